//! Edges of PROTOCOL.md (base and extensions) pinned as the server behaves today:
//! empty pull pages past either chain's bounds and a conversation pull without its id; the
//! logout of unknown and known users; who may dismiss a group and `member_count` after members leave; the exact
//! shapes of empty lists, unread counts and rooms; rooms over HTTP and a burst of room
//! sends; unknown query parameters; which conversations `GET /v1/unread` lists; and the
//! refusals of inverted time windows, zero limits and durations, too many mentions and an
//! `extra` over `--max-content-bytes`.

use crate::contract::{new_room, raw};
use crate::*;
use reqwest::Method;
use serde_json::json;

/// PROTOCOL.md 5.3: a pull answers `items` "in ascending order" and `has_more` "true when
/// the chain holds more after the last item, up to `to`". A range that is empty (`from`
/// past `to`, or past the newest seq) answers no items and `has_more:false`, on both chains;
/// `chain:"conversation"` without `conversation_id` is a frame whose fields are wrong
/// (PROTOCOL.md 5: `invalid_argument` "with its `req`"), and the connection stays.
#[tokio::test]
async fn pull_ranges_past_the_bounds_are_empty_and_a_conversation_pull_needs_its_id() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let tb = s.token(2).await;
    post_texts(&alice, "p", 2, 20, "x").await;
    let mut ws = s.ws(&tb, "b").await;
    assert_eq!(ws.hello["user_seq"], 20, "{}", ws.hello);

    let chains = [
        json!({"type": "pull", "chain": "user"}),
        json!({"type": "pull", "chain": "conversation", "conversation_id": "1-2"}),
    ];
    let mut req = 0;
    for chain in chains {
        let pull = |from: u64, to: Option<u64>| {
            let mut f = chain.clone();
            f["from"] = json!(from);
            if let Some(to) = to {
                f["to"] = json!(to);
            }
            f
        };
        // The chain holds 1..=20: the bounds below are its real ones.
        req += 1;
        let whole = request(&mut ws, pull(1, None), req).await;
        assert_eq!(item_seqs(&whole), (1..=20).collect::<Vec<u64>>(), "{chain}");
        assert_eq!(whole["has_more"], false, "{chain}");
        req += 1;
        let newest = request(&mut ws, pull(20, None), req).await;
        assert_eq!(item_seqs(&newest), vec![20], "{chain}");

        for (from, to) in [
            (10, Some(5)),
            (21, None),
            (21, Some(30)),
            (1000, Some(2000)),
        ] {
            req += 1;
            let r = request(&mut ws, pull(from, to), req).await;
            assert_eq!(
                r,
                json!({"type": "pull_result", "req": req, "items": [], "has_more": false}),
                "{chain} from {from} to {to:?}"
            );
        }
    }

    let e = request(
        &mut ws,
        json!({"type": "pull", "chain": "conversation", "from": 1}),
        77,
    )
    .await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str(), e["req"].as_i64()),
        (Some("error"), Some("invalid_argument"), Some(77)),
        "{e}"
    );
    assert!(e["message"].is_string(), "{e}");
    let pong = request(&mut ws, json!({"type": "ping"}), 78).await;
    assert_eq!(pong["type"], "pong", "the connection stays: {pong}");
}

/// PROTOCOL.md 6: `POST /v1/admin/users/{id}/logout` "revokes tokens"; for a user that does
/// not exist, `not_found` | 404 | "no such ... user". PROTOCOL.md 6 (extension): such changes
/// answer `{}`.
#[tokio::test]
async fn logout_of_an_unknown_user_is_404_and_of_a_known_one_answers_an_empty_object() {
    let s = spawn_server().await;
    let (status, body) = raw(
        &s.admin,
        Method::POST,
        "/v1/admin/users/424242/logout",
        None,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    // (What a logout does to tokens and connections: basics.rs.)
    s.user(7).await;
    let (status, body) = raw(&s.admin, Method::POST, "/v1/admin/users/7/logout", None).await;
    assert_eq!((status, &body), (200, &json!({})));
}

/// PROTOCOL.md 6: `DELETE /v1/groups/{id}` is for the "owner"; 1: `forbidden` | 403 |
/// "authenticated but not allowed" (a member who lacks a right). An appointed admin is
/// refused and the chain does not move; the owner's dismissal then appends its command.
#[tokio::test]
async fn an_admin_who_is_not_the_owner_cannot_dismiss_the_group() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let bob = s.user(2).await;
    let _carol = s.user(3).await;
    let id = new_group(&alice, &[2, 3]).await;
    alice
        .put(&format!("/v1/groups/{id}/admins/2"), None)
        .await
        .expect("the owner appoints bob");
    let before = newest_seq(&alice, &id).await;

    let (status, body) = raw(&bob, Method::DELETE, &format!("/v1/groups/{id}"), None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );
    let group = alice.get(&format!("/v1/conversations/{id}")).await.unwrap();
    assert_eq!(group["seq"].as_u64(), Some(before), "{group}");
    assert_eq!(group["dismissed"], false, "{group}");

    let (status, body) = raw(&alice, Method::DELETE, &format!("/v1/groups/{id}"), None).await;
    assert_eq!((status, &body), (200, &json!({})));
    assert_eq!(newest_seq(&alice, &id).await, before + 1);
}

/// PROTOCOL.md 6: a conversation carries `member_count` ("counts the owner"); a quit and a
/// kick each take one member off.
#[tokio::test]
async fn member_count_follows_a_quit_and_a_kick() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let _bob = s.user(2).await;
    let carol = s.user(3).await;
    let id = new_group(&alice, &[2, 3]).await;
    let count = || async {
        alice.get(&format!("/v1/conversations/{id}")).await.unwrap()["member_count"].as_u64()
    };
    assert_eq!(count().await, Some(3));

    let quit = carol
        .delete(&format!("/v1/groups/{id}/members/3"))
        .await
        .expect("carol quits");
    assert_eq!(quit, json!({}));
    assert_eq!(count().await, Some(2));

    let kick = alice
        .delete(&format!("/v1/groups/{id}/members/2"))
        .await
        .expect("the owner kicks bob");
    assert_eq!(kick, json!({}));
    assert_eq!(count().await, Some(1));
}

/// The empty answers, whole: PROTOCOL.md 6's `{"conversations":[...],"next_cursor":C or
/// null}` and `{"total":N,"conversations":[...]}` of a user with no conversation, and 7's
/// `{"room_id","viewers":N,"recent":[...]}` of a room nobody watched.
#[tokio::test]
async fn a_fresh_users_lists_and_a_new_room_have_exact_empty_shapes() {
    let s = spawn_server().await;
    let fresh = s.user(5).await;
    assert_eq!(
        fresh.get("/v1/conversations").await.unwrap(),
        json!({"conversations": [], "next_cursor": null})
    );
    assert_eq!(
        fresh.get("/v1/unread").await.unwrap(),
        json!({"total": 0, "conversations": []})
    );
    let room = new_room(&s).await;
    assert_eq!(
        fresh.get(&format!("/v1/rooms/{room}")).await.unwrap(),
        json!({"room_id": room, "viewers": 0, "recent": []})
    );
}

/// PROTOCOL.md 7 over HTTP: `GET /v1/rooms/{id}` is for "any user" (a token is needed:
/// 401 without); `viewers` counts a connection until its socket closes; `DELETE
/// /v1/admin/rooms/{id}` "closes it", after which it is no room: a second close is 404.
#[tokio::test]
async fn rooms_over_http_need_a_token_count_viewers_down_and_close_once() {
    let s = spawn_server().await;
    let room = new_room(&s).await;
    let path = format!("/v1/rooms/{room}");
    let (status, body) = raw(&s.anon(), Method::GET, &path, None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("unauthorized")),
        "{body}"
    );

    let tv = s.token(1).await;
    let mut viewer = s.ws(&tv, "v").await;
    let ok = request(
        &mut viewer,
        json!({"type": "room_join", "room_id": room}),
        1,
    )
    .await;
    assert_eq!(ok, json!({"type": "ok", "req": 1}));
    assert_eq!(crate::rooms::viewers(&s, &room).await, 1);

    viewer.close().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let n = crate::rooms::viewers(&s, &room).await;
        if n == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "viewers still {n} after the socket closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let close = format!("/v1/admin/rooms/{room}");
    let (status, body) = raw(&s.admin, Method::DELETE, &close, None).await;
    assert_eq!((status, &body), (200, &json!({})));
    let (status, body) = raw(&s.admin, Method::DELETE, &close, None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
}

/// PROTOCOL.md 5 (extension): room frames with a `req` are answered `{"type":"ok","req":N}`,
/// and answers keep the order of the frames they answer. A burst of 300 `room_send`s (more
/// than one batch holds: the surplus is dropped, "the sender is never told") gets 300 `ok`s,
/// in order, and no `error`.
#[tokio::test]
async fn a_burst_of_300_room_sends_is_answered_ok_in_order() {
    let s = spawn_server().await;
    let room = new_room(&s).await;
    let tv = s.token(1).await;
    let mut ws = s.ws(&tv, "v").await;
    let ok = request(&mut ws, json!({"type": "room_join", "room_id": room}), 0).await;
    assert_eq!(ok, json!({"type": "ok", "req": 0}));

    const N: i64 = 300;
    let burst = (1..=N).map(|i| {
        json!({"type": "room_send", "room_id": room, "content": format!("m{i}"), "req": i})
            .to_string()
    });
    ws.send_burst(burst).await.unwrap();
    let mut answered = Vec::new();
    while answered.len() < N as usize {
        let f = ws.recv(WAIT).await.unwrap().unwrap_or_else(|| {
            panic!(
                "closed or silent after {} answers: {:?}",
                answered.len(),
                ws.closed_with
            )
        });
        match f["type"].as_str() {
            Some("room_msgs") => continue,
            Some("ok") => {
                assert_eq!(f, json!({"type": "ok", "req": f["req"]}), "{f}");
                answered.push(f["req"].as_i64().expect("an integer req"));
            }
            _ => panic!("not an ok answer: {f}"),
        }
    }
    assert_eq!(answered, (1..=N).collect::<Vec<i64>>());
}

/// PROTOCOL.md 1: "Unknown fields in requests are ignored", query parameters included: a
/// history page with `foo=1` is the page without it.
#[tokio::test]
async fn unknown_query_parameters_are_ignored() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let _bob = s.user(2).await;
    post_texts(&alice, "q", 2, 5, "x").await;
    let (status, page) = raw(
        &alice,
        Method::GET,
        "/v1/conversations/1-2/messages?foo=1&limit=2",
        None,
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page_seqs(&page), vec![4, 5], "{page}");
    assert_eq!(page["has_more"], true, "{page}");
}

/// PROTOCOL.md 6: `GET /v1/unread` answers `{"total":N,"conversations":[{...,"unread":n}]}`
/// where `unread` counts user content of others after `last_read_seq` ("command messages
/// ... never count"). The list holds only conversations with something unread: one read to
/// its end leaves it, and so does a group whose only news is a command message.
#[tokio::test]
async fn unread_lists_only_conversations_with_something_unread() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let bob = s.user(2).await;
    let carol = s.user(3).await;
    let _dave = s.user(4).await;
    post_texts(&alice, "a", 2, 3, "x").await;
    post_texts(&carol, "c", 2, 2, "x").await;
    // Bob's news in the group is its creation (read: PROTOCOL.md 6, extension) and an
    // invitation, a command message.
    let group = new_group(&alice, &[2, 3]).await;
    invite(&alice, &group, &[4]).await.expect("dave invited");
    let g = bob
        .get(&format!("/v1/conversations/{group}"))
        .await
        .unwrap();
    assert!(
        g["seq"].as_u64() > g["last_read_seq"].as_u64(),
        "the group has news for bob: {g}"
    );

    let unread = || async {
        let mut v = bob.get("/v1/unread").await.unwrap();
        if let Some(list) = v["conversations"].as_array_mut() {
            // The order is not part of the answer.
            list.sort_by_key(|c| c["conversation_id"].as_str().unwrap_or("").to_owned());
        }
        v
    };
    assert_eq!(
        unread().await,
        json!({"total": 5, "conversations": [
            {"conversation_id": "1-2", "unread": 3},
            {"conversation_id": "2-3", "unread": 2},
        ]})
    );

    let read = bob
        .post("/v1/conversations/1-2/read", &json!({"seq": 3}))
        .await
        .unwrap();
    assert_eq!(read, json!({"last_read_seq": 3}));
    assert_eq!(
        unread().await,
        json!({"total": 2, "conversations": [{"conversation_id": "2-3", "unread": 2}]})
    );

    bob.post("/v1/conversations/2-3/read", &json!({"seq": 2}))
        .await
        .unwrap();
    assert_eq!(unread().await, json!({"total": 0, "conversations": []}));
}

/// PROTOCOL.md 6: history's `from_time`, `to_time` are "inclusive": a window whose start is
/// after its end is `invalid_argument` (400); a window of one instant is a valid one.
#[tokio::test]
async fn history_with_from_time_after_to_time_is_invalid() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let _bob = s.user(2).await;
    post_texts(&alice, "t", 2, 2, "x").await;
    let base = "/v1/conversations/1-2/messages";
    let (status, body) = raw(
        &alice,
        Method::GET,
        &format!("{base}?from_time=2000&to_time=1000"),
        None,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("invalid_argument")),
        "{body}"
    );
    // Nothing was sent in 1970.
    let (status, body) = raw(
        &alice,
        Method::GET,
        &format!("{base}?from_time=1000&to_time=1000"),
        None,
    )
    .await;
    assert_eq!(
        (status, body),
        (200, json!({"messages": [], "has_more": false}))
    );
}

/// A zero where a count is asked for is `invalid_argument` (400): the list's `limit=0`,
/// and a mute of `duration_secs:0` (which appends no `member_muted`), while one second is
/// a mute.
#[tokio::test]
async fn a_zero_list_limit_and_a_zero_mute_duration_are_invalid() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let _bob = s.user(2).await;
    let (status, body) = raw(&alice, Method::GET, "/v1/conversations?limit=0", None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("invalid_argument")),
        "{body}"
    );

    let id = new_group(&alice, &[2]).await;
    let before = newest_seq(&alice, &id).await;
    let mutes = format!("/v1/groups/{id}/mutes");
    let (status, body) = raw(
        &alice,
        Method::POST,
        &mutes,
        Some(&json!({"user_id": 2, "duration_secs": 0})),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("invalid_argument")),
        "{body}"
    );
    assert_eq!(newest_seq(&alice, &id).await, before, "nothing appended");
    let (status, body) = raw(
        &alice,
        Method::POST,
        &mutes,
        Some(&json!({"user_id": 2, "duration_secs": 1})),
    )
    .await;
    assert_eq!((status, &body), (200, &json!({})));
    assert_eq!(newest_seq(&alice, &id).await, before + 1);
}

/// A send's limits (pigeon-core's rules): at most 100 `mentions` (101 is
/// `invalid_argument`), and an `extra` whose JSON text is longer than
/// `--max-content-bytes` is `payload_too_large` (PROTOCOL.md 1: "content or frame over the
/// configured limit"), one of exactly the limit is taken.
#[tokio::test]
async fn mentions_over_100_and_extra_over_max_content_bytes_are_refused() {
    const LIMIT: usize = 16;
    let s = spawn_with(|c| c.max_content_bytes = LIMIT).await;
    let alice = s.user(1).await;
    let _bob = s.user(2).await;
    let send = |cmid: &str, field: &str, value: Value| {
        let mut body = text_to_user(cmid, 2, "hi");
        body[field] = value;
        body
    };

    let (status, body) = raw(
        &alice,
        Method::POST,
        "/v1/messages",
        Some(&send(
            "m101",
            "mentions",
            json!((1..=101).collect::<Vec<u64>>()),
        )),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("invalid_argument")),
        "{body}"
    );
    let ack = alice
        .post(
            "/v1/messages",
            &send("m100", "mentions", json!((1..=100).collect::<Vec<u64>>())),
        )
        .await
        .expect("100 mentions are taken");
    assert_eq!(ack["seq"], 1, "{ack}");

    // `{"k":"` and `"}` are 8 bytes: an 8-byte value makes exactly the limit.
    let at_limit = json!({"k": "01234567"});
    assert_eq!(at_limit.to_string().len(), LIMIT);
    let ack = alice
        .post("/v1/messages", &send("e16", "extra", at_limit))
        .await
        .expect("an extra of exactly the limit is taken");
    assert_eq!(ack["seq"], 2, "{ack}");
    let (status, body) = raw(
        &alice,
        Method::POST,
        "/v1/messages",
        Some(&send("e17", "extra", json!({"k": "012345678"}))),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (413, Some("payload_too_large")),
        "{body}"
    );
    assert_eq!(
        newest_seq(&alice, "1-2").await,
        2,
        "the refused sends stored nothing"
    );
}

/// `--node-id` is the node number every message id carries (ten bits above its twelve
/// sequence bits), so that nodes handing out ids side by side never give the same one.
#[tokio::test]
async fn message_ids_carry_the_node_id() {
    let s = spawn_with(|c| c.node_id = 777).await;
    s.token(222).await;
    let alice = s.user(111).await;
    for i in 0..3 {
        let ack = alice
            .post(
                "/v1/messages",
                &text_to_user(&format!("node-{i}"), 222, "hi"),
            )
            .await
            .unwrap();
        let id: u64 = ack["msg_id"].as_str().unwrap().parse().unwrap();
        assert_eq!((id >> 12) & 1023, 777, "{id}");
    }
}

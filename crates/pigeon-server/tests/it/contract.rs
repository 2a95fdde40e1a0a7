//! Sentences of PROTOCOL.md (the base contract, and extensions where they fill a silence) pinned
//! one by one: defaults and caps, idempotency keys, versions, group mutes by an admin, reply
//! and mention fields, content limits, refusals to strangers, rooms, unknown fields, the
//! largest user id and readiness while draining.

use crate::*;
use reqwest::Method;
use serde_json::json;

/// Any call; answers the HTTP status and the JSON body, whatever the status.
pub(crate) async fn raw(
    h: &Http,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    h.raw(method, path, body).await.expect("an answer")
}

/// Sends `n` texts from `ws`'s user to `to` in one burst (client_msg_ids `{prefix}-{i}`)
/// and waits until every one is acknowledged.
async fn burst_to_user(ws: &mut WsConn, prefix: &str, to: u64, n: i64) {
    ws.send_burst(sends_to_user(prefix, to, n, 1))
        .await
        .unwrap();
    let barrier = 1_000_000;
    ws.send(&json!({"type": "ping", "req": barrier}))
        .await
        .unwrap();
    let (acked, pong) = acks_before(ws, barrier).await;
    assert_eq!(pong["type"], "pong", "{pong}");
    assert_eq!(acked, n, "every send of the burst is acknowledged");
}

/// A new live room's id.
pub(crate) async fn new_room(s: &TestServer) -> String {
    s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap()["room_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The next `room_msgs` batch on `ws`.
async fn room_batch(ws: &mut WsConn) -> Value {
    ws.recv_until(WAIT, |v| v["type"] == "room_msgs")
        .await
        .unwrap()
        .expect("a room_msgs batch")
}

/// Sends a frame without `req` and waits for a `ping` behind it: the frame is handled.
async fn send_then_barrier(ws: &mut WsConn, frame: Value, req: i64) {
    ws.send(&frame).await.unwrap();
    let pong = request(ws, json!({"type": "ping"}), req).await;
    assert_eq!(pong["type"], "pong", "{pong}");
}

/// The conversation ids of a list page, in page order.
fn conversation_ids(page: &Value) -> Vec<String> {
    page["conversations"]
        .as_array()
        .unwrap_or_else(|| panic!("a conversations array: {page}"))
        .iter()
        .map(|c| c["conversation_id"].as_str().unwrap().to_owned())
        .collect()
}

/// PROTOCOL.md 6: `GET /v1/conversations` takes `?limit=50&cursor=C` and answers
/// `{"conversations":[...],"next_cursor":C or null}`: without `limit`, 50 conversations
/// come back, and with more to come `next_cursor` is a cursor, whose page holds the rest.
/// "The list is ordered pinned first, then by newest activity".
#[tokio::test]
async fn the_conversation_list_pages_by_50_by_default() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    for peer in 2..=52u64 {
        s.admin
            .upsert_user(peer, &format!("user{peer}"))
            .await
            .unwrap();
    }
    for peer in 2..=52u64 {
        alice
            .post(
                "/v1/messages",
                &text_to_user(&format!("to-{peer}"), peer, "x"),
            )
            .await
            .unwrap();
    }
    let page = alice.get("/v1/conversations").await.unwrap();
    let newest_first: Vec<String> = (3..=52u64).rev().map(|p| format!("1-{p}")).collect();
    assert_eq!(conversation_ids(&page), newest_first, "{page}");
    let cursor = page["next_cursor"]
        .as_str()
        .unwrap_or_else(|| panic!("a string next_cursor with one chat left: {page}"));
    assert!(!cursor.is_empty());
    let rest = alice
        .get(&format!("/v1/conversations?cursor={cursor}"))
        .await
        .unwrap();
    assert_eq!(conversation_ids(&rest), vec!["1-2".to_owned()], "{rest}");
    assert!(rest["next_cursor"].is_null(), "the last page: {rest}");
}

/// PROTOCOL.md 6: `GET /v1/sync` takes `?user_seq=N&limit=100`, and pulls' `limit`
/// "defaults to 100 and is capped at 200" (5.3). PROTOCOL.md 6 (extension): `has_more` is
/// "true when `limit` cut `items` short", and `user_seq` is "the inbox's newest ... or, when
/// `has_more`, the last item's `seq`".
#[tokio::test]
async fn http_sync_defaults_to_100_items_and_caps_at_200() {
    let s = spawn_server().await;
    let ta = s.token(1).await;
    let bob = s.user(2).await;
    let mut a = s.ws(&ta, "a").await;
    burst_to_user(&mut a, "first", 2, 150).await;

    let page = bob.get("/v1/sync?user_seq=0").await.unwrap();
    assert_eq!(item_seqs(&page), (1..=100).collect::<Vec<u64>>());
    assert_eq!(page["has_more"], true, "{}", page["has_more"]);
    assert_eq!(page["user_seq"], 100);
    let first = &page["items"][0]["message"];
    assert_eq!(
        (first["client_msg_id"].as_str(), first["sender"].as_u64()),
        (Some("first-0"), Some(1))
    );

    let page = bob.get("/v1/sync?user_seq=0&limit=500").await.unwrap();
    assert_eq!(item_seqs(&page), (1..=150).collect::<Vec<u64>>());
    assert_eq!(page["has_more"], false);
    assert_eq!(page["user_seq"], 150);

    // Past 200 items, a larger limit still gives 200.
    burst_to_user(&mut a, "second", 2, 60).await;
    let page = bob.get("/v1/sync?user_seq=0&limit=500").await.unwrap();
    assert_eq!(item_seqs(&page), (1..=200).collect::<Vec<u64>>());
    assert_eq!(page["has_more"], true);
    assert_eq!(page["user_seq"], 200);
    let page = bob.get("/v1/sync?user_seq=200&limit=500").await.unwrap();
    assert_eq!(item_seqs(&page), (201..=210).collect::<Vec<u64>>());
    assert_eq!(page["has_more"], false);
    assert_eq!(page["user_seq"], 210);
}

/// PROTOCOL.md 1: "`client_msg_id`: ... unique per sender. The pair (sender,
/// client_msg_id) identifies a send for idempotency": the same id from another sender is
/// another message, not a retry.
#[tokio::test]
async fn the_same_client_msg_id_from_two_senders_is_two_messages() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let first = alice
        .post("/v1/messages", &text_to_user("x", 222, "x"))
        .await
        .unwrap();
    assert_eq!(first["duplicate"], false);
    assert_eq!(first["seq"], 1);
    let second = bob
        .post("/v1/messages", &text_to_user("x", 111, "x"))
        .await
        .unwrap();
    assert_eq!(second["duplicate"], false, "{second}");
    assert_eq!(second["seq"], 2, "{second}");
    assert_eq!(second["conversation_id"], "111-222");
    assert_eq!(second["client_msg_id"], "x");
    assert!(second["msg_id"].is_string());
    assert_ne!(second["msg_id"], first["msg_id"]);
    let history = history_msgs(&alice, "111-222", "").await;
    let senders: Vec<(u64, &str)> = history
        .iter()
        .map(|m| (m["sender"].as_u64().unwrap(), m["msg_id"].as_str().unwrap()))
        .collect();
    assert_eq!(
        senders,
        vec![
            (111, first["msg_id"].as_str().unwrap()),
            (222, second["msg_id"].as_str().unwrap())
        ]
    );
}

/// PROTOCOL.md 6: `GET /v1/messages/{msg_id}/versions` answers
/// `{"versions":[{"version":1,"content":"...","at":ms},...]}`; its extension: "of a
/// never-edited message lists its one version".
#[tokio::test]
async fn a_never_edited_message_has_exactly_its_first_version() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let ack = alice
        .post("/v1/messages", &text_to_user("v1", 222, "hi"))
        .await
        .unwrap();
    let id = ack["msg_id"].as_str().unwrap();
    let created_at = at_seq(&bob, "111-222", 1).await["created_at"].clone();
    assert!(created_at.is_i64(), "{created_at}");
    assert_eq!(created_at, ack["created_at"]);
    for h in [&alice, &bob] {
        let v = h.get(&format!("/v1/messages/{id}/versions")).await.unwrap();
        assert_eq!(
            v["versions"],
            json!([{"version": 1, "content": "hi", "at": created_at}]),
            "{v}"
        );
    }
}

/// PROTOCOL.md 1, errors: `not_found` | 404 | "no such message, conversation, group or
/// user", for the admin's `GET /v1/admin/messages/{msg_id}` too.
#[tokio::test]
async fn the_admin_audit_of_an_unknown_message_is_404_not_found() {
    let s = spawn_server().await;
    let (status, body) = raw(
        &s.admin,
        Method::GET,
        "/v1/admin/messages/7301234567890123456",
        None,
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["code"], "not_found", "{body}");
    assert!(body["message"].is_string(), "{body}");
}

/// PROTOCOL.md 6: `POST /v1/groups/{id}/mutes` and `DELETE /v1/groups/{id}/mutes/{uid}` are
/// for "owner, admins"; `muted` | 403 | "the caller is muted in that group"; "Each change
/// appends its command message to the group's chain and so reaches every member".
#[tokio::test]
async fn an_appointed_admin_mutes_and_unmutes_a_member() {
    let s = spawn_server().await;
    let (ta, tb, tc) = (s.token(111).await, s.token(222).await, s.token(333).await);
    let alice = s.anon().with_bearer(ta.clone());
    let bob = s.anon().with_bearer(tb.clone());
    let carol = s.anon().with_bearer(tc.clone());
    let id = new_group(&alice, &[222, 333]).await;
    alice
        .put(&format!("/v1/groups/{id}/admins/222"), None)
        .await
        .expect("the owner appoints bob");
    let mut a = s.ws(&ta, "a").await;
    let mut b = s.ws(&tb, "b").await;
    let mut c = s.ws(&tc, "c").await;

    let (status, answer) = raw(
        &bob,
        Method::POST,
        &format!("/v1/groups/{id}/mutes"),
        Some(&json!({"user_id": 333, "duration_secs": 600})),
    )
    .await;
    assert_eq!((status, &answer), (200, &json!({})));
    let mut muted_id = None;
    for ws in [&mut a, &mut b, &mut c] {
        let m = ws
            .recv_until(WAIT, |v| {
                v["type"] == "msg" && v["message"]["kind"] == "member_muted"
            })
            .await
            .unwrap()
            .expect("member_muted reaches every member")["message"]
            .clone();
        assert_eq!(m["conversation_id"], id.as_str());
        assert_eq!(m["seq"], 2, "the command after group_created: {m}");
        assert_eq!(m["sender"], 222);
        assert_eq!(m["extra"]["from_user"], 222);
        assert_eq!(m["extra"]["to_user"], 333);
        let until = m["extra"]["until"].as_i64().expect("until in ms");
        let at = m["created_at"].as_i64().unwrap();
        assert!((at + 595_000..=at + 605_000).contains(&until), "{m}");
        match &muted_id {
            None => muted_id = Some(m["msg_id"].clone()),
            Some(first) => assert_eq!(&m["msg_id"], first),
        }
    }

    let (status, e) = raw(
        &carol,
        Method::POST,
        "/v1/messages",
        Some(&text_to_conv("c1", &id, "may I?")),
    )
    .await;
    assert_eq!((status, e["code"].as_str()), (403, Some("muted")), "{e}");
    assert_eq!(
        newest_seq(&alice, &id).await,
        2,
        "the refused send stored nothing"
    );

    let answer = bob
        .delete(&format!("/v1/groups/{id}/mutes/333"))
        .await
        .expect("the admin unmutes");
    assert_eq!(answer, json!({}));
    for ws in [&mut a, &mut b, &mut c] {
        let m = ws
            .recv_until(WAIT, |v| {
                v["type"] == "msg" && v["message"]["kind"] == "member_unmuted"
            })
            .await
            .unwrap()
            .expect("member_unmuted reaches every member")["message"]
            .clone();
        assert_eq!(m["seq"], 3);
        assert_eq!(m["sender"], 222);
        assert_eq!(m["extra"], json!({"from_user": 222, "to_user": 333}), "{m}");
    }
    let ack = carol
        .post("/v1/messages", &text_to_conv("c2", &id, "thanks"))
        .await
        .expect("carol speaks again");
    assert_eq!(
        (ack["seq"].as_u64(), ack["duplicate"].as_bool()),
        (Some(4), Some(false))
    );
    let m = next_msg(&mut a).await;
    assert_eq!(
        (
            m["message"]["sender"].as_u64(),
            m["message"]["content"].as_str()
        ),
        (Some(333), Some("thanks"))
    );
}

/// PROTOCOL.md 5.1: `{"type":"send",...,"content":"hi all","reply_to":"7301234567890123456",
/// "mentions":[333]}`; its extension: "A send's `reply_to` is kept as given (a
/// `msg_id` string)". The message object carries `"reply_to"` and `"mentions"` (section 1).
#[tokio::test]
async fn reply_to_and_mentions_round_trip() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let tb = s.token(222).await;
    let tc = s.token(333).await;
    let id = new_group(&alice, &[222, 333]).await;
    let question = alice
        .post("/v1/messages", &text_to_conv("q", &id, "who's in?"))
        .await
        .unwrap();
    let earlier = question["msg_id"].as_str().unwrap().to_owned();
    let mut b = s.ws(&tb, "b").await;
    let mut c = s.ws(&tc, "c").await;

    let mut frame = send_frame(text_to_conv("r", &id, "me, and @carol"));
    frame["reply_to"] = json!(earlier);
    frame["mentions"] = json!([333]);
    let ack = request(&mut b, frame, 1).await;
    assert_eq!(ack["type"], "send_ack", "{ack}");
    let msg_id = ack["msg_id"].as_str().unwrap().to_owned();

    let push = next_msg(&mut c).await;
    let pushed = &push["message"];
    assert_eq!(pushed["msg_id"], msg_id.as_str());
    assert_eq!(pushed["reply_to"], json!(earlier), "{pushed}");
    assert_eq!(pushed["mentions"], json!([333]), "{pushed}");

    let read = history_msgs(&alice, &id, "")
        .await
        .into_iter()
        .find(|m| m["msg_id"] == msg_id.as_str())
        .expect("the reply is in history");
    assert_eq!(read["reply_to"], json!(earlier), "{read}");
    assert_eq!(read["mentions"], json!([333]), "{read}");
    assert_eq!(read["content"], "me, and @carol");
}

/// PROTOCOL.md 2: `--max-content-bytes` ... "larger content gets `payload_too_large`"
/// (413), an edit's content included; content of exactly the limit is taken.
#[tokio::test]
async fn content_over_max_content_bytes_is_413_at_send_and_edit() {
    let s = spawn_with(|c| c.max_content_bytes = 10).await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let ack = alice
        .post("/v1/messages", &text_to_user("ten", 222, "0123456789"))
        .await
        .expect("exactly 10 bytes are taken");
    let id = ack["msg_id"].as_str().unwrap().to_owned();
    assert_eq!(at_seq(&bob, "111-222", 1).await["content"], "0123456789");

    // Bytes, not characters: "ééééé1" is 6 characters and 11 bytes.
    for over in ["0123456789a", "ééééé1"] {
        let (status, e) = raw(
            &alice,
            Method::PATCH,
            &format!("/v1/messages/{id}"),
            Some(&json!({"content": over})),
        )
        .await;
        assert_eq!(
            (status, e["code"].as_str()),
            (413, Some("payload_too_large")),
            "{over}: {e}"
        );
        let (status, e) = raw(
            &alice,
            Method::POST,
            "/v1/messages",
            Some(&text_to_user("eleven", 222, over)),
        )
        .await;
        assert_eq!(
            (status, e["code"].as_str()),
            (413, Some("payload_too_large")),
            "{over}: {e}"
        );
    }
    let m = at_seq(&bob, "111-222", 1).await;
    assert_eq!(
        (m["content"].as_str(), m["version"].as_u64()),
        (Some("0123456789"), Some(1))
    );
    assert_eq!(newest_seq(&bob, "111-222").await, 1, "nothing was appended");
    let edited = alice
        .patch(&format!("/v1/messages/{id}"), &json!({"content": "ééééé"}))
        .await
        .expect("an edit of exactly 10 bytes is taken");
    assert_eq!(
        (edited["content"].as_str(), edited["version"].as_u64()),
        (Some("ééééé"), Some(2))
    );
}

/// PROTOCOL.md 1: "A client never learns anything about a conversation it is not in:
/// reading or writing one, or any message of it, answers `not_member` (or `not_found`),
/// never its data." The server refuses a message outside the caller's conversations as it
/// refuses one that does not exist: 404 `not_found`.
#[tokio::test]
async fn a_stranger_editing_another_pairs_message_learns_nothing() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    let ack = alice
        .post(
            "/v1/messages",
            &text_to_user("secret", 222, "meet at the old mill"),
        )
        .await
        .unwrap();
    let id = ack["msg_id"].as_str().unwrap().to_owned();

    let (status, body) = raw(
        &carol,
        Method::PATCH,
        &format!("/v1/messages/{id}"),
        Some(&json!({"content": "hijacked"})),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    let text = body.to_string();
    for leak in ["meet at the old mill", "old mill", "111-222"] {
        assert!(!text.contains(leak), "{leak:?} leaked in {text}");
    }
    let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
    assert_eq!(keys, vec!["code", "message"], "{body}");
    // Just as for a message that does not exist.
    let (status_unknown, unknown) = raw(
        &carol,
        Method::PATCH,
        "/v1/messages/7301234567890123456",
        Some(&json!({"content": "hijacked"})),
    )
    .await;
    assert_eq!((status_unknown, &unknown), (status, &body));

    let m = at_seq(&bob, "111-222", 1).await;
    assert_eq!(
        (m["content"].as_str(), m["version"].as_u64()),
        (Some("meet at the old mill"), Some(1))
    );
    assert_eq!(newest_seq(&bob, "111-222").await, 1);
}

/// PROTOCOL.md 7: `{"type":"room_leave","room_id":"r1"}`; `GET /v1/rooms/{id}` gives
/// `{"room_id":"r1","viewers":N,...}`. After leaving, a connection gets no more of the room's
/// batches, and its `room_send` is refused (`not_member`, PROTOCOL.md 7, extension: "`room_send`
/// needs the connection to have joined that room").
#[tokio::test]
async fn room_leave_stops_the_batches_and_the_sends() {
    let s = spawn_server().await;
    let room = new_room(&s).await;
    let onlooker = s.user(3).await;
    let (ta, tb) = (s.token(1).await, s.token(2).await);
    let mut a = s.ws(&ta, "a").await;
    let mut b = s.ws(&tb, "b").await;
    for (ws, req) in [(&mut a, 1), (&mut b, 1)] {
        let ok = request(ws, json!({"type": "room_join", "room_id": room}), req).await;
        assert_eq!(ok["type"], "ok", "{ok}");
    }
    assert_eq!(crate::rooms::viewers(&s, &room).await, 2);

    // Both get a message sent while both watch.
    send_then_barrier(
        &mut a,
        json!({"type": "room_send", "room_id": room, "content": "before"}),
        2,
    )
    .await;
    for ws in [&mut a, &mut b] {
        let batch = room_batch(ws).await;
        assert_eq!(batch["messages"][0]["content"], "before", "{batch}");
    }

    let ok = request(&mut b, json!({"type": "room_leave", "room_id": room}), 3).await;
    assert_eq!(ok["type"], "ok", "{ok}");
    assert_eq!(crate::rooms::viewers(&s, &room).await, 1);

    send_then_barrier(
        &mut a,
        json!({"type": "room_send", "room_id": room, "content": "after"}),
        4,
    )
    .await;
    let batch = room_batch(&mut a).await;
    assert_eq!(batch["messages"][0]["content"], "after", "{batch}");
    // The batch went out to the room's viewers at once; b, gone, got none of it.
    let late = b
        .recv_until(Duration::from_millis(400), |v| v["type"] == "room_msgs")
        .await
        .unwrap();
    assert!(late.is_none(), "a batch after room_leave: {late:?}");

    let e = request(
        &mut b,
        json!({"type": "room_send", "room_id": room, "content": "still here?"}),
        5,
    )
    .await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("not_member")),
        "{e}"
    );
    let recent = onlooker.get(&format!("/v1/rooms/{room}")).await.unwrap()["recent"].clone();
    let contents: Vec<&str> = recent
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        contents,
        vec!["before", "after"],
        "the refused send was not taken"
    );
}

/// PROTOCOL.md 7: `GET /v1/rooms/{id}` gives `"recent":[{"sender","content","at"},...]`,
/// "the most recent messages": `sender` a user id (integer), `content` a string, `at` a time
/// in integer milliseconds (section 1), oldest first.
#[tokio::test]
async fn room_recent_items_are_sender_content_at_oldest_first() {
    let s = spawn_server().await;
    let room = new_room(&s).await;
    let onlooker = s.user(3).await;
    let (ta, tb) = (s.token(1).await, s.token(2).await);
    let mut a = s.ws(&ta, "a").await;
    let mut b = s.ws(&tb, "b").await;
    for ws in [&mut a, &mut b] {
        let ok = request(ws, json!({"type": "room_join", "room_id": room}), 1).await;
        assert_eq!(ok["type"], "ok", "{ok}");
    }
    let before = clock_ms();
    // Each send is handled before the next one is written.
    send_then_barrier(
        &mut a,
        json!({"type": "room_send", "room_id": room, "content": "one"}),
        2,
    )
    .await;
    send_then_barrier(
        &mut b,
        json!({"type": "room_send", "room_id": room, "content": "two"}),
        2,
    )
    .await;
    send_then_barrier(
        &mut a,
        json!({"type": "room_send", "room_id": room, "content": "three"}),
        3,
    )
    .await;
    let after = clock_ms();

    let info = onlooker.get(&format!("/v1/rooms/{room}")).await.unwrap();
    assert_eq!(info["room_id"], room.as_str());
    let recent = info["recent"].as_array().expect("recent is an array");
    let mut got = Vec::new();
    let mut last_at = i64::MIN;
    for m in recent {
        let mut keys: Vec<&String> = m.as_object().expect("an object").keys().collect();
        keys.sort();
        assert_eq!(keys, vec!["at", "content", "sender"], "{m}");
        let sender = m["sender"].as_u64().expect("an integer sender");
        let content = m["content"].as_str().expect("a string content");
        let at = m["at"].as_i64().expect("an integer at");
        assert!(
            (before - 1000..=after + 1000).contains(&at),
            "at {at} is ms: {m}"
        );
        assert!(at >= last_at, "oldest first: {info}");
        last_at = at;
        got.push((sender, content));
    }
    assert_eq!(got, vec![(1, "one"), (2, "two"), (1, "three")], "{info}");
}

/// PROTOCOL.md 1: "Unknown fields in requests are ignored", in a WebSocket `send` too: it
/// gets its `send_ack`.
#[tokio::test]
async fn a_send_frame_with_an_unknown_field_is_acked() {
    let s = spawn_server().await;
    let ta = s.token(111).await;
    let bob = s.user(222).await;
    let mut a = s.ws(&ta, "a").await;
    let mut frame = send_frame(text_to_user("unknown-field", 222, "hi"));
    frame["foo"] = json!(1);
    let ack = request(&mut a, frame, 7).await;
    assert_eq!(ack["type"], "send_ack", "{ack}");
    assert_eq!(ack["req"], 7);
    assert_eq!(ack["client_msg_id"], "unknown-field");
    assert_eq!(ack["conversation_id"], "111-222");
    assert_eq!(ack["seq"], 1);
    assert_eq!(ack["duplicate"], false);
    let m = at_seq(&bob, "111-222", 1).await;
    assert_eq!(m["content"], "hi");
    assert_eq!(m["msg_id"], ack["msg_id"]);
}

/// PROTOCOL.md 1: "`user_id`: integer, 1 ..= 2^53-1 (safe in JavaScript)": the largest one
/// is registered, authenticated and said back exactly.
#[tokio::test]
async fn the_largest_user_id_is_accepted_and_said_back_exactly() {
    const MAX_ID: u64 = 9_007_199_254_740_991; // 2^53 - 1
    let s = spawn_server().await;
    let token = s.token(MAX_ID).await;
    let mut ws = s.ws(&token, "max").await;
    assert_eq!(ws.hello["user_id"], json!(MAX_ID), "{}", ws.hello);
    assert_eq!(ws.hello["user_id"].as_u64(), Some(MAX_ID));

    let peer = s.user(7).await;
    let ack = request(&mut ws, send_frame(text_to_user("big", 7, "hi")), 1).await;
    assert_eq!(ack["type"], "send_ack", "{ack}");
    assert_eq!(ack["conversation_id"], "7-9007199254740991");
    let m = at_seq(&peer, "7-9007199254740991", 1).await;
    assert_eq!(m["sender"].as_u64(), Some(MAX_ID), "{m}");
    let c = peer
        .get("/v1/conversations/7-9007199254740991")
        .await
        .unwrap();
    assert_eq!(c["peer"].as_u64(), Some(MAX_ID), "{c}");
}

/// PROTOCOL.md 2: "`GET /readyz` answers 200 when it can serve ..., 503 otherwise", and
/// a draining server cannot serve (new connections are refused), while `GET /healthz`
/// "answers 200 when the process is up". The drain is begun through the server's own flag
/// (what `Running::shutdown` sets first), with the listener still open.
#[tokio::test]
async fn readyz_answers_503_while_draining() {
    let s = spawn_server().await;
    let anon = s.anon();
    assert_eq!(raw(&anon, Method::GET, "/readyz", None).await.0, 200);
    s.running
        .as_ref()
        .expect("running")
        .app
        .draining
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, body) = raw(&anon, Method::GET, "/readyz", None).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(raw(&anon, Method::GET, "/healthz", None).await.0, 200);
}

/// The test machine's clock, in milliseconds since the Unix epoch.
fn clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

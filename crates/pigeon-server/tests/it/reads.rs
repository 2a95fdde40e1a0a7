//! Read marks, receipts, typing (PROTOCOL.md 5.4), unread counts and the conversation list
//! with its settings (section 6).

use crate::*;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};

async fn read(h: &Http, conv: &str, seq: u64) -> u64 {
    h.post(
        &format!("/v1/conversations/{conv}/read"),
        &json!({"seq": seq}),
    )
    .await
    .expect("read")["last_read_seq"]
        .as_u64()
        .expect("last_read_seq")
}

async fn conv(h: &Http, id: &str) -> Value {
    h.get(&format!("/v1/conversations/{id}"))
        .await
        .expect("conversation")
}

async fn settings(h: &Http, id: &str, body: Value) -> Value {
    h.put(&format!("/v1/conversations/{id}/settings"), Some(&body))
        .await
        .expect("settings")
}

/// The ids of the caller's conversation list, in order.
pub async fn listed(h: &Http) -> Vec<String> {
    let list = h.get("/v1/conversations").await.expect("list");
    list["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["conversation_id"].as_str().unwrap().to_owned())
        .collect()
}

/// `GET /v1/unread` as (total, per conversation; missing ones are 0).
async fn unread(h: &Http) -> (u64, HashMap<String, u64>) {
    let u = h.get("/v1/unread").await.expect("unread");
    let per = u["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["conversation_id"].as_str().unwrap().to_owned(),
                c["unread"].as_u64().unwrap(),
            )
        })
        .collect();
    (u["total"].as_u64().unwrap(), per)
}

async fn receipt(ws: &mut WsConn, conv: &str, user: u64, seq: u64) -> Value {
    ws.recv_until(WAIT, |v| {
        v["type"] == "receipt"
            && v["conversation_id"] == conv
            && v["user_id"] == user
            && v["last_read_seq"] == seq
    })
    .await
    .expect("recv")
    .unwrap_or_else(|| panic!("no receipt of {user} up to {seq} in {conv}"))
}

async fn no_frame_of(ws: &mut WsConn, ty: &str, wait_ms: u64) {
    let got = ws
        .recv_until(Duration::from_millis(wait_ms), |v| v["type"] == ty)
        .await
        .expect("recv");
    assert!(got.is_none(), "unexpected {ty}: {got:?}");
}

fn sorted_ids(v: &Value) -> Vec<u64> {
    let mut out: Vec<u64> = v
        .as_array()
        .unwrap_or_else(|| panic!("an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    out.sort();
    out
}

async fn send_n(h: &Http, to: u64, prefix: &str, n: usize) {
    for i in 0..n {
        h.post(
            "/v1/messages",
            &text_to_user(&format!("{prefix}{i}"), to, &format!("{prefix} {i}")),
        )
        .await
        .expect("send");
    }
}

#[tokio::test]
async fn read_marks_only_move_forward_and_stop_at_the_newest() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let tb = s.token(222).await;
    let bob = s.anon().with_bearer(tb.clone());
    send_n(&alice, 222, "m", 5).await;
    let c = conv(&bob, "111-222").await;
    assert_eq!(
        (c["unread"].as_u64(), c["last_read_seq"].as_u64()),
        (Some(5), Some(0))
    );

    assert_eq!(read(&bob, "111-222", 3).await, 3);
    let c = conv(&bob, "111-222").await;
    assert_eq!(
        (c["unread"].as_u64(), c["last_read_seq"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(read(&bob, "111-222", 2).await, 3, "never moves back");
    assert_eq!(conv(&bob, "111-222").await["last_read_seq"], 3);
    assert_eq!(read(&bob, "111-222", 99).await, 5, "never past the newest");
    let c = conv(&bob, "111-222").await;
    assert_eq!(
        (c["unread"].as_u64(), c["last_read_seq"].as_u64()),
        (Some(0), Some(5))
    );

    // The same over the WebSocket.
    send_n(&alice, 222, "n", 3).await;
    // A read frame has no reply: the receipt on bob's other device says it is done.
    let mut b = s.ws(&tb, "b").await;
    let mut b2 = s.ws(&tb, "b2").await;
    b.send(&json!({"type": "read", "conversation_id": "111-222", "seq": 7}))
        .await
        .unwrap();
    receipt(&mut b2, "111-222", 222, 7).await;
    let c = conv(&bob, "111-222").await;
    assert_eq!(
        (c["unread"].as_u64(), c["last_read_seq"].as_u64()),
        (Some(1), Some(7))
    );
    b.send(&json!({"type": "read", "conversation_id": "111-222", "seq": 4}))
        .await
        .unwrap();
    b.send(&json!({"type": "read", "conversation_id": "111-222", "seq": 1000}))
        .await
        .unwrap();
    receipt(&mut b2, "111-222", 222, 8).await;
    let c = conv(&bob, "111-222").await;
    assert_eq!(
        (c["unread"].as_u64(), c["last_read_seq"].as_u64()),
        (Some(0), Some(8))
    );
    assert_eq!(read(&bob, "111-222", 6).await, 8);
    // Not a member: no read mark anywhere.
    let carol = s.user(333).await;
    assert_eq!(
        code_of(
            carol
                .post("/v1/conversations/111-222/read", &json!({"seq": 1}))
                .await
        ),
        "not_member"
    );
}

#[tokio::test]
async fn receipts_reach_the_peer_and_the_readers_other_devices() {
    let s = spawn_server().await;
    let (ta, tb) = (s.token(111).await, s.token(222).await);
    let alice = s.anon().with_bearer(ta.clone());
    let bob = s.anon().with_bearer(tb.clone());
    send_n(&alice, 222, "m", 4).await;
    let mut a = s.ws(&ta, "a-phone").await;
    let mut b1 = s.ws(&tb, "b-phone").await;
    let mut b2 = s.ws(&tb, "b-laptop").await;

    // Over the WebSocket: the peer and the reader's other devices hear of it.
    b1.send(&json!({"type": "read", "conversation_id": "111-222", "seq": 2}))
        .await
        .unwrap();
    for ws in [&mut a, &mut b2] {
        let r = receipt(ws, "111-222", 222, 2).await;
        assert_eq!(r["type"], "receipt");
    }
    // Over HTTP: every device of the reader, too.
    assert_eq!(read(&bob, "111-222", 3).await, 3);
    for ws in [&mut a, &mut b1, &mut b2] {
        receipt(ws, "111-222", 222, 3).await;
    }
    // A receipt names the reader: alice reading bob's answer shows up on bob's devices.
    bob.post("/v1/messages", &text_to_user("b1", 111, "answer"))
        .await
        .unwrap();
    assert_eq!(read(&alice, "111-222", 5).await, 5);
    for ws in [&mut b1, &mut b2] {
        receipt(ws, "111-222", 111, 5).await;
    }
    // A read that moves nothing never announces an older position.
    assert_eq!(read(&bob, "111-222", 1).await, 5);
    let stray = a
        .recv_until(Duration::from_millis(300), |v| {
            v["type"] == "receipt"
                && v["user_id"] == 222
                && v["last_read_seq"].as_u64().unwrap_or(0) < 5
        })
        .await
        .unwrap();
    assert!(stray.is_none(), "{stray:?}");
}

/// PROTOCOL.md 5.4: the server "may coalesce these, at most a few per second per
/// conversation". A client that marks each message read as it shows it (30 reads at once)
/// costs its peer a few receipts: the first at once, then the newest each flush, never an
/// older position after a newer one, and the last read always arrives.
#[tokio::test]
async fn a_burst_of_reads_reaches_the_peer_as_a_few_receipts_ending_at_the_newest() {
    let s = spawn_server().await;
    let (ta, tb) = (s.token(111).await, s.token(222).await);
    let alice = s.anon().with_bearer(ta.clone());
    send_n(&alice, 222, "m", 30).await;
    let mut a = s.ws(&ta, "a-phone").await;
    let mut b = s.ws(&tb, "b-phone").await;
    let started = std::time::Instant::now();
    for seq in 1..=30 {
        b.send(&json!({"type": "read", "conversation_id": "111-222", "seq": seq}))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    while seen.last() != Some(&30) {
        let r = a
            .recv_until(WAIT, |v| v["type"] == "receipt")
            .await
            .unwrap()
            .expect("a receipt up to the last read");
        seen.push(r["last_read_seq"].as_u64().unwrap());
    }
    let took = started.elapsed();
    assert_eq!(seen[0], 1, "the first goes at once: {seen:?}");
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    // Reads committed over up to a few flushes (250 ms each) on a busy machine: a receipt
    // per flush at most, plus the first.
    let flushes = took.as_millis() / 250 + 2;
    assert!(
        seen.len() as u128 <= flushes && seen.len() < 30,
        "{} receipts in {took:?}: {seen:?}",
        seen.len()
    );
    let stray = a
        .recv_until(Duration::from_millis(600), |v| v["type"] == "receipt")
        .await
        .unwrap();
    assert!(stray.is_none(), "nothing after the newest: {stray:?}");
}

#[tokio::test]
async fn receipts_list_who_read_a_message() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    let td = s.token(444).await;
    let id = new_group_named(&alice, "g", &[222, 333, 444]).await;
    let ack = alice
        .post(
            "/v1/messages",
            &text_to_conv("a1", &id, "did you read this?"),
        )
        .await
        .unwrap();
    let seq = ack["seq"].as_u64().unwrap();
    let mut d = s.ws(&td, "d").await;
    let path = format!("/v1/conversations/{id}/receipts?seq={seq}");
    let r = alice.get(&path).await.unwrap();
    assert_eq!(sorted_ids(&r["read"]), Vec::<u64>::new());
    assert_eq!(sorted_ids(&r["unread"]), vec![222, 333, 444]);

    read(&bob, &id, seq).await;
    // Carol's mark is the group's creation (seq 1, where every initial member starts): a
    // read up to it moves nothing and tells nobody.
    read(&carol, &id, seq - 1).await;
    // Every other member of the group hears of each read that moved a mark.
    receipt(&mut d, &id, 222, seq).await;
    let r = carol.get(&path).await.unwrap();
    assert_eq!(sorted_ids(&r["read"]), vec![222]);
    assert_eq!(sorted_ids(&r["unread"]), vec![333, 444]);

    // A later message read by carol covers this one too; bob's own message excludes bob.
    let ack = bob
        .post("/v1/messages", &text_to_conv("b1", &id, "yes"))
        .await
        .unwrap();
    let later = ack["seq"].as_u64().unwrap();
    read(&carol, &id, later).await;
    let r = alice.get(&path).await.unwrap();
    assert_eq!(sorted_ids(&r["read"]), vec![222, 333]);
    assert_eq!(sorted_ids(&r["unread"]), vec![444]);
    let r = alice
        .get(&format!("/v1/conversations/{id}/receipts?seq={later}"))
        .await
        .unwrap();
    // Alice sent at seq 2 and has read nothing since: bob's message is unread for her.
    assert_eq!(sorted_ids(&r["read"]), vec![333]);
    assert_eq!(sorted_ids(&r["unread"]), vec![111, 444]);

    let stranger = s.user(555).await;
    let code = code_of(stranger.get(&path).await);
    assert!(code == "not_member" || code == "not_found", "{code}");
}

#[tokio::test]
async fn unread_counts_only_normal_user_content_from_others() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    let id = new_group_named(&alice, "g", &[222, 333]).await;
    // The group_created command does not count.
    assert_eq!(conv(&bob, &id).await["unread"], 0);

    let send = |h: Http, cmid: &'static str, kind: &'static str| {
        let id = id.clone();
        async move {
            let ack = h
                .post(
                    "/v1/messages",
                    &json!({"client_msg_id": cmid, "to": {"conversation": id}, "kind": kind, "content": "x"}),
                )
                .await
                .unwrap();
            ack["msg_id"].as_str().unwrap().to_owned()
        }
    };
    send(alice.clone(), "a1", "text").await;
    send(alice.clone(), "a2", "image").await;
    send(alice.clone(), "a3", "custom").await;
    send(bob.clone(), "b1", "file").await;
    // Commands: an update and a mute/unmute.
    alice
        .patch(&format!("/v1/groups/{id}"), &json!({"name": "renamed"}))
        .await
        .unwrap();
    let recalled = send(alice.clone(), "a4", "text").await;
    alice
        .post(&format!("/v1/messages/{recalled}/recall"), &json!({}))
        .await
        .unwrap();
    let edited = send(alice.clone(), "a5", "text").await;
    alice
        .patch(&format!("/v1/messages/{edited}"), &json!({"content": "y"}))
        .await
        .unwrap();
    let hidden = send(alice.clone(), "a6", "voice").await;
    carol
        .delete(&format!("/v1/messages/{hidden}"))
        .await
        .unwrap();
    let deleted = send(alice.clone(), "a7", "video").await;
    s.admin
        .delete(&format!("/v1/admin/messages/{deleted}"))
        .await
        .unwrap();

    // Carol: a1 a2 a3 b1 a5 (edited, still normal); not the commands, a4 (recalled), a6
    // (hidden for her), a7 (deleted).
    let c = conv(&carol, &id).await;
    assert_eq!(c["unread"], 5, "{c}");
    let (total, per) = unread(&carol).await;
    assert_eq!((total, per.get(&id).copied()), (5, Some(5)));
    // Bob: sending b1 read everything up to it; after it, a5 and a6 (a6 is hidden only for
    // carol).
    let c = conv(&bob, &id).await;
    assert_eq!(c["last_read_seq"], 5);
    assert_eq!(c["unread"], 2, "{c}");
    assert_eq!(unread(&bob).await.0, 2);
    // Alice sent the newest message: nothing counts for her.
    let c = conv(&alice, &id).await;
    assert_eq!(c["unread"], 0, "{c}");
    let (total, _) = unread(&alice).await;
    assert_eq!(total, 0);
    // The list shows the same numbers.
    let list = carol.get("/v1/conversations").await.unwrap();
    let entry = list["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["conversation_id"] == id.as_str())
        .cloned()
        .unwrap();
    assert_eq!(entry["unread"], 5);
}

#[tokio::test]
async fn total_unread_leaves_out_muted_conversations() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    send_n(&alice, 222, "a", 2).await;
    send_n(&carol, 222, "c", 3).await;
    let (total, per) = unread(&bob).await;
    assert_eq!(total, 5);
    assert_eq!(per.get("111-222"), Some(&2));
    assert_eq!(per.get("222-333"), Some(&3));

    let c = settings(&bob, "111-222", json!({"muted": true})).await;
    assert_eq!(c["muted"], true);
    assert_eq!(c["pinned"], false);
    let (total, per) = unread(&bob).await;
    assert_eq!(total, 3, "the muted conversation is left out of the total");
    assert_eq!(
        per.get("111-222").copied().unwrap_or(0),
        2,
        "its own count stays"
    );
    assert_eq!(conv(&bob, "111-222").await["unread"], 2);
    // Muting is the reader's: alice's total is unaffected.
    send_n(&bob, 111, "b", 1).await;
    assert_eq!(unread(&alice).await.0, 1);
    // Bob's send read 111-222 for him; unmuting brings the count back into the total.
    assert_eq!(unread(&bob).await.0, 3);
    send_n(&alice, 222, "a2-", 4).await;
    assert_eq!(unread(&bob).await.0, 3);
    let c = settings(&bob, "111-222", json!({"muted": false})).await;
    assert_eq!(c["muted"], false);
    assert_eq!(unread(&bob).await.0, 7);
}

#[tokio::test]
async fn pinned_conversations_come_first() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    for peer in [222u64, 333, 444] {
        let _ = s.user(peer).await;
        send_n(&alice, peer, &format!("p{peer}-"), 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(listed(&alice).await, vec!["111-444", "111-333", "111-222"]);
    let c = settings(&alice, "111-222", json!({"pinned": true})).await;
    assert_eq!(c["pinned"], true);
    assert_eq!(listed(&alice).await, vec!["111-222", "111-444", "111-333"]);
    tokio::time::sleep(Duration::from_millis(5)).await;
    let carol = s.user(333).await;
    send_n(&carol, 111, "back", 1).await;
    assert_eq!(
        listed(&alice).await,
        vec!["111-222", "111-333", "111-444"],
        "pinned first, then by newest activity"
    );
    // Pinning is per user: bob's list is unaffected by alice's pin.
    let list = alice.get("/v1/conversations").await.unwrap();
    let pinned: Vec<bool> = list["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["pinned"].as_bool().unwrap())
        .collect();
    assert_eq!(pinned, vec![true, false, false]);
    let bob = s.user(222).await;
    assert_eq!(conv(&bob, "111-222").await["pinned"], false);
    settings(&alice, "111-222", json!({"pinned": false})).await;
    assert_eq!(listed(&alice).await, vec!["111-333", "111-444", "111-222"]);
    // Pages follow the same order.
    let page = alice.get("/v1/conversations?limit=2").await.unwrap();
    let cursor = page["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let rest = alice
        .get(&format!("/v1/conversations?limit=2&cursor={cursor}"))
        .await
        .unwrap();
    let ids: Vec<&str> = rest["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["conversation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["111-222"]);
    assert!(rest["next_cursor"].is_null());
}

/// PROTOCOL.md 6: "The list is ordered pinned first, then by newest activity", among the
/// pinned conversations too: with two pinned and one not, a message in the older pinned one
/// moves it ahead of the other pinned one, never behind an unpinned one, and a message in
/// the unpinned one keeps it behind both. The pages of `?limit=1` agree with the list.
#[tokio::test]
async fn two_pinned_conversations_are_ordered_by_activity_ahead_of_the_rest() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    for peer in [222u64, 333, 444] {
        let _ = s.user(peer).await;
        send_n(&alice, peer, &format!("t{peer}-"), 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The two oldest are pinned (the older first, so either reading of "activity", message
    // or setting, gives the same order).
    settings(&alice, "111-222", json!({"pinned": true})).await;
    settings(&alice, "111-333", json!({"pinned": true})).await;
    assert_eq!(listed(&alice).await, vec!["111-333", "111-222", "111-444"]);
    tokio::time::sleep(Duration::from_millis(5)).await;
    let bob = s.user(222).await;
    send_n(&bob, 111, "pinned-again", 1).await;
    assert_eq!(
        listed(&alice).await,
        vec!["111-222", "111-333", "111-444"],
        "the older pinned one, now the newest, leads"
    );
    assert_eq!(
        walk_single_pages(&alice, 5).await,
        vec![
            ("111-222".to_owned(), true),
            ("111-333".to_owned(), true),
            ("111-444".to_owned(), false),
        ]
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    let dave = s.user(444).await;
    send_n(&dave, 111, "unpinned", 1).await;
    assert_eq!(
        listed(&alice).await,
        vec!["111-222", "111-333", "111-444"],
        "the newest activity of all, unpinned: still behind the pinned ones"
    );
}

#[tokio::test]
async fn hidden_conversations_return_with_a_new_message() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    send_n(&alice, 222, "b", 1).await;
    send_n(&alice, 333, "c", 1).await;
    assert_eq!(listed(&alice).await.len(), 2);
    settings(&alice, "111-333", json!({"hidden": true})).await;
    assert_eq!(listed(&alice).await, vec!["111-222"]);
    // Still readable directly; only the list leaves it out, and only for alice.
    assert_eq!(conv(&alice, "111-333").await["seq"], 1);
    assert_eq!(listed(&carol).await, vec!["111-333"]);
    // Other activity does not bring it back.
    send_n(&bob, 111, "x", 1).await;
    assert_eq!(listed(&alice).await, vec!["111-222"]);
    // A new message in it does.
    send_n(&carol, 111, "back", 1).await;
    let l = listed(&alice).await;
    assert_eq!(l, vec!["111-333", "111-222"]);
    let c = conv(&alice, "111-333").await;
    assert_eq!(c["unread"], 1);
    // Settings are only for members.
    let code = code_of(
        bob.put(
            "/v1/conversations/111-333/settings",
            Some(&json!({"hidden": true})),
        )
        .await,
    );
    assert!(code == "not_member" || code == "not_found", "{code}");
}

/// PROTOCOL.md 6: "`hidden` ones are left out until a new message arrives", whoever writes
/// it: the user's own send brings a hidden single chat back, and a command message (a group
/// change by another member) brings a hidden group back.
#[tokio::test]
async fn hidden_conversations_return_with_the_users_own_send_and_with_a_command() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _bob = s.user(222).await;
    let carol = s.user(333).await;
    send_n(&alice, 222, "own", 1).await;
    let g = new_group_named(&carol, "before", &[111]).await;
    assert_eq!(listed(&alice).await.len(), 2);
    settings(&alice, "111-222", json!({"hidden": true})).await;
    settings(&alice, &g, json!({"hidden": true})).await;
    assert_eq!(listed(&alice).await, Vec::<String>::new());
    send_n(&alice, 222, "own-again", 1).await;
    assert_eq!(
        listed(&alice).await,
        vec!["111-222"],
        "back with her own send"
    );
    carol
        .patch(&format!("/v1/groups/{g}"), &json!({"name": "after"}))
        .await
        .unwrap();
    assert_eq!(
        listed(&alice).await,
        vec![g.clone(), "111-222".to_owned()],
        "back with the group_updated command"
    );
}

/// PROTOCOL.md 6: `GET .../receipts` answers `{"read":[uids],"unread":[uids]}` "(the sender
/// excluded)", in a single chat too: the sender is in neither list, only the peer is, unread
/// until they read and read after.
#[tokio::test]
async fn receipts_in_a_single_chat_list_only_the_peer() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let ack = alice
        .post("/v1/messages", &text_to_user("r1", 222, "seen?"))
        .await
        .unwrap();
    let seq = ack["seq"].as_u64().unwrap();
    let path = format!("/v1/conversations/111-222/receipts?seq={seq}");
    for h in [&alice, &bob] {
        let r = h.get(&path).await.unwrap();
        assert_eq!(
            (sorted_ids(&r["read"]), sorted_ids(&r["unread"])),
            (vec![], vec![222]),
            "{r}"
        );
    }
    read(&bob, "111-222", seq).await;
    for h in [&alice, &bob] {
        let r = h.get(&path).await.unwrap();
        assert_eq!(
            (sorted_ids(&r["read"]), sorted_ids(&r["unread"])),
            (vec![222], vec![]),
            "{r}"
        );
    }
}

#[tokio::test]
async fn typing_is_relayed_to_the_other_members_only() {
    let s = spawn_server().await;
    let (ta, tb, tc) = (s.token(111).await, s.token(222).await, s.token(333).await);
    let alice = s.anon().with_bearer(ta.clone());
    let id = new_group_named(&alice, "g", &[222, 333]).await;
    let mut a1 = s.ws(&ta, "a1").await;
    let mut a2 = s.ws(&ta, "a2").await;
    let mut b = s.ws(&tb, "b").await;
    let mut c = s.ws(&tc, "c").await;

    a1.send(&json!({"type": "typing", "conversation_id": id}))
        .await
        .unwrap();
    for ws in [&mut b, &mut c] {
        let t = ws
            .recv_until(WAIT, |v| v["type"] == "typing")
            .await
            .unwrap()
            .expect("a typing frame");
        assert_eq!(t["conversation_id"], id.as_str());
        assert_eq!(t["user_id"], 111);
    }
    no_frame_of(&mut a1, "typing", 300).await;
    no_frame_of(&mut a2, "typing", 100).await;

    // In a single chat, only the peer.
    let _ = s.user(444).await;
    let td = s.token(444).await;
    let mut d = s.ws(&td, "d").await;
    alice
        .post("/v1/messages", &text_to_user("x", 444, "hi"))
        .await
        .unwrap();
    d.send(&json!({"type": "typing", "conversation_id": "111-444"}))
        .await
        .unwrap();
    let t = a2
        .recv_until(WAIT, |v| v["type"] == "typing")
        .await
        .unwrap()
        .expect("typing on alice's device");
    assert_eq!(t["conversation_id"], "111-444");
    assert_eq!(t["user_id"], 444);
    // A single chat's typing is relayed again 200 ms later (a group's once a second).
    tokio::time::sleep(Duration::from_millis(250)).await;
    d.send(&json!({"type": "typing", "conversation_id": "111-444"}))
        .await
        .unwrap();
    let again = a2
        .recv_until(WAIT, |v| v["type"] == "typing")
        .await
        .unwrap();
    assert!(again.is_some(), "the second typing frame is relayed too");
    no_frame_of(&mut b, "typing", 300).await;
    no_frame_of(&mut d, "typing", 100).await;
    // An outsider's typing reaches nobody.
    let te = s.token(555).await;
    let mut e = s.ws(&te, "e").await;
    e.send(&json!({"type": "typing", "conversation_id": id}))
        .await
        .unwrap();
    if let Some(err) = e
        .recv_until(Duration::from_millis(300), |v| v["type"] == "error")
        .await
        .unwrap()
    {
        assert!(
            err["code"] == "not_member" || err["code"] == "not_found",
            "{err}"
        );
    }
    no_frame_of(&mut b, "typing", 100).await;
    no_frame_of(&mut c, "typing", 100).await;
    // Nothing is stored.
    assert_eq!(conv(&alice, "111-444").await["seq"], 1);
}

/// A tiny deterministic generator (Knuth's MMIX LCG), so the test needs no new dependency.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[tokio::test]
async fn random_traffic_leaves_the_expected_unread_counts() {
    let s = spawn_server().await;
    let users: Vec<u64> = vec![101, 102, 103, 104];
    let mut http: HashMap<u64, Http> = HashMap::new();
    for u in &users {
        http.insert(*u, s.user(*u).await);
    }
    let gid = new_group_named(&http[&101], "all", &[102, 103, 104]).await;

    // The model: per conversation, the sender of each seq (None for command messages);
    // per (user, conversation), the read mark.
    let mut senders: BTreeMap<String, Vec<Option<u64>>> = BTreeMap::new();
    senders.insert(gid.clone(), vec![None]);
    let mut members: HashMap<String, Vec<u64>> = HashMap::new();
    members.insert(gid.clone(), users.clone());
    let mut marks: HashMap<(u64, String), u64> = HashMap::new();

    let mut rng = Lcg(0x5eed_1234_abcd_0042);
    for step in 0..80 {
        let who = users[rng.below(users.len() as u64) as usize];
        if rng.below(5) == 0 {
            // Read some conversation of `who` up to a random seq, sometimes past the newest.
            let mine: Vec<String> = senders
                .keys()
                .filter(|c| members[*c].contains(&who))
                .cloned()
                .collect();
            let c = &mine[rng.below(mine.len() as u64) as usize];
            let newest = senders[c].len() as u64;
            let target = rng.below(newest + 3);
            let got = read(&http[&who], c, target).await;
            let mark = marks.entry((who, c.clone())).or_insert(0);
            *mark = (*mark).max(target.min(newest));
            assert_eq!(
                got, *mark,
                "read mark of {who} in {c} after reading {target}"
            );
            continue;
        }
        let body = if rng.below(3) == 0 {
            text_to_conv(&format!("s{step}"), &gid, "to all")
        } else {
            let peers: Vec<u64> = users.iter().copied().filter(|u| *u != who).collect();
            let peer = peers[rng.below(peers.len() as u64) as usize];
            text_to_user(&format!("s{step}"), peer, "to one")
        };
        let ack = http[&who].post("/v1/messages", &body).await.unwrap();
        let c = ack["conversation_id"].as_str().unwrap().to_owned();
        let chain = senders.entry(c.clone()).or_insert_with(|| {
            let (lo, hi) = c.split_once('-').unwrap();
            members.insert(c.clone(), vec![lo.parse().unwrap(), hi.parse().unwrap()]);
            Vec::new()
        });
        chain.push(Some(who));
        let seq = chain.len() as u64;
        assert_eq!(ack["seq"], seq, "seqs follow the model in {c}");
        // Sending reads everything up to the new message.
        marks.insert((who, c), seq);
    }

    // One more round of reads so every user has a random mark everywhere.
    for u in &users {
        for (c, chain) in &senders {
            if !members[c].contains(u) || rng.below(2) == 0 {
                continue;
            }
            let target = rng.below(chain.len() as u64 + 1);
            let got = read(&http[u], c, target).await;
            let mark = marks.entry((*u, c.clone())).or_insert(0);
            *mark = (*mark).max(target);
            assert_eq!(got, *mark);
        }
    }

    let mut checked = 0;
    for u in &users {
        let mut expected_total = 0;
        let (total, per) = unread(&http[u]).await;
        let list = http[u].get("/v1/conversations?limit=200").await.unwrap();
        for (c, chain) in &senders {
            if !members[c].contains(u) {
                continue;
            }
            let mark = marks.get(&(*u, c.clone())).copied().unwrap_or(0);
            let expected = chain
                .iter()
                .enumerate()
                .filter(|(i, sender)| (*i as u64 + 1) > mark && sender.is_some_and(|s| s != *u))
                .count() as u64;
            expected_total += expected;
            let got = conv(&http[u], c).await;
            assert_eq!(got["last_read_seq"], mark, "{u} in {c}: {got}");
            assert_eq!(got["unread"], expected, "{u} in {c}: {got}");
            assert_eq!(
                per.get(c).copied().unwrap_or(0),
                expected,
                "/v1/unread of {u} in {c}"
            );
            let entry = list["conversations"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["conversation_id"] == c.as_str())
                .unwrap_or_else(|| panic!("{c} is in {u}'s list"));
            assert_eq!(entry["unread"], expected);
            checked += 1;
        }
        assert_eq!(total, expected_total, "total unread of {u}");
    }
    assert!(checked >= 6, "enough conversations took part: {checked}");
}

/// PROTOCOL.md 5.4: the server tells "the user's own other devices (all of them, when the
/// read came over HTTP)": a read sent over a WebSocket reaches the reader's other device
/// and the peer, but not the connection it came from.
#[tokio::test]
async fn the_device_that_sent_a_read_gets_no_receipt_of_it() {
    let s = spawn_server().await;
    let (ta, tb) = (s.token(111).await, s.token(222).await);
    let alice = s.anon().with_bearer(ta.clone());
    send_n(&alice, 222, "m", 3).await;
    let mut a = s.ws(&ta, "a-phone").await;
    let mut b1 = s.ws(&tb, "b-phone").await;
    let mut b2 = s.ws(&tb, "b-laptop").await;
    b1.send(&json!({"type": "read", "conversation_id": "111-222", "seq": 2}))
        .await
        .unwrap();
    receipt(&mut b2, "111-222", 222, 2).await;
    receipt(&mut a, "111-222", 222, 2).await;
    // Everything b1 is told up to the answer of a later ping: no receipt among it.
    b1.send(&json!({"type": "ping", "req": 7})).await.unwrap();
    loop {
        let v = b1
            .recv(WAIT)
            .await
            .unwrap()
            .expect("a frame before the pong");
        assert_ne!(v["type"], "receipt", "the reading device got {v}");
        if v["type"] == "pong" {
            break;
        }
    }
    no_frame_of(&mut b1, "receipt", 300).await;
    // The mark did move for the user.
    assert_eq!(
        conv(&s.anon().with_bearer(tb), "111-222").await["last_read_seq"],
        2
    );
}

/// PROTOCOL.md 1: a single chat's id "is derived, never allocated", so its two users type in
/// it before its first message as they may send to it: the typing is relayed, and no error
/// answers it. A chat whose peer was never registered is `not_found`; a chat of two other
/// users is not the typist's (`not_member`).
#[tokio::test]
async fn typing_in_a_single_chat_before_its_first_message_is_relayed() {
    let s = spawn_server().await;
    let (ta, tb, tc) = (s.token(111).await, s.token(222).await, s.token(333).await);
    let mut a = s.ws(&ta, "a").await;
    let mut b = s.ws(&tb, "b").await;
    let mut c = s.ws(&tc, "c").await;
    a.send(&json!({"type": "typing", "req": 1, "conversation_id": "111-222"}))
        .await
        .unwrap();
    let t = b
        .recv_until(WAIT, |v| v["type"] == "typing")
        .await
        .unwrap()
        .expect("typing relayed before any message");
    assert_eq!(t["conversation_id"], "111-222");
    assert_eq!(t["user_id"], 111);
    // It carried a `req`: answered `ok` (had it been refused, an error).
    let next = a.recv(WAIT).await.unwrap().expect("a frame");
    assert_eq!(next, json!({"type": "ok", "req": 1}));
    let e = request(
        &mut a,
        json!({"type": "typing", "conversation_id": "111-999999"}),
        3,
    )
    .await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("not_found")),
        "{e}"
    );
    // A third user is not in it: `not_member`, although it has no message yet (whether two
    // others have talked is not theirs to learn).
    let e = request(
        &mut c,
        json!({"type": "typing", "conversation_id": "111-222"}),
        4,
    )
    .await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("not_member")),
        "{e}"
    );
    no_frame_of(&mut b, "typing", 200).await;
    // Nothing was stored: the chat is still in nobody's list.
    assert!(listed(&s.anon().with_bearer(ta)).await.is_empty());
}

/// PROTOCOL.md 5 (extension): "a refused one answers an `error` frame with its `req`", every
/// time: only a relayed typing counts for the once-a-second limit, so an outsider's second
/// typing within the second is refused aloud too, not dropped.
#[tokio::test]
async fn a_refused_typing_frame_is_answered_every_time() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    let g = new_group(&alice, &[222]).await;
    let te = s.token(555).await;
    let mut e = s.ws(&te, "e").await;
    for req in [1, 2] {
        e.send(&json!({"type": "typing", "req": req, "conversation_id": g}))
            .await
            .unwrap();
    }
    e.send(&json!({"type": "ping", "req": 3})).await.unwrap();
    // Everything answered before the pong (frames are answered in order).
    let mut answers = Vec::new();
    loop {
        let f = e
            .recv(WAIT)
            .await
            .unwrap()
            .expect("a frame before the pong");
        if f["type"] == "pong" {
            break;
        }
        answers.push(json!({"type": f["type"], "code": f["code"], "req": f["req"]}));
    }
    assert_eq!(
        answers,
        vec![
            json!({"type": "error", "code": "not_member", "req": 1}),
            json!({"type": "error", "code": "not_member", "req": 2}),
        ]
    );
}

/// The conversation ids of every page of `GET /v1/conversations?limit=1`, walked by
/// `next_cursor` (at most `max_pages` pages), with each entry's `pinned`.
async fn walk_single_pages(h: &Http, max_pages: usize) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..max_pages {
        let path = match &cursor {
            Some(c) => format!("/v1/conversations?limit=1&cursor={c}"),
            None => "/v1/conversations?limit=1".to_owned(),
        };
        let page = h.get(&path).await.expect("list page");
        let convs = page["conversations"].as_array().unwrap();
        assert!(convs.len() <= 1, "limit=1 gives at most one: {page}");
        for c in convs {
            out.push((
                c["conversation_id"].as_str().unwrap().to_owned(),
                c["pinned"].as_bool().unwrap(),
            ));
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return out,
        }
    }
    panic!("the list did not end within {max_pages} pages: {out:?}");
}

/// PROTOCOL.md 6: "The list is ordered pinned first, then by newest activity" — across
/// pages too: walking `?limit=1` pages by `next_cursor` from the pinned (oldest)
/// conversation into the unpinned ones keeps that order, none repeated or missing, also
/// after new activity reorders the unpinned ones.
#[tokio::test]
async fn one_conversation_pages_keep_pinned_first_then_newest_activity() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    for peer in [222u64, 333, 444] {
        let _ = s.user(peer).await;
        send_n(&alice, peer, &format!("w{peer}-"), 1).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Pin the oldest.
    settings(&alice, "111-222", json!({"pinned": true})).await;
    let expected = vec![
        ("111-222".to_owned(), true),
        ("111-444".to_owned(), false),
        ("111-333".to_owned(), false),
    ];
    assert_eq!(walk_single_pages(&alice, 5).await, expected);
    // The full list agrees with the pages.
    assert_eq!(listed(&alice).await, vec!["111-222", "111-444", "111-333"]);

    // New activity in 111-333 moves it ahead of 111-444, still behind the pinned one.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let carol = s.user(333).await;
    send_n(&carol, 111, "again", 1).await;
    let expected = vec![
        ("111-222".to_owned(), true),
        ("111-333".to_owned(), false),
        ("111-444".to_owned(), false),
    ];
    assert_eq!(walk_single_pages(&alice, 5).await, expected);
}

//! Group management (PROTOCOL.md 6 Groups) and the command messages it writes (section 1):
//! every change is a message of the group's chain, pushed to every member and kept in history.

use crate::reads::listed;
use crate::*;
use serde_json::json;

/// Waits for the push of a message of `kind` in `conv`; answers the message object.
async fn pushed(ws: &mut WsConn, conv: &str, kind: &str) -> Value {
    let push = ws
        .recv_until(WAIT, |v| {
            v["type"] == "msg"
                && v["message"]["conversation_id"] == conv
                && v["message"]["kind"] == kind
        })
        .await
        .expect("recv")
        .unwrap_or_else(|| panic!("no {kind} push in {conv}"));
    push["message"].clone()
}

/// Every connection gets the same `kind` command message; answers it.
async fn command_reaches_all(conns: &mut [&mut WsConn], conv: &str, kind: &str) -> Value {
    let mut first: Option<Value> = None;
    for ws in conns.iter_mut() {
        let m = pushed(ws, conv, kind).await;
        match &first {
            None => first = Some(m),
            Some(f) => {
                assert_eq!(
                    m["msg_id"], f["msg_id"],
                    "the same message reaches everyone"
                );
                assert_eq!(m["seq"], f["seq"]);
            }
        }
    }
    first.expect("at least one connection")
}

/// Asserts no message of `conv` after `seq` is pushed to `ws` within 300 ms.
async fn no_push_after(ws: &mut WsConn, conv: &str, seq: u64) {
    let got = ws
        .recv_until(Duration::from_millis(300), |v| {
            v["type"] == "msg"
                && v["message"]["conversation_id"] == conv
                && v["message"]["seq"].as_u64().unwrap_or(0) > seq
        })
        .await
        .expect("recv");
    assert!(got.is_none(), "unexpected push after seq {seq}: {got:?}");
}

/// Asserts `h` reads nothing of `conv` after `seq`: either an empty page or `not_member`.
async fn reads_nothing_after(h: &Http, conv: &str, seq: u64) {
    match h
        .get(&format!("/v1/conversations/{conv}/messages?after={seq}"))
        .await
    {
        Ok(page) => assert_eq!(page["messages"], json!([]), "nothing after seq {seq}"),
        Err(e) => assert_eq!(e.code(), Some("not_member")),
    }
}

/// alice (111) and the group she created with bob (222) and carol (333), its seq 1.
struct Trio {
    alice: Http,
    bob: Http,
    carol: Http,
    /// The group's conversation id.
    id: String,
    /// The tokens of alice, bob and carol, in that order.
    tokens: [String; 3],
}

/// Registers alice, bob and carol and has alice create their group; no connection yet.
async fn trio(s: &TestServer) -> Trio {
    let (ta, tb, tc) = (s.token(111).await, s.token(222).await, s.token(333).await);
    let alice = s.anon().with_bearer(ta.clone());
    let bob = s.anon().with_bearer(tb.clone());
    let carol = s.anon().with_bearer(tc.clone());
    let id = new_group(&alice, &[222, 333]).await;
    Trio {
        alice,
        bob,
        carol,
        id,
        tokens: [ta, tb, tc],
    }
}

/// The roles of a trio's group as `trio` made it: alice owns it, bob and carol are members.
fn trio_roles() -> Vec<(u64, String)> {
    vec![
        (111, "owner".into()),
        (222, "member".into()),
        (333, "member".into()),
    ]
}

/// Connects one WebSocket per token, in order, as devices "a", "b" and "c".
async fn connect_abc(s: &TestServer, tokens: &[String; 3]) -> (WsConn, WsConn, WsConn) {
    let a = s.ws(&tokens[0], "a").await;
    let b = s.ws(&tokens[1], "b").await;
    let c = s.ws(&tokens[2], "c").await;
    (a, b, c)
}

/// The (user_id, role) pairs of the member list.
async fn roles(h: &Http, conv: &str) -> Vec<(u64, String)> {
    let list = h
        .get(&format!("/v1/groups/{conv}/members"))
        .await
        .expect("members");
    list["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["user_id"].as_u64().unwrap(),
                m["role"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn member(h: &Http, conv: &str, uid: u64) -> Value {
    let list = h
        .get(&format!("/v1/groups/{conv}/members?limit=1000"))
        .await
        .expect("members");
    list["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["user_id"] == uid)
        .cloned()
        .unwrap_or_else(|| panic!("{uid} is not listed: {list}"))
}

fn ids(v: &Value) -> Vec<u64> {
    let mut out: Vec<u64> = v
        .as_array()
        .unwrap_or_else(|| panic!("an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn any_member_invites_and_every_member_hears_of_it() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let (tb, tc) = (s.token(222).await, s.token(333).await);
    let bob = s.anon().with_bearer(tb.clone());
    let carol = s.anon().with_bearer(tc.clone());
    let id = new_group(&alice, &[222]).await;
    // Every initial member starts having read the group's newest seq, its creation (1).
    for h in [&alice, &bob] {
        let cv = h.get(&format!("/v1/conversations/{id}")).await.unwrap();
        assert_eq!(
            (
                cv["seq"].as_u64(),
                cv["last_read_seq"].as_u64(),
                cv["unread"].as_u64()
            ),
            (Some(1), Some(1), Some(0)),
            "{cv}"
        );
    }
    for i in 0..3 {
        alice
            .post(
                "/v1/messages",
                &text_to_conv(&format!("pre{i}"), &id, "before carol"),
            )
            .await
            .unwrap();
    }
    let ta = s.token(111).await;
    let mut a = s.ws(&ta, "a").await;
    let mut b = s.ws(&tb, "b").await;
    let mut c = s.ws(&tc, "c").await;

    // A plain member may invite.
    let conv = invite(&bob, &id, &[333]).await.unwrap();
    assert_eq!(conv["member_count"], 3);
    let cmd = command_reaches_all(&mut [&mut a, &mut b, &mut c], &id, "member_invited").await;
    assert_eq!(cmd["seq"], 5);
    assert_eq!(cmd["sender"], 222);
    assert_eq!(cmd["extra"]["from_user"], 222);
    assert_eq!(ids(&cmd["extra"]["to_users"]), vec![333]);
    assert_eq!(cmd["status"], "normal");
    // It is in everyone's history, at its seq.
    for h in [&alice, &bob, &carol] {
        let m = at_seq(h, &id, 5).await;
        assert_eq!(m["msg_id"], cmd["msg_id"]);
        assert_eq!(m["kind"], "member_invited");
    }

    // The newcomer has read everything there is and sees nothing from before they joined.
    let cv = carol.get(&format!("/v1/conversations/{id}")).await.unwrap();
    assert_eq!(cv["unread"], 0, "{cv}");
    let seen = history_msgs(&carol, &id, "?limit=100").await;
    assert!(
        seen.iter().all(|m| m["seq"].as_u64().unwrap() >= 5),
        "carol reads only from her invitation on: {seen:?}"
    );
    assert_eq!(seen.len(), 1);
    let before = history_msgs(&carol, &id, "?before=5").await;
    assert!(before.is_empty(), "{before:?}");
    let r = carol
        .get(&format!(
            "/v1/conversations/{id}/messages/range?from=1&to=4"
        ))
        .await;
    if let Ok(page) = r {
        assert_eq!(page["messages"], json!([]), "no message before joining");
    }
    let first = at_seq(&alice, &id, 2).await;
    let code = code_of(
        carol
            .get(&format!(
                "/v1/messages/{}/versions",
                first["msg_id"].as_str().unwrap()
            ))
            .await,
    );
    assert!(code == "not_found" || code == "not_member", "{code}");
    let u = carol.get("/v1/unread").await.unwrap();
    assert_eq!(u["total"], 0);

    // Already a member: conflict, and nothing is appended.
    assert_eq!(code_of(invite(&alice, &id, &[333]).await), "conflict");
    assert_eq!(newest_seq(&alice, &id).await, 5);
    // One already a member in the list refuses the whole invitation.
    let _erin = s.user(555).await;
    assert_eq!(code_of(invite(&alice, &id, &[555, 222]).await), "conflict");
    assert_eq!(newest_seq(&alice, &id).await, 5);
    // A user who was never registered is `not_found` ("no such ... user"), at invitation and
    // at creation, and nothing is appended.
    assert_eq!(code_of(invite(&alice, &id, &[98_765]).await), "not_found");
    assert_eq!(newest_seq(&alice, &id).await, 5);
    assert_eq!(
        code_of(
            alice
                .post(
                    "/v1/groups",
                    &json!({"name": "g", "members": [222, 98_765]})
                )
                .await
        ),
        "not_found"
    );
    assert_eq!(roles(&alice, &id).await, trio_roles());

    // The newcomer takes part like anyone else.
    let ack = carol
        .post("/v1/messages", &text_to_conv("c1", &id, "hi all"))
        .await
        .unwrap();
    assert_eq!(ack["seq"], 6);
    let m = pushed(&mut a, &id, "text").await;
    assert_eq!(
        (m["seq"].as_u64(), m["sender"].as_u64()),
        (Some(6), Some(333))
    );
    // A stranger cannot invite.
    let dave = s.user(444).await;
    let code = code_of(invite(&dave, &id, &[444]).await);
    assert!(code == "not_member" || code == "not_found", "{code}");
    // Joining, carol's read mark started at the group's newest seq (her invitation, 5).
    assert_eq!(cv["last_read_seq"], cv["seq"], "{cv}");
}

#[tokio::test]
async fn a_kicked_member_gets_the_kick_last_and_nothing_after() {
    let s = spawn_server().await;
    let Trio {
        alice,
        bob,
        carol,
        id,
        tokens,
    } = trio(&s).await;
    alice
        .post("/v1/messages", &text_to_conv("a1", &id, "hello"))
        .await
        .unwrap();
    let (mut a, mut b, mut c) = connect_abc(&s, &tokens).await;

    alice
        .delete(&format!("/v1/groups/{id}/members/333"))
        .await
        .unwrap();
    let cmd = command_reaches_all(&mut [&mut a, &mut b, &mut c], &id, "member_kicked").await;
    let kick_seq = cmd["seq"].as_u64().unwrap();
    assert_eq!(kick_seq, 3);
    assert_eq!(cmd["sender"], 111);
    assert_eq!(cmd["extra"]["from_user"], 111);
    assert_eq!(ids(&cmd["extra"]["to_users"]), vec![333]);
    assert_eq!(at_seq(&bob, &id, kick_seq).await["msg_id"], cmd["msg_id"]);
    assert_eq!(
        roles(&alice, &id).await,
        vec![(111, "owner".into()), (222, "member".into())]
    );

    // Later messages reach the others, not the kicked member.
    let ack = alice
        .post("/v1/messages", &text_to_conv("a2", &id, "after the kick"))
        .await
        .unwrap();
    assert_eq!(ack["seq"], 4);
    assert_eq!(pushed(&mut b, &id, "text").await["seq"], 4);
    no_push_after(&mut c, &id, kick_seq).await;

    // Carol's inbox ends with the kick.
    let pulled = request(
        &mut c,
        json!({"type": "pull", "chain": "user", "from": 1}),
        7,
    )
    .await;
    let items = pulled["items"].as_array().expect("pull items");
    let last = items
        .iter()
        .rfind(|i| i["message"]["conversation_id"] == id.as_str())
        .expect("group messages in carol's inbox");
    assert_eq!(last["message"]["msg_id"], cmd["msg_id"], "{pulled}");

    // Reading: up to the kick at most.
    match carol
        .get(&format!("/v1/conversations/{id}/messages?limit=100"))
        .await
    {
        Ok(page) => assert_eq!(page_seqs(&page), vec![1, 2, 3], "history ends at the kick"),
        Err(e) => assert_eq!(e.code(), Some("not_member")),
    }
    reads_nothing_after(&carol, &id, kick_seq).await;
    match carol
        .get(&format!(
            "/v1/conversations/{id}/messages/range?from=1&to=10"
        ))
        .await
    {
        Ok(page) => assert!(
            page_seqs(&page).iter().all(|&seq| seq <= kick_seq),
            "{page}"
        ),
        Err(e) => assert_eq!(e.code(), Some("not_member")),
    }
    assert_eq!(
        code_of(
            carol
                .post("/v1/messages", &text_to_conv("c1", &id, "let me back"))
                .await
        ),
        "not_member"
    );
    let ack = request(&mut c, send_frame(text_to_conv("c2", &id, "over ws")), 1).await;
    assert_eq!(
        (ack["type"].as_str(), ack["code"].as_str()),
        (Some("error"), Some("not_member"))
    );
    assert_eq!(
        code_of(carol.get(&format!("/v1/groups/{id}/members")).await),
        "not_member"
    );
    // The kicked member cannot act on the group any more.
    assert_eq!(code_of(invite(&carol, &id, &[333]).await), "not_member");
    assert_eq!(newest_seq(&alice, &id).await, 4);
}

#[tokio::test]
async fn plain_members_cannot_kick() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let _carol = s.user(333).await;
    let id = new_group(&alice, &[222, 333]).await;
    assert_eq!(
        code_of(bob.delete(&format!("/v1/groups/{id}/members/333")).await),
        "forbidden"
    );
    assert_eq!(
        code_of(bob.delete(&format!("/v1/groups/{id}/members/111")).await),
        "forbidden"
    );
    assert_eq!(newest_seq(&alice, &id).await, 1, "nothing appended");
    assert_eq!(roles(&alice, &id).await.len(), 3);
    // A stranger neither.
    let dave = s.user(444).await;
    let code = code_of(dave.delete(&format!("/v1/groups/{id}/members/333")).await);
    assert!(code == "not_member" || code == "not_found", "{code}");
}

#[tokio::test]
async fn members_quit_but_the_owner_cannot() {
    let s = spawn_server().await;
    let Trio {
        alice,
        carol,
        id,
        tokens,
        ..
    } = trio(&s).await;
    let (mut a, mut b, mut c) = connect_abc(&s, &tokens).await;

    carol
        .delete(&format!("/v1/groups/{id}/members/333"))
        .await
        .unwrap();
    let cmd = command_reaches_all(&mut [&mut a, &mut b, &mut c], &id, "member_quit").await;
    let quit_seq = cmd["seq"].as_u64().unwrap();
    assert_eq!(quit_seq, 2);
    assert_eq!(cmd["sender"], 333);
    assert_eq!(cmd["extra"]["user"], 333);
    assert_eq!(at_seq(&alice, &id, quit_seq).await["kind"], "member_quit");

    alice
        .post("/v1/messages", &text_to_conv("a1", &id, "bye carol"))
        .await
        .unwrap();
    assert_eq!(pushed(&mut b, &id, "text").await["seq"], 3);
    no_push_after(&mut c, &id, quit_seq).await;
    reads_nothing_after(&carol, &id, quit_seq).await;
    assert_eq!(
        code_of(
            carol
                .post("/v1/messages", &text_to_conv("c1", &id, "still here?"))
                .await
        ),
        "not_member"
    );

    // The owner may not quit (they dismiss instead): 403 `forbidden` (PROTOCOL.md 6, extension),
    // and nothing changes.
    let path = format!("/v1/groups/{id}/members/111");
    assert_eq!(
        status_and_code(&alice, reqwest::Method::DELETE, &path, None).await,
        (403, "forbidden".to_owned())
    );
    assert_eq!(newest_seq(&alice, &id).await, 3);
    assert_eq!(
        roles(&alice, &id).await,
        vec![(111, "owner".into()), (222, "member".into())]
    );
}

#[tokio::test]
async fn a_muted_member_cannot_send_until_unmuted() {
    let s = spawn_server().await;
    let Trio {
        alice,
        bob,
        carol,
        id,
        tokens,
    } = trio(&s).await;
    let (mut a, mut b, mut c) = connect_abc(&s, &tokens).await;
    let before = bob
        .post("/v1/messages", &text_to_conv("b0", &id, "before the mute"))
        .await
        .unwrap();
    let before_id = before["msg_id"].as_str().unwrap().to_owned();

    // Only the owner and admins mute.
    assert_eq!(
        code_of(
            carol
                .post(
                    &format!("/v1/groups/{id}/mutes"),
                    &json!({"user_id": 222, "duration_secs": 600})
                )
                .await
        ),
        "forbidden"
    );
    alice
        .post(
            &format!("/v1/groups/{id}/mutes"),
            &json!({"user_id": 222, "duration_secs": 600}),
        )
        .await
        .unwrap();
    let cmd = command_reaches_all(&mut [&mut a, &mut b, &mut c], &id, "member_muted").await;
    assert_eq!(cmd["sender"], 111);
    assert_eq!(cmd["extra"]["from_user"], 111);
    assert_eq!(cmd["extra"]["to_user"], 222);
    let until = cmd["extra"]["until"].as_i64().expect("until in ms");
    let at = cmd["created_at"].as_i64().unwrap();
    assert!(
        (at + 595_000..=at + 605_000).contains(&until),
        "until {until} is about 600 s after {at}"
    );
    assert_eq!(
        at_seq(&carol, &id, cmd["seq"].as_u64().unwrap()).await["kind"],
        "member_muted"
    );
    assert_eq!(member(&alice, &id, 222).await["muted_until"], until);

    assert_eq!(
        code_of(
            bob.post("/v1/messages", &text_to_conv("b1", &id, "hello?"))
                .await
        ),
        "muted"
    );
    let e = request(&mut b, send_frame(text_to_conv("b2", &id, "over ws")), 9).await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("muted"))
    );
    // An edit reaches every member as a send does: not while muted either.
    assert_eq!(
        code_of(
            bob.patch(
                &format!("/v1/messages/{before_id}"),
                &json!({"content": "edited while muted"})
            )
            .await
        ),
        "muted"
    );
    let seq_muted = newest_seq(&alice, &id).await;
    // Others still talk; muting in a group does not touch bob's single chats.
    carol
        .post("/v1/messages", &text_to_conv("c1", &id, "i can"))
        .await
        .unwrap();
    assert_eq!(pushed(&mut a, &id, "text").await["content"], "i can");
    bob.post("/v1/messages", &text_to_user("b3", 111, "psst"))
        .await
        .unwrap();

    // Unmute: the command goes out and bob speaks again.
    alice
        .delete(&format!("/v1/groups/{id}/mutes/222"))
        .await
        .unwrap();
    let cmd = command_reaches_all(&mut [&mut a, &mut b, &mut c], &id, "member_unmuted").await;
    assert_eq!(cmd["seq"].as_u64().unwrap(), seq_muted + 2);
    assert_eq!(cmd["sender"], 111);
    assert_eq!(cmd["extra"]["from_user"], 111);
    assert_eq!(cmd["extra"]["to_user"], 222);
    assert!(member(&alice, &id, 222).await["muted_until"].is_null());
    let ack = bob
        .post("/v1/messages", &text_to_conv("b4", &id, "back"))
        .await
        .unwrap();
    assert_eq!(ack["seq"].as_u64().unwrap(), seq_muted + 3);
    assert_eq!(pushed(&mut c, &id, "text").await["content"], "back");
    assert_eq!(pushed(&mut a, &id, "text").await["content"], "back");
}

#[tokio::test]
async fn a_mute_expires_by_itself() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let id = new_group(&alice, &[222]).await;
    alice
        .post(
            &format!("/v1/groups/{id}/mutes"),
            &json!({"user_id": 222, "duration_secs": 1}),
        )
        .await
        .unwrap();
    assert_eq!(
        code_of(
            bob.post("/v1/messages", &text_to_conv("b1", &id, "now?"))
                .await
        ),
        "muted"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let ack = bob
        .post("/v1/messages", &text_to_conv("b2", &id, "now!"))
        .await
        .expect("the mute is over");
    assert_eq!(ack["seq"], 3);
    assert!(member(&alice, &id, 222).await["muted_until"].is_null());
}

#[tokio::test]
async fn the_owner_appoints_admins_who_kick_members_but_not_admins() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    let _dave = s.user(444).await;
    let _erin = s.user(555).await;
    let id = new_group(&alice, &[222, 333, 444, 555]).await;

    // Only the owner appoints.
    assert_eq!(
        code_of(bob.put(&format!("/v1/groups/{id}/admins/333"), None).await),
        "forbidden"
    );
    alice
        .put(&format!("/v1/groups/{id}/admins/222"), None)
        .await
        .unwrap();
    alice
        .put(&format!("/v1/groups/{id}/admins/333"), None)
        .await
        .unwrap();
    assert_eq!(
        roles(&carol, &id).await,
        vec![
            (111, "owner".into()),
            (222, "admin".into()),
            (333, "admin".into()),
            (444, "member".into()),
            (555, "member".into()),
        ]
    );
    // An admin does not appoint or demote either.
    assert_eq!(
        code_of(bob.put(&format!("/v1/groups/{id}/admins/444"), None).await),
        "forbidden"
    );
    assert_eq!(
        code_of(bob.delete(&format!("/v1/groups/{id}/admins/333")).await),
        "forbidden"
    );

    // An admin kicks a member ...
    let before = newest_seq(&alice, &id).await;
    bob.delete(&format!("/v1/groups/{id}/members/444"))
        .await
        .expect("an admin kicks a member");
    let kick = at_seq(&alice, &id, before + 1).await;
    assert_eq!(kick["kind"], "member_kicked");
    assert_eq!(kick["sender"], 222);
    assert_eq!(kick["extra"]["from_user"], 222);
    assert_eq!(ids(&kick["extra"]["to_users"]), vec![444]);
    // ... but neither another admin nor the owner.
    assert_eq!(
        code_of(bob.delete(&format!("/v1/groups/{id}/members/333")).await),
        "forbidden"
    );
    assert_eq!(
        code_of(bob.delete(&format!("/v1/groups/{id}/members/111")).await),
        "forbidden"
    );
    assert_eq!(newest_seq(&alice, &id).await, before + 1);

    // Demoted, carol is a plain member again: the admin may kick her, and she may not kick.
    alice
        .delete(&format!("/v1/groups/{id}/admins/333"))
        .await
        .unwrap();
    assert_eq!(member(&alice, &id, 333).await["role"], "member");
    assert_eq!(
        code_of(carol.delete(&format!("/v1/groups/{id}/members/555")).await),
        "forbidden"
    );
    // Rights come before the target: a plain member naming a non-member is refused as
    // `forbidden`; the owner naming one is told `not_found`.
    assert_eq!(
        code_of(carol.delete(&format!("/v1/groups/{id}/members/999")).await),
        "forbidden"
    );
    assert_eq!(
        code_of(alice.delete(&format!("/v1/groups/{id}/members/999")).await),
        "not_found"
    );
    bob.delete(&format!("/v1/groups/{id}/members/333"))
        .await
        .expect("the demoted member can be kicked by an admin");
    assert_eq!(
        roles(&alice, &id).await,
        vec![
            (111, "owner".into()),
            (222, "admin".into()),
            (555, "member".into()),
        ]
    );
    // The owner's role never changes.
    let code = code_of(alice.delete(&format!("/v1/groups/{id}/admins/111")).await);
    assert!(
        code == "conflict" || code == "forbidden" || code == "invalid_argument",
        "{code}"
    );
    assert_eq!(member(&alice, &id, 111).await["role"], "owner");
}

/// PROTOCOL.md 6: "a group's owner and admins may recall any message of the group at any
/// time": an admin appointed after joining recalls a message sent before they joined
/// (which they cannot read), and everyone then reads it as recalled.
#[tokio::test]
async fn an_admin_recalls_a_message_sent_before_they_joined() {
    let s = spawn_server().await;
    let Trio { alice, bob, id, .. } = trio(&s).await;
    let dave = s.user(444).await;
    let sent = bob
        .post("/v1/messages", &text_to_conv("early", &id, "before dave"))
        .await
        .unwrap();
    let msg_id = sent["msg_id"].as_str().unwrap().to_owned();
    invite(&alice, &id, &[444]).await.unwrap();
    // Not his to recall while he is a plain member (he cannot see it).
    assert_eq!(
        code_of(
            dave.post(&format!("/v1/messages/{msg_id}/recall"), &json!({}))
                .await
        ),
        "not_found"
    );
    alice
        .put(&format!("/v1/groups/{id}/admins/444"), None)
        .await
        .unwrap();
    let recalled = dave
        .post(&format!("/v1/messages/{msg_id}/recall"), &json!({}))
        .await
        .unwrap();
    assert_eq!(recalled["status"], "recalled", "{recalled}");
    let m = at_seq(&alice, &id, sent["seq"].as_u64().unwrap()).await;
    assert_eq!(
        (m["status"].as_str(), m["content"].as_str()),
        (Some("recalled"), Some("")),
        "{m}"
    );
    // What cannot be recalled of what he cannot read answers as if it did not exist: the
    // group's creation (a command message), where a readable one answers invalid_argument.
    let created = at_seq(&alice, &id, 1).await;
    let created_id = created["msg_id"].as_str().unwrap();
    assert_eq!(
        code_of(
            dave.post(&format!("/v1/messages/{created_id}/recall"), &json!({}))
                .await
        ),
        "not_found"
    );
    assert_eq!(
        code_of(
            alice
                .post(&format!("/v1/messages/{created_id}/recall"), &json!({}))
                .await
        ),
        "invalid_argument"
    );
}

#[tokio::test]
async fn group_updates_carry_only_the_changed_fields() {
    let s = spawn_server().await;
    let Trio {
        alice,
        bob,
        carol,
        id,
        tokens,
    } = trio(&s).await;
    let mut b = s.ws(&tokens[1], "b").await;
    let mut c = s.ws(&tokens[2], "c").await;

    let conv = alice
        .patch(&format!("/v1/groups/{id}"), &json!({"name": "renamed"}))
        .await
        .unwrap();
    assert_eq!(conv["name"], "renamed");
    let cmd = command_reaches_all(&mut [&mut b, &mut c], &id, "group_updated").await;
    assert_eq!(cmd["sender"], 111);
    assert_eq!(cmd["extra"], json!({"name": "renamed"}));
    assert_eq!(cmd["seq"], 2);
    assert_eq!(
        at_seq(&carol, &id, 2).await["extra"],
        json!({"name": "renamed"})
    );
    assert_eq!(
        carol.get(&format!("/v1/conversations/{id}")).await.unwrap()["name"],
        "renamed"
    );

    alice
        .patch(
            &format!("/v1/groups/{id}"),
            &json!({"notice": "be nice", "avatar": "https://x/a.png"}),
        )
        .await
        .unwrap();
    let cmd = command_reaches_all(&mut [&mut b, &mut c], &id, "group_updated").await;
    assert_eq!(
        cmd["extra"],
        json!({"notice": "be nice", "avatar": "https://x/a.png"})
    );
    assert_eq!(cmd["seq"], 3);

    // A plain member may not; an admin may.
    assert_eq!(
        code_of(
            bob.patch(&format!("/v1/groups/{id}"), &json!({"name": "mine"}))
                .await
        ),
        "forbidden"
    );
    assert_eq!(newest_seq(&alice, &id).await, 3);
    alice
        .put(&format!("/v1/groups/{id}/admins/222"), None)
        .await
        .unwrap();
    bob.patch(&format!("/v1/groups/{id}"), &json!({"notice": "by bob"}))
        .await
        .expect("an admin updates");
    let cmd = command_reaches_all(&mut [&mut c], &id, "group_updated").await;
    assert_eq!(cmd["sender"], 222);
    assert_eq!(cmd["extra"], json!({"notice": "by bob"}));
    // A stranger neither reads nor updates.
    let dave = s.user(444).await;
    let code = code_of(
        dave.patch(&format!("/v1/groups/{id}"), &json!({"name": "x"}))
            .await,
    );
    assert!(code == "not_member" || code == "not_found", "{code}");
}

/// A recall retried after the group was dismissed answers as the first one did (the recall
/// is done; retrying changes nothing), while a new recall there is `conflict`.
#[tokio::test]
async fn a_recall_retried_after_dismissal_answers_as_before() {
    let s = spawn_server().await;
    let Trio { alice, bob, id, .. } = trio(&s).await;
    let m = bob
        .post("/v1/messages", &text_to_conv("r1", &id, "oops"))
        .await
        .unwrap();
    let m_id = m["msg_id"].as_str().unwrap().to_owned();
    let first = bob
        .post(&format!("/v1/messages/{m_id}/recall"), &json!({}))
        .await
        .unwrap();
    assert_eq!(first["status"], "recalled");
    alice.delete(&format!("/v1/groups/{id}")).await.unwrap();
    let again = bob
        .post(&format!("/v1/messages/{m_id}/recall"), &json!({}))
        .await
        .expect("a retried recall is answered");
    assert_eq!(again, first);
}

#[tokio::test]
async fn a_dismissed_group_is_read_only() {
    let s = spawn_server().await;
    let Trio {
        alice,
        bob,
        id,
        tokens,
        ..
    } = trio(&s).await;
    let hi = bob
        .post("/v1/messages", &text_to_conv("b1", &id, "hi"))
        .await
        .unwrap();
    let (mut a, mut b, mut c) = connect_abc(&s, &tokens).await;

    assert_eq!(
        code_of(bob.delete(&format!("/v1/groups/{id}")).await),
        "forbidden"
    );
    alice.delete(&format!("/v1/groups/{id}")).await.unwrap();
    let cmd = command_reaches_all(&mut [&mut a, &mut b, &mut c], &id, "group_dismissed").await;
    assert_eq!(cmd["seq"], 3);
    assert_eq!(cmd["sender"], 111);
    // PROTOCOL.md 1 (extension): "Command messages have `client_msg_id` `null`;
    // `group_dismissed` has `extra` `{}`".
    assert_eq!(cmd["extra"], json!({}), "{cmd}");
    assert!(cmd["client_msg_id"].is_null(), "{cmd}");

    for (h, cmid) in [(&bob, "b2"), (&alice, "a1")] {
        assert_eq!(
            code_of(
                h.post("/v1/messages", &text_to_conv(cmid, &id, "anyone?"))
                    .await
            ),
            "conflict"
        );
    }
    let e = request(&mut c, send_frame(text_to_conv("c1", &id, "hello?")), 3).await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("conflict"))
    );
    assert_eq!(code_of(invite(&bob, &id, &[444]).await), "conflict");
    let _ = s.user(444).await;
    assert_eq!(code_of(invite(&alice, &id, &[444]).await), "conflict");
    // Read-only for every change: recall, kick, quit, admins.
    let hi_id = hi["msg_id"].as_str().unwrap();
    for (h, who) in [(&bob, "the sender"), (&alice, "the owner")] {
        assert_eq!(
            code_of(
                h.post(&format!("/v1/messages/{hi_id}/recall"), &json!({}))
                    .await
            ),
            "conflict",
            "a recall by {who}"
        );
    }
    assert_eq!(
        code_of(alice.delete(&format!("/v1/groups/{id}/members/222")).await),
        "conflict"
    );
    assert_eq!(
        code_of(bob.delete(&format!("/v1/groups/{id}/members/222")).await),
        "conflict"
    );
    assert_eq!(
        code_of(
            alice
                .put(&format!("/v1/groups/{id}/admins/222"), None)
                .await
        ),
        "conflict"
    );
    // History stays readable and ends with the dismissal.
    let msgs = history_msgs(&bob, &id, "").await;
    let kinds: Vec<&str> = msgs.iter().map(|m| m["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, vec!["group_created", "text", "group_dismissed"]);
    assert_eq!(newest_seq(&alice, &id).await, 3);
    let code = code_of(alice.delete(&format!("/v1/groups/{id}")).await);
    assert_eq!(code, "conflict", "dismissing twice");
}

/// PROTOCOL.md 6: `POST /v1/groups` "answers with the new group's conversation (the shape
/// of `GET /v1/conversations/{id}`)": the very object a read of it right after gives, every
/// field alike (nothing happens in the group between the two calls).
#[tokio::test]
async fn creating_a_group_answers_what_reading_its_conversation_answers() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    let _ = s.user(333).await;
    let created = alice
        .post(
            "/v1/groups",
            &json!({"name": "same", "members": [222, 333]}),
        )
        .await
        .unwrap();
    let id = created["conversation_id"].as_str().unwrap();
    let read = alice.get(&format!("/v1/conversations/{id}")).await.unwrap();
    assert_eq!(created, read);
    assert_eq!(created["member_count"], 3, "the owner counted: {created}");
}

/// PROTOCOL.md 1 (extension): "Command messages have `client_msg_id` `null`; `group_dismissed`
/// has `extra` `{}`". Every kind of command the server writes into a group's chain, as the
/// history reads it.
#[tokio::test]
async fn command_messages_have_no_client_msg_id_and_a_dismissal_no_parameters() {
    let s = spawn_server().await;
    let Trio {
        alice,
        bob,
        carol,
        id,
        ..
    } = trio(&s).await;
    let _dave = s.user(444).await;
    invite(&bob, &id, &[444]).await.unwrap();
    alice
        .post(
            &format!("/v1/groups/{id}/mutes"),
            &json!({"user_id": 444, "duration_secs": 600}),
        )
        .await
        .unwrap();
    alice
        .delete(&format!("/v1/groups/{id}/mutes/444"))
        .await
        .unwrap();
    alice
        .patch(&format!("/v1/groups/{id}"), &json!({"notice": "be nice"}))
        .await
        .unwrap();
    let sent = bob
        .post("/v1/messages", &text_to_conv("b1", &id, "typo"))
        .await
        .unwrap();
    let sent_id = sent["msg_id"].as_str().unwrap();
    bob.patch(
        &format!("/v1/messages/{sent_id}"),
        &json!({"content": "fixed"}),
    )
    .await
    .unwrap();
    bob.post(&format!("/v1/messages/{sent_id}/recall"), &json!({}))
        .await
        .unwrap();
    alice
        .delete(&format!("/v1/groups/{id}/members/444"))
        .await
        .unwrap();
    carol
        .delete(&format!("/v1/groups/{id}/members/333"))
        .await
        .unwrap();
    alice.delete(&format!("/v1/groups/{id}")).await.unwrap();

    let msgs = alice.whole_history(&id).await.unwrap();
    let kinds: Vec<&str> = msgs.iter().map(|m| m["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        vec![
            "group_created",
            "member_invited",
            "member_muted",
            "member_unmuted",
            "group_updated",
            "text",
            "edit",
            "recall",
            "member_kicked",
            "member_quit",
            "group_dismissed",
        ]
    );
    for m in &msgs {
        if m["kind"] == "text" {
            assert_eq!(m["client_msg_id"], "b1", "{m}");
        } else {
            assert!(m["client_msg_id"].is_null(), "a command's: {m}");
        }
    }
    let dismissed = msgs.last().unwrap();
    assert_eq!(dismissed["extra"], json!({}), "{dismissed}");
}

/// PROTOCOL.md 6 (extension): "kick/quit, admin changes, mutes and dismiss answer `{}`"
/// (`PUT`/`DELETE /v1/groups/{id}/admins/{uid}` among them).
#[tokio::test]
async fn group_changes_other_than_create_update_and_invite_answer_an_empty_object() {
    let s = spawn_server().await;
    let Trio {
        alice, carol, id, ..
    } = trio(&s).await;
    let _dave = s.user(444).await;
    invite(&alice, &id, &[444]).await.unwrap();
    let answers = [
        (
            "appoint an admin",
            alice
                .put(&format!("/v1/groups/{id}/admins/222"), None)
                .await,
        ),
        (
            "remove an admin",
            alice.delete(&format!("/v1/groups/{id}/admins/222")).await,
        ),
        (
            "mute",
            alice
                .post(
                    &format!("/v1/groups/{id}/mutes"),
                    &json!({"user_id": 222, "duration_secs": 600}),
                )
                .await,
        ),
        (
            "unmute",
            alice.delete(&format!("/v1/groups/{id}/mutes/222")).await,
        ),
        (
            "kick",
            alice.delete(&format!("/v1/groups/{id}/members/444")).await,
        ),
        (
            "quit",
            carol.delete(&format!("/v1/groups/{id}/members/333")).await,
        ),
        ("dismiss", alice.delete(&format!("/v1/groups/{id}")).await),
    ];
    for (what, answer) in answers {
        let answer = answer.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(answer, json!({}), "{what}");
    }
}

/// PROTOCOL.md 6 (extension): "The conversation list leaves out groups the caller has left or
/// was removed from, and `GET /v1/conversations/{id}` of such a group answers `403
/// not_member`; their history up to the removal stays readable". For a kicked member and
/// for one who quit.
#[tokio::test]
async fn a_former_member_no_longer_lists_the_group_nor_reads_it_as_a_conversation() {
    let s = spawn_server().await;
    let Trio {
        alice,
        bob,
        carol,
        id,
        ..
    } = trio(&s).await;
    for h in [&bob, &carol] {
        assert_eq!(listed(h).await, vec![id.clone()], "a member lists it");
    }
    alice
        .delete(&format!("/v1/groups/{id}/members/222"))
        .await
        .unwrap();
    carol
        .delete(&format!("/v1/groups/{id}/members/333"))
        .await
        .unwrap();
    // Later activity in the group does not bring it back either.
    alice
        .post("/v1/messages", &text_to_conv("a1", &id, "after"))
        .await
        .unwrap();
    for (h, who, removal) in [(&bob, "kicked", 2u64), (&carol, "quit", 3)] {
        assert_eq!(listed(h).await, Vec::<String>::new(), "{who}");
        let path = format!("/v1/conversations/{id}");
        assert_eq!(
            status_and_code(h, reqwest::Method::GET, &path, None).await,
            (403, "not_member".to_owned()),
            "{who}"
        );
        assert_eq!(
            history_seqs(h, &id, "?limit=100").await.last(),
            Some(&removal),
            "{who}: history up to the removal"
        );
    }
    assert_eq!(newest_seq(&alice, &id).await, 4);
}

#[tokio::test]
async fn members_are_listed_page_by_page() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let mut others = Vec::new();
    for u in 201..=208u64 {
        let _ = s.user(u).await;
        others.push(u);
    }
    let id = new_group(&alice, &others).await;
    let bob = s.user(204).await;
    let mut seen: Vec<u64> = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/groups/{id}/members?limit=3&cursor={c}"),
            None => format!("/v1/groups/{id}/members?limit=3"),
        };
        let page = bob.get(&path).await.unwrap();
        let members = page["members"].as_array().unwrap();
        assert!(members.len() <= 3, "{page}");
        for m in members {
            assert!(m["joined_at"].as_i64().unwrap() > 1_700_000_000_000);
            assert!(m["muted_until"].is_null());
            let role = m["role"].as_str().unwrap();
            let uid = m["user_id"].as_u64().unwrap();
            assert_eq!(role, if uid == 111 { "owner" } else { "member" });
            seen.push(uid);
        }
        pages += 1;
        assert!(pages <= 4, "too many pages");
        match page["next_cursor"].as_str() {
            Some(c) => {
                assert_eq!(members.len(), 3, "a full page before a cursor");
                cursor = Some(c.to_owned());
            }
            None => {
                assert!(page["next_cursor"].is_null());
                break;
            }
        }
    }
    let mut expected = vec![111];
    expected.extend(201..=208);
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), seen.len(), "no member twice: {seen:?}");
    assert_eq!(sorted, expected);
    assert_eq!(pages, 3);
    let all = bob
        .get(&format!("/v1/groups/{id}/members?limit=100"))
        .await
        .unwrap();
    assert_eq!(all["members"].as_array().unwrap().len(), 9);
    assert!(all["next_cursor"].is_null());
    // Only members may list.
    let stranger = s.user(999).await;
    assert_eq!(
        code_of(stranger.get(&format!("/v1/groups/{id}/members")).await),
        "not_member"
    );
}

#[tokio::test]
async fn a_member_invited_again_reads_only_from_the_new_invitation() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let id = new_group(&alice, &[222]).await;
    alice
        .delete(&format!("/v1/groups/{id}/members/222"))
        .await
        .unwrap();
    alice
        .post(
            "/v1/messages",
            &text_to_conv("a1", &id, "while bob is away"),
        )
        .await
        .unwrap();
    invite(&alice, &id, &[222])
        .await
        .expect("a former member can be invited again");
    let back = newest_seq(&alice, &id).await;
    assert_eq!(back, 4);
    assert_eq!(
        history_seqs(&bob, &id, "?limit=100").await,
        vec![4],
        "only from the new invitation on"
    );
    let cv = bob.get(&format!("/v1/conversations/{id}")).await.unwrap();
    assert_eq!(cv["unread"], 0);
    assert_eq!(code_of(invite(&alice, &id, &[222]).await), "conflict");
    // The read mark starts at the group's newest seq (the new invitation).
    assert_eq!(cv["last_read_seq"], cv["seq"], "{cv}");
    bob.post("/v1/messages", &text_to_conv("b1", &id, "back"))
        .await
        .expect("a member again");
}

#[tokio::test]
async fn removal_is_the_last_push_in_a_read_fanout_group_too() {
    let s = spawn_with(|c| c.fanout_write_max_members = 2).await;
    let (ta, tb, tc) = (s.token(111).await, s.token(222).await, s.token(333).await);
    let alice = s.anon().with_bearer(ta.clone());
    let carol = s.anon().with_bearer(tc.clone());
    let _dave = s.user(444).await;
    let id = new_group(&alice, &[222, 333, 444]).await;
    let cv = alice.get(&format!("/v1/conversations/{id}")).await.unwrap();
    assert_eq!(cv["fanout"], "read");
    let mut b = s.ws(&tb, "b").await;
    let mut c = s.ws(&tc, "c").await;

    alice
        .delete(&format!("/v1/groups/{id}/members/333"))
        .await
        .unwrap();
    let push = c
        .recv_until(WAIT, |v| {
            v["type"] == "msg" && v["message"]["kind"] == "member_kicked"
        })
        .await
        .unwrap()
        .expect("the kick reaches the kicked member");
    assert!(
        push.get("user_seq").is_none(),
        "read fan-out pushes carry no user_seq: {push}"
    );
    let kick_seq = push["message"]["seq"].as_u64().unwrap();
    pushed(&mut b, &id, "member_kicked").await;
    alice
        .post("/v1/messages", &text_to_conv("a1", &id, "after"))
        .await
        .unwrap();
    assert_eq!(pushed(&mut b, &id, "text").await["seq"], kick_seq + 1);
    no_push_after(&mut c, &id, kick_seq).await;
    let pulled = request(
        &mut c,
        json!({"type": "pull", "chain": "conversation", "conversation_id": id, "from": 1}),
        2,
    )
    .await;
    if pulled["type"] == "pull_result" {
        assert_eq!(
            item_seqs(&pulled).last().copied(),
            Some(kick_seq),
            "{pulled}"
        );
    } else {
        assert_eq!(pulled["code"], "not_member", "{pulled}");
    }
    reads_nothing_after(&carol, &id, kick_seq).await;
    // A newcomer to the big group gets the invitation pushed and reads from it on.
    let te = s.token(555).await;
    let erin = s.anon().with_bearer(te.clone());
    let mut e = s.ws(&te, "e").await;
    invite(&alice, &id, &[555]).await.unwrap();
    let inv = pushed(&mut e, &id, "member_invited").await;
    assert_eq!(inv["seq"], kick_seq + 2);
    let seen = history_msgs(&erin, &id, "?limit=100").await;
    assert!(
        seen.iter()
            .all(|m| m["seq"].as_u64().unwrap() >= kick_seq + 2)
    );
    let cv = erin.get(&format!("/v1/conversations/{id}")).await.unwrap();
    assert_eq!(cv["unread"], 0, "{cv}");
}

#[tokio::test]
async fn history_after_the_removal_answers_not_member() {
    let s = spawn_server().await;
    let owner = s.user(1).await;
    let bob = s.user(2).await;
    let _ = s.user(3).await;
    let gid = new_group_named(&owner, "g", &[2, 3]).await;
    let before = owner
        .post("/v1/messages", &text_to_conv("k1", &gid, "before"))
        .await
        .unwrap();
    owner
        .delete(&format!("/v1/groups/{gid}/members/2"))
        .await
        .expect("kick");
    owner
        .post("/v1/messages", &text_to_conv("k2", &gid, "after"))
        .await
        .unwrap();
    // Up to the removal (seq 3) stays readable; anything after it is not theirs.
    assert_eq!(history_seqs(&bob, &gid, "").await, vec![1, 2, 3]);
    // A message reads as it is now: its sender's edit after the removal shows (the `edit`
    // command, seq 5, does not).
    owner
        .patch(
            &format!("/v1/messages/{}", before["msg_id"].as_str().unwrap()),
            &json!({"content": "corrected"}),
        )
        .await
        .unwrap();
    let seen = history_msgs(&bob, &gid, "").await;
    assert_eq!(seen.len(), 3);
    assert_eq!(
        (&seen[1]["content"], &seen[1]["version"]),
        (&json!("corrected"), &json!(2))
    );
    assert_eq!(
        code_of(
            bob.get(&format!("/v1/conversations/{gid}/messages?after=3"))
                .await
        ),
        "not_member"
    );
    assert_eq!(
        code_of(
            bob.get(&format!(
                "/v1/conversations/{gid}/messages/range?from=4&to=4"
            ))
            .await
        ),
        "not_member"
    );
    // Receipts are today's reads by today's members, even of a seq they could read: who
    // joined and who read after the removal is not theirs to learn.
    for seq in [2, 4] {
        assert_eq!(
            code_of(
                bob.get(&format!("/v1/conversations/{gid}/receipts?seq={seq}"))
                    .await
            ),
            "not_member"
        );
    }
    let r = bob
        .get(&format!(
            "/v1/conversations/{gid}/messages/range?from=1&to=4"
        ))
        .await
        .unwrap();
    assert_eq!(r["messages"].as_array().unwrap().len(), 3);
}

/// PROTOCOL.md 6: `DELETE /v1/groups/{id}/mutes/{uid}` is for "owner, admins": a plain member
/// lifting a mute is `forbidden` (403), and the mute stays.
#[tokio::test]
async fn plain_members_cannot_unmute() {
    let s = spawn_server().await;
    let Trio {
        alice,
        bob,
        carol,
        id,
        ..
    } = trio(&s).await;
    alice
        .post(
            &format!("/v1/groups/{id}/mutes"),
            &json!({"user_id": 222, "duration_secs": 600}),
        )
        .await
        .unwrap();
    let seq = newest_seq(&alice, &id).await;
    for who in [&carol, &bob] {
        let (status, body) = who
            .raw(
                reqwest::Method::DELETE,
                &format!("/v1/groups/{id}/mutes/222"),
                None,
            )
            .await
            .unwrap();
        assert_eq!((status, body["code"].as_str()), (403, Some("forbidden")));
    }
    assert!(member(&alice, &id, 222).await["muted_until"].is_i64());
    assert_eq!(newest_seq(&alice, &id).await, seq, "no member_unmuted");
    assert_eq!(
        code_of(
            bob.post("/v1/messages", &text_to_conv("b1", &id, "free?"))
                .await
        ),
        "muted"
    );
}

/// PROTOCOL.md 6: `PATCH /v1/groups/{id}` takes `{"name","notice","avatar"}` (any of them),
/// and "`group_updated`: the changed fields": a body with none of them has nothing to change
/// and answers 400 `invalid_argument`, and no `group_updated` is appended.
#[tokio::test]
async fn a_group_update_with_nothing_to_change_is_invalid() {
    let s = spawn_server().await;
    let Trio { alice, id, .. } = trio(&s).await;
    for body in [json!({}), json!({"colour": "blue"})] {
        let (status, answer) = alice
            .raw(
                reqwest::Method::PATCH,
                &format!("/v1/groups/{id}"),
                Some(&body),
            )
            .await
            .unwrap();
        assert_eq!(
            (status, answer["code"].as_str()),
            (400, Some("invalid_argument")),
            "{body}"
        );
    }
    assert_eq!(newest_seq(&alice, &id).await, 1, "nothing appended");
    assert_eq!(
        alice.get(&format!("/v1/conversations/{id}")).await.unwrap()["name"],
        "team"
    );
}

/// Every group endpoint that changes a group, and the member list, called on `conv`.
fn group_calls(conv: &str) -> Vec<(reqwest::Method, String, Option<Value>)> {
    use reqwest::Method;
    vec![
        (
            Method::PATCH,
            format!("/v1/groups/{conv}"),
            Some(json!({"name": "mine"})),
        ),
        (
            Method::POST,
            format!("/v1/groups/{conv}/members"),
            Some(json!({"user_ids": [444]})),
        ),
        (
            Method::DELETE,
            format!("/v1/groups/{conv}/members/222"),
            None,
        ),
        (Method::PUT, format!("/v1/groups/{conv}/admins/222"), None),
        (
            Method::POST,
            format!("/v1/groups/{conv}/mutes"),
            Some(json!({"user_id": 222, "duration_secs": 600})),
        ),
        (Method::DELETE, format!("/v1/groups/{conv}/mutes/222"), None),
        (Method::DELETE, format!("/v1/groups/{conv}"), None),
        (Method::GET, format!("/v1/groups/{conv}/members"), None),
    ]
}

/// PROTOCOL.md 1: a stranger gets 403 `not_member` from the group endpoints for an existing
/// group and for a single chat of two other users alike (nothing tells a group from a
/// single chat), and 404 `not_found` for a group id that never existed ("no such ...
/// group"). Only a participant of a single chat learns that it is not a group (400
/// `invalid_argument`).
#[tokio::test]
async fn group_endpoints_answer_a_stranger_not_member_and_a_missing_group_not_found() {
    let s = spawn_server().await;
    let Trio { alice, bob, id, .. } = trio(&s).await;
    let dave = s.user(444).await;
    // bob and carol have chatted: their single chat exists.
    bob.post("/v1/messages", &text_to_user("bc", 333, "hi carol"))
        .await
        .unwrap();
    for (i, (method, path, body)) in group_calls(&id).into_iter().enumerate() {
        let existing = dave
            .raw(method.clone(), &path, body.as_ref())
            .await
            .unwrap();
        assert_eq!(
            (existing.0, existing.1["code"].as_str()),
            (403, Some("not_member")),
            "{method} {path}: {}",
            existing.1
        );
        // Status and body alike: nothing tells the group from the single chat.
        let (m, p, b) = group_calls("222-333").swap_remove(i);
        let answer = dave.raw(m, &p, b.as_ref()).await.unwrap();
        assert_eq!(answer, existing, "{method} {p} answers as {path} does");
        let (m, p, b) = group_calls("g123456789").swap_remove(i);
        let (status, missing) = dave.raw(m, &p, b.as_ref()).await.unwrap();
        assert_eq!(
            (status, missing["code"].as_str()),
            (404, Some("not_found")),
            "{method} {p}: {missing}"
        );
    }
    // bob is in the single chat: he is told it is not a group.
    for (method, path, body) in group_calls("222-333") {
        let (status, answer) = bob.raw(method.clone(), &path, body.as_ref()).await.unwrap();
        assert_eq!(
            (status, answer["code"].as_str(), answer["message"].as_str()),
            (400, Some("invalid_argument"), Some("not a group")),
            "{method} {path}: {answer}"
        );
    }
    // Nothing was changed anywhere.
    assert_eq!(newest_seq(&alice, &id).await, 1);
    assert_eq!(newest_seq(&bob, "222-333").await, 1);
    assert_eq!(roles(&alice, &id).await, trio_roles());
}

/// An invitation names 1 to 1000 users: none, or more (here ids that do not even exist,
/// which the server would otherwise look up one by one), is `invalid_argument` before
/// anything is loaded, and the group is unchanged.
#[tokio::test]
async fn an_invitation_of_no_one_or_over_1000_users_is_refused() {
    let s = spawn_server().await;
    let Trio { alice, id, .. } = trio(&s).await;
    let too_many: Vec<u64> = (1_000_000..1_001_001).collect();
    for users in [Vec::new(), too_many] {
        let (status, body) = alice
            .raw(
                reqwest::Method::POST,
                &format!("/v1/groups/{id}/members"),
                Some(&json!({ "user_ids": users })),
            )
            .await
            .unwrap();
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("invalid_argument")),
            "{} users: {body}",
            users.len()
        );
    }
    let g = alice.get(&format!("/v1/conversations/{id}")).await.unwrap();
    assert_eq!(g["member_count"], 3, "{g}");
}

/// PROTOCOL.md 6: a member who joins a group has read everything sent before they joined,
/// so the receipts of an earlier message list them among its readers.
#[tokio::test]
async fn a_member_who_joined_later_has_read_what_came_before() {
    let s = spawn_server().await;
    let (ta, tb, _) = (s.token(111).await, s.token(222).await, s.token(333).await);
    let alice = s.anon().with_bearer(ta);
    let bob = s.anon().with_bearer(tb);
    let id = new_group(&alice, &[222]).await;
    let sent = alice
        .post("/v1/messages", &text_to_conv("before-carol", &id, "hi bob"))
        .await
        .unwrap();
    let seq = sent["seq"].as_u64().unwrap();
    invite(&bob, &id, &[333]).await.unwrap();
    let receipts = alice
        .get(&format!("/v1/conversations/{id}/receipts?seq={seq}"))
        .await
        .unwrap();
    assert_eq!(receipts["read"], json!([333]), "{receipts}");
    assert_eq!(receipts["unread"], json!([222]), "{receipts}");
    // A message after the join is theirs to read like anyone's.
    let after = alice
        .post("/v1/messages", &text_to_conv("after-carol", &id, "hi all"))
        .await
        .unwrap();
    let receipts = alice
        .get(&format!(
            "/v1/conversations/{id}/receipts?seq={}",
            after["seq"]
        ))
        .await
        .unwrap();
    assert_eq!(receipts["read"], json!([]), "{receipts}");
    assert_eq!(receipts["unread"], json!([222, 333]), "{receipts}");
}

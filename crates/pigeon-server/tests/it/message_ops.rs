//! Changing sent messages (PROTOCOL.md 1 and 6): recall, edit, delete for me, admin delete.

use crate::*;
use serde_json::json;

async fn edit(h: &Http, msg_id: &str, content: &str) -> Result<Value, pigeon_client::ClientError> {
    h.patch(
        &format!("/v1/messages/{msg_id}"),
        &json!({"content": content}),
    )
    .await
}

async fn recall(h: &Http, msg_id: &str) -> Result<Value, pigeon_client::ClientError> {
    h.post(&format!("/v1/messages/{msg_id}/recall"), &json!({}))
        .await
}

/// Sends a text; answers (msg_id, seq).
async fn send(h: &Http, body: Value) -> (String, u64) {
    let ack = h.post("/v1/messages", &body).await.expect("send");
    (
        ack["msg_id"].as_str().unwrap().to_owned(),
        ack["seq"].as_u64().unwrap(),
    )
}

/// The message `msg_id` in `h`'s newest history page (as a history read shows it).
async fn in_history(h: &Http, conv: &str, msg_id: &str) -> Value {
    let page = history_page(h, conv, "?limit=100").await;
    page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["msg_id"] == msg_id)
        .cloned()
        .unwrap_or_else(|| panic!("{msg_id} not in history: {page}"))
}

/// Waits for the push of a command of `kind` in `conv`.
async fn pushed(ws: &mut WsConn, conv: &str, kind: &str) -> Value {
    ws.recv_until(WAIT, |v| {
        v["type"] == "msg"
            && v["message"]["conversation_id"] == conv
            && v["message"]["kind"] == kind
    })
    .await
    .expect("recv")
    .unwrap_or_else(|| panic!("no {kind} push"))["message"]
        .clone()
}

#[tokio::test]
async fn the_sender_recalls_and_everyone_sees_it_recalled() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let tb = s.token(222).await;
    let bob = s.anon().with_bearer(tb.clone());
    let (id, seq) = send(&alice, text_to_user("r1", 222, "oops, wrong chat")).await;
    let mut b = s.ws(&tb, "b").await;

    // Neither the peer nor a stranger may recall it.
    assert_eq!(code_of(recall(&bob, &id).await), "forbidden");
    let carol = s.user(333).await;
    let code = code_of(recall(&carol, &id).await);
    assert!(code == "not_found" || code == "not_member", "{code}");

    let m = recall(&alice, &id).await.unwrap();
    assert_eq!(m["msg_id"], id.as_str());
    assert_eq!(m["status"], "recalled");
    assert_eq!(m["content"], "");
    assert_eq!(m["seq"], seq);

    let cmd = pushed(&mut b, "111-222", "recall").await;
    assert_eq!(cmd["sender"], 111);
    assert_eq!(cmd["extra"]["msg_id"], id.as_str());
    assert_eq!(cmd["seq"], seq + 1);
    assert_eq!(cmd["content"], "");

    for h in [&alice, &bob] {
        let m = at_seq(h, "111-222", seq).await;
        assert_eq!(m["msg_id"], id.as_str());
        assert_eq!(m["status"], "recalled");
        assert_eq!(m["content"], "");
        let m = in_history(h, "111-222", &id).await;
        assert_eq!(
            (m["status"].as_str(), m["content"].as_str()),
            (Some("recalled"), Some(""))
        );
        let c = at_seq(h, "111-222", seq + 1).await;
        assert_eq!(c["kind"], "recall");
        assert_eq!(c["extra"]["msg_id"], id.as_str());
    }
    // Nor does the conversation's last message, which stays the recalled one: the `recall`
    // command advances the chain but does not replace `last_message`
    // (PROTOCOL.md 6, extension).
    for h in [&alice, &bob] {
        let c = h.get("/v1/conversations/111-222").await.unwrap();
        assert_eq!(c["seq"], seq + 1, "{c}");
        let last = &c["last_message"];
        assert_eq!(last["msg_id"], id.as_str(), "{c}");
        assert_eq!(
            (last["status"].as_str(), last["content"].as_str()),
            (Some("recalled"), Some(""))
        );
        let listed = h.get("/v1/conversations").await.unwrap();
        assert_eq!(
            listed["conversations"][0]["last_message"]["msg_id"],
            id.as_str(),
            "{listed}"
        );
    }
    // The versions read shows nothing of the original either.
    let v = bob
        .get(&format!("/v1/messages/{id}/versions"))
        .await
        .unwrap();
    for version in v["versions"].as_array().unwrap() {
        assert_eq!(version["content"], "", "{v}");
    }

    // The back end still sees the original, and who recalled it when.
    let audit = s
        .admin
        .get(&format!("/v1/admin/messages/{id}"))
        .await
        .unwrap();
    assert_eq!(audit["message"]["content"], "oops, wrong chat");
    assert_eq!(audit["message"]["status"], "recalled");
    assert_eq!(audit["recalled_by"], 111);
    let at = audit["recalled_at"].as_i64().expect("recalled_at is set");
    assert!(
        at >= cmd["created_at"].as_i64().unwrap() - 1000
            && at <= cmd["created_at"].as_i64().unwrap() + 1000
    );
    assert_eq!(
        code_of(alice.get(&format!("/v1/admin/messages/{id}")).await),
        "unauthorized"
    );
    // A recalled message cannot be edited.
    assert!(edit(&alice, &id, "fixed").await.is_err());
}

#[tokio::test]
async fn a_late_recall_is_refused() {
    let s = spawn_with(|c| c.recall_window_secs = 1).await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let (id, seq) = send(&alice, text_to_user("r1", 222, "too late")).await;
    let (fresh, _) = send(&alice, text_to_user("r2", 222, "in time")).await;
    recall(&alice, &fresh).await.expect("within the window");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(code_of(recall(&alice, &id).await), "window_expired");
    let m = at_seq(&bob, "111-222", seq).await;
    assert_eq!(
        (m["status"].as_str(), m["content"].as_str()),
        (Some("normal"), Some("too late"))
    );
    let conv = bob.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(conv["seq"], 3, "only the one recall command was appended");
    let audit = s
        .admin
        .get(&format!("/v1/admin/messages/{id}"))
        .await
        .unwrap();
    assert!(audit["recalled_at"].is_null() && audit["recalled_by"].is_null());
}

#[tokio::test]
async fn group_owner_and_admins_recall_any_message_at_any_time() {
    let s = spawn_with(|c| c.recall_window_secs = 1).await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    let td = s.token(444).await;
    let dave = s.anon().with_bearer(td.clone());
    let gid = new_group_named(&alice, "g", &[222, 333, 444]).await;
    alice
        .put(&format!("/v1/groups/{gid}/admins/222"), None)
        .await
        .unwrap();
    let (m1, s1) = send(&carol, text_to_conv("c1", &gid, "one")).await;
    let (m2, s2) = send(&carol, text_to_conv("c2", &gid, "two")).await;
    let (m3, s3) = send(&carol, text_to_conv("c3", &gid, "three")).await;
    // A plain member may not recall another's message, even at once.
    assert_eq!(code_of(recall(&dave, &m1).await), "forbidden");
    let mut d = s.ws(&td, "d").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;

    assert_eq!(code_of(recall(&carol, &m1).await), "window_expired");
    let r = recall(&alice, &m1)
        .await
        .expect("the owner recalls at any time");
    assert_eq!(r["status"], "recalled");
    let cmd = pushed(&mut d, &gid, "recall").await;
    assert_eq!(cmd["sender"], 111);
    assert_eq!(cmd["extra"]["msg_id"], m1.as_str());
    recall(&bob, &m2)
        .await
        .expect("an admin recalls at any time");
    let cmd = pushed(&mut d, &gid, "recall").await;
    assert_eq!(cmd["sender"], 222);
    assert_eq!(cmd["extra"]["msg_id"], m2.as_str());
    assert_eq!(code_of(recall(&dave, &m3).await), "forbidden");

    for h in [&alice, &bob, &carol, &dave] {
        for seq in [s1, s2] {
            let m = at_seq(h, &gid, seq).await;
            assert_eq!(
                (m["status"].as_str(), m["content"].as_str()),
                (Some("recalled"), Some(""))
            );
        }
        let m = at_seq(h, &gid, s3).await;
        assert_eq!(
            (m["status"].as_str(), m["content"].as_str()),
            (Some("normal"), Some("three"))
        );
    }
    let audit = s
        .admin
        .get(&format!("/v1/admin/messages/{m1}"))
        .await
        .unwrap();
    assert_eq!(audit["recalled_by"], 111);
    assert_eq!(audit["message"]["content"], "one");
    let audit = s
        .admin
        .get(&format!("/v1/admin/messages/{m2}"))
        .await
        .unwrap();
    assert_eq!(audit["recalled_by"], 222);
    assert_eq!(audit["message"]["content"], "two");
    assert_eq!(audit["message"]["sender"], 333);
}

#[tokio::test]
async fn edits_grow_the_version_and_keep_every_version() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let tb = s.token(222).await;
    let bob = s.anon().with_bearer(tb.clone());
    let (id, seq) = send(&alice, text_to_user("e1", 222, "v one")).await;
    let mut b = s.ws(&tb, "b").await;

    let m = edit(&alice, &id, "v two").await.unwrap();
    assert_eq!(m["msg_id"], id.as_str());
    assert_eq!(m["version"], 2);
    assert_eq!(m["content"], "v two");
    assert_eq!(m["status"], "normal");
    assert_eq!(m["seq"], seq);
    let edited_at = m["edited_at"].as_i64().expect("edited_at is set");
    assert!(edited_at >= m["created_at"].as_i64().unwrap());
    let cmd = pushed(&mut b, "111-222", "edit").await;
    assert_eq!(cmd["sender"], 111);
    assert_eq!(cmd["extra"]["msg_id"], id.as_str());
    assert_eq!(cmd["extra"]["version"], 2);
    assert_eq!(cmd["seq"], seq + 1);

    let m = edit(&alice, &id, "v three").await.unwrap();
    assert_eq!(m["version"], 3);
    let cmd = pushed(&mut b, "111-222", "edit").await;
    assert_eq!(cmd["extra"]["version"], 3);
    assert_eq!(cmd["seq"], seq + 2);

    for h in [&alice, &bob] {
        let m = at_seq(h, "111-222", seq).await;
        assert_eq!(m["content"], "v three");
        assert_eq!(m["version"], 3);
        assert!(m["edited_at"].as_i64().unwrap() >= edited_at);
        let v = h.get(&format!("/v1/messages/{id}/versions")).await.unwrap();
        let versions = v["versions"].as_array().unwrap();
        let got: Vec<(u64, &str)> = versions
            .iter()
            .map(|x| {
                (
                    x["version"].as_u64().unwrap(),
                    x["content"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(got, vec![(1, "v one"), (2, "v two"), (3, "v three")]);
        let ats: Vec<i64> = versions.iter().map(|x| x["at"].as_i64().unwrap()).collect();
        assert!(ats.windows(2).all(|w| w[0] <= w[1]), "{ats:?}");
        assert_eq!(ats[0], m["created_at"].as_i64().unwrap());
    }
    // The `edit` commands advance the chain but do not replace `last_message`: it stays the
    // edited message, as it now reads (PROTOCOL.md 6, extension).
    for h in [&alice, &bob] {
        let c = h.get("/v1/conversations/111-222").await.unwrap();
        assert_eq!(c["seq"], seq + 2, "{c}");
        let last = &c["last_message"];
        assert_eq!(
            (
                last["msg_id"].as_str(),
                last["content"].as_str(),
                last["version"].as_u64()
            ),
            (Some(id.as_str()), Some("v three"), Some(3)),
            "{c}"
        );
        let listed = h.get("/v1/conversations").await.unwrap();
        assert_eq!(
            listed["conversations"][0]["last_message"]["msg_id"],
            id.as_str(),
            "{listed}"
        );
    }
    let audit = s
        .admin
        .get(&format!("/v1/admin/messages/{id}"))
        .await
        .unwrap();
    assert_eq!(audit["versions"].as_array().unwrap().len(), 3);
    assert_eq!(audit["message"]["content"], "v three");
    // Nobody else edits it.
    assert_eq!(code_of(edit(&bob, &id, "mine now").await), "forbidden");
    assert_eq!(code_of(edit(&alice, &id, "").await), "invalid_argument");
    let m = at_seq(&bob, "111-222", seq).await;
    assert_eq!(
        (m["version"].as_u64(), m["content"].as_str()),
        (Some(3), Some("v three"))
    );
}

#[tokio::test]
async fn only_text_is_edited() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let body = json!({"client_msg_id": "i1", "to": {"user": 222}, "kind": "image", "content": "https://x/1.png"});
    let (id, seq) = send(&alice, body).await;
    assert_eq!(
        code_of(edit(&alice, &id, "https://x/2.png").await),
        "invalid_argument"
    );
    let m = at_seq(&bob, "111-222", seq).await;
    assert_eq!(
        (m["version"].as_u64(), m["content"].as_str()),
        (Some(1), Some("https://x/1.png"))
    );
    // Someone else's message: forbidden, whatever its kind.
    let (text, _) = send(&bob, text_to_user("t1", 111, "bob's")).await;
    assert_eq!(code_of(edit(&alice, &text, "alice's").await), "forbidden");
    let conv = alice.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(conv["seq"], 2, "no edit command appended");
}

/// PROTOCOL.md 6: "Only the sender may edit" (PROTOCOL.md 1: `forbidden` for "a member
/// editing another's message"). A group's owner and admins may recall any message, but not
/// edit one: their edit of a member's message answers 403 `forbidden` and changes nothing.
#[tokio::test]
async fn a_group_owner_or_admin_editing_a_members_message_is_forbidden() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let carol = s.user(333).await;
    let gid = new_group_named(&alice, "g", &[222, 333]).await;
    alice
        .put(&format!("/v1/groups/{gid}/admins/222"), None)
        .await
        .unwrap();
    let (id, seq) = send(&carol, text_to_conv("c1", &gid, "carol's words")).await;
    for (h, who) in [(&alice, "the owner"), (&bob, "an admin")] {
        let path = format!("/v1/messages/{id}");
        let body = json!({"content": "not carol's"});
        assert_eq!(
            status_and_code(h, reqwest::Method::PATCH, &path, Some(&body)).await,
            (403, "forbidden".to_owned()),
            "{who}"
        );
    }
    let m = at_seq(&carol, &gid, seq).await;
    assert_eq!(
        (m["version"].as_u64(), m["content"].as_str()),
        (Some(1), Some("carol's words"))
    );
    assert_eq!(
        newest_seq(&alice, &gid).await,
        seq,
        "no edit command appended"
    );
    // The sender still may.
    let m = edit(&carol, &id, "carol's, edited").await.unwrap();
    assert_eq!(m["version"], 2);
}

#[tokio::test]
async fn a_late_edit_is_refused() {
    let s = spawn_with(|c| c.edit_window_secs = 1).await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let (id, seq) = send(&alice, text_to_user("e1", 222, "first")).await;
    edit(&alice, &id, "second")
        .await
        .expect("within the window");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(code_of(edit(&alice, &id, "third").await), "window_expired");
    let m = at_seq(&bob, "111-222", seq).await;
    assert_eq!(
        (m["version"].as_u64(), m["content"].as_str()),
        (Some(2), Some("second"))
    );
}

#[tokio::test]
async fn delete_for_me_hides_the_message_only_for_the_caller() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let (m1, s1) = send(&alice, text_to_user("d1", 222, "keep")).await;
    let (m2, s2) = send(&alice, text_to_user("d2", 222, "hide me")).await;

    let r = bob.delete(&format!("/v1/messages/{m2}")).await.unwrap();
    assert_eq!(
        (r["status"].as_str(), r["content"].as_str()),
        (Some("deleted"), Some(""))
    );
    let page = bob.get("/v1/conversations/111-222/messages").await.unwrap();
    assert_eq!(
        page_seqs(&page),
        vec![s1, s2],
        "the message keeps its place"
    );
    let hidden = at_seq(&bob, "111-222", s2).await;
    assert_eq!(hidden["msg_id"], m2.as_str());
    assert_eq!(
        (hidden["status"].as_str(), hidden["content"].as_str()),
        (Some("deleted"), Some(""))
    );
    let kept = at_seq(&bob, "111-222", s1).await;
    assert_eq!(
        (kept["status"].as_str(), kept["content"].as_str()),
        (Some("normal"), Some("keep"))
    );
    // The sender still has it.
    let theirs = at_seq(&alice, "111-222", s2).await;
    assert_eq!(
        (theirs["status"].as_str(), theirs["content"].as_str()),
        (Some("normal"), Some("hide me"))
    );
    let c = bob.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(c["last_message"]["msg_id"], m2.as_str());
    assert_eq!(c["last_message"]["status"], "deleted");
    assert_eq!(c["last_message"]["content"], "");
    let c = alice.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(c["last_message"]["content"], "hide me");
    // Deleting for me appends nothing, and a stranger cannot do it.
    let conv = alice.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(conv["seq"], 2);
    let carol = s.user(333).await;
    let code = code_of(carol.delete(&format!("/v1/messages/{m1}")).await);
    assert!(code == "not_found" || code == "not_member", "{code}");
    let still = at_seq(&alice, "111-222", s1).await;
    assert_eq!(still["status"], "normal");
    // Pulled through the inbox, it reads deleted for bob too.
    let tb = s.token(222).await;
    let mut b = s.ws(&tb, "b").await;
    let pulled = request(
        &mut b,
        json!({"type": "pull", "chain": "user", "from": 1, "to": 10}),
        1,
    )
    .await;
    let item = pulled["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["message"]["msg_id"] == m2.as_str())
        .cloned()
        .expect("in bob's inbox");
    assert_eq!(item["message"]["status"], "deleted");
    assert_eq!(item["message"]["content"], "");
}

#[tokio::test]
async fn admin_delete_removes_the_message_for_everyone_and_keeps_its_seq() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    send(&alice, text_to_user("a1", 222, "one")).await;
    let (m2, s2) = send(&alice, text_to_user("a2", 222, "bad words")).await;
    send(&bob, text_to_user("b1", 111, "three")).await;

    assert_eq!(
        code_of(alice.delete(&format!("/v1/admin/messages/{m2}")).await),
        "unauthorized"
    );
    let r = s
        .admin
        .delete(&format!("/v1/admin/messages/{m2}"))
        .await
        .unwrap();
    assert_eq!(r["status"], "deleted");
    assert_eq!(r["content"], "");
    assert_eq!(r["seq"], s2);
    for h in [&alice, &bob] {
        let page = h.get("/v1/conversations/111-222/messages").await.unwrap();
        assert_eq!(page_seqs(&page), vec![1, 2, 3]);
        let m = at_seq(h, "111-222", s2).await;
        assert_eq!(m["msg_id"], m2.as_str());
        assert_eq!(
            (m["status"].as_str(), m["content"].as_str()),
            (Some("deleted"), Some(""))
        );
    }
    let audit = s
        .admin
        .get(&format!("/v1/admin/messages/{m2}"))
        .await
        .unwrap();
    assert_eq!(audit["message"]["status"], "deleted");
    assert_eq!(audit["message"]["seq"], s2);
    // The chain goes on after it.
    let (_, s4) = send(&alice, text_to_user("a3", 222, "four")).await;
    assert_eq!(s4, 4);
    // A deleted message is neither edited nor recalled.
    assert!(edit(&alice, &m2, "again").await.is_err());
    assert!(recall(&alice, &m2).await.is_err());
    assert_eq!(
        code_of(s.admin.delete("/v1/admin/messages/12345").await),
        "not_found"
    );
}

/// PROTOCOL.md 6: an admin delete removes the message "for everyone (status `deleted`,
/// content gone, seq kept)": its `extra` (a custom message's payload) and `mentions` go
/// with its content, and so do an edited message's earlier versions, from the admin audit
/// too.
#[tokio::test]
async fn admin_delete_wipes_extra_mentions_and_every_version() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _bob = s.user(222).await;
    let g = new_group(&alice, &[222]).await;
    let card = json!({"title": "secret card", "n": 7});
    let (custom, _) = send(
        &alice,
        json!({"client_msg_id": "c1", "to": {"conversation": g}, "kind": "custom",
               "content": "card", "extra": card, "mentions": [222]}),
    )
    .await;
    let (edited, _) = send(&alice, text_to_conv("t1", &g, "first words")).await;
    edit(&alice, &edited, "second words").await.expect("edit");
    // Before the deletion the audit holds it all, so what goes is the deletion's doing.
    let before = s
        .admin
        .get(&format!("/v1/admin/messages/{custom}"))
        .await
        .unwrap();
    assert_eq!(
        (&before["message"]["extra"], &before["message"]["mentions"]),
        (&card, &json!([222]))
    );
    let before = s
        .admin
        .get(&format!("/v1/admin/messages/{edited}"))
        .await
        .unwrap();
    let contents: Vec<&str> = before["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, vec!["first words", "second words"]);

    for id in [&custom, &edited] {
        let r = s
            .admin
            .delete(&format!("/v1/admin/messages/{id}"))
            .await
            .unwrap();
        assert_eq!(
            (r["status"].as_str(), r["content"].as_str()),
            (Some("deleted"), Some("")),
            "{r}"
        );
        assert!(r["extra"].is_null(), "{r}");
        assert_eq!(r["mentions"], json!([]), "{r}");
        let audit = s
            .admin
            .get(&format!("/v1/admin/messages/{id}"))
            .await
            .unwrap();
        let m = &audit["message"];
        assert_eq!(
            (m["status"].as_str(), m["content"].as_str()),
            (Some("deleted"), Some("")),
            "{audit}"
        );
        assert!(m["extra"].is_null(), "{audit}");
        assert_eq!(m["mentions"], json!([]), "{audit}");
        let versions = audit["versions"].as_array().unwrap();
        assert!(!versions.is_empty(), "{audit}");
        for v in versions {
            assert_eq!(v["content"], "", "{audit}");
        }
    }
    // The edited message keeps its two versions, emptied.
    let audit = s
        .admin
        .get(&format!("/v1/admin/messages/{edited}"))
        .await
        .unwrap();
    assert_eq!(audit["versions"].as_array().unwrap().len(), 2, "{audit}");
}

/// A message keeps at most 100 versions (the original and 99 edits): each may hold the
/// largest content and `versions` answers them all, so an edit past that is a `conflict`,
/// and the message stays at its last version.
#[tokio::test]
async fn a_message_keeps_at_most_100_versions() {
    let s = spawn_server().await;
    let alice = s.user(701).await;
    let _ = s.user(702).await;
    let sent = alice
        .post("/v1/messages", &text_to_user("v", 702, "v1"))
        .await
        .unwrap();
    let id = sent["msg_id"].as_str().unwrap().to_owned();
    for v in 2..=100 {
        let m = alice
            .patch(
                &format!("/v1/messages/{id}"),
                &json!({"content": format!("v{v}")}),
            )
            .await
            .unwrap();
        assert_eq!(m["version"], v);
    }
    assert_eq!(
        code_of(
            alice
                .patch(&format!("/v1/messages/{id}"), &json!({"content": "v101"}))
                .await
        ),
        "conflict"
    );
    let versions = alice
        .get(&format!("/v1/messages/{id}/versions"))
        .await
        .unwrap();
    assert_eq!(versions["versions"].as_array().unwrap().len(), 100);
}

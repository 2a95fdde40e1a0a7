//! Bad input: every malformed frame or request gets its error and the server keeps serving.

use crate::*;
use reqwest::Method;
use serde_json::{Value, json};

async fn connected() -> (TestServer, WsConn) {
    let s = spawn_server().await;
    let t = s.token(111).await;
    let _ = s.token(222).await;
    let ws = s.ws(&t, "d").await;
    (s, ws)
}

async fn expect_error(ws: &mut WsConn, code: &str) -> Value {
    let v = ws
        .recv_until(WAIT, |v| v["type"] == "error")
        .await
        .unwrap()
        .expect("an error frame");
    assert_eq!(v["code"], code, "{v}");
    assert!(v["message"].is_string());
    v
}

#[tokio::test]
async fn malformed_frames_get_invalid_argument_and_the_connection_stays() {
    let (_s, mut ws) = connected().await;
    ws.send_text("not json".into()).await.unwrap();
    expect_error(&mut ws, "invalid_argument").await;
    ws.send_text("[1,2]".into()).await.unwrap();
    expect_error(&mut ws, "invalid_argument").await;
    ws.send(&json!({"req": 5})).await.unwrap();
    let e = expect_error(&mut ws, "invalid_argument").await;
    assert_eq!(e["req"], 5);
    ws.send(&json!({"type": "teleport", "req": 6}))
        .await
        .unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 6);
    // Wrong field types.
    ws.send(&json!({"type": "send", "req": 7, "client_msg_id": 12, "to": {"user": 222}, "kind": "text", "content": "x"})).await.unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 7);
    ws.send(&json!({"type": "send", "req": 8, "client_msg_id": "ok", "to": {"user": "222"}, "kind": "text", "content": "x"})).await.unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 8);
    ws.send(&json!({"type": "send", "req": 9, "client_msg_id": "bad id!", "to": {"user": 222}, "kind": "text", "content": "x"})).await.unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 9);
    ws.send(&json!({"type": "send", "req": 10, "client_msg_id": "k", "to": {"user": 222}, "kind": "hologram", "content": "x"})).await.unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 10);
    ws.send(&json!({"type": "send", "req": 11, "client_msg_id": "k", "to": {"user": 222}, "kind": "text", "content": ""})).await.unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 11);
    ws.send(&json!({"type": "send", "req": 12, "client_msg_id": "k", "to": {}, "kind": "text", "content": "x"})).await.unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 12);
    ws.send_binary(vec![1, 2, 3]).await.unwrap();
    expect_error(&mut ws, "invalid_argument").await;
    // A binary frame holding a JSON object: refused too, with its `req`.
    ws.send_binary(br#"{"type":"ping","req":77}"#.to_vec())
        .await
        .unwrap();
    assert_eq!(expect_error(&mut ws, "invalid_argument").await["req"], 77);
    // A `req` or `type` that is not an integer or a string: refused, without its `req`.
    for bad in [
        json!({"type": "ping", "req": "13"}),
        json!({"type": "ping", "req": [[1, 2], {"a": [3]}]}),
        json!({"type": "ping", "req": 1.5}),
        json!({"type": {"t": "ping"}, "req": 14}),
    ] {
        ws.send(&bad).await.unwrap();
        let e = expect_error(&mut ws, "invalid_argument").await;
        let expected_req = if bad["req"] == 14 {
            json!(14)
        } else {
            Value::Null
        };
        assert_eq!(e["req"], expected_req, "{bad} answered {e}");
    }
    // Still serving.
    let ack = request(
        &mut ws,
        send_frame(text_to_user("fine", 222, "still here")),
        13,
    )
    .await;
    assert_eq!(ack["type"], "send_ack");
}

#[tokio::test]
async fn oversized_content_and_frames() {
    let s = spawn_with(|c| c.max_content_bytes = 1000).await;
    let t = s.token(111).await;
    let _ = s.token(222).await;
    let mut ws = s.ws(&t, "d").await;
    let big = "x".repeat(1001);
    ws.send(&json!({"type": "send", "req": 1, "client_msg_id": "b", "to": {"user": 222}, "kind": "text", "content": big})).await.unwrap();
    assert_eq!(expect_error(&mut ws, "payload_too_large").await["req"], 1);
    let alice = s.user(111).await;
    assert_eq!(
        code_of(
            alice
                .post("/v1/messages", &text_to_user("b2", 222, &big))
                .await
        ),
        "payload_too_large"
    );
    // A frame over 1 MiB that the server still reads: payload_too_large, connection kept.
    // Its reply carries its `req`, like every reply.
    let frame = json!({"type": "ping", "req": 9, "pad": "y".repeat((1 << 20) + 10)});
    ws.send(&frame).await.unwrap();
    assert_eq!(expect_error(&mut ws, "payload_too_large").await["req"], 9);
    let pong = request(&mut ws, json!({"type": "ping"}), 2).await;
    assert_eq!(pong["type"], "pong");
    // A frame the server will not read whole: closed with 1009.
    let huge = "z".repeat(3 << 20);
    let _ = ws.send_text(huge).await;
    assert_eq!(ws.closed(WAIT).await, Some(1009));
}

/// Content over the limit, sent again and again, counts as bad frames too (each costs its
/// parsing): past 100 in 10 s the connection is closed with 1008, each one answered
/// `payload_too_large` until then.
#[tokio::test]
async fn a_connection_that_keeps_sending_oversized_content_is_closed_with_1008() {
    let (_s, mut ws) = connected().await;
    let content = "x".repeat(65_537);
    let mut answered = 0;
    for i in 0..150 {
        let mut send = send_frame(text_to_user(&format!("big-{i}"), 222, &content));
        send["req"] = json!(i);
        if ws.send(&send).await.is_err() {
            break;
        }
    }
    while let Ok(Some(f)) = ws.recv(WAIT).await {
        assert_eq!(f["code"], "payload_too_large", "{f}");
        answered += 1;
    }
    assert_eq!(ws.closed_with.as_ref().map(|c| c.0), Some(1008));
    assert!(
        (100..150).contains(&answered),
        "{answered} answered before the close"
    );
}

#[tokio::test]
async fn a_connection_that_keeps_sending_garbage_is_closed_with_1008() {
    let (_s, mut ws) = connected().await;
    // A client checking its validation case by case on one connection is answered every
    // time: thirty refused sends, each with its error, and the connection stays.
    for i in 0..30 {
        let e = request(
            &mut ws,
            send_frame(text_to_user(&format!("self-{i}"), 111, "to myself")),
            i,
        )
        .await;
        assert_eq!(
            (e["code"].as_str(), e["req"].as_i64()),
            (Some("invalid_argument"), Some(i))
        );
    }
    let pong = request(&mut ws, json!({"type": "ping"}), 99).await;
    assert_eq!(pong["type"], "pong");
    // Garbage on top (the refused sends counted too): past 100 bad frames in 10 s, 1008.
    // Far more is written than the server reads before it closes: it reads and drops the
    // rest until the client's close frame, or its socket would be reset with unread bytes,
    // and the reset could overtake the close frame.
    for _ in 0..2000 {
        if ws.send_text("garbage".into()).await.is_err() {
            break;
        }
    }
    assert_eq!(ws.closed(WAIT).await, Some(1008));
}

/// "Every body is JSON (UTF-8)" and "Unknown fields in requests are ignored": a body is read
/// as JSON whatever its `Content-Type` says, or without one (`curl -d`, a bare `fetch`).
#[tokio::test]
async fn json_bodies_are_read_whatever_their_content_type_and_unknown_fields_ignored() {
    let s = spawn_server().await;
    let _ = s.user(111).await;
    let _ = s.user(222).await;
    let token = s.token(111).await;
    let client = reqwest::Client::new();
    for (i, content_type) in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ]
    .into_iter()
    .enumerate()
    {
        let body = json!({
            "client_msg_id": format!("ct-{i}"),
            "to": {"user": 222},
            "kind": "text",
            "content": "hi",
            "some_future_field": {"x": 1},
        });
        let mut req = client
            .post(format!("{}/v1/messages", s.base))
            .bearer_auth(&token)
            .body(body.to_string());
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 200, "content type {content_type:?}");
        let ack: Value = resp.json().await.unwrap();
        assert_eq!(ack["client_msg_id"], format!("ct-{i}"));
        assert_eq!(ack["seq"], i as u64 + 1);
    }
    // A body over the server's body limit is `payload_too_large` (413), whatever its type.
    let resp = client
        .post(format!("{}/v1/messages", s.base))
        .bearer_auth(&token)
        .body(format!(
            r#"{{"pad":"{}"}}"#,
            "p".repeat((1 << 20) + 100 * 1024)
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "payload_too_large");
    // Every optional field of the message object given as `null` reads as absent.
    let alice = s.user(111).await;
    let ack = alice
        .post(
            "/v1/messages",
            &json!({"client_msg_id": "nulls", "to": {"user": 222}, "kind": "text", "content": "n",
                    "extra": null, "reply_to": null, "mentions": null}),
        )
        .await
        .unwrap();
    assert_eq!(ack["seq"], 4);
}

#[tokio::test]
async fn http_bad_input_gets_protocol_errors() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let (status, body) = alice
        .raw(
            Method::POST,
            "/v1/messages",
            Some(&json!({"nonsense": true})),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("invalid_argument"))
    );
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{}/v1/messages", s.base))
        .bearer_auth(s.token(111).await)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "invalid_argument");
    assert_eq!(
        code_of(alice.get("/v1/conversations/not-an-id/messages").await),
        "invalid_argument"
    );
    assert_eq!(
        code_of(alice.get("/v1/conversations/222-111/messages").await),
        "invalid_argument"
    );
    assert_eq!(
        code_of(
            alice
                .get("/v1/conversations/111-222/messages?before=x")
                .await
        ),
        "invalid_argument"
    );
    assert_eq!(
        code_of(alice.get("/v1/messages/abc/versions").await),
        "invalid_argument"
    );
    assert_eq!(
        code_of(alice.get("/v1/messages/123/versions").await),
        "not_found"
    );
    let (status, body) = alice
        .raw(Method::GET, "/v1/nothing-here", None)
        .await
        .unwrap();
    assert_eq!((status, body["code"].as_str()), (404, Some("not_found")));
    assert_eq!(
        code_of(
            s.admin
                .post("/v1/admin/users", &json!({"user_id": 0}))
                .await
        ),
        "invalid_argument"
    );
    assert_eq!(
        code_of(
            s.admin
                .post("/v1/admin/users", &json!({"user_id": 9007199254740992u64}))
                .await
        ),
        "invalid_argument"
    );
    assert_eq!(
        code_of(
            s.admin
                .post(
                    "/v1/admin/tokens",
                    &json!({"user_id": 111, "ttl_secs": 31_536_001u64})
                )
                .await
        ),
        "invalid_argument",
        "over --max-token-ttl-secs"
    );
}

/// PROTOCOL.md 1's `invalid_argument` ("malformed JSON, wrong types, bad ids, empty
/// content, unknown kind") for the fields of `POST /v1/messages`: a kind that is no kind, a
/// command kind (those are the server's to write), empty or missing content, a target naming
/// both a user and a conversation, an empty `client_msg_id` (1-64 characters). Each answers
/// 400 and stores nothing: the chat's newest seq and the peer's inbox stay where they were.
#[tokio::test]
async fn bad_send_fields_answer_400_invalid_argument_and_store_nothing() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    alice
        .post("/v1/messages", &text_to_user("good", 222, "kept"))
        .await
        .unwrap();
    let with = |cmid: &str, field: &str, value: Value| {
        let mut body = text_to_user(cmid, 222, "x");
        body[field] = value;
        body
    };
    let mut no_content = text_to_user("no-content", 222, "x");
    no_content.as_object_mut().unwrap().remove("content");
    let cases = [
        (
            "an unknown kind",
            with("hologram", "kind", json!("hologram")),
        ),
        (
            "a command kind",
            with("command", "kind", json!("group_created")),
        ),
        ("empty content", with("empty", "content", json!(""))),
        ("no content", no_content),
        (
            "both targets",
            with(
                "both",
                "to",
                json!({"user": 222, "conversation": "111-222"}),
            ),
        ),
        ("an empty client_msg_id", text_to_user("", 222, "x")),
    ];
    for (what, body) in &cases {
        assert_eq!(
            status_and_code(&alice, Method::POST, "/v1/messages", Some(body)).await,
            (400, "invalid_argument".to_owned()),
            "{what}: {body}"
        );
    }
    assert_eq!(newest_seq(&alice, "111-222").await, 1, "nothing stored");
    let inbox = bob.get("/v1/sync?wait_ms=0").await.unwrap();
    assert_eq!(inbox["user_seq"], 1, "nothing delivered: {inbox}");
}

/// PROTOCOL.md 1: `not_found` is for "no such ... user": a WebSocket send to a user id that
/// was never registered answers an error frame `not_found` carrying the send's `req`, and
/// the connection goes on.
#[tokio::test]
async fn a_websocket_send_to_an_unregistered_user_answers_not_found_with_its_req() {
    let (_s, mut ws) = connected().await;
    let e = request(&mut ws, send_frame(text_to_user("nobody", 98765, "x")), 5).await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str(), e["req"].as_i64()),
        (Some("error"), Some("not_found"), Some(5)),
        "{e}"
    );
    assert!(e["message"].is_string(), "{e}");
    let ack = request(&mut ws, send_frame(text_to_user("somebody", 222, "x")), 6).await;
    assert_eq!(
        (ack["type"].as_str(), ack["seq"].as_u64()),
        (Some("send_ack"), Some(1)),
        "{ack}"
    );
}

/// `ttl_secs: 0` mints a token that has already expired (PROTOCOL.md 6, extension): a way to
/// see an expired token refused, over HTTP and on the upgrade, without waiting.
#[tokio::test]
async fn a_token_minted_with_ttl_0_is_already_expired() {
    let s = spawn_server().await;
    let _ = s.user(3401).await;
    let minted = s
        .admin
        .post("/v1/admin/tokens", &json!({"user_id": 3401, "ttl_secs": 0}))
        .await
        .unwrap();
    let token = minted["token"].as_str().unwrap().to_owned();
    let expired = s.anon().with_bearer(token.clone());
    assert_eq!(
        code_of(expired.get("/v1/conversations").await),
        "unauthorized"
    );
    match WsConn::connect(&s.ws_base, &token, "d").await {
        Err(pigeon_client::ClientError::Api { status, .. }) => assert_eq!(status, 401),
        Err(e) => panic!("refused otherwise than with 401: {e}"),
        Ok(_) => panic!("an expired token connected"),
    }
}

#[tokio::test]
async fn reading_someone_elses_conversation_reveals_nothing() {
    let s = spawn_server().await;
    let bob = s.user(222).await;
    let _ = s.user(333).await;
    let ack = bob
        .post("/v1/messages", &text_to_user("p", 333, "private"))
        .await
        .unwrap();
    let msg_id = ack["msg_id"].as_str().unwrap();
    let t = s.token(111).await;
    let eve = s.anon().with_bearer(t.clone());
    for path in [
        "/v1/conversations/222-333".to_string(),
        "/v1/conversations/222-333/messages".to_string(),
        "/v1/conversations/222-333/messages/range?from=1&to=1".to_string(),
        "/v1/conversations/222-333/receipts?seq=1".to_string(),
    ] {
        let (status, body) = eve.raw(Method::GET, &path, None).await.unwrap();
        assert!(status == 403 || status == 404, "{path}: {status}");
        assert!(body["code"] == "not_member" || body["code"] == "not_found");
        assert!(!body.to_string().contains("private"));
    }
    assert_eq!(
        code_of(eve.get(&format!("/v1/messages/{msg_id}/versions")).await),
        "not_found"
    );
    assert_eq!(
        code_of(
            eve.post(&format!("/v1/messages/{msg_id}/recall"), &json!({}))
                .await
        ),
        "not_found"
    );
    let mut ws = s.ws(&t, "e").await;
    let r = request(&mut ws, json!({"type": "pull", "chain": "conversation", "conversation_id": "222-333", "from": 1, "to": 1}), 3).await;
    assert_eq!(r["type"], "error");
    assert_eq!(r["code"], "not_member");
    let r = request(
        &mut ws,
        json!({"type": "read", "conversation_id": "222-333", "seq": 1}),
        4,
    )
    .await;
    assert_eq!(r["code"], "not_member");
}

#[tokio::test]
async fn sending_too_fast_answers_rate_limited_with_a_retry_hint() {
    let s = spawn_with(|c| c.send_rate_per_sec = 5).await;
    let _ = s.user(2).await;
    // Connected first: the WebSocket send below follows the burst at once (the allowance
    // refills a send every 200 ms, and a connection made under load can take that long).
    let t = s.token(1).await;
    let mut ws = s.ws(&t, "d").await;
    // Over plain reqwest, to see the headers of the first refusal (a request made after the
    // burst could find the allowance refilled: a send every 200 ms).
    let client = reqwest::Client::new();
    let mut limited = None;
    for i in 0..100 {
        let resp = client
            .post(format!("{}/v1/messages", s.base))
            .bearer_auth(&t)
            .json(&text_to_user(&format!("r{i}"), 2, "x"))
            .send()
            .await
            .unwrap();
        if resp.status().as_u16() == 429 {
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            limited = Some((retry_after, resp.json::<Value>().await.unwrap()));
            break;
        }
        assert_eq!(resp.status().as_u16(), 200);
    }
    let (retry_after, body) =
        limited.expect("a burst of 100 is over a limit of 5/s (bursts of 50)");
    assert_eq!(body["code"], "rate_limited");
    assert!(body["retry_after_ms"].as_u64().unwrap() >= 1);
    // HTTP's own `Retry-After` too, in whole seconds rounded up (a send refills in 200 ms).
    assert_eq!(retry_after.as_deref(), Some("1"));
    // The WebSocket path shares the user's allowance.
    let e = request(&mut ws, send_frame(text_to_user("ws-1", 2, "x")), 1).await;
    assert_eq!(e["code"], "rate_limited");
    assert!(e["retry_after_ms"].is_u64());
    tokio::time::sleep(Duration::from_millis(
        e["retry_after_ms"].as_u64().unwrap() + 50,
    ))
    .await;
    let ack = request(&mut ws, send_frame(text_to_user("ws-2", 2, "x")), 2).await;
    assert_eq!(ack["type"], "send_ack", "allowed again after the hint");
}

/// Every write shares the send allowance, so none is a way around it: group changes (each
/// appends a command message to every member's inbox), edits and reads answer
/// `rate_limited` once the user's allowance is spent.
#[tokio::test]
async fn every_write_shares_the_send_rate_limit() {
    let s = spawn_with(|c| c.send_rate_per_sec = 2).await;
    let alice = s.user(1).await;
    let _ = s.user(2).await;
    let g = new_group_named(&alice, "limited", &[2]).await;
    let mut limited = None;
    for i in 0..50 {
        let (status, body) = alice
            .raw(
                Method::PATCH,
                &format!("/v1/groups/{g}"),
                Some(&json!({"name": format!("n{i}")})),
            )
            .await
            .unwrap();
        if status == 429 {
            limited = Some(body);
            break;
        }
        assert_eq!(status, 200, "{body}");
    }
    let body = limited.expect("50 group changes are over 2/s (bursts of 20)");
    assert_eq!(body["code"], "rate_limited");
    assert!(body["retry_after_ms"].as_u64().unwrap() >= 1);
    for (method, path, body) in [
        (
            Method::POST,
            format!("/v1/conversations/{g}/read"),
            json!({"seq": 1}),
        ),
        (
            Method::POST,
            "/v1/groups".to_owned(),
            json!({"name": "more", "members": [2]}),
        ),
    ] {
        let (status, answer) = alice.raw(method, &path, Some(&body)).await.unwrap();
        assert_eq!(
            (status, answer["code"].as_str()),
            (429, Some("rate_limited")),
            "{path}"
        );
    }
}

/// The error table of PROTOCOL.md 1: "`forbidden` | 403 | authenticated but not allowed",
/// "`not_member` | 403 | the caller is not a member of that conversation", "`muted` | 403 |
/// the caller is muted in that group" and "`conflict` | 409 | the request contradicts state
/// (group dismissed, user already a member)": the status and the code come together.
#[tokio::test]
async fn forbidden_not_member_muted_and_conflict_carry_their_http_status() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let _carol = s.user(333).await;
    let dave = s.user(444).await;
    let g = new_group(&alice, &[222, 333]).await;
    let post = Method::POST;

    // A plain member updating the group: 403 forbidden.
    assert_eq!(
        status_and_code(
            &bob,
            Method::PATCH,
            &format!("/v1/groups/{g}"),
            Some(&json!({"name": "mine"})),
        )
        .await,
        (403, "forbidden".to_owned())
    );
    // A stranger writing into the group: 403 not_member.
    assert_eq!(
        status_and_code(
            &dave,
            post.clone(),
            "/v1/messages",
            Some(&text_to_conv("d1", &g, "let me in")),
        )
        .await,
        (403, "not_member".to_owned())
    );
    // A muted member sending: 403 muted.
    alice
        .post(
            &format!("/v1/groups/{g}/mutes"),
            &json!({"user_id": 222, "duration_secs": 600}),
        )
        .await
        .unwrap();
    assert_eq!(
        status_and_code(
            &bob,
            post.clone(),
            "/v1/messages",
            Some(&text_to_conv("b1", &g, "hello?")),
        )
        .await,
        (403, "muted".to_owned())
    );
    // Inviting someone who is already a member: 409 conflict.
    assert_eq!(
        status_and_code(
            &alice,
            post.clone(),
            &format!("/v1/groups/{g}/members"),
            Some(&json!({"user_ids": [333]})),
        )
        .await,
        (409, "conflict".to_owned())
    );
    // Sending into a dismissed group: 409 conflict.
    alice.delete(&format!("/v1/groups/{g}")).await.unwrap();
    assert_eq!(
        status_and_code(
            &alice,
            post,
            "/v1/messages",
            Some(&text_to_conv("a1", &g, "anyone?")),
        )
        .await,
        (409, "conflict".to_owned())
    );
}

/// The error table of PROTOCOL.md 1: "`window_expired` | 409 | recall or edit after its time
/// window", over HTTP for both a late edit and a late recall.
#[tokio::test]
async fn late_edits_and_recalls_answer_409_window_expired() {
    let s = spawn_with(|c| {
        c.edit_window_secs = 1;
        c.recall_window_secs = 1;
    })
    .await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    let ack = alice
        .post("/v1/messages", &text_to_user("late", 222, "first"))
        .await
        .unwrap();
    let id = ack["msg_id"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        status_and_code(
            &alice,
            Method::PATCH,
            &format!("/v1/messages/{id}"),
            Some(&json!({"content": "second"})),
        )
        .await,
        (409, "window_expired".to_owned())
    );
    assert_eq!(
        status_and_code(
            &alice,
            Method::POST,
            &format!("/v1/messages/{id}/recall"),
            None,
        )
        .await,
        (409, "window_expired".to_owned())
    );
}

/// The error table of PROTOCOL.md 1: "`payload_too_large` | 413 | content or frame over the
/// configured limit": content one byte over `--max-content-bytes` answers 413 over HTTP,
/// content exactly at the limit is stored.
#[tokio::test]
async fn content_over_the_limit_answers_413_payload_too_large() {
    let s = spawn_with(|c| c.max_content_bytes = 1000).await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    assert_eq!(
        status_and_code(
            &alice,
            Method::POST,
            "/v1/messages",
            Some(&text_to_user("big", 222, &"x".repeat(1001))),
        )
        .await,
        (413, "payload_too_large".to_owned())
    );
    let ack = alice
        .post(
            "/v1/messages",
            &text_to_user("fits", 222, &"x".repeat(1000)),
        )
        .await
        .expect("content at the limit is accepted");
    assert_eq!(ack["seq"], 1, "the refused send stored nothing");
}

/// One user holds at most `max-connections-per-user` WebSocket connections: one more is
/// refused before the upgrade with 429 `rate_limited` and a `retry_after_ms`
/// (PROTOCOL.md 5, extension), other users are not affected, and a connection that closes
/// makes room again.
#[tokio::test]
async fn one_user_holds_at_most_the_connections_per_user_limit() {
    let s = spawn_with(|c| c.max_connections_per_user = 2).await;
    let t = s.token(111).await;
    let phone = s.ws(&t, "phone").await;
    let _laptop = s.ws(&t, "laptop").await;
    match WsConn::connect(&s.ws_base, &t, "tablet").await {
        Err(pigeon_client::ClientError::Api { status, body }) => {
            assert_eq!((status, body.code.as_str()), (429, "rate_limited"));
            assert!(body.retry_after_ms.is_some_and(|ms| ms > 0), "{body:?}");
        }
        Err(e) => panic!("refused otherwise than with 429: {e}"),
        Ok(_) => panic!("a third connection was let in"),
    }
    // Upgrades racing each other are counted as they are let in, not once they are done:
    // of 20 at once from a user who holds one connection, exactly one more gets in.
    let other_device = s.token(333).await;
    let _first = s.ws(&other_device, "d0").await;
    let racing = (1..=20).map(|i| {
        let (base, t) = (s.ws_base.clone(), other_device.clone());
        tokio::spawn(async move { WsConn::connect(&base, &t, &format!("d{i}")).await })
    });
    let mut admitted = Vec::new();
    for attempt in racing.collect::<Vec<_>>() {
        match attempt.await.unwrap() {
            Ok(ws) => admitted.push(ws),
            Err(pigeon_client::ClientError::Api { status: 429, .. }) => {}
            Err(e) => panic!("refused otherwise than with 429: {e}"),
        }
    }
    assert_eq!(admitted.len(), 1, "the limit is 2 and one was held");
    // Another user is not held to this one's count.
    let other = s.token(222).await;
    let _bob = s.ws(&other, "phone").await;
    // Once one closes, there is room again (the hub lets it go as the socket ends).
    drop(phone);
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match WsConn::connect(&s.ws_base, &t, "tablet").await {
            Ok(_) => break,
            Err(e) => assert!(
                std::time::Instant::now() < deadline,
                "no room after a connection closed: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// At most `max-open-connections` TCP connections are open at once, HTTP and WebSocket
/// alike (PROTOCOL.md 2, extension): one more is answered 503 `unavailable` with a
/// `retry_after_ms` and closed, and an upgraded WebSocket keeps its place until it closes.
/// Past the connections being refused at once, new ones wait unanswered to be accepted.
/// (The bound keeps sockets from taking the file descriptors the store needs.)
#[tokio::test]
async fn connections_past_the_open_limit_are_refused_until_one_closes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    /// Asks for /healthz on a kept-alive connection.
    async fn ask(tcp: &mut TcpStream) {
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: pigeon\r\n\r\n")
            .await
            .unwrap();
    }
    /// What came, if it ends a head (or the connection) within `wait`.
    async fn answer(tcp: &mut TcpStream, wait: Duration) -> Option<String> {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        tokio::time::timeout(wait, async {
            loop {
                let n = tcp.read(&mut buf).await.unwrap_or(0);
                got.extend_from_slice(&buf[..n]);
                if n == 0 || got.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
        })
        .await
        .ok()?;
        Some(String::from_utf8_lossy(&got).into_owned())
    }
    /// A connection asking for /healthz is refused and closed.
    async fn refused(addr: &str) {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        ask(&mut tcp).await;
        let mut all = Vec::new();
        tokio::time::timeout(WAIT, tcp.read_to_end(&mut all))
            .await
            .expect("refused and closed at once")
            .unwrap();
        let all = String::from_utf8_lossy(&all);
        assert!(all.starts_with("HTTP/1.1 503"), "{all}");
        let body: Value = serde_json::from_str(&all[all.find("\r\n\r\n").unwrap() + 4..]).unwrap();
        assert_eq!(body["code"], "unavailable", "{body}");
        assert!(
            body["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0),
            "{body}"
        );
    }
    /// A connection whose /healthz is answered, retried while refused until a place frees.
    async fn served(addr: &str) -> TcpStream {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            ask(&mut tcp).await;
            let head = answer(&mut tcp, WAIT).await.unwrap();
            if head.starts_with("HTTP/1.1 200") {
                return tcp;
            }
            assert!(head.starts_with("HTTP/1.1 503"), "{head}");
            assert!(std::time::Instant::now() < deadline, "no place freed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let s = spawn_with(|c| c.max_open_connections = Some(2)).await;
    // The token through a client of its own, whose pooled connection closes with it.
    let token = {
        let admin = pigeon_client::Http::new(s.base.clone()).with_bearer(ADMIN_KEY);
        admin.upsert_user(111, "user111").await.unwrap();
        admin.mint_token(111, 3600).await.unwrap()
    };
    let addr = s.base.trim_start_matches("http://").to_owned();
    // The admin client's connection may still hold a place for a moment: until it is let
    // go, a connection is refused.
    let first = served(&addr).await;
    let deadline = std::time::Instant::now() + WAIT;
    let ws = loop {
        match WsConn::connect(&s.ws_base, &token, "phone").await {
            Ok(ws) => break ws,
            Err(pigeon_client::ClientError::Api { status: 503, .. }) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the admin's place stays taken"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    refused(&addr).await;
    drop(first);
    // Its place is given back as the server sees it close.
    let mut third = served(&addr).await;
    // The WebSocket, upgraded, still holds its place beside the third.
    refused(&addr).await;
    // Connections being refused are bounded too (one at once with two places): past those
    // that say nothing, one more waits unanswered until one of them is let go (their
    // heads' 2 s), then is refused.
    let mut silent = Vec::new();
    for _ in 0..pigeon_server::serve::refusing_at_once(2) {
        silent.push(TcpStream::connect(&addr).await.unwrap());
    }
    let mut waiting = TcpStream::connect(&addr).await.unwrap();
    ask(&mut waiting).await;
    assert_eq!(
        answer(&mut waiting, Duration::from_millis(500)).await,
        None,
        "accepted past the refusals' bound"
    );
    let head = answer(&mut waiting, WAIT)
        .await
        .expect("refused in the end");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    drop(silent);
    drop(ws);
    ask(&mut third).await;
    assert!(
        answer(&mut third, WAIT)
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200")
    );
    // Once the WebSocket closed, a new connection is served.
    served(&addr).await;
}

/// A place that comes free while the accept loop, having found none, waits for the next
/// client with a refusal in hand goes to that client: once the server has seen a
/// connection close, the next one is served, not told to retry.
#[tokio::test]
async fn a_place_freed_while_full_goes_to_the_next_client() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    async fn status_of_healthz(addr: &str) -> String {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: pigeon\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut all = Vec::new();
        tokio::time::timeout(WAIT, tcp.read_to_end(&mut all))
            .await
            .expect("answered")
            .unwrap();
        String::from_utf8_lossy(&all)
            .lines()
            .next()
            .unwrap_or("")
            .to_owned()
    }
    let s = spawn_with(|c| c.max_open_connections = Some(1)).await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let held = TcpStream::connect(&addr).await.unwrap();
    // Full: refused (and from here the loop waits for a client with a refusal in hand).
    assert_eq!(
        status_of_healthz(&addr).await,
        "HTTP/1.1 503 Service Unavailable"
    );
    // Once the client sees the server close it too, the server has let the socket, and its
    // place, go.
    let mut held = held;
    held.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, held.read_to_end(&mut rest))
        .await
        .expect("closed by the server")
        .unwrap();
    assert_eq!(status_of_healthz(&addr).await, "HTTP/1.1 200 OK");
}

/// A server whose every connection place is taken, with refusals under way and a client
/// waiting in the backlog, still stops at once when asked: the accept loop waits for a
/// place or the stop, whichever comes first.
#[tokio::test]
async fn a_full_server_stops_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    let mut s = spawn_with(|c| c.max_open_connections = Some(1)).await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let mut held = Vec::new();
    // One served, one being refused (silent), one more in the backlog.
    for _ in 0..1 + pigeon_server::serve::refusing_at_once(1) {
        held.push(TcpStream::connect(&addr).await.unwrap());
    }
    let mut waiting = TcpStream::connect(&addr).await.unwrap();
    waiting
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: pigeon\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), waiting.read(&mut buf))
            .await
            .is_err(),
        "the server was not full"
    );
    let running = s.running.take().unwrap();
    tokio::time::timeout(Duration::from_secs(5), running.shutdown())
        .await
        .expect("the server stopped while full");
}

/// PROTOCOL.md 5: "A frame over 1 MiB gets `payload_too_large`": a binary one on a
/// `pigeon.v1.json` connection (the default) too, rather than `invalid_argument` for its
/// being binary, and the connection stays.
#[tokio::test]
async fn a_binary_frame_over_1_mib_on_a_json_connection_is_payload_too_large() {
    let (_s, mut ws) = connected().await;
    ws.send_binary(vec![b'x'; (1 << 20) + 10]).await.unwrap();
    expect_error(&mut ws, "payload_too_large").await;
    let pong = request(&mut ws, json!({"type": "ping"}), 1).await;
    assert_eq!(pong["type"], "pong");
}

/// RFC 6455 8.1: a text frame that is not UTF-8 fails the connection with close code 1007
/// (PROTOCOL.md 5 says text frames carry JSON, which is UTF-8). `WsConn` only sends valid
/// text, so this client sends the frame itself: tungstenite's `Message::Frame` writes a text
/// frame with any payload, masked as a client's must be.
#[tokio::test]
async fn a_text_frame_that_is_not_utf8_is_closed_with_1007() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    let s = spawn_server().await;
    let t = s.token(111).await;
    let mut req = format!("{}/v1/ws?device_id=d", s.ws_base)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", format!("Bearer {t}").parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    let bad = vec![b'{', 0xff, 0xfe, b'}'];
    assert!(std::str::from_utf8(&bad).is_err());
    ws.send(Message::Frame(Frame::message(
        bad,
        OpCode::Data(Data::Text),
        true,
    )))
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    let code = loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Close(frame)))) => break frame.map(|f| u16::from(f.code)),
            // The hello, and anything else before the close.
            Ok(Some(Ok(_))) => continue,
            Ok(Some(Err(e))) => panic!("no close frame: {e}"),
            Ok(None) => panic!("the connection ended without a close frame"),
            Err(_) => panic!("not closed in time"),
        }
    };
    assert_eq!(code, Some(1007));
}

/// PROTOCOL.md 1: "`device_id`: 1-64 characters of `[A-Za-z0-9_-]`, chosen by the client".
/// The upgrade (`GET /v1/ws?device_id=D`) lets in a device id of 64 characters of that set
/// (and `hello` echoes it), and refuses, before upgrading, one of 65 characters, an empty one
/// and ones with a character outside the set, with 400 `invalid_argument` (PROTOCOL.md 1:
/// "bad ids"). `basics::websocket_upgrade_without_token_or_device_is_refused` covers only a
/// missing `device_id`. The token is valid, so a refusal can only be for the device id.
#[tokio::test]
async fn the_upgrade_takes_device_ids_of_64_characters_of_the_set_and_refuses_others() {
    let s = spawn_server().await;
    let t = s.token(111).await;
    let id64 = format!("Az09_-{}", "x".repeat(58));
    assert_eq!(id64.len(), 64);
    let ws = s.ws(&t, &id64).await;
    assert_eq!(ws.hello["device_id"], id64.as_str());
    // `WsConn::connect` puts the device id in the URL as given: these are query spellings
    // (`%20` is a space, `%C3%A9` an `é`, `%2F` a `/`).
    let id65 = "x".repeat(65);
    for bad in [
        id65.as_str(),
        "",
        "a.b",
        "a%20b",
        "caf%C3%A9",
        "a%2Fb",
        "a:b",
    ] {
        match WsConn::connect(&s.ws_base, &t, bad).await {
            Err(pigeon_client::ClientError::Api { status, body }) => assert_eq!(
                (status, body.code.as_str()),
                (400, "invalid_argument"),
                "device_id={bad}: {}",
                body.message
            ),
            Err(e) => panic!("device_id={bad}: refused otherwise than with 400: {e}"),
            Ok(ws) => panic!("device_id={bad} was let in: {}", ws.hello),
        }
    }
}

/// PROTOCOL.md 5: "`GET /v1/ws?device_id=D[&platform=ios|android|web|desktop][&token=T]`":
/// each listed platform is let in, and a value outside the list is refused before the
/// upgrade with 400 `invalid_argument` (a wrong field, PROTOCOL.md 1). The token and the
/// device id are valid, so a refusal can only be for the platform.
#[tokio::test]
async fn the_upgrade_takes_the_listed_platforms_and_refuses_others() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let s = spawn_server().await;
    let t = s.token(111).await;
    let upgrade = |platform: &str| {
        let mut req = format!(
            "{}/v1/ws?device_id=dev-{platform}&platform={platform}",
            s.ws_base
        )
        .into_client_request()
        .unwrap();
        req.headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
        req
    };
    let mut held = Vec::new();
    // An empty one is one not given (PROTOCOL.md 6, extension).
    for platform in ["ios", "android", "web", "desktop", ""] {
        let ws = WsConn::connect_request(upgrade(platform))
            .await
            .unwrap_or_else(|e| panic!("platform={platform} is refused: {e}"));
        assert_eq!(ws.hello["type"], "hello");
        assert_eq!(ws.hello["user_id"], 111);
        held.push(ws);
    }
    for platform in ["windows", "tv"] {
        match WsConn::connect_request(upgrade(platform)).await {
            Err(pigeon_client::ClientError::Api { status, body }) => assert_eq!(
                (status, body.code.as_str()),
                (400, "invalid_argument"),
                "platform={platform}: {}",
                body.message
            ),
            Err(e) => panic!("platform={platform}: refused otherwise than with 400: {e}"),
            Ok(ws) => panic!("platform={platform} was let in: {}", ws.hello),
        }
    }
}

/// PROTOCOL.md 1: `not_found` is for "no such ... conversation, group", `not_member` for a
/// conversation the caller is not in. Every conversation endpoint, and `pull` over
/// WebSocket, tells a group that was never created (404 `not_found`) from one that exists
/// without the caller (403 `not_member`), and neither answer carries the conversation's data.
/// A single chat of two other users answers `not_member` whether they have talked or not:
/// its existence would tell who talks to whom.
#[tokio::test]
async fn a_missing_conversation_is_not_found_and_another_one_not_member_everywhere() {
    let s = spawn_server().await;
    let owner = s.user(3001).await;
    let _ = s.user(3002).await;
    let stranger_token = s.token(3003).await;
    let stranger = s.anon().with_bearer(stranger_token.clone());
    let existing = new_group_named(&owner, "theirs", &[3002]).await;
    owner
        .post("/v1/messages", &text_to_conv("m1", &existing, "private"))
        .await
        .unwrap();
    let mut ws = s.ws(&stranger_token, "d").await;
    let _ = s.user(3004).await;
    owner
        .post("/v1/messages", &text_to_user("dm", 3002, "private"))
        .await
        .unwrap();
    for (conv, status, code) in [
        ("g123456789", 404, "not_found"),
        (existing.as_str(), 403, "not_member"),
        ("3001-3002", 403, "not_member"),
        ("3001-3004", 403, "not_member"),
    ] {
        let calls: Vec<(Method, String, Option<Value>)> = vec![
            (Method::GET, format!("/v1/conversations/{conv}"), None),
            (
                Method::GET,
                format!("/v1/conversations/{conv}/messages"),
                None,
            ),
            (
                Method::GET,
                format!("/v1/conversations/{conv}/messages/range?from=1&to=2"),
                None,
            ),
            (
                Method::POST,
                format!("/v1/conversations/{conv}/read"),
                Some(json!({"seq": 1})),
            ),
            (
                Method::GET,
                format!("/v1/conversations/{conv}/receipts?seq=1"),
                None,
            ),
            (
                Method::PUT,
                format!("/v1/conversations/{conv}/settings"),
                Some(json!({"pinned": true})),
            ),
            (
                Method::POST,
                "/v1/messages".to_owned(),
                Some(text_to_conv("probe", conv, "hello?")),
            ),
        ];
        for (method, path, body) in calls {
            let (got, answer) = stranger
                .raw(method.clone(), &path, body.as_ref())
                .await
                .unwrap();
            assert_eq!(
                (got, answer["code"].as_str()),
                (status, Some(code)),
                "{method} {path}: {answer}"
            );
            assert!(!answer.to_string().contains("private"), "{answer}");
        }
        let pulled = request(
            &mut ws,
            json!({"type": "pull", "chain": "conversation", "conversation_id": conv}),
            1,
        )
        .await;
        assert_eq!(
            (pulled["type"].as_str(), pulled["code"].as_str()),
            (Some("error"), Some(code)),
            "{pulled}"
        );
    }
}

/// Seqs a client gives past what SQLite's integers hold (2^63 and up, up to u64::MAX) read
/// as "beyond everything": a pull to u64::MAX is complete, an inbox long poll after it has
/// nothing newer, a history page after it is empty, and an ack of it neither breaks the
/// connection nor makes a later pull wrap around to old messages.
#[tokio::test]
async fn seqs_past_sqlites_integers_read_as_beyond_everything() {
    let s = spawn_server().await;
    let ta = s.token(3101).await;
    let alice = s.anon().with_bearer(ta.clone());
    let bob = s.user(3102).await;
    for i in 0..3 {
        bob.post(
            "/v1/messages",
            &text_to_user(&format!("big-{i}"), 3101, "x"),
        )
        .await
        .unwrap();
    }
    let huge = u64::MAX;
    let mut ws = s.ws(&ta, "d").await;
    let pulled = request(
        &mut ws,
        json!({"type": "pull", "chain": "user", "from": 1, "to": huge}),
        1,
    )
    .await;
    assert_eq!(item_seqs(&pulled), vec![1, 2, 3], "{pulled}");
    assert_eq!(pulled["has_more"], false, "{pulled}");
    let polled = alice
        .get(&format!("/v1/sync?user_seq={huge}&wait_ms=0"))
        .await
        .unwrap();
    assert_eq!(polled["items"], json!([]), "{polled}");
    let page = history_page(&alice, "3101-3102", &format!("?after={huge}")).await;
    assert_eq!(page["messages"], json!([]), "{page}");
    ws.send(&json!({"type": "ack", "user_seq": huge}))
        .await
        .unwrap();
    let after_ack = request(&mut ws, json!({"type": "pull", "chain": "user"}), 2).await;
    assert_eq!(after_ack["type"], "pull_result", "{after_ack}");
    assert_eq!(
        after_ack["items"],
        json!([]),
        "nothing wraps around: {after_ack}"
    );
}

/// PROTOCOL.md 6 writes the members query as `?cursor=&limit=`: a parameter given empty is
/// one not given (its default), on every endpoint with a query.
#[tokio::test]
async fn empty_query_parameters_read_as_not_given() {
    let s = spawn_server().await;
    let owner = s.user(3201).await;
    let _ = s.user(3202).await;
    let g = new_group_named(&owner, "q", &[3202]).await;
    let members = owner
        .get(&format!("/v1/groups/{g}/members?cursor=&limit="))
        .await
        .unwrap();
    assert_eq!(members["members"].as_array().unwrap().len(), 2, "{members}");
    assert_eq!(members["next_cursor"], Value::Null, "{members}");
    let page = owner
        .get(&format!("/v1/conversations/{g}/messages?limit=&before="))
        .await
        .unwrap();
    assert_eq!(page["messages"].as_array().unwrap().len(), 1, "{page}");
    let list = owner.get("/v1/conversations?limit=&cursor=").await.unwrap();
    assert_eq!(list["conversations"].as_array().unwrap().len(), 1, "{list}");
    let polled = owner.get("/v1/sync?user_seq=&wait_ms").await.unwrap();
    assert!(polled["items"].is_array(), "{polled}");
    // A value is still checked: one that is not a number is refused.
    for bad in ["limit=5=", "limit=x", "before=-1"] {
        assert_eq!(
            code_of(
                owner
                    .get(&format!("/v1/conversations/{g}/messages?{bad}"))
                    .await
            ),
            "invalid_argument",
            "{bad}"
        );
    }
}

/// PROTOCOL.md 1: "Every error is `{"code": "...", "message": "human readable"}`": a path
/// segment that is not UTF-8 too (axum's own answer would be plain text).
#[tokio::test]
async fn a_path_segment_that_is_not_utf8_answers_the_json_error_body() {
    let s = spawn_server().await;
    let alice = s.user(3301).await;
    for path in [
        "/v1/conversations/%FF",
        "/v1/messages/%C0/versions",
        "/v1/groups/g1/members/%FF",
    ] {
        let method = if path.contains("/members/") {
            Method::DELETE
        } else {
            Method::GET
        };
        let (status, body) = alice.raw(method, path, None).await.unwrap();
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("invalid_argument")),
            "{path}: {body}"
        );
        assert!(body["message"].is_string(), "{path}: {body}");
    }
}

/// What one connection tracks is bounded: past 1024 chains acknowledged between two saves
/// of its positions they are saved at once (every ack is still taken), and it types in at
/// most 256 conversations within a second (the next is `rate_limited`; a throttle is never
/// forgotten while its second runs, so a loop over many conversations cannot get around
/// it).
#[tokio::test]
async fn a_connection_saves_past_1024_acked_chains_and_types_in_at_most_256() {
    let (_s, mut ws) = connected().await;
    let mut burst: Vec<String> = (1..=1024)
        .map(|i| json!({"type": "ack", "conversation_id": format!("g{i}"), "seq": 1}).to_string())
        .collect();
    burst.push(json!({"type": "ack", "req": 1, "conversation_id": "g5000", "seq": 1}).to_string());
    ws.send_burst(burst).await.unwrap();
    let e = ws
        .recv_until(WAIT, |v| v["req"] == 1)
        .await
        .unwrap()
        .expect("an answer");
    assert_eq!(e, json!({"type": "ok", "req": 1}));
    let burst: Vec<String> = (1..=257)
        .map(|i| {
            json!({"type": "typing", "req": 1000 + i, "conversation_id": format!("g{i}")})
                .to_string()
        })
        .collect();
    ws.send_burst(burst).await.unwrap();
    let last = ws
        .recv_until(WAIT, |v| v["req"] == 1257)
        .await
        .unwrap()
        .expect("an answer");
    assert_eq!(last["code"], "rate_limited", "{last}");
    assert!(last["retry_after_ms"].as_u64().is_some(), "{last}");
}

/// A client cannot hold a connection with a request it never finishes: a request head not
/// complete within 30 s ends the connection (the server stops reading and closes it),
/// while the server answers everyone else meanwhile.
#[tokio::test]
async fn a_half_sent_request_head_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = spawn_server().await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: pigeon\r\nX-Slow: ")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    // Others are served meanwhile.
    s.anon().get("/healthz").await.unwrap();
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(60), tcp.read(&mut buf))
        .await
        .expect("the connection is ended, not left open");
    // Closed (0 bytes, or reset), possibly after a 408 answer: never a 200.
    if let Ok(n) = read {
        let answered = String::from_utf8_lossy(&buf[..n]);
        assert!(!answered.contains(" 200 "), "{answered}");
    }
    assert!(
        started.elapsed() >= Duration::from_secs(20),
        "not cut off at once"
    );
}

/// PROTOCOL.md 1: "Every error is `{"code": ..., "message": ...}`, over HTTP with the status
/// below": a path nobody serves and a served path with a method it does not take both
/// answer a row of the table, `404 not_found` (there is no 405 in it).
#[tokio::test]
async fn unknown_paths_and_wrong_methods_answer_404_not_found() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    for (method, path) in [
        (Method::GET, "/v1/nothing-here"),
        (Method::PUT, "/v1/messages"),
        (Method::DELETE, "/v1/groups/g1/members"),
        (Method::POST, "/v1/unread"),
        (Method::PATCH, "/v1/conversations"),
    ] {
        let (status, code) = status_and_code(&alice, method.clone(), path, None).await;
        assert_eq!(
            (status, code.as_str()),
            (404, "not_found"),
            "{method} {path}"
        );
    }
}

/// "The body never leaks internals" (PROTOCOL.md 1): a body, query or frame of the wrong
/// types is answered in the protocol's words, not in the Rust types the server parses
/// into (`expected u64`, `expected struct …`, "target type").
#[tokio::test]
async fn wrong_types_are_answered_without_rust_type_names() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let _ = s.user(2).await;
    let mut answers = Vec::new();
    for (method, path, body) in [
        (
            reqwest::Method::POST,
            "/v1/messages",
            Some(json!({"client_msg_id": "t1", "to": "x", "kind": "text", "content": "c"})),
        ),
        (
            reqwest::Method::POST,
            "/v1/messages",
            Some(
                json!({"client_msg_id": "t2", "to": {"user": "x"}, "kind": "text", "content": "c"}),
            ),
        ),
        (
            reqwest::Method::POST,
            "/v1/groups",
            Some(json!({"name": "g", "members": [1.5]})),
        ),
        (
            reqwest::Method::GET,
            "/v1/conversations?limit=18446744073709551616",
            None,
        ),
    ] {
        let (status, answer) = alice.raw(method, path, body.as_ref()).await.unwrap();
        assert_eq!(
            (status, answer["code"].as_str()),
            (400, Some("invalid_argument")),
            "{path}: {answer}"
        );
        answers.push(answer);
    }
    let token = s.token(1).await;
    let mut ws = s.ws(&token, "d").await;
    for (req, frame) in [
        (1, json!({"type": "ack", "user_seq": "x"})),
        (
            2,
            json!({"type": "send", "client_msg_id": "w", "to": "x", "kind": "text", "content": "c"}),
        ),
    ] {
        let answer = request(&mut ws, frame, req).await;
        assert_eq!(answer["code"], "invalid_argument", "{answer}");
        answers.push(answer);
    }
    for answer in answers {
        let message = answer["message"].as_str().unwrap();
        for rust in ["u64", "struct", "target type", "Failed to deserialize"] {
            assert!(!message.contains(rust), "{message:?} names {rust:?}");
        }
    }
}

/// PROTOCOL.md 2 (extension): a request's head holds at most 64 KiB. One just under
/// is served; one over is refused with `431`, whether the HTTP layer saw it first (as it
/// does with this client, which writes the head in pieces) or the head came whole.
#[tokio::test]
async fn a_request_head_over_64_kib_is_refused_with_431() {
    let s = spawn_server().await;
    let client = reqwest::Client::new();
    let with_header = |bytes: usize| {
        client
            .get(format!("{}/healthz", s.base))
            .header("x-padding", "a".repeat(bytes))
            .send()
    };
    let under = with_header(60 * 1024).await.unwrap();
    assert_eq!(under.status().as_u16(), 200);
    let over = with_header(70 * 1024).await.unwrap();
    assert_eq!(over.status().as_u16(), 431);
    // Written whole in one write, as a raw client may: the server reads it and answers
    // with its error body.
    let head = format!(
        "GET /healthz HTTP/1.1\r\nhost: x\r\nx-padding: {}\r\nconnection: close\r\n\r\n",
        "a".repeat(80 * 1024)
    );
    let mut tcp = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
        .await
        .unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(WAIT, tcp.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    if let Some((_, body)) = answer.split_once("\r\n\r\n")
        && !body.is_empty()
    {
        let body: Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["code"], "payload_too_large", "{body}");
    }
}

/// An HTTP answer is held in memory until its client reads it, so what one user's clients
/// leave unread is bounded (64 MiB, `api::unread`): past it a request is answered `429
/// rate_limited` with `retry_after_ms`, and answered again once the client reads, or drops,
/// what it left.
#[tokio::test]
async fn answers_a_user_leaves_unread_are_bounded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = spawn_server().await;
    let alice = s.user(1).await;
    s.user(2).await;
    let token = s.token(1).await;
    // Control characters are escaped as `\u0001` in JSON: a page of 100 such messages of
    // 64 KiB is ~39 MB, more than the kernel's socket buffers take.
    let content = "\u{1}".repeat(s.cfg.max_content_bytes);
    let mut conv = String::new();
    for i in 0..100 {
        let ack = alice
            .post(
                "/v1/messages",
                &text_to_user(&format!("big-{i}"), 2, &content),
            )
            .await
            .unwrap();
        conv = ack["conversation_id"].as_str().unwrap().to_owned();
    }
    let addr = s.base.trim_start_matches("http://").to_owned();
    let request = format!(
        "GET /v1/conversations/{conv}/messages?limit=100 HTTP/1.1\r\nHost: pigeon\r\n\
         Authorization: Bearer {token}\r\n\r\n"
    );
    let app = s.running.as_ref().unwrap().app.clone();
    let held = || {
        app.unread_answers
            .held_by(pigeon_proto::UserId::new(1).unwrap())
    };

    // The first page is taken by the server and left unread.
    let mut unread = tokio::net::TcpStream::connect(&addr).await.unwrap();
    unread.write_all(request.as_bytes()).await.unwrap();
    within_10s(|| held() > 0, "the page is not made").await;
    assert!(held() > 30 << 20, "the page is ~39 MB: {}", held());

    // A second one would take the user past the bound: refused, with a small answer.
    let (status, body) = alice
        .raw(
            reqwest::Method::GET,
            &format!("/v1/conversations/{conv}/messages?limit=100"),
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (429, Some("rate_limited")),
        "{body}"
    );
    assert!(body["retry_after_ms"].as_u64().unwrap() > 0, "{body}");
    // Small answers still fit beside the unread page.
    alice.get("/v1/unread").await.unwrap();
    // Another user's answers are theirs.
    s.user(2)
        .await
        .get(&format!("/v1/conversations/{conv}/messages?limit=100"))
        .await
        .unwrap();

    // Once the client reads its page, the user is answered again.
    let mut sink = vec![0u8; 1 << 20];
    let mut read = 0usize;
    while held() > 0 {
        let n = tokio::time::timeout(Duration::from_secs(10), unread.read(&mut sink))
            .await
            .expect("the page comes")
            .unwrap();
        assert!(n > 0, "the page is cut short after {read} bytes");
        read += n;
    }
    let page = alice
        .get(&format!("/v1/conversations/{conv}/messages?limit=100"))
        .await
        .unwrap();
    assert_eq!(page["messages"].as_array().unwrap().len(), 100);

    // A client that drops its connection instead gives its answer's bytes back too.
    let mut dropped = tokio::net::TcpStream::connect(&addr).await.unwrap();
    dropped.write_all(request.as_bytes()).await.unwrap();
    within_10s(|| held() > 0, "the second page is not made").await;
    drop(dropped);
    within_10s(|| held() == 0, "a dropped answer is still counted").await;
}

/// Waits for `done`, failing with `what` after 10 s.
async fn within_10s(done: impl Fn() -> bool, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

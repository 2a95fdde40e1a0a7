//! The operating contract, authentication, sending and push (PROTOCOL.md 2, 3, 5.1, 5.2).

use crate::*;
use serde_json::json;

#[tokio::test]
async fn health_ready_metrics_and_openapi_answer() {
    let s = spawn_server().await;
    let anon = s.anon();
    assert_eq!(
        anon.raw(reqwest::Method::GET, "/healthz", None)
            .await
            .unwrap()
            .0,
        200
    );
    assert_eq!(
        anon.raw(reqwest::Method::GET, "/readyz", None)
            .await
            .unwrap()
            .0,
        200
    );
    // After a stored message, the pipeline's counters are exported.
    let alice = s.user(1).await;
    let _ = s.user(2).await;
    alice
        .post("/v1/messages", &text_to_user("metric", 2, "x"))
        .await
        .unwrap();
    // A read right after it finds the tables behind (the applier gathers batches for up to
    // 250 ms) and has them applied: the applier's and the waiting read's figures appear.
    alice.get("/v1/conversations").await.unwrap();
    let resp = reqwest::get(format!("{}/metrics", s.base)).await.unwrap();
    assert_eq!(resp.status(), 200);
    // PROTOCOL.md 2: "Prometheus text".
    let content_type = resp.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap();
    assert!(content_type.starts_with("text/plain"), "{content_type}");
    let text = resp.text().await.unwrap();
    for name in [
        "pigeon_messages_stored_total",
        "pigeon_batch_size_bucket",
        "pigeon_apply_seconds_bucket",
        "pigeon_apply_batches_bucket",
        "pigeon_read_wait_seconds_bucket",
        "pigeon_tcp_connections",
        "pigeon_connections_refused_total",
        "pigeon_connections ",
        "pigeon_batches_set_aside_total",
    ] {
        assert!(text.contains(name), "{name} missing from: {text}");
    }
    let doc = anon.get("/openapi.json").await.unwrap();
    assert_eq!(doc["openapi"], "3.0.3");
    assert!(doc["paths"]["/v1/messages"]["post"].is_object());
}

/// PROTOCOL.md 2: "`GET /openapi.json` serves the OpenAPI 3 description of every HTTP
/// endpoint": every (method, path) of PROTOCOL.md 2, 5, 6 and 7, written out here by hand
/// from PROTOCOL.md (not taken from the server's own table), is an operation of the
/// document, with its answers described. Paths are spelled with the document's parameter
/// names (`{id}`, `{uid}`, `{msg_id}`).
#[tokio::test]
async fn openapi_describes_every_endpoint_of_the_protocol() {
    let s = spawn_server().await;
    let doc = s.anon().get("/openapi.json").await.unwrap();
    let endpoints = [
        // Section 2.
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
        // Section 5.
        ("get", "/v1/ws"),
        // Section 6, admin.
        ("post", "/v1/admin/users"),
        ("post", "/v1/admin/tokens"),
        ("post", "/v1/admin/users/{id}/logout"),
        ("get", "/v1/admin/messages/{msg_id}"),
        ("delete", "/v1/admin/messages/{msg_id}"),
        // Messages.
        ("post", "/v1/messages"),
        ("post", "/v1/messages/{msg_id}/recall"),
        ("patch", "/v1/messages/{msg_id}"),
        ("get", "/v1/messages/{msg_id}/versions"),
        ("delete", "/v1/messages/{msg_id}"),
        // Conversations.
        ("get", "/v1/conversations"),
        ("get", "/v1/conversations/{id}"),
        ("get", "/v1/conversations/{id}/messages"),
        ("get", "/v1/conversations/{id}/messages/range"),
        ("post", "/v1/conversations/{id}/read"),
        ("get", "/v1/conversations/{id}/receipts"),
        ("put", "/v1/conversations/{id}/settings"),
        ("get", "/v1/unread"),
        ("get", "/v1/sync"),
        // Groups.
        ("post", "/v1/groups"),
        ("patch", "/v1/groups/{id}"),
        ("post", "/v1/groups/{id}/members"),
        ("delete", "/v1/groups/{id}/members/{uid}"),
        ("put", "/v1/groups/{id}/admins/{uid}"),
        ("delete", "/v1/groups/{id}/admins/{uid}"),
        ("post", "/v1/groups/{id}/mutes"),
        ("delete", "/v1/groups/{id}/mutes/{uid}"),
        ("delete", "/v1/groups/{id}"),
        ("get", "/v1/groups/{id}/members"),
        // Section 7.
        ("post", "/v1/admin/rooms"),
        ("delete", "/v1/admin/rooms/{id}"),
        ("get", "/v1/rooms/{id}"),
    ];
    let missing: Vec<String> = endpoints
        .iter()
        .filter(|(method, path)| {
            let op = &doc["paths"][*path][*method];
            !(op.is_object() && op["responses"].is_object())
        })
        .map(|(method, path)| format!("{method} {path}"))
        .collect();
    assert!(
        missing.is_empty(),
        "not described by /openapi.json: {missing:?}"
    );
}

#[tokio::test]
async fn every_documented_endpoint_is_routed() {
    let s = spawn_server().await;
    let client = reqwest::Client::new();
    for (method, path, _, _) in pigeon_server::openapi::ENDPOINTS {
        let concrete = path
            .replace("{id}", "g1")
            .replace("{uid}", "5")
            .replace("{msg_id}", "1");
        let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
        let resp = client
            .request(m, format!("{}{}", s.base, concrete))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
        let fell_through = status == 404
            && (body["message"] == "no such endpoint"
                || body["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("this path does not take")));
        assert!(!fell_through, "{method} {path} is not routed ({status})");
    }
}

#[tokio::test]
async fn admin_endpoints_refuse_user_tokens_and_wrong_keys() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    assert_eq!(code_of(alice.upsert_user(5, "x").await), "unauthorized");
    // A wrong key, and no `Authorization` header at all.
    for caller in [s.anon().with_bearer("not-the-admin-key-at-all"), s.anon()] {
        let (status, body) = caller
            .raw(
                reqwest::Method::POST,
                "/v1/admin/users",
                Some(&json!({"user_id": 5})),
            )
            .await
            .unwrap();
        assert_eq!((status, &body["code"]), (401, &json!("unauthorized")));
        assert!(body["message"].is_string());
    }
    assert_eq!(code_of(s.admin.mint_token(999, 60).await), "not_found");
    assert_eq!(code_of(s.admin.mint_token(5, 60).await), "not_found");
}

#[tokio::test]
async fn user_endpoints_need_a_valid_token() {
    let s = spawn_server().await;
    let (status, body) = s
        .anon()
        .raw(reqwest::Method::GET, "/v1/conversations", None)
        .await
        .unwrap();
    assert_eq!((status, body["code"].as_str()), (401, Some("unauthorized")));
    let forged = s.anon().with_bearer("v1.eyJ1aWQiOjExMX0.AAAA");
    assert_eq!(
        code_of(forged.get("/v1/conversations").await),
        "unauthorized"
    );
}

#[tokio::test]
async fn expired_tokens_are_refused() {
    let s = spawn_server().await;
    s.admin.upsert_user(111, "a").await.unwrap();
    let token = s.admin.mint_token(111, 1).await.unwrap();
    let alice = s.anon().with_bearer(token.clone());
    alice
        .get("/v1/conversations")
        .await
        .expect("fresh token works");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        code_of(alice.get("/v1/conversations").await),
        "unauthorized"
    );
    let err = WsConn::connect(&s.ws_base, &token, "d1")
        .await
        .err()
        .expect("upgrade refused");
    assert_eq!(err.code(), Some("unauthorized"));
}

/// "Stop working at once": once the logout is answered, the user's open connections take
/// nothing more. A `send` written on one right after the answer gets no `send_ack`: the
/// connection only ends with `kicked` and 1008. (Rounds, since the window was narrow.)
#[tokio::test]
async fn a_send_right_after_the_logout_answer_is_not_taken() {
    let s = spawn_server().await;
    let _ = s.user(162).await;
    for round in 0..20 {
        let token = s.token(161).await;
        let mut ws = s.ws(&token, "phone").await;
        s.admin
            .post("/v1/admin/users/161/logout", &json!({}))
            .await
            .unwrap();
        let _ = ws
            .send(&send_frame(text_to_user(
                &format!("late-{round}"),
                162,
                "x",
            )))
            .await;
        let mut frames = Vec::new();
        while let Ok(Some(f)) = ws.recv(WAIT).await {
            frames.push(f["type"].as_str().unwrap_or_default().to_owned());
        }
        assert_eq!(frames, vec!["kicked"], "round {round}");
        assert_eq!(
            ws.closed_with.as_ref().map(|c| c.0),
            Some(1008),
            "round {round}"
        );
    }
    let bob = s.user(162).await;
    assert_eq!(
        bob.get("/v1/conversations").await.unwrap()["conversations"],
        json!([]),
        "no late send was stored"
    );
}

/// PROTOCOL.md 3: revoked tokens "stop working at once". A `GET /v1/sync` long poll that
/// waits when its user is logged out is ended by the logout with `401 unauthorized`, and
/// what is sent to the user afterwards does not go to it.
#[tokio::test]
async fn a_long_poll_waiting_at_a_logout_ends_unauthorized() {
    let s = spawn_server().await;
    let alice = s.user(171).await;
    let bob = s.user(172).await;
    let waiting = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let r = bob.get("/v1/sync?user_seq=0&wait_ms=20000").await;
        (r, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.admin
        .post("/v1/admin/users/172/logout", &json!({}))
        .await
        .unwrap();
    alice
        .post(
            "/v1/messages",
            &text_to_user("after-logout", 172, "not for a revoked token"),
        )
        .await
        .unwrap();
    let (r, waited) = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("the poll ended before its wait_ms")
        .unwrap();
    assert_eq!(code_of(r), "unauthorized");
    assert!(
        waited < Duration::from_secs(15),
        "ended by the logout, not by wait_ms: {waited:?}"
    );
}

/// A logout that comes while a write to the connection is stuck (its client paused
/// reading through a flood of pushes) still ends it with `kicked` before its 1008, once the
/// client reads again within a second: the write under way is finished, not dropped with
/// the `kicked` frame queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logout_while_a_write_is_stuck_still_sends_kicked() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let token = s.token(222).await;
    let mut bob = s.ws(&token, "phone").await;
    // Far more than the socket's buffers hold: the server's writes to Bob stall.
    let big = "k".repeat(60_000);
    for i in 0..200 {
        alice
            .post(
                "/v1/messages",
                &text_to_user(&format!("big-{i}"), 222, &big),
            )
            .await
            .unwrap();
    }
    s.admin
        .post("/v1/admin/users/222/logout", &json!({}))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let kicked = bob
        .recv_until(WAIT, |v| v["type"] == "kicked")
        .await
        .unwrap();
    assert!(kicked.is_some(), "no kicked frame");
    assert_eq!(bob.closed(WAIT).await, Some(1008));
}

/// PROTOCOL.md 3 and 5: revoked tokens "stop working at once, and that user's open
/// connections receive `kicked` and are closed".
#[tokio::test]
async fn logout_revokes_tokens_and_kicks_connections() {
    let s = spawn_server().await;
    let token = s.token(111).await;
    // Every one of the user's connections, on every token: a second device on a second token.
    let laptop_token = s.admin.mint_token(111, 3600).await.unwrap();
    let mut ws = s.ws(&token, "phone").await;
    let mut laptop = s.ws(&laptop_token, "laptop").await;
    s.admin
        .post("/v1/admin/users/111/logout", &json!({}))
        .await
        .unwrap();
    for (device, conn) in [("phone", &mut ws), ("laptop", &mut laptop)] {
        let kicked = conn
            .recv_until(WAIT, |v| v["type"] == "kicked")
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{device}: no kicked frame"));
        assert_eq!(
            kicked,
            json!({"type": "kicked", "reason": "token_revoked"}),
            "{device}"
        );
        // Closed with 1008 (PROTOCOL.md 5, extension).
        assert_eq!(conn.closed(WAIT).await, Some(1008), "{device}");
    }
    // Both tokens' upgrades are refused with 401 ("A connection that cannot authenticate is
    // refused"), and both stop working over HTTP.
    for t in [&token, &laptop_token] {
        match WsConn::connect(&s.ws_base, t, "phone").await {
            Err(pigeon_client::ClientError::Api { status, body }) => {
                assert_eq!((status, body.code.as_str()), (401, "unauthorized"));
            }
            Err(e) => panic!("refused otherwise than with 401: {e}"),
            Ok(_) => panic!("a revoked token connected"),
        }
        let alice = s.anon().with_bearer(t.clone());
        assert_eq!(
            code_of(alice.get("/v1/conversations").await),
            "unauthorized"
        );
    }
    // A token minted after the logout works.
    let fresh = s.admin.mint_token(111, 60).await.unwrap();
    s.anon()
        .with_bearer(fresh)
        .get("/v1/conversations")
        .await
        .expect("new token works");
}

#[tokio::test]
async fn websocket_accepts_the_token_in_the_query_and_says_hello() {
    let s = spawn_server().await;
    let token = s.token(111).await;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let req = format!(
        "{}/v1/ws?device_id=web-1&platform=web&token={token}",
        s.ws_base
    )
    .into_client_request()
    .unwrap();
    let ws = WsConn::connect_request(req).await.unwrap();
    assert_eq!(ws.hello["type"], "hello");
    assert_eq!(ws.hello["user_id"], 111);
    assert_eq!(ws.hello["device_id"], "web-1");
    assert_eq!(ws.hello["heartbeat_ms"], 30000);
    assert_eq!(ws.hello["user_seq"], 0);
    assert!(ws.hello["server_time"].as_i64().unwrap() > 1_700_000_000_000);
}

/// The status and the JSON body of the answer to a WebSocket upgrade request (`GET /v1/ws`
/// with the handshake's headers) for device `d`, `query` appended to its query string,
/// read raw: `WsConn::connect_request` makes up the code `unauthorized` for any refusal whose
/// body is not JSON.
async fn upgrade_answer(s: &TestServer, query: &str, bearer: Option<&str>) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .get(format!("{}/v1/ws?device_id=d{query}", s.base))
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==");
    if let Some(b) = bearer {
        req = req.bearer_auth(b);
    }
    let resp = req.send().await.expect("an answer");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{status}: a body that is not JSON ({e}): {text:?}"));
    (status, body)
}

/// PROTOCOL.md 5: "A connection that cannot authenticate is refused (HTTP 401 on the
/// upgrade)", with PROTOCOL.md 1's error body, `unauthorized` ("missing, malformed, expired
/// or revoked token"): a garbage token, an expired one (`ttl_secs` 0) and a revoked one
/// (after a logout), each given as `?token=` and as the `Authorization` header, and none at
/// all (an empty `?token=` is none, PROTOCOL.md 6, extension).
#[tokio::test]
async fn the_upgrade_is_refused_with_401_for_a_bad_expired_revoked_or_missing_token() {
    let s = spawn_server().await;
    s.admin.upsert_user(111, "a").await.unwrap();
    let expired = s
        .admin
        .post("/v1/admin/tokens", &json!({"user_id": 111, "ttl_secs": 0}))
        .await
        .unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let revoked = s.token(112).await;
    s.admin
        .post("/v1/admin/users/112/logout", &json!({}))
        .await
        .unwrap();
    let mut cases: Vec<(String, String, Option<String>)> = vec![
        ("no token".into(), String::new(), None),
        ("an empty ?token=".into(), "&token=".into(), None),
    ];
    for (what, token) in [
        ("garbage", "not-a-token".to_owned()),
        ("expired", expired),
        ("revoked", revoked),
    ] {
        cases.push((
            format!("{what} in ?token="),
            format!("&token={token}"),
            None,
        ));
        cases.push((format!("{what} in the header"), String::new(), Some(token)));
    }
    for (what, query, bearer) in cases {
        let (status, body) = upgrade_answer(&s, &query, bearer.as_deref()).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (401, Some("unauthorized")),
            "{what}: {body}"
        );
        assert!(body["message"].is_string(), "{what}: {body}");
    }
}

#[tokio::test]
async fn websocket_upgrade_without_token_or_device_is_refused() {
    let s = spawn_server().await;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let req = format!("{}/v1/ws?device_id=d1", s.ws_base)
        .into_client_request()
        .unwrap();
    let err = WsConn::connect_request(req).await.err().expect("refused");
    assert_eq!(err.code(), Some("unauthorized"));
    let token = s.token(111).await;
    let req = format!("{}/v1/ws?token={token}", s.ws_base)
        .into_client_request()
        .unwrap();
    let err = WsConn::connect_request(req).await.err().expect("refused");
    assert_eq!(err.code(), Some("invalid_argument"));
}

#[tokio::test]
async fn single_chat_send_is_acked_then_pushed_to_every_device() {
    let s = spawn_server().await;
    let (ta, tb) = (s.token(111).await, s.token(222).await);
    let mut a1 = s.ws(&ta, "a-phone").await;
    let mut a2 = s.ws(&ta, "a-laptop").await;
    let mut b1 = s.ws(&tb, "b-phone").await;

    let ack = request(&mut a1, send_frame(text_to_user("m-0001", 222, "hi")), 1).await;
    assert_eq!(ack["type"], "send_ack", "{ack}");
    assert_eq!(ack["client_msg_id"], "m-0001");
    assert_eq!(ack["conversation_id"], "111-222");
    assert_eq!(ack["seq"], 1);
    assert_eq!(ack["duplicate"], false);
    let msg_id = ack["msg_id"]
        .as_str()
        .expect("msg_id is a string")
        .to_owned();
    assert!(msg_id.chars().all(|c| c.is_ascii_digit()));

    // The sending connection gets the push after its ack.
    let own = next_msg(&mut a1).await;
    assert_eq!(own["message"]["msg_id"], msg_id.as_str());
    assert_eq!(own["user_seq"], 1);
    for ws in [&mut a2, &mut b1] {
        let push = next_msg(ws).await;
        let m = &push["message"];
        assert_eq!(m["msg_id"], msg_id.as_str());
        assert_eq!(m["conversation_id"], "111-222");
        assert_eq!(m["seq"], 1);
        assert_eq!(m["sender"], 111);
        assert_eq!(m["client_msg_id"], "m-0001");
        assert_eq!(m["kind"], "text");
        assert_eq!(m["content"], "hi");
        assert_eq!(m["status"], "normal");
        assert_eq!(m["version"], 1);
        assert!(m["extra"].is_null() && m["reply_to"].is_null() && m["edited_at"].is_null());
        assert_eq!(m["mentions"], json!([]));
        assert_eq!(push["user_seq"], 1);
    }
    // Bob answers: the same conversation from the other side, next seq; Bob's inbox moves on.
    let ack = request(&mut b1, send_frame(text_to_user("b-1", 111, "hello")), 7).await;
    assert_eq!(
        (ack["conversation_id"].as_str(), ack["seq"].as_i64()),
        (Some("111-222"), Some(2))
    );
    let push = next_msg(&mut a2).await;
    assert_eq!(
        (push["message"]["seq"].as_i64(), push["user_seq"].as_i64()),
        (Some(2), Some(2))
    );
}

/// "The server handles the frames of one connection in the order they arrive": a `pull` and a
/// `sync` written right behind sends, without waiting for their acks, see those sends.
#[tokio::test]
async fn a_pull_right_behind_sends_on_one_connection_sees_them() {
    let s = spawn_server().await;
    let t = s.token(111).await;
    let _ = s.token(222).await;
    let mut ws = s.ws(&t, "d").await;
    for round in 0..5u64 {
        // Each round sends four: three before a pull, one before a sync.
        let base = round * 4;
        for i in 1..=3 {
            let mut f = send_frame(text_to_user(&format!("o-{round}-{i}"), 222, "x"));
            f["req"] = json!(base + i);
            ws.send(&f).await.unwrap();
        }
        let r = request(
            &mut ws,
            json!({"type": "pull", "chain": "user", "from": base + 1}),
            1000 + round as i64,
        )
        .await;
        assert_eq!(
            item_seqs(&r),
            vec![base + 1, base + 2, base + 3],
            "round {round}: {r}"
        );
        let mut f = send_frame(text_to_user(&format!("o-{round}-sync"), 222, "x"));
        f["req"] = json!(2000 + round);
        ws.send(&f).await.unwrap();
        let r = request(&mut ws, json!({"type": "sync"}), 3000 + round as i64).await;
        assert_eq!(r["user_seq"], base + 4, "round {round}: {r}");
    }
}

/// "The single-chat id is derived, never allocated": a member may name it in `to.conversation`
/// before the chat has a message, and the first send creates it as `to.user` would; a user
/// it does not name is `not_member`, and a peer who was never registered `not_found`.
#[tokio::test]
async fn a_single_chat_named_by_its_derived_id_is_created_by_the_first_send() {
    let s = spawn_server().await;
    let alice = s.user(222).await;
    let bob = s.user(333).await;
    let carol = s.user(444).await;
    let t = s.token(333).await;
    let mut bob_ws = s.ws(&t, "phone").await;
    let ack = alice
        .post("/v1/messages", &text_to_conv("derived-1", "222-333", "hi"))
        .await
        .unwrap();
    assert_eq!(
        (ack["conversation_id"].as_str(), ack["seq"].as_u64()),
        (Some("222-333"), Some(1))
    );
    let push = bob_ws
        .recv_until(WAIT, |v| v["type"] == "msg")
        .await
        .unwrap()
        .expect("the peer gets it");
    assert_eq!(push["message"]["content"], "hi");
    // The same chat whichever way it is named.
    let ack = bob
        .post("/v1/messages", &text_to_user("derived-2", 222, "hello"))
        .await
        .unwrap();
    assert_eq!(ack["seq"], 2);
    assert_eq!(
        code_of(
            carol
                .post("/v1/messages", &text_to_conv("c", "222-333", "x"))
                .await
        ),
        "not_member"
    );
    assert_eq!(
        code_of(
            carol
                .post("/v1/messages", &text_to_conv("c2", "444-98765", "x"))
                .await
        ),
        "not_found"
    );
}

#[tokio::test]
async fn http_send_answers_the_ack_and_the_sender_devices_get_it() {
    let s = spawn_server().await;
    let ta = s.token(111).await;
    let bob = s.user(222).await;
    let mut a = s.ws(&ta, "a").await;
    let ack = bob
        .post("/v1/messages", &text_to_user("x1", 111, "yo"))
        .await
        .unwrap();
    assert_eq!(ack["seq"], 1);
    assert_eq!(ack["conversation_id"], "111-222");
    assert_eq!(ack["duplicate"], false);
    let push = next_msg(&mut a).await;
    assert_eq!(push["message"]["content"], "yo");
    // Sending moves the sender's own read mark.
    let conv = bob.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(conv["last_read_seq"], 1);
    assert_eq!(conv["unread"], 0);
    let conv = s
        .anon()
        .with_bearer(ta)
        .get("/v1/conversations/111-222")
        .await
        .unwrap();
    assert_eq!(conv["unread"], 1);
    assert_eq!(conv["peer"], 222);
    assert_eq!(conv["type"], "single");
    assert_eq!(conv["fanout"], "write");
    assert_eq!(conv["member_count"], 2);
}

/// PROTOCOL.md 5.1: "Sending moves the sender's own `last_read_seq` in that conversation to
/// the new message", for a send over the WebSocket too: the peer's unread messages before it
/// are read with it.
#[tokio::test]
async fn a_websocket_send_moves_the_senders_own_read_mark() {
    let s = spawn_server().await;
    let ta = s.token(111).await;
    let alice = s.anon().with_bearer(ta.clone());
    let bob = s.user(222).await;
    post_texts(&bob, "unread-", 111, 2, "for alice").await;
    let c = alice.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(
        (c["last_read_seq"].as_u64(), c["unread"].as_u64()),
        (Some(0), Some(2)),
        "{c}"
    );
    let mut ws = s.ws(&ta, "a").await;
    let ack = request(&mut ws, send_frame(text_to_user("ws-own", 222, "back")), 1).await;
    assert_eq!(ack["seq"], 3, "{ack}");
    let c = alice.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(
        (c["last_read_seq"].as_u64(), c["unread"].as_u64()),
        (Some(3), Some(0)),
        "{c}"
    );
    // Only the sender's: the peer has read nothing of it.
    let c = bob.get("/v1/conversations/111-222").await.unwrap();
    assert_eq!(
        (c["last_read_seq"].as_u64(), c["unread"].as_u64()),
        (Some(2), Some(1)),
        "{c}"
    );
}

#[tokio::test]
async fn retrying_a_send_returns_the_first_ack_and_delivers_nothing_new() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let tb = s.token(222).await;
    let mut b = s.ws(&tb, "b").await;
    let first = alice
        .post("/v1/messages", &text_to_user("same", 222, "once"))
        .await
        .unwrap();
    let again = alice
        .post("/v1/messages", &text_to_user("same", 222, "changed text"))
        .await
        .unwrap();
    assert_eq!(again["msg_id"], first["msg_id"]);
    assert_eq!(again["seq"], first["seq"]);
    assert_eq!(again["duplicate"], true);
    let push = next_msg(&mut b).await;
    assert_eq!(push["message"]["content"], "once");
    assert!(
        b.recv_until(Duration::from_millis(300), |v| v["type"] == "msg")
            .await
            .unwrap()
            .is_none(),
        "no second push"
    );
    assert_eq!(history_msgs(&alice, "111-222", "").await.len(), 1);
    // The id is the sender's across conversations: the same id to someone else is the
    // same retry, and stores nothing there.
    let _ = s.user(333).await;
    let elsewhere = alice
        .post("/v1/messages", &text_to_user("same", 333, "to carol"))
        .await
        .unwrap();
    assert_eq!(
        (&elsewhere["msg_id"], &elsewhere["duplicate"]),
        (&first["msg_id"], &json!(true))
    );
    assert_eq!(elsewhere["conversation_id"], "111-222");
    // A refused send keeps nothing: its id can be used again.
    let refused = alice
        .post("/v1/messages", &text_to_user("fresh", 999, "nobody"))
        .await;
    assert_eq!(code_of(refused), "not_found");
    let fresh = alice
        .post("/v1/messages", &text_to_user("fresh", 333, "now"))
        .await
        .unwrap();
    assert_eq!(
        (&fresh["conversation_id"], &fresh["duplicate"]),
        (&json!("111-333"), &json!(false))
    );
}

#[tokio::test]
async fn sending_to_yourself_or_to_strangers_is_refused() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    assert_eq!(
        code_of(
            alice
                .post("/v1/messages", &text_to_user("a", 111, "me"))
                .await
        ),
        "invalid_argument"
    );
    assert_eq!(
        code_of(
            alice
                .post("/v1/messages", &text_to_user("b", 999, "who"))
                .await
        ),
        "not_found"
    );
    let bob = s.user(222).await;
    bob.post("/v1/messages", &text_to_user("c", 333, "x"))
        .await
        .err();
    let _carol = s.user(333).await;
    bob.post("/v1/messages", &text_to_user("d", 333, "hi carol"))
        .await
        .unwrap();
    // Alice is not in 222-333: she can neither write nor read it.
    assert_eq!(
        code_of(
            alice
                .post("/v1/messages", &text_to_conv("e", "222-333", "sneak"))
                .await
        ),
        "not_member"
    );
    assert_eq!(
        code_of(alice.get("/v1/conversations/222-333/messages").await),
        "not_member"
    );
    assert_eq!(
        code_of(alice.get("/v1/conversations/222-333").await),
        "not_member"
    );
    // No such group: PROTOCOL.md 1's table, `not_found`.
    assert_eq!(
        code_of(alice.get("/v1/conversations/g12345").await),
        "not_found"
    );
}

#[tokio::test]
async fn groups_are_created_with_a_command_message_at_seq_1() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let tb = s.token(222).await;
    let _c = s.user(333).await;
    let mut b = s.ws(&tb, "b").await;
    let g = alice
        .post(
            "/v1/groups",
            &json!({"name": "team", "members": [222, 333]}),
        )
        .await
        .unwrap();
    let id = g["conversation_id"].as_str().unwrap().to_owned();
    assert!(id.starts_with('g') && id[1..].chars().all(|c| c.is_ascii_digit()));
    assert_eq!(g["type"], "group");
    assert_eq!(g["name"], "team");
    assert_eq!(g["member_count"], 3);
    assert_eq!(g["seq"], 1);
    let push = next_msg(&mut b).await;
    assert_eq!(push["message"]["kind"], "group_created");
    assert_eq!(push["message"]["seq"], 1);
    assert_eq!(push["message"]["sender"], 111);
    let mut members: Vec<u64> = push["message"]["extra"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    members.sort();
    assert_eq!(members, vec![111, 222, 333]);
    let list = alice
        .get(&format!("/v1/groups/{id}/members"))
        .await
        .unwrap();
    let roles: Vec<(u64, String)> = list["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["user_id"].as_u64().unwrap(),
                m["role"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        roles,
        vec![
            (111, "owner".into()),
            (222, "member".into()),
            (333, "member".into())
        ]
    );
    assert!(list["next_cursor"].is_null());
    let ack = alice
        .post("/v1/messages", &text_to_conv("g1", &id, "hello team"))
        .await
        .unwrap();
    assert_eq!(ack["seq"], 2);
    let push = next_msg(&mut b).await;
    assert_eq!(push["message"]["content"], "hello team");
    assert_eq!(push["user_seq"], 2);
}

#[tokio::test]
async fn ping_gets_pong_and_frames_are_handled_in_order() {
    let s = spawn_server().await;
    let ta = s.token(111).await;
    let _ = s.token(222).await;
    let mut a = s.ws(&ta, "a").await;
    let pong = request(&mut a, json!({"type": "ping"}), 42).await;
    assert_eq!(pong["type"], "pong");
    assert!(pong["server_time"].is_i64());
    // Two sends on one connection get their seqs in the order they were sent.
    for i in 0..20 {
        let mut f = send_frame(text_to_user(&format!("o{i}"), 222, &format!("{i}")));
        f["req"] = json!(i);
        a.send(&f).await.unwrap();
    }
    let mut seqs = Vec::new();
    while seqs.len() < 20 {
        let v = a
            .recv_until(WAIT, |v| v["type"] == "send_ack")
            .await
            .unwrap()
            .expect("ack");
        seqs.push((v["req"].as_i64().unwrap(), v["seq"].as_i64().unwrap()));
    }
    seqs.sort();
    for (i, (req, seq)) in seqs.iter().enumerate() {
        assert_eq!((*req, *seq), (i as i64, i as i64 + 1));
    }
}

/// PROTOCOL.md 6: "A user token on an admin endpoint, or a wrong admin key, answers 401
/// `unauthorized`", for every admin endpoint, and the refused call changes nothing.
#[tokio::test]
async fn every_admin_endpoint_refuses_user_tokens_and_wrong_keys_with_401() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    let ack = alice
        .post("/v1/messages", &text_to_user("keep", 222, "kept"))
        .await
        .unwrap();
    let msg_id = ack["msg_id"].as_str().unwrap().to_owned();
    let room = s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap();
    let room_id = room["room_id"].as_str().unwrap().to_owned();
    let wrong_key = s.anon().with_bearer(format!("{ADMIN_KEY}-not"));
    use reqwest::Method;
    let calls: Vec<(Method, String, Option<Value>)> = vec![
        (
            Method::POST,
            "/v1/admin/users".into(),
            Some(json!({"user_id": 111, "name": "hijacked", "avatar": ""})),
        ),
        (
            Method::POST,
            "/v1/admin/tokens".into(),
            Some(json!({"user_id": 222, "ttl_secs": 60})),
        ),
        (Method::POST, "/v1/admin/users/111/logout".into(), None),
        (Method::GET, format!("/v1/admin/messages/{msg_id}"), None),
        (Method::DELETE, format!("/v1/admin/messages/{msg_id}"), None),
        (Method::POST, "/v1/admin/rooms".into(), Some(json!({}))),
        (Method::DELETE, format!("/v1/admin/rooms/{room_id}"), None),
    ];
    for who in [&alice, &wrong_key] {
        for (method, path, body) in &calls {
            let (status, answer) = who.raw(method.clone(), path, body.as_ref()).await.unwrap();
            assert_eq!(
                (status, answer["code"].as_str()),
                (401, Some("unauthorized")),
                "{method} {path}: {answer}"
            );
            assert!(answer["message"].is_string());
        }
    }
    // Nothing was done: alice's token still works, her name and the message are untouched,
    // the room is still open.
    let listed = alice
        .get("/v1/conversations")
        .await
        .expect("not logged out");
    assert_eq!(
        listed["conversations"][0]["last_message"]["content"],
        "kept"
    );
    let bob = s
        .anon()
        .with_bearer(s.admin.mint_token(222, 60).await.unwrap());
    assert_eq!(
        bob.get("/v1/conversations/111-222").await.unwrap()["name"],
        "user111"
    );
    assert_eq!(at_seq(&bob, "111-222", 1).await["status"], "normal");
    assert_eq!(
        alice.get(&format!("/v1/rooms/{room_id}")).await.unwrap()["room_id"],
        room_id.as_str()
    );
}

/// PROTOCOL.md 6: `POST /v1/admin/tokens` with `{"user_id","ttl_secs"}` answers
/// `{"token":"...","expires_at":ms}`: `expires_at` is now plus `ttl_secs` in milliseconds.
#[tokio::test]
async fn minted_tokens_expire_ttl_secs_after_now() {
    let s = spawn_server().await;
    s.admin.upsert_user(111, "a").await.unwrap();
    for ttl in [60u64, 86_400] {
        let before = now_ms();
        let t = s
            .admin
            .post(
                "/v1/admin/tokens",
                &json!({"user_id": 111, "ttl_secs": ttl}),
            )
            .await
            .unwrap();
        let after = now_ms();
        assert!(t["token"].as_str().is_some_and(|t| !t.is_empty()), "{t}");
        let exp = t["expires_at"].as_i64().expect("expires_at in ms");
        let ttl_ms = ttl as i64 * 1000;
        assert!(
            (before + ttl_ms - 2000..=after + ttl_ms + 2000).contains(&exp),
            "expires_at {exp} is {ttl} s after {before}..{after}"
        );
    }
}

/// A user as `POST /v1/admin/users` answers it: id, name, avatar.
fn user_fields(u: &Value) -> (Option<u64>, Option<&str>, Option<&str>) {
    (
        u["user_id"].as_u64(),
        u["name"].as_str(),
        u["avatar"].as_str(),
    )
}

/// PROTOCOL.md 6 (extension): a repeat of `POST /v1/admin/users` that leaves `name` or
/// `avatar` out keeps what the user has, and answers the user as stored; updates of
/// different fields racing each other both hold (they are merged where the row is written).
#[tokio::test]
async fn registering_a_user_again_keeps_the_fields_left_out() {
    let s = spawn_server().await;
    s.admin
        .post(
            "/v1/admin/users",
            &json!({"user_id": 222, "name": "Bob", "avatar": "b.png"}),
        )
        .await
        .unwrap();
    let u = s
        .admin
        .post(
            "/v1/admin/users",
            &json!({"user_id": 222, "avatar": "c.png"}),
        )
        .await
        .unwrap();
    assert_eq!(
        (u["name"].as_str(), u["avatar"].as_str()),
        (Some("Bob"), Some("c.png"))
    );
    let (rename, new_avatar) = (
        json!({"user_id": 222, "name": "Robert"}),
        json!({"user_id": 222, "avatar": "d.png", "name": null}),
    );
    let (a, b) = tokio::join!(
        s.admin.post("/v1/admin/users", &rename),
        s.admin.post("/v1/admin/users", &new_avatar),
    );
    a.unwrap();
    b.unwrap();
    let u = s
        .admin
        .post("/v1/admin/users", &json!({"user_id": 222}))
        .await
        .unwrap();
    assert_eq!(
        (u["name"].as_str(), u["avatar"].as_str()),
        (Some("Robert"), Some("d.png"))
    );
    // A new user registered with nothing but an id.
    let u = s
        .admin
        .post("/v1/admin/users", &json!({"user_id": 333}))
        .await
        .unwrap();
    assert_eq!(user_fields(&u), (Some(333), Some(""), Some("")));
}

/// PROTOCOL.md 6: `POST /v1/admin/users` answers "the user; repeat = update": a second call
/// for the same id renames the user, and a single chat shows the peer's new name (a single
/// chat's `name` is the peer's registered name, PROTOCOL.md 6, extension).
#[tokio::test]
async fn registering_a_user_again_updates_them() {
    let s = spawn_server().await;
    let u = s
        .admin
        .post(
            "/v1/admin/users",
            &json!({"user_id": 222, "name": "Bob", "avatar": ""}),
        )
        .await
        .unwrap();
    assert_eq!(
        (u["user_id"].as_u64(), u["name"].as_str()),
        (Some(222), Some("Bob"))
    );
    let alice = s.user(111).await;
    alice
        .post("/v1/messages", &text_to_user("n1", 222, "hi bob"))
        .await
        .unwrap();
    assert_eq!(
        alice.get("/v1/conversations/111-222").await.unwrap()["name"],
        "Bob"
    );
    let u = s
        .admin
        .post(
            "/v1/admin/users",
            &json!({"user_id": 222, "name": "Robert", "avatar": "https://x/r.png"}),
        )
        .await
        .unwrap();
    assert_eq!(
        user_fields(&u),
        (Some(222), Some("Robert"), Some("https://x/r.png"))
    );
    assert_eq!(
        alice.get("/v1/conversations/111-222").await.unwrap()["name"],
        "Robert"
    );
    let list = alice.get("/v1/conversations").await.unwrap();
    assert_eq!(list["conversations"][0]["name"], "Robert");
    // The update is not a new user: the chat and its history are the same.
    assert_eq!(newest_seq(&alice, "111-222").await, 1);
}

/// PROTOCOL.md 5.1: "Sending the same `client_msg_id` again (a retry) returns the same
/// `msg_id` and `seq` with `"duplicate":true`", over the WebSocket too, where the reply
/// carries the retry's own `req`.
#[tokio::test]
async fn a_websocket_retry_answers_duplicate_with_its_own_req() {
    let s = spawn_server().await;
    let ta = s.token(111).await;
    let tb = s.token(222).await;
    let mut a = s.ws(&ta, "a").await;
    let mut b = s.ws(&tb, "b").await;
    let first = request(&mut a, send_frame(text_to_user("ws-same", 222, "once")), 1).await;
    assert_eq!(
        (first["type"].as_str(), first["duplicate"].as_bool()),
        (Some("send_ack"), Some(false))
    );
    assert_eq!(next_msg(&mut b).await["message"]["content"], "once");
    let again = request(&mut a, send_frame(text_to_user("ws-same", 222, "twice")), 2).await;
    assert_eq!(again["type"], "send_ack", "{again}");
    assert_eq!(again["req"], 2);
    assert_eq!(again["duplicate"], true);
    assert_eq!(again["client_msg_id"], "ws-same");
    assert_eq!(again["msg_id"], first["msg_id"]);
    assert_eq!(again["seq"], first["seq"]);
    assert_eq!(again["conversation_id"], "111-222");
    // Nothing new is stored or delivered.
    assert!(
        b.recv_until(Duration::from_millis(300), |v| v["type"] == "msg")
            .await
            .unwrap()
            .is_none(),
        "no second push"
    );
    let alice = s.anon().with_bearer(ta);
    assert_eq!(newest_seq(&alice, "111-222").await, 1);
}

/// PROTOCOL.md 5.1: the `send_ack` carries `created_at`, the message's own (the one its
/// push and history show), and a retry, which "returns the same `msg_id` and `seq`", returns
/// the first send's `created_at` too, not the time of the retry.
#[tokio::test]
async fn send_ack_created_at_is_the_messages_and_a_retry_repeats_it() {
    let s = spawn_server().await;
    let ta = s.token(111).await;
    let bob = s.user(222).await;
    let mut a = s.ws(&ta, "a").await;
    let first = request(&mut a, send_frame(text_to_user("ca-1", 222, "when")), 1).await;
    assert_eq!(first["type"], "send_ack", "{first}");
    let created_at = first["created_at"].as_i64().expect("created_at in ms");
    let own = next_msg(&mut a).await;
    assert_eq!(own["message"]["msg_id"], first["msg_id"]);
    assert_eq!(own["message"]["created_at"], created_at, "{own}");
    assert_eq!(at_seq(&bob, "111-222", 1).await["created_at"], created_at);
    // A retry a little later: the clock has moved, the message's time has not.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let again = request(&mut a, send_frame(text_to_user("ca-1", 222, "when")), 2).await;
    assert_eq!(again["duplicate"], true, "{again}");
    assert_eq!(again["created_at"], created_at, "{again}");
    // Over HTTP too.
    let alice = s.anon().with_bearer(ta);
    let http = alice
        .post("/v1/messages", &text_to_user("ca-1", 222, "when"))
        .await
        .unwrap();
    assert_eq!(
        (http["duplicate"].as_bool(), http["created_at"].as_i64()),
        (Some(true), Some(created_at)),
        "{http}"
    );
}

/// PROTOCOL.md 5: "A connection silent for more than two heartbeats is closed" (close code
/// 1001, PROTOCOL.md 5, extension), while one that keeps talking stays open.
#[tokio::test]
async fn a_silent_connection_is_closed_with_1001_after_two_heartbeats() {
    let s = spawn_with(|c| c.heartbeat_ms = 200).await;
    let t = s.token(111).await;
    let mut silent = s.ws(&t, "silent").await;
    let mut talker = s.ws(&t, "talker").await;
    assert_eq!(silent.hello["heartbeat_ms"], 200);
    // The talker pings every half heartbeat for five heartbeats and is answered every time.
    for i in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pong = request(&mut talker, json!({"type": "ping"}), i).await;
        assert_eq!(pong["type"], "pong");
    }
    assert_eq!(silent.closed(WAIT).await, Some(1001));
    // Once the talker falls silent too, it goes the same way.
    assert_eq!(talker.closed(WAIT).await, Some(1001));
}

/// PROTOCOL.md 5: "A connection silent for more than two heartbeats is closed": counted
/// from its last frame, and at that moment, not at a later tick of a coarser timer (the
/// server once checked every half heartbeat, closing up to half a heartbeat late).
#[tokio::test]
async fn the_silence_limit_is_two_heartbeats_from_the_last_frame() {
    let s = spawn_with(|c| c.heartbeat_ms = 4000).await;
    let t = s.token(113).await;
    let mut ws = s.ws(&t, "d").await;
    // Halfway between two of the old half-heartbeat ticks (2 s apart), which then closed
    // it 9 s after the ping, not 8.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let pinged = std::time::Instant::now();
    let pong = request(&mut ws, json!({"type": "ping"}), 1).await;
    assert_eq!(pong["type"], "pong");
    assert_eq!(ws.closed(Duration::from_secs(15)).await, Some(1001));
    let silent = pinged.elapsed();
    // The server saw the ping after it was sent: never sooner than two heartbeats after
    // it; later only by the machine's scheduling (up to 700 ms allowed: the full suite on
    // two busy cores).
    assert!(
        silent >= Duration::from_millis(8000) && silent < Duration::from_millis(8700),
        "closed {silent:?} after the ping"
    );
}

/// PROTOCOL.md 5: "A client may put an integer `req` in any request; the reply to it carries
/// the same `req`". A request whose success has no frame of its own (`read`, `ack`,
/// `typing`, the room frames) is answered `{"type":"ok","req":N}` when it carries one (a
/// `read` once committed: HTTP then shows it), and nothing when it does not.
#[tokio::test]
async fn requests_without_a_reply_of_their_own_are_answered_ok_when_they_carry_req() {
    let s = spawn_server().await;
    let ta = s.token(171).await;
    let alice = s.anon().with_bearer(ta.clone());
    let bob = s.user(172).await;
    let sent = bob
        .post("/v1/messages", &text_to_user("ok-1", 171, "read me"))
        .await
        .unwrap();
    let conv = sent["conversation_id"].as_str().unwrap().to_owned();
    let room = s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap()["room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut ws = s.ws(&ta, "d").await;
    let read = request(
        &mut ws,
        json!({"type": "read", "conversation_id": conv.clone(), "seq": 1}),
        11,
    )
    .await;
    assert_eq!(read, json!({"type": "ok", "req": 11}));
    let c = alice
        .get(&format!("/v1/conversations/{conv}"))
        .await
        .unwrap();
    assert_eq!(
        (c["last_read_seq"].as_u64(), c["unread"].as_u64()),
        (Some(1), Some(0)),
        "{c}"
    );
    for (req, frame) in [
        (12, json!({"type": "ack", "user_seq": 1})),
        (
            13,
            json!({"type": "typing", "conversation_id": conv.clone()}),
        ),
        (14, json!({"type": "room_join", "room_id": room.clone()})),
        (
            15,
            json!({"type": "room_send", "room_id": room.clone(), "content": "666"}),
        ),
        (16, json!({"type": "room_leave", "room_id": room.clone()})),
    ] {
        let answer = request(&mut ws, frame.clone(), req).await;
        assert_eq!(answer, json!({"type": "ok", "req": req}), "{frame}");
    }
    // Without `req`: nothing; the next frame is the pong of the ping after it.
    ws.send(&json!({"type": "typing", "conversation_id": conv.clone()}))
        .await
        .unwrap();
    ws.send(&json!({"type": "ping", "req": 17})).await.unwrap();
    let next = ws.recv(WAIT).await.unwrap().expect("a frame");
    assert_eq!(
        (next["type"].as_str(), next["req"].as_i64()),
        (Some("pong"), Some(17)),
        "{next}"
    );
}

/// PROTOCOL.md 5: "`{"type":"ping"}` gets `{"type":"pong","server_time":ms}`", a time in
/// milliseconds since the epoch, also for a ping without `req`.
#[tokio::test]
async fn ping_gets_pong_with_the_server_time_in_ms() {
    let s = spawn_server().await;
    let t = s.token(111).await;
    let mut ws = s.ws(&t, "d").await;
    let before = now_ms();
    ws.send(&json!({"type": "ping"})).await.unwrap();
    let pong = ws
        .recv_until(WAIT, |v| v["type"] == "pong")
        .await
        .unwrap()
        .expect("pong");
    let after = now_ms();
    let at = pong["server_time"].as_i64().expect("server_time in ms");
    assert!(
        (before - 2000..=after + 2000).contains(&at),
        "server_time {at} is now ({before}..{after}) in ms"
    );
}

/// The test machine's clock, in milliseconds since the Unix epoch.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// PROTOCOL.md 1: "`client_msg_id`: 1-64 characters of `[A-Za-z0-9_-]`": 64 characters are
/// taken (and echoed), 65 are `invalid_argument` over HTTP and over the WebSocket.
#[tokio::test]
async fn client_msg_ids_of_64_characters_are_taken_and_65_refused() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    let id64 = format!("a-_Z9{}", "x".repeat(59));
    assert_eq!(id64.len(), 64);
    let ack = alice
        .post("/v1/messages", &text_to_user(&id64, 222, "long id"))
        .await
        .expect("64 characters are fine");
    assert_eq!(ack["client_msg_id"], id64.as_str());
    let id65 = "y".repeat(65);
    let (status, body) = alice
        .raw(
            reqwest::Method::POST,
            "/v1/messages",
            Some(&text_to_user(&id65, 222, "too long")),
        )
        .await
        .unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("invalid_argument"))
    );
    let t = s.token(111).await;
    let mut ws = s.ws(&t, "d").await;
    let ack = request(
        &mut ws,
        send_frame(text_to_user(&"z".repeat(64), 222, "ws")),
        1,
    )
    .await;
    assert_eq!(ack["type"], "send_ack", "{ack}");
    let e = request(
        &mut ws,
        send_frame(text_to_user(&"z".repeat(65), 222, "ws")),
        2,
    )
    .await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("invalid_argument"))
    );
    assert_eq!(
        newest_seq(&alice, "111-222").await,
        2,
        "only the two accepted"
    );
}

/// PROTOCOL.md 1: "`kind`, user content: `text`, `image`, `voice`, `video`, `file`,
/// `custom`": each is stored and read back as sent, its content untouched.
#[tokio::test]
async fn every_user_content_kind_is_accepted() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let bob = s.user(222).await;
    let kinds = ["text", "image", "voice", "video", "file", "custom"];
    for (i, kind) in kinds.iter().enumerate() {
        let content = format!("https://cdn.example/{kind}/{i}");
        let ack = alice
            .post(
                "/v1/messages",
                &json!({"client_msg_id": format!("k-{kind}"), "to": {"user": 222}, "kind": kind, "content": content}),
            )
            .await
            .unwrap_or_else(|e| panic!("kind {kind}: {e}"));
        assert_eq!(ack["seq"], i as u64 + 1);
        let m = at_seq(&bob, "111-222", i as u64 + 1).await;
        assert_eq!(
            (m["kind"].as_str(), m["content"].as_str()),
            (Some(*kind), Some(content.as_str()))
        );
    }
}

/// PROTOCOL.md 2: `--listen` is the "HTTP + WebSocket address": a host name with its port
/// (`localhost:8080`) is taken as well as an IP address, and one that is neither is refused.
#[test]
fn listen_addresses_take_a_host_name_and_port() {
    use pigeon_server::config::parse_listen;
    let a = parse_listen("localhost:8080").expect("localhost resolves");
    assert!(a.ip().is_loopback() && a.port() == 8080, "{a}");
    let ip: std::net::SocketAddr = "127.0.0.1:9000".parse().unwrap();
    assert_eq!(parse_listen("127.0.0.1:9000"), Ok(ip));
    assert_eq!(parse_listen("[::1]:9000").map(|a| a.port()), Ok(9000));
    for bad in ["nonsense", "localhost", "127.0.0.1:port", ""] {
        assert!(parse_listen(bad).is_err(), "{bad:?} is refused");
    }
}

/// PROTOCOL.md 3: "WebSocket: the same header, or `?token=<token>` in the URL for browsers".
/// (A connection with only `?token=` is pinned by
/// `websocket_accepts_the_token_in_the_query_and_says_hello`.) When an upgrade carries both,
/// the header counts (PROTOCOL.md 3, extension): the server reads the `Authorization:
/// Bearer` header and then does not look at the query. This pins that choice: with two
/// valid tokens of different users, the header's user is connected; with a bad bearer token
/// in the header, a good one in the query does not rescue the upgrade (401 `unauthorized`,
/// as for any bad token).
#[tokio::test]
async fn with_a_token_in_both_the_header_and_the_query_the_header_decides() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let s = spawn_server().await;
    let (ta, tb) = (s.token(111).await, s.token(222).await);
    let upgrade = |header: String, query_token: &str| {
        let mut req = format!("{}/v1/ws?device_id=d&token={query_token}", s.ws_base)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", header.parse().unwrap());
        req
    };
    let ws = WsConn::connect_request(upgrade(format!("Bearer {ta}"), tb.as_str()))
        .await
        .expect("two valid tokens: let in");
    assert_eq!(
        ws.hello["user_id"], 111,
        "the header's user, not the query's: {}",
        ws.hello
    );
    match WsConn::connect_request(upgrade("Bearer not-a-token".to_owned(), ta.as_str())).await {
        Err(pigeon_client::ClientError::Api { status, body }) => {
            assert_eq!((status, body.code.as_str()), (401, "unauthorized"))
        }
        Err(e) => panic!("refused otherwise than with 401: {e}"),
        Ok(ws) => panic!(
            "a bad header token was passed over for the query's: {}",
            ws.hello
        ),
    }
}

//! Live rooms (PROTOCOL.md 7): batches to viewers, one room at a time, nothing stored.

use crate::*;
use serde_json::json;

/// How many viewers `GET /v1/rooms/{id}` counts.
pub(crate) async fn viewers(s: &TestServer, room: &str) -> u64 {
    let info = s
        .user(3)
        .await
        .get(&format!("/v1/rooms/{room}"))
        .await
        .unwrap();
    info["viewers"].as_u64().unwrap()
}

#[tokio::test]
async fn viewers_receive_batches_and_a_user_watches_one_room_at_a_time() {
    let s = spawn_server().await;
    let r1 = s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap()["room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let r2 = s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap()["room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(r1.starts_with('r') && r1 != r2);
    let (ta, tb) = (s.token(1).await, s.token(2).await);
    let mut a = s.ws(&ta, "a").await;
    let mut b = s.ws(&tb, "b").await;
    a.send(&json!({"type": "room_join", "room_id": r1}))
        .await
        .unwrap();
    b.send(&json!({"type": "room_join", "room_id": r1}))
        .await
        .unwrap();
    let _ = request(&mut b, json!({"type": "ping"}), 1).await; // the join is handled
    let _ = request(&mut a, json!({"type": "ping"}), 1).await;
    for i in 0..5 {
        a.send(&json!({"type": "room_send", "room_id": r1, "content": format!("66{i}")}))
            .await
            .unwrap();
    }
    let mut got = Vec::new();
    while got.len() < 5 {
        let f = b
            .recv_until(WAIT, |v| v["type"] == "room_msgs")
            .await
            .unwrap()
            .expect("a batch");
        assert_eq!(f["room_id"], r1.as_str());
        for m in f["messages"].as_array().unwrap() {
            assert_eq!(m["sender"], 1);
            assert!(m["at"].is_i64());
            got.push(m["content"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(got, vec!["660", "661", "662", "663", "664"]);
    let info = s
        .user(3)
        .await
        .get(&format!("/v1/rooms/{r1}"))
        .await
        .unwrap();
    assert_eq!(info["viewers"], 2);
    assert_eq!(info["recent"].as_array().unwrap().len(), 5);
    // Joining another room leaves the first.
    b.send(&json!({"type": "room_join", "room_id": r2}))
        .await
        .unwrap();
    let _ = request(&mut b, json!({"type": "ping"}), 2).await;
    assert_eq!(viewers(&s, &r1).await, 1);
    a.send(&json!({"type": "room_send", "room_id": r1, "content": "only a"}))
        .await
        .unwrap();
    assert!(
        b.recv_until(Duration::from_millis(400), |v| v["type"] == "room_msgs")
            .await
            .unwrap()
            .is_none()
    );
    // Sending to a room one is not in, or to no room, is refused.
    let e = request(
        &mut b,
        json!({"type": "room_send", "room_id": r1, "content": "x"}),
        3,
    )
    .await;
    assert_eq!(e["code"], "not_member");
    let e = request(&mut b, json!({"type": "room_join", "room_id": "r404"}), 4).await;
    assert_eq!(e["code"], "not_found");
    // A join that failed leaves b in the room it was in: it still sends there.
    assert_eq!(viewers(&s, &r2).await, 1);
    // Content over the room limit is `payload_too_large`, empty content `invalid_argument`.
    let e = request(
        &mut b,
        json!({"type": "room_send", "room_id": r2, "content": "x".repeat(1025)}),
        5,
    )
    .await;
    assert_eq!(e["code"], "payload_too_large");
    let e = request(
        &mut b,
        json!({"type": "room_send", "room_id": r2, "content": ""}),
        6,
    )
    .await;
    assert_eq!(e["code"], "invalid_argument");
    // Closing a room.
    s.admin
        .delete(&format!("/v1/admin/rooms/{r2}"))
        .await
        .expect("room closed");
    assert_eq!(
        code_of(s.user(3).await.get(&format!("/v1/rooms/{r2}")).await),
        "not_found"
    );
    assert_eq!(
        code_of(s.user(3).await.post("/v1/admin/rooms", &json!({})).await),
        "unauthorized"
    );
}

/// "A user is in at most one room at a time (joining another leaves the first)": across the
/// user's connections too. A room closed while watched leaves nothing behind.
#[tokio::test]
async fn a_user_with_two_connections_is_in_one_room() {
    let s = spawn_server().await;
    let room = || async {
        s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap()["room_id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (r1, r2) = (room().await, room().await);
    let t = s.token(7).await;
    let mut phone = s.ws(&t, "phone").await;
    let mut laptop = s.ws(&t, "laptop").await;
    phone
        .send(&json!({"type": "room_join", "room_id": r1}))
        .await
        .unwrap();
    let _ = request(&mut phone, json!({"type": "ping"}), 1).await;
    assert_eq!((viewers(&s, &r1).await, viewers(&s, &r2).await), (1, 0));
    // The laptop joins another room: the user leaves the first, on the phone too.
    laptop
        .send(&json!({"type": "room_join", "room_id": r2}))
        .await
        .unwrap();
    let _ = request(&mut laptop, json!({"type": "ping"}), 2).await;
    assert_eq!((viewers(&s, &r1).await, viewers(&s, &r2).await), (0, 1));
    let e = request(
        &mut phone,
        json!({"type": "room_send", "room_id": r1, "content": "still here?"}),
        3,
    )
    .await;
    assert_eq!(e["code"], "not_member");
    // Both connections in the same room are still one user in one room.
    phone
        .send(&json!({"type": "room_join", "room_id": r2}))
        .await
        .unwrap();
    let _ = request(&mut phone, json!({"type": "ping"}), 4).await;
    assert_eq!(viewers(&s, &r2).await, 2);
    // Closing the room the user watches, then joining the other one, works as from scratch.
    s.admin
        .delete(&format!("/v1/admin/rooms/{r2}"))
        .await
        .expect("room closed");
    phone
        .send(&json!({"type": "room_join", "room_id": r1}))
        .await
        .unwrap();
    let _ = request(&mut phone, json!({"type": "ping"}), 5).await;
    assert_eq!(viewers(&s, &r1).await, 1);
}

/// PROTOCOL.md 7: `GET /v1/rooms/{id}` gives "the most recent messages": a message is there
/// as soon as its `room_send` is handled, not only after the next batch to the viewers
/// (every 100 ms, PROTOCOL.md 7, extension).
#[tokio::test]
async fn a_room_message_is_in_recent_as_soon_as_it_is_sent() {
    let s = spawn_server().await;
    let room = s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap()["room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let onlooker = s.user(3).await;
    let t = s.token(1).await;
    let mut ws = s.ws(&t, "a").await;
    ws.send(&json!({"type": "room_join", "room_id": room}))
        .await
        .unwrap();
    // A few rounds: one read that happened to follow a batch would pass by luck.
    for round in 1..=5i64 {
        let content = format!("now-{round}");
        ws.send(&json!({"type": "room_send", "room_id": room, "content": content}))
            .await
            .unwrap();
        // The pong comes once the join and the send were handled.
        let pong = request(&mut ws, json!({"type": "ping"}), round).await;
        assert_eq!(pong["type"], "pong");
        let info = onlooker.get(&format!("/v1/rooms/{room}")).await.unwrap();
        let recent: Vec<&str> = info["recent"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert!(recent.contains(&content.as_str()), "round {round}: {info}");
    }
}

/// PROTOCOL.md 7: "`DELETE /v1/admin/rooms/{id}` closes it"; its extension:
/// "Viewers of a room closed by `DELETE /v1/admin/rooms/{id}` get
/// `{"type":"room_closed","room_id"}`". Every viewer is told (and nobody watching another
/// room); afterwards the room is gone: `GET /v1/rooms/{id}` answers 404 `not_found` and a
/// `room_join` of it `not_found`.
#[tokio::test]
async fn closing_a_room_tells_its_viewers_and_forgets_it() {
    let s = spawn_server().await;
    let new_room = || async {
        s.admin.post("/v1/admin/rooms", &json!({})).await.unwrap()["room_id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (room, other) = (new_room().await, new_room().await);
    let (t1, t2, t3) = (s.token(1).await, s.token(2).await, s.token(3).await);
    let mut v1 = s.ws(&t1, "v1").await;
    let mut v2 = s.ws(&t2, "v2").await;
    let mut elsewhere = s.ws(&t3, "v3").await;
    for (ws, r) in [(&mut v1, &room), (&mut v2, &room), (&mut elsewhere, &other)] {
        ws.send(&json!({"type": "room_join", "room_id": r}))
            .await
            .unwrap();
        // The pong comes once the join was handled.
        let pong = request(ws, json!({"type": "ping"}), 1).await;
        assert_eq!(pong["type"], "pong");
    }
    assert_eq!(viewers(&s, &room).await, 2);

    s.admin
        .delete(&format!("/v1/admin/rooms/{room}"))
        .await
        .expect("room closed");
    for ws in [&mut v1, &mut v2] {
        let f = ws
            .recv_until(WAIT, |v| v["type"] == "room_closed")
            .await
            .unwrap()
            .expect("a room_closed frame");
        assert_eq!(f, json!({"type": "room_closed", "room_id": room}));
    }
    let stray = elsewhere
        .recv_until(Duration::from_millis(300), |v| v["type"] == "room_closed")
        .await
        .unwrap();
    assert!(
        stray.is_none(),
        "a viewer of another room was told: {stray:?}"
    );

    let onlooker = s.user(4).await;
    let (status, body) = onlooker
        .raw(reqwest::Method::GET, &format!("/v1/rooms/{room}"), None)
        .await
        .unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );
    let e = request(&mut v1, json!({"type": "room_join", "room_id": room}), 2).await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("not_found")),
        "{e}"
    );
    // The other room is untouched.
    assert_eq!(viewers(&s, &other).await, 1);
}

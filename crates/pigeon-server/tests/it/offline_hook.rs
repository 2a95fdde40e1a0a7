//! The offline hook posts to a real HTTP receiver for users with no connected device, and a
//! receiver that is down or slow does not slow sending.

use crate::*;
use axum::routing::post;
use serde_json::json;
use std::sync::{Arc, Mutex};

type Received = Arc<Mutex<Vec<Value>>>;

/// Starts a receiver that records every notification and answers after `delay`.
async fn receiver(delay: Duration) -> (String, Received) {
    let got: Received = Arc::default();
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        post(move |axum::Json(body): axum::Json<Value>| {
            let sink = sink.clone();
            async move {
                tokio::time::sleep(delay).await;
                sink.lock().unwrap().extend(
                    body["notifications"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default(),
                );
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/hook"), got)
}

async fn wait_for(got: &Received, n: usize) -> Vec<Value> {
    for _ in 0..100 {
        if got.lock().unwrap().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    got.lock().unwrap().clone()
}

#[tokio::test]
async fn offline_members_are_notified_online_and_muted_ones_are_not() {
    let (url, got) = receiver(Duration::ZERO).await;
    let s = spawn_with(|c| c.offline_webhook_url = Some(url)).await;
    let alice = s.user(1).await;
    let bob = s.user(2).await;
    let tc = s.token(3).await;
    let _online = s.ws(&tc, "carol-phone").await;
    alice
        .post("/v1/messages", &text_to_user("o1", 2, "are you there?"))
        .await
        .unwrap();
    alice
        .post("/v1/messages", &text_to_user("o2", 3, "carol is online"))
        .await
        .unwrap();
    let seen = wait_for(&got, 1).await;
    assert_eq!(
        seen.len(),
        1,
        "only the offline recipient, never the sender or online users: {seen:?}"
    );
    let n = &seen[0];
    assert_eq!(n["recipient"], 2);
    assert_eq!(n["sender"], 1);
    assert_eq!(n["conversation_id"], "1-2");
    assert_eq!(n["preview"], "are you there?");
    assert_eq!(n["unread_total"], 1);
    assert_eq!(n["seq"], 1);
    // Bob mutes the chat: no more notifications for it.
    bob.put(
        "/v1/conversations/1-2/settings",
        Some(&json!({"muted": true})),
    )
    .await
    .unwrap();
    alice
        .post("/v1/messages", &text_to_user("o3", 2, "muted now"))
        .await
        .unwrap();
    let gid = new_group_named(&alice, "g", &[2]).await;
    alice
        .post("/v1/messages", &text_to_conv("o4", &gid, "in the group"))
        .await
        .unwrap();
    let seen = wait_for(&got, 2).await;
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        seen[1]["preview"], "in the group",
        "command messages and muted chats are not notified"
    );
    assert_eq!(
        seen[1]["unread_total"], 1,
        "the muted chat's unread is left out of the total"
    );
}

#[tokio::test]
async fn a_down_or_slow_receiver_does_not_slow_sending() {
    for url in [None, Some(Duration::from_secs(5))] {
        let url = match url {
            // Nothing listens on this port.
            None => {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let addr = l.local_addr().unwrap();
                drop(l);
                format!("http://{addr}/hook")
            }
            Some(delay) => receiver(delay).await.0,
        };
        let s = spawn_with(|c| {
            c.offline_webhook_url = Some(url);
            c.offline_webhook_timeout_ms = 300;
        })
        .await;
        let ta = s.token(1).await;
        let _ = s.token(2).await;
        let mut a = s.ws(&ta, "a").await;
        for i in 0..300 {
            a.send(&send_frame(text_to_user(&format!("s{i}"), 2, "x")))
                .await
                .unwrap();
        }
        let mut acks = 0;
        while acks < 300 {
            let v = a
                .recv_until(Duration::from_secs(5), |v| v["type"] == "send_ack")
                .await
                .unwrap();
            assert!(
                v.is_some(),
                "acks keep coming while the hook is unreachable or slow"
            );
            acks += 1;
        }
    }
}

/// A device whose connection the server closes is offline from the moment its close frame
/// is sent, not once the client answers it (the server waits up to 1 s for that answer,
/// reading what comes): a message sent in that second notifies it.
#[tokio::test]
async fn a_device_the_server_closes_is_offline_while_its_answer_is_awaited() {
    let (url, got) = receiver(Duration::ZERO).await;
    let s = spawn_with(|c| {
        c.offline_webhook_url = Some(url);
        c.heartbeat_ms = 200;
    })
    .await;
    let alice = s.user(1).await;
    let tc = s.token(3).await;
    // Never read again, so it never answers the close frame.
    let _silent = s.ws(&tc, "carol-phone").await;
    // Closed with 1001 after two heartbeats (400-500 ms); its answer is awaited until ~1.5 s.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    alice
        .post("/v1/messages", &text_to_user("c1", 3, "still there?"))
        .await
        .unwrap();
    let seen = wait_for(&got, 1).await;
    assert_eq!(seen.len(), 1, "carol is offline: {seen:?}");
    assert_eq!(seen[0]["recipient"], 3);
}

//! The client SDK through a faulty network: every client ends up with every message of its
//! conversations exactly once, in seq order, and every chain is gap-free.

use crate::proxy::{self, Faults};
use crate::*;
use pigeon_client::{Client, ClientConfig, Event, Outgoing};
use pigeon_proto::views::SendTarget;
use pigeon_proto::{ConversationId, UserId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

type Shown = Arc<Mutex<HashMap<String, Vec<u64>>>>;

fn sdk_config(ws_base: &str, token: &str, device: &str) -> ClientConfig {
    let mut cfg = ClientConfig::new(ws_base, token, device);
    cfg.ack_interval = Duration::from_millis(50);
    cfg.send_retry = Duration::from_millis(700);
    cfg.backoff_min = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(300);
    cfg.pull_timeout = Duration::from_millis(1000);
    cfg
}

/// Starts a client whose messages are recorded per conversation, in the order shown.
fn start_client(cfg: ClientConfig) -> (Client, Shown) {
    let (client, mut events) = Client::start(cfg);
    let shown: Shown = Arc::default();
    let sink = shown.clone();
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            if let Event::Message(m) = ev {
                sink.lock()
                    .unwrap()
                    .entry(m.conversation_id.clone())
                    .or_default()
                    .push(m.seq);
            }
        }
    });
    (client, shown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_sees_every_message_once_in_order_through_a_faulty_network() {
    let s = spawn_with(|c| {
        c.fanout_write_max_members = 4;
        c.push_retry_ms = 300;
    })
    .await;
    let users: Vec<u64> = (1..=6).collect();
    let mut tokens = HashMap::new();
    for u in &users {
        tokens.insert(*u, s.token(*u).await);
    }
    let owner = s.anon().with_bearer(tokens[&1].clone());
    let small = new_group_named(&owner, "small", &[2, 3]).await;
    let big = new_group_named(&owner, "big", &[2, 3, 4, 5, 6]).await;
    assert_eq!(
        owner
            .get(&format!("/v1/conversations/{big}"))
            .await
            .unwrap()["fanout"],
        "read"
    );
    let faults = Faults {
        drop: 0.05,
        duplicate: 0.05,
        reorder: 0.05,
        cut: 0.004,
        max_delay_ms: 3,
        // Other seeds and sizes by hand: PIGEON_PROXY_SEED=3 PIGEON_PROXY_SENDS=50.
        seed: env_or("PIGEON_PROXY_SEED", 7),
    };
    let proxy = proxy::start(s.ws_base.clone(), faults).await;

    let mut clients = HashMap::new();
    for u in &users {
        let (c, shown) = start_client(sdk_config(&proxy.ws_base, &tokens[u], &format!("dev{u}")));
        clients.insert(*u, (Arc::new(c), shown));
    }
    let per_user = env_or("PIGEON_PROXY_SENDS", 200) as usize;
    let mut sends = Vec::new();
    for u in users.clone() {
        let client = clients[&u].0.clone();
        let small = small.clone();
        let big = big.clone();
        sends.push(tokio::spawn(async move {
            for n in 0..per_user {
                let to = match (n + u as usize) % 4 {
                    0 if u <= 3 => SendTarget {
                        user: None,
                        conversation: Some(ConversationId::parse(&small).unwrap()),
                    },
                    1 => SendTarget {
                        user: None,
                        conversation: Some(ConversationId::parse(&big).unwrap()),
                    },
                    _ => {
                        let peer = 1 + (u + n as u64) % 6;
                        let peer = if peer == u { 1 + (peer % 6) } else { peer };
                        SendTarget {
                            user: Some(UserId::new(peer).unwrap()),
                            conversation: None,
                        }
                    }
                };
                let ack = tokio::time::timeout(
                    Duration::from_secs(30),
                    client.send(Outgoing::text(to, format!("{u}:{n}"))),
                )
                .await
                .expect("send acknowledged despite the faults")
                .expect("send succeeds");
                assert!(ack.seq >= 1);
            }
        }));
    }
    for t in sends {
        t.await.unwrap();
    }
    // What each user must end up with: every seq of each of their conversations.
    let mut expected: HashMap<u64, HashMap<String, u64>> = HashMap::new();
    for u in &users {
        let h = s.anon().with_bearer(tokens[u].clone());
        let list = h.get("/v1/conversations?limit=200").await.unwrap();
        for c in list["conversations"].as_array().unwrap() {
            let id = c["conversation_id"].as_str().unwrap().to_owned();
            let head = newest_seq(&h, &id).await;
            expected.entry(*u).or_default().insert(id, head);
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let done = users.iter().all(|u| {
            let shown = clients[u].1.lock().unwrap();
            expected[u]
                .iter()
                .all(|(c, head)| shown.get(c).map_or(0, |v| v.len()) as u64 >= *head)
        });
        if done || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for u in &users {
        let shown = clients[u].1.lock().unwrap().clone();
        for (conv, head) in &expected[u] {
            let got = shown.get(conv).cloned().unwrap_or_default();
            assert_eq!(
                got,
                (1..=*head).collect::<Vec<_>>(),
                "user {u} in {conv}: every message once, in order"
            );
        }
        assert_eq!(
            shown.len(),
            expected[u].len(),
            "user {u} saw no conversation it is not in"
        );
    }
    assert!(
        proxy.cuts.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the network did cut connections"
    );
    assert!(
        proxy.dropped.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the network did drop frames"
    );
}

#[tokio::test]
async fn a_client_without_local_state_resumes_from_the_server_side_cursor() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    let tb = s.token(2).await;
    post_texts(&alice, "a", 2, 5, "early").await;
    let (client, shown) = start_client(sdk_config(&s.ws_base, &tb, "phone"));
    for _ in 0..100 {
        if shown.lock().unwrap().get("1-2").map_or(0, |v| v.len()) == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(shown.lock().unwrap()["1-2"], vec![1, 2, 3, 4, 5]);
    tokio::time::sleep(Duration::from_millis(200)).await; // acks are batched
    client.shutdown().await;
    for i in 5..8 {
        alice
            .post("/v1/messages", &text_to_user(&format!("a{i}"), 2, "later"))
            .await
            .unwrap();
    }
    // A new client (no local state) on the same device picks up after what was acknowledged.
    let (_client, shown) = start_client(sdk_config(&s.ws_base, &tb, "phone"));
    for _ in 0..100 {
        if shown.lock().unwrap().get("1-2").map_or(0, |v| v.len()) >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(shown.lock().unwrap()["1-2"], vec![6, 7, 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_the_fanout_threshold_with_messages_in_flight() {
    let s = spawn_with(|c| {
        c.fanout_write_max_members = 4;
        c.push_retry_ms = 300;
    })
    .await;
    let mut tokens = HashMap::new();
    for u in 1..=6u64 {
        tokens.insert(u, s.token(u).await);
    }
    let owner = s.anon().with_bearer(tokens[&1].clone());
    let g = new_group_named(&owner, "edge", &[2, 3]).await;
    // Members 1-3 stay throughout and watch through the SDK.
    let mut watchers = Vec::new();
    for u in 1..=3u64 {
        watchers.push(start_client(sdk_config(
            &s.ws_base,
            &tokens[&u],
            &format!("w{u}"),
        )));
    }
    let sender = {
        let h = s.anon().with_bearer(tokens[&2].clone());
        let g = g.clone();
        tokio::spawn(async move {
            for i in 0..150 {
                h.post(
                    "/v1/messages",
                    &text_to_conv(&format!("f{i}"), &g, &i.to_string()),
                )
                .await
                .unwrap();
            }
        })
    };
    // Meanwhile the group grows past the threshold and shrinks back, again and again.
    for _ in 0..6 {
        invite(&owner, &g, &[4, 5]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        for u in [4, 5] {
            owner
                .delete(&format!("/v1/groups/{g}/members/{u}"))
                .await
                .expect("kick");
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    sender.await.unwrap();
    let head = newest_seq(&owner, &g).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::time::Instant::now() < deadline {
        if watchers
            .iter()
            .all(|(_, shown)| shown.lock().unwrap().get(&g).map_or(0, |v| v.len()) as u64 >= head)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (i, (_, shown)) in watchers.iter().enumerate() {
        let got = shown.lock().unwrap().get(&g).cloned().unwrap_or_default();
        assert_eq!(
            got,
            (1..=head).collect::<Vec<_>>(),
            "watcher {} saw every seq once, in order",
            i + 1
        );
    }
}

/// A number from the environment, or `default`.
fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

//! A group of thousands: read fan-out, receipts that stay cheap, writes that grow with the
//! work asked for and not with members × messages.

use crate::*;
use serde_json::json;
use std::sync::atomic::Ordering;

async fn register_all(s: &TestServer, ids: std::ops::RangeInclusive<u64>) {
    let ids: Vec<u64> = ids.collect();
    let mut tasks = Vec::new();
    for chunk in ids.chunks(100) {
        let admin = s.admin.clone();
        let chunk = chunk.to_vec();
        tasks.push(tokio::spawn(async move {
            for id in chunk {
                admin.upsert_user(id, "m").await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_in_a_2000_member_group_cost_one_write_each() {
    let s = spawn_server().await;
    register_all(&s, 1..=2000).await;
    let owner = s.user(1).await;
    let first: Vec<u64> = (2..=1000).collect();
    let gid = new_group_named(&owner, "big", &first).await;
    let rest: Vec<u64> = (1001..=2000).collect();
    let g = invite(&owner, &gid, &rest).await.unwrap();
    assert_eq!(g["member_count"], 2000);
    assert_eq!(g["fanout"], "read");
    let stats = s.running.as_ref().unwrap().app.pipeline.stats();

    // 20 messages: no inbox rows, and only the sender's own membership row per batch.
    let (inbox0, members0) = (
        stats.inbox_rows.load(Ordering::Relaxed),
        stats.member_rows.load(Ordering::Relaxed),
    );
    for i in 0..20 {
        owner
            .post(
                "/v1/messages",
                &text_to_conv(&format!("b{i}"), &gid, "to everyone"),
            )
            .await
            .unwrap();
    }
    assert_eq!(
        stats.inbox_rows.load(Ordering::Relaxed),
        inbox0,
        "read fan-out writes no inbox rows"
    );
    assert!(
        stats.member_rows.load(Ordering::Relaxed) - members0 <= 20,
        "one sender row per send at most"
    );

    // 50 members report reads (some twice): one membership row per report that moves.
    let t_watch = s.token(1500).await;
    let mut watcher = s.ws(&t_watch, "w").await;
    let members0 = stats.member_rows.load(Ordering::Relaxed);
    let mut tasks = Vec::new();
    for reader in 2..=51u64 {
        let h = s.user(reader).await;
        let gid = gid.clone();
        tasks.push(tokio::spawn(async move {
            h.post(
                &format!("/v1/conversations/{gid}/read"),
                &json!({"seq": 10}),
            )
            .await
            .unwrap();
            h.post(
                &format!("/v1/conversations/{gid}/read"),
                &json!({"seq": 22}),
            )
            .await
            .unwrap();
            h.post(&format!("/v1/conversations/{gid}/read"), &json!({"seq": 5}))
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let written = stats.member_rows.load(Ordering::Relaxed) - members0;
    assert!(
        written <= 100,
        "{written} membership rows for 100 forward-moving read reports"
    );
    // Receipts are coalesced: a watching member hears each reader's newest position, not all.
    let mut receipts = std::collections::HashMap::new();
    while let Some(r) = watcher
        .recv_until(Duration::from_millis(800), |v| v["type"] == "receipt")
        .await
        .unwrap()
    {
        let e = receipts
            .entry(r["user_id"].as_u64().unwrap())
            .or_insert(0u64);
        *e = (*e).max(r["last_read_seq"].as_u64().unwrap());
    }
    assert_eq!(receipts.len(), 50, "every reader is announced");
    assert!(
        receipts.values().all(|s| *s == 22),
        "with their newest position"
    );
    let r = s
        .user(77)
        .await
        .get(&format!("/v1/conversations/{gid}/receipts?seq=22"))
        .await
        .unwrap();
    assert_eq!(r["read"].as_array().unwrap().len(), 50);
    assert_eq!(
        r["unread"].as_array().unwrap().len(),
        1949,
        "everyone else but the sender"
    );
    let unread = s.user(1999).await.get("/v1/unread").await.unwrap();
    assert_eq!(unread["total"], 20);
}

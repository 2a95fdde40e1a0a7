//! The store failing under the pipeline, for real: another connection holds the SQLite
//! database's write lock for longer than the server's busy timeout, so the journal's batches
//! cannot reach the tables.
//!
//! - A batch already journaled is acknowledged and lost by nothing: it reaches the tables once
//!   the lock is gone, at the seq its ack gave.
//! - With the journal's backlog full (a 1 KiB limit here), the next commit fails after its
//!   wait, and the batch decided on top of it (the pipeline decides batch N+1 while batch N
//!   commits) is refused with it: all `unavailable`, nothing of either stored, and seqs go on
//!   from what the store holds, with no gap and no seq given twice. Meanwhile `/readyz`
//!   answers 503, and 200 again once a commit goes through.

use crate::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Another connection takes the server's SQLite write lock and holds it for `hold`; returns
/// once it is held, with the thread and a flag set just before the lock is let go.
fn hold_write_lock(
    s: &TestServer,
    hold: Duration,
) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
    let db = s.dir.0.join("pigeon.db");
    let released = Arc::new(AtomicBool::new(false));
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let holder = {
        let released = released.clone();
        std::thread::spawn(move || {
            let c = rusqlite::Connection::open(db).unwrap();
            c.busy_timeout(Duration::from_secs(5)).unwrap();
            c.execute_batch("BEGIN IMMEDIATE").unwrap();
            locked_tx.send(()).unwrap();
            std::thread::sleep(hold);
            released.store(true, Ordering::SeqCst);
            c.execute_batch("ROLLBACK").unwrap();
        })
    };
    locked_rx.recv().unwrap();
    (holder, released)
}

#[tokio::test]
async fn a_failed_commit_refuses_the_batch_decided_on_top_of_it_and_a_journaled_one_survives() {
    let s = spawn_with(|c| c.journal_backlog_kib = 1).await;
    let alice = s.user(1).await;
    s.user(2).await;
    let mut ws = s.ws(&s.token(1).await, "d1").await;
    let zero = request(&mut ws, send_frame(text_to_user("c0", 2, "zero")), 1).await;
    assert_eq!(zero["type"], "send_ack", "{zero}");
    let conv = zero["conversation_id"].as_str().unwrap().to_owned();
    // A read waits until the tables hold "zero", so the lock below is not taken mid-apply.
    assert_eq!(alice.whole_history(&conv).await.unwrap().len(), 1);

    // Longer than the server's busy timeout and its wait for room in the journal's backlog
    // (5 s each): the apply fails (and is retried), the next commit gives up.
    let (holder, _) = hold_write_lock(&s, Duration::from_millis(6_500));

    // A is journaled (the backlog was empty) and acknowledged; the tables cannot take it.
    // Its record alone fills the backlog's KiB.
    let one = "one ".repeat(300);
    let a = request(&mut ws, send_frame(text_to_user("c1", 2, &one)), 1000).await;
    assert_eq!(
        (a["type"].as_str(), a["seq"].as_u64()),
        (Some("send_ack"), Some(2)),
        "{a}"
    );
    // B finds the backlog full and waits in its commit; then a chunk of sends arrives, which
    // the pipeline decides on top of B while B's commit waits.
    let mut b = send_frame(text_to_user("c2", 2, "two"));
    b["req"] = json!(1001);
    ws.send(&b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let chunk = pigeon_server::pipeline::DECIDE_CHUNK as i64;
    for k in 0..chunk {
        let mut b = send_frame(text_to_user(&format!("b{k}"), 2, &format!("b{k}")));
        b["req"] = json!(2000 + k);
        ws.send(&b).await.unwrap();
    }
    for req in std::iter::once(1001).chain((0..chunk).map(|k| 2000 + k)) {
        let reply = ws
            .recv_until(Duration::from_secs(20), |v| v["req"] == json!(req))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no reply to req {req}"));
        assert_eq!(reply["type"], "error", "{reply}");
        assert_eq!(reply["code"], "unavailable", "{reply}");
    }
    // PROTOCOL.md 2: `/readyz` answers 503 when the server cannot serve; while commits
    // fail it cannot take a message, however well it reads. A batch that writes nothing
    // (the barrier of this `ping`, behind the refused sends) does not say otherwise.
    let pong = request(&mut ws, json!({"type": "ping"}), 7).await;
    assert_eq!(pong["type"], "pong", "{pong}");
    let anon = s.anon();
    let (status, body) = anon
        .raw(reqwest::Method::GET, "/readyz", None)
        .await
        .unwrap();
    assert_eq!((status, &body["status"]), (503, &json!("commits failing")));
    holder.join().unwrap();

    // The store is the truth again: A reached the tables, the next message takes seq 3, and
    // the refused sends are new messages when retried (they were never stored), not
    // duplicates, at the seqs that follow.
    let c = request(&mut ws, send_frame(text_to_user("c3", 2, "three")), 4).await;
    assert_eq!(
        (c["type"].as_str(), c["seq"].as_u64()),
        (Some("send_ack"), Some(3)),
        "{c}"
    );
    // A commit went through: ready again at once.
    let (status, body) = anon
        .raw(reqwest::Method::GET, "/readyz", None)
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let retry = request(&mut ws, send_frame(text_to_user("c2", 2, "two")), 5).await;
    assert_eq!(
        (retry["seq"].as_u64(), retry["duplicate"].as_bool()),
        (Some(4), Some(false)),
        "{retry}"
    );
    let again = request(&mut ws, send_frame(text_to_user("c1", 2, &one)), 6).await;
    assert_eq!(
        (again["seq"].as_u64(), again["duplicate"].as_bool()),
        (Some(2), Some(true)),
        "A was stored once: {again}"
    );
    for k in 0..chunk {
        let r = request(
            &mut ws,
            send_frame(text_to_user(&format!("b{k}"), 2, &format!("b{k}"))),
            3000 + k,
        )
        .await;
        assert_eq!(
            (r["seq"].as_i64(), r["duplicate"].as_bool()),
            (Some(5 + k), Some(false)),
            "{r}"
        );
    }
    let history = alice.whole_history(&conv).await.unwrap();
    let seen: Vec<(u64, String)> = history
        .iter()
        .map(|m| {
            (
                m["seq"].as_u64().unwrap(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let mut want: Vec<(u64, String)> = vec![
        (1, "zero".into()),
        (2, one),
        (3, "three".into()),
        (4, "two".into()),
    ];
    want.extend((0..chunk as u64).map(|k| (5 + k, format!("b{k}"))));
    assert_eq!(seen, want);
}

/// While a connection's `ping` waits for its sends to commit, what they are answered with is
/// written as it comes: a burst larger than the outbox (4 096 frames) whose commits stall
/// behind a held write lock (a 1 KiB journal backlog: each commit waits until the tables
/// took the one before) is answered with every `send_ack` and then the `pong`, with no close
/// as too slow (1013), however long the burst's commits lag behind the reads.
#[tokio::test]
async fn a_ping_waiting_behind_stalled_commits_still_writes_the_acks_that_come() {
    let s = spawn_with(|c| c.journal_backlog_kib = 1).await;
    s.user(2).await;
    let mut ws = s.ws(&s.token(1).await, "d1").await;
    let first = request(&mut ws, send_frame(text_to_user("s0", 2, "zero")), 1).await;
    assert_eq!(first["type"], "send_ack", "{first}");

    // Shorter than the server's busy timeout: the stalled commits succeed afterwards.
    let (holder, _) = hold_write_lock(&s, Duration::from_millis(1_500));
    const N: i64 = 6_000;
    let mut burst = sends_to_user("s", 2, N, 10);
    burst.push(json!({"type": "ping", "req": 9}).to_string());
    ws.send_burst(burst).await.unwrap();
    let (acked, pong) = acks_before(&mut ws, 9).await;
    assert_eq!(pong["type"], "pong", "{pong}");
    assert_eq!(acked, N, "every send_ack comes before the pong");
    holder.join().unwrap();
}

/// A connection whose `ping` waits behind stalled commits still ends when the server
/// stops: its close frame (1001) comes while the commits are still held back, not once the
/// barrier's wait is over.
#[tokio::test]
async fn a_connection_waiting_at_its_barrier_is_closed_when_the_server_stops() {
    let mut s = spawn_with(|c| c.journal_backlog_kib = 1).await;
    s.user(2).await;
    let mut ws = s.ws(&s.token(1).await, "d1").await;
    let first = request(&mut ws, send_frame(text_to_user("w0", 2, "zero")), 1).await;
    assert_eq!(first["type"], "send_ack", "{first}");

    let (holder, released) = hold_write_lock(&s, Duration::from_millis(4_000));
    let mut burst = sends_to_user("w", 2, 50, 10);
    burst.push(json!({"type": "ping", "req": 9}).to_string());
    ws.send_burst(burst).await.unwrap();
    // The first of them is journaled; the next commit waits for the tables.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let running = s.running.take().unwrap();
    let stopping = tokio::spawn(running.shutdown());
    let code = ws.closed(Duration::from_secs(3)).await;
    assert_eq!(code, Some(1001), "closed as the server stops");
    assert!(
        !released.load(Ordering::SeqCst),
        "before the stalled commits went on"
    );
    holder.join().unwrap();
    stopping.await.unwrap();
}

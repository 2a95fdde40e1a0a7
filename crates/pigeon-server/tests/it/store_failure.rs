//! The store failing under the pipeline, through the embedded store rigged ([`Faulty`]) so
//! that a test can hold back or refuse its commits:
//!
//! - A failed commit refuses its batch and the batch decided on top of it (the pipeline
//!   decides batch N+1 while batch N commits): all `unavailable`, nothing of either stored,
//!   and seqs go on from what the store holds, with no gap and no seq given twice.
//!   Meanwhile `/readyz` answers 503, and 200 again once a commit goes through.
//! - Commits held back do not hold back the answers of the connection waiting for them,
//!   nor the server's stop.

use crate::*;
use pigeon_core::StoreError;
use pigeon_core::changes::Changes;
use pigeon_core::rigged_store::{Rig, Rigged};
use pigeon_core::store::Store;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Commits that can be held back ([`Faulty::hold`]) or refused ([`Faulty::refuse_commits`]);
/// everything else goes straight to the embedded store.
struct Faulty {
    refusing: AtomicBool,
    gate: Arc<tokio::sync::RwLock<()>>,
}

impl Faulty {
    /// Holds every commit back until the guard is dropped.
    async fn hold(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.gate.clone().write_owned().await
    }

    fn refuse_commits(&self, refuse: bool) {
        self.refusing.store(refuse, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Rig for Faulty {
    async fn commit(&self, inner: &dyn Store, changes: Changes) -> Result<(), StoreError> {
        let _open = self.gate.read().await;
        if self.refusing.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("the disk is full"));
        }
        inner.commit(changes).await
    }
}

/// A server over a [`Faulty`] store, and the store.
async fn faulty_server() -> (TestServer, Arc<Rigged<Faulty>>) {
    let dir = Arc::new(TempDir::new());
    let cfg = test_config(&dir);
    let inner =
        pigeon_store_sqlite::SqliteStore::open(&dir.0, pigeon_store_sqlite::Durability::Fsync)
            .expect("the store opens");
    let store = Arc::new(Rigged {
        inner: Arc::new(inner),
        rig: Faulty {
            refusing: AtomicBool::new(false),
            gate: Arc::new(tokio::sync::RwLock::new(())),
        },
    });
    let running = pigeon_server::start_with_store(cfg.clone(), store.clone())
        .await
        .expect("server starts");
    (serving(running, cfg, dir), store)
}

#[tokio::test]
async fn a_failed_commit_refuses_the_batch_decided_on_top_of_it() {
    let (s, store) = faulty_server().await;
    let alice = s.user(1).await;
    s.user(2).await;
    let mut ws = s.ws(&s.token(1).await, "d1").await;
    let zero = request(&mut ws, send_frame(text_to_user("c0", 2, "zero")), 1).await;
    assert_eq!(zero["type"], "send_ack", "{zero}");
    let conv = zero["conversation_id"].as_str().unwrap().to_owned();

    // B is decided and its commit held back; a chunk of sends is decided on top of it
    // meanwhile; then B's commit fails.
    let held = store.rig.hold().await;
    store.rig.refuse_commits(true);
    let mut b = send_frame(text_to_user("c1", 2, "one"));
    b["req"] = json!(1001);
    ws.send(&b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let chunk = pigeon_server::pipeline::DECIDE_CHUNK as i64;
    for k in 0..chunk {
        let mut b = send_frame(text_to_user(&format!("b{k}"), 2, &format!("b{k}")));
        b["req"] = json!(2000 + k);
        ws.send(&b).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(held);
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

    // The store is the truth again: the next message takes seq 2, and the refused sends are
    // new messages when retried (they were never stored), not duplicates, at the seqs that
    // follow.
    store.rig.refuse_commits(false);
    let c = request(&mut ws, send_frame(text_to_user("c2", 2, "two")), 4).await;
    assert_eq!(
        (c["type"].as_str(), c["seq"].as_u64()),
        (Some("send_ack"), Some(2)),
        "{c}"
    );
    // A commit went through: ready again at once.
    let (status, body) = anon
        .raw(reqwest::Method::GET, "/readyz", None)
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let retry = request(&mut ws, send_frame(text_to_user("c1", 2, "one")), 5).await;
    assert_eq!(
        (retry["seq"].as_u64(), retry["duplicate"].as_bool()),
        (Some(3), Some(false)),
        "{retry}"
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
            (Some(4 + k), Some(false)),
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
    let mut want: Vec<(u64, String)> =
        vec![(1, "zero".into()), (2, "two".into()), (3, "one".into())];
    want.extend((0..chunk as u64).map(|k| (4 + k, format!("b{k}"))));
    assert_eq!(seen, want);
}

/// While a connection's `ping` waits for its sends to commit, what they are answered with is
/// written as it comes: a burst larger than the outbox (4 096 frames) whose commits are held
/// back is answered with every `send_ack` and then the `pong`, with no close as too slow
/// (1013), however long the burst's commits lag behind the reads.
#[tokio::test]
async fn a_ping_waiting_behind_stalled_commits_still_writes_the_acks_that_come() {
    let (s, store) = faulty_server().await;
    s.user(2).await;
    let mut ws = s.ws(&s.token(1).await, "d1").await;
    let first = request(&mut ws, send_frame(text_to_user("s0", 2, "zero")), 1).await;
    assert_eq!(first["type"], "send_ack", "{first}");

    let held = store.rig.hold().await;
    const N: i64 = 6_000;
    let mut burst = sends_to_user("s", 2, N, 10);
    burst.push(json!({"type": "ping", "req": 9}).to_string());
    ws.send_burst(burst).await.unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        drop(held);
    });
    let (acked, pong) = acks_before(&mut ws, 9).await;
    assert_eq!(pong["type"], "pong", "{pong}");
    assert_eq!(acked, N, "every send_ack comes before the pong");
    release.await.unwrap();
}

/// A connection whose `ping` waits behind stalled commits still ends when the server
/// stops: its close frame (1001) comes while the commits are still held back, not once the
/// barrier's wait is over.
#[tokio::test]
async fn a_connection_waiting_at_its_barrier_is_closed_when_the_server_stops() {
    let (mut s, store) = faulty_server().await;
    s.user(2).await;
    let mut ws = s.ws(&s.token(1).await, "d1").await;
    let first = request(&mut ws, send_frame(text_to_user("w0", 2, "zero")), 1).await;
    assert_eq!(first["type"], "send_ack", "{first}");

    let released = Arc::new(AtomicBool::new(false));
    let holder = {
        let (store, released) = (store.clone(), released.clone());
        let (held_tx, held_rx) = tokio::sync::oneshot::channel();
        let holder = tokio::spawn(async move {
            let held = store.rig.hold().await;
            held_tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(4_000)).await;
            released.store(true, Ordering::SeqCst);
            drop(held);
        });
        held_rx.await.unwrap();
        holder
    };
    let mut burst = sends_to_user("w", 2, 50, 10);
    burst.push(json!({"type": "ping", "req": 9}).to_string());
    ws.send_burst(burst).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let running = s.running.take().unwrap();
    let stopping = tokio::spawn(running.shutdown());
    let code = ws.closed(Duration::from_secs(3)).await;
    assert_eq!(code, Some(1001), "closed as the server stops");
    assert!(
        !released.load(Ordering::SeqCst),
        "before the stalled commits went on"
    );
    holder.await.unwrap();
    stopping.await.unwrap();
}

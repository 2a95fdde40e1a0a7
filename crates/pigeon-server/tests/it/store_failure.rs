//! A commit that fails while the next batch has already been decided on top of it (the
//! pipeline decides batch N+1 while batch N commits): both batches are refused with
//! `unavailable`, nothing of either is stored, and seqs go on from what the store holds: no
//! gap and no seq given twice. The failure is real: another process-level writer holds the
//! database's write lock for longer than the server's busy timeout.

use crate::*;

#[tokio::test]
async fn a_failed_commit_refuses_the_batch_decided_on_top_of_it() {
    let s = spawn_server().await;
    let alice = s.user(1).await;
    s.user(2).await;
    let mut ws = s.ws(&s.token(1).await, "d1").await;
    let zero = request(&mut ws, send_frame(text_to_user("c0", 2, "zero")), 1).await;
    assert_eq!(zero["type"], "send_ack", "{zero}");
    let conv = zero["conversation_id"].as_str().unwrap().to_owned();

    let db = s.dir.0.join("pigeon.db");
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let c = rusqlite::Connection::open(db).unwrap();
        c.execute_batch("BEGIN IMMEDIATE").unwrap();
        locked_tx.send(()).unwrap();
        // Longer than the server's busy timeout (5 s): its commit gives up.
        std::thread::sleep(Duration::from_millis(6_500));
        c.execute_batch("ROLLBACK").unwrap();
    });
    locked_rx.recv().unwrap();

    let mut a = send_frame(text_to_user("c1", 2, "one"));
    a["req"] = json!(1000);
    ws.send(&a).await.unwrap();
    // A is decided and waits on the lock in its commit; then a chunk of sends arrives, which
    // the pipeline decides on top of A while A's commit waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let chunk = pigeon_server::pipeline::DECIDE_CHUNK as i64;
    for k in 0..chunk {
        let mut b = send_frame(text_to_user(&format!("b{k}"), 2, &format!("b{k}")));
        b["req"] = json!(2000 + k);
        ws.send(&b).await.unwrap();
    }
    for req in std::iter::once(1000).chain((0..chunk).map(|k| 2000 + k)) {
        let reply = ws
            .recv_until(Duration::from_secs(20), |v| v["req"] == json!(req))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no reply to req {req}"));
        assert_eq!(reply["type"], "error", "{reply}");
        assert_eq!(reply["code"], "unavailable", "{reply}");
    }
    holder.join().unwrap();

    // The store is the truth again: the next message takes seq 2, and the retried sends are
    // new messages (they were never stored), not duplicates, at the seqs that follow.
    let c = request(&mut ws, send_frame(text_to_user("c3", 2, "three")), 4).await;
    assert_eq!(
        (c["type"].as_str(), c["seq"].as_u64()),
        (Some("send_ack"), Some(2)),
        "{c}"
    );
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
        vec![(1, "zero".into()), (2, "three".into()), (3, "one".into())];
    want.extend((0..chunk as u64).map(|k| (4 + k, format!("b{k}"))));
    assert_eq!(seen, want);
}

//! How busy this process is, measured the way a waiting task feels it: how late a timer
//! fires. The pipeline takes sends into large conversations (the bulk tier) only while the
//! runtime keeps time and single chats are sending, so that a flood gets the CPU they leave
//! rather than delaying them (see `pipeline::decide`).
//!
//! A timer is late when the runtime's workers are busy with other tasks or when the
//! machine's cores are busy with other threads; both delay a single chat's frame too, which
//! takes several task wake-ups from the socket to its acknowledgement.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};

/// How often the probe measures while the gate is being asked.
const PROBE_EVERY: Duration = Duration::from_millis(2);
/// A timer firing later than this past its time (tokio's timers have 1 ms granularity)
/// means the runtime or the machine is busy.
const LATE: Duration = Duration::from_millis(2);
/// How long a late timer keeps the gate shut: long enough for the work let in before to
/// run.
const HOLD: Duration = Duration::from_millis(40);
/// The probe stops after this long without anyone asking (about twice this: a permit left
/// by an ask while it ran wakes it once more), and starts again when asked.
const IDLE_AFTER: Duration = Duration::from_secs(1);

/// Open while the runtime keeps time. Reading it is cheap; the probe behind it runs only
/// while it is being asked, so an idle server does not wake for it.
#[derive(Clone)]
pub struct Gate {
    open: watch::Receiver<bool>,
    asked: Arc<Asked>,
}

struct Asked {
    since_last_look: AtomicBool,
    wake: Notify,
}

impl Gate {
    /// Starts the probe task on the current runtime; it ends when every `Gate` is dropped.
    pub fn start() -> Gate {
        let (tx, open) = watch::channel(true);
        let asked = Arc::new(Asked {
            since_last_look: AtomicBool::new(false),
            wake: Notify::new(),
        });
        tokio::spawn(probe(tx, asked.clone()));
        Gate { open, asked }
    }

    /// A gate with no probe, open or shut as `switch` says (tests of what waits for it).
    #[cfg(test)]
    pub(crate) fn manual(open: bool) -> (Gate, watch::Sender<bool>) {
        let (switch, rx) = watch::channel(open);
        let asked = Arc::new(Asked {
            since_last_look: AtomicBool::new(false),
            wake: Notify::new(),
        });
        (Gate { open: rx, asked }, switch)
    }

    /// Whether the runtime has kept time lately. Asking keeps the probe measuring.
    pub fn is_open(&self) -> bool {
        if !self.asked.since_last_look.swap(true, Ordering::AcqRel) {
            self.asked.wake.notify_one();
        }
        *self.open.borrow()
    }

    /// Resolves when the gate is open, or at `deadline`, whichever comes first.
    pub async fn opened(&mut self, deadline: tokio::time::Instant) {
        if tokio::time::Instant::now() >= deadline {
            return;
        }
        let _ = tokio::time::timeout_at(deadline, self.open.wait_for(|open| *open)).await;
    }
}

async fn probe(tx: watch::Sender<bool>, asked: Arc<Asked>) {
    loop {
        // Nobody asks: the gate says open (nothing is measured) and the probe sleeps.
        tokio::select! {
            _ = asked.wake.notified() => {}
            _ = tx.closed() => return,
        }
        let mut last_asked = Instant::now();
        let mut shut_until: Option<Instant> = None;
        loop {
            if asked.since_last_look.swap(false, Ordering::AcqRel) {
                last_asked = Instant::now();
            } else if last_asked.elapsed() > IDLE_AFTER {
                tx.send_replace(true);
                break;
            }
            let set = Instant::now();
            tokio::select! {
                _ = tokio::time::sleep(PROBE_EVERY) => {}
                _ = tx.closed() => return,
            }
            let now = Instant::now();
            if now.duration_since(set) > PROBE_EVERY + LATE {
                shut_until = Some(now + HOLD);
            }
            let open = shut_until.is_none_or(|t| now >= t);
            tx.send_if_modified(|o| std::mem::replace(o, open) != open);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn the_gate_shuts_when_the_runtime_is_held_up_and_opens_again() {
        let mut gate = Gate::start();
        assert!(gate.is_open(), "open until something was measured");
        // Let the probe start and set its timer.
        tokio::time::sleep(Duration::from_millis(1)).await;
        // The runtime's only thread is held up: the probe's timer fires late.
        std::thread::sleep(Duration::from_millis(30));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!gate.is_open(), "a late timer shuts the gate");
        // Generous: on a loaded machine the probe may find the runtime late a while longer.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        gate.opened(deadline).await;
        assert!(
            tokio::time::Instant::now() < deadline && gate.is_open(),
            "the gate opens again once the runtime keeps time"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn waiting_for_a_shut_gate_ends_at_the_deadline() {
        let mut gate = Gate::start();
        assert!(gate.is_open());
        tokio::time::sleep(Duration::from_millis(1)).await;
        std::thread::sleep(Duration::from_millis(30));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!gate.is_open());
        gate.opened(tokio::time::Instant::now()).await;
        // A deadline already passed returns before waiting, so nothing else ran in between
        // (one thread): the wait ended at its deadline, not because the gate opened.
        assert!(
            !*gate.open.borrow(),
            "a deadline already passed does not wait for the gate"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_probe_ends_with_the_last_gate() {
        let gate = Gate::start();
        let asked = Arc::downgrade(&gate.asked);
        assert!(gate.is_open());
        drop(gate);
        for _ in 0..100 {
            if asked.strong_count() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the probe task still holds its state after the last gate was dropped");
    }
}

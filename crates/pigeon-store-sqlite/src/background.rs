//! The tables' threads (the applier, the checkpointer) as background work for the
//! scheduler. They take about a third of the server's CPU in bursts (a step of rows every
//! 10 ms, a commit and a checkpoint every quarter second) while every acknowledged send waits
//! on the threads that answer clients: under Linux's `SCHED_BATCH` they keep their full share
//! of the CPU (so the tables keep up at the maximum rate) but their wake-ups no longer
//! preempt those threads. Measured at half the maximum rate: p99 24.7-57.9 ms against
//! 32.7-139.2 ms in alternated runs; the maximum may be a few % lower (BENCHMARKS.md, tenth
//! session).

/// Runs the calling thread under `SCHED_BATCH` (Linux; elsewhere, and if refused, it stays
/// as it is: only latency is at stake).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn run_as_batch_work() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler only reads `param`, a valid initialised value that outlives
    // the call, and changes the scheduling policy of the calling thread (pid 0 is the
    // calling thread on Linux); it touches no other memory of this process.
    let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if r != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "the scheduler refused SCHED_BATCH for a tables thread"
        );
    }
}

#[cfg(not(target_os = "linux"))]
pub fn run_as_batch_work() {}

/// The scheduling policy of the thread whose `/proc/.../sched` file is `sched` (3 is
/// `SCHED_BATCH`), for tests.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn policy_in(sched: &str) -> Option<u32> {
    let text = std::fs::read_to_string(sched).ok()?;
    let line = text.lines().find(|l| l.starts_with("policy"))?;
    line.split(':').nth(1)?.trim().parse().ok()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_thread_asks_for_batch_scheduling_and_gets_it() {
        let (before, after) = std::thread::spawn(|| {
            let before = policy_in("/proc/thread-self/sched");
            run_as_batch_work();
            (before, policy_in("/proc/thread-self/sched"))
        })
        .join()
        .unwrap();
        assert_eq!(before, Some(libc::SCHED_OTHER as u32));
        assert_eq!(after, Some(libc::SCHED_BATCH as u32));
    }
}

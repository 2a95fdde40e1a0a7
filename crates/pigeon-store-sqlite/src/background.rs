//! The tables' threads (the applier, the checkpointer) as background work for the
//! scheduler. They take about a third of the server's CPU in bursts (a step of rows every
//! 10 ms, a commit and a checkpoint every quarter second) while every acknowledged send waits
//! on the threads that answer clients: under Linux's `SCHED_BATCH` they keep their full share
//! of the CPU (so the tables keep up at the maximum rate) but their wake-ups no longer
//! preempt those threads. Measured at half the maximum rate: p99 24.7-57.9 ms against
//! 32.7-139.2 ms in alternated runs; the maximum may be a few % lower.

/// Runs the calling thread under `SCHED_BATCH` (Linux with glibc; elsewhere, and if refused,
/// it stays as it is: only latency is at stake).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
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

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn run_as_batch_work() {}

/// The scheduling policy of the thread whose `/proc/.../stat` file is `stat` (its 41st
/// field; 3 is `SCHED_BATCH`), for tests.
#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
pub(crate) fn policy_in(stat: &str) -> Option<u32> {
    let text = std::fs::read_to_string(stat).ok()?;
    // Fields 3 and on follow the command name's closing parenthesis.
    let after_name = &text[text.rfind(')')? + 1..];
    after_name.split_whitespace().nth(41 - 3)?.parse().ok()
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn a_thread_asks_for_batch_scheduling_and_gets_it() {
        let policy = std::thread::spawn(|| {
            run_as_batch_work();
            policy_in("/proc/thread-self/stat")
        })
        .join()
        .unwrap();
        assert_eq!(policy, Some(libc::SCHED_BATCH as u32));
    }
}

//! The rate-limit port: each user's allowance of writes (sends, and every other write, over
//! all their devices), a token bucket of `rate` a second with bursts of ten seconds' worth.
//! The embedded adapter keeps the buckets in memory (the server's `limits.rs`, over
//! `governor`); a cluster's shares them between nodes.

use pigeon_proto::UserId;
use std::time::Duration;

pub trait RateLimit: Send + Sync {
    /// Takes `n` writes from `user`'s allowance: done, or refused with how long until it
    /// holds them (`Duration::MAX` for more than a whole burst, which it never holds).
    fn take(&self, user: UserId, n: u32) -> Result<(), Duration>;
    /// Forgets users whose allowance is full again: memory bounded by who wrote lately.
    fn forget_idle(&self) {}
}

/// The rate-limit port's contract, stamped onto an adapter with
/// [`rate_limit_suite!`](crate::rate_limit_suite!). The adapter is made for 10 writes a
/// second (so a burst of 100).
#[cfg(any(test, feature = "port-suites"))]
pub mod suite {
    use super::*;

    fn uid(n: u64) -> UserId {
        UserId::new(n).unwrap()
    }

    /// A burst's worth goes at once, then nothing until the bucket refills, with the wait
    /// said; another user's allowance is their own.
    pub fn a_burst_goes_then_writes_wait(limit: &dyn RateLimit) {
        assert_eq!(limit.take(uid(1), 60), Ok(()));
        assert_eq!(limit.take(uid(1), 40), Ok(()));
        // Five writes take half a second to come back: refused, however slow this machine.
        let wait = limit.take(uid(1), 5).unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(500),
            "five writes refill in half a second: {wait:?}"
        );
        assert_eq!(limit.take(uid(2), 100), Ok(()), "a user's own bucket");
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(limit.take(uid(1), 2), Ok(()), "refilled");
    }

    /// More than a burst at once is never taken.
    pub fn more_than_a_burst_is_refused(limit: &dyn RateLimit) {
        assert_eq!(limit.take(uid(3), 101), Err(Duration::MAX), "never");
        assert_eq!(
            limit.take(uid(3), 100),
            Ok(()),
            "nothing was taken by the refusal"
        );
    }

    /// Forgetting idle users changes no one's allowance.
    pub fn forgetting_idle_users_keeps_allowances(limit: &dyn RateLimit) {
        assert_eq!(limit.take(uid(4), 100), Ok(()));
        limit.forget_idle();
        assert!(limit.take(uid(4), 5).is_err(), "still spent");
    }
}

/// Stamps the rate-limit suite onto an adapter: `pigeon_core::rate_limit_suite!(fresh)`,
/// where `fn fresh() -> impl Deref<Target = impl RateLimit>` makes one of 10 writes a
/// second.
#[cfg(any(test, feature = "port-suites"))]
#[macro_export]
macro_rules! rate_limit_suite {
    ($fresh:path) => {
        #[test]
        fn a_burst_goes_then_writes_wait() {
            $crate::rate_limit::suite::a_burst_goes_then_writes_wait(&*$fresh());
        }

        #[test]
        fn more_than_a_burst_is_refused() {
            $crate::rate_limit::suite::more_than_a_burst_is_refused(&*$fresh());
        }

        #[test]
        fn forgetting_idle_users_keeps_allowances() {
            $crate::rate_limit::suite::forgetting_idle_users_keeps_allowances(&*$fresh());
        }
    };
}

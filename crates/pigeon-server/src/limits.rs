//! Rate limits on what users ask of the server, keyed by user (all their devices together).
//! A refused request answers `rate_limited` with `retry_after_ms`. The allowances are kept
//! behind the rate-limit port (`pigeon_core::rate_limit`); [`GovernorLimit`] is its
//! embedded adapter, the buckets in this process's memory.

use crate::error::ApiError;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use pigeon_core::rate_limit::RateLimit;
use pigeon_proto::{ErrorCode, UserId};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

/// The users' write allowances in memory: a token bucket per user (`governor`).
pub struct GovernorLimit {
    limiter: DefaultKeyedRateLimiter<UserId>,
    clock: DefaultClock,
}

impl GovernorLimit {
    /// `per_sec` writes a second, with bursts of ten seconds' worth: the limit stops a
    /// runaway client, not an application that sends a batch (the protocol itself sets no
    /// rate).
    pub fn new(per_sec: NonZeroU32) -> Self {
        let burst = NonZeroU32::new(per_sec.get().saturating_mul(10)).unwrap_or(per_sec);
        GovernorLimit {
            limiter: RateLimiter::dashmap(Quota::per_second(per_sec).allow_burst(burst)),
            clock: DefaultClock::default(),
        }
    }
}

impl RateLimit for GovernorLimit {
    fn take(&self, user: UserId, n: u32) -> Result<(), Duration> {
        let n = NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        match self.limiter.check_key_n(&user, n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(not_until.wait_time_from(self.clock.now())),
            // More than the burst, which the bucket never holds.
            Err(_) => Err(Duration::MAX),
        }
    }

    fn forget_idle(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }
}

/// The edge's view of the allowances: refusals as the protocol's errors.
pub struct RateLimits {
    /// `None`: the limit is off.
    writes: Option<Arc<dyn RateLimit>>,
}

impl RateLimits {
    /// `sends_per_sec` of 0 turns the limit off.
    pub fn new(sends_per_sec: u32) -> Self {
        RateLimits {
            writes: NonZeroU32::new(sends_per_sec)
                .map(|rate| Arc::new(GovernorLimit::new(rate)) as Arc<dyn RateLimit>),
        }
    }

    /// Takes one write from `user`'s allowance: a send, or any change that appends to a
    /// chain or tells other members (an edit, a recall, a group change, a read, a setting),
    /// so that no write is a way around the send limit.
    pub fn check_send(&self, user: UserId) -> Result<(), ApiError> {
        let Some(limit) = &self.writes else {
            return Ok(());
        };
        limit.take(user, 1).map_err(|wait| {
            metrics::counter!("pigeon_rate_limited_total").increment(1);
            ApiError {
                code: ErrorCode::RateLimited,
                message: "too many messages; slow down".into(),
                retry_after_ms: Some(wait.as_millis().max(1) as u64),
            }
        })
    }

    /// Takes `n` writes from `user`'s allowance if it holds them (saved positions of
    /// conversations, which the client does not wait for: refused, they are dropped, not
    /// answered). Always true with the limit off.
    pub fn take_writes(&self, user: UserId, n: usize) -> bool {
        let Some(limit) = &self.writes else {
            return true;
        };
        limit
            .take(user, u32::try_from(n).unwrap_or(u32::MAX))
            .is_ok()
    }

    /// Forgets users whose allowance is full again (keeps memory bounded).
    pub fn forget_idle(&self) {
        if let Some(l) = &self.writes {
            l.forget_idle();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rate-limit port's suite, on the embedded adapter.
    mod governor_suite {
        use super::*;

        fn fresh() -> Box<GovernorLimit> {
            Box::new(GovernorLimit::new(NonZeroU32::new(10).unwrap()))
        }

        pigeon_core::rate_limit_suite!(fresh);
    }

    /// Saved positions take from the same allowance as sends: a burst's worth at once, then
    /// nothing until it refills; with the limit off, always.
    #[test]
    fn writes_taken_in_bulk_share_the_send_allowance() {
        let user = UserId::new(1).unwrap();
        let limits = RateLimits::new(10);
        assert!(
            limits.take_writes(user, 100),
            "a burst is ten seconds' worth"
        );
        assert!(!limits.take_writes(user, 1));
        assert!(limits.check_send(user).is_err(), "the same allowance");
        let other = UserId::new(2).unwrap();
        assert!(
            !limits.take_writes(other, 101),
            "more than a burst is never taken"
        );
        assert!(limits.take_writes(other, 100), "and takes nothing");
        let off = RateLimits::new(0);
        assert!(off.take_writes(user, 1_000_000));
    }
}

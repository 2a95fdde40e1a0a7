//! Rate limits on what users ask of the server, keyed by user (all their devices together).
//! A refused request answers `rate_limited` with `retry_after_ms`.

use crate::error::ApiError;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use pigeon_proto::{ErrorCode, UserId};
use std::num::NonZeroU32;

pub struct RateLimits {
    sends: Option<DefaultKeyedRateLimiter<UserId>>,
    clock: DefaultClock,
}

impl RateLimits {
    /// `sends_per_sec` of 0 turns the send limit off. Bursts of ten seconds' worth are
    /// allowed: the limit stops a runaway client, not an application that sends a batch (the
    /// protocol itself sets no rate).
    pub fn new(sends_per_sec: u32) -> Self {
        let sends = NonZeroU32::new(sends_per_sec).map(|rate| {
            let burst = NonZeroU32::new(sends_per_sec.saturating_mul(10)).unwrap_or(rate);
            RateLimiter::dashmap(Quota::per_second(rate).allow_burst(burst))
        });
        RateLimits {
            sends,
            clock: DefaultClock::default(),
        }
    }

    /// Takes one write from `user`'s allowance: a send, or any change that appends to a
    /// chain or tells other members (an edit, a recall, a group change, a read, a setting),
    /// so that no write is a way around the send limit.
    pub fn check_send(&self, user: UserId) -> Result<(), ApiError> {
        let Some(limiter) = &self.sends else {
            return Ok(());
        };
        limiter.check_key(&user).map_err(|not_until| {
            metrics::counter!("pigeon_rate_limited_total").increment(1);
            let wait = not_until.wait_time_from(self.clock.now());
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
        let Some(limiter) = &self.sends else {
            return true;
        };
        let n = NonZeroU32::new(u32::try_from(n).unwrap_or(u32::MAX)).unwrap_or(NonZeroU32::MIN);
        matches!(limiter.check_key_n(&user, n), Ok(Ok(())))
    }

    /// Forgets users whose allowance is full again (keeps memory bounded).
    pub fn forget_idle(&self) {
        if let Some(l) = &self.sends {
            l.retain_recent();
            l.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

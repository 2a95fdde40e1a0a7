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

    /// Forgets users whose allowance is full again (keeps memory bounded).
    pub fn forget_idle(&self) {
        if let Some(l) = &self.sends {
            l.retain_recent();
            l.shrink_to_fit();
        }
    }
}

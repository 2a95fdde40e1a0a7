//! Bearer tokens and the admin key. A user token is `v1.<claims>.<mac>`: base64url JSON claims
//! (user, expiry, generation) and their HMAC-SHA256 under a secret kept in the store. Logout
//! bumps the user's generation, which revokes every token minted before it at once.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use hmac::{Hmac, Mac};
use pigeon_proto::UserId;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// The user.
    pub uid: UserId,
    /// Expiry, ms since the epoch.
    pub exp: i64,
    /// The user's token generation when minted.
    pub gen_: u64,
}

/// Signs and checks tokens; holds the secret.
#[derive(Clone)]
pub struct TokenSigner {
    secret: Vec<u8>,
}

impl TokenSigner {
    pub fn new(secret: Vec<u8>) -> Self {
        TokenSigner { secret }
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.secret).expect("HMAC takes keys of any length")
    }

    pub fn mint(&self, claims: Claims) -> String {
        let body = B64.encode(serde_json::to_vec(&claims).expect("claims serialise"));
        let mut mac = self.mac();
        mac.update(body.as_bytes());
        let sig = B64.encode(mac.finalize().into_bytes());
        format!("v1.{body}.{sig}")
    }

    /// The claims of a well-formed token with a valid signature (expiry and generation are
    /// the caller's to check). Bounded: longer strings than any minted token are refused.
    pub fn verify(&self, token: &str) -> Option<Claims> {
        if token.len() > 512 {
            return None;
        }
        let rest = token.strip_prefix("v1.")?;
        let (body, sig) = rest.split_once('.')?;
        let sig = B64.decode(sig).ok()?;
        let mut mac = self.mac();
        mac.update(body.as_bytes());
        mac.verify_slice(&sig).ok()?;
        serde_json::from_slice(&B64.decode(body).ok()?).ok()
    }
}

/// Users' token generations as last read from the store, so that authenticating a request
/// does not read the store each time: a store read first waits until the tables hold every
/// acknowledged batch (the read barrier), which under a write load means the applier's
/// current transaction (~80 ms at 24 000 msgs/s: every HTTP request waited that long).
/// Logout is the only change to a generation, and it calls [`TokenGenerations::forget`]
/// once it is acknowledged: what was remembered before is dropped, and a read that began
/// before is never remembered (the epoch).
#[derive(Default)]
pub struct TokenGenerations {
    known: std::sync::RwLock<std::collections::HashMap<UserId, u64>>,
    epoch: std::sync::atomic::AtomicU64,
}

impl TokenGenerations {
    /// Users remembered at most; past it the memory starts over (a miss is one store read).
    const MAX: usize = 100_000;

    pub fn get(&self, user: UserId) -> Option<u64> {
        self.known
            .read()
            .expect("token generations lock")
            .get(&user)
            .copied()
    }

    /// To pass to [`TokenGenerations::remember`]: taken before the store read.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Remembers what a store read begun at `read_epoch` found, unless a logout began since.
    pub fn remember(&self, user: UserId, generation: u64, read_epoch: u64) {
        let mut known = self.known.write().expect("token generations lock");
        if self.epoch() != read_epoch {
            return;
        }
        if known.len() >= Self::MAX {
            known.clear();
        }
        known.insert(user, generation);
    }

    /// `user`'s generation changed: forget it, and refuse what reads in flight found.
    pub fn forget(&self, user: UserId) {
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.known
            .write()
            .expect("token generations lock")
            .remove(&user);
    }
}

/// Compares secrets in time independent of where they differ.
pub fn secrets_equal(a: &str, b: &str) -> bool {
    let mut mac = HmacSha256::new_from_slice(b"pigeon-admin-key-compare").expect("any key length");
    mac.update(a.as_bytes());
    let da = mac.finalize().into_bytes();
    let mut mac = HmacSha256::new_from_slice(b"pigeon-admin-key-compare").expect("any key length");
    mac.update(b.as_bytes());
    mac.verify_slice(&da).is_ok()
}

/// A fresh random secret of `n` bytes, base64url.
pub fn random_secret(n: usize) -> String {
    let bytes: Vec<u8> = (0..n).map(|_| rand::random::<u8>()).collect();
    B64.encode(bytes)
}

/// The token of an `Authorization: Bearer <token>` header value.
pub fn bearer(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_read_before_a_logout_was_acknowledged_outlives_it() {
        let gens = TokenGenerations::default();
        let u = UserId::new(7).unwrap();
        // Remembered before the logout: dropped by it.
        gens.remember(u, 0, gens.epoch());
        assert_eq!(gens.get(u), Some(0));
        // A read in flight across the acknowledgement answers with the old generation.
        let in_flight = gens.epoch();
        gens.forget(u);
        assert_eq!(gens.get(u), None);
        gens.remember(u, 0, in_flight);
        assert_eq!(gens.get(u), None, "the old generation must not come back");
        // A read begun after the acknowledgement is remembered.
        gens.remember(u, 1, gens.epoch());
        assert_eq!(gens.get(u), Some(1));
    }

    #[test]
    fn tokens_round_trip_and_resist_tampering() {
        let s = TokenSigner::new(b"secret".to_vec());
        let claims = Claims {
            uid: UserId::new(7).unwrap(),
            exp: 1000,
            gen_: 2,
        };
        let t = s.mint(claims);
        assert_eq!(s.verify(&t), Some(claims));
        let other = TokenSigner::new(b"other".to_vec());
        assert_eq!(other.verify(&t), None);
        let mut forged = t.clone();
        forged.insert(5, 'A');
        assert_eq!(s.verify(&forged), None);
        assert_eq!(s.verify("v1.x"), None);
    }

    #[test]
    fn admin_key_comparison() {
        assert!(secrets_equal("abc", "abc"));
        assert!(!secrets_equal("abc", "abd"));
        assert_eq!(bearer("Bearer xyz"), Some("xyz"));
        assert_eq!(bearer("Basic xyz"), None);
    }
}

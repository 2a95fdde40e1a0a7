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

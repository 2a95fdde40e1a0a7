//! Validated identifiers. Each is parsed once at the edge; an invalid one cannot be built.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdError(pub &'static str);

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for IdError {}

/// The largest user id: 2^53-1, the largest integer JavaScript holds exactly.
pub const MAX_USER_ID: u64 = (1 << 53) - 1;

/// A user id, 1 ..= 2^53-1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct UserId(u64);

impl UserId {
    pub fn new(raw: u64) -> Result<Self, IdError> {
        if (1..=MAX_USER_ID).contains(&raw) {
            Ok(UserId(raw))
        } else {
            Err(IdError("user_id must be an integer in 1..=2^53-1"))
        }
    }
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<'de> Deserialize<'de> for UserId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = u64::deserialize(d)?;
        UserId::new(raw).map_err(serde::de::Error::custom)
    }
}

/// A 63-bit snowflake message id; on the wire a string of decimal digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MsgId(u64);

impl MsgId {
    pub fn new(raw: u64) -> Result<Self, IdError> {
        if raw > 0 && raw < (1 << 63) {
            Ok(MsgId(raw))
        } else {
            Err(IdError("msg_id must be a positive 63-bit integer"))
        }
    }
    pub fn get(self) -> u64 {
        self.0
    }
    /// Parses the wire form (decimal digits only).
    pub fn parse(s: &str) -> Result<Self, IdError> {
        if s.is_empty() || s.len() > 19 || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(IdError("msg_id must be a string of decimal digits"));
        }
        let raw: u64 = s.parse().map_err(|_| IdError("msg_id out of range"))?;
        MsgId::new(raw)
    }
}

impl fmt::Display for MsgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for MsgId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for MsgId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        MsgId::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A conversation id: `"{lo}-{hi}"` for a single chat, `"g{snowflake}"` for a group.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct ConversationId(String);

/// The two kinds of conversation and what identifies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConversationRef {
    Single(UserId, UserId),
    Group(u64),
}

impl ConversationId {
    /// The single chat of two distinct users; the same id whichever side names it.
    pub fn single(a: UserId, b: UserId) -> Result<Self, IdError> {
        if a == b {
            return Err(IdError("a single chat needs two different users"));
        }
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        Ok(ConversationId(format!("{lo}-{hi}")))
    }

    /// The group whose snowflake is `id`.
    pub fn group(id: u64) -> Self {
        ConversationId(format!("g{id}"))
    }

    pub fn parse(s: &str) -> Result<Self, IdError> {
        let bad = IdError("conversation_id must be \"{lo}-{hi}\" or \"g{digits}\"");
        if s.len() > 64 {
            return Err(bad);
        }
        if let Some(digits) = s.strip_prefix('g') {
            let id = parse_canonical_u64(digits).ok_or(bad.clone())?;
            if id == 0 || id >= 1 << 63 {
                return Err(bad);
            }
            return Ok(ConversationId(s.to_owned()));
        }
        let (lo, hi) = s.split_once('-').ok_or(bad.clone())?;
        let lo = parse_canonical_u64(lo).and_then(|v| UserId::new(v).ok());
        let hi = parse_canonical_u64(hi).and_then(|v| UserId::new(v).ok());
        match (lo, hi) {
            (Some(lo), Some(hi)) if lo < hi => Ok(ConversationId(s.to_owned())),
            _ => Err(bad),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What kind of conversation this is; total because the id was validated.
    pub fn kind(&self) -> ConversationRef {
        if let Some(d) = self.0.strip_prefix('g') {
            ConversationRef::Group(d.parse().unwrap_or_default())
        } else {
            let (lo, hi) = self.0.split_once('-').unwrap_or(("1", "1"));
            let uid = |s: &str| UserId(s.parse().unwrap_or(1));
            ConversationRef::Single(uid(lo), uid(hi))
        }
    }

    pub fn is_group(&self) -> bool {
        self.0.starts_with('g')
    }

    /// For a single chat, the member that is not `me`.
    pub fn peer_of(&self, me: UserId) -> Option<UserId> {
        match self.kind() {
            ConversationRef::Single(a, b) if a == me => Some(b),
            ConversationRef::Single(a, b) if b == me => Some(a),
            _ => None,
        }
    }
}

/// Digits only, no sign, no leading zero (so each number has one spelling).
fn parse_canonical_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

impl fmt::Display for ConversationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ConversationId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        ConversationId::parse(&s).map_err(serde::de::Error::custom)
    }
}

fn valid_token_chars(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

macro_rules! short_token_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn parse(s: &str) -> Result<Self, IdError> {
                if valid_token_chars(s) {
                    Ok($name(s.to_owned()))
                } else {
                    Err(IdError(concat!($what, " must be 1-64 characters of [A-Za-z0-9_-]")))
                }
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
                $name::parse(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

short_token_id!(
    /// Chosen by the sending client; (sender, client_msg_id) identifies a send.
    ClientMsgId,
    "client_msg_id"
);
short_token_id!(
    /// Chosen by the client, stable per install.
    DeviceId,
    "device_id"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_chat_id_is_ordered_numerically() {
        let a = UserId::new(222).unwrap();
        let b = UserId::new(1111).unwrap();
        assert_eq!(ConversationId::single(b, a).unwrap().as_str(), "222-1111");
        assert_eq!(ConversationId::single(a, b).unwrap().as_str(), "222-1111");
        assert!(ConversationId::single(a, a).is_err());
    }

    #[test]
    fn conversation_ids_have_one_spelling() {
        assert!(ConversationId::parse("111-222").is_ok());
        assert!(ConversationId::parse("222-111").is_err());
        assert!(ConversationId::parse("0111-222").is_err());
        assert!(ConversationId::parse("111-111").is_err());
        assert!(ConversationId::parse("g123").is_ok());
        assert!(ConversationId::parse("g").is_err());
        assert!(ConversationId::parse("g01").is_err());
        assert!(ConversationId::parse("x1").is_err());
        assert!(ConversationId::parse("0-5").is_err());
    }

    #[test]
    fn user_ids_are_bounded() {
        assert!(UserId::new(0).is_err());
        assert!(UserId::new(MAX_USER_ID).is_ok());
        assert!(UserId::new(MAX_USER_ID + 1).is_err());
    }

    #[test]
    fn msg_id_is_a_string_on_the_wire() {
        let id = MsgId::new(7301234567890123456).unwrap();
        assert_eq!(
            serde_json::to_string(&id).unwrap(),
            "\"7301234567890123456\""
        );
        let back: MsgId = serde_json::from_str("\"7301234567890123456\"").unwrap();
        assert_eq!(back, id);
        assert!(serde_json::from_str::<MsgId>("7301").is_err());
        assert!(MsgId::parse("-1").is_err());
    }

    #[test]
    fn token_ids_accept_only_their_alphabet() {
        assert!(ClientMsgId::parse("m-0001_A").is_ok());
        assert!(ClientMsgId::parse("").is_err());
        assert!(ClientMsgId::parse("a b").is_err());
        assert!(DeviceId::parse(&"x".repeat(64)).is_ok());
        assert!(DeviceId::parse(&"x".repeat(65)).is_err());
    }
}

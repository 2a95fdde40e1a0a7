//! The idempotency keys partitions are deciding. A sender's `client_msg_id` names one send
//! across all their conversations (PROTOCOL.md 1), and a retry may name another
//! conversation, owned by another partition. The store answers a key once its batch is
//! durable; until then the partition deciding it holds a claim, so no other partition takes
//! the same key for a new message meanwhile: the second is answered `unavailable`, and its
//! retry, once the first is durable, finds the first's `send_ack`.

use pigeon_proto::{ClientMsgId, UserId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(super) type Key = (UserId, ClientMsgId);

#[derive(Default)]
pub(super) struct KeyClaims {
    /// Each claimed key: the partition holding it, and how many of its commands do.
    held: Mutex<HashMap<Key, (usize, u32)>>,
}

impl KeyClaims {
    /// Claims `key` for `partition`, which may claim a key it holds again (a retry within
    /// it is its own duplicate). False when another partition holds it.
    pub(super) fn claim(&self, key: &Key, partition: usize) -> bool {
        let mut held = self.held.lock().expect("claims lock");
        match held.get_mut(key) {
            Some((holder, n)) if *holder == partition => {
                *n += 1;
                true
            }
            Some(_) => false,
            None => {
                held.insert(key.clone(), (partition, 1));
                true
            }
        }
    }

    /// Lets go of a partition's claims of `keys`, once the store answers for their batch
    /// (it is durable) or the batch is refused.
    pub(super) fn release(&self, keys: impl IntoIterator<Item = Key>) {
        let mut held = self.held.lock().expect("claims lock");
        for key in keys {
            if let Some((_, n)) = held.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    held.remove(&key);
                }
            }
        }
    }
}

/// Keys one batch claimed, let go when it is dropped: once its batch is durable or refused,
/// and also when its partition stops on a panic, so a retry of one of them into another
/// partition is not refused until a restart.
#[derive(Default)]
pub(super) struct Claimed {
    claims: Option<Arc<KeyClaims>>,
    keys: Vec<Key>,
}

impl Claimed {
    pub(super) fn new(claims: Arc<KeyClaims>) -> Self {
        Claimed {
            claims: Some(claims),
            keys: Vec::new(),
        }
    }

    /// Claims `key` for `partition` (see [`KeyClaims::claim`]); false when another holds it.
    pub(super) fn claim(&mut self, key: Key, partition: usize) -> bool {
        let claims = self
            .claims
            .as_ref()
            .expect("claims made with their registry");
        if !claims.claim(&key, partition) {
            return false;
        }
        self.keys.push(key);
        true
    }

    /// Takes `other`'s claims into these.
    pub(super) fn absorb(&mut self, mut other: Claimed) {
        if self.claims.is_none() {
            self.claims = other.claims.clone();
        }
        self.keys.append(&mut other.keys);
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if let Some(claims) = &self.claims
            && !self.keys.is_empty()
        {
            claims.release(self.keys.drain(..));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_held_by_one_partition_until_each_of_its_claims_is_released() {
        let claims = KeyClaims::default();
        let key = (UserId::new(1).unwrap(), ClientMsgId::parse("m").unwrap());
        assert!(claims.claim(&key, 0));
        assert!(claims.claim(&key, 0), "again by the same partition");
        assert!(!claims.claim(&key, 1));
        claims.release([key.clone()]);
        assert!(!claims.claim(&key, 1), "one claim of partition 0 is left");
        claims.release([key.clone()]);
        assert!(claims.claim(&key, 1));
        claims.release([key.clone()]);

        // A batch's claims go with it, however it ends.
        let claims = Arc::new(claims);
        let mut batch = Claimed::new(claims.clone());
        assert!(batch.claim(key.clone(), 2));
        assert!(!claims.claim(&key, 3));
        let mut open = Claimed::default();
        open.absorb(batch);
        drop(open);
        assert!(claims.claim(&key, 3));
    }
}

//! What the conversation partitions of one node share: the id generator (message and group
//! ids are unique per node, whichever partition makes them), the idempotency keys the store
//! may hold (a sender's `client_msg_id` is unique across all their conversations, so a key
//! decided in one partition must be looked up by every other), and the users whose
//! registration is durable (a user registered through one partition may be invited through
//! another at once, before the tables hold the registration). Each piece sits behind its own
//! short lock: a partition takes it for one call, never across an await.

use crate::known_keys::KnownKeys;
use crate::snowflake::Snowflake;
use pigeon_proto::{ClientMsgId, UserId};
use std::collections::HashSet;
use std::sync::{Mutex, RwLock};

pub struct NodeShared {
    ids: Mutex<Snowflake>,
    known_keys: Mutex<KnownKeys>,
    registered: RwLock<HashSet<UserId>>,
}

impl NodeShared {
    /// `max_msg_id`: the largest id the store holds (the id generator's floor).
    pub fn new(node_id: u16, max_msg_id: u64) -> Self {
        NodeShared {
            ids: Mutex::new(Snowflake::new(node_id, max_msg_id)),
            known_keys: Mutex::new(KnownKeys::with_capacity(crate::known_keys::MIN_CAPACITY)),
            registered: RwLock::new(HashSet::new()),
        }
    }

    /// The next id of this node (a message's, or a group's).
    pub fn next_id(&self, now_ms: i64) -> u64 {
        self.ids.lock().expect("ids lock").next(now_ms)
    }

    /// The time of the newest id handed out, or of the store's newest message at start.
    pub fn newest_id_ms(&self) -> i64 {
        self.ids.lock().expect("ids lock").last_ms()
    }

    /// Sizes the set of known idempotency keys for about `expected` keys. Call before
    /// [`NodeShared::remember_key`] at start.
    pub fn expect_keys(&self, expected: usize) {
        *self.known_keys.lock().expect("keys lock") = KnownKeys::with_capacity(expected);
    }

    /// An idempotency key the store may hold: every stored key at start, and every key a
    /// partition decides (whether or not its batch then commits: a key of a failed batch is
    /// only a false positive).
    pub fn remember_key(&self, sender: UserId, client_msg_id: &ClientMsgId) {
        self.known_keys
            .lock()
            .expect("keys lock")
            .insert(sender, client_msg_id);
    }

    /// False only for a key the store cannot hold: no look-up needed.
    pub fn may_hold_key(&self, sender: UserId, client_msg_id: &ClientMsgId) -> bool {
        self.known_keys
            .lock()
            .expect("keys lock")
            .may_contain(sender, client_msg_id)
    }

    pub fn known_key_count(&self) -> u64 {
        self.known_keys.lock().expect("keys lock").len()
    }

    /// Whether `user`'s registration is durable (as far as this node has seen).
    pub fn is_registered(&self, user: UserId) -> bool {
        self.registered
            .read()
            .expect("registered lock")
            .contains(&user)
    }

    /// Users whose registration just became durable: every partition knows them from now on.
    pub fn registered(&self, users: impl IntoIterator<Item = UserId>) {
        let mut users = users.into_iter().peekable();
        if users.peek().is_some() {
            self.registered
                .write()
                .expect("registered lock")
                .extend(users);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uid(n: u64) -> UserId {
        UserId::new(n).unwrap()
    }

    #[test]
    fn ids_stay_unique_and_keys_known_across_the_partitions_that_share_them() {
        let shared = std::sync::Arc::new(NodeShared::new(3, 0));
        let ids: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..1000)
                            .map(|_| shared.next_id(1_800_000_000_000))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        let distinct: HashSet<u64> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), 4000);

        let key = ClientMsgId::parse("m-1").unwrap();
        assert!(!shared.may_hold_key(uid(1), &key));
        shared.remember_key(uid(1), &key);
        assert!(shared.may_hold_key(uid(1), &key));

        assert!(!shared.is_registered(uid(9)));
        shared.registered([uid(9)]);
        assert!(shared.is_registered(uid(9)));
    }
}

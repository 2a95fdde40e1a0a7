//! Memory of one batch that must outlive the batch's decision until its commit: while batch N
//! commits, batch N+1 is already being decided, and the store does not show N's rows yet, so
//! what N decided (a send's ack, a recalled message, a checked idempotency key) has to be
//! remembered in memory until N is durable. After that the store is the truth again.

use std::collections::HashMap;
use std::hash::Hash;

/// A map whose entries are tagged with the batch that last wrote them and dropped once that
/// batch has been committed ([`UntilCommitted::retire`]).
#[derive(Debug)]
pub struct UntilCommitted<K, V> {
    entries: HashMap<K, (u64, V)>,
}

impl<K, V> Default for UntilCommitted<K, V> {
    fn default() -> Self {
        UntilCommitted {
            entries: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq, V> UntilCommitted<K, V> {
    pub fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(_, v)| v)
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Writes `value` for `key` in `batch`, which keeps it until `batch` is committed.
    pub fn insert(&mut self, batch: u64, key: K, value: V) {
        self.entries.insert(key, (batch, value));
    }

    /// Drops what batches up to `committed` wrote: the store shows it now.
    pub fn retire(&mut self, committed: u64) {
        self.entries.retain(|_, (batch, _)| *batch > committed);
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_live_until_their_batch_is_committed() {
        let mut m = UntilCommitted::default();
        m.insert(1, "a", 1);
        m.insert(2, "b", 2);
        m.retire(1);
        assert!(!m.contains_key(&"a"));
        assert_eq!(m.get(&"b"), Some(&2));
        // Rewritten in a later batch: kept for that batch.
        m.insert(3, "b", 3);
        m.retire(2);
        assert_eq!(m.get(&"b"), Some(&3));
        m.retire(3);
        assert!(m.is_empty());
    }
}

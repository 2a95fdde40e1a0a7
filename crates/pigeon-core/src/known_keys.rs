//! The idempotency keys `(sender, client_msg_id)` the store may hold, kept in memory so that a
//! send whose key was never seen skips the store look-up (one index probe per send was ~14 %
//! of the server's time). A scalable Bloom filter: every key inserted answers "maybe" (no
//! false negatives, so no duplicate is ever missed), a key never inserted answers "no" except
//! for a few false positives (0.1 % per filter of the chain), which are looked up in the store.
//!
//! Every stored key must be in it: the server fills it from the store at start, and the
//! engine inserts each key it decides, whether or not its batch then commits (a key of a
//! failed batch is only a false positive).

use fastbloom::BloomFilter;
use pigeon_proto::{ClientMsgId, UserId};

/// False-positive rate of each filter of the chain. Capacities double, so a chain that has
/// grown to a billion keys has ten filters and a rate near 1 %.
const FALSE_POSITIVES: f64 = 0.001;
/// Keys the first filter is sized for (~1.8 MB): a send batch asks a few hundred keys, and
/// one false positive costs the whole batch a look-up, so a small first filter that grows
/// by doubling would soon answer "maybe" to most batches.
pub const MIN_CAPACITY: usize = 1 << 20;

pub struct KnownKeys {
    /// Filters of doubling capacity; keys go into the last, look-ups ask them all.
    filters: Vec<BloomFilter>,
    /// Keys the last filter was sized for, and how many it holds.
    capacity: usize,
    in_last: usize,
    total: u64,
}

impl KnownKeys {
    /// Sized for `expected` keys; grows past that by adding filters twice as large.
    pub fn with_capacity(expected: usize) -> Self {
        let capacity = expected.max(MIN_CAPACITY);
        KnownKeys {
            filters: vec![Self::filter(capacity)],
            capacity,
            in_last: 0,
            total: 0,
        }
    }

    fn filter(capacity: usize) -> BloomFilter {
        BloomFilter::with_false_pos(FALSE_POSITIVES).expected_items(capacity)
    }

    pub fn insert(&mut self, sender: UserId, cmid: &ClientMsgId) {
        if self.in_last >= self.capacity {
            self.capacity *= 2;
            self.filters.push(Self::filter(self.capacity));
            self.in_last = 0;
        }
        let key = (sender.get(), cmid.as_str());
        self.filters
            .last_mut()
            .expect("there is always a filter")
            .insert(&key);
        self.in_last += 1;
        self.total += 1;
    }

    /// False only when the key was never inserted.
    pub fn may_contain(&self, sender: UserId, cmid: &ClientMsgId) -> bool {
        let key = (sender.get(), cmid.as_str());
        self.filters.iter().any(|f| f.contains(&key))
    }

    /// Keys inserted (with repeats).
    pub fn len(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> (UserId, ClientMsgId) {
        (
            UserId::new(n % 97 + 1).unwrap(),
            ClientMsgId::parse(&format!("m-{n}")).unwrap(),
        )
    }

    #[test]
    fn every_inserted_key_is_found_as_it_grows_and_few_others_are() {
        let mut k = KnownKeys::with_capacity(1000);
        // Grow past the first filter.
        for n in 20_000..(20_000 + MIN_CAPACITY as u64) {
            let (u, c) = key(n);
            k.insert(u, &c);
        }
        for n in 0..10_000 {
            let (u, c) = key(n);
            k.insert(u, &c);
        }
        assert!(k.filters.len() > 1, "it grew past its first filter");
        for n in 0..10_000 {
            let (u, c) = key(n);
            assert!(k.may_contain(u, &c), "inserted key {n} must be found");
        }
        let false_positives = (10_000..20_000)
            .filter(|n| {
                let (u, c) = key(*n);
                k.may_contain(u, &c)
            })
            .count();
        assert!(
            false_positives < 100,
            "{false_positives} of 10 000 unseen keys"
        );
    }
}

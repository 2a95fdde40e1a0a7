//! 63-bit time-ordered ids: 41 bits of milliseconds since 2024-01-01, 10 bits of node, 12 bits
//! of sequence within the millisecond.

/// Milliseconds of 2024-01-01T00:00:00Z since the Unix epoch.
pub const EPOCH_MS: i64 = 1_704_067_200_000;
const NODE_BITS: u32 = 10;
const SEQ_BITS: u32 = 12;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// The largest node number an id can carry.
pub const MAX_NODE: u16 = (1 << NODE_BITS) - 1;

/// Hands out strictly increasing ids. Owned by one thread (the writer), so it needs no lock.
#[derive(Debug)]
pub struct Snowflake {
    node: u64,
    last: u64,
}

impl Snowflake {
    /// `floor` is the largest id already handed out (read from the store at start), so that a
    /// clock that went back across a restart can never repeat an id.
    pub fn new(node: u16, floor: u64) -> Self {
        Snowflake {
            node: u64::from(node) & ((1 << NODE_BITS) - 1),
            last: floor,
        }
    }

    /// The wall-clock millisecond of the largest id handed out or read at start (0 if none):
    /// what was decided before is no later than this.
    pub fn last_ms(&self) -> i64 {
        if self.last == 0 {
            return 0;
        }
        (self.last >> (NODE_BITS + SEQ_BITS)) as i64 + EPOCH_MS
    }

    pub fn next(&mut self, now_ms: i64) -> u64 {
        let ms = (now_ms - EPOCH_MS).max(0) as u64;
        let candidate = (ms << (NODE_BITS + SEQ_BITS)) | (self.node << SEQ_BITS);
        // Same millisecond (or a clock that went back): keep counting past the last id. Past
        // the sequence's last value the count moves on to the next millisecond, never into
        // the node bits, where it would make another node's ids.
        let id = if candidate > self.last {
            candidate
        } else if self.last & SEQ_MASK == SEQ_MASK {
            ((self.last >> (NODE_BITS + SEQ_BITS)) + 1) << (NODE_BITS + SEQ_BITS)
                | (self.node << SEQ_BITS)
        } else {
            self.last + 1
        };
        self.last = id;
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_grow_even_when_the_clock_stands_still_or_goes_back() {
        let mut s = Snowflake::new(1, 0);
        let a = s.next(EPOCH_MS + 1000);
        let b = s.next(EPOCH_MS + 1000);
        let c = s.next(EPOCH_MS + 10);
        assert!(a < b && b < c);
        let mut restarted = Snowflake::new(1, c);
        assert!(restarted.next(EPOCH_MS) > c);
    }

    #[test]
    fn more_ids_in_a_millisecond_than_its_sequence_holds_keep_the_node() {
        let mut s = Snowflake::new(5, 0);
        let now = EPOCH_MS + 1000;
        let ids: Vec<u64> = (0..10_000).map(|_| s.next(now)).collect();
        assert!(ids.windows(2).all(|w| w[1] > w[0]));
        assert!(
            ids.iter()
                .all(|id| (id >> SEQ_BITS) & ((1 << NODE_BITS) - 1) == 5),
            "an id carried into the node bits"
        );
    }

    #[test]
    fn the_last_ids_millisecond_is_the_clocks() {
        assert_eq!(Snowflake::new(3, 0).last_ms(), 0);
        let mut s = Snowflake::new(3, 0);
        s.next(EPOCH_MS + 5_000);
        assert_eq!(s.last_ms(), EPOCH_MS + 5_000);
        assert_eq!(
            Snowflake::new(3, s.next(EPOCH_MS)).last_ms(),
            EPOCH_MS + 5_000
        );
    }

    #[test]
    fn ids_fit_in_63_bits_for_decades() {
        let mut s = Snowflake::new(1023, 0);
        let in_60_years = EPOCH_MS + 60 * 365 * 86_400_000;
        assert!(s.next(in_60_years) < 1 << 63);
    }
}

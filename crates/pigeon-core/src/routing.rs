//! Where a conversation's commands are decided: its tier (single chats, and groups by size)
//! and, within the tier, one of its partitions by a hash of the conversation's id. Each
//! partition is one worker with its own queue and batch, so a flood in a large group is
//! decided, batched and delivered apart from single chats and small groups.

use pigeon_proto::ids::ConversationRef;
use pigeon_proto::{ConversationId, UserId};

/// Groups with fewer members than this are small.
pub const SMALL_GROUP_BELOW: u64 = 100;
/// Groups with fewer members than this (and at least [`SMALL_GROUP_BELOW`]) are medium; the
/// rest are large.
pub const MEDIUM_GROUP_BELOW: u64 = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Single,
    Small,
    Medium,
    Large,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Single, Tier::Small, Tier::Medium, Tier::Large];

    /// The tier of a group of `members`.
    pub fn of_group(members: u64) -> Tier {
        if members < SMALL_GROUP_BELOW {
            Tier::Small
        } else if members < MEDIUM_GROUP_BELOW {
            Tier::Medium
        } else {
            Tier::Large
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Single => "single",
            Tier::Small => "small",
            Tier::Medium => "medium",
            Tier::Large => "large",
        }
    }
}

/// Which of a tier's `partitions` owns `id`: a hash of what the id names (its two users, or
/// its group number), the same on every node and across restarts.
pub fn partition_of(id: &ConversationId, partitions: usize) -> usize {
    match id.kind() {
        ConversationRef::Single(a, b) => partition_of_chat(a, b, partitions),
        ConversationRef::Group(g) => {
            let mut key = [b'g'; 9];
            key[1..].copy_from_slice(&g.to_le_bytes());
            slot(&key, partitions)
        }
    }
}

/// [`partition_of`] the single chat of `a` and `b`, without making its id.
pub fn partition_of_chat(a: UserId, b: UserId, partitions: usize) -> usize {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    let mut key = [b's'; 17];
    key[1..9].copy_from_slice(&lo.get().to_le_bytes());
    key[9..].copy_from_slice(&hi.get().to_le_bytes());
    slot(&key, partitions)
}

/// Which of `partitions` decides `user`'s commands that name no conversation (a
/// registration, a logout, an inbox position).
pub fn partition_of_user(user: UserId, partitions: usize) -> usize {
    slot(&user.get().to_le_bytes(), partitions)
}

fn slot(bytes: &[u8], partitions: usize) -> usize {
    (crc32fast::hash(bytes) as usize) % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_tiered_by_size_and_spread_over_partitions_stably() {
        assert_eq!(Tier::of_group(2), Tier::Small);
        assert_eq!(Tier::of_group(99), Tier::Small);
        assert_eq!(Tier::of_group(100), Tier::Medium);
        assert_eq!(Tier::of_group(999), Tier::Medium);
        assert_eq!(Tier::of_group(1000), Tier::Large);
        let ids: Vec<ConversationId> = (1..=64).map(ConversationId::group).collect();
        let slots: Vec<usize> = ids.iter().map(|c| partition_of(c, 4)).collect();
        assert!(slots.iter().all(|s| *s < 4));
        for p in 0..4 {
            assert!(slots.contains(&p), "every partition gets some of 64 ids");
        }
        // A hash of the id's spelling: the same answer every time.
        assert_eq!(partition_of(&ids[0], 4), partition_of(&ids[0].clone(), 4));
        assert_eq!(partition_of(&ids[5], 1), 0);
        let (a, b) = (UserId::new(3).unwrap(), UserId::new(9).unwrap());
        let chat = ConversationId::single(a, b).unwrap();
        assert_eq!(partition_of(&chat, 4), partition_of_chat(b, a, 4));
    }
}

//! The state the engine keeps in memory per conversation and per user. The store is the
//! truth; this is a cache of it that only the engine's owner mutates.

use pigeon_proto::views::{Fanout, Role};
use pigeon_proto::{ConversationId, MsgId, UserId};
use std::collections::HashMap;

/// A current member of a conversation.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemberState {
    pub role: Role,
    /// The seq of the message that made them a member (they see it and everything after).
    pub joined_seq: u64,
    pub joined_at: i64,
    #[serde(default)]
    pub mute_until: Option<i64>,
    pub last_read_seq: u64,
    pub pinned: bool,
    pub muted: bool,
    /// Hidden while the conversation's newest seq is at most this.
    #[serde(default)]
    pub hidden_seq: Option<u64>,
}

impl MemberState {
    /// A member who joined at `joined_seq` with `role`, having read up to `last_read_seq`,
    /// with no settings of their own yet.
    pub fn joined(role: Role, joined_seq: u64, last_read_seq: u64, now: i64) -> Self {
        MemberState {
            role,
            joined_seq,
            joined_at: now,
            mute_until: None,
            last_read_seq,
            pinned: false,
            muted: false,
            hidden_seq: None,
        }
    }

    pub fn hidden(&self, conversation_seq: u64) -> bool {
        self.hidden_seq.is_some_and(|h| conversation_seq <= h)
    }
}

/// A conversation as the engine needs it to decide.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationState {
    pub id: ConversationId,
    pub is_group: bool,
    /// The newest seq; the next message gets `seq + 1`.
    pub seq: u64,
    pub name: Option<String>,
    pub notice: Option<String>,
    pub avatar: Option<String>,
    pub owner: Option<UserId>,
    pub dismissed: bool,
    pub last_msg_id: Option<MsgId>,
    /// The first seq delivered by read fan-out (none while the group never crossed the
    /// threshold); a device's position in the chain starts no lower than this.
    pub read_fanout_since: Option<u64>,
    pub created_at: i64,
    pub updated_at: i64,
    /// Current members only; former members live in the store with their `left_seq`.
    pub members: HashMap<UserId, MemberState>,
}

impl ConversationState {
    pub fn member_count(&self) -> u64 {
        self.members.len() as u64
    }

    pub fn fanout(&self, write_max_members: u64) -> Fanout {
        if !self.is_group || self.member_count() <= write_max_members {
            Fanout::Write
        } else {
            Fanout::Read
        }
    }
}

//! What one batch of commands writes (committed in one transaction) and what it announces
//! once that transaction is durable.

use crate::state::{ConversationState, MemberState};
use pigeon_proto::views::Fanout;
use pigeon_proto::{ConversationId, DeviceId, Message, MessageStatus, MsgId, UserId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;

/// An entry of a user's inbox chain: where a message sits in it. (The message's
/// conversation and seq are the message's own; journal records written before schema
/// version 2 also carry them here, and reading ignores them.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InboxRow {
    pub user: UserId,
    pub user_seq: u64,
    pub msg_id: MsgId,
}

/// A conversation's own row: its state without the member list. (The `default`s read
/// journal records of earlier versions, which left an absent option out.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConversationRow {
    pub id: ConversationId,
    pub is_group: bool,
    pub seq: u64,
    pub member_count: u64,
    pub fanout: Fanout,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub notice: Option<String>,
    #[serde(default)]
    pub avatar: Option<String>,
    #[serde(default)]
    pub owner: Option<UserId>,
    pub dismissed: bool,
    #[serde(default)]
    pub last_msg_id: Option<MsgId>,
    #[serde(default)]
    pub read_fanout_since: Option<u64>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl ConversationRow {
    pub fn of(s: &ConversationState, write_max_members: u64) -> Self {
        ConversationRow {
            id: s.id.clone(),
            is_group: s.is_group,
            seq: s.seq,
            member_count: s.member_count(),
            fanout: s.fanout(write_max_members),
            name: s.name.clone(),
            notice: s.notice.clone(),
            avatar: s.avatar.clone(),
            owner: s.owner,
            dismissed: s.dismissed,
            last_msg_id: s.last_msg_id,
            read_fanout_since: s.read_fanout_since,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}

/// A membership as written: current (`left_seq` none) or ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberRow {
    pub conversation: ConversationId,
    pub user: UserId,
    pub state: MemberState,
    #[serde(default)]
    pub left_seq: Option<u64>,
}

/// A change to a stored message (recall, edit, delete for everyone).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageUpdate {
    pub msg_id: MsgId,
    pub status: MessageStatus,
    pub version: u32,
    /// The current content; for a recall the stored original is kept (audit) and only the
    /// status changes, so this is `None`.
    pub content: Option<String>,
    pub edited_at: Option<i64>,
    pub recalled: Option<(i64, UserId)>,
}

/// Everything one batch writes. Committed as one unit or not at all (in the embedded store,
/// one journal record; the tables get it later, with other batches).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Changes {
    /// Registrations: name and avatar, each `None` when kept as it is (journal records
    /// written before that was possible hold both).
    pub users: Vec<(UserId, Option<String>, Option<String>, i64)>,
    pub logouts: Vec<UserId>,
    /// Final state of every conversation the batch touched (the row is upserted).
    pub conversations: Vec<ConversationRow>,
    pub messages: Vec<Message>,
    pub inbox: Vec<InboxRow>,
    /// Keyed so that several changes to one membership in a batch write one row.
    #[serde(with = "members_as_list")]
    pub members: HashMap<(ConversationId, UserId), MemberRow>,
    pub message_updates: Vec<MessageUpdate>,
    pub versions: Vec<(MsgId, u32, String, i64)>,
    pub hidden_messages: Vec<(UserId, MsgId)>,
    pub cursors: Vec<(UserId, DeviceId, String, u64)>,
    /// Acknowledgements of a conversation the engine did not have at hand (after a restart,
    /// or once evicted), as given: the store saves one only for a member or former member,
    /// clamped to the conversation's newest stored seq (and to the removal of a former
    /// member), so an ack naming any id makes no row and skips nothing. (Absent from
    /// journal records written before it existed, and left out of JSON ones that hold none.)
    #[serde(default)]
    pub member_cursors: Vec<(UserId, DeviceId, ConversationId, u64)>,
}

impl Changes {
    /// Moves `other`'s rows in after these: one unit for several partitions' batches (their
    /// conversations, and so their membership rows, never overlap).
    pub fn append(&mut self, other: Changes) {
        let Changes {
            users,
            logouts,
            conversations,
            messages,
            inbox,
            members,
            message_updates,
            versions,
            hidden_messages,
            cursors,
            member_cursors,
        } = other;
        self.users.extend(users);
        self.logouts.extend(logouts);
        self.conversations.extend(conversations);
        self.messages.extend(messages);
        self.inbox.extend(inbox);
        self.members.extend(members);
        self.message_updates.extend(message_updates);
        self.versions.extend(versions);
        self.hidden_messages.extend(hidden_messages);
        self.cursors.extend(cursors);
        self.member_cursors.extend(member_cursors);
    }

    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
            && self.logouts.is_empty()
            && self.conversations.is_empty()
            && self.messages.is_empty()
            && self.inbox.is_empty()
            && self.members.is_empty()
            && self.message_updates.is_empty()
            && self.versions.is_empty()
            && self.hidden_messages.is_empty()
            && self.cursors.is_empty()
            && self.member_cursors.is_empty()
    }
}

/// The members map as a list of rows: its tuple keys have no JSON form, and every row
/// carries its own key.
mod members_as_list {
    use super::MemberRow;
    use pigeon_proto::{ConversationId, UserId};
    use serde::{Deserialize, Deserializer, Serializer};
    use std::collections::HashMap;

    pub fn serialize<S: Serializer>(
        map: &HashMap<(ConversationId, UserId), MemberRow>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(map.values())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<HashMap<(ConversationId, UserId), MemberRow>, D::Error> {
        let rows = Vec::<MemberRow>::deserialize(d)?;
        Ok(rows
            .into_iter()
            .map(|r| ((r.conversation.clone(), r.user), r))
            .collect())
    }
}

/// A recipient of a pushed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recipient {
    pub user: UserId,
    /// The message's place in their inbox; none for read fan-out.
    pub user_seq: Option<u64>,
    /// They muted the conversation (no offline notification).
    pub muted: bool,
}

/// What is announced after commit.
#[derive(Debug, Clone)]
pub enum Event {
    /// Push `message` to every connected device of each recipient.
    Message {
        message: Arc<Message>,
        recipients: Vec<Recipient>,
    },
    /// `user` has read `conversation` up to `last_read_seq`; tell `to` (other members and the
    /// reader's own devices, except `except_device`).
    Receipt {
        conversation: ConversationId,
        user: UserId,
        last_read_seq: u64,
        to: Vec<UserId>,
        except_device: Option<DeviceId>,
    },
    /// A user's settings of a conversation changed: tell their devices.
    SettingsChanged {
        user: UserId,
        conversation: ConversationId,
        pinned: bool,
        muted: bool,
        hidden: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Journal records written before schema version 2 carry the conversation and seq in
    /// every inbox row; they must still be read (a journal outlives an upgrade).
    #[test]
    fn an_inbox_row_of_an_older_journal_record_is_read() {
        let old = r#"{"users":[],"logouts":[],"conversations":[],"messages":[],
            "inbox":[{"user":2,"user_seq":20,"msg_id":"385582362932543488","conversation":"2-3","seq":20}],
            "members":[],"message_updates":[],"versions":[],"hidden_messages":[],"cursors":[]}"#;
        let ch: Changes = serde_json::from_str(old).unwrap();
        assert_eq!(
            ch.inbox,
            vec![InboxRow {
                user: UserId::new(2).unwrap(),
                user_seq: 20,
                msg_id: MsgId::new(385582362932543488).unwrap(),
            }]
        );
    }
}

//! HTTP bodies and read models: conversations, members, history pages, acks.

use crate::ids::{ConversationId, MsgId, UserId};
use crate::message::Message;
use serde::{Deserialize, Serialize};

/// `to` of a send: exactly one of a user (single chat) or a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct SendTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<UserId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<ConversationId>,
}

/// The fields of a send (the `send` frame without `type`/`req`, or `POST /v1/messages`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendRequest {
    pub client_msg_id: String,
    pub to: SendTarget,
    pub kind: String,
    #[serde(default)]
    pub content: String,
    #[serde(default)]
    pub extra: serde_json::Value,
    #[serde(default)]
    pub reply_to: Option<MsgId>,
    /// `null` reads as none, like `extra` and `reply_to` (a client may send every field of
    /// the message object, empty ones as `null`).
    #[serde(default, deserialize_with = "null_as_default")]
    pub mentions: Vec<u64>,
}

/// A field given as `null` reads as absent (its default), as the protocol's optional
/// fields do.
pub(crate) fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// What a durable send answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendAck {
    pub client_msg_id: String,
    pub msg_id: MsgId,
    pub conversation_id: ConversationId,
    pub seq: u64,
    pub created_at: i64,
    pub duplicate: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConversationType {
    Single,
    Group,
}

/// How a conversation's messages reach members: through their inboxes or by its own chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fanout {
    Write,
    Read,
}

/// One conversation as one user sees it (list entry and `GET /v1/conversations/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConversationView {
    pub conversation_id: ConversationId,
    #[serde(rename = "type")]
    pub kind: ConversationType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<UserId>,
    pub name: Option<String>,
    pub member_count: u64,
    pub seq: u64,
    pub fanout: Fanout,
    pub last_message: Option<Message>,
    pub unread: u64,
    pub last_read_seq: u64,
    pub pinned: bool,
    pub muted: bool,
    pub updated_at: i64,
    // Extensions (the base contract is silent; docs/PROTOCOL.md 6, Conversations, extension).
    pub hidden: bool,
    pub notice: Option<String>,
    pub avatar: Option<String>,
    pub owner: Option<UserId>,
    pub dismissed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Owner,
    Admin,
    Member,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Owner => "owner",
            Role::Admin => "admin",
            Role::Member => "member",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "owner" => Some(Role::Owner),
            "admin" => Some(Role::Admin),
            "member" => Some(Role::Member),
            _ => None,
        }
    }
    /// Owner and admins manage the group.
    pub fn manages(self) -> bool {
        matches!(self, Role::Owner | Role::Admin)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberView {
    pub user_id: UserId,
    pub role: Role,
    pub joined_at: i64,
    pub muted_until: Option<i64>,
}

/// One entry of a pulled chain: its position and the message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainItem {
    pub seq: u64,
    pub message: Message,
}

/// A version of an edited message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionView {
    pub version: u32,
    pub content: String,
    pub at: i64,
}

/// A user as registered by the application's back end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UserView {
    pub user_id: UserId,
    pub name: String,
    pub avatar: String,
}

//! Commands: every change to the store is one of these, applied in order by the engine.

use pigeon_proto::views::SendAck;
use pigeon_proto::{ClientMsgId, ConversationId, DeviceId, Message, MessageKind, MsgId, UserId};

/// Where a send goes: the single chat with a user, or an existing conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendTo {
    User(UserId),
    Conversation(ConversationId),
}

/// A validated send (the edge has checked sizes, kinds and ids).
#[derive(Debug, Clone, PartialEq)]
pub struct SendCommand {
    pub sender: UserId,
    pub to: SendTo,
    pub client_msg_id: ClientMsgId,
    pub kind: MessageKind,
    pub content: String,
    pub extra: serde_json::Value,
    pub reply_to: Option<MsgId>,
    pub mentions: Vec<u64>,
}

impl SendCommand {
    /// A plain text send: no extra, no reply, no mentions.
    pub fn text(
        sender: UserId,
        to: SendTo,
        client_msg_id: ClientMsgId,
        content: impl Into<String>,
    ) -> Self {
        SendCommand {
            sender,
            to,
            client_msg_id,
            kind: MessageKind::Text,
            content: content.into(),
            extra: serde_json::Value::Null,
            reply_to: None,
            mentions: Vec::new(),
        }
    }
}

/// Which chain a device cursor follows.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CursorChain {
    Inbox,
    Conversation(ConversationId),
}

impl CursorChain {
    /// The key stored for this chain: `"user"` or the conversation id.
    pub fn key(&self) -> &str {
        match self {
            CursorChain::Inbox => "user",
            CursorChain::Conversation(c) => c.as_str(),
        }
    }
}

/// The group fields `PATCH /v1/groups/{id}` may change.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GroupPatch {
    pub name: Option<String>,
    pub notice: Option<String>,
    pub avatar: Option<String>,
}

/// Per-user conversation settings; `None` leaves a setting as it is.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SettingsPatch {
    pub pinned: Option<bool>,
    pub muted: Option<bool>,
    pub hidden: Option<bool>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Registers a user, or updates one: a field left `None` keeps what the user has (`""`
    /// for a new one).
    UpsertUser {
        user: UserId,
        name: Option<String>,
        avatar: Option<String>,
    },
    Logout {
        user: UserId,
    },
    Send(SendCommand),
    CreateGroup {
        /// The new group's id, when the caller chose it (a node's router picks one that
        /// belongs to the partition it sends the command to); `None`: the stage makes one.
        id: Option<ConversationId>,
        owner: UserId,
        name: String,
        members: Vec<UserId>,
    },
    Invite {
        actor: UserId,
        conversation: ConversationId,
        users: Vec<UserId>,
    },
    /// Kick when `actor != user`, quit when they are the same.
    RemoveMember {
        actor: UserId,
        conversation: ConversationId,
        user: UserId,
    },
    SetAdmin {
        actor: UserId,
        conversation: ConversationId,
        user: UserId,
        admin: bool,
    },
    Mute {
        actor: UserId,
        conversation: ConversationId,
        user: UserId,
        duration_secs: u64,
    },
    Unmute {
        actor: UserId,
        conversation: ConversationId,
        user: UserId,
    },
    UpdateGroup {
        actor: UserId,
        conversation: ConversationId,
        patch: GroupPatch,
    },
    Dismiss {
        actor: UserId,
        conversation: ConversationId,
    },
    Recall {
        actor: UserId,
        msg_id: MsgId,
    },
    Edit {
        actor: UserId,
        msg_id: MsgId,
        content: String,
    },
    /// Admin API: delete for everyone.
    AdminDelete {
        msg_id: MsgId,
    },
    /// Delete for me.
    HideMessage {
        user: UserId,
        msg_id: MsgId,
    },
    Read {
        user: UserId,
        conversation: ConversationId,
        seq: u64,
        from_device: Option<DeviceId>,
    },
    Settings {
        user: UserId,
        conversation: ConversationId,
        patch: SettingsPatch,
    },
    AdvanceCursor {
        user: UserId,
        device: DeviceId,
        chain: CursorChain,
        seq: u64,
    },
    /// Changes nothing; answered once every command queued before it is committed.
    Flush,
}

impl Command {
    /// The conversation a command names in a field of its own (a group change, a read mark,
    /// a user's settings of it). Sends, acks and the commands that name a message find
    /// theirs otherwise.
    pub fn named_conversation(&self) -> Option<&ConversationId> {
        match self {
            Command::Invite { conversation, .. }
            | Command::RemoveMember { conversation, .. }
            | Command::SetAdmin { conversation, .. }
            | Command::Mute { conversation, .. }
            | Command::Unmute { conversation, .. }
            | Command::UpdateGroup { conversation, .. }
            | Command::Dismiss { conversation, .. }
            | Command::Read { conversation, .. }
            | Command::Settings { conversation, .. } => Some(conversation),
            _ => None,
        }
    }
}

/// What a command answers once its changes are durable.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Done,
    SendAck(SendAck),
    Conversation(ConversationId),
    Message(Box<Message>),
    LastRead(u64),
}

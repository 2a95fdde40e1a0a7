//! The message object of PROTOCOL.md section 1.

use crate::ids::{MsgId, UserId};
use serde::{Deserialize, Serialize};

/// What a message is: user content, or a command the server writes into the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageKind {
    Text,
    Image,
    Voice,
    Video,
    File,
    Custom,
    GroupCreated,
    MemberInvited,
    MemberKicked,
    MemberQuit,
    MemberMuted,
    MemberUnmuted,
    GroupUpdated,
    GroupDismissed,
    Recall,
    Edit,
}

impl MessageKind {
    pub const USER_CONTENT: [MessageKind; 6] = [
        MessageKind::Text,
        MessageKind::Image,
        MessageKind::Voice,
        MessageKind::Video,
        MessageKind::File,
        MessageKind::Custom,
    ];

    /// User content (counts toward unread); everything else is a command message.
    pub fn is_user_content(self) -> bool {
        Self::USER_CONTENT.contains(&self)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MessageKind::Text => "text",
            MessageKind::Image => "image",
            MessageKind::Voice => "voice",
            MessageKind::Video => "video",
            MessageKind::File => "file",
            MessageKind::Custom => "custom",
            MessageKind::GroupCreated => "group_created",
            MessageKind::MemberInvited => "member_invited",
            MessageKind::MemberKicked => "member_kicked",
            MessageKind::MemberQuit => "member_quit",
            MessageKind::MemberMuted => "member_muted",
            MessageKind::MemberUnmuted => "member_unmuted",
            MessageKind::GroupUpdated => "group_updated",
            MessageKind::GroupDismissed => "group_dismissed",
            MessageKind::Recall => "recall",
            MessageKind::Edit => "edit",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        serde_json::from_value(serde_json::Value::String(s.to_owned())).ok()
    }
}

/// `normal`, `recalled` or `deleted`; a message keeps its seq whatever its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageStatus {
    Normal,
    Recalled,
    Deleted,
}

impl MessageStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            MessageStatus::Normal => "normal",
            MessageStatus::Recalled => "recalled",
            MessageStatus::Deleted => "deleted",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "normal" => Some(MessageStatus::Normal),
            "recalled" => Some(MessageStatus::Recalled),
            "deleted" => Some(MessageStatus::Deleted),
            _ => None,
        }
    }
}

/// One message as every reader sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub msg_id: MsgId,
    pub conversation_id: String,
    pub seq: u64,
    pub sender: UserId,
    pub client_msg_id: Option<String>,
    pub kind: MessageKind,
    pub content: String,
    pub extra: serde_json::Value,
    pub reply_to: Option<MsgId>,
    pub mentions: Vec<u64>,
    pub status: MessageStatus,
    pub version: u32,
    pub created_at: i64,
    pub edited_at: Option<i64>,
}

impl Message {
    /// The message as `reader` sees it: recalled and deleted messages carry nothing of what
    /// was said (no content, no `extra`, which holds a custom or media message's payload, no
    /// mentions; the original stays for the admin's audit), and a message the reader deleted
    /// for themself reads as `deleted`.
    pub fn redacted(mut self, hidden_for_reader: bool) -> Self {
        if hidden_for_reader {
            self.status = MessageStatus::Deleted;
        }
        if self.status != MessageStatus::Normal {
            self.content.clear();
            self.extra = serde_json::Value::Null;
            self.mentions.clear();
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn custom(status: MessageStatus) -> Message {
        Message {
            msg_id: MsgId::new(7).unwrap(),
            conversation_id: "1-2".into(),
            seq: 1,
            sender: UserId::new(1).unwrap(),
            client_msg_id: Some("c".into()),
            kind: MessageKind::Custom,
            content: "card".into(),
            extra: serde_json::json!({"order": 42}),
            reply_to: None,
            mentions: vec![2],
            status,
            version: 1,
            created_at: 0,
            edited_at: None,
        }
    }

    #[test]
    fn a_recalled_or_deleted_message_reads_without_anything_that_was_said() {
        for (status, hidden) in [
            (MessageStatus::Recalled, false),
            (MessageStatus::Deleted, false),
            (MessageStatus::Normal, true),
        ] {
            let m = custom(status).redacted(hidden);
            assert_eq!(
                (m.content.as_str(), &m.extra, m.mentions.len()),
                ("", &serde_json::Value::Null, 0),
                "{status:?} hidden={hidden}"
            );
        }
        let m = custom(MessageStatus::Normal).redacted(false);
        assert_eq!((m.content.as_str(), m.mentions.len()), ("card", 1));
        assert_eq!(m.extra["order"], 42);
    }
}

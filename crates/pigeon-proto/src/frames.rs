//! WebSocket frames (PROTOCOL.md section 5): what clients send and what the server sends.

use crate::error::ErrorCode;
use crate::ids::{ConversationId, DeviceId, UserId};
use crate::message::Message;
use crate::views::{ChainItem, SendAck, SendRequest};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A frame from a client. `req` is read separately so that it can be echoed even when the
/// rest of the frame is wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientFrame {
    Send(SendRequest),
    Ack(AckFrame),
    Sync(SyncFrame),
    Pull(PullFrame),
    Read(ReadFrame),
    Typing(TypingFrame),
    Ping,
    RoomJoin(RoomFrame),
    RoomLeave(RoomFrame),
    RoomSend(RoomSendFrame),
}

impl ClientFrame {
    /// Parses `text`, whose `type` the caller has read already (`kind`), straight into that
    /// variant's fields: what deserializing [`ClientFrame`] gives, without serde's buffering
    /// of every field of an internally tagged enum (an allocation per string field, on
    /// every frame a connection sends). `None` for a type that is not a client frame's.
    pub fn parse_typed(kind: &str, text: &str) -> Option<serde_json::Result<ClientFrame>> {
        use serde_json::from_str;
        Some(match kind {
            "send" => from_str(text).map(ClientFrame::Send),
            "ack" => from_str(text).map(ClientFrame::Ack),
            "sync" => from_str(text).map(ClientFrame::Sync),
            "pull" => from_str(text).map(ClientFrame::Pull),
            "read" => from_str(text).map(ClientFrame::Read),
            "typing" => from_str(text).map(ClientFrame::Typing),
            "ping" => from_str::<serde::de::IgnoredAny>(text).map(|_| ClientFrame::Ping),
            "room_join" => from_str(text).map(ClientFrame::RoomJoin),
            "room_leave" => from_str(text).map(ClientFrame::RoomLeave),
            "room_send" => from_str(text).map(ClientFrame::RoomSend),
            _ => return None,
        })
    }
}

/// A cumulative acknowledgement: an inbox position, or a read fan-out group's seq.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct AckFrame {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<ConversationId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct SyncFrame {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_seq: Option<u64>,
    /// `null` reads as none given, like an omitted field.
    #[serde(default, deserialize_with = "crate::views::null_as_default")]
    pub conversations: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Chain {
    User,
    Conversation,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PullFrame {
    pub chain: Chain,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<ConversationId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFrame {
    pub conversation_id: ConversationId,
    pub seq: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TypingFrame {
    pub conversation_id: ConversationId,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoomFrame {
    pub room_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoomSendFrame {
    pub room_id: String,
    pub content: String,
}

/// One read fan-out group in a `sync_result`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncConversation {
    pub conversation_id: ConversationId,
    pub seq: u64,
    pub cursor: u64,
    pub unread: u64,
    pub last_message: Option<Message>,
}

/// One message of a live room.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoomMessage {
    pub sender: UserId,
    pub content: String,
    pub at: i64,
}

/// A frame from the server. `msg` pushes are built by [`msg_frame`] because they are
/// serialised once per message and reused for every recipient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    Hello {
        user_id: UserId,
        device_id: DeviceId,
        server_time: i64,
        heartbeat_ms: u64,
        user_seq: u64,
    },
    SendAck {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        req: Option<i64>,
        #[serde(flatten)]
        ack: SendAck,
    },
    Msg {
        message: Message,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user_seq: Option<u64>,
    },
    SyncResult {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        req: Option<i64>,
        user_seq: u64,
        cursor: u64,
        conversations: Vec<SyncConversation>,
    },
    PullResult {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        req: Option<i64>,
        items: Vec<ChainItem>,
        has_more: bool,
    },
    Receipt {
        conversation_id: ConversationId,
        user_id: UserId,
        last_read_seq: u64,
    },
    Typing {
        conversation_id: ConversationId,
        user_id: UserId,
    },
    Pong {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        req: Option<i64>,
        server_time: i64,
    },
    /// The answer to a request that carried `req` and whose success has no frame of its
    /// own (`read`, `ack`, `typing`, the room frames): it is done.
    Ok {
        req: i64,
    },
    Error {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        req: Option<i64>,
        code: ErrorCode,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },
    Kicked {
        reason: String,
    },
    RoomMsgs {
        room_id: String,
        messages: Vec<RoomMessage>,
    },
    /// Extension: settings of a conversation changed on another device of this user.
    ConversationUpdated {
        conversation_id: ConversationId,
        pinned: bool,
        muted: bool,
        hidden: bool,
    },
}

impl ServerFrame {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("server frames always serialise")
    }
}

/// `{"type":"msg","message":...,"user_seq":N}` from a message already serialised to JSON.
pub fn msg_frame(message_json: &str, user_seq: Option<u64>) -> String {
    let mut out = String::with_capacity(message_json.len() + 48);
    out.push_str("{\"type\":\"msg\",\"message\":");
    out.push_str(message_json);
    if let Some(us) = user_seq {
        out.push_str(",\"user_seq\":");
        out.push_str(&us.to_string());
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_frames_parse_by_type_and_ignore_unknown_fields() {
        let f: ClientFrame =
            serde_json::from_str(r#"{"type":"ack","user_seq":5,"req":1,"x":true}"#).unwrap();
        assert_eq!(
            f,
            ClientFrame::Ack(AckFrame {
                user_seq: Some(5),
                ..Default::default()
            })
        );
        let f: ClientFrame = serde_json::from_str(r#"{"type":"ping"}"#).unwrap();
        assert_eq!(f, ClientFrame::Ping);
        assert!(serde_json::from_str::<ClientFrame>(r#"{"type":"nope"}"#).is_err());
    }

    /// The typed parse gives what the tagged enum gives, for every frame type, and fails
    /// where it fails.
    #[test]
    fn a_typed_parse_agrees_with_the_tagged_one() {
        let frames = [
            r#"{"type":"send","req":1,"client_msg_id":"m-1","to":{"user":2},"kind":"text","content":"hi","extra":{"a":1},"mentions":[3]}"#,
            r#"{"type":"send","client_msg_id":"m-2","to":{"conversation":"g7"},"kind":"text"}"#,
            r#"{"type":"ack","user_seq":5,"req":1,"x":true}"#,
            r#"{"type":"ack","conversation_id":"g7","seq":3}"#,
            r#"{"type":"sync","user_seq":9,"conversations":{"g7":2}}"#,
            r#"{"type":"pull","chain":"conversation","conversation_id":"g7","from":1,"limit":5}"#,
            r#"{"type":"read","conversation_id":"2-3","seq":4}"#,
            r#"{"type":"typing","conversation_id":"2-3"}"#,
            r#"{"type":"ping","req":4}"#,
            r#"{"type":"room_join","room_id":"r"}"#,
            r#"{"type":"room_leave","room_id":"r"}"#,
            r#"{"type":"room_send","room_id":"r","content":"x"}"#,
            // Wrong fields: both refuse.
            r#"{"type":"send","to":{"user":2}}"#,
            r#"{"type":"read","conversation_id":"2-3","seq":"four"}"#,
            r#"{"type":"pull","chain":"sideways"}"#,
        ];
        for text in frames {
            let kind = serde_json::from_str::<serde_json::Value>(text).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_owned();
            let typed = ClientFrame::parse_typed(&kind, text).unwrap();
            let tagged = serde_json::from_str::<ClientFrame>(text);
            match (typed, tagged) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{text}"),
                (Err(_), Err(_)) => {}
                (a, b) => panic!("{text}: typed {a:?}, tagged {b:?}"),
            }
        }
        assert!(ClientFrame::parse_typed("msg", "{}").is_none());
    }

    #[test]
    fn msg_frame_leaves_user_seq_out_for_read_fanout() {
        assert_eq!(msg_frame("{}", None), r#"{"type":"msg","message":{}}"#);
        assert_eq!(
            msg_frame("{}", Some(7)),
            r#"{"type":"msg","message":{},"user_seq":7}"#
        );
    }

    #[test]
    fn error_frame_shape() {
        let f = ServerFrame::Error {
            req: Some(3),
            code: ErrorCode::NotMember,
            message: "no".into(),
            retry_after_ms: None,
        };
        assert_eq!(
            f.to_json(),
            r#"{"type":"error","req":3,"code":"not_member","message":"no"}"#
        );
    }
}

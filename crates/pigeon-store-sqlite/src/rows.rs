//! Row ↔ domain value conversions shared by the read and write paths.

use pigeon_proto::views::{Role, SendAck};
use pigeon_proto::{
    ClientMsgId, ConversationId, Message, MessageKind, MessageStatus, MsgId, UserId,
};
use rusqlite::Row;
use rusqlite::types::Type;

/// The columns [`message`] reads, in order, from a table aliased `m`.
pub const MESSAGE_COLUMNS: &str = "m.msg_id, m.conversation_id, m.seq, m.sender, m.client_msg_id, m.kind, m.content, \
     m.extra, m.reply_to, m.mentions, m.status, m.version, m.created_at, m.edited_at";
/// How many columns [`MESSAGE_COLUMNS`] has.
pub const MESSAGE_COLUMN_COUNT: usize = 14;

fn bad(col: usize, what: &str) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(col, Type::Text, what.to_owned().into())
}

pub fn user_id(row: &Row, col: usize) -> rusqlite::Result<UserId> {
    UserId::new(row.get::<_, i64>(col)? as u64).map_err(|_| bad(col, "bad user id"))
}

pub fn msg_id(row: &Row, col: usize) -> rusqlite::Result<MsgId> {
    MsgId::new(row.get::<_, i64>(col)? as u64).map_err(|_| bad(col, "bad msg id"))
}

/// What a resend of `cmid` is answered: where its first message went. `None` when the
/// stored conversation id does not parse (nothing to report it as a duplicate of).
pub fn duplicate_ack(
    cmid: &ClientMsgId,
    msg_id: MsgId,
    conversation: &str,
    seq: u64,
    created_at: i64,
) -> Option<SendAck> {
    Some(SendAck {
        client_msg_id: cmid.to_string(),
        msg_id,
        conversation_id: ConversationId::parse(conversation).ok()?,
        seq,
        created_at,
        duplicate: true,
    })
}

pub fn role(row: &Row, col: usize) -> rusqlite::Result<Role> {
    Role::parse(&row.get::<_, String>(col)?).ok_or_else(|| bad(col, "bad role"))
}

/// Reads a message starting at column `at` (see [`MESSAGE_COLUMNS`]), unredacted.
pub fn message(row: &Row, at: usize) -> rusqlite::Result<Message> {
    let kind: String = row.get(at + 5)?;
    let status: String = row.get(at + 10)?;
    let extra: Option<String> = row.get(at + 7)?;
    let mentions: Option<String> = row.get(at + 9)?;
    let reply_to: Option<i64> = row.get(at + 8)?;
    Ok(Message {
        msg_id: msg_id(row, at)?,
        conversation_id: row.get(at + 1)?,
        seq: row.get::<_, i64>(at + 2)? as u64,
        sender: user_id(row, at + 3)?,
        client_msg_id: row.get(at + 4)?,
        kind: MessageKind::parse(&kind).ok_or_else(|| bad(at + 5, "bad kind"))?,
        content: row.get(at + 6)?,
        extra: match extra {
            Some(s) => serde_json::from_str(&s).map_err(|_| bad(at + 7, "bad extra"))?,
            None => serde_json::Value::Null,
        },
        reply_to: reply_to.and_then(|v| MsgId::new(v as u64).ok()),
        mentions: match mentions {
            Some(s) => serde_json::from_str(&s).map_err(|_| bad(at + 9, "bad mentions"))?,
            None => Vec::new(),
        },
        status: MessageStatus::parse(&status).ok_or_else(|| bad(at + 10, "bad status"))?,
        version: row.get::<_, i64>(at + 11)? as u32,
        created_at: row.get(at + 12)?,
        edited_at: row.get(at + 13)?,
    })
}

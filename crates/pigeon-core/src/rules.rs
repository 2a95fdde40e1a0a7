//! Rules that both the write path and the read path apply: what a member may see, what a
//! send may carry, who may change what. Pure functions over plain values.

use crate::command::{SendCommand, SendTo};
use crate::error::DomainError;
use pigeon_proto::views::{Role, SendRequest};
use pigeon_proto::{ClientMsgId, ConversationId, MessageKind, UserId};

/// Limits on what comes from outside.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_content_bytes: usize,
}

pub const MAX_MENTIONS: usize = 100;
pub const MAX_GROUP_NAME_CHARS: usize = 128;
pub const MAX_USER_NAME_CHARS: usize = 128;
pub const MAX_NOTICE_CHARS: usize = 4096;
pub const MAX_AVATAR_CHARS: usize = 2048;
pub const MAX_USERS_PER_REQUEST: usize = 1000;
pub const MAX_GROUP_MEMBERS: usize = 100_000;
pub const MAX_MUTE_SECS: u64 = 366 * 86_400;
/// Versions one message keeps (the original and its edits): each may hold the largest
/// content, and `GET /v1/messages/{id}/versions` answers them all.
pub const MAX_MESSAGE_VERSIONS: u32 = 100;

/// The part of a conversation's chain a membership may read: `joined_seq ..= left_seq` (or
/// up to the newest seq while still a member).
pub fn visible_range(joined_seq: u64, left_seq: Option<u64>, newest_seq: u64) -> (u64, u64) {
    (
        joined_seq.max(1),
        left_seq.unwrap_or(newest_seq).min(newest_seq),
    )
}

/// The users of one invitation: 1 to [`MAX_USERS_PER_REQUEST`]. Checked at the edge too,
/// before the pipeline loads anything for them.
pub fn validate_invitees(users: &[UserId]) -> Result<(), DomainError> {
    if users.is_empty() || users.len() > MAX_USERS_PER_REQUEST {
        return Err(DomainError::invalid(format!(
            "user_ids must hold 1..={MAX_USERS_PER_REQUEST} users"
        )));
    }
    Ok(())
}

/// Whether refusing `user` a conversation they are not in may depend on whether it exists.
/// A single chat of two other users may not: its id is derived from the pair and it exists
/// from their first message on, so "no such conversation" would tell who has talked to
/// whom. A group id reveals only that some group was made (PROTOCOL.md 1's table:
/// `not_found` for "no such ... group"), and the caller's own single chat is theirs to
/// know about.
pub fn existence_shown(user: UserId, conv: &ConversationId) -> bool {
    conv.is_group() || conv.peer_of(user).is_some()
}

/// The refusal of a conversation `user` is not in: `not_found` when it does not exist and
/// [`existence_shown`] allows saying so, `not_member` otherwise.
pub fn refusal_outside(user: UserId, conv: &ConversationId, exists: bool) -> DomainError {
    if !exists && existence_shown(user, conv) {
        DomainError::NotFound("conversation")
    } else {
        DomainError::NotMember
    }
}

/// Checks a send from the wire and turns it into a command.
pub fn validate_send(
    sender: UserId,
    req: SendRequest,
    limits: Limits,
) -> Result<SendCommand, DomainError> {
    let client_msg_id =
        ClientMsgId::parse(&req.client_msg_id).map_err(|e| DomainError::invalid(e.0))?;
    let to = match (req.to.user, req.to.conversation) {
        (Some(user), None) if user == sender => {
            return Err(DomainError::invalid(
                "cannot send a single-chat message to yourself",
            ));
        }
        (Some(user), None) => SendTo::User(user),
        (None, Some(conv)) => SendTo::Conversation(conv),
        _ => {
            return Err(DomainError::invalid(
                "to must name exactly one of user or conversation",
            ));
        }
    };
    let kind = MessageKind::parse(&req.kind)
        .filter(|k| k.is_user_content())
        .ok_or_else(|| {
            DomainError::invalid("kind must be one of text, image, voice, video, file, custom")
        })?;
    if req.content.is_empty() {
        return Err(DomainError::invalid("content must not be empty"));
    }
    if req.content.len() > limits.max_content_bytes {
        return Err(DomainError::PayloadTooLarge(format!(
            "content is over {} bytes",
            limits.max_content_bytes
        )));
    }
    if !req.extra.is_null() && req.extra.to_string().len() > limits.max_content_bytes {
        return Err(DomainError::PayloadTooLarge(format!(
            "extra is over {} bytes",
            limits.max_content_bytes
        )));
    }
    if depth(&req.extra) > MAX_EXTRA_DEPTH {
        return Err(DomainError::invalid(format!(
            "extra nests deeper than {MAX_EXTRA_DEPTH} levels"
        )));
    }
    if req.mentions.len() > MAX_MENTIONS {
        return Err(DomainError::invalid(format!(
            "at most {MAX_MENTIONS} mentions"
        )));
    }
    for m in &req.mentions {
        UserId::new(*m).map_err(|e| DomainError::invalid(e.0))?;
    }
    Ok(SendCommand {
        sender,
        to,
        client_msg_id,
        kind,
        content: req.content,
        extra: req.extra,
        reply_to: req.reply_to,
        mentions: req.mentions,
    })
}

/// How deep a message's `extra` may nest (arrays and objects). Deeper structures are no
/// app's card or payload, and the protobuf subprotocol carries `extra` as a
/// `google.protobuf.Value`, whose decoders stop at 100 levels of messages: about three per
/// level of JSON, and a few for the frame around it, so about 30 levels would decode; 20
/// leaves a margin.
pub const MAX_EXTRA_DEPTH: usize = 20;

/// Levels of arrays and objects in `v` (0 for a scalar).
fn depth(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        serde_json::Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Checks edited text like the content of a send.
pub fn validate_edit_content(content: &str, limits: Limits) -> Result<(), DomainError> {
    if content.is_empty() {
        return Err(DomainError::invalid("content must not be empty"));
    }
    if content.len() > limits.max_content_bytes {
        return Err(DomainError::PayloadTooLarge(format!(
            "content is over {} bytes",
            limits.max_content_bytes
        )));
    }
    Ok(())
}

/// Bounds a free-text group field.
pub fn validate_text_field(field: &str, value: &str, max_chars: usize) -> Result<(), DomainError> {
    if value.chars().count() > max_chars {
        return Err(DomainError::invalid(format!(
            "{field} is longer than {max_chars} characters"
        )));
    }
    Ok(())
}

/// Whether `actor` may act on `target` (kick, mute): strictly higher rank.
pub fn outranks(actor: Role, target: Role) -> bool {
    fn rank(r: Role) -> u8 {
        match r {
            Role::Owner => 2,
            Role::Admin => 1,
            Role::Member => 0,
        }
    }
    rank(actor) > rank(target)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pigeon_proto::views::SendTarget;

    fn req(kind: &str, content: &str, to_user: u64) -> SendRequest {
        SendRequest {
            client_msg_id: "m1".into(),
            to: SendTarget {
                user: Some(UserId::new(to_user).unwrap()),
                conversation: None,
            },
            kind: kind.into(),
            content: content.into(),
            extra: serde_json::Value::Null,
            reply_to: None,
            mentions: vec![],
        }
    }

    const LIMITS: Limits = Limits {
        max_content_bytes: 10,
    };

    #[test]
    fn sends_are_checked() {
        let me = UserId::new(1).unwrap();
        assert!(validate_send(me, req("text", "hi", 2), LIMITS).is_ok());
        assert_eq!(
            validate_send(me, req("text", "hi", 1), LIMITS)
                .unwrap_err()
                .code()
                .as_str(),
            "invalid_argument"
        );
        assert_eq!(
            validate_send(me, req("recall", "hi", 2), LIMITS)
                .unwrap_err()
                .code()
                .as_str(),
            "invalid_argument"
        );
        assert_eq!(
            validate_send(me, req("text", "", 2), LIMITS)
                .unwrap_err()
                .code()
                .as_str(),
            "invalid_argument"
        );
        assert_eq!(
            validate_send(me, req("text", "01234567890", 2), LIMITS)
                .unwrap_err()
                .code()
                .as_str(),
            "payload_too_large"
        );
    }

    #[test]
    fn visibility_is_bounded_by_membership() {
        assert_eq!(visible_range(5, None, 10), (5, 10));
        assert_eq!(visible_range(5, Some(7), 10), (5, 7));
        assert_eq!(visible_range(0, None, 3), (1, 3));
    }

    #[test]
    fn only_higher_ranks_act() {
        assert!(outranks(Role::Owner, Role::Admin));
        assert!(outranks(Role::Admin, Role::Member));
        assert!(!outranks(Role::Admin, Role::Admin));
        assert!(!outranks(Role::Member, Role::Member));
    }

    #[test]
    fn outsiders_learn_existence_only_of_groups_and_their_own_chats() {
        let me = UserId::new(1).unwrap();
        let conv = |s: &str| ConversationId::parse(s).unwrap();
        let refused = |c: &str, exists| refusal_outside(me, &conv(c), exists);
        assert_eq!(refused("g5", false), DomainError::NotFound("conversation"));
        assert_eq!(refused("g5", true), DomainError::NotMember);
        assert_eq!(refused("1-2", false), DomainError::NotFound("conversation"));
        // Another pair's chat answers alike whether they have talked or not.
        assert_eq!(refused("2-3", false), DomainError::NotMember);
        assert_eq!(refused("2-3", true), DomainError::NotMember);
    }
}

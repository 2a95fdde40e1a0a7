//! The read side: history pages, the conversation list, pulls, unread counts and receipts.
//! Every history read walks the (conversation_id, seq) index; nothing uses OFFSET.

use crate::rows::{self, MESSAGE_COLUMN_COUNT, MESSAGE_COLUMNS};
use pigeon_core::store::{
    AuditedMessage, HistoryAnchor, HistoryQuery, KeyCursor, KeyPage, ListCursor, Membership,
    UserRecord, chain_position,
};
use pigeon_proto::frames::SyncConversation;
use pigeon_proto::views::{
    ChainItem, ConversationType, ConversationView, Fanout, MemberView, VersionView,
};
use pigeon_proto::{ClientMsgId, ConversationId, Message, MsgId, UserId};
use rusqlite::{Connection, OptionalExtension, params};
use std::collections::HashMap;

/// Counts toward unread: user content from others, still normal, not hidden by the reader.
const UNREAD_SQL: &str = "SELECT count(*) FROM messages m WHERE m.conversation_id = ?1 AND m.seq > ?2 AND m.seq <= ?3 \
     AND m.sender != ?4 AND m.status = 'normal' AND m.kind IN ('text','image','voice','video','file','custom') \
     AND NOT EXISTS (SELECT 1 FROM hidden_messages h WHERE h.user_id = ?4 AND h.msg_id = m.msg_id)";

pub fn meta_get(c: &Connection, key: &str) -> rusqlite::Result<Option<String>> {
    c.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
        .optional()
}

pub fn user(c: &Connection, user: UserId) -> rusqlite::Result<Option<UserRecord>> {
    c.prepare_cached("SELECT name, avatar, token_gen FROM users WHERE user_id = ?1")?
        .query_row([user.get() as i64], |r| {
            Ok(UserRecord {
                user_id: user,
                name: r.get(0)?,
                avatar: r.get(1)?,
                token_gen: r.get::<_, i64>(2)? as u64,
            })
        })
        .optional()
}

pub fn membership(
    c: &Connection,
    conv: &ConversationId,
    user: UserId,
) -> rusqlite::Result<Option<Membership>> {
    c.prepare_cached(
        "SELECT mb.role, mb.joined_seq, mb.left_seq, mb.last_read_seq, c.seq, c.fanout FROM members mb \
         JOIN conversations c ON c.conversation_id = mb.conversation_id WHERE mb.conversation_id = ?1 AND mb.user_id = ?2",
    )?
    .query_row(params![conv.as_str(), user.get() as i64], |r| {
        Ok(Membership {
            role: rows::role(r, 0)?,
            joined_seq: r.get::<_, i64>(1)? as u64,
            left_seq: r.get::<_, Option<i64>>(2)?.map(|v| v as u64),
            last_read_seq: r.get::<_, i64>(3)? as u64,
            conversation_seq: r.get::<_, i64>(4)? as u64,
            is_read_fanout: r.get::<_, String>(5)? == "read",
        })
    })
    .optional()
}

/// A seq given by a client, as SQLite's integer: one past `i64::MAX` (which no seq
/// reaches) reads as `i64::MAX`, "beyond everything", instead of wrapping to a negative.
pub fn seq_arg(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

pub fn conversation_exists(c: &Connection, conv: &ConversationId) -> rusqlite::Result<bool> {
    c.prepare_cached("SELECT 1 FROM conversations WHERE conversation_id = ?1")?
        .query_row([conv.as_str()], |_| Ok(()))
        .optional()
        .map(|found| found.is_some())
}

/// A message as `reader` sees it, from a row of MESSAGE_COLUMNS followed by a hidden flag.
fn reader_message(r: &rusqlite::Row, at: usize) -> rusqlite::Result<Message> {
    let hidden: bool = r
        .get::<_, Option<i64>>(at + MESSAGE_COLUMN_COUNT)?
        .is_some();
    Ok(rows::message(r, at)?.redacted(hidden))
}

// Page sizes are written into the SQL as literals, never bound as `LIMIT ?`: SQLite plans
// with a bound LIMIT's value, so binding one marks the statement expired and every
// execution prepared it again, same value or not (measured: every pull re-parsed and
// re-planned its query, about a fifth of its time). A literal costs a cached statement per
// page size in use.

pub fn history(
    c: &Connection,
    conv: &ConversationId,
    reader: UserId,
    (lo, hi): (u64, u64),
    q: HistoryQuery,
) -> rusqlite::Result<(Vec<Message>, bool)> {
    let (lo, hi, desc) = match q.anchor {
        HistoryAnchor::Newest => (lo, hi, true),
        HistoryAnchor::Before(s) => (lo, hi.min(s.saturating_sub(1)), true),
        HistoryAnchor::After(s) => (lo.max(s.saturating_add(1)), hi, false),
    };
    if lo > hi || q.limit == 0 {
        return Ok((Vec::new(), false));
    }
    let Some((lo, hi)) = seqs_created_within(c, conv, (lo, hi), q.from_time, q.to_time)? else {
        return Ok((Vec::new(), false));
    };
    // The time bounds stay in the query too, so that a page never holds a message outside
    // them, whatever the narrowing found.
    let sql = format!(
        "SELECT {MESSAGE_COLUMNS}, h.msg_id FROM messages m \
         LEFT JOIN hidden_messages h ON h.user_id = ?4 AND h.msg_id = m.msg_id \
         WHERE m.conversation_id = ?1 AND m.seq >= ?2 AND m.seq <= ?3 AND m.created_at >= ?5 AND m.created_at <= ?6 \
         ORDER BY m.seq {} LIMIT {}",
        if desc { "DESC" } else { "ASC" },
        q.limit as u64 + 1
    );
    let mut st = c.prepare_cached(&sql)?;
    let rows = st.query_map(
        params![
            conv.as_str(),
            seq_arg(lo),
            seq_arg(hi),
            reader.get() as i64,
            q.from_time.unwrap_or(i64::MIN),
            q.to_time.unwrap_or(i64::MAX),
        ],
        |r| reader_message(r, 0),
    )?;
    let mut out = rows.collect::<rusqlite::Result<Vec<_>>>()?;
    let has_more = out.len() > q.limit as usize;
    out.truncate(q.limit as usize);
    if desc {
        out.reverse();
    }
    Ok((out, has_more))
}

/// The part of the seqs `lo..=hi` of `conv` whose messages were created within
/// `from..=to` (either open), or `None` if none was. `created_at` never decreases along a
/// conversation's seqs (the pipeline's decision clock is monotonic and starts past the
/// newest message id), so each bound is a binary search over the `(conversation_id, seq)`
/// index: about log2(hi - lo) point reads, instead of an index by time that every send
/// would write (schema migration 3).
pub fn seqs_created_within(
    c: &Connection,
    conv: &ConversationId,
    (lo, hi): (u64, u64),
    from: Option<i64>,
    to: Option<i64>,
) -> rusqlite::Result<Option<(u64, u64)>> {
    let mut st = c.prepare_cached(
        "SELECT created_at FROM messages WHERE conversation_id = ?1 AND seq >= ?2 AND seq <= ?3 \
         ORDER BY seq LIMIT 1",
    )?;
    // The creation time of the first message at or after `seq` (a seq may have no row), or
    // "never" past the last.
    let mut created_from = |seq: u64| -> rusqlite::Result<i64> {
        Ok(st
            .query_row(params![conv.as_str(), seq_arg(seq), seq_arg(hi)], |r| {
                r.get(0)
            })
            .optional()?
            .unwrap_or(i64::MAX))
    };
    // The first seq in lo..=hi + 1 from which messages were created at `t` or later.
    let mut first_at_or_after = |t: i64| -> rusqlite::Result<u64> {
        let (mut a, mut b) = (lo, hi.saturating_add(1));
        while a < b {
            let mid = a + (b - a) / 2;
            if created_from(mid)? >= t {
                b = mid;
            } else {
                a = mid + 1;
            }
        }
        Ok(a)
    };
    let lo = match from {
        Some(t) => first_at_or_after(t)?,
        None => lo,
    };
    let hi = match to {
        Some(i64::MAX) | None => hi,
        Some(t) => first_at_or_after(t + 1)?.saturating_sub(1).min(hi),
    };
    Ok((lo <= hi).then_some((lo, hi)))
}

fn message_for(c: &Connection, reader: UserId, msg_id: i64) -> rusqlite::Result<Option<Message>> {
    let sql = format!(
        "SELECT {MESSAGE_COLUMNS}, h.msg_id FROM messages m \
         LEFT JOIN hidden_messages h ON h.user_id = ?2 AND h.msg_id = m.msg_id WHERE m.msg_id = ?1"
    );
    c.prepare_cached(&sql)?
        .query_row(params![msg_id, reader.get() as i64], |r| {
            reader_message(r, 0)
        })
        .optional()
}

fn unread_count(
    c: &Connection,
    conv: &str,
    after: u64,
    upto: u64,
    reader: UserId,
) -> rusqlite::Result<u64> {
    if after >= upto {
        return Ok(0);
    }
    c.prepare_cached(UNREAD_SQL)?
        .query_row(
            params![conv, seq_arg(after), seq_arg(upto), reader.get() as i64],
            |r| r.get::<_, i64>(0),
        )
        .map(|n| n as u64)
}

/// The query of [`conversations`]: a page of the user's list, or with `only` the one
/// conversation, found by its membership's key rather than by a walk of every membership
/// of the user (`?2 IS NULL OR …` could use no index for it).
fn conversations_sql(only: bool, limit: u32) -> String {
    let only = if only {
        "mb.conversation_id = ?2"
    } else {
        "?2 IS NULL"
    };
    format!(
        "SELECT c.conversation_id, c.is_group, c.seq, c.member_count, c.fanout, c.name, c.notice, c.avatar, \
         c.owner, c.dismissed, c.last_msg_id, c.updated_at, mb.last_read_seq, mb.pinned, mb.muted, mb.hidden_seq \
         FROM members mb JOIN conversations c ON c.conversation_id = mb.conversation_id \
         WHERE mb.user_id = ?1 AND mb.left_seq IS NULL AND {only} \
         AND (?3 OR mb.hidden_seq IS NULL OR c.seq > mb.hidden_seq) \
         AND (?4 IS NULL OR (mb.pinned, c.updated_at, COALESCE(c.last_msg_id, 0), c.conversation_id) \
              < (?4, ?5, ?7, ?6)) \
         ORDER BY mb.pinned DESC, c.updated_at DESC, COALESCE(c.last_msg_id, 0) DESC, c.conversation_id DESC \
         LIMIT {limit}"
    )
}

pub fn conversations(
    c: &Connection,
    user: UserId,
    only: Option<&ConversationId>,
    after: Option<&ListCursor>,
    limit: u32,
    include_hidden: bool,
) -> rusqlite::Result<Vec<ConversationView>> {
    let mut st = c.prepare_cached(&conversations_sql(only.is_some(), limit))?;
    struct Raw {
        view: ConversationView,
        last_msg_id: Option<i64>,
    }
    let raws = st
        .query_map(
            params![
                user.get() as i64,
                only.map(|o| o.as_str()),
                include_hidden,
                after.map(|a| a.pinned as i64),
                after.map(|a| a.updated_at),
                after.map(|a| a.conversation_id.as_str()),
                after.map(|a| seq_arg(a.last_msg_id)),
            ],
            |r| {
                let id: String = r.get(0)?;
                let conversation_id = ConversationId::parse(&id).map_err(|_| {
                    rusqlite::Error::FromSqlConversionFailure(
                        0,
                        rusqlite::types::Type::Text,
                        "bad id".into(),
                    )
                })?;
                let is_group = r.get::<_, i64>(1)? != 0;
                let seq = r.get::<_, i64>(2)? as u64;
                let hidden_seq: Option<i64> = r.get(15)?;
                Ok(Raw {
                    view: ConversationView {
                        peer: conversation_id.peer_of(user),
                        conversation_id,
                        kind: if is_group {
                            ConversationType::Group
                        } else {
                            ConversationType::Single
                        },
                        name: r.get(5)?,
                        member_count: r.get::<_, i64>(3)? as u64,
                        seq,
                        fanout: if r.get::<_, String>(4)? == "read" {
                            Fanout::Read
                        } else {
                            Fanout::Write
                        },
                        last_message: None,
                        unread: 0,
                        last_read_seq: r.get::<_, i64>(12)? as u64,
                        pinned: r.get::<_, i64>(13)? != 0,
                        muted: r.get::<_, i64>(14)? != 0,
                        updated_at: r.get(11)?,
                        hidden: hidden_seq.is_some_and(|h| seq <= h as u64),
                        notice: r.get(6)?,
                        avatar: r.get(7)?,
                        owner: r
                            .get::<_, Option<i64>>(8)?
                            .and_then(|v| UserId::new(v as u64).ok()),
                        dismissed: r.get::<_, i64>(9)? != 0,
                    },
                    last_msg_id: r.get(10)?,
                })
            },
        )?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(raws.len());
    for Raw {
        mut view,
        last_msg_id,
    } in raws
    {
        if let Some(id) = last_msg_id {
            view.last_message = message_for(c, user, id)?;
        }
        view.unread = unread_count(
            c,
            view.conversation_id.as_str(),
            view.last_read_seq,
            view.seq,
            user,
        )?;
        if let Some(peer) = view.peer {
            view.name = self::user(c, peer)?.map(|u| u.name);
        }
        out.push(view);
    }
    Ok(out)
}

pub fn members(
    c: &Connection,
    conv: &ConversationId,
    after: Option<UserId>,
    limit: u32,
) -> rusqlite::Result<Vec<MemberView>> {
    let now = now_ms();
    let mut st = c.prepare_cached(&format!(
        "SELECT user_id, role, joined_at, mute_until FROM members WHERE conversation_id = ?1 AND left_seq IS NULL \
         AND user_id > ?2 ORDER BY user_id LIMIT {limit}"
    ))?;
    st.query_map(
        params![conv.as_str(), after.map_or(0, |u| u.get() as i64)],
        |r| {
            Ok(MemberView {
                user_id: rows::user_id(r, 0)?,
                role: rows::role(r, 1)?,
                joined_at: r.get(2)?,
                muted_until: r.get::<_, Option<i64>>(3)?.filter(|until| *until > now),
            })
        },
    )?
    .collect()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

pub fn audited_message(c: &Connection, msg_id: MsgId) -> rusqlite::Result<Option<AuditedMessage>> {
    let sql = format!(
        "SELECT {MESSAGE_COLUMNS}, m.recalled_at, m.recalled_by FROM messages m WHERE m.msg_id = ?1"
    );
    c.prepare_cached(&sql)?
        .query_row([msg_id.get() as i64], |r| {
            Ok(AuditedMessage {
                message: rows::message(r, 0)?,
                recalled_at: r.get(MESSAGE_COLUMN_COUNT)?,
                recalled_by: r
                    .get::<_, Option<i64>>(MESSAGE_COLUMN_COUNT + 1)?
                    .and_then(|v| UserId::new(v as u64).ok()),
            })
        })
        .optional()
}

pub fn versions(c: &Connection, msg_id: MsgId) -> rusqlite::Result<Vec<VersionView>> {
    c.prepare_cached(
        "SELECT version, content, at FROM message_versions WHERE msg_id = ?1 ORDER BY version",
    )?
    .query_map([msg_id.get() as i64], |r| {
        Ok(VersionView {
            version: r.get::<_, i64>(0)? as u32,
            content: r.get(1)?,
            at: r.get(2)?,
        })
    })?
    .collect()
}

pub fn is_hidden_for(c: &Connection, user: UserId, msg_id: MsgId) -> rusqlite::Result<bool> {
    c.prepare_cached("SELECT 1 FROM hidden_messages WHERE user_id = ?1 AND msg_id = ?2")?
        .exists(params![user.get() as i64, msg_id.get() as i64])
}

pub fn inbox_head(c: &Connection, user: UserId) -> rusqlite::Result<u64> {
    c.prepare_cached("SELECT coalesce(max(user_seq), 0) FROM inbox WHERE user_id = ?1")?
        .query_row([user.get() as i64], |r| r.get::<_, i64>(0))
        .map(|v| v as u64)
}

fn pull_inbox_sql(limit: u32) -> String {
    format!(
        "SELECT i.user_seq, {MESSAGE_COLUMNS}, h.msg_id FROM inbox i JOIN messages m ON m.msg_id = i.msg_id \
         LEFT JOIN hidden_messages h ON h.user_id = ?1 AND h.msg_id = m.msg_id \
         WHERE i.user_id = ?1 AND i.user_seq >= ?2 AND i.user_seq <= ?3 ORDER BY i.user_seq LIMIT {}",
        limit as u64 + 1
    )
}

pub fn pull_inbox(
    c: &Connection,
    user: UserId,
    from: u64,
    to: u64,
    limit: u32,
) -> rusqlite::Result<(Vec<ChainItem>, bool)> {
    if from > to || limit == 0 {
        return Ok((Vec::new(), false));
    }
    let mut st = c.prepare_cached(&pull_inbox_sql(limit))?;
    let mut items = st
        .query_map(
            params![user.get() as i64, seq_arg(from), seq_arg(to)],
            |r| {
                Ok(ChainItem {
                    seq: r.get::<_, i64>(0)? as u64,
                    message: reader_message(r, 1)?,
                })
            },
        )?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let has_more = items.len() > limit as usize;
    items.truncate(limit as usize);
    Ok((items, has_more))
}

pub fn cursor(c: &Connection, user: UserId, device: &str, chain: &str) -> rusqlite::Result<u64> {
    c.prepare_cached(
        "SELECT seq FROM cursors WHERE user_id = ?1 AND device_id = ?2 AND chain = ?3",
    )?
    .query_row(params![user.get() as i64, device, chain], |r| {
        r.get::<_, i64>(0)
    })
    .optional()
    .map(|v| v.unwrap_or(0) as u64)
}

/// The read fan-out groups with messages past the device's position in them (given, or its
/// stored cursor): current memberships, and ended ones up to the message that ended them
/// (PROTOCOL.md 6: a removal is the last message of the group its member can read), so a
/// member removed while offline learns of it.
pub fn read_fanout_changes(
    c: &Connection,
    user: UserId,
    device: &str,
    given: &HashMap<String, u64>,
) -> rusqlite::Result<Vec<SyncConversation>> {
    let mut st = c.prepare_cached(
        "SELECT c.conversation_id, c.seq, c.last_msg_id, mb.joined_seq, mb.last_read_seq, \
         mb.left_seq FROM members mb \
         JOIN conversations c ON c.conversation_id = mb.conversation_id \
         WHERE mb.user_id = ?1 AND c.read_fanout_since IS NOT NULL \
         AND (mb.left_seq IS NULL OR mb.left_seq >= c.read_fanout_since)",
    )?;
    let groups = st
        .query_map([user.get() as i64], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, Option<i64>>(2)?,
                r.get::<_, i64>(3)? as u64,
                r.get::<_, i64>(4)? as u64,
                r.get::<_, Option<i64>>(5)?.map(|s| s as u64),
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut out = Vec::new();
    for (id, newest, last_msg_id, joined_seq, last_read, left_seq) in groups {
        let position = match given.get(&id) {
            Some(p) => *p,
            None => chain_position(cursor(c, user, device, &id)?, joined_seq),
        };
        // A former member's chain ends at the removal.
        let seq = left_seq.unwrap_or(newest);
        if seq <= position {
            continue;
        }
        let Ok(conversation_id) = ConversationId::parse(&id) else {
            continue;
        };
        let last_message = match left_seq {
            Some(left) => message_at(c, user, &id, left)?,
            None => match last_msg_id {
                Some(m) => message_for(c, user, m)?,
                None => None,
            },
        };
        out.push(SyncConversation {
            unread: unread_count(c, &id, last_read, seq, user)?,
            conversation_id,
            seq,
            cursor: position,
            last_message,
        });
    }
    Ok(out)
}

/// The message at `seq` of a conversation, as `reader` sees it.
fn message_at(
    c: &Connection,
    reader: UserId,
    conv: &str,
    seq: u64,
) -> rusqlite::Result<Option<Message>> {
    let id = c
        .prepare_cached("SELECT msg_id FROM messages WHERE conversation_id = ?1 AND seq = ?2")?
        .query_row(params![conv, seq_arg(seq)], |r| r.get::<_, i64>(0))
        .optional()?;
    match id {
        Some(m) => message_for(c, reader, m),
        None => Ok(None),
    }
}

pub fn unread(c: &Connection, user: UserId) -> rusqlite::Result<Vec<(ConversationId, u64, bool)>> {
    let mut st = c.prepare_cached(
        "SELECT c.conversation_id, mb.last_read_seq, c.seq, mb.muted FROM members mb \
         JOIN conversations c ON c.conversation_id = mb.conversation_id \
         WHERE mb.user_id = ?1 AND mb.left_seq IS NULL AND c.seq > mb.last_read_seq",
    )?;
    let candidates = st
        .query_map([user.get() as i64], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, i64>(2)? as u64,
                r.get::<_, i64>(3)? != 0,
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut out = Vec::new();
    for (id, last_read, seq, muted) in candidates {
        let n = unread_count(c, &id, last_read, seq, user)?;
        if n > 0
            && let Ok(conv) = ConversationId::parse(&id)
        {
            out.push((conv, n, muted));
        }
    }
    Ok(out)
}

pub fn receipts(
    c: &Connection,
    conv: &ConversationId,
    seq: u64,
) -> rusqlite::Result<(Vec<UserId>, Vec<UserId>)> {
    let sender: Option<i64> = c
        .prepare_cached("SELECT sender FROM messages WHERE conversation_id = ?1 AND seq = ?2")?
        .query_row(params![conv.as_str(), seq_arg(seq)], |r| r.get(0))
        .optional()?;
    // A member who joined after the message has read it (PROTOCOL.md 6: a member who joins
    // has read everything sent before they joined).
    let mut st = c.prepare_cached(
        "SELECT user_id, last_read_seq >= ?2 OR joined_seq > ?2 FROM members \
         WHERE conversation_id = ?1 AND left_seq IS NULL ORDER BY user_id",
    )?;
    let (mut read, mut unread) = (Vec::new(), Vec::new());
    let rows = st.query_map(params![conv.as_str(), seq_arg(seq)], |r| {
        Ok((rows::user_id(r, 0)?, r.get::<_, bool>(1)?))
    })?;
    for row in rows {
        let (u, has_read) = row?;
        if Some(u.get() as i64) == sender {
            continue;
        }
        if has_read {
            read.push(u)
        } else {
            unread.push(u)
        }
    }
    Ok((read, unread))
}

/// Stored idempotency keys in key order after `after` (walks the unique
/// `(sender, client_msg_id)` index), and the cursor of the next page when `limit` rows were
/// read. Keys that would not parse are left out (they cannot collide with a valid new key)
/// but still move the cursor.
pub fn idempotency_keys(
    c: &Connection,
    after: Option<KeyCursor>,
    limit: usize,
) -> rusqlite::Result<KeyPage> {
    let (sender, cmid) = after.map_or((0, String::new()), |k| (k.sender as i64, k.client_msg_id));
    let mut st = c.prepare_cached(&format!(
        "SELECT sender, client_msg_id FROM messages \
         WHERE client_msg_id IS NOT NULL AND (sender, client_msg_id) > (?1, ?2) \
         ORDER BY sender, client_msg_id LIMIT {limit}"
    ))?;
    let rows = st.query_map(params![sender, cmid], |r| {
        Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
    })?;
    let mut out = Vec::with_capacity(limit.min(65_536));
    let (mut read, mut last) = (0, None);
    for row in rows {
        let (u, m) = row?;
        read += 1;
        if let (Ok(sender), Ok(cmid)) = (UserId::new(u as u64), ClientMsgId::parse(&m)) {
            out.push((sender, cmid));
        }
        last = Some(KeyCursor {
            sender: u as u64,
            client_msg_id: m,
        });
    }
    Ok((out, if read == limit { last } else { None }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pull's statement is prepared once per connection, not at every execution (a bound
    /// `LIMIT ?` made SQLite prepare it again every time).
    #[test]
    fn a_repeated_pull_reuses_its_prepared_statement() {
        let mut c = Connection::open_in_memory().unwrap();
        crate::schema::migrate(&mut c).unwrap();
        let user = UserId::new(2).unwrap();
        for from in 1..=5 {
            pull_inbox(&c, user, from, from + 50, 200).unwrap();
        }
        let st = c.prepare_cached(&pull_inbox_sql(200)).unwrap();
        assert_eq!(
            st.get_status(rusqlite::StatementStatus::RePrepare),
            0,
            "prepared again"
        );
        assert_eq!(st.get_status(rusqlite::StatementStatus::Run), 5);
    }

    /// One conversation of a user's list is found by its membership's key, whatever the
    /// number of the user's memberships; a page of the list walks them in the user's index.
    #[test]
    fn one_conversation_is_looked_up_by_key_not_found_in_a_walk() {
        let mut c = Connection::open_in_memory().unwrap();
        crate::schema::migrate(&mut c).unwrap();
        let plan = |only: bool| -> String {
            let mut st = c
                .prepare(&format!(
                    "EXPLAIN QUERY PLAN {}",
                    conversations_sql(only, 50)
                ))
                .unwrap();
            st.query_map(
                params![
                    1,
                    only.then_some("1-2"),
                    false,
                    None::<i64>,
                    None::<i64>,
                    None::<String>,
                    None::<i64>
                ],
                |r| r.get::<_, String>(3),
            )
            .unwrap()
            .map(Result::unwrap)
            .collect::<Vec<_>>()
            .join("; ")
        };
        let one = plan(true);
        let membership = one
            .split("; ")
            .find(|step| step.starts_with("SEARCH mb "))
            .unwrap_or_else(|| panic!("{one}"));
        assert!(
            membership.contains("conversation_id=?") && membership.contains("user_id=?"),
            "{one}"
        );
        assert!(!one.contains("SCAN"), "{one}");
        let page = plan(false);
        assert!(
            page.contains("SEARCH mb USING INDEX members_by_user (user_id=?)"),
            "{page}"
        );
    }

    /// A time-bounded page, found by binary searches over seqs (no index by time), holds
    /// what filtering every row would: with ties within a millisecond, seqs without a row,
    /// another conversation's rows between, every anchor and bound in or outside the range.
    #[test]
    fn time_bounded_pages_hold_what_a_scan_of_every_row_would() {
        let mut c = Connection::open_in_memory().unwrap();
        crate::schema::migrate(&mut c).unwrap();
        let created = |seq: u64| 1000 + (seq / 3) as i64;
        let holes = [7, 30, 31, 59];
        for seq in (1..=60u64).filter(|s| !holes.contains(s)) {
            for (conv, at) in [("1-2", created(seq)), ("3-4", 5000 - seq as i64)] {
                c.execute(
                    "INSERT INTO messages (msg_id, conversation_id, seq, sender, kind, content, status, version, created_at) \
                     VALUES (?1, ?2, ?3, 1, 'text', '', 'normal', 1, ?4)",
                    params![(seq * 2) as i64 + i64::from(conv == "3-4"), conv, seq as i64, at],
                )
                .unwrap();
            }
        }
        let conv = ConversationId::parse("1-2").unwrap();
        let reader = UserId::new(1).unwrap();
        let times = [
            None,
            Some(990),
            Some(1000),
            Some(1005),
            Some(1010),
            Some(1019),
            Some(1020),
            Some(1021),
            Some(5000),
        ];
        let mut checked = 0;
        let stored = |s: &u64| *s <= 60 && !holes.contains(s);
        for (lo, hi) in [(1, 60), (5, 40), (31, 31), (61, 90)] {
            for from in times {
                for to in times {
                    // The narrowed seqs hold exactly the rows created within the bounds
                    // (the page's filter cannot hide a search that keeps too much here).
                    let within = |s: &u64| {
                        from.is_none_or(|f| created(*s) >= f) && to.is_none_or(|t| created(*s) <= t)
                    };
                    let want: Vec<u64> = (lo..=hi).filter(stored).filter(within).collect();
                    let got: Vec<u64> =
                        match seqs_created_within(&c, &conv, (lo, hi), from, to).unwrap() {
                            Some((a, b)) => {
                                assert!(lo <= a && b <= hi, "{a}..={b} outside {lo}..={hi}");
                                (a..=b).filter(stored).collect()
                            }
                            None => Vec::new(),
                        };
                    assert_eq!(got, want, "{lo}..={hi} {from:?}..{to:?}");
                    for anchor in [
                        HistoryAnchor::Newest,
                        HistoryAnchor::Before(25),
                        HistoryAnchor::After(10),
                    ] {
                        for limit in [3, 100] {
                            let q = HistoryQuery {
                                anchor,
                                limit,
                                from_time: from,
                                to_time: to,
                            };
                            let (got, more) = history(&c, &conv, reader, (lo, hi), q).unwrap();
                            let got: Vec<u64> = got.iter().map(|m| m.seq).collect();
                            let mut want: Vec<u64> = (lo..=hi)
                                .filter(|s| *s <= 60 && !holes.contains(s))
                                .filter(|s| match anchor {
                                    HistoryAnchor::Newest => true,
                                    HistoryAnchor::Before(b) => *s < b,
                                    HistoryAnchor::After(a) => *s > a,
                                })
                                .filter(|s| from.is_none_or(|f| created(*s) >= f))
                                .filter(|s| to.is_none_or(|t| created(*s) <= t))
                                .collect();
                            let want_more = want.len() > limit as usize;
                            if matches!(anchor, HistoryAnchor::After(_)) {
                                want.truncate(limit as usize);
                            } else {
                                want.drain(..want.len().saturating_sub(limit as usize));
                            }
                            let case =
                                format!("{lo}..={hi} {from:?}..{to:?} {anchor:?} limit {limit}");
                            assert_eq!(got, want, "{case}");
                            assert_eq!(more, want_more, "{case}");
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 4 * 9 * 9 * 3 * 2);
        assert_eq!(
            seqs_created_within(&c, &conv, (1, 60), Some(1005), Some(1010)).unwrap(),
            Some((15, 32))
        );
        assert_eq!(
            seqs_created_within(&c, &conv, (1, 60), Some(1021), None).unwrap(),
            None
        );
    }

    /// Each bound costs about log2(range) point reads, not a read of every row.
    #[test]
    fn a_time_bound_reads_log_many_rows() {
        let mut c = Connection::open_in_memory().unwrap();
        crate::schema::migrate(&mut c).unwrap();
        for seq in 1..=4096i64 {
            c.execute(
                "INSERT INTO messages (msg_id, conversation_id, seq, sender, kind, content, status, version, created_at) \
                 VALUES (?1, '1-2', ?1, 1, 'text', '', 'normal', 1, ?1)",
                [seq],
            )
            .unwrap();
        }
        let conv = ConversationId::parse("1-2").unwrap();
        assert_eq!(
            seqs_created_within(&c, &conv, (1, 4096), Some(1000), Some(3000)).unwrap(),
            Some((1000, 3000))
        );
        let st = c
            .prepare_cached(
                "SELECT created_at FROM messages WHERE conversation_id = ?1 AND seq >= ?2 AND seq <= ?3 \
                 ORDER BY seq LIMIT 1",
            )
            .unwrap();
        let reads = st.get_status(rusqlite::StatementStatus::Run);
        assert!(reads <= 2 * 13, "{reads} reads");
        assert!(reads >= 2 * 12, "{reads} reads: the search did not run");
        drop(st);
        // Each read is a seek in the index of seqs, not a scan.
        let plan: Vec<String> = c
            .prepare(
                "EXPLAIN QUERY PLAN SELECT created_at FROM messages WHERE conversation_id = ?1 AND seq >= ?2 \
                 AND seq <= ?3 ORDER BY seq LIMIT 1",
            )
            .unwrap()
            .query_map(params!["1-2", 1, 4096], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            plan,
            vec![
                "SEARCH messages USING INDEX messages_by_seq (conversation_id=? AND seq>? AND seq<?)"
            ]
        );
    }

    #[test]
    fn idempotency_keys_page_through_every_key_once_in_order() {
        let mut c = Connection::open_in_memory().unwrap();
        crate::schema::migrate(&mut c).unwrap();
        let mut want = Vec::new();
        for (i, (sender, cmid)) in [(2, "b"), (1, "z"), (1, "a"), (3, "a"), (2, "a"), (1, "m")]
            .into_iter()
            .enumerate()
        {
            c.execute(
                "INSERT INTO messages (msg_id, conversation_id, seq, sender, client_msg_id, kind, content, status, version, created_at) \
                 VALUES (?1, 'c', ?1, ?2, ?3, 'text', '', 'normal', 1, 0)",
                params![i as i64 + 1, sender, cmid],
            )
            .unwrap();
            want.push((sender as u64, cmid.to_owned()));
        }
        // A message without a key (a command message) is not a key.
        c.execute(
            "INSERT INTO messages (msg_id, conversation_id, seq, sender, kind, content, status, version, created_at) \
             VALUES (99, 'c', 99, 1, 'invite', '', 'normal', 1, 0)",
            [],
        )
        .unwrap();
        want.sort();
        // A key that no longer parses (too long) is left out but paged past.
        c.execute(
            "INSERT INTO messages (msg_id, conversation_id, seq, sender, client_msg_id, kind, content, status, version, created_at) \
             VALUES (98, 'c', 98, 1, ?1, 'text', '', 'normal', 1, 0)",
            [format!("n{}", "x".repeat(80))],
        )
        .unwrap();
        let mut got = Vec::new();
        let mut after = None;
        let mut pages = 0;
        loop {
            let (keys, next) = idempotency_keys(&c, after, 4).unwrap();
            pages += 1;
            got.extend(keys.iter().map(|(u, m)| (u.get(), m.to_string())));
            match next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        assert_eq!(got, want);
        assert_eq!(pages, 2, "7 rows in pages of 4");
    }
}

//! The write side: loading what the engine needs, and writing a batch's changes to the tables.

use crate::rows;
use pigeon_core::changes::{Changes, ConversationRow, MemberRow};
use pigeon_core::state::{ConversationState, MemberState};
use pigeon_core::store::{Loaded, Needs};
use pigeon_proto::views::Fanout;
use pigeon_proto::{ConversationId, UserId};
use rusqlite::{Connection, OptionalExtension, params};
use std::collections::HashMap;

pub fn load(c: &Connection, needs: &Needs) -> rusqlite::Result<Loaded> {
    let mut out = Loaded::default();
    let mut conv_stmt = c.prepare_cached(
        "SELECT is_group, seq, name, notice, avatar, owner, dismissed, last_msg_id, created_at, updated_at, read_fanout_since \
         FROM conversations WHERE conversation_id = ?1",
    )?;
    let mut members_stmt = c.prepare_cached(
        "SELECT user_id, role, joined_seq, joined_at, mute_until, last_read_seq, pinned, muted, hidden_seq \
         FROM members WHERE conversation_id = ?1 AND left_seq IS NULL",
    )?;
    let mut head_users = Vec::new();
    for id in &needs.conversations {
        let row = conv_stmt
            .query_row([id.as_str()], |r| {
                Ok(ConversationState {
                    id: id.clone(),
                    is_group: r.get::<_, i64>(0)? != 0,
                    seq: r.get::<_, i64>(1)? as u64,
                    name: r.get(2)?,
                    notice: r.get(3)?,
                    avatar: r.get(4)?,
                    owner: r
                        .get::<_, Option<i64>>(5)?
                        .and_then(|v| UserId::new(v as u64).ok()),
                    dismissed: r.get::<_, i64>(6)? != 0,
                    last_msg_id: r
                        .get::<_, Option<i64>>(7)?
                        .and_then(|v| pigeon_proto::MsgId::new(v as u64).ok()),
                    created_at: r.get(8)?,
                    updated_at: r.get(9)?,
                    read_fanout_since: r.get::<_, Option<i64>>(10)?.map(|v| v as u64),
                    members: HashMap::new(),
                })
            })
            .optional()?;
        let state = match row {
            Some(mut state) => {
                let members = members_stmt.query_map([id.as_str()], |r| {
                    Ok((
                        rows::user_id(r, 0)?,
                        MemberState {
                            role: rows::role(r, 1)?,
                            joined_seq: r.get::<_, i64>(2)? as u64,
                            joined_at: r.get(3)?,
                            mute_until: r.get(4)?,
                            last_read_seq: r.get::<_, i64>(5)? as u64,
                            pinned: r.get::<_, i64>(6)? != 0,
                            muted: r.get::<_, i64>(7)? != 0,
                            hidden_seq: r.get::<_, Option<i64>>(8)?.map(|v| v as u64),
                        },
                    ))
                })?;
                for m in members {
                    let (u, s) = m?;
                    head_users.push(u);
                    state.members.insert(u, s);
                }
                Some(state)
            }
            None => None,
        };
        out.conversations.insert(id.clone(), state);
    }
    let mut user_stmt = c.prepare_cached("SELECT 1 FROM users WHERE user_id = ?1")?;
    for u in &needs.users {
        if user_stmt.exists([u.get() as i64])? {
            out.users.insert(*u);
        }
        head_users.push(*u);
    }
    let mut head_stmt =
        c.prepare_cached("SELECT coalesce(max(user_seq), 0) FROM inbox WHERE user_id = ?1")?;
    for u in head_users {
        if let std::collections::hash_map::Entry::Vacant(e) = out.inbox_heads.entry(u) {
            e.insert(head_stmt.query_row([u.get() as i64], |r| r.get::<_, i64>(0))? as u64);
        }
    }
    let sql = format!(
        "SELECT {} FROM messages m WHERE m.msg_id = ?1",
        rows::MESSAGE_COLUMNS
    );
    let mut msg_stmt = c.prepare_cached(&sql)?;
    for id in &needs.messages {
        if let Some(m) = msg_stmt
            .query_row([id.get() as i64], |r| rows::message(r, 0))
            .optional()?
        {
            out.messages.insert(*id, m);
        }
    }
    let mut dedupe_stmt = c.prepare_cached(
        "SELECT msg_id, conversation_id, seq, created_at FROM messages WHERE sender = ?1 AND client_msg_id = ?2",
    )?;
    for (sender, cmid) in &needs.dedupe {
        let hit = dedupe_stmt
            .query_row(params![sender.get() as i64, cmid.as_str()], |r| {
                let conv: String = r.get(1)?;
                Ok((
                    rows::msg_id(r, 0)?,
                    conv,
                    r.get::<_, i64>(2)? as u64,
                    r.get::<_, i64>(3)?,
                ))
            })
            .optional()?;
        if let Some(ack) = hit.and_then(|(msg_id, conv, seq, created_at)| {
            rows::duplicate_ack(cmid, msg_id, &conv, seq, created_at)
        }) {
            out.dedupe.insert((*sender, cmid.clone()), ack);
        }
    }
    Ok(out)
}

/// Sets `key` in the `meta` table.
pub fn meta_set(c: &Connection, key: &str, value: &str) -> rusqlite::Result<()> {
    c.execute(
        "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
    .map(|_| ())
}

/// Writes several batches' changes, in order, inside the transaction open on `tx` (the
/// applier puts many batches in one): [`apply_rows`], then [`apply_whole_rows`].
pub fn apply(tx: &Connection, batches: &[&Changes]) -> rusqlite::Result<()> {
    apply_rows(tx, batches)?;
    apply_whole_rows(tx, batches.iter().copied())
}

/// Writes what `batches` add or change row by row, as it comes, table by table (inserts of
/// distinct rows, and updates that depend on order, in order: a user's upsert keeps the
/// `created_at` of its first). Everything but conversations and memberships, which
/// [`apply_whole_rows`] writes.
pub fn apply_rows(tx: &Connection, batches: &[&Changes]) -> rusqlite::Result<()> {
    let every = || batches.iter().copied();
    {
        // A field not given (NULL) keeps what the user has: `""` for a new one.
        let mut st = tx.prepare_cached(
            "INSERT INTO users (user_id, name, avatar, token_gen, created_at, updated_at) \
             VALUES (?1, coalesce(?2, ''), coalesce(?3, ''), 0, ?4, ?4) \
             ON CONFLICT (user_id) DO UPDATE SET name = coalesce(?2, name), avatar = coalesce(?3, avatar), \
             updated_at = excluded.updated_at",
        )?;
        for (u, name, avatar, now) in every().flat_map(|ch| &ch.users) {
            st.execute(params![u.get() as i64, name, avatar, now])?;
        }
        let mut st =
            tx.prepare_cached("UPDATE users SET token_gen = token_gen + 1 WHERE user_id = ?1")?;
        for u in every().flat_map(|ch| &ch.logouts) {
            st.execute([u.get() as i64])?;
        }
        // Before this chunk's messages: see `write_member_cursors`.
        write_member_cursors(tx, batches)?;
        let mut st = tx.prepare_cached(
            "INSERT INTO messages (msg_id, conversation_id, seq, sender, client_msg_id, kind, content, extra, reply_to, \
             mentions, status, version, created_at, edited_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        )?;
        for m in every().flat_map(|ch| &ch.messages) {
            let extra = (!m.extra.is_null()).then(|| m.extra.to_string());
            let mentions = (!m.mentions.is_empty())
                .then(|| serde_json::to_string(&m.mentions).unwrap_or_default());
            st.execute(params![
                m.msg_id.get() as i64,
                m.conversation_id,
                m.seq as i64,
                m.sender.get() as i64,
                m.client_msg_id,
                m.kind.as_str(),
                m.content,
                extra,
                m.reply_to.map(|r| r.get() as i64),
                mentions,
                m.status.as_str(),
                m.version,
                m.created_at,
                m.edited_at,
            ])?;
        }
        let mut st =
            tx.prepare_cached("INSERT INTO inbox (user_id, user_seq, msg_id) VALUES (?1, ?2, ?3)")?;
        for i in every().flat_map(|ch| &ch.inbox) {
            st.execute(params![
                i.user.get() as i64,
                i.user_seq as i64,
                i.msg_id.get() as i64
            ])?;
        }
        // Before the updates: a deletion for everyone wipes the versions an edit earlier in
        // this transaction wrote.
        let mut st = tx.prepare_cached(
            "INSERT OR IGNORE INTO message_versions (msg_id, version, content, at) VALUES (?1, ?2, ?3, ?4)",
        )?;
        for (id, v, content, at) in every().flat_map(|ch| &ch.versions) {
            st.execute(params![id.get() as i64, v, content, at])?;
        }
        let mut st = tx.prepare_cached(
            "UPDATE messages SET status = ?2, version = ?3, content = coalesce(?4, content), edited_at = ?5, \
             recalled_at = coalesce(?6, recalled_at), recalled_by = coalesce(?7, recalled_by), \
             extra = CASE WHEN ?8 THEN NULL ELSE extra END, mentions = CASE WHEN ?8 THEN NULL ELSE mentions END \
             WHERE msg_id = ?1",
        )?;
        let mut wipe_versions =
            tx.prepare_cached("UPDATE message_versions SET content = '' WHERE msg_id = ?1")?;
        for u in every().flat_map(|ch| &ch.message_updates) {
            // Deleted for everyone (the one change that deletes): its `extra`, `mentions`
            // and every earlier version's content go too, not only the current content.
            // From the status, so that a journal record written before this rule applies
            // it too.
            let wipe = u.status == pigeon_proto::MessageStatus::Deleted;
            st.execute(params![
                u.msg_id.get() as i64,
                u.status.as_str(),
                u.version,
                u.content,
                u.edited_at,
                u.recalled.map(|r| r.0),
                u.recalled.map(|r| r.1.get() as i64),
                wipe,
            ])?;
            if wipe {
                wipe_versions.execute([u.msg_id.get() as i64])?;
            }
        }
        let mut st = tx.prepare_cached(
            "INSERT OR IGNORE INTO hidden_messages (user_id, msg_id) VALUES (?1, ?2)",
        )?;
        for (u, m) in every().flat_map(|ch| &ch.hidden_messages) {
            st.execute(params![u.get() as i64, m.get() as i64])?;
        }
        let mut st = tx.prepare_cached(
            "INSERT INTO cursors (user_id, device_id, chain, seq) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT (user_id, device_id, chain) DO UPDATE SET seq = max(seq, excluded.seq)",
        )?;
        for (u, d, chain, seq) in every().flat_map(|ch| &ch.cursors) {
            st.execute(params![
                u.get() as i64,
                d.as_str(),
                chain,
                crate::read::seq_arg(*seq)
            ])?;
        }
    }
    Ok(())
}

/// Acks of conversations the engine did not have at hand (`Changes::member_cursors`):
/// saved only for a member or former member, no further than the newest message stored
/// before the ack (before this chunk, or by the chunk's batches before the ack's: an ack
/// comes after the push of what it acknowledges, in a later batch; never a message of a
/// later batch, which an ack past the newest would otherwise have the device skip when it
/// resumes), nor, for a former member whose removal is stored, than the removal.
/// Written before the chunk's messages, so that the stored newest holds none of the
/// chunk's.
fn write_member_cursors(tx: &Connection, batches: &[&Changes]) -> rusqlite::Result<()> {
    if batches.iter().all(|ch| ch.member_cursors.is_empty()) {
        return Ok(());
    }
    let mut st = tx.prepare_cached(
        "INSERT INTO cursors (user_id, device_id, chain, seq) \
         SELECT mb.user_id, ?2, mb.conversation_id, min(?4, \
             max(coalesce((SELECT max(m.seq) FROM messages m WHERE m.conversation_id = ?3), 0), ?5), \
             coalesce(mb.left_seq, ?4)) \
         FROM members mb WHERE mb.conversation_id = ?3 AND mb.user_id = ?1 \
         ON CONFLICT (user_id, device_id, chain) DO UPDATE SET seq = max(seq, excluded.seq)",
    )?;
    // The newest seq of each conversation among the chunk's batches so far.
    let mut newest_in_chunk: HashMap<&str, u64> = HashMap::new();
    for ch in batches {
        for (u, d, conv, seq) in &ch.member_cursors {
            let earlier = newest_in_chunk.get(conv.as_str()).copied().unwrap_or(0);
            st.execute(params![
                u.get() as i64,
                d.as_str(),
                conv.as_str(),
                crate::read::seq_arg(*seq),
                crate::read::seq_arg(earlier),
            ])?;
        }
        for m in &ch.messages {
            let newest = newest_in_chunk
                .entry(m.conversation_id.as_str())
                .or_insert(0);
            *newest = (*newest).max(m.seq);
        }
    }
    Ok(())
}

/// Writes the conversations' rows and the memberships `batches` changed. Each is a whole
/// row, so only the last of each across the batches is written: a transaction that holds
/// hundreds of batches of one chat writes its row once.
pub fn apply_whole_rows<'a>(
    tx: &Connection,
    batches: impl Iterator<Item = &'a Changes>,
) -> rusqlite::Result<()> {
    let mut conversations: HashMap<&ConversationId, &ConversationRow> = HashMap::new();
    let mut members: HashMap<&(ConversationId, UserId), &MemberRow> = HashMap::new();
    for ch in batches {
        for s in &ch.conversations {
            conversations.insert(&s.id, s);
        }
        for (key, m) in &ch.members {
            members.insert(key, m);
        }
    }
    let mut st = tx.prepare_cached(
            "INSERT INTO conversations (conversation_id, is_group, seq, member_count, fanout, name, notice, avatar, owner, \
             dismissed, last_msg_id, created_at, updated_at, read_fanout_since) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14) \
             ON CONFLICT (conversation_id) DO UPDATE SET seq = excluded.seq, member_count = excluded.member_count, \
             fanout = excluded.fanout, name = excluded.name, notice = excluded.notice, avatar = excluded.avatar, \
             owner = excluded.owner, dismissed = excluded.dismissed, last_msg_id = excluded.last_msg_id, read_fanout_since = excluded.read_fanout_since, \
             updated_at = excluded.updated_at",
        )?;
    for s in conversations.into_values() {
        let fanout = match s.fanout {
            Fanout::Write => "write",
            Fanout::Read => "read",
        };
        st.execute(params![
            s.id.as_str(),
            s.is_group as i64,
            s.seq as i64,
            s.member_count as i64,
            fanout,
            s.name,
            s.notice,
            s.avatar,
            s.owner.map(|o| o.get() as i64),
            s.dismissed as i64,
            s.last_msg_id.map(|m| m.get() as i64),
            s.created_at,
            s.updated_at,
            s.read_fanout_since.map(|v| v as i64),
        ])?;
    }
    let mut st = tx.prepare_cached(
            "INSERT INTO members (conversation_id, user_id, role, joined_seq, joined_at, left_seq, last_read_seq, mute_until, \
             pinned, muted, hidden_seq) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11) \
             ON CONFLICT (conversation_id, user_id) DO UPDATE SET role = excluded.role, joined_seq = excluded.joined_seq, \
             joined_at = excluded.joined_at, left_seq = excluded.left_seq, last_read_seq = excluded.last_read_seq, \
             mute_until = excluded.mute_until, pinned = excluded.pinned, muted = excluded.muted, hidden_seq = excluded.hidden_seq",
        )?;
    for m in members.into_values() {
        let s = &m.state;
        st.execute(params![
            m.conversation.as_str(),
            m.user.get() as i64,
            s.role.as_str(),
            s.joined_seq as i64,
            s.joined_at,
            m.left_seq.map(|v| v as i64),
            s.last_read_seq as i64,
            s.mute_until,
            s.pinned as i64,
            s.muted as i64,
            s.hidden_seq.map(|v| v as i64),
        ])?;
    }
    Ok(())
}

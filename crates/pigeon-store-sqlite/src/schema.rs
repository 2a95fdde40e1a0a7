//! Versioned schema migrations, applied in order at start; `PRAGMA user_version` records how
//! far a database has come.

use rusqlite::{Connection, OptionalExtension};

/// Each entry moves the schema one version forward. Never edit a released entry: add one.
const MIGRATIONS: &[&str] = &[
    // 1: the first schema.
    r#"
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;

    CREATE TABLE users (
        user_id INTEGER PRIMARY KEY,
        name TEXT NOT NULL,
        avatar TEXT NOT NULL,
        token_gen INTEGER NOT NULL DEFAULT 0,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    );

    CREATE TABLE conversations (
        conversation_id TEXT PRIMARY KEY,
        is_group INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        member_count INTEGER NOT NULL,
        fanout TEXT NOT NULL,
        name TEXT,
        notice TEXT,
        avatar TEXT,
        owner INTEGER,
        dismissed INTEGER NOT NULL DEFAULT 0,
        last_msg_id INTEGER,
        read_fanout_since INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    ) WITHOUT ROWID;

    CREATE TABLE messages (
        msg_id INTEGER PRIMARY KEY,
        conversation_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        sender INTEGER NOT NULL,
        client_msg_id TEXT,
        kind TEXT NOT NULL,
        content TEXT NOT NULL,
        extra TEXT,
        reply_to INTEGER,
        mentions TEXT,
        status TEXT NOT NULL,
        version INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        edited_at INTEGER,
        recalled_at INTEGER,
        recalled_by INTEGER
    );
    CREATE UNIQUE INDEX messages_by_seq ON messages (conversation_id, seq);
    CREATE UNIQUE INDEX messages_by_client_id ON messages (sender, client_msg_id) WHERE client_msg_id IS NOT NULL;
    CREATE INDEX messages_by_time ON messages (conversation_id, created_at);

    CREATE TABLE message_versions (
        msg_id INTEGER NOT NULL,
        version INTEGER NOT NULL,
        content TEXT NOT NULL,
        at INTEGER NOT NULL,
        PRIMARY KEY (msg_id, version)
    ) WITHOUT ROWID;

    CREATE TABLE inbox (
        user_id INTEGER NOT NULL,
        user_seq INTEGER NOT NULL,
        msg_id INTEGER NOT NULL,
        conversation_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        PRIMARY KEY (user_id, user_seq)
    ) WITHOUT ROWID;

    CREATE TABLE members (
        conversation_id TEXT NOT NULL,
        user_id INTEGER NOT NULL,
        role TEXT NOT NULL,
        joined_seq INTEGER NOT NULL,
        joined_at INTEGER NOT NULL,
        left_seq INTEGER,
        last_read_seq INTEGER NOT NULL,
        mute_until INTEGER,
        pinned INTEGER NOT NULL DEFAULT 0,
        muted INTEGER NOT NULL DEFAULT 0,
        hidden_seq INTEGER,
        PRIMARY KEY (conversation_id, user_id)
    ) WITHOUT ROWID;
    CREATE INDEX members_by_user ON members (user_id, conversation_id);

    CREATE TABLE cursors (
        user_id INTEGER NOT NULL,
        device_id TEXT NOT NULL,
        chain TEXT NOT NULL,
        seq INTEGER NOT NULL,
        PRIMARY KEY (user_id, device_id, chain)
    ) WITHOUT ROWID;

    CREATE TABLE hidden_messages (
        user_id INTEGER NOT NULL,
        msg_id INTEGER NOT NULL,
        PRIMARY KEY (user_id, msg_id)
    ) WITHOUT ROWID;
    "#,
    // 2: inbox rows keep only where a message sits in a user's chain; its conversation and
    // seq are the message's own (every read joins `messages`). A direct message wrote two
    // rows of ~70 bytes, a third of its table bytes: the applier's B-tree work, the WAL and
    // the checkpoint's writes, which every journal fsync shares the disk with.
    r#"
    CREATE TABLE inbox_v2 (
        user_id INTEGER NOT NULL,
        user_seq INTEGER NOT NULL,
        msg_id INTEGER NOT NULL,
        PRIMARY KEY (user_id, user_seq)
    ) WITHOUT ROWID;
    INSERT INTO inbox_v2 (user_id, user_seq, msg_id) SELECT user_id, user_seq, msg_id FROM inbox;
    DROP TABLE inbox;
    ALTER TABLE inbox_v2 RENAME TO inbox;
    "#,
    // 3: no index of messages by time. A time-bounded page (`from_time`, `to_time`) finds
    // its seqs by a binary search over `messages_by_seq` (`read::seqs_created_within`), which
    // needs `created_at` never to decrease along a conversation's seqs: the decision clock
    // keeps that from now on, and `stamp_times_in_seq_order` makes it true of what an
    // older store holds, once, at open. The index was a sixth of the applier's CPU and of
    // the tables' bytes, written for every message, for a query that is rare.
    r#"DROP INDEX IF EXISTS messages_by_time;"#,
    // 4: a message deleted for everyone keeps nothing of its content: its payload, mentions
    // and earlier versions go too (PROTOCOL.md 6, "content gone"). Deletions from now on
    // write it so; this does it for the ones made before.
    r#"
    UPDATE messages SET extra = NULL, mentions = NULL WHERE status = 'deleted';
    UPDATE message_versions SET content = ''
        WHERE msg_id IN (SELECT msg_id FROM messages WHERE status = 'deleted');
    "#,
];

/// Brings `conn`'s schema to the newest version, one transaction per migration.
pub fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    let current: usize =
        conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))? as usize;
    if current > MIGRATIONS.len() {
        // Its tables have columns this binary does not know of (or lacks ones it writes).
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
            Some(format!(
                "the store was written by a newer Pigeon (schema version {current}; this one knows up to {})",
                MIGRATIONS.len()
            )),
        ));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(current) {
        // A migration may rewrite a table: say so before, so a long start is explained.
        if current > 0 {
            tracing::info!(
                version = i + 1,
                "applying schema migration (may take a while on a large store)"
            );
        }
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tx.commit()?;
        tracing::info!(version = i + 1, "applied schema migration");
    }
    Ok(())
}

/// The meta key set once every message's `created_at` is known to follow its conversation's
/// seqs.
const TIMES_IN_SEQ_ORDER: &str = "created_at_in_seq_order";

/// Once per store: stamps each message whose `created_at` is earlier than that of a message
/// before it in its conversation (a wall clock set back across a restart, before the
/// decision clock started past the newest id) with the latest time before it: it was
/// decided after that message, so it was not created before it. Run at open after the
/// journal is applied, so that batches an older binary journaled are covered too. Answers
/// how many messages it stamped.
pub fn stamp_times_in_seq_order(conn: &mut Connection) -> rusqlite::Result<usize> {
    let done: Option<String> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = ?1",
            [TIMES_IN_SEQ_ORDER],
            |r| r.get(0),
        )
        .optional()?;
    if done.is_some() {
        return Ok(0);
    }
    tracing::info!(
        "checking that message times follow their seqs (once; may take a while on a large store)"
    );
    let tx = conn.transaction()?;
    let stamped = tx.execute(
        "UPDATE messages SET created_at = fix.latest_before
         FROM (
             SELECT msg_id, latest_before FROM (
                 SELECT msg_id, created_at, max(created_at) OVER (
                     PARTITION BY conversation_id ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
                 ) AS latest_before
                 FROM messages
             ) WHERE latest_before > created_at
         ) AS fix
         WHERE messages.msg_id = fix.msg_id",
        [],
    )?;
    crate::write::meta_set(&tx, TIMES_IN_SEQ_ORDER, "1")?;
    tx.commit()?;
    if stamped > 0 {
        tracing::warn!(
            messages = stamped,
            "stamped messages created earlier than a message before them in their conversation \
             with that message's time (a clock set back across an earlier restart)"
        );
    }
    Ok(stamped)
}

pub fn newest_version() -> usize {
    MIGRATIONS.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row `sql` selects, read by `row`.
    fn select_all<T>(
        c: &Connection,
        sql: &str,
        row: impl FnMut(&rusqlite::Row) -> rusqlite::Result<T>,
    ) -> Vec<T> {
        c.prepare(sql)
            .unwrap()
            .query_map([], row)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// A store made at version 1 keeps every inbox entry through the later migrations.
    #[test]
    fn an_inbox_written_at_version_1_survives_the_migrations() {
        let mut c = Connection::open_in_memory().unwrap();
        let tx = c.transaction().unwrap();
        tx.execute_batch(MIGRATIONS[0]).unwrap();
        tx.pragma_update(None, "user_version", 1).unwrap();
        for (user, user_seq, msg) in [(7, 1, 100), (7, 2, 101), (8, 1, 100)] {
            tx.execute(
                "INSERT INTO inbox (user_id, user_seq, msg_id, conversation_id, seq) VALUES (?1, ?2, ?3, '7-8', ?2)",
                [user, user_seq, msg],
            )
            .unwrap();
        }
        tx.commit().unwrap();
        migrate(&mut c).unwrap();
        let version: i64 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version as usize, newest_version());
        let rows: Vec<(i64, i64, i64)> = select_all(
            &c,
            "SELECT user_id, user_seq, msg_id FROM inbox ORDER BY user_id, user_seq",
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        );
        assert_eq!(rows, vec![(7, 1, 100), (7, 2, 101), (8, 1, 100)]);
        // A duplicate position is still refused.
        assert!(
            c.execute(
                "INSERT INTO inbox (user_id, user_seq, msg_id) VALUES (7, 2, 102)",
                []
            )
            .is_err()
        );
    }

    /// Version 3 drops the index by time a store of version 2 has; the index of seqs stays.
    #[test]
    fn version_3_drops_the_index_by_time() {
        let mut c = Connection::open_in_memory().unwrap();
        let tx = c.transaction().unwrap();
        tx.execute_batch(MIGRATIONS[0]).unwrap();
        tx.execute_batch(MIGRATIONS[1]).unwrap();
        tx.pragma_update(None, "user_version", 2).unwrap();
        tx.commit().unwrap();
        let indexes = |c: &Connection| -> Vec<String> {
            select_all(
                c,
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'messages' ORDER BY name",
                |r| r.get(0),
            )
        };
        assert!(indexes(&c).contains(&"messages_by_time".to_owned()));
        migrate(&mut c).unwrap();
        assert_eq!(
            indexes(&c),
            vec!["messages_by_client_id", "messages_by_seq"]
        );
    }

    /// Each message that steps back in time along its conversation's seqs is stamped with
    /// the latest time before it; nothing else changes, and it is done once.
    #[test]
    fn times_are_stamped_in_seq_order_once() {
        let mut c = Connection::open_in_memory().unwrap();
        migrate(&mut c).unwrap();
        // "1-2" steps back twice (a clock set back at seq 3, again at seq 6); "3-4" is in
        // order, with ties, and interleaves with it in msg_id.
        let rows = [
            ("1-2", 1, 100),
            ("1-2", 2, 200),
            ("1-2", 3, 150),
            ("1-2", 4, 180),
            ("1-2", 5, 250),
            ("1-2", 6, 90),
            ("3-4", 1, 50),
            ("3-4", 2, 50),
            ("3-4", 3, 60),
        ];
        let insert = |c: &Connection, i: i64, (conv, seq, at): (&str, i64, i64)| {
            c.execute(
                "INSERT INTO messages (msg_id, conversation_id, seq, sender, kind, content, status, version, created_at) \
                 VALUES (?1, ?2, ?3, 1, 'text', '', 'normal', 1, ?4)",
                rusqlite::params![i, conv, seq, at],
            )
            .unwrap();
        };
        for (i, row) in rows.into_iter().enumerate() {
            insert(&c, i as i64 * 7 % 9 + 1, row);
        }
        assert_eq!(stamp_times_in_seq_order(&mut c).unwrap(), 3);
        let times = |c: &Connection| -> Vec<(String, i64, i64)> {
            select_all(
                c,
                "SELECT conversation_id, seq, created_at FROM messages ORDER BY conversation_id, seq",
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
        };
        let want: Vec<(String, i64, i64)> = [
            ("1-2", 1, 100),
            ("1-2", 2, 200),
            ("1-2", 3, 200),
            ("1-2", 4, 200),
            ("1-2", 5, 250),
            ("1-2", 6, 250),
            ("3-4", 1, 50),
            ("3-4", 2, 50),
            ("3-4", 3, 60),
        ]
        .into_iter()
        .map(|(c, s, t)| (c.to_owned(), s, t))
        .collect();
        assert_eq!(times(&c), want);
        // Once: a later step back (which the decision clock no longer makes) is left alone.
        insert(&c, 99, ("3-4", 4, 10));
        assert_eq!(stamp_times_in_seq_order(&mut c).unwrap(), 0);
        assert_eq!(times(&c).last().unwrap().2, 10);
    }

    #[test]
    fn a_store_of_a_newer_schema_is_refused() {
        let mut c = Connection::open_in_memory().unwrap();
        migrate(&mut c).unwrap();
        c.pragma_update(None, "user_version", (newest_version() + 1) as i64)
            .unwrap();
        let e = migrate(&mut c).unwrap_err().to_string();
        assert!(e.contains("newer Pigeon"), "{e}");
    }
}

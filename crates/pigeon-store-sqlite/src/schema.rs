//! Versioned schema migrations, applied in order at start; `PRAGMA user_version` records how
//! far a database has come.

use rusqlite::Connection;

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
];

/// Brings `conn`'s schema to the newest version, one transaction per migration.
pub fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    let current: usize =
        conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))? as usize;
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(current) {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tx.commit()?;
        tracing::info!(version = i + 1, "applied schema migration");
    }
    Ok(())
}

pub fn newest_version() -> usize {
    MIGRATIONS.len()
}

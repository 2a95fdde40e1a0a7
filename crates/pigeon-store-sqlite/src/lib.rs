//! Pigeon's embedded store: one SQLite database file in WAL mode. Writes go through one
//! connection (the pipeline commits a whole batch in one transaction, so one fsync covers
//! many messages); reads use a small pool of read-only connections that WAL lets run beside
//! the writer.

mod read;
mod rows;
mod schema;
mod write;

use async_trait::async_trait;
use pigeon_core::changes::Changes;
use pigeon_core::store::{
    AuditedMessage, HistoryQuery, KeyCursor, KeyPage, ListCursor, Loaded, Membership, Needs, Store,
    StoreError, UserRecord,
};
use pigeon_proto::frames::SyncConversation;
use pigeon_proto::views::{ChainItem, ConversationView, MemberView, VersionView};
use pigeon_proto::{ConversationId, Message, MsgId, UserId};
use rusqlite::{Connection, OpenFlags};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use schema::newest_version as schema_version;

/// How hard a commit tries to reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsync at every commit (`synchronous=FULL`): an acknowledged message survives power loss.
    Fsync,
    /// Let the OS flush (`synchronous=OFF`): survives a process crash, not a power loss.
    Os,
}

/// The embedded store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    writer: Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
}

const MAX_IDLE_READERS: usize = 8;
/// WAL pages after which a commit checkpoints by itself (~160 MB at 4 KiB): a backstop for
/// when the background checkpointer falls behind. Under a steady load the WAL file grows to
/// about this size and is then reused.
const WAL_AUTOCHECKPOINT_PAGES: i64 = 40_000;

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

impl SqliteStore {
    /// Opens (creating if needed) `dir/pigeon.db` and applies pending migrations.
    pub fn open(dir: &Path, durability: Durability) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError(format!("create {}: {e}", dir.display())))?;
        let path = dir.join("pigeon.db");
        let mut writer = Connection::open(&path).map_err(err)?;
        writer
            .pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        let sync = match durability {
            Durability::Fsync => "FULL",
            Durability::Os => "OFF",
        };
        writer
            .pragma_update(None, "synchronous", sync)
            .map_err(err)?;
        writer
            .pragma_update(None, "busy_timeout", 5000)
            .map_err(err)?;
        writer
            .pragma_update(None, "cache_size", -64_000)
            .map_err(err)?;
        writer
            .pragma_update(None, "mmap_size", 268_435_456)
            .map_err(err)?;
        writer
            .pragma_update(None, "wal_autocheckpoint", WAL_AUTOCHECKPOINT_PAGES)
            .map_err(err)?;
        schema::migrate(&mut writer).map_err(err)?;
        let store = SqliteStore {
            inner: Arc::new(Inner {
                path,
                writer: Mutex::new(writer),
                readers: Mutex::new(Vec::new()),
            }),
        };
        store.start_checkpointer()?;
        Ok(store)
    }

    /// Checkpoints the WAL from its own connection and thread, so that commits rarely do:
    /// SQLite's automatic checkpoint runs inside a commit and stalls every sender behind it
    /// (it was ~6 % of the server's time and the longest commits under load). Every 100 ms a
    /// PASSIVE checkpoint copies what it can without blocking anyone; the writer's automatic
    /// checkpoint stays as a backstop at [`WAL_AUTOCHECKPOINT_PAGES`]. (A RESTART or TRUNCATE
    /// checkpoint from here, to keep the WAL small under a steady load, was tried: it blocks
    /// the writer while it waits for readers, and the p99 of sends doubled.) The thread ends
    /// with the store.
    fn start_checkpointer(&self) -> Result<(), StoreError> {
        let conn = Connection::open(&self.inner.path).map_err(err)?;
        conn.pragma_update(None, "busy_timeout", 5000)
            .map_err(err)?;
        let store = Arc::downgrade(&self.inner);
        std::thread::Builder::new()
            .name("pigeon-checkpoint".into())
            .spawn(move || {
                while store.upgrade().is_some() {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                    {
                        tracing::warn!(error = %e, "wal checkpoint failed");
                    }
                }
            })
            .map_err(err)?;
        Ok(())
    }

    fn open_reader(&self) -> Result<Connection, StoreError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI;
        let conn = Connection::open_with_flags(&self.inner.path, flags).map_err(err)?;
        conn.pragma_update(None, "busy_timeout", 5000)
            .map_err(err)?;
        conn.pragma_update(None, "cache_size", -16_000)
            .map_err(err)?;
        conn.pragma_update(None, "mmap_size", 268_435_456)
            .map_err(err)?;
        Ok(conn)
    }

    /// Runs `f` on a pooled read connection on the blocking pool.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let pooled = this.inner.readers.lock().expect("reader pool lock").pop();
            let conn = match pooled {
                Some(c) => c,
                None => this.open_reader()?,
            };
            let out = f(&conn).map_err(err);
            let mut pool = this.inner.readers.lock().expect("reader pool lock");
            if pool.len() < MAX_IDLE_READERS {
                pool.push(conn);
            }
            out
        })
        .await
        .map_err(err)?
    }

    /// Runs `f` on the single writer connection on the blocking pool.
    async fn write<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = this.inner.writer.lock().expect("writer lock");
            f(&mut conn).map_err(err)
        })
        .await
        .map_err(err)?
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn load(&self, needs: Needs) -> Result<Loaded, StoreError> {
        // From a read connection, so the next batch loads while the previous one commits; the
        // engine holds in memory whatever an uncommitted batch changed.
        self.read(move |c| write::load(c, &needs)).await
    }

    async fn commit(&self, changes: Changes) -> Result<(), StoreError> {
        self.write(move |c| write::commit(c, &changes)).await
    }

    async fn max_msg_id(&self) -> Result<u64, StoreError> {
        self.read(|c| {
            c.query_row("SELECT coalesce(max(msg_id), 0) FROM messages", [], |r| {
                r.get::<_, i64>(0)
            })
        })
        .await
        .map(|v| v as u64)
    }

    async fn idempotency_key_count(&self) -> Result<u64, StoreError> {
        self.read(|c| {
            c.query_row(
                "SELECT count(*) FROM messages WHERE client_msg_id IS NOT NULL",
                [],
                |r| r.get::<_, i64>(0),
            )
        })
        .await
        .map(|v| v as u64)
    }

    async fn idempotency_keys(
        &self,
        after: Option<KeyCursor>,
        limit: usize,
    ) -> Result<KeyPage, StoreError> {
        self.read(move |c| read::idempotency_keys(c, after, limit))
            .await
    }

    async fn meta_get(&self, key: &str) -> Result<Option<String>, StoreError> {
        let key = key.to_owned();
        self.write(move |c| read::meta_get(c, &key)).await
    }

    async fn meta_set(&self, key: &str, value: &str) -> Result<(), StoreError> {
        let (key, value) = (key.to_owned(), value.to_owned());
        self.write(move |c| {
            c.execute("INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))
                .map(|_| ())
        })
        .await
    }

    async fn user(&self, user: UserId) -> Result<Option<UserRecord>, StoreError> {
        self.read(move |c| read::user(c, user)).await
    }

    async fn membership(
        &self,
        conv: &ConversationId,
        user: UserId,
    ) -> Result<Option<Membership>, StoreError> {
        let conv = conv.clone();
        self.read(move |c| read::membership(c, &conv, user)).await
    }

    async fn history(
        &self,
        conv: &ConversationId,
        reader: UserId,
        range: (u64, u64),
        query: HistoryQuery,
    ) -> Result<(Vec<Message>, bool), StoreError> {
        let conv = conv.clone();
        self.read(move |c| read::history(c, &conv, reader, range, query))
            .await
    }

    async fn conversations(
        &self,
        user: UserId,
        only: Option<&ConversationId>,
        after: Option<ListCursor>,
        limit: u32,
        include_hidden: bool,
    ) -> Result<Vec<ConversationView>, StoreError> {
        let only = only.cloned();
        self.read(move |c| {
            read::conversations(
                c,
                user,
                only.as_ref(),
                after.as_ref(),
                limit,
                include_hidden,
            )
        })
        .await
    }

    async fn members(
        &self,
        conv: &ConversationId,
        after: Option<UserId>,
        limit: u32,
    ) -> Result<Vec<MemberView>, StoreError> {
        let conv = conv.clone();
        self.read(move |c| read::members(c, &conv, after, limit))
            .await
    }

    async fn message(&self, msg_id: MsgId) -> Result<Option<AuditedMessage>, StoreError> {
        self.read(move |c| read::audited_message(c, msg_id)).await
    }

    async fn versions(&self, msg_id: MsgId) -> Result<Vec<VersionView>, StoreError> {
        self.read(move |c| read::versions(c, msg_id)).await
    }

    async fn is_hidden_for(&self, user: UserId, msg_id: MsgId) -> Result<bool, StoreError> {
        self.read(move |c| read::is_hidden_for(c, user, msg_id))
            .await
    }

    async fn inbox_head(&self, user: UserId) -> Result<u64, StoreError> {
        self.read(move |c| read::inbox_head(c, user)).await
    }

    async fn pull_inbox(
        &self,
        user: UserId,
        from: u64,
        to: u64,
        limit: u32,
    ) -> Result<(Vec<ChainItem>, bool), StoreError> {
        self.read(move |c| read::pull_inbox(c, user, from, to, limit))
            .await
    }

    async fn cursor(&self, user: UserId, device: &str, chain: &str) -> Result<u64, StoreError> {
        let (device, chain) = (device.to_owned(), chain.to_owned());
        self.read(move |c| read::cursor(c, user, &device, &chain))
            .await
    }

    async fn read_fanout_changes(
        &self,
        user: UserId,
        device: &str,
        given: &HashMap<String, u64>,
    ) -> Result<Vec<SyncConversation>, StoreError> {
        let (device, given) = (device.to_owned(), given.clone());
        self.read(move |c| read::read_fanout_changes(c, user, &device, &given))
            .await
    }

    async fn unread(&self, user: UserId) -> Result<Vec<(ConversationId, u64, bool)>, StoreError> {
        self.read(move |c| read::unread(c, user)).await
    }

    async fn receipts(
        &self,
        conv: &ConversationId,
        seq: u64,
    ) -> Result<(Vec<UserId>, Vec<UserId>), StoreError> {
        let conv = conv.clone();
        self.read(move |c| read::receipts(c, &conv, seq)).await
    }
}

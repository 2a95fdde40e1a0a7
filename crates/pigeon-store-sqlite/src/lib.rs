//! Pigeon's embedded store: a journal and one SQLite database file in WAL mode. A batch is
//! durable once its journal record is fsynced (`journal.rs`); one thread then applies the
//! journaled batches to the tables, many per transaction (`applier.rs`). Reads use a small
//! pool of read-only connections that WAL lets run beside that writer, each after the
//! tables hold every batch acknowledged before it began.

mod applier;
mod background;
mod journal;
mod read;
mod record;
mod rows;
mod schema;
mod table_files;
mod write;

use applier::StoreWrites;
use async_trait::async_trait;
use journal::Journal;
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
use table_files::TableFiles;

pub use schema::newest_version as schema_version;

/// How hard a commit tries to reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fdatasync the journal at every commit: an acknowledged message survives power loss.
    /// The tables' transactions are not synced as they commit (`synchronous=NORMAL`); the
    /// checkpointer syncs the tables' files every 100 ms, a step at a time, and a journal
    /// segment is deleted only once the tables hold its batches durably. (Synced at every
    /// commit, four or more times a second under load, each of those fsyncs wrote megabytes
    /// at once, and every journal fsync behind it on the one disk waited: at 15 000 sends/s
    /// the p99 was 19-52 ms in six runs, 15-22 ms without those fsyncs.)
    Fsync,
    /// Let the OS flush the journal and the tables (`synchronous=OFF`): survives a process
    /// crash, not a power loss.
    Os,
}

/// The embedded store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

/// A batch to make durable, and where to say how that went.
type JournalJob = (
    Changes,
    tokio::sync::oneshot::Sender<Result<(), StoreError>>,
);

/// The journal thread and the way to it: dropping the sender ends the thread once it has
/// committed what it was given.
type JournalThread = (
    std::sync::mpsc::Sender<JournalJob>,
    std::thread::JoinHandle<()>,
);

struct Inner {
    path: PathBuf,
    /// Durability `fsync`: the few settings written outside the journal (`meta_set`) are
    /// synced as they are written.
    fsync: bool,
    writes: Arc<StoreWrites>,
    /// Commits go to one thread that appends and fsyncs them (`pigeon-journal`): the same
    /// warm thread every time, not whichever of the blocking pool's threads wakes. `None`
    /// once closed.
    journal: Mutex<Option<JournalThread>>,
    applier: Mutex<Option<std::thread::JoinHandle<()>>>,
    readers: Mutex<Vec<Connection>>,
    /// Places for the queries running at once (see [`MAX_QUERIES_AT_ONCE`]).
    query_places: Arc<tokio::sync::Semaphore>,
    /// Places for the lookups by key running at once, a lane of their own (see
    /// [`MAX_LOOKUPS_AT_ONCE`]).
    lookup_places: Arc<tokio::sync::Semaphore>,
    /// Read connections opened since the store was (tests: they stay bounded).
    #[cfg(test)]
    readers_opened: std::sync::atomic::AtomicUsize,
}

impl Inner {
    /// Lets the applier finish what is queued, then closes the journal, so that a store
    /// opened next on the same directory does not replay batches this one is still applying.
    fn close(&self) {
        // Commits already handed over finish; later ones answer that the store is closed.
        let journal = self.journal.lock().expect("journal thread lock").take();
        if let Some((jobs, thread)) = journal {
            drop(jobs);
            if thread.join().is_err() {
                tracing::error!("the journal thread panicked");
            }
        }
        self.writes.close();
        let handle = match self.applier.lock() {
            Ok(mut guard) => guard.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(handle) = handle
            && handle.join().is_err()
        {
            tracing::error!("the journal applier panicked");
        }
        self.writes.close_journal();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.close();
    }
}

/// Queries (every read but the lookups by key and the engine's loads) running at once; more wait their turn,
/// first come first served, holding no thread. Each running one holds a blocking thread
/// and a read connection (two file descriptors, a 16 MB page cache): unbounded, a burst of
/// slow queries (a user in many conversations asking for unread counts again and again)
/// took up to tokio's 512 blocking threads, as many connections and their descriptors,
/// and the engine's loads, which every send may need, queued behind them. The loads do not
/// take a place, so queries never hold up a decision. Two cores run no more than this at
/// once anyway.
pub const MAX_QUERIES_AT_ONCE: usize = 8;
/// Lookups of one row by its key (a user, a membership, a cursor, the state a connection
/// starts from) running at once: a lane apart from the queries', so that a WebSocket's
/// `hello`, a token check or `/readyz` never waits behind a queue of slow lists and counts.
/// Bounded for the same reasons.
pub const MAX_LOOKUPS_AT_ONCE: usize = 8;
/// Read connections kept open between reads: one for every place, and one for the loads,
/// so that reads in both lanes at once do not open and close connections (and lose their
/// prepared statements).
const MAX_IDLE_READERS: usize = MAX_QUERIES_AT_ONCE + MAX_LOOKUPS_AT_ONCE + 1;
/// Journaled bytes the tables may lag behind before sends wait: what bounds the memory the
/// unapplied batches hold.
pub const DEFAULT_BACKLOG_BYTES: usize = 64 << 20;
/// WAL pages after which the applier's commit checkpoints by itself (~160 MB at 4 KiB): a
/// backstop for when the checkpoints between transactions fall behind. Under a steady load
/// the WAL file stays at about one transaction's pages (the applier checkpoints before it
/// begins the next one, so SQLite reuses the WAL from its start).
const WAL_AUTOCHECKPOINT_PAGES: i64 = 40_000;

/// Makes everything the tables' files hold durable: the database file and its WAL, each
/// through a descriptor of its own (any descriptor of a file flushes all of its written
/// pages).
fn sync_tables(db: &Path) -> Result<(), StoreError> {
    TableFiles::new(db).sync()
}

pub(crate) fn err<E: std::fmt::Display + 'static>(e: E) -> StoreError {
    // SQLite's own errors say whether trying again may help: a database held busy or
    // locked past the busy timeout may be free on the next try, a constraint refused a row
    // that will be refused again.
    let code = (&e as &dyn std::any::Any)
        .downcast_ref::<rusqlite::Error>()
        .and_then(rusqlite::Error::sqlite_error_code);
    match code {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            StoreError::Retry(e.to_string())
        }
        Some(rusqlite::ErrorCode::ConstraintViolation) => StoreError::Conflict(e.to_string()),
        _ => StoreError::Unavailable(e.to_string()),
    }
}

impl SqliteStore {
    /// Opens (creating if needed) `dir/pigeon.db` and `dir/journal/`, applies pending
    /// migrations, then applies whatever the journal holds beyond the tables (a crash left it
    /// there).
    pub fn open(dir: &Path, durability: Durability) -> Result<Self, StoreError> {
        Self::open_with(dir, durability, DEFAULT_BACKLOG_BYTES)
    }

    /// [`SqliteStore::open`], with sends waiting once the tables are `backlog_bytes` of
    /// journal behind.
    pub fn open_with(
        dir: &Path,
        durability: Durability,
        backlog_bytes: usize,
    ) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::unavailable(format!("create {}: {e}", dir.display())))?;
        let path = dir.join("pigeon.db");
        let mut writer = Connection::open(&path).map_err(err)?;
        writer
            .pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        let sync = match durability {
            Durability::Fsync => "NORMAL",
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
        let fsync = durability == Durability::Fsync;
        if fsync {
            // The journal deletes its segments at or below the lsn the tables hold: what
            // they hold must be on the disk first (an earlier run that crashed may have
            // left its last commits in the OS's cache alone).
            sync_tables(&path)?;
        }
        let applied = applier::applied_lsn(&writer)?;
        let journal_dir = dir.join("journal");
        let (journal, pending) =
            Journal::open(&journal_dir, durability == Durability::Fsync, applied)
                .map_err(|e| StoreError::unavailable(format!("journal: {e}")))?;
        let replayed = applier::replay(&mut writer, pending, &journal_dir)?;
        if replayed > 0 {
            tracing::info!(
                batches = replayed,
                "applied journaled batches the tables lacked"
            );
        }
        // After the journal: what an older binary journaled is covered too.
        let stamped = schema::stamp_times_in_seq_order(&mut writer).map_err(err)?;
        let applied = journal.next_lsn() - 1;
        if fsync && (replayed > 0 || stamped > 0) {
            // The replayed batches too, before their segments may go.
            sync_tables(&path)?;
        }
        let writes = StoreWrites::new(writer, journal, applied, backlog_bytes, fsync);
        // The journal thread first: it ends by itself when the sender goes (here, if the
        // applier's thread cannot start), the applier only when told to close.
        let (journal_tx, jobs) = std::sync::mpsc::channel::<JournalJob>();
        let journal_thread = {
            let writes = writes.clone();
            std::thread::Builder::new()
                .name("pigeon-journal".into())
                .spawn(move || {
                    for (changes, reply) in jobs {
                        let _ = reply.send(writes.commit(changes));
                    }
                })
                .map_err(err)?
        };
        let handle = {
            let writes = writes.clone();
            std::thread::Builder::new()
                .name("pigeon-apply".into())
                .spawn(move || {
                    background::run_as_batch_work();
                    writes.run_applier()
                })
                .map_err(err)?
        };
        let store = SqliteStore {
            inner: Arc::new(Inner {
                path,
                fsync,
                writes,
                journal: Mutex::new(Some((journal_tx, journal_thread))),
                applier: Mutex::new(Some(handle)),
                readers: Mutex::new(Vec::new()),
                query_places: Arc::new(tokio::sync::Semaphore::new(MAX_QUERIES_AT_ONCE)),
                lookup_places: Arc::new(tokio::sync::Semaphore::new(MAX_LOOKUPS_AT_ONCE)),
                #[cfg(test)]
                readers_opened: Default::default(),
            }),
        };
        store.start_checkpointer(fsync)?;
        Ok(store)
    }

    /// Makes the tables durable from a thread of its own, every 100 ms. With `fsync` it
    /// writes the database file and the WAL back a step at a time and syncs them
    /// (`table_files.rs`), which makes every batch applied before durable in the tables,
    /// and tells the applier so: the journal segments of those batches may go. It copies
    /// nothing itself: the applier checkpoints between two transactions, holding the only
    /// writer, a step at a time too (a PASSIVE checkpoint from here would sync through
    /// SQLite, which hands the disk a quarter second's pages at once, and every journal
    /// sync queued behind them). Without `fsync` it checkpoints the WAL every 100 ms, so
    /// that no checkpoint runs inside the applier's transaction: SQLite's automatic
    /// checkpoint runs inside a commit and stalls it (when transactions were the commits,
    /// it was ~6 % of the server's time and the longest commits under load). The writer's
    /// automatic checkpoint stays as a backstop at [`WAL_AUTOCHECKPOINT_PAGES`]. (A RESTART
    /// or TRUNCATE checkpoint from here, to keep the WAL small under a steady load, was
    /// tried: it blocks the writer while it waits for readers, and the p99 of sends
    /// doubled.) The thread ends with the store.
    fn start_checkpointer(&self, fsync: bool) -> Result<(), StoreError> {
        // With `fsync` no connection: one that checkpointed as it closed, last, could copy
        // and sync nothing and delete a WAL whose copy a failed sync left in doubt.
        enum Round {
            Checkpoint(Connection),
            Sync(TableFiles),
        }
        let mut round = if fsync {
            Round::Sync(TableFiles::new(&self.inner.path))
        } else {
            let conn = Connection::open(&self.inner.path).map_err(err)?;
            conn.pragma_update(None, "busy_timeout", 5000)
                .map_err(err)?;
            conn.pragma_update(None, "synchronous", "OFF")
                .map_err(err)?;
            Round::Checkpoint(conn)
        };
        // Weak: the writer connection inside goes with the store, not a round later.
        let writes = Arc::downgrade(&self.inner.writes);
        let store = Arc::downgrade(&self.inner);
        std::thread::Builder::new()
            .name("pigeon-checkpoint".into())
            .spawn(move || {
                background::run_as_batch_work();
                // Not `upgrade`: holding the last reference here would close the store on
                // this thread, after its owner believed it closed.
                while store.strong_count() > 0 {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    let Some(writes) = writes.upgrade() else {
                        break;
                    };
                    let applied = writes.applied();
                    let tables = match &mut round {
                        Round::Checkpoint(conn) => {
                            if let Err(e) =
                                conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                            {
                                tracing::warn!(error = %e, "wal checkpoint failed");
                            }
                            continue;
                        }
                        Round::Sync(tables) => tables,
                    };
                    if tables.failed {
                        continue;
                    }
                    match tables.sync() {
                        Ok(()) => writes.tables_durable(applied),
                        Err(e) => {
                            // A write-back error is reported once: a later sync that
                            // succeeds proves nothing about the pages that failed.
                            tables.failed = true;
                            tracing::error!(error = %e, "the tables could not be made durable: \
                                every journal segment is kept from now on (restart once the disk is sound; \
                                the journal is applied again at open)");
                        }
                    }
                }
            })
            .map_err(err)?;
        Ok(())
    }

    fn open_reader(&self) -> Result<Connection, StoreError> {
        #[cfg(test)]
        self.inner
            .readers_opened
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI;
        let conn = Connection::open_with_flags(&self.inner.path, flags).map_err(err)?;
        conn.pragma_update(None, "busy_timeout", 5000)
            .map_err(err)?;
        conn.pragma_update(None, "cache_size", -16_000)
            .map_err(err)?;
        // A statement per query and page size in use (see read.rs).
        conn.set_prepared_statement_cache_capacity(64);
        conn.pragma_update(None, "mmap_size", 268_435_456)
            .map_err(err)?;
        Ok(conn)
    }

    /// Runs the query `f` on a pooled read connection on the blocking pool, once the tables
    /// hold every batch acknowledged before the call and a query place is free
    /// ([`MAX_QUERIES_AT_ONCE`]).
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.read_placed(&self.inner.query_places, f).await
    }

    /// [`SqliteStore::read`] for a lookup of one row by its key, in the lookups' lane
    /// ([`MAX_LOOKUPS_AT_ONCE`]).
    async fn look_up<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.read_placed(&self.inner.lookup_places, f).await
    }

    async fn read_placed<T, F>(
        &self,
        places: &Arc<tokio::sync::Semaphore>,
        f: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.inner.writes.caught_up().await?;
        let place = places
            .clone()
            .acquire_owned()
            .await
            .expect("the read places are never closed");
        self.read_tables(Some(place), f).await
    }

    /// Runs `f` on a pooled read connection on the blocking pool, on the tables as they are,
    /// holding `place` until `f` has run: a caller that stops waiting (a client gone) does
    /// not give its query place back while its query still runs.
    async fn read_tables<T, F>(
        &self,
        place: Option<tokio::sync::OwnedSemaphorePermit>,
        f: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let _place = place;
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
            // The applier holds the writer through its transaction: it commits at once
            // while someone waits.
            let _waiting = applier::WaitingReader::new(&this.inner.writes);
            let mut conn = this.inner.writes.writer.lock().expect("writer lock");
            this.inner.writes.check_not_stopped()?;
            f(&mut conn).map_err(err)
        })
        .await
        .map_err(err)?
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn load(&self, mut needs: Needs) -> Result<Loaded, StoreError> {
        // From a read connection, so the next batch loads while the previous one commits,
        // and without the read barrier: waiting for the applier here would hold up every
        // decision behind its current transaction (tens of ms under load). Idempotency keys
        // of journaled batches the tables lack are answered from memory first (before the
        // tables are read), so a duplicate check never waits; for what else could miss a
        // journaled batch the pipeline calls `caught_up` first.
        let pending = self.inner.writes.dedupe_pending(&mut needs.dedupe);
        let mut loaded = self
            .read_tables(None, move |c| write::load(c, &needs))
            .await?;
        loaded.dedupe.extend(pending);
        Ok(loaded)
    }

    async fn caught_up(&self) -> Result<(), StoreError> {
        self.inner.writes.caught_up().await
    }

    async fn commit(&self, changes: Changes) -> Result<(), StoreError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let sent = match self
            .inner
            .journal
            .lock()
            .expect("journal thread lock")
            .as_ref()
        {
            Some((jobs, _)) => jobs.send((changes, reply)).is_ok(),
            None => false,
        };
        if !sent {
            return Err(StoreError::unavailable("the store is closed"));
        }
        answer
            .await
            .map_err(|_| StoreError::unavailable("the journal thread is gone"))?
    }

    async fn close(&self) {
        let inner = self.inner.clone();
        if tokio::task::spawn_blocking(move || inner.close())
            .await
            .is_err()
        {
            tracing::error!("closing the store failed");
        }
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
        self.look_up(move |c| read::meta_get(c, &key)).await
    }

    async fn meta_set(&self, key: &str, value: &str) -> Result<(), StoreError> {
        let (key, value) = (key.to_owned(), value.to_owned());
        self.write(move |c| write::meta_set(c, &key, &value))
            .await?;
        if self.inner.fsync {
            // Not in the journal (the token secret, the admin key): synced here, since the
            // tables' own commits are not.
            let path = self.inner.path.clone();
            tokio::task::spawn_blocking(move || sync_tables(&path))
                .await
                .map_err(err)??;
        }
        Ok(())
    }

    async fn user(&self, user: UserId) -> Result<Option<UserRecord>, StoreError> {
        self.look_up(move |c| read::user(c, user)).await
    }

    async fn membership(
        &self,
        conv: &ConversationId,
        user: UserId,
    ) -> Result<Option<Membership>, StoreError> {
        let conv = conv.clone();
        self.look_up(move |c| read::membership(c, &conv, user))
            .await
    }

    async fn conversation_exists(&self, conv: &ConversationId) -> Result<bool, StoreError> {
        let conv = conv.clone();
        self.look_up(move |c| read::conversation_exists(c, &conv))
            .await
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
        self.look_up(move |c| read::audited_message(c, msg_id))
            .await
    }

    async fn versions(&self, msg_id: MsgId) -> Result<Vec<VersionView>, StoreError> {
        self.read(move |c| read::versions(c, msg_id)).await
    }

    async fn is_hidden_for(&self, user: UserId, msg_id: MsgId) -> Result<bool, StoreError> {
        self.look_up(move |c| read::is_hidden_for(c, user, msg_id))
            .await
    }

    async fn inbox_head(&self, user: UserId) -> Result<u64, StoreError> {
        self.look_up(move |c| read::inbox_head(c, user)).await
    }

    async fn connect_state(&self, user: UserId) -> Result<(u64, Option<u64>), StoreError> {
        self.look_up(move |c| {
            let head = read::inbox_head(c, user)?;
            Ok((head, read::user(c, user)?.map(|u| u.token_gen)))
        })
        .await
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
        self.look_up(move |c| read::cursor(c, user, &device, &chain))
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

/// A fresh directory under the system's temp dir, for tests.
#[cfg(test)]
pub(crate) fn temp_dir(name: &str) -> PathBuf {
    // A count, beside the time: tests that start in the same nanosecond get their own.
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "pigeon-store-{name}-{}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
        MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The store port's suite, stamped onto this adapter (`pigeon_core::store_suite`).
#[cfg(test)]
mod store_suite {
    use super::*;

    /// A fresh store in a directory of its own, removed when it is dropped.
    struct Fresh {
        store: Option<SqliteStore>,
        dir: PathBuf,
    }

    impl std::ops::Deref for Fresh {
        type Target = SqliteStore;
        fn deref(&self) -> &SqliteStore {
            self.store.as_ref().expect("open")
        }
    }

    impl Drop for Fresh {
        fn drop(&mut self) {
            drop(self.store.take());
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    async fn fresh() -> Fresh {
        let dir = temp_dir("suite");
        let store = SqliteStore::open(&dir, Durability::Fsync).expect("a fresh store opens");
        Fresh {
            store: Some(store),
            dir,
        }
    }

    pigeon_core::store_suite!(fresh);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// While the tables cannot be written (another connection holds SQLite's write lock),
    /// a batch is still journaled and acknowledged, and reaches the tables once the lock is
    /// gone; once the journal's backlog is full, the next commit waits for room, then is
    /// refused as unavailable ("behind"), and nothing of it is stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_backlog_refuses_commits_and_a_journaled_batch_still_reaches_the_tables() {
        let dir = temp_dir("backlog");
        let store = SqliteStore::open_with(&dir, Durability::Fsync, 1024).unwrap();
        let db = dir.join("pigeon.db");
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let c = Connection::open(db).unwrap();
            c.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
            c.execute_batch("BEGIN IMMEDIATE").unwrap();
            locked_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            c.execute_batch("ROLLBACK").unwrap();
        });
        locked_rx.recv().unwrap();
        // The backlog was empty: journaled and acknowledged. Its record fills the KiB.
        let long = "a".repeat(2_000);
        store.commit(user_named(1, &long)).await.unwrap();
        let refused = store.commit(user_named(2, "b")).await.unwrap_err();
        assert!(
            matches!(&refused, StoreError::Unavailable(m) if m.contains("behind")),
            "{refused:?}"
        );
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(user_name(&store, 1).await, Some(long));
        assert_eq!(
            user_name(&store, 2).await,
            None,
            "the refused batch was not stored"
        );
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// SQLite's errors keep what they say of trying again: a constraint refused is a
    /// conflict, anything else unavailable; other errors are unavailable.
    #[test]
    fn store_errors_say_whether_to_try_again() {
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch("CREATE TABLE t (k INTEGER PRIMARY KEY); INSERT INTO t VALUES (1);")
            .unwrap();
        let taken = c.execute("INSERT INTO t VALUES (1)", []).unwrap_err();
        assert!(matches!(err(taken), StoreError::Conflict(_)));
        let no_table = c.execute("INSERT INTO missing VALUES (1)", []).unwrap_err();
        assert!(matches!(err(no_table), StoreError::Unavailable(_)));
        assert!(matches!(err("a full disk"), StoreError::Unavailable(_)));
    }

    async fn user_name(store: &SqliteStore, id: u64) -> Option<String> {
        let user = store.user(UserId::new(id).unwrap()).await.unwrap();
        user.map(|u| u.name)
    }

    /// The applied lsn the tables of the (closed) store in `dir` record.
    fn applied_lsn_in(dir: &Path) -> u64 {
        let c = Connection::open(dir.join("pigeon.db")).unwrap();
        applier::applied_lsn(&c).unwrap()
    }

    fn user_named(id: u64, name: &str) -> Changes {
        user_named_at(id, name, 1)
    }

    /// A batch that creates or renames user `id` at time `at`.
    fn user_named_at(id: u64, name: &str, at: i64) -> Changes {
        Changes {
            users: vec![(
                UserId::new(id).unwrap(),
                Some(name.into()),
                Some(String::new()),
                at,
            )],
            ..Changes::default()
        }
    }

    fn journal_segments(dir: &Path) -> usize {
        std::fs::read_dir(dir.join("journal"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "journal")
            })
            .count()
    }

    /// Commits a batch in one journal segment and a second in the next; waits until the
    /// tables hold both.
    async fn two_segments_applied(writes: &StoreWrites) {
        writes.commit(user_named(1, "a")).unwrap();
        writes.end_segment();
        writes.commit(user_named(2, "b")).unwrap();
        writes.caught_up().await.unwrap();
    }

    /// With durability `fsync` the tables' commits are not synced, so a batch they hold is
    /// not yet safe: its journal segment stays until they hold it durably. Without it
    /// (durability `os`), a segment goes once applied.
    #[tokio::test]
    async fn a_journal_segment_stays_until_the_tables_hold_its_batches_durably() {
        for keep_until_durable in [true, false] {
            let dir = temp_dir("durable");
            let mut writer = Connection::open(dir.join("pigeon.db")).unwrap();
            writer.pragma_update(None, "journal_mode", "WAL").unwrap();
            schema::migrate(&mut writer).unwrap();
            let (journal, _) = Journal::open(&dir.join("journal"), true, 0).unwrap();
            let writes = StoreWrites::new(
                writer,
                journal,
                0,
                DEFAULT_BACKLOG_BYTES,
                keep_until_durable,
            );
            let applier = {
                let w = writes.clone();
                std::thread::spawn(move || w.run_applier())
            };
            two_segments_applied(&writes).await;
            if keep_until_durable {
                std::thread::sleep(std::time::Duration::from_millis(50));
                assert_eq!(journal_segments(&dir), 2, "applied is not yet durable");
                writes.tables_durable(1);
                assert_eq!(journal_segments(&dir), 1);
            } else {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
                while journal_segments(&dir) > 1 && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                assert_eq!(journal_segments(&dir), 1, "applied is enough without fsync");
            }
            writes.close();
            applier.join().unwrap();
            writes.close_journal();
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    /// A checkpoint whose copy may not be durable (the database file's sync failed after
    /// SQLite copied the WAL into it) stops the tables: no transaction may start the WAL
    /// over and no connection may delete it as it closes, so the next open recovers it.
    #[tokio::test]
    async fn a_checkpoint_that_cannot_be_made_durable_stops_the_tables_and_keeps_the_wal() {
        let dir = temp_dir("ckpt-fails");
        let db = dir.join("pigeon.db");
        let mut writer = Connection::open(&db).unwrap();
        writer.pragma_update(None, "journal_mode", "WAL").unwrap();
        schema::migrate(&mut writer).unwrap();
        let (journal, _) = Journal::open(&dir.join("journal"), true, 0).unwrap();
        let writes = StoreWrites::new(writer, journal, 0, DEFAULT_BACKLOG_BYTES, true);
        let applier = {
            let w = writes.clone();
            std::thread::spawn(move || w.run_applier())
        };
        writes.commit(user_named(1, "a")).unwrap();
        // Not `caught_up`: a waiting reader would put the next checkpoint a second off.
        while writes.applied() < 1 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        table_files::test_failures::fail_syncs_of(&db);
        // The next transaction begins with a checkpoint once this long has passed since the
        // last one.
        std::thread::sleep(applier::CHECKPOINT_BEFORE_BEGIN + std::time::Duration::from_millis(50));
        writes.commit(user_named(2, "b")).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !applier.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(applier.is_finished(), "the applier stopped");
        assert_eq!(
            writes.applied(),
            1,
            "the second batch stays in the journal only"
        );
        let read = writes.caught_up().await.unwrap_err();
        assert!(read.message().contains("take no more writes"), "{read:?}");

        applier.join().unwrap();
        writes.close();
        writes.close_journal();
        drop(writes);
        let wal = table_files::wal_path(&db);
        assert!(
            std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0),
            "the writer closed without checkpointing the WAL away"
        );
        let users: i64 = Connection::open(&db)
            .unwrap()
            .query_row("SELECT count(*) FROM users", [], |r| r.get(0))
            .unwrap();
        assert_eq!(users, 1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Opening a store written before times followed seqs stamps its step backs forward
    /// (`schema::stamp_times_in_seq_order`), once.
    #[tokio::test]
    async fn opening_an_older_store_puts_its_times_in_seq_order() {
        let dir = temp_dir("times-in-order");
        drop(SqliteStore::open(&dir, Durability::Os).unwrap());
        {
            let c = Connection::open(dir.join("pigeon.db")).unwrap();
            c.execute("DELETE FROM meta WHERE key = 'created_at_in_seq_order'", [])
                .unwrap();
            for (id, seq, at) in [(1, 1, 500), (2, 2, 400), (3, 3, 600)] {
                c.execute(
                    "INSERT INTO messages (msg_id, conversation_id, seq, sender, kind, content, status, version, created_at) \
                     VALUES (?1, '1-2', ?2, 1, 'text', '', 'normal', 1, ?3)",
                    [id, seq, at],
                )
                .unwrap();
            }
        }
        drop(SqliteStore::open(&dir, Durability::Os).unwrap());
        let c = Connection::open(dir.join("pigeon.db")).unwrap();
        let times: Vec<i64> = c
            .prepare("SELECT created_at FROM messages ORDER BY seq")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(times, vec![500, 500, 600]);
    }

    /// Queries racing each other run [`MAX_QUERIES_AT_ONCE`] at a time: two hundred at once
    /// open no more read connections than that, where each used to take a blocking thread
    /// and a connection of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_queries_open_at_most_their_places_of_read_connections() {
        use std::sync::atomic::Ordering::Relaxed;
        let dir = temp_dir("query-places");
        let store = SqliteStore::open(&dir, Durability::Os).unwrap();
        let before = store.inner.readers_opened.load(Relaxed);
        let queries: Vec<_> = (1..=200)
            .map(|id| {
                let store = store.clone();
                // A query that takes a while, as a slow one would.
                tokio::spawn(async move {
                    store
                        .read(move |c| {
                            std::thread::sleep(std::time::Duration::from_millis(5));
                            read::user(c, UserId::new(id).unwrap())
                        })
                        .await
                })
            })
            .collect();
        for q in queries {
            assert!(q.await.unwrap().unwrap().is_none());
        }
        let opened = store.inner.readers_opened.load(Relaxed) - before;
        assert!(
            (1..=MAX_QUERIES_AT_ONCE).contains(&opened),
            "{opened} read connections for 200 racing queries"
        );
    }

    /// Lookups by key have a lane of their own: with every query place taken by slow
    /// queries and more queued, a user's lookup answers before any of them ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookups_do_not_wait_behind_slow_queries() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let dir = temp_dir("lookup-lane");
        let store = SqliteStore::open(&dir, Durability::Os).unwrap();
        let running = Arc::new(AtomicUsize::new(0));
        // The slow queries run until the gate opens, after the lookup has answered: a
        // lookup that waited for a query place would never answer.
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let slow: Vec<_> = (0..MAX_QUERIES_AT_ONCE + 2)
            .map(|_| {
                let (store, running, gate) = (store.clone(), running.clone(), gate.clone());
                tokio::spawn(async move {
                    store
                        .read(move |_| {
                            running.fetch_add(1, SeqCst);
                            let (open, opened) = &*gate;
                            let mut open = open.lock().unwrap();
                            while !*open {
                                open = opened.wait(open).unwrap();
                            }
                            Ok(())
                        })
                        .await
                })
            })
            .collect();
        while running.load(SeqCst) < MAX_QUERIES_AT_ONCE {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let looked_up = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            store.user(UserId::new(1).unwrap()),
        )
        .await;
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert!(
            looked_up
                .expect("the lookup waited for a query place")
                .unwrap()
                .is_none()
        );
        for q in slow {
            q.await.unwrap().unwrap();
        }
    }

    /// A query whose caller stops waiting keeps its place until it has run: callers that
    /// give up (clients gone) cannot start more than [`MAX_QUERIES_AT_ONCE`] at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn abandoned_queries_keep_their_places_until_they_end() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let dir = temp_dir("abandoned-queries");
        let store = SqliteStore::open(&dir, Durability::Os).unwrap();
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        for _ in 0..5 {
            let callers: Vec<_> = (0..20)
                .map(|_| {
                    let (store, running, most) = (store.clone(), running.clone(), most.clone());
                    tokio::spawn(async move {
                        store
                            .read(move |_| {
                                let now = running.fetch_add(1, SeqCst) + 1;
                                most.fetch_max(now, SeqCst);
                                std::thread::sleep(std::time::Duration::from_millis(20));
                                running.fetch_sub(1, SeqCst);
                                Ok(())
                            })
                            .await
                    })
                })
                .collect();
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            for caller in callers {
                caller.abort();
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while running.load(SeqCst) > 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let most = most.load(SeqCst);
        assert!(
            (1..=MAX_QUERIES_AT_ONCE).contains(&most),
            "{most} queries ran at once"
        );
    }

    /// The tables' threads of an open store run as batch work for the scheduler
    /// (`background.rs`): threads named like them exist, and they have that policy.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[tokio::test]
    async fn the_tables_threads_run_as_batch_work() {
        let dir = temp_dir("batch-work");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        // Other tests' stores run in this process too: each name must have a thread under
        // SCHED_BATCH (3) once this store's threads have started.
        for name in ["pigeon-apply", "pigeon-checkpoi"] {
            loop {
                let batch = std::fs::read_dir("/proc/self/task")
                    .unwrap()
                    .flatten()
                    .any(|t| {
                        let path = t.path();
                        std::fs::read_to_string(path.join("comm")).is_ok_and(|c| c.trim() == name)
                            && crate::background::policy_in(path.join("stat").to_str().unwrap())
                                == Some(libc::SCHED_BATCH as u32)
                    });
                if batch {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "no {name} thread under SCHED_BATCH"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
        drop(store);
    }

    /// The checkpointer syncs the tables and lets applied segments go, so that the journal
    /// of a store with durability `fsync` does not grow without end.
    #[tokio::test]
    async fn the_checkpointer_lets_segments_of_durable_batches_go() {
        let dir = temp_dir("checkpointer");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        two_segments_applied(&store.inner.writes).await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while journal_segments(&dir) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(journal_segments(&dir), 1);
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn a_read_right_after_a_commit_sees_it_though_the_tables_apply_later() {
        let dir = temp_dir("barrier");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        for i in 1..=20u64 {
            store.commit(user_named(i, &format!("u{i}"))).await.unwrap();
            // The applier waits up to a quarter second for more batches; the read must not
            // see the tables before it has applied this one.
            assert_eq!(user_name(&store, i).await, Some(format!("u{i}")));
        }
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// When a burst stops, the applier commits what it took APPLY_QUIET after the last
    /// batch, without a reader asking, not APPLY_DELAY after the first: a device that
    /// comes to catch up on the burst finds the tables current.
    #[tokio::test]
    async fn a_burst_that_stops_reaches_the_tables_without_a_reader_asking() {
        let dir = temp_dir("quiet");
        let store = SqliteStore::open(&dir, Durability::Os).unwrap();
        let mut id = 0;
        for round in 1..=3 {
            // A burst: more batches than QUIET_MIN_BATCHES, one after the other.
            for _ in 0..2 * applier::QUIET_MIN_BATCHES {
                id += 1;
                store
                    .commit(user_named(id, &format!("u{id}")))
                    .await
                    .unwrap();
            }
            let writes = &store.inner.writes;
            let logged = writes.logged();
            let started = std::time::Instant::now();
            // No read: nothing here asks the applier to hurry.
            while writes.applied() < logged {
                assert!(
                    started.elapsed() < applier::APPLY_DELAY / 2,
                    "round {round}: still not applied after {:?}",
                    started.elapsed()
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Commits go through the journal thread: what was committed before `close` is there at
    /// the next open; a commit after it is refused (not left waiting for a thread that left).
    #[tokio::test]
    async fn commits_before_close_last_and_a_commit_after_it_is_refused() {
        let dir = temp_dir("close");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        for i in 1..=5u64 {
            store.commit(user_named(i, &format!("u{i}"))).await.unwrap();
        }
        store.close().await;
        let late = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            store.commit(user_named(6, "late")),
        )
        .await
        .expect("answered, not left waiting");
        assert!(late.is_err(), "a commit after close is refused");
        drop(store);
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        for i in 1..=5u64 {
            assert_eq!(user_name(&store, i).await, Some(format!("u{i}")));
        }
        assert_eq!(user_name(&store, 6).await, None);
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A fresh database with the newest schema, and its directory (removed by the caller).
    fn migrated_db(name: &str) -> (PathBuf, Connection) {
        let dir = temp_dir(name);
        let mut c = Connection::open(dir.join("pigeon.db")).unwrap();
        schema::migrate(&mut c).unwrap();
        (dir, c)
    }

    /// Writes `batches` in one transaction, as the applier takes batches that come close.
    fn apply_together(c: &mut Connection, batches: &[&Changes]) {
        let tx = c.transaction().unwrap();
        write::apply(&tx, batches).unwrap();
        tx.commit().unwrap();
    }

    #[test]
    fn a_user_created_and_renamed_in_one_apply_keeps_its_creation_time() {
        let (dir, mut c) = migrated_db("rename");
        // Both batches in one transaction, as the applier takes them when they come close.
        apply_together(
            &mut c,
            &[
                &user_named_at(1, "first", 10),
                &user_named_at(1, "second", 20),
            ],
        );
        let row: (String, i64, i64) = c
            .query_row(
                "SELECT name, created_at, updated_at FROM users WHERE user_id = 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!(row, ("second".to_string(), 10, 20));
        drop(c);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn batches_in_the_journal_but_not_in_the_tables_are_applied_at_open() {
        let dir = temp_dir("replay");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        store.commit(user_named(1, "applied")).await.unwrap();
        drop(store);
        // A crash between the journal and the tables: records the tables never got.
        let applied = applied_lsn_in(&dir);
        assert_eq!(applied, 1, "closing applied what was queued");
        {
            let (mut journal, pending) =
                Journal::open(&dir.join("journal"), true, applied).unwrap();
            assert!(pending.is_empty());
            // One record as earlier versions wrote them (JSON), one as this one does.
            let old = serde_json::to_vec(&user_named(2, "journaled")).unwrap();
            journal.append(&old).unwrap();
            let mut record = crate::journal::RecordBuf::default();
            crate::record::encode(&user_named(1, "renamed"), &mut record).unwrap();
            journal.append_record(&mut record).unwrap();
        }
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        assert_eq!(user_name(&store, 2).await.as_deref(), Some("journaled"));
        assert_eq!(
            user_name(&store, 1).await.as_deref(),
            Some("renamed"),
            "applied in order"
        );
        // New batches follow the replayed ones, and a second open replays nothing twice: a
        // logout (which adds one to the generation) is counted once.
        store.commit(user_named(3, "after")).await.unwrap();
        let logout = Changes {
            logouts: vec![UserId::new(3).unwrap()],
            ..Changes::default()
        };
        store.commit(logout).await.unwrap();
        drop(store);
        assert_eq!(applied_lsn_in(&dir), 5);
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        let user = store.user(UserId::new(3).unwrap()).await.unwrap().unwrap();
        assert_eq!((user.name.as_str(), user.token_gen), ("after", 1));
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn a_batch_the_tables_refuse_is_set_aside_and_later_ones_still_apply() {
        let dir = temp_dir("refused");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        let message = |seq| Message {
            msg_id: MsgId::new(5).unwrap(),
            conversation_id: "1-2".into(),
            seq,
            sender: UserId::new(1).unwrap(),
            client_msg_id: None,
            kind: pigeon_proto::MessageKind::Text,
            content: "x".into(),
            extra: serde_json::Value::Null,
            reply_to: None,
            mentions: Vec::new(),
            status: pigeon_proto::MessageStatus::Normal,
            version: 1,
            created_at: 1,
            edited_at: None,
        };
        let mut first = user_named(1, "one");
        first.messages.push(message(1));
        // The same msg_id again: the tables refuse this batch whatever is tried.
        let mut second = user_named(2, "two");
        second.messages.push(message(2));
        store.commit(first).await.unwrap();
        // A step later: `first` is already written into the open transaction when
        // `second` fails it, and must not be lost when it is rolled back.
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        store.commit(second).await.unwrap();
        store.commit(user_named(3, "three")).await.unwrap();
        assert_eq!(user_name(&store, 1).await.as_deref(), Some("one"));
        assert_eq!(
            user_name(&store, 2).await,
            None,
            "the refused batch is not half applied"
        );
        assert_eq!(user_name(&store, 3).await.as_deref(), Some("three"));
        let kept = dir.join("journal").join(format!("rejected-{:020}.json", 2));
        let back: Changes = serde_json::from_slice(&std::fs::read(kept).unwrap()).unwrap();
        assert_eq!(back.users[0].1.as_deref(), Some("two"));
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// The applier writes rows as batches come (every `APPLY_STEP`) but a conversation's
    /// row once, at the commit: the row the tables keep is the last batch's, whichever
    /// step each batch came in.
    #[tokio::test]
    async fn batches_applied_in_steps_leave_the_last_conversation_row() {
        let dir = temp_dir("steps");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        let conv = |seq: u64| Changes {
            conversations: vec![pigeon_core::changes::ConversationRow {
                id: ConversationId::parse("g9").unwrap(),
                is_group: true,
                seq,
                member_count: 1,
                fanout: pigeon_proto::views::Fanout::Write,
                name: Some(format!("v{seq}")),
                notice: None,
                avatar: None,
                owner: None,
                dismissed: false,
                last_msg_id: None,
                read_fanout_since: None,
                created_at: 1,
                updated_at: seq as i64,
            }],
            ..user_named(seq, &format!("u{seq}"))
        };
        for seq in 1..=6 {
            store.commit(conv(seq)).await.unwrap();
            // Some batches come in later steps of the same transaction, some in the same.
            if seq % 2 == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(25)).await;
            }
        }
        // Every step's rows are there, not only the last step's.
        for seq in 1..=6 {
            assert_eq!(user_name(&store, seq).await, Some(format!("u{seq}")));
        }
        drop(store);
        let c = Connection::open(dir.join("pigeon.db")).unwrap();
        let row: (i64, String) = c
            .query_row(
                "SELECT seq, name FROM conversations WHERE conversation_id = 'g9'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(row, (6, "v6".to_string()));
        drop(c);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// An ack of a conversation the engine did not have at hand is saved for a member no
    /// further than the newest stored message, for a former member no further than their
    /// removal, for anyone else not at all; and, like every cursor, never moved back.
    #[tokio::test]
    async fn member_cursors_are_clamped_and_saved_only_for_members() {
        let dir = temp_dir("member-cursors");
        drop(SqliteStore::open(&dir, Durability::Os).unwrap());
        let c = Connection::open(dir.join("pigeon.db")).unwrap();
        for seq in 1..=5 {
            c.execute(
                "INSERT INTO messages (msg_id, conversation_id, seq, sender, kind, content, \
                 status, version, created_at) VALUES (?1, 'g7', ?2, 1, 'text', 'x', 'normal', 1, 0)",
                rusqlite::params![100 + seq, seq],
            )
            .unwrap();
        }
        for (user, left_seq) in [(1, None), (2, Some(3))] {
            c.execute(
                "INSERT INTO members (conversation_id, user_id, role, joined_seq, joined_at, \
                 left_seq, last_read_seq) VALUES ('g7', ?1, 'member', 1, 0, ?2, 0)",
                rusqlite::params![user, left_seq],
            )
            .unwrap();
        }
        drop(c);
        let store = SqliteStore::open(&dir, Durability::Os).unwrap();
        let u = |id| UserId::new(id).unwrap();
        let d = pigeon_proto::DeviceId::parse("d").unwrap();
        let g7 = ConversationId::parse("g7").unwrap();
        let acks = |list: Vec<(u64, &ConversationId, u64)>| Changes {
            member_cursors: list
                .into_iter()
                .map(|(user, conv, seq)| (u(user), d.clone(), conv.clone(), seq))
                .collect(),
            ..Changes::default()
        };
        let g8 = ConversationId::parse("g8").unwrap();
        store
            .commit(acks(vec![
                (1, &g7, 100),
                (2, &g7, 100),
                (3, &g7, 4),
                (1, &g8, 4),
            ]))
            .await
            .unwrap();
        store.commit(acks(vec![(1, &g7, 2)])).await.unwrap();
        let saved = |user, chain: &'static str| {
            let store = &store;
            async move { store.cursor(u(user), "d", chain).await.unwrap() }
        };
        assert_eq!(
            saved(1, "g7").await,
            5,
            "a member: up to the newest message"
        );
        assert_eq!(
            saved(2, "g7").await,
            3,
            "a former member: up to the removal"
        );
        assert_eq!(saved(3, "g7").await, 0, "not a member: nothing saved");
        assert_eq!(
            saved(1, "g8").await,
            0,
            "no such conversation: nothing saved"
        );
        let c = Connection::open(dir.join("pigeon.db")).unwrap();
        let rows: i64 = c
            .query_row("SELECT count(*) FROM cursors", [], |r| r.get(0))
            .unwrap();
        assert_eq!(rows, 2, "no row for the others");
        drop((c, store));

        // In one chunk of batches the applier writes table by table: an ack is clamped to
        // what came before it, never to a message of a later batch of the chunk, which the
        // device cannot have had (it would skip it when it resumes).
        let message = |seq: u64| Changes {
            messages: vec![pigeon_proto::Message {
                msg_id: pigeon_proto::MsgId::new(200 + seq).unwrap(),
                conversation_id: "g7".into(),
                seq,
                sender: u(1),
                client_msg_id: None,
                kind: pigeon_proto::MessageKind::Text,
                content: "x".into(),
                extra: serde_json::Value::Null,
                reply_to: None,
                mentions: vec![],
                status: pigeon_proto::MessageStatus::Normal,
                version: 1,
                created_at: 0,
                edited_at: None,
            }],
            ..Changes::default()
        };
        let ack = |device: &str| Changes {
            member_cursors: vec![(
                u(1),
                pigeon_proto::DeviceId::parse(device).unwrap(),
                g7.clone(),
                100,
            )],
            ..Changes::default()
        };
        let mut c = Connection::open(dir.join("pigeon.db")).unwrap();
        let tx = c.transaction().unwrap();
        write::apply_rows(
            &tx,
            &[&ack("early"), &message(6), &ack("late"), &message(7)],
        )
        .unwrap();
        tx.commit().unwrap();
        let cursor = |device: &str| read::cursor(&c, u(1), device, "g7").unwrap();
        assert_eq!(cursor("early"), 5, "before the chunk's messages");
        assert_eq!(cursor("late"), 6, "after the chunk's seq 6, before its 7");
        drop(c);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Under a steady stream of batches each transaction begins right after the last
    /// commit; the applier checkpoints first, so SQLite writes the WAL from its start again
    /// instead of growing it by every transaction (to 160 MB under load).
    #[tokio::test]
    async fn a_steady_stream_of_batches_reuses_the_wal() {
        let dir = temp_dir("wal-reuse");
        let store = SqliteStore::open(&dir, Durability::Os).unwrap();
        let started = std::time::Instant::now();
        let mut id = 0u64;
        // Long enough for several transactions of a quarter second each.
        while started.elapsed() < std::time::Duration::from_millis(2500) {
            let mut batch = Changes::default();
            for _ in 0..50 {
                id += 1;
                batch.users.push((
                    UserId::new(id).unwrap(),
                    Some(format!("user {id} {}", "x".repeat(100))),
                    Some(String::new()),
                    1,
                ));
            }
            store.commit(batch).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        let size = |name: &str| std::fs::metadata(dir.join(name)).unwrap().len();
        let (wal, db) = (size("pigeon.db-wal"), size("pigeon.db"));
        assert!(
            wal < db / 2,
            "the WAL ({wal} bytes) grew with every transaction; the tables hold {db} bytes ({id} users)"
        );
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Writers, readers and settings writes racing for the applier's open transaction:
    /// every read sees every batch committed before it began (read your writes), through
    /// reads that cut transactions short, steps, checkpoints between transactions and
    /// settings writes that take the writer connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_writers_readers_and_settings_each_read_their_writes() {
        let dir = temp_dir("race");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_millis(1500);
        let mut tasks = Vec::new();
        for w in 0..4u64 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while std::time::Instant::now() < until {
                    n += 1;
                    let id = w * 1_000_000 + n;
                    store
                        .commit(user_named(id, &format!("w{w}-{n}")))
                        .await
                        .unwrap();
                    // Read back at once only sometimes: the rest go in later steps.
                    if n.is_multiple_of(3) {
                        assert_eq!(user_name(&store, id).await, Some(format!("w{w}-{n}")));
                    }
                    if n.is_multiple_of(7) {
                        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
                    }
                }
                n
            }));
        }
        let settings = {
            let store = store.clone();
            tokio::spawn(async move {
                let mut k = 0;
                while std::time::Instant::now() < until {
                    k += 1;
                    store.meta_set("race", &k.to_string()).await.unwrap();
                    assert_eq!(store.meta_get("race").await.unwrap(), Some(k.to_string()));
                    tokio::time::sleep(std::time::Duration::from_millis(40)).await;
                }
                k
            })
        };
        let mut written = Vec::new();
        for t in tasks {
            written.push(t.await.unwrap());
        }
        let k = settings.await.unwrap();
        drop(store);
        // Everything is there after a reopen, nothing twice (the ids are a primary key).
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        for (w, n) in written.iter().enumerate() {
            let w = w as u64;
            assert!(*n > 10, "writer {w} wrote {n} batches");
            for i in [1, n / 2, *n] {
                assert_eq!(
                    user_name(&store, w * 1_000_000 + i).await,
                    Some(format!("w{w}-{i}"))
                );
            }
        }
        assert_eq!(store.meta_get("race").await.unwrap(), Some(k.to_string()));
        drop(store);
        let c = Connection::open(dir.join("pigeon.db")).unwrap();
        let users: u64 = c
            .query_row("SELECT count(*) FROM users", [], |r| r.get::<_, i64>(0))
            .unwrap() as u64;
        assert_eq!(users, written.iter().sum::<u64>());
        drop(c);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A setting written while the applier's transaction is open (it holds the writer
    /// connection while its transaction is open) is written, and so is the batch before it, durably.
    #[tokio::test]
    async fn a_setting_written_while_a_transaction_is_open_lands_with_it() {
        let dir = temp_dir("meta-during-apply");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        for round in 1..=3u64 {
            store
                .commit(user_named(round, &format!("u{round}")))
                .await
                .unwrap();
            // Right after the commit the applier's transaction is open (for up to 250 ms):
            // the write is not left waiting for that, nor for ever.
            tokio::time::timeout(
                std::time::Duration::from_secs(2),
                store.meta_set("k", &format!("v{round}")),
            )
            .await
            .expect("the settings write does not wait behind the open transaction")
            .unwrap();
            assert_eq!(
                store.meta_get("k").await.unwrap().as_deref(),
                Some(format!("v{round}").as_str())
            );
        }
        drop(store);
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        assert_eq!(store.meta_get("k").await.unwrap().as_deref(), Some("v3"));
        for i in 1..=3u64 {
            assert_eq!(user_name(&store, i).await, Some(format!("u{i}")));
        }
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A duplicate check answers for a batch that is journaled but not in the tables yet
    /// without waiting for the applier (held off the tables here), and from the tables
    /// once they hold it.
    #[tokio::test]
    #[allow(clippy::await_holding_lock)] // one thread; holding the writer is the point
    async fn a_duplicate_check_sees_a_journaled_key_without_waiting_for_the_tables() {
        use pigeon_core::store::Needs;
        use pigeon_proto::{ClientMsgId, MessageKind, MessageStatus};
        let dir = temp_dir("pending-keys");
        let store = SqliteStore::open(&dir, Durability::Fsync).unwrap();
        let u = UserId::new(7).unwrap();
        let msg = MsgId::new(99).unwrap();
        // Besides "k1", more keys than the applier forgets per turn of the lock.
        let messages = (0..601u64)
            .map(|i| Message {
                msg_id: MsgId::new(99 + i).unwrap(),
                conversation_id: "g42".into(),
                seq: 3 + i,
                sender: u,
                client_msg_id: Some(if i == 0 {
                    "k1".into()
                } else {
                    format!("more-{i}")
                }),
                kind: MessageKind::Text,
                content: "hi".into(),
                extra: serde_json::Value::Null,
                reply_to: None,
                mentions: vec![],
                status: MessageStatus::Normal,
                version: 1,
                created_at: 10,
                edited_at: None,
            })
            .collect();
        let changes = Changes {
            messages,
            ..Changes::default()
        };
        let key = (u, ClientMsgId::parse("k1").unwrap());
        let asking = |k: &(UserId, ClientMsgId)| Needs {
            dedupe: [k.clone()].into(),
            ..Needs::default()
        };
        async fn answered(store: &SqliteStore, needs: Needs) -> pigeon_core::store::Loaded {
            tokio::time::timeout(std::time::Duration::from_secs(5), store.load(needs))
                .await
                .expect("answered without the applier")
                .unwrap()
        }
        {
            let _tables = store.inner.writes.writer.lock().unwrap();
            store.commit(changes).await.unwrap();
            let loaded = answered(&store, asking(&key)).await;
            let ack = &loaded.dedupe[&key];
            assert_eq!(
                (ack.msg_id, ack.seq, ack.conversation_id.as_str()),
                (msg, 3, "g42")
            );
            assert!(ack.duplicate);
            assert_eq!(store.inner.writes.pending_key_count(), 601);
            let never_sent = (u, ClientMsgId::parse("k2").unwrap());
            assert!(
                answered(&store, asking(&never_sent))
                    .await
                    .dedupe
                    .is_empty()
            );
        }
        store.caught_up().await.unwrap();
        assert_eq!(
            store.inner.writes.pending_key_count(),
            0,
            "forgotten once applied"
        );
        assert_eq!(
            answered(&store, asking(&key)).await.dedupe[&key].msg_id,
            msg
        );
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_registration_that_leaves_a_field_out_keeps_it() {
        let (dir, mut c) = migrated_db("partial-user");
        let u = UserId::new(1).unwrap();
        apply_together(
            &mut c,
            &[
                &user_named_at(1, "ann", 10),
                &Changes {
                    users: vec![(u, None, Some("a.png".into()), 20)],
                    ..Changes::default()
                },
                &Changes {
                    users: vec![(UserId::new(2).unwrap(), None, None, 30)],
                    ..Changes::default()
                },
            ],
        );
        let row = |id: i64| -> (String, String) {
            c.query_row(
                "SELECT name, avatar FROM users WHERE user_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
        };
        assert_eq!(row(1), ("ann".to_string(), "a.png".to_string()));
        assert_eq!(row(2), (String::new(), String::new()));
        drop(c);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// An edit and a deletion for everyone that the applier takes in one transaction: the
    /// deletion wipes the versions the edit wrote (they are inserted before the updates).
    #[test]
    fn a_deletion_wipes_what_an_edit_in_the_same_apply_wrote() {
        use pigeon_core::changes::MessageUpdate;
        use pigeon_proto::{MessageKind, MessageStatus};
        let (dir, mut c) = migrated_db("wipe");
        let u = UserId::new(7).unwrap();
        let msg = MsgId::new(99).unwrap();
        let sent = Changes {
            messages: vec![Message {
                msg_id: msg,
                conversation_id: "g42".into(),
                seq: 1,
                sender: u,
                client_msg_id: None,
                kind: MessageKind::Text,
                content: "first".into(),
                extra: serde_json::json!({"card": 1}),
                reply_to: None,
                mentions: vec![8],
                status: MessageStatus::Normal,
                version: 1,
                created_at: 10,
                edited_at: None,
            }],
            ..Changes::default()
        };
        let update = |status, version, content: &str| MessageUpdate {
            msg_id: msg,
            status,
            version,
            content: Some(content.into()),
            edited_at: Some(11),
            recalled: None,
        };
        let edited = Changes {
            message_updates: vec![update(MessageStatus::Normal, 2, "second")],
            versions: vec![(msg, 1, "first".into(), 10), (msg, 2, "second".into(), 11)],
            ..Changes::default()
        };
        let deleted = Changes {
            message_updates: vec![update(MessageStatus::Deleted, 2, "")],
            ..Changes::default()
        };
        apply_together(&mut c, &[&sent, &edited, &deleted]);
        let row: (String, String, Option<String>, Option<String>) = c
            .query_row(
                "SELECT status, content, extra, mentions FROM messages WHERE msg_id = 99",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(row, ("deleted".to_string(), String::new(), None, None));
        let versions: Vec<String> = c
            .prepare("SELECT content FROM message_versions WHERE msg_id = 99 ORDER BY version")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(versions, vec![String::new(), String::new()]);
        drop(c);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A journal record written by the previous version (a user's name and avatar always
    /// both given; a deletion that did not yet say what it wipes) applies as it did, and
    /// the deletion wipes what it must: journal records outlive the binary that wrote them.
    #[test]
    fn a_journal_record_of_the_previous_version_applies_the_same() {
        let (dir, mut c) = migrated_db("old-record");
        c.execute_batch(
            "INSERT INTO users (user_id, name, avatar, token_gen, created_at, updated_at) VALUES (1, 'old', 'o.png', 0, 1, 1);
             INSERT INTO messages (msg_id, conversation_id, seq, sender, kind, content, extra, mentions, status, version, created_at)
                 VALUES (99, 'g42', 1, 1, 'custom', 'x', '{\"card\":1}', '[1]', 'normal', 1, 10);
             INSERT INTO message_versions (msg_id, version, content, at) VALUES (99, 1, 'x', 10);",
        )
        .unwrap();
        let old = r#"{"users":[[1,"n","a",5]],"logouts":[],"conversations":[],"messages":[],"inbox":[],
            "members":[],"message_updates":[{"msg_id":"99","status":"deleted","version":1,"content":"","edited_at":null,"recalled":null}],
            "versions":[],"hidden_messages":[],"cursors":[]}"#;
        let changes = crate::record::decode(old.as_bytes()).unwrap();
        apply_together(&mut c, &[&changes]);
        let user: (String, String) = c
            .query_row(
                "SELECT name, avatar FROM users WHERE user_id = 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(user, ("n".to_string(), "a".to_string()));
        let msg: (String, String, Option<String>, Option<String>, String) = c
            .query_row(
                "SELECT m.status, m.content, m.extra, m.mentions, v.content FROM messages m \
                 JOIN message_versions v ON v.msg_id = m.msg_id WHERE m.msg_id = 99",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .unwrap();
        assert_eq!(
            msg,
            (
                "deleted".to_string(),
                String::new(),
                None,
                None,
                String::new()
            )
        );
        drop(c);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_batch_survives_the_journal_encoding_whole() {
        use pigeon_core::changes::{ConversationRow, InboxRow, MemberRow, MessageUpdate};
        use pigeon_core::state::MemberState;
        use pigeon_proto::views::{Fanout, Role};
        use pigeon_proto::{DeviceId, MessageKind, MessageStatus};
        let u = UserId::new(7).unwrap();
        let conv = ConversationId::parse("g42").unwrap();
        let msg = MsgId::new(99).unwrap();
        let mut changes = Changes {
            users: vec![(u, Some("n".into()), Some("a".into()), 5)],
            logouts: vec![u],
            conversations: vec![ConversationRow {
                id: conv.clone(),
                is_group: true,
                seq: 3,
                member_count: 2,
                fanout: Fanout::Read,
                name: Some("g".into()),
                notice: None,
                avatar: Some("x".into()),
                owner: Some(u),
                dismissed: false,
                last_msg_id: Some(msg),
                read_fanout_since: Some(2),
                created_at: 1,
                updated_at: 2,
            }],
            messages: vec![Message {
                msg_id: msg,
                conversation_id: conv.as_str().into(),
                seq: 3,
                sender: u,
                client_msg_id: Some("k\u{e9}\"y".into()),
                kind: MessageKind::Text,
                content: "hi\n\u{1f426}".into(),
                extra: serde_json::json!({"a": [1, 2]}),
                reply_to: Some(msg),
                mentions: vec![7],
                status: MessageStatus::Normal,
                version: 2,
                created_at: 10,
                edited_at: Some(11),
            }],
            inbox: vec![InboxRow {
                user: u,
                user_seq: 4,
                msg_id: msg,
            }],
            members: HashMap::new(),
            message_updates: vec![MessageUpdate {
                msg_id: msg,
                status: MessageStatus::Recalled,
                version: 3,
                content: None,
                edited_at: None,
                recalled: Some((12, u)),
            }],
            versions: vec![(msg, 1, "old".into(), 9)],
            hidden_messages: vec![(u, msg)],
            cursors: vec![(u, DeviceId::parse("d1").unwrap(), "inbox".into(), 4)],
            member_cursors: vec![(u, DeviceId::parse("d1").unwrap(), conv.clone(), 5)],
        };
        changes.members.insert(
            (conv.clone(), u),
            MemberRow {
                conversation: conv.clone(),
                user: u,
                state: MemberState {
                    mute_until: Some(9),
                    hidden_seq: Some(2),
                    ..MemberState::joined(Role::Owner, 1, 3, 5)
                },
                left_seq: Some(3),
            },
        );
        let mut record = crate::journal::RecordBuf::default();
        crate::record::encode(&changes, &mut record).unwrap();
        let back = crate::record::decode(record.payload()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{changes:?}"));
        // An array of the batch's fields (a fixarray: 0x90 + 11), never a JSON object's `{`.
        assert_eq!(record.payload()[0], 0x90 + 11);
        // A set-aside batch is written as JSON, and older records are JSON: both read back.
        let json = serde_json::to_vec(&changes).unwrap();
        let back = crate::record::decode(&json).unwrap();
        assert_eq!(format!("{back:?}"), format!("{changes:?}"));
        assert!(
            record.payload().len() * 2 < json.len(),
            "positional: {} bytes against JSON's {}",
            record.payload().len(),
            json.len()
        );
        // Every option absent: a field its type skipped when empty would shift the rest.
        let c = &mut changes.conversations[0];
        (
            c.name,
            c.avatar,
            c.owner,
            c.last_msg_id,
            c.read_fanout_since,
        ) = (None, None, None, None, None);
        let m = &mut changes.messages[0];
        (m.client_msg_id, m.reply_to, m.edited_at) = (None, None, None);
        (m.extra, m.mentions) = (serde_json::Value::Null, Vec::new());
        changes.users[0].1 = None;
        changes.message_updates[0].recalled = None;
        changes.member_cursors.clear();
        for row in changes.members.values_mut() {
            row.left_seq = None;
            (row.state.mute_until, row.state.hidden_seq) = (None, None);
        }
        let mut record = crate::journal::RecordBuf::default();
        crate::record::encode(&changes, &mut record).unwrap();
        let back = crate::record::decode(record.payload()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{changes:?}"));
    }

    /// A field added at the end of a record's struct (with `#[serde(default)]`) reads
    /// records written before it: their array is one shorter.
    #[test]
    fn a_record_written_before_a_trailing_field_existed_still_decodes() {
        #[derive(serde::Serialize)]
        struct Before {
            users: Vec<(UserId, Option<String>, Option<String>, i64)>,
            logouts: Vec<UserId>,
            conversations: Vec<()>,
            messages: Vec<()>,
            inbox: Vec<()>,
            members: Vec<()>,
            message_updates: Vec<()>,
            versions: Vec<()>,
            hidden_messages: Vec<()>,
            cursors: Vec<()>,
        }
        let before = Before {
            users: user_named(4, "four").users,
            logouts: Vec::new(),
            conversations: Vec::new(),
            messages: Vec::new(),
            inbox: Vec::new(),
            members: Vec::new(),
            message_updates: Vec::new(),
            versions: Vec::new(),
            hidden_messages: Vec::new(),
            cursors: Vec::new(),
        };
        let bytes = rmp_serde::to_vec(&before).unwrap();
        let back = crate::record::decode(&bytes).unwrap();
        assert_eq!(back.users, before.users);
        assert!(back.member_cursors.is_empty());
    }
}

//! The write side after the journal: batches that are durable in the journal wait here until
//! one thread applies them to the SQLite tables, many in one transaction, so that a page
//! touched by many batches is written once. Readers wait until the tables hold every batch
//! acknowledged before they started (`StoreWrites::caught_up`), so nobody reads around the
//! journal.

use crate::err;
use crate::journal::{Journal, RecordBuf};
use crate::table_files::{TableFile, TableFiles};
use crate::write;
use pigeon_core::changes::Changes;
use pigeon_core::store::StoreError;
use pigeon_proto::views::SendAck;
use pigeon_proto::{ClientMsgId, MsgId, UserId};
use rusqlite::Connection;
use rusqlite::config::DbConfig;
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Most batches applied in one transaction (a longer one holds up readers waiting for the
/// tables, `meta_set`, and commits waiting for backlog room).
const MAX_APPLY_BATCHES: usize = 512;
/// How long a journaled batch may wait for the tables while nobody reads. Waiting is the
/// point: a transaction writes each B-tree page it touched once, so a page shared by the
/// batches of a quarter second (a conversation's index leaf, a user's inbox leaf) is written
/// once instead of once per batch. A reader that finds the tables behind has them applied
/// at once.
pub(crate) const APPLY_DELAY: Duration = Duration::from_millis(250);
/// How long an open transaction of at least [`QUIET_MIN_BATCHES`] batches (or
/// [`QUIET_MIN_BYTES`]) waits for more once none are queued after its last step: when a
/// burst ends, its rows are committed this long after the last batch taken, not
/// [`APPLY_DELAY`] after the first, so a reader who comes a little later (a device catching
/// up on the burst) finds the tables current instead of waiting for the commit. Under a
/// heavy load batches come every millisecond or two, and a light one never fills a
/// transaction that large, so neither commits more often (a small transaction makes a
/// reader wait for little anyway).
const APPLY_QUIET: Duration = Duration::from_millis(5);
/// Batches a transaction must hold before a quiet spell commits it (see [`APPLY_QUIET`]).
pub(crate) const QUIET_MIN_BATCHES: usize = 32;
/// Or bytes of batches: a burst's last transaction, begun after a full one
/// ([`APPLY_BYTES`]), may hold only a few large batches.
const QUIET_MIN_BYTES: usize = 256 << 10;
/// Bytes of batches in the open transaction past which it commits without waiting for
/// [`APPLY_DELAY`].
const APPLY_BYTES: usize = 8 << 20;
/// How often an open transaction takes in the batches queued since: their rows are written
/// as they come, so a reader who finds the tables behind waits for the last step's batches
/// and the commit, not for a quarter second's rows (45 ms for a burst of 10 000 messages,
/// when the whole transaction was written after the wait).
const APPLY_STEP: Duration = Duration::from_millis(10);
/// How often the applier checkpoints the WAL itself, before it begins a transaction (see
/// `run_applier`); the checkpointer thread syncs the tables every 100 ms.
pub(crate) const CHECKPOINT_BEFORE_BEGIN: Duration = Duration::from_millis(100);
/// The same after a transaction a reader cut short.
const CHECKPOINT_AFTER_A_READ: Duration = Duration::from_secs(1);
/// The longest the applier goes without a checkpoint while batches come, readers waiting
/// or not.
const CHECKPOINT_AT_LEAST: Duration = Duration::from_secs(2);
/// How long a commit waits for room in the backlog, and a reader for the tables to catch
/// up, before it answers that the store is unavailable.
pub const WAIT_LIMIT: Duration = Duration::from_secs(5);
/// The pause before an apply that failed is tried again.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// The meta key holding the last lsn the tables hold (written in the same transaction).
pub const APPLIED_KEY: &str = "journal_applied_lsn";

#[derive(Default)]
struct Backlog {
    queue: VecDeque<(u64, Changes, usize)>,
    /// Bytes of every batch not yet applied, including the ones being applied now.
    bytes: usize,
    /// When the oldest queued batch was queued.
    oldest: Option<Instant>,
    closed: bool,
}

/// Everything the committer, the applier thread and the readers share.
pub struct StoreWrites {
    pub writer: Mutex<Connection>,
    /// `None` once closed: the journal's directory lock is released with it.
    journal: Mutex<Option<Journal>>,
    /// The buffer each batch is encoded into (taken before `journal`).
    record: Mutex<RecordBuf>,
    /// Where refused batches are set aside (the journal's directory).
    journal_dir: PathBuf,
    backlog: Mutex<Backlog>,
    /// Signalled when the backlog grows or closes (the applier waits on it).
    more: Condvar,
    /// Signalled when the backlog shrinks (a commit waiting for room waits on it).
    room: Condvar,
    logged: AtomicU64,
    /// Readers waiting in [`StoreWrites::caught_up`]: while there are any, the applier does
    /// not wait for more batches.
    readers_waiting: AtomicUsize,
    applied: watch::Sender<u64>,
    /// With durability `fsync`: the tables' transactions are not fsynced when they commit
    /// (`synchronous=NORMAL`), so a journal segment is deleted only once the tables hold its
    /// batches durably ([`StoreWrites::tables_durable`], told by the checkpointer after it
    /// synced the tables' files), not as soon as they are applied.
    keep_until_durable: bool,
    /// The newest lsn the tables hold durably (only kept with `keep_until_durable`).
    durable: AtomicU64,
    /// Journaled but unapplied payload bytes past which a commit waits for the applier.
    max_backlog_bytes: usize,
    /// The idempotency keys of journaled batches the tables do not hold yet, with where
    /// their messages went: a duplicate check answers from here and from the tables as they
    /// are, instead of waiting for the applier's transaction (see [`StoreWrites::dedupe_pending`]).
    pending_keys: Mutex<HashMap<(u64, String), PendingKey>>,
    /// A checkpoint's copy could not be made durable: the tables take no more writes
    /// ([`StoreWrites::stop_tables`]).
    stopped: AtomicBool,
}

/// Where an idempotency key's message went: msg id, conversation, seq, created at.
type PendingKey = (MsgId, String, u64, i64);
/// Capacity the empty pending-keys table keeps (a steady load's transaction holds fewer).
const PENDING_KEYS_KEEP_CAPACITY: usize = 1 << 16;

impl StoreWrites {
    /// `applied` is the newest lsn the tables hold, durably: the caller synced them.
    pub fn new(
        writer: Connection,
        journal: Journal,
        applied: u64,
        max_backlog_bytes: usize,
        keep_until_durable: bool,
    ) -> Arc<Self> {
        Arc::new(StoreWrites {
            journal_dir: journal.dir().to_path_buf(),
            writer: Mutex::new(writer),
            journal: Mutex::new(Some(journal)),
            record: Mutex::new(RecordBuf::default()),
            backlog: Mutex::new(Backlog::default()),
            more: Condvar::new(),
            room: Condvar::new(),
            logged: AtomicU64::new(applied),
            readers_waiting: AtomicUsize::new(0),
            applied: watch::channel(applied).0,
            keep_until_durable,
            durable: AtomicU64::new(applied),
            pending_keys: Mutex::new(HashMap::new()),
            max_backlog_bytes,
            stopped: AtomicBool::new(false),
        })
    }

    /// The newest lsn journaled.
    #[cfg(test)]
    pub(crate) fn logged(&self) -> u64 {
        self.logged.load(Ordering::Acquire)
    }

    /// The newest lsn whose batch the tables hold (committed, not necessarily synced).
    pub fn applied(&self) -> u64 {
        *self.applied.borrow()
    }

    /// The tables hold every batch up to `lsn` durably (the caller synced them after that
    /// batch was applied): the journal segments holding only such batches are deleted.
    pub fn tables_durable(&self, lsn: u64) {
        let lsn = self.durable.fetch_max(lsn, Ordering::AcqRel).max(lsn);
        self.report_unsynced();
        self.delete_segments_through(lsn);
    }

    /// `pigeon_tables_unsynced_batches`: batches the tables hold but not yet durably, whose
    /// journal segments must stay. It stays under a few hundred while the checkpointer
    /// syncs every 100 ms; if its syncs fail (a failing disk), it grows with every batch
    /// the tables take. (If a checkpoint's fail, the tables stop: `pigeon_tables_stopped`.)
    fn report_unsynced(&self) {
        if self.keep_until_durable {
            let unsynced = self
                .applied()
                .saturating_sub(self.durable.load(Ordering::Acquire));
            metrics::gauge!("pigeon_tables_unsynced_batches").set(unsynced as f64);
        }
    }

    /// The next batch starts a new journal segment (tests).
    #[cfg(test)]
    pub(crate) fn end_segment(&self) {
        if let Some(j) = self.journal.lock().expect("journal lock").as_mut() {
            j.end_segment();
        }
    }

    /// Deletes the journal segments whose batches are all at or below `lsn`: detached
    /// under the journal lock, unlinked after it (an unlink of a 64 MiB segment takes tens
    /// of ms, which no commit should wait for).
    fn delete_segments_through(&self, lsn: u64) {
        let segments = match self.journal.lock().expect("journal lock").as_mut() {
            Some(journal) => journal.detach_applied(lsn),
            None => Vec::new(),
        };
        for path in segments {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(error = %e, segment = %path.display(), "deleting an applied journal segment failed");
            }
        }
    }

    /// Makes `changes` durable in the journal and queues it for the tables. Blocking.
    pub fn commit(&self, changes: Changes) -> Result<(), StoreError> {
        let mut record = self.record.lock().expect("record lock");
        record.clear();
        crate::record::encode(&changes, &mut record).map_err(err)?;
        let size = record.payload().len();
        self.wait_for_room(size)?;
        let mut journal = self.journal.lock().expect("journal lock");
        let Some(open) = journal.as_mut() else {
            return Err(StoreError::unavailable("the store is closed"));
        };
        let lsn = open.append_record(&mut record).map_err(err)?;
        // Before the batch is queued, so the applier cannot forget its keys before they are
        // here; before this returns, so the engine, which forgets them once it does, leaves
        // no gap.
        self.remember_keys(&changes);
        let mut backlog = self.backlog.lock().expect("backlog lock");
        backlog.queue.push_back((lsn, changes, size));
        backlog.oldest.get_or_insert_with(Instant::now);
        backlog.bytes += size;
        self.logged.store(lsn, Ordering::Release);
        drop(backlog);
        drop(journal);
        self.more.notify_one();
        Ok(())
    }

    fn remember_keys(&self, changes: &Changes) {
        // Made before the lock is taken: the applier may be waiting for it.
        let keys: Vec<_> = changes
            .messages
            .iter()
            .filter_map(|m| {
                let cmid = m.client_msg_id.as_ref()?;
                let at = (m.msg_id, m.conversation_id.clone(), m.seq, m.created_at);
                Some(((m.sender.get(), cmid.clone()), at))
            })
            .collect();
        if !keys.is_empty() {
            self.pending_keys
                .lock()
                .expect("pending keys lock")
                .extend(keys);
        }
    }

    /// Takes the keys of the batches the tables now hold out of the pending ones, a few
    /// hundred per turn of the lock: the journal's thread takes it for every batch it
    /// commits, and a transaction's ten thousand keys at once held it (and every send
    /// behind that commit) for 5-10 ms, longer when this thread, which runs as batch work,
    /// was preempted holding it. What is taken out is dropped after each turn.
    fn forget_keys(&self, applied: &[(u64, Changes, usize)]) {
        const TURN: usize = 256;
        if self
            .pending_keys
            .lock()
            .expect("pending keys lock")
            .is_empty()
        {
            return;
        }
        let keys: Vec<(u64, String)> = applied
            .iter()
            .flat_map(|(_, c, _)| &c.messages)
            .filter_map(|m| Some((m.sender.get(), m.client_msg_id.clone()?)))
            .collect();
        let mut taken = Vec::with_capacity(TURN);
        for turn in keys.chunks(TURN) {
            let mut pending = self.pending_keys.lock().expect("pending keys lock");
            taken.extend(turn.iter().filter_map(|k| pending.remove_entry(k)));
            // A backlog's worth of keys leaves a large table behind: give it back once empty
            // (freed after the lock, with what was taken).
            let mut large = None;
            if pending.is_empty() && pending.capacity() > PENDING_KEYS_KEEP_CAPACITY {
                large = Some(std::mem::take(&mut *pending));
            }
            let done = pending.is_empty();
            drop(pending);
            drop(large);
            taken.clear();
            if done {
                break;
            }
        }
    }

    /// Answers the idempotency keys of `dedupe` that journaled batches the tables lack hold,
    /// and takes them out of it. What is left may be read from the tables as they are, in
    /// a read begun after this call: a key missing here was never journaled, or its batch
    /// was applied before (or set aside, refused by the tables: see `apply_or_set_aside`).
    pub fn dedupe_pending(
        &self,
        dedupe: &mut std::collections::HashSet<(UserId, ClientMsgId)>,
    ) -> HashMap<(UserId, ClientMsgId), SendAck> {
        let pending = self.pending_keys.lock().expect("pending keys lock");
        let mut found = HashMap::new();
        if pending.is_empty() {
            return found;
        }
        dedupe.retain(|(sender, cmid)| {
            let ack = pending
                .get(&(sender.get(), cmid.as_str().to_owned()))
                .and_then(|(msg_id, conv, seq, at)| {
                    crate::rows::duplicate_ack(cmid, *msg_id, conv, *seq, *at)
                });
            match ack {
                Some(ack) => {
                    found.insert((*sender, cmid.clone()), ack);
                    false
                }
                None => true,
            }
        });
        found
    }

    #[cfg(test)]
    pub(crate) fn pending_key_count(&self) -> usize {
        self.pending_keys.lock().expect("pending keys lock").len()
    }

    fn wait_for_room(&self, size: usize) -> Result<(), StoreError> {
        let deadline = Instant::now() + WAIT_LIMIT;
        let mut backlog = self.backlog.lock().expect("backlog lock");
        // One batch larger than the whole limit still goes, alone.
        while backlog.bytes > 0 && backlog.bytes + size > self.max_backlog_bytes {
            self.check_not_stopped()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StoreError::unavailable(
                    "the store is behind: the tables could not keep up with the journal",
                ));
            }
            backlog = self
                .room
                .wait_timeout(backlog, left)
                .expect("backlog lock")
                .0;
        }
        Ok(())
    }

    /// Waits until the tables hold every batch acknowledged before this call.
    pub async fn caught_up(&self) -> Result<(), StoreError> {
        // Even when the tables hold everything: a server whose tables stopped answers that it
        // is not ready (`/readyz` reads through here).
        self.check_not_stopped()?;
        let target = self.logged.load(Ordering::Acquire);
        if *self.applied.borrow() >= target {
            return Ok(());
        }
        let mut rx = self.applied.subscribe();
        let _waiting = WaitingReader::new(self);
        let started = Instant::now();
        let wait = rx.wait_for(|a| *a >= target || self.stopped.load(Ordering::Acquire));
        match tokio::time::timeout(WAIT_LIMIT, wait).await {
            Ok(Ok(_)) if self.stopped.load(Ordering::Acquire) => Err(stopped_error()),
            Ok(Ok(_)) => {
                // Only reads that found the tables behind: how long the applier kept them.
                metrics::histogram!("pigeon_read_wait_seconds")
                    .record(started.elapsed().as_secs_f64());
                Ok(())
            }
            Ok(Err(_)) => Err(StoreError::unavailable("the store is closed")),
            Err(_) => Err(StoreError::unavailable(
                "the store is behind: the tables did not catch up with the journal",
            )),
        }
    }

    /// Fails once the tables have stopped taking writes.
    pub fn check_not_stopped(&self) -> Result<(), StoreError> {
        if self.stopped.load(Ordering::Acquire) {
            return Err(stopped_error());
        }
        Ok(())
    }

    /// After a checkpoint whose copy may not be durable: SQLite counts the WAL as copied,
    /// so a transaction would start it over, and the last connection to close would delete
    /// it, with the database file's copy maybe never on the disk. The writer is told not
    /// to checkpoint as it closes, nothing writes the tables again (the applier stops,
    /// settings writes fail, reads and sends waiting for the tables fail at once), and the
    /// WAL stays whole for the next open, whose recovery copies it again (what SQLite's
    /// own checkpoint leaves after a failed sync).
    fn stop_tables(&self, writer: &Connection) {
        if let Err(e) = writer.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true) {
            tracing::error!(error = %e, "could not keep the writer from checkpointing as it closes");
        }
        self.stopped.store(true, Ordering::Release);
        metrics::gauge!("pigeon_tables_stopped").set(1.0);
        self.applied.send_modify(|_| {});
        let _backlog = self.backlog.lock().expect("backlog lock");
        self.room.notify_all();
    }

    /// Asks the applier to finish what is queued and stop.
    pub fn close(&self) {
        self.backlog.lock().expect("backlog lock").closed = true;
        self.more.notify_all();
    }

    /// Once the applier has stopped: closes the journal, so that another store may open
    /// the directory; later commits fail.
    pub fn close_journal(&self) {
        self.journal.lock().expect("journal lock").take();
    }

    /// The applier thread's loop: one transaction at a time, which writes the queued
    /// batches' rows as they come (every [`APPLY_STEP`]) and commits once its oldest batch
    /// has waited [`APPLY_DELAY`], [`APPLY_QUIET`] after its last step if it holds
    /// [`QUIET_MIN_BATCHES`] (or [`QUIET_MIN_BYTES`]) and none are queued, or at once when
    /// a reader waits. If a step, the final
    /// rows or the commit fail, the transaction is rolled back and its batches are applied
    /// again in a fresh transaction (one by one if the tables refuse one, which is set
    /// aside), retrying after any other failure (the batches are durable in the journal;
    /// they must reach the tables, and readers wait meanwhile), until closed with nothing
    /// left, or until a checkpoint's copy cannot be made durable (the tables stop, see
    /// [`StoreWrites::stop_tables`]).
    pub fn run_applier(self: Arc<Self>) {
        let mut checkpointed = Instant::now();
        let mut last_cut_short = false;
        // With durability `fsync`, this thread's checkpoints make the tables durable
        // themselves, a step at a time (`checkpoint_in_steps`).
        let mut files = {
            let conn = self.writer.lock().expect("writer lock");
            let path = conn.path().filter(|_| self.keep_until_durable);
            path.map(|p| {
                let mut files = TableFiles::new(Path::new(p));
                // From now on, so that a write-back error of any later write is seen.
                files.open_existing();
                files
            })
        };
        while let Some(oldest) = self.wait_for_batches() {
            let mut taken: Vec<(u64, Changes, usize)> = Vec::new();
            let mut busy = Duration::ZERO;
            let stepped = {
                let mut conn = self.writer.lock().expect("writer lock");
                let due = checkpointed.elapsed()
                    >= if last_cut_short {
                        CHECKPOINT_AFTER_A_READ
                    } else {
                        CHECKPOINT_BEFORE_BEGIN
                    };
                let overdue = checkpointed.elapsed() >= CHECKPOINT_AT_LEAST;
                if (due && self.readers_waiting.load(Ordering::Acquire) == 0) || overdue {
                    // Under a steady load the next transaction begins right after the last
                    // commit; SQLite writes a transaction from the WAL's start again only
                    // if, when it began, every frame was copied. Without this the WAL grew
                    // to the 160 MB backstop and every write went to a new page of it (the
                    // server's maximum fell by 4 %). Never while a reader waits; after a
                    // transaction a reader cut short (its next read may come at once, and
                    // would wait for this checkpoint's syncs) at most once a second; and at
                    // least every
                    // CHECKPOINT_AT_LEAST, or readers always waiting would let the WAL grow
                    // to the backstop, whose checkpoint runs inside a commit and syncs it
                    // all at once.
                    let started = Instant::now();
                    if let Some(files) = files.as_mut() {
                        // A reader waiting hurries it, but not an overdue one: readers always
                        // waiting would have up to CHECKPOINT_AT_LEAST of pages go in one sync.
                        let hurry = || !overdue && self.readers_waiting.load(Ordering::Acquire) > 0;
                        if let Err(e) = checkpoint_in_steps(&conn, files, &hurry) {
                            tracing::error!(error = %e, "the tables could not be made durable: \
                                they take no more writes, reads fail, and sends fail once the \
                                journal's backlog is full (restart once the disk is sound: \
                                the journal and the WAL are applied again at open)");
                            self.stop_tables(&conn);
                            return;
                        }
                    } else if let Err(e) =
                        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                    {
                        tracing::warn!(error = %e, "wal checkpoint before a transaction failed");
                    }
                    busy += started.elapsed();
                    checkpointed = Instant::now();
                }
                self.apply_in_steps(&mut conn, oldest + APPLY_DELAY, &mut taken, &mut busy)
            };
            last_cut_short = matches!(stepped, Ok(true));
            let Some(last) = taken.last().map(|t| t.0) else {
                // Nothing was taken: the transaction could not even begin.
                if let Err(e) = stepped
                    && self.closed_or_pause(&e, 0)
                {
                    return;
                }
                continue;
            };
            if let Err(e) = stepped {
                tracing::warn!(error = %e, lsn = last, "applying journaled batches in steps failed; applying them again in a fresh transaction");
                let started = Instant::now();
                if !self.apply_until_done(&taken) {
                    return;
                }
                busy += started.elapsed();
            }
            metrics::histogram!("pigeon_apply_seconds").record(busy.as_secs_f64());
            metrics::histogram!("pigeon_apply_batches").record(taken.len() as f64);
            let size: usize = taken.iter().map(|t| t.2).sum();
            self.backlog.lock().expect("backlog lock").bytes -= size;
            self.room.notify_all();
            // After the tables' commit: a look-up that misses a key here then reads tables
            // that hold it.
            self.forget_keys(&taken);
            self.applied.send_replace(last);
            self.report_unsynced();
            if !self.keep_until_durable {
                self.delete_segments_through(last);
            }
        }
    }

    /// Waits until a batch is queued; returns when the oldest queued one was queued, or
    /// `None` once closed with nothing queued.
    fn wait_for_batches(&self) -> Option<Instant> {
        let mut backlog = self.backlog.lock().expect("backlog lock");
        loop {
            if let Some(oldest) = backlog.oldest {
                return Some(oldest);
            }
            if backlog.closed {
                return None;
            }
            backlog = self.more.wait(backlog).expect("backlog lock");
        }
    }

    /// One transaction: takes the queued batches every [`APPLY_STEP`] and writes their rows
    /// into it, and commits at `due`, [`APPLY_QUIET`] after the last batch it took if it
    /// holds [`QUIET_MIN_BATCHES`] (or [`QUIET_MIN_BYTES`]) and no more are queued, or at
    /// once when a reader waits, the store closes, or the transaction is full. Everything
    /// taken is in `taken`, even on an error (the transaction is then rolled back); `busy`
    /// is the time spent writing. True when a waiting reader (or settings write) was what
    /// made it commit.
    fn apply_in_steps(
        &self,
        conn: &mut Connection,
        due: Instant,
        taken: &mut Vec<(u64, Changes, usize)>,
        busy: &mut Duration,
    ) -> rusqlite::Result<bool> {
        let tx = conn.transaction()?;
        let mut bytes = 0;
        let mut next_step = Instant::now();
        // When the last batch was taken: once nothing more comes for APPLY_QUIET, commit.
        let mut quiet_from: Option<Instant> = None;
        let mut cut_short;
        loop {
            let (chunk, commit) = {
                let mut backlog = self.backlog.lock().expect("backlog lock");
                loop {
                    let now = Instant::now();
                    let room = MAX_APPLY_BATCHES - taken.len();
                    let idle = backlog.queue.is_empty();
                    // When a quiet spell commits this transaction, if it is large enough.
                    let quiet_at = quiet_from
                        .filter(|_| {
                            idle && (taken.len() >= QUIET_MIN_BATCHES || bytes >= QUIET_MIN_BYTES)
                        })
                        .map(|at| at + APPLY_QUIET);
                    let quiet = quiet_at.is_some_and(|at| now >= at);
                    let ends =
                        backlog.closed || now >= due || room == 0 || bytes >= APPLY_BYTES || quiet;
                    let reader = self.readers_waiting.load(Ordering::Acquire) > 0;
                    let commit = ends || reader;
                    cut_short = !ends && reader;
                    if !idle && room > 0 && (commit || now >= next_step) {
                        let n = backlog.queue.len().min(room);
                        let chunk: Vec<_> = backlog.queue.drain(..n).collect();
                        // Left as it was when some stay (a full transaction): the next one
                        // then commits early, which costs a little batching, nothing else.
                        if backlog.queue.is_empty() {
                            backlog.oldest = None;
                        }
                        break (chunk, commit);
                    }
                    if commit {
                        break (Vec::new(), true);
                    }
                    let wake = match quiet_at {
                        Some(at) => at.min(due),
                        None if idle => due,
                        None => next_step.min(due),
                    };
                    backlog = self
                        .more
                        .wait_timeout(backlog, wake - now)
                        .expect("backlog lock")
                        .0;
                }
            };
            if !chunk.is_empty() {
                let started = Instant::now();
                let rows: Vec<&Changes> = chunk.iter().map(|t| &t.1).collect();
                let written = write::apply_rows(&tx, &rows);
                bytes += chunk.iter().map(|t| t.2).sum::<usize>();
                taken.extend(chunk);
                *busy += started.elapsed();
                written?;
                next_step = Instant::now() + APPLY_STEP;
                quiet_from = Some(Instant::now());
            }
            if commit {
                break;
            }
        }
        let Some(last) = taken.last().map(|t| t.0) else {
            return Ok(cut_short);
        };
        let started = Instant::now();
        write::apply_whole_rows(&tx, taken.iter().map(|t| &t.1))?;
        write::meta_set(&tx, APPLIED_KEY, &last.to_string())?;
        tx.commit()?;
        *busy += started.elapsed();
        Ok(cut_short)
    }

    /// Applies `taken` in a transaction of its own, setting aside a batch the tables refuse,
    /// and retries after any other failure. False if the store closed meanwhile (the
    /// journal keeps the batches, and the next open applies them).
    fn apply_until_done(&self, taken: &[(u64, Changes, usize)]) -> bool {
        let last = taken.last().map(|t| t.0).unwrap_or_default();
        loop {
            let done = {
                let mut conn = self.writer.lock().expect("writer lock");
                let batches: Vec<(u64, &Changes)> = taken.iter().map(|t| (t.0, &t.1)).collect();
                apply_or_set_aside(&mut conn, &batches, &self.journal_dir)
            };
            match done {
                Ok(()) => return true,
                Err(e) if self.closed_or_pause(&e, last) => return false,
                Err(_) => {}
            }
        }
    }

    /// After a failed write of the tables: true when the store is closing (the journal
    /// keeps the batches, and the next open applies them); otherwise pauses before the
    /// caller tries again. `lsn` is the newest batch concerned (0: none taken yet).
    fn closed_or_pause(&self, e: &rusqlite::Error, lsn: u64) -> bool {
        if self.backlog.lock().expect("backlog lock").closed {
            tracing::error!(error = %e, lsn, "writing the tables failed at close; the journal keeps the batches");
            return true;
        }
        tracing::error!(error = %e, lsn, "writing journaled batches to the tables failed; retrying");
        std::thread::sleep(RETRY_PAUSE);
        false
    }
}

/// Counts a reader in [`StoreWrites::readers_waiting`] for as long as it lives (a waiting
/// future may be dropped), and wakes the applier when it starts waiting. Whoever else needs
/// the writer connection counts itself too: the applier holds it through its transaction.
pub(crate) struct WaitingReader<'a>(&'a StoreWrites);

impl<'a> WaitingReader<'a> {
    pub(crate) fn new(writes: &'a StoreWrites) -> Self {
        // Counted under the backlog lock, so the applier cannot miss it between its check
        // and its wait.
        let backlog = writes.backlog.lock().expect("backlog lock");
        writes.readers_waiting.fetch_add(1, Ordering::AcqRel);
        drop(backlog);
        writes.more.notify_one();
        WaitingReader(writes)
    }
}

impl Drop for WaitingReader<'_> {
    fn drop(&mut self) {
        self.0.readers_waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Applies `batches` in order in one transaction that also records `last` as applied.
pub fn apply<'a>(
    conn: &mut Connection,
    batches: impl Iterator<Item = &'a Changes>,
    last: u64,
) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    let batches: Vec<&Changes> = batches.collect();
    write::apply(&tx, &batches)?;
    write::meta_set(&tx, APPLIED_KEY, &last.to_string())?;
    tx.commit()
}

/// Applies `batches` in one transaction; if the tables refuse one of them (a constraint,
/// which no retry would change: the engine decided something the tables forbid), applies
/// them one by one and sets the refused ones aside as `rejected-<lsn>.json` beside the
/// journal, loudly, rather than stop every later batch behind it. Other errors (the database
/// busy, the disk full) are returned, to be tried again.
pub fn apply_or_set_aside(
    conn: &mut Connection,
    batches: &[(u64, &Changes)],
    journal_dir: &Path,
) -> rusqlite::Result<()> {
    let Some(last) = batches.last().map(|b| b.0) else {
        return Ok(());
    };
    match apply(conn, batches.iter().map(|b| b.1), last) {
        Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation) => {}
        other => return other,
    }
    for (lsn, changes) in batches {
        match apply(conn, std::iter::once(*changes), *lsn) {
            Ok(()) => {}
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation) => {
                let path = journal_dir.join(format!("rejected-{lsn:020}.json"));
                let kept = serde_json::to_vec(changes)
                    .map_err(std::io::Error::other)
                    .and_then(|bytes| std::fs::write(&path, bytes));
                tracing::error!(lsn, error = %e, file = %path.display(), kept = ?kept, "the tables refused a journaled batch; it is set aside");
                // For an alert: its senders had their acks, so this is data lost.
                metrics::counter!("pigeon_batches_set_aside_total").increment(1);
                apply(conn, std::iter::empty(), *lsn)?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// At open: applies what the journal holds beyond the tables, in transactions of at most
/// [`MAX_APPLY_BATCHES`]. Returns how many batches it applied.
pub fn replay(
    conn: &mut Connection,
    pending: Vec<crate::journal::Record>,
    journal_dir: &Path,
) -> Result<usize, StoreError> {
    let count = pending.len();
    for chunk in pending.chunks(MAX_APPLY_BATCHES) {
        let mut batches = Vec::with_capacity(chunk.len());
        for (lsn, payload) in chunk {
            let changes = crate::record::decode(payload).map_err(|e| {
                StoreError::unavailable(format!("journal record {lsn} does not decode: {e}"))
            })?;
            batches.push(changes);
        }
        let batches: Vec<(u64, &Changes)> = chunk.iter().map(|r| r.0).zip(batches.iter()).collect();
        apply_or_set_aside(conn, &batches, journal_dir).map_err(err)?;
    }
    Ok(count)
}

fn stopped_error() -> StoreError {
    StoreError::unavailable(
        "the tables could not be made durable and take no more writes: restart once the disk is sound",
    )
}

/// The last lsn the tables hold (0 for a store that never journaled).
pub fn applied_lsn(conn: &Connection) -> Result<u64, StoreError> {
    let value = crate::read::meta_get(conn, APPLIED_KEY).map_err(err)?;
    match value {
        None => Ok(0),
        Some(v) => v.parse().map_err(|_| {
            StoreError::unavailable(format!("meta {APPLIED_KEY} is not a number: {v}"))
        }),
    }
}

/// Copies the WAL into the database file with the tables' writes reaching the disk a step
/// at a time (see `table_files.rs`), in the order SQLite's own checkpoint syncs them: the
/// WAL is made durable, SQLite copies it without syncing, then the database file is made
/// durable. The caller holds the writer connection throughout (every write of the tables
/// goes through it), so SQLite cannot start the WAL over (the next transaction would)
/// before the copy is durable; if this fails, the caller stops the tables
/// ([`StoreWrites::stop_tables`]). Once `hurry` says so (a reader waits for the tables),
/// what is left of each file goes in one sync.
fn checkpoint_in_steps(
    conn: &Connection,
    files: &mut TableFiles,
    hurry: &dyn Fn() -> bool,
) -> Result<(), StoreError> {
    files.sync_file(TableFile::Wal, hurry)?;
    conn.pragma_update(None, "synchronous", "OFF")
        .map_err(err)?;
    let copied = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
    let restored = conn.pragma_update(None, "synchronous", "NORMAL");
    copied.and(restored).map_err(err)?;
    files.sync_file(TableFile::Database, hurry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temp_dir;

    /// A database in WAL mode in a new directory, as the writer has it (`synchronous=NORMAL`)
    /// and with no automatic checkpoint: its directory, its path and the connection.
    fn wal_db(name: &str) -> (PathBuf, PathBuf, Connection) {
        let dir = temp_dir(name);
        let db = dir.join("pigeon.db");
        let conn = Connection::open(&db).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.pragma_update(None, "synchronous", "NORMAL").unwrap();
        conn.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
        (dir, db, conn)
    }

    fn rows_in(db: &Path) -> i64 {
        Connection::open(db)
            .unwrap()
            .query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .unwrap()
    }

    /// Nothing is copied into the database file before the WAL is durable: a WAL that
    /// cannot be synced fails the checkpoint first, and the writer syncs as before.
    #[test]
    fn a_checkpoint_copies_nothing_before_the_wal_is_synced() {
        let (dir, db, conn) = wal_db("ckpt-wal-fails");
        conn.execute_batch("CREATE TABLE t (x BLOB); INSERT INTO t VALUES (zeroblob(4000));")
            .unwrap();
        crate::table_files::test_failures::fail_syncs_of(&crate::table_files::wal_path(&db));
        let mut files = TableFiles::new(&db);
        assert!(checkpoint_in_steps(&conn, &mut files, &|| false).is_err());
        let synchronous: i64 = conn
            .query_row("PRAGMA synchronous", [], |r| r.get(0))
            .unwrap();
        assert_eq!(synchronous, 1);
        let alone = temp_dir("ckpt-wal-fails-copy").join("pigeon.db");
        std::fs::copy(&db, &alone).unwrap();
        let in_file_alone =
            Connection::open(&alone)
                .unwrap()
                .query_row("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0));
        assert!(in_file_alone.is_err(), "the table is still only in the WAL");
        std::fs::remove_dir_all(dir).unwrap();
        std::fs::remove_dir_all(alone.parent().unwrap()).unwrap();
    }

    /// The copy reaches the database file itself, and the writer's own syncing is as it
    /// was: a transaction's commit must not be left with `synchronous=OFF`.
    #[test]
    fn a_checkpoint_in_steps_copies_the_wal_and_leaves_the_writer_as_it_was() {
        let (dir, db, conn) = wal_db("ckpt-steps");
        conn.execute_batch("CREATE TABLE t (x BLOB)").unwrap();
        for _ in 0..300 {
            conn.execute("INSERT INTO t VALUES (zeroblob(4000))", [])
                .unwrap();
        }
        // The database file alone (a copy without its WAL) does not hold the rows yet.
        let alone = temp_dir("ckpt-steps-copy").join("pigeon.db");
        std::fs::copy(&db, &alone).unwrap();
        assert!(
            Connection::open(&alone)
                .unwrap()
                .query_row("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0))
                .is_err()
        );

        let mut files = TableFiles::new(&db);
        checkpoint_in_steps(&conn, &mut files, &|| false).unwrap();

        let synchronous: i64 = conn
            .query_row("PRAGMA synchronous", [], |r| r.get(0))
            .unwrap();
        assert_eq!(synchronous, 1, "NORMAL again");
        std::fs::remove_file(&alone).unwrap();
        std::fs::copy(&db, &alone).unwrap();
        assert_eq!(rows_in(&alone), 300, "the database file holds every row");
        // Every frame was copied: the next transaction writes the WAL from its start.
        let wal = crate::table_files::wal_path(&db);
        let before = std::fs::metadata(&wal).unwrap().len();
        conn.execute("INSERT INTO t VALUES (zeroblob(4000))", [])
            .unwrap();
        assert_eq!(std::fs::metadata(&wal).unwrap().len(), before);
        assert_eq!(rows_in(&db), 301);
        std::fs::remove_dir_all(dir).unwrap();
        std::fs::remove_dir_all(alone.parent().unwrap()).unwrap();
    }
}

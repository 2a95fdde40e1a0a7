//! The write pipeline: a decider task takes commands as they arrive and lets the engine
//! decide them into a batch; a committer task commits each batch as one unit (group commit:
//! in the embedded store, one journal record and one fsync for the whole batch) and only
//! then answers and pushes. The two overlap: batch N+1 is decided while batch N commits. In
//! the embedded mode the one decider owns every conversation, so `seq` and `user_seq` have
//! exactly one owner.

use crate::hub::{ConnectionAddr, Hub};
use pigeon_core::changes::{Changes, Event};
use pigeon_core::command::{Command, Reply};
use pigeon_core::engine::Engine;
use pigeon_core::error::DomainError;
use pigeon_core::store::{Needs, Store};
use pigeon_proto::frames::ServerFrame;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Most commands decided and committed together.
pub const MAX_BATCH: usize = 1024;
/// Commands decided together while the store is busy committing (one load each time).
pub const DECIDE_CHUNK: usize = 64;
/// Commands waiting for the pipeline before senders are told `unavailable`.
pub const QUEUE_CAPACITY: usize = 16_384;

/// Why a command got no answer from the domain.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Domain(#[from] DomainError),
    /// The store failed or the pipeline is gone; the same request is safe to retry.
    #[error("the service is unavailable; retry")]
    Unavailable,
}

/// Where a command's answer goes.
pub enum ReplyTo {
    /// A waiting HTTP request (or any caller).
    Caller(oneshot::Sender<Result<Reply, PipelineError>>),
    /// A WebSocket connection, by its address: the answer is queued on its outbox before
    /// any push of the same batch, so a sender always sees its `send_ack` before the `msg`
    /// of its message.
    Connection(ConnectionReply),
    /// A barrier (`flush_tiers`): answered once the delivery task of `tier` has queued on
    /// the outboxes every frame decided before it, so a connection that waited for it
    /// finds its `send_ack`s (and their pushes) queued ahead of the reply it writes next.
    AfterDelivery { tx: Answer, tier: Tier },
    /// Nobody waits.
    Nobody,
}

impl ReplyTo {
    /// For a command that never reached the pipeline, whose caller answers the error
    /// itself: nothing more is sent.
    fn disarm(self) {
        if let ReplyTo::Connection(reply) = self {
            reply.take();
        }
    }
}

/// Where a WebSocket command's answer goes: its connection's address and the frame's
/// `req`. One dropped unanswered (its decider panicked with it in the batch) answers
/// `unavailable` as it goes, through the hub it names, so the client is not left waiting
/// for a reply that never comes.
pub struct ConnectionReply {
    to: Option<ConnectionAddr>,
    req: Option<i64>,
    hub: Arc<Hub>,
}

impl ConnectionReply {
    pub fn new(hub: Arc<Hub>, to: ConnectionAddr, req: Option<i64>) -> Self {
        ConnectionReply {
            to: Some(to),
            req,
            hub,
        }
    }

    /// The address and `req`, for whoever answers: nothing is sent on drop then.
    fn take(mut self) -> (ConnectionAddr, Option<i64>) {
        let to = self.to.take().expect("a reply is taken once");
        (to, self.req)
    }

    fn answer_unavailable(&mut self) {
        if let Some(to) = self.to.take() {
            self.hub
                .send_to_connection(to, error_frame(self.req, &PipelineError::Unavailable));
        }
    }
}

impl Drop for ConnectionReply {
    fn drop(&mut self) {
        self.answer_unavailable();
    }
}

struct Envelope {
    cmd: Command,
    reply: ReplyTo,
}

/// The handle the API uses to submit commands.
#[derive(Clone)]
pub struct Pipeline {
    tx: mpsc::Sender<Envelope>,
    /// Sends into large conversations wait here, so a flood cannot fill the queue ahead of
    /// single chats; each batch takes at most [`BULK_BUDGET`] of work from it.
    bulk_tx: mpsc::Sender<Envelope>,
    /// Conversations that have been large (sticky, so a conversation's sends never move back
    /// to the fast queue behind its own earlier sends).
    large: LargeConversations,
    stats: Arc<PipelineStats>,
}

/// The work one batch may take from the bulk queue, in rows: a send into a write fan-out
/// conversation costs one inbox row per member, into a read fan-out one a twentieth of its
/// members (the pushes). Sends are taken while the batch has spent less than this, so the
/// last one may go past it (a batch always takes at least one). Small enough that a batch carrying a flood still commits in a few
/// milliseconds, so single chats waiting behind it are not held up long.
pub const BULK_BUDGET: u64 = 400;
/// How long after the fast tier's last send the bulk tier still waits for the runtime to
/// keep time (see `decide`).
pub const FAST_SENDS_RECENT: std::time::Duration = std::time::Duration::from_secs(1);
/// The longest bulk work waits while single chats send: past this it is taken as if the
/// gate were open and unpaced (see [`BULK_PACE`]), and beside their sends, until a batch has
/// taken some, so a server kept busy by single chats still moves a flood.
pub const BULK_MAX_WAIT: std::time::Duration = std::time::Duration::from_millis(100);
/// The bulk work a batch that carries fast commands but no fast sends (cursor moves, read
/// marks) may take. A batch that carries a single chat's send takes none until bulk work
/// is overdue ([`BULK_MAX_WAIT`]), then this much: the send's own commit stays light.
pub const BULK_BUDGET_BESIDE_FAST: u64 = 100;
/// Bulk work a batch without fast commands may take while fast sends are recent (see
/// [`FAST_SENDS_RECENT`]): one send into a group of 200 rather than [`BULK_BUDGET`]'s two.
/// Each such batch wakes every connected member at once when it is delivered; halving the
/// burst took the single chats' p99 during `pigeon bench isolation`'s flood from 8.6-9.3 ms
/// to 7.2-8.9 ms (four runs each, alternated), for 3-25 % fewer flood deliveries.
pub const BULK_BUDGET_WHILE_FAST: u64 = 200;
/// While single chats send and the machine has lately been found strained (the gate was
/// shut in the last [`PACED_AFTER_SHUT`]), a batch takes bulk work only this long after the
/// last batch that took some (counted from its hand-over, so a longer commit covers it).
/// The gate reacts to lateness once single chats have felt it; the pace leaves room between
/// a flood's deliveries before they do. In `pigeon bench isolation` the single chats'
/// flood-phase p99 went from 7.2-9.3 ms to 5.5-7.1 ms (ratios 1.4-2.6× against
/// 2.5-3.4×), the flood from 57 000-113 000 to 28 000-41 000 deliveries/s. A machine that
/// keeps time is not paced, nor is a flood alone, nor bulk work that is overdue.
pub const BULK_PACE: Duration = Duration::from_millis(3);
/// How long after the gate was last found shut bulk batches stay paced.
pub const PACED_AFTER_SHUT: Duration = Duration::from_secs(1);

/// What decides whether bulk work must wait for its pace ([`BULK_PACE`]).
struct Pacing {
    /// When a batch last took bulk work.
    bulk_taken_at: Option<Instant>,
    /// When the gate was last found shut.
    gate_shut_at: Option<Instant>,
    fast_recent: bool,
    overdue: bool,
}

impl Pacing {
    /// Until when bulk work waits, if it must.
    fn until(&self, now: Instant) -> Option<Instant> {
        let strained = self
            .gate_shut_at
            .is_some_and(|t| now.saturating_duration_since(t) < PACED_AFTER_SHUT);
        if !self.fast_recent || !strained || self.overdue {
            return None;
        }
        self.bulk_taken_at
            .map(|t| t + BULK_PACE)
            .filter(|until| *until > now)
    }
}

/// Conversations that have been large, with what one send into each costs (see
/// [`BULK_BUDGET`]). Sticky, so a conversation's sends never move back to the fast queue
/// behind its own earlier sends.
type LargeConversations =
    Arc<std::sync::RwLock<std::collections::HashMap<pigeon_proto::ConversationId, u64>>>;

/// Counts of what the pipeline committed since start: what tests and operators use to see
/// that writes grow with the work asked for (not, say, with members × messages).
#[derive(Debug, Default)]
pub struct PipelineStats {
    pub batches: AtomicU64,
    pub commands: AtomicU64,
    pub messages: AtomicU64,
    pub inbox_rows: AtomicU64,
    pub member_rows: AtomicU64,
    pub conversation_rows: AtomicU64,
    /// When the last commit failed ([`monotonic_ms`]), or 0 once a batch that wrote something
    /// committed after it:
    /// `/readyz` answers 503 while commits fail (a full disk, tables that cannot take the
    /// journal's backlog), for up to [`COMMIT_FAILURE_UNREADY_MS`] after the last failure.
    last_commit_failure_ms: AtomicU64,
    /// The decider stopped on a panic (a broken invariant, e.g. `Engine::append`'s): every
    /// write then answers `unavailable`, and `/readyz` says why until a restart.
    decider_stopped: AtomicBool,
}

/// Milliseconds on a clock that never goes back (from the first call, plus one: never 0).
fn monotonic_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// How long one failed commit keeps `/readyz` at 503 when no commit comes after it: a
/// balancer that sent its traffic elsewhere meanwhile would otherwise never let one
/// through to find the store well again.
pub const COMMIT_FAILURE_UNREADY_MS: u64 = 10_000;

/// The sizes of one batch's changes, taken before they move into the commit.
struct BatchCounts {
    messages: u64,
    inbox: u64,
    members: u64,
    conversations: u64,
}

impl BatchCounts {
    fn of(ch: &Changes) -> Self {
        BatchCounts {
            messages: ch.messages.len() as u64,
            inbox: ch.inbox.len() as u64,
            members: ch.members.len() as u64,
            conversations: ch.conversations.len() as u64,
        }
    }
}

impl PipelineStats {
    /// Whether the decider stopped on a panic (see [`stop_flagged`]).
    pub fn decider_stopped(&self) -> bool {
        self.decider_stopped.load(Ordering::Relaxed)
    }

    /// Whether a commit failed within [`COMMIT_FAILURE_UNREADY_MS`] with none succeeding since.
    pub fn commits_failing(&self) -> bool {
        let failed = self.last_commit_failure_ms.load(Ordering::Relaxed);
        failed != 0 && monotonic_ms().saturating_sub(failed) < COMMIT_FAILURE_UNREADY_MS
    }

    fn commit_failed(&self) {
        self.last_commit_failure_ms
            .store(monotonic_ms(), Ordering::Relaxed);
    }

    fn commit_succeeded(&self) {
        if self.last_commit_failure_ms.load(Ordering::Relaxed) != 0 {
            self.last_commit_failure_ms.store(0, Ordering::Relaxed);
        }
    }

    fn record(&self, commands: usize, c: &BatchCounts) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.commands.fetch_add(commands as u64, Ordering::Relaxed);
        self.messages.fetch_add(c.messages, Ordering::Relaxed);
        self.inbox_rows.fetch_add(c.inbox, Ordering::Relaxed);
        self.member_rows.fetch_add(c.members, Ordering::Relaxed);
        self.conversation_rows
            .fetch_add(c.conversations, Ordering::Relaxed);
        metrics::counter!("pigeon_messages_stored_total").increment(c.messages);
        metrics::counter!("pigeon_inbox_rows_written_total").increment(c.inbox);
        metrics::counter!("pigeon_member_rows_written_total").increment(c.members);
    }
}

impl Pipeline {
    /// Starts the pipeline task over `store` and the delivery task over `hub`.
    pub fn start(
        store: Arc<dyn Store>,
        engine: Engine,
        hub: Arc<Hub>,
    ) -> (Pipeline, tokio::task::JoinHandle<()>) {
        Pipeline::start_with_gate(store, engine, hub, None)
    }

    /// [`Pipeline::start`] with the bulk tier's gate given (tests); `None` starts the probe.
    fn start_with_gate(
        store: Arc<dyn Store>,
        engine: Engine,
        hub: Arc<Hub>,
        gate: Option<crate::lag::Gate>,
    ) -> (Pipeline, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let (bulk_in, bulk_rx_in) = mpsc::channel(QUEUE_CAPACITY);
        let large = LargeConversations::default();
        let (fast_tx, fast_rx) = mpsc::channel(64);
        let (bulk_tx, bulk_rx) = mpsc::channel(1024);
        tokio::spawn(deliver(fast_rx, hub.clone()));
        tokio::spawn(deliver(bulk_rx, hub));
        let tiers = Tiers {
            fast: fast_tx,
            bulk: bulk_tx,
        };
        let stats = Arc::new(PipelineStats::default());
        let queues = Queues {
            fast: rx,
            bulk: bulk_rx_in,
            fast_closed: false,
            bulk_closed: false,
            large: large.clone(),
            parked: None,
        };
        let (decided_tx, decided_rx) = mpsc::channel(1);
        let (outcome_tx, outcome_rx) = mpsc::unbounded_channel();
        tokio::spawn(stop_flagged(
            decide(store.clone(), engine, queues, decided_tx, outcome_rx, gate),
            stats.clone(),
        ));
        let handle = tokio::spawn(commit(
            store,
            decided_rx,
            outcome_tx,
            large.clone(),
            tiers,
            stats.clone(),
        ));
        (
            Pipeline {
                tx,
                bulk_tx: bulk_in,
                large,
                stats,
            },
            handle,
        )
    }

    pub fn stats(&self) -> &PipelineStats {
        &self.stats
    }

    /// Submits and waits for the answer.
    pub async fn call(&self, cmd: Command) -> Result<Reply, PipelineError> {
        let (tx, rx) = oneshot::channel();
        self.submit(cmd, ReplyTo::Caller(tx)).await?;
        rx.await.map_err(|_| PipelineError::Unavailable)?
    }

    /// Waits until everything queued before the call, in both queues, is committed (or
    /// refused).
    pub async fn flush(&self) -> Result<(), PipelineError> {
        self.flush_tiers(&[Tier::Fast, Tier::Bulk]).await
    }

    /// Waits until everything queued before the call in the queues of `tiers` is committed
    /// (or refused).
    pub async fn flush_tiers(&self, tiers: &[Tier]) -> Result<(), PipelineError> {
        let mut answers = Vec::with_capacity(tiers.len());
        for tier in tiers {
            let (tx, rx) = oneshot::channel();
            self.queue(*tier)
                .send(Envelope {
                    cmd: Command::Flush,
                    reply: ReplyTo::AfterDelivery { tx, tier: *tier },
                })
                .await
                .map_err(|_| PipelineError::Unavailable)?;
            answers.push(rx);
        }
        for rx in answers {
            rx.await.map_err(|_| PipelineError::Unavailable)??;
        }
        Ok(())
    }

    /// Queues a command; waits only while the queue is full. Answers the queue it went to.
    pub async fn submit(&self, cmd: Command, reply: ReplyTo) -> Result<Tier, PipelineError> {
        let tier = if large_cost(&self.large, &cmd).is_some() {
            Tier::Bulk
        } else {
            Tier::Fast
        };
        self.queue(tier)
            .send(Envelope { cmd, reply })
            .await
            .map_err(|mpsc::error::SendError(refused)| {
                // The caller answers this error: the reply must not answer too.
                refused.reply.disarm();
                PipelineError::Unavailable
            })?;
        Ok(tier)
    }

    fn queue(&self, tier: Tier) -> &mpsc::Sender<Envelope> {
        match tier {
            Tier::Fast => &self.tx,
            Tier::Bulk => &self.bulk_tx,
        }
    }
}

/// The two queues of the decider: single chats and small groups, and sends into
/// conversations that have had more than [`LARGE_TIER_MEMBERS`] members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Fast,
    Bulk,
}

/// Conversations with more members than this are delivered by the bulk task, so that a
/// flood in a large group does not queue in front of single chats and small groups.
pub const LARGE_TIER_MEMBERS: usize = 100;

/// The two delivery tasks. Everything of one conversation (its senders' acks and its pushes)
/// goes through the same one, so order per conversation holds.
struct Tiers {
    fast: mpsc::Sender<Delivery>,
    bulk: mpsc::Sender<Delivery>,
}

/// What a delivery task sends after a commit, in order.
#[derive(Default)]
struct Delivery {
    replies: Vec<(ConnectionAddr, String)>,
    events: Vec<Event>,
    /// Answered once the replies and events before them are queued.
    after: Vec<(Answer, Result<Reply, PipelineError>)>,
}

/// Where a caller waits for its command's result.
type Answer = oneshot::Sender<Result<Reply, PipelineError>>;

/// What one send into a large conversation costs a batch; `None` when `cmd` is not one.
fn large_cost(large: &LargeConversations, cmd: &Command) -> Option<u64> {
    match cmd {
        Command::Send(pigeon_core::command::SendCommand {
            to: pigeon_core::command::SendTo::Conversation(c),
            ..
        }) => large.read().expect("large set lock").get(c).copied(),
        _ => None,
    }
}

/// The pipeline's inputs.
struct Queues {
    fast: mpsc::Receiver<Envelope>,
    bulk: mpsc::Receiver<Envelope>,
    fast_closed: bool,
    bulk_closed: bool,
    large: LargeConversations,
    /// A bulk command received while bulk work could not be taken (it was received to learn
    /// that bulk work waits); taken first once bulk work can be.
    parked: Option<Envelope>,
}

impl Queues {
    /// What is waiting now, without waiting: the fast queue first (up to `room`), then, only
    /// when the fast queue is empty and `bulk` allows, sends into large conversations while
    /// the batch's bulk budget lasts. Bulk after fast: a conversation's earlier sends (queued
    /// fast before it became large) are always decided before its later ones.
    fn take_ready(
        &mut self,
        room: usize,
        bulk: bool,
        batch: &mut BatchShare,
        into: &mut Vec<Envelope>,
    ) {
        let limit = into.len() + room;
        while into.len() < limit {
            match self.fast.try_recv() {
                Ok(e) => {
                    batch.took_fast(&e.cmd);
                    into.push(e);
                }
                Err(_) => break,
            }
        }
        if !bulk || !self.fast.is_empty() {
            return;
        }
        while into.len() < limit && batch.bulk_left() {
            let e = match self.parked.take() {
                Some(e) => e,
                None => match self.bulk.try_recv() {
                    Ok(e) => e,
                    Err(_) => break,
                },
            };
            batch.bulk_spent += self.cost(&e.cmd);
            into.push(e);
        }
    }

    /// Whether bulk work waits (queued, or parked by [`Queues::next`]).
    fn bulk_waiting(&self) -> bool {
        self.parked.is_some() || !self.bulk.is_empty()
    }

    /// Waits for the next command, fast queue first, bulk work only when `bulk` allows and
    /// the batch's bulk budget lasts. A bulk command that arrives while bulk work may not be
    /// taken, or may not be taken as it arrives (`bulk_on_arrival`), is parked and reported
    /// ([`Next::BulkWaiting`]): the caller learns that bulk work waits (and asks the gate)
    /// before it is taken.
    async fn next(&mut self, bulk: bool, bulk_on_arrival: bool, batch: &mut BatchShare) -> Next {
        loop {
            let may_take = bulk && batch.bulk_left();
            if may_take && let Some(e) = self.parked.take() {
                batch.bulk_spent += self.cost(&e.cmd);
                return Next::Command(e);
            }
            if self.fast_closed && self.bulk_closed && self.parked.is_none() {
                return Next::Closed;
            }
            let bulk_open = !self.bulk_closed && self.parked.is_none();
            tokio::select! {
                biased;
                e = self.fast.recv(), if !self.fast_closed => match e {
                    Some(e) => {
                        batch.took_fast(&e.cmd);
                        return Next::Command(e);
                    }
                    None => self.fast_closed = true,
                },
                e = self.bulk.recv(), if bulk_open => match e {
                    Some(e) if may_take && bulk_on_arrival => {
                        batch.bulk_spent += self.cost(&e.cmd);
                        return Next::Command(e);
                    }
                    Some(e) => {
                        self.parked = Some(e);
                        return Next::BulkWaiting;
                    }
                    None => self.bulk_closed = true,
                },
                // Bulk work is parked (more may wait behind it) and may not be taken now,
                // or both queues are closed with it parked: the caller's other events (a
                // commit's end, the gate, the batch going) decide when it may.
                else => std::future::pending::<()>().await,
            }
        }
    }

    fn cost(&self, cmd: &Command) -> u64 {
        large_cost(&self.large, cmd).unwrap_or(1)
    }
}

/// What [`Queues::next`] found. (Returned once per command and moved into the batch at
/// once: boxing the command would cost an allocation per command.)
#[allow(clippy::large_enum_variant)]
enum Next {
    Command(Envelope),
    /// Bulk work arrived that may not be taken now (it is parked).
    BulkWaiting,
    /// Both queues are closed and nothing is parked.
    Closed,
}

/// What one batch has taken from each queue.
#[derive(Default)]
struct BatchShare {
    fast: usize,
    /// Of `fast`, the sends (single chats, small groups); see also `decide`'s
    /// `fast_send_at`.
    fast_sends: usize,
    bulk_spent: u64,
    /// Bulk work has waited [`BULK_MAX_WAIT`] (set by the decider before each take).
    bulk_overdue: bool,
    /// Fast sends came in the last [`FAST_SENDS_RECENT`] (set by the decider too).
    fast_recent: bool,
}

impl BatchShare {
    /// Whether the batch may take more bulk work: [`BULK_BUDGET`] alone, less while fast
    /// sends are recent and less again beside fast commands, none beside fast sends until
    /// bulk work is overdue.
    fn bulk_left(&self) -> bool {
        let budget = if self.fast_sends > 0 && !self.bulk_overdue {
            0
        } else if self.fast > 0 {
            BULK_BUDGET_BESIDE_FAST
        } else if self.fast_recent {
            BULK_BUDGET_WHILE_FAST
        } else {
            BULK_BUDGET
        };
        self.bulk_spent < budget
    }

    fn took_fast(&mut self, cmd: &Command) {
        self.fast += 1;
        if matches!(cmd, Command::Send(_)) {
            self.fast_sends += 1;
        }
    }
}

/// The batch the engine is deciding: commands join it as they arrive, and it goes to the
/// store as soon as the store is free, so a batch holds whatever came while the previous one
/// was being committed.
#[derive(Default)]
struct OpenBatch {
    changes: Changes,
    events: Vec<Event>,
    replies: Vec<(ReplyTo, Result<Reply, DomainError>)>,
    share: BatchShare,
    started: Option<Instant>,
}

impl OpenBatch {
    fn is_empty(&self) -> bool {
        self.replies.is_empty()
    }

    /// Refuses every command of the batch (its decisions are void) and empties it.
    fn refuse(&mut self) {
        answer_all_unavailable(std::mem::take(self).replies.into_iter().map(|(r, _)| r));
    }
}

/// A batch decided by the engine, on its way to the store.
struct Decided {
    /// The engine's number of this batch ([`Engine::committed`] takes it).
    batch: u64,
    changes: Changes,
    events: Vec<Event>,
    replies: Vec<(ReplyTo, Result<Reply, DomainError>)>,
    started: Instant,
}

/// What the committer tells the decider of each batch it was handed.
struct Outcome {
    batch: u64,
    committed: bool,
}

/// Decides batches while the previous one commits. Owns the engine: takes commands as they
/// come, loads what the engine needs (from a read connection, so loading does not wait for
/// the commit in flight; see `load` for when it waits for the tables), applies them to the open batch, and hands the batch to the committer as soon as
/// the committer is free. One batch commits at a time, and the next is handed over only once
/// the committer has said how the previous one ended; so when a commit fails, the only batch
/// decided on top of it is the open one, which is refused with it.
async fn decide(
    store: Arc<dyn Store>,
    mut engine: Engine,
    mut queues: Queues,
    to_commit: mpsc::Sender<Decided>,
    mut outcomes: mpsc::UnboundedReceiver<Outcome>,
    gate: Option<crate::lag::Gate>,
) {
    let mut open = OpenBatch::default();
    let mut in_flight = 0usize;
    let mut closed = false;
    let mut arrived = Vec::new();
    let mut clock = DecisionClock::after(engine.newest_id_ms());
    // Set when the engine forgot what it knew (a failed commit, a failed eviction): its next
    // load first waits until the tables hold every acknowledged batch (see `load`).
    let mut stale = false;
    let mut gate = gate.unwrap_or_else(crate::lag::Gate::start);
    // When a send of the fast tier (a single chat, a small group) was last taken: while
    // they come, bulk work waits for a gate that is open only while the runtime keeps
    // time. Alone, a flood takes what it can.
    let mut fast_send_at: Option<Instant> = None;
    // Since when bulk work has been waiting; once this is BULK_MAX_WAIT old it is overdue
    // (let in past a shut gate, and beside fast sends), until a batch takes some.
    let mut bulk_waiting_since: Option<Instant> = None;
    // When a batch that took bulk work was handed over: while fast sends come on a strained
    // machine (see `Pacing`), the next may take some only BULK_PACE later.
    let mut bulk_taken_at: Option<Instant> = None;
    // When the gate was last found shut: for a while after, bulk batches are paced too.
    let mut gate_shut_at: Option<Instant> = None;
    loop {
        // Caches past their bound are dropped only when nothing decided is uncommitted and
        // the tables hold every batch (until then the cache is the only place that shows
        // what those batches changed); meanwhile no new command is taken.
        let evicting = engine.caches_full();
        if evicting && open.is_empty() && in_flight == 0 {
            match store.caught_up().await {
                Ok(()) => engine.evict_caches(),
                Err(e) => {
                    tracing::error!(error = %e, "the tables did not catch up; every cache dropped");
                    engine.reset();
                    stale = true;
                }
            }
            continue;
        }
        let room = MAX_BATCH.saturating_sub(open.replies.len() + arrived.len());
        let taking = !closed && !evicting && room > 0;
        // Bulk work joins a batch only when it is about to go (the store is idle), once it
        // is known whether fast commands are in it (see BULK_BUDGET_BESIDE_FAST), and,
        // while single chats and small groups are sending, only while the runtime keeps
        // time (`lag::Gate`) and, once it has not lately, BULK_PACE apart: a flood then gets
        // the CPU they leave rather than delaying them.
        let fast_recent = fast_send_at.is_some_and(|t| t.elapsed() < FAST_SENDS_RECENT);
        let bulk_waiting = queues.bulk_waiting();
        if !bulk_waiting {
            // What waited was taken (bulk work leaves its queue no other way).
            if let Some(since) = bulk_waiting_since.take() {
                record_bulk_wait(since);
            }
        } else if bulk_waiting_since.is_none() {
            bulk_waiting_since = Some(Instant::now());
        }
        let overdue = bulk_waiting_since.is_some_and(|t| t.elapsed() >= BULK_MAX_WAIT);
        open.share.bulk_overdue = overdue;
        open.share.fast_recent = fast_recent;
        let gated = in_flight == 0 && fast_recent && bulk_waiting && !overdue && !gate.is_open();
        if gated {
            gate_shut_at = Some(Instant::now());
        }
        let paced_until = Pacing {
            bulk_taken_at,
            gate_shut_at,
            fast_recent,
            overdue,
        }
        .until(Instant::now());
        let bulk = in_flight == 0 && !gated && paced_until.is_none();
        if taking {
            queues.take_ready(room, bulk, &mut open.share, &mut arrived);
        }
        // Each decision costs a load from the store, so commands are decided at once only
        // when the store is idle (the batch then goes right away); while it commits they are
        // decided in chunks, and the rest when it is done.
        let room = MAX_BATCH.saturating_sub(open.replies.len() + arrived.len());
        // With the store idle and a batch ready, the batch goes first (the select below):
        // deciding more before it would keep the store waiting as long as commands arrive.
        let store_idle_and_empty = in_flight == 0 && open.is_empty();
        if !arrived.is_empty()
            && (store_idle_and_empty || arrived.len() >= DECIDE_CHUNK || room == 0)
        {
            if open.share.fast_sends > 0 {
                fast_send_at = Some(Instant::now());
            }
            decide_into(
                &*store,
                &mut engine,
                &mut stale,
                &mut open,
                &mut arrived,
                &mut clock,
            )
            .await;
            continue;
        }
        if closed && open.is_empty() && arrived.is_empty() && in_flight == 0 {
            return;
        }
        tokio::select! {
            biased;
            Some(o) = outcomes.recv() => {
                in_flight -= 1;
                if o.committed {
                    engine.committed(o.batch);
                } else {
                    // The open batch was decided on top of the failed one.
                    engine.reset();
                    stale = true;
                    open.refuse();
                }
            }
            // Handed over only when the committer is idle: until then the batch grows with
            // what arrives, so a busy store gets fewer, larger commits.
            permit = to_commit.reserve(), if !open.is_empty() && in_flight == 0 => {
                let Ok(permit) = permit else {
                    tracing::error!("the committer is gone");
                    open.refuse();
                    answer_all_unavailable(arrived.drain(..).map(|e| e.reply));
                    return;
                };
                let mut b = std::mem::take(&mut open);
                // The batch took bulk work: that wait is over (work still waiting starts
                // a new one at the next pass).
                if b.share.bulk_spent > 0 {
                    bulk_taken_at = Some(Instant::now());
                    if let Some(since) = bulk_waiting_since.take() {
                        record_bulk_wait(since);
                    }
                }
                let batch = engine.seal(&mut b.changes);
                permit.send(Decided {
                    batch,
                    changes: b.changes,
                    events: b.events,
                    replies: b.replies,
                    started: b.started.unwrap_or_else(Instant::now),
                });
                in_flight += 1;
            }
            // While fast sends come, bulk work arriving now is parked, so that the gate is
            // asked (above) before it is taken.
            e = queues.next(bulk, !fast_recent, &mut open.share), if taking => match e {
                Next::Command(e) => arrived.push(e),
                Next::BulkWaiting => {}
                Next::Closed => closed = true,
            },
            _ = gate.opened(
                bulk_waiting_since.map_or_else(tokio::time::Instant::now, |t| (t + BULK_MAX_WAIT).into()),
            ), if gated && taking => {}
            _ = tokio::time::sleep_until(paced_until.unwrap_or_else(Instant::now).into()),
                if paced_until.is_some() && bulk_waiting && taking && in_flight == 0 => {}
        }
    }
}

/// Runs the decider and, should it panic (a broken invariant: it stops rather than decide a
/// batch the tables would refuse after its senders had their acks), marks the pipeline
/// stopped and says so loudly, so that `/healthz` and `/readyz` fail and a supervisor
/// restarts the process (the journal holds every acknowledged batch) instead of every
/// write failing quietly. (The commands of the chunk being decided are dropped with it:
/// each caller, over HTTP or WebSocket, is answered `unavailable`.)
async fn stop_flagged(decider: impl Future<Output = ()>, stats: Arc<PipelineStats>) {
    use futures_util::FutureExt;
    if std::panic::AssertUnwindSafe(decider)
        .catch_unwind()
        .await
        .is_err()
    {
        stats.decider_stopped.store(true, Ordering::Relaxed);
        tracing::error!(
            "the decider stopped on a panic: every write answers unavailable until a restart"
        );
    }
}

/// How long bulk work waited before a batch took it (the commit in flight, the gate, single
/// chats' sends): operators see what a flood is made to wait. Work taken as it arrived
/// waited for nothing and is not counted.
fn record_bulk_wait(since: Instant) {
    metrics::histogram!("pigeon_bulk_wait_seconds").record(since.elapsed().as_secs_f64());
}

/// Loads what `arrived` needs and applies it to the open batch (emptying `arrived`). If the
/// store cannot be read, these commands are refused; the batch goes on.
async fn decide_into(
    store: &dyn Store,
    engine: &mut Engine,
    stale: &mut bool,
    open: &mut OpenBatch,
    arrived: &mut Vec<Envelope>,
    clock: &mut DecisionClock,
) {
    open.started.get_or_insert_with(Instant::now);
    let (cmds, replies): (Vec<Command>, Vec<ReplyTo>) =
        arrived.drain(..).map(|e| (e.cmd, e.reply)).unzip();
    let load_started = Instant::now();
    if let Err(e) = load(store, engine, stale, &cmds).await {
        tracing::error!(error = %e, commands = cmds.len(), "loading state failed; commands refused");
        answer_all_unavailable(replies);
        if open.is_empty() {
            // Nothing of this batch was decided: its share of the bulk queue starts over, or
            // a batch that never goes would keep the bulk queue waiting.
            *open = OpenBatch::default();
        }
        return;
    }
    // One sample per decision step (several per batch), store read included.
    metrics::histogram!("pigeon_load_seconds").record(load_started.elapsed().as_secs_f64());
    let now = clock.next();
    for (cmd, reply) in cmds.into_iter().zip(replies) {
        let result = engine.apply(cmd, now, &mut open.changes, &mut open.events);
        open.replies.push((reply, result));
    }
}

/// Commits decided batches in order, each as one unit (`Store::commit`), and only then answers and
/// pushes. Tells the decider of every batch whether it committed.
async fn commit(
    store: Arc<dyn Store>,
    mut decided: mpsc::Receiver<Decided>,
    outcomes: mpsc::UnboundedSender<Outcome>,
    large_set: LargeConversations,
    delivery: Tiers,
    stats: Arc<PipelineStats>,
) {
    while let Some(d) = decided.recv().await {
        let n = d.replies.len();
        let outcome = |committed| Outcome {
            batch: d.batch,
            committed,
        };
        let counts = BatchCounts::of(&d.changes);
        let commit_started = Instant::now();
        let wrote = !d.changes.is_empty();
        let committed = if wrote {
            store.commit(d.changes).await
        } else {
            Ok(())
        };
        if let Err(e) = committed {
            if matches!(e, pigeon_core::StoreError::Conflict(_)) {
                tracing::error!(error = %e, batch = n, "the store refused a batch the engine decided (a bug); batch refused and state reloaded");
            } else {
                tracing::error!(error = %e, batch = n, "commit failed; batch refused and state reloaded");
            }
            stats.commit_failed();
            let _ = outcomes.send(outcome(false));
            answer_all_unavailable(d.replies.into_iter().map(|(r, _)| r));
            continue;
        }
        if wrote {
            // Only a batch that reached the store shows it takes writes again (a barrier or a
            // duplicate send writes nothing).
            stats.commit_succeeded();
        }
        let _ = outcomes.send(outcome(true));
        metrics::histogram!("pigeon_store_commit_seconds")
            .record(commit_started.elapsed().as_secs_f64());
        metrics::histogram!("pigeon_batch_size").record(n as f64);
        // From the batch's first decision to its durable commit: what its first command waited.
        metrics::histogram!("pigeon_batch_seconds").record(d.started.elapsed().as_secs_f64());
        stats.record(n, &counts);
        if !deliver_batch(d.replies, d.events, &large_set, &delivery).await {
            tracing::error!("a delivery task is gone");
            return;
        }
    }
}

/// Hands a committed batch's answers and events to the delivery tasks. A conversation whose
/// send in this batch reached more than [`LARGE_TIER_MEMBERS`] joins the large set (sticky,
/// with the cost of one send into it; see [`BULK_BUDGET`]); every ack, push and receipt of a
/// conversation in that set goes to the bulk delivery task, everything else to the fast
/// one, so one conversation's frames keep their order from batch to batch. (The batch in
/// which a conversation joins is the one place where its earlier frames, still queued on
/// the fast task, may be passed: clients fill such a gap from `pull`.) False when a
/// delivery task is gone.
async fn deliver_batch(
    replies: Vec<(ReplyTo, Result<Reply, DomainError>)>,
    events: Vec<Event>,
    large_set: &LargeConversations,
    delivery: &Tiers,
) -> bool {
    let joining: Vec<(pigeon_proto::ConversationId, u64)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Message {
                message,
                recipients,
            } if recipients.len() > LARGE_TIER_MEMBERS => {
                let n = recipients.len() as u64;
                let write_fanout = recipients.first().is_some_and(|r| r.user_seq.is_some());
                let cost = if write_fanout { n } else { (n / 20).max(1) };
                pigeon_proto::ConversationId::parse(&message.conversation_id)
                    .ok()
                    .map(|c| (c, cost))
            }
            _ => None,
        })
        .collect();
    if !joining.is_empty() {
        large_set.write().expect("large set lock").extend(joining);
    }
    let (mut fast, mut bulk) = (Delivery::default(), Delivery::default());
    {
        let large = large_set.read().expect("large set lock");
        // Message events name their conversation as a string: parsed once per conversation.
        let mut message_in_large: HashMap<&str, bool> = HashMap::new();
        let mut in_large = Vec::with_capacity(events.len());
        for e in &events {
            in_large.push(match e {
                Event::Message { message, .. } => {
                    let id = message.conversation_id.as_str();
                    *message_in_large.entry(id).or_insert_with(|| {
                        pigeon_proto::ConversationId::parse(id)
                            .is_ok_and(|c| large.contains_key(&c))
                    })
                }
                Event::Receipt { conversation, .. } => large.contains_key(conversation),
                Event::SettingsChanged { .. } => false,
            });
        }
        for (reply, result) in replies {
            match reply {
                ReplyTo::Caller(tx) => {
                    let _ = tx.send(result.map_err(PipelineError::from));
                }
                ReplyTo::Connection(reply) => {
                    let (to, req) = reply.take();
                    let in_large = matches!(&result, Ok(Reply::SendAck(a)) if large.contains_key(&a.conversation_id));
                    if let Some(frame) = connection_reply(req, result) {
                        if in_large { &mut bulk } else { &mut fast }
                            .replies
                            .push((to, frame));
                    }
                }
                ReplyTo::AfterDelivery { tx, tier } => match tier {
                    Tier::Fast => &mut fast,
                    Tier::Bulk => &mut bulk,
                }
                .after
                .push((tx, result.map_err(PipelineError::from))),
                ReplyTo::Nobody => {}
            }
        }
        for (e, in_large) in events.into_iter().zip(in_large) {
            if in_large { &mut bulk } else { &mut fast }.events.push(e);
        }
    }
    let fast_ok = fast.is_empty() || delivery.fast.send(fast).await.is_ok();
    let bulk_ok = bulk.is_empty() || delivery.bulk.send(bulk).await.is_ok();
    fast_ok && bulk_ok
}

/// Loads what `cmds` need that the engine does not hold. `Store::load` reads the tables as
/// they are, which may still lack journaled batches; that is safe for conversations, their
/// members and users' inbox heads, which the engine keeps from the batch that changes them
/// until it evicts, and it evicts only once the tables hold every batch, and for idempotency
/// keys, which the store answers against every journaled batch (see `Store::load`).
/// Messages leave the engine's memory once their batch is journaled, and a reset forgets
/// everything (`stale`): those loads wait for the tables to catch up first.
async fn load(
    store: &dyn Store,
    engine: &mut Engine,
    stale: &mut bool,
    cmds: &[Command],
) -> Result<(), pigeon_core::StoreError> {
    // A recall needs its message before its conversation: at most a few rounds. A round
    // that asks what the last one did would learn nothing more: what is left names users
    // who are not registered (a registration in this chunk, an invitation of a made-up
    // id), whose commands the engine decides without them.
    let mut asked: Option<Needs> = None;
    for _ in 0..4 {
        let needs = engine.needs(cmds);
        if needs.is_empty() || asked.as_ref() == Some(&needs) {
            return Ok(());
        }
        if *stale || !needs.messages.is_empty() {
            store.caught_up().await?;
            *stale = false;
        }
        let started = Instant::now();
        let loaded = store.load(needs.clone()).await?;
        metrics::histogram!("pigeon_store_load_seconds").record(started.elapsed().as_secs_f64());
        engine.absorb(loaded, &needs);
        asked = Some(needs);
    }
    Ok(())
}

fn answer_all_unavailable(replies: impl IntoIterator<Item = ReplyTo>) {
    for r in replies {
        match r {
            ReplyTo::Caller(tx) | ReplyTo::AfterDelivery { tx, .. } => {
                let _ = tx.send(Err(PipelineError::Unavailable));
            }
            ReplyTo::Connection(mut reply) => reply.answer_unavailable(),
            ReplyTo::Nobody => {}
        }
    }
}

/// The frame a connection gets for a command it sent: `send_ack` or an error; for a command
/// whose success has no frame of its own (`read`), `ok` when it carried a `req`.
fn connection_reply(req: Option<i64>, result: Result<Reply, DomainError>) -> Option<String> {
    match result {
        Ok(Reply::SendAck(ack)) => Some(ServerFrame::SendAck { req, ack }.to_json()),
        Ok(_) => req.map(|req| ServerFrame::Ok { req }.to_json()),
        Err(e) => Some(error_frame(req, &PipelineError::Domain(e))),
    }
}

pub fn error_frame(req: Option<i64>, e: &PipelineError) -> String {
    let (code, message) = match e {
        PipelineError::Domain(d) => (d.code(), d.to_string()),
        PipelineError::Unavailable => (pigeon_proto::ErrorCode::Unavailable, e.to_string()),
    };
    ServerFrame::Error {
        req,
        code,
        message,
        retry_after_ms: None,
    }
    .to_json()
}

impl Delivery {
    fn is_empty(&self) -> bool {
        self.replies.is_empty() && self.events.is_empty() && self.after.is_empty()
    }
}

async fn deliver(mut rx: mpsc::Receiver<Delivery>, hub: Arc<Hub>) {
    while let Some(d) = rx.recv().await {
        for (to, frame) in d.replies {
            hub.send_to_connection(to, frame);
        }
        hub.publish(d.events);
        for (tx, result) in d.after {
            let _ = tx.send(result);
        }
    }
}

/// The time each decision step stamps on what it decides (`created_at`, a conversation's
/// `updated_at`): the wall clock, but never earlier than the previous step's, so that what
/// is decided later is never older (a time-bounded history page finds its seqs by a binary
/// search on `created_at`). Steps within one millisecond share it: a stamp that had to be
/// later than the one before would gain on the wall clock whenever steps come faster than
/// one a millisecond, and keep the lead. Order is by `seq`; message ids stay unique by their
/// sequence bits, and the conversation list breaks a tie of `updated_at` by the newest
/// message id. Commands decided together share it.
#[derive(Default)]
struct DecisionClock {
    last: i64,
}

impl DecisionClock {
    /// A clock whose first step is no earlier than `newest` (the store's newest message), so
    /// that a wall clock set back across a restart does not step it back: time-bounded history
    /// pages rely on `created_at` never decreasing along a conversation's seqs. A store
    /// stamped far ahead (a clock that was wrong) holds stamps ahead until the wall clock
    /// catches up, as message ids do; that is said once, at start.
    fn after(newest: i64) -> Self {
        let ahead = newest - now_ms();
        if ahead > 60_000 {
            tracing::warn!(
                ahead_secs = ahead / 1000,
                "the newest stored message is stamped ahead of this machine's clock; \
                 new messages are stamped after it until the clock catches up"
            );
        }
        DecisionClock { last: newest }
    }

    fn next(&mut self) -> i64 {
        self.last = now_ms().max(self.last);
        self.last
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::Outgoing;
    use pigeon_core::command::{SendCommand, SendTo};
    use pigeon_proto::views::SendAck;
    use pigeon_proto::{ClientMsgId, ConversationId, UserId};
    use std::time::Duration;

    /// A pipeline over a real store in a fresh directory, whose engine caches at most
    /// `max_cached` conversations, with users 1..=12 registered.
    async fn pipeline_over_store(
        name: &str,
        max_cached: usize,
    ) -> (Arc<dyn Store>, Pipeline, TempDir) {
        pipeline_over_store_gated(name, max_cached, 12, None).await
    }

    /// A pipeline over a real store in a fresh directory, with users 1..=`users`
    /// registered and the bulk tier's gate given (`None`: the probe's).
    async fn pipeline_over_store_gated(
        name: &str,
        max_cached: usize,
        users: u64,
        gate: Option<crate::lag::Gate>,
    ) -> (Arc<dyn Store>, Pipeline, TempDir) {
        let cfg = pigeon_core::engine::EngineConfig {
            max_cached_conversations: max_cached,
            ..Default::default()
        };
        pipeline_with_engine(name, Engine::new(cfg, 0), users, gate).await
    }

    /// A pipeline of `engine` over a real store in a fresh directory, with users
    /// 1..=`users` registered.
    async fn pipeline_with_engine(
        name: &str,
        engine: Engine,
        users: u64,
        gate: Option<crate::lag::Gate>,
    ) -> (Arc<dyn Store>, Pipeline, TempDir) {
        let dir = TempDir(std::env::temp_dir().join(format!(
            "pigeon-pipeline-{name}-{}-{}",
            std::process::id(),
            now_ms()
        )));
        let store: Arc<dyn Store> = Arc::new(
            pigeon_store_sqlite::SqliteStore::open(&dir.0, pigeon_store_sqlite::Durability::Os)
                .unwrap(),
        );
        let (pipeline, _task) =
            Pipeline::start_with_gate(store.clone(), engine, Arc::new(Hub::default()), gate);
        for n in 1..=users {
            pipeline
                .call(Command::UpsertUser {
                    user: user(n),
                    name: Some(format!("u{n}")),
                    avatar: Some(String::new()),
                })
                .await
                .unwrap();
        }
        (store, pipeline, dir)
    }

    /// A store whose tables never catch up with what it acknowledged: `caught_up` never
    /// returns; everything else is the real store's.
    struct TablesNeverCatchUp(Arc<dyn Store>);

    #[async_trait::async_trait]
    impl Store for TablesNeverCatchUp {
        async fn load(
            &self,
            needs: pigeon_core::store::Needs,
        ) -> Result<pigeon_core::store::Loaded, pigeon_core::StoreError> {
            self.0.load(needs).await
        }
        async fn caught_up(&self) -> Result<(), pigeon_core::StoreError> {
            std::future::pending().await
        }
        async fn commit(&self, changes: Changes) -> Result<(), pigeon_core::StoreError> {
            self.0.commit(changes).await
        }
        async fn close(&self) {
            self.0.close().await
        }
        async fn max_msg_id(&self) -> Result<u64, pigeon_core::StoreError> {
            self.0.max_msg_id().await
        }
        async fn idempotency_key_count(&self) -> Result<u64, pigeon_core::StoreError> {
            self.0.idempotency_key_count().await
        }
        async fn idempotency_keys(
            &self,
            after: Option<pigeon_core::store::KeyCursor>,
            limit: usize,
        ) -> Result<pigeon_core::store::KeyPage, pigeon_core::StoreError> {
            self.0.idempotency_keys(after, limit).await
        }
        async fn meta_get(&self, key: &str) -> Result<Option<String>, pigeon_core::StoreError> {
            self.0.meta_get(key).await
        }
        async fn meta_set(&self, key: &str, value: &str) -> Result<(), pigeon_core::StoreError> {
            self.0.meta_set(key, value).await
        }
        async fn user(
            &self,
            user: UserId,
        ) -> Result<Option<pigeon_core::store::UserRecord>, pigeon_core::StoreError> {
            self.0.user(user).await
        }
        async fn membership(
            &self,
            conv: &ConversationId,
            user: UserId,
        ) -> Result<Option<pigeon_core::store::Membership>, pigeon_core::StoreError> {
            self.0.membership(conv, user).await
        }
        async fn conversation_exists(
            &self,
            conv: &ConversationId,
        ) -> Result<bool, pigeon_core::StoreError> {
            self.0.conversation_exists(conv).await
        }
        async fn history(
            &self,
            conv: &ConversationId,
            reader: UserId,
            range: (u64, u64),
            query: pigeon_core::store::HistoryQuery,
        ) -> Result<(Vec<pigeon_proto::Message>, bool), pigeon_core::StoreError> {
            self.0.history(conv, reader, range, query).await
        }
        async fn conversations(
            &self,
            user: UserId,
            only: Option<&ConversationId>,
            after: Option<pigeon_core::store::ListCursor>,
            limit: u32,
            include_hidden: bool,
        ) -> Result<Vec<pigeon_proto::views::ConversationView>, pigeon_core::StoreError> {
            self.0
                .conversations(user, only, after, limit, include_hidden)
                .await
        }
        async fn members(
            &self,
            conv: &ConversationId,
            after: Option<UserId>,
            limit: u32,
        ) -> Result<Vec<pigeon_proto::views::MemberView>, pigeon_core::StoreError> {
            self.0.members(conv, after, limit).await
        }
        async fn message(
            &self,
            msg_id: pigeon_proto::MsgId,
        ) -> Result<Option<pigeon_core::store::AuditedMessage>, pigeon_core::StoreError> {
            self.0.message(msg_id).await
        }
        async fn versions(
            &self,
            msg_id: pigeon_proto::MsgId,
        ) -> Result<Vec<pigeon_proto::views::VersionView>, pigeon_core::StoreError> {
            self.0.versions(msg_id).await
        }
        async fn is_hidden_for(
            &self,
            user: UserId,
            msg_id: pigeon_proto::MsgId,
        ) -> Result<bool, pigeon_core::StoreError> {
            self.0.is_hidden_for(user, msg_id).await
        }
        async fn inbox_head(&self, user: UserId) -> Result<u64, pigeon_core::StoreError> {
            self.0.inbox_head(user).await
        }
        async fn pull_inbox(
            &self,
            user: UserId,
            from: u64,
            to: u64,
            limit: u32,
        ) -> Result<(Vec<pigeon_proto::views::ChainItem>, bool), pigeon_core::StoreError> {
            self.0.pull_inbox(user, from, to, limit).await
        }
        async fn cursor(
            &self,
            user: UserId,
            device: &str,
            chain: &str,
        ) -> Result<u64, pigeon_core::StoreError> {
            self.0.cursor(user, device, chain).await
        }
        async fn read_fanout_changes(
            &self,
            user: UserId,
            device: &str,
            given: &HashMap<String, u64>,
        ) -> Result<Vec<pigeon_proto::frames::SyncConversation>, pigeon_core::StoreError> {
            self.0.read_fanout_changes(user, device, given).await
        }
        async fn unread(
            &self,
            user: UserId,
        ) -> Result<Vec<(ConversationId, u64, bool)>, pigeon_core::StoreError> {
            self.0.unread(user).await
        }
        async fn receipts(
            &self,
            conv: &ConversationId,
            seq: u64,
        ) -> Result<(Vec<UserId>, Vec<UserId>), pigeon_core::StoreError> {
            self.0.receipts(conv, seq).await
        }
    }

    /// A resend of an acknowledged message whose key the engine no longer holds is found a
    /// duplicate by the store without waiting for its tables (here they never catch up):
    /// before, every such look-up waited for the applier, and held the decider with it.
    #[tokio::test]
    async fn a_resend_is_found_a_duplicate_without_waiting_for_the_tables() {
        // Users registered by a first pipeline, which then goes; the tables hold them
        // before the second starts, as they do at a start.
        let (store, registering, dir) = pipeline_over_store("no-catch-up", 1000).await;
        drop(registering);
        store.caught_up().await.unwrap();
        let store: Arc<dyn Store> = Arc::new(TablesNeverCatchUp(store));
        let (pipeline, _task) = Pipeline::start_with_gate(
            store,
            Engine::new(Default::default(), 0),
            Arc::new(Hub::default()),
            None,
        );
        let within = |f| tokio::time::timeout(Duration::from_secs(10), f);
        let first = within(send(&pipeline, 1, 2, "k-1"))
            .await
            .expect("answered");
        // A later batch goes only once the first one's outcome is in: by then the engine
        // has let go of the first key.
        within(send(&pipeline, 3, 4, "k-2"))
            .await
            .expect("answered");
        let again = within(send(&pipeline, 1, 2, "k-1"))
            .await
            .expect("a duplicate check does not wait for the tables");
        assert!(again.duplicate, "{again:?}");
        assert_eq!((again.msg_id, again.seq), (first.msg_id, first.seq));
        drop(dir);
    }

    #[tokio::test]
    async fn a_decider_that_panics_marks_the_pipeline_stopped() {
        let stats = Arc::new(PipelineStats::default());
        stop_flagged(async {}, stats.clone()).await;
        assert!(
            !stats.decider_stopped(),
            "an ending decider is not a stopped one"
        );
        stop_flagged(async { panic!("a broken invariant") }, stats.clone()).await;
        assert!(stats.decider_stopped());
    }

    #[tokio::test]
    async fn a_websocket_command_dropped_by_a_panicking_decider_is_answered_unavailable() {
        let hub = Arc::new(Hub::default());
        let registered = hub.register(user(3), pigeon_proto::DeviceId::parse("d").unwrap());
        let mut reader = registered.reader;
        let to = hub.address(user(3), registered.registration.id());
        let stats = Arc::new(PipelineStats::default());
        let held = ReplyTo::Connection(ConnectionReply::new(hub.clone(), to, Some(7)));
        stop_flagged(
            async move {
                let _in_the_batch = held;
                panic!("a broken invariant")
            },
            stats,
        )
        .await;
        let Some(Outgoing::Frame(frame)) = reader.try_recv() else {
            panic!("the command was left unanswered");
        };
        let frame: serde_json::Value = serde_json::from_str(frame.as_str()).unwrap();
        assert_eq!(frame["type"], "error");
        assert_eq!(frame["req"], 7);
        assert_eq!(frame["code"], "unavailable");
        assert!(reader.try_recv().is_none(), "answered once");

        // A reply taken by whoever answers, or disarmed for a caller that answers the
        // error itself, sends nothing more.
        ReplyTo::Connection(ConnectionReply::new(hub.clone(), to, Some(8))).disarm();
        let (_, req) = ConnectionReply::new(hub.clone(), to, Some(9)).take();
        assert_eq!(req, Some(9));
        assert!(reader.try_recv().is_none());
        // A reply to another node's connection, or to one gone, goes nowhere.
        let elsewhere = crate::hub::ConnectionAddr { node: 9, ..to };
        hub.send_to_connection(elsewhere, "{}".into());
        let gone = crate::hub::ConnectionAddr {
            id: to.id + 1,
            ..to
        };
        hub.send_to_connection(gone, "{}".into());
        assert!(reader.try_recv().is_none());
        hub.send_to_connection(to, "{}".into());
        assert!(reader.try_recv().is_some());
    }

    /// A test's data directory, removed when the test ends, passed or not.
    struct TempDir(std::path::PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn user(n: u64) -> UserId {
        UserId::new(n).unwrap()
    }

    /// A text send of "x".
    fn text_send(sender: UserId, to: SendTo, cmid: &str) -> Command {
        Command::Send(SendCommand::text(
            sender,
            to,
            ClientMsgId::parse(cmid).unwrap(),
            "x",
        ))
    }

    async fn send(pipeline: &Pipeline, from: u64, to: u64, cmid: &str) -> SendAck {
        let cmd = text_send(user(from), SendTo::User(user(to)), cmid);
        let reply = pipeline.call(cmd).await.unwrap();
        match reply {
            Reply::SendAck(ack) => ack,
            other => panic!("not an ack: {other:?}"),
        }
    }

    /// A group of 120 (users 1..=120) that has had a send, so its sends go to the bulk tier.
    async fn large_group(pipeline: &Pipeline) -> ConversationId {
        let reply = pipeline
            .call(Command::CreateGroup {
                owner: user(1),
                name: "flood".into(),
                members: (2..=120).map(user).collect(),
            })
            .await
            .unwrap();
        let Reply::Conversation(group) = reply else {
            panic!("not a conversation: {reply:?}");
        };
        pipeline
            .call(text_send(
                user(1),
                SendTo::Conversation(group.clone()),
                "g-0",
            ))
            .await
            .unwrap();
        assert!(
            pipeline.large.read().unwrap().contains_key(&group),
            "a send to 120 members puts the group in the bulk tier"
        );
        group
    }

    /// A pipeline whose bulk tier's gate stays shut, with the large group of `large_group`.
    /// Keep the switch: a gate whose switch is gone never waits.
    async fn large_group_behind_a_shut_gate(
        name: &str,
    ) -> (
        Pipeline,
        ConversationId,
        TempDir,
        tokio::sync::watch::Sender<bool>,
    ) {
        let (gate, switch) = crate::lag::Gate::manual(false);
        let (_store, pipeline, dir) =
            pipeline_over_store_gated(name, 10_000, 120, Some(gate)).await;
        let group = large_group(&pipeline).await;
        (pipeline, group, dir, switch)
    }

    /// Single chats that keep sending, a batch of their own every 10 ms, until aborted; they
    /// have begun when this returns.
    async fn single_chats_sending(pipeline: &Pipeline) -> tokio::task::JoinHandle<()> {
        let chats = pipeline.clone();
        let chatter = tokio::spawn(async move {
            for i in 0.. {
                send(&chats, 2 + i % 2, 3 - i % 2, &format!("c-{i}")).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        chatter
    }

    /// `n` sends at once by user 1 into `group` (client ids `{prefix}-1`...); asserts each
    /// is acknowledged.
    async fn flood(pipeline: &Pipeline, group: &ConversationId, prefix: &str, n: usize) {
        let replies = futures_util::future::join_all((1..=n).map(|i| {
            pipeline.call(text_send(
                user(1),
                SendTo::Conversation(group.clone()),
                &format!("{prefix}-{i}"),
            ))
        }))
        .await;
        for reply in replies {
            assert!(matches!(reply, Ok(Reply::SendAck(_))), "{reply:?}");
        }
    }

    /// While single chats send and the gate is shut, a flood's send waits for the gate, but
    /// never for good: past BULK_MAX_WAIT it goes even though single chats keep sending
    /// (each committing its own batch) and the gate stays shut.
    #[tokio::test]
    async fn a_shut_gate_holds_bulk_sends_beside_single_chats_but_never_for_good() {
        let (pipeline, group, _dir, _switch) = large_group_behind_a_shut_gate("gate-held").await;
        let chatter = single_chats_sending(&pipeline).await;
        let started = Instant::now();
        let flood = pipeline.call(text_send(user(1), SendTo::Conversation(group), "g-1"));
        let reply = tokio::time::timeout(Duration::from_secs(30), flood)
            .await
            .expect("a bulk send held by a shut gate goes after BULK_MAX_WAIT");
        assert!(matches!(reply, Ok(Reply::SendAck(_))), "{reply:?}");
        assert!(
            started.elapsed() >= BULK_MAX_WAIT,
            "beside single chats, a shut gate held the send ({:?})",
            started.elapsed()
        );
        chatter.abort();
    }

    /// Once the gate was found shut beside single chats, bulk batches are paced; paced work
    /// goes when its pace ends even if nothing else wakes the decider (the single chats
    /// stopped, the gate is open, nothing is in flight).
    #[tokio::test]
    async fn paced_bulk_work_goes_when_its_pace_ends_though_nothing_else_happens() {
        let (pipeline, group, _dir, switch) = large_group_behind_a_shut_gate("paced").await;
        let chatter = single_chats_sending(&pipeline).await;
        // Held by the shut gate (which the decider thus finds shut) until overdue.
        let first = pipeline
            .call(text_send(
                user(1),
                SendTo::Conversation(group.clone()),
                "p-0",
            ))
            .await;
        assert!(matches!(first, Ok(Reply::SendAck(_))), "{first:?}");
        chatter.abort();
        switch.send(true).unwrap();
        // Single chats sent within FAST_SENDS_RECENT and the gate was shut within
        // PACED_AFTER_SHUT: six sends of cost 120 go two a batch (BULK_BUDGET_WHILE_FAST),
        // each batch BULK_PACE after the one before.
        let started = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), flood(&pipeline, &group, "p", 6))
            .await
            .expect("paced bulk work goes when its pace ends");
        assert!(
            started.elapsed() >= BULK_PACE * 2,
            "three batches, paced: {:?}",
            started.elapsed()
        );
    }

    /// Alone (no single chat sent lately), a flood does not wait for the gate.
    #[tokio::test]
    async fn a_flood_alone_does_not_wait_for_the_gate() {
        let (pipeline, group, _dir, _switch) = large_group_behind_a_shut_gate("gate-alone").await;
        // The group's first send went by the fast queue (it was not large yet): wait until
        // that no longer counts as a fast send lately.
        tokio::time::sleep(FAST_SENDS_RECENT + Duration::from_millis(100)).await;
        // Sixty sends at once: a batch takes four (BULK_BUDGET), so they queue; held by the
        // shut gate, each batch would wait BULK_MAX_WAIT (1.4 s or more in all). Ungated
        // they take tens of milliseconds; the bound leaves a loaded machine ten times that.
        let started = Instant::now();
        flood(&pipeline, &group, "g", 60).await;
        let elapsed = started.elapsed();
        assert!(
            elapsed < BULK_MAX_WAIT * 10,
            "no fast sends: the shut gate held the flood ({elapsed:?})"
        );
    }

    /// The engine's caches hold two conversations, so nearly every send evicts them; the
    /// applier waits 250 ms before writing journaled batches to the tables, so at each
    /// eviction the tables lag. A conversation loaded again from lagging tables would hand
    /// out a seq twice: eviction must wait for the tables first.
    #[tokio::test]
    async fn seqs_stay_contiguous_when_caches_are_evicted_while_the_tables_lag() {
        let (store, pipeline, _dir) = pipeline_over_store("evict", 2).await;
        for round in 1..=4u64 {
            for pair in 0..6u64 {
                let ack = send(
                    &pipeline,
                    2 * pair + 1,
                    2 * pair + 2,
                    &format!("r{round}p{pair}"),
                )
                .await;
                assert_eq!(ack.seq, round, "pair {pair}");
            }
        }
        for pair in 0..6u64 {
            let conv = ConversationId::single(user(2 * pair + 1), user(2 * pair + 2)).unwrap();
            let query = pigeon_core::store::HistoryQuery {
                anchor: pigeon_core::store::HistoryAnchor::Newest,
                limit: 10,
                from_time: None,
                to_time: None,
            };
            let (msgs, _) = store
                .history(&conv, user(2 * pair + 1), (1, u64::MAX >> 1), query)
                .await
                .unwrap();
            let seqs: Vec<u64> = msgs.iter().map(|m| m.seq).collect();
            assert_eq!(seqs, vec![1, 2, 3, 4], "pair {pair}");
        }
        store.close().await;
    }

    /// The caches hold two conversations, so they are dropped between nearly every batch; a
    /// group send then comes to a group loaded again, whose members' inbox heads must come
    /// with it. Every inbox stays contiguous and every acknowledged message is stored. (The
    /// same after a restart, when the engine knows no user yet, is pinned end to end by
    /// `concurrency::the_first_writes_after_a_restart_continue_every_inbox`.)
    #[tokio::test]
    async fn inboxes_stay_contiguous_when_group_sends_follow_evictions() {
        let (store, pipeline, _dir) = pipeline_over_store("evict-group", 2).await;
        let Reply::Conversation(group) = pipeline
            .call(Command::CreateGroup {
                owner: user(1),
                name: "g".into(),
                members: vec![user(2), user(3)],
            })
            .await
            .unwrap()
        else {
            panic!("not a conversation");
        };
        let mut acks = Vec::new();
        for round in 0..4u64 {
            let cmd = text_send(
                user(round % 3 + 1),
                SendTo::Conversation(group.clone()),
                &format!("g{round}"),
            );
            let Reply::SendAck(ack) = pipeline.call(cmd).await.unwrap() else {
                panic!("not an ack");
            };
            acks.push(ack);
            acks.push(send(&pipeline, 1, 4, &format!("a{round}")).await);
            acks.push(send(&pipeline, 5, 6, &format!("b{round}")).await);
        }
        pipeline.flush().await.unwrap();
        for ack in &acks {
            let conv = ack.conversation_id.clone();
            let query = pigeon_core::store::HistoryQuery {
                anchor: pigeon_core::store::HistoryAnchor::Newest,
                limit: 20,
                from_time: None,
                to_time: None,
            };
            // A member of each: the group's owner, 1 in 1-4, 6 in 5-6.
            let reader = if conv == group || conv.to_string() == "1-4" {
                user(1)
            } else {
                user(6)
            };
            let (msgs, _) = store
                .history(&conv, reader, (1, u64::MAX >> 1), query)
                .await
                .unwrap();
            let stored = msgs.iter().find(|m| m.seq == ack.seq);
            assert_eq!(stored.map(|m| m.msg_id), Some(ack.msg_id), "{ack:?}");
        }
        for u in 1..=6 {
            let (items, _) = store
                .pull_inbox(user(u), 1, u64::MAX >> 1, 200)
                .await
                .unwrap();
            let seqs: Vec<u64> = items.iter().map(|i| i.seq).collect();
            assert_eq!(
                seqs,
                (1..=seqs.len() as u64).collect::<Vec<_>>(),
                "user {u}"
            );
            let expected = match u {
                // created, and 4 group sends; with user 4: 4 more.
                1 => 9,
                2 | 3 => 5,
                _ => 4,
            };
            assert_eq!(seqs.len(), expected, "user {u}");
        }
        store.close().await;
    }

    /// A send again at once: its batch is journaled (so the engine has let go of its ack)
    /// but not in the tables yet (the applier waits 250 ms); the idempotency look-up must
    /// wait for the tables, or the retry becomes a second message.
    #[tokio::test]
    async fn a_retry_of_a_send_the_tables_do_not_hold_yet_is_a_duplicate() {
        let (store, pipeline, _dir) = pipeline_over_store("retry", 1000).await;
        let first = send(&pipeline, 1, 2, "once").await;
        let again = send(&pipeline, 1, 2, "once").await;
        assert_eq!(
            (again.msg_id, again.seq, again.duplicate),
            (first.msg_id, 1, true)
        );
        assert_eq!(send(&pipeline, 1, 2, "next").await.seq, 2);
        store.close().await;
    }

    fn send_to(conv: &ConversationId, n: u64) -> Envelope {
        Envelope {
            cmd: text_send(
                user(1),
                SendTo::Conversation(conv.clone()),
                &format!("m{n}"),
            ),
            reply: ReplyTo::Nobody,
        }
    }

    type Senders = (mpsc::Sender<Envelope>, mpsc::Sender<Envelope>);

    /// Queues holding `fast` sends into a small group and `bulk` sends into a write fan-out
    /// group of 200 (200 rows each), with their senders (which keep them open).
    fn queues(fast: u64, bulk: u64) -> (Queues, Senders) {
        let small = ConversationId::parse("g1").unwrap();
        let big = ConversationId::parse("g2").unwrap();
        let large = LargeConversations::default();
        large.write().unwrap().insert(big.clone(), 200);
        let (ftx, frx) = mpsc::channel(64);
        let (btx, brx) = mpsc::channel(64);
        for n in 0..fast {
            ftx.try_send(send_to(&small, n)).ok().unwrap();
        }
        for n in 0..bulk {
            btx.try_send(send_to(&big, 100 + n)).ok().unwrap();
        }
        let q = Queues {
            fast: frx,
            bulk: brx,
            fast_closed: false,
            bulk_closed: false,
            large,
            parked: None,
        };
        (q, (ftx, btx))
    }

    /// Takes what is ready: (fast commands, flood sends).
    fn take(q: (Queues, Senders), bulk: bool) -> (usize, usize) {
        take_with(q, bulk, BatchShare::default())
    }

    fn take_with(
        (mut q, _open): (Queues, Senders),
        bulk: bool,
        mut share: BatchShare,
    ) -> (usize, usize) {
        let q = &mut q;
        let mut got = Vec::new();
        q.take_ready(MAX_BATCH, bulk, &mut share, &mut got);
        let big = got.iter().filter(|e| q.cost(&e.cmd) > 1).count();
        (got.len() - big, big)
    }

    #[test]
    fn decision_stamps_never_go_back_nor_run_ahead_of_the_clock() {
        let mut clock = DecisionClock::default();
        // Far more steps than milliseconds pass: a clock that stamps each step later than
        // the one before would end seconds ahead.
        let stamps: Vec<i64> = (0..20_000).map(|_| clock.next()).collect();
        let after = now_ms();
        assert!(stamps.windows(2).all(|w| w[1] >= w[0]));
        assert!(stamps[0] >= after - 10_000);
        assert!(
            *stamps.last().unwrap() <= after,
            "{} ms ahead of the wall clock",
            stamps.last().unwrap() - after
        );
    }

    #[test]
    fn a_clock_set_back_across_a_restart_does_not_step_back() {
        // The store's newest message was stamped ten minutes ahead of this wall clock.
        let newest = now_ms() + 600_000;
        let engine = Engine::new(
            Default::default(),
            pigeon_core::snowflake::Snowflake::new(0, 0).next(newest),
        );
        let mut clock = DecisionClock::after(engine.newest_id_ms());
        assert_eq!(clock.next(), newest);
        assert_eq!(clock.next(), newest);
    }

    /// The pipeline's clock starts past the newest id it is given (the store's, at start),
    /// so a send after a restart whose wall clock went back is stamped later than what came
    /// before (or at the same millisecond: never earlier).
    #[tokio::test]
    async fn a_send_after_the_clock_went_back_is_not_stamped_before_the_newest_message() {
        // The store's newest message was stamped ten minutes ahead of this wall clock.
        let newest = now_ms() + 600_000;
        let floor = pigeon_core::snowflake::Snowflake::new(0, 0).next(newest);
        let engine = Engine::new(Default::default(), floor);
        let (_store, pipeline, _dir) = pipeline_with_engine("clock", engine, 2, None).await;
        let first = send(&pipeline, 1, 2, "after-1").await;
        let second = send(&pipeline, 2, 1, "after-2").await;
        assert!(
            first.created_at >= newest,
            "{} < {newest}",
            first.created_at
        );
        assert!(second.created_at >= first.created_at);
        assert!(first.msg_id.get() > floor);
        assert!(second.msg_id.get() > first.msg_id.get());
    }

    #[test]
    fn bulk_work_is_paced_only_beside_single_chats_on_a_strained_machine() {
        let now = Instant::now();
        let strained = Pacing {
            bulk_taken_at: Some(now - Duration::from_millis(1)),
            gate_shut_at: Some(now - Duration::from_millis(500)),
            fast_recent: true,
            overdue: false,
        };
        assert_eq!(
            strained.until(now),
            Some(now - Duration::from_millis(1) + BULK_PACE)
        );
        // The pace has passed.
        let later = now + BULK_PACE;
        assert_eq!(strained.until(later), None);
        let unpaced = [
            (
                "the gate was not shut lately: the machine keeps time",
                Pacing {
                    gate_shut_at: Some(now - PACED_AFTER_SHUT),
                    ..strained
                },
            ),
            (
                "the gate was never shut",
                Pacing {
                    gate_shut_at: None,
                    ..strained
                },
            ),
            (
                "no single chat sent lately: a flood alone",
                Pacing {
                    fast_recent: false,
                    ..strained
                },
            ),
            (
                "bulk work that waited BULK_MAX_WAIT goes",
                Pacing {
                    overdue: true,
                    ..strained
                },
            ),
            (
                "no batch took bulk work yet",
                Pacing {
                    bulk_taken_at: None,
                    ..strained
                },
            ),
        ];
        for (why, pacing) in unpaced {
            assert_eq!(pacing.until(now), None, "{why}");
        }
    }

    #[test]
    fn a_batch_takes_all_fast_work_and_bulk_work_within_its_budget() {
        // Alone, a batch takes flood sends up to BULK_BUDGET (400 rows: two sends of 200).
        assert_eq!(take(queues(0, 10), true), (0, 2));
        // Alone but while single chats send, up to BULK_BUDGET_WHILE_FAST: one send.
        let while_fast = BatchShare {
            fast_recent: true,
            ..BatchShare::default()
        };
        assert_eq!(take_with(queues(0, 10), true, while_fast), (0, 1));
        // Beside fast sends none, so a single chat's commit stays light; once bulk work is
        // overdue, up to BULK_BUDGET_BESIDE_FAST: one send (the first is always allowed),
        // so a flood still moves under steady single chats.
        assert_eq!(take(queues(3, 10), true), (3, 0));
        let overdue = BatchShare {
            bulk_overdue: true,
            ..BatchShare::default()
        };
        assert_eq!(take_with(queues(3, 10), true, overdue), (3, 1));
        // Beside fast commands that are not sends (cursor moves), one send too.
        let (q, open) = queues(0, 10);
        let flush = Envelope {
            cmd: Command::Flush,
            reply: ReplyTo::Nobody,
        };
        open.0.try_send(flush).ok().unwrap();
        assert_eq!(take((q, open), true), (1, 1));
        // While the store commits, bulk work waits for the batch that goes next.
        assert_eq!(take(queues(3, 10), false), (3, 0));
        assert_eq!(take(queues(0, 10), false), (0, 0));
    }
}

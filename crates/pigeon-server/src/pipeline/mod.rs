//! The write pipeline. The edge's commands are routed (`router.rs`) to the partition that
//! owns their conversation: its tier's (single chats, small, medium and large groups), and
//! within the tier one of `--partitions-per-tier` by a hash of the conversation's id. Each
//! partition is one task (`partition.rs`) with its own queue and batch: it decides what
//! arrives with its own conversation stage (`seq`, messages, group rules) and hands each
//! batch, with the messages it appended, to the committer (`committer.rs`). The committer
//! runs the user stage over them (`user_seq`, inbox rows) and commits the batches that are
//! ready as one unit (group commit: in the embedded store, one journal record and one
//! fsync), and only then answers and pushes, through its tier's delivery task. A partition
//! decides its next batch while its last one commits. A flood in a large group is decided,
//! batched and delivered by partitions and a delivery task of its own: single chats never
//! queue behind it.

mod claims;
mod committer;
mod partition;
mod router;
#[cfg(test)]
mod tests;

use crate::hub::{ConnectionAddr, Hub};
use pigeon_core::changes::{Changes, Event};
use pigeon_core::command::{Command, Reply};
use pigeon_core::engine::EngineConfig;
use pigeon_core::error::DomainError;
use pigeon_core::node::NodeShared;
use pigeon_core::store::Store;
use pigeon_proto::frames::ServerFrame;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

pub use pigeon_core::routing::Tier;

/// Most commands a partition decides and commits together.
pub const MAX_BATCH: usize = 1024;
/// Most members of write fan-out messages one partition's batch hands the user stage (its
/// inbox rows): past it the batch takes no more commands, so that a batch of sends into
/// large groups stays about a millisecond of commit beside the single chats committed with
/// it.
pub const MAX_BATCH_FANOUT: usize = 4096;
/// Commands decided together while the partition's last batch commits (one load each time).
pub const DECIDE_CHUNK: usize = 64;
/// Commands waiting for one partition before senders are told `unavailable`.
pub const QUEUE_CAPACITY: usize = 16_384;
/// Partitions of each tier unless configured.
pub const DEFAULT_PARTITIONS_PER_TIER: usize = 2;
/// Most partitions of one tier (routes are kept as bits of a `u64`).
pub const MAX_PARTITIONS_PER_TIER: usize = 16;

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
    /// A barrier (`flush_routes`): answered once the delivery task of its partition's tier
    /// has queued on the outboxes every frame decided before it, so a connection that waited
    /// for it finds its `send_ack`s (and their pushes) queued ahead of the reply it writes
    /// next.
    AfterDelivery(Answer),
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
/// `req`. One dropped unanswered (its partition panicked with it in the batch) answers
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

/// The partition a command went to: what a connection keeps to wait for its own commands
/// (see [`Pipeline::flush_routes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route(u8);

/// A set of [`Route`]s, as bits (kept in every connection, idle or not).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RouteSet(u64);

impl RouteSet {
    /// Every partition.
    pub fn all() -> Self {
        RouteSet(u64::MAX)
    }

    pub fn add(&mut self, route: Route) {
        self.0 |= 1 << route.0;
    }

    pub fn extend(&mut self, other: RouteSet) {
        self.0 |= other.0;
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether any of these is not `route` (`None`: any at all).
    pub fn other_than(self, route: Option<Route>) -> bool {
        let this = route.map_or(0, |r| 1u64 << r.0);
        self.0 & !this != 0
    }

    fn routes(self) -> impl Iterator<Item = usize> {
        (0..64).filter(move |i| self.0 & (1 << i) != 0)
    }
}

/// The handle the edge submits commands with.
#[derive(Clone)]
pub struct Pipeline {
    router: Arc<router::Router>,
    stats: Arc<PipelineStats>,
}

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
    /// A partition or the committer stopped on a panic (a broken invariant, e.g.
    /// the user stage's): every write then answers `unavailable`, and `/readyz` says why
    /// until a restart.
    pipeline_stopped: AtomicBool,
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
    /// Whether a pipeline task stopped on a panic (see [`stop_flagged`]).
    pub fn pipeline_stopped(&self) -> bool {
        self.pipeline_stopped.load(Ordering::Relaxed)
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
    /// Starts `partitions_per_tier` partitions of each tier over `store`, the committer and
    /// the delivery tasks over `hub`. `shared` is what the partitions share (ids, known
    /// idempotency keys, registrations), filled from the store by the caller. Answers the
    /// committer's task.
    pub fn start(
        store: Arc<dyn Store>,
        cfg: EngineConfig,
        shared: Arc<NodeShared>,
        hub: Arc<Hub>,
        partitions_per_tier: usize,
    ) -> (Pipeline, tokio::task::JoinHandle<()>) {
        let per_tier = partitions_per_tier.clamp(1, MAX_PARTITIONS_PER_TIER);
        let stats = Arc::new(PipelineStats::default());
        let clock = Arc::new(DecisionClock::after(shared.newest_id_ms()));
        let claims = Arc::new(claims::KeyClaims::default());
        let (commit_tx, commit_rx) = mpsc::channel(per_tier * Tier::ALL.len());
        let delivery: Vec<mpsc::Sender<Delivery>> = Tier::ALL
            .iter()
            .map(|_| {
                let (tx, rx) = mpsc::channel(64);
                tokio::spawn(deliver(rx, hub.clone()));
                tx
            })
            .collect();
        let mut queues = Vec::new();
        for tier in Tier::ALL {
            for p in 0..per_tier {
                let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
                let index = queues.len();
                queues.push(tx);
                let stage = pigeon_core::conversation_stage::ConversationStage::with_shared(
                    cfg.clone(),
                    shared.clone(),
                );
                let worker = partition::Partition {
                    index,
                    tier,
                    delivery: delivery[tier.index()].clone(),
                    store: store.clone(),
                    stage,
                    claims: claims.clone(),
                    clock: clock.clone(),
                };
                tracing::debug!(tier = tier.name(), partition = p, "partition started");
                tokio::spawn(stop_flagged(
                    worker.run(rx, commit_tx.clone()),
                    stats.clone(),
                ));
            }
        }
        drop(commit_tx);
        let router = Arc::new(router::Router::new(
            queues,
            per_tier,
            shared.clone(),
            store.clone(),
        ));
        let committer = committer::Committer {
            store,
            shared,
            router: Arc::downgrade(&router),
            stats: stats.clone(),
            max_heads: cfg.max_cached_conversations,
        };
        let handle = tokio::spawn(stop_flagged(committer.run(commit_rx), stats.clone()));
        (Pipeline { router, stats }, handle)
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

    /// Waits until everything queued before the call, on every partition, is committed (or
    /// refused) and its frames queued on the outboxes.
    pub async fn flush(&self) -> Result<(), PipelineError> {
        self.flush_routes(RouteSet::all()).await
    }

    /// Waits until everything queued before the call on the partitions of `routes` is
    /// committed (or refused) and its frames queued on the outboxes.
    pub async fn flush_routes(&self, routes: RouteSet) -> Result<(), PipelineError> {
        self.router.flush(routes).await
    }

    /// Queues a command on the partition that owns it; waits only while its queue is full
    /// (or while its conversation moves to another tier). Answers where it went.
    pub async fn submit(&self, cmd: Command, reply: ReplyTo) -> Result<Route, PipelineError> {
        self.router
            .submit(Envelope { cmd, reply })
            .await
            .map(|index| Route(index as u8))
    }

    /// The partition of the single chat of `a` and `b`.
    pub fn route_of_chat(&self, a: pigeon_proto::UserId, b: pigeon_proto::UserId) -> Route {
        Route(self.router.chat_index(a, b) as u8)
    }

    /// The partition `conversation`'s commands go to now; `None` when that takes a look-up
    /// (a group not seen since start) or the group is moving to another tier.
    pub fn route_of(&self, conversation: &pigeon_proto::ConversationId) -> Option<Route> {
        self.router
            .known_index(conversation)
            .map(|index| Route(index as u8))
    }
}

/// What a delivery task sends after a commit, in order.
#[derive(Default)]
pub(super) struct Delivery {
    replies: Vec<(ConnectionAddr, String)>,
    events: Vec<Event>,
    /// Answered once the replies and events before them are queued.
    after: Vec<(Answer, Result<Reply, PipelineError>)>,
}

/// Where a caller waits for its command's result.
type Answer = oneshot::Sender<Result<Reply, PipelineError>>;

/// Runs a partition (or the committer) and, should it panic (a broken invariant: it stops rather than decide a
/// batch the tables would refuse after its senders had their acks), marks the pipeline
/// stopped and says so loudly, so that `/healthz` and `/readyz` fail and a supervisor
/// restarts the process (the journal holds every acknowledged batch) instead of every
/// write failing quietly. (The commands of the chunk being decided are dropped with it:
/// each caller, over HTTP or WebSocket, is answered `unavailable`.)
async fn stop_flagged(task: impl Future<Output = ()>, stats: Arc<PipelineStats>) {
    use futures_util::FutureExt;
    if std::panic::AssertUnwindSafe(task)
        .catch_unwind()
        .await
        .is_err()
    {
        stats.pipeline_stopped.store(true, Ordering::Relaxed);
        tracing::error!(
            "a pipeline task stopped on a panic: every write answers unavailable until a restart"
        );
    }
}

fn answer_all_unavailable(replies: impl IntoIterator<Item = ReplyTo>) {
    for r in replies {
        match r {
            ReplyTo::Caller(tx) | ReplyTo::AfterDelivery(tx) => {
                let _ = tx.send(Err(PipelineError::Unavailable));
            }
            ReplyTo::Connection(mut reply) => reply.answer_unavailable(),
            ReplyTo::Nobody => {}
        }
    }
}

/// The frame a connection gets for a command it sent: `send_ack` or an error; for a command
/// whose success has no frame of its own (`read`), `ok` when it carried a `req`.
fn connection_reply(req: Option<i64>, result: Result<Reply, PipelineError>) -> Option<String> {
    match result {
        Ok(Reply::SendAck(ack)) => Some(ServerFrame::SendAck { req, ack }.to_json()),
        Ok(_) => req.map(|req| ServerFrame::Ok { req }.to_json()),
        Err(e) => Some(error_frame(req, &e)),
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
struct DecisionClock {
    last: AtomicI64,
}

impl DecisionClock {
    /// A clock whose first step is no earlier than `newest` (the store's newest message), so
    /// that a wall clock set back across a restart does not step it back: time-bounded history
    /// pages rely on `created_at` never decreasing along a conversation's seqs. A store
    /// stamped far ahead (a clock that was wrong) holds stamps ahead until the wall clock
    /// catches up, as message ids do; that is said once, at start. One clock for every
    /// partition: a conversation that moves to another tier keeps its stamps in order.
    fn after(newest: i64) -> Self {
        let ahead = newest - now_ms();
        if ahead > 60_000 {
            tracing::warn!(
                ahead_secs = ahead / 1000,
                "the newest stored message is stamped ahead of this machine's clock; \
                 new messages are stamped after it until the clock catches up"
            );
        }
        DecisionClock {
            last: AtomicI64::new(newest),
        }
    }

    fn next(&self) -> i64 {
        let now = now_ms();
        self.last.fetch_max(now, Ordering::Relaxed).max(now)
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

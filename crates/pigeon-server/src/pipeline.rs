//! The write pipeline: one task that takes commands in batches, lets the engine decide them,
//! commits each batch in one transaction (group commit: one fsync for the whole batch), and
//! only then answers and pushes. In the embedded mode this one task owns every partition,
//! because SQLite has one writer; `seq` and `user_seq` therefore have exactly one owner.

use crate::hub::{Hub, Outbox, Outgoing};
use pigeon_core::changes::{Changes, Event};
use pigeon_core::command::{Command, Reply};
use pigeon_core::engine::Engine;
use pigeon_core::error::DomainError;
use pigeon_core::store::Store;
use pigeon_proto::frames::ServerFrame;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// Most commands decided and committed together.
pub const MAX_BATCH: usize = 1024;
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
    /// A WebSocket connection: the answer is queued on its outbox before any push of the same
    /// batch, so a sender always sees its `send_ack` before the `msg` of its message.
    Connection { outbox: Outbox, req: Option<i64> },
    /// Nobody waits.
    Nobody,
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
/// members (the pushes). Small enough that a batch carrying a flood still commits in a few
/// milliseconds, so single chats in the same batch are not held up.
pub const BULK_BUDGET: u64 = 1600;

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
}

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
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let (bulk_in, bulk_rx_in) = mpsc::channel(QUEUE_CAPACITY);
        let large = LargeConversations::default();
        let (fast_tx, fast_rx) = mpsc::channel(64);
        let (bulk_tx, bulk_rx) = mpsc::channel(1024);
        tokio::spawn(deliver(fast_rx, hub.clone()));
        tokio::spawn(deliver(bulk_rx, hub));
        let dtx = Tiers {
            fast: fast_tx,
            bulk: bulk_tx,
        };
        let stats = Arc::new(PipelineStats::default());
        let queues = Queues {
            fast: rx,
            bulk: bulk_rx_in,
            large: large.clone(),
        };
        let handle = tokio::spawn(run(store, engine, queues, dtx, stats.clone()));
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

    /// Queues a command; waits only while the queue is full.
    pub async fn submit(&self, cmd: Command, reply: ReplyTo) -> Result<(), PipelineError> {
        if large_cost(&self.large, &cmd).is_some() {
            &self.bulk_tx
        } else {
            &self.tx
        }
        .send(Envelope { cmd, reply })
        .await
        .map_err(|_| PipelineError::Unavailable)
    }
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
    replies: Vec<(Outbox, String)>,
    events: Vec<Event>,
}

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
    large: LargeConversations,
}

impl Queues {
    /// The next batch: everything waiting in the fast queue (up to [`MAX_BATCH`]); then, only
    /// when the fast queue is empty, sends into large conversations up to [`BULK_BUDGET`].
    /// Empty when both queues are closed.
    async fn next_batch(&mut self, batch: &mut Vec<Envelope>) {
        let mut bulk = Vec::new();
        tokio::select! {
            biased;
            _ = self.fast.recv_many(batch, MAX_BATCH) => {}
            _ = self.bulk.recv_many(&mut bulk, 1) => {}
        }
        while batch.len() < MAX_BATCH {
            match self.fast.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        // Bulk after fast: a conversation's earlier sends (queued fast before it became
        // large) are always decided before its later ones.
        if self.fast.is_empty() {
            let mut spent: u64 = bulk.iter().map(|e| self.cost(&e.cmd)).sum();
            while spent < BULK_BUDGET {
                match self.bulk.try_recv() {
                    Ok(e) => {
                        spent += self.cost(&e.cmd);
                        bulk.push(e);
                    }
                    Err(_) => break,
                }
            }
        }
        batch.extend(bulk);
    }

    fn cost(&self, cmd: &Command) -> u64 {
        large_cost(&self.large, cmd).unwrap_or(1)
    }
}

async fn run(
    store: Arc<dyn Store>,
    mut engine: Engine,
    mut queues: Queues,
    delivery: Tiers,
    stats: Arc<PipelineStats>,
) {
    let mut batch: Vec<Envelope> = Vec::with_capacity(MAX_BATCH);
    loop {
        queues.next_batch(&mut batch).await;
        if batch.is_empty() {
            return;
        }
        let started = Instant::now();
        let (cmds, replies): (Vec<Command>, Vec<ReplyTo>) =
            batch.drain(..).map(|e| (e.cmd, e.reply)).unzip();
        let n = cmds.len();
        let load_started = Instant::now();
        if let Err(e) = load(&*store, &mut engine, &cmds).await {
            tracing::error!(error = %e, batch = n, "loading state failed; batch refused");
            engine.reset();
            answer_all_unavailable(replies);
            continue;
        }
        metrics::histogram!("pigeon_load_seconds").record(load_started.elapsed().as_secs_f64());
        let now = now_ms();
        let mut changes = Changes::default();
        let mut events = Vec::new();
        let results: Vec<Result<Reply, DomainError>> = cmds
            .into_iter()
            .map(|cmd| engine.apply(cmd, now, &mut changes, &mut events))
            .collect();
        engine.seal(&mut changes);
        let counts = BatchCounts::of(&changes);
        let commit_started = Instant::now();
        let committed = if changes.is_empty() {
            Ok(())
        } else {
            store.commit(changes).await
        };
        if let Err(e) = committed {
            tracing::error!(error = %e, batch = n, "commit failed; batch refused and state reloaded");
            engine.reset();
            answer_all_unavailable(replies);
            continue;
        }
        metrics::histogram!("pigeon_store_commit_seconds")
            .record(commit_started.elapsed().as_secs_f64());
        engine.finish_batch();
        metrics::histogram!("pigeon_batch_size").record(n as f64);
        metrics::histogram!("pigeon_commit_seconds").record(started.elapsed().as_secs_f64());
        stats.record(n, &counts);
        // Conversations of this batch in the large tier, with the cost of one send into each
        // (see BULK_BUDGET): their acks and pushes go to the bulk delivery task, and their
        // later sends to the bulk queue (sticky).
        let large: HashMap<String, u64> = events
            .iter()
            .filter_map(|e| match e {
                Event::Message {
                    message,
                    recipients,
                } if recipients.len() > LARGE_TIER_MEMBERS => {
                    let n = recipients.len() as u64;
                    let write_fanout = recipients.first().is_some_and(|r| r.user_seq.is_some());
                    Some((
                        message.conversation_id.clone(),
                        if write_fanout { n } else { (n / 20).max(1) },
                    ))
                }
                _ => None,
            })
            .collect();
        if !large.is_empty() {
            let mut sticky = queues.large.write().expect("large set lock");
            for (id, cost) in &large {
                if let Ok(c) = pigeon_proto::ConversationId::parse(id) {
                    sticky.insert(c, *cost);
                }
            }
        }
        let (mut fast, mut bulk) = (Delivery::default(), Delivery::default());
        for (reply, result) in replies.into_iter().zip(results) {
            match reply {
                ReplyTo::Caller(tx) => {
                    let _ = tx.send(result.map_err(PipelineError::from));
                }
                ReplyTo::Connection { outbox, req } => {
                    let in_large = matches!(&result, Ok(Reply::SendAck(a)) if !a.duplicate && large.contains_key(a.conversation_id.as_str()));
                    if let Some(frame) = connection_reply(req, result) {
                        if in_large { &mut bulk } else { &mut fast }
                            .replies
                            .push((outbox, frame));
                    }
                }
                ReplyTo::Nobody => {}
            }
        }
        for e in events {
            let in_large = matches!(&e, Event::Message { message, .. } if large.contains_key(&message.conversation_id));
            if in_large { &mut bulk } else { &mut fast }.events.push(e);
        }
        let fast_ok = fast.is_empty() || delivery.fast.send(fast).await.is_ok();
        let bulk_ok = bulk.is_empty() || delivery.bulk.send(bulk).await.is_ok();
        if !(fast_ok && bulk_ok) {
            tracing::error!("a delivery task is gone");
            return;
        }
    }
}

async fn load(
    store: &dyn Store,
    engine: &mut Engine,
    cmds: &[Command],
) -> Result<(), pigeon_core::StoreError> {
    // A recall needs its message before its conversation: at most a few rounds.
    for _ in 0..4 {
        let needs = engine.needs(cmds);
        if needs.is_empty() {
            return Ok(());
        }
        let loaded = store.load(needs.clone()).await?;
        engine.absorb(loaded, &needs);
    }
    Ok(())
}

fn answer_all_unavailable(replies: Vec<ReplyTo>) {
    for r in replies {
        match r {
            ReplyTo::Caller(tx) => {
                let _ = tx.send(Err(PipelineError::Unavailable));
            }
            ReplyTo::Connection { outbox, req } => {
                outbox.send(Outgoing::Frame(
                    error_frame(req, &PipelineError::Unavailable).into(),
                ));
            }
            ReplyTo::Nobody => {}
        }
    }
}

/// The frame a connection gets for a command it sent: `send_ack` or an error; nothing for
/// commands whose success has no reply frame (read, ack).
fn connection_reply(req: Option<i64>, result: Result<Reply, DomainError>) -> Option<String> {
    match result {
        Ok(Reply::SendAck(ack)) => Some(ServerFrame::SendAck { req, ack }.to_json()),
        Ok(_) => None,
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
        self.replies.is_empty() && self.events.is_empty()
    }
}

async fn deliver(mut rx: mpsc::Receiver<Delivery>, hub: Arc<Hub>) {
    while let Some(d) = rx.recv().await {
        for (outbox, frame) in d.replies {
            outbox.send(Outgoing::Frame(frame.into()));
        }
        hub.publish(d.events);
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

//! One partition: a task that owns the conversations routed to it. It takes commands as they
//! arrive, loads what its conversation stage is missing (from a read connection, so loading
//! does not wait for the commit in flight; see [`load`] for when it waits for the tables),
//! decides them into its open batch, and hands the batch to the committer as soon as its
//! previous one has come back. So when a commit fails, the only batch decided on top of it
//! is the open one, which is refused with it.

use super::claims::{Claimed, KeyClaims};
use super::{
    DECIDE_CHUNK, DecisionClock, Delivery, Envelope, MAX_BATCH, MAX_BATCH_FANOUT, PipelineError,
    ReplyTo, answer_all_unavailable,
};
use pigeon_core::changes::{Changes, Event};
use pigeon_core::command::{Command, CursorChain, Reply};
use pigeon_core::conversation_stage::ConversationStage;
use pigeon_core::handoff::FanOut;
use pigeon_core::routing::Tier;
use pigeon_core::state::ConversationState;
use pigeon_core::store::{Needs, Store};
use pigeon_proto::views::Fanout;
use pigeon_proto::{ConversationId, DeviceId, UserId};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// What a partition's queue carries.
pub(super) enum Work {
    Command(Envelope),
    /// Give up a conversation (it moves to another tier): once every batch that touched it
    /// is committed, answer its state.
    Release {
        conversation: ConversationId,
        reply: oneshot::Sender<Option<ConversationState>>,
    },
    /// Take over a conversation another partition released, with its state (`None`: it
    /// held none; the tables are read once they hold every acknowledged batch).
    Adopt(Option<ConversationState>),
}

/// A batch a partition decided, on its way to the committer.
pub(super) struct Sealed {
    pub changes: Changes,
    pub events: Vec<Event>,
    /// The messages the batch appended, each with the length `events` had when it was
    /// appended: the user stage puts its message event there, so a batch's events keep the
    /// order they were decided in.
    pub handoffs: Vec<(usize, FanOut)>,
    /// Devices' acknowledged inbox positions, for the user stage to clamp to the heads.
    pub inbox_cursors: Vec<(UserId, DeviceId, u64)>,
    pub replies: Vec<(ReplyTo, Result<Reply, PipelineError>)>,
    pub started: Instant,
    /// The idempotency keys its sends claimed: let go by the committer once the store
    /// answers for them (or the batch is refused), whatever becomes of the partition.
    pub claimed: Claimed,
    /// Its tier's delivery task, for the committer should the partition be gone (stopped
    /// on a panic) when its batch commits: its callers are still answered.
    pub delivery: mpsc::Sender<Delivery>,
    /// How the batch ended.
    pub outcome: oneshot::Sender<Outcome>,
}

/// What the committer tells a partition of its batch.
pub(super) enum Outcome {
    /// Durable: its frames, for the partition's tier's delivery task (sent by the
    /// partition, so a tier whose delivery lags holds up its own partitions only).
    Committed(Delivery),
    /// Refused, and every command in it answered `unavailable`.
    Refused,
}

pub(super) struct Partition {
    pub index: usize,
    pub tier: Tier,
    /// The delivery task of this partition's tier.
    pub delivery: mpsc::Sender<Delivery>,
    pub store: Arc<dyn Store>,
    pub stage: ConversationStage,
    pub claims: Arc<KeyClaims>,
    pub clock: Arc<DecisionClock>,
}

/// The batch being decided: commands join it as they arrive, and it goes to the committer
/// as soon as the partition's last batch is back, so a batch holds whatever came while the
/// previous one was being committed.
#[derive(Default)]
struct OpenBatch {
    changes: Changes,
    events: Vec<Event>,
    handoffs: Vec<(usize, FanOut)>,
    inbox_cursors: Vec<(UserId, DeviceId, u64)>,
    replies: Vec<(ReplyTo, Result<Reply, PipelineError>)>,
    /// The idempotency keys its sends claimed.
    claimed: Claimed,
    /// Members of its write fan-out messages (the inbox rows it will write).
    fanout: usize,
    started: Option<Instant>,
}

impl OpenBatch {
    fn is_empty(&self) -> bool {
        self.replies.is_empty()
    }
}

/// The batch at the committer.
struct InFlight {
    batch: u64,
    outcome: oneshot::Receiver<Outcome>,
}

impl Partition {
    pub(super) async fn run(
        mut self,
        mut queue: mpsc::Receiver<Work>,
        to_commit: mpsc::Sender<Sealed>,
    ) {
        let mut open = OpenBatch::default();
        let mut in_flight: Option<InFlight> = None;
        let mut closed = false;
        let mut arrived: Vec<Envelope> = Vec::new();
        let mut releasing: Option<(ConversationId, oneshot::Sender<Option<ConversationState>>)> =
            None;
        // Set when the stage forgot what it knew (a failed commit, a failed eviction, a
        // conversation adopted without its state): its next load first waits until the
        // tables hold every acknowledged batch (see `load`).
        let mut stale = false;
        loop {
            // Caches past their bound are dropped only when nothing decided is uncommitted and
            // the tables hold every batch (until then the cache is the only place that shows
            // what those batches changed); meanwhile no new command is taken.
            let evicting = self.stage.caches_full();
            if evicting && open.is_empty() && in_flight.is_none() {
                match self.store.caught_up().await {
                    Ok(()) => self.stage.evict_caches(),
                    Err(e) => {
                        tracing::error!(error = %e, "the tables did not catch up; every cache dropped");
                        self.stage.reset();
                        stale = true;
                    }
                }
                continue;
            }
            // A conversation is released once everything decided before the release is
            // committed.
            if releasing.is_some() && arrived.is_empty() && open.is_empty() && in_flight.is_none() {
                let (conversation, reply) = releasing.take().expect("checked");
                let _ = reply.send(self.stage.release(&conversation));
                continue;
            }
            let room = if open.fanout >= MAX_BATCH_FANOUT {
                0
            } else {
                MAX_BATCH.saturating_sub(open.replies.len() + arrived.len())
            };
            let taking = !closed && !evicting && releasing.is_none() && room > 0;
            if taking {
                self.take_ready(&mut queue, room, &mut arrived, &mut releasing, &mut stale);
                if releasing.is_some() {
                    // A release just taken stops the taking until it is done (above).
                    continue;
                }
            }
            // Each decision costs a load from the store, so commands are decided at once only
            // when nothing is committing (the batch then goes right away); while the last
            // batch commits they are decided in chunks, and the rest when it is back.
            let full =
                open.fanout >= MAX_BATCH_FANOUT || open.replies.len() + arrived.len() >= MAX_BATCH;
            let idle_and_empty = in_flight.is_none() && open.is_empty();
            if !arrived.is_empty()
                && (idle_and_empty || arrived.len() >= DECIDE_CHUNK || full || releasing.is_some())
            {
                self.decide_into(&mut stale, &mut open, &mut arrived).await;
                continue;
            }
            if closed && open.is_empty() && arrived.is_empty() && in_flight.is_none() {
                return;
            }
            tokio::select! {
                biased;
                committed = async { (&mut in_flight.as_mut().expect("in flight").outcome).await },
                    if in_flight.is_some() => {
                    let done = in_flight.take().expect("in flight");
                    if let Ok(Outcome::Committed(frames)) = committed {
                        self.stage.committed(done.batch);
                        if !frames.is_empty() && self.delivery.send(frames).await.is_err() {
                            tracing::error!("a delivery task is gone");
                            self.refuse(&mut open);
                            answer_all_unavailable(arrived.drain(..).map(|e| e.reply));
                            return;
                        }
                    } else {
                        // The open batch was decided on top of the failed one.
                        self.stage.reset();
                        stale = true;
                        self.refuse(&mut open);
                    }
                }
                // Handed over only when the last batch is back: until then the batch grows
                // with what arrives, so a busy store gets fewer, larger commits.
                permit = to_commit.reserve(), if !open.is_empty() && in_flight.is_none() => {
                    let Ok(permit) = permit else {
                        tracing::error!("the committer is gone");
                        self.refuse(&mut open);
                        answer_all_unavailable(arrived.drain(..).map(|e| e.reply));
                        return;
                    };
                    let mut b = std::mem::take(&mut open);
                    metrics::histogram!("pigeon_partition_batch_size", "tier" => self.tier.name())
                        .record(b.replies.len() as f64);
                    let batch = self.stage.seal(&mut b.changes);
                    let (outcome, outcome_rx) = oneshot::channel();
                    permit.send(Sealed {
                        changes: b.changes,
                        events: b.events,
                        handoffs: b.handoffs,
                        inbox_cursors: b.inbox_cursors,
                        replies: b.replies,
                        started: b.started.unwrap_or_else(Instant::now),
                        claimed: b.claimed,
                        delivery: self.delivery.clone(),
                        outcome,
                    });
                    in_flight = Some(InFlight { batch, outcome: outcome_rx });
                }
                work = queue.recv(), if taking => match work {
                    Some(work) => self.take(work, &mut arrived, &mut releasing, &mut stale),
                    None => closed = true,
                },
            }
        }
    }

    /// Takes what is queued now, without waiting, up to `room` commands or a release.
    fn take_ready(
        &mut self,
        queue: &mut mpsc::Receiver<Work>,
        room: usize,
        arrived: &mut Vec<Envelope>,
        releasing: &mut Option<(ConversationId, oneshot::Sender<Option<ConversationState>>)>,
        stale: &mut bool,
    ) {
        let limit = arrived.len() + room;
        while arrived.len() < limit && releasing.is_none() {
            match queue.try_recv() {
                Ok(work) => self.take(work, arrived, releasing, stale),
                Err(_) => break,
            }
        }
    }

    fn take(
        &mut self,
        work: Work,
        arrived: &mut Vec<Envelope>,
        releasing: &mut Option<(ConversationId, oneshot::Sender<Option<ConversationState>>)>,
        stale: &mut bool,
    ) {
        match work {
            Work::Command(e) => arrived.push(e),
            Work::Release {
                conversation,
                reply,
            } => *releasing = Some((conversation, reply)),
            // Its commands come after it in this queue.
            Work::Adopt(Some(state)) => self.stage.adopt(state),
            Work::Adopt(None) => *stale = true,
        }
    }

    fn refuse(&self, open: &mut OpenBatch) {
        let b = std::mem::take(open);
        drop(b.claimed);
        answer_all_unavailable(b.replies.into_iter().map(|(r, _)| r));
    }

    /// Loads what `arrived` needs and applies it to the open batch (emptying `arrived`). If
    /// the store cannot be read, these commands are refused; the batch goes on. A send whose
    /// idempotency key another partition is deciding is answered `unavailable` (see
    /// `claims.rs`).
    async fn decide_into(
        &mut self,
        stale: &mut bool,
        open: &mut OpenBatch,
        arrived: &mut Vec<Envelope>,
    ) {
        open.started.get_or_insert_with(Instant::now);
        let mut cmds = Vec::with_capacity(arrived.len());
        let mut replies = Vec::with_capacity(arrived.len());
        let mut claimed = Claimed::new(self.claims.clone());
        for e in arrived.drain(..) {
            if let Command::Send(s) = &e.cmd {
                let key = (s.sender, s.client_msg_id.clone());
                if !claimed.claim(key, self.index) {
                    // Answered in its place among the batch's answers.
                    open.replies
                        .push((e.reply, Err(PipelineError::Unavailable)));
                    continue;
                }
            }
            cmds.push(e.cmd);
            replies.push(e.reply);
        }
        let load_started = Instant::now();
        if let Err(e) = load(&*self.store, &mut self.stage, stale, &cmds).await {
            tracing::error!(error = %e, commands = cmds.len(), "loading state failed; commands refused");
            drop(claimed);
            // Answered in their places among the batch's answers.
            open.replies.extend(
                replies
                    .into_iter()
                    .map(|r| (r, Err(PipelineError::Unavailable))),
            );
            return;
        }
        open.claimed.absorb(claimed);
        // One sample per decision step (several per batch), store read included.
        metrics::histogram!("pigeon_load_seconds").record(load_started.elapsed().as_secs_f64());
        let now = self.clock.next();
        for (cmd, reply) in cmds.into_iter().zip(replies) {
            // The user stage's, which alone knows the inbox's newest `user_seq`.
            if let Command::AdvanceCursor {
                user,
                device,
                chain: CursorChain::Inbox,
                seq,
            } = cmd
            {
                open.inbox_cursors.push((user, device, seq));
                open.replies.push((reply, Ok(Reply::Done)));
                continue;
            }
            let result = self
                .stage
                .apply(cmd, now, &mut open.changes, &mut open.events);
            for f in self.stage.handed_off() {
                if f.fanout == Fanout::Write {
                    open.fanout += f.recipients.len();
                }
                open.handoffs.push((open.events.len(), f));
            }
            open.replies
                .push((reply, result.map_err(PipelineError::from)));
        }
    }
}

/// Loads what `cmds` need that the stage does not hold. `Store::load` reads the tables as
/// they are, which may still lack journaled batches; that is safe for conversations and
/// their members, which the stage keeps from the batch that changes them until it evicts
/// (or releases them, once committed), and it evicts only once the tables hold every batch;
/// for users, whose registrations the committer shares once durable (`NodeShared`); and for
/// idempotency keys, which the store answers against every journaled batch (see
/// `Store::load`). Messages leave the stage's memory once their batch is journaled, and a
/// reset forgets everything (`stale`): those loads wait for the tables to catch up first.
async fn load(
    store: &dyn Store,
    stage: &mut ConversationStage,
    stale: &mut bool,
    cmds: &[Command],
) -> Result<(), pigeon_core::StoreError> {
    // A recall needs its message before its conversation: at most a few rounds. A round
    // that asks what the last one did would learn nothing more: what is left names users
    // who are not registered (a registration in this chunk, an invitation of a made-up
    // id), whose commands the stage decides without them.
    let mut asked: Option<Needs> = None;
    for _ in 0..4 {
        // Inbox heads are the user stage's (the committer's): none are asked here.
        let needs = stage.needs(cmds, |_| true);
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
        stage.absorb(loaded, &needs);
        asked = Some(needs);
    }
    Ok(())
}

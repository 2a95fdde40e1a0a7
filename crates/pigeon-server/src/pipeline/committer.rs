//! The committer: the user stage, and the one place batches become durable. It takes the
//! batches the partitions have ready (at most one each), puts their messages into the
//! members' inboxes (`user_seq` has one owner here, whichever partition decided the
//! message), commits them together as one unit, and only then tells each partition how its
//! batch ended, answers its callers and hands its frames to its tier's delivery task.

use super::partition::{Outcome, Sealed};
use super::router::Router;
use super::{
    BatchCounts, Delivery, PipelineError, PipelineStats, ReplyTo, answer_all_unavailable,
    connection_reply,
};
use pigeon_core::changes::{Changes, Event};
use pigeon_core::handoff::FanOut;
use pigeon_core::node::NodeShared;
use pigeon_core::store::{Needs, Store};
use pigeon_core::user_stage::UserStage;
use pigeon_proto::{ConversationId, UserId};
use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::Instant;
use tokio::sync::mpsc;

pub(super) struct Committer {
    pub store: Arc<dyn Store>,
    pub shared: Arc<NodeShared>,
    /// Told of groups that grew into another tier.
    pub router: Weak<Router>,
    pub stats: Arc<PipelineStats>,
    /// Above this many inbox heads the user stage forgets them between commits.
    pub max_heads: usize,
}

/// A command's answer-to-be, with its result.
type Reply = (ReplyTo, Result<pigeon_core::command::Reply, PipelineError>);

/// One partition's batch once its rows are in the unit being committed.
struct Part {
    events: Vec<Event>,
    replies: Vec<Reply>,
    started: Instant,
    claimed: super::claims::Claimed,
    delivery: mpsc::Sender<Delivery>,
    outcome: tokio::sync::oneshot::Sender<Outcome>,
}

impl Committer {
    pub(super) async fn run(self, mut ready: mpsc::Receiver<Sealed>) {
        let mut users = UserStage::default();
        // Set when the user stage forgot heads it moved (a failed commit): its next load
        // waits until the tables hold every acknowledged batch.
        let mut stale = false;
        while let Some(first) = ready.recv().await {
            let mut batches = vec![first];
            while let Ok(more) = ready.try_recv() {
                batches.push(more);
            }
            if users.len() > self.max_heads {
                // Heads are dropped only when the tables hold every batch: until then they
                // are the only place that shows what those batches appended.
                if let Err(e) = self.store.caught_up().await {
                    tracing::error!(error = %e, "the tables did not catch up; inbox heads dropped");
                    stale = true;
                }
                users.clear();
            }
            if let Err(e) = self.load_heads(&mut users, &mut stale, &batches).await {
                tracing::error!(error = %e, batches = batches.len(), "loading inbox heads failed; batches refused");
                refuse_all(batches);
                continue;
            }
            let mut changes = Changes::default();
            let mut parts = Vec::with_capacity(batches.len());
            let mut registered: Vec<UserId> = Vec::new();
            let mut sizes: Vec<(ConversationId, u64)> = Vec::new();
            let mut commands = 0;
            for b in batches {
                let mut rows = b.changes;
                let events = into_inboxes(&mut users, &mut rows, b.events, b.handoffs);
                for (user, device, seq) in b.inbox_cursors {
                    users.inbox_cursor(user, device, seq, &mut rows);
                }
                registered.extend(rows.users.iter().map(|u| u.0));
                sizes.extend(
                    rows.conversations
                        .iter()
                        .filter(|c| c.is_group)
                        .map(|c| (c.id.clone(), c.member_count)),
                );
                commands += b.replies.len();
                changes.append(rows);
                parts.push(Part {
                    events,
                    replies: b.replies,
                    started: b.started,
                    claimed: b.claimed,
                    delivery: b.delivery,
                    outcome: b.outcome,
                });
            }
            let counts = BatchCounts::of(&changes);
            let commit_started = Instant::now();
            let wrote = !changes.is_empty();
            let committed = if wrote {
                self.store.commit(changes).await
            } else {
                Ok(())
            };
            if let Err(e) = committed {
                if matches!(e, pigeon_core::StoreError::Conflict(_)) {
                    tracing::error!(error = %e, commands, "the store refused a batch the engine decided (a bug); batch refused and state reloaded");
                } else {
                    tracing::error!(error = %e, commands, "commit failed; batch refused and state reloaded");
                }
                self.stats.commit_failed();
                // Heads moved by the refused batches are void.
                users.clear();
                stale = true;
                for p in parts {
                    let _ = p.outcome.send(Outcome::Refused);
                    answer_all_unavailable(p.replies.into_iter().map(|(r, _)| r));
                }
                continue;
            }
            if wrote {
                // Only a batch that reached the store shows it takes writes again (a barrier
                // or a duplicate send writes nothing).
                self.stats.commit_succeeded();
            }
            // Before anyone hears of them: every partition may take these users from now on.
            self.shared.registered(registered);
            metrics::histogram!("pigeon_store_commit_seconds")
                .record(commit_started.elapsed().as_secs_f64());
            metrics::histogram!("pigeon_batch_size").record(commands as f64);
            self.stats.record(commands, &counts);
            if let Some(router) = self.router.upgrade() {
                for (conversation, members) in sizes {
                    router.grew(&conversation, members);
                }
            }
            for p in parts {
                // From the batch's first decision to its durable commit: what its first
                // command waited.
                metrics::histogram!("pigeon_batch_seconds")
                    .record(p.started.elapsed().as_secs_f64());
                // The store answers for these keys now.
                drop(p.claimed);
                let frames = answer_callers(p.events, p.replies);
                if let Err(Outcome::Committed(frames)) = p.outcome.send(Outcome::Committed(frames))
                {
                    // Its partition is gone: the batch is durable all the same, and its
                    // frames still go out, after what that tier's task holds.
                    let delivery = p.delivery;
                    tokio::spawn(async move {
                        let _ = delivery.send(frames).await;
                    });
                }
            }
        }
    }

    /// Loads the inbox heads the batches need that the user stage lacks.
    async fn load_heads(
        &self,
        users: &mut UserStage,
        stale: &mut bool,
        batches: &[Sealed],
    ) -> Result<(), pigeon_core::StoreError> {
        let lacking: HashSet<UserId> = users.lacking_heads(
            batches
                .iter()
                .flat_map(|b| b.handoffs.iter().map(|(_, f)| f)),
            batches
                .iter()
                .flat_map(|b| b.inbox_cursors.iter().map(|c| c.0)),
        );
        if lacking.is_empty() {
            return Ok(());
        }
        if *stale {
            self.store.caught_up().await?;
            *stale = false;
        }
        let needs = Needs {
            users: lacking,
            ..Needs::default()
        };
        let mut loaded = self.store.load(needs.clone()).await?;
        // Heads only of registered users (the store answers one for every user asked about):
        // an ack naming a made-up user must not grow the map nor save a position. A user
        // registered by these very batches is one (a message to them may be in them too).
        let registering: HashSet<UserId> = batches
            .iter()
            .flat_map(|b| b.changes.users.iter().map(|u| u.0))
            .collect();
        let registered: HashSet<UserId> = needs
            .users
            .into_iter()
            .filter(|u| {
                loaded.users.contains(u) || registering.contains(u) || self.shared.is_registered(*u)
            })
            .collect();
        loaded.inbox_heads.retain(|u, _| registered.contains(u));
        users.absorb_heads(loaded.inbox_heads, &registered);
        Ok(())
    }
}

/// Answers a committed batch's callers, and gathers what its tier's delivery task sends.
fn answer_callers(events: Vec<Event>, replies: Vec<Reply>) -> Delivery {
    let mut d = Delivery {
        events,
        ..Delivery::default()
    };
    for (reply, result) in replies {
        match reply {
            ReplyTo::Caller(tx) => {
                let _ = tx.send(result);
            }
            ReplyTo::Connection(reply) => {
                let (to, req) = reply.take();
                if let Some(frame) = connection_reply(req, result) {
                    d.replies.push((to, frame));
                }
            }
            ReplyTo::AfterDelivery(tx) => d.after.push((tx, result)),
            ReplyTo::Nobody => {}
        }
    }
    d
}

/// Runs the user stage over one batch's messages: their inbox rows go into `rows`, and each
/// message's event into the batch's events where it was decided.
fn into_inboxes(
    users: &mut UserStage,
    rows: &mut Changes,
    events: Vec<Event>,
    handoffs: Vec<(usize, FanOut)>,
) -> Vec<Event> {
    if handoffs.is_empty() {
        return events;
    }
    let mut out = Vec::with_capacity(events.len() + handoffs.len());
    let mut events = events.into_iter();
    let mut taken = 0;
    for (at, f) in handoffs {
        while taken < at {
            let Some(e) = events.next() else { break };
            out.push(e);
            taken += 1;
        }
        users.deliver(f, rows, &mut out);
    }
    out.extend(events);
    out
}

fn refuse_all(batches: Vec<Sealed>) {
    for b in batches {
        let _ = b.outcome.send(Outcome::Refused);
        answer_all_unavailable(b.replies.into_iter().map(|(r, _)| r));
    }
}

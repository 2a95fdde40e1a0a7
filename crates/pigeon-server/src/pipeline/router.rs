//! Which partition owns a command: the edge's side of the partitions. A conversation's
//! commands go to its tier's partitions (a single chat's to the single-chat tier, a group's
//! to the tier of its size) and there to one by a hash of its id; a user's commands that name
//! no conversation by a hash of the user. A new group's id is chosen here, so its creation
//! is decided where its later commands go; a command that names a message goes where the
//! message's conversation is. A group that grows into another tier moves: its old
//! partition releases it once every batch that touched it is committed and delivered, and
//! its new one adopts its state, while its commands wait.

use super::partition::Work;
use super::{Envelope, PipelineError, ReplyTo, RouteSet, now_ms};
use pigeon_core::command::{Command, CursorChain, SendTo};
use pigeon_core::node::NodeShared;
use pigeon_core::routing::{Tier, partition_of, partition_of_chat, partition_of_user};
use pigeon_core::store::{Needs, Store};
use pigeon_proto::{ConversationId, MsgId, UserId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::{mpsc, oneshot, watch};

/// Most groups remembered as not found.
const MAX_ABSENT: usize = 100_000;

pub(super) struct Router {
    /// Every partition, tier after tier: partition `p` of tier `t` is at
    /// `t.index() * per_tier + p`.
    queues: Vec<mpsc::Sender<Work>>,
    per_tier: usize,
    shared: Arc<NodeShared>,
    store: Arc<dyn Store>,
    /// The tier of each group seen since start (its size when it was first routed, or when it
    /// last moved). A group not in it does not exist, as far as this node has seen.
    groups: RwLock<HashMap<ConversationId, Tier>>,
    /// Groups looked up and not found (bounded: cleared when full). A group is made only
    /// here, with a new id, which leaves this set.
    absent: Mutex<std::collections::HashSet<ConversationId>>,
    /// Groups moving to another tier, each with what its commands wait for.
    moves: Mutex<HashMap<ConversationId, watch::Receiver<bool>>>,
    moving: AtomicUsize,
    /// Held (shared) from checking a command's route to queueing it, and (alone) to start and
    /// end a move: so no command is queued on a partition after its release of the
    /// conversation, nor on the next one before its adoption.
    handover: RwLock<()>,
}

/// What decides a command's partition.
enum Owner {
    Conversation(ConversationId),
    /// A single chat, by its two users (its id is not made to route it).
    Chat(UserId, UserId),
    User(UserId),
    Message(MsgId),
    /// A group being created, with its members at creation.
    NewGroup(usize),
    /// Any partition does (it answers the command without a conversation).
    Any,
}

fn owner(cmd: &Command) -> Owner {
    match cmd {
        Command::UpsertUser { user, .. } | Command::Logout { user } => Owner::User(*user),
        Command::Send(s) => match &s.to {
            SendTo::User(peer) if *peer != s.sender => Owner::Chat(s.sender, *peer),
            SendTo::User(_) => Owner::User(s.sender),
            SendTo::Conversation(c) => Owner::Conversation(c.clone()),
        },
        Command::CreateGroup { members, .. } => Owner::NewGroup(members.len() + 1),
        Command::Recall { msg_id, .. }
        | Command::Edit { msg_id, .. }
        | Command::AdminDelete { msg_id }
        | Command::HideMessage { msg_id, .. } => Owner::Message(*msg_id),
        Command::AdvanceCursor { user, chain, .. } => match chain {
            CursorChain::Inbox => Owner::User(*user),
            CursorChain::Conversation(c) => Owner::Conversation(c.clone()),
        },
        Command::Flush => Owner::Any,
        other => other
            .named_conversation()
            .map_or(Owner::Any, |c| Owner::Conversation(c.clone())),
    }
}

impl Router {
    pub(super) fn new(
        queues: Vec<mpsc::Sender<Work>>,
        per_tier: usize,
        shared: Arc<NodeShared>,
        store: Arc<dyn Store>,
    ) -> Self {
        Router {
            queues,
            per_tier,
            shared,
            store,
            groups: RwLock::default(),
            absent: Mutex::default(),
            moves: Mutex::default(),
            moving: AtomicUsize::new(0),
            handover: RwLock::default(),
        }
    }

    fn index(&self, tier: Tier, p: usize) -> usize {
        tier.index() * self.per_tier + p
    }

    /// The partition of a conversation in `tier`.
    fn index_of(&self, c: &ConversationId, tier: Tier) -> usize {
        self.index(tier, partition_of(c, self.per_tier))
    }

    /// The partition of the single chat of `a` and `b`.
    pub(super) fn chat_index(&self, a: UserId, b: UserId) -> usize {
        self.index(Tier::Single, partition_of_chat(a, b, self.per_tier))
    }

    /// The partition `c`'s commands go to now, when that is known without a look-up.
    pub(super) fn known_index(&self, c: &ConversationId) -> Option<usize> {
        let tier = if c.is_group() {
            self.known_tier(c)?
        } else {
            Tier::Single
        };
        self.move_of(c).is_none().then(|| self.index_of(c, tier))
    }

    /// The tier a conversation's commands go to now: a single chat's is fixed; a group's is
    /// the one it was seen in; a group never seen is looked up (once the tables hold every
    /// acknowledged batch, so that a group created just before a restart is found); one
    /// that does not exist goes to the small groups, where it is refused.
    async fn tier_of(&self, c: &ConversationId) -> Result<Tier, PipelineError> {
        if !c.is_group() {
            return Ok(Tier::Single);
        }
        if let Some(tier) = self.known_tier(c) {
            return Ok(tier);
        }
        if self.absent.lock().expect("absent lock").contains(c) {
            return Ok(Tier::Small);
        }
        let unavailable = |e: pigeon_core::StoreError| {
            tracing::error!(error = %e, "looking up a group's size failed");
            PipelineError::Unavailable
        };
        self.store.caught_up().await.map_err(unavailable)?;
        let needs = Needs {
            conversations: [c.clone()].into(),
            ..Needs::default()
        };
        let loaded = self.store.load(needs).await.map_err(unavailable)?;
        Ok(match loaded.conversations.get(c) {
            Some(Some(state)) => *self
                .groups
                .write()
                .expect("groups lock")
                .entry(c.clone())
                .or_insert(Tier::of_group(state.members.len() as u64)),
            _ => {
                let mut absent = self.absent.lock().expect("absent lock");
                if absent.len() >= MAX_ABSENT {
                    absent.clear();
                }
                absent.insert(c.clone());
                Tier::Small
            }
        })
    }

    fn known_tier(&self, c: &ConversationId) -> Option<Tier> {
        self.groups.read().expect("groups lock").get(c).copied()
    }

    /// What a command for `c` waits for while `c` moves to another tier.
    fn move_of(&self, c: &ConversationId) -> Option<watch::Receiver<bool>> {
        if self.moving.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.moves.lock().expect("moves lock").get(c).cloned()
    }

    /// Whether `c`'s commands still go to `tier` (checked under `handover`).
    fn still_in(&self, c: &ConversationId, tier: Tier) -> bool {
        if !c.is_group() {
            return true;
        }
        self.move_of(c).is_none() && self.known_tier(c).unwrap_or(Tier::Small) == tier
    }

    /// Queues `env` on its partition; answers the partition's index.
    pub(super) async fn submit(&self, mut env: Envelope) -> Result<usize, PipelineError> {
        let owner = match owner(&env.cmd) {
            Owner::Message(m) => match self.conversation_of(m).await {
                Ok(Some(c)) => Owner::Conversation(c),
                Ok(None) => Owner::Any,
                Err(e) => {
                    env.reply.disarm();
                    return Err(e);
                }
            },
            Owner::NewGroup(members) => {
                let id = ConversationId::group(self.shared.next_id(now_ms()));
                if let Command::CreateGroup { id: chosen, .. } = &mut env.cmd {
                    *chosen = Some(id.clone());
                }
                self.absent.lock().expect("absent lock").remove(&id);
                self.groups
                    .write()
                    .expect("groups lock")
                    .insert(id.clone(), Tier::of_group(members as u64));
                Owner::Conversation(id)
            }
            other => other,
        };
        loop {
            let (index, tier) = match &owner {
                Owner::Conversation(c) => {
                    if let Some(mut moved) = self.move_of(c) {
                        if moved.wait_for(|done| *done).await.is_err() {
                            // The move stopped on a panic.
                            env.reply.disarm();
                            return Err(PipelineError::Unavailable);
                        }
                        continue;
                    }
                    let tier = match self.tier_of(c).await {
                        Ok(tier) => tier,
                        Err(e) => {
                            env.reply.disarm();
                            return Err(e);
                        }
                    };
                    (self.index_of(c, tier), Some(tier))
                }
                Owner::User(u) => (
                    self.index(Tier::Single, partition_of_user(*u, self.per_tier)),
                    None,
                ),
                Owner::Chat(a, b) => (self.chat_index(*a, *b), None),
                Owner::Any | Owner::Message(_) | Owner::NewGroup(_) => (0, None),
            };
            let Ok(permit) = self.queues[index].reserve().await else {
                // The caller answers this error: the reply must not answer too.
                env.reply.disarm();
                return Err(PipelineError::Unavailable);
            };
            let _held = self.handover.read().expect("handover lock");
            let settled = match (&owner, tier) {
                (Owner::Conversation(c), Some(tier)) => self.still_in(c, tier),
                _ => true,
            };
            if settled {
                permit.send(Work::Command(env));
                return Ok(index);
            }
            // It began to move meanwhile: routed again once it has.
        }
    }

    /// The conversation of a stored message (read once the tables hold every acknowledged
    /// batch); `None` when there is no such message.
    async fn conversation_of(&self, m: MsgId) -> Result<Option<ConversationId>, PipelineError> {
        match self.store.message(m).await {
            Ok(found) => {
                Ok(found.and_then(|a| ConversationId::parse(&a.message.conversation_id).ok()))
            }
            Err(e) => {
                tracing::error!(error = %e, "looking up a message's conversation failed");
                Err(PipelineError::Unavailable)
            }
        }
    }

    /// Waits until everything queued before on the partitions of `routes` is committed (or
    /// refused) and its frames are queued on the outboxes.
    /// Every partition is waited for, even after one fails (a shutdown flushes them all
    /// before the store closes); the first failure is answered.
    pub(super) async fn flush(&self, routes: RouteSet) -> Result<(), PipelineError> {
        let mut answers = Vec::new();
        let mut outcome = Ok(());
        for index in routes.routes().take_while(|i| *i < self.queues.len()) {
            match self.barrier(index).await {
                Ok(rx) => answers.push(rx),
                Err(e) => outcome = outcome.and(Err(e)),
            }
        }
        for rx in answers {
            let answered = match rx.await {
                Ok(result) => result.map(|_| ()),
                Err(_) => Err(PipelineError::Unavailable),
            };
            outcome = outcome.and(answered);
        }
        outcome
    }

    /// A barrier through partition `index`: answered once everything queued on it before
    /// is committed (or refused) and its frames are queued on the outboxes.
    pub(super) async fn barrier(
        &self,
        index: usize,
    ) -> Result<oneshot::Receiver<Result<pigeon_core::command::Reply, PipelineError>>, PipelineError>
    {
        let (tx, rx) = oneshot::channel();
        self.queues[index]
            .send(Work::Command(Envelope {
                cmd: Command::Flush,
                reply: ReplyTo::AfterDelivery(tx),
            }))
            .await
            .map_err(|_| PipelineError::Unavailable)?;
        Ok(rx)
    }

    /// A committed batch left group `c` with `members`: if that is past its tier, it moves
    /// up (never down: a group that shrinks stays where it is, so a group near a bound does
    /// not go back and forth).
    pub(super) fn grew(self: &Arc<Self>, c: &ConversationId, members: u64) {
        let to = Tier::of_group(members);
        let Some(from) = self.known_tier(c) else {
            return;
        };
        if to <= from {
            return;
        }
        let (done, waiting) = watch::channel(false);
        {
            let mut moves = self.moves.lock().expect("moves lock");
            if moves.contains_key(c) {
                return;
            }
            moves.insert(c.clone(), waiting);
        }
        let this = self.clone();
        let c = c.clone();
        tokio::spawn(async move {
            this.move_group(&c, from, to).await;
            this.moves.lock().expect("moves lock").remove(&c);
            let _ = done.send(true);
        });
    }

    /// Moves `c` from its partition of `from` to its partition of `to` (see the module's
    /// comment). Its commands wait from the release on (`moves` holds it, but `moving`
    /// counts it only from there).
    async fn move_group(&self, c: &ConversationId, from: Tier, to: Tier) {
        let (old, new) = (self.index_of(c, from), self.index_of(c, to));
        let Ok(permit) = self.queues[old].reserve().await else {
            return;
        };
        let (reply, state) = oneshot::channel();
        {
            let _alone = self.handover.write().expect("handover lock");
            self.moving.fetch_add(1, Ordering::AcqRel);
            permit.send(Work::Release {
                conversation: c.clone(),
                reply,
            });
        }
        let Ok(state) = state.await else {
            // The old partition is gone (it stopped on a panic) with a batch of this group
            // perhaps still on its way to the store: no other partition may take it over.
            // Its commands go on to the old one, which answers none of them.
            let _alone = self.handover.write().expect("handover lock");
            self.moving.fetch_sub(1, Ordering::AcqRel);
            tracing::error!(conversation = %c, "a group could not move: its partition is gone");
            return;
        };
        // Its frames delivered before the new partition's can follow them.
        if let Ok(delivered) = self.barrier(old).await {
            let _ = delivered.await;
        }
        let permit = self.queues[new].reserve().await;
        let _alone = self.handover.write().expect("handover lock");
        self.groups
            .write()
            .expect("groups lock")
            .insert(c.clone(), to);
        if let Ok(permit) = permit {
            permit.send(Work::Adopt(state));
        }
        self.moving.fetch_sub(1, Ordering::AcqRel);
        tracing::debug!(conversation = %c, from = from.name(), to = to.name(), "group moved to another tier");
    }
}

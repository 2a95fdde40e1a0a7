//! The conversation stage: applies commands in order to the cached conversations and records
//! the rows to commit and the events to publish. It owns `seq` assignment (one owner per
//! conversation), finds duplicate sends before it allocates, writes the message, the
//! conversation's summary and the sender's read mark, and chooses the fan-out: each message
//! it appends is handed to the user stage as a [`FanOut`]. It never does I/O: the pipeline
//! asks what it [`ConversationStage::needs`], loads that from the store, and
//! [`ConversationStage::absorb`]s it before applying a batch.

use crate::changes::{Changes, ConversationRow, Event, MemberRow, MessageUpdate, Recipient};
use crate::command::{Command, CursorChain, GroupPatch, Reply, SendCommand, SendTo, SettingsPatch};
use crate::engine::EngineConfig;
use crate::error::DomainError;
use crate::handoff::FanOut;
use crate::node::NodeShared;
use crate::rules::{self, outranks};
use crate::state::{ConversationState, MemberState};
use crate::store::{Loaded, Needs};
use crate::until_committed::UntilCommitted;
use pigeon_proto::views::{Fanout, Role, SendAck};
use pigeon_proto::{
    ClientMsgId, ConversationId, DeviceId, Message, MessageKind, MessageStatus, MsgId, UserId,
};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

mod groups;
mod marks;
mod messages;

pub struct ConversationStage {
    cfg: EngineConfig,
    /// The id generator, known idempotency keys and durable registrations this stage shares
    /// with the node's other partitions.
    shared: Arc<NodeShared>,
    conversations: HashMap<ConversationId, ConversationState>,
    /// Conversations known not to exist (until created).
    absent: HashSet<ConversationId>,
    /// Registered users this stage has seen (loaded, or registered by its own batches):
    /// with [`NodeShared::is_registered`], who may join a conversation or be sent to.
    known_users: HashSet<UserId>,
    /// The batch being decided. Batches are numbered from 1; [`ConversationStage::seal`]
    /// closes one and opens the next, [`ConversationStage::committed`] says which are
    /// durable.
    batch: u64,
    // Per batch: loaded on demand, kept until the batch that wrote them is committed.
    /// Messages loaded for recall, edit or delete; `None` for ids the store does not hold.
    messages: UntilCommitted<MsgId, Option<Message>>,
    dedupe: UntilCommitted<(UserId, ClientMsgId), SendAck>,
    dedupe_checked: UntilCommitted<(UserId, ClientMsgId), ()>,
    /// Conversations changed in the open batch (their rows are written by
    /// [`ConversationStage::seal`]).
    touched: HashSet<ConversationId>,
    /// The messages appended by the command being applied, for the user stage.
    handoff: Vec<FanOut>,
}

type Outcome = Result<Reply, DomainError>;

/// Where a send goes: the single chat with a peer (`to.user`, or a single chat's id that
/// names the sender: such an id is derived, never allocated (PROTOCOL.md 1), so a send into
/// it before the chat exists creates it, as a send to the user would), or a group.
enum Target<'a> {
    Peer(UserId),
    Group(&'a ConversationId),
}

fn target(s: &SendCommand) -> Target<'_> {
    match &s.to {
        SendTo::User(peer) => Target::Peer(*peer),
        SendTo::Conversation(c) => c.peer_of(s.sender).map_or(Target::Group(c), Target::Peer),
    }
}

/// A dismissed group is read-only (PROTOCOL.md 6): every change to it answers `conflict`.
fn still_open(conv: &ConversationState) -> Result<(), DomainError> {
    if conv.dismissed {
        return Err(DomainError::Conflict(
            "the group was dismissed; it is read-only".into(),
        ));
    }
    Ok(())
}

impl ConversationStage {
    pub fn new(cfg: EngineConfig, max_msg_id: u64) -> Self {
        let shared = Arc::new(NodeShared::new(cfg.node_id, max_msg_id));
        ConversationStage::with_shared(cfg, shared)
    }

    /// A stage for one partition of a node, sharing `shared` with the node's others.
    pub fn with_shared(cfg: EngineConfig, shared: Arc<NodeShared>) -> Self {
        ConversationStage {
            shared,
            cfg,
            conversations: HashMap::new(),
            absent: HashSet::new(),
            known_users: HashSet::new(),
            batch: 1,
            messages: UntilCommitted::default(),
            dedupe: UntilCommitted::default(),
            dedupe_checked: UntilCommitted::default(),
            touched: HashSet::new(),
            handoff: Vec::new(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn shared(&self) -> &Arc<NodeShared> {
        &self.shared
    }

    /// Whether `user` is a registered user this stage knows of.
    pub fn knows(&self, user: UserId) -> bool {
        self.known_users.contains(&user) || self.shared.is_registered(user)
    }

    #[cfg(test)]
    pub(crate) fn cached(&self) -> &HashMap<ConversationId, ConversationState> {
        &self.conversations
    }

    #[cfg(test)]
    pub(crate) fn mark_absent(&mut self, id: ConversationId) {
        self.absent.insert(id);
    }

    /// What must be loaded before `batch` can be applied, `has_head` telling which users'
    /// inbox heads the user stage holds (a user joining a conversation is loaded with
    /// theirs). Call again after each [`ConversationStage::absorb`] until it is empty (a
    /// recall needs its message before its conversation).
    pub fn needs(&self, batch: &[Command], has_head: impl Fn(UserId) -> bool) -> Needs {
        let mut n = Needs::default();
        let want_conv = |n: &mut Needs, c: &ConversationId| {
            if !self.conversations.contains_key(c) && !self.absent.contains(c) {
                n.conversations.insert(c.clone());
            }
        };
        let want_user = |n: &mut Needs, u: UserId| {
            if !self.knows(u) || !has_head(u) {
                n.users.insert(u);
            }
        };
        for cmd in batch {
            match cmd {
                Command::Send(s) => {
                    // Never seen (new for sure: the common case, asked first, with no key
                    // built), or known already (answered from memory): no look-up.
                    if self.shared.may_hold_key(s.sender, &s.client_msg_id) {
                        let key = (s.sender, s.client_msg_id.clone());
                        if !self.dedupe.contains_key(&key)
                            && !self.dedupe_checked.contains_key(&key)
                        {
                            n.dedupe.insert(key);
                        }
                    }
                    match target(s) {
                        Target::Peer(peer) => {
                            if let Ok(c) = ConversationId::single(s.sender, peer) {
                                want_conv(&mut n, &c);
                                // A chat the store may not hold yet: its users' heads with
                                // it, in the same round.
                                if !self.conversations.contains_key(&c) {
                                    want_user(&mut n, s.sender);
                                    want_user(&mut n, peer);
                                }
                            }
                        }
                        Target::Group(c) => want_conv(&mut n, c),
                    }
                }
                Command::CreateGroup { owner, members, .. } => {
                    want_user(&mut n, *owner);
                    members.iter().for_each(|u| want_user(&mut n, *u));
                }
                Command::Invite {
                    conversation,
                    users,
                    ..
                } => {
                    want_conv(&mut n, conversation);
                    users.iter().for_each(|u| want_user(&mut n, *u));
                }
                Command::Recall { msg_id, .. }
                | Command::Edit { msg_id, .. }
                | Command::AdminDelete { msg_id }
                | Command::HideMessage { msg_id, .. } => match self.messages.get(msg_id) {
                    Some(Some(m)) => {
                        if let Ok(c) = ConversationId::parse(&m.conversation_id) {
                            want_conv(&mut n, &c);
                        }
                    }
                    Some(None) => {}
                    None => {
                        n.messages.insert(*msg_id);
                    }
                },
                // The user stage's (see `Engine::needs`); a conversation is not loaded for
                // an ack, which anyone can send for any id: it is clamped when cached (see
                // `apply`).
                Command::AdvanceCursor { .. } => {}
                // Whether the user is registered already (see `Engine::needs`).
                Command::UpsertUser { .. } => {}
                Command::Logout { .. } | Command::Flush => {}
                other => {
                    if let Some(c) = other.named_conversation() {
                        want_conv(&mut n, c);
                    }
                }
            }
        }
        n
    }

    /// Takes in what the store loaded for [`ConversationStage::needs`], but the inbox heads
    /// (the user stage's).
    pub fn absorb(&mut self, loaded: Loaded, asked: &Needs) {
        for (id, state) in loaded.conversations {
            match state {
                Some(s) => {
                    self.absent.remove(&id);
                    // Its members are registered users, and the store gave their inbox
                    // heads with it (taken below): an append to it needs no other round.
                    self.known_users.extend(s.members.keys().copied());
                    self.conversations.insert(id, s);
                }
                None => {
                    self.absent.insert(id);
                }
            }
        }
        self.known_users.extend(loaded.users);
        let batch = self.batch;
        for m in &asked.messages {
            self.messages
                .insert(batch, *m, loaded.messages.get(m).cloned());
        }
        for key in &asked.dedupe {
            self.dedupe_checked.insert(batch, key.clone(), ());
        }
        for (key, ack) in loaded.dedupe {
            self.dedupe.insert(batch, key, ack);
        }
    }

    /// Moves the final state of every conversation the open batch touched into `changes`,
    /// closes the batch and opens the next. Returns the closed batch's number, which
    /// [`ConversationStage::committed`] takes once its changes are durable.
    pub fn seal(&mut self, changes: &mut Changes) -> u64 {
        let write_max = self.cfg.fanout_write_max_members;
        for id in self.touched.drain() {
            if let Some(c) = self.conversations.get(&id) {
                changes
                    .conversations
                    .push(ConversationRow::of(c, write_max));
            }
        }
        self.batch += 1;
        self.batch - 1
    }

    /// Batches up to `batch` are committed: what they remembered for the batches decided on
    /// top of them (acks, loaded messages) is in the store now and is dropped.
    pub fn committed(&mut self, batch: u64) {
        self.messages.retire(batch);
        self.dedupe.retire(batch);
        self.dedupe_checked.retire(batch);
    }

    /// True when the caches have grown past their bound and
    /// [`ConversationStage::evict_caches`] is due.
    pub fn caches_full(&self) -> bool {
        self.conversations.len() > self.cfg.max_cached_conversations
            || self.absent.len() > self.cfg.max_cached_conversations
    }

    /// Drops the cached conversations. Only while no batch is open or being committed: the
    /// cache holds what uncommitted batches decided, which the store does not show yet.
    pub fn evict_caches(&mut self) {
        self.conversations.clear();
        self.absent.clear();
    }

    /// Forgets every cached state after a failed commit: the store is the truth again. Every
    /// batch decided after the failed one is void too (it was decided on top of it).
    pub fn reset(&mut self) {
        self.evict_caches();
        self.known_users.clear();
        self.messages.clear();
        self.dedupe.clear();
        self.dedupe_checked.clear();
        self.touched.clear();
        self.handoff.clear();
    }

    /// Gives up `id`, whose commands go to another partition from now on: its cached state,
    /// for that partition to [`ConversationStage::adopt`] (`None` when it is not cached).
    /// Only once every batch that touched it is committed.
    pub fn release(&mut self, id: &ConversationId) -> Option<ConversationState> {
        self.absent.remove(id);
        self.conversations.remove(id)
    }

    /// Takes over a conversation another partition released, with the state it held.
    pub fn adopt(&mut self, state: ConversationState) {
        self.absent.remove(&state.id);
        self.known_users.extend(state.members.keys().copied());
        self.conversations.insert(state.id.clone(), state);
    }

    /// The messages the last [`ConversationStage::apply`] appended, for the user stage.
    pub fn handed_off(&mut self) -> std::vec::Drain<'_, FanOut> {
        self.handoff.drain(..)
    }

    /// Applies one command. A refused command changes nothing.
    pub fn apply(
        &mut self,
        cmd: Command,
        now: i64,
        ch: &mut Changes,
        ev: &mut Vec<Event>,
    ) -> Outcome {
        match cmd {
            Command::UpsertUser { user, name, avatar } => {
                self.known_users.insert(user);
                ch.users.push((user, name, avatar, now));
                Ok(Reply::Done)
            }
            Command::Logout { user } => {
                // The edge ends the user's connections once this is durable and before it
                // answers (`Hub::revoke`): an event, handled later, could end a connection
                // opened meanwhile with a token minted after the logout.
                ch.logouts.push(user);
                Ok(Reply::Done)
            }
            Command::Send(s) => self.send(s, now, ch),
            Command::CreateGroup {
                id,
                owner,
                name,
                members,
            } => self.create_group(id, owner, name, members, now, ch),
            Command::Invite {
                actor,
                conversation,
                users,
            } => self.invite(actor, &conversation, users, now, ch),
            Command::RemoveMember {
                actor,
                conversation,
                user,
            } => self.remove(actor, &conversation, user, now, ch),
            Command::SetAdmin {
                actor,
                conversation,
                user,
                admin,
            } => self.set_admin(actor, conversation, user, admin, ch),
            Command::Mute {
                actor,
                conversation,
                user,
                duration_secs,
            } => self.mute(actor, &conversation, user, duration_secs, now, ch),
            Command::Unmute {
                actor,
                conversation,
                user,
            } => self.unmute(actor, &conversation, user, now, ch),
            Command::UpdateGroup {
                actor,
                conversation,
                patch,
            } => self.update_group(actor, conversation, patch, now, ch),
            Command::Dismiss {
                actor,
                conversation,
            } => self.dismiss(actor, &conversation, now, ch),
            Command::Recall { actor, msg_id } => self.recall(actor, msg_id, now, ch),
            Command::Edit {
                actor,
                msg_id,
                content,
            } => self.edit(actor, msg_id, content, now, ch),
            Command::AdminDelete { msg_id } => self.admin_delete(msg_id, ch),
            Command::HideMessage { user, msg_id } => self.hide_message(user, msg_id, ch),
            Command::Read {
                user,
                conversation,
                seq,
                from_device,
            } => self.read(user, conversation, seq, from_device, ch, ev),
            Command::Settings {
                user,
                conversation,
                patch,
            } => self.settings(user, conversation, patch, ch, ev),
            Command::AdvanceCursor {
                user,
                device,
                chain,
                seq,
            } => {
                self.advance_cursor(user, device, chain, seq, ch);
                Ok(Reply::Done)
            }
            Command::Flush => Ok(Reply::Done),
        }
    }

    /// The group `id`, for a change by `actor`; one `actor` is not in is refused as
    /// `rules::refusal_outside` says; only a member learns that a single chat is not a group.
    fn member_group_mut(
        &mut self,
        id: &ConversationId,
        actor: UserId,
    ) -> Result<&mut ConversationState, DomainError> {
        match self.conversations.get_mut(id) {
            Some(c) if c.members.contains_key(&actor) && c.is_group => Ok(c),
            Some(c) if c.members.contains_key(&actor) => Err(DomainError::invalid("not a group")),
            c => Err(rules::refusal_outside(actor, id, c.is_some())),
        }
    }

    fn member_conv_mut(
        &mut self,
        id: &ConversationId,
        user: UserId,
    ) -> Result<&mut ConversationState, DomainError> {
        match self.conversations.get_mut(id) {
            Some(c) if c.members.contains_key(&user) => Ok(c),
            c => Err(rules::refusal_outside(user, id, c.is_some())),
        }
    }

    fn conv_mut(&mut self, id: &ConversationId) -> &mut ConversationState {
        self.conversations
            .get_mut(id)
            .expect("conversation loaded and checked")
    }

    /// Records the current (or, with `left_seq`, the ended) membership row of `user`.
    fn write_member(
        &mut self,
        conv_id: &ConversationId,
        user: UserId,
        left_seq: Option<u64>,
        ch: &mut Changes,
    ) {
        let conv = self.conv_mut(conv_id);
        if let Some(state) = conv.members.get(&user) {
            let row = MemberRow {
                conversation: conv_id.clone(),
                user,
                state: state.clone(),
                left_seq,
            };
            ch.members.insert((conv_id.clone(), user), row);
        }
        self.touched.insert(conv_id.clone());
    }

    #[allow(clippy::too_many_arguments)]
    fn append(
        &mut self,
        conv_id: &ConversationId,
        sender: UserId,
        kind: MessageKind,
        extra: serde_json::Value,
        now: i64,
        ch: &mut Changes,
    ) -> Arc<Message> {
        let content = Content {
            kind,
            content: String::new(),
            extra,
            reply_to: None,
            mentions: Vec::new(),
        };
        self.append_full(conv_id, sender, None, content, now, ch)
    }

    /// Appends a message at the next seq and hands it to the user stage, with the members
    /// it goes to and how. The conversation must be loaded.
    #[allow(clippy::too_many_arguments)]
    fn append_full(
        &mut self,
        conv_id: &ConversationId,
        sender: UserId,
        client_msg_id: Option<ClientMsgId>,
        c: Content,
        now: i64,
        ch: &mut Changes,
    ) -> Arc<Message> {
        let msg_id =
            MsgId::new(self.shared.next_id(now)).expect("snowflakes are positive 63-bit ids");
        let write_max = self.cfg.fanout_write_max_members;
        let conv = self
            .conversations
            .get_mut(conv_id)
            .expect("conversation loaded and checked");
        conv.seq += 1;
        let seq = conv.seq;
        // Recall and edit commands change an older message; the list keeps showing that one.
        if !matches!(c.kind, MessageKind::Recall | MessageKind::Edit) {
            conv.last_msg_id = Some(msg_id);
        }
        conv.updated_at = now;
        let message = Arc::new(Message {
            msg_id,
            conversation_id: conv_id.to_string(),
            seq,
            sender,
            client_msg_id: client_msg_id.map(|c| c.to_string()),
            kind: c.kind,
            content: c.content,
            extra: c.extra,
            reply_to: c.reply_to,
            mentions: c.mentions,
            status: MessageStatus::Normal,
            version: 1,
            created_at: now,
            edited_at: None,
        });
        let fanout = conv.fanout(write_max);
        if fanout == Fanout::Read && conv.read_fanout_since.is_none() {
            conv.read_fanout_since = Some(seq);
        }
        let recipients = conv
            .members
            .iter()
            .map(|(user, member)| Recipient {
                user: *user,
                user_seq: None,
                muted: member.muted,
            })
            .collect();
        self.touched.insert(conv_id.clone());
        ch.messages.push((*message).clone());
        self.handoff.push(FanOut {
            message: message.clone(),
            recipients,
            fanout,
        });
        message
    }
}

struct Content {
    kind: MessageKind,
    content: String,
    extra: serde_json::Value,
    reply_to: Option<MsgId>,
    mentions: Vec<u64>,
}

fn role_of(conv: &ConversationState, user: UserId) -> Result<Role, DomainError> {
    conv.members
        .get(&user)
        .map(|m| m.role)
        .ok_or(DomainError::NotMember)
}

fn new_conversation(
    id: ConversationId,
    is_group: bool,
    name: Option<String>,
    owner: Option<UserId>,
    members: HashMap<UserId, MemberState>,
    now: i64,
) -> ConversationState {
    ConversationState {
        id,
        is_group,
        seq: 0,
        name,
        notice: None,
        avatar: None,
        owner,
        dismissed: false,
        last_msg_id: None,
        read_fanout_since: None,
        created_at: now,
        updated_at: now,
        members,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uid(n: u64) -> UserId {
        UserId::new(n).unwrap()
    }

    /// The conversation stage gives a message its `seq` and hands it on, with its members;
    /// it writes no inbox row (the user stage's).
    #[test]
    fn an_appended_message_is_handed_off_with_its_members() {
        let mut stage = ConversationStage::new(EngineConfig::default(), 0);
        let users: HashSet<UserId> = [uid(1), uid(2)].into();
        let asked = Needs {
            users: users.clone(),
            ..Needs::default()
        };
        stage.absorb(
            Loaded {
                users,
                ..Loaded::default()
            },
            &asked,
        );
        let (mut ch, mut ev) = (Changes::default(), Vec::new());
        let send = SendCommand::text(
            uid(1),
            SendTo::User(uid(2)),
            ClientMsgId::parse("m1").unwrap(),
            "hi",
        );
        stage
            .apply(Command::Send(send), 1_800_000_000_000, &mut ch, &mut ev)
            .unwrap();
        let handed: Vec<FanOut> = stage.handed_off().collect();
        assert_eq!(handed.len(), 1);
        assert_eq!(handed[0].message.seq, 1);
        assert_eq!(handed[0].fanout, Fanout::Write);
        let mut members: Vec<u64> = handed[0].recipients.iter().map(|r| r.user.get()).collect();
        members.sort();
        assert_eq!(members, vec![1, 2]);
        assert!(ch.inbox.is_empty());
        assert!(ev.is_empty(), "announced by the user stage");
        assert_eq!(ch.messages.len(), 1);
        assert_eq!(stage.handed_off().count(), 0, "handed off once");
    }
}

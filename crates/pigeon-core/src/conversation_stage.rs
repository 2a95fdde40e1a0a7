//! The conversation stage: applies commands in order to the cached conversations and records
//! the rows to commit and the events to publish. It owns `seq` assignment (one owner per
//! conversation), finds duplicate sends before it allocates, writes the message, the
//! conversation's summary and the sender's read mark, and chooses the fan-out: each message
//! it appends is handed to the user stage as a [`FanOut`]. It never does I/O: the pipeline
//! asks what it [`ConversationStage::needs`], loads that from the store, and
//! [`ConversationStage::absorb`]s it before applying a batch.

use crate::changes::{Changes, ConversationRow, Event, MemberRow, MessageUpdate};
use crate::command::{Command, CursorChain, Reply, SendCommand, SendTo};
use crate::engine::EngineConfig;
use crate::error::DomainError;
use crate::handoff::FanOut;
use crate::known_keys::KnownKeys;
use crate::rules::{self, outranks};
use crate::snowflake::Snowflake;
use crate::state::{ConversationState, MemberState};
use crate::store::{Loaded, Needs};
use crate::until_committed::UntilCommitted;
use pigeon_proto::views::{Fanout, Role, SendAck};
use pigeon_proto::{
    ClientMsgId, ConversationId, Message, MessageKind, MessageStatus, MsgId, UserId,
};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

pub struct ConversationStage {
    cfg: EngineConfig,
    ids: Snowflake,
    conversations: HashMap<ConversationId, ConversationState>,
    /// Conversations known not to exist (until created).
    absent: HashSet<ConversationId>,
    /// Registered users: who may join a conversation or be sent to.
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
    /// Every idempotency key the store may hold: a key it has never seen needs no look-up.
    known_keys: KnownKeys,
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
        ConversationStage {
            ids: Snowflake::new(cfg.node_id, max_msg_id),
            cfg,
            conversations: HashMap::new(),
            absent: HashSet::new(),
            known_users: HashSet::new(),
            batch: 1,
            messages: UntilCommitted::default(),
            dedupe: UntilCommitted::default(),
            dedupe_checked: UntilCommitted::default(),
            known_keys: KnownKeys::with_capacity(crate::known_keys::MIN_CAPACITY),
            touched: HashSet::new(),
            handoff: Vec::new(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Sizes the set of known idempotency keys for about `expected` keys. Call before
    /// [`Engine::remember_key`] at start.
    pub fn expect_keys(&mut self, expected: usize) {
        self.known_keys = KnownKeys::with_capacity(expected);
    }

    /// Tells the stage of an idempotency key the store holds. At start, for every stored
    /// key: a key it was not told of is taken for new without asking the store.
    pub fn remember_key(&mut self, sender: UserId, client_msg_id: &ClientMsgId) {
        self.known_keys.insert(sender, client_msg_id);
    }

    /// The time of the newest id handed out, or of the store's newest message at start:
    /// decisions made from now on must not be stamped earlier (the pipeline's decision
    /// clock).
    pub fn newest_id_ms(&self) -> i64 {
        self.ids.last_ms()
    }

    /// How many keys [`ConversationStage::remember_key`] and new sends have added.
    pub fn known_key_count(&self) -> u64 {
        self.known_keys.len()
    }

    /// Whether `user` is a registered user this stage knows of.
    pub fn knows(&self, user: UserId) -> bool {
        self.known_users.contains(&user)
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
            if !self.known_users.contains(&u) || !has_head(u) {
                n.users.insert(u);
            }
        };
        for cmd in batch {
            match cmd {
                Command::Send(s) => {
                    // Never seen (new for sure: the common case, asked first, with no key
                    // built), or known already (answered from memory): no look-up.
                    if self.known_keys.may_contain(s.sender, &s.client_msg_id) {
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
                Command::RemoveMember { conversation, .. }
                | Command::SetAdmin { conversation, .. }
                | Command::Mute { conversation, .. }
                | Command::Unmute { conversation, .. }
                | Command::UpdateGroup { conversation, .. }
                | Command::Dismiss { conversation, .. }
                | Command::Read { conversation, .. }
                | Command::Settings { conversation, .. } => want_conv(&mut n, conversation),
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
                owner,
                name,
                members,
            } => self.create_group(owner, name, members, now, ch),
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
            } => {
                let conv = self.member_group_mut(&conversation, actor)?;
                let actor_role = role_of(conv, actor)?;
                if actor_role != Role::Owner {
                    return Err(DomainError::Forbidden(
                        "only the owner appoints admins".into(),
                    ));
                }
                still_open(conv)?;
                let target = conv
                    .members
                    .get_mut(&user)
                    .ok_or(DomainError::NotFound("member"))?;
                if target.role == Role::Owner {
                    return Err(DomainError::Conflict(
                        "the owner's role cannot change".into(),
                    ));
                }
                target.role = if admin { Role::Admin } else { Role::Member };
                self.write_member(&conversation, user, None, ch);
                self.touched.insert(conversation);
                Ok(Reply::Done)
            }
            Command::Mute {
                actor,
                conversation,
                user,
                duration_secs,
            } => {
                if duration_secs == 0 || duration_secs > rules::MAX_MUTE_SECS {
                    return Err(DomainError::invalid(format!(
                        "duration_secs must be 1..={}",
                        rules::MAX_MUTE_SECS
                    )));
                }
                let until = now + (duration_secs as i64) * 1000;
                self.check_manage_member(actor, &conversation, user)?;
                self.conv_mut(&conversation)
                    .members
                    .get_mut(&user)
                    .expect("checked")
                    .mute_until = Some(until);
                self.write_member(&conversation, user, None, ch);
                let extra = json!({"from_user": actor, "to_user": user, "until": until});
                self.append(
                    &conversation,
                    actor,
                    MessageKind::MemberMuted,
                    extra,
                    now,
                    ch,
                );
                Ok(Reply::Done)
            }
            Command::Unmute {
                actor,
                conversation,
                user,
            } => {
                self.check_manage_member(actor, &conversation, user)?;
                self.conv_mut(&conversation)
                    .members
                    .get_mut(&user)
                    .expect("checked")
                    .mute_until = None;
                self.write_member(&conversation, user, None, ch);
                let extra = json!({"from_user": actor, "to_user": user});
                self.append(
                    &conversation,
                    actor,
                    MessageKind::MemberUnmuted,
                    extra,
                    now,
                    ch,
                );
                Ok(Reply::Done)
            }
            Command::UpdateGroup {
                actor,
                conversation,
                patch,
            } => {
                let conv = self.member_group_mut(&conversation, actor)?;
                if !role_of(conv, actor)?.manages() {
                    return Err(DomainError::Forbidden(
                        "only the owner and admins update the group".into(),
                    ));
                }
                still_open(conv)?;
                let mut changed = serde_json::Map::new();
                if let Some(name) = patch.name {
                    changed.insert("name".into(), json!(name));
                    conv.name = Some(name);
                }
                if let Some(notice) = patch.notice {
                    changed.insert("notice".into(), json!(notice));
                    conv.notice = Some(notice);
                }
                if let Some(avatar) = patch.avatar {
                    changed.insert("avatar".into(), json!(avatar));
                    conv.avatar = Some(avatar);
                }
                if changed.is_empty() {
                    return Err(DomainError::invalid(
                        "nothing to update: give name, notice or avatar",
                    ));
                }
                let extra = serde_json::Value::Object(changed);
                self.append(
                    &conversation,
                    actor,
                    MessageKind::GroupUpdated,
                    extra,
                    now,
                    ch,
                );
                Ok(Reply::Conversation(conversation))
            }
            Command::Dismiss {
                actor,
                conversation,
            } => {
                let conv = self.member_group_mut(&conversation, actor)?;
                if role_of(conv, actor)? != Role::Owner {
                    return Err(DomainError::Forbidden(
                        "only the owner dismisses the group".into(),
                    ));
                }
                if conv.dismissed {
                    return Err(DomainError::Conflict(
                        "the group was dismissed already".into(),
                    ));
                }
                self.append(
                    &conversation,
                    actor,
                    MessageKind::GroupDismissed,
                    json!({}),
                    now,
                    ch,
                );
                self.conv_mut(&conversation).dismissed = true;
                Ok(Reply::Done)
            }
            Command::Recall { actor, msg_id } => self.recall(actor, msg_id, now, ch),
            Command::Edit {
                actor,
                msg_id,
                content,
            } => self.edit(actor, msg_id, content, now, ch),
            Command::AdminDelete { msg_id } => {
                let mut msg = self.existing_message(msg_id)?;
                if msg.status != MessageStatus::Deleted {
                    // "Content gone" (PROTOCOL.md 6): its payload, mentions and earlier
                    // versions too, even from the admin audit.
                    msg.status = MessageStatus::Deleted;
                    msg.content.clear();
                    msg.extra = serde_json::Value::Null;
                    msg.mentions.clear();
                    ch.message_updates.push(MessageUpdate {
                        msg_id,
                        status: MessageStatus::Deleted,
                        version: msg.version,
                        content: Some(String::new()),
                        edited_at: msg.edited_at,
                        recalled: None,
                    });
                    self.messages.insert(self.batch, msg_id, Some(msg.clone()));
                }
                Ok(Reply::Message(Box::new(msg)))
            }
            Command::HideMessage { user, msg_id } => {
                let msg = self.existing_message(msg_id)?;
                let conv_id = ConversationId::parse(&msg.conversation_id)
                    .map_err(|_| DomainError::NotFound("message"))?;
                let conv = self
                    .conversations
                    .get(&conv_id)
                    .ok_or(DomainError::NotFound("message"))?;
                let m = conv
                    .members
                    .get(&user)
                    .ok_or(DomainError::NotFound("message"))?;
                if msg.seq < m.joined_seq {
                    return Err(DomainError::NotFound("message"));
                }
                ch.hidden_messages.push((user, msg_id));
                Ok(Reply::Done)
            }
            Command::Read {
                user,
                conversation,
                seq,
                from_device,
            } => {
                let conv = self.member_conv_mut(&conversation, user)?;
                let newest = conv.seq;
                let member = conv.members.get_mut(&user).expect("member checked");
                let target = seq.min(newest);
                if target <= member.last_read_seq {
                    return Ok(Reply::LastRead(member.last_read_seq));
                }
                member.last_read_seq = target;
                let to: Vec<UserId> = conv.members.keys().copied().collect();
                self.write_member(&conversation, user, None, ch);
                ev.push(Event::Receipt {
                    conversation,
                    user,
                    last_read_seq: target,
                    to,
                    except_device: from_device,
                });
                Ok(Reply::LastRead(target))
            }
            Command::Settings {
                user,
                conversation,
                patch,
            } => {
                let conv = self.member_conv_mut(&conversation, user)?;
                let newest = conv.seq;
                let m = conv.members.get_mut(&user).expect("member checked");
                if let Some(p) = patch.pinned {
                    m.pinned = p;
                }
                if let Some(mu) = patch.muted {
                    m.muted = mu;
                }
                if let Some(h) = patch.hidden {
                    m.hidden_seq = h.then_some(newest);
                }
                let (pinned, muted, hidden) = (m.pinned, m.muted, m.hidden(newest));
                self.write_member(&conversation, user, None, ch);
                ev.push(Event::SettingsChanged {
                    user,
                    conversation: conversation.clone(),
                    pinned,
                    muted,
                    hidden,
                });
                Ok(Reply::Conversation(conversation))
            }
            Command::AdvanceCursor {
                user,
                device,
                chain,
                seq,
            } => {
                // An acknowledgement past the chain's newest seq counts up to the newest:
                // stored as given, the device would skip what comes next when it resumes.
                // A conversation's is saved for its members only. One cached with the user
                // in it is clamped here; any other is not loaded (an ack can name any id):
                // the store checks membership and clamps (`member_cursors`), which also
                // saves a former member's position up to their removal. One known not to
                // exist is dropped.
                match &chain {
                    // The user stage's: the engine clamps it to the inbox head.
                    CursorChain::Inbox => {}
                    CursorChain::Conversation(c) => match self.conversations.get(c) {
                        Some(conv) if conv.members.contains_key(&user) => {
                            let newest = conv.seq;
                            ch.cursors.push((
                                user,
                                device,
                                chain.key().to_owned(),
                                seq.min(newest),
                            ));
                        }
                        None if self.absent.contains(c) => {}
                        // Not cached, or not in it now (a former member's, perhaps).
                        _ => ch.member_cursors.push((user, device, c.clone(), seq)),
                    },
                }
                Ok(Reply::Done)
            }
            Command::Flush => Ok(Reply::Done),
        }
    }

    fn send(&mut self, s: SendCommand, now: i64, ch: &mut Changes) -> Outcome {
        let key = (s.sender, s.client_msg_id.clone());
        if let Some(ack) = self.dedupe.get(&key) {
            return Ok(Reply::SendAck(SendAck {
                duplicate: true,
                ..ack.clone()
            }));
        }
        let conv_id = match target(&s) {
            Target::Peer(peer) => {
                let id = ConversationId::single(s.sender, peer)
                    .map_err(|e| DomainError::invalid(e.0))?;
                if !self.conversations.contains_key(&id) {
                    if !self.known_users.contains(&peer) {
                        return Err(DomainError::NotFound("user"));
                    }
                    self.create_single(&id, s.sender, peer, now);
                    self.write_member(&id, peer, None, ch);
                }
                id
            }
            Target::Group(id) => id.clone(),
        };
        let conv = self.member_conv_mut(&conv_id, s.sender)?;
        still_open(conv)?;
        let me = conv.members.get(&s.sender).expect("member checked");
        if me.mute_until.is_some_and(|until| until > now) {
            return Err(DomainError::Muted);
        }
        let content = Content {
            kind: s.kind,
            content: s.content,
            extra: s.extra,
            reply_to: s.reply_to,
            mentions: s.mentions,
        };
        let msg = self.append_full(
            &conv_id,
            s.sender,
            Some(s.client_msg_id.clone()),
            content,
            now,
            ch,
        );
        // Sending reads everything up to the new message for the sender.
        if let Some(m) = self.conv_mut(&conv_id).members.get_mut(&s.sender) {
            m.last_read_seq = msg.seq;
        }
        self.write_member(&conv_id, s.sender, None, ch);
        let ack = SendAck {
            client_msg_id: s.client_msg_id.to_string(),
            msg_id: msg.msg_id,
            conversation_id: conv_id,
            seq: msg.seq,
            created_at: msg.created_at,
            duplicate: false,
        };
        self.known_keys.insert(key.0, &key.1);
        self.dedupe.insert(self.batch, key, ack.clone());
        Ok(Reply::SendAck(ack))
    }

    fn create_single(&mut self, id: &ConversationId, a: UserId, b: UserId, now: i64) {
        let member = || MemberState::joined(Role::Member, 1, 0, now);
        let members = [(a, member()), (b, member())].into_iter().collect();
        self.absent.remove(id);
        self.conversations.insert(
            id.clone(),
            new_conversation(id.clone(), false, None, None, members, now),
        );
    }

    fn create_group(
        &mut self,
        owner: UserId,
        name: String,
        members: Vec<UserId>,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        rules::validate_text_field("name", &name, rules::MAX_GROUP_NAME_CHARS)?;
        let mut all = vec![owner];
        for m in members {
            if !all.contains(&m) {
                all.push(m);
            }
        }
        if all.len() > rules::MAX_USERS_PER_REQUEST + 1 {
            return Err(DomainError::invalid(format!(
                "at most {} members at creation",
                rules::MAX_USERS_PER_REQUEST
            )));
        }
        // `not_found`: "no such ... user" (PROTOCOL.md 1), as for a send to one.
        if all.iter().any(|u| !self.known_users.contains(u)) {
            return Err(DomainError::NotFound("user"));
        }
        let id = ConversationId::group(self.ids.next(now));
        let members = all
            .iter()
            .map(|u| {
                let role = if *u == owner {
                    Role::Owner
                } else {
                    Role::Member
                };
                // Joined with the creation message (seq 1), which each has read: "a member
                // who joins a group has read everything sent before they joined".
                (*u, MemberState::joined(role, 1, 1, now))
            })
            .collect();
        self.conversations.insert(
            id.clone(),
            new_conversation(id.clone(), true, Some(name), Some(owner), members, now),
        );
        for u in &all {
            self.write_member(&id, *u, None, ch);
        }
        let extra = json!({ "members": all });
        self.append(&id, owner, MessageKind::GroupCreated, extra, now, ch);
        Ok(Reply::Conversation(id))
    }

    fn invite(
        &mut self,
        actor: UserId,
        conv_id: &ConversationId,
        users: Vec<UserId>,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        rules::validate_invitees(&users)?;
        // Looked up before the group is borrowed: at most a thousand, not a copy of every
        // known user.
        let unknown: HashSet<UserId> = users
            .iter()
            .filter(|u| !self.known_users.contains(u))
            .copied()
            .collect();
        let conv = self.member_group_mut(conv_id, actor)?;
        role_of(conv, actor)?;
        still_open(conv)?;
        let mut fresh: Vec<UserId> = Vec::new();
        for u in users {
            if conv.members.contains_key(&u) {
                return Err(DomainError::Conflict(format!(
                    "user {u} is already a member"
                )));
            }
            if unknown.contains(&u) {
                return Err(DomainError::NotFound("user"));
            }
            if !fresh.contains(&u) {
                fresh.push(u);
            }
        }
        if conv.members.len() + fresh.len() > rules::MAX_GROUP_MEMBERS {
            return Err(DomainError::Conflict(format!(
                "a group holds at most {} members",
                rules::MAX_GROUP_MEMBERS
            )));
        }
        // New members see the invitation itself; their read mark starts at the newest seq, the
        // invitation (PROTOCOL.md: a joiner has read everything sent before they joined).
        let invite_seq = conv.seq + 1;
        for u in &fresh {
            conv.members.insert(
                *u,
                MemberState::joined(Role::Member, invite_seq, invite_seq, now),
            );
        }
        for u in &fresh {
            self.write_member(conv_id, *u, None, ch);
        }
        let extra = json!({"from_user": actor, "to_users": fresh});
        self.append(conv_id, actor, MessageKind::MemberInvited, extra, now, ch);
        Ok(Reply::Done)
    }

    fn remove(
        &mut self,
        actor: UserId,
        conv_id: &ConversationId,
        user: UserId,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        let conv = self.member_group_mut(conv_id, actor)?;
        let actor_role = role_of(conv, actor)?;
        // A dismissed group is read-only: nobody is kicked from it or quits it (a member who
        // no longer wants to see it hides it).
        still_open(conv)?;
        // Rights before the target, as for mutes: a plain member who names someone else is
        // refused (`forbidden`) whether or not that user is in the group.
        if actor != user && !actor_role.manages() {
            return Err(DomainError::Forbidden(
                "only the owner and admins remove members".into(),
            ));
        }
        let target_role = conv
            .members
            .get(&user)
            .map(|m| m.role)
            .ok_or(DomainError::NotFound("member"))?;
        let (kind, extra) = if actor == user {
            if actor_role == Role::Owner {
                return Err(DomainError::Forbidden(
                    "the owner cannot quit; dismiss the group instead".into(),
                ));
            }
            (MessageKind::MemberQuit, json!({"user": user}))
        } else {
            if !outranks(actor_role, target_role) {
                return Err(DomainError::Forbidden(
                    "cannot remove a member of equal or higher role".into(),
                ));
            }
            (
                MessageKind::MemberKicked,
                json!({"from_user": actor, "to_users": [user]}),
            )
        };
        // The removal is the last message the removed member receives.
        let msg = self.append(conv_id, actor, kind, extra, now, ch);
        self.write_member(conv_id, user, Some(msg.seq), ch);
        self.conv_mut(conv_id).members.remove(&user);
        self.touched.insert(conv_id.clone());
        Ok(Reply::Done)
    }

    fn recall(&mut self, actor: UserId, msg_id: MsgId, now: i64, ch: &mut Changes) -> Outcome {
        let msg = self.existing_message(msg_id)?;
        let conv_id = self.recallable_conversation_of(&msg, actor)?;
        // A manager may recall what was sent before they joined, which they cannot read:
        // what cannot be recalled of it answers as if it did not exist.
        let readable = self.visible_conversation_of(&msg, actor).is_ok();
        if !readable && (!msg.kind.is_user_content() || msg.status == MessageStatus::Deleted) {
            return Err(DomainError::NotFound("message"));
        }
        if !msg.kind.is_user_content() {
            return Err(DomainError::invalid("only user messages can be recalled"));
        }
        let conv = self.conversations.get(&conv_id).expect("visible checked");
        let manager = conv.is_group && conv.members.get(&actor).is_some_and(|m| m.role.manages());
        if msg.sender != actor && !manager {
            return Err(DomainError::Forbidden(
                "only the sender or a group admin may recall".into(),
            ));
        }
        // A retry of a recall that was done answers as the first did, dismissed or not.
        if msg.status == MessageStatus::Recalled {
            return Ok(Reply::Message(Box::new(msg.redacted(false))));
        }
        still_open(conv)?;
        if msg.status == MessageStatus::Deleted {
            return Err(DomainError::Conflict("the message was deleted".into()));
        }
        if !manager && now - msg.created_at > self.cfg.recall_window_ms {
            return Err(DomainError::WindowExpired);
        }
        let mut updated = msg.clone();
        updated.status = MessageStatus::Recalled;
        ch.message_updates.push(MessageUpdate {
            msg_id,
            status: MessageStatus::Recalled,
            version: msg.version,
            content: None,
            edited_at: msg.edited_at,
            recalled: Some((now, actor)),
        });
        self.messages
            .insert(self.batch, msg_id, Some(updated.clone()));
        let extra = json!({"msg_id": msg_id});
        self.append(&conv_id, actor, MessageKind::Recall, extra, now, ch);
        Ok(Reply::Message(Box::new(updated.redacted(false))))
    }

    fn edit(
        &mut self,
        actor: UserId,
        msg_id: MsgId,
        content: String,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        let msg = self.existing_message(msg_id)?;
        let conv_id = self.visible_conversation_of(&msg, actor)?;
        if msg.sender != actor {
            return Err(DomainError::Forbidden(
                "only the sender may edit a message".into(),
            ));
        }
        if msg.kind != MessageKind::Text {
            return Err(DomainError::invalid("only text messages can be edited"));
        }
        let conv = self.conversations.get(&conv_id).expect("visible checked");
        // A dismissed group is read-only: that answers before the message's own state.
        still_open(conv)?;
        // An edit reaches every member, as a send does: not while muted.
        let me = conv.members.get(&actor).expect("visible: a member");
        let muted = me.mute_until.is_some_and(|until| until > now);
        if msg.status != MessageStatus::Normal {
            return Err(DomainError::Conflict(format!(
                "the message is {}",
                msg.status.as_str()
            )));
        }
        if now - msg.created_at > self.cfg.edit_window_ms {
            return Err(DomainError::WindowExpired);
        }
        if msg.version >= rules::MAX_MESSAGE_VERSIONS {
            return Err(DomainError::Conflict(format!(
                "a message keeps at most {} versions",
                rules::MAX_MESSAGE_VERSIONS
            )));
        }
        if muted {
            return Err(DomainError::Muted);
        }
        let mut updated = msg.clone();
        updated.version += 1;
        updated.content = content.clone();
        updated.edited_at = Some(now);
        if msg.version == 1 {
            ch.versions
                .push((msg_id, 1, msg.content.clone(), msg.created_at));
        }
        ch.versions
            .push((msg_id, updated.version, content.clone(), now));
        ch.message_updates.push(MessageUpdate {
            msg_id,
            status: MessageStatus::Normal,
            version: updated.version,
            content: Some(content),
            edited_at: Some(now),
            recalled: None,
        });
        self.messages
            .insert(self.batch, msg_id, Some(updated.clone()));
        let extra = json!({"msg_id": msg_id, "version": updated.version});
        self.append(&conv_id, actor, MessageKind::Edit, extra, now, ch);
        Ok(Reply::Message(Box::new(updated)))
    }

    /// The conversation of `msg`, if `user` may see the message (a current member who joined
    /// at or before it); `not_found` otherwise, so nothing leaks.
    fn visible_conversation_of(
        &self,
        msg: &Message,
        user: UserId,
    ) -> Result<ConversationId, DomainError> {
        let conv_id = ConversationId::parse(&msg.conversation_id)
            .map_err(|_| DomainError::NotFound("message"))?;
        let conv = self
            .conversations
            .get(&conv_id)
            .ok_or(DomainError::NotFound("message"))?;
        match conv.members.get(&user) {
            Some(m) if msg.seq >= m.joined_seq => Ok(conv_id),
            _ => Err(DomainError::NotFound("message")),
        }
    }

    /// The conversation of a message `actor` may recall: one they see, or any message of a
    /// group they own or administer, sent before they joined too (PROTOCOL.md 6: "a group's
    /// owner and admins may recall any message of the group at any time").
    fn recallable_conversation_of(
        &self,
        msg: &Message,
        actor: UserId,
    ) -> Result<ConversationId, DomainError> {
        if let Ok(conv_id) = ConversationId::parse(&msg.conversation_id)
            && let Some(conv) = self.conversations.get(&conv_id)
            && conv.is_group
            && conv.members.get(&actor).is_some_and(|m| m.role.manages())
        {
            return Ok(conv_id);
        }
        self.visible_conversation_of(msg, actor)
    }

    fn existing_message(&self, msg_id: MsgId) -> Result<Message, DomainError> {
        match self.messages.get(&msg_id) {
            Some(Some(m)) => Ok(m.clone()),
            _ => Err(DomainError::NotFound("message")),
        }
    }

    fn check_manage_member(
        &mut self,
        actor: UserId,
        conv_id: &ConversationId,
        user: UserId,
    ) -> Result<(), DomainError> {
        let conv = self.member_group_mut(conv_id, actor)?;
        let actor_role = role_of(conv, actor)?;
        if !actor_role.manages() {
            return Err(DomainError::Forbidden(
                "only the owner and admins mute members".into(),
            ));
        }
        still_open(conv)?;
        let target = conv
            .members
            .get(&user)
            .ok_or(DomainError::NotFound("member"))?;
        if !outranks(actor_role, target.role) {
            return Err(DomainError::Forbidden(
                "cannot mute a member of equal or higher role".into(),
            ));
        }
        Ok(())
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
        let msg_id = MsgId::new(self.ids.next(now)).expect("snowflakes are positive 63-bit ids");
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
        let members = conv
            .members
            .iter()
            .map(|(user, member)| (*user, member.muted))
            .collect();
        self.touched.insert(conv_id.clone());
        ch.messages.push((*message).clone());
        self.handoff.push(FanOut {
            message: message.clone(),
            members,
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
        let mut members: Vec<u64> = handed[0].members.iter().map(|(u, _)| u.get()).collect();
        members.sort();
        assert_eq!(members, vec![1, 2]);
        assert!(ch.inbox.is_empty());
        assert!(ev.is_empty(), "announced by the user stage");
        assert_eq!(ch.messages.len(), 1);
        assert_eq!(stage.handed_off().count(), 0, "handed off once");
    }
}

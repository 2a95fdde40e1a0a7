//! The engine: the two stages of a decision, side by side. The conversation stage
//! (`conversation_stage/`) decides each command on its conversation and hands every
//! message it appends to the user stage (`user_stage.rs`), which puts it into the members'
//! inboxes; both stages' rows go into one batch of [`Changes`], committed as one unit. It
//! never does I/O: its caller asks it what it [`Engine::needs`], loads that from the store,
//! and [`Engine::absorb`]s it before applying a batch. One node's whole decision in one
//! value, as the store's suite and the domain's tests drive it; the server's pipeline runs
//! the two stages apart (a conversation stage per partition, the user stage in its
//! committer).

use crate::changes::{Changes, Event};
use crate::command::{Command, CursorChain, Reply};
use crate::conversation_stage::ConversationStage;
use crate::error::DomainError;
use crate::node::NodeShared;
use crate::store::{Loaded, Needs};
use crate::user_stage::UserStage;
use pigeon_proto::{ClientMsgId, UserId};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub fanout_write_max_members: u64,
    pub recall_window_ms: i64,
    pub edit_window_ms: i64,
    pub node_id: u16,
    /// Above this many cached conversations the cache is dropped between batches.
    pub max_cached_conversations: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            fanout_write_max_members: 500,
            recall_window_ms: 120_000,
            edit_window_ms: 86_400_000,
            node_id: 0,
            max_cached_conversations: 200_000,
        }
    }
}

pub struct Engine {
    conversations: ConversationStage,
    users: UserStage,
}

impl Engine {
    pub fn new(cfg: EngineConfig, max_msg_id: u64) -> Self {
        Engine {
            conversations: ConversationStage::new(cfg, max_msg_id),
            users: UserStage::default(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        self.conversations.config()
    }

    /// What this engine shares with a node's partitions: ids, known idempotency keys,
    /// durable registrations.
    pub fn shared(&self) -> &Arc<NodeShared> {
        self.conversations.shared()
    }

    /// Sizes the set of known idempotency keys for about `expected` keys. Call before
    /// [`Engine::remember_key`] at start.
    pub fn expect_keys(&mut self, expected: usize) {
        self.shared().expect_keys(expected);
    }

    /// Tells the engine of an idempotency key the store holds (see
    /// [`NodeShared::remember_key`]).
    pub fn remember_key(&mut self, sender: UserId, client_msg_id: &ClientMsgId) {
        self.shared().remember_key(sender, client_msg_id);
    }

    /// The time of the newest id handed out, or of the store's newest message at start.
    pub fn newest_id_ms(&self) -> i64 {
        self.shared().newest_id_ms()
    }

    pub fn known_key_count(&self) -> u64 {
        self.shared().known_key_count()
    }

    /// What must be loaded before `batch` can be applied. Call again after each
    /// [`Engine::absorb`] until it is empty.
    pub fn needs(&self, batch: &[Command]) -> Needs {
        let mut n = self
            .conversations
            .needs(batch, |u| !self.users.lacks_head(u));
        for cmd in batch {
            // The inbox head of an acknowledging connection's own user (cheap, and held
            // while they get messages), and whether a user being registered is new.
            if let Command::AdvanceCursor {
                user,
                chain: CursorChain::Inbox,
                ..
            }
            | Command::UpsertUser { user, .. } = cmd
                && (!self.conversations.knows(*user) || self.users.lacks_head(*user))
            {
                n.users.insert(*user);
            }
        }
        n
    }

    /// Takes in what the store loaded for [`Engine::needs`]: the inbox heads for the user
    /// stage, the rest for the conversation stage.
    pub fn absorb(&mut self, mut loaded: Loaded, asked: &Needs) {
        let heads = std::mem::take(&mut loaded.inbox_heads);
        self.conversations.absorb(loaded, asked);
        // Heads only of users that exist (the store answers one for every user asked about,
        // and an invitation of made-up ids must not grow the map); one with no inbox yet
        // starts at 0.
        for (u, head) in heads {
            if self.conversations.knows(u) {
                self.users.absorb_head(u, head);
            }
        }
        for u in &asked.users {
            if self.conversations.knows(*u) {
                self.users.absorb_head(*u, 0);
            }
        }
    }

    /// Closes the open batch (see [`ConversationStage::seal`]); answers its number.
    pub fn seal(&mut self, changes: &mut Changes) -> u64 {
        self.conversations.seal(changes)
    }

    /// Batches up to `batch` are committed.
    pub fn committed(&mut self, batch: u64) {
        self.conversations.committed(batch);
    }

    pub fn caches_full(&self) -> bool {
        self.conversations.caches_full()
    }

    /// Drops the cached conversations and the inbox heads of their members. Only while no
    /// batch is open or being committed.
    pub fn evict_caches(&mut self) {
        self.conversations.evict_caches();
        self.users.clear();
    }

    /// Forgets every cached state after a failed commit: the store is the truth again.
    pub fn reset(&mut self) {
        self.conversations.reset();
        self.users.clear();
    }

    /// Applies one command: its conversation's decision, then the user stage's inboxes for
    /// what it appended. A refused command changes nothing.
    pub fn apply(
        &mut self,
        cmd: Command,
        now: i64,
        ch: &mut Changes,
        ev: &mut Vec<Event>,
    ) -> Result<Reply, DomainError> {
        match cmd {
            // A user the store did not know is new, with no inbox yet, and may be written to
            // later in this very batch.
            Command::UpsertUser { user, .. } if !self.conversations.knows(user) => {
                self.users.absorb_head(user, 0);
            }
            Command::AdvanceCursor {
                user,
                device,
                chain: CursorChain::Inbox,
                seq,
            } => {
                self.users.inbox_cursor(user, device, seq, ch);
                return Ok(Reply::Done);
            }
            _ => {}
        }
        let outcome = self.conversations.apply(cmd, now, ch, ev);
        for f in self.conversations.handed_off() {
            self.users.deliver(f, ch, ev);
        }
        outcome
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;

//! The store port: what the write pipeline and the read paths need of durable storage.
//! Every adapter passes the same suite (`store_suite.rs`); the embedded one is SQLite's
//! (`pigeon-store-sqlite`).

use crate::changes::Changes;
use crate::state::ConversationState;
use pigeon_proto::frames::SyncConversation;
use pigeon_proto::views::{ChainItem, ConversationView, MemberView, Role, SendAck, VersionView};
use pigeon_proto::{ClientMsgId, ConversationId, Message, MsgId, UserId};
use std::collections::{HashMap, HashSet};

/// A storage failure, by what its caller may do about it. Its text is logged, never sent
/// to clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Transient: the same operation may go through if it is tried again as it is (a lock
    /// held too long, a transaction that lost a race with another).
    #[error("store (retry): {0}")]
    Retry(String),
    /// The operation contradicts what is stored (a unique key taken): tried again as it is,
    /// it fails again.
    #[error("store (conflict): {0}")]
    Conflict(String),
    /// The store cannot take the operation now (closed, stopped, behind, or unreachable):
    /// a client may retry later.
    #[error("store (unavailable): {0}")]
    Unavailable(String),
}

impl StoreError {
    pub fn unavailable(message: impl Into<String>) -> Self {
        StoreError::Unavailable(message.into())
    }

    /// What happened, without its kind.
    pub fn message(&self) -> &str {
        match self {
            StoreError::Retry(m) | StoreError::Conflict(m) | StoreError::Unavailable(m) => m,
        }
    }
}

/// What the engine is missing to decide a batch.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Needs {
    pub conversations: HashSet<ConversationId>,
    /// Users whose existence and inbox head are needed.
    pub users: HashSet<UserId>,
    pub messages: HashSet<MsgId>,
    pub dedupe: HashSet<(UserId, ClientMsgId)>,
}

impl Needs {
    pub fn is_empty(&self) -> bool {
        self.conversations.is_empty()
            && self.users.is_empty()
            && self.messages.is_empty()
            && self.dedupe.is_empty()
    }
}

/// The answer to [`Needs`]. Every conversation asked for is present (`None` when it does not
/// exist); inbox heads cover the users asked for and every current member of the loaded
/// conversations; `users` holds those of the asked-for users that are registered.
#[derive(Debug, Default)]
pub struct Loaded {
    pub conversations: HashMap<ConversationId, Option<ConversationState>>,
    pub users: HashSet<UserId>,
    pub inbox_heads: HashMap<UserId, u64>,
    pub messages: HashMap<MsgId, Message>,
    pub dedupe: HashMap<(UserId, ClientMsgId), SendAck>,
}

/// A registered user.
#[derive(Debug, Clone, PartialEq)]
pub struct UserRecord {
    pub user_id: UserId,
    pub name: String,
    pub avatar: String,
    /// Bumped by logout; tokens minted under an older generation are revoked.
    pub token_gen: u64,
}

/// One user's membership of one conversation, current or ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Membership {
    pub role: Role,
    pub joined_seq: u64,
    pub left_seq: Option<u64>,
    pub last_read_seq: u64,
    /// The conversation's newest seq.
    pub conversation_seq: u64,
    pub is_read_fanout: bool,
}

impl Membership {
    /// A device's position in this conversation's chain when it gives none (see
    /// [`chain_position`]).
    pub fn chain_position(&self, stored: u64) -> u64 {
        chain_position(stored, self.joined_seq)
    }
}

/// A device's position in a group's chain when it gives none: its stored cursor (0 for a
/// device that never acknowledged any of it, PROTOCOL.md 5.3), but no lower than just
/// before the member's first readable message (`joined_seq`). `sync` reports it as the
/// group's `cursor`, and `pull` starts after it, so the two agree. (In a group that turned
/// to read fan-out, what came before also reached the inbox: a device that pulls it again
/// keeps it once, by seq.)
pub fn chain_position(stored: u64, joined_seq: u64) -> u64 {
    stored.max(joined_seq.saturating_sub(1))
}

/// Which page of history.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HistoryAnchor {
    Newest,
    Before(u64),
    After(u64),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HistoryQuery {
    pub anchor: HistoryAnchor,
    pub limit: u32,
    pub from_time: Option<i64>,
    pub to_time: Option<i64>,
}

/// A stored message with its audit fields (admin API).
#[derive(Debug, Clone, PartialEq)]
pub struct AuditedMessage {
    /// Original content, even of a recalled message.
    pub message: Message,
    pub recalled_at: Option<i64>,
    pub recalled_by: Option<UserId>,
}

/// Position in the conversation list: (pinned, updated_at, conversation_id) of the last entry.
#[derive(Debug, Clone, PartialEq)]
pub struct ListCursor {
    pub pinned: bool,
    pub updated_at: i64,
    /// The id of the conversation's last message: a snowflake, so it orders conversations
    /// whose activity fell in the same millisecond.
    pub last_msg_id: u64,
    pub conversation_id: ConversationId,
}

/// Where a page of idempotency keys ended: the raw key of its last row (a row whose key no
/// longer parses still moves the cursor on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCursor {
    pub sender: u64,
    pub client_msg_id: String,
}

/// A page of idempotency keys and the cursor of the next page (`None` after the last).
pub type KeyPage = (Vec<(UserId, ClientMsgId)>, Option<KeyCursor>);

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    // The write pipeline.
    /// Reads what the engine is missing from the tables as they are, without waiting for
    /// commits that a store applies after acknowledging them (see [`Store::caught_up`]): the
    /// engine holds in memory the conversations, members, inbox heads and users such commits
    /// touched; for messages, or after losing its memory, the caller waits with `caught_up`
    /// first. Idempotency keys (`dedupe`) are answered against every acknowledged commit,
    /// applied or not: a duplicate check is on the path of every send whose key the engine
    /// cannot rule out, and must not wait for the tables.
    async fn load(&self, needs: Needs) -> Result<Loaded, StoreError>;
    /// Waits until the tables hold every commit acknowledged before the call. Every read
    /// query below does this by itself; [`Store::load`] does not. A store that applies a
    /// commit before acknowledging it is always caught up.
    async fn caught_up(&self) -> Result<(), StoreError> {
        Ok(())
    }
    /// Makes `changes` durable as one unit: all of them, or none. An adapter tries again by
    /// itself what it knows may go through (a transaction that lost a race); a commit that
    /// fails stored nothing, as far as the store can tell, and the pipeline refuses the
    /// batch and reloads its state. [`StoreError::Conflict`] here means the batch breaks a
    /// rule of the tables the engine should have kept (a bug).
    async fn commit(&self, changes: Changes) -> Result<(), StoreError>;
    /// Finishes what was committed and releases the store's files; later commits fail.
    /// Called once the pipeline has flushed, at shutdown.
    async fn close(&self) {}
    /// The largest msg_id ever stored (floor for the id generator).
    async fn max_msg_id(&self) -> Result<u64, StoreError>;
    /// How many idempotency keys `(sender, client_msg_id)` are stored.
    async fn idempotency_key_count(&self) -> Result<u64, StoreError>;
    /// Stored idempotency keys in key order, from the first `limit` rows after the cursor
    /// `after` (`None`: from the start): at start the engine learns them all, page by page
    /// (see `NodeShared::remember_key`). Answers the page's keys and the cursor of the next page,
    /// `None` when this was the last.
    async fn idempotency_keys(
        &self,
        after: Option<KeyCursor>,
        limit: usize,
    ) -> Result<KeyPage, StoreError>;

    // Settings kept by the store (admin key, token secret).
    async fn meta_get(&self, key: &str) -> Result<Option<String>, StoreError>;
    async fn meta_set(&self, key: &str, value: &str) -> Result<(), StoreError>;

    // Reads.
    async fn user(&self, user: UserId) -> Result<Option<UserRecord>, StoreError>;
    async fn membership(
        &self,
        conv: &ConversationId,
        user: UserId,
    ) -> Result<Option<Membership>, StoreError>;
    /// Whether `conv` exists (a single chat exists from its first message on).
    async fn conversation_exists(&self, conv: &ConversationId) -> Result<bool, StoreError>;
    /// One page of `conv` between seqs `lo ..= hi` (the reader's visible range), as `reader`
    /// sees it, ascending; and whether more exist beyond the page in the direction asked.
    async fn history(
        &self,
        conv: &ConversationId,
        reader: UserId,
        range: (u64, u64),
        query: HistoryQuery,
    ) -> Result<(Vec<Message>, bool), StoreError>;
    /// The conversations `user` is a member of, as the list shows them; one when `only` is set.
    async fn conversations(
        &self,
        user: UserId,
        only: Option<&ConversationId>,
        after: Option<ListCursor>,
        limit: u32,
        include_hidden: bool,
    ) -> Result<Vec<ConversationView>, StoreError>;
    async fn members(
        &self,
        conv: &ConversationId,
        after: Option<UserId>,
        limit: u32,
    ) -> Result<Vec<MemberView>, StoreError>;
    async fn message(&self, msg_id: MsgId) -> Result<Option<AuditedMessage>, StoreError>;
    async fn versions(&self, msg_id: MsgId) -> Result<Vec<VersionView>, StoreError>;
    async fn is_hidden_for(&self, user: UserId, msg_id: MsgId) -> Result<bool, StoreError>;
    async fn inbox_head(&self, user: UserId) -> Result<u64, StoreError>;
    /// What a connecting device starts from: `user`'s inbox head and token generation
    /// (`None`: no such user). In one read where the store can: every connection makes it.
    async fn connect_state(&self, user: UserId) -> Result<(u64, Option<u64>), StoreError> {
        let head = self.inbox_head(user).await?;
        let token_gen = self.user(user).await?.map(|u| u.token_gen);
        Ok((head, token_gen))
    }
    /// Inbox entries `from ..= to`, at most `limit`, ascending, as `user` sees them; and
    /// whether the inbox holds more after the last one up to `to`.
    async fn pull_inbox(
        &self,
        user: UserId,
        from: u64,
        to: u64,
        limit: u32,
    ) -> Result<(Vec<ChainItem>, bool), StoreError>;
    async fn cursor(&self, user: UserId, device: &str, chain: &str) -> Result<u64, StoreError>;
    /// Read fan-out groups of `user` with messages after the position given (or the device's
    /// stored cursor, or 0).
    async fn read_fanout_changes(
        &self,
        user: UserId,
        device: &str,
        given: &HashMap<String, u64>,
    ) -> Result<Vec<SyncConversation>, StoreError>;
    /// (conversation, unread, muted) for every current membership with unread messages.
    async fn unread(&self, user: UserId) -> Result<Vec<(ConversationId, u64, bool)>, StoreError>;
    /// Current members other than the sender of `seq`, split by whether they read it.
    async fn receipts(
        &self,
        conv: &ConversationId,
        seq: u64,
    ) -> Result<(Vec<UserId>, Vec<UserId>), StoreError>;
}

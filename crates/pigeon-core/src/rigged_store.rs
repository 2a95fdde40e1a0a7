//! A store that passes every call to another and lets a test step into the calls that
//! failures are made of (loads, the wait for the tables, commits): one wrapper for every test
//! that needs a store to fail, stall or lag, over any adapter.

use crate::changes::Changes;
use crate::store::{
    AuditedMessage, HistoryQuery, KeyCursor, KeyPage, ListCursor, Loaded, Membership, Needs, Store,
    StoreError, UserRecord,
};
use pigeon_proto::frames::SyncConversation;
use pigeon_proto::views::{ChainItem, ConversationView, MemberView, VersionView};
use pigeon_proto::{ConversationId, Message, MsgId, UserId};
use std::collections::HashMap;
use std::sync::Arc;

/// Where a test steps in; each call does what the store does unless the rig says otherwise.
#[async_trait::async_trait]
pub trait Rig: Send + Sync + 'static {
    /// Before a load of `needs` goes to the store (a test may hold it here).
    async fn before_load(&self, _needs: &Needs) {}
    async fn caught_up(&self, inner: &dyn Store) -> Result<(), StoreError> {
        inner.caught_up().await
    }
    async fn commit(&self, inner: &dyn Store, changes: Changes) -> Result<(), StoreError> {
        inner.commit(changes).await
    }
}

/// `inner`, with `rig` stepping in.
pub struct Rigged<R> {
    pub inner: Arc<dyn Store>,
    pub rig: R,
}

#[async_trait::async_trait]
impl<R: Rig> Store for Rigged<R> {
    async fn load(&self, needs: Needs) -> Result<Loaded, StoreError> {
        self.rig.before_load(&needs).await;
        self.inner.load(needs).await
    }
    async fn caught_up(&self) -> Result<(), StoreError> {
        self.rig.caught_up(&*self.inner).await
    }
    async fn commit(&self, changes: Changes) -> Result<(), StoreError> {
        self.rig.commit(&*self.inner, changes).await
    }
    async fn close(&self) {
        self.inner.close().await
    }
    async fn max_msg_id(&self) -> Result<u64, StoreError> {
        self.inner.max_msg_id().await
    }
    async fn idempotency_key_count(&self) -> Result<u64, StoreError> {
        self.inner.idempotency_key_count().await
    }
    async fn idempotency_keys(
        &self,
        after: Option<KeyCursor>,
        limit: usize,
    ) -> Result<KeyPage, StoreError> {
        self.inner.idempotency_keys(after, limit).await
    }
    async fn meta_get(&self, key: &str) -> Result<Option<String>, StoreError> {
        self.inner.meta_get(key).await
    }
    async fn meta_set(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.inner.meta_set(key, value).await
    }
    async fn user(&self, user: UserId) -> Result<Option<UserRecord>, StoreError> {
        self.inner.user(user).await
    }
    async fn membership(
        &self,
        conv: &ConversationId,
        user: UserId,
    ) -> Result<Option<Membership>, StoreError> {
        self.inner.membership(conv, user).await
    }
    async fn conversation_exists(&self, conv: &ConversationId) -> Result<bool, StoreError> {
        self.inner.conversation_exists(conv).await
    }
    async fn history(
        &self,
        conv: &ConversationId,
        reader: UserId,
        range: (u64, u64),
        query: HistoryQuery,
    ) -> Result<(Vec<Message>, bool), StoreError> {
        self.inner.history(conv, reader, range, query).await
    }
    async fn conversations(
        &self,
        user: UserId,
        only: Option<&ConversationId>,
        after: Option<ListCursor>,
        limit: u32,
        include_hidden: bool,
    ) -> Result<Vec<ConversationView>, StoreError> {
        self.inner
            .conversations(user, only, after, limit, include_hidden)
            .await
    }
    async fn members(
        &self,
        conv: &ConversationId,
        after: Option<UserId>,
        limit: u32,
    ) -> Result<Vec<MemberView>, StoreError> {
        self.inner.members(conv, after, limit).await
    }
    async fn message(&self, msg_id: MsgId) -> Result<Option<AuditedMessage>, StoreError> {
        self.inner.message(msg_id).await
    }
    async fn versions(&self, msg_id: MsgId) -> Result<Vec<VersionView>, StoreError> {
        self.inner.versions(msg_id).await
    }
    async fn is_hidden_for(&self, user: UserId, msg_id: MsgId) -> Result<bool, StoreError> {
        self.inner.is_hidden_for(user, msg_id).await
    }
    async fn inbox_head(&self, user: UserId) -> Result<u64, StoreError> {
        self.inner.inbox_head(user).await
    }
    async fn connect_state(&self, user: UserId) -> Result<(u64, Option<u64>), StoreError> {
        self.inner.connect_state(user).await
    }
    async fn pull_inbox(
        &self,
        user: UserId,
        from: u64,
        to: u64,
        limit: u32,
    ) -> Result<(Vec<ChainItem>, bool), StoreError> {
        self.inner.pull_inbox(user, from, to, limit).await
    }
    async fn cursor(&self, user: UserId, device: &str, chain: &str) -> Result<u64, StoreError> {
        self.inner.cursor(user, device, chain).await
    }
    async fn read_fanout_changes(
        &self,
        user: UserId,
        device: &str,
        given: &HashMap<String, u64>,
    ) -> Result<Vec<SyncConversation>, StoreError> {
        self.inner.read_fanout_changes(user, device, given).await
    }
    async fn unread(&self, user: UserId) -> Result<Vec<(ConversationId, u64, bool)>, StoreError> {
        self.inner.unread(user).await
    }
    async fn receipts(
        &self,
        conv: &ConversationId,
        seq: u64,
    ) -> Result<(Vec<UserId>, Vec<UserId>), StoreError> {
        self.inner.receipts(conv, seq).await
    }
}

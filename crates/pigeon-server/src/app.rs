//! The application state shared by the HTTP API and the WebSocket gateway, and the
//! operations both of them offer (authentication, reads that check membership, sync, pull),
//! so that the two edges cannot drift apart.

use crate::auth::{Claims, TokenSigner, secrets_equal};
use crate::config::Config;
use crate::error::{ApiError, ApiResult};
use crate::hub::Hub;
use crate::pipeline::{Pipeline, now_ms};
use pigeon_core::rules::{Limits, visible_range};
use pigeon_core::store::{HistoryQuery, Membership, Store};
use pigeon_proto::frames::{Chain, PullFrame, SyncFrame};
use pigeon_proto::views::{ChainItem, ConversationView};
use pigeon_proto::{ConversationId, DeviceId, ErrorCode, Message, UserId};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Most items a pull returns.
pub const PULL_MAX: u32 = 200;
pub const PULL_DEFAULT: u32 = 100;

/// A page's `limit` (a `pull`'s, or an HTTP page's query parameter): `default` when absent,
/// at least 1 (`limit=0` asks for nothing and is refused), cut to `max` when larger, up to
/// the largest number it can be given as (2^64-1) (PROTOCOL.md: "capped", "at most").
pub fn page_limit(asked: Option<u64>, default: u32, max: u32) -> Result<u32, ApiError> {
    match asked {
        None => Ok(default),
        Some(0) => Err(ApiError::invalid("limit must be at least 1")),
        Some(n) => Ok(n.min(u64::from(max)) as u32),
    }
}

pub struct App {
    pub cfg: Config,
    pub store: Arc<dyn Store>,
    pub pipeline: Pipeline,
    pub hub: Arc<Hub>,
    pub signer: TokenSigner,
    /// Token generations already read (see [`crate::auth::TokenGenerations`]).
    pub token_gens: crate::auth::TokenGenerations,
    /// Where a logout is announced once durable, for every node to forget the user's token
    /// generation and end the user's connections it holds (see [`App::on_revocation`]).
    pub revocations: Arc<dyn pigeon_core::revocation::Revocations>,
    pub admin_key: String,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Set when shutdown begins: /readyz answers 503 and new connections are refused.
    pub draining: AtomicBool,
    /// Flips to true when shutdown begins; every connection task watches it.
    pub shutdown: tokio::sync::watch::Sender<bool>,
    pub rooms: Arc<crate::rooms::Rooms>,
    pub limits: crate::limits::RateLimits,
    /// Bytes of HTTP answers each user's clients have not read yet (`api::unread`).
    pub unread_answers: Arc<crate::api::unread::UnreadAnswers>,
}

pub type AppRef = Arc<App>;

/// The result of a level-one sync.
pub struct SyncSummary {
    pub user_seq: u64,
    pub cursor: u64,
    pub conversations: Vec<pigeon_proto::frames::SyncConversation>,
}

impl App {
    /// What this node does when it hears of a revocation, announced here or by another
    /// node: forgets the user's token generation (a request in flight with an older one
    /// is then refused) and ends the user's connections it holds (`kicked`, then 1008).
    pub fn on_revocation(app: &AppRef) {
        let weak = Arc::downgrade(app);
        app.revocations.listen(Arc::new(move |user| {
            if let Some(app) = weak.upgrade() {
                app.token_gens.forget(user);
                app.hub.revoke(user);
            }
        }));
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_content_bytes: self.cfg.max_content_bytes,
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The user a token belongs to, if it is well-formed, signed, unexpired and not revoked.
    pub async fn authenticate(&self, token: &str) -> ApiResult<UserId> {
        self.authenticate_token(token).await.map(|(uid, _)| uid)
    }

    /// The user a token is for, and its generation (a logout moves the user's on).
    pub async fn authenticate_token(&self, token: &str) -> ApiResult<(UserId, u64)> {
        let Claims { uid, exp, gen_ } = self
            .signer
            .verify(token)
            .ok_or_else(ApiError::unauthorized)?;
        if exp <= now_ms() {
            return Err(ApiError::unauthorized());
        }
        match self.token_gens.get(uid) {
            Some(known) if known == gen_ => return Ok((uid, gen_)),
            // Generations only grow: an older one was revoked.
            Some(known) if known > gen_ => return Err(ApiError::unauthorized()),
            _ => {}
        }
        let epoch = self.token_gens.epoch();
        let u = self
            .store
            .user(uid)
            .await?
            .ok_or_else(ApiError::unauthorized)?;
        self.token_gens.remember(uid, u.token_gen, epoch);
        if u.token_gen == gen_ {
            Ok((uid, gen_))
        } else {
            Err(ApiError::unauthorized())
        }
    }

    pub fn is_admin_key(&self, key: &str) -> bool {
        secrets_equal(key, &self.admin_key)
    }

    /// The caller's membership of `conv` (current or ended); when none, the refusal of
    /// [`Self::not_in`].
    pub async fn membership(&self, user: UserId, conv: &ConversationId) -> ApiResult<Membership> {
        match self.store.membership(conv, user).await? {
            Some(m) => Ok(m),
            None => Err(self.not_in(user, conv).await),
        }
    }

    /// The refusal of a conversation `user` was never in (`rules::refusal_outside`): a group
    /// that exists or another pair's single chat, existing or not, answers `not_member`; a
    /// group that does not exist, or the caller's own single chat before its first message,
    /// `not_found`.
    pub async fn not_in(&self, user: UserId, conv: &ConversationId) -> ApiError {
        let exists = if pigeon_core::rules::existence_shown(user, conv) {
            match self.store.conversation_exists(conv).await {
                Ok(e) => e,
                Err(e) => return e.into(),
            }
        } else {
            true
        };
        pigeon_core::rules::refusal_outside(user, conv, exists).into()
    }

    /// The seqs of `conv` the caller may read.
    /// A former member asking for anything after the message that removed them (`from`
    /// beyond it) answers `not_member`: the removal is the last thing they can read.
    pub async fn readable_range(
        &self,
        user: UserId,
        conv: &ConversationId,
        from: Option<u64>,
    ) -> ApiResult<(u64, u64)> {
        readable_range_of(&self.membership(user, conv).await?, from)
    }

    pub async fn history(
        &self,
        user: UserId,
        conv: &ConversationId,
        q: HistoryQuery,
    ) -> ApiResult<(Vec<Message>, bool)> {
        let from = match q.anchor {
            pigeon_core::store::HistoryAnchor::After(a) => Some(a.saturating_add(1)),
            _ => None,
        };
        let range = self.readable_range(user, conv, from).await?;
        Ok(self.store.history(conv, user, range, q).await?)
    }

    /// One conversation as the caller sees it (hidden or not).
    pub async fn conversation(
        &self,
        user: UserId,
        conv: &ConversationId,
    ) -> ApiResult<ConversationView> {
        let mut list = self
            .store
            .conversations(user, Some(conv), None, 1, true)
            .await?;
        match list.pop() {
            Some(c) => Ok(c),
            None => Err(self.not_in(user, conv).await),
        }
    }

    /// Level one of sync: the inbox head and the read fan-out groups that moved.
    pub async fn sync(
        &self,
        user: UserId,
        device: &DeviceId,
        f: &SyncFrame,
    ) -> ApiResult<SyncSummary> {
        let user_seq = self.store.inbox_head(user).await?;
        let cursor = match f.user_seq {
            Some(s) => s,
            None => self.store.cursor(user, device.as_str(), "user").await?,
        };
        let given: HashMap<String, u64> = f
            .conversations
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        if given.len() > 10_000 {
            return Err(ApiError::invalid("at most 10000 conversations in one sync"));
        }
        let conversations = self
            .store
            .read_fanout_changes(user, device.as_str(), &given)
            .await?;
        Ok(SyncSummary {
            user_seq,
            cursor,
            conversations,
        })
    }

    /// Level two of sync: a complete, contiguous range of a chain, capped at [`PULL_MAX`].
    pub async fn pull(
        &self,
        user: UserId,
        device: &DeviceId,
        f: &PullFrame,
    ) -> ApiResult<(Vec<ChainItem>, bool)> {
        let limit = page_limit(f.limit, PULL_DEFAULT, PULL_MAX)?;
        match f.chain {
            Chain::User => {
                if f.conversation_id.is_some() {
                    return Err(ApiError::invalid("chain user takes no conversation_id"));
                }
                let from = match f.from {
                    Some(v) => v,
                    None => self
                        .store
                        .cursor(user, device.as_str(), "user")
                        .await?
                        .saturating_add(1),
                };
                let to = match f.to {
                    Some(v) => v,
                    None => self.store.inbox_head(user).await?,
                };
                Ok(self.store.pull_inbox(user, from.max(1), to, limit).await?)
            }
            Chain::Conversation => {
                let conv = f
                    .conversation_id
                    .as_ref()
                    .ok_or_else(|| ApiError::invalid("chain conversation needs conversation_id"))?;
                let m = self.membership(user, conv).await?;
                let (lo, hi) = readable_range_of(&m, f.from)?;
                let from = match f.from {
                    Some(v) => v,
                    // Where `sync` says this device is in the group.
                    None => m
                        .chain_position(
                            self.store
                                .cursor(user, device.as_str(), conv.as_str())
                                .await?,
                        )
                        .saturating_add(1),
                };
                let to = f.to.unwrap_or(hi).min(hi);
                let from = from.max(lo);
                if from > to {
                    return Ok((Vec::new(), false));
                }
                let q = HistoryQuery {
                    anchor: pigeon_core::store::HistoryAnchor::After(from - 1),
                    limit,
                    from_time: None,
                    to_time: None,
                };
                let (msgs, has_more) = self.store.history(conv, user, (from, to), q).await?;
                Ok((
                    msgs.into_iter()
                        .map(|m| ChainItem {
                            seq: m.seq,
                            message: m,
                        })
                        .collect(),
                    has_more,
                ))
            }
        }
    }

    /// Relays a typing notice to the other members' online devices; stores nothing.
    pub async fn typing(&self, user: UserId, conv: &ConversationId) -> ApiResult<()> {
        let others: Vec<UserId> = match conv.peer_of(user) {
            // A single chat's id is derived, never allocated: its two users may type in it
            // before its first message, as they may send to it (to a registered peer).
            Some(peer) => {
                if self.store.user(peer).await?.is_none() {
                    return Err(ApiError::not_found("user"));
                }
                vec![peer]
            }
            None => {
                let m = self.membership(user, conv).await?;
                if m.left_seq.is_some() {
                    return Err(ApiError::not_member());
                }
                self.store
                    .members(conv, None, 2000)
                    .await?
                    .iter()
                    .map(|m| m.user_id)
                    .filter(|u| *u != user)
                    .collect()
            }
        };
        let frame = pigeon_proto::frames::ServerFrame::Typing {
            conversation_id: conv.clone(),
            user_id: user,
        }
        .to_json();
        self.hub.send_to_users(&others, &frame, None);
        Ok(())
    }
}

/// Parses a conversation id from a path or field, as `invalid_argument` when malformed.
pub fn parse_conversation(s: &str) -> ApiResult<ConversationId> {
    ConversationId::parse(s).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.0))
}

/// The seqs of a conversation its member (current or former) may read, for a request
/// starting at `from`; `not_member` for one that starts past a former member's removal.
fn readable_range_of(m: &Membership, from: Option<u64>) -> ApiResult<(u64, u64)> {
    if let (Some(left), Some(from)) = (m.left_seq, from)
        && from > left
    {
        return Err(ApiError::not_member());
    }
    Ok(visible_range(m.joined_seq, m.left_seq, m.conversation_seq))
}

//! Conversations over HTTP: the list, one conversation, history pages, read marks, receipts,
//! settings, unread counts, and the long-polling pull-mode sync.

use super::{ApiJson, ApiPath, ApiQuery, AuthSession, AuthUser, WritingUser, run_then_view};
use crate::app::{AppRef, PULL_DEFAULT, PULL_MAX, page_limit, parse_conversation};
use crate::error::{ApiError, ApiResult};
use axum::Json;
use axum::extract::State;
use pigeon_core::command::{Command, Reply, SettingsPatch};
use pigeon_core::rules::visible_range;
use pigeon_core::store::{HistoryAnchor, HistoryQuery, ListCursor};
use pigeon_proto::views::ConversationView;
use pigeon_proto::{DeviceId, ErrorCode};
use serde::Deserialize;
use serde_json::{Value, json};
use std::time::Duration;

const LIST_DEFAULT: u32 = 50;
const LIST_MAX: u32 = 200;
const HISTORY_DEFAULT: u32 = 20;
const HISTORY_MAX: u32 = 100;
const RANGE_MAX: u64 = 200;
const WAIT_MAX_MS: u64 = 30_000;

#[derive(Deserialize)]
pub struct ListQuery {
    /// A u64, so that any limit a client can write is cut to the cap rather than refused.
    limit: Option<u64>,
    cursor: Option<String>,
}

/// The list's order key of `v` (see `ListCursor`), as an opaque cursor.
fn encode_cursor(v: &ConversationView) -> String {
    let last_msg_id = v.last_message.as_ref().map_or(0, |m| m.msg_id.get());
    format!(
        "{}.{}.{}.{}",
        v.pinned as u8, v.updated_at, last_msg_id, v.conversation_id
    )
}

fn decode_cursor(s: &str) -> ApiResult<ListCursor> {
    let bad = || ApiError::invalid("cursor is not one this server gave");
    let mut parts = s.splitn(4, '.');
    let pinned = match parts.next() {
        Some("1") => true,
        Some("0") => false,
        _ => return Err(bad()),
    };
    let updated_at: i64 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let last_msg_id: u64 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let conversation_id = parts
        .next()
        .and_then(|p| pigeon_proto::ConversationId::parse(p).ok())
        .ok_or_else(bad)?;
    Ok(ListCursor {
        pinned,
        updated_at,
        last_msg_id,
        conversation_id,
    })
}

pub async fn list(
    AuthUser(me): AuthUser,
    State(app): State<AppRef>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<Value>> {
    let limit = page_limit(q.limit, LIST_DEFAULT, LIST_MAX)?;
    let after = q
        .cursor
        .as_deref()
        .filter(|c| !c.is_empty())
        .map(decode_cursor)
        .transpose()?;
    let mut page = app
        .store
        .conversations(me, None, after, limit + 1, false)
        .await?;
    let next = if page.len() > limit as usize {
        page.truncate(limit as usize);
        page.last().map(encode_cursor)
    } else {
        None
    };
    Ok(Json(json!({"conversations": page, "next_cursor": next})))
}

pub async fn one(
    AuthUser(me): AuthUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<ConversationView>> {
    let conv = parse_conversation(&id)?;
    Ok(Json(app.conversation(me, &conv).await?))
}

#[derive(Deserialize)]
pub struct HistoryParams {
    /// A u64, so that any limit a client can write is cut to the cap rather than refused.
    limit: Option<u64>,
    before: Option<u64>,
    after: Option<u64>,
    from_time: Option<i64>,
    to_time: Option<i64>,
}

pub async fn history(
    AuthUser(me): AuthUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<HistoryParams>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    let limit = page_limit(q.limit, HISTORY_DEFAULT, HISTORY_MAX)?;
    let anchor = match (q.before, q.after) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("give at most one of before and after"));
        }
        (Some(b), None) => HistoryAnchor::Before(b),
        (None, Some(a)) => HistoryAnchor::After(a),
        (None, None) => HistoryAnchor::Newest,
    };
    if let (Some(f), Some(t)) = (q.from_time, q.to_time)
        && f > t
    {
        return Err(ApiError::invalid("from_time is after to_time"));
    }
    let query = HistoryQuery {
        anchor,
        limit,
        from_time: q.from_time,
        to_time: q.to_time,
    };
    let (messages, has_more) = app.history(me, &conv, query).await?;
    Ok(Json(json!({"messages": messages, "has_more": has_more})))
}

#[derive(Deserialize)]
pub struct RangeParams {
    from: u64,
    to: u64,
}

pub async fn range(
    AuthUser(me): AuthUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<RangeParams>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    // Seqs start at 1; `from: 0` means the chain's start, as in a WebSocket `pull`.
    let first = q.from.max(1);
    if first > q.to {
        return Err(ApiError::invalid("need from <= to (seqs start at 1)"));
    }
    if q.to - first + 1 > RANGE_MAX {
        return Err(ApiError::invalid(format!(
            "a range holds at most {RANGE_MAX} messages"
        )));
    }
    let (lo, hi) = app.readable_range(me, &conv, Some(first)).await?;
    let (from, to) = (first.max(lo), q.to.min(hi));
    let messages = if from > to {
        Vec::new()
    } else {
        let query = HistoryQuery {
            anchor: HistoryAnchor::After(from - 1),
            limit: RANGE_MAX as u32,
            from_time: None,
            to_time: None,
        };
        app.store.history(&conv, me, (from, to), query).await?.0
    };
    Ok(Json(json!({"messages": messages})))
}

#[derive(Deserialize)]
pub struct ReadBody {
    seq: u64,
}

pub async fn read(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiJson(b): ApiJson<ReadBody>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    let reply = app
        .pipeline
        .call(Command::Read {
            user: me,
            conversation: conv,
            seq: b.seq,
            from_device: None,
        })
        .await?;
    match reply {
        Reply::LastRead(s) => Ok(Json(json!({"last_read_seq": s}))),
        _ => Err(ApiError::new(
            pigeon_proto::ErrorCode::Internal,
            "internal error",
        )),
    }
}

#[derive(Deserialize)]
pub struct ReceiptParams {
    seq: u64,
}

pub async fn receipts(
    AuthUser(me): AuthUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ReceiptParams>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    let m = app.membership(me, &conv).await?;
    // Receipts are today's reads by today's members: a former member would learn who joined
    // and who read after their removal (PROTOCOL.md 1: nothing of a conversation one is not
    // in), so they answer `not_member` whatever the seq.
    if m.left_seq.is_some() {
        return Err(ApiError::not_member());
    }
    let (lo, hi) = visible_range(m.joined_seq, None, m.conversation_seq);
    if !(lo..=hi).contains(&q.seq) {
        return Err(ApiError::not_found("message"));
    }
    let (read, unread) = app.store.receipts(&conv, q.seq).await?;
    Ok(Json(json!({"read": read, "unread": unread})))
}

#[derive(Deserialize)]
pub struct SettingsBody {
    pinned: Option<bool>,
    muted: Option<bool>,
    hidden: Option<bool>,
}

pub async fn settings(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiJson(b): ApiJson<SettingsBody>,
) -> ApiResult<Json<ConversationView>> {
    let conv = parse_conversation(&id)?;
    if b.pinned.is_none() && b.muted.is_none() && b.hidden.is_none() {
        return Err(ApiError::invalid("give any of pinned, muted, hidden"));
    }
    let patch = SettingsPatch {
        pinned: b.pinned,
        muted: b.muted,
        hidden: b.hidden,
    };
    run_then_view(
        &app,
        me,
        &conv,
        Command::Settings {
            user: me,
            conversation: conv.clone(),
            patch,
        },
    )
    .await
}

pub async fn unread(AuthUser(me): AuthUser, State(app): State<AppRef>) -> ApiResult<Json<Value>> {
    let rows = app.store.unread(me).await?;
    let total: u64 = rows
        .iter()
        .filter(|(_, _, muted)| !muted)
        .map(|(_, n, _)| n)
        .sum();
    let conversations: Vec<Value> = rows
        .iter()
        .map(|(c, n, _)| json!({"conversation_id": c, "unread": n}))
        .collect();
    Ok(Json(
        json!({"total": total, "conversations": conversations}),
    ))
}

#[derive(Deserialize)]
pub struct SyncParams {
    user_seq: Option<u64>,
    limit: Option<u64>,
    wait_ms: Option<u64>,
}

/// Long polls one user may hold waiting at once.
const MAX_LONG_POLLS_PER_USER: usize = 8;

/// The device name pull-mode clients are tracked under.
const HTTP_DEVICE: &str = "http";

pub async fn sync(
    session: AuthSession,
    State(app): State<AppRef>,
    ApiQuery(q): ApiQuery<SyncParams>,
) -> ApiResult<Json<Value>> {
    let me = session.user;
    let wait_ms = q.wait_ms.unwrap_or(0);
    if wait_ms > WAIT_MAX_MS {
        return Err(ApiError::invalid(format!(
            "wait_ms must be 0..={WAIT_MAX_MS}"
        )));
    }
    let limit = page_limit(q.limit, PULL_DEFAULT, PULL_MAX)?;
    let after = q.user_seq.unwrap_or(0);
    let device = DeviceId::parse(HTTP_DEVICE).expect("a valid device id");
    // Register interest before looking, so that a message committed in between wakes us.
    // Each waiting poll is woken, and answers with a whole sync, by every message to the
    // user: a few at once are plenty for one user's devices.
    let at_most = if wait_ms > 0 {
        MAX_LONG_POLLS_PER_USER
    } else {
        usize::MAX
    };
    let Some(waiter) = app.hub.waiter(me, at_most) else {
        let mut e = ApiError::new(
            ErrorCode::RateLimited,
            format!("at most {MAX_LONG_POLLS_PER_USER} long polls at once per user"),
        );
        e.retry_after_ms = Some(1_000);
        return Err(e);
    };
    let mut shutdown = app.shutdown.subscribe();
    let result = async {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
        let mut waited = false;
        loop {
            let notified = waiter.notify().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if waited {
                // A logout while the poll waited ends it (and wakes it): nothing that came
                // after goes to the revoked token.
                session.still_valid(&app).await?;
            }
            let head = app.store.inbox_head(me).await?;
            if head > after
                || waiter.group_message_arrived()
                || tokio::time::Instant::now() >= deadline
                || app.is_draining()
            {
                let (items, has_more) = app
                    .store
                    .pull_inbox(me, after.saturating_add(1), head, limit)
                    .await?;
                let summary = app.sync(me, &device, &Default::default()).await?;
                // `user_seq` is where the answer brings the client: the inbox's newest, or,
                // when `limit` cut the items short (`has_more`), the last item's. A pull-mode
                // client passes it back as the next `user_seq` and misses nothing.
                let reached = match items.last() {
                    Some(last) if has_more => last.seq,
                    _ => head,
                };
                return Ok::<_, ApiError>(json!({
                    "user_seq": reached,
                    "items": items,
                    "has_more": has_more,
                    "conversations": summary.conversations,
                }));
            }
            // A shutdown answers at once too: the server gives requests in flight only a
            // few seconds to finish.
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                _ = notified => {}
                _ = shutdown.wait_for(|s| *s) => {}
            }
            waited = true;
        }
    }
    .await;
    result.map(Json)
}

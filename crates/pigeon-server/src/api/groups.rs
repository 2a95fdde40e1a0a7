//! Group management over HTTP. Every change goes through the pipeline, which checks who may
//! make it and appends the command message that tells every member.

use super::{ApiJson, ApiPath, ApiQuery, AuthUser, WritingUser, path_user, run, run_then_view};
use crate::app::{AppRef, parse_conversation};
use crate::error::{ApiError, ApiResult};
use axum::Json;
use axum::extract::State;
use pigeon_core::command::{Command, GroupPatch, Reply};
use pigeon_core::rules;
use pigeon_proto::UserId;
use pigeon_proto::views::ConversationView;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
pub struct CreateBody {
    #[serde(default)]
    name: String,
    #[serde(default)]
    members: Vec<UserId>,
}

pub async fn create(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiJson(b): ApiJson<CreateBody>,
) -> ApiResult<Json<ConversationView>> {
    if b.members.len() > rules::MAX_USERS_PER_REQUEST {
        return Err(ApiError::invalid(format!(
            "at most {} members at creation",
            rules::MAX_USERS_PER_REQUEST
        )));
    }
    let reply = app
        .pipeline
        .call(Command::CreateGroup {
            id: None,
            owner: me,
            name: b.name,
            members: b.members,
        })
        .await?;
    let Reply::Conversation(id) = reply else {
        return Err(ApiError::new(
            pigeon_proto::ErrorCode::Internal,
            "internal error",
        ));
    };
    Ok(Json(app.conversation(me, &id).await?))
}

#[derive(Deserialize)]
pub struct UpdateBody {
    name: Option<String>,
    notice: Option<String>,
    avatar: Option<String>,
}

pub async fn update(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiJson(b): ApiJson<UpdateBody>,
) -> ApiResult<Json<ConversationView>> {
    let conv = parse_conversation(&id)?;
    if let Some(n) = &b.name {
        rules::validate_text_field("name", n, rules::MAX_GROUP_NAME_CHARS)?;
    }
    if let Some(n) = &b.notice {
        rules::validate_text_field("notice", n, rules::MAX_NOTICE_CHARS)?;
    }
    if let Some(a) = &b.avatar {
        rules::validate_text_field("avatar", a, rules::MAX_AVATAR_CHARS)?;
    }
    let patch = GroupPatch {
        name: b.name,
        notice: b.notice,
        avatar: b.avatar,
    };
    run_then_view(
        &app,
        me,
        &conv,
        Command::UpdateGroup {
            actor: me,
            conversation: conv.clone(),
            patch,
        },
    )
    .await
}

#[derive(Deserialize)]
pub struct InviteBody {
    user_ids: Vec<UserId>,
}

pub async fn invite(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiJson(b): ApiJson<InviteBody>,
) -> ApiResult<Json<ConversationView>> {
    let conv = parse_conversation(&id)?;
    // Before the pipeline loads every one of them.
    rules::validate_invitees(&b.user_ids)?;
    run_then_view(
        &app,
        me,
        &conv,
        Command::Invite {
            actor: me,
            conversation: conv.clone(),
            users: b.user_ids,
        },
    )
    .await
}

pub async fn remove(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath((id, uid)): ApiPath<(String, String)>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    let user = path_user(&uid)?;
    run(
        &app,
        Command::RemoveMember {
            actor: me,
            conversation: conv,
            user,
        },
    )
    .await
}

async fn set_admin(
    app: AppRef,
    me: UserId,
    id: String,
    uid: String,
    admin: bool,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    let user = path_user(&uid)?;
    run(
        &app,
        Command::SetAdmin {
            actor: me,
            conversation: conv,
            user,
            admin,
        },
    )
    .await
}

pub async fn add_admin(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath((id, uid)): ApiPath<(String, String)>,
) -> ApiResult<Json<Value>> {
    set_admin(app, me, id, uid, true).await
}

pub async fn remove_admin(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath((id, uid)): ApiPath<(String, String)>,
) -> ApiResult<Json<Value>> {
    set_admin(app, me, id, uid, false).await
}

#[derive(Deserialize)]
pub struct MuteBody {
    user_id: UserId,
    duration_secs: u64,
}

pub async fn mute(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiJson(b): ApiJson<MuteBody>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    run(
        &app,
        Command::Mute {
            actor: me,
            conversation: conv,
            user: b.user_id,
            duration_secs: b.duration_secs,
        },
    )
    .await
}

pub async fn unmute(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath((id, uid)): ApiPath<(String, String)>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    let user = path_user(&uid)?;
    run(
        &app,
        Command::Unmute {
            actor: me,
            conversation: conv,
            user,
        },
    )
    .await
}

pub async fn dismiss(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    run(
        &app,
        Command::Dismiss {
            actor: me,
            conversation: conv,
        },
    )
    .await
}

/// A member list page: 100 members unless asked, at most 1 000.
const MEMBERS_DEFAULT: u32 = 100;
const MEMBERS_MAX: u32 = 1000;

#[derive(Deserialize)]
pub struct MembersQuery {
    cursor: Option<String>,
    /// A u64, so that any limit a client can write is cut to the cap rather than refused.
    limit: Option<u64>,
}

pub async fn members(
    AuthUser(me): AuthUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<MembersQuery>,
) -> ApiResult<Json<Value>> {
    let conv = parse_conversation(&id)?;
    let m = app.membership(me, &conv).await?;
    if m.left_seq.is_some() {
        return Err(ApiError::not_member());
    }
    // After the membership check, like the group changes: only a member learns this.
    if !conv.is_group() {
        return Err(ApiError::invalid("not a group"));
    }
    let limit = crate::app::page_limit(q.limit, MEMBERS_DEFAULT, MEMBERS_MAX)?;
    let after = match q.cursor.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => Some(
            path_user(c).map_err(|_| ApiError::invalid("cursor is not one this server gave"))?,
        ),
        None => None,
    };
    let mut page = app.store.members(&conv, after, limit + 1).await?;
    let next = if page.len() > limit as usize {
        page.truncate(limit as usize);
        page.last().map(|m| m.user_id.to_string())
    } else {
        None
    };
    Ok(Json(json!({"members": page, "next_cursor": next})))
}

//! The admin API: the application's back end registers users, mints and revokes tokens, and
//! audits or deletes messages.

use super::{Admin, ApiJson, ApiPath, path_msg_id, path_user, run};
use crate::app::AppRef;
use crate::auth::Claims;
use crate::error::{ApiError, ApiResult};
use crate::pipeline::now_ms;
use axum::Json;
use axum::extract::State;
use pigeon_core::command::{Command, Reply};
use pigeon_core::rules;
use pigeon_proto::views::UserView;
use pigeon_proto::{Message, UserId};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
pub struct UpsertUser {
    user_id: UserId,
    /// Left out (or `null`): kept as registered (`""` for a new user).
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    avatar: Option<String>,
}

pub async fn upsert_user(
    _: Admin,
    State(app): State<AppRef>,
    ApiJson(b): ApiJson<UpsertUser>,
) -> ApiResult<Json<UserView>> {
    if let Some(n) = &b.name {
        rules::validate_text_field("name", n, rules::MAX_USER_NAME_CHARS)?;
    }
    if let Some(a) = &b.avatar {
        rules::validate_text_field("avatar", a, rules::MAX_AVATAR_CHARS)?;
    }
    // "Repeat = update": a field left out keeps what the user has, merged where the row is
    // written, so two updates of different fields both hold.
    let partial = b.name.is_none() || b.avatar.is_none();
    app.pipeline
        .call(Command::UpsertUser {
            user: b.user_id,
            name: b.name.clone(),
            avatar: b.avatar.clone(),
        })
        .await?;
    if partial {
        // The user as now stored (a read waits for the batch just committed).
        let u = app
            .store
            .user(b.user_id)
            .await?
            .ok_or_else(|| ApiError::not_found("user"))?;
        return Ok(Json(UserView {
            user_id: u.user_id,
            name: u.name,
            avatar: u.avatar,
        }));
    }
    Ok(Json(UserView {
        user_id: b.user_id,
        name: b.name.unwrap_or_default(),
        avatar: b.avatar.unwrap_or_default(),
    }))
}

#[derive(Deserialize)]
pub struct MintToken {
    user_id: UserId,
    ttl_secs: Option<u64>,
}

pub async fn mint_token(
    _: Admin,
    State(app): State<AppRef>,
    ApiJson(b): ApiJson<MintToken>,
) -> ApiResult<Json<Value>> {
    let ttl = b.ttl_secs.unwrap_or(86_400);
    // 0 mints a token that has already expired: a client's expiry handling can be tried
    // without waiting.
    if ttl > app.cfg.max_token_ttl_secs {
        return Err(ApiError::invalid(format!(
            "ttl_secs must be 0..={}",
            app.cfg.max_token_ttl_secs
        )));
    }
    let user = app
        .store
        .user(b.user_id)
        .await?
        .ok_or_else(|| ApiError::not_found("user"))?;
    let expires_at = now_ms() + (ttl as i64) * 1000;
    let token = app.signer.mint(Claims {
        uid: b.user_id,
        exp: expires_at,
        gen_: user.token_gen,
    });
    Ok(Json(json!({"token": token, "expires_at": expires_at})))
}

pub async fn logout(
    _: Admin,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let user = path_user(&id)?;
    app.store
        .user(user)
        .await?
        .ok_or_else(|| ApiError::not_found("user"))?;
    // Once acknowledged, no generation remembered before may outlive the logout, and the
    // user's connections end: the revocation is announced (this node hears it before
    // `announce` returns), once the logout is durable and before the answer: "stop working
    // at once" (PROTOCOL.md 3). In a task of its own, so a caller that goes away cannot
    // skip it. A logout that failed may still have been stored: what this node remembered
    // is forgotten then too.
    let task_app = app.clone();
    tokio::spawn(async move {
        let done = run(&task_app, Command::Logout { user }).await;
        if done.is_ok() {
            task_app.revocations.announce(user);
        } else {
            task_app.token_gens.forget(user);
        }
        done
    })
    .await
    .map_err(|_| {
        ApiError::new(
            pigeon_proto::ErrorCode::Unavailable,
            "logout did not finish; retry",
        )
    })?
}

pub async fn get_message(
    _: Admin,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let msg_id = path_msg_id(&id)?;
    let audited = app
        .store
        .message(msg_id)
        .await?
        .ok_or_else(|| ApiError::not_found("message"))?;
    let mut versions = app.store.versions(msg_id).await?;
    if versions.is_empty() {
        let m = &audited.message;
        versions.push(pigeon_proto::views::VersionView {
            version: m.version,
            content: m.content.clone(),
            at: m.created_at,
        });
    }
    Ok(Json(json!({
        "message": audited.message,
        "versions": versions,
        "recalled_at": audited.recalled_at,
        "recalled_by": audited.recalled_by,
    })))
}

pub async fn delete_message(
    _: Admin,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Message>> {
    let msg_id = path_msg_id(&id)?;
    match app.pipeline.call(Command::AdminDelete { msg_id }).await? {
        Reply::Message(m) => Ok(Json(*m)),
        _ => Err(ApiError::not_found("message")),
    }
}

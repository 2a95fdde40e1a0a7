//! Sending, recalling, editing and deleting-for-me over HTTP.

use super::{ApiJson, ApiPath, AuthUser, WritingUser, path_msg_id};
use crate::app::AppRef;
use crate::error::{ApiError, ApiResult};
use axum::Json;
use axum::extract::State;
use pigeon_core::command::{Command, Reply};
use pigeon_core::rules::{validate_edit_content, validate_send, visible_range};
use pigeon_proto::views::{SendAck, SendRequest, VersionView};
use pigeon_proto::{ConversationId, Message, MsgId, UserId};
use serde::Deserialize;
use serde_json::{Value, json};

pub async fn send(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiJson(req): ApiJson<SendRequest>,
) -> ApiResult<Json<SendAck>> {
    let cmd = validate_send(me, req, app.limits())?;
    match app.pipeline.call(Command::Send(cmd)).await? {
        Reply::SendAck(ack) => Ok(Json(ack)),
        other => {
            tracing::error!(?other, "send answered with something else than an ack");
            Err(ApiError::new(
                pigeon_proto::ErrorCode::Internal,
                "internal error",
            ))
        }
    }
}

fn expect_message(reply: Reply) -> ApiResult<Json<Message>> {
    match reply {
        Reply::Message(m) => Ok(Json(*m)),
        _ => Err(ApiError::new(
            pigeon_proto::ErrorCode::Internal,
            "internal error",
        )),
    }
}

pub async fn recall(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Message>> {
    let msg_id = path_msg_id(&id)?;
    expect_message(
        app.pipeline
            .call(Command::Recall { actor: me, msg_id })
            .await?,
    )
}

#[derive(Deserialize)]
pub struct EditBody {
    content: String,
}

pub async fn edit(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
    ApiJson(b): ApiJson<EditBody>,
) -> ApiResult<Json<Message>> {
    let msg_id = path_msg_id(&id)?;
    validate_edit_content(&b.content, app.limits())?;
    expect_message(
        app.pipeline
            .call(Command::Edit {
                actor: me,
                msg_id,
                content: b.content,
            })
            .await?,
    )
}

/// The message if `me` may read it (a member whose visible part of the chain holds it).
async fn readable_message(app: &AppRef, me: UserId, msg_id: MsgId) -> ApiResult<Message> {
    let audited = app
        .store
        .message(msg_id)
        .await?
        .ok_or_else(|| ApiError::not_found("message"))?;
    let conv = ConversationId::parse(&audited.message.conversation_id)
        .map_err(|_| ApiError::not_found("message"))?;
    let m = app
        .store
        .membership(&conv, me)
        .await?
        .ok_or_else(|| ApiError::not_found("message"))?;
    let (lo, hi) = visible_range(m.joined_seq, m.left_seq, m.conversation_seq);
    if !(lo..=hi).contains(&audited.message.seq) {
        return Err(ApiError::not_found("message"));
    }
    let hidden = app.store.is_hidden_for(me, msg_id).await?;
    Ok(audited.message.redacted(hidden))
}

pub async fn versions(
    AuthUser(me): AuthUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let msg_id = path_msg_id(&id)?;
    let msg = readable_message(&app, me, msg_id).await?;
    let mut versions = app.store.versions(msg_id).await?;
    if versions.is_empty() {
        versions.push(VersionView {
            version: msg.version,
            content: msg.content.clone(),
            at: msg.created_at,
        });
    }
    if msg.status != pigeon_proto::MessageStatus::Normal {
        versions.iter_mut().for_each(|v| v.content.clear());
    }
    Ok(Json(json!({ "versions": versions })))
}

pub async fn hide(
    WritingUser(me): WritingUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Message>> {
    let msg_id = path_msg_id(&id)?;
    readable_message(&app, me, msg_id).await?;
    app.pipeline
        .call(Command::HideMessage { user: me, msg_id })
        .await?;
    Ok(Json(readable_message(&app, me, msg_id).await?))
}

//! Live rooms over HTTP: admins open and close them, any user looks at one.

use super::{Admin, ApiPath, AuthUser, empty};
use crate::app::AppRef;
use crate::error::{ApiError, ApiResult};
use crate::pipeline::now_ms;
use crate::rooms::RoomError;
use axum::Json;
use axum::extract::State;
use pigeon_proto::ErrorCode;
use serde_json::{Value, json};

pub async fn create(_: Admin, State(app): State<AppRef>) -> ApiResult<Json<Value>> {
    match app.rooms.create(now_ms()) {
        Ok(id) => Ok(Json(json!({"room_id": id}))),
        Err(_) => Err(ApiError::new(ErrorCode::Unavailable, "too many live rooms")),
    }
}

pub async fn close(
    _: Admin,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    app.rooms
        .close(&id)
        .map_err(|_: RoomError| ApiError::not_found("room"))?;
    Ok(empty())
}

pub async fn info(
    _: AuthUser,
    State(app): State<AppRef>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Value>> {
    let (viewers, recent) = app
        .rooms
        .info(&id)
        .ok_or_else(|| ApiError::not_found("room"))?;
    Ok(Json(
        json!({"room_id": id, "viewers": viewers, "recent": recent}),
    ))
}

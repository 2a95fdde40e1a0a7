//! Operational endpoints: health, readiness, metrics, the OpenAPI description, fallbacks.

use crate::app::AppRef;
use crate::error::ApiError;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use pigeon_proto::ErrorCode;

/// The chat page, embedded in the binary (no build step, no external network).
pub async fn chat_page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("../../web/index.html"),
    )
}

/// A probe's answer: `{"status": ...}`, 200 when `ok`, 503 otherwise.
fn probe(ok: bool, status: &str) -> (StatusCode, axum::Json<serde_json::Value>) {
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(serde_json::json!({ "status": status })))
}

/// Liveness: the process serves, unless a partition or the committer stopped on a broken invariant, which
/// only a restart mends (so a supervisor that probes liveness restarts it).
pub async fn healthz(State(app): State<AppRef>) -> impl IntoResponse {
    if app.pipeline.stats().pipeline_stopped() {
        return probe(false, "pipeline stopped");
    }
    probe(true, "ok")
}

pub async fn readyz(State(app): State<AppRef>) -> impl IntoResponse {
    if app.is_draining() {
        return probe(false, "draining");
    }
    if app.pipeline.stats().pipeline_stopped() {
        return probe(false, "pipeline stopped");
    }
    if app.pipeline.stats().commits_failing() {
        return probe(false, "commits failing");
    }
    match app.store.meta_get("schema").await {
        Ok(_) => probe(true, "ready"),
        Err(e) => {
            tracing::warn!(error = %e, "readiness check failed");
            probe(false, "store unavailable")
        }
    }
}

pub async fn metrics(State(app): State<AppRef>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
}

pub async fn openapi(State(app): State<AppRef>) -> impl IntoResponse {
    axum::Json(crate::openapi::document(&app.cfg))
}

pub async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such endpoint")
}

/// A known path with a method it does not take: PROTOCOL.md 1's table has no 405, and
/// "every error is ... over HTTP with the status below", so this is `404 not_found` (there is
/// no such endpoint: an endpoint is a method and a path), with a message that says which.
pub async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("this path does not take {method}"),
    )
}

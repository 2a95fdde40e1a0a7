//! The one error type of the edge, mapped from every layer's errors to the protocol's codes.
//! Internal details are logged here and never sent.

use crate::pipeline::PipelineError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pigeon_core::{DomainError, StoreError};
use pigeon_proto::{ErrorBody, ErrorCode, IdError};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub retry_after_ms: Option<u64>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            retry_after_ms: None,
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }
    pub fn unauthorized() -> Self {
        Self::new(
            ErrorCode::Unauthorized,
            "missing, malformed, expired or revoked token",
        )
    }
    pub fn not_member() -> Self {
        Self::new(ErrorCode::NotMember, "not a member of this conversation")
    }
    /// The server holds all the connections it may: an upgrade past `--max-connections`,
    /// or any connection past `--max-open-connections`.
    pub fn server_full() -> Self {
        Self::new(ErrorCode::Unavailable, "too many connections; retry later")
    }
    pub fn not_found(what: &str) -> Self {
        Self::new(ErrorCode::NotFound, format!("{what} not found"))
    }
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code,
            message: self.message.clone(),
            retry_after_ms: self.retry_after_ms,
        }
    }
    /// The error as a WebSocket frame answering request `req`.
    pub fn frame(&self, req: Option<i64>) -> String {
        pigeon_proto::frames::ServerFrame::Error {
            req,
            code: self.code,
            message: self.message.clone(),
            retry_after_ms: self.retry_after_ms,
        }
        .to_json()
    }
}

impl From<DomainError> for ApiError {
    fn from(e: DomainError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

impl From<PipelineError> for ApiError {
    fn from(e: PipelineError) -> Self {
        match e {
            PipelineError::Domain(d) => d.into(),
            PipelineError::Unavailable => {
                ApiError::new(ErrorCode::Unavailable, "temporarily unavailable; retry")
            }
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(error = %e, "store read failed");
        ApiError::new(ErrorCode::Unavailable, "temporarily unavailable; retry")
    }
}

impl From<IdError> for ApiError {
    fn from(e: IdError) -> Self {
        ApiError::invalid(e.0)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        metrics::counter!("pigeon_http_errors_total", "code" => self.code.as_str()).increment(1);
        let mut response = (status, axum::Json(self.body())).into_response();
        // HTTP's own hint too (whole seconds, rounded up), for clients and proxies that
        // know only that: the body's `retry_after_ms` is the protocol's, and exact.
        if let Some(ms) = self.retry_after_ms {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(ms.div_ceil(1000)),
            );
        }
        response
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

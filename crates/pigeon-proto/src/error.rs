//! The error codes of PROTOCOL.md section 1 and the body every error carries.

use serde::{Deserialize, Serialize};

/// One code of the protocol's error table. Each maps to exactly one HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidArgument,
    Unauthorized,
    Forbidden,
    NotMember,
    Muted,
    NotFound,
    Conflict,
    WindowExpired,
    PayloadTooLarge,
    RateLimited,
    Unavailable,
    Internal,
}

impl ErrorCode {
    /// The HTTP status the protocol assigns to this code.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden | ErrorCode::NotMember | ErrorCode::Muted => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict | ErrorCode::WindowExpired => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::RateLimited => 429,
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }

    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotMember => "not_member",
            ErrorCode::Muted => "muted",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::WindowExpired => "window_expired",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        }
    }
}

/// `{"code": "...", "message": "human readable"}`, plus `retry_after_ms` for `rate_limited`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

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
    /// `invalid_argument` for what a parser (serde, axum's extractors) refused, in words a
    /// client can use: see [`without_rust_types`].
    pub fn unparsable(what: &str, parser_message: &str) -> Self {
        Self::invalid(format!("{what}: {}", without_rust_types(parser_message)))
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

/// A parser's message without the Rust types it names: serde and axum say what they
/// wanted as Rust sees it (`expected u64`, `expected struct SendTarget`, "target type"),
/// which tells a client nothing of the protocol and shows the server's insides. The
/// position and the value found stay.
pub fn without_rust_types(message: &str) -> String {
    // (what the parser says, what a client reads, whether a type's name follows to go too)
    const WORDS: [(&str, &str, bool); 13] = [
        ("Failed to deserialize query string: ", "", false),
        ("Failed to deserialize form: ", "", false),
        (" to fit in target type", "", false),
        ("expected u8", "expected a non-negative integer", false),
        ("expected u16", "expected a non-negative integer", false),
        ("expected u32", "expected a non-negative integer", false),
        ("expected u64", "expected a non-negative integer", false),
        ("expected usize", "expected a non-negative integer", false),
        ("expected i32", "expected an integer", false),
        ("expected i64", "expected an integer", false),
        ("expected f64", "expected a number", false),
        ("expected struct ", "expected an object", true),
        ("expected enum ", "expected one of its known values", true),
    ];
    let is_name = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = message.to_owned();
    for (rust, plain, named) in WORDS {
        let mut from = 0;
        while let Some(at) = out[from..].find(rust).map(|i| i + from) {
            let mut end = at + rust.len();
            if named {
                end += out[end..].find(|c| !is_name(c)).unwrap_or(out.len() - end);
            } else if rust.ends_with(is_name) && out[end..].starts_with(is_name) {
                // Part of a longer word (`u645`): not the type.
                from = end;
                continue;
            }
            out.replace_range(at..end, plain);
            from = at + plain.len();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parser_messages_lose_their_rust_types_and_keep_the_rest() {
        for (said, plain) in [
            (
                "invalid type: string \"x\", expected struct SendTarget at line 1 column 52",
                "invalid type: string \"x\", expected an object at line 1 column 52",
            ),
            (
                "invalid type: floating point `1.5`, expected u64",
                "invalid type: floating point `1.5`, expected a non-negative integer",
            ),
            (
                "Failed to deserialize query string: limit: number too large to fit in target type",
                "limit: number too large",
            ),
            (
                "invalid type: map, expected i64 at line 1 column 3",
                "invalid type: map, expected an integer at line 1 column 3",
            ),
            ("expected enum Kind", "expected one of its known values"),
            ("missing field `content`", "missing field `content`"),
            ("expected u645", "expected u645"),
        ] {
            assert_eq!(without_rust_types(said), plain, "{said}");
        }
    }
}

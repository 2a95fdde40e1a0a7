//! The domain's refusals, each mapped once to a protocol error code.

use pigeon_proto::ErrorCode;

/// Why a command or a read was refused. The text is for humans and never holds internals.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DomainError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("not a member of this conversation")]
    NotMember,
    #[error("you are muted in this group")]
    Muted,
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("{0}")]
    Conflict(String),
    #[error("the time window for this change has passed")]
    WindowExpired,
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    Unavailable(String),
}

impl DomainError {
    pub fn code(&self) -> ErrorCode {
        match self {
            DomainError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            DomainError::Forbidden(_) => ErrorCode::Forbidden,
            DomainError::NotMember => ErrorCode::NotMember,
            DomainError::Muted => ErrorCode::Muted,
            DomainError::NotFound(_) => ErrorCode::NotFound,
            DomainError::Conflict(_) => ErrorCode::Conflict,
            DomainError::WindowExpired => ErrorCode::WindowExpired,
            DomainError::PayloadTooLarge(_) => ErrorCode::PayloadTooLarge,
            DomainError::Unavailable(_) => ErrorCode::Unavailable,
        }
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        DomainError::InvalidArgument(msg.into())
    }
}

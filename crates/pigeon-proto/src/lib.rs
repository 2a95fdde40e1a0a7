//! Pigeon's wire contract (PROTOCOL.md) as Rust types: ids, the message object, the frames
//! of the WebSocket protocol, HTTP bodies and error codes. Serde only; no behaviour.

pub mod error;
pub mod frames;
pub mod ids;
pub mod message;
pub mod views;

pub use error::{ErrorBody, ErrorCode};
pub use ids::{ClientMsgId, ConversationId, DeviceId, IdError, MsgId, UserId};
pub use message::{Message, MessageKind, MessageStatus};

//! Pigeon's client SDK.
//!
//! - [`Http`]: the HTTP API (admin and user calls) with protocol errors as values.
//! - [`WsConn`]: one raw WebSocket connection, frame by frame (tests, tools).

mod http;
mod ws;

pub use http::{ClientError, Http};
pub use ws::WsConn;

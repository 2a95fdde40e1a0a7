//! A connection's subprotocol: JSON text frames or protobuf binary ones.

use crate::protobuf;
use axum::extract::ws::{Message as WsMessage, Utf8Bytes, WebSocket};

/// How one connection's frames travel: JSON text (`pigeon.v1.json`, also when the client
/// asked for no subprotocol), or protobuf in binary frames (`pigeon.v1.proto`, transcoded
/// from and to the same JSON frames at this edge).
#[derive(Clone, Copy)]
pub(super) enum Codec {
    Json,
    Proto(&'static protobuf::Schema),
}

impl Codec {
    pub(super) fn of(socket: &WebSocket) -> Codec {
        match socket.protocol().map(|p| p.as_bytes()) {
            Some(p) if p == protobuf::SUBPROTOCOL.as_bytes() => {
                Codec::Proto(protobuf::Schema::get().expect("the schema is compiled at start"))
            }
            _ => Codec::Json,
        }
    }

    /// A server frame, as this connection's WebSocket message.
    pub(super) fn message(self, frame: Utf8Bytes) -> WsMessage {
        match self {
            Codec::Json => WsMessage::Text(frame),
            Codec::Proto(schema) => {
                WsMessage::Binary(schema.server_frame_for_client(frame.as_str()).into())
            }
        }
    }
}

//! A batch as a journal record's payload: its [`Changes`] in MessagePack, each struct an
//! array of its fields in declaration order (no field names).
//!
//! Every batch is written and fsynced before anyone hears of it, so its bytes are on the
//! hot path: a direct message took ~890 bytes as JSON (the message, its conversation's
//! row, the sender's membership, two inbox entries, every field named) and takes ~370
//! here, and a commit's time grows with its bytes (mean commit 1.35-1.65 ms against
//! 1.14-1.39 ms at 55 000 sends/s, alternated runs).
//!
//! Positional fields set two rules for the types a record holds (`pigeon_core::changes`
//! and what they contain): no `skip_serializing_if` (a field left out would shift the
//! ones after it), and a new field only at the end of its struct, with `#[serde(default)]`,
//! so that records written before it still decode.
//!
//! Records written as JSON by earlier versions are still read: a JSON record is an object
//! and starts with `{`, a byte that never starts this encoding of a batch (an array, whose
//! first byte is 0x90-0x9f or 0xdc-0xdd).

use crate::journal::RecordBuf;
use pigeon_core::changes::Changes;

/// Writes `changes` into `record` (emptied first by the caller).
pub fn encode(changes: &Changes, record: &mut RecordBuf) -> Result<(), String> {
    rmp_serde::encode::write(record, changes).map_err(|e| e.to_string())
}

/// Reads a record's payload back, whichever version wrote it.
pub fn decode(payload: &[u8]) -> Result<Changes, String> {
    if payload.first() == Some(&b'{') {
        serde_json::from_slice(payload).map_err(|e| e.to_string())
    } else {
        rmp_serde::from_slice(payload).map_err(|e| e.to_string())
    }
}

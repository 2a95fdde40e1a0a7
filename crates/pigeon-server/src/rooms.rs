//! Live rooms (PROTOCOL.md section 7): huge, short-lived audiences; nothing is stored. Each
//! room keeps its viewers' outboxes, the messages sent since the last flush and a small ring
//! of recent ones. A flusher sends every room's new messages as one `room_msgs` frame per
//! viewer every [`FLUSH_EVERY`]; under overload it keeps at most [`MAX_PER_FLUSH`] messages a
//! flush and drops the rest (senders are never told).

use crate::hub::{Outbox, Outgoing};
use pigeon_proto::UserId;
use pigeon_proto::frames::{RoomMessage, ServerFrame};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
pub const MAX_PER_FLUSH: usize = 200;
pub const RECENT: usize = 50;
pub const MAX_ROOMS: usize = 10_000;
/// Longest room message, in bytes.
pub const MAX_ROOM_CONTENT: usize = 1024;

#[derive(Default)]
struct Room {
    viewers: HashMap<u64, Outbox>,
    pending: Vec<RoomMessage>,
    recent: VecDeque<RoomMessage>,
}

/// Every live room of this node.
#[derive(Default)]
pub struct Rooms {
    rooms: Mutex<HashMap<String, Room>>,
    next: AtomicU64,
}

/// Why a room operation was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum RoomError {
    NotFound,
    NotJoined,
    TooMany,
}

impl Rooms {
    pub fn create(&self, now_ms: i64) -> Result<String, RoomError> {
        let mut rooms = self.rooms.lock().expect("rooms lock");
        if rooms.len() >= MAX_ROOMS {
            return Err(RoomError::TooMany);
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("r{}{n}", now_ms.max(0));
        rooms.insert(id.clone(), Room::default());
        Ok(id)
    }

    /// Closes a room; its viewers are told with a `room_closed` frame (an extension).
    pub fn close(&self, id: &str) -> Result<(), RoomError> {
        let room = self
            .rooms
            .lock()
            .expect("rooms lock")
            .remove(id)
            .ok_or(RoomError::NotFound)?;
        let frame = serde_json::json!({"type": "room_closed", "room_id": id}).to_string();
        for outbox in room.viewers.values() {
            outbox.send(Outgoing::Frame(frame.clone().into()));
        }
        Ok(())
    }

    /// Adds connection `conn` to room `id`.
    pub fn join(&self, id: &str, conn: u64, outbox: Outbox) -> Result<(), RoomError> {
        let mut rooms = self.rooms.lock().expect("rooms lock");
        let room = rooms.get_mut(id).ok_or(RoomError::NotFound)?;
        room.viewers.insert(conn, outbox);
        Ok(())
    }

    pub fn leave(&self, id: &str, conn: u64) {
        if let Some(room) = self.rooms.lock().expect("rooms lock").get_mut(id) {
            room.viewers.remove(&conn);
        }
    }

    pub fn send(&self, id: &str, conn: u64, message: RoomMessage) -> Result<(), RoomError> {
        let mut rooms = self.rooms.lock().expect("rooms lock");
        let room = rooms.get_mut(id).ok_or(RoomError::NotFound)?;
        if !room.viewers.contains_key(&conn) {
            return Err(RoomError::NotJoined);
        }
        if room.pending.len() < MAX_PER_FLUSH {
            room.pending.push(message);
        } else {
            metrics::counter!("pigeon_room_messages_dropped_total").increment(1);
        }
        Ok(())
    }

    /// `(viewers, recent)` of a room.
    pub fn info(&self, id: &str) -> Option<(usize, Vec<RoomMessage>)> {
        let rooms = self.rooms.lock().expect("rooms lock");
        rooms
            .get(id)
            .map(|r| (r.viewers.len(), r.recent.iter().cloned().collect()))
    }

    /// Sends what every room gathered since the last flush.
    pub fn flush(&self) {
        let mut out: Vec<(String, Vec<RoomMessage>, Vec<Outbox>)> = Vec::new();
        {
            let mut rooms = self.rooms.lock().expect("rooms lock");
            for (id, room) in rooms.iter_mut() {
                if room.pending.is_empty() {
                    continue;
                }
                let batch = std::mem::take(&mut room.pending);
                for m in &batch {
                    if room.recent.len() == RECENT {
                        room.recent.pop_front();
                    }
                    room.recent.push_back(m.clone());
                }
                out.push((id.clone(), batch, room.viewers.values().cloned().collect()));
            }
        }
        // Frames are built and queued outside the lock.
        for (room_id, messages, viewers) in out {
            let frame = ServerFrame::RoomMsgs { room_id, messages }.to_json();
            for v in viewers {
                v.send(Outgoing::Frame(frame.clone().into()));
            }
        }
    }
}

/// The sender and content of a room message, stamped now.
pub fn room_message(sender: UserId, content: String, at: i64) -> RoomMessage {
    RoomMessage {
        sender,
        content,
        at,
    }
}

/// Runs the flusher until `stop` flips.
pub async fn run_flusher(rooms: Arc<Rooms>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => rooms.flush(),
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

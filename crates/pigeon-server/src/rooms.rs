//! Live rooms (PROTOCOL.md section 7): huge, short-lived audiences; nothing is stored. Each
//! room keeps its viewers' outboxes, the messages sent since the last flush and a small ring
//! of recent ones. A flusher sends every room's new messages as one `room_msgs` frame per
//! viewer every [`FLUSH_EVERY`]; under overload it keeps at most [`MAX_PER_FLUSH`] messages a
//! flush and drops the rest (senders are never told).

use crate::outbox::{Frame, Outbox, Outgoing};
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
    /// Each watching connection, with its user.
    viewers: HashMap<u64, (UserId, Outbox)>,
    pending: Vec<RoomMessage>,
    recent: VecDeque<RoomMessage>,
}

#[derive(Default)]
struct State {
    rooms: HashMap<String, Room>,
    /// The connections of each user that watch a room, and which: "a user is in at most one
    /// room at a time", so a join by any of their connections leaves the others' rooms.
    watching: HashMap<UserId, Vec<(u64, String)>>,
}

impl State {
    fn forget(&mut self, user: UserId, conn: u64, id: &str) {
        if let Some(w) = self.watching.get_mut(&user) {
            w.retain(|(c, r)| !(*c == conn && r == id));
            if w.is_empty() {
                self.watching.remove(&user);
            }
        }
    }
}

/// Every live room of this node.
#[derive(Default)]
pub struct Rooms {
    state: Mutex<State>,
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
        let mut st = self.state.lock().expect("rooms lock");
        if st.rooms.len() >= MAX_ROOMS {
            return Err(RoomError::TooMany);
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("r{}{n}", now_ms.max(0));
        st.rooms.insert(id.clone(), Room::default());
        Ok(id)
    }

    /// Closes a room; its viewers are told with a `room_closed` frame (an extension).
    pub fn close(&self, id: &str) -> Result<(), RoomError> {
        let room = {
            let mut st = self.state.lock().expect("rooms lock");
            let room = st.rooms.remove(id).ok_or(RoomError::NotFound)?;
            for (conn, (user, _)) in &room.viewers {
                st.forget(*user, *conn, id);
            }
            room
        };
        let frame =
            Frame::shared(serde_json::json!({"type": "room_closed", "room_id": id}).to_string());
        for (_, outbox) in room.viewers.values() {
            outbox.send(Outgoing::Frame(frame.clone()));
        }
        Ok(())
    }

    /// Adds connection `conn` of `user` to room `id`; every connection of `user` that
    /// watched another room leaves it.
    pub fn join(&self, id: &str, user: UserId, conn: u64, outbox: Outbox) -> Result<(), RoomError> {
        let mut st = self.state.lock().expect("rooms lock");
        if !st.rooms.contains_key(id) {
            return Err(RoomError::NotFound);
        }
        let elsewhere: Vec<(u64, String)> = st
            .watching
            .get(&user)
            .map(|w| w.iter().filter(|(_, r)| r != id).cloned().collect())
            .unwrap_or_default();
        for (c, r) in elsewhere {
            if let Some(room) = st.rooms.get_mut(&r) {
                room.viewers.remove(&c);
            }
            st.forget(user, c, &r);
        }
        let w = st.watching.entry(user).or_default();
        if !w.iter().any(|(c, _)| *c == conn) {
            w.push((conn, id.to_owned()));
        }
        if let Some(room) = st.rooms.get_mut(id) {
            room.viewers.insert(conn, (user, outbox));
        }
        Ok(())
    }

    pub fn leave(&self, id: &str, user: UserId, conn: u64) {
        let mut st = self.state.lock().expect("rooms lock");
        if let Some(room) = st.rooms.get_mut(id) {
            room.viewers.remove(&conn);
        }
        st.forget(user, conn, id);
    }

    pub fn send(&self, id: &str, conn: u64, message: RoomMessage) -> Result<(), RoomError> {
        let mut st = self.state.lock().expect("rooms lock");
        let room = st.rooms.get_mut(id).ok_or(RoomError::NotFound)?;
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

    /// `(viewers, recent)` of a room: the last [`RECENT`] messages it took, including those
    /// its viewers get at the next flush.
    pub fn info(&self, id: &str) -> Option<(usize, Vec<RoomMessage>)> {
        let st = self.state.lock().expect("rooms lock");
        st.rooms.get(id).map(|r| {
            let all = r.recent.len() + r.pending.len();
            let recent = r
                .recent
                .iter()
                .chain(&r.pending)
                .skip(all.saturating_sub(RECENT))
                .cloned()
                .collect();
            (r.viewers.len(), recent)
        })
    }

    /// Sends what every room gathered since the last flush.
    pub fn flush(&self) {
        let mut out: Vec<(String, Vec<RoomMessage>, Vec<Outbox>)> = Vec::new();
        {
            let mut st = self.state.lock().expect("rooms lock");
            for (id, room) in st.rooms.iter_mut() {
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
                let viewers = room.viewers.values().map(|(_, o)| o.clone()).collect();
                out.push((id.clone(), batch, viewers));
            }
        }
        // Frames are built and queued outside the lock.
        for (room_id, messages, viewers) in out {
            // One buffer shared by every viewer's outbox (a clone is a reference count).
            let frame = Frame::shared(ServerFrame::RoomMsgs { room_id, messages }.to_json());
            for v in viewers {
                v.send(Outgoing::Frame(frame.clone()));
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

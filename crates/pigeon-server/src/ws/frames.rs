//! The client's frames on one connection (PROTOCOL.md 5): read (the head first, then the
//! typed frame), refused with `invalid_argument` when they are not frames, and answered.

use super::{Connection, MAX_FRAME_BYTES};
use crate::error::ApiError;
use crate::pipeline::{ConnectionReply, ReplyTo, Route, now_ms};
use pigeon_core::command::Command;
use pigeon_core::rules::validate_send;
use pigeon_proto::ErrorCode;
use pigeon_proto::frames::{ClientFrame, ServerFrame};
use std::time::{Duration, Instant};

/// Bad frames tolerated per window before the connection is closed with 1008: enough that
/// a client checking its validation case by case on one connection is answered every time,
/// few enough that one sending garbage in a loop is cut off within a second.
pub(super) const BAD_FRAMES_PER_WINDOW: u32 = 100;
/// The window [`BAD_FRAMES_PER_WINDOW`] counts in.
const BAD_FRAME_WINDOW: Duration = Duration::from_secs(10);
/// Conversations a connection's typing throttle tracks at once (each for a second).
const MAX_TYPING_TRACKED: usize = 256;
/// Chains one connection holds acknowledged positions of between two saves (every second);
/// past this they are saved at once.
const MAX_ACKED_CHAINS: usize = 1024;

/// The answer to a request whose success has no frame of its own: `ok` when it carried a
/// `req` ("the reply to it carries the same `req`"), nothing otherwise.
fn done(req: Option<i64>) -> Vec<String> {
    req.map(|req| vec![ServerFrame::Ok { req }.to_json()])
        .unwrap_or_default()
}

/// The `req` of a frame that is refused unread (one over the size limit, a binary frame on
/// the JSON subprotocol), when it holds a JSON object with one: its error then carries it,
/// as every other does.
pub(super) fn req_in(frame: &[u8]) -> Option<i64> {
    serde_json::from_slice::<FrameHead>(frame)
        .ok()
        .and_then(|h| h.req.and_then(|r| r.int()))
}

/// What handling a frame came to.
pub(super) enum Answer {
    /// The frames to write at once, in order (none for most frames).
    Now(Vec<String>),
    /// The frame reads what this connection's own commands change: handle it again once
    /// they are committed.
    AfterOwnSends,
}

impl From<Vec<String>> for Answer {
    fn from(replies: Vec<String>) -> Answer {
        Answer::Now(replies)
    }
}

impl Connection {
    /// Where the pipeline answers a command of this connection's: by its address.
    fn reply_to(&self, req: Option<i64>) -> ReplyTo {
        let to = self.app.hub.address(self.user, self.registration.id());
        ReplyTo::Connection(ConnectionReply::new(self.app.hub.clone(), to, req))
    }

    /// Where a send or read mark goes: `Some(None)` when that is not known without a
    /// look-up; `None` for other frames.
    fn route_of(&self, frame: &ClientFrame) -> Option<Option<Route>> {
        let pipeline = &self.app.pipeline;
        match frame {
            ClientFrame::Send(s) => match (s.to.user, &s.to.conversation) {
                (Some(peer), _) if peer != self.user => {
                    Some(Some(pipeline.route_of_chat(self.user, peer)))
                }
                (Some(_), _) => Some(None),
                (None, Some(c)) => Some(pipeline.route_of(c)),
                (None, None) => None,
            },
            ClientFrame::Read(r) => Some(pipeline.route_of(&r.conversation_id)),
            _ => None,
        }
    }

    pub(super) fn bad_frame(&mut self, req: Option<i64>, message: &str) -> Vec<String> {
        self.count_bad_frame();
        vec![ApiError::invalid(message).frame(req)]
    }

    /// The answer to a frame over [`MAX_FRAME_BYTES`], which counts as bad.
    pub(super) fn too_large(&mut self, req: Option<i64>) -> Vec<String> {
        self.count_bad_frame();
        vec![ApiError::new(ErrorCode::PayloadTooLarge, "frame is over 1 MiB").frame(req)]
    }

    fn count_bad_frame(&mut self) {
        if self.bad_window_start.elapsed() > BAD_FRAME_WINDOW {
            self.bad_window_start = Instant::now();
            self.bad_frames = 0;
        }
        self.bad_frames += 1;
    }

    /// Handles one text frame; `barrier_done` when this connection's own commands were
    /// waited for since it came (see [`Answer::AfterOwnSends`]).
    pub(super) async fn handle_text(&mut self, text: &str, barrier_done: bool) -> Answer {
        if text.len() > MAX_FRAME_BYTES {
            // Read whole (up to the 2 MiB the socket accepts), so its `req` can be echoed; it
            // counts as a bad frame, so a client cannot have the server parse them forever.
            return self.too_large(req_in(text.as_bytes())).into();
        }
        // First only what every frame has (the rest is skipped, but its syntax checked),
        // then the typed frame straight from the text: no intermediate JSON tree.
        if !text.trim_start().starts_with('{') {
            return match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                Ok(_) => self.bad_frame(None, "frame must be a JSON object"),
                Err(_) => self.bad_frame(None, "frame is not valid JSON"),
            }
            .into();
        }
        let head: FrameHead = match serde_json::from_str(text) {
            Ok(h) => h,
            Err(_) => return self.bad_frame(None, "frame is not valid JSON").into(),
        };
        let req = head.req.as_ref().and_then(Scalar::int);
        if matches!(head.req, Some(Scalar::Str(_) | Scalar::Other)) {
            return self.bad_frame(None, "req must be an integer").into();
        }
        let kind = match &head.kind {
            Some(Scalar::Str(t)) => t.as_str(),
            _ => return self.bad_frame(req, "frame needs a string type").into(),
        };
        let frame = match ClientFrame::parse_typed(kind, text) {
            None => {
                return self
                    .bad_frame(req, &format!("unknown frame type {kind:?}"))
                    .into();
            }
            Some(Ok(f)) => f,
            Some(Err(e)) => {
                let message = crate::error::without_rust_types(&e.to_string());
                return self.bad_frame(req, &format!("bad frame: {message}")).into();
            }
        };
        // A `sync` or `pull` reads what this connection's commands and acks changed, and
        // a `pong` says everything sent before its `ping` is durable, acks included (so a
        // client that pings after acking knows a crash will not move its cursor back).
        if !barrier_done
            && matches!(
                frame,
                ClientFrame::Sync(_) | ClientFrame::Pull(_) | ClientFrame::Ping
            )
            && (self.cursors_dirty || !self.sent_since_barrier.is_empty())
        {
            // Queued behind this connection's commands: one barrier covers both.
            self.flush_cursors(false).await;
            return Answer::AfterOwnSends;
        }
        // A send or read mark goes to its conversation's partition; one of this connection's
        // earlier commands on another partition is committed and delivered first, so the
        // connection's frames are handled in the order they came (and their answers come
        // in that order) whichever partitions own them.
        if !barrier_done
            && !self.sent_since_barrier.is_empty()
            && let Some(route) = self.route_of(&frame)
            && self.sent_since_barrier.other_than(route)
        {
            return Answer::AfterOwnSends;
        }
        let result = self.dispatch(frame, req).await;
        match result {
            Ok(frames) => frames.into(),
            Err(e) => {
                // A frame refused for what it is (not for the state it meets) counts as bad:
                // content over the limit too, which costs its parsing every time.
                if matches!(
                    e.code,
                    ErrorCode::InvalidArgument | ErrorCode::PayloadTooLarge
                ) {
                    self.count_bad_frame();
                }
                vec![e.frame(req)].into()
            }
        }
    }

    async fn dispatch(
        &mut self,
        frame: ClientFrame,
        req: Option<i64>,
    ) -> Result<Vec<String>, ApiError> {
        let app = self.app.clone();
        match frame {
            ClientFrame::Send(s) => {
                // The allowance first: a refused frame costs its validation, not only a
                // valid one.
                app.limits.check_send(self.user)?;
                let cmd = validate_send(self.user, s, app.limits())?;
                let reply = self.reply_to(req);
                let route = app.pipeline.submit(Command::Send(cmd), reply).await?;
                self.sent_on(route);
                Ok(Vec::new())
            }
            ClientFrame::Ack(a) => {
                // The positions held between two saves are bounded: past the bound they
                // are saved now rather than refused (what saving costs is bounded by the
                // user's write allowance, see `flush_cursors`).
                if self.cursors.len() >= MAX_ACKED_CHAINS {
                    self.flush_cursors(false).await;
                }
                self.ack(a)?;
                Ok(done(req))
            }
            ClientFrame::Sync(f) => {
                // This connection's earlier commands and acks first.
                self.flush_cursors(true).await;
                let s = app.sync(self.user, &self.device, &f).await?;
                self.inbox_seen = self.inbox_seen.max(s.user_seq);
                let frame = ServerFrame::SyncResult {
                    req,
                    user_seq: s.user_seq,
                    cursor: s.cursor,
                    conversations: s.conversations,
                };
                Ok(vec![frame.to_json()])
            }
            ClientFrame::Pull(f) => {
                // This connection's earlier commands and acks first.
                self.flush_cursors(true).await;
                let (items, has_more) = app.pull(self.user, &self.device, &f).await?;
                if f.chain == pigeon_proto::frames::Chain::User
                    && let Some(last) = items.last()
                {
                    self.inbox_seen = self.inbox_seen.max(last.seq);
                }
                Ok(vec![
                    ServerFrame::PullResult {
                        req,
                        items,
                        has_more,
                    }
                    .to_json(),
                ])
            }
            ClientFrame::Read(r) => {
                app.limits.check_send(self.user)?;
                let cmd = Command::Read {
                    user: self.user,
                    conversation: r.conversation_id,
                    seq: r.seq,
                    from_device: Some(self.device.clone()),
                };
                let reply = self.reply_to(req);
                let route = app.pipeline.submit(cmd, reply).await?;
                self.sent_on(route);
                Ok(Vec::new())
            }
            ClientFrame::Typing(t) => self.typing(t, req).await,
            ClientFrame::Ping => Ok(vec![
                ServerFrame::Pong {
                    req,
                    server_time: now_ms(),
                }
                .to_json(),
            ]),
            ClientFrame::RoomJoin(r) => self.room_join(&r.room_id, req),
            ClientFrame::RoomLeave(r) => Ok(self.room_leave(&r.room_id, req)),
            ClientFrame::RoomSend(r) => self.room_send(&r.room_id, r.content, req),
        }
    }

    /// `typing`, relayed to the other members (PROTOCOL.md 5.4), throttled per connection
    /// and conversation; a refusal is remembered for the throttle's window.
    async fn typing(
        &mut self,
        t: pigeon_proto::frames::TypingFrame,
        req: Option<i64>,
    ) -> Result<Vec<String>, ApiError> {
        let app = self.app.clone();
        let now = Instant::now();
        // A group's typing reaches every member (and reads the member list): at most
        // one a second per connection. A single chat's goes to one peer: one every
        // 200 ms (a client sends one every few seconds), so a loop cannot flood it.
        let every = if t.conversation_id.is_group() {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(200)
        };
        match self.typing_last.get(&t.conversation_id) {
            Some((at, refused)) if now.duration_since(*at) < every => match refused {
                // A refused one is answered every time, not once and then silently.
                Some(code) => Err(ApiError::new(*code, "typing refused")),
                None => Ok(done(req)),
            },
            _ => {
                // Bounded without forgetting the throttle of a conversation still in
                // its window (a clear-all let a loop over 257 conversations through).
                if self.typing_last.len() >= MAX_TYPING_TRACKED
                    && !self.typing_last.contains_key(&t.conversation_id)
                {
                    self.typing_last
                        .retain(|_, (at, _)| now.duration_since(*at) < Duration::from_secs(1));
                    if self.typing_last.len() >= MAX_TYPING_TRACKED {
                        let mut e = ApiError::new(
                            ErrorCode::RateLimited,
                            "typing in too many conversations at once",
                        );
                        e.retry_after_ms = Some(1_000);
                        return Err(e);
                    }
                }
                let result = app.typing(self.user, &t.conversation_id).await;
                match result.as_ref().err().map(|e| e.code) {
                    // A lasting refusal is remembered; a store that failed is asked
                    // again next time.
                    Some(code) if !matches!(code, ErrorCode::NotMember | ErrorCode::NotFound) => {
                        self.typing_last.remove(&t.conversation_id);
                    }
                    refused => {
                        self.typing_last
                            .insert(t.conversation_id.clone(), (now, refused));
                    }
                }
                result.map(|()| done(req))
            }
        }
    }

    fn room_join(&mut self, room_id: &str, req: Option<i64>) -> Result<Vec<String>, ApiError> {
        // A join that fails leaves the connection in the room it was in.
        self.app
            .rooms
            .join(
                room_id,
                self.user,
                self.registration.id(),
                self.outbox.clone(),
            )
            .map_err(|_| ApiError::not_found("room"))?;
        // `join` took this connection out of the room it watched before.
        self.room = Some(room_id.into());
        Ok(done(req))
    }

    fn room_leave(&mut self, room_id: &str, req: Option<i64>) -> Vec<String> {
        if self.room.as_deref() == Some(room_id) {
            self.app
                .rooms
                .leave(room_id, self.user, self.registration.id());
            self.room = None;
        }
        done(req)
    }

    fn room_send(
        &mut self,
        room_id: &str,
        content: String,
        req: Option<i64>,
    ) -> Result<Vec<String>, ApiError> {
        if content.is_empty() {
            return Err(ApiError::invalid("room content must not be empty"));
        }
        if content.len() > crate::rooms::MAX_ROOM_CONTENT {
            return Err(ApiError::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "room content is at most {} bytes",
                    crate::rooms::MAX_ROOM_CONTENT
                ),
            ));
        }
        let message = crate::rooms::room_message(self.user, content, now_ms());
        self.app
            .rooms
            .send(room_id, self.registration.id(), message)
            .map_err(|e| match e {
                crate::rooms::RoomError::NotJoined => {
                    ApiError::new(ErrorCode::NotMember, "join the room before sending to it")
                }
                _ => ApiError::not_found("room"),
            })?;
        Ok(done(req))
    }
}

/// The fields every client frame may carry, read before the frame itself.
#[derive(serde::Deserialize)]
struct FrameHead {
    #[serde(rename = "type")]
    kind: Option<Scalar>,
    req: Option<Scalar>,
}

/// A head field as far as the head needs it. Arrays and objects are skipped, not built: a
/// 1 MiB `req` of nested arrays would otherwise become a tree many times its size.
enum Scalar {
    Int(i64),
    Str(String),
    Null,
    Other,
}

impl Scalar {
    fn int(&self) -> Option<i64> {
        match self {
            Scalar::Int(i) => Some(*i),
            _ => None,
        }
    }
}

impl<'de> serde::Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(i64::try_from(v).map_or(Scalar::Other, Scalar::Int))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_str<E>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::Str(v.to_owned()))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_none<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Scalar, A::Error> {
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Scalar, A::Error> {
                while a
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Scalar::Other)
            }
        }
        d.deserialize_any(V)
    }
}

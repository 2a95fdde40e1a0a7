//! The WebSocket gateway (PROTOCOL.md section 5): authenticates the upgrade, then runs one
//! task per connection that reads frames in order, writes what the outbox holds (coalesced
//! into one flush), keeps pushes until they are acknowledged and resends them, and records the
//! device's acknowledged position (its sync cursor).
//!
//! `frames` reads and answers the client's frames, `delivery` keeps the pushes until
//! they are acknowledged and saves the acknowledged positions, `codec` turns frames into
//! the connection's subprotocol; this module holds the connection's loop, its barriers and
//! its timers.

mod codec;
mod delivery;
mod frames;

use crate::app::AppRef;
use crate::auth::bearer;
use crate::error::ApiError;
use crate::hub::{Admission, Refused, Registered, Registration};
use crate::outbox::{KillReason, Outbox, OutboxReader, Outgoing};
use crate::pipeline::{Route, RouteSet, now_ms};
use crate::protobuf;
use axum::extract::ws::{CloseFrame, Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use codec::Codec;
use delivery::Unacked;
use frames::{Answer, BAD_FRAMES_PER_WINDOW, req_in};
use futures_util::{SinkExt, StreamExt};
use pigeon_proto::frames::ServerFrame;
use pigeon_proto::{ConversationId, DeviceId, ErrorCode, UserId};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Frames larger than this get `payload_too_large`.
pub const MAX_FRAME_BYTES: usize = 1 << 20;
/// Frames larger than this are not read at all: the connection is closed with 1009.
const MAX_READ_BYTES: usize = 2 << 20;
/// Longest wait of a barrier (a `sync`, a `pull`, an answer given at once) for this
/// connection's own queued commands. The outbox is written meanwhile, so a long wait holds
/// only this client's later frames, which must wait anyway to be answered in order; the
/// bound is for a pipeline that neither commits nor refuses.
const OWN_SENDS_WAIT: Duration = Duration::from_secs(10);
/// Bytes read from the socket at a time, the read buffer's capacity reserved for every
/// connection up front: an idle connection's largest buffer. A client frame is ~100-300
/// bytes, so one or two fit. A larger frame (up to the frame limit) grows the buffer to its
/// size, and the connection keeps that capacity (tungstenite reclaims its buffer rather
/// than shrink it); it is still read 512 bytes at a time (2 048 reads for 1 MiB). Against
/// 2 KiB, 512 bytes take ~1.8 KiB off each idle connection's memory with no change in
/// `direct`'s maximum.
const READ_BUFFER_BYTES: usize = 512;
/// Bytes of frames gathered before they are written to the socket (see [`upgrade`]).
const WRITE_BUFFER_BYTES: usize = 16 * 1024;
/// Frames written before one flush.
const COALESCE_MAX: usize = 256;
const CURSOR_FLUSH_EVERY: Duration = Duration::from_secs(1);
/// How long a new connection waits for the other connections of its device to queue their
/// acknowledged positions (`Outgoing::SaveCursors`).
const SIBLING_SAVE_WAIT: Duration = Duration::from_secs(1);
/// The wait a client refused for holding, or finding, too many connections is told to make.
pub(crate) const RETRY_AFTER_TOO_MANY_MS: u64 = 5_000;
/// How long a connection this server closes may take, from its close frame to letting the
/// socket go (see [`await_close_reply`]).
const CLOSE_WAIT: Duration = Duration::from_secs(1);

#[derive(Deserialize)]
pub struct WsParams {
    device_id: Option<String>,
    platform: Option<String>,
    token: Option<String>,
}

pub async fn upgrade(
    State(app): State<AppRef>,
    headers: HeaderMap,
    params: Result<Query<WsParams>, axum::extract::rejection::QueryRejection>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let authorized = authorize(&app, &headers, params).await;
    let ws = match (authorized.is_ok(), ws) {
        (true, Ok(_)) if !key_is_valid(&headers) => {
            return ApiError::invalid(
                "Sec-WebSocket-Key must be 16 bytes in base64 (RFC 6455, 4.2.1)",
            )
            .into_response();
        }
        (true, Ok(ws)) => ws,
        (true, Err(_)) => {
            return ApiError::invalid("this endpoint needs a WebSocket upgrade").into_response();
        }
        (false, _) => {
            return authorized
                .err()
                .map(IntoResponse::into_response)
                .unwrap_or_default();
        }
    };
    match authorized {
        Ok(peer) => ws
            .protocols(subprotocols_by_preference(&headers))
            .read_buffer_size(READ_BUFFER_BYTES)
            // Frames fed between two flushes are gathered up to this size and written with one
            // syscall (0 would write each frame by itself: one syscall per frame). The buffer
            // grows only as frames need it, so an idle connection keeps it small.
            .write_buffer_size(WRITE_BUFFER_BYTES)
            .max_message_size(MAX_READ_BYTES)
            .max_frame_size(MAX_READ_BYTES)
            .on_upgrade(move |socket| {
                // Split here, not in `run`: an argument is kept in the task's future twice
                // (as it came and as a local), and a whole WebSocket is 368 bytes against
                // 64 for its halves, in every connection's task for its whole life.
                let codec = Codec::of(&socket);
                // A task of its own rather than the one axum upgraded in, whose future
                // wraps this one with axum's state for the connection's whole life (1 920
                // bytes a connection against 1 520 for `run`'s alone, heaptrack); that
                // task ends here.
                tokio::spawn(run(app, peer, codec, socket.split()));
                std::future::ready(())
            }),
        Err(e) => e.into_response(),
    }
}

/// Whether the upgrade's `Sec-WebSocket-Key` is what RFC 6455 asks: a nonce of 16 bytes,
/// in base64 (the upgrade extractor takes any value).
fn key_is_valid(headers: &HeaderMap) -> bool {
    use base64::Engine as _;
    headers
        .get(header::SEC_WEBSOCKET_KEY)
        .and_then(|k| {
            base64::engine::general_purpose::STANDARD
                .decode(k.as_bytes())
                .ok()
        })
        .is_some_and(|nonce| nonce.len() == 16)
}

/// The subprotocols this server speaks, the one the client listed first in front: the
/// upgrade picks the first of these that the client offered, and the client's order is its
/// preference.
fn subprotocols_by_preference(headers: &HeaderMap) -> [&'static str; 2] {
    let proto_first = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .find(|p| *p == protobuf::JSON_SUBPROTOCOL || *p == protobuf::SUBPROTOCOL)
        == Some(protobuf::SUBPROTOCOL);
    if proto_first {
        [protobuf::SUBPROTOCOL, protobuf::JSON_SUBPROTOCOL]
    } else {
        [protobuf::JSON_SUBPROTOCOL, protobuf::SUBPROTOCOL]
    }
}

async fn authorize(
    app: &AppRef,
    headers: &HeaderMap,
    params: Result<Query<WsParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Peer, ApiError> {
    if app.is_draining() {
        return Err(ApiError::new(
            ErrorCode::Unavailable,
            "server is shutting down",
        ));
    }
    let Query(p) = params.map_err(|e| ApiError::unparsable("bad query", &e.body_text()))?;
    let header_token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer);
    // An empty parameter is one not given, as on every other endpoint.
    let token = header_token
        .or(p.token.as_deref().filter(|t| !t.is_empty()))
        .ok_or_else(ApiError::unauthorized)?;
    let (user, token_gen) = app.authenticate_token(token).await?;
    let device = DeviceId::parse(p.device_id.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::invalid(e.0))?;
    if let Some(pl) = p.platform.as_deref().filter(|pl| !pl.is_empty())
        && !matches!(pl, "ios" | "android" | "web" | "desktop")
    {
        return Err(ApiError::invalid(
            "platform must be ios, android, web or desktop",
        ));
    }
    // One user cannot take the server's connections (nor pin a read buffer grown by a
    // large frame in each of thousands of them). The place is taken here, before the
    // upgrade, and held by the connection's task: upgrades under way count too.
    let admission = app
        .hub
        .admit(
            user,
            app.cfg.max_connections,
            app.cfg.max_connections_per_user,
        )
        .map_err(|refused| match refused {
            Refused::Server => ApiError::server_full(),
            Refused::User => {
                let mut e = ApiError::new(
                    ErrorCode::RateLimited,
                    "too many connections for this user; close one or retry later",
                );
                e.retry_after_ms = Some(RETRY_AFTER_TOO_MANY_MS);
                e
            }
        })?;
    Ok((user, device, admission, token_gen))
}

/// How the connection loop ends: with a close frame, or because the peer is gone.
enum Stop {
    Close(u16, &'static str),
    /// The client sent a close frame: the reply goes once its cursors are saved, so a
    /// client that waits for the close handshake and reconnects finds where it stopped.
    ClientClosed,
    Gone,
    /// The outbox was killed (a logout, or too slow) while the loop was writing: what is
    /// queued (a `kicked` frame) is written as [`Writer::stop_for_kill`] does.
    Killed,
}

/// The state of one connection, owned by its task.
struct Connection {
    app: AppRef,
    user: UserId,
    device: DeviceId,
    outbox: Outbox,
    unacked: Unacked,
    /// (A `BTreeMap`, 24 bytes against a `HashMap`'s 48, in every connection's task.)
    cursors: BTreeMap<String, u64>,
    cursors_dirty: bool,
    /// The newest `user_seq` this connection has told its device of (`hello`, pushes,
    /// `sync`, `pull`): an inbox ack past it counts up to it. The inbox's head moves on
    /// in other partitions meanwhile; clamped only later, an ack past the newest would
    /// skip what came after it.
    inbox_seen: u64,
    /// The partitions this connection's commands went to since the last barrier: a `sync`
    /// or `pull` after them first waits until they are committed, so this connection's
    /// frames are handled in the order they came (a flood in other partitions is not
    /// waited for).
    sent_since_barrier: RouteSet,
    last_cursor_flush: Instant,
    last_seen: Instant,
    bad_frames: u32,
    bad_window_start: Instant,
    /// When a `typing` per conversation was last taken, and how it was refused if it was
    /// (a refusal within the throttle's window is answered again without asking the store).
    typing_last: BTreeMap<ConversationId, (Instant, Option<ErrorCode>)>,
    /// Its place in the hub (its id names it in rooms too); let go with the connection, or
    /// before the close handshake's wait.
    registration: Registration,
    /// The live room this connection watches (at most one).
    room: Option<Box<str>>,
}

/// Where a connection's frames go out, and what ends it: borrowed for the waits that must
/// keep writing and still end when the connection is killed or the server stops.
struct Writer<'a> {
    sink: &'a mut futures_util::stream::SplitSink<WebSocket, WsMessage>,
    out_rx: &'a mut OutboxReader,
    shutdown: &'a mut tokio::sync::watch::Receiver<bool>,
    codec: Codec,
}

impl<'a> Writer<'a> {
    /// The same writer, for one call that takes it by value.
    fn reborrow(&mut self) -> Writer<'_> {
        Writer {
            sink: &mut *self.sink,
            out_rx: &mut *self.out_rx,
            shutdown: &mut *self.shutdown,
            codec: self.codec,
        }
    }

    fn new(
        sink: &'a mut futures_util::stream::SplitSink<WebSocket, WsMessage>,
        out_rx: &'a mut OutboxReader,
        shutdown: &'a mut tokio::sync::watch::Receiver<bool>,
        codec: Codec,
    ) -> Writer<'a> {
        Writer {
            sink,
            out_rx,
            shutdown,
            codec,
        }
    }

    /// Waits until the commands `conn` queued are committed (or refused), writing what its
    /// outbox receives meanwhile: their `send_ack`s and pushes, which could otherwise fill
    /// the outbox while a burst's commits lag behind its reads, and close the connection as
    /// too slow. Ends the connection instead when it is killed (a logout, a full outbox),
    /// the server stops, or the socket fails; the barrier is then left for the connection's
    /// end to wait for.
    async fn wait_for_own_sends(&mut self, conn: &mut Connection) -> Result<(), Stop> {
        let Some((sent, barrier)) = conn.own_sends_barrier() else {
            return Ok(());
        };
        let stall = conn.write_stall();
        tokio::pin!(barrier);
        let kill = conn.outbox.clone();
        let ended = loop {
            tokio::select! {
                biased;
                _ = kill.killed() => break self.stop_for_kill(conn).await,
                () = shutdown_begun(self.shutdown) => break Stop::Close(1001, "server shutting down"),
                () = &mut barrier => return Ok(()),
                out = self.out_rx.recv() => {
                    let write = async {
                        feed_queued(conn, self.sink, self.out_rx, self.codec, Some(out), COALESCE_MAX).await
                            && self.sink.flush().await.is_ok()
                    };
                    if let Err(stop) = write_within(stall, &kill, write).await {
                        break stop;
                    }
                }
            }
        };
        conn.sent_on_all(sent);
        Err(ended)
    }

    /// After the outbox was killed: writes what it holds (a `kicked` frame) for at most
    /// [`CLOSE_WAIT`], and says how the connection closes. A connection too slow holds no
    /// frame, only requests to save its positions, which are handled without waiting on
    /// its socket.
    async fn stop_for_kill(&mut self, conn: &mut Connection) -> Stop {
        let too_slow = conn.outbox.kill_reason() == Some(KillReason::TooSlow);
        let write = async {
            feed_queued(conn, self.sink, self.out_rx, self.codec, None, usize::MAX).await
                && (too_slow || self.sink.flush().await.is_ok())
        };
        let _ = tokio::time::timeout(CLOSE_WAIT, write).await;
        kill_stop(&conn.outbox)
    }
}

/// Completes once the server's shutdown has begun, also when it began before this was asked
/// (a connection upgraded after the signal was sent sees it too).
async fn shutdown_begun(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

/// Runs a write to the socket (true when it went through): the connection ends when the
/// socket failed, or as too slow (1013) when the client has not taken it within `stall`
/// ([`Connection::write_stall`]), so a client that stops reading cannot hold its task, its
/// outbox and its unacknowledged pushes for ever (the heartbeat is checked only between
/// writes); and when its outbox is killed meanwhile: at once when it is too slow, however
/// long the write would have waited, and after the write (for at most [`CLOSE_WAIT`]) when
/// it was logged out, so that its `kicked` frame, which the write may hold, still goes.
async fn write_within(
    stall: Duration,
    kill: &Outbox,
    write: impl Future<Output = bool>,
) -> Result<(), Stop> {
    let write = tokio::time::timeout(stall, write);
    tokio::pin!(write);
    let done = tokio::select! {
        biased;
        _ = kill.killed() => {
            if kill.kill_reason() != Some(KillReason::TooSlow) {
                let _ = tokio::time::timeout(CLOSE_WAIT, &mut write).await;
            }
            return Err(Stop::Killed);
        }
        done = &mut write => done,
    };
    match done {
        Ok(true) => Ok(()),
        Ok(false) => Err(Stop::Gone),
        Err(_) => Err(Stop::Close(1013, "too slow; reconnect and sync")),
    }
}

/// How a connection whose outbox was killed closes.
fn kill_stop(outbox: &Outbox) -> Stop {
    match outbox.kill_reason() {
        Some(KillReason::TokenRevoked) => Stop::Close(1008, "token_revoked"),
        _ => Stop::Close(1013, "too slow; reconnect and sync"),
    }
}

/// Answers one text frame, or says how the connection ends meanwhile. A `sync` or `pull`
/// after this connection's own commands is handled once they are committed, its outbox
/// written meanwhile ([`Writer::wait_for_own_sends`]).
async fn answer(conn: &mut Connection, mut w: Writer<'_>, text: &str) -> Result<Vec<String>, Stop> {
    match conn.handle_text(text, false).await {
        Answer::Now(replies) => Ok(replies),
        Answer::AfterOwnSends => {
            w.wait_for_own_sends(conn).await?;
            match conn.handle_text(text, true).await {
                Answer::Now(replies) => Ok(replies),
                Answer::AfterOwnSends => unreachable!("handled after its barrier"),
            }
        }
    }
}

/// Feeds `first` and then what the outbox holds (at most `max` frames in all) to the socket,
/// without flushing. False once the socket failed.
async fn feed_queued(
    conn: &mut Connection,
    sink: &mut futures_util::stream::SplitSink<WebSocket, WsMessage>,
    out_rx: &mut OutboxReader,
    codec: Codec,
    first: Option<Outgoing>,
    max: usize,
) -> bool {
    let mut next = first.or_else(|| out_rx.try_recv());
    let mut n = 0;
    while let Some(out) = next.take() {
        if let Outgoing::SaveCursors(saved) = out {
            // Boxed: not kept in every connection's task.
            Box::pin(conn.flush_cursors(false)).await;
            let _ = saved.send(());
        } else if let Some(frame) = conn.frame_to_write(out)
            && sink.feed(codec.message(frame)).await.is_err()
        {
            return false;
        }
        n += 1;
        if n < max {
            next = out_rx.try_recv();
        }
    }
    true
}

/// The two halves of a connection's WebSocket.
type Halves = (
    futures_util::stream::SplitSink<WebSocket, WsMessage>,
    futures_util::stream::SplitStream<WebSocket>,
);

/// Who a connection is: its user, its device, its place in the hub's counts (held until
/// the task ends) and its token's generation.
type Peer = (UserId, DeviceId, Admission, u64);

async fn run(
    app: AppRef,
    (user, device, _admission, token_gen): Peer,
    codec: Codec,
    socket: Halves,
) {
    // Before anything that waits: a receiver made after the shutdown began would never see
    // it change.
    let mut shutdown = app.shutdown.subscribe();
    let Registered {
        registration,
        outbox,
        reader: mut out_rx,
        sibling_saves,
    } = app.hub.register(user, device.clone());
    let device_was_connected = !sibling_saves.is_empty();
    if device_was_connected {
        // Until the device's other connections have queued their positions (see below), or
        // for at most SIBLING_SAVE_WAIT: one stuck on a full socket cannot hold this one.
        // Boxed: not kept in every connection's task.
        let _ = Box::pin(tokio::time::timeout(
            SIBLING_SAVE_WAIT,
            futures_util::future::join_all(sibling_saves),
        ))
        .await;
    }
    let (mut sink, mut stream) = socket;
    let now = Instant::now();
    let mut conn = Connection {
        app: app.clone(),
        user,
        device,
        outbox,
        unacked: Unacked::default(),
        cursors: BTreeMap::new(),
        cursors_dirty: false,
        inbox_seen: 0,
        // With another connection of this device still registered (ending, or half-open:
        // a socket gone without a word, and a client that reconnected), as if this one had
        // sent already: its first `sync` or `pull` (or answer given at once) passes a
        // barrier behind the acknowledged positions that one queued when asked at the
        // registration above, wherever they went. (One no longer registered has saved
        // them.)
        sent_since_barrier: if device_was_connected {
            RouteSet::all()
        } else {
            RouteSet::default()
        },
        last_cursor_flush: now,
        last_seen: now,
        bad_frames: 0,
        bad_window_start: now,
        typing_last: BTreeMap::new(),
        registration,
        room: None,
    };
    // The inbox head for `hello`, and the user's token generation in the same read: a
    // logout committed between the token's check and the registration above kicked no
    // connection of this one, and the store, read after registering, tells (a later logout
    // finds it registered). No await inside the match (its scrutinee would be held across
    // it, in every connection's task).
    let state = match app.store.connect_state(user).await {
        Ok((head, stored_gen)) => Some((head, stored_gen == Some(token_gen))),
        Err(e) => {
            tracing::error!(error = %e, %user, "cannot read the inbox head; closing");
            None
        }
    };
    let Some((head, current)) = state else {
        let _ = sink.send(close(1011, "unavailable")).await;
        return;
    };
    conn.inbox_seen = head;
    if !current {
        // Boxed, and the frame made inside: held across these awaits in the task itself,
        // they would size every connection's task for its whole life.
        Box::pin(async {
            let kicked = codec.message(
                ServerFrame::Kicked {
                    reason: "token_revoked".into(),
                }
                .to_json()
                .into(),
            );
            let _ = sink.feed(kicked).await;
            let _ = sink.send(close(1008, "token_revoked")).await;
        })
        .await;
        return;
    }
    // Made in a block of its own: a value with a destructor lives until its scope ends, so
    // a frame built in the function's scope would be held in every connection's task for
    // its whole life (216 bytes).
    let hello = {
        let frame = ServerFrame::Hello {
            user_id: user,
            device_id: conn.device.clone(),
            server_time: now_ms(),
            heartbeat_ms: app.cfg.heartbeat_ms,
            user_seq: head,
        };
        codec.message(frame.to_json().into())
    };
    if sink.send(hello).await.is_err() {
        return;
    }
    // The settings below are read from the config where they are used, not kept in locals:
    // every local that lives across an await is in every connection's task (80 bytes).
    let timer = tokio::time::sleep_until(conn.silence_deadline());
    tokio::pin!(timer);
    let kill = conn.outbox.clone();
    let stop = loop {
        let wanted = conn.next_wake();
        if wanted < timer.deadline() {
            timer.as_mut().reset(wanted);
        }
        tokio::select! {
            biased;
            _ = kill.killed() => {
                // Write what is queued (a `kicked` frame) before closing.
                break Box::pin(Writer::new(&mut sink, &mut out_rx, &mut shutdown, codec).stop_for_kill(&mut conn)).await;
            }
            // Not `changed`: a connection upgraded after the shutdown began sees it too.
            () = shutdown_begun(&mut shutdown) => break Stop::Close(1001, "server shutting down"),
            out = out_rx.recv() => {
                let stall = conn.write_stall();
                let write = async {
                    feed_queued(&mut conn, &mut sink, &mut out_rx, codec, Some(out), COALESCE_MAX).await
                        && sink.flush().await.is_ok()
                };
                if let Err(stop) = Box::pin(write_within(stall, &kill, write)).await {
                    break stop;
                }
            }
            incoming = stream.next() => {
                let msg = match incoming {
                    None => break Stop::Gone,
                    Some(Err(e)) => break stop_for_read_error(e),
                    Some(Ok(m)) => m,
                };
                conn.last_seen = Instant::now();
                // Boxed: inline, the largest future a frame may await (sync, pull) would size
                // every connection's task, idle or not (3 432 bytes inline, 1 792 boxed).
                let w = Writer::new(&mut sink, &mut out_rx, &mut shutdown, codec);
                if let Err(stop) = Box::pin(on_frame(&mut conn, w, &kill, msg)).await {
                    break stop;
                }
            }
            _ = &mut timer => {
                let w = Writer::new(&mut sink, &mut out_rx, &mut shutdown, codec);
                if let Err(stop) = Box::pin(on_timer(&mut conn, w, &kill, timer.as_mut())).await {
                    break stop;
                }
            }
        }
    };
    Box::pin(end(conn, stop, sink, out_rx, shutdown, codec, stream)).await;
}

/// How a connection ends, once its loop is over: with the close frame `stop` says, its
/// acknowledged positions saved before it unregisters.
async fn end(
    mut conn: Connection,
    stop: Stop,
    mut sink: futures_util::stream::SplitSink<WebSocket, WsMessage>,
    mut out_rx: OutboxReader,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    codec: Codec,
    mut stream: futures_util::stream::SplitStream<WebSocket>,
) {
    let stop = match stop {
        Stop::Killed => {
            Writer::new(&mut sink, &mut out_rx, &mut shutdown, codec)
                .stop_for_kill(&mut conn)
                .await
        }
        stop => stop,
    };
    // Nothing more is written to this client: what is sent to it from here is let go at
    // once, not held for the close's waits, and so is what it kept for resending.
    conn.outbox.stop_frames();
    conn.unacked.clear();
    if let Some(room) = conn.room.take() {
        conn.app
            .rooms
            .leave(&room, conn.user, conn.registration.id());
    }
    match stop {
        Stop::Close(code, reason) => {
            // Queued before the close frame, which a stuck socket can hold up to CLOSE_WAIT:
            // a new connection of the device waits for these, not for that.
            conn.flush_cursors(false).await;
            let deadline = tokio::time::Instant::now() + CLOSE_WAIT;
            // A client that stopped reading cannot hold the task here either.
            let _ = tokio::time::timeout_at(deadline, sink.send(close(code, reason))).await;
            conn.flush_cursors(true).await;
            // Offline from here on: what is sent to the user meanwhile goes to their other
            // devices and the offline hook, not to an outbox nobody writes.
            drop(conn);
            drop(out_rx);
            await_close_reply(&mut stream, deadline).await;
        }
        Stop::ClientClosed => {
            conn.flush_cursors(true).await;
            // The WebSocket queued its reply to the client's close frame; closing sends it.
            let _ = tokio::time::timeout(CLOSE_WAIT, sink.close()).await;
        }
        // (`Killed` became a close above.)
        Stop::Gone | Stop::Killed => conn.flush_cursors(true).await,
    }
}

/// Answers one frame of the client's (its answers written in order after what was queued
/// before them), or says how the connection ends.
async fn on_frame(
    conn: &mut Connection,
    mut w: Writer<'_>,
    kill: &Outbox,
    msg: WsMessage,
) -> Result<(), Stop> {
    let replies = match msg {
        WsMessage::Text(t) => answer(conn, w.reborrow(), t.as_str()).await,
        WsMessage::Binary(b) => match w.codec {
            // Not decoded: a small protobuf frame can stand for a large tree (its
            // `req` is read by skipping the rest). A frame over the limit is too
            // large whatever the subprotocol.
            _ if b.len() > MAX_FRAME_BYTES => Ok(conn.too_large(match w.codec {
                Codec::Json => req_in(&b),
                Codec::Proto(_) => protobuf::req_of_client_frame(&b),
            })),
            Codec::Proto(schema) => match schema.client_frame_to_json(&b) {
                Ok(text) => answer(conn, w.reborrow(), &text).await,
                Err((req, e)) => Ok(conn.bad_frame(req, &e)),
            },
            Codec::Json => {
                Ok(conn.bad_frame(req_in(&b), "binary frames are not part of pigeon.v1.json"))
            }
        },
        WsMessage::Ping(_) | WsMessage::Pong(_) => Ok(Vec::new()),
        WsMessage::Close(_) => return Err(Stop::ClientClosed),
    };
    let replies = replies?;
    // An answer given at once (a `pong`, an error) first waits for the commands
    // this connection sent before it, whose answers are then queued ahead of it:
    // frames are answered in the order they came, so a `ping` after a `send` is
    // a barrier a client can rely on.
    if !replies.is_empty() {
        w.reborrow().wait_for_own_sends(conn).await?;
    }
    if conn.bad_frames > BAD_FRAMES_PER_WINDOW {
        // What was queued before still goes first.
        let stall = conn.write_stall();
        let write = feed_replies(conn, &mut w, replies);
        let _ = tokio::time::timeout(CLOSE_WAIT.min(stall), write).await;
        return Err(Stop::Close(1008, "too many bad frames"));
    }
    let stall = conn.write_stall();
    let write = async { feed_replies(conn, &mut w, replies).await && w.sink.flush().await.is_ok() };
    write_within(stall, kill, write).await
}

/// Feeds `replies` to the socket, without flushing, after what was queued for this
/// connection before them: a `sync` or `pull` waited for the barrier, by which its sends'
/// `send_ack`s and pushes are on the outbox, and the protocol answers frames in order.
/// False once the socket failed.
async fn feed_replies(conn: &mut Connection, w: &mut Writer<'_>, replies: Vec<String>) -> bool {
    if !replies.is_empty()
        && !feed_queued(
            conn,
            &mut *w.sink,
            &mut *w.out_rx,
            w.codec,
            None,
            usize::MAX,
        )
        .await
    {
        return false;
    }
    for r in replies {
        if w.sink.feed(w.codec.message(r.into())).await.is_err() {
            return false;
        }
    }
    true
}

/// The connection's timer: a client silent for two heartbeats is closed, pushes due are
/// sent again, positions are saved every second. Sets the timer's next deadline.
async fn on_timer(
    conn: &mut Connection,
    w: Writer<'_>,
    kill: &Outbox,
    mut timer: std::pin::Pin<&mut tokio::time::Sleep>,
) -> Result<(), Stop> {
    if conn.last_seen.elapsed() > conn.heartbeat() * 2 {
        return Err(Stop::Close(1001, "heartbeat timeout"));
    }
    // From here the timer is pulled earlier as needed: by the next push to come
    // due, and at the loop's top by whatever else is pending.
    timer.as_mut().reset(conn.silence_deadline());
    let (resend, next_due) = conn.due_resends();
    if let Some(due) = next_due {
        // Not sooner than a step from now: each wake scans every unacknowledged
        // push, and a client that never acknowledges, sent a push a millisecond,
        // would otherwise have its connection scan them a thousand times a second.
        let due = tokio::time::Instant::from_std(due)
            .max(tokio::time::Instant::now() + conn.resend_step());
        if due < timer.deadline() {
            timer.as_mut().reset(due);
        }
    }
    let write = async {
        for frame in resend {
            if w.sink.feed(w.codec.message(frame)).await.is_err() {
                return false;
            }
        }
        w.sink.flush().await.is_ok()
    };
    write_within(conn.write_stall(), kill, write).await?;
    if conn.cursors_dirty && conn.last_cursor_flush.elapsed() >= CURSOR_FLUSH_EVERY {
        conn.flush_cursors(false).await;
    }
    Ok(())
}

/// After this server's close frame: reads and drops what the client sends until its own
/// close frame, or until `deadline`. A socket closed with unread bytes is reset, and the
/// reset can overtake the close frame. When the stream ends first (it reads nothing past a
/// frame over the size limit, or the client went), the socket is kept until `deadline`, so
/// that the client has the time to read the close frame before any reset.
async fn await_close_reply(
    stream: &mut futures_util::stream::SplitStream<WebSocket>,
    deadline: tokio::time::Instant,
) {
    let replied = tokio::time::timeout_at(deadline, async {
        loop {
            match stream.next().await {
                Some(Ok(WsMessage::Close(_))) => return true,
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return false,
            }
        }
    })
    .await;
    if matches!(replied, Ok(false)) {
        tokio::time::sleep_until(deadline).await;
    }
}

fn close(code: u16, reason: &'static str) -> WsMessage {
    WsMessage::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

/// How a connection whose client's frames could not be read ends (RFC 6455 7.4.1): a frame
/// over the size limit 1009, a text frame that is not UTF-8 1007 (8.1), any other breach of
/// the framing (a frame not masked, reserved bits set, an unknown opcode, a fragmented or
/// oversized control frame) 1002; a socket that failed or closed without a close frame
/// has nobody left to tell.
fn stop_for_read_error(e: axum::Error) -> Stop {
    use tungstenite::error::{Error, ProtocolError};
    match e.into_inner().downcast::<Error>().map(|e| *e) {
        Ok(Error::Capacity(_)) => Stop::Close(1009, "frame too large"),
        Ok(Error::Utf8(_)) => Stop::Close(1007, "text frame is not UTF-8"),
        Ok(Error::Protocol(ProtocolError::ResetWithoutClosingHandshake)) => Stop::Gone,
        Ok(Error::Protocol(_)) => Stop::Close(1002, "protocol error"),
        _ => Stop::Gone,
    }
}

impl Connection {
    /// Notes that this connection queued a command on `route` (see `sent_since_barrier`).
    fn sent_on(&mut self, route: Route) {
        self.sent_since_barrier.add(route);
    }

    /// Waits until the commands this connection queued are committed (or refused), without
    /// writing its outbox: as the connection ends, and for a read whose barrier [`answer`]
    /// already waited for (then there is nothing left to wait for).
    async fn wait_for_own_sends(&mut self) {
        if let Some((_, barrier)) = self.own_sends_barrier() {
            barrier.await;
        }
    }

    /// How long a write may wait for the client to take it: two heartbeats, the silence a
    /// connection is allowed the other way (60 s by default; a client with a large answer
    /// on a slow link needs the time).
    fn write_stall(&self) -> Duration {
        Duration::from_millis(self.app.cfg.heartbeat_ms.saturating_mul(2))
    }

    /// The heartbeat announced in `hello`.
    fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.app.cfg.heartbeat_ms)
    }

    /// How long a push waits for its acknowledgement before it is sent again.
    fn push_retry(&self) -> Duration {
        Duration::from_millis(self.app.cfg.push_retry_ms)
    }

    /// The least time between two wakes for resends: a twentieth of the retry, at most
    /// 50 ms (so a push is resent at most that much after it came due, never before).
    fn resend_step(&self) -> Duration {
        (self.push_retry() / 20).min(Duration::from_millis(50))
    }

    /// The latest the connection's one timer may fire from the loop's top: the client's
    /// silence limit, a retry from now while pushes wait for their acknowledgement (the
    /// first push after none sets it; when it fires, `due_resends` says when the next push
    /// comes due), a second after the last cursor save while one is pending. The loop only
    /// ever moves the timer earlier, so this is cheap to ask on every frame; an idle
    /// connection wakes about once per heartbeat its client sends.
    fn next_wake(&self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let mut at = self.silence_deadline();
        if !self.unacked.is_empty() {
            at = at.min(now + self.push_retry());
        }
        if self.cursors_dirty {
            // A second after the last save (at once when that was longer ago): positions
            // are saved every second while acks come, not a second after the last check.
            let flush = tokio::time::Instant::from_std(self.last_cursor_flush + CURSOR_FLUSH_EVERY);
            at = at.min(flush.max(now));
        }
        at
    }

    /// When a client that sends nothing more has been silent for more than two heartbeats
    /// (PROTOCOL.md 5: it is closed then, not at the next tick of a coarser timer).
    fn silence_deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.last_seen + self.heartbeat() * 2)
            + Duration::from_millis(1)
    }

    /// Notes again partitions this connection's commands went to (a barrier left
    /// unfinished).
    fn sent_on_all(&mut self, sent: RouteSet) {
        self.sent_since_barrier.extend(sent);
    }

    /// The wait until the commands this connection queued since the last barrier are
    /// committed (or refused), at most [`OWN_SENDS_WAIT`], with the queues it covers (taken
    /// from `sent_since_barrier`); `None` when it queued none. It borrows nothing of the
    /// connection, so the connection can write while it waits.
    fn own_sends_barrier(&mut self) -> Option<(RouteSet, impl Future<Output = ()> + use<>)> {
        let sent = std::mem::take(&mut self.sent_since_barrier);
        if sent.is_empty() {
            return None;
        }
        let (app, user) = (self.app.clone(), self.user);
        Some((sent, async move {
            match tokio::time::timeout(OWN_SENDS_WAIT, app.pipeline.flush_routes(sent)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, user = %user, "waiting for this connection's sends failed");
                }
                Err(_) => {
                    tracing::warn!(user = %user, "this connection's sends took over {OWN_SENDS_WAIT:?} to commit; answering without them");
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes of the future `f` returns, without making one.
    fn future_bytes<F, Fut>(_: &F) -> usize
    where
        F: Fn(AppRef, Peer, Codec, Halves) -> Fut,
    {
        std::mem::size_of::<Fut>()
    }

    /// Every connection holds its task for its whole life, idle or not, so the task's
    /// future is part of every idle connection's memory. It stays small because nothing
    /// large is held across an await: the WebSocket is kept once, as its two halves; frames
    /// are made in blocks of their own; settings are read where used, not kept in locals;
    /// maps are `BTreeMap`s; one `u64` of bits stands for the partitions it sent to. With
    /// tokio's ~142 bytes around it, the task is then at most 1 536 bytes, one allocator bin
    /// below 1 792 (heaptrack). A change that holds something large across an await fails
    /// here rather than in a benchmark's noise.
    #[test]
    fn a_connection_task_stays_small() {
        let bytes = future_bytes(&run);
        assert!(bytes <= 1392, "ws::run's future is {bytes} bytes");
    }
}

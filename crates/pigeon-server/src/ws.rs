//! The WebSocket gateway (PROTOCOL.md section 5): authenticates the upgrade, then runs one
//! task per connection that reads frames in order, writes what the outbox holds (coalesced
//! into one flush), keeps pushes until they are acknowledged and resends them, and records the
//! device's acknowledged position (its sync cursor).

use crate::app::AppRef;
use crate::auth::bearer;
use crate::error::ApiError;
use crate::hub::{
    Admission, KillReason, Outbox, OutboxReader, Outgoing, PushChain, Refused, Registration,
};
use crate::pipeline::{ReplyTo, Tier, now_ms};
use crate::protobuf;
use axum::extract::ws::{CloseFrame, Message as WsMessage, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use pigeon_core::command::{Command, CursorChain};
use pigeon_core::rules::validate_send;
use pigeon_proto::frames::{AckFrame, ClientFrame, ServerFrame};
use pigeon_proto::{ConversationId, DeviceId, ErrorCode, UserId};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Frames larger than this get `payload_too_large`.
pub const MAX_FRAME_BYTES: usize = 1 << 20;
/// Frames larger than this are not read at all: the connection is closed with 1009.
const MAX_READ_BYTES: usize = 2 << 20;
/// Pushes kept for resending per connection; past this the oldest are left to pull.
const MAX_UNACKED: usize = 8192;
/// Sends of one push before leaving it to the client's pull.
const MAX_PUSH_TRIES: u8 = 4;
/// Longest wait of a barrier (a `sync`, a `pull`, an answer given at once) for this
/// connection's own queued commands. The outbox is written meanwhile, so a long wait holds
/// only this client's later frames, which must wait anyway to be answered in order; the
/// bound is for a pipeline that neither commits nor refuses.
const OWN_SENDS_WAIT: Duration = Duration::from_secs(10);
/// Bad frames tolerated per window before the connection is closed with 1008: enough that
/// a client checking its validation case by case on one connection is answered every time,
/// few enough that one sending garbage in a loop is cut off within a second.
const BAD_FRAMES_PER_WINDOW: u32 = 100;
const BAD_FRAME_WINDOW: Duration = Duration::from_secs(10);
/// Bytes read from the socket at a time, the read buffer's capacity reserved for every
/// connection up front: an idle connection's largest buffer. A client frame is ~100-300
/// bytes, so one or two fit. A larger frame (up to the frame limit) grows the buffer to its
/// size, and the connection keeps that capacity (tungstenite reclaims its buffer rather
/// than shrink it); it is still read 512 bytes at a time (2 048 reads for 1 MiB). 2 KiB
/// until the twelfth session: 512 bytes took ~1.8 KiB off each idle connection's memory
/// with no change in `direct`'s maximum (BENCHMARKS.md).
const READ_BUFFER_BYTES: usize = 512;
/// Bytes of frames gathered before they are written to the socket (see [`upgrade`]).
const WRITE_BUFFER_BYTES: usize = 16 * 1024;
/// Conversations a connection's typing throttle tracks at once (each for a second).
const MAX_TYPING_TRACKED: usize = 256;
/// Chains one connection holds acknowledged positions of between two saves (every second);
/// past this they are saved at once.
const MAX_ACKED_CHAINS: usize = 1024;
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
    let Query(p) = params.map_err(|e| ApiError::invalid(e.body_text()))?;
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

struct Pending {
    frame: Utf8Bytes,
    sent_at: Instant,
    tries: u8,
}

/// How the connection loop ends: with a close frame, or because the peer is gone.
enum Stop {
    Close(u16, &'static str),
    /// The client sent a close frame: the reply goes once its cursors are saved, so a
    /// client that waits for the close handshake and reconnects finds where it stopped.
    ClientClosed,
    Gone,
}

/// The state of one connection, owned by its task.
struct Connection {
    app: AppRef,
    user: UserId,
    device: DeviceId,
    outbox: Outbox,
    unacked: BTreeMap<PushChain, Pending>,
    /// (A `BTreeMap`, 24 bytes against a `HashMap`'s 48, in every connection's task.)
    cursors: BTreeMap<String, u64>,
    cursors_dirty: bool,
    /// The queues this connection's sends went to since the last barrier: a `sync` or `pull`
    /// after them first waits until they are committed, so this connection's frames are
    /// handled in the order they came (a flood queued in the other tier is not waited for).
    sent_since_barrier: SentOn,
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

/// The queues a connection's commands went to since its last barrier (two flags, not a
/// list: kept in every connection, idle or not).
#[derive(Default, Clone, Copy)]
struct SentOn {
    fast: bool,
    bulk: bool,
}

impl SentOn {
    fn any(self) -> bool {
        self.fast || self.bulk
    }
}

/// How one connection's frames travel: JSON text (`pigeon.v1.json`, also when the client
/// asked for no subprotocol), or protobuf in binary frames (`pigeon.v1.proto`, transcoded
/// from and to the same JSON frames at this edge).
#[derive(Clone, Copy)]
enum Codec {
    Json,
    Proto(&'static protobuf::Schema),
}

impl Codec {
    fn of(socket: &WebSocket) -> Codec {
        match socket.protocol().map(|p| p.as_bytes()) {
            Some(p) if p == protobuf::SUBPROTOCOL.as_bytes() => {
                Codec::Proto(protobuf::Schema::get().expect("the schema is compiled at start"))
            }
            _ => Codec::Json,
        }
    }

    /// A server frame, as this connection's WebSocket message.
    fn message(self, frame: Utf8Bytes) -> WsMessage {
        match self {
            Codec::Json => WsMessage::Text(frame),
            Codec::Proto(schema) => {
                WsMessage::Binary(schema.server_frame_for_client(frame.as_str()).into())
            }
        }
    }
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
                    if let Err(stop) = write_within(stall, write).await {
                        break stop;
                    }
                }
            }
        };
        conn.sent_on_all(sent);
        Err(ended)
    }

    /// After the outbox was killed: writes what it holds (a `kicked` frame) and says how
    /// the connection closes.
    async fn stop_for_kill(&mut self, conn: &mut Connection) -> Stop {
        let stall = conn.write_stall();
        let write = feed_queued(conn, self.sink, self.out_rx, self.codec, None, usize::MAX);
        let _ = tokio::time::timeout(stall, write).await;
        match conn.outbox.kill_reason() {
            Some(KillReason::TokenRevoked) => Stop::Close(1008, "token_revoked"),
            _ => Stop::Close(1013, "too slow; reconnect and sync"),
        }
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
/// writes).
async fn write_within(stall: Duration, write: impl Future<Output = bool>) -> Result<(), Stop> {
    match tokio::time::timeout(stall, write).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Stop::Gone),
        Err(_) => Err(Stop::Close(1013, "too slow; reconnect and sync")),
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

/// The answer to a request whose success has no frame of its own: `ok` when it carried a
/// `req` ("the reply to it carries the same `req`"), nothing otherwise.
fn done(req: Option<i64>) -> Vec<String> {
    req.map(|req| vec![ServerFrame::Ok { req }.to_json()])
        .unwrap_or_default()
}

/// The `req` of a frame that is refused unread (one over the size limit, a binary frame on
/// the JSON subprotocol), when it holds a JSON object with one: its error then carries it,
/// as every other does.
fn req_in(frame: &[u8]) -> Option<i64> {
    serde_json::from_slice::<FrameHead>(frame)
        .ok()
        .and_then(|h| h.req.and_then(|r| r.int()))
}

/// What handling a frame came to.
enum Answer {
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
    let (outbox, mut out_rx) = Outbox::new();
    // Before anything that waits: a receiver made after the shutdown began would never see
    // it change.
    let mut shutdown = app.shutdown.subscribe();
    let (registration, sibling_saves) = app.hub.register(user, device.clone(), outbox.clone());
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
        unacked: BTreeMap::new(),
        cursors: BTreeMap::new(),
        cursors_dirty: false,
        // With another connection of this device still registered (ending, or half-open:
        // a socket gone without a word, and a client that reconnected), as if this one had
        // sent already: its first `sync` or `pull` (or answer given at once) passes a
        // barrier behind the acknowledged positions that one queued when asked at the
        // registration above. (One no longer registered has saved them.)
        sent_since_barrier: SentOn {
            fast: device_was_connected,
            bulk: false,
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
                if let Err(stop) = Box::pin(write_within(stall, write)).await {
                    break stop;
                }
            }
            incoming = stream.next() => {
                let msg = match incoming {
                    None => break Stop::Gone,
                    Some(Err(e)) => {
                        if is_too_big(&e) {
                            break Stop::Close(1009, "frame too large");
                        }
                        // A text frame that is not UTF-8 (RFC 6455 section 8.1): tungstenite's
                        // `Error::Utf8` (pinned by a test, should its wording change).
                        if e.to_string().contains("UTF-8 encoding error") {
                            break Stop::Close(1007, "text frame is not UTF-8");
                        }
                        break Stop::Gone;
                    }
                    Some(Ok(m)) => m,
                };
                conn.last_seen = Instant::now();
                // Boxed, like the cursor flushes below: inline, the largest future a frame
                // may await (sync, pull) would size every connection's task, idle or not
                // (3 432 bytes inline, 1 792 boxed).
                let replies = match msg {
                    WsMessage::Text(t) => Box::pin(answer(&mut conn, Writer::new(&mut sink, &mut out_rx, &mut shutdown, codec), t.as_str())).await,
                    WsMessage::Binary(b) => match codec {
                        // Not decoded: a small protobuf frame can stand for a large tree. A
                        // frame over the limit is too large whatever the subprotocol.
                        _ if b.len() > MAX_FRAME_BYTES => Ok(conn.too_large(match codec {
                            Codec::Json => req_in(&b),
                            // Not decoded (see above).
                            Codec::Proto(_) => None,
                        })),
                        Codec::Proto(schema) => match schema.client_frame_to_json(&b) {
                            Ok(text) => Box::pin(answer(&mut conn, Writer::new(&mut sink, &mut out_rx, &mut shutdown, codec), &text)).await,
                            Err((req, e)) => Ok(conn.bad_frame(req, &e)),
                        },
                        Codec::Json => Ok(conn.bad_frame(req_in(&b), "binary frames are not part of pigeon.v1.json")),
                    },
                    WsMessage::Ping(_) | WsMessage::Pong(_) => Ok(Vec::new()),
                    WsMessage::Close(_) => break Stop::ClientClosed,
                };
                let replies = match replies {
                    Ok(replies) => replies,
                    Err(stop) => break stop,
                };
                // An answer given at once (a `pong`, an error) first waits for the commands
                // this connection sent before it, whose answers are then queued ahead of it:
                // frames are answered in the order they came, so a `ping` after a `send` is
                // a barrier a client can rely on. (Boxed: see above.)
                if !replies.is_empty()
                    && let Err(stop) = Box::pin(Writer::new(&mut sink, &mut out_rx, &mut shutdown, codec).wait_for_own_sends(&mut conn)).await
                {
                    break stop;
                }
                if conn.bad_frames > BAD_FRAMES_PER_WINDOW {
                    // What was queued before still goes first.
                    let stall = conn.write_stall();
                    let write = async {
                        feed_queued(&mut conn, &mut sink, &mut out_rx, codec, None, usize::MAX).await;
                        for r in replies {
                            let _ = sink.feed(codec.message(r.into())).await;
                        }
                    };
                    let _ = Box::pin(tokio::time::timeout(stall, write)).await;
                    break Stop::Close(1008, "too many bad frames");
                }
                // What was queued for this connection before these replies goes first: a
                // `sync` or `pull` waited for the barrier, by which its sends' `send_ack`s
                // and pushes are on the outbox, and the protocol answers frames in order.
                let stall = conn.write_stall();
                let write = async {
                    if !replies.is_empty()
                        && !feed_queued(&mut conn, &mut sink, &mut out_rx, codec, None, usize::MAX).await
                    {
                        return false;
                    }
                    for r in replies {
                        if sink.feed(codec.message(r.into())).await.is_err() {
                            return false;
                        }
                    }
                    sink.flush().await.is_ok()
                };
                if let Err(stop) = Box::pin(write_within(stall, write)).await {
                    break stop;
                }
            }
            _ = &mut timer => {
                if conn.last_seen.elapsed() > conn.heartbeat() * 2 {
                    break Stop::Close(1001, "heartbeat timeout");
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
                        if sink.feed(codec.message(frame)).await.is_err() {
                            return false;
                        }
                    }
                    sink.flush().await.is_ok()
                };
                if let Err(stop) = Box::pin(write_within(conn.write_stall(), write)).await {
                    break stop;
                }
                if conn.cursors_dirty && conn.last_cursor_flush.elapsed() >= CURSOR_FLUSH_EVERY {
                    Box::pin(conn.flush_cursors(false)).await;
                }
            }
        }
    };
    if let Some(room) = conn.room.take() {
        app.rooms.leave(&room, conn.user, conn.registration.id());
    }
    match stop {
        Stop::Close(code, reason) => {
            // Queued before the close frame, which a stuck socket can hold up to CLOSE_WAIT:
            // a new connection of the device waits for these, not for that.
            Box::pin(conn.flush_cursors(false)).await;
            let deadline = tokio::time::Instant::now() + CLOSE_WAIT;
            // A client that stopped reading cannot hold the task here either.
            let _ = tokio::time::timeout_at(deadline, sink.send(close(code, reason))).await;
            Box::pin(conn.flush_cursors(true)).await;
            // Offline from here on: what is sent to the user meanwhile goes to their other
            // devices and the offline hook, not to an outbox nobody writes.
            drop(conn);
            drop(out_rx);
            await_close_reply(&mut stream, deadline).await;
        }
        Stop::ClientClosed => {
            Box::pin(conn.flush_cursors(true)).await;
            // The WebSocket queued its reply to the client's close frame; closing sends it.
            let _ = tokio::time::timeout(CLOSE_WAIT, sink.close()).await;
        }
        Stop::Gone => Box::pin(conn.flush_cursors(true)).await,
    }
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

fn is_too_big(e: &axum::Error) -> bool {
    let text = e.to_string();
    text.contains("too long")
        || text.contains("too big")
        || text.contains("Space limit")
        || text.contains("capacity")
}

impl Connection {
    /// The text to write for an outbox entry; pushes are remembered until acknowledged.
    fn frame_to_write(&mut self, out: Outgoing) -> Option<Utf8Bytes> {
        match out {
            Outgoing::Frame(f) => Some(f),
            // Handled where the outbox is read (`feed_queued`): not a frame.
            Outgoing::SaveCursors(_) => None,
            Outgoing::Push { chain, frame } => {
                if self.unacked.len() >= MAX_UNACKED {
                    self.unacked.pop_first();
                }
                self.unacked.insert(
                    chain,
                    Pending {
                        frame: frame.clone(),
                        sent_at: Instant::now(),
                        tries: 1,
                    },
                );
                Some(frame)
            }
        }
    }

    /// Pushes unacknowledged for `retry` or longer, to send again (those tried enough are
    /// dropped: the client finds the hole and pulls), and when the next of the others comes
    /// due, so that each is sent again `retry` after it was sent, not at a later tick.
    fn due_resends(&mut self) -> (Vec<Utf8Bytes>, Option<Instant>) {
        let retry = self.push_retry();
        let now = Instant::now();
        let mut out = Vec::new();
        let mut next_due: Option<Instant> = None;
        self.unacked.retain(|_, p| {
            if now.duration_since(p.sent_at) >= retry {
                if p.tries >= MAX_PUSH_TRIES {
                    return false;
                }
                p.tries += 1;
                p.sent_at = now;
                out.push(p.frame.clone());
            }
            let due = p.sent_at + retry;
            next_due = Some(next_due.map_or(due, |d| d.min(due)));
            true
        });
        if !out.is_empty() {
            metrics::counter!("pigeon_push_resends_total").increment(out.len() as u64);
        }
        (out, next_due)
    }

    fn bad_frame(&mut self, req: Option<i64>, message: &str) -> Vec<String> {
        self.count_bad_frame();
        vec![ApiError::invalid(message).frame(req)]
    }

    /// The answer to a frame over [`MAX_FRAME_BYTES`], which counts as bad.
    fn too_large(&mut self, req: Option<i64>) -> Vec<String> {
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
    async fn handle_text(&mut self, text: &str, barrier_done: bool) -> Answer {
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
            Some(Err(e)) => return self.bad_frame(req, &format!("bad frame: {e}")).into(),
        };
        if !barrier_done
            && matches!(frame, ClientFrame::Sync(_) | ClientFrame::Pull(_))
            && (self.cursors_dirty || self.sent_since_barrier.any())
        {
            // Queued behind this connection's commands: one barrier covers both.
            self.flush_cursors(false).await;
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
                let reply = ReplyTo::Connection {
                    outbox: self.outbox.clone(),
                    req,
                };
                let tier = app.pipeline.submit(Command::Send(cmd), reply).await?;
                self.sent_on(tier);
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
                self.sent_on(Tier::Fast);
                let cmd = Command::Read {
                    user: self.user,
                    conversation: r.conversation_id,
                    seq: r.seq,
                    from_device: Some(self.device.clone()),
                };
                app.pipeline
                    .submit(
                        cmd,
                        ReplyTo::Connection {
                            outbox: self.outbox.clone(),
                            req,
                        },
                    )
                    .await?;
                Ok(Vec::new())
            }
            ClientFrame::Typing(t) => {
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
                            self.typing_last.retain(|_, (at, _)| {
                                now.duration_since(*at) < Duration::from_secs(1)
                            });
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
                            Some(code)
                                if !matches!(code, ErrorCode::NotMember | ErrorCode::NotFound) =>
                            {
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
            ClientFrame::Ping => Ok(vec![
                ServerFrame::Pong {
                    req,
                    server_time: now_ms(),
                }
                .to_json(),
            ]),
            ClientFrame::RoomJoin(r) => {
                // A join that fails leaves the connection in the room it was in.
                app.rooms
                    .join(
                        &r.room_id,
                        self.user,
                        self.registration.id(),
                        self.outbox.clone(),
                    )
                    .map_err(|_| ApiError::not_found("room"))?;
                // `join` took this connection out of the room it watched before.
                self.room = Some(r.room_id.into_boxed_str());
                Ok(done(req))
            }
            ClientFrame::RoomLeave(r) => {
                if self.room.as_deref() == Some(r.room_id.as_str()) {
                    app.rooms
                        .leave(&r.room_id, self.user, self.registration.id());
                    self.room = None;
                }
                Ok(done(req))
            }
            ClientFrame::RoomSend(r) => {
                if r.content.is_empty() {
                    return Err(ApiError::invalid("room content must not be empty"));
                }
                if r.content.len() > crate::rooms::MAX_ROOM_CONTENT {
                    return Err(ApiError::new(
                        ErrorCode::PayloadTooLarge,
                        format!(
                            "room content is at most {} bytes",
                            crate::rooms::MAX_ROOM_CONTENT
                        ),
                    ));
                }
                let message = crate::rooms::room_message(self.user, r.content, now_ms());
                app.rooms
                    .send(&r.room_id, self.registration.id(), message)
                    .map_err(|e| match e {
                        crate::rooms::RoomError::NotJoined => ApiError::new(
                            ErrorCode::NotMember,
                            "join the room before sending to it",
                        ),
                        _ => ApiError::not_found("room"),
                    })?;
                Ok(done(req))
            }
        }
    }

    /// A cumulative acknowledgement: forget the pushes it covers, move the cursor forward.
    fn ack(&mut self, a: AckFrame) -> Result<(), ApiError> {
        let mut any = false;
        if let Some(us) = a.user_seq {
            self.unacked
                .retain(|k, _| !matches!(k, PushChain::Inbox(s) if *s <= us));
            self.advance("user", us);
            any = true;
        }
        match (a.conversation_id, a.seq) {
            (Some(conv), Some(seq)) => {
                self.unacked.retain(
                    |k, _| !matches!(k, PushChain::Conversation(c, s) if *c == conv && *s <= seq),
                );
                self.advance(conv.as_str(), seq);
                any = true;
            }
            (None, None) => {}
            _ => {
                return Err(ApiError::invalid(
                    "ack by conversation needs both conversation_id and seq",
                ));
            }
        }
        if !any {
            return Err(ApiError::invalid(
                "ack needs user_seq, or conversation_id and seq",
            ));
        }
        Ok(())
    }

    fn advance(&mut self, chain: &str, seq: u64) {
        // Nothing to move (and no entry, which would stay unsaved in the map).
        if seq == 0 {
            return;
        }
        let e = self.cursors.entry(chain.to_owned()).or_insert(0);
        if seq > *e {
            *e = seq;
            self.cursors_dirty = true;
        }
    }

    /// Notes that this connection queued a command on `tier` (see `sent_since_barrier`).
    fn sent_on(&mut self, tier: Tier) {
        match tier {
            Tier::Fast => self.sent_since_barrier.fast = true,
            Tier::Bulk => self.sent_since_barrier.bulk = true,
        }
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

    /// Notes again queues this connection's commands went to (a barrier left unfinished).
    fn sent_on_all(&mut self, sent: SentOn) {
        self.sent_since_barrier.fast |= sent.fast;
        self.sent_since_barrier.bulk |= sent.bulk;
    }

    /// The wait until the commands this connection queued since the last barrier are
    /// committed (or refused), at most [`OWN_SENDS_WAIT`], with the queues it covers (taken
    /// from `sent_since_barrier`); `None` when it queued none. It borrows nothing of the
    /// connection, so the connection can write while it waits.
    fn own_sends_barrier(&mut self) -> Option<(SentOn, impl Future<Output = ()> + use<>)> {
        let sent = std::mem::take(&mut self.sent_since_barrier);
        let tiers: &'static [Tier] = match (sent.fast, sent.bulk) {
            (false, false) => return None,
            (true, false) => &[Tier::Fast],
            (false, true) => &[Tier::Bulk],
            (true, true) => &[Tier::Fast, Tier::Bulk],
        };
        let (app, user) = (self.app.clone(), self.user);
        Some((sent, async move {
            match tokio::time::timeout(OWN_SENDS_WAIT, app.pipeline.flush_tiers(tiers)).await {
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

    /// Writes acknowledged positions to the store; `wait` when a read follows that must see
    /// them, or the connection ends: then the commands this connection queued before
    /// (`wait_for_own_sends`) are committed first too.
    async fn flush_cursors(&mut self, wait: bool) {
        if self.cursors_dirty {
            self.cursors_dirty = false;
            self.last_cursor_flush = Instant::now();
            let mut cmds = Vec::with_capacity(self.cursors.len());
            for (chain, seq) in std::mem::take(&mut self.cursors) {
                let chain = if chain == "user" {
                    CursorChain::Inbox
                } else {
                    match ConversationId::parse(&chain) {
                        Ok(c) => CursorChain::Conversation(c),
                        Err(_) => continue,
                    }
                };
                cmds.push(Command::AdvanceCursor {
                    user: self.user,
                    device: self.device.clone(),
                    chain,
                    seq,
                });
            }
            // A group's position costs the store a journaled row and two lookups whatever
            // id an ack names (`Changes::member_cursors`): each takes one write from the
            // user's allowance, as a read mark does. Past it they are not saved (the device
            // gets those messages again when it resumes); the inbox's always is.
            let groups = cmds.iter().filter(|c| is_group_cursor(c)).count();
            if groups > 0 && !self.app.limits.take_writes(self.user, groups) {
                metrics::counter!("pigeon_cursor_saves_dropped_total").increment(groups as u64);
                cmds.retain(|c| !is_group_cursor(c));
            }
            // Committed by the next barrier: a read's, the close's, or the one below.
            self.sent_on(Tier::Fast);
            for cmd in cmds {
                if let Err(e) = self.app.pipeline.submit(cmd, ReplyTo::Nobody).await {
                    tracing::warn!(error = %e, user = %self.user, "cursor not saved");
                }
            }
        }
        if wait {
            // Queued first, waited for after: the pipeline is FIFO, so one barrier covers
            // these saves and whatever this connection queued before them (a connection
            // that ends unregisters after this, and a new one of the device then trusts the
            // store).
            self.wait_for_own_sends().await;
        }
    }
}

/// Whether `cmd` saves a position in a conversation's chain (not the inbox's).
fn is_group_cursor(cmd: &Command) -> bool {
    matches!(
        cmd,
        Command::AdvanceCursor {
            chain: CursorChain::Conversation(_),
            ..
        }
    )
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
    /// future is part of every idle connection's memory: 2 248 bytes before the twelfth
    /// session (the WebSocket kept twice, the hello frame kept in scope), 1 480 after (and
    /// after the thirteenth's token check, paid for by two flags in place of a list), 1 520
    /// with the fourteenth's barrier that writes the outbox while it waits, 1 384 in the
    /// fifteenth (settings read where used, not kept in locals; `BTreeMap`s; the hub
    /// registration in place of a copy of its id). With tokio's ~142 bytes around it, the
    /// task is then at most 1 536 bytes, one allocator bin below 1 792 (heaptrack). A
    /// change that holds something large across an await fails here rather than in a
    /// benchmark's noise.
    #[test]
    fn a_connection_task_stays_small() {
        let bytes = future_bytes(&run);
        assert!(bytes <= 1392, "ws::run's future is {bytes} bytes");
    }
}

//! One connection's outbox, and the bounds on what frames waiting for their clients may
//! hold: a client that stops reading must not make the server hold its pushes without end.
//!
//! Three bounds, each in bytes of frame text (`--max-outbox-kib`, `--max-outbox-kib-per-user`,
//! `--max-outbox-mib-total`):
//! - a connection whose outbox would hold more than its bound is closed at once (1013), and
//!   what it held is let go; its client reconnects and catches up by `sync` and `pull`;
//! - a user's connections together, and the server's together, hold frames up to theirs:
//!   past it, a connection that has not emptied its outbox for [`STUCK_AFTER`] and has more
//!   queued than its share (half the bound over the connections under it, at least
//!   [`MIN_SHARE`]) is closed as it is given its next frame. A connection that keeps up
//!   empties its outbox at every write, however many frames a burst brings, and is left
//!   alone. These two are thresholds, not hard bounds: what they count can pass them by the
//!   share of each connection that is behind, until its next frame closes it.
//!
//! A frame is counted once however many outboxes share it (a push to every device of a
//! user, a read fan-out push to every member), for as long as it lives: queued, or kept by
//! a connection for resending until acknowledged. A connection's own bound counts what it
//! has queued, each frame whole.

use axum::extract::ws::Utf8Bytes;
use pigeon_proto::{ConversationId, MsgId};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::Notify;

/// Frames a connection's outbox may hold before the connection counts as too slow.
pub const OUTBOX_CAPACITY: usize = 4096;

/// The least a connection may have queued before a spent budget closes it: a burst of a few
/// of the largest pushes queues more, and a connection that takes it is not behind.
pub const MIN_SHARE: usize = 1 << 20;

/// How long an outbox must have been left unemptied before a spent budget closes its
/// connection: a client that reads empties it at every write, and is then only busy with
/// its own frames (a `pull` waiting for the store) for moments.
pub const STUCK_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// The bounds, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct OutboxBounds {
    pub connection: usize,
    pub user: usize,
    pub server: usize,
}

impl Default for OutboxBounds {
    fn default() -> Self {
        OutboxBounds {
            connection: 8 << 20,
            user: 16 << 20,
            server: 64 << 20,
        }
    }
}

/// What the frames charged to one user, or to the server, hold.
pub struct Budget {
    held: AtomicUsize,
    limit: usize,
    outboxes: AtomicUsize,
}

impl Budget {
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            held: AtomicUsize::new(0),
            limit,
            outboxes: AtomicUsize::new(0),
        })
    }

    /// Bytes of frame text held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Whether an outbox of this budget that would queue `queued` bytes is to close: the
    /// budget is spent and the outbox is behind by more than its share of it (half the
    /// bound over the outboxes under it, at least [`MIN_SHARE`]). What the connections keep
    /// for resending counts in the budget, but not here: it is cut short while the budget
    /// is spent (`ws/delivery.rs`).
    fn sheds(&self, queued: usize) -> bool {
        self.spent() && queued > self.share()
    }

    fn spent(&self) -> bool {
        self.held() > self.limit
    }

    fn share(&self) -> usize {
        (self.limit / self.outboxes.load(Ordering::Relaxed).max(1) / 2).max(MIN_SHARE)
    }
}

/// A frame's text, shared (reference-counted) by every outbox it is queued on and every
/// connection that keeps it for resending.
#[derive(Clone)]
pub struct Frame(Arc<FrameText>);

struct FrameText {
    text: Utf8Bytes,
    /// Charged to the user of the outbox that first takes it (a frame made for one user's
    /// devices), or to the server only (a frame shared by several users).
    one_user: bool,
    /// Set by the first outbox that takes the frame.
    charged: OnceLock<Charge>,
}

struct Charge {
    server: Arc<Budget>,
    user: Option<Arc<Budget>>,
}

impl Frame {
    /// A frame for one user's devices: charged to that user and to the server.
    pub fn for_user(text: impl Into<Utf8Bytes>) -> Frame {
        Frame::new(text.into(), true)
    }

    /// A frame shared by several users' devices: charged to the server only.
    pub fn shared(text: impl Into<Utf8Bytes>) -> Frame {
        Frame::new(text.into(), false)
    }

    fn new(text: Utf8Bytes, one_user: bool) -> Frame {
        Frame(Arc::new(FrameText {
            text,
            one_user,
            charged: OnceLock::new(),
        }))
    }

    pub fn text(&self) -> Utf8Bytes {
        self.0.text.clone()
    }

    pub fn as_str(&self) -> &str {
        self.0.text.as_str()
    }

    pub fn len(&self) -> usize {
        self.0.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.text.is_empty()
    }

    fn charge_to(&self, server: &Arc<Budget>, user: &Arc<Budget>) {
        let len = self.len();
        self.0.charged.get_or_init(|| {
            server.held.fetch_add(len, Ordering::Relaxed);
            let user = self.0.one_user.then(|| {
                user.held.fetch_add(len, Ordering::Relaxed);
                user.clone()
            });
            Charge {
                server: server.clone(),
                user,
            }
        });
    }
}

impl Drop for FrameText {
    fn drop(&mut self) {
        if let Some(c) = self.charged.get() {
            let len = self.text.len();
            c.server.held.fetch_sub(len, Ordering::Relaxed);
            if let Some(u) = &c.user {
                u.held.fetch_sub(len, Ordering::Relaxed);
            }
        }
    }
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Frame").field(&self.as_str()).finish()
    }
}

/// What is queued for a connection.
#[derive(Debug)]
pub enum Outgoing {
    /// A frame sent once.
    Frame(Frame),
    /// A message push, kept until acknowledged and resent if it is not.
    Push { chain: PushChain, frame: Frame },
    /// Another connection of this device opened: save the acknowledged positions now (they
    /// are otherwise saved every second), and say so once they are queued for the store.
    /// This one may be half-open (a socket gone without a word), its acks the device's
    /// latest.
    SaveCursors(tokio::sync::oneshot::Sender<()>),
    /// The message was recalled or edited: stop resending an earlier push of it, which
    /// would show again what its sender took back (the client that lacks it finds the
    /// hole and pulls it as it is now).
    Forget(MsgId),
}

impl Outgoing {
    fn frame(&self) -> Option<&Frame> {
        match self {
            Outgoing::Frame(f) | Outgoing::Push { frame: f, .. } => Some(f),
            Outgoing::SaveCursors(_) | Outgoing::Forget(_) => None,
        }
    }
}

/// The chain position a push is acknowledged by.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PushChain {
    Inbox(u64),
    Conversation(ConversationId, u64),
}

/// One connection's outbox: the frames queued for it, and its kill switch. The sending side
/// ([`Outbox`]) is cloned wherever frames come from; the connection's task holds the
/// one [`OutboxReader`]. One allocation per connection, and a queue buffer only while
/// frames wait: a bounded tokio channel allocated a block of 32 slots (~2.4 KB) up front,
/// a fifth of what every idle connection cost.
#[derive(Clone)]
pub struct Outbox(Arc<OutboxShared>);

/// The receiving side of an [`Outbox`]; dropping it (the connection ended) drops what is
/// queued and every frame sent after.
pub struct OutboxReader(Arc<OutboxShared>);

struct OutboxShared {
    state: Mutex<OutboxState>,
    /// Woken when a frame is queued.
    ready: Notify,
    /// Woken when the connection must close (too slow, logged out).
    kill: Notify,
    /// Bytes this outbox may hold queued.
    limit: usize,
    user: Arc<Budget>,
    server: Arc<Budget>,
}

struct OutboxState {
    frames: VecDeque<Outgoing>,
    /// Bytes of frame text in `frames`.
    queued: usize,
    /// When `frames` was last found empty by the reader.
    emptied_at: std::time::Instant,
    /// The reader is gone: nothing is queued any more.
    closed: bool,
    /// The connection is ending (closed as too slow, or its loop is over): frames are
    /// dropped, a request to save its positions is still taken.
    frames_stopped: bool,
    kill_reason: Option<KillReason>,
}

impl Default for OutboxState {
    fn default() -> Self {
        OutboxState {
            frames: VecDeque::new(),
            queued: 0,
            emptied_at: std::time::Instant::now(),
            closed: false,
            frames_stopped: false,
            kill_reason: None,
        }
    }
}

/// Queue capacity an empty outbox keeps; a larger one (left by a burst) is given back.
const OUTBOX_KEEP_CAPACITY: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillReason {
    TooSlow,
    TokenRevoked,
}

impl Outbox {
    /// An outbox of its own, with the default bounds and budgets of its own (tests, tools).
    pub fn new() -> (Outbox, OutboxReader) {
        let bounds = OutboxBounds::default();
        Outbox::within(
            bounds.connection,
            Budget::new(bounds.user),
            Budget::new(bounds.server),
        )
    }

    /// An outbox that may queue `limit` bytes, of a user's and a server's budgets.
    pub fn within(limit: usize, user: Arc<Budget>, server: Arc<Budget>) -> (Outbox, OutboxReader) {
        user.outboxes.fetch_add(1, Ordering::Relaxed);
        server.outboxes.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(OutboxShared {
            state: Mutex::new(OutboxState::default()),
            ready: Notify::new(),
            kill: Notify::new(),
            limit,
            user,
            server,
        });
        (Outbox(shared.clone()), OutboxReader(shared))
    }

    /// The budget of this outbox's user, which the user's other outboxes share.
    pub fn user_budget(&self) -> &Arc<Budget> {
        &self.0.user
    }

    /// Whether frames kept for resending are to be let go: this outbox's user, or the
    /// server, holds more than its bound.
    pub fn under_pressure(&self) -> bool {
        self.0.user.spent() || self.0.server.spent()
    }

    /// A frame for this connection alone.
    pub fn send_text(&self, text: impl Into<Utf8Bytes>) {
        self.send(Outgoing::Frame(Frame::for_user(text)));
    }

    /// Queues without waiting; an outbox past its bounds closes the connection.
    pub fn send(&self, out: Outgoing) {
        let mut state = self.0.state.lock().expect("outbox lock");
        if state.closed {
            return;
        }
        // A request to save positions is not a frame: a connection too slow for frames still
        // takes it (at most one per other connection of its device that opens).
        if let Some(frame) = out.frame() {
            if state.frames_stopped {
                return;
            }
            frame.charge_to(&self.0.server, &self.0.user);
            let queued = state.queued + frame.len();
            // An outbox with nothing queued takes a frame of any size: one larger than a
            // bound would otherwise close every connection it is pushed to, each time.
            let stuck = || state.emptied_at.elapsed() >= STUCK_AFTER;
            let past_bounds = state.queued > 0
                && (queued > self.0.limit
                    || ((self.0.user.sheds(queued) || self.0.server.sheds(queued)) && stuck()));
            if state.frames.len() >= OUTBOX_CAPACITY || past_bounds {
                drop(state);
                drop(out);
                self.close(KillReason::TooSlow);
                return;
            }
            state.queued = queued;
        }
        state.frames.push_back(out);
        drop(state);
        self.0.ready.notify_one();
    }

    /// Tells the connection to close, for the first reason given. A connection too slow
    /// lets go of what it queued at once (its client pulls it when it comes back); a
    /// logged-out one keeps its `kicked` frame to write.
    pub fn close(&self, reason: KillReason) {
        let mut state = self.0.state.lock().expect("outbox lock");
        let first = *state.kill_reason.get_or_insert(reason);
        let dropped = if first == KillReason::TooSlow && !state.frames_stopped {
            metrics::counter!("pigeon_connections_too_slow_total").increment(1);
            Self::stop_frames_of(&mut state)
        } else {
            VecDeque::new()
        };
        drop(state);
        // Outside the lock: up to OUTBOX_CAPACITY frames.
        drop(dropped);
        self.0.kill.notify_one();
    }

    /// The connection is ending: what is queued for it and every frame sent after are let
    /// go, while requests to save its positions are still taken (a new connection of the
    /// device waits for them).
    pub fn stop_frames(&self) {
        let dropped = Self::stop_frames_of(&mut self.0.state.lock().expect("outbox lock"));
        drop(dropped);
    }

    fn stop_frames_of(state: &mut OutboxState) -> VecDeque<Outgoing> {
        state.frames_stopped = true;
        state.queued = 0;
        let (saves, frames): (VecDeque<Outgoing>, VecDeque<Outgoing>) =
            std::mem::take(&mut state.frames)
                .into_iter()
                .partition(|o| matches!(o, Outgoing::SaveCursors(_)));
        state.frames = saves;
        frames
    }

    /// Completes once the connection is told to close (see [`Outbox::kill_reason`]).
    pub async fn killed(&self) {
        self.0.kill.notified().await;
    }

    pub fn kill_reason(&self) -> Option<KillReason> {
        self.0.state.lock().expect("outbox lock").kill_reason
    }

    /// Bytes of frame text queued now.
    pub fn queued_bytes(&self) -> usize {
        self.0.state.lock().expect("outbox lock").queued
    }
}

impl Drop for OutboxShared {
    fn drop(&mut self) {
        self.user.outboxes.fetch_sub(1, Ordering::Relaxed);
        self.server.outboxes.fetch_sub(1, Ordering::Relaxed);
    }
}

impl OutboxReader {
    /// The next queued frame, once there is one. Cancel-safe: a frame leaves the queue only
    /// when it is returned.
    pub async fn recv(&mut self) -> Outgoing {
        loop {
            if let Some(out) = self.try_recv() {
                return out;
            }
            // A frame queued since the look above left a permit: this completes at once.
            self.0.ready.notified().await;
        }
    }

    pub fn try_recv(&mut self) -> Option<Outgoing> {
        let mut state = self.0.state.lock().expect("outbox lock");
        let out = state.frames.pop_front();
        match &out {
            Some(o) => state.queued -= o.frame().map_or(0, Frame::len),
            None => {
                state.emptied_at = std::time::Instant::now();
                if state.frames.capacity() > OUTBOX_KEEP_CAPACITY {
                    state.frames = VecDeque::new();
                }
            }
        }
        out
    }
}

impl Drop for OutboxReader {
    fn drop(&mut self) {
        let frames = {
            let mut state = self.0.state.lock().expect("outbox lock");
            state.closed = true;
            state.queued = 0;
            std::mem::take(&mut state.frames)
        };
        // Dropped outside the lock: up to OUTBOX_CAPACITY frames.
        drop(frames);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(text: &str) -> Outgoing {
        Outgoing::Frame(Frame::for_user(text.to_owned()))
    }

    fn text(out: Outgoing) -> String {
        match out {
            Outgoing::Frame(t) | Outgoing::Push { frame: t, .. } => t.as_str().to_owned(),
            Outgoing::SaveCursors(_) => "(save cursors)".into(),
            Outgoing::Forget(id) => format!("(forget {id})"),
        }
    }

    #[tokio::test]
    async fn an_outbox_hands_frames_over_in_order_and_wakes_its_reader() {
        let (outbox, mut reader) = Outbox::new();
        assert!(reader.try_recv().is_none());
        let waiting = tokio::spawn(async move {
            let first = text(reader.recv().await);
            let second = text(reader.recv().await);
            (first, second, reader)
        });
        tokio::task::yield_now().await;
        let sender = outbox.clone();
        sender.send(frame("one"));
        sender.send(frame("two"));
        let (first, second, mut reader) = waiting.await.unwrap();
        assert_eq!((first.as_str(), second.as_str()), ("one", "two"));
        assert!(reader.try_recv().is_none());
        assert_eq!(outbox.kill_reason(), None);
    }

    /// A `recv` dropped while it waits (another branch of a select won) loses nothing.
    #[tokio::test]
    async fn a_cancelled_recv_leaves_the_frame_queued() {
        let (outbox, mut reader) = Outbox::new();
        let mut recv = Box::pin(reader.recv());
        assert!(
            futures_util::FutureExt::now_or_never(&mut recv).is_none(),
            "nothing queued yet"
        );
        // The frame wakes the waiting recv, which is dropped before it runs again.
        outbox.send(frame("kept"));
        drop(recv);
        assert_eq!(text(reader.recv().await), "kept");
        assert!(reader.try_recv().is_none());
    }

    #[tokio::test]
    async fn a_full_outbox_closes_its_connection_as_too_slow_and_lets_go_of_its_frames() {
        let (outbox, mut reader) = Outbox::new();
        for i in 0..OUTBOX_CAPACITY {
            outbox.send(frame(&i.to_string()));
        }
        assert_eq!(outbox.kill_reason(), None);
        outbox.send(frame("one too many"));
        assert_eq!(outbox.kill_reason(), Some(KillReason::TooSlow));
        tokio::time::timeout(std::time::Duration::from_secs(5), outbox.killed())
            .await
            .expect("the connection is told");
        // The first reason stays; nothing is kept for a connection that is behind.
        outbox.close(KillReason::TokenRevoked);
        assert_eq!(outbox.kill_reason(), Some(KillReason::TooSlow));
        assert!(reader.try_recv().is_none());
        outbox.send(frame("after"));
        assert!(reader.try_recv().is_none());
        assert_eq!(outbox.queued_bytes(), 0);
    }

    #[test]
    fn a_logged_out_connection_keeps_its_kicked_frame() {
        let (outbox, mut reader) = Outbox::new();
        outbox.send(frame("kicked"));
        outbox.close(KillReason::TokenRevoked);
        assert_eq!(text(reader.try_recv().unwrap()), "kicked");
    }

    #[test]
    fn an_emptied_outbox_gives_its_buffer_back_and_a_gone_reader_takes_nothing() {
        let (outbox, mut reader) = Outbox::new();
        for i in 0..1000 {
            outbox.send(frame(&i.to_string()));
        }
        while reader.try_recv().is_some() {}
        assert!(reader.try_recv().is_none());
        let capacity = |o: &Outbox| o.0.state.lock().unwrap().frames.capacity();
        assert!(capacity(&outbox) <= OUTBOX_KEEP_CAPACITY);
        drop(reader);
        for i in 0..10 {
            outbox.send(frame(&i.to_string()));
        }
        assert_eq!(capacity(&outbox), 0);
        assert_eq!(outbox.kill_reason(), None, "not counted as a slow reader");
    }

    #[test]
    fn a_connection_past_its_bytes_is_closed_at_once() {
        let (user, server) = (Budget::new(1 << 30), Budget::new(1 << 30));
        let (outbox, mut reader) = Outbox::within(10_000, user, server.clone());
        let big = "x".repeat(4_000);
        outbox.send(frame(&big));
        outbox.send(frame(&big));
        assert_eq!(outbox.queued_bytes(), 8_000);
        assert_eq!(server.held(), 8_000);
        // Reading makes room.
        reader.try_recv().unwrap();
        assert_eq!(outbox.queued_bytes(), 4_000);
        outbox.send(frame(&big));
        assert_eq!(outbox.kill_reason(), None);
        // 12 000 bytes would be queued: over.
        outbox.send(frame(&big));
        assert_eq!(outbox.kill_reason(), Some(KillReason::TooSlow));
        assert!(reader.try_recv().is_none());
        assert_eq!(server.held(), 0, "what it held is let go");
    }

    /// A frame queued on several outboxes (every device of a user, every member of a read
    /// fan-out group) is one buffer, and counts once.
    #[test]
    fn a_shared_frame_counts_once_while_any_outbox_holds_it() {
        let (user, server) = (Budget::new(1 << 30), Budget::new(1 << 30));
        let (a, mut ra) = Outbox::within(1 << 20, user.clone(), server.clone());
        let (b, mut rb) = Outbox::within(1 << 20, user.clone(), server.clone());
        let push = Frame::for_user("y".repeat(1_000));
        a.send(Outgoing::Frame(push.clone()));
        b.send(Outgoing::Frame(push.clone()));
        drop(push);
        assert_eq!((a.queued_bytes(), b.queued_bytes()), (1_000, 1_000));
        assert_eq!((user.held(), server.held()), (1_000, 1_000));
        let kept = ra.try_recv().unwrap();
        assert_eq!(server.held(), 1_000, "still queued on b, and kept");
        drop(kept);
        drop(rb.try_recv().unwrap());
        assert_eq!((user.held(), server.held()), (0, 0));
        // Shared by several users: the server's only.
        let other = Budget::new(1 << 30);
        let (c, _rc) = Outbox::within(1 << 20, other.clone(), server.clone());
        let room = Frame::shared("z".repeat(500));
        a.send(Outgoing::Frame(room.clone()));
        c.send(Outgoing::Frame(room));
        assert_eq!((user.held(), other.held(), server.held()), (0, 0, 500));
    }

    /// Past the server's bound, a connection that has been behind for a while, by more than
    /// its share, is closed as it gets its next frame; one that keeps up is not, whatever
    /// the frames' size.
    #[test]
    fn past_a_spent_bound_only_connections_behind_are_closed() {
        let server = Budget::new(4 << 20);
        let outbox =
            |server: &Arc<Budget>| Outbox::within(8 << 20, Budget::new(1 << 30), server.clone());
        let (slow_a, _ra) = outbox(&server);
        let (slow_b, _rb) = outbox(&server);
        let (reading, mut rr) = outbox(&server);
        let chunk = "s".repeat(300_000);
        // Two connections that never read take the server past its 4 MiB; they have not
        // been behind long yet.
        for _ in 0..7 {
            slow_a.send(frame(&chunk));
            slow_b.send(frame(&chunk));
        }
        assert!(server.spent());
        assert_eq!(slow_a.kill_reason(), None);
        std::thread::sleep(STUCK_AFTER);
        // The reader takes each frame as it comes, however large: it is never behind.
        for _ in 0..20 {
            reading.send(frame(&chunk));
            drop(rr.try_recv().unwrap());
        }
        assert_eq!(reading.kill_reason(), None);
        // The next frame of a connection long behind closes it, and its frames are let go.
        slow_a.send(frame(&chunk));
        assert_eq!(slow_a.kill_reason(), Some(KillReason::TooSlow));
        assert_eq!(server.held(), 7 * 300_000);
        assert_eq!(slow_b.kill_reason(), None);
    }

    /// One user's connections together are bounded too.
    #[test]
    fn a_users_connections_together_are_bounded() {
        let (user, server) = (Budget::new(2 << 20), Budget::new(1 << 30));
        let outboxes: Vec<_> = (0..4)
            .map(|_| Outbox::within(8 << 20, user.clone(), server.clone()))
            .collect();
        std::thread::sleep(STUCK_AFTER);
        let chunk = "u".repeat(300_000);
        for _ in 0..5 {
            for (o, _) in &outboxes {
                o.send(frame(&chunk));
            }
        }
        assert!(
            outboxes
                .iter()
                .any(|(o, _)| o.kill_reason() == Some(KillReason::TooSlow))
        );
        assert!(user.held() < 20 * chunk.len(), "what was closed was let go");
    }

    /// A connection closed as too slow, or ending, drops its frames but still takes a
    /// request to save its positions, which a new connection of its device waits for.
    #[test]
    fn an_ending_connection_still_takes_a_request_to_save_its_positions() {
        let (outbox, mut reader) = Outbox::new();
        let (early, _early_rx) = tokio::sync::oneshot::channel();
        outbox.send(Outgoing::SaveCursors(early));
        outbox.send(frame("a push"));
        outbox.stop_frames();
        let (late, _late_rx) = tokio::sync::oneshot::channel();
        outbox.send(Outgoing::SaveCursors(late));
        outbox.send(frame("after"));
        let left: Vec<String> = std::iter::from_fn(|| reader.try_recv()).map(text).collect();
        assert_eq!(left, vec!["(save cursors)", "(save cursors)"]);
    }
}

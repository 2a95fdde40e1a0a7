//! The push hub: which devices of which users are connected to this node, and the delivery
//! of frames to them. Every connection has a bounded outbox (`outbox.rs`); a connection
//! whose outbox is past its bounds is told to close (its client will reconnect and pull),
//! so a slow reader never makes the server hold more memory.

use crate::outbox::{
    Budget, Frame, KillReason, Outbox, OutboxBounds, OutboxReader, Outgoing, PushChain,
};
use crate::webhook::{Notice, OfflineHook};
use pigeon_core::changes::Event;
use pigeon_proto::frames::{ServerFrame, msg_frame};
use pigeon_proto::{ConversationId, DeviceId, MessageKind, MsgId, UserId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::Notify;

/// Where a connection is (`pigeon_core::presence`): what the pipeline answers a WebSocket
/// command to, instead of a handle on its outbox, so that a command may be decided on
/// another node than the one that holds its connection.
pub use pigeon_core::presence::ConnectionAddr;
use pigeon_core::presence::Presence;

struct Conn {
    id: u64,
    device: DeviceId,
    outbox: Outbox,
}

const SHARDS: usize = 32;

/// Connected devices by user, sharded to keep lock hold times short.
pub struct Hub {
    shards: Vec<RwLock<HashMap<UserId, Vec<Conn>>>>,
    next_id: AtomicU64,
    connections: AtomicUsize,
    /// Connections admitted ([`Hub::admit`]): registered ones and upgrades under way, in
    /// all and per user. Counted apart from the registrations, which begin only once an
    /// upgrade is done: checked against those, every upgrade racing another would pass.
    admitted: Mutex<AdmittedCounts>,
    waiters: Mutex<HashMap<UserId, Arc<WaitState>>>,
    /// Long polls in progress; when none, publishing skips the waiters lock.
    waiting: AtomicUsize,
    offline: Option<OfflineHook>,
    /// Receipts per (conversation, reader) within the last [`RECEIPT_FLUSH_EVERY`]: when
    /// one last went out, and the newest held back since (see [`Hub::publish`]'s receipts).
    receipts: Mutex<HashMap<(ConversationId, UserId), ReceiptPace>>,
    /// What the outboxes of this node may hold (see `outbox.rs`), and what they hold.
    bounds: OutboxBounds,
    frames: Arc<Budget>,
    /// This node's number (`--node-id`): the `node` of the addresses of its connections.
    node: u16,
    /// Where the devices of every node are, when this node is one of several: told of each
    /// connection here, and asked whether a user is online elsewhere before the offline
    /// hook is called. Alone, this hub's own map is the whole truth.
    presence: Option<Arc<dyn Presence>>,
}

/// One reader's receipts in one conversation, paced.
struct ReceiptPace {
    /// When one last went out (none yet: only held ones): the next waits for a flush unless
    /// this is [`RECEIPT_FLUSH_EVERY`] ago.
    sent_at: Option<std::time::Instant>,
    /// The newest position that went out: an older one that comes after it (two tiers'
    /// delivery tasks may both publish around a group's move to another tier) is dropped,
    /// so the others never see a read mark go back.
    sent_seq: u64,
    /// The newest held back: its position, who to tell, and the device not to tell.
    held: Option<HeldReceipt>,
}

struct HeldReceipt {
    last_read_seq: u64,
    to: Vec<UserId>,
    except_device: Option<DeviceId>,
}

/// How often held-back receipts go out: each reader's receipts in a conversation reach the
/// others at most about twice per this, the first at once (PROTOCOL.md 5.4 allows "at most
/// a few per second per conversation"; a frame names one reader, so the pace is per reader,
/// and a group where many read at once gets a few per second of each).
pub const RECEIPT_FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

impl Default for Hub {
    fn default() -> Self {
        Hub {
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
            next_id: AtomicU64::new(1),
            connections: AtomicUsize::new(0),
            admitted: Mutex::new(AdmittedCounts::default()),
            waiters: Mutex::new(HashMap::new()),
            waiting: AtomicUsize::new(0),
            offline: None,
            receipts: Mutex::new(HashMap::new()),
            bounds: OutboxBounds::default(),
            frames: Budget::new(OutboxBounds::default().server),
            node: 0,
            presence: None,
        }
    }
}

#[derive(Default)]
struct AdmittedCounts {
    total: usize,
    by_user: HashMap<UserId, usize>,
}

/// Why [`Hub::admit`] refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The server holds its most connections.
    Server,
    /// The user holds their most connections.
    User,
}

/// A connection's place in the hub's counts, taken before its upgrade and held until
/// dropped: when the connection ends, or when the upgrade never completes.
pub struct Admission {
    hub: Arc<Hub>,
    user: UserId,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut admitted = self.hub.admitted.lock().expect("admitted lock");
        admitted.total -= 1;
        if let Some(n) = admitted.by_user.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                admitted.by_user.remove(&self.user);
            }
        }
    }
}

/// A connection just registered: its place in the hub, its outbox's two sides, and the
/// answers of the device's other connections asked to save their positions.
pub struct Registered {
    pub registration: Registration,
    pub outbox: Outbox,
    pub reader: OutboxReader,
    pub sibling_saves: Vec<tokio::sync::oneshot::Receiver<()>>,
}

/// Removes its connection from the hub when dropped.
pub struct Registration {
    hub: Arc<Hub>,
    user: UserId,
    id: u64,
}

impl Registration {
    /// This connection's id, unique on this node.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut shard = self.hub.shard(self.user).write().expect("hub shard lock");
        if let Some(conns) = shard.get_mut(&self.user) {
            conns.retain(|c| c.id != self.id);
            if conns.is_empty() {
                shard.remove(&self.user);
            }
        }
        if let Some(p) = &self.hub.presence {
            p.disconnected(self.hub.address(self.user, self.id));
        }
        self.hub.connections.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!("pigeon_connections").decrement(1.0);
    }
}

impl Hub {
    /// A hub that notifies `offline` of messages reaching users with no connected device,
    /// whose outboxes hold frames within `bounds`.
    pub fn new(offline: Option<OfflineHook>, bounds: OutboxBounds, node: u16) -> Hub {
        Hub {
            offline,
            bounds,
            frames: Budget::new(bounds.server),
            node,
            ..Hub::default()
        }
    }

    /// This hub as one node of several, whose devices `presence` knows.
    pub fn with_presence(mut self, presence: Arc<dyn Presence>) -> Hub {
        self.presence = Some(presence);
        self
    }

    /// Whether `user` has a device connected to another node.
    fn online_elsewhere(&self, user: UserId) -> bool {
        self.presence.as_ref().is_some_and(|p| {
            p.connections_of(user)
                .iter()
                .any(|(_, a)| a.node != self.node)
        })
    }

    /// The address of this node's connection `id` of `user`.
    pub fn address(&self, user: UserId, id: u64) -> ConnectionAddr {
        ConnectionAddr {
            node: self.node,
            user,
            id,
        }
    }

    /// Queues a frame for one connection (a command's answer: `send_ack`, `ok`, an error),
    /// before whatever is published after it. One that is gone, or held by another node
    /// (which this node cannot reach: it has no transport to others), is dropped: its
    /// client resends the command, or pulls what it missed.
    pub fn send_to_connection(&self, to: ConnectionAddr, frame: String) {
        if to.node != self.node {
            tracing::debug!(
                node = to.node,
                "a reply for a connection of another node dropped"
            );
            return;
        }
        let mut frame = Some(frame);
        self.each(to.user, |c| {
            if c.id == to.id
                && let Some(f) = frame.take()
            {
                c.outbox.send_text(f);
            }
        });
    }

    /// Bytes of frame text this node's outboxes hold (queued, or kept for resending).
    pub fn frame_bytes(&self) -> usize {
        self.frames.held()
    }

    fn shard(&self, user: UserId) -> &RwLock<HashMap<UserId, Vec<Conn>>> {
        &self.shards[(user.get() as usize) % SHARDS]
    }

    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Takes a place for one more connection of `user`, unless the server already holds
    /// `max_total` or the user `max_per_user` (upgrades under way included).
    pub fn admit(
        self: &Arc<Self>,
        user: UserId,
        max_total: usize,
        max_per_user: usize,
    ) -> Result<Admission, Refused> {
        let mut admitted = self.admitted.lock().expect("admitted lock");
        if admitted.total >= max_total {
            return Err(Refused::Server);
        }
        let mine = admitted.by_user.entry(user).or_default();
        if *mine >= max_per_user {
            return Err(Refused::User);
        }
        *mine += 1;
        admitted.total += 1;
        Ok(Admission {
            hub: self.clone(),
            user,
        })
    }

    /// Registers a connection of `user`'s `device`, with its outbox (within the user's
    /// budget, which the user's connections share). Every other connection of that device
    /// still registered (ending, or half-open) is asked to save its acknowledged positions
    /// now; the answers say when each has queued them for the store.
    pub fn register(self: &Arc<Self>, user: UserId, device: DeviceId) -> Registered {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (outbox, reader, saves) = {
            let mut shard = self.shard(user).write().expect("hub shard lock");
            // Most users hold one connection: a first push into an empty Vec would make
            // room for four (160 bytes kept by every idle connection, heaptrack).
            let conns = shard.entry(user).or_insert_with(|| Vec::with_capacity(1));
            let budget = conns.first().map_or_else(
                || Budget::new(self.bounds.user),
                |c| c.outbox.user_budget().clone(),
            );
            let (outbox, reader) =
                Outbox::within(self.bounds.connection, budget, self.frames.clone());
            let mut saves = Vec::new();
            for c in conns.iter().filter(|c| c.device == device) {
                let (tx, rx) = tokio::sync::oneshot::channel();
                c.outbox.send(Outgoing::SaveCursors(tx));
                saves.push(rx);
            }
            if let Some(p) = &self.presence {
                p.connected(&device, self.address(user, id));
            }
            conns.push(Conn {
                id,
                device,
                outbox: outbox.clone(),
            });
            (outbox, reader, saves)
        };
        self.connections.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!("pigeon_connections").increment(1.0);
        Registered {
            registration: Registration {
                hub: self.clone(),
                user,
                id,
            },
            outbox,
            reader,
            sibling_saves: saves,
        }
    }

    /// Calls `f` with each connected device of `user`.
    fn each(&self, user: UserId, mut f: impl FnMut(&Conn)) {
        if let Some(conns) = self.shard(user).read().expect("hub shard lock").get(&user) {
            conns.iter().for_each(&mut f);
        }
    }

    /// Ends every open connection of `user` after a logout: `kicked`, then the close
    /// (1008). Once per connection: a second call passes those already ended. Their long
    /// polls are woken, to find their token revoked.
    pub fn revoke(&self, user: UserId) {
        self.wake(user, false);
        let frame = Frame::for_user(
            ServerFrame::Kicked {
                reason: "token_revoked".into(),
            }
            .to_json(),
        );
        self.each(user, |c| {
            if c.outbox.kill_reason().is_none() {
                c.outbox.send(Outgoing::Frame(frame.clone()));
                c.outbox.close(KillReason::TokenRevoked);
            }
        });
    }

    /// Sends `frame` to every device of each user, except `except_device` of `except_user`.
    pub fn send_to_users(
        &self,
        users: &[UserId],
        frame: &str,
        except: Option<(UserId, &DeviceId)>,
    ) {
        // For one user, the user's: their devices share it.
        let shared = match users {
            [_] => Frame::for_user(frame.to_owned()),
            _ => Frame::shared(frame.to_owned()),
        };
        for u in users {
            self.each(*u, |c| {
                if except.is_some_and(|(eu, ed)| eu == *u && *ed == c.device) {
                    return;
                }
                c.outbox.send(Outgoing::Frame(shared.clone()));
            });
        }
    }

    /// Delivers what a committed batch announced.
    pub fn publish(&self, events: Vec<Event>) {
        for ev in events {
            match ev {
                Event::Message {
                    message,
                    recipients,
                } => {
                    let json = serde_json::to_string(&*message).expect("messages serialise");
                    let conv = ConversationId::parse(&message.conversation_id).ok();
                    // A recall or an edit: the message it changes, whose pushes not yet
                    // acknowledged are not to be sent again.
                    let changed = matches!(message.kind, MessageKind::Recall | MessageKind::Edit)
                        .then(|| MsgId::parse(message.extra.get("msg_id")?.as_str()?).ok())
                        .flatten();
                    // Read fan-out recipients all get the same bytes; built at the first one
                    // online, and each frame only for a recipient with a connected device.
                    let mut shared: Option<Frame> = None;
                    let notify_offline = self
                        .offline
                        .as_ref()
                        .filter(|_| message.kind.is_user_content());
                    for r in recipients {
                        self.wake(r.user, r.user_seq.is_none());
                        let chain = match (r.user_seq, &conv) {
                            (Some(us), _) => PushChain::Inbox(us),
                            (None, Some(c)) => PushChain::Conversation(c.clone(), message.seq),
                            (None, None) => continue,
                        };
                        let mut frame: Option<Frame> = None;
                        let mut online = false;
                        self.each(r.user, |c| {
                            online = true;
                            let frame = frame.get_or_insert_with(|| match r.user_seq {
                                Some(_) => Frame::for_user(msg_frame(&json, r.user_seq)),
                                None => shared
                                    .get_or_insert_with(|| Frame::shared(msg_frame(&json, None)))
                                    .clone(),
                            });
                            if let Some(id) = changed {
                                c.outbox.send(Outgoing::Forget(id));
                            }
                            c.outbox.send(Outgoing::Push {
                                chain: chain.clone(),
                                frame: frame.clone(),
                            })
                        });
                        if let Some(hook) = notify_offline
                            && !online
                            && !r.muted
                            && r.user != message.sender
                            && !self.online_elsewhere(r.user)
                        {
                            hook.notify(Notice::of(&message, r.user));
                        }
                    }
                    metrics::counter!("pigeon_messages_pushed_total").increment(1);
                }
                Event::Receipt {
                    conversation,
                    user,
                    last_read_seq,
                    to,
                    except_device,
                } => {
                    // The first of a reader's receipts in a conversation goes at once; those
                    // that follow within the flush interval are held, and only the newest
                    // goes at the flush: a client that marks every message read as it shows
                    // it costs the others a few frames a second, not one per message.
                    let now = std::time::Instant::now();
                    let mut paced = self.receipts.lock().expect("receipts lock");
                    let pace = paced
                        .entry((conversation.clone(), user))
                        .or_insert(ReceiptPace {
                            sent_at: None,
                            sent_seq: 0,
                            held: None,
                        });
                    let paced_now = pace
                        .sent_at
                        .is_some_and(|at| now - at < RECEIPT_FLUSH_EVERY);
                    if last_read_seq <= pace.sent_seq {
                        // Behind what the others were told already.
                    } else if pace.held.is_some() || paced_now {
                        let newest = pace
                            .held
                            .as_ref()
                            .map_or(last_read_seq, |h| h.last_read_seq.max(last_read_seq));
                        pace.held = Some(HeldReceipt {
                            last_read_seq: newest,
                            to,
                            except_device,
                        });
                    } else {
                        pace.sent_at = Some(now);
                        pace.sent_seq = last_read_seq;
                        drop(paced);
                        self.send_receipt(
                            conversation,
                            user,
                            last_read_seq,
                            &to,
                            except_device.as_ref(),
                        );
                    }
                }
                Event::SettingsChanged {
                    user,
                    conversation,
                    pinned,
                    muted,
                    hidden,
                } => {
                    let frame = ServerFrame::ConversationUpdated {
                        conversation_id: conversation,
                        pinned,
                        muted,
                        hidden,
                    }
                    .to_json();
                    self.send_to_users(&[user], &frame, None);
                }
            }
        }
    }

    fn send_receipt(
        &self,
        conversation: ConversationId,
        user: UserId,
        last_read_seq: u64,
        to: &[UserId],
        except: Option<&DeviceId>,
    ) {
        let frame = ServerFrame::Receipt {
            conversation_id: conversation,
            user_id: user,
            last_read_seq,
        }
        .to_json();
        self.send_to_users(to, &frame, except.map(|d| (user, d)));
    }

    /// Sends the held-back receipts (called every [`RECEIPT_FLUSH_EVERY`]), and forgets the
    /// readers with nothing held whose last receipt is that long ago (their next goes at
    /// once), so the map holds only the readers of about the last interval.
    pub fn flush_receipts(&self) {
        let now = std::time::Instant::now();
        let mut held = Vec::new();
        self.receipts.lock().expect("receipts lock").retain(
            |(conversation, user), pace| match pace.held.take() {
                Some(h) => {
                    pace.sent_at = Some(now);
                    pace.sent_seq = h.last_read_seq;
                    held.push((conversation.clone(), *user, h));
                    true
                }
                None => pace
                    .sent_at
                    .is_some_and(|at| now - at < RECEIPT_FLUSH_EVERY),
            },
        );
        for (conversation, user, h) in held {
            self.send_receipt(
                conversation,
                user,
                h.last_read_seq,
                &h.to,
                h.except_device.as_ref(),
            );
        }
    }

    /// The notifier a long poll of `user` waits on, unless `at_most` polls of the user wait
    /// already (counted and registered under one lock, so racing polls cannot all pass).
    /// Released when the guard drops, also when the request is dropped mid-wait (the client
    /// went away).
    pub fn waiter(self: &Arc<Self>, user: UserId, at_most: usize) -> Option<Waiter> {
        let state = {
            let mut waiters = self.waiters.lock().expect("waiters lock");
            let state = waiters.entry(user).or_default();
            // The map holds one reference; each waiting poll another.
            if Arc::strong_count(state) > at_most {
                return None;
            }
            state.clone()
        };
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let group_messages_at_start = state.group_messages.load(Ordering::SeqCst);
        Some(Waiter {
            hub: self.clone(),
            user,
            state: Some(state),
            group_messages_at_start,
        })
    }

    /// How many long polls of `user` are waiting.
    pub fn long_polls_of(&self, user: UserId) -> usize {
        self.waiters
            .lock()
            .expect("waiters lock")
            .get(&user)
            .map_or(0, |w| Arc::strong_count(w) - 1)
    }

    /// Wakes the long polls of `user`; `in_group` for a message of a read fan-out group,
    /// which moves no inbox (the polls learn of it from [`Waiter::group_message_arrived`]).
    fn wake(&self, user: UserId, in_group: bool) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(w) = self.waiters.lock().expect("waiters lock").get(&user) {
            if in_group {
                w.group_messages.fetch_add(1, Ordering::SeqCst);
            }
            w.notify.notify_waiters();
        }
    }
}

/// What the long polls of one user share.
#[derive(Default)]
struct WaitState {
    notify: Notify,
    /// Messages of read fan-out groups delivered to the user while a poll was waiting.
    group_messages: AtomicU64,
}

/// A long poll's interest in a user's inbox and read fan-out groups (see [`Hub::waiter`]).
pub struct Waiter {
    hub: Arc<Hub>,
    user: UserId,
    state: Option<Arc<WaitState>>,
    group_messages_at_start: u64,
}

impl Waiter {
    pub fn notify(&self) -> &Notify {
        &self.state().notify
    }

    /// Whether a message of one of the user's read fan-out groups was delivered since this
    /// poll began.
    pub fn group_message_arrived(&self) -> bool {
        self.state().group_messages.load(Ordering::SeqCst) != self.group_messages_at_start
    }

    fn state(&self) -> &WaitState {
        self.state.as_deref().expect("held until drop")
    }
}

impl Drop for Waiter {
    /// Drops the user's notifier when no long poll holds it any more.
    fn drop(&mut self) {
        let mut w = self.hub.waiters.lock().expect("waiters lock");
        drop(self.state.take());
        self.hub.waiting.fetch_sub(1, Ordering::SeqCst);
        if w.get(&self.user).is_some_and(|n| Arc::strong_count(n) == 1) {
            w.remove(&self.user);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(out: Outgoing) -> String {
        match out {
            Outgoing::Frame(t) | Outgoing::Push { frame: t, .. } => t.as_str().to_owned(),
            Outgoing::SaveCursors(_) => "(save cursors)".into(),
            Outgoing::Forget(id) => format!("(forget {id})"),
        }
    }

    /// Two nodes sharing a presence: each tells it of its connections, and one finds a
    /// user online on the other (whom it must not call the offline hook for) until that
    /// connection ends.
    #[test]
    fn nodes_sharing_a_presence_see_each_others_connections() {
        let presence: Arc<dyn Presence> = Arc::new(pigeon_core::presence::LocalPresence::default());
        let node = |n| {
            Arc::new(Hub::new(None, OutboxBounds::default(), n).with_presence(presence.clone()))
        };
        let (zero, one) = (node(0), node(1));
        let ann = UserId::new(1).unwrap();
        assert!(!zero.online_elsewhere(ann));
        let on_one = one.register(ann, DeviceId::parse("phone").unwrap());
        assert!(zero.online_elsewhere(ann));
        assert!(
            !one.online_elsewhere(ann),
            "its own connection is not elsewhere"
        );
        let found = presence.connections_of(ann);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].1, one.address(ann, on_one.registration.id()));
        drop(on_one);
        assert!(!zero.online_elsewhere(ann));
        assert!(presence.connections_of(ann).is_empty());
    }

    /// A user's connections share one budget, each other user has their own, and every
    /// outbox of the node is of the node's.
    #[test]
    fn a_users_connections_share_their_budget() {
        let hub = Arc::new(Hub::default());
        let (ann, bob) = (UserId::new(1).unwrap(), UserId::new(2).unwrap());
        let phone = hub.register(ann, DeviceId::parse("phone").unwrap());
        let laptop = hub.register(ann, DeviceId::parse("laptop").unwrap());
        let other = hub.register(bob, DeviceId::parse("phone").unwrap());
        assert!(Arc::ptr_eq(
            phone.outbox.user_budget(),
            laptop.outbox.user_budget()
        ));
        assert!(!Arc::ptr_eq(
            phone.outbox.user_budget(),
            other.outbox.user_budget()
        ));
        hub.send_to_users(&[ann, bob], r#"{"type":"typing"}"#, None);
        // One buffer for the three devices, charged to the node once and to no user.
        assert_eq!(hub.frame_bytes(), r#"{"type":"typing"}"#.len());
        assert_eq!(phone.outbox.user_budget().held(), 0);
        drop((phone, laptop, other));
        assert_eq!(hub.frame_bytes(), 0);
    }

    /// PROTOCOL.md 5.4's receipts carry a read mark, which only moves forward: one that
    /// reaches the hub after a newer one of the same reader (two tiers' delivery tasks may
    /// both publish around a group's move to another tier) is not sent, at once or at the
    /// flush.
    #[test]
    fn a_receipt_older_than_one_sent_is_dropped() {
        let hub = Arc::new(Hub::default());
        let (reader_user, peer) = (UserId::new(1).unwrap(), UserId::new(2).unwrap());
        let registered = hub.register(peer, DeviceId::parse("phone").unwrap());
        let mut peer_reader = registered.reader;
        let conversation = ConversationId::parse("g1").unwrap();
        let receipt = |seq: u64| Event::Receipt {
            conversation: conversation.clone(),
            user: reader_user,
            last_read_seq: seq,
            to: vec![peer],
            except_device: None,
        };
        let seqs_told = |r: &mut OutboxReader| {
            let mut seqs = Vec::new();
            while let Some(out) = r.try_recv() {
                let v: serde_json::Value = serde_json::from_str(&text(out)).unwrap();
                assert_eq!(v["type"], "receipt", "{v}");
                seqs.push(v["last_read_seq"].as_u64().unwrap());
            }
            seqs
        };
        hub.publish(vec![receipt(6), receipt(5)]);
        hub.flush_receipts();
        assert_eq!(seqs_told(&mut peer_reader), vec![6]);
        // A newer one is paced as before, and goes at the flush.
        hub.publish(vec![receipt(7), receipt(6)]);
        hub.flush_receipts();
        assert_eq!(seqs_told(&mut peer_reader), vec![7]);
    }

    #[tokio::test]
    async fn a_long_poll_dropped_mid_wait_releases_its_interest() {
        let hub = Arc::new(Hub::default());
        let user = UserId::new(7).unwrap();
        let first = hub.waiter(user, usize::MAX).unwrap();
        let second = hub.waiter(user, usize::MAX).unwrap();
        // The request is dropped while it waits (the client went away).
        let waiting = tokio::spawn(async move {
            second.notify().notified().await;
        });
        tokio::task::yield_now().await;
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(hub.waiting.load(Ordering::SeqCst), 1);
        assert!(hub.waiters.lock().unwrap().contains_key(&user));
        drop(first);
        assert_eq!(hub.waiting.load(Ordering::SeqCst), 0);
        assert!(hub.waiters.lock().unwrap().is_empty());
    }
}

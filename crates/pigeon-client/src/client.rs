//! The reliable client: one background task that owns the connection and the local state.
//!
//! What it guarantees to the application, whatever the network does: every message of the
//! user's conversations is handed out once, in `seq` order per conversation. How:
//! - the inbox chain is followed by `user_seq` (`local_seq`): a push at `local_seq + 1` is
//!   taken, an older one is a duplicate, a newer one is buffered and the hole is pulled;
//! - read fan-out groups are followed by their conversation `seq` in the same way (and so is
//!   any group once it has been seen in read fan-out, whichever chain its messages come by);
//! - after every (re)connect it asks `sync` and pulls what moved, in pages;
//! - acknowledgements are batched; sends are retried with the same `client_msg_id` until
//!   acknowledged (the server answers a retry with the first ack).

use crate::http::ClientError;
use crate::ws::WsConn;
use pigeon_proto::views::{SendAck, SendTarget};
use pigeon_proto::{ErrorBody, Message};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Settings of a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Like `ws://127.0.0.1:8080`.
    pub ws_base: String,
    pub token: String,
    pub device_id: String,
    /// How often acknowledgements are sent (batched).
    pub ack_interval: Duration,
    /// How long a send waits for its ack before it is sent again.
    pub send_retry: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// How long a pull may stay unanswered before it is asked again.
    pub pull_timeout: Duration,
}

impl ClientConfig {
    pub fn new(
        ws_base: impl Into<String>,
        token: impl Into<String>,
        device_id: impl Into<String>,
    ) -> Self {
        ClientConfig {
            ws_base: ws_base.into(),
            token: token.into(),
            device_id: device_id.into(),
            ack_interval: Duration::from_millis(100),
            send_retry: Duration::from_secs(2),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            pull_timeout: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionState {
    Connecting,
    Connected,
    Disconnected,
}

/// What the application receives, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    State(ConnectionState),
    /// A message, exactly once, in seq order within its conversation.
    Message(Box<Message>),
    Receipt {
        conversation_id: String,
        user_id: u64,
        last_read_seq: u64,
    },
    Typing {
        conversation_id: String,
        user_id: u64,
    },
    /// The server revoked the token; the client stops.
    Kicked {
        reason: String,
    },
    /// A frame this SDK does not know (the protocol grows by adding them).
    Other(Value),
}

/// A message to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing {
    pub to: SendTarget,
    pub kind: String,
    pub content: String,
    pub extra: Value,
}

impl Outgoing {
    pub fn text(to: SendTarget, content: impl Into<String>) -> Self {
        Outgoing {
            to,
            kind: "text".into(),
            content: content.into(),
            extra: Value::Null,
        }
    }
}

enum Cmd {
    Send {
        client_msg_id: String,
        out: Outgoing,
        reply: oneshot::Sender<Result<SendAck, ClientError>>,
    },
    Frame(Value),
    Shutdown,
}

/// The handle the application holds. Dropping it stops the client.
pub struct Client {
    cmd: mpsc::Sender<Cmd>,
    device_id: String,
    counter: std::sync::atomic::AtomicU64,
    task: tokio::task::JoinHandle<()>,
}

impl Client {
    /// Starts connecting; events arrive on the returned receiver.
    pub fn start(cfg: ClientConfig) -> (Client, mpsc::UnboundedReceiver<Event>) {
        let (cmd_tx, cmd_rx) = mpsc::channel(1024);
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let device_id = cfg.device_id.clone();
        let task = tokio::spawn(Engine::new(cfg, ev_tx).run(cmd_rx));
        (
            Client {
                cmd: cmd_tx,
                device_id,
                counter: Default::default(),
                task,
            },
            ev_rx,
        )
    }

    /// Sends and waits for the ack; retried across reconnects with the same `client_msg_id`.
    pub async fn send(&self, out: Outgoing) -> Result<SendAck, ClientError> {
        let n = self
            .counter
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id: String = format!("{}-{:x}-{}", self.device_id, rand::random::<u32>(), n)
            .chars()
            .take(64)
            .collect();
        self.send_as(id, out).await
    }

    /// Sends with a chosen `client_msg_id` (an application retrying across restarts).
    pub async fn send_as(
        &self,
        client_msg_id: String,
        out: Outgoing,
    ) -> Result<SendAck, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Send {
                client_msg_id,
                out,
                reply: tx,
            })
            .await
            .map_err(|_| ClientError::Transport("client stopped".into()))?;
        rx.await
            .map_err(|_| ClientError::Transport("client stopped".into()))?
    }

    /// Marks `conversation_id` read up to `seq` (a `read` frame).
    pub async fn read(&self, conversation_id: &str, seq: u64) {
        let _ = self
            .cmd
            .send(Cmd::Frame(
                json!({"type": "read", "conversation_id": conversation_id, "seq": seq}),
            ))
            .await;
    }

    /// Sends a typing notice.
    pub async fn typing(&self, conversation_id: &str) {
        let _ = self
            .cmd
            .send(Cmd::Frame(
                json!({"type": "typing", "conversation_id": conversation_id}),
            ))
            .await;
    }

    /// Closes the connection and stops.
    pub async fn shutdown(self) {
        let _ = self.cmd.send(Cmd::Shutdown).await;
        let _ = self.task.await;
    }
}

/// A conversation followed by its own seq.
#[derive(Default)]
struct ConvChain {
    /// Highest seq handed to the application (everything below it was, too).
    shown: u64,
    buffer: BTreeMap<u64, Message>,
    pull_in_flight: Option<Instant>,
    ack_due: bool,
}

struct PendingSend {
    frame: Value,
    sent_at: Option<Instant>,
    reply: oneshot::Sender<Result<SendAck, ClientError>>,
}

enum PullOf {
    Inbox,
    Conversation(String),
}

/// Most messages buffered ahead of a hole per chain; the rest are pulled later.
const MAX_BUFFER: usize = 10_000;
const PAGE: u64 = 200;

struct Engine {
    cfg: ClientConfig,
    events: mpsc::UnboundedSender<Event>,
    /// Inbox position (`local_seq`); `None` until the first sync told where this device is.
    inbox: Option<u64>,
    inbox_buffer: BTreeMap<u64, Message>,
    inbox_pull_in_flight: Option<Instant>,
    inbox_ack_due: bool,
    /// The newest inbox position known to exist (from sync or a push).
    inbox_target: u64,
    /// Highest seq shown per conversation followed through the inbox only.
    inbox_shown: HashMap<String, u64>,
    /// Conversations followed by their own seq (read fan-out, now or once).
    chains: HashMap<String, ConvChain>,
    sends: BTreeMap<i64, (String, PendingSend)>,
    send_ids: HashSet<String>,
    pulls: HashMap<i64, PullOf>,
    /// The req and time of a sync not answered yet.
    sync_in_flight: Option<(i64, Instant)>,
    next_req: i64,
}

impl Engine {
    fn new(cfg: ClientConfig, events: mpsc::UnboundedSender<Event>) -> Self {
        Engine {
            cfg,
            events,
            inbox: None,
            inbox_buffer: BTreeMap::new(),
            inbox_pull_in_flight: None,
            inbox_ack_due: false,
            inbox_target: 0,
            inbox_shown: HashMap::new(),
            chains: HashMap::new(),
            sends: BTreeMap::new(),
            send_ids: HashSet::new(),
            pulls: HashMap::new(),
            sync_in_flight: None,
            next_req: 0,
        }
    }

    fn emit(&self, e: Event) {
        let _ = self.events.send(e);
    }

    fn req(&mut self) -> i64 {
        self.next_req += 1;
        self.next_req
    }

    async fn run(mut self, mut cmds: mpsc::Receiver<Cmd>) {
        let mut backoff = self.cfg.backoff_min;
        loop {
            self.emit(Event::State(ConnectionState::Connecting));
            // Commands that arrive while connecting are queued; the attempt goes on.
            let (base, token, device) = (
                self.cfg.ws_base.clone(),
                self.cfg.token.clone(),
                self.cfg.device_id.clone(),
            );
            let connect = async move { WsConn::connect(&base, &token, &device).await };
            tokio::pin!(connect);
            let conn = loop {
                tokio::select! {
                    c = &mut connect => break c,
                    cmd = cmds.recv() => {
                        if !self.queue_while_offline(cmd) {
                            return;
                        }
                    }
                }
            };
            let mut ws = match conn {
                Ok(ws) => ws,
                Err(ClientError::Api { status: 401, .. }) => {
                    self.emit(Event::Kicked {
                        reason: "unauthorized".into(),
                    });
                    self.emit(Event::State(ConnectionState::Disconnected));
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "connect failed");
                    self.emit(Event::State(ConnectionState::Disconnected));
                    // A refusal that names its wait (429 `rate_limited`: too many of this
                    // user's connections) is not tried again before it.
                    if let ClientError::Api { body, .. } = &e
                        && let Some(ms) = body.retry_after_ms
                    {
                        backoff = backoff.max(Duration::from_millis(ms));
                    }
                    let jitter = backoff.mul_f64(rand::random::<f64>() * 0.5);
                    tokio::time::sleep(backoff + jitter).await;
                    backoff = (backoff * 2).min(self.cfg.backoff_max);
                    continue;
                }
            };
            backoff = self.cfg.backoff_min;
            self.emit(Event::State(ConnectionState::Connected));
            match self.session(&mut ws, &mut cmds).await {
                SessionEnd::Stop => {
                    ws.close().await;
                    self.emit(Event::State(ConnectionState::Disconnected));
                    return;
                }
                SessionEnd::Kicked => {
                    self.emit(Event::State(ConnectionState::Disconnected));
                    return;
                }
                SessionEnd::Lost => {
                    self.emit(Event::State(ConnectionState::Disconnected));
                    // Pulls and acks of the lost connection are void; sync asks again.
                    self.pulls.clear();
                    self.sync_in_flight = None;
                    self.inbox_pull_in_flight = None;
                    self.chains
                        .values_mut()
                        .for_each(|c| c.pull_in_flight = None);
                    let jitter = backoff.mul_f64(rand::random::<f64>());
                    tokio::time::sleep(jitter).await;
                }
            }
        }
    }

    /// Takes a command while not connected; false when the client must stop.
    fn queue_while_offline(&mut self, cmd: Option<Cmd>) -> bool {
        match cmd {
            None | Some(Cmd::Shutdown) => false,
            Some(Cmd::Send {
                client_msg_id,
                out,
                reply,
            }) => {
                self.add_send(client_msg_id, out, reply);
                true
            }
            Some(Cmd::Frame(_)) => true,
        }
    }

    fn add_send(
        &mut self,
        client_msg_id: String,
        out: Outgoing,
        reply: oneshot::Sender<Result<SendAck, ClientError>>,
    ) {
        if !self.send_ids.insert(client_msg_id.clone()) {
            let _ = reply.send(Err(ClientError::Decode(format!(
                "{client_msg_id} is already being sent"
            ))));
            return;
        }
        let req = self.req();
        let frame = json!({
            "type": "send", "req": req, "client_msg_id": client_msg_id, "to": out.to,
            "kind": out.kind, "content": out.content, "extra": out.extra,
        });
        self.sends.insert(
            req,
            (
                client_msg_id,
                PendingSend {
                    frame,
                    sent_at: None,
                    reply,
                },
            ),
        );
    }

    async fn session(&mut self, ws: &mut WsConn, cmds: &mut mpsc::Receiver<Cmd>) -> SessionEnd {
        let heartbeat = Duration::from_millis(ws.hello["heartbeat_ms"].as_u64().unwrap_or(30_000));
        // Resend every unacknowledged send, then ask what moved.
        for (_, (_, p)) in self.sends.iter_mut() {
            p.sent_at = None;
        }
        if self.flush_sends(ws).await.is_err() || self.sync(ws).await.is_err() {
            return SessionEnd::Lost;
        }
        let mut ack_tick = tokio::time::interval(self.cfg.ack_interval);
        let mut ping_tick = tokio::time::interval(heartbeat / 2);
        ping_tick.reset();
        loop {
            let step = tokio::select! {
                cmd = cmds.recv() => match cmd {
                    None | Some(Cmd::Shutdown) => {
                        let _ = self.send_acks(ws).await;
                        return SessionEnd::Stop;
                    }
                    Some(Cmd::Send { client_msg_id, out, reply }) => {
                        self.add_send(client_msg_id, out, reply);
                        self.flush_sends(ws).await
                    }
                    Some(Cmd::Frame(f)) => ws.send(&f).await,
                },
                frame = ws.recv(heartbeat * 3) => match frame {
                    Ok(Some(f)) => match self.on_frame(ws, f).await {
                        Ok(true) => Ok(()),
                        Ok(false) => return SessionEnd::Kicked,
                        Err(e) => Err(e),
                    },
                    _ => return SessionEnd::Lost,
                },
                _ = ack_tick.tick() => {
                    let r = self.send_acks(ws).await;
                    if r.is_ok() { self.flush_sends(ws).await.and(self.repull_stale(ws).await) } else { r }
                }
                _ = ping_tick.tick() => ws.send(&json!({"type": "ping"})).await,
            };
            if step.is_err() {
                return SessionEnd::Lost;
            }
        }
    }

    /// Sends what was never sent on this connection, or not acknowledged in time.
    async fn flush_sends(&mut self, ws: &mut WsConn) -> Result<(), ClientError> {
        let now = Instant::now();
        for (_, (_, p)) in self.sends.iter_mut() {
            if p.sent_at
                .is_none_or(|t| now.duration_since(t) >= self.cfg.send_retry)
            {
                ws.send(&p.frame).await?;
                p.sent_at = Some(now);
            }
        }
        Ok(())
    }

    async fn sync(&mut self, ws: &mut WsConn) -> Result<(), ClientError> {
        let req = self.req();
        let mut frame = json!({"type": "sync", "req": req});
        if let Some(us) = self.inbox {
            frame["user_seq"] = json!(us);
        }
        let convs: serde_json::Map<String, Value> = self
            .chains
            .iter()
            .map(|(k, c)| (k.clone(), json!(c.shown)))
            .collect();
        frame["conversations"] = Value::Object(convs);
        self.sync_in_flight = Some((req, Instant::now()));
        ws.send(&frame).await
    }

    async fn pull(
        &mut self,
        ws: &mut WsConn,
        of: PullOf,
        from: u64,
        to: Option<u64>,
    ) -> Result<(), ClientError> {
        let req = self.req();
        let mut frame = match &of {
            PullOf::Inbox => {
                self.inbox_pull_in_flight = Some(Instant::now());
                json!({"type": "pull", "req": req, "chain": "user", "from": from, "limit": PAGE})
            }
            PullOf::Conversation(c) => {
                self.chains.entry(c.clone()).or_default().pull_in_flight = Some(Instant::now());
                json!({"type": "pull", "req": req, "chain": "conversation", "conversation_id": c, "from": from, "limit": PAGE})
            }
        };
        if let Some(to) = to {
            frame["to"] = json!(to);
        }
        self.pulls.insert(req, of);
        ws.send(&frame).await
    }

    /// Asks again for pulls that were not answered in time (a dropped frame).
    async fn repull_stale(&mut self, ws: &mut WsConn) -> Result<(), ClientError> {
        let timeout = self.cfg.pull_timeout;
        if self
            .sync_in_flight
            .is_some_and(|(_, t)| t.elapsed() > timeout)
        {
            self.sync(ws).await?;
        }
        if self
            .inbox_pull_in_flight
            .is_some_and(|t| t.elapsed() > timeout)
        {
            self.inbox_pull_in_flight = None;
            self.fill_inbox_hole(ws, None).await?;
        }
        let stale: Vec<String> = self
            .chains
            .iter()
            .filter(|(_, c)| c.pull_in_flight.is_some_and(|t| t.elapsed() > timeout))
            .map(|(k, _)| k.clone())
            .collect();
        for c in stale {
            if let Some(ch) = self.chains.get_mut(&c) {
                ch.pull_in_flight = None;
            }
            self.fill_conv_hole(ws, &c, None).await?;
        }
        Ok(())
    }

    async fn send_acks(&mut self, ws: &mut WsConn) -> Result<(), ClientError> {
        if self.inbox_ack_due {
            if let Some(us) = self.inbox {
                ws.send(&json!({"type": "ack", "user_seq": us})).await?;
            }
            self.inbox_ack_due = false;
        }
        let due: Vec<(String, u64)> = self
            .chains
            .iter()
            .filter(|(_, c)| c.ack_due)
            .map(|(k, c)| (k.clone(), c.shown))
            .collect();
        for (conv, seq) in due {
            ws.send(&json!({"type": "ack", "conversation_id": conv, "seq": seq}))
                .await?;
            if let Some(c) = self.chains.get_mut(&conv) {
                c.ack_due = false;
            }
        }
        Ok(())
    }

    /// Handles one frame; false when the session must end for good (kicked).
    async fn on_frame(&mut self, ws: &mut WsConn, f: Value) -> Result<bool, ClientError> {
        match f["type"].as_str().unwrap_or("") {
            "msg" => {
                let Ok(message) = serde_json::from_value::<Message>(f["message"].clone()) else {
                    return Ok(true);
                };
                match f.get("user_seq").and_then(Value::as_u64) {
                    Some(us) => self.on_inbox(ws, us, message).await?,
                    None => {
                        let conv = message.conversation_id.clone();
                        self.follow(&conv);
                        self.on_conv(ws, message).await?;
                    }
                }
            }
            "send_ack" => {
                if let Some(req) = f["req"].as_i64()
                    && let Some((id, p)) = self.sends.remove(&req)
                {
                    self.send_ids.remove(&id);
                    let ack = serde_json::from_value::<SendAck>(f.clone())
                        .map_err(|e| ClientError::Decode(e.to_string()));
                    let _ = p.reply.send(ack);
                }
            }
            "sync_result" => {
                if self
                    .sync_in_flight
                    .is_some_and(|(req, _)| f["req"].as_i64() == Some(req))
                {
                    self.sync_in_flight = None;
                    self.on_sync(ws, &f).await?;
                }
            }
            "pull_result" => self.on_pull(ws, &f).await?,
            "error" => {
                let req = f["req"].as_i64();
                let body: Option<ErrorBody> = serde_json::from_value(f.clone()).ok();
                let retryable = matches!(
                    f["code"].as_str(),
                    Some("unavailable" | "rate_limited" | "internal")
                );
                if let (Some(req), Some(body)) = (req, body) {
                    if !retryable && let Some((id, p)) = self.sends.remove(&req) {
                        self.send_ids.remove(&id);
                        let _ = p.reply.send(Err(ClientError::Api {
                            status: body.code.http_status(),
                            body,
                        }));
                    }
                    if let Some(of) = self.pulls.remove(&req) {
                        match of {
                            PullOf::Inbox => self.inbox_pull_in_flight = None,
                            PullOf::Conversation(c) => {
                                // Not (or no longer) a member: stop following it.
                                self.chains.remove(&c);
                            }
                        }
                    }
                }
            }
            "receipt" => self.emit(Event::Receipt {
                conversation_id: f["conversation_id"].as_str().unwrap_or_default().to_owned(),
                user_id: f["user_id"].as_u64().unwrap_or_default(),
                last_read_seq: f["last_read_seq"].as_u64().unwrap_or_default(),
            }),
            "typing" => self.emit(Event::Typing {
                conversation_id: f["conversation_id"].as_str().unwrap_or_default().to_owned(),
                user_id: f["user_id"].as_u64().unwrap_or_default(),
            }),
            "kicked" => {
                self.emit(Event::Kicked {
                    reason: f["reason"].as_str().unwrap_or_default().to_owned(),
                });
                return Ok(false);
            }
            "pong" | "hello" => {}
            _ => self.emit(Event::Other(f)),
        }
        Ok(true)
    }

    fn follow(&mut self, conv: &str) {
        if !self.chains.contains_key(conv) {
            let shown = self.inbox_shown.get(conv).copied().unwrap_or(0);
            self.chains.insert(
                conv.to_owned(),
                ConvChain {
                    shown,
                    ..ConvChain::default()
                },
            );
        }
    }

    async fn on_sync(&mut self, ws: &mut WsConn, f: &Value) -> Result<(), ClientError> {
        let head = f["user_seq"].as_u64().unwrap_or(0);
        self.inbox_target = self.inbox_target.max(head);
        // A device that holds nothing yet reads a group's chain from its start: the part
        // before the group used read fan-out is in its inbox too, and reading the chain whole
        // keeps the order (the inbox copies are then duplicates).
        let fresh = self.inbox.is_none() && f["cursor"].as_u64().unwrap_or(0) == 0;
        if self.inbox.is_none() {
            self.inbox = Some(f["cursor"].as_u64().unwrap_or(0));
        }
        for c in f["conversations"].as_array().cloned().unwrap_or_default() {
            let Some(id) = c["conversation_id"].as_str() else {
                continue;
            };
            let cursor = if fresh {
                0
            } else {
                c["cursor"].as_u64().unwrap_or(0)
            };
            let newest = c["seq"].as_u64().unwrap_or(0);
            let shown = cursor.max(self.inbox_shown.get(id).copied().unwrap_or(0));
            let chain = self
                .chains
                .entry(id.to_owned())
                .or_insert_with(|| ConvChain {
                    shown,
                    ..ConvChain::default()
                });
            if newest > chain.shown {
                self.fill_conv_hole(ws, id, Some(newest)).await?;
            }
        }
        // Pushes that came before this answer were kept aside: take them in order now.
        let early = std::mem::take(&mut self.inbox_buffer);
        for (us, m) in early {
            self.on_inbox(ws, us, m).await?;
        }
        if head > self.inbox.unwrap_or(0) {
            self.fill_inbox_hole(ws, Some(head)).await?;
        }
        Ok(())
    }

    async fn on_pull(&mut self, ws: &mut WsConn, f: &Value) -> Result<(), ClientError> {
        let Some(of) = f["req"].as_i64().and_then(|r| self.pulls.remove(&r)) else {
            return Ok(());
        };
        let items = f["items"].as_array().cloned().unwrap_or_default();
        match of {
            PullOf::Inbox => {
                self.inbox_pull_in_flight = None;
                for it in items {
                    let (Some(us), Ok(m)) = (
                        it["seq"].as_u64(),
                        serde_json::from_value::<Message>(it["message"].clone()),
                    ) else {
                        continue;
                    };
                    self.on_inbox(ws, us, m).await?;
                }
                if f["has_more"] == true
                    || !self.inbox_buffer.is_empty()
                    || self.inbox.unwrap_or(0) < self.inbox_target
                {
                    let to = if self.inbox_buffer.is_empty() {
                        Some(self.inbox_target)
                    } else {
                        None
                    };
                    self.fill_inbox_hole(ws, to).await?;
                }
            }
            PullOf::Conversation(c) => {
                if let Some(ch) = self.chains.get_mut(&c) {
                    ch.pull_in_flight = None;
                }
                for it in items {
                    let Ok(m) = serde_json::from_value::<Message>(it["message"].clone()) else {
                        continue;
                    };
                    self.on_conv(ws, m).await?;
                }
                let more = f["has_more"] == true
                    || self.chains.get(&c).is_some_and(|ch| !ch.buffer.is_empty());
                if more {
                    self.fill_conv_hole(ws, &c, None).await?;
                }
            }
        }
        Ok(())
    }

    /// Pulls the inbox from `local_seq + 1` (to `to`, or the first buffered entry).
    async fn fill_inbox_hole(
        &mut self,
        ws: &mut WsConn,
        to: Option<u64>,
    ) -> Result<(), ClientError> {
        if self.inbox_pull_in_flight.is_some() {
            return Ok(());
        }
        let from = self.inbox.unwrap_or(0) + 1;
        let to = to.or_else(|| self.inbox_buffer.keys().next().map(|k| k - 1));
        if to.is_some_and(|t| t < from) {
            return Ok(());
        }
        self.pull(ws, PullOf::Inbox, from, to).await
    }

    async fn fill_conv_hole(
        &mut self,
        ws: &mut WsConn,
        conv: &str,
        to: Option<u64>,
    ) -> Result<(), ClientError> {
        let Some(ch) = self.chains.get(conv) else {
            return Ok(());
        };
        if ch.pull_in_flight.is_some() {
            return Ok(());
        }
        let from = ch.shown + 1;
        let to = to.or_else(|| ch.buffer.keys().next().map(|k| k - 1));
        if to.is_some_and(|t| t < from) {
            return Ok(());
        }
        self.pull(ws, PullOf::Conversation(conv.to_owned()), from, to)
            .await
    }

    /// A message at `user_seq` of the inbox chain.
    async fn on_inbox(
        &mut self,
        ws: &mut WsConn,
        user_seq: u64,
        message: Message,
    ) -> Result<(), ClientError> {
        self.inbox_target = self.inbox_target.max(user_seq);
        let Some(local) = self.inbox else {
            // Before the first sync answers, keep it: sync says where this device stands.
            if self.inbox_buffer.len() < MAX_BUFFER {
                self.inbox_buffer.insert(user_seq, message);
            }
            return Ok(());
        };
        if user_seq <= local {
            return Ok(());
        }
        if user_seq > local + 1 {
            if self.inbox_buffer.len() < MAX_BUFFER {
                self.inbox_buffer.insert(user_seq, message);
            }
            return self.fill_inbox_hole(ws, None).await;
        }
        self.inbox = Some(user_seq);
        self.inbox_ack_due = true;
        self.show_from_inbox(ws, message).await?;
        // Drain what the hole was holding back.
        while let Some(entry) = self.inbox_buffer.first_entry() {
            let next = self.inbox.unwrap_or(0) + 1;
            if *entry.key() < next {
                entry.remove();
                continue;
            }
            if *entry.key() != next {
                break;
            }
            let m = entry.remove();
            self.inbox = Some(next);
            self.show_from_inbox(ws, m).await?;
        }
        Ok(())
    }

    async fn show_from_inbox(&mut self, ws: &mut WsConn, m: Message) -> Result<(), ClientError> {
        if self.chains.contains_key(&m.conversation_id) {
            // A group followed by its seq: its order rules, whichever chain brought it.
            return self.on_conv(ws, m).await;
        }
        let shown = self
            .inbox_shown
            .entry(m.conversation_id.clone())
            .or_insert(0);
        if m.seq > *shown {
            *shown = m.seq;
            self.emit(Event::Message(Box::new(m)));
        }
        Ok(())
    }

    /// A message of a conversation followed by its own seq.
    async fn on_conv(&mut self, ws: &mut WsConn, m: Message) -> Result<(), ClientError> {
        let conv = m.conversation_id.clone();
        let Some(ch) = self.chains.get_mut(&conv) else {
            return Ok(());
        };
        if m.seq <= ch.shown {
            return Ok(());
        }
        if m.seq > ch.shown + 1 {
            if ch.buffer.len() < MAX_BUFFER {
                ch.buffer.insert(m.seq, m);
            }
            return self.fill_conv_hole(ws, &conv, None).await;
        }
        ch.shown = m.seq;
        ch.ack_due = true;
        let mut ready = vec![m];
        while let Some(entry) = ch.buffer.first_entry() {
            if *entry.key() <= ch.shown {
                entry.remove();
                continue;
            }
            if *entry.key() != ch.shown + 1 {
                break;
            }
            ch.shown += 1;
            ready.push(entry.remove());
        }
        let shown = ch.shown;
        self.inbox_shown.insert(conv, shown);
        for m in ready {
            self.emit(Event::Message(Box::new(m)));
        }
        Ok(())
    }
}

enum SessionEnd {
    Stop,
    Lost,
    Kicked,
}

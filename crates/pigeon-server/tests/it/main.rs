//! Black-box tests of the server through the real protocol: each test starts a server on
//! port 0 with its own data directory and talks to it with real HTTP and WebSocket clients.
//! One test binary (one module per feature) keeps link time down.

mod basics;
mod concurrency;
mod contract;
mod contract_edges;
mod delivery;
mod errors;
mod groups;
mod history;
mod large_groups;
mod message_ops;
mod offline_hook;
mod openapi;
mod protobuf;
mod proxy;
mod reads;
mod rooms;
mod sdk;
mod store_failure;
mod wire_rules;

use pigeon_client::{Http, WsConn};
use pigeon_server::{Config, Running};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub const WAIT: Duration = Duration::from_secs(10);
pub const ADMIN_KEY: &str = "test-admin-key-0123456789";

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "pigeon-it-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Default for TempDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct TestServer {
    pub running: Option<Running>,
    pub base: String,
    pub ws_base: String,
    pub admin: Http,
    pub dir: std::sync::Arc<TempDir>,
    pub cfg: Config,
}

pub fn test_config(dir: &TempDir) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.0.clone(),
        admin_key: Some(ADMIN_KEY.into()),
        // Tests send in bursts; the rate limit has its own test.
        send_rate_per_sec: 0,
        ..Config::default()
    }
}

pub async fn spawn_server() -> TestServer {
    spawn_with(|_| {}).await
}

pub async fn spawn_with(tweak: impl FnOnce(&mut Config)) -> TestServer {
    let dir = std::sync::Arc::new(TempDir::new());
    let mut cfg = test_config(&dir);
    tweak(&mut cfg);
    start_on(cfg, dir).await
}

pub async fn start_on(cfg: Config, dir: std::sync::Arc<TempDir>) -> TestServer {
    let running = pigeon_server::start(cfg.clone())
        .await
        .expect("server starts");
    serving(running, cfg, dir)
}

/// The test server of a server started already.
pub fn serving(running: Running, cfg: Config, dir: std::sync::Arc<TempDir>) -> TestServer {
    let base = format!("http://{}", running.addr);
    let ws_base = format!("ws://{}", running.addr);
    let admin = Http::new(base.clone()).with_bearer(ADMIN_KEY);
    TestServer {
        running: Some(running),
        base,
        ws_base,
        admin,
        dir,
        cfg,
    }
}

impl TestServer {
    /// Registers `id` and answers an HTTP client acting as them.
    pub async fn user(&self, id: u64) -> Http {
        let token = self.token(id).await;
        Http::new(self.base.clone()).with_bearer(token)
    }

    /// Registers `id` (if needed) and mints a token.
    pub async fn token(&self, id: u64) -> String {
        self.admin
            .upsert_user(id, &format!("user{id}"))
            .await
            .expect("register user");
        self.admin.mint_token(id, 3600).await.expect("mint token")
    }

    pub async fn ws(&self, token: &str, device: &str) -> WsConn {
        WsConn::connect(&self.ws_base, token, device)
            .await
            .expect("websocket connects")
    }

    pub fn anon(&self) -> Http {
        Http::new(self.base.clone())
    }

    /// Stops the server gracefully and starts it again on the same data directory, on a new
    /// port (the old one, once free, may go to another test's server meanwhile): clients
    /// made before the restart must be made again.
    pub async fn restart(mut self) -> TestServer {
        let cfg = self.cfg.clone();
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
        start_on(cfg, self.dir.clone()).await
    }
}

/// Sends `n` texts from `h`'s user to `to` over HTTP, one after another (client_msg_ids
/// `{prefix}0`, `{prefix}1`, ...).
pub async fn post_texts(h: &Http, prefix: &str, to: u64, n: usize, content: &str) {
    for i in 0..n {
        h.post(
            "/v1/messages",
            &text_to_user(&format!("{prefix}{i}"), to, content),
        )
        .await
        .unwrap();
    }
}

/// A text send body.
pub fn text_to_user(cmid: &str, to: u64, content: &str) -> Value {
    json!({"client_msg_id": cmid, "to": {"user": to}, "kind": "text", "content": content})
}

pub fn text_to_conv(cmid: &str, conv: &str, content: &str) -> Value {
    json!({"client_msg_id": cmid, "to": {"conversation": conv}, "kind": "text", "content": content})
}

/// Sends a frame and waits for the frame answering its `req`.
pub async fn request(ws: &mut WsConn, mut frame: Value, req: i64) -> Value {
    frame["req"] = json!(req);
    ws.send(&frame).await.expect("send frame");
    ws.recv_until(WAIT, |v| v["req"] == json!(req))
        .await
        .expect("recv")
        .unwrap_or_else(|| panic!("no reply to req {req}"))
}

/// `n` sends to `to` with reqs from `first_req` on, as frames for `WsConn::send_burst`.
pub fn sends_to_user(prefix: &str, to: u64, n: i64, first_req: i64) -> Vec<String> {
    (0..n)
        .map(|i| {
            let mut send = send_frame(text_to_user(&format!("{prefix}-{i}"), to, "x"));
            send["req"] = json!(first_req + i);
            send.to_string()
        })
        .collect()
}

/// Reads frames until the one answering `req` (an error frame fails the test); returns it
/// and how many `send_ack`s came before it.
pub async fn acks_before(ws: &mut WsConn, req: i64) -> (i64, Value) {
    let mut acked = 0;
    loop {
        let f = ws
            .recv(Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("closed or silent: {:?}", ws.closed_with));
        assert_ne!(f["type"], "error", "{f}");
        if f["type"] == "send_ack" {
            acked += 1;
        } else if f["req"] == req {
            return (acked, f);
        }
    }
}

/// Waits for the next `msg` push.
pub async fn next_msg(ws: &mut WsConn) -> Value {
    ws.recv_until(WAIT, |v| v["type"] == "msg")
        .await
        .expect("recv")
        .expect("a msg push")
}

/// The protocol error code of a failed HTTP call.
pub fn code_of<T: std::fmt::Debug>(r: Result<T, pigeon_client::ClientError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.code().unwrap_or("no code").to_owned(),
    }
}

/// Calls `method path` as `h`; answers the HTTP status with the body's `code`, so a test
/// pins both halves of a row of the error table at once.
pub async fn status_and_code(
    h: &Http,
    method: reqwest::Method,
    path: &str,
    body: Option<&Value>,
) -> (u16, String) {
    let (status, body) = h.raw(method, path, body).await.expect("an answer");
    assert!(body["message"].is_string(), "{status}: {body}");
    (
        status,
        body["code"].as_str().unwrap_or("no code").to_owned(),
    )
}

/// The `send` frame carrying an HTTP send body.
pub fn send_frame(mut body: Value) -> Value {
    body["type"] = json!("send");
    body
}

/// Creates a group named "team" owned by `owner`; answers its conversation id.
pub async fn new_group(owner: &Http, members: &[u64]) -> String {
    new_group_named(owner, "team", members).await
}

/// Creates a group called `name` owned by `owner` with `members` (the owner not among
/// them); answers its conversation id.
pub async fn new_group_named(owner: &Http, name: &str, members: &[u64]) -> String {
    let g = owner
        .post("/v1/groups", &json!({"name": name, "members": members}))
        .await
        .expect("group created");
    g["conversation_id"].as_str().unwrap().to_owned()
}

/// `h` invites `users` into the group `conv`; answers the call's outcome (on success, the
/// group's conversation view) so callers can assert either way.
pub async fn invite(
    h: &Http,
    conv: &str,
    users: &[u64],
) -> Result<Value, pigeon_client::ClientError> {
    h.post(
        &format!("/v1/groups/{conv}/members"),
        &json!({"user_ids": users}),
    )
    .await
}

/// One page of `h`'s history of `conv`, as the server answers it (`messages`, `has_more`).
/// `query` is empty or starts with `?`, e.g. `"?limit=100"`.
pub async fn history_page(h: &Http, conv: &str, query: &str) -> Value {
    h.get(&format!("/v1/conversations/{conv}/messages{query}"))
        .await
        .expect("history")
}

/// The messages of one page of `h`'s history of `conv` (see [`history_page`]).
pub async fn history_msgs(h: &Http, conv: &str, query: &str) -> Vec<Value> {
    history_page(h, conv, query).await["messages"]
        .as_array()
        .unwrap()
        .clone()
}

/// The seqs of one page of `h`'s history of `conv`, in page order (see [`history_page`]).
pub async fn history_seqs(h: &Http, conv: &str, query: &str) -> Vec<u64> {
    page_seqs(&history_page(h, conv, query).await)
}

/// The seqs of a history page's `messages`, in page order.
pub fn page_seqs(page: &Value) -> Vec<u64> {
    seqs_of(&page["messages"])
}

/// The seqs of a pull result's `items`, in order (the pulled chain's seqs).
pub fn item_seqs(pulled: &Value) -> Vec<u64> {
    seqs_of(&pulled["items"])
}

/// The `seq` of every element of a JSON array; panics if it is not an array of seq'd objects.
fn seqs_of(list: &Value) -> Vec<u64> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|m| m["seq"].as_u64().unwrap())
        .collect()
}

/// The conversation's newest seq as `h` sees it.
pub async fn newest_seq(h: &Http, conv: &str) -> u64 {
    h.get(&format!("/v1/conversations/{conv}"))
        .await
        .expect("conversation")["seq"]
        .as_u64()
        .unwrap()
}

/// The message at `seq` in `h`'s view of the history.
pub async fn at_seq(h: &Http, conv: &str, seq: u64) -> Value {
    let page = h
        .get(&format!(
            "/v1/conversations/{conv}/messages/range?from={seq}&to={seq}"
        ))
        .await
        .expect("range");
    let msgs = page["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 1, "one message at seq {seq}: {page}");
    msgs[0].clone()
}

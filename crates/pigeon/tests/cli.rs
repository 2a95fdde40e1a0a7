//! Tests of the `pigeon` binary as a process: zero-configuration start, settings from flags,
//! environment and file, graceful shutdown, and crash safety under SIGKILL.

use pigeon_client::{Http, WsConn};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const KEY: &str = "cli-test-admin-key-0123456789";

fn temp_dir(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("pigeon-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

struct Proc {
    child: Child,
    base: String,
    /// What the server printed before its "listening on" line.
    early_lines: Vec<String>,
    /// The port it bound (the tests ask for port 0: a port chosen by the test could be
    /// taken by another test's server before this one binds it).
    port: u16,
}

/// Starts `pigeon serve` in `dir` (on `127.0.0.1:0` unless `extra` or `env` set the address)
/// and waits until it prints the address it bound and answers `/readyz` there.
async fn start(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    // `PIGEON_TEST_BIN` runs these tests against another build (an older one, to compare).
    let bin = std::env::var_os("PIGEON_TEST_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_pigeon")),
        PathBuf::from,
    );
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .args(extra)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    cmd.env_remove("PIGEON_ADMIN_KEY")
        .env_remove("PIGEON_LISTEN")
        .env_remove("PIGEON_CONFIG");
    if !extra.contains(&"--listen") && !env.iter().any(|(k, _)| *k == "PIGEON_LISTEN") {
        cmd.arg("--listen").arg("127.0.0.1:0");
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("pigeon starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut early_lines = Vec::new();
    let mut addr = None;
    while let Ok(Ok(Some(line))) =
        tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await
    {
        if let Some(a) = line.strip_prefix("pigeon: listening on http://") {
            addr = a.parse::<std::net::SocketAddr>().ok();
            break;
        }
        early_lines.push(line);
    }
    let addr = addr.unwrap_or_else(|| {
        panic!(
            "no listening line; printed {early_lines:?}, exit status {:?}",
            child.try_wait().ok().flatten()
        )
    });
    // Keep draining stdout so the server never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let base = format!("http://{addr}");
    let http = Http::new(base.clone());
    for _ in 0..200 {
        if let Ok((200, _)) = http.raw(reqwest::Method::GET, "/readyz", None).await {
            return Proc {
                child,
                base,
                early_lines,
                port: addr.port(),
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("server did not become ready at {base}");
}

#[tokio::test]
async fn serve_with_no_configuration_generates_and_keeps_an_admin_key() {
    let dir = temp_dir("zero");
    let mut p = start(&dir, &[], &[]).await;
    let key = p
        .early_lines
        .iter()
        .find_map(|l| l.strip_prefix("pigeon: admin key: "))
        .expect("the generated admin key is printed")
        .to_owned();
    assert!(
        dir.join("data").join("pigeon.db").exists(),
        "the store lives under ./data"
    );
    let admin = Http::new(p.base.clone()).with_bearer(key.clone());
    admin
        .upsert_user(1, "a")
        .await
        .expect("the printed key is the admin key");
    p.child.kill().await.unwrap();
    // The second start keeps the same key and does not print a new one.
    let p2 = start(&dir, &[], &[]).await;
    assert!(
        !p2.early_lines.iter().any(|l| l.contains("admin key")),
        "no new key is printed: {:?}",
        p2.early_lines
    );
    let admin = Http::new(p2.base.clone()).with_bearer(key);
    admin
        .upsert_user(2, "b")
        .await
        .expect("the key survives a restart");
}

#[tokio::test]
async fn settings_come_from_the_environment_over_the_file() {
    let dir = temp_dir("cfg");
    std::fs::write(
        dir.join("p.toml"),
        format!("admin-key = \"{KEY}\"\nrecall-window-secs = 1\nlisten = \"127.0.0.1:1\"\n"),
    )
    .unwrap();
    // The file says port 1; the environment (port 0: any) wins; the admin key comes from
    // the file.
    let p = start(
        &dir,
        &["--config", "p.toml"],
        &[
            ("PIGEON_LISTEN", "127.0.0.1:0"),
            ("PIGEON_MAX_CONTENT_BYTES", "10"),
        ],
    )
    .await;
    assert_ne!(p.port, 1, "the environment's address wins over the file's");
    let admin = Http::new(p.base.clone()).with_bearer(KEY);
    admin.upsert_user(1, "a").await.unwrap();
    admin.upsert_user(2, "b").await.unwrap();
    let user = Http::new(p.base.clone()).with_bearer(admin.mint_token(1, 60).await.unwrap());
    let err = user
        .post("/v1/messages", &json!({"client_msg_id": "x", "to": {"user": 2}, "kind": "text", "content": "more than ten bytes"}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("payload_too_large"));
    // The file's `recall-window-secs = 1` holds too (the default is 120 s).
    let ack = user
        .post(
            "/v1/messages",
            &json!({"client_msg_id": "y", "to": {"user": 2}, "kind": "text", "content": "short"}),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let msg_id = ack["msg_id"].as_str().unwrap();
    assert_eq!(
        late_change(
            &user,
            reqwest::Method::POST,
            &format!("/v1/messages/{msg_id}/recall"),
            None
        )
        .await,
        (409, "window_expired".to_owned()),
        "recall-window-secs from the file"
    );
}

/// The status and error code of a recall or edit (`method path body`) as `h`.
async fn late_change(
    h: &Http,
    method: reqwest::Method,
    path: &str,
    body: Option<&Value>,
) -> (u16, String) {
    let (status, body) = h.raw(method, path, body).await.unwrap();
    (
        status,
        body["code"].as_str().unwrap_or("no code").to_owned(),
    )
}

#[tokio::test]
async fn bad_settings_fail_loudly() {
    let dir = temp_dir("bad");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args(["serve", "--admin-key", "", "--listen", "127.0.0.1:0"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin-key"));
}

#[tokio::test]
async fn sigterm_closes_connections_with_a_close_frame_and_exits_cleanly() {
    let dir = temp_dir("term");
    let mut p = start(&dir, &["--admin-key", KEY], &[]).await;
    let admin = Http::new(p.base.clone()).with_bearer(KEY);
    admin.upsert_user(1, "a").await.unwrap();
    let token = admin.mint_token(1, 60).await.unwrap();
    let mut ws = WsConn::connect(&p.base.replace("http", "ws"), &token, "d")
        .await
        .unwrap();
    let pid = p.child.id().unwrap();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert_eq!(ws.closed(Duration::from_secs(10)).await, Some(1001));
    let status = tokio::time::timeout(Duration::from_secs(15), p.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "clean exit: {status:?}");
}

/// Sends as fast as acks allow until killed; returns every ack received.
async fn send_until_killed(
    ws_base: String,
    token: String,
    me: u64,
    peers: Vec<u64>,
    group: String,
) -> Vec<Value> {
    let Ok(mut ws) = WsConn::connect(&ws_base, &token, "load").await else {
        return Vec::new();
    };
    let mut acks = Vec::new();
    let mut n = 0u64;
    loop {
        // A window of 16 sends in flight.
        for _ in 0..16 {
            n += 1;
            let to = if n.is_multiple_of(3) {
                json!({"conversation": group})
            } else {
                json!({"user": peers[(n as usize) % peers.len()]})
            };
            let f = json!({"type": "send", "client_msg_id": format!("c{me}-{n:06}"), "to": to, "kind": "text", "content": format!("{n}")});
            if ws.send(&f).await.is_err() {
                return acks;
            }
        }
        let mut got = 0;
        while got < 16 {
            match ws.recv(Duration::from_secs(5)).await {
                Ok(Some(v)) if v["type"] == "send_ack" => {
                    acks.push(v);
                    got += 1;
                }
                Ok(Some(_)) => {}
                _ => return acks,
            }
        }
    }
}

#[tokio::test]
async fn sigkill_during_a_send_load_loses_no_acknowledged_message() {
    let dir = temp_dir("kill");
    let users: Vec<u64> = (1..=4).collect();
    let mut p = start(&dir, &["--admin-key", KEY], &[]).await;
    let admin = Http::new(p.base.clone()).with_bearer(KEY);
    let mut tokens = HashMap::new();
    for u in &users {
        admin.upsert_user(*u, "u").await.unwrap();
        tokens.insert(*u, admin.mint_token(*u, 3600).await.unwrap());
    }
    let owner = Http::new(p.base.clone()).with_bearer(tokens[&1].clone());
    let group = owner
        .post("/v1/groups", &json!({"name": "g", "members": [2, 3, 4]}))
        .await
        .unwrap()["conversation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ws_base = p.base.replace("http", "ws");
    let mut tasks = Vec::new();
    for u in &users {
        let peers: Vec<u64> = users.iter().copied().filter(|x| x != u).collect();
        tasks.push(tokio::spawn(send_until_killed(
            ws_base.clone(),
            tokens[u].clone(),
            *u,
            peers,
            group.clone(),
        )));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    p.child.kill().await.unwrap(); // SIGKILL
    let mut acks = Vec::new();
    for t in tasks {
        acks.extend(t.await.unwrap());
    }
    assert!(
        acks.len() > 50,
        "the load ran before the kill ({} acks)",
        acks.len()
    );

    // The restarted server binds another port.
    let p = start(&dir, &["--admin-key", KEY], &[]).await;
    let ws_base = p.base.replace("http", "ws");
    let reader_of = |conv: &str| -> u64 {
        match conv.split_once('-') {
            Some((a, _)) => a.parse().unwrap(),
            None => 1,
        }
    };
    // Read every chain back whole.
    let mut chains: HashMap<String, Vec<Value>> = HashMap::new();
    let mut convs: Vec<String> = acks
        .iter()
        .map(|a| a["conversation_id"].as_str().unwrap().to_owned())
        .collect();
    convs.sort();
    convs.dedup();
    for conv in &convs {
        let h = Http::new(p.base.clone()).with_bearer(tokens[&reader_of(conv)].clone());
        let all = h.whole_history(conv).await.unwrap();
        for (i, m) in all.iter().enumerate() {
            assert_eq!(
                m["seq"].as_u64().unwrap(),
                i as u64 + 1,
                "{conv} is gap-free after the crash"
            );
        }
        chains.insert(conv.clone(), all);
    }
    for a in &acks {
        let conv = a["conversation_id"].as_str().unwrap();
        let seq = a["seq"].as_u64().unwrap() as usize;
        let m = &chains[conv][seq - 1];
        assert_eq!(
            m["msg_id"], a["msg_id"],
            "acknowledged message {a} is where its ack said"
        );
        assert_eq!(m["client_msg_id"], a["client_msg_id"]);
    }
    // New sends continue at the next seq, and every inbox is still gap-free.
    for conv in &convs {
        let h = Http::new(p.base.clone()).with_bearer(tokens[&reader_of(conv)].clone());
        let ack = h
            .post("/v1/messages", &json!({"client_msg_id": format!("after-{conv}"), "to": {"conversation": conv}, "kind": "text", "content": "after"}))
            .await
            .unwrap();
        assert_eq!(ack["seq"].as_u64().unwrap(), chains[conv].len() as u64 + 1);
    }
    for u in &users {
        let mut ws = WsConn::connect(&ws_base, &tokens[u], "check")
            .await
            .unwrap();
        let head = ws.hello["user_seq"].as_u64().unwrap();
        let mut from = 1;
        let mut req = 0;
        while from <= head {
            req += 1;
            ws.send(
                &json!({"type": "pull", "req": req, "chain": "user", "from": from, "limit": 200}),
            )
            .await
            .unwrap();
            let r = ws
                .recv_until(Duration::from_secs(10), |v| v["req"] == req)
                .await
                .unwrap()
                .unwrap();
            let items = r["items"].as_array().unwrap();
            assert!(!items.is_empty());
            for (i, it) in items.iter().enumerate() {
                assert_eq!(
                    it["seq"].as_u64().unwrap(),
                    from + i as u64,
                    "inbox of {u} is gap-free"
                );
            }
            from += items.len() as u64;
        }
        assert_eq!(from, head + 1);
    }
}

fn chat(base: &str, user: u64, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args([
            "chat",
            "--server",
            base,
            "--user",
            &user.to_string(),
            "--admin-key",
            KEY,
        ])
        .args(extra)
        .env_remove("PIGEON_TOKEN")
        .output()
        .unwrap()
}

#[tokio::test]
async fn pigeon_chat_one_shot_commands_exchange_messages() {
    let dir = temp_dir("chat");
    let p = start(&dir, &["--admin-key", KEY], &[]).await;
    // With the admin key (dev mode), --user is registered on first use.
    assert!(chat(&p.base, 22, &["--list"]).status.success());
    let out = chat(&p.base, 11, &["--send", "22", "hello from 11"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = chat(&p.base, 22, &["--send", "11", "hi 11"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("11-22"));
    let out = chat(&p.base, 11, &["--list"]);
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(list.contains("11-22") && list.contains("unread"), "{list}");
    let out = chat(&p.base, 11, &["--history", "22", "--json"]);
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let contents: Vec<&str> = lines
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, vec!["hello from 11", "hi 11"]);
    let out = chat(&p.base, 11, &["--recall-last", "22"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = chat(&p.base, 22, &["--history", "11"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("(recalled)"));
    let out = chat(&p.base, 22, &["--send", "11", ""]);
    assert!(!out.status.success(), "an empty message is refused");
}

#[tokio::test]
async fn pigeon_chat_line_mode_sends_and_receives_live() {
    let dir = temp_dir("chatlive");
    let p = start(&dir, &["--admin-key", KEY], &[]).await;
    let admin = Http::new(p.base.clone()).with_bearer(KEY);
    admin.upsert_user(5, "five").await.unwrap();
    admin.upsert_user(6, "six").await.unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args([
            "chat",
            "--server",
            &p.base,
            "--user",
            "6",
            "--admin-key",
            KEY,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    use tokio::io::AsyncWriteExt;
    stdin.write_all(b"/open 5\n").await.unwrap();
    // Give the client a moment to connect, then user 5 writes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let five = Http::new(p.base.clone()).with_bearer(admin.mint_token(5, 60).await.unwrap());
    five.post("/v1/messages", &json!({"client_msg_id": "live-1", "to": {"user": 6}, "kind": "text", "content": "ping from five"})).await.unwrap();
    let mut seen = false;
    while let Ok(Ok(Some(line))) =
        tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await
    {
        if line.contains("ping from five") {
            seen = true;
            break;
        }
    }
    assert!(seen, "the live message is printed");
    stdin.write_all(b"pong from six\n/read\n").await.unwrap();
    let mut acked = false;
    while let Ok(Ok(Some(line))) =
        tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await
    {
        if line.contains("read 5-6 up to") {
            acked = true;
            break;
        }
    }
    assert!(acked, "sent and marked read");
    let page = five.get("/v1/conversations/5-6/messages").await.unwrap();
    assert_eq!(page["messages"][1]["content"], "pong from six");
    stdin.write_all(b"/quit\n").await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
}

/// `--listen` takes a host name and port (`localhost:0`) as well as an IP address: the
/// server starts, prints the address it bound, and answers there.
#[tokio::test]
async fn listen_takes_a_host_name_and_port() {
    let dir = temp_dir("hostname");
    let mut p = start(&dir, &["--admin-key", KEY, "--listen", "localhost:0"], &[]).await;
    assert_ne!(p.port, 0);
    assert!(p.base.starts_with("http://127.0.0.1:") || p.base.starts_with("http://[::1]:"));
    let (status, _) = Http::new(p.base.clone())
        .raw(reqwest::Method::GET, "/healthz", None)
        .await
        .unwrap();
    assert_eq!(status, 200);
    p.child.kill().await.unwrap();
}

/// PROTOCOL.md 2: "flags win over the environment, which wins over the file".
/// `settings_come_from_the_environment_over_the_file` pins the environment over the file; this
/// pins the flag over the environment. `--listen` names port 0 (any free port) while
/// `PIGEON_LISTEN` names port 1: the server must bind a port other than 1 (`start` reads the
/// address it prints and waits for `/readyz` there). `--max-content-bytes` and `PIGEON_MAX_CONTENT_BYTES` are set
/// both ways round, so that neither the larger nor the smaller limit wins by itself: 50 bytes
/// of content pass under a flag of 100 with the environment at 10, and are refused with
/// `payload_too_large` under a flag of 10 with the environment at 100.
#[tokio::test]
async fn flags_win_over_the_environment() {
    let content = "x".repeat(50);
    for (tag, flag, env, passes) in [
        ("flagenv-a", "100", "10", true),
        ("flagenv-b", "10", "100", false),
    ] {
        let dir = temp_dir(tag);
        let mut p = start(
            &dir,
            &[
                "--admin-key",
                KEY,
                "--listen",
                "127.0.0.1:0",
                "--max-content-bytes",
                flag,
            ],
            &[
                ("PIGEON_LISTEN", "127.0.0.1:1"),
                ("PIGEON_MAX_CONTENT_BYTES", env),
            ],
        )
        .await;
        assert_ne!(p.port, 1, "the flag's address wins over the environment's");
        let admin = Http::new(p.base.clone()).with_bearer(KEY);
        admin.upsert_user(1, "a").await.unwrap();
        admin.upsert_user(2, "b").await.unwrap();
        let user = Http::new(p.base.clone()).with_bearer(admin.mint_token(1, 60).await.unwrap());
        let sent = user
            .post(
                "/v1/messages",
                &json!({"client_msg_id": "between", "to": {"user": 2}, "kind": "text", "content": content}),
            )
            .await;
        if passes {
            let ack = sent.unwrap_or_else(|e| {
                panic!("--max-content-bytes {flag} (env {env}) refused 50 bytes: {e}")
            });
            assert_eq!(ack["seq"], 1);
        } else {
            assert_eq!(
                sent.unwrap_err().code(),
                Some("payload_too_large"),
                "--max-content-bytes {flag} (env {env}) let 50 bytes through"
            );
        }
        p.child.kill().await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// PROTOCOL.md 2: `--recall-window-secs`, `--edit-window-secs`, `--push-retry-ms` and
/// `--data-dir` exist, as flags and as their `PIGEON_*` variables, and take effect: with
/// windows of 1 s a recall and an edit 1.1 s after the send answer 409 `window_expired` (the
/// defaults are 120 s and a day), an unacknowledged push comes again well before the default
/// 3 s (never sooner than 200 ms after the send: PROTOCOL.md 4, extension), and the store is
/// made under the directory named, not under `./data`.
#[tokio::test]
async fn windows_push_retry_and_data_dir_come_from_flags_and_the_environment() {
    for (tag, flags, env) in [
        (
            "windows-flags",
            vec![
                "--recall-window-secs",
                "1",
                "--edit-window-secs",
                "1",
                "--push-retry-ms",
                "200",
                "--data-dir",
                "store",
            ],
            vec![],
        ),
        (
            "windows-env",
            vec![],
            vec![
                ("PIGEON_RECALL_WINDOW_SECS", "1"),
                ("PIGEON_EDIT_WINDOW_SECS", "1"),
                ("PIGEON_PUSH_RETRY_MS", "200"),
                ("PIGEON_DATA_DIR", "store"),
            ],
        ),
    ] {
        let dir = temp_dir(tag);
        let mut args = vec!["--admin-key", KEY];
        args.extend(flags);
        let mut p = start(&dir, &args, &env).await;
        assert!(
            dir.join("store").join("pigeon.db").exists(),
            "{tag}: the store lives under the data dir named"
        );
        assert!(!dir.join("data").exists(), "{tag}: nothing under ./data");
        let admin = Http::new(p.base.clone()).with_bearer(KEY);
        admin.upsert_user(1, "a").await.unwrap();
        admin.upsert_user(2, "b").await.unwrap();
        let alice = Http::new(p.base.clone()).with_bearer(admin.mint_token(1, 60).await.unwrap());
        let bob_token = admin.mint_token(2, 60).await.unwrap();
        let mut bob = WsConn::connect(&p.base.replace("http", "ws"), &bob_token, "b")
            .await
            .unwrap();

        let sent = std::time::Instant::now();
        let ack = alice
            .post(
                "/v1/messages",
                &json!({"client_msg_id": "w1", "to": {"user": 2}, "kind": "text", "content": "first"}),
            )
            .await
            .unwrap();
        let is_msg = |v: &Value| v["type"] == "msg";
        let first = bob
            .recv_until(Duration::from_secs(10), is_msg)
            .await
            .unwrap()
            .expect("the push");
        // Not acknowledged: sent again after push-retry-ms (200), long before the default
        // 3000 (2500 ms allowed for a busy machine).
        let again = bob
            .recv_until(Duration::from_secs(10), is_msg)
            .await
            .unwrap()
            .expect("the push is resent");
        let took = sent.elapsed();
        assert_eq!(again, first, "{tag}: the same push again");
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_millis(2500),
            "{tag}: resent {took:?} after the send"
        );

        tokio::time::sleep(Duration::from_millis(1100)).await;
        let msg_id = ack["msg_id"].as_str().unwrap();
        let edit = json!({"content": "second"});
        for (what, method, path, body) in [
            (
                "edit",
                reqwest::Method::PATCH,
                format!("/v1/messages/{msg_id}"),
                Some(&edit),
            ),
            (
                "recall",
                reqwest::Method::POST,
                format!("/v1/messages/{msg_id}/recall"),
                None,
            ),
        ] {
            assert_eq!(
                late_change(&alice, method, &path, body).await,
                (409, "window_expired".to_owned()),
                "{tag}: a late {what}"
            );
        }
        p.child.kill().await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The server's peak resident memory, from `/proc` (Linux).
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in proc status");
    kib * 1024
}

/// A counter's value in the Prometheus text of `/metrics` (0 when absent).
async fn counter(base: &str, name: &str) -> f64 {
    let text = Http::new(base).get_text("/metrics").await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Members who connect and never read cannot make the server hold what is pushed to them:
/// 50 of them in a group flooded with 4 KiB messages leave the server's peak resident
/// memory under 300 MiB (each would otherwise hold thousands of pushes: gigabytes in all),
/// they are closed as too slow, and a member who reads gets every push meanwhile, with 300
/// more connections open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_who_never_read_cannot_make_the_server_hold_their_pushes() {
    const IDLE: u64 = 50;
    const MESSAGES: usize = 3_000;
    const WINDOW: usize = 50;
    let dir = temp_dir("never-read");
    let p = start(&dir, &["--admin-key", KEY, "--send-rate-per-sec", "0"], &[]).await;
    let admin = Http::new(p.base.clone()).with_bearer(KEY);
    let ws_base = p.base.replace("http://", "ws://");
    let mut tokens = HashMap::new();
    for u in [1, 2].into_iter().chain(100..100 + IDLE) {
        admin.upsert_user(u, &format!("user{u}")).await.unwrap();
        tokens.insert(u, admin.mint_token(u, 3600).await.unwrap());
    }
    let members: Vec<u64> = std::iter::once(2).chain(100..100 + IDLE).collect();
    let group = Http::new(p.base.clone())
        .with_bearer(tokens[&1].clone())
        .post("/v1/groups", &json!({"name": "flood", "members": members}))
        .await
        .unwrap()["conversation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Connected, and never read from again.
    let mut idle = Vec::new();
    for u in 100..100 + IDLE {
        idle.push(
            WsConn::connect(&ws_base, &tokens[&u], "never-reads")
                .await
                .unwrap(),
        );
    }
    // Many more connections, idle: each connection's share of the server's bound is then
    // its least, which a reader that keeps up must still never be closed for.
    let mut bystanders = Vec::new();
    for u in 1000..1030 {
        admin.upsert_user(u, &format!("user{u}")).await.unwrap();
        let token = admin.mint_token(u, 3600).await.unwrap();
        for d in 0..10 {
            bystanders.push(
                WsConn::connect(&ws_base, &token, &format!("d{d}"))
                    .await
                    .unwrap(),
            );
        }
    }
    let mut reader = WsConn::connect(&ws_base, &tokens[&2], "reads")
        .await
        .unwrap();
    let conv = group.clone();
    let reading = tokio::spawn(async move {
        let mut seqs = Vec::new();
        while seqs.len() < MESSAGES {
            let Some(v) = reader.recv(Duration::from_secs(60)).await.unwrap() else {
                panic!("the reader's pushes stopped after {}", seqs.len());
            };
            if v["type"] == "msg" && v["message"]["conversation_id"] == conv.as_str() {
                if v["message"]["kind"] == "text" {
                    seqs.push(v["message"]["seq"].as_u64().unwrap());
                }
                if seqs.len() % 100 == 0 {
                    let ack = json!({"type": "ack", "user_seq": v["user_seq"]});
                    reader.send(&ack).await.unwrap();
                }
            }
        }
        seqs
    });
    let mut sender = WsConn::connect(&ws_base, &tokens[&1], "sends")
        .await
        .unwrap();
    let content = "x".repeat(4096);
    for start in (0..MESSAGES).step_by(WINDOW) {
        let frames = (start..start + WINDOW).map(|i| {
            json!({"type": "send", "req": i, "client_msg_id": format!("f-{i}"),
                   "to": {"conversation": group}, "kind": "text", "content": content})
            .to_string()
        });
        sender.send_burst(frames).await.unwrap();
        let mut acked = 0;
        while acked < WINDOW {
            let v = sender
                .recv(Duration::from_secs(30))
                .await
                .unwrap()
                .expect("send_acks come");
            assert_ne!(v["type"], "error", "{v}");
            if v["type"] == "send_ack" {
                acked += 1;
            }
        }
    }
    let seqs = tokio::time::timeout(Duration::from_secs(120), reading)
        .await
        .expect("the reader gets every push")
        .unwrap();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "the reader's pushes came in order, each once"
    );
    let peak = peak_rss_bytes(p.child.id().expect("running"));
    let too_slow = counter(&p.base, "pigeon_connections_too_slow_total").await;
    eprintln!(
        "{MESSAGES} pushes of 4 KiB to {IDLE} members who never read: peak resident memory {} MiB, {too_slow} connections closed as too slow",
        peak >> 20
    );
    assert!(
        peak < 300 << 20,
        "the server's peak resident memory was {} MiB",
        peak >> 20
    );
    assert!(
        too_slow >= (IDLE / 2) as f64,
        "{too_slow} connections were closed as too slow"
    );
    drop((idle, bystanders));
}

//! `connections`: N idle WebSocket connections, spread over several source addresses
//! (127.0.0.2, 127.0.0.3, ...), held with pings for a while. Reports the server's memory per
//! connection (its RSS before and after they are open) and its CPU while they idle.
//!
//! One load process opens at most `MAX_CONNECTIONS_PER_PROCESS` (19 000): under the usual
//! 20 000 open-files limit a process holds about 19 900 sockets. For more, run several bench
//! processes against one `--server`.

use super::procfs::{self, CpuMeter};
use super::report::Checks;
use super::{
    Common, MAX_CONNECTIONS_PER_PROCESS, Progress, Report, Res, Target, make_users, note,
    user_id_base,
};
use futures_util::{SinkExt, StreamExt};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Idle connections to open, one user each (at most 19000 per load process)
    #[arg(long, short = 'n', default_value_t = 1000)]
    pub connections: usize,
    /// Seconds to hold them once all are open
    #[arg(long, default_value_t = 10.0)]
    pub hold_secs: f64,
    /// Seconds between two pings of one connection (the server closes connections silent for
    /// two heartbeats, 60 s by default)
    #[arg(long, default_value_t = 10.0)]
    pub ping_secs: f64,
    /// Client source addresses: 127.0.0.2 and up
    #[arg(long, default_value_t = 4)]
    pub source_addrs: u8,
    /// Connections being opened at once
    #[arg(long, default_value_t = 200)]
    pub connect_concurrency: usize,
}

#[derive(Default)]
struct Live {
    open: AtomicU64,
    failed: AtomicU64,
    pings: AtomicU64,
    pongs: AtomicU64,
}

/// What one connection ends with.
struct Outcome {
    opened: bool,
    alive_at_end: bool,
    error: Option<String>,
}

pub async fn run(a: Args) -> Res<ExitCode> {
    let n = a.connections;
    if n == 0 || n > MAX_CONNECTIONS_PER_PROCESS {
        return Err(format!(
            "--connections must be 1..={MAX_CONNECTIONS_PER_PROCESS}: a process can hold about \
             19 900 sockets under a 20 000 open-files limit, so one load process stops at \
             {MAX_CONNECTIONS_PER_PROCESS}; run several bench processes against one --server for more"
        ));
    }
    if !(1..=250).contains(&a.source_addrs) {
        return Err("--source-addrs must be 1..=250".into());
    }
    if !(a.hold_secs > 0.0 && a.hold_secs <= 3600.0 && a.ping_secs > 0.0) {
        return Err("--hold-secs must be in (0, 3600] and --ping-secs positive".into());
    }
    // Each connection costs this process one file, and the server one more (and the files
    // it keeps for its store) when it runs here.
    let files = if a.common.in_process {
        2 * n + pigeon_server::open_files::RESERVED_FOR_THE_STORE as usize
    } else {
        n + 200
    };
    if let Some(limit) = procfs::open_files_limit()
        && (files as u64) > limit
    {
        return Err(format!(
            "{n} connections need about {files} open files; this process may open {limit} \
             (raise `ulimit -n`{})",
            if a.common.in_process {
                ", or leave out --in-process"
            } else {
                ""
            }
        ));
    }
    let target = Target::open(&a.common).await?;
    let result = body(&a, &target).await;
    target.close().await;
    result
}

async fn body(a: &Args, target: &Target) -> Res<ExitCode> {
    let n = a.connections;
    let base = user_id_base();
    let ids: Vec<u64> = (0..n as u64).map(|i| base + i).collect();
    let tokens = make_users(&target.admin, &ids).await?;

    // The server's memory with the users known and no connection open.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_before = target.pid.and_then(procfs::rss_kib);
    let own_rss_before = procfs::rss_kib(std::process::id());

    let live = Arc::new(Live::default());
    let (finish_tx, finish_rx) = watch::channel(false);
    let gate = Arc::new(Semaphore::new(a.connect_concurrency.max(1)));
    let ping_every = Duration::from_secs_f64(a.ping_secs);
    let progress = {
        let live = live.clone();
        Progress::start(move |_| {
            format!(
                "open {}/{n}  failed {}  pings {}  pongs {}",
                live.open.load(Relaxed),
                live.failed.load(Relaxed),
                live.pings.load(Relaxed),
                live.pongs.load(Relaxed)
            )
        })
    };
    let connect_started = Instant::now();
    let tasks: Vec<_> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, token)| {
            let src = IpAddr::V4(Ipv4Addr::new(
                127,
                0,
                0,
                2 + (i % a.source_addrs as usize) as u8,
            ));
            let conn = Conn {
                server: target.addr,
                src,
                token,
                device: format!("idle-{i}"),
                ping_every,
                live: live.clone(),
            };
            let gate = gate.clone();
            let finish = finish_rx.clone();
            tokio::spawn(conn.run(gate, finish))
        })
        .collect();
    let open_limit = Instant::now() + Duration::from_secs(60 + n as u64 / 100);
    while live.open.load(Relaxed) + live.failed.load(Relaxed) < n as u64
        && Instant::now() < open_limit
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let connect_secs = connect_started.elapsed().as_secs_f64();
    let opened = live.open.load(Relaxed);
    note(format!(
        "{opened} of {n} connections open in {connect_secs:.1} s; holding for {} s",
        a.hold_secs
    ));

    // Let the server settle, then read its memory with every connection open, and its CPU
    // while they idle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = target.pid.and_then(procfs::rss_kib);
    let own_rss_after = procfs::rss_kib(std::process::id());
    let cpu = target.pid.map(CpuMeter::start);
    let pings0 = live.pings.load(Relaxed);
    let hold_started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(a.hold_secs)).await;
    let idle_cpu = cpu.and_then(|m| m.percent());
    let hold_secs = hold_started.elapsed().as_secs_f64();
    let hold_pings = live.pings.load(Relaxed) - pings0;

    let _ = finish_tx.send(true);
    let mut checks = Checks::default();
    let (mut alive, mut first_error) = (0u64, None);
    for t in tasks {
        match t.await {
            Ok(o) => {
                alive += u64::from(o.alive_at_end);
                if !o.opened {
                    checks.error("connection refused or failed", 1);
                } else if !o.alive_at_end {
                    checks.error("connection lost while held", 1);
                }
                if first_error.is_none() {
                    first_error = o.error;
                }
            }
            Err(e) => checks.error(format!("task failed: {e}"), 1),
        }
    }
    drop(progress);
    if let Some(e) = first_error {
        note(format!("first connection error: {e}"));
    }

    let per_conn = |before: Option<u64>, after: Option<u64>| match (before, after) {
        (Some(b), Some(a)) if opened > 0 => Some((a as f64 - b as f64) / opened as f64),
        _ => None,
    };
    let mut rep = Report::new(
        "connections",
        format!(
            "pigeon bench connections: {n} idle connections from {} source addresses, held {:.1} s, a ping every {} s each",
            a.source_addrs, a.hold_secs, a.ping_secs
        ),
    );
    rep.set("server", target.describe());
    rep.set("connections", n);
    rep.set("opened", opened);
    rep.set("alive_at_end", alive);
    rep.set("source_addrs", a.source_addrs);
    rep.set("max_connections_per_process", MAX_CONNECTIONS_PER_PROCESS);
    rep.num("connect_secs", Some(connect_secs));
    rep.num("connects_per_sec", Some(opened as f64 / connect_secs));
    rep.set("server_rss_before_kib", rss_before);
    rep.set("server_rss_after_kib", rss_after);
    rep.num(
        "server_rss_per_connection_kib",
        per_conn(rss_before, rss_after),
    );
    if target.kind == "in-process" {
        rep.set(
            "note",
            "in-process: the server's RSS and CPU include the load generator",
        );
    }
    rep.num(
        "bench_rss_per_connection_kib",
        per_conn(own_rss_before, own_rss_after),
    );
    rep.num("hold_secs", Some(hold_secs));
    rep.set("hold_pings", hold_pings);
    rep.num("server_idle_cpu_percent", idle_cpu);
    rep.set("pongs", live.pongs.load(Relaxed));
    Ok(rep.finish(&checks, a.common.json.as_deref()))
}

struct Conn {
    server: SocketAddr,
    src: IpAddr,
    token: String,
    device: String,
    ping_every: Duration,
    live: Arc<Live>,
}

const PING: &str = r#"{"type":"ping"}"#;

impl Conn {
    async fn run(self, gate: Arc<Semaphore>, mut finish: watch::Receiver<bool>) -> Outcome {
        let connected = {
            let _permit = gate.acquire().await;
            tokio::time::timeout(Duration::from_secs(30), self.connect()).await
        };
        let mut ws = match connected {
            Ok(Ok(ws)) => ws,
            Ok(Err(e)) => return self.failed(e),
            Err(_) => return self.failed("connect timed out".into()),
        };
        self.live.open.fetch_add(1, Relaxed);
        // Spread the pings of all connections over the interval.
        let offset = self.ping_every.mul_f64(rand::random::<f64>());
        let mut next_ping = tokio::time::Instant::now() + offset;
        loop {
            tokio::select! {
                frame = ws.next() => match frame {
                    Some(Ok(Message::Text(t))) => {
                        if t.as_str().contains(r#""pong""#) {
                            self.live.pongs.fetch_add(1, Relaxed);
                        }
                    }
                    Some(Ok(Message::Close(f))) => {
                        return self.lost(format!("closed by the server: {f:?}"));
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return self.lost(e.to_string()),
                    None => return self.lost("connection closed".into()),
                },
                _ = tokio::time::sleep_until(next_ping) => {
                    if let Err(e) = ws.send(Message::Text(PING.into())).await {
                        return self.lost(e.to_string());
                    }
                    self.live.pings.fetch_add(1, Relaxed);
                    next_ping += self.ping_every;
                }
                changed = finish.changed() => {
                    if changed.is_err() || *finish.borrow() {
                        break;
                    }
                }
            }
        }
        // Still alive at the end: a last ping is answered.
        let alive = async {
            ws.send(Message::Text(PING.into())).await.ok()?;
            loop {
                match ws.next().await? {
                    Ok(Message::Text(t)) if t.as_str().contains(r#""pong""#) => return Some(()),
                    Ok(Message::Close(_)) | Err(_) => return None,
                    Ok(_) => {}
                }
            }
        };
        let alive = tokio::time::timeout(Duration::from_secs(10), alive)
            .await
            .ok()
            .flatten()
            .is_some();
        let _ = ws.close(None).await;
        Outcome {
            opened: true,
            alive_at_end: alive,
            error: (!alive).then(|| "no pong to the last ping".to_owned()),
        }
    }

    async fn connect(&self) -> Res<WebSocketStream<TcpStream>> {
        let socket = TcpSocket::new_v4().map_err(|e| e.to_string())?;
        socket
            .bind(SocketAddr::new(self.src, 0))
            .map_err(|e| format!("bind {}: {e}", self.src))?;
        let tcp = socket
            .connect(self.server)
            .await
            .map_err(|e| format!("connect from {}: {e}", self.src))?;
        let _ = tcp.set_nodelay(true);
        let mut req = format!("ws://{}/v1/ws?device_id={}", self.server, self.device)
            .into_client_request()
            .map_err(|e| e.to_string())?;
        req.headers_mut().insert(
            "authorization",
            format!("Bearer {}", self.token)
                .parse()
                .map_err(|_| "bad token".to_owned())?,
        );
        let config = WebSocketConfig::default()
            .read_buffer_size(4096)
            .write_buffer_size(0);
        let (mut ws, _) = tokio_tungstenite::client_async_with_config(req, tcp, Some(config))
            .await
            .map_err(|e| format!("upgrade: {e}"))?;
        // The server's first frame is hello.
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) if t.as_str().contains(r#""hello""#) => Ok(ws),
            other => Err(format!("no hello: {other:?}")),
        }
    }

    fn failed(&self, e: String) -> Outcome {
        self.live.failed.fetch_add(1, Relaxed);
        Outcome {
            opened: false,
            alive_at_end: false,
            error: Some(e),
        }
    }

    fn lost(&self, e: String) -> Outcome {
        Outcome {
            opened: true,
            alive_at_end: false,
            error: Some(e),
        }
    }
}

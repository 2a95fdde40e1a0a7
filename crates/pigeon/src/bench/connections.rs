//! `connections`: N idle WebSocket connections, spread over several source addresses
//! (127.0.0.2, 127.0.0.3, ...), held with pings for a while. Reports the server's memory per
//! connection (its RSS before and after they are open) and its CPU while they idle.
//!
//! One load process opens at most `MAX_CONNECTIONS_PER_PROCESS` (19 000): under the usual
//! 20 000 open-files limit a process holds about 19 900 sockets. For more (or with
//! `--processes`), this process makes the users and then hands their connections to child
//! load processes (`pigeon bench connections --worker`, a plan on stdin, counts on stdout),
//! and reports each one's figures beside the totals. One server process is bound by the same
//! limit: what it refuses beyond it is reported as refused connections, and its memory per
//! connection is taken over those it held.

use super::procfs::{self, CpuMeter};
use super::report::Checks;
use super::{
    Common, MAX_CONNECTIONS_PER_PROCESS, Progress, Report, Res, Target, make_users, note,
    user_id_base,
};
use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// The most load processes one run starts.
const MAX_PROCESSES: usize = 64;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Idle connections to open, one user each (at most 19000 per load process)
    #[arg(long, short = 'n', default_value_t = 1000)]
    pub connections: usize,
    /// Load processes to open them from [default: as few as hold them, 19000 each]
    #[arg(long)]
    pub processes: Option<usize>,
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
    /// Connections being opened at once (per load process)
    #[arg(long, default_value_t = 200)]
    pub connect_concurrency: usize,
    /// Run as a child load process: the plan comes on stdin (see the module doc)
    #[arg(long, hide = true)]
    pub worker: bool,
}

/// Counts of one load process, as they go.
#[derive(Default)]
struct Live {
    open: AtomicU64,
    failed: AtomicU64,
    pings: AtomicU64,
    pongs: AtomicU64,
}

impl Live {
    fn status(&self) -> Status {
        Status {
            open: self.open.load(Relaxed),
            failed: self.failed.load(Relaxed),
            pings: self.pings.load(Relaxed),
            pongs: self.pongs.load(Relaxed),
        }
    }
}

/// A child load process's counts, one JSON line on its stdout now and then.
#[derive(Serialize, Deserialize, Default, Clone, Copy)]
struct Status {
    open: u64,
    failed: u64,
    pings: u64,
    pongs: u64,
}

/// What one connection ends with.
struct Outcome {
    opened: bool,
    alive_at_end: bool,
    error: Option<String>,
}

/// The connections a load process opens: the first line a child reads on its stdin.
#[derive(Serialize, Deserialize)]
struct Plan {
    server: SocketAddr,
    tokens: Vec<String>,
    /// The index of its first connection among all (device ids and source addresses follow
    /// it, so that every process's connections differ).
    first: usize,
    source_addrs: u8,
    ping_secs: f64,
    connect_concurrency: usize,
}

/// What one load process ends with: its last line on stdout.
#[derive(Serialize, Deserialize, Default)]
struct ProcessOutcome {
    connections: usize,
    opened: u64,
    alive_at_end: u64,
    error_kinds: BTreeMap<String, u64>,
    first_error: Option<String>,
    /// Its own memory, before connecting and with every connection open.
    rss_before_kib: Option<u64>,
    rss_after_kib: Option<u64>,
}

impl ProcessOutcome {
    fn rss_per_connection_kib(&self) -> Option<f64> {
        kib_per_connection(self.rss_before_kib, self.rss_after_kib, self.opened)
    }
}

/// A process's memory growth over the connections it came from.
fn kib_per_connection(before: Option<u64>, after: Option<u64>, opened: u64) -> Option<f64> {
    match (before, after) {
        (Some(b), Some(a)) if opened > 0 => Some((a as f64 - b as f64) / opened as f64),
        _ => None,
    }
}

pub async fn run(a: Args) -> Res<ExitCode> {
    if a.worker {
        return worker().await;
    }
    let n = a.connections;
    let processes = a
        .processes
        .unwrap_or(n.div_ceil(MAX_CONNECTIONS_PER_PROCESS).max(1));
    if n == 0 || n > MAX_CONNECTIONS_PER_PROCESS * MAX_PROCESSES {
        return Err(format!(
            "--connections must be 1..={}",
            MAX_CONNECTIONS_PER_PROCESS * MAX_PROCESSES
        ));
    }
    if !(1..=MAX_PROCESSES).contains(&processes)
        || processes > n
        || n.div_ceil(processes) > MAX_CONNECTIONS_PER_PROCESS
    {
        return Err(format!(
            "--processes must be 1..={MAX_PROCESSES}, at most --connections, and leave each \
             process at most {MAX_CONNECTIONS_PER_PROCESS} connections: a process can hold \
             about 19 900 sockets under a 20 000 open-files limit"
        ));
    }
    if !(1..=250).contains(&a.source_addrs) {
        return Err("--source-addrs must be 1..=250".into());
    }
    if !(a.hold_secs > 0.0 && a.hold_secs <= 3600.0 && a.ping_secs > 0.0) {
        return Err("--hold-secs must be in (0, 3600] and --ping-secs positive".into());
    }
    // This process holds the connections when it is their one load process, and the
    // server's ends of them (and the files it keeps for its store) when the server runs here.
    let client_files = if processes == 1 { n } else { 0 };
    let files = if a.common.in_process {
        client_files + n + pigeon_server::open_files::RESERVED_FOR_THE_STORE as usize
    } else {
        client_files + 200
    };
    if let Some(limit) = procfs::open_files_limit()
        && (files as u64) > limit
    {
        return Err(format!(
            "{n} connections need about {files} open files in this process; it may open \
             {limit} (raise `ulimit -n`{})",
            if a.common.in_process {
                ", or leave out --in-process"
            } else {
                ""
            }
        ));
    }
    let target = Target::open(&a.common).await?;
    let result = body(&a, processes, &target).await;
    target.close().await;
    result
}

async fn body(a: &Args, processes: usize, target: &Target) -> Res<ExitCode> {
    let n = a.connections;
    let base = user_id_base();
    let ids: Vec<u64> = (0..n as u64).map(|i| base + i).collect();
    let tokens = make_users(&target.admin, &ids).await?;

    // The server's memory with the users known and no connection open.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_before = target.pid.and_then(procfs::rss_kib);

    let plan = |tokens: Vec<String>, first: usize| Plan {
        server: target.addr,
        tokens,
        first,
        source_addrs: a.source_addrs,
        ping_secs: a.ping_secs,
        connect_concurrency: a.connect_concurrency,
    };
    let connect_started = Instant::now();
    let load = if processes == 1 {
        Load::Here(LocalLoad::start(plan(tokens, 0)))
    } else {
        let share = n.div_ceil(processes);
        let mut plans = Vec::with_capacity(processes);
        let mut tokens = tokens.into_iter();
        for p in 0..processes {
            plans.push(plan(tokens.by_ref().take(share).collect(), p * share));
        }
        Load::Children(ChildLoad::start(plans).await?)
    };
    let progress = {
        let load = load.counts();
        Progress::start(move |_| {
            let s = sum(&load);
            format!(
                "open {}/{n}  failed {}  pings {}  pongs {}",
                s.open, s.failed, s.pings, s.pongs
            )
        })
    };
    let counts = load.counts();
    let open_limit = Instant::now() + Duration::from_secs(60 + n as u64 / 100);
    while !load.all_tried(n) && Instant::now() < open_limit {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let connect_secs = connect_started.elapsed().as_secs_f64();
    let opened = sum(&counts).open;
    note(format!(
        "{opened} of {n} connections open in {connect_secs:.1} s from {processes} load \
         process(es); holding for {} s",
        a.hold_secs
    ));

    // Let the server settle, then read its memory with every connection open, and its CPU
    // while they idle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = target.pid.and_then(procfs::rss_kib);
    let cpu = target.pid.map(CpuMeter::start);
    let pings0 = sum(&counts).pings;
    let hold_started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(a.hold_secs)).await;
    let idle_cpu = cpu.and_then(|m| m.percent());
    let hold_secs = hold_started.elapsed().as_secs_f64();
    let hold_pings = sum(&counts).pings - pings0;

    let outcomes = load.finish().await;
    let pongs = sum(&counts).pongs;
    drop(progress);
    let mut checks = Checks::default();
    for o in &outcomes {
        for (kind, count) in &o.error_kinds {
            checks.error(kind.clone(), *count);
        }
    }
    if let Some(e) = outcomes.iter().find_map(|o| o.first_error.as_ref()) {
        note(format!("first connection error: {e}"));
    }

    let mut rep = Report::new(
        "connections",
        format!(
            "pigeon bench connections: {n} idle connections from {} source addresses and {processes} load process(es), held {:.1} s, a ping every {} s each",
            a.source_addrs, a.hold_secs, a.ping_secs
        ),
    );
    rep.set("server", target.describe());
    rep.set("connections", n);
    rep.set("opened", opened);
    rep.set(
        "alive_at_end",
        outcomes.iter().map(|o| o.alive_at_end).sum::<u64>(),
    );
    rep.set("source_addrs", a.source_addrs);
    rep.set("processes", processes);
    rep.set("max_connections_per_process", MAX_CONNECTIONS_PER_PROCESS);
    rep.num("connect_secs", Some(connect_secs));
    rep.num("connects_per_sec", Some(opened as f64 / connect_secs));
    rep.set("server_rss_before_kib", rss_before);
    rep.set("server_rss_after_kib", rss_after);
    rep.num(
        "server_rss_per_connection_kib",
        kib_per_connection(rss_before, rss_after, opened),
    );
    if target.kind == "in-process" {
        rep.set(
            "note",
            "in-process: the server's RSS and CPU include the load generator",
        );
    }
    // The load processes' own memory per connection: their sum over the connections open.
    let own: Option<(f64, u64)> = outcomes.iter().try_fold((0.0, 0), |(kib, conns), o| {
        let per = o.rss_per_connection_kib()?;
        Some((kib + per * o.opened as f64, conns + o.opened))
    });
    rep.num(
        "bench_rss_per_connection_kib",
        own.filter(|o| o.1 > 0)
            .map(|(kib, conns)| kib / conns as f64),
    );
    if processes > 1 {
        let per: Vec<_> = outcomes
            .iter()
            .map(|o| {
                json!({
                    "connections": o.connections,
                    "opened": o.opened,
                    "alive_at_end": o.alive_at_end,
                    "rss_per_connection_kib": o.rss_per_connection_kib().map(super::report::round3),
                })
            })
            .collect();
        rep.set("per_process", per);
    }
    rep.num("hold_secs", Some(hold_secs));
    rep.set("hold_pings", hold_pings);
    rep.num("server_idle_cpu_percent", idle_cpu);
    rep.set("pongs", pongs);
    Ok(rep.finish(&checks, a.common.json.as_deref()))
}

/// The counts of every load process, summed.
fn sum(counts: &[Arc<Live>]) -> Status {
    counts.iter().fold(Status::default(), |s, l| {
        let l = l.status();
        Status {
            open: s.open + l.open,
            failed: s.failed + l.failed,
            pings: s.pings + l.pings,
            pongs: s.pongs + l.pongs,
        }
    })
}

/// Where the connections are held: in this process, or in child load processes.
enum Load {
    Here(LocalLoad),
    Children(ChildLoad),
}

impl Load {
    fn counts(&self) -> Vec<Arc<Live>> {
        match self {
            Load::Here(l) => vec![l.live.clone()],
            Load::Children(c) => c.workers.iter().map(|w| w.live.clone()).collect(),
        }
    }

    /// True once every connection was opened or failed.
    fn all_tried(&self, n: usize) -> bool {
        let s = sum(&self.counts());
        match self {
            Load::Here(_) => s.open + s.failed >= n as u64,
            // A child that died tries nothing more: its reader marks it ready.
            Load::Children(c) => c.workers.iter().all(|w| *w.ready.borrow()),
        }
    }

    async fn finish(self) -> Vec<ProcessOutcome> {
        match self {
            Load::Here(l) => vec![l.finish().await],
            Load::Children(c) => c.finish().await,
        }
    }
}

/// Connections held by tasks of this process.
struct LocalLoad {
    live: Arc<Live>,
    tasks: Vec<tokio::task::JoinHandle<Outcome>>,
    finish: watch::Sender<bool>,
    connections: usize,
    rss_before_kib: Option<u64>,
}

impl LocalLoad {
    fn start(plan: Plan) -> LocalLoad {
        let rss_before_kib = procfs::rss_kib(std::process::id());
        let live = Arc::new(Live::default());
        let (finish, finish_rx) = watch::channel(false);
        let gate = Arc::new(Semaphore::new(plan.connect_concurrency.max(1)));
        let ping_every = Duration::from_secs_f64(plan.ping_secs);
        let connections = plan.tokens.len();
        let tasks = plan
            .tokens
            .into_iter()
            .enumerate()
            .map(|(i, token)| {
                let i = plan.first + i;
                let src = IpAddr::V4(Ipv4Addr::new(
                    127,
                    0,
                    0,
                    2 + (i % plan.source_addrs as usize) as u8,
                ));
                let conn = Conn {
                    server: plan.server,
                    src,
                    token,
                    device: format!("idle-{i}"),
                    ping_every,
                    live: live.clone(),
                };
                tokio::spawn(conn.run(gate.clone(), finish_rx.clone()))
            })
            .collect();
        LocalLoad {
            live,
            tasks,
            finish,
            connections,
            rss_before_kib,
        }
    }

    /// Ends the hold: every connection sends a last ping and closes. (This process's memory
    /// is read first, with every connection still open.)
    async fn finish(self) -> ProcessOutcome {
        let rss_after_kib = procfs::rss_kib(std::process::id());
        let _ = self.finish.send(true);
        let mut out = ProcessOutcome {
            connections: self.connections,
            opened: self.live.open.load(Relaxed),
            rss_before_kib: self.rss_before_kib,
            rss_after_kib,
            ..ProcessOutcome::default()
        };
        let mut checks = Checks::default();
        for t in self.tasks {
            match t.await {
                Ok(o) => {
                    out.alive_at_end += u64::from(o.alive_at_end);
                    if !o.opened {
                        checks.error("connection refused or failed", 1);
                    } else if !o.alive_at_end {
                        checks.error("connection lost while held", 1);
                    }
                    if out.first_error.is_none() {
                        out.first_error = o.error;
                    }
                }
                Err(e) => checks.error(format!("task failed: {e}"), 1),
            }
        }
        out.error_kinds = checks.error_kinds;
        out
    }
}

/// A child load process: `pigeon bench connections --worker`.
struct Worker {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    live: Arc<Live>,
    /// Set once it has tried every connection (or ended).
    ready: watch::Receiver<bool>,
    /// Its last line: what it ended with.
    outcome: tokio::task::JoinHandle<Option<ProcessOutcome>>,
    connections: usize,
}

struct ChildLoad {
    workers: Vec<Worker>,
}

impl ChildLoad {
    async fn start(plans: Vec<Plan>) -> Res<ChildLoad> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
        let mut workers = Vec::with_capacity(plans.len());
        for plan in plans {
            let mut child = tokio::process::Command::new(&exe)
                .args(["bench", "connections", "--worker"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("cannot start a load process: {e}"))?;
            let mut stdin = child.stdin.take().expect("piped stdin");
            let stdout = child.stdout.take().expect("piped stdout");
            let mut line = serde_json::to_vec(&plan).map_err(|e| e.to_string())?;
            line.push(b'\n');
            stdin
                .write_all(&line)
                .await
                .map_err(|e| format!("cannot hand a load process its plan: {e}"))?;
            let live = Arc::new(Live::default());
            let (ready_tx, ready) = watch::channel(false);
            let outcome = tokio::spawn(read_worker(stdout, live.clone(), ready_tx));
            workers.push(Worker {
                child,
                stdin,
                live,
                ready,
                outcome,
                connections: plan.tokens.len(),
            });
        }
        Ok(ChildLoad { workers })
    }

    async fn finish(self) -> Vec<ProcessOutcome> {
        let mut workers = self.workers;
        // All told first: they finish together, as one process's connections do.
        for w in &mut workers {
            let _ = w.stdin.write_all(b"finish\n").await;
            let _ = w.stdin.flush().await;
        }
        let mut out = Vec::with_capacity(workers.len());
        for mut w in workers {
            let outcome = tokio::time::timeout(Duration::from_secs(60), &mut w.outcome)
                .await
                .ok()
                .and_then(|r| r.ok())
                .flatten();
            let _ = w.child.start_kill();
            let _ = w.child.wait().await;
            out.push(outcome.unwrap_or_else(|| {
                let mut o = ProcessOutcome {
                    connections: w.connections,
                    ..ProcessOutcome::default()
                };
                o.error_kinds
                    .insert("load process ended without its figures".into(), 1);
                o
            }));
        }
        out
    }
}

/// Reads a child's lines: counts as they go, `ready` once it tried every connection, and
/// its outcome last.
async fn read_worker(
    stdout: tokio::process::ChildStdout,
    live: Arc<Live>,
    ready: watch::Sender<bool>,
) -> Option<ProcessOutcome> {
    let mut lines = BufReader::new(stdout).lines();
    let mut outcome = None;
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(msg) = serde_json::from_str::<WorkerLine>(&line) else {
            continue;
        };
        match msg {
            WorkerLine::Status(s) => {
                live.open.store(s.open, Relaxed);
                live.failed.store(s.failed, Relaxed);
                live.pings.store(s.pings, Relaxed);
                live.pongs.store(s.pongs, Relaxed);
            }
            WorkerLine::Ready(s) => {
                live.open.store(s.open, Relaxed);
                live.failed.store(s.failed, Relaxed);
                let _ = ready.send(true);
            }
            WorkerLine::Done(o) => outcome = Some(o),
        }
    }
    // Ended (or died): nothing more will come.
    let _ = ready.send(true);
    outcome
}

/// One line a child load process writes on its stdout.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WorkerLine {
    Status(Status),
    /// Every connection was tried.
    Ready(Status),
    Done(ProcessOutcome),
}

fn say(line: &WorkerLine) {
    if let Ok(text) = serde_json::to_string(line) {
        println!("{text}");
    }
}

/// A child load process: reads its plan, opens the connections, reports its counts every
/// 250 ms, and holds them until `finish` (or the end of its stdin), then its outcome.
async fn worker() -> Res<ExitCode> {
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let first = stdin
        .next_line()
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no plan on stdin")?;
    let plan: Plan = serde_json::from_str(&first).map_err(|e| format!("bad plan: {e}"))?;
    if plan.tokens.len() > MAX_CONNECTIONS_PER_PROCESS {
        return Err(format!(
            "a load process opens at most {MAX_CONNECTIONS_PER_PROCESS} connections"
        ));
    }
    let n = plan.tokens.len() as u64;
    let load = LocalLoad::start(plan);
    let live = load.live.clone();
    let reporter = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let mut told_ready = false;
        loop {
            tick.tick().await;
            let s = live.status();
            if !told_ready && s.open + s.failed >= n {
                say(&WorkerLine::Ready(s));
                told_ready = true;
            } else {
                say(&WorkerLine::Status(s));
            }
        }
    });
    // Until told, or until the parent is gone.
    while let Ok(Some(line)) = stdin.next_line().await {
        if line.trim() == "finish" {
            break;
        }
    }
    let outcome = load.finish().await;
    reporter.abort();
    say(&WorkerLine::Done(outcome));
    Ok(ExitCode::SUCCESS)
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

//! Load connections: each one a task that sends (with a window of in-flight sends, or at a
//! fixed rate), takes the pushes, acknowledges them in batches, and records what the
//! correctness check and the latency figures need. `evaluate` merges their records.

use super::procfs::CpuMeter;
use super::report::Checks;
use super::{Res, content, late_us_of, now_us, sent_us_of};
use futures_util::StreamExt;
use pigeon_client::WsConn;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Latency buckets: single chat or group, sent before or after `Shared::phase_split_us`.
pub const SINGLE_P1: usize = 0;
pub const SINGLE_P2: usize = 1;
pub const GROUP_P1: usize = 2;
pub const GROUP_P2: usize = 3;

/// Acknowledge pushes once this many are waiting, or once the oldest waited this long.
const ACK_BATCH: usize = 64;
const ACK_DELAY: Duration = Duration::from_millis(20);
/// A connection that wrote nothing for this long pings (the server closes silent ones).
const PING_EVERY: Duration = Duration::from_secs(10);

/// How late a fixed-rate send may leave the load tool before it counts in `late_sends`.
pub const LATE_SEND: Duration = Duration::from_millis(5);

/// Tokio's timer fires at the first millisecond tick at or after its deadline, so a
/// connection that slept until a send's time sent it ~1.2 ms late at the median (the
/// trace's `late_ms`), and every latency counted from the scheduled time carried that. It
/// now wakes this much before, and makes a send due within it at once: early, and then
/// counted from when it is made, so no latency is understated.
const TIMER_SLACK: Duration = Duration::from_millis(1);

/// Deliveries slower than this are counted live ([`Counters::slow`]): the progress line
/// shows, second by second, when a run's tail happens (20 ms: the p99 the server aims for
/// at half its maximum rate).
pub const SLOW_DELIVERY_US: u32 = 20_000;

/// Live totals over every connection of a run (the progress line reads them).
#[derive(Default)]
pub struct Counters {
    /// Distinct messages sent (retries not counted again).
    pub sent: AtomicU64,
    pub acked: AtomicU64,
    pub inflight: AtomicI64,
    /// First pushes of bench messages to members other than their sender.
    pub delivered: AtomicU64,
    /// First pushes of bench messages to any member (the sender's connection included).
    pub deliveries: AtomicU64,
    /// Pushes due for the acknowledged messages: the sum of their fan-outs.
    pub expected: AtomicU64,
    /// Sends answered `rate_limited` or `unavailable`, sent again.
    pub retried: AtomicU64,
    /// Fixed-rate sends the load tool itself wrote more than [`LATE_SEND`] after their
    /// scheduled time: their latency (counted from that time) includes the tool's own delay.
    pub late_sends: AtomicU64,
    pub errors: AtomicU64,
    /// Deliveries slower than [`SLOW_DELIVERY_US`].
    pub slow: AtomicU64,
    /// Sending connections that have seen the order to stop sending (or ended).
    pub stopped_senders: AtomicU64,
}

pub struct Shared {
    pub counters: Counters,
    /// Messages sent at or after this time (µs, see `now_us`) count in the second phase.
    pub phase_split_us: AtomicU64,
    /// Messages scheduled before this time (µs) count in no latency figure (the warm-up).
    pub record_from_us: AtomicU64,
    /// Every delivery's (send µs, latency µs, the tool's lateness µs) is kept for `--trace`.
    pub trace: AtomicBool,
}

impl Shared {
    pub fn new() -> Arc<Shared> {
        Arc::new(Shared {
            counters: Counters::default(),
            phase_split_us: AtomicU64::new(u64::MAX),
            record_from_us: AtomicU64::new(0),
            trace: AtomicBool::new(false),
        })
    }

    /// True for a message scheduled inside the warm-up.
    fn in_warmup(&self, sent_us: u64) -> bool {
        sent_us < self.record_from_us.load(Acquire)
    }
}

/// How a send-for-a-while scenario takes its latency figures.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LatencyArgs {
    /// Seconds at the start of sending whose messages count in no latency figure. They
    /// are still sent at the same pace, counted in the rates and checked for loss,
    /// duplicates and order; a server's first moments (its first conversations, cold
    /// caches, its allocator's first pages) are not its steady state
    #[arg(long, default_value_t = 0.0)]
    pub warmup: f64,
    /// Write every delivery's send time (with --rate the scheduled one, or the actual one
    /// for a send made up to 1 ms early), send→delivered
    /// latency and how late the tool itself sent it to this CSV file
    /// (`sent_ms,latency_ms,late_ms`, sent_ms counted from the start of sending, in send
    /// order; warm-up included; a resend's lateness counts from its first schedule), to see
    /// when a run's tail happens and how much of it the tool spent. It holds 16 bytes a delivery in memory until the end of the run.
    /// The wall-clock time at which sending started is printed, to lay the trace over a
    /// profile taken on the same clock (`perf record -k CLOCK_REALTIME`)
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

impl LatencyArgs {
    /// Refuses a warm-up that is not a number of seconds shorter than the sending.
    pub fn check(&self, duration: f64) -> Res<()> {
        if !(self.warmup >= 0.0 && self.warmup < duration) {
            return Err(format!(
                "--warmup must be at least 0 and shorter than --duration ({duration} s)"
            ));
        }
        Ok(())
    }
}

/// What the connections are told to do: which classes of senders send, and when to stop.
#[derive(Clone, Copy, Default, Debug)]
pub struct Ctl {
    pub send: [bool; 2],
    /// Sending is over for good: each sending connection says it has seen this.
    pub stop: bool,
    pub finish: bool,
}

/// What one connection sends.
pub struct SendPlan {
    /// The `to` of the send frame: `{"user":U}` or `{"conversation":C}`.
    pub to: Value,
    /// Member connections that get each message, the sender's included.
    pub fanout: u64,
    /// Most sends awaiting their `send_ack`.
    pub window: usize,
    /// With a fixed rate: the time between two sends of this connection.
    pub interval: Option<Duration>,
    /// Most messages to send.
    pub limit: Option<u64>,
    /// Content bytes.
    pub size: usize,
    /// Senders of class `i` send while `Ctl::send[i]`.
    pub class: usize,
}

/// One load connection.
pub struct Spec {
    pub user: u64,
    pub token: String,
    pub device: String,
    pub send: Option<SendPlan>,
    /// Conversations this connection must get every acknowledged message of.
    pub expect: Vec<String>,
    /// Record per-message delivery times (for the time until the last member has it).
    pub completion: bool,
}

/// A set of seqs (a bitmap; seqs of one chain are dense).
#[derive(Default)]
pub struct SeqSet {
    bits: Vec<u64>,
}

impl SeqSet {
    /// Adds `seq`; false when it was there already.
    pub fn insert(&mut self, seq: u64) -> bool {
        let (w, b) = ((seq / 64) as usize, seq % 64);
        if w >= self.bits.len() {
            self.bits.resize(w + 1, 0);
        }
        let had = self.bits[w] & (1 << b) != 0;
        self.bits[w] |= 1 << b;
        !had
    }

    pub fn contains(&self, seq: u64) -> bool {
        let (w, b) = ((seq / 64) as usize, seq % 64);
        self.bits.get(w).is_some_and(|x| x & (1 << b) != 0)
    }
}

/// What one connection saw of one conversation.
#[derive(Default)]
pub struct ConvTrack {
    pub seen: SeqSet,
    pub max: u64,
    /// Highest seq up to which every push since the first one arrived (read fan-out acks).
    contig: Option<u64>,
    acked: u64,
    /// Pushed without a `user_seq` (a read fan-out group): acknowledged by conversation.
    read_fanout: bool,
}

impl ConvTrack {
    /// Records a push of `seq`; answers (new, out_of_order).
    pub fn record(&mut self, seq: u64) -> (bool, bool) {
        if !self.seen.insert(seq) {
            return (false, false);
        }
        let ooo = seq < self.max;
        self.max = self.max.max(seq);
        let mut c = self.contig.unwrap_or(seq.saturating_sub(1));
        while self.seen.contains(c + 1) {
            c += 1;
        }
        self.contig = Some(c);
        (true, ooo)
    }
}

/// What a connection reports at the end.
#[derive(Default)]
pub struct ConnReport {
    pub user: u64,
    /// Connected from the start to the end, with no error.
    pub online_throughout: bool,
    pub failure: Option<String>,
    pub expect: Vec<String>,
    pub convs: HashMap<String, ConvTrack>,
    /// The seqs acknowledged to this connection's sends, per conversation.
    pub acked: HashMap<String, Vec<u64>>,
    pub fanout: u64,
    pub duplicated: u64,
    pub out_of_order: u64,
    /// Sends refused for good, by error code.
    pub send_errors: HashMap<String, u64>,
    /// Sends still without an answer at the end.
    pub unacked: u64,
    /// Latencies in µs, by bucket (see `SINGLE_P1` ...).
    pub ack_lat: [Vec<u32>; 4],
    pub delivery_lat: [Vec<u32>; 4],
    /// Per conversation: (seq, send→delivered µs) of bench messages from other senders.
    pub completion: HashMap<String, Vec<(u64, u32)>>,
    /// With `--trace`: (send µs, send→delivered µs, the tool's lateness µs) of every delivery;
    /// the send time is the scheduled one, or the actual one for a send made early.
    pub trace: Vec<(u64, u32, u32)>,
}

/// A send awaiting its answer: what it takes to write it again (its `client_msg_id` and
/// content are made from these, not kept: two strings fewer per send).
struct Inflight {
    /// This connection's count of sends when it was made (see [`client_msg_id`]).
    n: u64,
    sent_us: u64,
}

/// The `client_msg_id` of `user`'s `n`th send.
fn client_msg_id(user: u64, n: u64) -> String {
    format!("b{user}-{n}")
}

/// What one send-for-a-while phase measured (the `direct` and `group` scenarios).
pub struct Measured {
    pub out: Outcome,
    pub shared: Arc<Shared>,
    /// Sending that counted in no latency figure (`--warmup`).
    pub warmup_secs: f64,
    /// How long the senders sent.
    pub send_secs: f64,
    /// Sending plus draining.
    pub elapsed: f64,
    pub server_cpu: Option<f64>,
    pub own_cpu: Option<f64>,
    pub sent: u64,
    pub delivered: u64,
}

impl Measured {
    /// The figures every send-then-drain scenario reports, in their order: pace, times,
    /// counts, rates (`delivered_key` names the delivery rate) and the latencies of `bucket`.
    pub fn report_run(
        &mut self,
        rep: &mut super::Report,
        (rate, window): (Option<f64>, usize),
        bucket: usize,
        delivered_key: &str,
    ) {
        rep.set("window", window);
        rep.num("rate", rate);
        rep.num("duration_secs", Some(self.send_secs));
        rep.num("warmup_secs", Some(self.warmup_secs));
        rep.num("elapsed_secs", Some(self.elapsed));
        rep.set("sent", self.sent);
        rep.set("acked", self.out.acked);
        rep.set("delivered", self.delivered);
        rep.num(
            "acked_per_sec",
            Some(self.out.acked as f64 / self.send_secs),
        );
        rep.num(delivered_key, Some(self.delivered as f64 / self.elapsed));
        rep.latency(
            "ack_latency_ms",
            std::mem::take(&mut self.out.ack_lat[bucket]),
        );
        rep.latency(
            "delivery_latency_ms",
            std::mem::take(&mut self.out.delivery_lat[bucket]),
        );
    }

    /// What the run cost (server and load tool CPU) and how many sends were retried.
    pub fn report_cost(&self, rep: &mut super::Report) {
        rep.num("server_cpu_percent", self.server_cpu);
        rep.num("bench_cpu_percent", self.own_cpu);
        rep.set("retried", self.shared.counters.retried.load(Relaxed));
        report_late_sends(rep, &self.shared.counters);
    }
}

/// How many fixed-rate sends left the tool late (see [`Counters::late_sends`]).
pub fn report_late_sends(rep: &mut super::Report, counters: &Counters) {
    rep.set("sends_late_over_5ms", counters.late_sends.load(Relaxed));
}

/// How a scenario paces its senders, for its title.
pub fn pace(rate: Option<f64>, window: usize) -> String {
    match rate {
        Some(r) => format!("{r} msgs/s total (window {window})"),
        None => format!("window {window}"),
    }
}

/// Connection `i` of a pair of users chatting one to one (`peer` is the other).
pub fn pair_spec(i: usize, user: u64, peer: u64, token: String, plan: PairPlan) -> Spec {
    Spec {
        user,
        token,
        device: format!("bench-{i}"),
        send: Some(SendPlan {
            to: json!({"user": peer}),
            fanout: 2,
            window: plan.window,
            interval: plan.interval,
            limit: None,
            size: plan.size,
            class: 0,
        }),
        expect: vec![format!("{}-{}", user.min(peer), user.max(peer))],
        completion: false,
    }
}

/// How a one-to-one pair sends (see [`pair_spec`]).
#[derive(Clone, Copy)]
pub struct PairPlan {
    pub window: usize,
    pub interval: Option<Duration>,
    pub size: usize,
}

/// Connects `specs`, lets them send for `duration_secs`, drains for at most `drain_secs`,
/// and evaluates what every connection saw.
pub async fn measure(
    ws_base: &str,
    specs: Vec<Spec>,
    server_pid: Option<u32>,
    (duration_secs, drain_secs): (f64, u64),
    latency: &LatencyArgs,
) -> Res<Measured> {
    // Made before the run, so that a path that cannot be written fails before it.
    let trace_file = match &latency.trace {
        Some(path) => Some(
            std::fs::File::create(path)
                .map_err(|e| format!("cannot write the trace {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let conns = connect_all(ws_base, specs, 64).await?;
    let shared = Shared::new();
    shared.trace.store(trace_file.is_some(), Relaxed);
    let run = Run::start(conns, shared.clone());
    let server_cpu = server_pid.map(CpuMeter::start);
    let own_cpu = CpuMeter::start(std::process::id());
    let started = Instant::now();
    let progress = progress(shared.clone());
    let start_us = now_us();
    if trace_file.is_some() {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        super::note(format!(
            "trace: sending starts at {}.{:06} (Unix time, seconds)",
            wall.as_secs(),
            wall.subsec_micros()
        ));
    }
    shared
        .record_from_us
        .store(start_us + (latency.warmup * 1e6) as u64, Release);
    run.set(|c| c.send[0] = true);
    tokio::time::sleep(Duration::from_secs_f64(duration_secs)).await;
    let send_secs = started.elapsed().as_secs_f64();
    let server_cpu = server_cpu.and_then(|m| m.percent());
    let own_cpu = own_cpu.percent();
    let drained = run.drain(Duration::from_secs(drain_secs)).await;
    let elapsed = started.elapsed().as_secs_f64();
    drop(progress);
    let (sent, delivered) = (
        shared.counters.sent.load(Relaxed),
        shared.counters.delivered.load(Relaxed),
    );
    let mut out = evaluate(run.finish().await);
    if !drained {
        out.checks.error("drain timed out", 1);
    }
    if let (Some(file), Some(path)) = (trace_file, &latency.trace)
        && let Err(e) = write_trace(file, &mut out.trace, start_us)
    {
        // The run's figures are still worth reporting.
        super::note(format!("cannot write the trace {}: {e}", path.display()));
    }
    Ok(Measured {
        out,
        shared,
        warmup_secs: latency.warmup,
        send_secs,
        elapsed,
        server_cpu,
        own_cpu,
        sent,
        delivered,
    })
}

/// Opens the connections, `concurrency` at a time; fails on the first that cannot connect.
pub async fn connect_all(
    ws_base: &str,
    specs: Vec<Spec>,
    concurrency: usize,
) -> Res<Vec<(Spec, WsConn)>> {
    let n = specs.len();
    let results: Vec<Res<(Spec, WsConn)>> = futures_util::stream::iter(specs)
        .map(|spec| async move {
            match WsConn::connect(ws_base, &spec.token, &spec.device).await {
                Ok(c) => Ok((spec, c)),
                Err(e) => Err(format!("user {} cannot connect: {e}", spec.user)),
            }
        })
        .buffered(concurrency.max(1))
        .collect()
        .await;
    let conns: Res<Vec<_>> = results.into_iter().collect();
    let conns = conns?;
    super::note(format!("{n} connections open"));
    Ok(conns)
}

/// A runtime of its own, on its own thread, for the connections whose latency a scenario
/// reports beside heavy traffic: on the load tool's main runtime their frames would queue
/// behind the heavy connections' frames, and the figure would be the tool's own delay.
/// (A real user's phone is not busy receiving somebody else's flood.)
pub struct ProbeRuntime(Option<tokio::runtime::Runtime>);

impl ProbeRuntime {
    pub fn new() -> Res<ProbeRuntime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("bench-probe")
            .on_thread_start(raise_priority)
            .enable_all()
            .build()
            .map(|rt| ProbeRuntime(Some(rt)))
            .map_err(|e| format!("cannot start the probe runtime: {e}"))
    }

    pub fn handle(&self) -> tokio::runtime::Handle {
        self.0.as_ref().expect("probe runtime").handle().clone()
    }

    /// Opens `specs`' connections on this runtime, so their I/O is driven by its thread.
    pub async fn connect_all(&self, ws_base: &str, specs: Vec<Spec>) -> Res<Vec<(Spec, WsConn)>> {
        let base = ws_base.to_owned();
        self.handle()
            .spawn(async move { connect_all(&base, specs, 64).await })
            .await
            .map_err(|e| format!("probe connections: {e}"))?
    }
}

/// Asks the scheduler to run the calling thread ahead of ordinary ones (nice -10), as a
/// separate device would be; without the privilege (CAP_SYS_NICE) it stays as it is, and
/// the probe's figures then include more of the load tool's own delays.
#[allow(unsafe_code)]
fn raise_priority() {
    // SAFETY: setpriority takes plain integers and touches no memory of this process;
    // `who` 0 with PRIO_PROCESS is the calling thread on Linux.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -10) };
    if r != 0 {
        PROBE_PRIORITY_REFUSED.store(true, Relaxed);
    }
}

/// Set when [`raise_priority`] was refused (reported with the figures).
pub static PROBE_PRIORITY_REFUSED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

impl Drop for ProbeRuntime {
    fn drop(&mut self) {
        // Dropped inside another runtime's task, a runtime panics (its drop would block);
        // this one's tasks are done by the time the scenario drops it.
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The connections of a run, each driven by its own task.
pub struct Run {
    pub shared: Arc<Shared>,
    ctl: watch::Sender<Ctl>,
    tasks: Vec<tokio::task::JoinHandle<ConnReport>>,
    senders: u64,
}

impl Run {
    pub fn start(conns: Vec<(Spec, WsConn)>, shared: Arc<Shared>) -> Run {
        Run::start_on(vec![(tokio::runtime::Handle::current(), conns)], shared)
    }

    /// Drives each group of connections on the runtime it was opened on (see
    /// [`ProbeRuntime`]).
    pub fn start_on(
        groups: Vec<(tokio::runtime::Handle, Vec<(Spec, WsConn)>)>,
        shared: Arc<Shared>,
    ) -> Run {
        let (ctl, rx) = watch::channel(Ctl::default());
        let mut senders = 0;
        let mut tasks = Vec::new();
        for (runtime, conns) in groups {
            senders += conns.iter().filter(|(spec, _)| spec.send.is_some()).count() as u64;
            tasks.extend(
                conns
                    .into_iter()
                    .map(|(spec, ws)| runtime.spawn(drive(ws, spec, shared.clone(), rx.clone()))),
            );
        }
        Run {
            shared,
            ctl,
            tasks,
            senders,
        }
    }

    pub fn set(&self, f: impl FnOnce(&mut Ctl)) {
        self.ctl.send_modify(f);
    }

    /// Stops every sender and waits (at most `max`) until every send has its answer and every
    /// acknowledged message reached every member connection. True when everything arrived.
    pub async fn drain(&self, max: Duration) -> bool {
        self.set(|c| {
            c.send = [false, false];
            c.stop = true;
        });
        let until = Instant::now() + max;
        let c = &self.shared.counters;
        loop {
            // First every sender must have seen the stop: one that has not may still start a
            // send after `inflight` was read as zero.
            if c.stopped_senders.load(Relaxed) >= self.senders
                && c.inflight.load(Relaxed) <= 0
                && c.deliveries.load(Relaxed) >= c.expected.load(Relaxed)
            {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the connections and collects their reports.
    pub async fn finish(self) -> Vec<ConnReport> {
        self.ctl.send_modify(|c| c.finish = true);
        let mut out = Vec::with_capacity(self.tasks.len());
        for t in self.tasks {
            match t.await {
                Ok(r) => out.push(r),
                Err(e) => out.push(ConnReport {
                    failure: Some(format!("driver task failed: {e}")),
                    ..ConnReport::default()
                }),
            }
        }
        out
    }
}

struct Driver {
    sh: Arc<Shared>,
    plan: Option<SendPlan>,
    user: u64,
    completion: bool,
    next_req: i64,
    started_sends: u64,
    inflight: HashMap<i64, Inflight>,
    retries: Vec<(Instant, i64)>,
    /// Rate mode: when the next send is due.
    next_at: Option<Instant>,
    inbox: SeqSet,
    inbox_contig: u64,
    inbox_acked: u64,
    ack_pending: usize,
    ack_since: Option<Instant>,
    last_write: Instant,
    r: ConnReport,
}

async fn drive(
    mut ws: WsConn,
    spec: Spec,
    sh: Arc<Shared>,
    mut ctl: watch::Receiver<Ctl>,
) -> ConnReport {
    let head = ws.hello["user_seq"].as_u64().unwrap_or(0);
    let mut d = Driver {
        sh,
        user: spec.user,
        completion: spec.completion,
        next_req: 1,
        started_sends: 0,
        inflight: HashMap::new(),
        retries: Vec::new(),
        next_at: None,
        inbox: SeqSet::default(),
        inbox_contig: head,
        inbox_acked: head,
        ack_pending: 0,
        ack_since: None,
        last_write: Instant::now(),
        r: ConnReport {
            user: spec.user,
            online_throughout: true,
            expect: spec.expect,
            fanout: spec.send.as_ref().map_or(0, |p| p.fanout),
            ..ConnReport::default()
        },
        plan: spec.send,
    };
    let mut c = *ctl.borrow_and_update();
    let mut told_stopped = false;
    loop {
        if c.stop && !told_stopped && d.plan.is_some() {
            told_stopped = true;
            d.sh.counters.stopped_senders.fetch_add(1, Relaxed);
        }
        if c.finish {
            break;
        }
        let now = Instant::now();
        if let Err(e) = d.send_due(&mut ws, &c, now).await {
            d.fail(e);
            break;
        }
        if d.ack_due(now)
            && let Err(e) = d.flush_acks(&mut ws).await
        {
            d.fail(e);
            break;
        }
        if now.duration_since(d.last_write) >= PING_EVERY {
            if let Err(e) = ws.send_text(r#"{"type":"ping"}"#.into()).await {
                d.fail(e.to_string());
                break;
            }
            d.last_write = now;
        }
        let deadline = d.next_wake(&c, now);
        tokio::select! {
            got = ws.recv_text(deadline.saturating_duration_since(now)) => match got {
                Ok(Some(text)) => match serde_json::from_str::<Incoming>(&text) {
                    Ok(frame) => d.handle(frame, &text),
                    Err(e) => d.fail(format!("unparsable frame ({e}): {text}")),
                },
                Ok(None) => {
                    if Instant::now() + Duration::from_millis(1) < deadline {
                        let why = match &ws.closed_with {
                            Some((code, reason)) => format!("closed by the server: {code} {reason}"),
                            None => "connection closed".to_owned(),
                        };
                        d.fail(why);
                        break;
                    }
                }
                Err(e) => {
                    d.fail(e.to_string());
                    break;
                }
            },
            changed = ctl.changed() => {
                if changed.is_err() {
                    break;
                }
                c = *ctl.borrow_and_update();
            }
        }
    }
    if !told_stopped && d.plan.is_some() {
        // Ended early (failed): it sends no more either.
        d.sh.counters.stopped_senders.fetch_add(1, Relaxed);
    }
    if d.r.online_throughout {
        let _ = d.flush_acks(&mut ws).await;
        ws.close().await;
    }
    d.finish()
}

impl Driver {
    fn fail(&mut self, why: String) {
        if self.r.online_throughout {
            self.r.online_throughout = false;
            self.r.failure = Some(why);
            self.sh.counters.errors.fetch_add(1, Relaxed);
        }
    }

    fn finish(mut self) -> ConnReport {
        let left = self.inflight.len() as u64;
        self.r.unacked = left;
        self.sh.counters.inflight.fetch_sub(left as i64, Relaxed);
        self.r
    }

    fn bucket(&self, is_group: bool, sent_us: u64) -> usize {
        let phase2 = sent_us >= self.sh.phase_split_us.load(Relaxed);
        usize::from(phase2) + if is_group { 2 } else { 0 }
    }

    /// Sends what is due: retries, then new messages within the window (and the rate).
    async fn send_due(&mut self, ws: &mut WsConn, c: &Ctl, now: Instant) -> Result<(), String> {
        let Some(plan) = &self.plan else {
            return Ok(());
        };
        // Retries first, even once sending has stopped: a send already made must get its
        // answer for the run to drain.
        let mut due = Vec::new();
        self.retries.retain(|(at, req)| {
            if *at <= now {
                due.push(*req);
                false
            } else {
                true
            }
        });
        for req in due {
            if let Some(f) = self.inflight.get(&req) {
                let (cmid, text) = (client_msg_id(self.user, f.n), content(f.sent_us, plan.size));
                ws.send_text(send_frame(req, &cmid, &plan.to, &text))
                    .await
                    .map_err(|e| e.to_string())?;
                self.last_write = now;
            }
        }
        if !c.send[plan.class] {
            self.next_at = None;
            return Ok(());
        }
        loop {
            if self.inflight.len() >= plan.window
                || plan.limit.is_some_and(|l| self.started_sends >= l)
            {
                return Ok(());
            }
            // Rate mode: a late send's latency counts from its scheduled time, so that a slow
            // server cannot hide its delay by slowing the sender down; one made early
            // (within TIMER_SLACK) counts from when it is made.
            let sent_us = match plan.interval {
                None => now_us(),
                Some(every) => {
                    // Read again for every send: the sends before it in this loop took time.
                    let (t, t_us) = (Instant::now(), now_us());
                    // Connections start spread over one interval, not all at once: a
                    // fixed total rate then arrives evenly, as many independent users
                    // do, instead of as one burst of every connection per interval.
                    let at = *self
                        .next_at
                        .get_or_insert_with(|| now + every.mul_f64(start_phase(self.user)));
                    if at > t + TIMER_SLACK {
                        return Ok(());
                    }
                    self.next_at = Some(at + every);
                    if t.saturating_duration_since(at) > LATE_SEND {
                        self.sh.counters.late_sends.fetch_add(1, Relaxed);
                    }
                    t_us.saturating_sub(t.saturating_duration_since(at).as_micros() as u64)
                }
            };
            let req = self.next_req;
            self.next_req += 1;
            self.started_sends += 1;
            let n = self.started_sends;
            let cmid = client_msg_id(self.user, n);
            let text = content(sent_us, plan.size);
            ws.send_text(send_frame(req, &cmid, &plan.to, &text))
                .await
                .map_err(|e| e.to_string())?;
            self.last_write = now;
            self.inflight.insert(req, Inflight { n, sent_us });
            let k = &self.sh.counters;
            k.sent.fetch_add(1, Relaxed);
            k.inflight.fetch_add(1, Relaxed);
        }
    }

    /// When the loop must wake up at the latest.
    fn next_wake(&self, c: &Ctl, now: Instant) -> Instant {
        let mut at = now + Duration::from_millis(500);
        if let Some(since) = self.ack_since {
            at = at.min(since + ACK_DELAY);
        }
        if let Some(plan) = &self.plan
            && c.send[plan.class]
            && let Some(next) = self.next_at
            && self.inflight.len() < plan.window
        {
            at = at.min(next.checked_sub(TIMER_SLACK).unwrap_or(next));
        }
        if let Some(r) = self.retries.iter().map(|(t, _)| *t).min() {
            at = at.min(r);
        }
        at.max(now)
    }

    fn ack_due(&self, now: Instant) -> bool {
        self.ack_pending >= ACK_BATCH || self.ack_since.is_some_and(|s| now >= s + ACK_DELAY)
    }

    /// Acknowledges the inbox and every read fan-out conversation up to where they are
    /// complete.
    async fn flush_acks(&mut self, ws: &mut WsConn) -> Result<(), String> {
        if self.inbox_contig > self.inbox_acked {
            ws.send_text(format!(
                r#"{{"type":"ack","user_seq":{}}}"#,
                self.inbox_contig
            ))
            .await
            .map_err(|e| e.to_string())?;
            self.inbox_acked = self.inbox_contig;
        }
        for (conv, t) in self.r.convs.iter_mut() {
            if let Some(c) = t.contig
                && c > t.acked
                && t.read_fanout
            {
                ws.send_text(json!({"type": "ack", "conversation_id": conv, "seq": c}).to_string())
                    .await
                    .map_err(|e| e.to_string())?;
                t.acked = c;
            }
        }
        self.ack_pending = 0;
        self.ack_since = None;
        self.last_write = Instant::now();
        Ok(())
    }

    fn want_ack(&mut self) {
        self.ack_pending += 1;
        if self.ack_since.is_none() {
            self.ack_since = Some(Instant::now());
        }
    }

    fn handle(&mut self, frame: Incoming, text: &str) {
        match frame.kind.as_ref() {
            "msg" => self.on_push(&frame, text),
            "send_ack" => self.on_send_ack(&frame, text),
            "error" => self.on_error(&frame, text),
            "kicked" => self.fail(format!("kicked: {text}")),
            _ => {}
        }
    }

    fn on_push(&mut self, frame: &Incoming, text: &str) {
        let Some(m) = &frame.message else {
            self.fail(format!("malformed push: {text}"));
            return;
        };
        let (conv, seq) = (m.conversation_id.as_ref(), m.seq);
        let now = now_us();
        // Looked up first: an entry() would allocate the key for every push.
        if !self.r.convs.contains_key(conv) {
            self.r.convs.insert(conv.to_owned(), ConvTrack::default());
        }
        let track = self.r.convs.get_mut(conv).expect("inserted above");
        let (new, ooo) = track.record(seq);
        match frame.user_seq {
            // Through the inbox: acknowledged cumulatively up to where the inbox is complete.
            Some(us) => {
                self.inbox.insert(us);
                while self.inbox.contains(self.inbox_contig + 1) {
                    self.inbox_contig += 1;
                }
            }
            None => track.read_fanout = true,
        }
        self.want_ack();
        if !new {
            self.r.duplicated += 1;
            return;
        }
        if ooo {
            self.r.out_of_order += 1;
        }
        if m.kind != "text" {
            return;
        }
        let Some(sent_us) = sent_us_of(&m.content) else {
            return;
        };
        let k = &self.sh.counters;
        k.deliveries.fetch_add(1, Relaxed);
        if m.sender == self.user {
            return;
        }
        k.delivered.fetch_add(1, Relaxed);
        let lat = now.saturating_sub(sent_us).min(u64::from(u32::MAX)) as u32;
        if self.sh.trace.load(Relaxed) {
            let late = late_us_of(&m.content).unwrap_or(0).min(u64::from(u32::MAX)) as u32;
            self.r.trace.push((sent_us, lat, late));
        }
        if self.sh.in_warmup(sent_us) {
            return;
        }
        let b = self.bucket(conv.starts_with('g'), sent_us);
        self.r.delivery_lat[b].push(lat);
        if lat > SLOW_DELIVERY_US {
            k.slow.fetch_add(1, Relaxed);
        }
        if self.completion {
            self.r
                .completion
                .entry(conv.to_owned())
                .or_default()
                .push((seq, lat));
        }
    }

    fn on_send_ack(&mut self, frame: &Incoming, text: &str) {
        let Some(req) = frame.req else {
            return;
        };
        let Some(f) = self.inflight.remove(&req) else {
            return;
        };
        self.retries.retain(|(_, r)| *r != req);
        let (Some(conv), Some(seq)) = (frame.conversation_id.as_deref(), frame.seq) else {
            self.fail(format!("malformed send_ack: {text}"));
            return;
        };
        if !self.sh.in_warmup(f.sent_us) {
            let lat = now_us().saturating_sub(f.sent_us).min(u64::from(u32::MAX)) as u32;
            let b = self.bucket(conv.starts_with('g'), f.sent_us);
            self.r.ack_lat[b].push(lat);
        }
        match self.r.acked.get_mut(conv) {
            Some(seqs) => seqs.push(seq),
            None => {
                self.r.acked.insert(conv.to_owned(), vec![seq]);
            }
        }
        let k = &self.sh.counters;
        k.acked.fetch_add(1, Relaxed);
        k.inflight.fetch_sub(1, Relaxed);
        k.expected.fetch_add(self.r.fanout, Relaxed);
    }

    fn on_error(&mut self, frame: &Incoming, text: &str) {
        let code = frame.code.as_deref().unwrap_or("?").to_owned();
        let Some(req) = frame.req.filter(|r| self.inflight.contains_key(r)) else {
            self.fail(format!("error frame: {text}"));
            return;
        };
        if code == "rate_limited" || code == "unavailable" {
            // Safe to retry with the same client_msg_id (PROTOCOL.md section 1).
            let wait = frame.retry_after_ms.unwrap_or(50).clamp(1, 5_000);
            self.retries
                .push((Instant::now() + Duration::from_millis(wait), req));
            self.sh.counters.retried.fetch_add(1, Relaxed);
            return;
        }
        self.inflight.remove(&req);
        *self.r.send_errors.entry(code).or_default() += 1;
        let k = &self.sh.counters;
        k.inflight.fetch_sub(1, Relaxed);
        k.errors.fetch_add(1, Relaxed);
    }
}

/// Where in its send interval a connection starts, in [0, 1): its user id's Fibonacci hash
/// (ids are large and consecutive; a float product of them would keep no fraction), so
/// consecutive users land spread evenly over the interval.
/// A `send` frame's text, written straight from its fields (not through a JSON tree: a
/// map of six entries built and dropped for each of tens of thousands of sends a second).
fn send_frame(req: i64, client_msg_id: &str, to: &Value, content: &str) -> String {
    #[derive(serde::Serialize)]
    struct Send<'a> {
        #[serde(rename = "type")]
        kind_of_frame: &'static str,
        req: i64,
        client_msg_id: &'a str,
        to: &'a Value,
        kind: &'static str,
        content: &'a str,
    }
    serde_json::to_string(&Send {
        kind_of_frame: "send",
        req,
        client_msg_id,
        to,
        kind: "text",
        content,
    })
    .expect("a send frame serializes")
}

fn start_phase(user: u64) -> f64 {
    (user.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as f64 / (1u64 << 53) as f64
}

/// The fields of a server frame the load tool reads, parsed without building a JSON tree
/// (the tool parses every push; a `serde_json::Value` per frame cost most of a core).
#[derive(serde::Deserialize)]
struct Incoming<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
    req: Option<i64>,
    user_seq: Option<u64>,
    #[serde(borrow)]
    conversation_id: Option<std::borrow::Cow<'a, str>>,
    seq: Option<u64>,
    #[serde(borrow)]
    code: Option<std::borrow::Cow<'a, str>>,
    retry_after_ms: Option<u64>,
    /// A push's message; an `error` frame's `message` (its text) reads as `None`.
    #[serde(borrow, default, deserialize_with = "pushed_message")]
    message: Option<PushedMessage<'a>>,
}

/// `message` as a push's object, or `None` for any other JSON (an error frame's text).
fn pushed_message<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<PushedMessage<'de>>, D::Error> {
    use serde::de::{MapAccess, Visitor, value::MapAccessDeserializer};
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<PushedMessage<'de>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a message object or text")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            serde::Deserialize::deserialize(MapAccessDeserializer::new(map)).map(Some)
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(V)
}

#[derive(serde::Deserialize)]
struct PushedMessage<'a> {
    #[serde(borrow)]
    conversation_id: std::borrow::Cow<'a, str>,
    seq: u64,
    sender: u64,
    #[serde(borrow)]
    kind: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    content: std::borrow::Cow<'a, str>,
}

/// The progress line of the message scenarios: totals, and the delivery rate and the
/// deliveries slower than [`SLOW_DELIVERY_US`] since the last line.
pub fn progress(shared: Arc<Shared>) -> super::Progress {
    let mut last = (0.0, 0u64, 0u64);
    super::Progress::start(move |t| {
        let k = &shared.counters;
        let delivered = k.delivered.load(Relaxed);
        let slow = k.slow.load(Relaxed);
        let rate = (delivered - last.1) as f64 / (t - last.0).max(1e-3);
        let slow_now = slow - last.2;
        last = (t, delivered, slow);
        format!(
            "sent {}  acked {}  delivered {}  ({rate:.0}/s, {slow_now} over {} ms)  in flight {}  retried {}  errors {}",
            k.sent.load(Relaxed),
            k.acked.load(Relaxed),
            delivered,
            SLOW_DELIVERY_US / 1000,
            k.inflight.load(Relaxed),
            k.retried.load(Relaxed),
            k.errors.load(Relaxed),
        )
    })
}

/// The merged records of a run.
#[derive(Default)]
pub struct Outcome {
    pub checks: Checks,
    /// By bucket (see `SINGLE_P1` ...), µs.
    pub ack_lat: [Vec<u32>; 4],
    pub delivery_lat: [Vec<u32>; 4],
    /// Per acknowledged message reaching every other member: send→last member, µs.
    pub completion: Vec<u32>,
    pub acked: u64,
    /// Every connection's `ConnReport::trace`, merged.
    pub trace: Vec<(u64, u32, u32)>,
}

/// Merges the reports and counts lost, duplicated and out-of-order pushes, and errors.
pub fn evaluate(reports: Vec<ConnReport>) -> Outcome {
    let mut out = Outcome::default();
    // Every acknowledged seq, per conversation, with the fan-out of its sender's plan.
    let mut acked: HashMap<String, (u64, Vec<u64>)> = HashMap::new();
    for r in &reports {
        for (conv, seqs) in &r.acked {
            let e = acked.entry(conv.clone()).or_insert((r.fanout, Vec::new()));
            e.1.extend_from_slice(seqs);
        }
    }
    for (_, seqs) in acked.values_mut() {
        seqs.sort_unstable();
        let before = seqs.len();
        seqs.dedup();
        out.checks
            .error("seq given to two messages", (before - seqs.len()) as u64);
        out.acked += seqs.len() as u64;
    }
    let mut done: HashMap<&str, HashMap<u64, (u32, u64)>> = HashMap::new();
    let mut failures = 0;
    for r in &reports {
        out.checks.duplicated += r.duplicated;
        out.checks.out_of_order += r.out_of_order;
        out.checks.error("unanswered sends", r.unacked);
        for (code, n) in &r.send_errors {
            out.checks.error(format!("send refused: {code}"), *n);
        }
        if let Some(f) = &r.failure {
            out.checks.error("connection failed", 1);
            failures += 1;
            if failures <= 5 {
                super::note(format!("user {}: {f}", r.user));
            }
        }
        if r.online_throughout {
            for conv in &r.expect {
                let Some((_, seqs)) = acked.get(conv) else {
                    continue;
                };
                let track = r.convs.get(conv);
                let missing = seqs
                    .iter()
                    .filter(|s| !track.is_some_and(|t| t.seen.contains(**s)))
                    .count();
                out.checks.lost += missing as u64;
            }
        }
        for (conv, items) in &r.completion {
            let per = done.entry(conv.as_str()).or_default();
            for (seq, lat) in items {
                let e = per.entry(*seq).or_insert((0, 0));
                e.0 = e.0.max(*lat);
                e.1 += 1;
            }
        }
    }
    if failures > 5 {
        super::note(format!("... and {} more failed connections", failures - 5));
    }
    for (conv, per) in &done {
        let Some((fanout, seqs)) = acked.get(*conv) else {
            continue;
        };
        for s in seqs {
            if let Some((max, n)) = per.get(s)
                && *n + 1 >= *fanout
            {
                out.completion.push(*max);
            }
        }
    }
    for mut r in reports {
        for b in 0..4 {
            out.ack_lat[b].append(&mut r.ack_lat[b]);
            out.delivery_lat[b].append(&mut r.delivery_lat[b]);
        }
        out.trace.append(&mut r.trace);
    }
    out
}

/// Writes `trace` as CSV in send order, times in ms from `start_us` (see [`LatencyArgs`]).
fn write_trace(
    file: std::fs::File,
    trace: &mut [(u64, u32, u32)],
    start_us: u64,
) -> std::io::Result<()> {
    trace.sort_unstable();
    let mut f = std::io::BufWriter::new(file);
    writeln!(f, "sent_ms,latency_ms,late_ms")?;
    for (sent_us, lat, late) in trace.iter() {
        let sent = *sent_us as i64 - start_us as i64;
        let ms = |us: u32| f64::from(us) / 1e3;
        writeln!(
            f,
            "{:.3},{:.3},{:.3}",
            sent as f64 / 1e3,
            ms(*lat),
            ms(*late)
        )?;
    }
    f.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_phases_of_consecutive_users_spread_over_the_interval() {
        let base = 5_861_415_005_000_000u64;
        let mut tenths = [0u32; 10];
        for u in base..base + 200 {
            let p = start_phase(u);
            assert!((0.0..1.0).contains(&p));
            tenths[(p * 10.0) as usize] += 1;
        }
        // 200 users: every tenth of the interval gets some, none gets a crowd.
        assert!(tenths.iter().all(|&n| (10..=30).contains(&n)), "{tenths:?}");
    }

    #[test]
    fn error_frames_parse_beside_pushes() {
        let err = r#"{"type":"error","req":7,"code":"rate_limited","message":"too many messages; slow down","retry_after_ms":1}"#;
        let f: Incoming = serde_json::from_str(err).expect("error frame");
        assert_eq!(f.kind, "error");
        assert_eq!(
            (f.req, f.code.as_deref(), f.retry_after_ms),
            (Some(7), Some("rate_limited"), Some(1))
        );
        assert!(f.message.is_none());
        let push = r#"{"type":"msg","user_seq":3,"message":{"conversation_id":"1-2","seq":5,"sender":1,"kind":"text","content":"hi"}}"#;
        let f: Incoming = serde_json::from_str(push).expect("push frame");
        let m = f.message.expect("message");
        assert_eq!((m.conversation_id.as_ref(), m.seq, m.sender), ("1-2", 5, 1));
        assert_eq!(f.user_seq, Some(3));
    }

    #[test]
    fn a_send_frame_is_the_protocol_s_send() {
        let text = send_frame(7, "b1-7", &json!({"user": 2}), "hi \"there\"");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v,
            json!({"type": "send", "req": 7, "client_msg_id": "b1-7", "to": {"user": 2},
                "kind": "text", "content": "hi \"there\""})
        );
    }

    #[test]
    fn seq_set_and_tracking() {
        let mut s = SeqSet::default();
        assert!(s.insert(1));
        assert!(!s.insert(1));
        assert!(s.insert(200));
        assert!(s.contains(200) && !s.contains(199));

        let mut t = ConvTrack::default();
        assert_eq!(t.record(5), (true, false));
        assert_eq!(t.record(7), (true, false));
        assert_eq!(t.contig, Some(5));
        assert_eq!(t.record(6), (true, true));
        assert_eq!(t.contig, Some(7));
        assert_eq!(t.record(6), (false, false));
    }

    #[test]
    fn lost_and_duplicates_are_counted() {
        let mut sender = ConnReport {
            user: 1,
            online_throughout: true,
            fanout: 2,
            expect: vec!["1-2".into()],
            ..ConnReport::default()
        };
        sender.acked.insert("1-2".into(), vec![1, 2, 3]);
        let mut t = ConvTrack::default();
        for s in [1, 2, 3] {
            t.record(s);
        }
        sender.convs.insert("1-2".into(), t);
        let mut peer = ConnReport {
            user: 2,
            online_throughout: true,
            expect: vec!["1-2".into()],
            duplicated: 1,
            ..ConnReport::default()
        };
        let mut t = ConvTrack::default();
        t.record(1);
        t.record(3);
        peer.convs.insert("1-2".into(), t);
        let out = evaluate(vec![sender, peer]);
        assert_eq!(out.checks.lost, 1);
        assert_eq!(out.checks.duplicated, 1);
        assert_eq!(out.acked, 3);
        assert!(!out.checks.ok());
    }
}

//! `pigeon bench SCENARIO`: load scenarios that drive a running server (or one they spawn on
//! a temporary data directory), print a live progress line to stderr, then a result table
//! (and, with `--json FILE`, the same figures as JSON).
//!
//! Every run also checks delivery: each receiving connection records, per conversation, the
//! seqs pushed to it; at the end these are compared with the seqs acknowledged to the senders.
//! A message acknowledged but never pushed to a member that was online throughout is *lost*,
//! a `(conversation, seq)` pushed twice to one connection is *duplicated*, and a first push of
//! a seq lower than an earlier one of the same conversation is *out of order*. Any of them, or
//! any error (a dropped connection, a refused send), makes the run fail with exit code 1.
//!
//! Scenarios only ever talk to 127.0.0.0/8 and stop by themselves (durations and counts).
//! `disk` is the exception to all of this: it drives no server, only times the syncs of a
//! file, so that a run's tail can be set against what the disk alone does.

mod catchup;
mod commits;
mod connections;
mod direct;
mod disk;
mod driver;
mod group;
mod isolation;
mod procfs;
mod report;
mod target;

use futures_util::StreamExt;
use pigeon_client::Http;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

pub use report::Report;
pub use target::Target;

/// What a bench step fails with: a sentence for the operator.
pub type Res<T> = Result<T, String>;

/// The most connections one load process opens: it may hold about 19 900 sockets under the
/// usual 20 000 open-files hard limit, and needs a few files of its own.
pub const MAX_CONNECTIONS_PER_PROCESS: usize = 19_000;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub scenario: Scenario,
}

#[derive(clap::Subcommand)]
pub enum Scenario {
    /// Open N idle connections and hold them with pings: server memory per connection, idle CPU.
    Connections(connections::Args),
    /// Users in pairs sending single-chat messages: send→ack and send→delivered latency.
    Direct(direct::Args),
    /// Groups with every member online: deliveries per second, time until the last member has it.
    Group(group::Args),
    /// A user offline for K messages reconnects: messages per second pulled (sync + pull).
    Catchup(catchup::Args),
    /// Single chats' latency with and without a flood into a large group (two phases).
    Isolation(isolation::Args),
    /// The disk's own sync latency, no server: a file appended to and synced as the journal is.
    Disk(disk::Args),
}

/// Options every scenario takes.
#[derive(clap::Args, Clone, Debug)]
pub struct Common {
    /// Server to drive (must be on 127.0.0.0/8); ignored with --spawn
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// Admin key of --server
    #[arg(long, env = "PIGEON_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Start a server on a temporary data directory (fsync durability, 127.0.0.1:0, a
    /// generated admin key) as a child `pigeon serve`, so its CPU and memory are its own
    #[arg(long)]
    pub spawn: bool,
    /// With --spawn: run the server inside this process (pigeon_server::start) instead of as a
    /// child; its CPU and memory figures then include the load generator
    #[arg(long, requires = "spawn")]
    pub in_process: bool,
    /// Pid of --server, to read its CPU and memory from /proc (known by itself with --spawn)
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// With --spawn: groups with more members use read fan-out [server default: 500]
    #[arg(long, requires = "spawn")]
    pub fanout_write_max_members: Option<u64>,
    /// Also write the result as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Longest wait, once sending stops, for the outstanding acks and pushes
    #[arg(long, default_value_t = 15)]
    pub drain_secs: u64,
}

pub async fn run(args: BenchArgs) -> ExitCode {
    // The tool holds a socket a connection (and, with --in-process, the server one more):
    // as the server does at start, the soft limit goes up to the hard one.
    pigeon_server::open_files::raise_limit();
    let result = match args.scenario {
        Scenario::Connections(a) => connections::run(a).await,
        Scenario::Direct(a) => direct::run(a).await,
        Scenario::Group(a) => group::run(a).await,
        Scenario::Catchup(a) => catchup::run(a).await,
        Scenario::Isolation(a) => isolation::run(a).await,
        Scenario::Disk(a) => disk::run(a).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pigeon bench: {e}");
            ExitCode::from(2)
        }
    }
}

/// Says something on stderr (where the progress goes), prefixed.
pub fn note(msg: impl std::fmt::Display) {
    eprintln!("pigeon bench: {msg}");
}

/// A random base for this run's user ids, so that runs against the same server do not share
/// users (ids stay below 2^53 for `base + 999 999`).
pub fn user_id_base() -> u64 {
    rand::random_range(1_000_000u64..9_000_000_000) * 1_000_000
}

/// Registers `ids` and mints a token for each (in order), a few calls at a time.
pub async fn make_users(admin: &Http, ids: &[u64]) -> Res<Vec<String>> {
    if ids.len() >= 1000 {
        note(format!("registering {} users", ids.len()));
    }
    let results: Vec<Res<String>> = futures_util::stream::iter(ids.iter().copied())
        .map(|id| {
            let admin = admin.clone();
            async move {
                admin
                    .upsert_user(id, &format!("bench{id}"))
                    .await
                    .map_err(|e| format!("cannot register user {id}: {e}"))?;
                admin
                    .mint_token(id, 86_400)
                    .await
                    .map_err(|e| format!("cannot mint a token for user {id}: {e}"))
            }
        })
        .buffered(32)
        .collect()
        .await;
    results.into_iter().collect()
}

/// The content of a bench message: the send time (microseconds since the bench epoch) and how
/// late the tool makes it (µs past the send time, 0 if early), padded to `size` bytes, so
/// that any receiver can tell the send→delivered latency and the tool's part of it. 32 bytes
/// at the least.
pub fn content(sent_us: u64, size: usize) -> String {
    let late_us = now_us().saturating_sub(sent_us).min(LATE_US_MAX);
    let mut s = format!("pb{sent_us:020}{late_us:010}");
    while s.len() < size {
        s.push('x');
    }
    s
}

/// The most lateness a content carries (ten digits of µs).
const LATE_US_MAX: u64 = 9_999_999_999;

/// The send time carried by a bench message's content.
pub fn sent_us_of(content: &str) -> Option<u64> {
    content.strip_prefix("pb")?.get(..20)?.parse().ok()
}

/// How late after its send time the tool made a bench message's content (it is sent at
/// once): the part of its latency spent in the load tool before the server saw it.
pub fn late_us_of(content: &str) -> Option<u64> {
    content.strip_prefix("pb")?.get(20..30)?.parse().ok()
}

/// Microseconds since the bench epoch (the first call).
pub fn now_us() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// Runs `line` every second on a task that prints it to stderr, until the handle is dropped.
pub struct Progress(tokio::task::JoinHandle<()>);

impl Progress {
    pub fn start(mut line: impl FnMut(f64) -> String + Send + 'static) -> Progress {
        let started = Instant::now();
        Progress(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let t = started.elapsed().as_secs_f64();
                eprintln!("[{t:6.1}s] {}", line(t));
            }
        }))
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_round_trips() {
        let c = content(123_456, 64);
        assert_eq!(c.len(), 64);
        assert_eq!(sent_us_of(&c), Some(123_456));
        assert_eq!(sent_us_of(&content(7, 0)), Some(7));
        assert_eq!(sent_us_of("hello"), None);
        // Made now for a send due a second from now: not late. Due long ago: late by all of it.
        let ahead = now_us() + 1_000_000;
        assert_eq!(late_us_of(&content(ahead, 0)), Some(0));
        let late = late_us_of(&content(0, 0)).unwrap();
        assert!(
            late >= now_us().saturating_sub(1_000_000) && late <= now_us(),
            "{late}"
        );
        assert_eq!(late_us_of("pb00000000000000000007"), None);
    }
}

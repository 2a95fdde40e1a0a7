//! Settings of `pigeon serve`: each one a flag, a `PIGEON_*` environment variable or a key of
//! the TOML file given with `--config`; flags win over the environment, which wins over the
//! file, which wins over the defaults.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// How commits reach the disk (`--durability`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityMode {
    /// fsync every group commit: acknowledged messages survive power loss.
    Fsync,
    /// Leave flushing to the OS: survives a crash of the process, not of the machine.
    Os,
}

/// The command-line and environment layer. Every field is optional so that the file and the
/// defaults can fill what is not given.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (keys as the flags, with `_` or `-`).
    #[arg(long, env = "PIGEON_CONFIG")]
    pub config: Option<PathBuf>,
    /// HTTP + WebSocket address, IP:port or host:port [default: 127.0.0.1:8080]
    #[arg(long, env = "PIGEON_LISTEN", value_parser = parse_listen)]
    pub listen: Option<SocketAddr>,
    /// Where the embedded store lives [default: ./data]
    #[arg(long, env = "PIGEON_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Secret for the admin API [default: generated once, printed, kept in the data dir]
    #[arg(long, env = "PIGEON_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Groups with more members use read fan-out [default: 500]
    #[arg(long, env = "PIGEON_FANOUT_WRITE_MAX_MEMBERS")]
    pub fanout_write_max_members: Option<u64>,
    /// How long a sender may recall [default: 120]
    #[arg(long, env = "PIGEON_RECALL_WINDOW_SECS")]
    pub recall_window_secs: Option<u64>,
    /// How long a sender may edit [default: 86400]
    #[arg(long, env = "PIGEON_EDIT_WINDOW_SECS")]
    pub edit_window_secs: Option<u64>,
    /// Resend an unacknowledged push after this [default: 3000]
    #[arg(long, env = "PIGEON_PUSH_RETRY_MS")]
    pub push_retry_ms: Option<u64>,
    /// Larger content gets payload_too_large [default: 65536]
    #[arg(long, env = "PIGEON_MAX_CONTENT_BYTES")]
    pub max_content_bytes: Option<usize>,
    /// Heartbeat announced in hello; a connection silent for two is closed [default: 30000]
    #[arg(long, env = "PIGEON_HEARTBEAT_MS")]
    pub heartbeat_ms: Option<u64>,
    /// This node's number in message ids, 0..=1023: nodes that hand out ids side by side must each have their own [default: 0]
    #[arg(long, env = "PIGEON_NODE_ID")]
    pub node_id: Option<u16>,
    /// Partitions of each tier (single chats, small, medium and large groups), 1..=16: each decides its conversations' commands on its own [default: 2]
    #[arg(long, env = "PIGEON_PARTITIONS_PER_TIER")]
    pub partitions_per_tier: Option<usize>,
    /// fsync (default) or os
    #[arg(long, env = "PIGEON_DURABILITY", value_enum)]
    pub durability: Option<DurabilityMode>,
    /// Journaled batches not yet in the tables, in KiB, past which sends wait (then fail
    /// `unavailable`) until the tables catch up [default: 65536]
    #[arg(long, env = "PIGEON_JOURNAL_BACKLOG_KIB")]
    pub journal_backlog_kib: Option<usize>,
    /// Most WebSocket connections held at once [default: 100000]
    #[arg(long, env = "PIGEON_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Most TCP connections open at once, HTTP and WebSocket; past it a new client is answered 503 unavailable (a few at once; more wait to be accepted) until one closes [default: the open-file limit less 512 kept for the store, or less a quarter of a limit under 2048]
    #[arg(long, env = "PIGEON_MAX_OPEN_CONNECTIONS")]
    pub max_open_connections: Option<usize>,
    /// Most WebSocket connections one user may hold at once, over all their devices; one more is refused with 429 `rate_limited` [default: 100]
    #[arg(long, env = "PIGEON_MAX_CONNECTIONS_PER_USER")]
    pub max_connections_per_user: Option<usize>,
    /// Frames one WebSocket connection may have waiting to be written, in KiB; past it the connection is closed (1013) and its client catches up by sync and pull [default: 8192]
    #[arg(long, env = "PIGEON_MAX_OUTBOX_KIB")]
    pub max_outbox_kib: Option<usize>,
    /// Frames one user's connections may hold together (waiting, or kept for resending; a frame shared by their devices counts once), in KiB; past it their connections that are behind by more than their share are closed [default: 16384]
    #[arg(long, env = "PIGEON_MAX_OUTBOX_KIB_PER_USER")]
    pub max_outbox_kib_per_user: Option<usize>,
    /// Frames all connections may hold together (a frame shared by several counts once), in MiB; past it the connections that are behind by more than their share are closed [default: 64]
    #[arg(long, env = "PIGEON_MAX_OUTBOX_MIB_TOTAL")]
    pub max_outbox_mib_total: Option<usize>,
    /// Longest token lifetime the admin API mints, in seconds [default: 31536000, a year]
    #[arg(long, env = "PIGEON_MAX_TOKEN_TTL_SECS")]
    pub max_token_ttl_secs: Option<u64>,
    /// Sends (and other writes: edits, reads, group changes) one user may make per second, over all their devices, with bursts of ten times that; 0 turns the limit off [default: 1000]
    #[arg(long, env = "PIGEON_SEND_RATE_PER_SEC")]
    pub send_rate_per_sec: Option<u32>,
    /// URL that gets a JSON POST for messages reaching users with no connected device
    #[arg(long, env = "PIGEON_OFFLINE_WEBHOOK_URL")]
    pub offline_webhook_url: Option<String>,
    /// Timeout of one offline webhook call [default: 2000]
    #[arg(long, env = "PIGEON_OFFLINE_WEBHOOK_TIMEOUT_MS")]
    pub offline_webhook_timeout_ms: Option<u64>,
}

/// A listen address: an IP address and port, or a host name and port (`localhost:8080`),
/// resolved once at start to one address: its first IPv4 one if it has any (clients of
/// `localhost` mostly try 127.0.0.1), else its first.
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("{s:?} is not an address (IP:port or host:port): {e}"))?
        .collect();
    listen_choice(&addrs).ok_or_else(|| format!("{s:?} resolves to no address"))
}

/// Of the addresses a name resolves to, the first IPv4 one, else the first.
fn listen_choice(addrs: &[SocketAddr]) -> Option<SocketAddr> {
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
}

fn listen_from_file<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<SocketAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        Some(s) => parse_listen(&s).map(Some).map_err(serde::de::Error::custom),
        None => Ok(None),
    }
}

/// The file layer: the same keys, all optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default, deserialize_with = "listen_from_file")]
    listen: Option<SocketAddr>,
    #[serde(alias = "data-dir")]
    data_dir: Option<PathBuf>,
    #[serde(alias = "admin-key")]
    admin_key: Option<String>,
    #[serde(alias = "fanout-write-max-members")]
    fanout_write_max_members: Option<u64>,
    #[serde(alias = "recall-window-secs")]
    recall_window_secs: Option<u64>,
    #[serde(alias = "edit-window-secs")]
    edit_window_secs: Option<u64>,
    #[serde(alias = "push-retry-ms")]
    push_retry_ms: Option<u64>,
    #[serde(alias = "max-content-bytes")]
    max_content_bytes: Option<usize>,
    #[serde(alias = "heartbeat-ms")]
    heartbeat_ms: Option<u64>,
    durability: Option<DurabilityMode>,
    #[serde(alias = "node-id")]
    node_id: Option<u16>,
    #[serde(alias = "partitions-per-tier")]
    partitions_per_tier: Option<usize>,
    #[serde(alias = "journal-backlog-kib")]
    journal_backlog_kib: Option<usize>,
    #[serde(alias = "max-connections")]
    max_connections: Option<usize>,
    #[serde(alias = "max-open-connections")]
    max_open_connections: Option<usize>,
    #[serde(alias = "max-connections-per-user")]
    max_connections_per_user: Option<usize>,
    #[serde(alias = "max-outbox-kib")]
    max_outbox_kib: Option<usize>,
    #[serde(alias = "max-outbox-kib-per-user")]
    max_outbox_kib_per_user: Option<usize>,
    #[serde(alias = "max-outbox-mib-total")]
    max_outbox_mib_total: Option<usize>,
    #[serde(alias = "max-token-ttl-secs")]
    max_token_ttl_secs: Option<u64>,
    #[serde(alias = "send-rate-per-sec")]
    send_rate_per_sec: Option<u32>,
    #[serde(alias = "offline-webhook-url")]
    offline_webhook_url: Option<String>,
    #[serde(alias = "offline-webhook-timeout-ms")]
    offline_webhook_timeout_ms: Option<u64>,
}

/// The settings in force.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub admin_key: Option<String>,
    pub fanout_write_max_members: u64,
    pub recall_window_secs: u64,
    pub edit_window_secs: u64,
    pub push_retry_ms: u64,
    pub max_content_bytes: usize,
    pub heartbeat_ms: u64,
    pub durability: DurabilityMode,
    pub node_id: u16,
    pub partitions_per_tier: usize,
    pub journal_backlog_kib: usize,
    pub max_connections: usize,
    /// `None`: what the open-file limit leaves (`open_files::connections_for`).
    pub max_open_connections: Option<usize>,
    pub max_connections_per_user: usize,
    pub max_outbox_kib: usize,
    pub max_outbox_kib_per_user: usize,
    pub max_outbox_mib_total: usize,
    pub max_token_ttl_secs: u64,
    pub offline_webhook_url: Option<String>,
    pub offline_webhook_timeout_ms: u64,
    pub send_rate_per_sec: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: PathBuf::from("./data"),
            admin_key: None,
            fanout_write_max_members: 500,
            recall_window_secs: 120,
            edit_window_secs: 86_400,
            push_retry_ms: 3_000,
            max_content_bytes: 65_536,
            heartbeat_ms: 30_000,
            durability: DurabilityMode::Fsync,
            node_id: 0,
            partitions_per_tier: crate::pipeline::DEFAULT_PARTITIONS_PER_TIER,
            journal_backlog_kib: pigeon_store_sqlite::DEFAULT_BACKLOG_BYTES / 1024,
            max_connections: 100_000,
            max_open_connections: None,
            max_connections_per_user: 100,
            max_outbox_kib: 8 * 1024,
            max_outbox_kib_per_user: 16 * 1024,
            max_outbox_mib_total: 64,
            max_token_ttl_secs: 365 * 86_400,
            offline_webhook_url: None,
            offline_webhook_timeout_ms: 2_000,
            send_rate_per_sec: 1000,
        }
    }
}

/// A setting that cannot be used, said plainly.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// What connections' outboxes may hold, in bytes (see `outbox.rs`).
    pub fn outbox_bounds(&self) -> crate::outbox::OutboxBounds {
        crate::outbox::OutboxBounds {
            connection: self.max_outbox_kib.saturating_mul(1024),
            user: self.max_outbox_kib_per_user.saturating_mul(1024),
            server: self.max_outbox_mib_total.saturating_mul(1 << 20),
        }
    }

    /// Merges flags/env over the file over the defaults, then checks the result.
    pub fn resolve(args: &ServeArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                toml::from_str::<FileConfig>(&text).map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source,
                })?
            }
            None => FileConfig::default(),
        };
        let d = Config::default();
        let cfg = Config {
            listen: args.listen.or(file.listen).unwrap_or(d.listen),
            data_dir: args
                .data_dir
                .clone()
                .or(file.data_dir)
                .unwrap_or(d.data_dir),
            admin_key: args.admin_key.clone().or(file.admin_key),
            fanout_write_max_members: args
                .fanout_write_max_members
                .or(file.fanout_write_max_members)
                .unwrap_or(d.fanout_write_max_members),
            recall_window_secs: args
                .recall_window_secs
                .or(file.recall_window_secs)
                .unwrap_or(d.recall_window_secs),
            edit_window_secs: args
                .edit_window_secs
                .or(file.edit_window_secs)
                .unwrap_or(d.edit_window_secs),
            push_retry_ms: args
                .push_retry_ms
                .or(file.push_retry_ms)
                .unwrap_or(d.push_retry_ms),
            max_content_bytes: args
                .max_content_bytes
                .or(file.max_content_bytes)
                .unwrap_or(d.max_content_bytes),
            heartbeat_ms: args
                .heartbeat_ms
                .or(file.heartbeat_ms)
                .unwrap_or(d.heartbeat_ms),
            durability: args.durability.or(file.durability).unwrap_or(d.durability),
            node_id: args.node_id.or(file.node_id).unwrap_or(d.node_id),
            partitions_per_tier: args
                .partitions_per_tier
                .or(file.partitions_per_tier)
                .unwrap_or(d.partitions_per_tier),
            journal_backlog_kib: args
                .journal_backlog_kib
                .or(file.journal_backlog_kib)
                .unwrap_or(d.journal_backlog_kib),
            max_connections: args
                .max_connections
                .or(file.max_connections)
                .unwrap_or(d.max_connections),
            max_open_connections: args.max_open_connections.or(file.max_open_connections),
            max_connections_per_user: args
                .max_connections_per_user
                .or(file.max_connections_per_user)
                .unwrap_or(d.max_connections_per_user),
            max_outbox_kib: args
                .max_outbox_kib
                .or(file.max_outbox_kib)
                .unwrap_or(d.max_outbox_kib),
            max_outbox_kib_per_user: args
                .max_outbox_kib_per_user
                .or(file.max_outbox_kib_per_user)
                .unwrap_or(d.max_outbox_kib_per_user),
            max_outbox_mib_total: args
                .max_outbox_mib_total
                .or(file.max_outbox_mib_total)
                .unwrap_or(d.max_outbox_mib_total),
            max_token_ttl_secs: args
                .max_token_ttl_secs
                .or(file.max_token_ttl_secs)
                .unwrap_or(d.max_token_ttl_secs),
            offline_webhook_url: args
                .offline_webhook_url
                .clone()
                .or(file.offline_webhook_url),
            offline_webhook_timeout_ms: args
                .offline_webhook_timeout_ms
                .or(file.offline_webhook_timeout_ms)
                .unwrap_or(d.offline_webhook_timeout_ms),
            send_rate_per_sec: args
                .send_rate_per_sec
                .or(file.send_rate_per_sec)
                .unwrap_or(d.send_rate_per_sec),
        };
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        // Any non-empty key is taken (the protocol sets no length; a short one is warned of
        // at start, see `server::start`).
        if self.admin_key.as_ref().is_some_and(|k| k.trim().is_empty()) {
            return invalid("admin-key must not be empty");
        }
        if self.max_content_bytes == 0 || self.max_content_bytes > 1 << 20 {
            return invalid("max-content-bytes must be 1..=1048576 (a frame is at most 1 MiB)");
        }
        if self.push_retry_ms < 10 {
            return invalid("push-retry-ms must be at least 10");
        }
        if self.heartbeat_ms < 100 {
            return invalid("heartbeat-ms must be at least 100");
        }
        if let Some(url) = &self.offline_webhook_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return invalid("offline-webhook-url must be an http:// or https:// URL");
        }
        if self.max_connections == 0 {
            return invalid("max-connections must be at least 1");
        }
        if self.node_id > pigeon_core::snowflake::MAX_NODE {
            return invalid("node-id must be 0..=1023 (ten bits of every message id)");
        }
        if !(1..=crate::pipeline::MAX_PARTITIONS_PER_TIER).contains(&self.partitions_per_tier) {
            return invalid("partitions-per-tier must be 1..=16");
        }
        if self.max_open_connections == Some(0) {
            return invalid("max-open-connections must be at least 1");
        }
        if self.max_connections_per_user == 0 {
            return invalid("max-connections-per-user must be at least 1");
        }
        if self.max_outbox_kib == 0
            || self.max_outbox_kib_per_user == 0
            || self.max_outbox_mib_total == 0
        {
            return invalid(
                "max-outbox-kib, max-outbox-kib-per-user and max-outbox-mib-total must be at least 1",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_which_wins_over_defaults() {
        let dir = std::env::temp_dir().join(format!("pigeon-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.toml");
        std::fs::write(&path, "recall-window-secs = 5\npush_retry_ms = 700\n").unwrap();
        let args = ServeArgs {
            config: Some(path),
            push_retry_ms: Some(900),
            ..Default::default()
        };
        let cfg = Config::resolve(&args).unwrap();
        assert_eq!(cfg.recall_window_secs, 5);
        assert_eq!(cfg.push_retry_ms, 900);
        assert_eq!(cfg.edit_window_secs, 86_400);
    }

    #[test]
    fn unknown_file_keys_and_bad_values_are_refused() {
        let dir = std::env::temp_dir().join(format!("pigeon-cfg2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.toml");
        std::fs::write(&path, "recal_window = 5\n").unwrap();
        assert!(
            Config::resolve(&ServeArgs {
                config: Some(path),
                ..Default::default()
            })
            .is_err()
        );
        let args = ServeArgs {
            admin_key: Some(" ".into()),
            ..Default::default()
        };
        assert!(Config::resolve(&args).is_err());
        // A short key is a weak one, not an invalid one: the protocol sets no length.
        let args = ServeArgs {
            admin_key: Some("secret".into()),
            ..Default::default()
        };
        assert_eq!(
            Config::resolve(&args).unwrap().admin_key.as_deref(),
            Some("secret")
        );
        // No connection at all would be a server nobody can use.
        for args in [
            ServeArgs {
                max_connections: Some(0),
                ..Default::default()
            },
            ServeArgs {
                max_connections_per_user: Some(0),
                ..Default::default()
            },
        ] {
            let err = Config::resolve(&args).unwrap_err().to_string();
            assert!(err.contains("must be at least 1"), "{err}");
        }
        assert_eq!(Config::default().max_connections_per_user, 100);
    }

    /// PROTOCOL.md 2's table: the defaults of a server started with nothing given.
    #[test]
    fn nothing_given_is_the_protocol_s_defaults() {
        let cfg = Config::resolve(&ServeArgs::default()).unwrap();
        assert_eq!(cfg.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(cfg.data_dir, PathBuf::from("./data"));
        assert_eq!(
            cfg.admin_key, None,
            "generated at start and kept in the data dir"
        );
        assert_eq!(cfg.fanout_write_max_members, 500);
        assert_eq!(cfg.recall_window_secs, 120);
        assert_eq!(cfg.edit_window_secs, 86_400);
        assert_eq!(cfg.push_retry_ms, 3_000);
        assert_eq!(cfg.max_content_bytes, 65_536);
    }

    /// The bounds docs/PROTOCOL.md's Appendix B (Limits) gives for settings, each side of each.
    #[test]
    fn settings_are_refused_outside_their_bounds_and_taken_at_them() {
        let with = |f: fn(&mut ServeArgs)| {
            let mut args = ServeArgs::default();
            f(&mut args);
            Config::resolve(&args)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        for (refused, what) in [
            (with(|a| a.max_content_bytes = Some(0)), "max-content-bytes"),
            (
                with(|a| a.max_content_bytes = Some((1 << 20) + 1)),
                "max-content-bytes",
            ),
            (with(|a| a.push_retry_ms = Some(9)), "push-retry-ms"),
            (with(|a| a.heartbeat_ms = Some(99)), "heartbeat-ms"),
            (with(|a| a.node_id = Some(1024)), "node-id"),
            (
                with(|a| a.partitions_per_tier = Some(0)),
                "partitions-per-tier",
            ),
            (
                with(|a| a.partitions_per_tier = Some(17)),
                "partitions-per-tier",
            ),
        ] {
            let err = refused.unwrap_err();
            assert!(err.contains(what), "{err}");
        }
        with(|a| a.max_content_bytes = Some(1)).unwrap();
        with(|a| a.max_content_bytes = Some(1 << 20)).unwrap();
        with(|a| a.push_retry_ms = Some(10)).unwrap();
        with(|a| a.heartbeat_ms = Some(100)).unwrap();
        with(|a| a.node_id = Some(1023)).unwrap();
        with(|a| a.partitions_per_tier = Some(16)).unwrap();
    }

    #[test]
    fn a_listen_name_binds_its_ipv4_address_when_it_has_one() {
        let v6: SocketAddr = "[::1]:8080".parse().unwrap();
        let v4: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert_eq!(listen_choice(&[v6, v4]), Some(v4));
        assert_eq!(listen_choice(&[v6]), Some(v6));
        assert_eq!(listen_choice(&[]), None);
    }
}

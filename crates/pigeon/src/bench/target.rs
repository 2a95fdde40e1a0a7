//! The server a run drives: one given with `--server` (on 127.0.0.0/8 only), or one started
//! for the run on a temporary data directory, as a child `pigeon serve` (default) or inside
//! this process (`--in-process`).

use super::{Common, Res, note};
use clap::{CommandFactory, Parser};
use pigeon_client::Http;
use pigeon_server::{Config, Running, ServeArgs};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

/// `pigeon serve`'s options alone, to build a configuration the way the binary does.
#[derive(Parser)]
#[command(name = "serve")]
struct ServeOnly {
    #[command(flatten)]
    args: ServeArgs,
}

pub struct Target {
    pub addr: SocketAddr,
    pub admin: Http,
    /// The server's process, when known (for CPU and memory figures).
    pub pid: Option<u32>,
    /// `external`, `child` or `in-process`.
    pub kind: &'static str,
    child: Option<tokio::process::Child>,
    running: Option<Running>,
    dir: Option<PathBuf>,
}

impl Target {
    pub async fn open(c: &Common) -> Res<Target> {
        if c.spawn {
            let dir = std::env::temp_dir().join(format!(
                "pigeon-bench-{}-{}",
                std::process::id(),
                rand::random::<u32>()
            ));
            std::fs::create_dir_all(&dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            let key: String = (0..32)
                .map(|_| char::from(b'a' + rand::random_range(0..26u8)))
                .collect();
            let started = if c.in_process {
                start_in_process(c, &dir, &key).await
            } else {
                start_child(c, &dir, &key).await
            };
            let (addr, pid, child, running) = match started {
                Ok(s) => s,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    return Err(e);
                }
            };
            let admin = Http::new(format!("http://{addr}")).with_bearer(key);
            let target = Target {
                addr,
                admin,
                pid: Some(pid),
                kind: if c.in_process { "in-process" } else { "child" },
                child,
                running,
                dir: Some(dir),
            };
            target.wait_ready().await?;
            note(format!(
                "spawned a server ({}, pid {pid}) on http://{addr}, data in {}",
                target.kind,
                target
                    .dir
                    .as_ref()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            ));
            Ok(target)
        } else {
            let addr = loopback_addr(&c.server)?;
            let key = c
                .admin_key
                .clone()
                .ok_or("--admin-key (or PIGEON_ADMIN_KEY) is needed without --spawn")?;
            let target = Target {
                addr,
                admin: Http::new(format!("http://{addr}")).with_bearer(key),
                pid: c.server_pid,
                kind: "external",
                child: None,
                running: None,
                dir: None,
            };
            target.wait_ready().await?;
            Ok(target)
        }
    }

    /// The server's store-commit histogram now (`None` if its metrics cannot be read: the
    /// run goes on without those figures).
    pub async fn commits(&self) -> Option<super::commits::Commits> {
        let text = self.admin.get_text("/metrics").await.ok()?;
        Some(super::commits::Commits::parse(&text))
    }

    pub fn ws_base(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// A line for the result table.
    pub fn describe(&self) -> String {
        match (self.kind, self.pid) {
            ("external", Some(pid)) => format!("http://{} (pid {pid})", self.addr),
            ("external", None) => format!("http://{}", self.addr),
            (kind, pid) => format!(
                "spawned {kind}, pid {}, fsync, http://{}",
                pid.unwrap_or(0),
                self.addr
            ),
        }
    }

    async fn wait_ready(&self) -> Res<()> {
        let anon = Http::new(format!("http://{}", self.addr));
        let mut last = String::new();
        for _ in 0..100 {
            match anon.get("/readyz").await {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!("server at {} is not ready: {last}", self.addr))
    }

    /// Stops a spawned server and removes its data directory.
    pub async fn close(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
        if let Some(running) = self.running.take() {
            running.shutdown().await;
        }
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // A child is killed on drop (kill_on_drop); its data directory goes with it.
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The socket address of `--server`, refused unless it is on 127.0.0.0/8.
fn loopback_addr(url: &str) -> Res<SocketAddr> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("--server {url}: expected http://HOST:PORT"))?;
    let hostport = rest.split('/').next().unwrap_or("");
    let hostport = hostport.replacen("localhost", "127.0.0.1", 1);
    let addr: SocketAddr = hostport
        .parse()
        .or_else(|_| format!("{hostport}:80").parse())
        .map_err(|_| format!("--server {url}: expected http://127.x.y.z:PORT"))?;
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_loopback() => Ok(addr),
        _ => Err(format!(
            "--server {url}: the bench only drives servers on 127.0.0.0/8"
        )),
    }
}

/// The `pigeon serve` flags of a spawned server.
fn serve_flags(c: &Common, dir: &std::path::Path) -> Vec<String> {
    let mut f: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--data-dir".into(),
        dir.display().to_string(),
        "--durability".into(),
        "fsync".into(),
    ];
    if let Some(n) = c.fanout_write_max_members {
        f.push("--fanout-write-max-members".into());
        f.push(n.to_string());
    }
    // The bench measures capacity: a per-user send limit (when the server has one) is off.
    if serve_has_flag("send-rate-per-sec") {
        f.push("--send-rate-per-sec".into());
        f.push("0".into());
    }
    f
}

fn serve_has_flag(long: &str) -> bool {
    ServeOnly::command()
        .get_arguments()
        .any(|a| a.get_long() == Some(long))
}

type Started = (
    SocketAddr,
    u32,
    Option<tokio::process::Child>,
    Option<Running>,
);

async fn start_child(c: &Common, dir: &std::path::Path, key: &str) -> Res<Started> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let log_path = dir.join("server.log");
    let log = std::fs::File::create(&log_path)
        .map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("serve")
        .args(serve_flags(c, dir))
        .env("PIGEON_ADMIN_KEY", key)
        .env_remove("PIGEON_CONFIG")
        .env(
            "PIGEON_LOG",
            std::env::var("PIGEON_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start pigeon serve: {e}"))?;
    let pid = child.id().ok_or("the server exited at once")?;
    let stdout = child.stdout.take().ok_or("no stdout from the server")?;
    let mut lines = BufReader::new(stdout).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(a) = line.split("listening on http://").nth(1) {
                return a.trim().parse::<SocketAddr>().ok();
            }
        }
        None
    })
    .await
    .ok()
    .flatten();
    let Some(addr) = addr else {
        let _ = child.kill().await;
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        return Err(format!(
            "the spawned server did not say where it listens; its log:\n{log}"
        ));
    };
    // Keep reading its stdout so that it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((addr, pid, Some(child), None))
}

async fn start_in_process(c: &Common, dir: &std::path::Path, key: &str) -> Res<Started> {
    let mut argv = vec!["serve".to_owned()];
    argv.extend(serve_flags(c, dir));
    argv.push("--admin-key".into());
    argv.push(key.to_owned());
    let parsed = ServeOnly::try_parse_from(argv).map_err(|e| e.to_string())?;
    let mut cfg = Config::resolve(&parsed.args).map_err(|e| e.to_string())?;
    // Here every connection is two sockets of this process, the tool's and the server's:
    // the server's share of the descriptors is half of what its store leaves.
    let open_files = pigeon_server::open_files::raise_limit();
    cfg.max_open_connections = Some(pigeon_server::open_files::connections_for(open_files) / 2);
    let running = pigeon_server::start(cfg)
        .await
        .map_err(|e| format!("cannot start the server: {e}"))?;
    Ok((running.addr, std::process::id(), None, Some(running)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_servers() {
        assert_eq!(
            loopback_addr("http://127.0.0.1:8080").unwrap(),
            "127.0.0.1:8080".parse().unwrap()
        );
        assert!(loopback_addr("http://127.3.4.5:9/x").is_ok());
        assert!(loopback_addr("http://localhost:8080").is_ok());
        assert!(loopback_addr("http://10.0.0.1:8080").is_err());
        assert!(loopback_addr("http://example.com:8080").is_err());
        assert!(loopback_addr("127.0.0.1:8080").is_err());
    }
}

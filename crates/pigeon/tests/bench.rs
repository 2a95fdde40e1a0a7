//! Smoke tests of `pigeon bench`: every scenario at a tiny size against a server it spawns,
//! checking the exit code and the JSON result (its keys, and no lost, duplicated or
//! out-of-order message). No assertion on performance figures.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

/// Runs `pigeon bench ARGS --spawn --json FILE`; answers the parsed JSON.
fn bench(name: &str, args: &[&str]) -> Value {
    let json =
        std::env::temp_dir().join(format!("pigeon-bench-{name}-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .arg("bench")
        .args(args)
        .arg("--spawn")
        .arg("--json")
        .arg(&json)
        .env_remove("PIGEON_ADMIN_KEY")
        .output()
        .expect("pigeon bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "pigeon bench {args:?} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("lost"), "no result table:\n{stdout}");
    let v = read_json(&json);
    let _ = std::fs::remove_file(&json);
    v
}

fn read_json(path: &PathBuf) -> Value {
    let text = std::fs::read_to_string(path).expect("the JSON file is written");
    serde_json::from_str(&text).expect("the JSON file parses")
}

/// The keys every result has, with a clean delivery check.
fn assert_clean(v: &Value, scenario: &str, keys: &[&str]) {
    assert_eq!(v["scenario"], scenario, "{v:#}");
    for k in ["lost", "duplicated", "out_of_order", "errors"] {
        assert_eq!(v[k], 0, "{k} in {v:#}");
    }
    assert_eq!(v["ok"], true, "{v:#}");
    for k in keys {
        assert!(v.get(*k).is_some(), "no {k} in {v:#}");
    }
}

fn latency_keys(v: &Value, key: &str) {
    for k in ["p50", "p99", "p999", "max", "count"] {
        assert!(v[key].get(k).is_some(), "no {key}.{k} in {v:#}");
    }
}

#[test]
fn direct() {
    let v = bench("direct", &["direct", "--users", "4", "--duration", "1"]);
    assert_clean(
        &v,
        "direct",
        &[
            "server",
            "sent",
            "acked",
            "delivered",
            "delivered_per_sec",
            "server_cpu_percent",
        ],
    );
    latency_keys(&v, "ack_latency_ms");
    latency_keys(&v, "delivery_latency_ms");
    assert!(v["acked"].as_u64().unwrap() > 0, "{v:#}");
    assert!(v["delivered"].as_u64().unwrap() > 0, "{v:#}");
    assert_commits(&v);
}

/// The server's own commit figures for the run, read from its `/metrics`: the sends were
/// committed, and each slower count is within the one below it.
fn assert_commits(v: &Value) {
    let commits = v["store_commits"].as_u64().expect("store_commits");
    assert!(commits > 0, "{v:#}");
    assert!(v["store_commit_mean_ms"].as_f64().unwrap() > 0.0, "{v:#}");
    let over = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v:#}"));
    assert!(over("store_commits_over_100ms") <= over("store_commits_over_50ms"));
    assert!(over("store_commits_over_50ms") <= over("store_commits_over_20ms"));
    assert!(over("store_commits_over_20ms") <= commits);
}

#[test]
fn direct_at_a_fixed_rate() {
    let v = bench(
        "direct-rate",
        &["direct", "--users", "4", "--duration", "1", "--rate", "200"],
    );
    assert_clean(&v, "direct", &["rate", "delivered_per_sec"]);
    assert!(v["acked"].as_u64().unwrap() > 0, "{v:#}");
}

/// `--warmup` leaves the first second's messages out of the latency figures only, and
/// `--trace` writes one line per delivery, warm-up included, in send order.
#[test]
fn direct_with_a_warmup_and_a_trace() {
    let trace = std::env::temp_dir().join(format!("pigeon-bench-trace-{}.csv", std::process::id()));
    let _ = std::fs::remove_file(&trace);
    let v = bench(
        "direct-trace",
        &[
            "direct",
            "--users",
            "4",
            "--duration",
            "2",
            "--rate",
            "200",
            "--warmup",
            "1",
            "--trace",
            trace.to_str().unwrap(),
        ],
    );
    assert_clean(&v, "direct", &["warmup_secs"]);
    assert_eq!(v["warmup_secs"], 1.0, "{v:#}");
    let delivered = v["delivered"].as_u64().unwrap();
    let timed = v["delivery_latency_ms"]["count"].as_u64().unwrap();
    let acks_timed = v["ack_latency_ms"]["count"].as_u64().unwrap();
    // 200/s for 2 s: about 400 delivered, about half of them after the warm-up.
    assert!(delivered >= 300, "{v:#}");
    assert!(
        timed > 0 && timed < delivered * 3 / 4,
        "{timed} of {delivered}: {v:#}"
    );
    assert!(
        acks_timed > 0 && acks_timed < v["acked"].as_u64().unwrap() * 3 / 4,
        "{v:#}"
    );

    let text = std::fs::read_to_string(&trace).expect("the trace is written");
    let _ = std::fs::remove_file(&trace);
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("sent_ms,latency_ms,late_ms"));
    let rows: Vec<(f64, f64, f64)> = lines
        .map(|l| {
            let f: Vec<f64> = l.split(',').map(|x| x.parse().unwrap()).collect();
            assert_eq!(f.len(), 3, "three fields: {l}");
            (f[0], f[1], f[2])
        })
        .collect();
    assert_eq!(rows.len() as u64, delivered, "one line per delivery");
    assert!(rows.windows(2).all(|w| w[0].0 <= w[1].0), "in send order");
    assert!(
        rows.iter()
            .all(|r| r.0 >= -1.0 && r.0 < 2_100.0 && r.1 >= 0.0 && (0.0..=r.1).contains(&r.2)),
        "a send is never later than its delivery"
    );
    let in_warmup = rows.iter().filter(|r| r.0 < 1_000.0).count() as u64;
    assert!(in_warmup > 0, "the warm-up is in the trace");
    assert_eq!(
        timed,
        delivered - in_warmup,
        "the latency figure leaves out the warm-up"
    );
}

#[test]
fn a_warmup_as_long_as_the_run_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args([
            "bench",
            "direct",
            "--spawn",
            "--duration",
            "1",
            "--warmup",
            "1",
        ])
        .output()
        .expect("pigeon bench runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--warmup"), "{stderr}");
}

/// A trace that cannot be written is refused before the run, not after it.
#[test]
fn a_trace_that_cannot_be_written_is_refused_first() {
    let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args([
            "bench",
            "direct",
            "--spawn",
            "--users",
            "2",
            "--duration",
            "1",
        ])
        .args(["--trace", "/nonexistent-dir/trace.csv"])
        .output()
        .expect("pigeon bench runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot write the trace"), "{stderr}");
    assert!(!stderr.contains("sent"), "no run: {stderr}");
}

/// `disk` times appends and syncs of a file in `--dir`, reports them, and leaves nothing
/// behind; a bad size or directory is refused before anything is written.
#[test]
fn disk() {
    let dir = std::env::temp_dir().join(format!("pigeon-bench-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.with_extension("json");
    let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args(["bench", "disk", "--duration", "0.5", "--bytes", "4096"])
        .args(["--interval-ms", "1", "--dir"])
        .arg(&dir)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("pigeon bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("sync_latency_ms"),
        "no result table:\n{stdout}"
    );
    let v = read_json(&json);
    assert_clean(
        &v,
        "disk",
        &["syncs_over_50ms", "syncs_over_100ms", "written_mb_per_sec"],
    );
    latency_keys(&v, "sync_latency_ms");
    let syncs = v["syncs"].as_u64().unwrap();
    assert!(syncs > 0, "{v:#}");
    assert_eq!(v["sync_latency_ms"]["count"], syncs, "{v:#}");
    assert!(v["sync_latency_ms"]["p50"].as_f64() <= v["sync_latency_ms"]["max"].as_f64());
    assert_eq!(v["bytes"], 4096);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "the probe's file is left behind"
    );
    let d = dir.to_str().unwrap();
    for (args, says) in [
        (["--bytes", "0", "--dir", d], "--bytes"),
        (
            ["--bytes", "64", "--dir", "/nonexistent-dir"],
            "not a directory",
        ),
        (["--interval-ms", "5000", "--dir", d], "--interval-ms"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
            .args(["bench", "disk", "--duration", "0.2"])
            .args(args)
            .output()
            .expect("pigeon bench runs");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // Interrupted (Ctrl-C) mid-run, it stops, removes its file and says so.
    let child = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args(["bench", "disk", "--duration", "60", "--dir", d])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("pigeon bench runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::fs::read_dir(&dir).unwrap().count() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the probe never made its file"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "an interrupted probe left its file"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&json);
}

#[test]
fn group_write_and_read_fanout() {
    let v = bench(
        "group",
        &[
            "group",
            "--groups",
            "2",
            "--members",
            "5",
            "--duration",
            "1",
        ],
    );
    assert_clean(
        &v,
        "group",
        &["deliveries_per_sec", "fanout", "completion_ms"],
    );
    assert_eq!(v["fanout"], "write", "{v:#}");
    latency_keys(&v, "completion_ms");
    assert!(v["delivered"].as_u64().unwrap() > 0, "{v:#}");
    assert_commits(&v);

    // Above the threshold: the same groups use read fan-out.
    let v = bench(
        "group-read",
        &[
            "group",
            "--groups",
            "2",
            "--members",
            "5",
            "--duration",
            "1",
            "--fanout-write-max-members",
            "3",
        ],
    );
    assert_clean(&v, "group", &["deliveries_per_sec", "completion_ms"]);
    assert_eq!(v["fanout"], "read", "{v:#}");
    assert!(v["delivered"].as_u64().unwrap() > 0, "{v:#}");
}

#[test]
fn catchup() {
    let v = bench("catchup", &["catchup", "--messages", "300"]);
    assert_clean(&v, "catchup", &["pulled_per_sec", "pages", "catchup_secs"]);
    assert_eq!(v["acked"], 300, "{v:#}");
    assert_eq!(v["pulled"], 300, "{v:#}");
}

#[test]
fn connections() {
    let v = bench(
        "connections",
        &["connections", "--connections", "50", "--hold-secs", "1"],
    );
    assert_clean(
        &v,
        "connections",
        &[
            "server_rss_per_connection_kib",
            "server_idle_cpu_percent",
            "alive_at_end",
        ],
    );
    assert_eq!(v["opened"], 50, "{v:#}");
    assert_eq!(v["alive_at_end"], 50, "{v:#}");
}

/// More connections than one load process holds go to child load processes
/// (`--processes` makes them at a tiny size): each one's figures are reported beside the
/// totals, and every connection is counted once.
#[test]
fn connections_from_several_load_processes() {
    let v = bench(
        "connections-processes",
        &[
            "connections",
            "--connections",
            "61",
            "--processes",
            "3",
            "--hold-secs",
            "1",
        ],
    );
    assert_clean(
        &v,
        "connections",
        &[
            "server_rss_per_connection_kib",
            "bench_rss_per_connection_kib",
        ],
    );
    assert_eq!(v["processes"], 3, "{v:#}");
    assert_eq!(v["opened"], 61, "{v:#}");
    assert_eq!(v["alive_at_end"], 61, "{v:#}");
    let per = v["per_process"].as_array().expect("per-process figures");
    let shares: Vec<_> = per.iter().map(|p| p["connections"].clone()).collect();
    assert_eq!(shares, [21, 21, 19], "{v:#}");
    for p in per {
        assert_eq!(p["opened"], p["connections"], "{v:#}");
        assert_eq!(p["alive_at_end"], p["connections"], "{v:#}");
    }
}

#[test]
fn isolation() {
    let v = bench(
        "isolation",
        &[
            "isolation",
            "--duration",
            "1",
            "--users",
            "4",
            "--members",
            "10",
        ],
    );
    assert_clean(&v, "isolation", &["flood_deliveries_per_sec"]);
    latency_keys(&v, "single_delivery_latency_ms_quiet");
    latency_keys(&v, "single_delivery_latency_ms_flood");
    assert!(v["flood_acked"].as_u64().unwrap() > 0, "{v:#}");
}

#[test]
fn refuses_servers_off_loopback_and_too_many_connections() {
    let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args([
            "bench",
            "direct",
            "--server",
            "http://192.0.2.1:8080",
            "--admin-key",
            "k",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // One load process holds at most 19 000; more processes than connections is no plan.
    for args in [
        ["--connections", "19001", "--processes", "1"],
        ["--connections", "5", "--processes", "6"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
            .args(["bench", "connections", "--spawn"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("19000"),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

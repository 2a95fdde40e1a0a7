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
    let out = Command::new(env!("CARGO_BIN_EXE_pigeon"))
        .args(["bench", "connections", "--spawn", "--connections", "19001"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("19000"));
}

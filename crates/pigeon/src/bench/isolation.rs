//! `isolation`: single chats go on at a steady rate; after a first phase a flood starts into
//! a large group (every member online). Reports the single chats' latency in both phases, so
//! that one can see how much a busy group slows everyone else.

use super::direct::check_common;
use super::driver::{self, GROUP_P2, Run, SINGLE_P1, SINGLE_P2, SendPlan, Shared, Spec};
use super::group::create_group;
use super::procfs::CpuMeter;
use super::{
    Common, MAX_CONNECTIONS_PER_PROCESS, Report, Res, Target, make_users, note, now_us,
    user_id_base,
};
use serde_json::json;
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Single-chat users, in pairs
    #[arg(long, default_value_t = 20)]
    pub users: usize,
    /// Total rate of the single chats (messages per second), the same in both phases
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Sends awaiting their send_ack, per single-chat user
    #[arg(long, default_value_t = 16)]
    pub window: usize,
    /// Members of the flooded group; one connection each
    #[arg(long, default_value_t = 200)]
    pub members: usize,
    /// Members of the group that flood it
    #[arg(long, default_value_t = 4)]
    pub flood_senders: usize,
    /// Sends awaiting their send_ack, per flooding member (they send as fast as that allows)
    #[arg(long, default_value_t = 64)]
    pub flood_window: usize,
    /// Seconds of each phase
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Bytes of content per message (32 at the least: the send time and the tool's lateness)
    #[arg(long, default_value_t = 32)]
    pub size: usize,
}

pub async fn run(a: Args) -> Res<ExitCode> {
    let users = a.users / 2 * 2;
    if users < 2 || a.members < 2 || a.flood_senders == 0 || a.flood_senders > a.members {
        return Err("need --users >= 2, --members >= 2, 1 <= --flood-senders <= --members".into());
    }
    if users + a.members > MAX_CONNECTIONS_PER_PROCESS {
        return Err(format!(
            "--users + --members: at most {MAX_CONNECTIONS_PER_PROCESS} connections per load process"
        ));
    }
    check_common(a.window.min(a.flood_window), Some(a.rate), a.duration)?;
    let target = Target::open(&a.common).await?;
    let result = body(&a, users, &target).await;
    target.close().await;
    result
}

async fn body(a: &Args, users: usize, target: &Target) -> Res<ExitCode> {
    let m = a.members;
    let base = user_id_base();
    let ids: Vec<u64> = (0..(users + m) as u64).map(|i| base + i).collect();
    let tokens = make_users(&target.admin, &ids).await?;
    let (singles, members) = ids.split_at(users);
    let (conv, mode) = create_group(&target.admin, &tokens[users], members, "bench-flood").await?;
    note(format!("flood group of {m} members ({mode} fan-out)"));
    let pair = driver::PairPlan {
        window: a.window,
        interval: Some(Duration::from_secs_f64(users as f64 / a.rate)),
        size: a.size,
    };
    let mut specs: Vec<Spec> = ids
        .iter()
        .zip(tokens)
        .enumerate()
        .map(|(i, (&id, token))| {
            if i < users {
                driver::pair_spec(i, id, singles[i ^ 1], token, pair)
            } else {
                Spec {
                    user: id,
                    token,
                    device: format!("bench-{i}"),
                    send: (i - users < a.flood_senders).then(|| SendPlan {
                        to: json!({"conversation": conv}),
                        fanout: m as u64,
                        window: a.flood_window,
                        interval: None,
                        limit: None,
                        size: a.size,
                        class: 1,
                    }),
                    expect: vec![conv.clone()],
                    completion: false,
                }
            }
        })
        .collect();
    // The single chats are what is measured: they run apart from the flood's connections
    // (see `ProbeRuntime`).
    let flood_specs = specs.split_off(users);
    let probe = driver::ProbeRuntime::new()?;
    let single_conns = probe.connect_all(&target.ws_base(), specs).await?;
    let flood_conns = driver::connect_all(&target.ws_base(), flood_specs, 64).await?;
    let shared = Shared::new();
    let run = Run::start_on(
        vec![
            (probe.handle(), single_conns),
            (tokio::runtime::Handle::current(), flood_conns),
        ],
        shared.clone(),
    );
    let progress = driver::progress(shared.clone());
    let phase = Duration::from_secs_f64(a.duration);

    note("phase 1: single chats alone");
    let cpu1 = target.pid.map(CpuMeter::start);
    run.set(|c| c.send[0] = true);
    tokio::time::sleep(phase).await;
    let cpu1 = cpu1.and_then(|m| m.percent());

    note("phase 2: single chats and the flood");
    shared.phase_split_us.store(now_us(), Relaxed);
    let cpu2 = target.pid.map(CpuMeter::start);
    let flood_started = Instant::now();
    run.set(|c| c.send[1] = true);
    tokio::time::sleep(phase).await;
    let cpu2 = cpu2.and_then(|m| m.percent());
    let flood_send_secs = flood_started.elapsed().as_secs_f64();
    let drained = run.drain(Duration::from_secs(a.common.drain_secs)).await;
    let flood_secs = flood_started.elapsed().as_secs_f64();
    drop(progress);
    let retried = shared.counters.retried.load(Relaxed);
    let mut out = driver::evaluate(run.finish().await);
    if !drained {
        out.checks.error("drain timed out", 1);
    }
    let flood_acked = out.ack_lat[GROUP_P2].len();
    let flood_delivered = out.delivery_lat[GROUP_P2].len();
    let mut rep = Report::new(
        "isolation",
        format!(
            "pigeon bench isolation: {users} single-chat users at {} msgs/s; then a flood by {} senders into a group of {m} ({mode} fan-out); {:.1} s per phase",
            a.rate, a.flood_senders, a.duration
        ),
    );
    rep.set("server", target.describe());
    rep.set("users", users);
    rep.num("rate", Some(a.rate));
    rep.set("members", m);
    rep.set("fanout", mode);
    rep.set("flood_senders", a.flood_senders);
    rep.set("flood_window", a.flood_window);
    rep.num("phase_secs", Some(a.duration));
    rep.set("single_sent_quiet", out.ack_lat[SINGLE_P1].len());
    rep.set("single_sent_flood", out.ack_lat[SINGLE_P2].len());
    rep.latency(
        "single_delivery_latency_ms_quiet",
        std::mem::take(&mut out.delivery_lat[SINGLE_P1]),
    );
    rep.latency(
        "single_delivery_latency_ms_flood",
        std::mem::take(&mut out.delivery_lat[SINGLE_P2]),
    );
    rep.latency(
        "single_ack_latency_ms_quiet",
        std::mem::take(&mut out.ack_lat[SINGLE_P1]),
    );
    rep.latency(
        "single_ack_latency_ms_flood",
        std::mem::take(&mut out.ack_lat[SINGLE_P2]),
    );
    rep.set("flood_acked", flood_acked);
    rep.num(
        "flood_acked_per_sec",
        Some(flood_acked as f64 / flood_send_secs),
    );
    rep.num(
        "flood_deliveries_per_sec",
        Some(flood_delivered as f64 / flood_secs),
    );
    rep.latency(
        "flood_delivery_latency_ms",
        std::mem::take(&mut out.delivery_lat[GROUP_P2]),
    );
    rep.num("server_cpu_percent_quiet", cpu1);
    rep.num("server_cpu_percent_flood", cpu2);
    rep.set(
        "single_chat_runtime",
        if driver::PROBE_PRIORITY_REFUSED.load(Relaxed) {
            "own thread, normal priority (nice -10 refused)"
        } else {
            "own thread, nice -10"
        },
    );
    rep.set("retried", retried);
    driver::report_late_sends(&mut rep, &shared.counters);
    Ok(rep.finish(&out.checks, a.common.json.as_deref()))
}

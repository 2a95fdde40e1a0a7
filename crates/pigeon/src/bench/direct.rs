//! `direct`: users in pairs, each sending to its peer with a window of in-flight sends (or
//! at a fixed total rate) for a while. Reports send→ack and send→delivered latency, messages
//! delivered per second and the server's CPU.

use super::driver::{self, SINGLE_P1, SendPlan, Spec};
use super::{Common, MAX_CONNECTIONS_PER_PROCESS, Report, Res, Target, make_users, user_id_base};
use serde_json::json;
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Users, in pairs (an odd last one is left out); one connection each
    #[arg(long, default_value_t = 100)]
    pub users: usize,
    /// Sends awaiting their send_ack, per user
    #[arg(long, default_value_t = 16)]
    pub window: usize,
    /// Send at this fixed total rate (messages per second over all users) rather than as
    /// fast as the window allows; latency then counts from the scheduled send time
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seconds of sending
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Bytes of content per message
    #[arg(long, default_value_t = 32)]
    pub size: usize,
}

pub async fn run(a: Args) -> Res<ExitCode> {
    let users = a.users / 2 * 2;
    if !(2..=MAX_CONNECTIONS_PER_PROCESS).contains(&users) {
        return Err(format!("--users must be 2..={MAX_CONNECTIONS_PER_PROCESS}"));
    }
    check_common(a.window, a.rate, a.duration)?;
    let target = Target::open(&a.common).await?;
    let result = body(&a, users, &target).await;
    target.close().await;
    result
}

/// Checks shared by the message scenarios.
pub fn check_common(window: usize, rate: Option<f64>, duration: f64) -> Res<()> {
    if window == 0 {
        return Err("--window must be at least 1".into());
    }
    if rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        return Err("--rate must be a positive number".into());
    }
    if !(duration > 0.0 && duration <= 3600.0) {
        return Err("--duration must be in (0, 3600] seconds".into());
    }
    Ok(())
}

async fn body(a: &Args, users: usize, target: &Target) -> Res<ExitCode> {
    let base = user_id_base();
    let ids: Vec<u64> = (0..users as u64).map(|i| base + i).collect();
    let tokens = make_users(&target.admin, &ids).await?;
    let interval = a.rate.map(|r| Duration::from_secs_f64(users as f64 / r));
    let specs = ids
        .iter()
        .zip(tokens)
        .enumerate()
        .map(|(i, (&id, token))| {
            let peer = ids[i ^ 1];
            Spec {
                user: id,
                token,
                device: format!("bench-{i}"),
                send: Some(SendPlan {
                    to: json!({"user": peer}),
                    fanout: 2,
                    window: a.window,
                    interval,
                    limit: None,
                    size: a.size,
                    class: 0,
                }),
                expect: vec![format!("{}-{}", id.min(peer), id.max(peer))],
                completion: false,
            }
        })
        .collect();
    let driver::Measured {
        mut out,
        shared,
        send_secs,
        elapsed,
        server_cpu,
        own_cpu,
        sent,
        delivered,
    } = driver::measure(
        &target.ws_base(),
        specs,
        target.pid,
        a.duration,
        a.common.drain_secs,
    )
    .await?;
    let k = &shared.counters;
    let mut rep = Report::new(
        "direct",
        format!(
            "pigeon bench direct: {users} users in pairs, {}, {:.1} s",
            match a.rate {
                Some(r) => format!("{r} msgs/s total (window {})", a.window),
                None => format!("window {}", a.window),
            },
            a.duration
        ),
    );
    rep.set("server", target.describe());
    rep.set("users", users);
    rep.set("window", a.window);
    rep.num("rate", a.rate);
    rep.num("duration_secs", Some(send_secs));
    rep.num("elapsed_secs", Some(elapsed));
    rep.set("sent", sent);
    rep.set("acked", out.acked);
    rep.set("delivered", delivered);
    rep.num("acked_per_sec", Some(out.acked as f64 / send_secs));
    rep.num("delivered_per_sec", Some(delivered as f64 / elapsed));
    rep.latency(
        "ack_latency_ms",
        std::mem::take(&mut out.ack_lat[SINGLE_P1]),
    );
    rep.latency(
        "delivery_latency_ms",
        std::mem::take(&mut out.delivery_lat[SINGLE_P1]),
    );
    rep.num("server_cpu_percent", server_cpu);
    rep.num("bench_cpu_percent", own_cpu);
    rep.set("retried", k.retried.load(Relaxed));
    Ok(rep.finish(&out.checks, a.common.json.as_deref()))
}

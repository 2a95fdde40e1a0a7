//! `direct`: users in pairs, each sending to its peer with a window of in-flight sends (or
//! at a fixed total rate) for a while. Reports send→ack and send→delivered latency, messages
//! delivered per second and the server's CPU.

use super::commits::Commits;
use super::driver::{self, PairPlan, SINGLE_P1};
use super::{Common, MAX_CONNECTIONS_PER_PROCESS, Report, Res, Target, make_users, user_id_base};
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub latency: driver::LatencyArgs,
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
    /// Bytes of content per message (32 at the least: the send time and the tool's lateness)
    #[arg(long, default_value_t = 32)]
    pub size: usize,
}

pub async fn run(a: Args) -> Res<ExitCode> {
    let users = a.users / 2 * 2;
    if !(2..=MAX_CONNECTIONS_PER_PROCESS).contains(&users) {
        return Err(format!("--users must be 2..={MAX_CONNECTIONS_PER_PROCESS}"));
    }
    check_common(a.window, a.rate, a.duration)?;
    a.latency.check(a.duration)?;
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
    let plan = PairPlan {
        window: a.window,
        interval,
        size: a.size,
    };
    let specs = ids
        .iter()
        .zip(tokens)
        .enumerate()
        .map(|(i, (&id, token))| driver::pair_spec(i, id, ids[i ^ 1], token, plan))
        .collect();
    let before = target.commits().await;
    let mut m = driver::measure(
        &target.ws_base(),
        specs,
        target.pid,
        (a.duration, a.common.drain_secs),
        &a.latency,
    )
    .await?;
    let commits = Commits::between(before, target.commits().await);
    let mut rep = Report::new(
        "direct",
        format!(
            "pigeon bench direct: {users} users in pairs, {}, {:.1} s",
            driver::pace(a.rate, a.window),
            a.duration
        ),
    );
    rep.set("server", target.describe());
    rep.set("users", users);
    m.report_run(&mut rep, (a.rate, a.window), SINGLE_P1, "delivered_per_sec");
    m.report_cost(&mut rep);
    Commits::report(commits.as_ref(), &mut rep);
    Ok(rep.finish(&m.out.checks, a.common.json.as_deref()))
}

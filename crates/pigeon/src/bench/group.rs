//! `group`: G groups of M members, every member online, a few senders per group sending into
//! it. Reports deliveries per second and, per message, the time until the last member has it.
//! Run it below and above the server's fan-out threshold by choosing M (or, with --spawn,
//! `--fanout-write-max-members`).

use super::commits::Commits;
use super::direct::check_common;
use super::driver::{self, GROUP_P1, SendPlan, Spec};
use super::{
    Common, MAX_CONNECTIONS_PER_PROCESS, Report, Res, Target, make_users, note, user_id_base,
};
use pigeon_client::Http;
use serde_json::json;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub latency: driver::LatencyArgs,
    /// Members per group (the owner included); one connection each
    #[arg(long, default_value_t = 50)]
    pub members: usize,
    /// Groups (members are not shared between groups)
    #[arg(long, default_value_t = 10)]
    pub groups: usize,
    /// Members of each group that send
    #[arg(long, default_value_t = 2)]
    pub senders: usize,
    /// Sends awaiting their send_ack, per sender
    #[arg(long, default_value_t = 16)]
    pub window: usize,
    /// Send at this fixed total rate (messages per second over all senders)
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seconds of sending
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Bytes of content per message (32 at the least: the send time and the tool's lateness)
    #[arg(long, default_value_t = 32)]
    pub size: usize,
}

/// The most members one create or invite call may carry.
const USERS_PER_CALL: usize = 1000;

/// Creates a group owned by `members[0]` (whose token is `owner_token`) holding `members`;
/// answers its conversation id and fan-out mode.
pub async fn create_group(
    admin: &Http,
    owner_token: &str,
    members: &[u64],
    name: &str,
) -> Res<(String, String)> {
    let owner = admin.with_bearer(owner_token);
    let rest = &members[1..];
    let (first, later) = rest.split_at(rest.len().min(USERS_PER_CALL - 1));
    let g = owner
        .post("/v1/groups", &json!({"name": name, "members": first}))
        .await
        .map_err(|e| format!("cannot create group {name}: {e}"))?;
    let conv = g["conversation_id"]
        .as_str()
        .ok_or_else(|| format!("group creation answered {g}"))?
        .to_owned();
    for chunk in later.chunks(USERS_PER_CALL) {
        owner
            .post(
                &format!("/v1/groups/{conv}/members"),
                &json!({"user_ids": chunk}),
            )
            .await
            .map_err(|e| format!("cannot add members to {conv}: {e}"))?;
    }
    let view = owner
        .get(&format!("/v1/conversations/{conv}"))
        .await
        .map_err(|e| format!("cannot read {conv}: {e}"))?;
    let fanout = view["fanout"].as_str().unwrap_or("?").to_owned();
    Ok((conv, fanout))
}

pub async fn run(a: Args) -> Res<ExitCode> {
    if a.members < 2 || a.groups == 0 || a.senders == 0 || a.senders > a.members {
        return Err("need --members >= 2, --groups >= 1, 1 <= --senders <= --members".into());
    }
    if a.members * a.groups > MAX_CONNECTIONS_PER_PROCESS {
        return Err(format!(
            "--members x --groups is {}: at most {MAX_CONNECTIONS_PER_PROCESS} connections per load process",
            a.members * a.groups
        ));
    }
    check_common(a.window, a.rate, a.duration)?;
    a.latency.check(a.duration)?;
    let target = Target::open(&a.common).await?;
    let result = body(&a, &target).await;
    target.close().await;
    result
}

async fn body(a: &Args, target: &Target) -> Res<ExitCode> {
    let (m, g) = (a.members, a.groups);
    let base = user_id_base();
    let ids: Vec<u64> = (0..(m * g) as u64).map(|i| base + i).collect();
    let tokens = make_users(&target.admin, &ids).await?;
    let mut convs = Vec::with_capacity(g);
    let mut fanout_modes = std::collections::BTreeSet::new();
    for gi in 0..g {
        let members = &ids[gi * m..(gi + 1) * m];
        let (conv, mode) = create_group(
            &target.admin,
            &tokens[gi * m],
            members,
            &format!("bench-{gi}"),
        )
        .await?;
        convs.push(conv);
        fanout_modes.insert(mode);
    }
    let fanout_mode = fanout_modes.into_iter().collect::<Vec<_>>().join(",");
    note(format!("{g} groups of {m} members ({fanout_mode} fan-out)"));
    let interval = a
        .rate
        .map(|r| Duration::from_secs_f64((a.senders * g) as f64 / r));
    let specs = ids
        .iter()
        .zip(tokens)
        .enumerate()
        .map(|(i, (&id, token))| {
            let conv = &convs[i / m];
            Spec {
                user: id,
                token,
                device: format!("bench-{i}"),
                send: (i % m < a.senders).then(|| SendPlan {
                    to: json!({"conversation": conv}),
                    fanout: m as u64,
                    window: a.window,
                    interval,
                    limit: None,
                    size: a.size,
                    class: 0,
                }),
                expect: vec![conv.clone()],
                completion: true,
            }
        })
        .collect();
    let before = target.commits().await;
    let mut run = driver::measure(
        &target.ws_base(),
        specs,
        target.pid,
        (a.duration, a.common.drain_secs),
        &a.latency,
    )
    .await?;
    let commits = Commits::between(before, target.commits().await);
    let mut rep = Report::new(
        "group",
        format!(
            "pigeon bench group: {g} groups x {m} members ({fanout_mode} fan-out), {} senders each, {}, {:.1} s",
            a.senders,
            driver::pace(a.rate, a.window),
            a.duration
        ),
    );
    rep.set("server", target.describe());
    rep.set("groups", g);
    rep.set("members", m);
    rep.set("senders_per_group", a.senders);
    rep.set("fanout", fanout_mode);
    run.report_run(&mut rep, (a.rate, a.window), GROUP_P1, "deliveries_per_sec");
    rep.latency("completion_ms", std::mem::take(&mut run.out.completion));
    run.report_cost(&mut rep);
    Commits::report(commits.as_ref(), &mut rep);
    Ok(rep.finish(&run.out.checks, a.common.json.as_deref()))
}

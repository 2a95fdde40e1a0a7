//! `catchup`: a user is offline while another sends them K messages; they reconnect and
//! catch up with `sync` and pages of `pull` over the WebSocket. Reports messages per second
//! pulled.

use super::direct::check_common;
use super::driver::{self, ConnReport, ConvTrack, Run, SendPlan, Shared, Spec};
use super::procfs::CpuMeter;
use super::{Common, Report, Res, Target, make_users, note, user_id_base};
use pigeon_client::WsConn;
use serde_json::{Value, json};
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub common: Common,
    /// Messages sent to the user while offline
    #[arg(long, default_value_t = 10_000)]
    pub messages: u64,
    /// Items per pull page (the server caps it at 200)
    #[arg(long, default_value_t = 200)]
    pub page: u64,
    /// Sends awaiting their send_ack while filling the inbox
    #[arg(long, default_value_t = 64)]
    pub window: usize,
    /// Bytes of content per message (32 at the least: the send time and the tool's lateness)
    #[arg(long, default_value_t = 32)]
    pub size: usize,
}

const READER_DEVICE: &str = "bench-reader";

/// A `pull_result` (or the `error` answering a pull), read for what the check needs only:
/// a page is ~70 KB of JSON, and a tree of every field of 200 messages cost the load tool
/// more than the server spent answering.
#[derive(serde::Deserialize)]
struct Page {
    #[serde(rename = "type")]
    kind: String,
    req: Option<i64>,
    #[serde(default)]
    items: Vec<PageItem>,
}

#[derive(serde::Deserialize)]
struct PageItem {
    seq: u64,
    message: PageMessage,
}

#[derive(serde::Deserialize)]
struct PageMessage {
    seq: u64,
    conversation_id: String,
}
const WAIT: Duration = Duration::from_secs(30);

pub async fn run(a: Args) -> Res<ExitCode> {
    if !(1..=10_000_000).contains(&a.messages) || a.page == 0 {
        return Err("--messages must be 1..=10000000 and --page at least 1".into());
    }
    check_common(a.window, None, 1.0)?;
    let target = Target::open(&a.common).await?;
    let result = body(&a, &target).await;
    target.close().await;
    result
}

/// Sends `frame` with `req` and waits for the frame answering it.
/// Pull pages asked for ahead of the one being read.
const PULL_WINDOW: usize = 4;

async fn request(ws: &mut WsConn, mut frame: Value, req: i64) -> Res<Value> {
    frame["req"] = json!(req);
    ws.send(&frame).await.map_err(|e| e.to_string())?;
    let reply = ws
        .recv_until(WAIT, |v| v["req"] == json!(req))
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no answer to {frame}"))?;
    if reply["type"] == "error" {
        return Err(format!("{frame} answered {reply}"));
    }
    Ok(reply)
}

/// The answer to pull `want`: frames before it (pushes, answers to earlier requests) are
/// skipped.
async fn next_page(ws: &mut WsConn, want: i64) -> Res<Page> {
    let deadline = Instant::now() + WAIT;
    loop {
        let text = ws
            .recv_text(deadline.saturating_duration_since(Instant::now()))
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no answer to pull {want}"))?;
        let page: Page = serde_json::from_str(&text)
            .map_err(|e| format!("malformed pull answer ({e}): {text}"))?;
        if page.req != Some(want) {
            continue;
        }
        if page.kind != "pull_result" {
            return Err(format!("pull {want} answered {text}"));
        }
        return Ok(page);
    }
}

async fn body(a: &Args, target: &Target) -> Res<ExitCode> {
    let base = user_id_base();
    let (reader, sender) = (base, base + 1);
    let tokens = make_users(&target.admin, &[reader, sender]).await?;
    let conv = format!("{reader}-{sender}");

    // The reader's device exists (it has connected once) and is offline from here on.
    let ws = WsConn::connect(&target.ws_base(), &tokens[0], READER_DEVICE)
        .await
        .map_err(|e| format!("reader cannot connect: {e}"))?;
    ws.close().await;

    note(format!(
        "sending {} messages to an offline user",
        a.messages
    ));
    let spec = Spec {
        user: sender,
        token: tokens[1].clone(),
        device: "bench-sender".into(),
        send: Some(SendPlan {
            to: json!({"user": reader}),
            // Only the sender's connection is online to get the pushes.
            fanout: 1,
            window: a.window,
            interval: None,
            limit: Some(a.messages),
            size: a.size,
            class: 0,
        }),
        expect: vec![conv.clone()],
        completion: false,
    };
    let conns = driver::connect_all(&target.ws_base(), vec![spec], 1).await?;
    let shared = Shared::new();
    let run = Run::start(conns, shared.clone());
    let fill_started = Instant::now();
    let progress = driver::progress(shared.clone());
    run.set(|c| c.send[0] = true);
    let k = &shared.counters;
    let fill_limit = Duration::from_secs(60 + a.messages / 100);
    while (k.sent.load(Relaxed) < a.messages || k.inflight.load(Relaxed) > 0)
        && k.errors.load(Relaxed) == 0
        && fill_started.elapsed() < fill_limit
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fill_secs = fill_started.elapsed().as_secs_f64();
    let drained = run.drain(Duration::from_secs(a.common.drain_secs)).await;
    drop(progress);
    let retried = k.retried.load(Relaxed);
    let mut reports = run.finish().await;

    // The reader comes back: sync, then pull pages of its inbox until it holds everything.
    note("the offline user reconnects and catches up");
    let server_cpu = target.pid.map(CpuMeter::start);
    let t0 = Instant::now();
    let mut ws = WsConn::connect(&target.ws_base(), &tokens[0], READER_DEVICE)
        .await
        .map_err(|e| format!("reader cannot reconnect: {e}"))?;
    let connect_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let sync = request(&mut ws, json!({"type": "sync"}), 1).await?;
    let sync_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let newest = sync["user_seq"]
        .as_u64()
        .ok_or("sync_result without user_seq")?;
    let cursor = sync["cursor"].as_u64().unwrap_or(0);
    let mut track = ConvTrack::default();
    let mut reader_report = ConnReport {
        user: reader,
        online_throughout: true,
        expect: vec![conv.clone()],
        ..ConnReport::default()
    };
    let (mut next, mut pulled, mut pages, mut holes) = (cursor + 1, 0u64, 0u64, 0u64);
    let mut first_page_ms = None;
    // The range is known from sync: keep PULL_WINDOW pages asked for ahead, so the round trips
    // overlap (the server answers one connection's frames in order).
    let page_len = a.page.clamp(1, 200);
    let mut req = 2;
    let mut asked_to = cursor;
    let mut outstanding: std::collections::VecDeque<i64> = std::collections::VecDeque::new();
    loop {
        while outstanding.len() < PULL_WINDOW && asked_to < newest {
            let from = asked_to + 1;
            let to = (from + page_len - 1).min(newest);
            let frame = json!({"type": "pull", "req": req, "chain": "user", "from": from, "to": to, "limit": page_len});
            ws.send(&frame).await.map_err(|e| e.to_string())?;
            outstanding.push_back(req);
            req += 1;
            asked_to = to;
        }
        let Some(want) = outstanding.pop_front() else {
            break;
        };
        let page = next_page(&mut ws, want).await?;
        pages += 1;
        first_page_ms.get_or_insert(t0.elapsed().as_secs_f64() * 1000.0);
        for item in &page.items {
            let (us, seq) = (item.seq, item.message.seq);
            if us != next {
                holes += 1;
            }
            next = us + 1;
            pulled += 1;
            if item.message.conversation_id == conv {
                let (new, ooo) = track.record(seq);
                reader_report.duplicated += u64::from(!new);
                reader_report.out_of_order += u64::from(ooo);
            }
        }
    }
    let catchup_secs = t0.elapsed().as_secs_f64();
    let server_cpu = server_cpu.and_then(|m| m.percent());
    let _ = ws.send(&json!({"type": "ack", "user_seq": newest})).await;
    ws.close().await;
    reader_report.convs.insert(conv.clone(), track);
    reports.push(reader_report);

    let mut out = driver::evaluate(reports);
    if !drained {
        out.checks.error("drain timed out", 1);
    }
    out.checks.error("holes in pulled pages", holes);
    if next <= newest {
        out.checks
            .error("pull stopped short of the newest user_seq", 1);
    }
    let mut rep = Report::new(
        "catchup",
        format!(
            "pigeon bench catchup: {} messages to an offline user, pulled in pages of {}",
            a.messages, a.page
        ),
    );
    rep.set("server", target.describe());
    rep.set("messages", a.messages);
    rep.set("acked", out.acked);
    rep.num("fill_secs", Some(fill_secs));
    rep.num("fill_per_sec", Some(out.acked as f64 / fill_secs));
    rep.set("sync_cursor", cursor);
    rep.set("sync_user_seq", newest);
    rep.set("pulled", pulled);
    rep.set("pages", pages);
    rep.num("connect_ms", Some(connect_ms));
    rep.num("sync_ms", Some(sync_ms));
    rep.num("first_page_ms", first_page_ms);
    rep.num("catchup_secs", Some(catchup_secs));
    rep.num("pulled_per_sec", Some(pulled as f64 / catchup_secs));
    rep.num("server_cpu_percent", server_cpu);
    rep.set("retried", retried);
    Ok(rep.finish(&out.checks, a.common.json.as_deref()))
}

//! `disk`: the disk's own sync latency, with no server. A file in `--dir` is appended to and
//! synced (`fdatasync`) again and again, as the journal's group commit does, and each sync is
//! timed. Every acknowledged send waits for one such sync, so the tail here is a floor under
//! the send latency of any run on the same disk: run it beside a `direct` run's figures to
//! tell the disk's stalls from the server's (on this project's VM, five 30 s runs on the
//! idle machine had maxima of 8-48 ms in four and 268 ms in one).

use super::report::{Checks, Report};
use super::{Progress, Res};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The probe's file, removed when the probe ends however it ends (an error, a panic).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The file starts again (truncated) past this many bytes, as the journal starts a new
/// segment.
const FILE_BYTES: u64 = 64 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Directory on the disk to test (the data directory's, to judge a server's figures)
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Seconds of appending and syncing
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Bytes appended before each sync (a group commit of ~80 direct messages is ~64 KiB)
    #[arg(long, default_value_t = 65_536)]
    pub bytes: usize,
    /// Pause between a sync and the next append, in milliseconds
    #[arg(long, default_value_t = 3)]
    pub interval_ms: u64,
    /// Also write the result as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub async fn run(a: Args) -> Res<ExitCode> {
    if !(a.duration > 0.0 && a.duration <= 3600.0) {
        return Err("--duration must be in (0, 3600] seconds".into());
    }
    if !(1..=16 << 20).contains(&a.bytes) {
        return Err("--bytes must be 1..=16777216".into());
    }
    if a.interval_ms > 1000 {
        return Err("--interval-ms must be at most 1000".into());
    }
    if !a.dir.is_dir() {
        return Err(format!("--dir {} is not a directory", a.dir.display()));
    }
    let path = a
        .dir
        .join(format!("pigeon-bench-disk-{}.tmp", std::process::id()));
    let done = Arc::new(AtomicU64::new(0));
    let worst_us = Arc::new(AtomicU64::new(0));
    let progress = {
        let (done, worst_us) = (done.clone(), worst_us.clone());
        Progress::start(move |_| {
            format!(
                "{} syncs, slowest {:.1} ms",
                done.load(Relaxed),
                worst_us.load(Relaxed) as f64 / 1000.0
            )
        })
    };
    let (duration, bytes, pause) = (
        Duration::from_secs_f64(a.duration),
        a.bytes,
        Duration::from_millis(a.interval_ms),
    );
    // Listening before the file exists: a Ctrl-C from then on removes it.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|e| format!("cannot listen for Ctrl-C: {e}"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let job = tokio::task::spawn_blocking({
        let stop = stop.clone();
        move || {
            let _file = RemoveOnDrop(path.clone());
            time_syncs(&path, duration, bytes, pause, (&done, &worst_us, &stop))
        }
    });
    tokio::pin!(job);
    let timed = tokio::select! {
        timed = &mut job => timed,
        Some(()) = interrupt.recv() => {
            // Let the probe see the stop and remove its file before going.
            stop.store(true, Relaxed);
            let _ = (&mut job).await;
            return Err("interrupted (its file is removed)".into());
        }
    }
    .map_err(|e| format!("the disk probe stopped: {e}"))?;
    drop(progress);
    let (samples, elapsed) = timed?;

    let mut rep = Report::new(
        "disk",
        format!(
            "pigeon bench disk: {} bytes appended and synced every {} ms in {}, {:.1} s",
            a.bytes,
            a.interval_ms,
            a.dir.display(),
            a.duration
        ),
    );
    rep.set("dir", a.dir.display().to_string());
    rep.set("bytes", a.bytes);
    rep.set("interval_ms", a.interval_ms);
    rep.set("syncs", samples.len());
    rep.set(
        "syncs_over_50ms",
        samples.iter().filter(|&&us| us > 50_000).count(),
    );
    rep.set(
        "syncs_over_100ms",
        samples.iter().filter(|&&us| us > 100_000).count(),
    );
    rep.num(
        "written_mb_per_sec",
        Some(samples.len() as f64 * a.bytes as f64 / 1e6 / elapsed.as_secs_f64()),
    );
    rep.latency("sync_latency_ms", samples);
    Ok(rep.finish(&Checks::default(), a.json.as_deref()))
}

/// Appends `bytes` and syncs, pausing `pause` between, for `duration`; answers each sync's
/// latency (write and `fdatasync`, in microseconds) and the time it all took.
fn time_syncs(
    path: &Path,
    duration: Duration,
    bytes: usize,
    pause: Duration,
    (done, worst_us, stop): (&AtomicU64, &AtomicU64, &AtomicBool),
) -> Res<(Vec<u32>, Duration)> {
    let io = |e: std::io::Error| format!("{}: {e}", path.display());
    let create = || -> Res<File> {
        OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(path)
            .map_err(io)
    };
    let block = vec![0x5a_u8; bytes];
    let mut file = create()?;
    let mut len = 0u64;
    let mut samples = Vec::new();
    let started = Instant::now();
    while started.elapsed() < duration && !stop.load(Relaxed) {
        if len >= FILE_BYTES {
            file = create()?;
            len = 0;
        }
        let t = Instant::now();
        file.write_all(&block).map_err(io)?;
        file.sync_data().map_err(io)?;
        let us = u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX);
        len += bytes as u64;
        samples.push(us);
        done.fetch_add(1, Relaxed);
        worst_us.fetch_max(u64::from(us), Relaxed);
        std::thread::sleep(pause);
    }
    Ok((samples, started.elapsed()))
}

//! What the bench reads about processes from /proc (Linux): CPU time, resident memory, the
//! open-files limit. Elsewhere these answer `None` and the figures are left out.

use std::time::Instant;

/// Clock ticks per second of `utime`/`stime` (`getconf CLK_TCK`; 100 on Linux).
const TICKS_PER_SEC: f64 = 100.0;

/// User + system CPU time of `pid`, in seconds.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / TICKS_PER_SEC)
}

/// Resident set size of `pid` in KiB (`VmRSS` of /proc/PID/status).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// The soft limit on open files of this process.
pub fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// CPU use of one process over an interval, as a percentage of one core.
pub struct CpuMeter {
    pid: u32,
    started: Instant,
    cpu0: Option<f64>,
}

impl CpuMeter {
    pub fn start(pid: u32) -> CpuMeter {
        CpuMeter {
            pid,
            started: Instant::now(),
            cpu0: cpu_secs(pid),
        }
    }

    /// Percent of one core since `start` (200 = two cores busy).
    pub fn percent(&self) -> Option<f64> {
        let wall = self.started.elapsed().as_secs_f64();
        let used = cpu_secs(self.pid)? - self.cpu0?;
        (wall > 0.0).then(|| used / wall * 100.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        if !std::path::Path::new("/proc/self/stat").exists() {
            return;
        }
        let pid = std::process::id();
        assert!(cpu_secs(pid).is_some());
        assert!(rss_kib(pid).unwrap() > 0);
        assert!(open_files_limit().unwrap() > 0);
    }
}

//! The server's own view of a run's store commits (encoding a batch into the journal, any
//! wait for room while the tables lag, the append and its sync: what every acknowledged
//! send waits for), read from its `/metrics` before and after the run, so over the whole
//! run, warm-up and connecting included: how many took over 20, 50 and 100 ms. A latency
//! tail that matches commits that slow was spent there, most often in the disk's sync
//! (compare `pigeon bench disk`); one that does not was spent elsewhere.

use super::Report;
use super::report::round3;
use serde_json::Value;

const HISTOGRAM: &str = "pigeon_store_commit_seconds";

/// A snapshot of the commit-time histogram: the cumulative bucket counts by upper bound (in
/// seconds), the count and the sum.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Commits {
    buckets: Vec<(f64, u64)>,
    count: u64,
    sum_secs: f64,
}

impl Commits {
    /// Reads the histogram from a Prometheus text exposition (no commit yet: none there).
    pub fn parse(text: &str) -> Commits {
        let mut c = Commits::default();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(HISTOGRAM) else {
                continue;
            };
            let Some((key, value)) = rest.rsplit_once(' ') else {
                continue;
            };
            if let Some(le) = key
                .strip_prefix("_bucket{le=\"")
                .and_then(|k| k.strip_suffix("\"}"))
            {
                if let (Ok(le), Ok(n)) = (le.parse::<f64>(), value.parse::<u64>()) {
                    c.buckets.push((le, n));
                }
            } else if key == "_count" {
                c.count = value.parse().unwrap_or(0);
            } else if key == "_sum" {
                c.sum_secs = value.parse().unwrap_or(0.0);
            }
        }
        c.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        c
    }

    /// What happened between `before` and this snapshot.
    pub fn since(&self, before: &Commits) -> Commits {
        let earlier = |le: f64| {
            before
                .buckets
                .iter()
                .find(|(b, _)| *b == le)
                .map_or(0, |(_, n)| *n)
        };
        Commits {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, n)| (le, n.saturating_sub(earlier(le))))
                .collect(),
            count: self.count.saturating_sub(before.count),
            sum_secs: (self.sum_secs - before.sum_secs).max(0.0),
        }
    }

    /// What happened between two snapshots, when both were read.
    pub fn between(before: Option<Commits>, after: Option<Commits>) -> Option<Commits> {
        Some(after?.since(&before?))
    }

    /// Commits that took longer than `secs`, if the histogram has that bound.
    fn over(&self, secs: f64) -> Option<u64> {
        let within = self.buckets.iter().find(|(le, _)| *le == secs)?.1;
        Some(self.count.saturating_sub(within))
    }

    /// Adds the run's commit figures to `rep` (`null` when the server's metrics were not read).
    pub fn report(run: Option<&Commits>, rep: &mut Report) {
        let over = |secs: f64| -> Value {
            run.and_then(|c| c.over(secs))
                .map_or(Value::Null, Value::from)
        };
        rep.set("store_commits", run.map_or(Value::Null, |c| c.count.into()));
        rep.set(
            "store_commit_mean_ms",
            run.filter(|c| c.count > 0).map_or(Value::Null, |c| {
                round3(c.sum_secs * 1000.0 / c.count as f64)
            }),
        );
        rep.set("store_commits_over_20ms", over(0.02));
        rep.set("store_commits_over_50ms", over(0.05));
        rep.set("store_commits_over_100ms", over(0.1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(b: [u64; 4], count: u64, sum: f64) -> String {
        format!(
            "# TYPE pigeon_store_commit_seconds histogram\n\
             pigeon_store_commit_seconds_bucket{{le=\"0.005\"}} {}\n\
             pigeon_store_commit_seconds_bucket{{le=\"0.02\"}} {}\n\
             pigeon_store_commit_seconds_bucket{{le=\"0.05\"}} {}\n\
             pigeon_store_commit_seconds_bucket{{le=\"0.1\"}} {}\n\
             pigeon_store_commit_seconds_bucket{{le=\"+Inf\"}} {count}\n\
             pigeon_store_commit_seconds_sum {sum}\n\
             pigeon_store_commit_seconds_count {count}\n\
             pigeon_batch_size_count 99\n",
            b[0], b[1], b[2], b[3]
        )
    }

    #[test]
    fn a_runs_slow_commits_are_counted_from_two_snapshots() {
        let before = Commits::parse(&text([10, 12, 12, 12], 12, 0.05));
        let after = Commits::parse(&text([100, 110, 113, 114], 116, 1.35));
        let run = after.since(&before);
        assert_eq!(run.count, 104);
        assert_eq!(run.over(0.02), Some(6));
        assert_eq!(run.over(0.05), Some(3));
        assert_eq!(run.over(0.1), Some(2));
        assert_eq!(run.over(0.25), None);
        let mut rep = Report::new("t", "t");
        Commits::report(Some(&run), &mut rep);
        let v = rep.json();
        assert_eq!(v["store_commits"], 104);
        assert_eq!(v["store_commit_mean_ms"], 12.5);
        assert_eq!(v["store_commits_over_50ms"], 3);
    }

    #[test]
    fn no_histogram_yet_reads_as_no_commits_and_unread_metrics_as_unknown() {
        let none = Commits::parse("pigeon_batch_size_count 3\n");
        let after = Commits::parse(&text([3, 4, 4, 4], 4, 0.01));
        let run = Commits::between(Some(none), Some(after)).unwrap();
        assert_eq!(run.count, 4);
        assert_eq!(run.over(0.02), Some(0));
        let mut rep = Report::new("t", "t");
        Commits::report(None, &mut rep);
        assert!(rep.json()["store_commits_over_100ms"].is_null());
    }
}

//! The result of a run: an ordered list of figures printed as a table on stdout and written
//! as one JSON object with `--json`; the correctness counts decide the exit code.

use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

/// The correctness counts of a run (see the module doc of `bench`).
#[derive(Debug, Default)]
pub struct Checks {
    pub lost: u64,
    pub duplicated: u64,
    pub out_of_order: u64,
    /// Dropped connections, refused sends, sends never answered, seqs given twice, ...
    pub errors: u64,
    /// What the errors were, by kind.
    pub error_kinds: BTreeMap<String, u64>,
}

impl Checks {
    pub fn error(&mut self, kind: impl Into<String>, n: u64) {
        if n > 0 {
            self.errors += n;
            *self.error_kinds.entry(kind.into()).or_default() += n;
        }
    }

    pub fn ok(&self) -> bool {
        self.lost == 0 && self.duplicated == 0 && self.out_of_order == 0 && self.errors == 0
    }
}

pub struct Report {
    title: String,
    rows: Vec<(String, Value)>,
}

/// A float with three decimals (enough for milliseconds and rates).
pub fn round3(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

/// p50 / p99 / p99.9 / max of latency samples (microseconds), in milliseconds.
pub fn latency_summary(mut samples: Vec<u32>) -> Value {
    if samples.is_empty() {
        return json!({"count": 0, "p50": null, "p99": null, "p999": null, "max": null});
    }
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
        round3(f64::from(samples[i]) / 1000.0)
    };
    json!({
        "count": samples.len(),
        "p50": at(0.50),
        "p99": at(0.99),
        "p999": at(0.999),
        "max": at(1.0),
    })
}

impl Report {
    pub fn new(scenario: &str, title: impl Into<String>) -> Report {
        Report {
            title: title.into(),
            rows: vec![("scenario".into(), json!(scenario))],
        }
    }

    pub fn set(&mut self, key: &str, value: impl Into<Value>) {
        let value = value.into();
        match self.rows.iter_mut().find(|(k, _)| k == key) {
            Some(row) => row.1 = value,
            None => self.rows.push((key.to_owned(), value)),
        }
    }

    /// A float figure (three decimals), `null` when unknown.
    pub fn num(&mut self, key: &str, value: Option<f64>) {
        self.set(key, value.map(round3).unwrap_or(Value::Null));
    }

    /// A latency distribution (samples in microseconds), as milliseconds.
    pub fn latency(&mut self, key: &str, samples: Vec<u32>) {
        self.set(key, latency_summary(samples));
    }

    /// The figures so far as one JSON object, in their order.
    pub fn json(&self) -> Value {
        Value::Object(self.rows.iter().cloned().collect())
    }

    /// Adds the correctness counts and answers the exit code after printing (and writing the
    /// JSON file when asked).
    pub fn finish(mut self, checks: &Checks, json_path: Option<&Path>) -> ExitCode {
        self.set("lost", checks.lost);
        self.set("duplicated", checks.duplicated);
        self.set("out_of_order", checks.out_of_order);
        self.set("errors", checks.errors);
        let kinds: Map<String, Value> = checks
            .error_kinds
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        self.set("error_kinds", Value::Object(kinds));
        self.set("ok", checks.ok());
        self.print();
        if let Some(path) = json_path {
            let text = serde_json::to_string_pretty(&self.json()).unwrap_or_default();
            if let Err(e) = std::fs::write(path, text + "\n") {
                eprintln!("pigeon bench: cannot write {}: {e}", path.display());
                return ExitCode::from(2);
            }
        }
        if checks.ok() {
            ExitCode::SUCCESS
        } else {
            eprintln!(
                "pigeon bench: FAILED: {} lost, {} duplicated, {} out of order, {} errors {:?}",
                checks.lost,
                checks.duplicated,
                checks.out_of_order,
                checks.errors,
                checks.error_kinds
            );
            ExitCode::FAILURE
        }
    }

    fn print(&self) {
        println!();
        println!("{}", self.title);
        let width = self.rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 2;
        for (key, value) in &self.rows {
            println!("  {key:<width$}{}", show(value));
        }
    }
}

/// A value in the table: latency objects as one line, others plainly.
fn show(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Object(o) if o.contains_key("p50") => {
            let f = |k: &str| match &o[k] {
                Value::Null => "-".to_owned(),
                x => x.to_string(),
            };
            format!(
                "p50 {}  p99 {}  p99.9 {}  max {} ms  (n={})",
                f("p50"),
                f("p99"),
                f("p999"),
                f("max"),
                o["count"]
            )
        }
        Value::Object(o) if o.is_empty() => "-".into(),
        Value::Object(o) => o
            .iter()
            .map(|(k, v)| format!("{k}={}", show(v)))
            .collect::<Vec<_>>()
            .join("  "),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let s: Vec<u32> = (1..=1000).map(|i| i * 1000).collect();
        let v = latency_summary(s);
        assert_eq!(v["p50"], json!(500.0));
        assert_eq!(v["p99"], json!(990.0));
        assert_eq!(v["p999"], json!(999.0));
        assert_eq!(v["max"], json!(1000.0));
        assert_eq!(v["count"], json!(1000));
        assert_eq!(latency_summary(vec![])["p50"], Value::Null);
    }
}

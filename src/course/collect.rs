//! A class's results (`workshop collect DIR`, for instructors): every student's `results.json`
//! under a folder as one line of the course's key numbers, and their CSV. Files that are not a
//! workspace's results are listed and skipped. The command is `cmd::compare::collect`.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use serde::Serialize;

use super::state::{Outcome, Results};

/// One student's line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Student {
    pub name: String,
    pub device: String,
    pub backend: String,
    /// Exercises with at least one recorded step.
    pub exercises: usize,
    /// Steps whose latest attempt passed, of all steps attempted.
    pub passed: usize,
    pub attempted: usize,
    pub baseline_throughput: Option<f64>,
    pub fp16_speedup: Option<f64>,
    pub efficiency: Option<f64>,
    pub scaling_efficiency: Option<f64>,
    pub path: PathBuf,
}

/// The key numbers: (column, exercise, step, metric).
const KEY: [(&str, &str, &str, &str); 4] = [
    ("baseline images/s", "01-baseline", "baseline", "throughput"),
    ("FP16 speedup", "02-precision", "summary", "fp16_speedup"),
    ("efficiency", "04-flops", "profile", "efficiency"),
    ("scaling", "05-multi-device", "two", "scaling_efficiency"),
];

/// Every `results.json` below `dir` (not following links, at most 8 levels down).
fn find(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.filter_map(|e| e.ok()).collect();
    entries.sort_by_key(|e| e.path());
    for e in entries {
        let path = e.path();
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_dir() && depth < 8 {
            find(&path, depth + 1, out);
        } else if kind.is_file() && path.file_name().is_some_and(|n| n == "results.json") {
            out.push(path);
        }
    }
}

fn student(path: &Path, r: &Results) -> Student {
    let latest = |ex: &str, step: &str| {
        r.attempts
            .iter()
            .rev()
            .find(|a| a.exercise == ex && a.step == step)
    };
    let value = |(_, ex, step, metric): (&str, &str, &str, &str)| {
        latest(ex, step).and_then(|a| a.metrics.get(metric).copied())
    };
    let env = |k: &str| {
        r.attempts
            .iter()
            .rev()
            .find_map(|a| a.environment.get(k).cloned())
            .unwrap_or_else(|| "—".into())
    };
    let mut exercises: Vec<&str> = r.attempts.iter().map(|a| a.exercise.as_str()).collect();
    exercises.sort_unstable();
    exercises.dedup();
    let latest_steps: Vec<_> = exercises.iter().flat_map(|e| r.latest(e)).collect();
    Student {
        name: r.student.clone(),
        device: env("device"),
        backend: env("backend"),
        exercises: exercises.len(),
        passed: latest_steps
            .iter()
            .filter(|a| a.outcome == Outcome::Pass)
            .count(),
        attempted: latest_steps.len(),
        baseline_throughput: value(KEY[0]),
        fp16_speedup: value(KEY[1]),
        efficiency: value(KEY[2]),
        scaling_efficiency: value(KEY[3]),
        path: path.to_path_buf(),
    }
}

/// A file that was not a workspace's results, and why.
pub type Skipped = (PathBuf, String);

/// The class under `dir`, and the files skipped.
pub fn collect(dir: &Path) -> Result<(Vec<Student>, Vec<Skipped>)> {
    if !dir.is_dir() {
        bail!("`{}` is not a folder", dir.display());
    }
    let mut files = Vec::new();
    find(dir, 0, &mut files);
    let mut class = Vec::new();
    let mut skipped = Vec::new();
    for f in files {
        let parsed = crate::files::read_text(&f)
            .map_err(|e| format!("{e:#}"))
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).map_err(|e| e.to_string()))
            .and_then(|mut v| {
                crate::units::printable_json(&mut v);
                serde_json::from_value::<Results>(v).map_err(|e| e.to_string())
            });
        match parsed {
            Ok(r) => class.push(student(&f, &r)),
            Err(e) => skipped.push((f, format!("not a workshop results file ({e})"))),
        }
    }
    Ok((class, skipped))
}

/// A student's line as table cells, in [`HEADER`]'s order.
pub fn cells(s: &Student) -> Vec<String> {
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("—".into(), f);
    vec![
        s.name.clone(),
        s.device.clone(),
        s.backend.clone(),
        s.exercises.to_string(),
        format!("{}/{}", s.passed, s.attempted),
        opt(s.baseline_throughput, &|v| format!("{v:.1}")),
        opt(s.fp16_speedup, &|v| format!("{v:.2}×")),
        opt(s.efficiency, &|v| format!("{:.0}%", v * 100.0)),
        opt(s.scaling_efficiency, &|v| format!("{:.0}%", v * 100.0)),
    ]
}

/// The class table's columns.
pub const HEADER: [&str; 9] = [
    "student",
    "device",
    "backend",
    "exercises",
    "steps passed",
    "baseline images/s",
    "FP16 speedup",
    "efficiency",
    "scaling",
];

/// The class as CSV (numbers unformatted).
pub fn csv(class: &[Student]) -> String {
    let quote = crate::units::csv_text;
    let num = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
    let mut out = String::from(
        "student,device,backend,exercises,steps_passed,steps_attempted,baseline_throughput,fp16_speedup,efficiency,scaling_efficiency,path\n",
    );
    for s in class {
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{}\n",
            quote(&s.name),
            quote(&s.device),
            quote(&s.backend),
            s.exercises,
            s.passed,
            s.attempted,
            num(s.baseline_throughput),
            num(s.fp16_speedup),
            num(s.efficiency),
            num(s.scaling_efficiency),
            quote(&s.path.display().to_string())
        ));
    }
    out
}

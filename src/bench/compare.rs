//! Comparing benchmark records: a side-by-side table, throughput ratios against the first
//! record, a verdict per pair that respects each run's own spread, and warnings whenever the
//! configurations or environments differ, so an unfair comparison is never silent.

use serde::{Deserialize, Serialize};

use super::record::BenchRecord;

/// One record in the comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// What sets this record apart from the others (device, precision, batch, ...), or its
    /// file name when nothing does.
    pub label: String,
    pub source: String,
    pub device: String,
    pub backend: String,
    pub precision: String,
    pub network: String,
    pub batch: usize,
    pub input_size: usize,
    pub median_ms: f64,
    /// The 99th percentile of the iteration times, from the samples (so older records have it).
    #[serde(default)]
    pub p99_ms: f64,
    pub throughput: f64,
    /// The slowest and the fastest iteration's throughput: the spread verdicts are judged on.
    pub throughput_range: (f64, f64),
    pub peak_memory_mib: f64,
    pub cv: f64,
    /// What the throughput counts: `images/s`, or a language model's decode `tokens/s`.
    #[serde(default = "images_per_s")]
    pub unit: String,
    /// Images (tokens) per joule, where the run's telemetry read the device's energy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_joule: Option<f64>,
}

fn images_per_s() -> String {
    "images/s".into()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Every sample of this run beats every sample of the first.
    Faster,
    Slower,
    /// The spreads overlap and the medians are within 2%.
    Same,
    /// The spreads overlap but the medians differ by more: measure again, longer.
    Ambiguous,
}

impl Direction {
    pub fn word(self) -> &'static str {
        match self {
            Direction::Faster => "faster",
            Direction::Slower => "slower",
            Direction::Same => "same",
            Direction::Ambiguous => "ambiguous",
        }
    }

    /// A difference beyond the runs' own noise.
    pub fn is_clear(self) -> bool {
        matches!(self, Direction::Faster | Direction::Slower)
    }
}

/// A record against the first one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pair {
    /// Index of the record in `rows`.
    pub index: usize,
    /// Throughput of this record / throughput of the first.
    pub ratio: f64,
    pub verdict: Direction,
    /// Why, in words.
    pub reason: String,
    /// "A is 1.26× faster than B on resnet50 fp32 b32".
    pub sentence: String,
}

/// How a chart of these records is best drawn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// Grouped bars of throughput.
    Bars,
    /// Lines of throughput against a swept parameter (`batch size`, `input size`).
    Lines { param: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub rows: Vec<Row>,
    pub pairs: Vec<Pair>,
    /// Configuration differences that make a comparison unfair or change what it measures.
    pub warnings: Vec<String>,
    /// Environment differences (driver, kernel version, threads, ...).
    pub differences: Vec<String>,
    /// Records whose telemetry found the machine unsteady, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unsteady: Vec<String>,
    pub shape: Shape,
}

/// Medians within this fraction of each other are "the same" when the spreads overlap.
const SAME: f64 = 0.02;
/// Fewer timed samples than this cannot show a spread.
const MIN_SAMPLES: usize = 3;

/// Seconds per image of each timed sample.
fn per_image(r: &BenchRecord) -> Vec<f64> {
    r.samples_s
        .iter()
        .map(|s| s / r.config.batch_size.max(1) as f64)
        .collect()
}

fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// The verdict of `b` against `a` from their per-image samples.
pub fn verdict(a: &BenchRecord, b: &BenchRecord) -> (Direction, String) {
    let (sa, sb) = (per_image(a), per_image(b));
    let ratio = a.stats.throughput_median.max(f64::MIN_POSITIVE)
        / b.stats.throughput_median.max(f64::MIN_POSITIVE);
    let differ = (ratio - 1.0).abs();
    if sa.len() < MIN_SAMPLES || sb.len() < MIN_SAMPLES {
        return (
            Direction::Ambiguous,
            format!(
                "too few timed iterations to see the noise ({} and {}; at least {MIN_SAMPLES} each)",
                sa.len(),
                sb.len()
            ),
        );
    }
    let unsteady: Vec<String> = [a, b]
        .iter()
        .filter_map(|r| r.telemetry())
        .flat_map(|t| t.summary.concerns.clone())
        .collect();
    if !unsteady.is_empty() {
        return (
            Direction::Ambiguous,
            format!(
                "the machine was not steady during the runs ({}): measure again when it is",
                unsteady.join("; ")
            ),
        );
    }
    let ((alo, ahi), (blo, bhi)) = (range(&sa), range(&sb));
    if differ <= SAME {
        return (
            Direction::Same,
            format!("the medians are within {:.0}%", SAME * 100.0),
        );
    }
    if bhi < alo {
        (
            Direction::Faster,
            "its slowest iteration beats the other's fastest".into(),
        )
    } else if blo > ahi {
        (
            Direction::Slower,
            "its fastest iteration is slower than the other's slowest".into(),
        )
    } else {
        (
            Direction::Ambiguous,
            format!(
                "the medians differ by {:.1}% but the runs' spreads overlap: measure again with more iterations",
                differ * 100.0
            ),
        )
    }
}

/// What tells records apart, in label order: device, backend, precision, network, batch
/// (`BATCH`), input size (`INPUT`), compile mode, kernels.
const FIELDS: usize = 8;
const BATCH: usize = 4;
const INPUT: usize = 5;
type Fields = [String; FIELDS];

/// Compare `records` (with where each came from) against the first.
pub fn compare(records: &[(String, BenchRecord)]) -> Comparison {
    let fields = |r: &BenchRecord| -> Fields {
        [
            r.environment.device.name.clone(),
            r.config.backend.to_string(),
            r.config.precision.name().to_string(),
            r.config.network.clone(),
            format!("b{}", r.config.batch_size),
            format!("{}px", r.config.input_size),
            r.config.compile.map_or("eager", |m| m.name()).to_string(),
            format!("{} kernels", r.config.kernels.name()),
        ]
    };
    let all: Vec<Fields> = records.iter().map(|(_, r)| fields(r)).collect();
    let varies: Vec<bool> = (0..FIELDS)
        .map(|i| all.iter().any(|f| f[i] != all[0][i]))
        .collect();
    let rows = rows(records, &all, &varies);
    if records.is_empty() {
        return Comparison {
            rows,
            pairs: Vec::new(),
            warnings: Vec::new(),
            differences: Vec::new(),
            unsteady: Vec::new(),
            shape: Shape::Bars,
        };
    }
    let unsteady = (records.iter().zip(&rows))
        .filter_map(|((_, r), row)| {
            let concerns = &r.telemetry()?.summary.concerns;
            (!concerns.is_empty()).then(|| format!("{}: {}", row.label, concerns.join("; ")))
        })
        .collect();
    let pairs = pairs(records, &rows, &all, &varies);
    let (warnings, differences) = config_differences(records, &rows);
    Comparison {
        shape: shape(&all, &varies),
        rows,
        pairs,
        warnings,
        differences,
        unsteady,
    }
}

/// Images per second of a step of `batch` images that took `seconds`.
fn per_second(batch: usize, seconds: f64) -> f64 {
    batch as f64 / seconds.max(f64::MIN_POSITIVE)
}

/// A row per record, labelled by the fields that vary (by its file where runs repeat one
/// configuration).
fn rows(records: &[(String, BenchRecord)], all: &[Fields], varies: &[bool]) -> Vec<Row> {
    let rows: Vec<Row> = records
        .iter()
        .zip(all)
        .map(|((source, r), f)| {
            let parts: Vec<&str> = (0..FIELDS)
                .filter(|&i| varies[i])
                .map(|i| f[i].as_str())
                .collect();
            let label = if parts.is_empty() {
                std::path::Path::new(source)
                    .file_stem()
                    .map_or(source.clone(), |s| s.to_string_lossy().into_owned())
            } else {
                parts.join(" ")
            };
            Row {
                label,
                source: source.clone(),
                device: r.environment.device.name.clone(),
                backend: r.config.backend.to_string(),
                precision: r.config.precision.name().to_string(),
                network: r.config.network.clone(),
                batch: r.config.batch_size,
                input_size: r.config.input_size,
                median_ms: r.stats.median_s * 1e3,
                p99_ms: {
                    let mut sorted = r.samples_s.clone();
                    sorted.sort_by(f64::total_cmp);
                    super::stats::percentile(&sorted, 99.0) * 1e3
                },
                throughput: r.stats.throughput_median,
                throughput_range: (
                    per_second(r.config.batch_size, r.stats.max_s),
                    per_second(r.config.batch_size, r.stats.min_s),
                ),
                peak_memory_mib: r.memory.peak as f64 / (1024.0 * 1024.0),
                cv: r.stats.cv,
                unit: match r.llm {
                    Some(_) => "tokens/s".into(),
                    None => images_per_s(),
                },
                per_joule: r.per_joule(),
            }
        })
        .collect();
    // Repeated runs of one configuration: tell them apart by their files.
    let mut rows = rows;
    let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
    for r in rows.iter_mut() {
        if labels.iter().filter(|l| **l == r.label).count() > 1 {
            let stem = std::path::Path::new(&r.source)
                .file_stem()
                .map_or(r.source.clone(), |s| s.to_string_lossy().into_owned());
            if stem != r.label {
                r.label = format!("{} [{stem}]", r.label);
            }
        }
    }
    rows
}

/// Each record after the first against the first: the throughput ratio, the verdict and a
/// sentence that says the common configuration once.
fn pairs(
    records: &[(String, BenchRecord)],
    rows: &[Row],
    all: &[Fields],
    varies: &[bool],
) -> Vec<Pair> {
    let first = &records[0].1;
    // The common configuration, said once in every sentence.
    let common: Vec<&str> = (3..6)
        .filter(|&i| !varies[i])
        .map(|i| all[0][i].as_str())
        .chain((2..3).filter(|&i| !varies[i]).map(|i| all[0][i].as_str()))
        .collect();
    let on = if common.is_empty() {
        String::new()
    } else {
        format!(" on {}", common.join(" "))
    };
    records
        .iter()
        .enumerate()
        .skip(1)
        .map(|(index, (_, r))| {
            let ratio =
                r.stats.throughput_median / first.stats.throughput_median.max(f64::MIN_POSITIVE);
            let (verdict, reason) = verdict(first, r);
            let (a, b) = (&rows[index].label, &rows[0].label);
            let sentence = if ratio >= 1.0 {
                format!("{a} is {ratio:.2}× faster than {b}{on}")
            } else {
                format!("{a} is {:.2}× slower than {b}{on}", 1.0 / ratio)
            };
            Pair {
                index,
                ratio,
                verdict,
                reason,
                sentence,
            }
        })
        .collect()
}

/// What differs between the first record's configuration and environment and each other's:
/// warnings where the comparison is not like for like, differences worth knowing otherwise.
fn config_differences(
    records: &[(String, BenchRecord)],
    rows: &[Row],
) -> (Vec<String>, Vec<String>) {
    let first = &records[0].1;
    let mut warnings = Vec::new();
    let mut differences = Vec::new();
    for (i, (_, r)) in records.iter().enumerate().skip(1) {
        let (a, b) = (&first.config, &r.config);
        let mut differ = |what: &str, x: String, y: String, warn: bool| {
            if x != y {
                let line = format!("{what}: {x} ({}) vs {y} ({})", rows[0].label, rows[i].label);
                if warn {
                    warnings.push(line);
                } else {
                    differences.push(line);
                }
            }
        };
        differ("network", a.network.clone(), b.network.clone(), true);
        differ(
            "throughput",
            rows[0].unit.clone(),
            rows[i].unit.clone(),
            true,
        );
        let tokens = |c: &super::record::BenchConfig| match (c.prompt_len, c.gen_len) {
            (Some(p), Some(n)) => format!("{p} + {n}"),
            _ => "none".into(),
        };
        differ("prompt + new tokens", tokens(a), tokens(b), true);
        differ(
            "batch size",
            a.batch_size.to_string(),
            b.batch_size.to_string(),
            true,
        );
        differ(
            "precision",
            a.precision.name().into(),
            b.precision.name().into(),
            true,
        );
        differ(
            "input size",
            a.input_size.to_string(),
            b.input_size.to_string(),
            true,
        );
        differ(
            "iterations",
            a.iterations.to_string(),
            b.iterations.to_string(),
            true,
        );
        differ("weights", a.weights.clone(), b.weights.clone(), true);
        differ(
            "profiling",
            a.profile.to_string(),
            b.profile.to_string(),
            true,
        );
        let threads = |c: &super::record::BenchConfig| {
            c.threads.map_or("all cores".into(), |t| t.to_string())
        };
        differ("threads", threads(a), threads(b), false);
        let (ea, eb) = (&first.environment, &r.environment);
        differ(
            "device",
            ea.device.name.clone(),
            eb.device.name.clone(),
            false,
        );
        differ(
            "driver",
            ea.device.driver.clone().unwrap_or_default(),
            eb.device.driver.clone().unwrap_or_default(),
            false,
        );
        // Kernel versions name the precision: only a change at the same precision is news.
        if a.precision == b.precision {
            differ(
                "kernels",
                ea.kernel_version.clone(),
                eb.kernel_version.clone(),
                false,
            );
        }
        differ(
            "workshop",
            ea.runner_version.clone(),
            eb.runner_version.clone(),
            false,
        );
        differ("CPU", ea.cpu_model.clone(), eb.cpu_model.clone(), false);
        differ(
            "host",
            ea.hostname.clone().unwrap_or_default(),
            eb.hostname.clone().unwrap_or_default(),
            false,
        );
    }
    warnings.dedup();
    differences.dedup();
    (warnings, differences)
}

/// Lines where the records sweep batch (or input) size within a series, else bars.
fn shape(all: &[Fields], varies: &[bool]) -> Shape {
    // A sweep: records that differ only in batch (or input) size within a series.
    let key = |f: &Fields, skip: usize| -> Vec<String> {
        (0..FIELDS)
            .filter(|&i| i != skip)
            .map(|i| f[i].clone())
            .collect()
    };
    let swept = |skip: usize| {
        varies[skip]
            && all
                .iter()
                .enumerate()
                .any(|(i, f)| all.iter().skip(i + 1).any(|g| key(f, skip) == key(g, skip)))
    };
    if swept(BATCH) {
        Shape::Lines {
            param: "batch size".into(),
        }
    } else if swept(INPUT) {
        Shape::Lines {
            param: "input size".into(),
        }
    } else {
        Shape::Bars
    }
}

/// Read a `workshop bench --json` record, saying plainly what else a file is.
pub fn load(path: &std::path::Path) -> anyhow::Result<BenchRecord> {
    use anyhow::Context as _;
    let text = crate::files::read_text(path)?;
    let mut value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("`{}` is not JSON", path.display()))?;
    crate::units::printable_json(&mut value);
    let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
    if kind != "bench" {
        anyhow::bail!(
            "`{}` is not a `workshop bench --json` record{}",
            path.display(),
            if kind.is_empty() {
                String::new()
            } else {
                format!(" (it is a `{kind}` record)")
            }
        );
    }
    let version = value
        .get("schema_version")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    if version > u64::from(super::record::SCHEMA_VERSION) {
        anyhow::bail!(
            "`{}` was written by a newer workshop (record schema {version}; this one reads {})",
            path.display(),
            super::record::SCHEMA_VERSION
        );
    }
    let record: BenchRecord = serde_json::from_value(value)
        .with_context(|| format!("`{}` is a damaged bench record", path.display()))?;
    if let Err(why) = plausible(&record) {
        anyhow::bail!("`{}` cannot be a measurement: {why}", path.display());
    }
    Ok(record)
}

/// What makes a record impossible as a measurement (issue 27: batch 0 and negative throughput
/// were compared as if measured): no images, no samples, a step that took no or negative time,
/// a statistic that is not a positive number.
fn plausible(r: &BenchRecord) -> Result<(), String> {
    if r.config.batch_size == 0 {
        return Err("its batch_size is 0".into());
    }
    if r.samples_s.is_empty() {
        return Err("it holds no timed samples".into());
    }
    if let Some((i, s)) =
        (r.samples_s.iter().enumerate()).find(|(_, s)| !(s.is_finite() && **s > 0.0))
    {
        return Err(format!(
            "sample {i} is {s} s; every step takes a positive time"
        ));
    }
    let s = &r.stats;
    for (name, v) in [
        ("median_s", s.median_s),
        ("mean_s", s.mean_s),
        ("throughput", s.throughput),
        ("throughput_median", s.throughput_median),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!("its stats.{name} is {v}, not a positive number"));
        }
    }
    Ok(())
}

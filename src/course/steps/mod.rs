//! One file per kind of step, each a function with the same signature ([`StepFn`]): read the
//! step's settings from [`StepContext`], run it through the engine, show what it did through
//! the [`Ui`], and record its metrics, table and answer in [`StepOutput`]. The runner
//! (`course::runner`) picks the function by kind, then judges the expectations and builds the
//! attempt. Adding a step kind: a variant of `schema::StepKind`, a file here, a line in
//! [`function`], its metrics in `course::metrics`.

mod accuracy;
mod bench;
mod chart;
mod compare;
mod doctor;
pub mod kernel;
mod llm;
mod peak;
mod profile;
mod question;
mod sweep;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;

use super::expect::{Check, Metrics};
use super::metrics::Recorded;
use super::schema::{BenchSpec, Step, StepKind};
use super::state::{ResultTable, Workspace};
use super::ui::Ui;
use crate::bench::Event;
use crate::bench::record::{BenchConfig, BenchRecord};

pub use accuracy::accuracy;

/// What a step runs with.
pub struct StepContext<'a> {
    pub ws: &'a Workspace,
    /// Where the course comes from (kernel steps read their start file from it).
    pub course: &'a super::Source,
    pub exercise: &'a str,
    pub step: &'a Step,
    /// What the earlier steps of the exercise left.
    pub earlier: &'a Earlier,
    /// The answer to a question step, given on the command line.
    pub answer: Option<&'a str>,
    /// Whether the device computes on the host's cores (`runner::runs_on_host`): steps then
    /// take their `cpu` settings.
    pub host_sized: bool,
}

impl StepContext<'_> {
    /// The step's id.
    pub fn id(&self) -> &str {
        self.step.id.get_ref()
    }

    /// The step's `[bench]` section, which its kind requires (lint checks it is there).
    fn bench_spec(&self) -> Result<&BenchSpec> {
        Ok(self
            .step
            .bench
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("a {:?} step needs a bench section", self.step.kind))?
            .get_ref())
    }

    /// The step's bench settings for this workspace's backend, on `workshop bench`'s defaults.
    fn bench_config(&self, spec: &BenchSpec) -> BenchConfig {
        self.bench_config_sized(spec, self.host_sized)
    }

    /// [`Self::bench_config`], sized for the host's cores or not as `host_sized` says (a step
    /// that runs on another device than the workspace's decides for that device).
    fn bench_config_sized(&self, spec: &BenchSpec, host_sized: bool) -> BenchConfig {
        let state = &self.ws.state;
        let s = spec.resolved(state.backend, host_sized);
        let d = BenchConfig::default();
        BenchConfig {
            network: s.network.unwrap_or(d.network),
            batch_size: s.batch_size.unwrap_or(d.batch_size),
            iterations: s.iterations.unwrap_or(d.iterations),
            warmup: s.warmup.unwrap_or(d.warmup),
            precision: s.precision.unwrap_or(d.precision),
            backend: state.backend,
            device: state.device,
            threads: state.threads,
            input_size: s.input_size.unwrap_or(d.input_size),
            kernels: s.kernels.unwrap_or(d.kernels),
            compile: s.compile,
            prompt_len: s.prompt_len,
            gen_len: s.gen_len,
            framework: s.framework.unwrap_or_default(),
            scenario: s.scenario.map(|scenario| {
                crate::bench::scenario::ScenarioConfig::new(
                    scenario,
                    host_sized,
                    s.queries,
                    s.duration_s,
                    s.latency_bound_ms,
                    s.batch_timeout_ms,
                    s.qps,
                )
            }),
            ..d
        }
    }

    /// Where the course keeps the record of step `step`'s run (for chart steps and `compare`),
    /// checked to stay in `records/`.
    fn record_path(&self, step: &str) -> Result<PathBuf> {
        let name = format!("{}.{step}.json", self.exercise);
        crate::files::child(&self.ws.dir.join("records"), &name)
    }

    /// A file this step writes under the workspace's `folder`: `EX.STEP.suffix`, checked to
    /// stay there whatever the course's ids say.
    fn own_file(&self, folder: &str, suffix: &str) -> Result<PathBuf> {
        let name = format!("{}.{}.{suffix}", self.exercise, self.id());
        crate::files::child(&self.ws.dir.join(folder), &name)
    }
}

/// What a step leaves for its attempt.
#[derive(Default)]
pub struct StepOutput {
    pub metrics: Recorded,
    pub table: Option<ResultTable>,
    pub answer: Option<String>,
    /// Checks the step judges itself (a question's answer); expectations come on top.
    pub checks: Vec<Check>,
    /// Where it ran (`device`, `kernel_version`, `cpu_model`, ...).
    pub environment: BTreeMap<String, String>,
    /// The device, for expectations per device.
    pub device: String,
}

impl StepOutput {
    /// Note a run's device and kernel version.
    fn note_run(&mut self, r: &BenchRecord) {
        self.device = r.environment.device.name.clone();
        self.environment
            .insert("device".into(), self.device.clone());
        self.environment.insert(
            "kernel_version".into(),
            r.environment.kernel_version.clone(),
        );
    }
}

/// What the earlier steps of an exercise left: the metrics of each step's latest attempt, and
/// why each step that could not run here (its latest attempt unavailable) could not.
#[derive(Debug, Default)]
pub struct Earlier {
    pub metrics: Metrics,
    pub unavailable: BTreeMap<String, String>,
}

/// A step that cannot run on this machine or build, and why: recorded as unavailable.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

impl Earlier {
    /// Refuse a step that uses (`STEP.metric`) a step which could not run here: a comparison
    /// of runs that never happened (the two-device run on a one-GPU machine) is not available
    /// here either, not a failure and not a question to guess at.
    fn require<'a>(&self, references: impl IntoIterator<Item = &'a str>) -> Result<()> {
        for r in references {
            let s = r.split_once('.').map_or(r, |(s, _)| s);
            if let Some(why) = self.unavailable.get(s) {
                return Err(Unavailable(format!(
                    "it uses step `{s}`, which could not run here ({why})"
                ))
                .into());
            }
        }
        Ok(())
    }

    /// The value of `STEP.metric`, if that step has it.
    fn value(&self, reference: &str) -> Option<f64> {
        let (s, m) = reference.split_once('.').unwrap_or((reference, ""));
        self.metrics.get(s).and_then(|ms| ms.get(m)).copied()
    }
}

/// The signature every kind of step has.
pub type StepFn = fn(&StepContext<'_>, &mut StepOutput, &mut dyn Ui) -> Result<()>;

/// The function that runs a kind of step.
pub fn function(kind: StepKind) -> StepFn {
    match kind {
        StepKind::Note => |_, _, _| Ok(()),
        StepKind::Doctor => doctor::run,
        StepKind::Bench => bench::run,
        StepKind::Profile => profile::run,
        StepKind::Chart => chart::run,
        StepKind::Sweep => sweep::run,
        StepKind::Accuracy => accuracy::run,
        StepKind::Peak => peak::run,
        StepKind::Compare => compare::run,
        StepKind::Question => question::run,
        StepKind::Llm => llm::run,
        StepKind::Kernel => kernel::run,
    }
}

/// One benchmark, with a progress display.
fn bench_with_progress(cfg: &BenchConfig, ui: &mut dyn Ui) -> Result<BenchRecord> {
    let label = format!("{} {} batch {}", cfg.network, cfg.precision, cfg.batch_size);
    let mut ticker = ui.progress(&label, (cfg.warmup + cfg.iterations) as u64);
    crate::bench::run(cfg, None, &mut |ev| match ev {
        Event::Warmup { .. } | Event::Iteration { .. } | Event::Generation { .. } => ticker.tick(),
        Event::Preparing { .. } | Event::Probe(_) => {}
    })
}

/// What the run's telemetry read: the machine's state and energy, and `unsteady` (1 when it
/// found reasons the times are not the device's own speed, which makes the step's timing
/// checks inconclusive); nothing where it read nothing.
pub(super) fn machine_metrics(r: &BenchRecord, m: &mut Recorded) {
    let Some(t) = r.telemetry() else {
        return;
    };
    state_metrics(t, m);
    let known = [
        ("energy_j", t.summary.energy_j),
        ("per_joule", r.per_joule()),
    ];
    for (name, value) in known {
        if let Some(v) = value {
            m.set(name, v);
        }
    }
}

/// The machine's state during a measurement (a run's, a peak probe's): `unsteady` and the
/// figures behind it.
pub(super) fn state_metrics(t: &crate::bench::telemetry::Telemetry, m: &mut Recorded) {
    let s = &t.summary;
    m.set("unsteady", f64::from(u8::from(!s.concerns.is_empty())));
    let known = [
        ("throttled", s.throttled),
        ("clock_ratio", s.clock_ratio),
        ("other_cores", s.other_cores),
        ("steal", s.steal),
    ];
    for (name, value) in known {
        if let Some(v) = value {
            m.set(name, v);
        }
    }
}

/// [`machine_metrics`] of a step that ran several times (a sweep, a multi-device run): its
/// first unsteady run's, so that one busy run makes the step's timing checks inconclusive,
/// else its last run's.
pub(super) fn machine_metrics_of<'a>(
    runs: impl IntoIterator<Item = &'a BenchRecord>,
    m: &mut Recorded,
) {
    let runs: Vec<&BenchRecord> = runs.into_iter().collect();
    let unsteady = |r: &&&BenchRecord| {
        r.telemetry()
            .is_some_and(|t| !t.summary.concerns.is_empty())
    };
    if let Some(r) = runs.iter().find(unsteady).or(runs.last()) {
        machine_metrics(r, m);
    }
}

/// The metrics of one run (bench and profile steps), `max_batch` where estimated.
fn run_metrics(r: &BenchRecord, max_batch: Option<usize>) -> Recorded {
    let s = &r.stats;
    let mut m = Recorded::default();
    m.set("throughput", s.throughput_median);
    m.set("throughput_mean", s.throughput);
    m.set("median_ms", s.median_s * 1e3);
    m.set("mean_ms", s.mean_s * 1e3);
    m.set("std_ms", s.std_s * 1e3);
    m.set("cv", s.cv);
    m.set("min_ms", s.min_s * 1e3);
    m.set("max_ms", s.max_s * 1e3);
    m.set("us_per_sample", s.us_per_sample);
    m.set("gflops", s.gflops);
    m.set("peak_memory_mib", r.memory.peak as f64 / (1024.0 * 1024.0));
    if r.scenario.is_none() {
        m.set("loss", r.loss);
    }
    if let Some(b) = max_batch {
        m.set("max_batch", b as f64);
    }
    m.set("p90_ms", s.p90_s * 1e3);
    m.set("p99_ms", s.p99_s * 1e3);
    if let Some(run) = &r.scenario {
        let p = run.reported();
        m.set("p50_ms", p.p50_ms);
        m.set("queue_p99_ms", p.queue_p99_ms);
        m.set("compute_p99_ms", p.compute_p99_ms);
        m.set("mean_batch", p.mean_batch);
        if let Some(q) = run.best_qps {
            m.set("best_qps", q);
        }
    }
    if !r.enqueue_s.is_empty() {
        let mut v = r.enqueue_s.clone();
        v.sort_by(f64::total_cmp);
        m.set("enqueue_us", v[v.len() / 2] * 1e6);
    }
    machine_metrics(r, &mut m);
    if let Some(c) = &r.compile {
        m.set("compile_s", c.compile_s);
        // An all-zero output compares nothing: not measured, so its checks are inconclusive.
        if c.output_scale != Some(0.0) {
            m.set("rel_diff", c.rel_diff);
        }
        m.set(
            "memory_saved",
            1.0 - c.compiled_memory as f64 / c.eager_memory.max(1) as f64,
        );
        if let Some(replay) = &c.replay {
            m.set("replayed", replay.is_ok() as u8 as f64);
        }
        if let Some(a) = &c.autotune {
            let cached = a.choices.iter().filter(|c| c.cached).count();
            m.set("autotune_timed", (a.choices.len() - cached) as f64);
            m.set("autotune_cached", cached as f64);
        }
    }
    m
}

/// Keep a step's record for chart steps and for `workshop compare`.
fn keep_record(ctx: &StepContext<'_>, r: &BenchRecord) -> Result<()> {
    crate::files::write_atomic(
        &ctx.record_path(ctx.id())?,
        serde_json::to_string_pretty(r)?.as_bytes(),
    )
}

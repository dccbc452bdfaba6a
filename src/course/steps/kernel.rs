//! `kernel` steps: rustlings' lesson, for kernels. The student edits a kernel file in the
//! workspace's `kernels/` (the course's deliberately slow start is copied there the first
//! time), and the step judges it in the order a kernel engineer would: it must compile (the
//! compiler's whole message otherwise, naming the student's file and line), then give the
//! engine's own kernel's output on the same input (the largest differences shown otherwise),
//! and only then is it timed — in rounds with the start and the engine's kernel, their order
//! rotating each round, each pass's launches of the entry point summed on the device's clock —
//! for a speedup judged with the course's noise rule. When it passes, the engine's kernel is
//! written next to the student's as one solution.
//!
//! The kernel is WGSL on the wgpu backend, the one kernel language every machine of the course
//! runs: the workspace's device when it is on wgpu, else wgpu's first adapter (on a machine
//! without a GPU, Mesa's lavapipe, which compiles WGSL for the CPU's vector units).

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

use super::{StepContext, StepOutput, Unavailable};
use crate::backend::{BackendError, BackendKind, Session};
use crate::bench::record::BenchConfig;
use crate::course::expect::{Check, DEFAULT_MAX_CV, Verdict, ratio_under_noise, within_noise};
use crate::course::schema::KernelSpec;
use crate::course::state::ResultTable;
use crate::course::ui::{Show, Ui};
use crate::model::Tensor;

/// The three versions of the kernel a step runs: the start, the student's, the engine's.
const WHOSE: [&str; 3] = ["start", "yours", "engine"];

/// Where the step keeps the kernel's versions in the workspace: the student's at
/// `kernels/FILE` (what `--kernels-dir kernels` reads), the start as given at
/// `kernels/start/FILE` (rewritten each run: it is what the speedup is against), the
/// solution at `kernels/solution/FILE` once the step has passed.
pub struct KernelFiles {
    /// The folder the student's copy is laid over the engine's from.
    pub root: PathBuf,
    pub yours: PathBuf,
    /// The folder the start is laid over the engine's from, and the start's copy in it.
    pub start_root: PathBuf,
    pub start: PathBuf,
    pub solution: PathBuf,
}

impl KernelFiles {
    /// The files of kernel file `file` (`wgsl/depthwise.wgsl`) in workspace `ws_dir`, each
    /// component checked to stay inside the workspace's `kernels/`.
    pub fn of(ws_dir: &Path, file: &str) -> Result<KernelFiles> {
        let root = ws_dir.join("kernels");
        let under = |base: &Path| -> Result<PathBuf> {
            file.split('/')
                .try_fold(base.to_path_buf(), |p, part| crate::files::child(&p, part))
        };
        Ok(KernelFiles {
            yours: under(&root)?,
            start: under(&root.join("start"))?,
            start_root: root.join("start"),
            solution: under(&root.join("solution"))?,
            root,
        })
    }
}

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let spec = (ctx.step.kernel.as_ref())
        .context("a kernel step needs a kernel section")?
        .get_ref();
    let files = KernelFiles::of(&ctx.ws.dir, &spec.file)?;
    let start = crate::course::start_text(ctx.course, &spec.start)
        .map_err(|why| anyhow::anyhow!("the course's start kernel `{}`: {why}", spec.start))?;
    crate::files::write_atomic(&files.start, start.as_bytes())?;
    if !files.yours.exists() {
        crate::files::write_atomic(&files.yours, start.as_bytes())?;
        ui.show(Show::Line(format!(
            "Your kernel is {}: a copy of the slow start, correct as it is. Open it, make it \
             faster, save, and run `workshop next` again (`workshop watch` runs the check each \
             time you save). The start stays in {} to compare with.",
            files.yours.display(),
            files.start.display()
        )));
    }
    // WGSL runs on wgpu whatever the workspace's backend: lavapipe on a machine without a GPU,
    // the GPU's Vulkan driver on one; sized for the device it runs on.
    let on_wgpu = ctx.ws.state.backend == BackendKind::Wgpu;
    let device = if on_wgpu { ctx.ws.state.device } else { 0 };
    let host_sized = match on_wgpu {
        true => ctx.host_sized,
        false => crate::course::runner::runs_on_host(BackendKind::Wgpu, device),
    };
    let mut cfg = ctx.bench_config_sized(ctx.bench_spec()?, host_sized);
    cfg.backend = BackendKind::Wgpu;
    cfg.device = device;
    cfg.threads = None;
    cfg.profile = true;
    let mut sessions = Vec::new();
    let mut input = None;
    for (whose, dir) in WHOSE.iter().zip([
        Some(files.start_root.clone()),
        Some(files.root.clone()),
        None,
    ]) {
        let cfg = BenchConfig {
            kernels_dir: dir,
            ..cfg.clone()
        };
        if let Some(dir) = &cfg.kernels_dir {
            crate::backend::kernel_files::overrides(dir)?;
        }
        match crate::bench::prepare(&cfg, None) {
            Ok((plan, session, device, _)) => {
                // A bench run's seeded input (its labels unused).
                input.get_or_insert_with(|| crate::bench::bench_batch(&cfg, &plan).0);
                out.device = device.name.clone();
                out.environment.insert("device".into(), device.name.clone());
                out.environment
                    .insert("kernel_version".into(), session.kernel_version());
                sessions.push(session);
            }
            Err(e) => {
                return match e.downcast_ref::<BackendError>() {
                    Some(BackendError::Compile { path, log }) if *whose == "yours" => {
                        rejected(
                            out,
                            ui,
                            "compiles",
                            &format!("did not compile ({path})"),
                            log,
                        );
                        Ok(())
                    }
                    Some(b) if *whose == "yours" && !b.is_unavailable() => {
                        rejected(out, ui, "runs", "could not be prepared", &b.to_string());
                        Ok(())
                    }
                    Some(b) if b.is_unavailable() => Err(Unavailable(format!(
                        "{b} (a kernel step runs WGSL on wgpu: on a machine without a GPU, \
                         install Mesa's lavapipe: apt-get install mesa-vulkan-drivers libvulkan1)"
                    ))
                    .into()),
                    _ => Err(e.context(format!("preparing the {whose} kernel"))),
                };
            }
        }
    }
    let input = input.context("no version of the kernel was prepared")?;
    let engine = crate::bench::infer(sessions[2].as_mut(), &input)?;
    let yours = match crate::bench::infer(sessions[1].as_mut(), &input) {
        Ok(y) => y,
        Err(e) => {
            rejected(out, ui, "runs", "failed as it ran", &format!("{e:#}"));
            return Ok(());
        }
    };
    let tolerance = tolerance(&cfg, &engine);
    let diff = compare(&engine, &yours, tolerance);
    out.metrics
        .set("correct", diff.wrong.is_empty() as u8 as f64);
    out.metrics.set("max_abs_diff", diff.max_abs);
    out.checks.push(Check {
        what: "your output matches the engine's kernel".into(),
        value: Some(diff.max_abs),
        min: None,
        max: Some(tolerance),
        range: "largest |Δ| of any output value".into(),
        verdict: match diff.wrong.is_empty() {
            true => Verdict::Pass,
            false => Verdict::Fail,
        },
        reason: None,
        hint: None,
    });
    if !diff.wrong.is_empty() {
        ui.show(Show::Table(&diff.table(&engine.shape)));
        ui.show(Show::Line(format!(
            "{} of {} output values differ from the engine's kernel by more than {tolerance:.1e} \
             (largest |Δ| {:.3e}): the table shows the first. Your kernel is not timed until \
             its output is right.",
            diff.count,
            engine.data.len(),
            diff.max_abs
        )));
        return Ok(());
    }
    let times = time_rounds(&cfg, &mut sessions, &input, &spec.entry, ui)?;
    judge(spec, ctx.step.max_cv, &times, out, ui);
    if out.checks.iter().all(|c| c.verdict == Verdict::Pass) {
        let engine_file = crate::backend::kernel_files::embedded(&spec.file)
            .context("the engine has no such kernel file")?;
        crate::files::write_atomic(&files.solution, engine_file.as_bytes())?;
        ui.show(Show::Line(format!(
            "One solution — the engine's own kernel — is now in {}: compare it with yours.",
            files.solution.display()
        )));
    }
    Ok(())
}

/// Record a kernel that did not get as far as an output: the compiler's or the driver's whole
/// message, a failed check "your kernel `what`", nothing timed.
fn rejected(out: &mut StepOutput, ui: &mut dyn Ui, what: &str, how: &str, message: &str) {
    ui.show(Show::Line(format!("Your kernel {how}:\n{message}")));
    out.metrics.set("correct", 0.0);
    out.checks.push(Check {
        what: format!("your kernel {what}"),
        value: None,
        min: None,
        max: None,
        range: "the message is above".into(),
        verdict: Verdict::Fail,
        reason: None,
        hint: None,
    });
}

/// How far a correct kernel's output may be from the engine's: summing in another order moves
/// FP32 results by a few units in the last place of the largest values; FP16 storage by one
/// part in a thousand.
fn tolerance(cfg: &BenchConfig, reference: &Tensor) -> f64 {
    let scale = (reference.data.iter())
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1.0) as f64;
    let relative = match cfg.precision {
        crate::model::Precision::Fp32 => 1e-4,
        _ => 1e-2,
    };
    relative * scale
}

/// Where the student's output differs from the engine's beyond the tolerance.
struct Diff {
    max_abs: f64,
    /// The first wrong values, as (flat index, expected, got).
    wrong: Vec<(usize, f32, f32)>,
    /// How many values are wrong.
    count: usize,
}

/// The wrong values a table shows.
const SHOWN: usize = 8;

fn compare(expected: &Tensor, got: &Tensor, tolerance: f64) -> Diff {
    let mut d = Diff {
        max_abs: 0.0,
        wrong: Vec::new(),
        count: 0,
    };
    if expected.shape != got.shape {
        d.max_abs = f64::INFINITY;
        d.count = expected.data.len();
        d.wrong.push((0, f32::NAN, f32::NAN));
        return d;
    }
    for (i, (&e, &g)) in expected.data.iter().zip(&got.data).enumerate() {
        let delta = (e as f64 - g as f64).abs();
        // A NaN is never within any tolerance.
        let bad = delta.is_nan() || delta > tolerance;
        d.max_abs = if delta.is_nan() {
            f64::INFINITY
        } else {
            d.max_abs.max(delta)
        };
        if bad {
            d.count += 1;
            if d.wrong.len() < SHOWN {
                d.wrong.push((i, e, g));
            }
        }
    }
    d
}

impl Diff {
    /// The first wrong values with their position in the output (NCHW: image, channel, row,
    /// column), expected next to got.
    fn table(&self, shape: &[usize]) -> ResultTable {
        let position = |i: usize| {
            let mut rest = i;
            let mut at: Vec<usize> = (shape.iter().rev())
                .map(|&d| {
                    let v = rest % d.max(1);
                    rest /= d.max(1);
                    v
                })
                .collect();
            at.reverse();
            let names = ["n", "c", "y", "x"];
            (at.iter().zip(names))
                .map(|(v, n)| format!("{n}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        ResultTable {
            header: ["output value", "engine's", "yours", "|Δ|"]
                .map(String::from)
                .to_vec(),
            rows: (self.wrong.iter())
                .map(|&(i, e, g)| {
                    vec![
                        position(i),
                        format!("{e:.6}"),
                        format!("{g:.6}"),
                        format!("{:.3e}", (e - g).abs()),
                    ]
                })
                .collect(),
        }
    }
}

/// The per-pass times (ms) of each version's entry point, in rounds.
struct Times {
    /// Per version (start, yours, engine): the timed rounds' times.
    ms: [Vec<f64>; 3],
    /// Whether the times are the entry point's on the device's clock (else whole passes on the
    /// host's, where the device gives no timestamps).
    kernel_only: bool,
}

/// Warm-up rounds, then timed rounds; each round runs every version once, the order rotating
/// so that none always follows the same other one (a GPU's clocks and caches carry over).
fn time_rounds(
    cfg: &BenchConfig,
    sessions: &mut [Box<dyn Session>],
    input: &Tensor,
    entry: &str,
    ui: &mut dyn Ui,
) -> Result<Times> {
    let rounds = cfg.warmup + cfg.iterations;
    let mut ticker = ui.progress("start, yours, engine", rounds as u64);
    let mut times = Times {
        ms: Default::default(),
        kernel_only: true,
    };
    for round in 0..rounds {
        for k in 0..WHOSE.len() {
            let v = (round + k) % WHOSE.len();
            let s = sessions[v].as_mut();
            let started = std::time::Instant::now();
            if !s.rerun()? {
                s.run(input)?;
            }
            s.sync()?;
            let wall = started.elapsed().as_secs_f64() * 1e3;
            let kernel = s.kernel_times().map(|ks| {
                (ks.iter())
                    .filter(|t| t.kernel.starts_with(entry))
                    .map(|t| t.ns as f64 / 1e6)
                    .sum::<f64>()
            });
            let ms = match kernel {
                Some(ms) if ms > 0.0 => ms,
                _ => {
                    times.kernel_only = false;
                    wall
                }
            };
            if round >= cfg.warmup {
                times.ms[v].push(ms);
            }
        }
        ticker.tick();
    }
    Ok(times)
}

/// Median and coefficient of variation of a version's times.
fn summary(ms: &[f64]) -> (f64, f64) {
    let mut v = ms.to_vec();
    v.sort_by(f64::total_cmp);
    let median = crate::bench::stats::percentile(&v, 0.5);
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len().max(1) as f64;
    (median, if mean > 0.0 { var.sqrt() / mean } else { 0.0 })
}

/// The times, the speedup and its verdict, passed at the course's speedup. Where the start or
/// the student's kernel varied by more than the step's noise limit, the verdict stands only if
/// the speedup's whole range under that noise ([`ratio_under_noise`]) is on one side of the
/// target; else it is inconclusive.
fn judge(
    spec: &KernelSpec,
    max_cv: Option<f64>,
    times: &Times,
    out: &mut StepOutput,
    ui: &mut dyn Ui,
) {
    let [start, yours, engine] = [0, 1, 2].map(|v| summary(&times.ms[v]));
    let speedup = start.0 / yours.0;
    let cv = start.1.max(yours.1);
    let m = &mut out.metrics;
    m.set("start_ms", start.0);
    m.set("kernel_ms", yours.0);
    m.set("engine_ms", engine.0);
    m.set("speedup", speedup);
    m.set("vs_engine", engine.0 / yours.0);
    m.set("cv", cv);
    let what = match times.kernel_only {
        true => format!("`{}` per pass, device clock", spec.entry),
        false => "whole pass, host clock (the device gives no timestamps)".into(),
    };
    let rows = WHOSE
        .iter()
        .zip([start, yours, engine])
        .map(|(w, (ms, cv))| {
            vec![
                w.to_string(),
                format!("{ms:.3}"),
                format!("{:.1}", cv * 100.0),
                format!("{:.2}×", start.0 / ms),
            ]
        });
    ui.show(Show::Table(&ResultTable {
        header: vec![
            "kernel".into(),
            format!("median ms ({what})"),
            "CV %".into(),
            "vs start".into(),
        ],
        rows: rows.collect(),
    }));
    let limit = max_cv.unwrap_or(DEFAULT_MAX_CV);
    let mut check = Check {
        what: "speedup over the start".into(),
        value: Some(speedup),
        min: Some(spec.speedup),
        max: None,
        range: "this step's target".into(),
        verdict: Verdict::Pass,
        reason: None,
        hint: None,
    };
    // A noisy run is still judged where even the noise could not carry it across the target.
    let (least, most) = ratio_under_noise(start.0, yours.0, start.1, yours.1);
    if cv > limit && least < spec.speedup && most >= spec.speedup {
        check.verdict = Verdict::Inconclusive;
        check.reason = Some(format!(
            "too noisy to judge: the timings varied by {:.1}% (CV), above this step's limit of \
             {:.1}%, so the speedup could be anywhere from {least:.2}× to {most:.2}×; close \
             other programs and run the step again",
            cv * 100.0,
            limit * 100.0
        ));
    } else if speedup < spec.speedup {
        check.verdict = Verdict::Fail;
        check.hint = Some(if cv > limit {
            format!(
                "{speedup:.2}× the start, and at most {most:.2}× allowing for this run's noise \
                 ({:.1}% CV); the step asks for {:.1}×",
                cv * 100.0,
                spec.speedup
            )
        } else if within_noise(start.0, yours.0, start.1, yours.1) {
            "no faster than the start, within the noise: what does each invocation of a workgroup do?".into()
        } else {
            format!(
                "{speedup:.2}× the start; the step asks for {:.1}×",
                spec.speedup
            )
        });
    }
    out.checks.push(check);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::course::ui::{Show, Ticker};

    struct Silent;
    impl Ticker for Silent {
        fn tick(&mut self) {}
    }
    impl Ui for Silent {
        fn show(&mut self, _: Show<'_>) {}
        fn progress(&mut self, _: &str, _: u64) -> Box<dyn Ticker> {
            Box::new(Silent)
        }
        fn choose(&mut self, _: &str, _: &[String]) -> Option<anyhow::Result<String>> {
            None
        }
    }

    /// The verdict of a start timed at `start` ms and a kernel at `yours`, each round's times
    /// spread by ±`spread` (a CV of `spread`), against a 3× target and a 25% noise limit.
    fn verdict(start: f64, yours: f64, spread: f64) -> Check {
        let times = |ms: f64| vec![ms * (1.0 - spread), ms * (1.0 + spread)];
        let times = Times {
            ms: [times(start), times(yours), times(yours)],
            kernel_only: true,
        };
        let spec = KernelSpec {
            file: "wgsl/k.wgsl".into(),
            start: "start/k.wgsl".into(),
            entry: "k".into(),
            speedup: 3.0,
        };
        let mut out = StepOutput::default();
        judge(&spec, Some(0.25), &times, &mut out, &mut Silent);
        out.checks.pop().unwrap()
    }

    #[test]
    fn noise_decides_only_what_it_could_change() {
        // Quiet runs: judged on the speedup.
        assert_eq!(verdict(100.0, 100.0, 0.05).verdict, Verdict::Fail);
        assert_eq!(verdict(100.0, 20.0, 0.05).verdict, Verdict::Pass);
        // 30% CV: 1× could be anywhere up to 1.6 / 0.4 = 4×, across the target.
        let c = verdict(100.0, 100.0, 0.30);
        assert_eq!(c.verdict, Verdict::Inconclusive, "{c:?}");
        assert!(c.reason.unwrap().contains("too noisy to judge"));
        // 26% CV: at most 1.52 / 0.48 = 3.2×, so still possible; 0.7× is not (2.2×).
        assert_eq!(verdict(100.0, 100.0, 0.26).verdict, Verdict::Inconclusive);
        let c = verdict(70.0, 100.0, 0.26);
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.hint.unwrap().contains("allowing for this run's noise"));
        // 10× faster at 26% CV: at least 0.48 / 1.52 × 10 = 3.2×, a pass; 5× is not sure.
        assert_eq!(verdict(100.0, 10.0, 0.26).verdict, Verdict::Pass);
        assert_eq!(verdict(100.0, 20.0, 0.26).verdict, Verdict::Inconclusive);
    }
}

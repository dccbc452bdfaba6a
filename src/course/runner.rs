//! Running one step of an exercise: resolve its settings for the workspace's backend, run it
//! through the engine (with a progress bar for anything that takes a while), collect its
//! metrics, judge its expectations, and hand back an [`Attempt`] to record. A step the build
//! or machine cannot run comes back `unavailable` with the reason, never with made-up numbers.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use super::expect::{self, Check, Context, Metrics, Verdict};
use super::schema::{BenchSpec, DeriveFormat, Pick, Step, StepKind, SweepParam};
use super::state::{Attempt, Outcome, Table, Workspace, now};
use crate::backend::{self, BackendError, ExecOptions};
use crate::bench::{self, Event, record::BenchConfig};
use crate::model::{Precision, Rng, zoo};
use crate::report;

/// How the step may interact with the student.
pub struct RunOptions {
    /// The answer to a question step, given on the command line.
    pub answer: Option<String>,
    /// A terminal is attached and prompts are allowed.
    pub interactive: bool,
}

/// Bench defaults for course steps (the `workshop bench` defaults).
fn bench_config(ws: &Workspace, spec: &BenchSpec) -> BenchConfig {
    let s = spec.resolved(ws.state.backend);
    let d = BenchConfig::default();
    BenchConfig {
        network: s.network.unwrap_or(d.network),
        batch_size: s.batch_size.unwrap_or(d.batch_size),
        iterations: s.iterations.unwrap_or(d.iterations),
        warmup: s.warmup.unwrap_or(d.warmup),
        precision: s.precision.unwrap_or(d.precision),
        backend: ws.state.backend,
        device: ws.state.device,
        threads: ws.state.threads,
        input_size: s.input_size.unwrap_or(d.input_size),
        kernels: s.kernels.unwrap_or(d.kernels),
        compile: s.compile,
        ..d
    }
}

/// Why a run cannot happen on this build or machine, if that is the reason it failed.
fn unavailable_reason(e: &anyhow::Error) -> Option<String> {
    e.downcast_ref::<BackendError>()
        .filter(|b| b.is_unavailable())
        .map(ToString::to_string)
}

/// One benchmark with a progress bar on stderr (hidden when stderr is not a terminal).
fn bench_with_progress(cfg: &BenchConfig) -> Result<bench::record::BenchRecord> {
    let bar = ProgressBar::new((cfg.warmup + cfg.iterations) as u64);
    bar.set_style(
        ProgressStyle::with_template("  {spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed})")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!(
        "{} {} batch {}",
        cfg.network, cfg.precision, cfg.batch_size
    ));
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let record = bench::run(cfg, None, &mut |ev| match ev {
        Event::Warmup { .. } | Event::Iteration { .. } => bar.inc(1),
        Event::Preparing { .. } => {}
    });
    bar.finish_and_clear();
    record
}

fn bench_metrics(
    r: &bench::record::BenchRecord,
    max_batch: Option<usize>,
) -> BTreeMap<String, f64> {
    let s = &r.stats;
    let mut m = BTreeMap::from([
        ("throughput".to_string(), s.throughput_median),
        ("throughput_mean".to_string(), s.throughput),
        ("median_ms".to_string(), s.median_s * 1e3),
        ("mean_ms".to_string(), s.mean_s * 1e3),
        ("std_ms".to_string(), s.std_s * 1e3),
        ("cv".to_string(), s.cv),
        ("min_ms".to_string(), s.min_s * 1e3),
        ("max_ms".to_string(), s.max_s * 1e3),
        ("us_per_sample".to_string(), s.us_per_sample),
        ("gflops".to_string(), s.gflops),
        (
            "peak_memory_mib".to_string(),
            r.memory.peak as f64 / (1024.0 * 1024.0),
        ),
        ("loss".to_string(), r.loss),
    ]);
    if let Some(b) = max_batch {
        m.insert("max_batch".into(), b as f64);
    }
    if !r.enqueue_s.is_empty() {
        let mut v = r.enqueue_s.clone();
        v.sort_by(f64::total_cmp);
        m.insert("enqueue_us".into(), v[v.len() / 2] * 1e6);
    }
    if let Some(c) = &r.compile {
        m.insert("compile_s".into(), c.compile_s);
        m.insert("rel_diff".into(), c.rel_diff);
        m.insert(
            "memory_saved".into(),
            1.0 - c.compiled_memory as f64 / c.eager_memory.max(1) as f64,
        );
        if let Some(replay) = &c.replay {
            m.insert("replayed".into(), replay.is_ok() as u8 as f64);
        }
        if let Some(a) = &c.autotune {
            let cached = a.choices.iter().filter(|c| c.cached).count();
            m.insert("autotune_timed".into(), (a.choices.len() - cached) as f64);
            m.insert("autotune_cached".into(), cached as f64);
        }
    }
    m
}

/// Put a run's device and kernel version into a step's environment; returns the device name.
fn note_run(environment: &mut BTreeMap<String, String>, r: &bench::record::BenchRecord) -> String {
    let device = r.environment.device.name.clone();
    environment.insert("device".into(), device.clone());
    environment.insert(
        "kernel_version".into(),
        r.environment.kernel_version.clone(),
    );
    device
}

/// Where the course keeps the record of a bench or profile step.
fn record_path(ws: &Workspace, exercise: &str, step: &str) -> std::path::PathBuf {
    ws.dir
        .join("records")
        .join(format!("{exercise}.{step}.json"))
}

/// Keep a step's record for `chart` steps and for `workshop compare`.
fn keep_record(
    ws: &Workspace,
    exercise: &str,
    step: &str,
    r: &bench::record::BenchRecord,
) -> Result<()> {
    crate::files::write_atomic(
        &record_path(ws, exercise, step),
        serde_json::to_string_pretty(r)?.as_bytes(),
    )
}

/// The metrics of a multi-device bench step: the global figures and the scaling.
fn multi_metrics(m: &bench::multi::MultiRecord) -> BTreeMap<String, f64> {
    let g = &m.global;
    let mut out = BTreeMap::from([
        ("throughput".to_string(), g.throughput_median),
        ("throughput_mean".to_string(), g.throughput),
        ("median_ms".to_string(), g.median_s * 1e3),
        ("cv".to_string(), g.cv),
        ("gflops".to_string(), g.gflops),
        ("spread".to_string(), m.spread),
        ("devices".to_string(), m.devices.len() as f64),
        (
            "peak_memory_mib".to_string(),
            m.runs.iter().map(|r| r.memory.peak).max().unwrap_or(0) as f64 / (1024.0 * 1024.0),
        ),
    ]);
    if let Some(e) = m.scaling_efficiency {
        out.insert("scaling_efficiency".into(), e);
    }
    if let Some(s) = &m.single {
        out.insert("single_throughput".into(), s.stats.throughput_median);
    }
    out
}

/// What a profile step records besides the bench metrics (see `StepKind::Profile`).
fn profile_metrics(r: &bench::record::BenchRecord) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    if let Some(p) = &r.profile {
        m.insert("device_ms".into(), p.device_ms_per_iter);
        m.insert("cpu_overhead".into(), p.cpu_overhead);
        for op in &p.ops {
            m.insert(format!("op.{}.time_pct", op.name), op.percentage);
        }
    }
    if let Some(f) = &r.flops_profile {
        let root = f.root();
        m.insert("intensity".into(), root.intensity());
        if let Some(e) = f.efficiency() {
            m.insert("efficiency".into(), e);
        }
        if let Some(p) = f.limits.peak_gflops {
            m.insert("peak_gflops".into(), p);
        }
        if let Some(b) = f.limits.balance() {
            m.insert("balance".into(), b);
        }
        for module in f.at_depth(1) {
            for (name, value) in bench::flops::MODULE_METRICS {
                m.insert(format!("{}.{name}", module.name), value(module, root));
            }
        }
    }
    m
}

/// The top-level modules of a FLOPs profile as a results table.
fn module_table(f: &bench::flops::FlopsProfile) -> Table {
    let root = f.root();
    let rows = f
        .at_depth(1)
        .map(|m| {
            vec![
                m.name.clone(),
                format!("{:.2}", m.latency_ns as f64 / 1e6),
                format!(
                    "{:.1}",
                    100.0 * m.latency_ns as f64 / root.latency_ns.max(1) as f64
                ),
                format!("{:.3}", m.macs as f64 / 1e9),
                format!("{:.1}", m.gflops()),
                format!("{:.1}", m.intensity()),
                f.limits.bound(m.intensity()).unwrap_or("—").to_string(),
            ]
        })
        .collect();
    Table {
        header: [
            "module",
            "latency ms",
            "% latency",
            "GMACs",
            "GFLOP/s",
            "FLOP/byte",
            "bound",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    }
}

/// How the note of an unavailable attempt starts.
pub const UNAVAILABLE: &str = "not available on this machine/build: ";

/// What the earlier steps of an exercise left: the metrics of each step's latest attempt, and
/// why each step that could not run here (its latest attempt unavailable) could not.
#[derive(Debug, Default)]
pub struct Earlier {
    pub metrics: Metrics,
    pub unavailable: BTreeMap<String, String>,
}

/// The first `STEP.metric` of `references` whose step could not run on this machine, as the
/// reason this step cannot either: a comparison of runs that never happened (the two-device run
/// on a one-GPU machine) is not available here, not a failure and not a question to guess at.
fn unavailable_input<'a>(
    references: impl IntoIterator<Item = &'a str>,
    earlier: &Earlier,
) -> Result<()> {
    for r in references {
        let s = r.split_once('.').map_or(r, |(s, _)| s);
        if let Some(why) = earlier.unavailable.get(s) {
            return Err(BackendError::Unsupported(format!(
                "it uses step `{s}`, which could not run here ({why})"
            ))
            .into());
        }
    }
    Ok(())
}

/// Run step `index` of `exercise` and return the attempt to record (nothing is written here).
pub fn run_step(
    ws: &Workspace,
    exercise: &str,
    step: &Step,
    earlier: &Earlier,
    opts: &RunOptions,
) -> Result<Attempt> {
    let started = now();
    let sid = step.id.get_ref().clone();
    let (unavailable, earlier) = (earlier, &earlier.metrics);
    let mut metrics: BTreeMap<String, f64> = BTreeMap::new();
    let mut table = None;
    let mut answer = None;
    let mut checks: Vec<Check> = Vec::new();
    let mut environment = BTreeMap::from([
        ("backend".to_string(), ws.state.backend.to_string()),
        (
            "runner_version".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        ),
    ]);
    let mut device_name = String::new();
    let result: Result<()> = (|| {
        match step.kind {
            StepKind::Note => {}
            StepKind::Doctor => {
                let d = crate::doctor::collect();
                println!("{}", report::doctor(&d));
                metrics.insert("cores".into(), d.cores.unwrap_or(0) as f64);
                metrics.insert(
                    "memory_gib".into(),
                    d.memory_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64,
                );
                environment.insert("cpu_model".into(), d.cpu_model.clone());
                environment.insert("os".into(), d.os.clone());
            }
            StepKind::Bench => {
                let spec = step
                    .bench
                    .as_ref()
                    .context("bench step without bench")?
                    .get_ref();
                let cfg = bench_config(ws, spec);
                println!("{}", report::step_config(&cfg));
                let resolved = spec.resolved(ws.state.backend);
                let devices = match (resolved.cpu_groups, &resolved.devices) {
                    (Some(n), _) => Some(bench::multi::cpu_groups(n)?),
                    (None, Some(list)) => Some(bench::multi::parse_devices(list, cfg.backend)?),
                    (None, None) => None,
                };
                if let Some(devices) = devices {
                    let m = bench::multi::run(&cfg, &devices, None, &mut |s| println!("{s}"))?;
                    println!("{}", report::multi(&m));
                    metrics = multi_metrics(&m);
                    device_name = m.runs[0].environment.device.name.clone();
                    environment.insert("device".into(), device_name.clone());
                    environment.insert("devices".into(), m.devices.len().to_string());
                    return Ok(());
                }
                let r = bench_with_progress(&cfg)?;
                println!("{}", report::summary(&r));
                keep_record(ws, exercise, &sid, &r)?;
                metrics = bench_metrics(&r, bench::max_batch_estimate(&cfg));
                device_name = note_run(&mut environment, &r);
                environment.insert("cpu_model".into(), r.environment.cpu_model.clone());
            }
            StepKind::Profile => {
                let spec = step
                    .bench
                    .as_ref()
                    .context("profile step without bench")?
                    .get_ref();
                let shown = step
                    .profile
                    .as_ref()
                    .map(|p| p.get_ref().clone())
                    .unwrap_or_default();
                let mut cfg = bench_config(ws, spec);
                cfg.profile = true;
                cfg.flops_prof_step = Some(cfg.iterations);
                println!("{}", report::step_config(&cfg));
                let r = bench_with_progress(&cfg)?;
                println!("{}", report::summary(&r));
                let top = shown.top.unwrap_or(10);
                if let Some(p) = &r.profile {
                    println!("{}", report::profile(p, top, cfg.backend));
                }
                let f = r
                    .flops_profile
                    .as_ref()
                    .context("the run gave no FLOPs profile")?;
                println!(
                    "{}",
                    report::flops_profile(f, Some(shown.depth.unwrap_or(1)), top)
                );
                if shown.files
                    && let Some(p) = &r.profile
                {
                    let dir = ws.dir.join("profiles");
                    let stem = format!("{exercise}.{sid}");
                    let trace = dir.join(format!("{stem}.trace.json"));
                    let csv = dir.join(format!("{stem}.kernels.csv"));
                    let t = bench::profile::trace(&r.timeline, &r.environment.device.name);
                    crate::files::write_atomic(&trace, serde_json::to_string(&t)?.as_bytes())?;
                    crate::files::write_atomic(&csv, bench::profile::csv(p).as_bytes())?;
                    println!(
                        "Wrote the timeline to {} (open it in https://ui.perfetto.dev) and the kernel table to {}",
                        trace.display(),
                        csv.display()
                    );
                }
                keep_record(ws, exercise, &sid, &r)?;
                metrics = bench_metrics(&r, None);
                metrics.extend(profile_metrics(&r));
                table = Some(module_table(f));
                device_name = note_run(&mut environment, &r);
            }
            StepKind::Chart => {
                let spec = step
                    .chart
                    .as_ref()
                    .context("chart step without chart")?
                    .get_ref();
                let records = spec
                    .steps
                    .iter()
                    .map(|s| {
                        let path = record_path(ws, exercise, s);
                        if !path.exists() {
                            bail!("step `{s}` has no record yet: run it first (`workshop run {exercise}.{s}`)");
                        }
                        Ok((s.clone(), bench::compare::load(&path)?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let c = bench::compare::compare(&records);
                println!("{}", report::comparison(&c));
                let chart = ws.dir.join("charts").join(format!("{exercise}.{sid}.svg"));
                // The comparison stands without its picture (a machine without fonts).
                match crate::chart::comparison(&c, &chart) {
                    Ok(()) => println!("Drew {} (open it in a browser)", chart.display()),
                    Err(e) => println!("No chart: {e:#}"),
                }
                metrics.insert("warnings".into(), c.warnings.len() as f64);
                for p in &c.pairs {
                    let s = &spec.steps[p.index];
                    let v = p.verdict;
                    metrics.insert(format!("{s}.ratio"), p.ratio);
                    let is = |b: bool| if b { 1.0 } else { 0.0 };
                    metrics.insert(
                        format!("{s}.faster"),
                        is(v == bench::compare::Verdict::Faster),
                    );
                    metrics.insert(
                        format!("{s}.slower"),
                        is(v == bench::compare::Verdict::Slower),
                    );
                    metrics.insert(format!("{s}.unclear"), is(!v.is_clear()));
                }
            }
            StepKind::Sweep => {
                let base = step
                    .bench
                    .as_ref()
                    .context("sweep step without bench")?
                    .get_ref();
                let sweep = step
                    .sweep
                    .as_ref()
                    .context("sweep step without sweep")?
                    .get_ref();
                let values = match (ws.state.backend, &sweep.cpu_values) {
                    (backend::BackendKind::Cpu, Some(v)) => v.clone(),
                    _ => sweep.values.clone(),
                };
                let param = match sweep.param {
                    SweepParam::BatchSize => "batch size",
                    SweepParam::InputSize => "input size",
                };
                let mut rows = Vec::new();
                let mut points = Vec::new();
                for &v in &values {
                    let mut cfg = bench_config(ws, base);
                    match sweep.param {
                        SweepParam::BatchSize => cfg.batch_size = v,
                        SweepParam::InputSize => cfg.input_size = v,
                    }
                    let r = bench_with_progress(&cfg)?;
                    device_name = note_run(&mut environment, &r);
                    let s = &r.stats;
                    rows.push(vec![
                        v.to_string(),
                        format!("{:.2}", s.median_s * 1e3),
                        format!("{:.1}", s.throughput_median),
                        format!("{:.0}", s.us_per_sample),
                        format!("{:.1}", s.cv * 100.0),
                        format!("{:.0}", r.memory.peak as f64 / (1024.0 * 1024.0)),
                    ]);
                    points.push((v, s.throughput_median));
                }
                let t = Table {
                    header: [
                        "".to_string() + param,
                        "median ms".into(),
                        "images/s".into(),
                        "µs/image".into(),
                        "CV %".into(),
                        "peak MiB".into(),
                    ]
                    .to_vec(),
                    rows,
                };
                println!("{}", report::table(&t));
                table = Some(t);
                let best = points
                    .iter()
                    .copied()
                    .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
                metrics.insert("best_throughput".into(), best.1);
                metrics.insert("best_value".into(), best.0 as f64);
                if let (Some(first), Some(last)) = (points.first(), points.last()) {
                    metrics.insert("scaling".into(), last.1 / first.1);
                }
            }
            StepKind::Accuracy => {
                let spec = step
                    .bench
                    .as_ref()
                    .context("accuracy step without bench")?
                    .get_ref();
                let cfg = bench_config(ws, spec);
                let (diff, rel, agree) = accuracy(&cfg)?;
                println!(
                    "{} {} against FP32 on the same input and weights: max |Δlogit| = {diff:.3e} ({:.3}% of the largest logit), top-1 agreement {:.1}%",
                    cfg.network,
                    cfg.precision.name().to_uppercase(),
                    rel * 100.0,
                    agree * 100.0
                );
                metrics.insert("max_abs_diff".into(), diff);
                metrics.insert("rel_diff".into(), rel);
                metrics.insert("top1_agreement".into(), agree);
            }
            StepKind::Peak => {
                let spec = step
                    .peak
                    .as_ref()
                    .map(|p| p.get_ref().clone())
                    .unwrap_or_default();
                let cpu = ws.state.backend == backend::BackendKind::Cpu;
                let over = |f: fn(&super::schema::PeakSpec) -> Option<usize>| {
                    spec.cpu.as_deref().filter(|_| cpu).and_then(f).or(f(&spec))
                };
                let precision = spec
                    .cpu
                    .as_deref()
                    .filter(|_| cpu)
                    .and_then(|c| c.precision)
                    .or(spec.precision)
                    .unwrap_or(Precision::Fp32);
                let (size, iterations) = (
                    over(|s| s.size).unwrap_or(1024),
                    over(|s| s.iterations).unwrap_or(10),
                );
                let (g, info) = bench::peak::gemm_on(
                    ws.state.backend,
                    ws.state.device,
                    precision,
                    ws.state.threads,
                    size,
                    iterations,
                )?;
                let bw = bench::peak::bandwidth_if_any(
                    ws.state.backend,
                    ws.state.device,
                    over(|s| s.array_mib).unwrap_or(256),
                    iterations,
                    ws.state.threads,
                )?;
                println!("{}", report::peak(&g, bw.as_deref()));
                // The ceiling above the GEMM (a CPU's FMA throughput, measured now; a GPU's
                // specification), recorded so expectations can place the GEMM under it.
                let ceiling = info
                    .and_then(|d| bench::peak::theoretical(ws.state.backend, &d, ws.state.threads));
                println!("{}", report::ceiling(g.gflops, ceiling.as_ref()));
                if let Some(t) = &ceiling {
                    metrics.insert("ceiling_gflops".into(), t.gflops);
                }
                // The device, for expectations per device (`device = [{ glob = "*H100*", ... }]`).
                if !g.device.is_empty() {
                    device_name = g.device.clone();
                    environment.insert("device".into(), g.device.clone());
                }
                if g.validated < g.iterations {
                    bail!(
                        "{} of {} GEMM results did not match the reference: the peak does not count",
                        g.iterations - g.validated,
                        g.iterations
                    );
                }
                metrics.insert("gemm_gflops".into(), g.gflops);
                // Kept for later FLOPs profiles of this device (a failure to keep it is harmless).
                let _ = bench::peak::keep(
                    ws.state.backend,
                    ws.state.device,
                    ws.state.threads,
                    &g,
                    bw.as_deref().unwrap_or_default(),
                );
                for b in bw.unwrap_or_default() {
                    metrics.insert(format!("{}_gbps", b.kernel), b.median_gbps);
                }
            }
            StepKind::Compare => {
                unavailable_input(
                    step.derive.iter().flat_map(|d| {
                        let d = d.get_ref();
                        [d.numerator.as_str(), d.denominator.as_str()]
                    }),
                    unavailable,
                )?;
                for d in &step.derive {
                    let d = d.get_ref();
                    let get = |r: &str| -> Result<f64> {
                        let (s, m) = r.split_once('.').context("STEP.metric")?;
                        earlier.get(s).and_then(|ms| ms.get(m)).copied().with_context(|| {
                            format!("`{r}` has no value yet: run (or re-run) step `{s}` of this exercise first")
                        })
                    };
                    let v = get(&d.numerator)? / get(&d.denominator)?;
                    let shown = match d.format {
                        DeriveFormat::Ratio => format!("{v:.2}×"),
                        DeriveFormat::Percent => format!("{:.1}%", v * 100.0),
                    };
                    println!(
                        "  {:<24} {shown:>10}   ({} / {})",
                        d.name, d.numerator, d.denominator
                    );
                    metrics.insert(d.name.clone(), v);
                }
            }
            StepKind::Question => {
                let q = step
                    .question
                    .as_ref()
                    .context("question step without question")?
                    .get_ref();
                if let Some(c) = &q.correct {
                    unavailable_input(c.references().iter().map(String::as_str), unavailable)?;
                }
                let given = match &opts.answer {
                    Some(a) => q
                        .choices
                        .iter()
                        .find(|c| c.eq_ignore_ascii_case(a.trim()))
                        .cloned()
                        .with_context(|| {
                            format!("`{a}` is not one of the choices: {}", q.choices.join(", "))
                        })?,
                    None if opts.interactive => inquire::Select::new(&q.prompt, q.choices.clone())
                        .prompt()
                        .map_err(|e| {
                            anyhow::anyhow!("no answer given ({e}); nothing was recorded")
                        })?,
                    None => bail!(
                        "this step asks: {}\nanswer with `workshop next --answer CHOICE` (choices: {})",
                        q.prompt,
                        q.choices.join(", ")
                    ),
                };
                if let Some(c) = &q.correct {
                    let refs = c.references();
                    let values: Vec<Option<f64>> = refs
                        .iter()
                        .map(|r| {
                            let (s, m) = r.split_once('.').unwrap_or((r, ""));
                            earlier.get(s).and_then(|ms| ms.get(m)).copied()
                        })
                        .collect();
                    let mut check = Check {
                        what: format!("answer: {given}"),
                        value: None,
                        min: None,
                        max: None,
                        range: "judged from your measurements".into(),
                        verdict: Verdict::Inconclusive,
                        reason: None,
                        hint: None,
                    };
                    if values.iter().all(Option::is_some) {
                        let vals: Vec<f64> = values.into_iter().flatten().collect();
                        let best = (0..vals.len())
                            .reduce(|a, b| {
                                let better = match c.pick {
                                    Pick::Max => vals[b] > vals[a],
                                    Pick::Min => vals[b] < vals[a],
                                };
                                if better { b } else { a }
                            })
                            .unwrap_or(0);
                        let right = &q.choices[best];
                        check.range = format!(
                            "your measurements say {right}: {} = {}",
                            refs[best],
                            report::number(vals[best])
                        );
                        check.verdict = if *right == given {
                            Verdict::Pass
                        } else {
                            Verdict::Fail
                        };
                        if check.verdict == Verdict::Fail {
                            check.hint = Some(format!(
                                "your measurements say `{right}` ({} = {:.3}); look at the earlier steps' results again",
                                refs[best], vals[best]
                            ));
                        }
                    } else {
                        check.reason =
                            Some("some of the steps this question is about have no results".into());
                    }
                    checks.push(check);
                }
                answer = Some(given);
            }
        }
        Ok(())
    })();
    let mut note = None;
    let outcome = match result {
        Ok(()) => {
            let mut all = earlier.clone();
            all.insert(sid.clone(), metrics.clone());
            let ctx = Context {
                device: &device_name,
                backend: ws.state.backend,
            };
            checks.extend(
                step.expects
                    .iter()
                    .filter_map(|x| expect::evaluate(x.get_ref(), &sid, &all, &ctx, step.max_cv)),
            );
            if checks.iter().any(|c| c.verdict == Verdict::Fail) {
                Outcome::Fail
            } else if checks.iter().any(|c| c.verdict == Verdict::Inconclusive) {
                Outcome::Inconclusive
            } else {
                Outcome::Pass
            }
        }
        Err(e) => match unavailable_reason(&e) {
            Some(reason) => {
                note = Some(format!("{UNAVAILABLE}{reason}"));
                Outcome::Unavailable
            }
            None => return Err(e),
        },
    };
    Ok(Attempt {
        exercise: exercise.to_string(),
        step: sid,
        kind: step.kind,
        outcome,
        metrics,
        table,
        checks,
        answer,
        note,
        environment,
        started,
        finished: now(),
    })
}

/// Max |Δlogit|, that relative to the largest FP32 logit, and top-1 agreement of one forward
/// pass at `cfg.precision` against FP32 on the same seeded input and weights.
pub fn accuracy(cfg: &BenchConfig) -> Result<(f64, f64, f64)> {
    let graph = zoo::build(&cfg.network)?;
    let plan = graph.plan(cfg.batch_size, cfg.input_size, cfg.input_size)?;
    let weights = bench::seeded_weights(&graph, cfg.seed, cfg.input_size)?;
    let b = backend::open(cfg.backend)?;
    let input = Rng::new(cfg.seed.wrapping_add(1)).normal_tensor(plan.input_shape().to_vec());
    let mut outs = Vec::new();
    for precision in [Precision::Fp32, cfg.precision] {
        let opt = ExecOptions {
            precision,
            ..cfg.exec_options()
        };
        let mut s = b.prepare(cfg.device, &plan, &weights, &opt)?;
        outs.push(bench::infer(s.as_mut(), &input)?);
    }
    let (r, o) = (&outs[0], &outs[1]);
    let diff = r.max_abs_diff(o) as f64;
    let scale = r
        .data
        .iter()
        .fold(0f32, |a, v| a.max(v.abs()))
        .max(f32::MIN_POSITIVE) as f64;
    let classes = r.shape[1];
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
    };
    let agree = r
        .data
        .chunks(classes)
        .zip(o.data.chunks(classes))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count() as f64
        / cfg.batch_size as f64;
    Ok((diff, diff / scale, agree))
}

//! Benchmarking: build the network, prepare it on a backend, run warm-up and timed iterations
//! (each one a forward pass, a device sync, reading the logits and computing the loss), and
//! summarise the samples into a [`record::BenchRecord`]. Progress is reported as events so
//! presentation stays in `report`.

pub mod autotune;
pub mod compare;
pub mod data_parallel;
pub mod flops;
pub mod framework;
pub mod llm;
pub mod peak;
pub mod profile;
pub mod record;
pub mod scenario;
pub mod stats;
pub mod telemetry;

use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::backend::{self, DeviceInfo, Session};
use crate::model::{Graph, Op, Plan, Rng, Tensor, Weights, reference, zoo};
use record::{BenchConfig, BenchRecord, CompileInfo, CompileMode, Environment, ModelInfo};
use stats::Stats;

/// What the runner reports while it works.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The network is built, its weights are ready and the session is prepared, `seconds`
    /// after the run started (the start-up a user waits through before the first warm-up).
    Preparing {
        params: u64,
        weights: String,
        seconds: f64,
    },
    /// `loss` is `None` where the output stays on the device until the run ends.
    Warmup {
        index: usize,
        loss: Option<f64>,
        seconds: f64,
    },
    Iteration {
        index: usize,
        loss: Option<f64>,
        seconds: f64,
    },
    /// An MLPerf scenario finished one run (a server: one probed rate).
    Probe(scenario::Probe),
    /// A language model's generation: its time to first token and mean decode step.
    Generation {
        index: usize,
        warmup: bool,
        ttft_s: f64,
        tpot_s: f64,
    },
}

/// Check the configuration before doing anything expensive.
pub fn validate(cfg: &BenchConfig) -> Result<()> {
    if cfg.batch_size == 0 {
        bail!("--batch-size must be at least 1 (got 0)");
    }
    if cfg.iterations == 0 {
        bail!("--iterations must be at least 1 (got 0): the statistics need timed samples");
    }
    if cfg.input_size == 0 {
        bail!("--input-size must be at least 1 (got 0)");
    }
    if cfg.threads == Some(0) {
        bail!("--threads must be at least 1 (got 0)");
    }
    let sizes = [
        ("batch_size", cfg.batch_size),
        ("iterations", cfg.iterations),
        ("warmup", cfg.warmup),
        ("input_size", cfg.input_size),
        ("threads", cfg.threads.unwrap_or(1)),
    ];
    for (name, v) in sizes {
        if let Err(why) = within_limit(name, v) {
            bail!("--{}: {why}", name.replace('_', "-"));
        }
    }
    if let Some(k) = cfg.flops_prof_step
        && !(1..=cfg.iterations).contains(&k)
    {
        bail!(
            "--flops-prof-step {k} is not one of the timed iterations (1 to {})",
            cfg.iterations
        );
    }
    if let Some(dir) = &cfg.kernels_dir {
        crate::backend::kernel_files::overrides(dir)?;
    }
    Ok(())
}

/// The largest value each size of a run may take, and why: numbers from users are checked
/// before anything is allocated, by `workshop bench` and by lint for a course's steps (issue
/// 27: sizes near 2^64 overflowed or spun instead of failing).
pub const LIMITS: [(&str, usize, &str); 12] = [
    (
        "size",
        1 << 14,
        "three matrices of that size would not fit in memory",
    ),
    (
        "array_mib",
        1 << 14,
        "three arrays of that size would not fit in memory",
    ),
    ("core", 1 << 16, "no machine has that many cores"),
    ("world_size", 1 << 16, "more ranks than any launcher starts"),
    (
        "batch_size",
        1 << 24,
        "more images or sequences than any machine's memory holds in one batch",
    ),
    (
        "iterations",
        1_000_000,
        "more timed iterations than any run needs",
    ),
    (
        "warmup",
        1_000_000,
        "more warm-up iterations than any run needs",
    ),
    (
        "input_size",
        1 << 14,
        "a larger image than any network here takes",
    ),
    (
        "threads",
        4096,
        "more worker threads than any machine has cores",
    ),
    (
        "prompt_len",
        1 << 20,
        "a longer prompt than any model here has positions for",
    ),
    (
        "gen_len",
        1 << 20,
        "more new tokens than any model here has positions for",
    ),
    (
        "cpu_groups",
        4096,
        "more groups of cores than any machine has cores",
    ),
];

/// `value` of size `name`, refused above its limit in [`LIMITS`] with the reason.
pub fn within_limit(name: &str, value: usize) -> Result<(), String> {
    match LIMITS.iter().find(|(n, _, _)| *n == name) {
        Some(&(_, max, why)) if value > max => {
            Err(format!("{value} is above the limit of {max}: {why}"))
        }
        _ => Ok(()),
    }
}

/// What [`prepare`] hands to [`measure`]: the plan, the session, the device it runs on, and
/// what compilation did (when asked).
pub type Prepared = (Plan, Box<dyn Session>, DeviceInfo, Option<CompileInfo>);

/// Build the plan and the session for a run configuration, with the device it runs on.
pub fn prepare(cfg: &BenchConfig, weights_file: Option<&std::path::Path>) -> Result<Prepared> {
    prepare_hw(cfg, weights_file, (cfg.input_size, cfg.input_size))
}

/// [`prepare`] for an input of `height`×`width` (`workshop infer` takes any shape).
pub fn prepare_hw(
    cfg: &BenchConfig,
    weights_file: Option<&std::path::Path>,
    hw: (usize, usize),
) -> Result<Prepared> {
    prepare_with(cfg, weights_file, hw, cfg.exec_options())
}

/// [`prepare_hw`] with these options rather than the configuration's own.
fn prepare_with(
    cfg: &BenchConfig,
    weights_file: Option<&std::path::Path>,
    (height, width): (usize, usize),
    opt: crate::backend::ExecOptions,
) -> Result<Prepared> {
    let graph = zoo::build(&cfg.network)?;
    let eager_plan = graph
        .plan(cfg.batch_size, height, width)
        .with_context(|| format!("{} cannot take {height}×{width} inputs", cfg.network))?;
    let backend = backend::open(cfg.backend)?;
    backend.check_fits(cfg.device, &eager_plan, &opt)?;
    let (weights, calibration) = match weights_file {
        Some(path) => (Weights::load(path, &graph)?, None),
        None => seeded_weights_calibrated(&graph, cfg.seed, height.max(width))?,
    };
    // Only the CPU's eager sessions take over the calibration's packed weights; free it now
    // for any other run.
    let calibration = calibration.filter(|_| cfg.backend.is_host() && cfg.compile.is_none());
    // Asked once here: enumerating devices can be slow (wgpu lists every adapter). A missing
    // device is reported by the backend's own `prepare`, which says what there is.
    let device = backend.devices().into_iter().nth(cfg.device);
    let mut opt = opt;
    let (plan, weights, compile) = match cfg.compile {
        None => (eager_plan, weights, None),
        Some(mode) => {
            let start = Instant::now();
            // The passes rewrite the eager weights in place, which are not needed again.
            let (g, w, passes) = crate::model::passes::optimize(&graph, weights)
                .map_err(|e| anyhow::anyhow!("the compile passes failed: {e}"))?;
            let plan = g.plan(cfg.batch_size, height, width)?;
            let autotune = if mode == CompileMode::MaxAutotune {
                let Some(device) = &device else {
                    backend.prepare(cfg.device, &plan, &w, &opt)?;
                    bail!("there is no device {}", cfg.device);
                };
                let (variants, mut report) = autotune::tune(cfg, &plan, backend.as_ref(), device)?;
                opt.variants = variants;
                report.schedule =
                    autotune::tune_schedule(cfg, &plan, &w, backend.as_ref(), device, &opt)?;
                opt.schedule = report.schedule.as_ref().map(|c| c.variant.clone());
                Some(report)
            } else {
                None
            };
            let compile_s = start.elapsed().as_secs_f64();
            let total = |p: &Plan| {
                let m = p.memory_estimate(cfg.precision);
                m.weights + m.activations
            };
            let info = CompileInfo {
                mode,
                passes,
                compile_s,
                eager_memory: total(&eager_plan),
                compiled_memory: total(&plan),
                max_abs_diff: f64::NAN,
                rel_diff: f64::NAN,
                output_scale: None,
                autotune,
                replay: None,
            };
            (plan, w, Some(info))
        }
    };
    // Calibration packed the weights for the CPU already: the run's session takes them over
    // where they fit (see `Calibration::prepare`). Either way the session takes the weights,
    // which nothing here reads again: the CPU's frees each layer's f32 tensors once it has
    // packed them (`Backend::prepare_owned`).
    let session = match calibration {
        Some(calibration) => calibration.prepare(cfg.device, &plan, weights, &opt)?,
        None => backend.prepare_owned(cfg.device, &plan, weights, &opt)?,
    };
    let device = device.context("the device disappeared while preparing")?;
    let compile = compile.map(|c| CompileInfo {
        replay: opt.replay.then(|| session.replay()),
        ..c
    });
    Ok((plan, session, device, compile))
}

/// Images in the batch that calibrates random weights' batch-norm statistics.
const CALIBRATION_BATCH: usize = 4;

/// Seeded random weights, as torchvision initialises them, with batch-norm statistics
/// calibrated on a seeded noise batch at `input_size` (see
/// [`backend::cpu::calibrate_batch_norm`] for why).
pub fn seeded_weights(graph: &Graph, seed: u64, input_size: usize) -> Result<Weights> {
    Ok(seeded_weights_calibrated(graph, seed, input_size)?.0)
}

/// [`seeded_weights`], and the CPU session that calibrated them (where the network has batch
/// norm): a CPU run of the same network takes its packed weights (see
/// [`backend::cpu::Calibration::prepare`]).
fn seeded_weights_calibrated(
    graph: &Graph,
    seed: u64,
    input_size: usize,
) -> Result<(Weights, Option<backend::cpu::Calibration>)> {
    let mut weights = Weights::seeded(graph, seed);
    if !graph
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::BatchNorm { .. }))
    {
        return Ok((weights, None));
    }
    // At ImageNet sizes one image gives every channel of the last stage 49 samples; small
    // inputs need more images for usable statistics.
    let batch = if input_size >= 128 {
        1
    } else {
        CALIBRATION_BATCH
    };
    let plan = graph.plan(batch, input_size, input_size)?;
    let mut rng = Rng::new(seed.wrapping_add(0xCA11));
    let batch = rng.normal_tensor(plan.input_shape().to_vec());
    let calibration = backend::cpu::calibrate_batch_norm(&plan, &mut weights, &batch)?;
    Ok((weights, Some(calibration)))
}

/// Run a benchmark as configured.
pub fn run(
    cfg: &BenchConfig,
    weights_file: Option<&std::path::Path>,
    on_event: &mut dyn FnMut(Event),
) -> Result<BenchRecord> {
    if crate::model::llm::is_decoder(&cfg.network) {
        return llm::run(cfg, None, on_event);
    }
    validate(cfg)?;
    if !cfg.framework.is_ours() {
        return framework::run(cfg);
    }
    if let Some(sc) = &cfg.scenario {
        return run_scenario(cfg, sc, weights_file, on_event);
    }
    let start = Instant::now();
    let prepared = prepare(cfg, weights_file)?;
    let prepare_s = start.elapsed().as_secs_f64();
    on_event(Event::Preparing {
        params: prepared.0.graph.param_count(),
        weights: cfg.weights.clone(),
        seconds: prepare_s,
    });
    let mut record = measure(cfg, prepared, on_event, None)?;
    record.prepare_s = Some(prepare_s);
    if let Some(info) = record.compile.as_mut() {
        // The compiled network must still compute what eager FP32 does.
        let eager = BenchConfig {
            compile: None,
            recompile: false,
            precision: crate::model::Precision::Fp32,
            profile: false,
            flops_prof_step: None,
            ..cfg.clone()
        };
        let mut opt = eager.exec_options();
        // A WORKSHOP_CPU_SPLIT names the compiled graph's nodes, where the eager graph may not
        // join the images (a block's last convolution, with its add fused): the reference
        // runs whole batches then, which changes none of its values.
        if crate::settings::get().is_ok_and(|s| s.cpu_split != crate::settings::SplitChoice::Auto) {
            opt.schedule = Some("off".into());
        }
        let hw = (cfg.input_size, cfg.input_size);
        let (plan, mut session, _, _) = prepare_with(&eager, weights_file, hw, opt)?;
        let want = infer(session.as_mut(), &bench_batch(cfg, &plan).0)?;
        let scale = want.data.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        info.max_abs_diff = want
            .data
            .iter()
            .zip(&record.output)
            .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
        info.rel_diff = info.max_abs_diff / scale.max(f64::MIN_POSITIVE);
        info.output_scale = Some(scale);
    }
    Ok(record)
}

/// An MLPerf scenario (`scenario`): sessions for batch sizes up to `cfg.batch_size`, the
/// scenario's probes on them, and a record whose samples are the reported probe's per-query
/// latencies and whose throughput is its queries per second.
fn run_scenario(
    cfg: &BenchConfig,
    sc: &scenario::ScenarioConfig,
    weights_file: Option<&std::path::Path>,
    on_event: &mut dyn FnMut(Event),
) -> Result<BenchRecord> {
    sc.validate()?;
    let start = Instant::now();
    let mut batches = scenario::Batches {
        sessions: Vec::new(),
        padded: 0,
        times: Vec::new(),
    };
    let mut last = None;
    // Sessions for the batch sizes the scenario can form: one query at a time, full batches,
    // or a server's any size up to the largest.
    let sizes = match sc.scenario {
        scenario::Scenario::SingleStream => vec![1],
        scenario::Scenario::Offline => vec![cfg.batch_size],
        scenario::Scenario::Server => scenario::Batches::sizes(cfg.batch_size),
    };
    for size in sizes {
        let sized = BenchConfig {
            batch_size: size,
            scenario: None,
            ..cfg.clone()
        };
        let (plan, session, device, _) = prepare(&sized, weights_file)?;
        let input = bench_batch(&sized, &plan).0;
        batches.sessions.push((size, session, input));
        last = Some((plan, device));
    }
    let (plan, device) = last.context("no batch size")?;
    let prepare_s = start.elapsed().as_secs_f64();
    on_event(Event::Preparing {
        params: plan.graph.param_count(),
        weights: cfg.weights.clone(),
        seconds: prepare_s,
    });
    let run = scenario::run(cfg, sc, &mut batches, &mut |p| {
        on_event(Event::Probe(p.clone()))
    })?;
    let reported = run.reported().clone();
    let per_image = plan.graph.plan(1, cfg.input_size, cfg.input_size)?;
    let samples_s = run.latencies_s.clone();
    let mut stats =
        Stats::from_samples(&samples_s, 1, per_image.macs() * 2).context("no timed samples")?;
    // A query is one image; the rate is what the scenario sustained, not 1 / latency.
    stats.throughput = reported.achieved_qps;
    stats.throughput_median = reported.achieved_qps;
    stats.gflops = reported.achieved_qps * per_image.macs() as f64 * 2.0 / 1e9;
    // The noise verdicts judge is the compute's, not the latencies' spread.
    stats.cv = reported.cv;
    let (_, session, _) = batches.sessions.last_mut().context("no session")?;
    let memory = session.memory();
    let environment = environment(device, session.kernel_version());
    let model = ModelInfo::of(&plan.graph, cfg.input_size)?;
    Ok(BenchRecord {
        prepare_s: Some(prepare_s),
        scenario: Some(run),
        ..BenchRecord::new(cfg.clone(), environment, model, samples_s, stats, memory)
    })
}

/// The seeded batch of a run: normal noise and random labels, like the classic benchmark (the
/// loss of an untrained network on it sits near ln(classes)).
pub fn bench_batch(cfg: &BenchConfig, plan: &Plan) -> (Tensor, Vec<usize>) {
    let mut rng = Rng::new(cfg.seed.wrapping_add(1));
    let input = rng.normal_tensor(plan.input_shape().to_vec());
    let classes = plan.output_shape()[1];
    let labels = (0..plan.batch()).map(|_| rng.below(classes)).collect();
    (input, labels)
}

/// Waits for every device of a multi-device run at the start (called with `None`) and at the
/// end of each iteration (called with the step's start and end instants, warm-up included);
/// an error means another device failed and the run is over.
pub type Together<'a> = &'a (dyn Fn(Option<(Instant, Instant)>) -> Result<()> + Sync);

/// The warm-up and timed iterations of a prepared session, and its record. With `sync`, each
/// iteration starts and ends together with the other devices'.
pub fn measure(
    cfg: &BenchConfig,
    (plan, mut session, device, compile): Prepared,
    on_event: &mut dyn FnMut(Event),
    sync: Option<Together<'_>>,
) -> Result<BenchRecord> {
    let together = |step| sync.map_or(Ok(()), |s| s(step));
    let (input, labels) = bench_batch(cfg, &plan);

    let mut last = Vec::new();
    let mut enqueue_s = Vec::with_capacity(cfg.iterations);
    // A classifier's logits are read back and scored every iteration, as the classic benchmark
    // does; any other output (a layer chain's activations: 2 GiB for a 3×3 convolution at
    // batch 128 and 256²) only once after the timed loop, so the times are the layer's and not
    // a copy to the host.
    // Every run keeps its input on the device after the first pass where the backend can
    // (`Session::rerun`), as PyTorch's benchmarks (which make their input on the device), its op
    // benchmarks and the published conv tables do: on an H200, copying ResNet-50's FP32 batch
    // of 64 from the host took 10 ms of a 37 ms step that PyTorch's side never pays.
    let read_each = plan.output_shape().len() == 2;
    let mut uploaded = false;
    // One iteration: its start and end instants and its loss (when read).
    let mut step = |session: &mut Box<dyn Session>| -> Result<(Instant, Instant, Option<f64>)> {
        let start = Instant::now();
        if !uploaded || !session.rerun()? {
            session.run(&input)?;
            uploaded = true;
        }
        enqueue_s.push(start.elapsed().as_secs_f64());
        session.sync()?;
        if !read_each {
            return Ok((start, Instant::now(), None));
        }
        let logits = session.read_output()?;
        let end = Instant::now();
        let loss = reference::cross_entropy(&logits, &labels);
        last = logits.data;
        Ok((start, end, Some(loss)))
    };
    let mut warmup_s = Vec::with_capacity(cfg.warmup);
    for index in 0..cfg.warmup {
        together(None)?;
        let (start, end, loss) = step(&mut session)?;
        together(Some((start, end)))?;
        let seconds = (end - start).as_secs_f64();
        warmup_s.push(seconds);
        on_event(Event::Warmup {
            index,
            loss,
            seconds,
        });
    }
    let mut samples_s = Vec::with_capacity(cfg.iterations);
    let mut loss = f64::NAN;
    let mut timeline = Vec::new();
    let mut flops_step = None;
    let reader = telemetry::reader_for(cfg.backend, cfg.device, &device);
    let sampler = reader.map(|r| telemetry::Sampler::start(r, telemetry::PERIOD));
    let run_start = Instant::now();
    for index in 0..cfg.iterations {
        together(None)?;
        let start_us = run_start.elapsed().as_secs_f64() * 1e6;
        let (start, end, l) = step(&mut session)?;
        together(Some((start, end)))?;
        let seconds = (end - start).as_secs_f64();
        samples_s.push(seconds);
        loss = l.unwrap_or(loss);
        let wanted = cfg.flops_prof_step == Some(index + 1);
        if (cfg.profile || wanted)
            && let Some(kernels) = session.kernel_times()
        {
            if wanted {
                flops_step = Some((kernels.clone(), seconds));
            }
            if cfg.profile {
                timeline.push(profile::IterationTimes {
                    start_us,
                    host_s: seconds,
                    kernels,
                });
            }
        }
        on_event(Event::Iteration {
            index,
            loss: l,
            seconds,
        });
    }
    let telemetry = Some(sampler.and_then(telemetry::Sampler::finish));
    if cfg.profile && timeline.is_empty() || cfg.flops_prof_step.is_some() && flops_step.is_none() {
        return Err(backend::BackendError::Unsupported(
            "this device cannot time its kernels (no timestamp queries): run without \
             --profile/--trace/--profile-csv/--flops-prof-step"
                .into(),
        )
        .into());
    }
    if !read_each {
        let output = session.read_output()?;
        loss = reference::cross_entropy(&output, &labels);
        last = output.data;
    }
    // The session's facts, then its memory back before a peak probe may need it.
    let memory = session.memory();
    let environment = Environment {
        telemetry,
        ..environment(device.clone(), session.kernel_version())
    };
    drop(session);
    let flops_profile = match flops_step {
        Some((kernels, host_s)) => Some(flops::profile(
            &plan,
            cfg.precision,
            &kernels,
            cfg.flops_prof_step.unwrap_or(1),
            host_s,
            limits(cfg, &device)?,
        )),
        None => None,
    };

    let model = ModelInfo::of(&plan.graph, cfg.input_size)?;
    let stats = Stats::from_samples(&samples_s, cfg.batch_size, 2 * plan.macs())
        .context("no timed samples")?;
    // The warm-up's enqueue times came first.
    let enqueue_s = enqueue_s.split_off(enqueue_s.len().saturating_sub(samples_s.len()));
    Ok(BenchRecord {
        warmup_s,
        enqueue_s,
        loss,
        profile: profile::aggregate(&timeline),
        flops_profile,
        compile,
        output: std::mem::take(&mut last),
        timeline,
        ..BenchRecord::new(cfg.clone(), environment, model, samples_s, stats, memory)
    })
}

fn environment(device: DeviceInfo, kernel_version: String) -> Environment {
    let host = backend::cpu::host_device();
    Environment {
        runner_version: env!("CARGO_PKG_VERSION").into(),
        os: sysinfo::System::long_os_version().unwrap_or_else(|_| std::env::consts::OS.into()),
        arch: std::env::consts::ARCH.into(),
        hostname: sysinfo::System::host_name().ok(),
        cpu_model: host.name,
        cpu_cores: host.compute_units,
        device,
        kernel_version,
        telemetry: None,
    }
}

/// The largest batch whose weights and activations fit in the memory the backend reports
/// free now: an estimate from the memory plan (nothing is allocated), `None` when the backend
/// does not report its memory.
pub fn max_batch_estimate(cfg: &BenchConfig) -> Option<usize> {
    let graph = zoo::build(&cfg.network).ok()?;
    let plan = graph.plan(1, cfg.input_size, cfg.input_size).ok()?;
    let budget = backend::open(cfg.backend).ok()?.memory_budget(cfg.device)?;
    let est = plan.memory_estimate(cfg.precision);
    let room = (budget / 11 * 10).saturating_sub(est.weights);
    Some((room / est.activations_per_image.max(1)) as usize)
}

/// One forward pass of `input` through a prepared session, returning the output.
pub fn infer(session: &mut dyn Session, input: &Tensor) -> Result<Tensor> {
    session.run(input)?;
    session.sync()?;
    Ok(session.read_output()?)
}

/// GEMM size and bandwidth arrays (MiB) of the quick peak probe: on the host and the software
/// devices; and on a real GPU, where a 512³ GEMM keeps an H200's 132 SMs a few microseconds
/// (1.2% of its BF16 tensor cores' rate) and 64 MiB arrays are read too quickly to time (1967
/// GB/s, against 3203 GB/s over 1 GiB with the same kernel).
const PROBE: (usize, usize) = (512, 64);
const GPU_PROBE: (usize, usize) = (4096, 512);

/// The limits a FLOPs profile is judged against: the cached `workshop peak` measurement of
/// this device, or a short probe run now (and cached), plus the theoretical peak where known.
pub fn limits(cfg: &BenchConfig, device: &DeviceInfo) -> Result<flops::Limits> {
    let cached = match peak::cached(cfg.backend, &device.name, cfg.precision, cfg.threads) {
        Some(c) => {
            let how = format!(
                "a {}³ GEMM measured {} (kept in {}; `workshop peak` measures again)",
                c.gemm.size,
                c.measured_at(),
                peak::cache_path().map_or(String::new(), |p| p.display().to_string())
            );
            (c, how)
        }
        None => {
            let (size, mib) = if peak::on_real_gpu(cfg.backend, device) {
                GPU_PROBE
            } else {
                PROBE
            };
            let gemm = peak::gemm(cfg.backend, cfg.device, cfg.precision, cfg.threads, size, 3)?;
            let bandwidth = peak::bandwidth_if_any(cfg.backend, cfg.device, mib, 3, cfg.threads)?
                .unwrap_or_default();
            let entry = peak::CachedPeak::new(device.name.clone(), cfg.threads, gemm, bandwidth);
            // A failed check keeps the probe out of the cache; the profile still shows it.
            let _ = peak::remember(entry.clone());
            let how = format!("a {size}³ GEMM probe run now (`workshop peak` measures longer)");
            (entry, how)
        }
    };
    let (c, how) = cached;
    let source = c.gemm.denominator(how);
    let theoretical = peak::theoretical(cfg.backend, device, cfg.threads, cfg.precision);
    Ok(flops::Limits {
        peak_gflops: (c.gemm.validated == c.gemm.iterations).then_some(c.gemm.gflops),
        peak_source: source,
        bandwidth_gbps: peak::memory_triad(cfg.backend, &device.name, cfg.threads)
            .or(c.triad_gbps()),
        theoretical,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ExecOptions;
    use crate::model::Precision;

    /// A session that took over the packed convolutions of the one that calibrated batch norm
    /// computes bit for bit what a freshly prepared session computes: at the calibration's
    /// batch; at a larger one (where a Winograd layer changes schedule); at a
    /// smaller one (where layers change tile, so their packing is redone); with other threads;
    /// and in FP16 (which takes nothing).
    #[test]
    fn calibration_session_runs_the_same_network() {
        let graph = zoo::build("resnet18").unwrap();
        // Below 128 px calibration takes CALIBRATION_BATCH (4) images.
        let size = 32;
        let cpu = backend::open(backend::BackendKind::Cpu).unwrap();
        let fp16 = ExecOptions {
            precision: Precision::Fp16,
            ..Default::default()
        };
        let one_thread = ExecOptions {
            threads: Some(1),
            ..Default::default()
        };
        let cases = [
            (CALIBRATION_BATCH, ExecOptions::default()),
            (8, ExecOptions::default()),
            (2, ExecOptions::default()),
            (CALIBRATION_BATCH, one_thread),
            (CALIBRATION_BATCH, fp16),
        ];
        for (batch, opt) in cases {
            let plan = graph.plan(batch, size, size).unwrap();
            let input = Rng::new(7).normal_tensor(plan.input_shape().to_vec());
            let (weights, calibration) = seeded_weights_calibrated(&graph, 3, size).unwrap();
            let mut fresh = cpu.prepare(0, &plan, &weights, &opt).unwrap();
            let want = infer(fresh.as_mut(), &input).unwrap();
            let mut handed = calibration
                .expect("resnet18 has batch norm")
                .prepare(0, &plan, weights, &opt)
                .unwrap();
            let what = format!("batch {batch}, {opt:?}");
            assert_eq!(
                infer(handed.as_mut(), &input).unwrap().data,
                want.data,
                "{what}"
            );
            // And again, with the first run's buffers.
            assert_eq!(
                infer(handed.as_mut(), &input).unwrap().data,
                want.data,
                "{what}"
            );
        }
        // A device the CPU does not have is refused as the backend refuses it.
        let plan = graph.plan(CALIBRATION_BATCH, size, size).unwrap();
        let (weights, calibration) = seeded_weights_calibrated(&graph, 3, size).unwrap();
        let err = calibration
            .unwrap()
            .prepare(1, &plan, weights, &Default::default())
            .err()
            .expect("device 1 refused");
        assert!(err.to_string().contains("one device"), "{err}");
    }
}

//! `workshop peak`: the machine's measured limits, to compare layers against — GEMM
//! throughput through the backend's own kernels (every iteration's output checked against an
//! f64 reference on sampled entries, so a fast wrong kernel never counts), and on the CPU the
//! memory bandwidth of a copy and a triad (a = b + s·c) over arrays far larger than the caches.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

pub use crate::backend::Theoretical;
use crate::backend::{self, BackendKind, DeviceInfo, ExecOptions};
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit};
use crate::model::{Precision, Rng, Weights};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmPeak {
    pub backend: BackendKind,
    /// The device's name, as the backend lists it (empty when it lists none).
    #[serde(default)]
    pub device: String,
    pub precision: Precision,
    /// M = N = K.
    pub size: usize,
    pub iterations: usize,
    pub median_s: f64,
    /// 2·size³ / median time.
    pub gflops: f64,
    pub best_gflops: f64,
    /// Iterations whose sampled outputs all matched the reference.
    pub validated: usize,
    pub max_rel_error: f64,
    /// The device's state while the GEMMs ran ([`super::telemetry`]), and `workshop peak`'s
    /// bandwidth probes after them, or why it was not read; absent in older records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<Result<super::telemetry::Telemetry, String>>,
    /// The ceiling's chains timed just before each GEMM, where the backend measures its
    /// ceiling (a CPU's cores); absent elsewhere and in older records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beside: Option<Beside>,
}

/// The compute ceiling's chains run just before each timed GEMM, as long as the GEMM before
/// (`Backend::ceiling_now`): on a shared machine the cores' rate moves between runs, and the
/// ceiling itself is the best of its own runs, so a GEMM's median over that best reads low.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Beside {
    /// Median over the iterations of the GEMM's GFLOP/s over the chains' just before it.
    pub share: f64,
    /// Median of the chains' GFLOP/s.
    pub chains_gflops: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bandwidth {
    /// `copy` or `triad`.
    pub kernel: String,
    /// Bytes read and written per pass.
    pub bytes: u64,
    pub median_gbps: f64,
    pub best_gbps: f64,
    /// The host's last-level cache, for a probe of host memory: arrays that fit in it time
    /// the cache, not memory.
    #[serde(default)]
    pub cache_bytes: Option<u64>,
}

/// Entries of the output checked per iteration.
const SAMPLES: usize = 64;

/// Relative error allowed per precision, against the sum of |products| of the dot product
/// (the scale rounding errors grow with): f32 accumulation of rounded inputs.
fn tolerance(p: Precision) -> f64 {
    match p {
        Precision::Fp32 => 1e-5,
        Precision::Fp16 => 1e-3,
        Precision::Bf16 => 1e-2,
    }
}

/// C = A·Bᵀ (+ bias) of size×size matrices as a fully connected layer through the backend.
pub fn gemm(
    kind: BackendKind,
    device: usize,
    precision: Precision,
    threads: Option<usize>,
    size: usize,
    iterations: usize,
) -> Result<GemmPeak> {
    Ok(gemm_on(
        kind,
        device,
        precision,
        threads,
        size,
        iterations,
        false,
        |_| Ok(()),
    )?
    .0)
}

/// [`gemm`], and what `then` returned: it runs after the timed GEMMs, on the facts of the
/// device they ran on (where the backend lists it), inside their telemetry's window (the
/// ceiling and the bandwidth probes of [`probe`]: on a CPU the GEMMs alone take a tenth of a
/// second, too short to tell whether other programs shared the cores). With `beside`, the
/// backend's ceiling chains run before each GEMM ([`GemmPeak::beside`]; `workshop peak`'s,
/// not a profile's quick probe, which has no use for them).
#[allow(clippy::too_many_arguments)]
pub fn gemm_on<R>(
    kind: BackendKind,
    device: usize,
    precision: Precision,
    threads: Option<usize>,
    size: usize,
    iterations: usize,
    beside: bool,
    then: impl FnOnce(Option<&DeviceInfo>) -> Result<R>,
) -> Result<(GemmPeak, R)> {
    if size == 0 || iterations == 0 {
        bail!("--size and --iterations must be at least 1");
    }
    for (name, v) in [("size", size), ("iterations", iterations)] {
        if let Err(why) = super::within_limit(name, v) {
            bail!("--{name}: {why}");
        }
    }
    let mut g = GraphBuilder::new(
        "gemm",
        size,
        ConvInit::TorchDefault,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let x = g.flatten("flatten", x);
    let y = g.linear("fc", x, size, size);
    let graph = g.finish(y);
    let plan = graph.plan(size, 1, 1)?;
    let weights = Weights::init(&graph, 7);
    let input = Rng::new(8).normal_tensor(vec![size, size, 1, 1]);
    let b = backend::open(kind)?;
    let opt = ExecOptions {
        precision,
        threads,
        // The GEMM's kernel alone is timed (a GPU's timestamps, the CPU's clock around the
        // kernel): the input's upload and the output's download would otherwise dwarf it on a
        // GPU, and on the CPU the pass's copy of the 4 MiB input into the session's arena
        // (timed with it, an Emerald Rapids Xeon's 1024³ GEMM read 88% of the FMA ceiling;
        // alone, 94% at best).
        profile: true,
        ..Default::default()
    };
    let mut session = b.prepare(device, &plan, &weights, &opt)?;
    // The reference sees the values the backend stores.
    let round = |v: f32| precision.round(v) as f64;
    let w = &weights.get("fc.weight").context("weights")?.data;
    let bias = &weights.get("fc.bias").context("bias")?.data;
    let mut rng = Rng::new(9);
    let picks: Vec<(usize, usize)> = (0..SAMPLES)
        .map(|_| (rng.below(size), rng.below(size)))
        .collect();
    let expected: Vec<(f64, f64)> = picks
        .iter()
        .map(|&(i, j)| {
            let (mut sum, mut scale) = (bias[j] as f64, bias[j].abs() as f64);
            for k in 0..size {
                let p = round(input.data[i * size + k]) * round(w[j * size + k]);
                sum += p;
                scale += p.abs();
            }
            (sum, scale)
        })
        .collect();
    let warm = Instant::now();
    session.run(&input)?;
    session.sync()?;
    let warm = warm.elapsed().as_secs_f64();
    let info = b.devices().into_iter().nth(device);
    let sampler = info
        .as_ref()
        .ok_or_else(|| format!("no {kind} device {device} to read"))
        .and_then(|d| super::telemetry::reader_for(kind, device, d))
        .map(|r| super::telemetry::Sampler::start(r, super::telemetry::PERIOD));
    let mut times = Vec::with_capacity(iterations);
    let mut shares = Vec::with_capacity(iterations);
    let mut validated = 0;
    let mut max_rel_error = 0f64;
    let flops = 2.0 * (size as f64).powi(3);
    for _ in 0..iterations {
        // The ceiling's chains for about as long as the last GEMM took, just before this one
        // (where the backend measures its ceiling).
        let last = times.last().copied().unwrap_or(warm);
        let chains = (info.as_ref())
            .filter(|_| beside)
            .and_then(|d| b.ceiling_now(d, threads, precision, last));
        let start = Instant::now();
        session.run(&input)?;
        session.sync()?;
        let wall = start.elapsed().as_secs_f64();
        let device_ns: Option<u64> = session
            .kernel_times()
            .map(|k| k.iter().filter(|k| k.node == "fc").map(|k| k.ns).sum())
            .filter(|&ns| ns > 0);
        let time = device_ns.map_or(wall, |ns| ns as f64 * 1e-9);
        times.push(time);
        if let Some(chains) = chains.filter(|&c| c > 0.0) {
            shares.push((flops / time / 1e9 / chains, chains));
        }
        let out = session.read_output()?;
        let mut ok = true;
        for (&(i, j), &(want, scale)) in picks.iter().zip(&expected) {
            let err = (out.data[i * size + j] as f64 - want).abs() / scale.max(f64::MIN_POSITIVE);
            max_rel_error = max_rel_error.max(err);
            ok &= err <= tolerance(precision);
        }
        validated += ok as usize;
    }
    let then = then(info.as_ref());
    let telemetry = Some(sampler.and_then(super::telemetry::Sampler::finish));
    let then = then?;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    // Medians, as the GEMM's, of its share of the chains beside it and of the chains.
    let beside = (!shares.is_empty()).then(|| {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Beside {
            share: median(shares.iter().map(|b| b.0).collect()),
            chains_gflops: median(shares.iter().map(|b| b.1).collect()),
        }
    });
    let peak = GemmPeak {
        backend: kind,
        device: info.as_ref().map(|d| d.name.clone()).unwrap_or_default(),
        precision,
        size,
        iterations,
        median_s: median,
        gflops: flops / median / 1e9,
        best_gflops: flops / sorted[0] / 1e9,
        validated,
        max_rel_error,
        telemetry,
        beside,
    };
    Ok((peak, then))
}

/// Copy and triad bandwidth of device `device`'s memory over `mib` MiB arrays (host memory
/// on the CPU backend).
pub fn bandwidth(
    kind: BackendKind,
    device: usize,
    mib: usize,
    iterations: usize,
    threads: Option<usize>,
) -> Result<Vec<Bandwidth>> {
    if let Err(why) = super::within_limit("array_mib", mib) {
        bail!("--array-mib: {why}");
    }
    let n = (mib << 20) / 4;
    if n == 0 || iterations == 0 {
        bail!("the arrays and the iterations must not be empty");
    }
    let t = backend::open(kind)?.stream(device, n, iterations, threads)?;
    let cache_bytes = kind
        .is_host()
        .then(|| crate::backend::cpu::batch_tiles::last_level_cache() as u64);
    let summary = |name: &str, bytes: u64, times: &[f64]| {
        let mut sorted = times.to_vec();
        sorted.sort_by(f64::total_cmp);
        Bandwidth {
            kernel: name.into(),
            bytes,
            median_gbps: bytes as f64 / sorted[sorted.len() / 2] / 1e9,
            best_gbps: bytes as f64 / sorted[0] / 1e9,
            cache_bytes,
        }
    };
    Ok(vec![
        summary(PROBES[0], (2 * t.n * 4) as u64, &t.copy_s),
        summary(PROBES[1], (3 * t.n * 4) as u64, &t.triad_s),
    ])
}

/// The bandwidth probes' kernels, as records and course metrics (`copy_gbps`) name them.
pub const PROBES: [&str; 2] = ["copy", "triad"];

/// [`bandwidth`], or `None` when the backend has no probe (a GPU backend without one yet).
pub fn bandwidth_if_any(
    kind: BackendKind,
    device: usize,
    mib: usize,
    iterations: usize,
    threads: Option<usize>,
) -> Result<Option<Vec<Bandwidth>>> {
    match bandwidth(kind, device, mib, iterations, threads) {
        Ok(b) => Ok(Some(b)),
        Err(e)
            if matches!(
                e.downcast_ref::<backend::BackendError>(),
                Some(backend::BackendError::Unsupported(_))
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// One device's measured limits, kept between runs so profiles and exercises can compare
/// against them without measuring again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachedPeak {
    pub device: String,
    pub threads: Option<usize>,
    pub gemm: GemmPeak,
    #[serde(default)]
    pub bandwidth: Vec<Bandwidth>,
    pub measured_unix: u64,
    /// The CPU kernels that ran (`sgemm::kernel_name`: the SIMD path `WORKSHOP_CPU_SIMD`
    /// may force), so a measurement of one path is never taken for another's; empty on GPUs.
    #[serde(default)]
    pub kernels: String,
}

impl CachedPeak {
    /// A measurement of `device` taken now.
    pub fn new(
        device: String,
        threads: Option<usize>,
        gemm: GemmPeak,
        bandwidth: Vec<Bandwidth>,
    ) -> Self {
        CachedPeak {
            device,
            threads,
            kernels: gemm.backend.gemm_kernels(),
            gemm,
            bandwidth,
            measured_unix: now_unix(),
        }
    }

    fn same_key(&self, other: &CachedPeak) -> bool {
        self.is_for(
            other.gemm.backend,
            &other.device,
            other.gemm.precision,
            other.threads,
            &other.kernels,
        ) && self.gemm.size == other.gemm.size
    }

    /// Whether this measures `device` of `backend` at `precision` with `threads` workers
    /// running `kernels` (any size).
    fn is_for(
        &self,
        backend: BackendKind,
        device: &str,
        precision: Precision,
        threads: Option<usize>,
        kernels: &str,
    ) -> bool {
        self.device == device
            && pool(backend, self.threads) == pool(backend, threads)
            && self.gemm.backend == backend
            && self.gemm.precision == precision
            && self.kernels == kernels
    }

    /// When it was measured, as RFC 3339 ("2026-11-30T20:16:39Z").
    pub fn measured_at(&self) -> String {
        let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(self.measured_unix);
        humantime::format_rfc3339_seconds(when).to_string()
    }

    /// Median triad bandwidth, when measured.
    pub fn triad_gbps(&self) -> Option<f64> {
        self.bandwidth
            .iter()
            .find(|b| b.kernel == "triad")
            .map(|b| b.median_gbps)
    }
}

/// The pool `threads` asks of `backend`, as the cache keys it: on the CPU, a count equal to
/// the backend's default pool is that pool (`--threads 2` on a 2-core machine and no
/// `--threads` measure the same thing); elsewhere the count as given.
fn pool(backend: BackendKind, threads: Option<usize>) -> Option<usize> {
    match threads {
        Some(n) if backend == BackendKind::Cpu && n == crate::backend::cpu::default_threads() => {
            None
        }
        other => other,
    }
}

/// The measured peaks, kept per device.
pub fn cache_path() -> Option<std::path::PathBuf> {
    Some(crate::settings::cache_dir()?.join("peak.json"))
}

fn read_cache() -> Vec<CachedPeak> {
    cache_path().map(|p| read_cache_at(&p)).unwrap_or_default()
}

fn read_cache_at(path: &std::path::Path) -> Vec<CachedPeak> {
    crate::files::read_text(path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// The cached limits of `device` on `backend` at `precision` with `threads`: of the sizes
/// measured, the largest (a small GEMM, as a quick `--size 256` or the profiles' probe, stays
/// below the machine's peak and must not replace a full measurement).
pub fn cached(
    backend: BackendKind,
    device: &str,
    precision: Precision,
    threads: Option<usize>,
) -> Option<CachedPeak> {
    let kernels = backend.gemm_kernels();
    read_cache()
        .into_iter()
        .filter(|c| c.is_for(backend, device, precision, threads, &kernels))
        .max_by_key(|c| (c.gemm.size, c.measured_unix))
}

/// The memory bandwidth that `device`'s memory-bound work (a decode step, a roofline's
/// balance) is judged against: of the cached measurements of it on `backend` with `threads`,
/// the triad over the largest arrays (the newest of those), whatever the precision, GEMM size
/// or kernels of the run (the probe depends on none of them). Small arrays time the cache: on
/// an Emerald Rapids Xeon `bench/gemm_peers.py`'s 2048³ runs (16 MiB arrays) kept a triad of
/// 52 GB/s, and a decode step that read 25 GB/s from memory showed as 49% of it, where the
/// 768 MiB runs' 23–26 GB/s put it near all of it.
pub fn memory_triad(backend: BackendKind, device: &str, threads: Option<usize>) -> Option<f64> {
    largest_triad(&read_cache(), backend, device, threads)
}

fn largest_triad(
    all: &[CachedPeak],
    backend: BackendKind,
    device: &str,
    threads: Option<usize>,
) -> Option<f64> {
    all.iter()
        .filter(|c| {
            c.device == device
                && c.gemm.backend == backend
                && pool(backend, c.threads) == pool(backend, threads)
        })
        .filter_map(|c| {
            let b = c.bandwidth.iter().find(|b| b.kernel == "triad")?;
            Some(((b.bytes, c.measured_unix), b.median_gbps))
        })
        .max_by_key(|&(key, _)| key)
        .map(|(_, gbps)| gbps)
}

/// What [`remember`] did with a measurement.
#[derive(Debug, Clone, PartialEq)]
pub enum Kept {
    /// It replaced the device's earlier one of the same probe, in the cache at this path.
    Now(std::path::PathBuf),
    /// It was left out: its telemetry says the run was disturbed (`why`), and the cache at
    /// `path` keeps `earlier`, a measurement of the same probe whose run was not.
    Earlier {
        path: std::path::PathBuf,
        earlier: Box<CachedPeak>,
        why: Vec<String>,
    },
}

impl GemmPeak {
    /// `how` this peak came to be the denominator of a profile's shares, and, for one
    /// measured while other programs had the cores (one the cache kept for want of an
    /// undisturbed one, or a probe just run), that those shares read high.
    pub fn denominator(&self, how: String) -> String {
        match self.disturbed() {
            [] => how,
            why => format!(
                "{how}; while it ran, {}, so the shares against it read high",
                why.join("; ")
            ),
        }
    }

    /// Why the telemetry says the run was not the device's speed (other programs on the
    /// cores, steal, throttling, low clocks); empty when it says nothing was wrong, or was
    /// not read.
    pub fn disturbed(&self) -> &[String] {
        match &self.telemetry {
            Some(Ok(t)) => &t.summary.concerns,
            _ => &[],
        }
    }

    /// Whether the telemetry read the run and found nothing wrong: on a CPU that includes
    /// other programs' load, which a window under a quarter of a second cannot judge (the
    /// GEMMs alone, before the bandwidth probes joined their window).
    pub fn undisturbed(&self) -> bool {
        match &self.telemetry {
            Some(Ok(t)) => {
                t.summary.concerns.is_empty()
                    && (t.cores.is_none() || t.summary.other_cores.is_some())
            }
            _ => false,
        }
    }
}

/// Keep a validated measurement, replacing the device's earlier one of the same probe —
/// unless the new run was disturbed and the earlier one is known not to have been: every
/// later FLOPs profile and exercise divides by the cached figure, and a `workshop peak` taken
/// while a build shared the cores once made a profile read "123% of the measured bandwidth".
/// A measurement with a failed check is never kept.
pub fn remember(entry: CachedPeak) -> Result<Kept> {
    let path = cache_path().context("no cache directory: set WORKSHOP_CACHE_DIR or HOME")?;
    remember_at(path, entry)
}

/// [`remember`] in the cache file at `path`.
fn remember_at(path: std::path::PathBuf, entry: CachedPeak) -> Result<Kept> {
    if entry.gemm.validated < entry.gemm.iterations {
        bail!("a GEMM result did not match the reference: not kept");
    }
    let mut all = read_cache_at(&path);
    let why = entry.gemm.disturbed();
    if !why.is_empty()
        && let Some(earlier) = all
            .iter()
            .find(|c| c.same_key(&entry) && c.gemm.undisturbed())
    {
        return Ok(Kept::Earlier {
            why: why.to_vec(),
            earlier: Box::new(earlier.clone()),
            path,
        });
    }
    all.retain(|c| !c.same_key(&entry));
    all.push(entry);
    crate::files::write_atomic(&path, serde_json::to_string_pretty(&all)?.as_bytes())?;
    Ok(Kept::Now(path))
}

/// Keep a validated measurement of device `index` of backend `kind` (see [`remember`]).
pub fn keep(
    kind: BackendKind,
    index: usize,
    threads: Option<usize>,
    gemm: &GemmPeak,
    bandwidth: &[Bandwidth],
) -> Result<Kept> {
    let device = backend::open(kind)?
        .devices()
        .into_iter()
        .nth(index)
        .map(|d| d.name)
        .with_context(|| format!("{kind} has no device {index}"))?;
    remember(CachedPeak::new(
        device,
        threads,
        gemm.clone(),
        bandwidth.to_vec(),
    ))
}

/// The compute ceiling of `device` for `precision` running `threads` workers, as its backend
/// knows it ([`backend::Backend::ceiling`]): measured on a CPU's cores, from a GPU's
/// specification.
pub fn theoretical(
    kind: BackendKind,
    device: &backend::DeviceInfo,
    threads: Option<usize>,
    precision: Precision,
) -> Option<Theoretical> {
    backend::open(kind)
        .ok()?
        .ceiling(device, threads, precision)
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What one run of the probes measures on one device: `workshop peak` and the course's peak
/// steps ask for the same.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeSpec {
    pub backend: BackendKind,
    pub device: usize,
    pub precision: Precision,
    pub threads: Option<usize>,
    /// GEMM size (M = N = K); `None`: [`HOST_PROBE`]'s or [`GPU_PROBE`]'s.
    pub size: Option<usize>,
    pub iterations: usize,
    /// Size of each bandwidth array, in MiB; `None` as `size`.
    pub array_mib: Option<usize>,
}

/// The probes' GEMM size and bandwidth arrays (MiB) by default: on the host and software
/// devices; and on a real GPU, which a 1024³ GEMM leaves mostly idle (an H200 ran our BF16
/// GEMM at 35 TFLOP/s at 1024³, 59 at 4096³) and whose caches reach hundreds of MiB (an
/// MI300X's Infinity Cache holds 256 MiB).
pub const HOST_PROBE: (usize, usize) = (1024, 256);
pub const GPU_PROBE: (usize, usize) = (4096, 1024);

/// Whether `device` of `backend` is a GPU of its own (not the host's cores, nor a device that
/// computes on them: the emulator, lavapipe), which the probes size for.
pub fn on_real_gpu(backend: BackendKind, device: &DeviceInfo) -> bool {
    !backend.is_host() && !device.is_software()
}

/// The GEMM peak, the bandwidth probes where the backend has them, and the ceiling above the
/// GEMM (from the facts of the device that was measured, or measured on the CPU's cores).
#[derive(Debug, Clone)]
pub struct Probe {
    pub gemm: GemmPeak,
    pub bandwidth: Option<Vec<Bandwidth>>,
    pub ceiling: Option<Theoretical>,
}

/// Run the probes of `spec`.
pub fn probe(spec: &ProbeSpec) -> Result<Probe> {
    let (backend, device, threads) = (spec.backend, spec.device, spec.threads);
    let defaults = if spec.size.is_some() && spec.array_mib.is_some() || backend.is_host() {
        HOST_PROBE
    } else {
        let devices = backend::open(backend)?.devices();
        match devices.get(device) {
            Some(d) if on_real_gpu(backend, d) => GPU_PROBE,
            _ => HOST_PROBE,
        }
    };
    let mib = spec.array_mib.unwrap_or(defaults.1);
    // The ceiling right after the timed GEMMs, before the bandwidth probes: the GEMM's share
    // of it is a ratio of two timings, which should see the cores at one clock. On a shared
    // 2-vCPU VM the FMA chains read 201.7 GFLOP/s in one run and 142.1 in the next (3.15 and
    // 2.22 GHz); measured after the probes' gigabyte of copies, the ceiling was seconds
    // apart from the GEMM rather than a fraction of one.
    let (gemm, (ceiling, bandwidth)) = gemm_on(
        backend,
        device,
        spec.precision,
        threads,
        spec.size.unwrap_or(defaults.0),
        spec.iterations,
        true,
        |info| {
            let ceiling = info.and_then(|d| theoretical(backend, d, threads, spec.precision));
            let bandwidth = bandwidth_if_any(backend, device, mib, spec.iterations, threads)?;
            Ok((ceiling, bandwidth))
        },
    )?;
    Ok(Probe {
        gemm,
        bandwidth,
        ceiling,
    })
}

impl Probe {
    /// Every GEMM result matched the reference: only then does the peak count.
    pub fn validated(&self) -> bool {
        self.gemm.validated == self.gemm.iterations
    }

    /// Why the peak does not count, when a GEMM result did not match the reference.
    pub fn refusal(&self) -> Option<String> {
        (!self.validated()).then(|| {
            format!(
                "{} of {} GEMM results did not match the reference: the peak does not count",
                self.gemm.iterations - self.gemm.validated,
                self.gemm.iterations
            )
        })
    }

    /// Keep the measurement for later FLOPs profiles and exercises of this device ([`keep`]).
    pub fn keep(&self, spec: &ProbeSpec) -> Result<Kept> {
        let bandwidth = self.bandwidth.as_deref().unwrap_or_default();
        keep(
            spec.backend,
            spec.device,
            spec.threads,
            &self.gemm,
            bandwidth,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::telemetry::{Summary, Telemetry};
    use super::*;

    /// A validated 256³ FP32 CPU measurement of `gflops` whose telemetry read other programs'
    /// load as `other_cores` (`None`: a window too short to read it), with `concerns`.
    fn measured(gflops: f64, other_cores: Option<f64>, concerns: &[&str]) -> CachedPeak {
        let telemetry = Telemetry {
            source: "test".into(),
            rated_clock_mhz: None,
            reports_throttling: false,
            cores: Some(2),
            readings: Vec::new(),
            summary: Summary {
                other_cores,
                concerns: concerns.iter().map(|c| c.to_string()).collect(),
                ..Summary::default()
            },
        };
        let gemm = GemmPeak {
            backend: BackendKind::Cpu,
            device: "CPU".into(),
            precision: Precision::Fp32,
            size: 256,
            iterations: 3,
            median_s: 1.0,
            gflops,
            best_gflops: gflops,
            validated: 3,
            max_rel_error: 0.0,
            telemetry: Some(Ok(telemetry)),
            beside: None,
        };
        CachedPeak::new("CPU".into(), Some(2), gemm, Vec::new())
    }

    /// The triad over the largest arrays counts, whichever GEMM it ran beside; another
    /// device's or pool's never.
    #[test]
    fn the_memory_triad_is_the_one_over_the_largest_arrays() {
        let with = |gbps: f64, mib: u64, when: u64, threads: usize, size: usize| {
            let mut c = measured(100.0, Some(0.0), &[]);
            c.threads = Some(threads);
            c.gemm.size = size;
            c.measured_unix = when;
            c.bandwidth = vec![Bandwidth {
                kernel: "triad".into(),
                bytes: mib << 20,
                median_gbps: gbps,
                best_gbps: gbps,
                cache_bytes: None,
            }];
            c
        };
        let mut all = vec![
            with(52.0, 48, 30, 2, 2048),
            with(26.0, 768, 10, 2, 1024),
            with(24.0, 768, 20, 2, 512),
            with(12.0, 4096, 40, 1, 1024),
        ];
        let cpu = BackendKind::Cpu;
        assert_eq!(largest_triad(&all, cpu, "CPU", Some(2)), Some(24.0));
        assert_eq!(largest_triad(&all, cpu, "CPU", Some(1)), Some(12.0));
        assert_eq!(largest_triad(&all, cpu, "GPU", Some(2)), None);
        all.retain(|c| c.bandwidth[0].bytes < 700 << 20);
        assert_eq!(largest_triad(&all, cpu, "CPU", Some(2)), Some(52.0));
    }

    /// The GEMM figure the cache at `path` holds (one entry expected).
    fn held(path: &std::path::Path) -> f64 {
        let all = read_cache_at(path);
        assert_eq!(all.len(), 1, "{all:?}");
        all[0].gemm.gflops
    }

    /// A disturbed measurement never replaces one known to be undisturbed, and says which it
    /// left in place; it does replace one whose load was never read (older records, short
    /// windows), and an undisturbed one replaces anything.
    #[test]
    fn a_disturbed_peak_keeps_the_undisturbed_one_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("peak.json");
        let busy = || {
            measured(
                90.0,
                Some(1.1),
                &["other programs kept 1.1 of 2 cores busy"],
            )
        };

        // Nothing earlier: the disturbed one is better than none.
        assert_eq!(
            remember_at(path.clone(), busy()).unwrap(),
            Kept::Now(path.clone())
        );
        assert_eq!(held(&path), 90.0);
        // An undisturbed one replaces it.
        remember_at(path.clone(), measured(170.0, Some(0.02), &[])).unwrap();
        assert_eq!(held(&path), 170.0);
        // The disturbed one is left out, naming why and what stays.
        match remember_at(path.clone(), busy()).unwrap() {
            Kept::Earlier {
                path: p,
                earlier,
                why,
            } => {
                assert_eq!(p, path);
                assert_eq!(earlier.gemm.gflops, 170.0);
                assert_eq!(why, ["other programs kept 1.1 of 2 cores busy"]);
            }
            other => panic!("kept the disturbed run: {other:?}"),
        }
        assert_eq!(held(&path), 170.0);
        // A quiet run measuring less replaces it: the latest undisturbed figure counts.
        remember_at(path.clone(), measured(150.0, Some(0.0), &[])).unwrap();
        assert_eq!(held(&path), 150.0);
        // An earlier one whose load was not read is not known to be undisturbed.
        remember_at(path.clone(), measured(160.0, None, &[])).unwrap();
        assert_eq!(
            remember_at(path.clone(), busy()).unwrap(),
            Kept::Now(path.clone())
        );
        assert_eq!(held(&path), 90.0);
        // Another probe's key (a different size) is not touched either way.
        let mut other = measured(40.0, Some(0.0), &[]);
        other.gemm.size = 128;
        remember_at(path.clone(), other).unwrap();
        assert_eq!(read_cache_at(&path).len(), 2);
    }

    /// A peak measured on busy cores says so where it divides a profile's figures; a quiet
    /// one, or one whose load was not read, is named as it is.
    #[test]
    fn a_disturbed_denominator_says_its_shares_read_high() {
        let busy = measured(
            90.0,
            Some(1.1),
            &["other programs kept 1.1 of 2 cores busy"],
        );
        assert_eq!(
            busy.gemm.denominator("a 512³ GEMM probe".into()),
            "a 512³ GEMM probe; while it ran, other programs kept 1.1 of 2 cores busy, so the \
             shares against it read high"
        );
        for quiet in [measured(150.0, Some(0.0), &[]), measured(150.0, None, &[])] {
            assert_eq!(quiet.gemm.denominator("a probe".into()), "a probe");
        }
    }

    /// On the CPU a thread count equal to the machine's cores is the default pool: a
    /// measurement under either key is found by both and replaces the other; any other count
    /// is a pool of its own.
    #[test]
    fn all_cores_and_the_default_pool_share_one_cache_key() {
        let cores = std::thread::available_parallelism().unwrap().get();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("peak.json");
        let mut all_cores = measured(150.0, Some(0.0), &[]);
        all_cores.threads = Some(cores);
        remember_at(path.clone(), all_cores.clone()).unwrap();
        let kernels = all_cores.kernels.clone();
        let found = |threads| {
            read_cache_at(&path)
                .iter()
                .any(|c| c.is_for(BackendKind::Cpu, "CPU", Precision::Fp32, threads, &kernels))
        };
        assert!(found(None) && found(Some(cores)));
        assert!(!found(Some(cores + 1)));

        let mut default_pool = measured(160.0, Some(0.0), &[]);
        default_pool.threads = None;
        remember_at(path.clone(), default_pool).unwrap();
        assert_eq!(held(&path), 160.0);
    }
}

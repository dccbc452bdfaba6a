//! The CPU backend: the embedded default that always works. It prepares a plan by packing
//! every layer's weights for its kernel (in the session's storage precision), then runs the
//! graph node by node on a rayon pool of `--threads` workers, freeing each activation after
//! its last reader and recycling buffers so the timed loop does not allocate.
//!
//! Where each layer goes (activations NHWC, f32 arithmetic, storage f32, f16 or bf16):
//! - 1×1 stride-1 convolutions and linear layers: a GEMM straight on the activations
//!   ([`sgemm`]: packed weights, 14×32 AVX-512 / 6×16 AVX2 register tiles, portable fallback);
//!   other convolutions gather im2col columns a chunk of rows at a time for the same GEMM
//!   ([`kernels`]).
//! - 3×3 stride-1 convolutions: Winograd F(4×4, 3×3) or F(2×2, 3×3) ([`winograd`]).
//! - BF16 sessions: convolutions multiply bf16 pairs on AMX tiles ([`amx`]) or with
//!   `vdpbf16ps` ([`pairs`]) where the CPU has them (Winograd instead on 3×3 layers with many
//!   tiles); FP16 weights are widened in registers by the GEMM tiles.
//! - Depthwise convolutions, pooling, batch norm (an affine map), ReLU, adds, softmax: direct
//!   loops vectorised for the widest SIMD in use ([`simd`]); element-wise ops work in place
//!   where their input is not read again.
//! - Where the early activations of a batch outgrow the last-level cache, the layers up to a
//!   block's output run a few images at a time ([`split`]), then the images are joined.
//!
//! `WORKSHOP_CPU_SIMD` forces a lesser SIMD path and `WORKSHOP_CPU_SPLIT` the batch tiles, to
//! test or time them.

pub mod amx;
pub mod ceiling;
pub mod elem;
pub mod kernels;
pub mod pairs;
pub mod sgemm;
pub mod simd;
pub mod split;
pub mod winograd;

use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};
use rayon::prelude::*;

use super::{
    Backend, BackendError, BackendKind, DeviceInfo, ExecOptions, KernelTime, MemoryStats, Session,
    StreamTimes, Theoretical,
};
use crate::model::buffers::take_best_fit;
use crate::model::op::{Op, Pool, batch_norm_affine};
use crate::model::{Plan, Precision, Tensor, Weights};
use elem::Elem;
use kernels::{Nhwc, PackedConv, PackedLinear};

pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// [`Backend::prepare`], taking from `donor` the packed convolutions that fit.
    fn prepare_with(
        &self,
        dev: usize,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
        donor: &mut Donor,
    ) -> Result<Box<dyn Session>, BackendError> {
        super::native_only(BackendKind::Cpu, opt)?;
        if dev != 0 {
            return Err(BackendError::NoDevice {
                kind: BackendKind::Cpu,
                reason: format!(
                    "the CPU backend has one device (0), not {dev}; use --threads to choose cores"
                ),
            });
        }
        let threads = match &opt.cores {
            Some(cores) => cores.len(),
            None => opt.threads.unwrap_or_else(default_threads),
        };
        if threads == 0 {
            return Err(BackendError::Invalid("--threads must be at least 1".into()));
        }
        check_memory(plan, opt.precision, threads)?;
        let pool = worker_pool(threads, opt.cores.clone().unwrap_or_default())?;
        fn boxed<T: Elem>(
            plan: &Plan,
            weights: &Weights,
            pool: Arc<rayon::ThreadPool>,
            threads: usize,
            opt: &ExecOptions,
            donor: &mut Donor,
        ) -> Result<Box<dyn Session>, BackendError> {
            let session = CpuSession::<T>::new(
                plan,
                weights,
                pool,
                threads,
                opt.profile,
                &opt.variants,
                donor,
            )?;
            Ok(Box::new(session))
        }
        match opt.precision {
            Precision::Fp32 => boxed::<f32>(plan, weights, pool, threads, opt, donor),
            Precision::Fp16 => boxed::<f16>(plan, weights, pool, threads, opt, donor),
            Precision::Bf16 => boxed::<bf16>(plan, weights, pool, threads, opt, donor),
        }
    }
}

/// Instruction-set features that our kernels (and `gemm`'s) take advantage of.
pub fn cpu_features() -> Vec<String> {
    let mut f = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($name:tt),*) => { $( if std::arch::is_x86_feature_detected!($name) { f.push($name.to_uppercase()); } )* };
        }
        probe!(
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bf16",
            "avx512fp16"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            f.push("NEON".into());
        }
        if std::arch::is_aarch64_feature_detected!("fp16") {
            f.push("FP16".into());
        }
    }
    f
}

/// The host's name, memory and cores, as the CPU backend's one device.
pub fn host_device() -> DeviceInfo {
    // sysinfo can fail on exotic platforms; the device is still usable without these facts.
    let sys = sysinfo::System::new().ok().map(|mut sys| {
        sys.refresh_memory();
        sys.refresh_cpu_list(sysinfo::CpuRefreshKind::nothing());
        sys
    });
    let name = sys
        .as_ref()
        .and_then(|s| s.cpus().first().map(|c| c.brand().trim().to_string()))
        .filter(|s| !s.is_empty());
    DeviceInfo {
        name: name.unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH)),
        memory_bytes: sys.as_ref().map(|s| s.total_memory()),
        driver: Some(format!(
            "workshop-cpu kernels, sgemm {}",
            sgemm::kernel_name()
        )),
        compute_units: std::thread::available_parallelism().ok().map(|n| n.get()),
        features: cpu_features(),
        clock_mhz: None,
    }
}

/// Memory the OS can give us now (unknown → no limit is enforced).
pub fn available_memory() -> u64 {
    sysinfo::System::new().map_or(u64::MAX, |mut sys| {
        sys.refresh_memory();
        sys.available_memory()
    })
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn ceiling(&self, device: &DeviceInfo, workers: Option<usize>) -> Option<Theoretical> {
        ceiling::ceiling(
            &device.features,
            workers.or(device.compute_units).unwrap_or(1),
        )
    }

    fn variants(&self, op: &Op, _out: &[usize]) -> Vec<&'static str> {
        match op {
            Op::Conv2d(c) if !(c.groups > 1 && c.groups == c.in_channels) => {
                let mut v = kernels::CONV_VARIANTS.to_vec();
                if winograd::eligible(c) {
                    v.extend(winograd::VARIANTS);
                }
                v
            }
            _ => Vec::new(),
        }
    }

    fn stream(
        &self,
        _dev: usize,
        n: usize,
        iterations: usize,
        threads: Option<usize>,
    ) -> Result<StreamTimes, BackendError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.unwrap_or(0))
            .build()
            .map_err(|e| BackendError::Driver(format!("cannot start the worker threads: {e}")))?;
        pool.install(|| {
            let a: Vec<f32> = vec![1.0; n];
            let mut b: Vec<f32> = vec![2.0; n];
            let c: Vec<f32> = vec![3.0; n];
            const CHUNK: usize = 1 << 16;
            let mut time = |f: &mut dyn FnMut(&mut Vec<f32>)| -> Vec<f64> {
                (0..iterations + 1)
                    .map(|_| {
                        let t = Instant::now();
                        f(&mut b);
                        t.elapsed().as_secs_f64()
                    })
                    .skip(1)
                    .collect()
            };
            let copy_s = time(&mut |b| {
                b.par_chunks_mut(CHUNK)
                    .zip(a.par_chunks(CHUNK))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            });
            let triad_s = time(&mut |b| {
                b.par_chunks_mut(CHUNK)
                    .zip(a.par_chunks(CHUNK))
                    .zip(c.par_chunks(CHUNK))
                    .for_each(|((d, x), y)| {
                        for ((d, x), y) in d.iter_mut().zip(x).zip(y) {
                            *d = x + 0.5 * y;
                        }
                    });
            });
            // The triad's result is checked, so the loop cannot be optimised away unseen.
            if b.iter().any(|&v| v != 2.5) {
                return Err(BackendError::WrongResult(
                    "the triad computed wrong values: the measurement is void".into(),
                ));
            }
            Ok(StreamTimes { n, copy_s, triad_s })
        })
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        vec![host_device()]
    }

    fn memory_budget(&self, _dev: usize) -> Option<u64> {
        Some(available_memory())
    }

    fn check_fits(&self, _dev: usize, plan: &Plan, opt: &ExecOptions) -> Result<(), BackendError> {
        check_memory(
            plan,
            opt.precision,
            opt.threads.unwrap_or_else(default_threads),
        )
    }

    fn prepare(
        &self,
        dev: usize,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        self.prepare_with(dev, plan, weights, opt, &mut Donor::default())
    }
}

/// The batch tiles for `plan` at `elem` bytes a value: as `WORKSHOP_CPU_SPLIT` sets them
/// ([`crate::settings::SplitChoice`]), else [`split::plan`] for this CPU's last-level cache.
fn batch_split(plan: &Plan, elem: usize) -> Result<Option<split::Split>, BackendError> {
    use crate::settings::{self, SplitChoice};
    let settings = settings::get().map_err(|e| BackendError::Invalid(e.to_string()))?;
    match &settings.cpu_split {
        SplitChoice::Off => Ok(None),
        SplitChoice::Levels(levels) => {
            let asked: Vec<(&str, usize)> = levels.iter().map(|(n, t)| (n.as_str(), *t)).collect();
            split::at(plan, &asked)
                .map(Some)
                .map_err(|why| BackendError::Invalid(format!("{}: {why}", settings::CPU_SPLIT)))
        }
        SplitChoice::Auto => Ok(split::plan(plan, elem, split::last_level_cache())),
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A pool of `threads` workers, the i-th pinned to `cores[i]` where one is listed.
fn worker_pool(threads: usize, cores: Vec<usize>) -> Result<Arc<rayon::ThreadPool>, BackendError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("workshop-cpu-{i}"))
        .start_handler(move |i| {
            // Pinning is a request: where the OS refuses it the thread runs unpinned.
            if let Some(&core) = cores.get(i) {
                core_affinity::set_for_current(core_affinity::CoreId { id: core });
            }
        })
        .build()
        .map(Arc::new)
        .map_err(|e| {
            BackendError::Driver(format!("cannot start {threads} CPU worker threads: {e}"))
        })
}

/// Refuse a plan that cannot fit in the memory available now, before allocating anything, and
/// suggest the largest batch that would.
fn check_memory(plan: &Plan, precision: Precision, threads: usize) -> Result<(), BackendError> {
    let est = plan.memory_estimate(precision);
    // Workers' column scratch (bounded per chunk), plus a 10% margin for the allocator.
    let scratch = (threads as u64) * (kernels::COLUMN_CHUNK_ELEMS as u64 * 4 * 8);
    let needed = (est.weights + est.activations + scratch) * 11 / 10;
    let available = available_memory();
    if needed <= available {
        return Ok(());
    }
    let room = (available * 10 / 11).saturating_sub(est.weights + scratch);
    let fits = (room / est.activations_per_image.max(1)) as usize;
    Err(BackendError::OutOfMemory {
        needed,
        available,
        suggestion: (fits >= 1).then_some(fits.min(plan.batch())),
    })
}

/// What a node does at run time, with its weights packed for the kernel.
enum Step<T> {
    Input,
    Conv(PackedConv<T>),
    Affine {
        scale: Vec<f32>,
        shift: Vec<f32>,
    },
    Clamp {
        lo: f32,
        hi: f32,
    },
    Pool {
        pool: Pool,
        max: bool,
    },
    Adaptive,
    Add,
    Linear {
        weight: PackedLinear<T>,
        fin: usize,
        fout: usize,
    },
    Flatten,
    Identity,
    Softmax,
}

/// An activation buffer: the first `len` elements of `data` in use. Every element of `data` is
/// initialised (zeros when it was made), so a buffer serves any length up to `data.len()`
/// without being filled again: a `Vec` truncated and grown back would refill the difference on
/// every pass (a memset of up to a whole tensor per op).
struct Buf<T> {
    data: Vec<T>,
    len: usize,
}

impl<T> std::ops::Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data[..self.len]
    }
}

impl<T> std::ops::DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data[..self.len]
    }
}

struct CpuSession<T: Elem> {
    plan: Plan,
    steps: Vec<Step<T>>,
    names: Vec<String>,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    profile: bool,
    /// Buffers that are free for reuse, and the one holding the last output.
    free: Vec<Buf<T>>,
    output: Option<Buf<T>>,
    times: Vec<KernelTime>,
    /// Batch-norm calibration mode: normalise with each batch's own statistics and keep
    /// them (node id, mean, biased variance) instead of using the running ones.
    calibrate: bool,
    batch_stats: Vec<(usize, Vec<f32>, Vec<f32>)>,
    /// The batch tiles of the first layers (see [`split`]); not used while calibrating, whose
    /// statistics are the whole batch's.
    split: Option<split::Split>,
    weight_bytes: u64,
    held_bytes: u64,
    peak_bytes: u64,
}

impl<T: Elem> CpuSession<T> {
    fn new(
        plan: &Plan,
        weights: &Weights,
        pool: Arc<rayon::ThreadPool>,
        threads: usize,
        profile: bool,
        variants: &std::collections::BTreeMap<String, String>,
        donor: &mut Donor,
    ) -> Result<Self, BackendError> {
        let split = batch_split(plan, std::mem::size_of::<T>())?;
        // The shape each node runs at: the most images one call of it sees.
        let run_shape = |id: usize| {
            let mut shape = plan.shapes[id].clone();
            if let (Some(s), Some(n)) = (&split, shape.first_mut()) {
                *n = s.images(id, *n);
            }
            shape
        };
        let mut steps = Vec::with_capacity(plan.graph.nodes.len());
        let mut weight_bytes = 0u64;
        for (id, node) in plan.graph.nodes.iter().enumerate() {
            let get = |suffix: &str| tensor(weights, &node.name, suffix);
            let shape = run_shape(id);
            let step = match node.op {
                Op::Input { .. } => Step::Input,
                Op::Conv2d(c) => {
                    let bias = if c.bias { Some(get("bias")?) } else { None };
                    let variant = variants.get(&node.name).map(String::as_str);
                    let tile = match variant {
                        Some(v) => winograd::Tile::from_variant(v),
                        // Where BF16 multiplies bf16 pairs, only layers with tiles enough
                        // (see `winograd::beats_pairs`).
                        None => winograd::by_default(&c, &shape).filter(|&t| {
                            !kernels::uses_pairs::<T>(&c) || winograd::beats_pairs(t, &shape)
                        }),
                    };
                    let donated = variant
                        .is_none()
                        .then(|| donor.take::<T>(id, tile, &shape))
                        .flatten();
                    let mut packed = match donated {
                        Some(packed) => packed,
                        None => tile
                            .and_then(|t| {
                                let w = get("weight").ok()?;
                                PackedConv::<T>::winograd(t, c, w, bias, &shape)
                            })
                            .map_or_else(
                                || get("weight").map(|w| PackedConv::<T>::new(c, w, bias)),
                                Ok,
                            )?,
                    };
                    packed.chunk_scale = kernels::chunk_scale(variant);
                    weight_bytes += packed.bytes();
                    Step::Conv(packed)
                }
                Op::BatchNorm { eps, .. } => {
                    let (g, b, m, v) = (
                        get("weight")?,
                        get("bias")?,
                        get("running_mean")?,
                        get("running_var")?,
                    );
                    let (scale, shift) = batch_norm_affine(g, b, m, v, eps);
                    weight_bytes += 2 * scale.len() as u64 * 4;
                    Step::Affine { scale, shift }
                }
                Op::Relu => Step::Clamp {
                    lo: 0.0,
                    hi: f32::INFINITY,
                },
                Op::Relu6 => Step::Clamp { lo: 0.0, hi: 6.0 },
                Op::MaxPool(p) => Step::Pool { pool: p, max: true },
                Op::AvgPool(p) => Step::Pool {
                    pool: p,
                    max: false,
                },
                Op::AdaptiveAvgPool { .. } => Step::Adaptive,
                Op::Add => Step::Add,
                Op::Linear {
                    in_features,
                    out_features,
                    bias,
                } => {
                    let bias = if bias { Some(get("bias")?) } else { None };
                    let weight = PackedLinear::new(get("weight")?, bias, in_features, out_features);
                    weight_bytes += weight.bytes();
                    Step::Linear {
                        weight,
                        fin: in_features,
                        fout: out_features,
                    }
                }
                Op::Flatten => Step::Flatten,
                Op::Dropout { .. } => Step::Identity,
                Op::Softmax => Step::Softmax,
            };
            steps.push(step);
        }
        let names = plan.graph.nodes.iter().map(|n| n.name.clone()).collect();
        Ok(CpuSession {
            plan: plan.clone(),
            steps,
            names,
            pool,
            threads,
            profile,
            free: Vec::new(),
            output: None,
            times: Vec::new(),
            calibrate: false,
            batch_stats: Vec::new(),
            split,
            weight_bytes,
            held_bytes: 0,
            peak_bytes: 0,
        })
    }

    /// A buffer of exactly `len` elements: the smallest free one that is large enough, or a new
    /// one. Buffers are reused at run time (not laid out ahead as the GPU programs are) because
    /// batch tiles run parts of the batch through the same nodes.
    fn alloc(&mut self, len: usize) -> Buf<T> {
        let fit = take_best_fit(&mut self.free, len as u64, |b| b.data.len() as u64);
        let mut buf = match fit {
            Some(buf) => buf,
            None => {
                self.held_bytes += (len * std::mem::size_of::<T>()) as u64;
                self.peak_bytes = self.peak_bytes.max(self.held_bytes);
                Buf {
                    data: big_buffer(len),
                    len,
                }
            }
        };
        buf.len = len;
        buf
    }

    /// Node `id`'s output for `n` images, as NHWC dimensions.
    fn dims(&self, id: usize, n: usize) -> Nhwc {
        match *self.plan.shapes[id].as_slice() {
            [_, c, h, w] => Nhwc { n, h, w, c },
            [_, f] => Nhwc {
                n,
                h: 1,
                w: 1,
                c: f,
            },
            _ => Nhwc {
                n: 1,
                h: 1,
                w: 1,
                c: self.plan.shapes[id].iter().product(),
            },
        }
    }

    fn forward(&mut self, input: &Tensor) -> Result<(), BackendError> {
        if input.shape != self.plan.input_shape() {
            return Err(BackendError::Invalid(format!(
                "input has shape {:?}, the prepared plan expects {:?}",
                input.shape,
                self.plan.input_shape()
            )));
        }
        if let Some(out) = self.output.take() {
            self.free.push(out);
        }
        self.times.clear();
        let start = Instant::now();
        let n_nodes = self.plan.graph.nodes.len();
        let batch = self.plan.batch();
        let mut values: Vec<Option<Buf<T>>> = (0..n_nodes).map(|_| None).collect();
        let mut steps = std::mem::take(&mut self.steps);
        let levels = match &self.split {
            Some(split) if !self.calibrate => split.levels.clone(),
            _ => Vec::new(),
        };
        let last = n_nodes - 1;
        self.run_nodes(
            &mut steps,
            &levels,
            last,
            0..batch,
            &mut values,
            input,
            start,
        );
        self.steps = steps;
        self.output = values[self.plan.graph.output].take();
        self.free.extend(values.into_iter().flatten());
        Ok(())
    }

    /// Nodes `0..=upto` on `images` of the batch, the batch tiles of `levels` (innermost first)
    /// that lie inside: up to the outermost level's cut, one of its tiles at a time (each
    /// through the levels inside it), the cut's values copied into their place among
    /// `images`, then the rest of the nodes on all of `images`.
    #[allow(clippy::too_many_arguments)]
    fn run_nodes(
        &mut self,
        steps: &mut [Step<T>],
        levels: &[split::Level],
        upto: usize,
        images: std::ops::Range<usize>,
        values: &mut [Option<Buf<T>>],
        input: &Tensor,
        start: Instant,
    ) {
        let mut first = 0;
        if let Some((level, inner)) = levels.split_last() {
            if level.end > upto || level.tile >= images.len() {
                return self.run_nodes(steps, inner, upto, images, values, input, start);
            }
            let end = level.end;
            let per_image = self.dims(end, 1).elems();
            let mut joined = self.alloc(per_image * images.len());
            for part in split::parts(images.clone(), level.tile) {
                let mut tile: Vec<Option<Buf<T>>> = (0..=end).map(|_| None).collect();
                self.run_nodes(steps, inner, end, part.clone(), &mut tile, input, start);
                let out = tile[end].take().expect("the cut computed");
                let at = (part.start - images.start) * per_image;
                joined[at..at + out.len()].copy_from_slice(&out);
                self.free.push(out);
                self.free.extend(tile.into_iter().flatten());
            }
            values[end] = Some(joined);
            first = end + 1;
        }
        for (id, step) in steps.iter_mut().enumerate().take(upto + 1).skip(first) {
            self.step(id, step, values, input, images.clone(), start);
        }
    }

    /// Node `id` on `images` of the batch: reads its inputs from `values`, leaves its output
    /// there, frees the inputs it read last, and times itself when profiling.
    fn step(
        &mut self,
        id: usize,
        step: &mut Step<T>,
        values: &mut [Option<Buf<T>>],
        input: &Tensor,
        images: std::ops::Range<usize>,
        forward_start: Instant,
    ) {
        let start = self.profile.then(Instant::now);
        let os = self.dims(id, images.len());
        let inputs = self.plan.graph.nodes[id].inputs.clone();
        // An op that maps its input element-wise reuses the input's buffer when nothing
        // else reads it later (torchvision's `inplace=True`).
        let last_reader = |v: usize| self.plan.last_use[v] == id;
        let out = match step {
            Step::Input => {
                let mut y = self.alloc(os.elems());
                let image = input.data.len() / self.plan.batch();
                let x = &input.data[images.start * image..images.end * image];
                kernels::nchw_to_nhwc(x, os, &mut y);
                y
            }
            Step::Conv(p) => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                let x = values[inputs[0]].as_ref().expect("input computed");
                let residual = inputs
                    .get(1)
                    .map(|&r| values[r].as_deref().expect("residual computed"));
                kernels::conv2d(p, x, xs, &mut y, os, self.threads, residual);
                y
            }
            Step::Affine { scale, shift } => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                if self.calibrate {
                    let (mean, var) = channel_stats(&y, os.c);
                    let gamma_beta: Vec<(f32, f32)> = scale
                        .iter()
                        .zip(shift.iter())
                        .map(|(&s, &b)| (s, b))
                        .collect();
                    // In calibration the prepared scale/shift hold gamma and beta (see
                    // `calibrate_batch_norm`); turn them into the batch's normalisation.
                    for (c, (g, b)) in gamma_beta.into_iter().enumerate() {
                        scale[c] = g / (var[c] + BN_EPS).sqrt();
                        shift[c] = b - mean[c] * scale[c];
                    }
                    self.batch_stats.push((id, mean, var));
                }
                kernels::affine_inplace(&mut y, os.c, scale, shift);
                y
            }
            Step::Clamp { lo, hi } => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                kernels::clamp_inplace(&mut y, *lo, *hi);
                y
            }
            Step::Identity => self.take_or_copy(values, inputs[0], last_reader(inputs[0])),
            Step::Add => {
                let (a, b) = if last_reader(inputs[0]) {
                    (inputs[0], inputs[1])
                } else {
                    (inputs[1], inputs[0])
                };
                let mut y = self.take_or_copy(values, a, last_reader(a));
                kernels::add_inplace(&mut y, values[b].as_ref().expect("input computed"));
                y
            }
            Step::Pool { pool, max } => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                kernels::pool(
                    pool,
                    *max,
                    values[inputs[0]].as_ref().expect("input computed"),
                    xs,
                    &mut y,
                    os,
                );
                y
            }
            Step::Adaptive => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                kernels::adaptive_avg_pool(
                    values[inputs[0]].as_ref().expect("input computed"),
                    xs,
                    &mut y,
                    os,
                );
                y
            }
            Step::Flatten => {
                let xs = self.dims(inputs[0], images.len());
                if xs.h * xs.w == 1 {
                    self.take_or_copy(values, inputs[0], last_reader(inputs[0]))
                } else {
                    let mut y = self.alloc(os.elems());
                    kernels::nhwc_to_nchw(
                        values[inputs[0]].as_ref().expect("input computed"),
                        xs,
                        &mut y,
                    );
                    y
                }
            }
            Step::Linear { weight, fin, fout } => {
                let mut y = self.alloc(os.elems());
                let x = values[inputs[0]].as_ref().expect("input computed");
                kernels::linear(x, weight, (os.n, *fin, *fout), &mut y, self.threads);
                y
            }
            Step::Softmax => {
                let mut y = self.alloc(os.elems());
                kernels::softmax(
                    values[inputs[0]].as_ref().expect("input computed"),
                    os.c,
                    &mut y,
                );
                y
            }
        };
        values[id] = Some(out);
        for &i in &inputs {
            if self.plan.last_use[i] == id
                && let Some(buf) = values[i].take()
            {
                self.free.push(buf);
            }
        }
        if let Some(start) = start {
            self.times.push(KernelTime {
                node: self.names[id].clone(),
                op: self.plan.graph.nodes[id].op.kind_name().to_string(),
                kernel: kernel_name(step, &self.plan.graph.nodes[id].op),
                start_ns: start.duration_since(forward_start).as_nanos() as u64,
                ns: start.elapsed().as_nanos() as u64,
            });
        }
    }

    /// The input buffer itself when this node is its last reader, else a copy of it.
    fn take_or_copy(&mut self, values: &mut [Option<Buf<T>>], v: usize, last: bool) -> Buf<T> {
        if last {
            return values[v].take().expect("input computed");
        }
        let len = values[v].as_ref().expect("input computed").len();
        let mut y = self.alloc(len);
        y.copy_from_slice(values[v].as_ref().expect("input computed"));
        y
    }
}

/// The tensor `{node}.{suffix}` of `weights`.
fn tensor<'w>(weights: &'w Weights, node: &str, suffix: &str) -> Result<&'w [f32], BackendError> {
    let name = format!("{node}.{suffix}");
    weights
        .get(&name)
        .map(|t| t.data.as_slice())
        .ok_or_else(|| BackendError::Invalid(format!("weights have no tensor `{name}`")))
}

/// Batch norm epsilon used in calibration (every zoo network uses PyTorch's default).
const BN_EPS: f32 = 1e-5;

/// Per-channel mean and biased variance of an NHWC (or N×C) buffer, accumulated in f64.
fn channel_stats<T: Elem>(buf: &[T], c: usize) -> (Vec<f32>, Vec<f32>) {
    let mut sum = vec![0f64; c];
    let mut sq = vec![0f64; c];
    for px in buf.chunks_exact(c) {
        for (i, v) in px.iter().enumerate() {
            let v = v.to_f32() as f64;
            sum[i] += v;
            sq[i] += v * v;
        }
    }
    let n = (buf.len() / c.max(1)).max(1) as f64;
    let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
    let var = sq
        .iter()
        .zip(&mean)
        .map(|(q, m)| (q / n - m * m).max(0.0) as f32)
        .collect();
    (mean.into_iter().map(|m| m as f32).collect(), var)
}

/// Give randomly initialised batch-norm layers the running statistics of one batch (what a
/// train-mode forward pass with momentum 1 would record). A freshly initialised network in
/// eval mode has mean 0 / variance 1 everywhere, so its activations grow layer after layer
/// and the logits explode (PyTorch gives a loss near 80 for resnet50); calibrated, every layer
/// sees normalised inputs as in training, and the loss on random labels sits near ln(1000).
pub fn calibrate_batch_norm(
    plan: &Plan,
    weights: &mut Weights,
    input: &Tensor,
) -> Result<Calibration, BackendError> {
    let threads = default_threads();
    let pool = worker_pool(threads, Vec::new())?;
    let mut session = CpuSession::<f32>::new(
        plan,
        weights,
        pool,
        threads,
        false,
        &Default::default(),
        &mut Donor::default(),
    )?;
    // Calibration normalises with batch statistics, so the steps carry gamma and beta.
    for (step, node) in session.steps.iter_mut().zip(&plan.graph.nodes) {
        if let Step::Affine { scale, shift } = step {
            scale.copy_from_slice(tensor(weights, &node.name, "weight")?);
            shift.copy_from_slice(tensor(weights, &node.name, "bias")?);
        }
    }
    session.calibrate = true;
    session.run(input)?;
    for (id, mean, var) in std::mem::take(&mut session.batch_stats) {
        let name = &plan.graph.nodes[id].name;
        let c = mean.len();
        weights
            .tensors
            .insert(format!("{name}.running_mean"), Tensor::new(vec![c], mean));
        weights
            .tensors
            .insert(format!("{name}.running_var"), Tensor::new(vec![c], var));
    }
    Ok(Calibration(session))
}

/// The FP32 session that calibrated a network's batch norm, on every core. Its packed weights
/// (Winograd transforms, GEMM panels: most of a session's preparation) do not depend on the
/// statistics, so a CPU run of the same network takes them instead of packing them again.
pub struct Calibration(CpuSession<f32>);

impl Calibration {
    /// The CPU backend's session for `plan` with `opt` on device `dev`, with `weights` (the
    /// weights this calibrated, now with their running statistics): at FP32 it takes over the
    /// packed convolutions that fit its batch (all but the layers whose Winograd tile changes).
    pub fn prepare(
        self,
        dev: usize,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        let mut session = self.0;
        let mut donor = Donor::default();
        if session.plan.graph == plan.graph && opt.precision == Precision::Fp32 {
            donor.0 = std::mem::take(&mut session.steps)
                .into_iter()
                .map(|step| match step {
                    Step::Conv(p) => Some(p),
                    _ => None,
                })
                .collect();
        }
        // Its activations go before the new session allocates.
        drop(session);
        CpuBackend.prepare_with(dev, plan, weights, opt, &mut donor)
    }
}

/// Packed FP32 convolutions by node id, from a session of the same graph, that a new session
/// takes where they fit instead of packing the weights again.
#[derive(Default)]
struct Donor(Vec<Option<PackedConv<f32>>>);

impl Donor {
    /// Node `id`'s packed convolution as `T`, for output `out` run with `tile`, where there is
    /// one and it fits (only FP32 sessions take any).
    fn take<T: Elem>(
        &mut self,
        id: usize,
        tile: Option<winograd::Tile>,
        out: &[usize],
    ) -> Option<PackedConv<T>> {
        let packed = self.0.get_mut(id)?.take()?.for_output(tile, out)?;
        let packed: Box<dyn std::any::Any> = Box::new(packed);
        packed.downcast::<PackedConv<T>>().ok().map(|p| *p)
    }
}

fn kernel_name<T: Elem>(step: &Step<T>, op: &Op) -> String {
    match step {
        Step::Conv(p) => p.kernel_name(),
        Step::Affine { .. } => format!("batch_norm_affine_{}", T::SUFFIX),
        Step::Input => format!("nchw_to_nhwc_{}", T::SUFFIX),
        _ => format!("{}_{}", op.kind_name(), T::SUFFIX),
    }
}

impl<T: Elem> Session for CpuSession<T> {
    fn run(&mut self, input: &Tensor) -> Result<(), BackendError> {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.forward(input))
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        // The CPU runs synchronously: `run` returns when the work is done.
        Ok(())
    }

    fn read_output(&mut self) -> Result<Tensor, BackendError> {
        let out = self
            .output
            .as_ref()
            .ok_or_else(|| BackendError::Invalid("no forward pass has run yet".into()))?;
        let shape = self.plan.output_shape().to_vec();
        let mut data = vec![0f32; out.len()];
        if let [n, c, h, w] = *shape.as_slice() {
            let xs = Nhwc { n, h, w, c };
            let mut nchw = vec![T::default(); out.len()];
            kernels::nhwc_to_nchw(out, xs, &mut nchw);
            T::widen(&nchw, &mut data);
        } else {
            T::widen(out, &mut data);
        }
        Ok(Tensor::new(shape, data))
    }

    fn kernel_times(&mut self) -> Option<Vec<KernelTime>> {
        self.profile.then(|| self.times.clone())
    }

    fn memory(&self) -> MemoryStats {
        MemoryStats {
            weights: self.weight_bytes,
            peak_activations: self.peak_bytes,
            peak: self.weight_bytes + self.peak_bytes,
        }
    }

    fn replay(&self) -> Result<String, String> {
        Err(
            "the CPU backend runs every pass itself, synchronously, on a persistent thread pool \
             with buffers recycled from the first pass: there are no launches to record"
                .into(),
        )
    }

    fn kernel_version(&self) -> String {
        let tiles = match &self.split {
            Some(s) => format!(
                ", batch tiles of {}",
                s.describe(self.plan.batch(), |id| self.names[id].clone())
            ),
            None => String::new(),
        };
        format!(
            "workshop-cpu {} (sgemm {}, {}{tiles})",
            env!("CARGO_PKG_VERSION"),
            sgemm::kernel_name(),
            T::PRECISION
        )
    }
}

/// CPUID's extended leaf 0x8000_0006 (ECX: the L2 cache, EDX: the L3 on AMD), where the CPU
/// has it.
pub(crate) fn cache_leaf() -> Option<(u32, u32)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 0x8000_0006 is read only where the
        // highest extended leaf (leaf 0x8000_0000's EAX) includes it.
        #[allow(unused_unsafe)]
        unsafe {
            if __cpuid(0x8000_0000).eax >= 0x8000_0006 {
                let leaf = __cpuid(0x8000_0006);
                return Some((leaf.ecx, leaf.edx));
            }
        }
    }
    None
}

/// `len` copies of `T::default()` in memory that Linux is asked to back with 2 MiB pages
/// (transparent huge pages, which Debian's kernels give only to memory a program asks them
/// for): the packed weights and the activations, tens of MB streamed every pass, then take
/// one TLB entry per 2 MiB instead of 512. ResNet-50 FP32 at batch 8 on a Zen 5 VM: +1.0%
/// (10 interleaved runs, 9 of them faster), start-up unchanged. The advice is given before
/// the first write, which is when the pages are made.
pub(crate) fn big_buffer<T: Default + Clone>(len: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = v.as_mut_ptr() as usize;
        let end = start + len * std::mem::size_of::<T>();
        let (a0, a1) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if a1 > a0 {
            // SAFETY: advice on whole pages inside this allocation; it changes how they will
            // be backed, never what they hold. A kernel without huge pages refuses it, which
            // changes nothing.
            unsafe { libc::madvise(a0 as *mut libc::c_void, a1 - a0, libc::MADV_HUGEPAGE) };
        }
    }
    v.resize(len, T::default());
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::zoo;
    use winograd::Tile;

    /// A pass whose first layers run a tile of images at a time gives the whole batch's
    /// outputs bit for bit: each image's values are its own, whatever else is in the call.
    /// Cuts after a downsampling block and after the stem's pooling, tiles of 1, 2 and 3
    /// images (the last part of 5 is 1 or 2), three nested levels, FP32 and BF16.
    #[test]
    fn batch_tiles_change_nothing() {
        fn check<T: Elem>(graph: &crate::model::Graph, weights: &Weights) {
            let plan = graph.plan(5, 32, 32).unwrap();
            let input = Tensor::new(
                plan.input_shape().to_vec(),
                (0..plan.input_shape().iter().product::<usize>())
                    .map(|i| ((i * 7919) % 997) as f32 / 997.0 - 0.5)
                    .collect(),
            );
            let pool = worker_pool(2, Vec::new()).unwrap();
            let mut session = CpuSession::<T>::new(
                &plan,
                weights,
                pool,
                2,
                false,
                &Default::default(),
                &mut Donor::default(),
            )
            .unwrap();
            session.split = None;
            session.run(&input).unwrap();
            let whole = session.read_output().unwrap();
            let cases: [&[(&str, usize)]; 4] = [
                &[("layer2.1.relu", 2)],
                &[("maxpool", 1)],
                &[("layer2.1.relu", 3)],
                &[
                    ("layer1.0.relu", 1),
                    ("layer1.1.relu", 2),
                    ("layer2.1.relu", 4),
                ],
            ];
            for asked in cases {
                session.split = Some(split::at(&plan, asked).unwrap());
                for _ in 0..2 {
                    session.run(&input).unwrap();
                    let tiled = session.read_output().unwrap();
                    assert_eq!(tiled.shape, whole.shape);
                    let same = (tiled.data.iter().zip(&whole.data))
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} in tiles {asked:?}", T::PRECISION);
                }
            }
            let refused = |asked: &[(&str, usize)]| split::at(&plan, asked).is_err();
            assert!(
                refused(&[("layer2.1.conv1", 2)]),
                "the block's input is live"
            );
            assert!(
                refused(&[("layer2.1.relu", 2), ("layer1.1.relu", 4)]),
                "out of order"
            );
            assert!(
                refused(&[("layer1.1.relu", 2), ("layer2.1.relu", 2)]),
                "tiles not growing"
            );
        }
        let graph = zoo::build("resnet18").unwrap();
        let weights = Weights::init(&graph, 3);
        check::<f32>(&graph, &weights);
        check::<bf16>(&graph, &weights);
    }

    /// A session's packed convolutions go to a new session where its layer runs as they were
    /// packed (another batch, the same Winograd tile or none), and only to FP32 sessions.
    #[test]
    fn donor_gives_only_what_fits() {
        let graph = zoo::build("resnet18").unwrap();
        let weights = Weights::init(&graph, 1);
        // At 32 px, layer1 is 8×8: F(4×4) from batch 4 up, F(2×2) below.
        let at = |batch| graph.plan(batch, 32, 32).unwrap();
        let donor = || {
            let plan = at(4);
            let pool = worker_pool(1, Vec::new()).unwrap();
            let session = CpuSession::<f32>::new(
                &plan,
                &weights,
                pool,
                1,
                false,
                &Default::default(),
                &mut Donor::default(),
            )
            .unwrap();
            let convs = session.steps.into_iter().map(|s| match s {
                Step::Conv(p) => Some(p),
                _ => None,
            });
            Donor(convs.collect())
        };
        let id = |name: &str| graph.nodes.iter().position(|n| n.name == name).unwrap();
        let (winograd, stem) = (id("layer1.0.conv1"), id("conv1"));
        let shape = |batch: usize, node: usize| at(batch).shapes[node].clone();
        let tile = |p: &PackedConv<f32>| p.winograd.as_ref().map(|w| w.tile());

        let mut d = donor();
        let taken = d.take::<f32>(winograd, Some(Tile::F4), &shape(8, winograd));
        assert_eq!(taken.as_ref().map(tile), Some(Some(Tile::F4)));
        assert!(
            d.take::<f32>(winograd, Some(Tile::F4), &shape(8, winograd))
                .is_none(),
            "taken once only"
        );
        let stem_conv = d.take::<f32>(stem, None, &shape(8, stem));
        assert_eq!(stem_conv.as_ref().map(tile), Some(None));

        let mut d = donor();
        assert!(
            d.take::<f32>(winograd, Some(Tile::F2), &shape(2, winograd))
                .is_none(),
            "packed for F(4×4), asked for F(2×2)"
        );
        assert!(
            d.take::<f32>(stem, Some(Tile::F2), &shape(2, stem))
                .is_none()
        );
        assert!(
            donor()
                .take::<f16>(winograd, Some(Tile::F4), &shape(4, winograd))
                .is_none(),
            "FP32 packing for an FP16 session"
        );
    }
}

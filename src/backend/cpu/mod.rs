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
//!   `vdpbf16ps` ([`bf16_gemm`]) where the CPU has them and they pay (a start-up probe decides,
//!   [`probe`]; Winograd instead on 3×3 layers with many tiles), else widen to FP32; FP16
//!   weights are widened in registers by the GEMM tiles.
//! - Depthwise convolutions, pooling, batch norm (an affine map), ReLU, adds, softmax: direct
//!   loops vectorised for the widest SIMD in use ([`simd`]); element-wise ops work in place
//!   where their input is not read again.
//! - Where the early activations of a batch outgrow the last-level cache, the layers up to a
//!   block's output run a few images at a time ([`batch_tiles`]), then the images are joined.
//!
//! `WORKSHOP_CPU_SIMD` forces a lesser SIMD path and `WORKSHOP_CPU_SPLIT` the batch tiles, to
//! test or time them.

pub mod amx;
pub mod batch_tiles;
pub mod bf16_gemm;
mod calibration;
pub mod ceiling;
mod decoder;
mod device;
pub mod elem;
pub mod kernels;
pub mod probe;
mod session;
pub mod sgemm;
pub mod simd;
pub mod winograd;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};
use rayon::prelude::*;

use super::{
    Backend, BackendError, BackendKind, DecoderOptions, DecoderSession, DeviceInfo, ExecOptions,
    KernelTime, MemoryStats, Session, StreamTimes, Theoretical,
};
use crate::model::op::{Op, Pool};
use crate::model::{Plan, Precision, Tensor, Weights};
use elem::Elem;
use kernels::{Nhwc, PackedConv, PackedLinear};

use calibration::Donor;
pub use calibration::{Calibration, calibrate_batch_norm};
pub(crate) use device::{Lines, big_buffer, cache_leaf, give_back_freed};
pub use device::{available_memory, cpu_features, host_device};
use session::CpuSession;

pub struct CpuBackend;

/// A hash of the CPU backend's source, for the caches of choices measured on its kernels (the
/// start-up probes' `simd.json`, `--compile max-autotune`'s `autotune.json`): a binary built
/// from changed kernels measures again instead of trusting what the old ones did. Every file
/// of this folder is in it; a new file belongs in the list.
pub fn source_hash() -> u64 {
    static HASH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *HASH.get_or_init(|| {
        macro_rules! sources {
            ($($file:literal),* $(,)?) => { [$(&include_bytes!($file)[..]),*] };
        }
        let files = sources!(
            "amx.rs",
            "batch_tiles.rs",
            "bf16_gemm.rs",
            "calibration.rs",
            "ceiling.rs",
            "decoder.rs",
            "device.rs",
            "elem.rs",
            "mod.rs",
            "probe.rs",
            "session.rs",
            "simd.rs",
            "winograd.rs",
            "kernels/activation.rs",
            "kernels/conv.rs",
            "kernels/decoder.rs",
            "kernels/depthwise.rs",
            "kernels/direct.rs",
            "kernels/elementwise.rs",
            "kernels/grouped.rs",
            "kernels/im2col.rs",
            "kernels/layout.rs",
            "kernels/linear.rs",
            "kernels/mod.rs",
            "kernels/pool.rs",
            "kernels/stem.rs",
            "kernels/transformer.rs",
            "sgemm/mod.rs",
            "sgemm/tiles.rs",
        );
        crate::files::stable_hash(&files.concat())
    })
}

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
        weights: Cow<'_, Weights>,
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
            weights: Cow<'_, Weights>,
            pool: Arc<rayon::ThreadPool>,
            threads: usize,
            opt: &ExecOptions,
            donor: &mut Donor,
        ) -> Result<Box<dyn Session>, BackendError> {
            let session = CpuSession::<T>::new(plan, weights, pool, threads, opt, donor)?;
            Ok(Box::new(session))
        }
        match opt.precision {
            Precision::Fp32 => boxed::<f32>(plan, weights, pool, threads, opt, donor),
            Precision::Fp16 => boxed::<f16>(plan, weights, pool, threads, opt, donor),
            Precision::Bf16 => boxed::<bf16>(plan, weights, pool, threads, opt, donor),
        }
    }
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    /// The FMA ceiling, for FP32 and the precisions widened to it (FP16; BF16 without bf16
    /// pairs); BF16 on `vdpbf16ps` or AMX's tiles, that instruction's own.
    fn ceiling(
        &self,
        device: &DeviceInfo,
        workers: Option<usize>,
        precision: Precision,
    ) -> Option<Theoretical> {
        let cores = workers.or(device.compute_units).unwrap_or(1);
        if precision == Precision::Bf16 && simd::simd() >= simd::Simd::Avx512Bf16 {
            return ceiling::bf16_ceiling(cores);
        }
        let mut fmas = ceiling::ceiling(&device.features, cores)?;
        // Where the probe chose the FMAs over the CPU's bf16 pairs, say why.
        if let Some(p) = simd::probed().filter(|p| !p.pay() && precision == Precision::Bf16) {
            fmas.how.push_str(&format!("; {}", p.describe()));
        }
        Some(fmas)
    }

    fn ceiling_now(
        &self,
        device: &DeviceInfo,
        workers: Option<usize>,
        precision: Precision,
        seconds: f64,
    ) -> Option<f64> {
        let cores = workers.or(device.compute_units).unwrap_or(1);
        simd::ceiling_now(cores, seconds, precision == Precision::Bf16)
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

    /// The batch splits worth timing ([`batch_tiles::candidates`]), named as
    /// `WORKSHOP_CPU_SPLIT` takes them; none where that variable decides.
    fn schedules(&self, plan: &Plan, opt: &ExecOptions) -> Vec<String> {
        let decided =
            crate::settings::get().is_ok_and(|s| s.cpu_split != crate::settings::SplitChoice::Auto);
        if decided {
            return Vec::new();
        }
        let elem = opt.precision.bytes();
        let found = batch_tiles::candidates(plan, elem, batch_tiles::last_level_cache());
        let names: Vec<String> = (found.iter())
            .map(|s| schedule_name(plan, s.as_ref()))
            .collect();
        if names.len() < 2 { Vec::new() } else { names }
    }

    fn stream(
        &self,
        _dev: usize,
        n: usize,
        iterations: usize,
        threads: Option<usize>,
    ) -> Result<StreamTimes, BackendError> {
        probe_pool(threads)?.install(|| {
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
        self.prepare_with(
            dev,
            plan,
            Cow::Borrowed(weights),
            opt,
            &mut Donor::default(),
        )
    }

    fn prepare_owned(
        &self,
        dev: usize,
        plan: &Plan,
        weights: Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        self.prepare_with(dev, plan, Cow::Owned(weights), opt, &mut Donor::default())
    }

    fn prepare_decoder(
        &self,
        dev: usize,
        weights: &crate::model::llm::DecoderWeights,
        opt: &DecoderOptions,
    ) -> Result<Box<dyn DecoderSession>, BackendError> {
        if dev != 0 {
            return Err(BackendError::NoDevice {
                kind: BackendKind::Cpu,
                reason: format!("the CPU backend has one device (0), not {dev}"),
            });
        }
        let threads = opt.threads.unwrap_or_else(default_threads).max(1);
        let cfg = &weights.config;
        // Packed weights, the token table kept apart for lookups, the KV cache, and the f32
        // copy of the largest tensor while it is packed; 10% for the allocator.
        let bytes = opt.precision.bytes() as u64;
        let needed = (cfg.matmul_params() + (cfg.vocab_size * cfg.hidden_size) as u64)
            .saturating_mul(bytes)
            .saturating_add(
                cfg.kv_bytes_per_token(opt.precision)
                    .saturating_mul(opt.batch as u64)
                    .saturating_mul(opt.context as u64),
            )
            .saturating_add((cfg.vocab_size * cfg.hidden_size * 4) as u64)
            .saturating_mul(11)
            / 10;
        let available = available_memory();
        if needed > available {
            // The KV cache grows with the batch; everything else is there at any batch.
            let per_sequence = cfg
                .kv_bytes_per_token(opt.precision)
                .saturating_mul(opt.context as u64)
                .max(1);
            let fixed =
                needed.saturating_sub(per_sequence.saturating_mul(opt.batch as u64) * 11 / 10);
            let fits = (available.saturating_sub(fixed) * 10 / 11 / per_sequence) as usize;
            return Err(BackendError::OutOfMemory {
                needed,
                available,
                suggestion: (fits >= 1 && fits < opt.batch).then_some(fits),
            });
        }
        let pool = worker_pool(threads, Vec::new())?;
        fn boxed<T: Elem>(
            w: &crate::model::llm::DecoderWeights,
            opt: &DecoderOptions,
            pool: Arc<rayon::ThreadPool>,
            threads: usize,
        ) -> Result<Box<dyn DecoderSession>, BackendError> {
            Ok(Box::new(decoder::CpuDecoder::<T>::new(
                w, opt, pool, threads,
            )?))
        }
        match opt.precision {
            Precision::Fp32 => boxed::<f32>(weights, opt, pool, threads),
            Precision::Fp16 => boxed::<f16>(weights, opt, pool, threads),
            Precision::Bf16 => boxed::<bf16>(weights, opt, pool, threads),
        }
    }
}

/// The batch tiles for `plan` at `elem` bytes a value: as `schedule` names them (max-autotune's
/// choice among [`Backend::schedules`], which offers none while `WORKSHOP_CPU_SPLIT` decides;
/// or a compiled run's eager reference, whose tiles change no value, run whole where that
/// variable names the compiled graph's nodes), else as `WORKSHOP_CPU_SPLIT` sets them
/// ([`crate::settings::SplitChoice`]), else [`batch_tiles::plan`] for this CPU's last-level
/// cache.
fn batch_split(
    plan: &Plan,
    elem: usize,
    schedule: Option<&str>,
) -> Result<Option<batch_tiles::Split>, BackendError> {
    use crate::settings::{self, SplitChoice};
    let settings = settings::get().map_err(|e| BackendError::Invalid(e.to_string()))?;
    let (choice, from) = match schedule {
        Some(name) => (
            SplitChoice::parse(name).map_err(BackendError::Invalid)?,
            "the schedule",
        ),
        None => (settings.cpu_split.clone(), settings::CPU_SPLIT),
    };
    match choice {
        SplitChoice::Off => Ok(None),
        SplitChoice::Levels(levels) => batch_tiles::at(plan, &levels)
            .map(Some)
            .map_err(|why| BackendError::Invalid(format!("{from}: {why}"))),
        SplitChoice::Auto => Ok(batch_tiles::plan(
            plan,
            elem,
            batch_tiles::last_level_cache(),
        )),
    }
}

/// A split's schedule name: `WORKSHOP_CPU_SPLIT`'s syntax (`off`, or `NODE:IMAGES,…`).
fn schedule_name(plan: &Plan, split: Option<&batch_tiles::Split>) -> String {
    let Some(split) = split else {
        return "off".into();
    };
    let levels = split.spec(|id| plan.graph.nodes[id].name.clone());
    let levels: Vec<String> = levels.iter().map(|(n, t)| format!("{n}:{t}")).collect();
    levels.join(",")
}

/// The workers of a CPU session opened without `threads`: one per core this process may run
/// on.
pub(crate) fn default_threads() -> usize {
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

/// `pass()` on `pool` with its other workers kept awake until it returns: each waits for the
/// pass's parallel work by taking it (`rayon::yield_now`) in a loop, instead of falling asleep
/// whenever the pass runs serial code for longer than rayon's idle rounds (tens of
/// microseconds) and being woken by a futex for the next parallel loop, a wake-up whose
/// latency on a VM includes an exit to the hypervisor. ONNX Runtime's and OpenMP's workers
/// spin through a run the same way. GPT-2's decode steps on 2 vCPUs took 0.83–1.04× the
/// time with it (14 alternating pairs, median 0.93); see ARCHITECTURE.md. Between passes the
/// workers sleep as before, and a pool with more workers than the machine has cores does not
/// spin.
///
/// A waiting worker that finds no work yields its core (`sched_yield`) instead of spinning on
/// it: where another program wants the core too, a pure spin held it while the pass's own
/// worker, descheduled, was the one everybody waited for. On 2 vCPUs (Emerald Rapids Xeon)
/// with one busy loop on one of them, MobileNetV3-Large FP32 batch 8 (compiled) took 67–71 ms
/// a pass spinning and 46–53 ms yielding (ONNX Runtime under the same load: 48 ms); ResNet-50
/// FP32 batch 1, 96–107 against 75–80 ms. On the idle machine the two were level (8 rounds,
/// median 0.96, inconclusive; GPT-2 decode steps level): with nothing else runnable the yield
/// returns at once.
pub(crate) fn install_awake<R: Send>(
    pool: &rayon::ThreadPool,
    pass: impl FnOnce() -> R + Send,
) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    // Only where every worker has a core: with more workers than cores a spinning worker
    // would hold a core the pass's own worker is waiting for.
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(default_threads);
    let threads = pool.current_num_threads();
    if !(2..=cores).contains(&threads) {
        return pool.install(pass);
    }
    pool.install(|| {
        let done = AtomicBool::new(false);
        let runner = rayon::current_thread_index();
        rayon::scope(|s| {
            for _ in 1..threads {
                s.spawn(|_| {
                    // The pass's own worker can meet one of these while it waits inside the
                    // pass (a join whose other half was stolen): it must not spin there, under
                    // the pass that would end the spinning.
                    if rayon::current_thread_index() == runner {
                        return;
                    }
                    while !done.load(Ordering::Acquire) {
                        if rayon::yield_now() != Some(rayon::Yield::Executed) {
                            // Hand the core to any other thread waiting for it (the pass's own
                            // worker, another program) rather than spin it away.
                            std::thread::yield_now();
                        }
                    }
                });
            }
            // Set however the pass ends: a panic in it would otherwise leave the scope
            // waiting for spinners that never stop.
            struct Done<'a>(&'a AtomicBool);
            impl Drop for Done<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                }
            }
            let _done = Done(&done);
            pass()
        })
    })
}

/// Refuse a plan that cannot fit in the memory available now, before allocating anything, and
/// suggest the largest batch that would.
fn check_memory(plan: &Plan, precision: Precision, threads: usize) -> Result<(), BackendError> {
    let est = plan.memory_estimate(precision);
    // Workers' column scratch (bounded per chunk), plus a 10% margin for the allocator.
    let scratch = (threads as u64) * (kernels::COLUMN_CHUNK_ELEMS as u64 * 4 * 8);
    let needed = (est.weights.saturating_add(est.activations))
        .saturating_add(scratch)
        .saturating_mul(11)
        / 10;
    let available = available_memory();
    if needed <= available {
        return Ok(());
    }
    let room = (available * 10 / 11).saturating_sub(est.weights + scratch);
    let fits = (room / est.activations_per_image.max(1)) as usize;
    Err(BackendError::OutOfMemory {
        needed,
        available,
        // Only a smaller batch is advice (issue 27: the batch that did not fit was suggested).
        suggestion: (fits >= 1 && fits < plan.batch()).then_some(fits),
    })
}

/// The workers of a bandwidth probe: `threads`, or one a core.
fn probe_pool(threads: Option<usize>) -> Result<rayon::ThreadPool, BackendError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .build()
        .map_err(|e| BackendError::Driver(format!("cannot start the worker threads: {e}")))
}

/// Seconds of each of `passes` plain reads of `runs` (after one untimed pass), each pass's
/// sum ([`read_sum`]) judged by `right`: the loads cannot be optimised away unseen, and a
/// wrong sum voids the measurement.
pub(crate) fn timed_reads(
    runs: &[&[u8]],
    passes: usize,
    mut right: impl FnMut(u64) -> bool,
) -> Result<Vec<f64>, BackendError> {
    let mut times = Vec::with_capacity(passes);
    for pass in 0..passes + 1 {
        let t = Instant::now();
        let sum = read_sum(runs);
        let s = t.elapsed().as_secs_f64();
        if !right(sum) {
            return Err(BackendError::WrongResult(
                "a read pass summed wrong values: the measurement is void".into(),
            ));
        }
        if pass > 0 {
            times.push(s);
        }
    }
    Ok(times)
}

/// The wrapping sum of the bytes of `runs` taken as 64-bit words (a run's bytes before its
/// first whole word and after its last one each added as a word of its own), read by the
/// pool's workers in chunks of 2 MiB of all the runs together (a layer's small matrices as
/// well as its large ones keep every worker reading), each chunk as four streams (its
/// quarters) side by side, 8 accumulators a stream (the compiler keeps them in vector
/// registers: the loads, not the adds, set the pace), each stream asking for its lines 4 KiB
/// ahead of its loads, as the GEMM tiles ask for their panels' rows. One stream a worker
/// asked the memory for too little at a time: on an Emerald Rapids Xeon (2 vCPU) it read
/// 12.8–14.6 GB/s where four read 14.7–17.6 in the same minutes, and a decode step on
/// `vdpbf16ps` (two panels of weights in flight a worker) read 114–131% of the one stream's
/// figure. Without the lines asked for ahead, the decode steps still outran the four streams
/// over the same weights (Llama 3.2 1B FP32 on the same VM: 107–111% of 22.0–23.4 GB/s, two
/// runs each way alternating; with them the read reached 25.0–27.9 and the steps 89–94%).
pub(crate) fn read_sum(runs: &[&[u8]]) -> u64 {
    const STREAMS: usize = 4;
    const LANES: usize = 8;
    const AHEAD: usize = 512;
    let mut edges = 0u64;
    let mut chunks = Vec::new();
    for run in runs {
        let (head, words, tail) = bytemuck::pod_align_to::<u8, u64>(run);
        for part in [head, tail] {
            let word = (part.iter().rev()).fold(0u64, |w, &b| (w << 8) | b as u64);
            edges = edges.wrapping_add(word);
        }
        chunks.extend(words.chunks(1 << 18));
    }
    let sum = chunks
        .par_iter()
        .map(|chunk| {
            let quarter = chunk.len() / STREAMS / LANES * LANES;
            let mut acc = [[0u64; LANES]; STREAMS];
            for i in (0..quarter).step_by(LANES) {
                for (s, a) in acc.iter_mut().enumerate() {
                    prefetch_ahead(chunk, s * quarter + i + AHEAD);
                    let block = &chunk[s * quarter + i..s * quarter + i + LANES];
                    for (a, &v) in a.iter_mut().zip(block) {
                        *a = a.wrapping_add(v);
                    }
                }
            }
            let rest = chunk[STREAMS * quarter..]
                .iter()
                .fold(0u64, |a, &v| a.wrapping_add(v));
            acc.iter().flatten().fold(rest, |a, &v| a.wrapping_add(v))
        })
        .reduce(|| 0, u64::wrapping_add);
    sum.wrapping_add(edges)
}

/// Ask for the line of `words[at]` ahead of its loads, where there is one (a hint: it reads
/// nothing and faults on nothing).
#[inline(always)]
fn prefetch_ahead(words: &[u64], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < words.len() {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: prefetching is a hint for any address; this one is inside the slice.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(words.as_ptr().add(at).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (words, at);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session prepared from weights it owns (each layer's f32 tensors freed once packed)
    /// computes what one prepared from borrowed weights does, bit for bit: no layer reads a
    /// tensor an earlier one freed. Every kind of parameter the zoo has (convolutions with
    /// and without Winograd, batch and layer norms, linear layers, attention, windowed
    /// attention, class tokens, positions, layer scales), eager and compiled, FP32 and BF16.
    #[test]
    fn owned_weights_prepare_the_same_session() {
        use crate::model::zoo::{self, MaxVitConfig, VitConfig};
        let vit = VitConfig::small();
        let maxvit = MaxVitConfig::small();
        let cases = [
            (zoo::vit_custom("vit", &vit), 32),
            (
                zoo::convnext_custom("cn", [8, 16, 16, 32], [1, 1, 1, 1], 10),
                64,
            ),
            (
                zoo::swin_custom("swin", (8, [1, 1, 1, 1], [1, 1, 1, 1]), (3, false), 10),
                64,
            ),
            (zoo::maxvit_custom("maxvit", &maxvit, 10), 96),
            (zoo::mobilenet_v3_custom("mnv3", false, 0.5, 10), 64),
            (zoo::build("resnet18").unwrap(), 32),
        ];
        for (graph, size) in cases {
            let weights = Weights::init(&graph, 3);
            let (fused, fused_weights, _) =
                crate::model::passes::optimize(&graph, weights.clone()).unwrap();
            let input = crate::model::Rng::new(4).normal_tensor(vec![2, 3, size, size]);
            for (form, g, w) in [
                ("eager", &graph, &weights),
                ("compiled", &fused, &fused_weights),
            ] {
                let plan = g.plan(2, size, size).unwrap();
                for precision in [Precision::Fp32, Precision::Bf16] {
                    let opt = ExecOptions {
                        precision,
                        threads: Some(2),
                        ..ExecOptions::default()
                    };
                    let output = |mut session: Box<dyn Session>| {
                        session.run(&input).unwrap();
                        session.read_output().unwrap()
                    };
                    let borrowed = output(CpuBackend.prepare(0, &plan, w, &opt).unwrap());
                    let owned = CpuBackend.prepare_owned(0, &plan, w.clone(), &opt);
                    let owned = output(owned.unwrap());
                    let bits = |t: &Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&borrowed),
                        bits(&owned),
                        "{} {form} {precision:?}",
                        graph.name
                    );
                }
            }
        }
    }

    /// A node's release drops its own parameters and nothing else, and counts their bytes.
    #[test]
    fn releasing_a_node_drops_its_parameters_alone() {
        let graph = crate::model::zoo::build("resnet18").unwrap();
        let mut weights = Weights::init(&graph, 1);
        let before = weights.len();
        let node = |name: &str| graph.nodes.iter().find(|n| n.name == name).unwrap();
        // `layer1.0.bn1`: weight, bias, running mean and variance.
        let bn = node("layer1.0.bn1");
        let names: Vec<String> = (bn.op.params().iter())
            .map(|p| crate::model::graph::param_name(&bn.name, p.suffix))
            .collect();
        let bytes: u64 = (names.iter())
            .map(|n| weights.get(n).unwrap().data.len() as u64 * 4)
            .sum();
        assert!(bytes > 0);
        assert_eq!(weights.release(bn), bytes);
        assert!(names.iter().all(|n| !weights.contains(n)));
        assert_eq!(weights.len(), before - names.len());
        let conv = node("layer1.0.conv1");
        assert_eq!(weights.release(conv), 64 * 64 * 9 * 4);
        assert_eq!(weights.len(), before - names.len() - 1);
        assert_eq!(weights.release(conv), 0, "released twice");
    }

    /// The read probe reads every byte (lengths not a whole number of words, blocks or chunks
    /// too) and times the passes asked for.
    #[test]
    fn the_read_probe_reads_every_value() {
        // Every byte counts: one bit flipped anywhere (the first and last bytes, those of a
        // run's partial words, a second chunk's, a second run's) changes the sum. Runs that
        // start and end off the words, short and long ones (two chunks), one run or two.
        let mut bytes: Vec<u8> = (0..(1usize << 21) + 100)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect();
        for (start, len) in [
            (0, 0),
            (3, 5),
            (1, 17),
            (8, 64 * 3 + 5),
            (5, (1 << 21) + 40),
        ] {
            // One run, or the same bytes in two: (first, past the last) of each.
            let (end, third) = (start + len, start + len / 3);
            for cuts in [&[(start, end)][..], &[(start, third), (third, end)]] {
                let sum = |bytes: &[u8]| {
                    let runs: Vec<&[u8]> = cuts.iter().map(|&(a, b)| &bytes[a..b]).collect();
                    read_sum(&runs)
                };
                let base = sum(&bytes);
                for at in [
                    0,
                    len / 3,
                    len / 2,
                    len.saturating_sub(9),
                    len.saturating_sub(1),
                ] {
                    if at >= len {
                        continue;
                    }
                    bytes[start + at] ^= 0x10;
                    let flipped = sum(&bytes);
                    bytes[start + at] ^= 0x10;
                    assert_ne!(flipped, base, "byte {at} of {len} in {} runs", cuts.len());
                }
            }
        }
        // Timed passes, each judged: a sum that is wrong voids them.
        let run: &[u8] = &bytes[..1 << 20];
        let want = read_sum(&[run]);
        let times = timed_reads(&[run], 2, |sum| sum == want).unwrap();
        assert!(
            times.len() == 2 && times.iter().all(|&s| s > 0.0),
            "{times:?}"
        );
        assert!(timed_reads(&[run], 2, |sum| sum != want).is_err());
    }

    /// A pass kept awake does its parallel work on every pool size, and a pass that panics
    /// hands its panic back (the spinners stop) and leaves the pool usable.
    #[test]
    fn awake_passes_finish_their_work_and_their_panics() {
        let squares = |n: u64| (0..n).map(|i| i * i).sum::<u64>();
        for threads in [1, 2, 3] {
            let pool = worker_pool(threads, Vec::new()).unwrap();
            let sum: u64 = install_awake(&pool, || {
                (0..100_000u64).into_par_iter().map(|i| i * i).sum()
            });
            assert_eq!(sum, squares(100_000), "{threads} threads");
            // On a thread of its own, so that a hang fails the test instead of holding it.
            let (tx, rx) = std::sync::mpsc::channel();
            let pool2 = Arc::clone(&pool);
            std::thread::spawn(move || {
                let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    install_awake(&pool2, || -> u64 {
                        let _: u64 = (0..1000u64).into_par_iter().sum();
                        panic!("the pass failed")
                    })
                }));
                tx.send(failed.is_err()).unwrap();
            });
            let failed = rx.recv_timeout(std::time::Duration::from_secs(60));
            assert_eq!(
                failed,
                Ok(true),
                "{threads} threads: the panic did not come back"
            );
            assert_eq!(install_awake(&pool, || squares(10)), squares(10));
        }
    }
}

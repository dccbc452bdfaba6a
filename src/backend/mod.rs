//! The backend seam. `BackendKind` names the backends (CLI, TOML, tables); the `Backend` and
//! `Session` traits carry behaviour; [`open`] is the one place that knows which backends this
//! build has. A backend prepares a whole planned graph once (weights uploaded, kernels chosen),
//! then a `Session` runs it many times; timing and profiling hang off the session.

pub mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decoding;
pub mod gpu;
#[cfg(feature = "hip")]
pub mod hip;
pub mod kernel_files;
#[cfg(feature = "wgpu")]
pub mod webgpu;

use serde::{Deserialize, Serialize};

use crate::model::{Op, Plan, Precision, Tensor, Weights};
use crate::units::human_bytes;

/// Every backend the project knows, whether or not this build has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Our native CPU kernels: always available.
    Cpu,
    /// WGSL kernels through wgpu (Vulkan, Metal, DX12).
    Wgpu,
    /// CUDA kernels through cudarc and NVRTC.
    Cuda,
    /// HIP kernels through hip-sys and hiprtc.
    Hip,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Hip => "hip",
        }
    }
}

/// What the layers above ask of a kind of backend, instead of asking which one it is.
impl BackendKind {
    /// The device is this machine's own CPU: one device whose cores multi-device runs split
    /// into groups, timed with the host's clock, its features listed on the CPU's line.
    pub fn is_host(self) -> bool {
        matches!(self, BackendKind::Cpu)
    }

    /// A pass is enqueued and then waited for (a GPU queue), so the host's time to enqueue it
    /// is a figure of its own; on the host a pass runs to its end before `run` returns.
    pub fn is_asynchronous(self) -> bool {
        !self.is_host()
    }

    /// Kernel times come from the device's timestamps rather than the host's clock.
    pub fn times_on_device(self) -> bool {
        !self.is_host()
    }

    /// The name and version of the GEMM kernels `workshop peak` times, where they can differ
    /// between runs of the same device (the CPU's SIMD paths); empty where the device names
    /// them itself.
    pub fn gemm_kernels(self) -> String {
        match self {
            BackendKind::Cpu => cpu::sgemm::kernel_name(),
            _ => String::new(),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a device is, as `doctor` and records show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub name: String,
    /// Device memory (host RAM for the CPU backend), when known.
    pub memory_bytes: Option<u64>,
    pub driver: Option<String>,
    /// Compute units: cores, SMs or CUs.
    pub compute_units: Option<usize>,
    /// Instruction-set or architecture features that matter for speed (AVX2, FMA, F16C, ...).
    pub features: Vec<String>,
    /// The highest clock the driver reports (GPUs), for the theoretical peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_mhz: Option<u32>,
}

impl DeviceInfo {
    /// Whether this device is the host's own cores under another name: a software GPU
    /// (lavapipe and llvmpipe are wgpu's `Cpu` adapters) or the GPU emulator.
    pub fn is_software(&self) -> bool {
        self.features.iter().any(|f| f == "Cpu" || f == "emulated")
    }
}

/// Which kernels run the GEMM-shaped work (`--kernels`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum KernelFamily {
    /// Our own kernels, on every backend.
    #[default]
    Native,
    /// The vendor's libraries for convolutions and linear layers (cuDNN and cuBLAS on CUDA,
    /// MIOpen and rocBLAS on HIP), ours for the rest.
    Vendor,
}

impl KernelFamily {
    pub fn name(self) -> &'static str {
        match self {
            KernelFamily::Native => "native",
            KernelFamily::Vendor => "vendor",
        }
    }
}

/// Seconds per pass of the memory-bandwidth probe ([`Backend::stream`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StreamTimes {
    /// f32 values per array.
    pub n: usize,
    pub copy_s: Vec<f64>,
    pub triad_s: Vec<f64>,
}

/// How a session should run.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecOptions {
    pub precision: Precision,
    /// CPU worker threads; `None` uses every core.
    pub threads: Option<usize>,
    /// CPU backend: run one worker per listed core, each pinned to its core where the OS
    /// allows (a "device" of a multi-device run is a disjoint set of cores).
    pub cores: Option<Vec<usize>>,
    /// Kernel variant per node name, as [`Backend::variants`] names them (`--compile
    /// max-autotune` fills it); nodes not listed use the backend's default.
    pub variants: std::collections::BTreeMap<String, String>,
    /// The whole network's schedule, as [`Backend::schedules`] names it (`--compile
    /// max-autotune` fills it); `None` runs the backend's default.
    pub schedule: Option<String>,
    /// Collect per-kernel times (costs a little per op).
    pub profile: bool,
    /// Our kernels or the vendor library's for GEMM-shaped work.
    pub kernels: KernelFamily,
    /// Record the forward pass once and replay it (`--compile reduce-overhead`): CUDA and HIP
    /// graphs. Backends without a replay run as usual and say why in [`Session::replay`].
    pub replay: bool,
    /// Read GPU kernel files from this directory (`wgsl/`, `gpu/`, `cuda/`, `hip/`) where it
    /// has them, the binary's copies elsewhere ([`kernel_files`]).
    pub kernels_dir: Option<std::path::PathBuf>,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            precision: Precision::Fp32,
            threads: None,
            profile: false,
            kernels: KernelFamily::Native,
            replay: false,
            kernels_dir: None,
            cores: None,
            variants: Default::default(),
            schedule: None,
        }
    }
}

/// The time one kernel (one op of the graph) took in the last forward pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelTime {
    /// The node's module name (`layer1.0.conv1`).
    pub node: String,
    /// The op it computes (`conv2d`, `batch_norm`, ...).
    pub op: String,
    /// The kernel that ran (`conv2d_im2col_gemm_f32`, ...).
    pub kernel: String,
    /// Start, from the start of the forward pass, on the device's clock.
    pub start_ns: u64,
    pub ns: u64,
    /// The other nodes whose work this kernel did along with `node`'s (layers fused at run
    /// time, in graph order; empty for a kernel of one node): the time is theirs too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fused: Vec<String>,
}

/// Device memory of a session, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Weights as the backend stores them (precision and packed layout).
    pub weights: u64,
    /// Most activation and scratch bytes alive at once during a forward pass.
    pub peak_activations: u64,
    /// weights + peak_activations: what the device must hold.
    pub peak: u64,
}

/// What went wrong in a backend, by kind: the course records the kinds that say "this build
/// or machine cannot do it" ([`BackendError::is_unavailable`]) as unavailable instead of failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("the {0} backend is not available in this build (rebuild with `--features {0}`)")]
    NotCompiled(BackendKind),
    #[error("no {kind} device: {reason}")]
    NoDevice { kind: BackendKind, reason: String },
    /// A runtime library or compiler the run needs is not installed (NVRTC, cuBLAS, rocBLAS);
    /// the message says what to install.
    #[error("{0}")]
    MissingLibrary(String),
    /// An op, a precision or a feature this backend or device does not have.
    #[error("{0}")]
    Unsupported(String),
    /// More than the device or our kernels take at once: a buffer binding, a launch grid, a
    /// 32-bit index.
    #[error("{0}")]
    DeviceLimit(String),
    #[error(
        "out of memory: this run needs about {} but {} is available{}",
        human_bytes(*needed),
        human_bytes(*available),
        suggestion.map(|b| format!("; a batch size of {b} would fit")).unwrap_or_default()
    )]
    OutOfMemory {
        needed: u64,
        available: u64,
        suggestion: Option<usize>,
    },
    /// A kernel source failed to compile: its path and the compiler's whole log.
    #[error("compiling `{path}` failed:\n{log}")]
    Compile { path: String, log: String },
    /// A driver or runtime call, a launch or a read-back failed.
    #[error("{0}")]
    Driver(String),
    /// A probe's result failed its own check, so its measurement does not count.
    #[error("{0}")]
    WrongResult(String),
    /// What the backend was asked is wrong: an input shape, a missing weight, an option, a
    /// setting.
    #[error("{0}")]
    Invalid(String),
}

impl From<crate::model::weights::MissingTensor> for BackendError {
    fn from(e: crate::model::weights::MissingTensor) -> Self {
        BackendError::Invalid(e.to_string())
    }
}

impl BackendError {
    /// Whether the failure says this build or machine cannot run the request (not that the
    /// request or the run went wrong): the course records such a step as unavailable.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            BackendError::NotCompiled(_)
                | BackendError::NoDevice { .. }
                | BackendError::MissingLibrary(_)
                | BackendError::Unsupported(_)
                | BackendError::DeviceLimit(_)
        )
    }
}

/// The compute ceiling a device's layers are judged against besides the measured GEMM: on
/// the CPU the FMA throughput of its cores, measured (see `cpu::ceiling`); on a GPU
/// the specification's peak.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Theoretical {
    /// What a measured ceiling is (`FP32 FMA ceiling`), for the line that shows it. Records
    /// from before the field measured only that one.
    #[serde(default = "fma_ceiling_name")]
    pub name: String,
    pub gflops: f64,
    /// How it was found, with its assumptions.
    pub how: String,
    /// Measured on the device (an FMA loop), not computed from a specification.
    #[serde(default)]
    pub measured: bool,
}

fn fma_ceiling_name() -> String {
    "FP32 FMA ceiling".into()
}

pub trait Backend {
    fn kind(&self) -> BackendKind;
    fn devices(&self) -> Vec<DeviceInfo>;
    /// Refuse a plan that cannot fit on device `dev` before anything is allocated.
    fn check_fits(
        &self,
        _dev: usize,
        _plan: &Plan,
        _opt: &ExecOptions,
    ) -> Result<(), BackendError> {
        Ok(())
    }
    /// The compute ceiling of `device` (one of [`Self::devices`]) for arithmetic in
    /// `precision`, on the units that precision multiplies on, running `workers` workers (CPU
    /// threads; the device's own count when `None`): measured where the backend can (a CPU's
    /// FMA units), from the specification elsewhere (a GPU's FP32 lanes, its tensor cores for
    /// FP16 and BF16), `None` where it knows neither.
    fn ceiling(
        &self,
        _device: &DeviceInfo,
        _workers: Option<usize>,
        _precision: Precision,
    ) -> Option<Theoretical> {
        None
    }
    /// One short run, about `seconds` long, of what [`Self::ceiling`] measures (GFLOP/s),
    /// where it is measured on the device: to time just before a kernel of that length, so
    /// that the kernel's share of the ceiling compares two timings made at one clock. `None`
    /// where the ceiling is not measured (a GPU's comes from its specification).
    fn ceiling_now(
        &self,
        _device: &DeviceInfo,
        _workers: Option<usize>,
        _precision: Precision,
        _seconds: f64,
    ) -> Option<f64> {
        None
    }
    /// Memory a run on device `dev` may use now, when the backend knows it.
    fn memory_budget(&self, _dev: usize) -> Option<u64> {
        None
    }
    /// What `--kernels vendor` would run here, in a line for `doctor` (each library's version,
    /// or what to install); `None` where the backend has no vendor family.
    fn vendor_libraries(&self) -> Option<String> {
        None
    }
    /// The kernel variants this backend can run `op` with, for an output of `out` (NCHW):
    /// what max-autotune times. Empty when there is no choice; the first is the default.
    fn variants(&self, _op: &Op, _out: &[usize]) -> Vec<&'static str> {
        Vec::new()
    }
    /// The ways this backend can schedule the whole of `plan` (the CPU's batch tiles), by
    /// name for [`ExecOptions::schedule`]: what max-autotune times on the whole network.
    /// Empty when there is no choice; the first is the default.
    fn schedules(&self, _plan: &Plan, _opt: &ExecOptions) -> Vec<String> {
        Vec::new()
    }
    /// Time a copy (b = a) and a triad (b = a + 0.5·c) over `n` f32 values in device `dev`'s
    /// memory, `iterations` times each after one untimed pass, and check the triad's result.
    /// The backend may use fewer values than asked (a binding limit): `StreamTimes::n` says.
    fn stream(
        &self,
        _dev: usize,
        _n: usize,
        _iterations: usize,
        _threads: Option<usize>,
    ) -> Result<StreamTimes, BackendError> {
        Err(BackendError::Unsupported(format!(
            "the {} backend has no memory-bandwidth probe yet",
            self.kind()
        )))
    }
    /// Upload weights and set up everything a forward pass of `plan` needs on device `dev`.
    fn prepare(
        &self,
        dev: usize,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError>;
    /// [`Backend::prepare`] from weights the caller has no more use for. A backend that keeps
    /// its own copy of each layer's weights (the CPU's packed panels) frees the f32 tensors
    /// layer by layer as it makes them, so the two sets never live whole side by side: ViT-B/16
    /// at FP32 (330 MiB of weights) peaked at 673 MiB resident, its weights twice, now 353 MiB;
    /// VGG-16 (528 MiB, 392 of them one layer's) 1.21 → 1.08 GiB. The others upload from the
    /// borrowed weights.
    fn prepare_owned(
        &self,
        dev: usize,
        plan: &Plan,
        weights: Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        self.prepare(dev, plan, &weights, opt)
    }
    /// Load a decoder's weights on device `dev` and preallocate its KV cache.
    fn prepare_decoder(
        &self,
        _dev: usize,
        _weights: &crate::model::llm::DecoderWeights,
        _opt: &DecoderOptions,
    ) -> Result<Box<dyn DecoderSession>, BackendError> {
        Err(BackendError::Unsupported(format!(
            "the {} backend does not run language models yet",
            self.kind()
        )))
    }
}

/// How a decoder session runs (`Backend::prepare_decoder`).
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderOptions {
    pub precision: Precision,
    /// CPU worker threads; `None` uses every core.
    pub threads: Option<usize>,
    /// Sequences decoded together.
    pub batch: usize,
    /// Positions the KV cache holds per sequence (prompt + generated tokens).
    pub context: usize,
    /// Time each kind of op (`DecoderSession::op_times`).
    pub profile: bool,
    /// Record a decode step once and replay it (`--compile reduce-overhead`; GPU backends).
    pub replay: bool,
    /// Read the GPU kernels from this folder instead of the copies in the binary.
    pub kernels_dir: Option<std::path::PathBuf>,
    /// Rows one forward pass takes at most (vLLM's `max_num_batched_tokens`): a longer
    /// prefill runs in chunks of whole positions, each attending to what the chunks before it
    /// cached. `None`: 2048 on the GPU backends, the whole prefill at once on the CPU.
    pub max_rows: Option<usize>,
}

/// The new tokens per sequence of a step over `tokens` (sequence-major), after checking that
/// they make `batch` equal rows, fit in the `context` the cache holds after `pos`, and are in
/// the vocabulary.
pub fn step_tokens(
    cfg: &crate::model::llm::DecoderConfig,
    batch: usize,
    context: usize,
    pos: usize,
    tokens: &[u32],
) -> Result<usize, BackendError> {
    let new = tokens.len() / batch;
    if new == 0 || tokens.len() != new * batch {
        return Err(BackendError::Invalid(format!(
            "{} token ids do not make {batch} sequences of equal length",
            tokens.len(),
        )));
    }
    if pos + new > context {
        return Err(BackendError::Invalid(format!(
            "{new} more tokens would take the sequences to {} positions; the KV cache holds \
             {context}",
            pos + new,
        )));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(BackendError::Invalid(format!(
            "token id {bad} is outside the vocabulary of {}",
            cfg.vocab_size
        )));
    }
    Ok(new)
}

/// A decode step takes one token per sequence, after a prefill.
fn check_decode(batch: usize, pos: usize, tokens: &[u32]) -> Result<(), BackendError> {
    if tokens.len() != batch {
        return Err(BackendError::Invalid(format!(
            "a decode step takes one token per sequence ({batch}), not {}",
            tokens.len()
        )));
    }
    if pos == 0 {
        return Err(BackendError::Invalid("decode before any prefill".into()));
    }
    Ok(())
}

/// Bytes a decoder session holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecoderMemory {
    /// Weights as the backend stores them (the token table included).
    pub weights: u64,
    /// The KV cache, preallocated for the whole context of every sequence.
    pub kv_cache: u64,
    /// Activations and scratch at the largest step (the prefill), the CPU attention's packed
    /// key and value tiles included.
    pub scratch: u64,
}

/// A prepared decoder on a device: prompts in, one token per sequence per step after, the KV
/// cache kept on the device in between.
pub trait DecoderSession {
    /// One forward pass over `tokens` (`batch` rows of equal length, token ids) from the
    /// current position, adding them to the KV cache; the logits are then those of each row's
    /// last token, or of every token with `all_logits`.
    fn step(&mut self, tokens: &[u32], all_logits: bool) -> Result<(), BackendError>;
    /// Forget the cache: the next step starts at position 0.
    fn rewind(&mut self);
    /// Sequences decoded together.
    fn batch(&self) -> usize;
    /// Run the prompts from position 0, filling the KV cache.
    fn prefill(&mut self, tokens: &[u32], all_logits: bool) -> Result<(), BackendError> {
        self.rewind();
        self.step(tokens, all_logits)
    }
    /// One new token per sequence at the next position.
    fn decode(&mut self, tokens: &[u32]) -> Result<(), BackendError> {
        check_decode(self.batch(), self.position(), tokens)?;
        self.step(tokens, false)
    }
    /// Wait until the device has finished everything enqueued.
    fn sync(&mut self) -> Result<(), BackendError>;
    /// The last step's logits, (rows × vocabulary) in f32.
    fn logits(&mut self) -> Result<Vec<f32>, BackendError>;
    /// Tokens each sequence holds in the cache.
    fn position(&self) -> usize;
    fn memory(&self) -> DecoderMemory;
    /// `passes` plain reads of the weights a decode step streams through (every matrix and
    /// bias the layers and the LM head keep, in their memory, on the session's threads), after
    /// one untimed pass: the bytes one pass reads and each timed pass's seconds. What a decode
    /// step's reads are judged against: the same bytes in the same pages, read as fast as
    /// loads alone go. `None` where the backend has no such read.
    fn read_weights(&mut self, _passes: usize) -> Result<Option<(u64, Vec<f64>)>, BackendError> {
        Ok(None)
    }
    /// Seconds per kind of op since the session started (`linear`, `attention`, ...), when
    /// profiling was asked for.
    fn op_times(&self) -> Vec<(String, f64)> {
        Vec::new()
    }
    fn kernel_version(&self) -> String;
}

pub trait Session {
    /// Enqueue one forward pass on `input` (NCHW f32, the plan's input shape).
    fn run(&mut self, input: &Tensor) -> Result<(), BackendError>;
    /// Enqueue another forward pass on the input the last `run` copied to the device, without
    /// copying it again, as PyTorch's op benchmarks keep their input on the device: true where
    /// the session keeps its input apart from the activations (the GPU backends), false where
    /// the input must be given again with `run` (the CPU converts it as its first op).
    fn rerun(&mut self) -> Result<bool, BackendError> {
        Ok(false)
    }
    /// Wait until the device has finished everything enqueued.
    fn sync(&mut self) -> Result<(), BackendError>;
    /// The last forward pass's output in f32, in the plan's logical shape.
    fn read_output(&mut self) -> Result<Tensor, BackendError>;
    /// Per-kernel times of the last forward pass, when profiling was asked for.
    fn kernel_times(&mut self) -> Option<Vec<KernelTime>>;
    fn memory(&self) -> MemoryStats;
    /// A short name of the kernel library and version, for records.
    fn kernel_version(&self) -> String;
    /// With [`ExecOptions::replay`]: how this session replays its recorded pass (Ok), or why
    /// it runs every pass as usual (Err).
    fn replay(&self) -> Result<String, String> {
        Err("this backend has no recorded replay".into())
    }
}

/// Open a backend by kind. This is the only function that knows which backends were built.
/// With `WORKSHOP_GPU_EMULATOR=1`, cuda and hip run their kernels on the host CPU instead
/// ([`gpu::emu`], for testing; labelled as such everywhere).
pub fn open(kind: BackendKind) -> Result<Box<dyn Backend>, BackendError> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::new())),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => Ok(Box::new(webgpu::WgpuBackend::new()?)),
        #[cfg(unix)]
        BackendKind::Cuda | BackendKind::Hip if gpu::emu::requested() => {
            Ok(Box::new(gpu::emu::EmuBackend::new(kind)))
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => Ok(Box::new(cuda::CudaBackend::new()?)),
        #[cfg(feature = "hip")]
        BackendKind::Hip => Ok(Box::new(hip::HipBackend::new()?)),
        #[allow(unreachable_patterns)]
        other => Err(BackendError::NotCompiled(other)),
    }
}

/// Every GPU kernel file compiled with every compiler this build and machine have (`workshop
/// dev kernels-check`): NVRTC, hiprtc, and the emulator's host build; `kernels_dir` replaces
/// the embedded sources. A compiler this build lacks is listed as skipped, with why.
pub fn kernels_check(kernels_dir: Option<&std::path::Path>) -> Vec<check::KernelCheck> {
    let mut out = Vec::new();
    #[cfg(feature = "cuda")]
    out.extend(cuda::kernel_checks(kernels_dir));
    #[cfg(not(feature = "cuda"))]
    out.extend(check::skipped(
        "cuda/ops.cu",
        "nvrtc",
        "the cuda backend is not in this build (`--features cuda`)",
    ));
    #[cfg(feature = "hip")]
    out.extend(hip::kernel_checks(kernels_dir));
    #[cfg(not(feature = "hip"))]
    out.extend(check::skipped(
        "hip/ops.hip",
        "hiprtc",
        "the hip backend is not in this build (rebuild with `--features hip`; needs \
         libamdhip64-dev)",
    ));
    out.extend(check::host(kernels_dir));
    out
}

/// Threads per block (workgroup) of the GPU kernels' 1-D launches.
pub const THREADS_PER_BLOCK: u32 = 256;

/// A 1-D launch of `total` threads in blocks (workgroups) of 256, folded into a 2-D grid whose
/// x is at most `max_x`: `[x, y, 1]`. Both GPU kernel sets take their launches this way and
/// unfold the index (`linear_index` in ops.cuh, `index` in the WGSL); y may exceed a device's
/// limit, which each backend checks against its own.
pub fn fold_grid(total: usize, max_x: u32) -> [u32; 3] {
    let blocks = total.div_ceil(THREADS_PER_BLOCK as usize).max(1) as u64;
    let x = blocks.min(max_x.max(1) as u64);
    [x as u32, blocks.div_ceil(x).min(u32::MAX as u64) as u32, 1]
}

/// What the backends would warn about before a run: a setting they cannot honour here (a
/// SIMD path this CPU lacks). The command layer prints them.
pub fn warnings() -> Vec<String> {
    cpu::simd::warning().into_iter().collect()
}

/// A note for a run in `precision` on backend `kind`, where the kernels will not compute in
/// that precision (BF16 on a CPU whose paths widen it to FP32: see
/// [`cpu::simd::bf16_widened`]).
pub fn precision_note(kind: BackendKind, precision: crate::model::Precision) -> Option<String> {
    if kind != BackendKind::Cpu || precision != crate::model::Precision::Bf16 {
        return None;
    }
    let why = cpu::simd::bf16_widened()?;
    Some(format!(
        "note: BF16 values are widened to FP32 for every multiply here ({why}): half the bytes \
         moved, plus conversions; compare with --precision fp32"
    ))
}

/// Refuse `--kernels vendor` on a backend without a vendor library.
pub fn native_only(kind: BackendKind, opt: &ExecOptions) -> Result<(), BackendError> {
    match opt.kernels {
        KernelFamily::Native => Ok(()),
        KernelFamily::Vendor => Err(BackendError::Unsupported(format!(
            "the {kind} backend has only our own kernels: --kernels vendor is for cuda (cuDNN, \
             cuBLAS) and hip (MIOpen, rocBLAS)"
        ))),
    }
}

/// The largest attention head the GPU attention kernels hold in registers (ViT-H's is 80).
pub(crate) const MAX_ATTENTION_HEAD: usize = 128;

/// Refuses an attention layer whose heads are larger than the GPU kernels hold.
pub(crate) fn check_attention_head(
    node: &str,
    dim: usize,
    heads: usize,
) -> Result<(), BackendError> {
    let head = dim / heads.max(1);
    if head > MAX_ATTENTION_HEAD {
        return Err(BackendError::Unsupported(format!(
            "`{node}`: heads of {head} values are more than the attention kernel holds ({MAX_ATTENTION_HEAD})"
        )));
    }
    Ok(())
}

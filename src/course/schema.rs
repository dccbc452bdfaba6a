//! The exercise file format, as instructors write it: one TOML file per exercise. Every field
//! is documented here, on the struct that reads it; unknown fields are refused, so a typo is
//! an error with its file:line:col rather than a silently ignored setting.
//!
//! ```toml
//! format_version = 1
//! id = "02-precision"
//! title = "Precision: FP32 vs FP16"
//! chapter = "02-precision.md"
//! requires = ["01-baseline"]
//!
//! [[step]]
//! id = "fp16"
//! kind = "bench"
//! say = "Same network and batch, half precision."
//! bench = { network = "resnet50", batch_size = 32, precision = "fp16" }
//!
//! [[step.expect]]
//! metric = "throughput"
//! per = "fp32.throughput"     # a ratio to an earlier step's metric
//! min = 1.3
//! backend = [{ backend = "cpu", min = 0.5 }]                # per backend
//! device = [{ glob = "*H100*", backend = "cuda", min = 1.05 }]  # per device (and backend)
//! hint = "No speedup? Does your device do FP16 natively? See `workshop doctor`."
//! ```

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::backend::BackendKind;
use crate::model::Precision;

/// The format version this build reads.
pub const FORMAT_VERSION: u32 = 1;

/// One exercise: a titled, ordered list of steps with a book chapter.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exercise {
    /// Version of the file format; this build reads 1.
    pub format_version: Spanned<u32>,
    /// Unique id, `NN-name`; the number orders the course.
    pub id: Spanned<String>,
    /// Title shown in `list`, `status` and the results file.
    pub title: String,
    /// The exercise's page in the book, relative to `book/src/`.
    pub chapter: Spanned<String>,
    /// Exercises to finish (or skip) first.
    #[serde(default)]
    pub requires: Vec<Spanned<String>>,
    /// One or two sentences: what the student will learn.
    #[serde(default)]
    pub summary: String,
    /// The steps, run in order by `workshop next`.
    #[serde(rename = "step")]
    pub steps: Vec<Step>,
}

/// What a step does. The metrics each kind records, with their units, meaning and whether they
/// are timings, are the table in [`crate::course::metrics::METRICS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// Report the machine (`workshop doctor`) and record its fingerprint.
    Doctor,
    /// One benchmark run (needs `bench`).
    Bench,
    /// A benchmark over a list of values of one parameter, giving a table (needs `sweep`).
    Sweep,
    /// One forward pass at `bench.precision` against FP32 on the same input: max logit
    /// difference and top-1 agreement (needs `bench`).
    Accuracy,
    /// Values derived from earlier steps (needs `derive`).
    Compare,
    /// A question whose answer is recorded and, where `question.correct` says how, checked
    /// against the student's own measurements (needs `question`).
    Question,
    /// The machine's measured limits (`workshop peak`): `gemm_gflops`; `ceiling_gflops`, the
    /// FP32 compute ceiling above it where the device gives one (a CPU's FMA throughput,
    /// measured on registers; a CUDA GPU's specification peak); and the memory bandwidth
    /// probe's `copy_gbps` and `triad_gbps`. Later expectations can be a fraction of them
    /// (`metric = "gflops"`, `per = "peak.gemm_gflops"`). Optional `peak` section.
    Peak,
    /// A benchmark with every kernel timed and a FLOPs profile of its last timed iteration
    /// (needs `bench`; optional `profile` section). Besides the bench metrics it gives
    /// `device_ms`, `cpu_overhead`, `efficiency` (of the measured peak), `intensity`,
    /// `peak_gflops` and, where bandwidth is measured, `balance`; per top-level module of the
    /// network (`layer1`, `fc`, ...) `MODULE.latency_ms`, `MODULE.latency_pct`,
    /// `MODULE.gflops` and `MODULE.intensity`; per op kind `op.KIND.time_pct` (`op.conv2d.time_pct`).
    Profile,
    /// Compare the records of earlier bench or profile steps of this exercise (the course keeps
    /// each run's record in the workspace's `records/`), like `workshop compare`, and draw them
    /// into `charts/` (needs `chart`). For every compared step after the first it gives
    /// `STEP.ratio` (throughput against the first), and `STEP.faster`, `STEP.slower`,
    /// `STEP.unclear` (1 for the verdict that applies, else 0); and `warnings`.
    Chart,
    /// A language model's generation (needs `bench` naming one of `workshop models`' language
    /// models, with `prompt_len`, `gen_len`, `batch_size`; optional `sweep` over `batch_size`
    /// or `prompt_len`): `ttft_ms`, `tpot_ms`, `prefill_tokens_per_s`, `decode_tokens_per_s`,
    /// `decode_gbps` and `bandwidth_pct` (of the measured bandwidth), `prefill_gflops` and
    /// `peak_pct` (of the GEMM peak), `kv_bytes_per_token`, `kv_cache_mib`, `cv`; a sweep
    /// records its last value's and `scaling`, `tpot_growth`, `ttft_growth` (last / first).
    Llm,
    /// Write a kernel (needs `kernel` and `bench`): the student edits a kernel file in the
    /// workspace's `kernels/` (copied there from the course's deliberately slow start the first
    /// time), and the step checks that it compiles, then that it gives the engine's own kernel's
    /// output, then times it against the start and the engine's kernel, interleaved: `correct`,
    /// `max_abs_diff`, `kernel_ms`, `start_ms`, `engine_ms`, `speedup` (start / yours),
    /// `vs_engine` (engine / yours) and `cv`. `workshop next` stays on the step until it passes
    /// (`workshop watch` runs it again on every save); then the solution is written next to it.
    Kernel,
    /// Text only.
    Note,
}

impl StepKind {
    /// Whether the step measures something (takes time and loads the machine), rather than
    /// printing, deriving or asking: only these ask "Run this step now?" on a terminal.
    pub fn measures(self) -> bool {
        matches!(
            self,
            StepKind::Bench
                | StepKind::Sweep
                | StepKind::Accuracy
                | StepKind::Peak
                | StepKind::Profile
                | StepKind::Llm
                | StepKind::Kernel
        )
    }
}

/// One step of an exercise.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// Unique within the exercise; other steps refer to its metrics as `ID.metric`.
    pub id: Spanned<String>,
    pub kind: StepKind,
    /// What to tell the student before the step runs (why it matters, what to look for).
    pub say: String,
    /// The run, for `bench` and `accuracy` steps (and the base run of a `sweep`).
    pub bench: Option<Spanned<BenchSpec>>,
    /// The parameter list of a `sweep` step.
    pub sweep: Option<Spanned<SweepSpec>>,
    /// Derived values of a `compare` step.
    #[serde(default)]
    pub derive: Vec<Spanned<Derive>>,
    /// The prompt of a `question` step.
    pub question: Option<Spanned<Question>>,
    /// Sizes of a `peak` step (defaults: a 1024³ GEMM, 10 iterations, 256 MiB arrays).
    pub peak: Option<Spanned<PeakSpec>>,
    /// What a `profile` step prints.
    pub profile: Option<Spanned<ProfileSpec>>,
    /// The steps a `chart` step compares.
    pub chart: Option<Spanned<ChartSpec>>,
    /// The kernel a `kernel` step has the student write.
    pub kernel: Option<Spanned<KernelSpec>>,
    /// Timing expectations are inconclusive (not failed) when the run's coefficient of
    /// variation is above this (e.g. 0.10 for 10%): the machine was too noisy to judge.
    /// Unset, 0.15 (`expect::DEFAULT_MAX_CV`).
    pub max_cv: Option<f64>,
    /// What to check in the step's results.
    #[serde(default, rename = "expect")]
    pub expects: Vec<Spanned<Expect>>,
    /// Shown by `workshop hint` while this step is current.
    pub hint: Option<String>,
    /// The backends the step means something on (empty: all). Elsewhere it is recorded as
    /// unavailable, not applicable there, without running (a launch-overhead question on a
    /// CPU, whose host is its device).
    #[serde(default)]
    pub backends: Vec<BackendKind>,
}

/// A benchmark run, with the same meaning as the `workshop bench` flags. Missing fields take
/// the bench defaults; the backend and device are the workspace's (set at `init`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BenchSpec {
    pub network: Option<String>,
    pub batch_size: Option<usize>,
    pub iterations: Option<usize>,
    pub warmup: Option<usize>,
    pub precision: Option<Precision>,
    pub input_size: Option<usize>,
    /// Data parallel over these devices (`all`, or indices `0,1`): `batch_size` is then the
    /// global batch. Metrics add `scaling_efficiency`, `spread`, `devices`, `single_throughput`.
    pub devices: Option<String>,
    /// Data parallel over this many groups of CPU cores (CPU backend; wins over `devices`).
    pub cpu_groups: Option<usize>,
    /// `native` (our kernels, the default) or `vendor` (the vendor libraries for convolutions
    /// and linear layers: cuDNN and cuBLAS on cuda, MIOpen and rocBLAS on hip). Backends
    /// without one record the step as unavailable.
    pub kernels: Option<crate::backend::KernelFamily>,
    /// Graph compilation (`default`, `reduce-overhead`, `max-autotune`); metrics then add
    /// `compile_s`, `rel_diff` (against eager FP32) and `memory_saved` (fraction of the plan),
    /// for max-autotune `autotune_timed` and `autotune_cached` (layer shapes), and for
    /// reduce-overhead `replayed` (1 when the pass is recorded and replayed, 0 when the backend
    /// runs it as usual). Asynchronous backends also record `enqueue_us` (host time per pass).
    pub compile: Option<crate::bench::record::CompileMode>,
    /// `pytorch`: PyTorch eager timed the same way (recorded unavailable where Python has no
    /// PyTorch); default our kernels.
    pub framework: Option<crate::bench::framework::Framework>,
    /// An MLPerf scenario instead of the timed loop (`single-stream`, `offline`, `server`;
    /// `batch_size` is then the largest batch): metrics add `p50_ms`, `queue_p99_ms`,
    /// `compute_p99_ms`, `mean_batch` and, for a server, `best_qps`.
    pub scenario: Option<crate::bench::scenario::Scenario>,
    /// Scenarios: queries per run, at least.
    pub queries: Option<usize>,
    /// Scenarios: seconds a run lasts at least on its clock.
    pub duration_s: Option<f64>,
    /// Server: the p99 latency bound, ms.
    pub latency_bound_ms: Option<f64>,
    /// Server: how long the first query of a batch waits for others, ms.
    pub batch_timeout_ms: Option<f64>,
    /// Server: a fixed rate instead of the search.
    pub qps: Option<f64>,
    /// Language models (`llm` steps): prompt tokens per sequence.
    pub prompt_len: Option<usize>,
    /// Language models: tokens generated per sequence, the first by the prefill.
    pub gen_len: Option<usize>,
    /// Overrides that apply when the workspace computes on the host's cores (the CPU backend,
    /// a software GPU such as lavapipe, the GPU emulator), so a step that takes a few seconds on
    /// a GPU stays well under a minute on a laptop (e.g. a smaller batch).
    pub cpu: Option<Box<BenchSpec>>,
}

/// The kernel a `kernel` step has the student write. It runs on the wgpu backend (WGSL):
/// the workspace's device when the workspace is on wgpu, else wgpu's first adapter — on a
/// machine without a GPU, Mesa's lavapipe, which runs WGSL on the CPU's cores.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelSpec {
    /// The kernel file the student edits, by its path under kernels/ (`wgsl/depthwise.wgsl`):
    /// the workspace's copy is laid over the engine's (`--kernels-dir`).
    pub file: String,
    /// The deliberately slow version the student starts from, by its path under the course's
    /// `exercises/` (`start/depthwise.wgsl`).
    pub start: String,
    /// The entry point whose kernel time is compared (`depthwise`): the device's timestamps of
    /// every launch of it in a pass, summed.
    pub entry: String,
    /// How many times faster than the start the student's kernel must be to pass.
    pub speedup: f64,
}

/// A sweep: the step's `bench` run once per value of `param`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepSpec {
    /// `batch_size` or `input_size` (`sweep` steps); `batch_size` or `prompt_len` (`llm` steps).
    pub param: SweepParam,
    pub values: Vec<usize>,
    /// Values to use instead where the workspace computes on the host's cores (as `cpu`).
    pub cpu_values: Option<Vec<usize>>,
    /// Published times to set the sweep's next to (a paper's table): `ms[i]` belongs to
    /// `values[i]`; the first reference is the one the others and the student's are
    /// compared against, as such tables are.
    #[serde(default)]
    pub reference: Vec<Reference>,
    /// The batch the published times were measured at (default: the step's batch); the
    /// student's times at another batch are scaled to it, and the table says so.
    pub reference_batch: Option<usize>,
}

/// One row of a published table: whose time, where (`CUDA.jl, A100`), per sweep value.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reference {
    pub label: String,
    pub ms: Vec<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SweepParam {
    BatchSize,
    InputSize,
    /// A language model's prompt (`llm` steps).
    PromptLen,
}

impl SweepParam {
    /// How a table's header names it.
    pub fn label(self) -> &'static str {
        match self {
            SweepParam::BatchSize => "batch size",
            SweepParam::InputSize => "input size",
            SweepParam::PromptLen => "prompt tokens",
        }
    }
}

/// The probe of a `peak` step.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakSpec {
    /// GEMM size (M = N = K).
    pub size: Option<usize>,
    pub iterations: Option<usize>,
    pub precision: Option<Precision>,
    /// Size of each bandwidth array, in MiB.
    pub array_mib: Option<usize>,
    /// Overrides where the workspace computes on the host's cores (as a bench's `cpu`).
    pub cpu: Option<Box<PeakSpec>>,
}

/// The runs a `chart` step compares: ids of earlier bench or profile steps of the exercise,
/// the first being the reference.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChartSpec {
    pub steps: Vec<String>,
}

/// What a `profile` step prints (it records every metric either way).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    /// Deepest level of the module tree in the whole profile (default 1: the network's
    /// top-level modules). The step shows a summary (operators, the top-level modules, the
    /// slowest layers); the whole profile goes to `profiles/EX.STEP.txt` (`--verbose` prints it).
    pub depth: Option<usize>,
    /// Rows of the operator, kernel and slowest-layer tables (default 10; the summary shows
    /// at most 5 slowest layers).
    pub top: Option<usize>,
    /// Also write the profiled iterations as a Chrome trace and the kernel table as a
    /// rocprof-style CSV into the workspace's `profiles/` folder, and show the kernel table in
    /// the step's summary (a step about kernels).
    #[serde(default)]
    pub files: bool,
}

/// A value computed from earlier steps' metrics: `numerator / denominator`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Derive {
    /// The metric's name in this step (`speedup`, ...).
    pub name: String,
    /// `STEP.metric`.
    pub numerator: String,
    /// `STEP.metric`.
    pub denominator: String,
    /// How to print it: `ratio` (1.84×) or `percent` (84.0%); default `ratio`.
    #[serde(default)]
    pub format: DeriveFormat,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeriveFormat {
    #[default]
    Ratio,
    Percent,
}

/// A multiple-choice question.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Question {
    pub prompt: String,
    pub choices: Vec<String>,
    /// How the right answer follows from the student's data; without it any answer is
    /// recorded as given.
    pub correct: Option<Correct>,
}

/// The right choice is the one with the largest (or smallest) measured value. Either one
/// `metric` of several `steps` (`steps[i]` belongs to `choices[i]`), or a `STEP.metric` per
/// choice in `values` (`values[i]` belongs to `choices[i]`; e.g. `profile.layer1.latency_ms`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Correct {
    #[serde(default)]
    pub metric: String,
    #[serde(default)]
    pub steps: Vec<String>,
    #[serde(default)]
    pub values: Vec<String>,
    /// `max` (default) or `min`.
    #[serde(default)]
    pub pick: Pick,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pick {
    #[default]
    Max,
    Min,
}

/// An expectation on one metric.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// A metric of this step (`throughput`, `median_ms`, `cv`, `loss`, ...) or `STEP.metric`
    /// for an earlier step's.
    pub metric: String,
    /// Divide by this metric (`STEP.metric`): the expectation is then on the ratio.
    pub per: Option<String>,
    /// Range that applies when no `device` entry matches.
    pub min: Option<f64>,
    pub max: Option<f64>,
    /// Ranges keyed by device: the first whose glob matches the device name wins. A device or
    /// backend range with neither `min` nor `max` means "not judged there" (a metric that
    /// device or backend does not measure).
    #[serde(default)]
    pub device: Vec<DeviceRange>,
    /// Ranges keyed by backend (checked after `device`, before the fallback).
    #[serde(default)]
    pub backend: Vec<BackendRange>,
    /// What to try when the expectation fails.
    pub hint: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceRange {
    /// A glob on the device name, e.g. `*A100*` or `AMD Instinct MI2*`.
    pub glob: String,
    /// Only on this backend (a range measured with one backend's kernels); any when absent.
    #[serde(default)]
    pub backend: Option<BackendKind>,
    pub min: Option<f64>,
    pub max: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendRange {
    pub backend: BackendKind,
    pub min: Option<f64>,
    pub max: Option<f64>,
}

impl Correct {
    /// The `STEP.metric` reference of each choice.
    pub fn references(&self) -> Vec<String> {
        if self.values.is_empty() {
            self.steps
                .iter()
                .map(|s| format!("{s}.{}", self.metric))
                .collect()
        } else {
            self.values.clone()
        }
    }
}

impl SweepSpec {
    /// The values to sweep (`cpu_values` where given, on a device that computes on the host's
    /// cores: `host_sized`).
    pub fn values_for(&self, host_sized: bool) -> &[usize] {
        match (host_sized, &self.cpu_values) {
            (true, Some(v)) => v,
            _ => &self.values,
        }
    }
}

impl PeakSpec {
    /// This probe with its CPU overrides applied on a device that computes on the host's
    /// cores (`host_sized`: the CPU backend, a software GPU, the emulator).
    pub fn resolved(&self, host_sized: bool) -> PeakSpec {
        let mut out = self.clone();
        out.cpu = None;
        if let (true, Some(cpu)) = (host_sized, &self.cpu) {
            out.size = cpu.size.or(out.size);
            out.iterations = cpu.iterations.or(out.iterations);
            out.precision = cpu.precision.or(out.precision);
            out.array_mib = cpu.array_mib.or(out.array_mib);
        }
        out
    }
}

impl BenchSpec {
    /// This spec with its CPU overrides applied on a device that computes on the host's cores
    /// (`host_sized`: the CPU backend, a software GPU, the emulator); CPU core groups only on
    /// the CPU backend.
    pub fn resolved(&self, backend: BackendKind, host_sized: bool) -> BenchSpec {
        let mut out = self.clone();
        out.cpu = None;
        if let (true, Some(cpu)) = (host_sized, &self.cpu) {
            out.network = cpu.network.clone().or(out.network);
            out.batch_size = cpu.batch_size.or(out.batch_size);
            out.iterations = cpu.iterations.or(out.iterations);
            out.warmup = cpu.warmup.or(out.warmup);
            out.precision = cpu.precision.or(out.precision);
            out.input_size = cpu.input_size.or(out.input_size);
            out.cpu_groups = cpu.cpu_groups.or(out.cpu_groups);
            out.compile = cpu.compile.or(out.compile);
            out.kernels = cpu.kernels.or(out.kernels);
            out.devices = cpu.devices.clone().or(out.devices);
            out.prompt_len = cpu.prompt_len.or(out.prompt_len);
            out.gen_len = cpu.gen_len.or(out.gen_len);
            out.scenario = cpu.scenario.or(out.scenario);
            out.framework = cpu.framework.or(out.framework);
            out.queries = cpu.queries.or(out.queries);
            out.duration_s = cpu.duration_s.or(out.duration_s);
            out.latency_bound_ms = cpu.latency_bound_ms.or(out.latency_bound_ms);
            out.batch_timeout_ms = cpu.batch_timeout_ms.or(out.batch_timeout_ms);
            out.qps = cpu.qps.or(out.qps);
        }
        if backend != BackendKind::Cpu {
            out.cpu_groups = None;
        } else if out.cpu_groups.is_some() {
            out.devices = None;
        }
        out
    }
}

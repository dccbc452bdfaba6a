//! The versioned record a benchmark run writes with `--json`: what was run, where, every
//! sample, and the summary. Exercises and `workshop compare` read these files later, so the
//! shape only grows; `schema_version` changes when a field changes meaning.

use serde::{Deserialize, Serialize};

use super::stats::Stats;
use crate::backend::{BackendKind, DeviceInfo, MemoryStats};
use crate::model::Precision;

pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRecord {
    pub schema_version: u32,
    /// Always `"bench"` for these records.
    pub kind: String,
    /// Seconds since the Unix epoch when the run finished.
    pub created_unix: u64,
    pub config: BenchConfig,
    pub environment: Environment,
    pub model: ModelInfo,
    /// Seconds from the start of the run until the session was ready (building the network,
    /// its weights — seeded ones calibrated — and preparing them for the backend): the
    /// start-up a user waits through, not in the statistics. Absent in older records and in
    /// each device's share of a multi-device run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepare_s: Option<f64>,
    /// Seconds per warm-up iteration (not in the statistics).
    pub warmup_s: Vec<f64>,
    /// Seconds per timed iteration (a language model's: per decode step).
    pub samples_s: Vec<f64>,
    /// Seconds of each timed iteration spent enqueueing the pass (before waiting for the
    /// device): the host overhead that replay removes on asynchronous backends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub enqueue_s: Vec<f64>,
    pub stats: Stats,
    /// Cross-entropy of the last iteration's logits against the seeded random labels (NaN
    /// when the logits are not finite, written as `"NaN"`).
    #[serde(with = "crate::units::named_float")]
    pub loss: f64,
    pub memory: MemoryStats,
    /// Kernel and operator statistics, when the run was profiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<super::profile::Profile>,
    /// The FLOPs profile of one step, when asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_profile: Option<super::flops::FlopsProfile>,
    /// What compilation did and how its output compares with eager FP32, when compiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile: Option<CompileInfo>,
    /// A language model's prefill and decode figures; the samples above are then its decode
    /// steps, so the throughput is new tokens per second over the batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<super::llm::LlmRun>,
    /// An MLPerf scenario's probes and verdict (`--scenario`); the samples above are then the
    /// reported probe's per-query latencies, and the throughput its queries per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scenario: Option<super::scenario::ScenarioRun>,
    /// The last iteration's output (not kept in the JSON record).
    #[serde(skip)]
    pub output: Vec<f32>,
    /// Every profiled iteration's kernels, for a trace (not kept in the JSON record).
    #[serde(skip)]
    pub timeline: Vec<super::profile::IterationTimes>,
}

impl BenchRecord {
    /// The record of `config`'s run: where it ran, its work, its timed samples and their
    /// summary, its memory. What only some runs have (warm-up and enqueue times, profiles,
    /// compilation, a language model's or a scenario's figures, the output) starts empty for
    /// the caller to fill; the loss starts NaN (not measured).
    pub fn new(
        config: BenchConfig,
        environment: Environment,
        model: ModelInfo,
        samples_s: Vec<f64>,
        stats: Stats,
        memory: MemoryStats,
    ) -> BenchRecord {
        BenchRecord {
            schema_version: SCHEMA_VERSION,
            kind: "bench".into(),
            created_unix: super::peak::now_unix(),
            config,
            environment,
            model,
            prepare_s: None,
            warmup_s: Vec::new(),
            samples_s,
            enqueue_s: Vec::new(),
            stats,
            loss: f64::NAN,
            memory,
            profile: None,
            flops_profile: None,
            compile: None,
            llm: None,
            scenario: None,
            output: Vec::new(),
            timeline: Vec::new(),
        }
    }
}

impl BenchRecord {
    /// The run's telemetry, where it was read.
    pub fn telemetry(&self) -> Option<&super::telemetry::Telemetry> {
        self.environment.telemetry.as_ref()?.as_ref().ok()
    }

    /// Images (a language model's: new tokens) per joule over the timed iterations, where the
    /// device's energy or power was readable.
    pub fn per_joule(&self) -> Option<f64> {
        let joules = self.telemetry()?.summary.energy_j.filter(|&j| j > 0.0)?;
        // A language model's samples are its decode steps; the window held whole generations.
        let items = match &self.llm {
            Some(run) => self.config.gen_len? * run.ttft_s.len(),
            None => self.samples_s.len(),
        } * self.config.batch_size;
        Some(items as f64 / joules)
    }
}

impl ModelInfo {
    /// The work of one `side`×`side` image through `graph`.
    pub fn of(
        graph: &crate::model::Graph,
        side: usize,
    ) -> Result<ModelInfo, crate::model::ShapeError> {
        let one = graph.plan(1, side, side)?;
        Ok(ModelInfo {
            params: graph.param_count(),
            macs_per_image: one.macs(),
            flops_per_image: one.flops(),
        })
    }
}

/// What was asked for: enough to run it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchConfig {
    pub network: String,
    pub batch_size: usize,
    pub iterations: usize,
    pub warmup: usize,
    pub precision: Precision,
    pub backend: BackendKind,
    pub device: usize,
    pub threads: Option<usize>,
    pub input_size: usize,
    pub seed: u64,
    /// `random(seed=N)` or the weights file's path.
    pub weights: String,
    /// Per-kernel times were collected (`--profile`, `--trace`, `--profile-csv`).
    #[serde(default)]
    pub profile: bool,
    /// GPU kernels read from this directory instead of the embedded copies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels_dir: Option<std::path::PathBuf>,
    /// Whose kernels ran the GEMM-shaped work (`--kernels`).
    #[serde(default, skip_serializing_if = "is_native")]
    pub kernels: crate::backend::KernelFamily,
    /// CPU backend: the cores this run was pinned to (one device of a multi-device run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<Vec<usize>>,
    /// Graph compilation mode (`--compile`); `None` runs the network as built (eager).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile: Option<CompileMode>,
    /// max-autotune: time the variants again instead of using the kept choices.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recompile: bool,
    /// Timed iteration (from 1) whose FLOPs profile is kept (`--flops-prof-step`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_prof_step: Option<usize>,
    /// Language models: prompt tokens per sequence (`--prompt-len`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_len: Option<usize>,
    /// Language models: tokens generated per sequence, the first by the prefill
    /// (`--gen-len`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gen_len: Option<usize>,
    /// Language models: the most rows one forward pass takes (`--max-batched-tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batched_tokens: Option<usize>,
    /// An MLPerf scenario instead of the timed loop (`--scenario`); `batch_size` is then the
    /// largest batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scenario: Option<super::scenario::ScenarioConfig>,
    /// Whose software ran it: ours, or PyTorch eager (`--framework`).
    #[serde(default, skip_serializing_if = "super::framework::Framework::is_ours")]
    pub framework: super::framework::Framework,
}

impl Default for BenchConfig {
    /// `workshop bench`'s defaults (the CLI's flags show these), after
    /// micro_benchmarking_pytorch.py's: ResNet-50, batch 32, 20 timed iterations after 5
    /// warm-ups, FP32, 224×224, seeded random weights, on the CPU backend.
    fn default() -> Self {
        BenchConfig {
            network: "resnet50".into(),
            batch_size: 32,
            iterations: 20,
            warmup: 5,
            precision: Precision::Fp32,
            backend: BackendKind::Cpu,
            device: 0,
            threads: None,
            input_size: 224,
            seed: 0,
            weights: random_weights_label(0),
            profile: false,
            kernels_dir: None,
            kernels: Default::default(),
            cores: None,
            compile: None,
            recompile: false,
            flops_prof_step: None,
            prompt_len: None,
            gen_len: None,
            max_batched_tokens: None,
            scenario: None,
            framework: Default::default(),
        }
    }
}

/// How a record names seeded random weights.
pub fn random_weights_label(seed: u64) -> String {
    format!("random(seed={seed})")
}

impl BenchConfig {
    /// How a session runs this configuration: the one place a config becomes
    /// [`ExecOptions`](crate::backend::ExecOptions).
    pub fn exec_options(&self) -> crate::backend::ExecOptions {
        crate::backend::ExecOptions {
            precision: self.precision,
            threads: self.threads,
            profile: self.profile || self.flops_prof_step.is_some(),
            kernels_dir: self.kernels_dir.clone(),
            kernels: self.kernels,
            replay: self.compile == Some(CompileMode::ReduceOverhead),
            cores: self.cores.clone(),
            variants: Default::default(),
            schedule: None,
        }
    }
}

/// Where it ran: what a comparison needs to say what differed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Environment {
    pub runner_version: String,
    pub os: String,
    pub arch: String,
    pub hostname: Option<String>,
    pub cpu_model: String,
    pub cpu_cores: Option<usize>,
    pub device: DeviceInfo,
    pub kernel_version: String,
    /// What the machine did while the run was timed (clocks, temperature, power, throttling,
    /// other programs' load: [`super::telemetry`]), or why nothing could be read. Absent in
    /// older records and in runs of other frameworks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<Result<super::telemetry::Telemetry, String>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub params: u64,
    /// Conv + linear multiply-accumulates per image at the run's input size.
    pub macs_per_image: u64,
    /// All FLOPs per image (2 per MAC plus element-wise work).
    pub flops_per_image: u64,
}

/// `--compile` modes, named after torch.compile's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CompileMode {
    /// Graph passes: batch norm folded into convolutions, layer norms' affines into the
    /// projections after them and layer scales into the linear layers before them, activations and residual adds fused into epilogues, dropout
    /// dropped
    Default,
    /// The default passes, then the forward pass recorded once and replayed each iteration
    /// (CUDA and HIP graphs; other backends say why they run it as usual)
    ReduceOverhead,
    /// Time each layer's kernel variants and keep the fastest
    MaxAutotune,
}

impl CompileMode {
    pub fn name(self) -> &'static str {
        match self {
            CompileMode::Default => "default",
            CompileMode::ReduceOverhead => "reduce-overhead",
            CompileMode::MaxAutotune => "max-autotune",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompileInfo {
    pub mode: CompileMode,
    pub passes: crate::model::passes::PassReport,
    /// Seconds spent in the graph passes.
    pub compile_s: f64,
    /// Memory plan (weights + activations) of the eager and the compiled graph, bytes.
    pub eager_memory: u64,
    pub compiled_memory: u64,
    /// The compiled run's last output against eager FP32 on the same input and backend.
    pub max_abs_diff: f64,
    /// `max_abs_diff` over the largest eager output magnitude.
    pub rel_diff: f64,
    /// The largest eager output magnitude: 0 when the output is all zeros (a zero-initialised
    /// head, as ViT's without trained weights), and then the check compares nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_scale: Option<f64>,
    /// What max-autotune tried and chose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autotune: Option<AutotuneReport>,
    /// reduce-overhead: how the pass is replayed (Ok), or why this backend runs it as usual.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<Result<String, String>>,
}

fn is_native(k: &crate::backend::KernelFamily) -> bool {
    *k == crate::backend::KernelFamily::Native
}

/// One layer shape and what was chosen for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// The first layer of this shape (`layer1.0.conv2`).
    pub layer: String,
    /// The op and its input shape.
    pub shape: String,
    pub variant: String,
    /// Best time of each variant tried, ms (when `cached`, as the run that filled the cache
    /// measured them).
    pub tried: Vec<(String, f64)>,
    pub cached: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AutotuneReport {
    pub choices: Vec<Choice>,
    /// Layers that got a variant (several layers share a shape).
    pub layers: usize,
    /// The whole network's schedule (the CPU's batch tiles), where the backend offers a
    /// choice: `layer` is empty, `shape` the batch and input, times are whole passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<Choice>,
}

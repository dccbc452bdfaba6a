//! Command-line types (clap derive) and nothing else: their `///` comments are the `--help`
//! text. `app` turns these plain arguments into the objects that do the work.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::backend::{BackendKind, KernelFamily};
use crate::bench::record::BenchConfig;
use crate::model::Precision;

#[derive(Debug, Parser)]
#[command(
    name = "workshop",
    version,
    about = "A hands-on course in GPU inference benchmarking, on our own kernels"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a workspace here: your state and results file
    Init(InitArgs),
    /// Run the next step of the course
    Next(NextArgs),
    /// Show your progress
    Status(CourseArgs),
    /// List the exercises
    List(CourseArgs),
    /// Jump to an exercise
    Goto(GotoArgs),
    /// Skip an exercise (the current one by default); it is recorded as skipped
    Skip(SkipArgs),
    /// Show the hint of the current step
    Hint(CourseArgs),
    /// On a kernel step: check your kernel now and again each time you save it, until it passes
    Watch(CourseArgs),
    /// Forget your progress on one exercise, or everything with --all (backups are kept)
    Reset(ResetArgs),
    /// Re-run an exercise or one step (ID or ID.STEP) without moving on
    Run(RunStepArgs),
    /// Print your results, or export them
    Results(ResultsArgs),
    /// Report this machine: OS, CPU, memory, backends and devices
    Doctor(DoctorArgs),
    /// Print a chapter of the course book (the current exercise's by default)
    Book(BookArgs),
    /// Tools for instructors and kernel developers
    #[command(subcommand)]
    Dev(DevCommand),
    /// Benchmark inference of a zoo network (like micro_benchmarking_pytorch.py) or a language
    /// model (prefill and decode, like vLLM's benchmark_latency and llama-bench)
    Bench(Box<BenchArgs>),
    /// Generate text with a language model, streaming tokens as they come
    Generate(GenerateArgs),
    /// Run one forward pass on an input tensor and write the logits (to check against PyTorch)
    Infer(InferArgs),
    /// List the model zoo with parameter counts and work per image
    Models(ModelsArgs),
    /// Write a network's seeded weights as a safetensors state_dict that PyTorch can load
    Weights(WeightsArgs),
    /// Measure the machine's limits: validated GEMM throughput and memory bandwidth
    Peak(PeakArgs),
    /// Compare benchmark records (`bench --json`) side by side: ratios, verdicts, differences
    Compare(CompareArgs),
    /// Gather a class: every student's results.json under a folder, in one table (instructors)
    Collect(CollectArgs),
    /// Merge the rank records that launched ranks (`bench --results-dir DIR`) wrote into DIR
    Gather(GatherArgs),
}

#[derive(Debug, Args)]
pub struct KernelsCheckArgs {
    /// Compile with the kernel files in DIR (DIR/cuda, DIR/hip, DIR/gpu) in place of the built-in ones of the same name
    #[arg(long, value_name = "DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Fail when one of these compilers is missing instead of skipping it: nvrtc, hiprtc, host
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub require: Vec<String>,
}

/// Where and how to run: shared by every command that runs a network.
#[derive(Debug, Args, Clone)]
pub struct RunArgs {
    /// Network from the zoo (see `workshop models`)
    #[arg(long, default_value_t = BenchConfig::default().network)]
    pub network: String,
    /// Precision of weights and activations (accumulation is always f32)
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// Shorthand kept from micro_benchmarking_pytorch.py: `--fp16 1` is `--precision fp16`
    #[arg(long, value_name = "0|1")]
    pub fp16: Option<u8>,
    /// Backend that runs the kernels
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Device index within the backend
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// CPU worker threads (default: every core)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Weights as a safetensors state_dict with torchvision's names (default: seeded random)
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Seed of the random weights, input and labels
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Read GPU kernel files from DIR where it has them (DIR/wgsl/depthwise.wgsl, DIR/gpu/ops.cuh,
    /// ...), the built-in copies elsewhere: edit one kernel and run it again
    #[arg(long, value_name = "DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Our own kernels, or the vendor libraries (cuDNN and cuBLAS, MIOpen and rocBLAS) for
    /// convolutions and linear layers
    #[arg(long, value_enum, default_value_t = KernelFamily::Native)]
    pub kernels: KernelFamily,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Images per forward pass (default 32), or a language model's sequences decoded together
    /// (default 1; a list sweeps: `-b 1,8`)
    #[arg(short = 'b', long, value_delimiter = ',', value_name = "N")]
    pub batch_size: Vec<usize>,
    /// Timed iterations (default 20; a language model's: 3 whole generations)
    #[arg(long)]
    pub iterations: Option<usize>,
    /// Untimed warm-up iterations before the timed ones (default 5; a language model's: 1)
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Language models: prompt tokens per sequence, seeded random ids (default 128; a list
    /// sweeps: `-p 128,512`)
    #[arg(short = 'p', long, value_delimiter = ',', value_name = "N")]
    pub prompt_len: Vec<usize>,
    /// Language models: tokens generated per sequence, greedy, the first by the prefill
    /// (default 64; a list sweeps)
    #[arg(short = 'n', long, value_delimiter = ',', value_name = "N")]
    pub gen_len: Vec<usize>,
    /// Language models: the most tokens (rows) one forward pass takes, as vLLM's
    /// max_num_batched_tokens: a longer prefill runs in chunks, each attending to what the
    /// chunks before it cached (default: 2048 on GPU backends; the CPU runs a prefill at once)
    #[arg(long, value_name = "N")]
    pub max_batched_tokens: Option<usize>,
    /// Whose software runs the network: our kernels, or PyTorch eager timed the same way (the
    /// bundled bench/pytorch_resnet.py on WORKSHOP_PYTHON or python3; cpu, cuda, hip)
    #[arg(long, value_enum, default_value_t = crate::bench::framework::Framework::Ours)]
    pub framework: crate::bench::framework::Framework,
    /// Run an MLPerf Inference scenario instead of the timed loop: `single-stream` (p50/p90/p99
    /// latency of one query at a time), `offline` (throughput of full batches), `server`
    /// (Poisson arrivals batched dynamically up to --batch-size; the largest rate whose p99
    /// meets --latency-bound-ms, or --qps)
    #[arg(long, value_enum)]
    pub scenario: Option<crate::bench::scenario::Scenario>,
    /// Scenarios: queries per run, at least (default 1024; 128 where the device computes on
    /// the host's cores; MLPerf asks 1,024 single-stream and 270,336 server)
    #[arg(long, value_name = "N")]
    pub queries: Option<usize>,
    /// Scenarios: seconds a run lasts at least on its clock (default 10; 2 on the host's
    /// cores; MLPerf asks 600)
    #[arg(long, value_name = "S")]
    pub duration: Option<f64>,
    /// Server: the p99 latency bound in ms (default 15, MLPerf's for ResNet-50; 100 where the
    /// device computes on the host's cores)
    #[arg(long, value_name = "MS")]
    pub latency_bound_ms: Option<f64>,
    /// Server: how long the first query of a batch waits for others, ms (default: a tenth of
    /// the latency bound)
    #[arg(long, value_name = "MS")]
    pub batch_timeout_ms: Option<f64>,
    /// Server: run at this many queries per second instead of searching for the largest rate
    #[arg(long, value_name = "Q")]
    pub qps: Option<f64>,
    /// A Hugging Face model folder (config.json and safetensors, one file or shards) to run
    /// instead of a built-in language model's seeded weights
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
    /// Input height and width in pixels (default: the network's own, 224 for most)
    #[arg(long)]
    pub input_size: Option<usize>,
    /// Also write the run as a versioned JSON record to FILE
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Time every kernel and print the operator and kernel tables
    #[arg(long)]
    pub profile: bool,
    /// Rows of the profile tables
    #[arg(long, default_value_t = 15, value_name = "N")]
    pub top: usize,
    /// Write the kernel table as CSV (rocprof --stats columns); implies --profile
    #[arg(long, value_name = "FILE")]
    pub profile_csv: Option<PathBuf>,
    /// Write a Chrome trace (open in ui.perfetto.dev or chrome://tracing); implies --profile
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// FLOPs profile of timed iteration K (from 1), like DeepSpeed's flops profiler: params,
    /// MACs, latency and FLOPS per module, efficiency against the peak, arithmetic intensity
    #[arg(long, value_name = "K")]
    pub flops_prof_step: Option<usize>,
    /// Deepest level of the module tree the FLOPs profile prints (default: all)
    #[arg(long, value_name = "D")]
    pub flops_depth: Option<usize>,
    /// Data parallel over several devices: `all`, indices `0,1`, or on the CPU backend groups
    /// of cores `cpu:0-3,cpu:4-7`; --batch-size is the global batch, split evenly
    #[arg(long, value_name = "LIST", conflicts_with = "cpu_groups")]
    pub devices: Option<String>,
    /// Data parallel over N disjoint groups of this machine's cores (CPU backend)
    #[arg(long, value_name = "N")]
    pub cpu_groups: Option<usize>,
    /// With --devices/--cpu-groups: take the single-device throughput from this earlier
    /// `--json` record instead of measuring it after the run
    #[arg(long, value_name = "FILE.json")]
    pub single: Option<PathBuf>,
    /// Compile the network first, like torch.compile: `default` folds batch norms (and layer
    /// norms' affines and layer scales) into the layers around them and fuses activations and residual adds into
    /// epilogues; the output is checked against eager FP32 and the compile time reported apart
    /// from the run. `max-autotune` also times each layer shape's kernel variants and the
    /// network's schedules (the CPU's batch tiles) and keeps the fastest
    #[arg(long, value_enum, value_name = "MODE", num_args = 0..=1, default_missing_value = "default")]
    pub compile: Option<crate::bench::record::CompileMode>,
    /// With --compile max-autotune: time the kernel variants and schedules again instead of
    /// using the choices kept from an earlier run
    #[arg(long)]
    pub recompile: bool,
    /// Compare this run with a saved `--json` record (the saved one is the reference)
    #[arg(long, value_name = "FILE.json")]
    pub baseline: Option<PathBuf>,
    /// Under a launcher (torchrun, srun, mpirun): benchmark this rank's device with its share
    /// of the global batch and write its record into DIR (then `workshop gather DIR`)
    #[arg(long, value_name = "DIR")]
    pub results_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_ids"])))]
pub struct GenerateArgs {
    /// A built-in language model with seeded random weights (see `workshop models`)
    #[arg(long, conflicts_with = "model_dir")]
    pub network: Option<String>,
    /// A Hugging Face model folder: config.json, safetensors, and tokenizer.json for text
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
    /// The prompt as text (needs the folder's tokenizer.json)
    #[arg(long)]
    pub prompt: Option<String>,
    /// The prompt as token ids: `--prompt-ids 1,450,4996`
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    pub prompt_ids: Option<Vec<u32>>,
    /// Send the prompt as a user's message through the folder's chat template (an instruct
    /// model's chat_template.jinja or tokenizer_config.json), as transformers'
    /// apply_chat_template does
    #[arg(long)]
    pub chat: bool,
    /// A system message before the prompt (implies --chat)
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// The most tokens to generate (fewer when the model ends the text)
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub max_tokens: usize,
    /// 0 picks the most probable token (greedy); above 0 samples, flatter as it grows
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub temperature: f32,
    /// Sample only from the most probable tokens that hold this much probability
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    pub top_p: f32,
    /// Precision of weights and activations (accumulation is always f32)
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// Backend that runs the kernels
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Device index within the backend
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// CPU worker threads (default: every core)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seed of the random weights and of sampling
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Two or more records written by `workshop bench --json`; the first is the reference
    #[arg(required = true, num_args = 2.., value_name = "RECORD.json")]
    pub records: Vec<PathBuf>,
    /// Also write the comparison as a Markdown report
    #[arg(long, value_name = "FILE.md")]
    pub markdown: Option<PathBuf>,
    /// Draw the throughputs: grouped bars, or lines for a batch/input-size sweep
    #[arg(long, value_name = "FILE.png|svg")]
    pub chart: Option<PathBuf>,
    /// Print the comparison as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CollectArgs {
    /// The folder holding the students' workspaces (searched for results.json)
    pub dir: PathBuf,
    /// Also write the class table as CSV
    #[arg(long, value_name = "FILE.csv")]
    pub csv: Option<PathBuf>,
    /// Draw the class's baseline throughputs by device
    #[arg(long, value_name = "FILE.png|svg")]
    pub chart: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct GatherArgs {
    /// The folder the ranks wrote their records into
    pub dir: PathBuf,
    /// Also write the merged record to FILE
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct InferArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Input tensor (N, C, H, W) in f32 as safetensors: its one tensor, or the one named `input`
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Where to write the output tensor (named `logits`) as safetensors
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Compile the network first, as `bench --compile` does, so the compiled graph's output
    /// can be checked against PyTorch directly
    #[arg(long, value_enum, value_name = "MODE", num_args = 0..=1, default_missing_value = "default")]
    pub compile: Option<crate::bench::record::CompileMode>,
    /// With --compile max-autotune: time the kernel variants again instead of using the
    /// choices kept from an earlier run
    #[arg(long)]
    pub recompile: bool,
}

#[derive(Debug, Args)]
pub struct ModelsArgs {
    /// Input height and width the work is counted for (default: each network's own; networks
    /// that cannot take the size asked, a ViT's fixed one, are left out)
    #[arg(long)]
    pub input_size: Option<usize>,
    /// Print the list as JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct WeightsArgs {
    /// Network from the zoo
    #[arg(long)]
    pub network: String,
    /// Seed of the weights
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output safetensors file; for a language model, a folder that gets config.json and
    /// model.safetensors (a Hugging Face model folder)
    #[arg(long, value_name = "FILE|DIR")]
    pub output: PathBuf,
    /// How a language model's tensors are stored (checkpoints on the Hugging Face Hub are
    /// mostly bf16); image networks' weights are fp32
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
}

/// Where the workspace and the course are.
#[derive(Debug, Args, Clone, Default)]
pub struct CourseArgs {
    /// Workspace folder (default: the current folder)
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Course directory with exercises/ and book/src/ (default: the course in this binary, or
    /// the one given at `init`)
    #[arg(long, value_name = "DIR")]
    pub course: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct InitArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// Your name, for the results file (asked for when on a terminal)
    #[arg(long)]
    pub name: Option<String>,
    /// Backend the course runs on (default: cpu). On an existing workspace, switches the
    /// backend and keeps the results
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Device index within the backend (default: 0)
    #[arg(long)]
    pub device: Option<usize>,
    /// CPU worker threads (default: every core)
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(Debug, Args)]
pub struct NextArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// Run without asking (also the behaviour when there is no terminal)
    #[arg(long, short)]
    pub yes: bool,
    /// Answer to the step's question
    #[arg(long)]
    pub answer: Option<String>,
    /// Show profiles whole (every kernel, the module tree) instead of their summary; the
    /// whole profile is always saved under profiles/
    #[arg(long, short)]
    pub verbose: bool,
}

#[derive(Debug, Args)]
pub struct GotoArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// Exercise id, e.g. 01-baseline
    pub id: String,
}

#[derive(Debug, Args)]
pub struct SkipArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// Exercise id (default: the current exercise)
    pub id: Option<String>,
}

#[derive(Debug, Args)]
pub struct ResetArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// Exercise id
    #[arg(required_unless_present = "all")]
    pub id: Option<String>,
    /// Start over completely; state and results are kept as *.bak-TIME backups
    #[arg(long, conflicts_with = "id")]
    pub all: bool,
    /// With --all: do not ask for confirmation on a terminal
    #[arg(long, short = 'y', requires = "all")]
    pub yes: bool,
}

#[derive(Debug, Args)]
pub struct RunStepArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// `ID` for every step of an exercise, `ID.STEP` for one
    pub target: String,
    /// Answer to the step's question
    #[arg(long)]
    pub answer: Option<String>,
    /// Show profiles whole (every kernel, the module tree) instead of their summary; the
    /// whole profile is always saved under profiles/
    #[arg(long, short)]
    pub verbose: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Csv,
    Json,
}

#[derive(Debug, Args)]
pub struct ResultsArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// Print every attempt as CSV or JSON instead of the worksheet
    #[arg(long, value_enum)]
    pub export: Option<ExportFormat>,
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BookArgs {
    #[command(flatten)]
    pub course: CourseArgs,
    /// Exercise id, or `introduction`
    pub id: Option<String>,
    /// Render the whole book to HTML in DIR (offline, with mdBook's library), then print where
    #[arg(long, value_name = "DIR", conflicts_with = "id")]
    pub html: Option<PathBuf>,
    /// With --html: open the book's first page in the web browser
    #[arg(long, requires = "html")]
    pub open: bool,
}

#[derive(Debug, Subcommand)]
pub enum DevCommand {
    /// Check a course directory (default: the embedded course) and report every problem
    Lint {
        /// Course directory with exercises/ and book/src/
        dir: Option<PathBuf>,
    },
    /// Scaffold a new exercise and its chapter in a course directory
    New {
        /// Exercise id, e.g. 03-profile
        id: String,
        /// Course directory
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Compile every GPU kernel file (CUDA with NVRTC, HIP with hiprtc, and for the CPU
    /// emulator) for the usual targets and precisions, without a GPU
    KernelsCheck(KernelsCheckArgs),
}

#[derive(Debug, Args)]
pub struct PeakArgs {
    /// Backend whose kernels run the GEMM
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Device index within the backend
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Precision of the GEMM's inputs (accumulation is always f32)
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// CPU worker threads (default: every core)
    #[arg(long)]
    pub threads: Option<usize>,
    /// GEMM size: M = N = K (default: 1024 on the CPU and software devices, 4096 on a GPU,
    /// which a 1024³ GEMM does not fill)
    #[arg(long)]
    pub size: Option<usize>,
    /// Timed GEMMs (each one's output is checked)
    #[arg(long, default_value_t = 10)]
    pub iterations: usize,
    /// Size of each bandwidth array in MiB: host memory on the CPU backend (default 256), device
    /// memory on a GPU (default 1024: several times the largest GPU caches)
    #[arg(long, value_name = "MIB")]
    pub array_mib: Option<usize>,
    /// Print the results as JSON
    #[arg(long)]
    pub json: bool,
}

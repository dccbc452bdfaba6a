//! Command-line types (clap derive) and nothing else: their `///` comments are the `--help`
//! text. `app` turns these plain arguments into the objects that do the work.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::backend::BackendKind;
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
    /// Benchmark inference of a zoo network (like micro_benchmarking_pytorch.py)
    Bench(BenchArgs),
    /// Run one forward pass on an input tensor and write the logits (to check against PyTorch)
    Infer(InferArgs),
    /// List the model zoo with parameter counts and work per image
    Models(ModelsArgs),
    /// Write a network's seeded weights as a safetensors state_dict that PyTorch can load
    Weights(WeightsArgs),
}

/// Where and how to run: shared by every command that runs a network.
#[derive(Debug, Args, Clone)]
pub struct RunArgs {
    /// Network from the zoo (see `workshop models`)
    #[arg(long, default_value = "resnet50")]
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
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Images per forward pass
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Timed iterations
    #[arg(long, default_value_t = 20)]
    pub iterations: usize,
    /// Untimed warm-up iterations before the timed ones
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Input height and width in pixels
    #[arg(long, default_value_t = 224)]
    pub input_size: usize,
    /// Also write the run as a versioned JSON record to FILE
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
}

#[derive(Debug, Args)]
pub struct ModelsArgs {
    /// Input height and width the work is counted for
    #[arg(long, default_value_t = 224)]
    pub input_size: usize,
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
    /// Output safetensors file
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
}

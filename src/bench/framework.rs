//! Whose software runs the network: our kernels, or PyTorch eager measured the same way
//! (`--framework pytorch`): the bundled `bench/pytorch_resnet.py`, embedded in the binary and
//! fed to `WORKSHOP_PYTHON` (else `python3`), builds the torchvision network, times the same
//! batch with a device sync per iteration, and prints its samples, which become an ordinary
//! record, so `compare`, charts and the course read it like one of ours. Without PyTorch the
//! run is unavailable and says how to install it.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::record::{BenchConfig, BenchRecord, ModelInfo};
use super::stats::Stats;
use crate::backend::{BackendError, BackendKind, MemoryStats};
use crate::model::zoo;

/// `--framework`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Framework {
    /// Our own kernels (the backend's)
    #[default]
    Ours,
    /// PyTorch eager through the bundled script, on the backend's device (cpu; cuda and hip
    /// as PyTorch's `cuda`)
    Pytorch,
}

impl Framework {
    pub fn is_ours(&self) -> bool {
        *self == Framework::Ours
    }
}

/// The script, as `bench/pytorch_resnet.py` has it.
const SCRIPT: &str = include_str!("../../bench/pytorch_resnet.py");

/// What the script prints (one JSON line).
#[derive(Debug, Deserialize)]
struct Printed {
    #[serde(rename = "impl")]
    implementation: String,
    device: String,
    samples_s: Vec<f64>,
    warmup_s: Vec<f64>,
    prepare_s: f64,
    threads_used: Option<usize>,
    peak_memory_bytes: Option<u64>,
}

/// The interpreter to run.
fn python() -> std::path::PathBuf {
    (crate::settings::get().ok())
        .and_then(|s| s.python.clone())
        .unwrap_or_else(|| "python3".into())
}

/// What PyTorch cannot be asked to do here, in words; `None` when it can run `cfg`.
fn refusal(cfg: &BenchConfig) -> Option<String> {
    if zoo::layer::is_layer_spec(&cfg.network) || !zoo::NETWORKS.contains(&cfg.network.as_str()) {
        return Some(format!(
            "--framework pytorch runs the zoo's networks (torchvision.models), not `{}`",
            cfg.network
        ));
    }
    let ours_only = [
        (cfg.compile.is_some(), "--compile"),
        (
            cfg.kernels != crate::backend::KernelFamily::Native,
            "--kernels vendor",
        ),
        (cfg.profile || cfg.flops_prof_step.is_some(), "profiling"),
        (cfg.kernels_dir.is_some(), "--kernels-dir"),
        (cfg.scenario.is_some(), "--scenario"),
    ];
    (ours_only.iter().find(|(given, _)| *given)).map(|(_, what)| {
        format!("--framework pytorch runs PyTorch eager as it comes: {what} is for our kernels")
    })
}

/// Run `cfg` with PyTorch and record it like one of our runs.
pub fn run(cfg: &BenchConfig) -> Result<BenchRecord> {
    if let Some(why) = refusal(cfg) {
        bail!(why);
    }
    let device = match cfg.backend {
        BackendKind::Cpu => "cpu".to_string(),
        BackendKind::Cuda | BackendKind::Hip => format!("cuda:{}", cfg.device),
        BackendKind::Wgpu => {
            return Err(BackendError::Unsupported(
                "PyTorch has no wgpu device: compare it on cpu, cuda or hip".into(),
            )
            .into());
        }
    };
    let threads = match cfg.backend {
        BackendKind::Cpu => cfg.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        }),
        _ => 0,
    };
    let python = python();
    let args = [
        "-".to_string(),
        format!("--network={}", cfg.network),
        format!("--batch-size={}", cfg.batch_size),
        format!("--iterations={}", cfg.iterations),
        format!("--warmup={}", cfg.warmup),
        format!("--threads={threads}"),
        format!("--dtype={}", cfg.precision.name()),
        format!("--device={device}"),
        format!("--input-size={}", cfg.input_size),
    ];
    let install = format!(
        "install PyTorch for it (`{} -m pip install torch torchvision`), or point WORKSHOP_PYTHON at a Python that has it",
        python.display()
    );
    let mut child = match Command::new(&python)
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(BackendError::MissingLibrary(format!(
                "no Python at `{}` to run PyTorch: install Python 3 and {install}",
                python.display()
            ))
            .into());
        }
        Err(e) => bail!("cannot start {}: {e}", python.display()),
    };
    // The script on standard input; closing it lets Python run it.
    let mut stdin = child.stdin.take().context("the interpreter's input")?;
    let fed = stdin.write_all(SCRIPT.as_bytes());
    drop(stdin);
    let out = child.wait_with_output()?;
    fed.with_context(|| format!("cannot give the script to {}", python.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("No module named 'torch") {
            return Err(BackendError::MissingLibrary(format!(
                "PyTorch is not installed for {}: {install}",
                python.display()
            ))
            .into());
        }
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
        bail!(
            "PyTorch failed ({}): {}",
            out.status,
            last.unwrap_or("no message")
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = (stdout.lines().rev())
        .find(|l| l.trim_start().starts_with('{'))
        .context("the PyTorch script printed no result")?;
    let printed: Printed = serde_json::from_str(line)
        .with_context(|| format!("the PyTorch script printed an unreadable result: {line}"))?;
    record(cfg, printed)
}

/// The record of a PyTorch run, in our format.
fn record(cfg: &BenchConfig, p: Printed) -> Result<BenchRecord> {
    if p.samples_s.len() != cfg.iterations
        || p.samples_s.iter().any(|s| !(s.is_finite() && *s > 0.0))
    {
        bail!(
            "the PyTorch script returned {} samples for {} iterations",
            p.samples_s.len(),
            cfg.iterations
        );
    }
    let graph = zoo::build(&cfg.network)?;
    let per_image = graph.plan(1, cfg.input_size, cfg.input_size)?;
    let stats = Stats::from_samples(
        &p.samples_s,
        cfg.batch_size,
        per_image.macs() * 2 * cfg.batch_size as u64,
    )
    .context("no timed samples")?;
    let mut device = match cfg.backend {
        BackendKind::Cpu => crate::backend::cpu::host_device(),
        _ => crate::backend::DeviceInfo {
            name: p.device.clone(),
            memory_bytes: None,
            driver: None,
            compute_units: None,
            features: Vec::new(),
            clock_mhz: None,
        },
    };
    if cfg.backend == BackendKind::Cpu {
        device.compute_units = p.threads_used.or(device.compute_units);
    }
    let weights = graph.param_count() * cfg.precision.bytes() as u64;
    let mut config = cfg.clone();
    config.weights = "torchvision's default initialisation".into();
    let model = ModelInfo::of(&graph, cfg.input_size)?;
    // PyTorch's allocator reports the GPU's peak; the CPU's is not measured.
    let memory = MemoryStats {
        weights,
        peak_activations: p.peak_memory_bytes.map_or(0, |m| m.saturating_sub(weights)),
        peak: p.peak_memory_bytes.unwrap_or(0),
    };
    let environment = super::environment(device, p.implementation);
    Ok(BenchRecord {
        prepare_s: Some(p.prepare_s),
        warmup_s: p.warmup_s,
        ..BenchRecord::new(config, environment, model, p.samples_s, stats, memory)
    })
}

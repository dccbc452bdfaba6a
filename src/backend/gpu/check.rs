//! `workshop dev kernels-check`: compile every GPU kernel file with every compiler this build
//! and machine have — NVRTC for CUDA, hiprtc for HIP, the host C++ compiler for the emulator —
//! for the usual targets and every storage precision, without a GPU.

use std::path::Path;
use std::time::Instant;

use crate::backend::BackendError;
use crate::model::Precision;

/// One compilation: what, for which target and precision, and how it went.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub file: &'static str,
    pub compiler: &'static str,
    pub target: String,
    pub precision: Precision,
    pub outcome: Outcome,
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Compiled,
    /// The compiler is not in this build or on this machine: why, and what to install.
    Skipped(String),
    /// The compiler is here but no longer (or not yet) builds for this target.
    NotSupported(String),
    Failed(String),
}

/// The compilers `--require` can name.
pub const COMPILERS: [&str; 3] = ["nvrtc", "hiprtc", "host"];

/// CUDA targets checked: V100, A100, H100.
pub const CUDA_TARGETS: [&str; 3] = ["compute_70", "compute_80", "compute_90"];

const PRECISIONS: [Precision; 3] = [Precision::Fp32, Precision::Fp16, Precision::Bf16];

/// Compile `file` with `compiler` for every target in every precision, timing each.
fn each<T>(
    file: &'static str,
    compiler: &'static str,
    targets: &[&str],
    compile: impl Fn(&str, Precision) -> Result<T, BackendError>,
) -> Vec<Check> {
    let mut out = Vec::new();
    for &target in targets {
        for precision in PRECISIONS {
            let t = Instant::now();
            let outcome = match compile(target, precision) {
                Ok(_) => Outcome::Compiled,
                Err(e) => Outcome::Failed(e.to_string()),
            };
            out.push(Check {
                file,
                compiler,
                target: target.to_string(),
                precision,
                outcome,
                seconds: t.elapsed().as_secs_f64(),
            });
        }
    }
    out
}

fn skipped(file: &'static str, compiler: &'static str, why: &str) -> Vec<Check> {
    vec![Check {
        file,
        compiler,
        target: "-".into(),
        precision: Precision::Fp32,
        outcome: Outcome::Skipped(why.to_string()),
        seconds: 0.0,
    }]
}

/// Compile everything; `kernels_dir` replaces the embedded sources.
pub fn run(kernels_dir: Option<&Path>) -> Vec<Check> {
    let mut out = Vec::new();
    out.extend(cuda(kernels_dir));
    out.extend(hip(kernels_dir));
    out.extend(host(kernels_dir));
    out
}

#[cfg(feature = "cuda")]
fn cuda(dir: Option<&Path>) -> Vec<Check> {
    use crate::backend::cuda;
    if !cuda::nvrtc_present() {
        return skipped(
            "cuda/ops.cu",
            "nvrtc",
            "NVRTC (libnvrtc.so) not found: `pip install nvidia-cuda-nvrtc-cu12` and add its \
             nvidia/cuda_nvrtc/lib folder to LD_LIBRARY_PATH",
        );
    }
    let archs = cuda::nvrtc_archs();
    let (known, unknown): (Vec<&str>, Vec<&str>) = CUDA_TARGETS.iter().partition(|t| {
        let n = t.trim_start_matches("compute_").parse().unwrap_or(0);
        archs.is_empty() || archs.contains(&n)
    });
    let version = cuda::nvrtc_version().unwrap_or_default();
    let why = |t: &str| {
        let list: Vec<String> = archs.iter().map(|a| format!("compute_{a}")).collect();
        format!(
            "NVRTC {version} does not build for {t} (it builds for {})",
            list.join(", ")
        )
    };
    let mut out: Vec<Check> = unknown
        .into_iter()
        .flat_map(|t| {
            PRECISIONS.map(|precision| Check {
                file: "cuda/ops.cu",
                compiler: "nvrtc",
                target: t.to_string(),
                precision,
                outcome: Outcome::NotSupported(why(t)),
                seconds: 0.0,
            })
        })
        .collect();
    out.extend(each("cuda/ops.cu", "nvrtc", &known, |target, p| {
        cuda::compile(target, p, dir)
    }));
    out
}

#[cfg(not(feature = "cuda"))]
fn cuda(_dir: Option<&Path>) -> Vec<Check> {
    skipped(
        "cuda/ops.cu",
        "nvrtc",
        "the cuda backend is not in this build (`--features cuda`)",
    )
}

#[cfg(feature = "hip")]
fn hip(dir: Option<&Path>) -> Vec<Check> {
    use crate::backend::hip;
    each("hip/ops.hip", "hiprtc", &hip::CHECK_TARGETS, |target, p| {
        hip::compile(target, p, dir)
    })
}

#[cfg(not(feature = "hip"))]
fn hip(_dir: Option<&Path>) -> Vec<Check> {
    skipped(
        "hip/ops.hip",
        "hiprtc",
        "the hip backend is not in this build (rebuild with `--features hip`; needs \
         libamdhip64-dev)",
    )
}

#[cfg(unix)]
fn host(dir: Option<&Path>) -> Vec<Check> {
    use super::Device;
    each("gpu/ops.cuh", "host", &["emulator"], |_, p| {
        super::emu::EmuDevice::new(crate::backend::BackendKind::Cuda).compile(
            p,
            dir,
            &["conv2d", "conv2d_t128"],
        )
    })
}

#[cfg(not(unix))]
fn host(_dir: Option<&Path>) -> Vec<Check> {
    skipped(
        "gpu/ops.cuh",
        "host",
        "the CPU emulator of the GPU kernels needs a Unix system",
    )
}

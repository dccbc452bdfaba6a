//! `workshop dev kernels-check`: compile every GPU kernel file with every compiler this build
//! and machine have — NVRTC for CUDA, hiprtc for HIP, the host C++ compiler for the emulator —
//! for the usual targets and every storage precision, without a GPU.

use std::path::Path;
use std::time::Instant;

use crate::backend::BackendError;
use crate::model::Precision;

/// One compilation: what, for which target and precision, and how it went.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelCheck {
    pub file: &'static str,
    pub compiler: &'static str,
    pub target: String,
    pub precision: Precision,
    pub outcome: CompileOutcome,
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum CompileOutcome {
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

pub(crate) const PRECISIONS: [Precision; 3] = [Precision::Fp32, Precision::Fp16, Precision::Bf16];

/// Compile `file` with `compiler` for every target in every precision, timing each.
pub(crate) fn each<T>(
    file: &'static str,
    compiler: &'static str,
    targets: &[&str],
    compile: impl Fn(&str, Precision) -> Result<T, BackendError>,
) -> Vec<KernelCheck> {
    let mut out = Vec::new();
    for &target in targets {
        for precision in PRECISIONS {
            let t = Instant::now();
            let outcome = match compile(target, precision) {
                Ok(_) => CompileOutcome::Compiled,
                Err(e) => CompileOutcome::Failed(e.to_string()),
            };
            out.push(KernelCheck {
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

pub(crate) fn skipped(file: &'static str, compiler: &'static str, why: &str) -> Vec<KernelCheck> {
    vec![KernelCheck {
        file,
        compiler,
        target: "-".into(),
        precision: Precision::Fp32,
        outcome: CompileOutcome::Skipped(why.to_string()),
        seconds: 0.0,
    }]
}

/// The emulator's host build of the kernels.
#[cfg(unix)]
pub(crate) fn host(dir: Option<&Path>) -> Vec<KernelCheck> {
    use super::gpu::Device;
    use crate::backend::BackendKind;
    // The warp-of-32 (CUDA) and wavefront-of-64 (HIP) matrix kernels are two builds.
    each("gpu/ops.cuh", "host", &["emulator"], |_, p| {
        let mut names = vec!["conv2d", "conv2d_t128"];
        if p != Precision::Fp32 {
            names.push("conv2d_mma_t64");
        }
        for kind in [BackendKind::Cuda, BackendKind::Hip] {
            super::gpu::emu::EmuDevice::new(kind).compile(p, dir, &names)?;
        }
        Ok(())
    })
}

#[cfg(not(unix))]
pub(crate) fn host(_dir: Option<&Path>) -> Vec<KernelCheck> {
    skipped(
        "gpu/ops.cuh",
        "host",
        "the CPU emulator of the GPU kernels needs a Unix system",
    )
}

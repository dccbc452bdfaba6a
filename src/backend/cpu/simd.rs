//! Which SIMD code paths the CPU kernels take: chosen once per process from what the CPU
//! supports, or forced to the portable paths with `WORKSHOP_CPU_SIMD=portable` (to test and
//! time the fallbacks that CPUs without AVX2 + FMA run, on a machine that has them).

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    /// AVX2 and FMA (x86-64 since Haswell and Zen).
    Avx2Fma,
    /// Plain Rust that the compiler vectorises for the target's baseline (SSE2 on x86-64).
    Portable,
}

/// The environment variable that forces the portable paths.
pub const ENV: &str = "WORKSHOP_CPU_SIMD";

/// The paths in use.
pub fn simd() -> Simd {
    static SIMD: OnceLock<Simd> = OnceLock::new();
    *SIMD.get_or_init(|| match std::env::var(ENV).as_deref() {
        Ok("portable") => Simd::Portable,
        Ok("") | Err(_) => best(),
        Ok(other) => {
            eprintln!(
                "warning: {ENV}={other} is not a choice (`portable`, or unset for the best this \
                 CPU runs): using the best"
            );
            best()
        }
    })
}

/// The best paths this CPU can run.
pub fn best() -> Simd {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return Simd::Avx2Fma;
    }
    Simd::Portable
}

/// Whether the AVX2 paths are in use and the CPU also converts f16 in hardware (F16C).
pub fn f16c() -> bool {
    static F16C: OnceLock<bool> = OnceLock::new();
    *F16C.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if simd() == Simd::Avx2Fma {
            return std::arch::is_x86_feature_detected!("f16c");
        }
        false
    })
}

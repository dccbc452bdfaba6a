//! Choices between SIMD paths that a CPU's features cannot make: measured once per CPU by a
//! quick probe at start-up and kept in the cache folder (`simd.json`, next to `workshop
//! peak`'s `peak.json`), so that every later process takes the same path without measuring
//! again, and a noisy moment cannot flip it from one run to the next.
//!
//! The one choice so far: whether BF16 layers multiply bf16 pairs with AVX512_BF16's
//! `vdpbf16ps` or widen them for the FP32 FMAs. One `vdpbf16ps` does the work of two FMAs
//! (two products a lane). A Zen 4 or Zen 5 core issues it as often as an FMA, so it doubles
//! the rate; an Intel Xeon of family 6 model 207 (Emerald Rapids, AMX hidden by its VM) ran
//! it at 0.51× the FMAs' FLOPs, and ResNet-50 BF16 at batch 8 ran at 19 images/s on pairs
//! against 25 widened. Whatever the CPU's name, the measurement decides.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The pairs pay where `vdpbf16ps` does at least an FMA's FLOPs a second: at the same rate
/// they also halve the bytes every GEMM reads. The CPUs measured sit far on either side
/// (Zen 4 and 5 about 2, the Xeon above 0.51).
pub const PAY_FROM: f64 = 1.0;

/// What the probe found on this CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bf16Pairs {
    /// `vdpbf16ps`'s FLOP rate over the FP32 FMAs', on registers on one core.
    pub dot_per_fma: f64,
}

impl Bf16Pairs {
    /// Whether BF16 layers should multiply pairs rather than widen to FP32.
    pub fn pay(self) -> bool {
        self.dot_per_fma >= PAY_FROM
    }

    /// What was chosen and why, for `doctor` and the records.
    pub fn describe(self) -> String {
        let chose = match self.pay() {
            true => "BF16 multiplies bf16 pairs (vdpbf16ps)",
            false => "BF16 widens to the FP32 FMAs",
        };
        format!(
            "{chose}: vdpbf16ps ran at {:.2}× their FLOP rate here (measured once, kept in simd.json)",
            self.dot_per_fma
        )
    }
}

/// The probe's result for this CPU: from the cache where it holds one, else measured now and
/// kept. `None` where the CPU lacks AVX512_BF16 (there is nothing to choose).
pub fn bf16_pairs() -> Option<Bf16Pairs> {
    static PAIRS: OnceLock<Option<Bf16Pairs>> = OnceLock::new();
    *PAIRS.get_or_init(|| {
        cached_or_measured(cache_path().as_deref(), &cpu_identity(), super::simd::dot_per_fma)
            .map(|dot_per_fma| Bf16Pairs { dot_per_fma })
    })
}

/// The cache's name in the cache folder.
pub const CACHE_FILE: &str = "simd.json";

/// One CPU's measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Entry {
    /// Brand string and CPUID signature ([`cpu_identity`]).
    cpu: String,
    dot_per_fma: f64,
    measured_unix: u64,
}

/// The ratio kept for `cpu` in the cache at `path`, else `measure()`'s, kept there in place
/// of any earlier one for that CPU (the other CPUs' entries stay). A cache that cannot be
/// read is measured over; one that cannot be written costs the next process the probe again.
fn cached_or_measured(
    path: Option<&Path>,
    cpu: &str,
    measure: impl FnOnce() -> Option<f64>,
) -> Option<f64> {
    let mut all: Vec<Entry> = path
        .and_then(|p| crate::files::read_text(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let kept = all.iter().find(|e| e.cpu == cpu);
    if let Some(e) = kept.filter(|e| e.dot_per_fma.is_finite() && e.dot_per_fma > 0.0) {
        return Some(e.dot_per_fma);
    }
    let dot_per_fma = measure()?;
    if let Some(path) = path {
        all.retain(|e| e.cpu != cpu);
        all.push(Entry {
            cpu: cpu.to_string(),
            dot_per_fma,
            measured_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        });
        if let Ok(text) = serde_json::to_string_pretty(&all) {
            let _ = crate::files::write_atomic(path, text.as_bytes());
        }
    }
    Some(dot_per_fma)
}

/// The CPU as the cache knows it: its brand string and CPUID signature (family, model and
/// stepping), which a virtual machine may report alike for different hosts only when they
/// are the same part.
fn cpu_identity() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: CPUID leaf 1 and the extended leaves up to the one leaf 0x8000_0000 names
        // exist on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let (signature, brand) = unsafe {
            let signature = __cpuid(1).eax;
            let brand: Vec<u8> = match __cpuid(0x8000_0000).eax >= 0x8000_0004 {
                true => (0x8000_0002..=0x8000_0004u32)
                    .flat_map(|leaf| {
                        let r = __cpuid(leaf);
                        [r.eax, r.ebx, r.ecx, r.edx]
                    })
                    .flat_map(u32::to_le_bytes)
                    .collect(),
                false => Vec::new(),
            };
            (signature, brand)
        };
        let brand = String::from_utf8_lossy(&brand);
        format!("{} (CPUID signature {signature:#x})", brand.trim_matches(['\0', ' ']))
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::env::consts::ARCH.to_string()
}

/// Where the probe's results are kept, if anywhere.
pub fn cache_path() -> Option<PathBuf> {
    Some(crate::settings::cache_dir()?.join(CACHE_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// The first process measures and keeps the result; later ones read it without
    /// measuring; another CPU's entry is measured beside it, not over it; a broken cache is
    /// measured over.
    #[test]
    fn the_probe_runs_once_per_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CACHE_FILE);
        let runs = Cell::new(0);
        let measure = |r: f64| {
            let runs = &runs;
            move || {
                runs.set(runs.get() + 1);
                Some(r)
            }
        };
        assert_eq!(cached_or_measured(Some(&path), "a", measure(0.5)), Some(0.5));
        assert_eq!(cached_or_measured(Some(&path), "a", measure(2.0)), Some(0.5));
        assert_eq!(runs.get(), 1);
        assert_eq!(cached_or_measured(Some(&path), "b", measure(2.0)), Some(2.0));
        assert_eq!(cached_or_measured(Some(&path), "a", measure(9.0)), Some(0.5));
        assert_eq!(cached_or_measured(Some(&path), "b", measure(9.0)), Some(2.0));
        assert_eq!(runs.get(), 2);
        std::fs::write(&path, "{ not json").unwrap();
        assert_eq!(cached_or_measured(Some(&path), "a", measure(1.5)), Some(1.5));
        assert_eq!(cached_or_measured(Some(&path), "a", measure(9.0)), Some(1.5));
        // Nothing to measure (no AVX512_BF16): nothing kept, nothing chosen.
        assert_eq!(cached_or_measured(Some(&path), "c", || None), None);
        assert_eq!(runs.get(), 3);
        // No cache folder: measured every time.
        assert_eq!(cached_or_measured(None, "a", measure(0.7)), Some(0.7));
        assert_eq!(runs.get(), 4);
    }

    #[test]
    fn the_pairs_pay_from_an_fmas_rate() {
        assert!(Bf16Pairs { dot_per_fma: 1.97 }.pay());
        assert!(!Bf16Pairs { dot_per_fma: 0.51 }.pay());
        let said = Bf16Pairs { dot_per_fma: 0.51 }.describe();
        assert!(said.contains("widens") && said.contains("0.51×"), "{said}");
    }

    /// On a CPU with AVX512_BF16 the probe measures a ratio between the slowest and fastest
    /// issue rates any core could have (a quarter of an FMA's to four times).
    #[test]
    fn the_probe_measures_a_plausible_ratio() {
        match super::super::simd::dot_per_fma() {
            Some(r) => assert!((0.25..4.0).contains(&r), "{r}"),
            None => assert!(super::super::simd::best() < super::super::simd::Simd::Avx512Bf16),
        }
        assert!(!cpu_identity().is_empty());
    }
}

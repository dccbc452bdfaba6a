//! Choices between kernels that a CPU's features cannot make: measured once per CPU (and
//! build of the kernels) by quick probes at start-up and kept in the cache folder
//! (`simd.json`, next to `workshop peak`'s `peak.json`), so that every later process takes the
//! same path without measuring again, and a noisy moment cannot flip it from one run to the
//! next. Whatever the CPU's name, the measurement decides.
//!
//! - Whether BF16 layers multiply bf16 pairs with AVX512_BF16's `vdpbf16ps` or widen them for
//!   the FP32 FMAs ([`bf16_pairs`]). One `vdpbf16ps` does the work of two FMAs (two products
//!   a lane). A Zen 4 or Zen 5 core issues it as often as an FMA, so it doubles the rate; an
//!   Intel Xeon of family 6 model 207 (Emerald Rapids, AMX hidden by its VM) ran it at 0.50×
//!   the FMAs' FLOPs, and ResNet-50 BF16 at batch 8 ran at 19 images/s on pairs against 25
//!   widened.
//! - How deep a K the FP32 GEMM's small-K kernel takes (`sgemm`'s `stationary`, B's panel held
//!   in registers) instead of the register tile ([`small_k_reach`]). On a Zen 4 (two 256-bit
//!   FMA units) it took 0.59–0.91× the tile's time on layers of K 16–64; on the Emerald Rapids
//!   core (two 512-bit units, which its 6 chains of FMAs leave partly idle) 1.03–1.31× at every
//!   K, and ResNet-50 FP32 at batch 8 ran 15% faster without it. AVX2's kernel (the tile's
//!   6×16 loop run a panel at a time) may go as deep as a K block: on a Zen 3 it won at every
//!   depth probed, up to 1024.
//! - Whether an FP32 layer with a residual writes its output over the residual's buffer
//!   ([`over_residual`]): 0.86× the GEMM's time on an Emerald Rapids core, and ResNet-50
//!   FP32 5–6% faster; a Zen 4 had read the network 1.28–1.32× slower that way before C's
//!   prefetches went to L2, and now level (its probe 0.75–0.92, so over).

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The pairs pay where `vdpbf16ps` does at least an FMA's FLOPs a second: at the same rate
/// they also halve the bytes every GEMM reads. The CPUs measured sit far on either side
/// (Zen 4 and 5 about 2, the Xeon 0.50).
pub const PAY_FROM: f64 = 1.0;

/// The depthwise pair kernels (`kernels::depthwise`'s `Pairs`) pay only where `vdpbf16ps`
/// does well over an FMA's FLOPs a second: they spend shuffles making each input pixel's
/// pairs that the FMA kernels do not. On a 2-vCPU AMX Xeon whose `vdpbf16ps` ran at 1.00× the
/// FMAs' FLOP rate, MobileNetV3-Large BF16's depthwise layers took 0.69–0.79× the time on
/// the FMA kernels (5×5 over 120 channels at 28², batch 8: 0.64 against 0.93 ms), 100–200
/// steps alternating in one process. Where they were written (the backend was tuned on a
/// Zen 5, which issues `vdpbf16ps` as often as FMAs: about 2), single layers took 0.63–0.89×
/// the time on pairs.
pub const DEPTHWISE_FROM: f64 = 1.5;

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

    /// Whether BF16 depthwise layers should multiply pairs rather than widen to the FMAs.
    pub fn depthwise_pays(self) -> bool {
        self.dot_per_fma >= DEPTHWISE_FROM
    }

    /// What was chosen and why, for `doctor` and the records.
    pub fn describe(self) -> String {
        let chose = match self.pay() {
            true => "BF16 multiplies bf16 pairs (vdpbf16ps)",
            false => "BF16 widens to the FP32 FMAs",
        };
        format!(
            "{chose}: vdpbf16ps ran at {:.2}× their FLOP rate here (measured once, kept in {CACHE_FILE})",
            self.dot_per_fma
        )
    }
}

/// The bf16-pair probe's result for this CPU: from the cache where it holds one, else
/// measured now and kept. `None` where the CPU lacks AVX512_BF16 (there is nothing to choose).
pub fn bf16_pairs() -> Option<Bf16Pairs> {
    static PAIRS: OnceLock<Option<Bf16Pairs>> = OnceLock::new();
    *PAIRS.get_or_init(|| {
        let found = kept(
            cache_path().as_deref(),
            &cpu_identity(),
            |e| e.dot_per_fma,
            |e, r| e.dot_per_fma = Some(r),
            super::simd::dot_per_fma,
        );
        found.map(|dot_per_fma| Bf16Pairs { dot_per_fma })
    })
}

/// The K depths the small-K probe tries, shallowest first (those within the path's reach:
/// AVX-512's kernel stops at 64).
pub const SMALL_K_DEPTHS: [usize; 5] = [16, 32, 64, 256, 1024];

/// How much slower than the register tile the small-K kernel may measure at a depth and
/// still keep it. Where the two kernels are level a cut at exactly 1.0 made the reach a coin
/// toss: on a Zen 3 one build of the kernels got 1024, the next 256, the next 16, and
/// profiles of two builds differed for that alone. There, with the probe's median of seven
/// rounds, eight probes in a row read 0.98–1.03 at K 256 and 0.94–1.03 at K 1024 (0.70–0.74
/// at K 16, 0.90–0.94 at K 64). Level goes to the small-K kernel, which the network preferred
/// where the probe ties: on that Zen 3 (2 threads, FP32, compiled), ResNet-50's 1×1 layers
/// took 0.94× the time with the reach at 1024 against 64 at batch 1 (7 of 8 rounds) and
/// 0.97× at batch 8 (8 of 8), measured against its Winograd layers in the same process
/// (`bench/ab.py --control`, which the reach does not touch); single layers timed process
/// against process had said 0.86–1.1×, either way, from one session to the next. A kernel
/// clearly behind (an Emerald Rapids core: up to 1.31×, and ResNet-50 FP32 15% faster
/// without it) still stops it.
pub const SMALL_K_TIE: f64 = 1.05;

/// The deepest K up to which the FP32 GEMM takes its small-K kernel: the deepest of
/// [`SMALL_K_DEPTHS`] at which that kernel was not behind the register tile (its time at most
/// [`SMALL_K_TIE`] of the tile's), with every shallower one not behind either (0: never).
/// `None` where the SIMD path has no small-K kernel.
pub fn small_k_reach() -> Option<usize> {
    static REACH: OnceLock<Option<usize>> = OnceLock::new();
    *REACH.get_or_init(|| {
        // A path without the kernel (AVX2, portable: forced, or all the CPU has) has nothing
        // to choose, whatever the cache kept for the AVX-512 kernels.
        let max = super::sgemm::small_k_max();
        if max == 0 {
            return None;
        }
        // AVX2's kernel is not AVX-512's: each path's reach is kept apart, so a forced AVX2
        // path on an AVX-512 CPU measures its own (it took AVX-512's 64 from the cache for a
        // kernel that may go to 1024).
        let avx2 = super::simd::simd() == super::simd::Simd::Avx2Fma;
        kept(
            cache_path().as_deref(),
            &cpu_identity(),
            |e| match avx2 {
                true => e.small_k_reach_avx2,
                false => e.small_k_reach,
            },
            |e, r| match avx2 {
                true => e.small_k_reach_avx2 = Some(r),
                false => e.small_k_reach = Some(r),
            },
            || {
                let depths = SMALL_K_DEPTHS.into_iter().filter(|&k| k <= max);
                reach_of(depths.map(|k| Some((k, super::sgemm::stationary_over_tile(k)?))))
            },
        )
    })
}

/// How much faster than writing apart writing a layer's output over its residual must
/// measure for the FP32 layers to do it ([`over_residual`]): level keeps the output apart,
/// the way every CPU ran before the probe.
pub const OVER_RESIDUAL_FROM: f64 = 0.97;

/// What the over-residual probe found on this CPU, with the SIMD path it measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OverResidual {
    /// The GEMM's time written over its residual over its time written apart, on one core.
    pub over_apart: f64,
}

impl OverResidual {
    /// Whether layers with a residual (FP32 in one K block, BF16 on pairs) should write their
    /// output over it.
    pub fn pays(self) -> bool {
        self.over_apart <= OVER_RESIDUAL_FROM
    }

    /// What was chosen and why, for `doctor`.
    pub fn describe(self) -> String {
        let chose = match self.pays() {
            true => "layers with a residual write their output over it",
            false => "layers with a residual write their output apart from it",
        };
        format!(
            "{chose}: over it took {:.2}× the time here (measured once, kept in {CACHE_FILE})",
            self.over_apart
        )
    }
}

/// Whether an FP32 GEMM that adds a residual writes its output over the residual's buffer
/// (the residual's last reader, in one K block), measured once per CPU and SIMD path
/// (`sgemm`'s `over_residual_over_apart`). Apart, the output's lines are fetched for the
/// stores while the residual's stream in beside them; over it, they are one stream. On an
/// Emerald Rapids Xeon (two 512-bit FMA units, 2 MiB L2 a core; the probe 0.86–0.87×)
/// ResNet-50 FP32's 1×1 kernels took 0.941× the time at batch 8 and 0.948× at 1 that way (7
/// of 8 rounds each, over its unchanged Winograd kernels), the step 0.944× at batch 8; a Zen
/// 4 had read the network 1.28–1.32× before C's prefetches went to L2, and since then its
/// probe reads 0.75–0.92 and the network level (ResNet-50's 1×1 kernels FP32 1.001× at batch
/// 8 and 1.005× at 1, BF16 0.973× at 8; 8 rounds each).
pub fn over_residual() -> OverResidual {
    static OVER: OnceLock<OverResidual> = OnceLock::new();
    *OVER.get_or_init(|| {
        let path = super::simd::simd().name().to_string();
        let over_apart = kept(
            cache_path().as_deref(),
            &cpu_identity(),
            |e| e.over_residual.get(&path).copied(),
            |e, r| {
                e.over_residual.insert(path.clone(), r);
            },
            || Some(super::sgemm::over_residual_over_apart()),
        )
        .unwrap_or(1.0);
        OverResidual { over_apart }
    })
}

/// The small-K reach from the probe's (depth, small-K time over the tile's) pairs,
/// shallowest first ([`small_k_reach`]); `None` where a measurement is missing.
fn reach_of(measured: impl IntoIterator<Item = Option<(usize, f64)>>) -> Option<usize> {
    let mut reach = 0;
    for m in measured {
        let (k, ratio) = m?;
        if ratio > SMALL_K_TIE {
            break;
        }
        reach = k;
    }
    Some(reach)
}

/// The cache's name in the cache folder.
pub const CACHE_FILE: &str = "simd.json";

/// Where the probes' results are kept, if anywhere.
pub fn cache_path() -> Option<PathBuf> {
    Some(crate::settings::cache_dir()?.join(CACHE_FILE))
}

/// One CPU's measurements (each absent until its probe first ran there).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Entry {
    /// Brand string, CPUID signature and kernels' build ([`cpu_identity`]).
    cpu: String,
    #[serde(default)]
    dot_per_fma: Option<f64>,
    /// The AVX-512 small-K kernel's reach.
    #[serde(default)]
    small_k_reach: Option<usize>,
    /// The AVX2 small-K kernel's (where that path runs, forced or the best the CPU has).
    #[serde(default)]
    small_k_reach_avx2: Option<usize>,
    /// The over-residual probe's ratio, per SIMD path ([`over_residual`]).
    #[serde(default)]
    over_residual: std::collections::BTreeMap<String, f64>,
    #[serde(default)]
    measured_unix: u64,
}

/// The value `get` reads from `cpu`'s entry in the cache at `path`, else `measure()`'s, which
/// `set` writes into that entry (the entry's other values and the other CPUs' entries stay).
/// A cache that cannot be read is measured over; one that cannot be written costs the next
/// process the probe again. A result of `None` (nothing to choose on this CPU) is not kept.
fn kept<T: Copy>(
    path: Option<&Path>,
    cpu: &str,
    get: impl Fn(&Entry) -> Option<T>,
    set: impl Fn(&mut Entry, T),
    measure: impl FnOnce() -> Option<T>,
) -> Option<T> {
    let mut all: Vec<Entry> = path
        .and_then(|p| crate::files::read_text(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    if let Some(v) = all.iter().find(|e| e.cpu == cpu).and_then(&get) {
        return Some(v);
    }
    let value = measure()?;
    if let Some(path) = path {
        // The same CPU's entries for other builds of the kernels go: each build of the
        // backend's source measures anew, and a developer's cache kept one entry per build.
        let part = |id: &str| id.split(KERNELS_SEP).next().unwrap_or_default().to_string();
        all.retain(|e| e.cpu == cpu || part(&e.cpu) != part(cpu));
        let at = match all.iter().position(|e| e.cpu == cpu) {
            Some(i) => i,
            None => {
                all.push(Entry {
                    cpu: cpu.to_string(),
                    ..Entry::default()
                });
                all.len() - 1
            }
        };
        set(&mut all[at], value);
        all[at].measured_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if let Ok(text) = serde_json::to_string_pretty(&all) {
            let _ = crate::files::write_atomic(path, text.as_bytes());
        }
    }
    Some(value)
}

/// What separates the CPU from the kernels' build in [`cpu_identity`].
const KERNELS_SEP: &str = ", kernels ";

/// The CPU as the cache knows it: its brand string and CPUID signature (family, model and
/// stepping), which a virtual machine may report alike for different hosts only when they
/// are the same part; and the build of the kernels measured ([`super::source_hash`]).
fn cpu_identity() -> String {
    let kernels = super::source_hash();
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
        format!(
            "{} (CPUID signature {signature:#x}){KERNELS_SEP}{kernels:016x}",
            brand.trim_matches(['\0', ' '])
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    format!("{}{KERNELS_SEP}{kernels:016x}", std::env::consts::ARCH)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// The first process measures and keeps the result; later ones read it without
    /// measuring; another CPU's entry is measured beside it, not over it; another probe's
    /// value joins the CPU's entry; a broken cache is measured over.
    #[test]
    fn each_probe_runs_once_per_cpu() {
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
        let dots = |p: Option<&Path>, cpu: &str, m: &dyn Fn() -> Option<f64>| {
            kept(p, cpu, |e| e.dot_per_fma, |e, r| e.dot_per_fma = Some(r), m)
        };
        assert_eq!(dots(Some(&path), "a", &measure(0.5)), Some(0.5));
        assert_eq!(dots(Some(&path), "a", &measure(2.0)), Some(0.5));
        assert_eq!(runs.get(), 1);
        assert_eq!(dots(Some(&path), "b", &measure(2.0)), Some(2.0));
        assert_eq!(dots(Some(&path), "a", &measure(9.0)), Some(0.5));
        assert_eq!(dots(Some(&path), "b", &measure(9.0)), Some(2.0));
        assert_eq!(runs.get(), 2);
        let reach = |m: usize| {
            kept(
                Some(&path),
                "a",
                |e| e.small_k_reach,
                |e, r| e.small_k_reach = Some(r),
                || Some(m),
            )
        };
        assert_eq!(reach(32), Some(32));
        assert_eq!(reach(64), Some(32));
        assert_eq!(dots(Some(&path), "a", &measure(9.0)), Some(0.5));
        std::fs::write(&path, "{ not json").unwrap();
        assert_eq!(dots(Some(&path), "a", &measure(1.5)), Some(1.5));
        assert_eq!(dots(Some(&path), "a", &measure(9.0)), Some(1.5));
        // Nothing to measure (no AVX512_BF16): nothing kept, nothing chosen.
        assert_eq!(dots(Some(&path), "c", &|| None), None);
        assert_eq!(runs.get(), 3);
        // No cache folder: measured every time.
        assert_eq!(dots(None, "a", &measure(0.7)), Some(0.7));
        assert_eq!(runs.get(), 4);
        // A new build of the kernels on a CPU replaces that CPU's entry for the old build;
        // other CPUs' entries stay.
        let (old, new) = (
            "x (CPUID signature 0x1), kernels 01",
            "x (CPUID signature 0x1), kernels 02",
        );
        assert_eq!(dots(Some(&path), old, &measure(0.5)), Some(0.5));
        assert_eq!(dots(Some(&path), new, &measure(2.0)), Some(2.0));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(old) && text.contains(new), "{text}");
        assert_eq!(dots(Some(&path), "a", &measure(9.0)), Some(1.5));
        assert_eq!(runs.get(), 6);
    }

    /// The reach stops at the first depth where the small-K kernel is clearly behind; a tie
    /// keeps it going.
    #[test]
    fn the_small_k_reach_stops_where_the_kernel_falls_behind() {
        let reach = |r: &[f64]| reach_of(SMALL_K_DEPTHS.iter().zip(r).map(|(&k, &r)| Some((k, r))));
        assert_eq!(reach(&[0.7, 0.8, 0.9, 0.99, 1.04]), Some(1024));
        assert_eq!(reach(&[0.7, 0.8, 0.9, 1.08, 0.9]), Some(64));
        assert_eq!(reach(&[1.1, 0.9, 0.9, 0.9, 0.9]), Some(0));
        // AVX-512's kernel stops at 64: fewer depths measured.
        assert_eq!(reach(&[0.6, 0.7, 0.8]), Some(64));
        assert_eq!(reach_of([Some((16, 0.7)), None]), None);
    }

    #[test]
    fn the_pairs_pay_from_an_fmas_rate() {
        assert!(Bf16Pairs { dot_per_fma: 1.97 }.pay());
        assert!(!Bf16Pairs { dot_per_fma: 0.51 }.pay());
        // The GEMMs' pairs pay at an FMA's rate (they halve the bytes read); the depthwise
        // ones, which make their pairs per input pixel, only well above it.
        let level = Bf16Pairs { dot_per_fma: 1.0 };
        assert!(level.pay() && !level.depthwise_pays());
        assert!(Bf16Pairs { dot_per_fma: 1.97 }.depthwise_pays());
        let said = Bf16Pairs { dot_per_fma: 0.51 }.describe();
        assert!(said.contains("widens") && said.contains("0.51×"), "{said}");
    }

    #[test]
    fn writing_over_the_residual_pays_only_clearly_faster() {
        let at = |over_apart| OverResidual { over_apart };
        assert!(at(0.86).pays() && !at(0.99).pays() && !at(1.3).pays());
        let said = at(0.86).describe();
        assert!(said.contains("over it") && said.contains("0.86×"), "{said}");
        assert!(at(1.3).describe().contains("apart"));
        // Measured here: a ratio no core could be off by more than 3× either way.
        let r = super::super::sgemm::over_residual_over_apart();
        assert!((0.33..3.0).contains(&r), "{r}");
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

    /// Every source file of the CPU backend is in the hash that keys the probes' cache (the
    /// unit tests apart).
    #[test]
    fn the_source_hash_covers_every_file() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cpu");
        let listed = std::fs::read_to_string(root.join("mod.rs")).unwrap();
        let mut stack = vec![root.clone()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.file_name().is_some_and(|n| n != "tests.rs") {
                    let rel = path.strip_prefix(&root).unwrap().to_str().unwrap();
                    assert!(
                        listed.contains(&format!("\"{rel}\",")),
                        "{rel} is not hashed"
                    );
                }
            }
        }
    }
}

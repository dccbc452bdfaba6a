//! Which SIMD code paths the CPU kernels take: chosen once per process from what the CPU
//! supports, or forced with `WORKSHOP_CPU_SIMD` to a lesser path the CPU also runs (`avx2` on
//! an AVX-512 CPU, `portable` anywhere), to test and time the paths that other CPUs take.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// Plain Rust that the compiler vectorises for the target's baseline (SSE2 on x86-64).
    Portable,
    /// AVX2 and FMA (x86-64 since Haswell and Zen).
    Avx2Fma,
    /// AVX-512 Foundation, BW and VL (with AVX2 and FMA), without bf16 pairs: Skylake-SP,
    /// Cascade Lake, Ice Lake.
    Avx512,
    /// AVX-512 and AVX512_BF16 (Zen 4 and 5, Cooper Lake): BF16 sessions' convolutions
    /// multiply bf16 pairs with `vdpbf16ps` ([`super::bf16_gemm`]), the rest as on AVX-512.
    /// Taken only where the start-up probe finds the pairs pay ([`super::probe`]); a CPU
    /// whose `vdpbf16ps` is slower than its FMAs takes [`Simd::Avx512`].
    Avx512Bf16,
    /// AVX-512 and AMX's BF16 tiles (Sapphire Rapids and later Xeons): BF16 sessions'
    /// convolutions run on the tiles ([`super::amx`]), the rest as on AVX-512.
    Amx,
}

impl Simd {
    /// Whether these paths include AVX2 + FMA (AVX-512 CPUs have them too).
    pub fn has_avx2(self) -> bool {
        self >= Simd::Avx2Fma
    }

    /// The name `WORKSHOP_CPU_SIMD` knows it by.
    pub fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            Simd::Avx2Fma => "avx2",
            Simd::Avx512 => "avx512",
            Simd::Avx512Bf16 => "avx512bf16",
            Simd::Amx => "amx",
        }
    }
}

/// The environment variable that forces a path.
pub const ENV: &str = crate::settings::CPU_SIMD;

/// The paths `WORKSHOP_CPU_SIMD` asked for, if any.
fn asked() -> Option<Simd> {
    use crate::settings::SimdChoice;
    let asked = crate::settings::get().ok()?.cpu_simd?;
    Some(match asked {
        SimdChoice::Portable => Simd::Portable,
        SimdChoice::Avx2 => Simd::Avx2Fma,
        SimdChoice::Avx512 => Simd::Avx512,
        SimdChoice::Avx512Bf16 => Simd::Avx512Bf16,
        SimdChoice::Amx => Simd::Amx,
    })
}

/// The paths in use: the ones asked for where the CPU runs them, else the ones that pay
/// ([`preferred`]).
pub fn simd() -> Simd {
    static SIMD: OnceLock<Simd> = OnceLock::new();
    *SIMD.get_or_init(|| forced().unwrap_or_else(preferred))
}

/// The paths [`ENV`] asked for, where this CPU runs them.
fn forced() -> Option<Simd> {
    asked().filter(|&a| a <= best())
}

/// Why the paths asked for are not the ones in use, for the command layer to warn about.
pub fn warning() -> Option<String> {
    let asked = asked().filter(|&a| a > best())?;
    Some(format!(
        "{ENV}={}: this CPU cannot run those paths: using {}",
        asked.name(),
        simd().name()
    ))
}

/// The paths in use and why, for `doctor`: forced by [`ENV`], or the best this CPU has, with
/// the probe's choice where it made one.
pub fn explain() -> String {
    let mut said = format!("SIMD paths {}", simd().name());
    if forced().is_some() {
        said.push_str(&format!(" (forced by {ENV})"));
    } else if let Some(p) = probed() {
        said.push_str(&format!("; {}", p.describe()));
    }
    // (Where the probe chose, its description says so already.)
    if let Some(why) = bf16_widened().filter(|_| probed().is_none()) {
        said.push_str(&format!("; BF16 multiplied as FP32 ({why})"));
    }
    match super::probe::small_k_reach() {
        Some(0) => {
            said.push_str("; FP32 small-K kernel not used: it lost to the register tile here")
        }
        Some(k) => said.push_str(&format!("; FP32 small-K kernel up to K {k}")),
        None => {}
    }
    if let Some(p) =
        super::probe::bf16_pairs().filter(|_| matches!(simd(), Simd::Avx512Bf16 | Simd::Amx))
    {
        let how = match depthwise_pairs() {
            true => "on vdpbf16ps",
            false => "on the FP32 FMAs",
        };
        said.push_str(&format!(
            "; BF16 depthwise layers {how} (vdpbf16ps at {:.2}× the FMAs' FLOP rate; pairs from {:.1}×)",
            p.dot_per_fma,
            super::probe::DEPTHWISE_FROM
        ));
    }
    said.push_str(&format!("; {}", super::probe::over_residual().describe()));
    said
}

/// Why BF16 sessions widen every value to FP32 before it is multiplied, where they do (every
/// path but AVX512_BF16's pairs and AMX's tiles): they still halve the bytes stored and
/// moved, but add conversions that FP32 does not have, so on such a CPU `--precision bf16`
/// is usually slower than FP32 (MobileNetV3-Large at batch 8 on a Zen 3: 136 against 178
/// images/s).
pub fn bf16_widened() -> Option<&'static str> {
    match (simd(), best()) {
        (Simd::Avx512Bf16 | Simd::Amx, _) => None,
        (_, Simd::Avx512Bf16 | Simd::Amx) if forced().is_some() => {
            Some("the paths forced have no BF16 multiply")
        }
        (_, Simd::Avx512Bf16) => Some("vdpbf16ps lost the start-up probe to the FP32 FMAs"),
        _ => Some("this CPU has neither AVX512_BF16 nor AMX"),
    }
}

/// The probe's result where it chose the paths in use: on a CPU with AVX512_BF16 (without
/// AMX), unless [`ENV`] forced them.
pub fn probed() -> Option<super::probe::Bf16Pairs> {
    (forced().is_none() && best() == Simd::Avx512Bf16).then(super::probe::bf16_pairs)?
}

/// The best paths of this CPU that pay: [`best`], except that AVX512_BF16's pairs give way
/// to the FP32 FMAs where the start-up probe found `vdpbf16ps` slower than them, FLOP for
/// FLOP ([`super::probe::bf16_pairs`]).
pub fn preferred() -> Simd {
    match best() {
        Simd::Avx512Bf16 if super::probe::bf16_pairs().is_some_and(|p| !p.pay()) => Simd::Avx512,
        b => b,
    }
}

/// Whether BF16 depthwise layers multiply bf16 pairs (`vdpbf16ps`) on the paths in use: where
/// those multiply pairs and the probe found `vdpbf16ps` fast enough for the depthwise kernels
/// ([`super::probe::Bf16Pairs::depthwise_pays`]; on AMX CPUs too, whose GEMMs take the tiles
/// whatever the probe says).
pub fn depthwise_pairs() -> bool {
    matches!(simd(), Simd::Avx512Bf16 | Simd::Amx)
        && super::probe::bf16_pairs().is_some_and(|p| p.depthwise_pays())
}

/// The best paths this CPU can run.
pub fn best() -> Simd {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // The AVX-512 paths ask for BW and VL beside F (bf16 loads of 16 lanes, masked):
        // every AVX-512 core since Skylake-SP has them; Xeon Phi, which has not, runs AVX2.
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl");
        return if !avx512 {
            Simd::Avx2Fma
        } else if super::amx::available() {
            Simd::Amx
        } else if std::arch::is_x86_feature_detected!("avx512bf16") {
            Simd::Avx512Bf16
        } else {
            Simd::Avx512
        };
    }
    Simd::Portable
}

/// Whether the AVX2 paths are in use and the CPU also converts f16 in hardware (F16C).
pub fn f16c() -> bool {
    static F16C: OnceLock<bool> = OnceLock::new();
    *F16C.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if simd().has_avx2() {
            return std::arch::is_x86_feature_detected!("f16c");
        }
        false
    })
}

/// Work that [`with_simd`] compiles for the widest vectors in use: loops over floats that
/// the compiler vectorises 8 wide with AVX2 and 16 with AVX-512, instead of the baseline's 4.
///
/// `run` must be `#[inline(always)]`, and so must every function it calls whose loops should
/// be vectorised: only code inlined into `with_simd`'s target-feature functions is compiled
/// with their features. A closure is not enough: the compiler is free not to inline a large
/// one, and then its loops run on the baseline's SSE. The Winograd transforms did, at every
/// width, while they were passed as closures (the disassembly showed only xmm registers).
pub trait Vectorised {
    type Output;
    fn run(self) -> Self::Output;
}

/// Run `work` compiled for the widest vectors `simd()` chose (see [`Vectorised`]).
#[inline(always)]
pub fn with_simd<W: Vectorised>(work: W) -> W::Output {
    #[cfg(target_arch = "x86_64")]
    {
        /// # Safety
        /// The CPU supports AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<W: Vectorised>(work: W) -> W::Output {
            work.run()
        }
        /// # Safety
        /// The CPU supports AVX-512F.
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512<W: Vectorised>(work: W) -> W::Output {
            work.run()
        }
        match simd() {
            // SAFETY: `simd()` chooses a path only where the CPU has its features.
            Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx => return unsafe { avx512(work) },
            // SAFETY: as above: this path is chosen only on a CPU with AVX2 and FMA.
            Simd::Avx2Fma => return unsafe { avx2(work) },
            Simd::Portable => {}
        }
    }
    work.run()
}

/// `f(d)` for each element of a slice, as [`Vectorised`] work (`f` as for [`ZipWith`]). An `f`
/// that keeps a value where a condition holds may become a masked store on AVX2 (see
/// [`map_in_place`]); through `map_in_place` instead, BF16's ReLU on bits (a select with `||`)
/// ran as scalar code and an eager BF16 ResNet-50 at batch 8 took 1.35× as long.
pub struct Update<'a, D, F>(pub &'a mut [D], pub F);

impl<D, F: Fn(&mut D)> Vectorised for Update<'_, D, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Update(dst, f) = self;
        dst.iter_mut().for_each(f);
    }
}

/// Each value of `values` replaced by `f` of it, a fixed run of values at a time mapped by
/// value and stored whole (inline it into [`Vectorised`] work). Updated one by one in place
/// (`*v = f(*v)`), an `f` that is a select (ReLU keeping a value, a clamp) was compiled into a
/// store only where the value changes, a masked store (`vmaskmovps`), which AMD's cores run
/// slowly: on a Zen 3, ReLU on a BF16 ResNet-50's f32 sums took 4.5% of a batch-8 run. Check
/// the profile of each new use: an `f` the compiler does not vectorise here runs as scalar
/// code (`array::from_fn` may also stay a call of its own).
#[inline(always)]
pub fn map_in_place<D: Copy>(values: &mut [D], f: impl Fn(D) -> D) {
    let (runs, tail) = values.as_chunks_mut::<16>();
    for run in runs {
        // Read through `black_box`, the stored run is no longer seen as the loaded one where
        // `f` keeps a value: mapped by value alone, the compiler still stored only the changed
        // values, through masks.
        let src = std::hint::black_box(*run);
        *run = std::array::from_fn(|i| f(src[i]));
    }
    for v in tail {
        *v = f(*v);
    }
}

/// `f(d, s)` for each pair of `dst` and `src` elements (the shorter's length), as
/// [`Vectorised`] work: the element-wise loops. `f` should be a small per-element closure
/// (the compiler inlines those; the loop around it is what must be inlined for sure).
pub struct ZipWith<'a, D, S, F>(pub &'a mut [D], pub &'a [S], pub F);

impl<D, S, F: Fn(&mut D, &S)> Vectorised for ZipWith<'_, D, S, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let ZipWith(dst, src, f) = self;
        // An indexed loop, not `zip(..).for_each(..)`: the zip's `fold` was compiled as a
        // function of its own, for SSE2, outside every `with_simd` path (8 values a step: 8%
        // of a BF16 MobileNetV3 bench process's samples, preparation included).
        let n = dst.len().min(src.len());
        let (dst, src) = (&mut dst[..n], &src[..n]);
        for i in 0..n {
            f(&mut dst[i], &src[i]);
        }
    }
}

/// Independent FMA chains per thread in [`fma_ceiling`]: enough to keep two FMA units busy
/// through a latency of up to 6 cycles.
const CHAINS: usize = 12;

/// `iters` rounds of x ← x·b + c (fused) on `CHAINS` chains of 16 (zmm) or 8 (ymm) floats,
/// all in registers; chain i starts at i. Returns each chain's first lane, so the work can't be
/// optimised away and can be checked against the scalar recurrence.
///
/// Each round is one `asm!` block of `CHAINS` FMA instructions on registers. Written as plain
/// loops over arrays, the compiler was free to reorder the work, and did (Rust 1.95): it
/// vectorised across the chains with gathers and scatters through memory, and the "ceiling"
/// on a Zen 5 read 6.4 GFLOP/s against a GEMM of 365.
#[cfg(target_arch = "x86_64")]
mod chains {
    use super::CHAINS;
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// One round of the recurrence on every chain: `$x` an array of `CHAINS` vectors held in
    /// `$class` registers, `$b` and `$c` vectors of the same class.
    macro_rules! round {
        ($class:ident, $x:ident, $b:ident, $c:ident) => {
            asm!(
                "vfmadd213ps {0}, {b}, {c}",
                "vfmadd213ps {1}, {b}, {c}",
                "vfmadd213ps {2}, {b}, {c}",
                "vfmadd213ps {3}, {b}, {c}",
                "vfmadd213ps {4}, {b}, {c}",
                "vfmadd213ps {5}, {b}, {c}",
                "vfmadd213ps {6}, {b}, {c}",
                "vfmadd213ps {7}, {b}, {c}",
                "vfmadd213ps {8}, {b}, {c}",
                "vfmadd213ps {9}, {b}, {c}",
                "vfmadd213ps {10}, {b}, {c}",
                "vfmadd213ps {11}, {b}, {c}",
                inout($class) $x[0], inout($class) $x[1], inout($class) $x[2],
                inout($class) $x[3], inout($class) $x[4], inout($class) $x[5],
                inout($class) $x[6], inout($class) $x[7], inout($class) $x[8],
                inout($class) $x[9], inout($class) $x[10], inout($class) $x[11],
                b = in($class) $b, c = in($class) $c,
                options(nomem, nostack),
            )
        };
    }
    const _: () = assert!(CHAINS == 12, "`round!` names twelve chains");

    /// 16 lanes a chain (zmm registers).
    ///
    /// # Safety
    /// The CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn zmm(iters: u64, b: f32, c: f32) -> [f32; CHAINS] {
        let (b, c) = (_mm512_set1_ps(b), _mm512_set1_ps(c));
        let mut x: [__m512; CHAINS] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
        for _ in 0..iters {
            // SAFETY: register-only FMAs; the CPU has AVX-512F (the contract).
            unsafe { round!(zmm_reg, x, b, c) };
        }
        x.map(|v| _mm512_cvtss_f32(v))
    }

    /// `iters` rounds of x ← x + a·b on `CHAINS` chains of 16 f32 lanes, each lane adding the
    /// dot product of a pair of bf16 values (`vdpbf16ps`, what the BF16 GEMM multiplies with);
    /// `a` and `b` are each a pair of bf16 values, both lanes of a pair alike, packed in a u32.
    ///
    /// # Safety
    /// The CPU supports AVX-512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn bf16_dots(iters: u64, a: u32, b: u32) -> [f32; CHAINS] {
        let (a, b) = (_mm512_set1_epi32(a as i32), _mm512_set1_epi32(b as i32));
        let mut x: [__m512; CHAINS] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
        for _ in 0..iters {
            // SAFETY: register-only dot products; the CPU has AVX512_BF16 (the contract).
            unsafe {
                asm!(
                    "vdpbf16ps {0}, {a}, {b}",
                    "vdpbf16ps {1}, {a}, {b}",
                    "vdpbf16ps {2}, {a}, {b}",
                    "vdpbf16ps {3}, {a}, {b}",
                    "vdpbf16ps {4}, {a}, {b}",
                    "vdpbf16ps {5}, {a}, {b}",
                    "vdpbf16ps {6}, {a}, {b}",
                    "vdpbf16ps {7}, {a}, {b}",
                    "vdpbf16ps {8}, {a}, {b}",
                    "vdpbf16ps {9}, {a}, {b}",
                    "vdpbf16ps {10}, {a}, {b}",
                    "vdpbf16ps {11}, {a}, {b}",
                    inout(zmm_reg) x[0], inout(zmm_reg) x[1], inout(zmm_reg) x[2],
                    inout(zmm_reg) x[3], inout(zmm_reg) x[4], inout(zmm_reg) x[5],
                    inout(zmm_reg) x[6], inout(zmm_reg) x[7], inout(zmm_reg) x[8],
                    inout(zmm_reg) x[9], inout(zmm_reg) x[10], inout(zmm_reg) x[11],
                    a = in(zmm_reg) a, b = in(zmm_reg) b,
                    options(nomem, nostack),
                )
            };
        }
        x.map(|v| _mm512_cvtss_f32(v))
    }

    /// 8 lanes a chain (ymm registers).
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn ymm(iters: u64, b: f32, c: f32) -> [f32; CHAINS] {
        let (b, c) = (_mm256_set1_ps(b), _mm256_set1_ps(c));
        let mut x: [__m256; CHAINS] = std::array::from_fn(|i| _mm256_set1_ps(i as f32));
        for _ in 0..iters {
            // SAFETY: register-only FMAs; the CPU has AVX2 and FMA (the contract).
            unsafe { round!(ymm_reg, x, b, c) };
        }
        x.map(|v| _mm256_cvtss_f32(v))
    }
}

/// The recurrence's multiplier and addend: x converges to 1, never denormal or infinite.
const CHAIN_B: f32 = 0.999_9;
const CHAIN_C: f32 = 1e-4;

/// A run of the FMA chains at some width: rounds in, chain results out.
type ChainsRun = fn(u64) -> [f32; CHAINS];

/// FP32 FLOPs of one round of the FMA chains at the width `simd()` chose, and the run itself;
/// `None` on the portable paths (no FMA instruction to time).
fn fma_chains() -> Option<(u64, ChainsRun)> {
    #[cfg(target_arch = "x86_64")]
    {
        fn zmm(iters: u64) -> [f32; CHAINS] {
            // SAFETY: chosen below only where `simd()` has AVX-512F.
            unsafe { chains::zmm(iters, CHAIN_B, CHAIN_C) }
        }
        fn ymm(iters: u64) -> [f32; CHAINS] {
            // SAFETY: chosen below only where `simd()` has AVX2 and FMA.
            unsafe { chains::ymm(iters, CHAIN_B, CHAIN_C) }
        }
        match simd() {
            Simd::Portable => None,
            Simd::Avx2Fma => Some((2 * 8 * CHAINS as u64, ymm)),
            _ => Some((2 * 16 * CHAINS as u64, zmm)),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The FP32 FMA throughput of `threads` cores in GFLOP/s, measured: every thread runs
/// independent fused multiply-adds on registers only (no memory traffic), at the widest
/// vectors in use, started together; best of seven runs of about 30 ms (a ceiling is a best
/// case: on a shared virtual machine one of three runs was not always free of a neighbour —
/// a ceiling at half the clock once made the GEMM "157% of it"). What the cores can compute
/// at the clock they run now: the ceiling any kernel can reach. `None` where the paths in use
/// have no FMA instruction (the portable ones).
pub fn fma_ceiling(threads: usize) -> Option<f64> {
    let (flops_per_iter, run) = fma_chains()?;
    Some(chains_gflops(flops_per_iter, run, threads, (7, 0.03)))
}

/// One run of the chains a ceiling is measured on, for about `seconds` on `threads` threads
/// started together, in GFLOP/s: [`fma_ceiling`]'s, or [`bf16_ceiling`]'s where `bf16` and it
/// has its own. What the cores computed just now, to time beside a kernel of that length
/// (`workshop peak` runs one before each GEMM): on a shared machine the cores' rate moves
/// between the best moment a ceiling keeps and the moments a kernel runs.
pub fn ceiling_now(threads: usize, seconds: f64, bf16: bool) -> Option<f64> {
    let (flops_per_iter, run) = bf16.then(bf16_chains).flatten().or_else(fma_chains)?;
    Some(chains_gflops(flops_per_iter, run, threads, (1, seconds)))
}

/// A pair of bf16 values (both 1/64) packed as `vdpbf16ps` reads them: x grows by 2⁻¹¹ a
/// round, far from overflow in any run.
const BF16_PAIR: u32 = 0x3c80_3c80;

/// The BF16 throughput of `threads` cores in GFLOP/s, measured like [`fma_ceiling`] on the
/// instruction the BF16 GEMM multiplies with: `vdpbf16ps` (2 products and 2 additions per f32
/// lane) on the AVX512_BF16 path, `tdpbf16ps` on AMX's tiles (four independent 16 × 16 × 32
/// products a round, `amx::chains`). `None` where BF16 is widened to FP32 (the FMA ceiling is
/// its ceiling).
pub fn bf16_ceiling(threads: usize) -> Option<f64> {
    let (flops_per_iter, run) = bf16_chains()?;
    Some(chains_gflops(flops_per_iter, run, threads, (7, 0.03)))
}

/// FLOPs of one round of [`bf16_ceiling`]'s chains and the run itself; `None` where BF16 is
/// widened to FP32.
fn bf16_chains() -> Option<(u64, ChainsRun)> {
    #[cfg(target_arch = "x86_64")]
    match simd() {
        Simd::Avx512Bf16 => {
            fn run(iters: u64) -> [f32; CHAINS] {
                // SAFETY: chosen only where `simd()` has AVX512_BF16.
                unsafe { chains::bf16_dots(iters, BF16_PAIR, BF16_PAIR) }
            }
            return Some((4 * 16 * CHAINS as u64, run));
        }
        Simd::Amx => {
            fn run(iters: u64) -> [f32; CHAINS] {
                // SAFETY: `simd()` is Amx only where `amx::available()`.
                unsafe { super::amx::chains(iters) }
            }
            return Some((super::amx::CHAIN_FLOPS, run));
        }
        _ => {}
    }
    None
}

/// `vdpbf16ps`'s FLOP rate over the FMAs' on one core, measured now on registers at 16 lanes:
/// the two kinds of chains alternate, about 2 ms a run, and the best of five runs of each
/// counts (a quick probe, not a ceiling: [`fma_ceiling`] and [`bf16_ceiling`] measure
/// those). `None` where the CPU lacks AVX512_BF16. Calls nothing that asks [`simd`], which
/// may be choosing its paths with this.
pub(super) fn dot_per_fma() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if best() >= Simd::Avx512Bf16 {
        fn fma(iters: u64) -> [f32; CHAINS] {
            // SAFETY: run only where `best()` has AVX512_BF16, so AVX-512F.
            unsafe { chains::zmm(iters, CHAIN_B, CHAIN_C) }
        }
        fn dot(iters: u64) -> [f32; CHAINS] {
            // SAFETY: run only where `best()` has AVX512_BF16.
            unsafe { chains::bf16_dots(iters, BF16_PAIR, BF16_PAIR) }
        }
        // GFLOP/s of one run of `iters` rounds.
        let rate = |run: ChainsRun, flops_per_iter: u64, iters: u64| {
            let start = std::time::Instant::now();
            std::hint::black_box(run(iters));
            (iters * flops_per_iter) as f64 / start.elapsed().as_secs_f64().max(1e-9) / 1e9
        };
        let (fma_flops, dot_flops) = (2 * 16 * CHAINS as u64, 4 * 16 * CHAINS as u64);
        let probe = 1 << 12;
        let iters = ((2e-3 * rate(fma, fma_flops, probe) * 1e9 / fma_flops as f64) as u64)
            .clamp(probe, 1 << 24);
        let (mut fmas, mut dots) = (0f64, 0f64);
        for _ in 0..5 {
            fmas = fmas.max(rate(fma, fma_flops, iters));
            dots = dots.max(rate(dot, dot_flops, iters));
        }
        return Some(dots / fmas);
    }
    None
}

/// GFLOP/s of `run` on `threads` threads started together, `flops_per_iter` a round: the best
/// of `runs` runs of about `seconds` each (calibrated on one thread).
fn chains_gflops(
    flops_per_iter: u64,
    run: ChainsRun,
    threads: usize,
    (runs, seconds): (usize, f64),
) -> f64 {
    let threads = threads.max(1);
    // Calibrate on one thread: rounds for about `seconds` (no fewer than the probe's).
    let probe = 1 << 16;
    let start = std::time::Instant::now();
    std::hint::black_box(run(probe));
    let per_iter = start.elapsed().as_secs_f64() / probe as f64;
    let iters = ((seconds / per_iter.max(1e-12)) as u64).clamp(probe, 1 << 32);
    let mut best = 0f64;
    for _ in 0..runs {
        let barrier = std::sync::Barrier::new(threads);
        let longest = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        let start = std::time::Instant::now();
                        std::hint::black_box(run(iters));
                        start.elapsed().as_secs_f64()
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap_or(f64::INFINITY))
                .fold(0f64, f64::max)
        });
        best = best.max((threads as u64 * iters * flops_per_iter) as f64 / longest / 1e9);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The FMA chains run every round they are asked for, fused, on every chain and lane:
    /// each chain's result equals the scalar recurrence's, bit for bit, at every width this
    /// CPU runs.
    #[test]
    fn fma_chains_compute_the_recurrence() {
        let iters = 1000;
        let scalar: [f32; CHAINS] =
            std::array::from_fn(|i| (0..iters).fold(i as f32, |x, _| x.mul_add(CHAIN_B, CHAIN_C)));
        #[cfg(target_arch = "x86_64")]
        {
            if best() >= Simd::Avx2Fma {
                // SAFETY: the CPU has AVX2 and FMA.
                assert_eq!(unsafe { chains::ymm(iters, CHAIN_B, CHAIN_C) }, scalar);
            }
            if best() >= Simd::Avx512 {
                // SAFETY: the CPU has AVX-512F.
                assert_eq!(unsafe { chains::zmm(iters, CHAIN_B, CHAIN_C) }, scalar);
            }
        }
        if let Some((_, run)) = fma_chains() {
            assert_eq!(run(iters), scalar);
        }
        #[cfg(target_arch = "x86_64")]
        if best() >= Simd::Avx512Bf16 {
            // 2 × (1/64)² a round, exact in f32 at these sizes.
            let dots: [f32; CHAINS] =
                std::array::from_fn(|i| i as f32 + iters as f32 * 2.0 / 4096.0);
            // SAFETY: the CPU has AVX512_BF16.
            let got = unsafe { chains::bf16_dots(iters, BF16_PAIR, BF16_PAIR) };
            assert_eq!(got, dots);
        }
        match fma_ceiling(1) {
            Some(gflops) => assert!(gflops > 0.0 && simd().has_avx2()),
            None => assert!(!simd().has_avx2()),
        }
    }
}

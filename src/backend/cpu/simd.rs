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
    /// AVX-512 Foundation (with AVX2 and FMA): Skylake-SP and later Xeons, Ice Lake, Zen 4.
    Avx512,
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
            Simd::Amx => "amx",
        }
    }
}

/// The environment variable that forces a path.
pub const ENV: &str = "WORKSHOP_CPU_SIMD";

/// The paths in use.
pub fn simd() -> Simd {
    static SIMD: OnceLock<Simd> = OnceLock::new();
    *SIMD.get_or_init(|| {
        let best = best();
        let asked = match std::env::var(ENV).as_deref() {
            Ok("") | Err(_) => return best,
            Ok("portable") => Simd::Portable,
            Ok("avx2") => Simd::Avx2Fma,
            Ok("avx512") => Simd::Avx512,
            Ok("amx") => Simd::Amx,
            Ok(other) => {
                eprintln!(
                    "warning: {ENV}={other} is not a choice (`portable`, `avx2`, `avx512`, \
                     `amx`, or unset for the best this CPU runs): using the best"
                );
                return best;
            }
        };
        if asked > best {
            eprintln!(
                "warning: {ENV}={}: this CPU cannot run those paths: using {}",
                asked.name(),
                best.name()
            );
            return best;
        }
        asked
    })
}

/// The best paths this CPU can run.
pub fn best() -> Simd {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return if !std::arch::is_x86_feature_detected!("avx512f") {
            Simd::Avx2Fma
        } else if super::amx::available() {
            Simd::Amx
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
            Simd::Avx512 | Simd::Amx => return unsafe { avx512(work) },
            Simd::Avx2Fma => return unsafe { avx2(work) },
            Simd::Portable => {}
        }
    }
    work.run()
}

/// `f(d)` for each element of a slice, as [`Vectorised`] work (`f` as for [`ZipWith`]).
pub struct Update<'a, D, F>(pub &'a mut [D], pub F);

impl<D, F: Fn(&mut D)> Vectorised for Update<'_, D, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Update(dst, f) = self;
        dst.iter_mut().for_each(f);
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
        dst.iter_mut().zip(src).for_each(|(d, s)| f(d, s));
    }
}

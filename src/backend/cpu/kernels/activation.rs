//! Activations over blocks of f32 values in place, for the epilogues of convolutions and
//! linear layers and the element-wise ops: the long ones (SiLU, the sigmoid, GELU) on AVX-512
//! or AVX2 intrinsics where the paths in use have them (one generic form over [`Vector`]),
//! every one otherwise as [`with_act`] compiles it into the caller's vectorised code.
//!
//! Plain Rust keeps every multiply and add apart (no contraction into FMAs), scales by 2^k
//! through integer bits and divides (`vdivps`, several times an FMA's cost). The intrinsics
//! evaluate the same functions with FMAs, `vscalefps` for 2^k (AVX2: the exponent bits), and
//! take the sigmoid's quotient with one `vdivps`: SiLU in 16 instructions a vector where the
//! plain form takes 31 and a division. The division had been the reciprocal estimate
//! (`vrcp14ps`, `vrcpps`) and a Newton step, three instructions for the FMA units that the
//! exponential keeps busy; the divider works beside them, and on a Zen 5 SiLU took 0.75×
//! (AVX-512) and 0.79× (AVX2) the time dividing, its quotient correctly rounded besides
//! ([`logistic`]).
//! In EfficientNet (SiLU) and ConvNeXt (GELU) the activation had been costing about as much as
//! the dot products of the layers it follows.

use super::with_act;
use crate::model::op::Act;

/// `act` on every value of `values`, in place: on AVX-512F or AVX2 + FMA intrinsics where the
/// paths in use have them, a vector at a time as the kernels that finish in registers apply it
/// ([`activate_vec`]; the long ones by [`logistic`] and [`gelu`]), otherwise (the portable
/// paths) as [`with_act`] compiles them in the caller's context. The clamps went through
/// [`crate::backend::cpu::simd::map_in_place`] on the SIMD paths too, which LLVM compiled as
/// scalar code (hardswish with a branch per clamp, its `array::from_fn` a call of its own):
/// 9% of a BF16 MobileNetV3-Large run's samples on a Zen 3, whose layers finish their f32 sums
/// through here.
#[inline(always)]
pub(crate) fn activate(act: Act, values: &mut [f32]) {
    if act == Act::None {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::backend::cpu::simd::{Simd, simd};
        let paths = simd();
        // SAFETY: the paths in use include AVX-512F, or AVX2 and FMA, so the CPU has them.
        unsafe {
            if paths >= Simd::Avx512 {
                return activate_avx512(act, values);
            }
            if paths.has_avx2() {
                return activate_avx2(act, values);
            }
        }
    }
    with_act!(act, |f| crate::backend::cpu::simd::map_in_place(values, f))
}

/// Whether `act` is one of the long activations (SiLU, the sigmoid, GELU), whose vector forms
/// are each path's own and differ from the plain per-value ones; the clamps are the same on
/// every path (for the tests that compare paths).
#[cfg(test)]
pub(super) fn long(act: Act) -> bool {
    matches!(act, Act::Silu | Act::Sigmoid | Act::Gelu)
}

/// e^r for |r| ≤ ln 2 / 2 by its degree-5 minimax polynomial, highest power first (relative
/// error 7.5·10⁻⁸ in exact arithmetic, 1.9·10⁻⁷ in f32 with FMAs; the degree-6 Taylor
/// polynomial of [`super::exp_nonpositive`] needs one term more for 1.2·10⁻⁷). Fitted by
/// iterated reweighted least squares on 4,000 Chebyshev nodes.
#[cfg(target_arch = "x86_64")]
const EXP_MINIMAX: [f32; 6] = [
    8.297_655e-3,
    4.191_538_3e-2,
    1.666_757_5e-1,
    4.999_889_4e-1,
    9.999_997e-1,
    1.000_000_1,
];

/// [`EXP_MINIMAX`] at −r: its odd powers' coefficients negated.
#[cfg(target_arch = "x86_64")]
const EXP_MINIMAX_NEG: [f32; 6] = [
    -EXP_MINIMAX[0],
    EXP_MINIMAX[1],
    -EXP_MINIMAX[2],
    EXP_MINIMAX[3],
    -EXP_MINIMAX[4],
    EXP_MINIMAX[5],
];

/// erf(x/√2) for |x| ≤ [`GELU_ERF_ONE`] as x · P(x²) / Q(x²), P and Q highest power first (Q's
/// last coefficient 1): absolute error 4.5·10⁻⁸ in exact arithmetic, 3.3·10⁻⁷ in f32 with
/// FMAs and a division, against 1.5·10⁻⁷ and 6·10⁻⁷ for Abramowitz & Stegun 7.1.26 (which
/// [`super::erf`] keeps for the plain path), at 11 FMAs and a division where 7.1.26 costs a
/// reciprocal with its Newton step, 5 FMAs and an exponential. Fitted as erf(z) = z · P(z²) /
/// Q(z²) on [0, 3.93] by iterated reweighted least squares (Lawson's weights, 24,000 points),
/// then scaled to x = z·√2 (P by 2^−i/√2, Q by 2^−i).
#[cfg(target_arch = "x86_64")]
const GELU_ERF_NUM: [f32; 7] = [
    2.190_452_7e-10,
    -4.404_576_6e-8,
    6.619_185e-6,
    3.546_381_2e-4,
    9.108_395e-3,
    7.321_457e-2,
    7.978_843e-1,
];
#[cfg(target_arch = "x86_64")]
const GELU_ERF_DEN: [f32; 5] = [
    6.457_271e-5,
    1.871_342_2e-3,
    2.949_098_7e-2,
    2.584_251_8e-1,
    1.0,
];

/// Where erf(x/√2) reaches 1 in f32 (3.93·√2: 1 − erf(3.93) is 3·10⁻⁸, under half an ulp of
/// 1): [`gelu`]'s rational form takes x clamped to ±this.
#[cfg(target_arch = "x86_64")]
const GELU_ERF_ONE: f32 = 5.557_859_4;

/// What the activations need of a SIMD vector of f32: AVX-512's 16 lanes or AVX2's 8. Every
/// method is an intrinsic (or two) compiled for its instruction set; the caller must run on a
/// CPU that has it.
#[cfg(target_arch = "x86_64")]
pub(super) trait Vector: Copy {
    const LANES: usize;
    /// # Safety (every method)
    /// The CPU has the vector's instruction set; `load`'s and `store`'s pointers have LANES
    /// floats.
    unsafe fn splat(v: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn add(self, o: Self) -> Self;
    unsafe fn mul(self, o: Self) -> Self;
    /// `o` where either is NaN, as `maxps` and `minps` do.
    unsafe fn max(self, o: Self) -> Self;
    unsafe fn min(self, o: Self) -> Self;
    /// self · b + c, and −(self · b) + c, each rounded once.
    unsafe fn fmadd(self, b: Self, c: Self) -> Self;
    unsafe fn fnmadd(self, b: Self, c: Self) -> Self;
    /// To the nearest whole number, ties to even.
    unsafe fn round(self) -> Self;
    /// self · 2^k for whole k in [−126, 127].
    unsafe fn scale(self, k: Self) -> Self;
    /// self / o, correctly rounded.
    unsafe fn div(self, o: Self) -> Self;
    /// self, with 0 in the lanes where `x < lo` (not where x is NaN).
    unsafe fn zero_below(self, x: Self, lo: f32) -> Self;
    /// The first `n` (< LANES) floats at `p`, `fill` in the other lanes: a masked load, which
    /// reads nothing past them (where a copy's small stores and its one wide load stalled
    /// the load until the stores retired).
    unsafe fn load_first(p: *const f32, n: usize, fill: f32) -> Self;
    /// The first `n` (< LANES) lanes to `p`, nothing past them.
    unsafe fn store_first(self, p: *mut f32, n: usize);
    /// The largest lane and the lanes' sum, halving the vector each step (no NaN among the
    /// lanes for the maximum: `max`'s second operand would win).
    unsafe fn reduce_max(self) -> f32;
    unsafe fn reduce_add(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
impl Vector for std::arch::x86_64::__m512 {
    const LANES: usize = 16;
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn splat(v: f32) -> Self {
        std::arch::x86_64::_mm512_set1_ps(v)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm512_storeu_ps(p, self) }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn add(self, o: Self) -> Self {
        std::arch::x86_64::_mm512_add_ps(self, o)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn mul(self, o: Self) -> Self {
        std::arch::x86_64::_mm512_mul_ps(self, o)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn max(self, o: Self) -> Self {
        std::arch::x86_64::_mm512_max_ps(self, o)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn min(self, o: Self) -> Self {
        std::arch::x86_64::_mm512_min_ps(self, o)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn fmadd(self, b: Self, c: Self) -> Self {
        std::arch::x86_64::_mm512_fmadd_ps(self, b, c)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn fnmadd(self, b: Self, c: Self) -> Self {
        std::arch::x86_64::_mm512_fnmadd_ps(self, b, c)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn round(self) -> Self {
        use std::arch::x86_64::*;
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn scale(self, k: Self) -> Self {
        std::arch::x86_64::_mm512_scalef_ps(self, k)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn div(self, o: Self) -> Self {
        std::arch::x86_64::_mm512_div_ps(self, o)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn zero_below(self, x: Self, lo: f32) -> Self {
        use std::arch::x86_64::*;
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(lo));
        _mm512_maskz_mov_ps(keep, self)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_first(p: *const f32, n: usize, fill: f32) -> Self {
        use std::arch::x86_64::*;
        // SAFETY: the caller's; the masked-off lanes are not read.
        unsafe { _mm512_mask_loadu_ps(_mm512_set1_ps(fill), (1u16 << n) - 1, p) }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_first(self, p: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's; the masked-off lanes are not written.
        unsafe { _mm512_mask_storeu_ps(p, (1u16 << n) - 1, self) }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn reduce_max(self) -> f32 {
        std::arch::x86_64::_mm512_reduce_max_ps(self)
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn reduce_add(self) -> f32 {
        std::arch::x86_64::_mm512_reduce_add_ps(self)
    }
}

#[cfg(target_arch = "x86_64")]
impl Vector for std::arch::x86_64::__m256 {
    const LANES: usize = 8;
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn splat(v: f32) -> Self {
        std::arch::x86_64::_mm256_set1_ps(v)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_storeu_ps(p, self) }
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn add(self, o: Self) -> Self {
        std::arch::x86_64::_mm256_add_ps(self, o)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn mul(self, o: Self) -> Self {
        std::arch::x86_64::_mm256_mul_ps(self, o)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn max(self, o: Self) -> Self {
        std::arch::x86_64::_mm256_max_ps(self, o)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn min(self, o: Self) -> Self {
        std::arch::x86_64::_mm256_min_ps(self, o)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn fmadd(self, b: Self, c: Self) -> Self {
        std::arch::x86_64::_mm256_fmadd_ps(self, b, c)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn fnmadd(self, b: Self, c: Self) -> Self {
        std::arch::x86_64::_mm256_fnmadd_ps(self, b, c)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn round(self) -> Self {
        use std::arch::x86_64::*;
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self)
    }
    /// 2^k from its exponent bits (k + 127, shifted), then one multiply: no `vscalefps`
    /// before AVX-512.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn scale(self, k: Self) -> Self {
        use std::arch::x86_64::*;
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(k),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(self, _mm256_castsi256_ps(bits))
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn div(self, o: Self) -> Self {
        std::arch::x86_64::_mm256_div_ps(self, o)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn zero_below(self, x: Self, lo: f32) -> Self {
        use std::arch::x86_64::*;
        _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(lo)), self)
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load_first(p: *const f32, n: usize, fill: f32) -> Self {
        use std::arch::x86_64::*;
        let keep = first_lanes(n);
        // SAFETY: the caller's; the masked-off lanes are not read.
        let v = unsafe { _mm256_maskload_ps(p, keep) };
        _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(keep))
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn store_first(self, p: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's; the masked-off lanes are not written.
        unsafe { _mm256_maskstore_ps(p, first_lanes(n), self) }
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn reduce_max(self) -> f32 {
        use std::arch::x86_64::*;
        let m = _mm_max_ps(
            _mm256_castps256_ps128(self),
            _mm256_extractf128_ps::<1>(self),
        );
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn reduce_add(self) -> f32 {
        use std::arch::x86_64::*;
        let s = _mm_add_ps(
            _mm256_castps256_ps128(self),
            _mm256_extractf128_ps::<1>(self),
        );
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

/// AVX2's mask of the first `n` of 8 lanes (all bits set in each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn first_lanes(n: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// `f` on every value of `values`, LANES at a time, the last few by masked loads and stores
/// (zeros in the lanes past them, which are neither read nor written).
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn each_vector<V: Vector>(values: &mut [f32], f: impl Fn(V) -> V) {
    let mut vectors = values.chunks_exact_mut(V::LANES);
    // SAFETY: each chunk holds LANES floats, the tail its length (< LANES), read and written
    // masked; the caller's instruction set.
    unsafe {
        for v in &mut vectors {
            f(V::load(v.as_ptr())).store(v.as_mut_ptr());
        }
        let tail = vectors.into_remainder();
        if !tail.is_empty() {
            let n = tail.len();
            f(V::load_first(tail.as_ptr(), n, 0.0)).store_first(tail.as_mut_ptr(), n);
        }
    }
}

/// e^((v − max) · scale) for every value v of `row`, in place, where max is the row's
/// largest, and their sum: a softmax's numerators. As [`super::exp_nonpositive`] computes them
/// value by value (0 where the exponent is below −87, a −∞ score's; a NaN makes its own value
/// and the sum NaN, so every probability after the division), but LANES at a time, the
/// maximum too, by [`exp`] where the paths in use have AVX-512 or AVX2 and FMA. ViT-B/16's
/// attention core at batch 8 in BF16 on two Zen 4 cores spent 29% of its time in the plain
/// loops, as long as in either product: the maximum (a NaN-keeping compare the compiler did
/// not vectorise) one value at a time, each waiting on the last.
pub(crate) fn softmax_numerators(row: &mut [f32], scale: f32) -> f32 {
    softmax_numerators_above(row, scale, f32::NEG_INFINITY).1
}

/// [`softmax_numerators`] against max(the row's largest, `floor`), which it returns with the
/// sum: an online softmax's step, a block of scores at a time, `floor` the blocks' largest so
/// far (−∞ for the first).
pub(crate) fn softmax_numerators_above(row: &mut [f32], scale: f32, floor: f32) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::backend::cpu::simd::{Simd, simd};
        let paths = simd();
        // SAFETY: the paths in use include AVX-512F, or AVX2 and FMA, so the CPU has them.
        unsafe {
            if paths >= Simd::Avx512 {
                return numerators_avx512(row, scale, floor);
            }
            if paths.has_avx2() {
                return numerators_avx2(row, scale, floor);
            }
        }
    }
    plain_numerators(row, scale, floor)
}

/// [`softmax_numerators_above`] value by value (the portable path).
fn plain_numerators(row: &mut [f32], scale: f32, floor: f32) -> (f32, f32) {
    let max = row.iter().fold(floor, |m, &v| super::max_nan(m, v));
    let sum = row.iter_mut().fold(0.0, |sum, v| {
        *v = super::exp_nonpositive((*v - max) * scale);
        sum + *v
    });
    (max, sum)
}

/// [`softmax_numerators`] on zmm vectors.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn numerators_avx512(row: &mut [f32], scale: f32, floor: f32) -> (f32, f32) {
    // SAFETY: the caller's.
    unsafe { numerators::<std::arch::x86_64::__m512>(row, scale, floor) }
}

/// [`softmax_numerators`] on ymm vectors.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn numerators_avx2(row: &mut [f32], scale: f32, floor: f32) -> (f32, f32) {
    // SAFETY: the caller's.
    unsafe { numerators::<std::arch::x86_64::__m256>(row, scale, floor) }
}

/// [`softmax_numerators_above`] LANES at a time: the maximum, then the numerators and their sum in
/// lanes, each reduced across the lanes in halves; the last few values by masked loads and
/// stores (padded with −∞, whose numerator is 0). On Llama-3.2-1B's prefill (rows of 1–128
/// scores) the copy this used before, and a reduction lane by lane, took 28% of the
/// attention's time.
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn numerators<V: Vector>(row: &mut [f32], scale: f32, floor: f32) -> (f32, f32) {
    let (n, lanes) = (row.len(), V::LANES);
    let (whole, rest) = (n / lanes * lanes, n % lanes);
    let p = row.as_mut_ptr();
    const { assert!(V::LANES <= 16, "a tail's mask covers 16 lanes at most") };
    // SAFETY: every load and store is of LANES floats below `whole`, or the first `rest`
    // from it; the caller's instruction set.
    unsafe {
        let max = row_max::<V>(p, n, floor);
        let (minus_max, scale) = (V::splat(-max), V::splat(scale));
        let mut sums = V::splat(0.0);
        for j in (0..whole).step_by(lanes) {
            let e = numerator(V::load(p.add(j)), minus_max, scale);
            e.store(p.add(j));
            sums = sums.add(e);
        }
        if rest > 0 {
            let v = V::load_first(p.add(whole), rest, f32::NEG_INFINITY);
            let e = numerator(v, minus_max, scale);
            e.store_first(p.add(whole), rest);
            sums = sums.add(e);
        }
        (max, sums.reduce_add())
    }
}

/// The largest of `n` floats at `p` and `floor`, LANES at a time in four chains of `max`
/// (one chain waited on each `vmaxps` in turn: a fifth of the numerators' time on Llama's
/// prefill scores), the last few by a masked load. A NaN never becomes it (`max` returns its
/// second operand then), so a NaN score's own numerator is NaN.
///
/// # Safety
/// The CPU has V's instruction set; `p` has `n` readable floats.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_max<V: Vector>(p: *const f32, n: usize, floor: f32) -> f32 {
    let lanes = V::LANES;
    let (whole, rest) = (n / lanes * lanes, n % lanes);
    // SAFETY: every load is of LANES floats below `whole`, or the first `rest` from it.
    unsafe {
        let mut most = [V::splat(f32::NEG_INFINITY); 4];
        let mut j = 0;
        while j + 4 * lanes <= whole {
            for (c, m) in most.iter_mut().enumerate() {
                *m = V::load(p.add(j + c * lanes)).max(*m);
            }
            j += 4 * lanes;
        }
        while j < whole {
            most[0] = V::load(p.add(j)).max(most[0]);
            j += lanes;
        }
        if rest > 0 {
            most[1] = V::load_first(p.add(whole), rest, f32::NEG_INFINITY).max(most[1]);
        }
        let all = most[0].max(most[1]).max(most[2].max(most[3]));
        all.reduce_max().max(floor)
    }
}

/// [`softmax_numerators_above`] of `row` with the numerators rounded to bf16 into `out` (as
/// long as `row`; `row` is scratch: left as it was on the CPUs that multiply bf16 pairs, the
/// f32 numerators elsewhere), in one pass: where an attention multiplies its
/// probabilities as bf16 pairs, the f32 numerators were stored, read back and rounded in a
/// second pass (8% of a Llama prefill's attention on AMX). The sum is of the f32 numerators,
/// and each bf16 is [`crate::backend::cpu::elem::f32_bf16`]'s (the numerators are 0 or at
/// least e^−87, a normal float, so `vcvtneps2bf16`'s flush of subnormals never applies).
pub(crate) fn softmax_numerators_bf16(
    row: &mut [f32],
    scale: f32,
    floor: f32,
    out: &mut [half::bf16],
) -> (f32, f32) {
    assert_eq!(row.len(), out.len(), "numerators: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if crate::backend::cpu::bf16_gemm::Engine::in_use().is_some() {
        // SAFETY: the engines run on CPUs with AVX-512F, BW, VL and AVX512_BF16.
        return unsafe { numerators_bf16_avx512(row, scale, floor, out) };
    }
    let found = softmax_numerators_above(row, scale, floor);
    crate::backend::cpu::elem::Elem::narrow(row, out);
    found
}

/// [`softmax_numerators_bf16`] on zmm vectors.
///
/// # Safety
/// The CPU has AVX-512F, BW, VL and AVX512_BF16; `row` and `out` have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn numerators_bf16_avx512(
    row: &[f32],
    scale: f32,
    floor: f32,
    out: &mut [half::bf16],
) -> (f32, f32) {
    use std::arch::x86_64::*;
    let (n, lanes) = (row.len(), 16);
    let (whole, rest) = (n / lanes * lanes, n % lanes);
    let (p, o) = (row.as_ptr(), out.as_mut_ptr().cast::<i16>());
    // SAFETY: every load and store is of 16 values below `whole`, or the first `rest` from
    // it (masked), in `row` and `out` alike; the caller's instruction set.
    unsafe {
        let max = row_max::<__m512>(p, n, floor);
        let (minus_max, scale) = (_mm512_set1_ps(-max), _mm512_set1_ps(scale));
        let mut sums = _mm512_setzero_ps();
        for j in (0..whole).step_by(lanes) {
            let e = numerator(_mm512_loadu_ps(p.add(j)), minus_max, scale);
            let h = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(e));
            _mm256_storeu_si256(o.add(j).cast(), h);
            sums = _mm512_add_ps(sums, e);
        }
        if rest > 0 {
            let mask = ((1u32 << rest) - 1) as __mmask16;
            let v = __m512::load_first(p.add(whole), rest, f32::NEG_INFINITY);
            let e = numerator(v, minus_max, scale);
            let h = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(e));
            _mm256_mask_storeu_epi16(o.add(whole).cast(), mask, h);
            sums = _mm512_add_ps(sums, e);
        }
        (max, sums.reduce_add())
    }
}

/// e^((v − max) · scale) of one vector, given −max: 0 below e^−87, a NaN kept. A function,
/// not a closure in the `#[inline(always)]` caller: there it was compiled without the
/// caller's target features (ARCHITECTURE.md, "Recipe: adding an op"), its intrinsics became
/// calls, and the attention core took 4× the time of the plain loops.
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn numerator<V: Vector>(v: V, minus_max: V, scale: V) -> V {
    const LO: f32 = -87.0;
    // SAFETY: the caller's.
    unsafe {
        // v − max is v + (−max) exactly; `max` keeps a NaN x (its second operand).
        let x = v.add(minus_max).mul(scale);
        exp(V::splat(LO).max(x)).zero_below(x, LO)
    }
}

/// The polynomial of `coefficients` (highest power first, at least one) at `x`, by Horner's
/// rule: one FMA a term, each constant broadcast from memory.
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn polynomial<V: Vector>(x: V, coefficients: &[f32]) -> V {
    // SAFETY: the caller's.
    unsafe {
        let rest = coefficients[1..].iter();
        rest.fold(V::splat(coefficients[0]), |p, &k| p.fmadd(x, V::splat(k)))
    }
}

/// e^x for x in [−87, 87] (the caller's to ensure): x = k·ln 2 + r, e^r by
/// [`EXP_MINIMAX`], then times 2^k.
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp<V: Vector>(x: V) -> V {
    use super::{LN2_HI, LN2_LO};
    // SAFETY: the caller's.
    unsafe {
        let c = |v| V::splat(v);
        let k = x.mul(c(std::f32::consts::LOG2_E)).round();
        let r = k.fnmadd(c(LN2_HI), x);
        let r = k.fnmadd(c(LN2_LO), r);
        polynomial(r, &EXP_MINIMAX).scale(k)
    }
}

/// e^−u for u in [−87, 87], as [`exp`] computes e^x for x = −u and bit for bit the same (the
/// negation folded into the constants: r's sign flips, and so do the odd powers'
/// coefficients).
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_neg<V: Vector>(u: V) -> V {
    use super::{LN2_HI, LN2_LO};
    // SAFETY: the caller's.
    unsafe {
        let c = |v| V::splat(v);
        let k = u.mul(c(-std::f32::consts::LOG2_E)).round();
        let r = k.fmadd(c(LN2_HI), u);
        let r = k.fmadd(c(LN2_LO), r);
        polynomial(r, &EXP_MINIMAX_NEG).scale(k)
    }
}

/// σ(x) = 1 / (1 + e^−x), or x · σ(x) where `silu`. 1 / (1 + e^−x) has no cancellation on
/// either side (e^−x overflowing is the danger, not precision): x is clamped to [−87, 87]
/// first, where 1 / (1 + e^87) is still a normal float and 1 + e^−87 is 1. So σ(x) for
/// x < −87 is 1.6·10⁻³⁸ (0 in [`super::sigmoid`]), SiLU(−∞) is −∞ (NaN in PyTorch's
/// x / (1 + e^−x) and in the plain form), and a NaN stays NaN (`max` and `min` return it as
/// their second operand). SiLU is x / (1 + e^−x), one division: a multiply by the reciprocal
/// would be one rounding more, and its estimate and Newton step cost three FMA-unit
/// instructions where `vdivps` runs on a unit of its own (EfficientNet-B0 at batch 8 on a Zen
/// 5 ran 3.0% faster in FP32 and 3.4% in BF16). Choosing per CPU at start-up was tried: a
/// check of the choice in every vector's activation took that gain and 1% more.
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn logistic<V: Vector>(x: V, silu: bool) -> V {
    // SAFETY: the caller's.
    unsafe {
        let c = |v| V::splat(v);
        let u = c(87.0).min(c(-87.0).max(x));
        let d = c(1.0).add(exp_neg(u));
        if silu { x.div(d) } else { c(1.0).div(d) }
    }
}

/// GELU, x · Φ(x) = x/2 · (1 + erf(x/√2)), erf(x/√2) as the rational form of
/// [`GELU_ERF_NUM`] and [`GELU_ERF_DEN`] on x clamped to ±[`GELU_ERF_ONE`] (a NaN kept: `max`
/// and `min` return it as their second operand): GELU(∞) is ∞, GELU(−∞) NaN (−∞ · 0, as in
/// PyTorch and the plain form). On a Zen 4, 4.7 ns a vector of 16 in L1 against 6.7 for
/// Abramowitz & Stegun 7.1.26 with its exponential (the plain path's [`super::erf`]), whose
/// pass over the stored tiles (`sgemm`'s `activate_stored`) was 3.3% of ConvNeXt-T's FP32 step.
///
/// # Safety
/// The CPU has V's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gelu<V: Vector>(x: V) -> V {
    // SAFETY: the caller's.
    unsafe {
        let c = |v| V::splat(v);
        let z = c(GELU_ERF_ONE).min(c(-GELU_ERF_ONE).max(x));
        let t = z.mul(z);
        let erf = z
            .mul(polynomial(t, &GELU_ERF_NUM))
            .div(polynomial(t, &GELU_ERF_DEN));
        let half = x.mul(c(0.5));
        half.fmadd(erf, half)
    }
}

/// `act` on one vector, value for value as [`activate`] computes it on the path of that
/// vector's width (the clamps as `clamp_nan` does them: a NaN stays NaN, −0 stays −0; the long
/// ones by [`logistic`] and [`gelu`]), for kernels that finish their sums in registers.
///
/// # Safety
/// The CPU has the vector's instruction set.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn activate_vec<V: Vector>(act: Act, x: V) -> V {
    // SAFETY: the caller's.
    unsafe {
        // v < lo → lo, v > hi → hi, else v (NaN included), as `clamp_nan`: `vmaxps` and
        // `vminps` return their second operand where either is NaN and where both are zeros,
        // so max(lo, v) keeps a NaN and a −0 as "v < lo → lo" does: one instruction where a
        // compare and a blend were two (a third of the time of MobileNetV3's 16 → 16 layer).
        let clamp = |v: V, lo: f32, hi: f32| V::splat(hi).min(V::splat(lo).max(v));
        match act {
            Act::None => x,
            Act::Relu => V::splat(0.0).max(x),
            Act::Relu6 => clamp(x, 0.0, 6.0),
            Act::Hardswish => {
                let t = clamp(x.add(V::splat(3.0)), 0.0, 6.0);
                x.mul(t).mul(V::splat(super::SIXTH))
            }
            Act::Hardsigmoid => clamp(x.add(V::splat(3.0)), 0.0, 6.0).mul(V::splat(super::SIXTH)),
            Act::Silu => logistic(x, true),
            Act::Sigmoid => logistic(x, false),
            Act::Gelu => gelu(x),
        }
    }
}

/// [`activate_vec`] on one AVX-512 vector.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn activate_zmm(
    act: Act,
    x: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    // SAFETY: the caller's.
    unsafe { activate_vec(act, x) }
}

/// [`activate_vec`] on one AVX2 vector: what [`activate`] computes on the AVX2 path.
///
/// # Safety
/// `$body` with `$op` bound to `$act` as a closure of one vector (`$apply(act, v)`): one copy
/// of the body for each common activation (none, ReLU, hardswish, SiLU) and one for the rest,
/// for register loops that finish their sums with it. Through the catch-all arm alone (a match
/// per vector), on a Zen 3, a 672-channel 3×3 depthwise layer with hardswish at 14² took
/// 1.5–1.8× the time of the layer without (with its own copy 1.3×, and 0.74× the time before:
/// the kernel's least time over 40 iterations in 6 alternating runs, one thread, batch 1), and
/// the AVX2 small-K GEMM's hardswish and SiLU layers 1.02–1.2× the time.
macro_rules! with_vec_act {
    ($act:expr, $apply:path, |$op:ident| $body:expr) => {
        match $act {
            $crate::model::op::Act::None => {
                let $op = |v| v;
                $body
            }
            $crate::model::op::Act::Relu => {
                let $op = |v| $apply($crate::model::op::Act::Relu, v);
                $body
            }
            $crate::model::op::Act::Hardswish => {
                let $op = |v| $apply($crate::model::op::Act::Hardswish, v);
                $body
            }
            $crate::model::op::Act::Silu => {
                let $op = |v| $apply($crate::model::op::Act::Silu, v);
                $body
            }
            other => {
                let $op = |v| $apply(other, v);
                $body
            }
        }
    };
}
pub(crate) use with_vec_act;

/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn activate_ymm(
    act: Act,
    x: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    // SAFETY: the caller's.
    unsafe { activate_vec(act, x) }
}

/// [`activate_vec`] on every value, 16 at a time (one loop per common activation).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn activate_avx512(act: Act, values: &mut [f32]) {
    use std::arch::x86_64::__m512;
    // SAFETY: the CPU has AVX-512F (the caller's).
    unsafe {
        with_vec_act!(act, activate_zmm, |op| each_vector(values, |x: __m512| op(
            x
        )))
    }
}

/// [`activate_vec`] on every value, 8 at a time (one loop per common activation).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn activate_avx2(act: Act, values: &mut [f32]) {
    use std::arch::x86_64::__m256;
    // SAFETY: the CPU has AVX2 and FMA (the caller's).
    unsafe {
        with_vec_act!(act, activate_ymm, |op| each_vector(values, |x: __m256| op(
            x
        )))
    }
}

/// `act` on every value as the portable path computes it, value by value (for the tests).
#[cfg(test)]
fn plain(act: Act, values: &mut [f32]) {
    with_act!(act, |f| values.iter_mut().for_each(|v| *v = f(*v)))
}

#[cfg(test)]
mod tests {
    /// [`super::activate_zmm`] and [`super::activate_ymm`] against [`super::activate`] bit for
    /// bit, every activation, on values around each one's bends and clamps, ±0, ±∞ and NaN:
    /// the form of the vectors of the paths in use (`activate` takes that path's forms; the
    /// AVX2 one is checked with `WORKSHOP_CPU_SIMD=avx2`), and the clamps (ReLU, ReLU6,
    /// hardswish, hardsigmoid) against their plain forms as the portable path computes them
    /// ([`super::plain`]). On other paths it says so and checks nothing.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn register_forms_match_activate() {
        use crate::backend::cpu::simd::{Simd, simd};
        use crate::model::op::Act;
        use std::arch::x86_64::*;
        let lanes = match simd() {
            Simd::Avx2Fma => 8,
            s if s >= Simd::Avx512 => 16,
            _ => {
                eprintln!("neither AVX2 nor AVX-512 is the path in use: nothing to check");
                return;
            }
        };
        let mut values: Vec<f32> = (-400..=400).map(|i| i as f32 / 40.0).collect();
        values.extend([0.0, -0.0, 3.0, -3.0, 6.0, 1e-40, -1e-40, 1e30, -1e30]);
        values.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            2.999_999_8,
            6.000_001,
        ]);
        values.resize(values.len().next_multiple_of(16), 0.5);
        for act in Act::ALL {
            let mut want = values.clone();
            super::activate(act, &mut want);
            if !super::long(act) {
                let mut plain = values.clone();
                super::plain(act, &mut plain);
                let differ = (plain.iter().zip(&want))
                    .position(|(p, w)| p.to_bits() != w.to_bits() && !(p.is_nan() && w.is_nan()));
                assert_eq!(
                    differ, None,
                    "{act:?}: the path's form against the plain one"
                );
            }
            for (i, chunk) in values.chunks(lanes).enumerate() {
                let mut got = [0f32; 16];
                // SAFETY: the CPU has the path's instructions (it is in use); both arrays
                // hold `lanes` floats or more.
                unsafe {
                    if lanes == 16 {
                        let v = super::activate_zmm(act, _mm512_loadu_ps(chunk.as_ptr()));
                        _mm512_storeu_ps(got.as_mut_ptr(), v);
                    } else {
                        let v = super::activate_ymm(act, _mm256_loadu_ps(chunk.as_ptr()));
                        _mm256_storeu_ps(got.as_mut_ptr(), v);
                    }
                }
                for (j, (g, w)) in got[..lanes].iter().zip(&want[i * lanes..]).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{act:?}({}) = {g} in {lanes} lanes, activate gives {w}",
                        chunk[j]
                    );
                }
            }
        }
    }

    /// The AVX-512 and AVX2 sigmoid, SiLU and GELU against libm's forms (f64), on slices of
    /// every length up to 40 (the last vectors partial, nothing written past them) over the
    /// range where they bend, the tails of both signs, ±∞ and NaN: each instruction set the
    /// CPU has.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_forms_match_libm() {
        use crate::model::op::Act;
        use std::arch::is_x86_feature_detected as has;
        let mut xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 2.5e-3).collect();
        xs.extend([
            -1e4, -300.0, -90.0, -87.5, 87.5, 90.0, 300.0, 1e4, 0.0, -0.0,
        ]);
        // (name, form, exact value, error allowed per |x|: the rational erf is off by up to
        // 3.3e-7 in f32, so GELU by half that times |x|).
        type Form = (&'static str, fn(&mut [f32]), fn(f64) -> f64, f64);
        let sigmoid: fn(f64) -> f64 = |x| 1.0 / (1.0 + (-x).exp());
        let silu: fn(f64) -> f64 = |x| x / (1.0 + (-x).exp());
        let gelu: fn(f64) -> f64 = |x| 0.5 * x * erfc(-x / std::f64::consts::SQRT_2);
        let mut forms: Vec<Form> = Vec::new();
        if has!("avx512f") {
            forms.extend([
                (
                    "sigmoid avx512",
                    // SAFETY: the CPU has the instruction set (checked above).
                    (|v| unsafe { super::activate_avx512(Act::Sigmoid, v) }) as fn(&mut [f32]),
                    sigmoid,
                    0.0,
                ),
                (
                    "silu avx512",
                    // SAFETY: as above.
                    |v| unsafe { super::activate_avx512(Act::Silu, v) },
                    silu,
                    0.0,
                ),
                (
                    "gelu avx512",
                    // SAFETY: as above.
                    |v| unsafe { super::activate_avx512(Act::Gelu, v) },
                    gelu,
                    1.9e-7,
                ),
            ]);
        }
        if has!("avx2") && has!("fma") {
            forms.extend([
                (
                    "sigmoid avx2",
                    // SAFETY: the CPU has the instruction set (checked above).
                    (|v| unsafe { super::activate_avx2(Act::Sigmoid, v) }) as fn(&mut [f32]),
                    sigmoid,
                    0.0,
                ),
                (
                    "silu avx2",
                    // SAFETY: as above.
                    |v| unsafe { super::activate_avx2(Act::Silu, v) },
                    silu,
                    0.0,
                ),
                (
                    "gelu avx2",
                    // SAFETY: as above.
                    |v| unsafe { super::activate_avx2(Act::Gelu, v) },
                    gelu,
                    1.9e-7,
                ),
            ]);
        }
        for (name, f, want, per_x) in forms {
            for len in [1, 7, 9, 15, 16, 17, 31, 40, xs.len()] {
                // Values past the slice (a vector's worth) must stay as they are.
                let mut buf = xs[..len].to_vec();
                buf.extend([7.0; 16]);
                f(&mut buf[..len]);
                assert!(
                    buf[len..].iter().all(|&v| v == 7.0),
                    "{name} on {len} values wrote past them"
                );
                for (&x, &got) in xs.iter().zip(&buf[..len]) {
                    let (got, want, x) = (got as f64, want(x as f64), x as f64);
                    // Below −87: σ is 1.6·10⁻³⁸ where it is less (see `logistic`).
                    let floor = 2e-38 * x.abs().max(1.0);
                    assert!(
                        (got - want).abs() <= 6e-7 * want.abs() + per_x * x.abs() + floor,
                        "{name}({x}): {got} vs {want}"
                    );
                }
            }
            let mut edges = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN];
            f(&mut edges);
            assert!(edges[0].is_nan() && edges[3].is_nan(), "{name}: {edges:?}");
            let (inf, neg_inf) = (edges[1], edges[2]);
            match name.split(' ').next() {
                Some("sigmoid") => assert!(
                    inf == 1.0 && (0.0..1e-37).contains(&neg_inf),
                    "{name}: {edges:?}"
                ),
                Some("silu") => assert!(inf == f32::INFINITY && neg_inf == f32::NEG_INFINITY),
                _ => assert!(
                    inf == f32::INFINITY && neg_inf.is_nan(),
                    "{name}: {edges:?}"
                ),
            }
        }
    }

    /// erfc in f64 to 1e-15 or so: the series for small |x|, the continued fraction beyond.
    fn erfc(x: f64) -> f64 {
        if x < 0.0 {
            return 2.0 - erfc(-x);
        }
        if x < 2.5 {
            // erf(x) = 2/√π Σ (−1)^n x^(2n+1) / (n! (2n+1))
            let (mut term, mut sum, mut n) = (x, x, 0.0);
            while term.abs() > 1e-17 {
                n += 1.0;
                term *= -x * x / n;
                sum += term / (2.0 * n + 1.0);
            }
            return 1.0 - sum * 2.0 / std::f64::consts::PI.sqrt();
        }
        // Lentz's continued fraction for erfc.
        let mut f = 0.0;
        for n in (1..200).rev() {
            f = (n as f64 / 2.0) / (x + f);
        }
        (-x * x).exp() / (std::f64::consts::PI.sqrt() * (x + f))
    }

    /// [`super::softmax_numerators_above`] on every path this CPU has (AVX-512, AVX2 and FMA,
    /// and the plain loop), rows of every length up to three vectors and more, with −∞ scores
    /// (a padding's, numerator 0) and exponents below −87 (0 as well), with no floor and a
    /// floor above the row's largest (an online softmax's later block): the maximum returned,
    /// each numerator within 4·10⁻⁷ of e^((v − max)·scale) in f64, the sum within 10⁻⁶ of
    /// theirs; a NaN among the scores makes its numerator and the sum NaN.
    #[test]
    fn softmax_numerators_match_f64_on_every_path() {
        type Path = (&'static str, fn(&mut [f32], f32, f32) -> (f32, f32));
        let mut paths: Vec<Path> = vec![("plain", super::plain_numerators)];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (detected just now).
                paths.push(("avx512", |r, s, f| unsafe {
                    super::numerators_avx512(r, s, f)
                }));
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA (detected just now).
                paths.push(("avx2", |r, s, f| unsafe { super::numerators_avx2(r, s, f) }));
            }
        }
        paths.push(("in use", super::softmax_numerators_above));
        for (name, f) in paths {
            for len in (1..=50).chain([197, 208]) {
                for (scale, lift) in [(0.125, None), (1.0, None), (0.125, Some(3.0))] {
                    let row: Vec<f32> = (0..len)
                        .map(|i| match i % 11 {
                            3 => f32::NEG_INFINITY,
                            7 => -900.0,
                            _ => ((i * 37 % 101) as f32 - 50.0) * 0.61,
                        })
                        .collect();
                    let largest = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let floor = lift.map_or(f32::NEG_INFINITY, |l| largest + l);
                    let max = largest.max(floor);
                    let mut got = row.clone();
                    let (got_max, sum) = f(&mut got, scale, floor);
                    assert_eq!(
                        got_max, max,
                        "{name}: len {len} scale {scale} floor {floor}"
                    );
                    let mut want_sum = 0f64;
                    for (i, (&v, &g)) in row.iter().zip(&got).enumerate() {
                        let x = (v - max) * scale;
                        let want = if x < -87.0 { 0.0 } else { (x as f64).exp() };
                        want_sum += want;
                        assert!(
                            (g as f64 - want).abs() <= 4e-7 * want,
                            "{name}: len {len} scale {scale} floor {floor} value {i}: {g} against {want}"
                        );
                    }
                    assert!(
                        (sum as f64 - want_sum).abs() <= 1e-6 * want_sum,
                        "{name}: len {len} scale {scale} floor {floor}: sum {sum} against {want_sum}"
                    );
                }
            }
            for len in [1, 5, 16, 19, 40] {
                let mut row: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
                row[len / 2] = f32::NAN;
                let (_, sum) = f(&mut row, 1.0, f32::NEG_INFINITY);
                assert!(sum.is_nan() && row[len / 2].is_nan(), "{name}: len {len}");
            }
        }
    }

    /// [`super::softmax_numerators_bf16`] (one pass on the CPUs that multiply bf16 pairs, else
    /// the f32 pass and a rounding) gives bit for bit the maximum, the sum and the rounded
    /// numerators of [`super::softmax_numerators_above`] followed by a rounding to bf16: rows
    /// of every length up to five vectors (the maximum's four chains and their remainder) and
    /// a tile's 512, −∞ scores, exponents below −87, a floor above the row, a NaN.
    #[test]
    fn bf16_numerators_round_the_f32_ones() {
        use crate::backend::cpu::elem::f32_bf16;
        for len in (1..=80).chain([197, 512]) {
            for (scale, lift, nan) in [
                (0.125, None, false),
                (1.0, Some(3.0), false),
                (0.125, None, true),
            ] {
                let mut row: Vec<f32> = (0..len)
                    .map(|i| match i % 13 {
                        3 => f32::NEG_INFINITY,
                        7 => -900.0,
                        _ => ((i * 37 % 101) as f32 - 50.0) * 0.61,
                    })
                    .collect();
                if nan {
                    row[len / 3] = f32::NAN;
                }
                let floor = lift.map_or(f32::NEG_INFINITY, |l| 30.0 + l);
                let mut want = row.clone();
                let (want_max, want_sum) = super::softmax_numerators_above(&mut want, scale, floor);
                let mut out = vec![half::bf16::ONE; len];
                let (max, sum) = super::softmax_numerators_bf16(&mut row, scale, floor, &mut out);
                let case = format!("len {len} scale {scale} floor {floor} nan {nan}");
                assert_eq!(max.to_bits(), want_max.to_bits(), "{case}: the maximum");
                assert_eq!(sum.to_bits(), want_sum.to_bits(), "{case}: the sum");
                for (i, (o, &w)) in out.iter().zip(&want).enumerate() {
                    assert_eq!(o.to_bits(), f32_bf16(w).to_bits(), "{case}: value {i}");
                }
            }
        }
    }
}

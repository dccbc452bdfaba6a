//! Activations over blocks of f32 values in place, for the epilogues of convolutions and
//! linear layers and the element-wise ops: the long ones (SiLU, the sigmoid, GELU) on AVX-512
//! intrinsics where the paths in use have them, every one otherwise as [`with_act`] compiles
//! it into the caller's vectorised code.
//!
//! Plain Rust keeps every multiply and add apart (no contraction into FMAs), scales by 2^k
//! through integer bits and divides (`vdivps`, about 5 cycles a vector on Zen 4). The
//! intrinsics evaluate the same functions with FMAs, `vscalefps` for 2^k and `vrcp14ps` with
//! one Newton step (error below 2^−26) for each reciprocal: SiLU in 18 instructions a vector
//! where the plain form takes 31 and a division. In EfficientNet (SiLU) and ConvNeXt (GELU)
//! the activation had been costing about as much as the dot products of the layers it follows.

use super::with_act;
use crate::backend::cpu::simd::Vectorised;
use crate::model::op::Act;

/// `act` on every value of `values`, in place: SiLU, the sigmoid and GELU on AVX-512
/// intrinsics where the paths in use have AVX-512F ([`logistic_avx512`], [`gelu_avx512`]), the
/// rest (and everything on other paths) as [`with_act`] compiles them in the caller's context:
/// every caller inlines this into its own vectorised code.
#[inline(always)]
pub(crate) fn activate(act: Act, values: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(act, Act::Silu | Act::Sigmoid | Act::Gelu)
        && crate::backend::cpu::simd::simd() >= crate::backend::cpu::simd::Simd::Avx512
    {
        // SAFETY: the paths in use include AVX-512F, so the CPU has it.
        unsafe {
            match act {
                Act::Gelu => gelu_avx512(values),
                _ => logistic_avx512(values, act == Act::Silu),
            }
        };
        return;
    }
    with_act!(act, |f| values.iter_mut().for_each(|v| *v = f(*v)))
}

/// Whether [`activate`] has an intrinsics form of `act`: epilogues that otherwise apply the
/// activation value by value as they narrow hand these a whole block instead.
pub(crate) fn long(act: Act) -> bool {
    matches!(act, Act::Silu | Act::Sigmoid | Act::Gelu)
}

/// An activation on a row of values, as vectorised work.
pub(super) struct Activation<'a>(pub(super) Act, pub(super) &'a mut [f32]);

impl Vectorised for Activation<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Activation(act, row) = self;
        activate(act, row)
    }
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// `f` on every value of `values`, 16 at a time, the last few through a masked load and
    /// store.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn each_vector(values: &mut [f32], f: impl Fn(__m512) -> __m512) {
        let mut vectors = values.chunks_exact_mut(16);
        // SAFETY: each chunk holds 16 floats (unaligned loads and stores); the tail's masked
        // load and store touch its own values only.
        unsafe {
            for v in &mut vectors {
                _mm512_storeu_ps(v.as_mut_ptr(), f(_mm512_loadu_ps(v.as_ptr())));
            }
            let tail = vectors.into_remainder();
            if !tail.is_empty() {
                let mask = ((1u32 << tail.len()) - 1) as __mmask16;
                let x = _mm512_maskz_loadu_ps(mask, tail.as_ptr());
                _mm512_mask_storeu_ps(tail.as_mut_ptr(), mask, f(x));
            }
        }
    }

    /// e^x for x in [−87, 88] (the caller's to ensure): x = k·ln 2 + r, e^r by
    /// [`super::EXP_MINIMAX`], 2^k by `vscalefps`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn exp(x: __m512) -> __m512 {
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        let c = _mm512_set1_ps;
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, c(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(k, c(LN2_HI), x);
        let r = _mm512_fnmadd_ps(k, c(LN2_LO), r);
        let [first, rest @ ..] = super::EXP_MINIMAX;
        let p = rest
            .iter()
            .fold(c(first), |p, &a| _mm512_fmadd_ps(p, r, c(a)));
        _mm512_scalef_ps(p, k)
    }

    /// 1 / d for normal d, by `vrcp14ps` and one Newton step.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn recip(d: __m512) -> __m512 {
        let s = _mm512_rcp14_ps(d);
        _mm512_mul_ps(s, _mm512_fnmadd_ps(d, s, _mm512_set1_ps(2.0)))
    }
}

/// σ(x) = 1 / (1 + e^−x), or x · σ(x) where `silu`, on every value. 1 / (1 + e^−x) has no
/// cancellation on either side (e^−x overflowing is the danger, not precision): x is clamped
/// to [−87, 87] first, where 1 / (1 + e^87) is still a normal float and 1 + e^−87 is 1. So
/// σ(x) for x < −87 is 1.6·10⁻³⁸ (0 in [`super::sigmoid`]), SiLU(−∞) is −∞ (NaN in PyTorch's
/// x / (1 + e^−x) and in the plain form), and a NaN stays NaN (`max` and `min` return it as
/// their second operand).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn logistic_avx512(values: &mut [f32], silu: bool) {
    use std::arch::x86_64::*;
    let c = _mm512_set1_ps;
    avx512::each_vector(values, |x| {
        let u = _mm512_min_ps(c(87.0), _mm512_max_ps(c(-87.0), x));
        let s = avx512::recip(_mm512_add_ps(c(1.0), avx512::exp(_mm512_sub_ps(c(0.0), u))));
        if silu { _mm512_mul_ps(x, s) } else { s }
    })
}

/// GELU, x · Φ(x) = x/2 · (1 + erf(x/√2)), on every value, erf as [`super::erf`] computes it
/// (Abramowitz & Stegun 7.1.26: t = 1 / (1 + p·|z|), a degree-5 polynomial in t times
/// e^−z²). |z| is clamped to 8, where erf is 1 in f32, so that t and e^−z² stay normal: GELU(∞)
/// is ∞, GELU(−∞) NaN (−∞ · 0, as in PyTorch and the plain form), and a NaN stays NaN.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gelu_avx512(values: &mut [f32]) {
    use std::arch::x86_64::*;
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        1.061_405_4,
        -1.453_152,
        1.421_413_7,
        -0.284_496_74,
        0.254_829_6,
    ];
    let c = _mm512_set1_ps;
    let sign = _mm512_set1_epi32(i32::MIN);
    avx512::each_vector(values, |x| {
        let z = _mm512_mul_ps(x, c(std::f32::consts::FRAC_1_SQRT_2));
        let a = _mm512_min_ps(c(8.0), _mm512_abs_ps(z));
        let t = avx512::recip(_mm512_fmadd_ps(a, c(P), c(1.0)));
        let [first, rest @ ..] = A;
        let poly = rest
            .iter()
            .fold(c(first), |p, &k| _mm512_fmadd_ps(p, t, c(k)));
        let e = avx512::exp(_mm512_fnmadd_ps(a, a, _mm512_setzero_ps()));
        // erf(|z|), then its sign from x's (NaN's included).
        let y = _mm512_fnmadd_ps(_mm512_mul_ps(poly, t), e, c(1.0));
        let x_sign = _mm512_and_si512(_mm512_castps_si512(x), sign);
        let erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(y), x_sign));
        let half = _mm512_mul_ps(x, c(0.5));
        _mm512_fmadd_ps(half, erf, half)
    })
}

#[cfg(test)]
mod tests {
    /// The AVX-512 sigmoid, SiLU and GELU against libm's forms (f64), on slices of every
    /// length up to 40 (masked last vectors) over the range where they bend, the tails of
    /// both signs, ±∞ and NaN. Where the CPU lacks AVX-512F there is nothing to test.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_forms_match_libm() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 2.5e-3).collect();
        xs.extend([
            -1e4, -300.0, -90.0, -87.5, 87.5, 90.0, 300.0, 1e4, 0.0, -0.0,
        ]);
        // (name, form, exact value, error allowed per |x|: A&S 7.1.26's erf is off by up to
        // 6e-7 in f32, so GELU by half that times |x|).
        type Form = (&'static str, fn(&mut [f32]), fn(f64) -> f64, f64);
        let forms: [Form; 3] = [
            (
                "sigmoid",
                // SAFETY: the CPU has AVX-512F (checked above).
                |v| unsafe { super::logistic_avx512(v, false) },
                |x| 1.0 / (1.0 + (-x).exp()),
                0.0,
            ),
            (
                "silu",
                // SAFETY: as above.
                |v| unsafe { super::logistic_avx512(v, true) },
                |x| x / (1.0 + (-x).exp()),
                0.0,
            ),
            (
                "gelu",
                // SAFETY: as above.
                |v| unsafe { super::gelu_avx512(v) },
                |x| 0.5 * x * erfc(-x / std::f64::consts::SQRT_2),
                3e-7,
            ),
        ];
        for (name, f, want, per_x) in forms {
            for len in [1, 15, 16, 17, 31, 40, xs.len()] {
                let mut got = xs[..len].to_vec();
                f(&mut got);
                for (&x, &got) in xs.iter().zip(&got) {
                    let (got, want, x) = (got as f64, want(x as f64), x as f64);
                    // Below −87: σ is 1.6·10⁻³⁸ where it is less (see `logistic_avx512`).
                    let floor = 2e-38 * x.abs().max(1.0);
                    assert!(
                        (got - want).abs() <= 6e-7 * want.abs() + per_x * x.abs() + floor,
                        "{name}({x}): {got} vs {want}"
                    );
                }
            }
        }
        let mut edges = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN];
        // SAFETY: as above.
        unsafe { super::logistic_avx512(&mut edges, false) };
        assert!(edges[0].is_nan() && edges[3].is_nan());
        assert_eq!(edges[1], 1.0);
        assert!((0.0..1e-37).contains(&edges[2]));
        let mut edges = [f32::NAN, f32::INFINITY];
        // SAFETY: as above.
        unsafe { super::logistic_avx512(&mut edges, true) };
        assert!(edges[0].is_nan() && edges[1] == f32::INFINITY);
        let mut edges = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN];
        // SAFETY: as above.
        unsafe { super::gelu_avx512(&mut edges) };
        assert!(edges[0].is_nan() && edges[2].is_nan() && edges[3].is_nan());
        assert_eq!(edges[1], f32::INFINITY);
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
}

//! Element-wise ops in place: batch norm as an affine map, clamps (ReLU, ReLU6), adds;
//! half types widened a block at a time or converted in registers.

use half::bf16;
use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::{self, Elem, bf16_f32, f32_bf16};
use crate::backend::cpu::simd::{Update, Vectorised, ZipWith, with_simd};
use crate::model::op::Act;

/// Apply `f` to `buf` in f32, one block at a time: in place for f32 storage, through a small
/// widened copy for half types (so conversions run over whole slices, with F16C where present,
/// instead of one scalar conversion per element). `period` is the period `f` relies on (the
/// channel count for per-channel maps, else 1): blocks are multiples of it.
pub(super) fn map_f32<T: Elem>(buf: &mut [T], period: usize, f: impl Fn(&mut [f32]) + Sync) {
    let period = period.max(1);
    buf.par_chunks_mut((ELEMENTWISE_CHUNK / period).max(1) * period)
        .for_each(|part| match T::as_f32_mut(part) {
            Some(p) => f(p),
            // Half storage: widened a few KiB at a time into the worker's scratch, so the copy
            // stays in L1 between the conversions and `f`.
            None => SCRATCH.with(|s| {
                let tmp = &mut s.borrow_mut().1;
                let block = (HALF_BLOCK / period).max(1) * period;
                tmp.resize(block, 0.0);
                for sub in part.chunks_mut(block) {
                    let wide = &mut tmp[..sub.len()];
                    T::widen(sub, wide);
                    f(wide);
                    T::narrow(wide, sub);
                }
            }),
        });
}

/// Elements per widened block of a half-precision element-wise op (8 KiB of f32).
pub(super) const HALF_BLOCK: usize = 2048;

/// y = x·scale + shift per channel (batch norm folded to an affine map at prepare time).
pub fn affine_inplace<T: Elem>(buf: &mut [T], c: usize, scale: &[f32], shift: &[f32]) {
    let c = c.max(1);
    if let Some(b) = T::as_bf16_mut(buf) {
        // bf16: converted in registers, one pass over memory (no widened copy).
        b.par_chunks_mut((ELEMENTWISE_CHUNK / c).max(1) * c)
            .for_each(|part| {
                with_simd(Affine {
                    part,
                    c,
                    scale,
                    shift,
                    load: bf16_f32,
                    store: f32_bf16,
                })
            });
        return;
    }
    if let Some(h) = T::as_f16_mut(buf)
        && crate::backend::cpu::simd::f16c()
    {
        // f16 with F16C: converted in registers, one pass over memory.
        h.par_chunks_mut((ELEMENTWISE_CHUNK / c).max(1) * c)
            .for_each(|part| assert!(elem::affine_f16(part, c, scale, shift)));
        return;
    }
    map_f32(buf, c, |part| {
        with_simd(Affine {
            part,
            c,
            scale,
            shift,
            load: |v: f32| v,
            store: |v: f32| v,
        })
    });
}

/// [`affine_inplace`] over whole pixels of `part`, as vectorised work: each value read as f32
/// by `load` and written back by `store` (the identity for f32, in registers for bf16).
pub(super) struct Affine<'a, V, L, S> {
    part: &'a mut [V],
    c: usize,
    scale: &'a [f32],
    shift: &'a [f32],
    load: L,
    store: S,
}

impl<V: Copy, L: Fn(V) -> f32, S: Fn(f32) -> V> Vectorised for Affine<'_, V, L, S> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for px in self.part.chunks_exact_mut(self.c) {
            for ((v, s), b) in px.iter_mut().zip(self.scale).zip(self.shift) {
                *v = (self.store)((self.load)(*v) * s + b);
            }
        }
    }
}

/// ln 2 in two parts for the range reduction r = x − k·ln 2 of an exponential: k·LN2_HI is
/// exact for the k an f32 exponent takes, LN2_LO carries the rest.
pub(super) const LN2_HI: f32 = 0.693_145_75;
pub(super) const LN2_LO: f32 = 1.428_606_8e-6;

/// Abramowitz & Stegun 7.1.26: erf(a) ≈ 1 − t·A(t)·e^(−a²) for a ≥ 0, t = 1 / (1 + ERF_P·a),
/// A's coefficients highest power first.
pub(super) const ERF_P: f32 = 0.327_591_1;
pub(super) const ERF_A: [f32; 5] = [
    1.061_405_4,
    -1.453_152,
    1.421_413_7,
    -0.284_496_74,
    0.254_829_6,
];

/// e^x for x ≤ 0 (what a softmax exponentiates once its maximum is subtracted), in code the
/// compiler vectorises (every step: check the assembly after changing it): x = k·ln 2 + r with
/// |r| ≤ ln 2 / 2, e^r by its Taylor polynomial to r⁶ (relative error below 2e-7), 2^k from
/// the exponent bits. Below −87 the result is 0 (f32's smallest normal is e^−87.3); a NaN
/// stays NaN. libm's `expf`, one call per score, took most of the attention's time (and half
/// of EfficientNet's, in SiLU).
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    let small = x < -87.0;
    let x = if small { -87.0 } else { x };
    // Ties to even: one vector instruction (`round`, ties away from zero, is several).
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = x - k * LN2_HI - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k from its exponent bits, without a float-to-integer conversion (Rust's saturating `as`
    // runs one lane at a time): k + 127 is a whole number in [1, 127], the low mantissa bits
    // of k + 127 + 2^23, shifted into the exponent. A NaN gives a scale of 0 and p stays NaN.
    let scale = f32::from_bits((k + 127.0 + 8_388_608.0).to_bits() << 23);
    if small { 0.0 } else { p * scale }
}

/// 1 / (1 + e^−x) with [`exp_nonpositive`]: e^−|x| never overflows, and the other half of
/// the curve is e^−|x| / (1 + e^−|x|). A NaN stays NaN.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 { s } else { e * s }
}

/// x · sigmoid(x) (`nn.SiLU`), vectorisable.
#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// erf(x) in code the compiler vectorises: Abramowitz & Stegun 7.1.26 ([`ERF_A`]; absolute
/// error below 1.5e-7 in exact arithmetic, 6e-7 in f32: a few ulps near 1) with
/// [`exp_nonpositive`] for e^(−x²); NaN stays NaN. libm's `erff`, one call per element, cost
/// 4× more.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + ERF_P * a);
    let [first, rest @ ..] = ERF_A;
    let poly = t * rest.iter().fold(first, |p, &k| p * t + k);
    let y = 1.0 - poly * exp_nonpositive(-a * a);
    if x < 0.0 {
        -y
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// x · Φ(x) = x · (1 + erf(x/√2)) / 2 (`nn.GELU()`, the exact form), vectorisable.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// 1/6, by which hardswish and hardsigmoid multiply where PyTorch divides by 6 (a result at
/// most an ulp apart): a vector division takes a 512-bit FPU 8–16 cycles against one for a
/// multiplication, and in a GEMM tile's finish, 28 of them weighed more than the 448 FMAs of a
/// K = 16 tile. Alone on one core of an Emerald Rapids Xeon, MobileNetV3's GEMMs with
/// hardswish: 16 → 64 (3136 rows) 94 → 75 µs, 80 → 200 (784 rows) 205 → 188 µs, 160 → 960
/// 781 → 744 µs (with ReLU: 59, 181 and 704).
pub const SIXTH: f32 = 1.0 / 6.0;

/// `v` clamped to [lo, hi], with a NaN staying NaN as in IEEE arithmetic and PyTorch
/// (`f32::max` would turn it into `lo`, hiding a broken input or weight; issue 27).
#[inline(always)]
pub fn clamp_nan(v: f32, lo: f32, hi: f32) -> f32 {
    if v < lo {
        lo
    } else if v > hi {
        hi
    } else {
        v
    }
}

/// Lanes [`fold_lanes`] reduces in: one AVX-512 vector, or two AVX2 ones.
const LANES: usize = 16;

/// `f` folded over `map` of each value of `row`, in [`LANES`] independent lanes, then the
/// lanes and the tail in order: a reduction (a row's sum, maximum) that the compiler keeps in
/// vector registers, where one running value is a chain of dependent operations, one per
/// value (8 cycles a value for attention's softmax on a Zen 4, 1 ns for a layer norm's sums).
/// The lanes are updated in place by an indexed loop over fixed-size chunks. Neither this
/// nor folding them by value (`array::from_fn` per chunk) gave the norms (its one user) 16-lane
/// sums on AVX-512: both compiled to eight chains of 2-lane vectors, hence the norms' own
/// intrinsics there (`transformer::norm512`); an earlier in-place loop had gone through the
/// stack. Check the assembly after changing it. Inline it into
/// [`crate::backend::cpu::simd::Vectorised`] work to get the wide vectors.
#[inline(always)]
pub(crate) fn fold_lanes(
    row: &[f32],
    init: f32,
    map: impl Fn(f32) -> f32,
    f: impl Fn(f32, f32) -> f32,
) -> f32 {
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut lanes = [init; LANES];
    for c in chunks {
        for i in 0..LANES {
            lanes[i] = f(lanes[i], map(c[i]));
        }
    }
    let lanes = f(init, fold_halves(lanes, &f));
    tail.iter().fold(lanes, |a, &v| f(a, map(v)))
}

/// `f` over 16 lanes as a tree: 8 pairs, 4, 2, 1, each a new array. The compiler keeps the
/// halves in registers; folded in order, the lanes went through the stack a value at a time
/// (window attention's softmax, two such reductions a 49-key row: the kernel 1.3× the time).
#[inline(always)]
pub(crate) fn fold_halves(v: [f32; LANES], f: impl Fn(f32, f32) -> f32) -> f32 {
    let v8: [f32; 8] = std::array::from_fn(|l| f(v[l], v[l + 8]));
    let v4: [f32; 4] = std::array::from_fn(|l| f(v8[l], v8[l + 4]));
    let v2: [f32; 2] = std::array::from_fn(|l| f(v4[l], v4[l + 2]));
    f(v2[0], v2[1])
}

/// The larger of `a` and `b`, NaN when either is (max pooling's rule in PyTorch).
#[inline(always)]
pub fn max_nan(a: f32, b: f32) -> f32 {
    if b > a || b.is_nan() { b } else { a }
}

/// Clamp every element to [lo, hi] (ReLU: [0, ∞), ReLU6: [0, 6]); NaNs stay NaN.
pub fn clamp_inplace<T: Elem>(buf: &mut [T], lo: f32, hi: f32) {
    if lo == 0.0
        && hi == f32::INFINITY
        && let Some((bits, inf)) = T::half_bits_mut(buf)
    {
        // ReLU on a half type needs no conversion: a value stays when its sign bit is clear
        // (zero, positive, +∞, positive NaNs) or it is a NaN (magnitude bits above +∞'s), and
        // becomes +0 otherwise (negatives), as the f32 path does. Compares and a select the
        // compiler vectorises.
        bits.par_chunks_mut(ELEMENTWISE_CHUNK).for_each(|part| {
            with_simd(Update(part, |v: &mut u16| {
                *v = if *v < 0x8000 || (*v & 0x7fff) > inf {
                    *v
                } else {
                    0
                };
            }))
        });
        return;
    }
    map_f32(buf, 1, |part| {
        with_simd(Update(part, |v: &mut f32| *v = clamp_nan(*v, lo, hi)))
    });
}

/// 1 / (1 + e^-x), element-wise, in f32 (half types widened a block at a time).
pub fn sigmoid_inplace<T: Elem>(buf: &mut [T]) {
    map_f32(buf, 1, |part| super::activate(Act::Sigmoid, part));
}

/// Hardswish, hardsigmoid, SiLU or tanh, element-wise in f32 (NaN stays NaN).
pub fn unary_inplace<T: Elem>(buf: &mut [T], u: crate::model::op::Unary) {
    use crate::model::op::Unary;
    match u {
        Unary::Hardswish => map_f32(buf, 1, |part| super::activate(Act::Hardswish, part)),
        Unary::Hardsigmoid => map_f32(buf, 1, |part| super::activate(Act::Hardsigmoid, part)),
        Unary::Silu => map_f32(buf, 1, |part| super::activate(Act::Silu, part)),
        Unary::Tanh => map_f32(buf, 1, |part| part.iter_mut().for_each(|v| *v = v.tanh())),
    }
}

/// x (NHWC) times s (N × C), channel by channel: each image's `per_image` values (H·W·C)
/// scaled by its `c` scales.
pub fn scale_channels_inplace<T: Elem>(x: &mut [T], s: &[T], (per_image, c): (usize, usize)) {
    let c = c.max(1);
    let scales: Vec<f32> = s.iter().map(|v| v.to_f32()).collect();
    // Work items of whole pixels within one image, so one image's work spreads over the
    // threads; f32 and bf16 vectorised in place (bf16 converted in registers), one scalar
    // conversion per value only for f16.
    let pixels = (ELEMENTWISE_CHUNK / c).max(1) * c;
    x.par_chunks_mut(per_image.max(1))
        .zip(scales.par_chunks(c))
        .for_each(|(image, k)| {
            image.par_chunks_mut(pixels).for_each(|part| {
                if let Some(part) = T::as_f32_mut(part) {
                    for px in part.chunks_mut(c) {
                        with_simd(ZipWith(px, k, |v: &mut f32, k: &f32| *v *= k));
                    }
                } else if let Some(part) = T::as_bf16_mut(part) {
                    for px in part.chunks_mut(c) {
                        with_simd(ZipWith(px, k, |v: &mut bf16, k: &f32| {
                            *v = f32_bf16(bf16_f32(*v) * k)
                        }));
                    }
                } else {
                    for px in part.chunks_mut(c) {
                        for (v, k) in px.iter_mut().zip(k) {
                            *v = T::from_f32(v.to_f32() * k);
                        }
                    }
                }
            })
        });
}

/// a += b, element-wise.
pub fn add_inplace<T: Elem>(a: &mut [T], b: &[T]) {
    a.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(b.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(a, b)| {
            if let (Some(a), Some(b)) = (T::as_bf16_mut(a), T::as_bf16(b)) {
                // bf16: converted in registers, one pass over memory.
                return with_simd(ZipWith(a, b, |x: &mut bf16, y: &bf16| {
                    *x = f32_bf16(bf16_f32(*x) + bf16_f32(*y))
                }));
            }
            if let (Some(a), Some(b)) = (T::as_f16_mut(a), T::as_f16(b))
                && elem::add_f16(a, b)
            {
                return;
            }
            add_chunk(a, b)
        });
}

/// [`add_inplace`] of one chunk, f32 in place or through widened copies.
pub(super) fn add_chunk<T: Elem>(a: &mut [T], b: &[T]) {
    let add = |x: &mut f32, y: &f32| *x += y;
    match (T::as_f32_mut(a), T::as_f32(b)) {
        (Some(a), Some(b)) => with_simd(ZipWith(a, b, add)),
        _ => {
            let (mut ta, mut tb) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
            for (a, b) in a.chunks_mut(HALF_BLOCK).zip(b.chunks(HALF_BLOCK)) {
                let (ta, tb) = (&mut ta[..a.len()], &mut tb[..a.len()]);
                T::widen(a, ta);
                T::widen(b, tb);
                with_simd(ZipWith(ta, tb, add));
                T::narrow(ta, a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// The vectorisable error function against libm's.
    #[test]
    fn erf_matches_libm() {
        for i in -80_000..=80_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (super::erf(x), libm::erff(x));
            assert!((got - want).abs() <= 6e-7, "erf({x}): {got} vs {want}");
        }
        assert!(super::erf(f32::NAN).is_nan());
        assert_eq!(super::erf(f32::INFINITY), 1.0);
        assert_eq!(super::erf(f32::NEG_INFINITY), -1.0);
    }

    #[test]
    fn exp_nonpositive_matches_libm() {
        for i in 0..=200_000 {
            let x = -(i as f32) * 0.0005;
            let (got, want) = (super::exp_nonpositive(x), x.exp());
            assert!(
                (got - want).abs() <= 4e-7 * want + 2e-38,
                "e^{x}: {got} vs {want}"
            );
        }
        assert_eq!(super::exp_nonpositive(-200.0), 0.0);
        assert_eq!(super::exp_nonpositive(0.0), 1.0);
        assert!(super::exp_nonpositive(f32::NAN).is_nan());
    }

    /// The vectorisable sigmoid and SiLU against libm's forms, tails and NaN included.
    #[test]
    fn sigmoid_and_silu_match_libm() {
        for i in -200_000..=200_000 {
            let x = i as f32 * 5e-4;
            let want = 1.0 / (1.0 + (-x as f64).exp());
            let got = super::sigmoid(x) as f64;
            assert!(
                (got - want).abs() <= 6e-7 * want + 1e-30,
                "sigmoid({x}): {got} vs {want}"
            );
            let (got, want) = (super::silu(x) as f64, x as f64 * want);
            assert!(
                (got - want).abs() <= 6e-7 * want.abs() + 1e-30,
                "silu({x}): {got} vs {want}"
            );
        }
        assert_eq!(super::sigmoid(-200.0), 0.0);
        assert_eq!(super::sigmoid(200.0), 1.0);
        assert!(super::sigmoid(f32::NAN).is_nan() && super::silu(f32::NAN).is_nan());
    }

    use super::*;
    use half::f16;
    /// Batch norm's affine map and the residual add on a half type, converted in registers
    /// (bf16 always, f16 where the CPU has F16C), give bit for bit what widening to f32, the
    /// f32 kernels and narrowing with `half` give, for every value of the type (up to which
    /// NaN comes out of two).
    fn halves_match_the_f32_path<T: Elem + std::fmt::Display>(
        from_bits: fn(u16) -> T,
        to_bits: fn(T) -> u16,
    ) {
        let all: Vec<T> = (0..=u16::MAX).map(from_bits).collect();
        let other: Vec<T> = (0..=u16::MAX)
            .map(|i| from_bits(i.wrapping_mul(40_503)))
            .collect();
        let widen = |v: &[T]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let narrow = |v: &[f32]| v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
        // Which NaN an operation on two NaNs gives is not defined (the compiler may swap an
        // add's operands): any NaN matches a NaN; every other value, bit for bit.
        let same = |what: &str, got: &[T], want: &[T]| {
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                if g.to_f32().is_nan() && w.to_f32().is_nan() {
                    continue;
                }
                assert_eq!(to_bits(g), to_bits(w), "{what} of element {i}: {g} vs {w}");
            }
        };
        // 24 channels: a vectorised body and a tail in every pixel; 65,520 values are
        // 2,730 whole pixels.
        let scale = [1.0, -0.5, 3.0e38, 1.0e-3, 0.0, 7.25, -2.0, 1.5].repeat(3);
        let shift: Vec<f32> = [0.0, 1.0, -1.0, 3.0e38, -0.0, 0.1, 1.0e-30, -7.0]
            .iter()
            .cycle()
            .skip(3)
            .take(24)
            .copied()
            .collect();
        let pixels = &all[..65_520];
        let mut fast = pixels.to_vec();
        affine_inplace(&mut fast, 24, &scale, &shift);
        let mut wide = widen(pixels);
        affine_inplace(&mut wide, 24, &scale, &shift);
        same("affine", &fast, &narrow(&wide));
        let mut fast = all.clone();
        add_inplace(&mut fast, &other);
        let mut wide = widen(&all);
        add_inplace(&mut wide, &widen(&other));
        same("add", &fast, &narrow(&wide));
    }

    #[test]
    fn bf16_affine_and_add_match_the_f32_path() {
        halves_match_the_f32_path(bf16::from_bits, bf16::to_bits);
    }

    #[test]
    fn f16_affine_and_add_match_the_f32_path() {
        halves_match_the_f32_path(f16::from_bits, f16::to_bits);
    }

    /// ReLU straight on the bits of a half type gives what the f32 path gives (widen, clamp,
    /// narrow), up to the sign of zero and a NaN's payload, for every value: NaNs (which stay
    /// NaN), infinities, zeros, subnormals.
    fn relu_on_bits_matches_the_f32_path<T: Elem + std::fmt::Display>(bits: fn(T) -> u16) {
        let all: Vec<T> = (0..=u16::MAX)
            .map(|b| {
                let mut v = [T::default()];
                T::half_bits_mut(&mut v).expect("a half type").0[0] = b;
                v[0]
            })
            .collect();
        let mut fast = all.clone();
        clamp_inplace(&mut fast, 0.0, f32::INFINITY);
        let mut wide: Vec<f32> = all.iter().map(|v| v.to_f32()).collect();
        clamp_inplace(&mut wide, 0.0, f32::INFINITY);
        for ((x, got), want) in all.iter().zip(&fast).zip(&wide) {
            let want = T::from_f32(*want);
            assert!(
                bits(*got) == bits(want)
                    || (got.to_f32() == 0.0 && want.to_f32() == 0.0)
                    || (got.to_f32().is_nan() && want.to_f32().is_nan()),
                "relu({x}) = {got}, the f32 path gives {want}"
            );
        }
    }

    #[test]
    fn bf16_relu_matches_the_f32_path() {
        relu_on_bits_matches_the_f32_path::<bf16>(bf16::to_bits);
    }

    #[test]
    fn f16_relu_matches_the_f32_path() {
        relu_on_bits_matches_the_f32_path::<f16>(f16::to_bits);
    }
}

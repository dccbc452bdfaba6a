//! Storage element types of the CPU backend. Activations and weights are stored as f32, f16 or
//! bf16; all arithmetic is f32. Conversions go through `half`'s slice routines, which use the
//! F16C instructions when the CPU has them.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::simd;
use crate::model::Precision;

pub trait Elem: Copy + Send + Sync + Default + 'static {
    const PRECISION: Precision;
    /// A short suffix for kernel names (`f32`, `f16`, `bf16`).
    const SUFFIX: &'static str;
    /// Whether the storage already is f32 (kernels then work in place, without conversions).
    const IS_F32: bool;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    /// The slice itself when the storage type is already f32 (no copy needed).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    /// The slice itself when the storage type is bf16 (what AMX tiles read).
    fn as_bf16(s: &[Self]) -> Option<&[bf16]>;
    fn as_bf16_mut(s: &mut [Self]) -> Option<&mut [bf16]>;
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Elem for f32 {
    const PRECISION: Precision = Precision::Fp32;
    const SUFFIX: &'static str = "f32";
    const IS_F32: bool = true;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn as_bf16(_: &[Self]) -> Option<&[bf16]> {
        None
    }
    fn as_bf16_mut(_: &mut [Self]) -> Option<&mut [bf16]> {
        None
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

/// The two half types differ only in their names, formats and conversion loops.
macro_rules! half_elem {
    ($t:ty, $precision:expr, $suffix:literal, $widen:path, $narrow:path, $as_bf16:path,
     $as_bf16_mut:path) => {
        impl Elem for $t {
            const PRECISION: Precision = $precision;
            const SUFFIX: &'static str = $suffix;
            const IS_F32: bool = false;
            fn from_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn as_f32(_: &[Self]) -> Option<&[f32]> {
                None
            }
            fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
                None
            }
            fn as_bf16(s: &[Self]) -> Option<&[bf16]> {
                $as_bf16(s)
            }
            fn as_bf16_mut(s: &mut [Self]) -> Option<&mut [bf16]> {
                $as_bf16_mut(s)
            }
            fn widen(src: &[Self], dst: &mut [f32]) {
                assert_eq!(src.len(), dst.len(), "widen: lengths differ");
                $widen(src, dst);
            }
            fn narrow(src: &[f32], dst: &mut [Self]) {
                assert_eq!(src.len(), dst.len(), "narrow: lengths differ");
                $narrow(src, dst);
            }
        }
    };
}

half_elem!(
    f16,
    Precision::Fp16,
    "f16",
    widen_f16,
    narrow_f16,
    not_bf16,
    not_bf16_mut
);
half_elem!(
    bf16,
    Precision::Bf16,
    "bf16",
    widen_bf16,
    narrow_bf16,
    Some,
    Some
);

fn not_bf16(_: &[f16]) -> Option<&[bf16]> {
    None
}

fn not_bf16_mut(_: &mut [f16]) -> Option<&mut [bf16]> {
    None
}

// The conversions run over every activation of a half-precision session, several times per
// layer: `half`'s slice routines convert 8 values per call (about 0.5 ns per value on a Zen
// core), so where the CPU has them we use loops of F16C (f16) and AVX2 (bf16) instructions,
// several times faster. The same rounding (to nearest, ties to even; NaN stays NaN).

fn widen_f16(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd::f16c() {
        // SAFETY: the CPU has AVX2 and F16C (checked by `simd::f16c`); the lengths are equal.
        return unsafe { x86::widen_f16(src, dst) };
    }
    src.convert_to_f32_slice(dst);
}

fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    #[cfg(target_arch = "x86_64")]
    if simd::f16c() {
        // SAFETY: as for `widen_f16`.
        return unsafe { x86::narrow_f16(src, dst) };
    }
    dst.convert_from_f32_slice(src);
}

fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd::simd() >= simd::Simd::Avx512 {
        // SAFETY: the CPU has AVX-512F (checked by `simd::simd`); the lengths are equal.
        return unsafe { x86_512::widen_bf16_avx512(src, dst) };
    }
    #[cfg(target_arch = "x86_64")]
    if simd::simd().has_avx2() {
        // SAFETY: the CPU has AVX2 (checked by `simd::simd`); the lengths are equal.
        return unsafe { x86::widen_bf16(src, dst) };
    }
    src.convert_to_f32_slice(dst);
}

fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if simd::simd() >= simd::Simd::Avx512 {
        // SAFETY: as for `widen_bf16`.
        return unsafe { x86_512::narrow_bf16_avx512(src, dst) };
    }
    #[cfg(target_arch = "x86_64")]
    if simd::simd().has_avx2() {
        // SAFETY: as for `widen_bf16`.
        return unsafe { x86::narrow_bf16(src, dst) };
    }
    dst.convert_from_f32_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU has AVX2 and F16C; `src` and `dst` have the same length.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen_f16(src: &[f16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        // SAFETY: every 8-value access lies below n ≤ both lengths.
        unsafe {
            for i in (0..n).step_by(8) {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = s.to_f32();
        }
    }

    /// # Safety
    /// As for [`widen_f16`].
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn narrow_f16(src: &[f32], dst: &mut [f16]) {
        let n = src.len() / 8 * 8;
        // SAFETY: as in `widen_f16`.
        unsafe {
            for i in (0..n).step_by(8) {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = f16::from_f32(*s);
        }
    }

    /// # Safety
    /// The CPU has AVX2; `src` and `dst` have the same length.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        // SAFETY: as in `widen_f16`.
        unsafe {
            for i in (0..n).step_by(8) {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                let bits = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(bits));
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = s.to_f32();
        }
    }

    /// Round to nearest, ties to even, as `bf16::from_f32`; a NaN keeps its sign and top
    /// payload bits and is made quiet.
    ///
    /// # Safety
    /// As for [`widen_bf16`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
        let n = src.len() / 8 * 8;
        // SAFETY: as in `widen_f16`.
        unsafe {
            let bias = _mm256_set1_epi32(0x7fff);
            let one = _mm256_set1_epi32(1);
            let quiet = _mm256_set1_epi32(0x40);
            for i in (0..n).step_by(8) {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                let x = _mm256_castps_si256(v);
                let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(x), one);
                let rounded =
                    _mm256_srli_epi32::<16>(_mm256_add_epi32(x, _mm256_add_epi32(bias, odd)));
                let nan_bits = _mm256_or_si256(_mm256_srli_epi32::<16>(x), quiet);
                let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                let r = _mm256_blendv_epi8(rounded, nan_bits, is_nan);
                // 32 → 16 bits: the pack works within 128-bit lanes, the permute restores order.
                let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(r, r));
                _mm_storeu_si128(
                    dst.as_mut_ptr().add(i) as *mut __m128i,
                    _mm256_castsi256_si128(packed),
                );
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = bf16::from_f32(*s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// [`super::x86::widen_bf16`] 16 values at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `src` and `dst` have the same length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_bf16_avx512(src: &[bf16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        // SAFETY: every 16-value access lies below n ≤ both lengths.
        unsafe {
            for i in (0..n).step_by(16) {
                let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
                let bits = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(bits));
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = s.to_f32();
        }
    }

    /// [`super::x86::narrow_bf16`] 16 values at a time, with the same rounding and NaNs.
    ///
    /// # Safety
    /// As for [`widen_bf16_avx512`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn narrow_bf16_avx512(src: &[f32], dst: &mut [bf16]) {
        let n = src.len() / 16 * 16;
        // SAFETY: as in `widen_bf16_avx512`.
        unsafe {
            let bias = _mm512_set1_epi32(0x7fff);
            let one = _mm512_set1_epi32(1);
            let quiet = _mm512_set1_epi32(0x40);
            for i in (0..n).step_by(16) {
                let v = _mm512_loadu_ps(src.as_ptr().add(i));
                let x = _mm512_castps_si512(v);
                let high = _mm512_srli_epi32::<16>(x);
                let odd = _mm512_and_si512(high, one);
                let rounded =
                    _mm512_srli_epi32::<16>(_mm512_add_epi32(x, _mm512_add_epi32(bias, odd)));
                let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
                let r = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_or_si512(high, quiet));
                // Every lane is below 2¹⁶: the truncating 32 → 16-bit move keeps it whole.
                _mm256_storeu_si256(
                    dst.as_mut_ptr().add(i) as *mut __m256i,
                    _mm512_cvtepi32_epi16(r),
                );
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = bf16::from_f32(*s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that exercise rounding (ties to even both ways), subnormals, overflow, the
    /// infinities and NaN, over a length with a tail that is not a multiple of 8.
    fn awkward() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            -2.5,
            65504.0,
            65520.0,
            1e6,
            -1e-7,
            6e-8,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x7f7f_ffff),
            f32::MIN_POSITIVE,
        ];
        v.extend(
            (0..1000).map(|i| ((i * 7919) % 2003) as f32 * 0.37 - 350.0 + 1.0 / (i + 1) as f32),
        );
        v
    }

    /// Our conversion loops give exactly `half`'s results, bit for bit.
    #[test]
    fn conversions_match_half() {
        let src = awkward();
        let mut h = vec![f16::ZERO; src.len()];
        let mut b = vec![bf16::ZERO; src.len()];
        f16::narrow(&src, &mut h);
        bf16::narrow(&src, &mut b);
        for (i, &v) in src.iter().enumerate() {
            assert_eq!(
                h[i].to_bits(),
                f16::from_f32(v).to_bits(),
                "f16 narrow of {v:e}"
            );
            assert_eq!(
                b[i].to_bits(),
                bf16::from_f32(v).to_bits(),
                "bf16 narrow of {v:e}"
            );
        }
        let mut wide = vec![0f32; src.len()];
        f16::widen(&h, &mut wide);
        for (w, x) in wide.iter().zip(&h) {
            assert_eq!(w.to_bits(), x.to_f32().to_bits(), "f16 widen of {x}");
        }
        bf16::widen(&b, &mut wide);
        for (w, x) in wide.iter().zip(&b) {
            assert_eq!(w.to_bits(), x.to_f32().to_bits(), "bf16 widen of {x}");
        }
    }
}

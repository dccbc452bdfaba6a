//! Storage element types of the CPU backend. Activations and weights are stored as f32, f16 or
//! bf16; all arithmetic is f32. Conversions go through `half`'s slice routines, which use the
//! F16C instructions when the CPU has them.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::simd;
use crate::model::Precision;

pub trait Elem: bytemuck::Pod + Send + Sync + Default + 'static {
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
    /// The slice itself when the storage type is bf16 (what the bf16-pair GEMMs read).
    fn as_bf16(s: &[Self]) -> Option<&[bf16]>;
    fn as_bf16_mut(s: &mut [Self]) -> Option<&mut [bf16]>;
    /// The slice itself when the storage type is f16 (what the SGEMM's f16 tiles read).
    fn as_f16(s: &[Self]) -> Option<&[f16]>;
    fn as_f16_mut(s: &mut [Self]) -> Option<&mut [f16]>;
    /// A half type's values as their bits, with +∞'s bits: the values above it are NaNs,
    /// those in 1..=+∞ positive (what ReLU keeps). `None` for f32.
    fn half_bits_mut(s: &mut [Self]) -> Option<(&mut [u16], u16)>;
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
    fn as_f16(_: &[Self]) -> Option<&[f16]> {
        None
    }
    fn as_f16_mut(_: &mut [Self]) -> Option<&mut [f16]> {
        None
    }
    fn half_bits_mut(_: &mut [Self]) -> Option<(&mut [u16], u16)> {
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
     $as_bf16_mut:path, $as_f16:path, $as_f16_mut:path) => {
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
            fn as_f16(s: &[Self]) -> Option<&[f16]> {
                $as_f16(s)
            }
            fn as_f16_mut(s: &mut [Self]) -> Option<&mut [f16]> {
                $as_f16_mut(s)
            }
            fn half_bits_mut(s: &mut [Self]) -> Option<(&mut [u16], u16)> {
                Some((s.reinterpret_cast_mut(), <$t>::INFINITY.to_bits()))
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
    not_bf16_mut,
    Some,
    Some
);
half_elem!(
    bf16,
    Precision::Bf16,
    "bf16",
    widen_bf16,
    narrow_bf16,
    Some,
    Some,
    not_f16,
    not_f16_mut
);

fn not_f16(_: &[bf16]) -> Option<&[f16]> {
    None
}

fn not_f16_mut(_: &mut [bf16]) -> Option<&mut [f16]> {
    None
}

fn not_bf16(_: &[f16]) -> Option<&[bf16]> {
    None
}

fn not_bf16_mut(_: &mut [f16]) -> Option<&mut [bf16]> {
    None
}

// The conversions run over every activation of a half-precision session, several times per
// layer: `half`'s slice routines convert 8 values per call (about 0.5 ns per value on a Zen
// core), so where the CPU has them we use loops of F16C instructions (f16) and loops the
// compiler vectorises for AVX2 or AVX-512 (bf16: shifts and an integer rounding), several
// times faster. The same rounding (to nearest, ties to even; NaN stays NaN).

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

/// Batch norm's `y = x·scale[c] + shift[c]` on f16 pixels of `c` channels in place (a part
/// pixel at the end left as it is), converted in registers by F16C (`vcvtph2ps`, then
/// `vcvtps2ph` to nearest): one pass over memory instead of widening a block into scratch,
/// mapping it and narrowing it back, with the same results bit for bit. `false` (nothing
/// done) where the CPU has no F16C.
pub fn affine_f16(part: &mut [f16], c: usize, scale: &[f32], shift: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd::f16c() {
        assert!(c > 0 && scale.len() >= c && shift.len() >= c);
        // SAFETY: the CPU has AVX2 and F16C (checked by `simd::f16c`); scale and shift cover
        // the channels.
        unsafe { x86::affine_f16(part, c, scale, shift) };
        return true;
    }
    false
}

/// a += b on f16 (each sum rounded once), converted in registers as [`affine_f16`] does;
/// `false` (nothing done) where the CPU has no F16C.
pub fn add_f16(a: &mut [f16], b: &[f16]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd::f16c() {
        assert_eq!(a.len(), b.len(), "add: lengths differ");
        // SAFETY: as in `affine_f16`; the lengths are equal.
        unsafe { x86::add_f16(a, b) };
        return true;
    }
    false
}

fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    simd::with_simd(simd::ZipWith(dst, src, |d: &mut f32, s: &bf16| {
        *d = bf16_f32(*s)
    }));
}

fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    simd::with_simd(simd::ZipWith(dst, src, |d: &mut bf16, s: &f32| {
        *d = f32_bf16(*s)
    }));
}

/// A bf16 value's f32 (exact: the bf16 bits are the f32's top half).
#[inline(always)]
pub fn bf16_f32(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

/// The bf16 nearest an f32 (ties to even; a NaN keeps its sign and top payload bits and is
/// made quiet), bit for bit as `bf16::from_f32`, written so that a loop of it vectorises: in
/// [`simd::with_simd`] as fast as hand-written AVX2 intrinsics were (2048 values: 61 ms vs
/// 61–71 ms per 100,000 calls on a Zen 1 core), at any vector width.
#[inline(always)]
pub fn f32_bf16(v: f32) -> bf16 {
    let x = v.to_bits();
    let bits = if v.is_nan() {
        (x >> 16) | 0x40
    } else {
        (x + 0x7fff + ((x >> 16) & 1)) >> 16
    };
    bf16::from_bits(bits as u16)
}

/// [`f32_bf16`] of 8 floats in AVX2 registers: each lane's bf16 in its low 16 bits (ties to
/// even; a NaN made quiet, its sign and top payload bits kept), for a kernel to pack and store
/// (`vpackusdw`: every lane is below 2¹⁶).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn bf16_bits8(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let x = _mm256_castps_si256(v);
    let high = _mm256_srli_epi32::<16>(x);
    let lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    let up = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    let rounded = _mm256_srli_epi32::<16>(up);
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    let quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// [`bf16_bits8`] of 16 floats in AVX-512 registers (AVX-512F).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn bf16_bits16(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let x = _mm512_castps_si512(v);
    let high = _mm512_srli_epi32::<16>(x);
    let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    let up = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    let rounded = _mm512_srli_epi32::<16>(up);
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    _mm512_mask_mov_epi32(rounded, nan, quiet)
}

/// Storage that the kernels written with intrinsics load and store a vector at a time (the
/// GEMM's small-K kernel, the depthwise rows, the AVX-512 stems): f32; bf16, widened as it is
/// loaded and rounded in registers as it is stored (to nearest, ties to even, as
/// [`f32_bf16`]).
pub(crate) trait Wide: Copy + Default {
    /// The lanes of `mask` of `v` stored at `p`.
    ///
    /// # Safety
    /// The CPU has AVX-512F; those lanes' places at `p` are writable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn store(p: *mut Self, mask: std::arch::x86_64::__mmask16, v: std::arch::x86_64::__m512);

    /// The lanes of `mask` from `p`, the others zero.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and VL; those lanes' places at `p` are readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load(p: *const Self, mask: std::arch::x86_64::__mmask16)
    -> std::arch::x86_64::__m512;

    /// 8 values from `p`, widened.
    ///
    /// # Safety
    /// The CPU has AVX2; 8 values at `p` are readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// `v`'s 8 values stored at `p`, narrowed.
    ///
    /// # Safety
    /// The CPU has AVX2; 8 places at `p` are writable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn store8(p: *mut Self, v: std::arch::x86_64::__m256);

    /// Whether [`Wide::store16`] stores two vectors in fewer instructions than two
    /// [`Wide::store8`] (bf16: one pack and one store for both).
    const PACKS_16: bool = false;

    /// `v`'s 16 values (the first vector's, then the second's) stored at `p`, narrowed.
    ///
    /// # Safety
    /// The CPU has AVX2; 16 places at `p` are writable.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store16(p: *mut Self, v: [std::arch::x86_64::__m256; 2]) {
        // SAFETY: the caller's.
        unsafe {
            Self::store8(p, v[0]);
            Self::store8(p.wrapping_add(8), v[1]);
        }
    }
}

impl Wide for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store(p: *mut f32, mask: std::arch::x86_64::__mmask16, v: std::arch::x86_64::__m512) {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm512_mask_storeu_ps(p, mask, v) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load(p: *const f32, mask: std::arch::x86_64::__mmask16) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm512_maskz_loadu_ps(mask, p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store8(p: *mut f32, v: std::arch::x86_64::__m256) {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_storeu_ps(p, v) }
    }
}

impl Wide for bf16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store(
        p: *mut bf16,
        mask: std::arch::x86_64::__mmask16,
        v: std::arch::x86_64::__m512,
    ) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's (AVX-512F; the store writes the lanes of `mask` alone).
        unsafe { _mm512_mask_cvtepi32_storeu_epi16(p.cast(), mask, bf16_bits16(v)) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load(
        p: *const bf16,
        mask: std::arch::x86_64::__mmask16,
    ) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's (AVX-512BW and VL: the AVX-512 paths ask for them; the load
        // reads the lanes of `mask` alone). bf16 is f32's upper half.
        unsafe {
            let x = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's (AVX2; 8 values, 16 bytes).
        unsafe {
            let x = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store8(p: *mut bf16, v: std::arch::x86_64::__m256) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's (AVX2; 8 places, 16 bytes).
        unsafe {
            let bits = bf16_bits8(v);
            // Every lane is below 2¹⁶: packing with unsigned saturation keeps it.
            let packed = _mm_packus_epi32(
                _mm256_castsi256_si128(bits),
                _mm256_extracti128_si256::<1>(bits),
            );
            _mm_storeu_si128(p.cast(), packed);
        }
    }

    const PACKS_16: bool = true;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store16(p: *mut bf16, v: [std::arch::x86_64::__m256; 2]) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's (AVX2; 16 places, 32 bytes).
        unsafe {
            // Packed lane by lane (the first vector's first 4, the second's first 4, the
            // first's last 4, the second's last 4), then the middle quarters swapped.
            let packed = _mm256_packus_epi32(bf16_bits8(v[0]), bf16_bits8(v[1]));
            let row = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            _mm256_storeu_si256(p.cast(), row);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
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

    /// 8 f16 at `p` as f32.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; 8 values are readable at `p`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller's.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }

    /// 8 f32 rounded to f16 (to nearest, as `narrow_f16`) and stored at `p`.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; 8 values are writable at `p`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn store8(p: *mut f16, v: __m256) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        // SAFETY: the caller's.
        unsafe { _mm_storeu_si128(p as *mut __m128i, h) };
    }

    /// # Safety
    /// The CPU has AVX2 and F16C; `scale` and `shift` hold at least `c` values.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn affine_f16(part: &mut [f16], c: usize, scale: &[f32], shift: &[f32]) {
        let full = c / 8 * 8;
        for px in part.chunks_exact_mut(c) {
            // SAFETY: channel groups of 8 below `full` ≤ c, inside the pixel and both maps.
            unsafe {
                for k in (0..full).step_by(8) {
                    // Multiply, then add: rounded twice, as the f32 path computes it.
                    let y = _mm256_add_ps(
                        _mm256_mul_ps(load8(px.as_ptr().add(k)), _mm256_loadu_ps(&scale[k])),
                        _mm256_loadu_ps(&shift[k]),
                    );
                    store8(px.as_mut_ptr().add(k), y);
                }
            }
            for k in full..c {
                px[k] = f16::from_f32(px[k].to_f32() * scale[k] + shift[k]);
            }
        }
    }

    /// # Safety
    /// The CPU has AVX2 and F16C; `a` and `b` have the same length.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn add_f16(a: &mut [f16], b: &[f16]) {
        let n = a.len() / 8 * 8;
        // SAFETY: every 8-value access lies below n ≤ both lengths.
        unsafe {
            for i in (0..n).step_by(8) {
                let sum = _mm256_add_ps(load8(a.as_ptr().add(i)), load8(b.as_ptr().add(i)));
                store8(a.as_mut_ptr().add(i), sum);
            }
        }
        for (x, y) in a[n..].iter_mut().zip(&b[n..]) {
            *x = f16::from_f32(x.to_f32() + y.to_f32());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bf16 stores' rounding in registers is `f32_bf16`'s, bit for bit: values that round
    /// up, down and to even, signed zeros, infinities, overflow to infinity, NaNs; on AVX2 8
    /// values in order (both halves of the ymm) and 16 by `store16` (both vectors' halves in
    /// order), none past them; on AVX-512, lanes outside the mask left alone. Each where the
    /// CPU has its instructions.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_bf16_stores_round_as_f32_bf16() {
        use super::simd::{Simd, simd};
        use std::arch::x86_64::{_mm256_loadu_ps, _mm512_loadu_ps};
        let values: [f32; 16] = [
            1.0,
            f32::from_bits(0x3f80_8000), // a tie, to even (down)
            f32::from_bits(0x3f81_8000), // a tie, to even (up)
            f32::from_bits(0x3f80_8001), // just above a tie: up
            f32::from_bits(0x3f80_7fff), // just below: down
            -2.5,
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX, // rounds to infinity
            f32::NAN,
            f32::from_bits(0xff80_0001), // a signalling NaN, negative
            1e-40,                       // subnormal
            -2.71875,
            65504.0,
        ];
        let want = |v: f32| f32_bf16(v).to_bits();
        let b7 = bf16::from_f32(7.0);
        if is_x86_feature_detected!("avx2") {
            for half in values.chunks(8) {
                let mut b = [b7; 9];
                // SAFETY: AVX2 (checked above); 8 readable values, 8 writable places.
                unsafe { <bf16 as Wide>::store8(b.as_mut_ptr(), _mm256_loadu_ps(half.as_ptr())) };
                for (i, v) in half.iter().enumerate() {
                    assert_eq!(b[i].to_bits(), want(*v), "AVX2 lane {i} ({v:e})");
                }
                assert_eq!(b[8], b7, "AVX2 wrote past its 8 values");
            }
            let mut b = [b7; 17];
            // SAFETY: AVX2 (checked above); 16 readable values, 16 writable places.
            unsafe {
                let v = [0, 8].map(|at| _mm256_loadu_ps(values[at..].as_ptr()));
                <bf16 as Wide>::store16(b.as_mut_ptr(), v);
            }
            for (i, v) in values.iter().enumerate() {
                assert_eq!(b[i].to_bits(), want(*v), "AVX2 pair, value {i} ({v:e})");
            }
            assert_eq!(b[16], b7, "AVX2 wrote past its 16 values");
        } else {
            eprintln!("no AVX2 here: its bf16 stores are not exercised");
        }
        if !matches!(simd(), Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx) {
            eprintln!("no AVX-512 here: its bf16 store is not exercised");
            return;
        }
        for mask in [0xffffu16, 0x00ff, 0x8001] {
            let mut b = [b7; 16];
            // SAFETY: AVX-512F (checked above); 16 writable values.
            unsafe {
                let v = _mm512_loadu_ps(values.as_ptr());
                <bf16 as Wide>::store(b.as_mut_ptr(), mask, v);
            }
            for (i, v) in values.iter().enumerate() {
                let want = if mask >> i & 1 == 1 {
                    want(*v)
                } else {
                    b7.to_bits()
                };
                assert_eq!(b[i].to_bits(), want, "lane {i} ({v:e}), mask {mask:#x}");
            }
        }
    }

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
            // Signalling NaNs: their payload sits below the bits a bf16 keeps.
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_0001),
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

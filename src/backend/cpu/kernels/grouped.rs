//! Grouped 3×3 convolutions of a few channels a group (ResNeXt-50 32×4d's 4, 8, 16 and 32,
//! RegNet's 8 and 16): direct loops in zmm registers over 16 output channels — 8 groups of 2
//! to one group of 16, or half a group of 32.
//!
//! Through im2col and the GEMM, such a layer ran as one GEMM per group of N = 4 or 8 output
//! channels on 16-column panels — three quarters (or half) of every FMA wasted on padding —
//! after gathering columns of 9 · channels floats a pixel. Here each output lane needs the
//! j-th input channel of its own group: one permute of the 16 input channels a pixel holds
//! (`vpermps`, the same index for every pixel) gives it to all lanes at once, and every FMA
//! is the layer's own work. In BF16, where the CPU multiplies bf16 pairs, one permute gives
//! each lane two of its group's channels as one pair and one `vdpbf16ps` multiplies both:
//! half the permutes and half the multiplies (alone, batch 8 on a Zen 5: 0.55–0.6× the time
//! of the FMA form on the same bf16 tensors).

use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::{Elem, Wide};
use crate::model::op::Conv2d;

/// A grouped layer's weights for [`conv2d_grouped`], a block of 16 output channels after
/// another: in each, (tap, way, lane), output channel lane's weights for the way's input
/// channels of its group, so that every weight of a block sits at a fixed offset from its
/// start (an FMA's memory operand; as one (tap, j, channel) array the compiler kept a pointer
/// per (tap, j) on the stack). A way is one input channel j (its weight an f32's bits), or
/// where the layer multiplies bf16 pairs ([`multiplies_pairs`]) two, 2j and 2j + 1 (their
/// weights two bf16, 2j's in the low half, as `vdpbf16ps` pairs them with the input's
/// channels). Rounded through the storage type, as every precision's packing is; the lanes
/// past the channels zero. `bias` 16 a block.
pub struct Grouped {
    w: Vec<u32>,
    bias: Vec<f32>,
    channels: usize,
    pairs: bool,
}

impl Grouped {
    /// From PyTorch's (cout, cin/groups, 3, 3) weight, where [`takes`] the layer.
    pub fn new<T: Elem>(c: &Conv2d, weight: &[f32], bias: Option<&[f32]>) -> Self {
        let (ch, g) = (c.out_channels, group_width(c));
        let pairs = multiplies_pairs::<T>();
        let per = if pairs { 2 } else { 1 };
        let blocks = ch.div_ceil(16);
        let mut w = vec![0u32; blocks * TAPS * g / per * 16];
        let mut b = vec![0f32; blocks * 16];
        for co in 0..ch {
            let (block, lane) = (co / 16, co % 16);
            for way in 0..g / per {
                for t in 0..TAPS {
                    let at = |j: usize| weight[(co * g + way * per + j) * TAPS + t];
                    w[((block * TAPS + t) * g / per + way) * 16 + lane] = match pairs {
                        true => {
                            let bits = |j| u32::from(half::bf16::from_f32(at(j)).to_bits());
                            bits(0) | bits(1) << 16
                        }
                        false => T::from_f32(at(0)).to_f32().to_bits(),
                    };
                }
            }
            b[co] = bias.map_or(0.0, |bias| bias[co]);
        }
        Grouped {
            w,
            bias: b,
            channels: ch,
            pairs,
        }
    }

    pub fn bytes(&self) -> u64 {
        (self.w.len() + self.bias.len()) as u64 * 4
    }

    /// Whether the weights are bf16 pairs ([`multiplies_pairs`]).
    pub fn pairs(&self) -> bool {
        self.pairs
    }
}

/// Whether a grouped layer of this precision multiplies bf16 pairs (`vdpbf16ps`): BF16, where
/// the paths in use multiply pairs and the start-up probe found them paying FLOP for FLOP
/// ([`crate::backend::cpu::probe::Bf16Pairs::pay`]). Unlike the depthwise pair kernels these
/// spend no shuffle the FMA kernel does not: a permute brings a lane two input channels, so a
/// pixel takes half the permutes and half the multiplies.
pub fn multiplies_pairs<T: Elem>() -> bool {
    use crate::backend::cpu::simd::{Simd, simd};
    T::PRECISION == crate::model::Precision::Bf16
        && matches!(simd(), Simd::Avx512Bf16 | Simd::Amx)
        && crate::backend::cpu::probe::bf16_pairs().is_some_and(|p| p.pay())
}

/// The taps of the 3×3 layers the kernel takes.
const TAPS: usize = 9;

/// Input (and output) channels a group of `c`.
fn group_width(c: &Conv2d) -> usize {
    c.in_channels / c.groups.max(1)
}

/// Whether [`conv2d_grouped`] runs `c`: a grouped (not depthwise) 3×3 layer at stride 1 or
/// 2 without dilation (32 channels a group: stride 1), as many output channels a group as
/// input ones, 2, 4, 8, 16 or 32 of them (whole groups in a vector of 16, or a vector in a
/// group), where the SIMD path in use has AVX-512.
pub fn takes(c: &Conv2d) -> bool {
    let g = group_width(c);
    #[cfg(target_arch = "x86_64")]
    let avx512 = crate::backend::cpu::simd::simd() >= crate::backend::cpu::simd::Simd::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = false;
    avx512
        && c.groups > 1
        && matches!(g, 2 | 4 | 8 | 16 | 32)
        // At stride 2 a run of 4 pixels makes 12 FMAs of each input pixel's 9 permutes, where
        // the GEMM's panels are whole at 32 channels a group: 1024 channels at 14² took 1.1 ms
        // there against 0.77 through im2col (16 a group: 1.14–1.17 against 1.19–1.63).
        && (g < 32 || c.stride.0 == 1)
        && c.out_channels == c.in_channels
        && c.kernel == (3, 3)
        && c.stride.0 == c.stride.1
        && matches!(c.stride.0, 1 | 2)
        && c.dilation == (1, 1)
}

/// The grouped convolution `c` (which [`takes`] allows) of `x` into `y`, one output row per
/// work item, finished with the residual and the activation in registers.
pub(super) fn conv2d_grouped<T: Elem + Wide>(
    c: &Conv2d,
    p: &Grouped,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    residual: Option<&[T]>,
) {
    assert!(
        takes(c) && xs.c == c.in_channels && ys.c == c.out_channels && ys.n == xs.n,
        "grouped: a layer the kernel does not take"
    );
    assert!(
        !p.pairs || T::PRECISION == crate::model::Precision::Bf16,
        "grouped: bf16 pairs of another type"
    );
    let row_len = ys.w * ys.c;
    let y = &mut y[..ys.n * ys.h * row_len];
    y.par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, out)| {
            let (n, oy) = (row / ys.h, row % ys.h);
            let input: [Option<&[T]>; 3] = std::array::from_fn(|ky| {
                super::pool::image_row(x, xs, n, super::depthwise::tap_row(c, oy, ky))
            });
            let residual = residual.map(|r| &r[row * row_len..][..row_len]);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `takes` checked that the paths in use have AVX-512 (F, BW, VL with it), and
            // `multiplies_pairs` AVX512_BF16 (or AMX, which has it) where the weights are pairs,
            // of bf16 values; the rows hold xs.w pixels of xs.c channels, the weights and bias
            // whole blocks of 16.
            unsafe {
                let at = (&input, p, c.padding.1, xs.w, residual);
                match p.pairs {
                    true => zmm::row_pairs(c, at, out),
                    false => zmm::row(c, at, out),
                }
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (input, residual, out);
        });
}

#[cfg(target_arch = "x86_64")]
mod zmm {
    use std::arch::x86_64::*;

    use super::super::activation::{activate_zmm, with_vec_act};
    use super::{Grouped, group_width};
    use crate::backend::cpu::elem::Wide;
    use crate::model::op::Conv2d;

    /// How a way's input channels meet its weights: one channel a lane in f32 by an FMA
    /// ([`Fma`]), or two as a bf16 pair by `vdpbf16ps` ([`Pairs`]).
    pub(super) trait Form {
        /// The input channels a way multiplies in each lane.
        const PER: usize;

        /// The 16 channels from `here` (the lanes of `mask`; the others zero), lane l given
        /// the 32-bit element `way[l]` of them: a value in f32, or a pair of bf16.
        ///
        /// # Safety
        /// The CPU has AVX-512F, BW and VL; the lanes of `mask` at `here` are readable.
        unsafe fn input<T: Wide>(here: *const T, mask: __mmask16, way: __m512i) -> __m512i;

        /// [`Form::input`] where every lane takes the same element, `i` (groups of 16 or
        /// more): a broadcast load, no shuffle, where the type allows one.
        ///
        /// # Safety
        /// As for [`Form::input`]; element `i` is readable.
        unsafe fn broadcast<T: Wide>(
            here: *const T,
            i: usize,
            mask: __mmask16,
            way: __m512i,
        ) -> __m512i;

        /// `acc` plus the products of `x`'s and `w`'s lanes (of their pairs' halves, summed).
        ///
        /// # Safety
        /// The CPU has AVX-512F (and AVX512_BF16 for [`Pairs`]).
        unsafe fn madd(acc: __m512, x: __m512i, w: __m512i) -> __m512;
    }

    /// One input channel a way: the pixel widened to f32, one FMA a way and tap.
    pub(super) struct Fma;

    impl Form for Fma {
        const PER: usize = 1;

        #[inline(always)]
        unsafe fn input<T: Wide>(here: *const T, mask: __mmask16, way: __m512i) -> __m512i {
            // SAFETY: the caller's.
            unsafe { _mm512_castps_si512(_mm512_permutexvar_ps(way, T::load(here, mask))) }
        }

        #[inline(always)]
        unsafe fn broadcast<T: Wide>(
            here: *const T,
            i: usize,
            mask: __mmask16,
            way: __m512i,
        ) -> __m512i {
            // SAFETY: the caller's; f32 values are 32 bits (bf16 ones, widened, keep the
            // permute).
            unsafe {
                match size_of::<T>() == 4 {
                    true => _mm512_set1_epi32(here.cast::<i32>().add(i).read_unaligned()),
                    false => Self::input(here, mask, way),
                }
            }
        }

        #[inline(always)]
        unsafe fn madd(acc: __m512, x: __m512i, w: __m512i) -> __m512 {
            // SAFETY: the caller's.
            unsafe { _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), acc) }
        }
    }

    /// Two input channels a way: the pixel's bf16 values as they are stored, 16 in the low
    /// half of the vector (8 pairs), one `vdpbf16ps` a way and tap.
    pub(super) struct Pairs;

    impl Form for Pairs {
        const PER: usize = 2;

        #[inline(always)]
        unsafe fn input<T: Wide>(here: *const T, mask: __mmask16, way: __m512i) -> __m512i {
            // SAFETY: the caller's; T is bf16 (`conv2d_grouped` checked), 16 bits a value.
            unsafe {
                let pixel = _mm256_maskz_loadu_epi16(mask, here.cast());
                _mm512_permutexvar_epi32(way, _mm512_zextsi256_si512(pixel))
            }
        }

        #[inline(always)]
        unsafe fn broadcast<T: Wide>(
            here: *const T,
            i: usize,
            _: __mmask16,
            _: __m512i,
        ) -> __m512i {
            // SAFETY: the caller's; T is bf16, a pair 32 bits.
            unsafe { _mm512_set1_epi32(here.cast::<i32>().add(i).read_unaligned()) }
        }

        #[inline(always)]
        unsafe fn madd(acc: __m512, x: __m512i, w: __m512i) -> __m512 {
            // SAFETY: the caller's; both hold bf16 pairs, which is all `__m512bh` means.
            unsafe {
                let bh = |v| std::mem::transmute::<__m512i, __m512bh>(v);
                _mm512_dpbf16_ps(acc, bh(x), bh(w))
            }
        }
    }

    /// One output row into `out` (`at`: what it reads), a way a channel on the FMAs.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and VL; `at` holds the 3 tap rows (`None` in the padding) of
    /// the input's width in pixels of the layer's channels; `out` (and the residual) one
    /// output row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn row<T: Wide>(c: &Conv2d, at: At<'_, T>, out: &mut [T]) {
        // SAFETY: the caller's.
        unsafe { shapes::<T, Fma>(c, at, out) }
    }

    /// [`row`] on bf16 pairs (`at`'s weights packed so).
    ///
    /// # Safety
    /// As for [`row`], and the CPU has AVX512_BF16; T is bf16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn row_pairs<T: Wide>(c: &Conv2d, at: At<'_, T>, out: &mut [T]) {
        // SAFETY: the caller's.
        unsafe { shapes::<T, Pairs>(c, at, out) }
    }

    /// The shape's loop, the activation's copy of it, in the caller's features.
    ///
    /// # Safety
    /// As for [`row`] (and [`row_pairs`] for its form).
    #[inline(always)]
    unsafe fn shapes<T: Wide, F: Form>(c: &Conv2d, at: At<'_, T>, out: &mut [T]) {
        macro_rules! shapes {
            ($op:expr) => {
                match (group_width(c), c.stride.1) {
                    (2, 1) => row_g::<T, F, 2, 1, 8>(at, out, $op),
                    (4, 1) => row_g::<T, F, 4, 1, 8>(at, out, $op),
                    (8, 1) => row_g::<T, F, 8, 1, 8>(at, out, $op),
                    (16, 1) => row_g::<T, F, 16, 1, 8>(at, out, $op),
                    (32, 1) => row_g::<T, F, 32, 1, 8>(at, out, $op),
                    (2, _) => row_g::<T, F, 2, 2, 4>(at, out, $op),
                    (4, _) => row_g::<T, F, 4, 2, 4>(at, out, $op),
                    (8, _) => row_g::<T, F, 8, 2, 4>(at, out, $op),
                    _ => row_g::<T, F, 16, 2, 4>(at, out, $op),
                }
            };
        }
        // SAFETY: the caller's.
        unsafe { with_vec_act!(c.act, activate_zmm, |op| shapes!(op)) }
    }

    /// What [`row_g`] reads besides its output: the tap rows, the weights, the padding, the
    /// input's width, the residual row.
    pub(super) type At<'a, T> = (
        &'a [Option<&'a [T]>; 3],
        &'a Grouped,
        usize,
        usize,
        Option<&'a [T]>,
    );

    /// [`row`] for groups of G channels at stride S, P output pixels a run, in form F: for
    /// each block of 16 channels and run of pixels, the bias, then tap row by tap row and way
    /// by way each input pixel the run reads ([`pixel`], unrolled: as a loop the compiler kept
    /// the sums on the stack); the sums finished with the residual and `op`.
    ///
    /// # Safety
    /// As for [`row`].
    #[inline(always)]
    unsafe fn row_g<T: Wide, F: Form, const G: usize, const S: usize, const P: usize>(
        (input, p, pad, width, residual): At<'_, T>,
        out: &mut [T],
        op: impl Fn(__m512) -> __m512,
    ) {
        let ch = p.channels;
        let out_w = out.len() / ch;
        let ways_n = G / F::PER;
        // SAFETY: the caller's (AVX-512; every load and store of the input and output masked
        // to the block's channels, input pixels checked against the row's width; the weights
        // and bias are whole blocks).
        unsafe {
            // Way w's lanes: each output lane's group's channels w·PER (and the next); in
            // groups wider than a vector (32) every lane takes them from the block of the
            // group that holds them, which `shift` finds.
            let ways: [__m512i; G] = std::array::from_fn(|w| {
                let j = w * F::PER;
                let lanes: [i32; 16] = std::array::from_fn(|l| match G > 16 {
                    true => (j % 16 / F::PER) as i32,
                    false => (((l / G) * G + j) / F::PER % 16) as i32,
                });
                _mm512_loadu_si512(lanes.as_ptr().cast())
            });
            for c0 in (0..ch).step_by(16) {
                let mask = (u32::MAX >> (32 - (ch - c0).min(16))) as __mmask16;
                let block = p.w.as_ptr().add(c0 / 16 * super::TAPS * ways_n * 16);
                let bias = _mm512_loadu_ps(p.bias.as_ptr().add(c0));
                for ox0 in (0..out_w).step_by(P) {
                    let x0 = (ox0 * S) as isize - pad as isize;
                    let mut acc = [bias; P];
                    for (ky, row) in input.iter().enumerate() {
                        let Some(row) = row else { continue };
                        let at = Pixel {
                            row: row.as_ptr().add(c0),
                            x0,
                            width,
                            ch,
                            mask,
                            w: block.add(ky * 3 * ways_n * 16),
                            // The last tap row's pixels S rows down are the next output row's
                            // new input (the other rows it reads, this one's already read).
                            ahead: if ky == 2 { S * width * ch } else { 0 },
                        };
                        for (w, &way) in ways.iter().enumerate().take(ways_n) {
                            // Where way w's input block starts, from the output block's first
                            // channel (elsewhere only in groups wider than a vector).
                            let shift = match G > 16 {
                                true => (w * F::PER / 16 * 16) as isize - (c0 % G) as isize,
                                false => 0,
                            };
                            let at = Pixel {
                                row: at.row.wrapping_offset(shift),
                                ..at
                            };
                            // This way's weights of the tap row's three taps, held in
                            // registers for every pixel (an FMA's memory operand each time,
                            // they took as many loads as FMAs).
                            // Groups of 16 or more: every lane takes the same element.
                            let all = (G >= 16).then_some(w * F::PER % 16 / F::PER);
                            let wk: [__m512i; 3] = std::array::from_fn(|kx| {
                                _mm512_loadu_si512(at.w.add((kx * ways_n + w) * 16).cast())
                            });
                            macro_rules! pixels {
                                ($($i:literal)*) => {
                                    $( if $i < (P - 1) * S + 3 {
                                        pixel::<T, F, S, P, $i>(&at, (way, all, w == 0), &wk, &mut acc);
                                    } )*
                                };
                            }
                            pixels!(0 1 2 3 4 5 6 7 8 9);
                        }
                    }
                    for (q, v) in acc.iter().enumerate().take(out_w - ox0) {
                        let at = (ox0 + q) * ch + c0;
                        let v = match residual {
                            Some(r) => _mm512_add_ps(*v, T::load(r.as_ptr().add(at), mask)),
                            None => *v,
                        };
                        T::store(out.as_mut_ptr().add(at), mask, op(v));
                    }
                }
            }
        }
    }

    /// Where [`pixel`] reads: the tap row from the block's first channel, the run's first
    /// input column, the row's width, the channels a pixel, the block's mask, and the block's
    /// weights of this tap row.
    struct Pixel<T> {
        row: *const T,
        x0: isize,
        width: usize,
        ch: usize,
        mask: __mmask16,
        w: *const u32,
        ahead: usize,
    }

    impl<T> Clone for Pixel<T> {
        fn clone(&self) -> Self {
            *self
        }
    }
    impl<T> Copy for Pixel<T> {}

    /// Input pixel I of a run (column x0 + I; nothing outside the row): its channels given to
    /// the lanes by `way` ([`Form::input`]) and multiplied by `w` (that way's weights of the
    /// tap row) into the sum of every output pixel q of the run whose tap I − q·S it is. The
    /// first way also asks for lines ahead.
    ///
    /// # Safety
    /// As for [`row`]; `at`'s pointers as [`row_g`] makes them.
    #[inline(always)]
    unsafe fn pixel<T: Wide, F: Form, const S: usize, const P: usize, const I: usize>(
        at: &Pixel<T>,
        (way, all, first): (__m512i, Option<usize>, bool),
        w: &[__m512i; 3],
        acc: &mut [__m512; P],
    ) {
        let ix = at.x0 + I as isize;
        if ix < 0 || ix as usize >= at.width {
            return;
        }
        // SAFETY: the caller's; ix is inside the row.
        unsafe {
            let here = at.row.add(ix as usize * at.ch);
            if first {
                // A block's pass over a row touches one line a pixel, 16 channels apart from
                // the last: the hardware did not fetch them ahead (the permutes waited on the
                // loads for a third of the kernel's time), so each pixel asks for the next
                // block's line, and on the last tap row for the line of the next output row's
                // new input.
                _mm_prefetch::<_MM_HINT_T0>(here.wrapping_add(16).cast());
                if at.ahead != 0 {
                    _mm_prefetch::<_MM_HINT_T0>(here.wrapping_add(at.ahead).cast());
                }
            }
            let xp = match all {
                Some(i) => F::broadcast(here, i, at.mask, way),
                None => F::input(here, at.mask, way),
            };
            for (q, acc) in acc.iter_mut().enumerate() {
                if I >= q * S && I - q * S < 3 {
                    *acc = F::madd(*acc, xp, w[I - q * S]);
                }
            }
        }
    }
}

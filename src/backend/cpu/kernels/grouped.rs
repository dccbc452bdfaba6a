//! Grouped 3×3 convolutions of a few channels a group (ResNeXt-50 32×4d's 4, 8, 16 and 32,
//! RegNet's 8 and 16): direct loops in zmm registers over 16 output channels — 8 groups of 2
//! to one group of 16, or half a group of 32.
//!
//! Through im2col and the GEMM, such a layer ran as one GEMM per group of N = 4 or 8 output
//! channels on 16-column panels — three quarters (or half) of every FMA wasted on padding —
//! after gathering columns of 9 · channels floats a pixel. Here each output lane needs the
//! j-th input channel of its own group: one permute of the 16 input channels a pixel holds
//! (`vpermps`, the same index for every pixel) gives it to all lanes at once, and every FMA
//! is the layer's own work.

use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::{Elem, Wide};
use crate::model::op::Conv2d;

/// A grouped layer's weights for [`conv2d_grouped`], a block of 16 output channels after
/// another: in each, (tap, j, lane), output channel lane's weight for the j-th input channel
/// of its group, so that every weight of a block sits at a fixed offset from its start (an
/// FMA's memory operand; as one (tap, j, channel) array the compiler kept a pointer per (tap,
/// j) on the stack). Rounded through the storage type, as every precision's packing is; the
/// lanes past the channels zero. `bias` likewise, 16 a block.
pub struct Grouped {
    w: Vec<f32>,
    bias: Vec<f32>,
    channels: usize,
}

impl Grouped {
    /// From PyTorch's (cout, cin/groups, 3, 3) weight, where [`takes`] the layer.
    pub fn new<T: Elem>(c: &Conv2d, weight: &[f32], bias: Option<&[f32]>) -> Self {
        let (ch, g) = (c.out_channels, group_width(c));
        let blocks = ch.div_ceil(16);
        let mut w = vec![0f32; blocks * TAPS * g * 16];
        let mut b = vec![0f32; blocks * 16];
        for co in 0..ch {
            let (block, lane) = (co / 16, co % 16);
            for j in 0..g {
                for t in 0..TAPS {
                    let v = weight[(co * g + j) * TAPS + t];
                    w[((block * TAPS + t) * g + j) * 16 + lane] = T::from_f32(v).to_f32();
                }
            }
            b[co] = bias.map_or(0.0, |bias| bias[co]);
        }
        Grouped {
            w,
            bias: b,
            channels: ch,
        }
    }

    pub fn bytes(&self) -> u64 {
        (self.w.len() + self.bias.len()) as u64 * 4
    }
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
            // SAFETY: `takes` checked that the paths in use have AVX-512 (F, BW, VL with it); the
            // rows hold xs.w pixels of xs.c channels, the weights and bias whole blocks of 16.
            unsafe {
                zmm::row(c, &input, p, out, xs.w, (residual, c.act))
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
    use crate::model::op::{Act, Conv2d};

    /// One output row into `out`: the shape's loop, the activation's copy of it.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and VL; `input` holds the 3 tap rows (`None` in the padding)
    /// of `width` pixels of the layer's channels; `out` (and `residual`) one output row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn row<T: Wide>(
        c: &Conv2d,
        input: &[Option<&[T]>; 3],
        p: &Grouped,
        out: &mut [T],
        width: usize,
        (residual, act): (Option<&[T]>, Act),
    ) {
        let at = (input, p, c.padding.1, width, residual);
        macro_rules! shapes {
            ($op:expr) => {
                match (group_width(c), c.stride.1) {
                    (2, 1) => row_g::<T, 2, 1, 8>(at, out, $op),
                    (4, 1) => row_g::<T, 4, 1, 8>(at, out, $op),
                    (8, 1) => row_g::<T, 8, 1, 8>(at, out, $op),
                    (16, 1) => row_g::<T, 16, 1, 8>(at, out, $op),
                    (32, 1) => row_g::<T, 32, 1, 8>(at, out, $op),
                    (2, _) => row_g::<T, 2, 2, 4>(at, out, $op),
                    (4, _) => row_g::<T, 4, 2, 4>(at, out, $op),
                    (8, _) => row_g::<T, 8, 2, 4>(at, out, $op),
                    _ => row_g::<T, 16, 2, 4>(at, out, $op),
                }
            };
        }
        // SAFETY: the caller's.
        unsafe { with_vec_act!(act, activate_zmm, |op| shapes!(op)) }
    }

    /// What [`row_g`] reads besides its output: the tap rows, the weights, the padding, the
    /// input's width, the residual row.
    type At<'a, T> = (
        &'a [Option<&'a [T]>; 3],
        &'a Grouped,
        usize,
        usize,
        Option<&'a [T]>,
    );

    /// [`row`] for groups of G channels at stride S, P output pixels a run: for each block of
    /// 16 channels and run of pixels, the bias, then tap row by tap row each input pixel the
    /// run reads ([`pixel`], unrolled: as a loop the compiler kept the sums on the stack); the
    /// sums finished with the residual and `op`.
    ///
    /// # Safety
    /// As for [`row`].
    #[inline(always)]
    unsafe fn row_g<T: Wide, const G: usize, const S: usize, const P: usize>(
        (input, p, pad, width, residual): At<'_, T>,
        out: &mut [T],
        op: impl Fn(__m512) -> __m512,
    ) {
        let ch = p.channels;
        let out_w = out.len() / ch;
        // SAFETY: the caller's (AVX-512; every load and store of the input and output masked
        // to the block's channels, input pixels checked against the row's width; the weights
        // and bias are whole blocks).
        unsafe {
            // Groups wider than a vector (32): every lane takes lane j % 16 of the group's
            // (j / 16)-th block, which `shift` finds.
            let ways: [__m512i; G] = std::array::from_fn(|j| {
                let lanes: [i32; 16] = std::array::from_fn(|l| match G > 16 {
                    true => (j % 16) as i32,
                    false => ((l / G) * G + j) as i32,
                });
                _mm512_loadu_si512(lanes.as_ptr().cast())
            });
            for c0 in (0..ch).step_by(16) {
                let mask = (u32::MAX >> (32 - (ch - c0).min(16))) as __mmask16;
                let block = p.w.as_ptr().add(c0 / 16 * super::TAPS * G * 16);
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
                            w: block.add(ky * 3 * G * 16),
                            // The last tap row's pixels S rows down are the next output row's
                            // new input (the other rows it reads, this one's already read).
                            ahead: if ky == 2 { S * width * ch } else { 0 },
                        };
                        for (j, &way) in ways.iter().enumerate() {
                            // Where way j's input block starts, from the output block's first
                            // channel (elsewhere only in groups wider than a vector).
                            let shift = match G > 16 {
                                true => (j / 16 * 16) as isize - (c0 % G) as isize,
                                false => 0,
                            };
                            let at = Pixel {
                                row: at.row.wrapping_offset(shift),
                                ..at
                            };
                            // This way's weights of the tap row's three taps, held in
                            // registers for every pixel (an FMA's memory operand each time,
                            // they took as many loads as FMAs).
                            let w: [__m512; 3] = std::array::from_fn(|kx| {
                                _mm512_loadu_ps(at.w.add((kx * G + j) * 16))
                            });
                            macro_rules! pixels {
                                ($($i:literal)*) => {
                                    $( if $i < (P - 1) * S + 3 {
                                        pixel::<T, S, P, $i>(&at, (way, j == 0), &w, &mut acc);
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
        w: *const f32,
        ahead: usize,
    }

    impl<T> Clone for Pixel<T> {
        fn clone(&self) -> Self {
            *self
        }
    }
    impl<T> Copy for Pixel<T> {}

    /// Input pixel I of a run (column x0 + I; nothing outside the row): its 16 channels
    /// permuted by `way` (lane l takes channel (l / G)·G + j of the block for the j-th way)
    /// and multiplied by `w` (that way's weights of the tap row) into the sum of every output
    /// pixel q of the run whose tap I − q·S it is. The first way also asks for lines ahead.
    ///
    /// # Safety
    /// As for [`row`]; `at`'s pointers as [`row_g`] makes them.
    #[inline(always)]
    unsafe fn pixel<T: Wide, const S: usize, const P: usize, const I: usize>(
        at: &Pixel<T>,
        (way, first): (__m512i, bool),
        w: &[__m512; 3],
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
            let xp = _mm512_permutexvar_ps(way, T::load(here, at.mask));
            for (q, acc) in acc.iter_mut().enumerate() {
                if I >= q * S && I - q * S < 3 {
                    *acc = _mm512_fmadd_ps(xp, w[I - q * S], *acc);
                }
            }
        }
    }
}

//! Depthwise convolutions: direct loops over rows of pixels, a block of channels at a time
//! (a GEMM with one input channel per group would waste the machine).

use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::simd::{Vectorised, with_simd};
use crate::model::op::Conv2d;

/// Depthwise convolution (one filter per channel) with its epilogue, one output row per work
/// item ([`DepthwiseRow`]), then the epilogue on the finished row. f32 activations are read
/// and written in place; half types go through widened input rows and an f32 output row.
#[allow(clippy::too_many_arguments)]
pub(super) fn depthwise<T: Elem>(
    c: &Conv2d,
    dw: &[f32],
    bias: Option<&[f32]>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    epilogue: &Epilogue<'_, T>,
) {
    let ch = ys.c;
    let (kh, kw) = c.kernel;
    let row_len = ys.w * ch;
    let zeros = vec![0f32; ch];
    let call = next_call();
    y[..ys.elems()]
        .par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, out)| {
            let (oy, n) = (row % ys.h, row / ys.h);
            let iys: Vec<isize> = (0..kh)
                .map(|ky| (oy * c.stride.0 + ky * c.dilation.0) as isize - c.padding.0 as isize)
                .collect();
            WIDE_ROWS.with_borrow_mut(|wide_in| {
                let input = input_rows(x, xs, n, &iys, wide_in, call);
                let run = |acc: &mut [f32]| {
                    with_simd(DepthwiseRow {
                        acc,
                        input: &input,
                        w: dw,
                        bias: bias.unwrap_or(&zeros),
                        kw,
                        stride: c.stride.1,
                        dilation: c.dilation.1,
                        pad: c.padding.1,
                    })
                };
                SCRATCH.with_borrow_mut(|(_, wide_out)| {
                    as_f32_row(out, wide_out, |acc| {
                        run(&mut *acc);
                        if !epilogue.is_empty() {
                            epilogue.apply(acc, row * row_len, &mut Vec::new());
                        }
                    })
                });
            })
        });
}

/// `f` on `out` as f32: in place for f32 storage, else on `wide` (resized to `out`'s length)
/// narrowed into `out` afterwards.
pub(super) fn as_f32_row<T: Elem>(out: &mut [T], wide: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
    match T::as_f32_mut(out) {
        Some(out) => f(out),
        None => {
            wide.resize(out.len(), 0.0);
            f(wide);
            T::narrow(wide, out);
        }
    }
}

/// Channels per register block of [`DepthwiseRow`]: two AVX2 vectors, one AVX-512 vector.
pub(super) const DW_BLOCK: usize = 16;

/// One output row of [`depthwise`], as vectorised work: for each output pixel and each block
/// of [`DW_BLOCK`] channels, the accumulators start from the bias and stay in registers
/// through every tap (the input pixel at row ky, column ox·stride + kx·dilation − pad, where
/// inside the image, times the tap's weights), and are stored once. Channels past the last
/// whole block take a plain loop.
pub(super) struct DepthwiseRow<'a> {
    acc: &'a mut [f32],
    /// The input row of each tap row ky (`None` above or below the image).
    input: &'a [Option<&'a [f32]>],
    /// Weights, (ky, kx, channel).
    w: &'a [f32],
    bias: &'a [f32],
    kw: usize,
    stride: usize,
    dilation: usize,
    pad: usize,
}

impl Vectorised for DepthwiseRow<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let ch = self.bias.len();
        let width = self
            .input
            .iter()
            .flatten()
            .next()
            .map_or(0, |r| r.len() / ch);
        let blocks = ch / DW_BLOCK * DW_BLOCK;
        // The taps of one output pixel: its input pixel's channels and the tap's weight offset.
        let mut taps: Vec<(&[f32], usize)> = Vec::with_capacity(self.input.len() * self.kw);
        for (ox, out) in self.acc.chunks_exact_mut(ch).enumerate() {
            taps.clear();
            for (ky, row) in self.input.iter().enumerate() {
                let Some(row) = row else { continue };
                for kx in 0..self.kw {
                    if let Some(ix) = (ox * self.stride + kx * self.dilation).checked_sub(self.pad)
                        && ix < width
                    {
                        taps.push((&row[ix * ch..][..ch], (ky * self.kw + kx) * ch));
                    }
                }
            }
            for c0 in (0..blocks).step_by(DW_BLOCK) {
                let mut acc: [f32; DW_BLOCK] = self.bias[c0..][..DW_BLOCK].try_into().unwrap();
                for &(x, w0) in &taps {
                    let (x, w) = (&x[c0..][..DW_BLOCK], &self.w[w0 + c0..][..DW_BLOCK]);
                    for i in 0..DW_BLOCK {
                        acc[i] += x[i] * w[i];
                    }
                }
                out[c0..][..DW_BLOCK].copy_from_slice(&acc);
            }
            if blocks < ch {
                let tail = &mut out[blocks..];
                tail.copy_from_slice(&self.bias[blocks..]);
                for &(x, w0) in &taps {
                    for ((a, xv), wv) in tail
                        .iter_mut()
                        .zip(&x[blocks..])
                        .zip(&self.w[w0 + blocks..])
                    {
                        *a += xv * wv;
                    }
                }
            }
        }
    }
}

//! Layout conversions between NCHW (the network's input, flattened features) and NHWC.

use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::{Elem, f32_bf16};
use crate::backend::cpu::simd::{Vectorised, with_simd};

/// (N, C, H, W) logical flatten of an NHWC tensor: reorder to NCHW, as PyTorch's flatten sees it.
pub fn nhwc_to_nchw<T: Elem>(x: &[T], xs: Nhwc, y: &mut [T]) {
    let plane = xs.h * xs.w;
    y[..xs.elems()]
        .par_chunks_mut(xs.c * plane)
        .enumerate()
        .for_each(|(n, out)| {
            for c in 0..xs.c {
                for p in 0..plane {
                    out[c * plane + p] = x[(n * plane + p) * xs.c + c];
                }
            }
        });
}

/// NCHW f32 (the seam's layout) → NHWC storage, an image row at a time (each channel's row
/// read straight, the pixels' channels interleaved; 3-channel images, every network's input,
/// with the count fixed for the compiler). Half types interleave into an f32 row first and
/// narrow it in one vectorised pass (bf16 one value at a time took 4× the f32 time).
pub fn nchw_to_nhwc<T: Elem>(x: &[f32], xs: Nhwc, y: &mut [T]) {
    let plane = xs.h * xs.w;
    if plane == 1 {
        // One pixel an image (a GEMM's rows, flattened features): both layouts are the same,
        // and a pixel's interleave, a channel at a time, cost a BF16 1024³ GEMM a quarter of
        // its time.
        let x = &x[..xs.elems()];
        (y[..xs.elems()].par_chunks_mut(NARROW_CHUNK))
            .zip(x.par_chunks(NARROW_CHUNK))
            .for_each(|(out, x)| T::narrow(x, out));
        return;
    }
    let row = (xs.w * xs.c).max(1);
    y[..xs.elems()]
        .par_chunks_mut(row)
        .enumerate()
        .for_each_init(Vec::new, |wide: &mut Vec<f32>, (r, out)| {
            let (n, iy) = (r / xs.h, r % xs.h);
            let channel = |c: usize| &x[(n * xs.c + c) * plane + iy * xs.w..][..xs.w];
            if xs.c == 3 {
                // Images in f32 or bf16: one vectorised pass, the narrowing in it.
                let planes = [channel(0), channel(1), channel(2)];
                if let Some(out) = T::as_f32_mut(out) {
                    return with_simd(Rgb {
                        planes,
                        out,
                        to: |v| v,
                    });
                }
                if let Some(out) = T::as_bf16_mut(out) {
                    return with_simd(Rgb {
                        planes,
                        out,
                        to: f32_bf16,
                    });
                }
            }
            let interleave = |out: &mut [f32]| {
                if xs.c == 3 {
                    // f16 (f32 and bf16 went above).
                    let (r, g, b) = (channel(0), channel(1), channel(2));
                    for (((px, r), g), b) in out.chunks_exact_mut(3).zip(r).zip(g).zip(b) {
                        px.copy_from_slice(&[*r, *g, *b]);
                    }
                    return;
                }
                // Blocks of 8 channels × 8 pixels through a local array (8 reads of 8 values, 8
                // writes of 8): a channel at a time, every value was a store of its own, `c`
                // values past the last (a fifth of a layer chain's step with 64 channels).
                const B: usize = 8;
                let (cw, pw) = (xs.c - xs.c % B, xs.w - xs.w % B);
                for c0 in (0..cw).step_by(B) {
                    for p0 in (0..pw).step_by(B) {
                        let mut block = [[0f32; B]; B];
                        for (i, row) in block.iter_mut().enumerate() {
                            row.copy_from_slice(&channel(c0 + i)[p0..p0 + B]);
                        }
                        for j in 0..B {
                            let px: &mut [f32; B] = (&mut out[(p0 + j) * xs.c + c0..][..B])
                                .try_into()
                                .expect("8");
                            for (i, v) in px.iter_mut().enumerate() {
                                *v = block[i][j];
                            }
                        }
                    }
                }
                // The channels and pixels past whole blocks, one value at a time.
                for c in 0..xs.c {
                    let from = if c < cw { pw } else { 0 };
                    for (p, &v) in channel(c).iter().enumerate().skip(from) {
                        out[p * xs.c + c] = v;
                    }
                }
            };
            as_f32_row(out, wide, interleave);
        });
}

/// One image row of [`nchw_to_nhwc`] for 3 channels: each pixel's values from the three
/// planes, converted by `to`, as vectorised work. As a plain loop outside a `with_simd` path
/// (then narrowed in a pass of its own), a BF16 batch of 8 224² images took 0.43 ms, as long as
/// OpenVINO's whole input reorder.
struct Rgb<'a, D, F> {
    planes: [&'a [f32]; 3],
    out: &'a mut [D],
    to: F,
}

impl<D, F: Fn(f32) -> D> Vectorised for Rgb<'_, D, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Rgb {
            planes: [r, g, b],
            out,
            to,
        } = self;
        let n = (out.len() / 3).min(r.len()).min(g.len()).min(b.len());
        let (out, r, g, b) = (&mut out[..3 * n], &r[..n], &g[..n], &b[..n]);
        for p in 0..n {
            out[3 * p] = to(r[p]);
            out[3 * p + 1] = to(g[p]);
            out[3 * p + 2] = to(b[p]);
        }
    }
}

/// Values per work item where [`nchw_to_nhwc`] only narrows.
const NARROW_CHUNK: usize = 1 << 14;

/// Pixels per work item of [`copy_channels`].
const COPY_PIXELS: usize = 256;

/// One [`ChannelCopy`](crate::model::op::ChannelCopy) on NHWC tensors: channels
/// `[from, from + count)` of every pixel of `x` into channels `to`, `to + step`, … of `y`
/// (`cy` channels).
pub fn copy_channels<T: Elem>(
    x: &[T],
    (y, cy): (&mut [T], usize),
    copy: &crate::model::op::ChannelCopy,
) {
    let (cx, cy) = (copy.channels.max(1), cy.max(1));
    let (from, to, count, step) = (copy.from, copy.to, copy.count, copy.step);
    y.par_chunks_mut(cy * COPY_PIXELS)
        .zip(x.par_chunks(cx * COPY_PIXELS))
        .for_each(|(out, input)| {
            for (o, i) in out.chunks_mut(cy).zip(input.chunks(cx)) {
                let src = &i[from..from + count];
                if step == 1 {
                    o[to..to + count].copy_from_slice(src);
                } else {
                    for (k, v) in src.iter().enumerate() {
                        o[to + k * step] = *v;
                    }
                }
            }
        });
}

/// Swin's patch merging on NHWC tensors: each output pixel the channels of its 2×2 block of
/// `x` (top-left, bottom-left, top-right, bottom-right), zeros past an odd edge.
pub fn patch_merge<T: Elem>(x: &[T], xs: Nhwc, y: &mut [T]) {
    let (oh, ow, c) = (xs.h.div_ceil(2), xs.w.div_ceil(2), xs.c);
    y.par_chunks_mut(4 * c).enumerate().for_each(|(p, out)| {
        let (img, oy, ox) = (p / (oh * ow), p / ow % oh, p % ow);
        for (q, (dy, dx)) in [(0, 0), (1, 0), (0, 1), (1, 1)].into_iter().enumerate() {
            let (yy, xx) = (2 * oy + dy, 2 * ox + dx);
            let part = &mut out[q * c..(q + 1) * c];
            if yy < xs.h && xx < xs.w {
                part.copy_from_slice(&x[((img * xs.h + yy) * xs.w + xx) * c..][..c]);
            } else {
                part.fill(T::default());
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// NCHW → NHWC against the definition, in f32 and bf16: whole 8 × 8 blocks, channels and
    /// pixels past them, three channels, and one pixel an image.
    #[test]
    fn nchw_to_nhwc_matches_the_definition() {
        for (n, c, h, w) in [
            (2, 19, 3, 21),
            (1, 16, 2, 16),
            (1, 3, 4, 9),
            (3, 7, 1, 1),
            (1, 9, 2, 7),
        ] {
            let xs = Nhwc { n, h, w, c };
            let x: Vec<f32> = (0..xs.elems()).map(|i| i as f32 * 0.5 - 3.0).collect();
            let want = |i: usize| {
                let (img, rest) = (i / (h * w * c), i % (h * w * c));
                let (iy, ix, ch) = (rest / (w * c), rest / c % w, rest % c);
                x[((img * c + ch) * h + iy) * w + ix]
            };
            let mut y = vec![0f32; xs.elems()];
            nchw_to_nhwc(&x, xs, &mut y);
            assert!(
                (0..xs.elems()).all(|i| y[i] == want(i)),
                "f32 {n}×{c}×{h}×{w}"
            );
            let mut y16 = vec![bf16::ZERO; xs.elems()];
            nchw_to_nhwc(&x, xs, &mut y16);
            assert!(
                (0..xs.elems()).all(|i| y16[i] == bf16::from_f32(want(i))),
                "bf16 {n}×{c}×{h}×{w}"
            );
        }
    }
}

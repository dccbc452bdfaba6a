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
    let avx = crate::backend::cpu::simd::simd().has_avx2();
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
                interleave_row(&channel, xs.c, xs.w, out, avx);
            };
            as_f32_row(out, wide, interleave);
        });
}

/// Pixels per block of [`interleave_row`], and channels.
const BLOCK: usize = 8;

/// One image row of [`nchw_to_nhwc`] (`w` pixels of `c` channels, `channel(i)` the row's
/// values of channel i) interleaved into `out`, by blocks of 8 channels × 8 pixels: 8 reads of
/// 8 values, 8 writes of 8, turned by AVX's shuffles where `avx` (else through a local array);
/// a row's last pixels (fewer than 8) in a narrower block of the same channels, and the
/// channels past whole blocks one value at a time. A channel at a time, every value was a
/// store of its own, `c` values past the last (a fifth of a layer chain's step with 64
/// channels). Through the local array alone (a row's last pixels one value at a time), 120
/// channels of 8 28² images took as long as the 1×1 layer they fed: 449–800 µs against
/// 180–311 now, 64 channels of 4 128² images 1372–1889 against 852–1015, 2048 of one 7²
/// image 122–146 against 67–93 (a Zen 3, 2 threads, 4 alternating runs each).
fn interleave_row<'a>(
    channel: &impl Fn(usize) -> &'a [f32],
    c: usize,
    w: usize,
    out: &mut [f32],
    avx: bool,
) {
    const B: usize = BLOCK;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx;
    let (cw, pw) = (c - c % B, w - w % B);
    assert!(out.len() >= w * c, "interleave_row: output row too short");
    for c0 in (0..cw).step_by(B) {
        let rows: [&[f32]; B] = std::array::from_fn(|i| &channel(c0 + i)[..w]);
        for p0 in (0..pw).step_by(B) {
            #[cfg(target_arch = "x86_64")]
            if avx {
                // SAFETY: AVX is there (`avx`: AVX2 implies it); each row has 8 values from p0
                // (p0 + 8 ≤ pw ≤ w), and pixel p0 + j's 8 channels from c0 end at
                // (p0 + j)·c + c0 + 8 ≤ w·c ≤ out.len().
                unsafe {
                    transpose8(
                        std::array::from_fn(|i| rows[i][p0..].as_ptr()),
                        out[p0 * c + c0..].as_mut_ptr(),
                        c,
                    )
                };
                continue;
            }
            let mut block = [[0f32; B]; B];
            for (i, row) in block.iter_mut().enumerate() {
                row.copy_from_slice(&rows[i][p0..p0 + B]);
            }
            put_block(&block, B, &mut out[p0 * c + c0..], c);
        }
        if pw < w {
            let mut block = [[0f32; B]; B];
            for (i, row) in block.iter_mut().enumerate() {
                row[..w - pw].copy_from_slice(&rows[i][pw..]);
            }
            put_block(&block, w - pw, &mut out[pw * c + c0..], c);
        }
    }
    for ch in cw..c {
        for (p, &v) in channel(ch).iter().take(w).enumerate() {
            out[p * c + ch] = v;
        }
    }
}

/// Pixels 0..pixels of `block` (8 channels × 8 pixels) into `out`, each pixel's 8 channels at
/// j·`stride`.
fn put_block(block: &[[f32; BLOCK]; BLOCK], pixels: usize, out: &mut [f32], stride: usize) {
    for j in 0..pixels {
        let px: &mut [f32; BLOCK] = (&mut out[j * stride..][..BLOCK]).try_into().expect("8");
        for (i, v) in px.iter_mut().enumerate() {
            *v = block[i][j];
        }
    }
}

/// 8 channels × 8 pixels turned around in registers: `rows[i]` points at channel i's 8
/// values, and pixel j's 8 channels are stored at `out + j·stride` (the classic 8×8
/// transpose: pairs unpacked, then quads shuffled, then the 128-bit halves exchanged).
///
/// # Safety
/// The CPU has AVX; 8 floats are readable at each of `rows` and writable at each
/// `out + j·stride`, j < 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8(rows: [*const f32; BLOCK], out: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's.
    unsafe {
        let r: [__m256; BLOCK] = std::array::from_fn(|i| _mm256_loadu_ps(rows[i]));
        // Pairs of channels, pixel by pixel: [a0 b0 a1 b1 | a4 b4 a5 b5] and the rest.
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        // Four channels of one pixel in each 128-bit half: [pixel 0 | pixel 4] and so on.
        let q = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        // Pixel j (< 4) from the low halves of channels 0–3's and 4–7's quads, j + 4 from
        // the high ones.
        for j in 0..4 {
            let (a, b) = (q[j], q[j + 4]);
            _mm256_storeu_ps(out.add(j * stride), _mm256_permute2f128_ps::<0x20>(a, b));
            _mm256_storeu_ps(
                out.add((j + 4) * stride),
                _mm256_permute2f128_ps::<0x31>(a, b),
            );
        }
    }
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
    /// pixels past them (rows narrower than a block too), three channels, and one pixel an
    /// image.
    #[test]
    fn nchw_to_nhwc_matches_the_definition() {
        for (n, c, h, w) in [
            (2, 19, 3, 21),
            (1, 16, 2, 16),
            (1, 3, 4, 9),
            (3, 7, 1, 1),
            (1, 9, 2, 7),
            (2, 16, 3, 7),
            (1, 24, 2, 17),
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
            // Both ways of turning a block, whichever the CPU takes above (AVX's where the
            // CPU has it).
            if c != 3 && h * w > 1 {
                for avx in [false, crate::backend::cpu::simd::simd().has_avx2()] {
                    let mut y = vec![0f32; xs.elems()];
                    for (r, out) in y.chunks_mut(w * c).enumerate() {
                        let (img, iy) = (r / h, r % h);
                        let channel = |ch: usize| &x[((img * c + ch) * h + iy) * w..][..w];
                        interleave_row(&channel, c, w, out, avx);
                    }
                    assert!(
                        (0..xs.elems()).all(|i| y[i] == want(i)),
                        "rows {n}×{c}×{h}×{w}, avx {avx}"
                    );
                }
            }
            let mut y16 = vec![bf16::ZERO; xs.elems()];
            nchw_to_nhwc(&x, xs, &mut y16);
            assert!(
                (0..xs.elems()).all(|i| y16[i] == bf16::from_f32(want(i))),
                "bf16 {n}×{c}×{h}×{w}"
            );
        }
    }
}

//! The ops of a vision transformer on token tensors (N, T, D), stored row-major — which is
//! what an NHWC image batch (N, H, W, C) already is as tokens (N, H·W, C), so turning a patch
//! grid into tokens moves nothing. Arithmetic in f32, storage any [`Elem`]; rows in parallel.
//!
//! Attention is fused: per (image, head) and block of queries, the scores of that block only
//! are formed (never the T × T matrix of a whole head at once), normalised with the running
//! maximum and sum as FlashAttention does, and multiplied by v.

use rayon::prelude::*;

use super::{exp_nonpositive, gelu};
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::simd::{Update, Vectorised, with_simd};
use crate::model::op::WindowGrid;
use crate::model::weights::WindowParams;

/// `nn.LayerNorm` over rows of `weight.len()` values: biased variance, in f32.
pub fn layer_norm<T: Elem>(x: &[T], weight: &[f32], bias: &[f32], eps: f32, y: &mut [T]) {
    super::map_rows(x, weight.len(), y, |v| {
        let d = v.len() as f32;
        let mean = v.iter().sum::<f32>() / d;
        let var = v.iter().map(|a| (a - mean) * (a - mean)).sum::<f32>() / d;
        let inv = 1.0 / (var + eps).sqrt();
        for (i, a) in v.iter_mut().enumerate() {
            *a = (*a - mean) * inv * weight[i] + bias[i];
        }
    });
}

/// x · Φ(x) = x · (1 + erf(x/√2)) / 2, in place (the exact form, `nn.GELU()`).
pub fn gelu_inplace<T: Elem>(buf: &mut [T]) {
    super::map_f32(buf, 1, |part| {
        with_simd(Update(part, |v: &mut f32| *v = gelu(*v)))
    });
}

/// (N, T, D) → (N, 1 + T, D) with `token` in front of each image's tokens.
pub fn class_token<T: Elem>(x: &[T], t: usize, token: &[f32], y: &mut [T]) {
    let d = token.len();
    for (out, image) in y.chunks_mut((t + 1) * d).zip(x.chunks(t * d)) {
        T::narrow(token, &mut out[..d]);
        out[d..].copy_from_slice(image);
    }
}

/// x += the position embedding, image by image.
pub fn add_positions<T: Elem>(buf: &mut [T], pos: &[f32]) {
    buf.par_chunks_mut(pos.len()).for_each(|image| {
        for (v, p) in image.iter_mut().zip(pos) {
            *v = T::from_f32(v.to_f32() + p);
        }
    });
}

/// (N, T, D) → (N, D): token `index` of each image.
pub fn select_token<T: Elem>(x: &[T], (t, d): (usize, usize), index: usize, y: &mut [T]) {
    for (out, image) in y.chunks_mut(d).zip(x.chunks(t * d)) {
        out.copy_from_slice(&image[index * d..(index + 1) * d]);
    }
}

/// Queries computed together: they share every load of the keys and values.
const QUERIES: usize = 4;
/// Keys scored, or value columns accumulated, together: 4 queries × 64 accumulators are 16
/// AVX-512 registers (the rest of the 32 hold the loads). Keys and values are zero-padded to
/// a multiple of it. Against one query and 16 lanes at a time, ViT-B/16's attention (197
/// tokens, 12 heads of 64) went from 6.3 to 2.1 ms a layer on 2 Sapphire Rapids cores.
const BLOCK: usize = 64;

/// softmax(q·kᵀ/√dh)·v for every image and head: `qkv` is (N, T, 3·D) as the input projection
/// leaves it (q, k, v side by side, heads side by side within each), `y` is (N, T, D).
pub fn attention<T: Elem>(
    qkv: &[T],
    (n, t, dim, heads): (usize, usize, usize, usize),
    y: &mut [T],
) {
    let out = SyncSlice(y.as_mut_ptr(), y.len());
    // Work items: (image, head); each writes its head's columns of its image's rows.
    (0..n * heads).into_par_iter().for_each(|item| {
        with_simd(Head {
            qkv,
            dims: (t, dim, heads),
            item,
            out: &out,
        })
    });
}

/// One work item of [`attention`], compiled for the machine's widest vectors.
struct Head<'a, T> {
    qkv: &'a [T],
    /// (tokens, model dimension, heads).
    dims: (usize, usize, usize),
    item: usize,
    out: &'a SyncSlice<T>,
}

impl<T: Elem> Vectorised for Head<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (t, dim, heads) = self.dims;
        let dh = dim / heads;
        let scale = 1.0 / (dh as f32).sqrt();
        let (image, head) = (self.item / heads, self.item % heads);
        let first = image * t;
        // Keys transposed (dh × tp) and values (t × dp), zero-padded to whole vectors.
        let (tp, dp) = (t.next_multiple_of(BLOCK), dh.next_multiple_of(BLOCK));
        let mut row = vec![0f32; dh];
        let widen = |part: usize, tok: usize, row: &mut [f32]| {
            let at = (first + tok) * 3 * dim + part * dim + head * dh;
            T::widen(&self.qkv[at..at + dh], row);
        };
        let mut kt = vec![0f32; dh * tp];
        let mut v = vec![0f32; t * dp];
        for tok in 0..t {
            widen(1, tok, &mut row);
            for (j, r) in row.iter().enumerate() {
                kt[j * tp + tok] = *r;
            }
            widen(2, tok, &mut v[tok * dp..tok * dp + dh]);
        }
        let mut q = vec![[0f32; QUERIES]; dh];
        // Each query's scores contiguous, so its softmax runs over whole vectors.
        let mut scores = vec![vec![0f32; tp]; QUERIES];
        let mut sums = [0f32; QUERIES];
        for q0 in (0..t).step_by(QUERIES) {
            let group = QUERIES.min(t - q0);
            for g in 0..group {
                widen(0, q0 + g, &mut row);
                for (qj, r) in q.iter_mut().zip(&row) {
                    qj[g] = r * scale;
                }
            }
            // Scores of the group against 64 keys at a time: 4 × 64 accumulators (16 vectors)
            // over dh.
            for kb in (0..tp).step_by(BLOCK) {
                let mut acc = [[0f32; BLOCK]; QUERIES];
                for (j, qj) in q.iter().enumerate() {
                    // A fixed-size view: the loops below then need no bounds checks.
                    let keys: &[f32; BLOCK] = kt[j * tp + kb..][..BLOCK].try_into().unwrap();
                    for g in 0..QUERIES {
                        for i in 0..BLOCK {
                            acc[g][i] += qj[g] * keys[i];
                        }
                    }
                }
                for (s, acc) in scores.iter_mut().zip(&acc) {
                    s[kb..kb + BLOCK].copy_from_slice(acc);
                }
            }
            // Softmax numerators; the maximum keeps a NaN (issue 27), so it spreads as in PyTorch.
            for (s, sum) in scores.iter_mut().zip(sums.iter_mut()) {
                let s = &mut s[..t];
                let max =
                    (s.iter()).fold(
                        f32::NEG_INFINITY,
                        |m, &v| if v > m || v.is_nan() { v } else { m },
                    );
                s.iter_mut().for_each(|v| *v = exp_nonpositive(*v - max));
                *sum = s.iter().sum();
            }
            // Weighted values, 64 columns at a time: 4 queries × 64 accumulators (16 vectors)
            // over the keys, each value row read once, in order.
            for c in (0..dp).step_by(BLOCK) {
                let mut acc = [[0f32; BLOCK]; QUERIES];
                for k in 0..t {
                    let values: &[f32; BLOCK] = v[k * dp + c..][..BLOCK].try_into().unwrap();
                    for g in 0..QUERIES {
                        let e = scores[g][k];
                        for i in 0..BLOCK {
                            acc[g][i] += e * values[i];
                        }
                    }
                }
                let width = BLOCK.min(dh - c);
                for (g, acc) in acc.iter().enumerate().take(group) {
                    let at = (first + q0 + g) * dim + head * dh + c;
                    // SAFETY: each (image, head) work item owns its head's dh columns of its
                    // image's rows; `at + width` stays within this row's head.
                    let dst = unsafe { self.out.slice(at, width) };
                    let inv = 1.0 / sums[g];
                    for (o, a) in dst.iter_mut().zip(acc) {
                        *o = T::from_f32(a * inv);
                    }
                }
            }
        }
    }
}

/// A slice whose disjoint parts threads write (the attention's heads interleave in each row).
/// Swin's shifted window attention core: `qkv` is (N, H, W, 3·C) as the q/k/v projection
/// leaves it, `y` (N, H, W, C). One work item per (image, window): it gathers the window's
/// tokens (a padded one holds the projection's bias), and for each real query and head adds
/// the relative position bias and the shift mask to the scaled scores before the softmax.
pub fn window_attention<T: Elem>(
    qkv: &[T],
    params: &WindowParams,
    grid: WindowGrid,
    (n, dim, heads): (usize, usize, usize),
    y: &mut [T],
) {
    let out = SyncSlice(y.as_mut_ptr(), y.len());
    let ws = grid.window;
    let windows = (grid.hp / ws) * (grid.wp / ws);
    (0..n * windows).into_par_iter().for_each(|item| {
        with_simd(Window {
            qkv,
            params,
            grid,
            dims: (dim, heads),
            item,
            out: &out,
        })
    });
}

/// One (image, window) of [`window_attention`], compiled for the widest vectors: per head the
/// keys transposed (dh × keys, zero-padded to whole blocks) so each query's scores are 64-lane
/// products, then the softmax and the weighted values row by row.
struct Window<'a, T> {
    qkv: &'a [T],
    params: &'a WindowParams,
    grid: WindowGrid,
    /// (channels, heads).
    dims: (usize, usize),
    item: usize,
    out: &'a SyncSlice<T>,
}

impl<T: Elem> Vectorised for Window<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (grid, params) = (self.grid, self.params);
        let (dim, heads) = self.dims;
        let ws = grid.window;
        let (across, down, keys) = (grid.wp / ws, grid.hp / ws, ws * ws);
        let img = self.item / (down * across);
        let (wy, wx) = ((self.item / across) % down * ws, self.item % across * ws);
        let dh = dim / heads.max(1);
        let kp = keys.next_multiple_of(BLOCK);
        // The window's tokens: q, k, v rows (V2: q and k of each head normalised).
        let mut t = vec![0f32; keys * 3 * dim];
        let mut pixel = vec![None; keys];
        let mut region = vec![0; keys];
        for (i, row) in t.chunks_mut(3 * dim).enumerate() {
            let (yy, xx) = (wy + i / ws, wx + i % ws);
            region[i] = grid.region(yy, xx);
            let (y, x) = grid.source(yy, xx);
            if y < grid.h && x < grid.w {
                let p = (img * grid.h + y) * grid.w + x;
                T::widen(&self.qkv[p * 3 * dim..(p + 1) * 3 * dim], row);
                pixel[i] = Some(p);
            } else {
                row.copy_from_slice(&params.qkv_bias);
            }
            if params.cosine {
                // F.normalize, ε = 1e-12.
                for head in row[..2 * dim].chunks_mut(dh) {
                    let norm = head.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                    head.iter_mut().for_each(|v| *v /= norm);
                }
            }
        }
        let mut kt = vec![0f32; dh * kp];
        let mut scores = vec![0f32; kp];
        let mut outs = vec![0f32; keys * dim];
        for h in 0..heads {
            for (j, row) in t.chunks(3 * dim).enumerate() {
                for (d, k) in row[dim + h * dh..][..dh].iter().enumerate() {
                    kt[d * kp + j] = *k;
                }
            }
            for i in (0..keys).filter(|&i| pixel[i].is_some()) {
                let q = &t[i * 3 * dim + h * dh..][..dh];
                let scale = params.scales[h];
                for kb in (0..kp).step_by(BLOCK) {
                    let mut acc = [0f32; BLOCK];
                    for (d, qd) in q.iter().enumerate() {
                        let qd = qd * scale;
                        let k: &[f32; BLOCK] = kt[d * kp + kb..][..BLOCK].try_into().unwrap();
                        for l in 0..BLOCK {
                            acc[l] += qd * k[l];
                        }
                    }
                    scores[kb..kb + BLOCK].copy_from_slice(&acc);
                }
                let s = &mut scores[..keys];
                for (j, v) in s.iter_mut().enumerate() {
                    let mask = if region[i] == region[j] { 0.0 } else { -100.0 };
                    *v += params.table[grid.bias_row(i, j) * heads + h] + mask;
                }
                // The maximum keeps a NaN, so it spreads as in PyTorch.
                let max =
                    (s.iter()).fold(
                        f32::NEG_INFINITY,
                        |m, &v| {
                            if v > m || v.is_nan() { v } else { m }
                        },
                    );
                s.iter_mut().for_each(|v| *v = exp_nonpositive(*v - max));
                let sum: f32 = s.iter().sum();
                let o = &mut outs[i * dim + h * dh..][..dh];
                for (j, e) in s.iter().enumerate() {
                    let w = e / sum;
                    let v = &t[j * 3 * dim + 2 * dim + h * dh..][..dh];
                    o.iter_mut().zip(v).for_each(|(o, v)| *o += w * v);
                }
            }
        }
        for (i, p) in pixel.iter().enumerate() {
            if let Some(p) = *p {
                // SAFETY: token p belongs to this window alone, so its row is written once.
                T::narrow(&outs[i * dim..(i + 1) * dim], unsafe {
                    self.out.slice(p * dim, dim)
                });
            }
        }
    }
}

struct SyncSlice<T>(*mut T, usize);
// SAFETY: only used for disjoint writes (see `attention`).
unsafe impl<T: Send> Sync for SyncSlice<T> {}
// SAFETY: as above: the pointer is only written through in disjoint ranges.
unsafe impl<T: Send> Send for SyncSlice<T> {}

impl<T> SyncSlice<T> {
    /// # Safety
    /// `at..at + len` is within the slice and no other thread touches it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [T] {
        assert!(at + len <= self.1);
        // SAFETY: in bounds (checked above); exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

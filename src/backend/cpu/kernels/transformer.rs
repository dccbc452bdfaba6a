//! The ops of a vision transformer on token tensors (N, T, D), stored row-major — which is
//! what an NHWC image batch (N, H, W, C) already is as tokens (N, H·W, C), so turning a patch
//! grid into tokens moves nothing. Arithmetic in f32, storage any [`Elem`]; rows in parallel.
//!
//! Attention is fused: per (image, head) and block of queries, the scores of that block only
//! are formed (never the T × T matrix of a whole head at once), normalised with the running
//! maximum and sum as FlashAttention does, and multiplied by v.

use rayon::prelude::*;

use crate::backend::cpu::elem::Elem;

/// `nn.LayerNorm` over rows of `weight.len()` values: biased variance, in f32.
pub fn layer_norm<T: Elem>(x: &[T], weight: &[f32], bias: &[f32], eps: f32, y: &mut [T]) {
    let d = weight.len();
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(out, row)| {
            let mut v = vec![0f32; d];
            T::widen(row, &mut v);
            let mean = v.iter().sum::<f32>() / d as f32;
            let var = v.iter().map(|a| (a - mean) * (a - mean)).sum::<f32>() / d as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for (i, a) in v.iter_mut().enumerate() {
                *a = (*a - mean) * inv * weight[i] + bias[i];
            }
            T::narrow(&v, out);
        });
}

/// x · Φ(x) with the exact error function, in place.
pub fn gelu_inplace<T: Elem>(buf: &mut [T]) {
    buf.par_chunks_mut(4096).for_each(|part| {
        for v in part {
            let x = v.to_f32();
            *v = T::from_f32(0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)));
        }
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

/// Queries per block: the scores formed at once are this many rows of T.
const QUERY_BLOCK: usize = 32;

/// softmax(q·kᵀ/√dh)·v for every image and head: `qkv` is (N, T, 3·D) as the input projection
/// leaves it (q, k, v side by side, heads side by side within each), `y` is (N, T, D).
pub fn attention<T: Elem>(
    qkv: &[T],
    (n, t, dim, heads): (usize, usize, usize, usize),
    y: &mut [T],
) {
    let dh = dim / heads;
    let scale = 1.0 / (dh as f32).sqrt();
    // Work items: (image, head, query block); each writes its own rows of its head's columns.
    let blocks = t.div_ceil(QUERY_BLOCK);
    let out = SyncSlice(y.as_mut_ptr(), y.len());
    (0..n * heads * blocks).into_par_iter().for_each(|item| {
        let (image, head, block) = (
            item / (heads * blocks),
            item / blocks % heads,
            item % blocks,
        );
        let rows = image * t..(image + 1) * t;
        let column = |part: usize, tok: usize, buf: &mut [f32]| {
            let at = (rows.start + tok) * 3 * dim + part * dim + head * dh;
            T::widen(&qkv[at..at + dh], buf);
        };
        // This head's keys and values, in f32, token-major.
        let mut k = vec![0f32; t * dh];
        let mut v = vec![0f32; t * dh];
        for tok in 0..t {
            column(1, tok, &mut k[tok * dh..(tok + 1) * dh]);
            column(2, tok, &mut v[tok * dh..(tok + 1) * dh]);
        }
        let (q0, q1) = (block * QUERY_BLOCK, ((block + 1) * QUERY_BLOCK).min(t));
        let mut q = vec![0f32; dh];
        let mut scores = vec![0f32; t];
        let mut acc = vec![0f32; dh];
        for query in q0..q1 {
            column(0, query, &mut q);
            let mut max = f32::NEG_INFINITY;
            for (s, key) in scores.iter_mut().zip(k.chunks_exact(dh)) {
                *s = q.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = if *s > max || s.is_nan() { *s } else { max };
            }
            acc.fill(0.0);
            let mut sum = 0f32;
            for (s, value) in scores.iter().zip(v.chunks_exact(dh)) {
                let e = (s - max).exp();
                sum += e;
                acc.iter_mut().zip(value).for_each(|(a, b)| *a += e * b);
            }
            let at = (rows.start + query) * dim + head * dh;
            // SAFETY: each (image, query, head) owns the dh outputs at `at`; no two work items
            // share a query row and head, and `at + dh <= y.len()`.
            let dst = unsafe { out.slice(at, dh) };
            for (o, a) in dst.iter_mut().zip(&acc) {
                *o = T::from_f32(a / sum);
            }
        }
    });
}

/// A slice whose disjoint parts threads write (the attention's heads interleave in each row).
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

//! A decoder's own ops on rows of tokens (one row per token of every sequence, row-major):
//! RMSNorm, rotary positions, the SwiGLU and GELU (tanh) activations, and attention of new
//! queries over a sequence's KV cache. Arithmetic in f32, storage any [`Elem`].

use rayon::prelude::*;

use super::transformer::Normalise;
use super::{activate, map_rows, sigmoid, softmax_numerators};
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::simd::{Vectorised, with_simd};
use crate::model::op::Act;

/// `x / rms(x) · weight` over rows of `weight.len()` values (Llama's RMSNorm, in f32; the
/// sum of squares in lanes, as the layer norm's).
pub fn rms_norm<T: Elem>(x: &[T], weight: &[f32], eps: f32, y: &mut [T]) {
    map_rows(x, weight.len(), y, |v| {
        with_simd(Normalise {
            v,
            weight,
            bias: None,
            eps,
            centre: false,
        })
    });
}

/// Rotates each head of the rows' first `heads` head-sized runs in place, as Hugging Face's
/// `rotate_half` does (value i paired with i + head/2): row r is at position `positions(r)`,
/// whose cosines and sines are row `position` of `cos` and `sin` (head/2 values each).
pub fn rope<T: Elem>(
    x: &mut [T],
    (width, heads, head): (usize, usize, usize),
    position: impl Fn(usize) -> usize + Sync,
    (cos, sin): (&[f32], &[f32]),
) {
    let half = head / 2;
    x.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
        let p = position(r);
        let (c, s) = (
            &cos[p * half..(p + 1) * half],
            &sin[p * half..(p + 1) * half],
        );
        let mut v = vec![0f32; head];
        for h in row[..heads * head].chunks_mut(head) {
            T::widen(h, &mut v);
            let (a, b) = v.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
            T::narrow(&v, h);
        }
    });
}

/// SwiGLU over rows of 2·`inner` values (gate, then up) into rows of `inner`:
/// silu(gate) · up.
pub fn swiglu<T: Elem>(x: &[T], inner: usize, y: &mut [T]) {
    y.par_chunks_mut(inner)
        .zip(x.par_chunks(2 * inner))
        .for_each(|(out, row)| {
            let mut v = vec![0f32; 2 * inner];
            T::widen(row, &mut v);
            let (g, u) = v.split_at_mut(inner);
            with_simd(Glu(g, u, false));
            T::narrow(g, out);
        });
}

/// GPT-2's GELU, tanh form ("gelu_new"), in place: 0.5·x·(1 + tanh(a)) = x·sigmoid(2a) with
/// a = √(2/π)·(x + 0.044715·x³).
pub fn gelu_tanh<T: Elem>(x: &mut [T], width: usize) {
    x.par_chunks_mut(width).for_each(|row| {
        let mut v = vec![0f32; row.len()];
        T::widen(row, &mut v);
        with_simd(Glu(&mut v, &[], true));
        T::narrow(&v, row);
    });
}

/// silu(g)·u into `g` (or GPT-2's tanh GELU of `g` alone), compiled for the widest vectors.
struct Glu<'a>(&'a mut [f32], &'a [f32], bool);

impl Vectorised for Glu<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Glu(g, u, tanh) = self;
        if tanh {
            const K: f32 = 0.797_884_6; // √(2/π)
            for x in g.iter_mut() {
                let a = K * (*x + 0.044_715 * *x * *x * *x);
                *x *= sigmoid(2.0 * a);
            }
        } else {
            activate(Act::Silu, g);
            g.iter_mut().zip(u).for_each(|(x, u)| *x *= u);
        }
    }
}

/// Where a sequence's cached keys and values are and which of them a query sees.
#[derive(Debug, Clone, Copy)]
pub struct CacheView {
    /// Sequences in the batch, and new tokens of each (queries) this call.
    pub batch: usize,
    pub tokens: usize,
    /// Position of each sequence's first new token.
    pub start: usize,
    /// Positions the cache holds per sequence and KV head.
    pub context: usize,
    /// Query heads, KV heads, values per head.
    pub heads: usize,
    pub kv_heads: usize,
    pub head: usize,
    /// A query sees at most this many keys (itself included).
    pub window: Option<usize>,
}

impl CacheView {
    /// The first key a query at `pos` sees.
    pub fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Queries handled by one work item.
const QUERY_BLOCK: usize = 32;

/// Causal attention of the new queries over the cache (which already holds the new keys and
/// values): `q` has rows of `q_stride` values whose first heads·head are the queries, `k` and
/// `v` are (batch, KV heads, context, head), `y` rows of heads·head. Per (sequence, KV head,
/// block of queries) the keys that block sees are widened once and serve every query head of
/// the group; the scores of one query at a time are kept (never the block's whole matrix).
pub fn cached_attention<T: Elem>(
    q: &[T],
    q_stride: usize,
    (k, v): (&[T], &[T]),
    c: CacheView,
    y: &mut [T],
) {
    let blocks = c.tokens.div_ceil(QUERY_BLOCK);
    let group = c.heads / c.kv_heads;
    let items = c.batch * c.kv_heads * blocks;
    let parts: Vec<(usize, Vec<f32>)> = (0..items)
        .into_par_iter()
        .map(|item| {
            let (b, g, blk) = (
                item / (c.kv_heads * blocks),
                item / blocks % c.kv_heads,
                item % blocks,
            );
            let (q0, q1) = (blk * QUERY_BLOCK, ((blk + 1) * QUERY_BLOCK).min(c.tokens));
            let (first, last) = (c.first_key(c.start + q0), c.start + q1 - 1);
            let n = last + 1 - first;
            let base = ((b * c.kv_heads + g) * c.context + first) * c.head;
            let mut keys = vec![0f32; n * c.head];
            let mut values = vec![0f32; n * c.head];
            T::widen(&k[base..base + n * c.head], &mut keys);
            T::widen(&v[base..base + n * c.head], &mut values);
            let mut out = vec![0f32; (q1 - q0) * group * c.head];
            let mut query = vec![0f32; c.head];
            let mut scores = vec![0f32; n];
            for i in q0..q1 {
                let pos = c.start + i;
                let (lo, hi) = (c.first_key(pos) - first, pos + 1 - first);
                for j in 0..group {
                    let h = g * group + j;
                    let at = (b * c.tokens + i) * q_stride + h * c.head;
                    T::widen(&q[at..at + c.head], &mut query);
                    let o = ((i - q0) * group + j) * c.head;
                    with_simd(Query {
                        q: &query,
                        keys: &keys[lo * c.head..hi * c.head],
                        values: &values[lo * c.head..hi * c.head],
                        scores: &mut scores[..hi - lo],
                        out: &mut out[o..o + c.head],
                    });
                }
            }
            (item, out)
        })
        .collect();
    let width = c.heads * c.head;
    for (item, out) in parts {
        let (b, g, blk) = (
            item / (c.kv_heads * blocks),
            item / blocks % c.kv_heads,
            item % blocks,
        );
        let q0 = blk * QUERY_BLOCK;
        for (r, rows) in out.chunks(group * c.head).enumerate() {
            let at = (b * c.tokens + q0 + r) * width + g * group * c.head;
            T::narrow(rows, &mut y[at..at + group * c.head]);
        }
    }
}

/// One query against its keys: softmax(q·kᵀ/√head)·v into `out`.
struct Query<'a> {
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    scores: &'a mut [f32],
    out: &'a mut [f32],
}

impl Vectorised for Query<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let d = self.q.len();
        let scale = 1.0 / (d as f32).sqrt();
        for (s, key) in self.scores.iter_mut().zip(self.keys.chunks_exact(d)) {
            *s = dot(self.q, key) * scale;
        }
        let sum = softmax_numerators(self.scores, 1.0);
        self.out.fill(0.0);
        for (s, value) in self.scores.iter().zip(self.values.chunks_exact(d)) {
            let p = s / sum;
            for (o, v) in self.out.iter_mut().zip(value) {
                *o += p * v;
            }
        }
    }
}

/// a·b over 16 independent partial sums, which the compiler keeps in one vector register (a
/// single running sum is a chain it may not reorder).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

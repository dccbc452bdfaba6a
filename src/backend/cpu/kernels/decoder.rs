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
/// block of queries) the keys that block sees are widened once, transposed (a row per
/// dimension, so that a query's scores come out a vector of keys at a time, with no sum
/// across a vector's lanes for each key), and serve every query head of the group; the scores
/// of one query at a time are kept (never the block's whole matrix).
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
            let (keys_t, stride) = transposed(&keys, c.head);
            let mut out = vec![0f32; (q1 - q0) * group * c.head];
            let mut query = vec![0f32; c.head];
            let mut scores = vec![0f32; stride];
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
                        keys_t: (&keys_t, stride),
                        keys: lo..hi,
                        values: &values[lo * c.head..hi * c.head],
                        scores: &mut scores,
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

/// Key rows of `head` values transposed: a row per dimension, padded with zeros to a whole
/// vector past the last key (so a query's last scores are a whole vector's too, those past its
/// keys dropped, not key by key), and the rows' stride.
fn transposed(keys: &[f32], head: usize) -> (Vec<f32>, usize) {
    let n = keys.len() / head;
    let stride = n + LANES - 1;
    let mut keys_t = vec![0f32; stride * head];
    for (j, key) in keys.chunks_exact(head).enumerate() {
        for (t, &x) in key.iter().enumerate() {
            keys_t[t * stride + j] = x;
        }
    }
    (keys_t, stride)
}

/// One query against its keys: softmax(q·kᵀ/√head)·v into `out`.
struct Query<'a> {
    q: &'a [f32],
    /// The block's keys transposed (head rows of its keys, zeros after them to a whole vector
    /// past the last of `keys`), and the rows' stride.
    keys_t: (&'a [f32], usize),
    /// The keys this query sees, of the block's.
    keys: std::ops::Range<usize>,
    /// Their values, a row of head values per key.
    values: &'a [f32],
    /// Room for the keys' scores rounded up to whole vectors of [`LANES`].
    scores: &'a mut [f32],
    out: &'a mut [f32],
}

impl Vectorised for Query<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let d = self.q.len();
        let scale = 1.0 / (d as f32).sqrt();
        let (kt, stride) = self.keys_t;
        // Scores 64 keys at a time (four AVX-512 vectors, eight AVX2 ones), then 16 (the last
        // run reads into the padding).
        let (lo, len) = (self.keys.start, self.keys.len());
        let mut j = 0;
        while j + 64 <= len {
            scores_of::<64>(self.q, kt, stride, lo + j, &mut self.scores[j..j + 64]);
            j += 64;
        }
        while j < len {
            scores_of::<LANES>(self.q, kt, stride, lo + j, &mut self.scores[j..j + LANES]);
            j += LANES;
        }
        let scores = &mut self.scores[..len];
        let sum = softmax_numerators(scores, scale);
        // The weighted values 64 dimensions at a time in registers, then 16, then one; the
        // numerators' sum divides them once they are summed.
        let mut t = 0;
        while t + 64 <= d {
            weighted::<64>(scores, self.values, d, t, &mut self.out[t..t + 64]);
            t += 64;
        }
        while t + 16 <= d {
            weighted::<16>(scores, self.values, d, t, &mut self.out[t..t + 16]);
            t += 16;
        }
        for (tt, o) in self.out.iter_mut().enumerate().skip(t) {
            *o = (scores.iter().zip(self.values.chunks_exact(d)))
                .fold(0.0, |a, (p, v)| a + p * v[tt]);
        }
        let inv = 1.0 / sum;
        for o in self.out.iter_mut() {
            *o *= inv;
        }
    }
}

/// Keys whose scores one run takes at least: an AVX-512 vector.
const LANES: usize = 16;

/// The scores of keys `key0..key0 + W` (in rows `stride` apart of the transposed `kt`) for
/// query `q`, unscaled, summed in `W` lanes kept in registers over the dimensions.
#[inline(always)]
fn scores_of<const W: usize>(q: &[f32], kt: &[f32], stride: usize, key0: usize, out: &mut [f32]) {
    let mut acc = [0f32; W];
    for (t, &qt) in q.iter().enumerate() {
        let row = &kt[t * stride + key0..][..W];
        for l in 0..W {
            acc[l] += qt * row[l];
        }
    }
    out.copy_from_slice(&acc);
}

/// Dimensions `t0..t0 + W` of Σ_j p_j·v_j over the value rows (of `d`) in `values`.
#[inline(always)]
fn weighted<const W: usize>(p: &[f32], values: &[f32], d: usize, t0: usize, out: &mut [f32]) {
    let mut acc = [0f32; W];
    for (&pj, value) in p.iter().zip(values.chunks_exact(d)) {
        let v = &value[t0..][..W];
        for l in 0..W {
            acc[l] += pj * v[l];
        }
    }
    out.copy_from_slice(&acc);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// softmax(q·kᵀ/√head)·v in f64, query by query, over the keys each one sees.
    fn reference(q: &[f32], qs: usize, (k, v): (&[f32], &[f32]), c: CacheView) -> Vec<f32> {
        let group = c.heads / c.kv_heads;
        let mut y = vec![0f32; c.batch * c.tokens * c.heads * c.head];
        for b in 0..c.batch {
            for i in 0..c.tokens {
                let pos = c.start + i;
                for h in 0..c.heads {
                    let qh = &q[(b * c.tokens + i) * qs + h * c.head..][..c.head];
                    let kv = (b * c.kv_heads + h / group) * c.context;
                    let keys = c.first_key(pos)..pos + 1;
                    let row = |m: &[f32], j: usize| m[(kv + j) * c.head..][..c.head].to_vec();
                    let scores: Vec<f64> = (keys.clone())
                        .map(|j| {
                            let dot: f64 = (qh.iter().zip(row(k, j)))
                                .map(|(&a, b)| a as f64 * b as f64)
                                .sum();
                            dot / (c.head as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    let out = &mut y[(b * c.tokens + i) * c.heads * c.head + h * c.head..];
                    for t in 0..c.head {
                        let dot: f64 = (keys.clone().zip(&e))
                            .map(|(j, p)| p * v[(kv + j) * c.head + t] as f64)
                            .sum();
                        out[t] = (dot / sum) as f32;
                    }
                }
            }
        }
        y
    }

    /// The transposed keys' scores and the weighted values in registers match the f64 softmax
    /// over the keys each query sees: heads of 8 (no whole vector), 80 (64 + 16) and 128,
    /// prompts crossing query blocks and 64-key runs, a decode step deep into the cache, a
    /// sliding window and grouped KV heads; on this process's vector path, and one query's
    /// work compiled for AVX2 + FMA (where the CPU has them) and for the baseline (portable).
    #[test]
    fn cached_attention_matches_f64() {
        let shapes = [
            // batch, tokens, start, context, heads, KV heads, head, window
            (1, 100, 0, 100, 4, 2, 64, None),
            (2, 37, 5, 50, 2, 1, 8, None),
            (1, 1, 150, 151, 6, 2, 80, None),
            (1, 70, 10, 90, 2, 2, 128, Some(33)),
        ];
        let wave =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin() * 2.0).collect() };
        let close = |a: f32, b: f32| (a - b).abs() <= 2e-5 * (1.0 + b.abs());
        for (batch, tokens, start, context, heads, kv_heads, head, window) in shapes {
            let c = CacheView {
                batch,
                tokens,
                start,
                context,
                heads,
                kv_heads,
                head,
                window,
            };
            let qs = heads * head + 3;
            let q = wave(batch * tokens * qs, 0.37);
            let k = wave(batch * kv_heads * context * head, 0.11);
            let v = wave(batch * kv_heads * context * head, 0.23);
            let mut y = vec![0f32; batch * tokens * heads * head];
            cached_attention(&q, qs, (&k, &v), c, &mut y);
            let want = reference(&q, qs, (&k, &v), c);
            for (i, (&a, &b)) in y.iter().zip(&want).enumerate() {
                assert!(close(a, b), "{c:?} [{i}]: {a} against {b}");
            }
            // The last query of the first sequence, head 0, on the other paths.
            let (pos, n) = (start + tokens - 1, start + tokens);
            let (keys_t, stride) = transposed(&k[..n * head], head);
            let first = c.first_key(pos);
            let at = (tokens - 1) * qs;
            let one = |run: &dyn Fn(Query)| {
                let (mut scores, mut out) = (vec![0f32; stride], vec![0f32; head]);
                run(Query {
                    q: &q[at..at + head],
                    keys_t: (&keys_t, stride),
                    keys: first..n,
                    values: &v[first * head..n * head],
                    scores: &mut scores,
                    out: &mut out,
                });
                out
            };
            let mut paths = vec![("portable", one(&|w| w.run()))];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                #[target_feature(enable = "avx2,fma")]
                fn avx2(w: Query) {
                    w.run()
                }
                // SAFETY: the CPU has AVX2 and FMA (detected above).
                paths.push(("avx2", one(&|w| unsafe { avx2(w) })));
            }
            let row = &want[(tokens - 1) * heads * head..][..head];
            for (path, out) in paths {
                for (t, (&a, &b)) in out.iter().zip(row).enumerate() {
                    assert!(close(a, b), "{path} {c:?} [{t}]: {a} against {b}");
                }
            }
        }
    }
}

//! A decoder's own ops on rows of tokens (one row per token of every sequence, row-major):
//! RMSNorm, rotary positions, the SwiGLU and GELU (tanh) activations, and attention of new
//! queries over a sequence's KV cache. Arithmetic in f32, storage any [`Elem`].

use rayon::prelude::*;

use std::cell::RefCell;

use half::bf16;

use super::conv::TilePtr;
use super::transformer::{Norm, normalise_rows};
use super::{activate, sigmoid, softmax_numerators_above, softmax_numerators_bf16};
use crate::backend::cpu::bf16_gemm::{self, PackedPairs};
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::sgemm::{self, NR, PackedB};
use crate::backend::cpu::simd::{Vectorised, with_simd};
use crate::model::op::Act;

/// `x / rms(x) · weight` over rows of `weight.len()` values (Llama's RMSNorm, in f32; the
/// sum of squares in lanes, as the layer norm's).
pub fn rms_norm<T: Elem>(x: &[T], weight: &[f32], eps: f32, y: &mut [T]) {
    let norm = Norm {
        weight,
        bias: None,
        eps,
        centre: false,
    };
    normalise_rows(x, y, norm);
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

/// Values of a half-precision row [`swiglu`] and [`gelu_tanh`] widen at a time: three such
/// runs of f32 stay in L1, where a row-sized copy (Qwen2.5-0.5B's 2 × 4864 values) went
/// through L2 and a heap allocation per row. f32 rows are not copied but once (SwiGLU's gate
/// into its output).
const ACT_CHUNK: usize = 512;

/// SwiGLU over rows of 2·`inner` values (gate, then up) into rows of `inner`:
/// silu(gate) · up.
pub fn swiglu<T: Elem>(x: &[T], inner: usize, y: &mut [T]) {
    y.par_chunks_mut(inner)
        .zip(x.par_chunks(2 * inner))
        .for_each(|(out, row)| {
            if let (Some(row), Some(out)) = (T::as_f32(row), T::as_f32_mut(out)) {
                // f32: the gate copied once into the output, the up read where it is.
                out.copy_from_slice(&row[..inner]);
                return with_simd(Glu(out, &row[inner..], false));
            }
            let (gate, up) = row.split_at(inner);
            let (mut g, mut u) = ([0f32; ACT_CHUNK], [0f32; ACT_CHUNK]);
            let runs = out.chunks_mut(ACT_CHUNK).zip(gate.chunks(ACT_CHUNK));
            for ((out, gate), up) in runs.zip(up.chunks(ACT_CHUNK)) {
                let (g, u) = (&mut g[..out.len()], &mut u[..out.len()]);
                T::widen(gate, g);
                T::widen(up, u);
                with_simd(Glu(g, u, false));
                T::narrow(g, out);
            }
        });
}

/// GPT-2's GELU, tanh form ("gelu_new"), in place: 0.5·x·(1 + tanh(a)) = x·sigmoid(2a) with
/// a = √(2/π)·(x + 0.044715·x³).
pub fn gelu_tanh<T: Elem>(x: &mut [T], width: usize) {
    x.par_chunks_mut(width).for_each(|row| {
        if let Some(row) = T::as_f32_mut(row) {
            return with_simd(Glu(row, &[], true));
        }
        let mut v = [0f32; ACT_CHUNK];
        for run in row.chunks_mut(ACT_CHUNK) {
            let v = &mut v[..run.len()];
            T::widen(run, v);
            with_simd(Glu(v, &[], true));
            T::narrow(v, run);
        }
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

/// Keys a work item's rows all go through before the next ones (a multiple of [`LANES`]):
/// their keys and values, 2·head·4 bytes each in f32 (256 KiB for heads of 64), stay in the
/// core's L2 while every pass of rows reads them, and a pass's scores (4 rows of 2 KiB) in L1.
/// On a Zen 5 (1 MiB of L2), Qwen2.5-0.5B's heads at a prompt of 8192: 470 → 372 ms against
/// one pass over all the keys (1.26×), 2048: 25.7 → 24.3 ms; tiles of 128 and 256 lost at
/// 2048 (the per-tile softmax's fixed cost), 512 level or ahead everywhere measured.
const KEY_TILE: usize = 512;

/// Causal attention of the new queries over the cache (which already holds the new keys and
/// values): `q` has rows of `q_stride` values whose first heads·head are the queries, `v` is
/// (batch, KV heads, context, head) and `k` (batch, KV heads, head, context): the keys stored
/// transposed, a row of positions per dimension, so that a query's scores come out a vector
/// of keys at a time with no sum across a vector's lanes for each key, and no work item
/// transposes them again; `y` has rows of heads·head.
///
/// Per (sequence, KV head, block of 32 queries), flash attention's order: the block's keys a
/// tile of `KEY_TILE` (512) at a time, and against each tile the block's rows (query by query,
/// each one's heads of the group in turn); a row keeps its output unnormalised with the
/// largest score and the numerators' sum so far, rescaled when a later tile holds a larger
/// score (an online softmax), and divided by the sum at the end. Only one tile's scores exist
/// at a time, and a tile's keys and values are read from the cache once per block — on the
/// GEMM paths the whole tiles once per call for every block (`SharedTiles`); on the bf16
/// engines the scores are stored straight from AMX's tiles (and from `vdpbf16ps`'s
/// registers) and the probabilities rounded to bf16 as they are made
/// (`softmax_numerators_bf16`). Llama-3.2-1B's heads at a prompt of
/// 2048 on 2 AMX cores (a Xeon reporting model 167), in one process, old and new
/// alternating, 6 rounds each: 0.87× the time with the shared tiles, 0.92× more with the
/// rounding in the softmax's pass (and the maximum in four chains: 0.96×), 0.965× more with
/// the direct stores; in FP32 on the SGEMM the shared tiles took Qwen2.5-0.5B's heads 0.89×
/// the time and Llama's 0.94× (6 of 6 rounds each).
///
/// A block goes one of three ways. A prefill's (16 rows or more): on GEMMs 32 rows at a time,
/// the scores one product and the weighted values another — the bf16 engines for a BF16
/// cache where the CPU multiplies bf16 pairs (`OnPairs`, the probabilities rounded to bf16),
/// else the FP32 SGEMM on AVX2 or AVX-512 (`OnFloats`). A decode step's few rows (and every
/// block on the portable path): through `Rows`, up to four at a time on AVX-512, each key and
/// value loaded serving all of them as a GEMM's register tile does, reading the cache in place
/// (f32) or widened a tile at a time. Qwen2.5-0.5B's heads on a Zen 5, 2 threads, a BF16
/// cache: a prompt of 2048 took 15.5 ms a layer on the engines against 22.6 widened through
/// `Rows` (1.46×), 8192 229–233 against 341–347 (1.49×), four prompts of 128 1.3–1.8 against
/// 2.9.
pub fn cached_attention<T: Elem>(
    q: &[T],
    q_stride: usize,
    (k, v): (&[T], &[T]),
    c: CacheView,
    y: &mut [T],
    kept: &mut AttentionTiles,
) {
    // A window that holds every key these queries see is none: the same keys, and the whole
    // tiles shared (`SharedTiles` takes no window). Mistral-7B's (4096) over a prompt of 2048,
    // its heads alone in BF16 on a Zen 4: 0.87× the time (6 of 6 alternating rounds).
    let c = CacheView {
        window: c.window.filter(|&w| w < c.start + c.tokens),
        ..c
    };
    let blocks = c.tokens.div_ceil(QUERY_BLOCK);
    let group = c.heads / c.kv_heads;
    let items = c.batch * c.kv_heads * blocks;
    let pairs = bf16_gemm::Engine::in_use().is_some();
    let gemms = gemm_paths();
    let width = c.heads * c.head;
    assert!(
        y.len() >= c.batch * c.tokens * width,
        "attention output too short"
    );
    let out_ptr = TilePtr(y.as_mut_ptr());
    let halves = (T::as_bf16(q), T::as_bf16(k), T::as_bf16(v));
    let on_pairs = pairs && matches!(halves, (Some(_), Some(_), Some(_)));
    let d = c.head;
    let AttentionTiles {
        pairs: kept_pairs,
        floats: kept_floats,
    } = kept;
    let shared_pairs = match halves {
        (Some(_), Some(k), Some(v)) if pairs => {
            let step = bf16_gemm::Engine::in_use()
                .unwrap_or(bf16_gemm::Engine::Dot)
                .k_step();
            let pack = |cache: usize, at, keys: &mut _, values: &mut _| {
                let tile = (d, at, KEY_TILE);
                pack_keys(
                    keys,
                    (&k[cache..cache + d * c.context], c.context),
                    tile,
                    step,
                );
                pack_values(values, &v[cache..cache + c.context * d], tile, step);
            };
            SharedTiles::pack(c, kept_pairs, PackedPairs::empty, pack)
        }
        _ => None,
    };
    let shared_floats = (gemms && !on_pairs)
        .then(|| {
            let pack = |cache: usize, at, keys: &mut _, values: &mut _| {
                let tile = (d, at, KEY_TILE);
                widen_keys(keys, (&k[cache..cache + d * c.context], c.context), tile);
                widen_values(values, &v[cache..cache + c.context * d], tile);
            };
            SharedTiles::pack(c, kept_floats, PackedB::empty, pack)
        })
        .flatten();
    (0..items).into_par_iter().for_each(|item| {
        let it = Item::new(c, q_stride, item);
        let (state, mut out) = match halves {
            (Some(q), Some(k), Some(v)) if pairs && it.seen.len() >= GEMM_ROWS => PAIRS
                .with_borrow_mut(|scratch| {
                    with_simd(OnPairs {
                        it: &it,
                        q,
                        kv: (k, v),
                        shared: shared_pairs.as_ref(),
                        scratch,
                    })
                }),
            _ if gemms && it.seen.len() >= GEMM_ROWS => FLOATS.with_borrow_mut(|scratch| {
                with_simd(OnFloats {
                    it: &it,
                    q,
                    kv: (k, v),
                    shared: shared_floats.as_ref(),
                    scratch,
                })
            }),
            _ => on_rows(&it, q, (k, v)),
        };
        for (row, &(_, sum)) in out.chunks_exact_mut(c.head).zip(&state) {
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|o| *o *= inv);
        }
        // Straight into the output, not through a list of every item's rows: freeing those
        // (a MiB at Llama-3.2-1B's prompt of 128) let the allocator hand the pages back, and
        // faulting them in again each call took 8% of the attention's time.
        for (r, rows) in out.chunks(group * c.head).enumerate() {
            let at = (it.b * c.tokens + it.q0 + r) * width + it.g * group * c.head;
            // SAFETY: `at + group·head` is within `y` (checked above), and no other item
            // writes these values: they are this item's sequence, queries and KV head's.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.add(at), group * c.head) };
            T::narrow(rows, dst);
        }
    });
}

/// One work item of [`cached_attention`]: a sequence, a KV head and a block of queries. Its
/// row r is query q0 + r / group, head g·group + r % group.
struct Item {
    c: CacheView,
    q_stride: usize,
    /// The sequence, the KV head, the block's first query.
    b: usize,
    g: usize,
    q0: usize,
    /// The first key any row sees, and how many keys from it the block's rows see in all.
    first: usize,
    n: usize,
    /// Where the sequence's and KV head's cache starts in `k` and in `v`.
    cache: usize,
    /// Each row's keys, counted from `first`.
    seen: Vec<std::ops::Range<usize>>,
}

impl Item {
    fn new(c: CacheView, q_stride: usize, item: usize) -> Self {
        let blocks = c.tokens.div_ceil(QUERY_BLOCK);
        let group = c.heads / c.kv_heads;
        let (b, g, blk) = (
            item / (c.kv_heads * blocks),
            item / blocks % c.kv_heads,
            item % blocks,
        );
        let (q0, q1) = (blk * QUERY_BLOCK, ((blk + 1) * QUERY_BLOCK).min(c.tokens));
        let (first, last) = (c.first_key(c.start + q0), c.start + q1 - 1);
        let seen = (0..(q1 - q0) * group)
            .map(|r| {
                let pos = c.start + q0 + r / group;
                c.first_key(pos) - first..pos + 1 - first
            })
            .collect();
        Item {
            c,
            q_stride,
            b,
            g,
            q0,
            first,
            n: last + 1 - first,
            cache: (b * c.kv_heads + g) * c.context * c.head,
            seen,
        }
    }

    /// Where row r's query starts in `q`.
    fn query(&self, r: usize) -> usize {
        let group = self.c.heads / self.c.kv_heads;
        let (i, j) = (self.q0 + r / group, r % group);
        (self.b * self.c.tokens + i) * self.q_stride + (self.g * group + j) * self.c.head
    }
}

/// A work item on f32 arithmetic: the rows up to four at a time through [`Rows`], keys and
/// values not in f32 widened a tile at a time. Returns each row's largest score and sum, and
/// its output not yet divided by the sum.
fn on_rows<T: Elem>(it: &Item, q: &[T], (k, v): (&[T], &[T])) -> (Vec<(f32, f32)>, Vec<f32>) {
    let (c, n, first) = (it.c, it.n, it.first);
    let per_pass = pass_rows();
    let keys = &k[it.cache..it.cache + c.head * c.context];
    let values = &v[it.cache + first * c.head..it.cache + (first + n) * c.head];
    let (mut wide_k, mut wide_v) = (Vec::new(), Vec::new());
    let rows = it.seen.len();
    let mut queries = vec![0f32; rows * c.head];
    for (r, query) in queries.chunks_exact_mut(c.head).enumerate() {
        let at = it.query(r);
        T::widen(&q[at..at + c.head], query);
    }
    let mut state = vec![(f32::NEG_INFINITY, 0f32); rows];
    let mut out = vec![0f32; rows * c.head];
    let room = KEY_TILE + LANES - 1;
    let mut scores = vec![0f32; per_pass * room];
    let mut tail = vec![0f32; c.head * LANES];
    for k0 in (0..n).step_by(KEY_TILE) {
        let k1 = (k0 + KEY_TILE).min(n);
        // The tile's values, and its keys' rows (one per dimension): the cache's own where
        // it is f32, else widened here, a tile at a time (in L2 for every pass).
        let values = in_f32(&values[k0 * c.head..k1 * c.head], &mut wide_v);
        let keys_t = match T::as_f32(keys) {
            Some(keys) => (&keys[first + k0..], c.context),
            None => {
                wide_k.resize(c.head * (k1 - k0), 0.0);
                for (t, row) in wide_k.chunks_exact_mut(k1 - k0).enumerate() {
                    T::widen(&keys[t * c.context + first + k0..][..k1 - k0], row);
                }
                (&wide_k[..], k1 - k0)
            }
        };
        let mut r0 = 0;
        while r0 < rows {
            let take = per_pass.min(rows - r0);
            // The keys a row sees of the tile's, from its first.
            let seen = |r: usize| in_tile(&it.seen[r0 + r], k0, k1);
            if (0..take).all(|r| seen(r).is_empty()) {
                r0 += take;
                continue;
            }
            let pass = Pass {
                q: &queries[r0 * c.head..(r0 + take) * c.head],
                keys_t,
                values,
                scores: (&mut scores, room),
                tail: &mut tail,
                state: &mut state[r0..r0 + take],
                out: &mut out[r0 * c.head..(r0 + take) * c.head],
            };
            match take {
                4 => with_simd(Rows::<4, 64>(pass, [0, 1, 2, 3].map(seen))),
                3 => with_simd(Rows::<3, 64>(pass, [0, 1, 2].map(seen))),
                2 => with_simd(Rows::<2, 64>(pass, [0, 1].map(seen))),
                _ => with_simd(Rows::<1, 64>(pass, [seen(0)])),
            }
            r0 += take;
        }
    }
    (state, out)
}

/// The keys of `seen` (counted from the block's first) that the tile `k0..k1` holds, counted
/// from the tile's first: empty where there are none.
fn in_tile(seen: &std::ops::Range<usize>, k0: usize, k1: usize) -> std::ops::Range<usize> {
    seen.start.max(k0) - k0..seen.end.min(k1).saturating_sub(k0)
}

/// One row's step of the online softmax on its scores over a tile (`row`), of which it sees
/// `seen`: their numerators in place against its largest score so far (`state`, with the
/// numerators' sum), its output scaled down by e^((old − new largest)·scale) where that grew.
/// Returns where the numerators are (an empty range at the row's end where it sees none).
#[inline(always)]
fn online_step(
    row: &mut [f32],
    seen: std::ops::Range<usize>,
    scale: f32,
    state: &mut (f32, f32),
    out: &mut [f32],
) -> (usize, usize) {
    let end = row.len();
    online_step_with(seen, scale, state, out, |s, old| {
        softmax_numerators_above(&mut row[s], scale, old)
    })
    .unwrap_or((end, end))
}

/// [`online_step`] with the numerators of the seen scores made by `numerators(seen, the
/// largest so far)`, which returns the new largest and their sum; `None` where the row sees
/// none of the tile.
#[inline(always)]
fn online_step_with(
    seen: std::ops::Range<usize>,
    scale: f32,
    state: &mut (f32, f32),
    out: &mut [f32],
    numerators: impl FnOnce(std::ops::Range<usize>, f32) -> (f32, f32),
) -> Option<(usize, usize)> {
    if seen.is_empty() {
        return None;
    }
    let (a, b) = (seen.start, seen.end);
    let (old, sum) = *state;
    let (max, part) = numerators(seen, old);
    let mut rescale = 1.0;
    if max > old && old > f32::NEG_INFINITY {
        rescale = ((old - max) * scale).exp();
        out.iter_mut().for_each(|o| *o *= rescale);
    }
    *state = (max, sum * rescale + part);
    Some((a, b))
}

/// Rows a work item needs for its products to go to GEMMs ([`OnPairs`], [`OnFloats`]): a
/// prefill's blocks (32 queries by the group's heads). A decode step's few rows stay on the
/// passes of [`Rows`], which read each key and value once where the GEMMs pack them first: on
/// AVX-512 a step 2047 tokens in took 0.04–0.09 ms at batch 1 that way, 0.13–0.14 on the SGEMM.
const GEMM_ROWS: usize = 16;

/// A thread's buffers for [`OnFloats`], kept from item to item and call to call.
struct FloatScratch {
    keys: PackedB<f32>,
    values: PackedB<f32>,
    q: Vec<f32>,
    scores: Vec<f32>,
    o: Vec<f32>,
}

thread_local! {
    static FLOATS: RefCell<FloatScratch> = RefCell::new(FloatScratch {
        keys: PackedB::empty(),
        values: PackedB::empty(),
        q: Vec::new(),
        scores: Vec::new(),
        o: Vec::new(),
    });
}

/// A prefill's work item on the FP32 SGEMM (the linear layers' engine), compiled for the
/// widest vectors: per key tile the keys widened into B panels (head × keys) and the values
/// into B panels (keys × head), then 32 rows at a time the scores one GEMM of the rows'
/// queries, the online softmax's step on them, and the weighted values a second GEMM added to
/// the rows' outputs — [`OnPairs`]'s order in f32. Qwen2.5-0.5B's heads on a Zen 5, 2
/// threads, against the passes of four rows: FP32 prompts of 128 at batch 1 and 8 0.19–0.25
/// and 1.4–1.8 ms against 0.30–0.45 and 2.8–3.2, 2048 20.6–21.9 against 22.6–23.3, 8192
/// 305–331 against 339–351; forced to AVX2, 2048 in 39 ms against 77 for one row of 64.
struct OnFloats<'a, T> {
    it: &'a Item,
    q: &'a [T],
    kv: (&'a [T], &'a [T]),
    /// The whole key tiles, widened once for every block that reads them.
    shared: Option<&'a SharedTiles<'a, PackedB<f32>>>,
    scratch: &'a mut FloatScratch,
}

impl<T: Elem> Vectorised for OnFloats<'_, T> {
    type Output = (Vec<(f32, f32)>, Vec<f32>);
    #[inline(always)]
    fn run(self) -> Self::Output {
        let OnFloats {
            it,
            q,
            kv: (k, v),
            shared,
            scratch,
        } = self;
        let FloatScratch {
            keys: packed_k,
            values: packed_v,
            q: queries,
            scores,
            o,
        } = scratch;
        let (c, d, rows) = (it.c, it.c.head, it.seen.len());
        let scale = 1.0 / (d as f32).sqrt();
        let keys = &k[it.cache..it.cache + d * c.context];
        let values = &v[it.cache..it.cache + c.context * d];
        queries.resize(rows * d, 0.0);
        for (r, dst) in queries.chunks_exact_mut(d).enumerate() {
            let at = it.query(r);
            T::widen(&q[at..at + d], dst);
        }
        let mut state = vec![(f32::NEG_INFINITY, 0f32); rows];
        let mut out = vec![0f32; rows * d];
        let chunk = PAIR_ROW_CHUNK;
        for k0 in (0..it.n).step_by(KEY_TILE) {
            let (k1, at) = ((k0 + KEY_TILE).min(it.n), it.first + k0);
            let len = k1 - k0;
            let (packed_k, packed_v) = match shared.and_then(|s| s.tile(it, at, len)) {
                Some((keys, values)) => (keys, values),
                None => {
                    widen_keys(packed_k, (keys, c.context), (d, at, len));
                    widen_values(packed_v, values, (d, at, len));
                    (&*packed_k, &*packed_v)
                }
            };
            let ld = len.next_multiple_of(NR);
            scores.resize(chunk.min(rows) * ld, 0.0);
            o.resize(chunk.min(rows) * d, 0.0);
            let (kview, vview) = (packed_k.view(), packed_v.view());
            for r0 in (0..rows).step_by(chunk) {
                let m = chunk.min(rows - r0);
                // SAFETY: m rows of d queries, scores m rows of ld >= len floats.
                unsafe {
                    sgemm::gemm(
                        m,
                        queries[r0 * d..].as_ptr(),
                        d,
                        &kview,
                        (0, kview.panels()),
                        scores.as_mut_ptr(),
                        ld,
                    )
                };
                for (i, row) in scores.chunks_exact_mut(ld).take(m).enumerate() {
                    let r = r0 + i;
                    let seen = in_tile(&it.seen[r], k0, k1);
                    let out = &mut out[r * d..(r + 1) * d];
                    let (a, b) = online_step(row, seen, scale, &mut state[r], out);
                    row[..a].fill(0.0);
                    row[b..].fill(0.0);
                }
                // SAFETY: m rows of ld probabilities (len of them read), o m rows of d.
                unsafe {
                    sgemm::gemm(
                        m,
                        scores.as_ptr(),
                        ld,
                        &vview,
                        (0, vview.panels()),
                        o.as_mut_ptr(),
                        d,
                    )
                };
                let dst = &mut out[r0 * d..(r0 + m) * d];
                dst.iter_mut().zip(&o[..m * d]).for_each(|(x, y)| *x += y);
            }
        }
        (state, out)
    }
}

/// Rows [`OnPairs`] takes through both products and the softmax between them at a time: their
/// scores (32 rows of a tile, 64 KiB) stay in L1 and L2 from the first product to the second.
/// Qwen2.5-0.5B's heads in BF16 on a Zen 5, 2 threads (two runs each): a prompt of 2048 took
/// 15.7–16.2 ms a layer, of 8192 234–236 ms, against 16.4–16.6 and 241–243 with a block's
/// 224 rows at once, 15.8–15.9 and 240 with 64, 16.2–16.3 and 238 with 16. One AMX block.
const PAIR_ROW_CHUNK: usize = 32;
const _: () = assert!(PAIR_ROW_CHUNK.is_multiple_of(bf16_gemm::BLOCK_ROWS));

/// A thread's buffers for [`OnPairs`], kept from item to item and call to call.
struct PairScratch {
    keys: PackedPairs,
    values: PackedPairs,
    /// The rows' queries and probabilities, padded with zeros to the packings' K.
    q: Vec<bf16>,
    probs: Vec<bf16>,
    scores: Vec<f32>,
}

thread_local! {
    static PAIRS: RefCell<PairScratch> = RefCell::new(PairScratch {
        keys: PackedPairs::empty(),
        values: PackedPairs::empty(),
        q: Vec::new(),
        probs: Vec::new(),
        scores: Vec::new(),
    });
}

/// A work item of a BF16 cache on the bf16 engines (`vdpbf16ps`, or AMX's tiles), compiled
/// for the widest vectors: per key tile, the tile's keys packed as B (head × keys) and its
/// values as B (keys × head), the scores one GEMM of the rows' queries (as stored), the
/// online softmax's step on them in f32, the probabilities rounded to bf16 (as PyTorch's BF16
/// attention rounds them) and the weighted values a second GEMM added to the rows' outputs.
/// Both products run at the engines' rate where the f32 passes multiply widened values.
struct OnPairs<'a> {
    it: &'a Item,
    q: &'a [bf16],
    kv: (&'a [bf16], &'a [bf16]),
    /// The whole key tiles, packed once for every block that reads them.
    shared: Option<&'a SharedTiles<'a, PackedPairs>>,
    scratch: &'a mut PairScratch,
}

impl Vectorised for OnPairs<'_> {
    type Output = (Vec<(f32, f32)>, Vec<f32>);
    #[inline(always)]
    fn run(self) -> Self::Output {
        use bf16_gemm::{Done, Engine};
        let OnPairs {
            it,
            q,
            kv: (k, v),
            shared,
            scratch,
        } = self;
        let PairScratch {
            keys: packed_k,
            values: packed_v,
            q: q_pairs,
            probs,
            scores,
        } = scratch;
        let (c, d, rows) = (it.c, it.c.head, it.seen.len());
        let scale = 1.0 / (d as f32).sqrt();
        let engine = Engine::in_use().unwrap_or(Engine::Dot);
        let step = engine.k_step();
        let keys = &k[it.cache..it.cache + d * c.context];
        let values = &v[it.cache..it.cache + c.context * d];
        // The queries as A: rows of K = head padded to the step, as stored.
        let kq = d.div_ceil(step) * step;
        let lda = engine.lda(kq);
        q_pairs.resize(rows * lda, bf16::ZERO);
        for (r, dst) in q_pairs.chunks_exact_mut(lda).enumerate() {
            let at = it.query(r);
            dst[..d].copy_from_slice(&q[at..at + d]);
            dst[d..].fill(bf16::ZERO);
        }
        let mut state = vec![(f32::NEG_INFINITY, 0f32); rows];
        let mut out = vec![0f32; rows * d];
        for k0 in (0..it.n).step_by(KEY_TILE) {
            let (k1, at) = ((k0 + KEY_TILE).min(it.n), it.first + k0);
            let len = k1 - k0;
            let (packed_k, packed_v) = match shared.and_then(|s| s.tile(it, at, len)) {
                Some((keys, values)) => (keys, values),
                None => {
                    pack_keys(packed_k, (keys, c.context), (d, at, len), step);
                    pack_values(packed_v, values, (d, at, len), step);
                    (&*packed_k, &*packed_v)
                }
            };
            let (ld, chunk) = (packed_v.kp(), PAIR_ROW_CHUNK);
            let ldp = engine.lda(ld);
            // Whole blocks of rows: AMX stores its tiles of scores straight here.
            scores.resize(chunk * ld, 0.0);
            probs.resize(chunk.min(rows) * ldp, bf16::ZERO);
            for r0 in (0..rows).step_by(chunk) {
                let m = chunk.min(rows - r0);
                // The scores' one pointer, for the engines' direct stores and `keep` alike.
                let (to, room) = (scores.as_mut_ptr(), scores.len());
                let mut keep = |done: Done<'_>| {
                    // SAFETY: the CPU runs the engine, so it has AVX-512F; `to` has `room`
                    // floats, written by nothing else while the GEMM runs.
                    unsafe { done.write_into(std::slice::from_raw_parts_mut(to, room), ld, false) }
                };
                // SAFETY: `Engine::in_use` is some (checked by `cached_attention`), so the CPU
                // runs the engine; q_pairs has `rows` rows of kq = packed_k.kp() values `lda`
                // apart, zeros past the head; the packed keys have no bias; `scores` has 32
                // rows (PAIR_ROW_CHUNK) of ld ≥ the keys' panels' columns.
                unsafe {
                    let panels = (0, packed_k.panels());
                    let a = q_pairs[r0 * lda..].as_ptr();
                    let tiles = bf16_gemm::Tiles { c: to, ldc: ld };
                    bf16_gemm::gemm_into(engine, m, a, lda, packed_k, panels, tiles, &mut keep)
                };
                // Each row's step of the online softmax on the keys it sees of the tile; its
                // probabilities in bf16, zeros for the keys it does not see.
                let rows_of = scores.chunks_exact_mut(ld).zip(probs.chunks_exact_mut(ldp));
                for (i, (row, p)) in rows_of.take(m).enumerate() {
                    let r = r0 + i;
                    let seen = in_tile(&it.seen[r], k0, k1);
                    let out = &mut out[r * d..(r + 1) * d];
                    let end = row.len();
                    let (a, b) = online_step_with(seen, scale, &mut state[r], out, |s, old| {
                        softmax_numerators_bf16(&mut row[s.clone()], scale, old, &mut p[s])
                    })
                    .unwrap_or((end, end));
                    p[..a].fill(bf16::ZERO);
                    p[b..].fill(bf16::ZERO);
                }
                let rows_out = &mut out[r0 * d..];
                let mut add = |done: Done<'_>| {
                    // SAFETY: as above.
                    unsafe { done.write_into(rows_out, d, true) }
                };
                // SAFETY: as above; the probabilities' rows have ld = packed_v.kp() values,
                // ldp apart, zeros past the tile's keys.
                unsafe {
                    let panels = (0, packed_v.panels());
                    bf16_gemm::gemm(
                        engine,
                        m,
                        probs.as_ptr(),
                        ldp,
                        packed_v,
                        panels,
                        None,
                        &mut add,
                    )
                };
            }
        }
        (state, out)
    }
}

/// Keys `at..at + len` of a KV head's cache (`keys` transposed: a row of `context` positions
/// per dimension) packed as B (head × keys) for K steps of `step`: panel p, pair row r holds
/// dimensions 2r and 2r + 1 of keys 16p.. — two rows of the transposed cache interleaved.
#[inline(always)]
fn pack_keys(
    packed: &mut PackedPairs,
    (keys, context): (&[bf16], usize),
    (d, at, len): (usize, usize, usize),
    step: usize,
) {
    use bf16_gemm::PANEL;
    packed.refill((d, len), step, |p, panel| {
        let cols = PANEL.min(len - p * PANEL);
        let dim = |t: usize| &keys[t * context + at + p * PANEL..][..cols];
        for (r, row) in panel.chunks_exact_mut(2 * PANEL).take(d / 2).enumerate() {
            let (lo, hi) = (dim(2 * r), dim(2 * r + 1));
            for (j, two) in row.chunks_exact_mut(2).take(cols).enumerate() {
                two.copy_from_slice(&[lo[j], hi[j]]);
            }
        }
        if d % 2 == 1 {
            let (lo, row) = (dim(d - 1), &mut panel[d / 2 * 2 * PANEL..]);
            for (j, &x) in lo.iter().enumerate() {
                row[2 * j] = x;
            }
        }
    });
}

/// Values `at..at + len` of a KV head's cache (`values`: a row of head values per position)
/// packed as B (keys × head): panel p, pair row r interleaves dimensions 16p.. of keys 2r and
/// 2r + 1 (an odd last key with the padding's zeros). K padded to whole vectors (and to
/// `step`), so the probabilities' rows are.
#[inline(always)]
fn pack_values(
    packed: &mut PackedPairs,
    values: &[bf16],
    (d, at, len): (usize, usize, usize),
    step: usize,
) {
    use bf16_gemm::PANEL;
    packed.refill((len, d), PANEL.max(step), |p, panel| {
        let width = PANEL.min(d - p * PANEL);
        let value = |j: usize| &values[(at + j) * d + p * PANEL..][..width];
        let pairs = panel.chunks_exact_mut(2 * PANEL).take(len.div_ceil(2));
        for (r, row) in pairs.enumerate() {
            let even = value(2 * r);
            if 2 * r + 1 < len {
                let odd = value(2 * r + 1);
                for ((two, &e), &o) in row.chunks_exact_mut(2).zip(even).zip(odd) {
                    two.copy_from_slice(&[e, o]);
                }
            } else {
                for (two, &e) in row.chunks_exact_mut(2).zip(even) {
                    two[0] = e;
                }
            }
        }
    });
}

/// The memory [`cached_attention`] packs a call's whole key tiles into (as bf16 pairs for
/// the bf16 engines, as f32 panels for the SGEMM), kept by its caller from call to call and
/// layer to layer: packings made afresh each call would fault their pages in again. It grows
/// to one layer's keys and values of the longest context seen (Qwen2.5-0.5B's 2048 tokens in
/// BF16: 1 MiB; an 8B model's 8192: 32 MiB), and belongs to the session that owns it, which
/// counts it among its memory ([`Self::bytes`]) and frees it with itself. (It was a static
/// kept for the process's lifetime and counted nowhere, and a second session running
/// attention at the same time packed into memory of its own each call.)
#[derive(Default)]
pub struct AttentionTiles {
    pairs: Vec<(PackedPairs, PackedPairs)>,
    floats: Vec<(PackedB<f32>, PackedB<f32>)>,
}

impl AttentionTiles {
    /// The bytes the packed tiles hold.
    pub fn bytes(&self) -> u64 {
        let pairs = self.pairs.iter().map(|(k, v)| k.bytes() + v.bytes());
        let floats = self.floats.iter().map(|(k, v)| k.bytes() + v.bytes());
        pairs.chain(floats).sum()
    }
}

/// Every whole key tile (`KEY_TILE` keys from a multiple of it) of every sequence's KV heads,
/// packed once per call for the GEMM paths ([`OnPairs`], [`OnFloats`]): without them each
/// block of 32 queries packed again every key it sees, so a prompt of n keys packed n²/64 of
/// them a KV head (a 2048-token prompt: 32 times its keys) — 12–18% of the attention's time
/// on AMX, reading the transposed cache a row apart per dimension. A block's last, partial
/// tile is still packed by its item (the values' K must end where its keys do, or the
/// product would run over keys it never sees).
struct SharedTiles<'a, P> {
    /// Tile t of sequence b's KV head g at (b·kv_heads + g)·per_head + t.
    tiles: &'a [(P, P)],
    per_head: usize,
}

impl<'a, P: Send + Sync> SharedTiles<'a, P> {
    /// The whole tiles packed into `tiles` (the caller's [`AttentionTiles`]), grown as needed,
    /// in parallel: `pack(cache, at, keys, values)` packs the KV head's keys and values
    /// `at..at + KEY_TILE`, the head's cache starting at `cache` in `k` and in `v`. `None`
    /// where no tile is read by two blocks: one block of queries (a decode step, a short
    /// chunk), a prompt shorter than a tile, or a sliding window shorter than the context
    /// (its blocks' tiles start where the window does, not at multiples of a tile;
    /// [`cached_attention`] drops longer ones).
    fn pack(
        c: CacheView,
        tiles: &'a mut Vec<(P, P)>,
        empty: impl Fn() -> P,
        pack: impl Fn(usize, usize, &mut P, &mut P) + Sync,
    ) -> Option<Self> {
        let per_head = (c.start + c.tokens) / KEY_TILE;
        if c.window.is_some() || c.tokens <= QUERY_BLOCK || per_head == 0 {
            return None;
        }
        let count = c.batch * c.kv_heads * per_head;
        if tiles.len() < count {
            tiles.resize_with(count, || (empty(), empty()));
        }
        tiles[..count]
            .par_iter_mut()
            .enumerate()
            .for_each(|(i, (keys, values))| {
                let cache = (i / per_head) * c.context * c.head;
                pack(cache, i % per_head * KEY_TILE, keys, values);
            });
        Some(SharedTiles {
            tiles: &tiles[..count],
            per_head,
        })
    }

    /// The packed tile of `it`'s KV head holding its keys `at..at + len`, where that is a
    /// whole tile.
    fn tile(&self, it: &Item, at: usize, len: usize) -> Option<(&P, &P)> {
        let t = at / KEY_TILE;
        let whole = len == KEY_TILE && at.is_multiple_of(KEY_TILE) && t < self.per_head;
        let head = it.b * it.c.kv_heads + it.g;
        whole.then(|| {
            let (keys, values) = &self.tiles[head * self.per_head + t];
            (keys, values)
        })
    }
}

/// Keys `at..at + len` of a KV head's cache (`keys` transposed: a row of `context` positions
/// per dimension) widened into f32 B panels (head × keys) for the SGEMM.
#[inline(always)]
fn widen_keys<T: Elem>(
    packed: &mut PackedB<f32>,
    (keys, context): (&[T], usize),
    (d, at, len): (usize, usize, usize),
) {
    packed.refill((d, len), |p, panel| {
        let cols = NR.min(len - p * NR);
        for (t, row) in panel.chunks_exact_mut(NR).enumerate() {
            T::widen(&keys[t * context + at + p * NR..][..cols], &mut row[..cols]);
        }
    });
}

/// Values `at..at + len` of a KV head's cache (a row of head values per position) widened
/// into f32 B panels (keys × head) for the SGEMM.
#[inline(always)]
fn widen_values<T: Elem>(
    packed: &mut PackedB<f32>,
    values: &[T],
    (d, at, len): (usize, usize, usize),
) {
    packed.refill((len, d), |p, panel| {
        let width = NR.min(d - p * NR);
        for (j, row) in panel.chunks_exact_mut(NR).enumerate() {
            T::widen(&values[(at + j) * d + p * NR..][..width], &mut row[..width]);
        }
    });
}

/// Rows of queries one [`Rows`] pass takes at most, each summing 64 lanes: four on AVX-512 (its
/// 32 registers hold the 16 vectors), one elsewhere. AVX2's four rows of 16 lanes were
/// compiled to scalar code (the products' accumulators left in memory): on a Zen 5 forced to
/// AVX2, a decode step 2047 tokens in took 0.17–0.34 ms (batch 1) and 1.3–2.6 ms (batch 8)
/// that way, 0.08–0.18 and 0.68–0.78 with one row of 64, and a prompt of 2048 221 ms against
/// 77 (the prompts now go to [`OnFloats`]: 39).
fn pass_rows() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::backend::cpu::simd::{Simd, simd};
        if simd() >= Simd::Avx512 {
            return 4;
        }
    }
    1
}

/// Whether a prefill's blocks go to the SGEMM ([`OnFloats`]): where the paths in use have
/// AVX2 and FMA. The portable SGEMM lost to one row of 64 lanes (a prompt of 2048: 249 ms
/// against 178 on a Zen 5 forced to it).
fn gemm_paths() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::backend::cpu::simd::simd;
        simd().has_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `src` as f32: itself where it is, else widened into `buf`.
fn in_f32<'a, T: Elem>(src: &'a [T], buf: &'a mut Vec<f32>) -> &'a [f32] {
    match T::as_f32(src) {
        Some(f) => f,
        None => {
            buf.resize(src.len(), 0.0);
            T::widen(src, buf);
            buf
        }
    }
}

/// What one pass of [`Rows`] reads and writes.
struct Pass<'a> {
    /// The rows' queries, `head` values each (the pass's rows of them).
    q: &'a [f32],
    /// The tile's keys transposed: head rows (one per dimension) from its first key, the
    /// rows' stride apart (the last row ends with the tile's last key, or later).
    keys_t: (&'a [f32], usize),
    /// The tile's values, a row of head values per key.
    values: &'a [f32],
    /// Room for each row's scores (a tile's keys and `LANES - 1` more, so a last run of
    /// `LANES` scores always fits), and the room's length.
    scores: (&'a mut [f32], usize),
    /// Room for the last few keys' zero-padded copy: head rows of `LANES`.
    tail: &'a mut [f32],
    /// Each row's largest score so far (−∞ before its first) and its numerators' sum.
    state: &'a mut [(f32, f32)],
    /// The rows' outputs so far, `head` values each, not yet divided by their sums.
    out: &'a mut [f32],
}

/// `R` rows of queries against the keys each sees of one tile (an empty range: none): an
/// online softmax's step of softmax(q·kᵀ/√head)·v, with scores and weighted values summed `W`
/// lanes a row at a time. The rows' keys run from the first row's first to the last row's
/// last (the rows go query by query, so those are the extremes); a row's scores outside its
/// own keys are zero after its step, so the weighted values skip them at no cost but the
/// multiply.
struct Rows<'a, const R: usize, const W: usize>(Pass<'a>, [std::ops::Range<usize>; R]);

impl<const R: usize, const W: usize> Vectorised for Rows<'_, R, W> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Rows(p, seen) = self;
        let d = p.out.len() / R;
        let scale = 1.0 / (d as f32).sqrt();
        let (scores, room) = p.scores;
        let busy = || seen.iter().filter(|s| !s.is_empty());
        let (Some(lo), Some(hi)) = (busy().map(|s| s.start).min(), busy().map(|s| s.end).max())
        else {
            return;
        };
        let len = hi - lo;
        // Scores W keys at a time, then 16, then the last few through a zero-padded copy of
        // their keys (all 16 scores written: each row has room for them past its keys).
        let mut j = 0;
        while j + W <= len {
            scores_of::<W, R>(p.q, d, p.keys_t, lo + j, (scores, room), j);
            j += W;
        }
        while j + LANES <= len {
            scores_of::<LANES, R>(p.q, d, p.keys_t, lo + j, (scores, room), j);
            j += LANES;
        }
        if j < len {
            let (kt, stride) = p.keys_t;
            for (t, keys) in p.tail.chunks_exact_mut(LANES).enumerate() {
                let from = &kt[t * stride + lo + j..][..len - j];
                keys[..len - j].copy_from_slice(from);
                keys[len - j..].fill(0.0);
            }
            scores_of::<LANES, R>(p.q, d, (p.tail, LANES), 0, (scores, room), j);
        }
        // Each row's step: numerators against its largest score so far, the sum and the
        // output so far scaled down by e^((old − new largest)·scale) where it grew.
        let mut rescale = [1f32; R];
        for (r, (keys, state)) in seen.iter().zip(p.state.iter_mut()).enumerate() {
            let row = &mut scores[r * room..r * room + len];
            if keys.is_empty() {
                row.fill(0.0);
                continue;
            }
            let (a, b) = (keys.start - lo, keys.end - lo);
            let (old, sum) = *state;
            let (max, step) = softmax_numerators_above(&mut row[a..b], scale, old);
            if max > old && old > f32::NEG_INFINITY {
                rescale[r] = ((old - max) * scale).exp();
            }
            *state = (max, sum * rescale[r] + step);
            row[..a].fill(0.0);
            row[b..].fill(0.0);
        }
        // The weighted values W dimensions at a time in registers, then 16, then one, added
        // to each row's output so far (rescaled).
        let values = &p.values[lo * d..hi * d];
        let mut t = 0;
        while t + W <= d {
            weighted::<W, R>(scores, room, values, t, rescale, p.out);
            t += W;
        }
        while t + 16 <= d {
            weighted::<16, R>(scores, room, values, t, rescale, p.out);
            t += 16;
        }
        for (r, out) in p.out.chunks_exact_mut(d).enumerate() {
            let scores = &scores[r * room..r * room + len];
            for (tt, o) in out.iter_mut().enumerate().skip(t) {
                *o = (scores.iter().zip(values.chunks_exact(d)))
                    .fold(*o * rescale[r], |a, (s, v)| a + s * v[tt]);
            }
        }
    }
}

/// Keys whose scores one run takes at least: an AVX-512 vector.
const LANES: usize = 16;

/// The scores of keys `key0..key0 + W` (in the `d` rows, `stride` apart, of the transposed
/// `kt`) for `R` queries (rows of `d` in `q`), unscaled, summed in `R × W` lanes kept in
/// registers over the dimensions, into scores `j..j + W` of each row (`ld` apart).
#[inline(always)]
fn scores_of<const W: usize, const R: usize>(
    q: &[f32],
    d: usize,
    (kt, stride): (&[f32], usize),
    key0: usize,
    (scores, ld): (&mut [f32], usize),
    j: usize,
) {
    let q: [&[f32]; R] = std::array::from_fn(|r| &q[r * d..(r + 1) * d]);
    let mut acc = [[0f32; W]; R];
    for t in 0..d {
        let row = &kt[t * stride + key0..][..W];
        for (acc, q) in acc.iter_mut().zip(&q) {
            let qt = q[t];
            for l in 0..W {
                acc[l] += qt * row[l];
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        scores[r * ld + j..][..W].copy_from_slice(acc);
    }
}

/// Dimensions `t0..t0 + W` of Σ_j p_j·v_j over the value rows in `values`, for `R` rows of
/// weights `p` (`stride` apart, as many as `values` has rows), added to those of `out`'s rows
/// scaled by each row's `rescale`.
#[inline(always)]
fn weighted<const W: usize, const R: usize>(
    p: &[f32],
    stride: usize,
    values: &[f32],
    t0: usize,
    rescale: [f32; R],
    out: &mut [f32],
) {
    let d = out.len() / R;
    let n = values.len() / d;
    let p: [&[f32]; R] = std::array::from_fn(|r| &p[r * stride..r * stride + n]);
    // Not `array::from_fn`: its closure is compiled without the caller's target features.
    let mut acc = [[0f32; W]; R];
    for (r, acc) in acc.iter_mut().enumerate() {
        let o = &out[r * d + t0..][..W];
        for l in 0..W {
            acc[l] = o[l] * rescale[r];
        }
    }
    for (j, value) in values.chunks_exact(d).enumerate() {
        let v = &value[t0..][..W];
        for (acc, p) in acc.iter_mut().zip(&p) {
            let pj = p[j];
            for l in 0..W {
                acc[l] += pj * v[l];
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        out[r * d + t0..][..W].copy_from_slice(acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

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

    /// SwiGLU and GPT-2's tanh GELU match their formulas in f64, for rows shorter than a
    /// widened run, one run long, and crossing runs (1100 = 2 × 512 + 76), in f32 and BF16.
    #[test]
    fn activations_match_f64_across_runs() {
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let gelu = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        };
        for inner in [7, ACT_CHUNK, 1100] {
            let rows = 3;
            let x: Vec<f32> = (0..rows * 2 * inner)
                .map(|i| (i as f32 * 0.173).sin() * 4.0)
                .collect();
            let mut y = vec![0f32; rows * inner];
            swiglu(&x, inner, &mut y);
            let mut yh = vec![bf16::ZERO; rows * inner];
            let xh: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            swiglu(&xh, inner, &mut yh);
            let mut g = x[..rows * inner].to_vec();
            gelu_tanh(&mut g, inner);
            let mut gh = xh[..rows * inner].to_vec();
            gelu_tanh(&mut gh, inner);
            for r in 0..rows {
                for i in 0..inner {
                    let (a, b) = (
                        x[r * 2 * inner + i] as f64,
                        x[r * 2 * inner + inner + i] as f64,
                    );
                    let (ah, bh) = (
                        xh[r * 2 * inner + i].to_f64(),
                        xh[r * 2 * inner + inner + i].to_f64(),
                    );
                    let at = r * inner + i;
                    let checks = [
                        ("swiglu f32", y[at] as f64, silu(a) * b, 1e-5),
                        ("swiglu bf16", yh[at].to_f64(), silu(ah) * bh, 1e-2),
                        ("gelu f32", g[at] as f64, gelu(x[at] as f64), 1e-5),
                        ("gelu bf16", gh[at].to_f64(), gelu(xh[at].to_f64()), 1e-2),
                    ];
                    for (what, got, want, tol) in checks {
                        assert!(
                            (got - want).abs() <= tol * (1.0 + want.abs()),
                            "{what} {inner} [{r}, {i}]: {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    /// Each sequence's and KV head's keys (context rows of head values) transposed: head rows
    /// of context positions, the layout [`cached_attention`] reads.
    fn keys_transposed(k: &[f32], head: usize, context: usize) -> Vec<f32> {
        let mut t = vec![0f32; k.len()];
        for (block, out) in k.chunks(head * context).zip(t.chunks_mut(head * context)) {
            for (p, key) in block.chunks(head).enumerate() {
                for (d, &x) in key.iter().enumerate() {
                    out[d * context + p] = x;
                }
            }
        }
        t
    }

    /// Queries (rows `qs` apart), keys and values, and where they are.
    type Case<'a> = (&'a [f32], usize, (&'a [f32], &'a [f32]), CacheView);

    /// The last `R` rows (query by query, head by head) of the first sequence's first group of
    /// query heads, through one [`Rows`] pass that `run` compiles (`k` transposed, as the
    /// kernel takes it): each row's place in `y` and its output.
    fn last_rows<const R: usize, const W: usize>(
        (q, qs, (k, v), c): Case<'_>,
        run: fn(Rows<'_, R, W>),
    ) -> Vec<(usize, Vec<f32>)> {
        let group = c.heads / c.kv_heads;
        let rows: Vec<(usize, usize)> = (0..c.tokens)
            .flat_map(|i| (0..group).map(move |j| (i, j)))
            .collect();
        let Some(rows) = rows
            .get(rows.len().saturating_sub(R)..)
            .filter(|r| r.len() == R)
        else {
            return Vec::new();
        };
        let n = c.start + c.tokens;
        let queries: Vec<f32> = (rows.iter())
            .flat_map(|&(i, j)| &q[i * qs + j * c.head..][..c.head])
            .copied()
            .collect();
        let seen = std::array::from_fn(|r| {
            let pos = c.start + rows[r].0;
            c.first_key(pos)..pos + 1
        });
        let room = n + LANES - 1;
        let (mut scores, mut out) = (vec![0f32; R * room], vec![0f32; R * c.head]);
        let mut state = [(f32::NEG_INFINITY, 0f32); R];
        run(Rows(
            Pass {
                q: &queries,
                keys_t: (&k[..c.head * c.context], c.context),
                values: &v[..n * c.head],
                scores: (&mut scores, room),
                tail: &mut vec![0f32; c.head * LANES],
                state: &mut state,
                out: &mut out,
            },
            seen,
        ));
        for (row, (_, sum)) in out.chunks_exact_mut(c.head).zip(state) {
            row.iter_mut().for_each(|o| *o /= sum);
        }
        let at = |&(i, j): &(usize, usize)| (i * c.heads + j) * c.head;
        rows.iter()
            .map(at)
            .zip(out.chunks(c.head).map(<[f32]>::to_vec))
            .collect()
    }

    /// The scores over transposed keys and the weighted values in registers match the f64 softmax
    /// over the keys each query sees: heads of 8 (no whole vector), 16, 80 (64 + 16) and 128,
    /// prompts crossing query blocks, 64-key runs and key tiles (the online softmax's
    /// rescaling), decode steps deep into the cache, sliding windows (one starting past the
    /// first tile), grouped KV heads (Qwen's 7 query heads a KV head: passes that span two
    /// queries) and blocks whose rows leave passes of 3, 2 and 1; in f32 and BF16 storage on
    /// this process's vector path (prefills' blocks on the GEMMs — a BF16 cache's on the bf16
    /// engines where the CPU has them — and decode steps' few rows through `Rows`), and `Rows`
    /// passes compiled for AVX2 + FMA (where the CPU has them) and for the baseline (portable).
    #[test]
    fn cached_attention_matches_f64() {
        let shapes = [
            // batch, tokens, start, context, heads, KV heads, head, window
            (1, 100, 0, 100, 4, 2, 64, None),
            (2, 37, 5, 50, 2, 1, 8, None),
            (1, 1, 150, 151, 6, 2, 80, None),
            (1, 70, 10, 90, 2, 2, 128, Some(33)),
            (1, 40, 0, 40, 14, 2, 64, None),
            (1, 1, 60, 61, 14, 2, 64, None),
            (1, 37, 0, 40, 3, 3, 16, None),
            (1, 600, 0, 600, 14, 2, 64, None),
            (1, 150, 500, 650, 2, 1, 64, Some(150)),
            // A chunk after a whole tile of cache, two sequences: the tiles packed once for
            // every block (`SharedTiles`), a head that is not a whole K step.
            (2, 300, 600, 1000, 4, 2, 48, None),
            // A window longer than the context (Mistral-7B's 4096 over a short prompt).
            (1, 600, 0, 600, 4, 2, 64, Some(700)),
        ];
        let wave =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin() * 2.0).collect() };
        let close = |a: f32, b: f32| (a - b).abs() <= 2e-5 * (1.0 + b.abs());
        // One memory for the shared tiles throughout, as a session keeps it: each shape
        // finds the tiles of the one before (larger or smaller) there.
        let kept = &mut AttentionTiles::default();
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
            // Keys growing with their position, so that a later tile holds a row's largest
            // score and the online softmax must rescale what it summed before.
            let mut k = wave(batch * kv_heads * context * head, 0.11);
            for (i, x) in k.iter_mut().enumerate() {
                *x *= 1.0 + 2.0 * (i / head % context) as f32 / context as f32;
            }
            let v = wave(batch * kv_heads * context * head, 0.23);
            let mut y = vec![0f32; batch * tokens * heads * head];
            let k_t = keys_transposed(&k, head, context);
            cached_attention(&q, qs, (&k_t, &v), c, &mut y, kept);
            let want = reference(&q, qs, (&k, &v), c);
            for (i, (&a, &b)) in y.iter().zip(&want).enumerate() {
                assert!(close(a, b), "{c:?} [{i}]: {a} against {b}");
            }
            // The same in BF16 storage (the keys and values widened a block at a time), against
            // the reference on the rounded inputs, to BF16's output rounding.
            let round = |x: &[f32]| -> Vec<bf16> { x.iter().map(|&v| bf16::from_f32(v)).collect() };
            let (qh, kh, vh) = (round(&q), round(&k_t), round(&v));
            let mut yh = vec![bf16::ZERO; y.len()];
            cached_attention(&qh, qs, (&kh, &vh), c, &mut yh, kept);
            let wide = |x: &[bf16]| -> Vec<f32> { x.iter().map(|v| v.to_f32()).collect() };
            let (qr, vr) = (wide(&qh), wide(&vh));
            let kr = wide(&round(&k));
            let want_h = reference(&qr, qs, (&kr, &vr), c);
            for (i, (a, &b)) in yh.iter().zip(&want_h).enumerate() {
                let a = a.to_f32();
                assert!(
                    (a - b).abs() <= 1e-2 * (1.0 + b.abs()),
                    "bf16 {c:?} [{i}]: {a} against {b}"
                );
            }
            // The last rows of the first sequence's first group (its last queries' heads), a
            // pass of each size the paths take, compiled for AVX2 + FMA (where the CPU has
            // them) and for the baseline (portable).
            let x = (q.as_slice(), qs, (k_t.as_slice(), v.as_slice()), c);
            let mut paths = vec![
                ("portable 1", last_rows::<1, 64>(x, |w| w.run())),
                ("portable 4", last_rows::<4, 64>(x, |w| w.run())),
            ];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                /// A pass compiled for AVX2 + FMA.
                fn avx2<const R: usize, const W: usize>(w: Rows<R, W>) {
                    #[target_feature(enable = "avx2,fma")]
                    fn run<const R: usize, const W: usize>(w: Rows<R, W>) {
                        w.run()
                    }
                    // SAFETY: the CPU has AVX2 and FMA (detected before any call).
                    unsafe { run(w) }
                }
                paths.push(("avx2 1", last_rows::<1, 64>(x, avx2)));
                paths.push(("avx2 3", last_rows::<3, 64>(x, avx2)));
            }
            for (path, rows) in paths {
                for (at, out) in rows {
                    for (t, (&a, &b)) in out.iter().zip(&want[at..]).enumerate() {
                        assert!(close(a, b), "{path} {c:?} [{at} + {t}]: {a} against {b}");
                    }
                }
            }
        }
        // The last shape's shared tiles are the caller's, and counted.
        assert!(kept.bytes() > 0, "the shared tiles are not counted");
    }
}

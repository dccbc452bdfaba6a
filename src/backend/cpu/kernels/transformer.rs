//! The ops of a vision transformer on token tensors (N, T, D), stored row-major — which is
//! what an NHWC image batch (N, H, W, C) already is as tokens (N, H·W, C), so turning a patch
//! grid into tokens moves nothing. Arithmetic in f32, storage any [`Elem`]; rows in parallel.
//!
//! Attention runs per (image, head) and pass of query rows: the scores of those rows only are
//! formed (never the T × T matrix of a whole head at once), on the GEMM engines the linear
//! layers use, and the softmax runs on them between the two products.

use rayon::prelude::*;

use std::cell::RefCell;

use half::bf16;

use super::{fold_halves, fold_lanes, softmax_numerators};
use crate::backend::cpu::bf16_gemm::{self, PackedPairs};
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::elem::{bf16_f32, f32_bf16};
use crate::backend::cpu::sgemm::{self, NR, PackedB};
use crate::backend::cpu::simd::{Simd, Vectorised, simd, with_simd};
use crate::backend::cpu::{Lines, amx};
use crate::model::op::{Act, WindowGrid};
use crate::model::weights::WindowParams;

/// `nn.LayerNorm` over rows of `weight.len()` values: biased variance, in f32, the sums in
/// lanes (`fold_lanes`). ViT-B/16's 25 norms of 1576 × 768 values (batch 8) took 1.2 ms each
/// on two Zen 4 cores as running sums.
pub fn layer_norm<T: Elem>(x: &[T], weight: &[f32], bias: &[f32], eps: f32, y: &mut [T]) {
    let norm = Norm {
        weight,
        bias: Some(bias),
        eps,
        centre: true,
    };
    normalise_rows(x, y, norm);
}

/// A norm of rows of `weight.len()` values: (v − mean) / √(var + eps) · weight (+ bias), the
/// variance biased; with `centre` false the mean is taken as 0, which is RMSNorm.
#[derive(Clone, Copy)]
pub(crate) struct Norm<'a> {
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub eps: f32,
    pub centre: bool,
}

impl Norm<'_> {
    /// A row's mean (0 uncentred) and 1 / √(var + eps).
    #[inline(always)]
    fn stats(&self, v: &[f32]) -> (f32, f32) {
        let d = v.len() as f32;
        let add = |a: f32, b: f32| a + b;
        let mean = if self.centre {
            fold_lanes(v, 0.0, |a| a, add) / d
        } else {
            0.0
        };
        let var = fold_lanes(v, 0.0, |a| (a - mean) * (a - mean), add) / d;
        (mean, 1.0 / (var + self.eps).sqrt())
    }
}

thread_local! {
    /// A worker's row of [`normalise_rows`], widened.
    static NORM_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `norm` of each row of `x` into `y`, rows in parallel a few a work item: bf16 and f32 rows
/// on AVX-512 by [`norm512::rows`], elsewhere converted inside the vectorised loop (one
/// dispatch a work item); f16 ones by `widen` and `narrow` a row at a time.
pub(crate) fn normalise_rows<T: Elem>(x: &[T], y: &mut [T], norm: Norm<'_>) {
    let d = norm.weight.len().max(1);
    y.par_chunks_mut(d * super::ROWS)
        .zip(x.par_chunks(d * super::ROWS))
        .for_each(|(out, input)| {
            #[cfg(target_arch = "x86_64")]
            if simd() >= Simd::Avx512 {
                if let (Some(x), Some(y)) = (T::as_bf16(input), T::as_bf16_mut(out)) {
                    // SAFETY: the CPU runs AVX-512F, BW and VL (`simd`).
                    return unsafe { norm512::rows(x, y, &norm) };
                }
                if let (Some(x), Some(y)) = (T::as_f32(input), T::as_f32_mut(out)) {
                    // SAFETY: as above.
                    return unsafe { norm512::rows(x, y, &norm) };
                }
            }
            NORM_ROW.with_borrow_mut(|v| {
                let v = resized(v, d);
                if let (Some(x), Some(y)) = (T::as_bf16(input), T::as_bf16_mut(out)) {
                    let (widen, narrow) = (bf16_f32, f32_bf16);
                    return with_simd(NormRows {
                        x,
                        y,
                        v,
                        norm,
                        widen,
                        narrow,
                    });
                }
                if let (Some(x), Some(y)) = (T::as_f32(input), T::as_f32_mut(out)) {
                    let (widen, narrow) = (|a: f32| a, |a: f32| a);
                    return with_simd(NormRows {
                        x,
                        y,
                        v,
                        norm,
                        widen,
                        narrow,
                    });
                }
                for (out, row) in out.chunks_mut(d).zip(input.chunks(d)) {
                    T::widen(row, v);
                    with_simd(Normalise { v, norm });
                    T::narrow(v, out);
                }
            })
        });
}

/// Rows of [`normalise_rows`] stored as `S`, compiled for the widest vectors: each widened
/// into `v`, its statistics taken, and normalised into `y` as it is narrowed.
struct NormRows<'a, S, W, N> {
    x: &'a [S],
    y: &'a mut [S],
    v: &'a mut [f32],
    norm: Norm<'a>,
    widen: W,
    narrow: N,
}

impl<S: Copy, W: Fn(S) -> f32, N: Fn(f32) -> S> Vectorised for NormRows<'_, S, W, N> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let NormRows {
            x,
            y,
            v,
            norm,
            widen,
            narrow,
        } = self;
        let d = v.len();
        let w = &norm.weight[..d];
        // Indexed loops: a `zip` chain's `fold` can be compiled apart, outside the vectorised
        // path (see `ZipWith`).
        for (x, y) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            for i in 0..d {
                v[i] = widen(x[i]);
            }
            let (mean, inv) = norm.stats(v);
            match norm.bias {
                Some(b) => {
                    let b = &b[..d];
                    for i in 0..d {
                        y[i] = narrow((v[i] - mean) * inv * w[i] + b[i]);
                    }
                }
                None => {
                    for i in 0..d {
                        y[i] = narrow((v[i] - mean) * inv * w[i]);
                    }
                }
            }
        }
    }
}

/// [`NormRows`] for bf16 and f32 rows in AVX-512 intrinsics: the same operations in the same
/// order, so bit for bit the results of the compiled loops (`avx512_norms_match_the_loops`),
/// in 16 lanes and four rows at a time. The compiler built the loops' two sums as eight
/// chains of 2-lane vectors (`vmovsd` loads): a layer norm over 96 channels (56², batch 8,
/// BF16) took 600–650 µs on two Zen 5 cores, 240 µs here (455 a row at a time). Keep every
/// function that calls an intrinsic under `target_feature` (or inlined into one): `group`
/// without it, its intrinsics became calls, and the norm took 1050 µs.
#[cfg(target_arch = "x86_64")]
mod norm512 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::Norm;
    use crate::backend::cpu::elem::bf16_f32;

    /// A stored value type: 16 of them loaded as f32 lanes and stored back, under a mask.
    pub(super) trait Lanes: Copy {
        fn value(self) -> f32;
        /// # Safety
        /// AVX-512F/BW; the masked lanes of `p` are readable.
        unsafe fn load(p: *const Self, m: __mmask16) -> __m512;
        /// # Safety
        /// AVX-512F/BW; the masked lanes of `p` are writable.
        unsafe fn store(p: *mut Self, v: __m512, m: __mmask16);
    }

    impl Lanes for f32 {
        fn value(self) -> f32 {
            self
        }
        #[inline(always)]
        unsafe fn load(p: *const f32, m: __mmask16) -> __m512 {
            // SAFETY: the caller's contract.
            unsafe { _mm512_maskz_loadu_ps(m, p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512, m: __mmask16) {
            // SAFETY: the caller's contract.
            unsafe { _mm512_mask_storeu_ps(p, m, v) }
        }
    }

    impl Lanes for bf16 {
        fn value(self) -> f32 {
            bf16_f32(self)
        }
        #[inline(always)]
        unsafe fn load(p: *const bf16, m: __mmask16) -> __m512 {
            // SAFETY: the caller's contract.
            unsafe {
                let h = _mm256_maskz_loadu_epi16(m, p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
        /// Rounded as `elem::f32_bf16` rounds: ties to even, a NaN made quiet.
        #[inline(always)]
        unsafe fn store(p: *mut bf16, v: __m512, m: __mmask16) {
            // SAFETY: the caller's contract.
            unsafe {
                let x = _mm512_castps_si512(v);
                let top = _mm512_srli_epi32::<16>(x);
                let odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
                let up = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), odd);
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
                let quiet = _mm512_or_si512(top, _mm512_set1_epi32(0x40));
                let r = _mm512_mask_mov_epi32(_mm512_srli_epi32::<16>(up), nan, quiet);
                _mm512_mask_cvtepi32_storeu_epi16(p.cast(), m, r);
            }
        }
    }

    /// The 16 lanes summed as `fold_halves` sums them, plus 0 as `fold_lanes` adds them to its
    /// initial value.
    #[inline(always)]
    unsafe fn halves(a: __m512) -> f32 {
        // SAFETY: register operations only.
        unsafe {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
            let v8 = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
            let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
            let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
            0.0 + _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
        }
    }

    /// `norm` of each row of `x` into `y`, four rows at a time: each row's sums are chains
    /// of dependent additions (and its square root and division follow them), so four rows'
    /// chains side by side keep the adders busy where one row's left them waiting.
    ///
    /// # Safety
    /// The CPU runs AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn rows<S: Lanes>(x: &[S], y: &mut [S], norm: &Norm<'_>) {
        let d = norm.weight.len();
        assert!(d > 0 && x.len() == y.len() && x.len().is_multiple_of(d));
        assert!(norm.bias.is_none_or(|b| b.len() == d));
        let mut x = x.chunks_exact(d * 4);
        let mut y = y.chunks_exact_mut(d * 4);
        for (x, y) in (&mut x).zip(&mut y) {
            // SAFETY: the caller's contract; four rows of d.
            unsafe { group::<S, 4>(x, y, norm) };
        }
        let (x, y) = (x.remainder(), y.into_remainder());
        for (x, y) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            // SAFETY: as above; one row.
            unsafe { group::<S, 1>(x, y, norm) };
        }
    }

    /// R rows of d (`x`, `y`) normalised, their sums side by side.
    ///
    /// # Safety
    /// The CPU runs AVX-512F, BW and VL; `x` and `y` hold R rows of `norm.weight.len()`,
    /// `norm.bias` (if any) as many values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn group<S: Lanes, const R: usize>(x: &[S], y: &mut [S], norm: &Norm<'_>) {
        let d = norm.weight.len();
        let full = d / 16 * 16;
        let last = (1u32 << (d - full)) as u16 - 1;
        let (w, df) = (norm.weight.as_ptr(), d as f32);
        let row = |r: usize| &x[r * d..][..d];
        // SAFETY: every access is inside a row (whole vectors below `full`, the masked lanes
        // of the last) or of the weights and biases (d values).
        unsafe {
            let mut xp = [x.as_ptr(); R];
            for (r, p) in xp.iter_mut().enumerate() {
                *p = row(r).as_ptr();
            }
            let mean: [f32; R] = if norm.centre {
                let mut acc = [_mm512_setzero_ps(); R];
                for c in (0..full).step_by(16) {
                    for r in 0..R {
                        acc[r] = _mm512_add_ps(acc[r], S::load(xp[r].add(c), !0));
                    }
                }
                let mut mean = [0.0; R];
                for r in 0..R {
                    let sum = halves(acc[r]);
                    mean[r] = row(r)[full..].iter().fold(sum, |a, v| a + v.value()) / df;
                }
                mean
            } else {
                [0.0; R]
            };
            let mut m = [_mm512_setzero_ps(); R];
            for r in 0..R {
                m[r] = _mm512_set1_ps(mean[r]);
            }
            let mut acc = [_mm512_setzero_ps(); R];
            for c in (0..full).step_by(16) {
                for r in 0..R {
                    let e = _mm512_sub_ps(S::load(xp[r].add(c), !0), m[r]);
                    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(e, e));
                }
            }
            let mut inv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let sq = row(r)[full..].iter().fold(halves(acc[r]), |a, v| {
                    let e = v.value() - mean[r];
                    a + e * e
                });
                inv[r] = _mm512_set1_ps(1.0 / (sq / df + norm.eps).sqrt());
            }
            for r in 0..R {
                let yp = y[r * d..].as_mut_ptr();
                for c in (0..d).step_by(16) {
                    let mask = if c < full { !0 } else { last };
                    let e = _mm512_sub_ps(S::load(xp[r].add(c), mask), m[r]);
                    let weight = _mm512_maskz_loadu_ps(mask, w.add(c));
                    let mut v = _mm512_mul_ps(_mm512_mul_ps(e, inv[r]), weight);
                    if let Some(b) = norm.bias {
                        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b.as_ptr().add(c)));
                    }
                    S::store(yp.add(c), v, mask);
                }
            }
        }
    }
}

/// One row of a norm, in place, compiled for the widest vectors.
pub(crate) struct Normalise<'a> {
    pub v: &'a mut [f32],
    pub norm: Norm<'a>,
}

impl Vectorised for Normalise<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Normalise { v, norm } = self;
        let (mean, inv) = norm.stats(v);
        match norm.bias {
            Some(bias) => {
                for ((a, w), b) in v.iter_mut().zip(norm.weight).zip(bias) {
                    *a = (*a - mean) * inv * w + b;
                }
            }
            None => {
                for (a, w) in v.iter_mut().zip(norm.weight) {
                    *a = (*a - mean) * inv * w;
                }
            }
        }
    }
}

/// x · Φ(x) = x · (1 + erf(x/√2)) / 2, in place (the exact form, `nn.GELU()`).
pub fn gelu_inplace<T: Elem>(buf: &mut [T]) {
    super::map_f32(buf, 1, |part| super::activate(Act::Gelu, part));
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

/// Query rows per pass over a head's keys: their scores (rows × tokens, f32) are the buffer
/// that would otherwise grow with the square of the sequence. 8 × 14 (the AVX-512 SGEMM
/// tile's rows): ViT-B/16's 197 tokens in two passes.
const QUERY_ROWS: usize = 112;

/// softmax(q·kᵀ/√dh)·v for every image and head: `qkv` is (N, T, 3·D) as the input projection
/// leaves it (q, k, v side by side, heads side by side within each), `y` is (N, T, D).
///
/// Both products are GEMMs on the engines the linear layers use: per (image, head), the keys
/// are packed as B (dh × T) and the values as B (T × dh), then for each pass of query rows
/// the scores are one GEMM, the softmax runs on them in place, and the weighted values a
/// second GEMM. BF16 sessions multiply bf16 pairs where the CPU does (AMX's tiles or
/// `vdpbf16ps`: q, k and v as stored, the probabilities rounded to bf16 as PyTorch's BF16
/// attention rounds them), everything else the FP32 SGEMM. ViT-B/16's attention core at
/// batch 8 on two Zen 4 cores (`--profile`, one run each): BF16 22.2 → 6.9 ms a layer, FP32
/// 21.7 → 8.1, against the loops this replaced (4 queries × 64 keys of f32 in registers,
/// keys and values widened).
/// Its buffers are each thread's, kept between heads: allocated and freed per head, glibc
/// handed their pages back and faulted them in again every time.
pub fn attention<T: Elem>(
    qkv: &[T],
    (n, t, dim, heads): (usize, usize, usize, usize),
    y: &mut [T],
) {
    let out = SyncSlice(y.as_mut_ptr(), y.len());
    let engine = bf16_gemm::Engine::in_use();
    let pairs = T::as_bf16(qkv).is_some() && engine.is_some();
    // AMX's tiles straight (`head_on_tiles`) where a head is whole K steps of them.
    let tiles = pairs
        && engine == Some(bf16_gemm::Engine::Amx)
        && (dim / heads.max(1)).is_multiple_of(bf16_gemm::KSTEP);
    // Work items: (image, head); each writes its head's columns of its image's rows.
    (0..n * heads).into_par_iter().for_each(|item| {
        let head = Head::new((t, dim, heads), item);
        SCRATCH.with_borrow_mut(|scratch| {
            with_simd(OnHead {
                head,
                qkv,
                pairs,
                tiles,
                out: &out,
                scratch,
            })
        })
    });
}

/// Which head of which image a work item of [`attention`] is, and where its rows are.
#[derive(Clone, Copy)]
struct Head {
    /// Tokens, head size, model dimension.
    t: usize,
    dh: usize,
    dim: usize,
    /// Where token 0's q of this head starts in `qkv`, and its output in `y`.
    input: usize,
    output: usize,
}

impl Head {
    /// Work item `item` of (tokens, model dimension, heads).
    fn new((t, dim, heads): (usize, usize, usize), item: usize) -> Self {
        let (dh, image, head) = (dim / heads, item / heads, item % heads);
        Head {
            t,
            dh,
            dim,
            input: image * t * 3 * dim + head * dh,
            output: image * t * dim + head * dh,
        }
    }

    /// 1/√dh, the scores' scale.
    fn scale(self) -> f32 {
        1.0 / (self.dh as f32).sqrt()
    }

    /// Where token `tok`'s q (part 0), k (1) or v (2) of this head starts in `qkv`.
    fn at(self, part: usize, tok: usize) -> usize {
        self.input + tok * 3 * self.dim + part * self.dim
    }

    /// Where query `tok`'s output starts in `y`.
    fn out(self, tok: usize) -> usize {
        self.output + tok * self.dim
    }
}

/// A k-pair as `vdpbf16ps` reads it: `lo` in the low half.
#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | u32::from(hi.to_bits()) << 16
}

/// 16 tokens' keys as a panel of k-pairs (pair row r: each token's k[2r], k[2r + 1]), the
/// token at `first` and the next ones `stride` values apart: one gather per row. Copied one
/// pair at a time, ViT-B/16's keys took a tenth of its attention.
///
/// # Safety
/// The CPU runs AVX-512F. (Each token's `2 · rows.len() / 16` values are checked to be in
/// `qkv`: the caller sees that they are all its key's.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gather_pairs(qkv: &[bf16], first: usize, stride: usize, rows: &mut [u32]) {
    use bf16_gemm::PANEL;
    use std::arch::x86_64::*;
    let last = first + (PANEL - 1) * stride + rows.len() / PANEL * 2;
    assert!(last <= qkv.len());
    // Token j's pair r is u32 number j·stride/2 + r from the first's.
    let index = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((stride / 2) as i32),
    );
    let base = qkv[first..].as_ptr().cast::<u8>();
    for (r, row) in rows.chunks_exact_mut(PANEL).enumerate() {
        // SAFETY: every lane reads 4 bytes inside the 16 tokens' keys (asserted above).
        unsafe {
            let v = _mm512_i32gather_epi32::<4>(index, base.add(4 * r).cast());
            _mm512_storeu_si512(row.as_mut_ptr().cast(), v);
        }
    }
}

/// Never called off x86-64 (no engine multiplies bf16 pairs there).
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn gather_pairs(_: &[bf16], _: usize, _: usize, _: &mut [u32]) {
    unreachable!("bf16 pairs are multiplied on x86-64 only")
}

/// The numerators of the softmax of `row` times `scale`, in place, and the reciprocal of
/// their sum ([`softmax_numerators`]). A NaN among the scores makes its numerator and the sum
/// NaN, so every probability (issue 27), as in PyTorch.
#[inline(always)]
fn softmax_row(row: &mut [f32], scale: f32) -> f32 {
    1.0 / softmax_numerators(row, scale)
}

/// A thread's buffers for [`attention`], kept from head to head and call to call.
struct Scratch {
    keys: PackedB<f32>,
    values: PackedB<f32>,
    key_pairs: PackedPairs,
    value_pairs: PackedPairs,
    scores: Vec<f32>,
    /// A token's widened k, queries widened, outputs before narrowing.
    row: Vec<f32>,
    q: Vec<f32>,
    o: Vec<f32>,
    /// Queries and probabilities, rows padded with zeros to the packings' K.
    q_pairs: Vec<bf16>,
    probs: Vec<bf16>,
    /// On AMX's tiles ([`OnHead::on_tiles`]): the head's q, k and v rows side by side (zero
    /// rows to a whole block), its tokens' indices, the scores' bias row (−∞ on the
    /// padding), the outputs before narrowing, and [`head_on_tiles`]' own buffers.
    head_rows: Lines<bf16>,
    real: Vec<usize>,
    padding: Vec<f32>,
    tile_outs: Vec<f32>,
    on_tiles: TileScratch,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch {
        keys: PackedB::empty(),
        values: PackedB::empty(),
        key_pairs: PackedPairs::empty(),
        value_pairs: PackedPairs::empty(),
        scores: Vec::new(),
        row: Vec::new(),
        q: Vec::new(),
        o: Vec::new(),
        q_pairs: Vec::new(),
        probs: Vec::new(),
        head_rows: Lines::default(),
        real: Vec::new(),
        padding: Vec::new(),
        tile_outs: Vec::new(),
        on_tiles: TileScratch::default(),
    });
}

/// `v` as `len` values (any: the caller writes what it reads), in its own memory where it is
/// large enough. Zeroed per head, the buffers cost a tenth of the attention.
fn resized<E: Copy + Default>(v: &mut Vec<E>, len: usize) -> &mut [E] {
    v.resize(len, E::default());
    &mut v[..len]
}

/// One head of [`attention`], compiled for the widest vectors: on bf16 pairs (`vdpbf16ps`)
/// where `pairs` (BF16 sessions where the CPU multiplies them), else on the FP32 SGEMM with q,
/// k and v widened where they are not f32.
struct OnHead<'a, T> {
    head: Head,
    qkv: &'a [T],
    pairs: bool,
    /// Pairs on AMX's tiles, for heads of whole K steps ([`OnHead::on_tiles`]).
    tiles: bool,
    out: &'a SyncSlice<T>,
    scratch: &'a mut Scratch,
}

impl<T: Elem> Vectorised for OnHead<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        match T::as_bf16(self.qkv).filter(|_| self.pairs) {
            Some(qkv) if self.tiles => self.on_tiles(qkv),
            Some(qkv) => self.on_pairs(qkv),
            None => self.on_floats(),
        }
    }
}

impl<T: Elem> OnHead<'_, T> {
    #[inline(always)]
    fn on_floats(self) {
        let (head, qkv) = (self.head, self.qkv);
        let (t, dh, scale) = (head.t, head.dh, head.scale());
        let Scratch {
            keys,
            values,
            scores,
            row,
            q,
            o,
            ..
        } = self.scratch;
        let row = resized(row, dh);
        // Keys as B (dh × T): panel p, row d holds k[d] of tokens 16p..16p + 16.
        keys.refill((dh, t), |p, panel| {
            for j in 0..NR.min(t - p * NR) {
                T::widen(&qkv[head.at(1, p * NR + j)..][..dh], row);
                for (d, v) in row.iter().enumerate() {
                    panel[d * NR + j] = *v;
                }
            }
        });
        // Values as B (T × dh): panel p, row k holds v[16p..16p + 16] of token k.
        values.refill((t, dh), |p, panel| {
            let width = NR.min(dh - p * NR);
            for (k, dst) in panel.chunks_mut(NR).enumerate() {
                T::widen(&qkv[head.at(2, k) + p * NR..][..width], &mut dst[..width]);
            }
        });
        let (keys, values) = (keys.view(), values.view());
        let (ld, most) = (t.next_multiple_of(NR), QUERY_ROWS.min(t));
        let scores = resized(scores, most * ld);
        let (q, o) = (resized(q, most * dh), resized(o, most * dh));
        let (f32_in, f32_out) = (T::as_f32(qkv), T::as_f32(&[T::default()]).is_some());
        for q0 in (0..t).step_by(QUERY_ROWS) {
            let rows = QUERY_ROWS.min(t - q0);
            let (a, lda) = match f32_in {
                Some(qkv) => (
                    qkv[head.at(0, q0)..].as_ptr(),
                    head.at(0, 1) - head.at(0, 0),
                ),
                None => {
                    for (r, dst) in q.chunks_mut(dh).take(rows).enumerate() {
                        T::widen(&qkv[head.at(0, q0 + r)..][..dh], dst);
                    }
                    (q.as_ptr(), dh)
                }
            };
            // SAFETY: `a` has `rows` rows of dh = keys.k values `lda` apart (q's of this head,
            // in place or widened), `scores` rows × ld ≥ T floats.
            unsafe {
                sgemm::gemm(
                    rows,
                    a,
                    lda,
                    &keys,
                    (0, keys.panels()),
                    scores.as_mut_ptr(),
                    ld,
                )
            };
            // The padding's scores −∞, so the softmax runs on whole vectors.
            for row in scores.chunks_mut(ld).take(rows) {
                row[t..].fill(f32::NEG_INFINITY);
                let inv = softmax_row(row, scale);
                row.iter_mut().for_each(|v| *v *= inv);
            }
            // Straight into this head's columns of y where it is f32 (ld = D), else via `o`.
            let (c, ldc) = if f32_out {
                (
                    self.out.ptr(head.out(q0)).cast::<f32>(),
                    head.out(1) - head.out(0),
                )
            } else {
                (o.as_mut_ptr(), dh)
            };
            // SAFETY: the probabilities are `rows` rows of T = values.k floats, `ld` apart; C
            // is `rows` rows of dh floats: `o`, or this head's columns of y, which no other
            // work item writes (the SGEMM stores only columns below N = dh).
            unsafe {
                sgemm::gemm(
                    rows,
                    scores.as_ptr(),
                    ld,
                    &values,
                    (0, values.panels()),
                    c,
                    ldc,
                )
            };
            if !f32_out {
                for (r, src) in o.chunks(dh).take(rows).enumerate() {
                    // SAFETY: this work item alone writes this head's columns of its rows.
                    T::narrow(src, unsafe { self.out.slice(head.out(q0 + r), dh) });
                }
            }
        }
    }

    /// The head on AMX's tiles by [`head_on_tiles`], as a window's heads go: its q, k and v
    /// copied side by side onto cache lines (zero rows past the tokens, so that the padding's
    /// keys and values are zeros and its rows of q can be read), every token a query, the
    /// padding's scores −∞. Through `bf16_gemm::gemm` instead, in passes of 112 queries, each
    /// product configured the tiles and copied the pass's last rows to a whole block, and
    /// the softmax and the packing of the values ran a value at a time: ViT-B/16 BF16 at batch
    /// 8 on an Emerald Rapids Xeon spent 18.7% of its compiled step in attention at ~120
    /// GFLOP/s, against ~335 for its linear layers.
    #[inline(always)]
    fn on_tiles(self, qkv: &[bf16]) {
        let head = self.head;
        let (t, dh) = (head.t, head.dh);
        let kp = t.next_multiple_of(bf16_gemm::BLOCK_ROWS);
        let Scratch {
            head_rows,
            real,
            padding,
            tile_outs,
            on_tiles,
            ..
        } = self.scratch;
        head_rows.reuse(kp * 3 * dh);
        let (rows, zeros) = head_rows.split_at_mut(t * 3 * dh);
        for (j, row) in rows.chunks_exact_mut(3 * dh).enumerate() {
            for (part, dst) in row.chunks_exact_mut(dh).enumerate() {
                dst.copy_from_slice(&qkv[head.at(part, j)..][..dh]);
            }
        }
        zeros.fill(bf16::ZERO);
        if real.len() != t {
            real.clear();
            real.extend(0..t);
        }
        let padding = resized(padding, kp);
        padding[..t].fill(0.0);
        padding[t..].fill(f32::NEG_INFINITY);
        let outs = resized(tile_outs, t * dh);
        let pair_head = PairHead {
            tokens: head_rows,
            keys: t,
            real,
            region: None,
            bias: ScoreBias::Row(padding),
            scale: head.scale(),
            at: (dh, 0, dh),
        };
        // SAFETY: `tiles` only where the CPU runs AMX (and so AVX512_BF16) and heads are of
        // whole K steps (`attention`); configured here, released after the head; `head_rows`
        // has kp rows, zeros past the tokens.
        unsafe {
            amx::configure();
            head_on_tiles(&pair_head, on_tiles, outs);
            amx::release();
        }
        for (i, src) in outs.chunks_exact(dh).enumerate() {
            // SAFETY: this work item alone writes this head's columns of its rows.
            T::narrow(src, unsafe { self.out.slice(head.out(i), dh) });
        }
    }

    #[inline(always)]
    fn on_pairs(self, qkv: &[bf16]) {
        use bf16_gemm::{DOT_KSTEP, Done, Engine, PANEL};
        debug_assert!(PANEL.is_multiple_of(DOT_KSTEP));
        let head = self.head;
        let (t, dh, scale) = (head.t, head.dh, head.scale());
        let Scratch {
            key_pairs: keys,
            value_pairs: values,
            scores,
            q_pairs: q,
            probs,
            ..
        } = self.scratch;
        // The tiles where the CPU has them (heads of whole K steps go to `on_tiles` there, so
        // here only other head sizes): ViT-B/16 BF16 at batch 8 on 2 Sapphire Rapids cores,
        // 20 steps alternating in one process, spent 0.64× the time in attention with both
        // products on AMX rather than `vdpbf16ps` (the step 0.89×).
        let engine = Engine::in_use().unwrap_or(Engine::Dot);
        // Keys as B (dh × T): panel p, pair row r holds k[2r], k[2r + 1] of tokens 16p.. —
        // one 32-bit copy of each token's pair.
        let step = engine.k_step();
        keys.refill((dh, t), step, |p, panel| {
            let rows: &mut [u32] = bytemuck::cast_slice_mut(panel);
            let tokens = PANEL.min(t - p * PANEL);
            // The gather fills every pair row of the panel: only where K needs no padding.
            if tokens == PANEL && dh.is_multiple_of(step) {
                // SAFETY: `Engine::in_use` is some (checked by `attention`), so the CPU runs
                // AVX-512F; the panel's 16 tokens have dh values each from `head.at(1, ..)`.
                unsafe { gather_pairs(qkv, head.at(1, p * PANEL), 3 * head.dim, rows) };
                return;
            }
            for j in 0..tokens {
                let k = &qkv[head.at(1, p * PANEL + j)..][..dh];
                for (r, two) in k.chunks(2).enumerate() {
                    rows[r * PANEL + j] = pair(two[0], *two.get(1).unwrap_or(&bf16::ZERO));
                }
            }
        });
        // Values as B (T × dh): panel p, pair row r interleaves v[16p..16p + 16] of tokens 2r
        // and 2r + 1 (an odd last token with the padding's zeros).
        values.refill((t, dh), PANEL.max(engine.k_step()), |p, panel| {
            let width = PANEL.min(dh - p * PANEL);
            let value = |k: usize| &qkv[head.at(2, k) + p * PANEL..][..width];
            let rows: &mut [u32] = bytemuck::cast_slice_mut(panel);
            for (r, row) in rows.chunks_exact_mut(PANEL).take(t.div_ceil(2)).enumerate() {
                let even = value(2 * r);
                if 2 * r + 1 < t {
                    let odd = value(2 * r + 1);
                    for ((d, e), o) in row.iter_mut().zip(even).zip(odd) {
                        *d = pair(*e, *o);
                    }
                } else {
                    for (d, e) in row.iter_mut().zip(even) {
                        *d = pair(*e, bf16::ZERO);
                    }
                }
            }
        });
        // A's rows padded with zeros to the packings' K: q to dh's, the probabilities to T's
        // (whole vectors: the values are packed for a K step of 16, and the scores' padding
        // is −∞, whose probability is 0).
        let (kq, ld) = (keys.kp(), values.kp());
        let most = QUERY_ROWS.min(t);
        let q = resized(q, most * kq);
        let scores = resized(scores, most * ld);
        let probs = resized(probs, most * ld);
        for q0 in (0..t).step_by(QUERY_ROWS) {
            let rows = QUERY_ROWS.min(t - q0);
            for (r, dst) in q.chunks_mut(kq).take(rows).enumerate() {
                dst[..dh].copy_from_slice(&qkv[head.at(0, q0 + r)..][..dh]);
                dst[dh..].fill(bf16::ZERO);
            }
            for row in scores.chunks_mut(ld).take(rows) {
                row[t..].fill(f32::NEG_INFINITY);
            }
            let mut keep = |d: Done<'_>| {
                // SAFETY: the CPU runs AVX512_BF16 (below), so it has AVX-512F.
                unsafe { d.write_into(scores, ld, false) }
            };
            // SAFETY: `Engine::in_use` is some (checked by `attention`), so the CPU runs
            // AVX512_BF16; q has `rows` rows of kq values, zeros past dh.
            unsafe {
                let panels = (0, keys.panels());
                bf16_gemm::gemm(engine, rows, q.as_ptr(), kq, keys, panels, None, &mut keep)
            };
            for (row, dst) in scores.chunks_mut(ld).zip(probs.chunks_mut(ld)).take(rows) {
                let inv = softmax_row(row, scale);
                for (d, v) in dst.iter_mut().zip(&*row) {
                    *d = f32_bf16(v * inv);
                }
            }
            let mut store = |d: Done<'_>| {
                let col = d.col;
                for (i, v) in d.rows() {
                    let at = head.out(q0 + i) + col;
                    // SAFETY: this work item alone writes this head's columns of its rows.
                    let dst = unsafe { self.out.slice(at, v.len()) };
                    dst.iter_mut()
                        .zip(v)
                        .for_each(|(d, v)| *d = T::from_f32(*v));
                }
            };
            // SAFETY: as above; the probabilities' rows have ld values, zeros past T.
            unsafe {
                let panels = (0, values.panels());
                bf16_gemm::gemm(
                    engine,
                    rows,
                    probs.as_ptr(),
                    ld,
                    values,
                    panels,
                    None,
                    &mut store,
                )
            };
        }
    }
}

/// Keys [`window_attention`] scores together, 64 accumulators (4 AVX-512 vectors) a query; its
/// keys are zero-padded to a multiple of it.
const BLOCK: usize = 64;

/// Queries [`window_attention`] scores and weighs together, sharing each key's and value's
/// loads: 4 × 64 score accumulators, or 4 × 32 output ones, fill 16 or 8 zmm registers.
const QUERIES: usize = 4;

/// A window attention's relative position bias as its score loop adds it: (head, query, key)
/// for the window's tokens, each query's row padded with −∞ to whole blocks of `BLOCK` keys
/// (so that the padding's probabilities are 0), gathered once from the table (a table row a
/// (query, key) pair, a column a head) when the session is prepared. Gathered per window and
/// head instead, the pair's table row (four integer divisions) cost more than the scores'
/// products: Swin-T's attention took 47% of a BF16 step at batch 8.
pub struct WindowBias {
    values: Vec<f32>,
    keys: usize,
}

impl WindowBias {
    pub fn new(params: &WindowParams, attention: &crate::model::op::WindowAttention) -> Self {
        let (ws, heads) = (attention.window, attention.heads);
        let keys = ws * ws;
        let kp = keys.next_multiple_of(BLOCK);
        // bias_row reads the window's side only: any grid of this window will do.
        let grid = WindowGrid::new(ws, ws, ws, 0);
        let mut values = vec![f32::NEG_INFINITY; heads * keys * kp];
        for (hi, row) in values.chunks_mut(kp).enumerate() {
            let (h, i) = (hi / keys, hi % keys);
            for (j, v) in row[..keys].iter_mut().enumerate() {
                *v = params.table[grid.bias_row(i, j) * heads + h];
            }
        }
        WindowBias { values, keys }
    }

    pub fn bytes(&self) -> u64 {
        self.values.len() as u64 * 4
    }

    /// Head h's biases of query i, a value a key, then −∞ to the block.
    fn row(&self, h: usize, i: usize) -> &[f32] {
        let kp = self.keys.next_multiple_of(BLOCK);
        &self.values[(h * self.keys + i) * kp..][..kp]
    }
}

/// Swin's shifted window attention core: `qkv` is (N, H, W, 3·C) as the q/k/v projection
/// leaves it, `y` (N, H, W, C). One work item per (image, window): it gathers the window's
/// tokens (a padded one holds the projection's bias), and for each real query and head adds
/// the relative position bias and the shift mask to the scaled scores before the softmax.
pub fn window_attention<T: Elem>(
    qkv: &[T],
    (params, bias): (&WindowParams, &WindowBias),
    grid: WindowGrid,
    (n, dim, heads): (usize, usize, usize),
    y: &mut [T],
) {
    let out = SyncSlice(y.as_mut_ptr(), y.len());
    let ws = grid.window;
    assert_eq!(
        bias.keys,
        ws * ws,
        "window attention: a bias of another window"
    );
    let windows = (grid.hp / ws) * (grid.wp / ws);
    let (engine, dh) = (bf16_gemm::Engine::in_use(), dim / heads.max(1));
    let pairs = T::as_bf16(qkv).is_some() && engine.is_some() && dh.is_multiple_of(2);
    // AMX's tiles where the CPU has them and a head is whole K steps of them.
    let tiles =
        pairs && engine == Some(bf16_gemm::Engine::Amx) && dh.is_multiple_of(bf16_gemm::KSTEP);
    (0..n * windows).into_par_iter().for_each(|item| {
        let mut scratch = WINDOW_SCRATCH.take();
        with_simd(Window {
            qkv,
            params: (params, bias),
            grid,
            dims: (dim, heads),
            item,
            pairs,
            tiles,
            out: &out,
            scratch: &mut scratch,
        });
        WINDOW_SCRATCH.set(scratch);
    });
}

/// A thread's buffers for [`Window`], kept from window to window.
#[derive(Default)]
struct WindowScratch {
    /// The window's tokens' q, k, v rows.
    tokens: Vec<f32>,
    /// A head's keys transposed, its values padded to whole vectors, its queries scaled.
    kt: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
    /// [`QUERIES`] rows of scores, then probabilities.
    scores: Vec<f32>,
    outs: Vec<f32>,
    /// On bf16 pairs ([`head_on_pairs`]): the tokens' rows rounded to bf16 (zero rows to
    /// whole blocks of keys), the keys and values as pair rows, the numerators' pairs.
    token_pairs: Lines<bf16>,
    key_pairs: Vec<u32>,
    value_pairs: Vec<u32>,
    prob_pairs: Vec<u32>,
    /// On AMX's tiles ([`head_on_tiles`]).
    on_tiles: TileScratch,
    /// Each token's input pixel (none in the padding) and mask region (past the keys too:
    /// their bias is −∞ anyway); the tokens that are pixels.
    pixel: Vec<Option<usize>>,
    region: Vec<f32>,
    real: Vec<usize>,
}

thread_local! {
    static WINDOW_SCRATCH: std::cell::Cell<WindowScratch> = std::cell::Cell::default();
}

/// One (image, window) of [`window_attention`], compiled for the widest vectors: per head the
/// keys transposed (dh × keys, zero-padded to whole blocks) so that [`QUERIES`] queries'
/// scores are 64-lane products sharing each key's loads, then each one's bias, mask and
/// softmax, and the queries' weighted values, again sharing each value's loads.
struct Window<'a, T> {
    qkv: &'a [T],
    params: (&'a WindowParams, &'a WindowBias),
    grid: WindowGrid,
    /// (channels, heads).
    dims: (usize, usize),
    item: usize,
    /// Multiply bf16 pairs ([`head_on_pairs`]): BF16 sessions on CPUs that have `vdpbf16ps`;
    /// on AMX's tiles ([`head_on_tiles`]) where `tiles`.
    pairs: bool,
    tiles: bool,
    out: &'a SyncSlice<T>,
    scratch: &'a mut WindowScratch,
}

impl<T: Elem> Vectorised for Window<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (grid, (params, bias)) = (self.grid, self.params);
        let (dim, heads) = self.dims;
        let ws = grid.window;
        let (across, down, keys) = (grid.wp / ws, grid.hp / ws, ws * ws);
        let img = self.item / (down * across);
        let (wy, wx) = ((self.item / across) % down * ws, self.item % across * ws);
        let dh = dim / heads.max(1);
        let (kp, dhp) = (keys.next_multiple_of(BLOCK), dh.next_multiple_of(16));
        let WindowScratch {
            tokens,
            kt,
            values,
            queries,
            scores,
            outs,
            pixel,
            region,
            real,
            token_pairs,
            key_pairs,
            value_pairs,
            prob_pairs,
            on_tiles,
        } = self.scratch;
        // The window's tokens: q, k, v rows (V2: q and k of each head normalised).
        let t = resized(tokens, keys * 3 * dim);
        let pixel = resized(pixel, keys);
        pixel.fill(None);
        let region = resized(region, kp);
        // On pairs, rows as stored go straight to the bf16 rows (V2's are normalised in f32
        // first).
        let mut tb = self.pairs.then(|| {
            token_pairs.reuse(kp * 3 * dim);
            &mut token_pairs[..]
        });
        let stored = T::as_bf16(self.qkv).filter(|_| tb.is_some() && !params.cosine);
        for (i, row) in t.chunks_mut(3 * dim).enumerate() {
            let (yy, xx) = (wy + i / ws, wx + i % ws);
            region[i] = grid.region(yy, xx) as f32;
            let (y, x) = grid.source(yy, xx);
            let inside = (y < grid.h && x < grid.w).then(|| (img * grid.h + y) * grid.w + x);
            pixel[i] = inside;
            if let (Some(qkv), Some(tb)) = (stored, tb.as_deref_mut()) {
                let dst = &mut tb[i * 3 * dim..(i + 1) * 3 * dim];
                match inside {
                    Some(p) => dst.copy_from_slice(&qkv[p * 3 * dim..(p + 1) * 3 * dim]),
                    None => bf16::narrow(&params.qkv_bias, dst),
                }
                continue;
            }
            match inside {
                Some(p) => T::widen(&self.qkv[p * 3 * dim..(p + 1) * 3 * dim], row),
                None => row.copy_from_slice(&params.qkv_bias),
            }
            if params.cosine {
                // F.normalize, ε = 1e-12.
                for head in row[..2 * dim].chunks_mut(dh) {
                    let norm = head.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                    head.iter_mut().for_each(|v| *v /= norm);
                }
            }
        }
        let region = &*region;
        // Only windows on a shifted grid's last row or column mix regions.
        let mixed = region[..keys].iter().any(|&r| r != region[0]);
        real.clear();
        real.extend((0..keys).filter(|&i| pixel[i].is_some()));
        let outs = resized(outs, keys * dim);
        let scores = resized(scores, QUERIES * kp);
        let rounded = tb.map(|tb| {
            let (rows, padding) = tb.split_at_mut(keys * 3 * dim);
            if stored.is_none() {
                bf16::narrow(t, rows);
            }
            padding.fill(bf16::ZERO);
            &*tb
        });
        // (`tiles` is set only with `pairs`, which always makes `rounded` some.)
        let mut tiles = self.tiles.then_some(on_tiles);
        if tiles.is_some() {
            // SAFETY: `tiles` only where the CPU runs AMX (`window_attention`).
            unsafe { amx::configure() };
        }
        for h in 0..heads {
            if let Some(tokens) = rounded {
                let head = PairHead {
                    tokens,
                    keys,
                    real,
                    region: mixed.then_some(region),
                    bias: ScoreBias::Table(bias, h),
                    scale: params.scales[h],
                    at: (dim, h * dh, dh),
                };
                if let Some(tiles) = tiles.as_deref_mut() {
                    // SAFETY: the tiles are configured above, on a CPU that runs AMX and
                    // AVX512_BF16, for heads of whole K steps (`window_attention`).
                    unsafe { head_on_tiles(&head, tiles, outs) };
                    continue;
                }
                let buffers = (&mut *key_pairs, &mut *value_pairs, &mut *prob_pairs);
                // SAFETY: `pairs` only where the CPU runs AVX512_BF16 and heads are of an even
                // size (`window_attention`).
                unsafe { head_on_pairs(&head, buffers, scores, outs) };
                continue;
            }
            let kt = resized(kt, dh * kp);
            kt.fill(0.0);
            let vs = resized(values, keys * dhp);
            let qs = resized(queries, keys * dh);
            let scale = params.scales[h];
            for (j, row) in t.chunks(3 * dim).enumerate() {
                for (d, k) in row[dim + h * dh..][..dh].iter().enumerate() {
                    kt[d * kp + j] = *k;
                }
                let v = &mut vs[j * dhp..][..dhp];
                v[..dh].copy_from_slice(&row[2 * dim + h * dh..][..dh]);
                v[dh..].fill(0.0);
                let q = &mut qs[j * dh..][..dh];
                for (q, x) in q.iter_mut().zip(&row[h * dh..][..dh]) {
                    *q = x * scale;
                }
            }
            for group in real.chunks(QUERIES) {
                // A last group of fewer queries repeats its last one (its rows unread).
                let at: [usize; QUERIES] = std::array::from_fn(|r| group[r.min(group.len() - 1)]);
                score(at.map(|i| &qs[i * dh..][..dh]), kt, kp, scores);
                let mut inv = [0f32; QUERIES];
                for (r, &i) in group.iter().enumerate() {
                    let s = &mut scores[r * kp..][..kp];
                    let region = mixed.then_some((region, region[i]));
                    inv[r] = 1.0 / softmax_numerators_biased(s, bias.row(h, i), region);
                }
                let probs: [&[f32]; QUERIES] =
                    std::array::from_fn(|r| &scores[r.min(group.len() - 1) * kp..][..keys]);
                let mut o: [[f32; 32]; QUERIES] = [[0.0; 32]; QUERIES];
                for c in (0..dh).step_by(32) {
                    match dhp - c {
                        16 => weigh::<16>(&probs, vs, (dhp, c), &mut o),
                        _ => weigh::<32>(&probs, vs, (dhp, c), &mut o),
                    }
                    for ((o, &i), inv) in o.iter().zip(group).zip(inv) {
                        let n = (dh - c).min(32);
                        let dst = &mut outs[i * dim + h * dh + c..][..n];
                        dst.iter_mut().zip(o).for_each(|(d, o)| *d = o * inv);
                    }
                }
            }
        }
        if tiles.is_some() {
            // SAFETY: as for `configure` above.
            unsafe { amx::release() };
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

/// Each score of `s` (a row of a multiple of 16 keys) plus its `bias` and, where `region` has
/// them (every key's and the query's), the shift mask's −100 between regions, raised to e^(s −
/// max) in place; their sum: one pass for the bias, the mask and the maximum, one for the
/// exponentials and their sum, in 16 lanes (the padding's −∞ bias makes its keys' numerators
/// 0), the lanes reduced at the end by [`fold_halves`]: as one array folded in place (or
/// through `softmax_numerators`), each reduction went through the stack a value at a time, the
/// softmax took 40% of the kernel (timed by leaving each part out), and the kernel 1.3× its
/// time now. (The group's rows in step, to overlap their chains, took 1.1–1.25×: the compiler
/// kept their lanes on the stack.)
#[inline(always)]
fn softmax_numerators_biased(s: &mut [f32], bias: &[f32], region: Option<(&[f32], f32)>) -> f32 {
    let mut most = [f32::NEG_INFINITY; 16];
    for (j, (s, b)) in s
        .chunks_exact_mut(16)
        .zip(bias.chunks_exact(16))
        .enumerate()
    {
        for l in 0..16 {
            s[l] += b[l];
        }
        if let Some((region, ri)) = region {
            let r = &region[j * 16..][..16];
            for l in 0..16 {
                s[l] += if r[l] == ri { 0.0 } else { -100.0 };
            }
        }
        for l in 0..16 {
            most[l] = if s[l] > most[l] { s[l] } else { most[l] };
        }
    }
    let max = fold_halves(most, |a, b| if b > a { b } else { a });
    let mut sum = [0f32; 16];
    for s in s.chunks_exact_mut(16) {
        for l in 0..16 {
            s[l] = super::exp_nonpositive(s[l] - max);
            sum[l] += s[l];
        }
    }
    fold_halves(sum, |a, b| a + b)
}

/// The scores of [`QUERIES`] queries (`q`, scaled) against every key (`kt`: dh rows of `kp`
/// keys), into `out`'s rows of `kp`.
#[inline(always)]
fn score(q: [&[f32]; QUERIES], kt: &[f32], kp: usize, out: &mut [f32]) {
    for kb in (0..kp).step_by(BLOCK) {
        let mut acc = [[0f32; BLOCK]; QUERIES];
        for d in 0..q[0].len() {
            let k: &[f32; BLOCK] = kt[d * kp + kb..][..BLOCK].try_into().unwrap();
            for (acc, q) in acc.iter_mut().zip(&q) {
                let qd = q[d];
                for l in 0..BLOCK {
                    acc[l] = qd.mul_add(k[l], acc[l]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[r * kp + kb..][..BLOCK].copy_from_slice(acc);
        }
    }
}

/// Columns c..c + W of [`QUERIES`] queries' outputs: their probabilities (`p`, a value a key)
/// times the values (`v`: a row of `dhp` a key, zero-padded), into `o`'s first W columns.
#[inline(always)]
fn weigh<const W: usize>(
    p: &[&[f32]; QUERIES],
    v: &[f32],
    (dhp, c): (usize, usize),
    o: &mut [[f32; 32]; QUERIES],
) {
    let mut acc = [[0f32; W]; QUERIES];
    for j in 0..p[0].len() {
        let v: &[f32; W] = v[j * dhp + c..][..W].try_into().unwrap();
        for (acc, p) in acc.iter_mut().zip(p) {
            let w = p[j];
            for l in 0..W {
                acc[l] = w.mul_add(v[l], acc[l]);
            }
        }
    }
    for (o, acc) in o.iter_mut().zip(&acc) {
        o[..W].copy_from_slice(acc);
    }
}

/// What [`head_on_pairs`] reads of one head of a window.
struct PairHead<'a> {
    /// The window's tokens' rows of q, k and v (rounded to bf16, then zero rows to a whole
    /// [`BLOCK`] of keys), how many are tokens, the ones that are queries, and each token's
    /// mask region where the window mixes regions.
    tokens: &'a [bf16],
    keys: usize,
    real: &'a [usize],
    region: Option<&'a [f32]>,
    /// What each query adds to its scores.
    bias: ScoreBias<'a>,
    scale: f32,
    /// (channels, the head's first column, its width: even).
    at: (usize, usize, usize),
}

/// What a [`PairHead`]'s queries add to their scores before the softmax: a window's relative
/// position bias (the table, and which head this is), or one row for every query (a vision
/// transformer's: zeros for its tokens, −∞ for the padding to whole blocks of keys).
#[derive(Clone, Copy)]
enum ScoreBias<'a> {
    Table(&'a WindowBias, usize),
    Row(&'a [f32]),
}

impl ScoreBias<'_> {
    /// Query i's bias over the padded keys.
    fn row(&self, i: usize) -> &[f32] {
        match *self {
            ScoreBias::Table(table, h) => table.row(h, i),
            ScoreBias::Row(row) => row,
        }
    }
}

/// One head of a window on bf16 pairs (`vdpbf16ps`, two products a lane), the arithmetic of
/// [`Window`]'s in f32 otherwise: the keys as pair rows (row r: every key's k[2r], k[2r + 1],
/// gathered 16 keys at a time), the values as pairs of keys (row r: keys 2r and 2r + 1
/// interleaved column by column), each query's pairs read where they are; the scores scaled
/// in f32 (so that q stays as stored), and the softmax's numerators rounded to bf16 for the
/// second product, as PyTorch's BF16 attention rounds its probabilities. The outputs (f32,
/// normalised) go to `outs`, the window's rows of every head.
///
/// # Safety
/// The CPU runs AVX-512F, AVX-512BW and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
unsafe fn head_on_pairs(
    head: &PairHead<'_>,
    (kt, vs, ps): (&mut Vec<u32>, &mut Vec<u32>, &mut Vec<u32>),
    scores: &mut [f32],
    outs: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (dim, first, dh) = head.at;
    let keys = head.keys;
    let (kp, dp, dhp) = (
        keys.next_multiple_of(BLOCK),
        dh / 2,
        dh.next_multiple_of(16),
    );
    // Every row's pairs: row j's part p starts at pair j·(3·dim/2) + p·dim/2.
    let pairs: &[u32] = bytemuck::cast_slice(head.tokens);
    let (stride, k_at, v_at) = (3 * dim / 2, (dim + first) / 2, 2 * dim + first);
    assert!(dh.is_multiple_of(2) && pairs.len() >= kp * stride && scores.len() >= QUERIES * kp);
    let kt = resized(kt, dp * kp);
    let index = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(stride as i32),
    );
    for jb in (0..kp).step_by(16) {
        for r in 0..dp {
            // SAFETY: keys jb..jb + 16 are rows of `tokens` (kp of them, asserted), and pair r
            // of their k is inside each row.
            unsafe {
                let base = pairs.as_ptr().add(jb * stride + k_at + r);
                let v = _mm512_i32gather_epi32::<4>(index, base.cast());
                _mm512_storeu_si512(kt.as_mut_ptr().add(r * kp + jb).cast(), v);
            }
        }
    }
    // Keys 2r and 2r + 1's values, 32 columns at a time, interleaved into 32 pairs.
    let vs = resized(vs, keys.div_ceil(2) * dhp);
    for (r, row) in vs.chunks_exact_mut(dhp).enumerate() {
        for c in (0..dhp).step_by(32) {
            let mask = u32::MAX
                .checked_shr((c + 32).saturating_sub(dh) as u32)
                .unwrap_or(0);
            // SAFETY: the masked loads read columns c.. below dh of rows 2r and 2r + 1 (< kp),
            // the stores columns c..c + 32 of `row` where it has them (dhp a multiple of 16).
            unsafe {
                let at = |j: usize| head.tokens.as_ptr().add(j * 3 * dim + v_at + c);
                let even = _mm512_maskz_loadu_epi16(mask, at(2 * r).cast());
                let odd = _mm512_maskz_loadu_epi16(mask, at(2 * r + 1).cast());
                let dst = row.as_mut_ptr().add(c);
                let (low, high) = zip_tokens(even, odd);
                _mm512_storeu_si512(dst.cast(), low);
                if c + 16 < dhp {
                    _mm512_storeu_si512(dst.add(16).cast(), high);
                }
            }
        }
    }
    let ps = resized(ps, QUERIES * kp / 2);
    let query = |i: usize| &pairs[i * stride + first / 2..][..dp];
    for group in head.real.chunks(QUERIES) {
        // A last group of fewer queries repeats its last one (its rows unread).
        let q: [&[u32]; QUERIES] = std::array::from_fn(|r| query(group[r.min(group.len() - 1)]));
        for kb in (0..kp).step_by(BLOCK) {
            // SAFETY: the caller's contract.
            unsafe { pair_products::<{ BLOCK / 16 }>(q, kt, (kp, kb), &mut scores[kb..], kp) };
        }
        let mut inv = [0f32; QUERIES];
        for (r, &i) in group.iter().enumerate() {
            let s = &mut scores[r * kp..][..kp];
            let region = head.region.map(|region| (region, region[i]));
            let p = &mut ps[r * kp / 2..][..kp / 2];
            // SAFETY: the caller's contract.
            inv[r] = 1.0 / unsafe { softmax_pairs(s, head.scale, head.bias.row(i), region, p) };
        }
        let p: [&[u32]; QUERIES] =
            std::array::from_fn(|r| &ps[r.min(group.len() - 1) * kp / 2..][..keys.div_ceil(2)]);
        for c in (0..dh).step_by(32) {
            let mut o = [[0f32; 32]; QUERIES];
            // SAFETY: the caller's contract.
            unsafe {
                let o = o.as_flattened_mut();
                match dhp - c {
                    16 => pair_products::<1>(p, vs, (dhp, c), o, 32),
                    _ => pair_products::<2>(p, vs, (dhp, c), o, 32),
                }
            }
            for ((o, &i), inv) in o.iter().zip(group).zip(inv) {
                let n = (dh - c).min(32);
                let dst = &mut outs[i * dim + first + c..][..n];
                dst.iter_mut().zip(o).for_each(|(d, o)| *d = o * inv);
            }
        }
    }
}

/// Never called off x86-64 (no CPU there multiplies bf16 pairs).
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn head_on_pairs(
    _: &PairHead<'_>,
    _: (&mut Vec<u32>, &mut Vec<u32>, &mut Vec<u32>),
    _: &mut [f32],
    _: &mut [f32],
) {
    unreachable!("bf16 pairs are multiplied on x86-64 only")
}

/// A head's buffers for [`head_on_tiles`], on cache lines (where AMX's tiles load and store
/// rows fastest): its keys and values packed for the tiles, and one 32-row block of queries'
/// scores, the softmax's numerators as bf16 (rows of the keys padded to whole blocks), the
/// outputs before normalising, and each query's 1 / sum.
#[derive(Default)]
struct TileScratch {
    keys: PackedPairs,
    values: PackedPairs,
    scores: Lines<f32>,
    probs: Lines<u32>,
    outs: Lines<f32>,
    inv: Vec<f32>,
}

/// One head on AMX's tiles, as [`head_on_pairs`] computes a window's on `vdpbf16ps`: per
/// block of 32 queries (q read in place from `tokens`), their scores by every key (the
/// padding's zero rows too, so every score is written), the softmax's numerators rounded to
/// bf16 ([`softmax_pairs`]), their products with the values, and the sums normalised into
/// `outs`. A block at a time, its scores (32 × the keys) stay in L1 between the three steps:
/// a ViT's 197 tokens would make the whole head's 200 KiB. An Emerald Rapids core issues
/// `vdpbf16ps` at half the rate of its FMAs, and there the pairs spent 18% of Swin-T's BF16
/// step (batch 8) in their products.
///
/// # Safety
/// The CPU runs AMX, AVX-512F, BW and AVX512_BF16, the tile configuration is loaded
/// ([`amx::configure`]), the head's size is a multiple of AMX's K step, and `tokens` has
/// rows up to the keys' count rounded up to a whole block (zeros past the keys).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
unsafe fn head_on_tiles(head: &PairHead<'_>, tiles: &mut TileScratch, outs: &mut [f32]) {
    use bf16_gemm::{BLOCK_ROWS, KSTEP, PANEL};
    let (dim, first, dh) = head.at;
    let (tokens, keys, stride) = (head.tokens, head.keys, 3 * dim);
    // Keys (two panels a tile pair) and query rows both to whole blocks of 32.
    let kp = keys.next_multiple_of(BLOCK_ROWS);
    assert!(dh.is_multiple_of(KSTEP) && tokens.len() >= kp * stride && outs.len() >= keys * dim);
    // Keys as B (dh × kp): panel p's pair row r holds k[2r], k[2r + 1] of tokens 16p.. .
    tiles.keys.repack((dh, kp), KSTEP, |p, panel| {
        let rows = bytemuck::cast_slice_mut(panel);
        // SAFETY: the caller's contract (AVX-512F); tokens 16p.. are rows of `tokens` (kp).
        unsafe { gather_pairs(tokens, p * PANEL * stride + dim + first, stride, rows) };
    });
    // Values as B (keys × dh, K padded to the step with the padding's zero rows): panel p's
    // pair row r interleaves v[16p..16p + 16] of tokens 2r and 2r + 1.
    tiles.values.repack((keys, dh), KSTEP, |p, panel| {
        let rows = bytemuck::cast_slice_mut(panel);
        // SAFETY: as above; K padded to the step is kp tokens.
        unsafe { interleave_tokens(tokens, 2 * dim + first + p * PANEL, stride, rows) };
    });
    let (keys_b, values_b) = (&tiles.keys, &tiles.values);
    tiles.scores.reuse(BLOCK_ROWS * kp);
    tiles.probs.reuse(BLOCK_ROWS * kp / 2);
    tiles.outs.reuse(BLOCK_ROWS * dh);
    let inv = resized(&mut tiles.inv, BLOCK_ROWS);
    let (scores, o) = (tiles.scores.as_mut_ptr(), tiles.outs.as_mut_ptr());
    let mut real = head.real;
    for rb in (0..kp).step_by(BLOCK_ROWS) {
        // The block's queries (`real` is in order); rows of tokens that are not queries hold
        // an earlier block's numerators, and their outputs are not read.
        let (queries, rest) = real.split_at(real.partition_point(|&i| i < rb + BLOCK_ROWS));
        real = rest;
        if queries.is_empty() {
            continue;
        }
        for p in (0..keys_b.panels()).step_by(2) {
            // SAFETY: the tiles are configured (the caller's contract); A is q of tokens
            // rb.. (32 rows `stride` apart, below kp, dh = the packing's K from `first`), C
            // the block's 32 rows of panels p and p + 1 (kp / 16 panels, an even number).
            unsafe {
                let a = tokens.as_ptr().add(rb * stride + first);
                let panels = amx::Panels::cached(p, true);
                amx::block(
                    a,
                    (stride, KSTEP),
                    keys_b,
                    panels,
                    scores.add(p * PANEL),
                    kp,
                );
            }
        }
        for &i in queries {
            let r = i - rb;
            let s = &mut tiles.scores[r * kp..][..kp];
            let region = head.region.map(|region| (region, region[i]));
            let p = &mut tiles.probs[r * kp / 2..][..kp / 2];
            // SAFETY: the caller's contract.
            inv[r] = 1.0 / unsafe { softmax_pairs(s, head.scale, head.bias.row(i), region, p) };
        }
        // The numerators (kp to a row: zeros past the keys) by the values.
        let probs = tiles.probs.as_ptr().cast::<bf16>();
        for p in (0..values_b.panels()).step_by(2) {
            // SAFETY: as above; A is the block's 32 rows of numerators (kp values apart, the
            // values' padded K), C 32 rows of panels p and p + 1 (dh / 16 of them, an even
            // number) in `outs` (dh floats a row).
            unsafe {
                let panels = amx::Panels::cached(p, true);
                amx::block(probs, (kp, KSTEP), values_b, panels, o.add(p * PANEL), dh)
            };
        }
        for &i in queries {
            let r = i - rb;
            let src = &tiles.outs[r * dh..][..dh];
            let dst = &mut outs[i * dim + first..][..dh];
            dst.iter_mut().zip(src).for_each(|(d, o)| *d = o * inv[r]);
        }
    }
}

/// Never called off x86-64 (no CPU there has AMX).
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn head_on_tiles(_: &PairHead<'_>, _: &mut TileScratch, _: &mut [f32]) {
    unreachable!("AMX's tiles are x86-64's")
}

/// A panel of 16 value columns as pairs of tokens for the tiles: pair row r interleaves the
/// 16 values from `first` of tokens 2r and 2r + 1 (`stride` values apart), column by column.
///
/// # Safety
/// The CPU runs AVX-512F and BW. (The tokens' values are checked to be in `tokens`.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn interleave_tokens(tokens: &[bf16], first: usize, stride: usize, rows: &mut [u32]) {
    use bf16_gemm::PANEL;
    use std::arch::x86_64::*;
    let pairs = rows.len() / PANEL;
    assert!(pairs == 0 || first + (2 * pairs - 1) * stride + PANEL <= tokens.len());
    for (r, row) in rows.chunks_exact_mut(PANEL).enumerate() {
        // SAFETY: both tokens' 16 values are inside `tokens` (asserted), the row 16 pairs.
        unsafe {
            let at = |j: usize| tokens.as_ptr().add(first + j * stride).cast::<__m256i>();
            let even = _mm512_castsi256_si512(_mm256_loadu_si256(at(2 * r)));
            let odd = _mm512_castsi256_si512(_mm256_loadu_si256(at(2 * r + 1)));
            _mm512_storeu_si512(row.as_mut_ptr().cast(), zip_tokens(even, odd).0);
        }
    }
}

/// Two tokens' 32 bf16 values (`even`'s and `odd`'s lanes) as 32 k-pairs for B's pair rows:
/// pair c holds even's value c in its low half and odd's in its high half, the first 16 pairs
/// in `.0`, the last 16 in `.1`.
///
/// # Safety
/// The CPU runs AVX-512F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn zip_tokens(
    even: std::arch::x86_64::__m512i,
    odd: std::arch::x86_64::__m512i,
) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    // Lane 2c: even's value c; lane 2c + 1: odd's (the second operand's lanes from 32).
    let low = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
        35, 3, 34, 2, 33, 1, 32, 0,
    );
    let high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    (
        _mm512_permutex2var_epi16(even, low, odd),
        _mm512_permutex2var_epi16(even, high, odd),
    )
}

/// Never called off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn interleave_tokens(_: &[bf16], _: usize, _: usize, _: &mut [u32]) {
    unreachable!("AMX's tiles are x86-64's")
}

/// [`softmax_numerators_biased`] for [`head_on_pairs`], in AVX-512 intrinsics: each score
/// of `s` (a row of a multiple of 32 keys) times `scale` plus its bias (and the shift mask's
/// −100 between regions), then e^(s − max) rounded to bf16 into `pairs` (in order: key 2j's
/// in pair j's low half) and their sum (in f32, before rounding). The compiled loops ran
/// their first pass a value at a time in this function (scalar multiplies, adds and stores,
/// then 2-lane maxima), and the exponential without FMAs: together 45% of its time.
///
/// # Safety
/// The CPU runs AVX-512F, BW and AVX512_BF16; `bias` (and `region`'s keys) hold `s.len()`
/// values, `pairs` half as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
unsafe fn softmax_pairs(
    s: &mut [f32],
    scale: f32,
    bias: &[f32],
    region: Option<(&[f32], f32)>,
    pairs: &mut [u32],
) -> f32 {
    use std::arch::x86_64::*;
    let n = s.len();
    assert!(n.is_multiple_of(32) && bias.len() >= n && pairs.len() * 2 >= n);
    assert!(region.is_none_or(|(r, _)| r.len() >= n));
    let (sp, bp) = (s.as_mut_ptr(), bias.as_ptr());
    // SAFETY: every load and store is inside `s`, `bias`, `region` or `pairs` (asserted).
    unsafe {
        let (scale_v, mask_v) = (_mm512_set1_ps(scale), _mm512_set1_ps(-100.0));
        let mut most = _mm512_set1_ps(f32::NEG_INFINITY);
        for j in (0..n).step_by(16) {
            let mut v = _mm512_fmadd_ps(
                _mm512_loadu_ps(sp.add(j)),
                scale_v,
                _mm512_loadu_ps(bp.add(j)),
            );
            if let Some((region, ri)) = region {
                let same = _mm512_cmpeq_ps_mask(
                    _mm512_loadu_ps(region.as_ptr().add(j)),
                    _mm512_set1_ps(ri),
                );
                v = _mm512_mask_add_ps(v, !same, v, mask_v);
            }
            _mm512_storeu_ps(sp.add(j), v);
            // A NaN never becomes the maximum (`max_ps` returns its second operand then), as
            // in the compiled loop.
            most = _mm512_max_ps(v, most);
        }
        let max = _mm512_set1_ps(_mm512_reduce_max_ps(most));
        let mut sum = _mm512_setzero_ps();
        for j in (0..n).step_by(32) {
            let lo = exp_nonpositive_fma(_mm512_sub_ps(_mm512_loadu_ps(sp.add(j)), max));
            let hi = exp_nonpositive_fma(_mm512_sub_ps(_mm512_loadu_ps(sp.add(j + 16)), max));
            sum = _mm512_add_ps(sum, _mm512_add_ps(lo, hi));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(pairs.as_mut_ptr().add(j / 2).cast(), v);
        }
        _mm512_reduce_add_ps(sum)
    }
}

/// [`super::exp_nonpositive`] on 16 lanes with FMAs (the range reduction and the polynomial
/// fused, so its last bits may differ): 0 below −87, a NaN stays NaN.
///
/// # Safety
/// The CPU runs AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_nonpositive_fma(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.0));
    let x = _mm512_mask_mov_ps(x, small, _mm512_set1_ps(-87.0));
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(super::LN2_HI), x);
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(super::LN2_LO), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let bits = _mm512_add_ps(k, _mm512_set1_ps(127.0 + 8_388_608.0));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_castps_si512(bits)));
    _mm512_maskz_mul_ps(!small, p, scale)
}

/// [`score`] and [`weigh`] on bf16 pairs: [`QUERIES`] rows of A's pairs (`a`: the queries',
/// or their numerators'), each pair broadcast against 16·V columns from `col` of B's pair
/// rows (`b`, `ld` apart: the keys' pair rows, or the values'), the sums into `out`'s
/// [`QUERIES`] rows (`ldo` apart).
///
/// # Safety
/// The CPU runs AVX-512F and AVX512_BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
unsafe fn pair_products<const V: usize>(
    a: [&[u32]; QUERIES],
    b: &[u32],
    (ld, col): (usize, usize),
    out: &mut [f32],
    ldo: usize,
) {
    use std::arch::x86_64::*;
    let rows = a[0].len();
    assert!(col + 16 * V <= ld && b.len() >= rows * ld);
    assert!(16 * V <= ldo && out.len() >= (QUERIES - 1) * ldo + 16 * V);
    let mut acc = [[_mm512_setzero_ps(); V]; QUERIES];
    for r in 0..rows {
        // SAFETY: pair row r's columns col..col + 16·V are in `b` (asserted above).
        let bv: [__m512bh; V] = std::array::from_fn(|u| unsafe {
            bh(_mm512_loadu_si512(
                b.as_ptr().add(r * ld + col + 16 * u).cast(),
            ))
        });
        for (acc, a) in acc.iter_mut().zip(&a) {
            // SAFETY: a vector of 32 bf16 is one of 16 u32 (the pairs).
            let av = unsafe { bh(_mm512_set1_epi32(a[r] as i32)) };
            for (x, b) in acc.iter_mut().zip(bv) {
                *x = _mm512_dpbf16_ps(*x, b, av);
            }
        }
    }
    for (q, acc) in acc.iter().enumerate() {
        for (u, x) in acc.iter().enumerate() {
            // SAFETY: row q's 16·V columns are in `out` (asserted above).
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(q * ldo + 16 * u), *x) };
        }
    }
}

/// 16 bf16 pairs as `vdpbf16ps` takes them.
///
/// # Safety
/// None beyond the target's: the two types are the same 64 bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bh(v: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512bh {
    // SAFETY: both are 512-bit vectors of plain bits.
    unsafe { std::mem::transmute(v) }
}

/// Never called off x86-64 (no CPU there multiplies bf16 pairs).
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn pair_products<const V: usize>(
    _: [&[u32]; QUERIES],
    _: &[u32],
    _: (usize, usize),
    _: &mut [f32],
    _: usize,
) {
    unreachable!("bf16 pairs are multiplied on x86-64 only")
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

    /// Element `at`, for a writer that checks its own bounds.
    fn ptr(&self, at: usize) -> *mut T {
        assert!(at <= self.1);
        self.0.wrapping_add(at)
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// softmax(q·kᵀ/√dh)·v of every (image, head) in f64, from the values as stored.
    fn naive(qkv: &[f32], (n, t, dim, heads): (usize, usize, usize, usize)) -> Vec<f32> {
        let dh = dim / heads;
        let mut y = vec![0f32; n * t * dim];
        for (i, h) in (0..n).flat_map(|i| (0..heads).map(move |h| (i, h))) {
            let at = |part: usize, tok: usize, d: usize| {
                qkv[(i * t + tok) * 3 * dim + part * dim + h * dh + d] as f64
            };
            for qi in 0..t {
                let s: Vec<f64> = (0..t)
                    .map(|k| (0..dh).map(|d| at(0, qi, d) * at(1, k, d)).sum::<f64>())
                    .map(|s| s / (dh as f64).sqrt())
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..dh {
                    let o: f64 = (0..t).map(|k| e[k] * at(2, k, d)).sum();
                    y[(i * t + qi) * dim + h * dh + d] = (o / sum) as f32;
                }
            }
        }
        y
    }

    fn run<T: Elem>(qkv: &[f32], dims: (usize, usize, usize, usize)) -> (Vec<f32>, Vec<f32>) {
        let stored: Vec<T> = qkv.iter().map(|&v| T::from_f32(v)).collect();
        let mut y = vec![T::from_f32(f32::NAN); dims.0 * dims.1 * dims.2];
        attention(&stored, dims, &mut y);
        let rounded: Vec<f32> = stored.iter().map(|v| v.to_f32()).collect();
        (
            y.iter().map(|v| v.to_f32()).collect(),
            naive(&rounded, dims),
        )
    }

    /// Every shape class of the packings and passes (one token, odd token counts and head
    /// sizes, a head size under a panel, more queries than one pass) in f32, f16 and bf16 —
    /// on pairs where this CPU multiplies them — against an f64 reference of the same stored
    /// values; every output written.
    #[test]
    fn attention_matches_naive() {
        for dims in [
            (2, 1, 4, 2),
            (1, 17, 10, 2),
            (2, 33, 48, 3),
            (1, 130, 64, 1),
            (1, 9, 160, 2),
            // Heads of AMX's whole K steps (the tiles where the CPU has them): 32 over two
            // blocks of queries (one of a single token), 64 over 197 tokens (ViT-B/16's).
            (2, 33, 64, 2),
            (1, 197, 128, 2),
        ] {
            let (n, t, dim, _) = dims;
            let qkv: Vec<f32> = (0..n * t * 3 * dim)
                .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 64.0)
                .collect();
            for (name, (got, want), tol) in [
                ("f32", run::<f32>(&qkv, dims), 1e-5),
                ("f16", run::<f16>(&qkv, dims), 2e-3),
                ("bf16", run::<bf16>(&qkv, dims), 2e-2),
            ] {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= tol * (1.0 + w.abs()),
                        "{name} {dims:?} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// A NaN in one key spreads to every query of its head (as in PyTorch), and to no other
    /// head's.
    #[test]
    fn a_nan_key_spreads_within_its_head() {
        let dims @ (n, t, dim, _) = (1, 20, 16, 2);
        let mut qkv: Vec<f32> = (0..n * t * 3 * dim).map(|i| (i % 7) as f32 / 8.0).collect();
        // Token 3's k, head 1's first value.
        qkv[3 * 3 * dim + dim + 8] = f32::NAN;
        let check = |y: Vec<f32>| {
            for (i, v) in y.iter().enumerate() {
                assert_eq!(v.is_nan(), i % dim >= 8, "[{i}] {v}");
            }
        };
        check(run::<f32>(&qkv, dims).0);
        check(run::<bf16>(&qkv, dims).0);
    }

    /// The AVX-512 norm rows give the compiled loops' results bit for bit: widths with and
    /// without whole vectors and a masked rest, row counts around the groups of four, layer
    /// norms and RMSNorms, f32 and bf16 rows.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_norms_match_the_loops() {
        if simd() < Simd::Avx512 {
            return;
        }
        fn both<S: norm512::Lanes + PartialEq + std::fmt::Debug>(
            x: &[S],
            norm: Norm<'_>,
            widen: fn(S) -> f32,
            narrow: fn(f32) -> S,
        ) {
            let d = norm.weight.len();
            let mut want = x.to_vec();
            let mut v = vec![0f32; d];
            with_simd(NormRows {
                x,
                y: &mut want,
                v: &mut v,
                norm,
                widen,
                narrow,
            });
            let mut got = x.to_vec();
            // SAFETY: the CPU runs AVX-512 (checked above).
            unsafe { norm512::rows(x, &mut got, &norm) };
            assert_eq!(got, want, "width {d}, {} rows", x.len() / d);
        }
        for d in [1, 8, 16, 24, 40, 96] {
            let weight: Vec<f32> = (0..d).map(|i| 0.5 + (i % 7) as f32 / 8.0).collect();
            let bias: Vec<f32> = (0..d).map(|i| (i % 5) as f32 / 4.0 - 0.5).collect();
            for rows in [1, 3, 4, 5, 9] {
                let x: Vec<f32> = (0..rows * d)
                    .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 16.0)
                    .collect();
                for (bias, centre) in [(Some(&bias[..]), true), (None, false)] {
                    let norm = Norm {
                        weight: &weight,
                        bias,
                        eps: 1e-5,
                        centre,
                    };
                    both(&x, norm, |a| a, |a| a);
                    let stored: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                    both(&stored, norm, bf16_f32, f32_bf16);
                }
            }
        }
    }

    /// The window softmax's exponential with FMAs keeps `exp_nonpositive`'s accuracy and its
    /// edges: 0 below −87 (and at −∞), 1 at 0, a NaN stays NaN.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_exponential_matches_libm() {
        use std::arch::x86_64::*;
        if simd() < Simd::Avx512 {
            return;
        }
        let exp16 = |x: [f32; 16]| {
            let mut out = [0f32; 16];
            // SAFETY: the CPU runs AVX-512 (checked above); 16 values in and out.
            unsafe {
                let v = exp_nonpositive_fma(_mm512_loadu_ps(x.as_ptr()));
                _mm512_storeu_ps(out.as_mut_ptr(), v);
            }
            out
        };
        for i in (0..=200_000).step_by(16) {
            let x: [f32; 16] = std::array::from_fn(|l| -((i + l) as f32) * 0.0005);
            for (x, got) in x.iter().zip(exp16(x)) {
                let want = x.exp();
                assert!(
                    (got - want).abs() <= 4e-7 * want + 2e-38,
                    "e^{x}: {got} vs {want}"
                );
            }
        }
        let edges = exp16(std::array::from_fn(|l| match l {
            0 => 0.0,
            1 => -200.0,
            2 => f32::NEG_INFINITY,
            _ => f32::NAN,
        }));
        assert_eq!(edges[..3], [1.0, 0.0, 0.0]);
        assert!(edges[3].is_nan());
    }
}

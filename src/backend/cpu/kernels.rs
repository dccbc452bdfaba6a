//! The CPU kernels. Images are NHWC (channels innermost, so a pixel's channels are one
//! contiguous run and a convolution is a GEMM over them); features are (N, F). Storage is any
//! [`Elem`]; arithmetic is f32. Work is split over the session's rayon pool.
//!
//! Convolution is im2col + GEMM, fused per chunk of output rows: each worker gathers the
//! columns of its rows into a thread-local scratch (in f32), multiplies them by the packed
//! weights with the `gemm` crate, and writes bias-added results straight into the output. A
//! 1×1 stride-1 convolution in f32 skips the gather: its input already is the column matrix.
//! Depthwise convolutions are direct loops (a GEMM with one input channel per group wastes
//! the machine).

use std::cell::RefCell;

use gemm::Parallelism;
use rayon::prelude::*;

use super::elem::Elem;
use crate::model::op::{Conv2d, Pool};
use crate::model::reference::adaptive_bins;

/// An NHWC image batch's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nhwc {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
}

impl Nhwc {
    pub fn elems(&self) -> usize {
        self.n * self.h * self.w * self.c
    }
}

/// Elements per parallel work item of the element-wise kernels.
const ELEMENTWISE_CHUNK: usize = 1 << 16;

/// Target size of one chunk of im2col columns, in f32 elements (1 MiB): small enough to stay
/// in a core's cache while the GEMM reads it, large enough that the GEMM's per-call packing
/// of the weights is amortised over many rows.
pub const COLUMN_CHUNK_ELEMS: usize = 1 << 18;
/// Fewest output rows per chunk, for the same amortisation on layers with long columns.
pub const MIN_CHUNK_ROWS: usize = 192;

thread_local! {
    /// Per-worker scratch for columns and f32 results; reused across calls and iterations so
    /// the hot loop does not allocate.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Weights of a convolution packed for the GEMM: per group, a (K_g × cout_g) row-major
/// matrix with K ordered (ky, kx, ci) like the NHWC columns.
pub struct PackedConv<T> {
    pub conv: Conv2d,
    pub weight: Vec<T>,
    pub bias: Option<Vec<f32>>,
    /// Depthwise: weights as (ky, kx, c) in f32 instead, for the direct kernel.
    pub depthwise: Option<Vec<f32>>,
}

impl<T: Elem> PackedConv<T> {
    /// Pack PyTorch's (cout, cin/groups, kh, kw) weight.
    pub fn new(conv: Conv2d, weight: &[f32], bias: Option<&[f32]>) -> Self {
        let (kh, kw) = conv.kernel;
        let cin_g = conv.in_channels / conv.groups;
        let cout_g = conv.out_channels / conv.groups;
        let bias = bias.map(|b| b.to_vec());
        if is_depthwise(&conv) {
            let c = conv.out_channels;
            let mut dw = vec![0f32; kh * kw * c];
            for ch in 0..c {
                for k in 0..kh * kw {
                    // Round through the storage type so every precision sees its own weights.
                    dw[k * c + ch] = T::from_f32(weight[ch * kh * kw + k]).to_f32();
                }
            }
            return PackedConv {
                conv,
                weight: Vec::new(),
                bias,
                depthwise: Some(dw),
            };
        }
        let k_g = kh * kw * cin_g;
        let mut packed = vec![T::default(); conv.groups * k_g * cout_g];
        for g in 0..conv.groups {
            for co in 0..cout_g {
                let oc = g * cout_g + co;
                for ci in 0..cin_g {
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let src = ((oc * cin_g + ci) * kh + ky) * kw + kx;
                            let k = (ky * kw + kx) * cin_g + ci;
                            packed[(g * k_g + k) * cout_g + co] = T::from_f32(weight[src]);
                        }
                    }
                }
            }
        }
        PackedConv {
            conv,
            weight: packed,
            bias,
            depthwise: None,
        }
    }

    pub fn kernel_name(&self) -> String {
        let c = &self.conv;
        let form = if self.depthwise.is_some() {
            "depthwise_direct"
        } else if is_pointwise(c) {
            "pointwise_gemm"
        } else {
            "im2col_gemm"
        };
        format!("conv2d_{form}_{}", T::SUFFIX)
    }

    /// f32 scratch one worker needs for a chunk: columns and (for non-f32 storage) results.
    pub fn scratch_elems(&self, out: Nhwc) -> usize {
        let c = &self.conv;
        let k = c.kernel.0 * c.kernel.1 * c.in_channels;
        let rows = chunk_rows(out.n * out.h * out.w, k);
        rows * (k + c.out_channels)
    }
}

fn is_depthwise(c: &Conv2d) -> bool {
    c.groups > 1 && c.groups == c.in_channels && c.groups == c.out_channels
}

fn is_pointwise(c: &Conv2d) -> bool {
    c.kernel == (1, 1) && c.stride == (1, 1) && c.padding == (0, 0) && c.groups == 1
}

fn chunk_rows(m: usize, k: usize) -> usize {
    (COLUMN_CHUNK_ELEMS / k.max(1))
        .max(MIN_CHUNK_ROWS)
        .min(m.max(1))
}

/// The convolution: `x` (in_shape) → `y` (out_shape), both NHWC. `wide` holds the weights
/// widened to f32 for non-f32 storage (filled by the caller once per call).
pub fn conv2d<T: Elem>(
    p: &PackedConv<T>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    wide: &[f32],
    threads: usize,
) {
    if let Some(dw) = &p.depthwise {
        return depthwise(p, dw, x, xs, y, ys);
    }
    let c = &p.conv;
    let cin_g = c.in_channels / c.groups;
    let cout_g = c.out_channels / c.groups;
    let k_g = c.kernel.0 * c.kernel.1 * cin_g;
    let k = k_g * c.groups;
    let m = ys.n * ys.h * ys.w;
    let cout = c.out_channels;
    let weights: &[f32] = T::as_f32(&p.weight).unwrap_or(wide);
    let rows = chunk_rows(m, k);
    let chunks = m.div_ceil(rows);
    // Many chunks: one chunk per worker, each GEMM single-threaded (no synchronisation, the
    // chunk stays in the worker's cache). Few chunks (small batches, late layers): chunks in
    // turn, each GEMM spread over the pool.
    let spread = chunks < 2 * threads;
    let par = if spread && threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    let direct_input = if is_pointwise(c) { T::as_f32(x) } else { None };

    let run_chunk = |ci: usize, out: &mut [T]| {
        let m0 = ci * rows;
        let mr = out.len() / cout;
        SCRATCH.with(|s| {
            let (cols, res) = &mut *s.borrow_mut();
            let a: &[f32] = match direct_input {
                Some(xf) => &xf[m0 * k..(m0 + mr) * k],
                None => {
                    cols.resize(mr * k, 0.0);
                    im2col(c, x, xs, ys, m0, mr, &mut cols[..mr * k]);
                    &cols[..mr * k]
                }
            };
            let narrow = T::as_f32(out).is_none();
            let dst: &mut [f32] = match T::as_f32_mut(out) {
                Some(d) => d,
                None => {
                    res.resize(mr * cout, 0.0);
                    &mut res[..mr * cout]
                }
            };
            for g in 0..c.groups {
                // SAFETY: every pointer/stride pair describes memory inside its slice: `a` is
                // (mr × k) row-major and group g reads columns [g·k_g, (g+1)·k_g); the weights
                // are (k_g × cout_g) row-major at offset g·k_g·cout_g; `dst` is (mr × cout)
                // row-major and group g writes columns [g·cout_g, (g+1)·cout_g). `dst` does
                // not alias `a` or the weights.
                unsafe {
                    gemm::gemm(
                        mr,
                        cout_g,
                        k_g,
                        dst.as_mut_ptr().add(g * cout_g),
                        1,
                        cout as isize,
                        false,
                        a.as_ptr().add(g * k_g),
                        1,
                        k as isize,
                        weights.as_ptr().add(g * k_g * cout_g),
                        1,
                        cout_g as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        par,
                    );
                }
            }
            if let Some(b) = &p.bias {
                for row in dst.chunks_exact_mut(cout) {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            }
            if narrow {
                T::narrow(&res[..mr * cout], out);
            }
        });
    };
    let y = &mut y[..m * cout];
    if spread {
        y.chunks_mut(rows * cout)
            .enumerate()
            .for_each(|(i, out)| run_chunk(i, out));
    } else {
        y.par_chunks_mut(rows * cout)
            .enumerate()
            .for_each(|(i, out)| run_chunk(i, out));
    }
}

/// Gather the columns of output rows [m0, m0 + mr) into `cols` (mr × K, K ordered
/// (group, ky, kx, ci)), widening to f32 and writing zeros for padding.
fn im2col<T: Elem>(
    c: &Conv2d,
    x: &[T],
    xs: Nhwc,
    ys: Nhwc,
    m0: usize,
    mr: usize,
    cols: &mut [f32],
) {
    let (kh, kw) = c.kernel;
    let cin_g = c.in_channels / c.groups;
    let k_g = kh * kw * cin_g;
    let k = k_g * c.groups;
    for r in 0..mr {
        let m = m0 + r;
        let ox = m % ys.w;
        let oy = (m / ys.w) % ys.h;
        let n = m / (ys.w * ys.h);
        let row = &mut cols[r * k..(r + 1) * k];
        for ky in 0..kh {
            let iy = (oy * c.stride.0 + ky * c.dilation.0) as isize - c.padding.0 as isize;
            for kx in 0..kw {
                let ix = (ox * c.stride.1 + kx * c.dilation.1) as isize - c.padding.1 as isize;
                let inside = iy >= 0 && ix >= 0 && (iy as usize) < xs.h && (ix as usize) < xs.w;
                let base = if inside {
                    ((n * xs.h + iy as usize) * xs.w + ix as usize) * xs.c
                } else {
                    0
                };
                for g in 0..c.groups {
                    let dst = &mut row[g * k_g + (ky * kw + kx) * cin_g..][..cin_g];
                    if inside {
                        T::widen(&x[base + g * cin_g..][..cin_g], dst);
                    } else {
                        dst.fill(0.0);
                    }
                }
            }
        }
    }
}

/// Depthwise convolution, one output row (n, oy) per work item, channels vectorised.
fn depthwise<T: Elem>(p: &PackedConv<T>, dw: &[f32], x: &[T], xs: Nhwc, y: &mut [T], ys: Nhwc) {
    let c = &p.conv;
    let ch = ys.c;
    let (kh, kw) = c.kernel;
    y[..ys.elems()]
        .par_chunks_mut(ys.w * ch)
        .enumerate()
        .for_each(|(row, out)| {
            let oy = row % ys.h;
            let n = row / ys.h;
            let mut acc = vec![0f32; ch];
            let mut xin = vec![0f32; ch];
            for ox in 0..ys.w {
                match &p.bias {
                    Some(b) => acc.copy_from_slice(b),
                    None => acc.fill(0.0),
                }
                for ky in 0..kh {
                    let iy = (oy * c.stride.0 + ky * c.dilation.0) as isize - c.padding.0 as isize;
                    if iy < 0 || iy as usize >= xs.h {
                        continue;
                    }
                    for kx in 0..kw {
                        let ix =
                            (ox * c.stride.1 + kx * c.dilation.1) as isize - c.padding.1 as isize;
                        if ix < 0 || ix as usize >= xs.w {
                            continue;
                        }
                        let base = ((n * xs.h + iy as usize) * xs.w + ix as usize) * ch;
                        T::widen(&x[base..base + ch], &mut xin);
                        let w = &dw[(ky * kw + kx) * ch..][..ch];
                        for ((a, xv), wv) in acc.iter_mut().zip(&xin).zip(w) {
                            *a += xv * wv;
                        }
                    }
                }
                T::narrow(&acc, &mut out[ox * ch..(ox + 1) * ch]);
            }
        });
}

/// Apply `f` to `buf` in f32, one block at a time: in place for f32 storage, through a small
/// widened copy for half types (so conversions run over whole slices, with F16C where present,
/// instead of one scalar conversion per element). `block` must be a multiple of any period
/// `f` relies on (the channel count for per-channel maps).
fn map_f32<T: Elem>(buf: &mut [T], block: usize, f: impl Fn(&mut [f32]) + Sync) {
    buf.par_chunks_mut(block).for_each(|part| match T::as_f32_mut(part) {
        Some(p) => f(p),
        None => {
            let mut tmp = vec![0f32; part.len()];
            T::widen(part, &mut tmp);
            f(&mut tmp);
            T::narrow(&tmp, part);
        }
    });
}

/// y = x·scale + shift per channel (batch norm folded to an affine map at prepare time).
pub fn affine_inplace<T: Elem>(buf: &mut [T], c: usize, scale: &[f32], shift: &[f32]) {
    map_f32(buf, (ELEMENTWISE_CHUNK / c).max(1) * c, |part| {
        for px in part.chunks_exact_mut(c) {
            for ((v, s), b) in px.iter_mut().zip(scale).zip(shift) {
                *v = *v * s + b;
            }
        }
    });
}

/// Clamp every element to [lo, hi] (ReLU: [0, ∞), ReLU6: [0, 6]).
pub fn clamp_inplace<T: Elem>(buf: &mut [T], lo: f32, hi: f32) {
    map_f32(buf, ELEMENTWISE_CHUNK, |part| part.iter_mut().for_each(|v| *v = v.max(lo).min(hi)));
}

/// a += b, element-wise.
pub fn add_inplace<T: Elem>(a: &mut [T], b: &[T]) {
    a.par_chunks_mut(ELEMENTWISE_CHUNK).zip(b.par_chunks(ELEMENTWISE_CHUNK)).for_each(|(a, b)| {
        match (T::as_f32_mut(a), T::as_f32(b)) {
            (Some(a), Some(b)) => a.iter_mut().zip(b).for_each(|(x, y)| *x += y),
            _ => {
                let mut ta = vec![0f32; a.len()];
                let mut tb = vec![0f32; b.len()];
                T::widen(a, &mut ta);
                T::widen(b, &mut tb);
                ta.iter_mut().zip(&tb).for_each(|(x, y)| *x += y);
                T::narrow(&ta, a);
            }
        }
    });
}

/// Max or average pooling over windows, one output row per work item.
pub fn pool<T: Elem>(p: &Pool, max: bool, x: &[T], xs: Nhwc, y: &mut [T], ys: Nhwc) {
    let ch = xs.c;
    y[..ys.elems()]
        .par_chunks_mut(ys.w * ch)
        .enumerate()
        .for_each(|(row, out)| {
            let oy = row % ys.h;
            let n = row / ys.h;
            let mut acc = vec![0f32; ch];
            for ox in 0..ys.w {
                acc.fill(if max { f32::NEG_INFINITY } else { 0.0 });
                let y0 = (oy * p.stride.0) as isize - p.padding.0 as isize;
                let x0 = (ox * p.stride.1) as isize - p.padding.1 as isize;
                let mut count = 0usize;
                let mut inside = 0usize;
                for iy in y0..y0 + p.kernel.0 as isize {
                    for ix in x0..x0 + p.kernel.1 as isize {
                        if iy < (xs.h + p.padding.0) as isize && ix < (xs.w + p.padding.1) as isize
                        {
                            count += 1;
                        }
                        if iy < 0 || ix < 0 || iy as usize >= xs.h || ix as usize >= xs.w {
                            continue;
                        }
                        inside += 1;
                        let base = ((n * xs.h + iy as usize) * xs.w + ix as usize) * ch;
                        for (a, v) in acc.iter_mut().zip(&x[base..base + ch]) {
                            let v = v.to_f32();
                            *a = if max { a.max(v) } else { *a + v };
                        }
                    }
                }
                if !max {
                    let div = if p.count_include_pad { count } else { inside } as f32;
                    acc.iter_mut().for_each(|a| *a /= div);
                }
                T::narrow(&acc, &mut out[ox * ch..(ox + 1) * ch]);
            }
        });
}

/// Adaptive average pooling with PyTorch's bin edges.
pub fn adaptive_avg_pool<T: Elem>(x: &[T], xs: Nhwc, y: &mut [T], ys: Nhwc) {
    let ch = xs.c;
    y[..ys.elems()]
        .par_chunks_mut(ys.w * ch)
        .enumerate()
        .for_each(|(row, out)| {
            let oy = row % ys.h;
            let n = row / ys.h;
            let (y0, y1) = adaptive_bins(xs.h, ys.h, oy);
            let mut acc = vec![0f32; ch];
            for ox in 0..ys.w {
                let (x0, x1) = adaptive_bins(xs.w, ys.w, ox);
                acc.fill(0.0);
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let base = ((n * xs.h + iy) * xs.w + ix) * ch;
                        for (a, v) in acc.iter_mut().zip(&x[base..base + ch]) {
                            *a += v.to_f32();
                        }
                    }
                }
                let inv = 1.0 / ((y1 - y0) * (x1 - x0)) as f32;
                acc.iter_mut().for_each(|a| *a *= inv);
                T::narrow(&acc, &mut out[ox * ch..(ox + 1) * ch]);
            }
        });
}

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

/// NCHW f32 (the seam's layout) → NHWC storage.
pub fn nchw_to_nhwc<T: Elem>(x: &[f32], xs: Nhwc, y: &mut [T]) {
    let plane = xs.h * xs.w;
    y[..xs.elems()]
        .par_chunks_mut(xs.c * plane)
        .enumerate()
        .for_each(|(n, out)| {
            for p in 0..plane {
                for c in 0..xs.c {
                    out[p * xs.c + c] = T::from_f32(x[(n * xs.c + c) * plane + p]);
                }
            }
        });
}

/// Fully connected layer: y (n × out) = x (n × in) · Wᵀ + b, W stored (out × in);
/// `dims` is (n, in, out).
pub fn linear<T: Elem>(
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    dims: (usize, usize, usize),
    y: &mut [T],
    threads: usize,
) {
    let (n, fin, fout) = dims;
    if let (Some(xf), Some(wf), Some(yf)) = (T::as_f32(x), T::as_f32(w), T::as_f32_mut(y)) {
        let par = if threads > 1 {
            Parallelism::Rayon(threads)
        } else {
            Parallelism::None
        };
        // SAFETY: x is (n × fin) row-major, w is (fout × fin) row-major read as its transpose
        // (fin × fout) with column stride fin, y is (n × fout) row-major; all lengths were
        // checked by the caller against the plan, and y aliases neither input.
        unsafe {
            gemm::gemm(
                n,
                fout,
                fin,
                yf.as_mut_ptr(),
                1,
                fout as isize,
                false,
                xf.as_ptr(),
                1,
                fin as isize,
                wf.as_ptr(),
                fin as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
        if let Some(b) = bias {
            for row in yf[..n * fout].chunks_exact_mut(fout) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        return;
    }
    // Half-precision storage: widen the activations once, then stream the weights one output
    // feature at a time (these layers are bandwidth-bound at inference batch sizes, and
    // widening the whole matrix would cost as much memory as f32 weights).
    let mut xf = vec![0f32; n * fin];
    T::widen(&x[..n * fin], &mut xf);
    let mut outs = vec![0f32; n * fout];
    const BLOCK: usize = 16;
    let cols: Vec<(usize, Vec<f32>)> = (0..fout.div_ceil(BLOCK))
        .into_par_iter()
        .map(|blk| {
            let o0 = blk * BLOCK;
            let o1 = (o0 + BLOCK).min(fout);
            let mut row = vec![0f32; fin];
            let mut res = vec![0f32; n * (o1 - o0)];
            for o in o0..o1 {
                T::widen(&w[o * fin..(o + 1) * fin], &mut row);
                for i in 0..n {
                    let xi = &xf[i * fin..(i + 1) * fin];
                    let dot: f32 = xi.iter().zip(&row).map(|(a, b)| a * b).sum();
                    res[i * (o1 - o0) + (o - o0)] = dot + bias.map_or(0.0, |b| b[o]);
                }
            }
            (o0, res)
        })
        .collect();
    for (o0, res) in cols {
        let width = res.len() / n.max(1);
        for i in 0..n {
            outs[i * fout + o0..i * fout + o0 + width]
                .copy_from_slice(&res[i * width..(i + 1) * width]);
        }
    }
    T::narrow(&outs, &mut y[..n * fout]);
}

/// Softmax over rows of length `len`, in f32 with the row maximum subtracted.
pub fn softmax<T: Elem>(x: &[T], len: usize, y: &mut [T]) {
    y.par_chunks_mut(len)
        .zip(x.par_chunks(len))
        .for_each(|(out, row)| {
            let vals: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
            let m = vals.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f32> = vals.iter().map(|v| (v - m).exp()).collect();
            let s: f32 = e.iter().sum();
            for (o, v) in out.iter_mut().zip(e) {
                *o = T::from_f32(v / s);
            }
        });
}

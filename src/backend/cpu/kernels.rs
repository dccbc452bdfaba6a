//! The CPU kernels. Images are NHWC (channels innermost, so a pixel's channels are one
//! contiguous run and a convolution is a GEMM over them); features are (N, F). Storage is any
//! [`Elem`]; arithmetic is f32. Work is split over the session's rayon pool.
//!
//! Convolution is im2col + GEMM ([`super::sgemm`]), fused per work item: a worker gathers the
//! columns of a chunk of output rows into a thread-local scratch (in f32) and multiplies them
//! by the weights, packed once at prepare time, with the bias folded into the GEMM tile. A 1×1
//! stride-1 convolution in f32 skips the gather: its input already is the column matrix. When
//! there are too few row chunks to keep every worker busy (small batches, late layers), work
//! items also split the output channels. Depthwise convolutions are direct loops (a GEMM with
//! one input channel per group wastes the machine).

use std::cell::RefCell;

use half::bf16;
use rayon::prelude::*;

use super::elem::{self, Elem, bf16_f32, f32_bf16};
use super::pairs::{self, PackedPairs};
use super::sgemm::{self, NR, PackedB};
use super::simd::{Update, Vectorised, ZipWith, with_simd};
use crate::model::op::{Act, Conv2d, Pool};
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

/// Target size of one chunk of im2col columns, in f32 elements (512 KiB, a core's L2).
pub const COLUMN_CHUNK_ELEMS: usize = 1 << 17;
/// Bounds on the output rows of one chunk: enough rows to reuse each weight panel many
/// times, few enough to leave work for every worker.
const MIN_CHUNK_ROWS: usize = 96;
const MAX_CHUNK_ROWS: usize = 768;

thread_local! {
    /// Per-worker scratch for columns and f32 results; reused across calls and iterations so
    /// the hot loop does not allocate.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// A pointer to the output that work items write in disjoint tiles.
#[derive(Clone, Copy)]
struct TilePtr<T>(*mut T);
// SAFETY: work items write disjoint (row range × column range) tiles of the output, so sharing
// the base pointer between workers never lets two of them touch the same element.
unsafe impl<T> Send for TilePtr<T> {}
// SAFETY: as for Send: no two workers touch the same element through the shared pointer.
unsafe impl<T> Sync for TilePtr<T> {}

impl<T> TilePtr<T> {
    /// The element `i` past the base (a method, so that closures capture the whole `TilePtr`).
    ///
    /// # Safety
    /// As for `pointer::add`.
    unsafe fn add(self, i: usize) -> *mut T {
        // SAFETY: the caller's.
        unsafe { self.0.add(i) }
    }
}

/// A convolution's weights, prepared for its kernel.
pub struct PackedConv<T> {
    pub conv: Conv2d,
    /// Per group, the (K_g × cout_g) weight matrix with K ordered (ky, kx, ci) like the NHWC
    /// columns, packed for the GEMM, bias included.
    pub groups: Vec<PackedB<T>>,
    /// Depthwise: weights as (ky, kx, c) in f32 instead, for the direct kernel, and the bias.
    pub depthwise: Option<(Vec<f32>, Option<Vec<f32>>)>,
    /// Output rows per work item, as a multiple of [`chunk_rows`]'s choice (a tile-size
    /// variant max-autotune may pick: 1, 2 or 4).
    pub chunk_scale: usize,
    /// Winograd F(m×m, 3×3) weights, when this layer runs that way (3×3, stride 1): `groups`
    /// is then empty.
    pub winograd: Option<super::winograd::Winograd<T>>,
    /// The weights packed as bf16 k-pairs, when this BF16 layer multiplies pairs (ungrouped
    /// layers where the CPU has AMX or AVX512_BF16, see [`uses_pairs`]): `groups` is then
    /// empty.
    pub pairs: Option<Box<PackedPairs>>,
}

/// The CPU backend's conv variants: rows per work item at 1×, 2× and 4× the default.
pub const CONV_VARIANTS: [&str; 3] = ["rows-x1", "rows-x2", "rows-x4"];

/// The chunk scale of a variant name (1 for unknown names).
pub fn chunk_scale(variant: Option<&str>) -> usize {
    match variant {
        Some("rows-x2") => 2,
        Some("rows-x4") => 4,
        _ => 1,
    }
}

impl<T: Elem> PackedConv<T> {
    /// Pack PyTorch's (cout, cin/groups, kh, kw) weight.
    pub fn new(conv: Conv2d, weight: &[f32], bias: Option<&[f32]>) -> Self {
        let (kh, kw) = conv.kernel;
        let cout_g = conv.out_channels / conv.groups;
        if is_depthwise(&conv) {
            let c = conv.out_channels;
            let mut dw = vec![0f32; kh * kw * c];
            for ch in 0..c {
                for k in 0..kh * kw {
                    // Round through the storage type so every precision sees its own weights.
                    dw[k * c + ch] = T::from_f32(weight[ch * kh * kw + k]).to_f32();
                }
            }
            let bias = bias.map(|b| b.to_vec());
            return PackedConv {
                conv,
                groups: Vec::new(),
                depthwise: Some((dw, bias)),
                chunk_scale: 1,
                winograd: None,
                pairs: None,
            };
        }
        let cin_g = conv.in_channels / conv.groups;
        let taps = kh * kw;
        // Column co of group g: PyTorch's (cin_g, kh, kw) block of that output channel,
        // reordered to (ky, kx, ci) like the NHWC columns (`Conv2d::weight_index`, without the
        // divisions per element).
        let fill = |g: usize| {
            move |co: usize, col: &mut [f32]| {
                let src = &weight[(g * cout_g + co) * cin_g * taps..][..cin_g * taps];
                for ci in 0..cin_g {
                    for t in 0..taps {
                        col[t * cin_g + ci] = src[ci * taps + t];
                    }
                }
            }
        };
        if uses_pairs::<T>(&conv) {
            return PackedConv {
                conv,
                groups: Vec::new(),
                depthwise: None,
                chunk_scale: 1,
                winograd: None,
                pairs: Some(Box::new(PackedPairs::from_columns(
                    conv.taps(),
                    cout_g,
                    fill(0),
                    bias,
                ))),
            };
        }
        let groups = (0..conv.groups)
            .map(|g| {
                let fill = fill(g);
                PackedB::from_columns(
                    conv.taps(),
                    cout_g,
                    fill,
                    bias.map(|b| &b[g * cout_g..(g + 1) * cout_g]),
                )
            })
            .collect();
        PackedConv {
            conv,
            groups,
            depthwise: None,
            chunk_scale: 1,
            winograd: None,
            pairs: None,
        }
    }

    /// Pack for Winograd F(m×m, 3×3) instead, when the layer allows it.
    pub fn winograd(
        tile: super::winograd::Tile,
        conv: Conv2d,
        weight: &[f32],
        bias: Option<&[f32]>,
        out: &[usize],
    ) -> Option<Self> {
        super::winograd::eligible(&conv).then(|| PackedConv {
            conv,
            groups: Vec::new(),
            depthwise: None,
            chunk_scale: 1,
            winograd: Some(super::winograd::Winograd::new(
                tile, &conv, weight, bias, out,
            )),
            pairs: None,
        })
    }

    /// This packing for the same convolution with output `out` (another batch), where that
    /// output runs with `tile` (Winograd's, or none) as this packing does.
    pub fn for_output(
        mut self,
        tile: Option<super::winograd::Tile>,
        out: &[usize],
    ) -> Option<Self> {
        self.winograd = match (self.winograd.take(), tile) {
            (None, None) => None,
            (Some(w), Some(t)) if w.tile() == t => Some(w.for_output(&self.conv, out)?),
            _ => return None,
        };
        Some(self)
    }

    pub fn bytes(&self) -> u64 {
        let dw = self.depthwise.as_ref().map_or(0, |(w, b)| {
            (w.len() + b.as_ref().map_or(0, |b| b.len())) as u64 * 4
        });
        self.groups.iter().map(|g| g.bytes()).sum::<u64>()
            + dw
            + self.winograd.as_ref().map_or(0, |w| w.bytes())
            + self.pairs.as_ref().map_or(0, |a| a.bytes())
    }

    pub fn kernel_name(&self) -> String {
        let form = if let Some(w) = &self.winograd {
            w.tile().form()
        } else if self.pairs.is_some() {
            match pairs::Engine::in_use() {
                Some(pairs::Engine::Amx) => "amx_gemm",
                _ => "dpbf16_gemm",
            }
        } else if self.depthwise.is_some() {
            "depthwise_direct"
        } else if is_pointwise(&self.conv) {
            "pointwise_gemm"
        } else {
            "im2col_gemm"
        };
        format!("conv2d_{form}_{}", T::SUFFIX)
    }
}

/// Whether a convolution of this precision multiplies bf16 pairs: BF16, ungrouped, where the
/// paths in use include AMX or AVX512_BF16 (see [`super::pairs`]).
pub fn uses_pairs<T: Elem>(c: &Conv2d) -> bool {
    T::PRECISION == crate::model::Precision::Bf16
        && c.groups == 1
        && pairs::Engine::in_use().is_some()
}

fn is_depthwise(c: &Conv2d) -> bool {
    c.groups > 1 && c.groups == c.in_channels && c.groups == c.out_channels
}

fn is_pointwise(c: &Conv2d) -> bool {
    c.kernel == (1, 1) && c.stride == (1, 1) && c.padding == (0, 0) && c.groups == 1
}

/// Output rows per chunk for columns of length `k`: a multiple of the GEMM tile's rows.
pub fn chunk_rows(m: usize, k: usize) -> usize {
    let rows = (COLUMN_CHUNK_ELEMS / k.max(1)).clamp(MIN_CHUNK_ROWS, MAX_CHUNK_ROWS);
    let tile = sgemm::tile_rows();
    rows.div_ceil(tile).saturating_mul(tile).min(m.max(1))
}

/// Rows [0, m) cut into chunks of whole `unit`s (GEMM tiles) about `rows` long, in a multiple
/// of the workers where there are units enough, the units dealt out as evenly as they go:
/// chunk sizes differ by one unit at most. Chunks of one size and a short last one left
/// ResNet-50's late layers at batch 8 uneven: 392 rows in 72-row chunks were 5 × 72 + 32,
/// 216 rows for one worker and 176 for the other (91% of the pair's time used); even chunks
/// split its 33 tiles (of 12 rows, then) 17 and 16.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunks {
    m: usize,
    unit: usize,
    count: usize,
}

impl Chunks {
    pub(crate) fn new(m: usize, rows: usize, unit: usize, threads: usize) -> Self {
        let units = m.div_ceil(unit.max(1)).max(1);
        let count = m
            .div_ceil(rows.max(1))
            .next_multiple_of(threads.max(1))
            .min(units);
        Chunks {
            m,
            unit: unit.max(1),
            count,
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Chunk c's first row and rows.
    pub(crate) fn get(&self, c: usize) -> (usize, usize) {
        let units = self.m.div_ceil(self.unit);
        let at = |c: usize| (units * c / self.count * self.unit).min(self.m);
        (at(c), at(c + 1) - at(c))
    }

    /// `buf`, rows of `row` values, cut into the chunks' parts (the rows past `m` left out).
    pub(crate) fn split_mut<'a, X>(&self, buf: &'a mut [X], row: usize) -> Vec<&'a mut [X]> {
        let mut rest = buf;
        (0..self.count)
            .map(|c| {
                let (part, tail) = std::mem::take(&mut rest).split_at_mut(self.get(c).1 * row);
                rest = tail;
                part
            })
            .collect()
    }
}

/// How a GEMM's row chunks are cut into work items: each chunk whole, or, when there are too
/// few of them for `threads` workers, split over the panels too. Returns the splits per chunk.
fn work_split(chunks: usize, panels: usize, threads: usize) -> usize {
    if chunks >= 2 * threads {
        1
    } else {
        (2 * threads).div_ceil(chunks.max(1)).min(panels).max(1)
    }
}

/// Panels [p0, p1) of split `s` out of `splits`.
fn panel_range(panels: usize, splits: usize, s: usize) -> (usize, usize) {
    (panels * s / splits, panels * (s + 1) / splits)
}

/// The work items of a GEMM of `m` rows in chunks of about `rows` ([`Chunks`]) over `panels`
/// column panels ([`work_split`]), in parallel: each item's rows (m0, mr) and panels [p0, p1).
fn work_items(
    m: usize,
    rows: usize,
    panels: usize,
    threads: usize,
) -> impl IndexedParallelIterator<Item = ((usize, usize), (usize, usize))> {
    let chunks = Chunks::new(m, rows, sgemm::tile_rows(), threads);
    let splits = work_split(chunks.count(), panels, threads);
    (0..chunks.count() * splits)
        .into_par_iter()
        .map(move |item| {
            (
                chunks.get(item / splits),
                panel_range(panels, splits, item % splits),
            )
        })
}

/// Multiply rows [m0, m0 + mr) of `a` (row stride `lda`, group g's columns at g·k_g) by each
/// group's panels [p0, p1), writing into the NHWC output `y` (row stride `cout`).
#[allow(clippy::too_many_arguments)]
fn gemm_tile<T: Elem>(
    a: &[f32],
    lda: usize,
    groups: &[PackedB<T>],
    k_g: usize,
    (m0, mr): (usize, usize),
    (p0, p1): (usize, usize),
    y: TilePtr<T>,
    cout: usize,
    res: &mut Vec<f32>,
    epilogue: &Epilogue<'_, T>,
) {
    for (g, b) in groups.iter().enumerate() {
        let cout_g = cout / groups.len();
        let col0 = g * cout_g + p0 * NR;
        let width = (p1 * NR).min(cout_g) - p0 * NR;
        // SAFETY: `a` holds mr rows of lda ≥ (g + 1)·k_g floats. The output tile is rows
        // [m0, m0 + mr) × columns [col0, col0 + width) of y, inside y (the caller sized it to
        // the plan) and disjoint from every other work item's tile; f32 storage is written in
        // place, other types through `res` and a narrowing copy.
        unsafe {
            if T::IS_F32 {
                let c = y.0.add(m0 * cout + col0) as *mut f32;
                sgemm::gemm_packed(mr, a.as_ptr().add(g * k_g), lda, b, (p0, p1), c, cout);
                if !epilogue.is_empty() {
                    for r in 0..mr {
                        let row = std::slice::from_raw_parts_mut(c.add(r * cout), width);
                        epilogue.apply(row, (m0 + r) * cout + col0, res);
                    }
                }
            } else {
                let ldc = (p1 - p0) * NR;
                res.resize(mr * ldc, 0.0);
                sgemm::gemm_packed(
                    mr,
                    a.as_ptr().add(g * k_g),
                    lda,
                    b,
                    (p0, p1),
                    res.as_mut_ptr(),
                    ldc,
                );
                finish_rows(res, ldc, (m0, mr), (col0, width), y, cout, epilogue);
            }
        }
    }
}

/// Apply the epilogue to f32 results (`mr` rows spaced `ldc` apart in `res`) and store them
/// into rows [m0, m0 + mr), columns [col0, col0 + width) of the NHWC output `y`.
///
/// # Safety
/// That tile of `y` (row stride `cout`) is this work item's alone.
unsafe fn finish_rows<T: Elem>(
    res: &mut [f32],
    ldc: usize,
    (m0, mr): (usize, usize),
    (col0, width): (usize, usize),
    y: TilePtr<T>,
    cout: usize,
    epilogue: &Epilogue<'_, T>,
) {
    let mut scratch = Vec::new();
    for r in 0..mr {
        // SAFETY: inside the work item's tile (the contract).
        let out = unsafe { std::slice::from_raw_parts_mut(y.0.add((m0 + r) * cout + col0), width) };
        let row = &mut res[r * ldc..r * ldc + width];
        epilogue.apply(row, (m0 + r) * cout + col0, &mut scratch);
        T::narrow(row, out);
    }
}

/// [`conv2d`] on bf16 pairs (AMX tiles or `vdpbf16ps`): A is the bf16 input itself for a 1×1
/// stride-1 layer whose channels fill whole K steps, else bf16 columns gathered per chunk (K
/// padded with zeros to the step); results come back in f32 for the bias-free epilogue and
/// the narrowing.
#[allow(clippy::too_many_arguments)]
fn conv2d_pairs<T: Elem>(
    p: &PackedConv<T>,
    b: &PackedPairs,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    threads: usize,
    epilogue: &Epilogue<'_, T>,
) {
    let c = &p.conv;
    let x16 = T::as_bf16(x).expect("bf16-pair layers store bf16");
    let (k, kp) = (b.k, b.kp());
    let m = ys.n * ys.h * ys.w;
    let cout = c.out_channels;
    let rows = (chunk_rows(m, k) * p.chunk_scale).min(m.max(1));
    let direct = is_pointwise(c) && c.in_channels == kp;
    let engine = pairs::Engine::in_use().expect("pair packings exist only with an engine");
    assert!(y.len() >= m * cout, "conv2d output buffer too small");
    let out = TilePtr(y.as_mut_ptr());
    work_items(m, rows, b.panels(), threads).for_each(|((m0, mr), (p0, p1))| {
        PAIR_COLUMNS.with_borrow_mut(|cols| {
            let a: &[bf16] = if direct {
                &x16[m0 * kp..(m0 + mr) * kp]
            } else {
                cols.resize(mr * kp, bf16::ZERO);
                im2col(c, x, xs, ys, m0, mr, &mut cols[..mr * kp], kp);
                &cols[..mr * kp]
            };
            let col0 = p0 * pairs::PANEL;
            let mut scratch = Vec::new();
            let mut narrowed = [T::default(); pairs::BLOCK_ROWS * pairs::BLOCK_COLS];
            let mut store = |d: pairs::Done<'_>| {
                let at = |r: usize| (m0 + d.row + r) * cout + col0 + d.col;
                if !epilogue.is_empty() {
                    for r in 0..d.rows {
                        let row = &mut d.values[r * pairs::BLOCK_COLS..][..d.cols];
                        epilogue.apply(row, at(r), &mut scratch);
                    }
                }
                // The block narrowed in one pass (a 32-value row per call would spend more on
                // the calls than on the conversion where K is small), then its rows copied.
                let n = d.rows * pairs::BLOCK_COLS;
                T::narrow(&d.values[..n], &mut narrowed[..n]);
                // Whole rows as fixed-size copies: a copy of a length known only at run time
                // is a call to memmove, 32 of them a block (5% of a BF16 ResNet-50 pass).
                const COLS: usize = pairs::BLOCK_COLS;
                for (r, row) in narrowed.chunks_exact(COLS).take(d.rows).enumerate() {
                    // SAFETY: rows m0..m0 + mr, columns of panels p0..p1 of y are this work
                    // item's alone; row r's `cols` values from `at(r)` are inside them.
                    unsafe {
                        if d.cols == COLS {
                            let row: &[T; COLS] = row.try_into().expect("a whole row");
                            out.add(at(r)).cast::<[T; COLS]>().write_unaligned(*row);
                        } else {
                            std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(at(r)), d.cols);
                        }
                    };
                }
            };
            // SAFETY: pair packings exist only where `simd()` chose an engine, which it does
            // only where the CPU runs it (`simd::best`); A has mr rows of kp values (zeros
            // past K: gathered so, or K = kp).
            unsafe { pairs::gemm(engine, mr, a.as_ptr(), kp, b, (p0, p1), &mut store) };
        });
    });
}

thread_local! {
    /// Per-worker bf16 columns of the bf16-pair convolutions.
    static PAIR_COLUMNS: RefCell<Vec<bf16>> = const { RefCell::new(Vec::new()) };
}

/// What a fused convolution does to its results before storing them: add a residual tensor
/// (NHWC, the output's shape) and apply an activation.
pub struct Epilogue<'a, T> {
    pub residual: Option<&'a [T]>,
    pub act: Act,
}

impl<T: Elem> Epilogue<'_, T> {
    fn is_empty(&self) -> bool {
        self.residual.is_none() && self.act == Act::None
    }

    /// Apply to `row`, the outputs starting at flat index `at`; `scratch` widens the residual.
    /// Inlined so that it is vectorised where its caller is (the Winograd output transform).
    #[inline(always)]
    pub(crate) fn apply(&self, row: &mut [f32], at: usize, scratch: &mut Vec<f32>) {
        if let Some(r) = self.residual {
            let r = &r[at..at + row.len()];
            match T::as_f32(r) {
                Some(r) => row.iter_mut().zip(r).for_each(|(v, x)| *v += x),
                None => {
                    scratch.resize(row.len(), 0.0);
                    T::widen(r, scratch);
                    row.iter_mut()
                        .zip(scratch.iter())
                        .for_each(|(v, x)| *v += x);
                }
            }
        }
        match self.act {
            Act::None => {}
            Act::Relu => row.iter_mut().for_each(|v| *v = v.max(0.0)),
            Act::Relu6 => row.iter_mut().for_each(|v| *v = v.clamp(0.0, 6.0)),
        }
    }
}

/// The convolution: `x` (xs) → `y` (ys), both NHWC.
#[allow(clippy::too_many_arguments)]
pub fn conv2d<T: Elem>(
    p: &PackedConv<T>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    threads: usize,
    residual: Option<&[T]>,
) {
    let epilogue = Epilogue {
        residual,
        act: p.conv.act,
    };
    if let Some((dw, bias)) = &p.depthwise {
        return depthwise(&p.conv, dw, bias.as_deref(), x, xs, y, ys, &epilogue);
    }
    if let Some(w) = &p.winograd {
        super::winograd::conv2d(w, &p.conv, x, xs, y, ys, &epilogue);
        return;
    }
    if let Some(b) = &p.pairs {
        return conv2d_pairs(p, b, x, xs, y, ys, threads, &epilogue);
    }
    let c = &p.conv;
    let k_g = c.kernel.0 * c.kernel.1 * (c.in_channels / c.groups);
    let k = k_g * c.groups;
    let m = ys.n * ys.h * ys.w;
    let cout = c.out_channels;
    let rows = (chunk_rows(m, k) * p.chunk_scale).min(m.max(1));
    let direct = if is_pointwise(c) { T::as_f32(x) } else { None };
    assert!(y.len() >= m * cout, "conv2d output buffer too small");
    let out = TilePtr(y.as_mut_ptr());
    work_items(m, rows, p.groups[0].panels(), threads).for_each(|((m0, mr), panels)| {
        SCRATCH.with(|s| {
            let (cols, res) = &mut *s.borrow_mut();
            let a: &[f32] = match direct {
                Some(xf) => &xf[m0 * k..(m0 + mr) * k],
                None => {
                    cols.resize(mr * k, 0.0);
                    im2col(c, x, xs, ys, m0, mr, &mut cols[..mr * k], k);
                    &cols[..mr * k]
                }
            };
            gemm_tile(
                a,
                k,
                &p.groups,
                k_g,
                (m0, mr),
                panels,
                out,
                cout,
                res,
                &epilogue,
            );
        });
    });
}

/// What [`im2col`] gathers into: f32 columns (widened) for the SGEMM, or the bf16 storage
/// itself for the bf16-pair GEMMs.
trait Gathered<T: Elem>: Copy {
    const ZERO: Self;
    fn put(src: &[T], dst: &mut [Self]);
}

impl<T: Elem> Gathered<T> for f32 {
    const ZERO: f32 = 0.0;
    fn put(src: &[T], dst: &mut [f32]) {
        match T::as_f32(src) {
            Some(src) => copy_run(src, dst),
            None => T::widen(src, dst),
        }
    }
}

impl<T: Elem> Gathered<T> for bf16 {
    const ZERO: bf16 = bf16::ZERO;
    fn put(src: &[T], dst: &mut [bf16]) {
        let src = T::as_bf16(src).expect("bf16 columns are gathered from bf16");
        copy_run(src, dst);
    }
}

/// `dst.copy_from_slice(src)`, with short runs (a stem's 7 taps × 3 channels) copied inline
/// 8 values at a time, the last 8 overlapping the ones before, instead of through a call to
/// `memcpy` per run.
#[inline(always)]
fn copy_run<V: Copy>(src: &[V], dst: &mut [V]) {
    const BLOCK: usize = 8;
    let n = src.len();
    if !(BLOCK..=8 * BLOCK).contains(&n) {
        return dst.copy_from_slice(src);
    }
    assert_eq!(n, dst.len(), "copy_run: lengths differ");
    let block = |at: usize, dst: &mut [V]| {
        let v: [V; BLOCK] = src[at..at + BLOCK].try_into().unwrap();
        dst[at..at + BLOCK].copy_from_slice(&v);
    };
    for at in (0..n - BLOCK).step_by(BLOCK) {
        block(at, dst);
    }
    block(n - BLOCK, dst);
}

/// Gather the columns of output rows [m0, m0 + mr) into `cols` (mr × K, K ordered
/// (group, ky, kx, ci)), row r at r·ld (zeros from K to ld), converting to `D` and writing
/// zeros for padding.
#[allow(clippy::too_many_arguments)]
fn im2col<T: Elem, D: Gathered<T>>(
    c: &Conv2d,
    x: &[T],
    xs: Nhwc,
    ys: Nhwc,
    m0: usize,
    mr: usize,
    cols: &mut [D],
    ld: usize,
) {
    let (kh, kw) = c.kernel;
    let cin_g = c.in_channels / c.groups;
    let k_g = kh * kw * cin_g;
    let k = k_g * c.groups;
    if c.groups == 1 && c.dilation.1 == 1 {
        return im2col_runs(c, x, xs, ys, m0, mr, cols, ld);
    }
    for r in 0..mr {
        let m = m0 + r;
        let ox = m % ys.w;
        let oy = (m / ys.w) % ys.h;
        let n = m / (ys.w * ys.h);
        let (row, pad) = cols[r * ld..(r + 1) * ld].split_at_mut(k);
        pad.fill(D::ZERO);
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
                        D::put(&x[base + g * cin_g..][..cin_g], dst);
                    } else {
                        dst.fill(D::ZERO);
                    }
                }
            }
        }
    }
}

/// [`im2col`] for ungrouped convolutions without horizontal dilation: the taps (kx, ci) of one
/// kernel row are one contiguous run of the NHWC input, copied at once (a stem's 7×3 floats
/// instead of seven 3-float copies). Rows go an output row's segment at a time, so that the
/// segment's input rows are found once, not once per output pixel, and a pixel whose window
/// lies inside the image copies its runs straight.
#[allow(clippy::too_many_arguments)]
fn im2col_runs<T: Elem, D: Gathered<T>>(
    c: &Conv2d,
    x: &[T],
    xs: Nhwc,
    ys: Nhwc,
    m0: usize,
    mr: usize,
    cols: &mut [D],
    ld: usize,
) {
    let (kh, kw) = c.kernel;
    let run = kw * xs.c;
    let (sy, sx) = c.stride;
    let (py, px) = (c.padding.0 as isize, c.padding.1 as isize);
    let mut input_rows: Vec<Option<&[T]>> = Vec::with_capacity(kh);
    let mut m = m0;
    while m < m0 + mr {
        let ox0 = m % ys.w;
        let oy = (m / ys.w) % ys.h;
        let n = m / (ys.w * ys.h);
        let seg = (ys.w - ox0).min(m0 + mr - m);
        // The input row of each kernel row, where it lies inside the image.
        input_rows.clear();
        input_rows.extend((0..kh).map(|ky| {
            let iy = (oy * sy + ky * c.dilation.0) as isize - py;
            (iy >= 0 && (iy as usize) < xs.h).then(|| {
                let at = (n * xs.h + iy as usize) * xs.w * xs.c;
                &x[at..at + xs.w * xs.c]
            })
        }));
        let rows = cols[(m - m0) * ld..(m - m0 + seg) * ld].chunks_exact_mut(ld);
        for (row, ox) in rows.zip(ox0..) {
            let (row, pad) = row.split_at_mut(kh * run);
            pad.fill(D::ZERO);
            let x_left = (ox * sx) as isize - px;
            if x_left >= 0 && x_left as usize + kw <= xs.w {
                // The whole window row inside: one straight copy per kernel row.
                let at = x_left as usize * xs.c;
                for (dst, input) in row.chunks_exact_mut(run).zip(&input_rows) {
                    match input {
                        Some(input) => D::put(&input[at..at + run], dst),
                        None => dst.fill(D::ZERO),
                    }
                }
                continue;
            }
            // Taps kx in [kx0, kx1) fall inside the image.
            let kx0 = (-x_left).clamp(0, kw as isize) as usize;
            let kx1 = (xs.w as isize - x_left).clamp(kx0 as isize, kw as isize) as usize;
            for (dst, input) in row.chunks_exact_mut(run).zip(&input_rows) {
                let (head, rest) = dst.split_at_mut(kx0 * xs.c);
                let (mid, tail) = rest.split_at_mut((kx1 - kx0) * xs.c);
                head.fill(D::ZERO);
                tail.fill(D::ZERO);
                match input {
                    Some(input) if kx1 > kx0 => {
                        let at = (x_left + kx0 as isize) as usize * xs.c;
                        D::put(&input[at..at + mid.len()], mid);
                    }
                    _ => mid.fill(D::ZERO),
                }
            }
        }
        m += seg;
    }
}

/// Depthwise convolution (one filter per channel) with its epilogue, one output row per work
/// item ([`DepthwiseRow`]), then the epilogue on the finished row. f32 activations are read
/// and written in place; half types go through widened input rows and an f32 output row.
#[allow(clippy::too_many_arguments)]
fn depthwise<T: Elem>(
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
    y[..ys.elems()]
        .par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, out)| {
            let (oy, n) = (row % ys.h, row / ys.h);
            SCRATCH.with(|s| {
                let (wide_in, wide_out) = &mut *s.borrow_mut();
                let iys: Vec<isize> = (0..kh)
                    .map(|ky| (oy * c.stride.0 + ky * c.dilation.0) as isize - c.padding.0 as isize)
                    .collect();
                let input = input_rows(x, xs, n, &iys, wide_in);
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
                as_f32_row(out, wide_out, |acc| {
                    run(&mut *acc);
                    if !epilogue.is_empty() {
                        epilogue.apply(acc, row * row_len, &mut Vec::new());
                    }
                });
            })
        });
}

/// `f` on `out` as f32: in place for f32 storage, else on `wide` (resized to `out`'s length)
/// narrowed into `out` afterwards.
fn as_f32_row<T: Elem>(out: &mut [T], wide: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
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
const DW_BLOCK: usize = 16;

/// One output row of [`depthwise`], as vectorised work: for each output pixel and each block
/// of [`DW_BLOCK`] channels, the accumulators start from the bias and stay in registers
/// through every tap (the input pixel at row ky, column ox·stride + kx·dilation − pad, where
/// inside the image, times the tap's weights), and are stored once. Channels past the last
/// whole block take a plain loop.
struct DepthwiseRow<'a> {
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

/// Apply `f` to `buf` in f32, one block at a time: in place for f32 storage, through a small
/// widened copy for half types (so conversions run over whole slices, with F16C where present,
/// instead of one scalar conversion per element). `period` is the period `f` relies on (the
/// channel count for per-channel maps, else 1): blocks are multiples of it.
fn map_f32<T: Elem>(buf: &mut [T], period: usize, f: impl Fn(&mut [f32]) + Sync) {
    let period = period.max(1);
    buf.par_chunks_mut((ELEMENTWISE_CHUNK / period).max(1) * period)
        .for_each(|part| match T::as_f32_mut(part) {
            Some(p) => f(p),
            // Half storage: widened a few KiB at a time into the worker's scratch, so the copy
            // stays in L1 between the conversions and `f`.
            None => SCRATCH.with(|s| {
                let tmp = &mut s.borrow_mut().1;
                let block = (HALF_BLOCK / period).max(1) * period;
                tmp.resize(block, 0.0);
                for sub in part.chunks_mut(block) {
                    let wide = &mut tmp[..sub.len()];
                    T::widen(sub, wide);
                    f(wide);
                    T::narrow(wide, sub);
                }
            }),
        });
}

/// Elements per widened block of a half-precision element-wise op (8 KiB of f32).
const HALF_BLOCK: usize = 2048;

/// y = x·scale + shift per channel (batch norm folded to an affine map at prepare time).
pub fn affine_inplace<T: Elem>(buf: &mut [T], c: usize, scale: &[f32], shift: &[f32]) {
    let c = c.max(1);
    if let Some(b) = T::as_bf16_mut(buf) {
        // bf16: converted in registers, one pass over memory (no widened copy).
        b.par_chunks_mut((ELEMENTWISE_CHUNK / c).max(1) * c)
            .for_each(|part| {
                with_simd(Affine {
                    part,
                    c,
                    scale,
                    shift,
                    load: bf16_f32,
                    store: f32_bf16,
                })
            });
        return;
    }
    if let Some(h) = T::as_f16_mut(buf)
        && super::simd::f16c()
    {
        // f16 with F16C: converted in registers, one pass over memory.
        h.par_chunks_mut((ELEMENTWISE_CHUNK / c).max(1) * c)
            .for_each(|part| assert!(elem::affine_f16(part, c, scale, shift)));
        return;
    }
    map_f32(buf, c, |part| {
        with_simd(Affine {
            part,
            c,
            scale,
            shift,
            load: |v: f32| v,
            store: |v: f32| v,
        })
    });
}

/// [`affine_inplace`] over whole pixels of `part`, as vectorised work: each value read as f32
/// by `load` and written back by `store` (the identity for f32, in registers for bf16).
struct Affine<'a, V, L, S> {
    part: &'a mut [V],
    c: usize,
    scale: &'a [f32],
    shift: &'a [f32],
    load: L,
    store: S,
}

impl<V: Copy, L: Fn(V) -> f32, S: Fn(f32) -> V> Vectorised for Affine<'_, V, L, S> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        for px in self.part.chunks_exact_mut(self.c) {
            for ((v, s), b) in px.iter_mut().zip(self.scale).zip(self.shift) {
                *v = (self.store)((self.load)(*v) * s + b);
            }
        }
    }
}

/// Clamp every element to [lo, hi] (ReLU: [0, ∞), ReLU6: [0, 6]).
pub fn clamp_inplace<T: Elem>(buf: &mut [T], lo: f32, hi: f32) {
    if lo == 0.0
        && hi == f32::INFINITY
        && let Some((bits, inf)) = T::half_bits_mut(buf)
    {
        // ReLU on a half type needs no conversion: a value stays when its bits, as an
        // integer, lie in 1..=+∞'s (positive, up to +∞), and becomes +0 otherwise (zeros,
        // negatives, NaNs), as the f32 path's max(v, 0) does. A compare and a select the
        // compiler vectorises.
        bits.par_chunks_mut(ELEMENTWISE_CHUNK).for_each(|part| {
            with_simd(Update(part, |v: &mut u16| {
                *v = if v.wrapping_sub(1) < inf { *v } else { 0 };
            }))
        });
        return;
    }
    map_f32(buf, 1, |part| {
        with_simd(Update(part, |v: &mut f32| *v = v.max(lo).min(hi)))
    });
}

/// a += b, element-wise.
pub fn add_inplace<T: Elem>(a: &mut [T], b: &[T]) {
    a.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(b.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(a, b)| {
            if let (Some(a), Some(b)) = (T::as_bf16_mut(a), T::as_bf16(b)) {
                // bf16: converted in registers, one pass over memory.
                return with_simd(ZipWith(a, b, |x: &mut bf16, y: &bf16| {
                    *x = f32_bf16(bf16_f32(*x) + bf16_f32(*y))
                }));
            }
            if let (Some(a), Some(b)) = (T::as_f16_mut(a), T::as_f16(b))
                && elem::add_f16(a, b)
            {
                return;
            }
            add_chunk(a, b)
        });
}

/// [`add_inplace`] of one chunk, f32 in place or through widened copies.
fn add_chunk<T: Elem>(a: &mut [T], b: &[T]) {
    let add = |x: &mut f32, y: &f32| *x += y;
    match (T::as_f32_mut(a), T::as_f32(b)) {
        (Some(a), Some(b)) => with_simd(ZipWith(a, b, add)),
        _ => {
            let (mut ta, mut tb) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
            for (a, b) in a.chunks_mut(HALF_BLOCK).zip(b.chunks(HALF_BLOCK)) {
                let (ta, tb) = (&mut ta[..a.len()], &mut tb[..a.len()]);
                T::widen(a, ta);
                T::widen(b, tb);
                with_simd(ZipWith(ta, tb, add));
                T::narrow(ta, a);
            }
        }
    }
}

/// Max or average pooling over windows, one output row per work item (`PoolRow`): f32
/// inputs read in place, half types through their widened input rows.
pub fn pool<T: Elem>(p: &Pool, max: bool, x: &[T], xs: Nhwc, y: &mut [T], ys: Nhwc) {
    let ch = xs.c;
    let row_len = ys.w * ch;
    y[..ys.elems()]
        .par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, out)| {
            let (oy, n) = (row % ys.h, row / ys.h);
            let y0 = (oy * p.stride.0) as isize - p.padding.0 as isize;
            SCRATCH.with(|s| {
                let (wide_in, wide_out) = &mut *s.borrow_mut();
                let iys: Vec<isize> = (y0..y0 + p.kernel.0 as isize).collect();
                let input = input_rows(x, xs, n, &iys, wide_in);
                let rows: Vec<(isize, Option<&[f32]>)> = iys.into_iter().zip(input).collect();
                let run = |acc: &mut [f32]| {
                    with_simd(PoolRow {
                        acc,
                        rows: &rows,
                        ch,
                        width: xs.w,
                        pool: p,
                        max,
                        // Rows and columns up to these count towards an average's divisor
                        // with `count_include_pad` (the padding, not what lies beyond it).
                        limit: ((xs.h + p.padding.0) as isize, (xs.w + p.padding.1) as isize),
                    })
                };
                as_f32_row(out, wide_out, run);
            })
        });
}

/// The input rows `iys` of image `n` as f32, `None` where a row lies outside the image: f32
/// activations in place, half types widened into `wide`.
fn input_rows<'a, T: Elem>(
    x: &'a [T],
    xs: Nhwc,
    n: usize,
    iys: &[isize],
    wide: &'a mut Vec<f32>,
) -> Vec<Option<&'a [f32]>> {
    let len = xs.w * xs.c;
    let at = |iy: isize| (iy >= 0 && (iy as usize) < xs.h).then(|| (n * xs.h + iy as usize) * len);
    if let Some(x) = T::as_f32(x) {
        return iys
            .iter()
            .map(|&iy| at(iy).map(|a| &x[a..][..len]))
            .collect();
    }
    wide.resize(iys.len() * len, 0.0);
    for (i, &iy) in iys.iter().enumerate() {
        if let Some(a) = at(iy) {
            T::widen(&x[a..][..len], &mut wide[i * len..][..len]);
        }
    }
    let wide: &'a [f32] = wide;
    iys.iter()
        .enumerate()
        .map(|(i, &iy)| at(iy).map(|_| &wide[i * len..][..len]))
        .collect()
}

/// One output row of [`pool`], as vectorised work: each output pixel's channels start from
/// −∞ (max) or 0 (average), take in each window pixel inside the image, and an average is
/// divided by its window's count.
struct PoolRow<'a> {
    acc: &'a mut [f32],
    /// Each window row's index and its input row (`None` outside the image).
    rows: &'a [(isize, Option<&'a [f32]>)],
    ch: usize,
    width: usize,
    pool: &'a Pool,
    max: bool,
    limit: (isize, isize),
}

impl Vectorised for PoolRow<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let p = self.pool;
        for (ox, out) in self.acc.chunks_exact_mut(self.ch).enumerate() {
            out.fill(if self.max { f32::NEG_INFINITY } else { 0.0 });
            let x0 = (ox * p.stride.1) as isize - p.padding.1 as isize;
            let (mut count, mut inside) = (0usize, 0usize);
            for &(iy, row) in self.rows {
                for ix in x0..x0 + p.kernel.1 as isize {
                    if iy < self.limit.0 && ix < self.limit.1 {
                        count += 1;
                    }
                    let Some(row) = row else { continue };
                    if ix < 0 || ix as usize >= self.width {
                        continue;
                    }
                    inside += 1;
                    let px = &row[ix as usize * self.ch..][..self.ch];
                    if self.max {
                        out.iter_mut().zip(px).for_each(|(a, v)| *a = a.max(*v));
                    } else {
                        out.iter_mut().zip(px).for_each(|(a, v)| *a += v);
                    }
                }
            }
            if !self.max {
                let div = if p.count_include_pad { count } else { inside } as f32;
                out.iter_mut().for_each(|a| *a /= div);
            }
        }
    }
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
            let (mut acc, mut wide) = (vec![0f32; ch], vec![0f32; ch]);
            for ox in 0..ys.w {
                let (x0, x1) = adaptive_bins(xs.w, ys.w, ox);
                acc.fill(0.0);
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let base = ((n * xs.h + iy) * xs.w + ix) * ch;
                        // Half types widened a pixel at a time by the vector conversions (one
                        // value at a time, FP16 took 10× the f32 time here).
                        let px = &x[base..base + ch];
                        let px = T::as_f32(px).unwrap_or_else(|| {
                            T::widen(px, &mut wide);
                            &wide
                        });
                        for (a, v) in acc.iter_mut().zip(px) {
                            *a += v;
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

/// NCHW f32 (the seam's layout) → NHWC storage, an image row at a time (each channel's row
/// read straight, the pixels' channels interleaved; 3-channel images, every network's input,
/// with the count fixed for the compiler). Half types interleave into an f32 row first and
/// narrow it in one vectorised pass (bf16 one value at a time took 4× the f32 time).
pub fn nchw_to_nhwc<T: Elem>(x: &[f32], xs: Nhwc, y: &mut [T]) {
    let plane = xs.h * xs.w;
    let row = (xs.w * xs.c).max(1);
    y[..xs.elems()]
        .par_chunks_mut(row)
        .enumerate()
        .for_each_init(Vec::new, |wide: &mut Vec<f32>, (r, out)| {
            let (n, iy) = (r / xs.h, r % xs.h);
            let channel = |c: usize| &x[(n * xs.c + c) * plane + iy * xs.w..][..xs.w];
            let interleave = |out: &mut [f32]| {
                if xs.c == 3 {
                    let (r, g, b) = (channel(0), channel(1), channel(2));
                    for (((px, r), g), b) in out.chunks_exact_mut(3).zip(r).zip(g).zip(b) {
                        px.copy_from_slice(&[*r, *g, *b]);
                    }
                    return;
                }
                for c in 0..xs.c {
                    for (px, &v) in out.chunks_exact_mut(xs.c).zip(channel(c)) {
                        px[c] = v;
                    }
                }
            };
            as_f32_row(out, wide, interleave);
        });
}

/// A fully connected layer's weights, packed as those of the 1×1 convolution it is over an
/// n × 1 × 1 × in image: the same GEMM paths (half panels widened a block at a time, bf16
/// pairs where the CPU multiplies them), chunked the same way.
pub struct PackedLinear<T>(PackedConv<T>);

impl<T: Elem> PackedLinear<T> {
    /// From PyTorch's (out × in) weight: a (out, in, 1, 1) convolution's.
    pub fn new(weight: &[f32], bias: Option<&[f32]>, fin: usize, fout: usize) -> Self {
        let conv = Conv2d {
            bias: bias.is_some(),
            ..Conv2d::new(fin, fout, 1, 1, 0)
        };
        PackedLinear(PackedConv::new(conv, weight, bias))
    }

    pub fn bytes(&self) -> u64 {
        self.0.bytes()
    }
}

/// Fully connected layer: y (n × out) = x (n × in) · Wᵀ + b; `dims` is (n, in, out).
pub fn linear<T: Elem>(
    x: &[T],
    w: &PackedLinear<T>,
    (n, fin, fout): (usize, usize, usize),
    y: &mut [T],
    threads: usize,
) {
    let image = |c| Nhwc { n, h: 1, w: 1, c };
    conv2d(&w.0, x, image(fin), y, image(fout), threads, None);
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// The gathered columns, in f32 and bf16, against a plain loop over every tap: kernels
    /// from 1×1 to a 7×7 stem, strides 1 and 2, padding 0 to 3, row ranges that start and end
    /// inside output rows and cross images.
    #[test]
    fn im2col_matches_a_plain_gather() {
        let cases = [
            // (kernel, stride, padding, cin, in h, in w)
            (7, 2, 3, 3, 13, 11),
            (3, 2, 1, 5, 9, 8),
            (3, 1, 1, 16, 6, 7),
            (1, 2, 0, 9, 7, 5),
            (5, 1, 2, 2, 4, 3),
            (3, 1, 0, 4, 5, 6),
        ];
        for (k, st, pad, cin, h, w) in cases {
            let c = Conv2d::new(cin, 4, k, st, pad);
            let xs = Nhwc { n: 2, h, w, c: cin };
            let (oh, ow) = ((h + 2 * pad - k) / st + 1, (w + 2 * pad - k) / st + 1);
            let ys = Nhwc {
                n: 2,
                h: oh,
                w: ow,
                c: 4,
            };
            let x: Vec<f32> = (0..xs.elems()).map(|i| i as f32 + 1.0).collect();
            let xb: Vec<bf16> = (0..xs.elems())
                .map(|i| bf16::from_f32((i % 97) as f32))
                .collect();
            let kk = k * k * cin;
            let ld = kk + 3;
            let m = ys.n * oh * ow;
            let want = |r: usize, t: usize, xv: &dyn Fn(usize) -> f32| -> f32 {
                let (ox, oy, n) = (r % ow, (r / ow) % oh, r / (ow * oh));
                if t >= kk {
                    return 0.0;
                }
                let (ky, kx, ci) = (t / (k * cin), (t / cin) % k, t % cin);
                let (iy, ix) = (
                    (oy * st + ky) as isize - pad as isize,
                    (ox * st + kx) as isize - pad as isize,
                );
                if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= w {
                    return 0.0;
                }
                xv(((n * h + iy as usize) * w + ix as usize) * cin + ci)
            };
            for (m0, mr) in [(0, m), (1, m - 1), (ow - 1, ow + 2), (m / 2, m - m / 2 - 1)] {
                let mut cols = vec![f32::NAN; mr * ld];
                im2col(&c, &x, xs, ys, m0, mr, &mut cols, ld);
                let mut colb = vec![bf16::NAN; mr * ld];
                im2col(&c, &xb, xs, ys, m0, mr, &mut colb, ld);
                for r in 0..mr {
                    for t in 0..ld {
                        let f = want(m0 + r, t, &|i| x[i]);
                        let b = want(m0 + r, t, &|i| xb[i].to_f32());
                        let case = format!("k{k} s{st} p{pad} rows {m0}+{mr}: row {r} col {t}");
                        assert_eq!(cols[r * ld + t], f, "f32 {case}");
                        assert_eq!(colb[r * ld + t].to_f32(), b, "bf16 {case}");
                    }
                }
            }
        }
    }

    /// Batch norm's affine map and the residual add on a half type, converted in registers
    /// (bf16 always, f16 where the CPU has F16C), give bit for bit what widening to f32, the
    /// f32 kernels and narrowing with `half` give, for every value of the type (up to which
    /// NaN comes out of two).
    fn halves_match_the_f32_path<T: Elem + std::fmt::Display>(
        from_bits: fn(u16) -> T,
        to_bits: fn(T) -> u16,
    ) {
        let all: Vec<T> = (0..=u16::MAX).map(from_bits).collect();
        let other: Vec<T> = (0..=u16::MAX)
            .map(|i| from_bits(i.wrapping_mul(40_503)))
            .collect();
        let widen = |v: &[T]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let narrow = |v: &[f32]| v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
        // Which NaN an operation on two NaNs gives is not defined (the compiler may swap an
        // add's operands): any NaN matches a NaN; every other value, bit for bit.
        let same = |what: &str, got: &[T], want: &[T]| {
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                if g.to_f32().is_nan() && w.to_f32().is_nan() {
                    continue;
                }
                assert_eq!(to_bits(g), to_bits(w), "{what} of element {i}: {g} vs {w}");
            }
        };
        // 24 channels: a vectorised body and a tail in every pixel; 65,520 values are
        // 2,730 whole pixels.
        let scale = [1.0, -0.5, 3.0e38, 1.0e-3, 0.0, 7.25, -2.0, 1.5].repeat(3);
        let shift: Vec<f32> = [0.0, 1.0, -1.0, 3.0e38, -0.0, 0.1, 1.0e-30, -7.0]
            .iter()
            .cycle()
            .skip(3)
            .take(24)
            .copied()
            .collect();
        let pixels = &all[..65_520];
        let mut fast = pixels.to_vec();
        affine_inplace(&mut fast, 24, &scale, &shift);
        let mut wide = widen(pixels);
        affine_inplace(&mut wide, 24, &scale, &shift);
        same("affine", &fast, &narrow(&wide));
        let mut fast = all.clone();
        add_inplace(&mut fast, &other);
        let mut wide = widen(&all);
        add_inplace(&mut wide, &widen(&other));
        same("add", &fast, &narrow(&wide));
    }

    #[test]
    fn bf16_affine_and_add_match_the_f32_path() {
        halves_match_the_f32_path(bf16::from_bits, bf16::to_bits);
    }

    #[test]
    fn f16_affine_and_add_match_the_f32_path() {
        halves_match_the_f32_path(f16::from_bits, f16::to_bits);
    }

    /// ReLU straight on the bits of a half type gives what the f32 path gives (widen,
    /// max(v, 0), narrow), up to the sign of zero, for every value: NaNs, infinities, zeros,
    /// subnormals.
    fn relu_on_bits_matches_the_f32_path<T: Elem + std::fmt::Display>(bits: fn(T) -> u16) {
        let all: Vec<T> = (0..=u16::MAX)
            .map(|b| {
                let mut v = [T::default()];
                T::half_bits_mut(&mut v).expect("a half type").0[0] = b;
                v[0]
            })
            .collect();
        let mut fast = all.clone();
        clamp_inplace(&mut fast, 0.0, f32::INFINITY);
        let mut wide: Vec<f32> = all.iter().map(|v| v.to_f32()).collect();
        clamp_inplace(&mut wide, 0.0, f32::INFINITY);
        for ((x, got), want) in all.iter().zip(&fast).zip(&wide) {
            let want = T::from_f32(*want);
            assert!(
                bits(*got) == bits(want) || (got.to_f32() == 0.0 && want.to_f32() == 0.0),
                "relu({x}) = {got}, the f32 path gives {want}"
            );
        }
    }

    #[test]
    fn bf16_relu_matches_the_f32_path() {
        relu_on_bits_matches_the_f32_path::<bf16>(bf16::to_bits);
    }

    #[test]
    fn f16_relu_matches_the_f32_path() {
        relu_on_bits_matches_the_f32_path::<f16>(f16::to_bits);
    }

    /// Even chunks: whole units, sizes within one unit of each other, in a multiple of the
    /// workers where the units allow, none above the asked size by more than a unit's rounding,
    /// together covering every row once.
    #[test]
    fn chunks_are_even() {
        let c = Chunks::new(392, 72, 12, 2);
        let sizes: Vec<usize> = (0..c.count()).map(|i| c.get(i).1).collect();
        assert_eq!(sizes, [60, 72, 60, 72, 60, 68]);
        let first: usize = sizes[..3].iter().sum();
        assert_eq!((first, 392 - first), (192, 200));
        for (m, rows, unit, threads) in [
            (3136, 768, 12, 2),
            (25088, 768, 12, 2),
            (3136, 512, 6, 3),
            (49, 96, 12, 2),
            (7, 6, 12, 4),
            (1, 1, 12, 8),
            (128, 24, 12, 2),
        ] {
            let c = Chunks::new(m, rows, unit, threads);
            let parts: Vec<(usize, usize)> = (0..c.count()).map(|i| c.get(i)).collect();
            let mut next = 0;
            for &(m0, mr) in &parts {
                assert_eq!(m0, next, "{m} {rows} {unit} {threads}: {parts:?}");
                assert!(
                    mr >= 1 && m0 % unit == 0,
                    "{m} {rows} {unit} {threads}: {parts:?}"
                );
                assert!(mr <= rows.next_multiple_of(unit), "{m} {rows}: {parts:?}");
                next = m0 + mr;
            }
            assert_eq!(next, m);
            let units = m.div_ceil(unit);
            if units >= threads {
                assert!(c.count().is_multiple_of(threads) || c.count() == units);
            }
            let whole = |mr: usize| mr.div_ceil(unit);
            let (lo, hi) = parts.iter().fold((usize::MAX, 0), |(lo, hi), &(_, mr)| {
                (lo.min(whole(mr)), hi.max(whole(mr)))
            });
            assert!(hi - lo <= 1, "{m} {rows} {unit} {threads}: {parts:?}");
        }
        let mut buf: Vec<u32> = (0..3136 * 2).collect();
        let c = Chunks::new(3136, 768, 12, 2);
        let parts = c.split_mut(&mut buf, 2);
        assert_eq!(parts.len(), c.count());
        for (i, part) in parts.iter().enumerate() {
            let (m0, mr) = c.get(i);
            assert_eq!((part.len(), part[0]), (mr * 2, (m0 * 2) as u32));
        }
    }
}

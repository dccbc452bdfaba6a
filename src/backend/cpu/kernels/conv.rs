//! Convolutions as im2col + GEMM, fused per work item: chunking of the output rows (and
//! of the channels when rows are few), the packed weights, the GEMM tile with its epilogue
//! (bias, activation, residual), and BF16 convolutions on bf16 pairs.

use std::cell::RefCell;

use half::bf16;
use rayon::prelude::*;

use super::*;
use crate::backend::cpu::bf16_gemm::{self, PackedPairs};
use crate::backend::cpu::elem::{Elem, bf16_f32, f32_bf16};
use crate::backend::cpu::sgemm::{self, NR, PackedB};
use crate::backend::cpu::simd::{Vectorised, ZipWith, with_simd};
use crate::backend::cpu::{Lines, big_buffer};
use crate::model::Precision;
use crate::model::op::{Act, Conv2d};

/// Target size of one chunk of im2col columns, in f32 elements (512 KiB, a core's L2).
pub const COLUMN_CHUNK_ELEMS: usize = 1 << 17;
/// Bounds on the output rows of one chunk: enough rows to reuse each weight panel many
/// times, few enough to leave work for every worker.
pub(super) const MIN_CHUNK_ROWS: usize = 96;
pub(super) const MAX_CHUNK_ROWS: usize = 768;

/// `$body` with `$f` bound to `$act` as a function of one value: one copy of the body per
/// activation, so that loops over values inline it (a `match` per value would not vectorise).
macro_rules! with_act {
    ($act:expr, |$f:ident| $body:expr) => {
        match $act {
            Act::None => {
                let $f = |v: f32| v;
                $body
            }
            // NaN stays NaN (issue 27).
            Act::Relu => {
                let $f = |v: f32| super::clamp_nan(v, 0.0, f32::INFINITY);
                $body
            }
            Act::Relu6 => {
                let $f = |v: f32| super::clamp_nan(v, 0.0, 6.0);
                $body
            }
            Act::Silu => {
                let $f = super::silu;
                $body
            }
            Act::Hardswish => {
                let $f = |v: f32| v * super::clamp_nan(v + 3.0, 0.0, 6.0) * super::SIXTH;
                $body
            }
            Act::Gelu => {
                let $f = super::gelu;
                $body
            }
            Act::Sigmoid => {
                let $f = super::sigmoid;
                $body
            }
            Act::Hardsigmoid => {
                let $f = |v: f32| super::clamp_nan(v + 3.0, 0.0, 6.0) * super::SIXTH;
                $body
            }
        }
    };
}
pub(super) use with_act;

/// A pointer to the output that work items write in disjoint tiles.
#[derive(Clone, Copy)]
pub(super) struct TilePtr<T>(pub(super) *mut T);
// SAFETY: work items write disjoint (row range × column range) tiles of the output, so sharing
// the base pointer between workers never lets two of them touch the same element.
unsafe impl<T> Send for TilePtr<T> {}
// SAFETY: as for Send: no two workers touch the same element through the shared pointer.
unsafe impl<T> Sync for TilePtr<T> {}

impl<T> TilePtr<T> {
    /// A pointer read through, never written (a residual's), shared between workers alike.
    pub(super) fn from_const(p: *const T) -> Self {
        TilePtr(p.cast_mut())
    }

    /// The element `i` past the base (a method, so that closures capture the whole `TilePtr`).
    ///
    /// # Safety
    /// As for `pointer::add`.
    pub(super) unsafe fn add(self, i: usize) -> *mut T {
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
    /// Depthwise BF16 layers the pair kernel runs: the weights as its pairs of tap rows.
    pub(super) depthwise_pairs: Option<Box<super::depthwise::Pairs>>,
    /// Output rows per work item, as a multiple of [`chunk_rows`]'s choice (a tile-size
    /// variant max-autotune may pick: 1, 2 or 4).
    pub chunk_scale: usize,
    /// A BF16 stem's weights (rounded to bf16) packed in f32 for the FP32 stem kernel, where
    /// that kernel runs (AVX-512) and this layer does not multiply pairs (nor has a residual):
    /// see the stem module's `conv2d_stem_f32`. Where it is present, the layer runs there.
    pub stem_f32: Option<Box<PackedB<f32>>>,
    /// Winograd F(m×m, 3×3) weights, when this layer runs that way (3×3, stride 1): `groups`
    /// is then empty.
    pub winograd: Option<crate::backend::cpu::winograd::Winograd<T>>,
    /// The weights packed as bf16 k-pairs, when this BF16 layer multiplies pairs (ungrouped
    /// layers where the CPU has AMX or AVX512_BF16, see [`uses_pairs`]): `groups` is then
    /// empty.
    pub pairs: Option<Box<PackedPairs>>,
    /// A grouped layer of a few channels a group, where the direct kernel runs it
    /// ([`super::grouped::takes`]): `groups` is then empty.
    pub(super) grouped: Option<Box<super::grouped::Grouped>>,
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
            let pairs =
                T::PRECISION == Precision::Bf16 && crate::backend::cpu::simd::depthwise_pairs();
            let depthwise_pairs = pairs
                .then(|| super::depthwise::Pairs::new(&conv, &dw))
                .flatten()
                .map(Box::new);
            return PackedConv {
                conv,
                groups: Vec::new(),
                depthwise: Some((dw, bias)),
                depthwise_pairs,
                chunk_scale: 1,
                winograd: None,
                grouped: None,
                pairs: None,
                stem_f32: None,
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
        if (T::IS_F32 || T::PRECISION == Precision::Bf16) && super::grouped::takes(&conv) {
            let grouped = super::grouped::Grouped::new::<T>(&conv, weight, bias);
            return PackedConv {
                grouped: Some(Box::new(grouped)),
                ..PackedConv::bare(conv)
            };
        }
        if uses_pairs::<T>(&conv) {
            return PackedConv {
                pairs: Some(Box::new(if super::stem::is_stem(&conv) {
                    super::stem::pack(&conv, fill(0), bias)
                } else {
                    PackedPairs::from_columns(conv.taps(), cout_g, fill(0), bias)
                })),
                ..PackedConv::bare(conv)
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
        let stem_f32 = (T::PRECISION == crate::model::Precision::Bf16
            && conv.groups == 1
            && !conv.residual
            && super::stem::runs_f32(&conv))
        .then(|| {
            let fill = fill(0);
            let rounded = move |co: usize, col: &mut [f32]| {
                fill(co, col);
                col.iter_mut().for_each(|v| *v = T::from_f32(*v).to_f32());
            };
            Box::new(PackedB::from_columns(conv.taps(), cout_g, rounded, bias))
        });
        PackedConv {
            groups,
            stem_f32,
            ..PackedConv::bare(conv)
        }
    }

    /// `conv` with no weights packed in any form yet (each packing fills its own).
    fn bare(conv: Conv2d) -> Self {
        PackedConv {
            conv,
            groups: Vec::new(),
            depthwise: None,
            depthwise_pairs: None,
            chunk_scale: 1,
            winograd: None,
            grouped: None,
            pairs: None,
            stem_f32: None,
        }
    }

    /// Pack for Winograd F(m×m, 3×3) instead, when the layer allows it.
    pub fn winograd(
        tile: crate::backend::cpu::winograd::Tile,
        conv: Conv2d,
        weight: &[f32],
        bias: Option<&[f32]>,
        out: &[usize],
    ) -> Option<Self> {
        crate::backend::cpu::winograd::eligible(&conv).then(|| PackedConv {
            winograd: Some(crate::backend::cpu::winograd::Winograd::new(
                tile, &conv, weight, bias, out,
            )),
            ..PackedConv::bare(conv)
        })
    }

    /// This packing for the same convolution with output `out` (another batch), where that
    /// output runs with `tile` (Winograd's, or none) as this packing does.
    pub fn for_output(
        mut self,
        tile: Option<crate::backend::cpu::winograd::Tile>,
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
            + self.stem_f32.as_ref().map_or(0, |b| b.bytes())
            + self.depthwise_pairs.as_ref().map_or(0, |d| d.bytes())
            + self.grouped.as_ref().map_or(0, |g| g.bytes())
    }

    /// The kernel that runs the layer over `rows` output pixels (the bf16 GEMM's engine
    /// depends on them: [`bf16_gemm::Engine::for_rows`]).
    pub fn kernel_name(&self, rows: usize) -> String {
        if let Some(w) = &self.winograd {
            return format!("conv2d_{}_{}", w.form(), T::SUFFIX);
        }
        let form = if self.pairs.is_some() && super::stem::is_stem(&self.conv) {
            if super::stem::on_tiles(&self.conv) {
                "amx_stem"
            } else {
                "dpbf16_stem"
            }
        } else if (self.pairs.as_ref()).is_some_and(|b| super::direct::fits(&self.conv, b)) {
            // A window read in place is on the tiles at any row count.
            "amx_direct"
        } else if let Some(b) = &self.pairs {
            match bf16_gemm::Engine::for_rows(b.k, rows) {
                Some(bf16_gemm::Engine::Amx) => "amx_gemm",
                _ => "dpbf16_gemm",
            }
        } else if self.stem_f32.is_some() || (T::IS_F32 && super::stem::runs_f32(&self.conv)) {
            "direct_stem"
        } else if self.depthwise_pairs.is_some() {
            "depthwise_dpbf16"
        } else if self.depthwise.is_some() {
            "depthwise_direct"
        } else if self.grouped.as_ref().is_some_and(|g| g.pairs()) {
            "grouped_dpbf16"
        } else if self.grouped.is_some() {
            "grouped_direct"
        } else if is_pointwise(&self.conv) {
            "pointwise_gemm"
        } else {
            "im2col_gemm"
        };
        format!("conv2d_{form}_{}", T::SUFFIX)
    }
}

/// Whether a convolution of this precision multiplies bf16 pairs: BF16, ungrouped, where the
/// paths in use include AMX or AVX512_BF16 (see [`crate::backend::cpu::bf16_gemm`]).
pub fn uses_pairs<T: Elem>(c: &Conv2d) -> bool {
    pair_engine::<T>(c).is_some()
}

/// The engine that multiplies the layer's bf16 pairs, where [`uses_pairs`].
pub fn pair_engine<T: Elem>(c: &Conv2d) -> Option<bf16_gemm::Engine> {
    (T::PRECISION == crate::model::Precision::Bf16 && c.groups == 1)
        .then(|| bf16_gemm::Engine::for_k(c.taps()))
        .flatten()
}

pub(super) fn is_depthwise(c: &Conv2d) -> bool {
    c.groups > 1 && c.groups == c.in_channels && c.groups == c.out_channels
}

pub(super) fn is_pointwise(c: &Conv2d) -> bool {
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
///
/// With no more chunks than workers (each worker's one chunk is its whole share, with nothing
/// after it to even the workers out) the rows are dealt out one by one instead, the chunks'
/// last tiles partial: a unit's difference is most of the time there. A 128-token prompt of a
/// language model on two workers was 70 rows and 58 in 14-row units, now 64 and 64; Winograd's
/// 16 tiles of a 7² image were 14 and 2, now 8 and 8. On an Emerald Rapids Xeon, two workers,
/// the two ways alternating in one process (medians of 40): Qwen2.5-0.5B's four projections at
/// 128 rows 1.04–1.22× the GFLOP/s in BF16 (where 64 rows then kept both halves on the bf16
/// tiles; since `sgemm::FEW_ROWS_AVX512` both widen their blocks) and 1.00–1.05× in FP32;
/// ResNet-50's 7² layers at batch 1 (49 rows: 25 and 24, not 28 and 21) 0.96–1.12× in BF16
/// and FP32, its 3×3 on Winograd 1.04–1.06×.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunks {
    m: usize,
    unit: usize,
    count: usize,
    /// Rows dealt out one by one rather than in units (no more chunks than workers).
    by_row: bool,
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
            by_row: count <= threads,
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Chunk c's first row and rows.
    pub(crate) fn get(&self, c: usize) -> (usize, usize) {
        let unit = if self.by_row { 1 } else { self.unit };
        let units = self.m.div_ceil(unit);
        let at = |c: usize| (units * c / self.count * unit).min(self.m);
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

/// How a GEMM's row chunks are cut into work items: each chunk whole where there are two for
/// each of `threads` workers or one each (a multiple of the workers), or, when there are too
/// few of them, split over the panels too. Returns the splits per chunk.
///
/// One chunk a worker used to be split in two over the panels as well (two items a worker),
/// and each half of a chunk copied the chunk's A again where its rows alias (K of 1024 or
/// 2048) and read it unpacked (8 panels, under `PACK_FROM`). On the AMX Xeon, alternating in
/// one process, ResNet-50 FP32 at batch 1 (two chunks for its 14² and 7² layers) took
/// 1.02–1.03× the time in layer3 and 1.03–1.04× in layer4 with the split (two runs of 120
/// steps; 1×1 1024 → 256 at 14² 1.04–1.09×), BF16 1.02× and 1.01×; batch 8 makes four
/// chunks or more there, whole either way.
pub(super) fn work_split(chunks: usize, panels: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    if chunks >= 2 * threads || (chunks >= threads && chunks.is_multiple_of(threads)) {
        1
    } else {
        (2 * threads).div_ceil(chunks.max(1)).min(panels).max(1)
    }
}

/// Panels [p0, p1) of split `s` out of `splits`.
pub(super) fn panel_range(panels: usize, splits: usize, s: usize) -> (usize, usize) {
    (panels * s / splits, panels * (s + 1) / splits)
}

/// Rows a worker's share must reach for the workers to split a GEMM by rows: with fewer, each
/// would stream all of B (the weights) for a few rows, so they split the panels instead, each
/// worker every row and its share of B. ResNet-50 BF16 at batch 1 on two Zen 5 cores: its 7²
/// layers (49 rows, 25 and 24 a worker) 1.11–1.31× as fast split by panels alone (2048 → 512
/// 137.6 → 105.0 µs, 3×3 over 512 277 → 229 µs, gathered twice), and the network's step
/// 0.97× as long (FP32 0.99×); at 14² (98 rows a worker) the two ways were level. Only with
/// four panels a worker or more: MobileNetV3-Large FP32 and EfficientNet-B0 BF16 at batch 1,
/// whose 7² layers include outputs of 5 to 10 panels (split 2 + 3 and so on), ran ~1% slower
/// split by panels at any count (5 of 6 rounds each), level with four a worker, while ConvNeXt-T
/// BF16 at batch 1 ran 2.3% faster (6 of 6).
const MIN_WORKER_ROWS: usize = 32;

/// Whether `m` rows dealt out one chunk a worker (`chunks`, [`Chunks`]' rows one by one) cost
/// an eighth more blocks or more than every worker taking every row and its share of the
/// `panels`, where a block's rows are padded to a whole `unit` (AMX's 32): 197 rows (ViT's
/// tokens at batch 1, or a 14² layer's 196) made 98 and 99, four blocks a worker, where all of
/// them are seven blocks for half the panels each. Smaller savings (784 rows: 13 blocks a
/// worker or 25 for half the panels) are not worth every worker reading all of A.
fn panels_cheaper(chunks: &Chunks, m: usize, unit: usize, panels: usize, threads: usize) -> bool {
    if !chunks.by_row || chunks.count() < 2 || panels < threads {
        return false;
    }
    let blocks = |rows: usize| rows.div_ceil(unit.max(1));
    let by_rows = (0..chunks.count())
        .map(|c| blocks(chunks.get(c).1))
        .max()
        .unwrap_or(0)
        * panels;
    blocks(m) * panels.div_ceil(threads) * 8 <= by_rows * 7
}

/// The work items of a GEMM of `m` rows in chunks of about `rows` made of whole `unit`s (the
/// kernel's rows per block, [`Chunks`]) over `panels` column panels ([`work_split`]), in
/// parallel: each item's rows (m0, mr) and panels [p0, p1). Where the workers' shares of rows
/// would be under [`MIN_WORKER_ROWS`] and there are four panels a worker or more, one chunk of
/// every row, its panels split among them; the same where the kernel pads a partial `unit` of
/// rows to a whole one (`padded`) and that split multiplies fewer blocks ([`panels_cheaper`]).
pub(super) fn work_items(
    m: usize,
    (rows, unit): (usize, usize),
    panels: usize,
    threads: usize,
    padded: bool,
) -> impl IndexedParallelIterator<Item = ((usize, usize), (usize, usize))> {
    let chunks = Chunks::new(m, rows, unit, threads);
    let few = (chunks.count() > 1 && m < MIN_WORKER_ROWS * threads && panels >= 4 * threads)
        || (padded && panels_cheaper(&chunks, m, unit, panels, threads));
    let (chunks, splits) = if few {
        (Chunks::new(m, m, unit, 1), threads)
    } else {
        (chunks, work_split(chunks.count(), panels, threads))
    };
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
/// group's panels [p0, p1), writing into the NHWC output `y` (row stride `cout`). `pointwise`:
/// the layer is 1×1 (a bf16 one's rows may be rounded in the GEMM's registers, see below).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_tile<T: Elem>(
    a: &[f32],
    lda: usize,
    groups: &[PackedB<T>],
    (k_g, pointwise): (usize, bool),
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
                // The GEMM's tiles store their rows finished (in registers where whole):
                // a pass over the work item's C afterwards read it back from L2.
                let fin = (!epilogue.is_empty()).then(|| sgemm::Finish {
                    act: epilogue.act,
                    residual: match epilogue.residual {
                        Some(r) => T::as_f32(r).expect("f32 storage")[m0 * cout + col0..].as_ptr(),
                        // Over the residual: C's own values, each read as its sum is stored
                        // (one K block: `writes_over_residual`).
                        None if epilogue.in_output => c.cast_const(),
                        None => std::ptr::null(),
                    },
                    bf16: None,
                });
                let a = a.as_ptr().add(g * k_g);
                sgemm::gemm_packed(mr, a, lda, b, (p0, p1), c, cout, fin);
            } else {
                // A bf16 1×1 layer's rows rounded in the small-K kernel's registers where it
                // takes the GEMM (AVX2), with the residual and activation, straight into y:
                // on a Zen 3 (2 threads, alternating passes in one process) ResNet-50 BF16's
                // 1×1 layers took 0.95× the time at batch 1 and 8 (the network 0.96–0.97×),
                // MobileNetV3-Large's b8 0.97–0.98× (its depthwise → projection pairs 0.93–
                // 0.97×). The stems (3×3 over 3 channels, K 27, im2col) took 1.03–1.06× with
                // hardswish or SiLU to apply (level without): left to the pass after.
                if T::PRECISION == Precision::Bf16 && pointwise {
                    let at = m0 * cout + col0;
                    let residual = epilogue.residual.and_then(T::as_bf16);
                    let done = sgemm::gemm_packed_bf16(
                        mr,
                        a.as_ptr().add(g * k_g),
                        lda,
                        b,
                        (p0, p1),
                        y.0.add(at).cast(),
                        cout,
                        epilogue.act,
                        residual.map_or(std::ptr::null(), |r| r[at..].as_ptr()),
                    );
                    if done {
                        continue;
                    }
                }
                // Finished and rounded by the tiles themselves where the path can (AVX-512,
                // one K block): C, laid out as y (cout apart), is then never written, only
                // the offsets of its rows taken. Elsewhere C's rows are tight (the tiles
                // store an edge panel's valid columns alone), so that where they are the
                // output's whole rows one pass finishes them all; without a residual, the
                // activation in the tiles, as for f32 (the same vector forms as
                // `Epilogue::apply`'s): the pass after them only narrows.
                let narrowed = T::PRECISION == Precision::Bf16 && sgemm::narrows_in_tiles(b.k);
                let in_tiles = epilogue.residual.is_none() && epilogue.act != Act::None;
                let (ldc, fin) = if narrowed {
                    let at = m0 * cout + col0;
                    let out = y.0.add(at).cast::<bf16>();
                    let residual = match epilogue.residual.and_then(T::as_bf16) {
                        Some(r) => r[at..].as_ptr(),
                        None if epilogue.in_output => out.cast_const(),
                        None => std::ptr::null(),
                    };
                    let bf16 = Some(sgemm::Bf16Out { out, residual });
                    (cout, Some((epilogue.act, bf16)))
                } else {
                    (width, in_tiles.then_some((epilogue.act, None)))
                };
                let fin = fin.map(|(act, bf16)| sgemm::Finish {
                    act,
                    residual: std::ptr::null(),
                    bf16,
                });
                res.resize(mr * ldc, 0.0);
                sgemm::gemm_packed(
                    mr,
                    a.as_ptr().add(g * k_g),
                    lda,
                    b,
                    (p0, p1),
                    res.as_mut_ptr(),
                    ldc,
                    fin,
                );
                if narrowed {
                    continue;
                }
                let rest = Epilogue {
                    residual: epilogue.residual,
                    in_output: false,
                    act: if in_tiles { Act::None } else { epilogue.act },
                };
                finish_rows(res, ldc, (m0, mr), (col0, width), y, cout, &rest);
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
    if ldc == width && width == cout {
        // Whole rows, tight on both sides: one run of mr · cout values. Row by row, the
        // conversion's vector loop ran at most once a row at MobileNetV3's widths (40, 72,
        // 120) and its 8-wide tail did the rest.
        // SAFETY: the work item's rows of `y`, whole (the contract; col0 is 0).
        let out = unsafe { std::slice::from_raw_parts_mut(y.0.add(m0 * cout), mr * cout) };
        let run = &mut res[..mr * cout];
        // A bf16 projection's residual added and the sums rounded in one loop: MobileNetV3-
        // Large BF16 b8 (widened) 0.987× as long, its projections with a residual 0.96–0.99×.
        if epilogue.act == Act::None
            && let Some(r) = epilogue.residual.and_then(T::as_bf16)
            && let Some(out) = T::as_bf16_mut(out)
        {
            let residual = &r[m0 * cout..][..mr * cout];
            return with_simd(AddNarrow {
                values: run,
                residual,
                out,
            });
        }
        epilogue.apply(run, m0 * cout, &mut scratch);
        T::narrow(run, out);
        return;
    }
    for r in 0..mr {
        // SAFETY: inside the work item's tile (the contract).
        let out = unsafe { std::slice::from_raw_parts_mut(y.0.add((m0 + r) * cout + col0), width) };
        let row = &mut res[r * ldc..r * ldc + width];
        epilogue.apply(row, (m0 + r) * cout + col0, &mut scratch);
        T::narrow(row, out);
    }
}

/// `out` = `values` + `residual` (widened), rounded to bf16, in one loop: a layer's output
/// with a residual and no activation (a projection), finished as [`Epilogue::apply`] and the
/// narrowing would, bit for bit, without the pass between.
struct AddNarrow<'a> {
    values: &'a [f32],
    residual: &'a [bf16],
    out: &'a mut [bf16],
}

impl Vectorised for AddNarrow<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let n = self.out.len();
        let (values, residual, out) = (&self.values[..n], &self.residual[..n], self.out);
        for i in 0..n {
            out[i] = f32_bf16(values[i] + bf16_f32(residual[i]));
        }
    }
}

/// [`conv2d`] on bf16 pairs (AMX tiles or `vdpbf16ps`): A is the bf16 input itself for a 1×1
/// stride-1 layer whose channels fill whole K steps, or its zero-bordered copy for a stride-1
/// window on AMX ([`super::direct`]), else bf16 columns gathered per chunk (K padded with
/// zeros to the step); results come back in f32 for the bias-free epilogue and the narrowing.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv2d_pairs<T: Elem>(
    p: &PackedConv<T>,
    b: &PackedPairs,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    threads: usize,
    (prologue, epilogue): (Option<&Prologue<'_>>, &Epilogue<'_, T>),
) {
    let c = &p.conv;
    let act = epilogue.act;
    let (k, kp) = (b.k, b.kp());
    let m = ys.pixels();
    let cout = c.out_channels;
    let rows = (chunk_rows(m, k) * p.chunk_scale).min(m.max(1));
    let engine =
        bf16_gemm::Engine::for_rows(k, m).expect("pair packings exist only with an engine");
    assert!(y.len() >= m * cout, "conv2d output buffer too small");
    let out = TilePtr(
        T::as_bf16_mut(y)
            .expect("bf16-pair layers store bf16")
            .as_mut_ptr(),
    );
    // Over its residual, a layer reads each value where it stores its own (`Finished`).
    let residual = match epilogue.residual {
        Some(r) => Some(T::as_bf16(r).expect("bf16-pair layers store bf16").as_ptr()),
        None => epilogue.in_output.then_some(out.0.cast_const()),
    };
    let residual = residual.map(TilePtr::from_const);
    // A stride-1 window on AMX reads its input in place (`direct`): ResNet-50 BF16 on an
    // Emerald Rapids Xeon (2 vCPU), against the gathered columns: its 3×3 64 → 64 layer at
    // 56², batch 8, 0.479× the time (6 of 6 rounds); the network's step 0.889× at batch 8 (8
    // of 8) and 0.858× at batch 1 (7 of 8).
    if prologue.is_none() && super::direct::fits(c, b) {
        let x16 = T::as_bf16(x).expect("bf16-pair layers store bf16");
        // SAFETY: `fits`; `y` holds the output (asserted above), the residual its shape.
        return unsafe {
            super::direct::conv2d(c, b, x16, xs, (out, ys), residual, act, (rows, threads))
        };
    }
    // AMX's blocks are 32 rows: chunks of 14-row units (the FP32 tile's) left most chunks a
    // last block to copy and pad, 30 of its 32 rows zeros in chunks of 98 rows (3×3 layers
    // over 128 channels and more). ResNet-50 BF16 at batch 8 on 2 Sapphire Rapids cores, 30
    // steps alternating in one process: those layers 0.71–0.90× the time, the step 0.91×.
    let units = (rows, engine.row_unit());
    // A 1×1 layer's rows are read in place, unless the engine wants them further apart than K
    // (`Engine::lda`): then they are copied. ResNet-50 BF16 at batch 8 on 2 Sapphire Rapids
    // cores (60 steps alternating in one process): its layers over 2048 channels 0.90–0.93×
    // the time, the stride-2 one over 1024 (gathered anyway) 0.90–0.95×, those over 1024
    // channels copied 0.94–1.04×.
    let lda = engine.lda(kp);
    // Split by panels where AMX would pad the workers' rows (`panels_cheaper`), only where
    // A is read in place: each work item gathers (or copies) its own rows of A, so every
    // worker would gather all of them. On an Emerald Rapids Xeon (2 vCPU, `bench/ab.py
    // --kernel`, 6 rounds) ResNet-50's 3×3 256 → 256 at 14², batch 1, read level so (0.98×,
    // gathering twice), and so did its 1×1 1024 → 256 there (1.01×); ViT-B/16 BF16 at batch
    // 1 (197 tokens) took 0.935× the time in its linear layers (kernel total over attention,
    // 5 of 6 rounds) and 0.86× the step (7 of 8).
    let in_place = prologue.is_none() && is_pointwise(c) && c.in_channels == kp && lda == kp;
    let padded = engine == bf16_gemm::Engine::Amx && in_place;
    work_items(m, units, b.panels(), threads, padded).for_each(|((m0, mr), (p0, p1))| {
        PAIR_COLUMNS.with_borrow_mut(|cols| {
            let a = match prologue {
                Some(pro) => {
                    let cin = c.in_channels;
                    let x16 = T::as_bf16(x).expect("bf16-pair layers store bf16");
                    let src = &x16[m0 * cin..(m0 + mr) * cin];
                    cols.reuse(mr * lda);
                    pro.rows(src, cin, (&mut cols[..], lda, kp), bf16_f32, f32_bf16);
                    &cols[..]
                }
                None => pair_rows(c, (x, xs, ys), (m0, mr), (kp, lda), cols),
            };
            let ends = (out, residual.map(|r| r.0.cast_const()));
            // SAFETY: pair packings exist only where `simd()` chose an engine; A has mr rows
            // of kp values lda apart (zeros past K: gathered so, or K = kp); rows m0..m0 + mr,
            // columns of panels p0..p1 of y (and the residual) are this work item's alone.
            unsafe { pairs_finished(engine, (a, lda), b, (m0, mr), (p0, p1), ends, act) };
        });
    });
}

/// Rows m0..m0 + mr of a bf16-pair layer's A (`x` → output `ys`), `kp` values each, `lda`
/// apart: for a 1×1 layer at stride 1, its input's rows ([`padded_rows`]), else gathered
/// (im2col) into `cols`, zeros past K.
pub(super) fn pair_rows<'a, T: Elem>(
    c: &Conv2d,
    (x, xs, ys): (&'a [T], Nhwc, Nhwc),
    (m0, mr): (usize, usize),
    (kp, lda): (usize, usize),
    cols: &'a mut Lines<bf16>,
) -> &'a [bf16] {
    let cin = c.in_channels;
    let x16 = T::as_bf16(x).expect("bf16-pair layers store bf16");
    if is_pointwise(c) {
        return padded_rows(&x16[m0 * cin..(m0 + mr) * cin], cin, (kp, lda), cols);
    }
    cols.reuse(mr * lda);
    im2col(c, x, xs, ys, m0, mr, &mut cols[..], lda);
    &cols[..]
}

/// Rows of `cin` bf16 values (`src`) as a bf16-pair GEMM's A of `kp` values `lda` apart: `src`
/// itself where its channels fill K and the engine reads rows K apart, else copied into
/// `cols` ([`PaddedRows`]), zeros past `cin`.
pub(super) fn padded_rows<'a>(
    src: &'a [bf16],
    cin: usize,
    (kp, lda): (usize, usize),
    cols: &'a mut Lines<bf16>,
) -> &'a [bf16] {
    if cin == kp && lda == kp {
        return src;
    }
    cols.reuse(src.len() / cin * lda);
    with_simd(PaddedRows {
        src,
        cin,
        dst: &mut cols[..],
        ld: lda,
        kp,
    });
    &cols[..]
}

/// Rows of `cin` bf16 values (`src`) copied `ld` apart into `dst`, each padded with zeros to
/// `kp`: a 1×1 layer's input as the bf16-pair GEMM's A where its channels do not fill the
/// steps. 64-byte blocks, the last one
/// overlapping the one before, after the zeros of the row's last block: no call to `memcpy`
/// and `memset` per row (a pixel's 72 channels are 144 bytes). MobileNetV3-Large BF16 at
/// batch 8 on 2 Sapphire Rapids cores, 100 steps alternating in one process: its 72 → 24
/// layer took 0.89× the time (0.79× alone at 56²), those over 24 channels fused with their
/// depthwise layers 0.86–0.91×, those over 40 channels 0.88–0.91×, the network 0.98×.
struct PaddedRows<'a> {
    src: &'a [bf16],
    cin: usize,
    dst: &'a mut [bf16],
    ld: usize,
    kp: usize,
}

impl Vectorised for PaddedRows<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        const BLOCK: usize = bf16_gemm::KSTEP;
        let (cin, kp) = (self.cin, self.kp);
        assert!(
            cin <= kp && kp <= self.ld,
            "PaddedRows: rows longer than their place"
        );
        let block = |src: &[bf16], dst: &mut [bf16]| {
            let v: [bf16; BLOCK] = src[..BLOCK].try_into().unwrap();
            dst[..BLOCK].copy_from_slice(&v);
        };
        let zeros = [bf16::ZERO; BLOCK];
        for (src, dst) in self
            .src
            .chunks_exact(cin)
            .zip(self.dst.chunks_exact_mut(self.ld))
        {
            match kp.checked_sub(BLOCK) {
                Some(at) if at <= cin => block(&zeros, &mut dst[at..]),
                _ => dst[cin..kp].fill(bf16::ZERO),
            }
            if cin < BLOCK {
                copy_run(src, &mut dst[..cin]);
                continue;
            }
            for at in (0..cin - BLOCK).step_by(BLOCK) {
                block(&src[at..], &mut dst[at..]);
            }
            block(&src[cin - BLOCK..], &mut dst[cin - BLOCK..]);
        }
    }
}

/// Rows m0..m0 + mr of the bf16-pair GEMM A · B over panels p0..p1 on `engine`, finished (B's
/// bias, the residual, `act`, narrowed to bf16) into `out`, NHWC rows as wide as B: the tail
/// of [`conv2d_pairs`] and of the stems on AMX's tiles. The `vdpbf16ps` kernels store C's rows
/// finished, in registers; storing every block through `done` and a pass over it instead
/// took 3–4% longer in MobileNetV3-Large, EfficientNet-B0 and ResNet-50 BF16 at batch 8 (the
/// minimum and the first quartile of 100–200 steps alternating in one process). AMX's blocks
/// come back in f32 and are finished the same way from L1.
///
/// # Safety
/// `engine` is [`bf16_gemm::Engine::in_use`]; `a` holds mr rows of `b.kp()` values, zeros
/// (or finite values) past K; rows m0..m0 + mr and the columns of panels p0..p1 of `out` (and
/// of the residual) are inside them and written (read) by nobody else meanwhile.
pub(super) unsafe fn pairs_finished(
    engine: bf16_gemm::Engine,
    (a, lda): (&[bf16], usize),
    b: &PackedPairs,
    (m0, mr): (usize, usize),
    (p0, p1): (usize, usize),
    (out, residual): (TilePtr<bf16>, Option<*const bf16>),
    act: Act,
) {
    let (cout, col0) = (b.n, p0 * bf16_gemm::PANEL);
    let finished = bf16_gemm::Finished {
        // SAFETY: row m0 and column col0 are inside the output (the contract).
        out: unsafe { out.add(m0 * cout + col0) },
        residual: residual.map(|r| r.wrapping_add(m0 * cout + col0)),
        ld: cout,
        act,
    };
    // SAFETY: both engines' CPUs have AVX512_BF16 (`bf16_gemm::runs`); the block's rows and
    // columns are inside the output and the caller's alone (the contract).
    let mut store = |d: bf16_gemm::Done<'_>| unsafe { d.finish(finished) };
    // SAFETY: the engine is in use, so the CPU runs it; A and the places are the caller's.
    unsafe {
        bf16_gemm::gemm(
            engine,
            mr,
            a.as_ptr(),
            lda,
            b,
            (p0, p1),
            Some(finished),
            &mut store,
        )
    };
}

thread_local! {
    /// Per-worker bf16 columns of the bf16-pair convolutions, on a cache line: AMX's tile
    /// loads read A 64 bytes a row, and rows that straddled two lines (a `Vec`'s memory
    /// starts 16 bytes into a line, or anywhere for small ones) made its 2 × 2 blocks 1.5–2×
    /// slower than aligned ones, K from 64 to 1024 (normalized to the tiles' own rate in the
    /// same runs, one Sapphire Rapids core).
    static PAIR_COLUMNS: RefCell<Lines<bf16>> = RefCell::new(big_buffer(0));
}

/// What a fused convolution does to its results before storing them: add a residual tensor
/// (NHWC, the output's shape) and apply an activation.
pub struct Epilogue<'a, T> {
    pub residual: Option<&'a [T]>,
    /// The residual is the output's own values: the output buffer holds it when the layer
    /// starts, and the GEMM's tiles read each value as they store over it (`residual` is then
    /// `None`; only where [`writes_over_residual`] said so).
    pub in_output: bool,
    pub act: Act,
}

impl<T: Elem> Epilogue<'_, T> {
    pub(super) fn is_empty(&self) -> bool {
        self.residual.is_none() && !self.in_output && self.act == Act::None
    }

    /// Apply to `row`, the outputs starting at flat index `at`; `scratch` widens the residual.
    /// Inlined so that it is vectorised where its caller is (the Winograd output transform).
    #[inline(always)]
    pub(crate) fn apply(&self, row: &mut [f32], at: usize, scratch: &mut Vec<f32>) {
        if let Some(r) = self.residual {
            let r = &r[at..at + row.len()];
            match (T::as_f32(r), T::as_bf16(r)) {
                (Some(r), _) => row.iter_mut().zip(r).for_each(|(v, x)| *v += x),
                // bf16 widened in the loop that adds it, no scratch row between: MobileNetV3-
                // Large BF16 b8 (widened) 0.976× as long, its projections with a residual
                // 0.85–0.95×.
                (_, Some(r)) => {
                    with_simd(ZipWith(row, r, |v: &mut f32, x: &bf16| *v += bf16_f32(*x)))
                }
                _ => {
                    scratch.resize(row.len(), 0.0);
                    T::widen(r, scratch);
                    row.iter_mut()
                        .zip(scratch.iter())
                        .for_each(|(v, x)| *v += x);
                }
            }
        }
        self.activate(row);
    }

    /// The activation alone, on `values` ([`super::activate`]: the widest vectors).
    #[inline(always)]
    pub(crate) fn activate(&self, row: &mut [f32]) {
        super::activate(self.act, row);
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
    conv2d_squeezed(p, x, xs, y, ys, threads, residual, None);
}

/// [`conv2d`], and where `sums` is given and the layer is depthwise, its output rows' sums per
/// channel written there as well, for the global average pool that reads the output next
/// ([`mean_of_row_sums`]): returns whether they were (f32 and bf16 on the FMA kernels).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_squeezed<T: Elem>(
    p: &PackedConv<T>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    threads: usize,
    residual: Option<&[T]>,
    sums: Option<&mut [f32]>,
) -> bool {
    let epilogue = Epilogue {
        residual,
        in_output: false,
        act: p.conv.act,
    };
    if let Some((dw, bias)) = &p.depthwise {
        let pairs = p.depthwise_pairs.as_deref();
        return depthwise(
            &p.conv,
            (dw, pairs),
            bias.as_deref(),
            x,
            xs,
            y,
            ys,
            &epilogue,
            sums,
        );
    }
    conv2d_dense(p, x, xs, y, ys, threads, (None, &epilogue));
    false
}

/// Whether [`conv2d_over_residual`] can run this layer: one on bf16 pairs (not a stem), whose
/// blocks are finished once, over all of K; or f32 storage on the im2col (or 1×1) GEMM, not
/// Winograd's or a stem's direct kernel, whose K fits in one block (a later block would read
/// partial sums where the residual was).
pub fn writes_over_residual<T: Elem>(p: &PackedConv<T>) -> bool {
    let c = &p.conv;
    let runs = match p.pairs {
        Some(_) => !super::stem::is_stem(c),
        None => {
            let k_g = c.kernel.0 * c.kernel.1 * (c.in_channels / c.groups.max(1));
            T::IS_F32 && !super::stem::runs_f32(c) && sgemm::one_k_block(k_g)
        }
    };
    runs && p.winograd.is_none() && p.depthwise.is_none() && p.grouped.is_none()
}

/// [`conv2d`] with a residual whose buffer is the output `y`: `y` holds the residual (NHWC,
/// the output's shape) when it starts and the layer's finished output after, each value read
/// by the GEMM's tile as it stores the sum over it. Where the CPU's probe says it pays
/// (`probe::over_residual`), the session runs a layer with a residual it reads last this way:
/// the output's lines are the residual's, fetched once, not a second buffer's.
///
/// # Panics
/// Where [`writes_over_residual`] says the layer cannot.
pub fn conv2d_over_residual<T: Elem>(
    p: &PackedConv<T>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    threads: usize,
) {
    assert!(
        writes_over_residual(p),
        "conv2d_over_residual on a layer that cannot run so"
    );
    let epilogue = Epilogue {
        residual: None,
        in_output: true,
        act: p.conv.act,
    };
    conv2d_dense(p, x, xs, y, ys, threads, (None, &epilogue));
}

/// A batch norm's per-channel affine map and a clamp (ReLU's [0, ∞), or none: ±∞) applied to
/// a 1×1 layer's input as its kernel reads the rows, the values rounded to the storage type as
/// the ops apart would store them: DenseNet's pre-activation (BN → ReLU → 1×1) without its two
/// passes over the features, nor the copy the batch norm makes where the features are read
/// again later (`can_prologue` says which layers take one).
#[derive(Clone, Copy)]
pub struct Prologue<'a> {
    pub scale: &'a [f32],
    pub shift: &'a [f32],
    pub lo: f32,
    pub hi: f32,
}

impl Prologue<'_> {
    /// Rows of `cin` values (`src`) mapped into `dst`, `ld` apart, zeros from `cin` to `kp`:
    /// each value read by `load`, scaled, shifted and clamped in f32, written by `store`.
    fn rows<V: Copy, W: Copy + Default>(
        &self,
        src: &[V],
        cin: usize,
        (dst, ld, kp): (&mut [W], usize, usize),
        load: impl Fn(V) -> f32,
        store: impl Fn(f32) -> W,
    ) {
        with_simd(PrologueRows {
            pro: *self,
            src,
            cin,
            dst,
            ld,
            kp,
            load,
            store,
        })
    }
}

/// [`Prologue::rows`] as vectorised work.
struct PrologueRows<'a, V, W, L, S> {
    pro: Prologue<'a>,
    src: &'a [V],
    cin: usize,
    dst: &'a mut [W],
    ld: usize,
    kp: usize,
    load: L,
    store: S,
}

impl<V: Copy, W: Copy + Default, L: Fn(V) -> f32, S: Fn(f32) -> W> Vectorised
    for PrologueRows<'_, V, W, L, S>
{
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let (
            cin,
            kp,
            Prologue {
                scale,
                shift,
                lo,
                hi,
            },
        ) = (self.cin, self.kp, self.pro);
        let (scale, shift) = (&scale[..cin], &shift[..cin]);
        assert!(
            cin <= kp && kp <= self.ld,
            "Prologue: rows longer than their place"
        );
        for (src, dst) in self
            .src
            .chunks_exact(cin)
            .zip(self.dst.chunks_exact_mut(self.ld))
        {
            for (((d, &v), s), b) in dst[..cin].iter_mut().zip(src).zip(scale).zip(shift) {
                // As the batch norm computes it (no fused multiply-add), then the clamp.
                *d = (self.store)(clamp_nan((self.load)(v) * s + b, lo, hi));
            }
            dst[cin..kp].fill(W::default());
        }
    }
}

/// Whether [`conv2d_prologue`] runs this layer: a 1×1 layer at stride 1 in f32 or bf16
/// storage on the GEMM (bf16 pairs or f32 rows), not a stem.
pub fn can_prologue<T: Elem>(p: &PackedConv<T>) -> bool {
    let storage = T::IS_F32 || T::PRECISION == Precision::Bf16;
    storage
        && is_pointwise(&p.conv)
        && (p.pairs.is_some() || p.groups.len() == 1)
        && p.winograd.is_none()
        && p.depthwise.is_none()
        && p.grouped.is_none()
        && p.stem_f32.is_none()
        && !super::stem::is_stem(&p.conv)
        && !(T::IS_F32 && super::stem::runs_f32(&p.conv))
}

/// [`conv2d`] of a layer without a residual on its input mapped by `prologue` (see
/// [`Prologue`]): bit for bit the batch norm and clamp apart, then the layer.
///
/// # Panics
/// Where [`can_prologue`] says the layer cannot run so.
pub fn conv2d_prologue<T: Elem>(
    p: &PackedConv<T>,
    x: &[T],
    (xs, prologue): (Nhwc, Prologue<'_>),
    y: &mut [T],
    ys: Nhwc,
    threads: usize,
) {
    assert!(
        can_prologue(p),
        "conv2d_prologue on a layer that cannot run so"
    );
    let epilogue = Epilogue {
        residual: None,
        in_output: false,
        act: p.conv.act,
    };
    conv2d_dense(p, x, xs, y, ys, threads, (Some(&prologue), &epilogue));
}

/// [`conv2d`] of a layer that is not depthwise, its input mapped by the prologue where there
/// is one (only where [`can_prologue`]).
fn conv2d_dense<T: Elem>(
    p: &PackedConv<T>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    threads: usize,
    (prologue, epilogue): (Option<&Prologue<'_>>, &Epilogue<'_, T>),
) {
    let residual = epilogue.residual;
    if let Some(g) = &p.grouped {
        let ours = "grouped layers store f32 or bf16";
        match (T::as_f32(x), T::as_f32_mut(y)) {
            (Some(x), Some(y)) => {
                let residual = residual.map(|r| T::as_f32(r).expect(ours));
                super::grouped::conv2d_grouped(&p.conv, g, x, xs, y, ys, residual);
            }
            _ => {
                let (x, y) = (T::as_bf16(x).expect(ours), T::as_bf16_mut(y).expect(ours));
                let residual = residual.map(|r| T::as_bf16(r).expect(ours));
                super::grouped::conv2d_grouped(&p.conv, g, x, xs, y, ys, residual);
            }
        }
        return;
    }
    if let Some(w) = &p.winograd {
        crate::backend::cpu::winograd::conv2d(w, &p.conv, x, xs, y, ys, epilogue);
        return;
    }
    if let Some(b) = &p.pairs {
        if super::stem::is_stem(&p.conv) {
            let bf = "bf16-pair layers store bf16";
            let (x, y) = (T::as_bf16(x).expect(bf), T::as_bf16_mut(y).expect(bf));
            let residual = residual.map(|r| T::as_bf16(r).expect(bf));
            return super::stem::conv2d_stem(&p.conv, b, x, xs, y, ys, threads, residual);
        }
        return conv2d_pairs(p, b, x, xs, y, ys, threads, (prologue, epilogue));
    }
    // A BF16 stem that does not multiply pairs runs on the FP32 direct kernel, reading and
    // writing bf16, where there is one (AVX-512).
    if let (Some(b), Some(x), Some(y), None) =
        (&p.stem_f32, T::as_bf16(x), T::as_bf16_mut(y), residual)
    {
        let no_residual = None::<&[bf16]>;
        return super::stem::conv2d_stem_f32(&p.conv, b, x, xs, y, ys, threads, no_residual);
    }
    // An FP32 stem runs on its direct kernel where there is one (AVX-512).
    if T::IS_F32 && super::stem::runs_f32(&p.conv) {
        let f32s = "f32 layers store f32";
        let any = &p.groups[0] as &dyn std::any::Any;
        let b = any.downcast_ref::<PackedB<f32>>().expect(f32s);
        let (x, y) = (T::as_f32(x).expect(f32s), T::as_f32_mut(y).expect(f32s));
        let residual = residual.map(|r| T::as_f32(r).expect(f32s));
        return super::stem::conv2d_stem_f32(&p.conv, b, x, xs, y, ys, threads, residual);
    }
    let c = &p.conv;
    let k_g = c.kernel.0 * c.kernel.1 * (c.in_channels / c.groups);
    let k = k_g * c.groups;
    let m = ys.n * ys.h * ys.w;
    let cout = c.out_channels;
    let rows = (chunk_rows(m, k) * p.chunk_scale).min(m.max(1));
    let pointwise = is_pointwise(c);
    let direct = if pointwise && prologue.is_none() {
        T::as_f32(x)
    } else {
        None
    };
    assert!(y.len() >= m * cout, "conv2d output buffer too small");
    let out = TilePtr(y.as_mut_ptr());
    let units = (rows, sgemm::tile_rows());
    work_items(m, units, p.groups[0].panels(), threads, false).for_each(|((m0, mr), panels)| {
        SCRATCH.with(|s| {
            let (cols, res) = &mut *s.borrow_mut();
            let a: &[f32] = match (direct, prologue) {
                (Some(xf), _) => &xf[m0 * k..(m0 + mr) * k],
                // The map's values rounded to the storage type, as the batch norm stores them.
                (None, Some(pro)) => {
                    cols.resize(mr * k, 0.0);
                    let src = &x[m0 * k..(m0 + mr) * k];
                    let dst = (&mut cols[..mr * k], k, k);
                    match (T::as_f32(src), T::as_bf16(src)) {
                        (Some(src), _) => pro.rows(src, k, dst, |v| v, |v| v),
                        (_, Some(src)) => {
                            pro.rows(src, k, dst, bf16_f32, |v| bf16_f32(f32_bf16(v)))
                        }
                        _ => unreachable!("prologues run on f32 or bf16 storage"),
                    }
                    &cols[..mr * k]
                }
                // A 1×1 layer's rows are its input's pixels, one run: widened by one call.
                // Through im2col, a call per pixel: MobileNetV3-Large BF16 b8 (widened) ran
                // 1.02× as long, its 56² 1×1 layers 1.09–1.16×.
                (None, None) if pointwise => {
                    cols.resize(mr * k, 0.0);
                    T::widen(&x[m0 * k..(m0 + mr) * k], &mut cols[..mr * k]);
                    &cols[..mr * k]
                }
                (None, None) => {
                    cols.resize(mr * k, 0.0);
                    im2col(c, x, xs, ys, m0, mr, &mut cols[..mr * k], k);
                    &cols[..mr * k]
                }
            };
            gemm_tile(
                a,
                k,
                &p.groups,
                (k_g, pointwise),
                (m0, mr),
                panels,
                out,
                cout,
                res,
                epilogue,
            );
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A projection's residual added and rounded in one loop ([`AddNarrow`]) is the epilogue
    /// and the narrowing apart, bit for bit: values that round up, down and to even, signed
    /// zeros, infinities and NaNs, runs that leave vector tails.
    #[test]
    fn add_narrow_is_apply_then_narrow() {
        let special = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1.0 + 1.0 / 256.0,
        ];
        for n in [1, 7, 16, 33, 100] {
            let values: Vec<f32> = (0..n)
                .map(|i| {
                    special
                        .get(i)
                        .copied()
                        .unwrap_or((i as f32 * 0.37).sin() * 1e3)
                })
                .collect();
            let residual: Vec<bf16> = (0..n)
                .map(|i| bf16::from_f32((i as f32 * 1.3).cos() / 3.0))
                .collect();
            let mut got = vec![bf16::ZERO; n];
            with_simd(AddNarrow {
                values: &values,
                residual: &residual,
                out: &mut got,
            });
            let epilogue = Epilogue::<bf16> {
                residual: Some(&residual),
                in_output: false,
                act: Act::None,
            };
            let mut run = values.clone();
            epilogue.apply(&mut run, 0, &mut Vec::new());
            let mut want = vec![bf16::ZERO; n];
            bf16::narrow(&run, &mut want);
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{n} values");
        }
    }

    /// A chunk for each worker (or a multiple of them) stays whole; fewer chunks than workers,
    /// or a count that does not share out evenly, are split over the panels as far as they go.
    #[test]
    fn chunks_split_over_panels_only_when_too_few() {
        assert_eq!(work_split(2, 16, 2), 1);
        assert_eq!(work_split(4, 16, 2), 1);
        assert_eq!(work_split(5, 16, 2), 1);
        assert_eq!(work_split(4, 16, 4), 1);
        assert_eq!(work_split(1, 16, 2), 4);
        assert_eq!(work_split(3, 16, 2), 2);
        assert_eq!(work_split(2, 16, 4), 4);
        assert_eq!(work_split(1, 2, 2), 2);
    }

    /// Work items cover every (row, panel) once. Workers that would get under
    /// `MIN_WORKER_ROWS` rows each (ResNet-50's 49 rows of a 7² layer at batch 1) share the
    /// panels instead, each with every row, where there are four panels a worker; more rows
    /// (196 at 14²) or fewer panels are split by rows; a single chunk (a decode step's rows)
    /// keeps its usual panel split.
    #[test]
    fn few_rows_split_the_panels() {
        let items =
            |m, rows, unit, panels, threads| items_padded(m, rows, unit, panels, threads, false);
        for (m, panels, threads) in [(49, 1, 2), (63, 3, 2), (64, 5, 2), (100, 7, 4), (1, 9, 3)] {
            items(m, 24, 6, panels, threads);
        }
        assert_eq!(
            items(49, 96, 14, 16, 2),
            [((0, 49), (0, 8)), ((0, 49), (8, 16))]
        );
        assert_eq!(
            items(196, 96, 14, 16, 2)
                .iter()
                .filter(|i| i.1 == (0, 16))
                .count(),
            4
        );
        assert_eq!(items(8, 96, 14, 16, 2).len(), 4);
        assert_eq!(
            items(49, 96, 14, 7, 2),
            [((0, 24), (0, 7)), ((24, 25), (0, 7))]
        );
    }

    /// Where a partial block of rows costs a whole one (AMX's 32), rows that would leave each
    /// worker a partial block (197: 98 and 99, four blocks each) go to every worker with half
    /// the panels (seven blocks each); rows in whole blocks (192: three each), rows whose split
    /// saves less than an eighth (784: 13 blocks each against 25), and the same 197 rows where
    /// partial blocks cost their rows alone stay split by rows.
    #[test]
    fn padded_blocks_split_the_panels_where_that_multiplies_less() {
        // (rows, chunk rows, panels, padded) → the two workers' items.
        for ((m, rows, panels, padded), want) in [
            (
                (197, 256, 144, true),
                [((0, 197), (0, 72)), ((0, 197), (72, 144))],
            ),
            (
                (192, 256, 144, true),
                [((0, 96), (0, 144)), ((96, 96), (0, 144))],
            ),
            (
                (784, 392, 16, true),
                [((0, 392), (0, 16)), ((392, 392), (0, 16))],
            ),
            (
                (197, 256, 144, false),
                [((0, 98), (0, 144)), ((98, 99), (0, 144))],
            ),
        ] {
            assert_eq!(items_padded(m, rows, 32, panels, 2, padded), want);
        }
    }

    /// [`work_items`] sorted, each (row, panel) checked to be covered once.
    fn items_padded(
        m: usize,
        rows: usize,
        unit: usize,
        panels: usize,
        threads: usize,
        padded: bool,
    ) -> Vec<((usize, usize), (usize, usize))> {
        let mut v: Vec<_> = work_items(m, (rows, unit), panels, threads, padded).collect();
        v.sort();
        let mut seen = vec![0u8; m * panels];
        for &((m0, mr), (p0, p1)) in &v {
            for r in m0..m0 + mr {
                for p in p0..p1 {
                    seen[r * panels + p] += 1;
                }
            }
        }
        assert!(
            seen.iter().all(|&n| n == 1),
            "{m} rows, {panels} panels: {v:?}"
        );
        v
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
        // One chunk a worker: a prompt's 128 rows 64 and 64 (in 14-row units, 70 and 58),
        // Winograd's 16 tiles of a 7² image 8 and 8 (2 and 14); never less than a unit each.
        let sizes = |c: Chunks| (0..c.count()).map(|i| c.get(i).1).collect::<Vec<_>>();
        assert_eq!(sizes(Chunks::new(128, 154, 14, 2)), [64, 64]);
        assert_eq!(sizes(Chunks::new(16, 96, 14, 2)), [8, 8]);
        assert_eq!(sizes(Chunks::new(8, 96, 14, 2)), [8]);
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
            // One chunk a worker at most: rows one by one, else whole units.
            let dealt = if c.count() <= threads { 1 } else { unit };
            for &(m0, mr) in &parts {
                assert_eq!(m0, next, "{m} {rows} {unit} {threads}: {parts:?}");
                assert!(
                    mr >= 1 && m0 % dealt == 0,
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
            let whole = |mr: usize| mr.div_ceil(dealt);
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

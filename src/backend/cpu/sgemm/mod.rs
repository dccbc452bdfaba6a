//! Our single-precision GEMM for the CPU backend: C = A·B (+ bias), with A row-major (the
//! im2col columns, or the activations themselves), B packed once at prepare time, and C
//! row-major. It follows the BLIS structure: B is cut into panels of `NR` columns stored
//! k-major, K into blocks of `KC` so a panel block is reused for every `MR`-row group of the
//! chunk from L1 or L2 while the chunk's A block stays in L2 — or, where the K block of all
//! the call's panels fits in half the L2 (narrow or shallow layers), the other way round: a
//! row group's A stays in L1 while it meets every panel, and C is written whole rows at a
//! time. C's lines are prefetched two tiles ahead of their tile.
//! The 6×16 register tile (12 AVX accumulators) is the classic choice for AVX2 + FMA, which
//! can issue two 8-wide FMAs per cycle. AVX-512 keeps the same panels and runs 14×32 tiles
//! over two panels side by side (28 of the 32 zmm registers accumulate; per k two B loads and
//! fourteen broadcasts for 28 FMAs), one-panel 14×16 tiles for an odd last panel. 12×16 tiles
//! (one B load and twelve broadcasts for 12 FMAs) were bound by the loads on a Zen 5, which
//! runs two 512-bit FMAs a cycle: 205 GFLOP/s on one core against 250 for 12×32, whose FMA
//! ceiling is 265. 14 rows over 12 read each B row for two more rows of A, and divide every
//! ResNet-50 layer's rows at even batches (n·56², n·28², n·14², n·7²: 392 rows were 32 tiles
//! and a part-filled one): single layers at batch 8 1–7% faster (layer4's the most), the
//! network +1.2% (10 interleaved runs). Where a call has panels enough to repay a copy
//! (`PACK_FROM`), AVX-512 packs each K block's whole 14-row groups of A k-major first
//! (`pack_groups`), BLIS's packed A: the tile's fourteen broadcasts then read one stream at
//! constant offsets from one pointer (embedded broadcasts in the FMAs) instead of fourteen
//! rows. Machines without AVX2 + FMA run the 6×16 tiling with a
//! portable kernel. Both SIMD paths also have a small-K kernel that runs one panel at a time
//! over all of a work item's rows in a single K block, without the tile's per-call costs
//! (`Kernels::stationary`); a start-up probe decides how deep it pays on the CPU.
//! FP16 and BF16 weights stay half in their panels: the same tiles, built again, widen them in
//! registers as they load them (F16C's `vcvtph2ps`; for bf16 a zero extension and a shift),
//! where the path has them (see [`gemm_packed`]). A GEMM of fewer rows than AVX2's tile (a
//! decode step's batch) gets a tile exactly that tall (`thin`), and so do a whole panel's
//! last rows short of a tile (`Kernels::tails`); AVX-512 has masked tiles of every height
//! under its tall one for both (`Kernels::exact`).
//!
//! Why not a crate: the `gemm` crate reached ~55% of this machine's peak in our measurement
//! (it repacks B on every call); packing the constant weights once and fusing the bias into
//! the tile's initial value is what this module exists for.

use std::sync::OnceLock;

use half::{bf16, f16};
use rayon::prelude::*;

use super::elem::Elem;
use super::simd::{Simd, simd};
use crate::model::op::Act;

/// Rows of the register tile.
pub const MR: usize = 6;
/// Columns of the register tile (two 8-float vectors).
pub const NR: usize = 16;
/// K block: one panel block of B is KC × NR floats (64 KiB). Each K block after the first
/// reads C back and writes it again, and BLIS's usual choice, a block that fits in L1 (256:
/// 16 KiB a panel), paid that 4–8 times over on ResNet-50's deep layers; their B blocks stream
/// from L2 as fast as the tiles use them. Single layers at batch 8 on a Zen 5 (48 KiB L1,
/// 1 MiB L2), 256 → 1024: the 1×1 2048→512 at 7×7 2.08 → 1.84 ms, the 1×1 stride-2 1024→2048
/// 4.03 → 3.67, the 3×3 stride-2 512→512 4.47 → 4.17; no layer more than noise slower, and
/// none faster again at 2048. ResNet-50 at batch 8 FP32 +1.9%, FP16 +2.5%, AVX2 tiles +1.5%.
const KC: usize = 1024;

/// B (K × N) packed in NR-column panels, each panel k-major (`NR` values per k), with the
/// last panel zero-padded; stored in the session's precision. The bias is padded the same way
/// (zeros when there is none) and kept in f32.
pub struct PackedB<T> {
    pub k: usize,
    pub n: usize,
    data: super::Lines<T>,
    bias: Vec<f32>,
}

/// A view of packed panels, what the kernels read: f32, or f16 for the tiles that widen B
/// in registers (`kernels_f16`).
pub struct Panels<'a, E = f32> {
    k: usize,
    n: usize,
    data: &'a [E],
    bias: &'a [f32],
}

impl<T: Elem> PackedB<T> {
    /// Pack B given as `b(k, j)`, for k < K and j < N.
    pub fn new(
        k: usize,
        n: usize,
        b: impl Fn(usize, usize) -> f32 + Sync,
        bias: Option<&[f32]>,
    ) -> Self {
        Self::from_columns(
            k,
            n,
            |j, col| col.iter_mut().enumerate().for_each(|(kk, v)| *v = b(kk, j)),
            bias,
        )
    }

    /// Pack B given column by column: `fill(j, col)` writes column j (K values). Faster than
    /// [`Self::new`] where a column is a contiguous or simply strided run of the source.
    pub fn from_columns(
        k: usize,
        n: usize,
        fill: impl Fn(usize, &mut [f32]) + Sync,
        bias: Option<&[f32]>,
    ) -> Self {
        let panels = n.div_ceil(NR);
        let mut data = super::big_buffer(panels * k * NR);
        // Panels in parallel: packing every layer is most of a large network's preparation.
        data.par_chunks_mut((k * NR).max(1))
            .enumerate()
            .for_each_init(Vec::new, |cols, (p, panel)| {
                // The panel's columns first, then its rows: each row is one cache line,
                // written whole and once. (`fill` writes every value of the scratch.)
                let width = NR.min(n - p * NR);
                cols.resize(width * k, 0.0);
                for (jj, col) in cols.chunks_mut(k.max(1)).enumerate() {
                    fill(p * NR + jj, col);
                }
                for (kk, row) in panel.chunks_mut(NR).enumerate() {
                    for (jj, v) in row[..width].iter_mut().enumerate() {
                        *v = T::from_f32(cols[jj * k + kk]);
                    }
                }
            });
        PackedB {
            k,
            n,
            data,
            bias: padded_bias(bias, n, panels * NR),
        }
    }

    /// Pack `count` matrices of the same shape (K × N, no bias) made together, a panel row at
    /// a time: `row(kk, j0, values)` writes elements (kk, j0..j0 + NR) of every matrix, matrix
    /// i's at `values[i·NR..(i + 1)·NR]` (columns past N are ignored). For weights that one
    /// computation turns into several matrices (Winograd's α² positions): each row is one
    /// whole cache line of each panel, written once, and `row` can work on NR columns with
    /// vector instructions.
    pub fn many_from_rows(
        count: usize,
        k: usize,
        n: usize,
        row: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) -> Vec<Self> {
        let panels = n.div_ceil(NR);
        let span = (k * NR).max(1);
        let mut data: Vec<super::Lines<T>> = (0..count)
            .map(|_| super::big_buffer(panels * span))
            .collect();
        // Panel p of every matrix, handed to one work item together.
        let mut by_panel: Vec<Vec<&mut [T]>> = (0..panels).map(|_| Vec::new()).collect();
        for matrix in &mut data {
            for (p, panel) in matrix.chunks_mut(span).enumerate() {
                by_panel[p].push(panel);
            }
        }
        by_panel
            .into_par_iter()
            .enumerate()
            .for_each(|(p, mut outs)| {
                let width = NR.min(n - p * NR);
                let mut values = vec![0f32; count * NR];
                for kk in 0..k {
                    row(kk, p * NR, &mut values);
                    for (panel, v) in outs.iter_mut().zip(values.chunks(NR)) {
                        let dst = &mut panel[kk * NR..][..width];
                        dst.iter_mut()
                            .zip(v)
                            .for_each(|(d, &v)| *d = T::from_f32(v));
                    }
                }
            });
        data.into_iter()
            .map(|data| PackedB {
                k,
                n,
                data,
                bias: vec![0f32; panels * NR],
            })
            .collect()
    }

    /// No matrix yet: scratch for [`PackedB::refill`].
    pub fn empty() -> Self {
        PackedB {
            k: 0,
            n: 0,
            data: super::big_buffer(0),
            bias: Vec::new(),
        }
    }

    /// Pack B (K × N) again in this packing's memory, on this thread: `fill(p, panel)` writes
    /// panel p's K rows of `NR` values (zeros wherever it writes nothing); no bias. For
    /// activations packed per call (attention's keys and values), whose few small panels are
    /// not worth other threads. Inlined, so `fill` is compiled for the caller's vectors (a
    /// [`super::simd::Vectorised`] work's).
    #[inline(always)]
    pub fn refill(&mut self, (k, n): (usize, usize), mut fill: impl FnMut(usize, &mut [T])) {
        let panels = n.div_ceil(NR);
        self.data.refill_zeros(panels * k * NR);
        for (p, panel) in self.data.chunks_mut((k * NR).max(1)).enumerate() {
            fill(p, panel);
        }
        (self.k, self.n) = (k, n);
        self.bias.clear();
        self.bias.resize(panels * NR, 0.0);
    }

    pub fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    /// The bytes the packing holds: its [`Self::storage`], so the two cannot disagree.
    pub fn bytes(&self) -> u64 {
        self.storage().iter().map(|s| s.len() as u64).sum()
    }

    /// The memory the panels and the bias take, as bytes: what [`Self::bytes`] counts.
    pub fn storage(&self) -> [&[u8]; 2] {
        [
            bytemuck::cast_slice(&self.data),
            bytemuck::cast_slice(&self.bias),
        ]
    }

    /// Column j of B (its K values, as stored) into `out`: the weights of one output, read
    /// back from its panel (one value per panel row, `NR` apart).
    pub fn column(&self, j: usize, out: &mut [T]) {
        assert!(
            j < self.n && out.len() == self.k,
            "column {j} of a {}×{} B",
            self.k,
            self.n
        );
        let panel = &self.data[j / NR * self.k * NR..][..self.k * NR];
        for (o, row) in out.iter_mut().zip(panel.chunks_exact(NR)) {
            *o = row[j % NR];
        }
    }
}

/// The first `n` values of `bias` (zeros where there is none), padded with zeros to `len`: a
/// packing's bias, as long as its padded columns.
pub(super) fn padded_bias(bias: Option<&[f32]>, n: usize, len: usize) -> Vec<f32> {
    let mut padded = vec![0f32; len];
    if let Some(bias) = bias {
        padded[..n].copy_from_slice(&bias[..n]);
    }
    padded
}

impl PackedB<f32> {
    /// The panels as the kernels read them.
    pub fn view(&self) -> Panels<'_> {
        Panels {
            k: self.k,
            n: self.n,
            data: &self.data,
            bias: &self.bias,
        }
    }

    /// Panel p: K rows of [`NR`] values (zeros past N), and its [`NR`] bias values.
    pub(crate) fn panel(&self, p: usize) -> (&[f32], &[f32]) {
        let span = self.k * NR;
        (&self.data[p * span..][..span], &self.bias[p * NR..][..NR])
    }
}

impl<E> Panels<'_, E> {
    pub fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }
}

/// What a GEMM does to its sums before storing them (after the last K block): add a residual
/// laid out as C (`residual` points at C's first element's counterpart, rows `ldc` apart;
/// null for none) and apply an activation. The SIMD tiles add the residual and apply ReLU or
/// ReLU6 in registers, the other activations on the tile just stored, from L1
/// (`tiles::store_tile`, `tiles::map_rows`); an edge tile finishes its local copy the same way,
/// its residual copied beside it; the portable tile row by row (`apply`). An epilogue pass over
/// a work item's C afterwards read its rows back from L2.
#[derive(Clone, Copy, Debug)]
pub struct Finish {
    pub act: Act,
    pub residual: *const f32,
    /// Where the finished sums go rounded to bf16 instead of into C (see [`narrows_in_tiles`]).
    pub bf16: Option<Bf16Out>,
}

/// A bf16 output laid out as C (the same offsets, in bf16s), and its bf16 residual (null:
/// none; `Finish::residual` is then null): each tile stores its rows finished and rounded
/// there, from registers, and C is not written. A pass over a work item's f32 rows that
/// finished and narrowed them afterwards (`conv::finish_rows`) ran from L2 with no FMAs to
/// hide its loads and stores behind: on an Emerald Rapids Xeon whose VM hides AVX512_BF16
/// and AMX (BF16 widened to the FMAs), ResNet-50 BF16 at batch 8 spent 18 of its 214 ms of
/// kernels in it (the step with it skipped, its results wrong: 195 ms, against FP32's 189).
#[derive(Clone, Copy, Debug)]
pub struct Bf16Out {
    pub out: *mut bf16,
    pub residual: *const bf16,
}

impl Finish {
    /// The same finish for the C block that starts `offset` floats further on.
    fn at(self, offset: usize) -> Self {
        fn moved<P>(p: *const P, offset: usize) -> *const P {
            if p.is_null() {
                p
            } else {
                p.wrapping_add(offset)
            }
        }
        Finish {
            residual: moved(self.residual, offset),
            bf16: self.bf16.map(|o| Bf16Out {
                out: moved(o.out.cast_const(), offset).cast_mut(),
                residual: moved(o.residual, offset),
            }),
            ..self
        }
    }

    /// Applied to `values` (a row of C, or of a local tile) whose residual row starts at
    /// `residual` (ignored where there is none).
    ///
    /// # Safety
    /// Where there is a residual, `residual` has `values.len()` readable floats.
    unsafe fn apply(self, values: &mut [f32], residual: *const f32) {
        if !self.residual.is_null() {
            // SAFETY: the caller's.
            let r = unsafe { std::slice::from_raw_parts(residual, values.len()) };
            values.iter_mut().zip(r).for_each(|(v, r)| *v += r);
        }
        crate::backend::cpu::kernels::activate(self.act, values);
    }
}

/// How a tile's accumulators start.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Init {
    /// From the bias (first K block).
    Bias,
    /// From C (later K blocks accumulate).
    Load,
}

/// Rows of the tallest register tile (AVX-512's).
const MAX_ROWS: usize = 14;

/// Panels the widest register tile spans (AVX-512's: two, 32 columns).
const MAX_PANELS: usize = 2;

/// The deepest K a kernel with a [`StationaryFn`] can take that way (see
/// `avx512::stationary`); a start-up probe finds how deep it pays on this CPU, up to this
/// ([`super::probe::small_k_reach`]). On a Zen 4 it also won on ResNet-50's 1×1 layers at K
/// 64–512 (0.90–0.97× the time of the register tile with ReLU, alone at batch 8), but
/// Winograd's per-point GEMMs (few rows, K 256–512) took 1.15–1.5× as long with it and the
/// network 1.015×. With 6 chains of FMAs it leaves a core with two 512-bit FMA units partly
/// idle: an Emerald Rapids core took 1.03–1.31× the tile's time at every K up to 64.
const STATIONARY_MAX_K: usize = 64;

/// The deepest K the AVX2 small-K kernel (`avx2::stationary`) may take: a whole K block. On
/// that path it is the register tile's own 6×16 loop without the tile's per-call costs, run a
/// panel at a time over the work item's rows, B's rows prefetched as the tile's are; on a Zen 3
/// (AVX2 only, 32 KiB L1, 512 KiB L2) it won well past K 64. Single ResNet-50 layers at
/// batch 1, its time over the tile's (paired `bench/ab.py` rounds, 2 threads): 1×1 64 → 256
/// at 56² 0.90, 256 → 64 at 56² 0.83, 128 → 512 at 56² 0.87, 512 → 128 at 28² 0.89 (over K
/// 256's), 1024 → 256 at 14² 0.86, 256 → 1024 at 7² 0.87, 512 → 2048 at 7² 0.92; Winograd's
/// per-point GEMMs (3×3 256 → 256 at 14²) 0.93 with B prefetched, 1.2 without; at batch 8
/// every layer level, a prefill-sized GEMM (144 × 896 × 4864) 0.96. The start-up probe
/// still decides ([`super::probe::small_k_reach`]).
const AVX2_SMALL_K_MAX: usize = KC;

/// The small-K kernel's time over the register tile's at this `k` (at most [`small_k_max`]),
/// measured now on one core: the GEMM of a 1×1 layer with ReLU, [`PROBE_ROWS`] rows (fewer as
/// K deepens past 64, the work kept) by `k` by [`PROBE_COLS`] columns (its C outgrows a core's
/// L2 on some CPUs, as a layer's does); the median over [`PROBE_ROUNDS`] rounds of the ratio
/// of the two kernels' fastest of [`PROBE_RUNS`] runs, alternating.
/// `None` where the SIMD path has no small-K kernel.
pub(super) fn stationary_over_tile(k: usize) -> Option<f64> {
    let tiles = kernels_for(simd());
    tiles.stationary?;
    let plain = Kernels {
        small_k: 0,
        ..tiles
    };
    let k = k.clamp(1, tiles.small_k);
    // The same multiplications at every depth: fewer rows (never under 384) as K grows.
    let m = (PROBE_ROWS * 64 / k).clamp(384, PROBE_ROWS);
    let n = PROBE_COLS;
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.01 - 0.03).collect();
    // B's panels built here, not by `PackedB`'s packing: that runs on rayon, and this probe
    // runs while `kernels()` initialises, perhaps on a pool's worker, which while it waited
    // for the packing could take another work item that asks `kernels()` again.
    let data: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.01).collect();
    let bias = vec![0f32; n];
    let b = Panels {
        k,
        n,
        data: &data,
        bias: &bias,
    };
    let mut c = vec![0f32; m * n];
    let fin = Finish {
        act: Act::Relu,
        residual: std::ptr::null(),
        bf16: None,
    };
    let mut run = |kern: Kernels| {
        let start = std::time::Instant::now();
        // SAFETY: A has m rows of k floats, C m rows of n; B's panels cover n columns.
        unsafe {
            gemm_with(
                kern,
                Order::ByCache,
                m,
                a.as_ptr(),
                k,
                &b,
                (0, n / NR),
                c.as_mut_ptr(),
                n,
                Some(fin),
            )
        };
        start.elapsed().as_secs_f64()
    };
    Some(median_ratio(|small| run(if small { tiles } else { plain })))
}

/// The median over [`PROBE_ROUNDS`] rounds of the ratio of `run(true)`'s fastest of
/// [`PROBE_RUNS`] runs over `run(false)`'s, the two alternating (`run(x)`: one run's seconds).
/// One round's fastest run is at the mercy of one quiet or busy moment (on a shared 2-vCPU
/// Zen 3 VM, single rounds of eight read 0.70–0.95 at K 16 and 0.92–1.03 at K 256 for the
/// small-K probe), the median of several much less so.
fn median_ratio(mut run: impl FnMut(bool) -> f64) -> f64 {
    let mut ratios: Vec<f64> = (0..PROBE_ROUNDS)
        .map(|_| {
            let (mut new, mut old) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..PROBE_RUNS {
                new = new.min(run(true));
                old = old.min(run(false));
            }
            new / old.max(1e-9)
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Rounds of [`stationary_over_tile`]'s measurement (odd: their median is one of them).
const PROBE_ROUNDS: usize = 7;
/// Runs of each kernel, alternating, in one round of it.
const PROBE_RUNS: usize = 4;

/// The deepest K the SIMD path in use could give its small-K kernel (0: it has none).
pub(super) fn small_k_max() -> usize {
    let path = kernels_for(simd());
    path.stationary.map_or(0, |_| path.small_k)
}

/// Whether a GEMM of depth `k` runs in one K block: its tiles then start C from the bias and
/// finish it in the same pass, so C may be the residual's own buffer (each value read before
/// it is stored over; `over_residual_over_apart`). A later block would read partial sums.
pub fn one_k_block(k: usize) -> bool {
    k <= KC
}

/// The time of a 1×1 layer's GEMM written over its residual (C is the residual's buffer, each
/// tile reading a value as it stores its sum there) over its time written into a buffer apart,
/// measured now on one core with the kernels in use: ResNet-50's 64 → 256 at 56², with ReLU,
/// half of batch 1's rows (one worker's), on [`OVER_SETS`] sets of buffers used in turn (14
/// MiB in all, past a core's L2, as a network's layers leave them); the median over
/// [`PROBE_ROUNDS`] rounds of the ratio of the fastest of [`PROBE_RUNS`] runs each,
/// alternating ([`median_ratio`]). Apart, C's lines come from wherever the buffer was last used and the
/// residual's from elsewhere; over it, they are the residual's, already on their way.
pub(super) fn over_residual_over_apart() -> f64 {
    let (m, k, n) = (1568, 64, PROBE_COLS);
    let kern = kernels();
    let data: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.01).collect();
    let bias = vec![0.1f32; n];
    let b = Panels {
        k,
        n,
        data: &data,
        bias: &bias,
    };
    // Each set: A, the residual (or the output over it), the output apart.
    let mut sets: Vec<[Vec<f32>; 3]> = (0..OVER_SETS)
        .map(|s| {
            let a = (0..m * k)
                .map(|i| ((i + s) % 7) as f32 * 0.01 - 0.03)
                .collect();
            let r = (0..m * n).map(|i| (i % 9) as f32 * 0.1 - 0.4).collect();
            [a, r, vec![0f32; m * n]]
        })
        .collect();
    let mut turn = 0;
    let run = |over: bool| {
        let [a, r, y] = &mut sets[turn % OVER_SETS];
        turn += 1;
        let c = if over { r.as_mut_ptr() } else { y.as_mut_ptr() };
        let fin = Finish {
            act: Act::Relu,
            residual: r.as_ptr(),
            bf16: None,
        };
        let start = std::time::Instant::now();
        // SAFETY: A has m rows of k floats, C and the residual m rows of n (the same buffer
        // over it: one K block, each value read before it is stored over); B's panels cover
        // n columns.
        unsafe {
            gemm_with(
                kern,
                Order::ByCache,
                m,
                a.as_ptr(),
                k,
                &b,
                (0, n / NR),
                c,
                n,
                Some(fin),
            )
        };
        start.elapsed().as_secs_f64()
    };
    median_ratio(run)
}

/// Sets of buffers [`over_residual_over_apart`] uses in turn.
const OVER_SETS: usize = 4;

/// Rows of [`stationary_over_tile`]'s GEMM.
const PROBE_ROWS: usize = 1536;
/// Columns of [`stationary_over_tile`]'s GEMM (1.5 MiB of C): whole panels.
const PROBE_COLS: usize = 256;
const _: () = assert!(PROBE_COLS.is_multiple_of(NR));

/// A kernel for a K up to [`STATIONARY_MAX_K`] in one block: C[m × cols] of one panel, started from
/// the bias and finished. Its arguments: K; A, its row stride and the rows; the panel's block
/// and bias; C, its row stride and the panel's valid columns; the finish.
type StationaryFn<E = f32> = unsafe fn(
    usize,
    (*const f32, usize, usize),
    *const E,
    *const f32,
    (*mut f32, usize, usize),
    Option<Finish>,
);

/// A register-tile kernel: C[rows × panels·NR] (+)= A[rows × kc] · the panels' blocks
/// [kc × NR each]. Its arguments: kc, the rows' A pointers (the first `rows` used), the first
/// panel's block with the distance (floats) from one panel's block to the next's, C and its
/// row stride, the rows and columns of C that are valid (the tile's own on paths without
/// [`Kernels::edges`]), how the accumulators start, the first panel's bias (the next panels'
/// follow it), and the finish of the tile's C block where this is the last K block.
type TileFn<E = f32> = unsafe fn(
    usize,
    &[*const f32; MAX_ROWS],
    (*const E, usize),
    *mut f32,
    usize,
    (usize, usize),
    Init,
    *const f32,
    Option<Finish>,
);

/// The tiles of one SIMD path: a tall one for the bulk of the rows and an `MR`-row one for
/// what is left (row counts are multiples of `MR` wherever the callers can choose them), each
/// `panels` panels wide, and the same two one panel wide for a last odd panel.
struct Kernels<E = f32> {
    rows: usize,
    panels: usize,
    tall: TileFn<E>,
    short: TileFn<E>,
    tall1: TileFn<E>,
    short1: TileFn<E>,
    /// Where the path has one, the kernel for a small K ([`STATIONARY_MAX_K`] on AVX-512,
    /// [`AVX2_SMALL_K_MAX`] on AVX2).
    stationary: Option<StationaryFn<E>>,
    /// The deepest K the small-K kernel takes (0: none), as the start-up probe found
    /// ([`super::probe::small_k_reach`]).
    small_k: usize,
    /// Where the path has no masked edge tiles (AVX2), one-panel tiles exactly 1 to `MR` − 1
    /// rows tall: for a last row group shorter than `MR` over a whole panel, in place (see
    /// [`gemm_block`]), and for a GEMM of fewer rows than `MR` ([`thin`]). Before, such a
    /// group ran the 6-row tile on a local copy, or the small-K kernel repeating its last row:
    /// six rows' FMAs for as few as one. On a Zen 3 (2 threads, alternating passes in one
    /// process): 49-row GEMMs (K 512 and 2048, ResNet-50's 7² layers at batch 1) 0.94–0.96×
    /// the time; ResNet-50 at batch 1 0.969× (FP32) and 0.973× (BF16), MobileNetV3-Large
    /// 0.983×, ViT-B/16 0.989–0.996×, ResNet-50 at batch 8 (392 rows a layer4 GEMM) 0.997×.
    tails: Option<[TileFn<E>; MR - 1]>,
    /// Where the path masks its loads and stores (AVX-512), the same four tiles for edge
    /// tiles (`tall`, `short`, `tall1`, `short1`), which read and write only C's valid rows
    /// and columns and so run in place; the other paths run an edge tile on a local copy.
    /// In place, alone on one core of an Emerald Rapids Xeon, MobileNetV3's GEMMs with a
    /// half-filled last panel: 72 → 24 with a residual (3136 rows) 120 → 99 µs, 120 → 40
    /// with one (784 rows) 66 → 60 µs, 80 → 200 181 → 173 µs; with hardswish's division gone
    /// ([`crate::backend::cpu::kernels::SIXTH`]), MobileNetV3-Large FP32 b8 took 0.945× the
    /// time and EfficientNet-B0 0.97× (alternating runs). (Masks in the whole tiles' code
    /// spilled their accumulators, whatever the extents: hence two sets.)
    edges: Option<[TileFn<E>; 4]>,
    /// Where the path masks its edges (AVX-512), tiles exactly 1 to [`MAX_ROWS`] − 1 rows
    /// tall, two panels wide and one, masked as `edges` are: the rows left under a tall tile
    /// (and a GEMM of fewer rows than one, a decode step's) run as one tile of their height,
    /// in place, where the 6-row tiles did every row's FMAs up to a multiple of 6 (49 rows,
    /// ResNet-50's 7² layers at batch 1, cost what 54 do; one row, a decode step's, what 6
    /// do), and so do the small-K kernel's last rows short of its group.
    exact: Option<[[TileFn<E>; 2]; MAX_ROWS - 1]>,
    /// Where the path has them, `tall` and `tall1` reading A packed (`PACKED`: each group of
    /// `rows` rows k-major in one buffer, [`pack_groups`]), for calls of at least `pack_from`
    /// panels over K blocks deeper than `pack_over_k`: the tile's broadcasts then read one
    /// stream instead of `rows` rows. See [`PACK_FROM`] and [`PACK_OVER_K`].
    packed: Option<[TileFn<E>; 2]>,
    pack_from: usize,
    pack_over_k: usize,
}

// Function pointers copy whatever they point at (a derive would ask E: Copy).
impl<E> Clone for Kernels<E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Kernels<E> {}

/// The kernels for the SIMD paths in use (`simd::simd()`), chosen once: the small-K kernel
/// as deep as the start-up probe found it pays.
fn kernels() -> Kernels {
    static KERNELS: OnceLock<Kernels> = OnceLock::new();
    *KERNELS.get_or_init(|| {
        let path = kernels_for(simd());
        let reach = super::probe::small_k_reach().unwrap_or(0);
        Kernels {
            small_k: reach.min(path.small_k),
            ..path
        }
    })
}

/// One `MR`-row tile, one panel wide, for every part of a GEMM (AVX2's and the portable
/// path's shape).
fn six<E>(tile: TileFn<E>) -> Kernels<E> {
    Kernels {
        rows: MR,
        panels: 1,
        tall: tile,
        short: tile,
        tall1: tile,
        short1: tile,
        stationary: None,
        small_k: 0,
        tails: None,
        edges: None,
        exact: None,
        packed: None,
        pack_from: 0,
        pack_over_k: 0,
    }
}

/// AVX2's one-panel tiles of 1 to `MR` − 1 rows of a tile family (`avx2::tile`, `tile_h`,
/// `tile_b`): [`Kernels::tails`].
#[cfg(target_arch = "x86_64")]
macro_rules! avx2_tails {
    ($($tile:ident)::+) => {
        [
            $($tile)::+::<1, 2, false, false>,
            $($tile)::+::<2, 2, false, false>,
            $($tile)::+::<3, 2, false, false>,
            $($tile)::+::<4, 2, false, false>,
            $($tile)::+::<5, 2, false, false>,
        ]
    };
}

/// AVX-512's masked tiles of 1 to [`MAX_ROWS`] − 1 rows, two panels and one wide, of a tile
/// family (`avx512::tile`, `tile_h`, `tile_b`): [`Kernels::exact`].
#[cfg(target_arch = "x86_64")]
macro_rules! avx512_exact {
    ($m:ident::$tile:ident; $($rows:literal)+) => {
        [$([$m::$tile::<$rows, 2, true, false>, $m::$tile::<$rows, 1, true, false>]),+]
    };
    ($m:ident::$tile:ident) => {
        avx512_exact!($m::$tile; 1 2 3 4 5 6 7 8 9 10 11 12 13)
    };
}

fn kernels_for(simd: Simd) -> Kernels {
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx => Kernels {
            rows: 14,
            panels: 2,
            tall: avx512::tile::<14, 2, false, false>,
            short: avx512::tile::<MR, 2, false, false>,
            tall1: avx512::tile::<14, 1, false, false>,
            short1: avx512::tile::<MR, 1, false, false>,
            stationary: Some(avx512::stationary),
            small_k: STATIONARY_MAX_K,
            tails: None,
            edges: Some([
                avx512::tile::<14, 2, true, false>,
                avx512::tile::<MR, 2, true, false>,
                avx512::tile::<14, 1, true, false>,
                avx512::tile::<MR, 1, true, false>,
            ]),
            exact: Some(avx512_exact!(avx512::tile)),
            packed: Some([
                avx512::tile::<14, 2, false, true>,
                avx512::tile::<14, 1, false, true>,
            ]),
            pack_from: PACK_FROM,
            pack_over_k: PACK_OVER_K,
        },
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2Fma => Kernels {
            stationary: Some(avx2::stationary::<f32>),
            small_k: AVX2_SMALL_K_MAX,
            tails: Some(avx2_tails!(avx2::tile)),
            ..six(avx2::tile::<MR, 2, false, false>)
        },
        _ => six(tile_portable::<MR>),
    }
}

/// The same tiles reading f16 panels, widened in registers as they are loaded, where the CPU
/// converts f16 (F16C, or AVX-512): see [`gemm_packed`].
fn kernels_f16() -> Option<Kernels<f16>> {
    static KERNELS: OnceLock<Option<Kernels<f16>>> = OnceLock::new();
    *KERNELS.get_or_init(|| kernels_f16_for(simd()))
}

/// A half-precision tile family (`tile_h`, `tile_b`) of each x86 path as [`Kernels`], AVX2's
/// where `$avx2` holds (what the family needs beyond AVX2 + FMA).
macro_rules! half_kernels {
    ($simd:expr, $tile:ident, $avx2:expr) => {
        match $simd {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx => Some(Kernels {
                rows: 14,
                panels: 2,
                tall: avx512::$tile::<14, 2, false, false>,
                short: avx512::$tile::<MR, 2, false, false>,
                tall1: avx512::$tile::<14, 1, false, false>,
                short1: avx512::$tile::<MR, 1, false, false>,
                stationary: None,
                small_k: 0,
                tails: None,
                edges: Some([
                    avx512::$tile::<14, 2, true, false>,
                    avx512::$tile::<MR, 2, true, false>,
                    avx512::$tile::<14, 1, true, false>,
                    avx512::$tile::<MR, 1, true, false>,
                ]),
                exact: Some(avx512_exact!(avx512::$tile)),
                packed: Some([
                    avx512::$tile::<14, 2, false, true>,
                    avx512::$tile::<14, 1, false, true>,
                ]),
                pack_from: PACK_FROM,
                pack_over_k: PACK_OVER_K,
            }),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2Fma if $avx2 => Some(Kernels {
                tails: Some(avx2_tails!(avx2::$tile)),
                ..six(avx2::$tile::<MR, 2, false, false>)
            }),
            _ => None,
        }
    };
}

fn kernels_f16_for(simd: Simd) -> Option<Kernels<f16>> {
    half_kernels!(simd, tile_h, super::simd::f16c())
}

/// The same tiles reading bf16 panels, widened in registers as they are loaded (a zero
/// extension and a shift), on the AVX2 and AVX-512 paths: see [`gemm_packed`].
fn kernels_bf16() -> Option<Kernels<bf16>> {
    static KERNELS: OnceLock<Option<Kernels<bf16>>> = OnceLock::new();
    *KERNELS.get_or_init(|| kernels_bf16_for(simd()).map(|k| small_k_to(k, kernels().small_k)))
}

fn kernels_bf16_for(simd: Simd) -> Option<Kernels<bf16>> {
    let kern = half_kernels!(simd, tile_b, true)?;
    // AVX2's small-K kernel reads bf16 panels too, widening them as it loads them.
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2Fma {
        return Some(Kernels {
            stationary: Some(avx2::stationary::<bf16>),
            small_k: AVX2_SMALL_K_MAX,
            ..kern
        });
    }
    Some(kern)
}

/// Rows of the tallest tile in use: row chunks that are a multiple of it never end in a
/// short tile.
pub fn tile_rows() -> usize {
    kernels().rows
}

/// The name of the kernel in use, for records and `doctor`: the SIMD path and the tall tile's
/// shape, and the bf16-pair engine's block where BF16 convolutions use one.
pub fn kernel_name() -> String {
    let path = match simd() {
        Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx => "avx512",
        Simd::Avx2Fma => "avx2-fma",
        Simd::Portable => "portable",
    };
    let pairs =
        super::bf16_gemm::Engine::in_use().map_or(String::new(), |e| format!(", {}", e.name()));
    let kern = kernels();
    format!("{path} {}x{}{pairs}", kern.rows, kern.panels * NR)
}

/// C[0..m, cols of panels p0..p1] = A[0..m, 0..K] · B + bias, single-threaded.
///
/// `c` points at row 0, column p0·NR of C.
///
/// # Safety
/// `a` must point to `m` rows of at least `b.k` readable floats spaced `lda` apart, and `c` to
/// `m` rows spaced `ldc` apart of at least `min(p1·NR, n) − p0·NR` writable floats; `c` must
/// not overlap `a`. Other threads may write other tiles of the same matrix at the same time.
pub unsafe fn gemm(
    m: usize,
    a: *const f32,
    lda: usize,
    b: &Panels<'_>,
    (p0, p1): (usize, usize),
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        gemm_with(
            kernels(),
            Order::ByCache,
            m,
            a,
            lda,
            b,
            (p0, p1),
            c,
            ldc,
            None,
        )
    }
}

/// The order [`gemm_block`] runs its tiles in (the tests force each of the first two).
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(test), allow(dead_code))]
enum Order {
    /// Every panel for one row group, then the next row group.
    RowsOuter,
    /// Every row group for one panel, then the next panel.
    PanelsOuter,
    /// Rows outer where the block of B fits the cache for it ([`row_outer_fits`]).
    ByCache,
}

#[allow(clippy::too_many_arguments)]
unsafe fn gemm_with<E>(
    kern: Kernels<E>,
    order: Order,
    m: usize,
    a: *const f32,
    lda: usize,
    b: &Panels<'_, E>,
    (p0, p1): (usize, usize),
    c: *mut f32,
    ldc: usize,
    fin: Option<Finish>,
) {
    // SAFETY: forwarded from the contract of `gemm` (and `gemm_packed`'s for `fin`).
    unsafe {
        // Fewer rows than a tile (a decode step): each panel is read once, whole. K blocks
        // keep a panel's block in cache for the next row group, and here there is none; they
        // cut the panel's stream into KC-row pieces a panel apart. Qwen2.5-0.5B's down
        // projection (K 4864) at one row, two threads on a Zen 3, in one process: 0.91–0.97×
        // the time in BF16 (4 runs), 0.98× in FP32 (2 runs).
        let kc = if m < MR { b.k } else { KC };
        // Packed row groups are out of the way of each other's L1 sets: no copy first.
        let copy = aliases(lda) && m > 1 && packed_groups(&kern, m, (p0, p1), kc.min(b.k)) == 0;
        for_k_blocks(m, a, lda, (b.k, kc), copy, |a, lda, block| {
            let panels = (p0, p1);
            with_packed_groups(&kern, m, (a, lda), panels, block.kc, |packed| {
                let a = (a, lda, packed);
                gemm_block(kern, order, m, a, b, panels, block, c, ldc, fin)
            })
        })
    }
}

/// `kern` for a GEMM of `m` rows: where `m` is under `MR` (a decode step's batch) and the path
/// has tiles that tall ([`Kernels::tails`]: AVX2, which has no masked edge tiles), every tile
/// exactly `m` rows tall. The 6-row tile on a local copy did six rows' FMAs for one and, on
/// bf16 panels, could not keep pace with memory.
fn thin<E>(kern: Kernels<E>, m: usize) -> Kernels<E> {
    match kern.tails {
        Some(tails) if (1..MR).contains(&m) && kern.rows == MR && kern.panels == 1 => {
            let t = tails[m - 1];
            Kernels {
                rows: m,
                tall: t,
                short: t,
                tall1: t,
                short1: t,
                ..kern
            }
        }
        _ => kern,
    }
}

/// [`gemm`] straight from packed `b` in any storage type: f32 panels are read in place, f16
/// panels too where the CPU converts f16 (the f16 tiles widen B in registers as they load
/// it, `vcvtph2ps`), and bf16 panels on the AVX2 and AVX-512 paths (the bf16 tiles: a zero
/// extension and a shift) up to `FEW_ROWS` rows (above them, a K block at a time). Widened
/// a block at a time, as the portable path still does, a
/// decode step of Qwen2.5-0.5B BF16 on a Zen 3 (AVX2) read its weights at 45% of the
/// measured bandwidth; with the bf16 tiles 62–65%, and with tiles as tall as its one row
/// (`thin`) 74–80% (FP32: 83–90% before and after). Other half panels (f16 without
/// F16C, the portable path) are widened one K block of a tile's panels at a time into the
/// worker's buffer just before that block's tiles run.
/// Widening the whole matrix first (as once per layer call) wrote and read back a 4-byte copy
/// of every weight, which at small batches cost more than the multiplications it fed; the
/// blocks still wrote one per work item, a fifth of an FP16 ResNet-50 pass at batch 1. The
/// f16 tiles, on a Zen 5: FP16 ResNet-50 batch 1 43.8 → 53.0 images/s, batch 8 +5%, batch 32
/// +4% (3 interleaved runs each). With `fin`, C is stored finished (see [`Finish`]).
///
/// # Safety
/// As for [`gemm`]; a residual of `fin` has C's `m` rows of columns, `ldc` apart, readable.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_packed<T: Elem>(
    m: usize,
    a: *const f32,
    lda: usize,
    b: &PackedB<T>,
    panels: (usize, usize),
    c: *mut f32,
    ldc: usize,
    fin: Option<Finish>,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe { gemm_packed_to(usize::MAX, m, a, lda, b, panels, c, ldc, fin) }
}

/// Whether [`gemm_packed`] of `k`-deep panels finishes into a bf16 output in its tiles
/// ([`Finish::bf16`], with any activation): on AVX-512, whose tiles mask their edges in place,
/// where K is one block (C is then written once, by the finish) and deeper than the small-K
/// kernel's reach (its rows store f32). Elsewhere the caller finishes f32 rows itself.
pub fn narrows_in_tiles(k: usize) -> bool {
    simd() >= Simd::Avx512 && k <= KC && k > kernels().small_k
}

/// [`gemm_packed`] for Winograd's per-point GEMMs (a few rows of tiles against each point's
/// B, read once): the small-K kernel only as deep as AVX-512's (`STATIONARY_MAX_K`, 64). AVX2's
/// deeper reach lost there on a Zen 3: F(4×4) layers of ResNet-50 at batch 1 took 1.00–1.07×
/// and F(2×2) ones 1.05–1.11× the register tile's time in the network.
///
/// # Safety
/// As for [`gemm_packed`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_packed_per_point<T: Elem>(
    m: usize,
    a: *const f32,
    lda: usize,
    b: &PackedB<T>,
    panels: (usize, usize),
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe { gemm_packed_to(STATIONARY_MAX_K, m, a, lda, b, panels, c, ldc, None) }
}

/// [`gemm_packed`] of bf16 panels into bf16 C (`ldc` apart), finished: `act` after adding the
/// bf16 `residual` laid out as C (null: none). Where the small-K kernel stores bf16 (AVX2) and
/// takes this GEMM (K within its reach, at least a tile's rows, A's rows not aliasing), it
/// runs (on B's panels in place up to `FEW_ROWS` rows, else on each panel's block widened)
/// and rounds C's rows in registers as it stores them, and this returns true; elsewhere
/// it writes nothing and returns false, and the caller goes the f32 way ([`gemm_packed`] into
/// f32 rows, then a pass that finishes and narrows them).
///
/// # Safety
/// As for [`gemm_packed`], with C and the residual of bf16s.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_packed_bf16<T: Elem>(
    m: usize,
    a: *const f32,
    lda: usize,
    b: &PackedB<T>,
    (p0, p1): (usize, usize),
    c: *mut bf16,
    ldc: usize,
    act: Act,
    residual: *const bf16,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let kern = kernels();
        let takes = simd() == Simd::Avx2Fma
            && kern.stationary.is_some()
            && b.k <= kern.small_k
            && m >= MR
            && !aliases(lda);
        let Some(data) = T::as_bf16(&b.data).filter(|_| takes) else {
            return false;
        };
        let len = b.k * NR;
        let in_place = m <= FEW_ROWS;
        B_BLOCK.with_borrow_mut(|wide| {
            if !in_place {
                wide.resize(len, 0.0);
            }
            for p in p0..p1 {
                let off = (p - p0) * NR;
                let cols = NR.min(b.n - p * NR);
                // Null stays null: the kernel adds no residual then.
                let residual = residual.wrapping_add(if residual.is_null() { 0 } else { off });
                let (bias, block) = (b.bias[p * NR..].as_ptr(), &data[p * len..][..len]);
                let out = (c.wrapping_add(off), ldc, cols);
                // SAFETY: the AVX2 path is in use (so the CPU has AVX2 and FMA); A's m rows of
                // K floats and C's (and the residual's) m rows of the panel's `cols` columns
                // are the caller's (the contract); B's panel is read in place, or widened in
                // `wide`.
                unsafe {
                    if in_place {
                        let call = (b.k, (a, lda, m), block.as_ptr(), bias, out, residual);
                        avx2::stationary_to(call, act)
                    } else {
                        <bf16 as Elem>::widen(block, wide);
                        let call = (b.k, (a, lda, m), wide.as_ptr(), bias, out, residual);
                        avx2::stationary_to(call, act)
                    }
                }
            }
        });
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (m, a, lda, b, (p0, p1), c, ldc, act, residual);
        false
    }
}

/// Rows up to which a GEMM on bf16 panels reads them in place (the bf16 tiles, or within the
/// small-K kernel's reach AVX2's, widened as they are loaded: `avx2::stationary`) rather than
/// widening each panel's K block into a buffer first: with few rows, few row groups share the
/// widening (see `gemm_packed_to` for deeper K). Within the small-K kernel's reach, one
/// thread's work item on a Zen 3, the two alternating in one process, in-place time over
/// widened: 49 rows (ResNet-50's 7² layers at batch 1, 512 → 2048) 0.93×; 98–196 rows (14²)
/// 1.00–1.03×, 392 (7² at batch 8) 1.02×, 784 (28²) 1.08×.
/// (AVX2's; AVX-512's is [`FEW_ROWS_AVX512`].)
const FEW_ROWS: usize = 64;

/// [`FEW_ROWS`] on the AVX-512 path, where the first row group's tile widens a panel pair's
/// block for the rest as it multiplies it (`first_group_widening`): from a third row group
/// the block pays. On an Emerald Rapids Xeon whose VM hides AMX (BF16 widened to the FMAs),
/// two threads, against 64 (alternating): Qwen2.5-0.5B BF16's prefill of 128 tokens at batch
/// 1 (two 64-row work items a GEMM) 0.90× the time (8 of 8 rounds); at batch 1, the 1×1
/// layers' total over a control's (`bench/ab.py`, 8 rounds) EfficientNet-B0 0.970× (7 of
/// 8), ResNet-50 0.967× (6 of 8), MobileNetV3-Large 0.979× (6 of 8), ConvNeXt-T's linears
/// 0.987× (5 of 8).
const FEW_ROWS_AVX512: usize = 2 * MAX_ROWS;

/// [`gemm_packed`] with the small-K kernel no deeper than `small_k_max`.
///
/// # Safety
/// As for [`gemm_packed`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_packed_to<T: Elem>(
    small_k_max: usize,
    m: usize,
    a: *const f32,
    lda: usize,
    b: &PackedB<T>,
    (p0, p1): (usize, usize),
    c: *mut f32,
    ldc: usize,
    fin: Option<Finish>,
) {
    // Panels read in place by `$kern`'s tiles: the call is done.
    macro_rules! in_place {
        ($data:expr, $kern:expr) => {{
            let view = Panels {
                k: b.k,
                n: b.n,
                data: $data,
                bias: &b.bias,
            };
            let kern = $kern;
            // SAFETY: forwarded from this function's contract; the half tiles read the panels
            // as the f32 ones do, element for element.
            return unsafe {
                gemm_with(
                    kern,
                    Order::ByCache,
                    m,
                    a,
                    lda,
                    &view,
                    (p0, p1),
                    c,
                    ldc,
                    fin,
                )
            };
        }};
    }
    let f32_kernels = small_k_to(kernels(), small_k_max);
    if let Some(data) = T::as_f32(&b.data) {
        in_place!(data, thin(f32_kernels, m));
    }
    if let (Some(data), Some(kern)) = (
        T::as_f16(&b.data),
        kernels_f16().map(|k| small_k_to(k, small_k_max)),
    ) {
        in_place!(data, thin(kern, m));
    }
    // The bf16 tiles (B widened in registers as each tile loads it) up to `FEW_ROWS` rows
    // (`FEW_ROWS_AVX512` on AVX-512); above them each panel's K block is widened once into a buffer
    // that all the rows' tiles then read as f32. Within the small-K kernel's reach widening the
    // (single) K block and running the small-K kernel was faster from 64 rows on a Zen 3 (768 rows,
    // K 72 → 24, one thread, took 1.5× as long on the bf16 tiles); deeper the two were level there
    // (K 1152 → 128 0.99×, 4608 → 512 1.01×, 96 rows 2048 → 512 0.97×), while on an Emerald Rapids
    // Xeon, whose 512-bit FMAs on two ports leave the tiles' widening (a shuffle and a shift a
    // panel per k, beside fourteen rows' FMAs) nowhere to hide, the block was ahead: one thread
    // pinned, `bench/ab.py` 8 rounds, ResNet-50 BF16 0.943× the time at batch 1 (7 of 8; widened
    // from 96 rows, which splits its layers as 64 does) and 0.930× at batch 8 (7 of 8; widened from
    // any rows), its im2col GEMMs at batch 1 0.943× with this rule (8 of 8), `peak --precision
    // bf16` 1024³ best 140–145 against 130–134 GFLOP/s. Widened from any rows, even a decode step's
    // one, batch 1 took 1.07× the time of widening from 96 (slower in 8 of 8 rounds: under a few
    // tiles the blocks cost more than they save). AVX2's 6-row tiles keep the bf16 tiles beyond the
    // small-K kernel's reach: forced onto AVX2 on the same Xeon, the widened blocks took ResNet-50
    // BF16 batch 8 1.08× the time (one thread, 5 of 6 rounds), likely because a panel's bf16 block
    // of K 1024 (32 KiB) fits its 48 KiB L1 and the f32 one does not.
    let within_small_k = b.k <= f32_kernels.small_k;
    let few = match simd() >= Simd::Avx512 {
        true => FEW_ROWS_AVX512,
        false => FEW_ROWS,
    };
    let tiles_take = m <= few || (simd() == Simd::Avx2Fma && !within_small_k);
    if let (Some(data), Some(kern)) = (
        T::as_bf16(&b.data).filter(|_| tiles_take),
        kernels_bf16().map(|k| small_k_to(k, small_k_max)),
    ) {
        in_place!(data, thin(kern, m));
    }
    let kern = f32_kernels;
    // A's row groups are packed once per K block for all the call's panels (where
    // `packed_groups` says they pay, as for f32 panels), not by each widened panel group's
    // call: one or two panels, under `PACK_FROM`, which read A's fourteen rows in place. On
    // an Emerald Rapids Xeon whose VM hides AMX (BF16 layers widened to the FMAs), two
    // threads, batch 8, `bench/ab.py` 8 rounds: 1×1 256 → 1024 at 14² 0.93× the time (7 of
    // 8), 1024 → 256 0.91× (5 of 8); ResNet-50 BF16's 1×1 layers together (over its Winograd
    // layers' time in the same runs) 0.97× (5 of 8), and at batch 32 level (0.99×, 3 of 6).
    // On AVX-512 the first row group of each whole panel pair widens the pair's block as its
    // tile multiplies it (`first_group_widening`); the rows after it read the block as f32.
    B_BLOCK.with_borrow_mut(|wide| {
        wide.resize(KC * NR * kern.panels, 0.0);
        // SAFETY: forwarded from this function's contract; each view is its panels' K block
        // alone (k0 = 0 within it, the panels' blocks kc · NR apart), and C's columns for
        // panel p start (p − p0)·NR in. The packed groups are the K block's.
        unsafe {
            let copy = aliases(lda) && m > 1 && packed_groups(&kern, m, (p0, p1), KC.min(b.k)) == 0;
            for_k_blocks(m, a, lda, (b.k, KC), copy, |a, lda, block| {
                with_packed_groups(&kern, m, (a, lda), (p0, p1), block.kc, |packed| {
                    for p in (p0..p1).step_by(kern.panels) {
                        let w = kern.panels.min(p1 - p);
                        let len = block.kc * NR;
                        let (c, fin) = (c.add((p - p0) * NR), fin.map(|f| f.at((p - p0) * NR)));
                        let done = first_group_widening(
                            b,
                            (p, w),
                            block,
                            (a, lda, packed),
                            m,
                            (c, ldc, fin),
                            &mut wide[..w * len],
                        );
                        if done == 0 {
                            for q in 0..w {
                                T::widen(
                                    &b.data[((p + q) * b.k + block.k0) * NR..][..len],
                                    &mut wide[q * len..][..len],
                                );
                            }
                        }
                        let view = Panels {
                            k: block.kc,
                            n: (w * NR).min(b.n - p * NR),
                            data: &wide[..w * len],
                            bias: &b.bias[p * NR..],
                        };
                        let at_zero = Block { k0: 0, ..block };
                        let (packed, groups) = packed;
                        let packed = match groups {
                            0 => (packed, 0),
                            _ => (&packed[done * block.kc..], groups - done / kern.rows),
                        };
                        gemm_block(
                            kern,
                            Order::ByCache,
                            m - done,
                            (a.add(done * lda), lda, packed),
                            &view,
                            (0, w),
                            at_zero,
                            c.add(done * ldc),
                            ldc,
                            fin.map(|f| f.at(done * ldc)),
                        );
                    }
                })
            });
        }
    })
}

/// The first row group of a widened GEMM's panel pair (`p`, `w` panels) run on the bf16
/// tile that stores B's rows into `wide` as it widens them (`avx512::tile_b_copying`), where
/// the AVX-512 path takes it: a whole tile (`MAX_ROWS` rows, two whole panels). Returns the
/// rows it ran (0: none, and `wide` untouched: the caller widens the block first).
///
/// Widened in a loop of its own before any tile ran, the block was read from memory (or L3)
/// with nothing to hide the wait behind: a profile of Qwen2.5-0.5B BF16's prefill at batch 8
/// (128-row work items) put that loop at 14% of the tiles' time on an Emerald Rapids Xeon
/// whose VM hides AMX, where the f32 tiles stream the same weights under their FMAs, a page
/// ahead (`B_PREFETCH`). In the tile the widening costs a shift and a zero extension a
/// panel per k beside 28 FMAs, and a store, for one row group of the pair's nine or so. On
/// that Xeon, two threads, the two ways alternating: the 1024³ BF16 GEMM (`workshop peak`'s)
/// 1.04–1.05× the GFLOP/s (medians of 30 paired runs, twice; FP32's own level with it now,
/// 0.87× before); ViT-B/16 BF16's linears 0.928× the time at batch 1 (8 of 8 rounds) and
/// 0.930× at batch 8 (6 of 6), `bench/ab.py --kernel-total linear --control attention`;
/// ResNet-50 BF16's 1×1 layers at batch 8, whose chunks of up to 770 rows share a block
/// among 55 row groups, 0.981× (8 of 8); Qwen2.5-0.5B's prefill at batch 8 0.93–0.97× (3 of 3).
///
/// # Safety
/// As for [`gemm_block`]'s call in `gemm_packed_to`: A's block of `m` rows at `a` (`lda`
/// apart, its first groups packed), C's rows at `c` and the panels' columns.
#[allow(clippy::too_many_arguments)]
unsafe fn first_group_widening<T: Elem>(
    b: &PackedB<T>,
    (p, w): (usize, usize),
    block: Block,
    (a, lda, (packed, groups)): (*const f32, usize, (&[f32], usize)),
    m: usize,
    (c, ldc, fin): (*mut f32, usize, Option<Finish>),
    wide: &mut [f32],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(data) = T::as_bf16(&b.data) else {
            return 0;
        };
        let whole = w == MAX_PANELS && (p + w) * NR <= b.n && m >= MAX_ROWS;
        if !whole || simd() < Simd::Avx512 {
            return 0;
        }
        let kc = block.kc;
        let panel = (data[(p * b.k + block.k0) * NR..].as_ptr(), b.k * NR);
        let bias = b.bias[p * NR..].as_ptr();
        let fin = fin.filter(|_| block.last);
        let valid = (MAX_ROWS, w * NR);
        let copy = (wide.as_mut_ptr(), kc * NR);
        // SAFETY: the path runs AVX-512F; A's first MAX_ROWS rows (or its first packed group)
        // have kc readable floats; the tile's rows of C and its two whole panels are the
        // caller's; `wide` holds the two panels' blocks of kc · NR floats.
        unsafe {
            if groups > 0 {
                let rows = [packed.as_ptr(); MAX_ROWS];
                avx512::tile_b_copying::<MAX_ROWS, 2, false, true, true>(
                    kc, &rows, panel, c, ldc, valid, block.init, bias, fin, copy,
                )
            } else {
                let rows = row_pointers(a, lda, 0, MAX_ROWS);
                avx512::tile_b_copying::<MAX_ROWS, 2, false, false, true>(
                    kc, &rows, panel, c, ldc, valid, block.init, bias, fin, copy,
                )
            }
        }
        MAX_ROWS
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (
            b,
            (p, w),
            block,
            (a, lda, packed, groups),
            m,
            (c, ldc, fin),
            wide,
        );
        0
    }
}

/// `kern` with its small-K kernel taking no K deeper than `max`.
fn small_k_to<E>(kern: Kernels<E>, max: usize) -> Kernels<E> {
    Kernels {
        small_k: kern.small_k.min(max),
        ..kern
    }
}

/// Run `f(a, lda, block)` for each K block (of `kc_max` columns, the last fewer) of a GEMM
/// over K = `k`, `a` pointing at the block's first column: A itself, or where `copy` (A's
/// stride aliases, see [`aliases`]) a copy of the block at a stride that does not.
///
/// # Safety
/// `a` must point to `m` rows of at least `k` readable floats spaced `lda` apart.
unsafe fn for_k_blocks(
    m: usize,
    a: *const f32,
    lda: usize,
    (k, kc_max): (usize, usize),
    copy: bool,
    mut f: impl FnMut(*const f32, usize, Block),
) {
    let mut k0 = 0;
    while k0 < k {
        let kc = kc_max.min(k - k0);
        let block = Block {
            k0,
            kc,
            init: if k0 == 0 { Init::Bias } else { Init::Load },
            last: k0 + kc == k,
        };
        if copy {
            // Copy the K block at a stride that spreads its rows over the L1 sets.
            A_COPY.with_borrow_mut(|copy| {
                let ld = kc + COPY_PAD;
                copy.resize(m * ld, 0.0);
                for (r, row) in copy.chunks_mut(ld).enumerate() {
                    // SAFETY: row r of A has k ≥ k0 + kc readable floats (the contract).
                    let src = unsafe { std::slice::from_raw_parts(a.add(r * lda + k0), kc) };
                    row[..kc].copy_from_slice(src);
                }
                f(copy.as_ptr(), ld, block)
            });
        } else {
            // SAFETY: the block starts k0 into each row (the contract).
            f(unsafe { a.add(k0) }, lda, block)
        }
        k0 += kc;
    }
}

/// One K block of [`gemm_with`]: columns k0..k0 + kc of B's panels.
#[derive(Clone, Copy)]
struct Block {
    k0: usize,
    kc: usize,
    init: Init,
    /// The last K block: C is finished after it.
    last: bool,
}

/// `f((packed, groups))` with A's whole row groups (`a`'s rows, `lda` apart, columns 0..kc)
/// packed for `kern`'s packed tiles over panels p0..p1 where [`packed_groups`] says they pay
/// (none, and an empty buffer, elsewhere), in the worker's buffer: taken for the call and
/// given back after it.
///
/// # Safety
/// As for [`pack_groups`], with `a`'s m rows.
unsafe fn with_packed_groups<E, R>(
    kern: &Kernels<E>,
    m: usize,
    (a, lda): (*const f32, usize),
    panels: (usize, usize),
    kc: usize,
    f: impl FnOnce((&[f32], usize)) -> R,
) -> R {
    let groups = packed_groups(kern, m, panels, kc);
    if groups == 0 {
        return f((&[], 0));
    }
    let mut pack = A_PACK.take();
    // SAFETY: A has m ≥ groups · rows rows of kc readable floats (the contract).
    unsafe { pack_groups(a, lda, (groups, kern.rows), kc, &mut pack) };
    let done = f((&pack, groups));
    A_PACK.set(pack);
    done
}

/// C (+)= A[0..m, 0..kc] · B[k0..k0 + kc, panels p0..p1], `a` pointing at the block's column 0
/// (`lda` apart), its first `groups` row groups also in `packed` ([`with_packed_groups`]).
///
/// # Safety
/// As for [`gemm`], with `kc` readable floats per row of `a`; `packed` holds `groups` groups
/// of rows 0.. of this `a`'s K block.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_block<E>(
    kern: Kernels<E>,
    order: Order,
    m: usize,
    (a, lda, (packed, groups)): (*const f32, usize, (&[f32], usize)),
    b: &Panels<'_, E>,
    (p0, p1): (usize, usize),
    Block { k0, kc, init, last }: Block,
    c: *mut f32,
    ldc: usize,
    fin: Option<Finish>,
) {
    let fin = fin.filter(|_| last);
    // The whole of a small K in one block: B's panel in registers, a panel at a time (not for
    // fewer rows than a group where the path has tiles that short: the kernel would repeat
    // them).
    if let Some(stationary) = kern.stationary
        && (m >= MR || (kern.tails.is_none() && kern.exact.is_none()))
        && init == Init::Bias
        && last
        && kc <= kern.small_k
    {
        for p in p0..p1 {
            let off = (p - p0) * NR;
            let cols = NR.min(b.n - p * NR);
            let panel = b.data[p * b.k * NR..].as_ptr();
            let bias = b.bias[p * NR..].as_ptr();
            // The last rows short of a group of `MR` go to a tile exactly that tall where the
            // path has one (AVX2's for a whole panel, AVX-512's masked ones for any): the
            // kernel would repeat the last row to fill the group (49 rows, ResNet-50's 7²
            // layers at batch 1, cost what 54 do).
            let tail = match (kern.tails, kern.exact) {
                _ if m < MR || m.is_multiple_of(MR) => None,
                (Some(tails), _) if cols == NR => Some(tails[m % MR - 1]),
                (_, Some(exact)) => Some(exact[m % MR - 1][1]),
                _ => None,
            };
            let body = m - tail.map_or(0, |_| m % MR);
            // SAFETY: as for the tiles below: rows 0..m of A and C, panel p of B (k0 is 0:
            // `Init::Bias` is the first block, and `last` makes it the only one); the tail
            // tile's rows body..m and its panel's whole width are in those ranges.
            unsafe {
                stationary(
                    kc,
                    (a, lda, body),
                    panel,
                    bias,
                    (c.add(off), ldc, cols),
                    fin.map(|f| f.at(off)),
                );
                if let Some(tile) = tail {
                    let a_rows = row_pointers(a, lda, body, m - body);
                    tile(
                        kc,
                        &a_rows,
                        (panel, b.k * NR),
                        c.add(body * ldc + off),
                        ldc,
                        (m - body, cols),
                        init,
                        bias,
                        fin.map(|f| f.at(body * ldc + off)),
                    );
                }
            }
        }
        return;
    }
    // One tile: rows i.. of panels p..p + w (w ≤ kern.panels); returns the rows it covered.
    let tile_at = |p: usize, w: usize, i: usize| -> usize {
        let width = w * NR;
        let cols = width.min(b.n - p * NR);
        let panel = b.data[(p * b.k + k0) * NR..].as_ptr();
        let bias = b.bias[p * NR..].as_ptr();
        // The tall tile while enough rows are left, then the short one; as wide as asked.
        let (tile, height, which) = match (m - i >= kern.rows, w == kern.panels) {
            (true, true) => (kern.tall, kern.rows, 0),
            (true, false) => (kern.tall1, kern.rows, 2),
            (false, true) => (kern.short, MR, 1),
            (false, false) => (kern.short1, MR, 3),
        };
        // The rows left under a tall tile, on a path with tiles exactly that tall: one of them.
        let exact = kern
            .exact
            .filter(|_| m - i < kern.rows)
            .map(|e| e[m - i - 1][usize::from(w != kern.panels)]);
        let height = if exact.is_some() { m - i } else { height };
        let rows = height.min(m - i);
        let whole = rows == height && cols == width;
        // C's lines, and the residual's where the tile finishes with one (read as it stores);
        // the bf16 output's and its residual's where the tile stores there instead.
        let residual = fin.map_or(std::ptr::null(), |f| f.residual);
        for q in 0..w {
            let (col, r0) = ((p + q - p0) * NR, i + PREFETCH_TILES * height);
            match fin.and_then(|f| f.bf16) {
                Some(o) => prefetch_c_rows((o.out, o.residual), ldc, col, r0, height, m),
                None => prefetch_c_rows((c, residual), ldc, col, r0, height, m),
            }
        }
        // SAFETY: rows i..i+rows of A and C exist by the contract, and so do panels
        // p..p + w (the callers keep p + w ≤ p1); rows past `rows` in an edge tile repeat
        // the last valid row and their results are dropped. A packed group holds its rows'
        // kc columns (`pack_groups`); i is a multiple of the tall tile's rows while they run.
        unsafe {
            let c_tile = c.add(i * ldc + (p - p0) * NR);
            let fin = fin.map(|f| f.at(i * ldc + (p - p0) * NR));
            let bstride = b.k * NR;
            let group = i / kern.rows;
            if let Some(tiles) = kern
                .packed
                .filter(|_| whole && which % 2 == 0 && group < groups)
            {
                let tile = tiles[which / 2];
                let a_group = [packed.as_ptr().add(group * kern.rows * kc); MAX_ROWS];
                let (b, valid) = ((panel, bstride), (rows, cols));
                tile(kc, &a_group, b, c_tile, ldc, valid, init, bias, fin);
                return rows;
            }
            let a_rows = row_pointers(a, lda, i, rows);
            // In place: a tile exactly as tall as the rows left (masked); a whole tile; a
            // whole panel's last rows on a path with tiles that tall; an edge tile on a path
            // that masks its edges.
            let in_place = match (whole, kern.tails) {
                _ if exact.is_some() => exact,
                (true, _) => Some(tile),
                (false, Some(tails)) if cols == width && w == 1 && rows < height => {
                    Some(tails[rows - 1])
                }
                _ => kern.edges.map(|edges| edges[which]),
            };
            if let Some(tile) = in_place {
                let valid = (rows, cols);
                tile(
                    kc,
                    &a_rows,
                    (panel, bstride),
                    c_tile,
                    ldc,
                    valid,
                    init,
                    bias,
                    fin,
                );
            } else {
                // Edge tile: run the full kernel on a local tile, copy the valid part.
                debug_assert!(
                    fin.is_none_or(|f| f.bf16.is_none()),
                    "bf16 outputs are for paths with masked edges"
                );
                let mut local = [0f32; MAX_ROWS * LD];
                if init == Init::Load {
                    to_local(c_tile, ldc, (rows, cols), &mut local);
                }
                // The residual's valid part laid out as the local tile, so the kernel
                // finishes in registers here too (a pass per row of the tile, as the portable
                // tile's, was 4–5% slower on MobileNetV3's 24- and 72-column layers, whose
                // last panel is half full).
                let near;
                let fin = match fin {
                    Some(f) if !f.residual.is_null() => {
                        near = {
                            let mut near = [0f32; MAX_ROWS * LD];
                            to_local(f.residual, ldc, (rows, cols), &mut near);
                            near
                        };
                        Some(Finish {
                            residual: near.as_ptr(),
                            ..f
                        })
                    }
                    fin => fin,
                };
                tile(
                    kc,
                    &a_rows,
                    (panel, bstride),
                    local.as_mut_ptr(),
                    LD,
                    (height, width),
                    init,
                    bias,
                    fin,
                );
                for r in 0..rows {
                    std::ptr::copy_nonoverlapping(
                        local[r * LD..].as_ptr(),
                        c_tile.add(r * ldc),
                        cols,
                    );
                }
            }
        }
        rows
    };
    // The call's panels in tiles `kern.panels` wide, the last one narrower when they do not
    // divide evenly: (first panel, width).
    let panel_groups = (p0..p1)
        .step_by(kern.panels)
        .map(|p| (p, kern.panels.min(p1 - p)));
    // Rows outer where the K block of every panel fits in half the L2 cache: a row group's A
    // then stays in L1 across the panels and C is written a whole row at a time, which the
    // prefetchers follow. Panels outer otherwise: each panel's block stays in L1 while the
    // chunk's A streams from L2. See `row_outer_fits`.
    let row_outer = match order {
        Order::RowsOuter => true,
        Order::PanelsOuter => false,
        Order::ByCache => kc * (p1 - p0) * NR * 4 <= row_outer_fits(),
    };
    if row_outer && p1 > p0 {
        let mut i = 0;
        while i < m {
            let mut rows = 0;
            for (p, w) in panel_groups.clone() {
                rows = tile_at(p, w, i);
            }
            i += rows;
        }
    } else {
        for (p, w) in panel_groups {
            let mut i = 0;
            while i < m {
                i += tile_at(p, w, i);
            }
        }
    }
}

/// The whole row groups of A a call of [`gemm_block`] packs for `kern`'s packed tiles over a
/// K block of `kc`: none where the path has none, or the call has fewer panels than
/// `kern.pack_from` (each group is copied once and read by every panel: a few panels do not
/// repay the copy), or the block is no deeper than `kern.pack_over_k` ([`PACK_OVER_K`]).
fn packed_groups<E>(kern: &Kernels<E>, m: usize, (p0, p1): (usize, usize), kc: usize) -> usize {
    match kern.packed {
        Some(_)
            if kern.pack_from > 0
                && p1.saturating_sub(p0) >= kern.pack_from
                && kc > kern.pack_over_k =>
        {
            m / kern.rows
        }
        _ => 0,
    }
}

/// Copy `groups` groups of `rows` rows of A (`lda` apart, from row 0), columns 0..kc, into
/// `pack` k-major, as the `PACKED` tiles read them: group g's row r, column k at
/// g·rows·kc + k·rows + r. The buffer only grows (its old values are all overwritten).
///
/// # Safety
/// `a` points to `groups · rows` rows of at least `kc` readable floats `lda` apart.
unsafe fn pack_groups(
    a: *const f32,
    lda: usize,
    (groups, rows): (usize, usize),
    kc: usize,
    pack: &mut Vec<f32>,
) {
    let len = groups * rows * kc;
    if pack.len() < len {
        pack.resize(len, 0.0);
    }
    for (g, block) in pack[..len].chunks_exact_mut((rows * kc).max(1)).enumerate() {
        let row = row_pointers(a, lda, g * rows, rows);
        // AVX-512's groups (the only path with packed tiles) transposed in registers.
        #[cfg(target_arch = "x86_64")]
        if rows == MAX_ROWS && simd() >= Simd::Avx512 {
            // SAFETY: the path runs AVX-512F; the group's rows have kc readable floats (the
            // contract) and its block is kc · rows long.
            unsafe { avx512::pack_group(&row, kc, block.as_mut_ptr()) };
            continue;
        }
        for (k, values) in block.chunks_exact_mut(rows).enumerate() {
            for (v, row) in values.iter_mut().zip(row) {
                // SAFETY: row g·rows + r < groups · rows has kc > k readable floats.
                *v = unsafe { *row.add(k) };
            }
        }
    }
}

/// A tile's row pointers into A for `rows` rows from row `i` (`lda` apart), the rows past
/// them repeating the last (a tile that is taller reads them; its results there are dropped).
#[inline(always)]
fn row_pointers(a: *const f32, lda: usize, i: usize, rows: usize) -> [*const f32; MAX_ROWS] {
    std::array::from_fn(|r| a.wrapping_add((i + r.min(rows - 1)) * lda))
}

/// Row stride of an edge tile's local copy: the widest tile's columns.
const LD: usize = MAX_PANELS * NR;

/// The valid part of a tile (`rows` × `cols` floats, rows `ld` apart from `src`) copied into
/// `local`'s rows, [`LD`] apart: C's values for a later K block, or the residual.
///
/// # Safety
/// `src` has `rows` rows of `cols` readable floats `ld` apart; `rows` ≤ [`MAX_ROWS`] and
/// `cols` ≤ [`LD`].
unsafe fn to_local(src: *const f32, ld: usize, (rows, cols): (usize, usize), local: &mut [f32]) {
    for (r, row) in local.chunks_exact_mut(LD).take(rows).enumerate() {
        // SAFETY: the caller's.
        let src = unsafe { std::slice::from_raw_parts(src.add(r * ld), cols) };
        row[..cols].copy_from_slice(src);
    }
}

/// The largest K block of B (bytes, all of a call's panels) for which [`gemm_block`] runs rows
/// outer: half the L2 cache, so the block stays there beside A's rows and C's lines.
///
/// Measured on a 2-core Zen 3 VM (512 KiB L2), single ResNet-50 layers at batch 8 interleaved
/// in one process: rows outer ran the 1×1 convs whose blocks are 64–256 KiB (64→256,
/// 256→64, 128→512, 512→128) up to 25% faster (C is written whole rows at a time instead of
/// one 64-byte piece of every row per panel) and those with 512 KiB blocks (2048→512, 1×1
/// s2 512→1024) 7–10% slower (their B then streams from L3 for every row group).
fn row_outer_fits() -> usize {
    static FITS: OnceLock<usize> = OnceLock::new();
    *FITS.get_or_init(|| l2_bytes() / 2)
}

/// The L2 cache of one core in bytes: CPUID's extended leaf 0x8000_0006 on x86-64 (Intel and
/// AMD both report it there), 256 KiB (the smallest of recent x86 cores) where it says
/// nothing.
pub(crate) fn l2_bytes() -> usize {
    match super::cache_leaf() {
        Some((ecx, _)) if ecx >> 16 > 0 => ((ecx >> 16) as usize) << 10,
        _ => 256 << 10,
    }
}

/// How far ahead (in k, rows of a panel) the SIMD tiles ask for B: 64 rows of 64 bytes, the
/// next 4 KiB page of the panel. The weights of a network's late layers (and Winograd's
/// transformed ones, 4× the plain) are read from memory once per pass, and the hardware
/// prefetchers stop at every page boundary, so a tile that meets a panel first waited on
/// memory once per 64 k; in cache the hints cost next to nothing. Single ResNet-50 layers at
/// batch 8 with their weights cold, on a 2-core Zen 5: 3×3 at 7×7 (F(4×4), 38 MB of U) 2.53 →
/// 2.23 ms, at 14×14 2.28 → 2.05 ms, the 1×1 512→2048 at 7×7 1.86 → 1.76 ms; ResNet-50 FP32
/// batch 8 55.4 → 56.7 images/s (medians of 5 interleaved runs). (The f16 tiles' rows are 32
/// bytes: the same 64 rows are half a page ahead there.)
const B_PREFETCH: usize = 64;

/// How many tiles ahead of the one running [`prefetch_c_rows`] asks for C's lines.
const PREFETCH_TILES: usize = 2;

/// Ask the caches for C's lines of the tile at rows `r0..r0 + height` (those below `m`),
/// columns `col..col + NR`, ahead of its kernel, and for the residual's (laid out as C; null:
/// none): a tile writes (or first reads) C rows that are `ldc` apart, and reads the residual's
/// as it stores, which the hardware prefetchers do not foresee, and a tile's stores that miss
/// wait for their lines while the next tile's loads queue behind them (a profile showed about
/// 8% of ResNet-50's time stalled on the stores right after each tile). Into L2, not L1
/// (`prefetcht1`): walking rows outer, two row groups ahead is 16 tiles ahead at 512 columns,
/// 56 KiB of C's and the residual's lines, more than L1 holds beside the tile's A and B. On a
/// Zen 4, one thread, 3136 × 128 → 512 with a residual (C and the residual on huge pages,
/// alternating in one process) took 0.82–0.86× the time of the `prefetcht0` version, 784 ×
/// 256 → 1024 0.93×, the plain GEMMs level; ResNet-50 FP32's 1×1 kernels (over its Winograd
/// ones, `bench/ab.py --kernel-total`) 0.95× at batch 8 (8 of 8 rounds), 0.955× at 32 (5 of 6),
/// level at 1. (The bf16 pairs' finish, `bf16_gemm::dot::finish`, read 1.03× the same way,
/// 6 of 8 rounds slower: it keeps `prefetcht0`.) A hint only: it reads nothing and faults on
/// nothing.
#[inline(always)]
fn prefetch_c_rows<O>(
    (c, residual): (*mut O, *const O),
    ldc: usize,
    col: usize,
    r0: usize,
    height: usize,
    m: usize,
) {
    // Written over its residual, C's lines are the residual's: asked for once.
    #[cfg(target_arch = "x86_64")]
    let residual = match residual == c.cast_const() {
        true => std::ptr::null(),
        false => residual,
    };
    #[cfg(target_arch = "x86_64")]
    for lines in [c.cast_const(), residual] {
        if lines.is_null() {
            continue;
        }
        for r in r0..(r0 + height).min(m) {
            use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
            let at = lines.wrapping_add(r * ldc + col);
            // SAFETY: prefetching is a hint for any address; no access is made.
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(at as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(NR - 1) as *const i8);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, residual, ldc, col, r0, height, m);
}

/// The fewest panels a [`gemm_block`] call has for the AVX-512 tiles to read A packed
/// ([`pack_groups`], a copy of each A value per K block: about a cycle, against the tile's
/// one FMA cycle per value and panel pair that it speeds up).
///
/// On an AMX Xeon (Sapphire Rapids family, 2 vCPUs, 2 MiB L2 a core), one core: the 14×32
/// tile reading 14 rows of A ran at 0.76–0.80× its rate on data in L1 over a whole GEMM
/// (784 × 768 × 3072 and 504 × 1024 × 1024, K blocks of 1024), and at 0.90–0.93× on A packed
/// before the timing (the copy: 0.55 ns a value). In the workshop, the two alternating in one
/// process (packed time over the rows' time, FP32 batch 8, medians): ViT-B/16's MLP linears
/// 0.87–0.89×, its compiled linears all together 0.87× and the network 0.94× eager and 0.88×
/// compiled; 1024³ (`linear(1024,1024)` on 1024 rows) 0.91×; FP16 ViT-B/16's (f16 panels)
/// 0.96–0.97×. ResNet-50's 1×1 and 3×3 layers of 256 to 2048 outputs (16 to 128 panels)
/// 0.90–0.96×, but its 128-output ones (8 panels) 1.07–1.09×: they pack from 16.
const PACK_FROM: usize = 16;

/// The deepest K block [`gemm_block`] leaves unpacked whatever its panels: there the copy did
/// not pay (a group of 14 rows of 64 floats or fewer is 56 lines of L1, none aliasing, and
/// presumably the tile's start and stores weigh more beside so few FMAs). On the AMX Xeon,
/// alternating in one process (packed time over unpacked, FP32, compiled): ResNet-50's 1×1
/// layers of K 64 into 256 outputs at 56² 1.04–1.06× at batch 8 and 1.00–1.04× at batch 1;
/// its K 128 ones (128 → 512 at 28²) 0.98–1.01× at batch 8, so they still pack.
const PACK_OVER_K: usize = 64;

/// Padding of a copied K block's rows (floats): one cache line, so that consecutive rows start
/// on different L1 sets.
const COPY_PAD: usize = 16;

thread_local! {
    /// The copied K block of A (see [`aliases`]): grown once per worker, reused by every call.
    static A_COPY: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A K block's row groups of A packed for the packed tiles (see [`pack_groups`]).
    static A_PACK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// One widened K block of a half-precision panel (see [`gemm_packed`]).
    static B_BLOCK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether rows `lda` floats apart fall on the same L1 sets: a stride that is a multiple of
/// 4 KiB (1×1 convolutions over 1024 or 2048 channels) puts all the tile's rows — 14 on
/// AVX-512 — into one set of a 12-way L1, where they evict each other and the B panel. A
/// Sapphire Rapids core ran such a GEMM (m48 n512 k2048) at 68 GFLOP/s read in place and at
/// 117 with the rows 64 bytes further apart; copying the K block (m × `KC` floats at most,
/// reused by every panel) costs far less than that.
fn aliases(lda: usize) -> bool {
    lda >= 1024 && lda.is_multiple_of(1024)
}

mod tiles;
use tiles::tile_portable;
#[cfg(target_arch = "x86_64")]
use tiles::{avx2, avx512};

#[cfg(test)]
mod tests;

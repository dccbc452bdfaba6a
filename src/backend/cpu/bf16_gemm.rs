//! BF16 GEMMs on k-pairs, for BF16 sessions' convolutions: C (f32) = A (bf16) · B (bf16) +
//! bias, f32 accumulation, handed to the caller 32 × 32 blocks at a time.
//!
//! Two instruction sets multiply bf16 values two k at a time into f32: Intel AMX's
//! `tdpbf16ps` ([`super::amx`]: a 16 × 32 tile of A by a 32 × 16 tile of B, Sapphire Rapids and
//! later Xeons) and AVX512_BF16's `vdpbf16ps` (16 f32 lanes, each += a0·b0 + a1·b1: Zen 4 and
//! 5, Cooper Lake, and the AMX Xeons too). Both read B as rows of k-pairs — row r of a panel
//! holds `B[2r][j]`, `B[2r + 1][j]` for its 16 columns j, 64 bytes — and A as rows of bf16 along
//! K, so one packing ([`PackedPairs`]), one driver ([`gemm`]) and one block shape serve both;
//! only the block kernel differs ([`Engine`]).
//!
//! `vdpbf16ps` does twice the FLOPs of an FP32 FMA in one instruction; a Zen 5 core runs two a
//! cycle, as it does FMAs: 495 GFLOP/s against 265 for FP32 FMAs on one core here. A Sapphire
//! Rapids core ran it at 78 GFLOP/s from memory against 235–390 for its AMX tiles, which is
//! why AMX wins where both exist; an Emerald Rapids core issues it every other cycle, at half
//! its FMAs' FLOPs, so there (without AMX) BF16 layers widen to FP32 instead: a start-up probe
//! measures which ([`super::probe`]).

use half::bf16;
use rayon::prelude::*;

use super::simd::{Simd, simd};

/// Columns of a panel (one AMX B tile's width, one zmm of f32 results).
pub const PANEL: usize = 16;
/// K per AMX step (32 bf16 = one 64-byte tile row of A): packings for AMX pad K to a
/// multiple of it.
pub const KSTEP: usize = 32;
/// K per `vdpbf16ps` step: packings for it pad K only to a multiple of this (4 k-pairs, the
/// single-row kernel's chains). Padded to [`KSTEP`], MobileNetV3's 1×1 layers of 16, 40 and
/// 72 input channels multiplied 100%, 60% and 33% more than they needed, and gathered their
/// input into padded rows instead of reading it in place.
pub const DOT_KSTEP: usize = 8;
/// The longest K that AMX CPUs multiply on `vdpbf16ps` rather than on the tiles
/// ([`Engine::for_k`]).
pub const SHORT_K: usize = 16;
/// The most rows a layer whose K AMX takes multiplies on `vdpbf16ps` instead
/// ([`Engine::for_rows`]): a language model's decode step at a batch of up to 8, a classifier
/// or a squeeze-and-excitation layer at a small batch.
pub const FEW_ROWS: usize = 8;
/// Rows of a C block (two 16-row AMX tiles).
pub const BLOCK_ROWS: usize = 32;
/// Row length of a finished block's values (two panels).
pub const BLOCK_COLS: usize = 2 * PANEL;

/// The instructions a block is computed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// AMX tiles (`tdpbf16ps`).
    Amx,
    /// AVX-512 registers (`vdpbf16ps`).
    Dot,
}

impl Engine {
    /// The rows a block of C takes: AMX's tiles 32 (fewer are copied and padded to 32), the
    /// `vdpbf16ps` kernels any number (work is cut as for the FP32 tile).
    pub fn row_unit(self) -> usize {
        match self {
            Engine::Amx => BLOCK_ROWS,
            Engine::Dot => super::sgemm::tile_rows(),
        }
    }

    /// The row stride A's `kp` values are laid out at where they are gathered or copied.
    /// AMX's tile loads read 16 rows a line each; rows a multiple of 2 KiB apart fall in two
    /// of L1's 64 sets, 16 lines a set for its 12 ways, so a block's rows evicted each other
    /// (and the lines asked for ahead of them): one step more puts each row in a set of its
    /// own.
    pub fn lda(self, kp: usize) -> usize {
        match self {
            Engine::Amx if kp.is_multiple_of(1024) => kp + KSTEP,
            _ => kp,
        }
    }

    /// Whether [`gemm`] walks a work item's blocks a row block at a time across its panels
    /// rather than a panel pair at a time down its rows: AMX where a block's A rows stay in
    /// L1 across eight panel pairs or more (K of 64 to 256, N of 256 or more) and all of B
    /// in L2 (512 KiB or less) — the wide, short-K 1×1 layers, whose finished blocks then go
    /// out a whole row stripe at a time. ResNet-50 BF16 at batch 8 on 2 Sapphire Rapids
    /// cores, 30–60 steps alternating in one process (3 runs): its 1×1 layers from 128
    /// channels to 512 took 0.56–0.87× the time, from 256 to 1024 0.82–0.93×, and from 256
    /// to 64 or 128 (four panels) 1.10–1.12× as long: there a pair of panels in L1 down all
    /// the rows does better. From 64 to 256 they first read even (0.79–1.14×, before A's
    /// rows sat on cache lines); measured again after (two runs of 40 steps), layer1's four
    /// took 0.72–0.90× the time (the one alone at 56², 0.68–0.74×), and EfficientNet-B0's
    /// 80 → 480 (K padded to 96) 0.90×; no other layer of the two moved past noise.
    pub fn rows_outer(self, kp: usize, n: usize) -> bool {
        let wide = n >= 16 * PANEL && kp * n * 2 <= 512 << 10;
        self == Engine::Amx && (64..=256).contains(&kp) && wide
    }

    /// The engine of the SIMD paths in use: `None` where they multiply no bf16 pairs (BF16
    /// layers then widen B's panels for the FP32 GEMM).
    pub fn in_use() -> Option<Engine> {
        match simd() {
            Simd::Amx => Some(Engine::Amx),
            Simd::Avx512Bf16 => Some(Engine::Dot),
            _ => None,
        }
    }

    /// The engine that multiplies a B of `k` rows (K before padding): the one in use, except
    /// that AMX hands K of [`SHORT_K`] or less to `vdpbf16ps` (a CPU with AMX has AVX512_BF16
    /// too). Padded to AMX's step, such a layer multiplied twice the products it needed and
    /// gathered its input into padded rows; `vdpbf16ps` reads it in place, B's few k-pairs
    /// held in registers (the stationary kernel). MobileNetV3-Large BF16 at batch 8 on 2
    /// Sapphire Rapids cores, 100 steps alternating in one process (two runs): its 16 → 16
    /// layer took 0.49× the time, 16 → 64 0.71–0.73×, the network 0.93×; EfficientNet-B0's
    /// 16 → 96 read even. At K 24 and 40 the tiles stayed ahead: its two 24 → 72 layers even
    /// and 1.23× as long on `vdpbf16ps`, its two 40 → 120 and one 40 → 240 1.4–1.8×.
    pub fn for_k(k: usize) -> Option<Engine> {
        Engine::in_use().map(|e| match e {
            Engine::Amx if k <= SHORT_K => Engine::Dot,
            e => e,
        })
    }

    /// The engine that multiplies `m` rows by a B of `k` rows: [`Engine::for_k`]'s, except
    /// that AMX hands [`FEW_ROWS`] rows or fewer to `vdpbf16ps` (its packing's K step, 32, is
    /// a multiple of `vdpbf16ps`'s). AMX pads a block to 32 rows and streams B through tile
    /// loads that wait on memory; `vdpbf16ps` multiplies the rows there are, and its loads run
    /// ahead. Qwen2.5-0.5B BF16 decode (prompt 128) on an Emerald Rapids Xeon (2 vCPU), three
    /// alternating runs: batch 1's TPOT 74, 139 and 109 ms on the tiles against 52, 51 and 52
    /// on `vdpbf16ps`; batch 8's 109, 125 and 108 against 101, 113 and 92. With every layer
    /// of a step forced to one engine, 12 rows took 88 and 118 ms on the tiles against 161 and
    /// 157, and 16 or 24 rows ran 1.3–2.5× as fast on the tiles.
    pub fn for_rows(k: usize, m: usize) -> Option<Engine> {
        Engine::for_k(k).map(|e| match e {
            Engine::Amx if m <= FEW_ROWS => Engine::Dot,
            e => e,
        })
    }

    /// The multiple of K its packings are padded to.
    pub fn k_step(self) -> usize {
        match self {
            Engine::Amx => KSTEP,
            Engine::Dot => DOT_KSTEP,
        }
    }

    /// The name records and `doctor` give it, with the block shape.
    pub fn name(self) -> String {
        let what = match self {
            Engine::Amx => "amx-bf16",
            Engine::Dot => "avx512-bf16",
        };
        format!("{what} {BLOCK_ROWS}x{BLOCK_COLS}")
    }
}

/// B (K × N) packed as k-pairs: K padded with zeros to a multiple of the engine's step
/// ([`Engine::k_step`]), N to a
/// multiple of [`PANEL`]; panel p holds Kp/2 rows of 16 k-pairs (64 bytes). The bias is padded
/// alike and kept in f32 (zeros when there is none).
pub struct PackedPairs {
    pub k: usize,
    pub n: usize,
    kp: usize,
    data: super::Lines<bf16>,
    /// On a cache line: AMX loads a panel's 16 values (64 bytes) as every row of a tile.
    bias: super::Lines<f32>,
}

/// K padded to a multiple of `step` (even: k-pairs), at least one step.
fn padded_k(k: usize, step: usize) -> usize {
    assert!(step.is_multiple_of(2), "k-pairs need an even K step");
    k.div_ceil(step).max(1) * step
}

impl PackedPairs {
    /// Pack B given column by column for the engine that multiplies it ([`Engine::for_k`];
    /// AMX's step where none does):
    /// `fill(j, col)` writes column j (K values), as for
    /// [`super::sgemm::PackedB::from_columns`].
    pub fn from_columns(
        k: usize,
        n: usize,
        fill: impl Fn(usize, &mut [f32]) + Sync,
        bias: Option<&[f32]>,
    ) -> Self {
        let step = Engine::for_k(k).map_or(KSTEP, Engine::k_step);
        Self::with_step(k, n, step, fill, bias)
    }

    /// [`PackedPairs::from_columns`] with K padded to a multiple of `step` (even): the engines
    /// a packing serves are those whose [`Engine::k_step`] divides it.
    pub fn with_step(
        k: usize,
        n: usize,
        step: usize,
        fill: impl Fn(usize, &mut [f32]) + Sync,
        bias: Option<&[f32]>,
    ) -> Self {
        let kp = padded_k(k, step);
        let panels = n.div_ceil(PANEL);
        let mut data = super::big_buffer(panels * kp * PANEL);
        data.par_chunks_mut(kp * PANEL).enumerate().for_each_init(
            || (vec![0f32; k], vec![0u32; kp / 2]),
            |(col, pairs), (p, panel)| {
                // A column rounded in one vectorised pass, then stored a k-pair (4 bytes) at
                // a time: per element, the rounding and 2-byte scatter were most of a
                // Llama-3.2-1B's start-up after its random values.
                let panel: &mut [u32] = bytemuck::cast_slice_mut(panel);
                for jj in 0..PANEL.min(n - p * PANEL) {
                    fill(p * PANEL + jj, col);
                    let halves = bytemuck::cast_slice_mut::<u32, bf16>(pairs);
                    super::elem::Elem::narrow(col, &mut halves[..k]);
                    for (i, &pair) in pairs.iter().enumerate() {
                        panel[i * PANEL + jj] = pair;
                    }
                }
            },
        );
        PackedPairs {
            k,
            n,
            kp,
            data,
            bias: super::Lines::from_slice(&super::sgemm::padded_bias(bias, n, panels * PANEL)),
        }
    }

    /// No matrix yet: scratch for [`PackedPairs::refill`].
    pub fn empty() -> Self {
        PackedPairs {
            k: 0,
            n: 0,
            kp: 0,
            data: super::big_buffer(0),
            bias: super::big_buffer(0),
        }
    }

    /// Pack B (K × N) again in this packing's memory, on this thread, K padded to `step`:
    /// `fill(p, panel)` writes panel p's Kp/2 k-pair rows (row r holds `B[2r][j]`,
    /// `B[2r + 1][j]` for its 16 columns j; zeros wherever it writes nothing); no bias. For
    /// activations packed per call (attention's keys and values), whose few small panels are
    /// not worth other threads. Inlined, so `fill` is compiled for the caller's vectors (a
    /// [`super::simd::Vectorised`] work's).
    #[inline(always)]
    pub fn refill(
        &mut self,
        (k, n): (usize, usize),
        step: usize,
        fill: impl FnMut(usize, &mut [bf16]),
    ) {
        let panels = n.div_ceil(PANEL);
        self.data.refill_zeros(panels * padded_k(k, step) * PANEL);
        self.repack((k, n), step, fill);
    }

    /// [`PackedPairs::refill`] where `fill` writes every value of its panel (zeros in K's
    /// padding too): the panels hold what was last written there until it does. Zeroed first,
    /// a window's keys and values (4 KiB each) cost a tenth of Swin-T's attention on AMX.
    #[inline(always)]
    pub fn repack(
        &mut self,
        (k, n): (usize, usize),
        step: usize,
        mut fill: impl FnMut(usize, &mut [bf16]),
    ) {
        let kp = padded_k(k, step);
        let panels = n.div_ceil(PANEL);
        self.data.reuse(panels * kp * PANEL);
        for (p, panel) in self.data.chunks_mut(kp * PANEL).enumerate() {
            fill(p, panel);
        }
        (self.k, self.n, self.kp) = (k, n, kp);
        self.bias.refill_zeros(panels * PANEL);
    }

    /// K padded to the step: the row length A's rows must have (zeros past `k`).
    pub fn kp(&self) -> usize {
        self.kp
    }

    pub fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// The bytes the packing holds: its [`Self::storage`], so the two cannot disagree.
    pub fn bytes(&self) -> u64 {
        self.storage().iter().map(|s| s.len() as u64).sum()
    }

    /// The memory the pairs and the bias take, as bytes: what [`Self::bytes`] counts.
    pub fn storage(&self) -> [&[u8]; 2] {
        [
            bytemuck::cast_slice(&self.data),
            bytemuck::cast_slice(&self.bias),
        ]
    }

    /// Column j of B (its K values) into `out`, as [`super::sgemm::PackedB::column`]: value
    /// k of it is in k-pair row k/2, at the column's pair.
    pub fn column(&self, j: usize, out: &mut [bf16]) {
        assert!(
            j < self.n && out.len() == self.k,
            "column {j} of a {}×{} B",
            self.k,
            self.n
        );
        let panel = &self.data[j / PANEL * self.kp * PANEL..][..self.kp * PANEL];
        let at = j % PANEL * 2;
        for (kk, o) in out.iter_mut().enumerate() {
            *o = panel[kk / 2 * 2 * PANEL + at + kk % 2];
        }
    }

    /// Panel q's k-pair rows (Kp/2 rows of 2 × [`PANEL`] values).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn panel(&self, q: usize) -> &[bf16] {
        &self.data[q * self.kp * PANEL..(q + 1) * self.kp * PANEL]
    }

    /// The bias from panel q's first column on.
    pub(crate) fn bias_from(&self, q: usize) -> &[f32] {
        &self.bias[q * PANEL..]
    }

    /// Panel q's bias ([`PANEL`] values).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn bias(&self, q: usize) -> &[f32] {
        &self.bias_from(q)[..PANEL]
    }
}

impl Default for PackedPairs {
    fn default() -> Self {
        Self::empty()
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// AMX's last rows of A copied and zero-padded to a whole block when fewer than 32 are
    /// left.
    /// (On a cache line, as the tiles read A best.)
    static EDGE: std::cell::RefCell<super::Lines<bf16>> = std::cell::RefCell::new(super::big_buffer(0));
}

/// Where the `vdpbf16ps` kernel for a few k-pairs ([`gemm`]'s `finished`) stores its rows
/// itself, finished: C's value (i, j) (row i of the call's A, column j counted from panel
/// p0's first) plus the residual's value at the same place, through `act`, narrowed to bf16
/// at `out + i·ld + j`. The other kernels hand their blocks to `done` as ever.
#[derive(Clone, Copy)]
pub struct Finished {
    pub out: *mut bf16,
    pub residual: Option<*const bf16>,
    pub ld: usize,
    pub act: crate::model::op::Act,
}

/// One vector of f32 sums finished and stored as bf16, its `mask`ed lanes: the residual's
/// values (bf16, at `residual`) widened and added, the activation ([`activate_zmm`], bit for
/// bit what [`super::kernels::activate`] and the depthwise `Finish` apply), then narrowed by
/// `vcvtneps2bf16` (to nearest, ties to even, as [`super::elem::f32_bf16`]; it also flushes
/// f32 subnormals, below 1.2·10⁻³⁸, to zero) and stored at `out`. The register epilogue of
/// every bf16-pair GEMM's rows (the kernels here, [`Done::finish`]) and the depthwise pairs.
///
/// # Safety
/// The CPU has AVX-512F, BW, VL and AVX512_BF16; the masked lanes at `out` (and `residual`)
/// are inside their tensors.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn store_finished(
    v: std::arch::x86_64::__m512,
    residual: Option<*const bf16>,
    act: crate::model::op::Act,
    out: *mut bf16,
    mask: std::arch::x86_64::__mmask16,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's (masked loads and stores).
    unsafe {
        let v = match residual {
            Some(r) => {
                let r = _mm256_maskz_loadu_epi16(mask, r.cast());
                let r = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(r));
                _mm512_add_ps(v, _mm512_castsi512_ps(r))
            }
            None => v,
        };
        let h = _mm512_cvtneps_pbh(super::kernels::activate_zmm(act, v));
        let h = std::mem::transmute::<__m256bh, __m256i>(h);
        _mm256_mask_storeu_epi16(out.cast(), mask, h);
    }
}

impl Finished {
    /// The same, from C's value (i, j) on.
    fn at(self, i: usize, j: usize) -> Finished {
        let off = i * self.ld + j;
        Finished {
            out: self.out.wrapping_add(off),
            residual: self.residual.map(|r| r.wrapping_add(off)),
            ..self
        }
    }
}

/// A block of C in f32 (32 rows of [`BLOCK_COLS`]) on a cache line: AMX stores its tiles here
/// 64 bytes a row, before [`Done::finish`] reads them.
#[repr(C, align(64))]
pub(crate) struct CBlock(pub [f32; BLOCK_ROWS * BLOCK_COLS]);

impl Default for CBlock {
    fn default() -> Self {
        CBlock([0.0; BLOCK_ROWS * BLOCK_COLS])
    }
}

/// A finished block of C: its first row and row count, its first column (from panel p0's) and
/// valid column count, and its values (32 rows of [`BLOCK_COLS`] f32, `cols` valid per row),
/// with B's bias still to add where `bias` says so ([`Done::rows`] and [`Done::finish`] add
/// it).
pub struct Done<'a> {
    pub row: usize,
    pub rows: usize,
    pub col: usize,
    pub cols: usize,
    pub values: &'a mut [f32],
    /// B's bias for the block's columns (from `col`), where `values` do not hold it yet: AMX's
    /// tiles start from zero.
    pub bias: Option<&'a [f32]>,
}

impl<'a> Done<'a> {
    /// The block's rows, each as C's row index and its `cols` valid values (the bias added).
    pub fn rows(self) -> impl Iterator<Item = (usize, &'a [f32])> {
        if let Some(bias) = self.bias {
            for row in self.values.chunks_exact_mut(BLOCK_COLS).take(self.rows) {
                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
            }
        }
        let (row, cols) = (self.row, self.cols);
        let rows = self.values.chunks_exact(BLOCK_COLS).take(self.rows);
        rows.enumerate().map(move |(r, v)| (row + r, &v[..cols]))
    }

    /// The block's rows (the bias added) into `dst`, C's row i at `i · ld + col`, or added to
    /// what is there where `add`: 16 lanes at a time under masks. A closure handed to [`gemm`]
    /// is compiled without its caller's target features: the attention's loops there ran on
    /// SSE registers and its copies called `memmove` a row at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512F (every CPU that runs the engines does); `dst` holds every row's
    /// `cols` values at its place.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn write_into(self, dst: &mut [f32], ld: usize, add: bool) {
        use std::arch::x86_64::*;
        let (col, cols) = (self.col, self.cols);
        debug_assert!(cols <= BLOCK_COLS);
        let lanes = |n: usize| -> __mmask16 { ((1u32 << n.min(16)) - 1) as __mmask16 };
        let (m0, m1) = (lanes(cols), lanes(cols.saturating_sub(16)));
        for (i, v) in self.rows() {
            let at = i * ld + col;
            assert!(at + cols <= dst.len(), "a block's row past its destination");
            // SAFETY: the masks cover `cols` values of `v` and of dst from `at` (checked); the
            // second half's pointers are only formed (wrapping), not read, where its mask is 0.
            unsafe {
                let (s, d) = (v.as_ptr(), dst.as_mut_ptr().add(at));
                let mut x0 = _mm512_maskz_loadu_ps(m0, s);
                let mut x1 = _mm512_maskz_loadu_ps(m1, s.wrapping_add(16));
                if add {
                    x0 = _mm512_add_ps(x0, _mm512_maskz_loadu_ps(m0, d));
                    x1 = _mm512_add_ps(x1, _mm512_maskz_loadu_ps(m1, d.wrapping_add(16)));
                }
                _mm512_mask_storeu_ps(d, m0, x0);
                _mm512_mask_storeu_ps(d.wrapping_add(16), m1, x1);
            }
        }
    }

    /// Never called: [`Engine::in_use`] is `None` off x86-64.
    ///
    /// # Safety
    /// None needed; it panics.
    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn write_into(self, _dst: &mut [f32], _ld: usize, _add: bool) {
        unreachable!("bf16 pairs are multiplied on x86-64 only")
    }

    /// The block finished and stored as the `vdpbf16ps` kernels store their rows in
    /// registers: C's value (i, j) at `f`'s place (i, j) (`f` is where C's first row and
    /// column go), through the same `store_finished`, so bit for bit the same values.
    /// What the caller of [`gemm`] does with AMX's blocks.
    ///
    /// # Safety
    /// As for `store_finished`: the CPU has AVX-512F, BW, VL and AVX512_BF16; the block's
    /// rows and valid columns at `f`'s places (and its residual's) are inside their tensors.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
    pub unsafe fn finish(&self, f: Finished) {
        use std::arch::x86_64::*;
        // The bias's two halves (zeros where there is none or past `cols`). No closures
        // around the intrinsics: one passed to `array::map` is compiled apart from this
        // function's target features, and its intrinsics became calls.
        let (b0, b1) = match self.bias {
            Some(b) => {
                let mask = |n: usize| ((1u32 << n.min(PANEL)) - 1) as __mmask16;
                // SAFETY: the bias has `cols` values, of which the masks read those there are.
                unsafe {
                    (
                        _mm512_maskz_loadu_ps(mask(self.cols), b.as_ptr()),
                        _mm512_maskz_loadu_ps(
                            mask(self.cols.saturating_sub(PANEL)),
                            b[PANEL.min(b.len())..].as_ptr(),
                        ),
                    )
                }
            }
            None => (_mm512_setzero_ps(), _mm512_setzero_ps()),
        };
        for (r, row) in self
            .values
            .chunks_exact(BLOCK_COLS)
            .take(self.rows)
            .enumerate()
        {
            // SAFETY: a row holds BLOCK_COLS floats; the places are the caller's.
            unsafe {
                let halves = [
                    _mm512_add_ps(_mm512_loadu_ps(row.as_ptr()), b0),
                    _mm512_add_ps(_mm512_loadu_ps(row[PANEL..].as_ptr()), b1),
                ];
                dot::finish(halves, f.at(self.row + r, self.col), self.cols);
            }
        }
    }

    /// Never called: [`Engine::in_use`] is `None` off x86-64.
    ///
    /// # Safety
    /// None needed; it panics.
    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn finish(&self, _f: Finished) {
        unreachable!("bf16 pairs are multiplied on x86-64 only")
    }
}

/// C = A[0..m, 0..Kp] · B[.., panels p0..p1] + bias on `engine`, single-threaded, in f32,
/// handed to `done` one block (up to 32 × 32) at a time while it is in L1 (AMX's without the
/// bias, which the [`Done`] carries and its readers add): the caller applies
/// its epilogue and stores the block wherever it belongs — except where `finished` says where
/// C's rows go: then the `vdpbf16ps` kernels apply the epilogue to their accumulators in
/// registers and store the rows themselves, and `done` sees only AMX's blocks.
///
/// Panels are the outer loop: a pair of B panels (Kp × 32 bf16) is reused by every row block
/// of A, which streams from L2.
///
/// # Safety
/// The CPU runs `engine` (AMX: [`super::amx::available`]; Dot: AVX-512F and AVX512_BF16);
/// `a` points to `m` rows of at least `b.kp()` readable bf16 spaced `lda` apart, zero past
/// `b.k` (finite at least: they meet B's zero padding). `finished`'s output (and residual)
/// holds C's m rows of the panels' columns at its places, written (read) by nobody else
/// meanwhile.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    engine: Engine,
    m: usize,
    a: *const bf16,
    lda: usize,
    b: &PackedPairs,
    panels: (usize, usize),
    finished: Option<Finished>,
    done: &mut impl FnMut(Done<'_>),
) {
    // SAFETY: the caller's.
    unsafe { gemm_stored(engine, m, a, lda, b, panels, (finished, None), done) }
}

/// Where a block of C is stored straight, in f32 ([`gemm_into`]): C's value (i, j) (row i of
/// the call's A, column j counted from panel p0's first) at `c + i·ldc + j`.
#[derive(Clone, Copy)]
pub struct Tiles {
    pub c: *mut f32,
    pub ldc: usize,
}

/// [`gemm`] where C is wanted as it is, in f32 (no bias, no epilogue), at `tiles`' places: AMX
/// stores its tiles there, and the `vdpbf16ps` block kernel its rows, where both stored into
/// a block and `done` copied it on (the scores of a Llama prefill's attention: a copy per
/// block, 13% of the attention's time on AMX with the tile stores it doubled). In a prefill's
/// BF16 attention at 2048 tokens on a Zen 4 (`vdpbf16ps`, 2 threads, the kernel alone, old and
/// new alternating in one process, 6 rounds): Qwen2.5-0.5B's heads 0.945× the time, Llama-3.2-1B's
/// 0.93×, Qwen's at 512 0.96× (6 of 6 each). The kernels for a few k-pairs and for a last
/// half panel still hand their blocks to `done`.
///
/// # Safety
/// As for [`gemm`], and B has no bias (AMX's stores leave it out); `tiles` holds C's rows
/// rounded up to whole blocks of 32 and the panels' columns rounded up to whole panels of
/// 16, written (read) by nobody else meanwhile.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_into(
    engine: Engine,
    m: usize,
    a: *const bf16,
    lda: usize,
    b: &PackedPairs,
    panels: (usize, usize),
    tiles: Tiles,
    done: &mut impl FnMut(Done<'_>),
) {
    debug_assert!(
        b.bias.iter().all(|&x| x == 0.0),
        "AMX's stores leave the bias out"
    );
    // SAFETY: the caller's.
    unsafe { gemm_stored(engine, m, a, lda, b, panels, (None, Some(tiles)), done) }
}

/// [`gemm`] and [`gemm_into`]: the `vdpbf16ps` kernels store their rows finished where
/// `finished` says, AMX its tiles where `tiles` says; the rest go to `done`.
///
/// # Safety
/// As for [`gemm`] and [`gemm_into`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_stored(
    engine: Engine,
    m: usize,
    a: *const bf16,
    lda: usize,
    b: &PackedPairs,
    (p0, p1): (usize, usize),
    (finished, tiles): (Option<Finished>, Option<Tiles>),
    done: &mut impl FnMut(Done<'_>),
) {
    let kp = b.kp;
    assert_eq!(
        kp % engine.k_step(),
        0,
        "B is packed for a coarser K step than the engine's"
    );
    // AMX's tiles take 32 rows, so a last block of fewer is copied and zero-padded; the
    // `vdpbf16ps` kernel computes the rows it is given, read in place.
    let whole = match engine {
        Engine::Amx => m / BLOCK_ROWS * BLOCK_ROWS,
        Engine::Dot => m,
    };
    if engine == Engine::Amx {
        // SAFETY: the CPU runs AMX (the contract).
        unsafe { super::amx::configure() };
    }
    EDGE.with_borrow_mut(|edge| {
        if whole < m {
            edge.refill_zeros(BLOCK_ROWS * kp);
            for r in 0..m - whole {
                // SAFETY: rows whole..m of A have kp readable values (the contract).
                let src = unsafe { std::slice::from_raw_parts(a.add((whole + r) * lda), kp) };
                edge[r * kp..(r + 1) * kp].copy_from_slice(src);
            }
        }
        let CBlock(values) = &mut CBlock::default();
        // Whether the kernel for a few k-pairs may take the blocks (it says for each).
        let few = kp / 2 <= dot::STATIONARY;
        let halves = engine == Engine::Dot && !few;
        // Panel p's step: whether it goes with p + 1, and the columns they hold. A last panel
        // of 8 columns or fewer goes alone, to the `vdpbf16ps` half kernel (not where B fits
        // in registers: there the zmm kernels were as fast).
        let step = |p: usize| {
            let half_next = halves && p + 2 == p1 && b.n - (p + 1) * PANEL <= PANEL / 2;
            let pair = p + 1 < p1 && !half_next;
            (
                pair,
                (if pair { 2 } else { 1 } * PANEL).min(b.n - p * PANEL),
            )
        };
        let next = |p: usize| p + if step(p).0 { 2 } else { 1 };
        let rows_outer = engine.rows_outer(kp, b.n);
        // (Rows-outer is AMX's order alone.)
        let resident = rows_outer && kp == super::amx::RESIDENT_K;
        // The block of rows i.. and panel p (and p + 1).
        let mut one = |i: usize, p: usize| {
            let (pair, cols) = step(p);
            let rows = BLOCK_ROWS.min(m - i);
            let (ab, ldab) = if i < whole {
                // SAFETY: row i exists (the contract).
                (unsafe { a.add(i * lda) }, lda)
            } else {
                (edge.as_ptr(), kp)
            };
            // SAFETY: the block's A rows have kp values (above: 32 rows for AMX, `rows` for
            // Dot), panels p (and p + 1) of B exist, `values` holds 32 rows of BLOCK_COLS
            // floats; the CPU runs `engine` (the contract), and AMX's tiles are configured
            // above.
            let stored = unsafe {
                let c = values.as_mut_ptr();
                let here = finished.map(|f| (f.at(i, (p - p0) * PANEL), cols));
                let (tc, ldc) = match tiles {
                    Some(t) => (t.c.add(i * t.ldc + (p - p0) * PANEL), t.ldc),
                    None => (c, BLOCK_COLS),
                };
                match engine {
                    Engine::Amx if resident => {
                        if p == p0 {
                            super::amx::load_resident(ab, ldab);
                        }
                        super::amx::resident(b, p, pair, tc, ldc);
                        tiles.is_some()
                    }
                    Engine::Amx => {
                        let panels = super::amx::Panels {
                            p,
                            pair,
                            first: i == 0,
                        };
                        super::amx::block(ab, (ldab, KSTEP), b, panels, tc, ldc);
                        tiles.is_some()
                    }
                    Engine::Dot if halves && !pair && cols <= PANEL / 2 => {
                        dot::half(ab, ldab, rows, b, p, c, here);
                        here.is_some()
                    }
                    Engine::Dot => {
                        let few = few && dot::few_pairs(ab, ldab, rows, b, p, pair, c, here);
                        if !few {
                            dot::block(ab, ldab, rows, b, p, pair, tc, ldc, here)
                        }
                        here.is_some() || (!few && tiles.is_some())
                    }
                }
            };
            if !stored {
                done(Done {
                    row: i,
                    rows,
                    col: (p - p0) * PANEL,
                    cols,
                    values,
                    bias: (engine == Engine::Amx).then(|| &b.bias_from(p)[..cols]),
                });
            }
        };
        let blocks = (0..m).step_by(BLOCK_ROWS);
        if rows_outer {
            for i in blocks {
                let mut p = p0;
                while p < p1 {
                    one(i, p);
                    p = next(p);
                }
            }
        } else {
            let mut p = p0;
            while p < p1 {
                for i in blocks.clone() {
                    one(i, p);
                }
                p = next(p);
            }
        }
    });
    if engine == Engine::Amx {
        // SAFETY: as above; hands the tile state back.
        unsafe { super::amx::release() };
    }
}

/// Never called: [`Engine::in_use`] is `None` off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    _engine: Engine,
    _m: usize,
    _a: *const bf16,
    _lda: usize,
    _b: &PackedPairs,
    _panels: (usize, usize),
    _finished: Option<Finished>,
    _done: &mut impl FnMut(Done<'_>),
) {
    unreachable!("bf16 pairs are multiplied on x86-64 only")
}

/// Never called: [`Engine::in_use`] is `None` off x86-64.
///
/// # Safety
/// None needed; it panics.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_into(
    _engine: Engine,
    _m: usize,
    _a: *const bf16,
    _lda: usize,
    _b: &PackedPairs,
    _panels: (usize, usize),
    _tiles: Tiles,
    _done: &mut impl FnMut(Done<'_>),
) {
    unreachable!("bf16 pairs are multiplied on x86-64 only")
}

/// The `vdpbf16ps` block kernel.
#[cfg(target_arch = "x86_64")]
mod dot {
    use super::{BLOCK_COLS, Finished, KSTEP, PANEL, PackedPairs};
    use half::bf16;
    use std::arch::x86_64::*;

    /// How far ahead (k-pair rows of 64 bytes) `group` asks for B: the next 4 KiB page of the
    /// panel, for weights that come from memory (see the SGEMM's `B_PREFETCH`).
    const B_PREFETCH: usize = 64;

    /// K per pass over the block's row groups; the accumulators go through C (in L1) between
    /// passes. Passes of 256 (their B and A rows, 16 KiB each, fit L1) ran a 1024³ GEMM at
    /// 393 GFLOP/s on two Zen 4 cores; passes of 1024, whose rows stream from L2 behind the B
    /// panels' prefetches, at 421 (five interleaved runs, medians); ResNet-50's layers
    /// unchanged.
    const KCHUNK: usize = 32 * KSTEP;

    /// One block of C for panel p (and p + 1 when `pair`), as AMX's `block` computes it, of
    /// `rows` rows (up to 32): the bias, then each K chunk adds its share, 8 rows × 2 panels
    /// (or 16 rows × 1) of accumulators in registers at a time. A pair's last rows go 4 and
    /// then 1 at a time; a single panel's last group of fewer than 16 repeats its last row
    /// (C's rows past `rows` then hold copies, which nobody reads).
    ///
    /// With `finished` (the block's first place and its valid columns) the last K chunk's
    /// sums are finished in registers and stored there ([`finish`]), the block's rows only;
    /// C then holds the earlier chunks' partial sums.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW, VL and AVX512_BF16; `a` has `rows` rows of `b.kp()` values
    /// spaced `lda` apart; `c` has 32 rows of 32 (`pair`) or 16 writable floats spaced `ldc`
    /// apart; `finished` as [`super::gemm`] takes it.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
    pub(super) unsafe fn block(
        a: *const bf16,
        lda: usize,
        rows: usize,
        b: &PackedPairs,
        p: usize,
        pair: bool,
        c: *mut f32,
        ldc: usize,
        finished: Option<(Finished, usize)>,
    ) {
        let kp = b.kp();
        let panels = [
            b.panel(p).as_ptr(),
            b.panel((p + 1).min(b.panels() - 1)).as_ptr(),
        ];
        let bias = [
            b.bias(p).as_ptr(),
            b.bias((p + 1).min(b.panels() - 1)).as_ptr(),
        ];
        // SAFETY: the caller's contract: every row and column touched is inside A, B and C.
        unsafe {
            for k0 in (0..kp).step_by(KCHUNK) {
                let pairs = (KCHUNK.min(kp - k0)) / 2;
                // Row k0 / 2 of each panel: k-pair rows are 2 × PANEL values long. The first
                // chunk starts from the bias, the others from C.
                let bk = panels.map(|q| q.add(k0 * PANEL));
                let start = (k0 == 0).then_some(bias);
                let last = k0 + KCHUNK >= kp;
                // Row r of the group at r0, clamped to the block's last row.
                let at = |r0: usize| move |r: usize| a.add(((r0 + r).min(rows - 1)) * lda + k0);
                // Where the group at r0 stores its rows finished (after the last chunk), and
                // how many of them are the block's.
                let fin = |r0: usize| {
                    finished
                        .filter(|_| last)
                        .map(|(f, cols)| (f.at(r0, 0), cols, rows - r0))
                };
                // Groups of 8 rows (16 for one panel) while they last; the last rows in groups
                // of 4 (and 8 for one panel), then one at a time: a group of 8 for the last 1
                // of ResNet-50's 49 rows at batch 1 (7 × 7) computed 7 copies of it.
                let mut r0 = 0;
                while r0 < rows {
                    let (cr, left) = (c.add(r0 * ldc), rows - r0);
                    r0 += match (pair, left) {
                        (true, 8..) => {
                            let a = std::array::from_fn(at(r0));
                            group::<8, 2>(a, bk, pairs, cr, ldc, start, fin(r0));
                            8
                        }
                        (true, 4..) => {
                            let a = std::array::from_fn(at(r0));
                            group::<4, 2>(a, bk, pairs, cr, ldc, start, fin(r0));
                            4
                        }
                        (true, _) => {
                            single::<2>(at(r0)(0), bk, pairs, cr, start, fin(r0));
                            1
                        }
                        (false, 16..) => {
                            let a = std::array::from_fn(at(r0));
                            group::<16, 1>(a, bk, pairs, cr, ldc, start, fin(r0));
                            16
                        }
                        // A panel's last rows in groups of 8 and 4, as a pair's, then one at
                        // a time (one row: a decode step at batch 1).
                        (false, 8..) => {
                            let a = std::array::from_fn(at(r0));
                            group::<8, 1>(a, bk, pairs, cr, ldc, start, fin(r0));
                            8
                        }
                        (false, 4..) => {
                            let a = std::array::from_fn(at(r0));
                            group::<4, 1>(a, bk, pairs, cr, ldc, start, fin(r0));
                            4
                        }
                        (false, _) => {
                            single::<1>(at(r0)(0), bk, pairs, cr, start, fin(r0));
                            1
                        }
                    };
                }
            }
        }
    }

    /// Rows of C for a last panel of at most 8 valid columns (MobileNetV3's 24, 40, 72, 120,
    /// 184 and 200 channels end in one): the panel's left halves by 256-bit `vdpbf16ps`,
    /// which costs half a 512-bit one's FP-pipe time on Zen 4 (two 256-bit units) and never
    /// more elsewhere, where the zmm kernels multiplied the padding's 8 columns too. Rows in
    /// groups of 8 (the last repeating the block's last row), all of K at once (8
    /// accumulators). With `finished` the rows are finished and stored there, else written
    /// to `c` (32 rows of [`BLOCK_COLS`]). MobileNetV3-Large BF16 at batch 8 (100 steps
    /// alternating in one process): its 72 → 40 and 120 → 40 layers 0.89–0.90× the time,
    /// 72 → 24 0.94×, the network 0.99×.
    ///
    /// # Safety
    /// As for [`block`] with one panel; `finished` as [`super::gemm`] takes it.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
    pub(super) unsafe fn half(
        a: *const bf16,
        lda: usize,
        rows: usize,
        b: &PackedPairs,
        p: usize,
        c: *mut f32,
        finished: Option<(Finished, usize)>,
    ) {
        const R: usize = 8;
        let (panel, bias, pairs) = (b.panel(p).as_ptr(), b.bias(p).as_ptr(), b.kp() / 2);
        // SAFETY: the caller's contract (unaligned loads and stores throughout).
        unsafe {
            let start = _mm256_loadu_ps(bias);
            for r0 in (0..rows).step_by(R) {
                let ar: [*const bf16; R] =
                    std::array::from_fn(|i| a.add((r0 + i).min(rows - 1) * lda));
                let mut acc = [start; R];
                for k2 in 0..pairs {
                    let bv = std::mem::transmute::<__m256i, __m256bh>(_mm256_loadu_si256(
                        panel.add(k2 * 2 * PANEL).cast(),
                    ));
                    for (x, ar) in acc.iter_mut().zip(&ar) {
                        let pair = ar.add(2 * k2).cast::<i32>().read_unaligned();
                        let av = std::mem::transmute::<__m256i, __m256bh>(_mm256_set1_epi32(pair));
                        *x = _mm256_dpbf16_ps(*x, bv, av);
                    }
                }
                for (i, x) in acc.iter().enumerate().take(rows - r0) {
                    let r = r0 + i;
                    let v = _mm512_zextps256_ps512(*x);
                    match finished {
                        Some((f, cols)) => finish([v], f.at(r, 0), cols),
                        None => _mm512_storeu_ps(c.add(r * BLOCK_COLS), v),
                    }
                }
            }
        }
    }

    /// The most k-pair rows of B (over all panels) that [`stationary`] holds in registers.
    pub(super) const STATIONARY: usize = 24;

    /// [`block`] by [`stationary`] where B's k-pair rows for the block's panels fit in
    /// registers ([`STATIONARY`]); `false` (nothing done) where they do not. Kept apart from
    /// `block`, whose code for larger K it would otherwise share. With `finished` (the
    /// block's first place and its valid columns) the rows are finished and stored there,
    /// else written to `c` (32 rows of [`BLOCK_COLS`]).
    ///
    /// # Safety
    /// As for [`block`]; `finished` as [`super::gemm`] takes it.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
    pub(super) unsafe fn few_pairs(
        a: *const bf16,
        lda: usize,
        rows: usize,
        b: &PackedPairs,
        p: usize,
        pair: bool,
        c: *mut f32,
        finished: Option<(Finished, usize)>,
    ) -> bool {
        let panels = [
            b.panel(p).as_ptr(),
            b.panel((p + 1).min(b.panels() - 1)).as_ptr(),
        ];
        let bias = [
            b.bias(p).as_ptr(),
            b.bias((p + 1).min(b.panels() - 1)).as_ptr(),
        ];
        macro_rules! stationary {
            ($($pairs:literal),*) => {
                match (b.kp() / 2, pair) {
                    $(($pairs, true) if 2 * $pairs <= STATIONARY => {
                        stationary::<$pairs, 2, 2>(a, lda, rows, panels, bias, c, finished)
                    }
                    ($pairs, false) => {
                        stationary::<$pairs, 1, 4>(a, lda, rows, panels, bias, c, finished)
                    })*
                    _ => return false,
                }
            };
        }
        // SAFETY: the caller's contract: every row and column touched is inside A, B and C,
        // and K is one chunk.
        unsafe { stationary!(4, 8, 12, 16, 20, 24) };
        true
    }

    /// C[rows × PANELS·16] = bias + A[rows × 2·PAIRS] · B for a K of a few k-pairs: B's
    /// PAIRS × PANELS k-pair rows held in registers while the rows of A stream past them, R
    /// rows at a time (the last R repeating the block's last row; each row a chain of PAIRS
    /// `vdpbf16ps` per panel). The row-group kernel ([`group`]) kept 16 row pointers, which
    /// spilled, and reloaded them from the stack on every k-pair: MobileNetV3's 16 → 16
    /// layer (K = 16) ran at a third of `vdpbf16ps`'s rate. A row at a time left the
    /// overlap of the rows' chains (6 cycles a step on Zen 4) to out-of-order execution:
    /// 2 rows of 2 panels and 4 of one ran MobileNetV3's 24 → 72, 16 → 64 and 16 → 16
    /// layers in 0.97×, 0.95× and 0.955× the time (alone, batch 8, 150–300 steps
    /// alternating in one process); 4 rows of 2 panels 1.09× (registers: B's 16 and 8
    /// accumulators).
    ///
    /// Each row's sums are stored to `c` (f32), or finished in registers where `finished`
    /// says where ([`finish`]).
    ///
    /// # Safety
    /// As for `few_pairs`, with K = 2·PAIRS padded (one chunk).
    #[inline(always)]
    unsafe fn stationary<const PAIRS: usize, const PANELS: usize, const R: usize>(
        a: *const bf16,
        lda: usize,
        rows: usize,
        panels: [*const bf16; 2],
        bias: [*const f32; 2],
        c: *mut f32,
        finished: Option<(Finished, usize)>,
    ) {
        // SAFETY: the caller's contract (unaligned loads and stores throughout).
        unsafe {
            let bv: [[__m512bh; PANELS]; PAIRS] = std::array::from_fn(|k2| {
                std::array::from_fn(|q| {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        panels[q].add(k2 * 2 * PANEL).cast(),
                    ))
                })
            });
            let start: [__m512; PANELS] = std::array::from_fn(|q| _mm512_loadu_ps(bias[q]));
            for r0 in (0..rows).step_by(R) {
                // R rows at once (the last group repeating the block's last row).
                let ar: [*const bf16; R] =
                    std::array::from_fn(|i| a.add((r0 + i).min(rows - 1) * lda));
                let mut acc = [start; R];
                for (k2, bk) in bv.iter().enumerate() {
                    for (acc, ar) in acc.iter_mut().zip(&ar) {
                        let pair = ar.add(2 * k2).cast::<i32>().read_unaligned();
                        let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                        for (x, bq) in acc.iter_mut().zip(bk) {
                            *x = _mm512_dpbf16_ps(*x, *bq, av);
                        }
                    }
                }
                for (i, acc) in acc.iter().enumerate().take(rows - r0) {
                    let r = r0 + i;
                    match finished {
                        Some((f, cols)) => finish(*acc, f.at(r, 0), cols),
                        None => {
                            for (q, x) in acc.iter().enumerate() {
                                _mm512_storeu_ps(c.add(r * BLOCK_COLS + q * PANEL), *x);
                            }
                        }
                    }
                }
            }
        }
    }

    /// One row's sums (a vector per panel) finished and stored as `f` says, the first `cols`
    /// values, by [`super::store_finished`]. In registers, the block's trip through C and the
    /// store's passes over it went: MobileNetV3-Large's 16 → 16 layer with its residual (`features.1.block.1.0`, BF16
    /// batch 8) 0.375 → 0.213 ms in the network; its wider neighbours (16 → 64, 24 → 72)
    /// unchanged, with the line prefetch below (without it 16 → 64 ran 18% slower).
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW, VL and AVX512_BF16; `cols` values from `f.out` (and
    /// `f.residual`) are inside their tensors.
    #[inline(always)]
    pub(super) unsafe fn finish<const PANELS: usize>(
        acc: [__m512; PANELS],
        f: Finished,
        cols: usize,
    ) {
        // SAFETY: the caller's (masked loads and stores); prefetches are hints, whatever the
        // address.
        unsafe {
            // The line a block further down, which the hardware prefetchers do not foresee
            // (rows are `ld` apart; as `conv2d_pairs`'s store does for `done`'s blocks).
            let ahead = super::BLOCK_ROWS * f.ld;
            _mm_prefetch::<_MM_HINT_T0>(f.out.wrapping_add(ahead).cast());
            if let Some(r) = f.residual {
                _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(ahead).cast());
            }
            for (q, v) in acc.into_iter().enumerate() {
                let n = cols.saturating_sub(q * PANEL).min(PANEL);
                if n == 0 {
                    break;
                }
                let mask = (u32::MAX >> (32 - n)) as __mmask16;
                let residual = f.residual.map(|r| r.add(q * PANEL));
                super::store_finished(v, residual, f.act, f.out.add(q * PANEL), mask);
            }
        }
    }

    /// Independent accumulators per panel in [`single`]: `vdpbf16ps` has a latency of several
    /// cycles, and one row's single chain per panel waited on it (slower than 8 copies of the
    /// row, which at least kept 16 chains going).
    const CHAINS: usize = 4;

    /// C[1 × PANELS·16] += a[2·pairs] · B[2·pairs × PANELS·16] for one row of A: [`CHAINS`]
    /// k-pairs at a time into their own accumulators, summed at the end, so the step streams B
    /// at memory speed (a GEMV: each weight is used once). `pairs` is a multiple of CHAINS (K
    /// is padded to [`super::DOT_KSTEP`]).
    ///
    /// # Safety
    /// As for `group` with one row.
    #[inline(always)]
    unsafe fn single<const PANELS: usize>(
        a: *const bf16,
        b: [*const bf16; 2],
        pairs: usize,
        c: *mut f32,
        bias: Option<[*const f32; 2]>,
        finished: Option<(Finished, usize, usize)>,
    ) {
        // SAFETY: the caller's contract (unaligned loads and stores throughout).
        unsafe {
            let mut acc: [[__m512; PANELS]; CHAINS] = [[_mm512_setzero_ps(); PANELS]; CHAINS];
            for (q, x) in acc[0].iter_mut().enumerate() {
                *x = match bias {
                    Some(bias) => _mm512_loadu_ps(bias[q]),
                    None => _mm512_loadu_ps(c.add(q * PANEL)),
                };
            }
            // No prefetch hints for B here: the hardware prefetchers follow the panels' two
            // streams on their own, and the hints cost more than they saved. A decode step's
            // linear layers at one row over bf16 weights from memory (`cargo bench --bench
            // cpu_decoder -- stream`, hints 64 k-pairs ahead and none alternating call by call
            // in one process, medians of 14), on a Zen 4 (2 vCPU): Llama-3.2-1B's shapes
            // 0.93–0.95× the time without (3 runs), Qwen2.5-0.5B's 0.90–1.00× (3). The f32
            // tiles' thin rows dropped theirs for the same reason. `group` keeps them: at 8
            // rows, without them Llama's shapes took 0.98–1.06× the time, Qwen's 0.91–1.03×.
            for k2 in (0..pairs).step_by(CHAINS) {
                for (u, chain) in acc.iter_mut().enumerate() {
                    let pair = a.add(2 * (k2 + u)).cast::<i32>().read_unaligned();
                    let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                    for (q, x) in chain.iter_mut().enumerate() {
                        let bv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                            b[q].add((k2 + u) * 2 * PANEL).cast(),
                        ));
                        *x = _mm512_dpbf16_ps(*x, av, bv);
                    }
                }
            }
            let sums: [__m512; PANELS] = std::array::from_fn(|q| {
                (acc[1..].iter()).fold(acc[0][q], |sum, chain| _mm512_add_ps(sum, chain[q]))
            });
            match finished {
                Some((f, cols, _)) => finish(sums, f, cols),
                None => {
                    for (q, sum) in sums.iter().enumerate() {
                        _mm512_storeu_ps(c.add(q * PANEL), *sum);
                    }
                }
            }
        }
    }

    /// C[ROWS × PANELS·16] += A[ROWS × 2·pairs] · B[2·pairs × PANELS·16], accumulators in
    /// registers: per k-pair, `PANELS` loads of B, `ROWS` broadcasts of an A pair (32 bits),
    /// ROWS × PANELS `vdpbf16ps`. The accumulators start from `bias` (16 values a panel, on
    /// every row) where given, else from C. They are stored to C, or, where `finished` gives
    /// the group's first place, its valid columns and how many of its rows are real (the
    /// others repeat the last), those rows finished in registers ([`finish`]).
    ///
    /// # Safety
    /// As for `block`: each `a[r]` has 2·pairs values, each `b[q]` `pairs` k-pair rows, `c`
    /// ROWS rows of PANELS·16 floats (ldc apart), each `bias[q]` 16 floats.
    #[inline(always)]
    unsafe fn group<const ROWS: usize, const PANELS: usize>(
        a: [*const bf16; ROWS],
        b: [*const bf16; 2],
        pairs: usize,
        c: *mut f32,
        ldc: usize,
        bias: Option<[*const f32; 2]>,
        finished: Option<(Finished, usize, usize)>,
    ) {
        // SAFETY: the caller's contract (unaligned loads and stores throughout).
        unsafe {
            let mut acc: [[__m512; PANELS]; ROWS] = std::array::from_fn(|r| {
                std::array::from_fn(|q| match bias {
                    Some(bias) => _mm512_loadu_ps(bias[q]),
                    None => _mm512_loadu_ps(c.add(r * ldc + q * PANEL)),
                })
            });
            for k2 in 0..pairs {
                // Each panel's k-pair row B_PREFETCH ahead (a hint), as the SGEMM tiles do.
                for bq in &b[..PANELS] {
                    let ahead = bq.wrapping_add((k2 + B_PREFETCH) * 2 * PANEL);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                }
                let bv: [__m512bh; PANELS] = std::array::from_fn(|q| {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        b[q].add(k2 * 2 * PANEL).cast(),
                    ))
                });
                for (row, a) in acc.iter_mut().zip(a) {
                    let pair = a.add(2 * k2).cast::<i32>().read_unaligned();
                    let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                    for (x, bq) in row.iter_mut().zip(bv) {
                        // The broadcast last: `vdpbf16ps` takes its third operand from memory
                        // broadcast ({1to16}), in the load, where second it took a
                        // `vbroadcastss` of its own. Single panels (16 rows a group, each
                        // pair used once): 120 → 40 and 672 → 112 at batch 8 0.91× and 0.95×
                        // the time (alone, 300 steps alternating in one process).
                        *x = _mm512_dpbf16_ps(*x, bq, av);
                    }
                }
            }
            match finished {
                Some((f, cols, real)) => {
                    for (r, row) in acc.into_iter().enumerate().take(real) {
                        finish(row, f.at(r, 0), cols);
                    }
                }
                None => {
                    for (r, row) in acc.iter().enumerate() {
                        for (q, x) in row.iter().enumerate() {
                            _mm512_storeu_ps(c.add(r * ldc + q * PANEL), *x);
                        }
                    }
                }
            }
        }
    }
}

/// Whether this CPU runs `engine`.
pub fn runs(engine: Engine) -> bool {
    match engine {
        #[cfg(target_arch = "x86_64")]
        Engine::Amx => super::amx::available(),
        #[cfg(not(target_arch = "x86_64"))]
        Engine::Amx => false,
        Engine::Dot => super::simd::best() >= Simd::Avx512Bf16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape class the blocks meet (row tails, single panels, K and N padding, a panel
    /// range that starts on an odd panel, K over several chunks), on every engine this CPU
    /// runs, against a plain f64 sum of the same bf16 values. Where it runs neither, it says
    /// so and checks only the packing.
    #[test]
    fn pair_gemms_match_naive() {
        let engines: Vec<Engine> = [Engine::Amx, Engine::Dot]
            .into_iter()
            .filter(|&e| runs(e))
            .collect();
        for &(m, k, n, p0, p1) in &[
            (1, 3, 16, 0, 1),
            (17, 64, 40, 0, 3),
            (32, 147, 64, 0, 4),
            (45, 600, 72, 1, 5),
            (100, 256, 1000, 0, 63),
            // AMX's rows-outer order at its shortest K (`Engine::rows_outer`), with A held in
            // the tiles (`amx::resident`), a tail block, a last panel alone.
            (70, 64, 300, 1, 19),
            (40, 50, 256, 0, 15),
            (64, 32, 48, 1, 2),
            (40, 1100, 32, 0, 2),
            // MobileNetV3's small 1×1 layers: K a multiple of 8, not of 32.
            (33, 40, 24, 0, 2),
            (9, 16, 16, 0, 1),
            // One panel's last rows in groups of 8 and 4, then one.
            (13, 96, 16, 0, 1),
            // B in registers: pairs of panels (K ≤ 24) and single ones (K ≤ 48).
            (45, 20, 72, 0, 5),
            (50, 16, 64, 0, 4),
            (37, 48, 40, 0, 3),
        ] {
            let av: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 29) as f32 - 14.0) / 8.0)
                .collect();
            let bv: Vec<f32> = (0..k * n)
                .map(|i| ((i * 104_729 % 23) as f32 - 11.0) / 16.0)
                .collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 / 4.0 - 3.0).collect();
            for step in [KSTEP, DOT_KSTEP] {
                let kp = PackedPairs::with_step(k, n, step, |_, _| {}, None).kp();
                assert!(
                    kp.is_multiple_of(step) && kp >= k && kp < k + step,
                    "k{k} step {step}: kp {kp}"
                );
            }
            // Each engine on its own packing, and `vdpbf16ps` on AMX's (a few rows of a layer
            // packed for the tiles: `Engine::for_rows`).
            let runs_on = engines.iter().map(|&e| (e, e.k_step()));
            let dot_on_tiles = engines
                .contains(&Engine::Dot)
                .then_some((Engine::Dot, KSTEP));
            for (engine, step) in runs_on.chain(dot_on_tiles) {
                let packed = PackedPairs::with_step(
                    k,
                    n,
                    step,
                    |j, col| {
                        col.iter_mut()
                            .enumerate()
                            .for_each(|(kk, v)| *v = bv[kk * n + j])
                    },
                    Some(&bias),
                );
                let kp = packed.kp();
                let lda = kp + 32;
                let mut a = vec![bf16::ZERO; m * lda];
                for r in 0..m {
                    for kk in 0..k {
                        a[r * lda + kk] = bf16::from_f32(av[r * k + kk]);
                    }
                }
                let width = (p1 * PANEL).min(n) - p0 * PANEL;
                let ldc = width + 5;
                let mut c = vec![f32::NAN; m * ldc];
                let mut seen = 0;
                // SAFETY: the CPU runs `engine`; A has m rows of kp values (zeros past k).
                unsafe {
                    gemm(
                        engine,
                        m,
                        a.as_ptr(),
                        lda,
                        &packed,
                        (p0, p1),
                        None,
                        &mut |d: Done<'_>| {
                            assert!(d.col + d.cols <= width && d.row + d.rows <= m);
                            seen += d.rows * d.cols;
                            let col = d.col;
                            for (i, v) in d.rows() {
                                c[i * ldc + col..][..v.len()].copy_from_slice(v);
                            }
                        },
                    )
                };
                assert_eq!(
                    seen,
                    m * width,
                    "{engine:?}: every element handed over once"
                );
                for r in 0..m {
                    for jj in 0..width {
                        let j = p0 * PANEL + jj;
                        let want: f64 = bias[j] as f64
                            + (0..k)
                                .map(|kk| {
                                    a[r * lda + kk].to_f64()
                                        * bf16::from_f32(bv[kk * n + j]).to_f64()
                                })
                                .sum::<f64>();
                        let got = c[r * ldc + jj] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{engine:?} (K step {step}) m{m} k{k} n{n} panels {p0}..{p1}: \
                             C[{r}][{j}] = {got}, want {want}"
                        );
                    }
                    // Nothing past the panels' columns is written.
                    assert!(c[r * ldc + width..(r + 1) * ldc].iter().all(|v| v.is_nan()));
                }
            }
        }
        if engines.is_empty() {
            eprintln!("neither AMX nor AVX512_BF16 on this machine: only the packing was checked");
        }
    }

    /// The rows the kernel for a few k-pairs finishes and stores itself ([`Finished`]) against
    /// the same GEMM's blocks handed to `done` and finished in plain code (residual added,
    /// `activate`, `f32_bf16`), bit for bit: pairs of panels and single ones, a last panel
    /// of 8 columns, row tails, with and without a residual, under each activation; nothing
    /// outside the panels' columns written. Blocks the kernel does not finish (larger K) still
    /// come to `done`. Where the CPU has no AVX512_BF16 it says so and checks nothing.
    #[test]
    fn finished_rows_match_done_blocks() {
        use crate::backend::cpu::elem::{bf16_f32, f32_bf16};
        use crate::backend::cpu::kernels::activate;
        use crate::model::op::Act;
        if !runs(Engine::Dot) {
            eprintln!("no AVX512_BF16 here: the finished rows are not exercised");
            return;
        }
        // The plain code is compiled for the paths in use, and the engine runs only where
        // they are AVX-512's: forced below (`WORKSHOP_CPU_SIMD=avx2`), `activate`'s SiLU is
        // AVX2 code, one bf16 ulp from the kernel's on some values, a pairing that never runs.
        if simd() < Simd::Avx512 {
            eprintln!("paths forced below AVX-512: the finished rows are not exercised");
            return;
        }
        let acts = [Act::Relu, Act::None, Act::Hardswish, Act::Silu, Act::Relu6];
        for (case, &(m, k, n, p0, p1)) in [
            (45, 16, 64, 0, 4),
            (37, 24, 72, 0, 5),
            (50, 40, 24, 0, 2),
            (33, 16, 16, 0, 1),
            (40, 72, 24, 0, 2),
            // The row-group kernel: groups of 8, 4 and 1 rows on a pair of panels, of 16
            // (the last repeating its last row) on one, a single row, and K in two chunks.
            (45, 200, 80, 1, 5),
            (29, 2100, 40, 0, 3),
            (3, 96, 16, 0, 1),
            (1, 64, 48, 0, 3),
            // The half kernel: a last panel of 8 columns, alone and split from a pair.
            (21, 96, 40, 0, 3),
            (19, 80, 24, 0, 2),
        ]
        .iter()
        .enumerate()
        {
            let act = acts[case % acts.len()];
            let value = |i: usize| ((i * 7919 % 29) as f32 - 14.0) / 8.0;
            let packed = PackedPairs::with_step(
                k,
                n,
                DOT_KSTEP,
                |j, col| {
                    (col.iter_mut().enumerate()).for_each(|(kk, v)| *v = value(kk * n + j) / 4.0)
                },
                Some(&(0..n).map(|j| j as f32 / 8.0 - 1.0).collect::<Vec<_>>()),
            );
            let kp = packed.kp();
            let mut a = vec![bf16::ZERO; m * kp];
            for r in 0..m {
                for kk in 0..k {
                    a[r * kp + kk] = bf16::from_f32(value(r * k + kk + 3));
                }
            }
            let ld = n + 3;
            let res: Vec<bf16> = (0..m * ld).map(|i| bf16::from_f32(value(i + 5))).collect();
            let res = (case % 2 == 0).then_some(res);
            let width = (p1 * PANEL).min(n) - p0 * PANEL;
            // A block handed to `done`, finished in plain code into `out`.
            let finish = |d: Done<'_>, out: &mut [bf16]| {
                for r in 0..d.rows {
                    let at = (d.row + r) * ld + d.col;
                    let mut v = d.values[r * BLOCK_COLS..][..d.cols].to_vec();
                    if let Some(res) = &res {
                        (v.iter_mut().zip(&res[at..])).for_each(|(v, x)| *v += bf16_f32(*x));
                    }
                    activate(act, &mut v);
                    (out[at..].iter_mut().zip(&v)).for_each(|(o, v)| *o = f32_bf16(*v));
                }
            };
            // The GEMM on the Dot engine, rows stored where `finished` says (if anywhere).
            let run = |finished: Option<Finished>, done: &mut dyn FnMut(Done<'_>)| {
                // SAFETY: the CPU runs the engine (checked above); A has m rows of kp values;
                // each caller's `finished` places m rows of ld ≥ width values, in its own
                // buffer (and the residual's).
                unsafe {
                    gemm(
                        Engine::Dot,
                        m,
                        a.as_ptr(),
                        kp,
                        &packed,
                        (p0, p1),
                        finished,
                        &mut |d| done(d),
                    )
                }
            };
            let mut want = vec![bf16::NAN; m * ld];
            run(None, &mut |d| finish(d, &mut want));
            let mut got = vec![bf16::NAN; m * ld];
            let finished = Finished {
                out: got.as_mut_ptr(),
                residual: res.as_ref().map(|r| r.as_ptr()),
                ld,
                act,
            };
            // The blocks still handed over, apart (`got` is written through `finished`).
            let mut handed = vec![bf16::NAN; m * ld];
            run(Some(finished), &mut |d| finish(d, &mut handed));
            // Every block handed over and finished by `Done::finish` (AMX's way): the same
            // values as the kernels' own.
            let mut blocks = vec![bf16::NAN; m * ld];
            let at = Finished {
                out: blocks.as_mut_ptr(),
                ..finished
            };
            // SAFETY: the CPU runs the engine (checked above); `at` places m rows of ld ≥
            // width values in `blocks`.
            run(None, &mut |d| unsafe { d.finish(at) });
            assert_eq!(
                blocks.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "m{m} k{k} n{n} {act:?}: blocks finished by Done::finish"
            );
            for (g, h) in got.iter_mut().zip(&handed).filter(|(_, h)| !h.is_nan()) {
                assert!(
                    g.is_nan(),
                    "m{m} k{k} n{n}: a value both finished and handed over"
                );
                *g = *h;
            }
            for r in 0..m {
                for j in 0..ld {
                    let (g, w) = (got[r * ld + j], want[r * ld + j]);
                    if j < width {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "m{m} k{k} n{n} {act:?}: row {r} column {j}: {g} against {w}"
                        );
                    } else {
                        assert!(
                            g.is_nan(),
                            "m{m} k{k} n{n}: column {j} past the panels written"
                        );
                    }
                }
            }
        }
    }

    /// `store_finished` narrows as `f32_bf16` rounds (to nearest, ties to even; NaNs quiet),
    /// on the values where rounding differs: ties either way, ±0, ±∞, the largest finite,
    /// NaNs, the smallest normal.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn store_finished_rounds_as_f32_bf16() {
        use crate::backend::cpu::elem::f32_bf16;
        use crate::model::op::Act;
        if !runs(Engine::Dot) {
            eprintln!("no AVX512_BF16 here: the narrowing is not used, nor checked");
            return;
        }
        let bits: [u32; 16] = [
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_7fff,
            0x3f80_8001,
            0x8000_0000,
            0,
            0x7f80_0000,
            0xff80_0000,
            0x7f7f_ffff,
            0x7fc0_0001,
            0xffa0_0000,
            0x4049_0fdb,
            0xc2f6_e979,
            0x3400_0000,
            0x0080_0000,
            0x7f80_0001,
        ];
        for sign in [0u32, 1 << 31] {
            let values = bits.map(|b| f32::from_bits(b ^ sign));
            for n in [16, 9, 1] {
                let mut got = [bf16::NAN; 16];
                // SAFETY: the CPU has AVX512_BF16 (checked above, with AVX-512F, BW and VL);
                // 16 values are read and at most 16 written.
                unsafe {
                    let v = std::arch::x86_64::_mm512_loadu_ps(values.as_ptr());
                    let mask = (u32::MAX >> (32 - n)) as u16;
                    store_finished(v, None, Act::None, got.as_mut_ptr(), mask);
                }
                for (j, (g, v)) in got.iter().zip(values).enumerate() {
                    let want = if j < n {
                        f32_bf16(v).to_bits()
                    } else {
                        bf16::NAN.to_bits()
                    };
                    assert_eq!(g.to_bits(), want, "{v} ({:#x}), {n} lanes", v.to_bits());
                }
            }
        }
    }
}

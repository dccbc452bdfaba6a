//! Stems read in place: convolutions of a few input channels (an image's 3), in BF16 where
//! the CPU multiplies pairs (`vdpbf16ps`), and in FP32 on AVX-512 ([`conv2d_stem_f32`]), which
//! also runs BF16 stems where BF16 widens to the FP32 FMAs.
//!
//! Through im2col and the pair GEMM, MobileNetV3's 3×3 stem (3 → 16 channels, stride 2) spent
//! half its time gathering columns: 27 values a pixel padded to 32, written out and read back,
//! for 27 multiply-adds per output channel. Here nothing is gathered. In NHWC, a kernel row's
//! taps over all input channels are one contiguous run of kw·cin values (9 for the 3×3 stem,
//! 21 for ResNet's 7×7), so each pair of the run is broadcast straight from the input; an odd
//! run's last pair is its last two values, the first weighted zero (reading one value past the
//! run could leave the tensor at its last pixel). The weights are packed to match: per kernel
//! row, its pairs ([`pack`]). Eight output pixels × one or two panels of 16 channels stay in
//! registers; the bias starts them, the activation and the narrowing to bf16 finish them
//! there. A window that crosses the image's edge is copied into a zero-padded buffer first.

use half::bf16;
use rayon::prelude::*;

use super::conv::{TilePtr, pairs_finished, work_items};
use super::depthwise::Lanes;
use super::*;
use crate::backend::cpu::bf16_gemm::{Engine, KSTEP, PANEL, PackedPairs};
use crate::backend::cpu::elem::Wide;
use crate::backend::cpu::sgemm::{NR, PackedB};
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
use crate::model::op::Conv2d;

/// Input channels below which an ungrouped BF16 convolution multiplying pairs runs here (at 8
/// and more, the pair GEMM's K steps are whole, and a 1×1 layer reads its input in place).
const NARROW: usize = 8;

/// Output pixels computed together: 8 pixels × 2 panels are 16 accumulators, as the pair
/// GEMM's groups.
const PIXELS: usize = 8;

/// Whether a convolution (already known to multiply bf16 pairs, [`super::uses_pairs`]) runs
/// here: ungrouped, undilated, fewer than [`NARROW`] input channels, and a kernel row of at
/// least one pair.
pub(super) fn is_stem(c: &Conv2d) -> bool {
    c.groups == 1
        && c.dilation == (1, 1)
        && c.in_channels < NARROW
        && c.kernel.1 * c.in_channels >= 2
}

/// A kernel row's run of input values (kw taps × cin channels) and its pairs.
fn run_and_pairs(c: &Conv2d) -> (usize, usize) {
    let run = c.kernel.1 * c.in_channels;
    (run, run.div_ceil(2))
}

/// The values a kernel row takes in K as [`pack`] lays it out: its pairs, or a whole K step
/// of AMX's where the stem reads its input in place ([`implicit`]).
fn row_width(c: &Conv2d) -> usize {
    if implicit(c) {
        KSTEP
    } else {
        2 * run_and_pairs(c).1
    }
}

/// The values at the start of a kernel row's run that [`pack`] keeps in place: all of them
/// where the stem reads its input in place, else the whole pairs (an odd run's last value goes
/// to the end of its pair).
fn straight(c: &Conv2d) -> usize {
    let run = run_and_pairs(c).0;
    if implicit(c) { run } else { run - run % 2 }
}

/// Whether a stem on AMX's tiles ([`on_tiles`]) reads A in place ([`implicit_tiles`]): where a
/// kernel row's run fits one K step.
fn implicit(c: &Conv2d) -> bool {
    on_tiles(c) && run_and_pairs(c).0 <= KSTEP
}

/// The weights as k-pairs per kernel row: `fill(j, col)` writes output channel j's column
/// with K ordered (ky, kx, ci), as for the pair GEMM; row ky's pairs follow, an odd run's last
/// pair being (0, its last weight) to meet the last two input values.
pub(super) fn pack(
    c: &Conv2d,
    fill: impl Fn(usize, &mut [f32]) + Sync,
    bias: Option<&[f32]>,
) -> PackedPairs {
    let (run, width, even) = (run_and_pairs(c).0, row_width(c), straight(c));
    let kh = c.kernel.0;
    // AMX's tiles multiply K in steps of 32 (zeros past the kernel's pairs); the `vdpbf16ps`
    // kernel reads a panel's pairs from its start, whatever follows.
    let step = if on_tiles(c) { KSTEP } else { 2 };
    PackedPairs::with_step(
        kh * width,
        c.out_channels,
        step,
        |j, col| {
            let mut w = vec![0f32; kh * run];
            fill(j, &mut w);
            col.fill(0.0);
            for (dst, src) in col.chunks_exact_mut(width).zip(w.chunks_exact(run)) {
                dst[..even].copy_from_slice(&src[..even]);
                if even < run {
                    dst[width - 1] = src[run - 1];
                }
            }
        },
        bias,
    )
}

/// Output channel j's weights as PyTorch orders them (K as (ky, kx, ci)) from `b`, packed by
/// [`pack`], into `out` (kh·kw·cin values): each kernel row's run, which [`pack`] spread over
/// its pairs (an odd run's last value at the end of its last pair).
pub(super) fn column(c: &Conv2d, b: &PackedPairs, j: usize, out: &mut [bf16]) {
    let (run, width, even) = (run_and_pairs(c).0, row_width(c), straight(c));
    let mut packed = vec![bf16::ZERO; c.kernel.0 * width];
    b.column(j, &mut packed);
    for (dst, src) in out.chunks_exact_mut(run).zip(packed.chunks_exact(width)) {
        dst[..even].copy_from_slice(&src[..even]);
        if even < run {
            dst[run - 1] = src[width - 1];
        }
    }
}

/// The convolution `x` (xs) → `y` (ys), both NHWC bf16, with `b` from [`pack`] (the bias in
/// it), `residual` (NHWC like `y`) added and the layer's activation applied, rows and panels
/// split over `threads` as the pair GEMM's are.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv2d_stem(
    c: &Conv2d,
    b: &PackedPairs,
    x: &[bf16],
    xs: Nhwc,
    y: &mut [bf16],
    ys: Nhwc,
    threads: usize,
    residual: Option<&[bf16]>,
) {
    let job = Job::new(c, b, (x, xs), (y, ys), residual);
    #[cfg(target_arch = "x86_64")]
    if on_tiles(c) {
        return tiles(&job, threads);
    }
    // SAFETY: pair packings exist only where `simd()` chose an engine, and both engines'
    // CPUs have AVX512_BF16 (`bf16_gemm::Engine::in_use`).
    unsafe { job.launch((b.kp(), b.panels()), threads, rows_avx512) };
}

thread_local! {
    /// Per-worker rows of A of [`tiles`], on a cache line (as `conv`'s columns).
    static TILE_ROWS: std::cell::RefCell<crate::backend::cpu::Lines<bf16>> =
        std::cell::RefCell::new(crate::backend::cpu::big_buffer(0));
}

/// The value of a kernel row that its k-pairs' place j takes in [`gather_row`]: value j,
/// except an odd run's last pair (places run − 1 and run), which takes values run − 2 and
/// run − 1, as [`pack`] pairs the weights (0 and the last weight: a run of one pairs the
/// zero weight with value 0).
#[cfg(target_arch = "x86_64")]
fn pair_source(run: usize, j: usize) -> usize {
    if run % 2 == 1 && j + 1 >= run {
        j.saturating_sub(1)
    } else {
        j
    }
}

/// [`pair_source`] for each of a register's 32 lanes, the permutation [`gather_row`] applies.
#[cfg(target_arch = "x86_64")]
fn pair_lanes(run: usize) -> [i16; 32] {
    std::array::from_fn(|j| pair_source(run, j).min(31) as i16)
}

/// One output pixel's row of A for [`tiles`]: per kernel row (kh of them, `line` apart from
/// `window`) its `run` values as k-pairs (lane j from value `lanes[j]`, [`pair_lanes`]), then
/// zeros to the row's end (K's step). A masked load, a permutation and a masked store a
/// kernel row (rows of more than 32 values, AlexNet's 11 × 3, value by value). Copied
/// through `copy_from_slice`, ResNet-50's stem made 14 calls to `memmove` of 2 to
/// 20 values a pixel, 1.4 million a batch of 8; this way the stem took 0.82× the time (2
/// Sapphire Rapids cores, batch 8, 40 steps alternating in one process).
///
/// # Safety
/// The CPU has AVX-512F and BW (every AMX CPU has); `window` has kh rows of `run` readable
/// values `line` apart; `row` holds at least kh · (`run` rounded up to even) values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn gather_row(
    (window, line): (*const bf16, usize),
    (kh, run, lanes): (usize, usize, &[i16; 32]),
    row: &mut [bf16],
) {
    use std::arch::x86_64::*;
    let width = run.div_ceil(2) * 2;
    let span = kh * width;
    assert!(span <= row.len(), "a stem row of {kh} × {run} values");
    if width > 32 {
        let (kernel, padding) = row.split_at_mut(span);
        padding.fill(half::bf16::ZERO);
        for (ky, dst) in kernel.chunks_exact_mut(width).enumerate() {
            // SAFETY: the window's row ky has `run` values (the contract).
            let src = unsafe { std::slice::from_raw_parts(window.add(ky * line), run) };
            for (j, v) in dst.iter_mut().enumerate() {
                *v = src[pair_source(run, j)];
            }
        }
        return;
    }
    let first = |n: usize| if n >= 32 { u32::MAX } else { (1u32 << n) - 1 };
    // SAFETY: the contract: each kernel row's load reads `run` values of the window, its
    // store `width` values of `row`, the zeros the rest of it.
    unsafe {
        let index = _mm512_loadu_si512(lanes.as_ptr().cast());
        let dst = row.as_mut_ptr().cast::<i16>();
        for ky in 0..kh {
            let src = window.add(ky * line).cast::<i16>();
            let v = _mm512_maskz_loadu_epi16(first(run), src);
            let v = _mm512_permutexvar_epi16(index, v);
            _mm512_mask_storeu_epi16(dst.add(ky * width), first(width), v);
        }
        let mut at = span;
        while at < row.len() {
            let n = (row.len() - at).min(32);
            _mm512_mask_storeu_epi16(dst.add(at), first(n), _mm512_setzero_si512());
            at += n;
        }
    }
}

/// Whether a stem (multiplying pairs) runs on AMX's tiles ([`tiles`]): where the CPU has them
/// and the kernel's pairs fill more than two of their K steps. On 2 Sapphire Rapids cores at
/// batch 8 (BF16, the layer's kernel time against the other convolutions' in the same runs,
/// 3–4 runs alternating), ResNet-50's 7×7 stem (154 values, 5 steps) took 0.59× the time of
/// the `vdpbf16ps` kernel here, EfficientNet-B0's and MobileNetV3-Large's 3×3 stems (30
/// values, one step) 1.5× and 2× as long: a block's fixed work (the tiles stored, its rows
/// finished from L1, the rows gathered) outweighs one step's products.
pub(super) fn on_tiles(c: &Conv2d) -> bool {
    Engine::in_use() == Some(Engine::Amx) && c.kernel.0 * 2 * run_and_pairs(c).1 > 2 * KSTEP
}

/// A stem on AMX's tiles: each work item's output pixels gathered as rows of the pair GEMM's
/// A — per kernel row the pairs [`kernel_row`] broadcasts (the window's run, an odd run's
/// last pair repeating its next-to-last value), zeros to K's step — then multiplied by the
/// tiles and finished from L1 like any AMX convolution's blocks ([`on_tiles`] says where).
/// ResNet-50's 7×7 stem at batch 8 on 2 Sapphire Rapids cores: 9.4–10.6 ms a call against
/// 15.6–20.7 on the `vdpbf16ps` kernel. Now only for kernel rows longer than a K step
/// (AlexNet's 11 × 3): shorter ones are read in place ([`implicit_tiles`]).
#[cfg(target_arch = "x86_64")]
fn tiles(job: &Job<'_, bf16, PackedPairs>, threads: usize) {
    if implicit(job.c) {
        return implicit_tiles(job, threads);
    }
    let (c, b) = (job.c, job.b);
    let (run, _) = run_and_pairs(c);
    let lanes = pair_lanes(run);
    let (kp, cout) = (b.kp(), c.out_channels);
    let m = job.ys.n * job.ys.h * job.ys.w;
    let units = (chunk_rows(m, kp), Engine::Amx.row_unit());
    work_items(m, units, b.panels(), threads, true).for_each(|((m0, mr), (p0, p1))| {
        TILE_ROWS.with_borrow_mut(|a| {
            // Every row is gathered below, its K padding written with it.
            a.reuse(mr * kp);
            let gather =
                |windows: &[(*const bf16, usize); PIXELS], _, _, firsts: &[usize; PIXELS]| {
                    for (&(window, line), &first) in windows.iter().zip(firsts) {
                        let row = &mut a[(first / cout - m0) * kp..][..kp];
                        // SAFETY: every window has kh rows of `run` readable values, `line`
                        // apart (`rows`); the CPU has AMX, so AVX-512BW (`gather_row`).
                        unsafe { gather_row((window, line), (c.kernel.0, run, &lanes), row) };
                    }
                };
            // SAFETY: one panel asked for, so `gather` runs once per group of pixels, each
            // window read as `rows` promises; the rows written are this item's.
            unsafe { rows(job, m0, mr, (p0, p0 + 1), gather) };
            let ends = (job.out, job.residual.map(<[bf16]>::as_ptr));
            // SAFETY: the engine in use is AMX; A has mr rows of kp values, zeros past K (B is
            // packed to AMX's step, `pack`); the item's rows and panels' columns are its own.
            unsafe { pairs_finished(Engine::Amx, (a, kp), b, (m0, mr), (p0, p1), ends, c.act) };
        });
    });
}

thread_local! {
    /// The input of [`implicit_tiles`], zero-padded (on the calling thread).
    static PADDED: std::cell::RefCell<crate::backend::cpu::Lines<bf16>> =
        std::cell::RefCell::new(crate::backend::cpu::big_buffer(0));
}

/// A stem on AMX's tiles with nothing gathered: in NHWC a kernel row's run over a pixel's
/// window is kw·cin contiguous values, so the tile loads read A from the input itself, one
/// K step per kernel row ([`row_width`]), the 16 rows of a tile (pixels along an output row)
/// `stride · cin` values apart, the values past the run meeting zero weights. The input is
/// first copied zero-padded, wide enough that the last block's reads stay in their row. (The
/// values past a run are the next pixels': an infinity among them, times its zero weight,
/// makes a NaN one pixel beyond the window, where the gathered rows had zeros.)
/// Blocks are 32 pixels of one output row by two panels. The tile rows start 12 bytes apart
/// for ResNet-50's stem, most of them across two lines (which cost the 2 × 2 blocks of the
/// GEMMs up to half their rate), yet with no row gathered the stem took 0.49–0.65× the time
/// of [`tiles`]' (ResNet-50 BF16 at batch 8 on 2 Sapphire Rapids cores, 40 steps alternating
/// in one process, two runs): 3.2–3.6 ms a call, against OpenVINO's 5.9–7.7 in its counters.
/// At batch 1 (100 steps) 0.86×, at batch 32 (16 steps, two runs) 0.89× — there the batch
/// tiles run it as four calls of 8 images (7–8 ms each), so why it gains less than the one
/// call at batch 8 is not yet understood.
#[cfg(target_arch = "x86_64")]
fn implicit_tiles(job: &Job<'_, bf16, PackedPairs>, threads: usize) {
    use crate::backend::cpu::amx;
    use crate::backend::cpu::bf16_gemm::{BLOCK_COLS, BLOCK_ROWS, CBlock, Done, Finished};
    let (c, b, xs, ys) = (job.c, job.b, job.xs, job.ys);
    if ys.n * ys.h * ys.w == 0 {
        return;
    }
    let ((sy, sx), (py, px), cin) = (c.stride, c.padding, xs.c);
    // Rows and pixels the windows reach: the last block's last tile row reads 32 values from
    // its window's start.
    let hp = ((ys.h - 1) * sy + c.kernel.0).max(py + xs.h);
    let reach = (ys.w.next_multiple_of(BLOCK_ROWS) - 1) * sx * cin + KSTEP;
    let wp = reach.div_ceil(cin).max(px + xs.w);
    let image = hp * wp * cin;
    PADDED.with_borrow_mut(|padded| {
        padded.reuse(xs.n * image);
        let rows = xs.w * cin;
        padded[..xs.n * image]
            .par_chunks_mut(image)
            .zip(job.x.par_chunks(xs.h * rows))
            .for_each(|(dst, src)| {
                dst.fill(bf16::ZERO);
                for (y, row) in src.chunks_exact(rows).enumerate() {
                    dst[((py + y) * wp + px) * cin..][..rows].copy_from_slice(row);
                }
            });
        let padded = &padded[..xs.n * image];
        let out_rows = ys.n * ys.h;
        let chunk = out_rows.div_ceil(4 * threads.max(1));
        let panels = b.panels();
        (0..out_rows.div_ceil(chunk))
            .into_par_iter()
            .for_each(|item| {
                let CBlock(values) = &mut CBlock::default();
                let finished = Finished {
                    out: job.out.0,
                    residual: job.residual.map(|r| r.as_ptr()),
                    ld: c.out_channels,
                    act: c.act,
                };
                // SAFETY: a pair packing on tiles exists only where the CPU runs AMX (`on_tiles`).
                unsafe { amx::configure() };
                for r in item * chunk..((item + 1) * chunk).min(out_rows) {
                    let (n, oy) = (r / ys.h, r % ys.h);
                    for x0 in (0..ys.w).step_by(BLOCK_ROWS) {
                        let a = &padded[((n * hp + oy * sy) * wp + x0 * sx) * cin..];
                        for p in (0..panels).step_by(2) {
                            let pair = p + 1 < panels;
                            let cols = (if pair { 2 } else { 1 } * PANEL).min(b.n - p * PANEL);
                            // SAFETY: the tiles are configured above; the block's 32 pixels read
                            // kh rows of the padded input `wp · cin` apart, 32 values from each
                            // window's start, inside their row (`wp`); `values` holds 32 rows of
                            // BLOCK_COLS floats. The finished rows are output row r's pixels
                            // x0.., this work item's alone, inside the output (`Job::new`), as
                            // the residual's.
                            unsafe {
                                let c = values.as_mut_ptr();
                                let lda = (sx * cin, wp * cin);
                                let panels = amx::Panels::cached(p, pair);
                                amx::block(a.as_ptr(), lda, b, panels, c, BLOCK_COLS);
                                let rows = BLOCK_ROWS.min(ys.w - x0);
                                let row = r * ys.w + x0;
                                let col = p * PANEL;
                                Done {
                                    row,
                                    rows,
                                    col,
                                    cols,
                                    values,
                                    bias: Some(&b.bias_from(p)[..cols]),
                                }
                                .finish(finished);
                            }
                        }
                    }
                }
                // SAFETY: as above.
                unsafe { amx::release() };
            });
    });
}

/// Whether an FP32 convolution runs on [`conv2d_stem_f32`]: a stem, where the SIMD path in
/// use is AVX-512's. (A BF16 one too, where it does not multiply pairs and has no residual:
/// see [`Wide`].)
pub(super) fn runs_f32(c: &Conv2d) -> bool {
    use crate::backend::cpu::simd::{Simd, simd};
    is_stem(c) && matches!(simd(), Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx)
}

/// The convolution `x` (xs) → `y` (ys), both NHWC, f32 or bf16 ([`Wide`]), of a stem that
/// [`runs_f32`] says runs here, with `b` its GEMM packing in f32 (K ordered (ky, kx, ci), the
/// bias in it; a BF16 layer's weights rounded to bf16), `residual` (NHWC like `y`) added and
/// the layer's activation applied, in f32. The same design as the pairs' kernel, one value at
/// a time instead of pairs: through im2col and the GEMM, MobileNetV3-Large's stem (3 → 16,
/// 3×3, stride 2) gathered 27 values a pixel for 27 multiply-adds per output channel. Here,
/// at batch 8 (Zen 4): that stem 1.08–1.24 → 0.84–0.86 ms in the network; alone, it 1.06 →
/// 0.79 ms, EfficientNet-B0's (3 → 32, SiLU) 2.10 → 1.56, ResNet-50's 7×7 11.2 → 10.6. The
/// sums are the GEMM's, in its order. BF16 layers where the CPU widens bf16 for the FP32
/// FMAs instead of multiplying pairs ran through im2col too, at 2.0 ms for MobileNetV3-Large's
/// stem at batch 8 on a Xeon whose FP32 kernel took 0.84.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv2d_stem_f32<E: Lanes + Wide>(
    c: &Conv2d,
    b: &PackedB<f32>,
    x: &[E],
    xs: Nhwc,
    y: &mut [E],
    ys: Nhwc,
    threads: usize,
    residual: Option<&[E]>,
) {
    assert!(
        runs_f32(c) && b.k == c.taps(),
        "stem: not a layer the FP32 stem kernel runs, or not its packing"
    );
    let job = Job::new(c, b, (x, xs), (y, ys), residual);
    // SAFETY: `runs_f32` (asserted): `simd()` chose AVX-512 only where the CPU has AVX-512F.
    unsafe { job.launch((c.taps(), b.panels()), threads, rows_f32::<E>) };
}

/// [`conv2d_stem_f32`]'s output rows [m0, m0 + mr), panels [p0, p1).
///
/// # Safety
/// The CPU has AVX-512F; nobody else writes those rows' panels meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn rows_f32<E: Lanes + Wide>(
    job: &Job<'_, E, PackedB<f32>>,
    m0: usize,
    mr: usize,
    panels: (usize, usize),
) {
    let pixels = |windows: &_, q, two, firsts: &_| {
        let (c, b, ends) = (job.c, job.b, (job.out, job.residual));
        // SAFETY: as `rows` promises (windows, panels, outputs); the CPU's, the caller's.
        unsafe {
            if two {
                pixels_f32::<E, 2>(c, b, windows, q, ends, firsts);
            } else {
                pixels_f32::<E, 1>(c, b, windows, q, ends, firsts);
            }
        }
    };
    // SAFETY: the caller's.
    unsafe { rows(job, m0, mr, panels, pixels) }
}

/// Never called: [`conv2d_stem_f32`] runs where the SIMD path is AVX-512's.
///
/// # Safety
/// None needed.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn rows_f32<E: Lanes + Wide>(
    _: &Job<'_, E, PackedB<f32>>,
    _: usize,
    _: usize,
    _: (usize, usize),
) {
    unreachable!("the FP32 stem kernel runs on AVX-512 only")
}

/// [`PIXELS`] output pixels × panels q..q + Q in f32: the bias, every kernel row's values
/// broadcast from each window and multiplied by the panel's rows (the GEMM's order), the
/// residual and the activation in registers ([`activate_zmm`]), a masked store.
///
/// # Safety
/// As in [`rows`]; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pixels_f32<E: Lanes + Wide, const Q: usize>(
    c: &Conv2d,
    b: &PackedB<f32>,
    windows: &[(*const E, usize); PIXELS],
    q: usize,
    (out, residual): (TilePtr<E>, Option<&[E]>),
    firsts: &[usize; PIXELS],
) {
    use std::arch::x86_64::*;
    let run = c.kernel.1 * c.in_channels;
    let panels: [(&[f32], &[f32]); Q] = std::array::from_fn(|i| b.panel(q + i));
    // SAFETY: the caller's contract (unaligned and masked loads and stores throughout).
    unsafe {
        let mut acc: [[__m512; Q]; PIXELS] =
            [std::array::from_fn(|i| _mm512_loadu_ps(panels[i].1.as_ptr())); PIXELS];
        for ky in 0..c.kernel.0 {
            let lines: [*const E; PIXELS] =
                std::array::from_fn(|p| windows[p].0.add(ky * windows[p].1));
            let w = panels.map(|(p, _)| p[ky * run * NR..].as_ptr());
            kernel_row_f32(&mut acc, &lines, &w, run);
        }
        for (acc, &first) in acc.iter().zip(firsts) {
            for (i, v) in acc.iter().enumerate() {
                let col = (q + i) * NR;
                let cols = NR.min(c.out_channels - col);
                let mask = (u32::MAX >> (32 - cols)) as __mmask16;
                let v = match residual {
                    Some(r) => _mm512_add_ps(*v, E::load(r[first + col..].as_ptr(), mask)),
                    None => *v,
                };
                E::store(out.add(first + col), mask, activate_zmm(c.act, v));
            }
        }
    }
}

/// One kernel row's `run` values into the accumulators, each broadcast from every pixel's
/// line and multiplied by the panels' rows `w` (as [`kernel_row`], on a local copy).
///
/// # Safety
/// The CPU has AVX-512F; each line has `run` readable values, each `w[i]` `run` rows of
/// [`NR`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn kernel_row_f32<E: Lanes + Wide, const Q: usize>(
    acc: &mut [[std::arch::x86_64::__m512; Q]; PIXELS],
    lines: &[*const E; PIXELS],
    w: &[*const f32; Q],
    run: usize,
) {
    use std::arch::x86_64::*;
    let mut a = *acc;
    // bf16 lines widened first, a vector a line (their runs are short: 21 values for a 7×7
    // stem over 3 channels), so that each tap is broadcast from f32s in L1 as the FMAs take
    // it. Widened one value per tap instead (a load, a shift and a broadcast from a general
    // register, on the shuffle port the second FMA shares), ResNet-50's 7×7 stem took 1.4×
    // FP32's time on an Emerald Rapids Xeon; widened first, 0.88× the old time (6 of 6 rounds,
    // `bench/ab.py --kernel-total`). Not for short runs: the 3×3 stems' 9 values took 1.14×
    // the old time in EfficientNet-B0 (into 32 channels, two panels a tap) and 1.22× in
    // MobileNetV3-Large (16 channels, one panel), 6 of 6 rounds each.
    if size_of::<E>() == 2 && (16..=32).contains(&run) {
        let mut wide = [[0f32; 32]; PIXELS];
        // SAFETY: the caller's contract: `run` readable values a line (the masked load reads
        // no others); the stores are into `wide`.
        unsafe {
            for (line, wide) in lines.iter().zip(&mut wide) {
                let mask = (u64::MAX >> (64 - run)) as __mmask32;
                let v = _mm512_maskz_loadu_epi16(mask, line.cast::<i16>());
                let halves = [_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v)];
                for (h, half) in halves.into_iter().enumerate() {
                    let f = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half));
                    _mm512_storeu_ps(wide.as_mut_ptr().add(16 * h), _mm512_castsi512_ps(f));
                }
            }
            for t in 0..run {
                let wv: [_; Q] = std::array::from_fn(|i| _mm512_loadu_ps(w[i].add(t * NR)));
                for (line, acc) in wide.iter().zip(a.iter_mut()) {
                    let x = _mm512_set1_ps(line[t]);
                    for (v, wv) in acc.iter_mut().zip(&wv) {
                        *v = _mm512_fmadd_ps(x, *wv, *v);
                    }
                }
            }
        }
        *acc = a;
        return;
    }
    // SAFETY: the caller's contract (unaligned loads).
    unsafe {
        for t in 0..run {
            let wv: [_; Q] = std::array::from_fn(|i| _mm512_loadu_ps(w[i].add(t * NR)));
            for (line, acc) in lines.iter().zip(a.iter_mut()) {
                let x = _mm512_set1_ps(line.add(t).read().wide());
                for (v, wv) in acc.iter_mut().zip(&wv) {
                    *v = _mm512_fmadd_ps(x, *wv, *v);
                }
            }
        }
    }
    *acc = a;
}

/// What every work item of one call shares: activations of type `E`, weights packed as `B`.
struct Job<'a, E, B> {
    c: &'a Conv2d,
    b: &'a B,
    x: &'a [E],
    xs: Nhwc,
    ys: Nhwc,
    out: TilePtr<E>,
    residual: Option<&'a [E]>,
}

impl<'a, E: Sync, B: Sync> Job<'a, E, B> {
    /// The call's shared part, its tensors' lengths checked against the layer.
    fn new(
        c: &'a Conv2d,
        b: &'a B,
        (x, xs): (&'a [E], Nhwc),
        (y, ys): (&'a mut [E], Nhwc),
        residual: Option<&'a [E]>,
    ) -> Self {
        let outputs = ys.n * ys.h * ys.w * c.out_channels;
        assert!(
            x.len() >= xs.elems() && xs.c == c.in_channels,
            "stem input buffer too small"
        );
        assert!(y.len() >= outputs, "stem output buffer too small");
        assert!(
            residual.is_none_or(|r| r.len() >= outputs),
            "stem residual too small"
        );
        let out = TilePtr(y.as_mut_ptr());
        Job {
            c,
            b,
            x,
            xs,
            ys,
            out,
            residual,
        }
    }

    /// The output rows and `panels` split over `threads` as the GEMMs split theirs (chunks
    /// sized for columns of `k`), each work item through `rows`.
    ///
    /// # Safety
    /// The CPU runs `rows` (its `#[target_feature]`s).
    unsafe fn launch(
        &self,
        (k, panels): (usize, usize),
        threads: usize,
        rows: unsafe fn(&Self, usize, usize, (usize, usize)),
    ) {
        let m = self.ys.n * self.ys.h * self.ys.w;
        let units = (chunk_rows(m, k), crate::backend::cpu::sgemm::tile_rows());
        work_items(m, units, panels, threads, false).for_each(|((m0, mr), panels)| {
            // SAFETY: the CPU's, the caller's; this work item's rows and panels of the
            // output are its own (`work_items`).
            unsafe { rows(self, m0, mr, panels) };
        });
    }
}

/// Output rows [m0, m0 + mr), panels [p0, p1).
///
/// # Safety
/// The CPU has AVX-512F and AVX512_BF16; nobody else writes those rows' panels meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl")]
unsafe fn rows_avx512(
    job: &Job<'_, bf16, PackedPairs>,
    m0: usize,
    mr: usize,
    panels: (usize, usize),
) {
    let pixels = |windows: &_, q, two, firsts: &_| {
        let (c, b, ends) = (job.c, job.b, (job.out, job.residual));
        // SAFETY: as `rows` promises (windows, panels, outputs); the CPU's, the caller's.
        unsafe {
            if two {
                pixels::<2>(c, b, windows, q, ends, firsts);
            } else {
                pixels::<1>(c, b, windows, q, ends, firsts);
            }
        }
    };
    // SAFETY: the caller's.
    unsafe { rows(job, m0, mr, panels, pixels) }
}

/// Never called: pairs are multiplied on x86-64 only.
///
/// # Safety
/// None needed.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn rows_avx512(_: &Job<'_, bf16, PackedPairs>, _: usize, _: usize, _: (usize, usize)) {
    unreachable!("bf16 pairs are multiplied on x86-64 only")
}

/// Output rows [m0, m0 + mr), panels [p0, p1), for either type: groups of [`PIXELS`] output
/// pixels (the last group of a range repeating its last pixel), each pixel's window read in
/// place or, where it crosses the image's edge, from a zero-padded copy, handed to
/// `pixels(windows, q, two, firsts)` for panel q (and q + 1 when `two`): every window has kh
/// rows of kw·cin readable values spaced as given, each pixel's output row starts at
/// `firsts[p]`, and those rows' columns of panels p0..p1 are this call's alone.
///
/// # Safety
/// As for [`rows_avx512`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows<E: Copy + Default, B>(
    job: &Job<'_, E, B>,
    m0: usize,
    mr: usize,
    (p0, p1): (usize, usize),
    mut pixels: impl FnMut(&[(*const E, usize); PIXELS], usize, bool, &[usize; PIXELS]),
) {
    let Job { c, x, xs, ys, .. } = *job;
    let (kh, kw) = c.kernel;
    let (run, _) = run_and_pairs(c);
    let (sy, sx) = c.stride;
    let (py, px) = (c.padding.0 as isize, c.padding.1 as isize);
    let line = xs.w * xs.c;
    let mut copies = vec![E::default(); PIXELS * kh * run];
    let (mut m, end) = (m0, m0 + mr);
    while m < end {
        // A segment of one output row: its kernel rows' place in the image found once.
        let ox0 = m % ys.w;
        let oy = (m / ys.w) % ys.h;
        let n = m / (ys.w * ys.h);
        let seg = (ys.w - ox0).min(end - m);
        let image = &x[n * xs.h * line..(n + 1) * xs.h * line];
        let top = (oy * sy) as isize - py;
        let rows_inside = top >= 0 && top as usize + kh <= xs.h;
        for g in (0..seg).step_by(PIXELS) {
            let mut windows = [(std::ptr::null::<E>(), 0usize); PIXELS];
            let mut firsts = [0usize; PIXELS];
            let pixels_copies = windows
                .iter_mut()
                .zip(&mut firsts)
                .zip(copies.chunks_exact_mut(kh * run));
            for (p, ((window, first), copy)) in pixels_copies.enumerate() {
                let o = (g + p).min(seg - 1);
                *first = (m + o) * c.out_channels;
                let left = ((ox0 + o) * sx) as isize - px;
                *window = if rows_inside && left >= 0 && left as usize + kw <= xs.w {
                    (
                        image[top as usize * line + left as usize * xs.c..].as_ptr(),
                        line,
                    )
                } else {
                    edge_window(image, xs, run, (top, left), copy);
                    (copy.as_ptr(), run)
                };
            }
            let mut q = p0;
            while q < p1 {
                let two = q + 1 < p1;
                pixels(&windows, q, two, &firsts);
                q += if two { 2 } else { 1 };
            }
        }
        m += seg;
    }
}

/// The window of kernel rows `run` values long (kw taps × cin) whose top-left tap is at
/// (`top`, `left`) of `image` (NHWC, one image of `xs`), copied into `copy`, zeros where it
/// leaves the image.
fn edge_window<E: Copy + Default>(
    image: &[E],
    xs: Nhwc,
    run: usize,
    (top, left): (isize, isize),
    copy: &mut [E],
) {
    let line = xs.w * xs.c;
    for (ky, dst) in copy.chunks_exact_mut(run).enumerate() {
        let iy = top + ky as isize;
        for (kx, tap) in dst.chunks_exact_mut(xs.c).enumerate() {
            let ix = left + kx as isize;
            if iy >= 0 && (iy as usize) < xs.h && ix >= 0 && (ix as usize) < xs.w {
                let from = iy as usize * line + ix as usize * xs.c;
                tap.copy_from_slice(&image[from..from + xs.c]);
            } else {
                tap.fill(E::default());
            }
        }
    }
}

/// [`PIXELS`] output pixels × panels q..q + Q: the bias, every kernel row's pairs broadcast
/// from each window, the residual, the activation, the narrowing, the store (a partial last
/// panel's valid columns only).
///
/// # Safety
/// As in [`rows`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pixels<const Q: usize>(
    c: &Conv2d,
    b: &PackedPairs,
    windows: &[(*const bf16, usize); PIXELS],
    q: usize,
    (out, residual): (TilePtr<bf16>, Option<&[bf16]>),
    firsts: &[usize; PIXELS],
) {
    use crate::backend::cpu::bf16_gemm::store_finished;
    use std::arch::x86_64::{__m512, _mm512_loadu_ps};
    let (run, pairs) = run_and_pairs(c);
    let panels: [*const bf16; Q] = std::array::from_fn(|i| b.panel(q + i).as_ptr());
    // SAFETY: the caller's contract (unaligned loads and stores throughout).
    unsafe {
        let mut acc: [[__m512; Q]; PIXELS] =
            [std::array::from_fn(|i| _mm512_loadu_ps(b.bias(q + i).as_ptr())); PIXELS];
        for ky in 0..c.kernel.0 {
            let lines: [*const bf16; PIXELS] =
                std::array::from_fn(|p| windows[p].0.add(ky * windows[p].1));
            let w = panels.map(|p| p.add(ky * pairs * 2 * PANEL));
            kernel_row(&mut acc, &lines, &w, pairs, run);
        }
        // Finished in registers ([`store_finished`]): the residual, the activation, the
        // narrowing, a store of the valid columns. Through an f32 block and `activate` over
        // it (whose long chains, SiLU's, had been slow one vector at a time before
        // `activate_zmm`), MobileNetV3-Large's hardswish stem and EfficientNet-B0's SiLU one
        // took 8% and 11% longer (batch 8, layer alone, 300 steps alternating in one process).
        for (acc, &first) in acc.iter().zip(firsts) {
            for (i, v) in acc.iter().enumerate() {
                let col = (q + i) * PANEL;
                let cols = PANEL.min(c.out_channels - col);
                let mask = (u32::MAX >> (32 - cols)) as u16;
                let res = residual.map(|r| r[first + col..].as_ptr());
                store_finished(*v, res, c.act, out.add(first + col), mask);
            }
        }
    }
}

/// One kernel row's pairs into the accumulators: each pair of the row broadcast from every
/// pixel's line, multiplied by the panels' k-pair rows `w`, on a local copy of the
/// accumulators. Written inside the loop over kernel rows, the compiler copied 14 of the 16
/// accumulators between registers on every pair (a `vmovaps` per `vdpbf16ps`): ResNet-50's
/// 7×7 stem ran 12% slower, EfficientNet-B0's 4% (BF16, batch 2, 8 of 10 rounds each).
///
/// # Safety
/// The CPU has AVX-512F and AVX512_BF16; each line has `run` readable values, each `w[i]`
/// `pairs` k-pair rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel_row<const Q: usize>(
    acc: &mut [[std::arch::x86_64::__m512; Q]; PIXELS],
    lines: &[*const bf16; PIXELS],
    w: &[*const bf16; Q],
    pairs: usize,
    run: usize,
) {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_si512, _mm512_set1_epi32,
    };
    let mut a = *acc;
    // SAFETY: the caller's contract (unaligned loads).
    unsafe {
        for j in 0..pairs {
            let wv: [__m512bh; Q] = std::array::from_fn(|i| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    w[i].add(j * 2 * PANEL).cast(),
                ))
            });
            let off = (2 * j).min(run - 2);
            for (line, acc) in lines.iter().zip(a.iter_mut()) {
                let pair = line.add(off).cast::<i32>().read_unaligned();
                let x = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                for (v, wv) in acc.iter_mut().zip(&wv) {
                    // The broadcast last, in the load ({1to16}; see the pair GEMM's `group`):
                    // MobileNetV3-Large's stem (one panel) alone 0.87–0.91× the time.
                    *v = _mm512_dpbf16_ps(*v, *wv, x);
                }
            }
        }
    }
    *acc = a;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::bf16_gemm::Engine;
    use crate::model::op::Act;

    /// Stems of odd and even runs (3×3 and 7×7 over 3 channels, 1×1 and 5×5 over 2, 3×3 over
    /// 1), strides 1 and 2, padding 0 to 3, output channels within one panel, one pair and a
    /// partial third panel, activations, images smaller than a window's reach: every output
    /// against a plain loop in f32 over the same bf16 values: the pairs' kernel within the
    /// bf16 rounding of the result, the FP32 kernel within f32 rounding (its sums are fused
    /// multiply-adds, the loop's are not). Where the CPU runs neither it says so and checks
    /// nothing.
    #[test]
    fn stems_match_a_plain_loop() {
        use crate::backend::cpu::simd::{Simd, simd};
        let pairs = Engine::in_use().is_some();
        let f32_kernel = matches!(simd(), Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx);
        if !pairs {
            eprintln!("no AVX512_BF16 or AMX here: the pairs' stem kernel is not exercised");
        }
        if !f32_kernel {
            eprintln!("no AVX-512 here: the FP32 stem kernel is not exercised");
        }
        let cases = [
            // (cin, cout, kernel, stride, padding, h, w, act)
            (3, 16, 3, 2, 1, 15, 12, Act::Hardswish),
            (3, 64, 7, 2, 3, 17, 19, Act::Relu),
            (3, 24, 11, 4, 2, 23, 21, Act::Relu),
            // Read in place on AMX (a run of 15, five K steps), stride 1, two blocks a row.
            (3, 40, 5, 1, 2, 6, 37, Act::Relu),
            (2, 40, 1, 1, 0, 5, 6, Act::None),
            (2, 24, 5, 1, 2, 6, 4, Act::Relu6),
            (1, 16, 3, 1, 1, 9, 9, Act::None),
            (3, 33, 3, 1, 0, 4, 5, Act::Silu),
        ];
        for (cin, cout, k, st, pad, h, w, act) in cases {
            let mut c = Conv2d::new(cin, cout, k, st, pad);
            c.act = act;
            assert!(is_stem(&c), "case {c:?}");
            let xs = Nhwc { n: 3, h, w, c: cin };
            let (oh, ow) = ((h + 2 * pad - k) / st + 1, (w + 2 * pad - k) / st + 1);
            let ys = Nhwc {
                n: 3,
                h: oh,
                w: ow,
                c: cout,
            };
            let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
            let x: Vec<bf16> = (0..xs.elems()).map(|i| bf16::from_f32(value(i))).collect();
            // PyTorch's (cout, cin, kh, kw), bf16 values; the column of channel j (ky, kx, ci).
            let wt: Vec<f32> = (0..cout * cin * k * k)
                .map(|i| bf16::from_f32(value(i * 7 + 3)).to_f32())
                .collect();
            let bias: Vec<f32> = (0..cout).map(|j| j as f32 / 8.0 - 1.0).collect();
            let weight =
                |j: usize, ky: usize, kx: usize, ci: usize| wt[((j * cin + ci) * k + ky) * k + kx];
            let fill = |j: usize, col: &mut [f32]| {
                for (t, v) in col.iter_mut().enumerate() {
                    *v = weight(j, t / (k * cin), t / cin % k, t % cin);
                }
            };
            let residual: Vec<bf16> = (0..ys.elems())
                .map(|i| bf16::from_f32(value(i + 5)))
                .collect();
            let residual = (act == Act::Relu).then_some(&residual[..]);
            // (outputs, relative tolerance, what ran)
            let mut runs: Vec<(Vec<f32>, f32, &str)> = Vec::new();
            if pairs {
                let b = pack(&c, fill, Some(&bias));
                let mut y = vec![bf16::NAN; ys.elems()];
                conv2d_stem(&c, &b, &x, xs, &mut y, ys, 2, residual);
                runs.push((y.iter().map(|v| v.to_f32()).collect(), 1.0 / 128.0, "pairs"));
            }
            if f32_kernel {
                let b = PackedB::<f32>::from_columns(c.taps(), cout, fill, Some(&bias));
                let wide = |v: &[bf16]| v.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
                let (xf, rf) = (wide(&x), residual.map(wide));
                let mut y = vec![f32::NAN; ys.elems()];
                assert!(runs_f32(&c), "case {c:?}");
                conv2d_stem_f32(&c, &b, &xf, xs, &mut y, ys, 2, rf.as_deref());
                // The same kernel reading and writing bf16 (BF16 where pairs do not pay): the
                // f32 results rounded to bf16, bit for bit.
                let mut yb = vec![bf16::NAN; ys.elems()];
                conv2d_stem_f32(&c, &b, &x, xs, &mut yb, ys, 2, residual);
                for (i, (got, f)) in yb.iter().zip(&y).enumerate() {
                    let want = crate::backend::cpu::elem::f32_bf16(*f);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{c:?}: value {i}: {got} against {f}"
                    );
                }
                runs.push((y, 1e-5, "f32"));
                runs.push((
                    yb.iter().map(|v| v.to_f32()).collect(),
                    1.0 / 128.0,
                    "bf16 on f32",
                ));
            }
            let act_f = |v: f32| match act {
                Act::None => v,
                Act::Relu => v.max(0.0),
                Act::Relu6 => v.clamp(0.0, 6.0),
                Act::Hardswish => v * (v + 3.0).clamp(0.0, 6.0) / 6.0,
                Act::Silu => v / (1.0 + (-v).exp()),
                _ => unreachable!(),
            };
            for (i, (j, px)) in (0..ys.elems()).map(|i| (i, (i % cout, i / cout))) {
                let (ox, oy, n) = (px % ow, px / ow % oh, px / (ow * oh));
                let mut want = bias[j];
                for ky in 0..k {
                    for kx in 0..k {
                        let (iy, ix) = (
                            (oy * st + ky) as isize - pad as isize,
                            (ox * st + kx) as isize - pad as isize,
                        );
                        if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= w {
                            continue;
                        }
                        for ci in 0..cin {
                            let xv =
                                x[((n * h + iy as usize) * w + ix as usize) * cin + ci].to_f32();
                            want += xv * weight(j, ky, kx, ci);
                        }
                    }
                }
                let want = act_f(want + residual.map_or(0.0, |r| r[i].to_f32()));
                for (y, tolerance, what) in &runs {
                    let got = y[i];
                    assert!(
                        (got - want).abs() <= want.abs() * tolerance + 1e-4,
                        "{what}: {c:?} at pixel {px} channel {j}: {got} against {want}"
                    );
                }
            }
        }
    }
}

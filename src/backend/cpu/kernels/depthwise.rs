//! Depthwise convolutions: direct loops over rows of pixels, a block of channels and a few
//! output pixels at a time in registers (a GEMM with one input channel per group would waste
//! the machine). BF16 layers of 3×3, 5×5 and 7×7 taps multiply two tap rows per instruction where
//! the CPU has AVX512_BF16 ([`pairs`]).

use half::bf16;
use rayon::prelude::*;

use super::*;
use crate::backend::cpu::bf16_gemm;
use crate::backend::cpu::elem::{Elem, Wide, bf16_f32, f32_bf16};
use crate::backend::cpu::simd::{Vectorised, with_simd};
use crate::backend::cpu::{Lines, big_buffer};
use crate::model::op::{Act, Conv2d};

/// Depthwise convolution (one filter per channel) with its epilogue, one output row per work
/// item ([`DepthwiseRow`]), then the epilogue on the finished row ([`Finish`]). f32 and bf16
/// activations are read where they are; f16 goes through widened input rows. With `sums`
/// (n·h rows of c floats), each output row's sums per channel ([`row_sums`]) are written
/// there as the row is finished, for a global average pool that reads the output next
/// ([`mean_of_row_sums`]); returns whether they were (f32 and bf16 on the FMA kernels).
#[allow(clippy::too_many_arguments)]
pub(super) fn depthwise<T: Elem>(
    c: &Conv2d,
    (dw, pairs): (&[f32], Option<&Pairs>),
    bias: Option<&[f32]>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    epilogue: &Epilogue<'_, T>,
    sums: Option<&mut [f32]>,
) -> bool {
    let bias = bias_or_zeros(bias, ys.c);
    let bias = &bias[..];
    let y = &mut y[..ys.elems()];
    let residual = epilogue.residual;
    let act = epilogue.act;
    let made = sums.is_some();
    let sums = sums.map(|s| {
        assert!(
            s.len() >= ys.n * ys.h * ys.c,
            "depthwise: row sums too short"
        );
        TilePtr(s.as_mut_ptr())
    });
    if let (Some(x), Some(y)) = (T::as_f32(x), T::as_f32_mut(y)) {
        let residual = residual.map(|r| T::as_f32(r).expect("f32 like the output"));
        direct(c, dw, bias, x, xs, y, ys, residual, act, sums);
        return made;
    }
    if let (Some(x), Some(y)) = (T::as_bf16(x), T::as_bf16_mut(y)) {
        let residual = residual.map(|r| T::as_bf16(r).expect("bf16 like the output"));
        if let Some(p) = pairs {
            p.run(c, bias, x, xs, y, ys, residual, act);
            return false;
        }
        direct(c, dw, bias, x, xs, y, ys, residual, act, sums);
        return made;
    }
    widened(c, dw, bias, x, xs, y, ys, epilogue);
    false
}

/// Whether depthwise layers in storage `T` make their rows' sums when asked (f32 and bf16,
/// the storage `row_sums` reads; f16 does not).
pub fn makes_row_sums<T: Elem>() -> bool {
    T::IS_F32 || T::as_bf16(&[T::default()]).is_some()
}

/// Row `row`'s `ch` sums in `sums` (see [`depthwise`]), from the finished output row `out`.
///
/// # Safety
/// `sums` has n·h rows of `ch` floats; this worker alone writes row `row`.
unsafe fn put_row_sums<S: Lanes>(sums: TilePtr<f32>, row: usize, ch: usize, out: &[S]) {
    // SAFETY: the caller's.
    let dst = unsafe { std::slice::from_raw_parts_mut(sums.add(row * ch), ch) };
    row_sums(out, dst);
}

/// A depthwise layer's bias, or `channels` zeros where it has none.
fn bias_or_zeros(bias: Option<&[f32]>, channels: usize) -> std::borrow::Cow<'_, [f32]> {
    bias.map_or_else(|| vec![0f32; channels].into(), std::borrow::Cow::Borrowed)
}

/// [`depthwise`] on storage the kernel reads itself (f32, bf16): each row by the intrinsics
/// kernel ([`regs_row`]) where it covers the layer, straight from and into the storage; else
/// f32 rows computed in place and the epilogue applied there, bf16 rows computed into a
/// per-worker f32 row that the epilogue ([`Finish`]) narrows into the output.
#[allow(clippy::too_many_arguments)]
fn direct<S: Lanes + Wide>(
    c: &Conv2d,
    w: &[f32],
    bias: &[f32],
    x: &[S],
    xs: Nhwc,
    y: &mut [S],
    ys: Nhwc,
    residual: Option<&[S]>,
    act: Act,
    sums: Option<TilePtr<f32>>,
) {
    let row_len = ys.w * ys.c;
    y.par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, out)| {
            let input = tap_rows(c, x, xs, row / ys.h, row % ys.h);
            let residual = residual.map(|r| &r[row * row_len..][..row_len]);
            fma_row(c, &input, (w, bias), out, xs.w, (residual, act));
            if let Some(sums) = sums {
                // SAFETY: `depthwise` checked the sums' length; row `row` is this item's.
                unsafe { put_row_sums(sums, row, ys.c, out) };
            }
        });
}

/// One output row on the FMA kernels: by the intrinsics kernel ([`regs_row`]) where it covers
/// the layer, else by [`other_row`].
fn fma_row<S: Lanes + Wide>(
    c: &Conv2d,
    input: &[Option<&[S]>],
    weights: (&[f32], &[f32]),
    out: &mut [S],
    width: usize,
    fin: (Option<&[S]>, Act),
) {
    if !regs_row(c, input, weights, out, width, fin) {
        other_row(c, input, weights, out, width, fin);
    }
}

/// One output row of [`direct`] where the intrinsics kernel does not cover it: f32 rows computed
/// in place and finished there, bf16 rows computed into a per-worker f32 row that
/// [`Finish`] narrows into `out`.
fn other_row<S: Lanes + Wide>(
    c: &Conv2d,
    input: &[Option<&[S]>],
    (w, bias): (&[f32], &[f32]),
    out: &mut [S],
    width: usize,
    (residual, act): (Option<&[S]>, Act),
) {
    let row_len = out.len();
    match S::as_f32_mut(out) {
        Some(values) => vectorised_row(c, input, (w, bias), values, width, (residual, act)),
        None => SCRATCH.with_borrow_mut(|(_, wide)| {
            wide.resize(row_len, 0.0);
            vectorised_row(c, input, (w, bias), wide, width, (None, Act::None));
            with_simd(Finish {
                values: wide,
                residual,
                act,
                out: Some(out),
            })
        }),
    }
}

/// One output row into `out` (f32 or bf16), finished (`fin`: the residual row and the
/// activation), by the kernel written with intrinsics ([`regs`], AVX-512 or AVX2) where it
/// covers the layer's shape and the SIMD path in use; `false` (nothing written) where it does
/// not.
fn regs_row<I: Lanes + Wide, O: Wide>(
    c: &Conv2d,
    input: &[Option<&[I]>],
    weights: (&[f32], &[f32]),
    out: &mut [O],
    width: usize,
    fin: (Option<&[O]>, Act),
) -> bool {
    #[cfg(target_arch = "x86_64")]
    return regs::row(
        crate::backend::cpu::simd::simd(),
        c,
        input,
        weights,
        out,
        width,
        fin,
    );
    #[cfg(not(target_arch = "x86_64"))]
    return {
        let _ = (c, input, weights, out, width, fin);
        false
    };
}

/// One output row of f32 `values`, finished, by the vectorised kernel ([`DepthwiseRow`]) and
/// then [`Finish`] where there is an epilogue.
fn vectorised_row<S: Lanes>(
    c: &Conv2d,
    input: &[Option<&[S]>],
    (w, bias): (&[f32], &[f32]),
    values: &mut [f32],
    width: usize,
    (residual, act): (Option<&[S]>, Act),
) {
    with_simd(DepthwiseRow {
        acc: &mut *values,
        input,
        w,
        bias,
        c,
        width,
    });
    if residual.is_some() || act != Act::None {
        with_simd(Finish::<S> {
            values,
            residual,
            act,
            out: None,
        })
    }
}

/// The rows of the input (`rows` of them from `r0`) that output rows [oy0, oy1) of depthwise
/// layer `c` read, in an image of `h` rows.
fn tap_span(c: &Conv2d, (oy0, oy1): (usize, usize), h: usize) -> (usize, usize) {
    let first = tap_row(c, oy0, 0).clamp(0, h as isize) as usize;
    let end = (tap_row(c, oy1 - 1, c.kernel.0 - 1) + 1).clamp(0, h as isize) as usize;
    (first, end.saturating_sub(first))
}

/// How a fused pointwise → depthwise pair ([`pointwise_depthwise`]) cuts each image: bands of
/// this many output rows, or `None` where it should not run fused. The band is the tallest whose
/// pointwise rows (with the rows its taps share with the next band's) fill at most `budget`
/// bytes, cut small enough to give each of `threads` workers two of the `n` images' bands; the
/// pair is left unfused where the rows computed twice would add more than `eighths` eighths to
/// the pointwise layer's work (small maps cut for a batch of one).
pub fn fused_band_rows(
    dw: &Conv2d,
    mid: Nhwc,
    out_h: usize,
    threads: usize,
    (budget, eighths): (usize, usize),
) -> Option<usize> {
    if out_h == 0 || mid.h == 0 || mid.n == 0 {
        return None;
    }
    let row_bytes = mid.w.checked_mul(mid.c)?.checked_mul(4)?;
    let fewest = (2 * threads.max(1)).div_ceil(mid.n).clamp(1, out_h);
    // The input rows each band of `rows` output rows reads.
    let spans = |rows: usize| {
        (0..out_h)
            .step_by(rows)
            .map(move |oy| tap_span(dw, (oy, (oy + rows).min(out_h)), mid.h).1)
    };
    let rows = (fewest..=out_h)
        .map(|bands| out_h.div_ceil(bands))
        .find(|&rows| spans(rows).all(|read| read * row_bytes <= budget))?;
    let computed: usize = spans(rows).sum();
    (8 * computed <= (8 + eighths) * mid.h).then_some(rows)
}

/// A pointwise layer that reads a fused depthwise layer's output alone, run on its rows as
/// [`pointwise_depthwise`] makes them: the layer, and its residual (laid out as its output).
pub struct Projection<'a, T> {
    pub conv: &'a PackedConv<T>,
    pub residual: Option<&'a [T]>,
}

/// A pointwise convolution whose output only a depthwise one reads, the two run as one: each
/// work item, a band of one image's output rows ([`fused_band_rows`]), computes the pointwise
/// rows its taps read into the worker's buffer — the GEMM with its bias and activation, as
/// [`conv2d`] runs it, rounded to a half type's precision where the storage is one — and the
/// depthwise rows from there, while they are in L2. Run apart, the pointwise layer wrote its
/// output (the block's widest tensor, three to six times its input) through the last-level
/// cache and the depthwise one read it back: on a 2-vCPU Xeon whose memory (and L3, past
/// ~16 MB) copied at ~24 GB/s, MobileNetV3-Large's first pair (16 → 64 channels at 112², 26 MB
/// between them at batch 8, FP32) took 2.9 ms apart and 1.8 ms fused. Without `pw`, the
/// depthwise layer reads `x` itself, band by band.
///
/// With `project`, the pointwise layer that reads the depthwise one's output alone (an
/// inverted residual block's projection) runs on each band's depthwise rows from the worker's
/// buffer (rounded as a half type's storage would hold them), its residual added, and `y` is
/// its output: the depthwise output, as wide as the expanded tensor at a stride of 1, is
/// never written out and read back either.
///
/// The results are the unfused layers', bit for bit: the same GEMM tiles over the same K, the
/// same depthwise rows. With `sums` (and no `project`), the depthwise rows' sums as
/// [`super::conv2d_squeezed`] writes them (f32 and bf16 storage: returns whether they were).
/// Where the 1×1 layers multiply bf16 pairs the band's rows stay bf16 (`pairs_band`), without
/// sums where the depthwise layer multiplies pairs too, as the layers run apart.
#[allow(clippy::too_many_arguments)]
pub fn pointwise_depthwise<T: Elem>(
    pw: Option<&PackedConv<T>>,
    dw: &PackedConv<T>,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    band: usize,
    sums: Option<&mut [f32]>,
    project: Option<Projection<'_, T>>,
) -> bool {
    let sums = sums
        .filter(|_| makes_row_sums::<T>() && project.is_none())
        .map(|s| {
            assert!(s.len() >= ys.n * ys.h * ys.c, "pair: row sums too short");
            TilePtr(s.as_mut_ptr())
        });
    let pw_pairs = pw.is_some_and(|pw| pw.pairs.is_some());
    if pw_pairs || project.as_ref().is_some_and(|p| p.conv.pairs.is_some()) {
        let pairs = dw.depthwise_pairs.as_deref();
        let sums = sums.filter(|_| pairs.is_none());
        return pairs_band(pw, (dw, pairs), (x, xs), (y, ys), band, sums, project);
    }
    let made = sums.is_some();
    let Some((w, bias)) = &dw.depthwise else {
        unreachable!("a fused pair's second layer is depthwise");
    };
    let pw = pw.map(|pw| match pw.groups.as_slice() {
        [b] => (b, pw.conv.act),
        _ => unreachable!("a fused pair's first layer is an ungrouped pointwise one"),
    });
    let bias = bias_or_zeros(bias.as_deref(), ys.c);
    let bias = &bias[..];
    let (c, cin) = (&dw.conv, xs.c);
    let mid = Nhwc {
        c: pw.map_or(xs.c, |(b, _)| b.n),
        ..xs
    };
    let row_len = ys.w * ys.c;
    let out_len = match &project {
        Some(p) => ys.n * ys.h * ys.w * p.conv.conv.out_channels,
        None => ys.elems(),
    };
    let y = &mut y[..out_len];
    let bands = ys.h.div_ceil(band.max(1));
    let out = TilePtr(y.as_mut_ptr());
    (0..ys.n * bands).into_par_iter().for_each(|item| {
        let (n, oy0) = (item / bands, item % bands * band);
        let oy1 = (oy0 + band).min(ys.h);
        let (r0, rows) = tap_span(c, (oy0, oy1), mid.h);
        SCRATCH.with_borrow_mut(|(cols, expanded)| {
            let x = &x[(n * xs.h + r0) * xs.w * cin..][..rows * xs.w * cin];
            // The depthwise layer's input rows: the 1×1 layer's as `conv2d` computes them
            // (from f32 input in place, or from the input widened, its im2col; then, in half
            // precision, the epilogue and the rounding its output's storage would make), or
            // without one, the input's own rows (widened from a half type).
            let made_rows: &[f32] = match (pw, T::as_f32(x)) {
                (None, Some(a)) => a,
                (None, None) => {
                    expanded.resize(x.len(), 0.0);
                    T::widen(x, expanded);
                    expanded
                }
                (Some((b, act)), a) => {
                    let a = a.unwrap_or_else(|| {
                        cols.resize(x.len(), 0.0);
                        T::widen(x, cols);
                        cols
                    });
                    expanded.resize(rows * mid.w * mid.c, 0.0);
                    expand(b, act, a, (rows * mid.w, cin), expanded);
                    expanded
                }
            };
            let band_dims = Nhwc {
                n: 1,
                h: rows,
                ..mid
            };
            BAND.with_borrow_mut(|projected| {
                if project.is_some() {
                    projected.resize((oy1 - oy0) * row_len, 0.0);
                }
                for oy in oy0..oy1 {
                    let input: Vec<Option<&[f32]>> = (0..c.kernel.0)
                        .map(|ky| {
                            image_row(made_rows, band_dims, 0, tap_row(c, oy, ky) - r0 as isize)
                        })
                        .collect();
                    // The row in f32, finished: by the intrinsics kernel where it covers the
                    // layer, else the vectorised one.
                    let f32_row = |values: &mut [f32]| {
                        if !regs_row(c, &input, (w, bias), values, mid.w, (None, c.act)) {
                            vectorised_row(c, &input, (w, bias), values, mid.w, (None, c.act));
                        }
                    };
                    if project.is_some() {
                        // This band's row of the depthwise output, in the worker's buffer,
                        // rounded as a half type's storage would hold it.
                        let row = &mut projected[(oy - oy0) * row_len..][..row_len];
                        f32_row(row);
                        round_to::<T>(row);
                        continue;
                    }
                    // SAFETY: output row oy of image n, this work item's alone.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(out.add((n * ys.h + oy) * row_len), row_len)
                    };
                    // bf16 rows straight from the kernel's registers where it covers the layer.
                    let done = match T::as_bf16_mut(&mut *out) {
                        Some(o) => regs_row(c, &input, (w, bias), o, mid.w, (None, c.act)),
                        None => false,
                    };
                    if !done {
                        as_f32_row(out, cols, f32_row);
                    }
                    if let Some(sums) = sums {
                        let row = n * ys.h + oy;
                        // SAFETY: the sums' length is checked above; row `row` is this item's.
                        unsafe {
                            match (T::as_f32(out), T::as_bf16(out)) {
                                (Some(o), _) => put_row_sums(sums, row, ys.c, o),
                                (_, Some(o)) => put_row_sums(sums, row, ys.c, o),
                                _ => unreachable!("sums are made of f32 and bf16 rows"),
                            }
                        }
                    }
                }
                if let Some(p) = &project {
                    // The band's depthwise rows are the projection's A, as `conv2d` reads its
                    // input in place: its output rows of this band, finished.
                    let cout = p.conv.conv.out_channels;
                    let epilogue = Epilogue {
                        residual: p.residual,
                        in_output: false,
                        act: p.conv.conv.act,
                    };
                    let pixels = ((n * ys.h + oy0) * ys.w, (oy1 - oy0) * ys.w);
                    let panels = (0, p.conv.groups[0].panels());
                    let groups = &p.conv.groups;
                    gemm_tile(
                        projected,
                        ys.c,
                        groups,
                        (ys.c, true),
                        pixels,
                        panels,
                        out,
                        cout,
                        cols,
                        &epilogue,
                    );
                }
            });
        });
    });
    made
}

/// [`pointwise_depthwise`] on bf16 rows, where its 1×1 layers multiply bf16 pairs: each band's
/// pointwise rows made by the pair GEMM into the worker's buffer, in bf16, finished as
/// [`super::conv2d_pairs`] stores them (its input read in place or copied into padded rows, as
/// there) — or without `pw`, the input's own rows —, and the depthwise rows made from there by
/// the kernel the layer runs on apart: the pair kernel ([`Pairs::output_row`]) or the FMA one
/// (with the rows' `sums` where asked). With `project`, those rows go to a second buffer, and
/// the projection's pair GEMM reads them from there as its A, its output rows of the band
/// finished into `y` with its residual. The same values as the layers apart. Returns whether
/// the sums were made.
#[allow(clippy::too_many_arguments)]
fn pairs_band<T: Elem>(
    pw: Option<&PackedConv<T>>,
    (dw, pairs): (&PackedConv<T>, Option<&Pairs>),
    (x, xs): (&[T], Nhwc),
    (y, ys): (&mut [T], Nhwc),
    band: usize,
    sums: Option<TilePtr<f32>>,
    project: Option<Projection<'_, T>>,
) -> bool {
    /// A 1×1 layer's B, engine and A's K (padded) and row stride.
    fn gemm<T: Elem>(
        conv: &PackedConv<T>,
    ) -> (&bf16_gemm::PackedPairs, bf16_gemm::Engine, (usize, usize)) {
        let b = conv
            .pairs
            .as_deref()
            .expect("a bf16-row band's 1×1 layers multiply pairs");
        let engine =
            bf16_gemm::Engine::for_k(b.k).expect("pair packings exist only with an engine");
        (b, engine, (b.kp(), engine.lda(b.kp())))
    }
    fn stored<T: Elem>(v: &[T]) -> &[bf16] {
        T::as_bf16(v).expect("bf16-pair layers store bf16")
    }
    let pw = pw.map(|pw| (pw, gemm(pw)));
    let proj = project.as_ref().map(|p| (p.conv.conv.act, gemm(p.conv)));
    let c = &dw.conv;
    let mid = Nhwc {
        c: pw.map_or(xs.c, |(pw, _)| pw.conv.out_channels),
        ..xs
    };
    let Some((w, bias)) = &dw.depthwise else {
        unreachable!("a fused pair's second layer is depthwise");
    };
    let bias = bias_or_zeros(bias.as_deref(), ys.c);
    let bias = &bias[..];
    let row_len = ys.w * ys.c;
    let out_c = proj.map_or(ys.c, |(_, (b, _, _))| b.n);
    let residual = project.as_ref().and_then(|p| p.residual).map(stored::<T>);
    let x16 = stored::<T>(x);
    let out = TilePtr(
        T::as_bf16_mut(&mut y[..ys.n * ys.h * ys.w * out_c])
            .expect("bf16-pair layers store bf16")
            .as_mut_ptr(),
    );
    let bands = ys.h.div_ceil(band.max(1));
    (0..ys.n * bands).into_par_iter().for_each(|item| {
        let (n, oy0) = (item / bands, item % bands * band);
        let oy1 = (oy0 + band).min(ys.h);
        let (r0, rows) = tap_span(c, (oy0, oy1), mid.h);
        PAIR_BAND.with_borrow_mut(|(cols, made, depthwise_rows)| {
            let pixels = ((n * xs.h + r0) * xs.w, rows * xs.w);
            let made: &[bf16] = match pw {
                Some((pw, (b, engine, (kp, lda)))) => {
                    let a = super::pair_rows(&pw.conv, (x, xs, mid), pixels, (kp, lda), cols);
                    made.reuse(pixels.1 * mid.c);
                    let ends = (TilePtr(made.as_mut_ptr()), None);
                    // SAFETY: pair packings exist only where the CPU runs their engine; A has
                    // the band's rows of kp values lda apart (zeros past K); `made` holds as
                    // many rows of the layer's channels, this worker's alone.
                    unsafe {
                        let (m, panels) = ((0, pixels.1), (0, b.panels()));
                        super::pairs_finished(engine, (a, lda), b, m, panels, ends, pw.conv.act)
                    };
                    made
                }
                None => &x16[pixels.0 * mid.c..][..pixels.1 * mid.c],
            };
            let band_dims = Nhwc {
                n: 1,
                h: rows,
                ..mid
            };
            if proj.is_some() {
                depthwise_rows.reuse((oy1 - oy0) * row_len);
            }
            for oy in oy0..oy1 {
                let input: Vec<Option<&[bf16]>> = (0..c.kernel.0)
                    .map(|ky| image_row(made, band_dims, 0, tap_row(c, oy, ky) - r0 as isize))
                    .collect();
                let out = match proj {
                    Some(_) => &mut depthwise_rows[(oy - oy0) * row_len..][..row_len],
                    // SAFETY: output row oy of image n, this work item's alone.
                    None => unsafe {
                        std::slice::from_raw_parts_mut(out.add((n * ys.h + oy) * row_len), row_len)
                    },
                };
                let fin = (None, c.act);
                match pairs {
                    Some(p) => p.output_row(&input, bias, out, fin, (mid.w, c.padding.1)),
                    None => fma_row(c, &input, (w, bias), out, mid.w, fin),
                }
                if let Some(sums) = sums {
                    // SAFETY: the caller checked the sums' length; row n·h + oy is this
                    // item's.
                    unsafe { put_row_sums(sums, n * ys.h + oy, ys.c, out) };
                }
            }
            if let Some((act, (b, engine, (kp, lda)))) = proj {
                // The band's depthwise rows are the projection's A, as `conv2d` reads its
                // input: its output rows of this band, finished.
                let m = (oy1 - oy0) * ys.w;
                let a = super::padded_rows(&depthwise_rows[..m * ys.c], ys.c, (kp, lda), cols);
                let rows = ((n * ys.h + oy0) * ys.w, m);
                // SAFETY: as above; rows `rows` of `y` (and of the residual) are this work
                // item's.
                unsafe {
                    let ends = (out, residual.map(<[bf16]>::as_ptr));
                    super::pairs_finished(engine, (a, lda), b, rows, (0, b.panels()), ends, act)
                };
            }
        });
    });
    sums.is_some()
}

thread_local! {
    /// A fused pair's bf16 A rows (where they are copied), its band of pointwise rows and, for
    /// a projection, its band of depthwise rows (see [`pairs_band`]), on cache lines as the
    /// tiles read them.
    static PAIR_BAND: std::cell::RefCell<(Lines<bf16>, Lines<bf16>, Lines<bf16>)> =
        std::cell::RefCell::new((big_buffer(0), big_buffer(0), big_buffer(0)));
}

/// The 1×1 layer's rows (`m` pixels of `k` channels in `a`) into `expanded`, as [`conv2d`]
/// computes them: the GEMM, its activation applied in its tiles (it has no residual), then
/// the rounding a half type's storage would make.
fn expand<T: Elem>(
    b: &crate::backend::cpu::sgemm::PackedB<T>,
    act: Act,
    a: &[f32],
    (m, k): (usize, usize),
    expanded: &mut [f32],
) {
    let fin = (act != Act::None).then_some(crate::backend::cpu::sgemm::Finish {
        act,
        residual: std::ptr::null(),
        bf16: None,
    });
    // SAFETY: `a` holds m pixels of k floats; `expanded` as many of the layer's n channels,
    // written by this worker alone.
    unsafe {
        crate::backend::cpu::sgemm::gemm_packed(
            m,
            a.as_ptr(),
            k,
            b,
            (0, b.panels()),
            expanded.as_mut_ptr(),
            b.n,
            fin,
        );
    }
    round_to::<T>(expanded);
}

thread_local! {
    /// A fused projection's band of depthwise rows (see [`pointwise_depthwise`]).
    static BAND: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `values` rounded to `T`'s precision, as storing them in `T` and reading them back would.
fn round_to<T: Elem>(values: &mut [f32]) {
    if T::IS_F32 {
        return;
    }
    if T::PRECISION == crate::model::Precision::Bf16 {
        // In one vectorised pass: bf16 is f32's upper half, rounded in the bits.
        let round = |v: &mut f32| *v = bf16_f32(f32_bf16(*v));
        return with_simd(crate::backend::cpu::simd::Update(values, round));
    }
    let mut stored = [T::from_f32(0.0); 64];
    for run in values.chunks_mut(64) {
        T::narrow(run, &mut stored[..run.len()]);
        T::widen(&stored[..run.len()], run);
    }
}

/// Whether [`pointwise_depthwise`] may run `pw` then `dw` as one: `pw` an ungrouped 1×1
/// stride-1 layer (no residual: the caller checks its inputs) and `dw` a depthwise layer over
/// its channels, either both on f32 rows (the GEMM and the FMA kernels) or `pw` on bf16 pairs
/// (`dw` on either kernel of bf16 rows).
pub fn can_pair<T: Elem>(pw: &PackedConv<T>, dw: &PackedConv<T>) -> bool {
    let kernels = match (&pw.pairs, &dw.depthwise_pairs) {
        (None, None) => pw.groups.len() == 1,
        (Some(_), _) => !super::stem::is_stem(&pw.conv),
        (None, Some(_)) => false,
    };
    is_pointwise(&pw.conv)
        && kernels
        && pw.winograd.is_none()
        && dw.depthwise.is_some()
        && dw.conv.in_channels == pw.conv.out_channels
}

/// Whether pointwise layer `pw` and depthwise layer `dw` (which reads `pw`'s output alone),
/// `xs` → `ys`, should run as one ([`pointwise_depthwise`]), and in bands of how many output
/// rows. It pays where `pw`'s output outgrows the L2 caches of the `threads` workers (`l2`
/// bytes each), which it would otherwise leave for the depthwise layer to read back, and
/// serves where [`fused_band_rows`] finds bands within half an L2. Alternating in one process
/// on a 2-vCPU Xeon (2 MB of L2 a core), MobileNetV3-Large FP32 b8's pairs took 0.63× (16 →
/// 64 at 112², 26 MB), 0.86× (24 → 72 at 56², 7 MB), 0.91–0.94× (6–7 MB) as long fused, level
/// at 3–4 MB, and 1.06–1.10× at 1.2–1.5 MB (14² and 7² maps, whose per-image GEMMs are small).
/// BF16 (widened) with the tensor counted in f32 rather than bf16, five more pairs fused:
/// 0.91–0.96× (at 3.6, 1.8, 1.2 MB of bf16) and one 1.03× (24 → 72, 5×5 stride 2, 3.6 MB), the
/// network 0.976×. Where the tensor is four times the L2s or more, the bands may compute up to
/// three eighths of its rows twice, not one: on a Zen 3 (512 KiB of L2 a core) the pair 24 →
/// 72 at 56², 5×5 stride 2 (7.2 MB at batch 8, a fifth of its rows twice in bands of 6 output
/// rows) took 0.77–0.90× the time apart (each kernel's least time over 6 alternating runs,
/// three times); every pair let recompute as much (the 14² ones too) left the network level.
pub fn pair_bands<T: Elem>(
    (pw, dw): (&PackedConv<T>, &PackedConv<T>),
    xs: Nhwc,
    ys: Nhwc,
    threads: usize,
    l2: usize,
) -> Option<usize> {
    let mid = Nhwc {
        c: pw.conv.out_channels,
        ..xs
    };
    // Counted in f32, as the 1×1 layer computes it, in any storage: run apart in a half
    // type, its output also makes a pass to narrow it (and the depthwise layer widens it
    // again), which the fused pair does in place.
    let bytes = mid.elems().saturating_mul(4);
    let l2s = threads.saturating_mul(l2);
    // On bf16 pairs the tensor is stored as it is computed, in bf16, and the pair paid past
    // three quarters of the L2s: MobileNetV3-Large BF16 at batch 8 on 2 Sapphire Rapids cores
    // (2 MB of L2 each; 100 steps alternating in one process), fused against apart, 16 → 64 at
    // 112² (12.8 MB of bf16) 0.93×, 24 → 72 at 56² 0.85× and 0.95× (3.6 MB), 40 → 240 at 28²
    // 0.97× (3.0 MB), but 112 → 672 at 14² 1.14× and 1.15× as long (2.1 MB): a band of a
    // small map is a small GEMM, whose last block of 32 rows AMX pads. At batch 32 (40
    // steps) every pair this fuses took 0.71–0.94× the time, those at 14² (8.4 MB) 0.88× and
    // 0.94×; the network's least step 0.93×.
    let stored = match pw.pairs {
        Some(_) => pair_band_bytes(mid),
        None => bytes,
    };
    if stored <= l2s {
        return None;
    }
    let eighths = if bytes / 4 >= l2s { 3 } else { 1 };
    fused_band_rows(&dw.conv, mid, ys.h, threads, (l2 / 2, eighths))
}

/// The bytes a tensor kept in bf16 by a fused band on bf16 pairs counts as against the L2s
/// ([`pair_bands`], [`projected_bands`]): its bf16 bytes and a third more.
fn pair_band_bytes(dims: Nhwc) -> usize {
    dims.elems().saturating_mul(2).saturating_mul(4) / 3
}

/// Whether pointwise layer `proj` may run on depthwise layer `dw`'s rows as they are made (a
/// [`Projection`] of [`pointwise_depthwise`]): `proj` an ungrouped 1×1 stride-1 layer over
/// `dw`'s channels, as `conv2d` runs it — on the GEMM of f32 rows after `dw` on the FMA
/// kernels, or on bf16 pairs after `dw` on either kernel.
pub fn can_project<T: Elem>(dw: &PackedConv<T>, proj: &PackedConv<T>) -> bool {
    let kernels = match &proj.pairs {
        None => {
            dw.depthwise_pairs.is_none()
                && proj.groups.len() == 1
                && proj.winograd.is_none()
                && !super::stem::runs_f32(&proj.conv)
        }
        Some(_) => !super::stem::is_stem(&proj.conv),
    };
    dw.depthwise.is_some()
        && is_pointwise(&proj.conv)
        && kernels
        && proj.conv.in_channels == dw.conv.out_channels
}

/// Whether depthwise layer `dw` (`xs` → `ys`) and the pointwise layer `proj` that reads its
/// output alone should run as one ([`pointwise_depthwise`] without a pointwise layer before),
/// and in bands of how many output rows: where `dw`'s output outgrows the L2 caches of the
/// `threads` workers (`l2` bytes each), which the projection would otherwise read back, in
/// bands of input rows within half an L2 ([`fused_band_rows`]). Alternating in one process on a 2-vCPU
/// Emerald Rapids Xeon (2 MB of L2 a core), MobileNetV3-Large FP32 b8's projected layers took
/// 0.83× (16 channels at 112², no pointwise layer before), 0.94× (the pair 16 → 64 → 24),
/// 0.74× (24 → 72 → 24 at 56² with a residual) and 0.94× (40 → 240 → 80) the time of the
/// pair and the projection apart; the network 0.95× at batch 8 and 32, 0.985× at 1, and
/// MobileNetV2 (whose blocks all end in a projection) 0.91× at batch 8.
///
/// Where `proj` multiplies bf16 pairs (`dw`'s rows stay bf16, `pairs_band`) the tensor counts
/// as its bf16 bytes and a third more, as for [`pair_bands`]' pairs: MobileNetV3-Large BF16 on
/// 2 Sapphire Rapids cores (one process alternating, 100 steps at batch 8, 30 at 32), the
/// depthwise layer and its projection took 0.95–0.97× the time fused at 112² and 56² (3.2 and
/// 3.6 MB of bf16 at batch 8), the network 0.97–0.99×; counted in f32 instead, 14² layers of
/// 184 and 200 channels at batch 32 (2.3 and 2.5 MB) fused too, and took 1.00–1.05× as long.
pub fn projected_bands<T: Elem>(
    (dw, proj): (&PackedConv<T>, &PackedConv<T>),
    xs: Nhwc,
    ys: Nhwc,
    threads: usize,
    l2: usize,
) -> Option<usize> {
    let bytes = match proj.pairs {
        Some(_) => pair_band_bytes(ys),
        None => ys.elems().saturating_mul(4),
    };
    if bytes <= threads.saturating_mul(l2) {
        return None;
    }
    fused_band_rows(&dw.conv, xs, ys.h, threads, (l2 / 2, 1))
}

/// A row's epilogue, as vectorised work: the residual added to the f32 `values`, the
/// activation applied, and the values narrowed into `out` (`None`: they are the output). Three
/// plain loops over a row in L1: folded into one, SiLU's loop was compiled value by value and
/// EfficientNet-B0's depthwise layers in FP32 took three times as long.
struct Finish<'a, S> {
    values: &'a mut [f32],
    residual: Option<&'a [S]>,
    act: Act,
    out: Option<&'a mut [S]>,
}

impl<S: Lanes> Vectorised for Finish<'_, S> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Finish {
            values,
            residual,
            act,
            out,
        } = self;
        if let Some(r) = residual {
            (values.iter_mut().zip(r)).for_each(|(v, r)| *v += r.wide());
        }
        activate(act, values);
        if let Some(out) = out {
            (out.iter_mut().zip(values.iter())).for_each(|(o, v)| *o = S::from_wide(*v));
        }
    }
}

/// [`depthwise`] on f16: input rows widened to f32 (each kept for the worker's next output row,
/// [`input_rows`]), the row computed in f32, the epilogue applied and the row narrowed.
#[allow(clippy::too_many_arguments)]
fn widened<T: Elem>(
    c: &Conv2d,
    w: &[f32],
    bias: &[f32],
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    epilogue: &Epilogue<'_, T>,
) {
    let row_len = ys.w * ys.c;
    let call = next_call();
    y.par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, out)| {
            let (oy, n) = (row % ys.h, row / ys.h);
            let iys: Vec<isize> = (0..c.kernel.0).map(|ky| tap_row(c, oy, ky)).collect();
            WIDE_ROWS.with_borrow_mut(|wide_in| {
                let input = input_rows(x, xs, n, &iys, wide_in, call);
                SCRATCH.with_borrow_mut(|(_, wide_out)| {
                    as_f32_row(out, wide_out, |acc| {
                        with_simd(DepthwiseRow {
                            acc: &mut *acc,
                            input: &input,
                            w,
                            bias,
                            c,
                            width: xs.w,
                        });
                        epilogue.apply(acc, row * row_len, &mut Vec::new());
                    })
                });
            })
        });
}

/// The input row that tap row `ky` of output row `oy` reads (negative or past the image's
/// height where that row is padding).
pub(super) fn tap_row(c: &Conv2d, oy: usize, ky: usize) -> isize {
    (oy * c.stride.0 + ky * c.dilation.0) as isize - c.padding.0 as isize
}

/// The input rows of output row `oy` of image `n`, a tap row each (`None` outside the image).
fn tap_rows<'a, S>(c: &Conv2d, x: &'a [S], xs: Nhwc, n: usize, oy: usize) -> Vec<Option<&'a [S]>> {
    (0..c.kernel.0)
        .map(|ky| image_row(x, xs, n, tap_row(c, oy, ky)))
        .collect()
}

/// `f` on `out` as f32: in place for f32 storage, else on `wide` (resized to `out`'s length)
/// narrowed into `out` afterwards.
pub(super) fn as_f32_row<T: Elem>(out: &mut [T], wide: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
    match T::as_f32_mut(out) {
        Some(out) => f(out),
        None => {
            wide.resize(out.len(), 0.0);
            f(wide);
            T::narrow(wide, out);
        }
    }
}

/// A storage type the depthwise kernel loads and stores a value at a time (in loops the
/// compiler vectorises).
pub(super) trait Lanes: Elem {
    fn wide(self) -> f32;
    fn from_wide(v: f32) -> Self;
}

impl Lanes for f32 {
    #[inline(always)]
    fn wide(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_wide(v: f32) -> Self {
        v
    }
}

impl Lanes for bf16 {
    #[inline(always)]
    fn wide(self) -> f32 {
        bf16_f32(self)
    }
    #[inline(always)]
    fn from_wide(v: f32) -> Self {
        f32_bf16(v)
    }
}

/// Channels per register block of [`DepthwiseRow`]: two AVX2 vectors, one AVX-512 vector.
const BLOCK: usize = 16;
/// Output pixels per register block where every tap is inside the image: each tap's weights
/// are loaded once for all of them.
const PIXELS: usize = 4;
/// The bytes of input a run of [`PIXELS`] may read across its channel group (half of a 32 KiB
/// L1, the other half for the weights and what else the row needs).
const RUN_BYTES: usize = 16 << 10;

/// One output row of [`depthwise`] before its epilogue, as vectorised work. For each run of
/// [`PIXELS`] output pixels and each block of [`BLOCK`] channels (then one of 8, then single
/// channels), the accumulators start from the bias and stay in registers through every tap —
/// the input pixel at row ky, column ox·stride + kx·dilation − pad, times the tap's weights —
/// and are stored once, in f32. The common shapes (3, 5 or 7 taps a row, stride 1 or 2, no
/// dilation) have their taps unrolled ([`DepthwiseRow::row_taps`]), the image's edges
/// included; others go tap by tap ([`DepthwiseRow::pixels`]), the pixels near the edges one
/// at a time, skipping the padding.
pub(super) struct DepthwiseRow<'a, S> {
    acc: &'a mut [f32],
    /// The input row of each tap row ky (`None` above or below the image).
    input: &'a [Option<&'a [S]>],
    /// Weights, (ky, kx, channel).
    w: &'a [f32],
    bias: &'a [f32],
    c: &'a Conv2d,
    /// The input's width in pixels.
    width: usize,
}

impl<S: Lanes> Vectorised for DepthwiseRow<'_, S> {
    type Output = ();
    #[inline(always)]
    fn run(mut self) {
        let c = self.c;
        let (kw, stride, dilation, pad) = (c.kernel.1, c.stride.1, c.dilation.1, c.padding.1);
        let out_w = self.acc.len() / self.bias.len();
        // Output pixels ox in lo..hi read no padding: ox·s ≥ pad, ox·s + (kw − 1)·d − pad < width.
        let lo = pad.div_ceil(stride).min(out_w);
        let reach = (kw - 1) * dilation;
        let hi = if self.width + pad > reach {
            ((self.width + pad - reach - 1) / stride + 1).clamp(lo, out_w)
        } else {
            lo
        };
        match (kw, stride, dilation) {
            (3, 1, 1) => self.runs::<3, 1>(lo, hi, out_w),
            (5, 1, 1) => self.runs::<5, 1>(lo, hi, out_w),
            (7, 1, 1) => self.runs::<7, 1>(lo, hi, out_w),
            (3, 2, 1) => self.runs::<3, 2>(lo, hi, out_w),
            (5, 2, 1) => self.runs::<5, 2>(lo, hi, out_w),
            _ => self.runs::<0, 0>(lo, hi, out_w),
        }
    }
}

impl<S: Lanes> DepthwiseRow<'_, S> {
    /// [`Self::row_taps`] for the other shapes, tap by tap: each tap's weights loaded once for
    /// the run, each tap's input pixel checked where `EDGE`.
    #[inline(always)]
    fn pixels<const B: usize, const EDGE: bool>(&mut self, ox0: usize, valid: usize, c0: usize) {
        const P: usize = PIXELS;
        let c = self.c;
        let ch = self.bias.len();
        let (kw, stride, dilation) = (c.kernel.1, c.stride.1, c.dilation.1);
        let pad = c.padding.1 as isize;
        let bias: [f32; B] = self.bias[c0..][..B].try_into().expect("B channels");
        let mut acc = [bias; P];
        let x0 = (ox0 * stride) as isize - pad;
        for (ky, row) in self.input.iter().enumerate() {
            let Some(row) = row else { continue };
            let weights = &self.w[ky * kw * ch + c0..];
            for kx in 0..kw {
                let w: &[f32; B] = weights[kx * ch..][..B].try_into().expect("B weights");
                let ix0 = x0 + (kx * dilation) as isize;
                for (p, acc) in acc.iter_mut().enumerate() {
                    let ix = ix0 + (p * stride) as isize;
                    if EDGE && (ix < 0 || ix as usize >= self.width) {
                        continue;
                    }
                    let x: &[S; B] = row[ix as usize * ch + c0..][..B]
                        .try_into()
                        .expect("B inputs");
                    for i in 0..B {
                        acc[i] = x[i].wide().mul_add(w[i], acc[i]);
                    }
                }
            }
        }
        for (p, acc) in acc.iter().enumerate().take(valid) {
            self.acc[(ox0 + p) * ch + c0..][..B].copy_from_slice(acc);
        }
    }

    /// The row in runs of [`PIXELS`] output pixels, the image's edges and a short last run
    /// included (checked input pixel by input pixel; unchecked where `lo..hi` holds the
    /// run): for `K` taps a row at stride `STRIDE` (no dilation) by [`Self::row_taps`], for
    /// `K` = 0 (any other shape) by [`Self::pixels`]. Edge pixels one at a time, each tap
    /// checked, were a third of the time on MobileNetV3's 7- and 14-pixel rows. The channels go
    /// in groups whose share of a run's input pixels fits in [`RUN_BYTES`], each group along
    /// the whole row: a run over all of a wide layer's channels (672 at 14 × 14, 5 × 5 taps:
    /// 148 KiB) left L1 before the next run came back to the pixels they share.
    #[inline(always)]
    fn runs<const K: usize, const STRIDE: usize>(&mut self, lo: usize, hi: usize, out_w: usize) {
        let ch = self.bias.len();
        let c = self.c;
        let run_pixels = (PIXELS - 1) * c.stride.1 + (c.kernel.1 - 1) * c.dilation.1 + 1;
        let per_channel = run_pixels * self.input.len() * std::mem::size_of::<S>();
        let group = (RUN_BYTES / per_channel / BLOCK * BLOCK).max(BLOCK);
        for c_lo in (0..ch).step_by(group) {
            let cs = c_lo..(c_lo + group).min(ch);
            for ox in (0..out_w).step_by(PIXELS) {
                // The last run may be short: its pixels past the row are computed (from the
                // padding's side of the checks) and not stored. One at a time, those pixels
                // were each a chain of K² dependent FMAs.
                let valid = PIXELS.min(out_w - ox);
                if ox >= lo && ox + PIXELS <= hi {
                    self.taps_channels::<K, STRIDE, false>(ox, valid, cs.clone());
                } else {
                    self.taps_channels::<K, STRIDE, true>(ox, valid, cs.clone());
                }
            }
        }
    }

    /// A run over channels `cs`: blocks of [`BLOCK`], one of 8, then single channels.
    #[inline(always)]
    fn taps_channels<const K: usize, const STRIDE: usize, const EDGE: bool>(
        &mut self,
        ox0: usize,
        valid: usize,
        cs: std::ops::Range<usize>,
    ) {
        let mut c0 = cs.start;
        while c0 + BLOCK <= cs.end {
            self.block::<BLOCK, K, STRIDE, EDGE>(ox0, valid, c0);
            c0 += BLOCK;
        }
        if c0 + 8 <= cs.end {
            self.block::<8, K, STRIDE, EDGE>(ox0, valid, c0);
            c0 += 8;
        }
        for c0 in c0..cs.end {
            self.block::<1, K, STRIDE, EDGE>(ox0, valid, c0);
        }
    }

    /// One run's channels c0..c0 + B by the kernel for its shape (`K` = 0: tap by tap).
    #[inline(always)]
    fn block<const B: usize, const K: usize, const STRIDE: usize, const EDGE: bool>(
        &mut self,
        ox0: usize,
        valid: usize,
        c0: usize,
    ) {
        if K == 0 {
            self.pixels::<B, EDGE>(ox0, valid, c0)
        } else {
            self.row_taps::<B, K, STRIDE, EDGE>(ox0, valid, c0)
        }
    }

    /// Output pixels ox0..ox0 + [`PIXELS`] (the first `valid` of them stored), channels
    /// c0..c0 + B, for `K` taps a row at stride `STRIDE`:
    /// each input pixel the run reads is loaded (and widened) once per tap row and multiplied
    /// into every output pixel it reaches, the row's K weights held in registers (a 3×3 run of
    /// 4 reads 6 input pixels a row where tap by tap it read 12); `EDGE` where some of them
    /// may lie in the padding (skipped).
    #[inline(always)]
    fn row_taps<const B: usize, const K: usize, const STRIDE: usize, const EDGE: bool>(
        &mut self,
        ox0: usize,
        valid: usize,
        c0: usize,
    ) {
        const P: usize = PIXELS;
        let ch = self.bias.len();
        let bias: [f32; B] = self.bias[c0..][..B].try_into().expect("B channels");
        let mut acc = [bias; P];
        let x0 = (ox0 * STRIDE) as isize - self.c.padding.1 as isize;
        for (ky, row) in self.input.iter().enumerate() {
            let Some(row) = row else { continue };
            // (A loop, not `array::from_fn`: that one was not inlined, and copied the weights
            // through the stack on every tap row.)
            let mut w = [[0f32; B]; K];
            for (kx, w) in w.iter_mut().enumerate() {
                *w = self.w[(ky * K + kx) * ch + c0..][..B]
                    .try_into()
                    .expect("B weights");
            }
            for j in 0..(P - 1) * STRIDE + K {
                let ix = x0 + j as isize;
                if EDGE && (ix < 0 || ix as usize >= self.width) {
                    continue;
                }
                let xs: &[S; B] = row[ix as usize * ch + c0..][..B]
                    .try_into()
                    .expect("B inputs");
                let mut xv = [0f32; B];
                for i in 0..B {
                    xv[i] = xs[i].wide();
                }
                for (p, acc) in acc.iter_mut().enumerate() {
                    // Input pixel j is tap j − p·STRIDE of output pixel p.
                    if j >= p * STRIDE && j - p * STRIDE < K {
                        let w = &w[j - p * STRIDE];
                        for i in 0..B {
                            acc[i] = xv[i].mul_add(w[i], acc[i]);
                        }
                    }
                }
            }
        }
        for (p, acc) in acc.iter().enumerate().take(valid) {
            self.acc[(ox0 + p) * ch + c0..][..B].copy_from_slice(acc);
        }
    }
}

/// Depthwise rows written with intrinsics, on AVX-512 (a zmm of 16 channels, a layer's last
/// block masked) and on AVX2 (a ymm of 8, for layers whose channels are a multiple of 8: all of
/// MobileNet's, EfficientNet's and ConvNeXt's; ShuffleNet's 58- and 116-channel layers keep the
/// vectorised kernel): runs of P output pixels × one register of channels, the accumulators and
/// a tap row's weights in registers, each input pixel loaded once per tap row and multiplied
/// into every output pixel it reaches (on AVX2 at 5×5 and 7×7, once per tap: see `sums`). The
/// compiler's vectorisation of [`DepthwiseRow`] kept 4 pixels (8 spilled its arrays to the
/// stack and ran 30–50% slower on AVX-512), so each tap row was a chain of K dependent FMAs per
/// accumulator with only 4 accumulators, and every input load checked two slice bounds; on
/// AVX2 its blocks of 16 channels (two ymm) and a 5×5 row's weights needed more than AVX2's 16
/// registers. The sums are the same FMAs in the same order as [`DepthwiseRow::row_taps`]:
/// results are equal bit for bit, on every path.
#[cfg(target_arch = "x86_64")]
mod regs {
    use std::arch::x86_64::*;

    use super::super::activation::{Vector, activate_vec, with_vec_act};
    use super::{Lanes, RUN_BYTES, Wide};
    use crate::backend::cpu::simd::Simd;
    use crate::model::op::{Act, Conv2d};

    /// A register of f32 lanes the rows run in, and how it reads and writes a block of a
    /// row's channels in their storage.
    pub(super) trait Reg: Vector {
        /// Which of a block's lanes are the layer's channels.
        type Mask: Copy;
        /// The mask of a block with `left` channels from its first (every lane where `left`
        /// covers them).
        fn mask(left: usize) -> Self::Mask;
        /// The lanes of `mask` from `p`, widened, the others zero.
        ///
        /// # Safety
        /// The CPU has the register's instruction set; those lanes' places at `p` are
        /// readable.
        unsafe fn get<T: Wide>(p: *const T, mask: Self::Mask) -> Self;
        /// The lanes of `mask` of `v`, narrowed, stored at `p`.
        ///
        /// # Safety
        /// As for [`Reg::get`], the places writable.
        unsafe fn put<T: Wide>(p: *mut T, mask: Self::Mask, v: Self);
    }

    impl Reg for __m512 {
        type Mask = __mmask16;
        #[inline(always)]
        fn mask(left: usize) -> __mmask16 {
            (u32::MAX >> (32 - left.min(16))) as __mmask16
        }
        #[inline(always)]
        unsafe fn get<T: Wide>(p: *const T, mask: __mmask16) -> Self {
            // SAFETY: the caller's.
            unsafe { T::load(p, mask) }
        }
        #[inline(always)]
        unsafe fn put<T: Wide>(p: *mut T, mask: __mmask16, v: Self) {
            // SAFETY: the caller's.
            unsafe { T::store(p, mask, v) }
        }
    }

    /// Whole blocks only: the AVX2 rows take layers whose channels are a multiple of 8.
    impl Reg for __m256 {
        type Mask = ();
        #[inline(always)]
        fn mask(_: usize) {}
        #[inline(always)]
        unsafe fn get<T: Wide>(p: *const T, (): ()) -> Self {
            // SAFETY: the caller's.
            unsafe { T::load8(p) }
        }
        #[inline(always)]
        unsafe fn put<T: Wide>(p: *mut T, (): (), v: Self) {
            // SAFETY: the caller's.
            unsafe { T::store8(p, v) }
        }
    }

    /// One output row into `acc` (out_w × ch: the bias and the taps, then the residual row
    /// added and the activation, in registers) for 3×3 and 5×5 layers at stride 1 or 2 and
    /// 7×7 at stride 1, without dilation, where `simd` is AVX-512's path (any channel count)
    /// or AVX2's (channels a multiple of 8); `false` (nothing written) otherwise. `input`
    /// holds the tap rows (`None` in the padding), each `width` pixels of `bias.len()`
    /// channels; `w` is (ky, kx, channel). `simd` is the path in use
    /// ([`crate::backend::cpu::simd::simd`]), or for tests one the CPU has.
    pub(super) fn row<I: Lanes + Wide, O: Wide>(
        simd: Simd,
        c: &Conv2d,
        input: &[Option<&[I]>],
        (w, bias): (&[f32], &[f32]),
        acc: &mut [O],
        width: usize,
        (residual, act): (Option<&[O]>, Act),
    ) -> bool {
        let ch = bias.len();
        let k = c.kernel.1;
        let square = c.kernel.0 == k && c.stride.0 == c.stride.1 && c.dilation == (1, 1);
        let wide = matches!(simd, Simd::Avx512 | Simd::Avx512Bf16 | Simd::Amx);
        let narrow = simd == Simd::Avx2Fma && ch.is_multiple_of(8);
        if !(square && (wide || narrow) && matches!((k, c.stride.1), (3 | 5, 1 | 2) | (7, 1))) {
            return false;
        }
        assert!(
            w.len() >= k * k * ch
                && acc.len().is_multiple_of(ch)
                && input.len() == k
                && input.iter().flatten().all(|r| r.len() >= width * ch)
                && residual.is_none_or(|r| r.len() == acc.len()),
            "depthwise: rows, weights and channels disagree"
        );
        let at = ((w, bias), (c.padding.1, width), (residual, act));
        // SAFETY: `simd` is a path the CPU has (AVX-512F, BW and VL; or AVX2 and FMA); the
        // rows, weights and output have the lengths asserted above, and AVX2's blocks are
        // whole.
        unsafe {
            if wide {
                avx512(k, c.stride.1, input, at, acc);
            } else {
                avx2(k, c.stride.1, input, at, acc);
            }
        }
        true
    }

    /// What [`row_k`] takes besides the rows: (weights, bias), (padding, input width),
    /// (residual row, activation).
    type At<'a, O> = (
        (&'a [f32], &'a [f32]),
        (usize, usize),
        (Option<&'a [O]>, Act),
    );

    /// [`row`] in zmm registers, taps a row: 8 pixels a run at stride 1, 4 at stride 2.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and VL; the lengths are as [`row`] asserts; (k, s) is a
    /// shape [`row`] takes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn avx512<I: Lanes + Wide, O: Wide>(
        k: usize,
        s: usize,
        i: &[Option<&[I]>],
        at: At<'_, O>,
        acc: &mut [O],
    ) {
        macro_rules! shapes {
            ($op:expr) => {
                match (k, s) {
                    (3, 1) => row_k::<__m512, I, O, 3, 1, 8, false>(i, at, acc, $op),
                    (5, 1) => row_k::<__m512, I, O, 5, 1, 8, false>(i, at, acc, $op),
                    (7, 1) => row_k::<__m512, I, O, 7, 1, 8, false>(i, at, acc, $op),
                    (3, 2) => row_k::<__m512, I, O, 3, 2, 4, false>(i, at, acc, $op),
                    _ => row_k::<__m512, I, O, 5, 2, 4, false>(i, at, acc, $op),
                }
            };
        }
        // SAFETY: the caller's.
        unsafe { with_vec_act!(at.2.1, activate_vec, |op| shapes!(op)) }
    }

    /// [`row`] in ymm registers. Each shape takes the loop and run length that measured
    /// fastest, single-threaded and interleaved in one process against the
    /// compiler-vectorised [`DepthwiseRow`] on a Zen 3 (f32, rows of 56 down to 7 pixels,
    /// 64 to 120 channels; the ratios are that kernel's time over this one's): 3×3 at stride
    /// 1 taps a row, 6 pixels a run (1.15–1.25×); 5×5 and 7×7 at stride 1 tap by tap, 8
    /// pixels (1.07–2.0×, the gain largest on 7- and 14-pixel rows; 1.09–1.17×); stride 2
    /// taps a row, 4 pixels (3×3 1.0–1.17×, 5×5 1.9–2.2×). Where this CPU's compiler
    /// vectorisation spilled (16 registers hold 4 pixels × 16 channels, or a 5×5 row's
    /// weights, but not both), a ymm of 8 channels leaves room for the accumulators.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; the lengths are as [`row`] asserts, the channels a multiple
    /// of 8; (k, s) is a shape [`row`] takes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<I: Lanes + Wide, O: Wide>(
        k: usize,
        s: usize,
        i: &[Option<&[I]>],
        at: At<'_, O>,
        acc: &mut [O],
    ) {
        macro_rules! shapes {
            ($op:expr) => {
                match (k, s) {
                    (3, 1) => row_k::<__m256, I, O, 3, 1, 6, false>(i, at, acc, $op),
                    (5, 1) => row_k::<__m256, I, O, 5, 1, 8, true>(i, at, acc, $op),
                    (7, 1) => row_k::<__m256, I, O, 7, 1, 8, true>(i, at, acc, $op),
                    (3, 2) => row_k::<__m256, I, O, 3, 2, 4, false>(i, at, acc, $op),
                    _ => row_k::<__m256, I, O, 5, 2, 4, false>(i, at, acc, $op),
                }
            };
        }
        // SAFETY: the caller's.
        unsafe { with_vec_act!(at.2.1, activate_vec, |op| shapes!(op)) }
    }

    /// [`row`] for K taps a row at stride S, P output pixels a run, in registers `V`, tap
    /// by tap where `BY_TAP` (see [`sums`]): the channels in groups whose share of a run's
    /// input fits [`RUN_BYTES`], each group along the whole row; runs that read no padding
    /// unchecked; each sum finished with its residual, then `op` (the activation).
    ///
    /// # Safety
    /// The CPU has `V`'s instruction set; the lengths are as [`row`] asserts (and the
    /// channels whole blocks where `V`'s mask cannot cut one).
    #[inline(always)]
    unsafe fn row_k<
        V: Reg,
        I: Lanes + Wide,
        O: Wide,
        const K: usize,
        const S: usize,
        const P: usize,
        const BY_TAP: bool,
    >(
        input: &[Option<&[I]>],
        ((w, bias), (pad, width), (residual, _)): At<'_, O>,
        acc: &mut [O],
        op: impl Fn(V) -> V,
    ) {
        let ch = bias.len();
        let out_w = acc.len() / ch;
        let span = (P - 1) * S + K;
        let lanes = V::LANES;
        let group = (RUN_BYTES / (span * K * size_of::<I>()) / lanes * lanes).max(lanes);
        // Output pixels lo..hi read no padding: ox·S ≥ pad and ox·S + K − 1 − pad < width.
        let lo = pad.div_ceil(S).min(out_w);
        let hi = if width + pad >= K {
            ((width + pad - K) / S + 1).clamp(lo, out_w)
        } else {
            lo
        };
        for c_lo in (0..ch).step_by(group) {
            for ox0 in (0..out_w).step_by(P) {
                let valid = P.min(out_w - ox0);
                let x0 = (ox0 * S) as isize - pad as isize;
                let inside = ox0 >= lo && ox0 + P <= hi;
                for c0 in (c_lo..(c_lo + group).min(ch)).step_by(lanes) {
                    let mask = V::mask(ch - c0);
                    let at = (x0, width, ch, c0, mask);
                    // SAFETY: the caller's; every load and store is of the block's channels
                    // and, outside `inside` runs, checked against the row's width.
                    unsafe {
                        let sums = if inside {
                            sums::<V, I, K, S, P, false, BY_TAP>(input, w, bias, at)
                        } else {
                            sums::<V, I, K, S, P, true, BY_TAP>(input, w, bias, at)
                        };
                        for (p, v) in sums.iter().enumerate().take(valid) {
                            let at = (ox0 + p) * ch + c0;
                            let v = match residual {
                                Some(r) => v.add(V::get(r.as_ptr().add(at), mask)),
                                None => *v,
                            };
                            V::put(acc.as_mut_ptr().add(at), mask, op(v));
                        }
                    }
                }
            }
        }
    }

    /// The sums of P output pixels (from input column x0) for the `mask`ed channels from c0:
    /// the bias, then tap row by tap row each input pixel times the weights of the taps it is
    /// for (or with `BY_TAP`, away from the edges, tap by tap: every accumulator's FMAs come
    /// in the same order either way); with `EDGE`, pixels outside the image are skipped.
    ///
    /// # Safety
    /// As for [`row_k`]; without `EDGE`, input columns x0..x0 + (P − 1)·S + K are inside the
    /// rows.
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    unsafe fn sums<
        V: Reg,
        I: Lanes + Wide,
        const K: usize,
        const S: usize,
        const P: usize,
        const EDGE: bool,
        const BY_TAP: bool,
    >(
        input: &[Option<&[I]>],
        w: &[f32],
        bias: &[f32],
        (x0, width, ch, c0, mask): (isize, usize, usize, usize, V::Mask),
    ) -> [V; P] {
        // SAFETY: the caller's (loads of the block's channels inside the rows and weights).
        unsafe {
            let mut acc = [V::get(bias.as_ptr().add(c0), mask); P];
            for (ky, row) in input.iter().enumerate() {
                let Some(row) = row else { continue };
                if BY_TAP && !EDGE && I::IS_F32 {
                    // Tap by tap (where the run reads no padding, from f32): each input pixel
                    // loaded for each tap that reads it, as an FMA's memory operand, over a
                    // tap count the compiler does not know. Over the taps unrolled, the
                    // compiler merged those loads back into one per pixel, hoisted them all
                    // ahead of the FMAs, and spilled the accumulators out of AVX2's 16
                    // registers and the pixels' offsets out of the general ones (5×5 layers
                    // 1.5× slower than the compiler-vectorised kernel). At the edges each
                    // pixel's check is made once a tap row, below. bf16 pixels take a widening
                    // each, so they are loaded once a tap row too (not measured apart).
                    for kx in 0..std::hint::black_box(K) {
                        let wv = V::get(w.as_ptr().add((ky * K + kx) * ch + c0), mask);
                        for (p, acc) in acc.iter_mut().enumerate() {
                            let ix = x0 + (p * S + kx) as isize;
                            let x = V::get(row.as_ptr().add(ix as usize * ch + c0), mask);
                            *acc = x.fmadd(wv, *acc);
                        }
                    }
                    continue;
                }
                let wk: [V; K] =
                    std::array::from_fn(|kx| V::get(w.as_ptr().add((ky * K + kx) * ch + c0), mask));
                for j in 0..(P - 1) * S + K {
                    let ix = x0 + j as isize;
                    if EDGE && (ix < 0 || ix as usize >= width) {
                        continue;
                    }
                    let x = V::get(row.as_ptr().add(ix as usize * ch + c0), mask);
                    for (p, acc) in acc.iter_mut().enumerate() {
                        // Input pixel j is tap j − p·S of output pixel p.
                        if j >= p * S && j - p * S < K {
                            *acc = x.fmadd(wk[j - p * S], *acc);
                        }
                    }
                }
            }
            acc
        }
    }
}

/// BF16 depthwise layers on `vdpbf16ps` where the CPU has it: two tap rows at a time. Each
/// input pixel's 16 channels from tap rows ky and ky + 1 become 16 bf16 pairs (one widening
/// and an OR, as many instructions as widening the two rows for FMAs), and one `vdpbf16ps`
/// multiplies a pair of taps into each channel's sum where two FMAs did: a 3×3 layer is 3 of
/// them and 3 FMAs (the odd last row) per output pixel instead of 9 FMAs, a 5×5 one 10 and 5
/// instead of 25. The sums stay f32 (each pair's two products are exact; their sum is rounded
/// once, as the FMAs rounded each) and get the same epilogue as [`Finish`]'s, applied in
/// registers (`bf16_gemm::store_finished`).
#[cfg(target_arch = "x86_64")]
pub(super) use pairs::Pairs;

/// No pairs off x86-64: [`Pairs::new`] always says `None`.
#[cfg(not(target_arch = "x86_64"))]
pub(super) enum Pairs {}

#[cfg(not(target_arch = "x86_64"))]
impl Pairs {
    pub(super) fn new(_: &Conv2d, _: &[f32]) -> Option<Pairs> {
        None
    }

    pub(super) fn bytes(&self) -> u64 {
        match *self {}
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        _: &Conv2d,
        _: &[f32],
        _: &[bf16],
        _: Nhwc,
        _: &mut [bf16],
        _: Nhwc,
        _: Option<&[bf16]>,
        _: Act,
    ) {
        match *self {}
    }

    pub(super) fn output_row(
        &self,
        _: &[Option<&[bf16]>],
        _: &[f32],
        _: &mut [bf16],
        _: (Option<&[bf16]>, Act),
        _: (usize, usize),
    ) {
        match *self {}
    }
}

#[cfg(target_arch = "x86_64")]
mod pairs {
    use std::arch::x86_64::*;

    use half::bf16 as Bf16;
    use rayon::prelude::*;

    use super::super::Nhwc;
    use super::{RUN_BYTES, tap_rows};
    use crate::backend::cpu::bf16_gemm::store_finished;
    use crate::backend::cpu::elem::f32_bf16;
    use crate::model::op::{Act, Conv2d};

    /// Channels per block: one zmm of f32 sums, one of bf16 pairs.
    const BLOCK: usize = 16;

    thread_local! {
        /// Per-worker staged rows of [`Pairs::staged`].
        static STAGED: std::cell::RefCell<Vec<__m512i>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// A layer's weights as pairs of tap rows: for row pair r, tap kx and channel c, the bf16
    /// weights of rows 2r and 2r + 1 in one 32-bit lane (channels padded to 16); an odd last
    /// row's weights in f32.
    pub(in super::super) struct Pairs {
        k: usize,
        stride: usize,
        padded: usize,
        pairs: Vec<u32>,
        last: Vec<f32>,
    }

    impl Pairs {
        /// The pairs of a 3×3 or 5×5 layer at stride 1 or 2, or a 7×7 one at stride 1, without
        /// dilation, where this CPU
        /// multiplies bf16 pairs (`None` otherwise). `w` is (ky, kx, channel) f32, each value
        /// a bf16 (the BF16 session's weights).
        pub(in super::super) fn new(c: &Conv2d, w: &[f32]) -> Option<Pairs> {
            let k = c.kernel.0;
            let stride = c.stride.0;
            let shape = c.kernel.1 == k && c.stride.1 == stride && c.dilation == (1, 1);
            let strides = matches!((k, stride), (3 | 5, 1 | 2) | (7, 1));
            let cpu = crate::backend::cpu::bf16_gemm::Engine::in_use().is_some()
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl");
            if !(shape && strides && cpu) {
                return None;
            }
            let ch = c.out_channels;
            let padded = ch.next_multiple_of(BLOCK);
            let tap = |ky: usize, kx: usize, c: usize| w[(ky * k + kx) * ch + c];
            let mut pairs = vec![0u32; k / 2 * k * padded];
            for (i, v) in pairs.iter_mut().enumerate() {
                let (r, kx, c) = (i / (k * padded), i / padded % k, i % padded);
                if c < ch {
                    let (lo, hi) = (f32_bf16(tap(2 * r, kx, c)), f32_bf16(tap(2 * r + 1, kx, c)));
                    *v = lo.to_bits() as u32 | (hi.to_bits() as u32) << 16;
                }
            }
            let mut last = vec![0f32; k * padded];
            for (i, v) in last.iter_mut().enumerate() {
                let (kx, c) = (i / padded, i % padded);
                if c < ch {
                    *v = tap(k - 1, kx, c);
                }
            }
            Some(Pairs {
                k,
                stride,
                padded,
                pairs,
                last,
            })
        }

        /// The packed weights' bytes.
        pub(in super::super) fn bytes(&self) -> u64 {
            (self.pairs.len() * 4 + self.last.len() * 4) as u64
        }

        /// The layer `x` (xs) → `y` (ys), bf16 NHWC, with `bias`, `residual` and `act`: rows in
        /// parallel, each run of sums finished in registers and stored
        /// (`bf16_gemm::store_finished`).
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) fn run(
            &self,
            c: &Conv2d,
            bias: &[f32],
            x: &[Bf16],
            xs: Nhwc,
            y: &mut [Bf16],
            ys: Nhwc,
            residual: Option<&[Bf16]>,
            act: Act,
        ) {
            let row_len = ys.w * ys.c;
            assert!(
                bias.len() == ys.c && xs.c == ys.c,
                "depthwise: channels differ"
            );
            y.par_chunks_mut(row_len)
                .enumerate()
                .for_each(|(row, out)| {
                    let input = tap_rows(c, x, xs, row / ys.h, row % ys.h);
                    let residual = residual.map(|r| &r[row * row_len..][..row_len]);
                    self.output_row(&input, bias, out, (residual, act), (xs.w, c.padding.1));
                });
        }

        /// One output row into `out` (bf16, its pixels × `bias.len()` channels) from the
        /// kernel's tap rows (`None` where a row is padding), each `width` pixels wide,
        /// padded by `pad` pixels left and right; `fin`: the residual row (as long as `out`)
        /// and the activation. [`Pairs::run`]'s rows, and a fused pair's from its band.
        pub(in super::super) fn output_row(
            &self,
            input: &[Option<&[Bf16]>],
            bias: &[f32],
            out: &mut [Bf16],
            fin: (Option<&[Bf16]>, Act),
            at: (usize, usize),
        ) {
            let ch = bias.len();
            // The output row is as wide as the layer makes from `width` and `pad`.
            let out_w = (at.0 + 2 * at.1)
                .checked_sub(self.k)
                .map(|span| span / self.stride + 1);
            assert!(
                input.len() == self.k
                    && input.iter().flatten().all(|r| r.len() == at.0 * ch)
                    && out_w.map(|w| w * ch) == Some(out.len())
                    && fin.0.is_none_or(|r| r.len() == out.len()),
                "depthwise: rows do not fit the layer"
            );
            // SAFETY: `new` checked that the CPU has AVX-512F, BW, VL and AVX512_BF16; the
            // rows' lengths are checked above.
            unsafe {
                match (self.k, self.stride) {
                    (3, 1) => self.row::<3, 1>(input, bias, out, fin, at),
                    (3, 2) => self.row::<3, 2>(input, bias, out, fin, at),
                    (5, 1) => self.row::<5, 1>(input, bias, out, fin, at),
                    (5, 2) => self.row::<5, 2>(input, bias, out, fin, at),
                    _ => self.row::<7, 1>(input, bias, out, fin, at),
                }
            }
        }

        /// One output row into `out` (bf16, out_w × ch): runs of P output pixels (8 at
        /// stride 1, 4 at 2), their channels in groups whose input fits [`RUN_BYTES`], 16 at
        /// a time (a masked last block), as the f32 kernels go; each run's sums finished in
        /// registers (`bf16_gemm::store_finished`). Written to an f32 row first and finished
        /// by [`Finish`]'s three passes over it, MobileNetV3's 16-channel 3×3 layer at 112²
        /// spent half as long again in the passes as in its sums.
        ///
        /// # Safety
        /// The CPU has AVX-512F, BW, VL and AVX512_BF16; each input row holds `width` pixels
        /// of `bias.len()` channels; the residual row (if any) is as long as `out`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
        unsafe fn row<const K: usize, const S: usize>(
            &self,
            input: &[Option<&[Bf16]>],
            bias: &[f32],
            out: &mut [Bf16],
            fin: (Option<&[Bf16]>, Act),
            at: (usize, usize),
        ) {
            // SAFETY: forwarded.
            unsafe {
                // One block of channels: staged rows (MobileNetV3-Large's 16-channel 3×3
                // layer alone at 112², batch 8: 0.65–0.69× the time of the runs below, 400
                // steps alternating in one process); more: the runs, which went 4% faster at
                // 32 channels and stay in L1 by channel groups.
                match (S == 1, bias.len() <= BLOCK) {
                    (true, false) => self.runs::<K, S, 8>(input, bias, out, fin, at),
                    (false, false) => self.runs::<K, S, 4>(input, bias, out, fin, at),
                    (true, true) => self.staged::<K, S, 8>(input, bias, out, fin, at),
                    (false, true) => self.staged::<K, S, 4>(input, bias, out, fin, at),
                }
            }
        }

        /// [`Pairs::row`] from staged rows: for each block of 16 channels, each pair of tap
        /// rows is first made into one row of bf16 pairs (64 bytes a pixel) and an odd last
        /// row widened to f32, both in a per-worker buffer with the padding's zeros in place;
        /// the runs of P output pixels then read their input pixels from it at fixed offsets,
        /// one pointer per staged row, no check per pixel. Each input pixel is made into
        /// pairs once, where the runs made the (P − 1)·S + K pixels of each run; the same
        /// sums in the same order, so the same values.
        ///
        /// # Safety
        /// As for [`Pairs::row`].
        #[inline(always)]
        unsafe fn staged<const K: usize, const S: usize, const P: usize>(
            &self,
            input: &[Option<&[Bf16]>],
            bias: &[f32],
            out: &mut [Bf16],
            (residual, act): (Option<&[Bf16]>, Act),
            (width, pad): (usize, usize),
        ) {
            let ch = bias.len();
            let out_w = out.len() / ch;
            // Staged columns: every run whole (the last one's extra outputs are not stored).
            let cols = (out_w.div_ceil(P) * P - 1) * S + K;
            let staged_rows = K / 2 + K % 2;
            let present: [bool; K] = std::array::from_fn(|k| input[k].is_some());
            // Taken out of its cell, and put back, rather than borrowed in a closure: a
            // closure would not have this function's target features.
            let mut staged = STAGED.take();
            // SAFETY: zeros, on a CPU with AVX-512F (the caller's).
            staged.resize(staged_rows * cols, unsafe { _mm512_setzero_si512() });
            let buf = staged.as_mut_ptr();
            for c0 in (0..ch).step_by(BLOCK) {
                let mask = (u32::MAX >> (32 - (ch - c0).min(BLOCK))) as __mmask16;
                // SAFETY: the caller's; loads are masked to the channels, the buffer
                // holds staged_rows × cols vectors.
                unsafe {
                    let load = |row: Option<&[Bf16]>, ix: usize| match row {
                        Some(r) => _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                            mask,
                            r.as_ptr().add(ix * ch + c0).cast(),
                        )),
                        None => _mm512_setzero_si512(),
                    };
                    // Column x of a staged row is input column x − pad.
                    let inside = pad..(pad + width).min(cols);
                    for r in 0..staged_rows {
                        let row = buf.add(r * cols);
                        let (a, b) = (input[2 * r], input.get(2 * r + 1).copied().flatten());
                        let odd = 2 * r + 1 == K;
                        if a.is_none() && b.is_none() {
                            continue;
                        }
                        for x in (0..inside.start).chain(inside.end..cols) {
                            *row.add(x) = _mm512_setzero_si512();
                        }
                        for x in inside.clone() {
                            let lo = load(a, x - pad);
                            *row.add(x) = if odd {
                                _mm512_slli_epi32::<16>(lo)
                            } else {
                                _mm512_or_si512(lo, _mm512_slli_epi32::<16>(load(b, x - pad)))
                            };
                        }
                    }
                    // Staged row r's taps: pairs of tap rows 2r and 2r + 1, or the odd
                    // last row's f32 weights (as bits); rows past the staged ones unused.
                    // Loops, not `array::from_fn`: its closures are compiled apart from this
                    // function's target features, and at K 5 and 7 their loads were calls.
                    let mut w = [[_mm512_setzero_si512(); K]; K];
                    for (r, taps) in w.iter_mut().enumerate().take(staged_rows) {
                        for (kx, t) in taps.iter_mut().enumerate() {
                            *t = if r < K / 2 {
                                let at = (r * K + kx) * self.padded + c0;
                                _mm512_loadu_si512(self.pairs.as_ptr().add(at).cast())
                            } else {
                                let at = kx * self.padded + c0;
                                _mm512_loadu_si512(self.last.as_ptr().add(at).cast())
                            };
                        }
                    }
                    let b0 = _mm512_maskz_loadu_ps(mask, bias.as_ptr().add(c0));
                    for ox0 in (0..out_w).step_by(P) {
                        let mut acc = [b0; P];
                        for r in 0..staged_rows {
                            let odd = 2 * r + 1 == K;
                            if !present[2 * r] && (odd || !present[2 * r + 1]) {
                                continue;
                            }
                            let row = buf.add(r * cols + ox0 * S);
                            for j in 0..(P - 1) * S + K {
                                let xv = *row.add(j);
                                for (p, acc) in acc.iter_mut().enumerate() {
                                    // Input pixel j is tap j − p·S of output pixel p.
                                    if j >= p * S && j - p * S < K {
                                        let wk = w[r][j - p * S];
                                        *acc = if odd {
                                            _mm512_fmadd_ps(
                                                _mm512_castsi512_ps(xv),
                                                _mm512_castsi512_ps(wk),
                                                *acc,
                                            )
                                        } else {
                                            _mm512_dpbf16_ps(
                                                *acc,
                                                std::mem::transmute::<__m512i, __m512bh>(xv),
                                                std::mem::transmute::<__m512i, __m512bh>(wk),
                                            )
                                        };
                                    }
                                }
                            }
                        }
                        for (p, acc) in acc.iter().enumerate().take(out_w - ox0) {
                            let at = (ox0 + p) * ch + c0;
                            let res = residual.map(|r| r.as_ptr().add(at));
                            store_finished(*acc, res, act, out.as_mut_ptr().add(at), mask);
                        }
                    }
                }
            }
            STAGED.set(staged);
        }

        /// [`Pairs::row`] in runs of P output pixels.
        ///
        /// # Safety
        /// As for [`Pairs::row`].
        #[inline(always)]
        unsafe fn runs<const K: usize, const S: usize, const P: usize>(
            &self,
            input: &[Option<&[Bf16]>],
            bias: &[f32],
            out: &mut [Bf16],
            (residual, act): (Option<&[Bf16]>, Act),
            (width, pad): (usize, usize),
        ) {
            let ch = bias.len();
            let out_w = out.len() / ch;
            let run_pixels = (P - 1) * S + K;
            let group = (RUN_BYTES / (run_pixels * K * 2) / BLOCK * BLOCK).max(BLOCK);
            // Every tap row inside the image: the runs inside it too read their pixels
            // without a check ([`Pairs::inside`]).
            let rows: Option<[*const Bf16; K]> = (input.iter().all(Option::is_some)).then(|| {
                std::array::from_fn(|k| input[k].map_or(std::ptr::null(), |r| r.as_ptr()))
            });
            for c_lo in (0..ch).step_by(group) {
                for ox0 in (0..out_w).step_by(P) {
                    let valid = P.min(out_w - ox0);
                    let x0 = (ox0 * S) as isize - pad as isize;
                    let inside = rows.filter(|_| x0 >= 0 && x0 as usize + run_pixels <= width);
                    for c0 in (c_lo..(c_lo + group).min(ch)).step_by(BLOCK) {
                        let mask = (u32::MAX >> (32 - (ch - c0).min(BLOCK))) as __mmask16;
                        // SAFETY: the caller's; loads and stores are masked to the channels.
                        unsafe {
                            let acc = match inside {
                                Some(rows) => {
                                    let at = x0 as usize * ch + c0;
                                    self.inside::<K, S, P>(
                                        rows.map(|r| r.add(at)),
                                        bias,
                                        ch,
                                        c0,
                                        mask,
                                    )
                                }
                                None => {
                                    self.sums::<K, S, P>(input, bias, (x0, width, ch), c0, mask)
                                }
                            };
                            for (p, acc) in acc.iter().enumerate().take(valid) {
                                let at = (ox0 + p) * ch + c0;
                                let res = residual.map(|r| r.as_ptr().add(at));
                                let to = out.as_mut_ptr().add(at);
                                store_finished(*acc, res, act, to, mask);
                            }
                        }
                    }
                }
            }
        }

        /// [`Pairs::sums`] where every tap row and input pixel of the run is inside the
        /// image: `rows[ky]` points to the run's first input pixel's channel c0 in tap row
        /// ky, and nothing is checked per pixel. With the checks the compiler kept a flag and
        /// a pointer per pixel and tap row on the stack, set afresh for every run: the 3×3
        /// and 5×5 layers of 72–240 channels at 28² and 56², strides 1 and 2, took 0.91–0.94×
        /// the time without them (alone, batch 8, 300–400 steps alternating in one process;
        /// 672 channels at 14², whose rows are two runs, the same).
        ///
        /// # Safety
        /// As for [`Pairs::row`]; the run's (P − 1)·S + K pixels from `rows` are inside
        /// their rows.
        #[inline(always)]
        unsafe fn inside<const K: usize, const S: usize, const P: usize>(
            &self,
            rows: [*const Bf16; K],
            bias: &[f32],
            ch: usize,
            c0: usize,
            mask: __mmask16,
        ) -> [__m512; P] {
            // SAFETY: the caller's (masked loads inside the rows and weights).
            unsafe {
                let load = |row: *const Bf16, j: usize| {
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, row.add(j * ch).cast()))
                };
                let mut acc = [_mm512_maskz_loadu_ps(mask, bias.as_ptr().add(c0)); P];
                for r in 0..K / 2 {
                    let (a, b) = (rows[2 * r], rows[2 * r + 1]);
                    let w: [__m512bh; K] = std::array::from_fn(|kx| {
                        let at = (r * K + kx) * self.padded + c0;
                        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                            self.pairs.as_ptr().add(at).cast(),
                        ))
                    });
                    for j in 0..(P - 1) * S + K {
                        let xv = _mm512_or_si512(load(a, j), _mm512_slli_epi32::<16>(load(b, j)));
                        let xp = std::mem::transmute::<__m512i, __m512bh>(xv);
                        for (p, acc) in acc.iter_mut().enumerate() {
                            // Input pixel j is tap j − p·S of output pixel p.
                            if j >= p * S && j - p * S < K {
                                *acc = _mm512_dpbf16_ps(*acc, xp, w[j - p * S]);
                            }
                        }
                    }
                }
                if K % 2 == 1 {
                    let w: [__m512; K] = std::array::from_fn(|kx| {
                        _mm512_loadu_ps(self.last.as_ptr().add(kx * self.padded + c0))
                    });
                    for j in 0..(P - 1) * S + K {
                        let xv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(load(rows[K - 1], j)));
                        for (p, acc) in acc.iter_mut().enumerate() {
                            if j >= p * S && j - p * S < K {
                                *acc = _mm512_fmadd_ps(xv, w[j - p * S], *acc);
                            }
                        }
                    }
                }
                acc
            }
        }

        /// The sums of P output pixels (from input column x0) for channels c0.. (the
        /// `mask`ed ones): the bias, each pair of tap rows by `vdpbf16ps`, an odd last row
        /// by FMAs; input pixels outside the image read as zeros. Each input pixel (pair) is
        /// made once per tap row (pair) and multiplied at once into every output pixel it
        /// reaches.
        ///
        /// # Safety
        /// As for [`Pairs::row`].
        #[inline(always)]
        unsafe fn sums<const K: usize, const S: usize, const P: usize>(
            &self,
            input: &[Option<&[Bf16]>],
            bias: &[f32],
            (x0, width, ch): (isize, usize, usize),
            c0: usize,
            mask: __mmask16,
        ) -> [__m512; P] {
            // SAFETY: the caller's (masked loads inside the rows and weights).
            unsafe {
                let load = |row: Option<&[Bf16]>, ix: isize| match row {
                    Some(r) if ix >= 0 && (ix as usize) < width => {
                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                            mask,
                            r.as_ptr().add(ix as usize * ch + c0).cast(),
                        ))
                    }
                    _ => _mm512_setzero_si512(),
                };
                let mut acc = [_mm512_maskz_loadu_ps(mask, bias.as_ptr().add(c0)); P];
                for r in 0..K / 2 {
                    let (a, b) = (input[2 * r], input[2 * r + 1]);
                    if a.is_none() && b.is_none() {
                        continue;
                    }
                    let mut w = [_mm512_setzero_si512(); K];
                    for (kx, w) in w.iter_mut().enumerate() {
                        let at = (r * K + kx) * self.padded + c0;
                        *w = _mm512_loadu_si512(self.pairs.as_ptr().add(at).cast());
                    }
                    for j in 0..(P - 1) * S + K {
                        let ix = x0 + j as isize;
                        let xv = _mm512_or_si512(load(a, ix), _mm512_slli_epi32::<16>(load(b, ix)));
                        let xp = std::mem::transmute::<__m512i, __m512bh>(xv);
                        for (p, acc) in acc.iter_mut().enumerate() {
                            // Input pixel j is tap j − p·S of output pixel p.
                            if j >= p * S && j - p * S < K {
                                let wp = std::mem::transmute::<__m512i, __m512bh>(w[j - p * S]);
                                *acc = _mm512_dpbf16_ps(*acc, xp, wp);
                            }
                        }
                    }
                }
                if K % 2 == 1
                    && let Some(row) = input[K - 1]
                {
                    let mut w = [_mm512_setzero_ps(); K];
                    for (kx, w) in w.iter_mut().enumerate() {
                        *w = _mm512_loadu_ps(self.last.as_ptr().add(kx * self.padded + c0));
                    }
                    for j in 0..(P - 1) * S + K {
                        let xv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(load(
                            Some(row),
                            x0 + j as isize,
                        )));
                        for (p, acc) in acc.iter_mut().enumerate() {
                            if j >= p * S && j - p * S < K {
                                *acc = _mm512_fmadd_ps(xv, w[j - p * S], *acc);
                            }
                        }
                    }
                }
                acc
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The intrinsics kernels (AVX-512's and AVX2's, each where the CPU has it, whichever path
    /// is in use) against the compiler-vectorised one and [`Finish`], row by row, bit for bit,
    /// with and without a residual, under several activations: every shape they take (3×3
    /// and 5×5 at strides 1 and 2, 7×7 at 1) with padding 0 to 3, rows narrower than a run,
    /// widths that leave short last runs, channel counts below, at and past a block (AVX-512's
    /// masked last blocks; AVX2 declines channel counts that are not a multiple of 8), and tap
    /// rows in the padding. Where the CPU has neither it says so and checks nothing.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn intrinsics_rows_match_the_vectorised_kernel() {
        use crate::backend::cpu::simd::Simd;
        let mut paths = Vec::new();
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
        {
            paths.push(Simd::Avx512);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            paths.push(Simd::Avx2Fma);
        }
        if paths.is_empty() {
            eprintln!(
                "neither AVX-512 nor AVX2 here: the intrinsics depthwise rows are not exercised"
            );
        }
        for path in paths {
            intrinsics_rows_on(path);
        }
    }

    /// [`intrinsics_rows_match_the_vectorised_kernel`] on one path.
    #[cfg(target_arch = "x86_64")]
    fn intrinsics_rows_on(path: crate::backend::cpu::simd::Simd) {
        use crate::backend::cpu::simd::{Simd, simd};
        // The reference's activation is the one of the path in use: the long ones
        // (SiLU, GELU) are each path's own, so they are compared where that path has this
        // one's width (the others, clamps and products, are the same on every path).
        let in_use = simd();
        let same_width = in_use.has_avx2() && (in_use >= Simd::Avx512) == (path >= Simd::Avx512);
        let cases = [
            // (channels, kernel, stride, padding, h, w)
            (16, 3, 1, 1, 5, 19),
            (72, 3, 1, 1, 4, 9),
            (5, 3, 1, 0, 4, 3),
            (40, 5, 1, 2, 6, 14),
            (33, 5, 1, 2, 5, 7),
            (24, 7, 1, 3, 8, 10),
            (17, 3, 2, 1, 5, 13),
            (240, 3, 2, 1, 4, 8),
            (72, 5, 2, 2, 6, 11),
            (8, 5, 2, 0, 7, 9),
        ];
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        let acts = [
            Act::None,
            Act::Relu,
            Act::Hardswish,
            Act::Silu,
            Act::Gelu,
            Act::Relu6,
        ];
        for (case, (ch, k, st, pad, h, w)) in cases.into_iter().enumerate() {
            let c = Conv2d::new(ch, ch, k, st, pad).with_groups(ch);
            let act = match acts[case % acts.len()] {
                act if super::super::activation::long(act) && !same_width => Act::Hardswish,
                act => act,
            };
            let xs = Nhwc { n: 1, h, w, c: ch };
            let (oh, ow) = ((h + 2 * pad - k) / st + 1, (w + 2 * pad - k) / st + 1);
            let x: Vec<f32> = (0..xs.elems()).map(value).collect();
            let wt: Vec<f32> = (0..k * k * ch).map(|i| value(i * 7 + 1) / 4.0).collect();
            let bias: Vec<f32> = (0..ch).map(|i| i as f32 / 16.0 - 1.0).collect();
            for oy in 0..oh {
                let input = tap_rows(&c, &x, xs, 0, oy);
                // A residual row on every other case.
                let res: Vec<f32> = (0..ow * ch).map(|i| value(i + oy * 3)).collect();
                let res = (case % 2 == 1).then_some(&res[..]);
                let mut got = vec![f32::NAN; ow * ch];
                let took = regs::row(path, &c, &input, (&wt, &bias), &mut got, w, (res, act));
                let declines = path == Simd::Avx2Fma && ch % 8 != 0;
                assert_eq!(
                    took, !declines,
                    "{path:?}, {ch} channels {k}×{k} stride {st}"
                );
                if declines {
                    continue;
                }
                let mut want = vec![f32::NAN; ow * ch];
                with_simd(DepthwiseRow {
                    acc: &mut want,
                    input: &input,
                    w: &wt,
                    bias: &bias,
                    c: &c,
                    width: w,
                });
                with_simd(Finish::<f32> {
                    values: &mut want,
                    residual: res,
                    act,
                    out: None,
                });
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        e.to_bits(),
                        "{path:?}, {ch} channels {k}×{k} stride {st} pad {pad}, {h}×{w}, {act:?}: \
                         row {oy} value {i}: {g} against {e}"
                    );
                }
                // bf16 storage: read and written by the same kernel in place, against the
                // vectorised kernel's f32 row finished and narrowed.
                let x16: Vec<bf16> = x.iter().map(|&v| f32_bf16(v)).collect();
                let res16: Option<Vec<bf16>> =
                    res.map(|r| r.iter().map(|&v| f32_bf16(v)).collect());
                let input16 = tap_rows(&c, &x16, xs, 0, oy);
                let mut got16 = vec![bf16::NAN; ow * ch];
                assert!(regs::row(
                    path,
                    &c,
                    &input16,
                    (&wt, &bias),
                    &mut got16,
                    w,
                    (res16.as_deref(), act)
                ));
                let mut wide = vec![f32::NAN; ow * ch];
                let mut want16 = vec![bf16::NAN; ow * ch];
                with_simd(DepthwiseRow {
                    acc: &mut wide,
                    input: &input16,
                    w: &wt,
                    bias: &bias,
                    c: &c,
                    width: w,
                });
                with_simd(Finish::<bf16> {
                    values: &mut wide,
                    residual: res16.as_deref(),
                    act,
                    out: Some(&mut want16),
                });
                for (i, (g, e)) in got16.iter().zip(&want16).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        e.to_bits(),
                        "{path:?} bf16, {ch} channels {k}×{k} stride {st} pad {pad}, {h}×{w}, {act:?}: \
                         row {oy} value {i}: {g} against {e}"
                    );
                }
            }
        }
    }

    /// A pointwise layer and the depthwise layer after it, fused, give the pair's results run
    /// apart bit for bit, in FP32, BF16 (where it widens) and FP16: every band height from one
    /// output row to the whole image, 3×3 and 5×5 taps at strides 1 and 2, padding 0 to 2
    /// (bands whose taps reach above and below the image), channel counts that leave a half
    /// panel and a masked last block, K below and above the small-K kernel's reach,
    /// activations on either layer or neither; in BF16 where it multiplies pairs, the
    /// depthwise layer on both its kernels. With the depthwise output projected too (by a 1×1
    /// layer with and without a residual, to channel counts that leave half panels), after
    /// the pointwise layer and without one, on f32 rows or on bf16 pairs.
    #[test]
    fn fused_pairs_match_the_layers_apart() {
        /// Returns how many cases fused on bf16 pairs.
        fn check<T: Elem>() -> usize {
            let mut on_pair_kernels = 0;
            let cases = [
                // (in, mid, kernel, stride, padding, h, w, batch)
                (16, 64, 3, 2, 1, 12, 10, 2),
                (24, 72, 3, 1, 1, 9, 7, 1),
                (40, 120, 5, 1, 2, 8, 9, 2),
                (8, 40, 5, 2, 2, 11, 6, 1),
                (80, 24, 3, 1, 0, 7, 8, 3),
                (3, 17, 3, 2, 0, 9, 9, 1),
            ];
            let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
            let acts = [
                (Act::Relu, Act::None),
                (Act::Hardswish, Act::Hardswish),
                (Act::Silu, Act::Silu),
                (Act::None, Act::Relu),
                (Act::Relu6, Act::Gelu),
                (Act::None, Act::None),
            ];
            for (case, (cin, cmid, k, st, pad, h, w, n)) in cases.into_iter().enumerate() {
                let (act_pw, act_dw) = acts[case % acts.len()];
                let pw_conv = Conv2d {
                    act: act_pw,
                    ..Conv2d::new(cin, cmid, 1, 1, 0).with_bias()
                };
                let dw_conv = Conv2d {
                    act: act_dw,
                    ..Conv2d::new(cmid, cmid, k, st, pad)
                        .with_groups(cmid)
                        .with_bias()
                };
                let pw_w: Vec<f32> = (0..cin * cmid).map(|i| value(i * 3 + 2) / 8.0).collect();
                let dw_w: Vec<f32> = (0..k * k * cmid).map(|i| value(i * 7 + 1) / 4.0).collect();
                let bias: Vec<f32> = (0..cmid).map(|i| i as f32 / 64.0 - 0.5).collect();
                let pw = PackedConv::<T>::new(pw_conv, &pw_w, Some(&bias));
                // The depthwise layer on the kernel this CPU picks for it and, where it
                // multiplies pairs at all, on the other one too: BF16 depthwise layers take
                // the FMA kernel where `vdpbf16ps` is slow (`simd::depthwise_pairs`).
                let dw = PackedConv::<T>::new(dw_conv, &dw_w, Some(&bias));
                let mut other = PackedConv::<T>::new(dw_conv, &dw_w, Some(&bias));
                other.depthwise_pairs = match &dw.depthwise_pairs {
                    Some(_) => None,
                    None => Pairs::new(&dw_conv, &dw.depthwise.as_ref().unwrap().0).map(Box::new),
                };
                let both = pw.pairs.is_some()
                    && other.depthwise_pairs.is_some() != dw.depthwise_pairs.is_some();
                for dw in std::iter::once(&dw).chain(both.then_some(&other)) {
                    // BF16 on bf16 pairs (AMX, AVX512_BF16 where it pays) fuses where the 1×1
                    // layer multiplies pairs (not the one over 3 channels: it runs as a stem), the
                    // depthwise layer on either kernel.
                    let on_pairs = dw.depthwise_pairs.is_some();
                    if !can_pair(&pw, dw) {
                        assert!(
                            T::PRECISION == crate::model::Precision::Bf16
                                && (pw.pairs.is_none() && on_pairs || cin < 8),
                            "{cin} → {cmid}"
                        );
                        continue;
                    }
                    on_pair_kernels += usize::from(pw.pairs.is_some());
                    let xs = Nhwc { n, h, w, c: cin };
                    let ms = Nhwc { c: cmid, ..xs };
                    let (oh, ow) = dw_conv.output_hw(h, w).unwrap();
                    let ys = Nhwc {
                        n,
                        h: oh,
                        w: ow,
                        c: cmid,
                    };
                    let x: Vec<T> = (0..xs.elems()).map(|i| T::from_f32(value(i))).collect();
                    let mut mid = vec![T::from_f32(0.0); ms.elems()];
                    let mut want = vec![T::from_f32(0.0); ys.elems()];
                    conv2d(&pw, &x, xs, &mut mid, ms, 2, None);
                    conv2d(dw, &mid, ms, &mut want, ys, 2, None);
                    for band in 1..=oh {
                        let mut got = vec![T::from_f32(f32::NAN); ys.elems()];
                        let mut sums = vec![f32::NAN; ys.n * ys.h * ys.c];
                        let sums_to = Some(&mut sums[..]);
                        let made = pointwise_depthwise(
                            Some(&pw),
                            dw,
                            &x,
                            xs,
                            &mut got,
                            ys,
                            band,
                            sums_to,
                            None,
                        );
                        // Each row's sums, where the storage makes them (f32, bf16 off the pair
                        // kernel): its values'.
                        let makes = T::PRECISION != crate::model::Precision::Fp16 && !on_pairs;
                        assert_eq!(made, makes);
                        let ch = ys.c;
                        let rows = want.chunks(ys.w * ch).zip(sums.chunks(ch));
                        for (r, (row, got)) in rows.enumerate().filter(|_| made) {
                            let wide: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
                            let mut sum = vec![0f32; ch];
                            super::super::pool::row_sums(&wide, &mut sum);
                            let bits =
                                |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(got), bits(&sum), "band {band}: row {r}'s sums");
                        }
                        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                            let (g, e) = (g.to_f32(), e.to_f32());
                            assert_eq!(
                                g.to_bits(),
                                e.to_bits(),
                                "{}: {cin} → {cmid}, {k}×{k} stride {st} pad {pad}, {n}×{h}×{w}, \
                             {act_pw:?} then {act_dw:?}, bands of {band}: value {i}: {g} \
                             against {e}",
                                T::PRECISION
                            );
                        }
                    }
                    let cp = [24, 16, 40, 8, 80, 17][case];
                    let proj_conv = Conv2d {
                        act: acts[(case + 1) % acts.len()].0,
                        residual: case % 2 == 0,
                        ..Conv2d::new(cmid, cp, 1, 1, 0).with_bias()
                    };
                    let proj_w: Vec<f32> = (0..cmid * cp).map(|i| value(i * 5 + 3) / 8.0).collect();
                    let proj_bias: Vec<f32> = (0..cp).map(|i| i as f32 / 32.0 - 0.25).collect();
                    let proj = PackedConv::<T>::new(proj_conv, &proj_w, Some(&proj_bias));
                    // On f32 rows after the FMA kernels, on bf16 pairs after either.
                    assert!(can_project(dw, &proj), "{cmid} → {cp}");
                    let os = Nhwc { c: cp, ..ys };
                    let res: Vec<T> = (0..os.elems())
                        .map(|i| T::from_f32(value(i * 11 + 5)))
                        .collect();
                    let residual = proj_conv.residual.then_some(&res[..]);
                    let mut want_p = vec![T::from_f32(0.0); os.elems()];
                    conv2d(&proj, &want, ys, &mut want_p, os, 2, residual);
                    for band in 1..=oh {
                        // After the pointwise layer, and on its output without it.
                        for (pw, x, xs) in [(Some(&pw), &x, xs), (None, &mid, ms)] {
                            let mut got = vec![T::from_f32(f32::NAN); os.elems()];
                            let projection = Projection {
                                conv: &proj,
                                residual,
                            };
                            let fused = (pw, dw);
                            let made = pointwise_depthwise(
                                fused.0,
                                fused.1,
                                x,
                                xs,
                                &mut got,
                                ys,
                                band,
                                None,
                                Some(projection),
                            );
                            assert!(!made);
                            let same = got
                                .iter()
                                .zip(&want_p)
                                .position(|(g, e)| g.to_f32().to_bits() != e.to_f32().to_bits());
                            assert_eq!(
                                same,
                                None,
                                "projected to {cp} after {}: {cin} → {cmid}, {k}×{k} stride {st}, \
                             bands of {band}",
                                if pw.is_some() {
                                    "the pair"
                                } else {
                                    "the depthwise layer"
                                }
                            );
                        }
                    }
                }
            }
            on_pair_kernels
        }
        assert_eq!(check::<f32>() + check::<half::f16>(), 0);
        let pairs = check::<bf16>();
        // Where the CPU multiplies pairs, the pair GEMM's path ran: five of the six cases (a
        // 1×1 layer over 3 channels runs as a stem), each with the depthwise layer on both
        // kernels where it has the pair kernel too.
        let pw = Conv2d::new(16, 64, 1, 1, 0);
        let on_pairs = PackedConv::<bf16>::new(pw, &[0.0; 1024], None)
            .pairs
            .is_some();
        let dw = Conv2d::new(16, 16, 3, 1, 1).with_groups(16);
        let dw_kernels = 1 + usize::from(Pairs::new(&dw, &[0.0; 144]).is_some());
        assert_eq!(pairs, if on_pairs { 5 * dw_kernels } else { 0 });
    }

    /// Bands: within the budget, at least two work items a worker where the rows allow, the
    /// rows computed twice at most an eighth of the image's; `None` where no band fits, or
    /// where small maps cut for a batch of one would compute too much twice.
    #[test]
    fn fused_bands_fit_the_budget() {
        let dw = |k: usize, st: usize| Conv2d::new(64, 64, k, st, k / 2).with_groups(64);
        let mid = |n: usize, h: usize| Nhwc { n, h, w: h, c: 64 };
        let row = 112 * 64 * 4;
        // MobileNetV3's first pair at batch 8: 56 output rows in bands of 8 (17 rows in).
        assert_eq!(
            fused_band_rows(&dw(3, 2), mid(8, 112), 56, 2, (512 << 10, 1)),
            Some(8)
        );
        assert_eq!(
            fused_band_rows(&dw(3, 2), mid(8, 112), 56, 2, (17 * row, 1)),
            Some(8)
        );
        // A budget of one more row than the whole image takes: one band an image.
        assert_eq!(
            fused_band_rows(&dw(3, 2), mid(8, 112), 56, 2, (112 * row, 1)),
            Some(56)
        );
        // Batch 1, two workers: at least four bands.
        assert_eq!(
            fused_band_rows(&dw(3, 2), mid(1, 112), 56, 2, (112 * row, 1)),
            Some(14)
        );
        // 14² at batch 1: four bands of 4 output rows read 5 or 6 rows each, 22 for 14.
        assert_eq!(
            fused_band_rows(&dw(3, 1), mid(1, 14), 14, 2, (1 << 30, 1)),
            None
        );
        // MobileNetV3-Large's 5×5 stride-2 pair at batch 8 in half of a Zen 3's L2: bands of
        // 7 output rows read 15 to 17 input rows, 65 for 56 (a sixth computed twice).
        let five = |eighths| fused_band_rows(&dw(5, 2), mid(8, 56), 28, 2, (256 << 10, eighths));
        assert_eq!((five(1), five(3)), (None, Some(7)));
        // No band fits: three rows of a 3×3 layer's taps need 3 rows' bytes.
        assert_eq!(
            fused_band_rows(&dw(3, 1), mid(8, 112), 112, 2, (2 * row, 1)),
            None
        );
        assert_eq!(
            fused_band_rows(&dw(3, 1), mid(0, 112), 112, 2, (1 << 30, 1)),
            None
        );
        for (k, st, n, h, budget) in [
            (3, 1, 8, 56, 300 << 10),
            (5, 2, 2, 56, 1 << 20),
            (5, 1, 4, 28, 1 << 20),
        ] {
            let out_h = dw(k, st).output_hw(h, h).unwrap().0;
            let Some(band) = fused_band_rows(&dw(k, st), mid(n, h), out_h, 2, (budget, 1)) else {
                panic!("{k}×{k} s{st} {n}×{h}²: no bands");
            };
            let w_row = h * 64 * 4;
            let mut computed = 0;
            for oy in (0..out_h).step_by(band) {
                let (_, rows) = tap_span(&dw(k, st), (oy, (oy + band).min(out_h)), h);
                assert!(rows * w_row <= budget, "{k}×{k} s{st}: {rows} rows");
                computed += rows;
            }
            assert!(
                8 * computed <= 9 * h,
                "{k}×{k} s{st}: {computed} rows for {h}"
            );
            assert!(
                n * out_h.div_ceil(band) >= 4.min(n * out_h),
                "{k}×{k} s{st}: bands of {band}"
            );
        }
    }

    /// The `vdpbf16ps` kernel against the FMA kernel on the same bf16 values: 3×3 and 5×5 at
    /// strides 1 and 2, padding 0 to 2 (tap rows above and below the image, pixels past both
    /// sides), channel counts with and without a masked last block, with and without a
    /// residual, every activation; within one bf16 rounding of each other. Where the CPU multiplies no pairs it
    /// says so and checks nothing.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn pairs_match_the_fma_kernel() {
        let cases = [
            // (channels, kernel, stride, padding, h, w)
            (24, 3, 1, 1, 7, 9),
            (5, 3, 2, 1, 8, 7),
            (40, 5, 1, 2, 6, 11),
            (16, 5, 2, 2, 9, 9),
            (24, 7, 1, 3, 8, 10),
            (33, 3, 1, 0, 5, 6),
            (48, 3, 1, 1, 6, 20),
            (20, 5, 1, 2, 5, 17),
            // Runs inside the image at stride 2; one block of channels (staged rows) over
            // several runs and a short last one, at both strides and every kernel size.
            (40, 3, 2, 1, 6, 30),
            (24, 5, 2, 2, 5, 26),
            (16, 3, 1, 1, 5, 21),
            (12, 7, 1, 3, 9, 19),
            (8, 3, 2, 0, 7, 23),
            (16, 5, 1, 2, 6, 18),
        ];
        for (i, (ch, k, st, pad, h, w)) in cases.into_iter().enumerate() {
            let mut c = Conv2d::new(ch, ch, k, st, pad).with_groups(ch);
            c.act = Act::ALL[(i + 4) % Act::ALL.len()];
            let value = |i: usize| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 25.0);
            let dw: Vec<f32> = (0..k * k * ch)
                .map(|i| value(i * 7 + 1).to_f32() / 4.0)
                .collect();
            let Some(pairs) = pairs::Pairs::new(&c, &dw) else {
                eprintln!("no bf16 pairs here: the depthwise pair kernel is not exercised");
                return;
            };
            let xs = Nhwc { n: 2, h, w, c: ch };
            let (oh, ow) = ((h + 2 * pad - k) / st + 1, (w + 2 * pad - k) / st + 1);
            let ys = Nhwc {
                n: 2,
                h: oh,
                w: ow,
                c: ch,
            };
            let x: Vec<bf16> = (0..xs.elems()).map(value).collect();
            let res: Vec<bf16> = (0..ys.elems()).map(|i| value(i + 11)).collect();
            let bias: Vec<f32> = (0..ch).map(|i| i as f32 / 16.0 - 1.0).collect();
            // A residual on every other case.
            let res = (i % 2 == 0).then_some(&res[..]);
            let mut got = vec![bf16::NAN; ys.elems()];
            pairs.run(&c, &bias, &x, xs, &mut got, ys, res, c.act);
            let mut want = vec![bf16::NAN; ys.elems()];
            direct(&c, &dw, &bias, &x, xs, &mut want, ys, res, c.act, None);
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                let (g, e) = (g.to_f32(), e.to_f32());
                assert!(
                    (g - e).abs() <= e.abs() / 64.0 + 1e-3,
                    "{ch} channels {k}×{k} stride {st} pad {pad}: value {i}: {g} against {e}"
                );
            }
        }
    }
}

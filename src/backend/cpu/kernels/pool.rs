//! Pooling: max and average windows, and adaptive average pooling.

use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::simd::{Vectorised, ZipWith, with_simd};
use crate::model::op::Pool;
use crate::model::reference::adaptive_bins;

/// Max or average pooling over windows, one output row per work item (`PoolRow`): f32
/// inputs read in place, half types through their widened input rows.
pub fn pool<T: Elem>(p: &Pool, max: bool, x: &[T], xs: Nhwc, y: &mut [T], ys: Nhwc) {
    let ch = xs.c;
    let row_len = ys.w * ch;
    let call = next_call();
    // Rows and columns up to these count towards an average's divisor with
    // `count_include_pad` (the padding, not what lies beyond it).
    let limit = ((xs.h + p.padding.0) as isize, (xs.w + p.padding.1) as isize);
    y[..ys.elems()]
        .par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, out)| {
            let (oy, n) = (row % ys.h, row / ys.h);
            let y0 = (oy * p.stride.0) as isize - p.padding.0 as isize;
            let iys: Vec<isize> = (y0..y0 + p.kernel.0 as isize).collect();
            let shape = (ch, xs.w, p, max, limit);
            // BF16 rows are read in place (a value widens by a shift, in the vectorised
            // loop): widened into f32 rows first, ResNet-50's BF16 max pool took 1.2× as
            // long at batch 8 (OpenVINO's still takes half the time of this one).
            if let Some(x) = T::as_bf16(x) {
                let rows: Vec<(isize, Option<&[half::bf16]>)> = (iys.iter())
                    .map(|&iy| (iy, image_row(x, xs, n, iy)))
                    .collect();
                SCRATCH.with_borrow_mut(|(_, wide_out)| {
                    as_f32_row(out, wide_out, |acc| {
                        with_simd(PoolRow::new(acc, &rows, shape))
                    })
                });
                return;
            }
            WIDE_ROWS.with_borrow_mut(|wide_in| {
                let input = input_rows(x, xs, n, &iys, wide_in, call);
                let rows: Vec<(isize, Option<&[f32]>)> = iys.iter().copied().zip(input).collect();
                SCRATCH.with_borrow_mut(|(_, wide_out)| {
                    as_f32_row(out, wide_out, |acc| {
                        with_simd(PoolRow::new(acc, &rows, shape))
                    })
                });
            })
        });
}

/// Row `iy` of image `n` of `x` (NHWC, `xs`): its w·c values, `None` where the row lies
/// outside the image (in the padding).
pub(super) fn image_row<S>(x: &[S], xs: Nhwc, n: usize, iy: isize) -> Option<&[S]> {
    let len = xs.w * xs.c;
    (iy >= 0 && (iy as usize) < xs.h).then(|| &x[(n * xs.h + iy as usize) * len..][..len])
}

/// The input rows `iys` of image `n` as f32, `None` where a row lies outside the image: f32
/// activations in place, half types widened into `wide`'s slots, keeping the rows it already
/// holds from this kernel call (`call`, from [`next_call`]): a worker's next output row is
/// usually the one below, whose window shares all but `stride` rows with this one's (a 3×3
/// depthwise convolution in BF16 widened each input row three times).
pub(super) fn input_rows<'a, T: Elem>(
    x: &'a [T],
    xs: Nhwc,
    n: usize,
    iys: &[isize],
    wide: &'a mut WideRows,
    call: u64,
) -> Vec<Option<&'a [f32]>> {
    let len = xs.w * xs.c;
    let at = |iy: isize| (iy >= 0 && (iy as usize) < xs.h).then(|| (n * xs.h + iy as usize) * len);
    if let Some(x) = T::as_f32(x) {
        return iys.iter().map(|&iy| image_row(x, xs, n, iy)).collect();
    }
    let slots = iys.len();
    if (wide.call, wide.image, wide.held.len()) != (call, n, slots) {
        (wide.call, wide.image) = (call, n);
        wide.held = vec![None; slots];
    }
    wide.data.resize(slots * len, 0.0);
    // Each inside row's slot: the one holding it, else one holding no row asked for now.
    let mut slot: Vec<Option<usize>> = iys
        .iter()
        .map(|&iy| at(iy).and(wide.held.iter().position(|&h| h == Some(iy))))
        .collect();
    for (i, &iy) in iys.iter().enumerate() {
        let Some(a) = at(iy) else { continue };
        if slot[i].is_some() {
            continue;
        }
        let free = (0..slots)
            .find(|&s| !slot.contains(&Some(s)) && wide.held[s].is_none_or(|h| !iys.contains(&h)))
            .expect("as many slots as rows asked for");
        T::widen(&x[a..][..len], &mut wide.data[free * len..][..len]);
        wide.held[free] = Some(iy);
        slot[i] = Some(free);
    }
    let data: &'a [f32] = &wide.data;
    slot.iter()
        .map(|s| s.map(|s| &data[s * len..][..len]))
        .collect()
}

/// Per worker: the widened input rows of [`input_rows`], slot by slot, and which row of which
/// image each slot holds for which kernel call.
#[derive(Default)]
pub(super) struct WideRows {
    call: u64,
    image: usize,
    held: Vec<Option<isize>>,
    data: Vec<f32>,
}

thread_local! {
    pub(super) static WIDE_ROWS: RefCell<WideRows> = RefCell::new(WideRows::default());
}

/// A number no earlier kernel call got: what [`WideRows`] keys its rows by, so that a buffer
/// the arena hands to another tensor is never mistaken for the rows it held.
pub(super) fn next_call() -> u64 {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One output row of [`pool`], as vectorised work: each output pixel's channels start from
/// −∞ (max) or 0 (average), take in each window pixel inside the image, and an average is
/// divided by its window's count.
pub(super) struct PoolRow<'a, S> {
    acc: &'a mut [f32],
    /// Each window row's index and its input row (`None` outside the image).
    rows: &'a [(isize, Option<&'a [S]>)],
    ch: usize,
    width: usize,
    pool: &'a Pool,
    max: bool,
    limit: (isize, isize),
}

impl<'a, S> PoolRow<'a, S> {
    /// One output row `acc` from `rows`, for (channels, input width, pool, max, limit).
    #[allow(clippy::type_complexity)]
    fn new(
        acc: &'a mut [f32],
        rows: &'a [(isize, Option<&'a [S]>)],
        (ch, width, pool, max, limit): (usize, usize, &'a Pool, bool, (isize, isize)),
    ) -> Self {
        PoolRow {
            acc,
            rows,
            ch,
            width,
            pool,
            max,
            limit,
        }
    }
}

impl<S: super::depthwise::Lanes> Vectorised for PoolRow<'_, S> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let p = self.pool;
        if self.max {
            let (rows, width, ch) = (self.rows, self.width, self.ch);
            for (ox, out) in self.acc.chunks_exact_mut(ch).enumerate() {
                let x0 = (ox * p.stride.1) as isize - p.padding.1 as isize;
                let window = (x0, p.kernel.1, width, ch);
                let mut c0 = 0;
                while c0 < ch {
                    c0 += match ch - c0 {
                        64.. => window_max::<S, 64>(rows, window, c0, out),
                        8.. => window_max::<S, 8>(rows, window, c0, out),
                        _ => window_max::<S, 1>(rows, window, c0, out),
                    };
                }
            }
            return;
        }
        let (rows, width, ch) = (self.rows, self.width, self.ch);
        for (ox, out) in self.acc.chunks_exact_mut(ch).enumerate() {
            let x0 = (ox * p.stride.1) as isize - p.padding.1 as isize;
            let (mut count, mut inside) = (0usize, 0usize);
            for &(iy, row) in rows {
                for ix in x0..x0 + p.kernel.1 as isize {
                    count += usize::from(iy < self.limit.0 && ix < self.limit.1);
                    inside += usize::from(row.is_some() && ix >= 0 && (ix as usize) < width);
                }
            }
            let div = if p.count_include_pad { count } else { inside } as f32;
            let window = (x0, p.kernel.1, width, ch);
            let mut c0 = 0;
            while c0 < ch {
                c0 += match ch - c0 {
                    64.. => window_mean::<S, 64>(rows, window, (c0, div), out),
                    8.. => window_mean::<S, 8>(rows, window, (c0, div), out),
                    _ => window_mean::<S, 1>(rows, window, (c0, div), out),
                };
            }
        }
    }
}

/// The sum of channels `c0..c0 + N` over one output pixel's window (as [`window_max`]'s),
/// divided by `div`, into `out`; returns N. The sums stay in registers across the taps (added
/// in `out`, each tap loaded and stored every channel again: Inception-v3's 3×3 average pools
/// at stride 1 took ~1.8× OpenVINO's time in BF16).
#[inline(always)]
fn window_mean<S: super::depthwise::Lanes, const N: usize>(
    rows: &[(isize, Option<&[S]>)],
    (x0, kernel, width, ch): (isize, usize, usize, usize),
    (c0, div): (usize, f32),
    out: &mut [f32],
) -> usize {
    let mut acc = [0f32; N];
    for row in rows.iter().filter_map(|&(_, row)| row) {
        for ix in x0.max(0)..(x0 + kernel as isize).min(width as isize) {
            let px = &row[ix as usize * ch + c0..][..N];
            acc = std::array::from_fn(|i| acc[i] + px[i].wide());
        }
    }
    for (o, a) in out[c0..c0 + N].iter_mut().zip(acc) {
        *o = a / div;
    }
    N
}

/// The maximum (a NaN wins) of channels `c0..c0 + N` over one output pixel's window (its
/// first column `x0`, `kernel` columns wide, of rows `width` pixels of `ch` channels), into
/// `out`; returns N. The N running maxima are folded by value (as in `fold_lanes`), stay in
/// registers and are stored once: kept in `out` across the taps, or updated in place in a local
/// array, the select became a masked store per tap and vector (`vmaskmovps`, slow on AMD
/// cores), and ResNet-50's max pool took 0.9 ms at batch 1 on a Zen 3, longer than the 1×1
/// convolution of 64 channels at 112² before it.
#[inline(always)]
fn window_max<S: super::depthwise::Lanes, const N: usize>(
    rows: &[(isize, Option<&[S]>)],
    (x0, kernel, width, ch): (isize, usize, usize, usize),
    c0: usize,
    out: &mut [f32],
) -> usize {
    let mut acc = [f32::NEG_INFINITY; N];
    for row in rows.iter().filter_map(|&(_, row)| row) {
        for ix in x0.max(0)..(x0 + kernel as isize).min(width as isize) {
            let px = &row[ix as usize * ch + c0..][..N];
            acc = std::array::from_fn(|i| super::max_nan(acc[i], px[i].wide()));
        }
    }
    out[c0..c0 + N].copy_from_slice(&acc);
    N
}

/// Adaptive average pooling with PyTorch's bin edges.
pub fn adaptive_avg_pool<T: Elem>(x: &[T], xs: Nhwc, y: &mut [T], ys: Nhwc) {
    let ch = xs.c;
    if ys.h == 1 && ys.w == 1 {
        if let Some(x) = T::as_f32(x) {
            return global_avg_pool(x, xs, y);
        }
        if let Some(x) = T::as_bf16(x) {
            return global_avg_pool(x, xs, y);
        }
    }
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

/// Global average pooling (an output of one pixel: every squeeze-and-excitation block's
/// squeeze, a classifier's pooling), one image per work item: each row's pixels summed four
/// at a time ([`row_sums`]), the rows' sums added in order, read in place (bf16 widened in the
/// vectorised loop). The general loop above widened each pixel by a call of its own and added
/// it to the sums one pixel at a time: EfficientNet-B0's first squeeze (32 channels, 112²,
/// BF16 batch 8) took 0.40 ms there, OpenVINO's 0.14. Row by row so that a depthwise layer can
/// hand its rows' sums over as it writes them ([`mean_of_row_sums`]), the same values.
fn global_avg_pool<S: super::depthwise::Lanes, T: Elem>(x: &[S], xs: Nhwc, y: &mut [T]) {
    let (ch, pixels) = (xs.c, xs.h * xs.w);
    if ch == 0 {
        return;
    }
    y[..xs.n * ch]
        .par_chunks_mut(ch)
        .enumerate()
        .for_each(|(n, out)| {
            let image = &x[n * pixels * ch..][..pixels * ch];
            let mut row = vec![0f32; ch];
            SCRATCH.with_borrow_mut(|(_, wide_out)| {
                as_f32_row(out, wide_out, |sums| {
                    sums.fill(0.0);
                    for line in image.chunks_exact(xs.w * ch) {
                        row_sums(line, &mut row);
                        with_simd(ZipWith(sums, &row, |s: &mut f32, r: &f32| *s += r));
                    }
                    let count = pixels as f32;
                    sums.iter_mut().for_each(|s| *s /= count);
                })
            });
        });
}

/// The sums per channel of one row of pixels (`row`, NHWC, `sums.len()` channels, at least
/// one), into `sums`: what [`global_avg_pool`] adds up for each row.
pub(super) fn row_sums<S: super::depthwise::Lanes>(row: &[S], sums: &mut [f32]) {
    with_simd(PixelSum { sums, image: row })
}

/// The global average pool of an image batch (`xs`) from its rows' sums per channel (`sums`,
/// n·h rows of c, as `row_sums` makes them), into `y` (n × c): bit for bit what
/// [`adaptive_avg_pool`] gives from the images themselves.
pub fn mean_of_row_sums<T: Elem>(sums: &[f32], xs: Nhwc, y: &mut [T]) {
    let (ch, pixels) = (xs.c, xs.h * xs.w);
    if ch == 0 {
        return;
    }
    let mut total = vec![0f32; ch];
    for (n, out) in y[..xs.n * ch].chunks_mut(ch).enumerate() {
        total.fill(0.0);
        for row in sums[n * xs.h * ch..][..xs.h * ch].chunks_exact(ch) {
            with_simd(ZipWith(&mut total, row, |s: &mut f32, r: &f32| *s += r));
        }
        let count = pixels as f32;
        total.iter_mut().for_each(|s| *s /= count);
        T::narrow(&total, out);
    }
}

/// The sums of the pixels of `image` (NHWC: one row, or any run of pixels) into `sums`, one
/// value per channel (at least one channel).
struct PixelSum<'a, S> {
    sums: &'a mut [f32],
    image: &'a [S],
}

impl<S: super::depthwise::Lanes> Vectorised for PixelSum<'_, S> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let ch = self.sums.len();
        let sums = self.sums;
        sums.fill(0.0);
        let mut quads = self.image.chunks_exact(4 * ch);
        for quad in &mut quads {
            let (a, rest) = quad.split_at(ch);
            let (b, rest) = rest.split_at(ch);
            let (c, d) = rest.split_at(ch);
            for i in 0..ch {
                sums[i] += (a[i].wide() + b[i].wide()) + (c[i].wide() + d[i].wide());
            }
        }
        for pixel in quads.remainder().chunks_exact(ch) {
            for i in 0..ch {
                sums[i] += pixel[i].wide();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Max pooling against a plain loop over each window, PyTorch's rule for NaNs (one in the
    /// window wins) included: 77 channels take the 64-, 8- and 1-channel runs of `window_max`,
    /// 3×3 windows with stride 2 and padding 1 cross every edge; f32 and bf16 storage.
    #[test]
    fn max_pool_matches_a_plain_loop_nans_included() {
        let xs = Nhwc {
            n: 2,
            h: 7,
            w: 6,
            c: 77,
        };
        let window = Pool::new(3, 2, 1);
        let ys = Nhwc { h: 4, w: 3, ..xs };
        let x: Vec<f32> = (0..xs.elems())
            .map(|i| match i % 101 {
                13 => f32::NAN,
                _ => ((i * 37 % 53) as f32 - 26.0) / 8.0,
            })
            .collect();
        let mut want = vec![0f32; ys.elems()];
        for (i, out) in want.iter_mut().enumerate() {
            let (c, ox, oy, n) = (
                i % ys.c,
                i / ys.c % ys.w,
                i / ys.c / ys.w % ys.h,
                i / ys.c / ys.w / ys.h,
            );
            let mut m = f32::NEG_INFINITY;
            for k in 0..9 {
                let iy = (oy * 2 + k / 3) as isize - 1;
                let ix = (ox * 2 + k % 3) as isize - 1;
                if iy < 0 || ix < 0 || iy as usize >= xs.h || ix as usize >= xs.w {
                    continue;
                }
                let v = x[((n * xs.h + iy as usize) * xs.w + ix as usize) * xs.c + c];
                if !m.is_nan() && (v.is_nan() || v > m) {
                    m = v;
                }
            }
            *out = m;
        }
        assert!(want.iter().any(|v| v.is_nan()) && want.iter().any(|v| !v.is_nan()));
        let same = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan());

        let mut y = vec![0f32; ys.elems()];
        pool(&window, true, &x, xs, &mut y, ys);
        for (i, (&a, &b)) in y.iter().zip(&want).enumerate() {
            assert!(same(a, b), "f32, value {i}: {a} against {b}");
        }

        let x16: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut y16 = vec![bf16::ZERO; ys.elems()];
        pool(&window, true, &x16, xs, &mut y16, ys);
        for (i, (&a, &b)) in y16.iter().zip(&want).enumerate() {
            let b = bf16::from_f32(b).to_f32();
            assert!(same(a.to_f32(), b), "bf16, value {i}: {a} against {b}");
        }
    }
}

//! Pooling: max and average windows, and adaptive average pooling.

use rayon::prelude::*;

use super::*;
use crate::backend::cpu::elem::Elem;
use crate::backend::cpu::simd::{Vectorised, with_simd};
use crate::model::op::Pool;
use crate::model::reference::adaptive_bins;

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
pub(super) fn input_rows<'a, T: Elem>(
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
pub(super) struct PoolRow<'a> {
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
                        out.iter_mut()
                            .zip(px)
                            .for_each(|(a, v)| *a = super::max_nan(*a, *v));
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

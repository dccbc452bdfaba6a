//! The im2col gather: a chunk of output rows' input windows as GEMM columns, by output-row
//! segments (whole-window pixels copied straight, short runs copied inline).

use half::bf16;

use super::*;
use crate::backend::cpu::elem::{Elem, bf16_f32};
use crate::model::op::Conv2d;

/// What [`im2col`] gathers into: f32 columns (widened) for the SGEMM, or the bf16 storage
/// itself for the bf16-pair GEMMs.
pub(super) trait Gathered<T: Elem>: Copy {
    const ZERO: Self;
    fn put(src: &[T], dst: &mut [Self]);
}

impl<T: Elem> Gathered<T> for f32 {
    const ZERO: f32 = 0.0;
    fn put(src: &[T], dst: &mut [f32]) {
        match (T::as_f32(src), T::as_bf16(src)) {
            (Some(src), _) => copy_run(src, dst),
            // A short run (a stem's kernel row over 3 channels: 9 or 21 values) widened in
            // line rather than through `widen`'s SIMD dispatch, a call per run.
            (_, Some(src)) if src.len() < 32 => {
                dst.iter_mut().zip(src).for_each(|(d, s)| *d = bf16_f32(*s))
            }
            _ => T::widen(src, dst),
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
pub(super) fn copy_run<V: Copy>(src: &[V], dst: &mut [V]) {
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
pub(super) fn im2col<T: Elem, D: Gathered<T>>(
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
pub(super) fn im2col_runs<T: Elem, D: Gathered<T>>(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The gathered columns, in f32, bf16 and bf16 widened to f32, against a plain loop over
    /// every tap: kernels from 1×1 to a 7×7 stem, strides 1 and 2, padding 0 to 3, row ranges
    /// that start and end inside output rows and cross images.
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
                // bf16 widened to f32 as it is gathered (short runs in line, long through
                // `Elem::widen`).
                let mut colw = vec![f32::NAN; mr * ld];
                im2col(&c, &xb, xs, ys, m0, mr, &mut colw, ld);
                for r in 0..mr {
                    for t in 0..ld {
                        let f = want(m0 + r, t, &|i| x[i]);
                        let b = want(m0 + r, t, &|i| xb[i].to_f32());
                        let case = format!("k{k} s{st} p{pad} rows {m0}+{mr}: row {r} col {t}");
                        assert_eq!(cols[r * ld + t], f, "f32 {case}");
                        assert_eq!(colb[r * ld + t].to_f32(), b, "bf16 {case}");
                        assert_eq!(colw[r * ld + t], b, "bf16 → f32 {case}");
                    }
                }
            }
        }
    }
}

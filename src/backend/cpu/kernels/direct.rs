//! BF16 convolutions of stride 1 with a window (ResNet's 3×3 layers) on AMX's tiles, read
//! straight from a zero-bordered copy of their input instead of gathered columns.
//!
//! im2col writes every input pixel's channels once per tap — nine times for a 3×3 layer — and
//! the tiles then stream those columns from L2. Here the input is copied once with its zero
//! border (`padding` pixels round each image), and a tile's 16 rows are 16 neighbouring
//! pixels of that copy, one pixel's channels apart: tap (ky, kx) of output pixel (oy, ox) is
//! padded pixel (oy + ky, ox + kx), so with the output's pixels numbered across the padded
//! width (`v = oy · wp + ox`), every tap of every pixel is the same offset from the pixel's
//! own, `(ky · wp + kx) · cin`, and a block's 32 pixels are one run of the copy. The
//! `wp − ow` pixels at each row's end (past the image's right edge) are multiplied and thrown
//! away: 3.6% more products at 56², 14% at 14², 29% at 7². A K step of 32 is one tap's run of
//! 32 channels, so the input's channels fill whole steps (`fits`), and the nine taps read the
//! same lines of the copy, from L1, where the columns read nine copies of them.
//!
//! oneDNN's AMX convolutions (OpenVINO's) read their input in place the same way; on an
//! Emerald Rapids Xeon they ran ResNet-50's 3×3 layers 1.5–2× as fast as our gathered ones.

use std::cell::RefCell;

use half::bf16;
use rayon::prelude::*;

use super::Nhwc;
use super::conv::{TilePtr, work_items};
use crate::backend::cpu::bf16_gemm::{
    BLOCK_COLS, BLOCK_ROWS, CBlock, Done, Engine, Finished, KSTEP, PANEL, PackedPairs,
};
use crate::backend::cpu::{Lines, amx, big_buffer};
use crate::model::op::{Act, Conv2d};

/// Whether [`conv2d`] runs layer `c`, B packed as `b`: on AMX, stride 1 without dilation or
/// groups, a window wider than one pixel, and input channels that fill whole K steps.
pub(super) fn fits(c: &Conv2d, b: &PackedPairs) -> bool {
    Engine::for_k(b.k) == Some(Engine::Amx)
        && c.groups == 1
        && c.stride == (1, 1)
        && c.dilation == (1, 1)
        && c.kernel != (1, 1)
        && c.in_channels.is_multiple_of(KSTEP)
        && b.kp() == b.k
        && b.k == c.kernel.0 * c.kernel.1 * c.in_channels
}

thread_local! {
    /// The input with its zero border, on cache lines (the tiles read 64-byte runs of it).
    static PADDED: RefCell<Lines<bf16>> = RefCell::new(big_buffer(0));
}

/// The zero-bordered copy's shape: padded height and width, and whole rows of zeros past the
/// last image, for the last block's pixels past its image.
#[derive(Clone, Copy)]
struct Padded {
    hp: usize,
    wp: usize,
    tail_rows: usize,
}

impl Padded {
    fn of(c: &Conv2d, xs: Nhwc) -> Padded {
        let wp = xs.w + 2 * c.padding.1;
        // A block's last pixel lies at most 31 past the image's last output pixel, whose
        // last tap is the image's last padded pixel: 31 + kw pixels past it at most.
        let tail_rows = (BLOCK_ROWS + c.kernel.1).div_ceil(wp);
        Padded {
            hp: xs.h + 2 * c.padding.0,
            wp,
            tail_rows,
        }
    }
}

/// `x` (NHWC) into `buf` with `c`'s zero border.
fn pad_input(c: &Conv2d, x: &[bf16], xs: Nhwc, pad: Padded, buf: &mut Lines<bf16>) {
    let (py, px) = c.padding;
    let row = pad.wp * xs.c;
    let len = (xs.n * pad.hp + pad.tail_rows) * row;
    buf.reuse(len);
    buf[..len]
        .par_chunks_mut(row)
        .enumerate()
        .for_each(|(r, dst)| {
            let (img, yy) = (r / pad.hp, r % pad.hp);
            if img >= xs.n || yy < py || yy >= py + xs.h {
                dst.fill(bf16::ZERO);
                return;
            }
            let (left, rest) = dst.split_at_mut(px * xs.c);
            let (mid, right) = rest.split_at_mut(xs.w * xs.c);
            left.fill(bf16::ZERO);
            right.fill(bf16::ZERO);
            let src = ((img * xs.h + yy - py) * xs.w) * xs.c;
            mid.copy_from_slice(&x[src..src + xs.w * xs.c]);
        });
}

/// Layer `c` (see [`fits`]) on AMX's tiles from its input's zero-bordered copy: `y` (NHWC,
/// `ys`) = x ∗ B + bias (+ the residual at `residual`, which may be `y` itself: each value is
/// read where it is stored over), through `act`, rounded to bf16. `rows`: the work items'
/// rows, about (as [`super::conv2d`]'s chunks).
///
/// # Safety
/// [`fits`] says so; `y` holds `ys.elems()` values and so does the residual where there is
/// one, written (read) by nobody else meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn conv2d(
    c: &Conv2d,
    b: &PackedPairs,
    x: &[bf16],
    xs: Nhwc,
    (y, ys): (TilePtr<bf16>, Nhwc),
    residual: Option<TilePtr<bf16>>,
    act: Act,
    (rows, threads): (usize, usize),
) {
    let pad = Padded::of(c, xs);
    let (cin, cout) = (xs.c, ys.c);
    // Step s's 32 channels: tap s · 32 / cin (ky, kx), from channel s · 32 % cin.
    let (kw, steps) = (c.kernel.1, b.kp() / KSTEP);
    let offsets: Vec<usize> = (0..steps)
        .map(|s| {
            let (tap, c0) = (s * KSTEP / cin, s * KSTEP % cin);
            ((tap / kw) * pad.wp + tap % kw) * cin + c0
        })
        .collect();
    let blocks = (ys.h * pad.wp).div_ceil(BLOCK_ROWS);
    let m = xs.n * blocks * BLOCK_ROWS;
    PADDED.with_borrow_mut(|buf| {
        pad_input(c, x, xs, pad, buf);
        let xp: &[bf16] = &buf[..];
        let items = work_items(m, (rows, BLOCK_ROWS), b.panels(), threads, false);
        items.for_each(|((m0, mr), (p0, p1))| {
            let finished = Finished {
                // SAFETY: the output's first value (through the method, so that the closure
                // captures the whole, shareable `TilePtr`).
                out: unsafe { y.add(0) },
                residual: residual.map(|r| r.0.cast_const()),
                ld: cout,
                act,
            };
            let mut sums = CBlock::default();
            // SAFETY: AMX is the engine in use (`fits`).
            unsafe { amx::configure() };
            let mut p = p0;
            while p < p1 {
                let pair = p + 1 < p1;
                let cols = (if pair { 2 } else { 1 } * PANEL).min(cout - p * PANEL);
                for j in m0 / BLOCK_ROWS..(m0 + mr) / BLOCK_ROWS {
                    let (img, v0) = (j / blocks, j % blocks * BLOCK_ROWS);
                    let a = xp[(img * pad.hp * pad.wp + v0) * cin..].as_ptr();
                    // SAFETY: the block's 32 pixels and their taps' channels lie in the copy
                    // (`Padded::tail_rows` past the last image); panels p (and p + 1) exist.
                    unsafe {
                        let c = (sums.0.as_mut_ptr(), BLOCK_COLS);
                        let first = j == m0 / BLOCK_ROWS;
                        let panels = amx::Panels { p, pair, first };
                        amx::block_at(a, cin, |s| offsets[s], b, panels, c);
                    }
                    // The block's pixels inside the image, a run along an output row at a time.
                    let mut r = 0;
                    while r < BLOCK_ROWS {
                        let (oy, ox) = ((v0 + r) / pad.wp, (v0 + r) % pad.wp);
                        if oy >= ys.h {
                            break;
                        }
                        if ox >= ys.w {
                            r += pad.wp - ox;
                            continue;
                        }
                        let run = (ys.w - ox).min(BLOCK_ROWS - r);
                        let done = Done {
                            row: (img * ys.h + oy) * ys.w + ox,
                            rows: run,
                            col: p * PANEL,
                            cols,
                            values: &mut sums.0[r * BLOCK_COLS..],
                            bias: Some(&b.bias_from(p)[..cols]),
                        };
                        // SAFETY: an AMX CPU has AVX-512 and AVX512_BF16; the run's pixels
                        // and the panels' columns are this work item's (the contract).
                        unsafe { done.finish(finished) };
                        r += run;
                    }
                }
                p += if pair { 2 } else { 1 };
            }
            // SAFETY: as above.
            unsafe { amx::release() };
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::bf16_gemm;

    /// The direct layer against the gathered columns through the same GEMM blocks: bit for
    /// bit, with and without a residual (also read over the output), for 3×3 windows padded
    /// by 1 and unpadded, a 5×5 one, 32 and 64 channels, an odd last panel, images whose last
    /// block runs past them. Only on a CPU with AMX.
    #[test]
    fn direct_layers_match_gathered_columns() {
        if Engine::in_use() != Some(Engine::Amx) {
            return;
        }
        let cases = [
            // (n, h, w, cin, cout, k, pad)
            (2, 9, 7, 64, 48, 3, 1),
            (1, 14, 14, 32, 64, 3, 1),
            (2, 6, 11, 32, 32, 3, 0),
            (1, 8, 8, 64, 16, 5, 2),
        ];
        for (n, h, w, cin, cout, k, pad) in cases {
            let c = Conv2d {
                bias: true,
                act: Act::Relu,
                ..Conv2d::new(cin, cout, k, 1, pad)
            };
            let xs = Nhwc { n, h, w, c: cin };
            let ys = Nhwc {
                n,
                h: h + 2 * pad + 1 - k,
                w: w + 2 * pad + 1 - k,
                c: cout,
            };
            let kk = k * k * cin;
            let value =
                |i: usize, m: usize| bf16::from_f32(((i * 37 + m) % 23) as f32 / 16.0 - 0.7);
            let x: Vec<bf16> = (0..xs.elems()).map(|i| value(i, 1)).collect();
            let bias: Vec<f32> = (0..cout).map(|j| j as f32 / 8.0 - 1.0).collect();
            let b = PackedPairs::from_columns(
                kk,
                cout,
                |j, col| {
                    for (t, v) in col.iter_mut().enumerate() {
                        *v = value(j * kk + t, 5).to_f32() / 4.0;
                    }
                },
                Some(&bias),
            );
            assert!(fits(&c, &b));
            // The columns, gathered naively (zeros outside the image).
            let m = ys.n * ys.h * ys.w;
            let mut cols = vec![bf16::ZERO; m * kk];
            for (row, col) in cols.chunks_mut(kk).enumerate() {
                let (img, oy, ox) = (row / (ys.h * ys.w), row / ys.w % ys.h, row % ys.w);
                for (ky, kx) in (0..k).flat_map(|ky| (0..k).map(move |kx| (ky, kx))) {
                    let (iy, ix) = (
                        (oy + ky) as isize - pad as isize,
                        (ox + kx) as isize - pad as isize,
                    );
                    if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= w {
                        continue;
                    }
                    let at = ((img * h + iy as usize) * w + ix as usize) * cin;
                    col[(ky * k + kx) * cin..][..cin].copy_from_slice(&x[at..at + cin]);
                }
            }
            let residual: Vec<bf16> = (0..ys.elems()).map(|i| value(i, 9)).collect();
            for with_residual in [false, true] {
                let mut want = vec![bf16::ZERO; ys.elems()];
                let f = Finished {
                    out: want.as_mut_ptr(),
                    residual: with_residual.then_some(residual.as_ptr()),
                    ld: cout,
                    act: c.act,
                };
                // SAFETY: AMX is in use; the columns hold m rows of kk values; `want` and the
                // residual hold m rows of cout.
                unsafe {
                    bf16_gemm::gemm(
                        Engine::Amx,
                        m,
                        cols.as_ptr(),
                        kk,
                        &b,
                        (0, b.panels()),
                        None,
                        &mut |d: Done<'_>| d.finish(f),
                    )
                };
                // Apart from the residual, and over it (the output holding it first).
                for over in [false, true] {
                    let mut got = if over {
                        residual.clone()
                    } else {
                        vec![bf16::ZERO; ys.elems()]
                    };
                    let y = TilePtr(got.as_mut_ptr());
                    let r = match (with_residual, over) {
                        (false, _) => None,
                        (true, false) => Some(TilePtr::from_const(residual.as_ptr())),
                        (true, true) => Some(TilePtr::from_const(y.0.cast_const())),
                    };
                    if over && !with_residual {
                        continue;
                    }
                    // SAFETY: `fits`; `got` (and the residual) hold the output's values.
                    unsafe { conv2d(&c, &b, &x, xs, (y, ys), r, c.act, (64, 2)) };
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{n}x{h}x{w}x{cin} -> {cout}, {k}x{k} pad {pad}, residual {with_residual}, over {over}"
                    );
                }
            }
        }
    }
}

//! Winograd F(2×2, 3×3) for dense 3×3 stride-1 convolutions: each 2×2 block of outputs
//! comes from a 4×4 input tile with 16 multiplications per (input, output) channel pair instead
//! of 36. Per chunk of tiles: the input transform V = Bᵀ·d·B of every tile and channel, 16 GEMMs
//! M_ξ = V_ξ·U_ξ (tiles × cin by cin × cout, on our packed SGEMM) against the transformed
//! weights U = G·g·Gᵀ, and the output transform Y = Aᵀ·M·A with bias and the fused epilogue.
//! Activations may be stored in any precision (widened per pixel, narrowed per output row); the
//! transformed weights are kept in f32, made from the weights as the storage type rounds them.
//! Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks" (2015).

use std::cell::RefCell;

use rayon::prelude::*;

use super::elem::Elem;
use super::kernels::{Epilogue, Nhwc};
use super::sgemm::{self, PackedB};
use crate::model::op::Conv2d;

/// The variant name max-autotune sees.
pub const VARIANT: &str = "winograd-f2x2";

/// Convolutions this path computes.
pub fn eligible(c: &Conv2d) -> bool {
    c.kernel == (3, 3) && c.stride == (1, 1) && c.dilation == (1, 1) && c.groups == 1
}

/// Whether a layer with output `out` (NCHW) runs this way when max-autotune has not chosen:
/// with enough channels for the transforms to pay off and enough tiles to reuse the
/// transformed weights (16/9 the size of the plain ones). ResNet-50's stride-1 3×3 layers ran
/// 1.9× faster this way at batch 4 on a 2-core AVX2 machine, and at batch 1 the 14×14 layers
/// (49 tiles) 1.45× faster, but the 7×7 ones (16 tiles) 1.15× slower: with few rows the larger
/// weights are streamed for little work.
pub fn by_default(c: &Conv2d, out: &[usize]) -> bool {
    let tiles = match *out {
        [n, _, h, w] => n * h.div_ceil(2) * w.div_ceil(2),
        _ => 0,
    };
    eligible(c) && c.in_channels >= 32 && c.out_channels >= 32 && tiles >= 40
}

/// Transformed weights: for each of the 16 positions ξ of a transformed tile, the (cin × cout)
/// matrix U_ξ, packed for the GEMM.
pub struct Winograd {
    u: Vec<PackedB<f32>>,
    bias: Option<Vec<f32>>,
}

impl Winograd {
    /// From PyTorch's (cout, cin, 3, 3) weight, as storage type `T` rounds it.
    pub fn new<T: Elem>(conv: &Conv2d, weight: &[f32], bias: Option<&[f32]>) -> Self {
        let (cin, cout) = (conv.in_channels, conv.out_channels);
        // t[ξ][co·cin + ci] = (G·g·Gᵀ)[ξ] with G = [[1,0,0],[½,½,½],[½,−½,½],[0,0,1]].
        let mut t = vec![vec![0f32; cout * cin]; 16];
        for co in 0..cout {
            for ci in 0..cin {
                let g: Vec<f32> = weight[(co * cin + ci) * 9..][..9]
                    .iter()
                    .map(|&v| T::from_f32(v).to_f32())
                    .collect();
                let mut gg = [[0f32; 3]; 4];
                for j in 0..3 {
                    let (a, b, c) = (g[j], g[3 + j], g[6 + j]);
                    gg[0][j] = a;
                    gg[1][j] = 0.5 * (a + b + c);
                    gg[2][j] = 0.5 * (a - b + c);
                    gg[3][j] = c;
                }
                for (i, row) in gg.iter().enumerate() {
                    let [a, b, c] = *row;
                    let u = [a, 0.5 * (a + b + c), 0.5 * (a - b + c), c];
                    for (j, v) in u.into_iter().enumerate() {
                        t[i * 4 + j][co * cin + ci] = v;
                    }
                }
            }
        }
        let u = t
            .iter()
            .map(|m| {
                PackedB::from_columns(
                    cin,
                    cout,
                    |co, col: &mut [f32]| col.copy_from_slice(&m[co * cin..(co + 1) * cin]),
                    None,
                )
            })
            .collect();
        Winograd {
            u,
            bias: bias.map(<[f32]>::to_vec),
        }
    }

    pub fn bytes(&self) -> u64 {
        self.u.iter().map(|u| u.bytes()).sum::<u64>()
            + self.bias.as_ref().map_or(0, |b| b.len() as u64 * 4)
    }
}

/// Per worker, reused across chunks, layers and passes.
#[derive(Default)]
struct Scratch {
    /// Transformed inputs, 16 × tiles × cin.
    v: Vec<f32>,
    /// GEMM results, 16 × tiles × cout.
    m: Vec<f32>,
    /// One tile's 16 input pixels and its half-transformed copy, 16 × cin each.
    d: Vec<f32>,
    tmp: Vec<f32>,
    /// One output pixel's channels, and the epilogue's widened residual.
    row: Vec<f32>,
    residual: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Tiles per work item: the chunk's transformed inputs and results stay about 1 MiB.
/// Fewer when that leaves too few work items for the workers.
fn chunk_tiles(cin: usize, cout: usize, tiles: usize, threads: usize) -> usize {
    let fair = tiles
        .div_ceil(2 * threads.max(1))
        .next_multiple_of(sgemm::MR);
    (16_384 / (cin + cout).max(1))
        .clamp(sgemm::MR * 2, sgemm::MR * 16)
        .next_multiple_of(sgemm::MR)
        .min(fair)
        .min(tiles.max(1))
}

struct OutPtr<T>(*mut T);
// SAFETY: work items write the outputs of disjoint tiles.
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

/// The convolution `x` (xs) → `y` (ys), NHWC, with the epilogue applied to each output row.
pub fn conv2d<T: Elem>(
    w: &Winograd,
    conv: &Conv2d,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    epilogue: &Epilogue<'_, T>,
) {
    let (cin, cout) = (xs.c, ys.c);
    let (th, tw) = (ys.h.div_ceil(2), ys.w.div_ceil(2));
    let tiles = ys.n * th * tw;
    let per = chunk_tiles(cin, cout, tiles, rayon::current_num_threads());
    let views: Vec<_> = w.u.iter().map(|u| u.view(&mut [])).collect();
    let panels = views[0].panels();
    assert!(y.len() >= ys.elems(), "conv2d output buffer too small");
    let out = OutPtr(y.as_mut_ptr());
    let (ph, pw) = (conv.padding.0 as isize, conv.padding.1 as isize);
    let out = &out;
    (0..tiles.div_ceil(per).max(1))
        .into_par_iter()
        .for_each(|chunk| {
            let t0 = chunk * per;
            let nt = per.min(tiles - t0);
            SCRATCH.with(|s| {
                let Scratch {
                    v,
                    m,
                    d,
                    tmp,
                    row,
                    residual,
                } = &mut *s.borrow_mut();
                v.resize(16 * nt * cin, 0.0);
                m.resize(16 * nt * cout, 0.0);
                d.resize(16 * cin, 0.0);
                tmp.resize(16 * cin, 0.0);
                row.resize(cout, 0.0);
                // Input transform, vectorised over channels.
                for t in 0..nt {
                    let (b, ty, tx) = tile_position(t0 + t, th, tw);
                    for i in 0..4 {
                        let iy = (2 * ty + i) as isize - ph;
                        for j in 0..4 {
                            let ix = (2 * tx + j) as isize - pw;
                            let dst = &mut d[(i * 4 + j) * cin..][..cin];
                            if iy < 0 || ix < 0 || iy >= xs.h as isize || ix >= xs.w as isize {
                                dst.fill(0.0);
                            } else {
                                let at = ((b * xs.h + iy as usize) * xs.w + ix as usize) * cin;
                                T::widen(&x[at..at + cin], dst);
                            }
                        }
                    }
                    input_transform(d, cin, tmp, |xi| {
                        let at = (xi * nt + t) * cin;
                        // SAFETY: a distinct row of `v` per (ξ, t); `v` outlives the closure.
                        unsafe {
                            std::slice::from_raw_parts_mut(v.as_ptr().add(at) as *mut f32, cin)
                        }
                    });
                }
                // The 16 GEMMs.
                for (xi, view) in views.iter().enumerate() {
                    // SAFETY: V_ξ holds nt rows of cin floats; M_ξ has nt rows of cout floats.
                    unsafe {
                        sgemm::gemm(
                            nt,
                            v.as_ptr().add(xi * nt * cin),
                            cin,
                            view,
                            (0, panels),
                            m.as_mut_ptr().add(xi * nt * cout),
                            cout,
                        );
                    }
                }
                // Output transform, bias and epilogue, row by row of the 2×2 block.
                for t in 0..nt {
                    let (b, ty, tx) = tile_position(t0 + t, th, tw);
                    let at = |xi: usize| &m[(xi * nt + t) * cout..][..cout];
                    for r in 0..2 {
                        let oy = 2 * ty + r;
                        if oy >= ys.h {
                            continue;
                        }
                        for c in 0..2 {
                            let ox = 2 * tx + c;
                            if ox >= ys.w {
                                continue;
                            }
                            output_transform(&at, r, c, row);
                            if let Some(bias) = &w.bias {
                                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
                            }
                            let flat = ((b * ys.h + oy) * ys.w + ox) * cout;
                            epilogue.apply(row, flat, residual);
                            // SAFETY: this pixel's cout outputs belong to this tile only.
                            let dst =
                                unsafe { std::slice::from_raw_parts_mut(out.0.add(flat), cout) };
                            T::narrow(row, dst);
                        }
                    }
                }
            });
        });
}

/// Tile index → (image, tile row, tile column).
fn tile_position(t: usize, th: usize, tw: usize) -> (usize, usize, usize) {
    (t / (th * tw), (t / tw) % th, t % tw)
}

/// V = Bᵀ·d·B for one tile, all channels: `d` holds the 16 input pixels (row-major 4×4, each
/// `c` channels), `v(ξ)` the destination row of position ξ.
/// Bᵀ = [[1,0,−1,0],[0,1,1,0],[0,−1,1,0],[0,1,0,−1]].
fn input_transform<'a>(d: &[f32], c: usize, tmp: &mut [f32], v: impl Fn(usize) -> &'a mut [f32]) {
    let px = |i: usize, j: usize| &d[(i * 4 + j) * c..][..c];
    // tmp = Bᵀ·d (rows combine).
    for j in 0..4 {
        let (d0, d1, d2, d3) = (px(0, j), px(1, j), px(2, j), px(3, j));
        for k in 0..c {
            tmp[j * c + k] = d0[k] - d2[k];
            tmp[(4 + j) * c + k] = d1[k] + d2[k];
            tmp[(8 + j) * c + k] = d2[k] - d1[k];
            tmp[(12 + j) * c + k] = d1[k] - d3[k];
        }
    }
    // V = tmp·B (columns combine).
    for i in 0..4 {
        let r = &tmp[i * 4 * c..][..4 * c];
        let (t0, t1, t2, t3) = (&r[..c], &r[c..2 * c], &r[2 * c..3 * c], &r[3 * c..]);
        let out = [v(i * 4), v(i * 4 + 1), v(i * 4 + 2), v(i * 4 + 3)];
        let [o0, o1, o2, o3] = out;
        for k in 0..c {
            o0[k] = t0[k] - t2[k];
            o1[k] = t1[k] + t2[k];
            o2[k] = t2[k] - t1[k];
            o3[k] = t1[k] - t3[k];
        }
    }
}

/// Output (r, c) of Y = Aᵀ·M·A for one tile, all channels, with Aᵀ = [[1,1,1,0],[0,1,−1,−1]].
fn output_transform<'a>(m: &impl Fn(usize) -> &'a [f32], r: usize, c: usize, out: &mut [f32]) {
    // Row r of Aᵀ·M: a combination of M's rows; then column c of that times A.
    let rows: [(usize, f32); 3] = if r == 0 {
        [(0, 1.0), (1, 1.0), (2, 1.0)]
    } else {
        [(1, 1.0), (2, -1.0), (3, -1.0)]
    };
    let cols: [(usize, f32); 3] = if c == 0 {
        [(0, 1.0), (1, 1.0), (2, 1.0)]
    } else {
        [(1, 1.0), (2, -1.0), (3, -1.0)]
    };
    out.fill(0.0);
    for (i, a) in rows {
        for (j, b) in cols {
            let s = a * b;
            let src = m(i * 4 + j);
            out.iter_mut().zip(src).for_each(|(o, v)| *o += s * v);
        }
    }
}

//! Winograd convolutions F(m×m, 3×3) for dense 3×3 stride-1 layers, m = 2 or 4: each m×m
//! block of outputs comes from an α×α input tile (α = m + 2) with α² multiplications per
//! (input, output) channel pair instead of 9m²: 16 instead of 36 for F(2×2), 36 instead of 144
//! for F(4×4). Per chunk of tiles: the input transform V = Bᵀ·d·B of every tile and channel,
//! α² GEMMs M_ξ = V_ξ·U_ξ (tiles × cin by cin × cout, on our packed SGEMM) against the
//! transformed weights U = G·g·Gᵀ, and the output transform Y = Aᵀ·M·A with bias and the fused
//! epilogue. F(4×4) does 44% of F(2×2)'s multiplications for larger transforms, 4× the weights
//! (against 16/9) and somewhat larger rounding errors (its points are 0, ±1, ±2, ∞).
//! Activations may be stored in any precision (widened per pixel, narrowed per output row); the
//! transformed weights are made from the weights as that precision rounds them, and kept in f32
//! or, for layers that run stage by stage, in that precision (see `Transformed`).
//! Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks" (2015).

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use half::bf16;

use super::bf16_gemm::{self, Engine, PackedPairs};
use super::elem::Elem;
use super::kernels::{Chunks, Epilogue, Nhwc};
use super::sgemm::{self, NR, PackedB};
use super::simd::{Vectorised, with_simd};
use crate::model::op::Conv2d;

/// The output tile: F(2×2, 3×3) or F(4×4, 3×3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tile {
    F2,
    F4,
}

/// The variant names max-autotune sees, one per tile.
pub const VARIANTS: [&str; 2] = ["winograd-f2x2", "winograd-f4x4"];

impl Tile {
    pub fn from_variant(name: &str) -> Option<Tile> {
        [Tile::F2, Tile::F4]
            .into_iter()
            .find(|t| t.variant() == name)
    }

    pub fn variant(self) -> &'static str {
        VARIANTS[self as usize]
    }

    /// The kernel name's form (`conv2d_<form>_<type>`).
    pub fn form(self) -> &'static str {
        match self {
            Tile::F2 => "winograd_f2x2",
            Tile::F4 => "winograd_f4x4",
        }
    }

    /// Outputs per tile side.
    fn m(self) -> usize {
        match self {
            Tile::F2 => 2,
            Tile::F4 => 4,
        }
    }

    /// Inputs per tile side.
    fn alpha(self) -> usize {
        self.m() + 2
    }

    /// The weight transform G (α × 3).
    fn g(self) -> &'static [[f64; 3]] {
        const G2: [[f64; 3]; 4] = [
            [1.0, 0.0, 0.0],
            [0.5, 0.5, 0.5],
            [0.5, -0.5, 0.5],
            [0.0, 0.0, 1.0],
        ];
        const G4: [[f64; 3]; 6] = [
            [1.0 / 4.0, 0.0, 0.0],
            [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
            [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
            [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0],
            [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0],
            [0.0, 0.0, 1.0],
        ];
        match self {
            Tile::F2 => &G2,
            Tile::F4 => &G4,
        }
    }

    /// Tiles covering an output of `out` (NCHW).
    fn tiles(self, out: &[usize]) -> usize {
        match *out {
            [n, _, h, w] => n * h.div_ceil(self.m()) * w.div_ceil(self.m()),
            _ => 0,
        }
    }
}

/// Convolutions these paths compute.
pub fn eligible(c: &Conv2d) -> bool {
    c.kernel == (3, 3) && c.stride == (1, 1) && c.dilation == (1, 1) && c.groups == 1
}

/// The tile a layer with output `out` (NCHW) runs with when max-autotune has not chosen, if
/// any: only with enough channels for the transforms to pay off, and enough tiles to reuse the
/// transformed weights (α²/9 the size of the plain ones). On a 2-core AVX2 machine (Zen),
/// ResNet-50's stride-1 3×3 layers ran 1.2–1.6× faster with F(4×4) than with F(2×2) and 1.6–2.7×
/// faster than im2col at batch 8; at batch 1 F(4×4) still won with 16 tiles (14×14), but with
/// 4 (7×7) F(2×2) was fastest (16 tiles; 1.4× im2col) and F(4×4) the slowest, its 36 MB of
/// transformed weights streamed for little work.
///
/// Where the layer multiplies bf16 pairs (`pairs`: BF16 on `vdpbf16ps` or AMX, twice the f32
/// FMA rate) the choice is between F(4×4) on f32 GEMMs, F(2×2) on pairs (see `Transformed`)
/// and im2col on pairs, by the tiles each has:
/// - F(4×4) with 192 tiles or more. ResNet-50 on a Zen 5, per 3×3 stride-1 layer, F(4×4)
///   against im2col on pairs: 1568, 392 and 196 tiles (56×56 and 28×28 at batch 8, 56×56 at
///   batch 1) 10–27% faster, 512 (14×14 at batch 32) 13% faster; 128 (14×14 at batch 8) 4%
///   slower, 49 and fewer 15–80% slower. Against F(2×2) on pairs, on a Zen 4: F(4×4) faster
///   with 392 tiles (28×28 at batch 8: 1.49 against 1.67 ms), 1568 (56×56, two images a
///   call: 0.87 against 1.13) and 1568 (28×28 at batch 32: 1.90 against 2.12).
/// - Else F(2×2) on pairs with 48 tiles or more. On the Zen 4, against im2col on pairs
///   (minimum over 10–40 steps alternating in one process): 392 tiles (14×14 at batch 8) 2.7
///   against 4.3 ms, 128 (7×7 at batch 8) 3.4–3.7 against 4.3, 512 (7×7 at batch 32) 13.0
///   against 18.0, 196 and 49 (28×28 and 14×14 at batch 1) 0.40 against 0.54 and 0.36–0.46
///   against 0.55; 16 (7×7 at batch 1) 0.56–0.61 against 0.59: no gain, its 8 MB of
///   transformed weights streamed for little work.
///
/// Nor over 32 input channels on `vdpbf16ps`: each transformed tile's GEMM has a K of 32, too
/// little work for its transforms. Inception-v3 BF16 at batch 8 on a Zen 5, max-autotune
/// timing each layer: its 3×3 layers over 32 channels at 147², 32 → 32 and 32 → 64, took 3.8
/// and 7.1–7.5 ms on im2col and pairs against 5.2 and 7.8 on F(4×4); with 64 and 80 channels
/// (64 → 96 at 35², 80 → 192 at 71²) F(4×4) led, 0.94 against 1.07 and 7.8 against 10.9.
/// GoogLeNet's over 32 channels, alone (`--profile`, two runs each): 32 → 96 at 28² 0.41–0.45
/// against 0.51–0.52 ms on F(4×4), 32 → 64 and 32 → 128 at 14² 0.07–0.10 and 0.13 against
/// 0.13 and 0.21 on F(2×2) pairs (the network level: 1.003×, 6 rounds).
///
/// On AMX's tiles (`pairs` is [`Engine::Amx`]) none: im2col. The tiles multiply 12–16× as
/// fast as the cores' FMAs (not `vdpbf16ps`'s 2×), so F(4×4) on f32 GEMMs loses to them and
/// what F(2×2) saves in products costs more in its transforms' passes over memory. ResNet-50
/// BF16 at batch 8 on 2 Sapphire Rapids cores, each stride-1 3×3 layer timed by max-autotune
/// in one process, im2col against F(2×2) on the tiles and F(4×4) on f32: 56×56 2.8–4.0 ms
/// against 6.5 and 5.0, 28×28 1.95 against 4.5 and 4.6, 14×14 2.3 against 4.9 and 5.7, 7×7
/// 3.0 against 3.6 and 5.1.
pub fn by_default(c: &Conv2d, out: &[usize], pairs: Option<Engine>) -> Option<Tile> {
    if !eligible(c) || c.in_channels < 32 || c.out_channels < 32 {
        return None;
    }
    let least = |t: Tile| match (pairs, t) {
        (Some(Engine::Amx), _) => usize::MAX,
        (Some(Engine::Dot), _) if c.in_channels <= 32 => usize::MAX,
        (None, _) => 16,
        (Some(Engine::Dot), Tile::F4) => 192,
        (Some(Engine::Dot), Tile::F2) => 48,
    };
    [Tile::F4, Tile::F2]
        .into_iter()
        .find(|&t| t.tiles(out) >= least(t))
}

/// Transformed weights: for each of the α² positions ξ of a transformed tile, the (cin × cout)
/// matrix U_ξ, packed for the GEMM.
pub struct Winograd<T> {
    tile: Tile,
    /// Whether the convolution runs stage by stage (see [`conv2d`]), decided from the output
    /// shape at prepare time.
    staged: bool,
    u: Transformed<T>,
    bias: Option<Vec<f32>>,
}

/// U in f32, or in the session's half type where the layer runs stage by stage: there the
/// weights dominate (F(4×4)'s are 4× the size of the plain ones, ResNet-50's last stage
/// alone 75 MB in f32) and each U_ξ is widened a panel block at a time as its one GEMM per
/// pass runs; chunks would widen every U_ξ once each, so layers that run in chunks keep f32
/// (they are the ones with small weights).
///
/// Or, for F(2×2) in BF16 where the CPU multiplies bf16 pairs, U_ξ packed as pairs for the
/// `vdpbf16ps` (or AMX) GEMMs, whose inputs V are then narrowed to bf16 too: twice the FMA
/// rate on 16/36 of the products. F(4×4)'s transforms (points ±2, coefficients to 8) make bf16
/// rounding of U and V cost too much accuracy there: on a 256-channel layer with random
/// inputs, 2.4% RMS error against 0.38% for F(2×2) and 0.17% for the output's own rounding.
enum Transformed<T> {
    F32(Vec<PackedB<f32>>),
    Stored(Vec<PackedB<T>>),
    Pairs(Vec<PackedPairs>),
}

impl<T: Elem> Winograd<T> {
    /// From PyTorch's (cout, cin, 3, 3) weight, as storage type `T` rounds it, for an output
    /// of shape `out` (NCHW).
    pub fn new(
        tile: Tile,
        conv: &Conv2d,
        weight: &[f32],
        bias: Option<&[f32]>,
        out: &[usize],
    ) -> Self {
        let staged = staged(tile, conv, out);
        let u = if on_pairs::<T>(tile, conv) {
            Transformed::Pairs(transform_pairs::<T>(conv, weight))
        } else if staged && !T::IS_F32 {
            Transformed::Stored(transform_weights::<T, T>(tile, conv, weight))
        } else {
            Transformed::F32(transform_weights::<T, f32>(tile, conv, weight))
        };
        Winograd {
            tile,
            staged,
            u,
            bias: bias.map(<[f32]>::to_vec),
        }
    }

    /// The same weights for the same convolution with output `out` (another batch), on the
    /// schedule that output takes; `None` where they would be stored differently.
    pub fn for_output(mut self, conv: &Conv2d, out: &[usize]) -> Option<Self> {
        let staged = staged(self.tile, conv, out);
        // f32 sessions keep U in f32 on either schedule, and pairs are pairs on both (see
        // `Transformed`).
        if staged != self.staged && !T::IS_F32 && !matches!(self.u, Transformed::Pairs(_)) {
            return None;
        }
        self.staged = staged;
        Some(self)
    }

    pub fn tile(&self) -> Tile {
        self.tile
    }

    /// The row length (K padded) of V in bf16, where U is packed as pairs.
    fn pairs_kp(&self) -> Option<usize> {
        match &self.u {
            Transformed::Pairs(u) => Some(u[0].kp()),
            _ => None,
        }
    }

    /// The kernel name's form (`conv2d_<form>_<type>`): the tile's, `_dpbf16` (or `_amx`)
    /// added where its GEMMs multiply bf16 pairs.
    pub fn form(&self) -> String {
        match &self.u {
            Transformed::Pairs(u) if Engine::for_k(u[0].k) == Some(Engine::Amx) => {
                format!("{}_amx", self.tile.form())
            }
            Transformed::Pairs(_) => format!("{}_dpbf16", self.tile.form()),
            _ => self.tile.form().to_string(),
        }
    }

    fn positions(&self) -> usize {
        self.tile.alpha().pow(2)
    }

    pub fn bytes(&self) -> u64 {
        let u = match &self.u {
            Transformed::F32(u) => u.iter().map(|u| u.bytes()).sum::<u64>(),
            Transformed::Stored(u) => u.iter().map(|u| u.bytes()).sum::<u64>(),
            Transformed::Pairs(u) => u.iter().map(|u| u.bytes()).sum::<u64>(),
        };
        u + self.bias.as_ref().map_or(0, |b| b.len() as u64 * 4)
    }
}

/// Whether a layer with output `out` runs stage by stage (see [`conv2d`]): where its
/// transformed weights outweigh its tiles' transformed data.
fn staged(tile: Tile, conv: &Conv2d, out: &[usize]) -> bool {
    conv.in_channels * conv.out_channels > tile.tiles(out) * (conv.in_channels + conv.out_channels)
}

/// U_ξ[ci][co] = Σ_ij G[ξ/α][i] · g[co][ci][i][j] · G[ξ%α][j] for every position ξ, from
/// PyTorch's (cout, cin, 3, 3) weight as `T` rounds it, packed in `S`. All α² positions of
/// one input channel and one panel of output channels are computed together (G·g, then ·Gᵀ,
/// over the panel's columns at once) straight into the packed panels, in parallel over
/// panels: this runs for every eligible layer at start-up.
fn transform_weights<T: Elem, S: Elem>(
    tile: Tile,
    conv: &Conv2d,
    weight: &[f32],
) -> Vec<PackedB<S>> {
    let (cin, cout, a) = (conv.in_channels, conv.out_channels, tile.alpha());
    let g: Vec<[f32; 3]> = tile.g().iter().map(|r| r.map(|v| v as f32)).collect();
    PackedB::many_from_rows(a * a, cin, cout, |ci, co0, u: &mut [f32]| {
        // w[tap][column]: the panel's 3×3 kernels of input channel ci.
        let mut w = [[0f32; NR]; 9];
        for (jj, co) in (co0..cout.min(co0 + NR)).enumerate() {
            for (tap, &src) in weight[(co * cin + ci) * 9..][..9].iter().enumerate() {
                w[tap][jj] = T::from_f32(src).to_f32();
            }
        }
        // G·g: α × 3 (per column).
        let mut gg = [[[0f32; NR]; 3]; 6];
        for (row, gr) in gg.iter_mut().zip(&g) {
            for (j, v) in row.iter_mut().enumerate() {
                for jj in 0..NR {
                    v[jj] = gr[0] * w[j][jj] + gr[1] * w[3 + j][jj] + gr[2] * w[6 + j][jj];
                }
            }
        }
        // (G·g)·Gᵀ: α × α (per column).
        for (i, row) in gg[..a].iter().enumerate() {
            for (j, gc) in g.iter().enumerate() {
                let out = &mut u[(i * a + j) * NR..][..NR];
                for jj in 0..NR {
                    out[jj] = row[0][jj] * gc[0] + row[1][jj] * gc[1] + row[2][jj] * gc[2];
                }
            }
        }
    })
}

/// Whether a layer with `tile` multiplies bf16 pairs in its GEMMs (see [`Transformed`]).
fn on_pairs<T: Elem>(tile: Tile, conv: &Conv2d) -> bool {
    tile == Tile::F2 && super::kernels::uses_pairs::<T>(conv)
}

/// U_ξ for every position ξ of F(2×2), from PyTorch's (cout, cin, 3, 3) weight as `T` rounds
/// it, packed as bf16 pairs (rounded once more: U in bf16). All of U is computed first, in f32
/// (output channel by output channel, in parallel), then packed position by position.
fn transform_pairs<T: Elem>(conv: &Conv2d, weight: &[f32]) -> Vec<PackedPairs> {
    let (cin, cout, a) = (conv.in_channels, conv.out_channels, Tile::F2.alpha());
    let positions = a * a;
    let g: Vec<[f32; 3]> = Tile::F2.g().iter().map(|r| r.map(|v| v as f32)).collect();
    // u[(co·positions + ξ)·cin + ci]: each position's column co contiguous over ci.
    let mut u = vec![0f32; cout * positions * cin];
    u.par_chunks_mut(positions * cin)
        .enumerate()
        .for_each(|(co, u)| {
            for ci in 0..cin {
                let w: [f32; 9] = std::array::from_fn(|tap| {
                    T::from_f32(weight[(co * cin + ci) * 9 + tap]).to_f32()
                });
                // G·g (α × 3), then (G·g)·Gᵀ (α × α), as `transform_weights` computes them.
                let gg: Vec<[f32; 3]> = (g.iter())
                    .map(|gr| {
                        std::array::from_fn(|j| gr[0] * w[j] + gr[1] * w[3 + j] + gr[2] * w[6 + j])
                    })
                    .collect();
                for (i, row) in gg.iter().enumerate() {
                    for (j, gc) in g.iter().enumerate() {
                        u[(i * a + j) * cin + ci] =
                            row[0] * gc[0] + row[1] * gc[1] + row[2] * gc[2];
                    }
                }
            }
        });
    (0..positions)
        .map(|xi| {
            let column = |co: usize, col: &mut [f32]| {
                col.copy_from_slice(&u[(co * positions + xi) * cin..][..cin]);
            };
            PackedPairs::from_columns(cin, cout, column, None)
        })
        .collect()
}

/// Per worker, reused across chunks, layers and passes.
#[derive(Default)]
struct Scratch {
    /// Transformed inputs, tile-major: tiles × α² × cin.
    v: Vec<f32>,
    /// The same narrowed to bf16 for GEMMs on pairs, cin padded with zeros to their K step.
    vb: Vec<bf16>,
    /// GEMM results, tiles × α² × cout.
    m: Vec<f32>,
    t: TileScratch,
}

/// What one tile's transforms need.
#[derive(Default)]
struct TileScratch {
    /// One tile's α² input pixels and a half-transformed copy, α² × channels each.
    d: Vec<f32>,
    tmp: Vec<f32>,
    /// One tile's outputs (m² × cout) and the epilogue's widened residual.
    y: Vec<f32>,
    residual: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Tiles per work item: the chunk's transformed inputs and results stay about 1 MiB.
/// Fewer when that leaves too few work items for the workers.
fn chunk_tiles(positions: usize, cin: usize, cout: usize, tiles: usize, threads: usize) -> usize {
    let tile = sgemm::tile_rows();
    let fair = tiles.div_ceil(2 * threads.max(1)).next_multiple_of(tile);
    ((1 << 18) / positions / (cin + cout).max(1))
        .clamp(sgemm::MR * 2, sgemm::MR * 16)
        .next_multiple_of(tile)
        .min(fair)
        .min(tiles.max(1))
}

struct OutPtr<T>(*mut T);
// SAFETY: work items write the outputs of disjoint tiles.
unsafe impl<T> Send for OutPtr<T> {}
// SAFETY: as for Send: no two work items write the same output element.
unsafe impl<T> Sync for OutPtr<T> {}

/// What every chunk of one convolution shares.
struct Job<'a, T> {
    w: &'a Winograd<T>,
    x: &'a [T],
    xs: Nhwc,
    ys: Nhwc,
    /// Tiles per output row and column.
    th: usize,
    tw: usize,
    pad: (isize, isize),
    out: OutPtr<T>,
    epilogue: &'a Epilogue<'a, T>,
}

/// The convolution `x` (xs) → `y` (ys), NHWC, with the epilogue applied to each output row.
///
/// Two schedules. Where the tiles' transformed data outweighs the transformed weights, work
/// items are chunks of tiles, each through all three stages while its data stays in cache.
/// Where the weights outweigh it (deep layers at small batches: ResNet-50's 7×7 layers hold
/// 36 MB of F(4×4) weights for 4 tiles per image), chunks would each stream all the weights,
/// so the stages run one after the other over all tiles ("staged"), and the GEMMs are split by
/// position ξ: every U_ξ is read once.
pub fn conv2d<T: Elem>(
    w: &Winograd<T>,
    conv: &Conv2d,
    x: &[T],
    xs: Nhwc,
    y: &mut [T],
    ys: Nhwc,
    epilogue: &Epilogue<'_, T>,
) {
    let m = w.tile.m();
    let (th, tw) = (ys.h.div_ceil(m), ys.w.div_ceil(m));
    let tiles = ys.n * th * tw;
    let positions = w.positions();
    let threads = rayon::current_num_threads();
    let chunks = Chunks::new(
        tiles,
        chunk_tiles(positions, xs.c, ys.c, tiles, threads),
        sgemm::tile_rows(),
        threads,
    );
    assert!(y.len() >= ys.elems(), "conv2d output buffer too small");
    let job = Job {
        w,
        x,
        xs,
        ys,
        th,
        tw,
        pad: (conv.padding.0 as isize, conv.padding.1 as isize),
        out: OutPtr(y.as_mut_ptr()),
        epilogue,
    };
    let chunk = |c: usize| {
        let (t0, nt) = chunks.get(c);
        t0..t0 + nt
    };
    if !w.staged {
        (0..chunks.count()).into_par_iter().for_each(|c| {
            SCRATCH.with(|s| {
                let s = &mut *s.borrow_mut();
                let tiles = chunk(c);
                let (v, vb, mm) = (&mut s.v, &mut s.vb, &mut s.m);
                v.resize(tiles.len() * positions * xs.c, 0.0);
                mm.resize(tiles.len() * positions * ys.c, 0.0);
                with_simd(Inputs {
                    job: &job,
                    tiles: tiles.clone(),
                    v,
                    s: &mut s.t,
                });
                if let Some(kp) = w.pairs_kp() {
                    vb.resize(v.len() / xs.c * kp, bf16::ZERO);
                    narrow_rows(xs.c, kp, v, vb);
                }
                // SAFETY: `mm` is this work item's own buffer, sized for its tiles above.
                unsafe {
                    gemms(
                        &job,
                        tiles.len(),
                        (v, vb),
                        (mm.as_mut_ptr(), mm.len()),
                        0..positions,
                    )
                };
                with_simd(Outputs {
                    job: &job,
                    tiles,
                    mm,
                    s: &mut s.t,
                });
            })
        });
        return;
    }
    // Stage by stage, in buffers this (calling) thread keeps between calls.
    let (mut v, mut vb, mut mm) = SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        (
            std::mem::take(&mut s.v),
            std::mem::take(&mut s.vb),
            std::mem::take(&mut s.m),
        )
    });
    v.resize(tiles * positions * xs.c, 0.0);
    mm.resize(tiles * positions * ys.c, 0.0);
    chunks
        .split_mut(&mut v, positions * xs.c)
        .into_par_iter()
        .enumerate()
        .for_each(|(c, v)| {
            SCRATCH.with(|s| {
                with_simd(Inputs {
                    job: &job,
                    tiles: chunk(c),
                    v,
                    s: &mut s.borrow_mut().t,
                })
            })
        });
    if let Some(kp) = w.pairs_kp() {
        vb.resize(v.len() / xs.c * kp, bf16::ZERO);
        let rows = chunks.get(0).1.max(1) * positions;
        (v.par_chunks(rows * xs.c))
            .zip(vb.par_chunks_mut(rows * kp))
            .for_each(|(v, vb)| narrow_rows(xs.c, kp, v, vb));
    }
    let (v_all, mp) = ((&v[..], &vb[..]), OutPtr(mm.as_mut_ptr()));
    let (mp, m_len) = (&mp, mm.len());
    (0..positions).into_par_iter().for_each(|xi| {
        // SAFETY: position ξ's GEMM writes only M's rows of ξ (the columns [ξ·cout, (ξ + 1)·cout)
        // of every tile), disjoint from every other position's; V is complete and only read.
        unsafe { gemms(&job, tiles, v_all, (mp.0, m_len), xi..xi + 1) };
    });
    chunks
        .split_mut(&mut mm, positions * ys.c)
        .into_par_iter()
        .enumerate()
        .for_each(|(c, mm)| {
            SCRATCH.with(|s| {
                with_simd(Outputs {
                    job: &job,
                    tiles: chunk(c),
                    mm,
                    s: &mut s.borrow_mut().t,
                })
            })
        });
    SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        (s.v, s.vb, s.m) = (v, vb, mm);
    });
}

/// The input transform of `tiles` into `v` (tile-major: tiles × α² × cin), as vectorised work.
struct Inputs<'a, 'j, T> {
    job: &'a Job<'j, T>,
    tiles: Range<usize>,
    v: &'a mut [f32],
    s: &'a mut TileScratch,
}

impl<T: Elem> Vectorised for Inputs<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Inputs { job, tiles, v, s } = self;
        match job.w.tile {
            Tile::F2 => inputs_with::<T, Bt4, 4, 2>(job, tiles, v, s),
            Tile::F4 => inputs_with::<T, Bt6, 6, 4>(job, tiles, v, s),
        }
    }
}

/// The output transform of `tiles` from `mm` (tiles × α² × cout), with bias and epilogue, as
/// vectorised work.
struct Outputs<'a, 'j, T> {
    job: &'a Job<'j, T>,
    tiles: Range<usize>,
    mm: &'a [f32],
    s: &'a mut TileScratch,
}

impl<T: Elem> Vectorised for Outputs<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Outputs { job, tiles, mm, s } = self;
        match job.w.tile {
            Tile::F2 => outputs_with::<T, At4, 4, 2>(job, tiles, mm, s),
            Tile::F4 => outputs_with::<T, At6, 6, 4>(job, tiles, mm, s),
        }
    }
}

/// Transformed inputs `v` (rows of `cin`) narrowed to bf16 into `vb`, rows of `kp` (zeros
/// past cin): what the GEMMs on pairs multiply.
fn narrow_rows(cin: usize, kp: usize, v: &[f32], vb: &mut [bf16]) {
    for (src, dst) in v.chunks_exact(cin).zip(vb.chunks_exact_mut(kp)) {
        <bf16 as Elem>::narrow(src, &mut dst[..cin]);
        dst[cin..].fill(bf16::ZERO);
    }
}

/// The GEMMs of positions `xis` for `nt` tiles: V_ξ's rows are every tile's row ξ (stride
/// α²·cin), M_ξ's likewise (half-precision U_ξ widened a panel block at a time as it runs;
/// U_ξ on pairs multiplied by `vb`, V narrowed by [`narrow_for_pairs`], rows of kp).
///
/// # Safety
/// `mm` points at `mm.1` writable floats that nothing reads or writes during the call except
/// other calls for other positions (which touch other rows).
unsafe fn gemms<T: Elem>(
    job: &Job<'_, T>,
    nt: usize,
    (v, vb): (&[f32], &[bf16]),
    mm: (*mut f32, usize),
    xis: Range<usize>,
) {
    let (cin, cout) = (job.xs.c, job.ys.c);
    let positions = job.w.positions();
    assert!(mm.1 >= nt * positions * cout);
    let (c, ldc) = (|xi: usize| mm.0.wrapping_add(xi * cout), positions * cout);
    if let Transformed::Pairs(u) = &job.w.u {
        let engine =
            bf16_gemm::Engine::for_k(u[0].k).expect("pair packings exist only with an engine");
        let kp = u[0].kp();
        assert!(vb.len() >= nt * positions * kp);
        for xi in xis {
            let c = c(xi);
            // M_ξ's block rows, from L1 into place.
            let mut store = |d: bf16_gemm::Done<'_>| {
                let col = d.col;
                for (i, row) in d.rows() {
                    // SAFETY: row i < nt of M_ξ, columns d.col.. + d.cols ≤ cout, inside `mm`
                    // (asserted above).
                    unsafe {
                        let dst = c.add(i * ldc + col);
                        std::ptr::copy_nonoverlapping(row.as_ptr(), dst, row.len());
                    }
                }
            };
            // SAFETY: pair packings exist only where the engine runs; V_ξ holds nt rows of
            // kp bf16 (zeros past cin) spaced positions·kp apart inside `vb` (asserted above).
            unsafe {
                let a = vb.as_ptr().add(xi * kp);
                let panels = (0, u[xi].panels());
                bf16_gemm::gemm(
                    engine,
                    nt,
                    a,
                    positions * kp,
                    &u[xi],
                    panels,
                    None,
                    &mut store,
                )
            };
        }
        return;
    }
    assert!(v.len() >= nt * positions * cin);
    for xi in xis {
        // SAFETY: V_ξ holds nt rows of cin floats spaced positions·cin apart, M_ξ nt rows of
        // cout floats spaced positions·cout apart, inside `v` and `mm` (asserted above).
        unsafe {
            let (a, lda) = (v.as_ptr().add(xi * cin), positions * cin);
            match &job.w.u {
                Transformed::F32(u) => sgemm::gemm_packed_per_point(
                    nt,
                    a,
                    lda,
                    &u[xi],
                    (0, u[xi].panels()),
                    c(xi),
                    ldc,
                ),
                Transformed::Stored(u) => sgemm::gemm_packed_per_point(
                    nt,
                    a,
                    lda,
                    &u[xi],
                    (0, u[xi].panels()),
                    c(xi),
                    ldc,
                ),
                Transformed::Pairs(_) => unreachable!("above"),
            }
        }
    }
}

#[inline(always)]
fn inputs_with<T: Elem, B: Transform<A, A>, const A: usize, const M: usize>(
    job: &Job<'_, T>,
    tiles: Range<usize>,
    v: &mut [f32],
    s: &mut TileScratch,
) {
    let (xs, cin) = (job.xs, job.xs.c);
    let positions = A * A;
    s.d.resize(positions * cin, 0.0);
    s.tmp.resize(positions * cin.max(job.ys.c), 0.0);
    // f32 activations are read in place where a tile's window lies inside the image.
    let direct = T::as_f32(job.x);
    for (t, vt) in tiles.zip(v.chunks_exact_mut(positions * cin)) {
        let (b, ty, tx) = tile_position(t, job.th, job.tw);
        let (y0, x0) = ((M * ty) as isize - job.pad.0, (M * tx) as isize - job.pad.1);
        // Input pixel (i, j) of the window, where it lies inside the image.
        let pixel = |i: usize, j: usize| {
            let (iy, ix) = ((y0 + i as isize) as usize, (x0 + j as isize) as usize);
            ((b * xs.h + iy) * xs.w + ix) * cin
        };
        let inside = y0 >= 0 && x0 >= 0 && y0 as usize + A <= xs.h && x0 as usize + A <= xs.w;
        if let (Some(x), true) = (direct, inside) {
            let rows = vt.chunks_exact_mut(A * cin);
            transform_2d::<B, A, A>(|i, j| &x[pixel(i, j)..][..cin], cin, &mut s.tmp, rows);
            continue;
        }
        for i in 0..A {
            let iy = y0 + i as isize;
            for j in 0..A {
                let ix = x0 + j as isize;
                let dst = &mut s.d[(i * A + j) * cin..][..cin];
                if iy < 0 || ix < 0 || iy >= xs.h as isize || ix >= xs.w as isize {
                    dst.fill(0.0);
                } else {
                    let at = pixel(i, j);
                    T::widen(&job.x[at..at + cin], dst);
                }
            }
        }
        let d = &s.d;
        let rows = vt.chunks_exact_mut(A * cin);
        transform_2d::<B, A, A>(|i, j| &d[(i * A + j) * cin..][..cin], cin, &mut s.tmp, rows);
    }
}

#[inline(always)]
fn outputs_with<T: Elem, O: Transform<A, M>, const A: usize, const M: usize>(
    job: &Job<'_, T>,
    tiles: Range<usize>,
    mm: &[f32],
    s: &mut TileScratch,
) {
    let (ys, cout) = (job.ys, job.ys.c);
    let positions = A * A;
    s.y.resize(M * M * cout, 0.0);
    s.tmp.resize(positions * cout.max(job.xs.c), 0.0);
    for (t, mt) in tiles.zip(mm.chunks_exact(positions * cout)) {
        let (b, ty, tx) = tile_position(t, job.th, job.tw);
        let src = |i: usize, j: usize| &mt[(i * A + j) * cout..][..cout];
        let flat = |r: usize, c: usize| ((b * ys.h + M * ty + r) * ys.w + M * tx + c) * cout;
        let whole = M * ty + M <= ys.h && M * tx + M <= ys.w;
        if T::IS_F32 && whole {
            // f32 outputs of a whole tile: each output row's M pixels are contiguous in the
            // image, so the transform writes them in place.
            // SAFETY: the tile's output pixels belong to this tile only; with T = f32 the
            // output holds f32 values.
            let row = |r: usize| unsafe {
                std::slice::from_raw_parts_mut(job.out.0.add(flat(r, 0)).cast::<f32>(), M * cout)
            };
            transform_2d::<O, A, M>(src, cout, &mut s.tmp, (0..M).map(row));
            for r in 0..M {
                for (c, px) in row(r).chunks_exact_mut(cout).enumerate() {
                    finish(job, px, flat(r, c), &mut s.residual);
                }
            }
            continue;
        }
        transform_2d::<O, A, M>(src, cout, &mut s.tmp, s.y.chunks_exact_mut(M * cout));
        for (r, rows) in s.y.chunks_exact_mut(M * cout).enumerate() {
            if M * ty + r >= ys.h {
                break;
            }
            for (c, row) in rows.chunks_exact_mut(cout).enumerate() {
                if M * tx + c >= ys.w {
                    break;
                }
                let at = flat(r, c);
                finish(job, row, at, &mut s.residual);
                // SAFETY: this pixel's cout outputs belong to this tile only.
                let dst = unsafe { std::slice::from_raw_parts_mut(job.out.0.add(at), cout) };
                T::narrow(row, dst);
            }
        }
    }
}

/// Bias and epilogue of the output pixel at flat index `at`.
#[inline(always)]
fn finish<T: Elem>(job: &Job<'_, T>, px: &mut [f32], at: usize, residual: &mut Vec<f32>) {
    if let Some(bias) = &job.w.bias {
        px.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
    }
    job.epilogue.apply(px, at, residual);
}

/// Tile index → (image, tile row, tile column).
fn tile_position(t: usize, th: usize, tw: usize) -> (usize, usize, usize) {
    (t / (th * tw), (t / tw) % th, t % tw)
}

/// A 1-D transform of `I` channel vectors into `O`, all `c` long.
trait Transform<const I: usize, const O: usize> {
    fn apply(d: [&[f32]; I], o: [&mut [f32]; O], c: usize);
}

/// `out` = L·`src`·Lᵀ for one tile, all `c` channels, with the 1-D transform L (`O` × `I`):
/// `src(i, j)` is input (i, j)'s channel vector, `out` yields the O channel vectors of output row
/// r in turn (O·c contiguous floats), `tmp` at least I·O·c.
#[inline(always)]
fn transform_2d<'s, 'o, L: Transform<I, O>, const I: usize, const O: usize>(
    src: impl Fn(usize, usize) -> &'s [f32],
    c: usize,
    tmp: &mut [f32],
    out: impl Iterator<Item = &'o mut [f32]>,
) {
    // Columns: tmp[j][r] = Σ_i L[r][i]·src[i][j], each column's results contiguous.
    for (j, col) in tmp[..I * O * c].chunks_exact_mut(O * c).enumerate() {
        let input = std::array::from_fn(|i| src(i, j));
        let mut rows = col.chunks_exact_mut(c);
        L::apply(input, std::array::from_fn(|_| rows.next().unwrap()), c);
    }
    // Rows: out[r][s] = Σ_j tmp[j][r]·L[s][j].
    for (r, row) in out.take(O).enumerate() {
        let input = std::array::from_fn(|j| &tmp[(j * O + r) * c..][..c]);
        let mut cols = row[..O * c].chunks_exact_mut(c);
        L::apply(input, std::array::from_fn(|_| cols.next().unwrap()), c);
    }
}

/// Apply `f`, a 1-D transform of one channel's `I` values into `O`, to all `c` channels: 16
/// channels at a time through local arrays, which the compiler turns into vector
/// instructions, then the rest one by one. Written over the slices directly, the loop stayed
/// scalar (its twelve slices might overlap, for all the compiler knew), and the transforms
/// were 40% of a 64-channel layer's time.
#[inline(always)]
fn lanes<const I: usize, const O: usize>(
    d: [&[f32]; I],
    mut o: [&mut [f32]; O],
    c: usize,
    f: impl Fn([f32; I]) -> [f32; O],
) {
    const W: usize = 16;
    let whole = c - c % W;
    for k in (0..whole).step_by(W) {
        let x: [[f32; W]; I] = std::array::from_fn(|i| d[i][k..k + W].try_into().unwrap());
        let mut y = [[0f32; W]; O];
        for l in 0..W {
            let out = f(std::array::from_fn(|i| x[i][l]));
            for (y, v) in y.iter_mut().zip(out) {
                y[l] = v;
            }
        }
        for (o, y) in o.iter_mut().zip(&y) {
            o[k..k + W].copy_from_slice(y);
        }
    }
    for k in whole..c {
        let out = f(std::array::from_fn(|i| d[i][k]));
        for (o, v) in o.iter_mut().zip(out) {
            o[k] = v;
        }
    }
}

/// Bᵀ of F(2×2): [[1,0,−1,0],[0,1,1,0],[0,−1,1,0],[0,1,0,−1]].
struct Bt4;
impl Transform<4, 4> for Bt4 {
    #[inline(always)]
    fn apply(d: [&[f32]; 4], o: [&mut [f32]; 4], c: usize) {
        lanes(d, o, c, |[a, b, e, f]| [a - e, b + e, e - b, b - f]);
    }
}

/// Bᵀ of F(4×4): [[4,0,−5,0,1,0],[0,−4,−4,1,1,0],[0,4,−4,−1,1,0],[0,−2,−1,2,1,0],
/// [0,2,−1,−2,1,0],[0,4,0,−5,0,1]].
struct Bt6;
impl Transform<6, 6> for Bt6 {
    #[inline(always)]
    fn apply(d: [&[f32]; 6], o: [&mut [f32]; 6], c: usize) {
        lanes(d, o, c, |[x0, x1, x2, x3, x4, x5]| {
            [
                4.0 * x0 - 5.0 * x2 + x4,
                (x3 + x4) - 4.0 * (x1 + x2),
                (x4 - x3) + 4.0 * (x1 - x2),
                (x4 - x2) - 2.0 * (x1 - x3),
                (x4 - x2) + 2.0 * (x1 - x3),
                4.0 * x1 - 5.0 * x3 + x5,
            ]
        });
    }
}

/// Aᵀ of F(2×2): [[1,1,1,0],[0,1,−1,−1]].
struct At4;
impl Transform<4, 2> for At4 {
    #[inline(always)]
    fn apply(m: [&[f32]; 4], o: [&mut [f32]; 2], c: usize) {
        lanes(m, o, c, |[m0, m1, m2, m3]| [m0 + m1 + m2, m1 - m2 - m3]);
    }
}

/// Aᵀ of F(4×4): [[1,1,1,1,1,0],[0,1,−1,2,−2,0],[0,1,1,4,4,0],[0,1,−1,8,−8,1]].
struct At6;
impl Transform<6, 4> for At6 {
    #[inline(always)]
    fn apply(m: [&[f32]; 6], o: [&mut [f32]; 4], c: usize) {
        lanes(m, o, c, |[m0, m1, m2, m3, m4, m5]| {
            let (p12, n12) = (m1 + m2, m1 - m2);
            let (p34, n34) = (m3 + m4, m3 - m4);
            [
                m0 + p12 + p34,
                n12 + 2.0 * n34,
                p12 + 4.0 * p34,
                n12 + 8.0 * n34 + m5,
            ]
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// L applied to `input` (one channel).
    fn apply<L: Transform<I, O>, const I: usize, const O: usize>(input: &[f32]) -> Vec<f32> {
        let mut out = [[0f32]; O];
        let mut rows = out.iter_mut().map(|r| r.as_mut_slice());
        L::apply(
            std::array::from_fn(|i| std::slice::from_ref(&input[i])),
            std::array::from_fn(|_| rows.next().unwrap()),
            1,
        );
        out.iter().map(|r| r[0]).collect()
    }

    /// The default tiles of ResNet-50's 3×3 stride-1 layers, with and without bf16 pairs (the
    /// measurements are at [`by_default`]).
    #[test]
    fn default_tiles_follow_the_measurements() {
        let conv = |c| Conv2d::new(c, c, 3, 1, 1);
        let out = |n, c, hw| [n, c, hw, hw];
        let cases = [
            // (batch, channels, side): without pairs, with pairs
            ((8, 64, 56), Some(Tile::F4), Some(Tile::F4)),
            ((8, 128, 28), Some(Tile::F4), Some(Tile::F4)),
            ((8, 256, 14), Some(Tile::F4), Some(Tile::F2)),
            ((8, 512, 7), Some(Tile::F4), Some(Tile::F2)),
            ((1, 256, 14), Some(Tile::F4), Some(Tile::F2)),
            ((1, 512, 7), Some(Tile::F2), None),
            ((32, 512, 7), Some(Tile::F4), Some(Tile::F2)),
        ];
        for ((n, c, hw), plain, pairs) in cases {
            let o = out(n, c, hw);
            assert_eq!(by_default(&conv(c), &o, None), plain, "{o:?} without pairs");
            assert_eq!(
                by_default(&conv(c), &o, Some(Engine::Dot)),
                pairs,
                "{o:?} on pairs"
            );
        }
        // Too few channels for the transforms to pay, and not a 3×3 stride-1 layer.
        assert_eq!(
            by_default(&conv(16), &out(8, 16, 56), Some(Engine::Dot)),
            None
        );
        let strided = Conv2d::new(64, 64, 3, 2, 1);
        assert_eq!(by_default(&strided, &out(8, 64, 28), None), None);
    }

    /// The 1-D identity behind both tiles: Aᵀ·((G·g) ⊙ (Bᵀ·d)) is the valid correlation of d
    /// with the 3 taps g, for the transforms as the kernels apply them.
    #[test]
    fn one_dimensional_transforms_correlate() {
        let d = [0.3f32, -1.2, 2.0, 0.7, -0.4, 1.1];
        let g = [0.5f64, -0.25, 1.5];
        for tile in [Tile::F2, Tile::F4] {
            let v = match tile {
                Tile::F2 => apply::<Bt4, 4, 4>(&d),
                Tile::F4 => apply::<Bt6, 6, 6>(&d),
            };
            let prod: Vec<f32> = v
                .iter()
                .zip(tile.g())
                .map(|(&v, row)| v * (0..3).map(|i| row[i] * g[i]).sum::<f64>() as f32)
                .collect();
            let out = match tile {
                Tile::F2 => apply::<At4, 4, 2>(&prod),
                Tile::F4 => apply::<At6, 6, 4>(&prod),
            };
            assert_eq!(out.len(), tile.m());
            for (r, o) in out.iter().enumerate() {
                let want: f64 = (0..3).map(|i| d[r + i] as f64 * g[i]).sum();
                assert!(
                    (*o as f64 - want).abs() < 1e-5,
                    "{tile:?} output {r}: {o} vs {want}"
                );
            }
        }
    }
}

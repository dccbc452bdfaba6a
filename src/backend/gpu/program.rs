//! A planned graph as a list of kernel launches, library GEMMs and library convolutions over
//! numbered buffers, for the CUDA and HIP backends (and the CPU emulator of their kernels): the
//! program's types, the argument packing, the launch shapes and the choice of convolution
//! kernel. Building one (`lower.rs`) is plain arithmetic too, so both are tested without a
//! device; a `Device` then only allocates, uploads and launches what the program says.

use crate::backend::BackendError;
use crate::model::Precision;

/// A buffer of the program, by index into [`Program::buffers`].
pub type BufId = usize;

/// One field of a kernel's argument struct, in declaration order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    Buf(BufId),
    /// A pointer `bytes` into a buffer.
    At(BufId, u64),
    /// A pointer the kernel does not read (an absent bias or residual).
    Null,
    I32(i32),
    F32(f32),
}

/// The bytes of a C struct holding `args` in order: pointers 8-aligned, 32-bit values 4-aligned,
/// the size rounded up to 8 (the struct's alignment when it holds a pointer). `ptr` gives a
/// buffer's device address.
pub fn pack(args: &[Arg], ptr: impl Fn(BufId) -> u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(args.len() * 8);
    for a in args {
        match *a {
            Arg::Buf(_) | Arg::At(..) | Arg::Null => {
                out.resize(out.len().next_multiple_of(8), 0);
                let p = match *a {
                    Arg::Buf(b) => ptr(b),
                    Arg::At(b, bytes) => ptr(b) + bytes,
                    _ => 0,
                };
                out.extend_from_slice(&p.to_ne_bytes());
            }
            Arg::I32(v) => out.extend_from_slice(&v.to_ne_bytes()),
            Arg::F32(v) => out.extend_from_slice(&v.to_ne_bytes()),
        }
    }
    out.resize(out.len().next_multiple_of(8).max(8), 0);
    out
}

/// Threads per block of every launch.
pub const BLOCK: u32 = crate::backend::THREADS_PER_BLOCK;

/// The largest grid dimension every CUDA and HIP device takes in y and z (and our x, folded).
pub const MAX_GRID: u32 = 65_535;

/// A 1-D launch of `total` threads folded into a 2-D grid (the kernels' `linear_index`).
pub fn grid_1d(total: usize) -> Result<[u32; 3], BackendError> {
    let grid = crate::backend::fold_grid(total, MAX_GRID);
    if grid[1] > MAX_GRID {
        return Err(BackendError::DeviceLimit(format!(
            "{total} threads are more than one launch takes: use a smaller batch"
        )));
    }
    Ok(grid)
}

/// Must match CONV_CO_TILE in kernels/gpu/ops.cuh.
pub const CONV_CO_TILE: usize = 8;

/// Conv weights `(cout, cin_g, kh·kw)` reordered to `(cout, kh·kw, cin_g)`: the reduction
/// order of the tiled kernels' `kc` mode.
pub fn window_major(w: &[f32], cin_g: usize, taps: usize) -> Vec<f32> {
    let per = cin_g * taps;
    let mut out = vec![0.0; w.len()];
    for (o, i) in out.chunks_exact_mut(per).zip(w.chunks_exact(per)) {
        for ci in 0..cin_g {
            for t in 0..taps {
                o[t * cin_g + ci] = i[ci * taps + t];
            }
        }
    }
    out
}

/// What a convolution's columns (its im2col matrix) are, for the tiled kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ConvShape {
    /// Gathered from x through the window.
    General,
    /// x itself: a 1×1, stride-1, unpadded convolution.
    Pointwise,
    /// x's rows: a pointwise convolution of 1×1 images (a linear layer).
    Linear,
}

/// The tiled conv kernels of ops.cuh by [tensor cores][`ConvShape`][64- or 128-wide tiles].
const TILED: [[[&str; 2]; 3]; 2] = [
    [
        ["conv2d_t64", "conv2d_t128"],
        ["conv2d_pw_t64", "conv2d_pw_t128"],
        ["conv2d_lin_t64", "conv2d_lin_t128"],
    ],
    [
        ["conv2d_mma_t64", "conv2d_mma_t128"],
        ["conv2d_pw_mma_t64", "conv2d_pw_mma_t128"],
        ["conv2d_lin_mma_t64", "conv2d_lin_mma_t128"],
    ],
];

/// The conv kernel for a layer and its grid. Layers with enough arithmetic per output take the
/// tiled implicit GEMM (`conv2d_t128`, or `conv2d_t64` when 128-wide tiles would leave a large
/// GPU with too few blocks, or the layer has at most 64 output channels; `pw` for 1×1,
/// stride-1, unpadded layers, which read x as their columns, `lin` for those on 1×1 images,
/// linear layers); thin ones (depthwise, few outputs or a short reduction) the direct kernel:
/// x over output pixels, y over groups × blocks of CONV_CO_TILE channels.
pub fn conv_kernel(
    pixels: usize,
    out_channels: usize,
    groups: usize,
    reduction: usize,
    shape: ConvShape,
    mma: bool,
) -> Result<(&'static str, [u32; 3]), BackendError> {
    let cout_g = out_channels / groups;
    let tiles = |m: usize, n: usize| (pixels.div_ceil(n), groups * cout_g.div_ceil(m));
    let (kernel, (gx, gy)) = if reduction < 32 || cout_g < 32 {
        (
            "conv2d",
            (
                pixels.div_ceil(BLOCK as usize).max(1),
                groups * cout_g.div_ceil(CONV_CO_TILE),
            ),
        )
    } else if let (x, y) = tiles(128, 128)
        && x * y >= 256
        && cout_g > 64
    {
        (TILED[mma as usize][shape as usize][1], (x, y))
    } else {
        (TILED[mma as usize][shape as usize][0], tiles(64, 64))
    };
    if gx > i32::MAX as usize || gy > MAX_GRID as usize {
        return Err(BackendError::DeviceLimit(format!(
            "a convolution over {pixels} pixels and {out_channels} channels in {groups} groups \
             needs a larger grid than devices take: use a smaller batch"
        )));
    }
    Ok((kernel, [gx.max(1) as u32, gy as u32, 1]))
}

/// A kernel launch of the program.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelLaunch {
    /// The `extern "C"` name in kernels/gpu/ops.cuh.
    pub kernel: &'static str,
    pub grid: [u32; 3],
    pub args: Vec<Arg>,
}

/// A library GEMM in row-major terms, batched with strides (in elements):
/// `C[i]` (m×n) = `A[i]` (m×k) · `B[i]` (k×n), where B is stored n×k when `trans_b`.
/// Storage is the session's precision; accumulation is f32; C is overwritten.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: BufId,
    pub b: BufId,
    pub c: BufId,
    pub trans_b: bool,
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

/// The same GEMM as a column-major library sees it (cuBLAS, rocBLAS): a row-major matrix is its
/// transpose in column-major, so C = A·B is computed as Cᵀ = Bᵀ·Aᵀ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColumnMajor {
    pub trans_first: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// The first operand (our B) and its leading dimension and stride.
    pub first: BufId,
    pub ld_first: usize,
    pub stride_first: usize,
    /// The second operand (our A).
    pub second: BufId,
    pub ld_second: usize,
    pub stride_second: usize,
    pub c: BufId,
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
}

impl Gemm {
    pub fn column_major(&self) -> ColumnMajor {
        ColumnMajor {
            trans_first: self.trans_b,
            m: self.n,
            n: self.m,
            k: self.k,
            first: self.b,
            ld_first: if self.trans_b { self.k } else { self.n },
            stride_first: self.stride_b,
            second: self.a,
            ld_second: self.k,
            stride_second: self.stride_a,
            c: self.c,
            ldc: self.n,
            stride_c: self.stride_c,
            batch: self.batch,
        }
    }

    pub fn flops(&self) -> u64 {
        2 * (self.m * self.n * self.k * self.batch) as u64
    }
}

/// A library convolution (cuDNN, MIOpen) of NCHW tensors in the session's precision with f32
/// accumulation: `y` is overwritten; bias, activation and residual follow in our epilogue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LibConv {
    pub batch: usize,
    /// Channels, height and width of the input and of the output.
    pub input: [usize; 3],
    pub output: [usize; 3],
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
    pub x: BufId,
    /// Weights as PyTorch stores them: out × in/groups × kh × kw.
    pub w: BufId,
    pub y: BufId,
}

impl LibConv {
    /// The dimensions as the libraries' `int` arguments: input, weights, output (each NCHW),
    /// then padding, stride and dilation (each height, width), then the groups. Checked when
    /// the program is built, so a device's call cannot overflow.
    pub fn dims(&self) -> Result<LibConvDims, BackendError> {
        let i = |v: usize| i32_of(v, "a library convolution's size");
        let [ci, hi, wi] = self.input;
        let [co, ho, wo] = self.output;
        let n = i(self.batch)?;
        Ok(LibConvDims {
            x: [n, i(ci)?, i(hi)?, i(wi)?],
            w: [
                i(co)?,
                i(ci / self.groups.max(1))?,
                i(self.kernel.0)?,
                i(self.kernel.1)?,
            ],
            y: [n, i(co)?, i(ho)?, i(wo)?],
            padding: [i(self.padding.0)?, i(self.padding.1)?],
            stride: [i(self.stride.0)?, i(self.stride.1)?],
            dilation: [i(self.dilation.0)?, i(self.dilation.1)?],
            groups: i(self.groups)?,
        })
    }
}

/// The most workspace one library convolution may take: an algorithm asking more (an FFT on a
/// large layer can ask for gigabytes) is passed over for the next best.
pub const WORKSPACE_LIMIT: u64 = 1 << 30;

/// [`LibConv`]'s sizes as `int`s, in the order cuDNN and MIOpen take them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LibConvDims {
    pub x: [i32; 4],
    pub w: [i32; 4],
    pub y: [i32; 4],
    pub padding: [i32; 2],
    pub stride: [i32; 2],
    pub dilation: [i32; 2],
    pub groups: i32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    Kernel(KernelLaunch),
    Gemm(Gemm),
    Conv(LibConv),
}

/// One piece of work and the graph node it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// The node's module name, or `output` for the final conversion.
    pub node: String,
    pub op: &'static str,
    pub work: Work,
}

impl Task {
    /// The kernel's name as profiles show it.
    pub fn kernel_name(&self, precision: Precision) -> String {
        match &self.work {
            Work::Kernel(l) => format!("{}_{}", l.kernel, precision.name()),
            Work::Gemm(_) => format!("vendor_gemm_{}", precision.name()),
            Work::Conv(_) => format!("vendor_conv_{}", precision.name()),
        }
    }
}

/// What a buffer holds when the session starts.
#[derive(Debug, Clone, PartialEq)]
pub enum Contents {
    /// Weights, already in the storage type.
    Weights(Vec<u8>),
    /// Activations, scratch, the input and the output: written by the program.
    Empty,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Buffer {
    pub bytes: u64,
    pub contents: Contents,
}

/// A planned graph, ready to be laid out on a device.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    pub buffers: Vec<Buffer>,
    pub tasks: Vec<Task>,
    /// The f32 NCHW input the host writes.
    pub input: BufId,
    /// The f32 output the host reads, in the plan's logical shape.
    pub output: BufId,
    pub input_shape: Vec<usize>,
    pub output_shape: Vec<usize>,
    pub precision: Precision,
}

impl Program {
    pub fn weight_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .filter(|b| matches!(b.contents, Contents::Weights(_)))
            .map(|b| b.bytes)
            .sum()
    }

    /// Everything else: activations (reused once dead), scratch, input and output.
    pub fn activation_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .filter(|b| b.contents == Contents::Empty)
            .map(|b| b.bytes)
            .sum()
    }
}

pub(super) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    Precision::Fp32.storage_bytes(v)
}

pub(super) fn i32_of(v: usize, what: &str) -> Result<i32, BackendError> {
    i32::try_from(v).map_err(|_| {
        BackendError::DeviceLimit(format!(
            "{what} is {v}, more than the kernels' 32-bit indices take: use a smaller batch"
        ))
    })
}

/// Batched row-major GEMMs (3×5 by 5×4, two of them), B stored either way, computed by
/// `run` (the GEMM, its buffers `[a, b, c]` as ids 0, 1, 2, c filled with NaN) and checked
/// against the plain product: for anything that claims to compute a [`Gemm`].
#[cfg(test)]
pub(crate) fn check_gemms(mut run: impl FnMut(&Gemm, &mut [Vec<f32>; 3])) {
    let (m, n, k, batch) = (3, 4, 5, 2);
    let a: Vec<f32> = (0..batch * m * k).map(|v| (v % 7) as f32 - 3.0).collect();
    let b: Vec<f32> = (0..batch * k * n).map(|v| (v % 5) as f32 * 0.5).collect();
    for trans_b in [false, true] {
        // B stored n×k when transposed: the same matrix, laid out the other way.
        let at = |s: usize, j: usize, l: usize| b[s * k * n + l * n + j];
        let stored_b: Vec<f32> = if trans_b {
            (0..batch)
                .flat_map(|s| (0..n).flat_map(move |j| (0..k).map(move |l| at(s, j, l))))
                .collect()
        } else {
            b.clone()
        };
        let g = Gemm {
            m,
            n,
            k,
            a: 0,
            b: 1,
            c: 2,
            trans_b,
            batch,
            stride_a: m * k,
            stride_b: k * n,
            stride_c: m * n,
        };
        let mut bufs = [a.clone(), stored_b, vec![f32::NAN; batch * m * n]];
        run(&g, &mut bufs);
        for s in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|l| a[s * m * k + i * k + l] * at(s, j, l)).sum();
                    assert_eq!(bufs[2][s * m * n + i * n + j], want, "trans_b {trans_b}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_pack_like_a_c_struct() {
        // struct { const float* x; float* y; int total; float lo; float hi; } → 8+8+4+4+4 = 28,
        // rounded up to the struct's 8-byte alignment.
        let b = pack(
            &[
                Arg::Buf(0),
                Arg::Buf(1),
                Arg::I32(7),
                Arg::F32(0.0),
                Arg::F32(6.0),
            ],
            |i| 0x1000 + i as u64 * 0x100,
        );
        assert_eq!(b.len(), 32);
        assert_eq!(u64::from_ne_bytes(b[8..16].try_into().unwrap()), 0x1100);
        assert_eq!(i32::from_ne_bytes(b[16..20].try_into().unwrap()), 7);
        assert_eq!(f32::from_ne_bytes(b[24..28].try_into().unwrap()), 6.0);
        // A pointer after an odd number of ints is realigned; a null pointer is zero.
        let b = pack(&[Arg::I32(1), Arg::Null, Arg::I32(2)], |_| 9);
        assert_eq!(b.len(), 24);
        assert_eq!(&b[4..16], &[0u8; 12]);
    }

    #[test]
    fn window_major_weights_run_tap_by_tap() {
        // Two output channels, 2 input channels, 3 taps: w[co][ci][t] = 100co + 10ci + t.
        let w: Vec<f32> = (0..2)
            .flat_map(|co| {
                (0..2).flat_map(move |ci| (0..3).map(move |t| (100 * co + 10 * ci + t) as f32))
            })
            .collect();
        let r = window_major(&w, 2, 3);
        assert_eq!(
            r,
            [
                0., 10., 1., 11., 2., 12., 100., 110., 101., 111., 102., 112.
            ]
        );
    }

    #[test]
    fn launches_fold_into_grids_devices_take() {
        assert_eq!(grid_1d(1).unwrap(), [1, 1, 1]);
        assert_eq!(grid_1d(256).unwrap(), [1, 1, 1]);
        assert_eq!(grid_1d(257).unwrap(), [2, 1, 1]);
        let g = grid_1d(65_536 * 256).unwrap();
        assert_eq!(g, [65_535, 2, 1]);
        assert!((g[0] as usize * g[1] as usize) * 256 >= 65_536 * 256);
        assert!(grid_1d(usize::MAX / 2).is_err());
        // ResNet-50's stem at batch 32: 3·7·7 = 147 deep, 64 channels: 128-wide tiles.
        use ConvShape::*;
        // ResNet-50's stem at batch 32: 3·7·7 = 147 deep, but 64 channels: 64-wide tiles.
        let stem = conv_kernel(32 * 112 * 112, 64, 1, 147, General, false).unwrap();
        assert_eq!(stem, ("conv2d_t64", [6272, 1, 1]));
        let wide = conv_kernel(32 * 56 * 56, 256, 1, 64, Pointwise, false).unwrap();
        assert_eq!(wide, ("conv2d_pw_t128", [784, 2, 1]));
        // Its last 3×3 conv at batch 1: 49 pixels, 512 channels: the smaller tiles.
        let late = conv_kernel(49, 512, 1, 4608, General, false).unwrap();
        assert_eq!(late, ("conv2d_t64", [1, 8, 1]));
        let expand = conv_kernel(49, 2048, 1, 512, Pointwise, false).unwrap();
        assert_eq!(expand, ("conv2d_pw_t64", [1, 32, 1]));
        let fc = conv_kernel(32, 1000, 1, 2048, Linear, false).unwrap();
        assert_eq!(fc, ("conv2d_lin_t64", [1, 16, 1]));
        // Half precision on tensor cores: the same tiles.
        let wide = conv_kernel(32 * 56 * 56, 256, 1, 64, Pointwise, true).unwrap();
        assert_eq!(wide, ("conv2d_pw_mma_t128", [784, 2, 1]));
        let fc = conv_kernel(32, 1000, 1, 2048, Linear, true).unwrap();
        assert_eq!(fc, ("conv2d_lin_mma_t64", [1, 16, 1]));
        // Depthwise: the direct kernel, one block per group of 1 channel.
        assert_eq!(
            conv_kernel(100, 960, 960, 9, General, false).unwrap(),
            ("conv2d", [1, 960, 1])
        );
        assert!(conv_kernel(100, 70_000 * 8, 70_000, 9, General, false).is_err());
    }

    /// A column-major GEMM as cuBLAS computes it, on f32 slices.
    fn column_major_gemm(g: &ColumnMajor, bufs: &mut [Vec<f32>]) {
        for batch in 0..g.batch {
            for j in 0..g.n {
                for i in 0..g.m {
                    let mut acc = 0.0;
                    for l in 0..g.k {
                        let f = if g.trans_first {
                            l + i * g.ld_first
                        } else {
                            i + l * g.ld_first
                        };
                        acc += bufs[g.first][batch * g.stride_first + f]
                            * bufs[g.second][batch * g.stride_second + l + j * g.ld_second];
                    }
                    bufs[g.c][batch * g.stride_c + i + j * g.ldc] = acc;
                }
            }
        }
    }

    #[test]
    fn row_major_gemms_map_onto_column_major_calls() {
        check_gemms(|g, bufs| column_major_gemm(&g.column_major(), bufs));
        let (m, n, k, batch) = (3, 4, 5, 2);
        assert_eq!(
            Gemm {
                m,
                n,
                k,
                a: 0,
                b: 1,
                c: 2,
                trans_b: false,
                batch,
                stride_a: 0,
                stride_b: 0,
                stride_c: 0
            }
            .flops(),
            2 * 3 * 4 * 5 * 2
        );
    }
}

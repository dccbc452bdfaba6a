//! A planned graph as a list of kernel launches over numbered buffers, for the CUDA and HIP
//! backends (and the CPU emulator of their kernels). Building it is plain arithmetic — launch
//! shapes, argument structs, buffer reuse — so it is tested without a device; a `Device` then
//! only allocates, uploads and launches what the program says.

use crate::backend::{BackendError, KernelFamily};
use crate::model::op::{Act, Conv2d, Op, batch_norm_affine};
use crate::model::{Plan, Precision, Weights};

/// A buffer of the program, by index into [`Program::buffers`].
pub type BufId = usize;

/// One field of a kernel's argument struct, in declaration order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    Buf(BufId),
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
            Arg::Buf(_) | Arg::Null => {
                out.resize(out.len().next_multiple_of(8), 0);
                let p = if let Arg::Buf(b) = *a { ptr(b) } else { 0 };
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
pub const BLOCK: u32 = 256;
/// The largest grid dimension every CUDA and HIP device takes in y and z (and our x, folded).
pub const MAX_GRID: u32 = 65_535;

/// A 1-D launch of `total` threads folded into a 2-D grid (the kernels' `linear_index`).
pub fn grid_1d(total: usize) -> Result<[u32; 3], BackendError> {
    let blocks = total.div_ceil(BLOCK as usize).max(1);
    let gx = blocks.min(MAX_GRID as usize);
    let gy = blocks.div_ceil(gx);
    if gy > MAX_GRID as usize {
        return Err(BackendError::DeviceLimit(format!(
            "{total} threads are more than one launch takes: use a smaller batch"
        )));
    }
    Ok([gx as u32, gy as u32, 1])
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
pub struct Launch {
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

/// The same GEMM as a column-major library sees it (cuBLAS, hipBLAS): a row-major matrix is its
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

#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    Kernel(Launch),
    Gemm(Gemm),
}

/// One piece of work and the graph node it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The node's module name, or `output` for the final conversion.
    pub node: String,
    pub op: &'static str,
    pub work: Work,
}

impl Step {
    /// The kernel's name as profiles show it.
    pub fn kernel_name(&self, precision: Precision) -> String {
        match &self.work {
            Work::Kernel(l) => format!("{}_{}", l.kernel, precision.name()),
            Work::Gemm(_) => format!("vendor_gemm_{}", precision.name()),
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
    pub steps: Vec<Step>,
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

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    Precision::Fp32.storage_bytes(v)
}

fn i32_of(v: usize, what: &str) -> Result<i32, BackendError> {
    i32::try_from(v).map_err(|_| {
        BackendError::DeviceLimit(format!(
            "{what} is {v}, more than the kernels' 32-bit indices take: use a smaller batch"
        ))
    })
}

/// Builds a [`Program`]: weight buffers are added as they are needed; activation buffers are
/// laid out first, by [`Plan::assign_buffers`].
struct Builder {
    buffers: Vec<Buffer>,
    steps: Vec<Step>,
    /// Value (node id) → buffer.
    of: Vec<BufId>,
    precision: Precision,
}

impl Builder {
    fn buffer(&mut self, bytes: u64, contents: Contents) -> BufId {
        self.buffers.push(Buffer {
            bytes: bytes.next_multiple_of(8).max(8),
            contents,
        });
        self.buffers.len() - 1
    }

    fn weights(&mut self, values: &[f32]) -> BufId {
        let bytes = self.precision.storage_bytes(values);
        self.buffer(bytes.len() as u64, Contents::Weights(bytes))
    }

    fn f32s(&mut self, values: &[f32]) -> BufId {
        let bytes = f32_bytes(values);
        self.buffer(bytes.len() as u64, Contents::Weights(bytes))
    }

    fn launch(
        &mut self,
        node: &str,
        op: &'static str,
        kernel: &'static str,
        grid: [u32; 3],
        args: Vec<Arg>,
    ) {
        self.steps.push(Step {
            node: node.to_string(),
            op,
            work: Work::Kernel(Launch { kernel, grid, args }),
        });
    }
}

/// The epilogue fields of the conv kernel (and of the vendor path's epilogue kernel).
fn act_code(act: Act) -> i32 {
    match act {
        Act::None => 0,
        Act::Relu => 1,
        Act::Relu6 => 2,
    }
}

/// Lay `plan` out as kernel launches in `precision`. With [`KernelFamily::Vendor`], dense
/// convolutions and linear layers become library GEMMs (after an im2col for k×k convolutions)
/// followed by an epilogue kernel; grouped convolutions keep our kernel.
pub fn build(
    plan: &Plan,
    weights: &Weights,
    precision: Precision,
    family: KernelFamily,
    mma: bool,
) -> Result<Program, BackendError> {
    let mut b = Builder {
        buffers: Vec::new(),
        steps: Vec::new(),
        of: Vec::new(),
        precision,
    };
    let numel = |s: &[usize]| s.iter().product::<usize>();
    let esize = precision.bytes() as u64;
    let input_shape = plan.input_shape().to_vec();
    let output_shape = plan.output_shape().to_vec();
    let input = b.buffer(numel(&input_shape) as u64 * 4, Contents::Empty);
    // NCHW order is already the flattened order: dropout and flatten share their input's buffer.
    let renames = |id: usize| matches!(plan.graph.nodes[id].op, Op::Dropout { .. } | Op::Flatten);
    let bytes = |id: usize| (numel(&plan.shapes[id]) as u64 * esize).next_multiple_of(8);
    let assignment = plan.assign_buffers(|id| bytes(id).max(8), renames);
    let first = b.buffers.len();
    for &bytes in &assignment.bytes {
        b.buffer(bytes, Contents::Empty);
    }
    b.of = assignment.of.iter().map(|&a| first + a).collect();
    // One im2col buffer serves every vendor convolution (they run one after another).
    let mut scratch: Option<BufId> = None;
    let dims4 = |id: usize| -> (usize, usize, usize, usize) {
        match *plan.shapes[id].as_slice() {
            [n, c, h, w] => (n, c, h, w),
            [n, f] => (n, f, 1, 1),
            _ => (1, numel(&plan.shapes[id]), 1, 1),
        }
    };
    for (id, node) in plan.graph.nodes.iter().enumerate() {
        if renames(id) {
            continue;
        }
        let total = numel(&plan.shapes[id]);
        let (n, c, h, w) = dims4(id);
        let (_, xc, xh, xw) = node.inputs.first().map_or((0, 0, 0, 0), |&i| dims4(i));
        let at = NodeCtx {
            node,
            op: node.op.kind_name(),
            shape: &plan.shapes[id],
            out: (n, c, h, w),
            total,
            total_i: i32_of(total, &format!("`{}`'s size", node.name))?,
            input: (xc, xh, xw),
            x: node
                .inputs
                .first()
                .map_or(Arg::Null, |&i| Arg::Buf(b.of[i])),
            y: b.of[id],
            grid: grid_1d(total)?,
            weights,
        };
        match conv_like(&at)? {
            Some((conv, wt)) if family == KernelFamily::Vendor && conv.groups == 1 => {
                vendor_conv(&mut b, &at, &conv, wt, &mut scratch)?
            }
            Some((conv, wt)) => native_conv(&mut b, &at, &conv, wt, mma)?,
            None => other_op(&mut b, &at, input)?,
        }
    }
    let out_total = numel(&output_shape);
    let output = b.buffer(out_total as u64 * 4, Contents::Empty);
    let last = Arg::Buf(b.of[plan.graph.output]);
    b.launch(
        "output",
        "output",
        "to_f32",
        grid_1d(out_total)?,
        vec![last, Arg::Buf(output), Arg::I32(out_total as i32)],
    );
    Ok(Program {
        buffers: b.buffers,
        steps: b.steps,
        input,
        output,
        input_shape,
        output_shape,
        precision,
    })
}

/// What lowering one node knows: the node, its output (NCHW dims, elements, buffer, a 1-D
/// grid over it), its first input (channels, height, width, buffer) and the weights.
struct NodeCtx<'a> {
    node: &'a crate::model::graph::Node,
    op: &'static str,
    /// The output's logical shape, and as NCHW (features are (n, f, 1, 1)).
    shape: &'a [usize],
    out: (usize, usize, usize, usize),
    total: usize,
    total_i: i32,
    input: (usize, usize, usize),
    x: Arg,
    y: BufId,
    grid: [u32; 3],
    weights: &'a Weights,
}

impl<'a> NodeCtx<'a> {
    /// The node's parameter `suffix` (`weight`, `bias`, ...).
    fn get(&self, suffix: &str) -> Result<&'a [f32], BackendError> {
        let name = format!("{}.{}", self.node.name, suffix);
        (self.weights.get(&name))
            .map(|t| t.data.as_slice())
            .ok_or_else(|| BackendError::Invalid(format!("weights have no tensor `{name}`")))
    }

    /// The bias (or null) and residual (or null) arguments of a convolution's epilogue.
    fn bias_and_residual(
        &self,
        b: &mut Builder,
        conv: &Conv2d,
    ) -> Result<(Arg, Arg), BackendError> {
        let bias = if conv.bias {
            Arg::Buf(b.f32s(self.get("bias")?))
        } else {
            Arg::Null
        };
        let res = if conv.residual {
            Arg::Buf(b.of[self.node.inputs[1]])
        } else {
            Arg::Null
        };
        Ok((bias, res))
    }
}

/// A convolution, or a linear layer as the 1×1 convolution it is, with its weight.
fn conv_like<'a>(at: &NodeCtx<'a>) -> Result<Option<(Conv2d, &'a [f32])>, BackendError> {
    Ok(match &at.node.op {
        Op::Conv2d(conv) => Some((*conv, at.get("weight")?)),
        Op::Linear {
            in_features,
            out_features,
            bias,
        } => Some((
            Conv2d {
                bias: *bias,
                ..Conv2d::new(*in_features, *out_features, 1, 1, 0)
            },
            at.get("weight")?,
        )),
        _ => None,
    })
}

/// A dense convolution or linear layer as a library GEMM (after an im2col for k×k
/// convolutions, into the shared `scratch`), then an epilogue kernel for bias, activation and
/// residual.
fn vendor_conv(
    b: &mut Builder,
    at: &NodeCtx<'_>,
    conv: &Conv2d,
    wt: &[f32],
    scratch: &mut Option<BufId>,
) -> Result<(), BackendError> {
    let NodeCtx {
        node,
        op,
        x,
        y,
        grid,
        total_i,
        ..
    } = *at;
    let ((n, c, h, w), (xc, xh, xw)) = (at.out, at.input);
    let conv = *conv;
    let has_bias = conv.bias;
    let esize = b.precision.bytes() as u64;
    let (bias_arg, res) = at.bias_and_residual(b, &conv)?;
    let wbuf = b.weights(wt);
    let pixels = h * w;
    let kk = xc * conv.kernel.0 * conv.kernel.1;
    let direct = conv.kernel == (1, 1) && conv.stride == (1, 1) && conv.padding == (0, 0);
    let cols = if direct {
        match x {
            Arg::Buf(buf) => buf,
            _ => unreachable!("a convolution always has an input"),
        }
    } else {
        let bytes = ((n * kk * pixels) as u64 * esize).next_multiple_of(8);
        let s = *scratch.get_or_insert_with(|| b.buffer(bytes, Contents::Empty));
        // Sized for the largest user.
        b.buffers[s].bytes = b.buffers[s].bytes.max(bytes);
        let args = vec![
            x,
            Arg::Buf(s),
            Arg::I32(n as i32),
            Arg::I32(xc as i32),
            Arg::I32(xh as i32),
            Arg::I32(xw as i32),
            Arg::I32(h as i32),
            Arg::I32(w as i32),
        ];
        let args = [args, window(&conv)].concat();
        i32_of(n * kk * pixels, &format!("`{}`'s im2col", node.name))?;
        b.launch(&node.name, op, "im2col", grid_1d(n * kk * pixels)?, args);
        s
    };
    let gemm = if matches!(node.op, Op::Linear { .. }) {
        // Y (n × out) = X (n × in) · Wᵀ, W stored out × in.
        Gemm {
            m: n,
            n: c,
            k: xc,
            a: cols,
            b: wbuf,
            c: y,
            trans_b: true,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        }
    } else {
        // Per image: Y (cout × pixels) = W (cout × cin·kh·kw) · columns.
        Gemm {
            m: c,
            n: pixels,
            k: kk,
            a: wbuf,
            b: cols,
            c: y,
            trans_b: false,
            batch: n,
            stride_a: 0,
            stride_b: kk * pixels,
            stride_c: c * pixels,
        }
    };
    b.steps.push(Step {
        node: node.name.clone(),
        op,
        work: Work::Gemm(gemm),
    });
    if has_bias || conv.residual || conv.act != Act::None {
        let args = vec![
            bias_arg,
            res,
            Arg::Buf(y),
            Arg::I32(total_i),
            Arg::I32(c as i32),
            Arg::I32((h * w) as i32),
            Arg::I32(act_code(conv.act)),
            Arg::I32(has_bias as i32),
            Arg::I32(conv.residual as i32),
        ];
        b.launch(&node.name, op, "epilogue", grid, args);
    }
    Ok(())
}

/// A convolution or linear layer on our kernels: the tiled implicit GEMM (tensor cores where
/// `mma`), or the direct kernel for grouped and small layers.
fn native_conv(
    b: &mut Builder,
    at: &NodeCtx<'_>,
    conv: &Conv2d,
    wt: &[f32],
    mma: bool,
) -> Result<(), BackendError> {
    let NodeCtx { node, op, x, y, .. } = *at;
    let ((n, c, h, w), (xc, xh, xw)) = (at.out, at.input);
    let conv = *conv;
    let has_bias = conv.bias;
    let (bias_arg, res) = at.bias_and_residual(b, &conv)?;
    let reduction = xc / conv.groups * conv.kernel.0 * conv.kernel.1;
    let shape = if conv.kernel != (1, 1) || conv.stride != (1, 1) || conv.padding != (0, 0) {
        ConvShape::General
    } else if h * w == 1 {
        ConvShape::Linear
    } else {
        ConvShape::Pointwise
    };
    let (kernel, g) = conv_kernel(n * h * w, c, conv.groups, reduction, shape, mma)?;
    // The tiled kernels gather a window position's 32 channels at a time
    // when the reduction runs (ky, kx, ci): weights reordered to match.
    let cin_g = xc / conv.groups;
    let kc = shape == ConvShape::General && kernel != "conv2d" && cin_g.is_multiple_of(32);
    let wbuf = if kc {
        b.weights(&window_major(wt, cin_g, conv.kernel.0 * conv.kernel.1))
    } else {
        b.weights(wt)
    };
    let args = vec![
        x,
        Arg::Buf(wbuf),
        bias_arg,
        res,
        Arg::Buf(y),
        Arg::I32(n as i32),
        Arg::I32(xc as i32),
        Arg::I32(xh as i32),
        Arg::I32(xw as i32),
        Arg::I32(c as i32),
        Arg::I32(h as i32),
        Arg::I32(w as i32),
    ];
    let args = [
        args,
        window(&conv),
        vec![
            Arg::I32(conv.groups as i32),
            Arg::I32(act_code(conv.act)),
            Arg::I32(has_bias as i32),
            Arg::I32(conv.residual as i32),
            Arg::I32(kc as i32),
        ],
    ]
    .concat();
    b.launch(&node.name, op, kernel, g, args);
    Ok(())
}

/// Every other op: one launch of its kernel.
fn other_op(b: &mut Builder, at: &NodeCtx<'_>, input: BufId) -> Result<(), BackendError> {
    let NodeCtx {
        node,
        op,
        x,
        y,
        grid,
        total,
        total_i,
        ..
    } = *at;
    let ((n, c, h, w), (_, xh, xw)) = (at.out, at.input);
    let get = |suffix: &str| at.get(suffix);
    match &node.op {
        Op::Input { .. } => {
            let args = vec![Arg::Buf(input), Arg::Buf(y), Arg::I32(total_i)];
            b.launch(&node.name, op, "to_elem", grid, args);
        }
        Op::BatchNorm { eps, .. } => {
            let (g, beta, m, v) = (
                get("weight")?,
                get("bias")?,
                get("running_mean")?,
                get("running_var")?,
            );
            let (scale, shift) = batch_norm_affine(g, beta, m, v, *eps);
            let (scale, shift) = (b.f32s(&scale), b.f32s(&shift));
            let args = vec![
                x,
                Arg::Buf(scale),
                Arg::Buf(shift),
                Arg::Buf(y),
                Arg::I32(total_i),
                Arg::I32(c as i32),
                Arg::I32((h * w) as i32),
            ];
            b.launch(&node.name, op, "affine", grid, args);
        }
        Op::Relu | Op::Relu6 => {
            let hi = if matches!(node.op, Op::Relu6) {
                6.0
            } else {
                f32::MAX
            };
            let args = vec![
                x,
                Arg::Buf(y),
                Arg::I32(total_i),
                Arg::F32(0.0),
                Arg::F32(hi),
            ];
            b.launch(&node.name, op, "clamp", grid, args);
        }
        Op::Sigmoid => {
            let args = vec![x, Arg::Buf(y), Arg::I32(total_i)];
            b.launch(&node.name, op, "sigmoid", grid, args);
        }
        Op::Add => {
            let z = Arg::Buf(b.of[node.inputs[1]]);
            b.launch(
                &node.name,
                op,
                "add",
                grid,
                vec![x, z, Arg::Buf(y), Arg::I32(total_i)],
            );
        }
        Op::MaxPool(p) | Op::AvgPool(p) => {
            let kernel = if matches!(node.op, Op::MaxPool(_)) {
                "max_pool"
            } else {
                "avg_pool"
            };
            let args = pool_args(
                x,
                y,
                (n * c, xh, xw, h, w),
                p.kernel,
                p.stride,
                p.padding,
                p.count_include_pad,
            );
            b.launch(&node.name, op, kernel, grid, args);
        }
        Op::AdaptiveAvgPool { .. } => {
            let args = pool_args(x, y, (n * c, xh, xw, h, w), (1, 1), (1, 1), (0, 0), false);
            b.launch(&node.name, op, "adaptive_avg_pool", grid, args);
        }
        Op::Softmax => {
            let cols = *at.shape.last().unwrap_or(&1);
            let rows = total / cols.max(1);
            let args = vec![x, Arg::Buf(y), Arg::I32(rows as i32), Arg::I32(cols as i32)];
            b.launch(&node.name, op, "softmax", grid_1d(rows)?, args);
        }
        Op::Conv2d(_) | Op::Linear { .. } | Op::Dropout { .. } | Op::Flatten => {
            unreachable!("lowered by conv_like or renamed")
        }
    }
    Ok(())
}

/// A convolution's window fields, in the order the kernels' structs declare them:
/// kh, kw, sh, sw, ph, pw, dh, dw.
fn window(conv: &Conv2d) -> Vec<Arg> {
    [conv.kernel, conv.stride, conv.padding, conv.dilation]
        .into_iter()
        .flat_map(|(a, b)| [Arg::I32(a as i32), Arg::I32(b as i32)])
        .collect()
}

/// The pooling kernels' arguments: (planes, h, w, oh, ow), window, stride, padding.
fn pool_args(
    x: Arg,
    y: BufId,
    (planes, h, w, oh, ow): (usize, usize, usize, usize, usize),
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    count_include_pad: bool,
) -> Vec<Arg> {
    let i = |v: usize| Arg::I32(v as i32);
    vec![
        x,
        Arg::Buf(y),
        i(planes),
        i(h),
        i(w),
        i(oh),
        i(ow),
        i(kernel.0),
        i(kernel.1),
        i(stride.0),
        i(stride.1),
        i(padding.0),
        i(padding.1),
        i(count_include_pad as usize),
    ]
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
        let (m, n, k, batch) = (3, 4, 5, 2);
        let a: Vec<f32> = (0..batch * m * k).map(|v| (v % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..batch * k * n).map(|v| (v % 5) as f32 * 0.5).collect();
        for trans_b in [false, true] {
            // B stored n×k when transposed: the same matrix, laid out the other way.
            let stored_b: Vec<f32> = if trans_b {
                (0..batch)
                    .flat_map(|s| {
                        let b = &b;
                        (0..n).flat_map(move |j| (0..k).map(move |l| b[s * k * n + l * n + j]))
                    })
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
            let mut bufs = vec![a.clone(), stored_b, vec![0.0; batch * m * n]];
            column_major_gemm(&g.column_major(), &mut bufs);
            for s in 0..batch {
                for i in 0..m {
                    for j in 0..n {
                        let want: f32 = (0..k)
                            .map(|l| a[s * m * k + i * k + l] * b[s * k * n + l * n + j])
                            .sum();
                        assert_eq!(bufs[2][s * m * n + i * n + j], want, "trans_b {trans_b}");
                    }
                }
            }
        }
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

    #[test]
    fn activation_buffers_are_reused_once_dead() {
        use crate::model::zoo;
        let g = zoo::build("resnet18").unwrap();
        let plan = g.plan(1, 64, 64).unwrap();
        let w = Weights::init(&g, 0);
        let p = build(&plan, &w, Precision::Fp32, KernelFamily::Native, false).unwrap();
        let activations = p
            .buffers
            .iter()
            .filter(|b| b.contents == Contents::Empty)
            .count();
        assert!(
            activations < plan.graph.nodes.len() / 4,
            "{activations} activation buffers for {} nodes",
            plan.graph.nodes.len()
        );
        // Every launch names only buffers of the program, and the last one writes the output.
        for s in &p.steps {
            if let Work::Kernel(l) = &s.work {
                for a in &l.args {
                    if let Arg::Buf(b) = a {
                        assert!(*b < p.buffers.len());
                    }
                }
            }
        }
        let Work::Kernel(last) = &p.steps.last().unwrap().work else {
            panic!("the last step converts the output");
        };
        assert_eq!(last.kernel, "to_f32");
        assert_eq!(last.args[1], Arg::Buf(p.output));
        // The vendor family adds an im2col scratch buffer and GEMMs, never more weights.
        let v = build(&plan, &w, Precision::Fp32, KernelFamily::Vendor, false).unwrap();
        assert_eq!(v.weight_bytes(), p.weight_bytes());
        assert!(v.steps.iter().any(|s| matches!(s.work, Work::Gemm(_))));
    }
}

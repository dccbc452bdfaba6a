//! Lowering a plan to a [`Program`] for the CUDA and HIP kernels: activation buffers from
//! [`Plan::assign_buffers`], weights uploaded in the storage precision, and one small function
//! per kind of node — a library GEMM (the vendor family), our convolution kernels, every other
//! op — each pushing its launches. Plain data: `gpu/mod.rs` runs the program on either runtime
//! or on the emulator.

use super::program::*;
use crate::backend::{BackendError, KernelFamily};
use crate::model::op::{Act, Conv2d, Op, WindowAttention};
use crate::model::{Plan, Precision, Weights};

/// Builds a [`Program`]: weight buffers are added as they are needed; activation buffers are
/// laid out first, by [`Plan::assign_buffers`].
struct Builder {
    buffers: Vec<Buffer>,
    tasks: Vec<Task>,
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
        self.tasks.push(Task {
            node: node.to_string(),
            op,
            work: Work::Kernel(KernelLaunch { kernel, grid, args }),
        });
    }
}

/// What the device offers the lowering.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Target {
    /// Half-precision matrix units our `_mma_` kernels use (tensor cores, MFMA).
    pub mma: bool,
    /// A library convolution (cuDNN, MIOpen) for the vendor family.
    pub library_conv: bool,
}

/// Lay `plan` out as kernel launches in `precision`. With [`KernelFamily::Vendor`], linear
/// layers become library GEMMs and convolutions library convolutions where the target has them
/// (dense and grouped alike), else library GEMMs after an im2col (dense only: grouped ones keep
/// our kernel); an epilogue kernel adds bias, activation and residual.
pub fn build(
    plan: &Plan,
    weights: &Weights,
    precision: Precision,
    family: KernelFamily,
    target: Target,
) -> Result<Program, BackendError> {
    let mma = target.mma;
    let mut b = Builder {
        buffers: Vec::new(),
        tasks: Vec::new(),
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
    // The attention layers' q/k/v and heads buffers, sized for the largest layer.
    let attention_rows = (plan.graph.nodes.iter().zip(&plan.shapes))
        .filter_map(|(node, shape)| match node.op {
            Op::Attention { dim, .. } | Op::WindowAttention(WindowAttention { dim, .. }) => {
                Some((numel(shape) / dim.max(1), dim))
            }
            _ => None,
        })
        .map(|(rows, dim)| rows as u64 * dim as u64 * esize)
        .max();
    let attention = attention_rows.map(|bytes| {
        (
            b.buffer(3 * bytes, Contents::Empty),
            b.buffer(bytes, Contents::Empty),
        )
    });
    let dims4 = |id: usize| -> (usize, usize, usize, usize) {
        match *plan.shapes[id].as_slice() {
            [n, c, h, w] => (n, c, h, w),
            [n, f] => (n, f, 1, 1),
            // Tokens (N, T, D): N·T rows of D, as features (so linear layers take every token).
            [n, t, d] => (n * t, d, 1, 1),
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
            input_shape: node.inputs.first().map_or(&[][..], |&i| &plan.shapes[i]),
            plan,
            bias: "bias",
            bias_values: None,
            attention,
        };
        if let Op::Attention {
            dim,
            heads,
            residual,
        } = node.op
        {
            attention_op(&mut b, &at, (dim, heads, residual), mma)?;
            continue;
        }
        if let Op::WindowAttention(_) = node.op {
            window_attention_op(&mut b, &at, mma)?;
            continue;
        }
        let vendor = family == KernelFamily::Vendor;
        let linear = matches!(node.op, Op::Linear { .. });
        match conv_like(&at)? {
            Some((conv, wt)) if vendor && target.library_conv && !linear => {
                library_conv(&mut b, &at, &conv, wt)?
            }
            Some((conv, wt)) if vendor && conv.groups == 1 => {
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
        tasks: b.tasks,
        input,
        output,
        input_shape,
        output_shape,
        precision,
    })
}

/// What lowering one node knows: the node, its output (NCHW dims, elements, buffer, a 1-D
/// grid over it), its first input (channels, height, width, buffer) and the weights.
#[derive(Clone, Copy)]
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
    /// The first input's logical shape.
    input_shape: &'a [usize],
    /// The plan (a concatenation reads its inputs' shapes).
    plan: &'a Plan,
    /// The suffix of the bias a GEMM's epilogue adds (`bias`; the attention's projections
    /// have their own).
    bias: &'static str,
    /// A bias that is not one of the node's tensors as they are (Swin V2's q/k/v bias with
    /// k's part zero), used instead of `bias`.
    bias_values: Option<&'a [f32]>,
    /// Two buffers the attention's projections write (q/k/v, then the heads), shared by every
    /// attention layer (they run one after another); `None` when the plan has no attention.
    attention: Option<(BufId, BufId)>,
}

impl<'a> NodeCtx<'a> {
    /// The node's parameter `suffix` (`weight`, `bias`, ...).
    fn get(&self, suffix: &str) -> Result<&'a [f32], BackendError> {
        Ok(self.weights.param(&self.node.name, suffix)?)
    }

    /// The bias (or null) and residual (or null) arguments of a convolution's epilogue.
    fn bias_and_residual(
        &self,
        b: &mut Builder,
        conv: &Conv2d,
    ) -> Result<(Arg, Arg), BackendError> {
        let bias = if conv.bias {
            let values = match self.bias_values {
                Some(values) => values,
                None => self.get(self.bias)?,
            };
            Arg::Buf(b.f32s(values))
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
    match at.node.op.as_conv() {
        Some(conv) => Ok(Some((conv, at.get("weight")?))),
        None => Ok(None),
    }
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
    let NodeCtx { node, op, x, y, .. } = *at;
    let ((n, c, h, w), (xc, xh, xw)) = (at.out, at.input);
    let conv = *conv;
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
    b.tasks.push(Task {
        node: node.name.clone(),
        op,
        work: Work::Gemm(gemm),
    });
    epilogue(b, at, &conv, bias_arg, res);
    Ok(())
}

/// A convolution as one library call (cuDNN, MIOpen: they pick the algorithm), then the
/// epilogue kernel.
fn library_conv(
    b: &mut Builder,
    at: &NodeCtx<'_>,
    conv: &Conv2d,
    wt: &[f32],
) -> Result<(), BackendError> {
    let ((n, c, h, w), (xc, xh, xw)) = (at.out, at.input);
    let (bias_arg, res) = at.bias_and_residual(b, conv)?;
    let Arg::Buf(x) = at.x else {
        unreachable!("a convolution always has an input")
    };
    let call = LibConv {
        batch: n,
        input: [xc, xh, xw],
        output: [c, h, w],
        kernel: conv.kernel,
        stride: conv.stride,
        padding: conv.padding,
        dilation: conv.dilation,
        groups: conv.groups,
        x,
        w: b.weights(wt),
        y: at.y,
    };
    // Every size fits the libraries' `int`s (and the epilogue's).
    call.dims()?;
    b.tasks.push(Task {
        node: at.node.name.clone(),
        op: at.op,
        work: Work::Conv(call),
    });
    epilogue(b, at, conv, bias_arg, res);
    Ok(())
}

/// Bias, activation and residual over a library call's output, where the layer has any.
fn epilogue(b: &mut Builder, at: &NodeCtx<'_>, conv: &Conv2d, bias: Arg, res: Arg) {
    let (_, c, h, w) = at.out;
    if conv.bias || conv.residual || conv.act != Act::None {
        let args = vec![
            bias,
            res,
            Arg::Buf(at.y),
            Arg::I32(at.total_i),
            Arg::I32(c as i32),
            Arg::I32((h * w) as i32),
            Arg::I32(conv.act.code() as i32),
            Arg::I32(conv.bias as i32),
            Arg::I32(conv.residual as i32),
        ];
        b.launch(&at.node.name, at.op, "epilogue", at.grid, args);
    }
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
            Arg::I32(conv.act.code() as i32),
            Arg::I32(has_bias as i32),
            Arg::I32(conv.residual as i32),
            Arg::I32(kc as i32),
        ],
    ]
    .concat();
    b.launch(&node.name, op, kernel, g, args);
    Ok(())
}

/// Multi-head self-attention: the q/k/v projection and the output projection are GEMMs on our
/// kernels (with their biases in the epilogue), between them the fused attention kernel.
fn attention_op(
    b: &mut Builder,
    at: &NodeCtx<'_>,
    (dim, heads, residual): (usize, usize, bool),
    mma: bool,
) -> Result<(), BackendError> {
    let (qkv, mid) = at
        .attention
        .expect("buffers for the plan's attention layers");
    let (imgs, t) = (at.shape[0], at.shape[1]);
    let rows = imgs * t;
    crate::backend::check_attention_head(&at.node.name, dim, heads)?;
    let projection = |out: usize| Conv2d {
        bias: true,
        ..Conv2d::new(dim, out, 1, 1, 0)
    };
    // The projections are profiled as linear layers, apart from the attention core.
    let into_qkv = NodeCtx {
        out: (rows, 3 * dim, 1, 1),
        y: qkv,
        bias: "in_proj_bias",
        op: "linear",
        ..*at
    };
    native_conv(
        b,
        &into_qkv,
        &projection(3 * dim),
        at.get("in_proj_weight")?,
        mma,
    )?;
    let args = vec![Arg::Buf(qkv), Arg::Buf(mid)];
    // Every size is below the node's element count, which `total_i` already fits in an i32.
    let dims = [imgs, t, dim, heads].map(|v| Arg::I32(v as i32));
    let (kernel, grid) = attention_kernel(imgs * heads, t, dim / heads)?;
    b.launch(
        &at.node.name,
        at.op,
        kernel,
        grid,
        [args, dims.to_vec()].concat(),
    );
    let out = NodeCtx {
        x: Arg::Buf(mid),
        bias: "out_proj.bias",
        op: "linear",
        ..*at
    };
    // The block's residual (the node's second input), where the compile passes fused it.
    let out_proj = Conv2d {
        residual,
        ..projection(dim)
    };
    native_conv(b, &out, &out_proj, at.get("out_proj.weight")?, mma)
}

/// The attention core's kernel and grid for `rows` = images × heads of `t` tokens: the tiled
/// kernel of the head size where there is one (query tiles of 128 by rows), else one thread per
/// query.
fn attention_kernel(
    rows: usize,
    t: usize,
    dh: usize,
) -> Result<(&'static str, [u32; 3]), BackendError> {
    let tiled = match dh {
        32 => Some("attention_t32"),
        64 => Some("attention_t64"),
        80 => Some("attention_t80"),
        _ => None,
    };
    match tiled {
        // Both fit: t · rows is below the node's element count, an i32.
        Some(k) if rows <= MAX_GRID as usize => {
            Ok((k, [t.div_ceil(ATTENTION_QUERY_TILE) as u32, rows as u32, 1]))
        }
        _ => Ok(("attention", grid_1d(rows * t)?)),
    }
}

/// Queries per block of the tiled attention kernels (`ATTENTION_QT` in ops.cuh).
const ATTENTION_QUERY_TILE: usize = 128;

/// Swin's window attention on an NCHW image: to tokens (into the second attention buffer),
/// the q/k/v projection, the core (tokens in, tokens out), the output projection (into the
/// first buffer, free again), and back to NCHW.
fn window_attention_op(b: &mut Builder, at: &NodeCtx<'_>, mma: bool) -> Result<(), BackendError> {
    let Op::WindowAttention(attention) = at.node.op else {
        unreachable!("called for window attention")
    };
    let WindowAttention {
        dim, heads, form, ..
    } = attention;
    let (qkv, mid) = at
        .attention
        .expect("buffers for the plan's attention layers");
    let (n, _, h, w) = at.out;
    let rows = n * h * w;
    crate::backend::check_attention_head(&at.node.name, dim, heads)?;
    let i = |v: usize| Arg::I32(v as i32);
    // Every size is below the node's element count or its q/k/v's, which fit an i32 (the
    // plan checks the largest buffer).
    let transpose = |b: &mut Builder, from: Arg, to: BufId, (c, hw): (usize, usize)| {
        let args = vec![from, Arg::Buf(to), i(n), i(c), i(hw)];
        b.launch(&at.node.name, at.op, "tokens", at.grid, args);
    };
    transpose(b, at.x, mid, (dim, h * w));
    let projection = |out: usize| Conv2d {
        bias: true,
        ..Conv2d::new(dim, out, 1, 1, 0)
    };
    let gemm = |y: BufId, x: BufId, cout: usize, bias: &'static str| NodeCtx {
        out: (rows, cout, 1, 1),
        input: (dim, 1, 1),
        x: Arg::Buf(x),
        y,
        bias,
        op: "linear",
        ..*at
    };
    let params = at.weights.window_attention(&at.node.name, &attention)?;
    let [qkv_w, qkv_b, proj_w, proj_b] = form.projections();
    let into_qkv = NodeCtx {
        bias_values: Some(&params.qkv_bias),
        ..gemm(qkv, mid, 3 * dim, qkv_b)
    };
    native_conv(b, &into_qkv, &projection(3 * dim), at.get(qkv_w)?, mma)?;
    let g = attention.grid(h, w);
    let consts = [&params.table, &params.qkv_bias, &params.scales].map(|v| b.f32s(v));
    let args = [qkv, consts[0], consts[1], consts[2], mid].map(Arg::Buf);
    let dims = [
        n, h, w, g.hp, g.wp, g.window, g.shift_h, g.shift_w, dim, heads,
    ]
    .into_iter()
    .chain([params.cosine as usize, g.dilated as usize])
    .map(i)
    .collect::<Vec<_>>();
    let grid = grid_1d(n * heads * g.hp * g.wp)?;
    b.launch(
        &at.node.name,
        at.op,
        "window_attention",
        grid,
        [args.to_vec(), dims].concat(),
    );
    let out = gemm(qkv, mid, dim, proj_b);
    native_conv(b, &out, &projection(dim), at.get(proj_w)?, mma)?;
    transpose(b, Arg::Buf(qkv), at.y, (h * w, dim));
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
    match &node.op {
        Op::Input { .. } => {
            let args = vec![Arg::Buf(input), Arg::Buf(y), Arg::I32(total_i)];
            b.launch(&node.name, op, "to_elem", grid, args);
        }
        // Batch norm, and the layer scale as an affine map with a zero shift.
        Op::BatchNorm { .. } | Op::LayerScale { .. } => {
            let (scale, shift) = match node.op {
                Op::BatchNorm { eps, .. } => at.weights.batch_norm_affine(&node.name, eps)?,
                _ => (at.get("")?.to_vec(), vec![0.0; c]),
            };
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
        Op::Unary(u) => {
            let args = vec![x, Arg::Buf(y), Arg::I32(total_i), Arg::I32(u.code() as i32)];
            b.launch(&node.name, op, "unary", grid, args);
        }
        Op::ScaleChannels => {
            let s = Arg::Buf(b.of[node.inputs[1]]);
            let args = vec![
                x,
                s,
                Arg::Buf(y),
                Arg::I32(total_i),
                Arg::I32((h * w) as i32),
            ];
            b.launch(&node.name, op, "scale_channels", grid, args);
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
        Op::Tokens => {
            let args = vec![
                x,
                Arg::Buf(y),
                Arg::I32(at.shape[0] as i32),
                Arg::I32(at.shape[2] as i32),
                Arg::I32(at.shape[1] as i32),
            ];
            b.launch(&node.name, op, "tokens", grid, args);
        }
        // The tokens kernel with the two inner dimensions' roles swapped: (N, H·W, C) → (N, C, H·W).
        Op::Image => {
            let args = vec![
                x,
                Arg::Buf(y),
                Arg::I32(n as i32),
                Arg::I32((h * w) as i32),
                Arg::I32(c as i32),
            ];
            b.launch(&node.name, op, "tokens", grid, args);
        }
        Op::Concat { .. } | Op::ChannelSlice { .. } | Op::ChannelShuffle { .. } => {
            for k in at.plan.channel_copies(node).unwrap_or_default() {
                let x = Arg::Buf(b.of[node.inputs[k.input]]);
                let dims = [n, h * w, k.channels, k.from, c, k.to, k.count, k.step];
                let args = [
                    vec![x, Arg::Buf(y)],
                    dims.map(|v| Arg::I32(v as i32)).to_vec(),
                ];
                let grid = grid_1d(n * k.count * h * w)?;
                b.launch(&node.name, op, "channel_copy", grid, args.concat());
            }
        }
        Op::ClassToken { .. } => {
            let token = b.f32s(at.get("")?);
            let (imgs, t, d) = (at.shape[0], at.shape[1] - 1, at.shape[2]);
            let args = vec![x, Arg::Buf(token), Arg::Buf(y)];
            let dims = [imgs, t, d].map(|v| Arg::I32(v as i32));
            b.launch(
                &node.name,
                op,
                "class_token",
                grid,
                [args, dims.to_vec()].concat(),
            );
        }
        Op::PosEmbed { .. } => {
            let pos = b.f32s(at.get("")?);
            let per_image = at.shape[1] * at.shape[2];
            let args = vec![
                x,
                Arg::Buf(pos),
                Arg::Buf(y),
                Arg::I32(total_i),
                Arg::I32(per_image as i32),
            ];
            b.launch(&node.name, op, "positions", grid, args);
        }
        Op::LayerNorm { dim, eps, affine } => {
            // An NCHW image is normalised over its channels, H·W apart.
            let inner = if at.shape.len() == 4 { h * w } else { 1 };
            let (w, bias) = at.weights.layer_norm(&node.name, (*dim, *affine))?;
            let (w, bias) = (b.f32s(&w), b.f32s(&bias));
            let rows = total / dim.max(&1);
            let args = vec![
                x,
                Arg::Buf(w),
                Arg::Buf(bias),
                Arg::Buf(y),
                Arg::I32(rows as i32),
                Arg::I32(*dim as i32),
                Arg::I32(inner as i32),
                Arg::F32(*eps),
            ];
            // Rows of tokens: a row to 32 threads (`rows` · 32 is below the node's element
            // count times 32, checked by grid_1d); an image's channels: a thread a row.
            let (kernel, grid) = match inner {
                1 => ("layer_norm_rows", grid_1d(rows.saturating_mul(32))?),
                _ => ("layer_norm", grid_1d(rows)?),
            };
            b.launch(&node.name, op, kernel, grid, args);
        }
        Op::Gelu => {
            let args = vec![x, Arg::Buf(y), Arg::I32(total_i)];
            b.launch(&node.name, op, "gelu", grid, args);
        }
        Op::SelectToken { index } => {
            let (imgs, d, t) = (at.shape[0], at.shape[1], at.input_shape[1]);
            let dims = [imgs, t, d, *index].map(|v| Arg::I32(v as i32));
            b.launch(
                &node.name,
                op,
                "select_token",
                grid,
                [vec![x, Arg::Buf(y)], dims.to_vec()].concat(),
            );
        }
        Op::PatchMerge => {
            let dims = [n, c / 4, xh, xw, h, w].map(|v| Arg::I32(v as i32));
            let args = [vec![x, Arg::Buf(y)], dims.to_vec()].concat();
            b.launch(&node.name, op, "patch_merge", grid, args);
        }
        Op::Attention { .. } | Op::WindowAttention(_) => {
            unreachable!("lowered by `attention_op` and `window_attention_op`")
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
    fn activation_buffers_are_reused_once_dead() {
        use crate::model::zoo;
        let g = zoo::build("resnet18").unwrap();
        let plan = g.plan(1, 64, 64).unwrap();
        let w = Weights::init(&g, 0);
        let p = build(
            &plan,
            &w,
            Precision::Fp32,
            KernelFamily::Native,
            Target::default(),
        )
        .unwrap();
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
        for s in &p.tasks {
            if let Work::Kernel(l) = &s.work {
                for a in &l.args {
                    if let Arg::Buf(b) = a {
                        assert!(*b < p.buffers.len());
                    }
                }
            }
        }
        let Work::Kernel(last) = &p.tasks.last().unwrap().work else {
            panic!("the last step converts the output");
        };
        assert_eq!(last.kernel, "to_f32");
        assert_eq!(last.args[1], Arg::Buf(p.output));
        // The vendor family adds an im2col scratch buffer and GEMMs, never more weights.
        let v = build(
            &plan,
            &w,
            Precision::Fp32,
            KernelFamily::Vendor,
            Target::default(),
        )
        .unwrap();
        assert_eq!(v.weight_bytes(), p.weight_bytes());
        assert!(v.tasks.iter().any(|s| matches!(s.work, Work::Gemm(_))));
    }
}

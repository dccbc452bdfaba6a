//! The wgpu lowering, plain data and no device: a planned graph as WGSL kernel launches — each
//! a kernel, its parameters, and the buffers it binds (activations placed by
//! [`Plan::assign_buffers`], constants such as packed weights, the input and the output) —
//! checked against the adapter's limits. The session (`session.rs`) turns them into buffers,
//! pipelines and bind groups. Adding an op here is one arm of [`node_launches`].

use std::collections::BTreeMap;

use super::Kernel;
use crate::backend::BackendError;
use crate::model::buffers::BufferAssignment;
use crate::model::op::{Act, Conv2d, Op, WindowAttention};
use crate::model::{Plan, Precision, Weights};

/// A buffer a launch binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Buf {
    /// The f32 NCHW input the session uploads before each pass.
    Input,
    /// Activation buffer `.0` of the assignment.
    Activation(usize),
    /// Constant `.0` of [`Lowered::consts`], uploaded once.
    Const(usize),
    /// Sixteen zero bytes: the bias and residual of launches that have none.
    Zero,
    /// The f32 output the session reads back.
    Output,
}

/// One kernel launch.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Launch {
    pub kernel: Kernel,
    /// The node it computes (`output` for the final conversion).
    pub node: String,
    /// The node's op kind (`conv2d`, ...), or `output`.
    pub op: &'static str,
    /// The kernel's `Params` uniform, in order (binding 0).
    pub params: Vec<u32>,
    /// Every other binding, the output among them.
    pub bindings: Vec<(u32, Buf)>,
    pub groups: (u32, u32, u32),
}

/// The op kind a launch of `op` is profiled as: an attention layer's projections are linear
/// layers (the operator table tells them from the attention core), every other launch is its
/// node's.
fn part_op(op: &Op, kernel: Kernel) -> &'static str {
    match op {
        Op::Attention { .. } | Op::WindowAttention(_)
            if !matches!(kernel, Kernel::Attention | Kernel::WindowAttention) =>
        {
            "linear"
        }
        _ => op.kind_name(),
    }
}

/// Constant buffers: a label and the bytes.
#[derive(Debug, Default)]
pub(super) struct Consts(pub Vec<(&'static str, Vec<u8>)>);

impl Consts {
    fn add(&mut self, label: &'static str, bytes: Vec<u8>) -> Buf {
        self.0.push((label, bytes));
        Buf::Const(self.0.len() - 1)
    }
}

/// What a session needs to build.
#[derive(Debug)]
pub(super) struct Lowered {
    pub launches: Vec<Launch>,
    pub assignment: BufferAssignment,
    pub consts: Consts,
    /// Bytes of weights as stored on the device.
    pub weight_bytes: u64,
    /// The activation buffers the attention layers' q/k/v and heads go to, shared by every
    /// attention layer (they run one after another); `None` without attention.
    pub attention: Option<(usize, usize)>,
}

/// The adapter's limits the launches must respect.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Workgroups per dimension of one dispatch.
    pub max_groups: u32,
    /// Bytes of one storage buffer binding.
    pub max_binding: u64,
}

/// A launch of a node before its output is bound: kernel, parameters, the buffers it reads
/// (by binding), the binding of its output, and the grid.
type Part = (Kernel, Vec<usize>, Vec<(u32, Buf)>, u32, (u32, u32, u32));

/// Bytes of `n` values of the storage type, rounded up to whole words.
pub(super) fn elem_bytes(n: usize, precision: Precision) -> u64 {
    ((n * precision.bytes()) as u64).div_ceil(4) * 4
}

/// Values in the storage type, as bytes.
fn to_bytes(v: &[f32], precision: Precision) -> Vec<u8> {
    let mut out = precision.storage_bytes(v);
    out.resize(out.len().div_ceil(4).max(1) * 4, 0);
    out
}

/// f32 values as bytes (at least one word: a binding may not be empty).
pub(super) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut b: Vec<u8> = bytemuck::cast_slice(v).to_vec();
    if b.is_empty() {
        b.resize(4, 0);
    }
    b
}

/// 1-D launches of 256 threads, folded into a 2-D grid within the dispatch limits.
pub(super) fn grid(total: usize, max: u32) -> (u32, u32, u32) {
    let [x, y, z] = crate::backend::fold_grid(total, max);
    (x, y, z)
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// Whether node `id` only renames its input (dropout, a flatten of 1×1 maps): its value shares
/// its input's buffer and it launches nothing.
fn renames(plan: &Plan, id: usize) -> bool {
    let node = &plan.graph.nodes[id];
    match node.op {
        // NHWC images already are (N, H·W, C) tokens, and tokens an NHWC image.
        Op::Dropout { .. } | Op::Tokens | Op::Image => true,
        Op::Flatten => numel(&plan.shapes[node.inputs[0]][2..]) == 1,
        _ => false,
    }
}

/// A value's shape as NHWC (n, h, w, c): features are (n, 1, 1, f).
fn nhwc(plan: &Plan, id: usize) -> (usize, usize, usize, usize) {
    match *plan.shapes[id].as_slice() {
        [n, c, h, w] => (n, h, w, c),
        [n, f] => (n, 1, 1, f),
        // Tokens (N, T, D): N·T rows of D, as features (linear layers take every token).
        [n, t, d] => (n * t, 1, 1, d),
        _ => (1, 1, 1, numel(&plan.shapes[id])),
    }
}

/// Lay `plan` out as launches in `precision`; `variants` forces GEMM kernels per node
/// (max-autotune).
pub(super) fn lower(
    plan: &Plan,
    weights: &Weights,
    precision: Precision,
    variants: &BTreeMap<String, String>,
    limits: Limits,
) -> Result<Lowered, BackendError> {
    let nodes = &plan.graph.nodes;
    // Every value within one binding.
    for (node, shape) in nodes.iter().zip(&plan.shapes) {
        check_size(
            &format!("`{}` output", node.name),
            elem_bytes(numel(shape), precision),
            limits.max_binding,
        )?;
    }
    let mut assignment = plan.assign_buffers(
        |id| elem_bytes(numel(&plan.shapes[id]), precision),
        |id| renames(plan, id),
    );
    let output_shape = plan.output_shape();
    let out_total = numel(output_shape);
    // An image output is converted from NHWC in a scratch buffer after the last node.
    let out_scratch = match *output_shape {
        [_, _, oh, ow] if oh * ow > 1 => Some(assignment.scratch(elem_bytes(out_total, precision))),
        _ => None,
    };
    // Fresh buffers (never another value's) for the attention layers' intermediates.
    let attention_bytes = (nodes.iter().zip(&plan.shapes))
        .filter(|(node, _)| matches!(node.op, Op::Attention { .. } | Op::WindowAttention(_)))
        .map(|(_, shape)| elem_bytes(numel(shape), precision))
        .max();
    let attention = match attention_bytes {
        Some(bytes) => {
            check_size("the attention's q, k and v", 3 * bytes, limits.max_binding)?;
            assignment.bytes.extend([3 * bytes, bytes]);
            let n = assignment.bytes.len();
            Some((n - 2, n - 1))
        }
        None => None,
    };
    let mut out = Lowered {
        launches: Vec::new(),
        assignment,
        consts: Consts::default(),
        weight_bytes: 0,
        attention,
    };
    for (id, node) in nodes.iter().enumerate() {
        let parts = node_launches(plan, id, &mut out, weights, precision, variants, limits)?;
        debug_assert_eq!(parts.is_empty(), renames(plan, id), "`{}`", node.name);
        let y = Buf::Activation(out.assignment.of[id]);
        for (kernel, params, mut bindings, at, groups) in parts {
            // A part that binds its output itself writes an intermediate (the attention's).
            if !bindings.iter().any(|&(b, _)| b == at) {
                bindings.push((at, y));
            }
            out.launches.push(launch(
                kernel,
                &node.name,
                part_op(&node.op, kernel),
                params,
                bindings,
                groups,
                limits,
            )?);
        }
    }
    // The output, converted to f32 (and from NHWC to NCHW when it is an image).
    let mut src = Buf::Activation(out.assignment.of[plan.graph.output]);
    if let (Some(tmp), [_, oc, oh, ow]) = (out_scratch, output_shape) {
        let tmp = Buf::Activation(tmp);
        let params = vec![out_total, *oc, oh * ow];
        let bindings = vec![(1, src), (5, tmp)];
        let groups = grid(out_total, limits.max_groups);
        out.launches.push(launch(
            Kernel::NhwcToNchw,
            "output",
            "output",
            params,
            bindings,
            groups,
            limits,
        )?);
        src = tmp;
    }
    let bindings = vec![(1, src), (7, Buf::Output)];
    let groups = grid(out_total, limits.max_groups);
    out.launches.push(launch(
        Kernel::ToF32,
        "output",
        "output",
        vec![out_total, 1, 1],
        bindings,
        groups,
        limits,
    )?);
    Ok(out)
}

/// A launch, refused where its grid is above the adapter's limit.
fn launch(
    kernel: Kernel,
    node: &str,
    op: &'static str,
    params: Vec<usize>,
    bindings: Vec<(u32, Buf)>,
    groups: (u32, u32, u32),
    limits: Limits,
) -> Result<Launch, BackendError> {
    let max = limits.max_groups;
    if groups.0 > max || groups.1 > max || groups.2 > max {
        return Err(BackendError::DeviceLimit(format!(
            "`{node}` needs a {groups:?} grid, above this adapter's limit of {max} per dimension: use a smaller batch"
        )));
    }
    Ok(Launch {
        kernel,
        node: node.to_string(),
        op,
        params: params.iter().map(|&v| v as u32).collect(),
        bindings,
        groups,
    })
}

/// Refuse a buffer larger than one storage binding takes.
fn check_size(what: &str, bytes: u64, max_binding: u64) -> Result<(), BackendError> {
    if bytes > max_binding {
        return Err(BackendError::DeviceLimit(format!(
            "{what} needs {} in one buffer, but this adapter binds at most {} per storage buffer \
             (max_storage_buffer_binding_size): use a smaller network or batch, or another device",
            crate::units::human_bytes(bytes),
            crate::units::human_bytes(max_binding)
        )));
    }
    Ok(())
}

/// Node `id`'s launches, without their output binding (empty for a node that renames its
/// input). Constants go to `out.consts`, their bytes to `out.weight_bytes`.
fn node_launches(
    plan: &Plan,
    id: usize,
    out: &mut Lowered,
    weights: &Weights,
    precision: Precision,
    variants: &BTreeMap<String, String>,
    limits: Limits,
) -> Result<Vec<Part>, BackendError> {
    let Limits {
        max_groups,
        max_binding,
    } = limits;
    let node = &plan.graph.nodes[id];
    let (n, h, w, c) = nhwc(plan, id);
    let total = n * h * w * c;
    let get = |suffix: &str| weights.param(&node.name, suffix);
    let of = &out.assignment.of;
    // The node's input values (activation buffers) and a bias buffer, or the zero one.
    let input_buf = |k: usize| Buf::Activation(of[node.inputs[k]]);
    // The reads of most ops: their input at binding 1.
    let x = || vec![(1, input_buf(0))];
    let bias_buf = |consts: &mut Consts, b: &[f32]| {
        if b.is_empty() {
            Buf::Zero
        } else {
            consts.add("bias", f32_bytes(b))
        }
    };
    let consts = &mut out.consts;
    let weight_bytes = &mut out.weight_bytes;
    let (_, xh, xw, xc) = node.inputs.first().map_or((0, 0, 0, 0), |&i| nhwc(plan, i));
    let shape = [total, c, h * w];
    // Most ops are one launch: a kernel, its parameters, the buffers it reads (by binding),
    // the binding of its output, and a grid of one thread per element of `threads`.
    let one = |kernel, params: Vec<usize>, reads, out, threads: usize| -> Vec<Part> {
        vec![(kernel, params, reads, out, grid(threads, max_groups))]
    };
    let parts: Vec<Part> = match &node.op {
        Op::Input { .. } => one(
            Kernel::NchwToNhwc,
            shape.to_vec(),
            vec![(6, Buf::Input)],
            5,
            total,
        ),
        // Depthwise with at most an activation; with a residual it takes the general kernel.
        Op::Conv2d(conv) if is_plain_depthwise(conv) => {
            let (wt, bias) = (get("weight")?, if conv.bias { get("bias")? } else { &[] });
            let dw = depthwise_weights(wt, c, conv.kernel, precision);
            *weight_bytes += ((dw.len() + bias.len()) * 4) as u64;
            let (kh, kw) = conv.kernel;
            let p = [
                [total, xh, xw, c, h, w, kh, kw].as_slice(),
                &[conv.stride.0, conv.stride.1, conv.padding.0, conv.padding.1],
                &[conv.dilation.0, conv.dilation.1, conv.bias as usize],
                &[conv.act.code() as usize],
            ]
            .concat();
            let reads = vec![
                (1, input_buf(0)),
                (2, consts.add("depthwise weights", f32_bytes(&dw))),
                (3, bias_buf(consts, bias)),
            ];
            one(Kernel::Depthwise, p, reads, 4, total)
        }
        // Convolutions and linear layers (1×1 convolutions of 1×1 images): implicit GEMMs.
        Op::Conv2d(_) | Op::Linear { .. } => {
            let has_bias = node.op.params().iter().any(|p| p.suffix == "bias");
            let bias = if has_bias { get("bias")? } else { &[] };
            let residual = match node.op.as_conv() {
                Some(c) if c.residual => input_buf(1),
                _ => Buf::Zero,
            };
            gemm_parts(
                (consts, weight_bytes),
                (&node.name, precision, max_binding),
                (&node.op, get("weight")?, bias),
                (
                    (xh, xw, xc),
                    (n, h, w),
                    variants.get(&node.name).map(String::as_str),
                ),
                (input_buf(0), residual, None),
            )?
        }
        // Batch norm, and the layer scale as an affine map with a zero shift.
        Op::BatchNorm { .. } | Op::LayerScale { .. } => {
            let (scale, shift) = match node.op {
                Op::BatchNorm { eps, .. } => weights.batch_norm_affine(&node.name, eps)?,
                _ => (get("")?.to_vec(), vec![0.0; c]),
            };
            *weight_bytes += (scale.len() * 8) as u64;
            let reads = vec![
                (1, input_buf(0)),
                (3, consts.add("scale", f32_bytes(&scale))),
                (4, consts.add("shift", f32_bytes(&shift))),
            ];
            one(Kernel::Affine, shape.to_vec(), reads, 5, total)
        }
        Op::Relu | Op::Relu6 => {
            let hi = if matches!(node.op, Op::Relu6) {
                6.0f32
            } else {
                f32::MAX
            };
            let p = vec![
                total,
                c,
                h * w,
                0f32.to_bits() as usize,
                hi.to_bits() as usize,
            ];
            one(Kernel::Clamp, p, x(), 5, total)
        }
        Op::Sigmoid => one(Kernel::Sigmoid, shape.to_vec(), x(), 5, total),
        Op::Unary(u) => {
            let p = vec![total, c, h * w, 0, 0, u.code() as usize];
            one(Kernel::Unary, p, x(), 5, total)
        }
        Op::ScaleChannels => one(
            Kernel::ScaleChannels,
            shape.to_vec(),
            vec![(1, input_buf(0)), (2, input_buf(1))],
            5,
            total,
        ),
        Op::Add => one(
            Kernel::Add,
            shape.to_vec(),
            vec![(1, input_buf(0)), (2, input_buf(1))],
            5,
            total,
        ),
        Op::MaxPool(pool) | Op::AvgPool(pool) => {
            let (k, st, pad) = (pool.kernel, pool.stride, pool.padding);
            let window = [k.0, k.1, st.0, st.1, pad.0, pad.1];
            let p = [
                &[total, xh, xw, c, h, w],
                &window[..],
                &[pool.count_include_pad as usize],
            ]
            .concat();
            let k = if matches!(node.op, Op::MaxPool(_)) {
                Kernel::MaxPool
            } else {
                Kernel::AvgPool
            };
            one(k, p, x(), 2, total)
        }
        Op::AdaptiveAvgPool { .. } => {
            let p = vec![total, xh, xw, c, h, w];
            one(Kernel::AdaptiveAvgPool, p, x(), 2, total)
        }
        // Dropout and a flatten of a 1×1 map change nothing: the value shares its input's buffer.
        Op::Dropout { .. } => Vec::new(),
        Op::Flatten if xh * xw == 1 => Vec::new(),
        Op::Flatten => one(Kernel::NhwcToNchw, vec![total, xc, xh * xw], x(), 5, total),
        Op::Softmax => one(Kernel::Softmax, shape.to_vec(), x(), 5, total / c.max(1)),
        Op::Tokens | Op::Image => Vec::new(),
        Op::Concat { .. } | Op::ChannelSlice { .. } | Op::ChannelShuffle { .. } => {
            let copies = plan.channel_copies(node).unwrap_or_default();
            (copies.iter())
                .flat_map(|k| {
                    let total = n * h * w * k.count;
                    let p = vec![total, k.count, k.channels, k.from, c, k.to, k.step, 0];
                    one(
                        Kernel::ChannelCopy,
                        p,
                        vec![(1, input_buf(k.input))],
                        2,
                        total,
                    )
                })
                .collect()
        }
        Op::ClassToken { dim } => {
            let t = plan.shapes[node.inputs[0]][1];
            let token = consts.add("class token", f32_bytes(get("")?));
            *weight_bytes += *dim as u64 * 4;
            let reads = vec![(1, input_buf(0)), (2, token)];
            one(Kernel::ClassToken, vec![total, t, *dim], reads, 4, total)
        }
        Op::PosEmbed { tokens, dim, .. } => {
            let pos = consts.add("positions", f32_bytes(get("")?));
            *weight_bytes += (tokens * dim) as u64 * 4;
            let reads = vec![(1, input_buf(0)), (2, pos)];
            one(
                Kernel::Positions,
                vec![total, *tokens, *dim],
                reads,
                4,
                total,
            )
        }
        Op::LayerNorm { dim, eps, affine } => {
            let (wt, bias) = weights.layer_norm(&node.name, (*dim, *affine))?;
            *weight_bytes += 2 * *dim as u64 * 4;
            let reads = vec![
                (1, input_buf(0)),
                (2, consts.add("layer norm weight", f32_bytes(&wt))),
                (3, consts.add("layer norm bias", f32_bytes(&bias))),
            ];
            let rows = total / dim.max(&1);
            let p = vec![rows, 0, *dim, 0, 0, eps.to_bits() as usize];
            one(Kernel::LayerNorm, p, reads, 4, rows)
        }
        Op::Gelu => one(Kernel::Gelu, vec![total], vec![(1, input_buf(0))], 4, total),
        Op::SelectToken { index } => {
            let t = plan.shapes[node.inputs[0]][1];
            let p = vec![total, t, c, 0, *index];
            one(Kernel::SelectToken, p, vec![(1, input_buf(0))], 4, total)
        }
        Op::PatchMerge => {
            let p = vec![total, xh, xw, h, w, 0, 0, 0, xc, 0, 0, 0];
            one(Kernel::PatchMerge, p, x(), 4, total)
        }
        Op::WindowAttention(attention) => {
            let WindowAttention {
                dim, heads, form, ..
            } = attention;
            let (qkv, mid) = out
                .attention
                .expect("buffers for the plan's attention layers");
            let (qkv, mid) = (Buf::Activation(qkv), Buf::Activation(mid));
            crate::backend::check_attention_head(&node.name, *dim, *heads)?;
            let linear = |fout| Op::linear(*dim, fout, true);
            // The projections: linear layers over all n · h · w tokens.
            let dims = ((1, 1, *dim), (n * h * w, 1, 1), None);
            let params = weights.window_attention(&node.name, attention)?;
            let [qkv_w, _, proj_w, proj_b] = form.projections();
            let mut parts = gemm_parts(
                (consts, weight_bytes),
                (&node.name, precision, max_binding),
                (&linear(3 * *dim), get(qkv_w)?, &params.qkv_bias),
                dims,
                (input_buf(0), Buf::Zero, Some(qkv)),
            )?;
            let g = attention.grid(h, w);
            let threads = n * heads * g.hp * g.wp;
            let p = [threads, h, w, g.hp, g.wp, g.window, g.shift_h, g.shift_w]
                .into_iter()
                .chain([*dim, *heads, params.cosine as usize, g.dilated as usize])
                .collect();
            *weight_bytes += (params.table.len() * 4) as u64;
            let reads = vec![
                (1, qkv),
                (
                    2,
                    consts.add("relative position bias", f32_bytes(&params.table)),
                ),
                (3, consts.add("q/k/v bias", f32_bytes(&params.qkv_bias))),
                (5, consts.add("head scales", f32_bytes(&params.scales))),
            ];
            let mut core = one(Kernel::WindowAttention, p, reads, 4, threads);
            core[0].2.push((4, mid));
            parts.extend(core);
            parts.extend(gemm_parts(
                (consts, weight_bytes),
                (&node.name, precision, max_binding),
                (&linear(*dim), get(proj_w)?, get(proj_b)?),
                dims,
                (mid, Buf::Zero, None),
            )?);
            parts
        }
        Op::Attention {
            dim,
            heads,
            residual,
        } => {
            let (qkv, mid) = out
                .attention
                .expect("buffers for the plan's attention layers");
            let (qkv, mid) = (Buf::Activation(qkv), Buf::Activation(mid));
            let (imgs, t) = (plan.shapes[id][0], plan.shapes[id][1]);
            crate::backend::check_attention_head(&node.name, *dim, *heads)?;
            // The projections: linear layers over all n = images · tokens rows.
            let linear = |fout| Op::linear(*dim, fout, true);
            let dims = ((1, 1, *dim), (n, 1, 1), None);
            let mut parts = gemm_parts(
                (consts, weight_bytes),
                (&node.name, precision, max_binding),
                (
                    &linear(3 * *dim),
                    get("in_proj_weight")?,
                    get("in_proj_bias")?,
                ),
                dims,
                (input_buf(0), Buf::Zero, Some(qkv)),
            )?;
            let threads = imgs * heads * t;
            let p = vec![threads, t, *dim, *heads];
            let mut core = one(Kernel::Attention, p, vec![(1, qkv)], 4, threads);
            core[0].2.push((4, mid));
            parts.extend(core);
            // The block's residual, where the compile passes fused it, in the output
            // projection's epilogue.
            let out_proj = Op::Linear {
                in_features: *dim,
                out_features: *dim,
                bias: true,
                act: Act::None,
                residual: *residual,
            };
            let residual = if *residual { input_buf(1) } else { Buf::Zero };
            parts.extend(gemm_parts(
                (consts, weight_bytes),
                (&node.name, precision, max_binding),
                (&out_proj, get("out_proj.weight")?, get("out_proj.bias")?),
                dims,
                (mid, residual, None),
            )?);
            parts
        }
    };
    Ok(parts)
}

/// Three dimensions of an image or its GEMM view: (h, w, c) in, (n, h, w) out.
type Hwc = (usize, usize, usize);

/// A convolution or linear layer `op` as the GEMM launches of conv2d.wgsl, with its bias
/// (none when empty) and residual: input dims (h, w, c) → output dims (n, h, w), a forced
/// variant (max-autotune) or none; it reads `input` and writes `output` (the node's own buffer
/// when `None`). Convolution and linear nodes, and the attention's two projections (a linear
/// layer over every token, whose weights are not the node's `weight`).
fn gemm_parts(
    (consts, weight_bytes): (&mut Consts, &mut u64),
    (node, precision, max_binding): (&str, Precision, u64),
    (op, weight, bias): (&Op, &[f32], &[f32]),
    (input_dims, output_dims, variant): (Hwc, Hwc, Option<&str>),
    (input, residual, output): (Buf, Buf, Option<Buf>),
) -> Result<Vec<Part>, BackendError> {
    let (conv, packed, gemm_input) = as_gemm(op, weight, input_dims);
    let gemm = Gemm {
        conv: &conv,
        weights: &packed,
        input: gemm_input,
        output: output_dims,
        variant,
    };
    let (launches, bytes) = gemm.launches(consts, node, precision, max_binding)?;
    *weight_bytes += bytes + bias.len() as u64 * 4;
    let bias = if bias.is_empty() {
        Buf::Zero
    } else {
        consts.add("bias", f32_bytes(bias))
    };
    let mut parts = with_reads(launches, &[(1, input), (3, bias), (5, residual)]);
    if let Some(output) = output {
        for part in &mut parts {
            part.2.push((part.3, output));
        }
    }
    Ok(parts)
}

/// Few enough output rows for `conv2d_rows` (two of its 8-row passes at most): a 64-row tile
/// would waste most of its work, while re-reading B twice costs less.
pub(super) const FEW_ROWS: usize = 16;

/// A convolution or linear layer as the implicit GEMM of conv2d.wgsl: per group a
/// (taps × cout_g) weight matrix, an NHWC input of (h, w, cin), an output of (n, oh, ow).
struct Gemm<'a> {
    conv: &'a Conv2d,
    weights: &'a [f32],
    input: (usize, usize, usize),
    output: (usize, usize, usize),
    /// `tiled` or `rows` to force a kernel (max-autotune), else chosen by the row count.
    variant: Option<&'a str>,
}

impl Gemm<'_> {
    /// Its launches, each with its parameters and weight buffer (binding 2), and the weight
    /// bytes uploaded. A weight matrix larger than one storage binding allows is cut into
    /// slices of output channels, one launch each (VGG's and AlexNet's first classifier
    /// layers on adapters that bind 128 MiB).
    fn launches(
        &self,
        consts: &mut Consts,
        node: &str,
        precision: Precision,
        max_binding: u64,
    ) -> Result<(Vec<Part>, u64), BackendError> {
        let c = self.conv;
        let (k_g, cout_g) = (c.taps(), c.out_channels / c.groups);
        let bytes = elem_bytes(self.weights.len(), precision);
        let (n, oh, ow) = self.output;
        let m = n * oh * ow;
        let kernel = match self.variant {
            Some("rows") => Kernel::Conv2dRows,
            Some("tiled") => Kernel::Conv2d,
            _ if m <= FEW_ROWS => Kernel::Conv2dRows,
            _ => Kernel::Conv2d,
        };
        let slice = if bytes <= max_binding {
            cout_g
        } else {
            // Whole 64-column tiles per slice.
            let per_column = elem_bytes(k_g, precision);
            (max_binding / per_column) as usize / 64 * 64
        };
        if c.groups > 1 && slice < cout_g || slice == 0 {
            return Err(BackendError::DeviceLimit(format!(
                "`{node}.weight` needs {} in one buffer, but this adapter binds at most {} per storage buffer \
                 (max_storage_buffer_binding_size): use a smaller network, or another device",
                crate::units::human_bytes(bytes),
                crate::units::human_bytes(max_binding)
            )));
        }
        let mut launches = Vec::new();
        let mut uploaded = 0;
        for base in (0..cout_g).step_by(slice) {
            let width = slice.min(cout_g - base);
            let matrix: Vec<f32> = if width == cout_g {
                self.weights.to_vec()
            } else {
                (0..k_g)
                    .flat_map(|k| &self.weights[k * cout_g + base..][..width])
                    .copied()
                    .collect()
            };
            let bytes = to_bytes(&matrix, precision);
            uploaded += elem_bytes(matrix.len(), precision);
            let (i_h, i_w, cin) = self.input;
            // The order of `Params` in conv2d.wgsl.
            let params = vec![
                m,
                i_h,
                i_w,
                cin,
                oh,
                ow,
                c.out_channels,
                c.kernel.1,
                c.stride.0,
                c.stride.1,
                c.padding.0,
                c.padding.1,
                c.dilation.0,
                c.dilation.1,
                c.in_channels / c.groups,
                width,
                k_g,
                c.bias as usize,
                c.act.code() as usize,
                base,
                c.residual as usize,
            ];
            let groups = match kernel {
                Kernel::Conv2dRows => (m.div_ceil(8), width.div_ceil(64), c.groups),
                _ => (m.div_ceil(64), width.div_ceil(64), c.groups),
            };
            let groups = (groups.0 as u32, groups.1 as u32, groups.2 as u32);
            launches.push((
                kernel,
                params,
                vec![(2, consts.add("weights", bytes))],
                4,
                groups,
            ));
        }
        Ok((launches, uploaded))
    }
}

/// A depthwise convolution without a fused residual: the direct kernel, which applies the
/// bias and activation itself (one with a residual takes the GEMM's).
fn is_plain_depthwise(conv: &Conv2d) -> bool {
    conv.groups > 1
        && conv.groups == conv.in_channels
        && conv.groups == conv.out_channels
        && !conv.residual
}

/// Depthwise weights (c, kh, kw) as (ky, kx, c) in f32, rounded to the run's precision.
fn depthwise_weights(
    wt: &[f32],
    c: usize,
    (kh, kw): (usize, usize),
    precision: Precision,
) -> Vec<f32> {
    let mut dw = vec![0f32; kh * kw * c];
    for ch in 0..c {
        for k in 0..kh * kw {
            dw[k * c + ch] = precision.round(wt[ch * kh * kw + k]);
        }
    }
    dw
}

/// A convolution or linear layer as the implicit GEMM of conv2d.wgsl: the convolution, its
/// packed weights and its input as NHWC (h, w, c). A linear layer's W (out × in) is the
/// (in × out) B matrix of a 1×1 convolution on 1×1 images.
fn as_gemm(
    op: &Op,
    weight: &[f32],
    input: (usize, usize, usize),
) -> (Conv2d, Vec<f32>, (usize, usize, usize)) {
    match *op {
        Op::Conv2d(conv) => (conv, pack_conv(&conv, weight), input),
        Op::Linear {
            in_features: fin,
            out_features: fout,
            ..
        } => {
            let mut packed = vec![0f32; fin * fout];
            for o in 0..fout {
                for k in 0..fin {
                    packed[k * fout + o] = weight[o * fin + k];
                }
            }
            let conv = op.as_conv().expect("a linear layer is a 1×1 convolution");
            (conv, packed, (1, 1, fin))
        }
        _ => unreachable!("only convolutions and linear layers are GEMMs"),
    }
}

/// Launches with the buffers every one of them reads added.
fn with_reads(mut launches: Vec<Part>, reads: &[(u32, Buf)]) -> Vec<Part> {
    for l in &mut launches {
        l.2.extend_from_slice(reads);
    }
    launches
}

/// PyTorch's (cout, cin/g, kh, kw) weight as per-group (taps × cout_g) matrices, taps
/// ordered (ky, kx, ci) like the NHWC gather of the kernel.
fn pack_conv(conv: &Conv2d, weight: &[f32]) -> Vec<f32> {
    let (k_g, cout_g) = (conv.taps(), conv.out_channels / conv.groups);
    let mut packed = Vec::with_capacity(conv.groups * k_g * cout_g);
    for g in 0..conv.groups {
        for k in 0..k_g {
            packed.extend((0..cout_g).map(|co| weight[conv.weight_index(g, k, co)]));
        }
    }
    packed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::graph::{ConvInit, GraphBuilder, LinearInit};
    use crate::model::zoo;

    const ROOMY: Limits = Limits {
        max_groups: 65535,
        max_binding: 128 << 20,
    };

    /// ResNet-18 lowers to a launch per node (the flatten of 1×1 maps renames) and the output's
    /// conversion; every binding names a buffer that exists; no launch writes a buffer it
    /// reads; and every launch's output is its node's assigned buffer.
    #[test]
    fn resnet18_lowers_to_sound_launches() {
        let graph = zoo::build("resnet18").unwrap();
        let plan = graph.plan(2, 64, 64).unwrap();
        let weights = Weights::init(&graph, 0);
        let l = lower(&plan, &weights, Precision::Fp32, &BTreeMap::new(), ROOMY).unwrap();
        let renamed = (0..plan.graph.nodes.len())
            .filter(|&id| renames(&plan, id))
            .count();
        assert_eq!(renamed, 1, "the flatten after global pooling");
        assert_eq!(l.launches.len(), plan.graph.nodes.len() - renamed + 1);
        assert!(l.weight_bytes > graph.param_count() * 4 * 9 / 10);
        let computed = (0..plan.graph.nodes.len()).filter(|&id| !renames(&plan, id));
        for (id, launch) in computed.zip(&l.launches) {
            let out = launch.bindings.last().unwrap().1;
            assert_eq!(launch.node, plan.graph.nodes[id].name);
            assert_eq!(
                out,
                Buf::Activation(l.assignment.of[id]),
                "`{}`",
                launch.node
            );
            for &(_, b) in &launch.bindings[..launch.bindings.len() - 1] {
                assert_ne!(b, out, "`{}` reads the buffer it writes", launch.node);
                match b {
                    Buf::Activation(i) => assert!(i < l.assignment.bytes.len()),
                    Buf::Const(i) => assert!(i < l.consts.0.len()),
                    _ => {}
                }
            }
        }
        let last = l.launches.last().unwrap();
        assert_eq!(
            (last.kernel, last.bindings.last().unwrap().1),
            (Kernel::ToF32, Buf::Output)
        );
    }

    fn linear(fin: usize, fout: usize) -> (Plan, Weights) {
        let mut g = GraphBuilder::new("fc", fin, ConvInit::TorchDefault, LinearInit::TorchDefault);
        let x = g.input();
        let x = g.flatten("flatten", x);
        let y = g.linear("fc", x, fin, fout);
        let graph = g.finish(y);
        let weights = Weights::init(&graph, 1);
        (graph.plan(2, 1, 1).unwrap(), weights)
    }

    /// A weight matrix larger than one binding is cut into slices of whole 64-column tiles, one
    /// launch each; a grid above the adapter's limit is refused as a device limit.
    #[test]
    fn limits_slice_weights_and_refuse_grids() {
        let (plan, weights) = linear(64, 256);
        let small = Limits {
            max_groups: 65535,
            max_binding: 16 << 10,
        };
        let l = lower(&plan, &weights, Precision::Fp32, &BTreeMap::new(), small).unwrap();
        let fc: Vec<&Launch> = l.launches.iter().filter(|l| l.node == "fc").collect();
        assert_eq!(fc.len(), 4, "64 × 256 f32 weights in 16 KiB bindings");
        assert_eq!(l.weight_bytes, 64 * 256 * 4 + 256 * 4);
        let (big_batch, big_weights) = linear(64, 64);
        let big_batch = big_batch.graph.plan(600, 1, 1).unwrap();
        let few = Limits {
            max_groups: 4,
            max_binding: 128 << 20,
        };
        let e = lower(
            &big_batch,
            &big_weights,
            Precision::Fp32,
            &BTreeMap::new(),
            few,
        );
        let e = e.unwrap_err();
        assert!(matches!(e, BackendError::DeviceLimit(_)), "{e}");
        let mut missing = weights.clone();
        missing.remove("fc.weight");
        let e = lower(&plan, &missing, Precision::Fp32, &BTreeMap::new(), ROOMY).unwrap_err();
        assert!(e.to_string().contains("fc.weight"), "{e}");
    }

    /// max-autotune's choice picks the GEMM kernel.
    #[test]
    fn variants_choose_the_gemm_kernel() {
        let (plan, weights) = linear(64, 64);
        let kernel = |v: &str| {
            let variants = BTreeMap::from([("fc".to_string(), v.to_string())]);
            let l = lower(&plan, &weights, Precision::Fp32, &variants, ROOMY).unwrap();
            l.launches.iter().find(|l| l.node == "fc").unwrap().kernel
        };
        assert_eq!(kernel("tiled"), Kernel::Conv2d);
        assert_eq!(kernel("rows"), Kernel::Conv2dRows);
    }
}

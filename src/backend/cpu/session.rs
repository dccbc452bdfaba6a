//! A prepared CPU session: the plan's nodes as steps (weights packed for their kernels), run
//! node by node on the worker pool, in batch tiles where the plan has them, with each
//! activation freed after its last reader and buffers recycled so the timed loop does not
//! allocate.

use std::sync::Arc;
use std::time::Instant;

use super::calibration::{BN_EPS, channel_stats};
use super::*;
use super::{BackendError, KernelTime, MemoryStats, Session};
use crate::model::buffers::take_best_fit;

/// What a node does at run time, with its weights packed for the kernel.
pub(super) enum NodeKernel<T> {
    Input,
    Conv(PackedConv<T>),
    Affine {
        scale: Vec<f32>,
        shift: Vec<f32>,
    },
    /// A per-channel scale (ConvNeXt's layer scale): the affine kernel with a zero shift, kept
    /// apart from batch norm's, which calibration rewrites.
    Scale {
        scale: Vec<f32>,
        zero: Vec<f32>,
    },
    Clamp {
        lo: f32,
        hi: f32,
    },
    Sigmoid,
    Unary(crate::model::op::Unary),
    ScaleChannels,
    Pool {
        pool: Pool,
        max: bool,
    },
    Adaptive,
    Add,
    Linear {
        weight: PackedLinear<T>,
        fin: usize,
        fout: usize,
    },
    Flatten,
    Identity,
    Softmax,
    ClassToken(Vec<f32>),
    Positions(Vec<f32>),
    LayerNorm {
        weight: Vec<f32>,
        bias: Vec<f32>,
        eps: f32,
    },
    Gelu,
    Attention {
        /// The q/k/v and output projections.
        proj: Box<(PackedLinear<T>, PackedLinear<T>)>,
        dim: usize,
        heads: usize,
    },
    SelectToken(usize),
    /// Concatenation, channel slice or shuffle.
    Copies(Vec<crate::model::op::ChannelCopy>),
    WindowAttention {
        /// The q/k/v and output projections.
        proj: Box<(PackedLinear<T>, PackedLinear<T>)>,
        params: crate::model::weights::WindowParams,
        bias: kernels::WindowBias,
        attention: crate::model::op::WindowAttention,
    },
    PatchMerge,
}

/// An activation buffer: the first `len` elements of `data` in use. Every element of `data` is
/// initialised (zeros when it was made), so a buffer serves any length up to `data.len()`
/// without being filled again: a `Vec` truncated and grown back would refill the difference on
/// every pass (a memset of up to a whole tensor per op).
pub(super) struct Buf<T> {
    data: super::Lines<T>,
    len: usize,
}

impl<T: bytemuck::Pod> std::ops::Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data[..self.len]
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data[..self.len]
    }
}

pub(super) struct CpuSession<T: Elem> {
    pub(super) plan: Plan,
    pub(super) steps: Vec<NodeKernel<T>>,
    pub(super) names: Vec<String>,
    pub(super) pool: Arc<rayon::ThreadPool>,
    pub(super) threads: usize,
    pub(super) profile: bool,
    /// Buffers that are free for reuse, and the one holding the last output.
    pub(super) free: Vec<Buf<T>>,
    pub(super) output: Option<Buf<T>>,
    pub(super) times: Vec<KernelTime>,
    /// Profiling: the parts of the node being run that end before it does (an attention
    /// layer's projections and core), each its op kind and when it ended.
    laps: Vec<(&'static str, Instant)>,
    /// Batch-norm calibration mode: normalise with each batch's own statistics and keep
    /// them (node id, mean, biased variance) instead of using the running ones.
    pub(super) calibrate: bool,
    pub(super) batch_stats: Vec<(usize, Vec<f32>, Vec<f32>)>,
    /// The batch tiles of the first layers (see [`batch_tiles`]); not used while calibrating, whose
    /// statistics are the whole batch's.
    pub(super) split: Option<batch_tiles::Split>,
    /// Node p and p + 1 are a pointwise and a depthwise layer [`CpuSession::fused`] may run
    /// as one where `paired[p]`.
    pub(super) paired: Vec<bool>,
    /// Node d and d + 1 are a depthwise layer and a pointwise one reading its output alone,
    /// which [`CpuSession::fused`] may run on the depthwise rows as they are made, where
    /// `projected[d]` (see [`projections`]).
    pub(super) projected: Vec<bool>,
    /// Node d is a depthwise layer whose output a global average pool reads where
    /// `squeezed[d]` (a squeeze-and-excitation block's squeeze): its kernel sums each output
    /// row as it writes it, and the pool adds up those sums instead of reading the tensor.
    pub(super) squeezed: Vec<bool>,
    /// Node id is a layer with a residual it reads last that writes its output over the
    /// residual's buffer where `over_residual[id]` (see [`over_residuals`]).
    over_residual: Vec<bool>,
    /// Node b is a batch norm that [`CpuSession::prologue`] runs with the clamp after it (if
    /// any) and the pointwise layer that reads them, node `prologued[b]`, as that layer alone
    /// (see [`prologues`]).
    pub(super) prologued: Vec<Option<usize>>,
    /// The row sums a squeezed layer made on its last run, with the images they are of.
    row_sums: Vec<Option<(std::ops::Range<usize>, Vec<f32>)>>,
    /// A core's L2 in bytes (for [`kernels::pair_bands`]).
    pub(super) l2: usize,
    pub(super) weight_bytes: u64,
    pub(super) held_bytes: u64,
    pub(super) peak_bytes: u64,
}

/// Bytes of f32 weights a session being prepared frees before it gives the pages back to the
/// system ([`give_back_freed`]): a few trims a network, each a walk over the allocator's heaps.
const RETURN_EVERY: u64 = 16 << 20;

impl<T: Elem> CpuSession<T> {
    /// The session for `plan`, its layers packed from `weights`; owned weights lose each
    /// node's tensors once the node has its own copy (see [`Backend::prepare_owned`]).
    pub(super) fn new(
        plan: &Plan,
        mut weights: Cow<'_, Weights>,
        pool: Arc<rayon::ThreadPool>,
        threads: usize,
        opt: &ExecOptions,
        donor: &mut Donor,
    ) -> Result<Self, BackendError> {
        let (profile, variants) = (opt.profile, &opt.variants);
        let split = batch_split(plan, std::mem::size_of::<T>(), opt.schedule.as_deref())?;
        // The shape each node runs at: the most images one call of it sees.
        let run_shape = |id: usize| {
            let mut shape = plan.shapes[id].clone();
            if let (Some(s), Some(n)) = (&split, shape.first_mut()) {
                *n = s.images(id, *n);
            }
            shape
        };
        let mut steps = Vec::with_capacity(plan.graph.nodes.len());
        let (mut weight_bytes, mut released) = (0u64, 0u64);
        for (id, node) in plan.graph.nodes.iter().enumerate() {
            let get = |suffix: &str| weights.param(&node.name, suffix);
            let shape = run_shape(id);
            let step = match node.op {
                Op::Input { .. } => NodeKernel::Input,
                Op::Conv2d(c) => {
                    let bias = if c.bias { Some(get("bias")?) } else { None };
                    let variant = variants.get(&node.name).map(String::as_str);
                    let tile = match variant {
                        Some(v) => winograd::Tile::from_variant(v),
                        None => winograd::by_default(&c, &shape, kernels::pair_engine::<T>(&c)),
                    };
                    let donated = variant
                        .is_none()
                        .then(|| donor.take::<T>(id, tile, &shape))
                        .flatten();
                    let mut packed = match donated {
                        Some(packed) => packed,
                        None => tile
                            .and_then(|t| {
                                let w = get("weight").ok()?;
                                PackedConv::<T>::winograd(t, c, w, bias, &shape)
                            })
                            .map_or_else(
                                || get("weight").map(|w| PackedConv::<T>::new(c, w, bias)),
                                Ok,
                            )?,
                    };
                    packed.chunk_scale = kernels::chunk_scale(variant);
                    weight_bytes += packed.bytes();
                    NodeKernel::Conv(packed)
                }
                Op::BatchNorm { eps, .. } => {
                    let (scale, shift) = weights.batch_norm_affine(&node.name, eps)?;
                    weight_bytes += 2 * scale.len() as u64 * 4;
                    NodeKernel::Affine { scale, shift }
                }
                Op::Relu => NodeKernel::Clamp {
                    lo: 0.0,
                    hi: f32::INFINITY,
                },
                Op::Relu6 => NodeKernel::Clamp { lo: 0.0, hi: 6.0 },
                Op::Sigmoid => NodeKernel::Sigmoid,
                Op::Unary(u) => NodeKernel::Unary(u),
                Op::ScaleChannels => NodeKernel::ScaleChannels,
                Op::MaxPool(p) => NodeKernel::Pool { pool: p, max: true },
                Op::AvgPool(p) => NodeKernel::Pool {
                    pool: p,
                    max: false,
                },
                Op::AdaptiveAvgPool { .. } => NodeKernel::Adaptive,
                Op::Add => NodeKernel::Add,
                Op::Linear {
                    in_features,
                    out_features,
                    bias,
                    act,
                    residual: _,
                } => {
                    let bias = if bias { Some(get("bias")?) } else { None };
                    let dims = (in_features, out_features);
                    let weight = PackedLinear::with_act(get("weight")?, bias, dims, act);
                    weight_bytes += weight.bytes();
                    NodeKernel::Linear {
                        weight,
                        fin: in_features,
                        fout: out_features,
                    }
                }
                Op::Flatten => NodeKernel::Flatten,
                Op::Dropout { .. } => NodeKernel::Identity,
                Op::Softmax => NodeKernel::Softmax,
                // NHWC images already are (N, H·W, C) tokens.
                Op::Tokens => NodeKernel::Identity,
                Op::ClassToken { .. } => NodeKernel::ClassToken(get("")?.to_vec()),
                Op::PosEmbed { .. } => NodeKernel::Positions(get("")?.to_vec()),
                Op::LayerNorm { dim, eps, affine } => {
                    let (weight, bias) = weights.layer_norm(&node.name, (dim, affine))?;
                    NodeKernel::LayerNorm { weight, bias, eps }
                }
                Op::Gelu => NodeKernel::Gelu,
                Op::Attention { dim, heads, .. } => {
                    let in_proj = PackedLinear::new(
                        get("in_proj_weight")?,
                        Some(get("in_proj_bias")?),
                        dim,
                        3 * dim,
                    );
                    let out_proj = PackedLinear::new(
                        get("out_proj.weight")?,
                        Some(get("out_proj.bias")?),
                        dim,
                        dim,
                    );
                    weight_bytes += in_proj.bytes() + out_proj.bytes();
                    NodeKernel::Attention {
                        proj: Box::new((in_proj, out_proj)),
                        dim,
                        heads,
                    }
                }
                Op::SelectToken { index } => NodeKernel::SelectToken(index),
                // NHWC images already are (N, H·W, C) tokens, and tokens an NHWC image.
                Op::Image => NodeKernel::Identity,
                Op::WindowAttention(attention) => {
                    let params = weights.window_attention(&node.name, &attention)?;
                    let bias = Some(params.qkv_bias.as_slice());
                    let dim = attention.dim;
                    let [qkv_w, _, proj_w, proj_b] = attention.form.projections();
                    let qkv = PackedLinear::new(get(qkv_w)?, bias, dim, 3 * dim);
                    let out = PackedLinear::new(get(proj_w)?, Some(get(proj_b)?), dim, dim);
                    let bias = kernels::WindowBias::new(&params, &attention);
                    weight_bytes += qkv.bytes() + out.bytes() + bias.bytes();
                    NodeKernel::WindowAttention {
                        proj: Box::new((qkv, out)),
                        params,
                        bias,
                        attention,
                    }
                }
                Op::PatchMerge => NodeKernel::PatchMerge,
                Op::Concat { .. } | Op::ChannelSlice { .. } | Op::ChannelShuffle { .. } => {
                    NodeKernel::Copies(plan.channel_copies(node).unwrap_or_default())
                }
                Op::LayerScale { channels } => {
                    weight_bytes += channels as u64 * 4;
                    NodeKernel::Scale {
                        scale: get("")?.to_vec(),
                        zero: vec![0.0; channels],
                    }
                }
            };
            if let Cow::Owned(w) = &mut weights {
                released += w.release(node);
                // Hand the pages back to the system now and then: the packed copies live in
                // mappings of their own (`big_buffer`), so the allocator's freed tensors would
                // otherwise stay resident, unused, for the session's life.
                if released >= RETURN_EVERY {
                    give_back_freed();
                    released = 0;
                }
            }
            steps.push(step);
        }
        // What no node took (a training-only head's), and the last pages freed.
        if let Cow::Owned(w) = weights {
            drop(w);
            give_back_freed();
        }
        let paired = pairs(plan, &steps);
        let projected = projections(plan, &steps);
        let squeezed = squeezes(plan, &steps);
        let over_residual = over_residuals(plan, &steps, || probe::over_residual().pays());
        let prologued = prologues(plan, &steps, |id| paired[id] || projected[id]);
        let runs = fused_runs(&paired, &projected, &prologued);
        let split = split.map(|s| past_runs(s, &runs));
        let names = plan.graph.nodes.iter().map(|n| n.name.clone()).collect();
        Ok(CpuSession {
            plan: plan.clone(),
            steps,
            names,
            pool,
            threads,
            profile,
            free: Vec::new(),
            output: None,
            times: Vec::new(),
            laps: Vec::new(),
            calibrate: false,
            batch_stats: Vec::new(),
            split,
            paired,
            projected,
            row_sums: vec![None; squeezed.len()],
            squeezed,
            over_residual,
            prologued,
            l2: sgemm::l2_bytes(),
            weight_bytes,
            held_bytes: 0,
            peak_bytes: 0,
        })
    }

    /// A buffer of exactly `len` elements: the smallest free one that is large enough, or a new
    /// one. Buffers are reused at run time (not laid out ahead as the GPU programs are) because
    /// batch tiles run parts of the batch through the same nodes.
    pub(super) fn alloc(&mut self, len: usize) -> Buf<T> {
        let fit = take_best_fit(&mut self.free, len as u64, |b| b.data.len() as u64);
        let mut buf = match fit {
            Some(buf) => buf,
            None => {
                self.held_bytes += (len * std::mem::size_of::<T>()) as u64;
                self.peak_bytes = self.peak_bytes.max(self.held_bytes);
                Buf {
                    data: big_buffer(len),
                    len,
                }
            }
        };
        buf.len = len;
        buf
    }

    /// Node `id`'s output for `n` images, as NHWC dimensions.
    pub(super) fn dims(&self, id: usize, n: usize) -> Nhwc {
        match *self.plan.shapes[id].as_slice() {
            [_, c, h, w] => Nhwc { n, h, w, c },
            // Tokens (N, T, D): T rows of D per image.
            [_, t, d] => Nhwc {
                n,
                h: t,
                w: 1,
                c: d,
            },
            [_, f] => Nhwc {
                n,
                h: 1,
                w: 1,
                c: f,
            },
            _ => Nhwc {
                n: 1,
                h: 1,
                w: 1,
                c: self.plan.shapes[id].iter().product(),
            },
        }
    }

    pub(super) fn forward(&mut self, input: &Tensor) -> Result<(), BackendError> {
        if input.shape != self.plan.input_shape() {
            return Err(BackendError::Invalid(format!(
                "input has shape {:?}, the prepared plan expects {:?}",
                input.shape,
                self.plan.input_shape()
            )));
        }
        if let Some(out) = self.output.take() {
            self.free.push(out);
        }
        self.times.clear();
        let start = Instant::now();
        let n_nodes = self.plan.graph.nodes.len();
        let batch = self.plan.batch();
        let mut values: Vec<Option<Buf<T>>> = (0..n_nodes).map(|_| None).collect();
        let mut steps = std::mem::take(&mut self.steps);
        let levels = match &self.split {
            Some(split) if !self.calibrate => split.levels.clone(),
            _ => Vec::new(),
        };
        let last = n_nodes - 1;
        self.run_nodes(
            &mut steps,
            &levels,
            last,
            0..batch,
            &mut values,
            input,
            start,
        );
        self.steps = steps;
        self.output = values[self.plan.graph.output].take();
        self.free.extend(values.into_iter().flatten());
        Ok(())
    }

    /// Nodes `0..=upto` on `images` of the batch, the batch tiles of `levels` (innermost first)
    /// that lie inside: up to the outermost level's cut, one of its tiles at a time (each
    /// through the levels inside it), the cut's values copied into their place among
    /// `images`, then the rest of the nodes on all of `images`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_nodes(
        &mut self,
        steps: &mut [NodeKernel<T>],
        levels: &[batch_tiles::Level],
        upto: usize,
        images: std::ops::Range<usize>,
        values: &mut [Option<Buf<T>>],
        input: &Tensor,
        start: Instant,
    ) {
        let mut first = 0;
        if let Some((level, inner)) = levels.split_last() {
            if level.end > upto || level.tile >= images.len() {
                return self.run_nodes(steps, inner, upto, images, values, input, start);
            }
            let end = level.end;
            let per_image = self.dims(end, 1).elems();
            let mut joined = self.alloc(per_image * images.len());
            for part in batch_tiles::parts(images.clone(), level.tile) {
                let mut tile: Vec<Option<Buf<T>>> = (0..=end).map(|_| None).collect();
                self.run_nodes(steps, inner, end, part.clone(), &mut tile, input, start);
                let out = tile[end].take().expect("the cut computed");
                let at = (part.start - images.start) * per_image;
                joined[at..at + out.len()].copy_from_slice(&out);
                self.free.push(out);
                self.free.extend(tile.into_iter().flatten());
            }
            values[end] = Some(joined);
            first = end + 1;
        }
        let mut id = first;
        while id <= upto {
            let prologued = self.prologue(id, upto, steps, values, images.len(), start);
            if prologued > 0 {
                id += prologued;
                continue;
            }
            let fused = self.fused(id, upto, steps, values, images.clone(), start);
            if fused > 0 {
                id += fused;
                continue;
            }
            self.step(id, &mut steps[id], values, input, images.clone(), start);
            id += 1;
        }
    }

    /// The layers from `first` (up to `upto`) that run as one kernel on `images`, where
    /// they do: pointwise layer `first` and the depthwise layer after it (see [`pairs`]),
    /// where [`kernels::pair_bands`] takes them, and the pointwise layer that projects the
    /// depthwise one's output after that (see [`projections`]); or a depthwise layer `first`
    /// and its projection, where [`kernels::projected_bands`] takes them. The last layer's
    /// output is left in `values`, the others' never made. Returns how many layers ran (0:
    /// none, nothing done). Profiling times them as one kernel, on the depthwise layer's node.
    fn fused(
        &mut self,
        first: usize,
        upto: usize,
        steps: &[NodeKernel<T>],
        values: &mut [Option<Buf<T>>],
        images: std::ops::Range<usize>,
        forward_start: Instant,
    ) -> usize {
        let pointwise = self.paired[first] && first < upto;
        let d = first + usize::from(pointwise);
        let project = self.projected[d] && d < upto;
        if !pointwise && !project {
            return 0;
        }
        let conv = |id: usize| match &steps[id] {
            NodeKernel::Conv(c) => Some(c),
            _ => None,
        };
        let (Some(dw), pw) = (conv(d), pointwise.then(|| conv(first)).flatten()) else {
            return 0;
        };
        let start = Instant::now();
        let x_id = self.plan.graph.nodes[first].inputs[0];
        let (xs, ys) = (self.dims(x_id, images.len()), self.dims(d, images.len()));
        let band = match pw {
            Some(pw) => kernels::pair_bands((pw, dw), xs, ys, self.threads, self.l2),
            None => {
                let proj = conv(d + 1).expect("projections are convolutions");
                kernels::projected_bands((dw, proj), xs, ys, self.threads, self.l2)
            }
        };
        let Some(band) = band else {
            return 0;
        };
        let last = d + usize::from(project);
        let mut y = self.alloc(self.dims(last, images.len()).elems());
        let x = values[x_id].as_ref().expect("input computed");
        let residual = project
            .then(|| self.plan.graph.nodes[last].inputs.get(1))
            .flatten()
            .map(|&r| &values[r].as_ref().expect("residual computed")[..]);
        let projection = project.then(|| kernels::Projection {
            conv: conv(last).expect("projections are convolutions"),
            residual,
        });
        let mut sums = (self.squeezed[d] && !project).then(|| vec![0f32; ys.n * ys.h * ys.c]);
        let made = kernels::pointwise_depthwise(
            pw,
            dw,
            x,
            xs,
            &mut y,
            ys,
            band,
            sums.as_deref_mut(),
            projection,
        );
        self.row_sums[d] = sums.filter(|_| made).map(|s| (images.clone(), s));
        values[last] = Some(y);
        // The inputs from outside that these layers read last: the first one's, the
        // projection's residual.
        for node in [first, last] {
            for &v in &self.plan.graph.nodes[node].inputs {
                if v < first
                    && self.plan.last_use[v] <= last
                    && let Some(buf) = values[v].take()
                {
                    self.free.push(buf);
                }
            }
        }
        if self.profile {
            let end = Instant::now();
            let kernel = match (pointwise, project) {
                (true, true) => "conv2d_pointwise_depthwise_pointwise",
                (true, false) => "conv2d_pointwise_depthwise",
                _ => "conv2d_depthwise_pointwise",
            };
            self.times.push(KernelTime {
                node: self.names[d].clone(),
                op: "conv2d".into(),
                kernel: format!("{kernel}_{}", T::SUFFIX),
                start_ns: start.duration_since(forward_start).as_nanos() as u64,
                ns: end.duration_since(start).as_nanos() as u64,
                fused: (first..=last)
                    .filter(|&id| id != d)
                    .map(|id| self.names[id].clone())
                    .collect(),
            });
        }
        last + 1 - first
    }

    /// Batch norm `b`, the clamp after it (if any) and the pointwise layer that reads them
    /// (see [`prologues`]) as the layer on the batch norm's input, the map applied to its rows
    /// as the layer's kernel reads them ([`kernels::conv2d_prologue`]), for `n` images: the
    /// layer's output is left in `values`, the others' never made. Returns how many nodes ran
    /// (0: none, where `b` starts no such run, it ends past `upto`, or the session calibrates:
    /// calibration's batch norms measure their input). Profiling times them as one kernel, on
    /// the layer's node.
    fn prologue(
        &mut self,
        b: usize,
        upto: usize,
        steps: &[NodeKernel<T>],
        values: &mut [Option<Buf<T>>],
        n: usize,
        forward_start: Instant,
    ) -> usize {
        let Some(id) = self.prologued[b].filter(|&id| id <= upto && !self.calibrate) else {
            return 0;
        };
        let (NodeKernel::Affine { scale, shift }, NodeKernel::Conv(p)) = (&steps[b], &steps[id])
        else {
            return 0;
        };
        let (lo, hi) = match steps[b + 1] {
            NodeKernel::Clamp { lo, hi } if b + 1 < id => (lo, hi),
            _ => (f32::NEG_INFINITY, f32::INFINITY),
        };
        let start = Instant::now();
        let x_id = self.plan.graph.nodes[b].inputs[0];
        let (xs, ys) = (self.dims(x_id, n), self.dims(id, n));
        let mut y = self.alloc(ys.elems());
        let x = values[x_id].as_ref().expect("input computed");
        let prologue = kernels::Prologue {
            scale,
            shift,
            lo,
            hi,
        };
        kernels::conv2d_prologue(p, x, (xs, prologue), &mut y, ys, self.threads);
        values[id] = Some(y);
        if self.plan.last_use[x_id] <= id
            && let Some(buf) = values[x_id].take()
        {
            self.free.push(buf);
        }
        if self.profile {
            let end = Instant::now();
            self.times.push(KernelTime {
                node: self.names[id].clone(),
                op: "conv2d".into(),
                kernel: kernel_name(&steps[id], &self.plan.graph.nodes[id].op, ys.pixels()),
                start_ns: start.duration_since(forward_start).as_nanos() as u64,
                ns: end.duration_since(start).as_nanos() as u64,
                fused: (b..id).map(|v| self.names[v].clone()).collect(),
            });
        }
        id + 1 - b
    }

    /// Node `id` on `images` of the batch: reads its inputs from `values`, leaves its output
    /// there, frees the inputs it read last, and times itself when profiling.
    pub(super) fn step(
        &mut self,
        id: usize,
        step: &mut NodeKernel<T>,
        values: &mut [Option<Buf<T>>],
        input: &Tensor,
        images: std::ops::Range<usize>,
        forward_start: Instant,
    ) {
        let start = self.profile.then(Instant::now);
        let os = self.dims(id, images.len());
        let inputs = self.plan.graph.nodes[id].inputs.clone();
        // An op that maps its input element-wise reuses the input's buffer when nothing
        // else reads it later (torchvision's `inplace=True`).
        let last_reader = |v: usize| self.plan.last_use[v] == id;
        let out = match step {
            NodeKernel::Input => {
                let mut y = self.alloc(os.elems());
                let image = input.data.len() / self.plan.batch();
                let x = &input.data[images.start * image..images.end * image];
                kernels::nchw_to_nhwc(x, os, &mut y);
                y
            }
            NodeKernel::Conv(p) if self.over_residual[id] => {
                // The residual's buffer (its last reader) becomes the output.
                let mut y = values[inputs[1]].take().expect("residual computed");
                let x = values[inputs[0]].as_ref().expect("input computed");
                let xs = self.dims(inputs[0], images.len());
                kernels::conv2d_over_residual(p, x, xs, &mut y, os, self.threads);
                y
            }
            NodeKernel::Conv(p) => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                let x = values[inputs[0]].as_ref().expect("input computed");
                let residual = residual_input(values, &inputs);
                let mut sums = self.squeezed[id].then(|| vec![0f32; os.n * os.h * os.c]);
                let made = kernels::conv2d_squeezed(
                    p,
                    x,
                    xs,
                    &mut y,
                    os,
                    self.threads,
                    residual,
                    sums.as_deref_mut(),
                );
                self.row_sums[id] = sums.filter(|_| made).map(|s| (images.clone(), s));
                y
            }
            NodeKernel::Affine { scale, shift } => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                if self.calibrate {
                    let (mean, var) = channel_stats(&y, os.c);
                    let gamma_beta: Vec<(f32, f32)> = scale
                        .iter()
                        .zip(shift.iter())
                        .map(|(&s, &b)| (s, b))
                        .collect();
                    // In calibration the prepared scale/shift hold gamma and beta (see
                    // `calibrate_batch_norm`); turn them into the batch's normalisation.
                    for (c, (g, b)) in gamma_beta.into_iter().enumerate() {
                        scale[c] = g / (var[c] + BN_EPS).sqrt();
                        shift[c] = b - mean[c] * scale[c];
                    }
                    self.batch_stats.push((id, mean, var));
                }
                kernels::affine_inplace(&mut y, os.c, scale, shift);
                y
            }
            NodeKernel::Copies(copies) => {
                let mut y = self.alloc(os.elems());
                for copy in copies.iter() {
                    let x = values[inputs[copy.input]].as_ref().expect("input computed");
                    kernels::copy_channels(x, (&mut y, os.c), copy);
                }
                y
            }
            NodeKernel::Scale { scale, zero } => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                kernels::affine_inplace(&mut y, os.c, scale, zero);
                y
            }
            NodeKernel::Clamp { lo, hi } => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                kernels::clamp_inplace(&mut y, *lo, *hi);
                y
            }
            NodeKernel::Sigmoid => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                kernels::sigmoid_inplace(&mut y);
                y
            }
            NodeKernel::Unary(u) => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                kernels::unary_inplace(&mut y, *u);
                y
            }
            NodeKernel::ScaleChannels => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                let s = values[inputs[1]].as_ref().expect("input computed");
                kernels::scale_channels_inplace(&mut y, s, (os.h * os.w * os.c, os.c));
                y
            }
            NodeKernel::Identity => self.take_or_copy(values, inputs[0], last_reader(inputs[0])),
            NodeKernel::Add => {
                let (a, b) = if last_reader(inputs[0]) {
                    (inputs[0], inputs[1])
                } else {
                    (inputs[1], inputs[0])
                };
                let mut y = self.take_or_copy(values, a, last_reader(a));
                kernels::add_inplace(&mut y, values[b].as_ref().expect("input computed"));
                y
            }
            NodeKernel::Pool { pool, max } => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                kernels::pool(
                    pool,
                    *max,
                    values[inputs[0]].as_ref().expect("input computed"),
                    xs,
                    &mut y,
                    os,
                );
                y
            }
            NodeKernel::Adaptive => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                // A squeezed layer's row sums, where they are of these images.
                if os.h * os.w == 1
                    && let Some((of, sums)) = self.row_sums[inputs[0]].take()
                    && of == images
                {
                    kernels::mean_of_row_sums(&sums, xs, &mut y);
                } else {
                    kernels::adaptive_avg_pool(
                        values[inputs[0]].as_ref().expect("input computed"),
                        xs,
                        &mut y,
                        os,
                    );
                }
                y
            }
            NodeKernel::Flatten => {
                let xs = self.dims(inputs[0], images.len());
                if xs.h * xs.w == 1 {
                    self.take_or_copy(values, inputs[0], last_reader(inputs[0]))
                } else {
                    let mut y = self.alloc(os.elems());
                    kernels::nhwc_to_nchw(
                        values[inputs[0]].as_ref().expect("input computed"),
                        xs,
                        &mut y,
                    );
                    y
                }
            }
            NodeKernel::Linear { weight, fin, fout } => {
                // Over the last dimension: every token of every image is a row.
                let dims = (os.elems() / *fout, *fin, *fout);
                if self.over_residual[id] {
                    // The residual's buffer (its last reader) becomes the output.
                    let mut y = values[inputs[1]].take().expect("residual computed");
                    let x = values[inputs[0]].as_ref().expect("input computed");
                    kernels::linear_over_residual(x, weight, dims, &mut y, self.threads);
                    y
                } else {
                    let mut y = self.alloc(os.elems());
                    let x = values[inputs[0]].as_ref().expect("input computed");
                    let r = residual_input(values, &inputs);
                    kernels::linear_residual(x, weight, dims, &mut y, self.threads, r);
                    y
                }
            }
            NodeKernel::ClassToken(token) => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                let x = values[inputs[0]].as_ref().expect("input computed");
                kernels::class_token(x, xs.h, token, &mut y);
                y
            }
            NodeKernel::Positions(pos) => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                kernels::add_positions(&mut y, pos);
                y
            }
            NodeKernel::LayerNorm { weight, bias, eps } => {
                let mut y = self.alloc(os.elems());
                let x = values[inputs[0]].as_ref().expect("input computed");
                kernels::layer_norm(x, weight, bias, *eps, &mut y);
                y
            }
            NodeKernel::Gelu => {
                let mut y = self.take_or_copy(values, inputs[0], last_reader(inputs[0]));
                kernels::gelu_inplace(&mut y);
                y
            }
            NodeKernel::Attention { proj, dim, heads } => {
                let (in_proj, out_proj) = &**proj;
                let (rows, d) = (os.n * os.h, *dim);
                let x = values[inputs[0]].as_ref().expect("input computed");
                let mut qkv = self.alloc(rows * 3 * d);
                kernels::linear(x, in_proj, (rows, d, 3 * d), &mut qkv, self.threads);
                self.lap("linear");
                let mut heads_out = self.alloc(rows * d);
                kernels::attention(&qkv, (os.n, os.h, d, *heads), &mut heads_out);
                self.lap("attention");
                self.free.push(qkv);
                let r = residual_input(values, &inputs);
                self.out_projection(heads_out, out_proj, (rows, d), r)
            }
            NodeKernel::WindowAttention {
                proj,
                params,
                bias,
                attention,
            } => {
                let (qkv_proj, out_proj) = &**proj;
                let (rows, d) = (os.n * os.h * os.w, attention.dim);
                let x = values[inputs[0]].as_ref().expect("input computed");
                let mut qkv = self.alloc(rows * 3 * d);
                kernels::linear(x, qkv_proj, (rows, d, 3 * d), &mut qkv, self.threads);
                self.lap("linear");
                let mut heads_out = self.alloc(rows * d);
                let grid = attention.grid(os.h, os.w);
                let dims = (os.n, d, attention.heads);
                kernels::window_attention(&qkv, (params, bias), grid, dims, &mut heads_out);
                self.lap("window_attention");
                self.free.push(qkv);
                let r = residual_input(values, &inputs);
                self.out_projection(heads_out, out_proj, (rows, d), r)
            }
            NodeKernel::PatchMerge => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                let x = values[inputs[0]].as_ref().expect("input computed");
                kernels::patch_merge(x, xs, &mut y);
                y
            }
            NodeKernel::SelectToken(index) => {
                let xs = self.dims(inputs[0], images.len());
                let mut y = self.alloc(os.elems());
                let x = values[inputs[0]].as_ref().expect("input computed");
                kernels::select_token(x, (xs.h, xs.c), *index, &mut y);
                y
            }
            NodeKernel::Softmax => {
                let mut y = self.alloc(os.elems());
                kernels::softmax(
                    values[inputs[0]].as_ref().expect("input computed"),
                    os.c,
                    &mut y,
                );
                y
            }
        };
        values[id] = Some(out);
        for &i in &inputs {
            if self.plan.last_use[i] == id
                && let Some(buf) = values[i].take()
            {
                self.free.push(buf);
            }
        }
        if let Some(start) = start {
            let op = self.plan.graph.nodes[id].op.kind_name();
            let end = Instant::now();
            let name = kernel_name(step, &self.plan.graph.nodes[id].op, os.pixels());
            let whole = [(op, name, end)];
            // A node timed in parts: each part from the end of the one before, the last to
            // the node's end.
            let mut laps: Vec<(&str, String, Instant)> = std::mem::take(&mut self.laps)
                .into_iter()
                .map(|(op, at)| (op, format!("{op}_{}", T::SUFFIX), at))
                .collect();
            if let Some(last) = laps.last_mut() {
                last.2 = end;
            }
            let mut from = start;
            for (op, kernel, to) in if laps.is_empty() { whole.into() } else { laps } {
                self.times.push(KernelTime {
                    node: self.names[id].clone(),
                    op: op.to_string(),
                    kernel,
                    start_ns: from.duration_since(forward_start).as_nanos() as u64,
                    ns: to.duration_since(from).as_nanos() as u64,
                    fused: Vec::new(),
                });
                from = to;
            }
        }
    }

    /// An attention's output projection of its heads' output (`rows` × `d`), with the block's
    /// residual where the compile passes fused it; the heads' buffer goes back to the pool.
    fn out_projection(
        &mut self,
        heads_out: Buf<T>,
        proj: &PackedLinear<T>,
        (rows, d): (usize, usize),
        residual: Option<&[T]>,
    ) -> Buf<T> {
        let mut y = self.alloc(rows * d);
        kernels::linear_residual(
            &heads_out,
            proj,
            (rows, d, d),
            &mut y,
            self.threads,
            residual,
        );
        self.lap("linear");
        self.free.push(heads_out);
        y
    }

    /// Profiling: the part of the running node since the last lap (or its start) is done and
    /// counts as `op` (an attention layer's projections as `linear`).
    fn lap(&mut self, op: &'static str) {
        if self.profile {
            self.laps.push((op, Instant::now()));
        }
    }

    /// The input buffer itself when this node is its last reader, else a copy of it.
    pub(super) fn take_or_copy(
        &mut self,
        values: &mut [Option<Buf<T>>],
        v: usize,
        last: bool,
    ) -> Buf<T> {
        if last {
            return values[v].take().expect("input computed");
        }
        let len = values[v].as_ref().expect("input computed").len();
        let mut y = self.alloc(len);
        y.copy_from_slice(values[v].as_ref().expect("input computed"));
        y
    }
}

/// Which nodes start a pair [`CpuSession::fused`] may run as one: a pointwise layer without a
/// residual whose output a depthwise layer (without one) alone reads next
/// ([`chained`]), where [`kernels::can_pair`] says the kernels serve them.
fn pairs<T: Elem>(plan: &Plan, steps: &[NodeKernel<T>]) -> Vec<bool> {
    let nodes = &plan.graph.nodes;
    chained(plan, steps, |p, pw, dw| {
        nodes[p].inputs.len() == 1 && nodes[p + 1].inputs.len() == 1 && kernels::can_pair(pw, dw)
    })
}

/// Which nodes start a projection [`CpuSession::fused`] may run on their rows: a depthwise
/// layer whose output a pointwise layer (with or without a residual) alone reads next
/// ([`chained`]), where [`kernels::can_project`] says the kernels serve them.
fn projections<T: Elem>(plan: &Plan, steps: &[NodeKernel<T>]) -> Vec<bool> {
    chained(plan, steps, |_, dw, proj| kernels::can_project(dw, proj))
}

/// The nodes i where i and i + 1 are convolutions, node i + 1 reads node i's output as its
/// first input (and not again, as a residual), nothing else reads it, it is not the network's
/// output, and `takes(i, layer i, layer i + 1)`.
fn chained<T: Elem>(
    plan: &Plan,
    steps: &[NodeKernel<T>],
    takes: impl Fn(usize, &PackedConv<T>, &PackedConv<T>) -> bool,
) -> Vec<bool> {
    let nodes = &plan.graph.nodes;
    (0..steps.len())
        .map(|i| {
            let Some((NodeKernel::Conv(first), NodeKernel::Conv(next))) =
                steps.get(i).zip(steps.get(i + 1))
            else {
                return false;
            };
            nodes[i + 1].inputs.first() == Some(&i)
                && nodes[i + 1].inputs.iter().filter(|&&v| v == i).count() == 1
                && nodes.iter().filter(|n| n.inputs.contains(&i)).count() == 1
                && i != plan.graph.output
                && takes(i, first, next)
        })
        .collect()
}

/// The runs of nodes (first, last) the session may run as one kernel: a pair and the
/// projection after it, a projection alone, a prologue and its layer.
fn fused_runs(
    paired: &[bool],
    projected: &[bool],
    prologued: &[Option<usize>],
) -> Vec<(usize, usize)> {
    let projects = |d: usize| projected.get(d).copied().unwrap_or(false);
    let mut runs = Vec::new();
    for id in 0..paired.len() {
        if paired[id] {
            runs.push((id, id + 1 + usize::from(projects(id + 1))));
        } else if projects(id) && !(id > 0 && paired[id - 1]) {
            runs.push((id, id + 1));
        }
        if let Some(layer) = prologued[id] {
            runs.push((id, layer));
        }
    }
    runs
}

/// `split` with each level that ends inside a fused run (`runs`) ending at the run's last node
/// instead, where that stays before the next level's end: a cut inside a run splits it, and its
/// nodes then run apart (DenseNet-121's BF16 tiles ended at `features.transition2.relu`, between
/// the transition's batch norm and ReLU and the 1×1 layer that takes them as its prologue).
fn past_runs(mut split: batch_tiles::Split, runs: &[(usize, usize)]) -> batch_tiles::Split {
    for i in 0..split.levels.len() {
        let end = split.levels[i].end;
        let bound = split.levels.get(i + 1).map_or(usize::MAX, |l| l.end);
        if let Some(&(_, last)) = runs
            .iter()
            .find(|&&(first, last)| first <= end && end < last)
            && last < bound
        {
            split.levels[i].end = last;
        }
    }
    split
}

/// For each batch norm b whose output a pointwise layer reads alone, directly or through a
/// clamp (ReLU) that alone reads it, neither the network's output, where
/// [`kernels::can_prologue`] says the layer's kernel can map its rows and it runs in no other
/// fused run (`taken`): the layer's node (DenseNet's BN → ReLU → 1×1, in every dense layer and
/// transition).
fn prologues<T: Elem>(
    plan: &Plan,
    steps: &[NodeKernel<T>],
    taken: impl Fn(usize) -> bool,
) -> Vec<Option<usize>> {
    let nodes = &plan.graph.nodes;
    // Value v is node id's only input, read by nobody else, and not the network's output.
    let alone = |v: usize, id: usize| {
        v != plan.graph.output
            && nodes[id].inputs == [v]
            && nodes.iter().filter(|n| n.inputs.contains(&v)).count() == 1
    };
    (0..steps.len())
        .map(|b| {
            if !matches!(steps[b], NodeKernel::Affine { .. }) {
                return None;
            }
            let clamped =
                matches!(steps.get(b + 1), Some(NodeKernel::Clamp { .. })) && alone(b, b + 1);
            let id = b + 1 + usize::from(clamped);
            match steps.get(id) {
                Some(NodeKernel::Conv(p))
                    if alone(id - 1, id) && !taken(id) && kernels::can_prologue(p) =>
                {
                    Some(id)
                }
                _ => None,
            }
        })
        .collect()
}

/// Which nodes are squeezed (see [`CpuSession::squeezed`]): depthwise layers in f32 or bf16
/// storage (whose rows the pool's sums are made of) that a global average pool reads.
fn squeezes<T: Elem>(plan: &Plan, steps: &[NodeKernel<T>]) -> Vec<bool> {
    let nodes = &plan.graph.nodes;
    let storage = kernels::makes_row_sums::<T>();
    let mut squeezed = vec![false; steps.len()];
    for node in nodes {
        if let (Op::AdaptiveAvgPool { out: (1, 1) }, [d]) = (&node.op, node.inputs.as_slice())
            && let Some(NodeKernel::Conv(c)) = steps.get(*d)
            && c.depthwise.is_some()
            && storage
        {
            squeezed[*d] = true;
        }
    }
    squeezed
}

/// A layer's fused residual, its second input where it has one (computed by then).
fn residual_input<'v, T: bytemuck::Pod>(
    values: &'v [Option<Buf<T>>],
    inputs: &[usize],
) -> Option<&'v [T]> {
    let r = *inputs.get(1)?;
    Some(values[r].as_deref().expect("residual computed"))
}

/// Which layers write their output over their residual's buffer
/// ([`kernels::conv2d_over_residual`]): a convolution or linear layer whose residual (its
/// second input, not also its first) it reads last, which the kernels can run so (FP32 in one
/// K block, or bf16 pairs), where the CPU's probe says it pays (`pays`, asked only where some
/// layer could).
fn over_residuals<T: Elem>(
    plan: &Plan,
    steps: &[NodeKernel<T>],
    pays: impl FnOnce() -> bool,
) -> Vec<bool> {
    let nodes = &plan.graph.nodes;
    let mut over: Vec<bool> = (0..steps.len())
        .map(|id| match (&steps[id], nodes[id].inputs.as_slice()) {
            (NodeKernel::Conv(p), &[x, r]) => {
                x != r && plan.last_use[r] == id && kernels::writes_over_residual(p)
            }
            (NodeKernel::Linear { weight, .. }, &[x, r]) => {
                x != r && plan.last_use[r] == id && weight.writes_over_residual()
            }
            _ => false,
        })
        .collect();
    if over.contains(&true) && !pays() {
        over.fill(false);
    }
    over
}

pub(super) fn kernel_name<T: Elem>(step: &NodeKernel<T>, op: &Op, rows: usize) -> String {
    match step {
        NodeKernel::Conv(p) => p.kernel_name(rows),
        NodeKernel::Affine { .. } => format!("batch_norm_affine_{}", T::SUFFIX),
        NodeKernel::Input => format!("nchw_to_nhwc_{}", T::SUFFIX),
        _ => format!("{}_{}", op.kind_name(), T::SUFFIX),
    }
}

impl<T: Elem> Session for CpuSession<T> {
    fn run(&mut self, input: &Tensor) -> Result<(), BackendError> {
        let pool = Arc::clone(&self.pool);
        super::install_awake(&pool, || self.forward(input))
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        // The CPU runs synchronously: `run` returns when the work is done.
        Ok(())
    }

    fn read_output(&mut self) -> Result<Tensor, BackendError> {
        let out = self
            .output
            .as_ref()
            .ok_or_else(|| BackendError::Invalid("no forward pass has run yet".into()))?;
        let shape = self.plan.output_shape().to_vec();
        let mut data = vec![0f32; out.len()];
        if let [n, c, h, w] = *shape.as_slice() {
            let xs = Nhwc { n, h, w, c };
            let mut nchw = vec![T::default(); out.len()];
            kernels::nhwc_to_nchw(out, xs, &mut nchw);
            T::widen(&nchw, &mut data);
        } else {
            T::widen(out, &mut data);
        }
        Ok(Tensor::new(shape, data))
    }

    fn kernel_times(&mut self) -> Option<Vec<KernelTime>> {
        self.profile.then(|| self.times.clone())
    }

    fn memory(&self) -> MemoryStats {
        MemoryStats {
            weights: self.weight_bytes,
            peak_activations: self.peak_bytes,
            peak: self.weight_bytes + self.peak_bytes,
        }
    }

    fn replay(&self) -> Result<String, String> {
        Err(
            "the CPU backend runs every pass itself, synchronously, on a persistent thread pool \
             with buffers recycled from the first pass: there are no launches to record"
                .into(),
        )
    }

    fn kernel_version(&self) -> String {
        let tiles = match &self.split {
            Some(s) => format!(
                ", batch tiles of {}",
                s.describe(self.plan.batch(), |id| self.names[id].clone())
            ),
            None => String::new(),
        };
        format!(
            "workshop-cpu {} (sgemm {}, {}{tiles})",
            env!("CARGO_PKG_VERSION"),
            sgemm::kernel_name(),
            T::PRECISION
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::zoo;

    /// A session of `plan` on two workers, from borrowed `weights`.
    fn two_workers<T: Elem>(plan: &Plan, weights: &Weights, opt: &ExecOptions) -> CpuSession<T> {
        let pool = worker_pool(2, Vec::new()).unwrap();
        CpuSession::<T>::new(
            plan,
            Cow::Borrowed(weights),
            pool,
            2,
            opt,
            &mut Donor::default(),
        )
        .unwrap()
    }

    /// A pass whose first layers run a tile of images at a time gives the whole batch's
    /// outputs bit for bit: each image's values are its own, whatever else is in the call.
    /// Cuts after a downsampling block and after the stem's pooling, tiles of 1, 2 and 3
    /// images (the last part of 5 is 1 or 2), three nested levels, FP32 and BF16.
    #[test]
    fn batch_tiles_change_nothing() {
        fn check<T: Elem>(graph: &crate::model::Graph, weights: &Weights) {
            let cases: [&[(&str, usize)]; 4] = [
                &[("layer2.1.relu", 2)],
                &[("maxpool", 1)],
                &[("layer2.1.relu", 3)],
                &[
                    ("layer1.0.relu", 1),
                    ("layer1.1.relu", 2),
                    ("layer2.1.relu", 4),
                ],
            ];
            let plan = same_in_tiles::<T>(graph, weights, &cases);
            let refused = |asked: &[(&str, usize)]| batch_tiles::at(&plan, asked).is_err();
            assert!(
                refused(&[("layer2.1.conv1", 2)]),
                "the block's input is live"
            );
            assert!(
                refused(&[("layer2.1.relu", 2), ("layer1.1.relu", 4)]),
                "out of order"
            );
            assert!(
                refused(&[("layer1.1.relu", 2), ("layer2.1.relu", 2)]),
                "tiles not growing"
            );
        }
        let graph = zoo::build("resnet18").unwrap();
        let weights = Weights::init(&graph, 3);
        check::<f32>(&graph, &weights);
        check::<bf16>(&graph, &weights);
    }

    /// [`batch_tiles_change_nothing`] through tokens (N, T, D): a small ConvNeXt, eager and
    /// compiled (its linear layers with GELU and the layer scale folded in), cut after its
    /// first and second stages, FP32 and BF16.
    #[test]
    fn batch_tiles_of_tokens_change_nothing() {
        let graph = zoo::convnext_custom("convnext_small_test", [8, 16, 24, 32], [1, 2, 1, 1], 10);
        let weights = Weights::init(&graph, 5);
        let (fused, fused_weights, _) =
            crate::model::passes::optimize(&graph, weights.clone()).unwrap();
        let cases: [&[(&str, usize)]; 3] = [
            &[("features.1.0.add", 2)],
            &[("features.2.1", 1), ("features.3.1.add", 3)],
            &[("features.3.0.add", 4)],
        ];
        for (g, w) in [(&graph, &weights), (&fused, &fused_weights)] {
            same_in_tiles::<f32>(g, w, &cases);
            same_in_tiles::<bf16>(g, w, &cases);
        }
    }

    /// Runs `graph` at batch 5 (32²) whole, then in the tiles of each of `cases` twice, and
    /// checks the outputs equal bit for bit; returns the plan.
    fn same_in_tiles<T: Elem>(
        graph: &crate::model::Graph,
        weights: &Weights,
        cases: &[&[(&str, usize)]],
    ) -> crate::model::Plan {
        let plan = graph.plan(5, 32, 32).unwrap();
        let input = Tensor::new(
            plan.input_shape().to_vec(),
            (0..plan.input_shape().iter().product::<usize>())
                .map(|i| ((i * 7919) % 997) as f32 / 997.0 - 0.5)
                .collect(),
        );
        let mut session = two_workers::<T>(&plan, weights, &ExecOptions::default());
        session.split = None;
        session.run(&input).unwrap();
        let whole = session.read_output().unwrap();
        for &asked in cases {
            session.split = Some(batch_tiles::at(&plan, asked).unwrap());
            for _ in 0..2 {
                session.run(&input).unwrap();
                let tiled = session.read_output().unwrap();
                assert_eq!(tiled.shape, whole.shape);
                let same =
                    (tiled.data.iter().zip(&whole.data)).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} {} in tiles {asked:?}", graph.name, T::PRECISION);
            }
        }
        plan
    }

    /// A pointwise layer and the depthwise layer after it run as one where their middle tensor
    /// outgrows the workers' L2 (here set to 256 KB a core; it is 1.2 MB), the 1×1 layer that
    /// projects the depthwise output with them or with the depthwise layer alone, and the
    /// output is the layers' apart bit for bit, with batch tiles too: one image at a time up to
    /// the pair (fused in each tile, the projection after the cut), and a cut between the two
    /// (the pair not fused).
    #[test]
    fn fused_pairs_change_nothing() {
        let chain =
            "conv2d(4,16,1)+hardswish+conv2d(16,16,3,padding=1,groups=16)+relu+conv2d(16,8,1)";
        let graph = zoo::build(chain).unwrap();
        let weights = Weights::init(&graph, 3);
        let (graph, weights, _) = crate::model::passes::optimize(&graph, weights).unwrap();
        let plan = graph.plan(2, 96, 96).unwrap();
        let input = crate::model::Rng::new(5).normal_tensor(plan.input_shape().to_vec());
        let opt = ExecOptions {
            profile: true,
            ..ExecOptions::default()
        };
        let mut session = two_workers::<f32>(&plan, &weights, &opt);
        assert_eq!(
            session.paired[..3],
            [false, true, false],
            "the 1×1 layer, then the depthwise"
        );
        assert_eq!(
            session.projected[..4],
            [false, false, true, false],
            "the depthwise layer, then the 1×1 layer that projects it"
        );
        session.l2 = 256 << 10;
        let kernels = |s: &mut CpuSession<f32>| -> Vec<String> {
            s.times.iter().map(|t| t.kernel.clone()).collect()
        };
        let run = |s: &mut CpuSession<f32>| {
            s.run(&input).unwrap();
            s.read_output().unwrap()
        };
        let (paired, projected) = (session.paired.clone(), session.projected.clone());
        let none = vec![false; plan.graph.nodes.len()];
        let same = |a: &Tensor, b: &Tensor| {
            a.shape == b.shape
                && (a.data.iter().zip(&b.data)).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        session.paired = none.clone();
        session.projected = none.clone();
        let apart = run(&mut session);
        let runs = [
            (true, true, "conv2d_pointwise_depthwise_pointwise_f32"),
            (true, false, "conv2d_pointwise_depthwise_f32"),
            (false, true, "conv2d_depthwise_pointwise_f32"),
        ];
        let ran = kernels(&mut session);
        assert!(
            !runs.iter().any(|r| ran.contains(&r.2.to_string())),
            "{ran:?}"
        );
        for (pairs, projects, kernel) in runs {
            session.paired = if pairs { &paired } else { &none }.clone();
            session.projected = if projects { &projected } else { &none }.clone();
            let fused = run(&mut session);
            assert!(
                kernels(&mut session).contains(&kernel.to_string()),
                "{kernel}"
            );
            assert!(same(&fused, &apart), "{kernel} against the layers apart");
            // Timed on the depthwise layer, naming the others it ran (profiles credit them).
            let t = (session.times.iter().find(|t| t.kernel == kernel)).unwrap();
            let name = |id: usize| plan.graph.nodes[id].name.clone();
            assert_eq!(t.node, name(2));
            let others = [pairs.then(|| name(1)), projects.then(|| name(3))];
            assert_eq!(t.fused, others.into_iter().flatten().collect::<Vec<_>>());
        }
        session.paired = paired;
        session.projected = projected;
        let (pw, dw) = (
            plan.graph.nodes[1].name.clone(),
            plan.graph.nodes[2].name.clone(),
        );
        for (cut, fuses) in [(dw, true), (pw, false)] {
            session.split = Some(batch_tiles::at(&plan, &[(cut.as_str(), 1)]).unwrap());
            let tiled = run(&mut session);
            assert!(same(&tiled, &apart), "tiles of one image up to {cut}");
            let ran = kernels(&mut session);
            let n = ran
                .iter()
                .filter(|k| k.contains("pointwise_depthwise"))
                .count();
            assert_eq!(n, if fuses { 2 } else { 0 }, "cut after {cut}: {ran:?}");
        }
    }

    /// A session of 2 worker threads for `graph` at batch 2, `size`², in T's precision, and a
    /// random input for it.
    fn two_images<T: Elem>(
        graph: &crate::model::Graph,
        weights: &Weights,
        size: usize,
    ) -> (CpuSession<T>, Tensor) {
        let plan = graph.plan(2, size, size).unwrap();
        let input = crate::model::Rng::new(5).normal_tensor(plan.input_shape().to_vec());
        let opt = ExecOptions {
            precision: T::PRECISION,
            ..ExecOptions::default()
        };
        let session = two_workers::<T>(&plan, weights, &opt);
        (session, input)
    }

    /// `a` and `b` have one shape and the same bits in every value (`what` names the run).
    fn same_bits(a: &Tensor, b: &Tensor, what: &str) {
        assert_eq!(a.shape, b.shape, "{what}");
        for (i, (x, y)) in a.data.iter().zip(&b.data).enumerate() {
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "{what} output {i}: {x} against {y}"
            );
        }
    }

    /// A level that ends inside a fused run ends at the run's last node, unless that would
    /// reach the next level's end; levels ending outside every run stay.
    #[test]
    fn cuts_move_past_fused_runs() {
        use batch_tiles::{Level, Split};
        let split = |ends: &[(usize, usize)]| Split {
            levels: ends
                .iter()
                .map(|&(end, tile)| Level { end, tile })
                .collect(),
        };
        let runs = fused_runs(
            &[
                false, false, true, false, false, false, false, false, false, false,
            ],
            &[
                false, false, false, true, false, false, false, false, false, false,
            ],
            &[
                None,
                None,
                None,
                None,
                None,
                None,
                Some(8),
                None,
                None,
                None,
            ],
        );
        assert_eq!(runs, [(2, 4), (6, 8)]);
        // Ends at 3 (inside the pair and its projection) and 7 (inside the prologue's run).
        assert_eq!(
            past_runs(split(&[(3, 2), (7, 4)]), &runs),
            split(&[(4, 2), (8, 4)])
        );
        // The first run's end would reach the next level's: left; run ends and outsiders stay.
        assert_eq!(
            past_runs(split(&[(3, 2), (4, 4)]), &runs),
            split(&[(3, 2), (4, 4)])
        );
        assert_eq!(
            past_runs(split(&[(1, 2), (8, 4)]), &runs),
            split(&[(1, 2), (8, 4)])
        );
    }

    /// A batch norm and clamp run as a pointwise layer's prologue give what the three give
    /// apart, bit for bit: DenseNet-121 optimised (its dense layers' and transitions' BN →
    /// ReLU → 1×1, the 1×1 layers with their next batch norm folded and ReLU fused) at batch 2,
    /// 32², and eager layer chains whose 1×1 layers read 40 channels (rows padded on bf16
    /// pairs), through ReLU6 and through no clamp; FP32 and BF16, batch norms away from the
    /// identity (negative scales, shifts that ReLU clips).
    #[test]
    fn prologues_change_nothing() {
        fn check<T: Elem>(network: &str, optimise: bool, prologues: usize) {
            let graph = zoo::build(network).unwrap();
            let mut weights = Weights::init(&graph, 3);
            let mut rng = crate::model::Rng::new(9);
            for (name, t) in weights.iter_mut() {
                let batch_norm = name.contains("norm") || t.shape.len() == 1;
                for v in t.data.iter_mut().filter(|_| batch_norm) {
                    *v = if name.ends_with("running_var") {
                        0.5 + rng.uniform() as f32
                    } else {
                        rng.normal() as f32
                    };
                }
            }
            let (graph, weights) = if optimise {
                let (g, w, _) = crate::model::passes::optimize(&graph, weights).unwrap();
                (g, w)
            } else {
                (graph, weights)
            };
            let (mut session, input) = two_images::<T>(&graph, &weights, 32);
            let found = session.prologued.iter().flatten().count();
            assert_eq!(found, prologues, "{network}: prologues");
            let run = |s: &mut CpuSession<T>| {
                s.run(&input).unwrap();
                s.read_output().unwrap()
            };
            let fused = run(&mut session);
            session.prologued.fill(None);
            let plain = run(&mut session);
            same_bits(&fused, &plain, &format!("{network} {:?}", T::PRECISION));
        }
        let chains = [
            "conv2d(3,40,3,padding=1)+batchnorm2d(40)+relu+conv2d(40,24,1)",
            "conv2d(3,40,3,padding=1)+batchnorm2d(40)+relu6+conv2d(40,24,1)+relu",
            "conv2d(3,40,3,padding=1)+batchnorm2d(40)+conv2d(40,24,1)",
        ];
        // 58 dense layers and 3 transitions.
        check::<f32>("densenet121", true, 61);
        check::<half::bf16>("densenet121", true, 61);
        for chain in chains {
            check::<f32>(chain, false, 1);
            check::<half::bf16>(chain, false, 1);
        }
    }

    /// A squeezed depthwise layer's row sums give the global average pool that reads it bit
    /// for bit: MobileNetV3-Small (squeeze-and-excitation blocks after depthwise layers, run
    /// alone and in fused pairs) at batch 2, 64², FP32 and BF16, against the same session with
    /// nothing squeezed; every pool took the sums it was left.
    #[test]
    fn squeezes_change_nothing() {
        fn check<T: Elem>() {
            let graph = zoo::build("mobilenet_v3_small").unwrap();
            let weights = Weights::init(&graph, 3);
            let (graph, weights, _) = crate::model::passes::optimize(&graph, weights).unwrap();
            let (mut session, input) = two_images::<T>(&graph, &weights, 64);
            let squeezes = session.squeezed.iter().filter(|&&s| s).count();
            assert!(squeezes >= 5, "{squeezes} squeezed layers");
            // Small enough an L2 that the first pairs run fused.
            session.l2 = 32 << 10;
            let run = |s: &mut CpuSession<T>| {
                s.run(&input).unwrap();
                s.read_output().unwrap()
            };
            let squeezed = run(&mut session);
            assert!(
                session.row_sums.iter().all(Option::is_none),
                "sums left untaken"
            );
            session.squeezed.fill(false);
            let plain = run(&mut session);
            same_bits(&squeezed, &plain, &format!("{:?}", T::PRECISION));
        }
        check::<f32>();
        check::<half::bf16>();
    }

    /// ResNet-50's bottlenecks' residual layers (FP32 1×1, one K block, the residual read last)
    /// write their output over their residual where the probe says it pays, and the network's
    /// output is the same bit for bit as with every output apart, the batch whole and in tiles
    /// of one image; nothing does where it does not pay. BF16 on bf16 pairs alike.
    #[test]
    fn over_residuals_change_nothing() {
        let graph = zoo::build("resnet50").unwrap();
        let weights = Weights::init(&graph, 3);
        let (graph, weights, _) = crate::model::passes::optimize(&graph, weights).unwrap();
        let plan = graph.plan(2, 32, 32).unwrap();
        let input = crate::model::Rng::new(5).normal_tensor(plan.input_shape().to_vec());
        let opt = ExecOptions::default();
        let mut session = two_workers::<f32>(&plan, &weights, &opt);
        let over = over_residuals(&plan, &session.steps, || true);
        let names: Vec<&str> = (0..over.len())
            .filter(|&id| over[id])
            .map(|id| plan.graph.nodes[id].name.as_str())
            .collect();
        assert_eq!(names.len(), 16, "{names:?}");
        // The first block of each stage adds its last 1×1 layer's output in the projection
        // of its input that runs after it.
        let last = |n: &&str| n.ends_with(".conv3") || n.ends_with(".0.downsample.0");
        assert!(names.iter().all(last), "{names:?}");
        let none = vec![false; over.len()];
        assert_eq!(over_residuals(&plan, &session.steps, || false), none);
        let run = |s: &mut CpuSession<f32>| {
            s.run(&input).unwrap();
            s.read_output().unwrap()
        };
        session.over_residual = none.clone();
        let apart = run(&mut session);
        session.over_residual = over;
        for split in [
            None,
            Some(batch_tiles::at(&plan, &[("layer2.1.conv3", 1)]).unwrap()),
        ] {
            session.split = split;
            let written = run(&mut session);
            assert_eq!(written.shape, apart.shape);
            let same =
                (written.data.iter().zip(&apart.data)).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "tiles {:?}", session.split.is_some());
        }
        // BF16: where its layers multiply bf16 pairs (AMX, AVX512_BF16) the same 16 write over
        // their residual, bit for bit as apart; where they widen to the FP32 GEMM (bf16
        // storage, more than one K block's partial sums) none can, and the probe is not asked.
        let opt = ExecOptions {
            precision: crate::model::Precision::Bf16,
            ..ExecOptions::default()
        };
        let mut bf16 = two_workers::<half::bf16>(&plan, &weights, &opt);
        let pairs = crate::backend::cpu::bf16_gemm::Engine::in_use().is_some();
        let over = over_residuals(&plan, &bf16.steps, || {
            assert!(pairs, "asked the probe without bf16 pairs");
            true
        });
        let count = over.iter().filter(|&&o| o).count();
        assert_eq!(count, if pairs { 16 } else { 0 });
        let run = |s: &mut CpuSession<half::bf16>| {
            s.run(&input).unwrap();
            s.read_output().unwrap()
        };
        bf16.over_residual = vec![false; over.len()];
        let apart = run(&mut bf16);
        bf16.over_residual = over;
        let written = run(&mut bf16);
        let same = (written.data.iter().zip(&apart.data)).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "BF16 over its residuals");
    }

    /// A compiled ViT's MLPs write their second linear layer's output over the block's residual
    /// (the tokens, read last there) where the probe says it pays, FP32 and BF16 alike, bit for
    /// bit as with the output apart (the residual added in the same epilogue).
    #[test]
    fn linear_layers_over_their_residual_change_nothing() {
        fn check<T: Elem>(precision: crate::model::Precision) {
            let vit = zoo::VitConfig {
                image_size: 32,
                patch: 8,
                layers: 2,
                heads: 2,
                hidden: 64,
                mlp: 128,
                classes: 10,
            };
            let graph = zoo::vit_custom("vit", &vit);
            let mut weights = Weights::init(&graph, 3);
            // torchvision starts the head at zero: every weight random, so the output shows.
            let mut rng = crate::model::Rng::new(7);
            for (_, t) in weights.iter_mut() {
                t.data
                    .iter_mut()
                    .for_each(|v| *v = 0.2 * rng.normal() as f32);
            }
            let (graph, weights, _) = crate::model::passes::optimize(&graph, weights).unwrap();
            let plan = graph.plan(2, 32, 32).unwrap();
            let input = crate::model::Rng::new(5).normal_tensor(plan.input_shape().to_vec());
            let opt = ExecOptions {
                precision,
                ..ExecOptions::default()
            };
            let mut session = two_workers::<T>(&plan, &weights, &opt);
            let over = over_residuals(&plan, &session.steps, || true);
            let names: Vec<&str> = (0..over.len())
                .filter(|&id| over[id])
                .map(|id| plan.graph.nodes[id].name.as_str())
                .collect();
            // FP32 in one K block, or bf16 pairs; BF16 widened to the FP32 GEMM cannot.
            let can = T::IS_F32 || crate::backend::cpu::bf16_gemm::Engine::in_use().is_some();
            let want = if can { 2 } else { 0 };
            assert_eq!(names.len(), want, "{precision}: {names:?}");
            assert!(names.iter().all(|n| n.ends_with(".mlp.3")), "{names:?}");
            let mut run = |over: Vec<bool>| {
                session.over_residual = over;
                session.run(&input).unwrap();
                session.read_output().unwrap()
            };
            let apart = run(vec![false; over.len()]);
            let written = run(over);
            let same =
                (written.data.iter().zip(&apart.data)).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{precision} over its residuals");
        }
        check::<f32>(crate::model::Precision::Fp32);
        check::<half::bf16>(crate::model::Precision::Bf16);
    }

    /// Every schedule max-autotune may pick names its split, and runs it: ResNet-18 at batch 5,
    /// 32², with the splits planned for a 384 KB cache, each gives the whole batch's output bit
    /// for bit. A name that is not a split is refused with the reason.
    #[test]
    fn schedules_name_their_splits() {
        let graph = zoo::build("resnet18").unwrap();
        let weights = Weights::init(&graph, 3);
        let plan = graph.plan(5, 32, 32).unwrap();
        let input = crate::model::Rng::new(5).normal_tensor(plan.input_shape().to_vec());
        let found = batch_tiles::candidates(&plan, 4, 384 << 10);
        assert!(found.len() >= 3, "{found:?}");
        let opt = ExecOptions::default();
        let mut session = two_workers::<f32>(&plan, &weights, &opt);
        session.split = None;
        session.run(&input).unwrap();
        let whole = session.read_output().unwrap();
        for split in &found {
            let name = schedule_name(&plan, split.as_ref());
            session.split = batch_split(&plan, 4, Some(&name)).unwrap();
            assert_eq!(&session.split, split, "{name}");
            session.run(&input).unwrap();
            let out = session.read_output().unwrap();
            let same = (out.data.iter().zip(&whole.data)).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}");
        }
        let refused = |name: &str| batch_split(&plan, 4, Some(name)).unwrap_err().to_string();
        assert!(refused("layer9.relu:2").contains("no node `layer9.relu`"));
        assert!(refused("layer2.1.relu").contains("neither `off` nor NODE:IMAGES"));
    }
}

//! Graph passes of `--compile default`: fold every batch norm that follows a convolution into
//! the convolution's weights and bias, fuse a following activation ([`Act`]: ReLU, ReLU6,
//! SiLU, hardswish, GELU, sigmoid, hardsigmoid) and a residual add into a convolution's or
//! linear layer's epilogue (a residual add also into a self-attention's output projection),
//! fold a layer norm's weight and bias into the projection that reads it and a layer scale
//! (ConvNeXt's γ) into the linear layer before it, and drop eval-mode dropout. The result
//! computes the same function (up to rounding) with fewer kernels and fewer activation buffers.
//!
//! A rewrite only happens when nothing else reads the intermediate value; a residual add is
//! fused into the layer that runs after the add's other input is ready (in a ResNet block
//! with a downsample branch, that is the downsample convolution; in a ViT block, the
//! attention's output projection and the MLP's second linear layer). Not through a reshape
//! between them: ConvNeXt's and Swin's blocks add their residual to an image, and their last
//! linear layer writes tokens (the same bytes on the CPU, not in a GPU's NCHW).

use super::graph::{Graph, Node, ValueId};
use super::op::{Act, Conv2d, Op, WindowForm, batch_norm_affine};
use super::{Tensor, Weights};

/// What the passes did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PassReport {
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub folded_batch_norms: usize,
    /// Layer norms whose weight and bias went into the projection after them.
    #[serde(default)]
    pub folded_layer_norms: usize,
    /// Layer scales (ConvNeXt's γ) folded into the linear layer before them.
    #[serde(default)]
    pub folded_layer_scales: usize,
    pub fused_activations: usize,
    pub fused_adds: usize,
    pub dropped: usize,
}

fn is_depthwise(c: &Conv2d) -> bool {
    c.groups > 1 && c.groups == c.in_channels && c.groups == c.out_channels
}

/// The nodes while they are being rewritten: removed nodes forward to their replacement.
struct Work {
    nodes: Vec<Option<Node>>,
    alias: Vec<ValueId>,
    output: ValueId,
}

impl Work {
    fn resolve(&self, mut id: ValueId) -> ValueId {
        while self.nodes[id].is_none() {
            id = self.alias[id];
        }
        id
    }

    /// Readers of `id` (the graph's output counts as one).
    fn readers(&self, id: ValueId) -> usize {
        let reads: usize = self
            .nodes
            .iter()
            .flatten()
            .flat_map(|n| &n.inputs)
            .filter(|&&i| self.resolve(i) == id)
            .count();
        reads + usize::from(self.resolve(self.output) == id)
    }

    /// The convolution at `id` if a fusion may change it: exactly one node (the one being fused
    /// into it) reads its value.
    fn fusable_conv(&self, id: ValueId) -> Option<Conv2d> {
        match self.nodes[id].as_ref()?.op {
            Op::Conv2d(c) if self.readers(id) == 1 => Some(c),
            _ => None,
        }
    }

    /// The convolution or linear layer at `id` (as a convolution) if a fusion may change it.
    fn fusable_gemm(&self, id: ValueId) -> Option<Conv2d> {
        match &self.nodes[id].as_ref()?.op {
            op @ (Op::Conv2d(_) | Op::Linear { .. }) if self.readers(id) == 1 => op.as_conv(),
            _ => None,
        }
    }

    fn remove(&mut self, id: ValueId, to: ValueId) {
        self.nodes[id] = None;
        self.alias[id] = to;
    }

    /// The one node that reads `id` (the graph's output is not a node).
    fn sole_reader(&self, id: ValueId) -> Option<ValueId> {
        if self.readers(id) != 1 {
            return None;
        }
        let reads = |n: &Node| n.inputs.iter().any(|&i| self.resolve(i) == id);
        (0..self.nodes.len()).find(|&k| self.nodes[k].as_ref().is_some_and(reads))
    }

    /// The projection that alone reads the layer norm at `id` (over `dim` features, through a
    /// reshape to tokens): its node's name and the suffixes of its (out × dim) weight and its
    /// bias. Folding is exact there: every input row of the projection is a normalised row.
    /// Not Swin's window attention: it pads windows with zeros after the norm, and a folded
    /// shift would reach the padding.
    fn projection_after(&self, id: ValueId, dim: usize) -> Option<(String, [&'static str; 2])> {
        let mut reader = self.sole_reader(id)?;
        if matches!(self.nodes[reader].as_ref()?.op, Op::Tokens) {
            reader = self.sole_reader(reader)?;
        }
        let node = self.nodes[reader].as_ref()?;
        let suffixes = match &node.op {
            Op::Linear { in_features, .. } if *in_features == dim => ["weight", "bias"],
            Op::Attention { .. } => ["in_proj_weight", "in_proj_bias"],
            Op::WindowAttention(a)
                if matches!(a.form, WindowForm::MaxVitWindow | WindowForm::MaxVitGrid) =>
            {
                let [weight, bias, ..] = a.form.projections();
                [weight, bias]
            }
            _ => return None,
        };
        Some((node.name.clone(), suffixes))
    }

    /// The linear layer that alone computes the value at `id` (through a reshape from tokens
    /// to an image that only it reads), with `channels` outputs and no activation: its name
    /// and whether it has a bias. A per-channel scale after it is exact in its weights.
    fn linear_before(&self, id: ValueId, channels: usize) -> Option<(String, bool)> {
        let mut id = id;
        if matches!(self.nodes[id].as_ref()?.op, Op::Image) {
            if self.readers(id) != 1 {
                return None;
            }
            id = self.resolve(self.nodes[id].as_ref()?.inputs[0]);
        }
        let node = self.nodes[id].as_ref()?;
        match node.op {
            Op::Linear {
                out_features,
                bias,
                act: Act::None,
                ..
            } if out_features == channels && self.readers(id) == 1 => {
                Some((node.name.clone(), bias))
            }
            _ => None,
        }
    }

    /// The linear layer `name` now has a bias (a folded layer norm's shift).
    fn set_linear_bias(&mut self, name: &str) {
        for n in self.nodes.iter_mut().flatten() {
            if n.name == name
                && let Op::Linear { bias, .. } = &mut n.op
            {
                *bias = true;
            }
        }
    }

    /// Fuse `act` into the convolution or linear layer at `id`.
    fn set_act(&mut self, id: ValueId, to: Act) {
        if let Some(n) = self.nodes[id].as_mut() {
            match &mut n.op {
                Op::Conv2d(c) => c.act = to,
                Op::Linear { act, .. } => *act = to,
                _ => unreachable!("only convolutions and linear layers take an activation"),
            }
        }
    }

    /// Whether a residual add may fuse into the layer at `id`, which only the add reads: a
    /// convolution (not a depthwise one) or linear layer with neither a residual nor an
    /// activation yet, or a self-attention (into its output projection).
    fn takes_residual(&self, id: ValueId) -> bool {
        if let Some(c) = self.fusable_gemm(id) {
            return !c.residual && c.act == Act::None && !is_depthwise(&c);
        }
        let op = self.nodes[id].as_ref().map(|n| &n.op);
        matches!(
            op,
            Some(Op::Attention {
                residual: false,
                ..
            })
        ) && self.readers(id) == 1
    }

    /// Fuse the residual add of `res` into the layer at `id` ([`Self::takes_residual`]).
    fn set_residual(&mut self, id: ValueId, res: ValueId) {
        if let Some(n) = self.nodes[id].as_mut() {
            match &mut n.op {
                Op::Conv2d(c) => c.residual = true,
                Op::Linear { residual, .. } | Op::Attention { residual, .. } => *residual = true,
                _ => unreachable!("only convolutions, linear layers and attention take a residual"),
            }
            n.inputs.push(res);
        }
    }

    fn set_conv(&mut self, id: ValueId, c: Conv2d) {
        if let Some(n) = self.nodes[id].as_mut() {
            n.op = Op::Conv2d(c);
        }
    }
}

/// Apply the default passes to `graph` and its `weights`, rewriting the tensors they fold in
/// place: a caller that needs the eager weights afterwards passes a clone (a copy made here
/// for every caller held two sets of f32 weights at once, ViT-B/16's 330 MiB twice).
pub fn optimize(graph: &Graph, weights: Weights) -> Result<(Graph, Weights, PassReport), String> {
    let mut w = weights;
    let mut work = Work {
        nodes: graph.nodes.iter().cloned().map(Some).collect(),
        alias: (0..graph.nodes.len()).collect(),
        output: graph.output,
    };
    let mut report = PassReport {
        nodes_before: graph.nodes.len(),
        ..PassReport::default()
    };
    let tensor = |w: &Weights, name: String| -> Result<Tensor, String> {
        w.get(&name)
            .cloned()
            .ok_or_else(|| format!("the weights have no tensor `{name}`"))
    };
    for id in 0..graph.nodes.len() {
        let Some(node) = work.nodes[id].clone() else {
            continue;
        };
        let inputs: Vec<ValueId> = node.inputs.iter().map(|&i| work.resolve(i)).collect();
        match node.op {
            Op::BatchNorm { eps, .. } => {
                let src = inputs[0];
                let Some(mut c) = work.fusable_conv(src) else {
                    continue;
                };
                if c.residual || c.act != Act::None {
                    continue;
                }
                let conv = work.nodes[src]
                    .as_ref()
                    .map(|n| n.name.clone())
                    .unwrap_or_default();
                let get = |s: &str| tensor(&w, format!("{}.{s}", node.name));
                let (scale, shift) = batch_norm_affine(
                    &get("weight")?.data,
                    &get("bias")?.data,
                    &get("running_mean")?.data,
                    &get("running_var")?.data,
                    eps,
                );
                let mut weight = tensor(&w, format!("{conv}.weight"))?;
                scale_rows(&mut weight.data, &scale);
                let bias: Vec<f32> = match c.bias {
                    true => tensor(&w, format!("{conv}.bias"))?.data,
                    false => vec![0.0; c.out_channels],
                };
                let bias: Vec<f32> = bias
                    .iter()
                    .zip(scale.iter().zip(&shift))
                    .map(|(b, (s, t))| b * s + t)
                    .collect();
                w.insert(format!("{conv}.weight"), weight);
                w.insert(
                    format!("{conv}.bias"),
                    Tensor::new(vec![c.out_channels], bias),
                );
                for suffix in [
                    "weight",
                    "bias",
                    "running_mean",
                    "running_var",
                    "num_batches_tracked",
                ] {
                    w.remove(&format!("{}.{suffix}", node.name));
                }
                c.bias = true;
                work.set_conv(src, c);
                work.remove(id, src);
                report.folded_batch_norms += 1;
            }
            ref op if Act::of(op).is_some() => {
                let src = inputs[0];
                let Some(gemm) = work.fusable_gemm(src) else {
                    continue;
                };
                // Every backend's depthwise kernel applies the activation itself.
                if gemm.act != Act::None {
                    continue;
                }
                work.set_act(src, Act::of(op).expect("matched above"));
                work.remove(id, src);
                report.fused_activations += 1;
            }
            Op::Add => {
                for (k, other) in [(0, 1), (1, 0)] {
                    let (src, res) = (inputs[k], inputs[other]);
                    // The other input must be ready before the layer runs.
                    if res >= src || !work.takes_residual(src) {
                        continue;
                    }
                    work.set_residual(src, res);
                    work.remove(id, src);
                    report.fused_adds += 1;
                    break;
                }
            }
            Op::LayerScale { channels } => {
                let Some((linear, has_bias)) = work.linear_before(inputs[0], channels) else {
                    continue;
                };
                // γ ⊙ (W·x + b) = (diag γ · W)·x + γ ⊙ b.
                let gamma = tensor(&w, node.name.clone())?.data;
                let mut wt = tensor(&w, format!("{linear}.weight"))?;
                scale_rows(&mut wt.data, &gamma);
                w.insert(format!("{linear}.weight"), wt);
                if has_bias {
                    let mut b = tensor(&w, format!("{linear}.bias"))?;
                    b.data.iter_mut().zip(&gamma).for_each(|(v, g)| *v *= g);
                    w.insert(format!("{linear}.bias"), b);
                }
                w.remove(&node.name);
                work.remove(id, inputs[0]);
                report.folded_layer_scales += 1;
            }
            Op::Dropout { .. } => {
                work.remove(id, inputs[0]);
                report.dropped += 1;
            }
            Op::LayerNorm {
                dim,
                eps,
                affine: true,
            } => {
                let Some((reader, [weight, bias])) = work.projection_after(id, dim) else {
                    continue;
                };
                let get = |s: &str| tensor(&w, format!("{}.{s}", node.name));
                let (gamma, beta) = (get("weight")?.data, get("bias")?.data);
                let mut wt = tensor(&w, format!("{reader}.{weight}"))?;
                let bias_name = format!("{reader}.{bias}");
                let rows = wt.data.len() / dim;
                let mut b = match w.get(&bias_name) {
                    Some(t) => t.data.clone(),
                    None => vec![0.0; rows],
                };
                // W·(γ⊙x̂ + β) + b = (W·diag γ)·x̂ + (W·β + b).
                for (row, b) in wt.data.chunks_mut(dim).zip(&mut b) {
                    let shift: f64 = row
                        .iter()
                        .zip(&beta)
                        .map(|(&v, &t)| v as f64 * t as f64)
                        .sum();
                    *b = (*b as f64 + shift) as f32;
                    row.iter_mut().zip(&gamma).for_each(|(v, g)| *v *= g);
                }
                w.insert(format!("{reader}.{weight}"), wt);
                w.insert(bias_name, Tensor::new(vec![rows], b));
                for suffix in ["weight", "bias"] {
                    w.remove(&format!("{}.{suffix}", node.name));
                }
                work.set_linear_bias(&reader);
                if let Some(n) = work.nodes[id].as_mut() {
                    n.op = Op::LayerNorm {
                        dim,
                        eps,
                        affine: false,
                    };
                }
                report.folded_layer_norms += 1;
            }
            _ => {}
        }
    }
    // Renumber the nodes that are left.
    let mut new_id = vec![usize::MAX; graph.nodes.len()];
    let mut nodes = Vec::new();
    for (id, n) in work.nodes.iter().enumerate() {
        if let Some(n) = n {
            new_id[id] = nodes.len();
            nodes.push(Node {
                name: n.name.clone(),
                op: n.op.clone(),
                inputs: n.inputs.iter().map(|&i| new_id[work.resolve(i)]).collect(),
            });
        }
    }
    report.nodes_after = nodes.len();
    let out = Graph {
        name: graph.name.clone(),
        nodes,
        output: new_id[work.resolve(graph.output)],
        conv_init: graph.conv_init,
        linear_init: graph.linear_init,
        input_size: graph.input_size,
        training_only: graph.training_only.clone(),
    };
    Ok((out, w, report))
}

/// Row i of `data` (one of `scale.len()` equal rows: an output channel's weights) times
/// `scale[i]`: folding a per-channel affine into the layer before it.
fn scale_rows(data: &mut [f32], scale: &[f32]) {
    let per_row = data.len() / scale.len().max(1);
    for (row, s) in data.chunks_mut(per_row.max(1)).zip(scale) {
        row.iter_mut().for_each(|v| *v *= s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Rng, reference, zoo};

    /// The optimised network computes what the original does, with the expected fusions.
    #[test]
    fn resnet_and_mobilenet_keep_their_function() {
        for (name, size) in [("resnet18", 64), ("resnet50", 64), ("mobilenet_v2", 64)] {
            let graph = zoo::build(name).unwrap();
            let mut weights = Weights::init(&graph, 1);
            // Batch-norm statistics away from the identity, so folding is really exercised.
            let mut rng = Rng::new(5);
            for (k, t) in weights.iter_mut() {
                if k.ends_with("running_var") {
                    t.data
                        .iter_mut()
                        .for_each(|v| *v = 0.5 + rng.uniform() as f32);
                } else if k.ends_with("running_mean") {
                    t.data
                        .iter_mut()
                        .for_each(|v| *v = 0.1 * rng.normal() as f32);
                }
            }
            let (opt, w2, rep) = optimize(&graph, weights.clone()).unwrap();
            let bns = graph
                .nodes
                .iter()
                .filter(|n| matches!(n.op, Op::BatchNorm { .. }))
                .count();
            assert_eq!(
                rep.folded_batch_norms, bns,
                "{name}: every BN follows a conv"
            );
            let bn_params: u64 = graph
                .nodes
                .iter()
                .map(|n| match n.op {
                    Op::BatchNorm { channels, .. } => 2 * channels as u64,
                    _ => 0,
                })
                .sum();
            assert_eq!(
                graph.param_count() + count_new_biases(&graph),
                opt.param_count() + bn_params,
                "{name}: BN parameters become conv biases"
            );
            if name.starts_with("resnet") {
                let adds = graph
                    .nodes
                    .iter()
                    .filter(|n| matches!(n.op, Op::Add))
                    .count();
                assert_eq!(rep.fused_adds, adds, "{name}: every residual add fuses");
            }
            assert_same_function(name, (&graph, &weights), (&opt, &w2), size);
        }
    }

    /// The transformers and the squeeze-and-excitation networks: GELU after linear layers and
    /// the gates after their 1×1 convolutions fuse, ViT's residual adds into its attention's
    /// output projections and its MLPs' second linear layers, layer norms fold into the projection after
    /// them (never into Swin's padded windows), every layer scale into the linear layer before
    /// it (ConvNeXt's), and the function stays the same with non-trivial layer-norm weights
    /// and layer scales.
    #[test]
    fn transformers_keep_their_function() {
        use zoo::{MaxVitConfig, VitConfig};
        let vit = VitConfig::small();
        let maxvit = MaxVitConfig::small();
        // (network, input side, layer norms folded, activations fused, residual adds fused
        // into linear layers and attention: ViT's; the others add theirs to an image, after a
        // reshape)
        let cases = [
            (zoo::vit_custom("vit", &vit), 32, 4, 2, 4),
            (
                zoo::convnext_custom("cn", [8, 16, 16, 32], [1, 1, 1, 1], 10),
                64,
                4,
                4,
                0,
            ),
            // Window 3 pads the 16×16 and 8×8 stages: only the MLPs' norms and the patch
            // mergings' fold.
            (
                zoo::swin_custom("swin", (8, [1, 1, 1, 1], [1, 1, 1, 1]), (3, false), 10),
                64,
                7,
                4,
                0,
            ),
            (zoo::maxvit_custom("maxvit", &maxvit, 10), 96, 21, 20, 0),
            (
                zoo::mobilenet_v3_custom("mnv3", false, 0.5, 10),
                64,
                0,
                0,
                0,
            ),
        ];
        for (graph, size, norms, min_acts, block_adds) in cases {
            let name = graph.name.clone();
            let mut weights = Weights::init(&graph, 1);
            let mut rng = Rng::new(5);
            for n in &graph.nodes {
                // Layer scales away from their 1e-6 start and linear biases away from 0, so
                // folding them is exercised.
                if let Op::Linear { bias: true, .. } = n.op {
                    let t = weights.get_mut(&format!("{}.bias", n.name)).unwrap();
                    t.data.iter_mut().for_each(|v| *v = rng.normal() as f32);
                }
                if matches!(n.op, Op::LayerScale { .. }) {
                    let t = weights.get_mut(&n.name).unwrap();
                    t.data
                        .iter_mut()
                        .for_each(|v| *v = 0.5 + rng.uniform() as f32);
                }
                if matches!(n.op, Op::LayerNorm { .. }) {
                    for (suffix, mean) in [("weight", 1.0), ("bias", 0.0)] {
                        let t = weights.get_mut(&format!("{}.{suffix}", n.name)).unwrap();
                        t.data
                            .iter_mut()
                            .for_each(|v| *v = mean + 0.5 * rng.normal() as f32);
                    }
                }
            }
            let (opt, w2, rep) = optimize(&graph, weights.clone()).unwrap();
            assert_eq!(rep.folded_layer_norms, norms, "{name}: {rep:?}");
            let scales = (graph.nodes.iter())
                .filter(|n| matches!(n.op, Op::LayerScale { .. }))
                .count();
            assert_eq!(rep.folded_layer_scales, scales, "{name}: {rep:?}");
            assert!(rep.fused_activations >= min_acts, "{name}: {rep:?}");
            let token_adds = (opt.nodes.iter())
                .filter(|n| {
                    matches!(
                        n.op,
                        Op::Linear { residual: true, .. } | Op::Attention { residual: true, .. }
                    )
                })
                .count();
            assert_eq!(token_adds, block_adds, "{name}: {rep:?}");
            assert_same_function(&name, (&graph, &weights), (&opt, &w2), size);
        }
    }

    /// The two networks give the same output (within 1e-4 of its largest value) on one
    /// random `size`² image, in the f64 reference.
    fn assert_same_function(name: &str, a: (&Graph, &Weights), b: (&Graph, &Weights), size: usize) {
        let x = Rng::new(9).normal_tensor(vec![1, 3, size, size]);
        let run =
            |(g, w): (&Graph, &Weights)| reference::forward(&g.plan(1, size, size).unwrap(), w, &x);
        let (a, b) = (run(a), run(b));
        let scale = a.data.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = (a.data.iter().zip(&b.data)).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(diff <= 1e-4 * scale, "{name}: {diff} vs {scale}");
    }

    /// Biases the folding adds to convolutions that had none (every conv before a BN).
    fn count_new_biases(graph: &Graph) -> u64 {
        graph
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::BatchNorm { .. }))
            .map(|n| match &graph.nodes[n.inputs[0]].op {
                Op::Conv2d(c) if !c.bias => c.out_channels as u64,
                _ => 0,
            })
            .sum()
    }
}

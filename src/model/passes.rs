//! Graph passes of `--compile default`: fold every batch norm that follows a convolution into
//! the convolution's weights and bias, fuse a following activation ([`Act`]: ReLU, ReLU6,
//! SiLU, hardswish, GELU, sigmoid, hardsigmoid) into a convolution's or linear layer's epilogue
//! and a residual add into a convolution's, and drop eval-mode dropout. The result computes the same function
//! (up to rounding) with fewer kernels and fewer activation buffers.
//!
//! A rewrite only happens when nothing else reads the intermediate value; a residual add is
//! fused into the convolution that runs after the add's other input is ready (in a ResNet
//! block with a downsample branch, that is the downsample convolution).

use super::graph::{Graph, Node, ValueId};
use super::op::{Act, Conv2d, Op, batch_norm_affine};
use super::{Tensor, Weights};

/// What the passes did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PassReport {
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub folded_batch_norms: usize,
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

    fn set_conv(&mut self, id: ValueId, c: Conv2d) {
        if let Some(n) = self.nodes[id].as_mut() {
            n.op = Op::Conv2d(c);
        }
    }
}

/// Apply the default passes to `graph` and its `weights`.
pub fn optimize(graph: &Graph, weights: &Weights) -> Result<(Graph, Weights, PassReport), String> {
    let mut w = weights.clone();
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
                let per_out = weight.data.len() / c.out_channels;
                for (co, chunk) in weight.data.chunks_mut(per_out).enumerate() {
                    chunk.iter_mut().for_each(|v| *v *= scale[co]);
                }
                let bias: Vec<f32> = match c.bias {
                    true => tensor(&w, format!("{conv}.bias"))?.data,
                    false => vec![0.0; c.out_channels],
                };
                let bias: Vec<f32> = bias
                    .iter()
                    .zip(scale.iter().zip(&shift))
                    .map(|(b, (s, t))| b * s + t)
                    .collect();
                w.tensors.insert(format!("{conv}.weight"), weight);
                w.tensors.insert(
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
                    w.tensors.remove(&format!("{}.{suffix}", node.name));
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
                    let Some(mut c) = work.fusable_conv(src) else {
                        continue;
                    };
                    // The other input must be ready before the convolution runs.
                    if c.residual || c.act != Act::None || is_depthwise(&c) || res >= src {
                        continue;
                    }
                    c.residual = true;
                    work.set_conv(src, c);
                    if let Some(n) = work.nodes[src].as_mut() {
                        n.inputs.push(res);
                    }
                    work.remove(id, src);
                    report.fused_adds += 1;
                    break;
                }
            }
            Op::Dropout { .. } => {
                work.remove(id, inputs[0]);
                report.dropped += 1;
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
            for (k, t) in weights.tensors.iter_mut() {
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
            let (opt, w2, rep) = optimize(&graph, &weights).unwrap();
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
            let x = Rng::new(9).normal_tensor(vec![1, 3, size, size]);
            let a = reference::forward(&graph.plan(1, size, size).unwrap(), &weights, &x);
            let b = reference::forward(&opt.plan(1, size, size).unwrap(), &w2, &x);
            let scale = a.data.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = a
                .data
                .iter()
                .zip(&b.data)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(diff <= 1e-4 * scale, "{name}: {diff} vs {scale}");
        }
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

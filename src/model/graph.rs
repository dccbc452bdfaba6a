//! The graph IR: nodes in topological order, each naming the torchvision module it mirrors, and
//! the [`Plan`] that fixes a graph to one input shape (every tensor's shape, its last use, and
//! the work and memory the whole forward pass takes).

use super::op::{Conv2d, Op, ParamKind, ParamSpec, Pool, ShapeError};
use crate::model::Precision;

/// Index of a node, which is also the id of the value it produces.
pub type ValueId = usize;

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The module path in torchvision's naming (`layer1.0.conv1`); parameters live at
    /// `{name}.{suffix}`. Parameter-free ops may share a name with their siblings' module.
    pub name: String,
    pub op: Op,
    pub inputs: Vec<ValueId>,
}

impl Node {
    /// The inputs, each once: a value read twice (a fused `conv(x) + x` reads `x` as input
    /// and as residual) is released once after its last reader.
    pub fn distinct_inputs(&self) -> impl Iterator<Item = ValueId> + '_ {
        (self.inputs.iter().enumerate())
            .filter(|&(k, i)| !self.inputs[..k].contains(i))
            .map(|(_, &i)| i)
    }
}

/// How a family of models initialises its layers (torchvision differs per architecture).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvInit {
    /// `kaiming_normal_(mode="fan_out", nonlinearity="relu")`, bias 0 (ResNet, VGG, MobileNet).
    KaimingNormalFanOut,
    /// PyTorch's default `reset_parameters`: kaiming_uniform(a=√5) and a uniform bias (AlexNet).
    TorchDefault,
    /// `trunc_normal_(std=√(1/fan_in))`, bias 0 (ViT's patch convolution; the truncation at ±2
    /// is far beyond such a small deviation).
    TruncNormalFanIn,
    /// `trunc_normal_(std=0.02)`, bias 0 (ConvNeXt, convolutions and linear layers alike).
    TruncNormal002,
    /// `trunc_normal_(std=0.01)` (GoogLeNet).
    TruncNormal001,
    /// `trunc_normal_(std=0.1)`, the auxiliary classifier's `conv1` 0.01 (Inception v3).
    TruncNormal01,
    /// `kaiming_normal_()` (fan in, ReLU's gain), bias 0 (DenseNet).
    KaimingNormalFanIn,
    /// `kaiming_uniform_()` (fan in, ReLU's gain), bias 0; the final `classifier.1` N(0, 0.01)
    /// (SqueezeNet).
    KaimingUniform,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearInit {
    /// `normal_(0, 0.01)`, bias 0 (VGG, MobileNet).
    Normal001,
    /// PyTorch's default: uniform(±1/√fan_in) for weight and bias (ResNet, AlexNet).
    TorchDefault,
    /// torchvision's VisionTransformer: xavier_uniform weights and N(0, 1e-6) biases in the
    /// MLPs, zeros for `heads.head`.
    Vit,
    /// uniform(±1/√fan_out) weights, zero biases (EfficientNet).
    UniformFanOut,
    /// `trunc_normal_(std=0.02)`, bias 0 (ConvNeXt).
    TruncNormal002,
    /// `trunc_normal_(std=0.01)`, PyTorch's default bias (GoogLeNet).
    TruncNormal001,
    /// `trunc_normal_(std=0.1)`, the auxiliary classifier's 0.001, PyTorch's default bias
    /// (Inception v3).
    TruncNormal01,
}

/// The state_dict name of a node's parameter: `node.suffix`, or the node's name alone for an
/// op whose parameter is a module's own tensor (ViT's `class_token`: suffix "").
pub fn param_name(node: &str, suffix: &str) -> String {
    if suffix.is_empty() {
        node.to_string()
    } else {
        format!("{node}.{suffix}")
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub output: ValueId,
    pub conv_init: ConvInit,
    pub linear_init: LinearInit,
    /// The image side the network is made for (torchvision's default: 224 for most; a ViT's
    /// position embedding fits only its own).
    pub input_size: usize,
    /// Modules in the state_dict that inference never runs (GoogLeNet's and Inception v3's
    /// auxiliary classifiers): nodes without inputs, kept for their parameters, which count
    /// as torchvision counts them but are never uploaded and may be absent from a file.
    pub training_only: Vec<Node>,
}

/// One state_dict entry of a graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedParam {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
    /// False for a training-only module's (see [`Graph::training_only`]).
    pub used: bool,
}

impl Graph {
    pub fn default_input_size(&self) -> usize {
        self.input_size
    }

    pub fn input_channels(&self) -> usize {
        match self.nodes.first().map(|n| &n.op) {
            Some(Op::Input { channels }) => *channels,
            _ => 0,
        }
    }

    /// Every state_dict tensor (parameters and running buffers), in graph order.
    pub fn params(&self) -> Vec<NamedParam> {
        let mut out = Vec::new();
        let used = self.nodes.iter().map(|n| (n, true));
        for (node, used) in used.chain(self.training_only.iter().map(|n| (n, false))) {
            for ParamSpec {
                suffix,
                shape,
                kind,
            } in node.op.params()
            {
                out.push(NamedParam {
                    name: param_name(&node.name, suffix),
                    shape,
                    kind,
                    used,
                });
            }
        }
        out
    }

    /// Learned parameters, as `sum(p.numel() for p in model.parameters())` counts them.
    pub fn param_count(&self) -> u64 {
        self.params()
            .iter()
            .filter(|p| p.kind == ParamKind::Trainable)
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum()
    }

    /// Fix the graph to an input of shape (batch, C, height, width).
    pub fn plan(&self, batch: usize, height: usize, width: usize) -> Result<Plan, ShapeError> {
        let mut shapes: Vec<Vec<usize>> = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            let shape = match node.op {
                Op::Input { channels } => vec![batch, channels, height, width],
                ref op => {
                    let ins: Vec<&[usize]> =
                        node.inputs.iter().map(|&i| shapes[i].as_slice()).collect();
                    op.infer_shape(&ins).map_err(|e| {
                        ShapeError(format!("{} (`{}`): {}", self.name, node.name, e.0))
                    })?
                }
            };
            shapes.push(shape);
        }
        // A value dies after the last node that reads it; the output lives to the end.
        let mut last_use: Vec<usize> = (0..self.nodes.len()).collect();
        for (id, node) in self.nodes.iter().enumerate() {
            for &i in &node.inputs {
                last_use[i] = last_use[i].max(id);
            }
        }
        last_use[self.output] = usize::MAX;
        Ok(Plan {
            graph: self.clone(),
            shapes,
            last_use,
        })
    }
}

/// A graph fixed to one input shape: what backends prepare and what the counters read.
#[derive(Debug, Clone)]
pub struct Plan {
    pub graph: Graph,
    /// Logical (NCHW) shape of every node's output.
    pub shapes: Vec<Vec<usize>>,
    /// Index of the last node reading each value (`usize::MAX` for the graph output).
    pub last_use: Vec<usize>,
}

/// What a planned forward pass needs in memory, before anything is allocated. Backends add
/// their own scratch (im2col columns, widened weights) on top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    pub weights: u64,
    /// The most activation bytes alive at once, freeing each tensor after its last use.
    pub activations: u64,
    /// Activation bytes per image of the batch at that peak, to suggest a batch that fits.
    pub activations_per_image: u64,
}

impl Plan {
    pub fn batch(&self) -> usize {
        self.shapes[0][0]
    }

    pub fn input_shape(&self) -> &[usize] {
        &self.shapes[0]
    }

    pub fn output_shape(&self) -> &[usize] {
        &self.shapes[self.graph.output]
    }

    fn input_shapes(&self, id: ValueId) -> Vec<&[usize]> {
        self.graph.nodes[id]
            .inputs
            .iter()
            .map(|&i| self.shapes[i].as_slice())
            .collect()
    }

    /// Conv + linear MACs of the whole batch.
    pub fn macs(&self) -> u64 {
        self.graph
            .nodes
            .iter()
            .enumerate()
            .map(|(id, n)| n.op.macs(&self.shapes[id]))
            .sum()
    }

    pub fn flops(&self) -> u64 {
        (0..self.graph.nodes.len())
            .map(|id| self.node_flops(id))
            .sum()
    }

    pub fn node_flops(&self, id: ValueId) -> u64 {
        self.graph.nodes[id]
            .op
            .flops(&self.input_shapes(id), &self.shapes[id])
    }

    pub fn node_bytes(&self, id: ValueId, precision: Precision) -> u64 {
        self.graph.nodes[id]
            .op
            .bytes(&self.input_shapes(id), &self.shapes[id], precision.bytes())
    }

    /// Node `node`'s channel copies when it only moves channels (see [`Op::channel_copies`]).
    pub fn channel_copies(&self, node: &Node) -> Option<Vec<super::op::ChannelCopy>> {
        let channels: Vec<usize> = node.inputs.iter().map(|&i| self.shapes[i][1]).collect();
        node.op.channel_copies(&channels)
    }

    /// The activation bytes live while each node runs, at `elem` bytes a value: its output and
    /// every earlier value a later node (or the output) still reads, its inputs included, and
    /// an attention layer's intermediates (q/k/v and the heads: four times its output, which
    /// then reuses the q/k/v buffer).
    pub fn live_bytes(&self, elem: u64) -> Vec<u64> {
        // Saturating: a plan far beyond any machine must read as "too big", never wrap to small.
        let bytes =
            |id: usize| (self.shapes[id].iter()).fold(elem, |n, &d| n.saturating_mul(d as u64));
        let mut live: u64 = 0;
        (self.graph.nodes.iter().enumerate())
            .map(|(id, node)| {
                live = live.saturating_add(bytes(id));
                let scratch = match node.op {
                    Op::Attention { .. } | Op::WindowAttention(_) => 3,
                    _ => 0,
                };
                let during = live.saturating_add(bytes(id).saturating_mul(scratch));
                for i in node.distinct_inputs() {
                    if self.last_use[i] == id {
                        live = live.saturating_sub(bytes(i));
                    }
                }
                during
            })
            .collect()
    }

    /// Memory for weights and live activations at `precision`: the planning figure used to
    /// refuse a batch that cannot fit before allocating it.
    pub fn memory_estimate(&self, precision: Precision) -> MemoryEstimate {
        let eb = precision.bytes() as u64;
        let numel = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
        let weights: u64 = self
            .graph
            .params()
            .iter()
            .filter(|p| p.used)
            .map(|p| numel(&p.shape))
            .sum::<u64>()
            * eb;
        let peak = self.live_bytes(eb).into_iter().max().unwrap_or(0);
        let batch = self.batch().max(1) as u64;
        MemoryEstimate {
            weights,
            activations: peak,
            activations_per_image: peak.div_ceil(batch),
        }
    }
}

/// Builds a graph node by node; the zoo's architecture code reads like torchvision's.
pub struct GraphBuilder {
    graph: Graph,
}

impl GraphBuilder {
    pub fn new(
        name: &str,
        input_channels: usize,
        conv_init: ConvInit,
        linear_init: LinearInit,
    ) -> Self {
        let input = Node {
            name: "input".into(),
            op: Op::Input {
                channels: input_channels,
            },
            inputs: vec![],
        };
        GraphBuilder {
            graph: Graph {
                name: name.into(),
                nodes: vec![input],
                output: 0,
                conv_init,
                linear_init,
                input_size: 224,
                training_only: Vec::new(),
            },
        }
    }

    /// Set the image side the network is made for (224 unless said).
    pub fn input_size(&mut self, side: usize) {
        self.graph.input_size = side;
    }

    pub fn input(&self) -> ValueId {
        0
    }

    pub fn add_node(&mut self, name: impl Into<String>, op: Op, inputs: &[ValueId]) -> ValueId {
        self.graph.nodes.push(Node {
            name: name.into(),
            op,
            inputs: inputs.to_vec(),
        });
        self.graph.nodes.len() - 1
    }

    pub fn conv(&mut self, name: impl Into<String>, x: ValueId, conv: Conv2d) -> ValueId {
        self.add_node(name, Op::Conv2d(conv), &[x])
    }

    pub fn bn(&mut self, name: impl Into<String>, x: ValueId, channels: usize) -> ValueId {
        self.add_node(
            name,
            Op::BatchNorm {
                channels,
                eps: 1e-5,
            },
            &[x],
        )
    }

    pub fn relu(&mut self, name: impl Into<String>, x: ValueId) -> ValueId {
        self.add_node(name, Op::Relu, &[x])
    }

    pub fn relu6(&mut self, name: impl Into<String>, x: ValueId) -> ValueId {
        self.add_node(name, Op::Relu6, &[x])
    }

    pub fn sigmoid(&mut self, name: impl Into<String>, x: ValueId) -> ValueId {
        self.add_node(name, Op::Sigmoid, &[x])
    }

    pub fn unary(&mut self, name: impl Into<String>, x: ValueId, u: super::op::Unary) -> ValueId {
        self.add_node(name, Op::Unary(u), &[x])
    }

    pub fn max_pool(&mut self, name: impl Into<String>, x: ValueId, pool: Pool) -> ValueId {
        self.add_node(name, Op::MaxPool(pool), &[x])
    }

    pub fn adaptive_avg_pool(
        &mut self,
        name: impl Into<String>,
        x: ValueId,
        out: (usize, usize),
    ) -> ValueId {
        self.add_node(name, Op::AdaptiveAvgPool { out }, &[x])
    }

    pub fn add(&mut self, name: impl Into<String>, a: ValueId, b: ValueId) -> ValueId {
        self.add_node(name, Op::Add, &[a, b])
    }

    pub fn flatten(&mut self, name: impl Into<String>, x: ValueId) -> ValueId {
        self.add_node(name, Op::Flatten, &[x])
    }

    pub fn dropout(&mut self, name: impl Into<String>, x: ValueId, p: f32) -> ValueId {
        self.add_node(name, Op::Dropout { p }, &[x])
    }

    pub fn linear(
        &mut self,
        name: impl Into<String>,
        x: ValueId,
        in_features: usize,
        out_features: usize,
    ) -> ValueId {
        self.add_node(name, Op::linear(in_features, out_features, true), &[x])
    }

    /// A module that only training runs, kept for its parameters (`Graph::training_only`).
    pub fn training_only(&mut self, name: impl Into<String>, op: Op) {
        self.graph.training_only.push(Node {
            name: name.into(),
            op,
            inputs: Vec::new(),
        });
    }

    pub fn finish(mut self, output: ValueId) -> Graph {
        self.graph.output = output;
        self.graph
    }
}

/// A small network of the convolutions the GPU lowering tells apart — a strided k×k one with
/// bias and ReLU, a 1×1 whose output is added to its own input (fused, it reads that input
/// twice), a grouped dilated one, a depthwise strided one — then a linear layer over the
/// flattened features: for a 2×3×9×7 input.
#[cfg(test)]
pub(crate) fn convolution_mix() -> Graph {
    use super::op::Conv2d;
    let mut g = GraphBuilder::new("mix", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let a = g.conv("stem", x, Conv2d::new(3, 8, 3, 2, 1).with_bias());
    let a = g.relu("stem_relu", a);
    let b = g.conv("pointwise", a, Conv2d::new(8, 8, 1, 1, 0));
    let c = g.add("sum", a, b);
    let grouped = Conv2d {
        groups: 2,
        dilation: (2, 1),
        ..Conv2d::new(8, 6, 3, 1, 2)
    };
    let d = g.conv("grouped", c, grouped);
    let depthwise = Conv2d {
        groups: 6,
        ..Conv2d::new(6, 6, 3, 2, 1)
    };
    let e = g.conv("depthwise", d, depthwise);
    let f = g.flatten("flatten", e);
    let y = g.linear("fc", f, 6 * 3 * 3, 5);
    g.finish(y)
}

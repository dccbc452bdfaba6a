//! MaxViT (Tu et al. 2022) as torchvision builds it: a two-convolution stem, then four blocks
//! of layers, each layer an MBConv (pre-norm batch norm, 1×1 expansion, 3×3 depthwise,
//! squeeze-and-excitation, 1×1 projection; the first layer of a block halves the grid, its
//! shortcut an average pool and a 1×1 convolution) followed by two partition attention layers:
//! attention within 7×7 windows of adjacent pixels, then within a 7×7 grid spread over the
//! whole image (each a pre-norm attention with a relative position bias and a pre-norm GELU
//! MLP, each with its residual). The head pools, normalises, and applies a linear layer, tanh
//! and the classifier. Batch norm's ε is 1e-3; stochastic depth and dropout are the identity at
//! inference. Torchvision partitions NCHW tensors into (B, windows, tokens, C); the layer norms
//! and MLPs act per pixel, so here only the attention sees the partition.

use super::mobilenet::{conv_norm_act, squeeze_excitation};
use super::swin::norm;
use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, Pool, Unary, WindowAttention, WindowForm};

/// A MaxViT's shape: stem channels, channels and layers per block, channels per attention
/// head, and the partition (window and grid) side.
#[derive(Debug, Clone, Copy)]
pub struct MaxVitConfig {
    pub stem: usize,
    pub channels: [usize; 4],
    pub layers: [usize; 4],
    pub head_dim: usize,
    pub partition: usize,
}

impl MaxVitConfig {
    /// The tests' small MaxViT: 8 stem channels, blocks of 8 to 32 channels, heads of 4,
    /// partitions of 3 (which pad a 96² input's later stages).
    pub fn small() -> Self {
        MaxVitConfig {
            stem: 8,
            channels: [8, 16, 16, 32],
            layers: [1, 2, 1, 1],
            head_dim: 4,
            partition: 3,
        }
    }
}

/// torchvision's `maxvit_t`.
pub(super) fn variant(name: &str) -> Option<MaxVitConfig> {
    (name == "maxvit_t").then_some(MaxVitConfig {
        stem: 64,
        channels: [64, 128, 256, 512],
        layers: [2, 2, 5, 2],
        head_dim: 32,
        partition: 7,
    })
}

/// Batch norm's ε and the activation of every MBConv and the stem.
const BN_GELU: (f32, Option<Op>) = (1e-3, Some(Op::Gelu));

/// MaxViT of this shape.
pub fn maxvit_custom(name: &str, cfg: &MaxVitConfig, classes: usize) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::TruncNormal002,
        LinearInit::TruncNormal002,
    );
    let x = g.input();
    let x = conv_norm_act(
        &mut g,
        "stem.0",
        x,
        Conv2d::new(3, cfg.stem, 3, 2, 1),
        BN_GELU,
    );
    let stem = Conv2d::new(cfg.stem, cfg.stem, 3, 1, 1).with_bias();
    let mut x = g.conv("stem.1.0", x, stem);
    let mut cin = cfg.stem;
    for (b, (&cout, &layers)) in cfg.channels.iter().zip(&cfg.layers).enumerate() {
        for l in 0..layers {
            let p = format!("blocks.{b}.layers.{l}.layers");
            let stride = if l == 0 { 2 } else { 1 };
            x = mbconv(&mut g, &format!("{p}.MBconv"), x, (cin, cout), stride);
            for form in [WindowForm::MaxVitWindow, WindowForm::MaxVitGrid] {
                let kind = if form.dilated() { "grid" } else { "window" };
                let at = format!("{p}.{kind}_attention");
                x = partition_attention(
                    &mut g,
                    &at,
                    x,
                    (cout, cfg.head_dim),
                    (cfg.partition, form),
                );
            }
            cin = cout;
        }
    }
    let x = g.adaptive_avg_pool("classifier.0", x, (1, 1));
    let x = g.flatten("classifier.1", x);
    let x = g.add_node("classifier.2", Op::layer_norm(cin, 1e-5), &[x]);
    let x = g.linear("classifier.3", x, cin, cin);
    let x = g.unary("classifier.4", x, Unary::Tanh);
    let head = Op::linear(cin, classes, false);
    let x = g.add_node("classifier.5", head, &[x]);
    g.finish(x)
}

/// torchvision's MaxViT `MBConv` at `p`: `proj` (the shortcut) and `layers` (`pre_norm`,
/// `conv_a`, `conv_b`, `squeeze_excitation`, `conv_c`).
fn mbconv(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (cin, cout): (usize, usize),
    stride: usize,
) -> ValueId {
    let project = Conv2d::new(cin, cout, 1, 1, 0).with_bias();
    let shortcut = match (stride, cin == cout) {
        (1, true) => x,
        (1, false) => g.conv(format!("{p}.proj.0"), x, project),
        _ => {
            let pool = Op::AvgPool(Pool::new(3, stride, 1));
            let pooled = g.add_node(format!("{p}.proj.0"), pool, &[x]);
            g.conv(format!("{p}.proj.1"), pooled, project)
        }
    };
    let (mid, squeeze) = (4 * cout, cout / 4);
    let l = format!("{p}.layers");
    let y = g.add_node(
        format!("{l}.pre_norm"),
        Op::BatchNorm {
            channels: cin,
            eps: 1e-3,
        },
        &[x],
    );
    let expand = Conv2d::new(cin, mid, 1, 1, 0);
    let y = conv_norm_act(g, &format!("{l}.conv_a"), y, expand, BN_GELU);
    let depthwise = Conv2d::new(mid, mid, 3, stride, 1).with_groups(mid);
    let y = conv_norm_act(g, &format!("{l}.conv_b"), y, depthwise, BN_GELU);
    let gates = (Op::Unary(Unary::Silu), Op::Sigmoid);
    let y = squeeze_excitation(
        g,
        &format!("{l}.squeeze_excitation"),
        y,
        (mid, squeeze),
        gates,
    );
    let reduce = Conv2d::new(mid, cout, 1, 1, 0).with_bias();
    let y = g.conv(format!("{l}.conv_c"), y, reduce);
    g.add(format!("{p}.add"), shortcut, y)
}

/// A `PartitionAttentionLayer` at `p`: `attn_layer.0` (layer norm), `attn_layer.1` (the
/// attention on the window or grid partition), then `mlp_layer` (layer norm, linear, GELU,
/// linear), each with its residual.
fn partition_attention(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (dim, head_dim): (usize, usize),
    (window, form): (usize, WindowForm),
) -> ValueId {
    let y = norm(g, format!("{p}.attn_layer.0"), x, dim);
    let attention = Op::WindowAttention(WindowAttention {
        dim,
        heads: dim / head_dim,
        window,
        shift: 0,
        form,
    });
    let y = g.add_node(format!("{p}.attn_layer.1"), attention, &[y]);
    let x = g.add(format!("{p}.add1"), x, y);
    let y = norm(g, format!("{p}.mlp_layer.0"), x, dim);
    let t = g.add_node(format!("{p}.mlp_layer.tokens"), Op::Tokens, &[y]);
    let t = g.linear(format!("{p}.mlp_layer.1"), t, dim, 4 * dim);
    let t = g.add_node(format!("{p}.mlp_layer.2"), Op::Gelu, &[t]);
    let t = g.linear(format!("{p}.mlp_layer.3"), t, 4 * dim, dim);
    let y = g.add_node(format!("{p}.mlp_layer.image"), Op::Image, &[t, x]);
    g.add(format!("{p}.add2"), x, y)
}

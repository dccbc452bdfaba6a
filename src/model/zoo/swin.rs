//! Swin Transformer (Liu et al. 2021) as torchvision builds it: a 4×4 patch embedding with a
//! layer norm, four stages of blocks alternating plain and shifted 7×7 window attention (each
//! block pre-norm: attention, then a GELU MLP, each with its residual), patch merging between
//! stages (2×2 neighbours concatenated, layer norm, a linear reduction to twice the channels),
//! a final layer norm, pooling and the head. Swin V2 (2022) normalises after attention and
//! after the MLP instead of before, reduces before its merge's norm, attends by cosine with a
//! learned scale per head, and draws its position bias from a small MLP over log-spaced
//! offsets; torchvision's V2 has 8×8 windows at 256×256. Torchvision keeps its tensors channels-last
//! (N, H, W, C); here they are image batches whose channel ops are the same on NHWC storage.
//! Stochastic depth is the identity at inference.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, WindowAttention, WindowForm};

/// torchvision's variants: embedding channels, blocks and heads per stage.
pub(super) fn variant(name: &str) -> Option<(usize, [usize; 4], [usize; 4])> {
    Some(match name.replace("_v2", "").as_str() {
        "swin_t" => (96, [2, 2, 6, 2], [3, 6, 12, 24]),
        "swin_s" => (96, [2, 2, 18, 2], [3, 6, 12, 24]),
        "swin_b" => (128, [2, 2, 18, 2], [4, 8, 16, 32]),
        _ => return None,
    })
}

/// torchvision's Swin V1 or V2 by name: the window and input size go with the version.
pub(super) fn build(name: &str) -> Option<Graph> {
    let shape = variant(name)?;
    Some(if name.starts_with("swin_v2") {
        let mut g = swin_custom(name, shape, (8, true), 1000);
        g.input_size = 256;
        g
    } else {
        swin_custom(name, shape, (7, false), 1000)
    })
}

/// `nn.LayerNorm(dim)` (ε = 1e-5) over an image's channels.
pub(super) fn norm(g: &mut GraphBuilder, name: String, x: ValueId, dim: usize) -> ValueId {
    g.add_node(name, Op::layer_norm(dim, 1e-5), &[x])
}

/// A linear layer `p` over an image's channels: to tokens, the layer, back on the grid of
/// `like` (the conversions named beside the layer, not inside it).
fn channel_linear(g: &mut GraphBuilder, p: &str, (x, like): (ValueId, ValueId), op: Op) -> ValueId {
    let parent = p.rsplit_once('.').map_or("", |(parent, _)| parent);
    let t = g.add_node(format!("{parent}.tokens"), Op::Tokens, &[x]);
    let t = g.add_node(p.to_string(), op, &[t]);
    g.add_node(format!("{parent}.image"), Op::Image, &[t, like])
}

/// Swin with this embedding width, blocks and heads per stage, window, and version (V2 when
/// `v2`).
pub fn swin_custom(
    name: &str,
    (embed, depths, heads): (usize, [usize; 4], [usize; 4]),
    (window, v2): (usize, bool),
    classes: usize,
) -> Graph {
    let mut g = GraphBuilder::new(name, 3, ConvInit::TorchDefault, LinearInit::TruncNormal002);
    let x = g.input();
    let x = g.conv(
        "features.0.0",
        x,
        Conv2d::new(3, embed, 4, 4, 0).with_bias(),
    );
    let mut x = norm(&mut g, "features.0.2".into(), x, embed);
    let mut dim = embed;
    for (s, (&blocks, &heads)) in depths.iter().zip(&heads).enumerate() {
        for b in 0..blocks {
            let p = format!("features.{}.{b}", 2 * s + 1);
            let shift = if b % 2 == 0 { 0 } else { window / 2 };
            x = block(&mut g, &p, x, (dim, heads), (window, shift, v2));
        }
        if s + 1 < depths.len() {
            let p = format!("features.{}", 2 * s + 2);
            let merged = g.add_node(format!("{p}.merge"), Op::PatchMerge, &[x]);
            let reduction = Op::linear(4 * dim, 2 * dim, false);
            let reduce = format!("{p}.reduction");
            x = if v2 {
                let y = channel_linear(&mut g, &reduce, (merged, merged), reduction);
                norm(&mut g, format!("{p}.norm"), y, 2 * dim)
            } else {
                let y = norm(&mut g, format!("{p}.norm"), merged, 4 * dim);
                channel_linear(&mut g, &reduce, (y, merged), reduction)
            };
            dim *= 2;
        }
    }
    let x = norm(&mut g, "norm".into(), x, dim);
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.linear("head", x, dim, classes);
    g.finish(x)
}

/// One `SwinTransformerBlock` (V2: `SwinTransformerBlockV2`) at `p`: `norm1`, `attn`,
/// `norm2`, `mlp.0`/`mlp.3`; V1 normalises each branch's input, V2 its output.
fn block(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (dim, heads): (usize, usize),
    (window, shift, v2): (usize, usize, bool),
) -> ValueId {
    let attention = Op::WindowAttention(WindowAttention {
        dim,
        heads,
        window,
        shift,
        form: if v2 {
            WindowForm::SwinV2
        } else {
            WindowForm::Swin
        },
    });
    let y = if v2 {
        x
    } else {
        norm(g, format!("{p}.norm1"), x, dim)
    };
    let y = g.add_node(format!("{p}.attn"), attention, &[y]);
    let y = if v2 {
        norm(g, format!("{p}.norm1"), y, dim)
    } else {
        y
    };
    let x = g.add(format!("{p}.add1"), x, y);
    let y = if v2 {
        x
    } else {
        norm(g, format!("{p}.norm2"), x, dim)
    };
    let t = g.add_node(format!("{p}.mlp.tokens"), Op::Tokens, &[y]);
    let t = g.linear(format!("{p}.mlp.0"), t, dim, 4 * dim);
    let t = g.add_node(format!("{p}.mlp.1"), Op::Gelu, &[t]);
    let t = g.linear(format!("{p}.mlp.3"), t, 4 * dim, dim);
    let y = g.add_node(format!("{p}.mlp.image"), Op::Image, &[t, x]);
    let y = if v2 {
        norm(g, format!("{p}.norm2"), y, dim)
    } else {
        y
    };
    g.add(format!("{p}.add2"), x, y)
}

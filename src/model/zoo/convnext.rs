//! ConvNeXt (Liu et al. 2022) as torchvision builds it: a 4×4 patchify stem, four stages of
//! blocks (depthwise 7×7 → LayerNorm → Linear ×4 → GELU → Linear, channels-last, then a learned
//! per-channel layer scale and the residual add), LayerNorm + 2×2 stride-2 convolutions
//! between stages, and a LayerNorm before the classifier. Stochastic depth is the identity at
//! inference, so it is not in the graph.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op};

/// torchvision's variants: channels and blocks per stage.
pub(super) fn variant(name: &str) -> Option<([usize; 4], [usize; 4])> {
    Some(match name {
        "convnext_tiny" => ([96, 192, 384, 768], [3, 3, 9, 3]),
        "convnext_small" => ([96, 192, 384, 768], [3, 3, 27, 3]),
        "convnext_base" => ([128, 256, 512, 1024], [3, 3, 27, 3]),
        "convnext_large" => ([192, 384, 768, 1536], [3, 3, 27, 3]),
        _ => return None,
    })
}

/// `LayerNorm2d` and the blocks' `LayerNorm`: ε = 1e-6.
fn layer_norm(g: &mut GraphBuilder, name: String, x: ValueId, dim: usize) -> ValueId {
    g.add_node(name, Op::layer_norm(dim, 1e-6), &[x])
}

/// ConvNeXt with these stage widths and depths.
pub fn convnext_custom(
    name: &str,
    widths: [usize; 4],
    depths: [usize; 4],
    classes: usize,
) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::TruncNormal002,
        LinearInit::TruncNormal002,
    );
    let x = g.input();
    let x = g.conv(
        "features.0.0",
        x,
        Conv2d::new(3, widths[0], 4, 4, 0).with_bias(),
    );
    let mut x = layer_norm(&mut g, "features.0.1".into(), x, widths[0]);
    // features.1, 3, 5, 7 are the stages; 2, 4, 6 the downsampling between them.
    for (s, (&dim, &blocks)) in widths.iter().zip(&depths).enumerate() {
        for b in 0..blocks {
            x = block(&mut g, &format!("features.{}.{b}", 2 * s + 1), x, dim);
        }
        if let Some(&next) = widths.get(s + 1) {
            let p = format!("features.{}", 2 * s + 2);
            let y = layer_norm(&mut g, format!("{p}.0"), x, dim);
            let down = Conv2d::new(dim, next, 2, 2, 0).with_bias();
            x = g.conv(format!("{p}.1"), y, down);
        }
    }
    let last = widths[3];
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = layer_norm(&mut g, "classifier.0".into(), x, last);
    let x = g.flatten("classifier.1", x);
    let x = g.linear("classifier.2", x, last, classes);
    g.finish(x)
}

/// One `CNBlock` at `p`: `block.0` … `block.6` and `layer_scale`, plus the residual add.
fn block(g: &mut GraphBuilder, p: &str, x: ValueId, dim: usize) -> ValueId {
    let dw = Conv2d::new(dim, dim, 7, 1, 3).with_groups(dim).with_bias();
    let y = g.conv(format!("{p}.block.0"), x, dw);
    let y = g.add_node(format!("{p}.block.1"), Op::Tokens, &[y]);
    let y = layer_norm(g, format!("{p}.block.2"), y, dim);
    let y = g.linear(format!("{p}.block.3"), y, dim, 4 * dim);
    let y = g.add_node(format!("{p}.block.4"), Op::Gelu, &[y]);
    let y = g.linear(format!("{p}.block.5"), y, 4 * dim, dim);
    let y = g.add_node(format!("{p}.block.6"), Op::Image, &[y, x]);
    let y = g.add_node(
        format!("{p}.layer_scale"),
        Op::LayerScale { channels: dim },
        &[y],
    );
    g.add(format!("{p}.add"), y, x)
}

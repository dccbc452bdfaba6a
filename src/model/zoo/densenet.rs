//! DenseNet (Huang et al. 2017) as torchvision builds it: a 7×7 stem, dense blocks whose every
//! layer (BN → ReLU → 1×1 → BN → ReLU → 3×3, `growth` new channels) reads the concatenation of
//! all the block's earlier features, transitions (BN → ReLU → 1×1 halving the channels →
//! 2×2 average pool) between blocks, a final batch norm, ReLU, pooling and the classifier.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, Pool};

/// torchvision's variants: growth rate, layers per block, stem channels.
pub(super) fn variant(name: &str) -> Option<(usize, [usize; 4], usize)> {
    Some(match name {
        "densenet121" => (32, [6, 12, 24, 16], 64),
        "densenet161" => (48, [6, 12, 36, 24], 96),
        "densenet169" => (32, [6, 12, 32, 32], 64),
        "densenet201" => (32, [6, 12, 48, 32], 64),
        _ => return None,
    })
}

/// DenseNet with this growth rate, block depths and stem width (bottleneck 4 × growth).
pub fn densenet_custom(
    name: &str,
    growth: usize,
    blocks: [usize; 4],
    stem: usize,
    classes: usize,
) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanIn,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let x = g.conv("features.conv0", x, Conv2d::new(3, stem, 7, 2, 3));
    let x = g.bn("features.norm0", x, stem);
    let x = g.relu("features.relu0", x);
    let mut x = g.max_pool("features.pool0", x, Pool::new(3, 2, 1));
    let mut channels = stem;
    for (b, &layers) in blocks.iter().enumerate() {
        let p = format!("features.denseblock{}", b + 1);
        for l in 0..layers {
            let new = dense_layer(
                &mut g,
                &format!("{p}.denselayer{}", l + 1),
                x,
                channels,
                growth,
            );
            // torch.cat(features, 1): the block's input and every layer's output so far.
            x = g.add_node(
                format!("{p}.cat{}", l + 1),
                Op::Concat { parts: 2 },
                &[x, new],
            );
            channels += growth;
        }
        if b + 1 < blocks.len() {
            let t = format!("features.transition{}", b + 1);
            let y = g.bn(format!("{t}.norm"), x, channels);
            let y = g.relu(format!("{t}.relu"), y);
            let y = g.conv(
                format!("{t}.conv"),
                y,
                Conv2d::new(channels, channels / 2, 1, 1, 0),
            );
            x = g.add_node(format!("{t}.pool"), Op::AvgPool(Pool::new(2, 2, 0)), &[y]);
            channels /= 2;
        }
    }
    let x = g.bn("features.norm5", x, channels);
    let x = g.relu("relu", x);
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.linear("classifier", x, channels, classes);
    g.finish(x)
}

/// One `_DenseLayer` at `p` on the concatenated features `x`: its `growth` new channels.
fn dense_layer(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    channels: usize,
    growth: usize,
) -> ValueId {
    let inner = 4 * growth;
    let y = g.bn(format!("{p}.norm1"), x, channels);
    let y = g.relu(format!("{p}.relu1"), y);
    let y = g.conv(
        format!("{p}.conv1"),
        y,
        Conv2d::new(channels, inner, 1, 1, 0),
    );
    let y = g.bn(format!("{p}.norm2"), y, inner);
    let y = g.relu(format!("{p}.relu2"), y);
    g.conv(format!("{p}.conv2"), y, Conv2d::new(inner, growth, 3, 1, 1))
}

//! SqueezeNet 1.0 and 1.1 (Iandola et al. 2016) as torchvision builds them: Fire modules
//! (a 1×1 squeeze, then 1×1 and 3×3 expands side by side, concatenated), ceil-mode max
//! pooling, and a convolutional classifier (1×1 to the classes, ReLU, global average pool).

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, Pool};

/// A layer of `features`: a Fire module (squeeze, expand 1×1, expand 3×3) or a max pool.
#[derive(Clone, Copy)]
enum Layer {
    Fire(usize, usize, usize),
    Pool,
}
use Layer::{Fire, Pool as P};

const V1_0: [Layer; 10] = [
    Fire(16, 64, 64),
    Fire(16, 64, 64),
    Fire(32, 128, 128),
    P,
    Fire(32, 128, 128),
    Fire(48, 192, 192),
    Fire(48, 192, 192),
    Fire(64, 256, 256),
    P,
    Fire(64, 256, 256),
];

const V1_1: [Layer; 10] = [
    Fire(16, 64, 64),
    Fire(16, 64, 64),
    P,
    Fire(32, 128, 128),
    Fire(32, 128, 128),
    P,
    Fire(48, 192, 192),
    Fire(48, 192, 192),
    Fire(64, 256, 256),
    Fire(64, 256, 256),
];

/// torchvision's `MaxPool2d(kernel_size=3, stride=2, ceil_mode=True)`.
fn ceil_pool() -> Pool {
    Pool {
        ceil_mode: true,
        ..Pool::new(3, 2, 0)
    }
}

/// SqueezeNet `1_0` (a 7×7 stem of 96) or `1_1` (a 3×3 stem of 64, pooling earlier).
pub fn squeezenet_custom(name: &str, v1_1: bool, classes: usize) -> Graph {
    let mut g = GraphBuilder::new(name, 3, ConvInit::KaimingUniform, LinearInit::TorchDefault);
    let (stem, k, layers) = if v1_1 { (64, 3, V1_1) } else { (96, 7, V1_0) };
    let x = g.input();
    let x = g.conv("features.0", x, Conv2d::new(3, stem, k, 2, 0).with_bias());
    let x = g.relu("features.1", x);
    let mut x = g.max_pool("features.2", x, ceil_pool());
    let mut channels = stem;
    for (i, layer) in layers.into_iter().enumerate() {
        let p = format!("features.{}", i + 3);
        x = match layer {
            Fire(squeeze, e1, e3) => {
                let y = fire(&mut g, &p, x, channels, (squeeze, e1, e3));
                channels = e1 + e3;
                y
            }
            P => g.max_pool(p, x, ceil_pool()),
        };
    }
    let x = g.dropout("classifier.0", x, 0.5);
    let x = g.conv(
        "classifier.1",
        x,
        Conv2d::new(channels, classes, 1, 1, 0).with_bias(),
    );
    let x = g.relu("classifier.2", x);
    let x = g.adaptive_avg_pool("classifier.3", x, (1, 1));
    let x = g.flatten("flatten", x);
    g.finish(x)
}

/// One Fire module at `p`.
fn fire(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    channels: usize,
    (squeeze, e1, e3): (usize, usize, usize),
) -> ValueId {
    let s = g.conv(
        format!("{p}.squeeze"),
        x,
        Conv2d::new(channels, squeeze, 1, 1, 0).with_bias(),
    );
    let s = g.relu(format!("{p}.squeeze_activation"), s);
    let a = g.conv(
        format!("{p}.expand1x1"),
        s,
        Conv2d::new(squeeze, e1, 1, 1, 0).with_bias(),
    );
    let a = g.relu(format!("{p}.expand1x1_activation"), a);
    let b = g.conv(
        format!("{p}.expand3x3"),
        s,
        Conv2d::new(squeeze, e3, 3, 1, 1).with_bias(),
    );
    let b = g.relu(format!("{p}.expand3x3_activation"), b);
    g.add_node(format!("{p}.cat"), Op::Concat { parts: 2 }, &[a, b])
}

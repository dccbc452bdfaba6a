//! VGG (Simonyan & Zisserman 2014) as torchvision builds it: `features.N` convolutions with
//! bias (and batch norm in the `_bn` variants), 2×2 max pools, a 7×7 adaptive pool and a
//! three-layer `classifier`.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit};
use crate::model::op::{Conv2d, Pool};

/// Channel plans A, B, D, E of the paper; 0 stands for a max pool.
fn plan(base: &str) -> &'static [usize] {
    match base {
        "vgg11" => &[64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0],
        "vgg13" => &[
            64, 64, 0, 128, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0,
        ],
        "vgg16" => &[
            64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
        ],
        _ => &[
            64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0, 512, 512, 512,
            512, 0,
        ],
    }
}

pub(super) fn vgg(name: &str, base: &str, batch_norm: bool, classes: usize) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::Normal001,
    );
    let mut x = g.input();
    let mut idx = 0;
    let mut channels = 3;
    for &v in plan(base) {
        if v == 0 {
            x = g.max_pool(format!("features.{idx}"), x, Pool::new(2, 2, 0));
            idx += 1;
            continue;
        }
        x = g.conv(
            format!("features.{idx}"),
            x,
            Conv2d::new(channels, v, 3, 1, 1).with_bias(),
        );
        idx += 1;
        if batch_norm {
            x = g.bn(format!("features.{idx}"), x, v);
            idx += 1;
        }
        x = g.relu(format!("features.{idx}"), x);
        idx += 1;
        channels = v;
    }
    let x = g.adaptive_avg_pool("avgpool", x, (7, 7));
    let x = g.flatten("flatten", x);
    let x = g.linear("classifier.0", x, 512 * 7 * 7, 4096);
    let x = g.relu("classifier.1", x);
    let x = g.dropout("classifier.2", x, 0.5);
    let x = g.linear("classifier.3", x, 4096, 4096);
    let x = g.relu("classifier.4", x);
    let x = g.dropout("classifier.5", x, 0.5);
    let x = g.linear("classifier.6", x, 4096, classes);
    g.finish(x)
}

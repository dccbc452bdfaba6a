//! AlexNet (Krizhevsky et al. 2012) in torchvision's single-tower form.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit};
use crate::model::op::{Conv2d, Pool};

pub(super) fn alexnet(classes: usize) -> Graph {
    let mut g = GraphBuilder::new(
        "alexnet",
        3,
        ConvInit::TorchDefault,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let x = g.conv("features.0", x, Conv2d::new(3, 64, 11, 4, 2).with_bias());
    let x = g.relu("features.1", x);
    let x = g.max_pool("features.2", x, Pool::new(3, 2, 0));
    let x = g.conv("features.3", x, Conv2d::new(64, 192, 5, 1, 2).with_bias());
    let x = g.relu("features.4", x);
    let x = g.max_pool("features.5", x, Pool::new(3, 2, 0));
    let x = g.conv("features.6", x, Conv2d::new(192, 384, 3, 1, 1).with_bias());
    let x = g.relu("features.7", x);
    let x = g.conv("features.8", x, Conv2d::new(384, 256, 3, 1, 1).with_bias());
    let x = g.relu("features.9", x);
    let x = g.conv("features.10", x, Conv2d::new(256, 256, 3, 1, 1).with_bias());
    let x = g.relu("features.11", x);
    let x = g.max_pool("features.12", x, Pool::new(3, 2, 0));
    let x = g.adaptive_avg_pool("avgpool", x, (6, 6));
    let x = g.flatten("flatten", x);
    let x = g.dropout("classifier.0", x, 0.5);
    let x = g.linear("classifier.1", x, 256 * 6 * 6, 4096);
    let x = g.relu("classifier.2", x);
    let x = g.dropout("classifier.3", x, 0.5);
    let x = g.linear("classifier.4", x, 4096, 4096);
    let x = g.relu("classifier.5", x);
    let x = g.linear("classifier.6", x, 4096, classes);
    g.finish(x)
}

//! MNASNet (Tan et al. 2019) as torchvision builds it: a stem, a depthwise-separable layer,
//! six stacks of inverted residuals (ReLU, no squeeze-and-excitation), a 1×1 convolution to
//! 1280 channels, the spatial mean and the classifier; depths scaled by `alpha`.

use super::mobilenet::conv_norm_act_at as conv3;
use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op};

/// The stacks: kernel, stride, expansion, repeats (their widths are `depths(alpha)[2..]`).
const STACKS: [(usize, usize, usize, usize); 6] = [
    (3, 2, 3, 3),
    (5, 2, 3, 3),
    (5, 2, 6, 3),
    (3, 1, 6, 2),
    (5, 2, 6, 4),
    (3, 1, 6, 1),
];

/// torchvision's variants: the depth multiplier `alpha`.
pub(super) fn variant(name: &str) -> Option<f64> {
    Some(match name {
        "mnasnet0_5" => 0.5,
        "mnasnet0_75" => 0.75,
        "mnasnet1_0" => 1.0,
        "mnasnet1_3" => 1.3,
        _ => return None,
    })
}

/// torchvision's `_round_to_multiple_of(val, 8)`: round to a multiple of 8, up when that
/// loses more than 10%.
fn round_to_multiple_of_8(v: f64) -> usize {
    let rounded = 8usize.max((v + 4.0) as usize / 8 * 8);
    if rounded as f64 >= 0.9 * v {
        rounded
    } else {
        rounded + 8
    }
}

/// The batch norm (ε = 1e-5) and ReLU after a convolution, as `layers.{i}`, `layers.{i+1}`.
const RELU: (f32, Option<Op>) = (1e-5, Some(Op::Relu));
const LINEAR: (f32, Option<Op>) = (1e-5, None);

/// MNASNet with depth multiplier `alpha`.
pub fn mnasnet_custom(name: &str, alpha: f64, classes: usize) -> Graph {
    let depths =
        [32, 16, 24, 40, 80, 96, 192, 320].map(|d| round_to_multiple_of_8(d as f64 * alpha));
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::UniformFanOut,
    );
    let x = g.input();
    // `layers` is one flat Sequential: conv, bn, relu at 0–2, the depthwise at 3–5, …
    let x = conv3(
        &mut g,
        ("layers", 0),
        x,
        Conv2d::new(3, depths[0], 3, 2, 1),
        RELU,
    );
    let dw = Conv2d::new(depths[0], depths[0], 3, 1, 1).with_groups(depths[0]);
    let x = conv3(&mut g, ("layers", 3), x, dw, RELU);
    let pw = Conv2d::new(depths[0], depths[1], 1, 1, 0);
    let mut x = conv3(&mut g, ("layers", 6), x, pw, LINEAR);
    for (s, &(k, stride, expand, repeats)) in STACKS.iter().enumerate() {
        let (cin, cout) = (depths[s + 1], depths[s + 2]);
        for r in 0..repeats {
            let p = format!("layers.{}.{r}", s + 8);
            let (cin, stride) = if r == 0 { (cin, stride) } else { (cout, 1) };
            x = inverted_residual(&mut g, &p, x, (cin, cout, k, stride, expand));
        }
    }
    let x = conv3(
        &mut g,
        ("layers", 14),
        x,
        Conv2d::new(depths[7], 1280, 1, 1, 0),
        RELU,
    );
    let x = g.adaptive_avg_pool("mean", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.dropout("classifier.0", x, 0.2);
    let x = g.linear("classifier.1", x, 1280, classes);
    g.finish(x)
}

/// One `_InvertedResidual` at `p`: `layers.0`–`layers.7` (expand, depthwise, project).
fn inverted_residual(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (cin, cout, k, stride, expand): (usize, usize, usize, usize, usize),
) -> ValueId {
    let mid = cin * expand;
    let y = conv3(
        g,
        (&format!("{p}.layers"), 0),
        x,
        Conv2d::new(cin, mid, 1, 1, 0),
        RELU,
    );
    let dw = Conv2d::new(mid, mid, k, stride, k / 2).with_groups(mid);
    let y = conv3(g, (&format!("{p}.layers"), 3), y, dw, RELU);
    let y = conv3(
        g,
        (&format!("{p}.layers"), 6),
        y,
        Conv2d::new(mid, cout, 1, 1, 0),
        LINEAR,
    );
    if cin == cout && stride == 1 {
        g.add(format!("{p}.add"), y, x)
    } else {
        y
    }
}

//! MobileNetV3 (Howard et al. 2019) as torchvision builds it: inverted residual blocks with
//! hardswish or ReLU, squeeze-and-excitation (`block.N.fc1`/`fc2`, a hardsigmoid scale) in
//! some, batch norm with ε = 0.001, and a hardswish classifier.

use super::mobilenet::{conv_norm_act, make_divisible, squeeze_excitation};
use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit};
use crate::model::op::{Conv2d, Op, Unary};

/// One bottleneck of torchvision's `InvertedResidualConfig`: input, kernel, expanded, output
/// channels (before the width multiplier), squeeze-and-excitation, hardswish, stride.
type Bneck = (usize, usize, usize, usize, bool, bool, usize);

const LARGE: [Bneck; 15] = [
    (16, 3, 16, 16, false, false, 1),
    (16, 3, 64, 24, false, false, 2),
    (24, 3, 72, 24, false, false, 1),
    (24, 5, 72, 40, true, false, 2),
    (40, 5, 120, 40, true, false, 1),
    (40, 5, 120, 40, true, false, 1),
    (40, 3, 240, 80, false, true, 2),
    (80, 3, 200, 80, false, true, 1),
    (80, 3, 184, 80, false, true, 1),
    (80, 3, 184, 80, false, true, 1),
    (80, 3, 480, 112, true, true, 1),
    (112, 3, 672, 112, true, true, 1),
    (112, 5, 672, 160, true, true, 2),
    (160, 5, 960, 160, true, true, 1),
    (160, 5, 960, 160, true, true, 1),
];

const SMALL: [Bneck; 11] = [
    (16, 3, 16, 16, true, false, 2),
    (16, 3, 72, 24, false, false, 2),
    (24, 3, 88, 24, false, false, 1),
    (24, 5, 96, 40, true, true, 2),
    (40, 5, 240, 40, true, true, 1),
    (40, 5, 240, 40, true, true, 1),
    (40, 5, 120, 48, true, true, 1),
    (48, 5, 144, 48, true, true, 1),
    (48, 5, 288, 96, true, true, 2),
    (96, 5, 576, 96, true, true, 1),
    (96, 5, 576, 96, true, true, 1),
];

/// Batch norm's ε and the activation after it: hardswish, ReLU, or none (the projections).
const HS: (f32, Option<Op>) = (1e-3, Some(Op::Unary(Unary::Hardswish)));
const RE: (f32, Option<Op>) = (1e-3, Some(Op::Relu));
const LINEAR: (f32, Option<Op>) = (1e-3, None);

/// `mobilenet_v3_large` or `mobilenet_v3_small` with a width multiplier (1.0 in the zoo).
pub fn mobilenet_v3_custom(name: &str, large: bool, width_mult: f64, classes: usize) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::Normal001,
    );
    let adjust = |c: usize| make_divisible(c as f64 * width_mult, 8);
    let (setting, last): (&[Bneck], usize) = if large {
        (&LARGE, 1280)
    } else {
        (&SMALL, 1024)
    };
    let x = g.input();
    let first = adjust(setting[0].0);
    let mut x = conv_norm_act(&mut g, "features.0", x, Conv2d::new(3, first, 3, 2, 1), HS);
    for (i, &(cin, k, exp, cout, se, hs, stride)) in setting.iter().enumerate() {
        let (cin, exp, cout) = (adjust(cin), adjust(exp), adjust(cout));
        let p = format!("features.{}.block", i + 1);
        let mut y = x;
        let mut j = 0;
        if exp != cin {
            y = conv_norm_act(
                &mut g,
                &format!("{p}.0"),
                y,
                Conv2d::new(cin, exp, 1, 1, 0),
                if hs { HS } else { RE },
            );
            j += 1;
        }
        let dw = Conv2d::new(exp, exp, k, stride, (k - 1) / 2).with_groups(exp);
        y = conv_norm_act(&mut g, &format!("{p}.{j}"), y, dw, if hs { HS } else { RE });
        j += 1;
        if se {
            let s = format!("{p}.{j}");
            let squeeze = make_divisible((exp / 4) as f64, 8);
            let ops = (Op::Relu, Op::Unary(Unary::Hardsigmoid));
            y = squeeze_excitation(&mut g, &s, y, (exp, squeeze), ops);
            j += 1;
        }
        y = conv_norm_act(
            &mut g,
            &format!("{p}.{j}"),
            y,
            Conv2d::new(exp, cout, 1, 1, 0),
            LINEAR,
        );
        x = if stride == 1 && cin == cout {
            g.add(format!("features.{}.add", i + 1), y, x)
        } else {
            y
        };
    }
    let cin = adjust(setting[setting.len() - 1].3);
    let lastconv = 6 * cin;
    let p = format!("features.{}", setting.len() + 1);
    let x = conv_norm_act(&mut g, &p, x, Conv2d::new(cin, lastconv, 1, 1, 0), HS);
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let hidden = adjust(last);
    let x = g.linear("classifier.0", x, lastconv, hidden);
    let x = g.unary("classifier.1", x, Unary::Hardswish);
    let x = g.dropout("classifier.2", x, 0.2);
    let x = g.linear("classifier.3", x, hidden, classes);
    g.finish(x)
}

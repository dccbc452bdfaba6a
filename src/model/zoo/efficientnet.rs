//! EfficientNet B0–B7 (Tan & Le 2019) as torchvision builds them: MBConv blocks (expand 1×1,
//! depthwise k×k, squeeze-and-excitation with SiLU and a sigmoid scale, project 1×1), SiLU
//! everywhere, widths and depths scaled per variant, stochastic depth (an identity at
//! inference, so not in the graph), dropout before the classifier.

use super::mobilenet::{conv_norm_act, make_divisible, squeeze_excitation};
use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, Unary};

/// One stage of torchvision's `MBConvConfig` at B0's size: expand ratio, kernel, stride,
/// input channels, output channels, blocks.
const STAGES: [(usize, usize, usize, usize, usize, usize); 7] = [
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
];

/// The activation after batch norm in every Conv2dNormActivation but the projections.
const SILU: Option<Op> = Some(Op::Unary(Unary::Silu));

/// torchvision's variants: width and depth multipliers, dropout, the input size its weights
/// were trained at, and batch norm's ε (B5–B7 use 0.001).
pub fn variant(b: usize) -> Option<(f64, f64, f32, usize, f32)> {
    Some(match b {
        0 => (1.0, 1.0, 0.2, 224, 1e-5),
        1 => (1.0, 1.1, 0.2, 240, 1e-5),
        2 => (1.1, 1.2, 0.3, 288, 1e-5),
        3 => (1.2, 1.4, 0.3, 300, 1e-5),
        4 => (1.4, 1.8, 0.4, 380, 1e-5),
        5 => (1.6, 2.2, 0.4, 456, 1e-3),
        6 => (1.8, 2.6, 0.5, 528, 1e-3),
        7 => (2.0, 3.1, 0.5, 600, 1e-3),
        _ => return None,
    })
}

/// EfficientNet with width and depth multipliers (torchvision's B0–B7 are in `variant`).
pub fn efficientnet_custom(
    name: &str,
    (width, depth): (f64, f64),
    (dropout, input_size, eps): (f32, usize, f32),
    classes: usize,
) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::UniformFanOut,
    );
    g.input_size(input_size);
    let adjust = |c: usize| make_divisible(c as f64 * width, 8);
    let x = g.input();
    let stem = adjust(STAGES[0].3);
    let mut x = conv_norm_act(
        &mut g,
        "features.0",
        x,
        Conv2d::new(3, stem, 3, 2, 1),
        (eps, SILU),
    );
    for (s, &(expand, k, stride, cin, cout, blocks)) in STAGES.iter().enumerate() {
        let (cin, cout) = (adjust(cin), adjust(cout));
        let blocks = (blocks as f64 * depth).ceil() as usize;
        for i in 0..blocks {
            let (cin, stride) = if i == 0 { (cin, stride) } else { (cout, 1) };
            let p = format!("features.{}.{i}", s + 1);
            x = mbconv(&mut g, &p, x, (cin, cout, expand, k, stride), eps);
        }
    }
    let cin = adjust(STAGES[6].4);
    let last = 4 * cin;
    let x = conv_norm_act(
        &mut g,
        "features.8",
        x,
        Conv2d::new(cin, last, 1, 1, 0),
        (eps, SILU),
    );
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.dropout("classifier.0", x, dropout);
    let x = g.linear("classifier.1", x, last, classes);
    g.finish(x)
}

/// One MBConv block: `{p}.block.{j}` layers, the residual add when the shape stays.
fn mbconv(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (cin, cout, expand, k, stride): (usize, usize, usize, usize, usize),
    eps: f32,
) -> ValueId {
    let exp = make_divisible((cin * expand) as f64, 8);
    let mut y = x;
    let mut j = 0;
    if exp != cin {
        y = conv_norm_act(
            g,
            &format!("{p}.block.{j}"),
            y,
            Conv2d::new(cin, exp, 1, 1, 0),
            (eps, SILU),
        );
        j += 1;
    }
    let dw = Conv2d::new(exp, exp, k, stride, (k - 1) / 2).with_groups(exp);
    y = conv_norm_act(g, &format!("{p}.block.{j}"), y, dw, (eps, SILU));
    j += 1;
    let s = format!("{p}.block.{j}");
    let squeeze = (cin / 4).max(1);
    let ops = (Op::Unary(Unary::Silu), Op::Sigmoid);
    y = squeeze_excitation(g, &s, y, (exp, squeeze), ops);
    j += 1;
    let project = Conv2d::new(exp, cout, 1, 1, 0);
    y = conv_norm_act(g, &format!("{p}.block.{j}"), y, project, (eps, None));
    if stride == 1 && cin == cout {
        g.add(p.to_string(), y, x)
    } else {
        y
    }
}

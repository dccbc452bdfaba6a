//! EfficientNet B0–B7 (Tan & Le 2019) and EfficientNetV2 S/M/L (2021) as torchvision builds
//! them: MBConv blocks (expand 1×1, depthwise k×k, squeeze-and-excitation with SiLU and a
//! sigmoid scale, project 1×1), V2's fused MBConv blocks (k×k expand, 1×1 project), SiLU
//! everywhere, widths and depths scaled per variant, stochastic depth (an identity at
//! inference, so not in the graph), dropout before the classifier.

use super::mobilenet::{conv_norm_act, make_divisible, squeeze_excitation};
use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, Unary};

/// One stage of torchvision's `MBConvConfig` / `FusedMBConvConfig`: whether it is fused,
/// expand ratio, kernel, stride, input channels, output channels, blocks.
type Stage = (bool, usize, usize, usize, usize, usize, usize);

/// EfficientNet B0's stages (B1–B7 scale them).
const B0: [Stage; 7] = [
    (false, 1, 3, 1, 32, 16, 1),
    (false, 6, 3, 2, 16, 24, 2),
    (false, 6, 5, 2, 24, 40, 2),
    (false, 6, 3, 2, 40, 80, 3),
    (false, 6, 5, 1, 80, 112, 3),
    (false, 6, 5, 2, 112, 192, 4),
    (false, 6, 3, 1, 192, 320, 1),
];

/// EfficientNetV2 (Tan & Le 2021): fused MBConv blocks (one k×k expansion, no depthwise) in
/// the first stages; S, M and L.
const V2_S: [Stage; 6] = [
    (true, 1, 3, 1, 24, 24, 2),
    (true, 4, 3, 2, 24, 48, 4),
    (true, 4, 3, 2, 48, 64, 4),
    (false, 4, 3, 2, 64, 128, 6),
    (false, 6, 3, 1, 128, 160, 9),
    (false, 6, 3, 2, 160, 256, 15),
];
const V2_M: [Stage; 7] = [
    (true, 1, 3, 1, 24, 24, 3),
    (true, 4, 3, 2, 24, 48, 5),
    (true, 4, 3, 2, 48, 80, 5),
    (false, 4, 3, 2, 80, 160, 7),
    (false, 6, 3, 1, 160, 176, 14),
    (false, 6, 3, 2, 176, 304, 18),
    (false, 6, 3, 1, 304, 512, 5),
];
const V2_L: [Stage; 7] = [
    (true, 1, 3, 1, 32, 32, 4),
    (true, 4, 3, 2, 32, 64, 7),
    (true, 4, 3, 2, 64, 96, 7),
    (false, 4, 3, 2, 96, 192, 10),
    (false, 6, 3, 1, 192, 224, 19),
    (false, 6, 3, 2, 224, 384, 25),
    (false, 6, 3, 1, 384, 640, 7),
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
    multipliers: (f64, f64),
    (dropout, input_size, eps): (f32, usize, f32),
    classes: usize,
) -> Graph {
    let head = (None, dropout, input_size, eps);
    efficientnet(name, &B0, multipliers, head, classes)
}

/// torchvision's EfficientNetV2 S, M and L: their stages, dropout and input size.
pub(super) fn v2(name: &str) -> Option<Graph> {
    let (stages, dropout, size): (&[Stage], f32, usize) = match name {
        "efficientnet_v2_s" => (&V2_S, 0.2, 384),
        "efficientnet_v2_m" => (&V2_M, 0.3, 480),
        "efficientnet_v2_l" => (&V2_L, 0.4, 480),
        _ => return None,
    };
    let head = (Some(1280), dropout, size, 1e-3);
    Some(efficientnet(name, stages, (1.0, 1.0), head, 1000))
}

/// torchvision's `EfficientNet` class: the stem, the stages, the last 1×1 convolution to
/// `last` channels (four times the last stage's by default) and the classifier.
fn efficientnet(
    name: &str,
    stages: &[Stage],
    (width, depth): (f64, f64),
    (last, dropout, input_size, eps): (Option<usize>, f32, usize, f32),
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
    let stem = adjust(stages[0].4);
    let mut x = conv_norm_act(
        &mut g,
        "features.0",
        x,
        Conv2d::new(3, stem, 3, 2, 1),
        (eps, SILU),
    );
    for (s, &(fused, expand, k, stride, cin, cout, blocks)) in stages.iter().enumerate() {
        let (cin, cout) = (adjust(cin), adjust(cout));
        let blocks = (blocks as f64 * depth).ceil() as usize;
        for i in 0..blocks {
            let (cin, stride) = if i == 0 { (cin, stride) } else { (cout, 1) };
            let p = format!("features.{}.{i}", s + 1);
            let shape = (cin, cout, expand, k, stride);
            x = if fused {
                fused_mbconv(&mut g, &p, x, shape, eps)
            } else {
                mbconv(&mut g, &p, x, shape, eps)
            };
        }
    }
    let cin = adjust(stages[stages.len() - 1].5);
    let last = last.unwrap_or(4 * cin);
    let x = conv_norm_act(
        &mut g,
        &format!("features.{}", stages.len() + 1),
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

/// One fused MBConv block (EfficientNetV2): a k×k expansion and a 1×1 projection, or a single
/// k×k convolution when it does not expand; the residual add when the shape stays.
fn fused_mbconv(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (cin, cout, expand, k, stride): (usize, usize, usize, usize, usize),
    eps: f32,
) -> ValueId {
    let exp = make_divisible((cin * expand) as f64, 8);
    let conv = |a, b| Conv2d::new(a, b, k, stride, (k - 1) / 2);
    let y = if exp != cin {
        let y = conv_norm_act(g, &format!("{p}.block.0"), x, conv(cin, exp), (eps, SILU));
        let project = Conv2d::new(exp, cout, 1, 1, 0);
        conv_norm_act(g, &format!("{p}.block.1"), y, project, (eps, None))
    } else {
        conv_norm_act(g, &format!("{p}.block.0"), x, conv(cin, cout), (eps, SILU))
    };
    if stride == 1 && cin == cout {
        g.add(format!("{p}.add"), y, x)
    } else {
        y
    }
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
        g.add(format!("{p}.add"), y, x)
    } else {
        y
    }
}

//! MobileNetV2 (Sandler et al. 2018) as torchvision builds it: inverted residual blocks of
//! expand 1×1 → depthwise 3×3 → project 1×1, ReLU6, channel counts rounded to multiples of 8.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op};

/// torchvision's `_make_divisible`: round to a multiple of 8 without losing more than 10%.
pub(super) fn make_divisible(v: f64, divisor: usize) -> usize {
    let d = divisor as f64;
    let mut new_v = (divisor).max(((v + d / 2.0) as usize) / divisor * divisor);
    if (new_v as f64) < 0.9 * v {
        new_v += divisor;
    }
    new_v
}

/// torchvision's Conv2dNormActivation: conv (no bias) → batch norm (`eps`) → `act` when there
/// is one, as `{p}.0`, `{p}.1`, `{p}.2` (MobileNetV2 and V3, EfficientNet, RegNet).
pub(super) fn conv_norm_act(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    conv: Conv2d,
    norm_act: (f32, Option<Op>),
) -> ValueId {
    conv_norm_act_at(g, (p, 0), x, conv, norm_act)
}

/// [`conv_norm_act`] numbered from `first` within `p`: `{p}.{first}`, `{p}.{first + 1}`, … (a
/// flat Sequential such as MNASNet's `layers`).
pub(super) fn conv_norm_act_at(
    g: &mut GraphBuilder,
    (p, first): (&str, usize),
    x: ValueId,
    conv: Conv2d,
    (eps, act): (f32, Option<Op>),
) -> ValueId {
    let channels = conv.out_channels;
    let x = g.conv(format!("{p}.{first}"), x, conv);
    let bn = Op::BatchNorm { channels, eps };
    let x = g.add_node(format!("{p}.{}", first + 1), bn, &[x]);
    match act {
        Some(op) => g.add_node(format!("{p}.{}", first + 2), op, &[x]),
        None => x,
    }
}

/// torchvision's `SqueezeExcitation` at `s` over `x`: average pool, `fc1` (a 1×1 convolution
/// with bias) to `squeeze` channels, `act`, `fc2` back, `gate`, and the channel scaling
/// (MobileNetV3, EfficientNet, RegNetY).
pub(super) fn squeeze_excitation(
    g: &mut GraphBuilder,
    s: &str,
    x: ValueId,
    (channels, squeeze): (usize, usize),
    (act, gate): (Op, Op),
) -> ValueId {
    let fc = |a, b| Conv2d::new(a, b, 1, 1, 0).with_bias();
    let scale = g.adaptive_avg_pool(format!("{s}.avgpool"), x, (1, 1));
    let scale = g.conv(format!("{s}.fc1"), scale, fc(channels, squeeze));
    let scale = g.add_node(format!("{s}.activation"), act, &[scale]);
    let scale = g.conv(format!("{s}.fc2"), scale, fc(squeeze, channels));
    let scale = g.add_node(format!("{s}.scale_activation"), gate, &[scale]);
    g.add_node(format!("{s}.scale"), Op::ScaleChannels, &[x, scale])
}

/// MobileNetV2's batch norm and activation.
const RELU6: (f32, Option<Op>) = (1e-5, Some(Op::Relu6));

/// MobileNetV2 with a width multiplier (1.0 is the zoo's `mobilenet_v2`).
pub fn mobilenet_v2_custom(name: &str, width_mult: f64, classes: usize) -> Graph {
    const SETTINGS: [(usize, usize, usize, usize); 7] = [
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    ];
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::Normal001,
    );
    let mut input_channel = make_divisible(32.0 * width_mult, 8);
    let last_channel = make_divisible(1280.0 * width_mult.max(1.0), 8);
    let x = g.input();
    let mut x = conv_norm_act(
        &mut g,
        "features.0",
        x,
        Conv2d::new(3, input_channel, 3, 2, 1),
        RELU6,
    );
    let mut idx = 1;
    for (t, c, n, s) in SETTINGS {
        let out = make_divisible(c as f64 * width_mult, 8);
        for i in 0..n {
            let stride = if i == 0 { s } else { 1 };
            let p = format!("features.{idx}.conv");
            let hidden = (input_channel as f64 * t as f64).round() as usize;
            let mut y = x;
            let mut j = 0;
            if t != 1 {
                y = conv_norm_act(
                    &mut g,
                    &format!("{p}.{j}"),
                    y,
                    Conv2d::new(input_channel, hidden, 1, 1, 0),
                    RELU6,
                );
                j += 1;
            }
            let dw = Conv2d::new(hidden, hidden, 3, stride, 1).with_groups(hidden);
            y = conv_norm_act(&mut g, &format!("{p}.{j}"), y, dw, RELU6);
            y = g.conv(
                format!("{p}.{}", j + 1),
                y,
                Conv2d::new(hidden, out, 1, 1, 0),
            );
            y = g.bn(format!("{p}.{}", j + 2), y, out);
            if stride == 1 && input_channel == out {
                y = g.add(format!("features.{idx}.add"), x, y);
            }
            x = y;
            input_channel = out;
            idx += 1;
        }
    }
    let x = conv_norm_act(
        &mut g,
        &format!("features.{idx}"),
        x,
        Conv2d::new(input_channel, last_channel, 1, 1, 0),
        RELU6,
    );
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.dropout("classifier.0", x, 0.2);
    let x = g.linear("classifier.1", x, last_channel, classes);
    g.finish(x)
}

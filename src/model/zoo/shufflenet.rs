//! ShuffleNetV2 (Ma et al. 2018) as torchvision builds it: a 3×3 stem and max pool, three
//! stages of units that split the channels in two (or, when they downsample, feed both
//! branches the whole input), run one half through 1×1 → depthwise 3×3 → 1×1, concatenate and
//! shuffle the two halves, then a 1×1 convolution, the spatial mean and the classifier.

use super::mobilenet::conv_norm_act_at;
use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, Pool};

/// torchvision's variants: the channels of the stem, the three stages and `conv5`.
pub(super) fn variant(name: &str) -> Option<[usize; 5]> {
    Some(match name {
        "shufflenet_v2_x0_5" => [24, 48, 96, 192, 1024],
        "shufflenet_v2_x1_0" => [24, 116, 232, 464, 1024],
        "shufflenet_v2_x1_5" => [24, 176, 352, 704, 1024],
        "shufflenet_v2_x2_0" => [24, 244, 488, 976, 2048],
        _ => return None,
    })
}

const RELU: (f32, Option<Op>) = (1e-5, Some(Op::Relu));
const LINEAR: (f32, Option<Op>) = (1e-5, None);

/// ShuffleNetV2 with these units per stage (torchvision: 4, 8, 4) and channels.
pub fn shufflenet_v2_custom(
    name: &str,
    repeats: [usize; 3],
    channels: [usize; 5],
    classes: usize,
) -> Graph {
    let mut g = GraphBuilder::new(name, 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let stem = Conv2d::new(3, channels[0], 3, 2, 1);
    let x = conv_norm_act_at(&mut g, ("conv1", 0), x, stem, RELU);
    let mut x = g.max_pool("maxpool", x, Pool::new(3, 2, 1));
    let mut cin = channels[0];
    for (s, repeats) in repeats.into_iter().enumerate() {
        let cout = channels[s + 1];
        for u in 0..repeats {
            let p = format!("stage{}.{u}", s + 2);
            x = unit(&mut g, &p, x, (cin, cout), if u == 0 { 2 } else { 1 });
            cin = cout;
        }
    }
    let last = channels[4];
    let x = conv_norm_act_at(
        &mut g,
        ("conv5", 0),
        x,
        Conv2d::new(cin, last, 1, 1, 0),
        RELU,
    );
    let x = g.adaptive_avg_pool("mean", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.linear("fc", x, last, classes);
    g.finish(x)
}

/// One `InvertedResidual` unit at `p`: `branch1` (downsampling units only) and `branch2`,
/// the concatenation and the shuffle in two groups.
fn unit(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (cin, cout): (usize, usize),
    stride: usize,
) -> ValueId {
    let half = cout / 2;
    let depthwise = |c: usize| Conv2d::new(c, c, 3, stride, 1).with_groups(c);
    let (left, right, right_in) = if stride > 1 {
        let b1 = format!("{p}.branch1");
        let y = conv_norm_act_at(g, (&b1, 0), x, depthwise(cin), LINEAR);
        let y = conv_norm_act_at(g, (&b1, 2), y, Conv2d::new(cin, half, 1, 1, 0), RELU);
        (y, x, cin)
    } else {
        let lo = Op::ChannelSlice {
            start: 0,
            count: half,
        };
        let hi = Op::ChannelSlice {
            start: half,
            count: half,
        };
        let a = g.add_node(format!("{p}.chunk0"), lo, &[x]);
        let b = g.add_node(format!("{p}.chunk1"), hi, &[x]);
        (a, b, half)
    };
    let b2 = format!("{p}.branch2");
    let y = conv_norm_act_at(
        g,
        (&b2, 0),
        right,
        Conv2d::new(right_in, half, 1, 1, 0),
        RELU,
    );
    let y = conv_norm_act_at(g, (&b2, 3), y, depthwise(half), LINEAR);
    let y = conv_norm_act_at(g, (&b2, 5), y, Conv2d::new(half, half, 1, 1, 0), RELU);
    let y = g.add_node(format!("{p}.cat"), Op::Concat { parts: 2 }, &[left, y]);
    g.add_node(
        format!("{p}.shuffle"),
        Op::ChannelShuffle { groups: 2 },
        &[y],
    )
}

//! ResNet (He et al. 2015) as torchvision builds it: a 7×7 stem, four stages of basic or
//! bottleneck blocks with `downsample.0/1` shortcuts, global average pooling and `fc`; with
//! grouped 3×3 convolutions it is ResNeXt (Xie et al. 2017), with wider ones Wide ResNet
//! (Zagoruyko & Komodakis 2016) — torchvision's `groups` and `width_per_group`.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Pool};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// Two 3×3 convolutions (resnet18/34), expansion 1.
    Basic,
    /// 1×1 → 3×3 → 1×1 (resnet50/101/152), expansion 4; the stride sits on the 3×3 (v1.5).
    Bottleneck,
}

impl Block {
    fn expansion(self) -> usize {
        match self {
            Block::Basic => 1,
            Block::Bottleneck => 4,
        }
    }
}

/// The knobs of torchvision's `ResNet` class, with stage widths exposed so the tests can build
/// a narrow network that matches a small PyTorch fixture.
#[derive(Debug, Clone)]
pub struct ResNetConfig {
    pub block: Block,
    pub layers: [usize; 4],
    /// Planes of the stem and of each stage (torchvision: 64 and [64, 128, 256, 512]).
    pub stem: usize,
    pub widths: [usize; 4],
    pub classes: usize,
    /// Groups of the bottleneck's 3×3 convolution (ResNeXt's cardinality; 1 otherwise).
    pub groups: usize,
    /// Channels per group of the bottleneck's inner width (torchvision's `width_per_group`:
    /// 64 for ResNet, 4 or 8 for ResNeXt, 128 for Wide ResNet).
    pub width_per_group: usize,
}

pub(super) fn resnet(name: &str, block: Block, layers: [usize; 4]) -> Graph {
    resnext(name, layers, 1, 64, block)
}

/// torchvision's ResNet class with its `groups` and `width_per_group`.
pub(super) fn resnext(
    name: &str,
    layers: [usize; 4],
    groups: usize,
    width_per_group: usize,
    block: Block,
) -> Graph {
    resnet_custom(
        name,
        &ResNetConfig {
            block,
            layers,
            stem: 64,
            widths: [64, 128, 256, 512],
            classes: 1000,
            groups,
            width_per_group,
        },
    )
}

pub fn resnet_custom(name: &str, cfg: &ResNetConfig) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let x = g.conv("conv1", x, Conv2d::new(3, cfg.stem, 7, 2, 3));
    let x = g.bn("bn1", x, cfg.stem);
    let x = g.relu("relu", x);
    let mut x = g.max_pool("maxpool", x, Pool::new(3, 2, 1));
    let mut inplanes = cfg.stem;
    for (stage, (&planes, &blocks)) in cfg.widths.iter().zip(&cfg.layers).enumerate() {
        let stride = if stage == 0 { 1 } else { 2 };
        for b in 0..blocks {
            let prefix = format!("layer{}.{}", stage + 1, b);
            let s = if b == 0 { stride } else { 1 };
            x = block_forward(&mut g, &prefix, x, cfg, inplanes, planes, s);
            inplanes = planes * cfg.block.expansion();
        }
    }
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.linear("fc", x, inplanes, cfg.classes);
    g.finish(x)
}

fn block_forward(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    cfg: &ResNetConfig,
    inplanes: usize,
    planes: usize,
    stride: usize,
) -> ValueId {
    let out_ch = planes * cfg.block.expansion();
    // torchvision: width = int(planes * (base_width / 64.)) * groups.
    let width = planes * cfg.width_per_group / 64 * cfg.groups;
    let y = match cfg.block {
        Block::Basic => {
            let y = g.conv(
                format!("{p}.conv1"),
                x,
                Conv2d::new(inplanes, planes, 3, stride, 1),
            );
            let y = g.bn(format!("{p}.bn1"), y, planes);
            let y = g.relu(format!("{p}.relu"), y);
            let y = g.conv(
                format!("{p}.conv2"),
                y,
                Conv2d::new(planes, planes, 3, 1, 1),
            );
            g.bn(format!("{p}.bn2"), y, planes)
        }
        Block::Bottleneck => {
            let y = g.conv(
                format!("{p}.conv1"),
                x,
                Conv2d::new(inplanes, width, 1, 1, 0),
            );
            let y = g.bn(format!("{p}.bn1"), y, width);
            let y = g.relu(format!("{p}.relu"), y);
            let y = g.conv(
                format!("{p}.conv2"),
                y,
                Conv2d::new(width, width, 3, stride, 1).with_groups(cfg.groups),
            );
            let y = g.bn(format!("{p}.bn2"), y, width);
            let y = g.relu(format!("{p}.relu"), y);
            let y = g.conv(format!("{p}.conv3"), y, Conv2d::new(width, out_ch, 1, 1, 0));
            g.bn(format!("{p}.bn3"), y, out_ch)
        }
    };
    let shortcut = if stride != 1 || inplanes != out_ch {
        let s = g.conv(
            format!("{p}.downsample.0"),
            x,
            Conv2d::new(inplanes, out_ch, 1, stride, 0),
        );
        g.bn(format!("{p}.downsample.1"), s, out_ch)
    } else {
        x
    };
    let y = g.add(format!("{p}.add"), y, shortcut);
    g.relu(format!("{p}.relu"), y)
}

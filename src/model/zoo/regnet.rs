//! RegNetX and RegNetY (Radosavovic et al. 2020) as torchvision builds them: a 3×3 stem, then
//! stages of residual bottleneck blocks (1×1 → grouped 3×3 → 1×1, squeeze-and-excitation in
//! RegNetY) whose widths follow a quantised linear rule in four numbers (depth, w₀, wₐ, wₘ).

use super::mobilenet::{conv_norm_act, make_divisible, squeeze_excitation};
use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op};

/// The four numbers of a RegNet design, its group width, and whether its blocks have
/// squeeze-and-excitation (ratio 1/4: RegNetY) — torchvision's `BlockParams.from_init_params`.
#[derive(Debug, Clone, Copy)]
pub struct RegNetConfig {
    pub depth: usize,
    pub w_0: usize,
    pub w_a: f32,
    pub w_m: f32,
    pub group_width: usize,
    pub se: bool,
}

/// torchvision's fifteen designs.
pub(super) fn variant(name: &str) -> Option<RegNetConfig> {
    let (depth, w_0, w_a, w_m, group_width) = match name {
        "regnet_y_400mf" => (16, 48, 27.89, 2.09, 8),
        "regnet_y_800mf" => (14, 56, 38.84, 2.4, 16),
        "regnet_y_1_6gf" => (27, 48, 20.71, 2.65, 24),
        "regnet_y_3_2gf" => (21, 80, 42.63, 2.66, 24),
        "regnet_y_8gf" => (17, 192, 76.82, 2.19, 56),
        "regnet_y_16gf" => (18, 200, 106.23, 2.48, 112),
        "regnet_y_32gf" => (20, 232, 115.89, 2.53, 232),
        "regnet_y_128gf" => (27, 456, 160.83, 2.52, 264),
        "regnet_x_400mf" => (22, 24, 24.48, 2.54, 16),
        "regnet_x_800mf" => (16, 56, 35.73, 2.28, 16),
        "regnet_x_1_6gf" => (18, 80, 34.01, 2.25, 24),
        "regnet_x_3_2gf" => (25, 88, 26.31, 2.25, 48),
        "regnet_x_8gf" => (23, 80, 49.56, 2.88, 120),
        "regnet_x_16gf" => (22, 216, 55.59, 2.1, 128),
        "regnet_x_32gf" => (23, 320, 69.86, 2.0, 168),
        _ => return None,
    };
    Some(RegNetConfig {
        depth,
        w_0,
        w_a,
        w_m,
        group_width,
        se: name.starts_with("regnet_y"),
    })
}

impl RegNetConfig {
    /// (width, blocks, group width) per stage. The block widths are computed in f32 with
    /// ties rounded to even, as torchvision's tensors do, so every width matches its own.
    pub fn stages(&self) -> Vec<(usize, usize, usize)> {
        let w_0 = self.w_0 as f32;
        let log_m = (self.w_m as f64).ln() as f32;
        let widths = (0..self.depth).map(|i| {
            let cont = i as f32 * self.w_a + w_0;
            let capacity = ((cont / w_0).ln() / log_m).round_ties_even();
            let w = (w_0 * self.w_m.powf(capacity) / 8.0).round_ties_even() * 8.0;
            w as usize
        });
        let mut stages: Vec<(usize, usize, usize)> = Vec::new();
        for w in widths {
            match stages.last_mut() {
                Some((last, blocks, _)) if *last == w => *blocks += 1,
                _ => stages.push((w, 1, 0)),
            }
        }
        // Widths and group widths made compatible (bottleneck multiplier 1).
        for (w, _, g) in &mut stages {
            *g = self.group_width.min(*w);
            *w = make_divisible(*w as f64, *g);
        }
        stages
    }
}

const RELU: (f32, Option<Op>) = (1e-5, Some(Op::Relu));
const LINEAR: (f32, Option<Op>) = (1e-5, None);

/// A RegNet with torchvision's 32-channel stem.
pub fn regnet_custom(name: &str, cfg: &RegNetConfig, classes: usize) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::Normal001,
    );
    let x = g.input();
    let stem = 32;
    let mut x = conv_norm_act(&mut g, "stem", x, Conv2d::new(3, stem, 3, 2, 1), RELU);
    let mut width_in = stem;
    for (s, (width, blocks, group_width)) in cfg.stages().into_iter().enumerate() {
        for b in 0..blocks {
            let p = format!("trunk_output.block{0}.block{0}-{b}", s + 1);
            let stride = if b == 0 { 2 } else { 1 };
            let widths = (width_in, width, group_width);
            x = block(&mut g, &p, x, widths, stride, cfg.se);
            width_in = width;
        }
    }
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.linear("fc", x, width_in, classes);
    g.finish(x)
}

/// One `ResBottleneckBlock`: `f.a`, `f.b`, `f.se`, `f.c`, the `proj` shortcut when the shape
/// changes, the add and the ReLU.
fn block(
    g: &mut GraphBuilder,
    p: &str,
    x: ValueId,
    (width_in, width, group_width): (usize, usize, usize),
    stride: usize,
    se: bool,
) -> ValueId {
    let f = format!("{p}.f");
    let y = conv_norm_act(
        g,
        &format!("{f}.a"),
        x,
        Conv2d::new(width_in, width, 1, 1, 0),
        RELU,
    );
    let grouped = Conv2d::new(width, width, 3, stride, 1).with_groups(width / group_width);
    let mut y = conv_norm_act(g, &format!("{f}.b"), y, grouped, RELU);
    if se {
        // A quarter of the block's input width, rounded as Python's `round`.
        let squeeze = (width_in as f64 * 0.25).round_ties_even() as usize;
        let ops = (Op::Relu, Op::Sigmoid);
        y = squeeze_excitation(g, &format!("{f}.se"), y, (width, squeeze), ops);
    }
    let y = conv_norm_act(
        g,
        &format!("{f}.c"),
        y,
        Conv2d::new(width, width, 1, 1, 0),
        LINEAR,
    );
    let shortcut = if width_in != width || stride != 1 {
        let proj = Conv2d::new(width_in, width, 1, stride, 0);
        conv_norm_act(g, &format!("{p}.proj"), x, proj, LINEAR)
    } else {
        x
    };
    let y = g.add(format!("{p}.add"), shortcut, y);
    g.relu(format!("{p}.activation"), y)
}

//! Vision Transformer (Dosovitskiy et al. 2020) as torchvision builds it: a patch convolution
//! (`conv_proj`), the class token, `encoder.pos_embedding`, pre-norm encoder blocks
//! (`encoder.layers.encoder_layer_{i}`: `ln_1`, `self_attention`, `ln_2`, `mlp.0`/`mlp.3`),
//! `encoder.ln`, and `heads.head` on the class token.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit};
use crate::model::op::{Conv2d, Op};

/// torchvision's `VisionTransformer` knobs, exposed so tests can build a small one.
#[derive(Debug, Clone)]
pub struct VitConfig {
    pub image_size: usize,
    pub patch: usize,
    pub layers: usize,
    pub heads: usize,
    pub hidden: usize,
    pub mlp: usize,
    pub classes: usize,
}

impl VitConfig {
    /// The tests' small ViT: 32×32 images in 8×8 patches (17 tokens), two blocks of two heads
    /// of 8, an MLP of 32, ten classes.
    pub fn small() -> Self {
        VitConfig {
            image_size: 32,
            patch: 8,
            layers: 2,
            heads: 2,
            hidden: 16,
            mlp: 32,
            classes: 10,
        }
    }
}

/// torchvision's `vit_*` with 1000 classes at 224×224.
pub(super) fn vit(
    name: &str,
    patch: usize,
    layers: usize,
    heads: usize,
    hidden: usize,
    mlp: usize,
) -> Graph {
    vit_custom(
        name,
        &VitConfig {
            image_size: 224,
            patch,
            layers,
            heads,
            hidden,
            mlp,
            classes: 1000,
        },
    )
}

pub fn vit_custom(name: &str, cfg: &VitConfig) -> Graph {
    let mut g = GraphBuilder::new(name, 3, ConvInit::TruncNormalFanIn, LinearInit::Vit);
    g.input_size(cfg.image_size);
    let d = cfg.hidden;
    let x = g.input();
    let patches = Conv2d {
        bias: true,
        ..Conv2d::new(3, d, cfg.patch, cfg.patch, 0)
    };
    let x = g.conv("conv_proj", x, patches);
    let x = g.add_node("tokens", Op::Tokens, &[x]);
    let x = g.add_node("class_token", Op::ClassToken { dim: d }, &[x]);
    let side = cfg.image_size / cfg.patch;
    let pos = Op::PosEmbed {
        tokens: side * side + 1,
        dim: d,
        image_size: cfg.image_size,
    };
    let x = g.add_node("encoder.pos_embedding", pos, &[x]);
    let mut x = g.dropout("encoder.dropout", x, 0.0);
    let norm =
        |g: &mut GraphBuilder, name: String, x| g.add_node(name, Op::layer_norm(d, 1e-6), &[x]);
    for i in 0..cfg.layers {
        let p = format!("encoder.layers.encoder_layer_{i}");
        let y = norm(&mut g, format!("{p}.ln_1"), x);
        let attention = Op::Attention {
            dim: d,
            heads: cfg.heads,
            residual: false,
        };
        let y = g.add_node(format!("{p}.self_attention"), attention, &[y]);
        let y = g.dropout(format!("{p}.dropout"), y, 0.0);
        let x1 = g.add(format!("{p}.add1"), y, x);
        let y = norm(&mut g, format!("{p}.ln_2"), x1);
        let y = g.linear(format!("{p}.mlp.0"), y, d, cfg.mlp);
        let y = g.add_node(format!("{p}.mlp.1"), Op::Gelu, &[y]);
        let y = g.dropout(format!("{p}.mlp.2"), y, 0.0);
        let y = g.linear(format!("{p}.mlp.3"), y, cfg.mlp, d);
        let y = g.dropout(format!("{p}.mlp.4"), y, 0.0);
        x = g.add(format!("{p}.add2"), y, x1);
    }
    let x = norm(&mut g, "encoder.ln".into(), x);
    let x = g.add_node("select_token", Op::SelectToken { index: 0 }, &[x]);
    let x = g.linear("heads.head", x, d, cfg.classes);
    g.finish(x)
}

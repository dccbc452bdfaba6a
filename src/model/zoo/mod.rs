//! The model zoo: torchvision's classification networks, rebuilt node by node with the same
//! module and parameter names, so a torchvision `state_dict` saved as safetensors loads as is.

mod alexnet;
mod convnext;
mod efficientnet;
mod mobilenet;
mod mobilenet_v3;
mod regnet;
mod resnet;
mod vgg;
mod vit;

pub use convnext::convnext_custom;
pub use efficientnet::efficientnet_custom;
pub use mobilenet::mobilenet_v2_custom;
pub use mobilenet_v3::mobilenet_v3_custom;
pub use regnet::{RegNetConfig, regnet_custom};
pub use resnet::{Block, ResNetConfig, resnet_custom};
pub use vit::{VitConfig, vit_custom};

use super::Graph;

/// Every network `--network` accepts, in the order `workshop models` lists them.
pub const NETWORKS: &[&str] = &[
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "resnext101_64x4d",
    "wide_resnet50_2",
    "wide_resnet101_2",
    "vgg11",
    "vgg11_bn",
    "vgg13",
    "vgg13_bn",
    "vgg16",
    "vgg16_bn",
    "vgg19",
    "vgg19_bn",
    "alexnet",
    "mobilenet_v2",
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "efficientnet_b1",
    "efficientnet_b2",
    "efficientnet_b3",
    "efficientnet_b4",
    "efficientnet_b5",
    "efficientnet_b6",
    "efficientnet_b7",
    "vit_b_16",
    "vit_b_32",
    "vit_l_16",
    "vit_l_32",
    "vit_h_14",
    "convnext_tiny",
    "convnext_small",
    "convnext_base",
    "convnext_large",
    "regnet_y_400mf",
    "regnet_y_800mf",
    "regnet_y_1_6gf",
    "regnet_y_3_2gf",
    "regnet_y_8gf",
    "regnet_y_16gf",
    "regnet_y_32gf",
    "regnet_y_128gf",
    "regnet_x_400mf",
    "regnet_x_800mf",
    "regnet_x_1_6gf",
    "regnet_x_3_2gf",
    "regnet_x_8gf",
    "regnet_x_16gf",
    "regnet_x_32gf",
];

/// A network name that the zoo does not have.
#[derive(Debug, thiserror::Error)]
#[error("unknown network `{name}`; the zoo has: {}", NETWORKS.join(", "))]
pub struct UnknownNetwork {
    pub name: String,
}

/// Build a zoo network with 1000 ImageNet classes.
pub fn build(name: &str) -> Result<Graph, UnknownNetwork> {
    let graph = match name {
        "resnet18" => resnet::resnet(name, Block::Basic, [2, 2, 2, 2]),
        "resnet34" => resnet::resnet(name, Block::Basic, [3, 4, 6, 3]),
        "resnet50" => resnet::resnet(name, Block::Bottleneck, [3, 4, 6, 3]),
        "resnet101" => resnet::resnet(name, Block::Bottleneck, [3, 4, 23, 3]),
        "resnet152" => resnet::resnet(name, Block::Bottleneck, [3, 8, 36, 3]),
        "resnext50_32x4d" => resnet::resnext(name, [3, 4, 6, 3], 32, 4, Block::Bottleneck),
        "resnext101_32x8d" => resnet::resnext(name, [3, 4, 23, 3], 32, 8, Block::Bottleneck),
        "resnext101_64x4d" => resnet::resnext(name, [3, 4, 23, 3], 64, 4, Block::Bottleneck),
        "wide_resnet50_2" => resnet::resnext(name, [3, 4, 6, 3], 1, 128, Block::Bottleneck),
        "wide_resnet101_2" => resnet::resnext(name, [3, 4, 23, 3], 1, 128, Block::Bottleneck),
        "alexnet" => alexnet::alexnet(1000),
        "mobilenet_v2" => mobilenet::mobilenet_v2_custom(name, 1.0, 1000),
        "mobilenet_v3_large" => mobilenet_v3::mobilenet_v3_custom(name, true, 1.0, 1000),
        "mobilenet_v3_small" => mobilenet_v3::mobilenet_v3_custom(name, false, 1.0, 1000),
        "vit_b_16" => vit::vit(name, 16, 12, 12, 768, 3072),
        "vit_b_32" => vit::vit(name, 32, 12, 12, 768, 3072),
        "vit_l_16" => vit::vit(name, 16, 24, 16, 1024, 4096),
        "vit_l_32" => vit::vit(name, 32, 24, 16, 1024, 4096),
        "vit_h_14" => vit::vit(name, 14, 32, 16, 1280, 5120),
        _ if convnext::variant(name).is_some() => {
            let (widths, depths) = convnext::variant(name).expect("checked");
            convnext::convnext_custom(name, widths, depths, 1000)
        }
        _ if regnet::variant(name).is_some() => {
            let cfg = regnet::variant(name).expect("checked");
            regnet::regnet_custom(name, &cfg, 1000)
        }
        _ if name.starts_with("efficientnet_b") => {
            let b = name["efficientnet_b".len()..].parse::<usize>().ok();
            match b.and_then(efficientnet::variant) {
                Some((w, d, dropout, size, eps)) => {
                    efficientnet::efficientnet_custom(name, (w, d), (dropout, size, eps), 1000)
                }
                None => {
                    return Err(UnknownNetwork {
                        name: name.to_string(),
                    });
                }
            }
        }
        _ => {
            let (base, bn) = match name.strip_suffix("_bn") {
                Some(base) => (base, true),
                None => (name, false),
            };
            match base {
                "vgg11" | "vgg13" | "vgg16" | "vgg19" => vgg::vgg(name, base, bn, 1000),
                _ => {
                    return Err(UnknownNetwork {
                        name: name.to_string(),
                    });
                }
            }
        }
    };
    Ok(graph)
}

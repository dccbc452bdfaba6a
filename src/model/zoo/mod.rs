//! The model zoo: torchvision's classification networks, rebuilt node by node with the same
//! module and parameter names, so a torchvision `state_dict` saved as safetensors loads as is.

mod alexnet;
mod convnext;
mod densenet;
mod efficientnet;
mod inception;
pub mod layer;
mod maxvit;
mod mnasnet;
mod mobilenet;
mod mobilenet_v3;
mod regnet;
mod resnet;
mod shufflenet;
mod squeezenet;
mod swin;
mod vgg;
mod vit;

pub use convnext::convnext_custom;
pub use densenet::densenet_custom;
pub use efficientnet::efficientnet_custom;
pub use maxvit::{MaxVitConfig, maxvit_custom};
pub use mnasnet::mnasnet_custom;
pub use mobilenet::mobilenet_v2_custom;
pub use mobilenet_v3::mobilenet_v3_custom;
pub use regnet::{RegNetConfig, regnet_custom};
pub use resnet::{Block, ResNetConfig, resnet_custom};
pub use shufflenet::shufflenet_v2_custom;
pub use squeezenet::squeezenet_custom;
pub use swin::swin_custom;
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
    "efficientnet_v2_s",
    "efficientnet_v2_m",
    "efficientnet_v2_l",
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
    "mnasnet0_5",
    "mnasnet0_75",
    "mnasnet1_0",
    "mnasnet1_3",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "squeezenet1_0",
    "squeezenet1_1",
    "shufflenet_v2_x0_5",
    "shufflenet_v2_x1_0",
    "shufflenet_v2_x1_5",
    "shufflenet_v2_x2_0",
    "googlenet",
    "inception_v3",
    "swin_t",
    "swin_s",
    "swin_b",
    "swin_v2_t",
    "swin_v2_s",
    "swin_v2_b",
    "maxvit_t",
];

/// A network name that the zoo does not have, or a layer chain that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum UnknownNetwork {
    #[error("unknown network `{name}`{}; `workshop models` lists all {} networks, and one layer \
             is written as PyTorch makes it: `conv2d(64, 64, 3, padding=1)+relu`",
             suggest(name), NETWORKS.len())]
    Unknown { name: String },
    #[error("layer chain `{spec}`: {why}")]
    Layer { spec: String, why: String },
}

/// ": did you mean `resnet50`?": the zoo's names fewest edits away from `name` (at most two,
/// or a quarter of its length; case ignored), up to three of them, or nothing.
fn suggest(name: &str) -> String {
    let name = name.to_lowercase();
    let within = 2.max(name.chars().count() / 4);
    let mut close: Vec<(usize, &str)> = NETWORKS
        .iter()
        .map(|n| (strsim::levenshtein(&name, n), *n))
        .filter(|&(d, _)| d <= within)
        .collect();
    close.sort();
    let best = close.first().map_or(0, |c| c.0);
    let names: Vec<String> = (close.iter())
        .filter(|c| c.0 == best)
        .take(3)
        .map(|(_, n)| format!("`{n}`"))
        .collect();
    match names.as_slice() {
        [] => String::new(),
        [one] => format!(" (did you mean {one}?)"),
        [first @ .., last] => format!(" (did you mean {} or {last}?)", first.join(", ")),
    }
}

/// Build a zoo network with 1000 ImageNet classes, or a chain of layers ([`layer`]).
pub fn build(name: &str) -> Result<Graph, UnknownNetwork> {
    if layer::is_layer_spec(name) {
        return layer::build(name).map_err(|why| UnknownNetwork::Layer {
            spec: name.to_string(),
            why,
        });
    }
    let unknown = || UnknownNetwork::Unknown {
        name: name.to_string(),
    };
    if !NETWORKS.contains(&name) {
        return Err(unknown());
    }
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
        "googlenet" => inception::googlenet(1000),
        "inception_v3" => inception::inception_v3(1000),
        "squeezenet1_0" => squeezenet::squeezenet_custom(name, false, 1000),
        "squeezenet1_1" => squeezenet::squeezenet_custom(name, true, 1000),
        _ => family(name).ok_or_else(unknown)?,
    };
    Ok(graph)
}

/// The networks whose variants are computed from their names: EfficientNet, ConvNeXt,
/// RegNet, Swin, MaxViT, DenseNet, ShuffleNetV2, MNASNet and VGG.
fn family(name: &str) -> Option<Graph> {
    if let Some(b) = name.strip_prefix("efficientnet_b") {
        let (w, d, dropout, size, eps) = efficientnet::variant(b.parse().ok()?)?;
        return Some(efficientnet::efficientnet_custom(
            name,
            (w, d),
            (dropout, size, eps),
            1000,
        ));
    }
    if let Some(g) = efficientnet::v2(name) {
        return Some(g);
    }
    if let Some((widths, depths)) = convnext::variant(name) {
        return Some(convnext::convnext_custom(name, widths, depths, 1000));
    }
    if let Some(cfg) = regnet::variant(name) {
        return Some(regnet::regnet_custom(name, &cfg, 1000));
    }
    if let Some(g) = swin::build(name) {
        return Some(g);
    }
    if let Some(cfg) = maxvit::variant(name) {
        return Some(maxvit::maxvit_custom(name, &cfg, 1000));
    }
    if let Some((growth, blocks, stem)) = densenet::variant(name) {
        return Some(densenet::densenet_custom(name, growth, blocks, stem, 1000));
    }
    if let Some(channels) = shufflenet::variant(name) {
        return Some(shufflenet::shufflenet_v2_custom(
            name,
            [4, 8, 4],
            channels,
            1000,
        ));
    }
    if let Some(alpha) = mnasnet::variant(name) {
        return Some(mnasnet::mnasnet_custom(name, alpha, 1000));
    }
    let (base, bn) = match name.strip_suffix("_bn") {
        Some(base) => (base, true),
        None => (name, false),
    };
    matches!(base, "vgg11" | "vgg13" | "vgg16" | "vgg19").then(|| vgg::vgg(name, base, bn, 1000))
}

//! Our outputs against PyTorch's on committed fixtures (tests/fixtures/make_fixtures.py):
//! narrow ResNets (basic and bottleneck), a narrow MobileNetV2, a VGG-shaped net, and single
//! layers. FP32 must match to rel 1e-4 of the output's magnitude; FP16/BF16 store every
//! activation rounded, so they get the looser bounds of `common::tolerance`.

use crate::backend_test;
use workshop::backend::BackendKind;
use workshop::model::graph::{ConvInit, GraphBuilder, LinearInit};
use workshop::model::op::{Conv2d, Op, Pool};
use workshop::model::weights::read_tensor;
use workshop::model::zoo::{self, Block, ResNetConfig};
use workshop::model::{Graph, Precision, Tensor, Weights};

use crate::common::{conv, fixture, session, tolerance};

fn tiny_vgg() -> Graph {
    // The PyTorch module is TinyVgg in make_fixtures.py.
    let mut g = GraphBuilder::new(
        "tiny_vgg",
        3,
        ConvInit::KaimingNormalFanOut,
        LinearInit::Normal001,
    );
    let x = g.input();
    let x = g.conv("features.0", x, Conv2d::new(3, 8, 3, 1, 1).with_bias());
    let x = g.bn("features.1", x, 8);
    let x = g.relu("features.2", x);
    let x = g.max_pool("features.3", x, Pool::new(2, 2, 0));
    let x = g.conv("features.4", x, Conv2d::new(8, 12, 3, 1, 1).with_bias());
    let x = g.relu("features.5", x);
    let x = g.max_pool(
        "features.6",
        x,
        Pool {
            ceil_mode: true,
            ..Pool::new(3, 2, 0)
        },
    );
    let x = g.adaptive_avg_pool("avgpool", x, (3, 3));
    let x = g.flatten("flatten", x);
    let x = g.linear("classifier.0", x, 12 * 9, 16);
    let x = g.relu("classifier.1", x);
    let x = g.dropout("classifier.2", x, 0.5);
    let x = g.linear("classifier.3", x, 16, 10);
    g.finish(x)
}

fn tiny_resnet_config(block: Block, widths: [usize; 4]) -> ResNetConfig {
    ResNetConfig {
        block,
        layers: [1, 1, 1, 1],
        stem: 8,
        widths,
        classes: 10,
        groups: 1,
        width_per_group: 64,
    }
}

fn tiny_resnet(block: Block, widths: [usize; 4]) -> Graph {
    zoo::resnet_custom("tiny_resnet", &tiny_resnet_config(block, widths))
}

/// Load a model fixture, run it on `kind` at every precision, and compare with PyTorch.
fn check_model(kind: BackendKind, name: &str, graph: &Graph) {
    let w = Weights::load(&fixture(&format!("{name}.safetensors")), graph)
        .expect("fixture weights load");
    let io = fixture(&format!("{name}_io.safetensors"));
    let x = read_tensor(&io, "input").unwrap();
    let expected = read_tensor(&io, "output").unwrap();
    let plan = graph.plan(x.shape[0], x.shape[2], x.shape[3]).unwrap();
    compare(kind, name, &plan, &w, &x, &expected);
}

fn compare(
    kind: BackendKind,
    name: &str,
    plan: &workshop::model::Plan,
    w: &Weights,
    x: &Tensor,
    expected: &Tensor,
) {
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        let Some(mut s) = session(kind, plan, w, precision) else {
            return;
        };
        s.run(x).unwrap();
        s.sync().unwrap();
        let got = s.read_output().unwrap();
        let scale = expected.data.iter().fold(1f32, |a, v| a.max(v.abs()));
        let diff = got.max_abs_diff(expected);
        eprintln!(
            "{name} on {kind} {precision}: max abs diff {diff:.3e} (output scale {scale:.3})"
        );
        assert!(
            diff <= tolerance(precision) * scale,
            "{name} on {kind} {precision}: max abs diff {diff} vs PyTorch exceeds {} × {scale}",
            tolerance(precision)
        );
    }
}

fn models_match_pytorch(kind: BackendKind) {
    check_model(
        kind,
        "tiny_resnet_bottleneck",
        &tiny_resnet(Block::Bottleneck, [4, 8, 16, 32]),
    );
    check_model(
        kind,
        "tiny_resnet_basic",
        &tiny_resnet(Block::Basic, [4, 8, 8, 16]),
    );
    check_model(
        kind,
        "tiny_mobilenet_v2",
        &zoo::mobilenet_v2_custom("tiny_mobilenet_v2", 0.1, 10),
    );
    check_model(kind, "tiny_vgg", &tiny_vgg());
    let resnext = ResNetConfig {
        groups: 4,
        width_per_group: 16,
        ..tiny_resnet_config(Block::Bottleneck, [8, 8, 16, 16])
    };
    check_model(
        kind,
        "tiny_resnext",
        &zoo::resnet_custom("tiny_resnext", &resnext),
    );
    let vit = zoo::vit_custom("tiny_vit", &crate::common::tiny_vit());
    check_model(kind, "tiny_vit", &vit);
    let v3 = zoo::mobilenet_v3_custom("tiny_mobilenet_v3", false, 0.25, 10);
    check_model(kind, "tiny_mobilenet_v3", &v3);
    let eff = zoo::efficientnet_custom("tiny_efficientnet", (0.25, 0.25), (0.2, 32, 1e-5), 10);
    check_model(kind, "tiny_efficientnet", &eff);
    let convnext = zoo::convnext_custom("tiny_convnext", [8, 16, 24, 32], [1, 1, 2, 1], 10);
    check_model(kind, "tiny_convnext", &convnext);
    check_model(
        kind,
        "tiny_regnet",
        &zoo::regnet_custom("tiny_regnet", &tiny_regnet(), 10),
    );
    let densenet = zoo::densenet_custom("tiny_densenet", 4, [2, 2, 2, 2], 8, 10);
    check_model(kind, "tiny_densenet", &densenet);
    let shufflenet =
        zoo::shufflenet_v2_custom("tiny_shufflenet", [1, 2, 1], [8, 16, 32, 48, 64], 10);
    check_model(kind, "tiny_shufflenet", &shufflenet);
    let swin = zoo::swin_custom("tiny_swin", (8, [2, 2, 2, 1], [2, 2, 4, 4]), (3, false), 10);
    check_model(kind, "tiny_swin", &swin);
    let swin2 = zoo::swin_custom(
        "tiny_swin_v2",
        (8, [2, 2, 2, 1], [2, 2, 4, 4]),
        (3, true),
        10,
    );
    check_model(kind, "tiny_swin_v2", &swin2);
    let maxvit = zoo::MaxVitConfig::small();
    check_model(
        kind,
        "tiny_maxvit",
        &zoo::maxvit_custom("tiny_maxvit", &maxvit, 10),
    );
}

/// `BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8,
/// se_ratio=0.25)`: stages of 8, 16 and 32 channels (1, 1 and 2 blocks) with
/// squeeze-and-excitation.
fn tiny_regnet() -> zoo::RegNetConfig {
    zoo::RegNetConfig {
        depth: 4,
        w_0: 8,
        w_a: 8.0,
        w_m: 2.0,
        group_width: 8,
        se: true,
    }
}
backend_test!(models_match_pytorch, cpu, wgpu, cuda, hip);

fn layers_match_pytorch(kind: BackendKind) {
    let file = fixture("layers.safetensors");
    let ceil = Pool {
        ceil_mode: true,
        ..Pool::new(2, 2, 0)
    };
    // Each case mirrors the `layer(...)` call of the same name in make_fixtures.py.
    let cases: Vec<(&str, Op)> = vec![
        (
            "conv_3x3_s2_g2_bias",
            conv(4, 6, (3, 3), 2, (1, 1), 1, 2, true),
        ),
        (
            "conv_depthwise_s2",
            conv(8, 8, (3, 3), 2, (1, 1), 1, 8, false),
        ),
        ("conv_dilated", conv(3, 5, (3, 3), 1, (2, 2), 2, 1, true)),
        ("conv_1x3", conv(3, 4, (1, 3), 1, (0, 1), 1, 1, false)),
        ("max_pool_3_s2_p1", Op::MaxPool(Pool::new(3, 2, 1))),
        ("avg_pool_3_s2_p1", Op::AvgPool(Pool::new(3, 2, 1))),
        ("avg_pool_ceil", Op::AvgPool(ceil)),
        ("adaptive_avg_pool_3x2", Op::AdaptiveAvgPool { out: (3, 2) }),
        ("sigmoid", Op::Sigmoid),
    ];
    for (name, op) in cases {
        let x = read_tensor(&file, &format!("{name}.input")).unwrap();
        let expected = read_tensor(&file, &format!("{name}.output")).unwrap();
        let mut g = GraphBuilder::new(
            name,
            x.shape[1],
            ConvInit::TorchDefault,
            LinearInit::TorchDefault,
        );
        let input = g.input();
        let y = g.add_node(name, op, &[input]);
        let graph = g.finish(y);
        let mut w = Weights::default();
        for p in graph.params() {
            w.insert(p.name.clone(), read_tensor(&file, &p.name).unwrap());
        }
        let plan = graph.plan(x.shape[0], x.shape[2], x.shape[3]).unwrap();
        compare(kind, name, &plan, &w, &x, &expected);
    }
}
backend_test!(layers_match_pytorch, cpu, wgpu, cuda, hip);

#[test]
fn reference_matches_pytorch() {
    // The f64 reference that every kernel test trusts is itself held against PyTorch.
    let graph = tiny_resnet(Block::Bottleneck, [4, 8, 16, 32]);
    let w = Weights::load(&fixture("tiny_resnet_bottleneck.safetensors"), &graph).unwrap();
    let io = fixture("tiny_resnet_bottleneck_io.safetensors");
    let x = read_tensor(&io, "input").unwrap();
    let expected = read_tensor(&io, "output").unwrap();
    let plan = graph.plan(2, 32, 32).unwrap();
    let got = workshop::model::reference::forward(&plan, &w, &x);
    let scale = expected.data.iter().fold(1f32, |a, v| a.max(v.abs()));
    assert!(got.max_abs_diff(&expected) <= 1e-5 * scale);
    let sm = read_tensor(&fixture("layers.safetensors"), "softmax.input").unwrap();
    let sm_out = read_tensor(&fixture("layers.safetensors"), "softmax.output").unwrap();
    assert!(workshop::model::reference::softmax(&sm).max_abs_diff(&sm_out) < 1e-6);
}

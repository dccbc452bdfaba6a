//! Every op of every backend against the plain f64 reference (`model::reference`), on small
//! and odd shapes: 1×1, stride 2, groups, depthwise, dilation, padding, non-square inputs and
//! kernels, several chunks of the im2col path, and every precision.

use crate::backend_test;
use workshop::backend::{BackendKind, ExecOptions, KernelFamily};
use workshop::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use workshop::model::op::{Conv2d, Op, Pool, WindowAttention, WindowForm};
use workshop::model::{Graph, Precision, Rng, Tensor, Weights, reference};

use crate::common::{conv, profiled_session, session, session_with, tolerance};

/// Weights for `graph` with every tensor random (batch-norm statistics included), so no op
/// degenerates to an identity.
fn random_weights(graph: &Graph, seed: u64) -> Weights {
    let mut w = Weights::init(graph, seed);
    let mut rng = Rng::new(seed + 100);
    for (name, t) in w.iter_mut() {
        // Tensors initialised to zeros (ViT's class token and head) become random too.
        let zeros = t.data.iter().all(|v| *v == 0.0);
        for v in t.data.iter_mut() {
            *v = if name.ends_with("running_var") {
                0.5 + rng.uniform() as f32
            } else if name.ends_with(".bias") || name.ends_with("running_mean") {
                (rng.normal() * 0.2) as f32
            } else if name.ends_with("relative_position_bias_table") || name.contains("cpb_mlp") {
                // Swin's bias (V2: its MLP) at a scale where a wrong row shows in the output.
                rng.normal() as f32
            } else if name.ends_with(".weight") && t.shape.len() == 1 {
                0.5 + rng.uniform() as f32
            } else if zeros {
                (rng.normal() * 0.2) as f32
            } else {
                *v
            };
        }
    }
    w
}

/// Run `graph` on `kind` at every precision and compare with the reference.
fn check(kind: BackendKind, graph: &Graph, input_shape: [usize; 4], input_scale: f32) {
    check_with(kind, graph, input_shape, input_scale, KernelFamily::Native)
}

/// [`check`] with the vendor library's kernels or ours.
fn check_with(
    kind: BackendKind,
    graph: &Graph,
    input_shape: [usize; 4],
    input_scale: f32,
    kernels: KernelFamily,
) {
    let plan = graph
        .plan(input_shape[0], input_shape[2], input_shape[3])
        .expect("valid plan");
    let w = random_weights(graph, 7);
    let mut rng = Rng::new(11);
    let mut x = rng.normal_tensor(input_shape.to_vec());
    x.data.iter_mut().for_each(|v| *v *= input_scale);
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        // The reference sees the input and weights the backend stores at this precision.
        let xr = Tensor::new(
            x.shape.clone(),
            x.data.iter().map(|&v| precision.round(v)).collect(),
        );
        let mut wr = w.clone();
        wr.iter_mut()
            .for_each(|(_, t)| t.data.iter_mut().for_each(|v| *v = precision.round(*v)));
        let expected = reference::forward(&plan, &wr, &xr);
        let opt = ExecOptions {
            precision,
            threads: Some(2),
            kernels,
            ..Default::default()
        };
        let Some(mut s) = session_with(kind, &plan, &w, &opt) else {
            return;
        };
        s.run(&x).unwrap();
        s.sync().unwrap();
        let got = s.read_output().unwrap();
        assert_eq!(got.shape, expected.shape, "{}: output shape", graph.name);
        let scale = expected.data.iter().fold(1f32, |a, v| a.max(v.abs()));
        let diff = got.max_abs_diff(&expected);
        assert!(
            diff <= tolerance(precision) * scale,
            "{} on {kind} {precision}: max abs diff {diff} exceeds {} × {scale}",
            graph.name,
            tolerance(precision)
        );
    }
}

fn single(name: &str, channels: usize, op: Op) -> Graph {
    let mut g = GraphBuilder::new(
        name,
        channels,
        ConvInit::TorchDefault,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let y = g.add_node("layer", op, &[x]);
    g.finish(y)
}

fn conv2d_variants(kind: BackendKind) {
    let cases: Vec<(&str, usize, Op, [usize; 4])> = vec![
        (
            "pointwise",
            5,
            conv(5, 7, (1, 1), 1, (0, 0), 1, 1, false),
            [2, 5, 4, 3],
        ),
        (
            "pointwise_stride2",
            6,
            conv(6, 4, (1, 1), 2, (0, 0), 1, 1, true),
            [1, 6, 7, 5],
        ),
        (
            "3x3_pad1",
            3,
            conv(3, 8, (3, 3), 1, (1, 1), 1, 1, true),
            [2, 3, 6, 5],
        ),
        (
            "3x3_stride2_odd",
            4,
            conv(4, 6, (3, 3), 2, (1, 1), 1, 1, false),
            [1, 4, 9, 7],
        ),
        (
            "7x7_stem",
            3,
            conv(3, 4, (7, 7), 2, (3, 3), 1, 1, false),
            [1, 3, 13, 11],
        ),
        (
            "grouped",
            6,
            conv(6, 9, (3, 3), 1, (1, 1), 1, 3, true),
            [2, 6, 5, 5],
        ),
        (
            "depthwise",
            8,
            conv(8, 8, (3, 3), 1, (1, 1), 1, 8, false),
            [2, 8, 5, 6],
        ),
        (
            "depthwise_stride2_bias",
            5,
            conv(5, 5, (3, 3), 2, (1, 1), 1, 5, true),
            [1, 5, 7, 8],
        ),
        // 24 channels: the CPU's 16-channel register block and an 8-channel tail.
        (
            "depthwise_block_and_tail_dilated_stride2",
            24,
            conv(24, 24, (3, 3), 2, (2, 2), 2, 24, true),
            [2, 24, 9, 7],
        ),
        // 27 channels (a 16-channel block, an 8-channel one, 3 single channels), 5×5 taps on
        // 13 columns: edge pixels, runs of 4 inside and a single interior pixel after them.
        (
            "depthwise_5x5_all_blocks",
            27,
            conv(27, 27, (5, 5), 1, (2, 2), 1, 27, true),
            [2, 27, 6, 13],
        ),
        // The other tap shapes the CPU unrolls: 5×5 at stride 2 (MobileNetV3), 7×7 (ConvNeXt).
        (
            "depthwise_5x5_stride2",
            24,
            conv(24, 24, (5, 5), 2, (2, 2), 1, 24, false),
            [1, 24, 9, 11],
        ),
        (
            "depthwise_7x7",
            16,
            conv(16, 16, (7, 7), 1, (3, 3), 1, 16, true),
            [1, 16, 8, 10],
        ),
        (
            "dilated",
            3,
            conv(3, 4, (3, 3), 1, (2, 2), 2, 1, false),
            [1, 3, 8, 9],
        ),
        (
            "kernel_1x3",
            3,
            conv(3, 5, (1, 3), 1, (0, 1), 1, 1, true),
            [1, 3, 4, 6],
        ),
        // Taps clipped on both sides of one output: the CPU's contiguous im2col runs.
        (
            "kernel_wider_than_input",
            2,
            conv(2, 3, (3, 5), 1, (1, 2), 1, 1, true),
            [1, 2, 4, 3],
        ),
        (
            "kernel_covers_input",
            2,
            conv(2, 3, (3, 3), 1, (0, 0), 1, 1, false),
            [1, 2, 3, 3],
        ),
        // Few output rows (9): the GPU backends' few-rows GEMM, with groups and a column tail.
        (
            "few_rows_grouped",
            6,
            conv(6, 9, (3, 3), 2, (1, 1), 1, 3, true),
            [1, 6, 5, 5],
        ),
        (
            "few_rows_column_tail",
            5,
            conv(5, 70, (3, 3), 1, (1, 1), 1, 1, true),
            [1, 5, 3, 3],
        ),
        // Long columns (K = 576) over 2×32×32 rows: several im2col chunks, split over workers.
        (
            "many_chunks",
            64,
            conv(64, 16, (3, 3), 1, (1, 1), 1, 1, true),
            [2, 64, 32, 32],
        ),
        // The GPU backends' tiled implicit GEMM: a tail in every dimension (70 channels, K = 45,
        // 90 pixels over 3 images), with groups and dilation, pointwise, and 128-wide tiles.
        (
            "tiled_tails_stride2",
            5,
            conv(5, 70, (3, 3), 2, (1, 1), 1, 1, true),
            [3, 5, 11, 9],
        ),
        (
            "tiled_grouped_dilated",
            64,
            conv(64, 66, (3, 3), 1, (2, 2), 2, 2, false),
            [1, 64, 9, 7],
        ),
        (
            "tiled_pointwise_tails",
            40,
            conv(40, 36, (1, 1), 1, (0, 0), 1, 1, false),
            [3, 40, 5, 7],
        ),
        (
            "tiled_128",
            8,
            conv(8, 40, (3, 3), 1, (1, 1), 1, 1, true),
            [1, 8, 128, 256],
        ),
        // 32 input channels per group: the reduction runs window position by position (kc).
        (
            "tiled_window_major_stride2",
            64,
            conv(64, 48, (3, 3), 2, (1, 1), 1, 1, true),
            [2, 64, 9, 11],
        ),
        (
            "tiled_128_pointwise",
            32,
            conv(32, 40, (1, 1), 1, (0, 0), 1, 1, true),
            [2, 32, 128, 128],
        ),
    ];
    for (name, c, op, shape) in cases {
        check(kind, &single(&format!("conv2d_{name}"), c, op), shape, 1.0);
    }
}
backend_test!(conv2d_variants, cpu, wgpu, cuda, hip);

/// FP16 and BF16 convolutions run on the matrix units' kernels where the device has them (on
/// the emulator: CUDA's mma.sync per warp of 32 and HIP's MFMA per wavefront of 64, the
/// variants above checked against the reference through them), and FP32 never does.
fn matrix_kernels_in_half_precision(kind: BackendKind) {
    let graph = single("layer", 48, conv(48, 40, (3, 3), 1, (1, 1), 1, 1, true));
    let plan = graph.plan(1, 9, 7).unwrap();
    let w = random_weights(&graph, 3);
    let x = Rng::new(2).normal_tensor(vec![1, 48, 9, 7]);
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        let Some(mut s) = profiled_session(kind, &plan, &w, precision, true) else {
            return;
        };
        s.run(&x).unwrap();
        s.sync().unwrap();
        let kernels: Vec<String> = s
            .kernel_times()
            .unwrap()
            .into_iter()
            .map(|k| k.kernel)
            .collect();
        let conv = kernels.iter().find(|k| k.starts_with("conv2d")).unwrap();
        // A real AMD GPU has them from CDNA 2 on, a real NVIDIA one from compute capability
        // 8.0 on: only the emulator's answer is known here.
        if workshop::backend::gpu::emu::requested() {
            let wanted = precision != Precision::Fp32;
            assert_eq!(
                conv.contains("_mma_"),
                wanted,
                "{kind} {precision:?}: {kernels:?}"
            );
        }
    }
}
backend_test!(matrix_kernels_in_half_precision, cuda, hip);

fn pooling(kind: BackendKind) {
    let ceil = |k, s, p| Pool {
        ceil_mode: true,
        ..Pool::new(k, s, p)
    };
    let no_pad_count = Pool {
        count_include_pad: false,
        ..Pool::new(3, 2, 1)
    };
    let cases: Vec<(&str, Op, [usize; 4])> = vec![
        ("max_3_s2_p1", Op::MaxPool(Pool::new(3, 2, 1)), [2, 3, 9, 8]),
        ("max_2_s2", Op::MaxPool(Pool::new(2, 2, 0)), [1, 4, 6, 6]),
        ("max_ceil", Op::MaxPool(ceil(3, 2, 0)), [1, 3, 8, 7]),
        // 77 channels: the CPU kernel's runs of 64, 8 and 1 channels.
        (
            "max_3_s2_p1_wide",
            Op::MaxPool(Pool::new(3, 2, 1)),
            [1, 77, 7, 6],
        ),
        ("avg_3_s1_p1", Op::AvgPool(Pool::new(3, 1, 1)), [1, 3, 5, 4]),
        // The average's runs of 64, 8 and 1 channels too.
        (
            "avg_3_s1_p1_wide",
            Op::AvgPool(Pool::new(3, 1, 1)),
            [2, 77, 5, 6],
        ),
        ("avg_ceil_pad", Op::AvgPool(ceil(2, 2, 1)), [1, 2, 5, 7]),
        ("avg_exclude_pad", Op::AvgPool(no_pad_count), [1, 2, 6, 5]),
        (
            "adaptive_1x1",
            Op::AdaptiveAvgPool { out: (1, 1) },
            [2, 5, 7, 7],
        ),
        // Global pooling sums pixels four at a time: 30 pixels leave two over; 37
        // channels are two AVX-512 vectors and a tail.
        (
            "adaptive_1x1_wide",
            Op::AdaptiveAvgPool { out: (1, 1) },
            [3, 37, 6, 5],
        ),
        (
            "adaptive_uneven",
            Op::AdaptiveAvgPool { out: (3, 2) },
            [1, 3, 7, 5],
        ),
        (
            "adaptive_upsample",
            Op::AdaptiveAvgPool { out: (4, 4) },
            [1, 2, 3, 2],
        ),
    ];
    for (name, op, shape) in cases {
        let c = shape[1];
        check(kind, &single(&format!("pool_{name}"), c, op), shape, 1.0);
    }
}
backend_test!(pooling, cpu, wgpu, cuda, hip);

fn elementwise(kind: BackendKind) {
    check(
        kind,
        &single(
            "batch_norm",
            6,
            Op::BatchNorm {
                channels: 6,
                eps: 1e-5,
            },
        ),
        [2, 6, 3, 5],
        1.0,
    );
    check(kind, &single("relu", 3, Op::Relu), [1, 3, 4, 4], 1.0);
    // Scaled input so ReLU6's upper clamp is exercised.
    check(kind, &single("relu6", 3, Op::Relu6), [1, 3, 4, 4], 5.0);
    check(
        kind,
        &single("dropout", 3, Op::Dropout { p: 0.5 }),
        [1, 3, 2, 2],
        1.0,
    );
}
backend_test!(elementwise, cpu, wgpu, cuda, hip);

/// Two branches from one input joined by a residual add, with BN and ReLU reusing buffers.
fn residual_add(kind: BackendKind) {
    let mut g = GraphBuilder::new(
        "residual",
        4,
        ConvInit::KaimingNormalFanOut,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let a = g.conv("a", x, Conv2d::new(4, 4, 3, 1, 1));
    let a = g.bn("a_bn", a, 4);
    let a = g.relu("a_relu", a);
    let y = g.add("add", a, x);
    let y = g.relu("out_relu", y);
    check(kind, &g.finish(y), [2, 4, 5, 5], 1.0);
}
backend_test!(residual_add, cpu, wgpu, cuda, hip);

/// Flatten of a spatial map then linear layers: the flatten must follow NCHW order.
fn flatten_linear_softmax(kind: BackendKind) {
    let mut g = GraphBuilder::new("head", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x: ValueId = g.input();
    let y = g.flatten("flatten", x);
    let y = g.linear("fc1", y, 3 * 4 * 5, 7);
    let y = g.relu("relu", y);
    let y = g.linear("fc2", y, 7, 5);
    let y = g.add_node("softmax", Op::Softmax, &[y]);
    let g = g.finish(y);
    // Batch 3 takes the GPU backends' few-rows GEMM, batch 20 their tiled one.
    check(kind, &g, [3, 3, 4, 5], 1.0);
    check(kind, &g, [20, 3, 4, 5], 1.0);
    // A wide linear layer over a large batch: the GPU backends' 128-wide tiles for linear
    // layers, with a tail in every dimension (2000 rows, 2100 outputs, 44 inputs).
    let mut g = GraphBuilder::new("wide", 44, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let y = g.flatten("flatten", x);
    let y = g.linear("fc", y, 44, 2100);
    check(kind, &g.finish(y), [2000, 44, 1, 1], 1.0);
}
backend_test!(flatten_linear_softmax, cpu, wgpu, cuda, hip);

/// Sigmoid on images and on features, in place after a convolution and on a value another
/// node reads again (the CPU must copy it then), with inputs large enough to saturate it.
fn sigmoid(kind: BackendKind) {
    let mut g = GraphBuilder::new("gate", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let a = g.conv("conv", x, Conv2d::new(3, 6, 3, 1, 1));
    let s = g.sigmoid("gate", a);
    let y = g.add("add", s, a);
    let y = g.flatten("flatten", y);
    let y = g.sigmoid("out", y);
    check(kind, &g.finish(y), [2, 3, 7, 5], 4.0);
}
backend_test!(sigmoid, cpu, wgpu, cuda, hip);

/// A linear layer whose FP32 weights (9216 × 4160, 146 MiB) exceed the 128 MiB a storage
/// binding may hold on many adapters, like AlexNet's and VGG's first classifier layers: the GPU
/// backends cut it into slices of output channels.
fn linear_larger_than_one_binding(kind: BackendKind) {
    let mut g = GraphBuilder::new(
        "big_fc",
        9216,
        ConvInit::TorchDefault,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let y = g.flatten("flatten", x);
    let y = g.linear("fc", y, 9216, 4160);
    check(kind, &g.finish(y), [2, 9216, 1, 1], 1.0);
}
backend_test!(linear_larger_than_one_binding, cpu, wgpu, cuda, hip);

#[test]
fn shape_errors_say_what_does_not_fit() {
    let g = single("c", 3, conv(3, 4, (7, 7), 1, (0, 0), 1, 1, false));
    let e = g.plan(1, 4, 4).unwrap_err().to_string();
    assert!(e.contains("smaller than its 7×7 kernel"), "{e}");
    let g = single("c", 3, conv(4, 4, (3, 3), 1, (1, 1), 1, 1, false));
    let e = g.plan(1, 8, 8).unwrap_err().to_string();
    assert!(e.contains("expects 4 input channels, got 3"), "{e}");
    let g = single("g", 6, conv(6, 4, (3, 3), 1, (1, 1), 1, 4, false));
    let e = g.plan(1, 8, 8).unwrap_err().to_string();
    assert!(e.contains("groups=4 must divide"), "{e}");
    // The channel ops of DenseNet, ShuffleNet and ConvNeXt, each with what does not fit.
    let cases = [
        (
            Op::ChannelSlice { start: 4, count: 4 },
            "4 channels from 4 does not fit 6",
        ),
        (
            Op::ChannelSlice {
                start: usize::MAX,
                count: 2,
            },
            "does not fit 6 channels",
        ),
        (Op::ChannelShuffle { groups: 4 }, "4 groups must divide 6"),
        (Op::ChannelShuffle { groups: 0 }, "0 groups must divide 6"),
        (Op::layer_norm(5, 1e-6), "over 5 channels"),
        (Op::LayerScale { channels: 5 }, "expects 5 channels, got 6"),
    ];
    for (op, says) in cases {
        let e = single("x", 6, op).plan(1, 4, 4).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    }
    let mut g = GraphBuilder::new("cat", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let half = g.max_pool("pool", x, Pool::new(2, 2, 0));
    let y = g.add_node("cat", Op::Concat { parts: 2 }, &[x, half]);
    let e = g.finish(y).plan(1, 4, 4).unwrap_err().to_string();
    assert!(
        e.contains("concat needs image batches of one (N, H, W)"),
        "{e}"
    );
}

#[test]
fn loss_and_softmax_match_closed_forms() {
    // Uniform logits: softmax is 1/C and the cross-entropy is ln(C).
    let t = Tensor::new(vec![2, 4], vec![3.0; 8]);
    assert!((reference::cross_entropy(&t, &[0, 3]) - 4f64.ln()).abs() < 1e-12);
    assert!(
        reference::softmax(&t)
            .data
            .iter()
            .all(|&p| (p - 0.25).abs() < 1e-7)
    );
    // torch.nn.functional.cross_entropy(torch.tensor([[1., 2., 3.]]), torch.tensor([2])) = 0.40760596
    let t = Tensor::new(vec![1, 3], vec![1.0, 2.0, 3.0]);
    assert!((reference::cross_entropy(&t, &[2]) - 0.407_605_96).abs() < 1e-7);
}

/// A narrow bottleneck ResNet for whole-network tests.
fn tiny_bottleneck(layers: [usize; 4], widths: [usize; 4]) -> Graph {
    use workshop::model::zoo::{Block, ResNetConfig, resnet_custom};
    let cfg = ResNetConfig {
        block: Block::Bottleneck,
        layers,
        stem: 8,
        widths,
        classes: 10,
        groups: 1,
        width_per_group: 64,
    };
    resnet_custom("tiny", &cfg)
}

/// Timing every kernel must not change a single output value.
fn profiling_changes_nothing(kind: BackendKind) {
    let graph = tiny_bottleneck([1, 1, 1, 1], [4, 8, 8, 8]);
    let plan = graph.plan(2, 32, 32).expect("valid plan");
    let w = random_weights(&graph, 3);
    let x = Rng::new(4).normal_tensor(plan.input_shape().to_vec());
    let mut outputs = Vec::new();
    for profile in [false, true] {
        let Some(mut s) = profiled_session(kind, &plan, &w, Precision::Fp32, profile) else {
            return;
        };
        s.run(&x).unwrap();
        s.sync().unwrap();
        outputs.push(s.read_output().unwrap().data);
        assert_eq!(
            s.kernel_times().is_some(),
            profile,
            "kernel times only when asked"
        );
    }
    assert_eq!(outputs[0], outputs[1]);
}
backend_test!(profiling_changes_nothing, cpu, wgpu, cuda, hip);

/// Convolutions with fused epilogues (what `--compile default` makes): bias, residual add and
/// activation in one kernel, on the tiled and the few-rows GEMM paths and a depthwise conv.
fn fused_conv_epilogues(kind: BackendKind) {
    use workshop::model::op::Act;
    let cases: Vec<(&str, Conv2d, [usize; 4])> = vec![
        (
            "res_relu",
            Conv2d {
                bias: true,
                residual: true,
                act: Act::Relu,
                ..Conv2d::new(4, 4, 3, 1, 1)
            },
            [2, 4, 6, 5],
        ),
        (
            "res_relu_few_rows",
            Conv2d {
                residual: true,
                act: Act::Relu,
                ..Conv2d::new(5, 5, 3, 1, 1)
            },
            [1, 5, 3, 3],
        ),
        // Whole and partial 32 × 32 blocks of the bf16-pair GEMM, whose epilogue runs a block
        // at a time.
        (
            "res_relu_blocks",
            Conv2d {
                residual: true,
                act: Act::Relu,
                ..Conv2d::new(48, 48, 1, 1, 0).with_bias()
            },
            [2, 48, 6, 6],
        ),
        // K of 16 or less: on AMX CPUs `vdpbf16ps` multiplies it (the input read in place, B
        // held in registers, rows finished there), MobileNetV3's 16 → 16 with its residual.
        (
            "res_relu_k16",
            Conv2d {
                residual: true,
                act: Act::Relu,
                ..Conv2d::new(16, 16, 1, 1, 0).with_bias()
            },
            [2, 16, 7, 9],
        ),
        // Channels that fill no whole K step (AMX's 32, `vdpbf16ps`'s 8): the bf16-pair
        // GEMM's input copied into rows padded with zeros, MobileNetV3's 40 and 72 channels.
        (
            "res_relu_k40",
            Conv2d {
                residual: true,
                act: Act::Relu,
                ..Conv2d::new(40, 40, 1, 1, 0).with_bias()
            },
            [2, 40, 5, 7],
        ),
        (
            "k20",
            Conv2d::new(20, 24, 1, 1, 0).with_bias(),
            [1, 20, 6, 6],
        ),
        ("k12", Conv2d::new(12, 40, 1, 1, 0), [1, 12, 5, 5]),
        (
            "relu6_grouped",
            Conv2d {
                act: Act::Relu6,
                ..Conv2d::new(6, 6, 3, 1, 1).with_groups(3)
            },
            [1, 6, 7, 7],
        ),
        (
            "depthwise_res",
            Conv2d {
                residual: true,
                act: Act::Relu6,
                ..Conv2d::new(8, 8, 3, 1, 1).with_groups(8)
            },
            [1, 8, 5, 5],
        ),
        (
            "depthwise_res_blocks",
            Conv2d {
                residual: true,
                act: Act::Relu,
                ..Conv2d::new(32, 32, 3, 1, 1).with_groups(32)
            },
            [2, 32, 6, 5],
        ),
        (
            "silu_pointwise",
            Conv2d {
                act: Act::Silu,
                ..Conv2d::new(8, 16, 1, 1, 0)
            },
            [2, 8, 5, 6],
        ),
        (
            "hardswish_res",
            Conv2d {
                residual: true,
                act: Act::Hardswish,
                ..Conv2d::new(8, 8, 3, 1, 1).with_bias()
            },
            [1, 8, 6, 5],
        ),
        (
            "silu_depthwise",
            Conv2d {
                act: Act::Silu,
                ..Conv2d::new(8, 8, 3, 1, 1).with_groups(8)
            },
            [1, 8, 5, 5],
        ),
        // Squeeze-and-excitation's gates on its second 1×1 convolution (one pixel per image).
        (
            "sigmoid_gate",
            Conv2d {
                act: Act::Sigmoid,
                ..Conv2d::new(8, 12, 1, 1, 0).with_bias()
            },
            [3, 8, 1, 1],
        ),
        (
            "hardsigmoid_gate",
            Conv2d {
                act: Act::Hardsigmoid,
                ..Conv2d::new(8, 12, 1, 1, 0).with_bias()
            },
            [3, 8, 1, 1],
        ),
        (
            "gelu_depthwise",
            Conv2d {
                act: Act::Gelu,
                ..Conv2d::new(8, 8, 3, 1, 1).with_groups(8)
            },
            [1, 8, 5, 5],
        ),
        // Grouped layers of 2, 4, 8, 16 and 32 channels a group (the CPU's direct grouped kernel on
        // AVX-512): ResNeXt's shape with a residual; stride 2 over odd sizes with 24 channels
        // (a block of 16 and a partial one of 8); 20 channels with runs cut by the edges; two
        // groups of 32 (each block half a group); two groups of 16 at stride 2.
        (
            "grouped_g4_res_relu",
            Conv2d {
                residual: true,
                act: Act::Relu,
                ..Conv2d::new(32, 32, 3, 1, 1).with_groups(8).with_bias()
            },
            [2, 32, 9, 11],
        ),
        (
            "grouped_g8_stride2_silu",
            Conv2d {
                act: Act::Silu,
                ..Conv2d::new(24, 24, 3, 2, 1).with_groups(3)
            },
            [1, 24, 13, 7],
        ),
        (
            "grouped_g2_edges",
            Conv2d::new(20, 20, 3, 1, 1).with_groups(10).with_bias(),
            [1, 20, 4, 19],
        ),
        (
            "grouped_g32",
            Conv2d::new(64, 64, 3, 1, 1).with_groups(2).with_bias(),
            [1, 64, 5, 6],
        ),
        (
            "grouped_g16_stride2_hardswish",
            Conv2d {
                act: Act::Hardswish,
                ..Conv2d::new(32, 32, 3, 2, 1).with_groups(2).with_bias()
            },
            [2, 32, 10, 9],
        ),
    ];
    for (name, c, shape) in cases {
        let mut g = GraphBuilder::new(
            name,
            shape[1],
            ConvInit::TorchDefault,
            LinearInit::TorchDefault,
        );
        let x = g.input();
        let inputs: Vec<ValueId> = if c.residual { vec![x, x] } else { vec![x] };
        let y = g.add_node(name, Op::Conv2d(c), &inputs);
        check(kind, &g.finish(y), shape, 3.0);
    }
}
backend_test!(fused_conv_epilogues, cpu, wgpu, cuda, hip);

/// Linear layers with a fused activation or residual add (what `--compile default` makes of a
/// transformer MLP's Linear → GELU and Linear → add, and of its attention → add): on tokens (70 rows, the tiled GEMM) and on three rows (the few-rows path).
fn fused_linear_epilogues(kind: BackendKind) {
    use workshop::model::op::Act;
    for (name, act, shape) in [
        ("gelu_tokens", Act::Gelu, [2, 6, 5, 7]),
        ("gelu_rows", Act::Gelu, [3, 6, 1, 1]),
        ("sigmoid_rows", Act::Sigmoid, [3, 6, 1, 1]),
    ] {
        let mut g = GraphBuilder::new(name, 6, ConvInit::TorchDefault, LinearInit::TorchDefault);
        let x = g.input();
        let x = g.add_node("tokens", Op::Tokens, &[x]);
        let linear = Op::Linear {
            in_features: 6,
            out_features: 12,
            bias: true,
            act,
            residual: false,
        };
        let y = g.add_node(name, linear, &[x]);
        check(kind, &g.finish(y), shape, 3.0);
    }
    // A transformer MLP's second layer with the block's residual add fused (and an activation
    // after it, which no transformer has but the epilogue allows): the residual is the tokens,
    // read last by this layer, whose buffer the CPU may write the output over.
    for (name, act, shape) in [
        ("add_tokens", Act::None, [2, 6, 5, 7]),
        ("add_relu_rows", Act::Relu, [3, 6, 1, 1]),
    ] {
        let mut g = GraphBuilder::new(name, 6, ConvInit::TorchDefault, LinearInit::TorchDefault);
        let x = g.input();
        let x = g.add_node("tokens", Op::Tokens, &[x]);
        let h = g.add_node("fc1", Op::linear(6, 6, true), &[x]);
        let linear = Op::Linear {
            in_features: 6,
            out_features: 6,
            bias: true,
            act,
            residual: true,
        };
        let y = g.add_node(name, linear, &[h, x]);
        check(kind, &g.finish(y), shape, 3.0);
    }
    // A ViT block's first residual add, fused into the attention's output projection.
    let mut g = GraphBuilder::new("attn", 6, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let x = g.add_node("tokens", Op::Tokens, &[x]);
    let h = g.add_node("fc", Op::linear(6, 6, true), &[x]);
    let attention = Op::Attention {
        dim: 6,
        heads: 2,
        residual: true,
    };
    let y = g.add_node("attention_add", attention, &[h, x]);
    check(kind, &g.finish(y), [2, 6, 5, 7], 3.0);
}
backend_test!(fused_linear_epilogues, cpu, wgpu, cuda, hip);

/// A whole network after the compile passes equals the eager one on the same backend: a
/// ResNet (batch norms folded, residual adds fused) and a ViT (GELU fused into the MLPs'
/// first linear layers, every residual add into the attention's output projection or the
/// MLP's second linear layer, layer norms folded into the projections after them).
fn compiled_network_matches_eager(kind: BackendKind) {
    let vit = workshop::model::zoo::VitConfig::small();
    let cases = [
        (tiny_bottleneck([1, 2, 1, 1], [4, 8, 8, 16]), "resnet"),
        (workshop::model::zoo::vit_custom("vit", &vit), "vit"),
    ];
    for (graph, family) in cases {
        let w = random_weights(&graph, 3);
        let (opt, w2, report) = workshop::model::passes::optimize(&graph, w.clone()).unwrap();
        let fused = match family {
            "resnet" => report.fused_adds == 5 && report.folded_batch_norms > 0,
            _ => {
                report.fused_activations == 2
                    && report.folded_layer_norms == 4
                    && report.fused_adds == 4
            }
        };
        assert!(fused, "{family}: {report:?}");
        let x = Rng::new(4).normal_tensor(vec![2, 3, 32, 32]);
        let run = |g: &workshop::model::Graph, w: &Weights| {
            let plan = g.plan(2, 32, 32).unwrap();
            let mut s = session(kind, &plan, w, Precision::Fp32)?;
            s.run(&x).unwrap();
            s.sync().unwrap();
            Some(s.read_output().unwrap().data)
        };
        let (Some(a), Some(b)) = (run(&graph, &w), run(&opt, &w2)) else {
            return;
        };
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff <= 1e-4 * scale.max(1e-3),
            "{kind} {family}: {diff} vs {scale}"
        );
    }
}
backend_test!(compiled_network_matches_eager, cpu, wgpu, cuda, hip);

/// `--kernels vendor` against the reference: library convolutions (the emulator's stand-in for
/// cuDNN on cuda) and library GEMMs for linear layers, each with our epilogue kernel; the
/// im2col + GEMM path of a device without a convolution library is tested in `gpu::emu`.
/// Backends without a vendor library refuse it in words.
fn vendor_kernels_match_the_reference(kind: BackendKind) {
    let mut g = GraphBuilder::new(
        "vendor_mix",
        3,
        ConvInit::TorchDefault,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let a = g.conv("stem", x, Conv2d::new(3, 8, 3, 2, 1).with_bias());
    let a = g.relu("stem_relu", a);
    let b = g.conv("pointwise", a, Conv2d::new(8, 8, 1, 1, 0));
    let c = g.add("sum", a, b);
    let d = g.conv(
        "depthwise",
        c,
        Conv2d {
            groups: 8,
            ..Conv2d::new(8, 8, 3, 1, 1)
        },
    );
    let e = g.adaptive_avg_pool("pool", d, (2, 2));
    let f = g.flatten("flatten", e);
    let h = g.linear("fc1", f, 32, 12);
    let h = g.relu("fc1_relu", h);
    let y = g.linear("fc2", h, 12, 5);
    let graph = g.finish(y);
    let (fused, w, report) =
        workshop::model::passes::optimize(&graph, random_weights(&graph, 9)).unwrap();
    // The epilogue kernel then adds the residual and applies the ReLU after the GEMM.
    assert!(report.fused_adds == 1, "{report:?}");
    if matches!(kind, BackendKind::Cpu | BackendKind::Wgpu) {
        let plan = fused.plan(1, 9, 7).unwrap();
        let opt = ExecOptions {
            kernels: KernelFamily::Vendor,
            ..Default::default()
        };
        let Ok(b) = workshop::backend::open(kind) else {
            return;
        };
        let Err(e) = b.prepare(0, &plan, &w, &opt) else {
            panic!("{kind} accepted --kernels vendor");
        };
        assert!(
            e.to_string().contains("--kernels vendor is for cuda"),
            "{e}"
        );
        return;
    }
    check_with(kind, &graph, [2, 3, 9, 7], 1.0, KernelFamily::Vendor);
    check_with(kind, &fused, [2, 3, 9, 7], 1.0, KernelFamily::Vendor);
}
backend_test!(vendor_kernels_match_the_reference, cpu, wgpu, cuda, hip);

/// `ExecOptions::replay` (`--compile reduce-overhead`): a pass recorded once and replayed
/// computes what the enqueued pass computes, for new inputs each time; backends that cannot
/// record say why.
fn replayed_pass_matches_the_enqueued_one(kind: BackendKind) {
    let graph = tiny_bottleneck([1, 1, 1, 1], [4, 8, 8, 16]);
    let (graph, w, _) =
        workshop::model::passes::optimize(&graph, random_weights(&graph, 5)).unwrap();
    let plan = graph.plan(2, 32, 32).unwrap();
    let opt = |replay| ExecOptions {
        replay,
        threads: Some(2),
        ..Default::default()
    };
    let (Some(mut plain), Some(mut replayed)) = (
        session_with(kind, &plan, &w, &opt(false)),
        session_with(kind, &plan, &w, &opt(true)),
    ) else {
        return;
    };
    match (kind, replayed.replay()) {
        (BackendKind::Cuda | BackendKind::Hip, Ok(how)) => {
            assert!(how.contains("graph of"), "{how}")
        }
        (BackendKind::Cpu | BackendKind::Wgpu, Err(why)) => assert!(!why.is_empty()),
        (k, r) => panic!("{k}: unexpected replay state {r:?}"),
    }
    assert!(plain.replay().is_err(), "replay was not asked for");
    for seed in [1, 2] {
        let x = Rng::new(seed).normal_tensor(vec![2, 3, 32, 32]);
        let mut out = Vec::new();
        for s in [&mut plain, &mut replayed] {
            s.run(&x).unwrap();
            s.sync().unwrap();
            out.push(s.read_output().unwrap());
        }
        assert_eq!(out[0], out[1], "{kind}: seed {seed}");
    }
}
backend_test!(replayed_pass_matches_the_enqueued_one, cpu, wgpu, cuda, hip);

/// The CPU backend's Winograd paths F(2×2, 3×3) and F(4×4, 3×3), forced on layers of every
/// awkward shape (odd sizes leave partial tiles; padding 0, 1 and 2; bias; a fused residual and
/// ReLU; both schedules), against the reference. They run by default only on layers with ≥ 32 channels.
#[test]
fn winograd_matches_the_reference() {
    use workshop::backend::cpu::winograd::VARIANTS;
    let cases = [
        ("odd", 5, 7, 1, [2, 5, 9, 7]),
        ("no_pad", 8, 3, 0, [1, 8, 6, 5]),
        ("pad2", 3, 4, 2, [1, 3, 4, 4]),
        ("one_pixel", 4, 6, 1, [1, 4, 1, 1]),
        ("wide", 40, 24, 1, [3, 40, 11, 13]),
        // More weights than tiles: the stage-by-stage schedule (F(4×4) here, F(2×2) below).
        ("few_tiles", 64, 64, 1, [2, 64, 12, 12]),
        ("few_tiles_small", 64, 64, 1, [1, 64, 8, 8]),
    ];
    for ((name, cin, cout, pad, shape), variant) in
        cases.into_iter().flat_map(|c| VARIANTS.map(|v| (c, v)))
    {
        let mut g = GraphBuilder::new(name, cin, ConvInit::TorchDefault, LinearInit::TorchDefault);
        let x = g.input();
        let a = g.conv("a", x, Conv2d::new(cin, cout, 3, 1, pad).with_bias());
        // `b` adds its input back (a residual) and applies ReLU in its epilogue.
        let fused = Conv2d {
            residual: true,
            act: workshop::model::op::Act::Relu,
            ..Conv2d::new(cout, cout, 3, 1, 1)
        };
        let y = g.add_node("b", Op::Conv2d(fused), &[a, a]);
        let graph = g.finish(y);
        let plan = graph.plan(shape[0], shape[2], shape[3]).unwrap();
        let w = random_weights(&graph, 3);
        let x = Rng::new(8).normal_tensor(shape.to_vec());
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            // The reference sees the input and weights as this precision stores them.
            let round = |t: &Tensor| {
                Tensor::new(
                    t.shape.clone(),
                    t.data.iter().map(|&v| precision.round(v)).collect(),
                )
            };
            let mut wr = w.clone();
            wr.iter_mut().for_each(|(_, t)| *t = round(t));
            let expected = reference::forward(&plan, &wr, &round(&x));
            let opt = ExecOptions {
                precision,
                threads: Some(2),
                variants: ["a", "b"]
                    .into_iter()
                    .map(|n| (n.to_string(), variant.to_string()))
                    .collect(),
                ..Default::default()
            };
            let b = workshop::backend::open(BackendKind::Cpu).unwrap();
            let mut s = b.prepare(0, &plan, &w, &opt).unwrap();
            s.run(&x).unwrap();
            let got = s.read_output().unwrap();
            let scale = expected.data.iter().fold(1f32, |m, v| m.max(v.abs()));
            let diff = got.max_abs_diff(&expected);
            assert!(
                diff <= tolerance(precision) * scale,
                "{name} {variant} {precision}: {diff} vs {scale}"
            );
        }
    }
}

/// A small vision transformer (patch convolution, class token, position embedding, pre-norm
/// blocks with multi-head attention and a GELU MLP, final norm, class-token head) against the
/// reference in every precision, with a token count that is not a multiple of the attention's
/// query block, on every backend.
fn vision_transformer(kind: BackendKind) {
    let cfg = crate::common::tiny_vit();
    let g = workshop::model::zoo::vit_custom("tiny_vit", &cfg);
    check(kind, &g, [2, 3, 40, 40], 1.0);
    // 26 tokens per image in one block, then 2 images × 65 tokens (three blocks, one short).
    let big = workshop::model::zoo::VitConfig {
        image_size: 64,
        ..cfg
    };
    check(
        kind,
        &workshop::model::zoo::vit_custom("vit64", &big),
        [2, 3, 64, 64],
        1.0,
    );
    // The head sizes the GPU backends have tiled attention kernels for (ViT-B's 64 among them),
    // over 145 tokens: two query tiles of 128 (one short) and a short last tile of keys.
    for (heads, dh) in [(2, 32), (1, 64), (1, 80)] {
        let wide = workshop::model::zoo::VitConfig {
            image_size: 48,
            patch: 4,
            layers: 1,
            heads,
            hidden: heads * dh,
            mlp: 32,
            ..cfg
        };
        let name = format!("vit_dh{dh}");
        let g = workshop::model::zoo::vit_custom(&name, &wide);
        check(kind, &g, [2, 3, 48, 48], 1.0);
    }
    // Another input size does not fit the position embedding: said, with the size that does.
    let e = g.plan(1, 48, 48).unwrap_err().to_string();
    assert!(e.contains("--input-size 40"), "{e}");
}
backend_test!(vision_transformer, cpu, wgpu, cuda, hip);

/// The newer networks' activations (tanh too) and squeeze-and-excitation's channel scaling,
/// against the reference in every precision, with inputs wide enough to reach every piece of
/// hardswish and hardsigmoid (below −3, between, above +3).
fn activations_and_channel_scaling(kind: BackendKind) {
    use workshop::model::op::Unary;
    let mut g = GraphBuilder::new("se", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let a = g.conv("conv", x, Conv2d::new(3, 8, 3, 1, 1));
    let a = g.unary("hardswish", a, Unary::Hardswish);
    let s = g.adaptive_avg_pool("pool", a, (1, 1));
    let s = g.unary("hardsigmoid", s, Unary::Hardsigmoid);
    let y = g.add_node("scale", Op::ScaleChannels, &[a, s]);
    let y = g.unary("silu", y, Unary::Silu);
    // tanh's tails (±1 past about ±9) and its steep middle.
    let t = g.unary("tanh", a, Unary::Tanh);
    let y = g.add("sum", y, t);
    check(kind, &g.finish(y), [2, 3, 7, 5], 4.0);
}
backend_test!(activations_and_channel_scaling, cpu, wgpu, cuda, hip);

/// ConvNeXt's ops: layer norm over an image's channels, tokens and back onto the image's grid
/// (non-square), linear layers on tokens, and the per-channel layer scale, against the
/// reference in every precision.
fn channels_last_block(kind: BackendKind) {
    let mut g = GraphBuilder::new("cn", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let x = g.conv("conv", x, Conv2d::new(3, 6, 3, 1, 1).with_bias());
    let x = g.add_node("norm2d", Op::layer_norm(6, 1e-6), &[x]);
    let y = g.add_node("tokens", Op::Tokens, &[x]);
    let y = g.add_node("norm", Op::layer_norm(6, 1e-6), &[y]);
    let y = g.linear("fc1", y, 6, 12);
    let y = g.add_node("gelu", Op::Gelu, &[y]);
    let y = g.linear("fc2", y, 12, 6);
    let y = g.add_node("image", Op::Image, &[y, x]);
    let y = g.add_node("layer_scale", Op::LayerScale { channels: 6 }, &[y]);
    let y = g.add("add", y, x);
    check(kind, &g.finish(y), [2, 3, 5, 7], 1.0);
}
backend_test!(channels_last_block, cpu, wgpu, cuda, hip);

/// Concatenation along the channels: three inputs of different widths (one of them the
/// graph's input itself), then a convolution that reads across their seams, in every
/// precision.
fn concat_channels(kind: BackendKind) {
    let mut g = GraphBuilder::new("cat", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let a = g.conv("a", x, Conv2d::new(3, 5, 3, 1, 1));
    let b = g.conv("b", x, Conv2d::new(3, 2, 1, 1, 0));
    let y = g.add_node("cat", Op::Concat { parts: 3 }, &[a, x, b]);
    let y = g.conv("mix", y, Conv2d::new(10, 4, 3, 1, 1));
    let y = g.add_node("cat2", Op::Concat { parts: 2 }, &[y, a]);
    check(kind, &g.finish(y), [2, 3, 5, 7], 1.0);
}
backend_test!(concat_channels, cpu, wgpu, cuda, hip);

/// ShuffleNetV2's unit: a slice of the channels, a concatenation, a shuffle in 3 groups (so a
/// wrong group order shows), and a slice from the middle, in every precision.
fn channel_slice_and_shuffle(kind: BackendKind) {
    let mut g = GraphBuilder::new("shuf", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let x = g.conv("conv", x, Conv2d::new(3, 6, 3, 1, 1));
    let a = g.add_node("lo", Op::ChannelSlice { start: 0, count: 3 }, &[x]);
    let b = g.add_node("hi", Op::ChannelSlice { start: 3, count: 3 }, &[x]);
    let b = g.conv("branch", b, Conv2d::new(3, 6, 1, 1, 0));
    let y = g.add_node("cat", Op::Concat { parts: 2 }, &[a, b]);
    let y = g.add_node("shuffle", Op::ChannelShuffle { groups: 3 }, &[y]);
    let y = g.add_node("mid", Op::ChannelSlice { start: 2, count: 5 }, &[y]);
    check(kind, &g.finish(y), [2, 3, 5, 7], 1.0);
}
backend_test!(channel_slice_and_shuffle, cpu, wgpu, cuda, hip);

/// A padded 3×3 convolution on a 1×1 image reads only its centre tap: the wgpu GEMM once took
/// every 1×1 image for a linear layer's and read the wrong weights (DenseNet's last block at
/// a 32×32 input). Also a padded 1×1 kernel, whose output is larger than its input.
fn kernels_on_one_pixel(kind: BackendKind) {
    let mut g = GraphBuilder::new("px", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let y = g.conv("k3", x, Conv2d::new(3, 5, 3, 1, 1).with_bias());
    let y = g.conv("k1", y, Conv2d::new(5, 4, 1, 1, 1));
    check(kind, &g.finish(y), [2, 3, 1, 1], 1.0);
}
backend_test!(kernels_on_one_pixel, cpu, wgpu, cuda, hip);

/// Swin's shifted window attention and patch merging against the reference (torchvision's
/// steps in f64), in every precision: a grid that pads to whole windows and shifts, then a
/// grid one window covers (no shift), Swin V2's cosine form, an odd grid to merge, and heads
/// of 4 values; then 81 keys a window, and heads of 48 values.
fn shifted_windows(kind: BackendKind) {
    let mut g = GraphBuilder::new("swin", 3, ConvInit::TorchDefault, LinearInit::TorchDefault);
    let x = g.input();
    let x = g.conv("conv", x, Conv2d::new(3, 8, 3, 1, 1));
    let attention = |shift, form| {
        Op::WindowAttention(WindowAttention {
            dim: 8,
            heads: 2,
            window: 3,
            shift,
            form,
        })
    };
    let y = g.add_node("shifted", attention(1, WindowForm::Swin), &[x]);
    let x = g.add("add", x, y);
    let y = g.add_node("plain", attention(0, WindowForm::Swin), &[x]);
    let x = g.add("add2", x, y);
    // Swin V2: cosine attention, its bias from an MLP, no bias on k.
    let y = g.add_node("v2", attention(1, WindowForm::SwinV2), &[x]);
    let x = g.add("add3", x, y);
    let x = g.add_node("merge", Op::PatchMerge, &[x]);
    let y = g.add_node(
        "small",
        Op::WindowAttention(WindowAttention {
            dim: 32,
            heads: 8,
            window: 3,
            shift: 1,
            form: WindowForm::Swin,
        }),
        &[x],
    );
    check(kind, &g.finish(y), [2, 3, 5, 7], 1.0);
    // (dim, heads, window, shift, form), the input's shape and scale, for a window
    // attention after a convolution.
    let cases = [
        // 81 keys a window: more than one 64-key block of the CPU's score loop.
        ((8, 2, 9, 4, WindowForm::SwinV2), [1, 3, 10, 9], 1.0),
        // Heads of 48 values (a whole 32 and a part of the CPU's bf16 value pairs) and 49
        // keys a window, an odd number, as Swin-T's; inputs large enough that a dropped
        // value shows.
        ((96, 2, 7, 3, WindowForm::Swin), [1, 3, 9, 10], 16.0),
        // Heads of whole K steps of AMX's tiles (where the CPU has them): Swin-T's 32 values
        // and 49 keys (two 32-row blocks of queries), and 64 values (two steps) over 16
        // keys, V2's cosine form.
        ((64, 2, 7, 3, WindowForm::Swin), [2, 3, 9, 10], 16.0),
        ((128, 2, 4, 2, WindowForm::SwinV2), [1, 3, 6, 7], 4.0),
    ];
    for ((dim, heads, window, shift, form), shape, scale) in cases {
        let attention = WindowAttention {
            dim,
            heads,
            window,
            shift,
            form,
        };
        one_window_attention(kind, attention, shape, scale);
    }
}

/// A convolution to `attention.dim` channels, then `attention`, against the reference.
fn one_window_attention(
    kind: BackendKind,
    attention: WindowAttention,
    shape: [usize; 4],
    input_scale: f32,
) {
    let mut g = GraphBuilder::new(
        "window",
        3,
        ConvInit::TorchDefault,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let x = g.conv("conv", x, Conv2d::new(3, attention.dim, 3, 1, 1));
    let y = g.add_node("attention", Op::WindowAttention(attention), &[x]);
    check(kind, &g.finish(y), shape, input_scale);
}
backend_test!(shifted_windows, cpu, wgpu, cuda, hip);

/// MaxViT's partition attention against the reference (its window and grid partitions as
/// torchvision's reshapes, permutes and swap of axes compute them, in f64), on a 6×9 grid of
/// 3×3 windows: blocks of 2×3 pixels for the grid form, so each side's stride is its own.
fn partition_attention(kind: BackendKind) {
    let mut g = GraphBuilder::new(
        "maxvit",
        3,
        ConvInit::TorchDefault,
        LinearInit::TorchDefault,
    );
    let x = g.input();
    let x = g.conv("conv", x, Conv2d::new(3, 8, 3, 1, 1));
    let attention = |form| {
        Op::WindowAttention(WindowAttention {
            dim: 8,
            heads: 2,
            window: 3,
            shift: 0,
            form,
        })
    };
    let y = g.add_node("window", attention(WindowForm::MaxVitWindow), &[x]);
    let x = g.add("add", x, y);
    let y = g.add_node("grid", attention(WindowForm::MaxVitGrid), &[x]);
    let x = g.add("add2", x, y);
    check(kind, &g.finish(x), [2, 3, 6, 9], 1.0);
}
backend_test!(partition_attention, cpu, wgpu, cuda, hip);

/// Layer chains as `--network` writes them (`model::zoo::layer`) on every backend against the
/// reference, and a second pass by `Session::rerun` (the input kept on the device, as layer
/// benchmarks run) gives the output of the first.
fn layer_chains(kind: BackendKind) {
    for (spec, shape) in [
        (
            "conv2d(6, 8, 3, padding=1)+relu+maxpool2d(2)+batchnorm2d(8)",
            [2, 6, 9, 8],
        ),
        (
            "conv2d(8, 8, 3, stride=2, padding=2, dilation=2, groups=2, bias=False)+silu",
            [1, 8, 7, 7],
        ),
        (
            "layernorm(16)+multiheadattention(16, 2)+linear(16, 24)+gelu",
            [2, 16, 3, 4],
        ),
    ] {
        let graph = workshop::model::zoo::build(spec).unwrap();
        check(kind, &graph, shape, 1.0);
        let plan = graph.plan(shape[0], shape[2], shape[3]).unwrap();
        let w = random_weights(&graph, 3);
        let Some(mut s) = session(kind, &plan, &w, Precision::Fp32) else {
            return;
        };
        let x = Rng::new(5).normal_tensor(shape.to_vec());
        s.run(&x).unwrap();
        s.sync().unwrap();
        let first = s.read_output().unwrap();
        let kept = s.rerun().unwrap();
        assert_eq!(kept, kind != BackendKind::Cpu, "{spec} on {kind}");
        s.sync().unwrap();
        assert_eq!(
            s.read_output().unwrap().data,
            first.data,
            "{spec} on {kind}"
        );
    }
}

backend_test!(layer_chains, cpu, wgpu, cuda, hip);

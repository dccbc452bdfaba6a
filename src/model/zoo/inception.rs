//! GoogLeNet (Szegedy et al. 2014) and Inception v3 (2015) as torchvision builds them: blocks
//! of parallel branches (1×1, 3×3, 5×5 or factorised 1×7/7×1 convolutions, pooling) whose
//! outputs are concatenated along the channels; every convolution a `BasicConv2d` (conv
//! without bias, batch norm with ε = 0.001, ReLU). Their auxiliary classifiers run only in
//! training: they are in the state_dict (`Graph::training_only`) but not in the graph.
//! torchvision's `transform_input` is off, as its constructors leave it without weights.

use crate::model::Graph;
use crate::model::graph::{ConvInit, GraphBuilder, LinearInit, ValueId};
use crate::model::op::{Conv2d, Op, Pool};

/// A `BasicConv2d` at `p`: `{p}.conv`, `{p}.bn`, and the ReLU.
fn basic(g: &mut GraphBuilder, p: &str, x: ValueId, conv: Conv2d) -> ValueId {
    let channels = conv.out_channels;
    let y = g.conv(format!("{p}.conv"), x, conv);
    let y = g.add_node(
        format!("{p}.bn"),
        Op::BatchNorm {
            channels,
            eps: 1e-3,
        },
        &[y],
    );
    g.relu(format!("{p}.relu"), y)
}

/// A `BasicConv2d`'s modules as training-only (an auxiliary classifier's).
fn basic_training_only(g: &mut GraphBuilder, p: &str, conv: Conv2d) {
    let channels = conv.out_channels;
    g.training_only(format!("{p}.conv"), Op::Conv2d(conv));
    g.training_only(
        format!("{p}.bn"),
        Op::BatchNorm {
            channels,
            eps: 1e-3,
        },
    );
}

/// A rectangular convolution without bias: kernel (kh, kw), padding (ph, pw), stride 1.
fn rect(cin: usize, cout: usize, (kh, kw): (usize, usize), (ph, pw): (usize, usize)) -> Conv2d {
    Conv2d {
        kernel: (kh, kw),
        padding: (ph, pw),
        ..Conv2d::new(cin, cout, 1, 1, 0)
    }
}

fn linear_training_only(g: &mut GraphBuilder, name: &str, in_features: usize, out: usize) {
    let op = Op::linear(in_features, out, true);
    g.training_only(name, op);
}

fn concat(g: &mut GraphBuilder, name: String, parts: &[ValueId]) -> ValueId {
    g.add_node(name, Op::Concat { parts: parts.len() }, parts)
}

/// torchvision's `MaxPool2d(kernel, stride, ceil_mode=True)`.
fn ceil_pool(kernel: usize, stride: usize, padding: usize) -> Pool {
    Pool {
        ceil_mode: true,
        ..Pool::new(kernel, stride, padding)
    }
}

/// GoogLeNet's nine inception blocks: input, 1×1, 3×3 reduce, 3×3, "5×5" reduce, "5×5" (a
/// 3×3 in torchvision, as in its original port), pool projection.
const GOOGLENET: [(&str, [usize; 7]); 9] = [
    ("inception3a", [192, 64, 96, 128, 16, 32, 32]),
    ("inception3b", [256, 128, 128, 192, 32, 96, 64]),
    ("inception4a", [480, 192, 96, 208, 16, 48, 64]),
    ("inception4b", [512, 160, 112, 224, 24, 64, 64]),
    ("inception4c", [512, 128, 128, 256, 24, 64, 64]),
    ("inception4d", [512, 112, 144, 288, 32, 64, 64]),
    ("inception4e", [528, 256, 160, 320, 32, 128, 128]),
    ("inception5a", [832, 256, 160, 320, 32, 128, 128]),
    ("inception5b", [832, 384, 192, 384, 48, 128, 128]),
];

pub fn googlenet(classes: usize) -> Graph {
    let mut g = GraphBuilder::new(
        "googlenet",
        3,
        ConvInit::TruncNormal001,
        LinearInit::TruncNormal001,
    );
    let x = g.input();
    let x = basic(&mut g, "conv1", x, Conv2d::new(3, 64, 7, 2, 3));
    let x = g.max_pool("maxpool1", x, ceil_pool(3, 2, 0));
    let x = basic(&mut g, "conv2", x, Conv2d::new(64, 64, 1, 1, 0));
    let x = basic(&mut g, "conv3", x, Conv2d::new(64, 192, 3, 1, 1));
    let mut x = g.max_pool("maxpool2", x, ceil_pool(3, 2, 0));
    for (name, [cin, c1, c3r, c3, c5r, c5, proj]) in GOOGLENET {
        let b1 = basic(
            &mut g,
            &format!("{name}.branch1"),
            x,
            Conv2d::new(cin, c1, 1, 1, 0),
        );
        let b2 = basic(
            &mut g,
            &format!("{name}.branch2.0"),
            x,
            Conv2d::new(cin, c3r, 1, 1, 0),
        );
        let b2 = basic(
            &mut g,
            &format!("{name}.branch2.1"),
            b2,
            Conv2d::new(c3r, c3, 3, 1, 1),
        );
        let b3 = basic(
            &mut g,
            &format!("{name}.branch3.0"),
            x,
            Conv2d::new(cin, c5r, 1, 1, 0),
        );
        let b3 = basic(
            &mut g,
            &format!("{name}.branch3.1"),
            b3,
            Conv2d::new(c5r, c5, 3, 1, 1),
        );
        let b4 = g.max_pool(format!("{name}.branch4.0"), x, ceil_pool(3, 1, 1));
        let b4 = basic(
            &mut g,
            &format!("{name}.branch4.1"),
            b4,
            Conv2d::new(cin, proj, 1, 1, 0),
        );
        x = concat(&mut g, format!("{name}.cat"), &[b1, b2, b3, b4]);
        match name {
            "inception3b" => x = g.max_pool("maxpool3", x, ceil_pool(3, 2, 0)),
            "inception4e" => x = g.max_pool("maxpool4", x, ceil_pool(2, 2, 0)),
            _ => {}
        }
    }
    // The auxiliary classifiers on inception4a's and 4d's outputs (training only).
    for (aux, cin) in [("aux1", 512), ("aux2", 528)] {
        basic_training_only(
            &mut g,
            &format!("{aux}.conv"),
            Conv2d::new(cin, 128, 1, 1, 0),
        );
        linear_training_only(&mut g, &format!("{aux}.fc1"), 2048, 1024);
        linear_training_only(&mut g, &format!("{aux}.fc2"), 1024, classes);
    }
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.flatten("flatten", x);
    let x = g.dropout("dropout", x, 0.2);
    let x = g.linear("fc", x, 1024, classes);
    g.finish(x)
}

pub fn inception_v3(classes: usize) -> Graph {
    let mut g = GraphBuilder::new(
        "inception_v3",
        3,
        ConvInit::TruncNormal01,
        LinearInit::TruncNormal01,
    );
    g.input_size(299);
    let x = g.input();
    let x = basic(&mut g, "Conv2d_1a_3x3", x, Conv2d::new(3, 32, 3, 2, 0));
    let x = basic(&mut g, "Conv2d_2a_3x3", x, Conv2d::new(32, 32, 3, 1, 0));
    let x = basic(&mut g, "Conv2d_2b_3x3", x, Conv2d::new(32, 64, 3, 1, 1));
    let x = g.max_pool("maxpool1", x, Pool::new(3, 2, 0));
    let x = basic(&mut g, "Conv2d_3b_1x1", x, Conv2d::new(64, 80, 1, 1, 0));
    let x = basic(&mut g, "Conv2d_4a_3x3", x, Conv2d::new(80, 192, 3, 1, 0));
    let mut x = g.max_pool("maxpool2", x, Pool::new(3, 2, 0));
    for (name, cin, pool) in [
        ("Mixed_5b", 192, 32),
        ("Mixed_5c", 256, 64),
        ("Mixed_5d", 288, 64),
    ] {
        x = inception_a(&mut g, name, x, cin, pool);
    }
    x = inception_b(&mut g, "Mixed_6a", x, 288);
    for (name, c7) in [
        ("Mixed_6b", 128),
        ("Mixed_6c", 160),
        ("Mixed_6d", 160),
        ("Mixed_6e", 192),
    ] {
        x = inception_c(&mut g, name, x, c7);
    }
    basic_training_only(&mut g, "AuxLogits.conv0", Conv2d::new(768, 128, 1, 1, 0));
    basic_training_only(&mut g, "AuxLogits.conv1", Conv2d::new(128, 768, 5, 1, 0));
    linear_training_only(&mut g, "AuxLogits.fc", 768, classes);
    x = inception_d(&mut g, "Mixed_7a", x);
    x = inception_e(&mut g, "Mixed_7b", x, 1280);
    x = inception_e(&mut g, "Mixed_7c", x, 2048);
    let x = g.adaptive_avg_pool("avgpool", x, (1, 1));
    let x = g.dropout("dropout", x, 0.5);
    let x = g.flatten("flatten", x);
    let x = g.linear("fc", x, 2048, classes);
    g.finish(x)
}

/// A 3×3 average pool of stride 1 and padding 1 (the pooling branch of blocks A, C and E).
fn avg3(g: &mut GraphBuilder, name: String, x: ValueId) -> ValueId {
    g.add_node(name, Op::AvgPool(Pool::new(3, 1, 1)), &[x])
}

fn inception_a(g: &mut GraphBuilder, p: &str, x: ValueId, cin: usize, pool: usize) -> ValueId {
    let c = |a, b, k: usize| Conv2d::new(a, b, k, 1, k / 2);
    let b1 = basic(g, &format!("{p}.branch1x1"), x, c(cin, 64, 1));
    let b5 = basic(g, &format!("{p}.branch5x5_1"), x, c(cin, 48, 1));
    let b5 = basic(g, &format!("{p}.branch5x5_2"), b5, c(48, 64, 5));
    let b3 = basic(g, &format!("{p}.branch3x3dbl_1"), x, c(cin, 64, 1));
    let b3 = basic(g, &format!("{p}.branch3x3dbl_2"), b3, c(64, 96, 3));
    let b3 = basic(g, &format!("{p}.branch3x3dbl_3"), b3, c(96, 96, 3));
    let bp = avg3(g, format!("{p}.avg_pool"), x);
    let bp = basic(g, &format!("{p}.branch_pool"), bp, c(cin, pool, 1));
    concat(g, format!("{p}.cat"), &[b1, b5, b3, bp])
}

fn inception_b(g: &mut GraphBuilder, p: &str, x: ValueId, cin: usize) -> ValueId {
    let b3 = basic(
        g,
        &format!("{p}.branch3x3"),
        x,
        Conv2d::new(cin, 384, 3, 2, 0),
    );
    let bd = basic(
        g,
        &format!("{p}.branch3x3dbl_1"),
        x,
        Conv2d::new(cin, 64, 1, 1, 0),
    );
    let bd = basic(
        g,
        &format!("{p}.branch3x3dbl_2"),
        bd,
        Conv2d::new(64, 96, 3, 1, 1),
    );
    let bd = basic(
        g,
        &format!("{p}.branch3x3dbl_3"),
        bd,
        Conv2d::new(96, 96, 3, 2, 0),
    );
    let bp = g.max_pool(format!("{p}.max_pool"), x, Pool::new(3, 2, 0));
    concat(g, format!("{p}.cat"), &[b3, bd, bp])
}

fn inception_c(g: &mut GraphBuilder, p: &str, x: ValueId, c7: usize) -> ValueId {
    let (row, col) = (((1, 7), (0, 3)), ((7, 1), (3, 0)));
    let one = |a, b| Conv2d::new(a, b, 1, 1, 0);
    let b1 = basic(g, &format!("{p}.branch1x1"), x, one(768, 192));
    let b7 = basic(g, &format!("{p}.branch7x7_1"), x, one(768, c7));
    let b7 = basic(
        g,
        &format!("{p}.branch7x7_2"),
        b7,
        rect(c7, c7, row.0, row.1),
    );
    let b7 = basic(
        g,
        &format!("{p}.branch7x7_3"),
        b7,
        rect(c7, 192, col.0, col.1),
    );
    let mut bd = basic(g, &format!("{p}.branch7x7dbl_1"), x, one(768, c7));
    for (i, (k, pad)) in [col, row, col, row].into_iter().enumerate() {
        let out = if i == 3 { 192 } else { c7 };
        bd = basic(
            g,
            &format!("{p}.branch7x7dbl_{}", i + 2),
            bd,
            rect(c7, out, k, pad),
        );
    }
    let bp = avg3(g, format!("{p}.avg_pool"), x);
    let bp = basic(g, &format!("{p}.branch_pool"), bp, one(768, 192));
    concat(g, format!("{p}.cat"), &[b1, b7, bd, bp])
}

fn inception_d(g: &mut GraphBuilder, p: &str, x: ValueId) -> ValueId {
    let one = |a, b| Conv2d::new(a, b, 1, 1, 0);
    let b3 = basic(g, &format!("{p}.branch3x3_1"), x, one(768, 192));
    let b3 = basic(
        g,
        &format!("{p}.branch3x3_2"),
        b3,
        Conv2d::new(192, 320, 3, 2, 0),
    );
    let b7 = basic(g, &format!("{p}.branch7x7x3_1"), x, one(768, 192));
    let b7 = basic(
        g,
        &format!("{p}.branch7x7x3_2"),
        b7,
        rect(192, 192, (1, 7), (0, 3)),
    );
    let b7 = basic(
        g,
        &format!("{p}.branch7x7x3_3"),
        b7,
        rect(192, 192, (7, 1), (3, 0)),
    );
    let b7 = basic(
        g,
        &format!("{p}.branch7x7x3_4"),
        b7,
        Conv2d::new(192, 192, 3, 2, 0),
    );
    let bp = g.max_pool(format!("{p}.max_pool"), x, Pool::new(3, 2, 0));
    concat(g, format!("{p}.cat"), &[b3, b7, bp])
}

/// Block E: its two nested concatenations (the 1×3 and 3×1 halves of two branches) are one
/// six-part concatenation here, which is the same tensor.
fn inception_e(g: &mut GraphBuilder, p: &str, x: ValueId, cin: usize) -> ValueId {
    let one = |a, b| Conv2d::new(a, b, 1, 1, 0);
    let (row, col) = (((1, 3), (0, 1)), ((3, 1), (1, 0)));
    let b1 = basic(g, &format!("{p}.branch1x1"), x, one(cin, 320));
    let b3 = basic(g, &format!("{p}.branch3x3_1"), x, one(cin, 384));
    let b3a = basic(
        g,
        &format!("{p}.branch3x3_2a"),
        b3,
        rect(384, 384, row.0, row.1),
    );
    let b3b = basic(
        g,
        &format!("{p}.branch3x3_2b"),
        b3,
        rect(384, 384, col.0, col.1),
    );
    let bd = basic(g, &format!("{p}.branch3x3dbl_1"), x, one(cin, 448));
    let bd = basic(
        g,
        &format!("{p}.branch3x3dbl_2"),
        bd,
        Conv2d::new(448, 384, 3, 1, 1),
    );
    let bda = basic(
        g,
        &format!("{p}.branch3x3dbl_3a"),
        bd,
        rect(384, 384, row.0, row.1),
    );
    let bdb = basic(
        g,
        &format!("{p}.branch3x3dbl_3b"),
        bd,
        rect(384, 384, col.0, col.1),
    );
    let bp = avg3(g, format!("{p}.avg_pool"), x);
    let bp = basic(g, &format!("{p}.branch_pool"), bp, one(cin, 192));
    concat(g, format!("{p}.cat"), &[b1, b3a, b3b, bda, bdb, bp])
}

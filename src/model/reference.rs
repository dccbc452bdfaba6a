//! A plain, slow reference implementation of every op: NCHW, direct loops, f64 accumulation.
//! It is written for obviousness, not speed; every backend's kernels are tested against it, and
//! it is itself tested against PyTorch fixtures. The loss lives here too, since every backend
//! shares it: it is computed on the host from the logits.

use super::op::{Conv2d, Op, Pool, WindowAttention, WindowForm};
use super::{Plan, Tensor, Weights};

/// Run a planned graph on `input` (NCHW) and return the graph's output.
pub fn forward(plan: &Plan, weights: &Weights, input: &Tensor) -> Tensor {
    assert_eq!(
        input.shape,
        plan.input_shape(),
        "input shape does not match the plan"
    );
    let mut values: Vec<Option<Tensor>> = vec![None; plan.graph.nodes.len()];
    values[0] = Some(input.clone());
    for (id, node) in plan.graph.nodes.iter().enumerate().skip(1) {
        let ins: Vec<&Tensor> = node
            .inputs
            .iter()
            .map(|&i| values[i].as_ref().expect("value computed"))
            .collect();
        let param = |suffix: &str| weights.get(&super::graph::param_name(&node.name, suffix));
        let out = eval(&node.op, &ins, &plan.shapes[id], &param);
        values[id] = Some(out);
    }
    values[plan.graph.output].take().expect("output computed")
}

/// Evaluate one op; `param(suffix)` finds the op's tensors.
pub fn eval<'a>(
    op: &Op,
    ins: &[&Tensor],
    out_shape: &[usize],
    param: &dyn Fn(&str) -> Option<&'a Tensor>,
) -> Tensor {
    let need = |s: &str| param(s).unwrap_or_else(|| panic!("missing parameter {s}"));
    match op {
        Op::Input { .. } => ins[0].clone(),
        Op::Conv2d(c) => {
            let mut y = conv2d(
                ins[0],
                need("weight"),
                if c.bias { Some(need("bias")) } else { None },
                c,
                out_shape,
            );
            if c.residual {
                add_residual(&mut y, ins[1]);
            }
            y.data.iter_mut().for_each(|v| *v = c.act.apply(*v));
            y
        }
        Op::BatchNorm { eps, .. } => batch_norm(
            ins[0],
            need("weight"),
            need("bias"),
            need("running_mean"),
            need("running_var"),
            *eps,
        ),
        // NaN stays NaN, as in PyTorch (`f64::max` would drop it).
        Op::Relu => map(ins[0], |x| if x < 0.0 { 0.0 } else { x }),
        Op::Relu6 => map(ins[0], |x| x.clamp(0.0, 6.0)),
        Op::Sigmoid => map(ins[0], |x| 1.0 / (1.0 + (-x).exp())),
        Op::Unary(u) => map(ins[0], |x| u.apply(x as f64) as f32),
        Op::ScaleChannels => {
            let hw = ins[0].shape[2] * ins[0].shape[3];
            let data = (ins[0].data.iter().enumerate())
                .map(|(i, &v)| (v as f64 * ins[1].data[i / hw] as f64) as f32)
                .collect();
            Tensor::new(ins[0].shape.clone(), data)
        }
        Op::Dropout { .. } => ins[0].clone(),
        Op::MaxPool(p) => pool(ins[0], p, out_shape, true),
        Op::AvgPool(p) => pool(ins[0], p, out_shape, false),
        Op::AdaptiveAvgPool { out } => adaptive_avg_pool(ins[0], *out),
        Op::Add => Tensor::new(
            ins[0].shape.clone(),
            ins[0]
                .data
                .iter()
                .zip(&ins[1].data)
                .map(|(a, b)| a + b)
                .collect(),
        ),
        Op::Linear {
            bias,
            act,
            residual,
            ..
        } => {
            let mut y = linear(
                ins[0],
                need("weight"),
                if *bias { Some(need("bias")) } else { None },
            );
            if *residual {
                add_residual(&mut y, ins[1]);
            }
            y.data.iter_mut().for_each(|v| *v = act.apply(*v));
            y
        }
        Op::Flatten => Tensor::new(out_shape.to_vec(), ins[0].data.clone()),
        Op::Softmax => softmax(ins[0]),
        Op::Tokens => {
            let s = &ins[0].shape;
            Tensor::new(
                out_shape.to_vec(),
                swap_inner(&ins[0].data, s[0], s[1], s[2] * s[3]),
            )
        }
        Op::Image => {
            let s = &ins[0].shape;
            let data = swap_inner(&ins[0].data, s[0], s[1], s[2]);
            Tensor::new(out_shape.to_vec(), data)
        }
        Op::Concat { .. } => {
            let n = out_shape[0];
            let mut data = Vec::with_capacity(out_shape.iter().product());
            for i in 0..n {
                for x in ins {
                    let per_image = x.numel() / n.max(1);
                    data.extend_from_slice(&x.data[i * per_image..(i + 1) * per_image]);
                }
            }
            Tensor::new(out_shape.to_vec(), data)
        }
        Op::WindowAttention(attention) => window_attention(ins[0], &need, attention),
        Op::PatchMerge => {
            let (n, c, h, w) = (
                ins[0].shape[0],
                ins[0].shape[1],
                ins[0].shape[2],
                ins[0].shape[3],
            );
            let (oh, ow) = (out_shape[2], out_shape[3]);
            let mut data = Vec::with_capacity(out_shape.iter().product());
            for img in 0..n {
                // torchvision's order: x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2].
                for (dy, dx) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                    for ch in 0..c {
                        for oy in 0..oh {
                            for ox in 0..ow {
                                let (y, x) = (2 * oy + dy, 2 * ox + dx);
                                data.push(if y < h && x < w {
                                    ins[0].data[((img * c + ch) * h + y) * w + x]
                                } else {
                                    0.0
                                });
                            }
                        }
                    }
                }
            }
            Tensor::new(out_shape.to_vec(), data)
        }
        Op::ChannelSlice { start, count } => {
            let (c, hw) = (ins[0].shape[1], ins[0].shape[2] * ins[0].shape[3]);
            let data = (ins[0].data.chunks(c * hw))
                .flat_map(|image| &image[start * hw..(start + count) * hw])
                .copied()
                .collect();
            Tensor::new(out_shape.to_vec(), data)
        }
        Op::ChannelShuffle { groups } => {
            let (c, hw) = (ins[0].shape[1], ins[0].shape[2] * ins[0].shape[3]);
            let per = c / groups;
            let data = (ins[0].data.chunks(c * hw))
                .flat_map(|image| {
                    (0..c).flat_map(move |o| {
                        let src = (o % groups) * per + o / groups;
                        &image[src * hw..(src + 1) * hw]
                    })
                })
                .copied()
                .collect();
            Tensor::new(out_shape.to_vec(), data)
        }
        Op::LayerScale { .. } => {
            let (c, hw) = (ins[0].shape[1], ins[0].shape[2] * ins[0].shape[3]);
            let gamma = &need("").data;
            let data = (ins[0].data.iter().enumerate())
                .map(|(i, &v)| (v as f64 * gamma[(i / hw) % c] as f64) as f32)
                .collect();
            Tensor::new(ins[0].shape.clone(), data)
        }
        Op::ClassToken { .. } => {
            let (t, d) = (ins[0].shape[1], ins[0].shape[2]);
            let token = &need("").data;
            let mut data = Vec::with_capacity(out_shape.iter().product());
            for image in ins[0].data.chunks(t * d) {
                data.extend_from_slice(token);
                data.extend_from_slice(image);
            }
            Tensor::new(out_shape.to_vec(), data)
        }
        Op::PosEmbed { .. } => {
            let pos = &need("").data;
            let data = (ins[0].data.chunks(pos.len()))
                .flat_map(|image| {
                    image
                        .iter()
                        .zip(pos)
                        .map(|(a, b)| (*a as f64 + *b as f64) as f32)
                })
                .collect();
            Tensor::new(out_shape.to_vec(), data)
        }
        Op::LayerNorm { dim, eps, affine } => {
            let identity = (
                Tensor::new(vec![*dim], vec![1.0; *dim]),
                Tensor::zeros(vec![*dim]),
            );
            let (w, b) = match affine {
                true => (need("weight"), need("bias")),
                false => (&identity.0, &identity.1),
            };
            match *ins[0].shape {
                // Over the channels of an image: normalise its tokens, then back.
                [n, c, h, wd] => {
                    let tokens = swap_inner(&ins[0].data, n, c, h * wd);
                    let tokens = Tensor::new(vec![n, h * wd, c], tokens);
                    let y = layer_norm(&tokens, w, b, *dim, *eps);
                    Tensor::new(ins[0].shape.clone(), swap_inner(&y.data, n, h * wd, c))
                }
                _ => layer_norm(ins[0], w, b, *dim, *eps),
            }
        }
        Op::Gelu => map(ins[0], |x| {
            let x = x as f64;
            (0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))) as f32
        }),
        Op::Attention {
            dim,
            heads,
            residual,
        } => {
            let mut y = attention(ins[0], &need, *dim, *heads);
            if *residual {
                add_residual(&mut y, ins[1]);
            }
            y
        }
        Op::SelectToken { index } => {
            let (t, d) = (ins[0].shape[1], ins[0].shape[2]);
            let data = (ins[0].data.chunks(t * d))
                .flat_map(|image| image[index * d..(index + 1) * d].to_vec())
                .collect();
            Tensor::new(out_shape.to_vec(), data)
        }
    }
}

/// A fused residual added to a GEMM's output (before its activation), summed in f64.
fn add_residual(y: &mut Tensor, r: &Tensor) {
    for (v, r) in y.data.iter_mut().zip(&r.data) {
        *v = (*v as f64 + *r as f64) as f32;
    }
}

fn map(x: &Tensor, f: impl Fn(f32) -> f32) -> Tensor {
    Tensor::new(x.shape.clone(), x.data.iter().map(|&v| f(v)).collect())
}

pub fn conv2d(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    c: &Conv2d,
    out_shape: &[usize],
) -> Tensor {
    let (n, cin, h, wd) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let (cout, oh, ow) = (out_shape[1], out_shape[2], out_shape[3]);
    let (cin_g, cout_g) = (cin / c.groups, cout / c.groups);
    let (kh, kw) = c.kernel;
    let mut out = vec![0f32; n * cout * oh * ow];
    for b_i in 0..n {
        for co in 0..cout {
            let g = co / cout_g;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = b.map_or(0.0, |b| b.data[co] as f64);
                    for ci in 0..cin_g {
                        let cin_idx = g * cin_g + ci;
                        for ky in 0..kh {
                            let iy = (oy * c.stride.0 + ky * c.dilation.0) as isize
                                - c.padding.0 as isize;
                            if iy < 0 || iy >= h as isize {
                                continue;
                            }
                            for kx in 0..kw {
                                let ix = (ox * c.stride.1 + kx * c.dilation.1) as isize
                                    - c.padding.1 as isize;
                                if ix < 0 || ix >= wd as isize {
                                    continue;
                                }
                                let xv = x.data
                                    [((b_i * cin + cin_idx) * h + iy as usize) * wd + ix as usize];
                                let wv = w.data[((co * cin_g + ci) * kh + ky) * kw + kx];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    out[((b_i * cout + co) * oh + oy) * ow + ox] = acc as f32;
                }
            }
        }
    }
    Tensor::new(out_shape.to_vec(), out)
}

pub fn batch_norm(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    eps: f32,
) -> Tensor {
    let c = x.shape[1];
    let plane: usize = x.shape[2..].iter().product();
    let data = x
        .data
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let ch = (i / plane) % c;
            let inv = 1.0 / (var.data[ch] as f64 + eps as f64).sqrt();
            ((v as f64 - mean.data[ch] as f64) * inv * gamma.data[ch] as f64 + beta.data[ch] as f64)
                as f32
        })
        .collect();
    Tensor::new(x.shape.clone(), data)
}

fn pool(x: &Tensor, p: &Pool, out_shape: &[usize], max: bool) -> Tensor {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let (oh, ow) = (out_shape[2], out_shape[3]);
    let mut out = Vec::with_capacity(n * c * oh * ow);
    for plane in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let y0 = (oy * p.stride.0) as isize - p.padding.0 as isize;
                let x0 = (ox * p.stride.1) as isize - p.padding.1 as isize;
                let mut best = f64::NEG_INFINITY;
                let mut sum = 0f64;
                let mut count = 0usize;
                for ky in 0..p.kernel.0 as isize {
                    for kx in 0..p.kernel.1 as isize {
                        let (iy, ix) = (y0 + ky, x0 + kx);
                        // The divisor counts the window clipped to the padded input (PyTorch).
                        if iy < h as isize + p.padding.0 as isize
                            && ix < w as isize + p.padding.1 as isize
                        {
                            count += 1;
                        }
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                            continue;
                        }
                        let v = x.data[(plane * h + iy as usize) * w + ix as usize] as f64;
                        best = if v > best || v.is_nan() { v } else { best };
                        sum += v;
                    }
                }
                let v = if max {
                    best
                } else if p.count_include_pad {
                    sum / count as f64
                } else {
                    let inside = (0..p.kernel.0 as isize)
                        .flat_map(|ky| (0..p.kernel.1 as isize).map(move |kx| (y0 + ky, x0 + kx)))
                        .filter(|&(iy, ix)| {
                            iy >= 0 && ix >= 0 && iy < h as isize && ix < w as isize
                        })
                        .count();
                    sum / inside as f64
                };
                out.push(v as f32);
            }
        }
    }
    Tensor::new(out_shape.to_vec(), out)
}

/// PyTorch's adaptive bins: start = ⌊i·H/oh⌋, end = ⌈(i+1)·H/oh⌉.
pub fn adaptive_bins(size: usize, out: usize, i: usize) -> (usize, usize) {
    (i * size / out, ((i + 1) * size).div_ceil(out))
}

fn adaptive_avg_pool(x: &Tensor, out: (usize, usize)) -> Tensor {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let mut data = Vec::with_capacity(n * c * out.0 * out.1);
    for plane in 0..n * c {
        for oy in 0..out.0 {
            let (y0, y1) = adaptive_bins(h, out.0, oy);
            for ox in 0..out.1 {
                let (x0, x1) = adaptive_bins(w, out.1, ox);
                let mut sum = 0f64;
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        sum += x.data[(plane * h + iy) * w + ix] as f64;
                    }
                }
                data.push((sum / ((y1 - y0) * (x1 - x0)) as f64) as f32);
            }
        }
    }
    Tensor::new(vec![n, c, out.0, out.1], data)
}

/// `nn.LayerNorm` over the last `dim` values: biased variance, as PyTorch.
/// (N, A, B) → (N, B, A): an image's channels to tokens and back.
fn swap_inner(x: &[f32], n: usize, a: usize, b: usize) -> Vec<f32> {
    let mut data = Vec::with_capacity(x.len());
    for i in 0..n {
        for q in 0..b {
            data.extend((0..a).map(|p| x[(i * a + p) * b + q]));
        }
    }
    data
}

fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, dim: usize, eps: f32) -> Tensor {
    let mut data = Vec::with_capacity(x.numel());
    for row in x.data.chunks(dim) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        data.extend(
            row.iter().enumerate().map(|(i, &v)| {
                ((v as f64 - mean) * inv * w.data[i] as f64 + b.data[i] as f64) as f32
            }),
        );
    }
    Tensor::new(x.shape.clone(), data)
}

/// Swin's shifted window attention as torchvision's `shifted_window_attention` computes it,
/// step by step in f64: pad to whole windows, roll, partition, project, attend with the
/// relative position bias and the shift mask, project, and put every token back. MaxViT's
/// `PartitionAttentionLayer` attention likewise: its window or grid partition (with the swap
/// of axes), then the same steps without padding, shift or mask.
fn window_attention<'a>(
    x: &Tensor,
    need: &dyn Fn(&str) -> &'a Tensor,
    &WindowAttention {
        dim,
        heads,
        window: ws,
        shift,
        form,
    }: &WindowAttention,
) -> Tensor {
    let v2 = form == WindowForm::SwinV2;
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let (hp, wp) = (h.div_ceil(ws) * ws, w.div_ceil(ws) * ws);
    // No shift along a side one window covers.
    let sh = if ws >= hp { 0 } else { shift };
    let sw = if ws >= wp { 0 } else { shift };
    let [qkv_w, qkv_b, proj_w, proj_b] = form.projections().map(|name| &need(name).data);
    let mut qkv_b: Vec<f64> = qkv_b.iter().map(|&v| v as f64).collect();
    let dh = dim / heads;
    // Swin scales by 1/√dh, MaxViT (k, in torchvision) by 1/√C.
    let scale = match form {
        WindowForm::Swin | WindowForm::SwinV2 => 1.0 / (dh as f64).sqrt(),
        WindowForm::MaxVitWindow | WindowForm::MaxVitGrid => 1.0 / (dim as f64).sqrt(),
    };
    // V1: a learned table and 1/√dh. V2: 16·sigmoid(cpb_mlp(relative_coords_table)), cosine
    // scores scaled by exp(min(logit_scale, ln 100)), and no bias on k.
    let (table, scales): (Vec<f64>, Vec<f64>) = if v2 {
        qkv_b[dim..2 * dim].fill(0.0);
        let (w1, b1) = (&need("cpb_mlp.0.weight").data, &need("cpb_mlp.0.bias").data);
        let w2 = &need("cpb_mlp.2.weight").data;
        let coords = &need("relative_coords_table").data;
        let table = (coords.chunks(2))
            .flat_map(|xy| {
                let mid: Vec<f64> = (0..b1.len())
                    .map(|j| {
                        let v = w1[2 * j] as f64 * xy[0] as f64
                            + w1[2 * j + 1] as f64 * xy[1] as f64
                            + b1[j] as f64;
                        v.max(0.0)
                    })
                    .collect();
                (0..heads)
                    .map(|h| {
                        let v: f64 = (0..b1.len())
                            .map(|j| w2[h * b1.len() + j] as f64 * mid[j])
                            .sum();
                        16.0 / (1.0 + (-v).exp())
                    })
                    .collect::<Vec<f64>>()
            })
            .collect();
        let logit = &need("logit_scale").data;
        let scales = logit
            .iter()
            .map(|&s| (s as f64).min(100f64.ln()).exp())
            .collect();
        (table, scales)
    } else {
        let table = need("relative_position_bias_table")
            .data
            .iter()
            .map(|&v| v as f64);
        (table.collect(), vec![scale; heads])
    };
    // F.normalize: v / max(‖v‖, 1e-12).
    let unit = |v: &[f64]| -> Vec<f64> {
        let norm = v.iter().map(|a| a * a).sum::<f64>().sqrt().max(1e-12);
        v.iter().map(|a| a / norm).collect()
    };
    // The mask's regions of the shifted grid: torchvision's slices (0, -ws), (-ws, -s), (-s, ∞).
    let region = |v: usize, size: usize, s: usize| match s {
        0 => 0,
        _ if v < size - ws => 0,
        _ if v < size - s => 1,
        _ => 2,
    };
    let mut out = vec![0f32; x.numel()];
    for img in 0..n {
        // Token (y', x') of the shifted grid is input pixel (y' + sh, x' + sw) mod the padded
        // size; zeros past the input. MaxViT's grid partition cuts the image into blocks of
        // (H/ws)×(W/ws) pixels (`WindowPartition` with p = H/ws), and after the swap of axes
        // window (a, b) holds pixel (a, b) of every block: token (i, j) is block (i, j)'s.
        let source = |yy: usize, xx: usize| match form {
            WindowForm::MaxVitGrid => {
                let (bh, bw) = (h / ws, w / ws);
                let (a, b, i, j) = (yy / ws, xx / ws, yy % ws, xx % ws);
                (i * bh + a, j * bw + b)
            }
            _ => ((yy + sh) % hp, (xx + sw) % wp),
        };
        let token = |yy: usize, xx: usize| -> Vec<f64> {
            let (y, xo) = source(yy, xx);
            (0..c)
                .map(|ch| match y < h && xo < w {
                    true => x.data[((img * c + ch) * h + y) * w + xo] as f64,
                    false => 0.0,
                })
                .collect()
        };
        for wy in (0..hp).step_by(ws) {
            for wx in (0..wp).step_by(ws) {
                let pos: Vec<(usize, usize)> =
                    (0..ws * ws).map(|i| (wy + i / ws, wx + i % ws)).collect();
                let qkv: Vec<Vec<f64>> = (pos.iter())
                    .map(|&(yy, xx)| {
                        let t = token(yy, xx);
                        (0..3 * dim)
                            .map(|o| {
                                let dot: f64 = (0..c).map(|k| qkv_w[o * c + k] as f64 * t[k]).sum();
                                qkv_b[o] + dot
                            })
                            .collect()
                    })
                    .collect();
                let mut heads_out = vec![vec![0f64; dim]; ws * ws];
                for hd in 0..heads {
                    for i in 0..ws * ws {
                        let head = |j: usize, part: usize| -> Vec<f64> {
                            let v = &qkv[j][part * dim + hd * dh..][..dh];
                            if v2 { unit(v) } else { v.to_vec() }
                        };
                        let q = head(i, 0);
                        let scores: Vec<f64> = (0..ws * ws)
                            .map(|j| {
                                let k = head(j, 1);
                                let dot: f64 =
                                    q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>() * scales[hd];
                                let (yi, xi, yj, xj) = (i / ws, i % ws, j / ws, j % ws);
                                let idx = (yi + ws - 1 - yj) * (2 * ws - 1) + (xi + ws - 1 - xj);
                                let (pi, pj) = (pos[i], pos[j]);
                                let same = region(pi.0, hp, sh) == region(pj.0, hp, sh)
                                    && region(pi.1, wp, sw) == region(pj.1, wp, sw);
                                let mask = if same { 0.0 } else { -100.0 };
                                dot + table[idx * heads + hd] + mask
                            })
                            .collect();
                        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                        let sum: f64 = e.iter().sum();
                        for d in 0..dh {
                            heads_out[i][hd * dh + d] = (0..ws * ws)
                                .map(|j| e[j] / sum * qkv[j][2 * dim + hd * dh + d])
                                .sum();
                        }
                    }
                }
                for (i, &(yy, xx)) in pos.iter().enumerate() {
                    let (y, xo) = source(yy, xx);
                    if y >= h || xo >= w {
                        continue;
                    }
                    for o in 0..dim {
                        let dot: f64 = (0..dim)
                            .map(|k| proj_w[o * dim + k] as f64 * heads_out[i][k])
                            .sum();
                        out[((img * c + o) * h + y) * w + xo] = (proj_b[o] as f64 + dot) as f32;
                    }
                }
            }
        }
    }
    Tensor::new(x.shape.clone(), out)
}

/// Self-attention as `nn.MultiheadAttention(batch_first=True)` computes it, in f64.
fn attention<'a>(
    x: &Tensor,
    need: &dyn Fn(&str) -> &'a Tensor,
    dim: usize,
    heads: usize,
) -> Tensor {
    let (n, t) = (x.shape[0], x.shape[1]);
    let qkv = linear(x, need("in_proj_weight"), Some(need("in_proj_bias")));
    let dh = dim / heads;
    let scale = 1.0 / (dh as f64).sqrt();
    let at = |i: usize, tok: usize, part: usize, h: usize, j: usize| {
        qkv.data[(i * t + tok) * 3 * dim + part * dim + h * dh + j] as f64
    };
    let mut heads_out = vec![0f32; n * t * dim];
    for i in 0..n {
        for h in 0..heads {
            for q in 0..t {
                let scores: Vec<f64> = (0..t)
                    .map(|k| {
                        (0..dh)
                            .map(|j| at(i, q, 0, h, j) * at(i, k, 1, h, j))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for j in 0..dh {
                    let v: f64 = (0..t).map(|k| e[k] * at(i, k, 2, h, j)).sum::<f64>() / sum;
                    heads_out[(i * t + q) * dim + h * dh + j] = v as f32;
                }
            }
        }
    }
    let heads_out = Tensor::new(x.shape.clone(), heads_out);
    linear(
        &heads_out,
        need("out_proj.weight"),
        Some(need("out_proj.bias")),
    )
}

/// `nn.Linear` over the last dimension of any tensor.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let fin = *x.shape.last().expect("linear input has dimensions");
    let n = x.numel() / fin.max(1);
    let fout = w.shape[0];
    let mut out = Vec::with_capacity(n * fout);
    for i in 0..n {
        for o in 0..fout {
            let mut acc = b.map_or(0.0, |b| b.data[o] as f64);
            for k in 0..fin {
                acc += x.data[i * fin + k] as f64 * w.data[o * fin + k] as f64;
            }
            out.push(acc as f32);
        }
    }
    let mut shape = x.shape.clone();
    *shape.last_mut().expect("linear input has dimensions") = fout;
    Tensor::new(shape, out)
}

/// Softmax over the last dimension, computed stably (max subtracted) in f64.
pub fn softmax(x: &Tensor) -> Tensor {
    let last = *x.shape.last().unwrap_or(&1);
    let mut data = Vec::with_capacity(x.numel());
    for row in x.data.chunks(last.max(1)) {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let sum: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        data.extend(row.iter().map(|&v| ((v as f64 - m).exp() / sum) as f32));
    }
    Tensor::new(x.shape.clone(), data)
}

/// Mean cross-entropy of logits (N, classes) against integer labels, as
/// `torch.nn.functional.cross_entropy`: log-sum-exp minus the true class's logit, in f64.
pub fn cross_entropy(logits: &Tensor, labels: &[usize]) -> f64 {
    let classes = logits.shape[1];
    let mut total = 0f64;
    for (row, &label) in logits.data.chunks(classes).zip(labels) {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        total += lse - row[label] as f64;
    }
    total / labels.len().max(1) as f64
}

//! The operator set of the graph IR: what each op is, how it maps input shapes to an output
//! shape, which parameters it owns (with torchvision's state_dict suffixes), and how much work
//! (multiply-accumulates, FLOPs) and traffic (bytes) it costs.
//!
//! Shapes are always written in PyTorch's logical order, NCHW for images and (N, F) for
//! features, whatever layout a backend chooses in memory.

use std::fmt;

/// An activation applied in a kernel's epilogue (compile passes fuse it into a convolution).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Act {
    #[default]
    None,
    Relu,
    Relu6,
    /// x · sigmoid(x) (EfficientNet's expansions).
    Silu,
    /// x · relu6(x + 3) / 6 (MobileNetV3's).
    Hardswish,
    /// x · Φ(x), the exact (erf) form (the transformers' MLPs).
    Gelu,
    /// 1 / (1 + e^(−x)) (EfficientNet's squeeze-and-excitation gate).
    Sigmoid,
    /// relu6(x + 3) / 6 (MobileNetV3's squeeze-and-excitation gate).
    Hardsigmoid,
}

impl Act {
    /// In f32, NaN kept NaN (as the kernels compute it).
    pub fn apply(self, v: f32) -> f32 {
        match self {
            Act::None => v,
            Act::Relu => v.max(0.0),
            Act::Relu6 => v.clamp(0.0, 6.0),
            Act::Silu => v / (1.0 + (-v).exp()),
            Act::Hardswish => v * (v + 3.0).clamp(0.0, 6.0) / 6.0,
            Act::Gelu => 0.5 * v * (1.0 + libm::erff(v * std::f32::consts::FRAC_1_SQRT_2)),
            Act::Sigmoid => 1.0 / (1.0 + (-v).exp()),
            Act::Hardsigmoid => (v + 3.0).clamp(0.0, 6.0) / 6.0,
        }
    }

    /// The activations an epilogue applies, in code order.
    pub const ALL: [Act; 8] = [
        Act::None,
        Act::Relu,
        Act::Relu6,
        Act::Silu,
        Act::Hardswish,
        Act::Gelu,
        Act::Sigmoid,
        Act::Hardsigmoid,
    ];

    /// The standalone op that computes this activation.
    fn op(self) -> Option<Op> {
        Some(match self {
            Act::None => return None,
            Act::Relu => Op::Relu,
            Act::Relu6 => Op::Relu6,
            Act::Silu => Op::Unary(Unary::Silu),
            Act::Hardswish => Op::Unary(Unary::Hardswish),
            Act::Gelu => Op::Gelu,
            Act::Sigmoid => Op::Sigmoid,
            Act::Hardsigmoid => Op::Unary(Unary::Hardsigmoid),
        })
    }

    /// The activation a standalone op computes, if an epilogue can take it over.
    pub fn of(op: &Op) -> Option<Act> {
        Act::ALL.into_iter().find(|a| a.op().as_ref() == Some(op))
    }

    /// The kernels' code: 0 none, 1 ReLU, 2 ReLU6, 3 SiLU, 4 hardswish, 5 GELU, 6 sigmoid,
    /// 7 hardsigmoid.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The name a fused convolution shows (`+silu`).
    pub fn name(self) -> &'static str {
        match self {
            Act::None => "",
            Act::Relu => "relu",
            Act::Relu6 => "relu6",
            Act::Silu => "silu",
            Act::Hardswish => "hardswish",
            Act::Gelu => "gelu",
            Act::Sigmoid => "sigmoid",
            Act::Hardsigmoid => "hardsigmoid",
        }
    }

    /// FLOPs per element, as the unfused op counts them.
    fn flops(self) -> u64 {
        self.op().map_or(0, |op| op.flops(&[&[1]], &[1]))
    }
}

/// An element-wise activation of the newer networks (MobileNetV3, EfficientNet, MaxViT), one op with
/// a kernel code so every backend has one kernel for them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unary {
    /// x · relu6(x + 3) / 6 (`nn.Hardswish`).
    Hardswish,
    /// relu6(x + 3) / 6 (`nn.Hardsigmoid`).
    Hardsigmoid,
    /// x · sigmoid(x) (`nn.SiLU`).
    Silu,
    /// tanh(x) (`nn.Tanh`, MaxViT's head).
    Tanh,
}

impl Unary {
    /// The kernels' code: 0 hardswish, 1 hardsigmoid, 2 SiLU, 3 tanh.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// In f64, with NaN kept (the reference's form; the kernels compute the same in f32).
    pub fn apply(self, x: f64) -> f64 {
        // f64::clamp keeps a NaN NaN.
        let relu6 = |v: f64| v.clamp(0.0, 6.0);
        match self {
            Unary::Hardswish => x * relu6(x + 3.0) / 6.0,
            Unary::Hardsigmoid => relu6(x + 3.0) / 6.0,
            Unary::Silu => x / (1.0 + (-x).exp()),
            Unary::Tanh => x.tanh(),
        }
    }
}

/// A 2-D convolution, as `torch.nn.Conv2d`; compile passes may add a residual input and an
/// activation to its epilogue: y = act(conv(x) + bias + residual).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2d {
    pub in_channels: usize,
    pub out_channels: usize,
    /// (height, width) of the kernel.
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    /// 1 for a dense convolution, `in_channels` for a depthwise one.
    pub groups: usize,
    pub bias: bool,
    /// A second input of the output's shape, added before the activation.
    pub residual: bool,
    pub act: Act,
}

impl Conv2d {
    /// A dense, square convolution without bias: the common case in the zoo.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Self {
        Conv2d {
            in_channels,
            out_channels,
            kernel: (kernel, kernel),
            stride: (stride, stride),
            padding: (padding, padding),
            dilation: (1, 1),
            groups: 1,
            bias: false,
            residual: false,
            act: Act::None,
        }
    }

    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }

    pub fn with_bias(mut self) -> Self {
        self.bias = true;
        self
    }

    /// Taps per group: the K of the convolution's GEMM, ordered (ky, kx, ci) to match NHWC
    /// inputs, where a pixel's channels are contiguous.
    pub fn taps(&self) -> usize {
        self.kernel.0 * self.kernel.1 * (self.in_channels / self.groups)
    }

    /// Where element (k, co) of group `g`'s GEMM weight matrix (taps × output channels) lives
    /// in PyTorch's (cout, cin/groups, kh, kw) weight.
    pub fn weight_index(&self, g: usize, k: usize, co: usize) -> usize {
        let cin_g = self.in_channels / self.groups;
        let cout_g = self.out_channels / self.groups;
        let (ci, tap) = (k % cin_g, k / cin_g);
        let (ky, kx) = (tap / self.kernel.1, tap % self.kernel.1);
        (((g * cout_g + co) * cin_g + ci) * self.kernel.0 + ky) * self.kernel.1 + kx
    }

    /// Output spatial size for an input of `h`×`w`, or `None` when the kernel does not fit.
    pub fn output_hw(&self, h: usize, w: usize) -> Option<(usize, usize)> {
        let oh = window_out(
            h,
            self.kernel.0,
            self.stride.0,
            self.padding.0,
            self.dilation.0,
            false,
        )?;
        let ow = window_out(
            w,
            self.kernel.1,
            self.stride.1,
            self.padding.1,
            self.dilation.1,
            false,
        )?;
        Some((oh, ow))
    }
}

/// A pooling window, as `torch.nn.MaxPool2d` / `AvgPool2d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub ceil_mode: bool,
    /// Average pooling only: divide by the full window, padding included (PyTorch's default).
    pub count_include_pad: bool,
}

impl Pool {
    pub fn new(kernel: usize, stride: usize, padding: usize) -> Self {
        Pool {
            kernel: (kernel, kernel),
            stride: (stride, stride),
            padding: (padding, padding),
            ceil_mode: false,
            count_include_pad: true,
        }
    }

    pub fn output_hw(&self, h: usize, w: usize) -> Option<(usize, usize)> {
        let oh = window_out(
            h,
            self.kernel.0,
            self.stride.0,
            self.padding.0,
            1,
            self.ceil_mode,
        )?;
        let ow = window_out(
            w,
            self.kernel.1,
            self.stride.1,
            self.padding.1,
            1,
            self.ceil_mode,
        )?;
        Some((oh, ow))
    }
}

/// PyTorch's output-size rule for a sliding window, including its ceil-mode correction (the
/// last window must start inside the input or its left padding).
fn window_out(
    size: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    dilation: usize,
    ceil: bool,
) -> Option<usize> {
    let span = dilation * (kernel - 1) + 1;
    let padded = size + 2 * pad;
    if padded < span || stride == 0 {
        return None;
    }
    let steps = padded - span;
    let mut out = if ceil {
        steps.div_ceil(stride)
    } else {
        steps / stride
    } + 1;
    if ceil && (out - 1) * stride >= size + pad {
        out -= 1;
    }
    Some(out)
}

/// One operation of the graph.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// The graph's input image batch: (N, channels, H, W).
    Input {
        channels: usize,
    },
    Conv2d(Conv2d),
    /// Batch normalisation in inference mode (running statistics), as `BatchNorm2d.eval()`.
    BatchNorm {
        channels: usize,
        eps: f32,
    },
    Relu,
    /// min(max(x, 0), 6), MobileNet's activation.
    Relu6,
    /// 1 / (1 + e^-x), element-wise (`nn.Sigmoid`).
    Sigmoid,
    /// Hardswish, hardsigmoid, SiLU or tanh, element-wise.
    Unary(Unary),
    /// x (N, C, H, W) times s (N, C, 1, 1), channel by channel: squeeze-and-excitation's
    /// `scale * input`.
    ScaleChannels,
    MaxPool(Pool),
    AvgPool(Pool),
    /// `AdaptiveAvgPool2d((h, w))`: PyTorch's floor/ceil bin edges.
    AdaptiveAvgPool {
        out: (usize, usize),
    },
    /// Element-wise sum of two tensors of one shape (the residual connection).
    Add,
    /// `torch.nn.Linear` on (N, in_features).
    Linear {
        in_features: usize,
        out_features: usize,
        bias: bool,
        /// Applied to the outputs (compile passes fuse a following activation).
        act: Act,
        /// A second input of the output's shape, added before the activation (compile passes
        /// fuse a following residual add, as into a convolution).
        residual: bool,
    },
    /// (N, C, H, W) → (N, C·H·W), in NCHW order.
    Flatten,
    /// Identity at inference; `p` is kept so the graph reads like the model.
    Dropout {
        p: f32,
    },
    /// Softmax over the last dimension.
    Softmax,
    /// (N, C, H, W) → (N, H·W, C): a patch grid as a token sequence (ViT's
    /// `x.reshape(n, c, h * w).permute(0, 2, 1)`).
    Tokens,
    /// (N, T, D) → (N, 1 + T, D): the learned class token (1, 1, D) put in front (ViT). The
    /// node's name is the parameter's whole name (`class_token`).
    ClassToken {
        dim: usize,
    },
    /// (N, T, D) + the learned position embedding (1, T, D) (ViT's `encoder.pos_embedding`; the
    /// node's name is the parameter's whole name). Fits only the token count it was made for.
    PosEmbed {
        tokens: usize,
        dim: usize,
        /// The image side that gives `tokens`, for the message when another does not.
        image_size: usize,
    },
    /// `nn.LayerNorm(dim, eps)` with its affine weight and bias: over the last dimension of
    /// tokens or features, over the channels of an image batch (N, C, H, W) — ConvNeXt's
    /// `LayerNorm2d`, the permute to channels-last and back included.
    LayerNorm {
        dim: usize,
        eps: f32,
        /// With the learned weight and bias (`elementwise_affine`); `--compile default` folds
        /// them into the linear layer that follows and clears this.
        affine: bool,
    },
    /// `nn.GELU()`: x · Φ(x), with the exact error function.
    Gelu,
    /// `nn.MultiheadAttention(dim, heads, batch_first=True)` as self-attention on (N, T, D): the
    /// input projection to q, k, v (`in_proj_weight`/`in_proj_bias`), softmax(q·kᵀ/√(D/heads))·v
    /// per head, and the output projection (`out_proj.weight`/`out_proj.bias`).
    Attention {
        dim: usize,
        heads: usize,
        /// A second input of the output's shape, added in the output projection's epilogue
        /// (compile passes fuse the block's residual add).
        residual: bool,
    },
    /// (N, T, D) → (N, D): token `index` (ViT's class token, `x[:, 0]`).
    SelectToken {
        index: usize,
    },
    /// (N, H·W, C) → (N, C, H, W): tokens back on the grid of the second input (only its
    /// height and width are read, as `view_as` would), the inverse of `Tokens` (ConvNeXt's
    /// `Permute([0, 3, 1, 2])` after its channels-last MLP).
    Image,
    /// `torch.cat` of `parts` image batches along the channels: every input (N, Cᵢ, H, W), the
    /// output (N, ΣCᵢ, H, W) (DenseNet, Inception, GoogLeNet, SqueezeNet).
    Concat {
        parts: usize,
    },
    /// Attention within windows of an image batch (N, C, H, W) (torchvision keeps Swin's
    /// channels-last, (N, H, W, C)): the q/k/v projection, self-attention within each
    /// `window`×`window` window of the grid, scores scaled per head plus a learned relative
    /// position bias, then the output projection; `form` says whose (Swin V1/V2's shifted
    /// windows, MaxViT's windows or grid). Swin pads the grid to whole windows (padded tokens
    /// hold the projection's bias, as after torchvision's zero padding) and shifts it
    /// cyclically by `shift` (0 along a side the window covers; pairs from different regions of
    /// the shifted grid get −100, torchvision's mask).
    WindowAttention(WindowAttention),
    /// Swin's `PatchMerging` gather: (N, C, H, W) → (N, 4C, ⌈H/2⌉, ⌈W/2⌉), each output pixel
    /// the channels of its 2×2 block in torchvision's order (top-left, bottom-left, top-right,
    /// bottom-right), zeros past an odd edge.
    PatchMerge,
    /// Channels `[start, start + count)` of an image batch (ShuffleNetV2's `x.chunk(2, dim=1)`).
    ChannelSlice {
        start: usize,
        count: usize,
    },
    /// ShuffleNet's `channel_shuffle`: the channels viewed as (groups, C / groups), transposed;
    /// output channel j·groups + i is input channel i·(C / groups) + j.
    ChannelShuffle {
        groups: usize,
    },
    /// (N, C, H, W) times a learned per-channel scale (C, 1, 1): ConvNeXt's `layer_scale`
    /// (the node's name is the parameter's whole name).
    LayerScale {
        channels: usize,
    },
}

/// A window attention's shape: `dim` channels in `heads` heads, `window`×`window` windows, the
/// cyclic `shift` (Swin's shifted blocks; 0 otherwise) and whose attention it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowAttention {
    pub dim: usize,
    pub heads: usize,
    pub window: usize,
    pub shift: usize,
    pub form: WindowForm,
}

impl WindowAttention {
    /// Its grid over an H×W image: padding, shift, or MaxViT's dilation.
    pub fn grid(&self, h: usize, w: usize) -> WindowGrid {
        WindowGrid {
            dilated: self.form.dilated(),
            ..WindowGrid::new(h, w, self.window, self.shift)
        }
    }
}

/// Whose window attention a `WindowAttention` is: its parameters' names, its scores' scale and
/// how its windows lie on the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowForm {
    /// Swin V1 (`qkv`, `proj`, `relative_position_bias_table`; scores scaled by 1/√(C/heads)).
    Swin,
    /// Swin V2: cosine attention (q and k normalised, scaled per head by
    /// exp(min(`logit_scale`, ln 100))), the bias 16·sigmoid of a small MLP (`cpb_mlp`) over
    /// log-spaced relative coordinates (`relative_coords_table`), no bias on k.
    SwinV2,
    /// MaxViT's `RelativePositionalMultiHeadAttention` (`to_qkv`, `merge`,
    /// `relative_position_bias_table`; scores scaled by 1/√C, torchvision's choice, not
    /// 1/√(C/heads)) on the window partition: windows of adjacent pixels.
    MaxVitWindow,
    /// The same on MaxViT's grid partition: the image cut into `window`×`window` equal blocks
    /// and each window one pixel from every block, at the same place in each (dilated, a
    /// global mixing); the image's sides must be multiples of the window.
    MaxVitGrid,
}

impl WindowForm {
    /// Swin V2's cosine attention.
    pub fn cosine(self) -> bool {
        self == WindowForm::SwinV2
    }

    /// MaxViT's grid partition.
    pub fn dilated(self) -> bool {
        self == WindowForm::MaxVitGrid
    }

    /// The parameters of the projections: the q/k/v one's weight and bias, then the output
    /// one's.
    pub fn projections(self) -> [&'static str; 4] {
        match self {
            WindowForm::Swin | WindowForm::SwinV2 => {
                ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"]
            }
            WindowForm::MaxVitWindow | WindowForm::MaxVitGrid => {
                ["to_qkv.weight", "to_qkv.bias", "merge.weight", "merge.bias"]
            }
        }
    }
}

/// The grid of a shifted-window attention over an H×W image: padded to whole windows
/// (`hp`×`wp`), and the shift along each side (0 where one window covers the side, as
/// torchvision does); or, `dilated`, MaxViT's grid partition (sides multiples of the window,
/// no padding, no shift). Every backend's kernel takes these numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowGrid {
    pub h: usize,
    pub w: usize,
    pub hp: usize,
    pub wp: usize,
    pub window: usize,
    pub shift_h: usize,
    pub shift_w: usize,
    pub dilated: bool,
}

impl WindowGrid {
    pub fn new(h: usize, w: usize, window: usize, shift: usize) -> WindowGrid {
        let window = window.max(1);
        let (hp, wp) = (h.div_ceil(window) * window, w.div_ceil(window) * window);
        WindowGrid {
            h,
            w,
            hp,
            wp,
            window,
            shift_h: if window >= hp { 0 } else { shift },
            shift_w: if window >= wp { 0 } else { shift },
            dilated: false,
        }
    }

    /// The input pixel under token (y', x') of the shifted, padded grid (past the input when
    /// it is padding). Dilated, window (a, b)'s token (i, j) is pixel (i·H/w + a, j·W/w + b).
    pub fn source(&self, yy: usize, xx: usize) -> (usize, usize) {
        if self.dilated {
            let ws = self.window;
            return (
                yy % ws * (self.h / ws) + yy / ws,
                xx % ws * (self.w / ws) + xx / ws,
            );
        }
        ((yy + self.shift_h) % self.hp, (xx + self.shift_w) % self.wp)
    }

    /// The mask's region (0–8) of token (y', x'): torchvision's slices (0, −w), (−w, −s),
    /// (−s, ∞) along each shifted side. Scores between regions get −100.
    pub fn region(&self, yy: usize, xx: usize) -> usize {
        let side = |v: usize, size: usize, s: usize| match s {
            0 => 0,
            _ if v < size - self.window => 0,
            _ if v < size - s => 1,
            _ => 2,
        };
        3 * side(yy, self.hp, self.shift_h) + side(xx, self.wp, self.shift_w)
    }

    /// Swin V2's `relative_coords_table`: for each (dy, dx) of the bias table's rows, the
    /// offsets scaled to ±8 and log-spaced: sign(t)·log2(|t| + 1)/3.
    pub fn coords_table(window: usize) -> Vec<f32> {
        let w = window.max(2) as f32;
        let side = 2 * window - 1;
        let log = |d: f32| {
            let t = d / (w - 1.0) * 8.0;
            t.signum() * (t.abs() + 1.0).log2() / 3.0
        };
        (0..side * side)
            .flat_map(|r| {
                let (dy, dx) = ((r / side) as f32, (r % side) as f32);
                [log(dy - (w - 1.0)), log(dx - (w - 1.0))]
            })
            .collect()
    }

    /// Row of the relative position bias table for query i and key j of one window.
    pub fn bias_row(&self, i: usize, j: usize) -> usize {
        let ws = self.window;
        (i / ws + ws - 1 - j / ws) * (2 * ws - 1) + (i % ws + ws - 1 - j % ws)
    }
}

/// One copy of an op that only moves channels (concatenation, slice, shuffle): `count`
/// channels of input `input` (which has `channels`) from channel `from`, to output channels
/// `to`, `to + step`, …
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelCopy {
    pub input: usize,
    pub channels: usize,
    pub from: usize,
    pub to: usize,
    pub count: usize,
    pub step: usize,
}

/// Inference batch norm as a per-channel affine map: y = x · scale + shift, with
/// scale = γ / √(var + ε) and shift = β − mean · scale.
pub fn batch_norm_affine(
    gamma: &[f32],
    beta: &[f32],
    mean: &[f32],
    var: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let scale: Vec<f32> = gamma
        .iter()
        .zip(var)
        .map(|(g, v)| g / (v + eps).sqrt())
        .collect();
    let shift = beta
        .iter()
        .zip(mean)
        .zip(&scale)
        .map(|((b, m), s)| b - m * s)
        .collect();
    (scale, shift)
}

/// Whether a state_dict entry is learned (counted as a parameter) or a running buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    Trainable,
    Buffer,
}

/// One tensor an op owns, named by its state_dict suffix (`weight`, `running_mean`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub suffix: &'static str,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
}

/// Why shape inference refused an op: said in words a user can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ShapeError(pub String);

/// A fused residual (the op's second input, where `residual`) must have the output's shape.
fn residual_fits(
    op: &str,
    residual: bool,
    inputs: &[&[usize]],
    out: &[usize],
) -> Result<(), ShapeError> {
    match inputs.get(1) {
        Some(r) if residual && *r != out => Err(ShapeError(format!(
            "{op}'s residual input has shape {}, its output {}",
            fmt_shape(r),
            fmt_shape(out)
        ))),
        _ => Ok(()),
    }
}

fn fmt_shape(s: &[usize]) -> String {
    let parts: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("({})", parts.join(", "))
}

impl Op {
    /// A convolution, or a linear layer as the 1×1 convolution it is over an n × 1 × 1 × in
    /// image (bias and fused activation kept): what the backends' GEMMs run.
    pub fn as_conv(&self) -> Option<Conv2d> {
        match *self {
            Op::Conv2d(c) => Some(c),
            Op::Linear {
                in_features,
                out_features,
                bias,
                act,
                residual,
            } => Some(Conv2d {
                bias,
                act,
                residual,
                ..Conv2d::new(in_features, out_features, 1, 1, 0)
            }),
            _ => None,
        }
    }

    /// `nn.LayerNorm(dim, eps)` with its affine weight and bias.
    pub fn layer_norm(dim: usize, eps: f32) -> Op {
        Op::LayerNorm {
            dim,
            eps,
            affine: true,
        }
    }

    /// `nn.Linear(in_features, out_features, bias)`, nothing fused.
    pub fn linear(in_features: usize, out_features: usize, bias: bool) -> Op {
        Op::Linear {
            in_features,
            out_features,
            bias,
            act: Act::None,
            residual: false,
        }
    }

    /// The short kind name used in tables and profiles (`conv2d`, `batch_norm`, ...).
    pub fn kind_name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Conv2d(_) => "conv2d",
            Op::BatchNorm { .. } => "batch_norm",
            Op::Relu => "relu",
            Op::Relu6 => "relu6",
            Op::Sigmoid => "sigmoid",
            Op::Unary(Unary::Hardswish) => "hardswish",
            Op::Unary(Unary::Hardsigmoid) => "hardsigmoid",
            Op::Unary(Unary::Silu) => "silu",
            Op::Unary(Unary::Tanh) => "tanh",
            Op::ScaleChannels => "scale_channels",
            Op::MaxPool(_) => "max_pool2d",
            Op::AvgPool(_) => "avg_pool2d",
            Op::AdaptiveAvgPool { .. } => "adaptive_avg_pool2d",
            Op::Add => "add",
            Op::Linear { .. } => "linear",
            Op::Flatten => "flatten",
            Op::Dropout { .. } => "dropout",
            Op::Softmax => "softmax",
            Op::Tokens => "tokens",
            Op::ClassToken { .. } => "class_token",
            Op::PosEmbed { .. } => "pos_embedding",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Gelu => "gelu",
            Op::Attention { .. } => "attention",
            Op::SelectToken { .. } => "select_token",
            Op::Image => "image",
            Op::LayerScale { .. } => "layer_scale",
            Op::Concat { .. } => "concat",
            Op::ChannelSlice { .. } => "channel_slice",
            Op::ChannelShuffle { .. } => "channel_shuffle",
            Op::WindowAttention(_) => "window_attention",
            Op::PatchMerge => "patch_merge",
        }
    }

    /// How many inputs the op takes.
    pub fn arity(&self) -> usize {
        match self {
            Op::Input { .. } => 0,
            Op::Add | Op::ScaleChannels | Op::Image => 2,
            Op::Concat { parts } => *parts,
            Op::Conv2d(Conv2d { residual: true, .. })
            | Op::Linear { residual: true, .. }
            | Op::Attention { residual: true, .. } => 2,
            _ => 1,
        }
    }

    /// The tensors this op owns, in state_dict order.
    pub fn params(&self) -> Vec<ParamSpec> {
        let p = |suffix, shape: Vec<usize>, kind| ParamSpec {
            suffix,
            shape,
            kind,
        };
        match *self {
            Op::Conv2d(c) => {
                let mut v = vec![p(
                    "weight",
                    vec![
                        c.out_channels,
                        c.in_channels / c.groups.max(1),
                        c.kernel.0,
                        c.kernel.1,
                    ],
                    ParamKind::Trainable,
                )];
                if c.bias {
                    v.push(p("bias", vec![c.out_channels], ParamKind::Trainable));
                }
                v
            }
            Op::BatchNorm { channels, .. } => vec![
                p("weight", vec![channels], ParamKind::Trainable),
                p("bias", vec![channels], ParamKind::Trainable),
                p("running_mean", vec![channels], ParamKind::Buffer),
                p("running_var", vec![channels], ParamKind::Buffer),
            ],
            Op::Linear {
                in_features,
                out_features,
                bias,
                ..
            } => {
                let mut v = vec![p(
                    "weight",
                    vec![out_features, in_features],
                    ParamKind::Trainable,
                )];
                if bias {
                    v.push(p("bias", vec![out_features], ParamKind::Trainable));
                }
                v
            }
            Op::ClassToken { dim } => vec![p("", vec![1, 1, dim], ParamKind::Trainable)],
            Op::PosEmbed { tokens, dim, .. } => {
                vec![p("", vec![1, tokens, dim], ParamKind::Trainable)]
            }
            Op::LayerNorm {
                dim, affine: true, ..
            } => vec![
                p("weight", vec![dim], ParamKind::Trainable),
                p("bias", vec![dim], ParamKind::Trainable),
            ],
            Op::LayerScale { channels } => {
                vec![p("", vec![channels, 1, 1], ParamKind::Trainable)]
            }
            Op::WindowAttention(WindowAttention {
                dim,
                heads,
                window,
                form,
                ..
            }) => {
                let side = 2 * window - 1;
                let [qkv_w, qkv_b, proj_w, proj_b] = form.projections();
                let mut v = vec![
                    p(qkv_w, vec![3 * dim, dim], ParamKind::Trainable),
                    p(qkv_b, vec![3 * dim], ParamKind::Trainable),
                    p(proj_w, vec![dim, dim], ParamKind::Trainable),
                    p(proj_b, vec![dim], ParamKind::Trainable),
                ];
                if form.cosine() {
                    v.extend([
                        p("logit_scale", vec![heads, 1, 1], ParamKind::Trainable),
                        p("cpb_mlp.0.weight", vec![512, 2], ParamKind::Trainable),
                        p("cpb_mlp.0.bias", vec![512], ParamKind::Trainable),
                        p("cpb_mlp.2.weight", vec![heads, 512], ParamKind::Trainable),
                        p(
                            "relative_coords_table",
                            vec![1, side, side, 2],
                            ParamKind::Buffer,
                        ),
                    ]);
                } else {
                    let table = vec![side * side, heads];
                    v.push(p(
                        "relative_position_bias_table",
                        table,
                        ParamKind::Trainable,
                    ));
                }
                v
            }
            Op::Attention { dim, .. } => vec![
                p("in_proj_weight", vec![3 * dim, dim], ParamKind::Trainable),
                p("in_proj_bias", vec![3 * dim], ParamKind::Trainable),
                p("out_proj.weight", vec![dim, dim], ParamKind::Trainable),
                p("out_proj.bias", vec![dim], ParamKind::Trainable),
            ],
            _ => Vec::new(),
        }
    }

    /// The output shape for these input shapes, or a sentence saying what does not fit.
    pub fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, ShapeError> {
        if inputs.len() != self.arity() {
            return Err(ShapeError(format!(
                "{} takes {} input(s), got {}",
                self.kind_name(),
                self.arity(),
                inputs.len()
            )));
        }
        let image = |s: &[usize]| -> Result<(usize, usize, usize, usize), ShapeError> {
            match *s {
                [n, c, h, w] => Ok((n, c, h, w)),
                _ => Err(ShapeError(format!(
                    "{} expects an image batch (N, C, H, W), got {}",
                    self.kind_name(),
                    fmt_shape(s)
                ))),
            }
        };
        match self {
            Op::Input { .. } => unreachable!("the input's shape is given, not inferred"),
            Op::Conv2d(c) => {
                let (n, ch, h, w) = image(inputs[0])?;
                if c.groups == 0 || c.in_channels % c.groups != 0 || c.out_channels % c.groups != 0
                {
                    return Err(ShapeError(format!(
                        "conv2d groups={} must divide both in_channels={} and out_channels={}",
                        c.groups, c.in_channels, c.out_channels
                    )));
                }
                if ch != c.in_channels {
                    return Err(ShapeError(format!(
                        "conv2d expects {} input channels, got {}",
                        c.in_channels, ch
                    )));
                }
                let (oh, ow) = c.output_hw(h, w).ok_or_else(|| {
                    ShapeError(format!(
                        "conv2d input {}×{} (padding {}×{}) is smaller than its {}×{} kernel (dilation {}): use a larger input size",
                        h, w, c.padding.0, c.padding.1, c.kernel.0, c.kernel.1, c.dilation.0
                    ))
                })?;
                let out = vec![n, c.out_channels, oh, ow];
                residual_fits("conv2d", c.residual, inputs, &out)?;
                Ok(out)
            }
            Op::BatchNorm { channels, .. } => {
                let (_, ch, _, _) = image(inputs[0])?;
                if ch != *channels {
                    return Err(ShapeError(format!(
                        "batch_norm expects {channels} channels, got {ch}"
                    )));
                }
                Ok(inputs[0].to_vec())
            }
            Op::Relu | Op::Relu6 | Op::Sigmoid | Op::Dropout { .. } | Op::Gelu | Op::Unary(_) => {
                Ok(inputs[0].to_vec())
            }
            Op::ScaleChannels => {
                let (n, c, _, _) = image(inputs[0])?;
                if inputs[1] != [n, c, 1, 1] {
                    return Err(ShapeError(format!(
                        "scale_channels needs one scale per image and channel ({n}, {c}, 1, 1), got {}",
                        fmt_shape(inputs[1])
                    )));
                }
                Ok(inputs[0].to_vec())
            }
            Op::MaxPool(p) | Op::AvgPool(p) => {
                let (n, ch, h, w) = image(inputs[0])?;
                if p.padding.0 * 2 > p.kernel.0 || p.padding.1 * 2 > p.kernel.1 {
                    return Err(ShapeError(format!(
                        "{}: padding {:?} must be at most half the kernel {:?}",
                        self.kind_name(),
                        p.padding,
                        p.kernel
                    )));
                }
                let (oh, ow) = p.output_hw(h, w).ok_or_else(|| {
                    ShapeError(format!(
                        "{} input {}×{} is smaller than its {}×{} window: use a larger input size",
                        self.kind_name(),
                        h,
                        w,
                        p.kernel.0,
                        p.kernel.1
                    ))
                })?;
                Ok(vec![n, ch, oh, ow])
            }
            Op::AdaptiveAvgPool { out } => {
                let (n, ch, _, _) = image(inputs[0])?;
                if out.0 == 0 || out.1 == 0 {
                    return Err(ShapeError(
                        "adaptive_avg_pool2d output size must be positive".into(),
                    ));
                }
                Ok(vec![n, ch, out.0, out.1])
            }
            Op::Add => {
                if inputs[0] != inputs[1] {
                    return Err(ShapeError(format!(
                        "add needs two tensors of one shape, got {} and {}",
                        fmt_shape(inputs[0]),
                        fmt_shape(inputs[1])
                    )));
                }
                Ok(inputs[0].to_vec())
            }
            Op::Linear {
                in_features,
                out_features,
                residual,
                ..
            } => match inputs[0] {
                [lead @ .., f] if !lead.is_empty() && f == in_features => {
                    let out = [lead, &[*out_features]].concat();
                    residual_fits("linear", *residual, inputs, &out)?;
                    Ok(out)
                }
                _ => Err(ShapeError(format!(
                    "linear expects (…, {in_features}), got {}",
                    fmt_shape(inputs[0])
                ))),
            },
            Op::Flatten => match inputs[0] {
                [n, rest @ ..] if !rest.is_empty() => Ok(vec![*n, rest.iter().product()]),
                s => Err(ShapeError(format!(
                    "flatten needs at least 2 dimensions, got {}",
                    fmt_shape(s)
                ))),
            },
            Op::Softmax => {
                if inputs[0].is_empty() {
                    return Err(ShapeError("softmax needs at least 1 dimension".into()));
                }
                Ok(inputs[0].to_vec())
            }
            Op::Tokens => {
                let (n, c, h, w) = image(inputs[0])?;
                Ok(vec![n, h * w, c])
            }
            Op::ClassToken { dim } => match *inputs[0] {
                [n, t, d] if d == *dim => Ok(vec![n, t + 1, d]),
                _ => Err(self.tokens_expected(*dim, inputs[0])),
            },
            Op::PosEmbed {
                tokens,
                dim,
                image_size,
            } => match *inputs[0] {
                [_, t, d] if d == *dim && t == *tokens => Ok(inputs[0].to_vec()),
                [_, t, d] if d == *dim => Err(ShapeError(format!(
                    "the position embedding holds {tokens} positions (a {image_size}×{image_size} image), this input makes {t} tokens: a ViT takes only the input size its position embedding was made for (--input-size {image_size})"
                ))),
                _ => Err(self.tokens_expected(*dim, inputs[0])),
            },
            // An image batch is normalised over its channels, anything else over its last
            // dimension.
            Op::LayerNorm { dim, .. } => match *inputs[0] {
                [_, c, _, _] if c == *dim => Ok(inputs[0].to_vec()),
                [_, _, _, _] => Err(ShapeError(format!(
                    "layer_norm over {dim} channels, got an image batch {}",
                    fmt_shape(inputs[0])
                ))),
                [.., d] if d == *dim => Ok(inputs[0].to_vec()),
                _ => Err(ShapeError(format!(
                    "layer_norm over {dim} features, got {}",
                    fmt_shape(inputs[0])
                ))),
            },
            Op::Image => {
                let (n, _, h, w) = image(inputs[1])?;
                match *inputs[0] {
                    [m, t, c] if m == n && t == h * w => Ok(vec![n, c, h, w]),
                    _ => Err(ShapeError(format!(
                        "image: tokens {} do not fit the {h}×{w} grid of {}",
                        fmt_shape(inputs[0]),
                        fmt_shape(inputs[1])
                    ))),
                }
            }
            Op::Concat { .. } => {
                let Some(first) = inputs.first() else {
                    return Err(ShapeError("concat needs at least one input".into()));
                };
                let (n, _, h, w) = image(first)?;
                let mut channels = 0usize;
                for s in inputs {
                    match **s {
                        [m, c, y, x] if (m, y, x) == (n, h, w) => {
                            channels = channels.saturating_add(c)
                        }
                        _ => {
                            return Err(ShapeError(format!(
                                "concat needs image batches of one (N, H, W), got {} and {}",
                                fmt_shape(inputs[0]),
                                fmt_shape(s)
                            )));
                        }
                    }
                }
                Ok(vec![n, channels, h, w])
            }
            Op::WindowAttention(WindowAttention {
                dim,
                heads,
                window,
                shift,
                form,
            }) => {
                let (_, c, h, w) = image(inputs[0])?;
                if *heads == 0 || dim % heads != 0 || c != *dim {
                    return Err(ShapeError(format!(
                        "window_attention over {dim} channels in {heads} heads, got {}",
                        fmt_shape(inputs[0])
                    )));
                }
                if *window == 0 || shift >= window {
                    return Err(ShapeError(format!(
                        "window_attention: the shift {shift} must be less than the window {window}"
                    )));
                }
                // MaxViT partitions without padding (torchvision asserts it) or shifting.
                let maxvit = matches!(form, WindowForm::MaxVitWindow | WindowForm::MaxVitGrid);
                if maxvit && (h % window != 0 || w % window != 0 || *shift != 0) {
                    return Err(ShapeError(format!(
                        "partition attention needs a grid of whole {window}×{window} windows \
                         (no shift), got {h}×{w}: choose an input size whose feature maps \
                         divide by {window}"
                    )));
                }
                Ok(inputs[0].to_vec())
            }
            Op::PatchMerge => {
                let (n, c, h, w) = image(inputs[0])?;
                Ok(vec![n, 4 * c, h.div_ceil(2), w.div_ceil(2)])
            }
            Op::ChannelSlice { start, count } => {
                let (n, c, h, w) = image(inputs[0])?;
                match start.checked_add(*count) {
                    Some(end) if end <= c && *count > 0 => Ok(vec![n, *count, h, w]),
                    _ => Err(ShapeError(format!(
                        "channel_slice of {count} channels from {start} does not fit {c} channels"
                    ))),
                }
            }
            Op::ChannelShuffle { groups } => {
                let (_, c, _, _) = image(inputs[0])?;
                if *groups == 0 || c % groups != 0 {
                    return Err(ShapeError(format!(
                        "channel_shuffle: {groups} groups must divide {c} channels"
                    )));
                }
                Ok(inputs[0].to_vec())
            }
            Op::LayerScale { channels } => {
                let (_, c, _, _) = image(inputs[0])?;
                if c != *channels {
                    return Err(ShapeError(format!(
                        "layer_scale expects {channels} channels, got {c}"
                    )));
                }
                Ok(inputs[0].to_vec())
            }
            Op::Attention {
                dim,
                heads,
                residual,
            } => {
                if *heads == 0 || dim % heads != 0 {
                    return Err(ShapeError(format!(
                        "attention: {heads} heads must divide the dimension {dim}"
                    )));
                }
                match *inputs[0] {
                    [_, _, d] if d == *dim => {
                        residual_fits("attention", *residual, inputs, inputs[0])?;
                        Ok(inputs[0].to_vec())
                    }
                    _ => Err(self.tokens_expected(*dim, inputs[0])),
                }
            }
            Op::SelectToken { index } => match *inputs[0] {
                [n, t, d] if *index < t => Ok(vec![n, d]),
                _ => Err(ShapeError(format!(
                    "select_token {index} needs (N, T > {index}, D), got {}",
                    fmt_shape(inputs[0])
                ))),
            },
        }
    }

    /// Concatenation, channel slice and shuffle as the channel copies every backend runs,
    /// given the inputs' channel counts; `None` for any other op.
    pub fn channel_copies(&self, in_channels: &[usize]) -> Option<Vec<ChannelCopy>> {
        let copy = |input: usize, from, to, count, step| ChannelCopy {
            input,
            channels: in_channels[input],
            from,
            to,
            count,
            step,
        };
        Some(match *self {
            Op::Concat { .. } => {
                let offsets = in_channels.iter().scan(0, |to, &c| {
                    *to += c;
                    Some(*to - c)
                });
                (in_channels.iter().zip(offsets).enumerate())
                    .map(|(k, (&c, to))| copy(k, 0, to, c, 1))
                    .collect()
            }
            Op::ChannelSlice { start, count } => vec![copy(0, start, 0, count, 1)],
            Op::ChannelShuffle { groups } => {
                let per = in_channels[0] / groups.max(1);
                (0..groups)
                    .map(|i| copy(0, i * per, i, per, groups))
                    .collect()
            }
            _ => return None,
        })
    }

    fn tokens_expected(&self, dim: usize, got: &[usize]) -> ShapeError {
        ShapeError(format!(
            "{} expects tokens (N, T, {dim}), got {}",
            self.kind_name(),
            fmt_shape(got)
        ))
    }

    /// Multiply-accumulates of conv and linear layers (what torchvision's and DeepSpeed's
    /// counters call MACs); other ops count 0 here and show up in [`Op::flops`].
    pub fn macs(&self, out: &[usize]) -> u64 {
        let n: u64 = out.iter().map(|&d| d as u64).product();
        match self {
            Op::Conv2d(c) => {
                n * (c.in_channels / c.groups) as u64 * (c.kernel.0 * c.kernel.1) as u64
            }
            Op::Linear { in_features, .. } => n * *in_features as u64,
            // Per padded token: the projections (4·C²) and, against its window's w² keys,
            // q·kᵀ and the product with v (2·w²·C), as torchvision computes them.
            Op::WindowAttention(WindowAttention { dim, window, .. }) => match *out {
                [n, _, h, w] => {
                    let grid = WindowGrid::new(h, w, *window, 0);
                    let tokens = (n * grid.hp * grid.wp) as u64;
                    let (c, keys) = (*dim as u64, (window * window) as u64);
                    tokens * (4 * c * c + 2 * keys * c)
                }
                _ => 0,
            },
            // Per image: the q/k/v projection (3·T·D²), q·kᵀ and its product with v (2·T²·D),
            // the output projection (T·D²).
            Op::Attention { dim, .. } => match *out {
                [batch, t, _] => {
                    let (b, t, d) = (batch as u64, t as u64, *dim as u64);
                    b * (4 * t * d * d + 2 * t * t * d)
                }
                _ => 0,
            },
            _ => 0,
        }
    }

    /// Floating-point operations: 2 per MAC, plus the element-wise work of the other ops
    /// (bias add, normalisation, comparisons, window sums), counted once per element touched.
    pub fn flops(&self, inputs: &[&[usize]], out: &[usize]) -> u64 {
        let elems = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
        let n = elems(out);
        match self {
            Op::Input { .. }
            | Op::Flatten
            | Op::Dropout { .. }
            | Op::Tokens
            | Op::Image
            | Op::Concat { .. }
            | Op::ChannelSlice { .. }
            | Op::ChannelShuffle { .. }
            | Op::PatchMerge
            | Op::SelectToken { .. }
            | Op::ClassToken { .. } => 0,
            Op::Conv2d(c) => {
                let epilogue = c.act.flops() * n;
                2 * self.macs(out)
                    + if c.bias { n } else { 0 }
                    + if c.residual { n } else { 0 }
                    + epilogue
            }
            Op::Linear {
                bias,
                act,
                residual,
                ..
            } => {
                2 * self.macs(out)
                    + if *bias { n } else { 0 }
                    + if *residual { n } else { 0 }
                    + act.flops() * n
            }
            Op::BatchNorm { .. } => 2 * n,
            Op::Relu | Op::Add => n,
            Op::Relu6 => 2 * n,
            // Negate, exponentiate, add one, divide: one each per element.
            Op::Sigmoid => 4 * n,
            // Add, two compares, multiply, divide; SiLU: sigmoid's four and a multiply.
            Op::Unary(Unary::Hardswish | Unary::Silu | Unary::Tanh) => 5 * n,
            Op::Unary(Unary::Hardsigmoid) => 4 * n,
            Op::ScaleChannels | Op::LayerScale { .. } => n,
            Op::MaxPool(p) | Op::AvgPool(p) => n * (p.kernel.0 * p.kernel.1) as u64,
            Op::AdaptiveAvgPool { .. } => elems(inputs[0]),
            Op::Softmax => 4 * n,
            Op::PosEmbed { .. } => n,
            // Mean, deviation, square, normalise, scale and shift: about six per element.
            // Mean, subtract, square, variance, scale; the affine's multiply and add.
            Op::LayerNorm { affine, .. } => {
                if *affine {
                    6 * n
                } else {
                    4 * n
                }
            }
            // Scale, erf, add one, two multiplies.
            Op::Gelu => 5 * n,
            // The products, the projections' biases, and per score a scale and the softmax's
            // four (exponentiate, subtract the maximum, sum, divide).
            Op::Attention {
                dim,
                heads,
                residual,
            } => match *out {
                [batch, t, _] => {
                    let (b, t, d, h) = (batch as u64, t as u64, *dim as u64, *heads as u64);
                    let residual = if *residual { b * t * d } else { 0 };
                    2 * self.macs(out) + b * 4 * t * d + 5 * b * h * t * t + residual
                }
                _ => 0,
            },
            // As attention's, with the window's w² keys per query, plus the bias and mask.
            Op::WindowAttention(WindowAttention {
                dim, heads, window, ..
            }) => match *out {
                [n, _, h, w] => {
                    let grid = WindowGrid::new(h, w, *window, 0);
                    let tokens = (n * grid.hp * grid.wp) as u64;
                    let keys = (window * window) as u64;
                    let scores = tokens * *heads as u64 * keys;
                    2 * self.macs(out) + tokens * 4 * *dim as u64 + 7 * scores
                }
                _ => 0,
            },
        }
    }

    /// Bytes read and written at `elem_bytes` per element: inputs, parameters and output,
    /// each once (the ideal traffic a perfect cache would give).
    pub fn bytes(&self, inputs: &[&[usize]], out: &[usize], elem_bytes: usize) -> u64 {
        let elems = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
        if matches!(
            self,
            Op::Input { .. } | Op::Flatten | Op::Dropout { .. } | Op::Tokens | Op::Image
        ) {
            return 0;
        }
        let params: u64 = self.params().iter().map(|p| elems(&p.shape)).sum();
        let ins: u64 = inputs.iter().map(|s| elems(s)).sum();
        (ins + params + elems(out)) * elem_bytes as u64
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Conv2d(c) => write!(
                f,
                "conv2d {}→{} k{}×{} s{} p{}{}{}",
                c.in_channels,
                c.out_channels,
                c.kernel.0,
                c.kernel.1,
                c.stride.0,
                c.padding.0,
                if c.groups > 1 {
                    format!(" g{}", c.groups)
                } else {
                    String::new()
                },
                epilogue_name(c.residual, c.act)
            ),
            Op::Linear {
                in_features,
                out_features,
                act,
                residual,
                ..
            } => write!(
                f,
                "linear {in_features}→{out_features}{}",
                epilogue_name(*residual, *act)
            ),
            Op::Attention {
                dim,
                heads,
                residual,
            } => write!(
                f,
                "attention {dim} ×{heads} heads{}",
                epilogue_name(*residual, Act::None)
            ),
            other => f.write_str(other.kind_name()),
        }
    }
}

/// What a GEMM's epilogue fuses, as the op's name shows it: " +add", " +relu", " +add+relu".
fn epilogue_name(residual: bool, act: Act) -> String {
    match (residual, act) {
        (false, Act::None) => String::new(),
        (false, act) => format!(" +{}", act.name()),
        (true, Act::None) => " +add".into(),
        (true, act) => format!(" +add+{}", act.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fused residual of another shape than the output is refused, naming both shapes.
    #[test]
    fn residuals_must_have_the_output_s_shape() {
        let conv = Op::Conv2d(Conv2d {
            residual: true,
            ..Conv2d::new(4, 8, 1, 1, 0)
        });
        let linear = Op::Linear {
            in_features: 4,
            out_features: 8,
            bias: true,
            act: Act::None,
            residual: true,
        };
        let attention = Op::Attention {
            dim: 4,
            heads: 2,
            residual: true,
        };
        for (op, x, good, bad) in [
            (
                conv,
                &[1, 4, 3, 3][..],
                &[1, 8, 3, 3][..],
                &[1, 4, 3, 3][..],
            ),
            (linear, &[2, 5, 4], &[2, 5, 8], &[2, 5, 4]),
            (attention, &[1, 5, 4], &[1, 5, 4], &[1, 6, 4]),
        ] {
            assert!(op.infer_shape(&[x, good]).is_ok(), "{op}");
            let e = op.infer_shape(&[x, bad]).unwrap_err().0;
            assert!(e.contains("residual input has shape"), "{op}: {e}");
        }
    }

    #[test]
    fn window_sizes_follow_pytorch() {
        // torch.nn.MaxPool2d(3, 2, 1) on 112 → 56; ceil_mode on 7 with k2 s2 → 4.
        assert_eq!(window_out(112, 3, 2, 1, 1, false), Some(56));
        assert_eq!(window_out(7, 2, 2, 0, 1, true), Some(4));
        assert_eq!(window_out(7, 2, 2, 0, 1, false), Some(3));
        // Ceil mode never starts a window in the right padding: torch gives 3 here, not 4.
        assert_eq!(window_out(5, 2, 2, 1, 1, true), Some(3));
        assert_eq!(window_out(2, 5, 1, 0, 1, false), None);
    }
}

//! Single layers as networks, for operator benchmarks (PyTorch's `torch.utils.benchmark` on one
//! module, the conv tables of the course's sources): `--network` takes a chain of layers
//! written as PyTorch constructs them, `conv2d(64, 64, 3, padding=1)+relu`. The chain is an
//! `nn.Sequential`: layer `i`'s parameters are `i.weight` and `i.bias`, so such a module's
//! state_dict loads with `--weights`. The input is an image batch whose channels are the first
//! layer's; `--input-size` sets its side (56 unless given: ResNet's first stage).
//!
//! | layer | arguments (PyTorch's order and names) |
//! |---|---|
//! | `conv2d` | in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True |
//! | `linear` | in_features, out_features, bias=True — on the image's pixels as tokens (N, H·W, C) |
//! | `batchnorm2d` | num_features |
//! | `layernorm` | normalized_shape — over the channels |
//! | `maxpool2d`, `avgpool2d` | kernel_size, stride=kernel_size, padding=0 |
//! | `multiheadattention` | embed_dim, num_heads — self-attention over the pixels as tokens |
//! | `relu`, `relu6`, `gelu`, `silu`, `sigmoid`, `hardswish`, `hardsigmoid`, `tanh`, `softmax` | none |

use super::super::graph::{ConvInit, Graph, GraphBuilder, LinearInit, ValueId};
use super::super::op::{Conv2d, Op, Pool, Unary};

/// The image side of a layer network unless `--input-size` says otherwise.
pub const DEFAULT_SIDE: usize = 56;

/// Whether `--network` names a chain of layers rather than a zoo network.
pub fn is_layer_spec(name: &str) -> bool {
    name.contains('(') || name.contains('+')
}

/// One argument as written: positional or `key=value`.
struct Arg<'a> {
    key: Option<&'a str>,
    value: &'a str,
}

/// A layer's arguments, read in PyTorch's order: positional ones first, then by name.
struct Args<'a> {
    layer: &'a str,
    args: Vec<Arg<'a>>,
    used: Vec<bool>,
    /// Parameter names in constructor order, for positional arguments.
    order: &'static [&'static str],
}

impl<'a> Args<'a> {
    fn get(&mut self, name: &str) -> Result<Option<&'a str>, String> {
        let at = self.order.iter().position(|&n| n == name);
        let mut found = None;
        for (i, a) in self.args.iter().enumerate() {
            let matches = match a.key {
                Some(k) => k == name,
                None => Some(i) == at,
            };
            if matches {
                if found.is_some() {
                    return Err(format!("{}: `{name}` is given twice", self.layer));
                }
                found = Some(a.value);
                self.used[i] = true;
            }
        }
        Ok(found)
    }

    fn size(&mut self, name: &str, default: Option<usize>) -> Result<usize, String> {
        let parsed = match self.get(name)? {
            Some(v) => v.parse::<usize>().map_err(|_| {
                format!(
                    "{}: `{name}` takes a whole number, not `{v}` (one value for both sides)",
                    self.layer
                )
            })?,
            None => default.ok_or_else(|| format!("{}: `{name}` is required", self.layer))?,
        };
        // Sizes come from the user: small enough that products of a few stay in range.
        if parsed == 0 && name != "padding" || parsed > 1 << 20 {
            return Err(format!(
                "{}: `{name}` = {parsed} is out of range (1 to {})",
                self.layer,
                1 << 20
            ));
        }
        Ok(parsed)
    }

    fn flag(&mut self, name: &str, default: bool) -> Result<bool, String> {
        match self.get(name)? {
            None => Ok(default),
            Some(v) if v.eq_ignore_ascii_case("true") => Ok(true),
            Some(v) if v.eq_ignore_ascii_case("false") => Ok(false),
            Some(v) => Err(format!(
                "{}: `{name}` takes True or False, not `{v}`",
                self.layer
            )),
        }
    }

    /// Every argument was read, or the first one that was not.
    fn done(self) -> Result<(), String> {
        match (self.args.iter().zip(&self.used)).find(|(_, used)| !**used) {
            None => Ok(()),
            Some((a, _)) => Err(match a.key {
                Some(k) => format!(
                    "{} has no argument `{k}` (it takes {})",
                    self.layer,
                    self.order.join(", ")
                ),
                None => format!(
                    "{} takes at most {} positional arguments ({})",
                    self.layer,
                    self.order.len(),
                    self.order.join(", ")
                ),
            }),
        }
    }
}

/// Split `name(a, b, k=v)` into its name and arguments.
fn split_layer(text: &str) -> Result<(String, Vec<Arg<'_>>), String> {
    let text = text.trim();
    let (name, inner) = match text.split_once('(') {
        None => (text, ""),
        Some((name, rest)) => (
            name,
            rest.trim_end()
                .strip_suffix(')')
                .ok_or_else(|| format!("`{text}` has no closing parenthesis"))?,
        ),
    };
    let name = name.trim().to_ascii_lowercase().replace('_', "");
    if name.is_empty() {
        return Err(format!("`{text}` has no layer name before its arguments"));
    }
    let mut args = Vec::new();
    for part in inner.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        args.push(match part.split_once('=') {
            Some((k, v)) => Arg {
                key: Some(k.trim()),
                value: v.trim(),
            },
            None => {
                if args.iter().any(|a: &Arg| a.key.is_some()) {
                    return Err(format!(
                        "{name}: positional argument `{part}` after a named one"
                    ));
                }
                Arg {
                    key: None,
                    value: part,
                }
            }
        });
    }
    Ok((name, args))
}

/// What the chain has made so far: the value and its channels, and whether it is tokens.
struct Chain {
    g: GraphBuilder,
    x: ValueId,
    channels: usize,
    tokens: bool,
}

impl Chain {
    fn make_tokens(&mut self, index: usize) {
        if !self.tokens {
            self.x = self
                .g
                .add_node(format!("{index}.tokens"), Op::Tokens, &[self.x]);
            self.tokens = true;
        }
    }

    fn need_image(&self, index: usize, layer: &str) -> Result<(), String> {
        if self.tokens {
            return Err(format!(
                "layer {index} ({layer}) takes an image, but the layer before it made tokens"
            ));
        }
        Ok(())
    }
}

/// The network a layer chain describes, or what is wrong with it.
pub fn build(spec: &str) -> Result<Graph, String> {
    let layers: Vec<&str> = spec.split('+').collect();
    let mut chain: Option<Chain> = None;
    for (index, text) in layers.iter().enumerate() {
        let (name, args) = split_layer(text)?;
        let order: &'static [&'static str] = match name.as_str() {
            "conv2d" => &[
                "in_channels",
                "out_channels",
                "kernel_size",
                "stride",
                "padding",
                "dilation",
                "groups",
                "bias",
            ],
            "linear" => &["in_features", "out_features", "bias"],
            "batchnorm2d" => &["num_features"],
            "layernorm" => &["normalized_shape"],
            "maxpool2d" | "avgpool2d" => &["kernel_size", "stride", "padding"],
            "multiheadattention" => &["embed_dim", "num_heads"],
            _ => &[],
        };
        let used = vec![false; args.len()];
        let mut a = Args {
            layer: text.trim(),
            args,
            used,
            order,
        };
        // The layers that say their input channels, and so may come first.
        let declared = match name.as_str() {
            "conv2d" => Some(a.size("in_channels", None)?),
            "linear" => Some(a.size("in_features", None)?),
            "batchnorm2d" => Some(a.size("num_features", None)?),
            "layernorm" => Some(a.size("normalized_shape", None)?),
            "multiheadattention" => Some(a.size("embed_dim", None)?),
            _ => None,
        };
        let c = match (chain.take(), declared) {
            (Some(c), Some(d)) if c.channels != d => {
                return Err(format!(
                    "layer {index} ({}) takes {d} channels, but the layer before it gives {}",
                    text.trim(),
                    c.channels
                ));
            }
            (Some(c), _) => c,
            (None, Some(d)) => Chain {
                g: GraphBuilder::new(spec, d, ConvInit::TorchDefault, LinearInit::TorchDefault),
                x: 0,
                channels: d,
                tokens: false,
            },
            (None, None) => {
                return Err(format!(
                    "the first layer must say its input channels (conv2d, linear, batchnorm2d, \
                     layernorm or multiheadattention), not `{}`",
                    text.trim()
                ));
            }
        };
        let c = chain.insert(c);
        let node = index.to_string();
        let op = match name.as_str() {
            "conv2d" => {
                c.need_image(index, text.trim())?;
                let out = a.size("out_channels", None)?;
                let kernel = a.size("kernel_size", None)?;
                let stride = a.size("stride", Some(1))?;
                let padding = a.size("padding", Some(0))?;
                let dilation = a.size("dilation", Some(1))?;
                let groups = a.size("groups", Some(1))?;
                if !c.channels.is_multiple_of(groups) || !out.is_multiple_of(groups) {
                    return Err(format!(
                        "{}: groups = {groups} must divide in_channels ({}) and out_channels \
                         ({out})",
                        text.trim(),
                        c.channels
                    ));
                }
                let mut conv = Conv2d::new(c.channels, out, kernel, stride, padding);
                conv.dilation = (dilation, dilation);
                conv.groups = groups;
                conv.bias = a.flag("bias", true)?;
                c.channels = out;
                Op::Conv2d(conv)
            }
            "linear" => {
                c.make_tokens(index);
                let out = a.size("out_features", None)?;
                let bias = a.flag("bias", true)?;
                let op = Op::linear(c.channels, out, bias);
                c.channels = out;
                op
            }
            "batchnorm2d" => {
                c.need_image(index, text.trim())?;
                Op::BatchNorm {
                    channels: c.channels,
                    eps: 1e-5,
                }
            }
            "layernorm" => Op::LayerNorm {
                dim: c.channels,
                eps: 1e-5,
                affine: true,
            },
            "maxpool2d" | "avgpool2d" => {
                c.need_image(index, text.trim())?;
                let kernel = a.size("kernel_size", None)?;
                let stride = a.size("stride", Some(kernel))?;
                let padding = a.size("padding", Some(0))?;
                if 2 * padding > kernel {
                    return Err(format!(
                        "{}: padding ({padding}) must be at most half of kernel_size ({kernel})",
                        text.trim()
                    ));
                }
                let pool = Pool::new(kernel, stride, padding);
                if name == "maxpool2d" {
                    Op::MaxPool(pool)
                } else {
                    Op::AvgPool(pool)
                }
            }
            "multiheadattention" => {
                c.make_tokens(index);
                let heads = a.size("num_heads", None)?;
                if !c.channels.is_multiple_of(heads) {
                    return Err(format!(
                        "{}: num_heads ({heads}) must divide embed_dim ({})",
                        text.trim(),
                        c.channels
                    ));
                }
                Op::Attention {
                    dim: c.channels,
                    heads,
                    residual: false,
                }
            }
            "relu" => Op::Relu,
            "relu6" => Op::Relu6,
            "gelu" => Op::Gelu,
            "sigmoid" => Op::Sigmoid,
            "silu" => Op::Unary(Unary::Silu),
            "hardswish" => Op::Unary(Unary::Hardswish),
            "hardsigmoid" => Op::Unary(Unary::Hardsigmoid),
            "tanh" => Op::Unary(Unary::Tanh),
            "softmax" => Op::Softmax,
            other => {
                return Err(format!(
                    "unknown layer `{other}`: conv2d, linear, batchnorm2d, layernorm, maxpool2d, \
                     avgpool2d, multiheadattention, or an activation (relu, relu6, gelu, silu, \
                     sigmoid, hardswish, hardsigmoid, tanh, softmax)"
                ));
            }
        };
        a.done()?;
        c.x = c.g.add_node(node, op, &[c.x]);
    }
    let mut c = chain.ok_or("the layer chain is empty")?;
    c.g.input_size(DEFAULT_SIDE);
    Ok(c.g.finish(c.x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conv_chain_is_a_sequential() {
        let g = build("conv2d(64, 64, 3, padding=1)+relu").unwrap();
        let names: Vec<String> = g.params().into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["0.weight", "0.bias"]);
        let plan = g.plan(128, 32, 32).unwrap();
        assert_eq!(plan.output_shape(), [128, 64, 32, 32]);
        // 2 FLOPs per MAC: 64·64·9 MACs per output pixel.
        assert_eq!(plan.macs(), 128 * 32 * 32 * 64 * 64 * 9);
        let g = build("Conv2d(3, 8, kernel_size=3, stride=2, bias=False)").unwrap();
        let names: Vec<String> = g.params().into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["0.weight"]);
        assert_eq!(g.plan(1, 9, 9).unwrap().output_shape(), [1, 8, 4, 4]);
    }

    #[test]
    fn tokens_and_attention() {
        let g = build("layernorm(768)+multiheadattention(768, 12)+linear(768, 3072)+gelu").unwrap();
        let plan = g.plan(2, 14, 14).unwrap();
        assert_eq!(plan.output_shape(), [2, 196, 3072]);
    }

    #[test]
    fn bad_chains_say_what_is_wrong() {
        for (spec, says) in [
            ("relu", "the first layer must say"),
            ("conv2d(64, 64)", "`kernel_size` is required"),
            ("conv2d(64, 64, 3, paddng=1)", "has no argument `paddng`"),
            (
                "conv2d(64, 64, 3, 1, 1, 1, 1, True, 9)",
                "at most 8 positional",
            ),
            ("conv2d(64, 64, x)", "takes a whole number"),
            ("conv2d(64, 64, 0)", "out of range"),
            ("conv2d(64, 64, 99999999999)", "out of range"),
            ("conv2d(64, 64, 3, bias=maybe)", "True or False"),
            ("conv2d(64, 32, 3)+conv2d(64, 64, 3)", "takes 64 channels"),
            ("conv2d(64, 64, 3, groups=3)", "must divide"),
            ("conv2d(64, 64, 3", "no closing parenthesis"),
            ("linear(8, 8)+conv2d(8, 8, 1)", "made tokens"),
            ("conv2d(8, 8, 1)+frobnicate", "unknown layer `frobnicate`"),
            (
                "conv2d(kernel_size=3, 8, 8)",
                "positional argument `8` after",
            ),
            ("conv2d(8, 8, 1, kernel_size=3)", "given twice"),
            ("multiheadattention(10, 3)", "must divide"),
            ("maxpool2d(2)", "the first layer"),
            ("batchnorm2d(8)+maxpool2d(2, padding=2)", "at most half"),
        ] {
            let e = build(spec)
                .err()
                .unwrap_or_else(|| panic!("{spec} was accepted"));
            assert!(e.contains(says), "{spec}: {e}");
        }
    }
}

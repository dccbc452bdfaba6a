//! Weights of a graph: seeded initialisation that follows torchvision's per-architecture
//! schemes, and safetensors loading/saving under torchvision's state_dict names, so weights
//! exported from PyTorch (`safetensors.torch.save_file(model.state_dict(), ...)`) run as is.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::{Dtype, tensor::TensorView};

use super::graph::{ConvInit, Graph, LinearInit};
use super::op::{Op, WindowAttention, WindowForm};
use super::tensor_file::TensorFile;
use super::{Rng, Tensor};

/// A state_dict on the host, in f32: backends cast to their precision when they prepare.
/// Two are equal when they hold the same tensors by name and value, drawn or made.
#[derive(Debug, Clone, Default)]
pub struct Weights {
    /// The tensors made so far: loaded, computed, or seeded and read (the others are in
    /// `drawn`; every method but [`Weights::held_bytes`] sees both).
    tensors: BTreeMap<String, Tensor>,
    /// Seeded random tensors not read yet ([`Weights::seeded`]), generated on first read.
    drawn: BTreeMap<String, Drawn>,
}

/// A seeded random tensor as [`Weights::seeded`] draws it (its [`Draw`]) and, once read, its
/// values.
#[derive(Debug, Clone)]
struct Drawn {
    draw: Draw,
    made: std::sync::OnceLock<Tensor>,
}

impl Drawn {
    fn new(draw: Draw) -> Drawn {
        Drawn {
            draw,
            made: std::sync::OnceLock::new(),
        }
    }

    fn tensor(&self) -> &Tensor {
        self.made.get_or_init(|| self.draw.generate())
    }

    fn into_tensor(self) -> Tensor {
        self.made
            .into_inner()
            .unwrap_or_else(|| self.draw.generate())
    }

    /// The bytes its values hold (none until read).
    fn bytes(&self) -> u64 {
        self.made
            .get()
            .map_or(0, |t| size_of_val(t.data.as_slice()) as u64)
    }
}

/// How a random tensor is drawn: its shape, stream and distribution.
#[derive(Debug, Clone, PartialEq)]
struct Draw {
    shape: Vec<usize>,
    stream: u64,
    fill: Fill,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    /// Normal values of this standard deviation.
    Normal(f64),
    /// Uniform values in ± this bound.
    Uniform(f64),
}

impl Draw {
    /// Normal values of standard deviation `std`, drawn from `rng` now, generated later.
    fn normal(rng: &mut Rng, shape: Vec<usize>, std: f64) -> Seeded {
        Draw::take(rng, shape, Fill::Normal(std))
    }

    /// Uniform values in ±`bound`, drawn from `rng` now, generated later.
    fn uniform(rng: &mut Rng, shape: Vec<usize>, bound: f64) -> Seeded {
        Draw::take(rng, shape, Fill::Uniform(bound))
    }

    /// A tensor of `shape` filled as `fill` says from the next stream of `rng` (one draw).
    fn take(rng: &mut Rng, shape: Vec<usize>, fill: Fill) -> Seeded {
        let stream = rng.next_u64();
        Seeded::Drawn(Draw {
            shape,
            stream,
            fill,
        })
    }

    fn generate(&self) -> Tensor {
        let mut data = vec![0f32; self.shape.iter().product()];
        match self.fill {
            Fill::Normal(std) => fill_stream(self.stream, &mut data, normal_fill(std)),
            Fill::Uniform(bound) => fill_stream(self.stream, &mut data, uniform_fill(bound)),
        }
        Tensor::new(self.shape.clone(), data)
    }
}

/// A tensor of [`Weights::seeded`]: made now (constants) or drawn for later.
enum Seeded {
    Made(Tensor),
    Drawn(Draw),
}

impl Seeded {
    fn zeros(shape: Vec<usize>) -> Seeded {
        Seeded::Made(Tensor::zeros(shape))
    }

    fn new(shape: Vec<usize>, data: Vec<f32>) -> Seeded {
        Seeded::Made(Tensor::new(shape, data))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    // The I/O error is part of the message, not a `source`: `main` prints the cause chain, and
    // a source would print it twice (issue 27).
    #[error("failed to read weights file `{path}`: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("`{path}` is not a safetensors file: {reason}")]
    Format { path: String, reason: String },
    #[error("`{path}`: tensor `{name}` is missing (the {network} graph needs shape {shape:?})")]
    Missing {
        path: String,
        network: String,
        name: String,
        shape: Vec<usize>,
    },
    #[error(
        "`{path}`: tensor `{name}` has shape {found:?}, but the {network} graph needs {expected:?}"
    )]
    Shape {
        path: String,
        network: String,
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error(
        "`{path}`: tensor `{name}` has dtype {dtype}, which is not a floating-point type (F32, F16, BF16, F64)"
    )]
    Dtype {
        path: String,
        name: String,
        dtype: String,
    },
    #[error(
        "`{path}`: tensor `{name}` is not part of {network} (is this file for another network?)"
    )]
    Unexpected {
        path: String,
        network: String,
        name: String,
    },
    #[error("failed to write weights file `{path}`: {reason}")]
    Write { path: String, reason: String },
}

impl PartialEq for Weights {
    fn eq(&self, other: &Weights) -> bool {
        self.names().eq(other.names()) && self.names().all(|name| self.get(name) == other.get(name))
    }
}

impl Weights {
    /// Seeded weights as torchvision's constructors initialise them, every tensor generated
    /// now ([`Weights::seeded`]'s, all of them).
    pub fn init(graph: &Graph, seed: u64) -> Weights {
        let mut w = Weights::seeded(graph, seed);
        w.make_all();
        w
    }

    /// Generate every drawn tensor now.
    fn make_all(&mut self) {
        for (name, d) in std::mem::take(&mut self.drawn) {
            self.tensors.insert(name, d.into_tensor());
        }
    }

    /// Seeded weights as torchvision's constructors initialise them. The same seed gives the
    /// same weights on every machine, whatever its number of threads (tensors are generated in
    /// parallel, in independently seeded blocks).
    ///
    /// The random tensors are drawn now (each one's stream of the seed) but generated when
    /// first read ([`Weights::get`], [`Weights::param`]): a backend that packs a layer and
    /// [`releases`](Weights::release) its f32 tensors then holds one layer's, not the whole
    /// network's, beside its own copies. A BF16 ViT-B/16 run held its 330 MiB of f32 weights
    /// at once before its 165 MiB of bf16 panels were done.
    pub fn seeded(graph: &Graph, seed: u64) -> Weights {
        let mut rng = Rng::new(seed);
        let (mut tensors, mut drawn) = (BTreeMap::new(), BTreeMap::new());
        for node in graph.nodes.iter().chain(&graph.training_only) {
            let mut put = |suffix: &str, t: Seeded| {
                let name = super::graph::param_name(&node.name, suffix);
                match t {
                    Seeded::Made(t) => {
                        tensors.insert(name, t);
                    }
                    Seeded::Drawn(draw) => {
                        drawn.insert(name, Drawn::new(draw));
                    }
                }
            };
            match node.op {
                Op::Conv2d(c) => {
                    let shape = node.op.params()[0].shape.clone();
                    let receptive = c.kernel.0 * c.kernel.1;
                    let fan_in = (c.in_channels / c.groups * receptive) as f64;
                    let fan_out = (c.out_channels * receptive) as f64;
                    let (weight, bias) = match graph.conv_init {
                        ConvInit::KaimingNormalFanOut => {
                            let std = (2.0 / fan_out).sqrt();
                            (
                                Draw::normal(&mut rng, shape, std),
                                Seeded::zeros(vec![c.out_channels]),
                            )
                        }
                        ConvInit::TruncNormalFanIn => (
                            Draw::normal(&mut rng, shape, (1.0 / fan_in).sqrt()),
                            Seeded::zeros(vec![c.out_channels]),
                        ),
                        ConvInit::TruncNormal001 => (
                            Draw::normal(&mut rng, shape, 0.01),
                            Seeded::zeros(vec![c.out_channels]),
                        ),
                        ConvInit::TruncNormal01 => {
                            let std = if node.name == "AuxLogits.conv1.conv" {
                                0.01
                            } else {
                                0.1
                            };
                            (
                                Draw::normal(&mut rng, shape, std),
                                Seeded::zeros(vec![c.out_channels]),
                            )
                        }
                        ConvInit::KaimingNormalFanIn => (
                            Draw::normal(&mut rng, shape, (2.0 / fan_in).sqrt()),
                            Seeded::zeros(vec![c.out_channels]),
                        ),
                        ConvInit::KaimingUniform if node.name == "classifier.1" => (
                            Draw::normal(&mut rng, shape, 0.01),
                            Seeded::zeros(vec![c.out_channels]),
                        ),
                        ConvInit::KaimingUniform => (
                            Draw::uniform(&mut rng, shape, (6.0 / fan_in).sqrt()),
                            Seeded::zeros(vec![c.out_channels]),
                        ),
                        // ±2 (the truncation) is a hundred deviations out: a plain normal.
                        ConvInit::TruncNormal002 => (
                            Draw::normal(&mut rng, shape, 0.02),
                            Seeded::zeros(vec![c.out_channels]),
                        ),
                        ConvInit::TorchDefault => {
                            let bound = 1.0 / fan_in.sqrt();
                            (
                                Draw::uniform(&mut rng, shape, bound),
                                Draw::uniform(&mut rng, vec![c.out_channels], bound),
                            )
                        }
                    };
                    put("weight", weight);
                    if c.bias {
                        put("bias", bias);
                    }
                }
                Op::BatchNorm { channels, .. } => {
                    put("weight", Seeded::new(vec![channels], vec![1.0; channels]));
                    put("bias", Seeded::zeros(vec![channels]));
                    put("running_mean", Seeded::zeros(vec![channels]));
                    put(
                        "running_var",
                        Seeded::new(vec![channels], vec![1.0; channels]),
                    );
                }
                Op::Linear {
                    in_features,
                    out_features,
                    bias,
                    ..
                } => {
                    let shape = vec![out_features, in_features];
                    let (w, b) = match graph.linear_init {
                        LinearInit::Normal001 => (
                            Draw::normal(&mut rng, shape, 0.01),
                            Seeded::zeros(vec![out_features]),
                        ),
                        LinearInit::TorchDefault => {
                            let bound = 1.0 / (in_features as f64).sqrt();
                            (
                                Draw::uniform(&mut rng, shape, bound),
                                Draw::uniform(&mut rng, vec![out_features], bound),
                            )
                        }
                        LinearInit::TruncNormal002 => (
                            Draw::normal(&mut rng, shape, 0.02),
                            Seeded::zeros(vec![out_features]),
                        ),
                        LinearInit::TruncNormal001 | LinearInit::TruncNormal01 => {
                            let std = match graph.linear_init {
                                LinearInit::TruncNormal001 => 0.01,
                                _ if node.name == "AuxLogits.fc" => 0.001,
                                _ => 0.1,
                            };
                            let bound = 1.0 / (in_features as f64).sqrt();
                            (
                                Draw::normal(&mut rng, shape, std),
                                Draw::uniform(&mut rng, vec![out_features], bound),
                            )
                        }
                        LinearInit::UniformFanOut => {
                            let bound = 1.0 / (out_features as f64).sqrt();
                            (
                                Draw::uniform(&mut rng, shape, bound),
                                Seeded::zeros(vec![out_features]),
                            )
                        }
                        LinearInit::Vit if node.name == "heads.head" => {
                            (Seeded::zeros(shape), Seeded::zeros(vec![out_features]))
                        }
                        LinearInit::Vit => {
                            let bound = (6.0 / (in_features + out_features) as f64).sqrt();
                            (
                                Draw::uniform(&mut rng, shape, bound),
                                Draw::normal(&mut rng, vec![out_features], 1e-6),
                            )
                        }
                    };
                    put("weight", w);
                    if bias {
                        put("bias", b);
                    }
                }
                Op::LayerNorm {
                    dim, affine: true, ..
                } => {
                    put("weight", Seeded::new(vec![dim], vec![1.0; dim]));
                    put("bias", Seeded::zeros(vec![dim]));
                }
                Op::ClassToken { dim } => put("", Seeded::zeros(vec![1, 1, dim])),
                // ConvNeXt's default: every block starts as (almost) the identity.
                Op::LayerScale { channels } => {
                    put("", Seeded::new(vec![channels, 1, 1], vec![1e-6; channels]))
                }
                Op::PosEmbed { tokens, dim, .. } => {
                    put("", Draw::normal(&mut rng, vec![1, tokens, dim], 0.02))
                }
                // Swin: trunc_normal_(std=0.02) for the projections and the bias table, zero
                // biases.
                // MaxViT: N(0, 0.02) for the projections (the same at this deviation).
                Op::WindowAttention(WindowAttention {
                    dim,
                    heads,
                    window,
                    form,
                    ..
                }) => {
                    let [qkv_w, qkv_b, proj_w, proj_b] = form.projections();
                    put(qkv_w, Draw::normal(&mut rng, vec![3 * dim, dim], 0.02));
                    put(qkv_b, Seeded::zeros(vec![3 * dim]));
                    put(proj_w, Draw::normal(&mut rng, vec![dim, dim], 0.02));
                    put(proj_b, Seeded::zeros(vec![dim]));
                    let side = 2 * window - 1;
                    if form.cosine() {
                        let scale = vec![10f32.ln(); heads];
                        put("logit_scale", Seeded::new(vec![heads, 1, 1], scale));
                        put(
                            "cpb_mlp.0.weight",
                            Draw::normal(&mut rng, vec![512, 2], 0.02),
                        );
                        put("cpb_mlp.0.bias", Seeded::zeros(vec![512]));
                        put(
                            "cpb_mlp.2.weight",
                            Draw::normal(&mut rng, vec![heads, 512], 0.02),
                        );
                        let coords = super::op::WindowGrid::coords_table(window);
                        put(
                            "relative_coords_table",
                            Seeded::new(vec![1, side, side, 2], coords),
                        );
                    } else {
                        let table = Draw::normal(&mut rng, vec![side * side, heads], 0.02);
                        put("relative_position_bias_table", table);
                    }
                }
                // nn.MultiheadAttention's own reset: xavier_uniform over the packed q/k/v
                // projection, zero biases; the output projection keeps Linear's default.
                Op::Attention { dim, .. } => {
                    let bound = (6.0 / (4 * dim) as f64).sqrt();
                    put(
                        "in_proj_weight",
                        Draw::uniform(&mut rng, vec![3 * dim, dim], bound),
                    );
                    put("in_proj_bias", Seeded::zeros(vec![3 * dim]));
                    let bound = 1.0 / (dim as f64).sqrt();
                    put(
                        "out_proj.weight",
                        Draw::uniform(&mut rng, vec![dim, dim], bound),
                    );
                    put("out_proj.bias", Seeded::zeros(vec![dim]));
                }
                _ => {}
            }
        }
        Weights { tensors, drawn }
    }

    /// Load a safetensors state_dict and check it against the graph: every tensor present with
    /// its exact shape, nothing foreign. Integer buffers are ignored: BatchNorm's
    /// `num_batches_tracked` and Swin's `relative_position_index` (which the kernels compute).
    pub fn load(path: &Path, graph: &Graph) -> Result<Weights, WeightsError> {
        // The header is checked against the graph before any tensor is read: a file for
        // another network, or a huge one, costs a header read (issue 27).
        let mut file = TensorFile::open(path)?;
        let p = file.path.clone();
        let expected = graph.params();
        let known: HashMap<&str, &[usize]> = expected
            .iter()
            .map(|e| (e.name.as_str(), e.shape.as_slice()))
            .collect();
        // Sorted, so the tensor an error names is the same on every run.
        if let Some(name) = file.names().find(|n| {
            !known.contains_key(n)
                && !n.ends_with(".num_batches_tracked")
                && !n.ends_with(".relative_position_index")
        }) {
            return Err(WeightsError::Unexpected {
                path: p,
                network: graph.name.clone(),
                name: name.to_string(),
            });
        }
        for e in &expected {
            match file.shape(&e.name) {
                // A training-only module's tensors (torchvision drops the auxiliary
                // classifiers from pretrained models) are never read.
                None if !e.used => {}
                None => {
                    return Err(WeightsError::Missing {
                        path: p,
                        network: graph.name.clone(),
                        name: e.name.clone(),
                        shape: e.shape.clone(),
                    });
                }
                Some(found) if found != e.shape.as_slice() => {
                    return Err(WeightsError::Shape {
                        path: p,
                        network: graph.name.clone(),
                        name: e.name.clone(),
                        found: found.to_vec(),
                        expected: e.shape.clone(),
                    });
                }
                Some(_) => {}
            }
        }
        let mut tensors = BTreeMap::new();
        for e in &expected {
            if e.used || file.shape(&e.name).is_some() {
                tensors.insert(e.name.clone(), file.read(&e.name)?);
            }
        }
        Ok(Weights {
            tensors,
            drawn: BTreeMap::new(),
        })
    }

    /// Save as a safetensors state_dict (f32) that `torchvision.models.<name>()` loads with
    /// `load_state_dict(..., strict=True)`: BatchNorm layers get a zero `num_batches_tracked`,
    /// Swin's and MaxViT's window attention its `relative_position_index`.
    pub fn save(&self, path: &Path, graph: &Graph) -> Result<(), WeightsError> {
        let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for name in self.names() {
            // A drawn tensor is generated for the file alone, not kept.
            let drawn = self.drawn.get(name).filter(|d| d.made.get().is_none());
            let generated = drawn.map(|d| d.draw.generate());
            let t = generated
                .as_ref()
                .or_else(|| self.get(name))
                .expect("named");
            let bytes = bytemuck::cast_slice(&t.data).to_vec();
            blobs.push((name.clone(), Dtype::F32, t.shape.clone(), bytes));
        }
        for node in graph.nodes.iter().chain(&graph.training_only) {
            // Every batch norm saved (a training-only one may have been left out).
            let saved = self.contains(&format!("{}.running_mean", node.name));
            if matches!(node.op, Op::BatchNorm { .. }) && saved {
                blobs.push((
                    format!("{}.num_batches_tracked", node.name),
                    Dtype::I64,
                    vec![],
                    0i64.to_le_bytes().to_vec(),
                ));
            }
            if let Op::WindowAttention(WindowAttention { window, form, .. }) = node.op {
                let keys = window * window;
                // Swin's is flat, MaxViT's (query, key).
                let shape = match form {
                    WindowForm::Swin | WindowForm::SwinV2 => vec![keys * keys],
                    WindowForm::MaxVitWindow | WindowForm::MaxVitGrid => vec![keys, keys],
                };
                let grid = super::op::WindowGrid::new(window, window, window, 0);
                let index: Vec<u8> = (0..keys * keys)
                    .flat_map(|k| (grid.bias_row(k / keys, k % keys) as i64).to_le_bytes())
                    .collect();
                blobs.push((
                    format!("{}.relative_position_index", node.name),
                    Dtype::I64,
                    shape,
                    index,
                ));
            }
        }
        let write_err = |reason: String| WeightsError::Write {
            path: path.display().to_string(),
            reason,
        };
        let mut views = Vec::with_capacity(blobs.len());
        for (name, dtype, shape, bytes) in &blobs {
            views.push((
                name.clone(),
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map_err(|e| write_err(e.to_string()))?,
            ));
        }
        let meta = HashMap::from([
            ("format".to_string(), "pt".to_string()),
            ("network".to_string(), graph.name.clone()),
        ]);
        safetensors::serialize_to_file(views, Some(meta), path)
            .map_err(|e| write_err(e.to_string()))
    }

    /// Tensor `name`, generated now if it was drawn and not read yet ([`Weights::seeded`]).
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        (self.tensors.get(name)).or_else(|| self.drawn.get(name).map(Drawn::tensor))
    }

    /// Every tensor's name, in order.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        let mut names: Vec<_> = self.tensors.keys().chain(self.drawn.keys()).collect();
        names.sort_unstable();
        names.into_iter()
    }

    /// How many tensors it holds, drawn or made.
    pub fn len(&self) -> usize {
        self.tensors.len() + self.drawn.len()
    }

    /// Whether it holds no tensor at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it holds tensor `name`, drawn or made.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.drawn.contains_key(name)
    }

    /// Bytes of values held now: the made tensors' and the drawn ones already read (a
    /// drawn tensor nobody read holds none).
    pub fn held_bytes(&self) -> u64 {
        let made = self.tensors.values();
        let made: u64 = made.map(|t| size_of_val(t.data.as_slice()) as u64).sum();
        made + self.drawn.values().map(Drawn::bytes).sum::<u64>()
    }

    /// Tensor `name` to change in place, generated now if it was drawn.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        if let Some(d) = self.drawn.remove(name) {
            self.tensors.insert(name.to_string(), d.into_tensor());
        }
        self.tensors.get_mut(name)
    }

    /// Every tensor to change in place, in name order, the drawn ones generated now.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&String, &mut Tensor)> {
        self.make_all();
        self.tensors.iter_mut()
    }

    /// Keep only the tensors whose names `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.tensors.retain(|name, _| keep(name));
        self.drawn.retain(|name, _| keep(name));
    }

    /// Set tensor `name` (in place of what it held, drawn or made).
    pub fn insert(&mut self, name: String, t: Tensor) {
        self.drawn.remove(&name);
        self.tensors.insert(name, t);
    }

    /// Drop tensor `name`, drawn or made.
    pub fn remove(&mut self, name: &str) {
        self.drawn.remove(name);
        self.tensors.remove(name);
    }

    /// Drop the tensors of `node`'s parameters (those its op declares), returning their
    /// bytes: a backend that has its own copy of a node's weights frees the f32 ones, so a
    /// session being prepared never holds the whole network twice.
    pub fn release(&mut self, node: &super::graph::Node) -> u64 {
        let names = node.op.params().into_iter();
        let names = names.map(|p| super::graph::param_name(&node.name, p.suffix));
        // A drawn tensor nobody read held nothing.
        let mut bytes = 0;
        for name in names {
            let made = self.tensors.remove(&name);
            bytes += made.map_or(0, |t| size_of_val(t.data.as_slice()) as u64);
            bytes += self.drawn.remove(&name).map_or(0, |d| d.bytes());
        }
        bytes
    }

    /// Parameter `suffix` (`weight`, `bias`, ...) of node `node` (`layer1.0.conv1`): what a
    /// backend packs when it prepares the node.
    pub fn param(&self, node: &str, suffix: &str) -> Result<&[f32], MissingTensor> {
        let name = super::graph::param_name(node, suffix);
        (self.get(&name))
            .map(|t| t.data.as_slice())
            .ok_or(MissingTensor(name))
    }

    /// Batch norm `node` as the per-channel affine map (scale, shift) it computes in
    /// inference: what every backend runs it as.
    pub fn batch_norm_affine(
        &self,
        node: &str,
        eps: f32,
    ) -> Result<(Vec<f32>, Vec<f32>), MissingTensor> {
        let p = |suffix| self.param(node, suffix);
        let (gamma, beta) = (p("weight")?, p("bias")?);
        let (mean, var) = (p("running_mean")?, p("running_var")?);
        Ok(super::op::batch_norm_affine(gamma, beta, mean, var, eps))
    }

    /// Layer norm `node`'s weight and bias: its own, or the identity's once `--compile` folded
    /// them into what follows (`affine` false).
    pub fn layer_norm(
        &self,
        node: &str,
        (dim, affine): (usize, bool),
    ) -> Result<(Vec<f32>, Vec<f32>), MissingTensor> {
        if !affine {
            return Ok((vec![1.0; dim], vec![0.0; dim]));
        }
        Ok((
            self.param(node, "weight")?.to_vec(),
            self.param(node, "bias")?.to_vec(),
        ))
    }

    /// Window attention `node` as every backend's kernels take it (Swin V1 or V2, MaxViT).
    pub fn window_attention(
        &self,
        node: &str,
        &WindowAttention {
            dim, heads, form, ..
        }: &WindowAttention,
    ) -> Result<WindowParams, MissingTensor> {
        let p = |suffix| self.param(node, suffix);
        let mut qkv_bias = p(form.projections()[1])?.to_vec();
        // A learned table; Swin scales by 1/√dh, MaxViT by 1/√C (torchvision's
        // `feat_dim ** -0.5`).
        let scaled_by = match form {
            WindowForm::Swin => Some(dim / heads.max(1)),
            WindowForm::MaxVitWindow | WindowForm::MaxVitGrid => Some(dim),
            WindowForm::SwinV2 => None,
        };
        if let Some(over) = scaled_by {
            return Ok(WindowParams {
                qkv_bias,
                table: p("relative_position_bias_table")?.to_vec(),
                scales: vec![1.0 / (over as f32).sqrt(); heads],
                cosine: false,
            });
        }
        // torchvision zeroes k's bias (a clone of it) in every forward pass.
        qkv_bias[dim..2 * dim].fill(0.0);
        let scales = (p("logit_scale")?.iter())
            .map(|s| s.min(100f32.ln()).exp())
            .collect();
        // 16·sigmoid(cpb_mlp(coords)): Linear(2, 512), ReLU, Linear(512, heads, no bias).
        let (w1, b1, w2) = (
            p("cpb_mlp.0.weight")?,
            p("cpb_mlp.0.bias")?,
            p("cpb_mlp.2.weight")?,
        );
        let coords = p("relative_coords_table")?;
        let hidden = b1.len();
        let mut table = Vec::with_capacity(coords.len() / 2 * heads);
        for xy in coords.chunks(2) {
            let mid: Vec<f32> = (0..hidden)
                .map(|j| (w1[2 * j] * xy[0] + w1[2 * j + 1] * xy[1] + b1[j]).max(0.0))
                .collect();
            table.extend((0..heads).map(|h| {
                let v: f32 = (0..hidden).map(|j| w2[h * hidden + j] * mid[j]).sum();
                16.0 / (1.0 + (-v).exp())
            }));
        }
        Ok(WindowParams {
            qkv_bias,
            table,
            scales,
            cosine: true,
        })
    }
}

/// A window attention's numbers as the kernels take them (see [`Weights::window_attention`]).
#[derive(Debug, Clone, PartialEq)]
pub struct WindowParams {
    /// The q/k/v projection's bias (V2: k's part zero): what a padded token holds.
    pub qkv_bias: Vec<f32>,
    /// The relative position bias, (table row, head): V1's learned table, V2's
    /// 16·sigmoid(cpb_mlp(coordinates)).
    pub table: Vec<f32>,
    /// The scores' scale per head: 1/√dh (MaxViT 1/√C), or V2's exp(min(logit_scale, ln 100)).
    pub scales: Vec<f32>,
    /// V2's cosine attention: q and k normalised before their product.
    pub cosine: bool,
}

/// A tensor a prepared node needs and the weights lack.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("weights have no tensor `{0}`")]
pub struct MissingTensor(pub String);

/// Read the one tensor of a safetensors file (or the one called `name` when there are several).
pub fn read_tensor(path: &Path, name: &str) -> Result<Tensor, WeightsError> {
    let mut file = TensorFile::open(path)?;
    let chosen = file.pick(name)?;
    file.read(&chosen)
}

/// Write tensors as f32 safetensors.
pub fn write_tensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<(), WeightsError> {
    let blobs: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.to_string(),
                t.shape.clone(),
                bytemuck::cast_slice(&t.data).to_vec(),
            )
        })
        .collect();
    let write_err = |reason: String| WeightsError::Write {
        path: path.display().to_string(),
        reason,
    };
    let mut views = Vec::new();
    for (n, s, b) in &blobs {
        views.push((
            n.clone(),
            TensorView::new(Dtype::F32, s.clone(), b).map_err(|e| write_err(e.to_string()))?,
        ));
    }
    safetensors::serialize_to_file(views, None, path).map_err(|e| write_err(e.to_string()))
}

/// Values per independently seeded block: a tensor is generated block by block in parallel,
/// and the same seed gives the same values whatever the number of threads.
const BLOCK: usize = 1 << 14;

/// Fill `out` from `stream` (one draw of a generator: [`Draw`]'s, or `normal_into`'s): block b
/// of the values comes from its own stream, blocks in parallel.
fn fill_stream(stream: u64, out: &mut [f32], fill: impl Fn(&mut Rng, &mut [f32]) + Sync) {
    use rayon::prelude::*;
    out.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(b, block)| {
            let mut r = Rng::new(stream ^ (b as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
            fill(&mut r, block);
        });
}

/// Normal values of standard deviation `std` from one draw of `rng` into `out`, generated in
/// parallel blocks (the same on every machine): what [`Weights::seeded`] gives a normal
/// tensor of `out.len()` values drawn at that point.
pub(crate) fn normal_into(rng: &mut Rng, out: &mut [f32], std: f64) {
    fill_stream(rng.next_u64(), out, normal_fill(std))
}

/// A block's normal values of standard deviation `std`.
fn normal_fill(std: f64) -> impl Fn(&mut Rng, &mut [f32]) + Sync {
    move |r, out| {
        // Marsaglia's polar method: two independent normals per accepted point of the unit
        // disc, with one logarithm and no trigonometry. Points are drawn a batch at a time and
        // the logarithms, divisions and square roots then run over the batch: independent of
        // each other, they overlap instead of waiting on one another.
        const BATCH: usize = 256;
        let (mut xs, mut ys, mut ss) = ([0f64; BATCH], [0f64; BATCH], [0f64; BATCH]);
        for chunk in out.chunks_mut(2 * BATCH) {
            let pairs = chunk.len().div_ceil(2);
            // Without a branch on acceptance (a fifth of the points miss the disc, at random):
            // every point is written and only an accepted one moves on.
            let mut i = 0;
            while i < pairs {
                let x = 2.0 * r.uniform() - 1.0;
                let y = 2.0 * r.uniform() - 1.0;
                let s = x * x + y * y;
                (xs[i], ys[i], ss[i]) = (x, y, s);
                i += usize::from(s > 0.0 && s < 1.0);
            }
            let mut fs = [0f64; BATCH];
            for (f, &s) in fs.iter_mut().zip(&ss[..pairs]) {
                *f = s.ln();
            }
            for (f, &s) in fs.iter_mut().zip(&ss[..pairs]) {
                *f = (-2.0 * *f / s).sqrt() * std;
            }
            for (i, pair) in chunk.chunks_mut(2).enumerate() {
                pair[0] = (xs[i] * fs[i]) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (ys[i] * fs[i]) as f32;
                }
            }
        }
    }
}

/// A block's uniform values in ±`bound`.
fn uniform_fill(bound: f64) -> impl Fn(&mut Rng, &mut [f32]) + Sync {
    move |r, out| {
        out.iter_mut()
            .for_each(|v| *v = ((r.uniform() * 2.0 - 1.0) * bound) as f32)
    }
}

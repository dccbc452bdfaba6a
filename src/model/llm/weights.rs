//! A decoder's weights under Hugging Face's tensor names: seeded random ones (generated tensor by
//! tensor when a backend asks, so a 7B model never sits in memory twice), or a model folder's
//! safetensors — one file or shards listed by `model.safetensors.index.json` — checked against
//! the config before anything is read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

use super::config::{DecoderConfig, Family};
use crate::model::Rng;
use crate::model::tensor_file::TensorFile;

/// Where the tensors come from.
pub enum TensorSource {
    /// Normal(0, 0.02) matrices and biases (Hugging Face's `initializer_range`), norms at one;
    /// each tensor from its own stream, seeded by the seed and its name.
    Seeded { seed: u64 },
    /// Safetensors files of a model folder and which tensor lives in which.
    Folder {
        dir: PathBuf,
        files: Vec<Mutex<TensorFile>>,
        /// Our name → (file index, the name in the file).
        index: BTreeMap<String, (usize, String)>,
    },
}

/// A decoder's config and where its tensors come from.
pub struct DecoderWeights {
    pub config: DecoderConfig,
    pub source: TensorSource,
    /// Every tensor the config needs and its stored shape ([`tensors`], listed once).
    shapes: BTreeMap<String, Vec<usize>>,
}

/// The standard deviation of seeded weights (`initializer_range` of every config here).
const INIT_STD: f64 = 0.02;

impl DecoderWeights {
    pub fn seeded(config: DecoderConfig, seed: u64) -> DecoderWeights {
        DecoderWeights {
            shapes: tensors(&config).into_iter().collect(),
            config,
            source: TensorSource::Seeded { seed },
        }
    }

    /// A Hugging Face model folder: `config.json` and `model.safetensors` or the shards that
    /// `model.safetensors.index.json` lists. Every tensor the config needs must be there with
    /// its shape; the first that is not is named.
    pub fn open_folder(dir: &Path) -> Result<DecoderWeights> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            bail!(
                "`{}` has no config.json: --model-dir takes a Hugging Face model folder",
                dir.display()
            );
        }
        let text = crate::files::read_text(&config_path)?;
        let name = dir
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        let mut config = DecoderConfig::from_hf_json(&name, &text)
            .with_context(|| format!("`{}`", config_path.display()))?;
        // transformers' generate stops at generation_config.json's end tokens, which instruct
        // models list there (Qwen2.5-Instruct's <|endoftext|> beside config.json's <|im_end|>).
        let generation = dir.join("generation_config.json");
        if generation.is_file() {
            let text = crate::files::read_text(&generation)?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("`{}` is not JSON", generation.display()))?;
            let ids: Vec<&serde_json::Value> = match v.get("eos_token_id") {
                Some(serde_json::Value::Array(ids)) => ids.iter().collect(),
                Some(id) => vec![id],
                None => Vec::new(),
            };
            for v in ids {
                let id = v
                    .as_u64()
                    .and_then(|i| u32::try_from(i).ok())
                    .with_context(|| {
                        format!(
                            "`{}`: eos_token_id {v} is not a token id",
                            generation.display()
                        )
                    })?;
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        let index_path = dir.join("model.safetensors.index.json");
        let shards: Vec<String> = if index_path.is_file() {
            let text = crate::files::read_text(&index_path)?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("`{}` is not JSON", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("`{}` has no weight_map", index_path.display()))?;
            let mut files: Vec<String> = map
                .values()
                .map(|f| f.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .with_context(|| {
                    format!(
                        "`{}`: a weight_map entry is not a file name",
                        index_path.display()
                    )
                })?;
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".into()]
        };
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for shard in &shards {
            let path = crate::files::child(dir, shard)
                .with_context(|| format!("`{}` names a weights file", index_path.display()))?;
            if !path.is_file() {
                bail!(
                    "`{}`: no such weights file in the model folder",
                    path.display()
                );
            }
            let file = TensorFile::open(&path)?;
            // A tensor in two shards: which one a reader takes would be its choice.
            for n in file.names() {
                if let Some((other, _)) = index.insert(n.to_string(), (files.len(), n.to_string()))
                {
                    bail!(
                        "tensor `{n}` is in two weights files, `{}` and `{shard}`: refusing to pick one",
                        shards[other]
                    );
                }
            }
            files.push(Mutex::new(file));
        }
        // GPT-2's checkpoints name tensors with or without `transformer.`. A tensor the model
        // needs under both names is refused: which one a reader takes would be its choice.
        let shapes: BTreeMap<String, Vec<usize>> = tensors(&config).into_iter().collect();
        let prefixed: Vec<(String, (usize, String))> = index
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix("transformer.")
                    .map(|s| (s.into(), v.clone()))
            })
            .collect();
        for (name, (f, stored)) in prefixed {
            match index.get(&name) {
                None => {
                    index.insert(name, (f, stored));
                }
                Some((other, _)) if shapes.contains_key(&name) => bail!(
                    "tensor `{name}` is in the model folder twice, as `{name}` (in `{}`) and as \
                     `{stored}` (in `{}`): refusing to pick one",
                    shards[*other],
                    shards[f]
                ),
                Some(_) => {}
            }
        }
        let weights = DecoderWeights {
            shapes,
            config,
            source: TensorSource::Folder {
                dir: dir.to_path_buf(),
                files,
                index,
            },
        };
        weights.check_shapes()?;
        Ok(weights)
    }

    /// Every tensor the config needs is in the folder with the shape it needs.
    fn check_shapes(&self) -> Result<()> {
        let TensorSource::Folder { files, index, dir } = &self.source else {
            return Ok(());
        };
        // In the config's order, so the first missing tensor named is the first a reader meets.
        for (name, shape) in tensors(&self.config) {
            let Some((f, stored)) = index.get(&name) else {
                bail!(
                    "`{}`: tensor `{name}` is missing (the {} config needs shape {shape:?})",
                    dir.display(),
                    self.config.model_type
                );
            };
            let file = files[*f]
                .lock()
                .map_err(|_| anyhow::anyhow!("a reader failed"))?;
            let found = file.shape(stored).unwrap_or(&[]);
            if found != shape.as_slice() {
                bail!(
                    "`{}`: tensor `{name}` has shape {found:?}, but the config needs {shape:?}",
                    file.path
                );
            }
        }
        Ok(())
    }

    /// Tensor `name` (one of [`tensors`]) in f32, row-major in its stored shape.
    pub fn tensor(&self, name: &str) -> Result<Vec<f32>> {
        let len: usize = self.shape(name)?.iter().product();
        if let TensorSource::Folder { .. } = self.source {
            // The file's values as read: no second copy of a tensor that can be 2 GB.
            let values = self.read_stored(name)?;
            if values.len() != len {
                bail!("`{name}` has {} values, not {len}", values.len());
            }
            return Ok(values);
        }
        let mut out = vec![0f32; len];
        self.tensor_into(name, &mut out)?;
        Ok(out)
    }

    /// Tensor `name` as a model folder stores it, in f32 (folders only).
    fn read_stored(&self, name: &str) -> Result<Vec<f32>> {
        let TensorSource::Folder { files, index, .. } = &self.source else {
            bail!("`{name}` is seeded, not stored");
        };
        let (f, stored) = &index[name];
        let mut file = files[*f]
            .lock()
            .map_err(|_| anyhow::anyhow!("a reader failed"))?;
        Ok(file.read(stored)?.data)
    }

    /// [`DecoderWeights::tensor`] into `out`, which holds exactly its values: how a fused
    /// matrix is filled part by part, and how a loader reuses one buffer for every layer
    /// instead of asking the system for fresh (zeroed) memory each time.
    pub fn tensor_into(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let len: usize = self.shape(name)?.iter().product();
        if out.len() != len {
            bail!("`{name}` has {len} values, not the {} asked for", out.len());
        }
        match &self.source {
            TensorSource::Seeded { seed } => {
                let mut rng = Rng::new(seed ^ crate::files::stable_hash(name.as_bytes()));
                // Norms start as the identity: weights one, biases zero.
                if name.contains("norm.") || name.contains("ln_") {
                    out.fill(if name.ends_with(".weight") { 1.0 } else { 0.0 });
                } else {
                    crate::model::weights::normal_into(&mut rng, out, INIT_STD);
                }
            }
            TensorSource::Folder { .. } => out.copy_from_slice(&self.read_stored(name)?),
        }
        Ok(())
    }

    /// The stored shape of tensor `name`, which the config must need.
    fn shape(&self, name: &str) -> Result<&[usize]> {
        self.shapes
            .get(name)
            .map(Vec::as_slice)
            .with_context(|| format!("the {} model has no tensor `{name}`", self.config.name))
    }

    /// A linear layer's weight as (out, in) rows whatever the checkpoint stores: GPT-2's
    /// Conv1D keeps (in, out) and is transposed here.
    pub fn linear(&self, name: &str) -> Result<Vec<f32>> {
        let w = self.tensor(name)?;
        if self.config.family != Family::Gpt2 || name.starts_with("wte") {
            return Ok(w);
        }
        let (rows, cols) = match self.shape(name)? {
            [rows, cols] => (*rows, *cols),
            other => bail!("`{name}` has shape {other:?}, not a matrix"),
        };
        let mut t = vec![0f32; w.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = w[r * cols + c];
            }
        }
        Ok(t)
    }
}

/// A linear layer as the sessions run it: weight (out, in) rows and an f32 bias.
#[derive(Default)]
pub struct Linear {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub inputs: usize,
    pub outputs: usize,
}

/// RMSNorm (no bias) or LayerNorm (with one).
#[derive(Default)]
pub struct Norm {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

/// One block's tensors, fused the way every backend runs them: q, k and v in one GEMM (rows of
/// q, then k, then v), Llama's gate and up in another (gate rows first; GPT-2's `up` is c_fc).
#[derive(Default)]
pub struct LayerTensors {
    pub norm1: Norm,
    pub qkv: Linear,
    pub o: Linear,
    pub norm2: Norm,
    pub up: Linear,
    pub down: Linear,
}

impl DecoderWeights {
    fn norm(&self, prefix: &str) -> Result<Norm> {
        Ok(Norm {
            weight: self.tensor(&format!("{prefix}.weight"))?,
            bias: if self.config.family == Family::Gpt2 {
                Some(self.tensor(&format!("{prefix}.bias"))?)
            } else {
                None
            },
        })
    }

    /// Block `l`'s tensors, fused as [`LayerTensors`] says.
    pub fn layer(&self, l: usize) -> Result<LayerTensors> {
        let mut t = LayerTensors::default();
        self.layer_into(l, &mut t)?;
        Ok(t)
    }

    /// [`DecoderWeights::layer`] into `t`, reusing its buffers: a loader that packs each
    /// layer before the next keeps one layer's f32 copies for the whole model. For
    /// Llama-3.2-1B that turned ~10 GB of freshly mapped (and so zeroed) memory into ~3.
    pub fn layer_into(&self, l: usize, t: &mut LayerTensors) -> Result<()> {
        let c = &self.config;
        let (d, inner) = (c.hidden_size, c.intermediate_size);
        let (qw, kvw) = c.qkv_widths();
        if c.family == Family::Gpt2 {
            let p = format!("h.{l}");
            let w = |n: &str| self.linear(&format!("{p}.{n}.weight"));
            let b = |n: &str| self.tensor(&format!("{p}.{n}.bias")).map(Some);
            let linear = |weight, bias, inputs, outputs| Linear {
                weight,
                bias,
                inputs,
                outputs,
            };
            *t = LayerTensors {
                norm1: self.norm(&format!("{p}.ln_1"))?,
                qkv: linear(w("attn.c_attn")?, b("attn.c_attn")?, d, qw + 2 * kvw),
                o: linear(w("attn.c_proj")?, b("attn.c_proj")?, qw, d),
                norm2: self.norm(&format!("{p}.ln_2"))?,
                up: linear(w("mlp.c_fc")?, b("mlp.c_fc")?, d, inner),
                down: linear(w("mlp.c_proj")?, b("mlp.c_proj")?, inner, d),
            };
            return Ok(());
        }
        let p = format!("model.layers.{l}");
        // Parts of one (out, in) matrix stacked by rows, each filled in place.
        let fill = |lin: &mut Linear, parts: &[&str], outputs: usize, inputs: usize| {
            lin.weight.resize(outputs * inputs, 0.0);
            lin.inputs = inputs;
            lin.outputs = outputs;
            let mut rest = lin.weight.as_mut_slice();
            for part in parts {
                let name = format!("{p}.{part}.weight");
                let len: usize = self.shape(&name)?.iter().product();
                let (head, tail) = rest.split_at_mut(len.min(rest.len()));
                self.tensor_into(&name, head)?;
                rest = tail;
            }
            if !rest.is_empty() {
                let short = rest.len();
                bail!("`{p}`: {parts:?} leave {short} of {outputs} × {inputs} values unfilled");
            }
            lin.bias = None;
            Ok::<_, anyhow::Error>(())
        };
        fill(
            &mut t.qkv,
            &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            qw + 2 * kvw,
            d,
        )?;
        if c.qkv_bias {
            let b = |n: &str| self.tensor(&format!("{p}.self_attn.{n}_proj.bias"));
            t.qkv.bias = Some([b("q")?, b("k")?, b("v")?].concat());
        }
        fill(&mut t.o, &["self_attn.o_proj"], d, qw)?;
        fill(&mut t.up, &["mlp.gate_proj", "mlp.up_proj"], 2 * inner, d)?;
        fill(&mut t.down, &["mlp.down_proj"], d, inner)?;
        t.norm1 = self.norm(&format!("{p}.input_layernorm"))?;
        t.norm2 = self.norm(&format!("{p}.post_attention_layernorm"))?;
        Ok(())
    }

    /// The token table (vocabulary × hidden).
    pub fn token_table(&self) -> Result<Vec<f32>> {
        self.tensor(match self.config.family {
            Family::Gpt2 => "wte.weight",
            Family::Llama => "model.embed_tokens.weight",
        })
    }

    /// GPT-2's learned positions (positions × hidden); `None` for rotary models.
    pub fn position_table(&self) -> Result<Option<Vec<f32>>> {
        match self.config.family {
            Family::Gpt2 => self.tensor("wpe.weight").map(Some),
            Family::Llama => Ok(None),
        }
    }

    pub fn final_norm(&self) -> Result<Norm> {
        self.norm(match self.config.family {
            Family::Gpt2 => "ln_f",
            Family::Llama => "model.norm",
        })
    }

    /// The LM head's own weight (vocabulary × hidden), `None` when it is the token table.
    pub fn lm_head(&self) -> Result<Option<Vec<f32>>> {
        if self.config.tie_word_embeddings {
            return Ok(None);
        }
        self.tensor("lm_head.weight").map(Some)
    }
}

/// Every tensor a config needs, with its stored shape, under Hugging Face's names.
pub fn tensors(c: &DecoderConfig) -> Vec<(String, Vec<usize>)> {
    let (d, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (q, kv) = c.qkv_widths();
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    let mut put = |n: String, s: &[usize]| out.push((n, s.to_vec()));
    match c.family {
        Family::Llama => {
            put("model.embed_tokens.weight".into(), &[v, d]);
            for l in 0..c.num_hidden_layers {
                let p = format!("model.layers.{l}");
                put(format!("{p}.input_layernorm.weight"), &[d]);
                for (proj, width) in [("q", q), ("k", kv), ("v", kv)] {
                    put(format!("{p}.self_attn.{proj}_proj.weight"), &[width, d]);
                    if c.qkv_bias {
                        put(format!("{p}.self_attn.{proj}_proj.bias"), &[width]);
                    }
                }
                put(format!("{p}.self_attn.o_proj.weight"), &[d, q]);
                put(format!("{p}.post_attention_layernorm.weight"), &[d]);
                put(format!("{p}.mlp.gate_proj.weight"), &[i, d]);
                put(format!("{p}.mlp.up_proj.weight"), &[i, d]);
                put(format!("{p}.mlp.down_proj.weight"), &[d, i]);
            }
            put("model.norm.weight".into(), &[d]);
            if !c.tie_word_embeddings {
                put("lm_head.weight".into(), &[v, d]);
            }
        }
        Family::Gpt2 => {
            put("wte.weight".into(), &[v, d]);
            put("wpe.weight".into(), &[c.max_position_embeddings, d]);
            for l in 0..c.num_hidden_layers {
                let p = format!("h.{l}");
                for (name, shape) in [
                    ("ln_1.weight", vec![d]),
                    ("ln_1.bias", vec![d]),
                    ("attn.c_attn.weight", vec![d, q + 2 * kv]),
                    ("attn.c_attn.bias", vec![q + 2 * kv]),
                    ("attn.c_proj.weight", vec![q, d]),
                    ("attn.c_proj.bias", vec![d]),
                    ("ln_2.weight", vec![d]),
                    ("ln_2.bias", vec![d]),
                    ("mlp.c_fc.weight", vec![d, i]),
                    ("mlp.c_fc.bias", vec![i]),
                    ("mlp.c_proj.weight", vec![i, d]),
                    ("mlp.c_proj.bias", vec![d]),
                ] {
                    put(format!("{p}.{name}"), &shape);
                }
            }
            put("ln_f.weight".into(), &[d]);
            put("ln_f.bias".into(), &[d]);
            if !c.tie_word_embeddings {
                put("lm_head.weight".into(), &[v, d]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensors listed hold exactly the parameters the config counts.
    #[test]
    fn tensor_list_matches_the_parameter_count() {
        for name in crate::model::llm::names() {
            let c = crate::model::llm::built_in(name).unwrap();
            let n: u64 = tensors(&c)
                .iter()
                .map(|(_, s)| s.iter().product::<usize>() as u64)
                .sum();
            assert_eq!(n, c.params(), "{name}");
        }
    }

    /// A layer filled into buffers that held another layer is the one made fresh, and its
    /// fused matrices are its tensors stacked in order (q, k, v; gate, up).
    #[test]
    fn layers_filled_in_place_match_their_tensors() {
        for name in ["qwen2.5-0.5b", "gpt2"] {
            let mut c = crate::model::llm::built_in(name).unwrap();
            (c.hidden_size, c.intermediate_size, c.vocab_size) = (32, 48, 50);
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim) = (4, 2, 8);
            c.num_hidden_layers = 3;
            let w = DecoderWeights::seeded(c, 11);
            let mut reused = LayerTensors::default();
            for l in [2, 0, 1] {
                w.layer_into(l, &mut reused).unwrap();
                let fresh = w.layer(l).unwrap();
                let pairs = [
                    (&reused.qkv, &fresh.qkv),
                    (&reused.o, &fresh.o),
                    (&reused.up, &fresh.up),
                    (&reused.down, &fresh.down),
                ];
                for (a, b) in pairs {
                    assert_eq!(a.weight, b.weight, "{name} layer {l}");
                    assert_eq!(a.bias, b.bias, "{name} layer {l}");
                    assert_eq!((a.inputs, a.outputs), (b.inputs, b.outputs));
                    assert_eq!(a.weight.len(), a.inputs * a.outputs);
                }
                assert_eq!(reused.norm2.weight, fresh.norm2.weight);
                if name == "gpt2" {
                    continue;
                }
                let t = |n: &str| w.tensor(&format!("model.layers.{l}.{n}")).unwrap();
                let stacked = |names: &[&str]| names.iter().flat_map(|n| t(n)).collect::<Vec<_>>();
                assert_eq!(
                    reused.qkv.weight,
                    stacked(&[
                        "self_attn.q_proj.weight",
                        "self_attn.k_proj.weight",
                        "self_attn.v_proj.weight"
                    ])
                );
                assert_eq!(
                    reused.qkv.bias.as_deref(),
                    Some(
                        &stacked(&[
                            "self_attn.q_proj.bias",
                            "self_attn.k_proj.bias",
                            "self_attn.v_proj.bias"
                        ])[..]
                    )
                );
                assert_eq!(
                    reused.up.weight,
                    stacked(&["mlp.gate_proj.weight", "mlp.up_proj.weight"])
                );
            }
        }
    }
}

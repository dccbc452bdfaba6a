//! A decoder's shape: the built-in models with Hugging Face's sizes, a model folder's
//! `config.json`, and what a token costs under them.

use serde_json::Value;

use crate::model::Precision;

/// Which block a decoder is built of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Llama, Qwen2 and Mistral: RMSNorm, rotary positions, grouped-query attention, SwiGLU.
    Llama,
    /// GPT-2: LayerNorm, learned positions, multi-head attention, a GELU (tanh) MLP, Conv1D
    /// weights stored (in, out).
    Gpt2,
}

/// Llama 3's rope scaling (`rope_type: "llama3"`): long wavelengths slowed by `factor`, short
/// ones kept, the band between blended.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Everything the forward pass and the cost model need; the names follow `config.json`'s.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecoderConfig {
    /// `qwen2.5-0.5b`, or the folder's name for a model read from disk.
    pub name: String,
    /// `model_type` as Hugging Face writes it: llama, qwen2, mistral, gpt2.
    pub model_type: String,
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    /// RMSNorm's (or GPT-2's LayerNorm's) epsilon.
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// The LM head is the token embedding's transpose.
    pub tie_word_embeddings: bool,
    /// q, k and v projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Each query sees at most this many keys, itself included (Mistral v0.1; Qwen2 with
    /// `use_sliding_window`), in every layer but those of `full_attention_layers`.
    pub sliding_window: Option<usize>,
    /// Layers that see every key although `sliding_window` is set: Qwen2's first
    /// `max_window_layers`, or its `layer_types`' `full_attention` entries. Empty for Mistral,
    /// whose every layer slides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub full_attention_layers: Vec<usize>,
    /// Tokens that end a generation (`eos_token_id`); none for seeded weights.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eos_token_ids: Vec<u32>,
}

/// A built-in decoder: its name, the Hugging Face repository whose `config.json` gave the
/// sizes, and the config.
pub(super) type BuiltIn = (&'static str, &'static str, fn() -> DecoderConfig);

pub(super) const BUILT_IN: [BuiltIn; 8] = [
    ("gpt2", "openai-community/gpt2", gpt2),
    ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", || {
        qwen("qwen2.5-0.5b", 896, 4864, 24, 14, 2, true)
    }),
    ("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", || {
        qwen("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, true)
    }),
    ("qwen2.5-7b", "Qwen/Qwen2.5-7B", || DecoderConfig {
        vocab_size: 152_064,
        max_position_embeddings: 131_072,
        ..qwen("qwen2.5-7b", 3584, 18944, 28, 28, 4, false)
    }),
    ("llama-3.2-1b", "meta-llama/Llama-3.2-1B", || {
        llama3("llama-3.2-1b", (2048, 8192, 16, 32), 32.0, true)
    }),
    ("llama-3.2-3b", "meta-llama/Llama-3.2-3B", || {
        llama3("llama-3.2-3b", (3072, 8192, 28, 24), 32.0, true)
    }),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B", || {
        llama3("llama-3.1-8b", (4096, 14336, 32, 32), 8.0, false)
    }),
    ("mistral-7b", "mistralai/Mistral-7B-v0.1", || {
        DecoderConfig {
            model_type: "mistral".into(),
            vocab_size: 32_000,
            max_position_embeddings: 32_768,
            rope_theta: 10_000.0,
            rope_scaling: None,
            sliding_window: Some(4096),
            tie_word_embeddings: false,
            ..llama3("mistral-7b", (4096, 14336, 32, 32), 1.0, false)
        }
    }),
];

fn gpt2() -> DecoderConfig {
    DecoderConfig {
        name: "gpt2".into(),
        model_type: "gpt2".into(),
        family: Family::Gpt2,
        vocab_size: 50_257,
        hidden_size: 768,
        intermediate_size: 3072,
        num_hidden_layers: 12,
        num_attention_heads: 12,
        num_key_value_heads: 12,
        head_dim: 64,
        max_position_embeddings: 1024,
        norm_eps: 1e-5,
        rope_theta: 0.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        qkv_bias: true,
        sliding_window: None,
        full_attention_layers: Vec::new(),
        eos_token_ids: Vec::new(),
    }
}

fn qwen(
    name: &str,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    tied: bool,
) -> DecoderConfig {
    DecoderConfig {
        name: name.into(),
        model_type: "qwen2".into(),
        family: Family::Llama,
        vocab_size: 151_936,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim: hidden / heads,
        max_position_embeddings: 32_768,
        norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        tie_word_embeddings: tied,
        qkv_bias: true,
        sliding_window: None,
        full_attention_layers: Vec::new(),
        eos_token_ids: Vec::new(),
    }
}

/// Llama 3.x: 8 KV heads, θ = 500 000, the llama3 rope scaling with `factor`.
fn llama3(
    name: &str,
    (hidden, intermediate, layers, heads): (usize, usize, usize, usize),
    factor: f64,
    tied: bool,
) -> DecoderConfig {
    DecoderConfig {
        name: name.into(),
        model_type: "llama".into(),
        family: Family::Llama,
        vocab_size: 128_256,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: 8,
        head_dim: hidden / heads,
        max_position_embeddings: 131_072,
        norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        tie_word_embeddings: tied,
        qkv_bias: false,
        sliding_window: None,
        full_attention_layers: Vec::new(),
        eos_token_ids: Vec::new(),
    }
}

/// Why a `config.json` cannot be run: the field and the reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{field}`: {reason}")]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

fn bad(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The largest size any field may take: far above every real model, far below overflow.
const MAX_SIZE: u64 = 1 << 24;

impl DecoderConfig {
    /// Read a Hugging Face `config.json` (its text); `name` labels the model.
    pub fn from_hf_json(name: &str, text: &str) -> Result<DecoderConfig, ConfigError> {
        let v: Value = serde_json::from_str(text).map_err(|e| bad("(file)", e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad("(file)", "not a JSON object"))?;
        let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
        let size = |k: &str| -> Result<Option<usize>, ConfigError> {
            match get(k) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if (1..=MAX_SIZE).contains(&n) => Ok(Some(n as usize)),
                    _ => Err(bad(k, format!("{v} is not a size from 1 to {MAX_SIZE}"))),
                },
            }
        };
        let need = |k: &str| size(k)?.ok_or_else(|| bad(k, "missing"));
        let float = |k: &str, default: f64| -> Result<f64, ConfigError> {
            match get(k) {
                None => Ok(default),
                Some(v) => v
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| bad(k, format!("{v} is not a positive number"))),
            }
        };
        let flag = |k: &str, default: bool| -> Result<bool, ConfigError> {
            match get(k) {
                None => Ok(default),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| bad(k, format!("{v} is not true or false"))),
            }
        };
        let model_type = get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("model_type", "missing"))?
            .to_string();
        let cfg = match model_type.as_str() {
            "gpt2" => {
                if let Some(act) = get("activation_function").and_then(Value::as_str)
                    && act != "gelu_new"
                {
                    return Err(bad(
                        "activation_function",
                        format!("`{act}` is not supported (GPT-2 uses gelu_new)"),
                    ));
                }
                let hidden = need("n_embd")?;
                let heads = need("n_head")?;
                DecoderConfig {
                    name: name.into(),
                    model_type,
                    vocab_size: need("vocab_size")?,
                    hidden_size: hidden,
                    intermediate_size: size("n_inner")?.unwrap_or(4 * hidden),
                    num_hidden_layers: need("n_layer")?,
                    num_attention_heads: heads,
                    num_key_value_heads: heads,
                    head_dim: hidden / heads,
                    max_position_embeddings: need("n_positions")?,
                    norm_eps: float("layer_norm_epsilon", 1e-5)?,
                    tie_word_embeddings: flag("tie_word_embeddings", true)?,
                    ..gpt2()
                }
            }
            "llama" | "qwen2" | "mistral" => {
                if let Some(act) = get("hidden_act").and_then(Value::as_str)
                    && act != "silu"
                {
                    return Err(bad(
                        "hidden_act",
                        format!("`{act}` is not supported (silu is)"),
                    ));
                }
                for k in ["attention_bias", "mlp_bias"] {
                    if flag(k, false)? {
                        return Err(bad(k, "biases on these layers are not supported yet"));
                    }
                }
                let hidden = need("hidden_size")?;
                let heads = need("num_attention_heads")?;
                // transformers 5 writes `rope_parameters` (θ inside); older configs, the
                // published checkpoints' among them, `rope_theta` and `rope_scaling`.
                let params = get("rope_parameters");
                let rope_scaling = match params.or(get("rope_scaling")) {
                    None => None,
                    Some(s) => {
                        let field = if params.is_some() {
                            "rope_parameters"
                        } else {
                            "rope_scaling"
                        };
                        rope_scaling(field, s)?
                    }
                };
                let rope_theta = match params.and_then(|p| p.get("rope_theta")) {
                    Some(v) => v
                        .as_f64()
                        .filter(|f| f.is_finite() && *f > 0.0)
                        .ok_or_else(|| {
                            bad("rope_parameters.rope_theta", "not a positive number")
                        })?,
                    None => float("rope_theta", 10_000.0)?,
                };
                DecoderConfig {
                    name: name.into(),
                    family: Family::Llama,
                    vocab_size: need("vocab_size")?,
                    hidden_size: hidden,
                    intermediate_size: need("intermediate_size")?,
                    num_hidden_layers: need("num_hidden_layers")?,
                    num_attention_heads: heads,
                    num_key_value_heads: size("num_key_value_heads")?.unwrap_or(heads),
                    head_dim: size("head_dim")?.unwrap_or(hidden / heads),
                    max_position_embeddings: need("max_position_embeddings")?,
                    norm_eps: float("rms_norm_eps", 1e-6)?,
                    rope_theta,
                    rope_scaling,
                    tie_word_embeddings: flag("tie_word_embeddings", false)?,
                    qkv_bias: model_type == "qwen2",
                    sliding_window: match model_type.as_str() {
                        "mistral" => size("sliding_window")?,
                        // Qwen2's window exists only with `use_sliding_window` (4096 keys
                        // when the size is left out, as transformers defaults it).
                        "qwen2" if flag("use_sliding_window", false)? => {
                            Some(size("sliding_window")?.unwrap_or(4096))
                        }
                        _ => None,
                    },
                    full_attention_layers: Vec::new(),
                    model_type,
                    eos_token_ids: Vec::new(),
                }
            }
            other => {
                return Err(bad(
                    "model_type",
                    format!("`{other}` is not supported (llama, qwen2, mistral and gpt2 are)"),
                ));
            }
        };
        let cfg = if cfg.model_type == "qwen2" && cfg.sliding_window.is_some() {
            DecoderConfig {
                full_attention_layers: qwen2_full_layers(obj, cfg.num_hidden_layers)?,
                ..cfg
            }
        } else {
            cfg
        };
        cfg.check()?;
        let eos = match get("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(ids)) => ids.iter().filter_map(token_id).collect(),
            Some(v) => token_id(v).into_iter().collect(),
        };
        Ok(DecoderConfig {
            eos_token_ids: eos,
            ..cfg
        })
    }

    /// The `config.json` Hugging Face's transformers reads this model from (the published
    /// checkpoints' format: `rope_theta` and `rope_scaling` apart).
    pub fn to_hf_json(&self) -> Value {
        let mut v = match self.family {
            Family::Gpt2 => serde_json::json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": self.vocab_size,
                "n_embd": self.hidden_size,
                "n_inner": self.intermediate_size,
                "n_layer": self.num_hidden_layers,
                "n_head": self.num_attention_heads,
                "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.norm_eps,
                "activation_function": "gelu_new",
            }),
            Family::Llama => {
                let architecture = match self.model_type.as_str() {
                    "qwen2" => "Qwen2ForCausalLM",
                    "mistral" => "MistralForCausalLM",
                    _ => "LlamaForCausalLM",
                };
                serde_json::json!({
                    "architectures": [architecture],
                    "model_type": self.model_type,
                    "vocab_size": self.vocab_size,
                    "hidden_size": self.hidden_size,
                    "intermediate_size": self.intermediate_size,
                    "num_hidden_layers": self.num_hidden_layers,
                    "num_attention_heads": self.num_attention_heads,
                    "num_key_value_heads": self.num_key_value_heads,
                    "head_dim": self.head_dim,
                    "max_position_embeddings": self.max_position_embeddings,
                    "rms_norm_eps": self.norm_eps,
                    "rope_theta": self.rope_theta,
                    "rope_scaling": self.rope_scaling.map(|s| serde_json::json!({
                        "rope_type": "llama3",
                        "factor": s.factor,
                        "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings,
                    })),
                    "hidden_act": "silu",
                    "sliding_window": self.sliding_window,
                    "use_sliding_window": self.sliding_window.is_some(),
                })
            }
        };
        if self.model_type == "qwen2" && self.sliding_window.is_some() {
            // transformers 5 reads `layer_types`; older releases, the leading full layers.
            let types: Vec<&str> = (0..self.num_hidden_layers)
                .map(|l| match self.window(l) {
                    Some(_) => "sliding_attention",
                    None => "full_attention",
                })
                .collect();
            let leading = types.iter().take_while(|t| **t == "full_attention").count();
            v["layer_types"] = types.into();
            v["max_window_layers"] = leading.into();
        }
        v["tie_word_embeddings"] = self.tie_word_embeddings.into();
        if !self.eos_token_ids.is_empty() {
            v["eos_token_id"] = self.eos_token_ids.clone().into();
        }
        v["torch_dtype"] = "float32".into();
        v
    }

    /// The sizes fit together: heads divide evenly, rotary halves are whole, and the largest
    /// weight's element count fits in memory arithmetic.
    pub fn check(&self) -> Result<(), ConfigError> {
        let (h, kv) = (self.num_attention_heads, self.num_key_value_heads);
        // The field as the family's config.json names it.
        let gpt2 = self.family == Family::Gpt2;
        let named = |field: &'static str, gpt2_field: &'static str| {
            if gpt2 { gpt2_field } else { field }
        };
        if h == 0 || kv == 0 || !h.is_multiple_of(kv) {
            return Err(bad(
                "num_key_value_heads",
                format!("{h} attention heads cannot share {kv} key/value heads evenly"),
            ));
        }
        if self.head_dim == 0 || (self.family == Family::Llama && self.head_dim % 2 == 1) {
            let reason = format!("a head of {} values has no rotary halves", self.head_dim);
            return Err(bad(named("head_dim", "n_head"), reason));
        }
        if gpt2 && h * self.head_dim != self.hidden_size {
            return Err(bad(
                "n_head",
                format!(
                    "{h} heads of {} values do not make the hidden size {}",
                    self.head_dim, self.hidden_size
                ),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(bad("sliding_window", "a sliding window of 0 keys"));
        }
        if let Some(&l) = self
            .full_attention_layers
            .iter()
            .find(|&&l| l >= self.num_hidden_layers)
        {
            return Err(bad(
                "layer_types",
                format!(
                    "full-attention layer {l} of {} layers",
                    self.num_hidden_layers
                ),
            ));
        }
        let largest = [
            ("vocab_size", self.vocab_size * self.hidden_size),
            (
                named("intermediate_size", "n_inner"),
                self.hidden_size * self.intermediate_size,
            ),
            (
                named("num_attention_heads", "n_head"),
                h * self.head_dim * self.hidden_size,
            ),
        ];
        if let Some((field, _)) = largest.iter().find(|&&(_, n)| n > 1 << 34) {
            return Err(bad(field, "makes a weight matrix of more than 2^34 values"));
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Widths of the fused q/k/v projection's three parts.
    pub fn qkv_widths(&self) -> (usize, usize) {
        (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        )
    }

    /// Values in the GEMMs a token goes through, the LM head included (tied or not).
    pub fn matmul_params(&self) -> u64 {
        let (q, kv) = self.qkv_widths();
        let (d, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let mlp = match self.family {
            Family::Llama => 3 * d * i,
            Family::Gpt2 => 2 * d * i,
        };
        let layer = d * (q as u64 + 2 * kv as u64) + q as u64 * d + mlp;
        self.num_hidden_layers as u64 * layer + self.lm_head_params()
    }

    fn lm_head_params(&self) -> u64 {
        self.vocab_size as u64 * self.hidden_size as u64
    }

    /// Every parameter, as the checkpoint holds them (a tied head counted once).
    pub fn params(&self) -> u64 {
        let (q, kv) = self.qkv_widths();
        let (d, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let layers = self.num_hidden_layers as u64;
        let mut n = self.matmul_params() + self.lm_head_params(); // + the embedding
        if self.tie_word_embeddings {
            n -= self.lm_head_params();
        }
        n += match self.family {
            // Two RMSNorms a layer and the final one; Qwen2's q/k/v biases.
            Family::Llama => {
                layers * 2 * d + d + layers * self.qkv_bias as u64 * (q + 2 * kv) as u64
            }
            // Two LayerNorms (weight, bias) a layer and the final one, every layer's biases,
            // the learned positions.
            Family::Gpt2 => {
                layers * (4 * d + (q + 2 * kv) as u64 + d + i + d)
                    + 2 * d
                    + self.max_position_embeddings as u64 * d
            }
        };
        n
    }

    /// The most keys a query of `layer` sees (itself included), or `None` for every key.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| !self.full_attention_layers.contains(&layer))
    }

    /// Keys a query at position `pos` (from 0) attends to, summed over the layers.
    pub fn layer_keys(&self, pos: usize) -> u64 {
        (0..self.num_hidden_layers)
            .map(|l| self.window(l).map_or(pos + 1, |w| w.min(pos + 1)) as u64)
            .sum()
    }

    /// FLOPs of one sequence's prefill of `prompt` tokens: every GEMM on every token but the
    /// LM head on the last only, and causal attention (q·k and p·v, 2 FLOPs a multiply-add).
    pub fn prefill_flops(&self, prompt: usize) -> u64 {
        let per_token = self.matmul_params() - self.lm_head_params();
        let keys: u64 = (0..prompt).map(|p| self.layer_keys(p)).sum();
        2 * per_token * prompt as u64 + 2 * self.lm_head_params() + self.attention_flops(keys)
    }

    /// FLOPs of one sequence's decode step at position `pos` (the new token's).
    pub fn decode_flops(&self, pos: usize) -> u64 {
        2 * self.matmul_params() + self.attention_flops(self.layer_keys(pos))
    }

    /// FLOPs of attention over `keys` keys, summed over the layers.
    fn attention_flops(&self, keys: u64) -> u64 {
        4 * (self.num_attention_heads * self.head_dim) as u64 * keys
    }

    /// Cached key and value bytes one sequence's decode step at position `pos` reads.
    pub fn kv_bytes_read(&self, pos: usize, precision: Precision) -> u64 {
        self.layer_keys(pos) * self.kv_bytes_per_token(precision) / self.num_hidden_layers as u64
    }

    /// Bytes of weights one decode step reads: every GEMM's weights once, whatever the batch.
    pub fn weight_bytes_per_step(&self, precision: Precision) -> u64 {
        self.matmul_params() * precision.bytes() as u64
    }

    /// KV cache bytes one token of one sequence holds: a key and a value per KV head per layer.
    pub fn kv_bytes_per_token(&self, precision: Precision) -> u64 {
        2 * (self.num_hidden_layers * self.num_key_value_heads * self.head_dim) as u64
            * precision.bytes() as u64
    }
}

/// Qwen2's layers that see every key when its window is on: `layer_types`' `full_attention`
/// entries where the file lists them (transformers 5), else the first `max_window_layers` (28
/// when left out, as transformers defaults it).
fn qwen2_full_layers(
    obj: &serde_json::Map<String, Value>,
    layers: usize,
) -> Result<Vec<usize>, ConfigError> {
    let Some(types) = obj.get("layer_types").filter(|v| !v.is_null()) else {
        let leading = match obj.get("max_window_layers").filter(|v| !v.is_null()) {
            None => 28,
            Some(v) => v
                .as_u64()
                .filter(|&n| n <= MAX_SIZE)
                .ok_or_else(|| bad("max_window_layers", format!("{v} is not a layer count")))?
                as usize,
        };
        return Ok((0..leading.min(layers)).collect());
    };
    let list = types
        .as_array()
        .filter(|a| a.len() == layers)
        .ok_or_else(|| bad("layer_types", format!("not a list of {layers} layer types")))?;
    let mut full = Vec::new();
    for (l, t) in list.iter().enumerate() {
        match t.as_str() {
            Some("full_attention") => full.push(l),
            Some("sliding_attention") => {}
            _ => {
                return Err(bad(
                    &format!("layer_types[{l}]"),
                    format!("{t} is not full_attention or sliding_attention"),
                ));
            }
        }
    }
    Ok(full)
}

/// A token id in JSON: a whole number that fits in u32.
fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|i| u32::try_from(i).ok())
}

/// Llama 3's rope scaling from `v`, the config's object `field` (`rope_parameters` or
/// `rope_scaling`), which the errors name.
fn rope_scaling(field: &str, v: &Value) -> Result<Option<RopeScaling>, ConfigError> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    if kind == "default" {
        return Ok(None);
    }
    if kind != "llama3" {
        return Err(bad(
            field,
            format!("rope type `{kind}` is not supported (llama3 is)"),
        ));
    }
    let num = |k: &str| {
        v.get(k)
            .and_then(Value::as_f64)
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| bad(&format!("{field}.{k}"), "missing or not a positive number"))
    };
    let s = RopeScaling {
        factor: num("factor")?,
        low_freq_factor: num("low_freq_factor")?,
        high_freq_factor: num("high_freq_factor")?,
        original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
    };
    if s.high_freq_factor <= s.low_freq_factor {
        return Err(bad(
            &format!("{field}.high_freq_factor"),
            "must be above low_freq_factor",
        ));
    }
    Ok(Some(s))
}

/// The rotary inverse frequencies of `cfg` (one per pair of a head's values), Llama 3's
/// scaling applied as Hugging Face's `_compute_llama3_parameters` does.
pub fn inverse_frequencies(cfg: &DecoderConfig) -> Vec<f64> {
    let d = cfg.head_dim;
    let base: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64))
        .collect();
    let Some(s) = cfg.rope_scaling else {
        return base;
    };
    let old = s.original_max_position_embeddings as f64;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// Rotary cosines and sines for positions 0..context, as Hugging Face computes them: the
/// inverse frequencies (Llama 3's scaling applied) and each angle rounded to f32 first.
pub fn rotary_tables(cfg: &DecoderConfig, context: usize) -> (Vec<f32>, Vec<f32>) {
    let inv: Vec<f32> = inverse_frequencies(cfg).iter().map(|&f| f as f32).collect();
    let mut cos = Vec::with_capacity(context * inv.len());
    let mut sin = Vec::with_capacity(context * inv.len());
    for p in 0..context {
        for &f in &inv {
            let angle = (p as f32 * f) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts of the built-ins against what their model cards say.
    #[test]
    fn built_in_sizes_match_the_model_cards() {
        let count = |n: &str| crate::model::llm::built_in(n).unwrap().params();
        // gpt2: 124,439,808 in PyTorch (`sum(p.numel())`, tied head counted once).
        assert_eq!(count("gpt2"), 124_439_808);
        // Qwen2.5-0.5B: 494,032,768; Llama-3.2-1B: 1,235,814,400; Llama-3.1-8B 8,030,261,248;
        // Mistral-7B-v0.1 7,241,732,096.
        assert_eq!(count("qwen2.5-0.5b"), 494_032_768);
        assert_eq!(count("llama-3.2-1b"), 1_235_814_400);
        assert_eq!(count("llama-3.1-8b"), 8_030_261_248);
        assert_eq!(count("mistral-7b"), 7_241_732_096);
    }

    #[test]
    fn config_json_errors_name_the_field() {
        let base = r#"{"model_type":"llama","vocab_size":100,"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "max_position_embeddings":256}"#;
        let ok = DecoderConfig::from_hf_json("t", base).unwrap();
        assert_eq!((ok.head_dim, ok.group()), (16, 2));
        let cases = [
            (base.replace("\"llama\"", "\"bert\""), "model_type"),
            (base.replace("\"vocab_size\":100,", ""), "vocab_size"),
            (
                base.replace("\"hidden_size\":64", "\"hidden_size\":-3"),
                "hidden_size",
            ),
            (
                base.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3"),
                "num_key_value_heads",
            ),
            (
                base.replace('}', r#","rope_scaling":{"rope_type":"yarn","factor":4}}"#),
                "rope_scaling",
            ),
            (
                base.replace(
                    '}',
                    r#","rope_parameters":{"rope_type":"llama3","factor":0,"rope_theta":1e4}}"#,
                ),
                "rope_parameters.factor",
            ),
            (
                base.replace("\"vocab_size\":100", "\"vocab_size\":16000000")
                    .replace("\"hidden_size\":64", "\"hidden_size\":4096"),
                "vocab_size",
            ),
            (base.replace('}', r#","hidden_act":"gelu"}"#), "hidden_act"),
            (
                base.replace(
                    "\"max_position_embeddings\":256",
                    "\"max_position_embeddings\":1e30",
                ),
                "max_position_embeddings",
            ),
        ];
        for (text, field) in cases {
            let err = DecoderConfig::from_hf_json("t", &text).unwrap_err();
            assert_eq!(err.field, field, "{err}");
            // The caller names the file; the message starts at the field.
            assert!(
                err.to_string().starts_with(&format!("`{field}`: ")),
                "{err}"
            );
        }
    }

    /// Every built-in survives a round trip through the config.json it writes.
    #[test]
    fn written_config_json_reads_back() {
        for name in crate::model::llm::names() {
            let c = crate::model::llm::built_in(name).unwrap();
            let text = c.to_hf_json().to_string();
            assert_eq!(
                DecoderConfig::from_hf_json(name, &text).unwrap(),
                c,
                "{name}"
            );
        }
    }

    /// Qwen2's window: off unless `use_sliding_window`; then in the layers from
    /// `max_window_layers` on, or where `layer_types` says; a bad list names its entry.
    #[test]
    fn qwen2_windows_follow_use_sliding_window_and_the_layer_list() {
        let base = r#"{"model_type":"qwen2","vocab_size":100,"hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":4,"num_attention_heads":4,
            "num_key_value_heads":2,"max_position_embeddings":256,"sliding_window":8,
            "max_window_layers":1"#;
        let read = |tail: &str| DecoderConfig::from_hf_json("t", &format!("{base}{tail}}}"));
        let windows = |c: &DecoderConfig| (0..4).map(|l| c.window(l)).collect::<Vec<_>>();
        assert_eq!(windows(&read("").unwrap()), [None; 4]);
        let on = read(r#","use_sliding_window":true"#).unwrap();
        assert_eq!(windows(&on), [None, Some(8), Some(8), Some(8)]);
        let listed = read(
            r#","use_sliding_window":true,"layer_types":["sliding_attention",
            "full_attention","sliding_attention","full_attention"]"#,
        )
        .unwrap();
        assert_eq!(windows(&listed), [Some(8), None, Some(8), None]);
        // Keys at position 9: 10 in a full layer, 8 in a sliding one.
        assert_eq!(listed.layer_keys(9), 10 + 8 + 8 + 10);
        let text = listed.to_hf_json().to_string();
        assert_eq!(DecoderConfig::from_hf_json("t", &text).unwrap(), listed);
        for (tail, field) in [
            (
                r#","use_sliding_window":true,"layer_types":["full_attention"]"#,
                "layer_types",
            ),
            (
                r#","use_sliding_window":true,"layer_types":["full_attention",
                "chunked_attention","full_attention","full_attention"]"#,
                "layer_types[1]",
            ),
            (
                r#","use_sliding_window":true,"max_window_layers":-1"#,
                "max_window_layers",
            ),
            (r#","use_sliding_window":"yes""#, "use_sliding_window"),
        ] {
            assert_eq!(read(tail).unwrap_err().field, field, "{tail}");
        }
    }

    /// Llama 3's scaling keeps short wavelengths, divides long ones by the factor.
    #[test]
    fn llama3_scaling_keeps_high_and_slows_low_frequencies() {
        let cfg = crate::model::llm::built_in("llama-3.2-1b").unwrap();
        let plain = inverse_frequencies(&DecoderConfig {
            rope_scaling: None,
            ..cfg.clone()
        });
        let scaled = inverse_frequencies(&cfg);
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] * 32.0 - plain[last]).abs() < 1e-15);
    }
}

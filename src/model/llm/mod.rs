//! Decoder-only language models (issue 30): one family covers Llama, Qwen2 and Mistral
//! (RMSNorm, rotary positions, grouped-query attention, SwiGLU), and GPT-2 (LayerNorm, learned
//! positions, GELU) is the small classic. A model is its [`DecoderConfig`] — built in with Hugging
//! Face's sizes and names, or read from a model folder's `config.json` — and its weights under
//! Hugging Face's tensor names ([`weights`]). What a token costs (FLOPs, bytes read, KV cache) is
//! counted here, from the config alone, for the benchmark's roofline.
//!
//! Unlike the zoo's networks a decoder is not a [`crate::model::Graph`]: its work changes every
//! step (one more key to attend to) and it keeps state between steps (the KV cache), so each
//! backend runs it through [`crate::backend::Backend::prepare_decoder`].

pub mod chat;
pub mod config;
pub mod text;
pub mod weights;

pub use config::{DecoderConfig, Family, RopeScaling};
pub use weights::{DecoderWeights, TensorSource};

/// The built-in decoders, in the order `workshop models` lists them.
pub fn names() -> Vec<&'static str> {
    config::BUILT_IN.iter().map(|(n, _, _)| *n).collect()
}

/// Whether `name` is a built-in decoder (and not a zoo CNN or transformer).
pub fn is_decoder(name: &str) -> bool {
    config::BUILT_IN.iter().any(|(n, _, _)| *n == name)
}

/// The built-in decoder `name`.
pub fn built_in(name: &str) -> Option<DecoderConfig> {
    config::BUILT_IN
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, make)| make())
}

/// Where a built-in's sizes come from (the Hugging Face repository), for `workshop models`.
pub fn source(name: &str) -> Option<&'static str> {
    config::BUILT_IN
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, s, _)| *s)
}

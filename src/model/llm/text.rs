//! Text in and out of a language model: a model folder's `tokenizer.json` (Hugging Face's
//! `tokenizers`), and choosing the next token from logits — greedy, or sampled with a
//! temperature and nucleus (top-p) cut.

use std::path::Path;

use anyhow::{Result, anyhow};

use crate::model::Rng;

/// A model folder's tokenizer.
pub struct Tokenizer(tokenizers::Tokenizer);

impl Tokenizer {
    /// `dir/tokenizer.json`, or `None` when the folder has none.
    pub fn open(dir: &Path) -> Result<Option<Tokenizer>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = crate::files::read_text(&path)?;
        let t: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| anyhow!("`{}` is not a tokenizer: {e}", path.display()))?;
        Ok(Some(Tokenizer(t)))
    }

    /// Token ids of `text`, with the special tokens the tokenizer adds (Llama's BOS) where
    /// `special`; a chat template's text carries its own, so it is encoded without.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let e = self
            .0
            .encode(text, special)
            .map_err(|e| anyhow!("cannot tokenize the prompt: {e}"))?;
        Ok(e.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.0
            .decode(ids, true)
            .map_err(|e| anyhow!("cannot decode tokens: {e}"))
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 is greedy (the most probable token); above, logits are divided by it before softmax.
    pub temperature: f32,
    /// Only the most probable tokens whose probabilities add up to this are drawn from.
    pub top_p: f32,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
    };

    /// The next token of one sequence from its logits.
    pub fn pick(&self, logits: &[f32], rng: &mut Rng) -> u32 {
        if self.temperature <= 0.0 {
            return argmax(logits);
        }
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, (((v - max) / self.temperature) as f64).exp()))
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = probs.iter().map(|p| p.1).sum();
        // The nucleus: the fewest most probable tokens holding top_p of the mass.
        let mut kept = 0.0;
        let mut n = 0;
        for p in &probs {
            kept += p.1;
            n += 1;
            if kept >= self.top_p as f64 * total {
                break;
            }
        }
        let mut draw = rng.uniform() * kept;
        for p in &probs[..n] {
            draw -= p.1;
            if draw <= 0.0 {
                return p.0;
            }
        }
        probs[n - 1].0
    }
}

/// The index of the largest value (the first of equals); NaN never wins.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_keeps_to_the_nucleus() {
        let logits = [0.0, 5.0, 4.0, -3.0];
        let mut rng = Rng::new(1);
        assert_eq!(Sampling::GREEDY.pick(&logits, &mut rng), 1);
        // p(1) ≈ 0.73, p(2) ≈ 0.27: a top-p of 0.5 keeps only token 1.
        let narrow = Sampling {
            temperature: 1.0,
            top_p: 0.5,
        };
        assert!((0..100).all(|_| narrow.pick(&logits, &mut rng) == 1));
        // With every token kept, both likely ones are drawn.
        let wide = Sampling {
            temperature: 1.0,
            top_p: 1.0,
        };
        let drawn: Vec<u32> = (0..200).map(|_| wide.pick(&logits, &mut rng)).collect();
        assert!(drawn.contains(&1) && drawn.contains(&2));
    }
}

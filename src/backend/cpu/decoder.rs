//! The CPU backend's language-model session: weights packed once for the GEMM kernels (q, k
//! and v fused into one projection, gate and up into another), the KV cache preallocated for
//! the whole context in the storage precision, and one forward pass per prefill or decode step
//! over rows of tokens.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::elem::Elem;
use super::kernels::{self, CacheView, PackedLinear};
use crate::backend::decoding::Chunk;
use crate::backend::{BackendError, DecoderMemory, DecoderOptions, DecoderSession};
use crate::model::llm::weights::{LayerTensors, Linear, Norm};
use crate::model::llm::{DecoderConfig, DecoderWeights, Family, config::rotary_tables};

/// The lengths of [`Scratch`]'s activation buffers (x, x2, xn, qkv, attn, up, act) for a pass
/// of `rows` rows.
fn scratch_lens(cfg: &DecoderConfig, rows: usize) -> [usize; 7] {
    let (d, inner) = (cfg.hidden_size, cfg.intermediate_size);
    let (qw, kvw) = cfg.qkv_widths();
    [d, d, d, qw + 2 * kvw, qw, 2 * inner, inner].map(|n| n.saturating_mul(rows))
}

/// [`CpuDecoder::check_pass`] for a `batch` of sequences with `per_sequence` rows each in a
/// pass: the pass's activations (as [`scratch_lens`] sizes them) and its logits (each
/// sequence's last row's, or every row's with `all`, in `T` and again in f32) against the
/// `held` bytes of scratch the pass reuses and, only where they are more, the bytes `free`
/// says the machine has besides (the weights and the KV cache already allocated): the OS is
/// not asked on every decode step. Refused with the batch whose pass would fit.
fn check_pass<T: Elem>(
    cfg: &DecoderConfig,
    (batch, per_sequence, all): (usize, usize, Option<usize>),
    (held, free): (u64, impl FnOnce() -> u64),
) -> Result<(), BackendError> {
    let elem = size_of::<T>() as u64;
    let vocab = cfg.vocab_size as u64;
    // Counted for any number of sequences: the whole batch's, and one's for the suggestion.
    let rows = |sequences: usize| sequences.saturating_mul(per_sequence);
    let activations = |sequences: usize| {
        let lens = scratch_lens(cfg, rows(sequences));
        (lens.iter()).fold(0u64, |sum, &n| {
            sum.saturating_add((n as u64).saturating_mul(elem))
        })
    };
    let logits = |picked: usize| (picked as u64).saturating_mul(vocab * (elem + 4));
    let (picked, every) = match all {
        Some(all) => (rows(batch), (all as u64).saturating_mul(vocab * 4)),
        None => (batch, 0),
    };
    let needed = (activations(batch))
        .saturating_add(logits(picked))
        .saturating_add(every);
    if needed <= held {
        return Ok(());
    }
    let available = held.saturating_add(free());
    if needed <= available {
        return Ok(());
    }
    // A smaller batch frees some of the KV cache too: the suggestion errs on the safe side.
    let per_sequence_bytes = activations(1).saturating_add(logits(1)).max(1);
    let fits = (available / per_sequence_bytes) as usize;
    Err(BackendError::OutOfMemory {
        needed,
        available,
        suggestion: (fits >= 1 && fits < batch).then_some(fits),
    })
}

struct Layer<T> {
    norm1: Norm,
    /// q, k and v in one GEMM: rows of q (heads·head), then k and v (KV heads·head each).
    qkv: PackedLinear<T>,
    o: PackedLinear<T>,
    norm2: Norm,
    /// Llama: gate and up in one GEMM (2·inner); GPT-2: c_fc (inner).
    up: PackedLinear<T>,
    down: PackedLinear<T>,
    /// Keys (batch, KV heads, head, context): stored transposed, as the attention reads them
    /// (see [`kernels::cached_attention`]).
    k: Vec<T>,
    /// Values (batch, KV heads, context, head).
    v: Vec<T>,
}

/// Activation rows, reused between steps (grown to the largest step).
#[derive(Default)]
struct Scratch<T> {
    x: Vec<T>,
    x2: Vec<T>,
    xn: Vec<T>,
    qkv: Vec<T>,
    attn: Vec<T>,
    up: Vec<T>,
    /// SwiGLU's output: the down projection's input (Llama; GPT-2's GELU works in `up`).
    act: Vec<T>,
    head: Vec<T>,
    /// The attention's packed key and value tiles (one layer's, of the longest context seen).
    tiles: kernels::AttentionTiles,
}

pub struct CpuDecoder<T> {
    cfg: DecoderConfig,
    layers: Vec<Layer<T>>,
    /// The token table (vocabulary × hidden), looked up by id; `None` where the LM head's
    /// weight is the table (tied: Qwen2.5's smaller models, Llama 3.2, GPT-2), whose rows are
    /// then read from the head's packing ([`PackedLinear::weights_of`]) rather than kept twice
    /// (Qwen2.5-0.5B: 272 MB in BF16).
    embed: Option<Vec<T>>,
    /// GPT-2's learned positions (positions × hidden); empty for rotary models.
    positions: Vec<f32>,
    final_norm: Norm,
    lm_head: PackedLinear<T>,
    /// Rotary cosines and sines, (context × head/2) each.
    cos: Vec<f32>,
    sin: Vec<f32>,
    batch: usize,
    /// Rows a forward pass takes at most (`DecoderOptions::max_rows`); `None`: every row.
    max_rows: Option<usize>,
    context: usize,
    pos: usize,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    s: Scratch<T>,
    /// The last step's logits (rows × vocabulary).
    logits: Vec<f32>,
    weight_bytes: u64,
    profile: bool,
    times: BTreeMap<&'static str, f64>,
}

fn load_err(e: anyhow::Error) -> BackendError {
    BackendError::Invalid(format!("{e:#}"))
}

impl<T: Elem> CpuDecoder<T> {
    pub(super) fn new(
        w: &DecoderWeights,
        opt: &DecoderOptions,
        pool: Arc<rayon::ThreadPool>,
        threads: usize,
    ) -> Result<Self, BackendError> {
        let cfg = w.config.clone();
        let d = cfg.hidden_size;
        let pack =
            |l: &Linear| PackedLinear::new(&l.weight, l.bias.as_deref(), l.inputs, l.outputs);
        let cache = opt.batch * cfg.num_key_value_heads * opt.context * cfg.head_dim;
        // The vocabulary's matrices first: their f32 copies (545 MB for Qwen2.5-0.5B's table,
        // 2.1 GB for each of Llama 3.1 8B's) are then the largest thing in memory for a moment,
        // one at a time, rather than on top of every packed block.
        let (lm_head, embed) = pool.install(|| -> Result<_, BackendError> {
            let vocab = cfg.vocab_size;
            let table = w.token_table().map_err(load_err)?;
            if cfg.tie_word_embeddings {
                return Ok((PackedLinear::new(&table, None, d, vocab), None));
            }
            let mut embed = vec![T::from_f32(0.0); table.len()];
            T::narrow(&table, &mut embed);
            drop(table);
            let head = w.lm_head().map_err(load_err)?.ok_or_else(|| {
                BackendError::Invalid("the model has neither a tied nor an own LM head".into())
            })?;
            Ok((PackedLinear::new(&head, None, d, vocab), Some(embed)))
        })?;
        // One layer's f32 tensors at a time, in the same buffers (`layer_into`).
        let mut t = LayerTensors::default();
        let layers = pool.install(|| {
            (0..cfg.num_hidden_layers)
                .map(|l| -> Result<Layer<T>, BackendError> {
                    w.layer_into(l, &mut t).map_err(load_err)?;
                    Ok(Layer {
                        qkv: pack(&t.qkv),
                        o: pack(&t.o),
                        up: pack(&t.up),
                        down: pack(&t.down),
                        norm1: std::mem::take(&mut t.norm1),
                        norm2: std::mem::take(&mut t.norm2),
                        k: vec![T::from_f32(0.0); cache],
                        v: vec![T::from_f32(0.0); cache],
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })?;
        let positions = w.position_table().map_err(load_err)?.unwrap_or_default();
        let (cos, sin) = if positions.is_empty() {
            rotary_tables(&cfg, opt.context)
        } else {
            (Vec::new(), Vec::new())
        };
        let weight_bytes = layers
            .iter()
            .map(|l| l.qkv.bytes() + l.o.bytes() + l.up.bytes() + l.down.bytes())
            .sum::<u64>()
            + lm_head.bytes()
            + (embed.as_ref().map_or(0, Vec::len) * size_of::<T>() + positions.len() * 4) as u64;
        Ok(CpuDecoder {
            final_norm: w.final_norm().map_err(load_err)?,
            cfg,
            layers,
            embed,
            positions,
            lm_head,
            cos,
            sin,
            batch: opt.batch,
            max_rows: opt.max_rows,
            context: opt.context,
            pos: 0,
            pool,
            threads,
            s: Scratch::default(),
            logits: Vec::new(),
            weight_bytes,
            profile: opt.profile,
            times: BTreeMap::new(),
        })
    }

    /// Adds the time since `*t` to `what` (profiling only) and restarts the clock.
    fn lap(&mut self, what: &'static str, t: &mut Instant) {
        if self.profile {
            let now = Instant::now();
            *self.times.entry(what).or_default() += (now - *t).as_secs_f64();
            *t = now;
        }
    }

    fn norm(&self, n: &Norm, x: &[T], y: &mut [T]) {
        let eps = self.cfg.norm_eps as f32;
        match &n.bias {
            Some(b) => kernels::layer_norm(x, &n.weight, b, eps, y),
            None => kernels::rms_norm(x, &n.weight, eps, y),
        }
    }

    /// One forward pass over `tokens` (batch × new tokens each) from position `self.pos`.
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<(), BackendError> {
        let new =
            crate::backend::step_tokens(&self.cfg, self.batch, self.context, self.pos, tokens)?;
        let pool = self.pool.clone();
        // In chunks only when asked (`DecoderOptions::max_rows`): on the host one pass costs
        // no more scratch than the chunks would.
        let chunk = self.max_rows.map_or(new, |rows| (rows / self.batch).max(1));
        let vocab = self.cfg.vocab_size;
        self.check_pass(chunk.min(new), all_logits.then_some(tokens.len()))?;
        let mut all = vec![0f32; if all_logits { tokens.len() * vocab } else { 0 }];
        for c in Chunk::all(new, chunk) {
            let ids = c.ids(tokens, self.batch);
            let head = all_logits || c.is_last();
            super::install_awake(&pool, || self.layers_pass(&ids, c.len, all_logits, head));
            self.pos += c.len;
            if all_logits {
                for (r, row) in self.logits.chunks(vocab).enumerate() {
                    let at = c.step_row(r) * vocab;
                    all[at..at + vocab].copy_from_slice(row);
                }
            }
        }
        if all_logits {
            self.logits = all;
        }
        Ok(())
    }

    /// Refuses a forward pass of `per_sequence` new rows for each sequence (and with `all`,
    /// logits for all of that many rows) whose activations and logits would not fit in the
    /// memory there is, before anything is allocated: a batch whose KV cache fits can still ask
    /// more of one prefill pass than the machine has (Qwen2.5-0.5B at batch 100,000 with a
    /// 4-token prompt: 31 GB of activations and 122 GB of logits on top of 15 GB of cache;
    /// on a 24 GB machine it went on allocating for over a minute rather than stopping).
    fn check_pass(&self, per_sequence: usize, all: Option<usize>) -> Result<(), BackendError> {
        // The scratch held is resized in place, so it counts as available to the pass.
        let held = (self.memory().scratch, super::available_memory);
        check_pass::<T>(&self.cfg, (self.batch, per_sequence, all), held)
    }

    /// The blocks over `tokens` (batch × `new`) from `self.pos`; with `head`, then the final
    /// norm and the LM head (every row's with `all_logits`, else each sequence's last).
    fn layers_pass(&mut self, tokens: &[u32], new: usize, all_logits: bool, head: bool) {
        let cfg = self.cfg.clone();
        let (d, inner) = (cfg.hidden_size, cfg.intermediate_size);
        let (qw, kvw) = cfg.qkv_widths();
        let width = qw + 2 * kvw;
        let rows = tokens.len();
        let start = self.pos;
        let mut s = std::mem::take(&mut self.s);
        let zero = T::from_f32(0.0);
        let lens = scratch_lens(&cfg, rows);
        let bufs = [
            &mut s.x,
            &mut s.x2,
            &mut s.xn,
            &mut s.qkv,
            &mut s.attn,
            &mut s.up,
            &mut s.act,
        ];
        for (buf, n) in bufs.into_iter().zip(lens) {
            buf.resize(n, zero);
        }
        let mut t = Instant::now();
        // Token (and, for GPT-2, position) embeddings.
        let mut row = vec![0f32; d];
        for (r, &tok) in tokens.iter().enumerate() {
            let out = &mut s.x[r * d..(r + 1) * d];
            let tok = tok as usize;
            match &self.embed {
                Some(table) => out.copy_from_slice(&table[tok * d..(tok + 1) * d]),
                None => self.lm_head.weights_of(tok, out),
            }
            if !self.positions.is_empty() {
                let p = start + r % new;
                T::widen(out, &mut row);
                for (a, b) in row.iter_mut().zip(&self.positions[p * d..(p + 1) * d]) {
                    *a += b;
                }
                T::narrow(&row, out);
            }
        }
        self.lap("embedding", &mut t);
        let view = CacheView {
            batch: self.batch,
            tokens: new,
            start,
            context: self.context,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head: cfg.head_dim,
            window: None,
        };
        let threads = self.threads;
        let up_width = if cfg.family == Family::Gpt2 {
            inner
        } else {
            2 * inner
        };
        for l in 0..self.layers.len() {
            let layer = &self.layers[l];
            self.norm(&layer.norm1, &s.x, &mut s.xn);
            self.lap("norm", &mut t);
            let layer = &self.layers[l];
            kernels::linear(&s.xn, &layer.qkv, (rows, d, width), &mut s.qkv, threads);
            self.lap("linear", &mut t);
            if cfg.family == Family::Llama {
                let position = |r: usize| start + r % new;
                let tables = (self.cos.as_slice(), self.sin.as_slice());
                // q and k are the first heads + KV heads runs of each row.
                let heads = cfg.num_attention_heads + cfg.num_key_value_heads;
                kernels::rope(&mut s.qkv, (width, heads, cfg.head_dim), position, tables);
                self.lap("rope", &mut t);
            }
            let layer = &mut self.layers[l];
            // The new keys and values into the cache.
            let hd = cfg.head_dim;
            for (r, row) in s.qkv.chunks(width).enumerate() {
                let (b, p) = (r / new, start + r % new);
                for g in 0..cfg.num_key_value_heads {
                    let cache = (b * cfg.num_key_value_heads + g) * self.context * hd;
                    let at = cache + p * hd;
                    let k = &row[qw + g * hd..qw + (g + 1) * hd];
                    let v = &row[qw + kvw + g * hd..qw + kvw + (g + 1) * hd];
                    for (t, &x) in k.iter().enumerate() {
                        layer.k[cache + t * self.context + p] = x;
                    }
                    layer.v[at..at + hd].copy_from_slice(v);
                }
            }
            let view = CacheView {
                window: cfg.window(l),
                ..view
            };
            let kv = (&layer.k[..], &layer.v[..]);
            kernels::cached_attention(&s.qkv, width, kv, view, &mut s.attn, &mut s.tiles);
            self.lap("attention", &mut t);
            let layer = &self.layers[l];
            kernels::linear_add(&s.attn, &layer.o, (rows, qw, d), &mut s.x2, threads, &s.x);
            std::mem::swap(&mut s.x, &mut s.x2);
            self.lap("linear", &mut t);
            let layer = &self.layers[l];
            self.norm(&layer.norm2, &s.x, &mut s.xn);
            self.lap("norm", &mut t);
            let layer = &self.layers[l];
            let up = &mut s.up[..rows * up_width];
            kernels::linear(&s.xn, &layer.up, (rows, d, up_width), up, threads);
            self.lap("linear", &mut t);
            let input: &[T] = match cfg.family {
                Family::Llama => {
                    let act = &mut s.act[..rows * inner];
                    kernels::swiglu(up, inner, act);
                    act
                }
                Family::Gpt2 => {
                    kernels::gelu_tanh(up, inner);
                    up
                }
            };
            self.lap("activation", &mut t);
            let layer = &self.layers[l];
            kernels::linear_add(
                input,
                &layer.down,
                (rows, inner, d),
                &mut s.x2,
                threads,
                &s.x,
            );
            std::mem::swap(&mut s.x, &mut s.x2);
            self.lap("linear", &mut t);
        }
        if !head {
            self.s = s;
            return;
        }
        // The final norm and the LM head, on every row or each sequence's last.
        let picked: Vec<usize> = if all_logits {
            (0..rows).collect()
        } else {
            (0..self.batch).map(|b| b * new + new - 1).collect()
        };
        let mut last = Vec::with_capacity(picked.len() * d);
        for &r in &picked {
            last.extend_from_slice(&s.x[r * d..(r + 1) * d]);
        }
        let mut normed = vec![zero; last.len()];
        self.norm(&self.final_norm, &last, &mut normed);
        let vocab = cfg.vocab_size;
        s.head.resize(picked.len() * vocab, zero);
        kernels::linear(
            &normed,
            &self.lm_head,
            (picked.len(), d, vocab),
            &mut s.head,
            threads,
        );
        self.logits.resize(s.head.len(), 0.0);
        T::widen(&s.head, &mut self.logits);
        self.lap("lm_head", &mut t);
        self.s = s;
    }
}

impl<T: Elem> DecoderSession for CpuDecoder<T> {
    fn step(&mut self, tokens: &[u32], all_logits: bool) -> Result<(), BackendError> {
        self.forward(tokens, all_logits)
    }

    fn rewind(&mut self) {
        self.pos = 0;
    }

    fn batch(&self) -> usize {
        self.batch
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn logits(&mut self) -> Result<Vec<f32>, BackendError> {
        Ok(self.logits.clone())
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn memory(&self) -> DecoderMemory {
        let kv = self
            .layers
            .iter()
            .map(|l| ((l.k.len() + l.v.len()) * size_of::<T>()) as u64)
            .sum();
        let s = &self.s;
        let scratch = [&s.x, &s.x2, &s.xn, &s.qkv, &s.attn, &s.up, &s.act, &s.head]
            .iter()
            .map(|b| (b.capacity() * size_of::<T>()) as u64)
            .sum::<u64>()
            + (self.logits.capacity() * 4) as u64
            + s.tiles.bytes();
        DecoderMemory {
            weights: self.weight_bytes,
            kv_cache: kv,
            scratch,
        }
    }

    fn read_weights(&mut self, passes: usize) -> Result<Option<(u64, Vec<f64>)>, BackendError> {
        let runs: Vec<&[u8]> = (self.layers.iter())
            .flat_map(|l| [&l.qkv, &l.o, &l.up, &l.down])
            .chain([&self.lm_head])
            .flat_map(PackedLinear::storage)
            .collect();
        let bytes = runs.iter().map(|r| r.len() as u64).sum();
        let times = self.pool.install(|| {
            // Every pass reads the same bytes: a sum that moves voids the passes.
            let mut first = None;
            super::timed_reads(&runs, passes, |sum| *first.get_or_insert(sum) == sum)
        })?;
        Ok(Some((bytes, times)))
    }

    fn op_times(&self) -> Vec<(String, f64)> {
        crate::backend::decoding::op_times(&self.times)
    }

    fn kernel_version(&self) -> String {
        super::sgemm::kernel_name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass's activations and logits are counted before they are allocated: Qwen2.5-0.5B in
    /// FP32 with a 4-token prompt fits 20 GB at batch 8, while batch 100,000 (whose KV cache,
    /// 15 GB, would fit) is refused with a batch that fits; the suggestion fits, and the count
    /// grows with the rows a pass takes (one token a step, or all 4 at once).
    #[test]
    fn passes_that_cannot_fit_are_refused_before_allocating() {
        let cfg = crate::model::llm::built_in("qwen2.5-0.5b").unwrap();
        let free = || 20u64 << 30;
        let pass =
            |batch: usize, rows: usize| check_pass::<f32>(&cfg, (batch, rows, None), (0, free));
        assert!(pass(8, 4).is_ok());
        // Within the scratch already held, the machine's free memory is not asked.
        let asked = || panic!("free memory asked for a pass within the scratch held");
        assert!(check_pass::<f32>(&cfg, (8, 4, None), (1 << 30, asked)).is_ok());
        let Err(BackendError::OutOfMemory {
            needed,
            suggestion: Some(fits),
            ..
        }) = pass(100_000, 4)
        else {
            panic!("batch 100,000 is not refused with a suggestion");
        };
        // 31 GB of activations, 122 GB of logits.
        assert!(needed > 140 << 30, "{needed}");
        assert!(fits > 8 && fits < 100_000, "{fits}");
        assert!(
            pass(fits, 4).is_ok(),
            "the suggested batch {fits} does not fit"
        );
        // One row a sequence (a decode step) needs less than the prompt's four.
        let need = |rows| match pass(100_000, rows) {
            Err(BackendError::OutOfMemory { needed, .. }) => needed,
            other => panic!("{other:?}"),
        };
        assert!(need(1) < need(4));
        // Sizes past any machine saturate rather than wrap to small.
        assert!(pass(usize::MAX, usize::MAX).is_err());
    }
}

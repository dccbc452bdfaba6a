//! What the GPU backends' decoder sessions share (`gpu/decoder.rs` for CUDA, HIP and the
//! emulator, `webgpu/decoder.rs`): a block's buffers by id, what each buffer is for, where the
//! last step's logits are, and how a prefill is cut into chunks of whole positions.

use std::collections::BTreeMap;

use super::{BackendError, DecoderMemory, DecoderOptions};
use crate::model::llm::DecoderWeights;
use crate::model::llm::config::rotary_tables;
use crate::model::llm::weights::{LayerTensors, Linear, Norm};

/// A buffer of a session, by index into its own list.
pub type BufId = usize;

/// The most rows one forward pass runs unless `DecoderOptions::max_rows` says otherwise; a
/// longer prefill goes in chunks of whole positions.
pub const CHUNK_ROWS: usize = 2048;

/// Positions of every sequence one forward pass takes.
pub fn chunk_positions(opt: &DecoderOptions) -> usize {
    (opt.max_rows.unwrap_or(CHUNK_ROWS) / opt.batch.max(1)).clamp(1, opt.context.max(1))
}

/// A linear layer: its weight (`W`: one buffer, or the slices a binding limit cut it into), its
/// f32 bias, and its shape.
pub struct Lin<W> {
    pub w: W,
    pub bias: Option<BufId>,
    pub inputs: usize,
    pub outputs: usize,
}

/// An f32 norm weight, and LayerNorm's bias.
pub struct NormBufs {
    pub w: BufId,
    pub bias: Option<BufId>,
}

/// One block, fused as `DecoderWeights::layer` gives it, and its KV cache
/// (batch, KV heads, context, head).
pub struct Layer<W> {
    pub norm1: NormBufs,
    pub qkv: Lin<W>,
    pub o: Lin<W>,
    pub norm2: NormBufs,
    pub up: Lin<W>,
    pub down: Lin<W>,
    pub k: BufId,
    pub v: BufId,
}

/// A decoder's weights on a device, by buffer (`M`: how a matrix is held).
pub struct Model<M> {
    pub layers: Vec<Layer<M>>,
    /// The token table (vocabulary × hidden), and the LM head (the same buffers when tied).
    pub embed: M,
    pub lm_head: M,
    /// GPT-2's learned positions.
    pub positions: Option<BufId>,
    pub final_norm: NormBufs,
    /// Rotary cosines and sines (context × head/2 each); placeholders for GPT-2.
    pub cos: BufId,
    pub sin: BufId,
}

/// How a session puts buffers on its device.
pub trait Upload {
    /// A matrix in the storage precision: one buffer, or slices of rows.
    type Matrix: Clone;
    fn f32s(&mut self, what: &str, v: &[f32]) -> Result<BufId, BackendError>;
    /// A row-major matrix of `cols` columns, in the session's storage precision.
    fn matrix(&mut self, what: &str, m: &[f32], cols: usize) -> Result<Self::Matrix, BackendError>;
    /// A zeroed buffer of `bytes`.
    fn empty(&mut self, what: &str, bytes: u64, role: Role) -> Result<BufId, BackendError>;

    fn norm(&mut self, n: &Norm) -> Result<NormBufs, BackendError> {
        Ok(NormBufs {
            w: self.f32s("a norm's weight", &n.weight)?,
            bias: match &n.bias {
                Some(b) => Some(self.f32s("a norm's bias", b)?),
                None => None,
            },
        })
    }

    fn linear(&mut self, l: &Linear) -> Result<Lin<Self::Matrix>, BackendError> {
        Ok(Lin {
            w: self.matrix("a linear layer's weight", &l.weight, l.inputs)?,
            bias: match &l.bias {
                Some(b) => Some(self.f32s("a linear layer's bias", b)?),
                None => None,
            },
            inputs: l.inputs,
            outputs: l.outputs,
        })
    }
}

fn load_err(e: anyhow::Error) -> BackendError {
    BackendError::Invalid(format!("{e:#}"))
}

/// Every weight of `w` on the device, and a KV cache of `cache_bytes` per layer for K and for V;
/// rotary tables for `context` positions.
pub fn upload_model<U: Upload>(
    u: &mut U,
    w: &DecoderWeights,
    cache_bytes: u64,
    context: usize,
) -> Result<Model<U::Matrix>, BackendError> {
    let cfg = &w.config;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    let mut t = LayerTensors::default();
    for l in 0..cfg.num_hidden_layers {
        w.layer_into(l, &mut t).map_err(load_err)?;
        layers.push(Layer {
            norm1: u.norm(&t.norm1)?,
            qkv: u.linear(&t.qkv)?,
            o: u.linear(&t.o)?,
            norm2: u.norm(&t.norm2)?,
            up: u.linear(&t.up)?,
            down: u.linear(&t.down)?,
            k: u.empty("the key cache", cache_bytes, Role::Cache)?,
            v: u.empty("the value cache", cache_bytes, Role::Cache)?,
        });
    }
    let table = w.token_table().map_err(load_err)?;
    let embed = u.matrix("the token table", &table, cfg.hidden_size)?;
    drop(table);
    let lm_head = match w.lm_head().map_err(load_err)? {
        Some(head) => u.matrix("the LM head", &head, cfg.hidden_size)?,
        None => embed.clone(),
    };
    let positions = match w.position_table().map_err(load_err)? {
        Some(t) => Some(u.f32s("the position table", &t)?),
        None => None,
    };
    let (cos, sin) = match positions {
        Some(_) => (Vec::new(), Vec::new()),
        None => rotary_tables(cfg, context),
    };
    Ok(Model {
        layers,
        embed,
        lm_head,
        positions,
        final_norm: u.norm(&w.final_norm().map_err(load_err)?)?,
        cos: u.f32s("the rotary cosines", &cos)?,
        sin: u.f32s("the rotary sines", &sin)?,
    })
}

/// What a buffer holds, for [`memory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Weights,
    Cache,
    Scratch,
}

/// The session's bytes by role.
pub fn memory(buffers: impl Iterator<Item = (u64, Role)>) -> DecoderMemory {
    let mut m = DecoderMemory::default();
    for (bytes, role) in buffers {
        *match role {
            Role::Weights => &mut m.weights,
            Role::Cache => &mut m.kv_cache,
            Role::Scratch => &mut m.scratch,
        } += bytes;
    }
    m
}

/// Seconds per kind of op, as `DecoderSession::op_times` gives them.
pub fn op_times(times: &BTreeMap<&'static str, f64>) -> Vec<(String, f64)> {
    times.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Where the last step's logits are.
pub enum Logits {
    None,
    /// In the device's logits buffer: each sequence's last row.
    Device,
    /// Every prompt position's, read back chunk by chunk.
    Host(Vec<f32>),
}

/// One chunk of a step: positions `start..start + len` of every sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Chunk {
    pub start: usize,
    pub len: usize,
    /// New tokens per sequence in the whole step.
    pub new: usize,
}

impl Chunk {
    /// The chunks of a step of `new` tokens per sequence, `size` positions at most each.
    pub fn all(new: usize, size: usize) -> impl Iterator<Item = Chunk> {
        (0..new).step_by(size.max(1)).map(move |start| Chunk {
            start,
            len: (new - start).min(size),
            new,
        })
    }

    /// Its token ids, sequence-major, out of the step's (`batch` rows of `new`).
    pub fn ids(&self, tokens: &[u32], batch: usize) -> Vec<u32> {
        (0..batch)
            .flat_map(|b| &tokens[b * self.new + self.start..][..self.len])
            .copied()
            .collect()
    }

    /// The step's row (sequence-major over all `new` positions) of the chunk's row `r`.
    pub fn step_row(&self, r: usize) -> usize {
        (r / self.len) * self.new + self.start + r % self.len
    }

    pub fn is_last(&self) -> bool {
        self.start + self.len == self.new
    }
}

/// What a session does for [`run_step`]: a GPU backend's part of a step.
pub trait Steps {
    /// Write a chunk's token ids (sequence-major) and where it starts, {start, len}, where the
    /// kernels read them.
    fn write_step(&mut self, ids: &[u32], start: usize, len: usize) -> Result<(), BackendError>;
    /// The prepared decode step: `batch` rows of one position, and the LM head on them.
    fn decode_step(&mut self) -> Result<(), BackendError>;
    /// Every block on `rows` rows of `len` positions each; with `head`, then the final norm
    /// and the LM head on each sequence's last row.
    fn layers(&mut self, rows: usize, len: usize, head: bool) -> Result<(), BackendError>;
    /// The final norm and LM head on `count` rows of the hidden states from row `first`, read
    /// back (`count` × vocabulary).
    fn head_rows(&mut self, first: usize, count: usize) -> Result<Vec<f32>, BackendError>;
}

/// One forward pass of `new` tokens per sequence from position `pos`, in chunks of `chunk`
/// positions: the prepared decode step where a chunk is one position, else the blocks, then the
/// LM head on the last chunk's last rows (or on every row, read back as it goes, with
/// `all_logits`). Returns where the logits are.
pub fn run_step<S: Steps>(
    s: &mut S,
    tokens: &[u32],
    (batch, new, pos): (usize, usize, usize),
    chunk: usize,
    vocab: usize,
    all_logits: bool,
) -> Result<Logits, BackendError> {
    let mut host = vec![0f32; if all_logits { tokens.len() * vocab } else { 0 }];
    let mut logits = Logits::None;
    for c in Chunk::all(new, chunk) {
        let rows = batch * c.len;
        s.write_step(&c.ids(tokens, batch), pos + c.start, c.len)?;
        if c.len == 1 && !all_logits {
            s.decode_step()?;
            logits = Logits::Device;
            continue;
        }
        s.layers(rows, c.len, c.is_last() && !all_logits)?;
        if c.is_last() && !all_logits {
            logits = Logits::Device;
        }
        if all_logits {
            // `batch` rows at a time: the logits buffer holds that many.
            for first in (0..rows).step_by(batch) {
                let count = (rows - first).min(batch);
                let got = s.head_rows(first, count)?;
                for (i, row) in got.chunks(vocab).enumerate() {
                    let at = c.step_row(first + i) * vocab;
                    host[at..at + vocab].copy_from_slice(row);
                }
            }
        }
    }
    if all_logits {
        logits = Logits::Host(host);
    }
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_position_once() {
        let chunks: Vec<Chunk> = Chunk::all(5, 2).collect();
        assert_eq!(
            chunks.iter().map(|c| (c.start, c.len)).collect::<Vec<_>>(),
            [(0, 2), (2, 2), (4, 1)]
        );
        assert!(chunks[2].is_last() && !chunks[1].is_last());
        // Two sequences of five tokens: the second chunk holds positions 2 and 3 of each.
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(chunks[1].ids(&tokens, 2), [2, 3, 7, 8]);
        assert_eq!(
            (0..4).map(|r| chunks[1].step_row(r)).collect::<Vec<_>>(),
            [2, 3, 7, 8]
        );
    }
}

//! The CUDA and HIP backends' language-model session, on any [`Device`] (the emulator too):
//! weights uploaded once in the storage precision (q/k/v and gate/up fused as on the CPU), the
//! KV cache preallocated for the whole context, and each step a list of launches of
//! kernels/gpu/llm.cuh and the linear kernels the CNNs use. Where a step starts comes from a
//! small device buffer, so a decode step's launches are packed once and, with
//! `DecoderOptions::replay`, recorded once as a graph and replayed every token. A long prefill
//! runs in chunks (`DecoderOptions::max_rows`, 2048 rows by default) that attend to what
//! earlier chunks cached, so scratch stays small whatever the context.

use std::collections::{BTreeMap, HashMap};

use super::Device;
use super::program::{Arg, ConvShape, KernelLaunch, conv_kernel, grid_1d, i32_of};
use crate::backend::decoding::{
    self, BufId, Lin, Logits, Model, NormBufs, Role, Steps, Upload, chunk_positions, run_step,
    upload_model,
};
use crate::backend::{BackendError, DecoderMemory, DecoderOptions, DecoderSession};
use crate::model::Precision;
use crate::model::llm::{DecoderConfig, DecoderWeights, Family};

/// Must match GEMV_ROWS in kernels/gpu/llm.cuh: steps of at most this many rows take `gemv`.
const GEMV_ROWS: usize = 8;

/// Every kernel a step may launch.
const KERNELS: [&str; 13] = [
    "cached_attention",
    "conv2d",
    "conv2d_lin_t128",
    "conv2d_lin_t64",
    "embed_tokens",
    "gemv",
    "glu",
    "kv_store",
    "layer_norm_rows",
    "rms_norm_rows",
    "rope",
    "select_token",
    "to_f32",
];
/// The tensor-core linear kernels, where the device has them.
const MMA_KERNELS: [&str; 2] = ["conv2d_lin_mma_t128", "conv2d_lin_mma_t64"];

/// Activations and step inputs, sized for one chunk of rows.
struct Scratch {
    tokens: BufId,
    /// {first position, new tokens per sequence} of the step.
    step: BufId,
    x: BufId,
    x2: BufId,
    xn: BufId,
    qkv: BufId,
    attn: BufId,
    up: BufId,
    act: BufId,
    /// Each sequence's last row, for the LM head after a prefill.
    last: BufId,
    lastn: BufId,
    head: BufId,
    /// The LM head's output in f32 (batch × vocabulary).
    logits: BufId,
}

/// A launch of a step: what profiles call it, and the kernel with its grid and arguments.
struct Task {
    op: &'static str,
    launch: KernelLaunch,
}

/// A task with its arguments packed, ready to enqueue.
struct Ready<F> {
    op: &'static str,
    f: F,
    grid: [u32; 3],
    args: Vec<u8>,
}

pub struct GpuDecoder<D: Device> {
    device: D,
    cfg: DecoderConfig,
    precision: Precision,
    mma: bool,
    functions: HashMap<&'static str, D::Function>,
    /// Device address and size of every buffer, by id.
    ptrs: Vec<u64>,
    sizes: Vec<(u64, Role)>,
    m: Model<BufId>,
    s: Scratch,
    batch: usize,
    context: usize,
    /// Positions per sequence in one forward pass.
    chunk: usize,
    pos: usize,
    /// A decode step's launches, packed at prepare time.
    decode: Vec<Ready<D::Function>>,
    /// The decode step was recorded as a graph and is replayed.
    replayed: bool,
    logits: Logits,
    profile: bool,
    times: BTreeMap<&'static str, f64>,
}

/// Device bytes of `n` values of `p`.
fn bytes(n: usize, p: Precision) -> u64 {
    n as u64 * p.bytes() as u64
}

impl<D: Device> GpuDecoder<D> {
    /// Refuse a session that needs more than `free` bytes of device memory, then upload the
    /// weights, allocate the cache and scratch, compile the kernels and pack a decode step.
    pub fn new(
        mut device: D,
        w: &DecoderWeights,
        opt: &DecoderOptions,
        free: Option<u64>,
    ) -> Result<Self, BackendError> {
        let cfg = w.config.clone();
        let p = opt.precision;
        if cfg.head_dim > 256 || !cfg.head_dim.is_multiple_of(2) {
            return Err(BackendError::Unsupported(format!(
                "a head of {} values: the GPU attention kernel takes even heads of up to 256",
                cfg.head_dim
            )));
        }
        let batch = opt.batch.max(1);
        let chunk = chunk_positions(opt);
        let rows = batch * chunk;
        // Every size the kernels index with 32-bit ints.
        for (what, v) in [
            ("rows of a step", rows),
            ("the context", opt.context),
            ("the logits of a step", batch.saturating_mul(cfg.vocab_size)),
            ("the intermediate size", 2 * cfg.intermediate_size),
        ] {
            i32_of(v, what)?;
        }
        let (d, inner, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qw, kvw) = cfg.qkv_widths();
        let up_width = match cfg.family {
            Family::Llama => 2 * inner,
            Family::Gpt2 => inner,
        };
        let cache = batch * cfg.num_key_value_heads * opt.context * cfg.head_dim;
        // In the order of `Scratch`'s fields.
        let scratch_sizes = [
            rows as u64 * 4,
            8,
            bytes(rows * d, p),
            bytes(rows * d, p),
            bytes(rows * d, p),
            bytes(rows * (qw + 2 * kvw), p),
            bytes(rows * qw, p),
            bytes(rows * up_width, p),
            bytes(rows * inner, p),
            bytes(batch * d, p),
            bytes(batch * d, p),
            bytes(batch * vocab, p),
            (batch * vocab) as u64 * 4,
        ];
        if let Some(free) = free {
            let half = cfg.head_dim / 2;
            let weights = cfg.matmul_params() * p.bytes() as u64
                + if cfg.tie_word_embeddings {
                    0
                } else {
                    bytes(vocab * d, p)
                }
                + (2 * opt.context * half * 4) as u64;
            let per_sequence = 2 * bytes(cache / batch, p) * cfg.num_hidden_layers as u64;
            let scratch: u64 = scratch_sizes.iter().sum();
            let needed = weights + per_sequence * batch as u64 + scratch;
            if needed > free {
                let fits = free.saturating_sub(weights + scratch) / per_sequence.max(1);
                return Err(BackendError::OutOfMemory {
                    needed,
                    available: free,
                    suggestion: (fits >= 1 && (fits as usize) < batch).then_some(fits as usize),
                });
            }
        }
        let mma = p != Precision::Fp32 && device.matrix_units();
        let mut names: Vec<&'static str> = KERNELS.to_vec();
        if mma {
            names.extend(MMA_KERNELS);
        }
        let compiled = device.compile(p, opt.kernels_dir.as_deref(), &names)?;
        let functions = names.into_iter().zip(compiled).collect();

        let mut bufs = Buffers {
            device: &mut device,
            precision: p,
            ptrs: Vec::new(),
            sizes: Vec::new(),
        };
        let m = upload_model(&mut bufs, w, bytes(cache, p), opt.context)?;
        let mut sizes = scratch_sizes.into_iter();
        let mut next = || bufs.empty("scratch", sizes.next().unwrap_or(8), Role::Scratch);
        let s = Scratch {
            tokens: next()?,
            step: next()?,
            x: next()?,
            x2: next()?,
            xn: next()?,
            qkv: next()?,
            attn: next()?,
            up: next()?,
            act: next()?,
            last: next()?,
            lastn: next()?,
            head: next()?,
            logits: next()?,
        };
        let Buffers { ptrs, sizes, .. } = bufs;
        let mut session = GpuDecoder {
            device,
            cfg,
            precision: p,
            mma,
            functions,
            ptrs,
            sizes,
            m,
            s,
            batch,
            context: opt.context,
            chunk,
            pos: 0,
            decode: Vec::new(),
            replayed: false,
            logits: Logits::None,
            profile: opt.profile,
            times: BTreeMap::new(),
        };
        let mut tasks = session.layer_tasks(batch, 1)?;
        tasks.extend(session.head_tasks(Arg::Buf(session.s.x), batch)?);
        session.decode = session.ready(&tasks);
        if opt.replay && !opt.profile && session.device.begin_capture()? {
            let decode = std::mem::take(&mut session.decode);
            let run = session.enqueue(&decode);
            session.decode = decode;
            session.device.end_capture()?;
            run?;
            session.replayed = true;
        }
        Ok(session)
    }
}

/// The session's buffers while they are made.
struct Buffers<'a, D> {
    device: &'a mut D,
    precision: Precision,
    ptrs: Vec<u64>,
    sizes: Vec<(u64, Role)>,
}

impl<D: Device> Buffers<'_, D> {
    fn upload(&mut self, data: Vec<u8>) -> Result<BufId, BackendError> {
        let id = self.empty("weights", data.len() as u64, Role::Weights)?;
        self.device.upload(self.ptrs[id], &data)?;
        Ok(id)
    }
}

impl<D: Device> Upload for Buffers<'_, D> {
    type Matrix = BufId;

    fn f32s(&mut self, _: &str, v: &[f32]) -> Result<BufId, BackendError> {
        self.upload(Precision::Fp32.storage_bytes(v))
    }

    fn matrix(&mut self, _: &str, m: &[f32], _: usize) -> Result<BufId, BackendError> {
        self.upload(self.precision.storage_bytes(m))
    }

    fn empty(&mut self, _: &str, bytes: u64, role: Role) -> Result<BufId, BackendError> {
        let bytes = bytes.next_multiple_of(8).max(8);
        self.ptrs.push(self.device.alloc(bytes)?);
        self.sizes.push((bytes, role));
        Ok(self.ptrs.len() - 1)
    }
}

fn int(v: usize) -> Arg {
    // Every size was checked against i32 when the session was prepared.
    Arg::I32(v as i32)
}

fn task(op: &'static str, kernel: &'static str, grid: [u32; 3], args: Vec<Arg>) -> Task {
    Task {
        op,
        launch: KernelLaunch { kernel, grid, args },
    }
}

impl<D: Device> GpuDecoder<D> {
    fn norm(&self, n: &NormBufs, x: Arg, y: BufId, rows: usize) -> Result<Task, BackendError> {
        let (d, eps) = (self.cfg.hidden_size, Arg::F32(self.cfg.norm_eps as f32));
        // RMSNorm takes a block (256 threads) a row, LayerNorm 32 threads a row.
        let (kernel, args, threads) = match n.bias {
            None => (
                "rms_norm_rows",
                vec![x, Arg::Buf(n.w), Arg::Buf(y), int(rows), int(d), eps],
                256,
            ),
            Some(b) => (
                "layer_norm_rows",
                vec![
                    x,
                    Arg::Buf(n.w),
                    Arg::Buf(b),
                    Arg::Buf(y),
                    int(rows),
                    int(d),
                    int(1),
                    eps,
                ],
                32,
            ),
        };
        Ok(task("norm", kernel, grid_1d(rows * threads)?, args))
    }

    /// y = x·wᵀ + bias (+ res): `gemv` for a few rows, else the CNNs' tiled linear kernel.
    fn linear(
        &self,
        op: &'static str,
        x: Arg,
        l: &Lin<BufId>,
        rows: usize,
        y: BufId,
        res: Option<BufId>,
    ) -> Result<Task, BackendError> {
        let bias = l.bias.map_or(Arg::Null, Arg::Buf);
        let residual = res.map_or(Arg::Null, Arg::Buf);
        let flags = [int(l.bias.is_some() as usize), int(res.is_some() as usize)];
        if rows <= GEMV_ROWS {
            let args = [
                vec![x, Arg::Buf(l.w), bias, residual, Arg::Buf(y)],
                vec![int(rows), int(l.inputs), int(l.outputs)],
                flags.to_vec(),
            ]
            .concat();
            return Ok(task(op, "gemv", grid_1d(l.outputs * 32)?, args));
        }
        let (kernel, grid) =
            conv_kernel(rows, l.outputs, 1, l.inputs, ConvShape::Linear, self.mma)?;
        // ConvArgs of `rows` 1×1 images: a 1×1 kernel, stride 1, no padding, one group.
        let args = [
            vec![x, Arg::Buf(l.w), bias, residual, Arg::Buf(y)],
            [rows, l.inputs, 1, 1, l.outputs, 1, 1].map(int).to_vec(),
            [1, 1, 1, 1, 0, 0, 1, 1, 1, 0].map(int).to_vec(),
            flags.to_vec(),
            vec![int(0)],
        ]
        .concat();
        Ok(task(op, kernel, grid, args))
    }

    /// Every block of a step of `rows` rows, `new` per sequence, from the token ids in `tokens`
    /// to the hidden states in `s.x`.
    fn layer_tasks(&self, rows: usize, new: usize) -> Result<Vec<Task>, BackendError> {
        let (c, s) = (&self.cfg, &self.s);
        let (d, inner, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let (qw, kvw) = c.qkv_widths();
        let width = qw + 2 * kvw;
        debug_assert_eq!(rows % new, 0);
        let mut t = vec![task(
            "embedding",
            "embed_tokens",
            grid_1d(rows * d)?,
            vec![
                Arg::Buf(self.m.embed),
                self.m.positions.map_or(Arg::Null, Arg::Buf),
                Arg::Buf(s.tokens),
                Arg::Buf(s.step),
                Arg::Buf(s.x),
                int(rows),
                int(d),
                int(self.m.positions.is_some() as usize),
            ],
        )];
        let (mut x, mut x2) = (s.x, s.x2);
        for (index, l) in self.m.layers.iter().enumerate() {
            t.push(self.norm(&l.norm1, Arg::Buf(x), s.xn, rows)?);
            t.push(self.linear("linear", Arg::Buf(s.xn), &l.qkv, rows, s.qkv, None)?);
            if c.family == Family::Llama {
                let rotated = heads + kv_heads;
                t.push(task(
                    "rope",
                    "rope",
                    grid_1d(rows * rotated * hd / 2)?,
                    vec![
                        Arg::Buf(s.qkv),
                        Arg::Buf(self.m.cos),
                        Arg::Buf(self.m.sin),
                        Arg::Buf(s.step),
                        int(rows),
                        int(width),
                        int(rotated),
                        int(hd),
                    ],
                ));
            }
            let cache = [
                Arg::Buf(s.qkv),
                Arg::Buf(l.k),
                Arg::Buf(l.v),
                Arg::Buf(s.step),
            ];
            t.push(task(
                "attention",
                "kv_store",
                grid_1d(rows * kvw)?,
                [
                    cache.to_vec(),
                    [rows, width, qw, kv_heads, hd, self.context]
                        .map(int)
                        .to_vec(),
                ]
                .concat(),
            ));
            let window = c.window(index).map_or(0, |w| w.min(self.context));
            t.push(task(
                "attention",
                "cached_attention",
                grid_1d(rows * heads * 256)?,
                [
                    cache.to_vec(),
                    vec![Arg::Buf(s.attn)],
                    [rows, width, heads, kv_heads, hd, self.context, window]
                        .map(int)
                        .to_vec(),
                ]
                .concat(),
            ));
            t.push(self.linear("linear", Arg::Buf(s.attn), &l.o, rows, x2, Some(x))?);
            std::mem::swap(&mut x, &mut x2);
            t.push(self.norm(&l.norm2, Arg::Buf(x), s.xn, rows)?);
            t.push(self.linear("linear", Arg::Buf(s.xn), &l.up, rows, s.up, None)?);
            t.push(task(
                "activation",
                "glu",
                grid_1d(rows * inner)?,
                vec![
                    Arg::Buf(s.up),
                    Arg::Buf(s.act),
                    int(rows),
                    int(inner),
                    int((c.family == Family::Gpt2) as usize),
                ],
            ));
            t.push(self.linear("linear", Arg::Buf(s.act), &l.down, rows, x2, Some(x))?);
            std::mem::swap(&mut x, &mut x2);
        }
        // Two residual adds a block: the hidden states end where they began.
        debug_assert_eq!(x, s.x);
        Ok(t)
    }

    /// The final norm and the LM head on `rows` rows starting at `x`, into `s.logits` (f32).
    fn head_tasks(&self, x: Arg, rows: usize) -> Result<Vec<Task>, BackendError> {
        let (s, vocab) = (&self.s, self.cfg.vocab_size);
        let head = Lin {
            w: self.m.lm_head,
            bias: None,
            inputs: self.cfg.hidden_size,
            outputs: vocab,
        };
        Ok(vec![
            self.norm(&self.m.final_norm, x, s.lastn, rows)?,
            self.linear("lm_head", Arg::Buf(s.lastn), &head, rows, s.head, None)?,
            task(
                "lm_head",
                "to_f32",
                grid_1d(rows * vocab)?,
                vec![Arg::Buf(s.head), Arg::Buf(s.logits), int(rows * vocab)],
            ),
        ])
    }

    fn ready(&self, tasks: &[Task]) -> Vec<Ready<D::Function>> {
        tasks
            .iter()
            .map(|t| Ready {
                op: t.op,
                f: self.functions[t.launch.kernel].clone(),
                grid: t.launch.grid,
                args: super::program::pack(&t.launch.args, |b| self.ptrs[b]),
            })
            .collect()
    }

    /// Enqueue `ready`; when profiling, wait for it and add each launch's time to its op.
    fn enqueue(&mut self, ready: &[Ready<D::Function>]) -> Result<(), BackendError> {
        if self.profile {
            self.device.marks(ready.len() + 1)?;
            self.device.mark(0)?;
        }
        for (i, r) in ready.iter().enumerate() {
            self.device
                .launch(&r.f, r.grid, super::program::BLOCK, &r.args)?;
            if self.profile {
                self.device.mark(i + 1)?;
            }
        }
        if self.profile {
            self.device.sync()?;
            let t = self.device.mark_times(ready.len() + 1)?;
            for (r, w) in ready.iter().zip(t.windows(2)) {
                *self.times.entry(r.op).or_default() += w[1].saturating_sub(w[0]) as f64 * 1e-9;
            }
        }
        Ok(())
    }

    fn run(&mut self, tasks: &[Task]) -> Result<(), BackendError> {
        let ready = self.ready(tasks);
        self.enqueue(&ready)
    }

    fn download_logits(&mut self, rows: usize) -> Result<Vec<f32>, BackendError> {
        let mut raw = vec![0u8; rows * self.cfg.vocab_size * 4];
        self.device.download(self.ptrs[self.s.logits], &mut raw)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<(), BackendError> {
        let new =
            crate::backend::step_tokens(&self.cfg, self.batch, self.context, self.pos, tokens)?;
        let (batch, pos, chunk, vocab) = (self.batch, self.pos, self.chunk, self.cfg.vocab_size);
        self.logits = Logits::None;
        self.logits = run_step(self, tokens, (batch, new, pos), chunk, vocab, all_logits)?;
        self.pos += new;
        Ok(())
    }
}

impl<D: Device> Steps for GpuDecoder<D> {
    fn write_step(&mut self, ids: &[u32], start: usize, len: usize) -> Result<(), BackendError> {
        let ids: Vec<u8> = ids.iter().flat_map(|&t| (t as i32).to_ne_bytes()).collect();
        self.device.upload(self.ptrs[self.s.tokens], &ids)?;
        let step: Vec<u8> = [start as i32, len as i32]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        self.device.upload(self.ptrs[self.s.step], &step)
    }

    fn decode_step(&mut self) -> Result<(), BackendError> {
        if self.replayed {
            return self.device.replay();
        }
        let decode = std::mem::take(&mut self.decode);
        let run = self.enqueue(&decode);
        self.decode = decode;
        run
    }

    fn layers(&mut self, rows: usize, len: usize, head: bool) -> Result<(), BackendError> {
        let mut tasks = self.layer_tasks(rows, len)?;
        if head {
            let (batch, d) = (self.batch, self.cfg.hidden_size);
            tasks.push(task(
                "lm_head",
                "select_token",
                grid_1d(batch * d)?,
                [
                    vec![Arg::Buf(self.s.x), Arg::Buf(self.s.last)],
                    [batch, len, d, len - 1].map(int).to_vec(),
                ]
                .concat(),
            ));
            tasks.extend(self.head_tasks(Arg::Buf(self.s.last), batch)?);
        }
        self.run(&tasks)
    }

    fn head_rows(&mut self, first: usize, count: usize) -> Result<Vec<f32>, BackendError> {
        let row_bytes = (self.precision.bytes() * self.cfg.hidden_size) as u64;
        let head = self.head_tasks(Arg::At(self.s.x, first as u64 * row_bytes), count)?;
        self.run(&head)?;
        self.download_logits(count)
    }
}

impl<D: Device> DecoderSession for GpuDecoder<D> {
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
        self.device.sync()
    }

    fn logits(&mut self) -> Result<Vec<f32>, BackendError> {
        match &self.logits {
            Logits::None => Err(BackendError::Invalid("no step has run yet".into())),
            Logits::Device => self.download_logits(self.batch),
            Logits::Host(v) => Ok(v.clone()),
        }
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn memory(&self) -> DecoderMemory {
        decoding::memory(self.sizes.iter().copied())
    }

    fn op_times(&self) -> Vec<(String, f64)> {
        decoding::op_times(&self.times)
    }

    fn kernel_version(&self) -> String {
        format!(
            "workshop-gpu {} on {} ({}{})",
            env!("CARGO_PKG_VERSION"),
            self.device.describe(),
            self.precision,
            if self.replayed {
                format!(", decode step replayed as a {}", self.device.graph_name())
            } else {
                String::new()
            }
        )
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::backend::BackendKind;
    use crate::backend::gpu::emu::EmuDevice;

    fn options(batch: usize, replay: bool, max_rows: Option<usize>) -> DecoderOptions {
        DecoderOptions {
            precision: Precision::Fp32,
            threads: None,
            batch,
            context: 12,
            profile: false,
            replay,
            kernels_dir: None,
            max_rows,
        }
    }

    /// A prefill in chunks (2 positions of 2 sequences at a time, the last chunk one position:
    /// `gemv`) gives the logits of one pass (the tiled GEMM), every position's and the last's;
    /// decode steps after it, recorded and replayed, give those of a session that enqueues
    /// them.
    #[test]
    fn chunked_prefill_and_replayed_decode_match_one_pass() {
        let mut cfg = crate::model::llm::built_in("qwen2.5-0.5b").unwrap();
        cfg.name = "tiny".into();
        // A hidden size that is no multiple of 4 values: `gemv`'s scalar path for q/k/v and
        // gate/up, its 16-byte path for the rest.
        (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) = (34, 48, 40);
        (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        ) = (4, 2, 8);
        cfg.num_hidden_layers = 2;
        let w = DecoderWeights::seeded(cfg, 7);
        let tokens: Vec<u32> = (0..10).map(|i| (i * 7 + 3) % 40).collect();
        let emu = || EmuDevice::new(BackendKind::Cuda);
        let mut one = GpuDecoder::new(emu(), &w, &options(2, false, None), None).unwrap();
        let mut chunked = GpuDecoder::new(emu(), &w, &options(2, true, Some(4)), None).unwrap();
        assert!(chunked.replayed && chunked.kernel_version().contains("replayed"));
        for all in [true, false] {
            one.prefill(&tokens, all).unwrap();
            chunked.prefill(&tokens, all).unwrap();
            let (a, b) = (one.logits().unwrap(), chunked.logits().unwrap());
            assert_eq!(a.len(), if all { 10 * 40 } else { 2 * 40 });
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "all logits {all}: chunks differ by {worst}");
        }
        for step in 0..3 {
            let next = [step as u32, 39 - step as u32];
            one.decode(&next).unwrap();
            chunked.decode(&next).unwrap();
            let (a, b) = (one.logits().unwrap(), chunked.logits().unwrap());
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "decode step {step} differs by {worst}");
        }
        assert_eq!(chunked.position(), 8);
        for _ in 8..12 {
            chunked.decode(&[1, 2]).unwrap();
        }
        let full = chunked.decode(&[1, 2]).unwrap_err().to_string();
        assert!(full.contains("the KV cache holds 12"), "{full}");
    }
}

//! The wgpu backend's language-model session: the same fused tensors as the other backends
//! (`DecoderWeights::layer`), the KV cache preallocated in storage buffers, and each step a
//! list of dispatches of kernels/wgsl/llm.wgsl. As on CUDA, where a step starts is read from a
//! small buffer (`step` = {start, new}), so a decode step's bind groups are made once; a
//! prefill's are made per call, in chunks (`DecoderOptions::max_rows`). Correct rather than fast:
//! one thread per output, no tiling (the CNNs' GEMM kernels take the image layout).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::Kernel;
use super::lower::{elem_bytes, f32_bytes, grid};
use super::session::{Pipelines, map_read, params};
use crate::backend::decoding::{
    self, BufId, Lin, Logits, Model, NormBufs, Role, Steps, Upload, chunk_positions, run_step,
    upload_model,
};
use crate::backend::{BackendError, DecoderMemory, DecoderOptions, DecoderSession};
use crate::model::Precision;
use crate::model::llm::{DecoderConfig, DecoderWeights, Family};

/// Must match the size of `acc` in llm.wgsl's `cached_attention`.
const MAX_HEAD: usize = 128;

/// `Params` of llm.wgsl, field by field.
#[derive(Debug, Default, Clone, Copy)]
struct Params {
    rows: usize,
    d: usize,
    k: usize,
    n: usize,
    width: usize,
    heads: usize,
    kv_heads: usize,
    head: usize,
    context: usize,
    window: usize,
    inner: usize,
    flags: usize,
    stride: usize,
    offset: usize,
    q_width: usize,
    eps: f32,
    first: usize,
    count: usize,
}

/// `Params::flags`.
const BIAS: usize = 1;
const RESIDUAL: usize = 2;
/// Positions for the embedding, LayerNorm for the norm.
const SECOND: usize = 4;
const TANH: usize = 8;

impl Params {
    fn words(&self) -> Vec<u32> {
        let mut w: Vec<u32> = [
            self.rows,
            self.d,
            self.k,
            self.n,
            self.width,
            self.heads,
            self.kv_heads,
            self.head,
            self.context,
            self.window,
            self.inner,
            self.flags,
            self.stride,
            self.offset,
            self.q_width,
        ]
        .iter()
        .map(|&v| v as u32)
        .collect();
        w.push(self.eps.to_bits());
        w.extend([self.first as u32, self.count as u32]);
        w
    }
}

/// One dispatch before it is bound.
struct Launch {
    kernel: Kernel,
    op: &'static str,
    params: Params,
    bindings: Vec<(u32, BufId)>,
    /// Threads that do work.
    threads: usize,
}

/// One dispatch, bound.
struct Bound {
    op: &'static str,
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    groups: (u32, u32, u32),
}

/// Rows `first..first + count` of a matrix, in one buffer: a matrix larger than the adapter
/// binds at once is cut into slices of whole rows, one launch each.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Slice {
    buf: BufId,
    first: usize,
    count: usize,
}

struct Scratch {
    tokens: BufId,
    step: BufId,
    x: BufId,
    x2: BufId,
    xn: BufId,
    qkv: BufId,
    attn: BufId,
    up: BufId,
    act: BufId,
    lastn: BufId,
    logits: BufId,
    readback: wgpu::Buffer,
}

pub(super) struct WgpuDecoder {
    device: wgpu::Device,
    queue: wgpu::Queue,
    cfg: DecoderConfig,
    precision: Precision,
    adapter_name: String,
    max_groups: u32,
    pipelines: HashMap<Kernel, wgpu::ComputePipeline>,
    buffers: Vec<wgpu::Buffer>,
    roles: Vec<Role>,
    zero: BufId,
    m: Model<Vec<Slice>>,
    s: Scratch,
    batch: usize,
    context: usize,
    chunk: usize,
    pos: usize,
    decode: Vec<Bound>,
    logits: Logits,
    profile: bool,
    times: BTreeMap<&'static str, f64>,
    pub(super) errors: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

/// Buffers while the session is made, each checked against the adapter's binding limit.
struct Buffers<'a> {
    device: &'a wgpu::Device,
    precision: Precision,
    max_binding: u64,
    buffers: Vec<wgpu::Buffer>,
    roles: Vec<Role>,
}

impl Buffers<'_> {
    fn check(&self, what: &str, bytes: u64) -> Result<(), BackendError> {
        if bytes > self.max_binding {
            return Err(BackendError::DeviceLimit(format!(
                "{what} needs {} in one buffer, but this adapter binds at most {} per storage \
                 buffer (max_storage_buffer_binding_size): use a smaller model, batch or context",
                crate::units::human_bytes(bytes),
                crate::units::human_bytes(self.max_binding)
            )));
        }
        Ok(())
    }

    fn upload(&mut self, what: &str, mut bytes: Vec<u8>) -> Result<BufId, BackendError> {
        bytes.resize(bytes.len().next_multiple_of(4).max(16), 0);
        self.check(what, bytes.len() as u64)?;
        self.buffers
            .push(super::session::storage(self.device, what, &bytes));
        self.roles.push(Role::Weights);
        Ok(self.buffers.len() - 1)
    }
}

impl Upload for Buffers<'_> {
    type Matrix = Vec<Slice>;

    fn empty(&mut self, what: &str, bytes: u64, role: Role) -> Result<BufId, BackendError> {
        let bytes = bytes.next_multiple_of(4).max(16);
        self.check(what, bytes)?;
        use wgpu::BufferUsages as U;
        self.buffers
            .push(self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(what),
                size: bytes,
                usage: U::STORAGE | U::COPY_DST | U::COPY_SRC,
                mapped_at_creation: false,
            }));
        self.roles.push(role);
        Ok(self.buffers.len() - 1)
    }

    /// In slices of whole rows that each fit one binding.
    fn matrix(&mut self, what: &str, m: &[f32], cols: usize) -> Result<Vec<Slice>, BackendError> {
        let p = self.precision;
        let row = elem_bytes(cols, p);
        self.check(&format!("a row of {what}"), row)?;
        let per = (self.max_binding / row.max(1)).max(1) as usize;
        let rows = m.len() / cols.max(1);
        let mut out = Vec::new();
        for first in (0..rows.max(1)).step_by(per) {
            let count = per.min(rows - first);
            let values = &m[first * cols..(first + count) * cols];
            let buf = self.upload(what, p.storage_bytes(values))?;
            out.push(Slice { buf, first, count });
        }
        Ok(out)
    }

    fn f32s(&mut self, what: &str, v: &[f32]) -> Result<BufId, BackendError> {
        self.upload(what, f32_bytes(v))
    }
}

impl WgpuDecoder {
    pub(super) fn new(
        device: wgpu::Device,
        queue: wgpu::Queue,
        limits: wgpu::Limits,
        w: &DecoderWeights,
        opt: &DecoderOptions,
        adapter_name: String,
    ) -> Result<Self, BackendError> {
        let cfg = w.config.clone();
        let p = opt.precision;
        if cfg.head_dim > MAX_HEAD || !cfg.head_dim.is_multiple_of(2) {
            return Err(BackendError::Unsupported(format!(
                "a head of {} values: the wgpu attention kernel takes even heads of up to {MAX_HEAD}",
                cfg.head_dim
            )));
        }
        let batch = opt.batch.max(1);
        let chunk = chunk_positions(opt);
        let rows = batch * chunk;
        let (d, inner, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qw, kvw) = cfg.qkv_widths();
        // Every index the kernels compute is a u32.
        let cache = batch * cfg.num_key_value_heads * opt.context * cfg.head_dim;
        for (what, v) in [
            ("the KV cache of a layer", cache),
            ("the logits of a step", batch.saturating_mul(vocab)),
            ("the token table", vocab.saturating_mul(d)),
            ("a step's MLP rows", rows.saturating_mul(2 * inner)),
        ] {
            if u32::try_from(v).is_err() {
                return Err(BackendError::DeviceLimit(format!(
                    "{what} holds {v} values, more than the wgpu kernels' 32-bit indices take"
                )));
            }
        }
        let mut pipelines = Pipelines::new(&device, opt.kernels_dir.as_ref(), p);
        let mut compiled = HashMap::new();
        for k in [
            Kernel::EmbedTokens,
            Kernel::LlmNorm,
            Kernel::Rope,
            Kernel::KvStore,
            Kernel::CachedAttention,
            Kernel::Glu,
            Kernel::LlmLinear,
            Kernel::LmHead,
        ] {
            compiled.insert(k, pipelines.get(k)?);
        }
        drop(pipelines);
        let mut b = Buffers {
            device: &device,
            precision: p,
            max_binding: limits
                .max_storage_buffer_binding_size
                .min(limits.max_buffer_size),
            buffers: Vec::new(),
            roles: Vec::new(),
        };
        let zero = b.upload("zero", vec![0; 16])?;
        let m = upload_model(&mut b, w, elem_bytes(cache, p), opt.context)?;
        let up_width = match cfg.family {
            Family::Llama => 2 * inner,
            Family::Gpt2 => inner,
        };
        let mut scratch = |what, n: u64| b.empty(what, n, Role::Scratch);
        let s = Scratch {
            tokens: scratch("tokens", rows as u64 * 4)?,
            step: scratch("step", 8)?,
            x: scratch("x", elem_bytes(rows * d, p))?,
            x2: scratch("x2", elem_bytes(rows * d, p))?,
            xn: scratch("xn", elem_bytes(rows * d, p))?,
            qkv: scratch("qkv", elem_bytes(rows * (qw + 2 * kvw), p))?,
            attn: scratch("attention", elem_bytes(rows * qw, p))?,
            up: scratch("up", elem_bytes(rows * up_width, p))?,
            act: scratch("act", elem_bytes(rows * inner, p))?,
            lastn: scratch("last rows", elem_bytes(batch * d, p))?,
            logits: scratch("logits", (batch * vocab * 4) as u64)?,
            readback: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("logits readback"),
                size: (batch * vocab * 4) as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        let (buffers, roles) = (b.buffers, b.roles);
        let mut session = WgpuDecoder {
            device,
            queue,
            cfg,
            precision: p,
            adapter_name,
            max_groups: limits.max_compute_workgroups_per_dimension,
            pipelines: compiled,
            buffers,
            roles,
            zero,
            m,
            s,
            batch,
            context: opt.context,
            chunk,
            pos: 0,
            decode: Vec::new(),
            logits: Logits::None,
            profile: opt.profile,
            times: BTreeMap::new(),
            errors: Default::default(),
        };
        let mut decode = session.layer_launches(batch);
        decode.extend(session.head_launches(batch, 1, 0));
        session.decode = session.bind(&decode);
        Ok(session)
    }

    /// The model's constants; each launch sets what it varies.
    fn base(&self, rows: usize) -> Params {
        let c = &self.cfg;
        let (qw, kvw) = c.qkv_widths();
        Params {
            rows,
            d: c.hidden_size,
            width: qw + 2 * kvw,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head: c.head_dim,
            context: self.context,
            inner: c.intermediate_size,
            stride: 1,
            q_width: qw,
            eps: c.norm_eps as f32,
            ..Default::default()
        }
    }

    fn norm(
        &self,
        n: &NormBufs,
        x: BufId,
        y: BufId,
        rows: usize,
        (stride, offset): (usize, usize),
    ) -> Launch {
        let bias = n.bias.unwrap_or(self.zero);
        Launch {
            kernel: Kernel::LlmNorm,
            op: "norm",
            params: Params {
                flags: if n.bias.is_some() { SECOND } else { 0 },
                stride,
                offset,
                ..self.base(rows)
            },
            bindings: vec![(2, x), (4, n.w), (5, bias), (6, y)],
            threads: rows,
        }
    }

    /// One launch per slice of the weight.
    fn linear(
        &self,
        x: BufId,
        l: &Lin<Vec<Slice>>,
        rows: usize,
        y: BufId,
        res: Option<BufId>,
    ) -> Vec<Launch> {
        let flags =
            if l.bias.is_some() { BIAS } else { 0 } | if res.is_some() { RESIDUAL } else { 0 };
        l.w.iter()
            .map(|s| Launch {
                kernel: Kernel::LlmLinear,
                op: "linear",
                params: Params {
                    k: l.inputs,
                    n: l.outputs,
                    flags,
                    first: s.first,
                    count: s.count,
                    ..self.base(rows)
                },
                bindings: vec![
                    (2, x),
                    (3, s.buf),
                    (5, l.bias.unwrap_or(self.zero)),
                    (6, y),
                    (9, res.unwrap_or(self.zero)),
                ],
                threads: rows * s.count,
            })
            .collect()
    }

    /// Every block of a step of `rows` rows, from the token ids to the hidden states in `s.x`.
    fn layer_launches(&self, rows: usize) -> Vec<Launch> {
        let (c, s) = (&self.cfg, &self.s);
        let base = self.base(rows);
        // Each slice of the table writes the rows whose token it holds.
        let mut out: Vec<Launch> = (self.m.embed.iter())
            .map(|t| Launch {
                kernel: Kernel::EmbedTokens,
                op: "embedding",
                params: Params {
                    flags: if self.m.positions.is_some() {
                        SECOND
                    } else {
                        0
                    },
                    first: t.first,
                    count: t.count,
                    ..base
                },
                bindings: vec![
                    (1, s.step),
                    (3, t.buf),
                    (4, self.m.positions.unwrap_or(self.zero)),
                    (6, s.x),
                    (8, s.tokens),
                ],
                threads: rows * c.hidden_size,
            })
            .collect();
        let (mut x, mut x2) = (s.x, s.x2);
        for (index, l) in self.m.layers.iter().enumerate() {
            out.push(self.norm(&l.norm1, x, s.xn, rows, (1, 0)));
            out.extend(self.linear(s.xn, &l.qkv, rows, s.qkv, None));
            if c.family == Family::Llama {
                let rotated = c.num_attention_heads + c.num_key_value_heads;
                out.push(Launch {
                    kernel: Kernel::Rope,
                    op: "rope",
                    params: Params {
                        heads: rotated,
                        ..base
                    },
                    bindings: vec![(1, s.step), (4, self.m.cos), (5, self.m.sin), (6, s.qkv)],
                    threads: rows * rotated * c.head_dim / 2,
                });
            }
            out.push(Launch {
                kernel: Kernel::KvStore,
                op: "attention",
                params: base,
                bindings: vec![(1, s.step), (2, s.qkv), (6, l.k), (7, l.v)],
                threads: rows * c.num_key_value_heads * c.head_dim,
            });
            out.push(Launch {
                kernel: Kernel::CachedAttention,
                op: "attention",
                params: Params {
                    window: c.window(index).map_or(0, |w| w.min(self.context)),
                    ..base
                },
                bindings: vec![(1, s.step), (2, s.qkv), (3, l.k), (6, s.attn), (11, l.v)],
                threads: rows * c.num_attention_heads,
            });
            out.extend(self.linear(s.attn, &l.o, rows, x2, Some(x)));
            std::mem::swap(&mut x, &mut x2);
            out.push(self.norm(&l.norm2, x, s.xn, rows, (1, 0)));
            out.extend(self.linear(s.xn, &l.up, rows, s.up, None));
            out.push(Launch {
                kernel: Kernel::Glu,
                op: "activation",
                params: Params {
                    flags: if c.family == Family::Gpt2 { TANH } else { 0 },
                    ..base
                },
                bindings: vec![(2, s.up), (6, s.act)],
                threads: rows * c.intermediate_size,
            });
            out.extend(self.linear(s.act, &l.down, rows, x2, Some(x)));
            std::mem::swap(&mut x, &mut x2);
        }
        debug_assert_eq!(x, s.x);
        out
    }

    /// The final norm of `rows` rows of `s.x` (row r is r · stride + offset) and the LM head,
    /// into the f32 `s.logits`.
    fn head_launches(&self, rows: usize, stride: usize, offset: usize) -> Vec<Launch> {
        let (s, vocab) = (&self.s, self.cfg.vocab_size);
        let mut out = vec![self.norm(&self.m.final_norm, s.x, s.lastn, rows, (stride, offset))];
        out.extend(self.m.lm_head.iter().map(|t| Launch {
            kernel: Kernel::LmHead,
            op: "lm_head",
            params: Params {
                k: self.cfg.hidden_size,
                n: vocab,
                first: t.first,
                count: t.count,
                ..self.base(rows)
            },
            bindings: vec![(2, s.lastn), (3, t.buf), (10, s.logits)],
            threads: rows * t.count,
        }));
        out
    }

    fn bind(&self, launches: &[Launch]) -> Vec<Bound> {
        launches
            .iter()
            .map(|l| {
                let pipeline = self.pipelines[&l.kernel].clone();
                let layout = pipeline.get_bind_group_layout(0);
                let pbuf = params(&self.device, &l.params.words());
                let mut entries = vec![wgpu::BindGroupEntry {
                    binding: 0,
                    resource: pbuf.as_entire_binding(),
                }];
                entries.extend(l.bindings.iter().map(|&(binding, b)| wgpu::BindGroupEntry {
                    binding,
                    resource: self.buffers[b].as_entire_binding(),
                }));
                let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(l.op),
                    layout: &layout,
                    entries: &entries,
                });
                Bound {
                    op: l.op,
                    pipeline,
                    bind_group,
                    groups: grid(l.threads, self.max_groups),
                }
            })
            .collect()
    }

    fn submit(&self, dispatches: &[Bound]) {
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("step"),
            });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("step"),
                timestamp_writes: None,
            });
            for d in dispatches {
                pass.set_pipeline(&d.pipeline);
                pass.set_bind_group(0, &d.bind_group, &[]);
                pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
            }
        }
        self.queue.submit([encoder.finish()]);
    }

    fn wait(&self) -> Result<(), BackendError> {
        super::session::wait(&self.device, &self.errors)
    }

    /// Submit `dispatches`; when profiling, one at a time, each timed to its end on the host.
    fn run(&mut self, dispatches: &[Bound]) -> Result<(), BackendError> {
        if !self.profile {
            self.submit(dispatches);
            return Ok(());
        }
        self.wait()?;
        for d in dispatches {
            let t = Instant::now();
            self.submit(std::slice::from_ref(d));
            self.wait()?;
            *self.times.entry(d.op).or_default() += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    fn read_logits(&mut self, rows: usize) -> Result<Vec<f32>, BackendError> {
        let bytes = (rows * self.cfg.vocab_size * 4) as u64;
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("logits"),
            });
        encoder.copy_buffer_to_buffer(&self.buffers[self.s.logits], 0, &self.s.readback, 0, bytes);
        self.queue.submit([encoder.finish()]);
        let raw = map_read(&self.device, &self.s.readback)?;
        self.wait()?;
        Ok(bytemuck::pod_collect_to_vec::<u8, f32>(
            &raw[..bytes as usize],
        ))
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

impl Steps for WgpuDecoder {
    fn write_step(&mut self, ids: &[u32], start: usize, len: usize) -> Result<(), BackendError> {
        let tokens = &self.buffers[self.s.tokens];
        self.queue
            .write_buffer(tokens, 0, bytemuck::cast_slice(ids));
        let step = [start as u32, len as u32];
        let at = &self.buffers[self.s.step];
        self.queue.write_buffer(at, 0, bytemuck::cast_slice(&step));
        Ok(())
    }

    fn decode_step(&mut self) -> Result<(), BackendError> {
        let decode = std::mem::take(&mut self.decode);
        let run = self.run(&decode);
        self.decode = decode;
        run
    }

    fn layers(&mut self, rows: usize, len: usize, head: bool) -> Result<(), BackendError> {
        let mut launches = self.layer_launches(rows);
        if head {
            launches.extend(self.head_launches(self.batch, len, len - 1));
        }
        let bound = self.bind(&launches);
        self.run(&bound)
    }

    fn head_rows(&mut self, first: usize, count: usize) -> Result<Vec<f32>, BackendError> {
        let bound = self.bind(&self.head_launches(count, 1, first));
        self.run(&bound)?;
        self.read_logits(count)
    }
}

impl DecoderSession for WgpuDecoder {
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
        self.wait()
    }

    fn logits(&mut self) -> Result<Vec<f32>, BackendError> {
        match &self.logits {
            Logits::None => Err(BackendError::Invalid("no step has run yet".into())),
            Logits::Device => self.read_logits(self.batch),
            Logits::Host(v) => Ok(v.clone()),
        }
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn memory(&self) -> DecoderMemory {
        let mut m = decoding::memory(
            self.buffers
                .iter()
                .map(|b| b.size())
                .zip(self.roles.iter().copied()),
        );
        m.scratch += self.s.readback.size();
        m
    }

    fn op_times(&self) -> Vec<(String, f64)> {
        decoding::op_times(&self.times)
    }

    fn kernel_version(&self) -> String {
        format!(
            "workshop-wgsl {} on {} ({})",
            env!("CARGO_PKG_VERSION"),
            self.adapter_name,
            self.precision
        )
    }
}

//! Benchmarking a language model the way vLLM's `benchmark_latency` and llama-bench do: seeded
//! random prompts, a prefill (time to first token), then one decode step per generated token
//! (time per output token), greedy. Each phase is placed on the roofline: decode's bytes read
//! per step (weights once, whatever the batch, plus the KV cache so far) against the measured
//! memory bandwidth, prefill's FLOP/s against the measured GEMM peak.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::record::{BenchConfig, BenchRecord, Environment, ModelInfo};
use super::stats::{Stats, percentile};
use super::{Event, limits, within_limit};
use crate::backend::{self, DecoderMemory, DecoderOptions, DecoderSession, MemoryStats};
use crate::model::Rng;
use crate::model::llm::{self, DecoderConfig, DecoderWeights};

/// `workshop bench`'s defaults for a decoder (llama-bench's spirit, sized for a CPU).
pub const DEFAULT_PROMPT: usize = 128;
pub const DEFAULT_GENERATE: usize = 64;
pub const DEFAULT_ITERATIONS: usize = 3;
pub const DEFAULT_WARMUP: usize = 1;

/// Mean, median and tail of a set of samples, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub mean_ms: f64,
    pub median_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

impl Spread {
    pub fn of(samples_s: &[f64]) -> Spread {
        let mut sorted = samples_s.to_vec();
        sorted.sort_by(f64::total_cmp);
        let mean = samples_s.iter().sum::<f64>() / samples_s.len().max(1) as f64;
        Spread {
            mean_ms: mean * 1e3,
            median_ms: percentile(&sorted, 50.0) * 1e3,
            p90_ms: percentile(&sorted, 90.0) * 1e3,
            p99_ms: percentile(&sorted, 99.0) * 1e3,
        }
    }
}

/// What a decoder run measured, beside the record's usual fields (whose samples are then the
/// decode steps, so throughput is decode tokens per second over the batch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlmRun {
    pub model_type: String,
    /// Time to first token of each timed iteration: the prefill, the first token's logits and
    /// its choice, seconds.
    pub ttft_s: Vec<f64>,
    /// Each timed iteration's whole generation, seconds.
    pub e2e_s: Vec<f64>,
    /// The mean decode step of each timed iteration (vLLM's TPOT of a request), seconds.
    pub tpot_s: Vec<f64>,
    pub ttft: Spread,
    pub tpot: Spread,
    /// Every decode step of every timed iteration (inter-token latency).
    pub itl: Spread,
    pub e2e: Spread,
    /// Prompt tokens of the whole batch per second of TTFT (median).
    pub prefill_tokens_per_s: f64,
    /// New tokens per second per sequence, and over the batch (median step).
    pub decode_tokens_per_s_per_sequence: f64,
    pub decode_tokens_per_s: f64,
    pub kv_bytes_per_token: u64,
    pub memory: DecoderMemory,
    /// At this batch, the longest context whose KV cache fits beside the weights (at most the
    /// model's positions); at this context, the largest batch (from the memory the backend
    /// reports free).
    pub max_context: Option<usize>,
    pub max_batch: Option<usize>,
    /// Bytes a decode step reads on average (weights once, the KV cache so far), and what
    /// that is per second at the median step.
    pub decode_bytes_per_step: f64,
    pub decode_gbps: f64,
    /// The memory bandwidth `workshop peak` measured (its triad).
    pub bandwidth_gbps: Option<f64>,
    /// The fastest plain read of the run's weights just before the warm-up and just after the
    /// last timed iteration (`read_beside`), where the session has that read: what the decode
    /// is judged against, measured beside it (a shared host's bandwidth moves by half from one
    /// minute to the next).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_gbps: Option<f64>,
    /// FLOPs of one prefill of the whole batch, and GFLOP/s at the median TTFT.
    pub prefill_flops: u64,
    pub prefill_gflops: f64,
    /// The measured GEMM peak at this precision, and where from.
    pub peak_gflops: Option<f64>,
    pub peak_source: String,
    /// Seconds per op kind in the last timed iteration's prefill and in its decode steps
    /// (`--profile`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefill_ops: Vec<(String, f64)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decode_ops: Vec<(String, f64)>,
}

impl LlmRun {
    /// The bandwidth the decode is judged against: the read beside the run where there was
    /// one, else `workshop peak`'s triad.
    pub fn bandwidth_ceiling(&self) -> Option<f64> {
        self.read_gbps.or(self.bandwidth_gbps)
    }

    /// Achieved decode bandwidth as a share of [`LlmRun::bandwidth_ceiling`].
    pub fn bandwidth_share(&self) -> Option<f64> {
        self.bandwidth_ceiling().map(|b| self.decode_gbps / b)
    }

    /// Achieved prefill FLOP/s as a share of the GEMM peak.
    pub fn peak_share(&self) -> Option<f64> {
        self.peak_gflops.map(|p| self.prefill_gflops / p)
    }
}

/// The decoder a run names: a model folder (`--model-dir`) or a built-in config.
pub fn weights_for(cfg: &BenchConfig, model_dir: Option<&Path>) -> Result<DecoderWeights> {
    match model_dir {
        Some(dir) => DecoderWeights::open_folder(dir),
        None => {
            let config = llm::built_in(&cfg.network).with_context(|| {
                format!(
                    "`{}` is not a language model here (see `workshop models`)",
                    cfg.network
                )
            })?;
            Ok(DecoderWeights::seeded(config, cfg.seed))
        }
    }
}

/// Check a decoder run's sizes against the model before anything is loaded.
pub fn validate(cfg: &BenchConfig, model: &DecoderConfig) -> Result<()> {
    let (prompt, generate) = lengths(cfg);
    if let Some(dir) = &cfg.kernels_dir {
        crate::backend::kernel_files::overrides(dir)?;
    }
    if prompt == 0 {
        bail!("--prompt-len must be at least 1 (got 0)");
    }
    if generate < 2 {
        bail!(
            "--gen-len must be at least 2 (got {generate}): the first token comes from the \
             prefill, the time per output token from the steps after it"
        );
    }
    for (name, v) in [("prompt_len", prompt), ("gen_len", generate)] {
        if let Err(why) = within_limit(name, v) {
            bail!("--{}: {why}", name.replace('_', "-"));
        }
    }
    if let Some(rows) = cfg.max_batched_tokens
        && rows < cfg.batch_size
    {
        bail!(
            "--max-batched-tokens ({rows}) must be at least the batch size ({}): a forward pass \
             takes at least one token of every sequence",
            cfg.batch_size
        );
    }
    check_context(model, prompt, generate)
}

/// A prompt and its new tokens fit in the model's positions.
pub fn check_context(model: &DecoderConfig, prompt: usize, generate: usize) -> Result<()> {
    let context = prompt + generate;
    if context > model.max_position_embeddings {
        bail!(
            "a prompt of {prompt} and {generate} new tokens make a context of {context}, longer \
             than {}'s limit of {} positions",
            model.name,
            model.max_position_embeddings
        );
    }
    Ok(())
}

/// (prompt tokens, generated tokens) of a decoder run.
pub fn lengths(cfg: &BenchConfig) -> (usize, usize) {
    (
        cfg.prompt_len.unwrap_or(DEFAULT_PROMPT),
        cfg.gen_len.unwrap_or(DEFAULT_GENERATE),
    )
}

/// Passes of [`read_beside`] each time.
const READ_PASSES: usize = 3;

/// GB/s of each plain read pass over the weights a decode step streams through
/// (`DecoderSession::read_weights`: a sum of their bytes, in their own pages, on the run's
/// threads), or none where the session has no such read (every GPU backend for now). The
/// decode's roofline is those bytes read as fast as they can be, and on a shared host that
/// moves: on a 2-vCPU Zen 5 VM `workshop peak`'s triad read 50 GB/s one minute and 80 the
/// next, and decode steps ran at "150%" of the older figure. The weights rather than an array
/// of their own: the same bytes in the same pages (huge ones, see `Lines`) as the decode
/// reads, from the same level of the caches where they fit there, and no memory beyond the
/// run's. An array of 8× the last-level cache read beside each run before (2 GiB on an
/// Emerald Rapids VM that reports the socket's 260 MiB, twice the weights of Qwen2.5-0.5B in
/// BF16 and three times the process's memory), and Llama 3.2 1B's FP32 decode steps read
/// 107–137% of its rate in nine runs.
fn read_beside(session: &mut dyn backend::DecoderSession) -> Result<Vec<f64>> {
    let Some((bytes, times)) = session.read_weights(READ_PASSES)? else {
        return Ok(Vec::new());
    };
    Ok(times
        .into_iter()
        .map(|s| bytes as f64 / s.max(1e-9) / 1e9)
        .collect())
}

/// The most probable token of each row of `logits` (rows of `vocab`).
pub fn greedy(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks(vocab.max(1)).map(llm::text::argmax).collect()
}

/// Run a decoder benchmark as configured.
pub fn run(
    cfg: &BenchConfig,
    model_dir: Option<&Path>,
    on_event: &mut dyn FnMut(Event),
) -> Result<BenchRecord> {
    super::validate(cfg)?;
    let start = Instant::now();
    let weights = weights_for(cfg, model_dir)?;
    let model = weights.config.clone();
    validate(cfg, &model)?;
    let (prompt, generate) = lengths(cfg);
    let batch = cfg.batch_size;
    let backend = backend::open(cfg.backend)?;
    let device = backend
        .devices()
        .into_iter()
        .nth(cfg.device)
        .with_context(|| format!("there is no {} device {}", cfg.backend, cfg.device))?;
    let opt = DecoderOptions {
        precision: cfg.precision,
        threads: cfg.threads,
        batch,
        context: prompt + generate,
        profile: cfg.profile,
        replay: cfg.exec_options().replay,
        kernels_dir: cfg.kernels_dir.clone(),
        max_rows: cfg.max_batched_tokens,
    };
    let mut session = backend.prepare_decoder(cfg.device, &weights, &opt)?;
    drop(weights);
    let prepare_s = start.elapsed().as_secs_f64();
    on_event(Event::Preparing {
        params: model.params(),
        weights: cfg.weights.clone(),
        seconds: prepare_s,
    });
    let mut rng = Rng::new(cfg.seed.wrapping_add(1));
    let prompts: Vec<u32> = (0..batch * prompt)
        .map(|_| rng.below(model.vocab_size) as u32)
        .collect();
    let labels: Vec<usize> = (0..batch).map(|_| rng.below(model.vocab_size)).collect();

    let mut warmup_s = Vec::new();
    let mut timed = Vec::new();
    let mut reads = Vec::new();
    let mut reader = Some(super::telemetry::reader_for(
        cfg.backend,
        cfg.device,
        &device,
    ));
    let mut sampler = None;
    for index in 0..cfg.warmup + cfg.iterations {
        // Before the warm-up: the timed generations then start from the caches a generation
        // leaves, not from the read's.
        if index == 0 {
            reads.extend(read_beside(session.as_mut())?);
        }
        if index == cfg.warmup
            && let Some(r) = reader.take()
        {
            sampler =
                Some(r.map(|r| super::telemetry::Sampler::start(r, super::telemetry::PERIOD)));
        }
        let g = generation(session.as_mut(), &prompts, generate, model.vocab_size)?;
        let warm = index < cfg.warmup;
        on_event(Event::Generation {
            index: if warm { index } else { index - cfg.warmup },
            warmup: warm,
            ttft_s: g.ttft_s,
            tpot_s: g.tpot_s(),
        });
        if warm {
            warmup_s.push(g.e2e_s);
        } else {
            timed.push(g);
        }
    }
    let telemetry = sampler.map(|s| s.and_then(super::telemetry::Sampler::finish));
    reads.extend(read_beside(session.as_mut())?);
    let memory = session.memory();
    let kernel_version = session.kernel_version();
    drop(session);

    let itl: Vec<f64> = timed.iter().flat_map(|g| g.steps_s.clone()).collect();
    let ttft_s: Vec<f64> = timed.iter().map(|g| g.ttft_s).collect();
    let e2e_s: Vec<f64> = timed.iter().map(|g| g.e2e_s).collect();
    let tpot_s: Vec<f64> = timed.iter().map(Generation::tpot_s).collect();
    // The decode steps at positions prompt .. prompt + generate − 2.
    let steps = (prompt..prompt + generate - 1).len().max(1) as f64;
    let decode_flops = (prompt..prompt + generate - 1)
        .map(|p| model.decode_flops(p))
        .sum::<u64>() as f64
        / steps;
    let kv_read = (prompt..prompt + generate - 1)
        .map(|p| model.kv_bytes_read(p, cfg.precision) as f64)
        .sum::<f64>()
        / steps
        * batch as f64;
    let stats = Stats::from_samples(&itl, batch, (decode_flops * batch as f64) as u64)
        .context("no decode steps were timed")?;
    let limits = limits(cfg, &device)?;
    let ttft = Spread::of(&ttft_s);
    let itl_spread = Spread::of(&itl);
    let decode_bytes_per_step = model.weight_bytes_per_step(cfg.precision) as f64 + kv_read;
    let prefill_flops = model.prefill_flops(prompt) * batch as u64;
    let per_token = model.kv_bytes_per_token(cfg.precision).max(1);
    let room = backend
        .memory_budget(cfg.device)
        .map(|free| (free + memory.kv_cache).saturating_sub(memory.weights + memory.scratch));
    let last_iteration = timed.last().context("no timed iterations")?;
    let loss = last_iteration.loss(&labels);
    let run = LlmRun {
        model_type: model.model_type.clone(),
        ttft,
        tpot: Spread::of(&tpot_s),
        itl: itl_spread,
        e2e: Spread::of(&e2e_s),
        prefill_tokens_per_s: (batch * prompt) as f64 / (ttft.median_ms / 1e3),
        decode_tokens_per_s_per_sequence: 1e3 / itl_spread.median_ms,
        decode_tokens_per_s: batch as f64 * 1e3 / itl_spread.median_ms,
        kv_bytes_per_token: per_token,
        memory,
        max_context: room
            .map(|r| ((r / per_token / batch as u64) as usize).min(model.max_position_embeddings)),
        max_batch: room.map(|r| (r / per_token / (prompt + generate) as u64) as usize),
        decode_bytes_per_step,
        decode_gbps: decode_bytes_per_step / (itl_spread.median_ms / 1e3) / 1e9,
        bandwidth_gbps: limits.bandwidth_gbps,
        read_gbps: reads.into_iter().reduce(f64::max),
        prefill_flops,
        prefill_gflops: prefill_flops as f64 / (ttft.median_ms / 1e3) / 1e9,
        peak_gflops: limits.peak_gflops,
        peak_source: limits.peak_source,
        prefill_ops: last_iteration.prefill_ops.clone(),
        decode_ops: last_iteration.decode_ops.clone(),
        ttft_s,
        e2e_s,
        tpot_s,
    };
    let config = BenchConfig {
        network: model.name.clone(),
        prompt_len: Some(prompt),
        gen_len: Some(generate),
        ..cfg.clone()
    };
    let info = ModelInfo {
        params: model.params(),
        macs_per_image: model.matmul_params(),
        flops_per_image: decode_flops as u64,
    };
    let memory = MemoryStats {
        weights: memory.weights,
        peak_activations: memory.kv_cache + memory.scratch,
        peak: memory.weights + memory.kv_cache + memory.scratch,
    };
    let environment = Environment {
        telemetry,
        ..super::environment(device, kernel_version)
    };
    Ok(BenchRecord {
        prepare_s: Some(prepare_s),
        warmup_s,
        loss,
        output: timed.pop().map(|g| g.last_logits).unwrap_or_default(),
        llm: Some(run),
        ..BenchRecord::new(config, environment, info, itl, stats, memory)
    })
}

/// One timed generation: prefill, then greedy decode steps.
struct Generation {
    ttft_s: f64,
    steps_s: Vec<f64>,
    e2e_s: f64,
    /// The prefill's logits of each sequence's last prompt token.
    first_logits: Vec<f32>,
    last_logits: Vec<f32>,
    prefill_ops: Vec<(String, f64)>,
    decode_ops: Vec<(String, f64)>,
}

impl Generation {
    /// The mean decode step (vLLM's TPOT of a request).
    fn tpot_s(&self) -> f64 {
        self.steps_s.iter().sum::<f64>() / self.steps_s.len().max(1) as f64
    }

    /// Cross-entropy of the first token's logits against seeded random labels: near
    /// ln(vocabulary) for random weights, like the CNNs' loss.
    fn loss(&self, labels: &[usize]) -> f64 {
        let vocab = self.first_logits.len() / labels.len().max(1);
        let t = crate::model::Tensor::new(vec![labels.len(), vocab], self.first_logits.clone());
        crate::model::reference::cross_entropy(&t, labels)
    }
}

fn generation(
    s: &mut dyn DecoderSession,
    prompts: &[u32],
    generate: usize,
    vocab: usize,
) -> Result<Generation> {
    let before = s.op_times();
    let start = Instant::now();
    s.prefill(prompts, false)?;
    s.sync()?;
    let first_logits = s.logits()?;
    let mut next = greedy(&first_logits, vocab);
    let ttft_s = start.elapsed().as_secs_f64();
    let after_prefill = s.op_times();
    let mut steps_s = Vec::with_capacity(generate);
    let mut logits = Vec::new();
    for _ in 1..generate {
        let t = Instant::now();
        s.decode(&next)?;
        s.sync()?;
        logits = s.logits()?;
        next = greedy(&logits, vocab);
        steps_s.push(t.elapsed().as_secs_f64());
    }
    let e2e_s = start.elapsed().as_secs_f64();
    Ok(Generation {
        ttft_s,
        steps_s,
        e2e_s,
        first_logits,
        last_logits: logits,
        prefill_ops: difference(&after_prefill, &before),
        decode_ops: difference(&s.op_times(), &after_prefill),
    })
}

/// Per-op seconds of `now` minus those of `then` (cumulative counters).
fn difference(now: &[(String, f64)], then: &[(String, f64)]) -> Vec<(String, f64)> {
    now.iter()
        .map(|(k, v)| {
            let was = then.iter().find(|(n, _)| n == k).map_or(0.0, |(_, t)| *t);
            (k.clone(), v - was)
        })
        .collect()
}

/// What a generation took: the time to the first token and each step after it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timing {
    pub ttft_s: f64,
    pub steps_s: Vec<f64>,
}

/// Generate up to `max_tokens` after `prompt` (one sequence), handing each new token to
/// `on_token` as it comes; stops early at one of the model's end-of-sequence tokens.
pub fn generate(
    s: &mut dyn DecoderSession,
    model: &DecoderConfig,
    prompt: &[u32],
    max_tokens: usize,
    sampling: llm::text::Sampling,
    seed: u64,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Timing> {
    let mut rng = Rng::new(seed.wrapping_add(2));
    let start = Instant::now();
    s.prefill(prompt, false)?;
    s.sync()?;
    let mut token = sampling.pick(&s.logits()?, &mut rng);
    let mut timing = Timing {
        ttft_s: start.elapsed().as_secs_f64(),
        steps_s: Vec::new(),
    };
    for n in 1..=max_tokens {
        on_token(token)?;
        if n == max_tokens || model.eos_token_ids.contains(&token) {
            break;
        }
        let t = Instant::now();
        s.decode(&[token])?;
        s.sync()?;
        token = sampling.pick(&s.logits()?, &mut rng);
        timing.steps_s.push(t.elapsed().as_secs_f64());
    }
    Ok(timing)
}

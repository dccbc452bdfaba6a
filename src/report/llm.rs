//! What a language-model benchmark shows: its configuration, the summary of prefill and decode
//! (vLLM's latency names: TTFT, TPOT, ITL, end to end) with each phase on the roofline, a
//! sweep's table (llama-bench's columns), and the decoders of `workshop models`.

use comfy_table::{Cell, CellAlignment};

use super::new_table;

use crate::bench::llm::{LlmRun, Spread, lengths};
use crate::bench::record::{BenchConfig, BenchRecord};
use crate::model::llm::DecoderConfig;
use crate::units::{group_digits, human_bytes};

pub fn config_echo(cfg: &BenchConfig, model: &str, emulated: bool) -> String {
    let (prompt, generate) = lengths(cfg);
    format!(
        "Model:       {model}\nBatch:       {}\nTokens:      {prompt} prompt + {generate} generated (greedy)\nIterations:  {} (after {} warm-up)\nPrecision:   {}\nBackend:     {}\nWeights:     {}",
        match cfg.batch_size {
            1 => "1 sequence".to_string(),
            n => format!("{n} sequences"),
        },
        cfg.iterations,
        cfg.warmup,
        cfg.precision.name().to_uppercase(),
        super::bench::backend_line(cfg, emulated),
        cfg.weights
    )
}

fn spread(s: &Spread) -> String {
    format!(
        "mean {:.2} ms, median {:.2} ms, p90 {:.2} ms, p99 {:.2} ms",
        s.mean_ms, s.median_ms, s.p90_ms, s.p99_ms
    )
}

/// ` = N% of the CEILING`; with no ceiling, that none was measured; past it (by more than the
/// noise of two measurements), that the measurement was no ceiling, and `why`: a short probe
/// on a large GPU, say (on an H200 a 512³ BF16 GEMM probe ran at 1.2% of the tensor cores'
/// rate), or a decode whose own reads outran the plain read timed beside it.
fn share(part: Option<f64>, ceiling: &str, why: &str) -> String {
    match part {
        None => " (no measured peak)".into(),
        Some(p) if p > 1.1 => format!(
            ", {:.0}% of the {ceiling}: that measurement is no ceiling ({why})",
            p * 100.0
        ),
        Some(p) => format!(" = {:.0}% of the {ceiling}", p * 100.0),
    }
}

/// Why a GEMM peak can be no ceiling: a short probe, or a small size, of `workshop peak`.
const PEAK_AGAIN: &str = "`workshop peak` measures one at this precision";

/// Why a triad can be no ceiling: arrays small enough for the caches.
const TRIAD_AGAIN: &str = "`workshop peak` measures one over arrays larger than the caches";

/// Why the read beside a run can be no ceiling: the decode's own reads ran faster. It reads
/// the decode's own weights, lines asked for ahead as the kernels do (`cpu::read_sum`), and on
/// a 2-vCPU Emerald Rapids Xeon the decode steps read 87–94% of it (Llama 3.2 1B FP32,
/// Qwen2.5-0.5B FP32 and BF16); but on a shared host the memory's speed moves from minute to
/// minute, and a read before and after the run can both fall in a slow one. Running
/// `workshop peak` changes nothing there.
const READ_OUTRUN: &str = "the decode's own reads ran faster than the plain read's; run again \
                          for a steadier figure";

/// The summary of one run.
pub fn summary(r: &BenchRecord, run: &LlmRun) -> String {
    let c = &r.config;
    let (prompt, generate) = lengths(c);
    let line = "=".repeat(56);
    let bandwidth = match (run.read_gbps, run.bandwidth_gbps) {
        (Some(read), triad) => {
            let triad = triad.map_or(String::new(), |t| {
                format!("; `workshop peak`'s triad: {t:.1} GB/s")
            });
            let ceiling = format!("{read:.1} GB/s a plain read of the weights reached beside it");
            share(run.bandwidth_share(), &ceiling, READ_OUTRUN) + &triad
        }
        (None, triad) => share(
            run.bandwidth_share(),
            &format!("{:.1} GB/s measured", triad.unwrap_or(0.0)),
            TRIAD_AGAIN,
        ),
    };
    let peak = share(
        run.peak_share(),
        &format!("{:.1} GFLOP/s GEMM peak", run.peak_gflops.unwrap_or(0.0)),
        PEAK_AGAIN,
    );
    let fits = match (run.max_context, run.max_batch) {
        (Some(ctx), Some(b)) => format!(
            "\n                fits: a context of {} at batch {}, or a batch of {} at {} tokens",
            group_digits(ctx as u64),
            c.batch_size,
            group_digits(b as u64),
            prompt + generate
        ),
        _ => String::new(),
    };
    let m = &run.memory;
    let ops = |name: &str, ops: &[(String, f64)]| {
        let total: f64 = ops.iter().map(|(_, s)| s).sum();
        if total <= 0.0 {
            return String::new();
        }
        let mut parts: Vec<&(String, f64)> = ops.iter().collect();
        parts.sort_by(|a, b| b.1.total_cmp(&a.1));
        let list: Vec<String> = parts
            .iter()
            .filter(|(_, s)| *s / total >= 0.005)
            .map(|(n, s)| format!("{n} {:.0}%", s / total * 100.0))
            .collect();
        format!("\n{name:<16}{}", list.join(", "))
    };
    format!(
        "{line}\nPerformance summary: {} {} batch {} on {} ({})\n{line}\n\
         TTFT            {} (prefill of {prompt} tokens)\n\
         Prefill         {:.1} tokens/s, {:.1} GFLOP/s{peak}\n\
         TPOT            {}\n\
         ITL             {} over {} steps\n\
         Decode          {:.1} tokens/s per sequence, {:.1} tokens/s in all\n\
         Bandwidth       {:.1} GB/s in decode{bandwidth} ({} read a step)\n\
         End to end      {} for {generate} tokens\n\
         KV cache        {} per token, {} for {} × {} positions{fits}\n\
         Memory          {} weights, {} KV cache, {} activations{}{}\n{}{line}",
        c.network,
        c.precision.name().to_uppercase(),
        c.batch_size,
        r.environment.device.name,
        c.backend,
        spread(&run.ttft),
        run.prefill_tokens_per_s,
        run.prefill_gflops,
        spread(&run.tpot),
        spread(&run.itl),
        r.samples_s.len(),
        run.decode_tokens_per_s_per_sequence,
        run.decode_tokens_per_s,
        run.decode_gbps,
        human_bytes(run.decode_bytes_per_step as u64),
        spread(&run.e2e),
        human_bytes(run.kv_bytes_per_token),
        human_bytes(m.kv_cache),
        c.batch_size,
        prompt + generate,
        human_bytes(m.weights),
        human_bytes(m.kv_cache),
        human_bytes(m.scratch),
        ops("Prefill time", &run.prefill_ops),
        ops("Decode time", &run.decode_ops),
        super::bench::machine_lines(r, "tokens", 16),
    )
}

/// One row per run of a sweep, llama-bench's way: prompt processing and generation side by side.
pub fn sweep_table(records: &[BenchRecord]) -> String {
    let mut t = new_table();
    t.set_header([
        "model",
        "prec",
        "batch",
        "prompt",
        "gen",
        "TTFT ms",
        "prefill tok/s",
        "TPOT ms",
        "decode tok/s",
        "GB/s",
        "% bw",
    ]);
    for r in records {
        let Some(run) = &r.llm else { continue };
        let c = &r.config;
        let (prompt, generate) = lengths(c);
        let row = [
            c.network.clone(),
            c.precision.name().into(),
            c.batch_size.to_string(),
            prompt.to_string(),
            generate.to_string(),
            format!("{:.1}", run.ttft.median_ms),
            format!("{:.1}", run.prefill_tokens_per_s),
            format!("{:.2}", run.tpot.median_ms),
            format!("{:.1}", run.decode_tokens_per_s),
            format!("{:.1}", run.decode_gbps),
            run.bandwidth_share()
                .map_or("-".into(), |s| format!("{:.0}", s * 100.0)),
        ];
        t.add_row(row.into_iter().enumerate().map(|(i, v)| {
            let cell = Cell::new(v);
            if i >= 2 {
                cell.set_alignment(CellAlignment::Right)
            } else {
                cell
            }
        }));
    }
    t.to_string()
}

/// The built-in decoders: parameters, weights, the work of a token, the KV cache a token holds.
/// One language model of `workshop models --json` (after the image networks' rows).
#[derive(Debug, Clone, serde::Serialize)]
pub struct DecoderRow {
    pub network: String,
    /// `language_model`, which tells these rows from the image networks'.
    pub kind: &'static str,
    pub params: u64,
    /// FLOPs of a decode step of one sequence at position 0.
    pub flops_per_token: u64,
    pub weights_bytes_bf16: u64,
    pub kv_bytes_per_token_bf16: u64,
    /// Positions the model takes (max_position_embeddings).
    pub context: usize,
    /// The Hugging Face repository its sizes come from.
    pub source: String,
}

pub fn decoder_rows(models: &[(DecoderConfig, &str)]) -> Vec<DecoderRow> {
    let bf16 = crate::model::Precision::Bf16;
    models
        .iter()
        .map(|(m, source)| DecoderRow {
            network: m.name.clone(),
            kind: "language_model",
            params: m.params(),
            flops_per_token: m.decode_flops(0),
            weights_bytes_bf16: m.params() * 2,
            kv_bytes_per_token_bf16: m.kv_bytes_per_token(bf16),
            context: m.max_position_embeddings,
            source: source.to_string(),
        })
        .collect()
}

pub fn models_table(models: &[(DecoderConfig, &str)]) -> String {
    let mut t = new_table();
    t.set_header([
        "language model",
        "params",
        "BF16 weights",
        "GFLOPs/token",
        "KV/token (BF16)",
        "context",
        "from",
    ]);
    for (m, source) in models {
        let bf16 = crate::model::Precision::Bf16;
        t.add_row([
            Cell::new(&m.name),
            Cell::new(format!("{:.2} B", m.params() as f64 / 1e9))
                .set_alignment(CellAlignment::Right),
            Cell::new(human_bytes(m.params() * 2)).set_alignment(CellAlignment::Right),
            Cell::new(format!("{:.2}", m.decode_flops(0) as f64 / 1e9))
                .set_alignment(CellAlignment::Right),
            Cell::new(human_bytes(m.kv_bytes_per_token(bf16))).set_alignment(CellAlignment::Right),
            Cell::new(group_digits(m.max_position_embeddings as u64))
                .set_alignment(CellAlignment::Right),
            Cell::new(*source),
        ]);
    }
    t.to_string()
}

/// The line after a generation: how many tokens, how fast.
pub fn generation_line(
    model: &str,
    prompt: usize,
    generated: usize,
    t: &crate::bench::llm::Timing,
) -> String {
    let decode: f64 = t.steps_s.iter().sum();
    let rate = match t.steps_s.len() {
        0 => String::new(),
        n => format!(", then {:.1} tokens/s", n as f64 / decode),
    };
    format!(
        "{model}: {prompt} prompt tokens, {generated} generated; first token after {:.1} ms{rate}",
        t.ttft_s * 1e3
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A share within the noise reads as one; past it, the line says the measurement was no
    /// ceiling and why, in the words of the measurement it names (the read beside a decode is
    /// not remeasured by `workshop peak`); none measured says so.
    #[test]
    fn shares_say_what_their_ceiling_was() {
        assert_eq!(
            share(Some(0.5), "12 GB/s", READ_OUTRUN),
            " = 50% of the 12 GB/s"
        );
        assert_eq!(
            share(Some(1.08), "12 GB/s", READ_OUTRUN),
            " = 108% of the 12 GB/s"
        );
        let past = share(
            Some(1.24),
            "12 GB/s a plain read of the weights reached beside it",
            READ_OUTRUN,
        );
        assert!(past.starts_with(", 124% of the 12 GB/s"), "{past}");
        assert!(
            past.contains("no ceiling (the decode's own reads ran faster"),
            "{past}"
        );
        assert!(!past.contains("workshop peak"), "{past}");
        let gemm = share(Some(3.0), "1 GFLOP/s GEMM peak", PEAK_AGAIN);
        assert!(
            gemm.contains("`workshop peak` measures one at this precision"),
            "{gemm}"
        );
        assert_eq!(share(None, "x", PEAK_AGAIN), " (no measured peak)");
    }
}

//! `llm` steps: a language model's prefill and decode, once or over a sweep of batch sizes
//! or prompt lengths.

use anyhow::{Result, bail};

use super::{StepContext, StepOutput, bench_with_progress, keep_record};
use crate::bench::llm::{self, LlmRun};
use crate::bench::record::BenchRecord;
use crate::course::metrics::Recorded;
use crate::course::schema::SweepParam;
use crate::course::state::ResultTable;
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let spec = ctx.bench_spec()?;
    let resolved = spec.resolved(ctx.ws.state.backend, ctx.host_sized);
    let mut cfg = ctx.bench_config(spec);
    cfg.batch_size = resolved.batch_size.unwrap_or(1);
    cfg.iterations = resolved.iterations.unwrap_or(llm::DEFAULT_ITERATIONS);
    cfg.warmup = resolved.warmup.unwrap_or(llm::DEFAULT_WARMUP);
    cfg.prompt_len = Some(resolved.prompt_len.unwrap_or(llm::DEFAULT_PROMPT));
    cfg.gen_len = Some(resolved.gen_len.unwrap_or(llm::DEFAULT_GENERATE));
    let Some(sweep) = ctx.step.sweep.as_ref().map(|s| s.get_ref()) else {
        ui.show(Show::Config(&cfg));
        let r = bench_with_progress(&cfg, ui)?;
        ui.show(Show::Summary(&r));
        keep_record(ctx, &r)?;
        out.metrics = metrics(&r)?;
        out.note_run(&r);
        return Ok(());
    };
    let mut runs: Vec<BenchRecord> = Vec::new();
    for &v in sweep.values_for(ctx.host_sized) {
        let mut c = cfg.clone();
        match sweep.param {
            SweepParam::BatchSize => c.batch_size = v,
            SweepParam::PromptLen => c.prompt_len = Some(v),
            SweepParam::InputSize => bail!("an `llm` step sweeps batch_size or prompt_len"),
        }
        ui.show(Show::Config(&c));
        let r = bench_with_progress(&c, ui)?;
        out.note_run(&r);
        runs.push(r);
    }
    let mut rows = Vec::new();
    for r in &runs {
        let run = of(r)?;
        let c = &r.config;
        let value = match sweep.param {
            SweepParam::PromptLen => llm::lengths(c).0,
            _ => c.batch_size,
        };
        rows.push(vec![
            value.to_string(),
            format!("{:.1}", run.ttft.median_ms),
            format!("{:.2}", run.tpot.median_ms),
            format!("{:.1}", run.decode_tokens_per_s),
            format!("{:.1}", run.decode_gbps),
            format!("{:.2}", run.memory.kv_cache as f64 / (1024.0 * 1024.0)),
        ]);
    }
    let t = ResultTable {
        header: [
            sweep.param.label(),
            "TTFT ms",
            "TPOT ms",
            "decode tok/s",
            "decode GB/s",
            "KV MiB",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    };
    ui.show(Show::Table(&t));
    out.table = Some(t);
    let (Some(first), Some(last)) = (runs.first(), runs.last()) else {
        bail!("the sweep has no values");
    };
    out.metrics = metrics(last)?;
    let (a, b) = (of(first)?, of(last)?);
    out.metrics
        .set("scaling", b.decode_tokens_per_s / a.decode_tokens_per_s);
    out.metrics
        .set("tpot_growth", b.tpot.median_ms / a.tpot.median_ms);
    out.metrics
        .set("ttft_growth", b.ttft.median_ms / a.ttft.median_ms);
    let noisiest = runs.iter().map(|r| r.stats.cv).fold(0.0, f64::max);
    out.metrics.set("cv", noisiest);
    keep_record(ctx, last)?;
    Ok(())
}

fn of(r: &BenchRecord) -> Result<&LlmRun> {
    r.llm
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("`{}` is not a language model", r.config.network))
}

/// The metrics of one language-model run.
fn metrics(r: &BenchRecord) -> Result<Recorded> {
    let run = of(r)?;
    let mut m = Recorded::default();
    m.set("ttft_ms", run.ttft.median_ms);
    m.set("tpot_ms", run.tpot.median_ms);
    m.set("prefill_tokens_per_s", run.prefill_tokens_per_s);
    m.set("decode_tokens_per_s", run.decode_tokens_per_s);
    m.set("decode_gbps", run.decode_gbps);
    m.set("prefill_gflops", run.prefill_gflops);
    if let Some(share) = run.bandwidth_share() {
        m.set("bandwidth_pct", share * 100.0);
    }
    if let Some(peak) = run.peak_gflops {
        m.set("peak_pct", run.prefill_gflops / peak * 100.0);
        m.set("decode_peak_pct", r.stats.gflops / peak * 100.0);
    }
    m.set("kv_bytes_per_token", run.kv_bytes_per_token as f64);
    m.set(
        "kv_cache_mib",
        run.memory.kv_cache as f64 / (1024.0 * 1024.0),
    );
    m.set("cv", r.stats.cv);
    super::machine_metrics(r, &mut m);
    Ok(m)
}

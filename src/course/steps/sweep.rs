//! `sweep` steps: one benchmark per value of a parameter (batch size, input size), as a table,
//! with each run's share of the measured GEMM peak, the kernel variants max-autotune timed,
//! and published times (a paper's table) next to the student's where the step gives them.

use anyhow::{Context as _, Result};

use super::{StepContext, StepOutput, bench_with_progress};
use crate::bench::record::BenchRecord;
use crate::course::schema::{SweepParam, SweepSpec};
use crate::course::state::ResultTable;
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let base = ctx.bench_spec()?;
    let sweep = (ctx.step.sweep.as_ref())
        .context("a sweep step needs a sweep section")?
        .get_ref();
    let values = sweep.values_for(ctx.host_sized);
    let mut runs = Vec::new();
    let mut peak = None;
    for &v in values {
        let mut cfg = ctx.bench_config(base);
        match sweep.param {
            SweepParam::BatchSize => cfg.batch_size = v,
            SweepParam::InputSize => cfg.input_size = v,
            SweepParam::PromptLen => anyhow::bail!(
                "a `sweep` step sweeps batch_size or input_size; prompt_len is for `llm` steps"
            ),
        }
        let r = bench_with_progress(&cfg, ui)?;
        out.note_run(&r);
        if peak.is_none() {
            // The cached GEMM peak (exercises 04 and 09 measure it), else a short probe now.
            peak = crate::bench::limits(&cfg, &r.environment.device)?.peak_gflops;
        }
        runs.push((v, r));
    }
    let t = table(sweep, &runs, peak);
    ui.show(Show::Table(&t));
    out.table = Some(t);
    record_metrics(sweep, &runs, peak, out);
    Ok(())
}

/// The kernel variants max-autotune timed for the network's one tunable layer shape, with
/// their best times (ms): a layer chain's direct and Winograd kernels, say. Empty for a network
/// with several shapes (its choices are in the run's record) or an uncompiled run.
fn variants(r: &BenchRecord) -> &[(String, f64)] {
    match r.compile.as_ref().and_then(|c| c.autotune.as_ref()) {
        Some(a) if a.choices.len() == 1 => &a.choices[0].tried,
        _ => &[],
    }
}

/// A run's time at the published table's batch (ms), scaled linearly from its own.
fn at_reference_batch(sweep: &SweepSpec, r: &BenchRecord) -> f64 {
    let batch = r.config.batch_size as f64;
    r.stats.median_s * 1e3 * sweep.reference_batch.map_or(batch, |b| b as f64) / batch
}

/// The published times at value `v`, if the table has it.
fn published(sweep: &SweepSpec, v: usize) -> Option<Vec<f64>> {
    let i = sweep.values.iter().position(|&x| x == v)?;
    Some(sweep.reference.iter().map(|r| r.ms[i]).collect())
}

fn table(sweep: &SweepSpec, runs: &[(usize, BenchRecord)], peak: Option<f64>) -> ResultTable {
    // Next to a published table, the columns it does not have make way for its rows.
    let published_too = !sweep.reference.is_empty();
    let mut header: Vec<String> = [
        sweep.param.label(),
        "median ms",
        "p99 ms",
        "images/s",
        "GFLOP/s",
        "% of peak",
        "CV %",
        "peak MiB",
    ]
    .iter()
    .filter(|h| !published_too || !matches!(**h, "images/s" | "peak MiB"))
    .map(|h| h.to_string())
    .collect();
    let names: Vec<String> = (runs.iter())
        .flat_map(|(_, r)| variants(r).iter().map(|t| t.0.clone()))
        .fold(Vec::new(), |mut all, n| {
            if !all.contains(&n) {
                all.push(n);
            }
            all
        });
    header.extend(names.iter().map(|n| format!("{n} ms")));
    let scaled = (runs.first()).and_then(|(_, r)| {
        let b = sweep.reference_batch?;
        (b != r.config.batch_size).then_some((r.config.batch_size, b))
    });
    if let Some(base) = sweep.reference.first() {
        if let Some((from, to)) = scaled {
            header.push(format!("ms at batch {to} (×{to}/{from})"));
        }
        header.push(format!("× {}", base.label));
        header.extend(sweep.reference.iter().map(|r| format!("{} ms", r.label)));
    }
    let rows = (runs.iter())
        .map(|(v, r)| {
            let s = &r.stats;
            let mut row = vec![
                v.to_string(),
                format!("{:.2}", s.median_s * 1e3),
                format!("{:.2}", s.p99_s * 1e3),
            ];
            if !published_too {
                row.push(format!("{:.1}", s.throughput_median));
            }
            row.extend([
                format!("{:.1}", s.gflops),
                peak.map_or("–".into(), |p| format!("{:.0}", s.gflops / p * 100.0)),
                format!("{:.1}", s.cv * 100.0),
            ]);
            if !published_too {
                row.push(format!("{:.0}", r.memory.peak as f64 / (1024.0 * 1024.0)));
            }
            let tried = variants(r);
            row.extend(names.iter().map(|n| {
                (tried.iter().find(|t| &t.0 == n)).map_or("–".into(), |t| format!("{:.2}", t.1))
            }));
            if !sweep.reference.is_empty() {
                let mine = at_reference_batch(sweep, r);
                if scaled.is_some() {
                    row.push(format!("{mine:.2}"));
                }
                match published(sweep, *v) {
                    Some(ms) => {
                        row.push(format!("{:.2}", mine / ms[0]));
                        row.push(ms[0].to_string());
                        row.extend(ms[1..].iter().map(|m| format!("{m} ({:.2}×)", m / ms[0])));
                    }
                    None => row.extend(vec!["–".into(); sweep.reference.len() + 1]),
                }
            }
            row
        })
        .collect();
    ResultTable { header, rows }
}

fn record_metrics(
    sweep: &SweepSpec,
    runs: &[(usize, BenchRecord)],
    peak: Option<f64>,
    out: &mut StepOutput,
) {
    let m = &mut out.metrics;
    let best = (runs.iter())
        .max_by(|a, b| (a.1.stats.throughput_median).total_cmp(&b.1.stats.throughput_median));
    if let Some((v, r)) = best {
        m.set("best_throughput", r.stats.throughput_median);
        m.set("best_value", *v as f64);
    }
    let gflops = runs.iter().map(|(_, r)| r.stats.gflops);
    m.set("best_gflops", gflops.fold(0.0, f64::max));
    let cv = runs.iter().map(|(_, r)| r.stats.cv);
    m.set("cv", cv.fold(0.0, f64::max));
    super::machine_metrics_of(runs.iter().map(|(_, r)| r), m);
    let (Some((_, first)), Some((_, last))) = (runs.first(), runs.last()) else {
        return;
    };
    m.set(
        "scaling",
        last.stats.throughput_median / first.stats.throughput_median,
    );
    if let Some(p) = peak {
        m.set("peak_pct_first", first.stats.gflops / p * 100.0);
        m.set("peak_pct_last", last.stats.gflops / p * 100.0);
    }
    let against: Vec<f64> = (runs.iter())
        .filter_map(|(v, r)| Some(at_reference_batch(sweep, r) / published(sweep, *v)?.first()?))
        .collect();
    if let (Some(f), Some(l)) = (against.first(), against.last()) {
        m.set("vs_reference_first", *f);
        m.set("vs_reference_last", *l);
    }
}

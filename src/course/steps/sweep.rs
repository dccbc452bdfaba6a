//! `sweep` steps: one benchmark per value of a parameter (batch size, input size), as a table.

use anyhow::{Context as _, Result};

use super::{StepContext, StepOutput, bench_with_progress};
use crate::course::schema::SweepParam;
use crate::course::state::ResultTable;
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let base = ctx.bench_spec()?;
    let sweep = (ctx.step.sweep.as_ref())
        .context("a sweep step needs a sweep section")?
        .get_ref();
    let values = sweep.values_for(ctx.host_sized);
    let mut rows = Vec::new();
    let mut points = Vec::new();
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
        let s = &r.stats;
        rows.push(vec![
            v.to_string(),
            format!("{:.2}", s.median_s * 1e3),
            format!("{:.1}", s.throughput_median),
            format!("{:.0}", s.us_per_sample),
            format!("{:.1}", s.cv * 100.0),
            format!("{:.0}", r.memory.peak as f64 / (1024.0 * 1024.0)),
        ]);
        points.push((v, s.throughput_median));
    }
    let t = ResultTable {
        header: [
            sweep.param.label(),
            "median ms",
            "images/s",
            "µs/image",
            "CV %",
            "peak MiB",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    };
    ui.show(Show::Table(&t));
    out.table = Some(t);
    let best = (points.iter().copied()).fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    out.metrics.set("best_throughput", best.1);
    out.metrics.set("best_value", best.0 as f64);
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        out.metrics.set("scaling", last.1 / first.1);
    }
    Ok(())
}

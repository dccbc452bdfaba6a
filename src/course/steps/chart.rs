//! `chart` steps: the records of earlier bench or profile steps compared side by side, as
//! `workshop compare` does, and drawn into `charts/`.

use anyhow::{Result, bail};

use super::{StepContext, StepOutput};
use crate::bench::compare::{self, Direction};
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let spec = (ctx.step.chart.as_ref())
        .ok_or_else(|| anyhow::anyhow!("a chart step needs a chart section"))?
        .get_ref();
    // Steps that could not run here (a vendor library or PyTorch this machine lacks) are left
    // out, said so; fewer than two runs left compare nothing, and the chart is unavailable.
    let (ran, skipped): (Vec<&String>, Vec<&String>) =
        (spec.steps.iter()).partition(|s| !ctx.earlier.unavailable.contains_key(s.as_str()));
    for s in &skipped {
        ui.show(Show::Line(format!(
            "  left out: step `{s}` could not run here ({})",
            ctx.earlier.unavailable[s.as_str()]
        )));
    }
    if ran.len() < 2 {
        return Err(super::Unavailable(format!(
            "only {} of the steps it compares ran here",
            ran.len()
        ))
        .into());
    }
    let records = (ran.iter())
        .map(|s| {
            let path = ctx.record_path(s)?;
            if !path.exists() {
                bail!(
                    "step `{s}` has no record yet: run it first (`workshop run {}.{s}`)",
                    ctx.exercise
                );
            }
            Ok((s.to_string(), compare::load(&path)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let c = compare::compare(&records);
    let chart = ctx.own_file("charts", "svg")?;
    ui.show(Show::Comparison {
        comparison: &c,
        chart: &chart,
    });
    out.metrics.set("warnings", c.warnings.len() as f64);
    // The noise behind every ratio: the noisiest run compared.
    let cv = c.rows.iter().map(|r| r.cv).fold(0.0, f64::max);
    out.metrics.set("cv", cv);
    let is = |b: bool| if b { 1.0 } else { 0.0 };
    for p in &c.pairs {
        let s = ran[p.index];
        let v = p.verdict;
        out.metrics.set(format!("{s}.ratio"), p.ratio);
        out.metrics
            .set(format!("{s}.faster"), is(v == Direction::Faster));
        out.metrics
            .set(format!("{s}.slower"), is(v == Direction::Slower));
        out.metrics.set(format!("{s}.unclear"), is(!v.is_clear()));
    }
    Ok(())
}

//! `compare` steps: values derived from earlier steps' metrics (`numerator / denominator`).

use anyhow::{Context as _, Result};

use super::{StepContext, StepOutput};
use crate::course::schema::DeriveFormat;
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let derive: Vec<_> = ctx.step.derive.iter().map(|d| d.get_ref()).collect();
    ctx.earlier
        .require((derive.iter()).flat_map(|d| [d.numerator.as_str(), d.denominator.as_str()]))?;
    for d in derive {
        let get = |r: &str| -> Result<f64> {
            let (s, _) = r.split_once('.').context("STEP.metric")?;
            ctx.earlier.value(r).with_context(|| {
                format!("`{r}` has no value yet: run (or re-run) step `{s}` of this exercise first")
            })
        };
        let v = get(&d.numerator)? / get(&d.denominator)?;
        let shown = match d.format {
            _ if !v.is_finite() => "not defined (division by zero)".to_string(),
            DeriveFormat::Ratio => format!("{v:.2}×"),
            DeriveFormat::Percent => format!("{:.1}%", v * 100.0),
        };
        ui.show(Show::Line(format!(
            "  {:<24} {shown:>10}   ({} / {})",
            d.name, d.numerator, d.denominator
        )));
        out.metrics.set(d.name.clone(), v);
    }
    Ok(())
}

//! `doctor` steps: the machine, as `workshop doctor` shows it, and its fingerprint.

use anyhow::Result;

use super::{StepContext, StepOutput};
use crate::course::ui::{Show, Ui};

pub fn run(_: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let d = crate::doctor::collect();
    ui.show(Show::Doctor(&d));
    out.metrics.set("cores", d.cores.unwrap_or(0) as f64);
    out.metrics.set(
        "memory_gib",
        d.memory_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64,
    );
    out.environment
        .insert("cpu_model".into(), d.cpu_model.clone());
    out.environment.insert("os".into(), d.os.clone());
    Ok(())
}

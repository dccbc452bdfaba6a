//! `peak` steps: the machine's measured limits (`workshop peak`): the GEMM peak, the
//! bandwidth probes where the backend has them, and the compute ceiling above the GEMM.

use anyhow::{Result, bail};

use super::{StepContext, StepOutput};
use crate::bench;
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let state = &ctx.ws.state;
    let spec = (ctx.step.peak.as_ref())
        .map(|p| p.get_ref().resolved(state.backend))
        .unwrap_or_default();
    let size = spec.size.unwrap_or(1024);
    let iterations = spec.iterations.unwrap_or(10);
    let precision = spec.precision.unwrap_or(crate::model::Precision::Fp32);
    let (g, info) = bench::peak::gemm_on(
        state.backend,
        state.device,
        precision,
        state.threads,
        size,
        iterations,
    )?;
    let bw = bench::peak::bandwidth_if_any(
        state.backend,
        state.device,
        spec.array_mib.unwrap_or(256),
        iterations,
        state.threads,
    )?;
    // The ceiling above the GEMM (a CPU's FMA throughput, measured now; a GPU's
    // specification), recorded so expectations can place the GEMM under it.
    let ceiling = info.and_then(|d| bench::peak::theoretical(state.backend, &d, state.threads));
    ui.show(Show::Peak {
        gemm: &g,
        bandwidth: bw.as_deref(),
        ceiling: ceiling.as_ref(),
    });
    if let Some(t) = &ceiling {
        out.metrics.set("ceiling_gflops", t.gflops);
    }
    // The device, for expectations per device (`device = [{ glob = "*H100*", ... }]`).
    if !g.device.is_empty() {
        out.device = g.device.clone();
        out.environment.insert("device".into(), g.device.clone());
    }
    if g.validated < g.iterations {
        bail!(
            "{} of {} GEMM results did not match the reference: the peak does not count",
            g.iterations - g.validated,
            g.iterations
        );
    }
    out.metrics.set("gemm_gflops", g.gflops);
    // Kept for later FLOPs profiles of this device (a failure to keep it is harmless).
    let _ = bench::peak::keep(
        state.backend,
        state.device,
        state.threads,
        &g,
        bw.as_deref().unwrap_or_default(),
    );
    for b in bw.unwrap_or_default() {
        out.metrics.set(format!("{}_gbps", b.kernel), b.median_gbps);
    }
    Ok(())
}

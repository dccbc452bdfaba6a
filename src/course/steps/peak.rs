//! `peak` steps: the machine's measured limits (`workshop peak`): the GEMM peak, the
//! bandwidth probes where the backend has them, and the compute ceiling above the GEMM.

use anyhow::{Result, bail};

use super::{StepContext, StepOutput};
use crate::bench::peak::{self, ProbeSpec};
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let state = &ctx.ws.state;
    let spec = (ctx.step.peak.as_ref())
        .map(|p| p.get_ref().resolved(ctx.host_sized))
        .unwrap_or_default();
    let probe = ProbeSpec {
        backend: state.backend,
        device: state.device,
        precision: spec.precision.unwrap_or(crate::model::Precision::Fp32),
        threads: state.threads,
        size: spec.size,
        iterations: spec.iterations.unwrap_or(10),
        array_mib: spec.array_mib,
    };
    let p = peak::probe(&probe)?;
    ui.show(Show::Peak {
        gemm: &p.gemm,
        bandwidth: p.bandwidth.as_deref(),
        ceiling: p.ceiling.as_ref(),
    });
    // The ceiling above the GEMM (a CPU's FMA throughput, measured now; a GPU's
    // specification), recorded so expectations can place the GEMM under it.
    if let Some(t) = &p.ceiling {
        out.metrics.set("ceiling_gflops", t.gflops);
    }
    // And the GEMM's share of the same chains timed beside it, which the cores' swings on a
    // shared machine do not move the way they move the two apart.
    if let Some(b) = &p.gemm.beside {
        out.metrics.set("ceiling_share_beside", b.share);
    }
    // The device, for expectations per device (`device = [{ glob = "*H100*", ... }]`).
    if !p.gemm.device.is_empty() {
        out.device = p.gemm.device.clone();
        out.environment
            .insert("device".into(), p.gemm.device.clone());
    }
    if let Some(why) = p.refusal() {
        bail!("{why}");
    }
    // Whether other programs, the hypervisor or the device's clocks disturbed the probes:
    // their checks are then inconclusive, as a benchmark's are.
    if let Some(Ok(t)) = &p.gemm.telemetry {
        super::state_metrics(t, &mut out.metrics);
    }
    out.metrics.set("gemm_gflops", p.gemm.gflops);
    // Kept for later FLOPs profiles of this device (a failure to keep it is harmless).
    let _ = p.keep(&probe);
    for b in p.bandwidth.iter().flatten() {
        out.metrics.set(format!("{}_gbps", b.kernel), b.median_gbps);
    }
    Ok(())
}

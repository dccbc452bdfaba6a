//! `bench` steps: one benchmark run, or one run over several devices (`devices`,
//! `cpu_groups`) with its scaling.

use anyhow::Result;

use super::{StepContext, StepOutput, bench_with_progress, keep_record, run_metrics};
use crate::bench::{self, data_parallel::MultiRecord};
use crate::course::metrics::Recorded;
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let spec = ctx.bench_spec()?;
    let cfg = ctx.bench_config(spec);
    ui.show(Show::Config(&cfg));
    let resolved = spec.resolved(cfg.backend, ctx.host_sized);
    let devices = match (resolved.cpu_groups, &resolved.devices) {
        (Some(n), _) => Some(bench::data_parallel::cpu_groups(n)?),
        (None, Some(list)) => Some(bench::data_parallel::parse_devices(list, cfg.backend)?),
        (None, None) => None,
    };
    if let Some(devices) = devices {
        let m = bench::data_parallel::run(&cfg, &devices, None, &mut |s| {
            ui.show(Show::Line(s.to_string()))
        })?;
        ui.show(Show::Multi(&m));
        out.metrics = multi_metrics(&m);
        out.device = m.runs[0].environment.device.name.clone();
        out.environment.insert("device".into(), out.device.clone());
        out.environment
            .insert("devices".into(), m.devices.len().to_string());
        return Ok(());
    }
    let r = bench_with_progress(&cfg, ui)?;
    ui.show(Show::Summary(&r));
    keep_record(ctx, &r)?;
    out.metrics = run_metrics(&r, bench::max_batch_estimate(&cfg));
    out.note_run(&r);
    out.environment
        .insert("cpu_model".into(), r.environment.cpu_model.clone());
    Ok(())
}

/// The metrics of a multi-device run: the global figures and the scaling.
fn multi_metrics(m: &MultiRecord) -> Recorded {
    let g = &m.global;
    let mut out = Recorded::default();
    out.set("throughput", g.throughput_median);
    out.set("throughput_mean", g.throughput);
    out.set("median_ms", g.median_s * 1e3);
    // The noisiest of the runs behind the figures: the global step, each device's own, and
    // the single-device run the scaling is against (one device at CV 45% makes the scaling
    // efficiency noise, however steady the others were).
    let runs = m.runs.iter().chain(&m.single).map(|r| r.stats.cv);
    out.set("cv", runs.fold(g.cv, f64::max));
    out.set("gflops", g.gflops);
    out.set("spread", m.spread);
    out.set("devices", m.devices.len() as f64);
    let peak = m.runs.iter().map(|r| r.memory.peak).max().unwrap_or(0);
    out.set("peak_memory_mib", peak as f64 / (1024.0 * 1024.0));
    if let Some(e) = m.scaling_efficiency {
        out.set("scaling_efficiency", e);
    }
    if let Some(s) = &m.single {
        out.set("single_throughput", s.stats.throughput_median);
    }
    super::machine_metrics_of(m.runs.iter().chain(&m.single), &mut out);
    out
}

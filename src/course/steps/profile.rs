//! `profile` steps: a benchmark with every kernel timed and a FLOPs profile of its last timed
//! iteration; optionally the timeline and kernel table as files.

use anyhow::{Context as _, Result};

use super::{StepContext, StepOutput, bench_with_progress, keep_record, run_metrics};
use crate::bench::{self, flops::FlopsProfile, record::BenchRecord};
use crate::course::metrics::Recorded;
use crate::course::state::ResultTable;
use crate::course::ui::{Show, Ui};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let spec = ctx.bench_spec()?;
    let shown = (ctx.step.profile.as_ref())
        .map(|p| p.get_ref().clone())
        .unwrap_or_default();
    let mut cfg = ctx.bench_config(spec);
    cfg.profile = true;
    cfg.flops_prof_step = Some(cfg.iterations);
    ui.show(Show::Config(&cfg));
    let r = bench_with_progress(&cfg, ui)?;
    ui.show(Show::Summary(&r));
    let f = (r.flops_profile.as_ref()).context("the run gave no FLOPs profile")?;
    ui.show(Show::Profile {
        record: &r,
        flops: f,
        top: shown.top.unwrap_or(10),
        depth: shown.depth.unwrap_or(1),
        kernels: shown.files,
        full: &ctx.own_file("profiles", "txt")?,
    });
    if shown.files
        && let Some(p) = &r.profile
    {
        let trace = ctx.own_file("profiles", "trace.json")?;
        let csv = ctx.own_file("profiles", "kernels.csv")?;
        let t = bench::profile::trace(&r.timeline, &r.environment.device.name);
        crate::files::write_atomic(&trace, serde_json::to_string(&t)?.as_bytes())?;
        crate::files::write_atomic(&csv, bench::profile::csv(p).as_bytes())?;
        ui.show(Show::Line(format!(
            "Wrote the timeline to {} (open it in https://ui.perfetto.dev) and the kernel table to {}",
            trace.display(),
            csv.display()
        )));
    }
    keep_record(ctx, &r)?;
    out.metrics = run_metrics(&r, None);
    out.metrics.extend(profile_metrics(&r));
    out.table = Some(module_table(f));
    out.note_run(&r);
    Ok(())
}

/// What a profile step records besides the run's metrics.
fn profile_metrics(r: &BenchRecord) -> Recorded {
    let mut m = Recorded::default();
    if let Some(p) = &r.profile {
        m.set("device_ms", p.device_ms_per_iter);
        m.set("cpu_overhead", p.cpu_overhead);
        for op in &p.ops {
            m.set(format!("op.{}.time_pct", op.name), op.percentage);
        }
    }
    if let Some(f) = &r.flops_profile {
        let root = f.root();
        m.set("intensity", root.intensity());
        if let Some(e) = f.efficiency() {
            m.set("efficiency", e);
        }
        if let Some(p) = f.limits.peak_gflops {
            m.set("peak_gflops", p);
        }
        if let Some(b) = f.limits.balance() {
            m.set("balance", b);
        }
        for module in f.at_depth(1) {
            for (name, value) in bench::flops::MODULE_METRICS {
                m.set(format!("{}.{name}", module.name), value(module, root));
            }
        }
    }
    m
}

/// The top-level modules of a FLOPs profile as a results table.
fn module_table(f: &FlopsProfile) -> ResultTable {
    let root = f.root();
    let rows = f
        .at_depth(1)
        .map(|m| {
            vec![
                m.name.clone(),
                format!("{:.2}", m.latency_ns as f64 / 1e6),
                format!(
                    "{:.1}",
                    100.0 * m.latency_ns as f64 / root.latency_ns.max(1) as f64
                ),
                format!("{:.3}", m.macs as f64 / 1e9),
                format!("{:.1}", m.gflops()),
                format!("{:.1}", m.intensity()),
                f.limits.bound(m.intensity()).unwrap_or("—").to_string(),
            ]
        })
        .collect();
    ResultTable {
        header: [
            "module",
            "latency ms",
            "% latency",
            "GMACs",
            "GFLOP/s",
            "FLOP/byte",
            "bound",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    }
}

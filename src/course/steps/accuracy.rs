//! `accuracy` steps: one forward pass at the step's precision against FP32 on the same seeded
//! input and weights.

use anyhow::Result;

use super::{StepContext, StepOutput};
use crate::backend::{self, ExecOptions};
use crate::bench::{self, record::BenchConfig};
use crate::course::ui::{Show, Ui};
use crate::model::{Precision, Rng, zoo};

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let cfg = ctx.bench_config(ctx.bench_spec()?);
    let (diff, rel, agree) = accuracy(&cfg)?;
    ui.show(Show::Line(format!(
        "{} {} against FP32 on the same input and weights: max |Δlogit| = {diff:.3e} ({:.3}% of the largest logit), top-1 agreement {:.1}%",
        cfg.network,
        cfg.precision.name().to_uppercase(),
        rel * 100.0,
        agree * 100.0
    )));
    out.metrics.set("max_abs_diff", diff);
    out.metrics.set("rel_diff", rel);
    out.metrics.set("top1_agreement", agree);
    Ok(())
}

/// Max |Δlogit|, that relative to the largest FP32 logit, and top-1 agreement of one forward
/// pass at `cfg.precision` against FP32 on the same seeded input and weights.
pub fn accuracy(cfg: &BenchConfig) -> Result<(f64, f64, f64)> {
    let graph = zoo::build(&cfg.network)?;
    let plan = graph.plan(cfg.batch_size, cfg.input_size, cfg.input_size)?;
    let weights = bench::seeded_weights(&graph, cfg.seed, cfg.input_size)?;
    let b = backend::open(cfg.backend)?;
    let input = Rng::new(cfg.seed.wrapping_add(1)).normal_tensor(plan.input_shape().to_vec());
    let mut outs = Vec::new();
    for precision in [Precision::Fp32, cfg.precision] {
        let opt = ExecOptions {
            precision,
            ..cfg.exec_options()
        };
        let mut s = b.prepare(cfg.device, &plan, &weights, &opt)?;
        outs.push(bench::infer(s.as_mut(), &input)?);
    }
    let (r, o) = (&outs[0], &outs[1]);
    let diff = r.max_abs_diff(o) as f64;
    let scale = r
        .data
        .iter()
        .fold(0f32, |a, v| a.max(v.abs()))
        .max(f32::MIN_POSITIVE) as f64;
    let classes = r.shape[1];
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
    };
    let agree = r
        .data
        .chunks(classes)
        .zip(o.data.chunks(classes))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count() as f64
        / cfg.batch_size as f64;
    Ok((diff, diff / scale, agree))
}

//! max-autotune: for every distinct GEMM-shaped layer (convolution, linear) time each kernel
//! variant the backend offers on a one-layer network of that shape, keep the fastest, and
//! remember the choice on disk, keyed by backend, device, driver, kernel version, precision and
//! shape, so a second run pays nothing (`--recompile` measures again).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::record::{AutotuneReport, BenchConfig, Choice};
use crate::backend::{Backend, DeviceInfo, ExecOptions};
use crate::model::graph::GraphBuilder;
use crate::model::op::{Act, Op};
use crate::model::{Plan, Rng, Weights};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Entry {
    key: String,
    variant: String,
    tried: Vec<(String, f64)>,
}

fn cache_file() -> Option<std::path::PathBuf> {
    Some(crate::settings::cache_dir()?.join("autotune.json"))
}

fn read_cache() -> Vec<Entry> {
    cache_file()
        .and_then(|p| crate::files::read_text(&p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// Timed runs per variant (after one warm-up); the best counts.
const RUNS: usize = 3;

/// Choose a variant for every tunable layer of `plan`: the node-name → variant map for
/// [`ExecOptions::variants`], and what was done.
pub fn tune(
    cfg: &BenchConfig,
    plan: &Plan,
    backend: &dyn Backend,
    device: &DeviceInfo,
) -> Result<(BTreeMap<String, String>, AutotuneReport)> {
    let mut cache = if cfg.recompile {
        Vec::new()
    } else {
        read_cache()
    };
    let mut chosen = BTreeMap::new();
    let mut report = AutotuneReport::default();
    let mut fresh = false;
    for (id, node) in plan.graph.nodes.iter().enumerate() {
        let variants = backend.variants(&node.op, &plan.shapes[id]);
        if variants.len() < 2 {
            continue;
        }
        let input = &plan.shapes[node.inputs[0]];
        // The epilogue does not change which kernel is faster: shapes differing only there share
        // one measurement.
        let shape = format!("{} on {input:?}", bare(&node.op));
        let key = format!(
            "{}|{}|{}|workshop {}|{}|{shape}",
            cfg.backend,
            device.name,
            device.driver.clone().unwrap_or_default(),
            env!("CARGO_PKG_VERSION"),
            cfg.precision.name()
        );
        report.layers += 1;
        if let Some(e) = cache.iter().find(|e| e.key == key) {
            chosen.insert(node.name.clone(), e.variant.clone());
            if !report.choices.iter().any(|c| c.shape == shape) {
                report.choices.push(Choice {
                    layer: node.name.clone(),
                    shape,
                    variant: e.variant.clone(),
                    tried: e.tried.clone(),
                    cached: true,
                });
            }
            continue;
        }
        let mut tried = Vec::new();
        for v in &variants {
            tried.push((
                v.to_string(),
                time_variant(cfg, &node.op, input, backend, v)?,
            ));
        }
        let best = tried
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|t| t.0.clone())
            .context("no variant")?;
        chosen.insert(node.name.clone(), best.clone());
        cache.push(Entry {
            key,
            variant: best.clone(),
            tried: tried.clone(),
        });
        fresh = true;
        report.choices.push(Choice {
            layer: node.name.clone(),
            shape,
            variant: best,
            tried,
            cached: false,
        });
    }
    if fresh && let Some(path) = cache_file() {
        // A cache that cannot be written only costs the next run the tuning again.
        let _ = crate::files::write_atomic(&path, serde_json::to_string_pretty(&cache)?.as_bytes());
    }
    Ok((chosen, report))
}

/// `op` without a fused epilogue.
fn bare(op: &Op) -> Op {
    match op {
        Op::Conv2d(c) => Op::Conv2d(crate::model::op::Conv2d {
            residual: false,
            act: Act::None,
            ..*c
        }),
        other => other.clone(),
    }
}

/// Best time in ms of `op` (without its epilogue, which every variant shares) as a one-layer
/// network on an input of `input` (NCHW or N×F), with variant `v`.
fn time_variant(
    cfg: &BenchConfig,
    op: &Op,
    input: &[usize],
    backend: &dyn Backend,
    v: &str,
) -> Result<f64> {
    let (n, c, h, w) = match *input {
        [n, c, h, w] => (n, c, h, w),
        [n, f] => (n, f, 1, 1),
        _ => anyhow::bail!("cannot tune an op on input {input:?}"),
    };
    let mut g = GraphBuilder::new(
        "tune",
        c,
        crate::model::graph::ConvInit::TorchDefault,
        crate::model::graph::LinearInit::TorchDefault,
    );
    let x = g.input();
    let y = match bare(op) {
        conv @ Op::Conv2d(_) => g.add_node("layer", conv, &[x]),
        other => {
            let flat = g.flatten("flatten", x);
            g.add_node("layer", other, &[flat])
        }
    };
    let graph = g.finish(y);
    let plan = graph.plan(n, h, w)?;
    let weights = Weights::init(&graph, 0);
    let opt = ExecOptions {
        variants: BTreeMap::from([("layer".to_string(), v.to_string())]),
        profile: true,
        replay: false,
        ..cfg.exec_options()
    };
    let mut session = backend.prepare(cfg.device, &plan, &weights, &opt)?;
    let x = Rng::new(3).normal_tensor(plan.input_shape().to_vec());
    let mut best = f64::INFINITY;
    for run in 0..=RUNS {
        let start = Instant::now();
        session.run(&x)?;
        session.sync()?;
        let wall = start.elapsed().as_secs_f64() * 1e3;
        let device_ms = session.kernel_times().map(|k| {
            k.iter()
                .filter(|t| t.node == "layer")
                .map(|t| t.ns as f64 / 1e6)
                .sum::<f64>()
        });
        if run > 0 {
            best = best.min(device_ms.unwrap_or(wall));
        }
    }
    Ok(best)
}

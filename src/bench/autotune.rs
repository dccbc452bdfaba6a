//! max-autotune: for every distinct GEMM-shaped layer (convolution, linear) time each kernel
//! variant the backend offers on a one-layer network of that shape, keep the fastest, and
//! remember the choice on disk, keyed by backend, device, driver, kernel version, precision and
//! shape, so a second run pays nothing (`--recompile` measures again). Then, where the backend
//! can schedule the whole network more than one way (the CPU's batch tiles), time whole passes
//! with each schedule and keep that choice the same way ([`tune_schedule`]).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::record::{AutotuneReport, BenchConfig, Choice};
use crate::backend::{Backend, BackendKind, DeviceInfo, ExecOptions};
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

/// `entry` in place of any earlier one with its key (`--recompile` replaces, never drops,
/// what other networks and shapes keep).
fn remember(cache: &mut Vec<Entry>, entry: Entry) {
    cache.retain(|e| e.key != entry.key);
    cache.push(entry);
}

/// Write the choices back; a cache that cannot be written only costs the next run the tuning
/// again.
fn write_cache(cache: &[Entry]) -> Result<()> {
    if let Some(path) = cache_file() {
        let _ = crate::files::write_atomic(&path, serde_json::to_string_pretty(cache)?.as_bytes());
    }
    Ok(())
}

/// The part of a cache key every choice shares: backend, device, driver, kernel version and
/// precision; on the CPU the kernels' build too (their source's hash): choices timed on
/// kernels since changed are timed again.
fn key_prefix(cfg: &BenchConfig, device: &DeviceInfo) -> String {
    let build = match cfg.backend {
        BackendKind::Cpu => format!(" kernels {:016x}", crate::backend::cpu::source_hash()),
        _ => String::new(),
    };
    format!(
        "{}|{}|{}|workshop {}{build}|{}",
        cfg.backend,
        device.name,
        device.driver.clone().unwrap_or_default(),
        env!("CARGO_PKG_VERSION"),
        cfg.precision.name()
    )
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
    // With --recompile every shape is timed once again (a second layer of a shape takes the
    // first's fresh choice); the other entries stay.
    let mut cache = read_cache();
    let mut timed_now = std::collections::BTreeSet::new();
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
        let key = format!("{}|{shape}", key_prefix(cfg, device));
        report.layers += 1;
        let usable = !cfg.recompile || timed_now.contains(&key);
        if let Some(e) = cache.iter().find(|e| e.key == key).filter(|_| usable) {
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
        timed_now.insert(key.clone());
        remember(
            &mut cache,
            Entry {
                key,
                variant: best.clone(),
                tried: tried.clone(),
            },
        );
        fresh = true;
        report.choices.push(Choice {
            layer: node.name.clone(),
            shape,
            variant: best,
            tried,
            cached: false,
        });
    }
    if fresh {
        write_cache(&cache)?;
    }
    Ok((chosen, report))
}

/// Rounds of whole passes over the schedules, each round in a rotated order.
const SCHEDULE_ROUNDS: usize = 4;

/// How much faster than the default schedule another one's best pass must be to be chosen: the
/// default is the planner's reasoned choice, and smaller gaps are within the noise of a
/// shared machine.
const SCHEDULE_MARGIN: f64 = 0.02;

/// Choose among the backend's schedules for `plan` ([`Backend::schedules`], with the layer
/// variants `opt` already holds): time whole passes with each, interleaved, and keep the one
/// with the fastest pass, the default unless another is 2% faster (`SCHEDULE_MARGIN`). `None`
/// where the backend offers no choice. Cached as [`tune`]'s choices are, keyed also by
/// network, batch, input, threads and the schedules offered.
pub fn tune_schedule(
    cfg: &BenchConfig,
    plan: &Plan,
    weights: &Weights,
    backend: &dyn Backend,
    device: &DeviceInfo,
    opt: &ExecOptions,
) -> Result<Option<Choice>> {
    let names = backend.schedules(plan, opt);
    if names.is_empty() {
        return Ok(None);
    }
    let shape = format!(
        "{} batch {} on {:?}",
        cfg.network,
        plan.batch(),
        plan.input_shape()
    );
    let key = format!(
        "{}|schedule|{shape}|threads {:?} cores {:?}|{}",
        key_prefix(cfg, device),
        opt.threads,
        opt.cores,
        names.join(" / ")
    );
    let mut cache = read_cache();
    if let Some(e) = cache.iter().find(|e| e.key == key && !cfg.recompile) {
        return Ok(Some(Choice {
            layer: String::new(),
            shape,
            variant: e.variant.clone(),
            tried: e.tried.clone(),
            cached: true,
        }));
    }
    let best = time_schedules(cfg, plan, weights, backend, opt, &names)?;
    let chosen = names[pick(&best)].clone();
    let tried: Vec<(String, f64)> = names.into_iter().zip(best).collect();
    remember(
        &mut cache,
        Entry {
            key,
            variant: chosen.clone(),
            tried: tried.clone(),
        },
    );
    write_cache(&cache)?;
    Ok(Some(Choice {
        layer: String::new(),
        shape,
        variant: chosen,
        tried,
        cached: false,
    }))
}

/// Which of the schedules whose best passes took `best` to keep: the fastest, where it is
/// [`SCHEDULE_MARGIN`] faster than the default (the first), else the default.
fn pick(best: &[f64]) -> usize {
    let fastest = (0..best.len()).min_by(|&a, &b| best[a].total_cmp(&best[b]));
    fastest
        .filter(|&i| best[i] < best[0] * (1.0 - SCHEDULE_MARGIN))
        .unwrap_or(0)
}

/// The fastest whole pass in ms of `plan` with each of `names`, from one session each: one
/// warm-up pass, then [`SCHEDULE_ROUNDS`] rounds of about a quarter second each. The sessions
/// live together (rounds interleave them) where all of them fit in half the memory the
/// backend has free, else one at a time.
fn time_schedules(
    cfg: &BenchConfig,
    plan: &Plan,
    weights: &Weights,
    backend: &dyn Backend,
    opt: &ExecOptions,
    names: &[String],
) -> Result<Vec<f64>> {
    let x = Rng::new(3).normal_tensor(plan.input_shape().to_vec());
    let open = |name: &String| {
        let opt = ExecOptions {
            schedule: Some(name.clone()),
            ..opt.clone()
        };
        backend.prepare(cfg.device, plan, weights, &opt)
    };
    let pass = |session: &mut Box<dyn crate::backend::Session>| -> Result<f64> {
        let start = Instant::now();
        session.run(&x)?;
        session.sync()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    let m = plan.memory_estimate(cfg.precision);
    let all = (m.weights + m.activations).saturating_mul(names.len() as u64);
    let together = backend
        .memory_budget(cfg.device)
        .is_none_or(|free| all < free / 2);
    let mut best = vec![f64::INFINITY; names.len()];
    if together {
        let mut sessions = names.iter().map(open).collect::<Result<Vec<_>, _>>()?;
        let mut passes = 1;
        for (i, session) in sessions.iter_mut().enumerate() {
            best[i] = pass(session)?;
            passes = passes.max((250.0 / best[i]) as usize).min(8);
        }
        for round in 0..SCHEDULE_ROUNDS {
            for k in 0..names.len() {
                let i = (k + round) % names.len();
                for _ in 0..passes {
                    best[i] = best[i].min(pass(&mut sessions[i])?);
                }
            }
        }
    } else {
        for (i, name) in names.iter().enumerate() {
            let mut session = open(name)?;
            best[i] = pass(&mut session)?;
            for _ in 0..SCHEDULE_ROUNDS {
                best[i] = best[i].min(pass(&mut session)?);
            }
        }
    }
    Ok(best)
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
    let mut opt = ExecOptions {
        variants: BTreeMap::from([("layer".to_string(), v.to_string())]),
        profile: true,
        replay: false,
        ..cfg.exec_options()
    };
    if cfg.backend == BackendKind::Cpu {
        opt.cores = opt.cores.take().or_else(|| every_core(opt.threads));
    }
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

/// Every core this process may run on, where a CPU session would use them all (`threads`
/// unset or their count): the workers of a variant's session, pinned one a core. Unpinned,
/// the scheduler often kept a fresh session's two workers on one of 2 Zen 5 vCPUs for its
/// few timed passes, and that variant measured up to twice as slow: Inception-v3 BF16 at batch
/// 8, 25 of its 43 layer shapes had a variant 1.6× or more its best, pinned 3 (the 147² stem
/// layers' F(2×2), twice as slow in every run). A network's own passes, longer, were level
/// either way (`bench/ab.py`, 4 networks); with a busy loop beside them pinned ran 1.08× as
/// long, so only these timings pin.
fn every_core(threads: Option<usize>) -> Option<Vec<usize>> {
    let ids: Vec<usize> = core_affinity::get_core_ids()?
        .iter()
        .map(|c| c.id)
        .collect();
    (ids.len() >= 2 && threads.is_none_or(|t| t == ids.len())).then_some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Variants time on every core, pinned, where their session would use every core; on
    /// fewer threads (or one core) they are left unpinned.
    #[test]
    fn variants_pin_only_a_pool_of_every_core() {
        let all = core_affinity::get_core_ids().map_or(0, |c| c.len());
        if all >= 2 {
            let cores = every_core(None).expect("every core");
            assert_eq!(cores.len(), all);
            assert_eq!(every_core(Some(all)), Some(cores));
            assert_eq!(every_core(Some(all - 1)), None);
        } else {
            assert_eq!(every_core(None), None);
        }
        assert_eq!(every_core(Some(1)), None);
        assert_eq!(every_core(Some(all + 1)), None);
    }

    #[test]
    fn a_schedule_must_beat_the_default_by_the_margin() {
        assert_eq!(pick(&[10.0, 9.9, 10.5]), 0, "1% is noise");
        assert_eq!(pick(&[10.0, 9.9, 9.7]), 2);
        assert_eq!(pick(&[10.0, f64::INFINITY]), 0);
        assert_eq!(pick(&[10.0]), 0);
    }
}

//! Data parallel over several devices: the global batch split evenly, one worker per device,
//! every iteration started and ended together (a barrier), and the scaling efficiency against
//! one device running the same per-device batch. On the CPU backend a device is a disjoint set
//! of cores, pinned where the OS allows, so scaling can be measured on any machine.
//!
//! Across machines the launchers people already use start one process per device
//! (`torchrun`, Slurm's `srun`, `mpirun`): [`Rank::detect`] reads their variables, each rank
//! writes its record into a shared folder, and [`gather`] merges the ranks.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::record::{BenchConfig, BenchRecord};
use super::stats::Stats;
use crate::backend::{self, BackendError, BackendKind};

/// One device of a multi-device run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// How the user names it: `0`, or `cpu:0-3` for a group of cores.
    pub label: String,
    /// The backend's device index.
    pub device: usize,
    /// CPU backend: the cores of this device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<Vec<usize>>,
}

/// Parse `--devices`: `all`, device indices `0,1,3`, or on the CPU backend core ranges
/// `cpu:0-3,cpu:4-7`.
pub fn parse_devices(list: &str, kind: BackendKind) -> Result<Vec<DeviceSpec>> {
    let list = list.trim();
    if list == "all" {
        if kind.is_host() {
            bail!(
                "the CPU backend is one device: split its cores with `--cpu-groups N` or `--devices cpu:0-0,cpu:1-1`"
            );
        }
        let n = backend::open(kind)?.devices().len();
        return Ok((0..n)
            .map(|d| DeviceSpec {
                label: d.to_string(),
                device: d,
                cores: None,
            })
            .collect());
    }
    let mut out: Vec<DeviceSpec> = Vec::new();
    for item in list.split(',').map(str::trim) {
        if let Some(range) = item.strip_prefix("cpu:") {
            if !kind.is_host() {
                bail!("`{item}` names CPU cores, but the backend is {kind}");
            }
            let (a, b) = range.split_once('-').unwrap_or((range, range));
            let parse = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .with_context(|| format!("`{item}`: `{v}` is not a core number"))
            };
            let (a, b) = (parse(a)?, parse(b)?);
            if a > b {
                bail!("`{item}`: the range runs backwards");
            }
            if let Err(why) = super::within_limit("core", b) {
                bail!("`{item}`: core {why}");
            }
            // Cores the process may not run on would run unpinned, measuring something else
            // than asked (issue 27).
            if let Some(usable) =
                core_affinity::get_core_ids().map(|c| c.iter().map(|c| c.id).collect::<Vec<_>>())
                && let Some(missing) = (a..=b).find(|c| !usable.contains(c))
            {
                bail!(
                    "`{item}`: core {missing} is not one this process can run on (it can use {})",
                    core_list(&usable)
                );
            }
            let cores: Vec<usize> = (a..=b).collect();
            if let Some(o) = out.iter().find(|d| {
                d.cores
                    .as_ref()
                    .is_some_and(|c| c.iter().any(|x| cores.contains(x)))
            }) {
                bail!(
                    "`{item}` overlaps `{}`: devices must not share cores",
                    o.label
                );
            }
            out.push(DeviceSpec {
                label: item.to_string(),
                device: 0,
                cores: Some(cores),
            });
        } else {
            let device = item.parse::<usize>().with_context(|| {
                format!("`{item}` is not a device index (expected `all`, `0,1` or `cpu:0-3`)")
            })?;
            if kind.is_host() {
                bail!(
                    "the CPU backend is one device: name groups of cores instead (`--devices cpu:0-0,cpu:1-1` or `--cpu-groups 2`)"
                );
            }
            if out.iter().any(|d| d.device == device) {
                bail!("device {device} is listed twice");
            }
            out.push(DeviceSpec {
                label: item.to_string(),
                device,
                cores: None,
            });
        }
    }
    Ok(out)
}

/// Cores as ranges: `0-3, 6, 8-9`.
fn core_list(cores: &[usize]) -> String {
    let mut sorted = cores.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        out.push(match j > i {
            true => format!("{}-{}", sorted[i], sorted[j]),
            false => sorted[i].to_string(),
        });
        i = j + 1;
    }
    out.join(", ")
}

/// The machine's cores split into `groups` disjoint, nearly equal groups.
pub fn cpu_groups(groups: usize) -> Result<Vec<DeviceSpec>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if groups == 0 || groups > cores {
        bail!("--cpu-groups {groups}: this machine has {cores} cores, so 1 to {cores} groups");
    }
    let mut start = 0;
    Ok((0..groups)
        .map(|g| {
            let size = cores / groups + usize::from(g < cores % groups);
            let c: Vec<usize> = (start..start + size).collect();
            start += size;
            DeviceSpec {
                label: format!("cpu:{}-{}", c[0], c[c.len() - 1]),
                device: 0,
                cores: Some(c),
            }
        })
        .collect())
}

/// A barrier that a failing participant can break, releasing everyone with an error instead of
/// leaving them waiting for ever.
pub struct Barrier {
    n: usize,
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Barrier {
    pub fn new(n: usize) -> Self {
        Barrier {
            n,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    pub fn wait(&self) -> Result<()> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.2 {
            bail!("another device failed");
        }
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.n {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while s.1 == generation && !s.2 {
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if s.1 == generation {
            bail!("another device failed");
        }
        Ok(())
    }

    pub fn abort(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.2 = true;
        self.cv.notify_all();
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MultiRecord {
    pub schema_version: u32,
    /// Always `"multi"`.
    pub kind: String,
    pub created_unix: u64,
    pub global_batch: usize,
    pub per_device_batch: usize,
    pub devices: Vec<DeviceSpec>,
    /// Each device's own record (its own step times).
    pub runs: Vec<BenchRecord>,
    /// Seconds per iteration from the first device's start of its step to the last device's
    /// end of its step: the slowest device sets the pace, and no device's own step is longer.
    pub global_samples_s: Vec<f64>,
    pub global: Stats,
    /// One device alone with the per-device batch, when measured or cited.
    pub single: Option<BenchRecord>,
    /// Global throughput / (devices × single-device throughput).
    pub scaling_efficiency: Option<f64>,
    /// Slowest device's median step / fastest device's: 1.0 for identical devices.
    pub spread: f64,
}

/// Split `global_batch` over `devices` evenly, or say why it cannot be.
pub fn per_device_batch(global_batch: usize, devices: usize) -> Result<usize> {
    if devices == 0 || !global_batch.is_multiple_of(devices) || global_batch < devices {
        bail!(
            "--batch-size {global_batch} (the global batch) does not split evenly over {devices} devices: use a multiple of {devices}"
        );
    }
    Ok(global_batch / devices)
}

/// The run configuration of one device.
fn device_config(cfg: &BenchConfig, d: &DeviceSpec, batch: usize) -> BenchConfig {
    BenchConfig {
        batch_size: batch,
        device: d.device,
        cores: d.cores.clone(),
        threads: d.cores.as_ref().map(Vec::len).or(cfg.threads),
        ..cfg.clone()
    }
}

/// Run `cfg` (whose batch is the global batch) data-parallel over `devices`, then, unless a
/// `single` record is given, the first device alone for the scaling efficiency.
pub fn run(
    cfg: &BenchConfig,
    devices: &[DeviceSpec],
    single: Option<BenchRecord>,
    say: &mut dyn FnMut(&str),
) -> Result<MultiRecord> {
    super::validate(cfg)?;
    if devices.len() < 2 {
        return Err(BackendError::Unsupported(format!(
            "a multi-device run needs at least 2 devices; {} has {}",
            cfg.backend,
            devices.len()
        ))
        .into());
    }
    let per = per_device_batch(cfg.batch_size, devices.len())?;
    // A one-device baseline must be this run's network, precision, backend and per-device
    // batch, or the scaling efficiency means nothing (issue 27).
    if let Some(s) = &single {
        let (a, b) = (&s.config, cfg);
        if (
            &a.network,
            a.precision,
            a.backend,
            a.batch_size,
            a.input_size,
        ) != (&b.network, b.precision, b.backend, per, b.input_size)
        {
            anyhow::bail!(
                "--single ran {} {} on {} at batch {} ({}px); this run needs {} {} on {} at batch {per} ({}px) per device",
                a.network,
                a.precision,
                a.backend,
                a.batch_size,
                a.input_size,
                b.network,
                b.precision,
                b.backend,
                b.input_size
            );
        }
    }
    let configs: Vec<BenchConfig> = devices.iter().map(|d| device_config(cfg, d, per)).collect();
    say(&format!(
        "Preparing {} devices ({}), {per} images each...",
        devices.len(),
        devices
            .iter()
            .map(|d| d.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let barrier = Barrier::new(devices.len());
    let steps = cfg.warmup + cfg.iterations;
    // Per iteration (warm-up included), the earliest start and the latest end of any device's
    // step: the global step. Taken from the devices' own clocks, so it never comes out shorter
    // than one of their steps (a separate clock thread, woken late by a busy machine, could).
    let windows: Mutex<Vec<Option<(Instant, Instant)>>> = Mutex::new(vec![None; steps]);
    let results: Vec<Result<BenchRecord>> = std::thread::scope(|scope| {
        let workers: Vec<_> = configs
            .iter()
            .map(|c| {
                let (barrier, windows) = (&barrier, &windows);
                scope.spawn(move || {
                    let done = AtomicUsize::new(0);
                    let together = |step: Option<(Instant, Instant)>| {
                        if let Some((start, end)) = step {
                            let i = done.fetch_add(1, Ordering::Relaxed);
                            let mut w = windows.lock().unwrap_or_else(|p| p.into_inner());
                            if let Some(slot) = w.get_mut(i) {
                                *slot = Some(match *slot {
                                    None => (start, end),
                                    Some((s, e)) => (s.min(start), e.max(end)),
                                });
                            }
                        }
                        barrier.wait()
                    };
                    let out = (|| {
                        let prepared = super::prepare(c, None)?;
                        barrier.wait()?;
                        super::measure(c, prepared, &mut |_| {}, Some(&together))
                    })();
                    if out.is_err() {
                        barrier.abort();
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a device's worker panicked")))
            })
            .collect()
    });
    let global_samples_s: Vec<f64> = windows
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .skip(cfg.warmup)
        .flatten()
        .map(|(start, end)| (end - start).as_secs_f64())
        .collect();
    let mut runs = Vec::with_capacity(results.len());
    for (r, d) in results.into_iter().zip(devices) {
        runs.push(r.with_context(|| format!("device {}", d.label))?);
    }
    let macs_per_image = runs[0].model.macs_per_image;
    let global = Stats::from_samples(
        &global_samples_s,
        cfg.batch_size,
        2 * macs_per_image * cfg.batch_size as u64,
    )
    .context("no timed samples")?;
    let medians: Vec<f64> = runs.iter().map(|r| r.stats.median_s).collect();
    let spread = medians.iter().copied().fold(0.0, f64::max)
        / medians.iter().copied().fold(f64::INFINITY, f64::min);
    let single = match single {
        Some(s) => Some(s),
        None => {
            say(&format!(
                "Measuring {} alone with {per} images for the scaling efficiency...",
                devices[0].label
            ));
            Some(super::run(&configs[0], None, &mut |_| {})?)
        }
    };
    let scaling_efficiency = single
        .as_ref()
        .map(|s| global.throughput_median / (devices.len() as f64 * s.stats.throughput_median));
    Ok(MultiRecord {
        schema_version: super::record::SCHEMA_VERSION,
        kind: "multi".into(),
        created_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        global_batch: cfg.batch_size,
        per_device_batch: per,
        devices: devices.to_vec(),
        runs,
        global_samples_s,
        global,
        single,
        scaling_efficiency,
        spread,
    })
}

/// Where a launcher placed this process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rank {
    /// `torchrun`, `slurm`, `openmpi` or `pmi`.
    pub launcher: String,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// Ranks on this machine, when the launcher says.
    pub local_world_size: Option<usize>,
}

impl Rank {
    /// The launcher's variables from `get` (the environment in real use).
    /// A launcher is detected when its rank and world-size variables are both set; values that
    /// cannot be one run's (not numbers, a rank at or past the world size, a world of 0 or
    /// beyond any cluster) are an error naming the variables (issue 27: `RANK=5 WORLD_SIZE=2`
    /// was accepted).
    pub fn detect_with(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Rank>> {
        let num = |k: &str| -> Result<Option<usize>> {
            let Some(v) = get(k) else { return Ok(None) };
            // Slurm writes counts per node like `2(x3)`.
            let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
            digits
                .parse::<usize>()
                .map(Some)
                .map_err(|_| anyhow::anyhow!("{k}={v} is not a number"))
        };
        let launchers: [(&str, [&str; 4]); 4] = [
            (
                "torchrun",
                ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            ),
            (
                "slurm",
                [
                    "SLURM_PROCID",
                    "SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_NTASKS_PER_NODE",
                ],
            ),
            (
                "openmpi",
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            ),
            (
                "pmi",
                ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            ),
        ];
        let Some((name, [r, w, lr, lw])) =
            (launchers.iter()).find(|(_, [r, w, ..])| get(r).is_some() && get(w).is_some())
        else {
            return Ok(None);
        };
        let (rank, world_size) = (num(r)?.unwrap_or(0), num(w)?.unwrap_or(0));
        let (local_rank, local_world_size) = (num(lr)?.unwrap_or(0), num(lw)?);
        let said = |k: &str| format!("{k}={}", get(k).unwrap_or_default());
        if world_size == 0 {
            bail!(
                "{}: a run has at least one rank ({name}'s variables)",
                said(w)
            );
        }
        if let Err(why) = super::within_limit("world_size", world_size) {
            bail!("{}: {why}", said(w));
        }
        if rank >= world_size {
            bail!(
                "{} with {}: ranks are numbered from 0 to the world size − 1 ({name}'s variables)",
                said(r),
                said(w)
            );
        }
        if let Some(n) = local_world_size
            && (n == 0 || local_rank >= n || n > world_size)
        {
            bail!(
                "{} with {}: a local rank must be below the ranks on this machine, which cannot be 0 or more than the world size ({})",
                said(lr),
                said(lw),
                said(w)
            );
        }
        Ok(Some(Rank {
            launcher: name.to_string(),
            rank,
            world_size,
            local_rank,
            local_world_size,
        }))
    }

    pub fn detect() -> Result<Option<Rank>> {
        Self::detect_with(&|k| std::env::var(k).ok())
    }

    /// This rank's device: the GPU of its local rank, or on the CPU backend its share of the
    /// cores when several ranks share the machine.
    pub fn device(&self, kind: BackendKind) -> Result<DeviceSpec> {
        match (kind.is_host(), self.local_world_size) {
            (true, Some(n)) if n > 1 => cpu_groups(n)?
                .into_iter()
                .nth(self.local_rank)
                .with_context(|| {
                    format!(
                        "local rank {} of {n} has no group of cores",
                        self.local_rank
                    )
                }),
            (true, _) => Ok(DeviceSpec {
                label: "cpu".into(),
                device: 0,
                cores: None,
            }),
            _ => Ok(DeviceSpec {
                label: self.local_rank.to_string(),
                device: self.local_rank,
                cores: None,
            }),
        }
    }
}

/// What one rank writes into the shared results folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRecord {
    pub schema_version: u32,
    /// Always `"rank"`.
    pub kind: String,
    pub rank: Rank,
    pub global_batch: usize,
    pub device: DeviceSpec,
    pub record: BenchRecord,
}

/// The file of rank `r` in a results folder.
pub fn rank_file(dir: &Path, rank: usize) -> std::path::PathBuf {
    dir.join(format!("rank-{rank:05}.json"))
}

/// Run this rank's share of the global batch on its device and write its record into `dir`.
pub fn run_rank(cfg: &BenchConfig, rank: &Rank, dir: &Path) -> Result<RankRecord> {
    let per = per_device_batch(cfg.batch_size, rank.world_size)?;
    let device = rank.device(cfg.backend)?;
    let c = device_config(cfg, &device, per);
    let record = super::run(&c, None, &mut |_| {})?;
    let out = RankRecord {
        schema_version: super::record::SCHEMA_VERSION,
        kind: "rank".into(),
        rank: rank.clone(),
        global_batch: cfg.batch_size,
        device,
        record,
    };
    crate::files::write_atomic(
        &rank_file(dir, rank.rank),
        serde_json::to_string_pretty(&out)?.as_bytes(),
    )?;
    Ok(out)
}

/// Every rank of a results folder, merged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gathered {
    pub schema_version: u32,
    /// Always `"gathered"`.
    pub kind: String,
    pub world_size: usize,
    pub global_batch: usize,
    pub ranks: Vec<RankRecord>,
    /// Sum of the ranks' throughputs: what the ranks did together, each at its own pace.
    pub throughput_sum: f64,
    /// Global batch / slowest rank's median step: the rate if every iteration waited for all
    /// ranks (the ranks ran independently, without a barrier between processes).
    pub throughput_synchronous: f64,
    pub spread: f64,
}

/// Merge the rank records in `dir`, checking that they belong to one run.
pub fn gather(dir: &Path) -> Result<Gathered> {
    let mut ranks: Vec<RankRecord> = Vec::new();
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the results folder `{}`", dir.display()))?;
    let mut files: Vec<std::path::PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rank-") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    for f in &files {
        let text = crate::files::read_text(f)?;
        let mut value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("`{}` is not a rank record", f.display()))?;
        crate::units::printable_json(&mut value);
        let r: RankRecord = serde_json::from_value(value)
            .with_context(|| format!("`{}` is not a rank record", f.display()))?;
        ranks.push(r);
    }
    let Some(first) = ranks.first() else {
        bail!(
            "`{}` holds no rank records (rank-NNNNN.json): start the ranks with --results-dir pointing here",
            dir.display()
        );
    };
    let world = first.rank.world_size;
    if world == 0 {
        bail!("the rank records say a world of 0 ranks: they are damaged");
    }
    if let Err(why) = super::within_limit("world_size", world) {
        bail!("the rank records' world size: {why}");
    }
    if let Some(r) = ranks.iter().find(|r| r.rank.rank >= world) {
        bail!(
            "a record is rank {} of {world}: ranks run from 0 to {}",
            r.rank.rank,
            world - 1
        );
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(r) = ranks.iter().find(|r| !seen.insert(r.rank.rank)) {
        bail!(
            "rank {} has two records: these are not one run",
            r.rank.rank
        );
    }
    let global_batch = first.global_batch;
    let key = |r: &RankRecord| {
        (
            r.record.config.network.clone(),
            r.record.config.precision,
            r.record.config.backend,
            r.global_batch,
            r.rank.world_size,
        )
    };
    if let Some(odd) = ranks.iter().find(|r| key(r) != key(first)) {
        bail!(
            "rank {} ran {} {} batch {} of {} ranks, but rank {} ran {} {} batch {} of {}: these records are not one run",
            odd.rank.rank,
            odd.record.config.network,
            odd.record.config.precision,
            odd.global_batch,
            odd.rank.world_size,
            first.rank.rank,
            first.record.config.network,
            first.record.config.precision,
            global_batch,
            world
        );
    }
    let missing: Vec<String> = (0..world)
        .filter(|r| !ranks.iter().any(|x| x.rank.rank == *r))
        .map(|r| r.to_string())
        .collect();
    if !missing.is_empty() {
        bail!(
            "ranks {} of {world} have not written their records yet",
            missing.join(", ")
        );
    }
    ranks.sort_by_key(|r| r.rank.rank);
    let medians: Vec<f64> = ranks.iter().map(|r| r.record.stats.median_s).collect();
    let slowest = medians.iter().copied().fold(0.0, f64::max);
    let fastest = medians.iter().copied().fold(f64::INFINITY, f64::min);
    Ok(Gathered {
        schema_version: super::record::SCHEMA_VERSION,
        kind: "gathered".into(),
        world_size: world,
        global_batch,
        throughput_sum: ranks.iter().map(|r| r.record.stats.throughput_median).sum(),
        throughput_synchronous: global_batch as f64 / slowest,
        spread: slowest / fastest,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launcher_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(a, _)| *a == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let r = Rank::detect_with(&env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                r.launcher.as_str(),
                r.rank,
                r.world_size,
                r.local_rank,
                r.local_world_size
            ),
            ("torchrun", 3, 8, 1, Some(2))
        );
        let r = Rank::detect_with(&env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "3(x2)"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (r.launcher.as_str(), r.rank, r.local_world_size),
            ("slurm", 5, Some(3))
        );
        let r = Rank::detect_with(&env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]))
            .unwrap()
            .unwrap();
        assert_eq!((r.launcher.as_str(), r.local_rank), ("pmi", 0));
        assert_eq!(Rank::detect_with(&env(&[("RANK", "1")])).unwrap(), None);
        // Values no run can have are refused, naming the variables (issue 27).
        for (pairs, says) in [
            (
                &[("RANK", "5"), ("WORLD_SIZE", "2")][..],
                "RANK=5 with WORLD_SIZE=2: ranks are numbered from 0",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "0")][..],
                "WORLD_SIZE=0: a run has",
            ),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "2")][..],
                "RANK=x is not a number",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "99999999999")][..],
                "WORLD_SIZE=99999999999: 99999999999 is above the limit",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "3"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ][..],
                "LOCAL_RANK=3 with LOCAL_WORLD_SIZE=2",
            ),
        ] {
            let pairs: Vec<(String, String)> = (pairs.iter())
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            let get = |k: &str| pairs.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone());
            let e = Rank::detect_with(&get).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn device_lists_and_groups() {
        // Two cores: what CI and these machines have at least.
        let d = parse_devices("cpu:0-0,cpu:1-1", BackendKind::Cpu).unwrap();
        assert_eq!(d[0].cores, Some(vec![0]));
        assert_eq!(d[1].cores, Some(vec![1]));
        let e = parse_devices("cpu:0-1,cpu:1-1", BackendKind::Cpu).unwrap_err();
        assert!(e.to_string().contains("overlaps `cpu:0-1`"), "{e}");
        // A core the process cannot run on would run unpinned (issue 27).
        let e = parse_devices("cpu:0-0,cpu:60000-60001", BackendKind::Cpu).unwrap_err();
        assert!(
            e.to_string()
                .contains("core 60000 is not one this process can run on"),
            "{e}"
        );
        assert!(parse_devices("0,1", BackendKind::Cpu).is_err());
        assert!(parse_devices("0,x", BackendKind::Wgpu).is_err());
        assert_eq!(
            parse_devices("0,2", BackendKind::Wgpu).unwrap()[1].device,
            2
        );
        let e = per_device_batch(9, 2).unwrap_err();
        assert!(e.to_string().contains("use a multiple of 2"), "{e}");
        assert_eq!(per_device_batch(8, 2).unwrap(), 4);
    }

    #[test]
    fn barrier_releases_everyone_when_aborted() {
        let b = Barrier::new(3);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| b.wait());
            std::thread::sleep(std::time::Duration::from_millis(20));
            b.abort();
            assert!(waiter.join().unwrap().is_err());
        });
        let ok = Barrier::new(2);
        std::thread::scope(|s| {
            let h = s.spawn(|| ok.wait());
            ok.wait().unwrap();
            h.join().unwrap().unwrap();
        });
    }
}

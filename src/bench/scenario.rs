//! MLPerf Inference's scenarios on our kernels: **single-stream** (one query at a time, the
//! next issued when the last returns: latency percentiles), **offline** (every query at once,
//! in full batches: throughput) and **server** (queries arriving at random — a Poisson process
//! at a target rate — batched dynamically up to a maximum batch or until the first query has
//! waited the batching timeout; the largest rate whose 99th-percentile latency meets a bound,
//! found by bisection).
//!
//! The device's work is real: every batch runs on a prepared session and is timed (run, sync,
//! read the output: a server answers with it). The waiting is not: arrivals follow a clock
//! that advances by those measured times instead of sleeping, so a probe at a low rate costs
//! only its compute. Latency = queue time (arrival to the batch's start) + compute time (the
//! batch's). Batches smaller than a prepared size run padded to the next one (sessions are
//! prepared for 1, 2, 4, … up to the maximum batch), and the record says how many were.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::record::BenchConfig;
use super::stats::percentile;
use crate::backend::Session;
use crate::model::{Rng, Tensor};

/// MLPerf's scenario names, as `--scenario` takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// One query of one image at a time, the next when the last returns: latency percentiles
    SingleStream,
    /// Every query available at once, run in full batches: throughput
    Offline,
    /// Queries arriving at random at a target rate, batched dynamically: the largest rate
    /// whose p99 latency meets the bound
    Server,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::SingleStream => "single-stream",
            Scenario::Offline => "offline",
            Scenario::Server => "server",
        }
    }
}

/// What MLPerf Inference's run rules ask of a run (v4/v5 datacenter and edge rules), which
/// our defaults scale down and say so.
pub const MLPERF_RULES: &str = "MLPerf asks at least 600 s per run and at least 1,024 \
    queries single-stream, 24,576 samples offline and 270,336 queries server, with a p99 \
    bound of 15 ms for ResNet-50 server";

/// How a scenario runs (`workshop bench --scenario`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioConfig {
    pub scenario: Scenario,
    /// Queries per run (a server's: per probed rate), at least.
    pub queries: usize,
    /// Seconds a run lasts at least, on its clock (a server probe issues
    /// max(queries, rate × duration) queries).
    pub duration_s: f64,
    /// Server: the bound on the 99th-percentile latency, ms.
    pub latency_bound_ms: f64,
    /// Server: how long the first query of a batch waits for others, ms.
    pub timeout_ms: f64,
    /// Server: run at this rate (queries per second) instead of searching.
    pub qps: Option<f64>,
}

impl ScenarioConfig {
    /// `scenario` with what was not given set for where it runs: MLPerf's ResNet-50 bound
    /// (15 ms), 1,024 queries and 10 s per run on a device; 100 ms, 128 queries and 2 s where
    /// the device computes on the host's cores (`host`); a batching timeout of a tenth of the
    /// bound.
    pub fn new(
        scenario: Scenario,
        host: bool,
        queries: Option<usize>,
        duration_s: Option<f64>,
        latency_bound_ms: Option<f64>,
        timeout_ms: Option<f64>,
        qps: Option<f64>,
    ) -> ScenarioConfig {
        let bound = latency_bound_ms.unwrap_or(if host { 100.0 } else { 15.0 });
        ScenarioConfig {
            scenario,
            queries: queries.unwrap_or(if host { 128 } else { 1024 }),
            duration_s: duration_s.unwrap_or(if host { 2.0 } else { 10.0 }),
            latency_bound_ms: bound,
            timeout_ms: timeout_ms.unwrap_or(bound / 10.0),
            qps,
        }
    }

    /// The checks a user's values get before anything runs.
    pub fn validate(&self) -> Result<()> {
        let finite = |v: f64| v.is_finite() && v >= 0.0;
        if self.queries == 0 || self.queries > 10_000_000 {
            bail!(
                "--queries must be between 1 and 10,000,000 (got {})",
                self.queries
            );
        }
        if !finite(self.duration_s) || self.duration_s > 86_400.0 {
            bail!("--duration must be 0 to 86,400 seconds");
        }
        if !(finite(self.latency_bound_ms) && self.latency_bound_ms > 0.0) {
            bail!("--latency-bound-ms must be a positive number of milliseconds");
        }
        if !finite(self.timeout_ms) {
            bail!("--batch-timeout-ms must be 0 or a positive number of milliseconds");
        }
        if let Some(q) = self.qps
            && !(q.is_finite() && q > 0.0 && q <= 1e7)
        {
            bail!("--qps must be a positive rate up to 10,000,000 queries per second");
        }
        Ok(())
    }
}

/// One query as it was served, in seconds on the run's clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Served {
    pub arrival: f64,
    pub start: f64,
    pub end: f64,
    /// The queries of its batch.
    pub batch: usize,
}

impl Served {
    pub fn latency(&self) -> f64 {
        self.end - self.arrival
    }
}

/// Serve queries arriving at `arrivals` (ascending) in batches of at most `max_batch`: when
/// the device is free, a batch closes once it is full or its first query has waited
/// `timeout` (whichever comes first, never before the device is free) and takes every query
/// that has arrived by then; `compute(k)` runs a batch of `k` and returns its seconds.
pub fn serve(
    arrivals: &[f64],
    max_batch: usize,
    timeout: f64,
    compute: &mut dyn FnMut(usize) -> Result<f64>,
) -> Result<Vec<Served>> {
    let max_batch = max_batch.max(1);
    let mut out = Vec::with_capacity(arrivals.len());
    let (mut free, mut i) = (0f64, 0);
    while i < arrivals.len() {
        let first = arrivals[i];
        let full = arrivals
            .get(i + max_batch - 1)
            .copied()
            .unwrap_or(f64::INFINITY);
        let close = free.max(first).max(full.min(first + timeout));
        let mut j = i;
        while j < arrivals.len() && j - i < max_batch && arrivals[j] <= close {
            j += 1;
        }
        let seconds = compute(j - i)?;
        let end = close + seconds;
        out.extend(arrivals[i..j].iter().map(|&arrival| Served {
            arrival,
            start: close,
            end,
            batch: j - i,
        }));
        (free, i) = (end, j);
    }
    Ok(out)
}

/// `n` arrival times of a Poisson process at `rate` per second (exponential gaps), from 0.
pub fn poisson_arrivals(n: usize, rate: f64, rng: &mut Rng) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let at = t;
            // 1 − U is in (0, 1]: its logarithm is finite.
            t += -(1.0 - rng.uniform()).ln() / rate;
            at
        })
        .collect()
}

/// A run of the scenario at one rate (single-stream and offline: their one run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// The target rate (queries per second); 0 for single-stream and offline.
    pub target_qps: f64,
    pub queries: usize,
    /// Queries served per second of the run's clock, first arrival to last answer.
    pub achieved_qps: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    /// The 99th percentile of the time queries waited before their batch started.
    pub queue_p99_ms: f64,
    /// The 99th percentile of their batch's compute time.
    pub compute_p99_ms: f64,
    pub mean_batch: f64,
    /// The p99 latency met the bound (server).
    pub met: bool,
    /// The timing noise: the largest coefficient of variation of the compute times of the
    /// batches of one size (the latencies' own spread is the scenario, not noise).
    #[serde(default)]
    pub cv: f64,
}

impl Probe {
    fn of(target_qps: f64, served: &[Served], bound_ms: f64) -> Probe {
        let sorted = |f: &dyn Fn(&Served) -> f64| {
            let mut v: Vec<f64> = served.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let latency = sorted(&|s| s.latency());
        let queue = sorted(&|s| s.start - s.arrival);
        let compute = sorted(&|s| s.end - s.start);
        let span = served.iter().map(|s| s.end).fold(0f64, f64::max)
            - served.first().map_or(0.0, |s| s.arrival);
        let p99_ms = percentile(&latency, 99.0) * 1e3;
        Probe {
            target_qps,
            queries: served.len(),
            achieved_qps: served.len() as f64 / span.max(f64::MIN_POSITIVE),
            p50_ms: percentile(&latency, 50.0) * 1e3,
            p90_ms: percentile(&latency, 90.0) * 1e3,
            p99_ms,
            queue_p99_ms: percentile(&queue, 99.0) * 1e3,
            compute_p99_ms: percentile(&compute, 99.0) * 1e3,
            // Queries over batches: each query is 1/batch of its batch.
            mean_batch: served.len() as f64
                / served
                    .iter()
                    .map(|s| 1.0 / s.batch as f64)
                    .sum::<f64>()
                    .max(1.0),
            met: p99_ms <= bound_ms,
            cv: 0.0,
        }
    }
}

/// The largest coefficient of variation among the batch sizes run at least three times.
fn noise(times: &[(usize, f64)]) -> f64 {
    let mut sizes: Vec<usize> = times.iter().map(|t| t.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
        .into_iter()
        .filter_map(|size| {
            let v: Vec<f64> = times.iter().filter(|t| t.0 == size).map(|t| t.1).collect();
            (v.len() >= 3)
                .then(|| super::stats::Stats::from_samples(&v, 1, 0).map_or(0.0, |s| s.cv))
        })
        .fold(0.0, f64::max)
}

/// What a scenario run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioRun {
    pub config: ScenarioConfig,
    /// The most queries one batch took (`--batch-size`).
    pub max_batch: usize,
    /// Every rate probed, in order (single-stream and offline: their one run).
    pub probes: Vec<Probe>,
    /// The probe the record's samples and headline figures come from: the best rate that met
    /// the bound, else the lowest probed; single-stream and offline: their one run.
    pub reported: usize,
    /// The reported probe's per-query latencies, seconds (the record's samples).
    #[serde(skip)]
    pub latencies_s: Vec<f64>,
    /// Server: the largest probed rate whose p99 met the bound (none met: `None`).
    pub best_qps: Option<f64>,
    /// The median time of one batch of each prepared size, ms (`(size, ms)`).
    pub batch_ms: Vec<(usize, f64)>,
    /// Batches that ran padded to a larger prepared size.
    pub padded_batches: usize,
    /// What MLPerf's rules ask, against what this run did.
    pub rules: String,
}

impl ScenarioRun {
    pub fn reported(&self) -> &Probe {
        &self.probes[self.reported]
    }
}

/// Sessions for batch sizes 1, 2, 4, … and `max_batch`, with their seeded inputs.
pub struct Batches {
    pub sessions: Vec<(usize, Box<dyn Session>, Tensor)>,
    /// Batches that ran padded.
    pub padded: usize,
    /// Every batch run since the last probe: (prepared size, seconds).
    pub times: Vec<(usize, f64)>,
}

impl Batches {
    /// Run a batch of `k` queries on the smallest prepared size that holds it: its seconds
    /// (run, sync, read the output).
    pub fn run(&mut self, k: usize) -> Result<f64> {
        let (size, session, input) = (self.sessions.iter_mut())
            .find(|(size, _, _)| *size >= k)
            .context("a batch larger than the largest prepared")?;
        if *size > k {
            self.padded += 1;
        }
        let start = Instant::now();
        session.run(input)?;
        session.sync()?;
        session.read_output()?;
        let seconds = start.elapsed().as_secs_f64();
        self.times.push((*size, seconds));
        Ok(seconds)
    }

    /// The batch sizes to prepare for a maximum batch.
    pub fn sizes(max_batch: usize) -> Vec<usize> {
        let mut sizes: Vec<usize> = std::iter::successors(Some(1usize), |s| s.checked_mul(2))
            .take_while(|&s| s < max_batch)
            .collect();
        sizes.push(max_batch.max(1));
        sizes
    }
}

/// Run `cfg.scenario` on prepared `batches`; `on_probe` sees each rate as it finishes.
pub fn run(
    cfg: &BenchConfig,
    sc: &ScenarioConfig,
    batches: &mut Batches,
    on_probe: &mut dyn FnMut(&Probe),
) -> Result<ScenarioRun> {
    // Warm every session up, and time each size on its own (the search's upper end).
    let mut batch_ms = Vec::new();
    for i in 0..batches.sessions.len() {
        let size = batches.sessions[i].0;
        let mut times: Vec<f64> = Vec::new();
        for _ in 0..cfg.warmup.max(1) + 3 {
            times.push(batches.run(size)?);
        }
        let mut timed = times.split_off(cfg.warmup.max(1));
        timed.sort_by(f64::total_cmp);
        batch_ms.push((size, percentile(&timed, 50.0) * 1e3));
    }
    batches.padded = 0;
    batches.times.clear();
    let max_batch = cfg.batch_size;
    let bound = sc.latency_bound_ms;
    let timeout = sc.timeout_ms / 1e3;
    let mut rng = Rng::new(cfg.seed.wrapping_add(17));
    // Each probe, with its queries' latencies (seconds).
    let mut probes: Vec<(Probe, Vec<f64>)> = Vec::new();
    let mut keep = |mut p: Probe,
                    served: &[Served],
                    times: &mut Vec<(usize, f64)>,
                    probes: &mut Vec<(Probe, Vec<f64>)>| {
        p.cv = noise(times);
        times.clear();
        on_probe(&p);
        let met = p.met;
        probes.push((p, served.iter().map(Served::latency).collect()));
        met
    };
    let mut probe_at = |rate: f64, probes: &mut Vec<(Probe, Vec<f64>)>| -> Result<bool> {
        let n = sc.queries.max((rate * sc.duration_s).ceil() as usize);
        let arrivals = poisson_arrivals(n, rate, &mut rng);
        let served = serve(&arrivals, max_batch, timeout, &mut |k| batches.run(k))?;
        Ok(keep(
            Probe::of(rate, &served, bound),
            &served,
            &mut batches.times,
            probes,
        ))
    };
    let mut best_qps = None;
    match sc.scenario {
        Scenario::SingleStream => {
            // Each query arrives when the one before it returns: no queue, batch 1; enough
            // queries to fill the duration at the measured latency.
            let one = batch_ms[0].1 / 1e3;
            let n = sc
                .queries
                .max((sc.duration_s / one.max(1e-9)).ceil() as usize);
            let mut served = Vec::with_capacity(n);
            let mut t = 0.0;
            for _ in 0..n {
                let d = batches.run(1)?;
                served.push(Served {
                    arrival: t,
                    start: t,
                    end: t + d,
                    batch: 1,
                });
                t += d;
            }
            keep(
                Probe::of(0.0, &served, bound),
                &served,
                &mut batches.times,
                &mut probes,
            );
        }
        Scenario::Offline => {
            let full = batch_ms.last().map_or(1.0, |b| b.1 / 1e3);
            let n = sc
                .queries
                .max((sc.duration_s / full.max(1e-9) * max_batch as f64).ceil() as usize)
                // Whole batches: offline has no reason to run a partial one.
                .next_multiple_of(max_batch.max(1));
            let served = serve(&vec![0.0; n], max_batch, 0.0, &mut |k| batches.run(k))?;
            keep(
                Probe::of(0.0, &served, f64::INFINITY),
                &served,
                &mut batches.times,
                &mut probes,
            );
        }
        Scenario::Server => match sc.qps {
            Some(rate) => {
                if probe_at(rate, &mut probes)? {
                    best_qps = Some(rate);
                }
            }
            None => {
                // Bisect between nothing and what full batches back to back can do.
                let full = batch_ms.last().context("no batch size")?;
                let mut hi = max_batch as f64 / (full.1 / 1e3).max(1e-9);
                let mut lo = 0.0;
                for _ in 0..7 {
                    let rate = (lo + hi) / 2.0;
                    if probe_at(rate, &mut probes)? {
                        lo = rate;
                        best_qps = Some(rate);
                    } else {
                        hi = rate;
                    }
                }
            }
        },
    }
    let rules = format!(
        "{MLPERF_RULES}; this run: at least {} queries and {} s per run{}",
        sc.queries,
        sc.duration_s,
        if sc.scenario == Scenario::Server {
            format!(
                ", p99 bound {bound} ms, batching timeout {} ms",
                sc.timeout_ms
            )
        } else {
            String::new()
        }
    );
    // The reported probe: the best rate that met the bound, else the lowest probed.
    let reported = (probes
        .iter()
        .position(|(p, _)| p.met && Some(p.target_qps) == best_qps))
    .or_else(|| {
        (0..probes.len()).min_by(|&a, &b| probes[a].0.target_qps.total_cmp(&probes[b].0.target_qps))
    })
    .context("the scenario ran nothing")?;
    let latencies_s = probes[reported].1.clone();
    Ok(ScenarioRun {
        config: sc.clone(),
        max_batch,
        reported,
        latencies_s,
        probes: probes.into_iter().map(|(p, _)| p).collect(),
        best_qps,
        batch_ms,
        padded_batches: batches.padded,
        rules,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_close_when_full_or_timed_out_and_never_before_the_device_is_free() {
        // 10 ms per batch whatever its size.
        let mut compute = |_k: usize| Ok(0.010);
        // Four queries at once, max batch 2: two batches back to back.
        let s = serve(&[0.0; 4], 2, 0.0, &mut compute).unwrap();
        let ends: Vec<f64> = s.iter().map(|q| q.end).collect();
        assert_eq!(ends, [0.010, 0.010, 0.020, 0.020]);
        // A lone query waits the 5 ms timeout for company, then runs alone.
        let s = serve(&[0.0, 0.1], 4, 0.005, &mut compute).unwrap();
        assert_eq!((s[0].start, s[0].batch), (0.005, 1));
        assert!((s[0].latency() - 0.015).abs() < 1e-12);
        // A second query 2 ms later joins the first one's batch.
        let s = serve(&[0.0, 0.002, 0.5], 4, 0.005, &mut compute).unwrap();
        assert_eq!((s[0].batch, s[1].batch, s[2].batch), (2, 2, 1));
        // While the device is busy, arrivals queue and go together once it is free.
        let s = serve(&[0.0, 0.001, 0.002, 0.003], 8, 0.0, &mut compute).unwrap();
        assert_eq!(s[0].batch, 1);
        assert_eq!((s[1].start, s[1].batch), (0.010, 3));
        let p = Probe::of(100.0, &s, 20.0);
        assert_eq!(p.queries, 4);
        assert!((p.mean_batch - 2.0).abs() < 1e-12 && p.met, "{p:?}");
        assert!(!Probe::of(100.0, &s, 15.0).met);
        assert!((p.p99_ms - 19.0).abs() < 0.1, "{p:?}");
    }

    #[test]
    fn poisson_arrivals_keep_their_rate() {
        let a = poisson_arrivals(20_000, 50.0, &mut Rng::new(1));
        let rate = a.len() as f64 / a.last().unwrap();
        assert!((rate - 50.0).abs() < 2.0, "{rate}");
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(Batches::sizes(6), [1, 2, 4, 6]);
        assert_eq!(Batches::sizes(1), [1]);
        assert_eq!(Batches::sizes(8), [1, 2, 4, 8]);
    }
}

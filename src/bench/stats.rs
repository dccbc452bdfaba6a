//! Summary statistics of per-iteration samples, the way the course reports them: median and
//! mean, spread (std, coefficient of variation), extremes, and the derived rates.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub mean_s: f64,
    pub median_s: f64,
    /// Sample standard deviation (n − 1).
    pub std_s: f64,
    /// std / mean: above a few percent, differences between runs need care.
    pub cv: f64,
    pub min_s: f64,
    pub max_s: f64,
    /// The 90th and 99th percentiles of the iteration times (the median is the 50th): the
    /// tail latency a server's users see (0 in records written before they were kept).
    #[serde(default)]
    pub p90_s: f64,
    #[serde(default)]
    pub p99_s: f64,
    /// Images per second from the mean step (total images / total time, as
    /// micro_benchmarking_pytorch.py reports it).
    pub throughput: f64,
    /// Images per second from the median step (robust to a few slow iterations).
    pub throughput_median: f64,
    /// The mean step in milliseconds (micro_benchmarking_pytorch.py's "time per batch").
    pub ms_per_batch: f64,
    /// Microseconds per image at the median step (what the throughput's median says).
    pub us_per_sample: f64,
    /// Conv + linear FLOPs (2 per MAC) per second at the median step.
    pub gflops: f64,
}

impl Stats {
    /// Statistics of `samples` (seconds per batch of `batch` images doing `flops` each step).
    /// Returns `None` for an empty sample set.
    pub fn from_samples(samples: &[f64], batch: usize, flops: u64) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        let n = samples.len() as f64;
        let mean = samples.iter().sum::<f64>() / n;
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = percentile(&sorted, 50.0);
        let var = if samples.len() > 1 {
            samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        let std = var.sqrt();
        let b = batch as f64;
        Some(Stats {
            mean_s: mean,
            median_s: median,
            std_s: std,
            cv: if mean > 0.0 { std / mean } else { 0.0 },
            p90_s: percentile(&sorted, 90.0),
            p99_s: percentile(&sorted, 99.0),
            min_s: sorted[0],
            max_s: sorted[sorted.len() - 1],
            throughput: b / mean,
            throughput_median: b / median,
            ms_per_batch: mean * 1e3,
            us_per_sample: median * 1e6 / b,
            gflops: flops as f64 / median / 1e9,
        })
    }
}

/// The `q`-th percentile (0 to 100) of ascending `sorted` samples, interpolated linearly
/// between the two nearest ranks (NumPy's default); 0 for no samples.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => {
            let rank = q.clamp(0.0, 100.0) / 100.0 * (n - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_samples_give_known_stats() {
        let s = Stats::from_samples(&[0.1, 0.2, 0.3, 0.4], 8, 4_000_000_000).unwrap();
        assert!((s.mean_s - 0.25).abs() < 1e-12);
        assert!((s.median_s - 0.25).abs() < 1e-12);
        // Sample std of 0.1..0.4: sqrt(0.05/3).
        assert!((s.std_s - (0.05f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((s.throughput - 32.0).abs() < 1e-9);
        assert!((s.us_per_sample - 31_250.0).abs() < 1e-6);
        assert!((s.gflops - 16.0).abs() < 1e-9);
        assert_eq!(Stats::from_samples(&[], 1, 0), None);
        // NumPy: np.percentile([1, 2, 3, 4], [50, 90, 99]) = 2.5, 3.7, 3.97.
        let sorted = [1.0, 2.0, 3.0, 4.0];
        for (q, want) in [
            (50.0, 2.5),
            (90.0, 3.7),
            (99.0, 3.97),
            (0.0, 1.0),
            (100.0, 4.0),
        ] {
            assert!((percentile(&sorted, q) - want).abs() < 1e-12, "p{q}");
        }
    }
}

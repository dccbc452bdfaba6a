//! Where the time goes: per-kernel and per-operator statistics over the timed iterations, the
//! CPU-overhead ratio, the rocprof-style CSV, and a Chrome/Perfetto trace. Kernel times come
//! from the session (CPU timers on the CPU backend, timestamp queries on GPUs).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::backend::KernelTime;

/// One timed iteration as the profiler saw it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct IterationTimes {
    /// Start of the iteration on the host clock, µs since the run started.
    pub start_us: f64,
    /// Host wall time of the whole iteration (run, sync, read back, loss).
    pub host_s: f64,
    pub kernels: Vec<KernelTime>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelStat {
    pub name: String,
    pub calls: usize,
    pub total_ns: u64,
    pub average_ns: f64,
    /// Share of all kernel time, in percent.
    pub percentage: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub iterations: usize,
    /// By kernel, most time first.
    pub kernels: Vec<KernelStat>,
    /// By operator kind (conv2d, batch_norm, ...), most time first.
    pub ops: Vec<KernelStat>,
    /// Kernel time per iteration (the device busy time).
    pub device_ms_per_iter: f64,
    /// Host wall time per iteration.
    pub host_ms_per_iter: f64,
    /// host / device: 1.0 means the device was never idle; above it, the rest is launch
    /// overhead, synchronisation, copies and host work.
    pub cpu_overhead: f64,
}

fn stats(groups: BTreeMap<String, (usize, u64)>, total: u64) -> Vec<KernelStat> {
    let mut v: Vec<KernelStat> = groups
        .into_iter()
        .map(|(name, (calls, ns))| KernelStat {
            name,
            calls,
            total_ns: ns,
            average_ns: ns as f64 / calls.max(1) as f64,
            percentage: 100.0 * ns as f64 / total.max(1) as f64,
        })
        .collect();
    v.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then(a.name.cmp(&b.name)));
    v
}

/// Aggregate the timed iterations; `None` when there are none.
pub fn aggregate(iters: &[IterationTimes]) -> Option<Profile> {
    if iters.is_empty() {
        return None;
    }
    let mut by_kernel: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut by_op: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut total = 0u64;
    for it in iters {
        for k in &it.kernels {
            let e = by_kernel.entry(k.kernel.clone()).or_default();
            e.0 += 1;
            e.1 += k.ns;
            let e = by_op.entry(k.op.clone()).or_default();
            e.0 += 1;
            e.1 += k.ns;
            total += k.ns;
        }
    }
    let n = iters.len() as f64;
    let device_ms = total as f64 / n / 1e6;
    let host_ms = iters.iter().map(|i| i.host_s).sum::<f64>() / n * 1e3;
    Some(Profile {
        iterations: iters.len(),
        kernels: stats(by_kernel, total),
        ops: stats(by_op, total),
        device_ms_per_iter: device_ms,
        host_ms_per_iter: host_ms,
        cpu_overhead: if device_ms > 0.0 {
            host_ms / device_ms
        } else {
            0.0
        },
    })
}

/// The kernel table in the columns rocprof --stats writes.
pub fn csv(p: &Profile) -> String {
    let mut s =
        String::from("\"Name\",\"Calls\",\"TotalDurationNs\",\"AverageNs\",\"Percentage\"\n");
    for k in &p.kernels {
        s.push_str(&format!(
            "\"{}\",{},{},{:.0},{:.4}\n",
            k.name, k.calls, k.total_ns, k.average_ns, k.percentage
        ));
    }
    s
}

/// A Chrome trace (chrome://tracing, ui.perfetto.dev): a host track with one event per
/// iteration and a device track with every kernel, placed at the iteration's start plus the
/// kernel's offset on the device clock.
pub fn trace(iters: &[IterationTimes], device: &str) -> serde_json::Value {
    let mut events = vec![
        serde_json::json!({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "host"}}),
        serde_json::json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "benchmark loop"}}),
        serde_json::json!({"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": format!("device: {device}")}}),
        serde_json::json!({"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "queue 0"}}),
    ];
    for (i, it) in iters.iter().enumerate() {
        events.push(serde_json::json!({
            "ph": "X", "name": format!("iteration {i}"), "cat": "host", "pid": 1, "tid": 1,
            "ts": it.start_us, "dur": it.host_s * 1e6,
        }));
        for k in &it.kernels {
            // A kernel of several layers names the others too.
            let mut args = serde_json::json!({"node": k.node});
            if !k.fused.is_empty() {
                args["fused"] = serde_json::json!(k.fused);
            }
            events.push(serde_json::json!({
                "ph": "X", "name": k.kernel, "cat": k.op, "pid": 2, "tid": 1,
                "ts": it.start_us + k.start_ns as f64 / 1e3, "dur": k.ns as f64 / 1e3,
                "args": args,
            }));
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kt(op: &str, kernel: &str, start_ns: u64, ns: u64) -> KernelTime {
        KernelTime {
            node: "n".into(),
            op: op.into(),
            kernel: kernel.into(),
            start_ns,
            ns,
            fused: Vec::new(),
        }
    }

    #[test]
    fn aggregates_sort_and_ratio() {
        let iters = vec![
            IterationTimes {
                start_us: 0.0,
                host_s: 0.004,
                kernels: vec![
                    kt("conv2d", "a", 0, 3_000_000),
                    kt("relu", "b", 3_000_000, 1_000_000),
                ],
            },
            IterationTimes {
                start_us: 5000.0,
                host_s: 0.006,
                kernels: vec![
                    kt("conv2d", "a", 0, 3_000_000),
                    kt("relu", "b", 3_000_000, 1_000_000),
                ],
            },
        ];
        let p = aggregate(&iters).unwrap();
        assert_eq!(p.kernels[0].name, "a");
        assert_eq!((p.kernels[0].calls, p.kernels[0].total_ns), (2, 6_000_000));
        assert!((p.kernels[0].percentage - 75.0).abs() < 1e-9);
        assert!(
            (p.device_ms_per_iter - 4.0).abs() < 1e-9 && (p.host_ms_per_iter - 5.0).abs() < 1e-9
        );
        assert!((p.cpu_overhead - 1.25).abs() < 1e-9);
        assert!(csv(&p).starts_with("\"Name\",\"Calls\",\"TotalDurationNs\",\"AverageNs\",\"Percentage\"\n\"a\",2,6000000,3000000,75.0000"));
        assert_eq!(aggregate(&[]), None);
    }
}

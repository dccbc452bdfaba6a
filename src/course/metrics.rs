//! The one table of the metrics course steps record: each name, the step kinds that produce
//! it, its unit, whether it is derived from timings (and so judged with the noise rule), and
//! what it means. The steps record through [`Recorded::set`], lint checks expectations
//! against [`names_of`], the verdicts ask [`is_timing`], and the schema's docs point here, so
//! a metric is added in one place.

use std::collections::BTreeMap;

use super::schema::StepKind;

/// Where a metric's name comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The name as it is (`throughput`).
    Step,
    /// Per top-level module of the network: `MODULE.name` (`layer1.latency_ms`).
    PerModule,
    /// Per op kind: `op.KIND.name` (`op.conv2d.time_pct`).
    PerOpKind,
    /// Per compared step of a chart step: `STEP.name` (`fp16.ratio`).
    PerComparedStep,
    /// Per bandwidth probe kernel: `KERNEL_gbps` (`copy_gbps`, `triad_gbps`).
    PerProbe,
}

/// One metric.
#[derive(Debug)]
pub struct Metric {
    /// The name (for [`Scope::Step`]) or its last part (`latency_ms` of `layer1.latency_ms`).
    pub name: &'static str,
    pub scope: Scope,
    /// The step kinds that record it.
    pub kinds: &'static [StepKind],
    pub unit: &'static str,
    /// Derived from timings: a check of it is inconclusive when the run was too noisy.
    pub timing: bool,
    pub doc: &'static str,
}

use StepKind::{Bench, Profile};

const RUNS: &[StepKind] = &[Bench, Profile];

macro_rules! metrics {
    ($($name:literal $scope:ident [$($kind:ident),*] $unit:literal $timing:literal $doc:literal;)*) => {
        /// Every metric, in the order the schema's documentation lists them.
        pub const METRICS: &[Metric] = &[$(Metric {
            name: $name,
            scope: Scope::$scope,
            kinds: metrics!(@kinds $($kind),*),
            unit: $unit,
            timing: $timing,
            doc: $doc,
        }),*];
    };
    (@kinds RUNS) => { RUNS };
    (@kinds $($kind:ident),*) => { &[$(StepKind::$kind),*] };
}

metrics! {
    // A benchmark run: bench and profile steps.
    "throughput" Step [RUNS] "images/s" true "median images per second over the timed iterations";
    "throughput_mean" Step [RUNS] "images/s" true "images per second over the mean iteration time";
    "median_ms" Step [RUNS] "ms" true "median time of one timed iteration (a batch)";
    "mean_ms" Step [RUNS] "ms" true "mean time of one timed iteration";
    "std_ms" Step [RUNS] "ms" true "standard deviation of the timed iterations";
    "min_ms" Step [RUNS] "ms" true "fastest timed iteration";
    "max_ms" Step [RUNS] "ms" true "slowest timed iteration";
    "p90_ms" Step [RUNS] "ms" true "90th percentile of the timed iterations (a scenario's: of its queries' latencies)";
    "p99_ms" Step [RUNS] "ms" true "99th percentile of the timed iterations (a scenario's: of its queries' latencies)";
    "p50_ms" Step [Bench] "ms" true "a scenario's median query latency";
    "queue_p99_ms" Step [Bench] "ms" true "a scenario's 99th percentile of the time queries waited for their batch";
    "compute_p99_ms" Step [Bench] "ms" true "a scenario's 99th percentile of the compute time of the queries' batches";
    "mean_batch" Step [Bench] "queries" false "a scenario's mean queries per batch";
    "best_qps" Step [Bench] "queries/s" true "a server scenario's largest rate whose p99 latency met the bound";
    "cv" Step [Bench, Profile, Chart, Llm, Sweep, Kernel] "ratio" false "coefficient of variation of the timed iterations (std / mean); of a multi-device run, the noisiest of its runs; of a chart, the noisiest run it compares; of a language model, of its decode steps (the noisiest run of a sweep); of a sweep, its noisiest run; of a kernel step, the noisier of the student's kernel and the start";
    "us_per_sample" Step [RUNS] "µs" true "median microseconds per image";
    "gflops" Step [RUNS] "GFLOP/s" true "the network's FLOPs per second at the median time";
    "peak_memory_mib" Step [RUNS] "MiB" false "weights and the most activations alive at once";
    "loss" Step [RUNS] "nats" false "cross-entropy of the last iteration against seeded labels";
    "enqueue_us" Step [RUNS] "µs" false "median host time to enqueue a pass (asynchronous backends)";
    "max_batch" Step [Bench] "images" false "the largest batch the device's memory holds, estimated";
    // The machine during the run (`bench::telemetry`), where it could be read.
    "unsteady" Step [Bench, Profile, Llm, Sweep, Peak] "0/1" false "1 when the machine was not steady during the timed run or the peak probes (the device throttled or ran below its rated clock, other programs or the hypervisor took the CPU): the step's timing checks are then inconclusive. A step of several runs (a sweep, several devices) records its first unsteady run's figures, else its last run's";
    "throttled" Step [Bench, Profile, Llm, Sweep, Peak] "ratio" false "share of the readings in which the GPU held its clocks back (power cap, thermal slowdown; where the driver reports reasons)";
    "clock_ratio" Step [Bench, Profile, Llm, Sweep, Peak] "ratio" false "the device's median clock during the run / its rated clock";
    "other_cores" Step [Bench, Profile, Llm, Sweep, Peak] "cores" false "cores other programs kept busy during the timed run (Linux)";
    "steal" Step [Bench, Profile, Llm, Sweep, Peak] "ratio" false "share of the CPU time the hypervisor gave to other machines during the timed run";
    "energy_j" Step [Bench, Profile, Llm, Sweep] "J" false "the device's energy over the timed iterations (from its counter, else its power readings)";
    "per_joule" Step [Bench, Profile, Llm, Sweep] "images/J" false "images per joule over the timed iterations (a language model's: new tokens per joule)";
    // Compiled runs (`compile`).
    "compile_s" Step [RUNS] "s" false "seconds spent compiling (passes, autotuning, recording)";
    "rel_diff" Step [Bench, Profile, Accuracy] "ratio" false "largest output difference from FP32 eager, relative to the largest output";
    "memory_saved" Step [RUNS] "ratio" false "fraction of eager's memory the compiled network saves";
    "replayed" Step [RUNS] "0/1" false "1 when the pass ran as a recorded replay (reduce-overhead)";
    "autotune_timed" Step [RUNS] "shapes" false "layer shapes max-autotune timed in this run";
    "autotune_cached" Step [RUNS] "shapes" false "layer shapes whose choice came from the autotune cache";
    // Multi-device runs (`devices` or `cpu_groups`).
    "scaling_efficiency" Step [Bench] "ratio" true "global throughput / (devices × one device's throughput)";
    "spread" Step [Bench] "ratio" true "(slowest − fastest) / fastest device's median";
    "devices" Step [Bench] "devices" false "devices in the run";
    "single_throughput" Step [Bench] "images/s" true "one device's throughput at the same per-device batch";
    // Profile steps.
    "device_ms" Step [Profile] "ms" true "kernel time of one pass on the device's clock";
    "cpu_overhead" Step [Profile] "ratio" true "host time / device time of a pass";
    "efficiency" Step [Profile] "ratio" true "achieved GFLOP/s / the measured GEMM peak";
    "intensity" Step [Profile] "FLOP/byte" false "the network's arithmetic intensity";
    "peak_gflops" Step [Profile] "GFLOP/s" false "the measured GEMM peak the efficiency is against";
    "balance" Step [Profile] "FLOP/byte" false "machine balance: peak / bandwidth";
    "latency_ms" PerModule [Profile] "ms" true "the module's time in the profiled pass";
    "latency_pct" PerModule [Profile] "%" false "the module's share of the pass";
    "gflops" PerModule [Profile] "GFLOP/s" true "the module's FLOPs per second";
    "intensity" PerModule [Profile] "FLOP/byte" false "the module's arithmetic intensity";
    "time_pct" PerOpKind [Profile] "%" false "the op kind's share of the kernel time";
    // Sweeps.
    "best_throughput" Step [Sweep] "images/s" true "the highest throughput of the sweep";
    "best_value" Step [Sweep] "value" false "the parameter value that gave it";
    "scaling" Step [Sweep, Llm] "ratio" true "last value's throughput / first value's (a language model's: decode tokens per second)";
    "best_gflops" Step [Sweep] "GFLOP/s" true "the highest FLOPs per second of the sweep";
    "peak_pct_first" Step [Sweep] "%" true "the first value's GFLOP/s as a share of the measured GEMM peak";
    "peak_pct_last" Step [Sweep] "%" true "the last value's GFLOP/s as a share of the measured GEMM peak";
    "vs_reference_first" Step [Sweep] "ratio" true "the first value's time (at the published batch) / the first published time";
    "vs_reference_last" Step [Sweep] "ratio" true "the last value's time (at the published batch) / the last published time";
    // Language models (`llm` steps).
    "ttft_ms" Step [Llm] "ms" true "time to first token: the prefill of the prompt and the first token's choice (median)";
    "tpot_ms" Step [Llm] "ms" true "time per output token after the first (median over the timed generations)";
    "prefill_tokens_per_s" Step [Llm] "tokens/s" true "prompt tokens of the whole batch per second of TTFT";
    "decode_tokens_per_s" Step [Llm] "tokens/s" true "new tokens per second over the batch (median decode step)";
    "decode_gbps" Step [Llm] "GB/s" true "bytes a decode step reads (weights once, the KV cache so far) per second";
    "bandwidth_pct" Step [Llm] "%" true "decode_gbps as a share of the bandwidth a plain read of the run's weights reached beside it (on a GPU, the triad of workshop peak)";
    "prefill_gflops" Step [Llm] "GFLOP/s" true "the prefill's FLOPs per second";
    "decode_peak_pct" Step [Llm] "%" true "a decode step's FLOPs per second as a share of the measured GEMM peak";
    "peak_pct" Step [Llm] "%" true "prefill_gflops as a share of the measured GEMM peak";
    "kv_bytes_per_token" Step [Llm] "bytes" false "KV cache bytes one token of one sequence holds";
    "kv_cache_mib" Step [Llm] "MiB" false "the KV cache preallocated for the whole context of every sequence";
    "tpot_growth" Step [Llm] "ratio" true "a sweep's last TPOT / its first";
    "ttft_growth" Step [Llm] "ratio" true "a sweep's last TTFT / its first";
    // Accuracy.
    "max_abs_diff" Step [Accuracy, Kernel] "value" false "largest |Δlogit| against FP32; of a kernel step, largest |Δ| of the output against the engine's kernel";
    "top1_agreement" Step [Accuracy] "ratio" false "fraction of images whose top-1 class matches FP32's";
    // Kernel steps.
    "correct" Step [Kernel] "0/1" false "1 when the student's kernel gave the engine's kernel's output within the tolerance";
    "kernel_ms" Step [Kernel] "ms" true "median time of the student's kernel in one pass (the device's clock)";
    "start_ms" Step [Kernel] "ms" true "median time of the start kernel, timed in the same rounds";
    "engine_ms" Step [Kernel] "ms" true "median time of the engine's own kernel, timed in the same rounds";
    "speedup" Step [Kernel] "ratio" true "start_ms / kernel_ms";
    "vs_engine" Step [Kernel] "ratio" true "engine_ms / kernel_ms: above 1, faster than the engine's own kernel";
    // Doctor.
    "cores" Step [Doctor] "cores" false "logical CPU cores";
    "memory_gib" Step [Doctor] "GiB" false "host memory";
    // Peak.
    "gemm_gflops" Step [Peak] "GFLOP/s" true "the measured GEMM peak";
    "ceiling_gflops" Step [Peak] "GFLOP/s" true "the compute ceiling above it (a CPU's FMA throughput, measured right after the GEMM; a GPU's specification)";
    "ceiling_share_beside" Step [Peak] "ratio" true "the GEMM's GFLOP/s over the ceiling's chains timed just before each GEMM, median (where the ceiling is measured: a CPU)";
    "gbps" PerProbe [Peak] "GB/s" true "memory bandwidth of the copy and triad probes (copy_gbps, triad_gbps)";
    // Charts.
    "warnings" Step [Chart] "count" false "what differed between the compared runs besides the setting";
    "ratio" PerComparedStep [Chart] "ratio" true "the step's throughput / the first step's";
    "faster" PerComparedStep [Chart] "0/1" false "1 when the step is faster beyond the noise";
    "slower" PerComparedStep [Chart] "0/1" false "1 when the step is slower beyond the noise";
    "unclear" PerComparedStep [Chart] "0/1" false "1 when the difference is within the noise";
}

/// The entry of a metric name as a step records it (`throughput`, `layer1.latency_ms`,
/// `op.conv2d.time_pct`, `fp16.ratio`, `triad_gbps`), if the table has one.
pub fn lookup(name: &str) -> Option<&'static Metric> {
    let exact = METRICS
        .iter()
        .find(|m| m.scope == Scope::Step && m.name == name);
    exact.or_else(|| {
        let (prefix, last) = name.rsplit_once('.').unwrap_or(("", name));
        METRICS.iter().find(|m| match m.scope {
            Scope::Step => false,
            Scope::PerProbe => {
                prefix.is_empty()
                    && name
                        .strip_suffix(m.name)
                        .is_some_and(|k| k.ends_with('_') && k.len() > 1)
            }
            Scope::PerOpKind => m.name == last && prefix.starts_with("op.") && prefix.len() > 3,
            Scope::PerModule | Scope::PerComparedStep => m.name == last && !prefix.is_empty(),
        })
    })
}

/// Whether a recorded metric depends on timing (and so on how quiet the machine was).
/// Values derived by compare steps are named by the course and are not timings here.
pub fn is_timing(name: &str) -> bool {
    lookup(name).is_some_and(|m| m.timing)
}

/// The plain names (scope [`Scope::Step`]) a kind of step records; patterned names come on
/// top (see [`Scope`]), and a compare step records the names of its `derive` entries.
pub fn names_of(kind: StepKind) -> impl Iterator<Item = &'static str> {
    METRICS
        .iter()
        .filter(move |m| m.scope == Scope::Step && m.kinds.contains(&kind))
        .map(|m| m.name)
}

/// The metrics one step run recorded, by name.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Recorded(pub BTreeMap<String, f64>);

impl Recorded {
    /// Record `name` = `value`. The name must be in [`METRICS`] for this kind: a step that
    /// records a name the table lacks is a bug that the course tests catch
    /// (`recorded_metrics_are_in_the_table` in tests/course.rs).
    pub fn set(&mut self, name: impl Into<String>, value: f64) {
        self.0.insert(name.into(), value);
    }

    pub fn extend(&mut self, other: Recorded) {
        self.0.extend(other.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use StepKind::{Accuracy, Chart, Doctor, Peak, Sweep};

    #[test]
    fn names_resolve_to_their_entries() {
        assert_eq!(lookup("throughput").unwrap().unit, "images/s");
        assert_eq!(lookup("layer1.latency_ms").unwrap().scope, Scope::PerModule);
        assert_eq!(lookup("layer4.gflops").unwrap().scope, Scope::PerModule);
        assert_eq!(lookup("gflops").unwrap().scope, Scope::Step);
        assert_eq!(
            lookup("op.conv2d.time_pct").unwrap().scope,
            Scope::PerOpKind
        );
        assert_eq!(lookup("fp16.ratio").unwrap().scope, Scope::PerComparedStep);
        assert_eq!(lookup("triad_gbps").unwrap().scope, Scope::PerProbe);
        for unknown in [
            "ratio",
            "op.time_pct",
            "_gbps",
            "gbps",
            "fp16_speedup",
            "nonsense",
        ] {
            assert!(lookup(unknown).is_none(), "{unknown}");
        }
    }

    /// The noise rule's old name test, kept as the table's flags (issue 26 moved it here
    /// unchanged; issue 29 revisits which metrics count as timings).
    #[test]
    fn timing_flags() {
        for t in [
            "throughput",
            "median_ms",
            "us_per_sample",
            "gflops",
            "layer1.latency_ms",
            // The peak probes are timed too: a GEMM on busy cores reads low.
            "gemm_gflops",
            "triad_gbps",
        ] {
            assert!(is_timing(t), "{t}");
        }
        for t in ["cv", "loss", "op.conv2d.time_pct", "fp16_speedup"] {
            assert!(!is_timing(t), "{t}");
        }
    }

    #[test]
    fn every_kind_that_measures_has_names() {
        for kind in [Bench, Profile, Sweep, Accuracy, Doctor, Peak, Chart] {
            assert!(names_of(kind).next().is_some(), "{kind:?}");
        }
        // The drift issue 26 found: profile steps record the whole bench set.
        assert!(names_of(Profile).any(|n| n == "mean_ms"));
    }

    #[test]
    fn names_are_unique_per_scope() {
        for (i, a) in METRICS.iter().enumerate() {
            for b in &METRICS[i + 1..] {
                assert!(!(a.name == b.name && a.scope == b.scope), "{}", a.name);
            }
        }
    }
}

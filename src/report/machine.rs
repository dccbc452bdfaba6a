//! The machine as text: `doctor`, the peak probes and their ceiling, the kernels check.

use crate::bench::telemetry::Telemetry;
use crate::doctor;
use crate::units::human_bytes;

use super::new_table;

/// The `workshop doctor` report, ready to paste into an issue or a chat.
pub fn doctor(d: &doctor::Report) -> String {
    let mut s = String::new();
    let mem = |b: Option<u64>| b.map_or("unknown".to_string(), human_bytes);
    s.push_str(&format!(
        "workshop {} on {} ({}), kernel {}\n",
        d.runner_version, d.os, d.arch, d.kernel
    ));
    s.push_str(&format!(
        "CPU: {} — {} cores, features: {}\n",
        d.cpu_model,
        d.cores.map_or("?".into(), |c| c.to_string()),
        if d.cpu_features.is_empty() {
            "none detected".to_string()
        } else {
            d.cpu_features.join(" ")
        }
    ));
    if let Some(paths) = &d.cpu_paths {
        s.push_str(&format!("     {paths}\n"));
    }
    s.push_str(&format!(
        "Memory: {} total, {} available\n",
        mem(d.memory_bytes),
        human_bytes(d.available_memory_bytes)
    ));
    if let Some(font) = &d.chart_font {
        s.push_str(&format!("Charts: drawn with {font}\n"));
    }
    if let Some(why) = &d.charts_problem {
        s.push_str(&format!("Charts: {why}\n"));
    }
    s.push_str("Backends:\n");
    for b in &d.backends {
        s.push_str(&format!("  {:<5} {}", b.backend.name(), b.status));
        if let Some(r) = &b.reason {
            s.push_str(&format!(" — {r}"));
        }
        s.push('\n');
        for (i, dev) in b.devices.iter().enumerate() {
            s.push_str(&format!(
                "        [{i}] {}{}{}\n",
                dev.name,
                dev.memory_bytes
                    .map(|m| format!(", {}", human_bytes(m)))
                    .unwrap_or_default(),
                dev.driver
                    .as_ref()
                    .map(|v| format!(", {v}"))
                    .unwrap_or_default()
            ));
            // CPU features are on the CPU line already; GPU adapters list theirs here.
            if !b.backend.is_host() && !dev.features.is_empty() {
                s.push_str(&format!("            {}\n", dev.features.join(" ")));
            }
        }
        if let Some(t) = &b.telemetry {
            s.push_str(&format!("        telemetry: {t}\n"));
        }
        if let Some(v) = &b.vendor {
            s.push_str(&format!("        vendor: {v}\n"));
        }
    }
    s.trim_end().to_string()
}

/// The `Machine` line of a measurement's telemetry (what was read, or why nothing was),
/// labelled `width` wide; nothing where the record has none.
pub fn state_line(t: Option<&Result<Telemetry, String>>, width: usize) -> String {
    match t {
        None => String::new(),
        Some(Err(why)) => format!("{:<width$}not recorded: {why}\n", "Machine"),
        Some(Ok(t)) => format!("{:<width$}{}\n", "Machine", t.describe()),
    }
}

/// The `Not steady` line where the telemetry found reasons the numbers are not the device's own
/// speed; nothing otherwise.
pub fn unsteady_line(t: Option<&Result<Telemetry, String>>, width: usize) -> String {
    match t {
        Some(Ok(t)) if !t.summary.concerns.is_empty() => format!(
            "{:<width$}{}: these times are not the device's own speed (the course judges them inconclusive)\n",
            "Not steady",
            t.summary.concerns.join("; ")
        ),
        _ => String::new(),
    }
}

/// A cached measurement in a few words: "GEMM median 172.5 GFLOP/s (1024³ FP32, measured
/// 2026-11-30T20:06:31Z)".
pub fn kept_peak(c: &crate::bench::peak::CachedPeak) -> String {
    format!(
        "GEMM median {:.1} GFLOP/s ({}³ {}, measured {})",
        c.gemm.gflops,
        c.gemm.size,
        c.gemm.precision.name().to_uppercase(),
        c.measured_at()
    )
}

/// `workshop peak`, in the shape of the classic validated-GEMM test.
pub fn peak(
    g: &crate::bench::peak::GemmPeak,
    bw: Option<&[crate::bench::peak::Bandwidth]>,
) -> String {
    let mut s = format!(
        "GEMM {0}×{0}×{0} {1} on {2}: {3}/{4} iterations validated (success rate {5:.0}%, max relative error {6:.1e})\n\
         Median {7:.1} GFLOP/s ({8:.3} ms per GEMM{10}), best {9:.1} GFLOP/s",
        g.size,
        g.precision.name().to_uppercase(),
        g.backend,
        g.validated,
        g.iterations,
        100.0 * g.validated as f64 / g.iterations.max(1) as f64,
        g.max_rel_error,
        g.gflops,
        g.median_s * 1e3,
        g.best_gflops,
        if g.backend.times_on_device() {
            ", kernel time on the device"
        } else {
            ", the kernel's time alone"
        }
    );
    match bw {
        Some(bw) => {
            for b in bw {
                s.push_str(&format!(
                    "\nMemory {:<5} {:.1} GB/s (median), {:.1} GB/s best, {} per pass",
                    b.kernel,
                    b.median_gbps,
                    b.best_gbps,
                    human_bytes(b.bytes)
                ));
            }
            // STREAM's rule: the arrays together at least 4× the last-level cache, or the
            // probe times the cache (host memory: a GPU probe's arrays are the device's).
            let cached = bw
                .iter()
                .find(|b| b.cache_bytes.is_some_and(|c| b.bytes < 4 * c));
            if let Some(llc) = cached.and_then(|b| b.cache_bytes) {
                let mib = (2 * llc).div_ceil(1 << 20).next_power_of_two();
                s.push_str(&format!(
                    "\nThese arrays fit in the CPU's {} last-level cache: this measured the cache, not memory (use --array-mib {mib} or more)",
                    human_bytes(llc)
                ));
            }
        }
        None => s.push_str("\nMemory bandwidth: this backend has no bandwidth probe yet."),
    }
    let t = g.telemetry.as_ref();
    let state = format!("{}{}", state_line(t, 13), unsteady_line(t, 13));
    if !state.is_empty() {
        s.push('\n');
        s.push_str(state.trim_end());
    }
    s
}

/// The line after a GEMM peak that places it under the device's compute ceiling for the
/// GEMM's precision: the FMA ceiling measured on a CPU's registers, or a GPU's specification
/// peak (FP32 lanes, or tensor cores for FP16 and BF16); `None`: not known for this device and
/// precision, and said so.
pub fn ceiling(
    g: &crate::bench::peak::GemmPeak,
    t: Option<&crate::bench::peak::Theoretical>,
) -> String {
    let share = |ceiling: f64| {
        let pct = 100.0 * g.gflops / ceiling;
        let mut s = format!(
            ": the GEMM reaches {pct:.0}% of it{}",
            if pct > 100.0 {
                " (so the cores ran faster than the ceiling assumes)"
            } else {
                ""
            }
        );
        // Against the chains run just before each GEMM: the share at the clock it ran at.
        if let Some(b) = &g.beside {
            s.push_str(&format!(
                "; {:.0}% of the same chains timed just before each GEMM (their median {:.1} GFLOP/s{})",
                100.0 * b.share,
                b.chains_gflops,
                if b.chains_gflops < 0.9 * ceiling {
                    ": the cores ran slower while the GEMMs did than at their best, and this share is the GEMM's own"
                } else {
                    ""
                }
            ));
        }
        s
    };
    let p = g.precision.name().to_uppercase();
    match t {
        Some(t) if t.measured => format!(
            "{} {:.1} GFLOP/s ({}){}",
            t.name,
            t.gflops,
            t.how,
            share(t.gflops)
        ),
        Some(t) => format!(
            "Theoretical {p} peak {:.1} GFLOP/s = {}{}",
            t.gflops,
            t.how,
            share(t.gflops)
        ),
        None if g.precision != crate::model::Precision::Fp32 => format!(
            "Theoretical {p} peak: not known for this device and precision (neither measured nor in a specification this build knows), so no share of it is given"
        ),
        None => "Theoretical peak: this device does not report the facts to compute it".into(),
    }
}

/// `workshop dev kernels-check`: one row per file, compiler and target, a column per
/// precision, then the full log of every failure and why anything was skipped.
pub fn kernels_check(checks: &[crate::backend::check::KernelCheck]) -> String {
    use crate::backend::check::CompileOutcome;
    let mut t = new_table();
    t.set_header(["file", "compiler", "target", "fp32", "fp16", "bf16"]);
    let mut rows: Vec<(&str, &str, &str)> = Vec::new();
    for c in checks {
        let key = (c.file, c.compiler, c.target.as_str());
        if !rows.contains(&key) {
            rows.push(key);
        }
    }
    let mut notes = Vec::new();
    for (file, compiler, target) in rows {
        let mut cells = vec![format!("kernels/{file}"), compiler.into(), target.into()];
        for p in [
            crate::model::Precision::Fp32,
            crate::model::Precision::Fp16,
            crate::model::Precision::Bf16,
        ] {
            let c = checks.iter().find(|c| {
                c.file == file && c.compiler == compiler && c.target == target && c.precision == p
            });
            cells.push(match c.map(|c| (&c.outcome, c.seconds)) {
                Some((CompileOutcome::Compiled, s)) => format!("ok {s:.2} s"),
                Some((CompileOutcome::Failed(log), _)) => {
                    notes.push(format!(
                        "FAILED kernels/{file} ({compiler}, {target}, {p}):\n{log}"
                    ));
                    "FAILED".into()
                }
                Some((CompileOutcome::Skipped(why), _)) => {
                    notes.push(format!("skipped {compiler}: {why}"));
                    "skipped".into()
                }
                Some((CompileOutcome::NotSupported(why), _)) => {
                    if p == crate::model::Precision::Fp32 {
                        notes.push(format!("not built {compiler} {target}: {why}"));
                    }
                    "not supported".into()
                }
                None => "-".into(),
            });
        }
        t.add_row(cells);
    }
    let mut out = format!("Kernel compile check (no GPU needed)\n{t}");
    for n in notes {
        out.push('\n');
        out.push_str(&n);
    }
    out
}

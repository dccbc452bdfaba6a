//! Profiles as text: the operator and kernel tables and the FLOPs profile in DeepSpeed's
//! layout.

use comfy_table::{Cell, CellAlignment};

use std::fmt::Write as _;

use super::new_table;
use crate::bench::flops::{FlopsProfile, Module};
use crate::units::{duration_ns, si};

/// The operator and kernel tables of `record`'s profile `p`, and what the CPU-overhead ratio
/// means.
pub fn profile(
    record: &crate::bench::record::BenchRecord,
    p: &crate::bench::profile::Profile,
    top: usize,
) -> String {
    tables(record, p, top, true)
}

/// Why the calls outnumber the layers, where they do: batch tiles (named in the kernel
/// version) run the early layers a few images at a time, each a call of its own.
fn calls_note(kernel_version: &str) -> Option<String> {
    let (_, after) = kernel_version.split_once("batch tiles of ")?;
    let tiles = after.strip_suffix(')').unwrap_or(after);
    Some(format!(
        "Calls count kernel runs, not layers: batch tiles of {tiles} run the early layers a few images at a time (to stay in cache), so they are called several times per iteration (`WORKSHOP_CPU_SPLIT=off` runs whole batches)."
    ))
}

/// What a course step shows of a profile, short enough to stay on screen with the question
/// that follows: the operator table (and the kernel table, with `kernels`), the CPU-overhead
/// ratio, the FLOPs profile's key lines, the network's stages and its slowest layers. The
/// rest (the module tree, every layer) is in the full profile, `full` names where.
pub fn course_summary(
    record: &crate::bench::record::BenchRecord,
    f: &FlopsProfile,
    (top, kernels): (usize, bool),
    full: &str,
) -> String {
    let mut s = String::new();
    if let Some(p) = &record.profile {
        s.push_str(&tables(record, p, top, kernels));
        s.push('\n');
    }
    let root = f.root();
    let _ = write!(
        s,
        "\nFLOPs profile of timed iteration {}: {} in {} of device time, {}",
        f.step,
        si(root.flops as f64, "FLOPs"),
        duration_ns(root.latency_ns as f64),
        si(root.gflops() * 1e9, "FLOPS"),
    );
    if let Some(peak) = f.limits.peak_gflops {
        let _ = write!(
            s,
            " = {:.1}% of the measured GEMM peak{}",
            pct(root.gflops(), peak),
            beyond(root.gflops(), peak)
        );
    }
    let _ = write!(
        s,
        ".\nArithmetic intensity {:.1} FLOP/byte",
        root.intensity()
    );
    match f.limits.balance() {
        Some(b) => {
            let _ = writeln!(s, " against a machine balance of {b:.1} FLOP/byte.");
        }
        None => s.push_str(" (no bandwidth measured here: no machine balance).\n"),
    }
    let mut t = new_table();
    t.set_header([&["stage"][..], &TIMING_COLUMNS].concat());
    for m in f.at_depth(1) {
        let mut row = vec![Cell::new(&m.name)];
        row.extend(timing_cells(f, m));
        t.add_row(row);
    }
    let _ = writeln!(s, "{t}");
    flops_slowest(&mut s, f, top.min(5));
    let _ = write!(
        s,
        "The full profile (every kernel, the module tree, every layer): {full}"
    );
    s
}

fn tables(
    record: &crate::bench::record::BenchRecord,
    p: &crate::bench::profile::Profile,
    top: usize,
    kernels: bool,
) -> String {
    let backend = record.config.backend;
    let table = |title: &str, rows: &[crate::bench::profile::KernelStat]| {
        let mut t = new_table();
        t.set_header(vec![title, "calls", "total ms", "avg µs", "%"]);
        for k in rows.iter().take(top) {
            t.add_row(vec![
                Cell::new(&k.name),
                Cell::new(k.calls).set_alignment(CellAlignment::Right),
                Cell::new(format!("{:.2}", k.total_ns as f64 / 1e6))
                    .set_alignment(CellAlignment::Right),
                Cell::new(format!("{:.1}", k.average_ns / 1e3)).set_alignment(CellAlignment::Right),
                Cell::new(format!("{:.1}", k.percentage)).set_alignment(CellAlignment::Right),
            ]);
        }
        t.to_string()
    };
    let clock = if backend.times_on_device() {
        "GPU timestamps"
    } else {
        "CPU timers"
    };
    let meaning = if p.cpu_overhead < 1.1 {
        "the device was busy nearly all the time: the kernels are what to speed up"
    } else if p.cpu_overhead < 1.5 {
        "some time goes to launches, synchronisation, copies and host work between kernels"
    } else {
        "much of each iteration is spent outside the kernels: launch overhead and host work dominate (try a larger batch)"
    };
    let kernels = match kernels {
        true => format!("\nKernels:\n{}", table("kernel", &p.kernels)),
        false => String::new(),
    };
    let calls =
        calls_note(&record.environment.kernel_version).map_or(String::new(), |n| format!("\n{n}"));
    format!(
        "Operators over {} iterations ({clock}):\n{}{kernels}\nDevice time {:.2} ms per iteration, host time {:.2} ms: CPU-overhead ratio {:.2} ({meaning}).{calls}",
        p.iterations,
        table("operator", &p.ops),
        p.device_ms_per_iter,
        p.host_ms_per_iter,
        p.cpu_overhead
    )
}

/// The FLOPs profile in DeepSpeed's layout: the summary, the top modules per depth, the
/// slowest layers with their intensity and bound, and the module tree down to `depth`.
pub fn flops_profile(p: &FlopsProfile, depth: Option<usize>, top: usize) -> String {
    let mut s = flops_summary(p);
    flops_aggregated(&mut s, p, depth);
    flops_slowest(&mut s, p, top);
    flops_detailed(&mut s, p, depth);
    s.push_str(&"-".repeat(80));
    s
}

/// Why an efficiency can pass 100%: the FLOPs are those of the layers as defined (a direct
/// convolution's multiply-adds), the work a fast algorithm saves included.
fn beyond(gflops: f64, peak: f64) -> &'static str {
    if gflops > peak {
        " (above 100%: FLOPs are counted as a direct convolution does them, and Winograd's \
         kernels execute fewer: these are effective FLOP/s, not executed ones)"
    } else {
        ""
    }
}

/// A percentage of a whole that may be zero.
fn pct(part: f64, whole: f64) -> f64 {
    100.0 * part / whole.max(f64::MIN_POSITIVE)
}

/// A section's title rule, 80 wide.
fn rule(title: &str) -> String {
    format!("{:-^80}\n", format!(" {title} "))
}

/// The profile's header: the step, the totals, the achieved rate against the peak and the
/// ceiling, and the bound.
fn flops_summary(p: &FlopsProfile) -> String {
    let root = p.root();
    let mut s = rule("workshop FLOPs profiler");
    let _ = writeln!(
        s,
        "Profile summary at step {} (timed iteration {} of the run)",
        p.step, p.step
    );
    s.push_str(
        "Notations: params (parameters), MACs (multiply-accumulates of conv and linear layers),\n\
         flops (2 per MAC plus element-wise work), fwd latency (device time of the forward pass),\n\
         FLOPS (flops per second), AI (arithmetic intensity: flops per byte read or written)\n\n",
    );
    let line = |s: &mut String, k: &str, v: String| {
        let _ = writeln!(s, "{k:<52}{v}");
    };
    line(&mut s, "world size:", "1".into());
    line(&mut s, "batch size per device:", p.batch_size.to_string());
    line(&mut s, "precision:", p.precision.name().to_uppercase());
    line(&mut s, "params per device:", si(root.params as f64, ""));
    line(&mut s, "fwd MACs per device:", si(root.macs as f64, "MACs"));
    line(&mut s, "fwd flops per device:", si(root.flops as f64, ""));
    line(
        &mut s,
        "fwd latency (device):",
        duration_ns(root.latency_ns as f64),
    );
    line(
        &mut s,
        "fwd latency (host, with sync and read-back):",
        duration_ns(p.host_s * 1e9),
    );
    line(
        &mut s,
        "fwd FLOPS per device = fwd flops / fwd latency:",
        si(root.gflops() * 1e9, "FLOPS"),
    );
    match p.limits.peak_gflops {
        Some(peak) => {
            line(
                &mut s,
                "measured GEMM peak:",
                format!("{}, from {}", si(peak * 1e9, "FLOPS"), p.limits.peak_source),
            );
            line(
                &mut s,
                "efficiency = fwd FLOPS / measured peak:",
                format!(
                    "{:.1}%{}",
                    pct(root.gflops(), peak),
                    beyond(root.gflops(), peak)
                ),
            );
        }
        None => line(
            &mut s,
            "measured GEMM peak:",
            "not available (the probe failed its check)".into(),
        ),
    }
    if let Some(t) = &p.limits.theoretical {
        let label = match t.measured {
            true => format!("{} (measured):", t.name),
            false => "theoretical peak:".into(),
        };
        line(
            &mut s,
            &label,
            format!("{} = {}", si(t.gflops * 1e9, "FLOPS"), t.how),
        );
        line(
            &mut s,
            "efficiency against it:",
            format!(
                "{:.1}%{}",
                pct(root.gflops(), t.gflops),
                beyond(root.gflops(), t.gflops)
            ),
        );
    }
    match (p.limits.bandwidth_gbps, p.limits.balance()) {
        (Some(bw), Some(b)) => {
            line(&mut s, "memory bandwidth (triad):", format!("{bw:.1} GB/s"));
            line(
                &mut s,
                "machine balance = peak / bandwidth:",
                format!("{b:.1} FLOP/byte"),
            );
        }
        _ => line(
            &mut s,
            "memory bandwidth:",
            "not measured on this backend yet: no memory-/compute-bound labels".into(),
        ),
    }
    line(
        &mut s,
        "arithmetic intensity of the whole pass:",
        format!("{:.1} FLOP/byte", root.intensity()),
    );

    s.push('\n');
    s
}

/// The top modules by params, MACs and latency at each depth.
fn flops_aggregated(s: &mut String, p: &FlopsProfile, depth: Option<usize>) {
    s.push_str(&rule("Aggregated profile"));
    let shown = 3;
    let _ = writeln!(
        s,
        "Top {shown} modules in terms of params, MACs or fwd latency at different model depths:"
    );
    let maxd = p.max_depth().min(depth.unwrap_or(usize::MAX));
    for d in 0..=maxd {
        let mods: Vec<&Module> = p.at_depth(d).collect();
        let top_by = |key: &dyn Fn(&Module) -> u64, unit: &str| {
            let mut v = mods.clone();
            v.sort_by_key(|m| std::cmp::Reverse(key(m)));
            let items: Vec<String> = v
                .iter()
                .take(shown)
                .map(|m| {
                    let val = key(m) as f64;
                    let shown = if unit == "s" {
                        duration_ns(val)
                    } else {
                        si(val, unit)
                    };
                    format!("'{}': '{}'", m.name, shown)
                })
                .collect();
            format!("{{{}}}", items.join(", "))
        };
        let _ = writeln!(s, "depth {d}:");
        let _ = writeln!(s, "    params      - {}", top_by(&|m| m.params, ""));
        let _ = writeln!(s, "    MACs        - {}", top_by(&|m| m.macs, "MACs"));
        let _ = writeln!(s, "    fwd latency - {}", top_by(&|m| m.latency_ns, "s"));
    }
}

/// The columns of [`timing_cells`].
const TIMING_COLUMNS: [&str; 6] = [
    "latency",
    "% latency",
    "MACs",
    "FLOPS",
    "AI FLOP/B",
    "bound",
];

/// A module's latency, share of the pass, MACs, FLOPS, intensity and bound: the columns the
/// stage and slowest-layer tables share.
fn timing_cells(p: &FlopsProfile, m: &Module) -> [Cell; 6] {
    let right = |v: String| Cell::new(v).set_alignment(CellAlignment::Right);
    [
        right(duration_ns(m.latency_ns as f64)),
        right(format!(
            "{:.2}%",
            pct(m.latency_ns as f64, p.root().latency_ns as f64)
        )),
        right(si(m.macs as f64, "")),
        right(si(m.gflops() * 1e9, "")),
        right(format!("{:.1}", m.intensity())),
        Cell::new(p.limits.bound(m.intensity()).unwrap_or("")),
    ]
}

/// The slowest layers with their intensity and bound: a group of layers that ran as one
/// kernel as one row, in place of its layers.
fn flops_slowest(s: &mut String, p: &FlopsProfile, top: usize) {
    let mut leaves: Vec<&Module> = p
        .modules
        .iter()
        .filter(|m| !m.kind.is_empty() && m.fused_in.is_none())
        .chain(&p.fused)
        .collect();
    leaves.sort_by_key(|m| std::cmp::Reverse(m.latency_ns));
    let _ = writeln!(s, "\nTop {} layers by fwd latency:", top.min(leaves.len()));
    let mut t = new_table();
    t.set_header([&["layer", "op", "calls"][..], &TIMING_COLUMNS].concat());
    for m in leaves.iter().take(top) {
        let mut row = vec![
            Cell::new(&m.name),
            Cell::new(&m.kind),
            Cell::new(m.calls).set_alignment(CellAlignment::Right),
        ];
        row.extend(timing_cells(p, m));
        t.add_row(row);
    }
    let _ = writeln!(s, "{t}");

    s.push('\n');
}

/// The module tree down to `depth`, each with its share of params, MACs and latency.
fn flops_detailed(s: &mut String, p: &FlopsProfile, depth: Option<usize>) {
    let root = p.root();
    s.push_str(&rule("Detailed profile"));
    s.push_str(
        "Each module is listed with: params, % of params, MACs, % of MACs, fwd latency, % of latency,\n\
         FLOPS, arithmetic intensity\n\n",
    );
    let stats = |m: &Module| {
        format!(
            "{}, {:.2}% Params, {}, {:.2}% MACs, {}, {:.2}% latency, {}, AI {:.1}",
            si(m.params as f64, ""),
            pct(m.params as f64, root.params as f64),
            si(m.macs as f64, "MACs"),
            pct(m.macs as f64, root.macs as f64),
            duration_ns(m.latency_ns as f64),
            pct(m.latency_ns as f64, root.latency_ns as f64),
            si(m.gflops() * 1e9, "FLOPS"),
            m.intensity()
        )
    };
    let limit = depth.unwrap_or(usize::MAX);
    let mut open: Vec<usize> = Vec::new();
    for m in &p.modules {
        if m.depth > limit {
            continue;
        }
        while open.last().is_some_and(|&d| d >= m.depth) {
            let d = open.pop().unwrap_or(0);
            let _ = writeln!(s, "{})", "  ".repeat(d));
        }
        let indent = "  ".repeat(m.depth);
        let short = m.name.rsplit('.').next().unwrap_or(&m.name);
        if m.kind.is_empty() {
            let head = if m.depth == 0 {
                m.name.clone()
            } else {
                format!("({short}): ")
            };
            let _ = writeln!(s, "{indent}{head}(");
            let _ = writeln!(s, "{indent}  {}", stats(m));
            open.push(m.depth);
        } else {
            let calls = if m.calls > 1 {
                format!(" ×{}", m.calls)
            } else {
                String::new()
            };
            match &m.fused_in {
                Some(group) => {
                    let _ = writeln!(
                        s,
                        "{indent}({short}): {}{calls}, one kernel with others: timed as {group}",
                        m.layer
                    );
                }
                None => {
                    let _ = writeln!(s, "{indent}({short}): {}{calls}, {}", m.layer, stats(m));
                }
            }
        }
    }
    while let Some(d) = open.pop() {
        let _ = writeln!(s, "{})", "  ".repeat(d));
    }
}

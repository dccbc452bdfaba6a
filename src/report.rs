//! Presentation: every table and summary the commands print is rendered here from plain
//! records, so the numbers and their display never mix.

use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};

use crate::backend::human_bytes;
use crate::bench::Event;
use crate::bench::record::{BenchConfig, BenchRecord};
use crate::course::state::Table as ResultTable;
use crate::doctor;

/// The configuration echo printed before a run.
pub fn config_echo(cfg: &BenchConfig) -> String {
    let threads = cfg
        .threads
        .map_or_else(|| "all cores".to_string(), |t| t.to_string());
    format!(
        "Network:     {}\nBatch size:  {}\nInput:       3×{}×{}\nIterations:  {} (after {} warm-up)\nPrecision:   {}\nBackend:     {} (device {}, threads: {})\nWeights:     {}",
        cfg.network,
        cfg.batch_size,
        cfg.input_size,
        cfg.input_size,
        cfg.iterations,
        cfg.warmup,
        cfg.precision.name().to_uppercase(),
        cfg.backend,
        cfg.device,
        threads,
        cfg.weights
    )
}

/// One progress line per event.
pub fn event_line(ev: &Event) -> String {
    match ev {
        Event::Preparing {
            params,
            weights,
            seconds,
        } => format!(
            "Prepared {} parameters ({weights}) in {seconds:.2} s.",
            group_digits(*params)
        ),
        Event::Warmup {
            index,
            loss,
            seconds,
        } => {
            format!(
                "Warm-up {index:>3}: loss = {loss:.4}, time = {:.1} ms",
                seconds * 1e3
            )
        }
        Event::Iteration {
            index,
            loss,
            seconds,
        } => {
            format!(
                "Iteration {index:>3}: loss = {loss:.4}, time = {:.1} ms",
                seconds * 1e3
            )
        }
    }
}

/// The performance summary after a run.
pub fn summary(r: &BenchRecord) -> String {
    let s = &r.stats;
    let c = &r.config;
    let line = "=".repeat(56);
    format!(
        "{line}\nPerformance summary: {} {} batch {} on {} ({})\n{line}\n\
         Step time     median {:.2} ms, mean {:.2} ms, std {:.2} ms (CV {:.1}%)\n\
         Range         min {:.2} ms, max {:.2} ms over {} iterations\n\
         Throughput    {:.1} images/s (mean), {:.1} images/s (median)\n\
         Per batch     {:.2} ms    per sample {:.1} µs\n\
         Compute       {:.1} GFLOP/s (conv + linear, {:.2} GMACs per image)\n\
         Memory        {} peak ({} weights + {} activations)\n\
         Loss          {:.4} (random labels: ln(classes) ≈ {:.4} for an untrained network)\n{}{}{line}",
        c.network,
        c.precision.name().to_uppercase(),
        c.batch_size,
        r.environment.device.name,
        c.backend,
        s.median_s * 1e3,
        s.mean_s * 1e3,
        s.std_s * 1e3,
        s.cv * 100.0,
        s.min_s * 1e3,
        s.max_s * 1e3,
        r.samples_s.len(),
        s.throughput,
        s.throughput_median,
        s.ms_per_batch,
        s.us_per_sample,
        s.gflops,
        r.model.macs_per_image as f64 / 1e9,
        human_bytes(r.memory.peak),
        human_bytes(r.memory.weights),
        human_bytes(r.memory.peak_activations),
        r.loss,
        1000f64.ln(),
        enqueue_line(r),
        r.compile.as_ref().map_or(String::new(), compile_lines),
    )
}

/// The host's time to enqueue one pass, on backends that run asynchronously: what launch
/// overhead and `--compile reduce-overhead` are about.
fn enqueue_line(r: &BenchRecord) -> String {
    if r.config.backend == crate::backend::BackendKind::Cpu || r.enqueue_s.is_empty() {
        return String::new();
    }
    let mut v = r.enqueue_s.clone();
    v.sort_by(f64::total_cmp);
    format!(
        "Host enqueue  median {:.1} µs per pass (time in run() before waiting for the device)\n",
        v[v.len() / 2] * 1e6
    )
}

/// What compilation did, for the summary.
fn compile_lines(c: &crate::bench::record::CompileInfo) -> String {
    let p = &c.passes;
    format!(
        "Compile       {} in {:.3} s (before the run): {} batch norms folded, {} activations and {} residual adds fused, {} dropouts dropped ({} → {} nodes)\n\
         Memory plan   {} eager → {} compiled\n\
         Check         max |Δ| {:.2e} against eager FP32 on the same input ({:.4}% of the largest output)\n",
        c.mode.name(),
        c.compile_s,
        p.folded_batch_norms,
        p.fused_activations,
        p.fused_adds,
        p.dropped,
        p.nodes_before,
        p.nodes_after,
        human_bytes(c.eager_memory),
        human_bytes(c.compiled_memory),
        c.max_abs_diff,
        c.rel_diff * 100.0
    ) + &c.autotune.as_ref().map_or(String::new(), autotune_lines)
        + &match &c.replay {
            Some(Ok(how)) => format!("Replay        {how}\n"),
            Some(Err(why)) => format!("Replay        none: {why}\n"),
            None => String::new(),
        }
}

/// What max-autotune tried and chose.
fn autotune_lines(a: &crate::bench::autotune::AutotuneReport) -> String {
    let cached = a.choices.iter().filter(|c| c.cached).count();
    let mut s = format!(
        "Autotune      {} layers, {} shapes: {} timed now, {} from the cache (keyed by device, driver, kernel version and shape; --recompile times them again)\n",
        a.layers,
        a.choices.len(),
        a.choices.len() - cached,
        cached
    );
    for c in a.choices.iter().filter(|c| !c.cached) {
        let tried: Vec<String> = c
            .tried
            .iter()
            .map(|(v, ms)| format!("{v} {ms:.2} ms"))
            .collect();
        s.push_str(&format!(
            "  {:<24} {} → {}\n",
            c.layer,
            tried.join(", "),
            c.variant
        ));
    }
    s
}

/// One row of `workshop models`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelRow {
    pub network: String,
    pub params: u64,
    pub macs: u64,
    pub flops: u64,
    pub weights_bytes_fp32: u64,
}

pub fn models_table(rows: &[ModelRow], input_size: usize) -> String {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "network".to_string(),
        "parameters".into(),
        format!("GMACs/image ({input_size}²)"),
        "GFLOPs/image".into(),
        "weights (fp32)".into(),
    ]);
    for r in rows {
        t.add_row(vec![
            Cell::new(&r.network),
            Cell::new(group_digits(r.params)).set_alignment(CellAlignment::Right),
            Cell::new(format!("{:.3}", r.macs as f64 / 1e9)).set_alignment(CellAlignment::Right),
            Cell::new(format!("{:.3}", r.flops as f64 / 1e9)).set_alignment(CellAlignment::Right),
            Cell::new(human_bytes(r.weights_bytes_fp32)).set_alignment(CellAlignment::Right),
        ]);
    }
    format!(
        "{t}\nMACs count conv and linear multiply-accumulates (torchvision's convention); \
         GFLOPs add 2 per MAC plus batch norm, activations, pooling and residual adds."
    )
}

/// 25557032 → "25,557,032".
pub fn group_digits(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// One line naming a course step's run.
pub fn step_config(c: &BenchConfig) -> String {
    format!(
        "Running {} {} batch {} ({}×{}), {} iterations after {} warm-up, on {} device {}",
        c.network,
        c.precision.name().to_uppercase(),
        c.batch_size,
        c.input_size,
        c.input_size,
        c.iterations,
        c.warmup,
        c.backend,
        c.device
    )
}

/// A step's table.
pub fn table(t: &ResultTable) -> String {
    let mut out = Table::new();
    out.load_style(UTF8_FULL_CONDENSED);
    out.set_header(t.header.clone());
    for r in &t.rows {
        out.add_row(
            r.iter()
                .map(|c| Cell::new(c).set_alignment(CellAlignment::Right))
                .collect::<Vec<_>>(),
        );
    }
    out.to_string()
}

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
    s.push_str(&format!(
        "Memory: {} total, {} available\n",
        mem(d.memory_bytes),
        human_bytes(d.available_memory_bytes)
    ));
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
            if b.backend != crate::backend::BackendKind::Cpu && !dev.features.is_empty() {
                s.push_str(&format!("            {}\n", dev.features.join(" ")));
            }
        }
    }
    s.trim_end().to_string()
}

/// The banner when an exercise starts.
pub fn exercise_header(e: &crate::course::schema::Exercise) -> String {
    let line = "─".repeat(64);
    let mut s = format!("{line}\n{} — {}\n", e.id.get_ref(), e.title);
    if !e.summary.is_empty() {
        s.push_str(&format!("{}\n", e.summary.trim()));
    }
    s.push_str(&format!(
        "Read along: `workshop book {}`\n{line}",
        e.id.get_ref()
    ));
    s
}

/// The header and explanation of a step about to run.
pub fn step_header(
    exercise: &str,
    index: usize,
    total: usize,
    step: &crate::course::schema::Step,
) -> String {
    format!(
        "\n[{exercise} · step {}/{total} · {}] {}\n{}\n",
        index + 1,
        format!("{:?}", step.kind).to_lowercase(),
        step.id.get_ref(),
        step.say.trim()
    )
}

/// The verdict of every expectation of an attempt.
pub fn attempt_verdicts(a: &crate::course::state::Attempt) -> String {
    use crate::course::expect::Verdict;
    use crate::course::state::Outcome;
    let mut s = String::new();
    if let Some(note) = &a.note {
        s.push_str(&format!("{note}\n"));
    }
    for c in &a.checks {
        let mark = match c.verdict {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Inconclusive => "INCONCLUSIVE",
        };
        match c.value {
            Some(v) => s.push_str(&format!(
                "  {mark:<12} {} = {} (expected {}, {})\n",
                c.what,
                number(v),
                range_text(c.min, c.max),
                c.range
            )),
            None => s.push_str(&format!("  {mark:<12} {} ({})\n", c.what, c.range)),
        }
        if let Some(r) = &c.reason {
            s.push_str(&format!("               {r}\n"));
        }
        if let Some(h) = &c.hint {
            s.push_str(&format!("               hint: {h}\n"));
        }
    }
    let outcome = match a.outcome {
        Outcome::Pass => "passed",
        Outcome::Fail => "failed (recorded; re-run it with `workshop run EX.STEP`, or go on)",
        Outcome::Inconclusive => "inconclusive (recorded; re-run it on a quieter machine to judge)",
        Outcome::Skipped => "skipped",
        Outcome::Unavailable => "unavailable here (recorded as such)",
    };
    s.push_str(&format!("Step {}: {outcome}.", a.step));
    s
}

/// What comes after a step.
pub fn what_next(exercise: &str, finished: bool, upcoming: Option<&str>) -> String {
    match (finished, upcoming) {
        (true, Some(next)) => format!("{exercise} is done. Next: {next} — `workshop next`."),
        (true, None) => format!(
            "{exercise} is done, and with it the course. See your worksheet: `workshop results`."
        ),
        (false, Some(next)) => format!("Next: {next} — `workshop next`."),
        (false, None) => "`workshop next` continues.".into(),
    }
}

pub fn course_done(student: &str, results: &std::path::Path) -> String {
    format!(
        "Well done, {student}: every exercise is done or skipped. Your worksheet is {}.",
        results.display()
    )
}

pub fn status_word(s: crate::course::state::Status) -> &'static str {
    use crate::course::state::Status;
    match s {
        Status::NotStarted => "not started",
        Status::InProgress => "in progress",
        Status::Done => "done",
        Status::Skipped => "skipped",
    }
}

pub struct StatusRow {
    pub id: String,
    pub title: String,
    pub status: crate::course::state::Status,
    pub steps_done: usize,
    pub steps: usize,
}

/// `workshop status`: a progress bar and one line per exercise.
pub fn status(
    state: &crate::course::state::State,
    rows: &[StatusRow],
    current: Option<&str>,
) -> String {
    use crate::course::state::Status;
    let finished = rows
        .iter()
        .filter(|r| matches!(r.status, Status::Done | Status::Skipped))
        .count();
    let width = 30;
    let filled = if rows.is_empty() {
        0
    } else {
        finished * width / rows.len()
    };
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec!["", "exercise", "title", "status", "steps"]);
    for r in rows {
        let here = if current == Some(r.id.as_str()) {
            "▶"
        } else {
            ""
        };
        t.add_row(vec![
            here.to_string(),
            r.id.clone(),
            r.title.clone(),
            status_word(r.status).to_string(),
            format!("{}/{}", r.steps_done, r.steps),
        ]);
    }
    format!(
        "{} · backend {} device {}\n[{}{}] {finished}/{} exercises\n{t}",
        state.student,
        state.backend,
        state.device,
        "#".repeat(filled),
        ".".repeat(width - filled),
        rows.len()
    )
}

pub fn exercise_list(rows: &[(String, String, String, String)]) -> String {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec!["exercise", "title", "status", "what you learn"]);
    for (id, title, status, summary) in rows {
        t.add_row(vec![
            id.clone(),
            title.clone(),
            status.clone(),
            summary.clone(),
        ]);
    }
    t.to_string()
}

/// A number with sensible precision for the worksheet.
pub fn number(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.3e}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

pub fn range_text(min: Option<f64>, max: Option<f64>) -> String {
    match (min, max) {
        (Some(a), Some(b)) => format!("{} to {}", number(a), number(b)),
        (Some(a), None) => format!("≥ {}", number(a)),
        (None, Some(b)) => format!("≤ {}", number(b)),
        (None, None) => "any".into(),
    }
}

/// The key values of an attempt, in one line.
pub fn measured(a: &crate::course::state::Attempt) -> String {
    let m = &a.metrics;
    let get = |k: &str| m.get(k).copied();
    let mut parts = Vec::new();
    if let Some(v) = get("throughput") {
        parts.push(format!("{v:.1} images/s"));
    }
    if let Some(v) = get("median_ms") {
        parts.push(format!("{v:.1} ms median"));
    }
    if let Some(v) = get("cv") {
        parts.push(format!("CV {:.1}%", v * 100.0));
    }
    if let Some(v) = get("peak_memory_mib") {
        parts.push(format!("{v:.0} MiB peak"));
    }
    if let Some(v) = get("loss") {
        parts.push(format!("loss {v:.4}"));
    }
    if let Some(v) = get("best_throughput") {
        parts.push(format!(
            "best {v:.1} images/s at {}",
            get("best_value").unwrap_or(0.0)
        ));
    }
    if let Some(v) = get("max_abs_diff") {
        parts.push(format!(
            "max abs Δlogit {v:.2e}, top-1 agreement {:.0}%",
            get("top1_agreement").unwrap_or(0.0) * 100.0
        ));
    }
    if let Some(v) = get("gemm_gflops") {
        parts.push(format!("GEMM {v:.1} GFLOP/s"));
    }
    if let (Some(c), Some(t)) = (get("copy_gbps"), get("triad_gbps")) {
        parts.push(format!("copy {c:.1} GB/s, triad {t:.1} GB/s"));
    }
    if let Some(v) = get("cores") {
        parts.push(format!(
            "{v} cores, {:.1} GiB",
            get("memory_gib").unwrap_or(0.0)
        ));
    }
    if a.kind == crate::course::schema::StepKind::Compare {
        parts.extend(m.iter().map(|(k, v)| format!("{k} {v:.2}")));
    }
    if let Some(ans) = &a.answer {
        parts.push(format!("answered {ans}"));
    }
    if let Some(n) = &a.note {
        parts.push(n.clone());
    }
    if parts.is_empty() {
        "—".into()
    } else {
        parts.join(", ")
    }
}

/// Every attempt's metrics as CSV rows: exercise, step, outcome, metric, value, finished.
pub fn results_csv(r: &crate::course::state::Results) -> String {
    let mut s = String::from("exercise,step,outcome,metric,value,finished\n");
    for a in &r.attempts {
        let outcome = format!("{:?}", a.outcome).to_lowercase();
        if a.metrics.is_empty() {
            s.push_str(&format!(
                "{},{},{outcome},,,{}\n",
                a.exercise, a.step, a.finished
            ));
        }
        for (k, v) in &a.metrics {
            s.push_str(&format!(
                "{},{},{outcome},{k},{v},{}\n",
                a.exercise, a.step, a.finished
            ));
        }
    }
    s
}

/// A new exercise file for `workshop dev new`.
pub fn scaffold_exercise(id: &str) -> String {
    format!(
        r#"format_version = 1
id = "{id}"
title = "A title for {id}"
chapter = "{id}.md"
summary = "What the student learns, in a sentence."

[[step]]
id = "run"
kind = "bench"
say = "What this step measures and what to look for."
bench = {{ network = "resnet50", batch_size = 32, iterations = 20, cpu = {{ batch_size = 4, iterations = 5 }} }}
max_cv = 0.15

[[step.expect]]
metric = "throughput"
min = 1.0
hint = "What to try when the number is out of range."
"#
    )
}

/// The operator and kernel tables of a profiled run, and what the CPU-overhead ratio means.
pub fn profile(
    p: &crate::bench::profile::Profile,
    top: usize,
    backend: crate::backend::BackendKind,
) -> String {
    let table = |title: &str, rows: &[crate::bench::profile::KernelStat]| {
        let mut t = Table::new();
        t.load_style(UTF8_FULL_CONDENSED);
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
    let clock = if backend == crate::backend::BackendKind::Cpu {
        "CPU timers"
    } else {
        "GPU timestamps"
    };
    let meaning = if p.cpu_overhead < 1.1 {
        "the device was busy nearly all the time: the kernels are what to speed up"
    } else if p.cpu_overhead < 1.5 {
        "some time goes to launches, synchronisation, copies and host work between kernels"
    } else {
        "much of each iteration is spent outside the kernels: launch overhead and host work dominate (try a larger batch)"
    };
    format!(
        "Operators over {} iterations ({clock}):\n{}\nKernels:\n{}\nDevice time {:.2} ms per iteration, host time {:.2} ms: CPU-overhead ratio {:.2} ({meaning}).",
        p.iterations,
        table("operator", &p.ops),
        table("kernel", &p.kernels),
        p.device_ms_per_iter,
        p.host_ms_per_iter,
        p.cpu_overhead
    )
}

/// `workshop peak`, in the shape of the classic validated-GEMM test.
pub fn peak(
    g: &crate::bench::peak::GemmPeak,
    bw: Option<&[crate::bench::peak::Bandwidth]>,
) -> String {
    let mut s = format!(
        "GEMM {0}×{0}×{0} {1} on {2}: {3}/{4} iterations validated (success rate {5:.0}%, max relative error {6:.1e})\n\
         Average {7:.1} GFLOP/s (median {8:.3} ms{10}), best {9:.1} GFLOP/s",
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
        if g.backend == crate::backend::BackendKind::Cpu {
            ""
        } else {
            ", kernel time on the device"
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
        }
        None => s.push_str("\nMemory bandwidth: this backend has no bandwidth probe yet."),
    }
    s
}

/// The line after a GEMM peak that places it under the device's compute ceiling: the FMA
/// ceiling measured on a CPU's registers, or a GPU's specification peak (`None`: the device
/// does not give the facts for one).
pub fn ceiling(gemm_gflops: f64, t: Option<&crate::bench::peak::Theoretical>) -> String {
    match t {
        Some(t) if t.measured => format!(
            "FP32 FMA ceiling {:.1} GFLOP/s ({}): the GEMM reaches {:.0}% of it",
            t.gflops,
            t.how,
            100.0 * gemm_gflops / t.gflops
        ),
        Some(t) => {
            let share = 100.0 * gemm_gflops / t.gflops;
            format!(
                "Theoretical FP32 peak {:.1} GFLOP/s = {}: the measured GEMM reaches {share:.0}% of it{}",
                t.gflops,
                t.how,
                if share > 100.0 {
                    " (so the cores ran faster than the reported clock)"
                } else {
                    ""
                }
            )
        }
        None => "Theoretical peak: this device does not report the facts to compute it".into(),
    }
}

/// A count with a metric prefix and a unit: `si(4.09e9, "MACs")` is `4.09 GMACs`,
/// `si(25.56e6, "")` is `25.56 M`, small counts stay whole (`128`).
pub fn si(v: f64, unit: &str) -> String {
    match [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]
        .into_iter()
        .find(|(d, _)| v.abs() >= *d)
    {
        Some((div, prefix)) => format!("{:.2} {prefix}{unit}", v / div),
        None if unit.is_empty() => format!("{v:.0}"),
        None => format!("{v:.0} {unit}"),
    }
}

/// A duration in ns as `12.34 ms`, `1.23 s` or `45.6 µs`.
pub fn duration_ns(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

/// The FLOPs profile in DeepSpeed's layout: the summary, the top modules per depth, the
/// slowest layers with their intensity and bound, and the module tree down to `depth`.
pub fn flops_profile(
    p: &crate::bench::flops::FlopsProfile,
    depth: Option<usize>,
    top: usize,
) -> String {
    use crate::bench::flops::Module;
    use std::fmt::Write as _;
    let root = p.root();
    let pct = |part: f64, whole: f64| 100.0 * part / whole.max(f64::MIN_POSITIVE);
    let rule = |title: &str| format!("{:-^80}\n", format!(" {title} "));
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
                format!("{:.1}%", pct(root.gflops(), peak)),
            );
        }
        None => line(
            &mut s,
            "measured GEMM peak:",
            "not available (the probe failed its check)".into(),
        ),
    }
    if let Some(t) = &p.limits.theoretical {
        line(
            &mut s,
            if t.measured {
                "FMA ceiling (measured):"
            } else {
                "theoretical peak:"
            },
            format!("{} = {}", si(t.gflops * 1e9, "FLOPS"), t.how),
        );
        line(
            &mut s,
            "efficiency against it:",
            format!("{:.1}%", pct(root.gflops(), t.gflops)),
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

    let mut leaves: Vec<&Module> = p.modules.iter().filter(|m| !m.kind.is_empty()).collect();
    leaves.sort_by_key(|m| std::cmp::Reverse(m.latency_ns));
    let _ = writeln!(s, "\nTop {} layers by fwd latency:", top.min(leaves.len()));
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "layer",
        "op",
        "calls",
        "latency",
        "% latency",
        "MACs",
        "FLOPS",
        "AI FLOP/B",
        "bound",
    ]);
    let right = |v: String| Cell::new(v).set_alignment(CellAlignment::Right);
    for m in leaves.iter().take(top) {
        t.add_row(vec![
            Cell::new(&m.name),
            Cell::new(&m.kind),
            right(m.calls.to_string()),
            right(duration_ns(m.latency_ns as f64)),
            right(format!(
                "{:.2}%",
                pct(m.latency_ns as f64, root.latency_ns as f64)
            )),
            right(si(m.macs as f64, "")),
            right(si(m.gflops() * 1e9, "")),
            right(format!("{:.1}", m.intensity())),
            Cell::new(p.limits.bound(m.intensity()).unwrap_or("")),
        ]);
    }
    let _ = writeln!(s, "{t}");

    s.push('\n');
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
            let _ = writeln!(s, "{indent}({short}): {}{calls}, {}", m.layer, stats(m));
        }
    }
    while let Some(d) = open.pop() {
        let _ = writeln!(s, "{})", "  ".repeat(d));
    }
    s.push_str(&"-".repeat(80));
    s
}

/// One device's line of a multi-device or gathered run.
fn device_line(label: &str, r: &BenchRecord) -> String {
    let s = &r.stats;
    format!(
        "[{label}] {} · batch {} · {:.1} images/s · median {:.2} ms · CV {:.1}% · peak memory {}",
        r.environment.device.name,
        r.config.batch_size,
        s.throughput_median,
        s.median_s * 1e3,
        s.cv * 100.0,
        human_bytes(r.memory.peak)
    )
}

/// What the spread between devices means.
fn spread_text(spread: f64) -> String {
    let judgement = if spread < 1.05 {
        "the devices kept pace with each other"
    } else if spread < 1.2 {
        "uneven: the slowest device holds the others back at every barrier"
    } else {
        "very uneven: check that the devices are alike and nothing else runs on the slow one"
    };
    format!("slowest / fastest device median {spread:.2} ({judgement})")
}

/// A multi-device run: each device, then the global summary with the scaling efficiency.
pub fn multi(m: &crate::bench::multi::MultiRecord) -> String {
    let mut s = String::new();
    for (d, r) in m.devices.iter().zip(&m.runs) {
        s.push_str(&device_line(&d.label, r));
        s.push('\n');
    }
    let g = &m.global;
    let first = &m.runs[0].config;
    s.push_str(&format!(
        "\n========================================================\n\
         Performance summary (global): {} {} on {} devices\n\
         ========================================================\n\
         Global batch  {} ({} per device)\n\
         Step time     median {:.2} ms, CV {:.1}% (start to end of every device: the slowest sets the pace)\n\
         Throughput    {:.1} images/s (median), {:.1} images/s (mean)\n\
         Devices       {}\n",
        first.network,
        first.precision.name().to_uppercase(),
        m.devices.len(),
        m.global_batch,
        m.per_device_batch,
        g.median_s * 1e3,
        g.cv * 100.0,
        g.throughput_median,
        g.throughput,
        spread_text(m.spread)
    ));
    match (&m.single, m.scaling_efficiency) {
        (Some(one), Some(eff)) => {
            let meaning = if eff > 1.05 {
                "above 100%: the run alone was slower than its share here (noise, clocks or caches): measure again before reading anything into it"
            } else if eff >= 0.9 {
                "near-linear scaling"
            } else if eff >= 0.7 {
                "good scaling; the rest goes to synchronisation and shared resources"
            } else {
                "poor scaling: the devices share something (memory bandwidth, caches, a bus) or wait on each other"
            };
            s.push_str(&format!(
                "One device    {:.1} images/s with {} images ({})\n\
                 Scaling       {:.2}× with {} devices: efficiency {:.1}% ({meaning})\n",
                one.stats.throughput_median,
                one.config.batch_size,
                one.environment.device.name,
                g.throughput_median / one.stats.throughput_median,
                m.devices.len(),
                eff * 100.0
            ));
        }
        _ => s.push_str("One device    not measured\n"),
    }
    s.push_str("========================================================");
    s
}

/// Ranks gathered from a results folder.
pub fn gathered(g: &crate::bench::multi::Gathered) -> String {
    let mut s = String::new();
    for r in &g.ranks {
        s.push_str(&device_line(
            &format!("rank {} · {}", r.rank.rank, r.device.label),
            &r.record,
        ));
        s.push('\n');
    }
    let c = &g.ranks[0].record.config;
    s.push_str(&format!(
        "\n========================================================\n\
         Performance summary (global): {} {}, {} ranks ({})\n\
         ========================================================\n\
         Global batch  {} ({} per rank)\n\
         Throughput    {:.1} images/s, the sum of the ranks' throughputs\n\
         Synchronous   {:.1} images/s if every iteration waited for the slowest rank\n\
         Ranks         {}\n\
         ========================================================",
        c.network,
        c.precision.name().to_uppercase(),
        g.world_size,
        g.ranks[0].rank.launcher,
        g.global_batch,
        g.global_batch / g.world_size.max(1),
        g.throughput_sum,
        g.throughput_synchronous,
        spread_text(g.spread)
    ));
    s
}

/// The cells of a comparison's table, header first.
fn comparison_cells(c: &crate::bench::compare::Comparison) -> Vec<Vec<String>> {
    let mut rows = vec![
        [
            "#",
            "record",
            "device",
            "backend",
            "precision",
            "network",
            "batch",
            "median ms",
            "images/s",
            "peak MiB",
            "CV %",
            "vs first",
            "verdict",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for (i, r) in c.rows.iter().enumerate() {
        let pair = c.pairs.iter().find(|p| p.index == i);
        rows.push(vec![
            (i + 1).to_string(),
            r.label.clone(),
            r.device.clone(),
            r.backend.clone(),
            r.precision.clone(),
            r.network.clone(),
            r.batch.to_string(),
            format!("{:.2}", r.median_ms),
            format!("{:.1}", r.throughput),
            format!("{:.0}", r.peak_memory_mib),
            format!("{:.1}", r.cv * 100.0),
            pair.map_or("reference".into(), |p| format!("{:.2}×", p.ratio)),
            pair.map_or(String::new(), |p| p.verdict.word().to_string()),
        ]);
    }
    rows
}

/// Sentences, verdicts and differences under the table.
fn comparison_notes(c: &crate::bench::compare::Comparison, bullet: &str) -> String {
    let mut s = String::new();
    for p in &c.pairs {
        s.push_str(&format!(
            "{bullet}{} — {}: {}\n",
            p.sentence,
            p.verdict.word(),
            p.reason
        ));
    }
    if !c.warnings.is_empty() {
        s.push_str("\nThe configurations differ, so the ratios measure these differences too:\n");
        for w in &c.warnings {
            s.push_str(&format!("{bullet}{w}\n"));
        }
    }
    if !c.differences.is_empty() {
        s.push_str("\nWhere they ran differs:\n");
        for d in &c.differences {
            s.push_str(&format!("{bullet}{d}\n"));
        }
    }
    s
}

/// A comparison for the terminal.
pub fn comparison(c: &crate::bench::compare::Comparison) -> String {
    let cells = comparison_cells(c);
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(cells[0].clone());
    for row in &cells[1..] {
        t.add_row(row.iter().enumerate().map(|(i, v)| {
            let cell = Cell::new(v);
            if i == 0 || i >= 6 {
                cell.set_alignment(CellAlignment::Right)
            } else {
                cell
            }
        }));
    }
    format!("{t}\n{}", comparison_notes(c, "  "))
}

/// A comparison as a Markdown report.
pub fn comparison_markdown(c: &crate::bench::compare::Comparison) -> String {
    let cells = comparison_cells(c);
    let mut s = String::from("# Benchmark comparison\n\n");
    s.push_str(&format!("| {} |\n", cells[0].join(" | ")));
    s.push_str(&format!("|{}\n", "---|".repeat(cells[0].len())));
    for row in &cells[1..] {
        s.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    s.push('\n');
    s.push_str(&comparison_notes(c, "- "));
    s.push_str(
        "\nVerdicts: *faster*/*slower* when every iteration of one run beats every iteration of the \
         other (per image); *same* when the medians are within 2%; *ambiguous* when the spreads \
         overlap and the medians differ more — measure again. A run's own spread is smaller than \
         the spread between runs on another day: repeat a comparison before trusting a small ratio.\n",
    );
    s
}

/// `workshop dev kernels-check`: one row per file, compiler and target, a column per
/// precision, then the full log of every failure and why anything was skipped.
pub fn kernels_check(checks: &[crate::backend::gpu::check::Check]) -> String {
    use crate::backend::gpu::check::Outcome;
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
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
                Some((Outcome::Compiled, s)) => format!("ok {s:.2} s"),
                Some((Outcome::Failed(log), _)) => {
                    notes.push(format!(
                        "FAILED kernels/{file} ({compiler}, {target}, {p}):\n{log}"
                    ));
                    "FAILED".into()
                }
                Some((Outcome::Skipped(why), _)) => {
                    notes.push(format!("skipped {compiler}: {why}"));
                    "skipped".into()
                }
                Some((Outcome::NotSupported(why), _)) => {
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

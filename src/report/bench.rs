//! Benchmark runs as text: the configuration echo, per-iteration lines, the performance
//! summary (with compile and autotune lines), the models table, and multi-device runs.

use comfy_table::{Cell, CellAlignment};

use crate::bench::Event;
use crate::bench::record::{BenchConfig, BenchRecord};
use crate::units::human_bytes;

use super::new_table;
use crate::units::group_digits;

/// The configuration echo printed before a run; `emulated`: the GPU backend's kernels run on
/// the host's emulator.
pub fn config_echo(cfg: &BenchConfig, emulated: bool) -> String {
    format!(
        "Network:     {}\nBatch size:  {}\nInput:       3×{}×{}\nIterations:  {} (after {} warm-up)\nPrecision:   {}\nBackend:     {}\nWeights:     {}",
        cfg.network,
        cfg.batch_size,
        cfg.input_size,
        cfg.input_size,
        cfg.iterations,
        cfg.warmup,
        cfg.precision.name().to_uppercase(),
        match cfg.framework.is_ours() {
            true => backend_line(cfg, emulated),
            false => format!("PyTorch eager on the {} backend's device", cfg.backend),
        },
        match cfg.framework.is_ours() {
            true => cfg.weights.as_str(),
            false => "torchvision's default initialisation",
        }
    )
}

/// `cpu (device 0, threads: all cores)`, `cuda emulated on the host CPU (device 0)`: the
/// worker threads only where the backend's kernels run on them.
pub fn backend_line(cfg: &BenchConfig, emulated: bool) -> String {
    if emulated {
        return format!(
            "{} emulated on the host CPU (device {})",
            cfg.backend, cfg.device
        );
    }
    if !cfg.backend.is_host() {
        return format!("{} (device {})", cfg.backend, cfg.device);
    }
    let threads = cfg
        .threads
        .map_or_else(|| "all cores".to_string(), |t| t.to_string());
    format!(
        "{} (device {}, threads: {threads})",
        cfg.backend, cfg.device
    )
}

/// One progress line per event.
pub fn event_line(ev: &Event) -> String {
    match ev {
        Event::Probe(p) => super::scenario::probe_line(p),
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
                "Warm-up {index:>3}: {}time = {:.1} ms",
                loss_text(*loss),
                seconds * 1e3
            )
        }
        Event::Iteration {
            index,
            loss,
            seconds,
        } => {
            format!(
                "Iteration {index:>3}: {}time = {:.1} ms",
                loss_text(*loss),
                seconds * 1e3
            )
        }
        Event::Generation {
            index,
            warmup,
            ttft_s,
            tpot_s,
        } => format!(
            "{} {index:>3}: TTFT = {:.1} ms, TPOT = {:.2} ms",
            if *warmup { "Warm-up" } else { "Iteration" },
            ttft_s * 1e3,
            tpot_s * 1e3
        ),
    }
}

/// "loss = 2.3026, " for an iteration whose output was scored; nothing for one whose output
/// stays on the device until the end (a layer chain's).
fn loss_text(loss: Option<f64>) -> String {
    loss.map_or(String::new(), |l| format!("loss = {l:.4}, "))
}

/// The performance summary after a run.
pub fn summary(r: &BenchRecord) -> String {
    if let Some(run) = &r.llm {
        return super::llm::summary(r, run);
    }
    if let Some(run) = &r.scenario {
        return super::scenario::summary(r, run);
    }
    let s = &r.stats;
    let c = &r.config;
    let line = "=".repeat(56);
    let whose = match c.framework.is_ours() {
        true => c.backend.to_string(),
        false => format!("{}, {}", c.backend, r.environment.kernel_version),
    };
    format!(
        "{line}\nPerformance summary: {} {} batch {} on {} ({})\n{line}\n\
         Step time     median {:.2} ms, mean {:.2} ms, std {:.2} ms (CV {:.1}%)\n\
         Latency       p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms\n\
         Range         min {:.2} ms, max {:.2} ms over {} iterations\n\
         Throughput    {:.1} images/s (mean), {:.1} images/s (median)\n\
         Per image     {:.1} µs (median step / batch)\n\
         Compute       {:.1} GFLOP/s ({:.2} GMACs per image in convolutions, linear layers and attention; 2 FLOPs each)\n\
         {}\n{}{}{}{}{line}",
        c.network,
        c.precision.name().to_uppercase(),
        c.batch_size,
        r.environment.device.name,
        whose,
        s.median_s * 1e3,
        s.mean_s * 1e3,
        s.std_s * 1e3,
        s.cv * 100.0,
        s.median_s * 1e3,
        s.p90_s * 1e3,
        s.p99_s * 1e3,
        s.min_s * 1e3,
        s.max_s * 1e3,
        r.samples_s.len(),
        s.throughput,
        s.throughput_median,
        s.us_per_sample,
        s.gflops,
        r.model.macs_per_image as f64 / 1e9,
        memory_line(r),
        loss_line(r),
        enqueue_line(r),
        machine_lines(r, "images", 14),
        r.compile.as_ref().map_or(String::new(), compile_lines),
    )
}

/// What the machine did while the run was timed, its energy where readable, and a warning
/// when it was not steady; nothing for records without telemetry (older ones, frameworks').
/// `items` names what a joule buys (images, tokens); labels are `width` wide.
pub fn machine_lines(r: &BenchRecord, items: &str, width: usize) -> String {
    let read = r.environment.telemetry.as_ref();
    let mut out = super::machine::state_line(read, width);
    if let (Some(t), Some(per)) = (r.telemetry(), r.per_joule()) {
        let runs = r.llm.as_ref().map_or(r.samples_s.len(), |l| l.ttft_s.len());
        let j = t.summary.energy_j.unwrap_or_default();
        out.push_str(&format!(
            "{:<width$}{j:.1} J over the timed iterations: {:.2} J per iteration, {per:.2} {items}/J\n",
            "Energy",
            j / runs.max(1) as f64
        ));
    }
    out.push_str(&super::machine::unsteady_line(read, width));
    out
}

/// The memory a run held at its peak; a framework's run on the CPU reports none.
fn memory_line(r: &BenchRecord) -> String {
    if r.memory.peak == 0 && !r.config.framework.is_ours() {
        return "Memory        not measured (PyTorch reports a GPU's peak, not the CPU's)".into();
    }
    format!(
        "Memory        {} peak: {}, {} activations",
        human_bytes(r.memory.peak),
        weights_text(r),
        human_bytes(r.memory.peak_activations)
    )
}

/// The loss of a classifier's last iteration against the seeded labels; nothing for a layer
/// chain, whose output is activations, not logits, nor for a framework's run (its output stays
/// in Python).
fn loss_line(r: &BenchRecord) -> String {
    if crate::model::zoo::layer::is_layer_spec(&r.config.network) || !r.config.framework.is_ours() {
        return String::new();
    }
    format!(
        "Loss          {:.4} (random labels: ln(classes) ≈ {:.4} for an untrained network)\n",
        r.loss,
        1000f64.ln()
    )
}

/// The weights' share of memory: the parameters at the run's precision, and apart from them
/// what the backend keeps on top (packed panels, Winograd-transformed filters, batch-tile
/// copies), so that "weights" is the network's figure on every backend.
fn weights_text(r: &BenchRecord) -> String {
    let own = r.model.params * r.config.precision.bytes() as u64;
    let stored = r.memory.weights;
    // Within 1% (biases padded, a layer norm's identity) counts as the same.
    if stored.abs_diff(own) * 100 <= own {
        return format!("{} weights", human_bytes(stored));
    }
    match stored > own {
        true => format!(
            "{} weights (+{} of packed copies for the kernels)",
            human_bytes(own),
            human_bytes(stored - own)
        ),
        false => format!(
            "{} weights (stored in {})",
            human_bytes(own),
            human_bytes(stored)
        ),
    }
}

/// The host's time to enqueue one pass, on backends that run asynchronously: what launch
/// overhead and `--compile reduce-overhead` are about.
fn enqueue_line(r: &BenchRecord) -> String {
    if !r.config.backend.is_asynchronous() || r.enqueue_s.is_empty() {
        return String::new();
    }
    let mut v = r.enqueue_s.clone();
    v.sort_by(f64::total_cmp);
    format!(
        "Host enqueue  median {:.1} µs per pass (time in run() before waiting for the device)\n",
        v[v.len() / 2] * 1e6
    )
}

/// What the compile passes did, in one line: `default in 0.012 s (before the run): …`, naming
/// only the rewrites that happened.
pub fn compile_passes(c: &crate::bench::record::CompileInfo) -> String {
    let p = &c.passes;
    let counts = [
        (p.folded_batch_norms, "batch norms folded into convolutions"),
        (
            p.folded_layer_norms,
            "layer-norm affines folded into projections",
        ),
        (
            p.folded_layer_scales,
            "layer scales folded into linear layers",
        ),
        (p.fused_activations, "activations fused into epilogues"),
        (p.fused_adds, "residual adds fused"),
        (p.dropped, "dropouts dropped"),
    ];
    let done = crate::units::nonzero_counts(&counts, "nothing to fuse");
    format!(
        "{} in {:.3} s (before the run): {done} ({} → {} nodes)",
        c.mode.name(),
        c.compile_s,
        p.nodes_before,
        p.nodes_after,
    )
}

/// What compilation did, for the summary.
fn compile_lines(c: &crate::bench::record::CompileInfo) -> String {
    let check = match c.output_scale {
        Some(0.0) => "nothing compared: eager FP32's output is all zeros (a zero-initialised \
                      head, as this network has without trained weights); give --weights to check"
            .to_string(),
        _ => format!(
            "max |Δ| {:.2e} against eager FP32 on the same input ({:.4}% of the largest output)",
            c.max_abs_diff,
            c.rel_diff * 100.0
        ),
    };
    format!(
        "Compile       {}\n\
         Memory plan   {} eager → {} compiled\n\
         Check         {check}\n",
        compile_passes(c),
        human_bytes(c.eager_memory),
        human_bytes(c.compiled_memory),
    ) + &c.autotune.as_ref().map_or(String::new(), autotune_lines)
        + &match &c.replay {
            Some(Ok(how)) => format!("Replay        {how}\n"),
            Some(Err(why)) => format!("Replay        none: {why}\n"),
            None => String::new(),
        }
}

/// What max-autotune tried and chose.
fn autotune_lines(a: &crate::bench::record::AutotuneReport) -> String {
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
    if let Some(c) = &a.schedule {
        let how = if c.cached {
            "from the cache"
        } else {
            "timed now, the fastest pass of each"
        };
        s.push_str(&format!("Schedule      {} ({how})\n", c.variant));
        for (v, ms) in c.tried.iter().filter(|_| !c.cached) {
            let default = if *v == c.tried[0].0 { " (default)" } else { "" };
            s.push_str(&format!("  {ms:>8.2} ms  {v}{default}\n"));
        }
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
    /// The image side the work is counted at.
    pub input_size: usize,
}

pub fn models_table(rows: &[ModelRow]) -> String {
    let mut t = new_table();
    t.set_header(vec![
        "network".to_string(),
        "parameters".into(),
        "input".into(),
        "GMACs/image".into(),
        "GFLOPs/image".into(),
        "weights (fp32)".into(),
    ]);
    for r in rows {
        t.add_row(vec![
            Cell::new(&r.network),
            Cell::new(group_digits(r.params)).set_alignment(CellAlignment::Right),
            Cell::new(format!("{0}²", r.input_size)).set_alignment(CellAlignment::Right),
            Cell::new(format!("{:.3}", r.macs as f64 / 1e9)).set_alignment(CellAlignment::Right),
            Cell::new(format!("{:.3}", r.flops as f64 / 1e9)).set_alignment(CellAlignment::Right),
            Cell::new(human_bytes(r.weights_bytes_fp32)).set_alignment(CellAlignment::Right),
        ]);
    }
    format!(
        "{t}\nMACs count conv and linear multiply-accumulates (torchvision's convention) and attention's q·kᵀ and weights·v; \
         GFLOPs add 2 per MAC plus batch norm, activations, pooling and residual adds."
    )
}

/// One line naming a course step's run.
pub fn step_config(c: &BenchConfig) -> String {
    if let (Some(prompt), Some(generate)) = (c.prompt_len, c.gen_len) {
        return format!(
            "Running {} {} batch {}: {prompt} prompt + {generate} generated tokens, {} generations after {} warm-up, on {} device {}",
            c.network,
            c.precision.name().to_uppercase(),
            c.batch_size,
            c.iterations,
            c.warmup,
            c.backend,
            c.device
        );
    }
    if let Some(sc) = &c.scenario {
        return format!(
            "Running the {} scenario of {} {} ({}×{}, batches up to {}), on {} device {}",
            sc.scenario.name(),
            c.network,
            c.precision.name().to_uppercase(),
            c.input_size,
            c.input_size,
            c.batch_size,
            c.backend,
            c.device
        );
    }
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
pub fn multi(m: &crate::bench::data_parallel::MultiRecord) -> String {
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
pub fn gathered(g: &crate::bench::data_parallel::Gathered) -> String {
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

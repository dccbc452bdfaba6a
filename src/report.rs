//! Presentation: every table and summary the commands print is rendered here from plain
//! records, so the numbers and their display never mix.

use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};

use crate::backend::human_bytes;
use crate::bench::Event;
use crate::bench::record::{BenchConfig, BenchRecord};

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
        Event::Preparing { params, weights } => {
            format!("Prepared {} parameters ({weights}).", group_digits(*params))
        }
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
         Loss          {:.4} (random labels: ln(classes) ≈ {:.4} for an untrained network)\n{line}",
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
    )
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

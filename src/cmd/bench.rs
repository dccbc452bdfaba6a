//! `workshop bench`, `infer`, `models` and `weights`: run the zoo's networks and show what was
//! measured.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::args::{BenchArgs, InferArgs, ModelsArgs, RunArgs, WeightsArgs};
use crate::backend::BackendKind;
use crate::bench::{self, record::BenchConfig};
use crate::model::tensor_file::TensorFile;
use crate::model::{Precision, weights, zoo};
use crate::report;

/// `--precision` and the classic `--fp16 0|1` must agree.
pub(super) fn resolve_precision(run: &RunArgs) -> Result<Precision> {
    match (run.precision, run.fp16) {
        (p, None) => Ok(p.unwrap_or(Precision::Fp32)),
        (_, Some(v)) if v > 1 => bail!("--fp16 takes 0 or 1 (got {v})"),
        (None, Some(0)) => Ok(Precision::Fp32),
        (None, Some(_)) => Ok(Precision::Fp16),
        (Some(p), Some(v)) => {
            let implied = if v == 1 {
                Precision::Fp16
            } else {
                Precision::Fp32
            };
            if p != implied {
                bail!("--precision {p} contradicts --fp16 {v}: give one of them");
            }
            Ok(p)
        }
    }
}

fn weights_label(run: &RunArgs) -> String {
    match &run.weights {
        Some(p) => p.display().to_string(),
        None => bench::record::random_weights_label(run.seed),
    }
}

/// Whether `kind`'s kernels run on the host's GPU emulator.
pub(super) fn emulated(kind: BackendKind) -> bool {
    matches!(kind, BackendKind::Cuda | BackendKind::Hip) && crate::backend::gpu::emu::requested()
}

/// The scenario the flags ask for, with the defaults for where it runs (smaller on the
/// host's cores, and said so in the record's rules line); scenario flags without
/// `--scenario` are refused.
fn scenario_config(args: &BenchArgs) -> Result<Option<bench::scenario::ScenarioConfig>> {
    let Some(scenario) = args.scenario else {
        for (flag, given) in [
            ("--queries", args.queries.is_some()),
            ("--duration", args.duration.is_some()),
            ("--latency-bound-ms", args.latency_bound_ms.is_some()),
            ("--batch-timeout-ms", args.batch_timeout_ms.is_some()),
            ("--qps", args.qps.is_some()),
        ] {
            if given {
                bail!(
                    "{flag} is for MLPerf scenarios: add --scenario single-stream|offline|server"
                );
            }
        }
        return Ok(None);
    };
    if args.profile
        || args.flops_prof_step.is_some()
        || args.devices.is_some()
        || args.cpu_groups.is_some()
    {
        bail!(
            "--scenario runs on its own: without --profile, --flops-prof-step, --devices or --cpu-groups"
        );
    }
    let host = crate::course::runner::runs_on_host(args.run.backend, args.run.device);
    let sc = bench::scenario::ScenarioConfig::new(
        scenario,
        host,
        args.queries,
        args.duration,
        args.latency_bound_ms,
        args.batch_timeout_ms,
        args.qps,
    );
    if args.qps.is_some() && scenario != bench::scenario::Scenario::Server {
        bail!("--qps is for --scenario server");
    }
    sc.validate()?;
    Ok(Some(sc))
}

pub fn bench(args: BenchArgs) -> Result<()> {
    if args.model_dir.is_some() || crate::model::llm::is_decoder(&args.run.network) {
        if args.scenario.is_some() {
            bail!(
                "--scenario runs image networks; a language model's serving figures are TTFT and TPOT (`workshop bench --network {}`)",
                args.run.network
            );
        }
        return super::llm::bench(args);
    }
    for (flag, given) in [
        ("--prompt-len", !args.prompt_len.is_empty()),
        ("--gen-len", !args.gen_len.is_empty()),
        ("--max-batched-tokens", args.max_batched_tokens.is_some()),
    ] {
        if given {
            bail!(
                "{flag} is for language models ({}); {} is an image network",
                crate::model::llm::names().join(", "),
                args.run.network
            );
        }
    }
    let batch_size = match args.batch_size.as_slice() {
        [] => BenchConfig::default().batch_size,
        [one] => *one,
        _ => bail!(
            "--batch-size takes one value for an image network (a list sweeps language models): \
             run once per batch size, or use `workshop compare` on the records"
        ),
    };
    // An unknown network fails here, before anything is printed.
    let network = zoo::build(&args.run.network)?;
    let defaults = BenchConfig::default();
    let cfg = BenchConfig {
        network: args.run.network.clone(),
        batch_size,
        iterations: args.iterations.unwrap_or(defaults.iterations),
        warmup: args.warmup.unwrap_or(defaults.warmup),
        precision: resolve_precision(&args.run)?,
        backend: args.run.backend,
        device: args.run.device,
        threads: args.run.threads,
        // The network's own size unless asked (EfficientNet-B7 600, most 224).
        input_size: args
            .input_size
            .unwrap_or_else(|| network.default_input_size()),
        seed: args.run.seed,
        weights: weights_label(&args.run),
        profile: args.profile || args.profile_csv.is_some() || args.trace.is_some(),
        kernels_dir: args.run.kernels_dir.clone(),
        kernels: args.run.kernels,
        flops_prof_step: args.flops_prof_step,
        cores: None,
        compile: args.compile,
        recompile: args.recompile,
        prompt_len: None,
        gen_len: None,
        max_batched_tokens: None,
        scenario: scenario_config(&args)?,
        framework: args.framework,
    };
    bench::validate(&cfg)?;
    // Where the results go must take them before the run starts.
    for path in [&args.json, &args.trace, &args.profile_csv]
        .into_iter()
        .flatten()
    {
        crate::files::check_destination(path)?;
    }
    if let Some(dir) = &args.results_dir {
        let rank = bench::data_parallel::Rank::detect()?.context(
            "--results-dir is for ranks started by a launcher, but none of their variables is set \
             (RANK/WORLD_SIZE from torchrun, SLURM_PROCID/SLURM_NTASKS from srun, \
             OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE from mpirun, PMI_RANK/PMI_SIZE)",
        )?;
        println!(
            "Rank {} of {} ({}, local rank {}): {} images of the global batch of {}",
            rank.rank,
            rank.world_size,
            rank.launcher,
            rank.local_rank,
            cfg.batch_size / rank.world_size.max(1),
            cfg.batch_size
        );
        let r = bench::data_parallel::run_rank(&cfg, &rank, dir)?;
        println!("\n{}", report::bench::summary(&r.record));
        println!(
            "Wrote {}; when every rank is done: workshop gather {}",
            bench::data_parallel::rank_file(dir, rank.rank).display(),
            dir.display()
        );
        return Ok(());
    }
    let devices = match (&args.devices, args.cpu_groups) {
        (Some(list), _) => Some(bench::data_parallel::parse_devices(list, cfg.backend)?),
        (None, Some(n)) => {
            if !cfg.backend.is_host() {
                bail!(
                    "--cpu-groups splits the CPU backend's cores; on {} use --devices",
                    cfg.backend
                );
            }
            Some(bench::data_parallel::cpu_groups(n)?)
        }
        (None, None) => None,
    };
    if let Some(devices) = devices {
        println!(
            "{}\n",
            report::bench::config_echo(&cfg, emulated(cfg.backend))
        );
        let single = match &args.single {
            Some(path) => Some(bench::compare::load(path)?),
            None => None,
        };
        let record = bench::data_parallel::run(&cfg, &devices, single, &mut |s| println!("{s}"))?;
        println!("\n{}", report::bench::multi(&record));
        if let Some(path) = &args.json {
            crate::files::write_atomic(path, serde_json::to_string_pretty(&record)?.as_bytes())?;
            println!("Wrote {}", path.display());
        }
        return Ok(());
    }
    if let Some(rank) = bench::data_parallel::Rank::detect()? {
        println!(
            "note: started as rank {} of {} by {}; add --results-dir DIR to benchmark this rank's share and gather the ranks",
            rank.rank, rank.world_size, rank.launcher
        );
    }
    println!(
        "{}\n",
        report::bench::config_echo(&cfg, emulated(cfg.backend))
    );
    if cfg.framework.is_ours() {
        if let Some(note) = crate::backend::precision_note(cfg.backend, cfg.precision) {
            println!("{note}");
        }
        println!("Building {} and preparing its weights...", cfg.network);
    } else {
        println!(
            "Running {} in PyTorch eager (the bundled bench/pytorch_resnet.py; WORKSHOP_PYTHON picks the Python)...",
            cfg.network
        );
    }
    let mut out = std::io::stdout();
    let record = bench::run(&cfg, args.run.weights.as_deref(), &mut |ev| {
        let _ = writeln!(out, "{}", report::bench::event_line(&ev));
        let _ = out.flush();
    })?;
    println!("\n{}", report::bench::summary(&record));
    if let Some(path) = &args.baseline {
        let saved = bench::compare::load(path)?;
        let c = bench::compare::compare(&[
            (path.display().to_string(), saved),
            ("this run".to_string(), record.clone()),
        ]);
        println!(
            "\nAgainst {}:\n{}",
            path.display(),
            report::compare::comparison(&c)
        );
    }
    if let Some(p) = &record.profile {
        println!("\n{}", report::profile::profile(&record, p, args.top));
    }
    if let Some(f) = &record.flops_profile {
        println!(
            "\n{}",
            report::profile::flops_profile(f, args.flops_depth, args.top)
        );
    }
    if let (Some(path), Some(p)) = (&args.profile_csv, &record.profile) {
        crate::files::write_atomic(path, bench::profile::csv(p).as_bytes())?;
        println!("Kernel table written to {}", path.display());
    }
    if let Some(path) = &args.trace {
        let trace = bench::profile::trace(&record.timeline, &record.environment.device.name);
        crate::files::write_atomic(path, serde_json::to_string(&trace)?.as_bytes())?;
        println!(
            "Trace written to {} (open it in ui.perfetto.dev or chrome://tracing)",
            path.display()
        );
    }
    if let Some(why) = crate::units::non_finite(&record.output) {
        eprintln!("warning: {why}");
    }
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&record)?;
        crate::files::write_atomic(path, json.as_bytes())?;
        println!("Record written to {}", path.display());
    }
    Ok(())
}

pub fn infer(args: InferArgs) -> Result<()> {
    crate::files::check_destination(&args.output)?;
    let precision = resolve_precision(&args.run)?;
    let graph = zoo::build(&args.run.network)?;
    // The shape is checked from the file's header, before its data is read.
    let mut file = TensorFile::open(&args.input)?;
    let name = file.pick("input")?;
    let shape = file.shape(&name).unwrap_or_default().to_vec();
    let [n, c, h, w] = *shape.as_slice() else {
        bail!(
            "`{}`: the input must be an image batch (N, C, H, W), got shape {shape:?}",
            args.input.display(),
        );
    };
    if n == 0 || h == 0 || w == 0 {
        bail!(
            "`{}`: the input holds no pixels (shape {shape:?}): it needs at least one image of at least 1×1",
            args.input.display(),
        );
    }
    for (name, v) in [("batch_size", n), ("input_size", h.max(w))] {
        if let Err(why) = bench::within_limit(name, v) {
            bail!(
                "`{}`: the input's {}: {why}",
                args.input.display(),
                name.replace('_', " ")
            );
        }
    }
    if let Some(Err(why)) = args.run.threads.map(|t| bench::within_limit("threads", t)) {
        bail!("--threads: {why}");
    }
    if c != graph.input_channels() {
        bail!(
            "`{}`: {} takes {} input channels, the input has {c}",
            args.input.display(),
            graph.name,
            graph.input_channels()
        );
    }
    if h != w {
        eprintln!("note: non-square input {h}×{w}");
    }
    let input = file.read(&name)?;
    let cfg = BenchConfig {
        network: graph.name.clone(),
        batch_size: n,
        precision,
        backend: args.run.backend,
        device: args.run.device,
        threads: args.run.threads,
        input_size: h.max(w),
        seed: args.run.seed,
        weights: weights_label(&args.run),
        kernels_dir: args.run.kernels_dir.clone(),
        kernels: args.run.kernels,
        compile: args.compile,
        recompile: args.recompile,
        ..Default::default()
    };
    let (_, mut session, _, compiled) =
        bench::prepare_hw(&cfg, args.run.weights.as_deref(), (h, w))?;
    if let Some(c) = &compiled {
        println!("Compiled {}", report::bench::compile_passes(c));
    }
    let start = Instant::now();
    let out = bench::infer(session.as_mut(), &input)?;
    let secs = start.elapsed().as_secs_f64();
    if let Some(parent) = args.output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("failed to create `{}`", parent.display()))?;
    }
    weights::write_tensors(&args.output, &[("logits", &out)])?;
    let compiled = compiled.map_or(String::new(), |c| format!(", compiled {}", c.mode.name()));
    println!(
        "{} {}{compiled} on {}: input {:?} → output {:?} in {:.1} ms, written to {}",
        graph.name,
        precision.name().to_uppercase(),
        args.run.backend,
        input.shape,
        out.shape,
        secs * 1e3,
        args.output.display()
    );
    if let Some(why) = crate::units::non_finite(&out.data) {
        eprintln!("warning: {why}");
    }
    Ok(())
}

pub fn models(args: ModelsArgs) -> Result<()> {
    if let Some(size) = args.input_size {
        if size == 0 {
            bail!("--input-size must be at least 1 (got 0)");
        }
        if let Err(why) = bench::within_limit("input_size", size) {
            bail!("--input-size: {why}");
        }
    }
    let mut rows = Vec::new();
    for name in zoo::NETWORKS {
        let graph = zoo::build(name)?;
        let size = args.input_size.unwrap_or(graph.default_input_size());
        let plan = match graph.plan(1, size, size) {
            Ok(plan) => plan,
            // A ViT fits only its own size: listed at that one when another is asked for all.
            Err(_) if args.input_size.is_some() => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("{name} cannot take {size}×{size} inputs"));
            }
        };
        let floats: u64 = graph
            .params()
            .iter()
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum();
        rows.push(report::bench::ModelRow {
            network: name.to_string(),
            params: graph.param_count(),
            macs: plan.macs(),
            flops: plan.flops(),
            weights_bytes_fp32: floats * 4,
            input_size: size,
        });
    }
    let decoders: Vec<_> = crate::model::llm::names()
        .into_iter()
        .filter_map(|n| {
            Some((
                crate::model::llm::built_in(n)?,
                crate::model::llm::source(n)?,
            ))
        })
        .collect();
    if args.json {
        // The image networks' rows, then the language models' (`kind`: language_model).
        let mut all = serde_json::to_value(&rows)?;
        if let (Some(list), serde_json::Value::Array(more)) = (
            all.as_array_mut(),
            serde_json::to_value(report::llm::decoder_rows(&decoders))?,
        ) {
            list.extend(more);
        }
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        println!("{}", report::bench::models_table(&rows));
        println!("\n{}", report::llm::models_table(&decoders));
    }
    Ok(())
}

pub fn weights(args: WeightsArgs) -> Result<()> {
    if let Some(config) = crate::model::llm::built_in(&args.network) {
        return decoder_folder(config, &args);
    }
    crate::files::check_destination(&args.output)?;
    if args.precision != Precision::Fp32 {
        bail!(
            "--precision {}: an image network's weights are written in fp32 (bench narrows them \
             at load); --precision is for language models",
            args.precision.name()
        );
    }
    let graph = zoo::build(&args.network)?;
    let w = bench::seeded_weights(&graph, args.seed, 224)?;
    w.save(&args.output, &graph)?;
    println!(
        "{} weights (seed {}) written to {}",
        graph.name,
        args.seed,
        args.output.display()
    );
    Ok(())
}

/// A language model's seeded weights as a Hugging Face model folder: `config.json` and one
/// `model.safetensors` under the checkpoint's names, in `--precision`, which `transformers`
/// loads with `from_pretrained` and `workshop bench --model-dir` reads back. Tensors are
/// made and written one at a time: an 8B model is written in the memory of its largest tensor.
fn decoder_folder(config: crate::model::llm::DecoderConfig, args: &WeightsArgs) -> Result<()> {
    use crate::model::llm::{DecoderWeights, weights::tensors};
    let dir = &args.output;
    if dir.is_file() {
        bail!(
            "`{}` is a file: a language model's weights are a folder (config.json and model.safetensors)",
            dir.display()
        );
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("failed to create `{}`", dir.display()))?;
    let precision = args.precision;
    let w = DecoderWeights::seeded(config.clone(), args.seed);
    crate::model::tensor_file::write_streamed(
        &dir.join("model.safetensors"),
        precision,
        &tensors(&config),
        |name| w.tensor(name),
    )?;
    let mut json = config.to_hf_json();
    json["torch_dtype"] = match precision {
        Precision::Fp32 => "float32",
        Precision::Fp16 => "float16",
        Precision::Bf16 => "bfloat16",
    }
    .into();
    let text = serde_json::to_string_pretty(&json)?;
    crate::files::write_atomic(&dir.join("config.json"), text.as_bytes())?;
    println!(
        "{} weights (seed {}, {}) written to {} (config.json, model.safetensors)",
        config.name,
        args.seed,
        precision.name(),
        dir.display()
    );
    Ok(())
}

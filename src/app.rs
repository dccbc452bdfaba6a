//! Commands: turn the parsed command line into runs, and runs into printed output and files.
//! Every failure comes back as an `anyhow` error with the context a user needs to fix it.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::backend::{self, ExecOptions};
use crate::bench::{self, record::BenchConfig};
use crate::cli::{
    BenchArgs, Cli, Command, CompareArgs, GatherArgs, InferArgs, ModelsArgs, PeakArgs, RunArgs,
    WeightsArgs,
};
use crate::course::commands;
use crate::model::{Precision, Weights, weights, zoo};
use crate::report;

pub fn run(cli: Cli) -> Result<()> {
    crate::settings::check()?;
    for w in backend::warnings() {
        eprintln!("warning: {w}");
    }
    match cli.command {
        Command::Bench(args) => bench_cmd(*args),
        Command::Infer(args) => infer_cmd(args),
        Command::Models(args) => models_cmd(args),
        Command::Weights(args) => weights_cmd(args),
        Command::Peak(a) => peak_cmd(a),
        Command::Gather(a) => gather_cmd(a),
        Command::Compare(a) => compare_cmd(a),
        Command::Collect(a) => crate::course::collect::collect_cmd(a),
        Command::Init(a) => commands::init(a),
        Command::Next(a) => commands::next(a),
        Command::Status(a) => commands::status(a),
        Command::List(a) => commands::list(a),
        Command::Goto(a) => commands::goto(a),
        Command::Skip(a) => commands::skip(a),
        Command::Hint(a) => commands::hint(a),
        Command::Reset(a) => commands::reset(a),
        Command::Run(a) => commands::run(a),
        Command::Results(a) => commands::results(a),
        Command::Book(a) => commands::book(a),
        Command::Dev(c) => commands::dev(c),
        Command::Doctor(a) => {
            let d = crate::doctor::collect();
            if a.json {
                println!("{}", serde_json::to_string_pretty(&d)?);
            } else {
                println!("{}", report::doctor(&d));
            }
            Ok(())
        }
    }
}

/// `--precision` and the classic `--fp16 0|1` must agree.
fn resolve_precision(run: &RunArgs) -> Result<Precision> {
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

fn bench_cmd(args: BenchArgs) -> Result<()> {
    let cfg = BenchConfig {
        network: args.run.network.clone(),
        batch_size: args.batch_size,
        iterations: args.iterations,
        warmup: args.warmup,
        precision: resolve_precision(&args.run)?,
        backend: args.run.backend,
        device: args.run.device,
        threads: args.run.threads,
        input_size: args.input_size,
        seed: args.run.seed,
        weights: weights_label(&args.run),
        profile: args.profile || args.profile_csv.is_some() || args.trace.is_some(),
        kernels_dir: args.run.kernels_dir.clone(),
        kernels: args.run.kernels,
        flops_prof_step: args.flops_prof_step,
        cores: None,
        compile: args.compile,
        recompile: args.recompile,
    };
    bench::validate(&cfg)?;
    if let Some(dir) = &args.results_dir {
        let rank = bench::multi::Rank::detect().context(
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
        let r = bench::multi::run_rank(&cfg, &rank, dir)?;
        println!("\n{}", report::summary(&r.record));
        println!(
            "Wrote {}; when every rank is done: workshop gather {}",
            bench::multi::rank_file(dir, rank.rank).display(),
            dir.display()
        );
        return Ok(());
    }
    let devices = match (&args.devices, args.cpu_groups) {
        (Some(list), _) => Some(bench::multi::parse_devices(list, cfg.backend)?),
        (None, Some(n)) => {
            if cfg.backend != backend::BackendKind::Cpu {
                bail!(
                    "--cpu-groups splits the CPU backend's cores; on {} use --devices",
                    cfg.backend
                );
            }
            Some(bench::multi::cpu_groups(n)?)
        }
        (None, None) => None,
    };
    if let Some(devices) = devices {
        println!("{}\n", report::config_echo(&cfg));
        let single = match &args.single {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read `{}`", path.display()))?;
                Some(
                    serde_json::from_str::<bench::record::BenchRecord>(&text).with_context(
                        || {
                            format!(
                                "`{}` is not a `workshop bench --json` record",
                                path.display()
                            )
                        },
                    )?,
                )
            }
            None => None,
        };
        let record = bench::multi::run(&cfg, &devices, single, &mut |s| println!("{s}"))?;
        println!("\n{}", report::multi(&record));
        if let Some(path) = &args.json {
            crate::files::write_atomic(path, serde_json::to_string_pretty(&record)?.as_bytes())?;
            println!("Wrote {}", path.display());
        }
        return Ok(());
    }
    if let Some(rank) = bench::multi::Rank::detect() {
        println!(
            "note: started as rank {} of {} by {}; add --results-dir DIR to benchmark this rank's share and gather the ranks",
            rank.rank, rank.world_size, rank.launcher
        );
    }
    println!("{}\n", report::config_echo(&cfg));
    println!("Building {} and preparing its weights...", cfg.network);
    let mut out = std::io::stdout();
    let record = bench::run(&cfg, args.run.weights.as_deref(), &mut |ev| {
        let _ = writeln!(out, "{}", report::event_line(&ev));
        let _ = out.flush();
    })?;
    println!("\n{}", report::summary(&record));
    if let Some(path) = &args.baseline {
        let saved = bench::compare::load(path)?;
        let c = bench::compare::compare(&[
            (path.display().to_string(), saved),
            ("this run".to_string(), record.clone()),
        ]);
        println!("\nAgainst {}:\n{}", path.display(), report::comparison(&c));
    }
    if let Some(p) = &record.profile {
        println!("\n{}", report::profile(p, args.top, record.config.backend));
    }
    if let Some(f) = &record.flops_profile {
        println!("\n{}", report::flops_profile(f, args.flops_depth, args.top));
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
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&record)?;
        crate::files::write_atomic(path, json.as_bytes())?;
        println!("Record written to {}", path.display());
    }
    Ok(())
}

fn infer_cmd(args: InferArgs) -> Result<()> {
    let precision = resolve_precision(&args.run)?;
    let graph = zoo::build(&args.run.network)?;
    let input = weights::read_tensor(&args.input, "input")?;
    let [n, c, h, w] = *input.shape.as_slice() else {
        bail!(
            "`{}`: the input must be an image batch (N, C, H, W), got shape {:?}",
            args.input.display(),
            input.shape
        );
    };
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
    let plan = graph
        .plan(n, h, w)
        .with_context(|| format!("{} cannot take {h}×{w} inputs", graph.name))?;
    let weights = match &args.run.weights {
        Some(p) => Weights::load(p, &graph)?,
        None => bench::seeded_weights(&graph, args.run.seed, h.max(w))?,
    };
    let backend = backend::open(args.run.backend)?;
    let opt = ExecOptions {
        precision,
        threads: args.run.threads,
        kernels_dir: args.run.kernels_dir.clone(),
        kernels: args.run.kernels,
        ..Default::default()
    };
    let mut session = backend.prepare(args.run.device, &plan, &weights, &opt)?;
    let start = Instant::now();
    let out = bench::infer(session.as_mut(), &input)?;
    let secs = start.elapsed().as_secs_f64();
    if let Some(parent) = args.output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("failed to create `{}`", parent.display()))?;
    }
    weights::write_tensors(&args.output, &[("logits", &out)])?;
    println!(
        "{} {} on {}: input {:?} → output {:?} in {:.1} ms, written to {}",
        graph.name,
        precision.name().to_uppercase(),
        args.run.backend,
        input.shape,
        out.shape,
        secs * 1e3,
        args.output.display()
    );
    Ok(())
}

fn models_cmd(args: ModelsArgs) -> Result<()> {
    if args.input_size == 0 {
        bail!("--input-size must be at least 1 (got 0)");
    }
    let mut rows = Vec::new();
    for name in zoo::NETWORKS {
        let graph = zoo::build(name)?;
        let plan = graph
            .plan(1, args.input_size, args.input_size)
            .with_context(|| format!("{name} cannot take {0}×{0} inputs", args.input_size))?;
        let floats: u64 = graph
            .params()
            .iter()
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum();
        rows.push(report::ModelRow {
            network: name.to_string(),
            params: graph.param_count(),
            macs: plan.macs(),
            flops: plan.flops(),
            weights_bytes_fp32: floats * 4,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("{}", report::models_table(&rows, args.input_size));
    }
    Ok(())
}

fn weights_cmd(args: WeightsArgs) -> Result<()> {
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

fn peak_cmd(a: PeakArgs) -> Result<()> {
    let (gemm, device) = bench::peak::gemm_on(
        a.backend,
        a.device,
        a.precision,
        a.threads,
        a.size,
        a.iterations,
    )?;
    let bandwidth =
        bench::peak::bandwidth_if_any(a.backend, a.device, a.array_mib, a.iterations, a.threads)?;
    // From the facts of the device that was measured (a GPU's SMs and clock, not the
    // host's), or measured on the CPU's cores.
    let ceiling = device.and_then(|d| bench::peak::theoretical(a.backend, &d, a.threads));
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "gemm": gemm, "bandwidth": bandwidth, "theoretical": ceiling })
        );
    } else {
        println!("{}", report::peak(&gemm, bandwidth.as_deref()));
        println!("{}", report::ceiling(gemm.gflops, ceiling.as_ref()));
    }
    if gemm.validated == gemm.iterations {
        let kept = bench::peak::keep(
            a.backend,
            a.device,
            a.threads,
            &gemm,
            bandwidth.as_deref().unwrap_or_default(),
        );
        // The measurement stands without the cache; say why it was not kept.
        match kept {
            Ok(path) if !a.json => println!(
                "Kept for FLOPs profiles and exercises in {}",
                path.display()
            ),
            Ok(_) => {}
            Err(e) => eprintln!("warning: the result was not kept for later: {e:#}"),
        }
    }
    if gemm.validated < gemm.iterations {
        bail!(
            "{} of {} GEMM results did not match the reference: the throughput above does not count",
            gemm.iterations - gemm.validated,
            gemm.iterations
        );
    }
    Ok(())
}

fn gather_cmd(a: GatherArgs) -> Result<()> {
    let g = bench::multi::gather(&a.dir)?;
    println!("{}", report::gathered(&g));
    if let Some(path) = &a.json {
        crate::files::write_atomic(path, serde_json::to_string_pretty(&g)?.as_bytes())?;
        println!("Wrote {}", path.display());
    }
    Ok(())
}

fn compare_cmd(a: CompareArgs) -> Result<()> {
    let records = a
        .records
        .iter()
        .map(|p| Ok((p.display().to_string(), bench::compare::load(p)?)))
        .collect::<Result<Vec<_>>>()?;
    let c = bench::compare::compare(&records);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        println!("{}", report::comparison(&c));
    }
    if let Some(path) = &a.markdown {
        crate::files::write_atomic(path, report::comparison_markdown(&c).as_bytes())?;
        eprintln!("Wrote {}", path.display());
    }
    if let Some(path) = &a.chart {
        crate::chart::comparison(&c, path)?;
        eprintln!("Drew {}", path.display());
    }
    Ok(())
}

/// `workshop dev kernels-check`.
pub(crate) fn kernels_check_cmd(args: crate::cli::KernelsCheckArgs) -> Result<()> {
    use crate::backend::gpu::check;
    for r in &args.require {
        if !check::COMPILERS.contains(&r.as_str()) {
            anyhow::bail!("--require takes {}, not `{r}`", check::COMPILERS.join(", "));
        }
    }
    let checks = check::run(args.kernels_dir.as_deref());
    println!("{}", report::kernels_check(&checks));
    let failed = checks
        .iter()
        .filter(|c| matches!(c.outcome, check::Outcome::Failed(_)))
        .count();
    let missing: Vec<&str> = checks
        .iter()
        .filter(|c| {
            matches!(c.outcome, check::Outcome::Skipped(_))
                && args.require.iter().any(|r| r == c.compiler)
        })
        .map(|c| c.compiler)
        .collect();
    if failed > 0 {
        anyhow::bail!("{failed} kernel compilation(s) failed (logs above)");
    }
    if !missing.is_empty() {
        anyhow::bail!("required compiler(s) missing: {}", missing.join(", "));
    }
    Ok(())
}

//! `workshop bench` for a language model: one run, or a sweep over batch sizes, prompt and
//! generation lengths (every combination, in order), each printed as it finishes.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::args::{BenchArgs, GenerateArgs};
use crate::bench::{self, llm, record::BenchConfig};
use crate::report;

/// Flags of `workshop bench` that only the image networks take, and what a decoder run has
/// instead.
fn refuse_image_flags(args: &BenchArgs) -> Result<()> {
    let image_only = [
        ("--input-size", args.input_size.is_some()),
        (
            "--weights (a language model reads --model-dir)",
            args.run.weights.is_some(),
        ),
        ("--profile-csv", args.profile_csv.is_some()),
        ("--trace", args.trace.is_some()),
        ("--flops-prof-step", args.flops_prof_step.is_some()),
        ("--devices", args.devices.is_some()),
        ("--cpu-groups", args.cpu_groups.is_some()),
        (
            "--compile other than reduce-overhead",
            args.compile
                .is_some_and(|c| c != crate::bench::record::CompileMode::ReduceOverhead),
        ),
        ("--results-dir", args.results_dir.is_some()),
        (
            "--kernels vendor",
            args.run.kernels != crate::backend::KernelFamily::Native,
        ),
    ];
    if let Some((flag, _)) = image_only.iter().find(|(_, given)| *given) {
        bail!(
            "{flag} is not available for language models yet: they take --batch-size, \
             --prompt-len, --gen-len, --precision, --backend, --threads, --model-dir, \
             --max-batched-tokens, --iterations, --warmup, --profile, --compile \
             reduce-overhead, --kernels-dir, --json and --baseline"
        );
    }
    Ok(())
}

/// `FILE` for a single run; `STEM-bB-pP-nN.EXT` beside it for each run of a sweep.
fn record_path(path: &Path, cfg: &BenchConfig, sweep: bool) -> PathBuf {
    if !sweep {
        return path.to_path_buf();
    }
    let (p, n) = llm::lengths(cfg);
    let stem = path
        .file_stem()
        .map_or_else(|| "run".into(), |s| s.to_string_lossy().into_owned());
    let ext = path
        .extension()
        .map_or_else(|| "json".into(), |s| s.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}-b{}-p{p}-n{n}.{ext}", cfg.batch_size))
}

pub fn bench(args: BenchArgs) -> Result<()> {
    refuse_image_flags(&args)?;
    let precision = super::bench::resolve_precision(&args.run)?;
    let or = |v: &[usize], d: usize| if v.is_empty() { vec![d] } else { v.to_vec() };
    let batches = or(&args.batch_size, 1);
    let prompts = or(&args.prompt_len, llm::DEFAULT_PROMPT);
    let gens = or(&args.gen_len, llm::DEFAULT_GENERATE);
    let base = BenchConfig {
        network: args.run.network.clone(),
        iterations: args.iterations.unwrap_or(llm::DEFAULT_ITERATIONS),
        warmup: args.warmup.unwrap_or(llm::DEFAULT_WARMUP),
        precision,
        backend: args.run.backend,
        device: args.run.device,
        threads: args.run.threads,
        seed: args.run.seed,
        weights: match &args.model_dir {
            Some(dir) => dir.display().to_string(),
            None => bench::record::random_weights_label(args.run.seed),
        },
        profile: args.profile,
        compile: args.compile,
        kernels_dir: args.run.kernels_dir.clone(),
        max_batched_tokens: args.max_batched_tokens,
        ..Default::default()
    };
    // The model and every combination are checked before the first run starts.
    let model = match &args.model_dir {
        Some(dir) => llm::weights_for(&base, Some(dir))?.config,
        None => crate::model::llm::built_in(&base.network)
            .ok_or_else(|| anyhow::anyhow!("`{}` is not a language model", base.network))?,
    };
    let mut runs = Vec::new();
    for &batch_size in &batches {
        for &p in &prompts {
            for &n in &gens {
                let cfg = BenchConfig {
                    network: model.name.clone(),
                    batch_size,
                    prompt_len: Some(p),
                    gen_len: Some(n),
                    ..base.clone()
                };
                bench::validate(&cfg)?;
                llm::validate(&cfg, &model)?;
                runs.push(cfg);
            }
        }
    }
    let sweep = runs.len() > 1;
    if let Some(path) = &args.json {
        for cfg in &runs {
            crate::files::check_destination(&record_path(path, cfg, sweep))?;
        }
    }
    let baseline = match &args.baseline {
        Some(path) => Some(bench::compare::load(path)?),
        None => None,
    };
    let mut records = Vec::new();
    for cfg in &runs {
        println!(
            "{}\n",
            report::llm::config_echo(cfg, &model.name, super::bench::emulated(cfg.backend))
        );
        let mut out = std::io::stdout();
        let record = llm::run(cfg, args.model_dir.as_deref(), &mut |ev| {
            let _ = writeln!(out, "{}", report::bench::event_line(&ev));
            let _ = out.flush();
        })?;
        if let Some(run) = &record.llm {
            println!("\n{}", report::llm::summary(&record, run));
        }
        if let (Some(path), Some(saved)) = (&args.baseline, &baseline) {
            let c = bench::compare::compare(&[
                (path.display().to_string(), saved.clone()),
                ("this run".to_string(), record.clone()),
            ]);
            println!(
                "\nAgainst {}:\n{}",
                path.display(),
                report::compare::comparison(&c)
            );
        }
        if let Some(why) = crate::units::non_finite(&record.output) {
            eprintln!("warning: {why}");
        }
        if let Some(path) = &args.json {
            let path = record_path(path, cfg, sweep);
            crate::files::write_atomic(&path, serde_json::to_string_pretty(&record)?.as_bytes())?;
            println!("Record written to {}", path.display());
        }
        println!();
        records.push(record);
    }
    if sweep {
        println!("{}", report::llm::sweep_table(&records));
    }
    Ok(())
}

pub fn generate(args: GenerateArgs) -> Result<()> {
    use crate::model::llm::chat::ChatTemplate;
    use crate::model::llm::text::{Sampling, Tokenizer};
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be 0 or more (got {})", args.temperature);
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be above 0 and at most 1 (got {})", args.top_p);
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if let Err(why) = bench::within_limit("gen_len", args.max_tokens) {
        bail!("--max-tokens: {why}");
    }
    let cfg = BenchConfig {
        network: args.network.clone().unwrap_or_default(),
        seed: args.seed,
        ..Default::default()
    };
    if args.network.is_none() && args.model_dir.is_none() {
        bail!("give a model: --network NAME (seeded weights) or --model-dir DIR");
    }
    let weights = llm::weights_for(&cfg, args.model_dir.as_deref())?;
    let model = weights.config.clone();
    let tokenizer = match &args.model_dir {
        Some(dir) => Tokenizer::open(dir)?,
        None => None,
    };
    if (args.chat || args.system.is_some()) && args.prompt.is_none() {
        bail!(
            "--chat and --system take a text prompt (--prompt TEXT): token ids go to the model as they are"
        );
    }
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => match &tokenizer {
            Some(t) if args.chat || args.system.is_some() => {
                let Some(dir) = &args.model_dir else {
                    unreachable!("a tokenizer comes from a model folder")
                };
                let template = ChatTemplate::open(dir)?.with_context(|| {
                    format!(
                        "--chat: `{}` has no chat template (chat_template.jinja, or chat_template \
                         in tokenizer_config.json): a base model takes the prompt as it is",
                        dir.display()
                    )
                })?;
                let mut messages = Vec::new();
                if let Some(system) = &args.system {
                    messages.push(("system", system.as_str()));
                }
                messages.push(("user", text.as_str()));
                t.encode(&template.render(&messages)?, false)?
            }
            Some(t) => t.encode(text, true)?,
            None => bail!(
                "--prompt needs the model folder's tokenizer.json ({}); give token ids with --prompt-ids",
                match &args.model_dir {
                    Some(dir) => format!("`{}` has none", dir.display()),
                    None => "a built-in model has none".into(),
                }
            ),
        },
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give a prompt: --prompt TEXT or --prompt-ids IDS"),
    };
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    llm::check_context(&model, prompt.len(), args.max_tokens)?;
    let context = prompt.len() + args.max_tokens;
    let backend = crate::backend::open(args.backend)?;
    let opt = crate::backend::DecoderOptions {
        precision: args.precision,
        threads: args.threads,
        batch: 1,
        context,
        profile: false,
        replay: false,
        kernels_dir: None,
        max_rows: None,
    };
    let mut session = backend.prepare_decoder(args.device, &weights, &opt)?;
    drop(weights);
    let sampling = Sampling {
        temperature: args.temperature,
        top_p: args.top_p,
    };
    let mut out = std::io::stdout();
    let mut generated = Vec::new();
    // The text is the prompt's and the continuation's ids decoded together (a tokenizer's
    // spaces and merged characters depend on the neighbours); what is new is printed.
    let mut all = prompt.clone();
    let mut shown = match &tokenizer {
        Some(t) => t.decode(&prompt)?,
        None => String::new(),
    };
    write!(out, "{shown}")?;
    let timing = llm::generate(
        session.as_mut(),
        &model,
        &prompt,
        args.max_tokens,
        sampling,
        args.seed,
        &mut |token| {
            generated.push(token);
            all.push(token);
            match &tokenizer {
                Some(t) => {
                    let text = t.decode(&all)?;
                    if let Some(new) = text.strip_prefix(shown.as_str()) {
                        write!(out, "{new}")?;
                    }
                    shown = text;
                }
                None => write!(out, "{}{token}", if generated.len() > 1 { "," } else { "" })?,
            }
            out.flush()?;
            Ok(())
        },
    )?;
    println!();
    eprintln!(
        "{}",
        report::llm::generation_line(&model.name, prompt.len(), generated.len(), &timing)
    );
    Ok(())
}

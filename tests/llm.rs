//! Language models against Hugging Face transformers: tiny decoders of each family with random
//! weights (tests/fixtures/llm, made by make_llm_fixtures.py) read through `--model-dir`'s
//! loader; the logits of every prompt position, the greedy continuation, and KV-cached decode
//! against a full recompute.

use std::path::{Path, PathBuf};

use workshop::backend::{self, BackendError, BackendKind, DecoderOptions, DecoderSession};
use workshop::model::Precision;
use workshop::model::llm::DecoderWeights;
use workshop::model::llm::text::argmax;

use crate::cli::fails_with;
use crate::common::{hand_made, skip, stderr, stdout, workshop};

const FAMILIES: [&str; 4] = ["llama", "qwen2", "mistral", "gpt2"];

fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llm")
        .join(family)
}

struct Expected {
    prompt: Vec<Vec<u32>>,
    /// (sequence, position, vocabulary).
    logits: Vec<Vec<Vec<f32>>>,
    generated: Vec<Vec<u32>>,
}

fn expected(family: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(family).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tokens = |k: &str| serde_json::from_value(v[k].clone()).unwrap();
    Expected {
        prompt: tokens("prompt"),
        logits: serde_json::from_value(v["logits"].clone()).unwrap(),
        generated: tokens("generated"),
    }
}

/// The backends that run decoders here: the CPU always, the GPU backends where this build and
/// machine have them (CI runs CUDA's and HIP's kernels on the emulator).
const BACKENDS: [BackendKind; 4] = [
    BackendKind::Cpu,
    BackendKind::Wgpu,
    BackendKind::Cuda,
    BackendKind::Hip,
];

/// A decoder session on `kind`, or `None` (and why, printed) where the backend is not here or
/// does not run language models yet.
fn session_on(
    kind: BackendKind,
    w: &DecoderWeights,
    precision: Precision,
    batch: usize,
) -> Option<Box<dyn DecoderSession>> {
    chunked_session(kind, w, precision, batch, None)
}

/// [`session_on`], with forward passes of at most `max_rows` rows.
fn chunked_session(
    kind: BackendKind,
    w: &DecoderWeights,
    precision: Precision,
    batch: usize,
    max_rows: Option<usize>,
) -> Option<Box<dyn DecoderSession>> {
    let opt = DecoderOptions {
        precision,
        threads: Some(2),
        batch,
        context: 32,
        profile: false,
        replay: false,
        kernels_dir: None,
        max_rows,
    };
    let prepared = backend::open(kind).and_then(|b| b.prepare_decoder(0, w, &opt));
    match prepared {
        Ok(s) => Some(s),
        Err(e @ BackendError::Unsupported(_)) => {
            eprintln!("skipped on {kind}: {e}");
            None
        }
        Err(e) if e.is_unavailable() => {
            skip(kind, &e.to_string());
            None
        }
        Err(e) => panic!("{kind}: {e}"),
    }
}

/// Largest |a − b| over the largest |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// The greedy continuation: prefill, then one argmax token per step; every step's logits.
fn greedy(s: &mut dyn DecoderSession, prompt: &[Vec<u32>], steps: usize) -> Vec<Vec<f32>> {
    let flat: Vec<u32> = prompt.concat();
    s.prefill(&flat, false).unwrap();
    let vocab = s.logits().unwrap().len() / prompt.len();
    let mut out = vec![s.logits().unwrap()];
    for _ in 1..steps {
        let next: Vec<u32> = out.last().unwrap().chunks(vocab).map(argmax).collect();
        s.decode(&next).unwrap();
        out.push(s.logits().unwrap());
    }
    out
}

/// The logits of every prompt position at `precision` on `kind`, relative to transformers' FP32
/// ones; `None` where `kind` does not run decoders here.
fn prompt_logits_rel(kind: BackendKind, family: &str, precision: Precision) -> Option<f32> {
    let want = expected(family);
    let w = DecoderWeights::open_folder(&fixture(family)).unwrap();
    let mut s = session_on(kind, &w, precision, 2)?;
    s.prefill(&want.prompt.concat(), true).unwrap();
    Some(rel_diff(
        &s.logits().unwrap(),
        &want.logits.concat().concat(),
    ))
}

#[test]
fn prompt_logits_match_transformers_in_fp32() {
    for (kind, family) in BACKENDS.iter().flat_map(|&k| FAMILIES.map(|f| (k, f))) {
        let Some(rel) = prompt_logits_rel(kind, family, Precision::Fp32) else {
            continue;
        };
        assert!(
            rel <= 1e-4,
            "{kind} {family}: logits differ from transformers by {rel:e}"
        );
    }
}

#[test]
fn greedy_continuation_matches_transformers_generate() {
    for (kind, family) in BACKENDS.iter().flat_map(|&k| FAMILIES.map(|f| (k, f))) {
        let want = expected(family);
        let w = DecoderWeights::open_folder(&fixture(family)).unwrap();
        let Some(mut s) = session_on(kind, &w, Precision::Fp32, 2) else {
            continue;
        };
        let steps = greedy(s.as_mut(), &want.prompt, want.generated[0].len());
        let vocab = w.config.vocab_size;
        let tokens: Vec<Vec<u32>> = (0..2)
            .map(|b| {
                steps
                    .iter()
                    .map(|l| argmax(&l[b * vocab..(b + 1) * vocab]))
                    .collect()
            })
            .collect();
        assert_eq!(tokens, want.generated, "{kind} {family}");
    }
}

/// A prefill in chunks of two positions (4 rows of 2 sequences) gives transformers' logits
/// too on every backend, every position's and each sequence's last: each chunk attends to what
/// the chunks before it cached.
#[test]
fn chunked_prefill_matches_transformers() {
    for (kind, family) in BACKENDS.iter().flat_map(|&k| FAMILIES.map(|f| (k, f))) {
        let want = expected(family);
        let w = DecoderWeights::open_folder(&fixture(family)).unwrap();
        let Some(mut s) = chunked_session(kind, &w, Precision::Fp32, 2, Some(4)) else {
            continue;
        };
        let all = want.logits.concat().concat();
        s.prefill(&want.prompt.concat(), true).unwrap();
        let rel = rel_diff(&s.logits().unwrap(), &all);
        assert!(
            rel <= 1e-4,
            "{kind} {family}: chunked logits off by {rel:e}"
        );
        s.prefill(&want.prompt.concat(), false).unwrap();
        let last: Vec<f32> = want
            .logits
            .iter()
            .flat_map(|seq| seq.last().unwrap().clone())
            .collect();
        let rel = rel_diff(&s.logits().unwrap(), &last);
        assert!(rel <= 1e-4, "{kind} {family}: last logits off by {rel:e}");
    }
}

/// A token table of 140,000 × 256 values (137 MiB in FP32, more than the 128 MiB one storage
/// binding holds on many adapters): wgpu cuts it, and the tied LM head, into slices of rows
/// and gives the CPU's logits, for the prompt and a decode step.
#[test]
fn token_table_larger_than_one_binding() {
    let mut cfg = workshop::model::llm::built_in("qwen2.5-0.5b").unwrap();
    cfg.name = "wide-vocabulary".into();
    (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) = (256, 64, 140_000);
    (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    ) = (4, 2, 64);
    cfg.num_hidden_layers = 1;
    let w = DecoderWeights::seeded(cfg, 3);
    let Some(mut gpu) = session_on(BackendKind::Wgpu, &w, Precision::Fp32, 1) else {
        return;
    };
    let mut cpu = session_on(BackendKind::Cpu, &w, Precision::Fp32, 1).unwrap();
    // Ids from both ends of the table, so more than one slice is read.
    let prompt = [5, 139_999, 70_000, 12];
    for s in [&mut gpu, &mut cpu] {
        s.prefill(&prompt, false).unwrap();
    }
    let (a, b) = (gpu.logits().unwrap(), cpu.logits().unwrap());
    assert!(rel_diff(&a, &b) <= 1e-4, "prompt: {:e}", rel_diff(&a, &b));
    let next = [argmax(&b)];
    for s in [&mut gpu, &mut cpu] {
        s.decode(&next).unwrap();
    }
    let (a, b) = (gpu.logits().unwrap(), cpu.logits().unwrap());
    assert!(rel_diff(&a, &b) <= 1e-4, "decode: {:e}", rel_diff(&a, &b));
}

/// Each decode step's logits equal those of the same position in one prefill of the whole
/// sequence (the KV cache holds what a recompute would compute), in every precision.
#[test]
fn cached_decode_matches_a_full_recompute() {
    for (kind, family) in BACKENDS.iter().flat_map(|&k| FAMILIES.map(|f| (k, f))) {
        let want = expected(family);
        let w = DecoderWeights::open_folder(&fixture(family)).unwrap();
        // One sequence (a decode step is then one row: the GEMMs' single-row kernels) and two.
        for (precision, batch) in [Precision::Fp32, Precision::Bf16, Precision::Fp16]
            .into_iter()
            .flat_map(|p| [(p, 1), (p, 2)])
        {
            let prompt = &want.prompt[..batch];
            let Some(mut s) = session_on(kind, &w, precision, batch) else {
                continue;
            };
            let steps = greedy(s.as_mut(), prompt, 6);
            let vocab = w.config.vocab_size;
            // The sequences as decoded: prompt, then each step's argmax but the last's.
            let mut seqs = prompt.to_vec();
            for l in &steps[..steps.len() - 1] {
                for (b, seq) in seqs.iter_mut().enumerate() {
                    seq.push(argmax(&l[b * vocab..(b + 1) * vocab]));
                }
            }
            let len = seqs[0].len();
            s.prefill(&seqs.concat(), true).unwrap();
            let full = s.logits().unwrap();
            let tolerance = if precision == Precision::Fp32 {
                1e-5
            } else {
                2e-2
            };
            for (i, step) in steps.iter().enumerate() {
                let pos = prompt[0].len() - 1 + i;
                let recompute: Vec<f32> = (0..batch)
                    .flat_map(|b| {
                        full[(b * len + pos) * vocab..(b * len + pos + 1) * vocab].to_vec()
                    })
                    .collect();
                let rel = rel_diff(step, &recompute);
                assert!(
                    rel <= tolerance,
                    "{kind} {family} {precision:?} batch {batch} step {i}: cached decode differs from a recompute by {rel:e}"
                );
            }
        }
    }
}

/// Half precisions stay near FP32's logits (bf16 keeps 8 bits of mantissa).
#[test]
fn half_precisions_stay_near_fp32() {
    for (kind, family) in BACKENDS.iter().flat_map(|&k| FAMILIES.map(|f| (k, f))) {
        for (precision, tolerance) in [(Precision::Bf16, 5e-2), (Precision::Fp16, 1e-2)] {
            let Some(rel) = prompt_logits_rel(kind, family, precision) else {
                continue;
            };
            assert!(
                rel <= tolerance,
                "{kind} {family} {precision:?}: {rel:e} from transformers"
            );
        }
    }
}

/// `workshop bench` on a model folder: a sweep of two batch sizes, a record per run that
/// `compare` reads, and the sweep's table.
#[test]
fn bench_sweeps_a_model_folder_and_writes_records() {
    let dir = tempfile_dir("sweep");
    let json = dir.join("run.json");
    let folder = fixture("qwen2");
    let o = workshop(&[
        "bench",
        "--model-dir",
        folder.to_str().unwrap(),
        "-b",
        "1,2",
        "-p",
        "8",
        "-n",
        "4",
        "--iterations",
        "2",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--profile",
        "--max-batched-tokens",
        "6",
        "--json",
        json.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    for needle in [
        "TTFT",
        "TPOT",
        "Bandwidth",
        "a plain read of the weights reached beside it",
        "Prefill time",
        "prefill tok/s",
    ] {
        assert!(out.contains(needle), "`{needle}` missing from:\n{out}");
    }
    let mut records = Vec::new();
    for b in [1, 2] {
        let path = dir.join(format!("run-b{b}-p8-n4.json"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["config"]["batch_size"], b);
        assert_eq!(v["config"]["prompt_len"], 8);
        assert_eq!(v["config"]["max_batched_tokens"], 6);
        // Two timed generations of three decode steps each.
        assert_eq!(v["samples_s"].as_array().unwrap().len(), 6);
        assert_eq!(v["llm"]["ttft_s"].as_array().unwrap().len(), 2);
        assert!(v["llm"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
        // The decode is judged against its weights read beside it.
        assert!(v["llm"]["read_gbps"].as_f64().unwrap() > 0.0);
        records.push(path.to_str().unwrap().to_string());
    }
    let o = workshop(&["compare", &records[0], &records[1]]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `workshop bench` on the GPU backends: a decode step recorded once and replayed with
/// `--compile reduce-overhead` (CUDA), and the time of each kind of op with `--profile`.
#[test]
fn gpu_backends_bench_a_model_folder() {
    let dir = tempfile_dir("gpu");
    let folder = fixture("llama");
    for (kind, flag) in [
        (BackendKind::Cuda, ["--compile", "reduce-overhead"]),
        (BackendKind::Hip, ["--profile", "--warmup=0"]),
        (BackendKind::Wgpu, ["--profile", "--warmup=0"]),
    ] {
        match backend::open(kind) {
            Err(e) => {
                skip(kind, &e.to_string());
                continue;
            }
            Ok(b) if b.devices().is_empty() => {
                skip(kind, "no device");
                continue;
            }
            Ok(_) => {}
        }
        let json = dir.join(format!("{kind}.json"));
        let o = workshop(&[
            "bench",
            "--model-dir",
            folder.to_str().unwrap(),
            "--backend",
            kind.name(),
            "-p",
            "6",
            "-n",
            "3",
            "--iterations",
            "1",
            flag[0],
            flag[1],
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{kind}: {}", stderr(&o));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let version = v["environment"]["kernel_version"].as_str().unwrap();
        let ours = if kind == BackendKind::Wgpu {
            "workshop-wgsl"
        } else {
            "workshop-gpu"
        };
        assert!(version.contains(ours), "{version}");
        if kind == BackendKind::Cuda {
            assert!(version.contains("decode step replayed"), "{version}");
        } else {
            let out = stdout(&o);
            assert!(out.contains("attention"), "no op times in:\n{out}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad input to a decoder run: one clear line naming what is wrong, no panic.
#[test]
fn bad_decoder_input_fails_clearly() {
    let llama = fixture("llama");
    let llama = llama.to_str().unwrap();
    fails_with(
        &["bench", "--model-dir", llama, "-p", "60", "-n", "8"],
        "longer than llama's limit of 64 positions",
    );
    fails_with(
        &["bench", "--model-dir", llama, "-n", "1"],
        "--gen-len must be at least 2",
    );
    fails_with(
        &[
            "bench",
            "--model-dir",
            llama,
            "-b",
            "4",
            "--max-batched-tokens",
            "2",
        ],
        "--max-batched-tokens (2) must be at least the batch size (4)",
    );
    fails_with(
        &[
            "bench",
            "--network",
            "resnet18",
            "--max-batched-tokens",
            "64",
        ],
        "--max-batched-tokens is for language models",
    );
    fails_with(
        &["bench", "--network", "gpt2", "--compile"],
        "--compile other than reduce-overhead is not available",
    );
    let dir = tempfile_dir("bad");
    fails_with(
        &["bench", "--model-dir", dir.to_str().unwrap()],
        "has no config.json",
    );
    let config = std::fs::read_to_string(fixture("llama").join("config.json")).unwrap();
    let cases = [
        (
            config.replace("\"llama\"", "\"bert\""),
            "`model_type`: `bert` is not supported",
        ),
        (
            config.replace("\"silu\"", "\"gelu\""),
            "`hidden_act`: `gelu` is not supported",
        ),
        (
            config.replace("\"vocab_size\": 128", "\"vocab_size\": 100"),
            "tensor `model.embed_tokens.weight` has shape [128, 32], but the config needs [100, 32]",
        ),
    ];
    for (text, needle) in cases {
        std::fs::write(dir.join("config.json"), text).unwrap();
        std::fs::copy(
            fixture("llama").join("model.safetensors"),
            dir.join("model.safetensors"),
        )
        .unwrap();
        fails_with(&["bench", "--model-dir", dir.to_str().unwrap()], needle);
    }
    // GPT-2's weights under a Llama config: the first tensor the config needs is named.
    std::fs::write(dir.join("config.json"), &config).unwrap();
    std::fs::copy(
        fixture("gpt2").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    fails_with(
        &["bench", "--model-dir", dir.to_str().unwrap()],
        "tensor `model.embed_tokens.weight` is missing",
    );
    // A sharded index whose shard names climb out of the folder: refused, the index named.
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.embed_tokens.weight": "../model.safetensors"}}"#,
    )
    .unwrap();
    fails_with(
        &["bench", "--model-dir", dir.to_str().unwrap()],
        "model.safetensors.index.json` names a weights file: `../model.safetensors` is not a \
         plain file name",
    );
    // Two shards that hold the same tensors: refused, not the last one read.
    for shard in ["a.safetensors", "b.safetensors"] {
        std::fs::copy(fixture("llama").join("model.safetensors"), dir.join(shard)).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"lm_head.weight": "a.safetensors", "model.norm.weight": "b.safetensors"}}"#,
    )
    .unwrap();
    fails_with(
        &["bench", "--model-dir", dir.to_str().unwrap()],
        "is in two weights files, `a.safetensors` and `b.safetensors`: refusing to pick one",
    );
    // A GPT-2 tensor under both of its names (with and without `transformer.`): refused, not
    // whichever name sorts last.
    std::fs::copy(fixture("gpt2").join("config.json"), dir.join("config.json")).unwrap();
    std::fs::copy(
        fixture("gpt2").join("model.safetensors"),
        dir.join("a.safetensors"),
    )
    .unwrap();
    hand_made(
        &dir.join("b.safetensors"),
        r#"{"wte.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        4,
    );
    fails_with(
        &["bench", "--model-dir", dir.to_str().unwrap()],
        "tensor `wte.weight` is in the model folder twice, as `wte.weight` (in `b.safetensors`) \
         and as `transformer.wte.weight` (in `a.safetensors`): refusing to pick one",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `workshop weights` writes a language model as a Hugging Face folder in the precision asked
/// for, a tensor at a time; the folder reads back to the seeded values rounded to it, and an
/// image network is refused anything but fp32.
#[test]
fn weights_writes_a_model_folder_in_bf16() {
    let dir = tempfile_dir("weights");
    let out = dir.join("gpt2");
    let o = workshop(&[
        "weights",
        "--network",
        "gpt2",
        "--precision",
        "bf16",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("bf16"), "{}", stdout(&o));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let read = DecoderWeights::open_folder(&out).unwrap();
    let seeded = DecoderWeights::seeded(read.config.clone(), 0);
    for name in ["wte.weight", "h.11.mlp.c_proj.weight", "ln_f.weight"] {
        let want: Vec<f32> = seeded
            .tensor(name)
            .unwrap()
            .iter()
            .map(|&x| Precision::Bf16.round(x))
            .collect();
        assert!(read.tensor(name).unwrap() == want, "{name}");
    }
    // 124M parameters in 2 bytes each, and the header.
    let bytes = std::fs::metadata(out.join("model.safetensors"))
        .unwrap()
        .len();
    assert!((248_000_000..250_000_000).contains(&bytes), "{bytes}");
    let _ = std::fs::remove_dir_all(&dir);
    fails_with(
        &[
            "weights",
            "--network",
            "resnet18",
            "--precision",
            "fp16",
            "--output",
            "/tmp/never-written.safetensors",
        ],
        "image network's weights are written in fp32",
    );
    assert!(!Path::new("/tmp/never-written.safetensors").exists());
}

fn tempfile_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("workshop-llm-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `workshop generate` with text: the folder's tokenizer encodes the prompt, the greedy
/// continuation streams as text, all as transformers and tokenizers give it.
#[test]
fn generate_streams_the_text_transformers_writes() {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llama").join("expected.json")).unwrap(),
    )
    .unwrap();
    let folder = fixture("llama");
    let o = workshop(&[
        "generate",
        "--model-dir",
        folder.to_str().unwrap(),
        "--prompt",
        v["text_prompt"].as_str().unwrap(),
        "--max-tokens",
        "8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim_end(), v["text"].as_str().unwrap());
    assert!(stderr(&o).contains("8 generated"), "{}", stderr(&o));
    // A system message and a prompt through the folder's chat template: the ids transformers'
    // apply_chat_template gives (the prompt's length says so) and its greedy continuation.
    let o = workshop(&[
        "generate",
        "--model-dir",
        folder.to_str().unwrap(),
        "--system",
        v["chat_system"].as_str().unwrap(),
        "--prompt",
        v["chat_prompt"].as_str().unwrap(),
        "--max-tokens",
        "8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim_end(), v["chat_text"].as_str().unwrap());
    let prompt_len = v["chat_ids"].as_array().unwrap().len();
    assert!(
        stderr(&o).contains(&format!("{prompt_len} prompt")),
        "{}",
        stderr(&o)
    );
    // The same folder without its template: --chat says what is missing.
    let bare = tempfile_dir("no-template");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(folder.join(f), bare.join(f)).unwrap();
    }
    fails_with(
        &[
            "generate",
            "--model-dir",
            bare.to_str().unwrap(),
            "--chat",
            "--prompt",
            "hi",
        ],
        "has no chat template",
    );
    // generation_config.json's end tokens stop a generation too (transformers' generate reads
    // them there): the text's first new token ends it at once.
    let first = v["text_ids"][0].as_u64().unwrap();
    let generation = bare.join("generation_config.json");
    std::fs::write(
        &generation,
        format!(r#"{{"eos_token_id": [7777, {first}]}}"#),
    )
    .unwrap();
    let o = workshop(&[
        "generate",
        "--model-dir",
        bare.to_str().unwrap(),
        "--prompt",
        v["text_prompt"].as_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(", 1 generated"), "{}", stderr(&o));
    std::fs::write(&generation, r#"{"eos_token_id": -1}"#).unwrap();
    fails_with(
        &[
            "generate",
            "--model-dir",
            bare.to_str().unwrap(),
            "--prompt",
            "hi",
        ],
        "eos_token_id -1 is not a token id",
    );
    let _ = std::fs::remove_dir_all(&bare);
    fails_with(
        &[
            "generate",
            "--network",
            "gpt2",
            "--chat",
            "--prompt-ids",
            "1",
        ],
        "--chat and --system take a text prompt",
    );
    // Token ids in, token ids out.
    let want = expected("qwen2");
    let ids: Vec<String> = want.prompt[0].iter().map(u32::to_string).collect();
    let folder = fixture("qwen2");
    let o = workshop(&[
        "generate",
        "--model-dir",
        folder.to_str().unwrap(),
        "--prompt-ids",
        &ids.join(","),
        "--max-tokens",
        "8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got: Vec<u32> = stdout(&o)
        .trim()
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(got, want.generated[0]);
    let qwen = folder.to_str().unwrap();
    fails_with(
        &["generate", "--model-dir", qwen, "--prompt", "hello"],
        "--prompt needs the model folder's tokenizer.json",
    );
    fails_with(
        &["generate", "--model-dir", qwen, "--prompt-ids", "1,500"],
        "token id 500 is outside",
    );
    fails_with(
        &[
            "generate",
            "--model-dir",
            qwen,
            "--prompt-ids",
            "1",
            "--top-p",
            "0",
        ],
        "--top-p must be above 0",
    );
    fails_with(
        &[
            "generate",
            "--model-dir",
            qwen,
            "--prompt-ids",
            "1",
            "--max-tokens",
            "70",
        ],
        "longer than qwen2's limit of 64 positions",
    );
}

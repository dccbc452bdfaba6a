//! The binary as a user meets it: `models`, `bench` with its record, `infer` against the
//! reference, `weights`, and one clear line (no panic) for each kind of bad input.

use serde_json::Value;
use workshop::model::weights::{read_tensor, write_tensors};
use workshop::model::{Precision, Rng, Weights, reference, zoo};

use crate::common::{stderr, stdout, workshop};

/// A failed command: non-zero exit, a one-line `error:` message containing `needle`, no panic.
/// Run `args` with `--json PATH` added, expect success, and return stdout and the record.
fn run_json(args: &[&str], json: &std::path::Path) -> (String, Value) {
    let mut a = args.to_vec();
    a.extend(["--json", json.to_str().unwrap()]);
    let o = workshop(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    (stdout(&o), read_json(json))
}

fn read_json(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Run `args` as a user's build does (without the GPU emulator CI sets for backend tests) and
/// expect a failure that says `needle`, with no panic.
pub(crate) fn fails_with(args: &[&str], needle: &str) {
    let o = crate::common::command()
        .env_remove(workshop::backend::gpu::emu::ENV)
        .args(args)
        .output()
        .expect("failed to start workshop");
    let err = stderr(&o);
    assert!(!o.status.success(), "{args:?} succeeded");
    assert!(
        err.contains(needle),
        "{args:?}: expected `{needle}` in:\n{err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{args:?} panicked:\n{err}"
    );
}

#[test]
fn models_lists_the_zoo_with_torchvision_counts() {
    let o = workshop(&["models"]);
    assert!(o.status.success());
    let out = stdout(&o);
    assert!(
        out.contains("resnet50") && out.contains("25,557,032") && out.contains("4.089"),
        "{out}"
    );
    let o = workshop(&["models", "--json"]);
    let rows: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    let decoders = workshop::model::llm::names().len();
    assert_eq!(rows.len(), zoo::NETWORKS.len() + decoders);
    // The language models follow the image networks, with their own numbers per token.
    let qwen = rows
        .iter()
        .find(|r| r["network"] == "qwen2.5-0.5b")
        .unwrap();
    assert_eq!(qwen["kind"], "language_model");
    assert_eq!(qwen["params"], 494_032_768);
    // Two FLOPs per weight of every GEMM, the LM head included.
    assert!(qwen["flops_per_token"].as_u64().unwrap() > 494_032_768);
}

#[test]
fn bench_prints_iterations_and_writes_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let o = workshop(&[
        "bench",
        "--network",
        "resnet18",
        "--batch-size",
        "2",
        "--iterations",
        "3",
        "--warmup",
        "1",
        "--input-size",
        "64",
        "--threads",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("Warm-up   0: loss = ") && out.contains("Iteration   2: loss = "),
        "{out}"
    );
    assert!(
        out.contains("Throughput") && out.contains("images/s") && out.contains("CV"),
        "{out}"
    );
    let r: Value = read_json(&json);
    assert_eq!(r["schema_version"], 1);
    assert_eq!(r["config"]["network"], "resnet18");
    assert_eq!(r["config"]["precision"], "fp32");
    assert_eq!(r["samples_s"].as_array().unwrap().len(), 3);
    assert_eq!(r["warmup_s"].as_array().unwrap().len(), 1);
    // Start-up is reported on the Prepared line and kept, apart from the statistics.
    let prepare_s = r["prepare_s"].as_f64().unwrap();
    assert!(prepare_s > 0.0, "{prepare_s}");
    let line = out.lines().find(|l| l.starts_with("Prepared ")).unwrap();
    assert!(
        line.contains("parameters (random(seed=0)) in ") && line.ends_with(" s."),
        "{line}"
    );
    let median = r["stats"]["median_s"].as_f64().unwrap();
    let throughput = r["stats"]["throughput_median"].as_f64().unwrap();
    assert!(median > 0.0 && (throughput - 2.0 / median).abs() < 1e-6 * throughput);
    assert_eq!(r["model"]["params"], 11_689_512);
    assert!(r["memory"]["peak"].as_u64().unwrap() > r["memory"]["weights"].as_u64().unwrap());
    // "Weights" is the network's 11.7 M parameters in FP32, whatever the backend packs on top;
    // the per-image time is the median step's.
    let memory = out.lines().find(|l| l.starts_with("Memory")).unwrap();
    assert!(memory.contains(" peak: 44.6 MiB weights"), "{memory}");
    let per_image = format!("Per image     {:.1} µs", median * 1e6 / 2.0);
    assert!(out.contains(&per_image), "{per_image} in {out}");
    assert!(
        r["environment"]["device"]["name"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
    // The machine's state while the iterations ran: Linux's counters, a reading before and
    // one after at least, other programs' load over the window, in the record and the summary.
    if cfg!(target_os = "linux") {
        let t = &r["environment"]["telemetry"]["Ok"];
        assert_eq!(t["source"], "Linux /proc and /sys", "{t}");
        let readings = t["readings"].as_array().unwrap();
        assert!(readings.len() >= 2, "{t}");
        // /proc/stat counts in ticks of 10 ms: a window of several has a share.
        if t["summary"]["seconds"].as_f64().unwrap() > 0.1 {
            assert!(readings.last().unwrap()["steal"].as_f64().is_some(), "{t}");
        }
        assert!(t["cores"].as_u64().unwrap() >= 1);
        assert!(out.contains("Machine       "), "{out}");
    }
}

#[test]
fn random_resnet50_loss_is_near_ln_1000() {
    // The classic workshop's untrained ResNet-50 prints a loss of 6.9078 on random labels.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r50.json");
    let o = workshop(&[
        "bench",
        "--network",
        "resnet50",
        "--batch-size",
        "4",
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = read_json(&json);
    let loss = r["loss"].as_f64().unwrap();
    assert!((loss - 1000f64.ln()).abs() < 0.75, "loss {loss}");
}

#[test]
fn half_precisions_run_and_say_so() {
    let o = workshop(&[
        "bench",
        "--network",
        "mobilenet_v2",
        "--batch-size",
        "1",
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--input-size",
        "64",
        "--fp16",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Precision:   FP16"));
    let o = workshop(&[
        "bench",
        "--network",
        "alexnet",
        "--batch-size",
        "1",
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--input-size",
        "96",
        "--precision",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("mobilenet_v2").eq(&false) && stdout(&o).contains("BF16"));
}

/// Batch tiles asked for by name run end to end and still match the reference; a value the
/// CPU backend cannot use is refused with what was wrong.
#[test]
fn batch_tiles_match_the_reference_and_bad_cuts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (wpath, xpath, ypath) = (
        dir.path().join("w.safetensors"),
        dir.path().join("x.safetensors"),
        dir.path().join("y.safetensors"),
    );
    let o = workshop(&[
        "weights",
        "--network",
        "resnet18",
        "--seed",
        "2",
        "--output",
        wpath.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let x = Rng::new(4).normal_tensor(vec![3, 3, 40, 40]);
    write_tensors(&xpath, &[("input", &x)]).unwrap();
    let graph = zoo::build("resnet18").unwrap();
    let w = Weights::load(&wpath, &graph).unwrap();
    let expected = reference::forward(&graph.plan(3, 40, 40).unwrap(), &w, &x);
    let scale = expected.data.iter().fold(1f32, |a, v| a.max(v.abs()));
    let infer = |split: &str| {
        crate::common::command()
            .env("WORKSHOP_CPU_SPLIT", split)
            .args(["infer", "--network", "resnet18", "--weights"])
            .arg(&wpath)
            .arg("--input")
            .arg(&xpath)
            .arg("--output")
            .arg(&ypath)
            .output()
            .unwrap()
    };
    for asked in ["layer1.1.relu:2", "layer1.0.relu:1,layer2.1.relu:2"] {
        let o = infer(asked);
        assert!(o.status.success(), "{asked}: {}", stderr(&o));
        let diff = read_tensor(&ypath, "logits")
            .unwrap()
            .max_abs_diff(&expected);
        assert!(diff <= 1e-4 * scale, "{asked}: diff {diff}");
    }
    // A profile of a tiled run says why its early layers are called more than once.
    let o = crate::common::command()
        .env("WORKSHOP_CPU_SPLIT", "layer1.1.relu:1")
        .args([
            "bench",
            "--network",
            "resnet18",
            "--batch-size",
            "2",
            "--input-size",
            "32",
        ])
        .args(["--iterations", "1", "--warmup", "0", "--profile"])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(
        o.status.success()
            && out.contains("Calls count kernel runs, not layers: batch tiles of 1 image"),
        "{out}{}",
        stderr(&o)
    );
    for (bad, says) in [
        (
            "layer1.1.conv1:2",
            "cannot be joined after `layer1.1.conv1`",
        ),
        ("layer9.relu:2", "no node `layer9.relu`"),
        ("layer1.1.relu:0", "not a positive number"),
        ("all", "neither `off` nor NODE:IMAGES"),
        (
            "layer2.1.relu:2,layer1.1.relu:4",
            "must come after its inner level's node",
        ),
    ] {
        let o = infer(bad);
        assert!(!o.status.success(), "{bad} ran");
        assert!(stderr(&o).contains(says), "{bad}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
    // Tiles named in the compiled graph (layer1.1.conv2 is its block's output once the add is
    // fused into it; in the eager graph the add still reads the block's input after it) run
    // the compiled network, and the eager reference it is checked against runs whole.
    let record = dir.path().join("compiled.json");
    let o = crate::common::command()
        .env("WORKSHOP_CPU_SPLIT", "layer1.1.conv2:1")
        .args(["bench", "--network", "resnet18", "--batch-size", "2"])
        .args(["--input-size", "32", "--compile", "default"])
        .args(["--iterations", "1", "--warmup", "0", "--json"])
        .arg(&record)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let json = std::fs::read_to_string(&record).unwrap();
    assert!(
        json.contains("batch tiles of 1 image up to layer1.1.conv2")
            && stdout(&o).contains("Check"),
        "{json}"
    );
}

/// MobileNetV3-Small's depthwise convolutions (3×3 and 5×5, strides 1 and 2, 16 to 576
/// channels: register blocks of 16 and 8 and single channels), hardswish and squeeze-excite,
/// eager and compiled (the activation fused into the depthwise epilogue), FP32 and BF16, on
/// every SIMD path this CPU runs (resnet18's test above has no depthwise layer), against the
/// reference on a non-square input.
#[test]
fn depthwise_network_matches_the_reference_on_every_simd_path() {
    let dir = tempfile::tempdir().unwrap();
    let wpath = dir.path().join("w.safetensors");
    let xpath = dir.path().join("x.safetensors");
    let ypath = dir.path().join("y.safetensors");
    let network = "mobilenet_v3_small";
    let o = workshop(&[
        "weights",
        "--network",
        network,
        "--seed",
        "3",
        "--output",
        wpath.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let x = Rng::new(4).normal_tensor(vec![2, 3, 72, 56]);
    write_tensors(&xpath, &[("input", &x)]).unwrap();
    let graph = zoo::build(network).unwrap();
    let w = Weights::load(&wpath, &graph).unwrap();
    let expected = reference::forward(&graph.plan(2, 72, 56).unwrap(), &w, &x);
    let scale = expected.data.iter().fold(1f32, |a, v| a.max(v.abs()));
    for (precision, tolerance) in [(Precision::Fp32, 1e-4), (Precision::Bf16, 1e-2)] {
        for simd in ["", "avx512bf16", "avx512", "avx2", "portable"] {
            for compile in [false, true] {
                let o = crate::common::command()
                    .env("WORKSHOP_CPU_SIMD", simd)
                    .args([
                        "infer",
                        "--network",
                        network,
                        "--precision",
                        precision.name(),
                    ])
                    .args(compile.then_some("--compile"))
                    .args(["--weights", wpath.to_str().unwrap()])
                    .args(["--input", xpath.to_str().unwrap()])
                    .args(["--output", ypath.to_str().unwrap()])
                    .output()
                    .unwrap();
                assert!(o.status.success(), "{}", stderr(&o));
                let diff = read_tensor(&ypath, "logits")
                    .unwrap()
                    .max_abs_diff(&expected);
                assert!(
                    diff <= tolerance * scale,
                    "{precision:?}, simd `{simd}`, compiled {compile}: diff {diff} (scale {scale})"
                );
            }
        }
    }
}

#[test]
fn infer_matches_the_reference_through_files() {
    let dir = tempfile::tempdir().unwrap();
    let wpath = dir.path().join("w.safetensors");
    let xpath = dir.path().join("x.safetensors");
    let ypath = dir.path().join("out/y.safetensors");
    let o = workshop(&[
        "weights",
        "--network",
        "resnet18",
        "--seed",
        "5",
        "--output",
        wpath.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let x = Rng::new(9).normal_tensor(vec![2, 3, 48, 40]);
    write_tensors(&xpath, &[("input", &x)]).unwrap();
    let graph = zoo::build("resnet18").unwrap();
    let w = Weights::load(&wpath, &graph).unwrap();
    let expected = reference::forward(&graph.plan(2, 48, 40).unwrap(), &w, &x);
    let scale = expected.data.iter().fold(1f32, |a, v| a.max(v.abs()));
    // The CPU's preferred SIMD paths, then AVX512_BF16's pairs (which the start-up probe
    // declines on a CPU that runs them slower than FMAs), AVX-512's without bf16 pairs and
    // AVX2's (what a CPU with more would otherwise never run here: BF16 convolutions widened
    // for the FP32 GEMM and Winograd instead of AMX or `vdpbf16ps`) and the portable ones that
    // CPUs without AVX2 + FMA run; in FP32 and in BF16. A path the CPU lacks warns and runs
    // the best.
    for (precision, tolerance) in [(Precision::Fp32, 1e-4), (Precision::Bf16, 6e-2)] {
        for simd in ["", "avx512bf16", "avx512", "avx2", "portable"] {
            let o = crate::common::command()
                .env("WORKSHOP_CPU_SIMD", simd)
                .args([
                    "infer",
                    "--network",
                    "resnet18",
                    "--precision",
                    precision.name(),
                    "--weights",
                    wpath.to_str().unwrap(),
                    "--input",
                    xpath.to_str().unwrap(),
                    "--output",
                    ypath.to_str().unwrap(),
                ])
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
            let got = read_tensor(&ypath, "logits").unwrap();
            let diff = got.max_abs_diff(&expected);
            assert!(
                diff <= tolerance * scale,
                "{precision:?}, simd `{simd}`: diff {diff}"
            );
        }
    }
    // Compiled (batch norms folded, activations and adds fused) on the same non-square input:
    // the compiled graph's logits are what the reference computes from the eager one.
    let o = workshop(&[
        "infer",
        "--network",
        "resnet18",
        "--compile",
        "--weights",
        wpath.to_str().unwrap(),
        "--input",
        xpath.to_str().unwrap(),
        "--output",
        ypath.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("Compiled default") && stdout(&o).contains("20 batch norms folded"),
        "{}",
        stdout(&o)
    );
    let diff = read_tensor(&ypath, "logits")
        .unwrap()
        .max_abs_diff(&expected);
    assert!(diff <= 1e-4 * scale, "compiled: diff {diff}");
    let o = crate::common::command()
        .env("WORKSHOP_CPU_SIMD", "portable")
        .args(["doctor"])
        .output()
        .unwrap();
    assert!(stdout(&o).contains("portable 6x16"), "{}", stdout(&o));
    // Asking for more than the CPU has says so, and runs the best it has.
    use workshop::backend::cpu::simd::{Simd, best};
    if best() < Simd::Avx512 {
        let o = crate::common::command()
            .env("WORKSHOP_CPU_SIMD", "avx512")
            .args(["doctor"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("cannot run those paths"),
            "{}",
            stderr(&o)
        );
        let kernel = workshop::backend::cpu::sgemm::kernel_name();
        assert!(stdout(&o).contains(&kernel), "{kernel}: {}", stdout(&o));
    }
}

/// `doctor` says what `--kernels vendor` runs on each GPU backend: on the emulator, its own
/// stand-ins for cuda and a refusal in words for hip (MIOpen and rocBLAS need an AMD GPU).
#[test]
fn doctor_names_the_vendor_libraries() {
    let o = crate::common::command()
        .env("WORKSHOP_GPU_EMULATOR", "1")
        .args(["doctor"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("vendor: emulated library convolutions and GEMMs"),
        "{out}"
    );
    assert!(
        out.contains("vendor: --kernels vendor on hip needs rocBLAS"),
        "{out}"
    );
}

/// `doctor` names the font charts are drawn with, or says why there is none (a GPU machine's
/// image had none, and every chart failed there); a WORKSHOP_FONT that is no font is named.
#[test]
fn doctor_says_how_charts_are_drawn() {
    let o = crate::common::command().args(["doctor"]).output().unwrap();
    let out = stdout(&o);
    assert!(
        out.contains("Charts: drawn with /") || out.contains("Charts: charts need a TrueType"),
        "{out}"
    );
    let not_a_font = crate::common::fixture("llm/make_llm_fixtures.py");
    let o = crate::common::command()
        .env("WORKSHOP_FONT", &not_a_font)
        .args(["doctor"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let said = format!(
        "Charts: WORKSHOP_FONT={} is no TrueType font that can be read; ",
        not_a_font.display()
    );
    assert!(stdout(&o).contains(&said), "{}", stdout(&o));
}

/// A BF16 run on the CPU says where its values are widened to FP32 for every multiply (always
/// on the portable path, forced here), and `doctor` says it beside the paths; an FP32 run says
/// nothing of it.
#[test]
fn bf16_runs_say_where_they_are_widened() {
    let run = |args: &[&str]| {
        let o = crate::common::command()
            .env("WORKSHOP_CPU_SIMD", "portable")
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let bench = |precision| {
        run(&[
            "bench",
            "--network",
            "conv2d(8,8,3,padding=1)",
            "--input-size",
            "8",
            "--batch-size",
            "1",
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--precision",
            precision,
        ])
    };
    let said = "note: BF16 values are widened to FP32 for every multiply here";
    let out = bench("bf16");
    assert!(out.contains(said), "{out}");
    let out = bench("fp32");
    assert!(!out.contains("widened"), "{out}");
    let out = run(&["doctor"]);
    assert!(out.contains("BF16 multiplied as FP32 ("), "{out}");
}

/// On a CPU with AVX512_BF16 (without AMX), BF16 multiplies bf16 pairs only where a probe
/// found `vdpbf16ps` at least as fast as FMAs, FLOP for FLOP: measured once, kept in the cache
/// folder, read by later runs, said by `doctor` and `peak`; `WORKSHOP_CPU_SIMD` still forces
/// either path. Other CPUs have nothing to choose and keep no ratio.
#[test]
fn bf16_pairs_are_chosen_by_a_cached_probe() {
    use workshop::backend::cpu::probe::CACHE_FILE;
    use workshop::backend::cpu::simd::{Simd, best};
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let file = cache.join(CACHE_FILE);
    let run = |simd: &str, args: &[&str]| {
        let o = crate::common::command()
            .env("WORKSHOP_CACHE_DIR", &cache)
            .env("WORKSHOP_CPU_SIMD", simd)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let out = run("", &["doctor"]);
    if best() != Simd::Avx512Bf16 {
        // Nothing kept for BF16's GEMMs (the small-K probe may keep its own depth in the
        // file); an AMX CPU keeps the ratio for its depthwise layers alone, and says so.
        let kept: Option<Value> = file.exists().then(|| read_json(&file));
        let ratio = kept.as_ref().map(|k| k[0]["dot_per_fma"].clone());
        match best() {
            Simd::Amx => {
                assert!(ratio.is_some_and(|r| r.is_number()), "{kept:?}");
                assert!(out.contains("BF16 depthwise layers on"), "{out}");
            }
            _ => {
                assert!(ratio.is_none_or(|r| r.is_null()), "{kept:?}");
                assert!(!out.contains("BF16 depthwise layers"), "{out}");
            }
        }
        assert!(!out.contains("vdpbf16ps ran at"), "{out}");
        return;
    }
    assert!(out.contains("vdpbf16ps ran at"), "{out}");
    // Later runs take the kept ratio, whatever it is.
    let keep = |ratio: f64| {
        let mut kept: Value = read_json(&file);
        kept[0]["dot_per_fma"] = ratio.into();
        std::fs::write(&file, kept.to_string()).unwrap();
    };
    keep(0.5);
    let out = run("", &["doctor"]);
    assert!(
        out.contains("SIMD paths avx512; BF16 widens to the FP32 FMAs: vdpbf16ps ran at 0.50×"),
        "{out}"
    );
    assert!(!out.contains("avx512-bf16"), "{out}");
    let peak = [
        "peak",
        "--precision",
        "bf16",
        "--size",
        "64",
        "--iterations",
        "2",
    ];
    let out = run("", &[&peak[..], &["--array-mib", "4"]].concat());
    assert!(
        out.contains("FP32 FMA ceiling") && out.contains("BF16 widens to the FP32 FMAs"),
        "{out}"
    );
    keep(2.0);
    let out = run("", &["doctor"]);
    assert!(
        out.contains("SIMD paths avx512bf16; BF16 multiplies bf16 pairs (vdpbf16ps)")
            && out.contains("avx512-bf16 32x32")
            && out.contains("BF16 depthwise layers on vdpbf16ps"),
        "{out}"
    );
    // Between an FMA's rate and the depthwise kernels' threshold: the GEMMs on pairs, the
    // depthwise layers on FMAs.
    keep(1.2);
    let out = run("", &["doctor"]);
    assert!(
        out.contains("SIMD paths avx512bf16;")
            && out.contains("BF16 depthwise layers on the FP32 FMAs"),
        "{out}"
    );
    keep(0.5);
    let out = run("avx512bf16", &["doctor"]);
    assert!(
        out.contains("SIMD paths avx512bf16 (forced by WORKSHOP_CPU_SIMD)"),
        "{out}"
    );
    // AVX2's small-K kernel is its own, probed apart: the AVX-512 kernel's kept reach does not
    // answer for it (it did, and doctor said AVX-512's depth for it), and stays as it was.
    let mut kept: Value = read_json(&file);
    kept[0]["small_k_reach"] = 16.into();
    std::fs::write(&file, kept.to_string()).unwrap();
    let out = run("avx2", &["doctor"]);
    assert!(
        out.contains("SIMD paths avx2 (forced by WORKSHOP_CPU_SIMD)") && out.contains("small-K"),
        "{out}"
    );
    let kept: Value = read_json(&file);
    assert!(kept[0]["small_k_reach_avx2"].is_number(), "{kept}");
    assert_eq!(kept[0]["small_k_reach"], 16, "{kept}");
}

/// A seeded normal input of `shape` (NCHW) with a NaN at pixel (5, 5) of the first image's
/// first channel, written to `dir`/x.safetensors; with the path an output may go to.
fn input_with_a_nan(
    dir: &std::path::Path,
    seed: u64,
    shape: [usize; 4],
) -> (
    workshop::model::Tensor,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let (xpath, ypath) = (dir.join("x.safetensors"), dir.join("y.safetensors"));
    let mut x = Rng::new(seed).normal_tensor(shape.to_vec());
    x.data[5 * shape[3] + 5] = f32::NAN;
    write_tensors(&xpath, &[("input", &x)]).unwrap();
    (x, xpath, ypath)
}

/// A NaN in the input reaches the logits as in IEEE arithmetic and PyTorch (ReLU and max
/// pooling used to turn it into a number), on every backend, and `infer` says the logits are
/// not finite; the other image of the batch is untouched (issue 27, class 10).
#[test]
fn a_nan_in_the_input_reaches_the_logits_and_is_said() {
    use workshop::backend::BackendKind;
    let dir = tempfile::tempdir().unwrap();
    let (x, xpath, ypath) = input_with_a_nan(dir.path(), 3, [2, 3, 32, 32]);
    let graph = zoo::build("resnet18").unwrap();
    let w = Weights::init(&graph, 0);
    let expected = reference::forward(&graph.plan(2, 32, 32).unwrap(), &w, &x);
    assert!(expected.data[..1000].iter().all(|v| v.is_nan()));
    assert!(expected.data[1000..].iter().all(|v| v.is_finite()));
    for kind in [
        BackendKind::Cpu,
        BackendKind::Wgpu,
        BackendKind::Cuda,
        BackendKind::Hip,
    ] {
        if let Err(e) = workshop::backend::open(kind) {
            crate::common::skip(kind, &e.to_string());
            continue;
        }
        let precisions: &[&str] = match kind {
            BackendKind::Cpu => &["fp32", "bf16", "fp16"],
            _ => &["fp32"],
        };
        for precision in precisions {
            let o = workshop(&[
                "infer",
                "--network",
                "resnet18",
                "--backend",
                kind.name(),
                "--precision",
                precision,
                "--input",
                xpath.to_str().unwrap(),
                "--output",
                ypath.to_str().unwrap(),
            ]);
            assert!(o.status.success(), "{kind} {precision}: {}", stderr(&o));
            let got = read_tensor(&ypath, "logits").unwrap();
            let (first, second) = got.data.split_at(1000);
            assert!(
                first.iter().all(|v| v.is_nan()) && second.iter().all(|v| v.is_finite()),
                "{kind} {precision}: {} finite logits in the image with a NaN, {} in the other",
                first.iter().filter(|v| v.is_finite()).count(),
                second.iter().filter(|v| v.is_finite()).count()
            );
            assert!(
                stderr(&o)
                    .contains("warning: 1000 NaN and 0 infinite value(s) among the 2000 logits"),
                "{kind} {precision}: {}",
                stderr(&o)
            );
        }
    }
}

/// A NaN stays NaN through wgpu's clamps, activations, maxima and poolings on every graphics
/// API wgpu finds here (Vulkan, and OpenGL where Mesa has it), as on the CPU: on GL, llvmpipe
/// took floats never to be NaN, folded `v != v` to false and compare-and-selects into max and
/// clamp, and ResNet-18's image with a NaN came out as 995 finite logits and 5 infinite ones.
#[test]
fn a_nan_survives_wgpu_on_every_graphics_api() {
    let dir = tempfile::tempdir().unwrap();
    let (_, xpath, ypath) = input_with_a_nan(dir.path(), 5, [1, 3, 12, 12]);
    let nans = |api: Option<&str>, backend: &str, chain: &str| {
        let mut cmd = crate::common::command();
        if let Some(api) = api {
            cmd.env("WGPU_BACKEND", api);
        }
        let args = ["infer", "--network", chain, "--backend", backend, "--input"];
        let o = (cmd.args(args).arg(&xpath).arg("--output").arg(&ypath))
            .output()
            .unwrap();
        if !o.status.success() {
            assert!(
                stderr(&o).contains("no wgpu device"),
                "{chain}: {}",
                stderr(&o)
            );
            return None;
        }
        let y = read_tensor(&ypath, "logits").unwrap();
        Some(y.data.iter().map(|v| v.is_nan()).collect::<Vec<bool>>())
    };
    for chain in [
        "conv2d(3,8,3)+relu+maxpool2d(3,2,1)",
        "conv2d(3,8,3)+batchnorm2d(8)+relu6+hardswish+hardsigmoid+tanh",
    ] {
        let want = nans(None, "cpu", chain).unwrap();
        assert!(
            want.iter().any(|&n| n) && !want.iter().all(|&n| n),
            "{chain}"
        );
        for api in ["vulkan", "gl"] {
            match nans(Some(api), "wgpu", chain) {
                Some(got) => assert!(got == want, "{api}: {chain}: NaNs lost or made"),
                None => eprintln!("skipped on wgpu {api}: no adapter"),
            }
        }
    }
}

#[test]
fn bad_input_gets_one_clear_line() {
    fails_with(
        &["bench", "--network", "resnet51"],
        "unknown network `resnet51` (did you mean `resnet50`?); `workshop models` lists all 80",
    );
    fails_with(
        &["bench", "--batch-size", "0"],
        "--batch-size must be at least 1",
    );
    fails_with(
        &["bench", "--iterations", "0"],
        "--iterations must be at least 1",
    );
    fails_with(&["bench", "--threads", "0"], "--threads must be at least 1");
    // Layer chains and scenarios.
    fails_with(
        &["bench", "--network", "conv2d(64, 64, 3, padding=x)"],
        "layer chain `conv2d(64, 64, 3, padding=x)`: conv2d(64, 64, 3, padding=x): `padding` takes a whole number, not `x`",
    );
    fails_with(
        &["bench", "--qps", "10"],
        "--qps is for MLPerf scenarios: add --scenario single-stream|offline|server",
    );
    fails_with(
        &["bench", "--scenario", "offline", "--qps", "10"],
        "--qps is for --scenario server",
    );
    fails_with(
        &["bench", "--scenario", "server", "--latency-bound-ms", "0"],
        "--latency-bound-ms must be a positive number of milliseconds",
    );
    fails_with(
        &["bench", "--scenario", "single-stream", "--queries", "0"],
        "--queries must be between 1 and 10,000,000 (got 0)",
    );
    fails_with(
        &["bench", "--scenario", "server", "--network", "gpt2"],
        "--scenario runs image networks",
    );
    fails_with(&["bench", "--fp16", "2"], "--fp16 takes 0 or 1");
    fails_with(
        &["bench", "--precision", "bf16", "--fp16", "1"],
        "contradicts --fp16 1",
    );
    if !cfg!(feature = "hip") {
        fails_with(
            &["bench", "--backend", "hip"],
            "the hip backend is not available in this build (rebuild with `--features hip`)",
        );
    }
    #[cfg(feature = "cuda")]
    if !workshop::backend::cuda::driver_present() {
        fails_with(
            &["bench", "--backend", "cuda"],
            "no cuda device: the NVIDIA driver library (libcuda.so) was not found",
        );
    }
    fails_with(
        &["bench", "--kernels", "vendor", "--network", "resnet18"],
        "the cpu backend has only our own kernels: --kernels vendor is for cuda (cuDNN, cuBLAS) and \
         hip (MIOpen, rocBLAS)",
    );
    fails_with(
        &[
            "bench",
            "--device",
            "3",
            "--network",
            "resnet18",
            "--input-size",
            "32",
        ],
        "the CPU backend has one device (0), not 3",
    );
    fails_with(
        &["bench", "--network", "alexnet", "--input-size", "32"],
        "alexnet cannot take 32×32 inputs",
    );
    fails_with(
        &["bench", "--weights", "/nonexistent/w.safetensors"],
        "failed to read weights file `/nonexistent/w.safetensors`",
    );
    // A batch far beyond any machine's memory is refused before allocating, with a suggestion.
    fails_with(
        &["bench", "--network", "resnet50", "--batch-size", "10000000"],
        "out of memory: this run needs about",
    );
    fails_with(
        &["bench", "--network", "resnet50", "--batch-size", "10000000"],
        "a batch size of",
    );
    fails_with(
        &[
            "infer",
            "--input",
            "/nonexistent/x.safetensors",
            "--output",
            "/tmp/y.safetensors",
        ],
        "failed to read weights file `/nonexistent/x.safetensors`",
    );
}

#[test]
fn mismatched_weights_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let wpath = dir.path().join("r34.safetensors");
    let o = workshop(&[
        "weights",
        "--network",
        "resnet34",
        "--output",
        wpath.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    fails_with(
        &[
            "bench",
            "--network",
            "resnet18",
            "--weights",
            wpath.to_str().unwrap(),
        ],
        "is not part of resnet18",
    );
    let xpath = dir.path().join("x.safetensors");
    write_tensors(
        &xpath,
        &[("input", &Rng::new(1).normal_tensor(vec![1, 1, 32, 32]))],
    )
    .unwrap();
    fails_with(
        &[
            "infer",
            "--network",
            "resnet18",
            "--input",
            xpath.to_str().unwrap(),
            "--output",
            "/tmp/y.safetensors",
        ],
        "resnet18 takes 3 input channels, the input has 1",
    );
}

#[test]
fn wgpu_says_what_it_cannot_do() {
    // Where no adapter exists, the backend says what to install instead.
    let o = workshop(&[
        "bench",
        "--backend",
        "wgpu",
        "--network",
        "resnet18",
        "--input-size",
        "32",
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--batch-size",
        "1",
        "--precision",
        "bf16",
    ]);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("WGSL has no bfloat16 type")
            || err.contains("no GPU adapter found: install a Vulkan driver"),
        "{err}"
    );
    let o = workshop(&[
        "bench",
        "--backend",
        "wgpu",
        "--device",
        "99",
        "--network",
        "resnet18",
        "--input-size",
        "32",
        "--iterations",
        "1",
    ]);
    let err = stderr(&o);
    assert!(
        err.contains("there is no adapter 99") || err.contains("no GPU adapter found"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // Without a runtime folder, no library complains about it on a run that works.
    let o = crate::common::command()
        .env_remove("XDG_RUNTIME_DIR")
        .args(["bench", "--backend", "wgpu", "--network", "resnet18"])
        .args(["--input-size", "32", "--iterations", "1", "--warmup", "0"])
        .args(["--batch-size", "1"])
        .output()
        .unwrap();
    assert!(!stderr(&o).contains("XDG_RUNTIME_DIR"), "{}", stderr(&o));
}

#[test]
fn a_broken_kernel_shows_the_whole_compiler_message_and_the_file() {
    // One edited file is enough: the others are the built-in copies.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("wgsl")).unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/wgsl/pool.wgsl");
    let planted = "var best = -3.4028235e38;";
    let original = std::fs::read_to_string(src).unwrap();
    let line = 1 + original.lines().position(|l| l.contains(planted)).unwrap();
    let broken = dir.path().join("wgsl/pool.wgsl");
    std::fs::write(
        &broken,
        original.replace(planted, "var best = undefined_name;"),
    )
    .unwrap();
    let run = |dir: &std::path::Path| {
        workshop(&[
            "bench",
            "--backend",
            "wgpu",
            "--network",
            "resnet18",
            "--input-size",
            "32",
            "--iterations",
            "1",
            "--kernels-dir",
            dir.to_str().unwrap(),
        ])
    };
    // A misspelt file would be ignored without a word: it is refused, naming the real ones.
    std::fs::write(dir.path().join("wgsl/pooll.wgsl"), "").unwrap();
    let err = stderr(&run(dir.path()));
    assert!(
        err.contains("pooll.wgsl is not one of this build's kernel files")
            && err.contains("pool.wgsl, "),
        "{err}"
    );
    std::fs::remove_file(dir.path().join("wgsl/pooll.wgsl")).unwrap();
    let empty = tempfile::tempdir().unwrap();
    assert!(stderr(&run(empty.path())).contains("no kernel file to use"));
    let o = workshop(&[
        "bench",
        "--backend",
        "wgpu",
        "--network",
        "resnet18",
        "--input-size",
        "32",
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--batch-size",
        "1",
        "--kernels-dir",
        dir.path().to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert!(!o.status.success());
    if err.contains("no GPU adapter found") {
        eprintln!("skipped: no wgpu adapter");
        return;
    }
    assert!(
        err.contains(&format!("wgsl/pool.wgsl:{line}:")) && err.contains("undefined_name"),
        "the error names the file and its line {line}:\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn profile_tables_csv_and_trace() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("kernels.csv");
    let trace = dir.path().join("trace.json");
    let o = workshop(&[
        "bench",
        "--network",
        "resnet18",
        "--batch-size",
        "1",
        "--input-size",
        "32",
        "--iterations",
        "2",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--profile-csv",
        csv.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("Operators over 2 iterations (CPU timers)")
            && out.contains("conv2d")
            && out.contains("CPU-overhead ratio"),
        "{out}"
    );
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("\"Name\",\"Calls\",\"TotalDurationNs\",\"AverageNs\",\"Percentage\"")
    );
    let first: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert!(first[0].starts_with("\"conv2d_"), "{text}");
    // The percentages of all kernels add up to 100.
    let total: f64 = text
        .lines()
        .skip(1)
        .map(|l| l.rsplit(',').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!((total - 100.0).abs() < 0.01, "{total}");
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let meta: Vec<&Value> = events.iter().filter(|e| e["ph"] == "M").collect();
    assert!(
        meta.iter().any(|e| e["args"]["name"] == "host")
            && meta.iter().any(|e| e["name"] == "thread_name")
    );
    let iterations: Vec<&Value> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == 1)
        .collect();
    assert_eq!(iterations.len(), 2);
    let kernels: Vec<&Value> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == 2)
        .collect();
    assert!(kernels.len() > 40);
    // Every kernel nests inside an iteration on the host track (one clock on the CPU backend).
    for k in &kernels {
        let (ts, dur) = (k["ts"].as_f64().unwrap(), k["dur"].as_f64().unwrap());
        assert!(dur >= 0.0);
        assert!(
            iterations.iter().any(|i| {
                let (its, idur) = (i["ts"].as_f64().unwrap(), i["dur"].as_f64().unwrap());
                ts >= its && ts + dur <= its + idur + 1.0
            }),
            "kernel {k} is outside every iteration"
        );
    }
}

/// The validated GEMM and the memory-bandwidth probe of one backend.
fn peak_reports_a_validated_gemm_and_bandwidth(kind: workshop::backend::BackendKind) {
    let o = workshop(&[
        "peak",
        "--backend",
        kind.name(),
        "--size",
        "200",
        "--iterations",
        "3",
        "--array-mib",
        "8",
        "--json",
    ]);
    let err = stderr(&o);
    if !o.status.success()
        && (err.contains("not available in this build")
            || err.contains("no GPU adapter found")
            || err.contains(&format!("no {kind} device")))
    {
        crate::common::skip(kind, &err);
        return;
    }
    assert!(o.status.success(), "{err}");
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["gemm"]["size"], 200);
    assert_eq!(r["gemm"]["validated"], 3, "{r}");
    assert!(r["gemm"]["gflops"].as_f64().unwrap() > 0.0);
    assert!(r["gemm"]["max_rel_error"].as_f64().unwrap() < 1e-5);
    if kind == workshop::backend::BackendKind::Cpu
        && workshop::backend::cpu::simd::simd().has_avx2()
    {
        // The cores' FMA throughput, measured: at least what the GEMM reached (on a noisy
        // machine either can be slowed, so only a wide margin is checked).
        let t = &r["theoretical"];
        assert_eq!(t["measured"], true, "{r}");
        let ceiling = t["gflops"].as_f64().unwrap();
        assert!(
            ceiling > 0.25 * r["gemm"]["gflops"].as_f64().unwrap(),
            "{r}"
        );
        // The same chains timed just before each GEMM: a share and their rate, both measured.
        let beside = &r["gemm"]["beside"];
        let share = beside["share"].as_f64().unwrap_or(-1.0);
        assert!(share > 0.0 && share.is_finite(), "{r}");
        assert!(beside["chains_gflops"].as_f64().unwrap_or(0.0) > 0.0, "{r}");
    } else if kind != workshop::backend::BackendKind::Cpu {
        // A GPU's ceiling is its specification's: nothing to time beside the GEMMs.
        assert!(r["gemm"].get("beside").is_none(), "{r}");
    }
    let bw = r["bandwidth"].as_array().unwrap();
    assert_eq!(bw.len(), 2);
    assert!(bw.iter().all(|b| b["median_gbps"].as_f64().unwrap() > 0.0));
    assert_eq!(bw[0]["bytes"], 2 * (8 << 20), "copy reads and writes 8 MiB");
    assert_eq!(
        bw[1]["bytes"],
        3 * (8 << 20),
        "triad reads two arrays and writes one"
    );
}
crate::backend_test!(
    peak_reports_a_validated_gemm_and_bandwidth,
    cpu,
    wgpu,
    cuda,
    hip
);

#[test]
fn peak_in_half_precision_and_bad_sizes() {
    let o = workshop(&[
        "peak",
        "--size",
        "64",
        "--iterations",
        "2",
        "--array-mib",
        "4",
        "--precision",
        "fp16",
    ]);
    let out = stdout(&o);
    assert!(
        o.status.success() && out.contains("2/2 iterations validated (success rate 100%"),
        "{out}"
    );
    // 4 MiB arrays (8 MiB a copy pass) are called a cache measurement exactly where the CPU's
    // last-level cache is more than a quarter of a pass.
    let llc = workshop::backend::cpu::batch_tiles::last_level_cache();
    assert_eq!(
        out.contains("this measured the cache, not memory"),
        2 * (4 << 20) < 4 * llc,
        "{out}"
    );
    assert!(out.contains("Median ") && !out.contains("Average"), "{out}");
    // FP16 on a CPU multiplies in FP32: placed under the FP32 ceiling. BF16 is too where the
    // CPU widens it, and has a ceiling of its own where it multiplies bf16 pairs.
    use workshop::backend::cpu::simd::{Simd, simd};
    if simd().has_avx2() {
        assert!(out.contains("the GEMM reaches"), "{out}");
        assert!(
            out.contains("of the same chains timed just before each GEMM"),
            "{out}"
        );
        let bf16 = ["--precision", "bf16", "--size", "64", "--iterations", "2"];
        let o = workshop(&[&["peak", "--array-mib", "4"][..], &bf16].concat());
        let out = stdout(&o);
        // AVX512_BF16: its own ceiling, measured on `vdpbf16ps`; AMX: on the tiles.
        let dots = simd() == Simd::Avx512Bf16;
        let tiles = simd() == Simd::Amx;
        assert!(
            !out.contains("not known for this device and precision"),
            "{out}"
        );
        assert_eq!(out.contains("BF16 dot-product ceiling"), dots, "{out}");
        assert_eq!(
            out.contains("BF16 AMX tile ceiling") && out.contains("tdpbf16ps chains on tiles"),
            tiles,
            "{out}"
        );
        assert!(out.contains("the GEMM reaches"), "{out}");
    }
    let o = workshop(&["peak", "--size", "0"]);
    assert!(
        !o.status.success() && stderr(&o).contains("--size and --iterations must be at least 1")
    );
}

/// A small `peak` measurement (a quick check, the profiles' probe) never replaces a larger one
/// as what profiles judge against.
#[test]
fn profiles_use_the_largest_peak_measured() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let run = |args: &[&str]| {
        let o = crate::common::command()
            .env("WORKSHOP_CACHE_DIR", &cache)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    // The smaller one first: the order they were kept in does not decide.
    for size in ["48", "96"] {
        run(&[
            "peak",
            "--size",
            size,
            "--iterations",
            "2",
            "--array-mib",
            "4",
            "--threads",
            "1",
        ]);
    }
    let kept = read_json(&cache.join("peak.json"));
    assert_eq!(
        kept.as_array().unwrap().len(),
        2,
        "one entry per size: {kept}"
    );
    let out = run(&[
        "bench",
        "--network",
        "resnet18",
        "--input-size",
        "64",
        "--batch-size",
        "1",
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--flops-prof-step",
        "1",
    ]);
    assert!(out.contains("a 96³ GEMM measured"), "{out}");
}

#[test]
fn flops_profile_of_one_step() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let cache = dir.path().join("cache");
    let run_simd = |step: &str, simd: &str| {
        crate::common::command()
            .env("WORKSHOP_CACHE_DIR", &cache)
            .env("WORKSHOP_CPU_SIMD", simd)
            .args([
                "bench",
                "--network",
                "resnet18",
                "--batch-size",
                "1",
                "--iterations",
                "2",
                "--warmup",
                "0",
                "--threads",
                "1",
                "--flops-prof-step",
                step,
                "--flops-depth",
                "2",
                "--json",
                json.to_str().unwrap(),
            ])
            .output()
            .unwrap()
    };
    let run = |step: &str| run_simd(step, "");
    let o = run("2");
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    for want in [
        "Profile summary at step 2",
        "params per device:                                  11.69 M",
        "fwd MACs per device:                                1.81 GMACs",
        "a 512³ GEMM probe run now",
        "machine balance = peak / bandwidth:",
        "depth 1:",
        "(layer1): (",
        "(conv1): conv2d 3→64",
    ] {
        assert!(out.contains(want), "missing `{want}` in\n{out}");
    }
    // --flops-depth 2 stops the tree above the blocks' layers.
    assert!(!out.contains("(conv2): "), "{out}");
    let r: Value = read_json(&json);
    let f = &r["flops_profile"];
    let modules = f["modules"].as_array().unwrap();
    let root = &modules[0];
    assert_eq!(root["macs"], 1_814_073_344u64, "torchvision's MACs");
    assert_eq!(root["params"], 11_689_512u64);
    let depth1: Vec<&Value> = modules.iter().filter(|m| m["depth"] == 1).collect();
    let sum: u64 = depth1
        .iter()
        .map(|m| m["latency_ns"].as_u64().unwrap())
        .sum();
    assert_eq!(sum, root["latency_ns"].as_u64().unwrap());
    let layer = |name: &str| modules.iter().find(|m| m["name"] == name).unwrap();
    assert!(layer("layer3")["latency_ns"].as_u64().unwrap() > 0);
    assert_eq!(layer("layer1.0.relu")["calls"], 2);
    assert!(f["limits"]["peak_gflops"].as_f64().unwrap() > 0.0);
    assert!(cache.join("peak.json").exists(), "the probe is kept");

    // The second run uses the kept measurement.
    let o = run("1");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("kept in"), "{}", stdout(&o));
    // The ceiling next to it: measured where the kernels have FMA instructions.
    let fma = workshop::backend::cpu::simd::simd().has_avx2();
    let label = if fma {
        "FMA ceiling (measured):"
    } else {
        "theoretical peak:"
    };
    assert!(stdout(&o).contains(label), "{}", stdout(&o));
    // Other kernels (the portable ones) are not judged by that measurement: a probe runs.
    if fma {
        let o = run_simd("1", "portable");
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stdout(&o).contains("a 512³ GEMM probe run now"),
            "{}",
            stdout(&o)
        );
    }

    let o = run("3");
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--flops-prof-step 3 is not one of the timed iterations (1 to 2)"),
        "{}",
        stderr(&o)
    );
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[test]
fn data_parallel_over_cpu_groups() {
    if cores() < 2 {
        eprintln!("skipped: one core cannot be split into two devices");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("multi.json");
    let args = |batch: &'static str| {
        vec![
            "bench",
            "--network",
            "resnet18",
            "--input-size",
            "32",
            "--batch-size",
            batch,
            "--iterations",
            "3",
            "--warmup",
            "1",
            "--cpu-groups",
            "2",
        ]
    };
    let (out, r) = run_json(&args("4"), &json);
    assert!(
        out.contains("Performance summary (global): resnet18 FP32 on 2 devices")
            && out.contains("Global batch  4 (2 per device)")
            && out.contains("efficiency"),
        "{out}"
    );
    assert_eq!(r["kind"], "multi");
    assert_eq!(r["runs"].as_array().unwrap().len(), 2);
    assert_eq!(r["global_samples_s"].as_array().unwrap().len(), 3);
    // Each device ran on its own half of the cores, with its share of the batch.
    let cores = |i: usize| -> Vec<u64> {
        let c = r["runs"][i]["config"]["cores"].as_array().unwrap();
        c.iter().map(|c| c.as_u64().unwrap()).collect()
    };
    let (a, b) = (cores(0), cores(1));
    assert!(
        !a.is_empty() && a.len() == b.len() && a[0] == 0,
        "{a:?} {b:?}"
    );
    assert!(a.iter().all(|c| !b.contains(c)), "{a:?} {b:?}");
    assert_eq!(r["runs"][1]["config"]["batch_size"], 2);
    assert_eq!(r["single"]["config"]["batch_size"], 2);
    let eff = r["scaling_efficiency"].as_f64().unwrap();
    assert!(eff > 0.0 && eff < 3.0, "{eff}");
    // The global step runs from the first device's start to the last one's end: never shorter
    // than a device's own step, iteration by iteration.
    let global = r["global_samples_s"].as_array().unwrap();
    for run in r["runs"].as_array().unwrap() {
        let own = run["samples_s"].as_array().unwrap();
        assert_eq!(own.len(), global.len());
        for (g, d) in global.iter().zip(own) {
            let (g, d) = (g.as_f64().unwrap(), d.as_f64().unwrap());
            assert!(g >= d, "global step {g} s < a device's {d} s");
        }
    }

    let o = workshop(&args("3"));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--batch-size 3 (the global batch) does not split evenly over 2 devices: use a multiple of 2"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn launched_ranks_write_records_and_gather_merges_them() {
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("ranks");
    let rank = |r: &str| {
        crate::common::command()
            .env("RANK", r)
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", r)
            .env("LOCAL_WORLD_SIZE", if cores() >= 2 { "2" } else { "1" })
            .args([
                "bench",
                "--network",
                "resnet18",
                "--input-size",
                "32",
                "--batch-size",
                "4",
                "--iterations",
                "2",
                "--warmup",
                "0",
                "--results-dir",
                results.to_str().unwrap(),
            ])
            .spawn()
            .unwrap()
    };
    let (a, b) = (rank("0"), rank("1"));
    for mut p in [a, b] {
        assert!(p.wait().unwrap().success());
    }
    let merged = dir.path().join("merged.json");
    let o = workshop(&[
        "gather",
        results.to_str().unwrap(),
        "--json",
        merged.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("[rank 0")
            && out.contains("2 ranks (torchrun)")
            && out.contains("Global batch  4 (2 per rank)"),
        "{out}"
    );
    let g: Value = serde_json::from_str(&std::fs::read_to_string(&merged).unwrap()).unwrap();
    let sum: f64 = g["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["record"]["stats"]["throughput_median"].as_f64().unwrap())
        .sum();
    assert!((g["throughput_sum"].as_f64().unwrap() - sum).abs() < 1e-9);
    assert_eq!(g["ranks"][1]["record"]["config"]["batch_size"], 2);

    // A missing rank and a foreign file are named.
    std::fs::remove_file(results.join("rank-00001.json")).unwrap();
    let o = workshop(&["gather", results.to_str().unwrap()]);
    assert!(
        stderr(&o).contains("ranks 1 of 2 have not written their records yet"),
        "{}",
        stderr(&o)
    );
    // Records that cannot be one run (issue 27): a rank twice, a rank beyond the world, an
    // impossible world.
    let zero: Value = read_json(&results.join("rank-00000.json"));
    for (rank, world, needle) in [
        (0u64, 2u64, "rank 0 has two records"),
        (7, 2, "a record is rank 7 of 2"),
        (1, 1_000_000_000_000, "is above the limit"),
    ] {
        let mut r = zero.clone();
        r["rank"]["rank"] = rank.into();
        for rec in ["rank-00000.json", "rank-00001.json"] {
            let mut x = if rec == "rank-00000.json" {
                zero.clone()
            } else {
                r.clone()
            };
            x["rank"]["world_size"] = world.into();
            std::fs::write(results.join(rec), x.to_string()).unwrap();
        }
        let o = workshop(&["gather", results.to_str().unwrap()]);
        assert!(
            !o.status.success() && stderr(&o).contains(needle),
            "{needle}: {}",
            stderr(&o)
        );
    }
    std::fs::write(results.join("rank-00000.json"), zero.to_string()).unwrap();
    std::fs::write(results.join("rank-00001.json"), "{\"not\": \"a rank\"}").unwrap();
    let o = workshop(&["gather", results.to_str().unwrap()]);
    assert!(
        !o.status.success() && stderr(&o).contains("rank-00001.json` is not a rank record"),
        "{}",
        stderr(&o)
    );

    // Without a launcher's variables --results-dir says what is missing.
    let mut c = crate::common::command();
    for v in ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"] {
        c.env_remove(v);
    }
    let o = c
        .args([
            "bench",
            "--results-dir",
            results.to_str().unwrap(),
            "--iterations",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && stderr(&o).contains("none of their variables is set"),
        "{}",
        stderr(&o)
    );
}

/// A real record of a tiny run, as a template for records with chosen numbers.
fn template_record(dir: &std::path::Path) -> Value {
    let path = dir.join("template.json");
    let o = workshop(&[
        "bench",
        "--network",
        "resnet18",
        "--input-size",
        "32",
        "--batch-size",
        "2",
        "--iterations",
        "4",
        "--warmup",
        "0",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The template with these step times (seconds per batch of 2) and, optionally, another batch.
fn record_with(template: &Value, samples: &[f64], batch: usize) -> Value {
    let mut r = template.clone();
    // The machine's state during the template's run is not the chosen numbers' (a busy CI
    // machine would make every verdict ambiguous).
    r["environment"]
        .as_object_mut()
        .unwrap()
        .remove("telemetry");
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = (sorted[(sorted.len() - 1) / 2] + sorted[sorted.len() / 2]) / 2.0;
    r["samples_s"] = serde_json::json!(samples);
    r["config"]["batch_size"] = serde_json::json!(batch);
    r["stats"]["median_s"] = serde_json::json!(median);
    r["stats"]["min_s"] = serde_json::json!(sorted[0]);
    r["stats"]["max_s"] = serde_json::json!(sorted[sorted.len() - 1]);
    r["stats"]["throughput_median"] = serde_json::json!(batch as f64 / median);
    r
}

#[test]
fn compare_gives_known_ratios_verdicts_and_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let t = template_record(dir.path());
    let write = |name: &str, v: &Value| {
        let p = dir.path().join(name);
        std::fs::write(&p, serde_json::to_string(v).unwrap()).unwrap();
        p.to_str().unwrap().to_string()
    };
    let base = write(
        "base.json",
        &record_with(&t, &[0.100, 0.101, 0.102, 0.103], 2),
    );
    // Twice as fast, every sample: faster.
    let fast = write(
        "fast.json",
        &record_with(&t, &[0.050, 0.051, 0.050, 0.052], 2),
    );
    // 1% apart: the same.
    let same = write(
        "same.json",
        &record_with(&t, &[0.101, 0.102, 0.103, 0.104], 2),
    );
    // 8% slower in the median, but the spreads overlap: ambiguous.
    let wide = write(
        "wide.json",
        &record_with(&t, &[0.095, 0.108, 0.112, 0.130], 2),
    );
    let o = workshop(&["compare", &base, &fast, &same, &wide, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let c: Value = serde_json::from_slice(&o.stdout).unwrap();
    let pairs = c["pairs"].as_array().unwrap();
    let verdicts: Vec<&str> = pairs
        .iter()
        .map(|p| p["verdict"].as_str().unwrap())
        .collect();
    assert_eq!(verdicts, ["faster", "same", "ambiguous"]);
    // Twice as fast on a machine whose telemetry found it busy: not a verdict, and why.
    let mut busy = record_with(&t, &[0.050, 0.051, 0.050, 0.052], 2);
    busy["environment"]["telemetry"] = serde_json::json!({"Ok": {
        "source": "Linux /proc and /sys", "reports_throttling": false, "cores": 2,
        "readings": [{"t_s": 0.0}, {"t_s": 1.0, "other_cores": 1.2}],
        "summary": {"seconds": 1.0, "other_cores": 1.2,
                    "concerns": ["other programs kept 1.2 of 2 cores busy"]}}});
    let busy = write("busy.json", &busy);
    let o = workshop(&["compare", &base, &busy]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("ambiguous: the machine was not steady during the runs (other programs kept 1.2 of 2 cores busy)"),
        "{out}"
    );
    assert!(
        out.contains("busy: other programs kept 1.2 of 2 cores busy"),
        "{out}"
    );
    let ratio = pairs[0]["ratio"].as_f64().unwrap();
    assert!((ratio - 0.1015 / 0.0505).abs() < 1e-9, "{ratio}");
    assert!(
        pairs[0]["sentence"]
            .as_str()
            .unwrap()
            .contains("2.01× faster than"),
        "{}",
        pairs[0]["sentence"]
    );
    assert!(c["warnings"].as_array().unwrap().is_empty());

    // Another batch size is an unfair comparison, and says so; a sweep draws lines.
    let b4 = write("b4.json", &record_with(&t, &[0.19, 0.2, 0.2, 0.21], 4));
    let md = dir.path().join("report.md");
    let png = dir.path().join("chart.png");
    let o = workshop(&[
        "compare",
        &base,
        &b4,
        "--markdown",
        md.to_str().unwrap(),
        "--chart",
        png.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains("batch size: 2 (b2) vs 4 (b4)"), "{out}");
    let report = std::fs::read_to_string(&md).unwrap();
    assert!(
        report.starts_with("# Benchmark comparison") && report.contains("| 2 | b4 |"),
        "{report}"
    );
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
    assert_eq!((be(16), be(20)), workshop::report::charts::SIZE);
    let c: Value =
        serde_json::from_slice(&workshop(&["compare", &base, &b4, "--json"]).stdout).unwrap();
    assert_eq!(c["shape"]["lines"]["param"], "batch size");

    // Bars as SVG, with the compile mode in the labels where it differs (the table's record
    // column and the chart's legend, outside the plot), and a whisker per bar.
    let mut compiled = record_with(&t, &[0.050, 0.051, 0.050, 0.052], 2);
    compiled["config"]["compile"] = serde_json::json!("max-autotune");
    let compiled = write("compiled.json", &compiled);
    let svg = dir.path().join("chart.svg");
    let o = workshop(&[
        "compare",
        &base,
        &compiled,
        "--chart",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("max-autotune is 2.01× faster than eager"),
        "{out}"
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg") && text.contains("width=\"960\"") && text.contains("<rect"));
    assert!(
        text.contains("\nmax-autotune\n</text>") && text.contains("\neager\n</text>"),
        "{text}"
    );
    // The whiskers span the slowest to the fastest iteration.
    let c: Value =
        serde_json::from_slice(&workshop(&["compare", &base, &compiled, "--json"]).stdout).unwrap();
    let range = &c["rows"][0]["throughput_range"];
    assert!(
        (range[0].as_f64().unwrap() - 2.0 / 0.103).abs() < 1e-9
            && (range[1].as_f64().unwrap() - 2.0 / 0.100).abs() < 1e-9,
        "{range}"
    );

    // Not a bench record: said plainly.
    let junk = write("junk.json", &serde_json::json!({"kind": "multi"}));
    let o = workshop(&["compare", &base, &junk]);
    assert!(
        !o.status.success()
            && stderr(&o)
                .contains("is not a `workshop bench --json` record (it is a `multi` record)"),
        "{}",
        stderr(&o)
    );
    let o = workshop(&["compare", &base, &base, "--chart", "chart.gif"]);
    assert!(
        stderr(&o).contains("a chart is a .png or .svg file"),
        "{}",
        stderr(&o)
    );

    // bench --baseline compares a fresh run with the saved one.
    let o = workshop(&[
        "bench",
        "--network",
        "resnet18",
        "--input-size",
        "32",
        "--batch-size",
        "2",
        "--iterations",
        "3",
        "--warmup",
        "0",
        "--baseline",
        &base,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("Against ") && stdout(&o).contains("this run"),
        "{}",
        stdout(&o)
    );
}

/// Records no run can have are refused by name (issue 27, class 11), and a FIFO as a record
/// is refused at once instead of blocking (class 9); `models` checks its size (class 11).
#[test]
fn impossible_records_and_sizes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = template_record(dir.path());
    let good = dir.path().join("good.json");
    std::fs::write(&good, serde_json::to_string(&t).unwrap()).unwrap();
    let bad = dir.path().join("bad.json");
    let mut cases: Vec<(Value, &str)> =
        vec![(record_with(&t, &[0.1, 0.1], 0), "its batch_size is 0")];
    let mut negative = t.clone();
    negative["stats"]["throughput"] = serde_json::json!(-5.0);
    cases.push((
        negative,
        "its stats.throughput is -5, not a positive number",
    ));
    cases.push((record_with(&t, &[0.1, -0.1, 0.1], 2), "sample 1 is -0.1 s"));
    for (record, says) in cases {
        std::fs::write(&bad, serde_json::to_string(&record).unwrap()).unwrap();
        for args in [
            vec!["compare", good.to_str().unwrap(), bad.to_str().unwrap()],
            vec!["compare", bad.to_str().unwrap(), good.to_str().unwrap()],
        ] {
            fails_with(&args, says);
        }
    }
    let fifo = dir.path().join("fifo.json");
    if std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        fails_with(
            &["compare", good.to_str().unwrap(), fifo.to_str().unwrap()],
            "is a FIFO, not a file to read",
        );
    }
    // Text from someone else's record reaches the terminal as text, never as escape codes.
    let mut painted = t.clone();
    painted["environment"]["device"]["name"] = serde_json::json!("GPU\u{1b}[2J\u{1b}[31m");
    painted["environment"]["cpu_model"] = serde_json::json!("CPU\u{1b}[2J");
    std::fs::write(&bad, serde_json::to_string(&painted).unwrap()).unwrap();
    let o = workshop(&["compare", good.to_str().unwrap(), bad.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !stdout(&o).contains('\u{1b}') && !stderr(&o).contains('\u{1b}'),
        "{}",
        stdout(&o)
    );
    fails_with(
        &["models", "--input-size", "4294967296"],
        "--input-size: 4294967296 is above the limit",
    );
}

#[test]
fn collect_gathers_a_class_and_skips_junk() {
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path();
    for (who, throughput) in [("Ada", 7.5), ("Grace", 12.0)] {
        let ws = class.join(who.to_lowercase());
        std::fs::create_dir_all(&ws).unwrap();
        let results = serde_json::json!({
            "schema_version": 1,
            "student": who,
            "attempts": [{
                "exercise": "01-baseline", "step": "baseline", "kind": "bench", "outcome": "pass",
                "metrics": {"throughput": throughput}, "table": null, "checks": [], "answer": null,
                "note": null, "environment": {"device": format!("{who}'s GPU"), "backend": "cpu"},
                "started": "2026-11-22T10:00:00Z", "finished": "2026-11-22T10:01:00Z"
            }]
        });
        std::fs::write(ws.join("results.json"), results.to_string()).unwrap();
    }
    std::fs::create_dir_all(class.join("broken")).unwrap();
    std::fs::write(class.join("broken/results.json"), "{ not json").unwrap();
    std::fs::write(class.join("notes.txt"), "hello").unwrap();
    let csv = class.join("class.csv");
    let png = class.join("class.png");
    let o = workshop(&[
        "collect",
        class.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
        "--chart",
        png.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("2 students") && out.contains("Grace's GPU") && out.contains("12.0"),
        "{out}"
    );
    assert!(out.contains("skipped") && out.contains("broken"), "{out}");
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(
        text.lines().count() == 3 && text.contains("\"Ada\",\"Ada's GPU\",\"cpu\",1,1,1,7.5,"),
        "{text}"
    );
    assert_eq!(&std::fs::read(&png).unwrap()[1..4], b"PNG");
    let o = workshop(&["collect", class.join("notes.txt").to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("is not a folder"));
}

#[test]
fn compile_default_fuses_checks_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("c.json");
    let args = |mode: &'static str| {
        vec![
            "bench",
            "--network",
            "resnet18",
            "--input-size",
            "64",
            "--batch-size",
            "2",
            "--iterations",
            "2",
            "--warmup",
            "0",
            "--compile",
            mode,
        ]
    };
    let (out, r) = run_json(&args("default"), &json);
    assert!(
        out.contains("Compile       default in")
            && out.contains("20 batch norms folded into convolutions, 17 activations fused into epilogues, 8 residual adds fused")
            && out.contains("against eager FP32"),
        "{out}"
    );
    let c = &r["compile"];
    assert_eq!(r["config"]["compile"], "default");
    assert!(c["rel_diff"].as_f64().unwrap() < 1e-4, "{c}");
    assert!(c["passes"]["nodes_after"].as_u64() < c["passes"]["nodes_before"].as_u64());
    assert!(c["compiled_memory"].as_u64() < c["eager_memory"].as_u64());
    // reduce-overhead: the default passes, and on the CPU no replay, with the reason.
    let (out, r) = run_json(&args("reduce-overhead"), &json);
    assert!(
        out.contains("Compile       reduce-overhead in")
            && out.contains("Replay        none: the CPU backend runs every pass itself"),
        "{out}"
    );
    assert!(
        r["compile"]["replay"]["Err"].is_string(),
        "{}",
        r["compile"]
    );
    // ViT's head starts at zero (as torchvision's): its untrained output is all zeros, and
    // the check says it compared nothing instead of reporting a perfect 0.
    let vit = ["bench", "--network", "vit_b_32", "--batch-size", "1"];
    let (out, r) = run_json(
        &[
            &vit[..],
            &["--iterations", "1", "--warmup", "0", "--compile"],
        ]
        .concat(),
        &json,
    );
    assert!(
        out.contains("Check         nothing compared: eager FP32's output is all zeros"),
        "{out}"
    );
    assert_eq!(r["compile"]["output_scale"], 0.0);
}

/// On the GPU backends reduce-overhead records a graph, and the summary shows the host's
/// enqueue time per pass (emulated here when no GPU is present: CI sets the emulator).
#[test]
fn reduce_overhead_replays_a_graph_on_gpu_backends() {
    let o = crate::common::command()
        .env(workshop::backend::gpu::emu::ENV, "1")
        .args([
            "bench",
            "--backend",
            "cuda",
            "--network",
            "resnet18",
            "--input-size",
            "32",
            "--batch-size",
            "1",
            "--iterations",
            "3",
            "--warmup",
            "1",
            "--compile",
            "reduce-overhead",
        ])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("graph of") && out.contains("launches recorded once"),
        "{out}"
    );
    assert!(out.contains("Host enqueue  median"), "{out}");
    assert!(out.contains("against eager FP32"), "{out}");
}

/// max-autotune times the CPU's batch schedules on the whole network where it has a choice
/// (the splits planned for several shares of this machine's last-level cache, as
/// `Backend::schedules` lists them), records what it tried and chose, and takes the choice
/// from the cache the second time; where this machine's cache leaves no choice, it says
/// nothing about schedules.
#[test]
fn max_autotune_times_the_batch_schedules() {
    use workshop::backend::{Backend, ExecOptions, cpu::CpuBackend};
    let graph = zoo::build("resnet18").unwrap();
    let weights = Weights::init(&graph, 0);
    let (fused, _, _) = workshop::model::passes::optimize(&graph, weights).unwrap();
    let plan = fused.plan(2, 224, 224).unwrap();
    let offered = CpuBackend::new().schedules(&plan, &ExecOptions::default());
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let json = dir.path().join("r.json");
        let o = crate::common::command()
            .env("WORKSHOP_CACHE_DIR", dir.path())
            .args([
                "bench",
                "--network",
                "resnet18",
                "--batch-size",
                "2",
                "--iterations",
                "1",
            ])
            .args(["--warmup", "0", "--compile", "max-autotune", "--json"])
            .arg(&json)
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        (
            stdout(&o),
            record["compile"]["autotune"]["schedule"].clone(),
        )
    };
    let (out, schedule) = run(&[]);
    if offered.len() < 2 {
        assert!(!out.contains("Schedule"), "{out}");
        assert!(schedule.is_null(), "{schedule}");
        return;
    }
    let chosen = schedule["variant"].as_str().unwrap().to_string();
    assert!(offered.contains(&chosen), "{chosen} not in {offered:?}");
    let tried: Vec<&str> = (schedule["tried"].as_array().unwrap().iter())
        .map(|t| t[0].as_str().unwrap())
        .collect();
    assert_eq!(
        tried,
        offered.iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert!(
        out.contains(&format!("Schedule      {chosen} (timed now")),
        "{out}"
    );
    assert!(out.contains(&format!("{} (default)", offered[0])), "{out}");
    let (again, cached) = run(&[]);
    assert_eq!(cached["variant"], schedule["variant"]);
    assert_eq!(cached["cached"], true);
    assert!(
        again.contains(&format!("Schedule      {chosen} (from the cache)")),
        "{again}"
    );
    // --recompile times the layers and the schedules again and keeps both.
    let (timed, retimed) = run(&["--recompile"]);
    assert_eq!(retimed["cached"], false, "{timed}");
    let (kept, schedule) = run(&[]);
    assert_eq!(schedule["cached"], true);
    assert!(kept.contains(" 0 timed now"), "{kept}");
}

#[test]
fn max_autotune_times_variants_once_and_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut c = crate::common::command();
        c.env("WORKSHOP_CACHE_DIR", dir.path()).args([
            "bench",
            "--network",
            "resnet18",
            "--input-size",
            "32",
            "--batch-size",
            "2",
            "--iterations",
            "2",
            "--warmup",
            "0",
            "--compile",
            "max-autotune",
        ]);
        c.args(extra);
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    // "Autotune      L layers, S shapes: T timed now, C from the cache ..."
    let counts = |out: &str| -> (usize, usize) {
        let line = out.lines().find(|l| l.starts_with("Autotune")).expect(out);
        let num = |after: &str| -> usize {
            let head = line.split(after).next().unwrap();
            head.rsplit(' ').next().unwrap().parse().unwrap()
        };
        (num(" timed now"), num(" from the cache"))
    };
    let first = run(&[]);
    assert!(
        first.contains("rows-x1") && first.contains("against eager FP32"),
        "{first}"
    );
    let (timed, cached) = counts(&first);
    assert!(timed > 5 && cached == 0, "{first}");
    assert!(dir.path().join("autotune.json").exists());
    assert_eq!(counts(&run(&[])), (0, timed));
    // Another precision's choices survive this one's --recompile.
    let (bf16, _) = counts(&run(&["--precision", "bf16"]));
    assert!(bf16 > 5, "bf16 timed its shapes");
    assert_eq!(counts(&run(&["--recompile"])), (timed, 0));
    assert_eq!(counts(&run(&["--precision", "bf16"])), (0, bf16));
}

#[test]
fn a_closed_pipe_ends_quietly() {
    let mut child = crate::common::command()
        .args(["models"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Hang up before it writes, like `workshop models | true`.
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}

#[test]
fn kernels_check_compiles_every_kernel_file_and_reports_errors_with_their_line() {
    let o = workshop(&["dev", "kernels-check", "--require", "host"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("kernels/gpu/ops.cuh"), "{out}");
    assert!(out.contains("emulator"), "{out}");
    let o = workshop(&["dev", "kernels-check", "--require", "cuda"]);
    assert!(stderr(&o).contains("--require takes nvrtc, hiprtc, host, not `cuda`"));
    // A broken copy of the kernels fails, naming the file and line of the error.
    let dir = tempfile::tempdir().unwrap();
    for sub in ["gpu", "cuda", "hip"] {
        std::fs::create_dir_all(dir.path().join(sub)).unwrap();
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut line = 0;
    for f in ["gpu/ops.cuh", "gpu/llm.cuh", "cuda/ops.cu", "hip/ops.hip"] {
        let mut text = std::fs::read_to_string(root.join(f)).unwrap();
        if f == "gpu/ops.cuh" {
            let planted = "float r = acc[j];";
            line = 1 + text.lines().position(|l| l.contains(planted)).unwrap();
            text = text.replace(planted, "float r = acc[j] + no_such_value;");
        }
        std::fs::write(dir.path().join(f), text).unwrap();
    }
    let o = workshop(&[
        "dev",
        "kernels-check",
        "--kernels-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let out = stdout(&o);
    assert!(out.contains("FAILED"), "{out}");
    assert!(out.contains("no_such_value"), "{out}");
    assert!(
        out.contains(&format!("gpu/ops.cuh:{line}"))
            || out.contains(&format!("gpu/ops.cuh({line})")),
        "the error names the shared file and its line:\n{out}"
    );
    assert!(stderr(&o).contains("kernel compilation(s) failed"));
}

/// Issue 27, classes 8 and 9: sizes near 2^64 and impossible inputs are one line, at once —
/// not a capacity overflow, a spin or a thread bomb; and a bad WORKSHOP_* value is refused
/// naming the variable (issue 26).
#[test]
fn huge_sizes_fail_fast_in_one_line() {
    let max = u64::MAX.to_string();
    for (flag, value, needle) in [
        (
            "--iterations",
            max.as_str(),
            "--iterations: 18446744073709551615 is above the limit",
        ),
        (
            "--warmup",
            "1000000000",
            "--warmup: 1000000000 is above the limit",
        ),
        (
            "--batch-size",
            max.as_str(),
            "--batch-size: 18446744073709551615 is above the limit",
        ),
        (
            "--input-size",
            "4294967296",
            "--input-size: 4294967296 is above the limit",
        ),
        (
            "--threads",
            "1000000",
            "--threads: 1000000 is above the limit",
        ),
    ] {
        fails_with(&["bench", "--network", "resnet18", flag, value], needle);
    }
    // An input batch of no images.
    let d = tempfile::tempdir().unwrap();
    let x = d.path().join("empty.safetensors");
    write_tensors(
        &x,
        &[(
            "input",
            &workshop::model::Tensor::new(vec![0, 3, 8, 8], vec![]),
        )],
    )
    .unwrap();
    let y = d.path().join("y.safetensors");
    fails_with(
        &[
            "infer",
            "--network",
            "resnet18",
            "--input",
            x.to_str().unwrap(),
            "--output",
            y.to_str().unwrap(),
        ],
        "the input holds no pixels",
    );
    // The same bounds hold for a course's steps.
    let course = d.path().join("course");
    std::fs::create_dir_all(course.join("exercises")).unwrap();
    std::fs::create_dir_all(course.join("book/src")).unwrap();
    std::fs::write(course.join("book/src/00-big.md"), "# big\n").unwrap();
    std::fs::write(
        course.join("exercises/00-big.toml"),
        "format_version = 1\nid = \"00-big\"\ntitle = \"Big\"\nchapter = \"00-big.md\"\n\n[[step]]\nid = \"run\"\nkind = \"bench\"\nsay = \"x\"\nbench = { batch_size = 1000000000000 }\n",
    )
    .unwrap();
    fails_with(
        &["dev", "lint", course.to_str().unwrap()],
        "batch_size: 1000000000000 is above the limit",
    );
    fails_with(
        &["peak", "--size", "100000"],
        "--size: 100000 is above the limit",
    );
    fails_with(
        &["peak", "--array-mib", "100000"],
        "--array-mib: 100000 is above the limit",
    );
    fails_with(
        &[
            "bench",
            "--network",
            "resnet18",
            "--devices",
            "cpu:0-18446744073709551615",
        ],
        "core 18446744073709551615 is above the limit",
    );
    let o = crate::common::command()
        .env("WORKSHOP_CPU_SIMD", "avx9000")
        .args(["models"])
        .output()
        .unwrap();
    assert!(
        !o.status.success()
            && stderr(&o).contains(
                "WORKSHOP_CPU_SIMD=\"avx9000\": not a SIMD path (accepted: portable, avx2"
            ),
        "{}",
        stderr(&o)
    );
}

/// Issue 27, class 12 (part): a cause is said once, not twice in the error chain.
#[test]
fn causes_are_said_once() {
    let o = workshop(&[
        "bench",
        "--network",
        "resnet18",
        "--weights",
        "/nonexistent/w.safetensors",
    ]);
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("/nonexistent/w.safetensors"),
        "{e}"
    );
    assert_eq!(e.matches("os error 2").count(), 1, "{e}");
}

/// Issue 27, class 11 (part): a one-device baseline of another batch is refused, not used.
#[test]
fn a_single_device_baseline_must_match_the_run() {
    let d = tempfile::tempdir().unwrap();
    let single = d.path().join("single.json");
    let small = [
        "--network",
        "resnet18",
        "--input-size",
        "32",
        "--iterations",
        "1",
        "--warmup",
        "0",
    ];
    let mut args = vec!["bench", "--batch-size", "2"];
    args.extend(small);
    run_json(&args, &single);
    let mut args = vec![
        "bench",
        "--batch-size",
        "8",
        "--cpu-groups",
        "2",
        "--single",
    ];
    args.push(single.to_str().unwrap());
    args.extend(small);
    fails_with(
        &args,
        "--single ran resnet18 fp32 on cpu at batch 2 (32px); this run needs resnet18 fp32 on cpu at batch 4",
    );
}

/// Issue 27, class 7: output paths. `--json /dev/null` writes to the device (a rename would
/// have replaced it with a regular file), a link is written through and stays a link, and a
/// folder or a FIFO is refused before the run starts.
#[cfg(unix)]
#[test]
fn output_paths_are_written_as_what_they_are() {
    use std::os::unix::fs::FileTypeExt;
    let quick = [
        "bench",
        "--network",
        "resnet18",
        "--input-size",
        "32",
        "--batch-size",
        "1",
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--json",
    ];
    let run = |target: &std::path::Path| {
        let mut args = quick.to_vec();
        args.push(target.to_str().unwrap());
        workshop(&args)
    };
    let null = std::path::Path::new("/dev/null");
    if std::fs::metadata(null).is_ok_and(|m| m.file_type().is_char_device()) {
        let o = run(null);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            std::fs::metadata(null)
                .unwrap()
                .file_type()
                .is_char_device()
        );
    }
    let d = tempfile::tempdir().unwrap();
    let real = d.path().join("real.json");
    let link = d.path().join("link.json");
    std::os::unix::fs::symlink("real.json", &link).unwrap();
    let o = run(&link);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(
        read_json(&real)["stats"]["throughput_median"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let o = run(d.path());
    assert!(
        !o.status.success() && stderr(&o).contains("is a folder"),
        "{}",
        stderr(&o)
    );
    assert!(
        !stdout(&o).contains("Performance summary"),
        "the run started"
    );
    let fifo = d.path().join("fifo");
    if std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        let o = run(&fifo);
        assert!(
            !o.status.success() && stderr(&o).contains("not a regular file"),
            "{}",
            stderr(&o)
        );
    }
}

/// `--framework pytorch` runs the bundled script on WORKSHOP_PYTHON and records what it prints
/// like one of our runs (a stand-in interpreter here, so the test needs no PyTorch); without
/// PyTorch, or without Python, it says how to install them; it refuses what only our kernels do.
#[test]
fn pytorch_runs_are_recorded_in_our_format() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let fake = |name: &str, body: &str| {
        let path = d.path().join(name);
        std::fs::write(&path, format!("#!/bin/sh\ncat > /dev/null\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    };
    let printing = fake(
        "python-ok",
        r#"echo '{"impl": "pytorch 9.9 eager", "device": "cpu", "network": "resnet18", "samples_s": [0.02, 0.03, 0.025], "warmup_s": [0.05], "prepare_s": 0.4, "threads_used": 2, "peak_memory_bytes": null}'"#,
    );
    let json = d.path().join("pt.json");
    let run = |python: &std::path::Path, iterations: &str, extra: &[&str]| {
        crate::common::command()
            .env("WORKSHOP_PYTHON", python)
            .args([
                "bench",
                "--network",
                "resnet18",
                "-b",
                "2",
                "--input-size",
                "64",
            ])
            .args(["--iterations", iterations, "--warmup", "1"])
            .args(["--framework", "pytorch"])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&printing, "3", &["--json", json.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("(cpu, pytorch 9.9 eager)"), "{out}");
    assert!(out.contains("Step time     median 25.00 ms"), "{out}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["config"]["framework"], "pytorch");
    assert_eq!(r["environment"]["kernel_version"], "pytorch 9.9 eager");
    assert_eq!(r["samples_s"].as_array().unwrap().len(), 3);
    // compare takes it like any record.
    let c = crate::common::command()
        .args(["compare", json.to_str().unwrap(), json.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(c.status.success(), "{}", stderr(&c));
    // A count of samples that is not the iterations' is refused.
    let o = run(&printing, "4", &[]);
    assert!(
        stderr(&o).contains("returned 3 samples for 4 iterations"),
        "{}{}",
        stderr(&o),
        String::from_utf8_lossy(&o.stdout)
    );
    let no_torch = fake(
        "python-bare",
        "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1",
    );
    let e = stderr(&run(&no_torch, "3", &[]));
    assert!(
        e.contains("PyTorch is not installed for") && e.contains("pip install torch torchvision"),
        "{e}"
    );
    let e = stderr(&run(&d.path().join("no-such-python"), "3", &[]));
    assert!(e.contains("no Python at"), "{e}");
    let e = stderr(&run(&printing, "3", &["--compile", "default"]));
    assert!(e.contains("--compile is for our kernels"), "{e}");
}

//! The course as a student and an instructor meet it: a whole run through 00–02 on the CPU,
//! navigation (skip, goto, reset, run, hint), broken exercise files with precise positions,
//! damaged or busy workspaces, and the book's commands against the real CLI.

use std::path::Path;
use std::process::Output;

use clap::Parser;
use serde_json::Value;

use crate::common::{stderr, stdout};

fn ws(dir: &Path, args: &[&str]) -> Output {
    crate::common::command()
        // No PyTorch, whatever this machine has: exercise 11's PyTorch step is unavailable.
        .env("WORKSHOP_PYTHON", "/nonexistent/python")
        .args(args)
        .arg("--dir")
        .arg(dir)
        .output()
        .expect("failed to start workshop")
}

fn ok(dir: &Path, args: &[&str]) -> String {
    let o = ws(dir, args);
    assert!(
        o.status.success(),
        "{args:?} failed:\n{}\n{}",
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

fn results(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap()
}

/// Every metric an attempt recorded is in the metrics table, for the attempt's kind of step
/// (issue 26: names were strings in four places and had drifted); a compare step's names are
/// the course's own.
fn recorded_metrics_are_in_the_table(r: &Value) {
    use workshop::course::metrics::{Scope, lookup};
    use workshop::course::schema::StepKind;
    for a in r["attempts"].as_array().unwrap() {
        let kind: StepKind = serde_json::from_value(a["kind"].clone()).unwrap();
        if kind == StepKind::Compare {
            continue;
        }
        for name in a["metrics"].as_object().unwrap().keys() {
            let m = lookup(name).unwrap_or_else(|| {
                panic!(
                    "{}.{}: `{name}` is not in the table",
                    a["exercise"], a["step"]
                )
            });
            assert!(
                m.scope != Scope::Step || m.kinds.contains(&kind),
                "`{name}` is recorded by a {kind:?} step, but the table does not list that kind"
            );
        }
    }
}

#[test]
fn the_embedded_course_runs_start_to_finish_on_the_cpu() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    ok(dir, &["init", "--name", "Ada Lovelace", "--threads", "2"]);
    let mut finished = false;
    for _ in 0..100 {
        let o = ws(dir, &["next", "--yes"]);
        let out = stdout(&o);
        if !o.status.success() {
            // The question step asks for its answer on the command line when there is no terminal.
            let err = stderr(&o);
            assert!(
                err.contains("answer with `workshop next --answer CHOICE`"),
                "{err}"
            );
            // Answer with the first choice.
            let choices = err.rsplit("(choices: ").next().unwrap_or_default();
            let first = choices.split([',', ')']).next().unwrap_or_default().trim();
            ok(dir, &["next", "--answer", first]);
            continue;
        }
        if out.contains("every exercise is done or skipped") {
            finished = true;
            break;
        }
        // 12 stays on its kernel step until the kernel passes: the engine's own kernel does.
        if out.contains("This step stays current until your kernel passes") {
            let kernel = dir.join("kernels/wgsl/depthwise.wgsl");
            let engine = engine_kernel("depthwise.wgsl");
            if std::fs::read_to_string(&kernel).unwrap() != engine {
                std::fs::write(&kernel, engine).unwrap();
            } else {
                // Right but not judged fast enough on this machine (its noise, or a narrow
                // lavapipe): its correctness is what this test holds it to.
                assert!(out.contains("PASS         your output matches"), "{out}");
                eprintln!("12's kernel step did not pass with the engine's kernel here:\n{out}");
                ok(dir, &["skip"]);
            }
        }
    }
    assert!(finished, "the course did not finish");
    let r = results(dir);
    recorded_metrics_are_in_the_table(&r);
    let attempts = r["attempts"].as_array().unwrap();
    let find = |ex: &str, step: &str| {
        attempts
            .iter()
            .find(|a| a["exercise"] == ex && a["step"] == step)
            .unwrap()
            .clone()
    };
    // 07's launch-overhead question means nothing where the host is the device.
    let overhead = find("07-kernel-profile", "overhead");
    assert_eq!(overhead["outcome"], "unavailable", "{overhead}");
    assert!(
        overhead["note"]
            .as_str()
            .unwrap()
            .contains("not applicable on the cpu backend (this step is for cuda, hip, wgpu)"),
        "{overhead}"
    );
    // The peak steps record the cores' FMA ceiling beside the GEMM, and 09 judges the GEMM
    // as a share of the same chains timed just before each GEMM (on the CPU's own range).
    assert!(
        find("01-baseline", "peak")["metrics"]["ceiling_gflops"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let peak = find("09-peak", "fp32");
    assert!(peak["metrics"]["ceiling_gflops"].as_f64().unwrap() > 0.0);
    let share = peak["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["what"] == "ceiling_share_beside")
        .expect("the GEMM judged against the chains beside it");
    assert_eq!(share["range"], "default");
    if workshop::backend::cpu::simd::simd().has_avx2() {
        assert!(share["value"].as_f64().unwrap() > 0.0, "{share}");
    }
    let baseline = find("01-baseline", "baseline");
    assert!(baseline["metrics"]["throughput"].as_f64().unwrap() > 0.0);
    assert_eq!(baseline["environment"]["backend"], "cpu");
    let sweep = find("01-baseline", "batch-sweep");
    assert_eq!(sweep["table"]["rows"].as_array().unwrap().len(), 3);
    let fp16 = find("02-precision", "fp16");
    assert_eq!(fp16["checks"].as_array().unwrap().len(), 2);
    assert!(["pass", "fail", "inconclusive"].contains(&fp16["outcome"].as_str().unwrap()));
    let q = find("02-precision", "fastest");
    assert_eq!(q["answer"], "fp32");
    let md = std::fs::read_to_string(dir.join("results.md")).unwrap();
    assert!(
        md.contains("Ada Lovelace") && md.contains("## 01-baseline") && md.contains("images/s"),
        "{md}"
    );
    let profile = find("04-flops", "profile");
    assert!(profile["metrics"]["efficiency"].as_f64().unwrap() > 0.0);
    assert!(profile["metrics"]["layer3.latency_ms"].as_f64().unwrap() > 0.0);
    assert!(
        dir.join("profiles/07-kernel-profile.large.trace.json")
            .exists()
    );
    // The vendor-library step needs cuBLAS: on the CPU it is recorded as unavailable.
    assert_eq!(
        find("07-kernel-profile", "vendor")["outcome"],
        "unavailable"
    );
    let compiled = find("06-compile", "default");
    assert!(compiled["metrics"]["rel_diff"].as_f64().unwrap() < 1e-3);
    // The CPU backend has nothing to replay: the step runs like default and records that.
    let replay = find("06-compile", "reduce-overhead");
    assert_ne!(replay["outcome"], "unavailable");
    assert_eq!(replay["metrics"]["replayed"], 0.0);
    assert_eq!(
        find("06-compile", "max-autotune-again")["metrics"]["autotune_timed"],
        0.0
    );
    // 08: the conv sweep at four sizes next to the published table, the CPU's kernel
    // variants timed per size, and the vendor step unavailable without cuBLAS.
    let conv = find("08-conv-sweep", "sweep");
    let table = &conv["table"];
    assert_eq!(table["rows"].as_array().unwrap().len(), 4, "{conv}");
    assert!(
        table["header"].to_string().contains("× CUDA.jl A100"),
        "{table}"
    );
    assert!(conv["metrics"]["vs_reference_last"].as_f64().unwrap() > 0.0);
    let variants = find("08-conv-sweep", "variants");
    assert!(
        variants["table"]["header"]
            .to_string()
            .contains("winograd-f4x4 ms"),
        "{variants}"
    );
    assert_eq!(find("08-conv-sweep", "vendor")["outcome"], "unavailable");
    // 11: our kernels eager and fused side by side; the vendor and PyTorch steps unavailable
    // here (no cuBLAS; the test's Python has no PyTorch), and the chart left them out.
    assert_eq!(
        find("11-native-vendor-framework", "vendor")["outcome"],
        "unavailable"
    );
    let pytorch = find("11-native-vendor-framework", "pytorch");
    assert_eq!(pytorch["outcome"], "unavailable", "{pytorch}");
    assert!(
        pytorch["note"]
            .as_str()
            .unwrap()
            .contains("pip install torch torchvision"),
        "{pytorch}"
    );
    let stack = find("11-native-vendor-framework", "stack");
    assert!(
        stack["metrics"]["fused.ratio"].as_f64().unwrap() > 0.0,
        "{stack}"
    );
    // 13: the three scenarios, their percentiles, and the server's best rate.
    let single = &find("13-latency-under-load", "single-stream")["metrics"];
    assert!(
        single["p99_ms"].as_f64() >= single["p50_ms"].as_f64(),
        "{single}"
    );
    let offline = &find("13-latency-under-load", "offline")["metrics"];
    assert_eq!(offline["mean_batch"].as_f64(), Some(8.0), "{offline}");
    let server = &find("13-latency-under-load", "server")["metrics"];
    assert!(server["best_qps"].as_f64().unwrap() > 0.0, "{server}");
    assert!(
        dir.join("records/13-latency-under-load.server.json")
            .exists()
    );
    let chart = find("10-compare", "comparison");
    assert!(chart["metrics"]["fp16.ratio"].as_f64().unwrap() > 0.0);
    assert!(dir.join("records/10-compare.fp16.json").exists());
    assert!(dir.join("charts/10-compare.comparison.svg").exists());
    // 14: the attention core apart from the linear layers (its projections among them), the
    // two networks' ratios, and the Swin sweep at the CPU's two sizes.
    let vit = &find("14-attention", "vit")["metrics"];
    let share = |op: &str| vit[format!("op.{op}.time_pct")].as_f64().unwrap();
    assert!(share("linear") > share("attention") && share("attention") > 0.0);
    let side = &find("14-attention", "side-by-side")["metrics"];
    assert!(side["intensity_ratio"].as_f64().unwrap() > 1.0, "{side}");
    let swin = find("14-attention", "swin-sizes");
    assert_eq!(swin["table"]["rows"].as_array().unwrap().len(), 2);
    // 15: a language model's phases on the roofline, and its two sweeps at the CPU's sizes;
    // the questions' own answers (prefill beats decode per token, decode is nearer the
    // bandwidth roof) hold on any machine.
    let llm = &find("15-llm", "run")["metrics"];
    for m in [
        "ttft_ms",
        "tpot_ms",
        "bandwidth_pct",
        "decode_peak_pct",
        "kv_cache_mib",
    ] {
        assert!(llm[m].as_f64().unwrap() > 0.0, "{m}: {llm}");
    }
    assert!(llm["prefill_tokens_per_s"].as_f64() > llm["decode_tokens_per_s"].as_f64());
    // Decode nearer the bandwidth roof than the GEMM's is a claim about the peaks behind the
    // two shares, which the step measures with short probes when the cache has none (BF16
    // here): with other tests' threads on the cores, a 512³ probe once read 23 GFLOP/s and
    // the shares came out the other way round. The step then records `unsteady` (its timing
    // checks inconclusive), and so does this test's claim.
    if llm["unsteady"].as_f64() == Some(0.0) {
        assert!(
            llm["bandwidth_pct"].as_f64() > llm["decode_peak_pct"].as_f64(),
            "{llm}"
        );
    } else {
        assert_eq!(llm["unsteady"].as_f64(), Some(1.0), "{llm}");
    }
    let batch = find("15-llm", "batch");
    assert_eq!(batch["table"]["rows"].as_array().unwrap().len(), 2);
    assert!(batch["metrics"]["scaling"].as_f64().unwrap() > 0.0);
    assert!(dir.join("records/15-llm.run.json").exists());
    let status = ok(dir, &["status"]);
    assert!(status.contains("16/16 exercises"), "{status}");
}

/// The engine's own copy of a WGSL kernel file.
fn engine_kernel(file: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/wgsl");
    std::fs::read_to_string(root.join(file)).unwrap()
}

/// 12's kernel step, as a student meets it: the slow start copied into the workspace and
/// judged right but slow; a compile error shown with the student's file and line; a wrong
/// output shown value by value and not timed; the step staying current through all of it;
/// and `workshop watch` checking again on save until the kernel passes, then writing the
/// solution and moving on.
#[test]
fn a_kernel_step_checks_compiling_then_output_then_speed() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    ok(dir, &["init", "--name", "Grace"]);
    ok(dir, &["goto", "12"]);
    let out = ok(dir, &["next", "--yes"]);
    let attempt = |n: usize| results(dir)["attempts"][n].clone();
    if attempt(0)["outcome"] == "unavailable" {
        eprintln!("skipped: no wgpu adapter here ({})", attempt(0)["note"]);
        return;
    }
    let kernel = dir.join("kernels/wgsl/depthwise.wgsl");
    let start = std::fs::read_to_string(&kernel).unwrap();
    assert!(start.contains("if (lid != 0u)"), "the slow start: {start}");
    assert_eq!(
        std::fs::read_to_string(dir.join("kernels/start/wgsl/depthwise.wgsl")).unwrap(),
        start
    );
    let first = attempt(0);
    // The start against itself falls short of 3×, unless this machine was so noisy that even
    // 1× could read as 3× (a CV above the step's 25% limit on both runs).
    match first["outcome"].as_str() {
        Some("inconclusive") => assert!(
            first["metrics"]["cv"].as_f64().unwrap() > 0.25 && out.contains("too noisy"),
            "{out}"
        ),
        _ => assert_eq!(first["outcome"], "fail", "{out}"),
    }
    assert_eq!(first["metrics"]["correct"], 1.0);
    assert!(
        first["metrics"]["speedup"].as_f64().unwrap() < 2.0,
        "{first}"
    );
    assert!(first["metrics"]["engine_ms"].as_f64().unwrap() > 0.0);
    assert!(out.contains("This step stays current"), "{out}");
    // A compile error: the compiler's message, with the student's file and line.
    let planted = "acc = bias[c];";
    let line = 1 + start.lines().position(|l| l.contains(planted)).unwrap();
    std::fs::write(
        &kernel,
        start.replace(planted, "acc = bias[c] + no_such_name;"),
    )
    .unwrap();
    let out = ok(dir, &["next", "--yes"]);
    assert!(out.contains("no_such_name"), "{out}");
    assert!(
        out.contains(&format!("kernels/wgsl/depthwise.wgsl:{line}:")),
        "the message names the student's file and line {line}:\n{out}"
    );
    assert_eq!(attempt(1)["outcome"], "fail");
    assert_eq!(attempt(1)["metrics"]["correct"], 0.0);
    // A wrong output: the values shown, nothing timed.
    std::fs::write(&kernel, start.replace(planted, "acc = bias[c] * 0.5;")).unwrap();
    let out = ok(dir, &["next", "--yes"]);
    assert!(out.contains("differ from the engine's kernel"), "{out}");
    assert!(out.contains("n=0 c=0 y=0 x=0"), "{out}");
    assert_eq!(attempt(2)["metrics"]["correct"], 0.0);
    assert!(attempt(2)["metrics"].get("speedup").is_none());
    // A kernel that compiles but no longer fits what the host binds: the driver's message.
    let uniform = start
        .replace(
            "var<storage, read> bias: array<f32>;",
            "var<uniform> bias: array<vec4<f32>, 4>;",
        )
        .replace(planted, "acc = bias[0].x;");
    std::fs::write(&kernel, uniform).unwrap();
    let out = ok(dir, &["next", "--yes"]);
    assert!(out.contains("Your kernel could not be prepared"), "{out}");
    assert!(out.contains("FAIL         your kernel runs"), "{out}");
    let status = ok(dir, &["status"]);
    assert!(!status.contains("12-write-a-kernel ┆ done"), "{status}");
    // `workshop watch`: checks now (still wrong), then again once the file is saved.
    let mut watch = crate::common::command()
        .args(["watch", "--dir"])
        .arg(dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let attempts = || results(dir)["attempts"].as_array().unwrap().len();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while attempts() < 5 {
        assert!(std::time::Instant::now() < deadline, "watch did not check");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    std::fs::write(&kernel, engine_kernel("depthwise.wgsl")).unwrap();
    let last = || {
        results(dir)["attempts"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    let exited = loop {
        if watch.try_wait().unwrap().is_some() {
            break true;
        }
        // Right but not judged fast enough here (too noisy, or a narrow lavapipe): watch
        // would wait for the next save; the check itself is what this test needs.
        if attempts() >= 6 && last()["outcome"] != "pass" {
            watch.kill().unwrap();
            break false;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "watch did not check again"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let o = watch.wait_with_output().unwrap();
    let out = stdout(&o);
    assert!(out.contains("Watching"), "{out}");
    let last = last();
    assert_eq!(last["metrics"]["correct"], 1.0, "{out}");
    if exited {
        assert!(o.status.success(), "{out}");
        assert_eq!(last["outcome"], "pass", "{out}");
        assert!(dir.join("kernels/solution/wgsl/depthwise.wgsl").exists());
        assert!(ok(dir, &["next", "--yes", "--answer", "yours"]).contains("versus"));
    } else {
        eprintln!("the engine's kernel was not judged fast enough here:\n{out}");
        assert!(last["metrics"]["speedup"].as_f64().unwrap() > 1.0, "{out}");
    }
}

/// A small course of two fast exercises, written into `root`.
fn tiny_course(root: &Path) {
    std::fs::create_dir_all(root.join("exercises")).unwrap();
    std::fs::create_dir_all(root.join("book/src")).unwrap();
    for (id, chapter) in [("00-first", "00-first.md"), ("01-second", "01-second.md")] {
        std::fs::write(root.join("book/src").join(chapter), format!("# {id}\n")).unwrap();
    }
    std::fs::write(
        root.join("exercises/00-first.toml"),
        r#"format_version = 1
id = "00-first"
title = "First"
chapter = "00-first.md"

[[step]]
id = "hello"
kind = "note"
say = "Hello."
hint = "Just run next."

[[step]]
id = "run"
kind = "bench"
say = "A tiny run."
bench = { network = "resnet18", batch_size = 1, iterations = 2, warmup = 0, input_size = 32 }
# A check that does not hang on timing (two iterations after no warm-up can be noisy enough
# to make a throughput check inconclusive): this step fails on purpose.
[[step.expect]]
metric = "loss"
min = 1e12
hint = "No loss is this high: this expectation fails on purpose."
"#,
    )
    .unwrap();
    std::fs::write(
        root.join("exercises/01-second.toml"),
        r#"format_version = 1
id = "01-second"
title = "Second"
chapter = "01-second.md"
requires = ["00-first"]

[[step]]
id = "only"
kind = "note"
say = "The end."
"#,
    )
    .unwrap();
}

#[test]
fn navigation_never_dead_ends() {
    let d = tempfile::tempdir().unwrap();
    let dir = &tiny_workspace(d.path(), ("", ""), &["--name", "Bob"]);
    assert!(ok(dir, &["hint"]).contains("Just run next."));
    ok(dir, &["next", "--yes"]);
    // A failed expectation is recorded with its hint and the course moves on.
    let out = ok(dir, &["next", "--yes"]);
    assert!(
        out.contains("FAIL") && out.contains("fails on purpose"),
        "{out}"
    );
    assert!(
        out.contains("re-run it with `workshop run 00-first.run`"),
        "{out}"
    );
    assert!(ok(dir, &["hint"]).contains("fails on purpose"));
    // Re-running a step records a new attempt without moving on.
    ok(dir, &["run", "00-first.run"]);
    // Short ids: the start of an exercise's id, when only it starts so.
    ok(dir, &["run", "00.run"]);
    let runs = results(dir)["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["step"] == "run")
        .count();
    assert_eq!(runs, 3);
    assert!(ok(dir, &["book", "01"]).contains("# 01-second"));
    let o = ws(dir, &["book", "0"]);
    assert!(
        !o.status.success()
            && stderr(&o).contains("`0` could be any of 00-first, 01-second: give more of the id"),
        "{}",
        stderr(&o)
    );
    assert!(ok(dir, &["status"]).contains("01-second"));
    // Skip is recorded; goto brings an exercise back; reset starts it over.
    let out = ok(dir, &["skip"]);
    assert!(out.contains("Skipped 01-second"), "{out}");
    let r = results(dir);
    assert!(
        r["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["step"] == "only" && a["outcome"] == "skipped")
    );
    // The last screen and status count what failed and say how to re-run it.
    let end = ok(dir, &["next", "--yes"]);
    assert!(
        end.contains("every exercise is done or skipped")
            && !end.contains("Well done")
            && end.contains("Steps: 1 passed, 1 failed, 1 skipped")
            && end.contains("Re-run what failed: `workshop run 00-first.run`"),
        "{end}"
    );
    let status = ok(dir, &["status"]);
    assert!(
        status.contains("steps: 1 passed, 1 failed, 1 skipped")
            && status.contains("`workshop run 00-first.run`"),
        "{status}"
    );
    ok(dir, &["goto", "01-second"]);
    assert!(ok(dir, &["next", "--yes"]).contains("The end."));
    // goto then skip: the steps run before keep their results (the worksheet too).
    ok(dir, &["goto", "00-first"]);
    ok(dir, &["skip"]);
    let skipped_hello = results(dir)["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["step"] == "hello" && a["outcome"] == "skipped")
        .count();
    assert_eq!(skipped_hello, 0);
    let sheet = std::fs::read_to_string(dir.join("results.md")).unwrap();
    assert!(sheet.contains("| hello | pass |"), "{sheet}");
    ok(dir, &["reset", "00-first"]);
    let status = ok(dir, &["status"]);
    assert!(status.contains("not started"), "{status}");
    let csv = ok(dir, &["results", "--export", "csv"]);
    assert!(
        csv.starts_with("exercise,step,outcome,metric,value,finished")
            && csv.contains("00-first,run,fail,throughput")
    );
    let o = ws(dir, &["goto", "99-nope"]);
    assert!(
        !o.status.success()
            && stderr(&o).contains("no exercise `99-nope`; the course has: 00-first, 01-second")
    );
}

/// A workspace in `root/ws` on the tiny course in `root/course`, whose first exercise has
/// `from` replaced by `to` (the same text for no change), initialised with `init` arguments.
fn tiny_workspace(root: &Path, (from, to): (&str, &str), init: &[&str]) -> std::path::PathBuf {
    let course = root.join("course");
    tiny_course(&course);
    let f = course.join("exercises/00-first.toml");
    let text = std::fs::read_to_string(&f).unwrap();
    assert!(text.contains(from), "the tiny course has no `{from}`");
    std::fs::write(&f, text.replace(from, to)).unwrap();
    let dir = root.join("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = vec!["init"];
    args.extend_from_slice(init);
    args.extend(["--course", course.to_str().unwrap()]);
    ok(&dir, &args);
    dir
}

/// Write `text` as the only exercise of a course and return `workshop dev lint`'s stderr.
fn lint_one(text: &str) -> String {
    let d = tempfile::tempdir().unwrap();
    tiny_course(d.path());
    std::fs::remove_file(d.path().join("exercises/01-second.toml")).unwrap();
    std::fs::write(d.path().join("exercises/00-first.toml"), text).unwrap();
    let o = crate::common::command()
        .args(["dev", "lint"])
        .arg(d.path())
        .output()
        .unwrap();
    assert!(!o.status.success(), "lint accepted:\n{text}");
    stderr(&o)
}

#[test]
fn broken_exercise_files_get_precise_errors() {
    let good =
        std::fs::read_to_string(crate::common::fixture("../../exercises/00-setup.toml")).unwrap();
    let good = good.replace("00-setup", "00-first");
    // TOML syntax error: line 3, where the string is not closed.
    let e = lint_one("format_version = 1\nid = \"00-first\"\ntitle = \"oops\nchapter = \"x.md\"\n");
    assert!(e.contains("00-first.toml:3:"), "{e}");
    // An unknown field, named, at its line.
    let e = lint_one(&good.replace("summary = ", "sumary = "));
    assert!(
        e.contains("00-first.toml:5:1: unknown field `sumary`"),
        "{e}"
    );
    // A range upside down.
    let e = lint_one(&good.replace("min = 6.0\nmax = 8.0", "min = 8.0\nmax = 6.0"));
    assert!(e.contains("range min 8 is above max 6"), "{e}");
    // A chapter that is not in the book.
    let e = lint_one(&good.replace("chapter = \"00-first.md\"", "chapter = \"nowhere.md\""));
    assert!(
        e.contains("00-first.toml:4:11: chapter `nowhere.md` does not exist"),
        "{e}"
    );
    // A network not in the zoo, and a metric no step produces.
    let e = lint_one(
        &good
            .replace("network = \"resnet18\"", "network = \"resnet19\"")
            .replace("metric = \"loss\"", "metric = \"lost\""),
    );
    assert!(
        e.contains("network `resnet19` is not in the zoo")
            && e.contains("this step has no metric `lost`"),
        "{e}"
    );
    // A question without `correct`, and a reference to a step that records nothing.
    let question = "\n[[step]]\nid = \"q\"\nkind = \"question\"\nhint = \"h\"\nsay = \"?\"\n";
    let e = lint_one(&format!(
        "{good}{question}question = {{ prompt = \"Which?\", choices = [\"a\", \"b\"] }}\n"
    ));
    assert!(e.contains("a question needs `correct`"), "{e}");
    let e = lint_one(&format!(
        "{good}{question}question = {{ prompt = \"Which?\", choices = [\"a\", \"b\"], correct = {{ values = [\"ready.x\", \"ready.y\"] }} }}\n"
    ));
    assert!(
        e.contains("step `ready` has no metric `x` (it has: none)"),
        "{e}"
    );
    // A missing hint.
    let e = lint_one(&good.replacen(
        "hint = \"The larger networks",
        "hint = \" \" # \"The larger networks",
        1,
    ));
    assert!(e.contains("an expectation needs a hint"), "{e}");
    // Language models run in `llm` steps only, and image networks never do.
    let run = "\n[[step]]\nid = \"lm\"\nhint = \"h\"\nsay = \"A run.\"\n";
    let cases = [
        (
            "kind = \"llm\"\nbench = { network = \"resnet18\" }",
            "`resnet18` is not a language model",
        ),
        (
            "kind = \"bench\"\nbench = { network = \"qwen2.5-0.5b\" }",
            "`qwen2.5-0.5b` is a language model: run it in a step of kind `llm`",
        ),
        (
            "kind = \"bench\"\nbench = { network = \"resnet18\", prompt_len = 8 }",
            "prompt_len and gen_len are for `llm` steps",
        ),
        (
            "kind = \"llm\"\nbench = { network = \"gpt2\" }\nsweep = { param = \"input_size\", values = [1, 2] }",
            "an `llm` step batch_size or prompt_len",
        ),
        (
            "kind = \"llm\"\nbench = { network = \"gpt2\", gen_len = 0 }",
            "gen_len must be at least 1",
        ),
        (
            "kind = \"sweep\"\nbench = { network = \"conv2d(4, 4, 3\" }\nsweep = { param = \"input_size\", values = [8] }",
            "no closing parenthesis",
        ),
        (
            "kind = \"sweep\"\nbench = { network = \"resnet18\" }\nsweep = { param = \"input_size\", values = [8, 16], reference = [{ label = \"A100\", ms = [0.3] }] }",
            "reference `A100` needs one positive time (ms) per sweep value: 2 values, 1 times",
        ),
        (
            "kind = \"sweep\"\nbench = { network = \"resnet18\" }\nsweep = { param = \"input_size\", values = [8], cpu_values = [4], reference = [{ label = \"A100\", ms = [0.3] }] }",
            "cpu value 4 has no published time",
        ),
        (
            "kind = \"bench\"\nbench = { network = \"resnet18\", qps = 5.0 }",
            "queries, duration_s, latency_bound_ms, batch_timeout_ms and qps are for a `scenario`",
        ),
        (
            "kind = \"bench\"\nbench = { network = \"resnet18\", scenario = \"offline\", qps = 5.0 }",
            "qps is for the `server` scenario",
        ),
        (
            "kind = \"kernel\"\nbench = { network = \"resnet18\" }",
            "a `kernel` step, and only a `kernel` step, has a `kernel` section",
        ),
        (
            "kind = \"bench\"\nbench = { network = \"resnet18\" }\nkernel = { file = \"wgsl/depthwise.wgsl\", start = \"start/depthwise.wgsl\", entry = \"depthwise\", speedup = 2.0 }",
            "a `kernel` step, and only a `kernel` step, has a `kernel` section",
        ),
        (
            "kind = \"kernel\"\nbench = { network = \"resnet18\" }\nkernel = { file = \"wgsl/nope.wgsl\", start = \"start/depthwise.wgsl\", entry = \"depthwise\", speedup = 2.0 }",
            "kernel file `wgsl/nope.wgsl` is not one of the engine's WGSL files (wgsl/activate.wgsl",
        ),
        (
            "kind = \"kernel\"\nbench = { network = \"resnet18\" }\nkernel = { file = \"wgsl/depthwise.wgsl\", start = \"../../etc/passwd\", entry = \"depthwise\", speedup = 2.0 }",
            "kernel start `../../etc/passwd`: not a plain path inside the course's exercises/",
        ),
        (
            "kind = \"kernel\"\nbench = { network = \"resnet18\" }\nkernel = { file = \"wgsl/depthwise.wgsl\", start = \"start/missing.wgsl\", entry = \"depthwise\", speedup = 2.0 }",
            "kernel start `start/missing.wgsl`: cannot read",
        ),
        (
            "kind = \"kernel\"\nbench = { network = \"resnet18\" }\nkernel = { file = \"wgsl/depthwise.wgsl\", start = \"start/missing.wgsl\", entry = \"depthwise\", speedup = 0.5 }",
            "kernel speedup 0.5 must be above 1",
        ),
    ];
    for (step, needle) in cases {
        let e = lint_one(&format!("{good}{run}{step}\n"));
        assert!(e.contains(needle), "{step}: {e}");
    }
}

#[test]
fn requires_cycles_are_found() {
    let d = tempfile::tempdir().unwrap();
    tiny_course(d.path());
    let first = std::fs::read_to_string(d.path().join("exercises/00-first.toml")).unwrap();
    std::fs::write(
        d.path().join("exercises/00-first.toml"),
        first.replace(
            "chapter = \"00-first.md\"",
            "chapter = \"00-first.md\"\nrequires = [\"01-second\"]",
        ),
    )
    .unwrap();
    let o = crate::common::command()
        .args(["dev", "lint"])
        .arg(d.path())
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(
        !o.status.success()
            && e.contains("`requires` forms a cycle: 00-first → 01-second → 00-first"),
        "{e}"
    );
}

#[test]
fn the_embedded_course_passes_lint_and_new_exercises_scaffold_cleanly() {
    let o = crate::common::command()
        .args(["dev", "lint"])
        .output()
        .unwrap();
    assert!(
        o.status.success() && stdout(&o).contains("course OK: 16 exercises"),
        "{}",
        stderr(&o)
    );
    // The repository's course as a folder: its book too (every chapter in SUMMARY.md), with
    // no warning either.
    let lint = |dir: &Path| {
        crate::common::command()
            .args(["dev", "lint"])
            .arg(dir)
            .output()
            .unwrap()
    };
    let o = lint(&crate::common::fixture("../.."));
    assert!(
        o.status.success() && stderr(&o).is_empty(),
        "{}",
        stderr(&o)
    );
    // A course started from nothing: the exercise, its chapter, the introduction and the
    // summary that lists both, clean.
    let d = tempfile::tempdir().unwrap();
    let new = |id: &str| {
        crate::common::command()
            .args(["dev", "new", id, "--dir"])
            .arg(d.path())
            .output()
            .unwrap()
    };
    let o = new("00-first");
    assert!(o.status.success(), "{}", stderr(&o));
    let o = new("01-second");
    assert!(o.status.success(), "{}", stderr(&o));
    let summary = std::fs::read_to_string(d.path().join("book/src/SUMMARY.md")).unwrap();
    assert!(
        summary.contains("[Introduction](introduction.md)")
            && summary.contains("- [00-first](00-first.md)\n- [01-second](01-second.md)\n"),
        "{summary}"
    );
    let o = lint(d.path());
    assert!(
        o.status.success() && stderr(&o).is_empty(),
        "the scaffold does not pass lint: {}",
        stderr(&o)
    );
    // Warnings say what to mend and do not fail: a page gone from the book, a chapter left
    // out of the summary, a step without a hint.
    std::fs::remove_file(d.path().join("book/src/introduction.md")).unwrap();
    std::fs::write(
        d.path().join("book/src/SUMMARY.md"),
        "# Summary\n\n- [00-first](00-first.md)\n",
    )
    .unwrap();
    let f = d.path().join("exercises/01-second.toml");
    let text = std::fs::read_to_string(&f).unwrap();
    let hint = text
        .lines()
        .find(|l| l.starts_with("hint = "))
        .unwrap()
        .to_string();
    std::fs::write(&f, text.replace(&(hint + "\n"), "")).unwrap();
    let o = lint(d.path());
    let err = stderr(&o);
    assert!(
        o.status.success()
            && stdout(&o).contains("(3 warning(s) above)")
            && err.contains("introduction.md:1:1: warning: missing: the book's first page")
            && err.contains("01-second.toml:4:11: warning: chapter `01-second.md` is not listed in book/src/SUMMARY.md")
            && err.contains("warning: step `")
            && err.contains("has no hint"),
        "{err}"
    );
    // The course still loads for a student.
    let ws = d.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let o = crate::common::command()
        .args(["init", "--name", "Di", "--course"])
        .arg(d.path())
        .current_dir(&ws)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // Every exercise file in exercises/ is embedded in the binary.
    let on_disk = std::fs::read_dir(crate::common::fixture("../../exercises"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "toml")
        })
        .count();
    // And every kernel step's start file.
    let starts = std::fs::read_dir(crate::common::fixture("../../exercises/start"))
        .unwrap()
        .count();
    assert_eq!(starts, workshop::course::EMBEDDED_STARTS.len());
    assert_eq!(on_disk, workshop::course::EMBEDDED_EXERCISES.len());
}

#[test]
fn damaged_busy_and_missing_workspaces_are_clear() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let o = ws(dir, &["status"]);
    assert!(!o.status.success() && stderr(&o).contains("no workshop workspace in"));
    let o = ws(dir, &["init"]);
    assert!(
        !o.status.success()
            && stderr(&o).contains("give your name with `workshop init --name NAME`")
    );
    ok(dir, &["init", "--name", "Cy"]);
    let o = ws(dir, &["init", "--name", "Cy"]);
    assert!(!o.status.success() && stderr(&o).contains("already holds a workshop workspace"));
    // Another command holding the lock.
    let file = std::fs::File::options()
        .write(true)
        .open(dir.join(".workshop/lock"))
        .unwrap();
    let mut lock = fd_lock::RwLock::new(file);
    let guard = lock.try_write().unwrap();
    let o = ws(dir, &["goto", "01-baseline"]);
    assert!(
        !o.status.success() && stderr(&o).contains("another workshop command is running"),
        "{}",
        stderr(&o)
    );
    drop(guard);
    // A damaged state file: a clear error, and a way out that keeps a backup.
    std::fs::write(dir.join(".workshop/state.json"), "{ not json").unwrap();
    let o = ws(dir, &["status"]);
    let e = stderr(&o);
    assert!(
        !o.status.success()
            && e.contains("state.json` is damaged")
            && e.contains("workshop reset --all"),
        "{e}"
    );
    assert!(!e.contains("panicked"));
    ok(dir, &["reset", "--all"]);
    let backups = std::fs::read_dir(dir.join(".workshop"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("state.json.bak-")
        })
        .count();
    assert_eq!(backups, 1);
    ok(dir, &["init", "--name", "Cy"]);
}

#[test]
fn a_killed_run_loses_nothing_recorded() {
    let d = tempfile::tempdir().unwrap();
    // Make the bench step long enough to be killed in the middle.
    let long = (
        "iterations = 2, warmup = 0, input_size = 32",
        "iterations = 100000, warmup = 0, input_size = 64",
    );
    let dir = &tiny_workspace(d.path(), long, &["--name", "Dee"]);
    ok(dir, &["next", "--yes"]);
    let before = std::fs::read_to_string(dir.join("results.json")).unwrap();
    let state_before = std::fs::read_to_string(dir.join(".workshop/state.json")).unwrap();
    let mut child = crate::common::command()
        .args(["next", "--yes", "--dir"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    child.kill().unwrap(); // SIGKILL: no chance to clean up
    child.wait().unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("results.json")).unwrap(),
        before
    );
    assert_eq!(
        std::fs::read_to_string(dir.join(".workshop/state.json")).unwrap(),
        state_before
    );
    // The lock died with the process: the workspace is usable at once.
    assert!(ok(dir, &["status"]).contains("1/2"));
    // Ctrl-C (SIGINT) says so, records nothing, and exits as interrupted programs do.
    let child = crate::common::command()
        .args(["next", "--yes", "--dir"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: signalling our own child, which is still running (it waits for us to reap it).
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130));
    assert!(
        stderr(&o).contains("interrupted: nothing recorded for this step"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("results.json")).unwrap(),
        before
    );
    ok(dir, &["skip", "00-first"]);
}

/// A kill between the two renames that record a step (results.json first, then the state)
/// leaves results ahead of the state: the next command must move on as the record said, not
/// run the step again and record it twice (issue 27, class 5). Simulated by putting back the
/// state from before the record.
#[test]
fn a_kill_between_the_two_writes_records_no_attempt_twice() {
    let d = tempfile::tempdir().unwrap();
    let dir = &tiny_workspace(d.path(), ("", ""), &["--name", "Kay"]);
    let state = dir.join(".workshop/state.json");
    let stale = std::fs::read_to_string(&state).unwrap();
    ok(dir, &["next", "--yes"]);
    std::fs::write(&state, &stale).unwrap();
    let out = ok(dir, &["next", "--yes"]);
    assert!(
        out.contains("A tiny run."),
        "ran the first step again:\n{out}"
    );
    let steps: Vec<String> = (results(dir)["attempts"].as_array().unwrap().iter())
        .map(|a| a["step"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(steps, ["hello", "run"]);
    // The same for skip, which moves on by recording skipped attempts.
    let stale = std::fs::read_to_string(&state).unwrap();
    ok(dir, &["skip"]);
    std::fs::write(&state, &stale).unwrap();
    assert!(ok(dir, &["status"]).contains("2/2"));
    assert!(ok(dir, &["next", "--yes"]).contains("every exercise is done or skipped"));
    assert_eq!(results(dir)["attempts"].as_array().unwrap().len(), 3);
}

/// A workspace that cannot be written fails before the step runs, not after (issue 27, class
/// 6). Root ignores permissions, so as root the command runs as `nobody` (util-linux's
/// `setpriv`) on a workspace that user owns but whose folder is read-only.
#[test]
fn a_read_only_workspace_fails_before_the_step_runs() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let long = (
        "iterations = 2, warmup = 0, input_size = 32",
        "iterations = 100000, warmup = 0, input_size = 64",
    );
    let dir = &tiny_workspace(d.path(), long, &["--name", "Ro"]);
    ok(dir, &["next", "--yes"]);
    // A folder this process made is owned by its effective user.
    let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(d.path()).unwrap()) == 0;
    let mut cmd = if root {
        for p in [d.path(), &d.path().join("course"), dir] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let chown = std::process::Command::new("chown")
            .args(["-R", "65534:65534"])
            .arg(dir)
            .status();
        let as_nobody = || {
            let mut c = std::process::Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
            c.arg(env!("CARGO_BIN_EXE_workshop"));
            c.env("WORKSHOP_CACHE_DIR", d.path().join("cache"));
            c
        };
        let runs = as_nobody().arg("--version").output();
        if !chown.is_ok_and(|s| s.success()) || !runs.is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: cannot run the binary as another user here");
            return;
        }
        as_nobody()
    } else {
        crate::common::command()
    };
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let started = std::time::Instant::now();
    let o = cmd
        .args(["next", "--yes", "--dir"])
        .arg(dir)
        .output()
        .unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = stderr(&o);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(
        err.contains("nothing was run")
            && err.contains(&format!("cannot write in `{}`", dir.display())),
        "{err}"
    );
    assert!(!stdout(&o).contains("A tiny run."), "{}", stdout(&o));
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    assert_eq!(results(dir)["attempts"].as_array().unwrap().len(), 1);
}

/// `init` checks where the course will run and, on an existing workspace, switches it while
/// keeping every result; a hand-edited state's threads are blamed on the state, not on a flag
/// (issue 27, class 12).
#[test]
fn init_checks_placement_and_switches_keeping_results() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let o = ws(dir, &["init", "--name", "Al", "--device", "99"]);
    assert!(
        !o.status.success()
            && stderr(&o).contains("--device 99: the cpu backend has 1 device(s) here"),
        "{}",
        stderr(&o)
    );
    assert!(!dir.join(".workshop").exists());
    let o = ws(dir, &["init", "--name", "Al", "--threads", "0"]);
    assert!(!o.status.success() && stderr(&o).contains("--threads must be at least 1"));
    // HIP without the emulator: not in this build, or no driver. Said, and accepted.
    let o = crate::common::command()
        .env_remove("WORKSHOP_GPU_EMULATOR")
        .args(["init", "--name", "Al", "--backend", "hip", "--dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("note: the hip backend")
            && stderr(&o).contains("`workshop init --backend cpu`"),
        "{}",
        stderr(&o)
    );
    ok(dir, &["next", "--yes"]);
    let o = ws(dir, &["init", "--name", "Al"]);
    assert!(!o.status.success() && stderr(&o).contains("not the name"));
    let out = ok(dir, &["init", "--backend", "cpu", "--threads", "1"]);
    assert!(
        out.contains("now runs on cpu device 0 with 1 threads; the 1 recorded attempt(s) stay"),
        "{out}"
    );
    assert_eq!(results(dir)["attempts"].as_array().unwrap().len(), 1);
    assert!(ok(dir, &["status"]).contains("00-setup"));
    let state = dir.join(".workshop/state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    std::fs::write(&state, text.replace("\"threads\": 1", "\"threads\": 0")).unwrap();
    let o = ws(dir, &["next", "--yes"]);
    let e = stderr(&o);
    assert!(
        !o.status.success()
            && e.contains("state.json` says threads = 0")
            && e.contains("`workshop init --threads N`")
            && !e.contains("--threads must"),
        "{e}"
    );
    ok(dir, &["init", "--threads", "2"]);
    ok(dir, &["status"]);
}

/// Split a shell line into words, honouring double quotes (enough for the book's examples).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    // The quote that opened the current quoted part, if any: " or '.
    let mut quoted: Option<char> = None;
    let mut any = false;
    for ch in line.chars() {
        match ch {
            '"' | '\'' if quoted.is_none_or(|q| q == ch) => {
                quoted = if quoted.is_some() { None } else { Some(ch) };
                any = true;
            }
            c if c.is_whitespace() && quoted.is_none() => {
                if any {
                    words.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(cur);
    }
    words
}

#[test]
fn every_command_in_the_book_and_exercises_parses_and_every_chapter_is_listed() {
    let book = crate::common::fixture("../../book/src");
    let summary = std::fs::read_to_string(book.join("SUMMARY.md")).unwrap();
    let mut commands = 0;
    for entry in std::fs::read_dir(&book).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name == "SUMMARY.md" {
            continue;
        }
        assert!(
            summary.contains(&format!("({name})")),
            "SUMMARY.md does not list {name}"
        );
        let text = std::fs::read_to_string(&path).unwrap();
        // Every `{{#include}}` resolves, as mdBook and `workshop book` show it.
        let shown = workshop::course::expand_includes(&text, |p| {
            std::fs::read_to_string(book.join("../..").join(p)).ok()
        });
        assert!(!shown.contains("the book cannot show"), "{name}: {shown}");
        let mut in_code = false;
        for line in text.lines() {
            if line.starts_with("```") {
                in_code = line.trim() == "```sh";
                continue;
            }
            let cmd = line.split(" # ").next().unwrap().trim();
            if in_code && cmd.starts_with("workshop ") {
                let words = shell_words(cmd);
                if let Err(e) = workshop::cmd::args::Cli::try_parse_from(&words) {
                    panic!("{name}: `{cmd}` does not parse:\n{e}");
                }
                // A network it names exists (a layer chain builds).
                if let Some(i) = words.iter().position(|w| w == "--network")
                    && let Some(net) = words.get(i + 1)
                    && !workshop::model::llm::is_decoder(net)
                    && let Err(e) = workshop::model::zoo::build(net)
                {
                    panic!("{name}: `{cmd}`: {e}");
                }
                commands += 1;
            }
        }
    }
    assert!(commands >= 10, "only {commands} commands found in the book");
    // And every command an exercise quotes (`workshop …` in its texts and hints).
    let exercises = crate::common::fixture("../../exercises");
    let mut quoted = 0;
    for entry in std::fs::read_dir(&exercises).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for cmd in text.split('`').skip(1).step_by(2) {
            if cmd.starts_with("workshop ") {
                let words = shell_words(cmd);
                if let Err(e) = workshop::cmd::args::Cli::try_parse_from(&words) {
                    panic!("{}: `{cmd}` does not parse:\n{e}", path.display());
                }
                quoted += 1;
            }
        }
    }
    assert!(
        quoted >= 40,
        "only {quoted} commands found in the exercises"
    );
    for (page, _) in workshop::course::EMBEDDED_CHAPTERS {
        assert!(
            book.join(page).exists(),
            "embedded chapter {page} is not in book/src"
        );
    }
}

#[test]
fn a_step_this_machine_cannot_run_is_recorded_as_unavailable() {
    let d = tempfile::tempdir().unwrap();
    // BF16 on wgpu: WGSL has no bf16 type (and without an adapter, there is no device at all).
    let bf16 = (
        "input_size = 32 }",
        "input_size = 32, precision = \"bf16\" }",
    );
    let dir = &tiny_workspace(d.path(), bf16, &["--name", "Eve", "--backend", "wgpu"]);
    // Steps built on the one that cannot run: a comparison and a question about its numbers
    // (05-multi-device's summary on a one-GPU machine).
    let f = d.path().join("course/exercises/00-first.toml");
    let mut text = std::fs::read_to_string(&f).unwrap();
    text.push_str(
        r#"
[[step]]
id = "ratio"
kind = "compare"
say = "A ratio of the run's numbers."
derive = [{ name = "same", numerator = "run.throughput", denominator = "run.throughput" }]

[[step]]
id = "which"
kind = "question"
say = "A question the run would answer."
question = { prompt = "Which?", choices = ["a", "b"], correct = { values = ["run.throughput", "run.median_ms"] } }
"#,
    );
    std::fs::write(&f, text).unwrap();
    ok(dir, &["next", "--yes"]);
    let out = ok(dir, &["next", "--yes"]);
    assert!(
        out.contains("not available on this machine/build") && out.contains("unavailable here"),
        "{out}"
    );
    // Neither an error that asks to run `run` again nor a question to guess at: unavailable too.
    for step in ["ratio", "which"] {
        let out = ok(dir, &["next", "--yes"]);
        assert!(
            out.contains("it uses step `run`, which could not run here")
                && out.contains(&format!("Step {step}: unavailable here")),
            "{out}"
        );
    }
    let r = results(dir);
    let attempt = |step: &str| {
        r["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["step"] == step)
            .unwrap()
            .clone()
    };
    let a = attempt("run");
    assert_eq!(a["outcome"], "unavailable");
    assert!(
        a["metrics"].as_object().unwrap().is_empty(),
        "no numbers are made up: {a}"
    );
    assert_eq!(attempt("ratio")["outcome"], "unavailable");
    assert_eq!(attempt("which")["answer"], Value::Null);
    // The course goes on.
    assert!(ok(dir, &["status"]).contains("01-second"));
}

const PROFILE_EXERCISE: &str = r#"format_version = 1
id = "00-first"
title = "Profile"
chapter = "00-first.md"

[[step]]
id = "prof"
kind = "profile"
say = "Every kernel timed."
bench = { network = "resnet18", batch_size = 1, iterations = 2, warmup = 0, input_size = 64 }
profile = { depth = 1, top = 3, files = true }

[[step.expect]]
metric = "op.conv2d.time_pct"
min = 30.0
hint = "Convolutions do the arithmetic."

[[step]]
id = "which"
kind = "question"
say = "Read the module table."
question = { prompt = "More FLOPs per byte?", choices = ["layer1", "fc"], correct = { values = ["prof.layer1.intensity", "prof.fc.intensity"] } }
"#;

#[test]
fn profile_step_records_module_metrics_and_checks_answers() {
    let d = tempfile::tempdir().unwrap();
    let course = d.path().join("course");
    tiny_course(&course);
    std::fs::remove_file(course.join("exercises/01-second.toml")).unwrap();
    std::fs::write(course.join("exercises/00-first.toml"), PROFILE_EXERCISE).unwrap();
    let dir = d.path().join("ws");
    std::fs::create_dir_all(&dir).unwrap();
    ok(
        &dir,
        &[
            "init",
            "--name",
            "Ann",
            "--course",
            course.to_str().unwrap(),
        ],
    );
    let out = ok(&dir, &["next", "--yes"]);
    assert!(
        out.contains("FLOPs profile of timed iteration")
            && out.contains("PASS         op.conv2d.time_pct"),
        "{out}"
    );
    let whole = std::fs::read_to_string(dir.join("profiles/00-first.prof.txt")).unwrap();
    assert!(whole.contains("workshop FLOPs profiler"), "{whole}");
    assert!(dir.join("profiles/00-first.prof.trace.json").exists());
    assert!(dir.join("profiles/00-first.prof.kernels.csv").exists());
    let r = results(&dir);
    recorded_metrics_are_in_the_table(&r);
    let attempt = &r["attempts"][0];
    let m = &attempt["metrics"];
    for k in [
        "layer1.latency_ms",
        "fc.gflops",
        "efficiency",
        "cpu_overhead",
        "op.conv2d.time_pct",
    ] {
        assert!(m[k].as_f64().is_some(), "no {k} in {m}");
    }
    // The module table is part of the results.
    assert_eq!(attempt["table"]["header"][0], "module");
    // layer1's convolutions reuse every byte far more than fc's one-image GEMM: the right
    // answer is layer1. (Arithmetic intensity, not latency: a timing would make this test
    // fail on a busy machine, as it once did when fc's 4 ms outlier beat layer1.)
    let out = ok(&dir, &["next", "--answer", "fc"]);
    assert!(
        out.contains("FAIL") && out.contains("your measurements say layer1"),
        "{out}"
    );
}

#[test]
fn profile_and_question_mistakes_are_named() {
    // A module the network does not have.
    let e = lint_one(&PROFILE_EXERCISE.replace("prof.fc.intensity", "prof.layer9.intensity"));
    assert!(
        e.contains("step `prof` has no metric `layer9.intensity`"),
        "{e}"
    );
    // Both ways of naming the right answer at once.
    let e = lint_one(&PROFILE_EXERCISE.replace(
        "correct = { values",
        "correct = { metric = \"throughput\", steps = [\"prof\", \"prof\"], values",
    ));
    assert!(
        e.contains("`correct` needs either `metric` with `steps`, or `values`"),
        "{e}"
    );
    // Fewer values than choices.
    let e = lint_one(&PROFILE_EXERCISE.replace(", \"prof.fc.intensity\"", ""));
    assert!(e.contains("correct has 1 entries for 2 choices"), "{e}");
    // A chart of a step that keeps no record.
    let e = lint_one(&format!(
        "{PROFILE_EXERCISE}\n[[step]]\nid = \"c\"\nkind = \"chart\"\nsay = \"x\"\nchart = {{ steps = [\"prof\", \"which\"] }}\n"
    ));
    assert!(e.contains("`which` is not a bench or profile step"), "{e}");
    // A profile section on a step that is not a profile.
    let e = lint_one(&PROFILE_EXERCISE.replace("kind = \"profile\"", "kind = \"bench\""));
    assert!(
        e.contains("only a `profile` step takes a `profile` section"),
        "{e}"
    );
}

/// Issue 27, class 1: ids and chapters from a course pack are names, never paths. A step id
/// that climbs out, a chapter outside the book (relative, absolute, or a link), and
/// `dev new ../x` are refused with the place to fix, and nothing is written outside.
#[test]
fn course_data_never_names_a_path_outside() {
    let ex = |step: &str, chapter: &str| {
        format!(
            "format_version = 1\nid = \"00-first\"\ntitle = \"First\"\nchapter = \"{chapter}\"\n\n[[step]]\nid = \"{step}\"\nkind = \"note\"\nsay = \"Hi.\"\n"
        )
    };
    let e = lint_one(&ex("../../../victim/results", "00-first.md"));
    assert!(
        e.contains("00-first.toml:7:6") && e.contains("step id `../../../victim/results` must be"),
        "{e}"
    );
    for chapter in [
        "../../../../etc/passwd",
        "/etc/passwd",
        "../exercises/00-first.toml",
    ] {
        let e = lint_one(&ex("hello", chapter));
        assert!(
            e.contains("00-first.toml:4:11") && e.contains("is not a page name"),
            "{chapter}: {e}"
        );
    }
    // A page that is a link out of the book.
    #[cfg(unix)]
    {
        let d = tempfile::tempdir().unwrap();
        let secret = d.path().join("secret.md");
        std::fs::write(&secret, "TOP SECRET").unwrap();
        let course = d.path().join("course");
        tiny_course(&course);
        std::os::unix::fs::symlink(&secret, course.join("book/src/leak.md")).unwrap();
        let f = course.join("exercises/00-first.toml");
        let text = std::fs::read_to_string(&f).unwrap();
        std::fs::write(
            &f,
            text.replace("chapter = \"00-first.md\"", "chapter = \"leak.md\""),
        )
        .unwrap();
        let o = crate::common::command()
            .args(["dev", "lint"])
            .arg(&course)
            .output()
            .unwrap();
        assert!(
            !o.status.success() && stderr(&o).contains("chapter `leak.md` leads outside the book"),
            "{}",
            stderr(&o)
        );
        let o = crate::common::command()
            .args(["book", "00-first", "--course"])
            .arg(&course)
            .arg("--dir")
            .arg(d.path())
            .output()
            .unwrap();
        assert!(!o.status.success() && !stdout(&o).contains("TOP SECRET"));
    }
    // `dev new` with a path for an id writes nothing anywhere.
    let d = tempfile::tempdir().unwrap();
    let course = d.path().join("a/b");
    std::fs::create_dir_all(&course).unwrap();
    let o = crate::common::command()
        .args(["dev", "new", "../../x", "--dir"])
        .arg(&course)
        .output()
        .unwrap();
    assert!(!o.status.success() && stderr(&o).contains("is not an exercise id"));
    let written: Vec<_> = walk(d.path());
    assert!(written.iter().all(|p| p.is_dir()), "{written:?}");
}

/// Every path under `root`.
fn walk(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

/// Issue 27, classes 2 and 4: `init` never replaces a results file that holds attempts (the
/// state folder deleted), `next` says how to get out, and two `reset --all`s in the same second
/// keep both backups.
#[test]
fn init_keeps_results_and_resets_keep_every_backup() {
    let d = tempfile::tempdir().unwrap();
    let dir = &tiny_workspace(
        d.path(),
        ("id = \"hello\"", "id = \"hello\""),
        &["--name", "Eve"],
    );
    ok(dir, &["next", "--yes"]);
    let results = std::fs::read_to_string(dir.join("results.json")).unwrap();
    assert!(results.contains("\"step\": \"hello\""), "{results}");
    std::fs::remove_dir_all(dir.join(".workshop")).unwrap();
    let o = ws(dir, &["next", "--yes"]);
    assert!(
        !o.status.success()
            && stderr(&o).contains("holds 1 recorded attempt(s)")
            && stderr(&o).contains("reset --all"),
        "{}",
        stderr(&o)
    );
    let o = ws(dir, &["init", "--name", "Eve"]);
    assert!(
        !o.status.success() && stderr(&o).contains("`init` would replace them"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("results.json")).unwrap(),
        results
    );
    // Two resets in quick succession: every file moved aside is kept.
    ok(dir, &["reset", "--all"]);
    ok(
        dir,
        &[
            "init",
            "--name",
            "Eve",
            "--course",
            d.path().join("course").to_str().unwrap(),
        ],
    );
    ok(dir, &["reset", "--all"]);
    let backups = std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("results.json.bak-")
        })
        .count();
    assert_eq!(backups, 2);
}

/// Issue 27, class 3: a derived value over a zero (FP32 against itself differs by exactly 0)
/// is recorded so that results.json reads back, shown as not defined, and judged inconclusive,
/// never fatal; later commands keep working.
#[test]
fn a_ratio_over_zero_is_not_defined_and_never_fatal() {
    let zero = r#"[[step]]
id = "acc"
kind = "accuracy"
say = "FP32 against FP32: a difference of exactly zero."
bench = { network = "resnet18", batch_size = 1, precision = "fp32", input_size = 32 }

[[step]]
id = "ratio"
kind = "compare"
say = "Over a zero."
derive = [
  { name = "inf", numerator = "acc.top1_agreement", denominator = "acc.max_abs_diff" },
  { name = "nan", numerator = "acc.max_abs_diff", denominator = "acc.rel_diff" },
]

[[step.expect]]
metric = "inf"
min = 1.0
hint = "Not defined: judged inconclusive."

[[step]]
id = "hello""#;
    let d = tempfile::tempdir().unwrap();
    let dir = &tiny_workspace(
        d.path(),
        ("[[step]]\nid = \"hello\"", zero),
        &["--name", "Fay"],
    );
    ok(dir, &["next", "--yes"]);
    let out = ok(dir, &["next", "--yes"]);
    assert!(out.contains("not defined (division by zero)"), "{out}");
    let r = results(dir);
    let m = &r["attempts"][1]["metrics"];
    assert_eq!(
        (m["inf"].as_str(), m["nan"].as_str()),
        (Some("inf"), Some("NaN")),
        "{m}"
    );
    let check = &r["attempts"][1]["checks"][0];
    assert_eq!(check["verdict"], "inconclusive", "{check}");
    assert!(
        check["reason"].as_str().unwrap().contains("not defined"),
        "{check}"
    );
    // Every later command still reads the results.
    for args in [
        &["status"][..],
        &["results"],
        &["results", "--export", "csv"],
        &["next", "--yes"],
    ] {
        ok(dir, args);
    }
    assert!(
        std::fs::read_to_string(dir.join("results.md"))
            .unwrap()
            .contains("not defined")
    );
}

/// Issue 27, class 12 (part): commands outside a workspace create nothing, a student's name is
/// printable text, and names that look like formulas stay text in the class CSV.
#[test]
fn outside_a_workspace_nothing_is_created_and_names_stay_text() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for args in [
        &["goto", "01-baseline"][..],
        &["skip"],
        &["reset", "--all"],
        &["reset", "00-setup"],
        &["run", "00-setup"],
    ] {
        let o = ws(dir, args);
        assert!(
            !o.status.success() && stderr(&o).contains("no workshop workspace in"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    assert_eq!(
        std::fs::read_dir(dir).unwrap().count(),
        0,
        "something was created"
    );
    let o = ws(dir, &["init", "--name", "\u{1b}[31mEve"]);
    assert!(
        !o.status.success() && stderr(&o).contains("must be printable text"),
        "{}",
        stderr(&o)
    );
    // A name that a spreadsheet would run.
    let student = dir.join("class/s1");
    std::fs::create_dir_all(&student).unwrap();
    ok(&student, &["init", "--name", "=HYPERLINK(\"x\")"]);
    let csv = dir.join("class.csv");
    let o = crate::common::command()
        .args(["collect"])
        .arg(dir.join("class"))
        .arg("--csv")
        .arg(&csv)
        .output()
        .unwrap();
    let _ = o;
    let text = std::fs::read_to_string(&csv).unwrap_or_default();
    assert!(text.contains("\"'=HYPERLINK(\"\"x\"\")\""), "{text}");
}

/// A device that computes on the host's cores (lavapipe, the GPU emulator) runs a step with its
/// CPU-sized settings and says so; the CPU backend runs them without a word.
#[test]
fn software_gpus_take_the_cpu_sized_settings() {
    use workshop::backend::BackendKind;
    let sized = (
        "batch_size = 1, iterations = 2, warmup = 0, input_size = 32 }",
        "batch_size = 3, iterations = 2, warmup = 0, input_size = 32, cpu = { batch_size = 1 } }",
    );
    for kind in [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda] {
        let devices = workshop::backend::open(kind).map(|b| b.devices());
        let Some(device) = devices.iter().flatten().next() else {
            crate::common::skip(kind, "no device");
            continue;
        };
        if kind != BackendKind::Cpu && !device.is_software() {
            eprintln!("{kind} has a real GPU here: its sizes are the GPU's");
            continue;
        }
        let d = tempfile::tempdir().unwrap();
        let init = ["--name", "Ann", "--backend", kind.name()];
        let dir = &tiny_workspace(d.path(), sized, &init);
        ok(dir, &["next", "--yes"]);
        let out = ok(dir, &["next", "--yes"]);
        assert!(out.contains("batch 1 (32×32)"), "{kind}: {out}");
        assert_eq!(
            out.contains("this step runs with its CPU-sized settings"),
            kind != BackendKind::Cpu,
            "{kind}: {out}"
        );
    }
}

/// A profile step shows a summary that fits beside the question after it, and keeps the whole
/// profile in profiles/; `--verbose` prints it whole.
#[test]
fn profile_steps_summarise_and_keep_the_whole_profile() {
    let d = tempfile::tempdir().unwrap();
    let dir = &tiny_workspace(d.path(), ("", ""), &["--name", "Flo"]);
    let f = d.path().join("course/exercises/00-first.toml");
    let mut text = std::fs::read_to_string(&f).unwrap();
    text.push_str(
        r#"
[[step]]
id = "prof"
kind = "profile"
say = "A profile."
hint = "Read the tables."
bench = { network = "resnet18", batch_size = 1, iterations = 2, warmup = 0, input_size = 32 }
profile = { depth = 2, top = 8 }
"#,
    );
    std::fs::write(&f, text).unwrap();
    let out = ok(dir, &["run", "00-first.prof"]);
    let whole = dir.join("profiles/00-first.prof.txt");
    assert!(
        out.contains("Operators over 2 iterations")
            && out.contains("│ stage")
            && out.contains("Top 5 layers by fwd latency")
            && !out.contains("Detailed profile")
            && !out.contains("Kernels:")
            && out.contains("The full profile (every kernel, the module tree, every layer)"),
        "{out}"
    );
    let kept = std::fs::read_to_string(&whole).unwrap();
    assert!(
        kept.contains("Kernels:") && kept.contains("Detailed profile") && kept.contains("layer1.0"),
        "{kept}"
    );
    let out = ok(dir, &["run", "00-first.prof", "--verbose"]);
    assert!(
        out.contains("Detailed profile") && out.contains("Saved to"),
        "{out}"
    );
}

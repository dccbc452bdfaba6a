//! The course as text: exercise and step headers, verdicts, status and lists, the one-line
//! summary of an attempt, the results CSV, and the exercise scaffold.

use comfy_table::{Cell, CellAlignment};

use crate::course::state::ResultTable;

use super::new_table;
use crate::units::csv_field;
use crate::units::number;

/// A step's table.
pub fn table(t: &ResultTable) -> String {
    let mut out = new_table();
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
        super::for_terminal(step.say.trim())
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
    let again = format!("workshop run {}.{}", a.exercise, a.step);
    let kernel = a.kind == crate::course::schema::StepKind::Kernel;
    let outcome = match a.outcome {
        Outcome::Pass => "passed".to_string(),
        // A kernel step stays current: the line after this one says how to go on.
        Outcome::Fail if kernel => "not yet (recorded)".to_string(),
        Outcome::Inconclusive if kernel => "inconclusive (recorded)".to_string(),
        Outcome::Fail => format!("failed (recorded; re-run it with `{again}`, or go on)"),
        Outcome::Inconclusive => {
            format!("inconclusive (recorded; re-run it on a quieter machine to judge: `{again}`)")
        }
        Outcome::Skipped => "skipped".to_string(),
        Outcome::Unavailable => "unavailable here (recorded as such)".to_string(),
    };
    s.push_str(&format!("Step {}: {outcome}.", a.step));
    s
}

/// What comes after a step; `dir` is the ` --dir DIR` the commands need where the workspace is
/// not the current folder.
pub fn what_next(exercise: &str, finished: bool, upcoming: Option<&str>, dir: &str) -> String {
    match (finished, upcoming) {
        (true, Some(next)) => {
            format!("{exercise} is done. Next: {next} — `workshop next{dir}`.")
        }
        (true, None) => format!(
            "{exercise} is done, and with it the course. See your worksheet: `workshop results{dir}`."
        ),
        (false, Some(next)) => format!("Next: {next} — `workshop next{dir}`."),
        (false, None) => format!("`workshop next{dir}` continues."),
    }
}

/// After a kernel step that has not passed: it stays current, and how to go on.
pub fn kernel_again(step: &crate::course::schema::Step) -> String {
    let file = (step.kernel.as_ref()).map_or("your kernel".to_string(), |k| {
        format!("kernels/{}", k.get_ref().file)
    });
    format!(
        "This step stays current until your kernel passes: edit {file} and run `workshop next` \
         again, or `workshop watch`, which checks it each time you save. `workshop hint` gives a \
         hint; `workshop skip` moves on."
    )
}

/// The last screen: what the steps came to, and how to re-run what failed.
pub fn course_done(
    student: &str,
    tally: &crate::course::state::Tally,
    results: &std::path::Path,
) -> String {
    let opening = match tally.failed {
        0 => format!("Well done, {student}: every exercise is done or skipped."),
        _ => format!(
            "{student}, you reached the end of the course: every exercise is done or skipped."
        ),
    };
    format!(
        "{opening}\nSteps: {}.{}\nYour worksheet is {}.",
        tally.summary(),
        rerun_failed(tally),
        results.display()
    )
}

/// `\nRe-run what failed: `workshop run 02-precision.fp16` …` (the first five), or nothing.
fn rerun_failed(tally: &crate::course::state::Tally) -> String {
    if tally.failed_steps.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = (tally.failed_steps.iter().take(5))
        .map(|s| format!("`workshop run {s}`"))
        .collect();
    let more = tally.failed_steps.len().saturating_sub(5);
    let more = match more {
        0 => String::new(),
        n => format!(" and {n} more (`workshop results` lists them)"),
    };
    format!("\nRe-run what failed: {}{more}", shown.join(", "))
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
    /// How its steps came out (latest attempts).
    pub tally: crate::course::state::Tally,
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
    let mut t = new_table();
    t.set_header(vec!["", "exercise", "title", "status", "steps", "results"]);
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
            match r.tally.summary().as_str() {
                "no steps run" => String::new(),
                s => s.to_string(),
            },
        ]);
    }
    let all: crate::course::state::Tally = rows.iter().map(|r| r.tally.clone()).sum();
    format!(
        "{} · backend {} device {}\n[{}{}] {finished}/{} exercises · steps: {}\n{t}{}",
        state.student,
        state.backend,
        state.device,
        "#".repeat(filled),
        ".".repeat(width - filled),
        rows.len(),
        all.summary(),
        rerun_failed(&all),
    )
}

pub fn exercise_list(rows: &[(String, String, String, String)]) -> String {
    let mut t = new_table();
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
    if let Some(v) = get("per_joule") {
        parts.push(format!("{v:.2} per joule"));
    }
    if get("unsteady") == Some(1.0) {
        parts.push("machine not steady (timing checks inconclusive)".into());
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
        let (ex, step) = (csv_field(&a.exercise), csv_field(&a.step));
        if a.metrics.is_empty() {
            s.push_str(&format!("{ex},{step},{outcome},,,{}\n", a.finished));
        }
        for (k, v) in &a.metrics {
            s.push_str(&format!(
                "{ex},{step},{outcome},{},{v},{}\n",
                csv_field(k),
                a.finished
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
hint = "What to do when this step will not run or its numbers look wrong."
bench = {{ network = "resnet50", batch_size = 32, iterations = 20, cpu = {{ batch_size = 4, iterations = 5 }} }}
max_cv = 0.15

[[step.expect]]
metric = "throughput"
min = 1.0
hint = "What to try when the number is out of range."
"#
    )
}

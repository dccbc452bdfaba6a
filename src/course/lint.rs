//! Checking a course before anyone runs it: TOML syntax and unknown fields, then the meaning
//! (unique ids, `requires` that resolve and do not form a cycle, chapters that exist, sections
//! that match each step's kind, networks in the zoo, sane ranges, hints present, metrics that
//! name something a step produces), and for a course in a folder its book (SUMMARY.md lists
//! the introduction and every chapter). Every problem is reported with file:line:col. Errors
//! keep a course from loading; warnings (a step without a hint, a chapter the book's summary
//! leaves out) are reported by `workshop dev lint` and do not.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Range;

use super::schema::{Exercise, FORMAT_VERSION, Step, StepKind};
use super::{LoadedExercise, Source, chapter_text};
use crate::model::zoo;

/// How much a problem matters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Severity {
    /// The course cannot be loaded with it.
    #[default]
    Error,
    /// Worth mending; the course runs without.
    Warning,
}

/// One problem, at a place in a file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diagnostic {
    pub path: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
    pub severity: Severity,
}

impl Diagnostic {
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let level = match self.severity {
            Severity::Error => "",
            Severity::Warning => "warning: ",
        };
        write!(
            f,
            "{}:{}:{}: {level}{}",
            self.path, self.line, self.col, self.message
        )
    }
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

struct Linter<'a> {
    path: &'a str,
    text: &'a str,
    out: Vec<Diagnostic>,
}

impl Linter<'_> {
    fn at(&mut self, span: Range<usize>, message: impl Into<String>) {
        self.push(span, message.into(), Severity::Error);
    }

    fn warn(&mut self, span: Range<usize>, message: impl Into<String>) {
        self.push(span, message.into(), Severity::Warning);
    }

    fn push(&mut self, span: Range<usize>, message: String, severity: Severity) {
        let (line, col) = line_col(self.text, span.start);
        self.out.push(Diagnostic {
            path: self.path.to_string(),
            line,
            col,
            message,
            severity,
        });
    }
}

/// Parse and check every file; returns the exercises that parsed (in id order) and every
/// problem found.
pub fn check(
    source: &Source,
    files: &[(String, String)],
) -> (Vec<LoadedExercise>, Vec<Diagnostic>) {
    let mut diags = Vec::new();
    let mut loaded = Vec::new();
    for (path, text) in files {
        match toml::from_str::<Exercise>(text) {
            Ok(exercise) => loaded.push(LoadedExercise {
                path: path.clone(),
                text: text.clone(),
                exercise,
            }),
            Err(e) => {
                let (line, col) = e.span().map_or((1, 1), |s| line_col(text, s.start));
                let message = e.message().trim().replace('\n', " ");
                diags.push(Diagnostic {
                    path: path.clone(),
                    line,
                    col,
                    message,
                    ..Diagnostic::default()
                });
            }
        }
    }
    if files.is_empty() {
        diags.push(Diagnostic {
            path: "exercises/".into(),
            line: 1,
            col: 1,
            message: "the course has no exercises".into(),
            ..Diagnostic::default()
        });
    }
    loaded.sort_by(|a, b| a.id().cmp(b.id()));
    let ids: HashSet<String> = loaded.iter().map(|e| e.id().to_string()).collect();
    let mut seen: HashMap<String, String> = HashMap::new();
    for ex in &loaded {
        let mut l = Linter {
            path: &ex.path,
            text: &ex.text,
            out: Vec::new(),
        };
        check_exercise(&mut l, ex, source, &ids);
        if let Some(first) = seen.insert(ex.id().to_string(), ex.path.clone()) {
            l.at(
                ex.exercise.id.span(),
                format!("exercise id `{}` is already used by {first}", ex.id()),
            );
        }
        diags.extend(l.out);
    }
    diags.extend(check_cycles(&loaded));
    if let Source::Dir(dir) = source {
        diags.extend(check_book(dir, &loaded));
    }
    (loaded, diags)
}

/// A course folder's book: `book/src/SUMMARY.md` (what `mdbook build` turns into the book)
/// lists pages that exist and every exercise's chapter, and the introduction is there. All
/// warnings: `workshop book` reads the chapters without the summary.
fn check_book(dir: &std::path::Path, loaded: &[LoadedExercise]) -> Vec<Diagnostic> {
    let book = super::book_dir(dir);
    let shown = |name: &str| book.join(name).display().to_string();
    let warn = |path: String, (line, col), message: String| Diagnostic {
        path,
        line,
        col,
        message,
        severity: Severity::Warning,
    };
    let mut out = Vec::new();
    if !book.join("introduction.md").is_file() {
        out.push(warn(
            shown("introduction.md"),
            (1, 1),
            "missing: the book's first page (`workshop book introduction` shows it)".into(),
        ));
    }
    let Ok(summary) = std::fs::read_to_string(book.join("SUMMARY.md")) else {
        out.push(warn(
            shown("SUMMARY.md"),
            (1, 1),
            "missing: `mdbook build book` makes the book from it; list the introduction and every chapter".into(),
        ));
        return out;
    };
    // Every `](page.md)` link, with where it starts.
    let mut listed = HashSet::new();
    for (at, page) in super::book::summary_links(&summary) {
        listed.insert(page.to_string());
        if super::chapter_path(dir, page).is_err() {
            out.push(warn(
                shown("SUMMARY.md"),
                line_col(&summary, at),
                format!("`{page}` is not a page of book/src/"),
            ));
        }
    }
    for ex in loaded {
        let page = ex.exercise.chapter.get_ref();
        if !listed.contains(page.as_str()) {
            out.push(warn(
                ex.path.clone(),
                line_col(&ex.text, ex.exercise.chapter.span().start),
                format!("chapter `{page}` is not listed in book/src/SUMMARY.md: the built book leaves it out"),
            ));
        }
    }
    out
}

fn check_exercise(l: &mut Linter<'_>, ex: &LoadedExercise, source: &Source, ids: &HashSet<String>) {
    check_header(l, ex, source, ids);
    let e = &ex.exercise;
    // Metrics each earlier step makes available, by step id.
    let mut known: HashMap<String, Vec<String>> = HashMap::new();
    for step in &e.steps {
        let sid = step.id.get_ref().clone();
        if !crate::files::is_plain_id(&sid) {
            l.at(
                step.id.span(),
                format!(
                    "step id `{sid}` must be lowercase letters, digits, `-` and `_` (at most 64): it names files in the workspace"
                ),
            );
        }
        if known.contains_key(&sid) {
            l.at(
                step.id.span(),
                format!("step id `{sid}` is used twice in this exercise"),
            );
        }
        if step.hint.as_deref().is_none_or(|h| h.trim().is_empty()) {
            l.warn(
                step.id.span(),
                format!("step `{sid}` has no hint: `workshop hint` has nothing to offer a student stuck on it"),
            );
        }
        check_sections(l, e, step);
        check_kernel(l, step, source);
        let mut produced = produced_metrics(step);
        check_derive(l, step, &known);
        produced.extend(step.derive.iter().map(|d| d.get_ref().name.clone()));
        check_question(l, step, &known);
        check_expects(l, step, &known, &produced);
        known.insert(sid, produced);
    }
}

/// The exercise's own fields: format version, id, file name, chapter, requirements, steps.
fn check_header(l: &mut Linter<'_>, ex: &LoadedExercise, source: &Source, ids: &HashSet<String>) {
    let e = &ex.exercise;
    if *e.format_version.get_ref() != FORMAT_VERSION {
        l.at(
            e.format_version.span(),
            format!(
                "format_version {} is not supported: this build reads {FORMAT_VERSION}",
                e.format_version.get_ref()
            ),
        );
    }
    let id = e.id.get_ref();
    let well_formed = id.len() > 3
        && id.as_bytes()[..2].iter().all(u8::is_ascii_digit)
        && id.as_bytes()[2] == b'-';
    if !well_formed
        || !crate::files::is_plain_id(id)
        || !id
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        l.at(
            e.id.span(),
            format!("id `{id}` must look like `NN-name` (two digits, a dash, lowercase letters)"),
        );
    }
    if let Source::Dir(_) = source {
        let stem = std::path::Path::new(&ex.path)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("");
        if stem != id {
            l.at(
                e.id.span(),
                format!("id `{id}` does not match the file name `{stem}.toml`"),
            );
        }
    }
    let page = e.chapter.get_ref();
    let outside = match source {
        Source::Dir(dir) => super::chapter_path(dir, page).err(),
        Source::Embedded => {
            (!super::is_page_name(page)).then(|| format!("`{page}` is not a page name"))
        }
    };
    if let Some(why) = outside {
        l.at(e.chapter.span(), why);
    } else if chapter_text(source, page).is_none() {
        l.at(
            e.chapter.span(),
            format!("chapter `{page}` does not exist in the book (book/src/)"),
        );
    }
    for r in &e.requires {
        if !ids.contains(r.get_ref()) {
            l.at(
                r.span(),
                format!(
                    "requires `{}`, which is not an exercise of this course",
                    r.get_ref()
                ),
            );
        } else if r.get_ref() == id {
            l.at(r.span(), "an exercise cannot require itself");
        }
    }
    if e.steps.is_empty() {
        l.at(e.id.span(), "the exercise has no [[step]]");
    }
}

/// The sections a step has for its kind: those it needs, none it does not take, and their
/// values.
fn check_sections(l: &mut Linter<'_>, e: &Exercise, step: &Step) {
    let needs =
        |what: &str| format!("a `{:?}` step needs a `{what}` section", step.kind).to_lowercase();
    let has_bench = step.bench.is_some();
    match step.kind {
        StepKind::Bench
        | StepKind::Accuracy
        | StepKind::Sweep
        | StepKind::Profile
        | StepKind::Llm
            if !has_bench =>
        {
            l.at(step.id.span(), needs("bench"))
        }
        StepKind::Sweep if step.sweep.is_none() => l.at(step.id.span(), needs("sweep")),
        StepKind::Compare if step.derive.is_empty() => l.at(step.id.span(), needs("derive")),
        StepKind::Question if step.question.is_none() => l.at(step.id.span(), needs("question")),
        StepKind::Kernel if !has_bench => l.at(step.id.span(), needs("bench")),
        _ => {}
    }
    let allowed_bench = matches!(
        step.kind,
        StepKind::Bench
            | StepKind::Accuracy
            | StepKind::Sweep
            | StepKind::Profile
            | StepKind::Llm
            | StepKind::Kernel
    );
    if step.chart.is_some() != (step.kind == StepKind::Chart) {
        l.at(
            step.id.span(),
            "a `chart` step, and only a `chart` step, has a `chart` section",
        );
    }
    if let Some(c) = &step.chart {
        let steps = &c.get_ref().steps;
        if steps.len() < 2 {
            l.at(c.span(), "a chart compares at least two steps");
        }
        for sid in steps {
            let earlier = e
                .steps
                .iter()
                .take_while(|x| x.id.get_ref() != step.id.get_ref());
            match earlier.clone().find(|x| x.id.get_ref() == sid) {
                Some(x) if matches!(x.kind, StepKind::Bench | StepKind::Profile) => {}
                Some(_) => l.at(
                    c.span(),
                    format!(
                        "`{sid}` is not a bench or profile step: it keeps no record to compare"
                    ),
                ),
                None => l.at(
                    c.span(),
                    format!("`{sid}` is not an earlier step of this exercise"),
                ),
            }
        }
    }
    if step.profile.is_some() && step.kind != StepKind::Profile {
        l.at(
            step.id.span(),
            "only a `profile` step takes a `profile` section",
        );
    }
    if has_bench && !allowed_bench {
        l.at(
            step.id.span(),
            format!("a `{:?}` step does not take a `bench` section", step.kind).to_lowercase(),
        );
    }
    if let Some(b) = &step.bench {
        let llm = step.kind == StepKind::Llm;
        check_bench(l, b.span(), b.get_ref(), llm);
        if let Some(cpu) = &b.get_ref().cpu {
            check_bench(l, b.span(), cpu, llm);
        }
        let (span, b) = (b.span(), b.get_ref());
        // A scenario's settings without one (in the run or its cpu overrides) do nothing.
        let settings = |b: &super::schema::BenchSpec| {
            b.queries.is_some()
                || b.duration_s.is_some()
                || b.latency_bound_ms.is_some()
                || b.batch_timeout_ms.is_some()
                || b.qps.is_some()
        };
        let cpu = b.cpu.as_deref();
        if b.scenario.is_none()
            && cpu.is_none_or(|c| c.scenario.is_none())
            && (settings(b) || cpu.is_some_and(settings))
        {
            l.at(
                span,
                "queries, duration_s, latency_bound_ms, batch_timeout_ms and qps are for a `scenario`",
            );
        }
    }
    if let Some(s) = &step.sweep {
        use super::schema::SweepParam;
        let ok = match step.kind {
            StepKind::Llm => matches!(
                s.get_ref().param,
                SweepParam::BatchSize | SweepParam::PromptLen
            ),
            _ => matches!(
                s.get_ref().param,
                SweepParam::BatchSize | SweepParam::InputSize
            ),
        };
        if !ok {
            l.at(
                s.span(),
                "a `sweep` step sweeps batch_size or input_size; an `llm` step batch_size or prompt_len",
            );
        }
        if !matches!(step.kind, StepKind::Sweep | StepKind::Llm) {
            l.at(
                s.span(),
                "only `sweep` and `llm` steps take a `sweep` section",
            );
        }
        let sw = s.get_ref();
        if sw.values.is_empty()
            || sw.values.contains(&0)
            || sw
                .cpu_values
                .as_ref()
                .is_some_and(|v| v.is_empty() || v.contains(&0))
        {
            l.at(
                s.span(),
                "sweep values must be a non-empty list of positive numbers",
            );
        }
        for r in &sw.reference {
            if r.ms.len() != sw.values.len() || r.ms.iter().any(|v| !(*v > 0.0 && v.is_finite())) {
                l.at(
                    s.span(),
                    format!(
                        "reference `{}` needs one positive time (ms) per sweep value: {} values, {} times",
                        r.label,
                        sw.values.len(),
                        r.ms.len()
                    ),
                );
            }
        }
        if !sw.reference.is_empty()
            && let Some(cpu) = &sw.cpu_values
            && let Some(v) = cpu.iter().find(|v| !sw.values.contains(v))
        {
            l.at(
                s.span(),
                format!("cpu value {v} has no published time: a sweep with a reference takes cpu_values from its values"),
            );
        }
        if sw.reference_batch == Some(0) {
            l.at(s.span(), "reference_batch must be positive");
        }
    }
    if step.peak.is_some() && step.kind != StepKind::Peak {
        l.at(step.id.span(), "only a `peak` step takes a `peak` section");
    }
    if let Some(pk) = &step.peak {
        let spec = pk.get_ref();
        let all = std::iter::once(spec).chain(spec.cpu.as_deref());
        if all
            .flat_map(|s| [s.size, s.iterations, s.array_mib])
            .any(|v| v == Some(0))
        {
            l.at(pk.span(), "peak sizes and iterations must be at least 1");
        }
    }
    if let Some(max_cv) = step.max_cv
        && !(max_cv > 0.0 && max_cv < 1.0)
    {
        l.at(
            step.id.span(),
            format!("max_cv {max_cv} must be between 0 and 1 (0.10 is 10%)"),
        );
    }
}

/// A `kernel` step's section, and only a kernel step's: a WGSL file of the engine, a start
/// file the course has, an entry point and a speedup to reach.
fn check_kernel(l: &mut Linter<'_>, step: &Step, source: &Source) {
    if step.kernel.is_some() != (step.kind == StepKind::Kernel) {
        l.at(
            step.id.span(),
            "a `kernel` step, and only a `kernel` step, has a `kernel` section",
        );
    }
    let Some(k) = &step.kernel else { return };
    let spec = k.get_ref();
    if !(spec.file.starts_with("wgsl/")
        && crate::backend::kernel_files::embedded(&spec.file).is_some())
    {
        let wgsl: Vec<&str> = (crate::backend::kernel_files::FILES.iter())
            .map(|(p, _)| *p)
            .filter(|p| p.starts_with("wgsl/"))
            .collect();
        l.at(
            k.span(),
            format!(
                "kernel file `{}` is not one of the engine's WGSL files ({})",
                spec.file,
                wgsl.join(", ")
            ),
        );
    }
    if let Err(why) = super::start_text(source, &spec.start) {
        l.at(k.span(), format!("kernel start `{}`: {why}", spec.start));
    }
    if !crate::files::is_plain_id(&spec.entry) {
        l.at(
            k.span(),
            format!("kernel entry `{}` is not an entry point's name", spec.entry),
        );
    }
    if !(spec.speedup.is_finite() && spec.speedup > 1.0) {
        l.at(
            k.span(),
            format!(
                "kernel speedup {} must be above 1: how many times faster than the start the student's kernel must be",
                spec.speedup
            ),
        );
    }
}

/// The metrics a step records, as expectations and later steps may name them (a compare
/// step's derived names come on top).
fn produced_metrics(step: &Step) -> Vec<String> {
    let mut produced: Vec<String> = super::metrics::names_of(step.kind)
        .map(String::from)
        .collect();
    if step.kind == StepKind::Peak {
        produced.extend(crate::bench::peak::PROBES.map(|k| format!("{k}_gbps")));
    }
    if let Some(c) = &step.chart {
        for sid in c.get_ref().steps.iter().skip(1) {
            produced.extend(["ratio", "faster", "slower", "unclear"].map(|m| format!("{sid}.{m}")));
        }
    }
    if step.kind == StepKind::Profile
        && let Some(b) = &step.bench
        && let Ok(graph) = zoo::build(b.get_ref().network.as_deref().unwrap_or("resnet50"))
    {
        produced.extend(crate::bench::flops::metric_names(&graph));
    }
    produced
}

/// A compare step's numerators and denominators name earlier steps' metrics.
fn check_derive(l: &mut Linter<'_>, step: &Step, known: &HashMap<String, Vec<String>>) {
    for d in &step.derive {
        for reference in [&d.get_ref().numerator, &d.get_ref().denominator] {
            if let Err(m) = resolve(reference, known, None) {
                l.at(d.span(), m);
            }
        }
    }
}

/// Names joined for a message, or `none`.
fn listed(names: &[String]) -> String {
    match names.is_empty() {
        true => "none".into(),
        false => names.join(", "),
    }
}

/// A question has choices and a `correct` that names one earlier metric per choice.
fn check_question(l: &mut Linter<'_>, step: &Step, known: &HashMap<String, Vec<String>>) {
    if let Some(q) = &step.question {
        let q_ref = q.get_ref();
        if q_ref.choices.len() < 2 {
            l.at(q.span(), "a question needs at least two choices");
        }
        if q_ref.correct.is_none() {
            l.at(
                q.span(),
                "a question needs `correct`: which earlier metrics decide the answer (`values = [\"STEP.metric\", ...]`, one per choice), so the student's own data judges it",
            );
        }
        if let Some(c) = &q_ref.correct {
            let by_steps = !c.metric.is_empty() || !c.steps.is_empty();
            if by_steps != c.values.is_empty() {
                l.at(
                    q.span(),
                    "`correct` needs either `metric` with `steps`, or `values` (a STEP.metric per choice)",
                );
            }
            let refs = c.references();
            if refs.len() != q_ref.choices.len() {
                l.at(
                    q.span(),
                    format!(
                        "correct has {} entries for {} choices",
                        refs.len(),
                        q_ref.choices.len()
                    ),
                );
            }
            for r in &refs {
                if let Err(m) = resolve(r, known, None) {
                    l.at(q.span(), m);
                }
            }
        }
    }
}

/// Each expectation names a metric this or an earlier step records, has sound ranges, valid
/// device globs and a hint.
fn check_expects(
    l: &mut Linter<'_>,
    step: &Step,
    known: &HashMap<String, Vec<String>>,
    produced: &[String],
) {
    for ex in &step.expects {
        let x = ex.get_ref();
        if let Err(m) = resolve(&x.metric, known, Some(produced)) {
            l.at(ex.span(), m);
        }
        if let Some(per) = &x.per
            && let Err(m) = resolve(per, known, Some(produced))
        {
            l.at(ex.span(), m);
        }
        let ranges = std::iter::once((x.min, x.max))
            .chain(x.device.iter().map(|d| (d.min, d.max)))
            .chain(x.backend.iter().map(|b| (b.min, b.max)));
        for (min, max) in ranges {
            if let (Some(a), Some(b)) = (min, max)
                && a > b
            {
                l.at(ex.span(), format!("range min {a} is above max {b}"));
            }
        }
        if x.min.is_none() && x.max.is_none() {
            l.at(ex.span(), "an expectation needs a fallback `min` or `max` (device and backend ranges may refine it)");
        }
        for d in &x.device {
            if glob::Pattern::new(&d.glob).is_err() {
                l.at(ex.span(), format!("`{}` is not a valid glob", d.glob));
            }
        }
        if x.hint.trim().is_empty() {
            l.at(
                ex.span(),
                "an expectation needs a hint: what should a student try when it fails?",
            );
        }
    }
}

/// A `bench` section's sizes and network (`llm`: a step of kind `llm`, which runs language
/// models and nothing else).
fn check_bench(l: &mut Linter<'_>, span: Range<usize>, b: &super::schema::BenchSpec, llm: bool) {
    use crate::model::llm as decoders;
    if let Some(sc) = b.scenario {
        let c = crate::bench::scenario::ScenarioConfig::new(
            sc,
            true,
            b.queries,
            b.duration_s,
            b.latency_bound_ms,
            b.batch_timeout_ms,
            b.qps,
        );
        if let Err(e) = c.validate() {
            l.at(span.clone(), e.to_string().replace("--", ""));
        }
        if b.qps.is_some() && sc != crate::bench::scenario::Scenario::Server {
            l.at(span.clone(), "qps is for the `server` scenario");
        }
    }
    match &b.network {
        Some(n) if llm && !decoders::is_decoder(n) => l.at(
            span.clone(),
            format!(
                "`{n}` is not a language model ({})",
                decoders::names().join(", ")
            ),
        ),
        Some(n) if !llm && decoders::is_decoder(n) => l.at(
            span.clone(),
            format!("`{n}` is a language model: run it in a step of kind `llm`"),
        ),
        Some(n) if !llm && zoo::layer::is_layer_spec(n) => {
            if let Err(e) = zoo::build(n) {
                l.at(span.clone(), e.to_string());
            }
        }
        Some(n) if !llm && zoo::build(n).is_err() => l.at(
            span.clone(),
            format!(
                "network `{n}` is not in the zoo ({})",
                zoo::NETWORKS.join(", ")
            ),
        ),
        None if llm => l.at(
            span.clone(),
            "an `llm` step names its language model (`network`)",
        ),
        _ => {}
    }
    if !llm && (b.prompt_len.is_some() || b.gen_len.is_some()) {
        l.at(span.clone(), "prompt_len and gen_len are for `llm` steps");
    }
    // (name, value, whether 0 is allowed): the bounds `workshop bench` checks too.
    for (name, v, zero_ok) in [
        ("batch_size", b.batch_size, false),
        ("iterations", b.iterations, false),
        ("warmup", b.warmup, true),
        ("input_size", b.input_size, false),
        ("cpu_groups", b.cpu_groups, false),
        ("prompt_len", b.prompt_len, false),
        ("gen_len", b.gen_len, false),
    ] {
        match v {
            Some(0) if !zero_ok => l.at(span.clone(), format!("{name} must be at least 1")),
            Some(v) => {
                if let Err(why) = crate::bench::within_limit(name, v) {
                    l.at(span.clone(), format!("{name}: {why}"));
                }
            }
            None => {}
        }
    }
}

/// Check a metric reference: `metric` (this step's, when `own` is given) or `STEP.metric`
/// (an earlier step's).
fn resolve(
    reference: &str,
    known: &HashMap<String, Vec<String>>,
    own: Option<&[String]>,
) -> Result<(), String> {
    // The step's own metrics may have dots in their names (`op.conv2d.time_pct`).
    if own.is_some_and(|ms| ms.iter().any(|m| m == reference)) {
        return Ok(());
    }
    match reference.split_once('.') {
        Some((step, metric)) => match known.get(step) {
            None => Err(format!(
                "`{reference}` names step `{step}`, which is not an earlier step of this exercise"
            )),
            Some(ms) if !ms.iter().any(|m| m == metric) => Err(format!(
                "step `{step}` has no metric `{metric}` (it has: {})",
                listed(ms)
            )),
            Some(_) => Ok(()),
        },
        None => match own {
            Some(ms) if ms.iter().any(|m| m == reference) => Ok(()),
            Some(ms) => Err(format!(
                "this step has no metric `{reference}` (it has: {})",
                listed(ms)
            )),
            None => Err(format!(
                "`{reference}` must name an earlier step's metric as STEP.metric"
            )),
        },
    }
}

/// `requires` must not loop.
fn check_cycles(exercises: &[LoadedExercise]) -> Vec<Diagnostic> {
    let deps: HashMap<&str, Vec<&str>> = exercises
        .iter()
        .map(|e| {
            (
                e.id(),
                e.exercise
                    .requires
                    .iter()
                    .map(|r| r.get_ref().as_str())
                    .collect(),
            )
        })
        .collect();
    let mut out = Vec::new();
    for ex in exercises {
        // Depth-first search from this exercise; reaching it again is a cycle.
        let mut stack: Vec<(&str, Vec<&str>)> = vec![(ex.id(), vec![ex.id()])];
        let mut visited = HashSet::new();
        while let Some((node, path)) = stack.pop() {
            for &next in deps.get(node).map(|v| v.as_slice()).unwrap_or(&[]) {
                if next == ex.id() {
                    let (line, col) = ex
                        .exercise
                        .requires
                        .first()
                        .map_or((1, 1), |r| line_col(&ex.text, r.span().start));
                    let mut cycle = path.clone();
                    cycle.push(next);
                    out.push(Diagnostic {
                        path: ex.path.clone(),
                        line,
                        col,
                        message: format!("`requires` forms a cycle: {}", cycle.join(" → ")),
                        ..Diagnostic::default()
                    });
                    stack.clear();
                    break;
                }
                if visited.insert(next) {
                    let mut p = path.clone();
                    p.push(next);
                    stack.push((next, p));
                }
            }
        }
    }
    out
}

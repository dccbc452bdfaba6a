//! The course: exercises written in TOML (embedded in the binary, or read from a course
//! directory with `--course DIR`), checked by [`lint`] before anything runs, executed step by
//! step by [`runner`], with progress and results kept by [`state`].

pub mod book;
pub mod collect;
pub mod expect;
pub mod lint;
pub mod metrics;
pub mod runner;
pub mod schema;
pub mod state;
pub mod steps;
pub mod ui;

use std::path::{Path, PathBuf};

use schema::Exercise;

/// The course shipped in the binary: (path, text) of every exercise, in course order.
pub const EMBEDDED_EXERCISES: &[(&str, &str)] = &[
    (
        "exercises/00-setup.toml",
        include_str!("../../exercises/00-setup.toml"),
    ),
    (
        "exercises/01-baseline.toml",
        include_str!("../../exercises/01-baseline.toml"),
    ),
    (
        "exercises/02-precision.toml",
        include_str!("../../exercises/02-precision.toml"),
    ),
    (
        "exercises/03-operator-profile.toml",
        include_str!("../../exercises/03-operator-profile.toml"),
    ),
    (
        "exercises/04-flops.toml",
        include_str!("../../exercises/04-flops.toml"),
    ),
    (
        "exercises/05-multi-device.toml",
        include_str!("../../exercises/05-multi-device.toml"),
    ),
    (
        "exercises/10-compare.toml",
        include_str!("../../exercises/10-compare.toml"),
    ),
    (
        "exercises/06-compile.toml",
        include_str!("../../exercises/06-compile.toml"),
    ),
    (
        "exercises/07-kernel-profile.toml",
        include_str!("../../exercises/07-kernel-profile.toml"),
    ),
    (
        "exercises/08-conv-sweep.toml",
        include_str!("../../exercises/08-conv-sweep.toml"),
    ),
    (
        "exercises/09-peak.toml",
        include_str!("../../exercises/09-peak.toml"),
    ),
    (
        "exercises/11-native-vendor-framework.toml",
        include_str!("../../exercises/11-native-vendor-framework.toml"),
    ),
    (
        "exercises/12-write-a-kernel.toml",
        include_str!("../../exercises/12-write-a-kernel.toml"),
    ),
    (
        "exercises/13-latency-under-load.toml",
        include_str!("../../exercises/13-latency-under-load.toml"),
    ),
    (
        "exercises/14-attention.toml",
        include_str!("../../exercises/14-attention.toml"),
    ),
    (
        "exercises/15-llm.toml",
        include_str!("../../exercises/15-llm.toml"),
    ),
];

/// The book's pages shipped in the binary, for `workshop book`: (path under book/src, text).
pub const EMBEDDED_CHAPTERS: &[(&str, &str)] = &[
    (
        "introduction.md",
        include_str!("../../book/src/introduction.md"),
    ),
    ("00-setup.md", include_str!("../../book/src/00-setup.md")),
    (
        "01-baseline.md",
        include_str!("../../book/src/01-baseline.md"),
    ),
    (
        "02-precision.md",
        include_str!("../../book/src/02-precision.md"),
    ),
    (
        "03-operator-profile.md",
        include_str!("../../book/src/03-operator-profile.md"),
    ),
    ("04-flops.md", include_str!("../../book/src/04-flops.md")),
    (
        "05-multi-device.md",
        include_str!("../../book/src/05-multi-device.md"),
    ),
    (
        "06-compile.md",
        include_str!("../../book/src/06-compile.md"),
    ),
    (
        "07-kernel-profile.md",
        include_str!("../../book/src/07-kernel-profile.md"),
    ),
    (
        "08-conv-sweep.md",
        include_str!("../../book/src/08-conv-sweep.md"),
    ),
    ("09-peak.md", include_str!("../../book/src/09-peak.md")),
    (
        "10-compare.md",
        include_str!("../../book/src/10-compare.md"),
    ),
    (
        "11-native-vendor-framework.md",
        include_str!("../../book/src/11-native-vendor-framework.md"),
    ),
    (
        "12-write-a-kernel.md",
        include_str!("../../book/src/12-write-a-kernel.md"),
    ),
    (
        "13-latency-under-load.md",
        include_str!("../../book/src/13-latency-under-load.md"),
    ),
    (
        "14-attention.md",
        include_str!("../../book/src/14-attention.md"),
    ),
    ("15-llm.md", include_str!("../../book/src/15-llm.md")),
];

/// Where a course comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Embedded,
    /// A directory holding `exercises/*.toml` and `book/src/`.
    Dir(PathBuf),
}

/// One exercise file, parsed.
#[derive(Debug, Clone)]
pub struct LoadedExercise {
    /// The path shown in messages.
    pub path: String,
    pub text: String,
    pub exercise: Exercise,
}

impl LoadedExercise {
    pub fn id(&self) -> &str {
        self.exercise.id.get_ref()
    }
}

/// A course that has passed lint.
#[derive(Debug, Clone)]
pub struct Course {
    pub source: Source,
    pub exercises: Vec<LoadedExercise>,
}

impl Course {
    /// Load and lint the course; any error is refused with every error listed (warnings are
    /// `workshop dev lint`'s to show).
    pub fn load(source: &Source) -> anyhow::Result<Course> {
        let files = read_files(source)?;
        let (exercises, mut diags) = lint::check(source, &files);
        diags.retain(lint::Diagnostic::is_error);
        if !diags.is_empty() {
            let list: Vec<String> = diags.iter().map(|d| d.to_string()).collect();
            anyhow::bail!(
                "the course has {} problem(s):\n{}",
                diags.len(),
                list.join("\n")
            );
        }
        Ok(Course {
            source: source.clone(),
            exercises,
        })
    }

    pub fn get(&self, id: &str) -> Option<&LoadedExercise> {
        self.exercises.iter().find(|e| e.id() == id)
    }

    /// The exercise `id` names: its whole id, or a prefix only it starts with (`03` for
    /// `03-operator-profile`); else an error listing the course's ids.
    pub fn find(&self, id: &str) -> anyhow::Result<&LoadedExercise> {
        if let Some(e) = self.get(id) {
            return Ok(e);
        }
        let matches: Vec<&LoadedExercise> = (self.exercises.iter())
            .filter(|e| !id.is_empty() && e.id().starts_with(id))
            .collect();
        match matches[..] {
            [one] => Ok(one),
            [] => anyhow::bail!(
                "no exercise `{id}`; the course has: {}",
                self.ids().join(", ")
            ),
            _ => anyhow::bail!(
                "`{id}` could be any of {}: give more of the id",
                matches
                    .iter()
                    .map(|e| e.id())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    pub fn ids(&self) -> Vec<&str> {
        self.exercises.iter().map(|e| e.id()).collect()
    }

    /// The text of a book page, its `{{#include}}`s expanded as mdBook expands them.
    pub fn chapter(&self, page: &str) -> Option<String> {
        let text = chapter_text(&self.source, page)?;
        Some(expand_includes(&text, |path| match &self.source {
            Source::Embedded => (path.strip_prefix("kernels/"))
                .and_then(crate::backend::kernel_files::embedded)
                .map(str::to_string),
            Source::Dir(dir) => crate::files::read_text(&dir.join(path)).ok(),
        }))
    }
}

/// The files kernel steps start the student from (`start = "start/depthwise.wgsl"`), by their
/// path under exercises/, for the course in the binary.
pub const EMBEDDED_STARTS: &[(&str, &str)] = &[(
    "start/depthwise.wgsl",
    include_str!("../../exercises/start/depthwise.wgsl"),
)];

/// The text of a kernel step's start file, `path` under the course's exercises/: a plain
/// relative path (no `..`, nothing hidden).
pub fn start_text(source: &Source, path: &str) -> Result<String, String> {
    if !is_plain_path(path) {
        return Err("not a plain path inside the course's exercises/".into());
    }
    match source {
        Source::Embedded => (EMBEDDED_STARTS.iter())
            .find(|(p, _)| *p == path)
            .map(|(_, t)| t.to_string())
            .ok_or_else(|| "not in the course built into the binary (EMBEDDED_STARTS)".into()),
        Source::Dir(dir) => {
            crate::files::read_text(&dir.join("exercises").join(path)).map_err(|e| format!("{e:#}"))
        }
    }
}

/// Expand mdBook's `{{#include PATH}}` and `{{#include PATH:ANCHOR}}` lines: PATH is relative
/// to book/src/ and must lie in the course's `kernels/` (`../../kernels/…`); ANCHOR keeps the
/// lines between `ANCHOR: name` and `ANCHOR_END: name`, without any anchor lines, as mdBook
/// does. `read` gives a file by its path in the course. An include that cannot be resolved
/// is left as written with a note after it (the book test fails on one).
pub fn expand_includes(text: &str, read: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        match include_of(line)
            .map(|(path, anchor)| (path, anchor, resolve_include(path, anchor, &read)))
        {
            Some((_, _, Ok(body))) => out.push_str(body.trim_end_matches('\n')),
            Some((path, _, Err(why))) => {
                out.push_str(line);
                out.push_str(&format!("\n(the book cannot show `{path}` here: {why})"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// The (path, anchor) of an include line.
fn include_of(line: &str) -> Option<(&str, Option<&str>)> {
    let inner = line
        .trim()
        .strip_prefix("{{#include ")?
        .strip_suffix("}}")?
        .trim();
    Some(match inner.rsplit_once(':') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (inner, None),
    })
}

fn resolve_include(
    path: &str,
    anchor: Option<&str>,
    read: &impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    let inside = path
        .strip_prefix("../../")
        .filter(|p| p.starts_with("kernels/") && is_plain_path(p))
        .ok_or("includes come from the course's kernels/ (`../../kernels/…`)")?;
    let text = read(inside).ok_or("no such file in this course")?;
    let Some(anchor) = anchor else {
        return Ok(text);
    };
    let (start, end) = (format!("ANCHOR: {anchor}"), format!("ANCHOR_END: {anchor}"));
    let mut lines = text.lines().skip_while(|l| !l.contains(&start));
    if lines.next().is_none() {
        return Err(format!("no `ANCHOR: {anchor}` in the file"));
    }
    let body: Vec<&str> = lines
        .take_while(|l| !l.contains(&end))
        .filter(|l| !l.contains("ANCHOR"))
        .collect();
    Ok(body.join("\n"))
}

/// Plain path components only: no `..`, nothing hidden, nothing absolute.
fn is_plain_path(p: &str) -> bool {
    p.split('/')
        .all(|c| !c.is_empty() && !c.starts_with('.') && c != "..")
}

/// Read every exercise file of a course as (path, text), sorted by file name.
pub fn read_files(source: &Source) -> anyhow::Result<Vec<(String, String)>> {
    match source {
        Source::Embedded => Ok(EMBEDDED_EXERCISES
            .iter()
            .map(|(p, t)| (p.to_string(), t.to_string()))
            .collect()),
        Source::Dir(dir) => {
            let ex_dir = dir.join("exercises");
            let entries = std::fs::read_dir(&ex_dir).map_err(|e| {
                anyhow::anyhow!(
                    "cannot read the course's exercises in `{}`: {e}",
                    ex_dir.display()
                )
            })?;
            let mut paths: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                .collect();
            paths.sort();
            paths
                .into_iter()
                .map(|p| {
                    let text = crate::files::read_text(&p)?;
                    Ok((p.display().to_string(), text))
                })
                .collect()
        }
    }
}

/// The text of a book page from the course's source: only a page inside the course's book
/// (see [`chapter_path`]).
pub fn chapter_text(source: &Source, page: &str) -> Option<String> {
    match source {
        Source::Embedded => EMBEDDED_CHAPTERS
            .iter()
            .find(|(p, _)| *p == page)
            .map(|(_, t)| t.to_string()),
        Source::Dir(dir) => crate::files::read_text(&chapter_path(dir, page).ok()?).ok(),
    }
}

/// Whether `page` is written as a book page may be: a relative path of plain components
/// (letters, digits, `-`, `_`, `.`; none hidden, none `..`) ending in `.md`.
pub fn is_page_name(page: &str) -> bool {
    page.ends_with(".md")
        && page.split('/').all(|part| {
            !part.is_empty()
                && !part.starts_with('.')
                && (part.bytes()).all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
        })
}

/// Where book page `page` of the course in `course_dir` is, refused unless it is a page name
/// ([`is_page_name`]) and the file it resolves to (links followed) lies inside the book.
pub fn chapter_path(course_dir: &Path, page: &str) -> Result<PathBuf, String> {
    if !is_page_name(page) {
        return Err(format!(
            "chapter `{page}` is not a page name: a path inside book/src/ such as `01-baseline.md`"
        ));
    }
    let book = book_dir(course_dir);
    let path = book.join(page);
    let (Ok(book), Ok(real)) = (book.canonicalize(), path.canonicalize()) else {
        return Err(format!(
            "chapter `{page}` does not exist in the book (book/src/)"
        ));
    };
    if !real.starts_with(&book) {
        return Err(format!(
            "chapter `{page}` leads outside the book (to `{}`)",
            real.display()
        ));
    }
    Ok(real)
}

pub fn book_dir(course_dir: &Path) -> PathBuf {
    course_dir.join("book").join("src")
}

#[cfg(test)]
mod tests {
    use super::expand_includes;

    #[test]
    fn includes_expand_like_mdbooks_and_refuse_paths_outside_the_kernels() {
        let file = "a\n// ANCHOR: two\nb\n// ANCHOR: inner\nc\n// ANCHOR_END: inner\n// ANCHOR_END: two\nd\n";
        let read = |p: &str| (p == "kernels/k.wgsl").then(|| file.to_string());
        let page = "x\n{{#include ../../kernels/k.wgsl:two}}\ny\n";
        assert_eq!(expand_includes(page, read), "x\nb\nc\ny\n");
        assert_eq!(
            expand_includes("{{#include ../../kernels/k.wgsl}}", read),
            format!("{}\n", file.trim_end())
        );
        for (line, why) in [
            (
                "{{#include ../../kernels/k.wgsl:three}}",
                "no `ANCHOR: three`",
            ),
            ("{{#include ../../kernels/none.wgsl}}", "no such file"),
            (
                "{{#include ../../../etc/passwd}}",
                "come from the course's kernels/",
            ),
            (
                "{{#include ../../kernels/../Cargo.toml}}",
                "come from the course's kernels/",
            ),
        ] {
            let shown = expand_includes(line, read);
            assert!(shown.contains(why), "{line}: {shown}");
        }
    }
}

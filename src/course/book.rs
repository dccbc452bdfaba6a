//! The course's book as HTML (`workshop book --html DIR`), rendered by mdBook's own library so
//! a workshop without internet, or without mdBook installed, has the book CI builds. The pages
//! are the ones `workshop book` shows — the course's own (built in, or its folder), their
//! `{{#include}}`s expanded the same way — laid out with the book's SUMMARY.md and book.toml
//! in a temporary folder for mdBook to read; only DIR is written.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};

use super::{Course, Source};

/// The built-in book's table of contents and settings.
pub const EMBEDDED_SUMMARY: &str = include_str!("../../book/src/SUMMARY.md");
pub const EMBEDDED_BOOK_TOML: &str = include_str!("../../book/book.toml");

/// Render `course`'s book into `out` and return its first page. `out` must be new, empty, or
/// a book rendered before: mdBook empties the folder it writes.
pub fn render_html(course: &Course, out: &Path) -> Result<PathBuf> {
    check_destination(out)?;
    let (settings, summary) = match &course.source {
        Source::Embedded => (EMBEDDED_BOOK_TOML.to_string(), EMBEDDED_SUMMARY.to_string()),
        Source::Dir(dir) => {
            let book = super::book_dir(dir);
            let settings = crate::files::read_text(&dir.join("book/book.toml"))
                .unwrap_or_else(|_| "[book]\n".into());
            (settings, crate::files::read_text(&book.join("SUMMARY.md"))?)
        }
    };
    let mut config: mdbook_driver::config::Config = settings
        .parse()
        .map_err(|e| anyhow::anyhow!("the book's book.toml: {e:#}"))?;
    let out = std::path::absolute(out)?;
    config.book.src = "src".into();
    config.build.build_dir = out.clone();
    config.build.create_missing = false;
    let tmp = tempfile::tempdir().context("cannot make a temporary folder for the book")?;
    let src = tmp.path().join("src");
    write(&src, "SUMMARY.md", &summary)?;
    for page in linked_pages(&summary) {
        if !super::is_page_name(page) {
            bail!("SUMMARY.md links `{page}`, which is not a page of the book");
        }
        let text = course
            .chapter(page)
            .with_context(|| format!("SUMMARY.md lists `{page}`, which the book does not have"))?;
        write(&src, page, &text)?;
    }
    let book = mdbook_driver::MDBook::load_with_config(tmp.path(), config)
        .map_err(|e| anyhow::anyhow!("mdBook could not load the book: {e:#}"))?;
    book.build()
        .map_err(|e| anyhow::anyhow!("mdBook could not render the book: {e:#}"))?;
    Ok(out.join("index.html"))
}

/// The links of a SUMMARY.md (`[title](page.md)`), in order, each with where its target
/// starts in the text (lint reports positions from it).
pub fn summary_links(summary: &str) -> impl Iterator<Item = (usize, &str)> {
    summary.match_indices("](").filter_map(|(i, _)| {
        let rest = &summary[i + 2..];
        rest.find(')').map(|end| (i + 2, &rest[..end]))
    })
}

/// The pages a SUMMARY.md links, in order.
fn linked_pages(summary: &str) -> Vec<&str> {
    (summary_links(summary).map(|(_, page)| page))
        .filter(|p| !p.is_empty())
        .collect()
}

fn write(src: &Path, page: &str, text: &str) -> Result<()> {
    let path = src.join(page);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create `{}`", parent.display()))?;
    }
    std::fs::write(&path, text).with_context(|| format!("cannot write `{}`", path.display()))
}

/// Refuse a destination mdBook would empty that holds anything but a book rendered before.
fn check_destination(out: &Path) -> Result<()> {
    match std::fs::read_dir(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => bail!("--html {}: {e}", out.display()),
        Ok(mut entries) => {
            let rendered = out.join("index.html").is_file() && out.join("toc.html").is_file();
            if entries.next().is_none() || rendered {
                Ok(())
            } else {
                bail!(
                    "--html {}: the folder is not empty and holds no book rendered before; mdBook empties the folder it writes, so give a new or empty one",
                    out.display()
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_book_renders_every_page_with_its_kernels() {
        let course = Course::load(&Source::Embedded).unwrap();
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("book");
        let index = render_html(&course, &out).unwrap();
        assert!(index.is_file());
        for page in linked_pages(EMBEDDED_SUMMARY) {
            let html = out.join(page.replace(".md", ".html"));
            assert!(html.is_file(), "{page} was not rendered");
        }
        // The includes are expanded: the kernel's parameters, not the directive.
        let conv = std::fs::read_to_string(out.join("08-conv-sweep.html")).unwrap();
        assert!(!conv.contains("#include"), "an include was left as written");
        assert!(conv.contains("k_g"), "the kernel's params are missing");
        // Rendering again over the book is fine; over anything else it is refused.
        render_html(&course, &out).unwrap();
        let other = d.path().join("notes");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("mine.txt"), "keep me").unwrap();
        let err = render_html(&course, &other).unwrap_err().to_string();
        assert!(err.contains("not empty"), "{err}");
        assert!(other.join("mine.txt").exists());
        let file = other.join("mine.txt");
        assert!(render_html(&course, &file).is_err());
    }
}

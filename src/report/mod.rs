//! Presentation: every table, summary and chart the commands show is rendered here from plain
//! records (bench runs, profiles, comparisons, the machine, the course's state), so numbers and
//! their display never mix. One file per domain; nothing here runs anything or prints.

pub mod bench;
pub mod charts;
pub mod compare;
pub mod course;
pub mod llm;
pub mod machine;
pub mod profile;
pub mod results;
pub mod scenario;

use std::io::IsTerminal;

use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};

/// A table in the style every report uses; on a terminal its columns wrap to fit its width.
pub(crate) fn new_table() -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_content_arrangement(ContentArrangement::Dynamic);
    t
}

/// `text` as a terminal shows it best: on a terminal, each paragraph's lines joined and filled
/// to the terminal's width (at most 100 columns, for reading), list items and indented lines
/// kept on lines of their own; elsewhere (a pipe, a file, a test) as written.
pub fn for_terminal(text: &str) -> String {
    if !std::io::stdout().is_terminal() {
        return text.to_string();
    }
    fill(text, textwrap::termwidth().clamp(40, 100))
}

/// Output whose every line is an item of its own (a measurement's summary): on a terminal,
/// each line longer than the terminal wrapped onto indented continuation lines.
pub fn lines_for_terminal(text: &str) -> String {
    if !std::io::stdout().is_terminal() {
        return text.to_string();
    }
    let opts = textwrap::Options::new(textwrap::termwidth().max(40))
        .subsequent_indent("    ")
        .break_words(false);
    (text.lines())
        .map(|l| textwrap::fill(l, &opts))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A book chapter (Markdown) rendered for a terminal `width` columns wide: headings, emphasis,
/// code and tables styled and laid out, paragraphs filled.
pub fn markdown(text: &str, width: usize) -> String {
    termimad::MadSkin::default()
        .text(&join_paragraphs(text), Some(width))
        .to_string()
}

/// Markdown with each paragraph's (and list item's) lines joined into one, as Markdown reads
/// them, so the renderer fills them to the terminal instead of keeping the source's breaks;
/// code blocks, headings and table rows stay as written.
fn join_paragraphs(text: &str) -> String {
    let starts_block = |l: &str| {
        let t = l.trim_start();
        ["#", "|", "```", ">"].iter().any(|p| t.starts_with(p)) || is_list_item(l)
    };
    let mut out: Vec<String> = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        let fence = line.trim_start().starts_with("```");
        let joins = !in_code
            && !fence
            && !line.trim().is_empty()
            && !starts_block(line)
            && out.last().is_some_and(|prev| {
                let p = prev.trim_start();
                !p.is_empty() && !p.starts_with('#') && !p.starts_with('|') && !p.starts_with("```")
            });
        match (joins, out.last_mut()) {
            (true, Some(prev)) => {
                prev.push(' ');
                prev.push_str(line.trim());
            }
            _ => out.push(line.to_string()),
        }
        if fence {
            in_code = !in_code;
        }
    }
    out.join("\n")
}

/// Whether line `l` starts a list item: `- `, `* ` or `N. `, indented or not.
fn is_list_item(l: &str) -> bool {
    let t = l.trim_start();
    t.starts_with("- ")
        || t.starts_with("* ")
        || t.split_once(". ")
            .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
}

/// Paragraphs of `text` refilled to `width` columns (see [`for_terminal`]).
pub fn fill(text: &str, width: usize) -> String {
    let starts_item = |l: &str| l.starts_with(' ') || is_list_item(l);
    let mut out: Vec<String> = Vec::new();
    let mut para: Vec<&str> = Vec::new();
    let flush = |para: &mut Vec<&str>, out: &mut Vec<String>| {
        if !para.is_empty() {
            let joined = para.join(" ");
            let indent = " ".repeat(joined.len() - joined.trim_start().len());
            let hang = if starts_item(&joined) { "  " } else { "" };
            let next = format!("{indent}{hang}");
            let opts = textwrap::Options::new(width)
                .subsequent_indent(&next)
                .break_words(false);
            out.push(textwrap::fill(&joined, opts));
            para.clear();
        }
    };
    for line in text.lines() {
        if line.trim().is_empty() {
            flush(&mut para, &mut out);
            out.push(String::new());
        } else {
            if starts_item(line) {
                flush(&mut para, &mut out);
            }
            para.push(line.trim_end());
        }
    }
    flush(&mut para, &mut out);
    out.join("\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn paragraphs_refill_and_items_stay_apart() {
        let text =
            "One two three\nfour five six seven.\n\n- an item that is long\n- another\n  indented";
        let got = super::fill(text, 16);
        assert_eq!(
            got,
            "One two three\nfour five six\nseven.\n\n- an item that\n  is long\n- another\n  indented"
        );
        // Every line fits.
        assert!(got.lines().all(|l| l.chars().count() <= 16));
    }

    #[test]
    fn markdown_reads_as_markdown_does() {
        let md = "# Title\n\nOne\ntwo.\n\n- item\n  more\n- next\n\n```sh\na\nb\n```\n\n| x | y |\n|---|---|\n| 1 | 2 |";
        assert_eq!(
            super::join_paragraphs(md),
            "# Title\n\nOne two.\n\n- item more\n- next\n\n```sh\na\nb\n```\n\n| x | y |\n|---|---|\n| 1 | 2 |"
        );
        let shown = super::markdown(md, 40);
        let plain: String = {
            // Without the styling's escape sequences.
            let mut out = String::new();
            let mut chars = shown.chars();
            while let Some(c) = chars.next() {
                if c == '\u{1b}' {
                    chars.by_ref().find(|c| c.is_ascii_alphabetic());
                } else {
                    out.push(c);
                }
            }
            out
        };
        assert!(
            plain.contains("One two.") && !plain.contains("# Title") && plain.contains("Title"),
            "{plain}"
        );
        assert!(plain.lines().all(|l| l.chars().count() <= 40), "{plain}");
    }
}

//! Comparisons of runs as text: the side-by-side table, its notes, and its Markdown form.

use comfy_table::{Cell, CellAlignment};

use super::new_table;

/// The cells of a comparison's table, header first.
fn comparison_cells(c: &crate::bench::compare::Comparison) -> Vec<Vec<String>> {
    let unit = c.rows.first().map_or("images/s", |r| r.unit.as_str());
    let mut rows = vec![
        [
            "#",
            "record",
            "device",
            "backend",
            "precision",
            "network",
            "batch",
            "median ms",
            "p99 ms",
            unit,
            "peak MiB",
            "CV %",
            "vs first",
            "verdict",
        ]
        .map(String::from)
        .to_vec(),
    ];
    // Energy only where some run could read it.
    let energy = c.rows.iter().any(|r| r.per_joule.is_some());
    if energy {
        let per = unit.split('/').next().unwrap_or("images");
        rows[0].insert(10, format!("{per}/J"));
    }
    for (i, r) in c.rows.iter().enumerate() {
        let pair = c.pairs.iter().find(|p| p.index == i);
        let mut row = vec![
            (i + 1).to_string(),
            r.label.clone(),
            r.device.clone(),
            r.backend.clone(),
            r.precision.clone(),
            r.network.clone(),
            r.batch.to_string(),
            format!("{:.2}", r.median_ms),
            format!("{:.2}", r.p99_ms),
            format!("{:.1}", r.throughput),
            format!("{:.0}", r.peak_memory_mib),
            format!("{:.1}", r.cv * 100.0),
            pair.map_or("reference".into(), |p| format!("{:.2}×", p.ratio)),
            pair.map_or(String::new(), |p| p.verdict.word().to_string()),
        ];
        if energy {
            let per = r.per_joule.map_or("—".into(), |j| format!("{j:.2}"));
            row.insert(10, per);
        }
        rows.push(row);
    }
    rows
}

/// Sentences, verdicts and differences under the table.
fn comparison_notes(c: &crate::bench::compare::Comparison, bullet: &str) -> String {
    let mut s = String::new();
    for p in &c.pairs {
        s.push_str(&format!(
            "{bullet}{} — {}: {}\n",
            p.sentence,
            p.verdict.word(),
            p.reason
        ));
    }
    if !c.warnings.is_empty() {
        s.push_str("\nThe configurations differ, so the ratios measure these differences too:\n");
        for w in &c.warnings {
            s.push_str(&format!("{bullet}{w}\n"));
        }
    }
    if !c.unsteady.is_empty() {
        s.push_str("\nThe machine was not steady during these runs (their times are not the device's own speed):\n");
        for u in &c.unsteady {
            s.push_str(&format!("{bullet}{u}\n"));
        }
    }
    if !c.differences.is_empty() {
        s.push_str("\nWhere they ran differs:\n");
        for d in &c.differences {
            s.push_str(&format!("{bullet}{d}\n"));
        }
    }
    s
}

/// A comparison for the terminal.
pub fn comparison(c: &crate::bench::compare::Comparison) -> String {
    let cells = comparison_cells(c);
    let mut t = new_table();
    t.set_header(cells[0].clone());
    for row in &cells[1..] {
        t.add_row(row.iter().enumerate().map(|(i, v)| {
            let cell = Cell::new(v);
            if i == 0 || i >= 6 {
                cell.set_alignment(CellAlignment::Right)
            } else {
                cell
            }
        }));
    }
    format!("{t}\n{}", comparison_notes(c, "  "))
}

/// A comparison as a Markdown report.
pub fn comparison_markdown(c: &crate::bench::compare::Comparison) -> String {
    let cells = comparison_cells(c);
    let mut s = String::from("# Benchmark comparison\n\n");
    s.push_str(&format!("| {} |\n", cells[0].join(" | ")));
    s.push_str(&format!("|{}\n", "---|".repeat(cells[0].len())));
    for row in &cells[1..] {
        s.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    s.push('\n');
    s.push_str(&comparison_notes(c, "- "));
    s.push_str(
        "\nVerdicts: *faster*/*slower* when every iteration of one run beats every iteration of the \
         other (per image); *same* when the medians are within 2%; *ambiguous* when the spreads \
         overlap and the medians differ more — measure again. A run's own spread is smaller than \
         the spread between runs on another day: repeat a comparison before trusting a small ratio.\n",
    );
    s
}

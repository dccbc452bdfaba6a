//! Presentation: every table, summary and chart the commands show is rendered here from plain
//! records (bench runs, profiles, comparisons, the machine, the course's state), so numbers and
//! their display never mix. One file per domain; nothing here runs anything or prints.

pub mod bench;
pub mod charts;
pub mod compare;
pub mod course;
pub mod machine;
pub mod profile;
pub mod results;

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};

/// A table in the style every report uses.
pub(crate) fn new_table() -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t
}

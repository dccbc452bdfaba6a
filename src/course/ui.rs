//! What the course shows and asks, as data: steps hand [`Show`] values and questions to a
//! [`Ui`], and the command layer (`cmd::course`) renders them with `report` and prints them.
//! Nothing in `course/` prints, prompts or draws; tests drive steps with a [`Ui`] of their own.

use std::path::Path;

use crate::backend::Theoretical;
use crate::bench::compare::Comparison;
use crate::bench::data_parallel::MultiRecord;
use crate::bench::flops::FlopsProfile;
use crate::bench::peak::{Bandwidth, GemmPeak};
use crate::bench::record::{BenchConfig, BenchRecord};
use crate::course::state::ResultTable;
use crate::doctor;

/// Something a step shows the student.
pub enum Show<'a> {
    /// The machine, as `workshop doctor` prints it.
    Doctor(&'a doctor::Report),
    /// What a run is about to do.
    Config(&'a BenchConfig),
    /// A finished run's summary.
    Summary(&'a BenchRecord),
    /// A multi-device run: each device, the global figures and the scaling.
    Multi(&'a MultiRecord),
    /// A profiled run's operator and kernel tables (`top` rows each) and its FLOPs profile
    /// to module depth `depth`, kept whole at `full` (the screen may get a summary).
    Profile {
        record: &'a BenchRecord,
        flops: &'a FlopsProfile,
        top: usize,
        depth: usize,
        /// Whether the summary shows the kernel table too.
        kernels: bool,
        full: &'a Path,
    },
    /// Runs compared side by side, and the chart to draw of them at `chart`.
    Comparison {
        comparison: &'a Comparison,
        chart: &'a Path,
    },
    /// A table of results.
    Table(&'a ResultTable),
    /// The GEMM peak, the bandwidth probes where the backend has them, and the ceiling.
    Peak {
        gemm: &'a GemmPeak,
        bandwidth: Option<&'a [Bandwidth]>,
        ceiling: Option<&'a Theoretical>,
    },
    /// A line of text.
    Line(String),
}

/// A progress display; it goes away when dropped.
pub trait Ticker {
    /// One unit of work done.
    fn tick(&mut self);
}

/// The student's side of a step.
pub trait Ui {
    fn show(&mut self, what: Show<'_>);
    /// A progress display of `total` units labelled `label`.
    fn progress(&mut self, label: &str, total: u64) -> Box<dyn Ticker>;
    /// Ask `prompt` with `choices`; `None` where nobody can answer (no terminal).
    fn choose(&mut self, prompt: &str, choices: &[String]) -> Option<anyhow::Result<String>>;
}

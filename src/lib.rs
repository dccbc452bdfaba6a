//! workshop: a hands-on course in GPU inference benchmarking, and the engine under it.
//!
//! The layers, each using only those before it (ARCHITECTURE.md draws them):
//! `units`, `files` and `settings` (plain helpers and the `WORKSHOP_*` variables); `model`
//! (networks, graphs, plans, weights, the reference); `backend` (our kernels on each device);
//! `bench` and `doctor` (measuring runs and machines); `course` (exercises, steps, verdicts,
//! the student's workspace); `report` (everything shown, rendered from records); `cmd` (the
//! command line: the only layer that prints).

pub mod backend;
pub mod bench;
pub mod cmd;
pub mod course;
pub mod doctor;
pub mod files;
pub mod fonts;
pub mod model;
pub mod report;
pub mod settings;
pub mod units;

//! workshop: a hands-on course in GPU inference benchmarking, and the engine under it.
//! `model` describes networks, `backend` runs them on a device through our own kernels,
//! `bench` measures them, `report` renders what was measured, `app` ties commands together.

pub mod app;
pub mod backend;
pub mod bench;
pub mod chart;
pub mod cli;
pub mod course;
pub mod doctor;
pub mod files;
pub mod model;
pub mod report;
pub mod settings;

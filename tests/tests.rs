//! The one integration test binary: each module below tests one part of the project.

mod common;

/// CLI behaviour as a user meets it: commands, records, and clear errors on bad input.
mod cli;
/// The course runner: a full run, navigation, lint, workspace safety, the book.
mod course;
/// Property tests: the safetensors reader and the course lint on damaged inputs.
mod fuzz;
/// Language models against Hugging Face transformers on committed tiny checkpoints.
mod llm;
/// Every kernel of every backend against the f64 reference, on small and odd shapes.
mod ops;
/// Our outputs against PyTorch's, on committed fixtures.
mod parity;
/// Weights: seeded init, safetensors round trips, and errors naming the tensor.
mod weights;
/// The model zoo against torchvision's parameter and MAC counts.
mod zoo;

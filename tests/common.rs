//! Helpers shared by the test modules: running the real binary, fixtures, and one test body
//! expanded for every backend.

use std::path::PathBuf;
use std::process::{Command, Output};

use workshop::backend::{self, BackendKind, ExecOptions, Session};
use workshop::model::op::{Conv2d, Op};
use workshop::model::{Plan, Precision, Weights};

/// A safetensors file whose header is written by hand: `header` as JSON, then `data` zero
/// bytes.
pub fn hand_made(path: &std::path::Path, header: &str, data: usize) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data, 0);
    std::fs::write(path, bytes).unwrap();
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The `workshop` binary, with its cache (measured peaks) in a folder of this test run
/// rather than the user's.
pub fn command() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_workshop"));
    c.env("WORKSHOP_CACHE_DIR", cache_dir());
    c
}

/// The cache folder of this test run.
pub fn cache_dir() -> PathBuf {
    std::env::temp_dir().join(format!("workshop-test-cache-{}", std::process::id()))
}

/// Run the `workshop` binary with `args`.
pub fn workshop(args: &[&str]) -> Output {
    command()
        .args(args)
        .output()
        .expect("failed to start workshop")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A prepared session on `kind`, or `None` (with the reason printed) when this machine or
/// build does not have that backend, so CPU-only machines pass and say what they skipped.
pub fn session(
    kind: BackendKind,
    plan: &Plan,
    w: &Weights,
    precision: Precision,
) -> Option<Box<dyn Session>> {
    profiled_session(kind, plan, w, precision, false)
}

/// [`session`], timing every kernel when `profile` is set.
pub fn profiled_session(
    kind: BackendKind,
    plan: &Plan,
    w: &Weights,
    precision: Precision,
    profile: bool,
) -> Option<Box<dyn Session>> {
    let opt = ExecOptions {
        precision,
        threads: Some(2),
        profile,
        ..Default::default()
    };
    session_with(kind, plan, w, &opt)
}

/// [`session`] with every execution option given.
pub fn session_with(
    kind: BackendKind,
    plan: &Plan,
    w: &Weights,
    opt: &ExecOptions,
) -> Option<Box<dyn Session>> {
    let precision = opt.precision;
    let b = match backend::open(kind) {
        Ok(b) => b,
        Err(e) => {
            skip(kind, &e.to_string());
            return None;
        }
    };
    match b.prepare(0, plan, w, opt) {
        Ok(s) => Some(s),
        Err(backend::BackendError::NoDevice { reason, .. }) => {
            skip(kind, &reason);
            None
        }
        // A precision, op or library this backend lacks here (rocBLAS where it is not
        // installed, or on the emulator).
        Err(e) if e.is_unavailable() => {
            eprintln!("skipped {precision} on {kind}: {e}");
            None
        }
        Err(e) => panic!("{kind} failed to prepare: {e}"),
    }
}

/// A conv op from a positional row of the case tables in ops and parity (they read best as columns).
#[allow(clippy::too_many_arguments)]
pub fn conv(
    cin: usize,
    cout: usize,
    k: (usize, usize),
    s: usize,
    p: (usize, usize),
    d: usize,
    groups: usize,
    bias: bool,
) -> Op {
    Op::Conv2d(Conv2d {
        in_channels: cin,
        out_channels: cout,
        kernel: k,
        stride: (s, s),
        padding: p,
        dilation: (d, d),
        groups,
        bias,
        ..Conv2d::new(cin, cout, 1, 1, 0)
    })
}

/// Say why a backend's test is skipped, or fail when CI requires that backend
/// (`WORKSHOP_REQUIRE_BACKENDS=wgpu,...`): a CI run that silently skipped them tests nothing.
pub fn skip(kind: BackendKind, reason: &str) {
    let required = std::env::var("WORKSHOP_REQUIRE_BACKENDS").unwrap_or_default();
    if required.split(',').any(|b| b.trim() == kind.name()) {
        panic!("{kind} is required here (WORKSHOP_REQUIRE_BACKENDS) but unavailable: {reason}");
    }
    eprintln!("skipped on {kind}: {reason}");
}

/// Tolerance of a precision, relative to the largest reference magnitude: FP32 accumulates in
/// a different order than the f64 reference (rel 1e-4); FP16 and BF16 also round every stored
/// activation (10 and 7 mantissa bits), so their bound is looser and grows with depth.
pub fn tolerance(p: Precision) -> f32 {
    match p {
        Precision::Fp32 => 1e-4,
        Precision::Fp16 => 1e-2,
        Precision::Bf16 => 6e-2,
    }
}

/// Expand one test body (a function taking the backend) into one test per backend:
/// `backend_test!(conv2d, cpu, wgpu, cuda, hip)` gives `conv2d::cpu`, `conv2d::wgpu`, ...
#[macro_export]
macro_rules! backend_test {
    ($body:ident, $($kind:ident),+) => {
        mod $body {
            $(
                #[test]
                fn $kind() {
                    let kind = <workshop::backend::BackendKind as clap::ValueEnum>::from_str(stringify!($kind), true)
                        .expect("a backend name");
                    super::$body(kind);
                }
            )+
        }
    };
}

/// The small ViT of the ops tests and of make_fixtures.py's `tiny_vit`: 40×40 images in 8×8
/// patches (26 tokens), two blocks of two heads of 8.
pub fn tiny_vit() -> workshop::model::zoo::VitConfig {
    workshop::model::zoo::VitConfig {
        image_size: 40,
        patch: 8,
        layers: 2,
        heads: 2,
        hidden: 16,
        mlp: 24,
        classes: 10,
    }
}

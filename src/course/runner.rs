//! Running one step of an exercise: the step's kind runs it (`steps/`), then its expectations
//! are judged against what it recorded and the earlier steps' metrics, and the result comes
//! back as an [`Attempt`] to record. A step the build or machine cannot run comes back
//! `unavailable` with the reason, never with made-up numbers.

use std::collections::BTreeMap;

use anyhow::Result;

use super::expect::{self, Context, Verdict};
use super::schema::Step;
use super::state::{Attempt, Outcome, Workspace, now};
use super::steps::{self, Earlier, StepContext, StepOutput, Unavailable};
use super::ui::{Show, Ui};
use crate::backend::{BackendError, BackendKind};

/// How the note of an unavailable attempt starts.
pub const UNAVAILABLE: &str = "not available on this machine/build: ";

/// Why a run cannot happen on this build or machine, if that is the reason it failed.
fn unavailable_reason(e: &anyhow::Error) -> Option<String> {
    let backend = e
        .downcast_ref::<BackendError>()
        .filter(|b| b.is_unavailable());
    backend
        .map(ToString::to_string)
        .or_else(|| e.downcast_ref::<Unavailable>().map(ToString::to_string))
}

/// Set while a step runs, so that Ctrl-C can say nothing was recorded for it (the handler is
/// in main). Results are written only after a step finishes, by atomic renames.
pub static STEP_RUNNING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Clears [`STEP_RUNNING`] however the step ends.
struct Running;

impl Running {
    fn start() -> Running {
        STEP_RUNNING.store(true, std::sync::atomic::Ordering::SeqCst);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        STEP_RUNNING.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether device `device` of `backend` computes on the host's cores: the CPU backend, a
/// software GPU (lavapipe: 00's quick step took 6.9 minutes there at GPU sizes) or the GPU
/// emulator. Steps take their `cpu` settings there, sized for a few cores.
pub fn runs_on_host(backend: BackendKind, device: usize) -> bool {
    backend == BackendKind::Cpu
        || crate::backend::open(backend)
            .ok()
            .and_then(|b| b.devices().into_iter().nth(device))
            .is_some_and(|d| d.is_software())
}

/// Run `step` of `exercise` and return the attempt to record (nothing is written to the
/// workspace's state or results here; a run's record and a chart go to `records/` and
/// `charts/`). `answer` answers a question step.
pub fn run_step(
    ws: &Workspace,
    course: &super::Source,
    exercise: &str,
    step: &Step,
    earlier: &Earlier,
    answer: Option<&str>,
    ui: &mut dyn Ui,
) -> Result<Attempt> {
    let started = now();
    let ctx = StepContext {
        ws,
        course,
        exercise,
        step,
        earlier,
        answer,
        // Only steps that measure ask the backend for its devices.
        host_sized: step.kind.measures() && runs_on_host(ws.state.backend, ws.state.device),
    };
    if ctx.host_sized && ws.state.backend != BackendKind::Cpu {
        ui.show(Show::Line(format!(
            "The {} device here computes on this machine's CPU (a software GPU or the emulator): \
             this step runs with its CPU-sized settings.",
            ws.state.backend
        )));
    }
    let mut out = StepOutput {
        environment: BTreeMap::from([
            ("backend".to_string(), ws.state.backend.to_string()),
            (
                "runner_version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            ),
        ]),
        ..StepOutput::default()
    };
    let applies = step.backends.is_empty() || step.backends.contains(&ws.state.backend);
    let running = Running::start();
    let result = match applies {
        true => steps::function(step.kind)(&ctx, &mut out, ui),
        false => Err(anyhow::Error::new(Unavailable(format!(
            "not applicable on the {} backend (this step is for {})",
            ws.state.backend,
            (step.backends.iter().map(|b| b.to_string()))
                .collect::<Vec<_>>()
                .join(", ")
        )))),
    };
    drop(running);
    let mut note = None;
    let outcome = match result {
        Ok(()) => {
            let sid = ctx.id();
            let mut all = earlier.metrics.clone();
            all.insert(sid.to_string(), out.metrics.0.clone());
            let judge = Context {
                device: &out.device,
                backend: ws.state.backend,
            };
            let checks = (step.expects.iter())
                .filter_map(|x| expect::evaluate(x.get_ref(), sid, &all, &judge, step.max_cv));
            out.checks.extend(checks);
            if out.checks.iter().any(|c| c.verdict == Verdict::Fail) {
                Outcome::Fail
            } else if out
                .checks
                .iter()
                .any(|c| c.verdict == Verdict::Inconclusive)
            {
                Outcome::Inconclusive
            } else {
                Outcome::Pass
            }
        }
        Err(e) => match unavailable_reason(&e) {
            Some(reason) => {
                note = Some(format!("{UNAVAILABLE}{reason}"));
                Outcome::Unavailable
            }
            None => return Err(e),
        },
    };
    Ok(Attempt {
        exercise: exercise.to_string(),
        step: ctx.id().to_string(),
        kind: step.kind,
        outcome,
        metrics: out.metrics.0,
        table: out.table,
        checks: out.checks,
        answer: out.answer,
        note,
        environment: out.environment,
        started,
        finished: now(),
        progress: None,
    })
}

/// What the earlier steps of `exercise` left in the workspace: the metrics of each step's
/// latest attempt, and why each step whose latest attempt was unavailable could not run.
pub fn earlier(ws: &Workspace, exercise: &str) -> Earlier {
    let mut earlier = Earlier::default();
    for a in ws.results.latest(exercise) {
        match a.outcome {
            Outcome::Skipped => {}
            Outcome::Unavailable => {
                let why = a.note.as_deref().unwrap_or("unavailable");
                let why = why.strip_prefix(UNAVAILABLE).unwrap_or(why);
                earlier.unavailable.insert(a.step.clone(), why.to_string());
            }
            _ => {
                earlier.metrics.insert(a.step.clone(), a.metrics.clone());
            }
        }
    }
    earlier
}

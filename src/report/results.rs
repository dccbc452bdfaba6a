//! The student's worksheet, `results.md`, rendered from the workspace's attempts with the
//! `templates/results.md` template.

use anyhow::Result;
use serde::Serialize;

use crate::course::Course;
use crate::course::state::{ResultTable, Status, Workspace, now};
use crate::report;

#[derive(Serialize)]
struct CheckView {
    what: String,
    value_text: String,
    range_text: String,
    verdict: String,
    reason: Option<String>,
    hint: Option<String>,
}

#[derive(Serialize)]
struct StepView {
    step: String,
    outcome: String,
    measured: String,
    table: Option<ResultTable>,
    checks: Vec<CheckView>,
}

#[derive(Serialize)]
struct ExerciseView {
    id: String,
    title: String,
    status: String,
    steps: Vec<StepView>,
    has_checks: bool,
}

/// The worksheet (`results.md`), rendered from `templates/results.md`.
pub fn worksheet(ws: &Workspace, course: &Course) -> Result<String> {
    let last_env = ws
        .results
        .attempts
        .iter()
        .rev()
        .find(|a| a.environment.contains_key("device"))
        .map(|a| &a.environment);
    let env = |k: &str| {
        last_env
            .and_then(|e| e.get(k))
            .cloned()
            .unwrap_or_else(|| "not measured yet".into())
    };
    let exercises: Vec<ExerciseView> = course
        .exercises
        .iter()
        .map(|e| {
            let steps: Vec<StepView> = ws
                .results
                .latest(e.id())
                .into_iter()
                .map(|a| StepView {
                    step: a.step.clone(),
                    outcome: format!("{:?}", a.outcome).to_lowercase(),
                    measured: report::course::measured(a),
                    table: a.table.clone(),
                    checks: a
                        .checks
                        .iter()
                        .map(|c| CheckView {
                            what: c.what.clone(),
                            value_text: c.value.map_or("—".into(), crate::units::number),
                            range_text: report::course::range_text(c.min, c.max),
                            verdict: format!("{:?}", c.verdict).to_lowercase(),
                            reason: c.reason.clone(),
                            hint: c.hint.clone(),
                        })
                        .collect(),
                })
                .collect();
            ExerciseView {
                id: e.id().to_string(),
                title: e.exercise.title.clone(),
                status: report::course::status_word(ws.progress(e.id()).status).to_string(),
                has_checks: steps.iter().any(|s| !s.checks.is_empty()),
                steps,
            }
        })
        .collect();
    let count = |s: Status| {
        course
            .exercises
            .iter()
            .filter(|e| ws.progress(e.id()).status == s)
            .count()
    };
    let mut env_j = minijinja::Environment::new();
    env_j.add_template("results.md", include_str!("../../templates/results.md"))?;
    let out = env_j
        .get_template("results.md")?
        .render(minijinja::context! {
            student => ws.state.student.clone(),
            date => now(),
            device => env("device"),
            backend => ws.state.backend.to_string(),
            kernels => env("kernel_version"),
            runner_version => env!("CARGO_PKG_VERSION"),
            done => count(Status::Done),
            skipped => count(Status::Skipped),
            total => course.exercises.len(),
            exercises => minijinja::value::Value::from(minijinja::value::Serde(&exercises)),
        })?;
    Ok(out)
}

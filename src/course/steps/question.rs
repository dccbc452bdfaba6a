//! `question` steps: the student's answer, recorded, and judged against the student's own
//! measurements where the question says how (`correct`).

use anyhow::{Context as _, Result, bail};

use super::{StepContext, StepOutput};
use crate::course::expect::{Check, Verdict};
use crate::course::schema::Pick;
use crate::course::ui::Ui;
use crate::units;

pub fn run(ctx: &StepContext<'_>, out: &mut StepOutput, ui: &mut dyn Ui) -> Result<()> {
    let q = (ctx.step.question.as_ref())
        .context("a question step needs a question section")?
        .get_ref();
    if let Some(c) = &q.correct {
        ctx.earlier
            .require(c.references().iter().map(String::as_str))?;
    }
    let given = match ctx.answer {
        Some(a) => (q.choices.iter())
            .find(|c| c.eq_ignore_ascii_case(a.trim()))
            .cloned()
            .with_context(|| {
                format!("`{a}` is not one of the choices: {}", q.choices.join(", "))
            })?,
        None => match ui.choose(&q.prompt, &q.choices) {
            Some(answer) => answer?,
            None => bail!(
                "this step asks: {}\nanswer with `workshop next --answer CHOICE` (choices: {})",
                q.prompt,
                q.choices.join(", ")
            ),
        },
    };
    if let Some(c) = &q.correct {
        let refs = c.references();
        let values: Option<Vec<f64>> = refs.iter().map(|r| ctx.earlier.value(r)).collect();
        let mut check = Check {
            what: format!("answer: {given}"),
            value: None,
            min: None,
            max: None,
            range: "judged from your measurements".into(),
            verdict: Verdict::Inconclusive,
            reason: None,
            hint: None,
        };
        match values {
            Some(vals) => {
                let best = (0..vals.len())
                    .reduce(|a, b| {
                        let better = match c.pick {
                            Pick::Max => vals[b] > vals[a],
                            Pick::Min => vals[b] < vals[a],
                        };
                        if better { b } else { a }
                    })
                    .unwrap_or(0);
                let right = &q.choices[best];
                check.range = format!(
                    "your measurements say {right}: {} = {}",
                    refs[best],
                    units::number(vals[best])
                );
                if *right == given {
                    check.verdict = Verdict::Pass;
                } else {
                    check.verdict = Verdict::Fail;
                    check.hint = Some(format!(
                        "your measurements say `{right}` ({} = {:.3}); look at the earlier steps' results again",
                        refs[best], vals[best]
                    ));
                }
            }
            None => {
                check.reason =
                    Some("some of the steps this question is about have no results".into());
            }
        }
        out.checks.push(check);
    }
    out.answer = Some(given);
    Ok(())
}

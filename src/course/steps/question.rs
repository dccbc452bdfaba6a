//! `question` steps: the student's answer, recorded, and judged against the student's own
//! measurements where the question says how (`correct`).

use anyhow::{Context as _, Result, bail};

use super::{StepContext, StepOutput};
use crate::course::expect::{Check, Verdict, within_noise};
use crate::course::metrics;
use crate::course::schema::Pick;
use crate::course::ui::Ui;
use crate::units;

/// Why two timing-derived answers are a tie, if they are: their values within the noise of
/// the runs behind them ([`within_noise`]); `value` looks up `STEP.metric`.
fn noise_tie(
    value: impl Fn(&str) -> Option<f64>,
    (a, va): (&str, f64),
    (b, vb): (&str, f64),
) -> Option<String> {
    let cv = |r: &str| {
        let (step, metric) = r.split_once('.')?;
        metrics::is_timing(metric).then(|| value(&format!("{step}.cv")))?
    };
    let (ca, cb) = (cv(a)?, cv(b)?);
    within_noise(va, vb, ca, cb).then(|| {
        format!(
            "{b} = {} is within the noise of it (the runs varied by {:.1}% and {:.1}%), so your answer counts",
            units::number(vb),
            ca * 100.0,
            cb * 100.0
        )
    })
}

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
                let chosen = q.choices.iter().position(|c| *c == given);
                let tie = chosen.and_then(|g| {
                    let value = |r: &str| ctx.earlier.value(r);
                    noise_tie(
                        value,
                        (&refs[best], vals[best]),
                        (refs.get(g)?, *vals.get(g)?),
                    )
                });
                if *right == given {
                    check.verdict = Verdict::Pass;
                } else if let Some(tie) = tie {
                    // Timings a re-run could swap: both answers are right.
                    check.verdict = Verdict::Pass;
                    check.range = format!("{}; {tie}", check.range);
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

#[cfg(test)]
mod tests {
    use super::noise_tie;

    #[test]
    fn timings_within_noise_tie_and_others_do_not() {
        let value = |r: &str| match r {
            "eager.cv" => Some(0.04),
            "default.cv" => Some(0.02),
            _ => None,
        };
        // 5% apart, CVs up to 4%: a re-run could swap them.
        let tie = noise_tie(
            value,
            ("eager.throughput", 100.0),
            ("default.throughput", 95.0),
        );
        assert!(tie.unwrap().contains("within the noise"));
        // 20% apart: a real difference.
        assert!(
            noise_tie(
                value,
                ("eager.throughput", 100.0),
                ("default.throughput", 80.0)
            )
            .is_none()
        );
        // Not timings (an intensity is arithmetic), or no CV recorded: no tie.
        assert!(
            noise_tie(
                value,
                ("eager.intensity", 100.0),
                ("default.intensity", 99.0)
            )
            .is_none()
        );
        assert!(
            noise_tie(
                value,
                ("other.throughput", 100.0),
                ("default.throughput", 99.0)
            )
            .is_none()
        );
    }
}

//! Judging a step's results against its expectations. A verdict is pass, fail, or
//! inconclusive: a value we could not measure, or a run too noisy to judge (its coefficient of
//! variation above the step's `max_cv`, [`DEFAULT_MAX_CV`] where it sets none), is never called
//! a failure.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::schema::Expect;
use crate::backend::BackendKind;

/// The noise limit of a step that sets no `max_cv`: timing checks are judged against some
/// limit everywhere, never against none.
pub const DEFAULT_MAX_CV: f64 = 0.15;

/// Two timing-derived values `a` and `b` whose runs varied by `cv_a` and `cv_b` (CV) are
/// within each other's noise when they differ by no more than twice the larger CV: about two
/// standard deviations of either run's iterations, the spread a re-run could move a median by
/// on a busy machine (book 10).
pub fn within_noise(a: f64, b: f64, cv_a: f64, cv_b: f64) -> bool {
    let scale = a.abs().max(b.abs());
    scale > 0.0 && (a - b).abs() / scale <= 2.0 * cv_a.max(cv_b)
}

/// The range the ratio `a / b` of two timing-derived values could take were each off by twice
/// its run's CV (the spread [`within_noise`] allows): `(least, most)`. `most` is infinite
/// where `b`'s noise could reach zero. A noisy run whose whole range is on one side of a target
/// is judged on that side; only a range across it is too noisy to judge.
pub fn ratio_under_noise(a: f64, b: f64, cv_a: f64, cv_b: f64) -> (f64, f64) {
    let (lo_a, hi_a) = (a * (1.0 - 2.0 * cv_a).max(0.0), a * (1.0 + 2.0 * cv_a));
    let (lo_b, hi_b) = (b * (1.0 - 2.0 * cv_b).max(0.0), b * (1.0 + 2.0 * cv_b));
    let most = match lo_b > 0.0 {
        true => hi_a / lo_b,
        false => f64::INFINITY,
    };
    (lo_a / hi_b, most)
}

/// Metrics of the steps run so far in an exercise, by step id.
pub type Metrics = BTreeMap<String, BTreeMap<String, f64>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
    Inconclusive,
}

/// One expectation, judged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    /// What was checked, as written (`throughput / fp32.throughput`).
    pub what: String,
    pub value: Option<f64>,
    pub min: Option<f64>,
    pub max: Option<f64>,
    /// Which range applied: `device *A100*`, `backend cpu` or `default`.
    pub range: String,
    pub verdict: Verdict,
    /// Why it is inconclusive.
    pub reason: Option<String>,
    /// The expectation's hint, kept when it failed.
    pub hint: Option<String>,
}

/// Where the step ran, for device- and backend-keyed ranges.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    pub device: &'a str,
    pub backend: BackendKind,
}

/// Look up `metric` (this step's) or `STEP.metric`.
fn lookup(reference: &str, step: &str, metrics: &Metrics) -> Result<f64, String> {
    let (s, m) = own_or_earlier(reference, step, metrics);
    metrics.get(s).and_then(|ms| ms.get(m)).copied().ok_or_else(|| {
        if metrics.contains_key(s) {
            format!("`{reference}` was not measured")
        } else {
            format!("step `{s}` has no results (skipped or unavailable), so `{reference}` is unknown")
        }
    })
}

/// A reference as (step, metric): this step's own metric when it has one of that name (own
/// names may contain dots: `op.conv2d.time_pct`), else `STEP.metric`.
fn own_or_earlier<'a>(reference: &'a str, step: &'a str, metrics: &Metrics) -> (&'a str, &'a str) {
    if metrics.get(step).is_some_and(|m| m.contains_key(reference)) {
        return (step, reference);
    }
    reference.split_once('.').unwrap_or((step, reference))
}

/// The CV of a step that a reference depends on.
fn cv_of(reference: &str, step: &str, metrics: &Metrics) -> Option<f64> {
    let (s, _) = own_or_earlier(reference, step, metrics);
    metrics.get(s).and_then(|m| m.get("cv")).copied()
}

/// What telemetry found wrong during the run behind `reference`, where it marked the run
/// `unsteady` (the rule is [`crate::bench::telemetry`]'s; this only words its figures).
fn unsteady(reference: &str, step: &str, metrics: &Metrics) -> Option<String> {
    let (s, _) = own_or_earlier(reference, step, metrics);
    let m = metrics.get(s)?;
    if m.get("unsteady") != Some(&1.0) {
        return None;
    }
    let mut why = Vec::new();
    if let Some(t) = m.get("throttled").filter(|&&t| t > 0.0) {
        why.push(format!(
            "the device held its clocks back in {:.0}% of the readings",
            t * 100.0
        ));
    }
    if let Some(c) = m
        .get("clock_ratio")
        .filter(|&&c| c < crate::bench::telemetry::LOW_CLOCK)
    {
        why.push(format!(
            "its clock ran at {:.0}% of the rated one",
            c * 100.0
        ));
    }
    if let Some(o) = m
        .get("other_cores")
        .filter(|&&o| o >= crate::bench::telemetry::OTHER_CORES)
    {
        why.push(format!("other programs kept {o:.1} cores busy"));
    }
    if let Some(st) = m
        .get("steal")
        .filter(|&&st| st >= crate::bench::telemetry::STEAL)
    {
        why.push(format!(
            "the hypervisor took {:.0}% of the CPU time",
            st * 100.0
        ));
    }
    if why.is_empty() {
        why.push("see the run's telemetry".into());
    }
    Some(why.join(", "))
}

/// Judge one expectation of step `step` (whose own metrics are already in `metrics`); `None`
/// where the range that applies has neither `min` nor `max` (not judged on this device or
/// backend: a metric it does not measure, say).
pub fn evaluate(
    x: &Expect,
    step: &str,
    metrics: &Metrics,
    ctx: &Context<'_>,
    max_cv: Option<f64>,
) -> Option<Check> {
    let what = match &x.per {
        Some(per) => format!("{} / {per}", x.metric),
        None => x.metric.clone(),
    };
    let (min, max, range) = x
        .device
        .iter()
        .find(|d| {
            d.backend.is_none_or(|b| b == ctx.backend)
                && glob::Pattern::new(&d.glob).is_ok_and(|p| p.matches(ctx.device))
        })
        .map(|d| (d.min, d.max, format!("device {}", d.glob)))
        .or_else(|| {
            x.backend
                .iter()
                .find(|b| b.backend == ctx.backend)
                .map(|b| (b.min, b.max, format!("backend {}", b.backend)))
        })
        .unwrap_or((x.min, x.max, "default".into()));
    if min.is_none() && max.is_none() {
        return None;
    }
    let mut check = Check {
        what,
        value: None,
        min,
        max,
        range,
        verdict: Verdict::Inconclusive,
        reason: None,
        hint: None,
    };
    let value = lookup(&x.metric, step, metrics).and_then(|v| match &x.per {
        Some(per) => lookup(per, step, metrics).and_then(|d| {
            if d == 0.0 {
                Err(format!("`{per}` is zero"))
            } else {
                Ok(v / d)
            }
        }),
        None => Ok(v),
    });
    let value = match value {
        // A value that is not a number (a ratio over a zero) judges nothing (issue 27).
        Ok(v) if !v.is_finite() => Err(format!(
            "`{}` is not defined ({v}: a division by zero in the steps it comes from)",
            check.what
        )),
        other => other,
    };
    let value = match value {
        Ok(v) => v,
        Err(reason) => {
            check.reason = Some(reason);
            return Some(check);
        }
    };
    check.value = Some(value);
    let limit = max_cv.unwrap_or(DEFAULT_MAX_CV);
    let refs = std::iter::once(&x.metric).chain(x.per.as_ref());
    let timing = |r: &&String| super::metrics::is_timing(own_or_earlier(r, step, metrics).1);
    for r in refs.filter(timing) {
        if let Some(cv) = cv_of(r, step, metrics).filter(|&cv| cv > limit) {
            check.reason = Some(format!(
                "too noisy to judge: the run behind `{r}` varied by {:.1}% (CV), above this step's limit of {:.1}%; close other programs and re-run the step",
                cv * 100.0,
                limit * 100.0
            ));
            return Some(check);
        }
        if let Some(why) = unsteady(r, step, metrics) {
            check.reason = Some(format!(
                "not judged: the machine was not steady during the run behind `{r}` ({why}); re-run the step when it is"
            ));
            return Some(check);
        }
    }
    let ok = min.is_none_or(|m| value >= m) && max.is_none_or(|m| value <= m);
    // A compared run's ratio out of range while the two runs' spreads overlap: the comparison
    // itself could not tell them apart.
    let unclear = (x.metric.strip_suffix(".ratio"))
        .and_then(|s| metrics.get(step)?.get(&format!("{s}.unclear")))
        .is_some_and(|&u| u == 1.0);
    if !ok && x.per.is_none() && unclear {
        check.reason = Some(
            "too noisy to judge: the two runs' spreads overlap (the comparison's verdict is ambiguous); close other programs and re-run both steps".into(),
        );
        return Some(check);
    }
    check.verdict = if ok { Verdict::Pass } else { Verdict::Fail };
    if !ok {
        check.hint = Some(x.hint.clone());
    }
    Some(check)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::course::schema::{BackendRange, DeviceRange};

    fn expect(metric: &str, per: Option<&str>, min: Option<f64>, max: Option<f64>) -> Expect {
        Expect {
            metric: metric.into(),
            per: per.map(String::from),
            min,
            max,
            device: vec![],
            backend: vec![],
            hint: "try again".into(),
        }
    }

    /// A chart's ratio out of range: failed where the runs are told apart, inconclusive where
    /// their spreads overlap or the noisiest run compared is above the limit.
    #[test]
    fn chart_ratios_respect_the_comparisons_noise() {
        let ctx = Context {
            device: "AMD EPYC",
            backend: crate::backend::BackendKind::Cpu,
        };
        let chart = |unclear: f64, cv: f64| {
            let mut m = Metrics::new();
            m.insert(
                "chart".into(),
                BTreeMap::from([
                    ("again.ratio".into(), 0.887),
                    ("again.unclear".into(), unclear),
                    ("cv".into(), cv),
                ]),
            );
            m
        };
        let x = expect("again.ratio", None, Some(0.9), Some(1.1));
        let c = evaluate(&x, "chart", &chart(0.0, 0.05), &ctx, None).unwrap();
        assert_eq!(c.verdict, Verdict::Fail);
        let c = evaluate(&x, "chart", &chart(1.0, 0.05), &ctx, None).unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive);
        assert!(c.reason.unwrap().contains("spreads overlap"));
        let c = evaluate(&x, "chart", &chart(0.0, 0.4), &ctx, None).unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive);
    }

    /// A run that telemetry marked unsteady: its timing checks are inconclusive with the
    /// figures behind it, also when a later step divides by it; its other checks are judged.
    #[test]
    fn an_unsteady_machine_makes_timing_checks_inconclusive() {
        let ctx = Context {
            device: "Intel Xeon",
            backend: crate::backend::BackendKind::Cpu,
        };
        let mut m = Metrics::new();
        m.insert(
            "busy".into(),
            BTreeMap::from([
                ("throughput".into(), 50.0),
                ("loss".into(), 7.0),
                ("cv".into(), 0.01),
                ("unsteady".into(), 1.0),
                ("other_cores".into(), 0.9),
                ("steal".into(), 0.02),
            ]),
        );
        m.insert(
            "quiet".into(),
            BTreeMap::from([
                ("throughput".into(), 100.0),
                ("cv".into(), 0.01),
                ("unsteady".into(), 0.0),
            ]),
        );
        let c = evaluate(
            &expect("throughput", None, Some(80.0), None),
            "busy",
            &m,
            &ctx,
            None,
        );
        let c = c.unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive);
        let why = c.reason.unwrap();
        assert!(why.contains("other programs kept 0.9 cores busy"), "{why}");
        assert!(!why.contains("hypervisor"), "{why}");
        let c = evaluate(
            &expect("loss", None, Some(1.0), None),
            "busy",
            &m,
            &ctx,
            None,
        )
        .unwrap();
        assert_eq!(c.verdict, Verdict::Pass);
        let x = expect("throughput", Some("busy.throughput"), Some(1.5), None);
        let c = evaluate(&x, "quiet", &m, &ctx, None).unwrap();
        assert_eq!(
            c.verdict,
            Verdict::Inconclusive,
            "the divisor's run was unsteady"
        );
        let c = evaluate(
            &expect("throughput", None, Some(80.0), None),
            "quiet",
            &m,
            &ctx,
            None,
        );
        assert_eq!(c.unwrap().verdict, Verdict::Pass);
        // A peak step's figures are timings too: a GEMM measured on busy cores, and a
        // baseline's throughput divided by it, are not judged.
        m.insert(
            "peak".into(),
            BTreeMap::from([
                ("gemm_gflops".into(), 60.0),
                ("ceiling_gflops".into(), 50.0),
                ("unsteady".into(), 1.0),
                ("other_cores".into(), 1.1),
            ]),
        );
        let x = expect("gemm_gflops", Some("ceiling_gflops"), None, Some(1.05));
        let c = evaluate(&x, "peak", &m, &ctx, None).unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive, "{:?}", c.reason);
        assert!(
            c.reason
                .unwrap()
                .contains("other programs kept 1.1 cores busy")
        );
        let x = expect("throughput", Some("peak.gemm_gflops"), Some(0.1), None);
        let c = evaluate(&x, "quiet", &m, &ctx, None).unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive);
    }

    fn metrics() -> Metrics {
        let mut m = Metrics::new();
        m.insert(
            "fp32".into(),
            BTreeMap::from([("throughput".into(), 100.0), ("cv".into(), 0.02)]),
        );
        m.insert(
            "fp16".into(),
            BTreeMap::from([("throughput".into(), 150.0), ("cv".into(), 0.12)]),
        );
        m
    }

    #[test]
    fn noise_bands() {
        // 4% apart with CVs of 3%: within 2 × 3%.
        assert!(within_noise(100.0, 96.0, 0.01, 0.03));
        // 10% apart: beyond it.
        assert!(!within_noise(100.0, 90.0, 0.01, 0.03));
        assert!(!within_noise(0.0, 0.0, 0.1, 0.1));
        // 100 ms over 50 ms, each off by up to 2 CV: 10% and 5% give 80/55 .. 120/45.
        let (least, most) = ratio_under_noise(100.0, 50.0, 0.10, 0.05);
        assert!((least - 80.0 / 55.0).abs() < 1e-12 && (most - 120.0 / 45.0).abs() < 1e-12);
        assert_eq!(ratio_under_noise(1.0, 1.0, 0.0, 0.5).1, f64::INFINITY);
    }

    #[test]
    fn ratios_ranges_and_noise() {
        let ctx = Context {
            device: "NVIDIA A100-SXM4-40GB",
            backend: BackendKind::Cuda,
        };
        let m = metrics();
        // 150 / 100 = 1.5 ≥ 1.3: pass.
        let c = evaluate(
            &expect("throughput", Some("fp32.throughput"), Some(1.3), None),
            "fp16",
            &m,
            &ctx,
            None,
        )
        .unwrap();
        assert_eq!((c.verdict, c.value), (Verdict::Pass, Some(1.5)));
        // Above 1.6 fails, with the hint kept.
        let c = evaluate(
            &expect("throughput", Some("fp32.throughput"), Some(1.6), None),
            "fp16",
            &m,
            &ctx,
            None,
        )
        .unwrap();
        assert_eq!(c.verdict, Verdict::Fail);
        assert_eq!(c.hint.as_deref(), Some("try again"));
        // The fp16 run's CV of 12% is above a 10% limit: inconclusive, not failed.
        let c = evaluate(
            &expect("throughput", Some("fp32.throughput"), Some(1.6), None),
            "fp16",
            &m,
            &ctx,
            Some(0.1),
        )
        .unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive);
        assert!(c.reason.unwrap().contains("too noisy"));
        // A step that sets no limit gets the default one: a multi-device run with one device
        // at CV 45% (its `cv`, the noisiest run's) judges no scaling efficiency.
        let mut noisy = m.clone();
        noisy.insert(
            "two".into(),
            BTreeMap::from([("scaling_efficiency".into(), 0.4), ("cv".into(), 0.45)]),
        );
        let x = expect("scaling_efficiency", None, Some(0.7), None);
        let c = evaluate(&x, "two", &noisy, &ctx, None).unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive, "{c:?}");
        assert!(
            c.reason
                .unwrap()
                .contains("above this step's limit of 15.0%")
        );
        // Not a timing: judged whatever the noise.
        let x = expect("cv", None, None, Some(0.3));
        let c = evaluate(&x, "two", &noisy, &ctx, None).unwrap();
        assert_eq!(c.verdict, Verdict::Fail);
        // A missing step is inconclusive with the reason.
        let c = evaluate(
            &expect("bf16.throughput", None, Some(1.0), None),
            "x",
            &m,
            &ctx,
            None,
        )
        .unwrap();
        assert_eq!(c.verdict, Verdict::Inconclusive);
        assert!(c.reason.unwrap().contains("step `bf16` has no results"));
        // Device globs win over backend ranges, which win over the fallback.
        let mut x = expect("throughput", None, Some(1000.0), None);
        x.backend = vec![BackendRange {
            backend: BackendKind::Cuda,
            min: Some(120.0),
            max: None,
        }];
        let c = evaluate(&x, "fp16", &m, &ctx, None).unwrap();
        assert_eq!(
            (c.verdict, c.range.as_str()),
            (Verdict::Pass, "backend cuda")
        );
        x.device = vec![DeviceRange {
            glob: "*A100*".into(),
            backend: None,
            min: Some(200.0),
            max: None,
        }];
        let c = evaluate(&x, "fp16", &m, &ctx, None).unwrap();
        assert_eq!(
            (c.verdict, c.range.as_str()),
            (Verdict::Fail, "device *A100*")
        );
        // A device range measured with another backend's kernels does not apply here.
        x.device[0].backend = Some(BackendKind::Hip);
        let c = evaluate(&x, "fp16", &m, &ctx, None).unwrap();
        assert_eq!(
            (c.verdict, c.range.as_str()),
            (Verdict::Pass, "backend cuda")
        );
        x.device[0].backend = Some(BackendKind::Cuda);
        let c = evaluate(&x, "fp16", &m, &ctx, None).unwrap();
        assert_eq!(c.range, "device *A100*");
        // A range with no bounds is not judged there: no check at all, even for a metric
        // the step did not measure; other devices still fall back to the default.
        x.device[0].min = None;
        let mut y = x.clone();
        y.metric = "ceiling_gflops".into();
        assert_eq!(evaluate(&y, "fp16", &m, &ctx, None), None);
        let elsewhere = Context {
            device: "NVIDIA H100 80GB HBM3",
            ..ctx
        };
        let c = evaluate(&y, "fp16", &m, &elsewhere, None).unwrap();
        assert_eq!(
            (c.verdict, c.range.as_str()),
            (Verdict::Inconclusive, "backend cuda")
        );
    }
}

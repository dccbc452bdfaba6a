//! What an MLPerf scenario run shows: a line per probe as it finishes, and the summary — the
//! latency percentiles, the rate, and for a server every probed rate with its queue and
//! compute share of the tail.

use comfy_table::{Cell, CellAlignment};

use super::new_table;
use crate::bench::record::BenchRecord;
use crate::bench::scenario::{Probe, Scenario, ScenarioRun};

/// One progress line per finished probe.
pub fn probe_line(p: &Probe) -> String {
    let rate = if p.target_qps > 0.0 {
        format!("Rate {:>9.1} q/s: ", p.target_qps)
    } else {
        String::new()
    };
    format!(
        "{rate}{} queries, p50 {:.2} ms, p99 {:.2} ms (p99 of the queue {:.2}, of compute {:.2}), mean batch {:.1}, {:.1} q/s served",
        p.queries,
        p.p50_ms,
        p.p99_ms,
        p.queue_p99_ms,
        p.compute_p99_ms,
        p.mean_batch,
        p.achieved_qps
    )
}

/// The summary of a scenario run.
pub fn summary(r: &BenchRecord, run: &ScenarioRun) -> String {
    let c = &r.config;
    let sc = &run.config;
    let p = run.reported();
    let line = "=".repeat(56);
    let mut s = format!(
        "{line}\nMLPerf-style {} scenario: {} {} on {} ({}), batches up to {}\n{line}\n",
        sc.scenario.name(),
        c.network,
        c.precision.name().to_uppercase(),
        r.environment.device.name,
        c.backend,
        run.max_batch
    );
    let batch_ms: Vec<String> = (run.batch_ms.iter())
        .map(|(b, ms)| format!("{b}: {ms:.2} ms"))
        .collect();
    s.push_str(&format!(
        "Batch times   {} (median, alone)\n",
        batch_ms.join(", ")
    ));
    if sc.scenario == Scenario::Server {
        let mut t = new_table();
        t.set_header(vec![
            "target q/s",
            "served q/s",
            "queries",
            "p50 ms",
            "p99 ms",
            "queue p99 ms",
            "compute p99 ms",
            "mean batch",
            "p99 ≤ bound",
        ]);
        for q in &run.probes {
            let num = |v: f64, d: usize| {
                Cell::new(format!("{v:.d$}")).set_alignment(CellAlignment::Right)
            };
            t.add_row(vec![
                num(q.target_qps, 1),
                num(q.achieved_qps, 1),
                num(q.queries as f64, 0),
                num(q.p50_ms, 2),
                num(q.p99_ms, 2),
                num(q.queue_p99_ms, 2),
                num(q.compute_p99_ms, 2),
                num(q.mean_batch, 2),
                Cell::new(if q.met { "yes" } else { "no" }),
            ]);
        }
        s.push_str(&format!("{t}\n"));
        s.push_str(&match run.best_qps {
            Some(q) => format!(
                "Best rate     {q:.1} queries/s with p99 {:.2} ms within the {} ms bound (p99 of the queue {:.2} ms, of compute {:.2} ms; mean batch {:.2})\n",
                p.p99_ms, sc.latency_bound_ms, p.queue_p99_ms, p.compute_p99_ms, p.mean_batch
            ),
            None => format!(
                "Best rate     none: even the lowest rate probed had p99 {:.2} ms, over the {} ms bound (one batch of 1 takes {:.2} ms)\n",
                p.p99_ms,
                sc.latency_bound_ms,
                run.batch_ms.first().map_or(0.0, |b| b.1)
            ),
        });
    } else {
        s.push_str(&format!(
            "Latency       p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms over {} queries\n\
             Throughput    {:.1} queries/s (images/s), mean batch {:.1}\n",
            p.p50_ms, p.p90_ms, p.p99_ms, p.queries, p.achieved_qps, p.mean_batch
        ));
    }
    if run.padded_batches > 0 {
        s.push_str(&format!(
            "Padded        {} batches ran on the next prepared size up (sessions for {})\n",
            run.padded_batches,
            run.batch_ms
                .iter()
                .map(|b| b.0.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    s.push_str(&format!(
        "Clock         the device's work is real and timed; arrivals and waits follow a clock \
         that advances by those times instead of sleeping\nRules         {}\n{line}",
        run.rules
    ));
    s
}

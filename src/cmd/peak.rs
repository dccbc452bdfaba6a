//! `workshop peak`: the machine's measured GEMM peak, memory bandwidth and compute ceiling.

use anyhow::{Result, bail};

use super::args::PeakArgs;
use crate::bench::peak::{self, ProbeSpec};
use crate::report;

pub fn run(a: PeakArgs) -> Result<()> {
    let spec = ProbeSpec {
        backend: a.backend,
        device: a.device,
        precision: a.precision,
        threads: a.threads,
        size: a.size,
        iterations: a.iterations,
        array_mib: a.array_mib,
    };
    let p = peak::probe(&spec)?;
    if a.json {
        let json = serde_json::json!({
            "gemm": p.gemm, "bandwidth": p.bandwidth, "theoretical": p.ceiling
        });
        println!("{json}");
    } else {
        let text = format!(
            "{}\n{}",
            report::machine::peak(&p.gemm, p.bandwidth.as_deref()),
            report::machine::ceiling(&p.gemm, p.ceiling.as_ref())
        );
        println!("{}", report::lines_for_terminal(&text));
    }
    if let Some(why) = p.refusal() {
        bail!("{why}");
    }
    // The measurement stands without the cache; say why it was not kept.
    match p.keep(&spec) {
        Ok(path) if !a.json => println!(
            "Kept for FLOPs profiles and exercises in {}",
            path.display()
        ),
        Ok(_) => {}
        Err(e) => eprintln!("warning: the result was not kept for later: {e:#}"),
    }
    Ok(())
}

//! `workshop peak`: the machine's measured GEMM peak, memory bandwidth and compute ceiling.

use anyhow::{Result, bail};

use super::args::PeakArgs;
use crate::bench::peak::{self, Kept, ProbeSpec};
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
        Ok(Kept::Now(path)) if !a.json => println!(
            "Kept for FLOPs profiles and exercises in {}",
            path.display()
        ),
        Ok(Kept::Now(_)) => {}
        Ok(Kept::Earlier { path, earlier, why }) => eprintln!(
            "note: not kept for later: {} while it ran. FLOPs profiles and exercises keep \
             the earlier, undisturbed {} in {}; measure again when the machine is quiet",
            why.join("; "),
            report::machine::kept_peak(&earlier),
            path.display()
        ),
        Err(e) => eprintln!("warning: the result was not kept for later: {e:#}"),
    }
    Ok(())
}

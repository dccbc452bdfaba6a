//! `workshop peak`: the machine's measured GEMM peak, memory bandwidth and compute ceiling.

use anyhow::{Result, bail};

use super::args::PeakArgs;
use crate::bench;
use crate::report;

pub fn run(a: PeakArgs) -> Result<()> {
    let (gemm, device) = bench::peak::gemm_on(
        a.backend,
        a.device,
        a.precision,
        a.threads,
        a.size,
        a.iterations,
    )?;
    let bandwidth =
        bench::peak::bandwidth_if_any(a.backend, a.device, a.array_mib, a.iterations, a.threads)?;
    // From the facts of the device that was measured (a GPU's SMs and clock, not the
    // host's), or measured on the CPU's cores.
    let ceiling = device.and_then(|d| bench::peak::theoretical(a.backend, &d, a.threads));
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "gemm": gemm, "bandwidth": bandwidth, "theoretical": ceiling })
        );
    } else {
        println!("{}", report::machine::peak(&gemm, bandwidth.as_deref()));
        println!(
            "{}",
            report::machine::ceiling(gemm.gflops, ceiling.as_ref())
        );
    }
    if gemm.validated == gemm.iterations {
        let kept = bench::peak::keep(
            a.backend,
            a.device,
            a.threads,
            &gemm,
            bandwidth.as_deref().unwrap_or_default(),
        );
        // The measurement stands without the cache; say why it was not kept.
        match kept {
            Ok(path) if !a.json => println!(
                "Kept for FLOPs profiles and exercises in {}",
                path.display()
            ),
            Ok(_) => {}
            Err(e) => eprintln!("warning: the result was not kept for later: {e:#}"),
        }
    }
    if gemm.validated < gemm.iterations {
        bail!(
            "{} of {} GEMM results did not match the reference: the throughput above does not count",
            gemm.iterations - gemm.validated,
            gemm.iterations
        );
    }
    Ok(())
}

//! The CPU's compute ceiling: the FMA throughput of its cores, measured on registers where
//! the SIMD paths in use have an FMA instruction, else estimated from the OS's clock and the
//! ISA's FLOPs per cycle. What profiles and `workshop peak` place the measured GEMM under.

use super::simd::{self, Simd};
use crate::backend::Theoretical;

/// The FP32 peak of `cores` CPU cores. Measured where the SIMD paths in use have an FMA
/// instruction: each core runs independent FMA chains on registers
/// ([`simd::fma_ceiling`]), which takes the clock the cores really run at (turbo, AVX
/// offsets, a VM's share) where the OS reports a nominal one, and the units' real width;
/// the clock that result implies at the ISA's FLOPs per cycle (`cpu_flops_per_cycle`) is
/// given next to the OS's. Elsewhere cores × the OS's clock × FLOPs per cycle, an estimate.
/// `None` when neither is known or the device is not the host CPU.
///
pub fn ceiling(features: &[String], cores: usize) -> Option<Theoretical> {
    let os_ghz = sysinfo::System::new().ok().and_then(|mut sys| {
        sys.refresh_cpu_list(sysinfo::CpuRefreshKind::nothing().with_frequency());
        let mhz = sys
            .cpus()
            .first()
            .map(|c| c.frequency())
            .filter(|&f| f > 0)?;
        Some(mhz as f64 / 1e3)
    });
    // The vector width of the paths in use (`WORKSHOP_CPU_SIMD` may choose a narrower one).
    let in_use = simd::simd();
    let features: Vec<String> = features
        .iter()
        .filter(|f| match f.as_str() {
            "AVX512F" => in_use >= Simd::Avx512,
            "AVX2" | "FMA" | "AVX" => in_use >= Simd::Avx2Fma,
            _ => true,
        })
        .cloned()
        .collect();
    let (per_cycle, isa) = cpu_flops_per_cycle(&features, amd_family_model());
    if let Some(gflops) = simd::fma_ceiling(cores) {
        let ghz = gflops / (cores as f64 * per_cycle as f64);
        // Far below the OS's clock, the chains shared the cores with another program.
        let os = os_ghz.map_or(String::new(), |g| match ghz < 0.7 * g {
            true => format!(
                ", far below the {g:.2} GHz the OS reports: another program is using these cores, so every figure measured now is low"
            ),
            false => format!(", the OS reports {g:.2} GHz"),
        });
        // Threads, not cores: two threads of one SMT core share its FMA units, and the
        // clock this implies per thread is then half the core's.
        let threads = threads(cores);
        return Some(Theoretical {
            name: "FP32 FMA ceiling".into(),
            gflops,
            how: format!(
                "FMA chains on registers, measured now on {threads}: {ghz:.2} GHz at {per_cycle} \
                 FLOP/cycle ({isa}){os}"
            ),
            measured: true,
        });
    }
    let ghz = os_ghz?;
    Some(Theoretical {
        name: String::new(),
        gflops: cores as f64 * ghz * per_cycle as f64,
        how: format!(
            "{cores} cores × {ghz:.2} GHz × {per_cycle} FLOP/cycle ({isa}); an estimate: the clock \
             is the one the OS reports, turbo and AVX clock offsets move it"
        ),
        measured: false,
    })
}

/// The BF16 ceiling of `cores` CPU cores where the BF16 GEMM multiplies pairs of bf16 values
/// in hardware: the throughput of its instruction (`vdpbf16ps` of AVX512_BF16, `tdpbf16ps` of
/// AMX's tiles) measured on registers ([`simd::bf16_ceiling`]), given against the FP32 FMA
/// ceiling measured the same way (one `vdpbf16ps` does twice an FMA's FLOPs; whether a core
/// runs it as fast as an FMA is what the ratio shows). `None` where BF16 is widened to FP32.
pub fn bf16_ceiling(cores: usize) -> Option<Theoretical> {
    let gflops = simd::bf16_ceiling(cores)?;
    let fp32 = simd::fma_ceiling(cores).map_or(String::new(), |f| {
        format!(", {:.2}× the FP32 FMA chains' {f:.0} GFLOP/s", gflops / f)
    });
    let (name, instruction, on) = match simd::simd() {
        Simd::Amx => ("BF16 AMX tile ceiling", "tdpbf16ps", "tiles"),
        _ => ("BF16 dot-product ceiling", "vdpbf16ps", "registers"),
    };
    let threads = threads(cores);
    Some(Theoretical {
        name: name.into(),
        gflops,
        how: format!("{instruction} chains on {on}, measured now on {threads}{fp32}"),
        measured: true,
    })
}

/// "1 thread", "2 threads": what a ceiling was measured on.
fn threads(n: usize) -> String {
    match n {
        1 => "1 thread".into(),
        _ => format!("{n} threads"),
    }
}

/// FP32 FLOPs per cycle and core from the vector ISA, assuming two FMA units per core (most
/// x86 server and desktop cores since Haswell), except on AMD cores whose units are narrower
/// than the ISA (`amd`: family and model): Zen and Zen+ (family 17h, models below 30h) split
/// each 256-bit operation into two 128-bit halves, and Zen 4 (family 19h) splits 512-bit ones;
/// Zen 5 EPYCs (family 1Ah) run them whole.
fn cpu_flops_per_cycle(features: &[String], amd: Option<(u32, u32)>) -> (u32, &'static str) {
    let has = |f: &str| features.iter().any(|x| x == f);
    let zen1 = matches!(amd, Some((0x17, model)) if model < 0x30);
    let zen4 = matches!(amd, Some((0x19, _)));
    if has("AVX512F") && zen4 {
        (32, "AVX-512 on 256-bit units: 8 lanes × 2 (FMA) × 2 units")
    } else if has("AVX512F") {
        (64, "AVX-512: 16 lanes × 2 (FMA) × 2 units")
    } else if has("AVX2") && has("FMA") && zen1 {
        (
            16,
            "AVX2 on Zen's 128-bit units: 4 lanes × 2 (FMA) × 2 units",
        )
    } else if has("AVX2") && has("FMA") {
        (32, "AVX2: 8 lanes × 2 (FMA) × 2 units")
    } else if has("AVX") {
        (16, "AVX: 8 lanes × (1 add + 1 mul)")
    } else if has("NEON") {
        (16, "NEON: 4 lanes × 2 (FMA) × 2 units")
    } else {
        (8, "SSE: 4 lanes × (1 add + 1 mul)")
    }
}

/// The host CPU's family and model when it is an AMD (or Hygon) x86 CPU, from CPUID.
fn amd_family_model() -> Option<(u32, u32)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: CPUID leaves 0 and 1 exist on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let (vendor, sig) = unsafe { (__cpuid(0), __cpuid(1).eax) };
        let name: Vec<u8> = [vendor.ebx, vendor.edx, vendor.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        if name != b"AuthenticAMD" && name != b"HygonGenuine" {
            return None;
        }
        let (base_family, base_model) = ((sig >> 8) & 0xf, (sig >> 4) & 0xf);
        let family = base_family
            + if base_family == 0xf {
                (sig >> 20) & 0xff
            } else {
                0
            };
        let model = base_model
            | if base_family == 0xf {
                ((sig >> 16) & 0xf) << 4
            } else {
                0
            };
        Some((family, model))
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FLOPs per cycle follow the ISA, halved where AMD cores split wide operations.
    #[test]
    fn cpu_flops_per_cycle_follow_the_isa_and_the_core() {
        let f = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let avx2 = f(&["AVX", "AVX2", "FMA"]);
        let avx512 = f(&["AVX", "AVX2", "FMA", "AVX512F"]);
        assert_eq!(cpu_flops_per_cycle(&avx2, None).0, 32);
        assert_eq!(cpu_flops_per_cycle(&avx2, Some((0x17, 0x01))).0, 16, "Zen");
        assert_eq!(cpu_flops_per_cycle(&avx2, Some((0x17, 0x08))).0, 16, "Zen+");
        assert_eq!(
            cpu_flops_per_cycle(&avx2, Some((0x17, 0x31))).0,
            32,
            "Zen 2"
        );
        assert_eq!(
            cpu_flops_per_cycle(&avx2, Some((0x19, 0x01))).0,
            32,
            "Zen 3"
        );
        assert_eq!(
            cpu_flops_per_cycle(&avx512, Some((0x19, 0x11))).0,
            32,
            "Zen 4"
        );
        // A Zen 5 EPYC (Turin) runs 512-bit FMAs whole: its measured ceiling implied 4.1 GHz
        // at 64 FLOP/cycle, its boost clock.
        assert_eq!(
            cpu_flops_per_cycle(&avx512, Some((0x1a, 0x02))).0,
            64,
            "Zen 5"
        );
        assert_eq!(cpu_flops_per_cycle(&avx512, None).0, 64);
        assert_eq!(cpu_flops_per_cycle(&f(&["AVX"]), None).0, 16);
        assert_eq!(cpu_flops_per_cycle(&[], None).0, 8);
    }
}

//! A GPU's arithmetic ceiling per precision from its own facts (SMs or CUs, the highest clock
//! its driver reports, and its architecture), with the rates per architecture in tables whose
//! sources the docs name: what `peak`, FLOPs profiles and the roofline judge a run against
//! where nothing measures the ceiling on the device.

use crate::backend::Theoretical;
use crate::model::Precision;

/// An NVIDIA GPU's peak for arithmetic in `precision`: SMs × clock × FLOPs per SM per clock
/// on the units that precision runs on, from the compute capability (`sm_XY` in the
/// features). FP32 on the ordinary cores: 64 lanes on sm_60, Volta, Turing and the A100
/// (sm_80), 128 on the rest from Pascal's sm_61 to Blackwell, 2 FLOPs per FMA. FP16 and BF16
/// on the tensor cores (dense, FP32 accumulation): [`tensor_flops_per_clock`].
pub fn nvidia(
    features: &[String],
    sms: usize,
    clock_mhz: u32,
    precision: Precision,
) -> Option<Theoretical> {
    let sm: u32 = features
        .iter()
        .find_map(|f| f.strip_prefix("sm_")?.parse().ok())?;
    let ghz = clock_mhz as f64 / 1e3;
    let (per_clock, units) = match precision {
        Precision::Fp32 => {
            let lanes = match sm {
                60 | 70..=75 | 80 => 64,
                _ => 128,
            };
            (
                2 * lanes,
                format!(
                    "{lanes} FP32 lanes × 2 (FMA), at the highest clock the driver reports; \
                     tensor cores (FP16, BF16, TF32) go well beyond this"
                ),
            )
        }
        Precision::Fp16 | Precision::Bf16 => {
            let flops = tensor_flops_per_clock(sm, precision)?;
            (
                flops,
                format!(
                    "{flops} {} FLOPs per SM per clock on tensor cores (dense, FP32 accumulation), \
                     at the highest clock the driver reports (data sheets quote a lower clock \
                     under tensor load)",
                    precision.name().to_uppercase()
                ),
            )
        }
    };
    Some(Theoretical {
        name: String::new(),
        gflops: sms as f64 * ghz * per_clock as f64,
        how: format!("{sms} SMs × {ghz:.2} GHz × {units}"),
        measured: false,
    })
}

/// Dense FP16/BF16 tensor-core FLOPs per SM per clock with FP32 accumulation, for the
/// data-centre architectures whose every part runs them at full rate: Volta (sm_70, FP16 only:
/// 8 tensor cores × 64 FMAs), the A100 (sm_80: 4 × 256) and Hopper (sm_90: 4 × 512; wgmma's rate,
/// which mma.sync kernels such as ours do not reach). `None` elsewhere: the consumer parts of
/// Turing, Ampere and Ada halve the rate with FP32 accumulation where the professional ones
/// do not, and the SM version does not tell them apart.
pub fn tensor_flops_per_clock(sm: u32, precision: Precision) -> Option<u32> {
    match (sm, precision) {
        (70, Precision::Fp16) => Some(1024),
        (80, _) => Some(2048),
        (90, _) => Some(4096),
        _ => None,
    }
}

/// An AMD GPU's peak for arithmetic in `precision`: CUs × clock × FLOPs per CU per clock on
/// the units that precision runs on, from the gfx target (`gfx942:sramecc+:xnack-` in the
/// features; [`amd_flops_per_clock`]). FP32 on the vector units; FP16 and BF16 on the matrix
/// cores (MFMA on CDNA, WMMA on RDNA 3: dense, FP32 accumulation), packed vector math where a
/// target has none. Our HIP kernels multiply FP16 and BF16 on the vector units, so their share
/// of this ceiling is small: that is what the matrix cores would add.
pub fn amd(
    features: &[String],
    cus: usize,
    clock_mhz: u32,
    precision: Precision,
) -> Option<Theoretical> {
    let target = features
        .iter()
        .map(|f| super::arch::base_target(f))
        .find(|f| f.starts_with("gfx"))?;
    let (flops, units) = amd_flops_per_clock(target, precision)?;
    let ghz = clock_mhz as f64 / 1e3;
    Some(Theoretical {
        name: String::new(),
        gflops: cus as f64 * ghz * flops as f64,
        how: format!(
            "{cus} CUs × {ghz:.2} GHz × {flops} {} FLOPs per CU per clock on {units} \
             ({target}), at the highest clock the driver reports",
            precision.name().to_uppercase()
        ),
        measured: false,
    })
}

/// Dense FLOPs per CU per clock, and the units, by gfx target and precision. From AMD's data
/// sheets at their peak engine clock (CUs × clock × this = the sheet's figure):
/// - gfx908 (MI100, 120 CUs, 1502 MHz): FP32 vector 23.1 TFLOP/s, FP16 matrix 184.6, BF16
///   matrix 92.3.
/// - gfx90a (MI210/MI250/MI250X; MI250X 220 CUs, 1700 MHz): FP32 vector 47.9 (95.7 packed,
///   `v_pk_fma_f32`), FP16 and BF16 matrix 383.
/// - gfx940/941/942 (MI300A/MI300X/MI325X; MI300X 304 CUs, 2100 MHz): FP32 vector 163.4, FP16
///   and BF16 matrix 1307.4.
/// - gfx950 (MI350X/MI355X; MI355X 256 CUs, 2400 MHz): FP32 vector 157.3, FP16 and BF16
///   matrix 2516.6.
/// - gfx11xx (RDNA 3; RX 7900 XTX 96 CUs, 2500 MHz): FP32 61.4 (dual issue), FP16 and BF16
///   WMMA 122.8.
/// - gfx10xx and gfx9 GCN (RX 6900 XT, MI50): FP32 on the vector units, FP16 packed at twice
///   that (MI50 60 CUs, 1725 MHz: 13.3 and 26.5); no BF16 arithmetic.
pub fn amd_flops_per_clock(target: &str, precision: Precision) -> Option<(u32, &'static str)> {
    let family = |p: &str| target.starts_with(p);
    let (fp32, half, bf16, units) = if target == "gfx908" {
        (128, 1024, 512, "MFMA matrix cores")
    } else if target == "gfx90a" {
        (128, 1024, 1024, "MFMA matrix cores")
    } else if family("gfx94") {
        (256, 2048, 2048, "MFMA matrix cores")
    } else if target == "gfx950" {
        (256, 4096, 4096, "MFMA matrix cores")
    } else if family("gfx11") {
        (256, 512, 512, "WMMA")
    } else if family("gfx10") || family("gfx9") {
        (128, 256, 0, "packed vector FP16")
    } else {
        return None;
    };
    match precision {
        Precision::Fp32 => Some((fp32, "the vector units")),
        Precision::Fp16 => Some((half, units)),
        Precision::Bf16 => (bf16 > 0).then_some((bf16, units)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_theoretical_peaks_follow_the_compute_capability() {
        let sm = |s: &str| vec![s.to_string()];
        // H100 SXM: 132 SMs at 1980 MHz, 128 lanes: 66.9 TFLOP/s, its specification.
        use Precision::*;
        let h100 = nvidia(&sm("sm_90"), 132, 1980, Fp32).unwrap();
        assert!((h100.gflops - 66_908.16).abs() < 0.01, "{}", h100.gflops);
        assert!(
            h100.how.contains("132 SMs × 1.98 GHz × 128 FP32 lanes"),
            "{}",
            h100.how
        );
        // Its tensor cores: 4096 FLOPs per SM per clock, 989 TFLOP/s at the data sheet's
        // 1830 MHz; the same for BF16.
        let h100_fp16 = nvidia(&sm("sm_90"), 132, 1830, Fp16).unwrap();
        assert!((h100_fp16.gflops - 989_429.76).abs() < 0.01);
        assert!(
            h100_fp16
                .how
                .contains("4096 FP16 FLOPs per SM per clock on tensor cores")
        );
        let bf16 = nvidia(&sm("sm_90"), 132, 1830, Bf16).unwrap();
        assert_eq!(bf16.gflops, h100_fp16.gflops);
        // A100: 108 SMs at 1410 MHz, 64 lanes: 19.5 TFLOP/s; tensor cores 312.
        let a100 = nvidia(&sm("sm_80"), 108, 1410, Fp32).unwrap();
        assert!((a100.gflops - 19_491.84).abs() < 0.01, "{}", a100.gflops);
        let a100 = nvidia(&sm("sm_80"), 108, 1410, Bf16).unwrap();
        assert!((a100.gflops - 311_869.44).abs() < 0.01, "{}", a100.gflops);
        // V100: FP16 tensor cores (125 TFLOP/s at 1530 MHz), no BF16 ones; a consumer
        // architecture's rate is not known from its SM version.
        let v100 = nvidia(&sm("sm_70"), 80, 1530, Fp16).unwrap();
        assert!((v100.gflops - 125_337.6).abs() < 0.01, "{}", v100.gflops);
        assert!(nvidia(&sm("sm_70"), 80, 1530, Bf16).is_none());
        assert!(nvidia(&sm("sm_89"), 128, 2520, Fp16).is_none());
        assert!(nvidia(&sm("emulated"), 1, 1000, Fp32).is_none());
    }

    #[test]
    fn amd_theoretical_peaks_follow_the_gfx_target() {
        use Precision::*;
        let gfx = |s: &str| vec![s.to_string()];
        let close = |t: Option<Theoretical>, want: f64| {
            let got = t.unwrap().gflops;
            assert!((got - want).abs() < 0.001 * want, "{got} against {want}");
        };
        // The data sheets' figures, from CUs, the peak engine clock and the target alone.
        let mi300x = gfx("gfx942:sramecc+:xnack-");
        close(amd(&mi300x, 304, 2100, Fp32), 163_430.0);
        close(amd(&mi300x, 304, 2100, Fp16), 1_307_400.0);
        close(amd(&mi300x, 304, 2100, Bf16), 1_307_400.0);
        close(amd(&gfx("gfx90a"), 220, 1700, Fp32), 47_900.0);
        close(amd(&gfx("gfx90a"), 220, 1700, Bf16), 383_000.0);
        close(amd(&gfx("gfx908"), 120, 1502, Fp16), 184_600.0);
        close(amd(&gfx("gfx908"), 120, 1502, Bf16), 92_300.0);
        close(amd(&gfx("gfx950"), 256, 2400, Fp16), 2_516_600.0);
        close(amd(&gfx("gfx1100"), 96, 2500, Fp32), 61_440.0);
        close(amd(&gfx("gfx1100"), 96, 2500, Fp16), 122_880.0);
        close(amd(&gfx("gfx906"), 60, 1725, Fp16), 26_500.0);
        let how = amd(&mi300x, 304, 2100, Bf16).unwrap().how;
        assert!(
            how.contains("304 CUs × 2.10 GHz × 2048 BF16 FLOPs per CU per clock on MFMA matrix cores (gfx942)"),
            "{how}"
        );
        // No BF16 arithmetic before CDNA and RDNA 3; unknown targets have no ceiling.
        assert!(amd(&gfx("gfx1030"), 80, 2250, Bf16).is_none());
        assert!(amd(&gfx("gfx801"), 8, 1000, Fp32).is_none());
        assert!(amd(&gfx("emulated"), 1, 1000, Fp32).is_none());
    }
}

//! Which target the runtime compilers build for: NVRTC's virtual architecture from a CUDA
//! device's compute capability, and hiprtc's gfx target from an AMD device's name, checked
//! against what the installed ROCm knows (hiprtc aborts the whole process on a target it does
//! not know, e.g. gfx940/942/1100 with ROCm 5.2).

/// NVRTC's `--gpu-architecture` for a compute capability: PTX for the virtual architecture,
/// which the driver compiles for the exact device when it loads the module.
pub fn cuda_arch((major, minor): (i32, i32)) -> String {
    format!("compute_{major}{minor}")
}

/// The virtual architecture to build a device of compute capability `cc` for, given the ones
/// this NVRTC supports (`supported`, as 75, 80, 90, ...; empty when NVRTC cannot say): its own
/// when listed, else the newest older one (PTX runs on later devices: the driver compiles it),
/// or why there is none (NVRTC 13 dropped compute_70 and older).
pub fn cuda_target(cc: (i32, i32), supported: &[i32]) -> Result<String, String> {
    let own = cc.0 * 10 + cc.1;
    if supported.is_empty() || supported.contains(&own) {
        return Ok(cuda_arch(cc));
    }
    match supported.iter().copied().filter(|&a| a < own).max() {
        Some(a) => Ok(format!("compute_{a}")),
        None => Err(format!(
            "this NVRTC builds for compute_{} and newer, not for compute_{own} (compute \
             capability {}.{}): use an NVRTC of an older CUDA release for this GPU",
            supported.iter().min().copied().unwrap_or_default(),
            cc.0,
            cc.1
        )),
    }
}

/// `gfx90a:sramecc+:xnack-` → `gfx90a`.
pub fn base_target(arch: &str) -> &str {
    arch.split(':').next().unwrap_or(arch)
}

/// Whether our matrix kernels run on target `arch`'s matrix cores: MFMA 16×16×16 in FP16 and
/// BF16 (`_1k`) exists from CDNA 2 on (gfx90a, gfx94x, gfx950; the HIP dialect file keeps the
/// same list). gfx908 (MI100) has MFMA but not the BF16 step of that shape, and RDNA's WMMA
/// works per wavefront of 32 on other layouts: both keep the vector-unit kernels.
pub fn has_mfma(arch: &str) -> bool {
    matches!(
        base_target(arch),
        "gfx90a" | "gfx940" | "gfx941" | "gfx942" | "gfx950"
    )
}

/// The gfx targets a ROCm release's hiprtc compiles for.
pub fn known_targets((major, minor): (i32, i32)) -> Vec<&'static str> {
    let v = (major, minor);
    let mut t = vec![
        "gfx803", "gfx900", "gfx906", "gfx908", "gfx90a", "gfx1010", "gfx1011", "gfx1012",
        "gfx1030", "gfx1031", "gfx1032", "gfx1034", "gfx1035",
    ];
    if v >= (5, 5) {
        t.extend([
            "gfx940", "gfx941", "gfx942", "gfx1100", "gfx1101", "gfx1102",
        ]);
    }
    if v >= (6, 3) {
        t.extend(["gfx1200", "gfx1201"]);
    }
    if v >= (6, 4) {
        t.push("gfx950");
    }
    t
}

/// The target to hand hiprtc for device `arch` (its full name, features included, so the code
/// object matches the device), or why this ROCm cannot build for it.
pub fn hip_target(arch: &str, rocm: (i32, i32)) -> Result<&str, String> {
    let known = known_targets(rocm);
    if known.contains(&base_target(arch)) {
        Ok(arch)
    } else {
        Err(format!(
            "this ROCm's hiprtc ({}.{}) does not know the target {arch}; it knows {}",
            rocm.0,
            rocm.1,
            known.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_targets_follow_the_compute_capability() {
        assert_eq!(cuda_arch((9, 0)), "compute_90");
        assert_eq!(cuda_arch((8, 6)), "compute_86");
    }

    #[test]
    fn cuda_targets_fall_back_to_what_this_nvrtc_supports() {
        let nvrtc13 = [75, 80, 86, 87, 89, 90, 100, 103, 120];
        assert_eq!(cuda_target((9, 0), &nvrtc13).unwrap(), "compute_90");
        assert_eq!(cuda_target((9, 0), &[]).unwrap(), "compute_90");
        // A device newer than this NVRTC: the newest PTX it can write, JIT-compiled by the driver.
        assert_eq!(cuda_target((12, 1), &nvrtc13).unwrap(), "compute_120");
        assert_eq!(cuda_target((10, 1), &[70, 80, 90]).unwrap(), "compute_90");
        let e = cuda_target((7, 0), &nvrtc13).unwrap_err();
        assert!(
            e.contains("compute_75 and newer, not for compute_70"),
            "{e}"
        );
    }

    #[test]
    fn hip_targets_are_refused_when_this_rocm_would_abort_on_them() {
        assert_eq!(
            hip_target("gfx90a:sramecc+:xnack-", (5, 2)),
            Ok("gfx90a:sramecc+:xnack-")
        );
        assert_eq!(hip_target("gfx1030", (5, 2)), Ok("gfx1030"));
        let e = hip_target("gfx942:sramecc+:xnack-", (5, 2)).unwrap_err();
        assert!(
            e.contains("(5.2) does not know the target gfx942") && e.contains("gfx90a"),
            "{e}"
        );
        assert!(hip_target("gfx942", (6, 0)).is_ok());
        assert!(hip_target("gfx1100", (5, 2)).is_err());
        assert!(hip_target("gfx950", (6, 2)).is_err());
        assert!(hip_target("gfx950", (6, 4)).is_ok());
    }

    #[test]
    fn matrix_cores_from_cdna2_on() {
        assert!(has_mfma("gfx90a:sramecc+:xnack-"));
        assert!(has_mfma("gfx942"));
        assert!(!has_mfma("gfx908"));
        assert!(!has_mfma("gfx1100"));
    }
}

//! AMD GPUs through the amdgpu driver's sysfs files — the ones ROCm SMI reads: the DPM clock
//! tables (`pp_dpm_sclk`, `pp_dpm_mclk`, the current level marked `*`) and the hwmon sensors
//! (temperatures in m°C, power in µW, energy in µJ where the card has a counter). No library
//! to load and no ABI that changes between ROCm releases; throttle reasons live in the binary
//! `gpu_metrics` table, whose layout does, so they are not read: a low clock is still judged.

use std::path::{Path, PathBuf};

use super::linux::glob_values;
use super::{Reader, Reading};

/// One AMD card under `root`'s `sys/class/drm`.
pub struct AmdGpu {
    device: PathBuf,
    rated_mhz: Option<f64>,
}

impl AmdGpu {
    /// HIP device `device` on this machine (`HIP_VISIBLE_DEVICES` or `ROCR_VISIBLE_DEVICES`
    /// as indices followed).
    pub fn system(device: usize) -> Result<AmdGpu, String> {
        let list = std::env::var("HIP_VISIBLE_DEVICES")
            .or_else(|_| std::env::var("ROCR_VISIBLE_DEVICES"))
            .ok();
        AmdGpu::at("/", super::visible(list.as_deref(), device))
    }

    /// The `index`-th AMD card (vendor 0x1002) under `root`, in PCI order (HIP's).
    pub fn at(root: impl AsRef<Path>, index: usize) -> Result<AmdGpu, String> {
        let drm = root.as_ref().join("sys/class/drm");
        let mut cards: Vec<(String, PathBuf)> = std::fs::read_dir(&drm)
            .map_err(|e| format!("cannot read {}: {e}", drm.display()))?
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_prefix("card")
                    .is_some_and(|n| n.parse::<u32>().is_ok())
            })
            .map(|e| e.path().join("device"))
            .filter(|d| {
                std::fs::read_to_string(d.join("vendor")).is_ok_and(|v| v.trim() == "0x1002")
            })
            .map(|d| {
                // The PCI address the device link points at orders the cards as HIP does.
                let pci = std::fs::canonicalize(&d)
                    .ok()
                    .and_then(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
                    .unwrap_or_default();
                (pci, d)
            })
            .collect();
        cards.sort();
        let count = cards.len();
        let (_, device) = cards
            .into_iter()
            .nth(index)
            .ok_or_else(|| format!("no AMD GPU {index} in {} ({count} found)", drm.display()))?;
        let rated_mhz = levels(&device, "pp_dpm_sclk")
            .map(|(all, _)| all.into_iter().fold(0.0, f64::max))
            .filter(|&m| m > 0.0);
        Ok(AmdGpu { device, rated_mhz })
    }
}

/// A DPM table's levels in MHz and the current one (`1: 1700Mhz *`).
fn levels(device: &Path, table: &str) -> Option<(Vec<f64>, Option<f64>)> {
    let text = std::fs::read_to_string(device.join(table)).ok()?;
    let mut all = Vec::new();
    let mut current = None;
    for line in text.lines() {
        let Some((_, rest)) = line.split_once(':') else {
            continue;
        };
        let mhz = rest.trim().trim_end_matches('*').trim();
        let digits = mhz.trim_end_matches(|c: char| c.is_ascii_alphabetic());
        if let Ok(v) = digits.trim().parse::<f64>() {
            all.push(v);
            if rest.trim_end().ends_with('*') {
                current = Some(v);
            }
        }
    }
    Some((all, current))
}

impl Reader for AmdGpu {
    fn source(&self) -> String {
        format!("amdgpu sysfs ({})", self.device.display())
    }

    fn rated_clock_mhz(&self) -> Option<f64> {
        self.rated_mhz
    }

    fn read(&mut self) -> Reading {
        let hwmon = |name: &str| glob_values(&self.device, &format!("hwmon/hwmon*/{name}"));
        let first = |v: Vec<f64>| v.first().copied();
        Reading {
            clock_mhz: levels(&self.device, "pp_dpm_sclk").and_then(|(_, c)| c),
            memory_clock_mhz: levels(&self.device, "pp_dpm_mclk").and_then(|(_, c)| c),
            temperature_c: hwmon("temp*_input")
                .into_iter()
                .reduce(f64::max)
                .map(|m| m / 1e3),
            power_w: first(hwmon("power1_average"))
                .or_else(|| first(hwmon("power1_input")))
                .map(|uw| uw / 1e6),
            energy_j: first(hwmon("energy1_input")).map(|uj| uj / 1e6),
            ..Reading::default()
        }
    }
}

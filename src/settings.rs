//! The `WORKSHOP_*` environment variables: every one is named, parsed and checked here, once
//! per process, with one rule for all: unset or empty means the default, and any other value
//! that is not one of the accepted ones is an error naming the variable and what it accepts.
//! The command layer checks them before it does anything ([`check`]); the engine reads them
//! through [`get`] and never looks at the environment itself.

use std::path::PathBuf;
use std::sync::OnceLock;

/// A variable with a value it does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: {why} (accepted: {accepted})")]
pub struct SettingError {
    pub var: &'static str,
    pub value: String,
    pub why: String,
    pub accepted: &'static str,
}

/// The variables, what they accept and what they do (ARCHITECTURE.md's table lists each; a test
/// keeps the two in step).
pub const VARIABLES: [(&str, &str, &str); 6] = [
    (
        CPU_SIMD,
        CPU_SIMD_ACCEPTS,
        "force the CPU kernels onto a lesser SIMD path than the CPU's best",
    ),
    (
        CPU_SPLIT,
        CPU_SPLIT_ACCEPTS,
        "the CPU backend's batch tiles: off, or where to cut and how many images a tile",
    ),
    (
        GPU_EMULATOR,
        GPU_EMULATOR_ACCEPTS,
        "run the cuda and hip kernels on the host CPU (testing; timings mean nothing)",
    ),
    (
        CACHE_DIR,
        "a folder",
        "where measured peaks, autotune choices and compiled PTX are kept",
    ),
    (FONT, "a TrueType file", "the font charts are drawn with"),
    (
        PYTHON,
        "a Python interpreter",
        "the Python that runs PyTorch for `--framework pytorch` (default: python3)",
    ),
];

pub const CPU_SIMD: &str = "WORKSHOP_CPU_SIMD";
const CPU_SIMD_ACCEPTS: &str = "portable, avx2, avx512, avx512bf16, amx";
pub const CPU_SPLIT: &str = "WORKSHOP_CPU_SPLIT";
const CPU_SPLIT_ACCEPTS: &str = "off, or NODE:IMAGES[,NODE:IMAGES…] such as layer2.3.relu:4";
pub const GPU_EMULATOR: &str = "WORKSHOP_GPU_EMULATOR";
const GPU_EMULATOR_ACCEPTS: &str = "1 (on) or 0 (off)";
pub const CACHE_DIR: &str = "WORKSHOP_CACHE_DIR";
pub const FONT: &str = "WORKSHOP_FONT";
pub const PYTHON: &str = "WORKSHOP_PYTHON";

/// The SIMD paths `WORKSHOP_CPU_SIMD` can ask for, least to most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdChoice {
    Portable,
    Avx2,
    Avx512,
    Avx512Bf16,
    Amx,
}

/// The CPU backend's batch tiles as `WORKSHOP_CPU_SPLIT` sets them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum SplitChoice {
    /// Planned for this CPU's last-level cache.
    #[default]
    Auto,
    /// No tiles.
    Off,
    /// Cut after the last node named `.0`, in tiles of `.1` images; levels in network order.
    Levels(Vec<(String, usize)>),
}

impl SplitChoice {
    /// `off`, or `NODE:IMAGES[,NODE:IMAGES…]` (`WORKSHOP_CPU_SPLIT`'s syntax, also the names
    /// max-autotune gives the splits it times); the reason where it is neither.
    pub fn parse(v: &str) -> Result<SplitChoice, String> {
        if v == "off" {
            return Ok(SplitChoice::Off);
        }
        let levels = v.split(',').map(|level| {
            let (node, tile) = (level.split_once(':'))
                .ok_or_else(|| format!("`{level}` is neither `off` nor NODE:IMAGES"))?;
            let tile = tile.parse::<usize>().ok().filter(|&t| t > 0);
            let tile = tile.ok_or_else(|| format!("`{level}`: not a positive number of images"))?;
            Ok((node.to_string(), tile))
        });
        Ok(SplitChoice::Levels(levels.collect::<Result<_, String>>()?))
    }
}

/// Every setting, parsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    pub cpu_simd: Option<SimdChoice>,
    pub cpu_split: SplitChoice,
    pub gpu_emulator: bool,
    pub cache_dir: Option<PathBuf>,
    pub font: Option<PathBuf>,
    pub python: Option<PathBuf>,
}

impl Settings {
    /// Parse the settings from a lookup of variables (the environment, or a test's map).
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingError> {
        let var = |k: &str| var(k).filter(|v| !v.is_empty());
        let bad = |v: &'static str, value: &str, why: String, accepted| SettingError {
            var: v,
            value: value.to_string(),
            why,
            accepted,
        };
        let cpu_simd = match var(CPU_SIMD).as_deref() {
            None => None,
            Some("portable") => Some(SimdChoice::Portable),
            Some("avx2") => Some(SimdChoice::Avx2),
            Some("avx512") => Some(SimdChoice::Avx512),
            Some("avx512bf16") => Some(SimdChoice::Avx512Bf16),
            Some("amx") => Some(SimdChoice::Amx),
            Some(other) => {
                return Err(bad(
                    CPU_SIMD,
                    other,
                    "not a SIMD path".into(),
                    CPU_SIMD_ACCEPTS,
                ));
            }
        };
        let cpu_split = match var(CPU_SPLIT) {
            None => SplitChoice::Auto,
            Some(v) => {
                SplitChoice::parse(&v).map_err(|why| bad(CPU_SPLIT, &v, why, CPU_SPLIT_ACCEPTS))?
            }
        };
        let gpu_emulator = match var(GPU_EMULATOR).as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(other) => {
                return Err(bad(
                    GPU_EMULATOR,
                    other,
                    "not a switch".into(),
                    GPU_EMULATOR_ACCEPTS,
                ));
            }
        };
        Ok(Settings {
            cpu_simd,
            cpu_split,
            gpu_emulator,
            cache_dir: var(CACHE_DIR).map(PathBuf::from),
            font: var(FONT).map(PathBuf::from),
            python: var(PYTHON).map(PathBuf::from),
        })
    }
}

/// The settings of this process, parsed from the environment the first time they are asked
/// for.
pub fn get() -> Result<&'static Settings, SettingError> {
    static SETTINGS: OnceLock<Result<Settings, SettingError>> = OnceLock::new();
    SETTINGS
        .get_or_init(|| Settings::parse(|k| std::env::var(k).ok()))
        .as_ref()
        .map_err(Clone::clone)
}

/// Refuse a bad variable before a command starts (the command layer calls this first).
pub fn check() -> Result<(), SettingError> {
    get().map(|_| ())
}

/// The cache folder: `$WORKSHOP_CACHE_DIR`, else `$XDG_CACHE_HOME/workshop` or
/// `~/.cache/workshop`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    get()
        .ok()
        .and_then(|s| s.cache_dir.clone())
        .or_else(|| var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("workshop")))
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache/workshop")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(pairs: &[(&str, &str)]) -> Result<Settings, SettingError> {
        Settings::parse(|k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn unset_and_empty_mean_the_defaults() {
        assert_eq!(parse(&[]).unwrap(), Settings::default());
        let empty = [(CPU_SIMD, ""), (CPU_SPLIT, ""), (GPU_EMULATOR, "")];
        assert_eq!(parse(&empty).unwrap(), Settings::default());
    }

    #[test]
    fn values_parse() {
        let s = parse(&[
            (CPU_SIMD, "avx2"),
            (CPU_SPLIT, "layer1.0.relu:1,layer2.1.relu:2"),
            (GPU_EMULATOR, "1"),
        ])
        .unwrap();
        assert_eq!(s.cpu_simd, Some(SimdChoice::Avx2));
        assert_eq!(
            s.cpu_split,
            SplitChoice::Levels(vec![
                ("layer1.0.relu".into(), 1),
                ("layer2.1.relu".into(), 2)
            ])
        );
        assert!(s.gpu_emulator);
        assert_eq!(
            parse(&[(CPU_SPLIT, "off")]).unwrap().cpu_split,
            SplitChoice::Off
        );
    }

    /// ARCHITECTURE.md documents every variable, with what it accepts.
    #[test]
    fn every_variable_is_documented() {
        let doc = include_str!("../ARCHITECTURE.md");
        for (var, accepts, _) in VARIABLES {
            let row = doc.lines().find(|l| l.starts_with(&format!("| `{var}` |")));
            let row = row.unwrap_or_else(|| panic!("ARCHITECTURE.md has no row for {var}"));
            assert!(
                accepts
                    .split(", ")
                    .all(|a| row.contains(a.split(' ').next().unwrap())),
                "{var}: the row does not list {accepts}: {row}"
            );
        }
    }

    /// Every variable refuses a value it does not accept, and the error names the variable and
    /// what it accepts (issue 26: a bad WORKSHOP_CPU_SIMD used to warn and go on).
    #[test]
    fn bad_values_name_the_variable_and_the_choices() {
        for (var, value, accepted) in [
            (CPU_SIMD, "avx9000", "portable, avx2"),
            (CPU_SPLIT, "layer1", "NODE:IMAGES"),
            (CPU_SPLIT, "layer1:0", "NODE:IMAGES"),
            (GPU_EMULATOR, "yes", "1 (on)"),
        ] {
            let e = parse(&[(var, value)]).unwrap_err().to_string();
            assert!(e.starts_with(var), "{e}");
            assert!(e.contains(value) && e.contains(accepted), "{e}");
        }
    }
}

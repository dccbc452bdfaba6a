//! The CPU's state from Linux's files: `/proc/stat` (all CPU time, the hypervisor's steal),
//! `/proc/self/stat` (ours), cpufreq's core frequencies, thermal zones, RAPL's energy counters
//! (`/sys/class/powercap`) and the package throttle counters. Virtual machines often have only
//! `/proc`: the rest is then `None`.

use std::path::{Path, PathBuf};

use super::{Reader, Reading};

/// Reads a Linux system under `root` (`/` on the machine itself).
pub struct Linux {
    root: PathBuf,
    cores: usize,
    rated_mhz: Option<f64>,
    last: Option<Counters>,
}

/// Cumulative counters, in `/proc/stat`'s ticks (the energy in µJ).
#[derive(Clone, Copy)]
struct Counters {
    total: u64,
    busy: u64,
    steal: u64,
    own: Option<u64>,
    throttles: Option<u64>,
}

impl Linux {
    /// This machine.
    pub fn system() -> Result<Linux, String> {
        if !cfg!(target_os = "linux") {
            return Err("CPU telemetry reads Linux's /proc and /sys: not on this OS".into());
        }
        Linux::at("/")
    }

    /// The system whose `/proc` and `/sys` are under `root`.
    pub fn at(root: impl Into<PathBuf>) -> Result<Linux, String> {
        let root = root.into();
        let stat = read(&root, "proc/stat")
            .ok_or_else(|| format!("cannot read {}", root.join("proc/stat").display()))?;
        let cores = stat
            .lines()
            .filter(|l| {
                l.strip_prefix("cpu")
                    .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
            })
            .count()
            .max(1);
        let rated_mhz = per_cpu(&root, "cpufreq/cpuinfo_max_freq")
            .into_iter()
            .reduce(f64::max)
            .map(|khz| khz / 1e3);
        Ok(Linux {
            root,
            cores,
            rated_mhz,
            last: None,
        })
    }

    fn counters(&self) -> Option<Counters> {
        let stat = read(&self.root, "proc/stat")?;
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        // user nice system idle iowait irq softirq steal (guest time is inside user already)
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        if v.len() < 8 {
            return None;
        }
        let total: u64 = v.iter().sum();
        let (idle, steal) = (v[3] + v[4], v[7]);
        Some(Counters {
            total,
            busy: total - idle - steal,
            steal,
            own: own_ticks(&self.root),
            throttles: {
                let n = per_cpu(&self.root, "thermal_throttle/package_throttle_count");
                (!n.is_empty()).then(|| n.iter().sum::<f64>() as u64)
            },
        })
    }
}

impl Reader for Linux {
    fn source(&self) -> String {
        "Linux /proc and /sys".into()
    }

    fn rated_clock_mhz(&self) -> Option<f64> {
        self.rated_mhz
    }

    fn cores(&self) -> Option<usize> {
        Some(self.cores)
    }

    fn reports_throttling(&self) -> bool {
        self.last.is_some_and(|c| c.throttles.is_some())
    }

    fn read(&mut self) -> Reading {
        let now = self.counters();
        let mut r = Reading::default();
        if let (Some(a), Some(b)) = (self.last, now) {
            let total = b.total.saturating_sub(a.total);
            if total > 0 {
                let cores = self.cores as f64;
                if let (Some(oa), Some(ob)) = (a.own, b.own) {
                    let busy = b.busy.saturating_sub(a.busy);
                    let others = busy.saturating_sub(ob.saturating_sub(oa));
                    r.other_cores = Some(others as f64 / total as f64 * cores);
                }
                r.steal = Some(b.steal.saturating_sub(a.steal) as f64 / total as f64);
            }
            if let (Some(ta), Some(tb)) = (a.throttles, b.throttles)
                && tb > ta
            {
                r.throttle.push("thermal (package)".into());
            }
        }
        if now.is_some() {
            self.last = now;
        }
        let freqs = per_cpu(&self.root, "cpufreq/scaling_cur_freq");
        if !freqs.is_empty() {
            r.clock_mhz = Some(freqs.iter().sum::<f64>() / freqs.len() as f64 / 1e3);
        }
        r.temperature_c = glob_values(&self.root, "sys/class/thermal/thermal_zone*/temp")
            .into_iter()
            .reduce(f64::max)
            .map(|m| m / 1e3);
        // The packages' counters (intel-rapl:N; their subzones intel-rapl:N:M are inside).
        let energy = glob_values(&self.root, "sys/class/powercap/intel-rapl:[0-9]/energy_uj");
        if !energy.is_empty() {
            r.energy_j = Some(energy.iter().sum::<f64>() / 1e6);
        }
        r
    }
}

/// Our process's user + system time, in ticks (fields 14 and 15 of `/proc/self/stat`; the
/// command name in parentheses may hold spaces, so count after its closing one).
fn own_ticks(root: &Path) -> Option<u64> {
    let stat = read(root, "proc/self/stat")?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn read(root: &Path, rel: &str) -> Option<String> {
    std::fs::read_to_string(root.join(rel)).ok()
}

/// The numbers in `sys/devices/system/cpu/cpuN/<rel>` for every core that has the file.
fn per_cpu(root: &Path, rel: &str) -> Vec<f64> {
    glob_values(root, &format!("sys/devices/system/cpu/cpu[0-9]*/{rel}"))
}

/// The numbers in the files matching `pattern` under `root` (unreadable ones left out).
pub(super) fn glob_values(root: &Path, pattern: &str) -> Vec<f64> {
    let base = glob::Pattern::escape(&root.to_string_lossy());
    let Ok(paths) = glob::glob(&format!("{}/{pattern}", base.trim_end_matches('/'))) else {
        return Vec::new();
    };
    paths
        .flatten()
        .filter_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<f64>().ok())
        .collect()
}

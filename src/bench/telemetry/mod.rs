//! What the machine was doing while a run was timed: the device's clocks, temperature, power
//! and throttling — what the seeds tell students to watch with `nvidia-smi` and `rocm-smi` —
//! and, for the CPU, what Linux exposes: core frequencies, the load of other programs and the
//! hypervisor's steal. A [`Sampler`] reads a [`Reader`] once before the timed iterations, a few
//! times a second while they run (a background thread) and once after; the [`Telemetry`] it
//! returns goes into the record's environment, the summary shows it, and its
//! [`Summary::concerns`] make the verdicts that depend on timing inconclusive.
//!
//! Sources: NVML for NVIDIA GPUs ([`nvml`], loaded at run time), amdgpu's sysfs files for AMD
//! GPUs ([`amdgpu`], the files ROCm SMI itself reads), `/proc` and `/sys` for the CPU
//! ([`linux`]). Each reads what its machine has and leaves the rest `None`; the file-based ones
//! take a root directory, so the tests read made-up trees.

pub mod amdgpu;
pub mod linux;
pub mod nvml;

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::backend::{BackendKind, DeviceInfo};

/// How often the sampler reads while the run is timed: a few times a second, as `nvidia-smi
/// --loop-ms=250` would.
pub const PERIOD: Duration = Duration::from_millis(250);

/// A GPU whose median clock under load is below this share of its rated clock did not run at
/// its speed (a power or thermal limit, a clock lock, a card in a low power state).
pub const LOW_CLOCK: f64 = 0.8;

/// Other programs keeping at least this many cores busy (and a quarter of the machine's) took
/// at least one worker's core away for part of the run.
pub const OTHER_CORES: f64 = 0.5;

/// The hypervisor giving at least this share of the CPU time to other machines (steal).
pub const STEAL: f64 = 0.1;

/// Windows shorter than this are too coarse for `/proc/stat`'s 10 ms ticks to judge load by.
const SHORTEST_LOAD_WINDOW_S: f64 = 0.25;

/// One reading: whatever the source could read now (the rest `None`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    /// Seconds since the sampler started.
    pub t_s: f64,
    /// The graphics/SM clock (GPU), or the mean core frequency (CPU), MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_mhz: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_clock_mhz: Option<f64>,
    /// The hottest sensor, °C.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<f64>,
    /// Board (GPU) or package (CPU) power, W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// The source's energy counter, J (only differences mean anything).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub energy_j: Option<f64>,
    /// Reasons the clocks are held back now (power cap, thermal slowdown, ...); empty when
    /// none, or when the source does not report them (see [`Telemetry::reports_throttling`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub throttle: Vec<String>,
    /// CPU: cores that other programs kept busy since the previous reading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_cores: Option<f64>,
    /// CPU: the share of CPU time the hypervisor gave elsewhere since the previous reading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steal: Option<f64>,
}

/// A source of readings for one device.
pub trait Reader: Send {
    /// What reads, for the record: `NVML 550.54.15`, `Linux /proc and /sys`.
    fn source(&self) -> String;
    /// The highest clock the device is rated for, MHz.
    fn rated_clock_mhz(&self) -> Option<f64> {
        None
    }
    /// Whether [`Reading::throttle`] is filled (an empty list then means "not throttled").
    fn reports_throttling(&self) -> bool {
        false
    }
    /// The machine's cores, where the reader judges other programs' load.
    fn cores(&self) -> Option<usize> {
        None
    }
    /// Read now; `t_s` is filled by the sampler.
    fn read(&mut self) -> Reading;
}

/// The reader for device `device` of `backend`: NVML for CUDA, amdgpu's files for HIP, Linux's
/// for the CPU and for devices that compute on it (lavapipe, the emulator). Why none, else.
pub fn reader_for(
    backend: BackendKind,
    device: usize,
    info: &DeviceInfo,
) -> Result<Box<dyn Reader>, String> {
    if backend.is_host() || info.is_software() {
        return Ok(Box::new(linux::Linux::system()?));
    }
    match backend {
        BackendKind::Cuda => Ok(Box::new(nvml::Nvml::open(device)?)),
        BackendKind::Hip => Ok(Box::new(amdgpu::AmdGpu::system(device)?)),
        other => Err(format!(
            "no telemetry for {other} devices (NVML and amdgpu's files are matched to CUDA and \
             HIP devices): run on --backend cuda or hip to record clocks and power"
        )),
    }
}

/// What `reader` can read on this machine, in words (for `doctor`): its source, what it has,
/// and what this machine does not expose.
pub fn readable(reader: &mut dyn Reader) -> String {
    let r = reader.read();
    let mut have = Vec::new();
    let mut lack = Vec::new();
    if reader.cores().is_some() {
        have.push("other programs' load, steal");
    }
    let fields = [
        (r.clock_mhz.is_some(), "clocks"),
        (r.temperature_c.is_some(), "temperature"),
        (
            r.power_w.is_some() || r.energy_j.is_some(),
            "power or energy",
        ),
        (reader.reports_throttling(), "throttle reasons"),
    ];
    for (present, what) in fields {
        if present {
            have.push(what)
        } else {
            lack.push(what)
        }
    }
    let lack = match lack.is_empty() {
        true => String::new(),
        false => format!(" (no {} here)", lack.join(", ")),
    };
    format!("{}: {}{lack}", reader.source(), have.join(", "))
}

/// The physical index of visible device `device` under a `*_VISIBLE_DEVICES` list of indices
/// (UUIDs and other forms are not followed: the device's own index then).
pub fn visible(list: Option<&str>, device: usize) -> usize {
    list.and_then(|l| l.split(',').nth(device)?.trim().parse().ok())
        .unwrap_or(device)
}

/// Reads in the background until [`Sampler::finish`].
pub struct Sampler {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<(Box<dyn Reader>, Vec<Reading>)>,
    start: Instant,
}

impl Sampler {
    /// Take the first reading now (before the timed work), then one every `period`.
    pub fn start(mut reader: Box<dyn Reader>, period: Duration) -> Sampler {
        let start = Instant::now();
        let first = Reading {
            t_s: 0.0,
            ..reader.read()
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let mut readings = vec![first];
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(period) {
                let t_s = start.elapsed().as_secs_f64();
                readings.push(Reading {
                    t_s,
                    ..reader.read()
                });
            }
            (reader, readings)
        });
        Sampler {
            stop,
            thread,
            start,
        }
    }

    /// Stop, take the last reading (after the timed work) and summarise; a reader that
    /// panicked in its thread costs the telemetry, not the run.
    pub fn finish(self) -> Result<Telemetry, String> {
        let _ = self.stop.send(());
        let (mut reader, mut readings) = self
            .thread
            .join()
            .map_err(|_| "the telemetry sampler stopped with an error".to_string())?;
        readings.push(Reading {
            t_s: self.start.elapsed().as_secs_f64(),
            ..reader.read()
        });
        Ok(Telemetry::of(reader.as_ref(), readings))
    }
}

/// The readings of one run and what they say.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Telemetry {
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rated_clock_mhz: Option<f64>,
    pub reports_throttling: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<usize>,
    /// The first before the timed iterations, the last after them.
    pub readings: Vec<Reading>,
    pub summary: Summary,
}

/// Least, median and most of a quantity over the readings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Option<Spread> {
        v.retain(|x| x.is_finite());
        v.sort_by(f64::total_cmp);
        Some(Spread {
            min: *v.first()?,
            median: v[v.len() / 2],
            max: *v.last()?,
        })
    }
}

/// What the readings say about the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Seconds from the first reading to the last.
    pub seconds: f64,
    /// Over the readings taken while the run was timed (and the one after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_mhz: Option<Spread>,
    /// Median clock over the rated one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_ratio: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<Spread>,
    /// Mean power over the readings, W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// Energy from the first reading to the last, J: the counter's difference where the source
    /// has one, else the power readings integrated over time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub energy_j: Option<f64>,
    /// Share of the readings with a throttle reason, where the source reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttled: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub throttle_reasons: Vec<String>,
    /// Cores other programs kept busy, over the whole window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_cores: Option<f64>,
    /// The hypervisor's share of the CPU time, over the whole window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steal: Option<f64>,
    /// Why timings from this run cannot be trusted as the device's speed; empty when nothing
    /// was wrong (or nothing could be read).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub concerns: Vec<String>,
}

impl Telemetry {
    /// Summarise `readings` from `reader`.
    pub fn of(reader: &dyn Reader, readings: Vec<Reading>) -> Telemetry {
        let mut t = Telemetry {
            source: reader.source(),
            rated_clock_mhz: reader.rated_clock_mhz(),
            reports_throttling: reader.reports_throttling(),
            cores: reader.cores(),
            readings,
            summary: Summary::default(),
        };
        t.summary = t.summarise();
        t
    }

    fn summarise(&self) -> Summary {
        let r = &self.readings;
        let seconds = match (r.first(), r.last()) {
            (Some(a), Some(b)) => b.t_s - a.t_s,
            _ => 0.0,
        };
        // The first reading is from before the run: the device may still have been idle.
        let during = if r.len() > 1 { &r[1..] } else { r };
        let values = |f: fn(&Reading) -> Option<f64>| during.iter().filter_map(f).collect();
        let clock_mhz = Spread::of(values(|x| x.clock_mhz));
        // A CPU's rated clock is its best one-core turbo, above what all its cores hold
        // under load: only a GPU's clock is compared with its rating.
        let clock_ratio = clock_mhz
            .zip(
                self.rated_clock_mhz
                    .filter(|&c| c > 0.0 && self.cores.is_none()),
            )
            .map(|(c, rated)| c.median / rated);
        let powers: Vec<f64> = values(|x| x.power_w);
        let power_w =
            (!powers.is_empty()).then(|| powers.iter().sum::<f64>() / powers.len() as f64);
        let counter = match (
            r.first().and_then(|x| x.energy_j),
            r.last().and_then(|x| x.energy_j),
        ) {
            (Some(a), Some(b)) if b >= a => Some(b - a),
            _ => None,
        };
        let energy_j = counter.or_else(|| integrate_power(r));
        let throttled = self.reports_throttling.then(|| {
            let n = during.iter().filter(|x| !x.throttle.is_empty()).count();
            n as f64 / during.len().max(1) as f64
        });
        let mut throttle_reasons: Vec<String> =
            during.iter().flat_map(|x| x.throttle.clone()).collect();
        throttle_reasons.sort();
        throttle_reasons.dedup();
        // Each CPU reading's share covers the time since the one before: weight by it.
        let weighted = |f: fn(&Reading) -> Option<f64>| {
            let (mut sum, mut time) = (0.0, 0.0);
            for w in r.windows(2) {
                if let Some(v) = f(&w[1]) {
                    let dt = w[1].t_s - w[0].t_s;
                    sum += v * dt;
                    time += dt;
                }
            }
            (time >= SHORTEST_LOAD_WINDOW_S).then(|| sum / time)
        };
        let mut s = Summary {
            seconds,
            clock_mhz,
            clock_ratio,
            temperature_c: Spread::of(values(|x| x.temperature_c)),
            power_w,
            energy_j,
            throttled,
            throttle_reasons,
            other_cores: weighted(|x| x.other_cores),
            steal: weighted(|x| x.steal),
            concerns: Vec::new(),
        };
        s.concerns = concerns(&s, self.cores, during.len());
        s
    }

    /// One line for the summary: what was read, and anything wrong.
    pub fn describe(&self) -> String {
        let s = &self.summary;
        let mut parts = Vec::new();
        if let Some(c) = s.clock_mhz {
            let rated = self
                .rated_clock_mhz
                .map_or(String::new(), |r| format!(", rated {r:.0}"));
            parts.push(format!(
                "clock {:.0} MHz median ({:.0}–{:.0}{rated})",
                c.median, c.min, c.max
            ));
        }
        if let Some(t) = s.temperature_c {
            parts.push(format!("{:.0}–{:.0} °C", t.min, t.max));
        }
        if let Some(p) = s.power_w {
            parts.push(format!("{p:.0} W mean"));
        }
        if let Some(o) = s.other_cores {
            let of = self.cores.map_or(String::new(), |c| format!(" of {c}"));
            parts.push(format!("other programs {o:.2} cores{of}"));
        }
        if let Some(st) = s.steal {
            parts.push(format!("hypervisor steal {:.1}%", st * 100.0));
        }
        if self.cores.is_some() && s.other_cores.is_none() {
            parts.push("too short a run to measure other programs' load".into());
        }
        match s.throttled {
            Some(0.0) => parts.push("no throttling".into()),
            Some(_) => parts.push(format!("throttled: {}", s.throttle_reasons.join(", "))),
            None => {}
        }
        if parts.is_empty() {
            parts.push("nothing readable here".into());
        }
        format!(
            "{} ({}, {} readings over {:.1} s)",
            parts.join(", "),
            self.source,
            self.readings.len(),
            s.seconds
        )
    }
}

/// Energy from power readings alone: the trapezoids between consecutive readings that both
/// have one.
fn integrate_power(r: &[Reading]) -> Option<f64> {
    let mut sum = None;
    for w in r.windows(2) {
        if let (Some(a), Some(b)) = (w[0].power_w, w[1].power_w) {
            *sum.get_or_insert(0.0) += (a + b) / 2.0 * (w[1].t_s - w[0].t_s);
        }
    }
    sum
}

/// Why timings from a run with summary `s` (on a machine of `cores` cores, `during` readings
/// taken while and after it ran) are not the device's speed.
fn concerns(s: &Summary, cores: Option<usize>, during: usize) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(share) = s.throttled.filter(|&t| t > 0.0) {
        out.push(format!(
            "the device held its clocks back ({}) in {:.0}% of {} readings",
            s.throttle_reasons.join(", "),
            share * 100.0,
            during
        ));
    }
    if let (Some(ratio), Some(c)) = (s.clock_ratio, s.clock_mhz)
        && ratio < LOW_CLOCK
    {
        out.push(format!(
            "the device ran at {:.0} MHz (median), {:.0}% of its rated clock",
            c.median,
            ratio * 100.0
        ));
    }
    if let Some(o) = s.other_cores {
        let quarter = cores.map_or(0.0, |c| c as f64 / 4.0);
        if o >= OTHER_CORES.max(quarter) {
            let of = cores.map_or(String::new(), |c| format!(" of {c}"));
            out.push(format!("other programs kept {o:.1}{of} cores busy"));
        }
    }
    if let Some(st) = s.steal.filter(|&st| st >= STEAL) {
        out.push(format!(
            "the hypervisor gave {:.0}% of the CPU time to other machines (steal)",
            st * 100.0
        ));
    }
    out
}

#[cfg(test)]
mod tests;

use std::path::Path;

use super::*;

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

/// `/proc/stat` with `busy` ticks of user time, `steal` ticks stolen and the rest idle out
/// of `total`, on two cores; and our process's user + system time `own`.
fn proc_at(root: &Path, total: u64, busy: u64, steal: u64, own: u64) {
    let idle = total - busy - steal;
    write(
        root,
        "proc/stat",
        &format!(
            "cpu  {busy} 0 0 {idle} 0 0 0 {steal} 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\nintr 1\n"
        ),
    );
    // A command name with a space and a parenthesis, as /proc allows.
    write(
        root,
        "proc/self/stat",
        &format!(
            "42 (work shop) R 1 42 42 0 -1 4194304 10 0 0 0 {} {} 0 0 20 0 3 0\n",
            own / 2,
            own - own / 2
        ),
    );
}

/// The CPU reader on a made-up tree: other programs' cores and the steal from the counters'
/// differences, our own time left out; the frequencies, the hottest zone, the packages'
/// energy and the throttle counter where the files exist, and nothing where they do not.
#[test]
fn linux_reads_load_steal_and_sensors_from_its_files() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    proc_at(root, 1000, 300, 0, 100);
    let mut r = linux::Linux::at(root).unwrap();
    assert_eq!(r.cores(), Some(2));
    assert_eq!(r.rated_clock_mhz(), None);
    let first = r.read();
    assert_eq!(
        first.other_cores, None,
        "nothing to compare the first reading with"
    );
    assert_eq!(
        (first.clock_mhz, first.temperature_c, first.energy_j),
        (None, None, None)
    );
    // 1000 more ticks (two cores): 600 busy, 400 of them ours; 100 stolen.
    proc_at(root, 2000, 900, 100, 500);
    let second = r.read();
    assert!(
        (second.other_cores.unwrap() - 0.4).abs() < 1e-9,
        "{second:?}"
    );
    assert!((second.steal.unwrap() - 0.1).abs() < 1e-9);
    assert!(second.throttle.is_empty());
    assert!(!r.reports_throttling());

    for (cpu, khz) in [(0, 2_000_000), (1, 3_000_000)] {
        let dir = format!("sys/devices/system/cpu/cpu{cpu}");
        write(
            root,
            &format!("{dir}/cpufreq/scaling_cur_freq"),
            &format!("{khz}\n"),
        );
        write(
            root,
            &format!("{dir}/cpufreq/cpuinfo_max_freq"),
            "3500000\n",
        );
        write(
            root,
            &format!("{dir}/thermal_throttle/package_throttle_count"),
            "5\n",
        );
    }
    write(root, "sys/class/thermal/thermal_zone0/temp", "45000\n");
    write(root, "sys/class/thermal/thermal_zone1/temp", "61500\n");
    write(
        root,
        "sys/class/powercap/intel-rapl:0/energy_uj",
        "2000000\n",
    );
    // A subzone is inside its package's count: not added again.
    write(
        root,
        "sys/class/powercap/intel-rapl:0:0/energy_uj",
        "1000000\n",
    );
    let mut r = linux::Linux::at(root).unwrap();
    assert_eq!(r.rated_clock_mhz(), Some(3500.0));
    let a = r.read();
    assert_eq!(a.clock_mhz, Some(2500.0));
    assert_eq!(a.temperature_c, Some(61.5));
    assert_eq!(a.energy_j, Some(2.0));
    assert!(r.reports_throttling());
    write(
        root,
        "sys/devices/system/cpu/cpu1/thermal_throttle/package_throttle_count",
        "7\n",
    );
    assert_eq!(r.read().throttle, ["thermal (package)"]);
    assert!(r.read().throttle.is_empty(), "only while the counter moves");

    assert!(linux::Linux::at(root.join("nowhere")).is_err());
}

/// An AMD card from its sysfs files: the current DPM levels, the rated clock, the hottest
/// sensor, power and energy; cards of other vendors skipped; a missing card named.
#[test]
fn amdgpu_reads_its_dpm_tables_and_sensors() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    write(root, "sys/class/drm/card0/device/vendor", "0x10de\n");
    let dev = "sys/class/drm/card1/device";
    write(root, &format!("{dev}/vendor"), "0x1002\n");
    write(
        root,
        &format!("{dev}/pp_dpm_sclk"),
        "0: 500Mhz\n1: 1700Mhz *\n2: 2100Mhz\n",
    );
    write(
        root,
        &format!("{dev}/pp_dpm_mclk"),
        "0: 900Mhz\n1: 1300Mhz *\n",
    );
    write(root, &format!("{dev}/hwmon/hwmon3/temp1_input"), "52000\n");
    write(root, &format!("{dev}/hwmon/hwmon3/temp2_input"), "71000\n");
    write(
        root,
        &format!("{dev}/hwmon/hwmon3/power1_average"),
        "355000000\n",
    );
    write(
        root,
        &format!("{dev}/hwmon/hwmon3/energy1_input"),
        "123000000\n",
    );
    write(root, "sys/class/drm/card1-DP-1/status", "connected\n");
    let mut gpu = amdgpu::AmdGpu::at(root, 0).unwrap();
    assert_eq!(gpu.rated_clock_mhz(), Some(2100.0));
    let r = gpu.read();
    assert_eq!(r.clock_mhz, Some(1700.0));
    assert_eq!(r.memory_clock_mhz, Some(1300.0));
    assert_eq!(r.temperature_c, Some(71.0));
    assert_eq!(r.power_w, Some(355.0));
    assert_eq!(r.energy_j, Some(123.0));
    let e = amdgpu::AmdGpu::at(root, 1).err().unwrap();
    assert!(e.contains("no AMD GPU 1") && e.contains("1 found"), "{e}");
}

/// NVML's reasons: only those that slow a run are named; device indices follow a visible list.
#[test]
fn nvml_names_the_reasons_that_slow_a_run() {
    use nvml_wrapper::bitmasks::device::ThrottleReasons as T;
    assert!(nvml::slowing(T::GPU_IDLE | T::APPLICATIONS_CLOCKS_SETTING).is_empty());
    assert_eq!(
        nvml::slowing(T::SW_POWER_CAP | T::HW_THERMAL_SLOWDOWN | T::GPU_IDLE),
        ["power cap", "thermal (hardware)"]
    );
    assert_eq!(visible(Some("2,3"), 1), 3);
    assert_eq!(visible(Some("GPU-8d1f"), 0), 0);
    assert_eq!(visible(None, 1), 1);
}

/// Without the NVIDIA driver (as on CI's machines), NVML says so and what to install; a
/// machine that has it opens GPU 0.
#[test]
fn nvml_missing_says_what_to_install() {
    match nvml::Nvml::open(0) {
        Err(e) => assert!(e.contains("libnvidia-ml.so.1"), "{e}"),
        Ok(n) => assert!(n.source().starts_with("NVML")),
    }
}

/// A scripted reader: the readings it returns, in order.
struct Script {
    readings: Vec<Reading>,
    rated: Option<f64>,
    throttling: bool,
    cores: Option<usize>,
}

impl Reader for Script {
    fn source(&self) -> String {
        "script".into()
    }
    fn rated_clock_mhz(&self) -> Option<f64> {
        self.rated
    }
    fn reports_throttling(&self) -> bool {
        self.throttling
    }
    fn cores(&self) -> Option<usize> {
        self.cores
    }
    fn read(&mut self) -> Reading {
        self.readings.remove(0)
    }
}

fn gpu(t_s: f64, clock: f64, power: f64, energy: Option<f64>, throttle: &[&str]) -> Reading {
    Reading {
        t_s,
        clock_mhz: Some(clock),
        power_w: Some(power),
        energy_j: energy,
        temperature_c: Some(60.0 + t_s),
        throttle: throttle.iter().map(|s| s.to_string()).collect(),
        ..Reading::default()
    }
}

fn script(readings: Vec<Reading>, rated: Option<f64>, throttling: bool) -> Script {
    Script {
        readings,
        rated,
        throttling,
        cores: None,
    }
}

/// A steady GPU run: clocks from the readings after the first (an idle card before the run
/// is not a slow run), energy from the counter, no concerns.
#[test]
fn a_steady_gpu_run_has_no_concerns() {
    let readings = vec![
        gpu(0.0, 300.0, 80.0, Some(1000.0), &[]),
        gpu(0.25, 1980.0, 600.0, Some(1150.0), &[]),
        gpu(0.5, 1965.0, 640.0, Some(1310.0), &[]),
        gpu(0.75, 1980.0, 620.0, Some(1465.0), &[]),
    ];
    let s = script(readings.clone(), Some(1980.0), true);
    let t = Telemetry::of(&s, readings);
    let m = &t.summary;
    assert_eq!(m.clock_mhz.unwrap().median, 1980.0);
    assert_eq!(m.clock_mhz.unwrap().min, 1965.0);
    assert_eq!(m.energy_j, Some(465.0));
    assert_eq!(m.power_w, Some(620.0));
    assert_eq!(m.throttled, Some(0.0));
    assert!(m.concerns.is_empty(), "{:?}", m.concerns);
    assert!(t.describe().contains("no throttling"), "{}", t.describe());
    assert!(
        t.describe()
            .contains("1980 MHz median (1965–1980, rated 1980)")
    );
}

/// Throttling and a low clock are concerns, each with its reason; without an energy counter
/// the power readings are integrated.
#[test]
fn throttled_and_slow_gpu_runs_say_why() {
    let readings = vec![
        gpu(0.0, 1400.0, 400.0, None, &[]),
        gpu(1.0, 1400.0, 700.0, None, &["power cap"]),
        gpu(
            2.0,
            1300.0,
            700.0,
            None,
            &["power cap", "thermal (software)"],
        ),
        gpu(3.0, 1410.0, 690.0, None, &[]),
    ];
    let s = script(readings.clone(), Some(1980.0), true);
    let m = Telemetry::of(&s, readings).summary;
    assert_eq!(m.throttle_reasons, ["power cap", "thermal (software)"]);
    assert!((m.throttled.unwrap() - 2.0 / 3.0).abs() < 1e-9);
    assert_eq!(m.energy_j, Some(550.0 + 700.0 + 695.0));
    assert_eq!(m.concerns.len(), 2, "{:?}", m.concerns);
    assert!(m.concerns[0].contains("power cap, thermal (software)) in 67% of 3 readings"));
    assert!(
        m.concerns[1].contains("1400 MHz (median), 71% of its rated clock"),
        "{:?}",
        m.concerns
    );
    // A source that reports no reasons judges none; the clock still counts.
    let readings = vec![
        gpu(0.0, 1400.0, 1.0, None, &[]),
        gpu(1.0, 1900.0, 1.0, None, &[]),
    ];
    let s = script(readings.clone(), Some(2000.0), false);
    let m = Telemetry::of(&s, readings).summary;
    assert_eq!(m.throttled, None);
    assert!(m.concerns.is_empty(), "{:?}", m.concerns);
}

fn cpu(t_s: f64, other: Option<f64>, steal: Option<f64>, clock: Option<f64>) -> Reading {
    Reading {
        t_s,
        other_cores: other,
        steal,
        clock_mhz: clock,
        ..Reading::default()
    }
}

/// The CPU's load over the window, weighted by each reading's interval; a busy machine and a
/// thieving hypervisor are concerns, a CPU's clock below its best turbo is not, and a window
/// too short for the tick counters judges nothing.
#[test]
fn cpu_runs_are_judged_by_other_load_and_steal() {
    let run = |readings: Vec<Reading>| {
        let s = Script {
            readings: readings.clone(),
            rated: Some(5000.0),
            throttling: false,
            cores: Some(2),
        };
        Telemetry::of(&s, readings)
    };
    let quiet = run(vec![
        cpu(0.0, None, None, Some(3000.0)),
        cpu(0.25, Some(0.1), Some(0.0), Some(3000.0)),
        cpu(1.0, Some(0.02), Some(0.01), Some(3000.0)),
    ]);
    let m = &quiet.summary;
    assert!((m.other_cores.unwrap() - (0.1 * 0.25 + 0.02 * 0.75)).abs() < 1e-9);
    assert!(m.concerns.is_empty(), "{:?}", m.concerns);
    assert!(
        quiet.describe().contains("other programs 0.04 cores of 2"),
        "{}",
        quiet.describe()
    );

    let busy = run(vec![
        cpu(0.0, None, None, None),
        cpu(0.5, Some(0.9), Some(0.2), None),
        cpu(1.0, Some(0.7), Some(0.1), None),
    ]);
    let c = &busy.summary.concerns;
    assert_eq!(c.len(), 2, "{c:?}");
    assert!(
        c[0].contains("other programs kept 0.8 of 2 cores busy"),
        "{c:?}"
    );
    assert!(c[1].contains("15% of the CPU time"), "{c:?}");

    let short = run(vec![
        cpu(0.0, None, None, None),
        cpu(0.1, Some(1.5), Some(0.5), None),
    ]);
    assert_eq!(short.summary.other_cores, None);
    assert!(short.summary.concerns.is_empty());
}

/// The sampler: a reading before, some while the work runs, one after, in time order.
#[test]
fn the_sampler_reads_before_during_and_after() {
    struct Count(u32);
    impl Reader for Count {
        fn source(&self) -> String {
            "count".into()
        }
        fn read(&mut self) -> Reading {
            self.0 += 1;
            Reading {
                power_w: Some(self.0 as f64),
                ..Reading::default()
            }
        }
    }
    let sampler = Sampler::start(Box::new(Count(0)), Duration::from_millis(10));
    std::thread::sleep(Duration::from_millis(100));
    let t = sampler.finish().unwrap();
    let n = t.readings.len();
    assert!(n >= 3, "{n} readings");
    assert_eq!(t.readings[0].power_w, Some(1.0));
    assert_eq!(t.readings[n - 1].power_w, Some(n as f64));
    assert!(t.readings.windows(2).all(|w| w[0].t_s <= w[1].t_s));
    assert!(t.summary.seconds >= 0.1);
}

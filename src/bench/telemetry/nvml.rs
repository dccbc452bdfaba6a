//! NVIDIA GPUs through NVML (`libnvidia-ml.so.1`, which the driver installs), loaded at run
//! time by `nvml-wrapper`: the binary builds and runs without it.

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};

use super::{Reader, Reading};

/// One GPU's NVML handle.
pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
    index: u32,
    driver: String,
    rated_mhz: Option<f64>,
}

/// The throttle reasons that slow a run down, with the words the summary uses. Idle, the
/// application clock setting and the display clock are how a GPU normally runs.
const SLOWING: [(ThrottleReasons, &str); 6] = [
    (ThrottleReasons::SW_POWER_CAP, "power cap"),
    (ThrottleReasons::HW_SLOWDOWN, "hardware slowdown"),
    (ThrottleReasons::SW_THERMAL_SLOWDOWN, "thermal (software)"),
    (ThrottleReasons::HW_THERMAL_SLOWDOWN, "thermal (hardware)"),
    (ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN, "power brake"),
    (ThrottleReasons::SYNC_BOOST, "sync boost"),
];

/// The words for the reasons in `bits` that slow a run.
pub fn slowing(bits: ThrottleReasons) -> Vec<String> {
    SLOWING
        .iter()
        .filter(|(r, _)| bits.contains(*r))
        .map(|(_, w)| w.to_string())
        .collect()
}

impl Nvml {
    /// CUDA device `device`: NVML counts GPUs in PCI order, as CUDA does with
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID` (and by default on machines of identical GPUs);
    /// `CUDA_VISIBLE_DEVICES` given as indices is followed.
    pub fn open(device: usize) -> Result<Nvml, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| {
            format!(
                "NVML could not be loaded ({e}): it comes with the NVIDIA driver \
                 (libnvidia-ml.so.1)"
            )
        })?;
        let index = super::visible(
            std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            device,
        );
        let index = u32::try_from(index).map_err(|_| format!("no GPU {index} in NVML"))?;
        let dev = nvml
            .device_by_index(index)
            .map_err(|e| format!("NVML has no GPU {index}: {e}"))?;
        let rated_mhz = dev.max_clock_info(Clock::SM).ok().map(f64::from);
        let driver = nvml.sys_driver_version().unwrap_or_default();
        Ok(Nvml {
            nvml,
            index,
            driver,
            rated_mhz,
        })
    }
}

impl Reader for Nvml {
    fn source(&self) -> String {
        format!("NVML, driver {}", self.driver)
    }

    fn rated_clock_mhz(&self) -> Option<f64> {
        self.rated_mhz
    }

    fn reports_throttling(&self) -> bool {
        true
    }

    fn read(&mut self) -> Reading {
        let Ok(dev) = self.nvml.device_by_index(self.index) else {
            return Reading::default();
        };
        Reading {
            clock_mhz: dev.clock_info(Clock::SM).ok().map(f64::from),
            memory_clock_mhz: dev.clock_info(Clock::Memory).ok().map(f64::from),
            temperature_c: dev.temperature(TemperatureSensor::Gpu).ok().map(f64::from),
            power_w: dev.power_usage().ok().map(|mw| mw as f64 / 1e3),
            energy_j: dev
                .total_energy_consumption()
                .ok()
                .map(|mj| mj as f64 / 1e3),
            throttle: dev
                .current_throttle_reasons()
                .map_or_else(|_| Vec::new(), slowing),
            ..Reading::default()
        }
    }
}

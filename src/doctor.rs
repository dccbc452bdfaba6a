//! `workshop doctor`: what this machine is and what it can run — OS, CPU and its features,
//! memory, every backend (in this build or not, usable or why not) with its devices, and the
//! versions of the runner and kernels. Plain data here; `report` renders it to paste.

use serde::{Deserialize, Serialize};

use crate::backend::{self, BackendError, BackendKind, DeviceInfo};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendStatus {
    pub backend: BackendKind,
    /// `available`, `not in this build`, or `no device`.
    pub status: String,
    /// Why not, in words that say what to install or change.
    pub reason: Option<String>,
    pub devices: Vec<DeviceInfo>,
    /// What a run on its first device records of the machine's state
    /// ([`crate::bench::telemetry`]), or why nothing; absent where the backend has no device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<String>,
    /// What `--kernels vendor` runs here (the libraries' versions, or what to install);
    /// absent where the backend has no vendor family or is not available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub runner_version: String,
    pub os: String,
    pub kernel: String,
    pub arch: String,
    pub cpu_model: String,
    pub cpu_features: Vec<String>,
    /// The CPU backend's SIMD paths and why they were chosen (absent in older records).
    #[serde(default)]
    pub cpu_paths: Option<String>,
    pub cores: Option<usize>,
    pub memory_bytes: Option<u64>,
    pub available_memory_bytes: u64,
    pub backends: Vec<BackendStatus>,
    /// The font charts are drawn with; else `charts_problem` says why there is none, or what
    /// is wrong with `WORKSHOP_FONT` (absent in older records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chart_font: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charts_problem: Option<String>,
}

pub fn collect() -> Report {
    let host = backend::cpu::host_device();
    let backends = [
        BackendKind::Cpu,
        BackendKind::Wgpu,
        BackendKind::Cuda,
        BackendKind::Hip,
    ]
    .into_iter()
    .map(|kind| match backend::open(kind) {
        Ok(b) => {
            let devices = b.devices();
            if devices.is_empty() {
                BackendStatus {
                    backend: kind,
                    status: "no device".into(),
                    reason: Some("no device found".into()),
                    devices,
                    telemetry: None,
                    vendor: None,
                }
            } else {
                let telemetry = Some(
                    match crate::bench::telemetry::reader_for(kind, 0, &devices[0]) {
                        Ok(mut r) => crate::bench::telemetry::readable(r.as_mut()),
                        Err(why) => why,
                    },
                );
                BackendStatus {
                    backend: kind,
                    status: "available".into(),
                    reason: None,
                    devices,
                    telemetry,
                    vendor: b.vendor_libraries(),
                }
            }
        }
        Err(e @ BackendError::NotCompiled(_)) => BackendStatus {
            backend: kind,
            status: "not in this build".into(),
            reason: Some(e.to_string()),
            devices: vec![],
            telemetry: None,
            vendor: None,
        },
        Err(e) => BackendStatus {
            backend: kind,
            status: "no device".into(),
            reason: Some(e.to_string()),
            devices: vec![],
            telemetry: None,
            vendor: None,
        },
    })
    .collect();
    let font = crate::fonts::font();
    Report {
        runner_version: env!("CARGO_PKG_VERSION").into(),
        os: sysinfo::System::long_os_version().unwrap_or_else(|_| std::env::consts::OS.into()),
        kernel: sysinfo::System::kernel_version().unwrap_or_else(|_| "unknown".into()),
        arch: std::env::consts::ARCH.into(),
        cpu_model: host.name.clone(),
        cpu_features: host.features.clone(),
        cpu_paths: Some(backend::cpu::simd::explain()),
        cores: host.compute_units,
        memory_bytes: host.memory_bytes,
        available_memory_bytes: backend::cpu::available_memory(),
        backends,
        chart_font: font.clone().ok(),
        charts_problem: font.err(),
    }
}

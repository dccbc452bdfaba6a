//! The wgpu backend: every op as a WGSL compute kernel (kernels/wgsl/), running on any Vulkan,
//! Metal or DX12 GPU — and, in CI, on Mesa's lavapipe CPU driver.
//!
//! It follows wgpu's canonical compute order. *Adapter*: enumerate, prefer discrete, then
//! integrated, virtual and CPU adapters. *Device*: request it with the adapter's own limits
//! (lavapipe offers 32 KiB of workgroup memory where the default is 16 KiB) and the features
//! the run needs (SHADER_F16, TIMESTAMP_QUERY). *Shader modules*: the embedded WGSL (or the
//! files under `--kernels-dir`), with the storage type prepended; a compile error returns
//! naga's whole message and the file. *Pipelines and bind groups*: built once at prepare time
//! for every node of the plan, with weights uploaded once and activations placed in buffers
//! reused across non-overlapping lifetimes. *Run*: one command encoder per forward pass, one
//! compute pass (one per kernel when timing each), then a copy of the f32 logits into a
//! mappable buffer that `read_output` maps after the device is polled.
//!
//! `lower.rs` turns a plan into launches (plain data, unit-tested), `session.rs` creates what
//! they bind and runs them.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use wgpu::util::DeviceExt;

mod decoder;
mod lower;
mod session;

use lower::{FEW_ROWS, f32_bytes, grid};
use session::{WgpuSession, map_read, params, shader, timestamp_queries};

use super::{Backend, BackendError, BackendKind, DeviceInfo, ExecOptions, Session, StreamTimes};
use crate::model::op::Op;
use crate::model::{Plan, Precision, Weights};

/// The kernels, as (file, entry point).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kernel {
    Conv2d,
    Conv2dRows,
    Depthwise,
    MaxPool,
    AvgPool,
    AdaptiveAvgPool,
    Affine,
    Clamp,
    Sigmoid,
    Add,
    NchwToNhwc,
    NhwcToNchw,
    ToF32,
    Softmax,
    Unary,
    ScaleChannels,
    ClassToken,
    Positions,
    LayerNorm,
    Gelu,
    SelectToken,
    Attention,
    ChannelCopy,
    WindowAttention,
    PatchMerge,
    EmbedTokens,
    LlmNorm,
    Rope,
    KvStore,
    CachedAttention,
    Glu,
    LlmLinear,
    LmHead,
}

impl Kernel {
    fn source(self) -> (&'static str, &'static str) {
        match self {
            Kernel::Conv2d => ("conv2d.wgsl", "conv2d"),
            Kernel::Conv2dRows => ("conv2d.wgsl", "conv2d_rows"),
            Kernel::Depthwise => ("depthwise.wgsl", "depthwise"),
            Kernel::MaxPool => ("pool.wgsl", "max_pool"),
            Kernel::AvgPool => ("pool.wgsl", "avg_pool"),
            Kernel::AdaptiveAvgPool => ("pool.wgsl", "adaptive_avg_pool"),
            Kernel::Affine => ("elementwise.wgsl", "affine"),
            Kernel::Clamp => ("elementwise.wgsl", "clamp_op"),
            Kernel::Sigmoid => ("elementwise.wgsl", "sigmoid"),
            Kernel::Add => ("elementwise.wgsl", "add"),
            Kernel::NchwToNhwc => ("elementwise.wgsl", "nchw_to_nhwc"),
            Kernel::NhwcToNchw => ("elementwise.wgsl", "nhwc_to_nchw"),
            Kernel::ToF32 => ("elementwise.wgsl", "to_f32"),
            Kernel::Softmax => ("elementwise.wgsl", "softmax"),
            Kernel::Unary => ("elementwise.wgsl", "unary"),
            Kernel::ScaleChannels => ("elementwise.wgsl", "scale_channels"),
            Kernel::ClassToken => ("transformer.wgsl", "class_token"),
            Kernel::Positions => ("transformer.wgsl", "positions"),
            Kernel::LayerNorm => ("transformer.wgsl", "layer_norm"),
            Kernel::Gelu => ("transformer.wgsl", "gelu"),
            Kernel::SelectToken => ("transformer.wgsl", "select_token"),
            Kernel::Attention => ("transformer.wgsl", "attention"),
            Kernel::ChannelCopy => ("channels.wgsl", "channel_copy"),
            Kernel::WindowAttention => ("window.wgsl", "window_attention"),
            Kernel::PatchMerge => ("window.wgsl", "patch_merge"),
            Kernel::EmbedTokens => ("llm.wgsl", "embed_tokens"),
            Kernel::LlmNorm => ("llm.wgsl", "llm_norm"),
            Kernel::Rope => ("llm.wgsl", "llm_rope"),
            Kernel::KvStore => ("llm.wgsl", "kv_store"),
            Kernel::CachedAttention => ("llm.wgsl", "cached_attention"),
            Kernel::Glu => ("llm.wgsl", "glu"),
            Kernel::LlmLinear => ("llm.wgsl", "llm_linear"),
            Kernel::LmHead => ("llm.wgsl", "lm_head"),
        }
    }
}

/// What to install when there is no adapter.
const NO_ADAPTER: &str = "no GPU adapter found: install a Vulkan driver for your GPU (on a CPU-only Linux machine, \
     `apt-get install mesa-vulkan-drivers libvulkan1` gives the lavapipe software driver)";

pub struct WgpuBackend {
    adapters: Vec<wgpu::Adapter>,
}

fn type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

fn backend_rank(b: wgpu::Backend) -> u8 {
    match b {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        _ => 1,
    }
}

impl WgpuBackend {
    /// Find the adapters, best first: discrete, integrated, virtual, CPU; native APIs before GL.
    pub fn new() -> Result<Self, BackendError> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let mut adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        adapters.sort_by_key(|a| {
            let i = a.get_info();
            (type_rank(i.device_type), backend_rank(i.backend))
        });
        if adapters.is_empty() {
            return Err(BackendError::NoDevice {
                kind: BackendKind::Wgpu,
                reason: NO_ADAPTER.into(),
            });
        }
        Ok(WgpuBackend { adapters })
    }
}

fn device_info(a: &wgpu::Adapter) -> DeviceInfo {
    let i = a.get_info();
    let l = a.limits();
    let f = a.features();
    let mut features = vec![format!("{:?}", i.device_type), format!("{:?}", i.backend)];
    for (flag, name) in [
        (wgpu::Features::SHADER_F16, "SHADER_F16"),
        (wgpu::Features::TIMESTAMP_QUERY, "TIMESTAMP_QUERY"),
    ] {
        if f.contains(flag) {
            features.push(name.into());
        }
    }
    features.push(format!(
        "workgroup_storage={}",
        l.max_compute_workgroup_storage_size
    ));
    features.push(format!(
        "invocations={}",
        l.max_compute_invocations_per_workgroup
    ));
    features.push(format!(
        "storage_binding={}",
        l.max_storage_buffer_binding_size
    ));
    DeviceInfo {
        name: i.name.clone(),
        memory_bytes: None,
        driver: Some(format!("{} {}", i.driver, i.driver_info).trim().to_string()),
        compute_units: None,
        features,
        clock_mhz: None,
    }
}

/// A device on `adapter` with `features` and the adapter's own limits (the defaults are
/// lower: 16 KiB of workgroup memory where lavapipe has 32).
fn open_device(
    adapter: &wgpu::Adapter,
    features: wgpu::Features,
) -> Result<(wgpu::Device, wgpu::Queue), BackendError> {
    pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("workshop"),
        required_features: features,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .map_err(|e| BackendError::NoDevice {
        kind: BackendKind::Wgpu,
        reason: format!("{}: {e}", adapter.get_info().name),
    })
}

/// A device on `adapter` with the features `precision` (and, with `profile`, timing) need; the
/// first error it reports outside an error scope lands in the returned slot (wgpu would panic
/// on it otherwise); and whether kernels can be timed on the device.
#[allow(clippy::type_complexity)]
fn open_for(
    adapter: &wgpu::Adapter,
    precision: Precision,
    profile: bool,
) -> Result<(wgpu::Device, wgpu::Queue, Arc<Mutex<Option<String>>>, bool), BackendError> {
    let name = adapter.get_info().name;
    let mut features = wgpu::Features::empty();
    match precision {
        Precision::Fp32 => {}
        Precision::Fp16 if adapter.features().contains(wgpu::Features::SHADER_F16) => {
            features |= wgpu::Features::SHADER_F16
        }
        Precision::Fp16 => {
            return Err(BackendError::Unsupported(format!(
                "this adapter ({name}) has no FP16 support (SHADER_F16); use --precision fp32"
            )));
        }
        Precision::Bf16 => {
            return Err(BackendError::Unsupported(
                    "the wgpu backend has no BF16: WGSL has no bfloat16 type; use --precision fp32 or fp16".into(),
                ));
        }
    }
    let timestamps = profile && adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
    if timestamps {
        features |= wgpu::Features::TIMESTAMP_QUERY;
    }
    let (device, queue) = open_device(adapter, features)?;
    // wgpu panics on errors nobody captured; keep the first one instead and report it as
    // an error from `prepare` or `sync`.
    let errors: Arc<Mutex<Option<String>>> = Arc::default();
    let slot = Arc::clone(&errors);
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
        slot.lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(|| e.to_string());
    }));
    Ok((device, queue, errors, timestamps))
}

impl WgpuBackend {
    fn adapter(&self, dev: usize) -> Result<&wgpu::Adapter, BackendError> {
        self.adapters
            .get(dev)
            .ok_or_else(|| BackendError::NoDevice {
                kind: BackendKind::Wgpu,
                reason: format!(
                    "there is no adapter {dev}; this machine has {}: {}",
                    self.adapters.len(),
                    self.adapters
                        .iter()
                        .enumerate()
                        .map(|(i, a)| format!("[{i}] {}", a.get_info().name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }
}

impl Backend for WgpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.adapters.iter().map(device_info).collect()
    }

    fn variants(&self, op: &Op, out: &[usize]) -> Vec<&'static str> {
        let rows: usize = match op {
            Op::Conv2d(c) if c.groups > 1 && c.groups == c.in_channels && !c.residual => {
                return Vec::new();
            }
            Op::Conv2d(_) => out[0] * out[2] * out[3],
            Op::Linear { .. } => out[0],
            _ => return Vec::new(),
        };
        // The few-rows kernel re-reads B once per 8 rows: only worth timing for few rows.
        if rows <= 256 {
            if rows <= FEW_ROWS {
                vec!["rows", "tiled"]
            } else {
                vec!["tiled", "rows"]
            }
        } else {
            Vec::new()
        }
    }

    fn stream(
        &self,
        dev: usize,
        n: usize,
        iterations: usize,
        _threads: Option<usize>,
    ) -> Result<StreamTimes, BackendError> {
        let adapter = self.adapter(dev)?;
        let limits = adapter.limits();
        let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        let features = if timestamps {
            wgpu::Features::TIMESTAMP_QUERY
        } else {
            wgpu::Features::empty()
        };
        let (device, queue) = open_device(adapter, features)?;
        // Whole vec4s, within one storage binding.
        let n4 = (n.min((limits.max_storage_buffer_binding_size / 4) as usize) / 4).max(1);
        let filled = |label: &str, v: f32| {
            let words = vec![v; n4 * 4];
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: &f32_bytes(&words),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            })
        };
        let (a, c, b) = (filled("a", 1.0), filled("c", 3.0), filled("b", 2.0));
        let module = shader(&device, "stream.wgsl", None, Precision::Fp32)?;
        let (gx, gy, _) = grid(n4, limits.max_compute_workgroups_per_dimension);
        let pbuf = params(&device, &[n4 as u32, gx * 256]);
        let set = timestamps.then(|| timestamp_queries(&device, 2));
        let period = queue.get_timestamp_period() as f64;
        let wait = || {
            device
                .poll(wgpu::PollType::wait_indefinitely())
                .map(|_| ())
                .map_err(|e| BackendError::Driver(format!("waiting for the GPU failed: {e}")))
        };
        let time =
            |entry: &str, reads: &[(u32, &wgpu::Buffer)]| -> Result<Vec<f64>, BackendError> {
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                });
                let mut entries = vec![
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: pbuf.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 3,
                        resource: b.as_entire_binding(),
                    },
                ];
                entries.extend(reads.iter().map(|(i, buf)| wgpu::BindGroupEntry {
                    binding: *i,
                    resource: buf.as_entire_binding(),
                }));
                let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(entry),
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &entries,
                });
                let mut out = Vec::with_capacity(iterations);
                for it in 0..=iterations {
                    let mut encoder = device.create_command_encoder(&Default::default());
                    {
                        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some(entry),
                            timestamp_writes: set.as_ref().map(|(s, _, _)| {
                                wgpu::ComputePassTimestampWrites {
                                    query_set: s,
                                    beginning_of_pass_write_index: Some(0),
                                    end_of_pass_write_index: Some(1),
                                }
                            }),
                        });
                        pass.set_pipeline(&pipeline);
                        pass.set_bind_group(0, &bind_group, &[]);
                        pass.dispatch_workgroups(gx, gy, 1);
                    }
                    if let Some((s, resolve, read)) = &set {
                        encoder.resolve_query_set(s, 0..2, resolve, 0);
                        encoder.copy_buffer_to_buffer(resolve, 0, read, 0, 16);
                    }
                    let start = Instant::now();
                    queue.submit([encoder.finish()]);
                    wait()?;
                    let wall = start.elapsed().as_secs_f64();
                    let seconds = match &set {
                        Some((_, _, read)) => {
                            let bytes = map_read(&device, read)?;
                            let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&bytes);
                            ticks[1].saturating_sub(ticks[0]) as f64 * period / 1e9
                        }
                        None => wall,
                    };
                    if it > 0 {
                        out.push(seconds);
                    }
                }
                Ok(out)
            };
        let copy_s = time("copy", &[(1, &a)])?;
        let triad_s = time("triad", &[(1, &a), (2, &c)])?;
        // Check the triad's result: a fast wrong kernel never counts.
        let check = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("stream check"),
            size: b.size(),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(&b, 0, &check, 0, b.size());
        queue.submit([encoder.finish()]);
        let bytes = map_read(&device, &check)?;
        if bytemuck::pod_collect_to_vec::<u8, f32>(&bytes)
            .iter()
            .any(|&v| v != 2.5)
        {
            return Err(BackendError::WrongResult(
                "the triad computed wrong values: the measurement is void".into(),
            ));
        }
        Ok(StreamTimes {
            n: n4 * 4,
            copy_s,
            triad_s,
        })
    }

    fn prepare(
        &self,
        dev: usize,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        super::native_only(BackendKind::Wgpu, opt)?;
        let adapter = self.adapter(dev)?;
        let name = adapter.get_info().name;
        let (device, queue, errors, timestamps) = open_for(adapter, opt.precision, opt.profile)?;
        let mut session = WgpuSession::new(
            device,
            queue,
            adapter.limits(),
            plan,
            weights,
            opt,
            timestamps,
            name,
        )?;
        session.errors = errors;
        session.check_errors()?;
        Ok(Box::new(session))
    }

    fn prepare_decoder(
        &self,
        dev: usize,
        weights: &crate::model::llm::DecoderWeights,
        opt: &super::DecoderOptions,
    ) -> Result<Box<dyn super::DecoderSession>, BackendError> {
        let adapter = self.adapter(dev)?;
        let (device, queue, errors, _) = open_for(adapter, opt.precision, false)?;
        let mut session = decoder::WgpuDecoder::new(
            device,
            queue,
            adapter.limits(),
            weights,
            opt,
            adapter.get_info().name,
        )?;
        session.errors = errors;
        Ok(Box::new(session))
    }
}

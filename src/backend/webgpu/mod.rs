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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use wgpu::util::DeviceExt;

use super::{
    Backend, BackendError, BackendKind, DeviceInfo, ExecOptions, KernelTime, MemoryStats, Session,
    StreamTimes,
};
use crate::model::op::{Conv2d, Op, batch_norm_affine};
use crate::model::{Plan, Precision, Tensor, Weights};

/// The kernel sources shipped in the binary, by file name.
const KERNELS: &[(&str, &str)] = &[
    (
        "conv2d.wgsl",
        include_str!("../../../kernels/wgsl/conv2d.wgsl"),
    ),
    (
        "depthwise.wgsl",
        include_str!("../../../kernels/wgsl/depthwise.wgsl"),
    ),
    ("pool.wgsl", include_str!("../../../kernels/wgsl/pool.wgsl")),
    (
        "elementwise.wgsl",
        include_str!("../../../kernels/wgsl/elementwise.wgsl"),
    ),
    (
        "stream.wgsl",
        include_str!("../../../kernels/wgsl/stream.wgsl"),
    ),
];

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
    Add,
    NchwToNhwc,
    NhwcToNchw,
    ToF32,
    Softmax,
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
            Kernel::Add => ("elementwise.wgsl", "add"),
            Kernel::NchwToNhwc => ("elementwise.wgsl", "nchw_to_nhwc"),
            Kernel::NhwcToNchw => ("elementwise.wgsl", "nhwc_to_nchw"),
            Kernel::ToF32 => ("elementwise.wgsl", "to_f32"),
            Kernel::Softmax => ("elementwise.wgsl", "softmax"),
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
            Op::Conv2d(c)
                if c.groups > 1
                    && c.groups == c.in_channels
                    && c.act == crate::model::op::Act::None
                    && !c.residual =>
            {
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
        let set = timestamps.then(|| {
            let set = device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("stream times"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            });
            let resolve = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("stream timestamps"),
                size: 16,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let read = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("stream timestamps readback"),
                size: 16,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            (set, resolve, read)
        });
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
        let mut features = wgpu::Features::empty();
        match opt.precision {
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
        let timestamps =
            opt.profile && adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
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
}

/// Bytes of `n` values of the storage type, rounded up to whole words.
fn elem_bytes(n: usize, precision: Precision) -> u64 {
    ((n * precision.bytes()) as u64).div_ceil(4) * 4
}

/// Values in the storage type, as bytes.
fn to_bytes(v: &[f32], precision: Precision) -> Vec<u8> {
    let mut out = precision.storage_bytes(v);
    out.resize(out.len().div_ceil(4).max(1) * 4, 0);
    out
}

/// A launch before binding: the kernel, its parameters, the buffers it reads (by binding
/// number), the binding of its output, and the grid.
type Launch = (
    Kernel,
    Vec<usize>,
    Vec<(u32, wgpu::Buffer)>,
    u32,
    (u32, u32, u32),
);

/// One kernel launch, fully bound.
struct Dispatch {
    kernel: Kernel,
    node: String,
    /// The op's kind name (`conv2d`, ...), or `output` for the final conversion.
    op: &'static str,
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    groups: (u32, u32, u32),
}

struct WgpuSession {
    device: wgpu::Device,
    queue: wgpu::Queue,
    dispatches: Vec<Dispatch>,
    input: wgpu::Buffer,
    output: wgpu::Buffer,
    readback: wgpu::Buffer,
    output_shape: Vec<usize>,
    input_shape: Vec<usize>,
    timestamps: Option<(wgpu::QuerySet, wgpu::Buffer, wgpu::Buffer)>,
    ran: bool,
    weight_bytes: u64,
    activation_bytes: u64,
    precision: Precision,
    adapter_name: String,
    /// The first error the device reported outside an error scope.
    errors: Arc<Mutex<Option<String>>>,
}

/// Activation buffers, reused once their values are dead.
/// 1-D launches of 256 threads, folded into a 2-D grid within the dispatch limits.
fn grid(total: usize, max: u32) -> (u32, u32, u32) {
    let groups = total.div_ceil(256).max(1) as u64;
    let gx = groups.min(max as u64);
    (gx as u32, groups.div_ceil(gx) as u32, 1)
}

/// Words in every parameter buffer: at least the largest `Params` struct of the kernels.
const PARAM_WORDS: usize = 32;

/// A uniform buffer of u32 parameters, zero-padded to `PARAM_WORDS`.
fn params(device: &wgpu::Device, values: &[u32]) -> wgpu::Buffer {
    let mut v = values.to_vec();
    v.resize(PARAM_WORDS.max(v.len()), 0);
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("params"),
        contents: bytemuck::cast_slice(&v),
        usage: wgpu::BufferUsages::UNIFORM,
    })
}

fn storage(device: &wgpu::Device, label: &str, bytes: &[u8]) -> wgpu::Buffer {
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some(label),
        contents: bytes,
        usage: wgpu::BufferUsages::STORAGE,
    })
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut b: Vec<u8> = bytemuck::cast_slice(v).to_vec();
    if b.is_empty() {
        b.resize(4, 0);
    }
    b
}

/// Compile a kernel file with the storage type prepended, reporting naga's full message.
fn shader(
    device: &wgpu::Device,
    file: &str,
    kernels_dir: Option<&PathBuf>,
    precision: Precision,
) -> Result<wgpu::ShaderModule, BackendError> {
    let (path, text) = match kernels_dir {
        Some(dir) => {
            let p = dir.join("wgsl").join(file);
            let text = std::fs::read_to_string(&p).map_err(|e| BackendError::Compile {
                path: p.display().to_string(),
                log: format!("cannot read the kernel: {e}"),
            })?;
            (p.display().to_string(), text)
        }
        None => {
            let text = KERNELS
                .iter()
                .find(|(f, _)| *f == file)
                .map(|(_, t)| t.to_string())
                .ok_or_else(|| BackendError::Compile {
                    path: format!("kernels/wgsl/{file}"),
                    log: "this kernel is not embedded in the binary (add it to KERNELS)".into(),
                })?;
            (format!("kernels/wgsl/{file} (embedded)"), text)
        }
    };
    let header = match precision {
        Precision::Fp16 => "enable f16;\nalias elem = f16;\n",
        _ => "alias elem = f32;\n",
    };
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(file),
        source: wgpu::ShaderSource::Wgsl(format!("{header}{text}").into()),
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(BackendError::Compile {
            path,
            log: format!(
                "{e}\n(line numbers count 2 extra lines: the storage-type header comes first)"
            ),
        });
    }
    Ok(module)
}

impl WgpuSession {
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: wgpu::Device,
        queue: wgpu::Queue,
        limits: wgpu::Limits,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
        timestamps: bool,
        adapter_name: String,
    ) -> Result<Self, BackendError> {
        let precision = opt.precision;
        let mut modules: HashMap<&str, wgpu::ShaderModule> = HashMap::new();
        let mut pipelines: HashMap<Kernel, wgpu::ComputePipeline> = HashMap::new();
        let mut pipeline = |k: Kernel| -> Result<wgpu::ComputePipeline, BackendError> {
            if let Some(p) = pipelines.get(&k) {
                return Ok(p.clone());
            }
            let (file, entry) = k.source();
            if !modules.contains_key(file) {
                modules.insert(
                    file,
                    shader(&device, file, opt.kernels_dir.as_ref(), precision)?,
                );
            }
            let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
            let p = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &modules[file],
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
            if let Some(e) = pollster::block_on(scope.pop()) {
                return Err(BackendError::Compile {
                    path: format!("kernels/wgsl/{file} ({entry})"),
                    log: e.to_string(),
                });
            }
            pipelines.insert(k, p.clone());
            Ok(p)
        };
        let max_groups = limits.max_compute_workgroups_per_dimension;
        let max_binding = limits.max_storage_buffer_binding_size;
        let check_size = |what: &str, bytes: u64| -> Result<(), BackendError> {
            if bytes > max_binding {
                return Err(BackendError::DeviceLimit(format!(
                    "{what} needs {} in one buffer, but this adapter binds at most {} per storage buffer \
                     (max_storage_buffer_binding_size): use a smaller network or batch, or another device",
                    crate::units::human_bytes(bytes),
                    crate::units::human_bytes(max_binding)
                )));
            }
            Ok(())
        };
        let zero = storage(&device, "zero", &[0u8; 16]);
        let numel = |s: &[usize]| s.iter().product::<usize>();
        let input_shape = plan.input_shape().to_vec();
        let input = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("input f32"),
            size: (numel(&input_shape) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        // Activation buffers, reused once their values are dead; dropout and a flatten of
        // 1×1 maps change nothing and share their input's buffer.
        let nodes = &plan.graph.nodes;
        let renames = |id: usize| match nodes[id].op {
            Op::Dropout { .. } => true,
            Op::Flatten => {
                plan.shapes[nodes[id].inputs[0]][2..]
                    .iter()
                    .product::<usize>()
                    == 1
            }
            _ => false,
        };
        let mut assignment =
            plan.assign_buffers(|id| elem_bytes(numel(&plan.shapes[id]), precision), renames);
        let output_shape = plan.output_shape().to_vec();
        let out_total = numel(&output_shape);
        // An image output is converted from NHWC in a scratch buffer after the last node.
        let out_scratch = match *output_shape.as_slice() {
            [_, _, oh, ow] if oh * ow > 1 => {
                Some(assignment.scratch(elem_bytes(out_total, precision)))
            }
            _ => None,
        };
        for (node, shape) in nodes.iter().zip(&plan.shapes) {
            check_size(
                &format!("`{}` output", node.name),
                elem_bytes(numel(shape), precision),
            )?;
        }
        let buffers: Vec<wgpu::Buffer> = (assignment.bytes.iter())
            .map(|&size| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("activation"),
                    size,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                })
            })
            .collect();
        let buffer_of = |value: usize| &buffers[assignment.of[value]];
        let mut dispatches = Vec::new();
        let mut weight_bytes = 0u64;
        let dims = |id: usize| -> (usize, usize, usize, usize) {
            match *plan.shapes[id].as_slice() {
                [n, c, h, w] => (n, h, w, c),
                [n, f] => (n, 1, 1, f),
                _ => (1, 1, 1, numel(&plan.shapes[id])),
            }
        };
        let mut bind = |kernel: Kernel,
                        node: &str,
                        entries: &[(u32, &wgpu::Buffer)],
                        groups: (u32, u32, u32)|
         -> Result<Dispatch, BackendError> {
            let p = pipeline(kernel)?;
            let layout = p.get_bind_group_layout(0);
            let entries: Vec<wgpu::BindGroupEntry> = entries
                .iter()
                .map(|(b, buf)| wgpu::BindGroupEntry {
                    binding: *b,
                    resource: buf.as_entire_binding(),
                })
                .collect();
            let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(node),
                layout: &layout,
                entries: &entries,
            });
            if groups.0 > max_groups || groups.1 > max_groups || groups.2 > max_groups {
                return Err(BackendError::DeviceLimit(format!(
                    "`{node}` needs a {groups:?} grid, above this adapter's limit of {max_groups} per dimension: use a smaller batch"
                )));
            }
            Ok(Dispatch {
                kernel,
                node: node.to_string(),
                op: "output",
                pipeline: p,
                bind_group,
                groups,
            })
        };
        for (id, node) in nodes.iter().enumerate() {
            let first_dispatch = dispatches.len();
            let (n, h, w, c) = dims(id);
            let total = n * h * w * c;
            let get = |suffix: &str| -> Result<&[f32], BackendError> {
                let name = format!("{}.{}", node.name, suffix);
                weights
                    .get(&name)
                    .map(|t| t.data.as_slice())
                    .ok_or_else(|| {
                        BackendError::Invalid(format!("weights have no tensor `{name}`"))
                    })
            };
            // The node's input values (activation buffers) and a bias buffer, or the zero one.
            let input_buf = |k: usize| buffer_of(node.inputs[k]).clone();
            let bias_buf = |b: &[f32]| {
                if b.is_empty() {
                    zero.clone()
                } else {
                    storage(&device, "bias", &f32_bytes(b))
                }
            };
            let (_, xh, xw, xc) = node.inputs.first().map_or((0, 0, 0, 0), |&i| dims(i));
            let shape = [total, c, h * w];
            // Most ops are one launch: a kernel, its parameters, the buffers it reads (by binding)
            // and the binding of its output. The output buffer is placed after the match.
            let launches: Vec<Launch> = match &node.op {
                Op::Input { .. } => vec![(
                    Kernel::NchwToNhwc,
                    shape.to_vec(),
                    vec![(6, input.clone())],
                    5,
                    grid(total, max_groups),
                )],
                // Depthwise without an epilogue; a fused one takes the general kernel.
                Op::Conv2d(conv)
                    if conv.groups > 1
                        && conv.groups == conv.in_channels
                        && conv.groups == conv.out_channels
                        && conv.act == crate::model::op::Act::None
                        && !conv.residual =>
                {
                    let (wt, bias) = (get("weight")?, if conv.bias { get("bias")? } else { &[] });
                    let (kh, kw) = conv.kernel;
                    // Depthwise weights as (ky, kx, c) in f32, rounded to the run's precision.
                    let mut dw = vec![0f32; kh * kw * c];
                    for ch in 0..c {
                        for k in 0..kh * kw {
                            dw[k * c + ch] = precision.round(wt[ch * kh * kw + k]);
                        }
                    }
                    weight_bytes += ((dw.len() + bias.len()) * 4) as u64;
                    let p = vec![
                        total,
                        xh,
                        xw,
                        c,
                        h,
                        w,
                        kh,
                        kw,
                        conv.stride.0,
                        conv.stride.1,
                        conv.padding.0,
                        conv.padding.1,
                        conv.dilation.0,
                        conv.dilation.1,
                        conv.bias as usize,
                    ];
                    let reads = vec![
                        (1, input_buf(0)),
                        (2, storage(&device, "depthwise weights", &f32_bytes(&dw))),
                        (3, bias_buf(bias)),
                    ];
                    vec![(Kernel::Depthwise, p, reads, 4, grid(total, max_groups))]
                }
                Op::Conv2d(conv) => {
                    let bias = if conv.bias { get("bias")? } else { &[] };
                    let gemm = Gemm {
                        conv,
                        weights: &pack_conv(conv, get("weight")?),
                        input: (xh, xw, xc),
                        output: (n, h, w),
                        variant: opt.variants.get(&node.name).map(String::as_str),
                    };
                    let (launches, bytes) =
                        gemm.launches(&device, &node.name, precision, max_binding)?;
                    weight_bytes += bytes + bias.len() as u64 * 4;
                    let residual = if conv.residual {
                        input_buf(1)
                    } else {
                        zero.clone()
                    };
                    let reads = [(1, input_buf(0)), (3, bias_buf(bias)), (5, residual)];
                    with_reads(launches, &reads)
                }
                Op::Linear {
                    in_features: fin,
                    out_features: fout,
                    bias,
                } => {
                    let (fin, fout) = (*fin, *fout);
                    let wt = get("weight")?;
                    let b = if *bias { get("bias")? } else { &[] };
                    // W (out × in) as the (in × out) B matrix of a 1×1 convolution on 1×1 images.
                    let mut packed = vec![0f32; fin * fout];
                    for o in 0..fout {
                        for k in 0..fin {
                            packed[k * fout + o] = wt[o * fin + k];
                        }
                    }
                    let conv = Conv2d {
                        bias: *bias,
                        ..Conv2d::new(fin, fout, 1, 1, 0)
                    };
                    let gemm = Gemm {
                        conv: &conv,
                        weights: &packed,
                        input: (1, 1, fin),
                        output: (n, 1, 1),
                        variant: opt.variants.get(&node.name).map(String::as_str),
                    };
                    let (launches, bytes) =
                        gemm.launches(&device, &node.name, precision, max_binding)?;
                    weight_bytes += bytes + b.len() as u64 * 4;
                    let reads = [(1, input_buf(0)), (3, bias_buf(b)), (5, zero.clone())];
                    with_reads(launches, &reads)
                }
                Op::BatchNorm { eps, .. } => {
                    let (g, b, m, v) = (
                        get("weight")?,
                        get("bias")?,
                        get("running_mean")?,
                        get("running_var")?,
                    );
                    let (scale, shift) = batch_norm_affine(g, b, m, v, *eps);
                    weight_bytes += (scale.len() * 8) as u64;
                    let reads = vec![
                        (1, input_buf(0)),
                        (3, storage(&device, "scale", &f32_bytes(&scale))),
                        (4, storage(&device, "shift", &f32_bytes(&shift))),
                    ];
                    vec![(
                        Kernel::Affine,
                        shape.to_vec(),
                        reads,
                        5,
                        grid(total, max_groups),
                    )]
                }
                Op::Relu | Op::Relu6 => {
                    let hi = if matches!(node.op, Op::Relu6) {
                        6.0f32
                    } else {
                        f32::MAX
                    };
                    let p = vec![
                        total,
                        c,
                        h * w,
                        0f32.to_bits() as usize,
                        hi.to_bits() as usize,
                    ];
                    vec![(
                        Kernel::Clamp,
                        p,
                        vec![(1, input_buf(0))],
                        5,
                        grid(total, max_groups),
                    )]
                }
                Op::Add => vec![(
                    Kernel::Add,
                    shape.to_vec(),
                    vec![(1, input_buf(0)), (2, input_buf(1))],
                    5,
                    grid(total, max_groups),
                )],
                Op::MaxPool(pool) | Op::AvgPool(pool) => {
                    let p = vec![
                        total,
                        xh,
                        xw,
                        c,
                        h,
                        w,
                        pool.kernel.0,
                        pool.kernel.1,
                        pool.stride.0,
                        pool.stride.1,
                        pool.padding.0,
                        pool.padding.1,
                        pool.count_include_pad as usize,
                    ];
                    let k = if matches!(node.op, Op::MaxPool(_)) {
                        Kernel::MaxPool
                    } else {
                        Kernel::AvgPool
                    };
                    vec![(k, p, vec![(1, input_buf(0))], 2, grid(total, max_groups))]
                }
                Op::AdaptiveAvgPool { .. } => {
                    let p = vec![total, xh, xw, c, h, w];
                    vec![(
                        Kernel::AdaptiveAvgPool,
                        p,
                        vec![(1, input_buf(0))],
                        2,
                        grid(total, max_groups),
                    )]
                }
                // Dropout and a flatten of a 1×1 map change nothing: the value shares its input's buffer.
                Op::Dropout { .. } => Vec::new(),
                Op::Flatten if xh * xw == 1 => Vec::new(),
                Op::Flatten => vec![(
                    Kernel::NhwcToNchw,
                    vec![total, xc, xh * xw],
                    vec![(1, input_buf(0))],
                    5,
                    grid(total, max_groups),
                )],
                Op::Softmax => vec![(
                    Kernel::Softmax,
                    shape.to_vec(),
                    vec![(1, input_buf(0))],
                    5,
                    grid(total / c.max(1), max_groups),
                )],
            };
            debug_assert_eq!(launches.is_empty(), renames(id), "`{}`", node.name);
            for (kernel, p, reads, out, groups) in launches {
                let pbuf = params(&device, &p.iter().map(|&v| v as u32).collect::<Vec<_>>());
                let mut entries: Vec<(u32, &wgpu::Buffer)> = vec![(0, &pbuf)];
                entries.extend(reads.iter().map(|(b, buf)| (*b, buf)));
                entries.push((out, buffer_of(id)));
                dispatches.push(bind(kernel, &node.name, &entries, groups)?);
            }
            for d in &mut dispatches[first_dispatch..] {
                d.op = node.op.kind_name();
            }
        }
        // The output, converted to f32 (and from NHWC to NCHW when it is an image).
        let out_id = plan.graph.output;
        let output = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("output f32"),
            size: (out_total * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut src = buffer_of(out_id).clone();
        if let (Some(tmp), [_, oc, oh, ow]) = (out_scratch, output_shape.as_slice()) {
            let pb = params(&device, &[out_total as u32, *oc as u32, (oh * ow) as u32]);
            let tmp_buf = buffers[tmp].clone();
            dispatches.push(bind(
                Kernel::NhwcToNchw,
                "output",
                &[(0, &pb), (1, &src), (5, &tmp_buf)],
                grid(out_total, max_groups),
            )?);
            src = tmp_buf;
        }
        let pb = params(&device, &[out_total as u32, 1, 1]);
        dispatches.push(bind(
            Kernel::ToF32,
            "output",
            &[(0, &pb), (1, &src), (7, &output)],
            grid(out_total, max_groups),
        )?);
        let readback = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: (out_total * 4) as u64,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let timestamps = timestamps.then(|| {
            let count = (dispatches.len() * 2) as u32;
            let set = device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("kernel times"),
                ty: wgpu::QueryType::Timestamp,
                count,
            });
            let resolve = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: count as u64 * 8,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let read = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps readback"),
                size: count as u64 * 8,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            (set, resolve, read)
        });
        Ok(WgpuSession {
            device,
            queue,
            dispatches,
            input,
            output,
            readback,
            output_shape,
            input_shape,
            timestamps,
            ran: false,
            weight_bytes,
            activation_bytes: assignment.total_bytes(),
            precision,
            adapter_name,
            errors: Arc::default(),
        })
    }

    fn check_errors(&self) -> Result<(), BackendError> {
        match self.errors.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(BackendError::Driver(format!(
                "the GPU reported an error: {e}"
            ))),
            None => Ok(()),
        }
    }

    fn read(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>, BackendError> {
        map_read(&self.device, buffer)
    }
}

/// Map a buffer, wait for it, and copy its bytes out.
fn map_read(device: &wgpu::Device, buffer: &wgpu::Buffer) -> Result<Vec<u8>, BackendError> {
    let (tx, rx) = std::sync::mpsc::channel();
    buffer.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = tx.send(r);
    });
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| BackendError::Driver(format!("waiting for the GPU failed: {e}")))?;
    rx.recv()
        .map_err(|_| BackendError::Driver("the GPU never answered the read".into()))?
        .map_err(|e| BackendError::Driver(format!("reading GPU memory failed: {e}")))?;
    let bytes = buffer
        .get_mapped_range(..)
        .map_err(|e| BackendError::Driver(format!("reading GPU memory failed: {e}")))?
        .to_vec();
    buffer.unmap();
    Ok(bytes)
}

/// Few enough output rows for `conv2d_rows` (two of its 8-row passes at most): a 64-row tile
/// would waste most of its work, while re-reading B twice costs less.
const FEW_ROWS: usize = 16;

/// A convolution or linear layer as the implicit GEMM of conv2d.wgsl: per group a
/// (taps × cout_g) weight matrix, an NHWC input of (h, w, cin), an output of (n, oh, ow).
struct Gemm<'a> {
    conv: &'a Conv2d,
    weights: &'a [f32],
    input: (usize, usize, usize),
    output: (usize, usize, usize),
    /// `tiled` or `rows` to force a kernel (max-autotune), else chosen by the row count.
    variant: Option<&'a str>,
}

impl Gemm<'_> {
    /// Its launches, each with its parameters and weight buffer (binding 2), and the weight
    /// bytes uploaded. A weight matrix larger than one storage binding allows is cut into
    /// slices of output channels, one launch each (VGG's and AlexNet's first classifier
    /// layers on adapters that bind 128 MiB).
    fn launches(
        &self,
        device: &wgpu::Device,
        node: &str,
        precision: Precision,
        max_binding: u64,
    ) -> Result<(Vec<Launch>, u64), BackendError> {
        let c = self.conv;
        let (k_g, cout_g) = (c.taps(), c.out_channels / c.groups);
        let bytes = elem_bytes(self.weights.len(), precision);
        let (n, oh, ow) = self.output;
        let m = n * oh * ow;
        let kernel = match self.variant {
            Some("rows") => Kernel::Conv2dRows,
            Some("tiled") => Kernel::Conv2d,
            _ if m <= FEW_ROWS => Kernel::Conv2dRows,
            _ => Kernel::Conv2d,
        };
        let slice = if bytes <= max_binding {
            cout_g
        } else {
            // Whole 64-column tiles per slice.
            let per_column = elem_bytes(k_g, precision);
            (max_binding / per_column) as usize / 64 * 64
        };
        if c.groups > 1 && slice < cout_g || slice == 0 {
            return Err(BackendError::DeviceLimit(format!(
                "`{node}.weight` needs {} in one buffer, but this adapter binds at most {} per storage buffer \
                 (max_storage_buffer_binding_size): use a smaller network, or another device",
                crate::units::human_bytes(bytes),
                crate::units::human_bytes(max_binding)
            )));
        }
        let mut launches = Vec::new();
        let mut uploaded = 0;
        for base in (0..cout_g).step_by(slice) {
            let width = slice.min(cout_g - base);
            let matrix: Vec<f32> = if width == cout_g {
                self.weights.to_vec()
            } else {
                (0..k_g)
                    .flat_map(|k| &self.weights[k * cout_g + base..][..width])
                    .copied()
                    .collect()
            };
            let bytes = to_bytes(&matrix, precision);
            uploaded += elem_bytes(matrix.len(), precision);
            let (i_h, i_w, cin) = self.input;
            // The order of `Params` in conv2d.wgsl.
            let params = vec![
                m,
                i_h,
                i_w,
                cin,
                oh,
                ow,
                c.out_channels,
                c.kernel.1,
                c.stride.0,
                c.stride.1,
                c.padding.0,
                c.padding.1,
                c.dilation.0,
                c.dilation.1,
                c.in_channels / c.groups,
                width,
                k_g,
                c.bias as usize,
                c.act.code() as usize,
                base,
                c.residual as usize,
            ];
            let groups = match kernel {
                Kernel::Conv2dRows => (m.div_ceil(8), width.div_ceil(64), c.groups),
                _ => (m.div_ceil(64), width.div_ceil(64), c.groups),
            };
            let groups = (groups.0 as u32, groups.1 as u32, groups.2 as u32);
            let wbuf = storage(device, "weights", &bytes);
            launches.push((kernel, params, vec![(2, wbuf)], 4, groups));
        }
        Ok((launches, uploaded))
    }
}

/// Launches with the buffers every one of them reads added.
fn with_reads(mut launches: Vec<Launch>, reads: &[(u32, wgpu::Buffer)]) -> Vec<Launch> {
    for l in &mut launches {
        l.2.extend(reads.iter().cloned());
    }
    launches
}

/// PyTorch's (cout, cin/g, kh, kw) weight as per-group (taps × cout_g) matrices, taps
/// ordered (ky, kx, ci) like the NHWC gather of the kernel.
fn pack_conv(conv: &Conv2d, weight: &[f32]) -> Vec<f32> {
    let (k_g, cout_g) = (conv.taps(), conv.out_channels / conv.groups);
    let mut packed = Vec::with_capacity(conv.groups * k_g * cout_g);
    for g in 0..conv.groups {
        for k in 0..k_g {
            packed.extend((0..cout_g).map(|co| weight[conv.weight_index(g, k, co)]));
        }
    }
    packed
}

impl Session for WgpuSession {
    fn run(&mut self, input: &Tensor) -> Result<(), BackendError> {
        if input.shape != self.input_shape {
            return Err(BackendError::Invalid(format!(
                "input has shape {:?}, the prepared plan expects {:?}",
                input.shape, self.input_shape
            )));
        }
        self.queue
            .write_buffer(&self.input, 0, &f32_bytes(&input.data));
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("forward"),
            });
        match &self.timestamps {
            // One pass per kernel, each with its begin and end timestamps.
            Some((set, resolve, read)) => {
                for (i, d) in self.dispatches.iter().enumerate() {
                    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some(&d.node),
                        timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                            query_set: set,
                            beginning_of_pass_write_index: Some(2 * i as u32),
                            end_of_pass_write_index: Some(2 * i as u32 + 1),
                        }),
                    });
                    pass.set_pipeline(&d.pipeline);
                    pass.set_bind_group(0, &d.bind_group, &[]);
                    pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
                }
                let count = (self.dispatches.len() * 2) as u32;
                encoder.resolve_query_set(set, 0..count, resolve, 0);
                encoder.copy_buffer_to_buffer(resolve, 0, read, 0, count as u64 * 8);
            }
            None => {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("forward"),
                    timestamp_writes: None,
                });
                for d in &self.dispatches {
                    pass.set_pipeline(&d.pipeline);
                    pass.set_bind_group(0, &d.bind_group, &[]);
                    pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
                }
            }
        }
        encoder.copy_buffer_to_buffer(&self.output, 0, &self.readback, 0, self.output.size());
        self.queue.submit([encoder.finish()]);
        self.ran = true;
        Ok(())
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| BackendError::Driver(format!("waiting for the GPU failed: {e}")))?;
        self.check_errors()
    }

    fn read_output(&mut self) -> Result<Tensor, BackendError> {
        if !self.ran {
            return Err(BackendError::Invalid("no forward pass has run yet".into()));
        }
        let bytes = self.read(&self.readback)?;
        let data = bytemuck::pod_collect_to_vec::<u8, f32>(&bytes);
        Ok(Tensor::new(self.output_shape.clone(), data))
    }

    fn kernel_times(&mut self) -> Option<Vec<KernelTime>> {
        let (_, _, read) = self.timestamps.as_ref()?;
        if !self.ran {
            return Some(Vec::new());
        }
        let bytes = self.read(read).ok()?;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&bytes);
        let period = self.queue.get_timestamp_period() as f64;
        Some(
            self.dispatches
                .iter()
                .enumerate()
                .map(|(i, d)| KernelTime {
                    node: d.node.clone(),
                    op: d.op.to_string(),
                    kernel: format!("{}_{}", d.kernel.source().1, self.precision.name()),
                    start_ns: (ticks[2 * i].saturating_sub(ticks[0]) as f64 * period) as u64,
                    ns: (ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * period) as u64,
                })
                .collect(),
        )
    }

    fn memory(&self) -> MemoryStats {
        let io = self.input.size() + self.output.size() + self.readback.size();
        MemoryStats {
            weights: self.weight_bytes,
            peak_activations: self.activation_bytes + io,
            peak: self.weight_bytes + self.activation_bytes + io,
        }
    }

    fn replay(&self) -> Result<String, String> {
        Err(
            "WebGPU cannot replay a command buffer: pipelines and bind groups are created once \
             in every mode, and each pass encodes one compute pass"
                .into(),
        )
    }

    fn kernel_version(&self) -> String {
        format!(
            "workshop-wgsl {} on {} ({})",
            env!("CARGO_PKG_VERSION"),
            self.adapter_name,
            self.precision
        )
    }
}

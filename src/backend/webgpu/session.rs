//! A prepared wgpu session: the lowered launches ([`super::lower`]) made real — buffers,
//! pipelines and bind groups created once — and run as one command encoder per forward pass,
//! one compute pass (one per kernel when timing each), then a copy of the f32 logits into a
//! mappable buffer that `read_output` maps after the device is polled.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use wgpu::util::DeviceExt;

use super::Kernel;
use super::lower::{self, Buf, Limits, f32_bytes};
use crate::backend::{BackendError, ExecOptions, KernelTime, MemoryStats, Session};
use crate::model::{Plan, Precision, Tensor, Weights};

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

pub(super) struct WgpuSession {
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
    pub(super) errors: Arc<Mutex<Option<String>>>,
}

/// Words in every parameter buffer: at least the largest `Params` struct of the kernels.
const PARAM_WORDS: usize = 32;

/// A uniform buffer of u32 parameters, zero-padded to `PARAM_WORDS`.
pub(super) fn params(device: &wgpu::Device, values: &[u32]) -> wgpu::Buffer {
    let mut v = values.to_vec();
    v.resize(PARAM_WORDS.max(v.len()), 0);
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("params"),
        contents: bytemuck::cast_slice(&v),
        usage: wgpu::BufferUsages::UNIFORM,
    })
}

pub(super) fn storage(device: &wgpu::Device, label: &str, bytes: &[u8]) -> wgpu::Buffer {
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some(label),
        contents: bytes,
        usage: wgpu::BufferUsages::STORAGE,
    })
}

/// `count` timestamp queries, the buffer they resolve into and a mappable copy of it.
pub(super) fn timestamp_queries(
    device: &wgpu::Device,
    count: usize,
) -> (wgpu::QuerySet, wgpu::Buffer, wgpu::Buffer) {
    let set = device.create_query_set(&wgpu::QuerySetDescriptor {
        label: Some("kernel times"),
        ty: wgpu::QueryType::Timestamp,
        count: count as u32,
    });
    let buffer = |label: &str, usage: wgpu::BufferUsages| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: count as u64 * 8,
            usage,
            mapped_at_creation: false,
        })
    };
    use wgpu::BufferUsages as U;
    let resolve = buffer("timestamps", U::QUERY_RESOLVE | U::COPY_SRC);
    let read = buffer("timestamps readback", U::MAP_READ | U::COPY_DST);
    (set, resolve, read)
}

/// The compute pipelines of a session, built on first use: one shader module per kernel file,
/// one pipeline per entry point.
pub(super) struct Pipelines<'a> {
    device: &'a wgpu::Device,
    kernels_dir: Option<&'a PathBuf>,
    precision: Precision,
    modules: HashMap<&'static str, wgpu::ShaderModule>,
    pipelines: HashMap<Kernel, wgpu::ComputePipeline>,
}

impl<'a> Pipelines<'a> {
    pub(super) fn new(
        device: &'a wgpu::Device,
        kernels_dir: Option<&'a PathBuf>,
        precision: Precision,
    ) -> Self {
        Pipelines {
            device,
            kernels_dir,
            precision,
            modules: HashMap::new(),
            pipelines: HashMap::new(),
        }
    }

    /// `kernel`'s pipeline; a compile or validation error names the file and entry point.
    pub(super) fn get(&mut self, k: Kernel) -> Result<wgpu::ComputePipeline, BackendError> {
        if let Some(p) = self.pipelines.get(&k) {
            return Ok(p.clone());
        }
        let (file, entry) = k.source();
        if !self.modules.contains_key(file) {
            let module = shader(self.device, file, self.kernels_dir, self.precision)?;
            self.modules.insert(file, module);
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let p = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &self.modules[file],
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
        self.pipelines.insert(k, p.clone());
        Ok(p)
    }
}

/// A kernel file's (path, text): DIR's copy where `kernels_dir` has one, else the built-in one.
fn source(file: &str, kernels_dir: Option<&PathBuf>) -> Result<(String, String), BackendError> {
    crate::backend::kernel_files::read(&format!("wgsl/{file}"), kernels_dir.map(|d| d.as_path()))
}

/// Compile a kernel file with the storage type and activate.wgsl appended, reporting naga's
/// full message with the file's own path and line numbers: WGSL lets a module use a
/// declaration before it, so only FP16's `enable` directive, which must come first, goes
/// ahead of the file — on its first line, which shifts nothing but that line's columns.
pub(super) fn shader(
    device: &wgpu::Device,
    file: &str,
    kernels_dir: Option<&PathBuf>,
    precision: Precision,
) -> Result<wgpu::ShaderModule, BackendError> {
    let (path, text) = source(file, kernels_dir)?;
    let (_, library) = source("activate.wgsl", kernels_dir)?;
    let (directive, elem) = match precision {
        Precision::Fp16 => ("enable f16; ", "f16"),
        _ => ("", "f32"),
    };
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(file),
        source: wgpu::ShaderSource::Wgsl(
            format!("{directive}{text}\nalias elem = {elem};\n{library}").into(),
        ),
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        // naga's code frame names the source `wgsl` (`┌─ wgsl:64:29`); its line numbers are
        // the file's own.
        let log = e.to_string().replace("┌─ wgsl:", &format!("┌─ {path}:"));
        return Err(BackendError::Compile { path, log });
    }
    Ok(module)
}

impl WgpuSession {
    /// Lower `plan` ([`lower::lower`]), then create what its launches bind: the activation
    /// buffers, the constants, the input and output, one pipeline per kernel (compiled once per
    /// file), one bind group per launch; and the timestamp queries when timing each kernel.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
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
        let limits = Limits {
            max_groups: limits.max_compute_workgroups_per_dimension,
            max_binding: limits.max_storage_buffer_binding_size,
        };
        let lowered = lower::lower(plan, weights, precision, &opt.variants, limits)?;
        let numel = |s: &[usize]| s.iter().product::<usize>();
        let input_shape = plan.input_shape().to_vec();
        let output_shape = plan.output_shape().to_vec();
        let buffer = |label: &str, size: u64, usage: wgpu::BufferUsages| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage,
                mapped_at_creation: false,
            })
        };
        use wgpu::BufferUsages as U;
        let input = buffer(
            "input f32",
            (numel(&input_shape) * 4) as u64,
            U::STORAGE | U::COPY_DST,
        );
        let out_bytes = (numel(&output_shape) * 4) as u64;
        let output = buffer("output f32", out_bytes, U::STORAGE | U::COPY_SRC);
        let readback = buffer("readback", out_bytes, U::MAP_READ | U::COPY_DST);
        let activations: Vec<wgpu::Buffer> = (lowered.assignment.bytes.iter())
            .map(|&size| buffer("activation", size, U::STORAGE | U::COPY_SRC))
            .collect();
        let consts: Vec<wgpu::Buffer> = (lowered.consts.0.iter())
            .map(|(label, bytes)| storage(&device, label, bytes))
            .collect();
        let zero = storage(&device, "zero", &[0u8; 16]);
        let resolve = |b: Buf| match b {
            Buf::Input => &input,
            Buf::Activation(i) => &activations[i],
            Buf::Const(i) => &consts[i],
            Buf::Zero => &zero,
            Buf::Output => &output,
        };
        let mut pipelines = Pipelines::new(&device, opt.kernels_dir.as_ref(), precision);
        let mut dispatches = Vec::with_capacity(lowered.launches.len());
        for l in &lowered.launches {
            let pipeline = pipelines.get(l.kernel)?;
            let layout = pipeline.get_bind_group_layout(0);
            let pbuf = params(&device, &l.params);
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: pbuf.as_entire_binding(),
            }];
            entries.extend(l.bindings.iter().map(|&(binding, b)| wgpu::BindGroupEntry {
                binding,
                resource: resolve(b).as_entire_binding(),
            }));
            let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(&l.node),
                layout: &layout,
                entries: &entries,
            });
            dispatches.push(Dispatch {
                kernel: l.kernel,
                node: l.node.clone(),
                op: l.op,
                pipeline,
                bind_group,
                groups: l.groups,
            });
        }
        let timestamps = timestamps.then(|| timestamp_queries(&device, dispatches.len() * 2));
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
            weight_bytes: lowered.weight_bytes,
            activation_bytes: lowered.assignment.total_bytes(),
            precision,
            adapter_name,
            errors: Arc::default(),
        })
    }

    pub(super) fn check_errors(&self) -> Result<(), BackendError> {
        reported(&self.errors)
    }

    fn read(&self, buffer: &wgpu::Buffer) -> Result<Vec<u8>, BackendError> {
        map_read(&self.device, buffer)
    }
}

/// The first error the device reported outside an error scope (`errors`), if any.
pub(super) fn reported(errors: &Mutex<Option<String>>) -> Result<(), BackendError> {
    match errors.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(e) => Err(BackendError::Driver(format!(
            "the GPU reported an error: {e}"
        ))),
        None => Ok(()),
    }
}

/// Wait until `device` has finished what was submitted, then report any error it raised.
pub(super) fn wait(
    device: &wgpu::Device,
    errors: &Mutex<Option<String>>,
) -> Result<(), BackendError> {
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| BackendError::Driver(format!("waiting for the GPU failed: {e}")))?;
    reported(errors)
}

/// Map a buffer, wait for it, and copy its bytes out.
pub(super) fn map_read(
    device: &wgpu::Device,
    buffer: &wgpu::Buffer,
) -> Result<Vec<u8>, BackendError> {
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

impl WgpuSession {
    /// One forward pass on the input buffer as it is (the session's own: no op writes it),
    /// with the output copied for reading back; `ran` once it is submitted.
    fn pass(&mut self) -> Result<(), BackendError> {
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
        self.pass()
    }

    /// The input buffer holds the last upload until the next.
    fn rerun(&mut self) -> Result<bool, BackendError> {
        if !self.ran {
            return Ok(false);
        }
        self.pass().map(|_| true)
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        wait(&self.device, &self.errors)
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
                    fused: Vec::new(),
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

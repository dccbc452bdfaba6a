//! What the CUDA and HIP backends share: one kernel source (kernels/gpu/ops.cuh, included by
//! kernels/cuda/ops.cu and kernels/hip/ops.hip), one [`program`] that lays a plan out as
//! launches, and one [`GpuSession`] that runs it on anything implementing [`Device`]: CUDA
//! through cudarc, HIP through hip-sys, or [`emu`], which compiles the same kernels for the host
//! CPU so that the shared path is tested on machines without a GPU.

pub mod arch;
pub mod ceiling;
#[cfg(feature = "cuda")]
pub mod cudnn;
pub mod decoder;
#[cfg(unix)]
pub mod dl;
#[cfg(unix)]
pub mod emu;
pub mod lower;
#[cfg(unix)]
pub mod miopen;
pub mod program;
#[cfg(unix)]
pub mod rocblas;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use super::{BackendError, ExecOptions, KernelTime, MemoryStats, Session};
use crate::model::{Plan, Precision, Tensor, Weights};
use program::{Contents, Program, Work};

/// A kernel file with its `#include "..."` lines replaced by the files they name (relative to
/// kernels/), with `#line` markers so compile errors name the right file and line. Each file
/// is `kernels_dir`'s copy where it has one, else the binary's ([`super::kernel_files`]).
pub fn source(path: &str, kernels_dir: Option<&Path>) -> Result<String, BackendError> {
    let (name, text) = super::kernel_files::read(path, kernels_dir)?;
    let dir = Path::new(path).parent().unwrap_or(Path::new(""));
    let mut out = format!("#line 1 \"{name}\"\n");
    for (i, line) in text.lines().enumerate() {
        let included = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|r| r.strip_suffix('"'));
        match included {
            Some(inc) => {
                let target = normalize(&dir.join(inc));
                out.push_str(&source(&target, kernels_dir)?);
                out.push_str(&format!("#line {} \"{name}\"\n", i + 2));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    Ok(out)
}

/// `cuda/../gpu/ops.cuh` → `gpu/ops.cuh`.
fn normalize(p: &Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            _ => {}
        }
    }
    parts.join("/")
}

/// A kernel source's hash: compiled modules are cached by it (and by device and precision),
/// in memory and on disk (PTX, the emulator's libraries), so it must be stable.
pub fn source_hash(src: &str) -> u64 {
    crate::files::stable_hash(src.as_bytes())
}

/// Compiled modules of one backend by (device, precision, source hash), kept for the life of
/// the process: a session after the first compiles nothing.
pub struct ModuleCache<M>(OnceLock<Mutex<ModuleMap<M>>>);

type ModuleMap<M> = HashMap<(usize, Precision, u64), M>;

impl<M: Clone> Default for ModuleCache<M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M: Clone> ModuleCache<M> {
    pub const fn new() -> Self {
        ModuleCache(OnceLock::new())
    }

    /// The module of `source` for `device` and `precision`, loaded by `load` the first time
    /// (under the lock: sessions prepared in parallel compile a source once).
    pub fn get_or_load(
        &self,
        device: usize,
        precision: Precision,
        source: &str,
        load: impl FnOnce() -> Result<M, BackendError>,
    ) -> Result<M, BackendError> {
        let key = (device, precision, source_hash(source));
        let mut map = self
            .0
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(m) = map.get(&key) {
            return Ok(m.clone());
        }
        let m = load()?;
        map.insert(key, m.clone());
        Ok(m)
    }
}

/// The preprocessor definition that selects the storage type in ops.cuh.
pub fn precision_define(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "WS_FP32",
        Precision::Fp16 => "WS_FP16",
        Precision::Bf16 => "WS_BF16",
    }
}

/// A device as the shared session drives it: memory, compiled kernels, launches in order on one
/// stream, and timing marks between them.
pub trait Device {
    type Function: Clone;
    /// Compile kernels/gpu/ops.cuh (through the backend's dialect file) for `precision` and
    /// look up `names` in it.
    fn compile(
        &mut self,
        precision: Precision,
        kernels_dir: Option<&Path>,
        names: &[&'static str],
    ) -> Result<Vec<Self::Function>, BackendError>;
    /// Device memory of `bytes` (zeroed), as an address kernels take.
    fn alloc(&mut self, bytes: u64) -> Result<u64, BackendError>;
    fn upload(&mut self, ptr: u64, data: &[u8]) -> Result<(), BackendError>;
    /// Copy device memory to the host, after everything enqueued before has finished.
    fn download(&mut self, ptr: u64, out: &mut [u8]) -> Result<(), BackendError>;
    /// Enqueue a launch of `block` threads per block; `args` is the kernel's argument struct.
    fn launch(
        &mut self,
        f: &Self::Function,
        grid: [u32; 3],
        block: u32,
        args: &[u8],
    ) -> Result<(), BackendError>;
    /// Whether the device has half-precision matrix units our kernels use (the `_mma_`
    /// convolutions: tensor cores from compute capability 8.0 on).
    fn matrix_units(&self) -> bool {
        false
    }
    /// Make [`Device::gemm`] ready, or say why it cannot run here: called at prepare time, so
    /// `--kernels vendor` without a library is refused before anything runs, and the library's
    /// handle exists before a pass is recorded (making one allocates, which a CUDA stream
    /// capture refuses: cuBLAS answers `CUBLAS_STATUS_NOT_INITIALIZED`).
    fn vendor_gemm(&mut self) -> Result<(), BackendError>;
    /// Enqueue a library GEMM in the session's precision (the vendor kernel family).
    fn gemm(
        &mut self,
        g: &program::ColumnMajor,
        ptr: &dyn Fn(program::BufId) -> u64,
        precision: Precision,
    ) -> Result<(), BackendError>;
    /// A planned library convolution.
    type Conv;
    /// The library convolution the vendor family uses here (`cuDNN 9.1`), or why there is
    /// none: convolutions then run as im2col and a library GEMM.
    fn library_conv(&self) -> Result<String, String> {
        Err("this device has no convolution library".into())
    }
    /// Plan convolution `c` on the device addresses `[x, w, y]`: the library picks its
    /// algorithm (MIOpen times its candidates here, on these buffers) and the device grows
    /// the one workspace its convolutions share. At prepare time, never while recording.
    fn plan_conv(
        &mut self,
        c: &program::LibConv,
        ptrs: [u64; 3],
        precision: Precision,
    ) -> Result<Self::Conv, BackendError>;
    /// Enqueue a planned convolution.
    fn conv(&mut self, c: &Self::Conv) -> Result<(), BackendError>;
    /// Bytes of the library workspace the device holds for its convolutions.
    fn workspace_bytes(&self) -> u64 {
        0
    }
    /// Make `count` timing marks available (0..count).
    fn marks(&mut self, count: usize) -> Result<(), BackendError>;
    /// Enqueue mark `i`: it records when the work enqueued before it has finished.
    fn mark(&mut self, i: usize) -> Result<(), BackendError>;
    /// Nanoseconds from mark 0 to each mark, once `sync` has returned.
    fn mark_times(&mut self, count: usize) -> Result<Vec<u64>, BackendError>;
    fn sync(&mut self) -> Result<(), BackendError>;
    /// Start recording the launches enqueued from now on into a graph instead of running
    /// them; `Ok(false)` when this device cannot.
    fn begin_capture(&mut self) -> Result<bool, BackendError> {
        Ok(false)
    }
    /// Stop recording and keep the graph for [`Device::replay`].
    fn end_capture(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Enqueue the recorded graph: the whole pass in one call.
    fn replay(&mut self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported(
            "this device records no graphs".into(),
        ))
    }
    /// What a recorded graph is called here (`CUDA graph`).
    fn graph_name(&self) -> &'static str {
        "graph"
    }
    /// For records: the device, the compiler and the kernel library.
    fn describe(&self) -> String;
}

/// A launch with everything resolved: the function, the grid and the argument bytes; a
/// library GEMM's arguments; a planned library convolution.
enum Ready<F, C> {
    Kernel { f: F, grid: [u32; 3], args: Vec<u8> },
    Gemm(program::ColumnMajor),
    Conv(C),
}

/// A prepared forward pass on a [`Device`]. Every launch's arguments are packed once, at
/// prepare time; a forward pass only enqueues.
pub struct GpuSession<D: Device> {
    device: D,
    program: Program,
    ready: Vec<Ready<D::Function, D::Conv>>,
    ptrs: Vec<u64>,
    profile: bool,
    ran: bool,
    /// The pass was recorded at prepare time and is replayed (`ExecOptions::replay`); else why not.
    replay: Result<String, String>,
    /// With the vendor family: which libraries run what, for records.
    libraries: Option<String>,
}

impl<D: Device> GpuSession<D> {
    /// Lay `plan` out, refuse it when it needs more than `free` bytes, then allocate, upload
    /// and resolve every launch on `device`.
    pub fn new(
        mut device: D,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
        free: Option<u64>,
    ) -> Result<Self, BackendError> {
        // With the vendor family: the device's convolution library, or why none.
        let library_conv =
            (opt.kernels == super::KernelFamily::Vendor).then(|| device.library_conv());
        let target = lower::Target {
            mma: opt.precision != Precision::Fp32 && device.matrix_units(),
            library_conv: matches!(library_conv, Some(Ok(_))),
        };
        let program = lower::build(plan, weights, opt.precision, opt.kernels, target)?;
        if let Some(free) = free {
            fits(&program, plan.batch(), free)?;
        }
        if program
            .tasks
            .iter()
            .any(|s| matches!(s.work, Work::Gemm(_)))
        {
            device.vendor_gemm()?;
        }
        let libraries = library_conv.map(|conv| match conv {
            Ok(conv) => format!("vendor: {conv} convolutions, library GEMMs for linear layers"),
            Err(why) => format!("vendor: convolutions as im2col + library GEMM ({why})"),
        });
        let mut names: Vec<&'static str> = program
            .tasks
            .iter()
            .filter_map(|s| match &s.work {
                Work::Kernel(l) => Some(l.kernel),
                Work::Gemm(_) | Work::Conv(_) => None,
            })
            .collect();
        names.sort_unstable();
        names.dedup();
        let functions = device.compile(opt.precision, opt.kernels_dir.as_deref(), &names)?;
        let mut ptrs = Vec::with_capacity(program.buffers.len());
        for b in &program.buffers {
            let p = device.alloc(b.bytes)?;
            if let Contents::Weights(data) = &b.contents {
                device.upload(p, data)?;
            }
            ptrs.push(p);
        }
        let ptr = |b: program::BufId| ptrs[b];
        let mut ready = Vec::with_capacity(program.tasks.len());
        for s in &program.tasks {
            ready.push(match &s.work {
                Work::Kernel(l) => {
                    let i = names
                        .binary_search(&l.kernel)
                        .expect("every kernel was compiled");
                    Ready::Kernel {
                        f: functions[i].clone(),
                        grid: l.grid,
                        args: program::pack(&l.args, ptr),
                    }
                }
                Work::Gemm(g) => Ready::Gemm(g.column_major()),
                Work::Conv(c) => Ready::Conv(
                    device
                        .plan_conv(c, [ptr(c.x), ptr(c.w), ptr(c.y)], opt.precision)
                        .map_err(|e| match e {
                            // Which layer the library refused.
                            BackendError::Driver(m) => {
                                BackendError::Driver(format!("`{}`: {m}", s.node))
                            }
                            e => e,
                        })?,
                ),
            });
        }
        if opt.profile {
            device.marks(program.tasks.len() + 1)?;
        }
        let mut session = GpuSession {
            device,
            program,
            ready,
            ptrs,
            profile: opt.profile,
            ran: false,
            replay: Err("not asked for (--compile reduce-overhead asks)".into()),
            libraries,
        };
        if opt.replay {
            session.replay = if opt.profile {
                Err("profiling times every launch, so the pass is not recorded".into())
            } else if session.device.begin_capture()? {
                session.enqueue()?;
                session.device.end_capture()?;
                Ok(format!(
                    "{} of {} launches recorded once, replayed with one call per pass",
                    session.device.graph_name(),
                    session.ready.len()
                ))
            } else {
                Err(format!(
                    "{} cannot record graphs: every pass enqueues its launches",
                    session.device.describe()
                ))
            };
        }
        Ok(session)
    }

    /// One forward pass on the input buffer as it is: replayed where recorded, else enqueued
    /// launch by launch; `ran` once it is.
    fn pass(&mut self) -> Result<(), BackendError> {
        if self.replay.is_ok() {
            self.device.replay()?;
        } else {
            self.enqueue()?;
        }
        self.ran = true;
        Ok(())
    }

    /// Enqueue every launch of the pass, with timing marks when profiling.
    fn enqueue(&mut self) -> Result<(), BackendError> {
        if self.profile {
            self.device.mark(0)?;
        }
        let ptrs = &self.ptrs;
        for (i, r) in self.ready.iter().enumerate() {
            match r {
                Ready::Kernel { f, grid, args } => {
                    self.device.launch(f, *grid, program::BLOCK, args)?
                }
                Ready::Gemm(g) => self.device.gemm(g, &|b| ptrs[b], self.program.precision)?,
                Ready::Conv(c) => self.device.conv(c)?,
            }
            if self.profile {
                self.device.mark(i + 1)?;
            }
        }
        Ok(())
    }
}

impl<D: Device> Session for GpuSession<D> {
    fn run(&mut self, input: &Tensor) -> Result<(), BackendError> {
        if input.shape != self.program.input_shape {
            return Err(BackendError::Invalid(format!(
                "input has shape {:?}, the prepared plan expects {:?}",
                input.shape, self.program.input_shape
            )));
        }
        let bytes = Precision::Fp32.storage_bytes(&input.data);
        self.device.upload(self.ptrs[self.program.input], &bytes)?;
        self.pass()
    }

    /// The input buffer is the program's own (the first op converts it into an activation
    /// buffer), so it holds the last upload until the next.
    fn rerun(&mut self) -> Result<bool, BackendError> {
        if !self.ran {
            return Ok(false);
        }
        self.pass().map(|_| true)
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        self.device.sync()
    }

    fn read_output(&mut self) -> Result<Tensor, BackendError> {
        if !self.ran {
            return Err(BackendError::Invalid("no forward pass has run yet".into()));
        }
        let n: usize = self.program.output_shape.iter().product();
        let mut bytes = vec![0u8; n * 4];
        self.device
            .download(self.ptrs[self.program.output], &mut bytes)?;
        let data = bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Tensor::new(self.program.output_shape.clone(), data))
    }

    fn kernel_times(&mut self) -> Option<Vec<KernelTime>> {
        if !self.profile {
            return None;
        }
        if !self.ran {
            return Some(Vec::new());
        }
        self.device.sync().ok()?;
        let t = self.device.mark_times(self.ready.len() + 1).ok()?;
        let p = self.program.precision;
        Some(
            self.program
                .tasks
                .iter()
                .enumerate()
                .map(|(i, s)| KernelTime {
                    node: s.node.clone(),
                    op: s.op.to_string(),
                    kernel: s.kernel_name(p),
                    start_ns: t[i],
                    ns: t[i + 1].saturating_sub(t[i]),
                    fused: Vec::new(),
                })
                .collect(),
        )
    }

    fn memory(&self) -> MemoryStats {
        let weights = self.program.weight_bytes();
        // The libraries' workspace is scratch too.
        let activations = self.program.activation_bytes() + self.device.workspace_bytes();
        MemoryStats {
            weights,
            peak_activations: activations,
            peak: weights + activations,
        }
    }

    fn replay(&self) -> Result<String, String> {
        self.replay.clone()
    }

    fn kernel_version(&self) -> String {
        let libraries = self
            .libraries
            .as_ref()
            .map_or(String::new(), |l| format!("; {l}"));
        format!(
            "workshop-gpu {} on {} ({}){libraries}",
            env!("CARGO_PKG_VERSION"),
            self.device.describe(),
            self.program.precision
        )
    }
}

/// The memory-bandwidth probe on a [`Device`]: `n` f32 values per array, timed with marks.
pub fn stream<D: Device>(
    mut device: D,
    n: usize,
    iterations: usize,
) -> Result<super::StreamTimes, BackendError> {
    let n = n.min(i32::MAX as usize);
    let f = device
        .compile(Precision::Fp32, None, &["stream"])?
        .remove(0);
    let bytes = n as u64 * 4;
    let (a, b, c) = (
        device.alloc(bytes)?,
        device.alloc(bytes)?,
        device.alloc(bytes)?,
    );
    let fill = |v: f32| Precision::Fp32.storage_bytes(&vec![v; n]);
    device.upload(a, &fill(1.0))?;
    device.upload(c, &fill(3.0))?;
    // Four values a thread (the kernel's 16-byte loads).
    let grid = program::grid_1d(n.div_ceil(4))?;
    let time = |device: &mut D, triad: bool| -> Result<Vec<f64>, BackendError> {
        let args = program::pack(
            &[
                program::Arg::Buf(0),
                program::Arg::Buf(1),
                program::Arg::Buf(2),
                program::Arg::I32(n as i32),
                program::Arg::I32(triad as i32),
            ],
            |i| [a, c, b][i],
        );
        device.marks(iterations + 2)?;
        device.launch(&f, grid, program::BLOCK, &args)?;
        for i in 0..=iterations {
            device.mark(i)?;
            device.launch(&f, grid, program::BLOCK, &args)?;
        }
        device.mark(iterations + 1)?;
        device.sync()?;
        let t = device.mark_times(iterations + 2)?;
        Ok(t.windows(2)
            .skip(1)
            .map(|w| (w[1] - w[0]) as f64 * 1e-9)
            .collect())
    };
    let copy_s = time(&mut device, false)?;
    let triad_s = time(&mut device, true)?;
    let mut out = vec![0u8; n * 4];
    device.download(b, &mut out)?;
    if out
        .chunks_exact(4)
        .any(|v| f32::from_ne_bytes([v[0], v[1], v[2], v[3]]) != 2.5)
    {
        return Err(BackendError::WrongResult(
            "the triad computed wrong values: the measurement is void".into(),
        ));
    }
    Ok(super::StreamTimes { n, copy_s, triad_s })
}

/// Refuse a program that needs more than `free` bytes, suggesting a batch that fits.
pub fn fits(p: &Program, batch: usize, free: u64) -> Result<(), BackendError> {
    let needed = p.weight_bytes() + p.activation_bytes();
    if needed <= free {
        return Ok(());
    }
    let per_image = p.activation_bytes() / batch.max(1) as u64;
    let room = free.saturating_sub(p.weight_bytes());
    let suggestion = (per_image > 0)
        .then(|| (room / per_image) as usize)
        .filter(|&b| b >= 1 && b < batch);
    Err(BackendError::OutOfMemory {
        needed,
        available: free,
        suggestion,
    })
}

//! The HIP backend (opt-in: `--features hip`, which links libamdhip64 through hip-sys). Kernels
//! are kernels/hip/ops.hip, compiled by hiprtc at run time for the device's gfx target — only
//! for targets this ROCm's hiprtc knows, since it aborts the process on others — and cached per
//! device for the life of the process. hiprtc's functions are exported by libamdhip64 itself;
//! the few we need are declared here. The vendor family (`--kernels vendor`) is MIOpen for
//! convolutions and rocBLAS for GEMMs, loaded at run time (`gpu::miopen`, `gpu::rocblas`);
//! without them the flag says what to install.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::Path;

use hip_sys::hiprt as h;

use super::check::{self, KernelCheck};
use super::gpu::program::{BufId, ColumnMajor, LibConv};
use super::gpu::{self, Device, GpuSession};
use super::{Backend, BackendError, BackendKind, DeviceInfo, ExecOptions, Session, StreamTimes};
use crate::model::{Plan, Precision, Weights};

#[link(name = "amdhip64")]
unsafe extern "C" {
    fn hiprtcCreateProgram(
        prog: *mut *mut c_void,
        src: *const c_char,
        name: *const c_char,
        num_headers: c_int,
        headers: *const *const c_char,
        include_names: *const *const c_char,
    ) -> c_int;
    fn hiprtcCompileProgram(prog: *mut c_void, n: c_int, options: *const *const c_char) -> c_int;
    fn hiprtcGetProgramLogSize(prog: *mut c_void, size: *mut usize) -> c_int;
    fn hiprtcGetProgramLog(prog: *mut c_void, log: *mut c_char) -> c_int;
    fn hiprtcGetCodeSize(prog: *mut c_void, size: *mut usize) -> c_int;
    fn hiprtcGetCode(prog: *mut c_void, code: *mut c_char) -> c_int;
    fn hiprtcDestroyProgram(prog: *mut *mut c_void) -> c_int;
    fn hiprtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int;
}

/// The targets `workshop dev kernels-check` compiles for without a GPU.
pub const CHECK_TARGETS: [&str; 3] = ["gfx90a", "gfx908", "gfx1030"];

/// hiprtc's version, as (major, minor).
pub fn hiprtc_version() -> Option<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers.
    let r = unsafe { hiprtcVersion(&mut major, &mut minor) };
    (r == 0).then_some((major, minor))
}

/// Compile kernels/hip/ops.hip for `arch` with hiprtc: a code object, or the full log.
pub fn compile(
    arch: &str,
    precision: Precision,
    kernels_dir: Option<&Path>,
) -> Result<Vec<u8>, BackendError> {
    let path = kernels_dir.map_or("kernels/hip/ops.hip (embedded)".into(), |d| {
        d.join("hip/ops.hip").display().to_string()
    });
    let fail = |log: String| BackendError::Compile {
        path: path.clone(),
        log,
    };
    let arch = gpu::arch::hip_target(arch, hiprtc_version().unwrap_or((0, 0)))
        .map_err(BackendError::Unsupported)?;
    let src = CString::new(gpu::source("hip/ops.hip", kernels_dir)?)
        .map_err(|_| fail("the source contains a NUL byte".into()))?;
    let name = CString::new("ops.hip").expect("no NUL");
    let options: Vec<CString> = [
        format!("--offload-arch={arch}"),
        format!("-D{}", gpu::precision_define(precision)),
        "-O3".into(),
    ]
    .into_iter()
    .map(|o| CString::new(o).expect("no NUL"))
    .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut prog: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the program; the program is destroyed below.
    unsafe {
        let r = hiprtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if r != 0 {
            return Err(fail(format!("hiprtcCreateProgram failed ({r})")));
        }
        let r = hiprtcCompileProgram(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr());
        let mut log_size = 0usize;
        hiprtcGetProgramLogSize(prog, &mut log_size);
        let mut log = vec![0u8; log_size.max(1)];
        hiprtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .to_string();
        let code = if r == 0 {
            let mut size = 0usize;
            hiprtcGetCodeSize(prog, &mut size);
            let mut code = vec![0u8; size];
            hiprtcGetCode(prog, code.as_mut_ptr() as *mut c_char);
            Ok(code)
        } else {
            Err(fail(format!("{log}\n(hiprtc options: {})", {
                let o: Vec<String> = options
                    .iter()
                    .map(|o| o.to_string_lossy().into_owned())
                    .collect();
                o.join(" ")
            })))
        };
        hiprtcDestroyProgram(&mut prog);
        code
    }
}

fn check(what: &str, e: h::hipError_t) -> Result<(), BackendError> {
    if e == h::hipError_t::hipSuccess {
        return Ok(());
    }
    // SAFETY: returns a static string for any code.
    let s = unsafe { CStr::from_ptr(h::hipGetErrorString(e)) };
    Err(BackendError::Driver(format!(
        "HIP: {what} failed: {}",
        s.to_string_lossy()
    )))
}

fn no_device(reason: impl Into<String>) -> BackendError {
    BackendError::NoDevice {
        kind: BackendKind::Hip,
        reason: reason.into(),
    }
}

pub struct HipBackend {
    count: usize,
}

impl HipBackend {
    pub fn new() -> Result<Self, BackendError> {
        let mut count: c_int = 0;
        // SAFETY: an out-pointer. Without an AMD GPU this returns an error code (no crash).
        let e = unsafe { h::hipGetDeviceCount(&mut count) };
        if e != h::hipError_t::hipSuccess || count <= 0 {
            // SAFETY: a static string.
            let why = unsafe { CStr::from_ptr(h::hipGetErrorString(e)) };
            return Err(no_device(format!(
                "the HIP runtime found no AMD GPU ({})",
                why.to_string_lossy()
            )));
        }
        Ok(HipBackend {
            count: count as usize,
        })
    }

    fn select(&self, dev: usize) -> Result<(), BackendError> {
        if dev >= self.count {
            return Err(no_device(format!(
                "there is no HIP device {dev}: this machine has {} (0..{})",
                self.count,
                self.count - 1
            )));
        }
        // SAFETY: a valid ordinal.
        check("selecting the device", unsafe {
            h::hipSetDevice(dev as c_int)
        })
    }
}

/// A C string field of the device properties, read within its bounds.
fn field(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Name, gfx target, memory and compute units of device `dev`. The properties struct changes
/// between ROCm versions, so it is read into a larger zeroed buffer and the target is trusted
/// only when it looks like one.
fn properties(dev: usize) -> Result<(String, Option<String>, u64, usize), BackendError> {
    #[repr(C, align(8))]
    struct Room([u8; 8192]);
    let mut room = Box::new(Room([0; 8192]));
    const _: () = assert!(std::mem::size_of::<h::hipDeviceProp_t>() <= 8192);
    // SAFETY: the buffer is larger than any version's struct and suitably aligned.
    check("reading device properties", unsafe {
        h::hipGetDeviceProperties(
            room.as_mut() as *mut Room as *mut h::hipDeviceProp_t,
            dev as c_int,
        )
    })?;
    // SAFETY: the buffer holds at least a hipDeviceProp_t of these bindings.
    let p = unsafe { &*(room.as_ref() as *const Room as *const h::hipDeviceProp_t) };
    let arch = field(&p.gcnArchName);
    let arch = arch.starts_with("gfx").then_some(arch);
    Ok((
        field(&p.name),
        arch,
        p.totalGlobalMem as u64,
        p.multiProcessorCount.max(0) as usize,
    ))
}

/// The highest clock of device `dev`'s compute units, MHz (the attribute's number is the same
/// in every ROCm since 5.0; a value outside any GPU's range is not trusted).
fn clock_mhz(dev: usize) -> Option<u32> {
    let mut khz: c_int = 0;
    let attr = h::hipDeviceAttribute_t::hipDeviceAttributeClockRate;
    // SAFETY: an out-pointer and a device index the caller checked.
    let e = unsafe { h::hipDeviceGetAttribute(&mut khz, attr, dev as c_int) };
    let mhz = (khz / 1000) as u32;
    (e == h::hipError_t::hipSuccess && (100..=10_000).contains(&mhz)).then_some(mhz)
}

fn versions() -> String {
    let (mut d, mut r) = (0, 0);
    // SAFETY: out-pointers.
    unsafe {
        h::hipDriverGetVersion(&mut d);
        h::hipRuntimeGetVersion(&mut r);
    }
    format!(
        "HIP driver {d}, runtime {r}, hiprtc {}",
        hiprtc_version().map_or("?".into(), |(a, b)| format!("{a}.{b}"))
    )
}

fn free_memory() -> Option<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: out-pointers.
    let e = unsafe { h::hipMemGetInfo(&mut free, &mut total) };
    (e == h::hipError_t::hipSuccess).then_some(free as u64)
}

impl Backend for HipBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Hip
    }

    fn vendor_libraries(&self) -> Option<String> {
        Some(match (gpu::miopen::present(), gpu::rocblas::present()) {
            (Ok(dnn), Ok(())) => format!("{dnn} convolutions, rocBLAS GEMMs"),
            (Err(why), Ok(())) => format!("rocBLAS GEMMs, convolutions as im2col + GEMM ({why})"),
            (_, Err(e)) => e.to_string(),
        })
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        (0..self.count)
            .filter_map(|d| Some((d, properties(d).ok()?)))
            .map(|(d, (name, arch, mem, cus))| DeviceInfo {
                name,
                memory_bytes: Some(mem),
                driver: Some(versions()),
                compute_units: Some(cus),
                // The target, and "mfma" where our matrix kernels use its matrix cores.
                features: (arch.iter().cloned())
                    .chain(
                        arch.iter()
                            .filter(|a| gpu::arch::has_mfma(a))
                            .map(|_| "mfma".into()),
                    )
                    .collect(),
                clock_mhz: clock_mhz(d),
            })
            .collect()
    }

    fn ceiling(
        &self,
        device: &DeviceInfo,
        _workers: Option<usize>,
        precision: Precision,
    ) -> Option<super::Theoretical> {
        gpu::ceiling::amd(
            &device.features,
            device.compute_units?,
            device.clock_mhz?,
            precision,
        )
    }

    fn memory_budget(&self, dev: usize) -> Option<u64> {
        self.select(dev).ok()?;
        free_memory()
    }

    fn stream(
        &self,
        dev: usize,
        n: usize,
        iterations: usize,
        _threads: Option<usize>,
    ) -> Result<StreamTimes, BackendError> {
        gpu::stream(HipDevice::new(dev)?, n, iterations)
    }

    fn prepare(
        &self,
        dev: usize,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        self.select(dev)?;
        let device = HipDevice::new(dev)?;
        Ok(Box::new(GpuSession::new(
            device,
            plan,
            weights,
            opt,
            free_memory(),
        )?))
    }

    fn prepare_decoder(
        &self,
        dev: usize,
        weights: &crate::model::llm::DecoderWeights,
        opt: &crate::backend::DecoderOptions,
    ) -> Result<Box<dyn crate::backend::DecoderSession>, BackendError> {
        self.select(dev)?;
        let device = HipDevice::new(dev)?;
        Ok(Box::new(gpu::decoder::GpuDecoder::new(
            device,
            weights,
            opt,
            free_memory(),
        )?))
    }
}

/// Loaded code objects (module handles as integers, which are Send).
static MODULES: gpu::ModuleCache<usize> = gpu::ModuleCache::new();

pub struct HipDevice {
    ordinal: usize,
    arch: String,
    name: String,
    /// The session's stream (capturable, unlike the null stream).
    stream: h::hipStream_t,
    allocations: Vec<*mut c_void>,
    events: Vec<h::hipEvent_t>,
    graph: Option<(h::hipGraph_t, h::hipGraphExec_t)>,
    /// rocBLAS on the session's stream, made on the first vendor GEMM.
    blas: Option<gpu::rocblas::RocBlas>,
    /// MIOpen on the session's stream, made on the first vendor convolution.
    dnn: Option<gpu::miopen::MiOpen>,
    /// The workspace the planned MIOpen convolutions share: address and bytes.
    workspace: (u64, u64),
}

impl HipDevice {
    fn new(ordinal: usize) -> Result<Self, BackendError> {
        let (name, arch, _, _) = properties(ordinal)?;
        let arch = arch.ok_or_else(|| {
            BackendError::Unsupported(format!(
                "cannot read device {ordinal}'s gfx target (this build's HIP headers may not \
                 match the installed ROCm)"
            ))
        })?;
        // SAFETY: a valid ordinal.
        check("selecting the device", unsafe {
            h::hipSetDevice(ordinal as c_int)
        })?;
        let mut stream: h::hipStream_t = std::ptr::null_mut();
        // SAFETY: an out-pointer; destroyed in Drop.
        check("creating a stream", unsafe {
            h::hipStreamCreate(&mut stream)
        })?;
        Ok(HipDevice {
            ordinal,
            arch,
            name,
            stream,
            allocations: Vec::new(),
            events: Vec::new(),
            graph: None,
            blas: None,
            dnn: None,
            workspace: (0, 0),
        })
    }

    fn select(&self) -> Result<(), BackendError> {
        // SAFETY: an ordinal that exists.
        check("selecting the device", unsafe {
            h::hipSetDevice(self.ordinal as c_int)
        })
    }
}

impl Drop for HipDevice {
    fn drop(&mut self) {
        if self.select().is_ok() {
            // SAFETY: our own allocations and events, no longer used once the device is idle.
            unsafe {
                h::hipStreamSynchronize(self.stream);
                self.blas = None;
                self.dnn = None;
                if let Some((g, exec)) = self.graph.take() {
                    h::hipGraphExecDestroy(exec);
                    h::hipGraphDestroy(g);
                }
                for p in self.allocations.drain(..) {
                    h::hipFree(p);
                }
                for e in self.events.drain(..) {
                    h::hipEventDestroy(e);
                }
                h::hipStreamDestroy(self.stream);
            }
        }
    }
}

impl Device for HipDevice {
    type Function = usize;
    type Conv = gpu::miopen::Conv;

    fn matrix_units(&self) -> bool {
        gpu::arch::has_mfma(&self.arch)
    }

    fn compile(
        &mut self,
        precision: Precision,
        kernels_dir: Option<&Path>,
        names: &[&'static str],
    ) -> Result<Vec<usize>, BackendError> {
        self.select()?;
        let src = gpu::source("hip/ops.hip", kernels_dir)?;
        let module = MODULES.get_or_load(self.ordinal, precision, &src, || {
            let code = compile(&self.arch, precision, kernels_dir)?;
            let mut m: h::hipModule_t = std::ptr::null_mut();
            // SAFETY: a code object hiprtc produced for this device's target.
            check("loading the compiled kernels", unsafe {
                h::hipModuleLoadData(&mut m, code.as_ptr() as *const c_void)
            })?;
            Ok(m as usize)
        })? as h::hipModule_t;
        names
            .iter()
            .map(|n| {
                let c = CString::new(*n).expect("no NUL");
                let mut f: h::hipFunction_t = std::ptr::null_mut();
                // SAFETY: a loaded module and a NUL-terminated name.
                check(&format!("finding kernel `{n}`"), unsafe {
                    h::hipModuleGetFunction(&mut f, module, c.as_ptr())
                })?;
                Ok(f as usize)
            })
            .collect()
    }

    fn alloc(&mut self, bytes: u64) -> Result<u64, BackendError> {
        self.select()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: an out-pointer; freed in Drop.
        let e = unsafe { h::hipMalloc(&mut p, bytes as usize) };
        if e == h::hipError_t::hipErrorOutOfMemory {
            return Err(BackendError::OutOfMemory {
                needed: bytes,
                available: free_memory().unwrap_or(0),
                suggestion: None,
            });
        }
        check("allocating device memory", e)?;
        self.allocations.push(p);
        // SAFETY: `p` has `bytes` bytes.
        check("clearing device memory", unsafe {
            h::hipMemsetAsync(p, 0, bytes as usize, self.stream)
        })?;
        Ok(p as u64)
    }

    fn upload(&mut self, ptr: u64, data: &[u8]) -> Result<(), BackendError> {
        self.select()?;
        // SAFETY: one of our allocations, at least `data.len()` long. The copy is waited for,
        // so `data` may be dropped after.
        check("copying to the device", unsafe {
            h::hipMemcpyAsync(
                ptr as *mut c_void,
                data.as_ptr() as *const c_void,
                data.len(),
                h::hipMemcpyKind::hipMemcpyHostToDevice,
                self.stream,
            )
        })?;
        self.sync()
    }

    fn download(&mut self, ptr: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.select()?;
        // SAFETY: as in `upload`; ordered after the pass on the stream, then waited for.
        check("copying from the device", unsafe {
            h::hipMemcpyAsync(
                out.as_mut_ptr() as *mut c_void,
                ptr as *const c_void,
                out.len(),
                h::hipMemcpyKind::hipMemcpyDeviceToHost,
                self.stream,
            )
        })?;
        self.sync()
    }

    fn launch(
        &mut self,
        f: &usize,
        grid: [u32; 3],
        block: u32,
        args: &[u8],
    ) -> Result<(), BackendError> {
        // The argument struct is the whole kernarg buffer: HIP's `extra` launch form takes it
        // as it is (HIP_LAUNCH_PARAM_BUFFER_POINTER, _SIZE, _END).
        let mut size = args.len();
        let mut extra: [*mut c_void; 5] = [
            std::ptr::without_provenance_mut(1),
            args.as_ptr() as *mut c_void,
            std::ptr::without_provenance_mut(2),
            &mut size as *mut usize as *mut c_void,
            std::ptr::without_provenance_mut(3),
        ];
        // SAFETY: a function of our module; the kernarg buffer matches its one struct argument.
        check("launching a kernel", unsafe {
            h::hipModuleLaunchKernel(
                *f as h::hipFunction_t,
                grid[0],
                grid[1],
                grid[2],
                block,
                1,
                1,
                0,
                self.stream,
                std::ptr::null_mut(),
                extra.as_mut_ptr(),
            )
        })
    }

    fn vendor_gemm(&mut self) -> Result<(), BackendError> {
        // Made once (at prepare time): the library's presence is then known, and a GEMM's
        // call to this costs one test.
        if self.blas.is_some() {
            return Ok(());
        }
        gpu::rocblas::present()?;
        self.select()?;
        // SAFETY: the session's stream, destroyed after the handle (Drop).
        self.blas = Some(unsafe { gpu::rocblas::RocBlas::new(self.stream as *mut c_void)? });
        Ok(())
    }

    fn gemm(
        &mut self,
        g: &ColumnMajor,
        ptr: &dyn Fn(BufId) -> u64,
        precision: Precision,
    ) -> Result<(), BackendError> {
        self.vendor_gemm()?;
        let blas = self.blas.as_ref().expect("made by vendor_gemm");
        // SAFETY: the pointers are our allocations, sized by the program for this GEMM.
        unsafe { blas.gemm(g, ptr, precision) }
    }

    fn library_conv(&self) -> Result<String, String> {
        gpu::miopen::present()
    }

    fn plan_conv(
        &mut self,
        c: &LibConv,
        ptrs: [u64; 3],
        precision: Precision,
    ) -> Result<gpu::miopen::Conv, BackendError> {
        self.select()?;
        if self.dnn.is_none() {
            // SAFETY: the session's stream, destroyed after the handle (Drop).
            self.dnn = Some(unsafe { gpu::miopen::MiOpen::new(self.stream as *mut c_void)? });
        }
        let dnn = self.dnn.as_ref().expect("made above");
        let mut conv = dnn.describe(c, precision)?;
        let bytes = dnn.workspace(&conv)?;
        if bytes > self.workspace.1 {
            self.workspace = (self.alloc(bytes)?, bytes);
        }
        let dnn = self.dnn.as_ref().expect("made above");
        // SAFETY: the buffers are this session's allocations, sized for `c`; the workspace
        // holds what MIOpen asked for.
        unsafe { dnn.plan(&mut conv, ptrs, self.workspace)? };
        Ok(conv)
    }

    fn conv(&mut self, c: &gpu::miopen::Conv) -> Result<(), BackendError> {
        let dnn = self.dnn.as_ref().expect("planned before");
        // SAFETY: as in `plan_conv`; the workspace only grew since.
        unsafe { dnn.forward(c, self.workspace) }
    }

    fn workspace_bytes(&self) -> u64 {
        self.workspace.1
    }

    fn marks(&mut self, count: usize) -> Result<(), BackendError> {
        self.select()?;
        while self.events.len() < count {
            let mut e: h::hipEvent_t = std::ptr::null_mut();
            // SAFETY: an out-pointer; destroyed in Drop.
            check("creating an event", unsafe { h::hipEventCreate(&mut e) })?;
            self.events.push(e);
        }
        Ok(())
    }

    fn mark(&mut self, i: usize) -> Result<(), BackendError> {
        // SAFETY: one of our events, on our stream.
        check("recording an event", unsafe {
            h::hipEventRecord(self.events[i], self.stream)
        })
    }

    fn mark_times(&mut self, count: usize) -> Result<Vec<u64>, BackendError> {
        (0..count)
            .map(|i| {
                let mut ms = 0f32;
                // SAFETY: recorded events of this device.
                check("reading an event", unsafe {
                    h::hipEventElapsedTime(&mut ms, self.events[0], self.events[i])
                })?;
                Ok((ms as f64 * 1e6) as u64)
            })
            .collect()
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        self.select()?;
        // SAFETY: our stream.
        check("waiting for the GPU", unsafe {
            h::hipStreamSynchronize(self.stream)
        })
    }

    fn begin_capture(&mut self) -> Result<bool, BackendError> {
        // SAFETY: our stream, idle between passes.
        check("starting a stream capture", unsafe {
            h::hipStreamBeginCapture(
                self.stream,
                h::hipStreamCaptureMode::hipStreamCaptureModeThreadLocal,
            )
        })?;
        Ok(true)
    }

    fn end_capture(&mut self) -> Result<(), BackendError> {
        let mut graph: h::hipGraph_t = std::ptr::null_mut();
        let mut exec: h::hipGraphExec_t = std::ptr::null_mut();
        // SAFETY: out-pointers; both are destroyed in Drop.
        unsafe {
            check(
                "ending the stream capture",
                h::hipStreamEndCapture(self.stream, &mut graph),
            )?;
            check(
                "instantiating the graph",
                h::hipGraphInstantiate(
                    &mut exec,
                    graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                ),
            )?;
        }
        self.graph = Some((graph, exec));
        Ok(())
    }

    fn replay(&mut self) -> Result<(), BackendError> {
        let Some((_, exec)) = self.graph else {
            return Err(BackendError::Driver(
                "the stream capture recorded no graph".into(),
            ));
        };
        // SAFETY: an instantiated graph of this device, on our stream.
        check("launching the graph", unsafe {
            h::hipGraphLaunch(exec, self.stream)
        })
    }

    fn graph_name(&self) -> &'static str {
        "HIP graph"
    }

    fn describe(&self) -> String {
        format!("{} ({}, {})", self.name, self.arch, versions())
    }
}

/// `workshop dev kernels-check` for HIP: the kernels compiled with hiprtc for the usual
/// targets, in every precision.
pub fn kernel_checks(dir: Option<&Path>) -> Vec<KernelCheck> {
    check::each("hip/ops.hip", "hiprtc", &CHECK_TARGETS, |target, p| {
        compile(target, p, dir)
    })
}

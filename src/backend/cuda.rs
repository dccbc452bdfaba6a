//! The CUDA backend: cudarc with dynamic loading, so this build runs on machines without the
//! NVIDIA driver (and says so). Kernels are kernels/cuda/ops.cu, compiled by NVRTC at run time
//! for the device's compute capability and cached per device for the life of the process; the
//! vendor family hands convolutions to cuDNN (where installed) and GEMMs to cuBLAS. Everything
//! runs in order on one stream of the session, timed with CUDA events; `--compile
//! reduce-overhead` captures the pass into a CUDA graph.

use std::ffi::c_void;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaStream, result, sys,
};

use super::check::{self, KernelCheck};
use super::gpu::program::{BufId, ColumnMajor, LibConv};
use super::gpu::{self, Device, GpuSession};
use super::{
    Backend, BackendError, BackendKind, DeviceInfo, ExecOptions, Session, StreamTimes, Theoretical,
};
use crate::model::{Plan, Precision, Weights};

fn no_device(reason: impl Into<String>) -> BackendError {
    BackendError::NoDevice {
        kind: BackendKind::Cuda,
        reason: reason.into(),
    }
}

fn driver_error(what: &str, e: result::DriverError) -> BackendError {
    BackendError::Driver(format!("CUDA: {what} failed: {e:?}"))
}

/// Whether libcuda (the NVIDIA driver) can be loaded: cudarc panics on first use otherwise.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { sys::is_culib_present() }
}

/// Whether NVRTC can be loaded (`workshop dev kernels-check` needs only this, no GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The NVRTC version, as `12.8`.
pub fn nvrtc_version() -> Option<String> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is present; two out-pointers.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
}

/// The virtual architectures this NVRTC builds for (75, 80, 90, ...); empty when it cannot say.
pub fn nvrtc_archs() -> Vec<i32> {
    use cudarc::nvrtc::sys::{self as nvrtc, nvrtcResult::NVRTC_SUCCESS};
    if !nvrtc_present() {
        return Vec::new();
    }
    let mut n = 0;
    // SAFETY: NVRTC is present; one out-pointer.
    if unsafe { nvrtc::nvrtcGetNumSupportedArchs(&mut n) } != NVRTC_SUCCESS || n <= 0 {
        return Vec::new();
    }
    let mut archs = vec![0; n as usize];
    // SAFETY: `archs` holds the `n` entries NVRTC writes.
    if unsafe { nvrtc::nvrtcGetSupportedArchs(archs.as_mut_ptr()) } != NVRTC_SUCCESS {
        return Vec::new();
    }
    archs
}

fn driver_version() -> Option<String> {
    let mut v = 0;
    // SAFETY: the driver is loaded (callers check); one out-pointer.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    (r == sys::CUresult::CUDA_SUCCESS).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// Compile kernels/cuda/ops.cu for `arch` (`compute_90`), returning PTX or NVRTC's full log.
pub fn compile(
    arch: &str,
    precision: Precision,
    kernels_dir: Option<&Path>,
) -> Result<cudarc::nvrtc::Ptx, BackendError> {
    let src = gpu::source("cuda/ops.cu", kernels_dir)?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![
            format!("--gpu-architecture={arch}"),
            format!("--define-macro={}", gpu::precision_define(precision)),
            "--std=c++14".into(),
        ],
        name: Some("ops.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| BackendError::Compile {
        path: kernels_dir.map_or("kernels/cuda/ops.cu (embedded)".into(), |d| {
            d.join("cuda/ops.cu").display().to_string()
        }),
        log: match e {
            cudarc::nvrtc::CompileError::CompileError { log, options, .. } => format!(
                "{}\n(NVRTC options: {})",
                log.to_string_lossy(),
                options.join(" ")
            ),
            other => format!("{other:?}"),
        },
    })
}

/// [`compile`], through a cache of PTX on disk (`ptx/` in the cache folder), keyed by the
/// expanded source, the target, the precision and the NVRTC version: NVRTC takes seconds for
/// the half-precision kernels, and every run of `workshop bench` would pay them again. A cache
/// that cannot be read or written only costs the compile.
fn compile_cached(
    arch: &str,
    precision: Precision,
    kernels_dir: Option<&Path>,
) -> Result<cudarc::nvrtc::Ptx, BackendError> {
    let src = gpu::source("cuda/ops.cu", kernels_dir)?;
    let key = format!(
        "{arch} {} NVRTC {}\n{src}",
        gpu::precision_define(precision),
        nvrtc_version().unwrap_or_default()
    );
    let path = crate::settings::cache_dir().map(|d| {
        d.join("ptx")
            .join(format!("{:016x}.ptx", gpu::source_hash(&key)))
    });
    if let Some(text) = path.as_ref().and_then(|p| crate::files::read_text(p).ok()) {
        return Ok(cudarc::nvrtc::Ptx::from_src(text));
    }
    let ptx = compile(arch, precision, kernels_dir)?;
    if let Some(p) = &path
        && p.parent()
            .is_some_and(|d| std::fs::create_dir_all(d).is_ok())
    {
        let _ = crate::files::write_atomic(p, ptx.to_src().as_bytes());
    }
    Ok(ptx)
}

pub struct CudaBackend {
    count: usize,
}

impl CudaBackend {
    /// Device `dev` for a session, and its free memory: NVRTC must be there to compile the
    /// kernels.
    fn open_device(&self, dev: usize) -> Result<(CudaDevice, Option<u64>), BackendError> {
        let ctx = self.context(dev)?;
        if !nvrtc_present() {
            return Err(nvrtc_missing());
        }
        let free = ctx.mem_get_info().ok().map(|(f, _)| f as u64);
        Ok((CudaDevice::new(ctx, dev)?, free))
    }

    pub fn new() -> Result<Self, BackendError> {
        if !driver_present() {
            return Err(no_device(
                "the NVIDIA driver library (libcuda.so) was not found: install the NVIDIA \
                 driver, or run on --backend cpu or wgpu",
            ));
        }
        result::init().map_err(|e| no_device(format!("cuInit failed: {e:?}")))?;
        let count = CudaContext::device_count()
            .map_err(|e| no_device(format!("counting devices failed: {e:?}")))?
            as usize;
        if count == 0 {
            return Err(no_device("the NVIDIA driver found no GPU"));
        }
        Ok(CudaBackend { count })
    }

    fn context(&self, dev: usize) -> Result<Arc<CudaContext>, BackendError> {
        if dev >= self.count {
            return Err(no_device(format!(
                "there is no CUDA device {dev}: this machine has {} (0..{})",
                self.count,
                self.count - 1
            )));
        }
        let ctx =
            CudaContext::new(dev).map_err(|e| no_device(format!("opening device {dev}: {e:?}")))?;
        // SAFETY: we order our own work: one stream per session, synchronised explicitly.
        // cudarc's tracking would also synchronise the whole (shared, primary) context when a
        // session opens its stream, which breaks another session's graph capture in flight.
        unsafe { ctx.disable_event_tracking() };
        Ok(ctx)
    }
}

fn info(ctx: &Arc<CudaContext>) -> DeviceInfo {
    let (major, minor) = ctx.compute_capability().unwrap_or((0, 0));
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .ok();
    DeviceInfo {
        name: ctx.name().unwrap_or_else(|_| "CUDA device".into()),
        memory_bytes: ctx.total_mem().ok().map(|b| b as u64),
        driver: Some(format!(
            "CUDA driver {}, NVRTC {}",
            driver_version().unwrap_or_else(|| "?".into()),
            nvrtc_version().unwrap_or_else(|| "not found".into())
        )),
        compute_units: sms.map(|s| s as usize),
        features: vec![format!("sm_{major}{minor}")],
        clock_mhz: ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .ok()
            .filter(|&khz| khz > 0)
            .map(|khz| (khz / 1000) as u32),
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn ceiling(
        &self,
        device: &DeviceInfo,
        _workers: Option<usize>,
        precision: Precision,
    ) -> Option<Theoretical> {
        gpu::ceiling::nvidia(
            &device.features,
            device.compute_units?,
            device.clock_mhz?,
            precision,
        )
    }

    fn vendor_libraries(&self) -> Option<String> {
        // SAFETY: only tries to dlopen the library.
        let blas = if unsafe { cudarc::cublas::sys::is_culib_present() } {
            "cuBLAS".to_string()
        } else {
            "no cuBLAS (libcublas.so): `pip install nvidia-cublas-cu12`".to_string()
        };
        Some(match gpu::cudnn::present() {
            Ok(dnn) => format!("{dnn} convolutions, {blas} GEMMs"),
            Err(why) => format!("{blas} GEMMs, convolutions as im2col + GEMM ({why})"),
        })
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        (0..self.count)
            .filter_map(|d| self.context(d).ok())
            .map(|c| info(&c))
            .collect()
    }

    fn stream(
        &self,
        dev: usize,
        n: usize,
        iterations: usize,
        _threads: Option<usize>,
    ) -> Result<StreamTimes, BackendError> {
        gpu::stream(CudaDevice::new(self.context(dev)?, dev)?, n, iterations)
    }

    fn memory_budget(&self, dev: usize) -> Option<u64> {
        let ctx = self.context(dev).ok()?;
        ctx.mem_get_info().ok().map(|(free, _)| free as u64)
    }

    fn prepare(
        &self,
        dev: usize,
        plan: &Plan,
        weights: &Weights,
        opt: &ExecOptions,
    ) -> Result<Box<dyn Session>, BackendError> {
        let (device, free) = self.open_device(dev)?;
        Ok(Box::new(GpuSession::new(device, plan, weights, opt, free)?))
    }

    fn prepare_decoder(
        &self,
        dev: usize,
        weights: &crate::model::llm::DecoderWeights,
        opt: &crate::backend::DecoderOptions,
    ) -> Result<Box<dyn crate::backend::DecoderSession>, BackendError> {
        let (device, free) = self.open_device(dev)?;
        Ok(Box::new(gpu::decoder::GpuDecoder::new(
            device, weights, opt, free,
        )?))
    }
}

fn nvrtc_missing() -> BackendError {
    BackendError::MissingLibrary(
        "NVRTC (libnvrtc.so) was not found: install the CUDA toolkit's runtime compiler (e.g. \
         `pip install nvidia-cuda-nvrtc-cu12` and add its lib folder to LD_LIBRARY_PATH)"
            .into(),
    )
}

/// Modules compiled in this process, by (device, precision, source): a session after the first
/// pays nothing.
static MODULES: gpu::ModuleCache<Arc<CudaModule>> = gpu::ModuleCache::new();

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    allocations: Vec<sys::CUdeviceptr>,
    events: Vec<CudaEvent>,
    blas: Option<cudarc::cublas::CudaBlas>,
    /// cuDNN on the session's stream, made on the first vendor convolution.
    dnn: Option<gpu::cudnn::Cudnn>,
    /// The workspace the planned cuDNN convolutions share: address and bytes.
    workspace: (u64, u64),
    graph: Option<CudaGraph>,
    name: String,
}

impl CudaDevice {
    fn new(ctx: Arc<CudaContext>, ordinal: usize) -> Result<Self, BackendError> {
        // A stream of our own (not the legacy default stream, which cannot be captured).
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating a stream", e))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        Ok(CudaDevice {
            ctx,
            stream,
            ordinal,
            allocations: Vec::new(),
            events: Vec::new(),
            blas: None,
            dnn: None,
            workspace: (0, 0),
            graph: None,
            name,
        })
    }

    fn arch(&self) -> Result<String, BackendError> {
        let cc = self
            .ctx
            .compute_capability()
            .map_err(|e| driver_error("reading the compute capability", e))?;
        gpu::arch::cuda_target(cc, &nvrtc_archs()).map_err(BackendError::Unsupported)
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the context", e))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        self.graph = None;
        if self.bind().is_ok() {
            let _ = self.stream.synchronize();
            self.dnn = None;
            for p in self.allocations.drain(..) {
                // SAFETY: allocated by `alloc` in this context and no longer used.
                let _ = unsafe { result::free_sync(p) };
            }
        }
    }
}

impl Device for CudaDevice {
    type Function = CudaFunction;
    type Conv = gpu::cudnn::Conv;

    fn compile(
        &mut self,
        precision: Precision,
        kernels_dir: Option<&Path>,
        names: &[&'static str],
    ) -> Result<Vec<CudaFunction>, BackendError> {
        self.bind()?;
        let src = gpu::source("cuda/ops.cu", kernels_dir)?;
        let module = MODULES.get_or_load(self.ordinal, precision, &src, || {
            let ptx = compile_cached(&self.arch()?, precision, kernels_dir)?;
            self.ctx
                .load_module(ptx)
                .map_err(|e| driver_error("loading the compiled kernels", e))
        })?;
        names
            .iter()
            .map(|n| {
                module.load_function(n).map_err(|e| BackendError::Compile {
                    path: "kernels/cuda/ops.cu".into(),
                    log: format!("no kernel `{n}` in the compiled module: {e:?}"),
                })
            })
            .collect()
    }

    fn matrix_units(&self) -> bool {
        // mma.sync m16n8k16 in FP16 and BF16, and the kernels exist for compute_80 and later.
        self.ctx.compute_capability().is_ok_and(|cc| cc >= (8, 0))
            && self.arch().is_ok_and(|a| {
                a.trim_start_matches("compute_")
                    .parse::<u32>()
                    .is_ok_and(|n| n >= 80)
            })
    }

    fn alloc(&mut self, bytes: u64) -> Result<u64, BackendError> {
        self.bind()?;
        // SAFETY: a plain allocation, freed in Drop.
        let p = unsafe { result::malloc_sync(bytes as usize) }.map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                BackendError::OutOfMemory {
                    needed: bytes,
                    available: result::mem_get_info().map_or(0, |(f, _)| f as u64),
                    suggestion: None,
                }
            } else {
                driver_error("allocating device memory", e)
            }
        })?;
        self.allocations.push(p);
        // SAFETY: `p` has `bytes` bytes; ordered before everything later on the stream.
        unsafe { result::memset_d8_async(p, 0, bytes as usize, self.stream.cu_stream()) }
            .map_err(|e| driver_error("clearing device memory", e))?;
        Ok(p)
    }

    fn upload(&mut self, ptr: u64, data: &[u8]) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: `ptr` is one of our allocations, at least `data.len()` long. From pageable
        // memory the call returns once `data` has been staged, so it may be dropped after.
        unsafe { result::memcpy_htod_async(ptr, data, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying to the device", e))
    }

    fn download(&mut self, ptr: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: as in `upload`; the stream is synchronised before `out` is read.
        unsafe { result::memcpy_dtoh_async(out, ptr, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying from the device", e))?;
        self.sync()
    }

    fn launch(
        &mut self,
        f: &CudaFunction,
        grid: [u32; 3],
        block: u32,
        args: &[u8],
    ) -> Result<(), BackendError> {
        let mut params = [args.as_ptr() as *mut c_void];
        // SAFETY: the kernel takes one argument struct, of which `args` holds the bytes (the
        // driver copies them at launch); its pointers are our allocations.
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                (grid[0], grid[1], grid[2]),
                (block, 1, 1),
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| driver_error("launching a kernel", e))
    }

    fn vendor_gemm(&mut self) -> Result<(), BackendError> {
        // Made once (at prepare time): the library's presence is then known, and a GEMM's
        // call to this costs one test.
        if self.blas.is_some() {
            return Ok(());
        }
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(BackendError::MissingLibrary(
                "--kernels vendor needs cuBLAS (libcublas.so), which was not found: install \
                 the CUDA toolkit's libraries (e.g. `pip install nvidia-cublas-cu12`)"
                    .into(),
            ));
        }
        self.bind()?;
        self.blas = Some(
            cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(|e| {
                BackendError::Driver(format!("creating the cuBLAS handle failed: {e:?}"))
            })?,
        );
        Ok(())
    }

    fn gemm(
        &mut self,
        g: &ColumnMajor,
        ptr: &dyn Fn(BufId) -> u64,
        precision: Precision,
    ) -> Result<(), BackendError> {
        use cudarc::cublas::sys as cb;
        self.vendor_gemm()?;
        let blas = self.blas.as_ref().expect("made by vendor_gemm");
        let ty = match precision {
            Precision::Fp32 => cb::cudaDataType::CUDA_R_32F,
            Precision::Fp16 => cb::cudaDataType::CUDA_R_16F,
            Precision::Bf16 => cb::cudaDataType::CUDA_R_16BF,
        };
        let op = |t: bool| {
            if t {
                cb::cublasOperation_t::CUBLAS_OP_T
            } else {
                cb::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1f32, 0f32);
        let i = |v: usize| v as i32;
        // SAFETY: the pointers are our allocations, sized by the program for this GEMM.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *blas.handle(),
                op(g.trans_first),
                cb::cublasOperation_t::CUBLAS_OP_N,
                i(g.m),
                i(g.n),
                i(g.k),
                &alpha as *const f32 as *const c_void,
                ptr(g.first) as *const c_void,
                ty,
                i(g.ld_first),
                g.stride_first as i64,
                ptr(g.second) as *const c_void,
                ty,
                i(g.ld_second),
                g.stride_second as i64,
                &beta as *const f32 as *const c_void,
                ptr(g.c) as *mut c_void,
                ty,
                i(g.ldc),
                g.stride_c as i64,
                i(g.batch),
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| BackendError::Driver(format!("cuBLAS GEMM failed: {e:?}")))
    }

    fn library_conv(&self) -> Result<String, String> {
        gpu::cudnn::present()
    }

    fn plan_conv(
        &mut self,
        c: &LibConv,
        ptrs: [u64; 3],
        precision: Precision,
    ) -> Result<gpu::cudnn::Conv, BackendError> {
        self.bind()?;
        if self.dnn.is_none() {
            // SAFETY: the session's stream, which outlives the handle (Drop).
            self.dnn =
                Some(unsafe { gpu::cudnn::Cudnn::new(self.stream.cu_stream() as *mut c_void)? });
        }
        let (conv, bytes) = self
            .dnn
            .as_ref()
            .expect("made above")
            .plan(c, ptrs, precision)?;
        if bytes > self.workspace.1 {
            self.workspace = (self.alloc(bytes)?, bytes);
        }
        Ok(conv)
    }

    fn conv(&mut self, c: &gpu::cudnn::Conv) -> Result<(), BackendError> {
        let dnn = self.dnn.as_ref().expect("planned before");
        // SAFETY: the plan's buffers are this session's allocations; the workspace is at least
        // as large as every plan asked.
        unsafe { dnn.forward(c, self.workspace) }
    }

    fn workspace_bytes(&self) -> u64 {
        self.workspace.1
    }

    fn marks(&mut self, count: usize) -> Result<(), BackendError> {
        self.events = (0..count)
            .map(|_| {
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| driver_error("creating an event", e))
            })
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    fn mark(&mut self, i: usize) -> Result<(), BackendError> {
        self.events[i]
            .record(&self.stream)
            .map_err(|e| driver_error("recording an event", e))
    }

    fn mark_times(&mut self, count: usize) -> Result<Vec<u64>, BackendError> {
        (0..count)
            .map(|i| {
                self.events[0]
                    .elapsed_ms(&self.events[i])
                    .map(|ms| (ms as f64 * 1e6) as u64)
                    .map_err(|e| driver_error("reading an event", e))
            })
            .collect()
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("waiting for the GPU", e))
    }

    fn begin_capture(&mut self) -> Result<bool, BackendError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver_error("starting a stream capture", e))?;
        Ok(true)
    }

    fn end_capture(&mut self) -> Result<(), BackendError> {
        self.graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| driver_error("ending the stream capture", e))?;
        if let Some(g) = &self.graph {
            g.upload()
                .map_err(|e| driver_error("uploading the graph", e))?;
        }
        Ok(())
    }

    fn replay(&mut self) -> Result<(), BackendError> {
        match &self.graph {
            Some(g) => g
                .launch()
                .map_err(|e| driver_error("launching the graph", e)),
            None => Err(BackendError::Driver(
                "the stream capture recorded no graph".into(),
            )),
        }
    }

    fn graph_name(&self) -> &'static str {
        "CUDA graph"
    }

    fn describe(&self) -> String {
        format!(
            "{} ({}, NVRTC {})",
            self.name,
            self.arch().unwrap_or_default(),
            nvrtc_version().unwrap_or_default()
        )
    }
}

/// `workshop dev kernels-check` for CUDA: the kernels compiled with NVRTC for every target
/// this NVRTC builds, in every precision.
pub fn kernel_checks(dir: Option<&Path>) -> Vec<KernelCheck> {
    if !nvrtc_present() {
        return check::skipped(
            "cuda/ops.cu",
            "nvrtc",
            "NVRTC (libnvrtc.so) not found: `pip install nvidia-cuda-nvrtc-cu12` and add its \
             nvidia/cuda_nvrtc/lib folder to LD_LIBRARY_PATH",
        );
    }
    let archs = nvrtc_archs();
    let (known, unknown): (Vec<&str>, Vec<&str>) = check::CUDA_TARGETS.iter().partition(|t| {
        let n = t.trim_start_matches("compute_").parse().unwrap_or(0);
        archs.is_empty() || archs.contains(&n)
    });
    let version = nvrtc_version().unwrap_or_default();
    let why = |t: &str| {
        let list: Vec<String> = archs.iter().map(|a| format!("compute_{a}")).collect();
        format!(
            "NVRTC {version} does not build for {t} (it builds for {})",
            list.join(", ")
        )
    };
    let mut out: Vec<KernelCheck> = unknown
        .into_iter()
        .flat_map(|t| {
            check::PRECISIONS.map(|precision| KernelCheck {
                file: "cuda/ops.cu",
                compiler: "nvrtc",
                target: t.to_string(),
                precision,
                outcome: check::CompileOutcome::NotSupported(why(t)),
                seconds: 0.0,
            })
        })
        .collect();
    out.extend(check::each("cuda/ops.cu", "nvrtc", &known, |target, p| {
        compile(target, p, dir)
    }));
    out
}

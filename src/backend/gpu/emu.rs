//! The GPU kernels run on the host CPU, for testing. The kernels of kernels/gpu/ops.cuh use no
//! shared memory and no barriers, so each thread can run on its own: a small C++ prelude turns
//! `KERNEL(...)` into a function that loops over a range of blocks and threads, the system C++
//! compiler builds it into a shared library, and launches call it (blocks in parallel). Library
//! GEMMs (the vendor family) are computed here in column-major order, exactly as cuBLAS and
//! rocBLAS are called, so the argument mapping is tested too; library convolutions (cuDNN's
//! and MIOpen's) directly, from the same description the devices hand the libraries.
//!
//! It is a developer's tool, selected with `WORKSHOP_GPU_EMULATOR=1` for the cuda and hip
//! backends: every number it produces is labelled as emulated, and its timings say nothing
//! about any GPU.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use super::dl::Library;
use super::program::{BufId, ColumnMajor, LibConv};
use super::{Device, precision_define, source};
use crate::backend::{BackendError, BackendKind, DeviceInfo};
use crate::model::Precision;

/// The environment variable that makes the cuda and hip backends run on this emulator.
pub const ENV: &str = crate::settings::GPU_EMULATOR;

/// Whether the emulator was asked for.
pub fn requested() -> bool {
    crate::settings::get().is_ok_and(|s| s.gpu_emulator)
}

/// What `devices()` shows for an emulated backend.
pub fn device_info(kind: BackendKind) -> DeviceInfo {
    DeviceInfo {
        name: format!("{kind} kernels emulated on the host CPU ({ENV}; timings mean nothing)"),
        memory_bytes: None,
        driver: Some(compiler()),
        compute_units: None,
        features: vec!["emulated".into()],
        clock_mhz: None,
    }
}

/// The C++ compiler: `$CXX`, or `c++`.
pub(crate) fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// Turns the CUDA-style kernels into host functions over a range of blocks.
const PRELUDE: &str = r#"
#include <algorithm>
#include <cmath>
#include <cstring>
struct ws_dim3 { unsigned x, y, z; };
static thread_local ws_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __device__
#define __global__
using std::max;
using std::min;
static inline float f16_to_f32(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
static inline unsigned short f32_to_f16(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }
// A block whose threads meet at __syncthreads() runs its threads as fibers on this OS thread:
// each runs until the barrier (or its end), then the next; once all are there, all go on.
// __shared__ arrays are per OS thread, as one block at a time runs on it. Fibers start with
// makecontext and switch with _setjmp/_longjmp (no system call per switch).
#define WS_EMULATOR 1
#include <setjmp.h>
#include <ucontext.h>
#include <vector>
#define __shared__ static thread_local
struct ws_fiber { ucontext_t uc; jmp_buf jb; bool started = false, done = false; };
static thread_local jmp_buf ws_sched;
static thread_local ws_fiber* ws_cur;
static thread_local void (*ws_body)(const void*);
static thread_local const void* ws_args;
static inline void __syncthreads() { if (!_setjmp(ws_cur->jb)) _longjmp(ws_sched, 1); }
static void ws_fiber_main() { ws_body(ws_args); ws_cur->done = true; _longjmp(ws_sched, 1); }
static void ws_run_block(unsigned threads, void (*body)(const void*), const void* args) {
    const size_t stack = 64 * 1024;
    static thread_local std::vector<char> stacks;
    if (stacks.size() < threads * stack) stacks.resize(threads * stack);
    std::vector<ws_fiber> f(threads);
    ws_body = body;
    ws_args = args;
    for (unsigned left = threads; left > 0;) {
        for (unsigned t = 0; t < threads; ++t) {
            if (f[t].done) continue;
            ws_cur = &f[t];
            threadIdx = {t, 0, 0};
            if (!_setjmp(ws_sched)) {
                if (f[t].started) _longjmp(f[t].jb, 1);
                f[t].started = true;
                getcontext(&f[t].uc);
                f[t].uc.uc_stack.ss_sp = &stacks[t * stack];
                f[t].uc.uc_stack.ss_size = stack;
                f[t].uc.uc_link = nullptr;
                makecontext(&f[t].uc, ws_fiber_main, 0);
                setcontext(&f[t].uc);
            }
            if (f[t].done) --left;
        }
    }
}
// Every kernel's entry: unpack the arguments and run blocks first..last, one at a time.
template <class Args>
static void ws_blocks(const void* args, const unsigned* dims, unsigned long first,
                      unsigned long last, void (*block)(const Args&)) {
    Args a;
    std::memcpy(&a, args, sizeof(Args));
    gridDim = {dims[0], dims[1], dims[2]};
    blockDim = {dims[3], 1, 1};
    for (unsigned long b = first; b < last; ++b) {
        blockIdx = {(unsigned)(b % dims[0]), (unsigned)((b / dims[0]) % dims[1]),
                    (unsigned)(b / ((unsigned long)dims[0] * dims[1]))};
        block(a);
    }
}
#define WS_ENTRY(name, Args)                                                                     \
    extern "C" unsigned long emu_size_##name() { return sizeof(Args); }                          \
    extern "C" void emu_##name(const void* args, const unsigned* dims, unsigned long first,      \
                               unsigned long last) {                                             \
        ws_blocks<Args>(args, dims, first, last, name##_block);                                  \
    }
// Threads that never meet run one after another; threads that do, as fibers.
#define KERNEL(name, Args)                                                                       \
    static void name##_thread(const Args& a);                                                    \
    static void name##_block(const Args& a) {                                                    \
        for (unsigned t = 0; t < blockDim.x; ++t) {                                              \
            threadIdx = {t, 0, 0};                                                               \
            name##_thread(a);                                                                    \
        }                                                                                        \
    }                                                                                            \
    WS_ENTRY(name, Args)                                                                         \
    static void name##_thread(const Args& a)
#define BLOCK_KERNEL(name, Args)                                                                 \
    static void name##_thread(const Args& a);                                                    \
    static void name##_fiber(const void* p) { name##_thread(*(const Args*)p); }                  \
    static void name##_block(const Args& a) { ws_run_block(blockDim.x, name##_fiber, &a); }      \
    WS_ENTRY(name, Args)                                                                         \
    static void name##_thread(const Args& a)
"#;

type KernelFn = unsafe extern "C" fn(*const u8, *const u32, u64, u64);
type SizeFn = unsafe extern "C" fn() -> u64;

/// Compiled libraries: tests prepare many sessions from the same source.
static LIBRARIES: super::ModuleCache<Arc<Library>> = super::ModuleCache::new();

/// Compile `text` (the prelude and the kernels) with the host C++ compiler and open it.
fn build(text: &str, path_hint: &str) -> Result<Arc<Library>, BackendError> {
    let key = super::source_hash(text);
    let fail = |log: String| BackendError::Compile {
        path: format!("{path_hint} (for the CPU emulator)"),
        log,
    };
    let dir = std::env::temp_dir().join(format!("workshop-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("cannot create {dir:?}: {e}")))?;
    let src = dir.join(format!("{key:016x}.cpp"));
    let lib = dir.join(format!("{key:016x}.so"));
    std::fs::write(&src, text).map_err(|e| fail(format!("cannot write {src:?}: {e}")))?;
    let out = std::process::Command::new(compiler())
        // No fortified longjmp: the fibers jump between stacks on purpose.
        .args([
            "-std=c++17",
            "-O2",
            "-U_FORTIFY_SOURCE",
            "-fPIC",
            "-shared",
            "-w",
            "-o",
        ])
        .arg(&lib)
        .arg(&src)
        .output()
        .map_err(|e| {
            fail(format!(
                "cannot run the C++ compiler `{}` ({e}): install g++ or set CXX",
                compiler()
            ))
        })?;
    if !out.status.success() {
        return Err(fail(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    // RTLD_NOW resolves everything up front.
    let opened = Library::open(&[&lib.to_string_lossy()]);
    let _ = std::fs::remove_file(&src);
    let _ = std::fs::remove_file(&lib);
    let opened = opened.ok_or_else(|| fail("dlopen failed on the compiled kernels".into()))?;
    Ok(Arc::new(opened))
}

/// A kernel of the emulator: its entry point and the size of its argument struct.
#[derive(Clone)]
pub struct EmuFunction {
    name: &'static str,
    entry: KernelFn,
    args_size: usize,
    _lib: Arc<Library>,
}

/// A launch kept in a recorded graph, with everything resolved.
enum Recorded {
    Kernel {
        f: EmuFunction,
        grid: [u32; 3],
        block: u32,
        args: Vec<u8>,
    },
    Gemm {
        g: ColumnMajor,
        ptrs: [u64; 3],
        precision: Precision,
    },
    Conv(EmuConv),
}

/// A planned library convolution: the call and its device addresses `[x, w, y]`.
#[derive(Debug, Clone, Copy)]
pub struct EmuConv {
    c: LibConv,
    ptrs: [u64; 3],
    precision: Precision,
}

/// Host memory posing as device memory; launches run before `launch` returns, or are kept in a
/// graph while capturing (as CUDA and HIP graphs keep them) and run by `replay`.
pub struct EmuDevice {
    kind: BackendKind,
    /// Every allocation, kept alive (and in place) for the session's life.
    /// In 16-byte words: allocations start 16-byte aligned, as on a GPU (kernels load
    /// 16-byte vectors).
    memory: Vec<Box<[u128]>>,
    marks: Vec<Option<Instant>>,
    capturing: bool,
    graph: Vec<Recorded>,
    /// Whether the vendor family gets library convolutions (CUDA's, standing in for cuDNN).
    conv_library: bool,
    /// Whether `vendor_gemm` made the GEMM library ready, as a real device makes its handle.
    gemm_ready: bool,
}

impl EmuDevice {
    pub fn new(kind: BackendKind) -> Self {
        EmuDevice {
            kind,
            memory: Vec::new(),
            marks: Vec::new(),
            capturing: false,
            graph: Vec::new(),
            conv_library: kind == BackendKind::Cuda,
            gemm_ready: false,
        }
    }

    /// A device whose vendor family has no convolution library, as a CUDA machine without
    /// cuDNN: convolutions run as im2col and a library GEMM.
    pub fn without_conv_library(kind: BackendKind) -> Self {
        EmuDevice {
            conv_library: false,
            ..EmuDevice::new(kind)
        }
    }

    /// The dialect file whose kernels this emulates (their shared body is the same).
    fn dialect(&self) -> &'static str {
        match self.kind {
            BackendKind::Hip => "hip/ops.hip",
            _ => "cuda/ops.cu",
        }
    }
}

/// Compile the shared kernel body for the host, as [`Device::compile`] does for a GPU; also
/// used by `workshop dev kernels-check`.
pub fn compile_source(
    kind: BackendKind,
    precision: Precision,
    kernels_dir: Option<&Path>,
) -> Result<String, BackendError> {
    let body = source("gpu/ops.cuh", kernels_dir)?;
    // HIP's matrix kernels run as AMD's matrix cores do: a wavefront of 64 per 16×16×16 step.
    let wave64 = match kind {
        BackendKind::Hip => "#define WS_EMU_WAVE64\n",
        _ => "",
    };
    Ok(format!(
        "#define {}\n{wave64}{PRELUDE}\n{body}",
        precision_define(precision)
    ))
}

impl Device for EmuDevice {
    type Function = EmuFunction;
    type Conv = EmuConv;

    fn compile(
        &mut self,
        precision: Precision,
        kernels_dir: Option<&Path>,
        names: &[&'static str],
    ) -> Result<Vec<EmuFunction>, BackendError> {
        let text = compile_source(self.kind, precision, kernels_dir)?;
        let lib =
            LIBRARIES.get_or_load(0, precision, &text, || build(&text, "kernels/gpu/ops.cuh"))?;
        names
            .iter()
            .map(|&name| {
                let missing = || BackendError::Compile {
                    path: self.dialect().into(),
                    log: format!("no kernel named `{name}`"),
                };
                let entry = lib.symbol(&format!("emu_{name}")).ok_or_else(missing)?;
                let size = lib
                    .symbol(&format!("emu_size_{name}"))
                    .ok_or_else(missing)?;
                // SAFETY: both symbols come from the KERNEL macro of the prelude, with these types.
                let (entry, size) = unsafe {
                    (
                        std::mem::transmute::<*mut libc::c_void, KernelFn>(entry),
                        std::mem::transmute::<*mut libc::c_void, SizeFn>(size),
                    )
                };
                Ok(EmuFunction {
                    name,
                    entry,
                    // SAFETY: a plain function returning sizeof.
                    args_size: unsafe { size() } as usize,
                    _lib: lib.clone(),
                })
            })
            .collect()
    }

    fn alloc(&mut self, bytes: u64) -> Result<u64, BackendError> {
        let words = (bytes as usize).div_ceil(16).max(1);
        let b = vec![0u128; words].into_boxed_slice();
        let p = b.as_ptr() as u64;
        self.memory.push(b);
        Ok(p)
    }

    fn upload(&mut self, ptr: u64, data: &[u8]) -> Result<(), BackendError> {
        // SAFETY: `ptr` came from `alloc` with at least `data.len()` bytes (the program sizes
        // every buffer for what is written to it).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        Ok(())
    }

    fn download(&mut self, ptr: u64, out: &mut [u8]) -> Result<(), BackendError> {
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn launch(
        &mut self,
        f: &EmuFunction,
        grid: [u32; 3],
        block: u32,
        args: &[u8],
    ) -> Result<(), BackendError> {
        if args.len() != f.args_size {
            return Err(BackendError::Driver(format!(
                "kernel `{}` takes a {}-byte argument struct, the host packed {} bytes",
                f.name,
                f.args_size,
                args.len()
            )));
        }
        if self.capturing {
            self.graph.push(Recorded::Kernel {
                f: f.clone(),
                grid,
                block,
                args: args.to_vec(),
            });
            return Ok(());
        }
        let dims = [grid[0], grid[1], grid[2], block];
        let blocks = grid.iter().map(|&g| g as u64).product::<u64>();
        let chunk = blocks
            .div_ceil(rayon::current_num_threads() as u64 * 4)
            .max(1);
        let (args_ptr, dims_ptr) = (args.as_ptr() as usize, dims.as_ptr() as usize);
        (0..blocks.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let first = c * chunk;
            let last = (first + chunk).min(blocks);
            // SAFETY: the argument struct has the size the kernel expects (checked above), its
            // pointers are this device's allocations, and the kernels write disjoint outputs
            // per thread, so blocks may run concurrently.
            unsafe { (f.entry)(args_ptr as *const u8, dims_ptr as *const u32, first, last) };
        });
        Ok(())
    }

    /// The emulator runs the matrix kernels too (their fragments in shared memory): CUDA's
    /// mma.sync per warp of 32, HIP's MFMA per wavefront of 64, so both are tested without a
    /// GPU.
    fn matrix_units(&self) -> bool {
        true
    }

    fn vendor_gemm(&mut self) -> Result<(), BackendError> {
        if self.kind == BackendKind::Hip {
            // rocBLAS runs on an AMD GPU only: the emulator has no vendor library for HIP.
            return Err(BackendError::MissingLibrary(
                "--kernels vendor on hip needs rocBLAS on an AMD GPU, which the emulator cannot \
                 run"
                .into(),
            ));
        }
        if self.capturing && !self.gemm_ready {
            // As cuBLAS refuses to make its handle (an allocation) inside a stream capture.
            return Err(BackendError::Driver(
                "the GEMM library's handle was first made while recording a graph".into(),
            ));
        }
        self.gemm_ready = true;
        Ok(())
    }

    fn gemm(
        &mut self,
        g: &ColumnMajor,
        ptr: &dyn Fn(BufId) -> u64,
        precision: Precision,
    ) -> Result<(), BackendError> {
        self.vendor_gemm()?;
        let ptrs = [ptr(g.first), ptr(g.second), ptr(g.c)];
        if self.capturing {
            self.graph.push(Recorded::Gemm {
                g: *g,
                ptrs,
                precision,
            });
            return Ok(());
        }
        column_major_gemm(g, ptrs, precision);
        Ok(())
    }

    fn library_conv(&self) -> Result<String, String> {
        if self.conv_library {
            Ok("emulated library".into())
        } else if self.kind == BackendKind::Hip {
            Err("MIOpen runs on an AMD GPU only, which the emulator is not".into())
        } else {
            Err("this emulated device has no convolution library".into())
        }
    }

    fn plan_conv(
        &mut self,
        c: &LibConv,
        ptrs: [u64; 3],
        precision: Precision,
    ) -> Result<EmuConv, BackendError> {
        self.library_conv().map_err(BackendError::MissingLibrary)?;
        Ok(EmuConv {
            c: *c,
            ptrs,
            precision,
        })
    }

    fn conv(&mut self, c: &EmuConv) -> Result<(), BackendError> {
        if self.capturing {
            self.graph.push(Recorded::Conv(*c));
        } else {
            library_conv(&c.c, c.ptrs, c.precision);
        }
        Ok(())
    }

    fn begin_capture(&mut self) -> Result<bool, BackendError> {
        self.capturing = true;
        self.graph.clear();
        Ok(true)
    }

    fn end_capture(&mut self) -> Result<(), BackendError> {
        self.capturing = false;
        Ok(())
    }

    fn replay(&mut self) -> Result<(), BackendError> {
        let graph = std::mem::take(&mut self.graph);
        let result = graph.iter().try_for_each(|r| match r {
            Recorded::Kernel {
                f,
                grid,
                block,
                args,
            } => self.launch(f, *grid, *block, args),
            Recorded::Gemm { g, ptrs, precision } => {
                column_major_gemm(g, *ptrs, *precision);
                Ok(())
            }
            Recorded::Conv(c) => {
                library_conv(&c.c, c.ptrs, c.precision);
                Ok(())
            }
        });
        self.graph = graph;
        result
    }

    fn graph_name(&self) -> &'static str {
        "emulated graph"
    }

    fn marks(&mut self, count: usize) -> Result<(), BackendError> {
        self.marks = vec![None; count];
        Ok(())
    }

    fn mark(&mut self, i: usize) -> Result<(), BackendError> {
        self.marks[i] = Some(Instant::now());
        Ok(())
    }

    fn mark_times(&mut self, count: usize) -> Result<Vec<u64>, BackendError> {
        let t0 = self.marks.first().copied().flatten();
        (0..count)
            .map(|i| match (t0, self.marks.get(i).copied().flatten()) {
                (Some(a), Some(b)) => Ok(b.duration_since(a).as_nanos() as u64),
                _ => Err(BackendError::Driver(
                    "a timing mark was not recorded".into(),
                )),
            })
            .collect()
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn describe(&self) -> String {
        format!("{} kernels emulated on the host CPU", self.kind)
    }
}

/// C = op(first) · second in column-major order, as cuBLAS's strided batched GEMM computes it.
fn column_major_gemm(g: &ColumnMajor, [first, second, c]: [u64; 3], precision: Precision) {
    {
        for batch in 0..g.batch {
            let f0 = batch * g.stride_first;
            let s0 = batch * g.stride_second;
            let c0 = batch * g.stride_c;
            for j in 0..g.n {
                for i in 0..g.m {
                    let mut acc = 0f32;
                    for l in 0..g.k {
                        let a = if g.trans_first {
                            f0 + l + i * g.ld_first
                        } else {
                            f0 + i + l * g.ld_first
                        };
                        // SAFETY: indices within the buffers the program sized for this GEMM.
                        unsafe {
                            acc += load(first, a, precision)
                                * load(second, s0 + l + j * g.ld_second, precision);
                        }
                    }
                    // SAFETY: as above.
                    unsafe { store(c, c0 + i + j * g.ldc, acc, precision) };
                }
            }
        }
    }
}

/// A grouped, strided, padded, dilated cross-correlation over NCHW tensors, as cuDNN's and
/// MIOpen's forward convolutions compute it (f32 accumulation); output planes in parallel.
pub(crate) fn library_conv(c: &LibConv, ptrs: [u64; 3], p: Precision) {
    let [x, w, y] = ptrs;
    let ([ci, hi, wi], [co, ho, wo]) = (c.input, c.output);
    let (cig, cog) = (ci / c.groups, co / c.groups);
    let (kh, kw) = c.kernel;
    (0..c.batch * co).into_par_iter().for_each(|plane| {
        let (n, o) = (plane / co, plane % co);
        let first = o / cog * cig;
        for oy in 0..ho {
            for ox in 0..wo {
                let mut acc = 0f32;
                for i in 0..cig {
                    for ky in 0..kh {
                        let iy = (oy * c.stride.0 + ky * c.dilation.0).checked_sub(c.padding.0);
                        let Some(iy) = iy.filter(|&v| v < hi) else {
                            continue;
                        };
                        for kx in 0..kw {
                            let ix = (ox * c.stride.1 + kx * c.dilation.1).checked_sub(c.padding.1);
                            let Some(ix) = ix.filter(|&v| v < wi) else {
                                continue;
                            };
                            let xi = ((n * ci + first + i) * hi + iy) * wi + ix;
                            let wk = ((o * cig + i) * kh + ky) * kw + kx;
                            // SAFETY: indices within the tensors the program sized for this
                            // convolution.
                            unsafe { acc += load(x, xi, p) * load(w, wk, p) };
                        }
                    }
                }
                // SAFETY: as above; each plane is written by one task only.
                unsafe { store(y, ((n * co + o) * ho + oy) * wo + ox, acc, p) };
            }
        }
    });
}

/// Element `i` of an array in the storage type, as f32.
unsafe fn load(base: u64, i: usize, p: Precision) -> f32 {
    // SAFETY: the caller keeps `i` within the array.
    unsafe {
        match p {
            Precision::Fp32 => *(base as *const f32).add(i),
            Precision::Fp16 => half::f16::from_bits(*(base as *const u16).add(i)).to_f32(),
            Precision::Bf16 => half::bf16::from_bits(*(base as *const u16).add(i)).to_f32(),
        }
    }
}

unsafe fn store(base: u64, i: usize, v: f32, p: Precision) {
    // SAFETY: the caller keeps `i` within the array.
    unsafe {
        match p {
            Precision::Fp32 => *(base as *mut f32).add(i) = v,
            Precision::Fp16 => *(base as *mut u16).add(i) = half::f16::from_f32(v).to_bits(),
            Precision::Bf16 => *(base as *mut u16).add(i) = half::bf16::from_f32(v).to_bits(),
        }
    }
}

/// The cuda or hip backend with [`EmuDevice`] underneath (`WORKSHOP_GPU_EMULATOR=1`).
pub struct EmuBackend {
    kind: BackendKind,
}

impl EmuBackend {
    pub fn new(kind: BackendKind) -> Self {
        EmuBackend { kind }
    }

    /// The one emulated device, 0.
    fn device(&self, dev: usize) -> Result<EmuDevice, BackendError> {
        if dev != 0 {
            return Err(BackendError::NoDevice {
                kind: self.kind,
                reason: format!("the emulator has one device (0), not {dev}"),
            });
        }
        Ok(EmuDevice::new(self.kind))
    }
}

impl crate::backend::Backend for EmuBackend {
    fn kind(&self) -> BackendKind {
        self.kind
    }

    fn vendor_libraries(&self) -> Option<String> {
        let mut device = EmuDevice::new(self.kind);
        Some(match (device.library_conv(), device.vendor_gemm()) {
            (Ok(_), Ok(())) => "emulated library convolutions and GEMMs".into(),
            (_, Err(e)) => e.to_string(),
            (Err(why), Ok(())) => format!("emulated GEMMs ({why})"),
        })
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        vec![device_info(self.kind)]
    }

    fn stream(
        &self,
        _dev: usize,
        n: usize,
        iterations: usize,
        _threads: Option<usize>,
    ) -> Result<crate::backend::StreamTimes, BackendError> {
        super::stream(EmuDevice::new(self.kind), n, iterations)
    }

    fn prepare(
        &self,
        dev: usize,
        plan: &crate::model::Plan,
        weights: &crate::model::Weights,
        opt: &crate::backend::ExecOptions,
    ) -> Result<Box<dyn crate::backend::Session>, BackendError> {
        let device = self.device(dev)?;
        Ok(Box::new(super::GpuSession::new(
            device, plan, weights, opt, None,
        )?))
    }

    fn prepare_decoder(
        &self,
        dev: usize,
        weights: &crate::model::llm::DecoderWeights,
        opt: &crate::backend::DecoderOptions,
    ) -> Result<Box<dyn crate::backend::DecoderSession>, BackendError> {
        let device = self.device(dev)?;
        Ok(Box::new(super::decoder::GpuDecoder::new(
            device, weights, opt, None,
        )?))
    }
}

/// A convolution whose every size differs (grouped, strided, padded, dilated, a non-square
/// kernel), so a library binding that swaps two arguments fails: buffers `[x, w, y] = [0, 1, 2]`.
#[cfg(test)]
pub(crate) fn odd_conv() -> LibConv {
    let out =
        |i: usize, p: usize, d: usize, k: usize, s: usize| (i + 2 * p - d * (k - 1) - 1) / s + 1;
    LibConv {
        batch: 2,
        input: [4, 9, 11],
        output: [6, out(9, 1, 1, 3, 2), out(11, 2, 2, 2, 3)],
        kernel: (3, 2),
        stride: (2, 3),
        padding: (1, 2),
        dilation: (1, 2),
        groups: 2,
        x: 0,
        w: 1,
        y: 2,
    }
}

/// Run `call` on `c` in FP32 with random host buffers (`[x, w, y]`, y filled with NaN) and
/// check y against this emulator's convolution, which is checked against the reference.
#[cfg(test)]
pub(crate) fn check_library_conv(c: &LibConv, call: impl FnOnce([u64; 3])) {
    let mut rng = crate::model::Rng::new(3);
    let mut random = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
    let [ci, hi, wi] = c.input;
    let x = random(c.batch * ci * hi * wi);
    let w = random(c.output[0] * ci / c.groups * c.kernel.0 * c.kernel.1);
    let numel = c.batch * c.output.iter().product::<usize>();
    let (mut y, mut expected) = (vec![f32::NAN; numel], vec![0f32; numel]);
    let address = |y: &mut Vec<f32>| [x.as_ptr() as u64, w.as_ptr() as u64, y.as_mut_ptr() as u64];
    call(address(&mut y));
    library_conv(c, address(&mut expected), Precision::Fp32);
    let worst = (y.iter().zip(&expected)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-5, "the library's convolution is off by {worst}");
}

#[cfg(test)]
mod tests {
    use super::super::GpuSession;
    use super::super::program::Work;
    use super::*;
    use crate::backend::{ExecOptions, KernelFamily, Session};
    use crate::model::{Rng, Weights, passes, reference};

    /// The vendor family on a device with a convolution library (cuDNN's and MIOpen's calls,
    /// every convolution one call) and on one without (im2col and a GEMM for dense ones, our
    /// kernel for grouped ones) computes what the reference computes, enqueued or recorded
    /// and replayed; so do our kernels.
    #[test]
    fn library_convolutions_and_im2col_gemms_match_the_reference() {
        let graph = crate::model::graph::convolution_mix();
        let (graph, w, _) = passes::optimize(&graph, Weights::init(&graph, 3)).unwrap();
        let plan = graph.plan(2, 9, 7).unwrap();
        let input = Rng::new(5).normal_tensor(vec![2, 3, 9, 7]);
        let expected = reference::forward(&plan, &w, &input);
        let cases = [
            (
                EmuDevice::new(BackendKind::Cuda),
                KernelFamily::Native,
                0,
                false,
            ),
            (
                EmuDevice::new(BackendKind::Cuda),
                KernelFamily::Vendor,
                4,
                false,
            ),
            // Recorded once and replayed, as `--compile reduce-overhead` runs it.
            (
                EmuDevice::new(BackendKind::Cuda),
                KernelFamily::Vendor,
                4,
                true,
            ),
            (
                EmuDevice::without_conv_library(BackendKind::Cuda),
                KernelFamily::Vendor,
                0,
                false,
            ),
        ];
        for (device, kernels, library_convs, replay) in cases {
            let opt = ExecOptions {
                kernels,
                replay,
                ..Default::default()
            };
            let mut s = GpuSession::new(device, &plan, &w, &opt, None).unwrap();
            let convs = s.program.tasks.iter();
            let convs = convs.filter(|t| matches!(t.work, Work::Conv(_))).count();
            assert_eq!(convs, library_convs, "{kernels:?}");
            assert_eq!(s.replay.is_ok(), replay, "{:?}", s.replay);
            s.run(&input).unwrap();
            let got = s.read_output().unwrap();
            let diff = got.max_abs_diff(&expected);
            assert!(
                diff < 1e-4,
                "{kernels:?} ({library_convs} library calls): {diff}"
            );
            let version = s.kernel_version();
            assert_eq!(version.contains("vendor:"), kernels == KernelFamily::Vendor);
        }
    }

    /// Runs `kernel` of `precision` on `threads` threads (256 a block) with `args`, whose
    /// buffers are `data` uploaded in order, and returns buffer `out`'s bytes afterwards.
    fn launch_on(
        precision: Precision,
        kernel: &'static str,
        data: &[Vec<u8>],
        args: &[super::super::program::Arg],
        threads: usize,
        out: usize,
    ) -> Vec<u8> {
        use super::super::program::{BLOCK, grid_1d, pack};
        let mut dev = EmuDevice::new(BackendKind::Cuda);
        let f = dev.compile(precision, None, &[kernel]).unwrap().remove(0);
        let at: Vec<u64> = (data.iter())
            .map(|bytes| {
                let p = dev.alloc(bytes.len().max(8) as u64).unwrap();
                dev.upload(p, bytes).unwrap();
                p
            })
            .collect();
        let grid = grid_1d(threads).unwrap();
        dev.launch(&f, grid, BLOCK, &pack(args, |b| at[b])).unwrap();
        let mut bytes = vec![0u8; data[out].len()];
        dev.download(at[out], &mut bytes).unwrap();
        bytes
    }

    /// Storage values (`precision`'s) back to f32.
    fn values(precision: Precision, bytes: &[u8]) -> Vec<f32> {
        match precision {
            Precision::Fp32 => bytemuck::pod_collect_to_vec(bytes),
            Precision::Bf16 => bytes
                .chunks(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Precision::Fp16 => bytes
                .chunks(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }

    /// `cached_attention` (a block per row and head) against softmax(q·kᵀ/√head)·v on the
    /// host: heads whose keys and values it reads 16 bytes at a time (8, 64, 96, 128 in FP32;
    /// 8, 64, 128 in BF16) and a value at a time (6; 12 in BF16), value groups that fill the
    /// block and ones that leave threads idle (96 in FP32: ten groups of 24 threads), grouped KV
    /// heads, contexts of one, two and three tiles of 256 keys, several new rows of a sequence,
    /// and a sliding window.
    #[test]
    fn cached_attention_matches_host_softmax() {
        use super::super::program::Arg;
        let cases = [
            // (precision, head, batch, new rows, start, window)
            (Precision::Fp32, 8, 2, 1, 300, 0),
            (Precision::Fp32, 6, 1, 3, 5, 4),
            (Precision::Fp32, 64, 1, 2, 520, 0),
            (Precision::Fp32, 128, 2, 1, 40, 0),
            (Precision::Fp32, 96, 1, 1, 257, 100),
            (Precision::Bf16, 8, 1, 2, 290, 0),
            (Precision::Bf16, 12, 2, 1, 17, 0),
            (Precision::Bf16, 128, 1, 1, 143, 0),
            (Precision::Bf16, 64, 2, 3, 400, 0),
        ];
        let (heads, kv_heads, context) = (4, 2, 600);
        let mut rng = Rng::new(21);
        for (precision, head, batch, new, start, window) in cases {
            let rows = batch * new;
            let width = (heads + 2 * kv_heads) * head;
            let mut random = |n: usize| -> Vec<f32> {
                let v = rng.normal_tensor(vec![n]).data;
                v.into_iter().map(|x| precision.round(x)).collect()
            };
            let qkv = random(rows * width);
            let cache_len = batch * kv_heads * context * head;
            let (k, v) = (random(cache_len), random(cache_len));
            let step: Vec<u8> = bytemuck::cast_slice(&[start as i32, new as i32]).to_vec();
            let y = vec![0u8; rows * heads * head * precision.bytes()];
            let store = |x: &[f32]| precision.storage_bytes(x);
            let data = [store(&qkv), store(&k), store(&v), step, y];
            let i = |v: usize| Arg::I32(v as i32);
            let mut args: Vec<Arg> = (0..5).map(Arg::Buf).collect();
            args.extend([rows, width, heads, kv_heads, head, context, window].map(i));
            let got = values(
                precision,
                &launch_on(
                    precision,
                    "cached_attention",
                    &data,
                    &args,
                    rows * heads * 256,
                    4,
                ),
            );
            for r in 0..rows {
                let (b, pos) = (r / new, start + r % new);
                let first = if window > 0 && pos + 1 > window {
                    pos + 1 - window
                } else {
                    0
                };
                for h in 0..heads {
                    let g = h / (heads / kv_heads);
                    let q = &qkv[r * width + h * head..][..head];
                    let row = |c: &[f32], key: usize| -> Vec<f64> {
                        let at = ((b * kv_heads + g) * context + key) * head;
                        c[at..at + head].iter().map(|&x| x as f64).collect()
                    };
                    let scores: Vec<f64> = (first..=pos)
                        .map(|key| {
                            let kr = row(&k, key);
                            let dot: f64 = q.iter().zip(&kr).map(|(&a, b)| a as f64 * b).sum();
                            dot / (head as f64).sqrt()
                        })
                        .collect();
                    let top = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..head {
                        let want: f64 = (first..=pos)
                            .zip(&e)
                            .map(|(key, w)| w * row(&v, key)[d])
                            .sum::<f64>()
                            / sum;
                        let got = got[(r * heads + h) * head + d] as f64;
                        let tol = if precision == Precision::Fp32 {
                            1e-5
                        } else {
                            1e-2
                        };
                        assert!(
                            (got - want).abs() <= tol * (1.0 + want.abs()),
                            "{precision:?} head {head}, row {r}, head {h}, dim {d}: {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    /// `rms_norm_rows` (a block a row) against x / √(mean(x²) + eps) · w on the host, for one
    /// row and several, rows shorter than the block and longer than it, read 16 bytes at a time
    /// (4096, 600) and a value at a time (33), in FP32 and BF16.
    #[test]
    fn rms_norm_matches_host() {
        use super::super::program::Arg;
        let mut rng = Rng::new(22);
        for precision in [Precision::Fp32, Precision::Bf16] {
            for (rows, d) in [(1, 4096), (3, 33), (2, 600)] {
                let x = rng.normal_tensor(vec![rows, d]).data;
                let x: Vec<f32> = x.into_iter().map(|v| precision.round(v)).collect();
                let w = rng.normal_tensor(vec![d]).data;
                let eps = 1e-5f32;
                let data = [
                    precision.storage_bytes(&x),
                    Precision::Fp32.storage_bytes(&w),
                    vec![0u8; rows * d * precision.bytes()],
                ];
                let i = |v: usize| Arg::I32(v as i32);
                let args = [
                    Arg::Buf(0),
                    Arg::Buf(1),
                    Arg::Buf(2),
                    i(rows),
                    i(d),
                    Arg::F32(eps),
                ];
                let got = values(
                    precision,
                    &launch_on(precision, "rms_norm_rows", &data, &args, rows * 256, 2),
                );
                let tol = if precision == Precision::Fp32 {
                    1e-5
                } else {
                    1e-2
                };
                for r in 0..rows {
                    let row = &x[r * d..][..d];
                    let mean = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
                    let inv = 1.0 / (mean + eps as f64).sqrt();
                    for j in 0..d {
                        let want = row[j] as f64 * inv * w[j] as f64;
                        let got = got[r * d + j] as f64;
                        assert!(
                            (got - want).abs() <= tol * (1.0 + want.abs()),
                            "{precision:?} rows {rows}, d {d}: row {r}, value {j}: {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    /// `gemv` (a decode step's linear layers) at row lengths that take its loop of four 16-byte
    /// loads and its one-load tail (k = 1636 and 676), only the tail (k = 36) and its scalar path
    /// (k = 514), for one to eight rows, with and without bias and residual, against sums on
    /// the host. The output count leaves warps of the last block without an output.
    #[test]
    fn gemv_matches_host_sums_on_each_of_its_paths() {
        use super::super::program::Arg;
        let mut rng = Rng::new(11);
        let n = 11;
        for (k, rows, extras) in [
            (1636, 2, true),
            (676, 1, false),
            (676, 8, true),
            (36, 3, true),
            (514, 5, false),
        ] {
            let x = rng.normal_tensor(vec![rows, k]).data;
            let w = rng.normal_tensor(vec![n, k]).data;
            let bias = rng.normal_tensor(vec![n]).data;
            let res = rng.normal_tensor(vec![rows, n]).data;
            let bytes = |v: &[f32]| Precision::Fp32.storage_bytes(v);
            let data = [
                bytes(&x),
                bytes(&w),
                bytes(&bias),
                bytes(&res),
                vec![0u8; rows * n * 4],
            ];
            let i = |v: usize| Arg::I32(v as i32);
            let mut args: Vec<Arg> = (0..5).map(Arg::Buf).collect();
            args.extend([rows, k, n, extras as usize, extras as usize].map(i));
            let out = values(
                Precision::Fp32,
                &launch_on(Precision::Fp32, "gemv", &data, &args, n * 32, 4),
            );
            for r in 0..rows {
                for o in 0..n {
                    let dot: f64 = (0..k)
                        .map(|j| x[r * k + j] as f64 * w[o * k + j] as f64)
                        .sum();
                    let want = dot
                        + if extras {
                            (bias[o] + res[r * n + o]) as f64
                        } else {
                            0.0
                        };
                    let got = out[r * n + o] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "k {k}, row {r}, output {o}: {got} against {want}"
                    );
                }
            }
        }
    }
}

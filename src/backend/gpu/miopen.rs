//! MIOpen, AMD's deep-learning primitives, as the HIP backend's vendor convolution
//! (`--kernels vendor`): opened at run time ([`super::dl`]) like rocBLAS. Only the functions
//! used are declared, with the enumerations' numbers from `miopen.h` (stable since MIOpen 2).
//!
//! MIOpen wants its search run before a convolution: `miopenFindConvolutionForwardAlgorithm`
//! times the candidate algorithms on the real buffers (answering from its find database when
//! the shape was seen before), so planning happens at prepare time and the pass only enqueues.

use std::ffi::c_void;

use super::dl::{Library, library_functions};
use super::program::{LibConv, WORKSPACE_LIMIT};
use crate::backend::BackendError;
use crate::model::Precision;

/// The names the library goes by: the development link, ROCm's soname, ROCm's own folder.
const NAMES: [&str; 3] = [
    "libMIOpen.so",
    "libMIOpen.so.1",
    "/opt/rocm/lib/libMIOpen.so",
];

// miopenStatus_t, miopenDataType_t, miopenConvolutionMode_t.
const SUCCESS: u32 = 0;
const HALF: u32 = 0;
const FLOAT: u32 = 1;
const BFLOAT16: u32 = 5;
const CROSS_CORRELATION: u32 = 0;

type Handle = *mut c_void;
type Desc = *mut c_void;

/// `miopenConvAlgoPerf_t`: the algorithm (a union of enums), its time and its workspace.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AlgoPerf {
    algo: u32,
    time_ms: f32,
    memory: usize,
}

#[rustfmt::skip]
library_functions! {
    /// MIOpen's functions we call (miopen.h).
    struct Functions {
        version: "miopenGetVersion" =>
            unsafe extern "C" fn(*mut usize, *mut usize, *mut usize) -> u32,
        create: "miopenCreateWithStream" => unsafe extern "C" fn(*mut Handle, *mut c_void) -> u32,
        destroy: "miopenDestroy" => unsafe extern "C" fn(Handle) -> u32,
        tensor: "miopenCreateTensorDescriptor" => unsafe extern "C" fn(*mut Desc) -> u32,
        set_tensor: "miopenSet4dTensorDescriptor" =>
            unsafe extern "C" fn(Desc, u32, i32, i32, i32, i32) -> u32,
        drop_tensor: "miopenDestroyTensorDescriptor" => unsafe extern "C" fn(Desc) -> u32,
        conv: "miopenCreateConvolutionDescriptor" => unsafe extern "C" fn(*mut Desc) -> u32,
        set_conv: "miopenInitConvolutionDescriptor" =>
            unsafe extern "C" fn(Desc, u32, i32, i32, i32, i32, i32, i32) -> u32,
        set_groups: "miopenSetConvolutionGroupCount" => unsafe extern "C" fn(Desc, i32) -> u32,
        drop_conv: "miopenDestroyConvolutionDescriptor" => unsafe extern "C" fn(Desc) -> u32,
        workspace: "miopenConvolutionForwardGetWorkSpaceSize" =>
            unsafe extern "C" fn(Handle, Desc, Desc, Desc, Desc, *mut usize) -> u32,
        find: "miopenFindConvolutionForwardAlgorithm" => unsafe extern "C" fn(
            Handle, Desc, *const c_void, Desc, *const c_void, Desc, Desc, *mut c_void,
            i32, *mut i32, *mut AlgoPerf, *mut c_void, usize, bool,
        ) -> u32,
        forward: "miopenConvolutionForward" => unsafe extern "C" fn(
            Handle, *const c_void, Desc, *const c_void, Desc, *const c_void, Desc, u32,
            *const c_void, Desc, *mut c_void, *mut c_void, usize,
        ) -> u32,
    }
}

/// What `--kernels vendor` on HIP says where MIOpen is missing.
fn missing(why: &str) -> String {
    format!(
        "no MIOpen (libMIOpen.so), {why}: install ROCm's miopen-hip package, or add \
         /opt/rocm/lib to LD_LIBRARY_PATH"
    )
}

/// Open MIOpen (the first of `names` that opens) and find its functions, or say what is
/// missing.
fn open(names: &[&str]) -> Result<Functions, String> {
    let lib = Library::open(names).ok_or_else(|| missing("which was not found"))?;
    Functions::load(&lib)
        .map_err(|name| missing(&format!("whose {name} was not found (too old a MIOpen?)")))
}

/// MIOpen's version (`MIOpen 3.1.0`) where it loads, else what to install.
pub fn present() -> Result<String, String> {
    Ok(version(&open(&NAMES)?))
}

fn version(f: &Functions) -> String {
    let (mut major, mut minor, mut patch) = (0, 0, 0);
    // SAFETY: three out-pointers.
    let status = unsafe { (f.version)(&mut major, &mut minor, &mut patch) };
    if status == SUCCESS {
        format!("MIOpen {major}.{minor}.{patch}")
    } else {
        "MIOpen".into()
    }
}

fn status(what: &str, s: u32) -> Result<(), BackendError> {
    // Names from miopenStatus_t.
    const NAMES: [&str; 11] = [
        "success",
        "not initialized",
        "invalid value",
        "bad parameter",
        "allocation failed",
        "internal error",
        "not implemented",
        "unknown error",
        "unsupported op",
        "GPU operations skipped",
        "version mismatch",
    ];
    match s {
        SUCCESS => Ok(()),
        s => Err(BackendError::Driver(format!(
            "MIOpen: {what} failed ({})",
            NAMES
                .get(s as usize)
                .map_or(format!("status {s}"), |n| n.to_string())
        ))),
    }
}

/// An MIOpen handle on one stream.
pub struct MiOpen {
    f: Functions,
    handle: Handle,
}

/// A convolution MIOpen has planned: its descriptors, the algorithm its search chose and the
/// buffers it runs on.
pub struct Conv {
    x: Desc,
    w: Desc,
    y: Desc,
    conv: Desc,
    algo: u32,
    ptrs: [u64; 3],
    /// Shares the library's functions to destroy the descriptors.
    destroy: (
        unsafe extern "C" fn(Desc) -> u32,
        unsafe extern "C" fn(Desc) -> u32,
    ),
}

impl Drop for Conv {
    fn drop(&mut self) {
        let (tensor, conv) = self.destroy;
        // SAFETY: descriptors made in `plan`, destroyed once.
        unsafe {
            for d in [self.x, self.w, self.y] {
                tensor(d);
            }
            conv(self.conv);
        }
    }
}

impl MiOpen {
    /// A handle whose work goes on `stream`.
    ///
    /// # Safety
    /// `stream` is a live `hipStream_t` of the current device, alive as long as the handle.
    pub unsafe fn new(stream: *mut c_void) -> Result<MiOpen, BackendError> {
        let f = open(&NAMES).map_err(BackendError::MissingLibrary)?;
        // SAFETY: forwarded.
        unsafe { MiOpen::with(f, stream) }
    }

    /// [`MiOpen::new`] with the library's functions at hand.
    ///
    /// # Safety
    /// As for [`MiOpen::new`].
    unsafe fn with(f: Functions, stream: *mut c_void) -> Result<MiOpen, BackendError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: an out-pointer and the stream the contract vouches for; destroyed in Drop.
        status("creating a handle", unsafe {
            (f.create)(&mut handle, stream)
        })?;
        Ok(MiOpen { f, handle })
    }

    /// The descriptors of `c` in `precision`, and the workspace its algorithms may need.
    pub fn describe(&self, c: &LibConv, precision: Precision) -> Result<Conv, BackendError> {
        let d = c.dims()?;
        let ty = match precision {
            Precision::Fp32 => FLOAT,
            Precision::Fp16 => HALF,
            Precision::Bf16 => BFLOAT16,
        };
        let f = &self.f;
        let tensor = |dims: [i32; 4]| -> Result<Desc, BackendError> {
            let mut t = std::ptr::null_mut();
            // SAFETY: an out-pointer, then the descriptor just made; destroyed by `Conv`.
            unsafe {
                status("creating a tensor descriptor", (f.tensor)(&mut t))?;
                status(
                    "describing a tensor",
                    (f.set_tensor)(t, ty, dims[0], dims[1], dims[2], dims[3]),
                )?;
            }
            Ok(t)
        };
        let mut conv = Conv {
            x: tensor(d.x)?,
            w: tensor(d.w)?,
            y: tensor(d.y)?,
            conv: std::ptr::null_mut(),
            algo: 0,
            ptrs: [0; 3],
            destroy: (f.drop_tensor, f.drop_conv),
        };
        // SAFETY: an out-pointer, then the descriptor just made.
        unsafe {
            status(
                "creating a convolution descriptor",
                (f.conv)(&mut conv.conv),
            )?;
            let [ph, pw] = d.padding;
            let [sh, sw] = d.stride;
            let [dh, dw] = d.dilation;
            status(
                "describing a convolution",
                (f.set_conv)(conv.conv, CROSS_CORRELATION, ph, pw, sh, sw, dh, dw),
            )?;
            status("setting the groups", (f.set_groups)(conv.conv, d.groups))?;
        }
        Ok(conv)
    }

    /// The workspace bytes MIOpen's search may use for `conv` (the most any candidate needs,
    /// up to [`WORKSPACE_LIMIT`]: the search then skips the algorithms needing more).
    pub fn workspace(&self, conv: &Conv) -> Result<u64, BackendError> {
        let mut bytes = 0usize;
        // SAFETY: live descriptors and an out-pointer.
        status("sizing the workspace", unsafe {
            (self.f.workspace)(self.handle, conv.w, conv.x, conv.conv, conv.y, &mut bytes)
        })?;
        Ok((bytes as u64).min(WORKSPACE_LIMIT))
    }

    /// Run MIOpen's search for `conv` on the buffers `[x, w, y]` and keep the fastest algorithm.
    ///
    /// # Safety
    /// `ptrs` are device allocations sized for `conv`, `workspace` one of `bytes` bytes
    /// (at least [`MiOpen::workspace`]).
    pub unsafe fn plan(
        &self,
        conv: &mut Conv,
        ptrs: [u64; 3],
        (workspace, bytes): (u64, u64),
    ) -> Result<(), BackendError> {
        let mut found = [AlgoPerf::default(); 4];
        let mut count = 0;
        let [x, w, y] = ptrs;
        // SAFETY: forwarded from the contract; `found` holds the 4 results asked for.
        status("searching for an algorithm", unsafe {
            (self.f.find)(
                self.handle,
                conv.x,
                x as *const c_void,
                conv.w,
                w as *const c_void,
                conv.conv,
                conv.y,
                y as *mut c_void,
                found.len() as i32,
                &mut count,
                found.as_mut_ptr(),
                workspace as *mut c_void,
                bytes as usize,
                false,
            )
        })?;
        // Sorted fastest first; MIOpen fits them to the workspace it was given.
        let best = found[..count.clamp(0, found.len() as i32) as usize]
            .iter()
            .find(|p| p.memory as u64 <= bytes)
            .ok_or_else(|| {
                BackendError::Driver("MIOpen found no algorithm for a convolution".into())
            })?;
        conv.algo = best.algo;
        conv.ptrs = ptrs;
        Ok(())
    }

    /// Enqueue a planned convolution (y = conv(x, w), overwritten).
    ///
    /// # Safety
    /// As for [`MiOpen::plan`], with the same buffers still allocated.
    pub unsafe fn forward(
        &self,
        conv: &Conv,
        (workspace, bytes): (u64, u64),
    ) -> Result<(), BackendError> {
        let (alpha, beta) = (1f32, 0f32);
        let [x, w, y] = conv.ptrs;
        // SAFETY: forwarded from the contract; alpha and beta are f32 for every data type.
        status("running a convolution", unsafe {
            (self.f.forward)(
                self.handle,
                &alpha as *const f32 as *const c_void,
                conv.x,
                x as *const c_void,
                conv.w,
                w as *const c_void,
                conv.conv,
                conv.algo,
                &beta as *const f32 as *const c_void,
                conv.y,
                y as *mut c_void,
                workspace as *mut c_void,
                bytes as usize,
            )
        })
    }
}

impl Drop for MiOpen {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        unsafe { (self.f.destroy)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::{dl, emu};

    /// Where MIOpen is not installed (CI's machines), the vendor path says what to install;
    /// where it is, it names its version.
    #[test]
    fn missing_miopen_says_what_to_install() {
        match present() {
            Ok(version) => assert!(version.starts_with("MIOpen"), "{version}"),
            Err(e) => assert!(e.contains("libMIOpen.so") && e.contains("install"), "{e}"),
        }
    }

    /// The binding drives a stand-in library with miopen.h's signatures
    /// (tests/fixtures/fake_miopen.cpp, built here with the host C++ compiler) through a
    /// grouped, strided, padded, dilated convolution whose every size differs, so a swapped
    /// argument fails its checks: descriptors, the workspace, the search (whose fastest
    /// candidate needs more workspace than granted, so the next is kept) and the call, whose
    /// output matches the emulator's convolution.
    #[test]
    fn the_binding_drives_a_stand_in_library() {
        let sources = [
            include_str!("../../../tests/fixtures/fake_conv.inc"),
            include_str!("../../../tests/fixtures/fake_miopen.cpp"),
        ];
        let f = Functions::load(&dl::stand_in("fake_miopen", &sources)).unwrap();
        assert_eq!(version(&f), "MIOpen 3.1.0");
        // SAFETY: the stand-in takes any stream.
        let dnn = unsafe { MiOpen::with(f, std::ptr::null_mut()) }.unwrap();
        let c = emu::odd_conv();
        let mut conv = dnn.describe(&c, Precision::Fp32).unwrap();
        let bytes = dnn.workspace(&conv).unwrap();
        let mut workspace = vec![0u8; bytes as usize];
        let ws = (workspace.as_mut_ptr() as u64, bytes);
        emu::check_library_conv(&c, |ptrs| {
            // SAFETY: host buffers of the sizes the stand-in reads and writes.
            unsafe {
                let early = dnn.forward(&conv, ws).unwrap_err().to_string();
                assert!(early.contains("not implemented"), "{early}");
                dnn.plan(&mut conv, ptrs, ws).unwrap();
                dnn.forward(&conv, ws).unwrap();
            }
        });
        // Sizes that make no convolution are refused by the library, in words.
        let wrong = LibConv { groups: 4, ..c };
        let mut bad = dnn.describe(&wrong, Precision::Fp32).unwrap();
        let zeros = [workspace.as_ptr() as u64; 3];
        // SAFETY: the stand-in refuses before reading the buffers.
        let e = unsafe { dnn.plan(&mut bad, zeros, ws) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad parameter"), "{e}");
    }
}

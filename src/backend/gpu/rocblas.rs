//! rocBLAS, AMD's BLAS, as the HIP backend's vendor GEMM (`--kernels vendor`): opened at run
//! time ([`super::dl`]), as cudarc opens cuBLAS. Only the few functions used are declared, with
//! the enumerations' numbers from `rocblas-types.h` (stable since ROCm 3).

use std::ffi::c_void;

use super::dl::{Library, library_functions};
use super::program::{BufId, ColumnMajor};
use crate::backend::BackendError;
use crate::model::Precision;

/// The names the library goes by: the development link, then ROCm 6's and ROCm 5's sonames, then
/// ROCm's own folder.
const NAMES: [&str; 4] = [
    "librocblas.so",
    "librocblas.so.4",
    "librocblas.so.0",
    "/opt/rocm/lib/librocblas.so",
];

// rocblas_operation, rocblas_datatype, rocblas_gemm_algo, rocblas_status.
const OPERATION_NONE: u32 = 111;
const OPERATION_TRANSPOSE: u32 = 112;
const F16: u32 = 150;
const F32: u32 = 151;
const BF16: u32 = 168;
const ALGO_STANDARD: u32 = 0;
const SUCCESS: u32 = 0;

#[rustfmt::skip]
library_functions! {
    /// rocBLAS's functions we call (rocblas-functions.h, rocblas-auxiliary.h).
    struct Functions {
        create: "rocblas_create_handle" => unsafe extern "C" fn(*mut *mut c_void) -> u32,
        destroy: "rocblas_destroy_handle" => unsafe extern "C" fn(*mut c_void) -> u32,
        set_stream: "rocblas_set_stream" => unsafe extern "C" fn(*mut c_void, *mut c_void) -> u32,
        gemm: "rocblas_gemm_strided_batched_ex" => unsafe extern "C" fn(
            *mut c_void, u32, u32, i32, i32, i32, *const c_void,
            *const c_void, u32, i32, i64,
            *const c_void, u32, i32, i64,
            *const c_void,
            *const c_void, u32, i32, i64,
            *mut c_void, u32, i32, i64,
            i32, u32, u32, i32, u32,
        ) -> u32,
    }
}

/// What `--kernels vendor` on HIP says where rocBLAS is missing.
fn missing(why: &str) -> BackendError {
    BackendError::MissingLibrary(format!(
        "--kernels vendor on hip needs rocBLAS (librocblas.so), {why}: install ROCm's rocblas \
         package, or add /opt/rocm/lib to LD_LIBRARY_PATH"
    ))
}

/// Open rocBLAS and find its functions, or say what is missing.
fn open() -> Result<Functions, BackendError> {
    let lib = Library::open(&NAMES).ok_or_else(|| missing("which was not found"))?;
    Functions::load(&lib)
        .map_err(|name| missing(&format!("whose {name} was not found (too old a rocBLAS?)")))
}

/// Whether rocBLAS can be loaded here, or what to install.
pub fn present() -> Result<(), BackendError> {
    open().map(|_| ())
}

/// A rocBLAS handle on one stream.
pub struct RocBlas {
    f: Functions,
    handle: *mut c_void,
}

impl RocBlas {
    /// A handle whose work goes on `stream`.
    ///
    /// # Safety
    /// `stream` is a live `hipStream_t` of the current device (or null: the default stream),
    /// alive as long as the handle.
    pub unsafe fn new(stream: *mut c_void) -> Result<RocBlas, BackendError> {
        // SAFETY: forwarded.
        unsafe { RocBlas::with(open()?, stream) }
    }

    /// [`RocBlas::new`] with the library's functions at hand.
    ///
    /// # Safety
    /// As for [`RocBlas::new`].
    unsafe fn with(f: Functions, stream: *mut c_void) -> Result<RocBlas, BackendError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: an out-pointer; the handle is destroyed in Drop.
        let status = unsafe { (f.create)(&mut handle) };
        if status != SUCCESS {
            return Err(BackendError::Driver(format!(
                "creating the rocBLAS handle failed (status {status})"
            )));
        }
        let blas = RocBlas { f, handle };
        // SAFETY: a live handle, and the stream the contract vouches for.
        let status = unsafe { (blas.f.set_stream)(blas.handle, stream) };
        if status != SUCCESS {
            return Err(BackendError::Driver(format!(
                "binding rocBLAS to the session's stream failed (status {status})"
            )));
        }
        Ok(blas)
    }

    /// Enqueue `g` in `precision` (f32 accumulation), as the CUDA backend's cuBLAS call does.
    ///
    /// # Safety
    /// `ptr` gives device pointers to allocations the program sized for this GEMM.
    pub unsafe fn gemm(
        &self,
        g: &ColumnMajor,
        ptr: &dyn Fn(BufId) -> u64,
        precision: Precision,
    ) -> Result<(), BackendError> {
        let ty = match precision {
            Precision::Fp32 => F32,
            Precision::Fp16 => F16,
            Precision::Bf16 => BF16,
        };
        let op = |t: bool| {
            if t {
                OPERATION_TRANSPOSE
            } else {
                OPERATION_NONE
            }
        };
        let (alpha, beta) = (1f32, 0f32);
        let i = |v: usize| v as i32;
        let c = ptr(g.c) as *mut c_void;
        // SAFETY: forwarded from the contract; C is also D (in place, as rocBLAS allows).
        let status = unsafe {
            (self.f.gemm)(
                self.handle,
                op(g.trans_first),
                OPERATION_NONE,
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
                c,
                ty,
                i(g.ldc),
                g.stride_c as i64,
                c,
                ty,
                i(g.ldc),
                g.stride_c as i64,
                i(g.batch),
                F32,
                ALGO_STANDARD,
                0,
                0,
            )
        };
        match status {
            SUCCESS => Ok(()),
            s => Err(BackendError::Driver(format!(
                "rocBLAS GEMM failed (status {s})"
            ))),
        }
    }
}

impl Drop for RocBlas {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        unsafe { (self.f.destroy)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::dl;
    use super::super::program::{Gemm, check_gemms};
    use super::*;

    /// Where rocBLAS is not installed (CI's machines), the vendor path says what to install;
    /// where it is, it loads.
    #[test]
    fn missing_rocblas_says_what_to_install() {
        if let Err(e) = present() {
            let e = e.to_string();
            assert!(e.contains("librocblas.so") && e.contains("install"), "{e}");
        }
    }

    /// The binding drives a stand-in library with rocBLAS's signature
    /// (tests/fixtures/fake_rocblas.cpp, built here), which checks the types, operations,
    /// leading dimensions and strides it is given: batched row-major GEMMs, B stored either
    /// way, come out as the plain product (`check_gemms`).
    #[test]
    fn the_binding_drives_a_stand_in_library() {
        let source = include_str!("../../../tests/fixtures/fake_rocblas.cpp");
        let f = Functions::load(&dl::stand_in("fake_rocblas", &[source])).unwrap();
        // SAFETY: the stand-in takes any stream.
        let blas = unsafe { RocBlas::with(f, std::ptr::null_mut()) }.unwrap();
        check_gemms(|g, bufs| {
            let ptrs = [
                bufs[0].as_ptr() as u64,
                bufs[1].as_ptr() as u64,
                bufs[2].as_mut_ptr() as u64,
            ];
            // SAFETY: host buffers of the sizes the GEMM reads and writes.
            unsafe { blas.gemm(&g.column_major(), &|id| ptrs[id], Precision::Fp32) }.unwrap();
        });
        // A storage type the stand-in does not take is refused with rocBLAS's status.
        let g = Gemm {
            m: 1,
            n: 1,
            k: 1,
            a: 0,
            b: 0,
            c: 0,
            trans_b: false,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        };
        let mut one = [1f32; 2];
        let p = one.as_mut_ptr() as u64;
        // SAFETY: as above.
        let e = unsafe { blas.gemm(&g.column_major(), &|_| p, Precision::Fp16) };
        assert!(e.unwrap_err().to_string().contains("status 11"));
    }
}

//! cuDNN as the CUDA backend's vendor convolution (`--kernels vendor`), through cudarc's thin
//! bindings, loaded at run time like cuBLAS. The algorithm is cuDNN's own heuristic pick
//! (`cudnnGetConvolutionForwardAlgorithm_v7`), as PyTorch makes it unless
//! `torch.backends.cudnn.benchmark` is set. FP32 runs on the FP32 units (`CUDNN_FMA_MATH`: no
//! TF32, like our kernels and the cuBLAS call), FP16 and BF16 on the tensor cores, all with f32
//! accumulation.

use std::ffi::c_void;

use cudarc::cudnn::{result, sys};

use super::program::{LibConv, WORKSPACE_LIMIT};
use crate::backend::BackendError;
use crate::model::Precision;

fn failed(what: &str, e: result::CudnnError) -> BackendError {
    BackendError::Driver(format!("cuDNN: {what} failed: {:?}", e.0))
}

/// cuDNN's version (`cuDNN 9.1.0`) where it loads, else what to install.
pub fn present() -> Result<String, String> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "no cuDNN (libcudnn.so) found: install it (e.g. `pip install \
                    nvidia-cudnn-cu12` and add its lib folder to LD_LIBRARY_PATH)"
                .into(),
        );
    }
    Ok(format!("cuDNN {}", version(result::get_version())))
}

/// `cudnnGetVersion`'s number as `major.minor.patch`: major·10000 + minor·100 + patch from
/// cuDNN 9 on, major·1000 + minor·100 + patch before.
fn version(v: usize) -> String {
    let base = if v >= 90_000 { 10_000 } else { 1_000 };
    format!("{}.{}.{}", v / base, v % base / 100, v % 100)
}

/// A cuDNN handle on one stream.
pub struct Cudnn {
    handle: sys::cudnnHandle_t,
}

/// A convolution cuDNN has planned: its descriptors, the algorithm and the buffers.
pub struct Conv {
    x: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
    algo: sys::cudnnConvolutionFwdAlgo_t,
    ptrs: [u64; 3],
}

impl Drop for Conv {
    fn drop(&mut self) {
        // SAFETY: descriptors made in `plan` (or null, which cuDNN ignores), destroyed once.
        unsafe {
            let _ = result::destroy_tensor_descriptor(self.x);
            let _ = result::destroy_filter_descriptor(self.w);
            let _ = result::destroy_tensor_descriptor(self.y);
            let _ = result::destroy_convolution_descriptor(self.conv);
        }
    }
}

impl Cudnn {
    /// A handle whose work goes on `stream`.
    ///
    /// # Safety
    /// `stream` is a live `CUstream` of the current context, alive as long as the handle.
    pub unsafe fn new(stream: *mut c_void) -> Result<Cudnn, BackendError> {
        present().map_err(BackendError::MissingLibrary)?;
        let handle = result::create_handle().map_err(|e| failed("creating a handle", e))?;
        let dnn = Cudnn { handle };
        // SAFETY: a live handle, and the stream the contract vouches for.
        unsafe { result::set_stream(dnn.handle, stream as sys::cudaStream_t) }
            .map_err(|e| failed("binding to the session's stream", e))?;
        Ok(dnn)
    }

    /// Describe `c` in `precision`, let cuDNN's heuristics pick the algorithm, and return the
    /// plan with the workspace bytes it needs. The buffers are `[x, w, y]`.
    pub fn plan(
        &self,
        c: &LibConv,
        ptrs: [u64; 3],
        precision: Precision,
    ) -> Result<(Conv, u64), BackendError> {
        let d = c.dims()?;
        let (ty, math) = match precision {
            Precision::Fp32 => (
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                sys::cudnnMathType_t::CUDNN_FMA_MATH,
            ),
            Precision::Fp16 => (
                sys::cudnnDataType_t::CUDNN_DATA_HALF,
                sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            ),
            Precision::Bf16 => (
                sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
                sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            ),
        };
        let nchw = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        let e = |what| move |e| failed(what, e);
        let mut conv = Conv {
            x: result::create_tensor_descriptor().map_err(e("creating a descriptor"))?,
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            algo: sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
            ptrs,
        };
        conv.y = result::create_tensor_descriptor().map_err(e("creating a descriptor"))?;
        conv.w = result::create_filter_descriptor().map_err(e("creating a descriptor"))?;
        conv.conv = result::create_convolution_descriptor().map_err(e("creating a descriptor"))?;
        let [ph, pw] = d.padding;
        let [sh, sw] = d.stride;
        let [dh, dw] = d.dilation;
        // SAFETY: the descriptors just made.
        unsafe {
            result::set_tensor4d_descriptor(conv.x, nchw, ty, d.x)
                .map_err(e("describing the input"))?;
            result::set_tensor4d_descriptor(conv.y, nchw, ty, d.y)
                .map_err(e("describing the output"))?;
            result::set_filter4d_descriptor(conv.w, ty, nchw, d.w)
                .map_err(e("describing the weights"))?;
            result::set_convolution2d_descriptor(
                conv.conv,
                ph,
                pw,
                sh,
                sw,
                dh,
                dw,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(e("describing the convolution"))?;
            result::set_convolution_group_count(conv.conv, d.groups)
                .map_err(e("setting the groups"))?;
            result::set_convolution_math_type(conv.conv, math)
                .map_err(e("setting the math type"))?;
        }
        const ASKED: usize =
            sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize;
        // SAFETY: plain C structs of enums and numbers, for which zero is valid.
        let mut found: [sys::cudnnConvolutionFwdAlgoPerf_t; ASKED] = unsafe { std::mem::zeroed() };
        let mut count = 0;
        // SAFETY: live descriptors; `found` holds the ASKED results cuDNN may write.
        unsafe {
            result::get_convolution_forward_algorithm(
                self.handle,
                conv.x,
                conv.w,
                conv.conv,
                conv.y,
                ASKED as i32,
                &mut count,
                found.as_mut_ptr(),
            )
        }
        .map_err(e("choosing an algorithm"))?;
        // Ranked best first; the first that can run this convolution in a workspace we grant.
        let best = found[..count.clamp(0, ASKED as i32) as usize]
            .iter()
            .find(|p| {
                p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
                    && p.memory as u64 <= WORKSPACE_LIMIT
            })
            .ok_or_else(|| {
                BackendError::Driver("cuDNN has no algorithm for a convolution".into())
            })?;
        conv.algo = best.algo;
        // SAFETY: live descriptors.
        let bytes = unsafe {
            result::get_convolution_forward_workspace_size(
                self.handle,
                conv.x,
                conv.w,
                conv.conv,
                conv.y,
                conv.algo,
            )
        }
        .map_err(e("sizing the workspace"))?;
        Ok((conv, bytes as u64))
    }

    /// Enqueue a planned convolution (y = conv(x, w), overwritten).
    ///
    /// # Safety
    /// The plan's buffers are still allocated; `workspace` holds at least the bytes its plan
    /// asked for.
    pub unsafe fn forward(
        &self,
        conv: &Conv,
        (workspace, bytes): (u64, u64),
    ) -> Result<(), BackendError> {
        let (alpha, beta) = (1f32, 0f32);
        let [x, w, y] = conv.ptrs;
        // SAFETY: forwarded from the contract; alpha and beta are f32 for every data type
        // but double.
        unsafe {
            result::convolution_forward(
                self.handle,
                &alpha as *const f32 as *const c_void,
                conv.x,
                x as *const c_void,
                conv.w,
                w as *const c_void,
                conv.conv,
                conv.algo,
                workspace as *mut c_void,
                bytes as usize,
                &beta as *const f32 as *const c_void,
                conv.y,
                y as *mut c_void,
            )
        }
        .map_err(|e| failed("running a convolution", e))
    }
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::{dl, emu};

    #[test]
    fn versions_read_in_both_schemes() {
        assert_eq!(version(91002), "9.10.2");
        assert_eq!(version(90100), "9.1.0");
        assert_eq!(version(8907), "8.9.7");
    }

    /// Where cuDNN is not installed (CI's machines), the vendor path says what to install;
    /// where it is, it names its version.
    #[test]
    fn missing_cudnn_says_what_to_install() {
        match present() {
            Ok(version) => assert!(version.starts_with("cuDNN"), "{version}"),
            Err(e) => assert!(e.contains("libcudnn.so") && e.contains("install"), "{e}"),
        }
    }

    /// Set in the process that runs the binding against the stand-in.
    const STAND_IN: &str = "WORKSHOP_TEST_CUDNN_STAND_IN";

    /// The binding drives a stand-in library with cudnn.h's signatures
    /// (tests/fixtures/fake_cudnn.cpp): descriptors, the heuristic's ranking (its best wants
    /// 2 GiB of workspace and its second cannot run the shape, so the third is kept), the
    /// workspace, and a convolution matching the emulator's. cudarc opens `libcudnn.so` by
    /// name, so this test runs itself again with the stand-in's folder on LD_LIBRARY_PATH.
    #[test]
    fn the_binding_drives_a_stand_in_library() {
        if std::env::var_os(STAND_IN).is_none() {
            let dir = std::env::temp_dir().join(format!("workshop-cudnn-{}", std::process::id()));
            let sources = [
                include_str!("../../../tests/fixtures/fake_conv.inc"),
                include_str!("../../../tests/fixtures/fake_cudnn.cpp"),
            ];
            dl::build_stand_in("cudnn", &sources, &dir);
            let name = "backend::gpu::cudnn::tests::the_binding_drives_a_stand_in_library";
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([name, "--exact", "--test-threads=1"])
                .env(STAND_IN, "1")
                .env("LD_LIBRARY_PATH", &dir)
                .output()
                .unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "{stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        assert_eq!(present().unwrap(), "cuDNN 9.10.2");
        // SAFETY: the stand-in takes any stream.
        let dnn = unsafe { Cudnn::new(std::ptr::null_mut()) }.unwrap();
        let c = emu::odd_conv();
        emu::check_library_conv(&c, |ptrs| {
            let (conv, bytes) = dnn.plan(&c, ptrs, Precision::Fp32).unwrap();
            assert_eq!(bytes, 512);
            let mut workspace = vec![0u8; bytes as usize];
            // SAFETY: host buffers of the sizes the stand-in reads and writes.
            unsafe { dnn.forward(&conv, (workspace.as_mut_ptr() as u64, bytes)) }.unwrap();
        });
        // The stand-in takes FP32 only: half precision is refused in cuDNN's words.
        let e = dnn
            .plan(&c, [0; 3], Precision::Fp16)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("CUDNN_STATUS_BAD_PARAM"), "{e}");
    }
}

//! The machine the CPU backend runs on: its SIMD features, memory, cache sizes (CPUID), and
//! buffers backed by huge pages.

use super::DeviceInfo;
use super::*;

/// Instruction-set features that our kernels (and `gemm`'s) take advantage of.
pub fn cpu_features() -> Vec<String> {
    let mut f = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($name:tt),*) => { $( if std::arch::is_x86_feature_detected!($name) { f.push($name.to_uppercase()); } )* };
        }
        probe!(
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bf16",
            "avx512fp16"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            f.push("NEON".into());
        }
        if std::arch::is_aarch64_feature_detected!("fp16") {
            f.push("FP16".into());
        }
    }
    f
}

/// The host's name, memory and cores, as the CPU backend's one device.
pub fn host_device() -> DeviceInfo {
    // sysinfo can fail on exotic platforms; the device is still usable without these facts.
    let sys = sysinfo::System::new().ok().map(|mut sys| {
        sys.refresh_memory();
        sys.refresh_cpu_list(sysinfo::CpuRefreshKind::nothing());
        sys
    });
    let name = sys
        .as_ref()
        .and_then(|s| s.cpus().first().map(|c| c.brand().trim().to_string()))
        .filter(|s| !s.is_empty());
    DeviceInfo {
        name: name.unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH)),
        memory_bytes: sys.as_ref().map(|s| s.total_memory()),
        driver: Some(format!(
            "workshop-cpu kernels, sgemm {}",
            sgemm::kernel_name()
        )),
        compute_units: std::thread::available_parallelism().ok().map(|n| n.get()),
        features: cpu_features(),
        clock_mhz: None,
    }
}

/// Memory the OS can give us now (unknown → no limit is enforced).
pub fn available_memory() -> u64 {
    sysinfo::System::new().map_or(u64::MAX, |mut sys| {
        sys.refresh_memory();
        sys.available_memory()
    })
}

/// CPUID's extended leaf 0x8000_0006 (ECX: the L2 cache, EDX: the L3 on AMD), where the CPU
/// has it.
pub(crate) fn cache_leaf() -> Option<(u32, u32)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 0x8000_0006 is read only where the
        // highest extended leaf (leaf 0x8000_0000's EAX) includes it.
        #[allow(unused_unsafe)]
        unsafe {
            if __cpuid(0x8000_0000).eax >= 0x8000_0006 {
                let leaf = __cpuid(0x8000_0006);
                return Some((leaf.ecx, leaf.edx));
            }
        }
    }
    None
}

/// `len` zeros of `T` on whole cache lines, in memory that Linux is asked to back with 2 MiB
/// pages (transparent huge pages, which Debian's kernels give only to memory a program asks
/// them for): the packed weights and the activations, tens of MB streamed every pass, then
/// take one TLB entry per 2 MiB instead of 512. ResNet-50 FP32 at batch 8 on a Zen 5 VM:
/// +1.0% (10 interleaved runs, 9 of them faster), start-up unchanged. The advice is given
/// before the first write, which is when the pages are made.
pub(crate) fn big_buffer<T: bytemuck::Pod>(len: usize) -> Lines<T> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .expect("buffer size overflows");
    let mut v: Vec<Line> = Vec::with_capacity(bytes.div_ceil(LINE));
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = v.as_mut_ptr() as usize;
        let end = start + bytes;
        let (a0, a1) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if a1 > a0 {
            // SAFETY: advice on whole pages inside this allocation; it changes how they will
            // be backed, never what they hold. A kernel without huge pages refuses it, which
            // changes nothing.
            unsafe { libc::madvise(a0 as *mut libc::c_void, a1 - a0, libc::MADV_HUGEPAGE) };
        }
    }
    v.resize(bytes.div_ceil(LINE), Line([0; LINE]));
    Lines {
        lines: v,
        len,
        of: std::marker::PhantomData,
    }
}

const LINE: usize = 64;

/// One cache line, the unit [`Lines`] are allocated in.
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(64))]
struct Line([u8; LINE]);

/// `len` values of `T` that start on a cache line ([`big_buffer`]). A `Vec` of a large size
/// starts 16 bytes into its pages (glibc's header before an mmap'd block), so every 64-byte
/// row of a block or a panel straddled two lines: two loads for one, and a store split in two.
pub(crate) struct Lines<T> {
    lines: Vec<Line>,
    len: usize,
    of: std::marker::PhantomData<T>,
}

impl<T: bytemuck::Pod> Lines<T> {
    /// `len` zeros again, in this buffer's memory where it is large enough (else a new
    /// one's): scratch refilled call after call allocates, and faults in pages, only when it
    /// grows. Freed per call instead, attention's buffers had glibc hand their pages back and
    /// fault them in again for every head (a tenth of its time in the kernel).
    pub(crate) fn refill_zeros(&mut self, len: usize) {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("buffer size overflows");
        if bytes <= self.lines.len() * LINE {
            self.len = len;
            self.fill(T::zeroed());
        } else {
            *self = big_buffer(len);
        }
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers start on a cache line, hold exactly `len` zeros, and write through.
    #[test]
    fn big_buffers_start_on_a_line() {
        for len in [0, 1, 15, 16, 17, 1000, (3 << 20) + 5] {
            let mut b = big_buffer::<half::bf16>(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|v| v.to_bits() == 0));
            assert_eq!(b.as_ptr() as usize % 64, 0, "{len} values");
            if let Some(last) = b.last_mut() {
                *last = half::bf16::ONE;
            }
            assert_eq!(
                b.iter().filter(|v| **v == half::bf16::ONE).count(),
                len.min(1)
            );
            let f = big_buffer::<f32>(len);
            assert_eq!((f.len(), f.as_ptr() as usize % 64), (len, 0));
        }
    }
}

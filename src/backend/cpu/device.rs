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

/// Return the allocator's free memory to the system (glibc keeps freed chunks in its heaps,
/// resident, for later allocations; its `malloc_trim` gives back every whole free page).
/// Elsewhere a no-op: other allocators return large blocks as they are freed or not at all.
pub(crate) fn give_back_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only changes the allocator's own bookkeeping and mappings.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `len` zeros of `T` on whole cache lines, in memory that Linux is asked to back with 2 MiB
/// pages (transparent huge pages, which Debian's kernels give only to memory a program asks
/// them for): the packed weights and the activations, tens of MB streamed every pass, then
/// take one TLB entry per 2 MiB instead of 512. ResNet-50 FP32 at batch 8 on a Zen 5 VM:
/// +1.0% (10 interleaved runs, 9 of them faster), start-up unchanged. The advice is given
/// before the first write, which is when the pages are made. From 2 MiB on, in a mapping of
/// its own ([`map_huge`]): in a Qwen2.5-0.5B BF16 decode, 854 MB of the weights' 1 GB lay in
/// huge pages, against 590 MB when they came from the allocator, and its layers' four GEMMs
/// at one row (two threads on a Zen 3, both kinds of buffer in one process, alternating) took
/// 0.89–0.975× as long in BF16 (6 runs, either kind allocated first) and 0.95–0.965× in FP32
/// (4 runs).
pub(crate) fn big_buffer<T: bytemuck::Pod>(len: usize) -> Lines<T> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .and_then(|b| b.checked_next_multiple_of(LINE))
        .expect("buffer size overflows");
    #[cfg(target_os = "linux")]
    let mapped = (bytes >= HUGE).then(|| map_huge(bytes)).flatten();
    #[cfg(not(target_os = "linux"))]
    let mapped = None;
    let (ptr, memory) = mapped.unwrap_or_else(|| {
        let layout =
            std::alloc::Layout::from_size_align(bytes, LINE).expect("buffer size overflows");
        let ptr = if bytes == 0 {
            std::ptr::NonNull::dangling()
        } else {
            // SAFETY: the layout's size is not zero.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            std::ptr::NonNull::new(p.cast())
                .unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        };
        (ptr, Memory::Allocated(layout))
    });
    Lines {
        ptr,
        bytes,
        memory,
        len,
        of: std::marker::PhantomData,
    }
}

/// `bytes` of zeros in a mapping of their own, starting on a 2 MiB boundary and advised to be
/// backed by huge pages up to the last whole one (the tail, under 2 MiB, keeps small pages
/// rather than a huge one it half uses). Its own mapping because the allocator's memory may
/// have been touched already, and pages made before the advice stay small: glibc serves
/// sizes up to its mmap threshold (which rises to 32 MiB as large blocks are freed, as
/// preparation frees every f32 weight it packs) from its heap, and 16 of Qwen2.5-0.5B's 24
/// down projections and all its qkv ones lay in small pages. None where the kernel refuses the
/// mapping.
#[cfg(target_os = "linux")]
fn map_huge(bytes: usize) -> Option<(std::ptr::NonNull<Line>, Memory)> {
    let size = bytes.checked_add(HUGE)?;
    // SAFETY: a fresh private anonymous mapping, touching no memory of ours.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let start = (base as usize).next_multiple_of(HUGE);
    let whole = bytes / HUGE * HUGE;
    // SAFETY: advice on whole pages inside the mapping; it changes how they will be backed,
    // never what they hold. A kernel without huge pages refuses it, which changes nothing.
    unsafe { libc::madvise(start as *mut libc::c_void, whole, libc::MADV_HUGEPAGE) };
    let ptr = std::ptr::NonNull::new(start as *mut Line)?;
    Some((ptr, Memory::Mapped((base as usize, size))))
}

const LINE: usize = 64;
const HUGE: usize = 2 << 20;

/// One cache line, the unit [`Lines`] are allocated in.
#[repr(C, align(64))]
struct Line([u8; LINE]);

/// Where a [`Lines`] buffer's memory came from, to give it back the same way.
enum Memory {
    /// The global allocator's, with this layout (a size of zero: nothing allocated).
    Allocated(std::alloc::Layout),
    /// A mapping of its own: its start and size.
    #[cfg(target_os = "linux")]
    Mapped((usize, usize)),
}

/// `len` values of `T` that start on a cache line ([`big_buffer`]), in memory of its own (a
/// `Vec` does not say where its memory comes from, nor take an alignment). A `Vec` of a large
/// size started 16 bytes into its pages (glibc's header before an mmap'd block), so every
/// 64-byte row of a block or a panel straddled two lines: two loads for one, and a store split
/// in two.
pub(crate) struct Lines<T> {
    ptr: std::ptr::NonNull<Line>,
    /// Zeroed or written bytes at `ptr`, whole lines.
    bytes: usize,
    memory: Memory,
    len: usize,
    of: std::marker::PhantomData<T>,
}

// SAFETY: `Lines` owns its memory, as a `Vec` does; `T` is plain data.
unsafe impl<T: bytemuck::Pod + Send> Send for Lines<T> {}
// SAFETY: as for `Send`; shared access only reads.
unsafe impl<T: bytemuck::Pod + Sync> Sync for Lines<T> {}

/// No values yet: scratch that [`Lines::reuse`] or [`Lines::refill_zeros`] sizes.
impl<T: bytemuck::Pod> Default for Lines<T> {
    fn default() -> Self {
        big_buffer(0)
    }
}

impl<T> Drop for Lines<T> {
    fn drop(&mut self) {
        match self.memory {
            Memory::Allocated(layout) if layout.size() > 0 => {
                // SAFETY: allocated in `big_buffer` with this layout.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) }
            }
            Memory::Allocated(_) => {}
            #[cfg(target_os = "linux")]
            Memory::Mapped((base, size)) => {
                // SAFETY: mapped in `map_huge` with this start and size, and no longer used.
                unsafe { libc::munmap(base as *mut libc::c_void, size) };
            }
        }
    }
}

impl<T: bytemuck::Pod> Lines<T> {
    /// `len` zeros again, in this buffer's memory where it is large enough (else a new
    /// one's): scratch refilled call after call allocates, and faults in pages, only when it
    /// grows. Freed per call instead, attention's buffers had glibc hand their pages back and
    /// fault them in again for every head (a tenth of its time in the kernel).
    pub(crate) fn refill_zeros(&mut self, len: usize) {
        if self.reuse(len) {
            self.fill(T::zeroed());
        }
    }

    /// `len` values in this buffer's memory where it is large enough (else a new one's),
    /// holding whatever was last written there (zeros where nothing was): scratch that its
    /// caller writes whole before it reads it, as a `Vec` resized call after call would be,
    /// but starting on a line. Returns whether the memory was this buffer's (else: all zeros).
    pub(crate) fn reuse(&mut self, len: usize) -> bool {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("buffer size overflows");
        let kept = bytes <= self.bytes;
        if kept {
            self.len = len;
        } else {
            *self = big_buffer(len);
        }
        kept
    }

    /// A copy of `values` that starts on a line.
    pub(crate) fn from_slice(values: &[T]) -> Self {
        let mut lines = big_buffer(values.len());
        lines.copy_from_slice(values);
        lines
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the memory holds `len` values of `T`, all initialised (zeroed, then written
        // through `deref_mut`), aligned to a line.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast(), self.len) }
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), self.len) }
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
            // From 2 MiB on, a mapping of its own that starts on a huge page.
            #[cfg(target_os = "linux")]
            if len * 4 >= HUGE {
                assert_eq!(f.as_ptr() as usize % HUGE, 0, "{len} floats");
            }
            // Refilled: zeros again, in place while it fits, in a new buffer beyond.
            for (refill, same) in [(len / 2, true), (len, true), (len + HUGE, false)] {
                let at = b.as_ptr();
                b.refill_zeros(refill);
                assert_eq!(b.len(), refill);
                assert!(b.iter().all(|v| v.to_bits() == 0), "{len} → {refill}");
                assert_eq!(b.as_ptr() == at, same, "{len} → {refill}");
                b.fill(half::bf16::ONE);
            }
        }
    }
}

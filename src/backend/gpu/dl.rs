//! Vendor libraries opened at run time with `dlopen`, as cudarc opens NVIDIA's: no header or
//! library is needed to build, and a machine without one says what to install. A library's
//! few functions are declared by `library_functions!` with their C signatures.

use std::ffi::{CString, c_void};

/// An opened shared library; the handle stays open for the life of the process.
pub struct Library(*mut c_void);
// SAFETY: the handle is only read (dlsym), which is thread-safe.
unsafe impl Send for Library {}
// SAFETY: as for Send: shared use only reads symbols, which dlsym allows from any thread.
unsafe impl Sync for Library {}

impl Library {
    /// The first of `names` that opens (a bare soname, or a path).
    pub fn open(names: &[&str]) -> Option<Library> {
        names.iter().find_map(|name| {
            let c = CString::new(*name).ok()?;
            // SAFETY: dlopen of a NUL-terminated name.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            (!h.is_null()).then_some(Library(h))
        })
    }

    /// The address of the function `name`.
    pub fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: a valid handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// A stand-in for a vendor library, built from C++ test fixtures (`sources`, in order) with
/// the emulator's C++ compiler (`$CXX`, else `c++`) as `lib{name}.so` in
/// `dir`.
#[cfg(test)]
pub(crate) fn build_stand_in(
    name: &str,
    sources: &[&str],
    dir: &std::path::Path,
) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let (src, lib) = (
        dir.join(format!("{name}.cpp")),
        dir.join(format!("lib{name}.so")),
    );
    std::fs::write(&src, sources.concat()).unwrap();
    let cxx = super::emu::compiler();
    let out = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-fPIC", "-shared", "-o"])
        .args([&lib, &src])
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler `{cxx}`: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

/// [`build_stand_in`] in a folder of its own, opened; the files are removed.
#[cfg(test)]
pub(crate) fn stand_in(name: &str, sources: &[&str]) -> Library {
    let dir = std::env::temp_dir().join(format!("workshop-{name}-{}", std::process::id()));
    let lib = build_stand_in(name, sources, &dir);
    let opened = Library::open(&[lib.to_str().unwrap()]).expect("the stand-in opens");
    std::fs::remove_dir_all(&dir).unwrap();
    opened
}

/// A struct of function pointers, one per C function of a [`Library`], with a `load` that
/// finds them all or names the first one missing:
///
/// ```ignore
/// library_functions! {
///     /// rocBLAS's functions.
///     struct Functions {
///         create: "rocblas_create_handle" => unsafe extern "C" fn(*mut *mut c_void) -> u32,
///     }
/// }
/// ```
///
/// Each signature must be the C function's exactly: `load` trusts it.
macro_rules! library_functions {
    ($(#[$m:meta])* struct $name:ident { $($field:ident: $symbol:literal => $ty:ty,)* }) => {
        $(#[$m])*
        struct $name {
            $($field: $ty,)*
        }

        impl $name {
            /// Find every function in `lib`, or the name of the first one missing.
            fn load(lib: &$crate::backend::gpu::dl::Library) -> Result<Self, &'static str> {
                Ok($name {
                    $($field: {
                        let p = lib.symbol($symbol).ok_or($symbol)?;
                        // SAFETY: the declared signature is the library's (see the macro).
                        unsafe { std::mem::transmute::<*mut std::ffi::c_void, $ty>(p) }
                    },)*
                })
            }
        }
    };
}
pub(crate) use library_functions;

#[cfg(test)]
mod tests {
    use super::*;

    library_functions! {
        /// Two functions every C library on Linux has.
        struct Libc {
            abs: "abs" => unsafe extern "C" fn(i32) -> i32,
            strlen: "strlen" => unsafe extern "C" fn(*const std::ffi::c_char) -> usize,
        }
    }

    library_functions! {
        #[allow(dead_code)]
        struct Missing {
            nothing: "workshop_no_such_function" => unsafe extern "C" fn() -> i32,
        }
    }

    #[test]
    fn functions_load_by_name_or_name_the_missing_one() {
        assert!(Library::open(&["libworkshop-none.so"]).is_none());
        let lib = Library::open(&["libworkshop-none.so", "libc.so.6"]).expect("glibc");
        let f = Libc::load(&lib).unwrap();
        // SAFETY: the C library's functions with their signatures.
        unsafe {
            assert_eq!((f.abs)(-7), 7);
            assert_eq!((f.strlen)(c"four".as_ptr()), 4);
        }
        assert_eq!(Missing::load(&lib).err(), Some("workshop_no_such_function"));
    }
}

//! The `workshop` binary: parse the command line, run it, and turn any error into one clear
//! message (the whole cause chain) and a non-zero exit code.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, which turns a closed pipe (`workshop models | head`) into a panic
    // in println!; the default action ends the process quietly, as for every other CLI tool.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to the default before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    #[cfg(unix)]
    // SAFETY: installing a handler that only calls async-signal-safe functions (an atomic
    // load, write(2), _exit(2)), before any thread starts.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_interrupt as *const () as libc::sighandler_t,
        );
    }
    #[cfg(unix)]
    private_runtime_dir();
    let cli = workshop::cmd::args::Cli::parse();
    match workshop::cmd::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Ctrl-C: say what became of the step that was running (nothing of it is recorded: results
/// are written after a step, by atomic renames), then exit as an interrupted program does.
#[cfg(unix)]
extern "C" fn on_interrupt(_: libc::c_int) {
    use std::sync::atomic::Ordering;
    let msg: &[u8] = if workshop::course::runner::STEP_RUNNING.load(Ordering::SeqCst) {
        b"\ninterrupted: nothing recorded for this step (earlier results are safe)\n"
    } else {
        b"\ninterrupted\n"
    };
    // SAFETY: write(2) and _exit(2) are async-signal-safe; `msg` is a static byte string.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::_exit(130);
    }
}

/// Vulkan's loader and Mesa's drivers connect to a Wayland display while wgpu looks for
/// devices, and libwayland prints `error: XDG_RUNTIME_DIR is invalid or not set` on runs that
/// then succeed. Where the variable is unset or not a directory, point it at a private one
/// (mode 0700, as the specification asks) in the temporary folder, before any thread starts.
#[cfg(unix)]
fn private_runtime_dir() {
    use std::os::unix::fs::DirBuilderExt;
    let current = std::env::var_os("XDG_RUNTIME_DIR").map(std::path::PathBuf::from);
    if current.is_some_and(|d| d.is_absolute() && d.is_dir()) {
        return;
    }
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("workshop-runtime-{uid}"));
    let made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    if made.is_ok() || dir.is_dir() {
        // SAFETY: no other thread exists yet (main's first steps).
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
    }
}

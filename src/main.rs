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
        libc::signal(libc::SIGINT, on_interrupt as *const () as libc::sighandler_t);
    }
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

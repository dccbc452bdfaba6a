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
    let cli = workshop::cmd::args::Cli::parse();
    match workshop::cmd::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

//! The `workshop` binary: parse the command line, run it, and turn any error into one clear
//! message (the whole cause chain) and a non-zero exit code.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = workshop::cli::Cli::parse();
    match workshop::app::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

//! The commands: each file turns one group of parsed command lines ([`args`]) into work for
//! the layers below and prints what comes back, rendered by `report`. This is the only layer
//! that prints, prompts or reads the command line; every failure comes back as an `anyhow`
//! error with the context a user needs to fix it, and `main` prints its whole chain.

pub mod args;
mod bench;
mod compare;
mod course;
mod dev;
mod llm;
mod peak;

use anyhow::Result;

use crate::backend;
use crate::report;
use args::{Cli, Command};

/// Run one parsed command line. The `WORKSHOP_*` settings are checked first: a bad value stops
/// every command with the variable's name and what it accepts.
pub fn run(cli: Cli) -> Result<()> {
    crate::settings::check()?;
    for w in backend::warnings() {
        eprintln!("warning: {w}");
    }
    match cli.command {
        Command::Bench(args) => bench::bench(*args),
        Command::Generate(args) => llm::generate(args),
        Command::Infer(args) => bench::infer(args),
        Command::Models(args) => bench::models(args),
        Command::Weights(args) => bench::weights(args),
        Command::Peak(a) => peak::run(a),
        Command::Gather(a) => compare::gather(a),
        Command::Compare(a) => compare::compare(a),
        Command::Collect(a) => compare::collect(a),
        Command::Init(a) => course::init(a),
        Command::Next(a) => course::next(a),
        Command::Status(a) => course::status(a),
        Command::List(a) => course::list(a),
        Command::Goto(a) => course::goto(a),
        Command::Skip(a) => course::skip(a),
        Command::Hint(a) => course::hint(a),
        Command::Watch(a) => course::watch(a),
        Command::Reset(a) => course::reset(a),
        Command::Run(a) => course::run(a),
        Command::Results(a) => course::results(a),
        Command::Book(a) => course::book(a),
        Command::Dev(c) => dev::run(c),
        Command::Doctor(a) => doctor(a.json),
    }
}

/// `workshop doctor`: this machine and every backend, as text or JSON.
fn doctor(json: bool) -> Result<()> {
    let d = crate::doctor::collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        println!("{}", report::machine::doctor(&d));
    }
    Ok(())
}

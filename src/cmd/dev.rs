//! `workshop dev`, for instructors and kernel authors: lint a course, scaffold an exercise,
//! compile every GPU kernel with every compiler at hand.

use anyhow::{Result, bail};

use super::args::{DevCommand, KernelsCheckArgs};
use crate::course;
use crate::report;

pub fn run(cmd: DevCommand) -> Result<()> {
    match cmd {
        DevCommand::KernelsCheck(a) => kernels_check(a),
        DevCommand::Lint { dir } => {
            let source = super::course::source_of(dir.as_deref());
            let files = course::read_files(&source)?;
            let (exercises, diags) = course::lint::check(&source, &files);
            if diags.is_empty() {
                let steps: usize = exercises.iter().map(|e| e.exercise.steps.len()).sum();
                println!("course OK: {} exercises, {steps} steps", exercises.len());
                Ok(())
            } else {
                for d in &diags {
                    eprintln!("{d}");
                }
                bail!("{} problem(s) in the course", diags.len())
            }
        }
        DevCommand::New { id, dir } => {
            // The id names the exercise's files: nothing but a plain id may pass (issue 27).
            if !crate::files::is_plain_id(&id) {
                bail!(
                    "`{id}` is not an exercise id: use lowercase letters, digits and dashes, like `11-my-exercise`; nothing was written"
                );
            }
            let ex_path = dir.join("exercises").join(format!("{id}.toml"));
            let ch_path = course::book_dir(&dir).join(format!("{id}.md"));
            for p in [&ex_path, &ch_path] {
                if p.exists() {
                    bail!("`{}` already exists; nothing was written", p.display());
                }
            }
            let toml = report::course::scaffold_exercise(&id);
            let chapter = format!(
                "# {id}\n\nWhat this exercise teaches, and why it matters.\n\n```sh\nworkshop next\n```\n"
            );
            crate::files::write_atomic(&ex_path, toml.as_bytes())?;
            crate::files::write_atomic(&ch_path, chapter.as_bytes())?;
            println!(
                "Created {} and {}. Add the chapter to book/src/SUMMARY.md, then check with `workshop dev lint {}`.",
                ex_path.display(),
                ch_path.display(),
                dir.display()
            );
            Ok(())
        }
    }
}

/// `workshop dev kernels-check`.
fn kernels_check(args: KernelsCheckArgs) -> Result<()> {
    use crate::backend::check;
    for r in &args.require {
        if !check::COMPILERS.contains(&r.as_str()) {
            anyhow::bail!("--require takes {}, not `{r}`", check::COMPILERS.join(", "));
        }
    }
    let checks = crate::backend::kernels_check(args.kernels_dir.as_deref());
    println!("{}", report::machine::kernels_check(&checks));
    let failed = checks
        .iter()
        .filter(|c| matches!(c.outcome, check::CompileOutcome::Failed(_)))
        .count();
    let missing: Vec<&str> = checks
        .iter()
        .filter(|c| {
            matches!(c.outcome, check::CompileOutcome::Skipped(_))
                && args.require.iter().any(|r| r == c.compiler)
        })
        .map(|c| c.compiler)
        .collect();
    if failed > 0 {
        anyhow::bail!("{failed} kernel compilation(s) failed (logs above)");
    }
    if !missing.is_empty() {
        anyhow::bail!("required compiler(s) missing: {}", missing.join(", "));
    }
    Ok(())
}

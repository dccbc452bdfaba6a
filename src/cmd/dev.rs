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
            for d in &diags {
                eprintln!("{d}");
            }
            let errors = diags.iter().filter(|d| d.is_error()).count();
            let warnings = match diags.len() - errors {
                0 => String::new(),
                n => format!(" ({n} warning(s) above)"),
            };
            if errors > 0 {
                bail!("{errors} problem(s) in the course{warnings}")
            }
            let steps: usize = exercises.iter().map(|e| e.exercise.steps.len()).sum();
            println!(
                "course OK: {} exercises, {steps} steps{warnings}",
                exercises.len()
            );
            Ok(())
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
            let book = course::book_dir(&dir);
            for folder in [&dir.join("exercises"), &book] {
                std::fs::create_dir_all(folder)
                    .map_err(|e| anyhow::anyhow!("cannot create `{}`: {e}", folder.display()))?;
            }
            crate::files::write_atomic(&ex_path, toml.as_bytes())?;
            crate::files::write_atomic(&ch_path, chapter.as_bytes())?;
            let mut made = vec![ex_path.display().to_string(), ch_path.display().to_string()];
            // A new course gets the book's first page and summary; an existing summary gets
            // the chapter's line.
            let intro = book.join("introduction.md");
            if !intro.exists() {
                let text = "# Introduction\n\nWhat this course teaches, for whom, and what a student needs.\n";
                crate::files::write_atomic(&intro, text.as_bytes())?;
                made.push(intro.display().to_string());
            }
            let summary_path = book.join("SUMMARY.md");
            let summary = match std::fs::read_to_string(&summary_path) {
                Ok(s) => s,
                Err(_) => "# Summary\n\n[Introduction](introduction.md)\n\n".to_string(),
            };
            let entry = format!("- [{id}]({id}.md)\n");
            let sep = if summary.ends_with('\n') { "" } else { "\n" };
            crate::files::write_atomic(&summary_path, format!("{summary}{sep}{entry}").as_bytes())?;
            made.push(format!("{} (the chapter listed)", summary_path.display()));
            println!(
                "Wrote {}. Check the course with `workshop dev lint {}`.",
                made.join(", "),
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
    if let Some(dir) = &args.kernels_dir {
        crate::backend::kernel_files::overrides(dir)?;
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

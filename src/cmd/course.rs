//! The student's commands: init, next, status, list, goto, skip, hint, reset, run, results
//! and book. Each opens (and locks) the workspace, does its work, and saves state and results
//! atomically before returning. [`Terminal`] is the course's [`Ui`] on a terminal: it renders
//! what steps show with `report`, draws progress bars and asks questions.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use super::args::{
    BookArgs, CourseArgs, ExportFormat, GotoArgs, InitArgs, NextArgs, ResetArgs, ResultsArgs,
    RunStepArgs, SkipArgs,
};
use crate::backend::BackendKind;
use crate::course::runner::{earlier, run_step};
use crate::course::schema::StepKind;
use crate::course::state::{self, Attempt, Outcome, Progress, Status, Workspace, now, with_lock};
use crate::course::ui::{Show, Ticker, Ui};
use crate::course::{Course, LoadedExercise, Source};
use crate::report;

fn workspace_dir(c: &CourseArgs) -> PathBuf {
    c.dir.clone().unwrap_or_else(|| PathBuf::from("."))
}

pub(super) fn source_of(course: Option<&Path>) -> Source {
    course.map_or(Source::Embedded, |d| Source::Dir(d.to_path_buf()))
}

fn interactive() -> bool {
    std::io::stdin().is_terminal() && std::io::stdout().is_terminal()
}

/// Open the workspace and its course (`--course`, else the one chosen at init).
fn open(c: &CourseArgs) -> Result<(Workspace, Course)> {
    let ws = Workspace::open(&workspace_dir(c))?;
    let dir = c.course.clone().or_else(|| ws.state.course_dir.clone());
    let course = Course::load(&source_of(dir.as_deref()))?;
    Ok((ws, course))
}

/// The exercise to work on: the one `goto` chose, else the first neither done nor skipped.
fn current<'a>(ws: &Workspace, course: &'a Course) -> Option<&'a LoadedExercise> {
    let open_ex = |id: &str| !matches!(ws.progress(id).status, Status::Done | Status::Skipped);
    if let Some(id) = &ws.state.current
        && let Some(ex) = course.get(id)
        && open_ex(id)
    {
        return Some(ex);
    }
    course.exercises.iter().find(|e| open_ex(e.id()))
}

/// Record an attempt and write state, results.json and results.md.
fn record(ws: &mut Workspace, course: &Course, attempt: Option<Attempt>) -> Result<()> {
    if let Some(a) = attempt {
        ws.results.attempts.push(a);
    }
    ws.save_results_json()?;
    ws.save_state()?;
    let md = report::results::worksheet(ws, course)?;
    crate::files::write_atomic(&state::results_md(&ws.dir), md.as_bytes())
}

/// Where the course will run, checked: `--threads` within bounds, `--device` one the backend
/// has; a backend that cannot run here is said (its steps are recorded as unavailable until
/// the student switches), not refused (issue 27).
fn check_placement(
    (backend, device, threads): (BackendKind, usize, Option<usize>),
) -> Result<Option<String>> {
    match threads.map(|t| (t, crate::bench::within_limit("threads", t))) {
        Some((0, _)) => bail!("--threads must be at least 1 (got 0)"),
        Some((_, Err(why))) => bail!("--threads: {why}"),
        _ => {}
    }
    let switch = "every step will be recorded as unavailable until you switch with `workshop init --backend cpu` (your results stay)";
    let devices = match crate::backend::open(backend) {
        Ok(b) => b.devices(),
        Err(e) => {
            return Ok(Some(format!(
                "the {backend} backend cannot run here ({e}): {switch}"
            )));
        }
    };
    if devices.is_empty() {
        return Ok(Some(format!(
            "the {backend} backend finds no device here: {switch}"
        )));
    }
    if device >= devices.len() {
        bail!(
            "--device {device}: the {backend} backend has {} device(s) here, numbered from 0 (`workshop doctor` lists them)",
            devices.len()
        );
    }
    Ok(None)
}

/// `init` on an existing workspace: switch backend, device or threads, keeping every result.
fn switch_placement(args: &InitArgs, dir: &Path) -> Result<()> {
    if args.name.is_some() {
        bail!(
            "`{}` already holds a workshop workspace: `init` there changes only --backend, --device and --threads, not the name",
            dir.display()
        );
    }
    if args.backend.is_none() && args.device.is_none() && args.threads.is_none() {
        bail!(
            "`{}` already holds a workshop workspace (see `workshop status`); `workshop init --backend KIND` (or --device, --threads) switches where it runs and keeps the results",
            dir.display()
        );
    }
    state::with_workspace_lock(dir, || {
        let (mut ws, course) = open(&args.course)?;
        let s = &ws.state;
        let placement = (
            args.backend.unwrap_or(s.backend),
            args.device.unwrap_or(s.device),
            args.threads.or(s.threads),
        );
        let note = check_placement(placement)?;
        (ws.state.backend, ws.state.device, ws.state.threads) = placement;
        record(&mut ws, &course, None)?;
        if let Some(note) = note {
            eprintln!("note: {note}");
        }
        println!(
            "The course now runs on {} device {}{}; the {} recorded attempt(s) stay in {}.",
            placement.0,
            placement.1,
            placement
                .2
                .map(|t| format!(" with {t} threads"))
                .unwrap_or_default(),
            ws.results.attempts.len(),
            state::results_json(dir).display()
        );
        Ok(())
    })
}

/// The first GPU this machine really has (not a software one, not the emulator): its backend,
/// index and name, for `init` to offer.
fn gpu_here() -> Option<(BackendKind, usize, String)> {
    [BackendKind::Cuda, BackendKind::Hip, BackendKind::Wgpu]
        .into_iter()
        .find_map(|kind| {
            let devices = crate::backend::open(kind).ok()?.devices();
            let (i, d) = (devices.into_iter().enumerate()).find(|(_, d)| !d.is_software())?;
            Some((kind, i, d.name))
        })
}

pub fn init(args: InitArgs) -> Result<()> {
    let dir = workspace_dir(&args.course);
    if state::exists(&dir) {
        return switch_placement(&args, &dir);
    }
    // With no backend named, a GPU here is offered (on a terminal) or pointed out.
    let mut gpu_note = None;
    let chosen = match (args.backend, gpu_here()) {
        (Some(b), _) => Some((b, args.device.unwrap_or(0))),
        (None, Some((kind, i, name))) => {
            let offer = format!("This machine has a GPU: {name} ({kind} device {i}).");
            if interactive()
                && inquire::Confirm::new(&format!("{offer} Run the course on it?"))
                    .with_default(true)
                    .with_help_message("the CPU backend always works; `workshop init --backend cpu` switches later, keeping your results")
                    .prompt()
                    .unwrap_or(false)
            {
                Some((kind, i))
            } else {
                gpu_note = Some(format!(
                    "{offer} The course runs on the CPU backend; `workshop init --backend {kind} --device {i}` moves it to the GPU (your results stay)."
                ));
                None
            }
        }
        (None, None) => None,
    };
    let (backend, device) = chosen.unwrap_or((BackendKind::Cpu, args.device.unwrap_or(0)));
    let placement = (backend, device, args.threads);
    let note = check_placement(placement)?.or(gpu_note);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
    // The course must be sound before a student starts on it.
    Course::load(&source_of(args.course.course.as_deref()))?;
    let name = match args.name {
        Some(n) => n,
        None if interactive() => inquire::Text::new("Your name (for the results file):")
            .prompt()
            .map_err(|e| anyhow::anyhow!("no name given ({e}); nothing was created"))?,
        None => bail!(
            "give your name with `workshop init --name NAME` (there is no terminal to ask on)"
        ),
    };
    if name.trim().is_empty() {
        bail!("the name must not be empty");
    }
    // The name is printed to terminals and written into worksheets and class tables.
    if name.chars().any(char::is_control) || name.chars().count() > 100 {
        bail!(
            "the name must be printable text of at most 100 characters (no control characters or escape sequences)"
        );
    }
    with_lock(&dir, || {
        let course_dir = args
            .course
            .course
            .as_ref()
            .map(|c| std::fs::canonicalize(c).unwrap_or(c.clone()));
        let ws = Workspace::create(&dir, name.trim(), placement, course_dir)?;
        let course = Course::load(&source_of(ws.state.course_dir.as_deref()))?;
        let mut ws = ws;
        record(&mut ws, &course, None)?;
        if let Some(note) = &note {
            eprintln!("note: {note}");
        }
        let dir_flag = dir_flag(&args.course);
        println!(
            "Workspace ready in {} for {} (backend {}). Results go to {}.\nStart with `workshop next{dir_flag}`.",
            dir.display(),
            ws.state.student,
            ws.state.backend,
            state::results_md(&dir).display()
        );
        Ok(())
    })
}

/// ` --dir DIR` where the workspace is not the current folder (every later command needs it),
/// quoted for pasting; nothing otherwise.
fn dir_flag(course: &CourseArgs) -> String {
    match &course.dir {
        Some(d) => {
            let d = d.display().to_string();
            format!(
                " --dir {}",
                shlex::try_quote(&d).unwrap_or(d.as_str().into())
            )
        }
        None => String::new(),
    }
}

pub fn next(args: NextArgs) -> Result<()> {
    let dir = workspace_dir(&args.course);
    if let Some(why) = state::orphan_results(&dir) {
        bail!(
            "{why}: `workshop reset --all --dir {}` moves the files aside (kept as backups), then `workshop init` starts again",
            dir.display()
        );
    }
    if !state::exists(&dir) {
        if interactive()
            && !args.yes
            && inquire::Confirm::new("There is no workspace here. Create one?")
                .with_default(true)
                .prompt()
                .unwrap_or(false)
        {
            init(InitArgs {
                course: args.course.clone(),
                name: None,
                backend: None,
                device: None,
                threads: None,
            })?;
        } else {
            bail!(
                "no workshop workspace in `{}`: run `workshop init --name NAME` there first",
                dir.display()
            );
        }
    }
    with_lock(&dir, || {
        let (mut ws, course) = open(&args.course)?;
        ws.ready_to_run()?;
        let Some(ex) = current(&ws, &course) else {
            println!(
                "{}",
                report::course::course_done(
                    &ws.state.student,
                    &course
                        .exercises
                        .iter()
                        .map(|e| ws.results.tally(e.id()))
                        .sum(),
                    &state::results_md(&dir)
                )
            );
            return Ok(());
        };
        let ex = ex.clone();
        let id = ex.id().to_string();
        let mut progress = ws.progress(&id);
        if progress.status == Status::NotStarted {
            println!("{}", report::course::exercise_header(&ex.exercise));
            let unmet: Vec<&str> = ex
                .exercise
                .requires
                .iter()
                .map(|r| r.get_ref().as_str())
                .filter(|r| !matches!(ws.progress(r).status, Status::Done | Status::Skipped))
                .collect();
            if !unmet.is_empty() {
                println!(
                    "Note: this exercise builds on {} (not done yet); you can go on and come back.",
                    unmet.join(", ")
                );
            }
        }
        let total = ex.exercise.steps.len();
        let step = &ex.exercise.steps[progress.next_step.min(total - 1)];
        println!(
            "{}",
            report::course::step_header(&id, progress.next_step, total, step)
        );
        if interactive()
            && !args.yes
            && args.answer.is_none()
            && step.kind.measures()
            && !inquire::Confirm::new("Run this step now?")
                .with_default(true)
                .prompt()
                .unwrap_or(false)
        {
            println!("Not run. `workshop next` continues from here.");
            return Ok(());
        }
        let mut ui = Terminal {
            interactive: interactive() && !args.yes,
            verbose: args.verbose,
        };
        let attempt = run_shown(&ws, &course, &id, step, args.answer.as_deref(), &mut ui)?;
        // A kernel step is rustlings' exercise: it stays current until the kernel passes.
        let stays = step.kind == StepKind::Kernel
            && !matches!(attempt.outcome, Outcome::Pass | Outcome::Unavailable);
        if !stays {
            progress.next_step += 1;
        }
        progress.status = if progress.next_step >= total {
            Status::Done
        } else {
            Status::InProgress
        };
        ws.move_to(&id, progress.clone());
        let attempt = Attempt {
            progress: Some(progress.clone()),
            ..attempt
        };
        record(&mut ws, &course, Some(attempt))?;
        let upcoming = if progress.status == Status::Done {
            current(&ws, &course).map(|e| format!("{} — {}", e.id(), e.exercise.title))
        } else {
            Some(format!("{id} step {} of {total}", progress.next_step + 1))
        };
        match stays {
            true => println!("{}", report::course::kernel_again(step)),
            false => println!(
                "{}",
                report::course::what_next(
                    &id,
                    progress.status == Status::Done,
                    upcoming.as_deref(),
                    &dir_flag(&args.course)
                )
            ),
        }
        Ok(())
    })
}

/// Run `step` of exercise `id` and print its verdicts.
fn run_shown(
    ws: &Workspace,
    course: &Course,
    id: &str,
    step: &crate::course::schema::Step,
    answer: Option<&str>,
    ui: &mut Terminal,
) -> Result<Attempt> {
    let attempt = run_step(ws, &course.source, id, step, &earlier(ws, id), answer, ui)?;
    println!("{}", report::course::attempt_verdicts(&attempt));
    Ok(attempt)
}

/// `workshop watch`: run the current kernel step now and again each time its file is saved,
/// until it passes or the current step is another kind.
pub fn watch(c: CourseArgs) -> Result<()> {
    let dir = workspace_dir(&c);
    loop {
        let (ws, course) = open(&c)?;
        let Some(ex) = current(&ws, &course) else {
            println!("Every exercise is done or skipped: there is nothing to watch.");
            return Ok(());
        };
        let progress = ws.progress(ex.id());
        let steps = &ex.exercise.steps;
        let index = progress.next_step.min(steps.len() - 1);
        let step = &steps[index];
        let Some(spec) = step
            .kernel
            .as_ref()
            .filter(|_| progress.status != Status::Done)
        else {
            bail!(
                "the current step ({} step {} of {}, `{}`) is not a kernel step: `workshop watch` checks a kernel each time you save it; `workshop next` runs this step",
                ex.id(),
                index + 1,
                steps.len(),
                step.id.get_ref()
            );
        };
        let file = crate::course::steps::kernel::KernelFiles::of(&dir, &spec.get_ref().file)?.yours;
        let before = (ex.id().to_string(), index);
        // The file as this check reads it: a save while the check runs is a change to check
        // again, not the state to wait from (the stamp taken after the check missed it).
        let checked = stamp(&file);
        next(NextArgs {
            course: c.clone(),
            yes: true,
            answer: None,
            verbose: false,
        })?;
        let (ws, course) = open(&c)?;
        let now =
            current(&ws, &course).map(|e| (e.id().to_string(), ws.progress(e.id()).next_step));
        if now.as_ref() != Some(&before) {
            return Ok(());
        }
        println!(
            "Watching {} — save it to check again (Ctrl-C stops).",
            file.display()
        );
        wait_for_change(&file, checked);
    }
}

/// What tells a save of `file` from the last: its length and modification time (an editor
/// that saves by renaming a new file over it changes them too).
type Stamp = Option<(u64, Option<std::time::SystemTime>)>;

fn stamp(file: &Path) -> Stamp {
    std::fs::metadata(file)
        .ok()
        .map(|m| (m.len(), m.modified().ok()))
}

/// Block until `file` differs from `seen` (at once where it already does), then a moment more
/// so that a save in several writes is read whole.
fn wait_for_change(file: &Path, seen: Stamp) {
    while stamp(file) == seen {
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
}

pub fn status(c: CourseArgs) -> Result<()> {
    let (ws, course) = open(&c)?;
    let rows: Vec<report::course::StatusRow> = course
        .exercises
        .iter()
        .map(|e| {
            let p = ws.progress(e.id());
            report::course::StatusRow {
                id: e.id().to_string(),
                title: e.exercise.title.clone(),
                status: p.status,
                steps_done: p.next_step.min(e.exercise.steps.len()),
                steps: e.exercise.steps.len(),
                tally: ws.results.tally(e.id()),
            }
        })
        .collect();
    let cur = current(&ws, &course).map(|e| e.id().to_string());
    println!(
        "{}",
        report::course::status(&ws.state, &rows, cur.as_deref())
    );
    Ok(())
}

pub fn list(c: CourseArgs) -> Result<()> {
    let dir = workspace_dir(&c);
    let (ws, course) = if state::exists(&dir) {
        let (ws, course) = open(&c)?;
        (Some(ws), course)
    } else {
        (None, Course::load(&source_of(c.course.as_deref()))?)
    };
    let rows: Vec<(String, String, String, String)> = course
        .exercises
        .iter()
        .map(|e| {
            let status = ws
                .as_ref()
                .map_or(Status::NotStarted, |w| w.progress(e.id()).status);
            (
                e.id().to_string(),
                e.exercise.title.clone(),
                report::course::status_word(status).to_string(),
                e.exercise.summary.clone(),
            )
        })
        .collect();
    println!("{}", report::course::exercise_list(&rows));
    Ok(())
}

pub fn goto(args: GotoArgs) -> Result<()> {
    let dir = workspace_dir(&args.course);
    state::with_workspace_lock(&dir, || {
        let (mut ws, course) = open(&args.course)?;
        let ex = course.find(&args.id)?;
        let id = ex.id().to_string();
        let mut p = ws.progress(&id);
        if matches!(p.status, Status::Done | Status::Skipped) {
            p = Progress {
                status: Status::InProgress,
                next_step: 0,
            };
        }
        let title = ex.exercise.title.clone();
        ws.set_progress(&id, p);
        ws.state.current = Some(id.clone());
        record(&mut ws, &course, None)?;
        println!("Now on {id} — {title}. `workshop next` runs its next step.");
        Ok(())
    })
}

pub fn skip(args: SkipArgs) -> Result<()> {
    let dir = workspace_dir(&args.course);
    state::with_workspace_lock(&dir, || {
        let (mut ws, course) = open(&args.course)?;
        let ex = match &args.id {
            Some(id) => course.find(id)?,
            None => {
                current(&ws, &course).context("nothing left to skip: the course is complete")?
            }
        }
        .clone();
        let id = ex.id().to_string();
        let p = ws.progress(&id);
        let skipped = Progress {
            status: Status::Skipped,
            next_step: ex.exercise.steps.len(),
        };
        // Steps run before (a `goto` back, then `skip`) keep their results on the worksheet.
        let ran: Vec<String> = (ws.results.latest(&id).iter())
            .filter(|a| a.outcome != Outcome::Skipped)
            .map(|a| a.step.clone())
            .collect();
        let untouched =
            (ex.exercise.steps.iter().skip(p.next_step)).filter(|s| !ran.contains(s.id.get_ref()));
        for step in untouched {
            ws.results.attempts.push(Attempt {
                exercise: id.clone(),
                step: step.id.get_ref().clone(),
                kind: step.kind,
                outcome: Outcome::Skipped,
                metrics: BTreeMap::new(),
                table: None,
                checks: vec![],
                answer: None,
                note: Some("skipped by the student".into()),
                environment: BTreeMap::new(),
                started: now(),
                finished: now(),
                progress: Some(skipped.clone()),
            });
        }
        ws.move_to(&id, skipped);
        record(&mut ws, &course, None)?;
        let upcoming = current(&ws, &course).map(|e| format!("{} — {}", e.id(), e.exercise.title));
        println!(
            "Skipped {id} (recorded as skipped; `workshop goto {id}` brings it back). Next: {}",
            upcoming.unwrap_or_else(|| "nothing — the course is complete".into())
        );
        Ok(())
    })
}

pub fn hint(c: CourseArgs) -> Result<()> {
    let (ws, course) = open(&c)?;
    let Some(ex) = current(&ws, &course) else {
        println!("The course is complete: no hints needed.");
        return Ok(());
    };
    let p = ws.progress(ex.id());
    let mut said = false;
    // Hints of the expectations that failed in the last step run come first.
    if let Some(a) = ws
        .results
        .attempts
        .iter()
        .rev()
        .find(|a| a.outcome != Outcome::Skipped)
    {
        for check in a.checks.iter().filter(|c| c.hint.is_some()) {
            println!(
                "{}.{}: `{}` — {}",
                a.exercise,
                a.step,
                check.what,
                check.hint.as_deref().unwrap_or_default()
            );
            said = true;
        }
    }
    if let Some(step) = ex.exercise.steps.get(p.next_step)
        && let Some(h) = &step.hint
    {
        println!("{}.{}: {h}", ex.id(), step.id.get_ref());
        said = true;
    }
    if !said {
        println!(
            "No hint for this step; its chapter explains it: `workshop book {}`.",
            ex.id()
        );
    }
    Ok(())
}

pub fn reset(args: ResetArgs) -> Result<()> {
    let dir = workspace_dir(&args.course);
    if args.all {
        if ![state::results_json(&dir), state::results_md(&dir)]
            .iter()
            .any(|p| p.exists())
            && !state::exists(&dir)
        {
            bail!(
                "no workshop workspace in `{}`: nothing to reset",
                dir.display()
            );
        }
        if !args.yes
            && interactive()
            && !inquire::Confirm::new("Start over? Your state and results move aside as backups.")
                .with_default(false)
                .prompt()
                .unwrap_or(false)
        {
            println!("Nothing reset.");
            return Ok(());
        }
        // Works on a damaged workspace too: nothing is parsed, files are moved aside.
        return with_lock(&dir, || {
            let kept = state::reset_all(&dir)?;
            for k in &kept {
                println!("kept {}", k.display());
            }
            println!("Workspace reset. Run `workshop init` to start again.");
            Ok(())
        });
    }
    let id = args.id.clone().context("give an exercise id, or --all")?;
    state::with_workspace_lock(&dir, || {
        let (mut ws, course) = open(&args.course)?;
        let id = course.find(&id)?.id().to_string();
        ws.state.exercises.remove(&id);
        if ws.state.current.as_deref() == Some(id.as_str()) {
            ws.state.current = None;
        }
        record(&mut ws, &course, None)?;
        println!("{id} starts over at its first step (earlier attempts stay in results.json).");
        Ok(())
    })
}

pub fn run(args: RunStepArgs) -> Result<()> {
    let dir = workspace_dir(&args.course);
    state::with_workspace_lock(&dir, || {
        let (mut ws, course) = open(&args.course)?;
        ws.ready_to_run()?;
        let (id, step_id) = match args.target.split_once('.') {
            Some((e, s)) => (e.to_string(), Some(s.to_string())),
            None => (args.target.clone(), None),
        };
        let ex = course.find(&id)?.clone();
        let id = ex.id().to_string();
        let steps: Vec<_> = match &step_id {
            Some(s) => vec![
                ex.exercise
                    .steps
                    .iter()
                    .find(|st| st.id.get_ref() == s)
                    .with_context(|| {
                        let ids: Vec<&str> = ex
                            .exercise
                            .steps
                            .iter()
                            .map(|st| st.id.get_ref().as_str())
                            .collect();
                        format!("{id} has no step `{s}`; its steps: {}", ids.join(", "))
                    })?,
            ],
            None => ex.exercise.steps.iter().collect(),
        };
        let total = ex.exercise.steps.len();
        for step in steps {
            let index = ex
                .exercise
                .steps
                .iter()
                .position(|s| s.id.get_ref() == step.id.get_ref())
                .unwrap_or(0);
            println!("{}", report::course::step_header(&id, index, total, step));
            let mut ui = Terminal {
                interactive: interactive(),
                verbose: args.verbose,
            };
            let attempt = run_shown(&ws, &course, &id, step, args.answer.as_deref(), &mut ui)?;
            // Saved after every step: a later failure keeps what was measured.
            record(&mut ws, &course, Some(attempt))?;
        }
        Ok(())
    })
}

pub fn results(args: ResultsArgs) -> Result<()> {
    let (ws, course) = open(&args.course)?;
    match args.export {
        None => print!("{}", report::results::worksheet(&ws, &course)?),
        Some(ExportFormat::Json) => println!("{}", serde_json::to_string_pretty(&ws.results)?),
        Some(ExportFormat::Csv) => print!("{}", report::course::results_csv(&ws.results)),
    }
    Ok(())
}

pub fn book(args: BookArgs) -> Result<()> {
    let dir = workspace_dir(&args.course);
    let (ws, course) = if state::exists(&dir) {
        let (ws, course) = open(&args.course)?;
        (Some(ws), course)
    } else {
        (
            None,
            Course::load(&source_of(args.course.course.as_deref()))?,
        )
    };
    if let Some(out) = &args.html {
        let index = crate::course::book::render_html(&course, out)?;
        println!("The book is in {}: open {}", out.display(), index.display());
        if args.open {
            open_in_browser(&index);
        }
        return Ok(());
    }
    let page = match args.id.as_deref() {
        Some("introduction") => "introduction.md".to_string(),
        Some(id) => course
            .find(id)
            .map_err(|e| anyhow::anyhow!("{e} (or `introduction`)"))?
            .exercise
            .chapter
            .get_ref()
            .clone(),
        None => ws.as_ref().and_then(|w| current(w, &course)).map_or_else(
            || "introduction.md".to_string(),
            |e| e.exercise.chapter.get_ref().clone(),
        ),
    };
    let text = course
        .chapter(&page)
        .with_context(|| format!("the book has no page `{page}`"))?;
    // On a terminal: rendered and paged; to a pipe or a file: the Markdown as written.
    if std::io::stdout().is_terminal() {
        let width = textwrap::termwidth().clamp(40, 100);
        page_through(&report::markdown(&text, width));
    } else {
        println!("{text}");
    }
    Ok(())
}

/// Open `page` in the web browser the desktop chooses; a machine without one says so.
fn open_in_browser(page: &Path) {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    let opened = std::process::Command::new(opener)
        .arg(page)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    if !opened.is_ok_and(|s| s.success()) {
        eprintln!(
            "Could not open a web browser here (`{opener}`): open {} yourself.",
            page.display()
        );
    }
}

/// Show `text` through the reader's pager (`$PAGER`, else `less -FRX`: it quits at once when
/// the text fits the screen and keeps colours), or print it where there is none.
fn page_through(text: &str) {
    use std::io::Write as _;
    let pager = std::env::var("PAGER")
        .ok()
        .filter(|p| !p.trim().is_empty())
        .unwrap_or_else(|| "less -FRX".into());
    let words = shlex::split(&pager).unwrap_or_default();
    let child = words.split_first().and_then(|(program, args)| {
        std::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .ok()
    });
    match child {
        Some(mut c) => {
            // A reader who quits early closes the pipe: not an error.
            if let Some(mut input) = c.stdin.take() {
                let _ = input.write_all(text.as_bytes());
            }
            let _ = c.wait();
        }
        None => println!("{text}"),
    }
}

/// The course's [`Ui`] on a terminal (or a pipe: progress bars hide themselves, questions
/// need `--answer`).
struct Terminal {
    /// A student can answer prompts.
    interactive: bool,
    /// Profiles whole rather than summarised.
    verbose: bool,
}

/// A progress bar on stderr, cleared when dropped.
struct Bar(ProgressBar);

impl Ticker for Bar {
    fn tick(&mut self) {
        self.0.inc(1);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

impl Ui for Terminal {
    fn show(&mut self, what: Show<'_>) {
        let text = match what {
            Show::Doctor(d) => report::machine::doctor(d),
            Show::Config(c) => report::bench::step_config(c),
            Show::Summary(r) => report::bench::summary(r),
            Show::Multi(m) => report::bench::multi(m),
            Show::Profile {
                record,
                flops,
                top,
                depth,
                kernels,
                full,
            } => {
                let ops = (record.profile.as_ref())
                    .map(|p| format!("{}\n", report::profile::profile(record, p, top)));
                let whole = format!(
                    "{}{}",
                    ops.unwrap_or_default(),
                    report::profile::flops_profile(flops, Some(depth), top)
                );
                // The whole profile is kept; the screen gets it with --verbose, else a summary.
                let kept = match crate::files::write_atomic(full, whole.as_bytes()) {
                    Ok(()) => full.display().to_string(),
                    Err(e) => format!("not saved ({e:#}): re-run with --verbose to see it"),
                };
                match self.verbose {
                    true => format!("{whole}\nSaved to {kept}"),
                    false => report::profile::course_summary(record, flops, (top, kernels), &kept),
                }
            }
            Show::Comparison { comparison, chart } => {
                // The comparison stands without its picture (a machine without fonts).
                let drawn = match report::charts::comparison(comparison, chart) {
                    Ok(()) => format!("Drew {} (open it in a browser)", chart.display()),
                    Err(e) => format!("No chart: {e:#}"),
                };
                format!("{}\n{drawn}", report::compare::comparison(comparison))
            }
            Show::Table(t) => report::course::table(t),
            Show::Peak {
                gemm,
                bandwidth,
                ceiling,
            } => format!(
                "{}\n{}",
                report::machine::peak(gemm, bandwidth),
                report::machine::ceiling(gemm, ceiling)
            ),
            Show::Line(line) => line,
        };
        // Every line that is wider than the terminal wraps onto indented continuation lines
        // (tables are laid out to the width already).
        println!("{}", report::lines_for_terminal(&text));
    }

    fn progress(&mut self, label: &str, total: u64) -> Box<dyn Ticker> {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("  {spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed})")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_message(label.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Box::new(Bar(bar))
    }

    fn choose(&mut self, prompt: &str, choices: &[String]) -> Option<Result<String>> {
        self.interactive.then(|| {
            inquire::Select::new(prompt, choices.to_vec())
                .prompt()
                .map_err(|e| anyhow::anyhow!("no answer given ({e}); nothing was recorded"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A save that lands while a check runs (after the stamp it checked, before watch waits
    /// again) ends the wait at once: `workshop watch` once took its stamp after the check and
    /// waited for a save that had already happened.
    #[test]
    fn a_save_during_the_check_is_not_missed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kernel.wgsl");
        std::fs::write(&file, "fn a() {}").unwrap();
        let checked = stamp(&file);
        std::fs::write(&file, "fn a() { let b = 1; }").unwrap();
        let (done, wait) = std::sync::mpsc::channel();
        let watched = file.clone();
        std::thread::spawn(move || {
            wait_for_change(&watched, checked);
            done.send(()).unwrap();
        });
        let waited = wait.recv_timeout(std::time::Duration::from_secs(30));
        assert!(waited.is_ok(), "the save before the wait was missed");
        // Nothing saved since: the wait goes on.
        let (done, wait) = std::sync::mpsc::channel();
        let now = stamp(&file);
        std::thread::spawn(move || {
            wait_for_change(&file, now);
            let _ = done.send(());
        });
        let waited = wait.recv_timeout(std::time::Duration::from_millis(800));
        assert!(waited.is_err(), "the wait ended with nothing saved");
    }
}

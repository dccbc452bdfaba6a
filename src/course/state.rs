//! A student's workspace: `.workshop/state.json` (where they are in the course), the results
//! (`results.json`, every attempt, and `results.md`, the worksheet rendered from it), and the
//! lock that keeps two commands from writing at once. Every write is atomic, so Ctrl-C or a
//! killed run never leaves a half-written file and never loses what was recorded before.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::expect::Check;
use crate::backend::BackendKind;
use crate::files::write_atomic;

pub const STATE_SCHEMA: u32 = 1;
pub const RESULTS_SCHEMA: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    NotStarted,
    InProgress,
    Done,
    Skipped,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub status: Status,
    /// Index of the next step to run.
    pub next_step: usize,
}

/// Where the student is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub schema_version: u32,
    pub student: String,
    /// RFC 3339.
    pub created: String,
    pub backend: BackendKind,
    pub device: usize,
    pub threads: Option<usize>,
    /// The course directory given at `init` (`None`: the course embedded in the binary).
    #[serde(default)]
    pub course_dir: Option<PathBuf>,
    /// Exercise `goto` pointed at, if any; otherwise the first unfinished one is current.
    pub current: Option<String>,
    #[serde(default)]
    pub exercises: BTreeMap<String, Progress>,
    /// How many attempts of results.json this state accounts for. results.json is written
    /// first, then this file: attempts past this count were recorded by a command killed
    /// between the two writes, and [`Workspace::open`] replays their progress (issue 27: the
    /// step used to run again and be recorded twice). `None` in states older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<usize>,
}

/// The outcome of one step run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Every expectation passed (or there were none).
    Pass,
    /// At least one expectation failed.
    Fail,
    /// Nothing failed, but something could not be judged.
    Inconclusive,
    /// Skipped by the student.
    Skipped,
    /// This build or machine cannot run the step; said plainly, never faked.
    Unavailable,
}

/// A table a step produced (a sweep), for the results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultTable {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// One attempt at one step: what was measured, what was expected, where and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub exercise: String,
    pub step: String,
    pub kind: super::schema::StepKind,
    pub outcome: Outcome,
    /// Non-finite values (a ratio over a zero) are written as `"NaN"`, `"inf"`, `"-inf"`, which
    /// JSON has no numbers for (see [`finite_or_named`]).
    #[serde(with = "finite_or_named")]
    pub metrics: BTreeMap<String, f64>,
    pub table: Option<ResultTable>,
    pub checks: Vec<Check>,
    pub answer: Option<String>,
    /// Why the step is unavailable or was skipped.
    pub note: Option<String>,
    /// Environment fingerprint: device, backend, kernel version, CPU, OS.
    pub environment: BTreeMap<String, String>,
    pub started: String,
    pub finished: String,
    /// Where recording this attempt moved its exercise (`next` and `skip` move on; `run`
    /// measures again without moving): what is replayed when the state was not written after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub schema_version: u32,
    pub student: String,
    pub attempts: Vec<Attempt>,
}

/// How the latest attempts of some steps came out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    pub passed: usize,
    pub failed: usize,
    pub inconclusive: usize,
    pub unavailable: usize,
    pub skipped: usize,
    /// `EXERCISE.STEP` of each failed step, to re-run.
    pub failed_steps: Vec<String>,
}

impl Tally {
    /// `5 passed, 1 failed, 1 inconclusive` (the counts that are not zero), or `no steps run`.
    pub fn summary(&self) -> String {
        let counts = [
            (self.passed, "passed"),
            (self.failed, "failed"),
            (self.inconclusive, "inconclusive"),
            (self.unavailable, "unavailable"),
            (self.skipped, "skipped"),
        ];
        crate::units::nonzero_counts(&counts, "no steps run")
    }

    fn add(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.inconclusive += other.inconclusive;
        self.unavailable += other.unavailable;
        self.skipped += other.skipped;
        self.failed_steps.extend(other.failed_steps);
    }
}

impl std::iter::Sum for Tally {
    fn sum<I: Iterator<Item = Tally>>(tallies: I) -> Tally {
        let mut all = Tally::default();
        tallies.for_each(|t| all.add(t));
        all
    }
}

impl Results {
    /// How the latest attempt of each step of `exercise` came out.
    pub fn tally(&self, exercise: &str) -> Tally {
        let mut t = Tally::default();
        for a in self.latest(exercise) {
            match a.outcome {
                Outcome::Pass => t.passed += 1,
                Outcome::Fail => {
                    t.failed += 1;
                    t.failed_steps.push(format!("{}.{}", a.exercise, a.step));
                }
                Outcome::Inconclusive => t.inconclusive += 1,
                Outcome::Unavailable => t.unavailable += 1,
                Outcome::Skipped => t.skipped += 1,
            }
        }
        t
    }

    /// The latest attempt of each step of an exercise, in step order of first appearance.
    pub fn latest(&self, exercise: &str) -> Vec<&Attempt> {
        let mut out: Vec<&Attempt> = Vec::new();
        for a in self.attempts.iter().filter(|a| a.exercise == exercise) {
            match out.iter_mut().find(|b| b.step == a.step) {
                Some(slot) => *slot = a,
                None => out.push(a),
            }
        }
        out
    }
}

/// An open, locked workspace.
pub struct Workspace {
    pub dir: PathBuf,
    pub state: State,
    pub results: Results,
}

pub fn state_dir(dir: &Path) -> PathBuf {
    dir.join(".workshop")
}

fn state_path(dir: &Path) -> PathBuf {
    state_dir(dir).join("state.json")
}

pub fn results_json(dir: &Path) -> PathBuf {
    dir.join("results.json")
}

pub fn results_md(dir: &Path) -> PathBuf {
    dir.join("results.md")
}

/// Why `dir`'s results.json must not be replaced, when it is there without a workspace state:
/// it holds attempts, or cannot be read to tell.
pub fn orphan_results(dir: &Path) -> Option<String> {
    let path = results_json(dir);
    if exists(dir) || !path.exists() {
        return None;
    }
    let held = crate::files::read_text(&path)
        .ok()
        .and_then(|t| serde_json::from_str::<Results>(&t).ok())
        .map(|r| r.attempts.len());
    match held {
        Some(0) => None,
        Some(n) => Some(format!(
            "`{}` holds {n} recorded attempt(s) but there is no workspace state (.workshop/state.json)",
            path.display()
        )),
        None => Some(format!(
            "`{}` is there but cannot be read as results, and there is no workspace state",
            path.display()
        )),
    }
}

pub fn exists(dir: &Path) -> bool {
    state_path(dir).exists()
}

pub fn now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// Run `f` with the workspace in `dir` locked for writing.
pub fn with_lock<T>(dir: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let sd = state_dir(dir);
    std::fs::create_dir_all(&sd).with_context(|| format!("cannot create `{}`", sd.display()))?;
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(sd.join("lock"))
        .with_context(|| format!("cannot open the lock file in `{}`", sd.display()))?;
    let mut lock = fd_lock::RwLock::new(file);
    let _guard = lock.try_write().map_err(|_| {
        anyhow::anyhow!(
            "another workshop command is running in `{}`; wait for it to finish",
            dir.display()
        )
    })?;
    f()
}

/// [`with_lock`] on a workspace that must already be there: outside one, say so and create
/// nothing (issue 27: `goto` outside a workspace used to leave a `.workshop/lock` behind).
pub fn with_workspace_lock<T>(dir: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !exists(dir) {
        bail!(
            "no workshop workspace in `{}`: run `workshop init --name NAME` there first",
            dir.display()
        );
    }
    with_lock(dir, f)
}

impl Workspace {
    /// Create a new workspace (state and empty results) in `dir`.
    pub fn create(
        dir: &Path,
        student: &str,
        (backend, device, threads): (BackendKind, usize, Option<usize>),
        course_dir: Option<PathBuf>,
    ) -> Result<Workspace> {
        if exists(dir) {
            bail!(
                "`{}` already holds a workshop workspace (student: see `workshop status`)",
                dir.display()
            );
        }
        // A results file without its state (the state folder deleted, a copied worksheet):
        // never replace recorded attempts (issue 27).
        if let Some(why) = orphan_results(dir) {
            bail!(
                "{why}; `init` would replace them: `workshop reset --all` moves them aside (kept as a backup), then run `init` again"
            );
        }
        let state = State {
            schema_version: STATE_SCHEMA,
            student: student.to_string(),
            created: now(),
            backend,
            device,
            threads,
            course_dir,
            current: None,
            exercises: BTreeMap::new(),
            recorded: Some(0),
        };
        let results = Results {
            schema_version: RESULTS_SCHEMA,
            student: student.to_string(),
            attempts: Vec::new(),
        };
        let mut ws = Workspace {
            dir: dir.to_path_buf(),
            state,
            results,
        };
        ws.save_results_json()?;
        ws.save_state()?;
        Ok(ws)
    }

    /// Open the workspace in `dir`; a damaged file is a clear error with a way out.
    pub fn open(dir: &Path) -> Result<Workspace> {
        if !exists(dir) {
            bail!(
                "no workshop workspace in `{}`: run `workshop init --name NAME` there first",
                dir.display()
            );
        }
        let state: State = read_json(&state_path(dir))?;
        if state.schema_version != STATE_SCHEMA {
            bail!(
                "`{}` has schema_version {}, this build reads {STATE_SCHEMA}; run `workshop reset --all` to start over (a backup is kept)",
                state_path(dir).display(),
                state.schema_version
            );
        }
        let rp = results_json(dir);
        let results = if rp.exists() {
            read_json(&rp)?
        } else {
            Results {
                schema_version: RESULTS_SCHEMA,
                student: state.student.clone(),
                attempts: Vec::new(),
            }
        };
        let mut ws = Workspace {
            dir: dir.to_path_buf(),
            state,
            results,
        };
        ws.replay_unaccounted();
        Ok(ws)
    }

    /// Bring the state up to date with attempts recorded after it was last written (a command
    /// killed between writing results.json and state.json). Only in memory: the next command
    /// that records writes it.
    fn replay_unaccounted(&mut self) {
        let Some(recorded) = self.state.recorded else {
            return;
        };
        let unaccounted: Vec<(String, Progress)> = (self.results.attempts.iter().skip(recorded))
            .filter_map(|a| a.progress.clone().map(|p| (a.exercise.clone(), p)))
            .collect();
        for (exercise, progress) in unaccounted {
            self.move_to(&exercise, progress);
        }
    }

    /// Set an exercise's progress; one that is finished (done or skipped) stops being the
    /// exercise `goto` chose.
    pub fn move_to(&mut self, exercise: &str, progress: Progress) {
        let finished = matches!(progress.status, Status::Done | Status::Skipped);
        if finished && self.state.current.as_deref() == Some(exercise) {
            self.state.current = None;
        }
        self.set_progress(exercise, progress);
    }

    /// Check, before a step runs, that it can run and what it records can be written: the
    /// state's settings are usable (a hand-edited `threads = 0` is blamed on the state, not on
    /// a flag nobody passed), and the workspace and its state folder take new files and have
    /// room for the results again plus a megabyte (records and charts). Run first by the
    /// commands that measure, so a read-only or full workspace fails in a second, not after
    /// minutes of measuring (issue 27).
    pub fn ready_to_run(&self) -> Result<()> {
        if let Some(t) = self.state.threads
            && (t == 0 || crate::bench::within_limit("threads", t).is_err())
        {
            bail!(
                "`{}` says threads = {t}, which is no usable number of worker threads (1 to 4096): `workshop init --threads N` sets it",
                state_path(&self.dir).display()
            );
        }
        let size = |p: PathBuf| std::fs::metadata(p).map_or(0, |m| m.len() as usize);
        let results = size(results_json(&self.dir)) + size(results_md(&self.dir));
        crate::files::check_room(&self.dir, results.saturating_add(1 << 20))
            .and_then(|_| crate::files::check_room(&state_dir(&self.dir), size(state_path(&self.dir))))
            .context("nothing was run: the step's results could not be recorded (make the workspace writable, or free some space)")
    }

    /// Write the state, saying it accounts for every attempt in memory (write results.json
    /// first: see [`State::recorded`]).
    pub fn save_state(&mut self) -> Result<()> {
        self.state.recorded = Some(self.results.attempts.len());
        write_atomic(
            &state_path(&self.dir),
            serde_json::to_string_pretty(&self.state)?.as_bytes(),
        )
    }

    pub fn save_results_json(&self) -> Result<()> {
        write_atomic(
            &results_json(&self.dir),
            serde_json::to_string_pretty(&self.results)?.as_bytes(),
        )
    }

    pub fn progress(&self, id: &str) -> Progress {
        self.state.exercises.get(id).cloned().unwrap_or(Progress {
            status: Status::NotStarted,
            next_step: 0,
        })
    }

    pub fn set_progress(&mut self, id: &str, p: Progress) {
        self.state.exercises.insert(id.to_string(), p);
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = crate::files::read_text(path)?;
    serde_json::from_str(&text).map_err(|e| {
        anyhow::anyhow!(
            "`{}` is damaged ({e}); fix it by hand or run `workshop reset --all` to start over (a backup is kept)",
            path.display()
        )
    })
}

/// Move the state and results aside (as `*.bak-<time>`), keeping them as a backup.
pub fn reset_all(dir: &Path) -> Result<Vec<PathBuf>> {
    // Readable (UTC date and time) and never reused: a second reset within the same second
    // gets a counter instead of overwriting the first one's backups (issue 27).
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace(':', "-");
    let mut kept = Vec::new();
    for p in [state_path(dir), results_json(dir), results_md(dir)] {
        if p.exists() {
            let name = |n: usize| match n {
                1 => PathBuf::from(format!("{}.bak-{stamp}", p.display())),
                n => PathBuf::from(format!("{}.bak-{stamp}-{n}", p.display())),
            };
            let bak = (1..).map(name).find(|b| !b.exists()).expect("a free name");
            std::fs::rename(&p, &bak)
                .with_context(|| format!("cannot move `{}` aside", p.display()))?;
            kept.push(bak);
        }
    }
    Ok(kept)
}

/// f64 metrics in JSON, where NaN and ±∞ have no number: written as the strings `"NaN"`,
/// `"inf"` and `"-inf"`, read back from those (and from the `null` that older versions wrote for
/// them), so a result file always reads back (issue 27).
pub mod finite_or_named {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::units::named_float::Repr;

    pub fn serialize<S: Serializer>(m: &BTreeMap<String, f64>, s: S) -> Result<S::Ok, S::Error> {
        let m: BTreeMap<&String, Repr> = m.iter().map(|(k, &v)| (k, Repr::from(v))).collect();
        m.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
        let m = BTreeMap::<String, Repr>::deserialize(d)?;
        m.into_iter()
            .map(|(k, v)| {
                let v = v
                    .value()
                    .map_err(|e| serde::de::Error::custom(format!("metric `{k}`: {e}")))?;
                Ok((k, v))
            })
            .collect()
    }
}

//! Files that outlive a process: writing someone's work atomically (to a temporary file beside
//! the target, flushed to disk, then renamed over it, so a crash or Ctrl-C leaves either the
//! old file or the new one), and the stable hash that names cached files.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// Whether `path` can take what a command will write there, asked before the work starts (a
/// long run must not end in "cannot write"): a regular file or a new one, a device such as
/// `/dev/null`, or a link to one of those; not a folder, a FIFO or a socket.
pub fn check_destination(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            anyhow::bail!("`{}` is a folder, not a file to write", path.display())
        }
        Ok(m) if !m.is_file() && !is_device(&m) => anyhow::bail!(
            "`{}` is {}, not a regular file or a device: refusing to write there",
            path.display(),
            kind_of(&m)
        ),
        _ => Ok(()),
    }
}

/// What a path that is not a regular file is, for messages ("`x` is a FIFO, not ...").
pub fn kind_of(m: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = m.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
    }
    if m.is_dir() {
        "a folder"
    } else if m.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// The largest text file read ([`read_text`]): records, caches, course files and results are
/// kilobytes to a few megabytes.
pub const MAX_TEXT: u64 = 256 << 20;

/// Read a text file a user or an earlier run left (a record, a cache, a course file): refused
/// at once when it is not a regular file (a FIFO would block forever, `/dev/zero` never end)
/// or larger than [`MAX_TEXT`]; errors name the path.
pub fn read_text(path: &Path) -> Result<String> {
    let m = std::fs::metadata(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    if !m.is_file() {
        anyhow::bail!(
            "`{}` is {}, not a file to read",
            path.display(),
            kind_of(&m)
        );
    }
    if m.len() > MAX_TEXT {
        anyhow::bail!(
            "`{}` is {} MiB, larger than any file this program writes ({} MiB)",
            path.display(),
            m.len() >> 20,
            MAX_TEXT >> 20
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "`{}` is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

#[cfg(unix)]
fn is_device(m: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    m.file_type().is_char_device() || m.file_type().is_block_device()
}

#[cfg(not(unix))]
fn is_device(_: &std::fs::Metadata) -> bool {
    false
}

/// Write `bytes` to `path`: a regular file atomically (see the module doc), through a link to
/// its target (the link stays a link), and to a device (`/dev/null`) directly; a folder, FIFO
/// or socket is refused (issue 27: a rename over `/dev/null` would replace the device).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| Ok(w.write_all(bytes)?))
}

/// [`write_atomic`] for contents too large to hold at once: `fill` writes them, in pieces, to
/// a buffered writer on the temporary file. An error from `fill` leaves nothing behind and is
/// returned as it is (an I/O error, with the path).
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    check_destination(path)?;
    let failed = || format!("failed to write `{}`", path.display());
    if let Ok(m) = std::fs::metadata(path)
        && is_device(&m)
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(failed)?;
        return fill(&mut f).with_context(failed);
    }
    let resolved;
    let path = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            resolved = resolve_link(path)?;
            resolved.as_path()
        }
        _ => path,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .with_context(|| format!("failed to create `{}`", dir.display()))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let f = std::fs::File::create(&tmp).with_context(failed)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 16, f);
    let written = fill(&mut w).and_then(|()| {
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    });
    if let Err(e) = written {
        // A failed write leaves nothing behind (on a full disk the temporary file would hold
        // the last free space; issue 27).
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(failed()));
    }
    Ok(())
}

/// Check that `bytes` can be written in the folder `dir`, by writing (and syncing, then
/// removing) a file of that size there: a read-only folder or a full disk is found before a
/// long run rather than after it (issue 27).
pub fn check_room(dir: &Path, bytes: usize) -> Result<()> {
    let probe = dir.join(format!(".write-check.{}.tmp", std::process::id()));
    let written = std::fs::File::create(&probe)
        .and_then(|mut f| f.write_all(&vec![0u8; bytes]).and_then(|_| f.sync_all()));
    let _ = std::fs::remove_file(&probe);
    written.with_context(|| format!("cannot write in `{}`", dir.display()))
}

/// Where the link at `path` leads (relative targets against the link's folder), following
/// chains of links; a dangling link leads to where its target would be.
fn resolve_link(path: &Path) -> Result<std::path::PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(&p)
                    .with_context(|| format!("cannot follow the link `{}`", p.display()))?;
                p = match p.parent() {
                    Some(dir) if target.is_relative() => dir.join(target),
                    _ => target,
                };
            }
            _ => return Ok(p),
        }
    }
    anyhow::bail!("`{}` is a loop of links", path.display())
}

/// Whether `id` is a plain id from course data (an exercise's or a step's): lowercase ASCII
/// letters, digits, `-` and `_`, starting with a letter or digit, at most 64 characters. Ids
/// name files in the workspace (`records/EX.STEP.json`), so nothing else may pass: no `/`, no
/// `..`, no dot files, no control characters.
pub fn is_plain_id(id: &str) -> bool {
    let b = id.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_')
}

/// `root/name` for a file name built from course data, refused unless `name` is one plain
/// component (no separator, not `.` or `..`, no NUL, not hidden): whatever a course says, what
/// the program writes stays inside `root`.
pub fn child(root: &Path, name: &str) -> Result<std::path::PathBuf> {
    let plain = !name.is_empty()
        && !name.starts_with('.')
        && !name.contains(['/', '\\', '\0'])
        && Path::new(name).components().count() == 1;
    if !plain {
        anyhow::bail!(
            "`{name}` is not a plain file name: refusing to use it under `{}`",
            root.display()
        );
    }
    Ok(root.join(name))
}

/// A 64-bit FNV-1a hash of `bytes`: the same on every build, platform and Rust version, so it
/// can name files in an on-disk cache (std's `DefaultHasher` promises none of that).
pub fn stable_hash(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, &b| (h ^ b as u64).wrapping_mul(PRIME))
}

#[cfg(test)]
mod tests {
    /// A write that fails leaves no temporary file behind, and the error names the user's
    /// path, not the hidden temporary one (issue 27).
    #[test]
    fn failed_writes_leave_nothing_behind() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("taken");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), "x").unwrap();
        let e = super::write_atomic(&target, b"new").unwrap_err();
        assert!(format!("{e:#}").contains("taken`"), "{e:#}");
        let left: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("taken")]);
    }

    /// Ids and file names from course data cannot climb out of the workspace (issue 27).
    #[test]
    fn course_names_stay_inside() {
        use std::path::Path;
        for ok in ["fp32", "batch-1", "a_b", "09-peak"] {
            assert!(super::is_plain_id(ok), "{ok}");
        }
        for bad in [
            "",
            "..",
            "../x",
            "a/b",
            "A",
            "-x",
            ".x",
            "x.y",
            "x\0",
            "é",
            &"a".repeat(65),
        ] {
            assert!(!super::is_plain_id(bad), "{bad:?}");
        }
        let root = Path::new("/ws/records");
        assert!(super::child(root, "01-a.fp32.json").is_ok());
        for bad in [
            "..",
            "../results.json",
            "a/b.json",
            "/etc/passwd",
            ".hidden",
            "",
            "x\0y",
        ] {
            assert!(super::child(root, bad).is_err(), "{bad:?}");
        }
    }

    /// The published FNV-1a test vectors: a changed hash would orphan every cached file.
    #[test]
    fn stable_hash_is_fnv1a() {
        assert_eq!(super::stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(super::stable_hash(b"foobar"), 0x8594_4171_f739_67e8);
    }
}

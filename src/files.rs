//! Writing files that hold someone's work: to a temporary file beside the target, flushed to
//! disk, then renamed over it, so a crash or Ctrl-C leaves either the old file or the new one.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .with_context(|| format!("failed to create `{}`", dir.display()))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let mut f = std::fs::File::create(&tmp)
        .with_context(|| format!("failed to write `{}`", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("failed to write `{}`", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("failed to write `{}`", path.display()))?;
    Ok(())
}

//! Files that outlive a process: writing someone's work atomically (to a temporary file beside
//! the target, flushed to disk, then renamed over it, so a crash or Ctrl-C leaves either the
//! old file or the new one), and the stable hash that names cached files.

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
    /// The published FNV-1a test vectors: a changed hash would orphan every cached file.
    #[test]
    fn stable_hash_is_fnv1a() {
        assert_eq!(super::stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(super::stable_hash(b"foobar"), 0x8594_4171_f739_67e8);
    }
}

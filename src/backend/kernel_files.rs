//! The GPU kernel files: the copies built into the binary, and `--kernels-dir DIR`, which lays
//! edited copies over them. A file present under DIR (`DIR/wgsl/depthwise.wgsl`) replaces the
//! built-in one of the same path; every other file stays the built-in copy, so editing one
//! kernel takes one file. A file under DIR's kernel folders that is not one of this build's
//! (a misspelt name would otherwise be ignored without a word) is refused, and so is a DIR that
//! overrides nothing.

use std::path::{Path, PathBuf};

use super::BackendError;

/// The kernel folders a kernels directory may hold.
pub const FOLDERS: &[&str] = &["wgsl", "gpu", "cuda", "hip"];

/// Every kernel file in the binary, by its path under kernels/.
pub const FILES: &[(&str, &str)] = &[
    (
        "wgsl/activate.wgsl",
        include_str!("../../kernels/wgsl/activate.wgsl"),
    ),
    (
        "wgsl/channels.wgsl",
        include_str!("../../kernels/wgsl/channels.wgsl"),
    ),
    (
        "wgsl/conv2d.wgsl",
        include_str!("../../kernels/wgsl/conv2d.wgsl"),
    ),
    (
        "wgsl/depthwise.wgsl",
        include_str!("../../kernels/wgsl/depthwise.wgsl"),
    ),
    (
        "wgsl/elementwise.wgsl",
        include_str!("../../kernels/wgsl/elementwise.wgsl"),
    ),
    ("wgsl/llm.wgsl", include_str!("../../kernels/wgsl/llm.wgsl")),
    (
        "wgsl/pool.wgsl",
        include_str!("../../kernels/wgsl/pool.wgsl"),
    ),
    (
        "wgsl/stream.wgsl",
        include_str!("../../kernels/wgsl/stream.wgsl"),
    ),
    (
        "wgsl/transformer.wgsl",
        include_str!("../../kernels/wgsl/transformer.wgsl"),
    ),
    (
        "wgsl/window.wgsl",
        include_str!("../../kernels/wgsl/window.wgsl"),
    ),
    ("gpu/ops.cuh", include_str!("../../kernels/gpu/ops.cuh")),
    ("gpu/llm.cuh", include_str!("../../kernels/gpu/llm.cuh")),
    ("cuda/ops.cu", include_str!("../../kernels/cuda/ops.cu")),
    ("hip/ops.hip", include_str!("../../kernels/hip/ops.hip")),
];

/// The built-in copy of `path` (`wgsl/conv2d.wgsl`).
pub fn embedded(path: &str) -> Option<&'static str> {
    FILES.iter().find(|(p, _)| *p == path).map(|(_, t)| *t)
}

/// Kernel file `path` as (the name errors and `#line` markers give it, text): DIR's copy where
/// `kernels_dir` has one, else the built-in copy.
pub fn read(path: &str, kernels_dir: Option<&Path>) -> Result<(String, String), BackendError> {
    if let Some(full) = kernels_dir.map(|d| d.join(path)).filter(|f| f.exists()) {
        let text = crate::files::read_text(&full).map_err(|e| BackendError::Compile {
            path: full.display().to_string(),
            log: format!("{e:#}"),
        })?;
        return Ok((full.display().to_string(), text));
    }
    let text = embedded(path).ok_or_else(|| BackendError::Compile {
        path: format!("kernels/{path}"),
        log: "this kernel file is not built into the binary (add it to kernel_files::FILES)".into(),
    })?;
    Ok((format!("kernels/{path}"), text.to_string()))
}

/// The files of `dir` that replace built-in ones, as paths under kernels/ (`wgsl/pool.wgsl`),
/// sorted; an error names a file that is not one of this build's, or says that DIR replaces
/// nothing.
pub fn overrides(dir: &Path) -> anyhow::Result<Vec<String>> {
    if !dir.is_dir() {
        anyhow::bail!(
            "--kernels-dir {}: not a directory (it holds wgsl/, gpu/, cuda/ or hip/ with the kernel files to use instead of the built-in ones)",
            dir.display()
        );
    }
    let mut found = Vec::new();
    for folder in FOLDERS {
        let sub = dir.join(folder);
        let Ok(entries) = std::fs::read_dir(&sub) else {
            continue;
        };
        for entry in entries.flatten() {
            let path: PathBuf = entry.path();
            if !path.is_file() {
                continue;
            }
            let name = format!("{folder}/{}", entry.file_name().to_string_lossy());
            if embedded(&name).is_none() {
                let known: Vec<&str> = (FILES.iter())
                    .filter_map(|(p, _)| p.strip_prefix(&format!("{folder}/")))
                    .collect();
                anyhow::bail!(
                    "--kernels-dir: {} is not one of this build's kernel files (in {folder}/: {})",
                    path.display(),
                    known.join(", ")
                );
            }
            found.push(name);
        }
    }
    if found.is_empty() {
        anyhow::bail!(
            "--kernels-dir {}: no kernel file to use (put an edited copy at {}/wgsl/NAME.wgsl, or under gpu/, cuda/ or hip/; the originals are in the repository's kernels/)",
            dir.display(),
            dir.display()
        );
    }
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_of_the_tree_is_built_in() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        for folder in FOLDERS {
            for e in std::fs::read_dir(root.join(folder)).unwrap().flatten() {
                let name = format!("{folder}/{}", e.file_name().to_string_lossy());
                assert!(embedded(&name).is_some(), "{name} is not in FILES");
            }
        }
    }

    #[test]
    fn a_directory_lays_its_files_over_the_built_in_ones() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("wgsl")).unwrap();
        let err = overrides(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no kernel file to use"), "{err}");
        std::fs::write(dir.path().join("wgsl/pool.wgsl"), "// mine").unwrap();
        assert_eq!(overrides(dir.path()).unwrap(), ["wgsl/pool.wgsl"]);
        let (name, text) = read("wgsl/pool.wgsl", Some(dir.path())).unwrap();
        assert!(name.ends_with("pool.wgsl") && name.contains(&*dir.path().to_string_lossy()));
        assert_eq!(text, "// mine");
        let (name, text) = read("wgsl/conv2d.wgsl", Some(dir.path())).unwrap();
        assert_eq!(name, "kernels/wgsl/conv2d.wgsl");
        assert_eq!(text, embedded("wgsl/conv2d.wgsl").unwrap());
        std::fs::write(dir.path().join("wgsl/depthwse.wgsl"), "").unwrap();
        let err = overrides(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("depthwse.wgsl is not one of this build's"),
            "{err}"
        );
        assert!(err.contains("depthwise.wgsl"), "{err}");
        let err = overrides(&dir.path().join("nowhere"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a directory"), "{err}");
    }
}

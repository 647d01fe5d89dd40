//! libnvrtc for the kernel compile check: installed from PyPI's `nvidia-cuda-nvrtc-cu12`
//! wheel into `target/nvrtc`, once (cached there), so CI needs no CUDA toolkit.

use crate::cmd::{Cmd, root};
use std::path::{Path, PathBuf};

/// The wheel, pinned to the CUDA version cudarc is built for (`cuda-12080`).
const WHEEL: &str = "nvidia-cuda-nvrtc-cu12==12.8.93";

/// The folder holding `libnvrtc.so.12`, installing the wheel first when it is missing.
pub fn install() -> Result<PathBuf, String> {
    let target = root().join("target").join("nvrtc");
    if let Some(dir) = find_lib_dir(&target) {
        return Ok(dir);
    }
    Cmd::new(
        "python3",
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--upgrade",
        ],
    )
    .args(["--target", &target.to_string_lossy(), WHEEL])
    .run()
    .map_err(|e| format!("installing libnvrtc from PyPI failed: {e}"))?;
    find_lib_dir(&target).ok_or_else(|| {
        format!(
            "{WHEEL} installed, but no libnvrtc.so* under {}",
            target.display()
        )
    })
}

/// The files of `dir` a program loading NVRTC needs: `libnvrtc.so.*` and its builtins
/// (not the `.alt` variants).
pub fn runtime_libs(dir: &Path) -> Result<Vec<String>, String> {
    let mut libs: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libnvrtc") && n.contains(".so") && !n.contains(".alt."))
        .collect();
    libs.sort();
    if libs.is_empty() {
        return Err(format!("no libnvrtc under {}", dir.display()));
    }
    Ok(libs)
}

/// `LD_LIBRARY_PATH` with `dir` in front.
pub fn library_path_with(dir: &Path) -> String {
    match std::env::var("LD_LIBRARY_PATH") {
        Ok(existing) if !existing.is_empty() => format!("{}:{existing}", dir.display()),
        _ => dir.display().to_string(),
    }
}

fn find_lib_dir(dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_lib_dir(&path) {
                return Some(found);
            }
        } else if path
            .file_name()?
            .to_string_lossy()
            .starts_with("libnvrtc.so")
        {
            return Some(dir.to_path_buf());
        }
    }
    None
}

//! `cargo xtask publish-check`: the library crates an engine depends on (the facade and
//! the crates under it) package and verify as crates.io would take them, without
//! uploading anything.
//!
//! A dry run per crate (`cargo publish --dry-run -p unikv-kernels`) cannot pass before the
//! first release: cargo resolves the package's dependencies against crates.io, where
//! `unikv-invariants` is not yet. `cargo publish --workspace --dry-run` packages every
//! member that is not `publish = false`, then verifies each one (builds it from its
//! `.crate` alone) against a local registry overlay that holds the packages before it in
//! dependency order, which is what the real release will see. This task runs that once,
//! reads cargo's output back into one line per crate, and checks around it:
//!
//! 1. each crate's copies of the license texts equal the root's (cargo packages only files
//!    under a crate's folder, so every published crate carries its own copy);
//! 2. each package's file list holds both license texts and the README, and nothing under
//!    `target/`;
//! 3. the dry run, with `--locked` (the lock file is current) and `--allow-dirty` (it
//!    checks the working tree as it is; a real `cargo publish` wants it committed);
//! 4. the set cargo packaged is exactly [`PUBLISHED`], so a crate that gains or loses
//!    `publish = false` is noticed here;
//! 5. the crates documented with `cuda` on docs.rs document with it (`cargo doc`, warnings
//!    denied).

use crate::cmd::{Cmd, root};
use std::collections::BTreeSet;
use std::time::Instant;

/// The published crates, in dependency order, with their folders.
const PUBLISHED: [(&str, &str); 6] = [
    ("unikv-invariants", "crates/invariants"),
    ("unikv-kernels", "crates/kernels"),
    ("unikv-pools", "crates/pools"),
    ("unikv-mamba", "crates/mamba"),
    ("unikv-radix", "crates/radix"),
    ("unikv", "."),
];

/// The crates whose `[package.metadata.docs.rs]` enables the `cuda` feature.
const DOCS_RS_CUDA: [&str; 4] = ["unikv-kernels", "unikv-pools", "unikv-mamba", "unikv"];

/// The license texts every package ships (the workspace's `license` is
/// `MIT OR Apache-2.0`).
const LICENSES: [&str; 2] = ["LICENSE-MIT", "LICENSE-APACHE"];

/// What cargo's output says about one crate.
#[derive(Default)]
struct CrateResult {
    name: String,
    /// "N files, SIZE (SIZE compressed)", from the `Packaged` line.
    packaged: Option<String>,
    /// The verification build started.
    verifying: bool,
    /// The verification build finished.
    verified: bool,
    /// Reached the (aborted) upload: every check passed.
    uploaded: bool,
}

/// `cargo xtask publish-check`.
pub fn publish_check(args: &[String]) -> Result<(), String> {
    if let Some(bad) = args.first() {
        return Err(format!("publish-check takes no arguments (got {bad:?})"));
    }
    let started = Instant::now();
    license_copies_match()?;
    package_lists()?;
    forget_earlier_packages()?;

    eprintln!(
        "\n=== cargo publish --dry-run of every publishable crate (cargo's output follows when it ends; minutes from scratch)"
    );
    let (passed, output) = Cmd::cargo(&[
        "publish",
        "--workspace",
        "--dry-run",
        "--locked",
        "--allow-dirty",
    ])
    .env("CARGO_TARGET_DIR", fresh_target()?.to_string_lossy())
    .run_reporting()?;
    let results = parse(&output);

    println!(
        "\npublish dry run ({:.0}s):",
        started.elapsed().as_secs_f64()
    );
    println!(
        "{:<17} {:<44} {:<9} result",
        "crate", "packaged", "verified"
    );
    for r in &results {
        let result = if r.uploaded {
            "pass"
        } else if r.verified {
            "verified (no upload reached)"
        } else if r.verifying || r.packaged.is_none() {
            "FAIL"
        } else {
            "not reached"
        };
        println!(
            "{:<17} {:<44} {:<9} {result}",
            r.name,
            r.packaged.as_deref().unwrap_or("-"),
            if r.verified { "yes" } else { "no" },
        );
    }
    if !passed {
        return Err("`cargo publish --workspace --dry-run` failed (its output is above)".into());
    }
    let packaged: BTreeSet<&str> = results.iter().map(|r| r.name.as_str()).collect();
    let listed: BTreeSet<&str> = PUBLISHED.iter().map(|(name, _)| *name).collect();
    if packaged != listed {
        return Err(format!(
            "cargo packaged {packaged:?} but xtask/src/publish.rs lists {listed:?}: set `publish = false` on a tool crate, or add a new library crate to PUBLISHED"
        ));
    }
    if let Some(r) = results.iter().find(|r| !r.uploaded) {
        return Err(format!(
            "{} did not reach the dry-run upload (its output is above)",
            r.name
        ));
    }

    eprintln!("\n=== the docs.rs build: rustdoc with the cuda feature");
    let mut doc = Cmd::cargo(&["doc", "--no-deps", "--locked", "--features", "unikv/cuda"]);
    for name in DOCS_RS_CUDA {
        doc = doc.args(["-p", name]);
    }
    doc.env("RUSTDOCFLAGS", "-D warnings").run()?;

    eprintln!("\n=== the wheel: maturin build --release of bindings/python");
    let wheels = root().join("target").join("wheels");
    let out = wheels.to_string_lossy().into_owned();
    crate::python::Venv::ready()?
        .maturin(&[
            "build",
            "--release",
            "-q",
            "-m",
            "bindings/python/Cargo.toml",
            "--out",
            &out,
        ])
        .run()?;
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| format!("reading {out}: {e}"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("unikv-") && n.ends_with(".whl"))
        .max()
        .ok_or_else(|| format!("maturin wrote no unikv wheel into {out}"))?;
    println!("wheel: {out}/{wheel}");

    println!(
        "publish-check: {} crates package and verify, docs build with cuda, the wheel builds ({:.0}s)",
        results.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Each published crate's copies of the license texts are byte for byte the root's.
/// An empty target directory for the dry run (`target/publish-check`): cargo takes the
/// workspace's packaged crates for registry crates, which it never rebuilds at the same
/// version, so a target directory an earlier run compiled them into would verify the
/// facade against an earlier session's crates.
fn fresh_target() -> Result<std::path::PathBuf, String> {
    let dir = crate::cmd::root().join("target").join("publish-check");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("removing {}: {e}", dir.display()))?;
    }
    Ok(dir)
}

/// Removes what an earlier dry run left of the workspace's own crates: cargo unpacks the
/// packaged dependencies of a `--workspace` publish into `~/.cargo/registry/src` under a
/// local registry of its own, and a second run at the same version would verify against
/// those stale sources. On a fresh machine there is nothing to remove.
fn forget_earlier_packages() -> Result<(), String> {
    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")));
    let Some(home) = home else { return Ok(()) };
    for kind in ["src", "cache"] {
        let Ok(registries) = std::fs::read_dir(home.join("registry").join(kind)) else {
            continue;
        };
        for registry in registries.flatten() {
            for (name, _) in PUBLISHED {
                for entry in [
                    registry
                        .path()
                        .join(format!("{name}-{}", env!("CARGO_PKG_VERSION"))),
                    registry
                        .path()
                        .join(format!("{name}-{}.crate", env!("CARGO_PKG_VERSION"))),
                ] {
                    let removed = if entry.is_dir() {
                        std::fs::remove_dir_all(&entry)
                    } else if entry.is_file() {
                        std::fs::remove_file(&entry)
                    } else {
                        continue;
                    };
                    removed.map_err(|e| format!("removing {}: {e}", entry.display()))?;
                }
            }
        }
    }
    Ok(())
}

fn license_copies_match() -> Result<(), String> {
    let root = root();
    for license in LICENSES {
        let original = std::fs::read(root.join(license))
            .map_err(|e| format!("reading {license} at the root: {e}"))?;
        for (name, dir) in PUBLISHED {
            if dir == "." {
                continue;
            }
            let path = root.join(dir).join(license);
            let copy = std::fs::read(&path)
                .map_err(|e| format!("{name} has no {dir}/{license} ({e}): copy the root's"))?;
            if copy != original {
                return Err(format!(
                    "{dir}/{license} differs from the root's {license}: copy the root's over it"
                ));
            }
        }
    }
    eprintln!("license texts: every published crate's copies equal the root's");
    Ok(())
}

/// Each package's file list (`cargo package --list`) holds the license texts and the
/// README, and nothing under `target/`.
fn package_lists() -> Result<(), String> {
    for (name, _) in PUBLISHED {
        let list = Cmd::cargo(&["package", "--list", "--allow-dirty", "-p", name])
            .quiet()
            .output()?;
        let files: Vec<&str> = list.lines().collect();
        for wanted in LICENSES.iter().chain(&["README.md"]) {
            if !files.contains(wanted) {
                return Err(format!(
                    "the {name} package lacks {wanted}: add it to the crate's `include`"
                ));
            }
        }
        if let Some(built) = files.iter().find(|f| f.starts_with("target/")) {
            return Err(format!(
                "the {name} package would ship {built}: narrow the crate's `include`"
            ));
        }
        eprintln!(
            "{name}: {} files listed, licenses and README among them",
            files.len()
        );
    }
    Ok(())
}

/// One result per crate cargo packaged, in its packaging order, from the lines
/// `Packaging NAME vX (…)`, `Packaged N files, …`, `Verifying NAME vX (…)` followed by
/// `Finished …`, and `Uploading NAME vX (…)`.
fn parse(output: &str) -> Vec<CrateResult> {
    let mut results: Vec<CrateResult> = Vec::new();
    let mut packaging: Option<usize> = None;
    let mut verifying: Option<usize> = None;
    for line in output.lines() {
        let line = line.trim();
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        let name = rest.split(' ').next().unwrap_or("");
        match word {
            "Packaging" => {
                results.push(CrateResult {
                    name: name.to_string(),
                    ..CrateResult::default()
                });
                packaging = Some(results.len() - 1);
            }
            "Packaged" => {
                if let Some(i) = packaging.take() {
                    results[i].packaged = Some(rest.to_string());
                }
            }
            "Verifying" => {
                verifying = results.iter().position(|r| r.name == name);
                if let Some(i) = verifying {
                    results[i].verifying = true;
                }
            }
            "Finished" => {
                if let Some(i) = verifying.take() {
                    results[i].verified = true;
                }
            }
            "Uploading" => {
                if let Some(r) = results.iter_mut().find(|r| r.name == name) {
                    r.uploaded = true;
                }
            }
            _ => {}
        }
    }
    results
}

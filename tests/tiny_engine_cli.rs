//! The tiny engine's command line (`examples/tiny_engine/main.rs`): `--help` prints its
//! usage with status 0 (it used to be "unexpected arguments"), even with a bad
//! `UNIKV_INVARIANT_CHECK`, and a bad argument is status 2 pointing to it.
//!
//! `cargo test` (and nextest) build the examples beside the test binaries, in
//! `target/<profile>/examples`.

use std::path::PathBuf;
use std::process::Command;

/// The example's binary, built by `cargo test` next to this test's `deps` directory.
fn tiny_engine() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let path = profile.join("examples").join("tiny_engine");
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test` or nextest over all targets, which \
         build the examples",
        path.display()
    );
    path
}

#[test]
fn tiny_engine_help_prints_its_usage() {
    for flag in ["--help", "-h"] {
        let out = Command::new(tiny_engine())
            .arg(flag)
            .env("UNIKV_INVARIANT_CHECK", "bogus")
            .output()
            .expect("the example runs");
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(
            out.status.success(),
            "{flag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(
                "Usage: cargo run --release --example tiny_engine [-- --spec K | --host-memory]"
            ),
            "{stdout}"
        );
        assert!(stdout.contains("--spec K"), "{stdout}");
        assert!(stdout.contains("--host-memory"), "{stdout}");
    }
    let out = Command::new(tiny_engine())
        .arg("--frobnicate")
        .output()
        .expect("the example runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("try `tiny_engine --help`"), "{stderr}");
}

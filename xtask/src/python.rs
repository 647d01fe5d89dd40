//! The Python stage of `cargo xtask test` and `ci`: builds the `unikv` extension with
//! maturin into a virtualenv under `target/py-venv` (made, and filled from PyPI, on first
//! use), then runs its pytest suite at invariant level strict and `mypy --strict` over the
//! package and the tests.

use crate::cmd::{Cmd, root};

/// What the suite needs, pinned so a fresh machine tests what this one did.
const REQUIREMENTS: [&str; 5] = [
    "maturin==1.16.0",
    "numpy==2.4.6",
    "pytest==9.2.0",
    "mypy==2.4.1",
    "typing_extensions==4.16.0",
];

/// Builds the extension and runs pytest and mypy; pytest prints its counts.
pub fn python_tests() -> Result<(), String> {
    let venv = root().join("target").join("py-venv");
    let bin = venv.join("bin");
    let python = bin.join("python");
    if !python.is_file() {
        let path = venv.to_string_lossy().into_owned();
        Cmd::new(&system_python(), &["-m", "venv", &path]).run()?;
    }
    let python = python.to_string_lossy().into_owned();
    Cmd::new(
        &python,
        &["-m", "pip", "install", "-q", "--disable-pip-version-check"],
    )
    .args(REQUIREMENTS)
    .run()?;
    let venv_path = venv.to_string_lossy().into_owned();
    let path = format!(
        "{}:{}",
        bin.to_string_lossy(),
        std::env::var("PATH").unwrap_or_default()
    );
    Cmd::new(
        &bin.join("maturin").to_string_lossy(),
        &["develop", "-q", "-m", "bindings/python/Cargo.toml"],
    )
    .env("VIRTUAL_ENV", venv_path)
    .env("PATH", path)
    .run()?;
    Cmd::new(&python, &["-m", "pytest", "-q", "bindings/python/tests"])
        .env("UNIKV_INVARIANT_CHECK", "strict")
        .run()?;
    Cmd::new(
        &python,
        &[
            "-m",
            "mypy",
            "--strict",
            "bindings/python/python",
            "bindings/python/tests",
        ],
    )
    .run()
}

/// The interpreter that makes the virtualenv: `$PYTHON`, else `python3`.
fn system_python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

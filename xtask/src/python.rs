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

/// The virtualenv under `target/py-venv`, made and filled with [`REQUIREMENTS`] if
/// needed.
pub struct Venv {
    /// Its directory.
    dir: String,
    /// Its `bin` directory.
    bin: std::path::PathBuf,
    /// Its interpreter.
    pub python: String,
}

impl Venv {
    /// Makes the virtualenv (once) and installs the pinned requirements (pip skips what
    /// is there).
    pub fn ready() -> Result<Venv, String> {
        let dir = root().join("target").join("py-venv");
        let bin = dir.join("bin");
        let python = bin.join("python");
        let dir = dir.to_string_lossy().into_owned();
        if !python.is_file() {
            Cmd::new(&system_python(), &["-m", "venv", &dir]).run()?;
        }
        let python = python.to_string_lossy().into_owned();
        Cmd::new(
            &python,
            &["-m", "pip", "install", "-q", "--disable-pip-version-check"],
        )
        .args(REQUIREMENTS)
        .run()?;
        Ok(Venv { dir, bin, python })
    }

    /// `maturin args...` inside the virtualenv.
    pub fn maturin(&self, args: &[&str]) -> Cmd {
        let path = format!(
            "{}:{}",
            self.bin.to_string_lossy(),
            std::env::var("PATH").unwrap_or_default()
        );
        Cmd::new(&self.bin.join("maturin").to_string_lossy(), args)
            .env("VIRTUAL_ENV", self.dir.clone())
            .env("PATH", path)
    }
}

/// Builds the extension and runs pytest and mypy; pytest prints its counts.
pub fn python_tests() -> Result<(), String> {
    let venv = Venv::ready()?;
    let python = venv.python.clone();
    venv.maturin(&["develop", "-q", "-m", "bindings/python/Cargo.toml"])
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
            "bindings/python/bench.py",
            "examples/python",
        ],
    )
    .run()
}

/// The DLPack GPU check of `cargo xtask gpu`: builds the extension with `--features cuda`
/// into the virtualenv and runs only the GPU test of `test_dlpack.py` (the step table
/// exported through DLPack, read on the GPU by torch when importable, else by
/// `cuMemcpyDtoH`, equals the host table with 0 host syncs counted by the ledger),
/// requiring the GPU. Returns whether it passed and pytest's output.
pub fn dlpack_gpu_check(library_path: &str) -> Result<(bool, String), String> {
    let venv = Venv::ready()?;
    venv.maturin(&[
        "develop",
        "-q",
        "-m",
        "bindings/python/Cargo.toml",
        "--features",
        "cuda",
    ])
    .run()?;
    Cmd::new(
        &venv.python,
        &[
            "-m",
            "pytest",
            "-q",
            "-rs",
            "bindings/python/tests/test_dlpack.py",
            "-k",
            "test_gpu_",
        ],
    )
    .env("LD_LIBRARY_PATH", library_path)
    .env("UNIKV_REQUIRE_GPU", "1")
    .env("UNIKV_INVARIANT_CHECK", "strict")
    .run_reporting()
}

/// The interpreter that makes the virtualenv: `$PYTHON`, else `python3`.
fn system_python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

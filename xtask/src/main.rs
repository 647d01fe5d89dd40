//! `cargo xtask`: the project's automation, in Rust with std only.
//!
//! - `cargo xtask test` — the whole test matrix: features {default, cuda} ×
//!   `UNIKV_INVARIANT_CHECK` {off, warn, strict} × `UNIKV_TEST_PAGE_SIZE` {1, 16, 256}
//!   under nextest, then the doctests; prints a table of cells; then the Python stage:
//!   the `unikv` wheel built by maturin into `target/py-venv`, its pytest suite and
//!   `mypy --strict`.
//! - `cargo xtask ci` — what CI runs: fmt check, the module-cycle check, clippy `-D warnings` (both feature
//!   sets), rustdoc with warnings denied, the NVRTC compile check of every `.cu`, the
//!   test matrix, the Python stage, the loom models and a CI-sized run of the simulator.
//! - `cargo xtask python` — the Python stage alone (the bindings' wheel, pytest, mypy).
//! - `cargo xtask gpu` — the one script to run on a GPU machine: driver and NVRTC
//!   versions, NVRTC compile check, CPU-vs-CUDA parity, no-sync and capture tests, the
//!   overlap benchmark (`unikv bench-overlap`). Says so when there is no GPU.
//! - `cargo xtask gpu-bundle [DIR]` — the same checks for a GPU machine without Rust: the
//!   test binaries built here, libnvrtc and a `run.sh`, in DIR (default `.gpu`).
//! - `cargo xtask sim [--seeds N] [--seed S] [--first S]` — the deterministic simulator
//!   with injected faults (`unikv sim`, release build): N seeds from S, or one seed.
//! - `cargo xtask mutants [ARGS]` — mutation testing with cargo-mutants (installed if
//!   missing) over `crates/pools`, `crates/radix` and the facade, each mutant tested by its
//!   own crate's tests at invariant level strict; ARGS go to `cargo mutants` (e.g.
//!   `--shard 0/8`, `-f crates/pools/src/sub.rs`). Hours on two cores: not part of CI.
//! - `cargo xtask bench` — every crate's benchmarks.
//! - `cargo xtask bench-scale [ARGS]` — the scaling table (`unikv bench-scale`, release):
//!   by default random-2048-512 at page size 1 on the unified layout, bookkeeping only,
//!   at 1×, 4× and 16× the pool and the requests; ARGS replace those defaults.
//! - `cargo xtask cycles` — fails when sibling modules of a crate depend on each other
//!   (directly or through a chain), naming the references that close each cycle.
//! - `cargo xtask nvrtc` — installs libnvrtc (from PyPI) under `target/nvrtc` and
//!   compile-checks every kernel.
//! - `cargo xtask publish-check` — `cargo publish --dry-run` of every library crate in
//!   dependency order, one line per crate; license copies, package lists, docs.rs build;
//!   then the `unikv` wheel (`maturin build --release` into `target/wheels`).

mod cmd;
mod cycles;
mod nvrtc;
mod publish;
mod python;
mod tasks;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => tasks::test(&args[1..]),
        Some("ci") => tasks::ci(),
        Some("gpu") => tasks::gpu(),
        Some("gpu-bundle") => tasks::gpu_bundle(&args[1..]),
        Some("bench") => tasks::bench(&args[1..]),
        Some("bench-scale") => tasks::bench_scale(&args[1..]),
        Some("sim") => tasks::sim(&args[1..]),
        Some("mutants") => tasks::mutants(&args[1..]),
        Some("nvrtc") => tasks::nvrtc_check(),
        Some(task @ ("cycles" | "python")) if args.len() > 1 => {
            Err(format!("{task} takes no arguments (got {:?})", args[1]))
        }
        Some("cycles") => cycles::cycles(),
        Some("python") => python::python_tests(),
        Some("publish-check") => publish::publish_check(&args[1..]),
        Some("help" | "--help" | "-h") | None => {
            println!("{}", USAGE);
            Ok(())
        }
        Some(other) => Err(format!("unknown task {other:?}\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

const USAGE: &str = "usage: cargo xtask <task>

tasks:
  test [--quick]   the test matrix (features x invariant levels x page sizes), then doctests,
                   then the Python bindings' pytest suite and mypy --strict (a virtualenv
                   under target/py-venv); --quick runs only the default-feature cells
  ci               fmt, module cycles, clippy, rustdoc, NVRTC check, the test matrix, the
                   Python stage, loom models, the simulator over CI_SIM_SEEDS seeds
  python           the Python stage alone: the bindings' wheel, pytest and mypy --strict
  sim [--seeds N] [--first S | --seed S]
                   the deterministic simulator with faults: N seeds (default 10000) from
                   S (default 0), or the one seed S; a failure prints its seed
  gpu              GPU checks (driver, NVRTC, CPU-vs-CUDA parity, no-sync, capture, the
                   overlap benchmark); skips loudly without a GPU
  gpu-bundle [DIR] the GPU checks built here for a GPU machine without Rust: test
                   binaries, libnvrtc and run.sh in DIR (default .gpu); run bash DIR/run.sh
  mutants [ARGS]   cargo-mutants over pools, radix and the facade (installs it if missing;
                   ARGS go to cargo mutants, e.g. --shard 0/8 or -f FILE); not in CI
  bench [ARGS]     cargo bench for the workspace
  bench-scale [ARGS]
                   tokens/s and step times at 1x, 4x, 16x the pool and the requests
                   (unikv bench-scale; ARGS replace the default random-2048-512, page
                   size 1, unified, --device none, --invariants off)
  cycles           fail on modules of a crate that depend on each other (std-only scan)
  publish-check    cargo publish --dry-run of the library crates in dependency order, then
                   the unikv wheel (maturin build --release into target/wheels)
  nvrtc            install libnvrtc under target/nvrtc and compile every kernel";

//! The tasks: test matrix, ci, gpu, bench, nvrtc.

use crate::cmd::{Cmd, root};
use crate::nvrtc;
use std::time::Instant;

/// Feature sets of the matrix: (label, cargo arguments).
const FEATURE_SETS: [(&str, &[&str]); 2] =
    [("default", &[]), ("cuda", &["--features", "unikv/cuda"])];
const LEVELS: [&str; 3] = ["off", "warn", "strict"];
const PAGE_SIZES: [&str; 3] = ["1", "16", "256"];

/// One cell of the matrix and how it went.
struct Cell {
    features: &'static str,
    level: &'static str,
    page_size: &'static str,
    passed: bool,
    seconds: f64,
    /// A failed cell's last lines (nextest's final list of failures and their output),
    /// repeated after the table: a CI log that keeps only its tail still names them.
    digest: Option<String>,
}

/// How many of a failed cell's last lines its digest keeps.
const DIGEST_LINES: usize = 60;

/// The last [`DIGEST_LINES`] lines of `output`.
fn digest(output: &str) -> String {
    let lines: Vec<&str> = output.lines().collect();
    lines[lines.len().saturating_sub(DIGEST_LINES)..].join("\n")
}

/// `cargo xtask test [--quick]`.
pub fn test(args: &[String]) -> Result<(), String> {
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(bad) = args.iter().find(|a| *a != "--quick") {
        return Err(format!(
            "unknown option {bad:?} for test (expected --quick)"
        ));
    }
    run_matrix(quick, &[])?;
    crate::python::python_tests()
}

/// Runs the matrix with extra environment for every cell; then doctests.
fn run_matrix(quick: bool, extra_env: &[(&str, String)]) -> Result<(), String> {
    let started = Instant::now();
    let mut cells = Vec::new();
    let sets = if quick {
        &FEATURE_SETS[..1]
    } else {
        &FEATURE_SETS[..]
    };
    for (features, feature_args) in sets {
        // Build once per feature set; the cells only change the environment.
        Cmd::cargo(&[
            "nextest",
            "run",
            "--workspace",
            "--cargo-profile",
            "dev",
            "--no-run",
        ])
        .args(*feature_args)
        .run()?;
        for level in LEVELS {
            for page_size in PAGE_SIZES {
                eprintln!(
                    "\n=== cell: features={features} UNIKV_INVARIANT_CHECK={level} UNIKV_TEST_PAGE_SIZE={page_size}"
                );
                let mut cmd = Cmd::cargo(&["nextest", "run", "--workspace", "--profile", "ci"])
                    .args(*feature_args)
                    .env("UNIKV_INVARIANT_CHECK", level)
                    .env("UNIKV_TEST_PAGE_SIZE", page_size);
                for (k, v) in extra_env {
                    cmd = cmd.env(k, v.clone());
                }
                let cell_started = Instant::now();
                let (passed, output) = cmd.run_reporting()?;
                cells.push(Cell {
                    features,
                    level,
                    page_size,
                    passed,
                    seconds: cell_started.elapsed().as_secs_f64(),
                    digest: (!passed).then(|| digest(&output)),
                });
            }
        }
    }
    eprintln!("\n=== doctests (nextest does not run them)");
    let doc_started = Instant::now();
    let doc_passed = Cmd::cargo(&["test", "--workspace", "--doc"]).run().is_ok();
    let doc_seconds = doc_started.elapsed().as_secs_f64();

    println!("\ntest matrix ({:.0}s):", started.elapsed().as_secs_f64());
    println!(
        "{:<9} {:<7} {:>9}  {:<6} {:>7}",
        "features", "level", "page size", "result", "seconds"
    );
    for c in &cells {
        let result = if c.passed { "pass" } else { "FAIL" };
        println!(
            "{:<9} {:<7} {:>9}  {:<6} {:>7.1}",
            c.features, c.level, c.page_size, result, c.seconds
        );
    }
    println!(
        "{:<9} {:<7} {:>9}  {:<6} {:>7.1}",
        "doctests",
        "-",
        "-",
        if doc_passed { "pass" } else { "FAIL" },
        doc_seconds
    );
    for c in &cells {
        if let Some(digest) = &c.digest {
            println!(
                "\n=== failed cell: features={} UNIKV_INVARIANT_CHECK={} UNIKV_TEST_PAGE_SIZE={} (last lines)\n{digest}",
                c.features, c.level, c.page_size
            );
        }
    }
    let failed = cells.iter().filter(|c| !c.passed).count() + usize::from(!doc_passed);
    let total = cells.len() + 1;
    if failed == 0 {
        println!("matrix: {total} passed, 0 failed");
        Ok(())
    } else {
        println!("matrix: {} passed, {failed} failed", total - failed);
        Err(format!("{failed} of {total} matrix cells failed"))
    }
}

/// Seeds of the simulator that `cargo xtask ci` runs (under a minute in a dev build on two
/// cores).
const CI_SIM_SEEDS: u64 = 500;

/// `cargo run [profile] -p unikv-cli --bin unikv -- sim`, to which the caller adds args.
fn unikv_sim(profile: &[&str]) -> Cmd {
    Cmd::cargo(&["run", "--locked"]).args(profile).args([
        "-p",
        "unikv-cli",
        "--bin",
        "unikv",
        "--",
        "sim",
    ])
}

/// `cargo xtask sim [ARGS]`: `unikv sim ARGS` in a release build.
pub fn sim(args: &[String]) -> Result<(), String> {
    unikv_sim(&["--release"])
        .args(args.iter().map(String::as_str))
        .run()
}

/// `cargo xtask mutants [ARGS]`: cargo-mutants over the crates whose tests must notice a
/// wrong line (pools, radix, the facade), each mutant tested by its own package's tests
/// under nextest at invariant level strict, one job at a time (two cores). Installs
/// cargo-mutants when it is missing. Results land in `mutants.out/`.
pub fn mutants(args: &[String]) -> Result<(), String> {
    if Cmd::cargo(&["mutants", "--version"]).quiet().run().is_err() {
        Cmd::cargo(&["install", "--locked", "cargo-mutants"]).run()?;
    }
    Cmd::cargo(&[
        "mutants",
        "--test-tool",
        "nextest",
        "--jobs",
        "1",
        "--profile",
        "mutants",
    ])
    .args([
        "--package",
        "unikv-pools",
        "--package",
        "unikv-radix",
        "--package",
        "unikv",
    ])
    .args(args.iter().map(String::as_str))
    .env("UNIKV_INVARIANT_CHECK", "strict")
    .run()
}

/// `cargo xtask ci`: everything CI checks, failing at the first broken stage.
pub fn ci() -> Result<(), String> {
    let started = Instant::now();
    Cmd::cargo(&["fmt", "--all", "--", "--check"]).run()?;
    crate::cycles::cycles()?;
    for (_, feature_args) in FEATURE_SETS {
        Cmd::cargo(&["clippy", "--workspace", "--all-targets", "--locked"])
            .args(feature_args)
            .args(["--", "-D", "warnings"])
            .run()?;
    }
    Cmd::cargo(&["doc", "--workspace", "--no-deps", "--locked"])
        .env("RUSTDOCFLAGS", "-D warnings")
        .run()?;
    let lib_dir = nvrtc::install()?;
    let library_path = nvrtc::library_path_with(&lib_dir);
    nvrtc_test(&library_path, false)?;
    // The matrix runs with libnvrtc on the library path, so the cuda cells compile the
    // kernels for real instead of skipping.
    run_matrix(false, &[("LD_LIBRARY_PATH", library_path)])?;
    crate::python::python_tests()?;
    loom()?;
    // The simulator, sized for CI (the dev build the matrix made; `cargo xtask sim` runs
    // thousands in release).
    unikv_sim(&[])
        .args(["--seeds", &CI_SIM_SEEDS.to_string()])
        .run()?;
    println!(
        "ci: all stages passed in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The NVRTC compile check of every `.cu`, required to run (not skip). With
/// `show_output` the test's lines (NVRTC version, PTX sizes) are printed.
fn nvrtc_test(library_path: &str, show_output: bool) -> Result<(), String> {
    Cmd::cargo(&[
        "nextest",
        "run",
        "--profile",
        "ci",
        "-p",
        "unikv-kernels",
        "--features",
        "cuda",
        "--test",
        "nvrtc",
    ])
    .args(show_output.then_some("--no-capture"))
    .env("LD_LIBRARY_PATH", library_path)
    .env("UNIKV_REQUIRE_NVRTC", "1")
    .run()
}

/// `cargo xtask nvrtc`.
pub fn nvrtc_check() -> Result<(), String> {
    let lib_dir = nvrtc::install()?;
    eprintln!("libnvrtc: {}", lib_dir.display());
    nvrtc_test(&nvrtc::library_path_with(&lib_dir), true)
}

/// Every loom model: files named `loom_*.rs` under a crate's `tests/`, built with
/// `--cfg unikv_loom` in a target folder of their own (so the normal build stays cached).
fn loom() -> Result<(), String> {
    let mut models = Vec::new();
    let crates =
        std::fs::read_dir(root().join("crates")).map_err(|e| format!("reading crates/: {e}"))?;
    for krate in crates.flatten() {
        let Ok(tests) = std::fs::read_dir(krate.path().join("tests")) else {
            continue;
        };
        for test in tests.flatten() {
            let name = test.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name
                .strip_prefix("loom_")
                .and_then(|s| s.strip_suffix(".rs"))
            {
                let package = format!("unikv-{}", krate.file_name().to_string_lossy());
                models.push((package, format!("loom_{stem}")));
            }
        }
    }
    models.sort();
    if models.is_empty() {
        return Err("no loom models found (expected crates/*/tests/loom_*.rs)".into());
    }
    let target = root().join("target").join("loom");
    for (package, test) in &models {
        Cmd::cargo(&["test", "--release", "-p", package, "--test", test])
            .env("RUSTFLAGS", "--cfg unikv_loom")
            .env("CARGO_TARGET_DIR", target.to_string_lossy())
            .env("LOOM_MAX_PREEMPTIONS", "3")
            .run()?;
    }
    println!("loom: {} models passed", models.len());
    Ok(())
}

/// The GPU checks: (suite, package, test target), each built with the `cuda` feature.
const GPU_SUITES: [(&str, &str, &str, &str); 4] = [
    ("nvrtc", "unikv-kernels", "nvrtc", ""),
    ("kernels", "unikv-kernels", "gpu_parity", ""),
    ("facade", "unikv", "no_sync", ""),
    // The speculative paths (verify, settle, checkpoints, aborts) on the GPU: the one
    // test of the suite that takes a device.
    (
        "speculative",
        "unikv",
        "speculative",
        "every_speculative_path_issues_no_host_sync",
    ),
];

/// What the GPU checks run of the overlap benchmark (`unikv bench-overlap`, every default
/// row: gpt-oss-20b shared-prefix and random-2048-512 at page sizes 1, 16 and 256, and
/// shared-prefix speculative), after the suites.
const OVERLAP_ARGS: [&str; 3] = ["bench-overlap", "--device", "cuda"];

/// The script `cargo xtask gpu-bundle` writes beside the test binaries: it unpacks
/// NVRTC, runs each suite one test at a time with the GPU required, prints every verdict
/// and the bandwidth table, and fails when a suite did.
const GPU_RUN_SH: &str = r#"#!/usr/bin/env bash
# Written by `cargo xtask gpu-bundle`: the GPU checks of `cargo xtask gpu` for a machine
# with an NVIDIA GPU and no Rust toolchain. Run from anywhere: bash <bundle>/run.sh
set -u
here="$(cd "$(dirname "$0")" && pwd)"
nv="$(mktemp -d)"
tar xJf "$here/nvrtc.tar.xz" -C "$nv" && ln -sf libnvrtc.so.12 "$nv/libnvrtc.so"
export LD_LIBRARY_PATH="$nv:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}"
export UNIKV_REQUIRE_GPU=1 UNIKV_REQUIRE_NVRTC=1 RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
failed=0
for entry in SUITES; do
  suite="${entry%%:*}"; filter="${entry#*:}"
  log="${OUT:-$nv}/$suite.log"
  timeout 300 "$here/$suite" $filter --test-threads=1 --nocapture >"$log" 2>&1
  rc=$?
  echo "== $suite (exit $rc, log $log)"
  # A test that prints puts its verdict on a later line: show those lines too.
  grep -E '^test |^(ok|FAILED)$|^test result|^BANDWIDTH|panicked' "$log"
  [ "$rc" -eq 0 ] || failed=1
done
# The overlap benchmark: GPU idle between forwards, unikv vs a syncing free path.
timeout 600 "$here/unikv" OVERLAP >"${OUT:-$nv}/overlap.txt" 2>"${OUT:-$nv}/overlap.log"
rc=$?
echo "== overlap (exit $rc: 0 every row met the target, 1 a row missed it)"
cat "${OUT:-$nv}/overlap.txt"
[ "$rc" -le 1 ] || failed=1
if [ "$failed" -ne 0 ]; then echo "gpu: a suite failed"; exit 1; fi
echo "gpu: all suites passed"
"#;

/// `cargo xtask gpu-bundle [DIR]`: builds the GPU checks' test binaries here (release,
/// the `cuda` feature; cudarc loads the driver at run time), packs libnvrtc beside them and
/// writes `run.sh`, into DIR (default `.gpu`, ignored by git), so that a GPU machine
/// without a Rust toolchain runs `bash DIR/run.sh`. The binaries need that machine's
/// architecture and a glibc no older than this one's.
pub fn gpu_bundle(args: &[String]) -> Result<(), String> {
    let dir = root().join(args.first().map_or(".gpu", String::as_str));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut names = Vec::new();
    for (_, package, test, filter) in GPU_SUITES {
        // Release: the bandwidth table times the host's packing and checks too.
        let json = Cmd::cargo(&["test", "--release", "--no-run", "--message-format=json"])
            .args(["-p", package, "--features", "cuda", "--test", test])
            .output()?;
        let executable = json
            .lines()
            .filter(|l| {
                l.contains("\"compiler-artifact\"") && l.contains(&format!("\"name\":\"{test}\""))
            })
            .find_map(|l| {
                let (_, rest) = l.split_once("\"executable\":\"")?;
                rest.split_once('"').map(|(path, _)| path.to_string())
            })
            .ok_or_else(|| format!("cargo built no executable for the test {test}"))?;
        let to = dir.join(test);
        std::fs::copy(&executable, &to)
            .map_err(|e| format!("copying {executable} to {}: {e}", to.display()))?;
        // Debug info would take the bundle past what a remote run carries (tens of MB).
        Cmd::new("strip", &[to.to_string_lossy().as_ref()]).run()?;
        names.push(format!("{test}:{filter}"));
    }
    // The overlap benchmark's binary, with the CUDA backend.
    let json = Cmd::cargo(&["build", "--release", "--message-format=json"])
        .args(["-p", "unikv-cli", "--features", "cuda", "--bin", "unikv"])
        .output()?;
    let executable = json
        .lines()
        .filter(|l| l.contains("\"compiler-artifact\"") && l.contains("\"executable\":\""))
        .find_map(|l| {
            let (_, rest) = l.split_once("\"executable\":\"")?;
            rest.split_once('"').map(|(path, _)| path.to_string())
        })
        .ok_or("cargo built no unikv binary")?;
    let to = dir.join("unikv");
    std::fs::copy(&executable, &to)
        .map_err(|e| format!("copying {executable} to {}: {e}", to.display()))?;
    Cmd::new("strip", &[to.to_string_lossy().as_ref()]).run()?;
    let lib_dir = nvrtc::install()?;
    let libs = nvrtc::runtime_libs(&lib_dir)?;
    Cmd::new(
        "tar",
        &["cJf", &dir.join("nvrtc.tar.xz").to_string_lossy(), "-C"],
    )
    .args([lib_dir.to_string_lossy().as_ref()])
    .args(&libs)
    .run()?;
    let script = GPU_RUN_SH
        .replace("SUITES", &names.join(" "))
        .replace("OVERLAP", &OVERLAP_ARGS.join(" "));
    std::fs::write(dir.join("run.sh"), script).map_err(|e| format!("writing run.sh: {e}"))?;
    println!(
        "gpu-bundle: {} ready: on the GPU machine run `bash {}/run.sh`",
        dir.display(),
        dir.display()
    );
    Ok(())
}

/// `cargo xtask gpu`: the one script for a GPU machine. Without a GPU it prints one
/// line and succeeds (fails under `UNIKV_REQUIRE_GPU=1`): the same checks run on the CUDA
/// backend's emulated driver in `cargo xtask test`. With one, it runs, on the GPU and
/// requiring it: the NVRTC compile of every kernel, CPU-vs-CUDA parity of every op, the
/// no-sync proofs (every op and a whole step return while a spin kernel holds the
/// stream), graph capture and replay, the bandwidth table, the speculative paths' no-sync
/// test, the Python binding's DLPack export read on the GPU (`python::dlpack_gpu_check`)
/// and the overlap benchmark ([`OVERLAP_ARGS`]); then prints one table (and the
/// benchmark's) and fails if any check did.
pub fn gpu() -> Result<(), String> {
    let require = std::env::var("UNIKV_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let gpus = Cmd::new(
        "nvidia-smi",
        &[
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ],
    )
    .quiet()
    .output()
    .unwrap_or_default();
    let Some(gpu) = gpus.lines().next().filter(|l| !l.trim().is_empty()) else {
        println!(
            "gpu: no NVIDIA GPU (nvidia-smi missing or lists none): GPU checks skipped; their emulated-driver twins run in `cargo xtask test`"
        );
        return if require {
            Err("UNIKV_REQUIRE_GPU=1 but no GPU was found".into())
        } else {
            Ok(())
        };
    };
    let lib_dir = nvrtc::install()?;
    let library_path = nvrtc::library_path_with(&lib_dir);
    let mut rows: Vec<(String, &str)> = Vec::new();
    let mut bandwidth: Vec<String> = Vec::new();
    for (suite, package, test, filter) in GPU_SUITES {
        let (ok, output) = Cmd::cargo(&["nextest", "run", "--profile", "ci", "--no-capture"])
            .args(["-p", package, "--features", "cuda", "--test", test])
            .args([filter].into_iter().filter(|f| !f.is_empty()))
            .env("LD_LIBRARY_PATH", library_path.as_str())
            .env("UNIKV_REQUIRE_GPU", "1")
            .env("UNIKV_REQUIRE_NVRTC", "1")
            .run_reporting()?;
        let mut seen = 0;
        for line in output.lines() {
            let verdict = if line.trim_start().starts_with("PASS [") {
                "pass"
            } else if line.trim_start().starts_with("FAIL [") {
                "FAIL"
            } else {
                if let Some(b) = line.strip_prefix("BANDWIDTH ") {
                    bandwidth.push(b.to_string());
                }
                continue;
            };
            let test = line.split_whitespace().last().unwrap_or("?");
            if !rows.iter().any(|(t, _)| t.ends_with(test)) {
                rows.push((format!("{suite}: {test}"), verdict));
                seen += 1;
            }
        }
        if !ok && seen == 0 {
            rows.push((format!("{suite}: (did not run)"), "FAIL"));
        }
    }
    // The Python binding's DLPack export, read on the GPU (one pytest test).
    let (ok, output) = crate::python::dlpack_gpu_check(&library_path)?;
    let verdict = if ok && output.contains("1 passed") {
        "pass"
    } else {
        "FAIL"
    };
    rows.push((
        "python dlpack: test_gpu_the_dlpack_step_table_equals_the_host_table_with_no_host_sync"
            .to_string(),
        verdict,
    ));
    // The overlap benchmark, in a release build with the CUDA backend.
    let (ok, output) = Cmd::cargo(&["run", "--locked", "--release", "-p", "unikv-cli"])
        .args(["--features", "cuda", "--bin", "unikv", "--"])
        .args(OVERLAP_ARGS)
        .env("LD_LIBRARY_PATH", library_path.as_str())
        .run_reporting()?;
    let overlap: Vec<&str> = output
        .lines()
        .skip_while(|l| !l.starts_with("unikv bench-overlap"))
        .collect();
    rows.push((
        "overlap: unikv's idle between forwards under 1 % of a forward, every row".to_string(),
        if ok { "pass" } else { "FAIL" },
    ));
    println!("\nGPU: {}  (NVRTC {})", gpu.trim(), lib_dir.display());
    let width = rows.iter().map(|(t, _)| t.len()).max().unwrap_or(0);
    for (test, verdict) in &rows {
        println!("  {test:<width$}  {verdict}");
    }
    for line in &bandwidth {
        println!("  {line}");
    }
    for line in &overlap {
        println!("  {line}");
    }
    let failed = rows.iter().filter(|(_, v)| *v == "FAIL").count();
    if failed > 0 {
        return Err(format!("gpu: {failed} of {} checks failed", rows.len()));
    }
    println!("gpu: all {} checks passed", rows.len());
    Ok(())
}

/// `cargo xtask bench [ARGS]`.
pub fn bench(args: &[String]) -> Result<(), String> {
    Cmd::cargo(&["bench", "--workspace"]).args(args).run()
}

/// The run `cargo xtask bench-scale` measures without arguments.
const BENCH_SCALE_DEFAULT: [&str; 10] = [
    "--workload",
    "random-2048-512",
    "--page-size",
    "1",
    "--layout",
    "unified",
    "--device",
    "none",
    "--invariants",
    "off",
];

/// `cargo xtask bench-scale [ARGS]`: `unikv bench-scale` in a release build, with ARGS
/// or [`BENCH_SCALE_DEFAULT`].
pub fn bench_scale(args: &[String]) -> Result<(), String> {
    let args: Vec<&str> = if args.is_empty() {
        BENCH_SCALE_DEFAULT.to_vec()
    } else {
        args.iter().map(String::as_str).collect()
    };
    Cmd::cargo(&[
        "run",
        "--locked",
        "--release",
        "-p",
        "unikv-cli",
        "--bin",
        "unikv",
        "--",
    ])
    .args(["bench-scale"])
    .args(args)
    .run()
}

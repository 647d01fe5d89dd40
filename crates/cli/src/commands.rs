//! The commands end to end: `unikv replay` (check the configuration and the outputs,
//! build the workloads, run every (workload, page size, layout) through the scheduler,
//! render the report and the plots), `unikv bench-ops` (replay a recorded ops trace and
//! print its throughput), `unikv bench-scale` (check the outputs, run the scales with
//! their bars) and `unikv bench-overlap` (the overlap loop on the CUDA backend).
//!
//! An output never overwrites an input: a `--record-ops` file or a plot that is the
//! `--trace` file (the same path, a symbolic or a hard link to it) is refused before
//! anything is read or written ([`check_not_input`]).
//!
//! [`replay_with`] takes the scheduler as a parameter ([`RunFn`]) so the whole path can be
//! tested with a stand-in; [`replay`] uses the real one ([`unikv_replay::run`]).

use crate::args::{BenchOpsArgs, BenchOverlapArgs, OverlapDevice, ReplayArgs};
use crate::error::CliError;
use crate::progress::{ReplayProgress, ScaleBars};
use crate::svg;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use unikv_invariants::scoped_level;
use unikv_replay::runs::{build_workloads, check_configs, check_writable_file, plan};
use unikv_replay::scale::BenchScaleArgs;
use unikv_replay::{ReplayOptions, Report, RunConfig, RunStats, StepProgress};
use unikv_workload::Workload;

/// A scheduler: the real one ([`unikv_replay::run`] with the replay's `--record-ops`), or
/// a stand-in in tests.
pub type RunFn<'a> =
    dyn Fn(&Workload, &RunConfig, &dyn Fn(StepProgress)) -> Result<RunStats, CliError> + 'a;

/// What a replay produced.
#[derive(Debug)]
pub struct Outcome {
    /// Every run's statistics and the shared settings.
    pub report: Report,
}

impl Outcome {
    /// Whether every run passed (the exit status is 0 exactly then).
    pub fn pass(&self) -> bool {
        self.report.pass()
    }
}

/// Runs the replay `args` describe with the scheduler `run`, drawing `progress`, and
/// writes the table (or the JSON object) to `out` and the plots to `--svg`'s directory.
/// Returns the outcome whether the runs passed or not; an error means no report.
pub fn replay_with(
    args: &ReplayArgs,
    run: &RunFn<'_>,
    progress: &ReplayProgress,
    out: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let options = &args.options;
    // Output paths first: a path that cannot be written fails before any work.
    check_output_paths(args)?;
    let workloads = build_workloads(options)?;
    let planned = plan(options, &workloads);
    if let Some(dir) = &args.svg_dir {
        // Each plot's own file too (an existing read-only file, a directory of its name).
        for (w, config) in &planned {
            let name = svg::plot_file_name_of(&workloads[*w].name, config.page_size, config.layout);
            let plot = dir.join(name);
            check_not_input(options, "--svg", &plot)?;
            check_writable_file(&plot)?;
        }
    }
    let mut runs = Vec::new();
    for (w, config) in planned {
        let workload = &workloads[w];
        let label = format!(
            "{} · page size {} · {}",
            workload.name, config.page_size, config.layout
        );
        let bar = progress.start_run(
            &label,
            workload.total_tokens(),
            workload.requests.len() as u64,
        );
        let result = {
            let callback = bar.callback();
            scoped_level(config.invariant_level, || run(workload, &config, &callback))
        };
        bar.finish();
        runs.push(result?);
    }
    let report = Report {
        model: options.model,
        memory_bytes: options.memory_bytes,
        seed: options.seed,
        invariant_level: options.invariant_level,
        timing: options.timing,
        runs,
    };
    let text = if args.json {
        report.to_json()?
    } else {
        report.render_table()
    };
    out.write_all(text.as_bytes()).map_err(CliError::Output)?;
    out.flush().map_err(CliError::Output)?;
    if let Some(dir) = &args.svg_dir {
        svg::write_plots(&report, dir)?;
    }
    Ok(Outcome { report })
}

/// Checks, before anything runs, that the outputs `args` name can be written: the
/// `--record-ops` file, and the `--svg` directory (created if missing) and a new file in
/// it. Leaves no file behind.
pub fn check_output_paths(args: &ReplayArgs) -> Result<(), CliError> {
    check_record_ops(&args.options)?;
    if let Some(dir) = &args.svg_dir {
        let io = |source| CliError::Io {
            path: dir.display().to_string(),
            source,
        };
        if dir.exists() && !dir.is_dir() {
            // create_dir_all would say "File exists".
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                "not a directory",
            )));
        }
        std::fs::create_dir_all(dir).map_err(io)?;
        // A directory can exist and still refuse new files (permissions, a read-only
        // mount).
        check_writable_file(&dir.join(format!(".unikv-write-check-{}", std::process::id())))?;
    }
    Ok(())
}

/// Checks that the `--record-ops` file `options` name (if any) is not their `--trace`
/// and can be written, leaving it as it was.
fn check_record_ops(options: &ReplayOptions) -> Result<(), CliError> {
    if let Some(path) = &options.record_ops {
        // First: the writability check opens the file, and it must never touch an input.
        check_not_input(options, "--record-ops", path)?;
        check_writable_file(path)?;
    }
    Ok(())
}

/// Refuses an output (`output` names its option) that is the `--trace` file of
/// `options`: the same path, or a link to the same file.
pub fn check_not_input(
    options: &ReplayOptions,
    output: &'static str,
    path: &Path,
) -> Result<(), CliError> {
    match &options.trace {
        Some(trace) if same_file(path, trace) => Err(CliError::OutputIsInput {
            output,
            input: "--trace",
            path: path.display().to_string(),
        }),
        _ => Ok(()),
    }
}

/// Whether `a` and `b` name one existing file: the same path, a symbolic link to it or,
/// on Unix, a hard link (same device and inode). A path that does not exist names no
/// input (an input must exist to be read), so it is never the same file.
pub fn same_file(a: &Path, b: &Path) -> bool {
    let (Ok(meta_a), Ok(meta_b)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        meta_a.dev() == meta_b.dev() && meta_a.ino() == meta_b.ino()
    }
    #[cfg(not(unix))]
    {
        let _ = (meta_a, meta_b);
        matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(x), Ok(y)) if x == y
        )
    }
}

/// `unikv bench-scale`: checks the configurations and the `--record-ops` file before
/// any run, then runs every scale with a bar per run on a terminal's stderr (plain lines
/// on any other), the table or the JSON object on `out`.
pub fn bench_scale(args: &BenchScaleArgs, out: &mut dyn Write) -> Result<(), CliError> {
    check_record_ops(&args.replay)?;
    check_configs(&args.replay)?;
    let mut progress = ScaleBars::for_stderr(args.replay.runs() * args.scales.len());
    unikv_replay::scale::bench_scale(args, out, &mut progress)?;
    Ok(())
}

/// `unikv bench-overlap`: the overlap benchmark ([`unikv_replay::overlap`]) on GPU 0 or
/// the clocked emulation, one line per row on stderr as it finishes, then the table (or
/// one JSON object). Returns whether the exit status is 0: every row met the target, or
/// the run was emulated (which checks the loop, not a GPU).
pub fn bench_overlap(args: &BenchOverlapArgs, out: &mut dyn Write) -> Result<bool, CliError> {
    use std::sync::Arc;
    use unikv::kernels::CudaDevice;
    use unikv_replay::overlap::{self, Cell, Row};
    let device_error = |e: unikv::kernels::Error| CliError::Replay(e.into());
    let (device, name) = match args.device {
        OverlapDevice::Cuda => {
            let device = CudaDevice::new(0).map_err(device_error)?;
            let (major, minor) = CudaDevice::driver_version().map_err(device_error)?;
            (device, format!("cuda:0 (driver CUDA {major}.{minor})"))
        }
        OverlapDevice::Emulated => (
            CudaDevice::emulated_clocked(),
            "emulated-cuda (forwards in host time)".to_string(),
        ),
    };
    let device = Arc::new(device);
    let workloads = build_workloads(&args.options)?;
    let mut runs = plan(&args.options, &workloads);
    if let Some(mode) = args.speculation {
        let speculative: Vec<(usize, RunConfig)> = runs
            .iter()
            .filter(|(w, _)| *w == 0)
            .map(|(w, config)| {
                let mut config = config.clone();
                config.speculation = Some(mode);
                (*w, config)
            })
            .collect();
        runs.extend(speculative);
    }
    let cells: Vec<Cell<'_>> = runs
        .iter()
        .map(|(w, config)| Cell {
            workload: &workloads[*w],
            config,
        })
        .collect();
    let mut progress = |r: &Row| {
        eprintln!(
            "bench-overlap: {} ps {}{}: idle median {:.1} µs (unikv) vs {:.1} µs (syncing)",
            r.workload,
            r.page_size,
            r.speculation
                .as_deref()
                .map_or(String::new(), |s| format!(" {s}")),
            r.unikv.idle.median_ns as f64 / 1e3,
            r.syncing.idle.median_ns as f64 / 1e3,
        );
    };
    let report = overlap::bench(&device, name, args.forward, &cells, &mut progress)?;
    let written = if args.json {
        serde_json::to_writer(&mut *out, &report)
            .map_err(std::io::Error::from)
            .and_then(|()| writeln!(out))
    } else {
        write!(out, "{}", report.table())
    };
    written.map_err(CliError::Output)?;
    Ok(args.device == OverlapDevice::Emulated || report.pass())
}

/// `unikv replay`: [`replay_with`] the real scheduler and a progress bar on stderr, once
/// every layout and page size was checked to be a cache the builder makes
/// ([`check_configs`]): a combination it refuses is reported before any run, not after
/// the runs before it.
pub fn replay(args: &ReplayArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    check_configs(&args.options)?;
    let progress = ReplayProgress::for_stderr(args.options.runs());
    let record_ops = args.options.record_ops.as_deref();
    let run = |w: &Workload, c: &RunConfig, p: &dyn Fn(StepProgress)| {
        unikv_replay::run(w, c, record_ops, p).map_err(CliError::from)
    };
    replay_with(args, &run, &progress, out)
}

/// `unikv bench-ops FILE`: replays a recorded operation trace against a fresh allocator.
///
/// Reads the trace once and checks it ([`unikv_ops::bench::check`]: one untimed replay
/// at level strict, so an illegal free is the trace's error on its line, whatever level
/// the passes run at), then at each level replays it `passes` times, each against a
/// fresh allocator, and prints the ops/s and tokens/s per op kind of the pass whose total
/// time is the median (a table, or one JSON object, schema [`unikv_ops::bench::SCHEMA`],
/// with `--json`). A speculative trace's
/// `verify` and `settle` lines are kinds of their own: the time of the allocator calls
/// each made, so the table's time per call is the allocator's time per verify step and
/// per settlement. A single pass is
/// mostly cold caches and first touches; the median pass is the steady state a server
/// runs in, and robust to a preempted pass on a shared machine.
pub fn bench_ops(args: &BenchOpsArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let trace = unikv_ops::load::load(&args.file)?;
    unikv_ops::bench::check(&trace, args.backend.ledger())?;
    let mut results = Vec::new();
    for &level in &args.levels {
        let mut passes = (0..args.passes.max(1))
            .map(|_| {
                scoped_level(level, || {
                    unikv_ops::bench::replay(&trace, args.backend.ledger())
                })
            })
            .collect::<Result<Vec<_>, unikv_ops::OpsError>>()?;
        passes.sort_by_key(|by_kind| by_kind.get("all").map_or(0, |t| t.nanos));
        let median = passes.swap_remove(passes.len() / 2);
        results.push((level, median));
    }
    let write = CliError::Output;
    if args.json {
        let levels: BTreeMap<&str, &BTreeMap<&str, unikv_ops::bench::OpThroughput>> = results
            .iter()
            .map(|(level, r)| (level.as_str(), r))
            .collect();
        let json = serde_json::json!({
            "schema": unikv_ops::bench::SCHEMA,
            "file": args.file.display().to_string(),
            "operations": trace.ops.len(),
            "passes": args.passes.max(1),
            "device": args.backend.as_str(),
            "levels": levels,
        });
        let text = serde_json::to_string_pretty(&json)?;
        writeln!(out, "{text}").map_err(write)?;
        return out.flush().map_err(write);
    }
    writeln!(
        out,
        "bench-ops {}: {} operations, median of {} passes",
        args.file.display(),
        trace.ops.len(),
        args.passes.max(1)
    )
    .map_err(write)?;
    for (level, by_kind) in &results {
        writeln!(out, "\ninvariants {level}").map_err(write)?;
        writeln!(
            out,
            "{:<22} {:>10} {:>13} {:>12} {:>14} {:>14} {:>12}",
            "op", "calls", "tokens", "time", "ops/s", "tokens/s", "time/call"
        )
        .map_err(write)?;
        for (name, t) in by_kind {
            writeln!(
                out,
                "{:<22} {:>10} {:>13} {:>12} {:>14.3e} {:>14.3e} {:>12}",
                name,
                t.calls,
                t.tokens,
                unikv_workload::units::format_ns(t.nanos),
                t.ops_per_second(),
                t.tokens_per_second(),
                unikv_workload::units::format_ns(t.nanos / t.calls.max(1))
            )
            .map_err(write)?;
        }
    }
    out.flush().map_err(write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use unikv_invariants::Level;
    use unikv_replay::{Backend, LAYOUTS, Layout, ReplayOptions, StepSample};
    use unikv_workload::Preset;

    /// A stand-in scheduler for testing the path around it: it reports every request of
    /// the workload finished, and numbers that depend, as a real run's do, on the
    /// workload's tokens (the hits) and on the run's seed (the steps: the scheduler's
    /// tie-breaks), so that a replay that drops either seed gives other numbers.
    fn fake(
        leak_on: Option<Layout>,
    ) -> impl Fn(&Workload, &RunConfig, &dyn Fn(StepProgress)) -> Result<RunStats, CliError> {
        move |workload, config, progress| {
            assert_eq!(
                unikv_invariants::level(),
                config.invariant_level,
                "the level is in force"
            );
            progress(StepProgress {
                step: 1,
                tokens_done: workload.total_tokens(),
                requests_completed: workload.requests.len() as u64,
            });
            let mut stats = RunStats::new(workload, config);
            stats.requests_completed = stats.requests_total;
            stats.prompt_tokens = workload
                .requests
                .iter()
                .map(|r| r.prompt.len() as u64)
                .sum();
            let fingerprint = workload
                .requests
                .iter()
                .flat_map(|r| &r.prompt)
                .fold(0u64, |h, &t| {
                    (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3)
                });
            stats.prefix_hit_tokens = fingerprint % (stats.prompt_tokens + 1);
            stats.steps = 1 + config.seed % 1_000;
            stats.samples = vec![StepSample {
                step: 1,
                bytes_by_subpool: BTreeMap::from([("full".to_string(), 4096)]),
            }];
            if leak_on == Some(config.layout) {
                stats.leaked_pages = 1;
            }
            Ok(stats)
        }
    }

    fn args() -> ReplayArgs {
        ReplayArgs {
            options: ReplayOptions {
                workloads: vec![Preset::Smoke],
                page_sizes: vec![1, 16],
                invariant_level: Level::Warn,
                timing: false,
                ..ReplayOptions::default()
            },
            ..ReplayArgs::default()
        }
    }

    #[test]
    fn every_run_goes_through_the_scheduler_in_report_order() {
        let mut out = Vec::new();
        let outcome =
            replay_with(&args(), &fake(None), &ReplayProgress::hidden(), &mut out).unwrap();
        assert!(outcome.pass());
        let order: Vec<(String, u32, Layout)> = outcome
            .report
            .runs
            .iter()
            .map(|r| (r.workload.clone(), r.page_size, r.layout))
            .collect();
        assert_eq!(
            order,
            [
                ("smoke".into(), 1, LAYOUTS[0]),
                ("smoke".into(), 1, Layout::Unified),
                ("smoke".into(), 16, LAYOUTS[0]),
                ("smoke".into(), 16, Layout::Unified),
            ]
        );
        let table = String::from_utf8(out).unwrap();
        assert!(
            table.contains("smoke · page size 16") && table.contains("verdict: PASS (4 runs"),
            "{table}"
        );
    }

    #[test]
    fn a_failing_run_still_prints_the_report_and_fails_the_outcome() {
        let mut out = Vec::new();
        let json = ReplayArgs {
            json: true,
            ..args()
        };
        let outcome = replay_with(
            &json,
            &fake(Some(Layout::Unified)),
            &ReplayProgress::hidden(),
            &mut out,
        )
        .unwrap();
        assert!(!outcome.pass());
        let value: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(value["pass"], false);
        assert_eq!(value["runs"][1]["failures"][0], "1 leaked pages");
    }

    #[test]
    fn the_same_seed_gives_the_same_json_and_another_seed_other_runs() {
        let json = ReplayArgs {
            json: true,
            ..args()
        };
        let once = |args: &ReplayArgs| {
            let mut out = Vec::new();
            replay_with(args, &fake(None), &ReplayProgress::hidden(), &mut out).unwrap();
            out
        };
        assert_eq!(once(&json), once(&json));
        // The seed must reach both the workloads and every run's scheduler: the runs
        // (not only the report's `seed` field) differ under another seed.
        let runs = |args: &ReplayArgs| {
            let value: serde_json::Value = serde_json::from_slice(&once(args)).unwrap();
            value["runs"].as_array().unwrap().clone()
        };
        let mut other = json.clone();
        other.options.seed += 1;
        let (first, second) = (runs(&json), runs(&other));
        assert_eq!(first.len(), 4);
        for (a, b) in first.iter().zip(&second) {
            assert_ne!(
                a["steps"], b["steps"],
                "the run's seed reaches the scheduler"
            );
            assert_ne!(
                a["prefix_hit_tokens"], b["prefix_hit_tokens"],
                "the workload is generated from the seed"
            );
        }
    }

    #[test]
    fn a_scheduler_error_stops_the_replay_with_that_error() {
        let mut out = Vec::new();
        let stalls =
            |w: &Workload, c: &RunConfig, _: &dyn Fn(StepProgress)| -> Result<RunStats, CliError> {
                Err(CliError::Replay(unikv_replay::ReplayError::Stalled {
                    workload: w.name.clone(),
                    layout: c.layout,
                    page_size: c.page_size,
                    steps: 7,
                    reason: "test".into(),
                }))
            };
        let err = replay_with(&args(), &stalls, &ReplayProgress::hidden(), &mut out).unwrap_err();
        assert!(
            matches!(
                err,
                CliError::Replay(unikv_replay::ReplayError::Stalled { steps: 7, .. })
            ),
            "{err:?}"
        );
        assert!(out.is_empty(), "no partial report");
    }

    #[test]
    fn svgs_are_written_when_asked() {
        let dir = std::env::temp_dir().join(format!("unikv-sim-{}-replay-svg", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let with_svg = ReplayArgs {
            svg_dir: Some(dir.clone()),
            ..args()
        };
        replay_with(
            &with_svg,
            &fake(None),
            &ReplayProgress::hidden(),
            &mut Vec::new(),
        )
        .unwrap();
        let plots = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(plots, 4);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bad_trace_fails_before_any_run() {
        let dir =
            std::env::temp_dir().join(format!("unikv-sim-{}-replay-trace", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.jsonl");
        std::fs::write(
            &path,
            "{\"arrival_step\": 0, \"prompt_len\": 4, \"output_len\": 1}\n{\"arrival_step\": 0}\n",
        )
        .unwrap();
        let mut with_trace = args();
        with_trace.options.trace = Some(path);
        let never = |_: &Workload,
                     _: &RunConfig,
                     _: &dyn Fn(StepProgress)|
         -> Result<RunStats, CliError> { panic!("no run may start") };
        let err = replay_with(
            &with_trace,
            &never,
            &ReplayProgress::hidden(),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                CliError::Replay(unikv_replay::ReplayError::Workload(
                    unikv_workload::WorkloadError::Trace { line: 2, .. }
                ))
            ),
            "{err:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bench_ops_replays_a_recorded_run_and_reports_every_op_kind() {
        let file = std::env::temp_dir().join(format!("unikv-sim-{}-ops.jsonl", std::process::id()));
        let config = RunConfig::new(unikv::ModelSpec::GPT_OSS_20B, Layout::Unified, 4, 1 << 30);
        let stats =
            unikv_replay::run(&Preset::Smoke.build(1), &config, Some(&file), &|_| {}).unwrap();
        assert_eq!(stats.requests_completed, stats.requests_total);
        let args = BenchOpsArgs {
            file: file.clone(),
            levels: vec![Level::Off, Level::Strict],
            json: false,
            backend: Backend::Cpu,
            passes: 3,
        };
        let mut out = Vec::new();
        bench_ops(&args, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for op in [
            "alloc_extend",
            "alloc_decode",
            "free_swa_segment",
            "free_swa_segments",
            "free_kv_row_segments",
            "flush",
            "all",
        ] {
            assert!(text.contains(op), "{op} missing:\n{text}");
        }
        assert!(
            text.contains("invariants off") && text.contains("invariants strict"),
            "{text}"
        );
        assert!(text.contains("median of 3 passes"), "{text}");
        // A trace that does not start with its header is refused with the file named.
        std::fs::write(&file, "{\"op\":\"flush\"}\n").unwrap();
        let err = bench_ops(&args, &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("header"), "{err}");
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn bench_ops_needs_a_readable_file() {
        let missing = BenchOpsArgs {
            file: "/nonexistent/ops.jsonl".into(),
            levels: vec![Level::Off],
            json: false,
            backend: Backend::Cpu,
            passes: 1,
        };
        assert!(matches!(
            bench_ops(&missing, &mut Vec::new()),
            Err(CliError::Ops(unikv_ops::OpsError::Io { .. }))
        ));
        let here = BenchOpsArgs {
            file: "Cargo.toml".into(),
            ..missing
        };
        assert!(matches!(
            bench_ops(&here, &mut Vec::new()),
            Err(CliError::Ops(unikv_ops::OpsError::OpsLine {
                line: 1,
                problem: unikv_ops::OpsProblem::Json { .. },
                ..
            }))
        ));
    }
}

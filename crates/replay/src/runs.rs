//! A replay's runs, from its options to the scheduler: the workloads they name
//! ([`build_workloads`]), the runs in report order ([`plan`]), the check that the
//! builder makes every layout and page size ([`check_config`], [`check_configs`]), and
//! one run with its
//! allocator operations recorded when asked ([`run`]).

use crate::config::{Backend, ReplayOptions, RunConfig, cache_builder};
use crate::error::ReplayError;
use crate::scheduler::{self, SpecNote, StepProgress};
use crate::stats::RunStats;
use std::path::Path;
use unikv::Layout;
use unikv_ops::{Op, Recorder};
use unikv_workload::{Workload, trace};

/// The workloads `options` name, in order: the presets (sized for the model and the
/// budget where a preset is, [`unikv_workload::Preset::build_for`]), then the trace.
/// Each is validated.
pub fn build_workloads(options: &ReplayOptions) -> Result<Vec<Workload>, ReplayError> {
    let mut workloads: Vec<Workload> = options
        .workloads
        .iter()
        .map(|p| p.build_for(options.seed, &options.model, options.memory_bytes))
        .collect();
    if let Some(path) = &options.trace {
        workloads.push(trace::load_trace(path, options.seed)?);
    }
    for w in &workloads {
        w.validate()?;
    }
    Ok(workloads)
}

/// The runs `options` give, in the order they run and are reported: for each workload,
/// for each page size, static then unified. Each pairs a workload index with its config.
pub fn plan(options: &ReplayOptions, workloads: &[Workload]) -> Vec<(usize, RunConfig)> {
    let mut runs = Vec::new();
    for (w, _) in workloads.iter().enumerate() {
        for &page_size in &options.page_sizes {
            for &layout in &options.layouts {
                let mut config =
                    RunConfig::new(options.model, layout, page_size, options.memory_bytes);
                config.seed = options.seed;
                config.invariant_level = options.invariant_level;
                config.backend = options.backend;
                config.speculation = options.speculation;
                config.host_memory_bytes = options.host_memory_bytes;
                config.checkpoint_interval = options.checkpoint_interval;
                runs.push((w, config));
            }
        }
    }
    runs
}

/// Checks that the builder makes `config`'s cache for some budget: a model and layout it
/// refuses whatever the workload is the builder's typed error ([`ReplayError::Cache`]). A
/// budget too small for one request is not an error here; the run reports it with its
/// workload ([`ReplayError::BudgetTooSmall`]).
pub fn check_config(config: &RunConfig) -> Result<(), ReplayError> {
    // Bookkeeping only: the check builds the cache and must not take its bytes.
    match cache_builder(config, Backend::None.ledger()).build() {
        Err(e @ unikv::Error::Config(_)) => Err(ReplayError::Cache(e)),
        _ => Ok(()),
    }
}

/// Checks that the builder makes a cache of every layout and page size `options` give
/// ([`check_config`]): a combination it refuses is reported before any run, not after
/// the runs before it.
pub fn check_configs(options: &ReplayOptions) -> Result<(), ReplayError> {
    for &layout in &options.layouts {
        for &page_size in &options.page_sizes {
            let mut config = RunConfig::new(options.model, layout, page_size, options.memory_bytes);
            config.speculation = options.speculation;
            config.host_memory_bytes = options.host_memory_bytes;
            config.checkpoint_interval = options.checkpoint_interval;
            check_config(&config)?;
        }
    }
    Ok(())
}

/// Runs `workload` with `config` through the scheduler ([`scheduler::run`]) and, with a
/// `record_ops` path, writes every allocator operation of the run there (the ops trace
/// `bench-ops` replays): the recorder hooks the allocator, and its write errors are the
/// run's once the run is over.
///
/// A speculative run (`config.speculation`) is run twice: first without speculation (the
/// baseline, not recorded, without progress), then speculating, its statistics carrying
/// the baseline's peaks ([`crate::stats::SpecStats`]); its trace (schema
/// `unikv.ops.v2`) also holds a `verify` and a `settle` line after the allocator calls of
/// each verify and settle.
pub fn run(
    workload: &Workload,
    config: &RunConfig,
    record_ops: Option<&Path>,
    progress: &dyn Fn(StepProgress),
) -> Result<RunStats, ReplayError> {
    let baseline = match config.speculation {
        Some(_) => {
            let plain = RunConfig {
                speculation: None,
                ..config.clone()
            };
            Some(scheduler::run(workload, &plain, (), &|_| {})?)
        }
        None => None,
    };
    let mut stats = run_one(workload, config, record_ops, progress)?;
    if let (Some(base), Some(spec)) = (baseline, &mut stats.speculative) {
        spec.baseline_failures = base.failures().iter().map(ToString::to_string).collect();
        spec.baseline_peak_bytes_by_subpool = base.peak_bytes_by_subpool;
        spec.baseline_steps = base.steps;
        spec.baseline_retractions = base.retractions;
        spec.baseline_prompt_tokens = base.prompt_tokens;
        spec.baseline_prefix_hit_tokens = base.prefix_hit_tokens;
        spec.baseline_recomputed_tokens = base.recomputed_tokens;
    }
    Ok(stats)
}

/// One run of `config` as it is, recorded when asked.
fn run_one(
    workload: &Workload,
    config: &RunConfig,
    record_ops: Option<&Path>,
    progress: &dyn Fn(StepProgress),
) -> Result<RunStats, ReplayError> {
    let (recorder, status) = match record_ops {
        Some(path) => {
            let schema = match config.speculation {
                Some(_) => unikv_ops::SCHEMA_V2,
                None => unikv_ops::SCHEMA,
            };
            let header = Op::Header {
                schema: schema.to_string(),
                layout: config.layout.as_str().to_string(),
                model: config.model.name.to_string(),
                page_size: config.page_size,
                memory_bytes: config.memory_bytes,
                // The unified layout has no ratio; its header carries the default.
                swa_full_ratio: match config.layout {
                    Layout::Static {
                        swa_full_tokens_ratio,
                    } => swa_full_tokens_ratio,
                    Layout::Unified => Layout::DEFAULT_SWA_FULL_TOKENS_RATIO,
                },
                scratch_slots: match config.layout {
                    Layout::Static { .. } => unikv::verify_scratch_slots(
                        crate::config::speculation(config),
                        crate::config::scratch_shape(config),
                    ),
                    Layout::Unified => 0,
                },
            };
            let (recorder, status) = Recorder::create(path, header)?;
            (Some(recorder), Some(status))
        }
        None => (None, None),
    };
    let mut marks = recorder.as_ref().map(Recorder::marks);
    let mut notes = |note: SpecNote<'_>| {
        let Some(marks) = &mut marks else { return };
        match note {
            SpecNote::Begin => marks.begin(),
            SpecNote::Verified { drafts } => marks.verify(drafts),
            SpecNote::Settled { accepted, paths } => marks.settle(accepted, paths),
        }
    };
    let stats = scheduler::run_noted(workload, config, recorder, &mut notes, progress);
    drop(marks);
    let stats = stats?;
    // The cache, the recorder in it and its marks are dropped: the trace is flushed and
    // its status final.
    if let Some(status) = status {
        status.check()?;
    }
    Ok(stats)
}

/// Checks that `path` can be opened for writing, without changing it: an existing file
/// is opened (not truncated); a missing one is created and removed again. An existing
/// directory, a read-only file or a missing parent directory is an error.
pub fn check_writable_file(path: &Path) -> Result<(), ReplayError> {
    let open = |create_new| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(create_new)
            .open(path)
    };
    match open(true) {
        Ok(file) => {
            drop(file);
            std::fs::remove_file(path)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => open(false).map(drop),
        Err(e) => Err(e),
    }
    .map_err(|source| ReplayError::Io {
        path: path.display().to_string(),
        source,
    })
}

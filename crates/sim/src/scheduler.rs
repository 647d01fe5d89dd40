//! The seam where the deterministic scheduler plugs in: [`run`] replays one workload
//! through one layout at one page size and returns its [`RunStats`].
//!
//! Everything around it — presets and traces, the command line, the progress bar, the
//! table, the JSON and the SVGs, the verdict — is built and tested; [`run`] itself needs
//! the `HybridCache` facade and returns [`SimError::NotYetWired`] until it exists. It
//! never fabricates results.
//!
//! # Contract for the implementation
//! - Deterministic: the same `(workload, config)` gives the same [`RunStats`] except
//!   `step_cpu_ns`, the only wall-clock field (no wall-clock input to any decision).
//! - It runs at [`RunConfig::invariant_level`]: the caller ([`crate::replay`]) puts that
//!   level in force on the calling thread with `unikv::invariants::scoped_level`, so a
//!   scheduler that stays on that thread needs to do nothing.
//! - It calls `progress` once per step with cumulative counts (cheap: the bar redraws at
//!   most 20 times a second); keep that call outside the timed region of `step_cpu_ns`.
//! - It never hangs: a budget that cannot hold one request alone is
//!   [`SimError::BudgetTooSmall`] before the first step, and a run that stops making
//!   progress (or passes [`RunConfig::max_steps`]) is [`SimError::Stalled`].
//! - It fills `samples` through [`crate::report::SampleRecorder`] (bounded, evenly spaced).

use crate::error::SimError;
use crate::model::ModelShape;
use crate::report::RunStats;
use crate::workload::Workload;
use serde::Serialize;
use std::fmt;
use std::path::PathBuf;
use unikv_invariants::Level;

/// How the KV memory is organised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// The baseline: two fixed pools (FULL and SWA) sized at start-up by
    /// [`RunConfig::swa_full_ratio`], and a FULL→SWA index map (`StaticSwa`). The
    /// `Default`, so that `RunStats::default()` exists.
    #[default]
    Static,
    /// One byte buffer, FULL growing from one end and SWA from the other (`UnifiedSwa`).
    Unified,
}

impl Layout {
    /// Both layouts, static first (the table's column order).
    pub const BOTH: [Layout; 2] = [Layout::Static, Layout::Unified];

    /// `static` or `unified`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Layout::Static => "static",
            Layout::Unified => "unified",
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything one run needs besides the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// The model whose KV shapes size the sub-pools.
    pub model: ModelShape,
    /// Static or unified.
    pub layout: Layout,
    /// Tokens per page (≥ 1).
    pub page_size: u32,
    /// The KV budget in bytes: the one buffer of the unified layout, or both pools of the
    /// static one together.
    pub memory_bytes: u64,
    /// The static layout's SWA tokens per FULL token (the reference engine's default
    /// `swa_full_tokens_ratio`, 0.8). Ignored by the unified layout.
    pub swa_full_ratio: f64,
    /// The seed the workload was generated from; also seeds any tie-break the scheduler
    /// makes at random.
    pub seed: u64,
    /// The invariant level the run is checked at (Strict by default).
    pub invariant_level: Level,
    /// Largest prefill chunk, in tokens (chunked prefill), per step across the batch.
    pub chunk_tokens: u32,
    /// At most this many samples in [`RunStats::samples`].
    pub max_samples: usize,
    /// The run fails with [`SimError::Stalled`] after this many steps.
    pub max_steps: u64,
    /// Where to write the allocator operations of this run (`--record-ops`), if anywhere.
    pub record_ops: Option<PathBuf>,
}

impl RunConfig {
    /// The reference engine's default SWA:FULL token ratio for the static pools.
    pub const DEFAULT_SWA_FULL_RATIO: f64 = 0.8;
    /// The default prefill chunk: 8,192 tokens per step (a common
    /// `--chunked-prefill-size`; the reference engine picks 2,048 to 16,384 by GPU memory).
    pub const DEFAULT_CHUNK_TOKENS: u32 = 8_192;
    /// The default cap on plotted samples per run.
    pub const DEFAULT_MAX_SAMPLES: usize = 512;
    /// The default step limit: far beyond what any preset needs (even at concurrency 1
    /// none takes 10⁶ steps), low enough to stop a livelock in minutes.
    pub const DEFAULT_MAX_STEPS: u64 = 10_000_000;

    /// A configuration with the defaults for everything but the run's identity.
    pub fn new(model: ModelShape, layout: Layout, page_size: u32, memory_bytes: u64) -> RunConfig {
        RunConfig {
            model,
            layout,
            page_size,
            memory_bytes,
            swa_full_ratio: RunConfig::DEFAULT_SWA_FULL_RATIO,
            seed: 0,
            invariant_level: Level::Strict,
            chunk_tokens: RunConfig::DEFAULT_CHUNK_TOKENS,
            max_samples: RunConfig::DEFAULT_MAX_SAMPLES,
            max_steps: RunConfig::DEFAULT_MAX_STEPS,
            record_ops: None,
        }
    }
}

/// Where a run stands, reported to the progress callback after every step. All counts
/// are cumulative and never decrease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepProgress {
    /// Steps run so far.
    pub step: u64,
    /// Tokens of the workload (prompt and output) processed at least once: a retraction
    /// does not move this back (recomputing a retracted prefix is not progress).
    /// At most [`Workload::total_tokens`].
    pub tokens_done: u64,
    /// Requests finished.
    pub requests_completed: u64,
}

/// The scheduler's signature, so that the replay driver can be exercised with another
/// implementation (tests) and the real one alike.
pub type RunFn = dyn Fn(&Workload, &RunConfig, &dyn Fn(StepProgress)) -> Result<RunStats, SimError>;

/// Replays `workload` through `config.layout` at `config.page_size` and reports what
/// happened, calling `progress` after every step.
///
/// Not wired yet: returns [`SimError::NotYetWired`] until the `HybridCache` facade
/// exists (see the module documentation for the contract an implementation keeps).
pub fn run(
    workload: &Workload,
    config: &RunConfig,
    progress: &dyn Fn(StepProgress),
) -> Result<RunStats, SimError> {
    let _ = (workload, config, progress);
    Err(SimError::NotYetWired {
        what: "the replay scheduler",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Preset;

    #[test]
    fn run_says_it_is_not_wired_instead_of_inventing_numbers() {
        let w = Preset::Smoke.build(0);
        let config = RunConfig::new(ModelShape::GPT_OSS_20B, Layout::Unified, 1, 1 << 30);
        let err = run(&w, &config, &|_| {}).unwrap_err();
        assert!(matches!(err, SimError::NotYetWired { .. }), "{err:?}");
        assert!(err.to_string().contains("HybridCache"), "{err}");
    }

    #[test]
    fn layouts_print_and_serialise_in_lower_case() {
        assert_eq!(Layout::Static.to_string(), "static");
        assert_eq!(
            serde_json::to_string(&Layout::Unified).unwrap(),
            "\"unified\""
        );
    }
}

//! The crate's one error type, [`ReplayError`]: a run that cannot be configured, finish
//! or report, or an input or output of the replay that fails.

use unikv::Layout;

/// What can go wrong in a replay: the cache refused the configuration or an operation,
/// a run cannot finish, a workload, trace or ops trace is bad, an output cannot be
/// written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The cache refused an operation the scheduler made (a bug, not memory pressure:
    /// running out of memory is handled by retraction), or a configuration.
    #[error("cache: {0}")]
    Cache(#[from] unikv::Error),
    /// A workload or its input (a preset, a `--trace` file) is bad.
    #[error(transparent)]
    Workload(#[from] unikv_workload::WorkloadError),
    /// The run's ops trace (`--record-ops`) could not be written.
    #[error(transparent)]
    Ops(#[from] unikv_ops::OpsError),
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file (or directory).
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Writing the report to its output failed.
    #[error("writing the report: {0}")]
    Output(#[source] std::io::Error),
    /// Serialising the JSON report failed.
    #[error("serialising the JSON report: {0}")]
    Json(#[from] serde_json::Error),
    /// The memory budget cannot hold what one request needs alone, so the run could
    /// never finish (reported up front instead of hanging).
    #[error(
        "{workload} ({layout}, page size {page_size}): a budget of {budget_bytes} bytes \
         cannot run it: {reason} (its KV and states alone take {needed_bytes} bytes{})",
        split_note(*.layout)
    )]
    BudgetTooSmall {
        /// The workload.
        workload: String,
        /// The layout.
        layout: Layout,
        /// The page size.
        page_size: u32,
        /// The budget given.
        budget_bytes: u64,
        /// The bytes that request's KV and states take on their own: the least budget
        /// that could finish the run in the unified layout (the static one splits the
        /// budget between fixed pools, so it may need more).
        needed_bytes: u64,
        /// Which request or sub-pool does not fit.
        reason: String,
    },
    /// A speculative option's value is out of range (`--spec 0`, `--spec-tree 65`).
    #[error("{option} {value}: {reason}")]
    BadSpeculation {
        /// The option.
        option: &'static str,
        /// The value given.
        value: u64,
        /// The range it must be in, and why.
        reason: String,
    },
    /// A run made no progress for too long or exceeded its step limit (a scheduler bug,
    /// reported instead of hanging).
    #[error("{workload} ({layout}, page size {page_size}): stopped after {steps} steps: {reason}")]
    Stalled {
        /// The workload.
        workload: String,
        /// The layout.
        layout: Layout,
        /// The page size.
        page_size: u32,
        /// Steps run.
        steps: u64,
        /// Why it stopped.
        reason: String,
    },
    /// The device a benchmark drives itself failed (`bench-overlap`: opening the GPU,
    /// launching a forward, reading its events).
    #[error("device: {0}")]
    Device(#[from] unikv::kernels::Error),
}

/// What a static layout adds to a budget's shortfall: its pools split the budget.
fn split_note(layout: Layout) -> &'static str {
    match layout {
        Layout::Static { .. } => ", and the static layout splits the budget between fixed pools",
        Layout::Unified => "",
    }
}

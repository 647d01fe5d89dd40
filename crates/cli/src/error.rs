//! The binary's one error type, [`CliError`]: a bad command line, an output that cannot
//! be written, or a library's error passed through with its own one-line message.

use unikv_ops::OpsError;
use unikv_replay::ReplayError;
use unikv_workload::WorkloadError;

/// Everything that can go wrong in the `unikv` binary: a bad command line, a plot or
/// report that cannot be written, or what a library reports (a bad trace, a run that
/// cannot finish).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A workload, trace, model or size is bad.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// An ops trace cannot be read or replayed (`bench-ops`).
    #[error(transparent)]
    Ops(#[from] OpsError),
    /// A replay or a run failed.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The command line does not parse: clap's message on one line ([`crate::args::one_line`]).
    #[error("{0}")]
    Usage(String),
    /// A workload that needs a model with recurrent (Mamba/GDN) state
    /// (`mamba-starvation`) was asked for with a model that has none.
    #[error(
        "workload {workload} needs a model with recurrent (Mamba/GDN) state, and {model} \
         has none (models with it: {recurrent})"
    )]
    NeedsRecurrentModel {
        /// The workload.
        workload: &'static str,
        /// The model given.
        model: &'static str,
        /// The named models with recurrent state, comma-separated.
        recurrent: String,
    },
    /// `--record-ops` with more than one run: one ops file describes one run.
    #[error(
        "--record-ops records one run, but these options give {runs}; \
         choose one --workload, one --page-size and one --layout (static or unified)"
    )]
    RecordOpsNeedsOneRun {
        /// How many runs the options give.
        runs: usize,
    },
    /// `bench-scale --record-ops` with more than one run (runs × scales): one ops file
    /// describes one run.
    #[error(
        "--record-ops records one run, but these options give {runs} (runs × scales); \
         choose one --workload, one --page-size, one --layout (static or unified) and one \
         --scales K"
    )]
    ScaleRecordOpsNeedsOneRun {
        /// How many runs the options and the scales give.
        runs: usize,
    },
    /// An output that is one of the command's inputs: writing it would destroy what the
    /// command reads.
    #[error(
        "{output} {path} is the {input} file: an output never overwrites an input \
         (choose another path)"
    )]
    OutputIsInput {
        /// The output's option (`--record-ops`, `--svg`).
        output: &'static str,
        /// The input's option (`--trace`).
        input: &'static str,
        /// The path as given.
        path: String,
    },
    /// A range of `sim` seeds that is empty or passes `u64::MAX`.
    #[error(transparent)]
    SeedRange(#[from] unikv_dst::SeedRangeError),
    /// `--spec-late` without a draft to settle late.
    #[error("--spec-late needs --spec K or --spec-tree N (it delays their accepted counts)")]
    SpecLateAlone,
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file (or directory).
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Standard output was closed when the process started: nothing could be reported.
    #[error("standard output is closed: the report would be lost (redirect it to a file)")]
    StdoutClosed,
    /// Writing the report to its output failed.
    #[error("writing the report: {0}")]
    Output(#[source] std::io::Error),
    /// Serialising the JSON report failed.
    #[error("serialising the JSON report: {0}")]
    Json(#[from] serde_json::Error),
    /// Drawing an SVG plot failed.
    #[error("{path}: drawing the plot failed: {message}")]
    Svg {
        /// The SVG file.
        path: String,
        /// The plotting library's message.
        message: String,
    },
}

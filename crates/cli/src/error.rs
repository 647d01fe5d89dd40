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
    /// A command-line argument is not valid UTF-8.
    #[error("argument {arg:?} is not valid UTF-8")]
    NotUtf8 {
        /// The argument, with invalid sequences replaced.
        arg: String,
    },
    /// The first argument is not a command.
    #[error("unknown command {command:?} (commands: replay, bench-ops; try `unikv --help`)")]
    UnknownCommand {
        /// What was given.
        command: String,
    },
    /// An option the command does not have.
    #[error("unknown option {option:?} for `unikv {command}` (try `unikv {command} --help`)")]
    UnknownOption {
        /// The command.
        command: &'static str,
        /// What was given.
        option: String,
    },
    /// An option that takes a value came last, or with an empty value.
    #[error("option {option} needs a value")]
    MissingValue {
        /// The option.
        option: &'static str,
    },
    /// An option that may be given once was given again.
    #[error("option {option} is given twice (it takes one value)")]
    RepeatedOption {
        /// The option.
        option: &'static str,
    },
    /// Options that contradict each other.
    #[error("conflicting options: {options}")]
    ConflictingOptions {
        /// Which, and why.
        options: &'static str,
    },
    /// A list-valued option with an empty item (`--page-size 1,,256`).
    #[error("option {option}: empty item in {value:?} (items are separated by single commas)")]
    EmptyListItem {
        /// The option.
        option: &'static str,
        /// The whole value given.
        value: String,
    },
    /// A flag that takes no value was given one (`--json=yes`).
    #[error("option {option} takes no value (got {value:?})")]
    UnexpectedValue {
        /// The option.
        option: &'static str,
        /// The value given.
        value: String,
    },
    /// A positional argument where the command takes none (or no more).
    #[error("unexpected argument {arg:?} for `unikv {command}`")]
    UnexpectedArgument {
        /// The command.
        command: &'static str,
        /// The argument.
        arg: String,
    },
    /// A command's required positional argument is missing.
    #[error("`unikv {command}` needs {what}")]
    MissingArgument {
        /// The command.
        command: &'static str,
        /// What it needs.
        what: &'static str,
    },
    /// `--workload` names no preset.
    #[error("unknown workload {name:?} (known: {known})")]
    UnknownWorkload {
        /// What was given.
        name: String,
        /// The preset names, comma-separated.
        known: String,
    },
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
    /// `--layout` is not `static`, `unified` or `both`.
    #[error("unknown layout {value:?} (expected static, unified or both)")]
    UnknownLayout {
        /// What was given.
        value: String,
    },
    /// `--device` is not `cpu` or `none`.
    #[error("unknown device {value:?} (expected cpu or none)")]
    UnknownDevice {
        /// What was given.
        value: String,
    },
    /// `--invariants` is not a level.
    #[error("unknown invariant level {value:?} (expected off, warn, strict, 0, 1, 2)")]
    UnknownLevel {
        /// What was given.
        value: String,
    },
    /// A numeric option's value is not acceptable.
    #[error("bad value {value:?} for {option}: {reason}")]
    BadNumber {
        /// The option.
        option: &'static str,
        /// What was given.
        value: String,
        /// Why it is refused.
        reason: &'static str,
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

//! The crate's one error type, [`SimError`], and [`TraceProblem`], what is wrong with one
//! line of a `--trace` file.

use crate::input::LineProblem;
use crate::scheduler::Layout;
use std::fmt;

/// Everything that can go wrong in the simulator: a bad command line, a bad trace, a
/// file that cannot be read or written, a run that cannot finish.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The cache refused an operation the scheduler made (a bug, not memory pressure:
    /// running out of memory is handled by retraction).
    #[error("cache: {0}")]
    Cache(#[from] unikv::Error),
    /// An ops trace (`--record-ops`, `bench-ops`) could not be written, read or replayed.
    #[error("ops trace: {reason}")]
    OpsTrace {
        /// What went wrong, with the file and line.
        reason: String,
    },
    /// A line of an ops trace (`bench-ops`) breaks a limit, is malformed, or cannot be
    /// replayed.
    #[error("{source_name}:{line}: {problem}")]
    OpsLine {
        /// The trace's path.
        source_name: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        problem: OpsProblem,
    },
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
    /// `--model` names no model.
    #[error("unknown model {name:?} (known: {known})")]
    UnknownModel {
        /// What was given.
        name: String,
        /// The model names, comma-separated.
        known: String,
    },
    /// A `--model NAME:KEY=VALUE,...` override that does not parse.
    #[error("bad model {spec:?}: {reason}")]
    BadModel {
        /// The spec given.
        spec: String,
        /// What is wrong with it.
        reason: String,
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
    /// A memory size (`--memory`) that does not parse.
    #[error("bad memory size {value:?}: {reason} (examples: 24GiB, 512MiB, 1.5GB, 4096)")]
    BadMemory {
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
    /// A line of a trace file is malformed.
    #[error("{source_name}:{line}: {problem}")]
    Trace {
        /// The trace's path (or a name for text parsed directly).
        source_name: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        problem: TraceProblem,
    },
    /// A trace file holds no request.
    #[error("{source_name}: the trace holds no request (one JSON object per line)")]
    EmptyTrace {
        /// The trace's path.
        source_name: String,
    },
    /// A workload breaks a rule the scheduler relies on.
    #[error("workload {name:?}: {reason}")]
    BadWorkload {
        /// The workload's name.
        name: String,
        /// What is wrong.
        reason: String,
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
    /// The memory budget cannot hold what one request needs alone, so the run could
    /// never finish (reported up front instead of hanging).
    #[error(
        "{workload} ({layout}, page size {page_size}): a budget of {budget_bytes} bytes \
         cannot run it: {reason} (needs at least {needed_bytes} bytes)"
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
        /// The least budget that could finish the run.
        needed_bytes: u64,
        /// Which request or sub-pool does not fit.
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
}

/// What is wrong with one line of an ops trace (see [`crate::ops`] and
/// `docs/ops-trace.md` for the format and its limits).
#[derive(Debug)]
#[non_exhaustive]
pub enum OpsProblem {
    /// The line could not be read within the input limits ([`crate::input`]).
    Line(LineProblem),
    /// The line is not an operation.
    Json {
        /// serde_json's message.
        message: String,
    },
    /// The first line is not the header.
    NoHeader,
    /// A header after the first line.
    SecondHeader,
    /// A header field the replay cannot use.
    Header {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
    /// The trace holds more operations than the limit.
    TooManyOps {
        /// The limit.
        limit: usize,
    },
    /// A run `[first, 0]`.
    EmptyRun {
        /// The run's first id.
        first: u32,
    },
    /// A run whose ids go past the largest id, `u32::MAX`.
    RunPastLastId {
        /// The run's first id.
        first: u32,
        /// Its count.
        count: u32,
    },
    /// An operation that names more ids than the limit.
    TooManyIds {
        /// Ids named (or asked for).
        ids: u64,
        /// The limit.
        limit: u64,
    },
    /// A row position, row length or page count above the limit.
    NumberTooLarge {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// An alloc request whose `seq_len` is below its `prefix_len`, or a decode request
    /// that does not grow by one token.
    BadRequest {
        /// Tokens held before.
        prefix_len: usize,
        /// Tokens held after.
        seq_len: usize,
        /// What it must be.
        expected: &'static str,
    },
    /// An alloc whose `out` names another number of ids than its requests ask for.
    OutCount {
        /// Ids in `out`.
        out: u64,
        /// Ids the requests ask for.
        asked: u64,
    },
    /// A segment whose row position is not a multiple of the page size.
    UnalignedStart {
        /// The row position.
        start: usize,
        /// The header's page size.
        page_size: u32,
    },
    /// A segment (or row) whose first id is not the first token of its page.
    StartsMidPage {
        /// The first id.
        id: u32,
        /// Its position in its page.
        offset: u32,
        /// The header's page size.
        page_size: u32,
    },
    /// The allocator refused the operation.
    Refused {
        /// The operation.
        op: &'static str,
        /// The allocator's error.
        error: unikv::pools::Error,
    },
    /// An alloc returned other ids than recorded.
    Diverged {
        /// The operation.
        op: &'static str,
    },
}

impl fmt::Display for OpsProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpsProblem::Line(problem) => problem.fmt(f),
            OpsProblem::Json { message } => write!(f, "not an operation: {message}"),
            OpsProblem::NoHeader => f.write_str("the first line must be the header"),
            OpsProblem::SecondHeader => f.write_str("a second header"),
            OpsProblem::Header {
                field,
                value,
                expected,
            } => write!(f, "header field {field} is {value}, expected {expected}"),
            OpsProblem::TooManyOps { limit } => write!(
                f,
                "the trace holds more than {limit} operations (the limit of an ops trace)"
            ),
            OpsProblem::EmptyRun { first } => {
                write!(
                    f,
                    "the run [{first}, 0] names no id (a run's count is >= 1)"
                )
            }
            OpsProblem::RunPastLastId { first, count } => write!(
                f,
                "the run [{first}, {count}] goes past the largest id {}",
                u32::MAX
            ),
            OpsProblem::TooManyIds { ids, limit } => write!(
                f,
                "the operation names {ids} ids, more than {limit} (the limit of one operation)"
            ),
            OpsProblem::NumberTooLarge {
                field,
                value,
                limit,
            } => write!(
                f,
                "{field} is {value}, more than {limit} (the limit of a row position, length or page count)"
            ),
            OpsProblem::BadRequest {
                prefix_len,
                seq_len,
                expected,
            } => write!(
                f,
                "a request with prefix_len {prefix_len} and seq_len {seq_len}: expected {expected}"
            ),
            OpsProblem::OutCount { out, asked } => {
                write!(f, "out names {out} ids but the requests ask for {asked}")
            }
            OpsProblem::UnalignedStart { start, page_size } => write!(
                f,
                "segment row position {start} is not a multiple of the page size {page_size}"
            ),
            OpsProblem::StartsMidPage {
                id,
                offset,
                page_size,
            } => write!(
                f,
                "the ids start mid-page: id {id} is token {offset} of its page (page size \
                 {page_size}), not the first"
            ),
            OpsProblem::Refused { op, error } => {
                write!(f, "{op}: the allocator refused it: {error}")
            }
            OpsProblem::Diverged { op } => write!(
                f,
                "{op}: replay diverged: the allocator returned other ids than recorded"
            ),
        }
    }
}

/// What is wrong with one line of a `--trace` file (see [`crate::trace`] for the format).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceProblem {
    /// The line could not be read within the input limits ([`crate::input`]).
    Line(LineProblem),
    /// The trace holds more requests than the simulator accepts.
    TooManyRequests {
        /// The limit, in requests.
        limit: usize,
    },
    /// The line is not JSON.
    Json {
        /// serde_json's message (with the column).
        message: String,
    },
    /// The line is JSON but not an object.
    NotAnObject,
    /// A field the format does not have (a typo, usually).
    UnknownField {
        /// The field.
        field: String,
    },
    /// A required field is missing.
    MissingField {
        /// The field.
        field: &'static str,
    },
    /// A field has the wrong type or range.
    WrongType {
        /// The field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
    },
    /// `output_len` is 0.
    ZeroOutput,
    /// Both `prompt_tokens` and `prompt_len`.
    BothTokensAndLength,
    /// Neither `prompt_tokens` nor `prompt_len`.
    NoPrompt,
    /// `prompt_tokens` is empty or `prompt_len` is 0.
    EmptyPrompt,
    /// `prefix_id` without `prefix_len`.
    PrefixIdWithoutLen,
    /// `prefix_len` without `prefix_id`.
    PrefixLenWithoutId,
    /// A shared prefix on a line that lists its tokens (tokens already say what is shared).
    PrefixWithTokens,
    /// `prefix_len` is 0.
    EmptyPrefix,
    /// `prefix_len` exceeds `prompt_len`.
    PrefixLongerThanPrompt {
        /// The prefix length.
        prefix_len: u64,
        /// The prompt length.
        prompt_len: u64,
    },
    /// The trace's prompts add up to more tokens than the simulator accepts.
    TooManyTokens {
        /// The limit, in prompt tokens.
        limit: u64,
    },
    /// A `prefix_id` used earlier with another `prefix_len`.
    PrefixLenMismatch {
        /// The prefix id.
        prefix_id: String,
        /// The length on this line.
        prefix_len: u64,
        /// The length it was first given.
        first_len: u64,
        /// The line it was first given on.
        first_line: usize,
    },
}

impl fmt::Display for TraceProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceProblem::Line(problem) => problem.fmt(f),
            TraceProblem::TooManyRequests { limit } => write!(
                f,
                "the trace holds more than {limit} requests (split the trace)"
            ),
            TraceProblem::Json { message } => write!(f, "not valid JSON: {message}"),
            TraceProblem::NotAnObject => f.write_str("expected a JSON object"),
            TraceProblem::UnknownField { field } => write!(
                f,
                "unknown field {field:?} (fields: arrival_step, prompt_tokens, prompt_len, \
                 prefix_id, prefix_len, output_len)"
            ),
            TraceProblem::MissingField { field } => write!(f, "missing field {field:?}"),
            TraceProblem::WrongType { field, expected } => {
                write!(f, "field {field:?} must be {expected}")
            }
            TraceProblem::ZeroOutput => f.write_str("output_len must be at least 1"),
            TraceProblem::BothTokensAndLength => {
                f.write_str("give either prompt_tokens or prompt_len, not both")
            }
            TraceProblem::NoPrompt => {
                f.write_str("missing the prompt: give prompt_tokens or prompt_len")
            }
            TraceProblem::EmptyPrompt => f.write_str("the prompt is empty"),
            TraceProblem::PrefixIdWithoutLen => f.write_str("prefix_id needs prefix_len"),
            TraceProblem::PrefixLenWithoutId => f.write_str("prefix_len needs prefix_id"),
            TraceProblem::PrefixWithTokens => f.write_str(
                "prefix_id/prefix_len go with prompt_len; with prompt_tokens the tokens \
                 themselves say what is shared",
            ),
            TraceProblem::EmptyPrefix => f.write_str("prefix_len must be at least 1"),
            TraceProblem::PrefixLongerThanPrompt {
                prefix_len,
                prompt_len,
            } => write!(
                f,
                "prefix_len {prefix_len} is longer than prompt_len {prompt_len}"
            ),
            TraceProblem::TooManyTokens { limit } => write!(
                f,
                "the trace's prompts exceed {limit} tokens in all (split the trace)"
            ),
            TraceProblem::PrefixLenMismatch {
                prefix_id,
                prefix_len,
                first_len,
                first_line,
            } => write!(
                f,
                "prefix_id {prefix_id:?} has prefix_len {prefix_len} here but {first_len} on \
                 line {first_line} (one id, one prefix)"
            ),
        }
    }
}

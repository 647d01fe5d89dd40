//! The crate's one error type, [`OpsError`], and [`OpsProblem`], what is wrong with one
//! line of an ops trace.

use std::fmt;
use unikv_workload::input::LineProblem;

/// What can go wrong with an ops trace: it cannot be written, read or replayed, or one of
/// its lines is wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// The allocator a header describes could not be built.
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
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// What is wrong with one line of an ops trace (see [`crate::format`] and
/// `docs/ops-trace.md` for the format and its limits).
#[derive(Debug)]
#[non_exhaustive]
pub enum OpsProblem {
    /// The line could not be read within the input limits ([`unikv_workload::input`]).
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
    /// The operation broke an invariant of the allocator, which contained it instead of
    /// refusing it (a double free, a free of the sink page, a free of a page never
    /// allocated): found by [`crate::bench::check`] at level strict.
    Breach {
        /// The operation.
        op: &'static str,
        /// The breaches, with the allocator's message of the last one.
        error: unikv::invariants::Error,
    },
    /// An alloc returned other ids than recorded.
    Diverged {
        /// The operation.
        op: &'static str,
    },
    /// A `verify` or `settle` line in a trace whose header declares `unikv.ops.v1`
    /// (speculative lines came with `unikv.ops.v2`).
    SpeculativeInV1 {
        /// The operation.
        op: &'static str,
    },
    /// A `verify` or `settle` line whose drafts or accepted positions are not ones the
    /// cache takes.
    BadSpeculative {
        /// The operation.
        op: &'static str,
        /// Which entry (request of the batch).
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A `verify` or `settle` line that claims more allocator lines than came after the
    /// line before it, or a `verify` whose lines hold no `alloc_extend` of its drafts.
    BadSpan {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
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
            OpsProblem::Breach { op, error } => {
                write!(f, "{op}: the allocator refused it: {error}")
            }
            OpsProblem::Diverged { op } => write!(
                f,
                "{op}: replay diverged: the allocator returned other ids than recorded"
            ),
            OpsProblem::SpeculativeInV1 { op } => write!(
                f,
                "{op} in a unikv.ops.v1 trace (speculative operations need schema \
                 unikv.ops.v2)"
            ),
            OpsProblem::BadSpeculative { op, index, reason } => {
                write!(f, "{op}: entry {index}: {reason}")
            }
            OpsProblem::BadSpan { op, reason } => write!(f, "{op}: {reason}"),
        }
    }
}

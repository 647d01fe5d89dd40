//! The crate's one error type, [`WorkloadError`], and [`TraceProblem`], what is wrong with
//! one line of a `--trace` file.

use crate::input::LineProblem;
use std::fmt;

/// What can go wrong making a workload: a model or size that does not parse, a trace
/// that cannot be read or is malformed, a workload that breaks a rule the scheduler
/// relies on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkloadError {
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
    /// A memory size (`--memory`) that does not parse.
    #[error("bad memory size {value:?}: {reason} (examples: 24GiB, 512MiB, 1.5GB, 4096)")]
    BadMemory {
        /// What was given.
        value: String,
        /// Why it is refused.
        reason: &'static str,
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
    /// A Hugging Face `config.json` that cannot be mapped to a model.
    #[error("model config: {0}")]
    HfConfig(#[from] crate::hf::HfConfigError),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
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

//! `--trace FILE`: a user's own request list, as JSON Lines, turned into a [`Workload`].
//!
//! # Format
//!
//! One JSON object per line; blank lines are skipped; line numbers in errors count every
//! line of the file from 1.
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `arrival_step` | integer 0 to 1,000,000, required | the scheduler step the request arrives at |
//! | `output_len` | integer 1 to 2^24, required | tokens to generate |
//! | `prompt_tokens` | array of u32, non-empty | the prompt's token ids, used as given |
//! | `prompt_len` | integer 1 to 2^24 | the prompt's length; its tokens are generated from `--seed` |
//! | `prefix_id` | string or integer | with `prompt_len`: the first `prefix_len` tokens are the prefix of that id, shared with every line naming it |
//! | `prefix_len` | integer ≥ 1, ≤ `prompt_len` | the shared prefix's length (the same on every line of an id) |
//!
//! Exactly one of `prompt_tokens` and `prompt_len`; `prefix_id` and `prefix_len` go
//! together and only with `prompt_len`. Any other field is an error (so a typo is not
//! silently ignored). Generated tokens follow the rules of [`crate::workload`]: requests
//! of one `prefix_id` share exactly that prefix, other generated prompts share nothing.
//!
//! ```text
//! {"arrival_step": 0, "prompt_len": 4224, "prefix_id": "system", "prefix_len": 4096, "output_len": 2048}
//! {"arrival_step": 0, "prompt_len": 512, "output_len": 4096}
//! {"arrival_step": 7, "prompt_tokens": [200006, 17360, 200008], "output_len": 16}
//! ```
//!
//! Limits: a line holds at most 16 MiB and the file at most 4 GiB ([`crate::input`]), the
//! trace at most [`MAX_TRACE_REQUESTS`] requests and [`MAX_TRACE_TOKENS`] prompt tokens;
//! each is an error naming the limit and the line it is crossed on, reported as soon as
//! the reader gets there (`--trace /dev/zero` stops after 16 MiB).
//!
//! Requests are ordered by arrival step (stably: lines with the same step keep their
//! order) and numbered in that order. The trace's workload has no client-side
//! concurrency cap (its concurrency is its request count): arrival steps shape the load.

use crate::error::{TraceProblem, WorkloadError};
use crate::input::{BoundedLines, LineError};
use crate::workload::{RequestSpec, TokenSource, Workload};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;

/// The trace format, for `unikv replay --help`.
pub const FORMAT_HELP: &str = "\
TRACE FORMAT (--trace FILE): JSON Lines, one request per line, blank lines skipped.
  arrival_step   0..=1000000, required    step at which the request arrives
  output_len     1..=2^24, required       tokens to generate
  prompt_tokens  [u32, ...], non-empty    the prompt's token ids, as given
  prompt_len     1..=2^24                 or: the prompt's length (tokens from --seed)
  prefix_id      string or integer        with prompt_len: the first prefix_len tokens
  prefix_len     1..=prompt_len           are shared by every line with this id
  Exactly one of prompt_tokens / prompt_len; one prefix_len per prefix_id; no other
  fields. Requests run in arrival order; no concurrency cap besides memory.
  Limits: 16 MiB per line, 4 GiB per file, 2^20 requests, 2^28 prompt tokens in all.
  {\"arrival_step\": 0, \"prompt_len\": 4224, \"prefix_id\": \"system\", \"prefix_len\": 4096, \"output_len\": 2048}
  {\"arrival_step\": 7, \"prompt_tokens\": [200006, 17360, 200008], \"output_len\": 16}";

/// The longest prompt or output one line may ask for: 2^24 tokens, far beyond any
/// model's context, and small enough that a typo cannot make the simulator allocate
/// terabytes.
pub const MAX_REQUEST_TOKENS: u64 = 1 << 24;

/// The most prompt tokens a whole trace may hold: 2^28 (1 GiB of token ids).
pub const MAX_TRACE_TOKENS: u64 = 1 << 28;

/// The fields a line may have.
const FIELDS: [&str; 6] = [
    "arrival_step",
    "output_len",
    "prompt_tokens",
    "prompt_len",
    "prefix_id",
    "prefix_len",
];

/// The most requests a trace may hold: 2^20 (about a million; a replay of that many
/// requests takes hours).
pub const MAX_TRACE_REQUESTS: usize = 1 << 20;

/// The latest step a request may arrive at: 10^6, a tenth of the scheduler's default
/// step limit (`RunConfig::DEFAULT_MAX_STEPS` in unikv-replay), so that a trace cannot ask for a
/// run that is bound to stall after millions of idle steps.
pub const MAX_ARRIVAL_STEP: u64 = 1_000_000;

/// Reads the trace at `path` into a workload named after the file's stem, generating
/// prompt tokens from `seed`. The file is read line by line within the limits of
/// [`crate::input`], so no file (`/dev/zero` included) is read past them.
pub fn load_trace(path: &Path, seed: u64) -> Result<Workload, WorkloadError> {
    let io = |source| WorkloadError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let name = workload_name(path);
    parse_lines(
        std::io::BufReader::new(file),
        &path.display().to_string(),
        &name,
        seed,
        MAX_TRACE_REQUESTS,
    )
}

/// Parses trace `text` into the workload `name`; `source_name` (the path, usually) is
/// what errors cite.
pub fn parse_trace(
    text: &str,
    source_name: &str,
    name: &str,
    seed: u64,
) -> Result<Workload, WorkloadError> {
    parse_lines(text.as_bytes(), source_name, name, seed, MAX_TRACE_REQUESTS)
}

/// [`parse_trace`] over a reader, within the limits of [`crate::input`] and at most
/// `max_requests` requests ([`MAX_TRACE_REQUESTS`] but in tests).
fn parse_lines(
    reader: impl BufRead,
    source_name: &str,
    name: &str,
    seed: u64,
    max_requests: usize,
) -> Result<Workload, WorkloadError> {
    // First pass: check every line (and the totals) before generating any token, so a
    // bad line is reported at once however large the lines before it are.
    let mut lines: Vec<(usize, Line)> = Vec::new();
    // prefix id → (its length, the line that introduced it)
    let mut prefix_lens: HashMap<&str, (u64, usize)> = HashMap::new();
    let mut total_tokens: u64 = 0;
    let mut reader = BoundedLines::new(reader);
    while let Some(next) = reader.next_line() {
        let fail = |line, problem| WorkloadError::Trace {
            source_name: source_name.to_string(),
            line,
            problem,
        };
        let (line, raw) = match next {
            Ok(line_and_text) => line_and_text,
            Err((line, LineError::Problem(problem))) => {
                return Err(fail(line, TraceProblem::Line(problem)));
            }
            Err((_, LineError::Io(source))) => {
                return Err(WorkloadError::Io {
                    path: source_name.to_string(),
                    source,
                });
            }
        };
        if raw.trim().is_empty() {
            continue;
        }
        let parsed = parse_line(raw).map_err(|problem| fail(line, problem))?;
        total_tokens += parsed.prompt.len();
        if total_tokens > MAX_TRACE_TOKENS {
            return Err(fail(
                line,
                TraceProblem::TooManyTokens {
                    limit: MAX_TRACE_TOKENS,
                },
            ));
        }
        if lines.len() == max_requests {
            return Err(fail(
                line,
                TraceProblem::TooManyRequests {
                    limit: max_requests,
                },
            ));
        }
        lines.push((line, parsed));
    }
    for (line, parsed) in &lines {
        if let Prompt::Generated {
            prefix: Some((id, prefix_len)),
            ..
        } = &parsed.prompt
        {
            let (first_len, first_line) = *prefix_lens.entry(id).or_insert((*prefix_len, *line));
            if first_len != *prefix_len {
                return Err(WorkloadError::Trace {
                    source_name: source_name.to_string(),
                    line: *line,
                    problem: TraceProblem::PrefixLenMismatch {
                        prefix_id: id.clone(),
                        prefix_len: *prefix_len,
                        first_len,
                        first_line,
                    },
                });
            }
        }
    }
    // Second pass: generate the prompts.
    let mut tokens = TokenSource::new(seed, &format!("trace:{name}"));
    let mut prefixes: HashMap<String, Vec<u32>> = HashMap::new();
    let mut requests = Vec::with_capacity(lines.len());
    for (_, parsed) in lines {
        let prompt = match parsed.prompt {
            Prompt::Tokens(t) => t,
            Prompt::Generated { len, prefix: None } => tokens.segment(len),
            Prompt::Generated {
                len,
                prefix: Some((id, prefix_len)),
            } => {
                let prefix = prefixes
                    .entry(id)
                    .or_insert_with(|| tokens.segment(prefix_len));
                let mut prompt = prefix.clone();
                prompt.extend(tokens.segment(len - prefix_len));
                prompt
            }
        };
        requests.push(RequestSpec {
            id: 0, // numbered after ordering
            arrival_step: parsed.arrival_step,
            prompt,
            output_len: parsed.output_len,
            after: Vec::new(),
            output: None,
        });
    }
    if requests.is_empty() {
        return Err(WorkloadError::EmptyTrace {
            source_name: source_name.to_string(),
        });
    }
    requests.sort_by_key(|r| r.arrival_step); // stable: equal steps keep line order
    for (i, r) in requests.iter_mut().enumerate() {
        r.id = i as u32;
    }
    let workload = Workload {
        name: name.to_string(),
        concurrency: u32::try_from(requests.len()).unwrap_or(u32::MAX),
        requests,
    };
    workload.validate()?;
    Ok(workload)
}

/// A workload name from a trace path: the file stem, with characters other than ASCII
/// letters, digits, `-`, `_` and `.` replaced by `_` (it names SVG files).
pub fn workload_name(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "trace".to_string()
    } else {
        name
    }
}

/// One line, checked.
#[derive(Debug)]
struct Line {
    arrival_step: u64,
    output_len: u32,
    prompt: Prompt,
}

#[derive(Debug)]
enum Prompt {
    Tokens(Vec<u32>),
    Generated {
        len: u64,
        /// (prefix id, prefix length)
        prefix: Option<(String, u64)>,
    },
}

impl Prompt {
    /// The prompt's length in tokens.
    fn len(&self) -> u64 {
        match self {
            Prompt::Tokens(t) => t.len() as u64,
            Prompt::Generated { len, .. } => *len,
        }
    }
}

fn parse_line(raw: &str) -> Result<Line, TraceProblem> {
    let value: Value = serde_json::from_str(raw).map_err(|e| TraceProblem::Json {
        message: crate::input::json_message(&e),
    })?;
    let Value::Object(object) = value else {
        return Err(TraceProblem::NotAnObject);
    };
    if let Some(field) = object.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(TraceProblem::UnknownField {
            field: field.clone(),
        });
    }
    let arrival_step = required(&object, "arrival_step")?;
    let arrival_step = as_u64(arrival_step, "arrival_step", "an integer >= 0")?;
    if arrival_step > MAX_ARRIVAL_STEP {
        return Err(TraceProblem::WrongType {
            field: "arrival_step",
            expected: "at most 1,000,000",
        });
    }
    let output_len = as_u64(
        required(&object, "output_len")?,
        "output_len",
        "an integer >= 1",
    )?;
    if output_len == 0 {
        return Err(TraceProblem::ZeroOutput);
    }
    if output_len > MAX_REQUEST_TOKENS {
        return Err(TraceProblem::WrongType {
            field: "output_len",
            expected: "at most 16,777,216",
        });
    }
    let output_len = output_len as u32;
    let prefix_id = object.get("prefix_id");
    let prefix_len = object.get("prefix_len");
    let prompt = match (object.get("prompt_tokens"), object.get("prompt_len")) {
        (Some(_), Some(_)) => return Err(TraceProblem::BothTokensAndLength),
        (None, None) => return Err(TraceProblem::NoPrompt),
        (Some(tokens), None) => {
            if prefix_id.is_some() || prefix_len.is_some() {
                return Err(TraceProblem::PrefixWithTokens);
            }
            let wrong = TraceProblem::WrongType {
                field: "prompt_tokens",
                expected: "an array of token ids (integers below 2^32)",
            };
            let Value::Array(items) = tokens else {
                return Err(wrong);
            };
            let ids = items
                .iter()
                .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or(wrong)?;
            if ids.is_empty() {
                return Err(TraceProblem::EmptyPrompt);
            }
            Prompt::Tokens(ids)
        }
        (None, Some(len)) => {
            let len = as_u64(len, "prompt_len", "an integer >= 1")?;
            if len == 0 {
                return Err(TraceProblem::EmptyPrompt);
            }
            if len > MAX_REQUEST_TOKENS {
                return Err(TraceProblem::WrongType {
                    field: "prompt_len",
                    expected: "at most 16,777,216",
                });
            }
            let prefix = match (prefix_id, prefix_len) {
                (None, None) => None,
                (Some(_), None) => return Err(TraceProblem::PrefixIdWithoutLen),
                (None, Some(_)) => return Err(TraceProblem::PrefixLenWithoutId),
                (Some(id), Some(plen)) => {
                    let id = match id {
                        Value::String(s) => s.clone(),
                        Value::Number(n) if n.is_u64() => n.to_string(),
                        _ => {
                            return Err(TraceProblem::WrongType {
                                field: "prefix_id",
                                expected: "a string or an integer >= 0",
                            });
                        }
                    };
                    let plen = as_u64(plen, "prefix_len", "an integer >= 1")?;
                    if plen == 0 {
                        return Err(TraceProblem::EmptyPrefix);
                    }
                    if plen > len {
                        return Err(TraceProblem::PrefixLongerThanPrompt {
                            prefix_len: plen,
                            prompt_len: len,
                        });
                    }
                    Some((id, plen))
                }
            };
            Prompt::Generated { len, prefix }
        }
    };
    Ok(Line {
        arrival_step,
        output_len,
        prompt,
    })
}

fn required<'a>(
    object: &'a Map<String, Value>,
    field: &'static str,
) -> Result<&'a Value, TraceProblem> {
    object
        .get(field)
        .ok_or(TraceProblem::MissingField { field })
}

fn as_u64(value: &Value, field: &'static str, expected: &'static str) -> Result<u64, TraceProblem> {
    value
        .as_u64()
        .ok_or(TraceProblem::WrongType { field, expected })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Workload, WorkloadError> {
        parse_trace(text, "t.jsonl", "t", 1)
    }

    /// The problem and line of a one-bad-line trace (the bad line comes second).
    fn problem_of(bad: &str) -> (usize, TraceProblem) {
        let text =
            format!("{{\"arrival_step\": 0, \"prompt_len\": 4, \"output_len\": 1}}\n{bad}\n");
        match parse(&text) {
            Err(WorkloadError::Trace { line, problem, .. }) => (line, problem),
            other => panic!("{bad}: expected a trace error, got {other:?}"),
        }
    }

    #[test]
    fn good_lines_parse_into_an_ordered_workload() {
        let text = r#"
{"arrival_step": 5, "prompt_tokens": [1, 2, 3], "output_len": 2}
{"arrival_step": 0, "prompt_len": 10, "prefix_id": "sys", "prefix_len": 6, "output_len": 4}

{"arrival_step": 0, "prompt_len": 8, "prefix_id": "sys", "prefix_len": 6, "output_len": 1}
{"arrival_step": 2, "prompt_len": 3, "output_len": 7}
{"arrival_step": 2, "prompt_len": 9, "prefix_id": 7, "prefix_len": 9, "output_len": 3}
"#;
        let w = parse(text).unwrap();
        assert_eq!(w.name, "t");
        assert_eq!(w.concurrency, 5);
        let shape: Vec<(u32, u64, usize, u32)> = w
            .requests
            .iter()
            .map(|r| (r.id, r.arrival_step, r.prompt.len(), r.output_len))
            .collect();
        assert_eq!(
            shape,
            [
                (0, 0, 10, 4),
                (1, 0, 8, 1),
                (2, 2, 3, 7),
                (3, 2, 9, 3),
                (4, 5, 3, 2)
            ]
        );
        assert_eq!(w.requests[4].prompt, [1, 2, 3]);
        // The two "sys" lines share exactly their 6-token prefix.
        let (a, b) = (&w.requests[0].prompt, &w.requests[1].prompt);
        assert_eq!(a[..6], b[..6]);
        assert_ne!(a[6], b[6]);
        // Different prefixes and unprefixed prompts start differently.
        assert_ne!(w.requests[2].prompt[0], a[0]);
        assert_ne!(w.requests[3].prompt[0], a[0]);
        // Same seed, same workload.
        assert_eq!(parse(text).unwrap(), w);
    }

    #[test]
    fn a_malformed_line_names_its_line_and_problem() {
        use TraceProblem as P;
        let cases: Vec<(&str, TraceProblem)> = vec![
            (
                "{\"arrival_step\": 0,",
                P::Json {
                    message: String::new(),
                },
            ),
            ("[1, 2]", P::NotAnObject),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "output_len": 1, "outputlen": 2}"#,
                P::UnknownField {
                    field: "outputlen".into(),
                },
            ),
            (
                r#"{"prompt_len": 4, "output_len": 1}"#,
                P::MissingField {
                    field: "arrival_step",
                },
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4}"#,
                P::MissingField {
                    field: "output_len",
                },
            ),
            (
                r#"{"arrival_step": -1, "prompt_len": 4, "output_len": 1}"#,
                P::WrongType {
                    field: "arrival_step",
                    expected: "an integer >= 0",
                },
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": "4", "output_len": 1}"#,
                P::WrongType {
                    field: "prompt_len",
                    expected: "an integer >= 1",
                },
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "output_len": 0}"#,
                P::ZeroOutput,
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "prompt_tokens": [1], "output_len": 1}"#,
                P::BothTokensAndLength,
            ),
            (r#"{"arrival_step": 0, "output_len": 1}"#, P::NoPrompt),
            (
                r#"{"arrival_step": 0, "prompt_tokens": [], "output_len": 1}"#,
                P::EmptyPrompt,
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 0, "output_len": 1}"#,
                P::EmptyPrompt,
            ),
            (
                r#"{"arrival_step": 0, "prompt_tokens": [1, -2], "output_len": 1}"#,
                P::WrongType {
                    field: "prompt_tokens",
                    expected: "an array of token ids (integers below 2^32)",
                },
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "prefix_id": "a", "output_len": 1}"#,
                P::PrefixIdWithoutLen,
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "prefix_len": 2, "output_len": 1}"#,
                P::PrefixLenWithoutId,
            ),
            (
                r#"{"arrival_step": 0, "prompt_tokens": [1], "prefix_id": "a", "prefix_len": 1, "output_len": 1}"#,
                P::PrefixWithTokens,
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "prefix_id": "a", "prefix_len": 0, "output_len": 1}"#,
                P::EmptyPrefix,
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "prefix_id": "a", "prefix_len": 5, "output_len": 1}"#,
                P::PrefixLongerThanPrompt {
                    prefix_len: 5,
                    prompt_len: 4,
                },
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 16777217, "output_len": 1}"#,
                P::WrongType {
                    field: "prompt_len",
                    expected: "at most 16,777,216",
                },
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "output_len": 4294967296}"#,
                P::WrongType {
                    field: "output_len",
                    expected: "at most 16,777,216",
                },
            ),
            (
                r#"{"arrival_step": 0, "prompt_len": 4, "prefix_id": [1], "prefix_len": 2, "output_len": 1}"#,
                P::WrongType {
                    field: "prefix_id",
                    expected: "a string or an integer >= 0",
                },
            ),
        ];
        for (bad, expected) in cases {
            let (line, problem) = problem_of(bad);
            assert_eq!(line, 2, "{bad}");
            match (&problem, &expected) {
                (P::Json { message }, P::Json { .. }) => {
                    assert!(message.contains("column"), "{message}")
                }
                _ => assert_eq!(problem, expected, "{bad}"),
            }
        }
    }

    #[test]
    fn a_prefix_id_keeps_one_length() {
        let text = "\n{\"arrival_step\": 0, \"prompt_len\": 9, \"prefix_id\": \"p\", \"prefix_len\": 4, \"output_len\": 1}\n\
                    {\"arrival_step\": 0, \"prompt_len\": 9, \"prefix_id\": \"p\", \"prefix_len\": 5, \"output_len\": 1}";
        let err = parse(text).unwrap_err();
        assert!(
            matches!(
                &err,
                WorkloadError::Trace {
                    line: 3,
                    problem: TraceProblem::PrefixLenMismatch {
                        first_line: 2,
                        prefix_len: 5,
                        first_len: 4,
                        ..
                    },
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "t.jsonl:3: prefix_id \"p\" has prefix_len 5 here but 4 on line 2 (one id, one prefix)"
        );
    }

    #[test]
    fn a_trace_too_large_to_hold_is_refused_before_it_is_generated() {
        let line = "{\"arrival_step\": 0, \"prompt_len\": 16777216, \"output_len\": 1}\n";
        let text = line.repeat(17);
        let err = parse(&text).unwrap_err();
        assert!(
            matches!(
                err,
                WorkloadError::Trace {
                    line: 17,
                    problem: TraceProblem::TooManyTokens { .. },
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn the_request_limit_is_reported_on_the_line_that_crosses_it() {
        let line = "{\"arrival_step\": 0, \"prompt_len\": 4, \"output_len\": 1}\n";
        let text = line.repeat(3);
        assert!(parse_lines(text.as_bytes(), "t.jsonl", "t", 1, 3).is_ok());
        let err = parse_lines(text.as_bytes(), "t.jsonl", "t", 1, 2).unwrap_err();
        assert!(
            matches!(
                err,
                WorkloadError::Trace {
                    line: 3,
                    problem: TraceProblem::TooManyRequests { limit: 2 },
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "t.jsonl:3: the trace holds more than 2 requests (split the trace)"
        );
    }

    #[test]
    fn arrivals_beyond_the_limit_are_refused() {
        let at = |step: u64| {
            parse(&format!(
                "{{\"arrival_step\": {step}, \"prompt_len\": 4, \"output_len\": 1}}"
            ))
        };
        assert!(at(MAX_ARRIVAL_STEP).is_ok());
        let err = at(MAX_ARRIVAL_STEP + 1).unwrap_err();
        assert!(
            matches!(
                err,
                WorkloadError::Trace {
                    line: 1,
                    problem: TraceProblem::WrongType {
                        field: "arrival_step",
                        expected: "at most 1,000,000"
                    },
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn a_line_over_the_line_limit_or_not_utf8_is_refused_with_its_number() {
        let long = format!("\n{}\n", " ".repeat(crate::input::MAX_LINE_BYTES + 1));
        let err = parse(&long).unwrap_err();
        assert!(
            matches!(
                err,
                WorkloadError::Trace {
                    line: 2,
                    problem: TraceProblem::Line(crate::input::LineProblem::TooLong { .. }),
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("16777216 bytes"), "{err}");
        let err = parse_lines(&b"\xff\n"[..], "t.jsonl", "t", 1, 1).unwrap_err();
        assert_eq!(err.to_string(), "t.jsonl:1: the line is not valid UTF-8");
    }

    #[test]
    fn an_empty_trace_and_a_missing_file_are_errors() {
        assert!(matches!(
            parse("\n  \n"),
            Err(WorkloadError::EmptyTrace { .. })
        ));
        let err = load_trace(Path::new("/nonexistent/dir/x.jsonl"), 0).unwrap_err();
        assert!(matches!(err, WorkloadError::Io { .. }), "{err:?}");
        assert!(
            err.to_string().starts_with("/nonexistent/dir/x.jsonl: "),
            "{err}"
        );
    }

    #[test]
    fn workload_names_come_from_the_file_stem() {
        assert_eq!(workload_name(Path::new("/a/b/my trace.jsonl")), "my_trace");
        assert_eq!(
            workload_name(Path::new("prod-2026.01.jsonl")),
            "prod-2026.01"
        );
        assert_eq!(workload_name(Path::new("/")), "trace");
    }
}

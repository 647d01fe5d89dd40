//! The loader: an ops trace read line by line within the input limits
//! ([`unikv_workload::input`]), every operation checked against the format's limits
//! before anything runs.

use crate::error::{OpsError, OpsProblem};
use crate::format::{MAX_OPS, Op, SCHEMA_V2, check, check_header};
use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use unikv_workload::input::{BoundedLines, LineError};

/// A parsed trace: the header's allocator and the operations.
#[derive(Debug)]
pub struct Trace {
    /// The trace's path (what errors cite).
    pub source_name: String,
    /// The header line.
    pub header: Op,
    /// The header's 1-based line number.
    pub header_line: usize,
    /// Every operation after it, with its 1-based line number.
    pub ops: Vec<(usize, Op)>,
}

/// Reads a trace file, line by line within the limits of [`unikv_workload::input`], and checks
/// every operation against the limits of the format ([`check`], [`MAX_OPS`]) before
/// anything runs.
pub fn load(path: &Path) -> Result<Trace, OpsError> {
    load_limited(path, MAX_OPS)
}

/// [`load`] with at most `max_ops` operations ([`MAX_OPS`] but in tests).
fn load_limited(path: &Path, max_ops: usize) -> Result<Trace, OpsError> {
    let source_name = path.display().to_string();
    let file = File::open(path).map_err(|source| OpsError::Io {
        path: source_name.clone(),
        source,
    })?;
    let at = |line, problem| OpsError::OpsLine {
        source_name: source_name.clone(),
        line,
        problem,
    };
    // (the header, its page size, its line, whether it is v2)
    let mut header: Option<(Op, u32, usize, bool)> = None;
    let mut ops = Vec::new();
    let mut lines = BoundedLines::new(BufReader::new(file));
    while let Some(next) = lines.next_line() {
        let (line, text) = match next {
            Ok(line_and_text) => line_and_text,
            Err((line, LineError::Problem(problem))) => {
                return Err(at(line, OpsProblem::Line(problem)));
            }
            Err((_, LineError::Io(source))) => {
                return Err(OpsError::Io {
                    path: source_name.clone(),
                    source,
                });
            }
        };
        if text.trim().is_empty() {
            continue;
        }
        let op: Op = serde_json::from_str(text).map_err(|e| {
            at(
                line,
                OpsProblem::Json {
                    message: unikv_workload::input::json_message(&e),
                },
            )
        })?;
        match (&header, op) {
            (None, op @ Op::Header { .. }) => {
                let page_size = check_header(&op).map_err(|p| at(line, p))?;
                let v2 = matches!(&op, Op::Header { schema, .. } if schema == SCHEMA_V2);
                header = Some((op, page_size, line, v2));
            }
            (None, _) => return Err(at(line, OpsProblem::NoHeader)),
            (Some(_), Op::Header { .. }) => return Err(at(line, OpsProblem::SecondHeader)),
            (Some((_, page_size, _, v2)), op) => {
                if ops.len() == max_ops {
                    return Err(at(line, OpsProblem::TooManyOps { limit: max_ops }));
                }
                if op.is_speculative() && !*v2 {
                    return Err(at(line, OpsProblem::SpeculativeInV1 { op: op.name() }));
                }
                check(&op, *page_size).map_err(|p| at(line, p))?;
                ops.push((line, op));
            }
        }
    }
    let (header, _, header_line, _) = header.ok_or_else(|| OpsError::OpsTrace {
        reason: format!("{source_name}: empty trace"),
    })?;
    Ok(Trace {
        source_name,
        header,
        header_line,
        ops,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::format::SCHEMA;

    /// Writes `lines` after a unified gpt-oss-20b header at page size 4 and loads the file
    /// with at most `max_ops` operations.
    pub(crate) fn load_lines(
        name: &str,
        lines: &[&str],
        max_ops: usize,
    ) -> Result<Trace, OpsError> {
        load_lines_of(SCHEMA, name, lines, max_ops)
    }

    /// [`load_lines`] under the header of `schema`.
    pub(crate) fn load_lines_of(
        schema: &str,
        name: &str,
        lines: &[&str],
        max_ops: usize,
    ) -> Result<Trace, OpsError> {
        let header = serde_json::to_string(&Op::Header {
            schema: schema.into(),
            layout: "unified".into(),
            model: "gpt-oss-20b".into(),
            page_size: 4,
            memory_bytes: 1 << 30,
            swa_full_ratio: 0.8,
            scratch_slots: 0,
        })
        .unwrap();
        let path = std::env::temp_dir().join(format!("unikv-sim-{}-{name}", std::process::id()));
        let text: String = std::iter::once(header.as_str())
            .chain(lines.iter().copied())
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, text).unwrap();
        let loaded = load_limited(&path, max_ops);
        let _ = std::fs::remove_file(&path);
        loaded
    }

    /// The line and message of a load error.
    pub(crate) fn line_and_message(err: &OpsError) -> (usize, String) {
        match err {
            OpsError::OpsLine { line, problem, .. } => (*line, problem.to_string()),
            other => panic!("expected an ops line error, got {other:?}"),
        }
    }

    #[test]
    fn load_reports_each_problem_on_its_line() {
        let flush = r#"{"op":"flush"}"#;
        let trace = load_lines("ok", &[flush, "", flush], 2).unwrap();
        assert_eq!(
            trace.ops.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
            [2, 4]
        );
        let err = load_lines("many", &[flush, flush, flush], 2).unwrap_err();
        assert_eq!(
            line_and_message(&err),
            (
                4,
                "the trace holds more than 2 operations (the limit of an ops trace)".into()
            )
        );
        let err =
            load_lines("4g", &[flush, r#"{"op":"free","ids":[[0,4294967295]]}"#], 9).unwrap_err();
        assert_eq!(line_and_message(&err).0, 3);
        assert!(err.to_string().contains("more than 16777216"), "{err}");
        let err = load_lines("second", &[flush, &flush.replace("flush", "nope")], 9).unwrap_err();
        let (line, message) = line_and_message(&err);
        assert_eq!(line, 3);
        assert!(
            message.starts_with("not an operation: unknown variant `nope`")
                && message.ends_with("(column 12)"),
            "{message}"
        );
    }

    /// A v1 trace (every trace written before speculation) loads as before, and refuses
    /// the speculative lines that came with v2; a v2 trace takes them.
    #[test]
    fn speculative_lines_need_a_v2_header() {
        let settle = r#"{"op":"settle","accepted":[1],"ops":0}"#;
        let err = load_lines("v1-settle", &[r#"{"op":"flush"}"#, settle], 9).unwrap_err();
        assert_eq!(
            line_and_message(&err),
            (
                3,
                "settle in a unikv.ops.v1 trace (speculative operations need schema \
                 unikv.ops.v2)"
                    .into()
            )
        );
        let path = std::env::temp_dir().join(format!("unikv-sim-{}-v2", std::process::id()));
        let header = serde_json::to_string(&Op::Header {
            schema: crate::format::SCHEMA_V2.into(),
            layout: "unified".into(),
            model: "gpt-oss-20b".into(),
            page_size: 4,
            memory_bytes: 1 << 30,
            swa_full_ratio: 0.8,
            scratch_slots: 0,
        })
        .unwrap();
        std::fs::write(&path, format!("{header}\n{settle}\n")).unwrap();
        let trace = load(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(trace.ops.len(), 1);
        assert!(trace.ops[0].1.is_speculative());
    }

    #[test]
    fn a_header_must_come_first_and_name_what_the_replay_can_build() {
        let path = std::env::temp_dir().join(format!("unikv-sim-{}-headers", std::process::id()));
        let check_file = |text: &str| {
            std::fs::write(&path, text).unwrap();
            load(&path).map(drop).map_err(|e| line_and_message(&e))
        };
        let header = r#"{"op":"header","schema":"unikv.ops.v1","layout":"unified","model":"gpt-oss-20b","page_size":4,"memory_bytes":1073741824,"swa_full_ratio":0.8}"#;
        assert!(check_file(header).is_ok());
        // Every named model, recurrent ones included, on both layouts.
        for model in unikv::ModelSpec::NAMED {
            for layout in ["unified", "static"] {
                let named = header
                    .replace("gpt-oss-20b", model.name)
                    .replace("\"unified\"", &format!("{layout:?}"));
                assert!(check_file(&named).is_ok(), "{named}");
            }
        }
        assert_eq!(
            check_file(&format!("\n{{\"op\":\"flush\"}}\n{header}")),
            Err((2, "the first line must be the header".into()))
        );
        assert_eq!(
            check_file(&format!("{header}\n{header}")),
            Err((2, "a second header".into()))
        );
        for (from, to, message) in [
            ("unikv.ops.v1", "v0", "header field schema is \"v0\""),
            (
                "\"unified\"",
                "\"paged\"",
                "header field layout is \"paged\"",
            ),
            ("gpt-oss-20b", "llama", "header field model is \"llama\""),
            (
                "\"page_size\":4",
                "\"page_size\":0",
                "header field page_size is 0",
            ),
            (
                "\"page_size\":4",
                "\"page_size\":65537",
                "header field page_size is 65537",
            ),
        ] {
            let got = check_file(&header.replace(from, to)).unwrap_err();
            assert_eq!(got.0, 1);
            assert!(got.1.starts_with(message), "{}", got.1);
        }
        let _ = std::fs::remove_file(&path);
    }
}

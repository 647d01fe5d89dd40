//! Reading the simulator's input files (`--trace FILE`, `bench-ops FILE`) line by line
//! within fixed limits, so that no file — `/dev/zero`, a file with no newline, a file of
//! terabytes — makes the reader hold more than one bounded line at a time or read
//! forever.
//!
//! Both formats share the limits: a line holds at most [`MAX_LINE_BYTES`], a file at
//! most [`MAX_FILE_BYTES`]. Exceeding either is an error naming the limit and the line it
//! was crossed on, reported as soon as the reader gets there.

use std::fmt;
use std::io::{BufRead, Read};

/// The longest line an input file may have: 16 MiB. That is over 1.5 million explicit
/// prompt token ids on a `--trace` line (longer prompts are given by `prompt_len`), and
/// over 150 times the longest line of a recorded `random-8192-64` run at page size 1.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// The largest input file: 4 GiB.
pub const MAX_FILE_BYTES: u64 = 4 << 30;

/// What is wrong with a line, as far as reading it goes (before its format is looked at).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LineProblem {
    /// The line is longer than the limit.
    TooLong {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The file is larger than the limit (counted up to the end of this line).
    FileTooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// The line is not UTF-8.
    NotUtf8,
}

impl fmt::Display for LineProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LineProblem::TooLong { limit } => write!(
                f,
                "the line is longer than {limit} bytes (the limit of one line)"
            ),
            LineProblem::FileTooLarge { limit } => write!(
                f,
                "the file is larger than {limit} bytes (the limit of one input file)"
            ),
            LineProblem::NotUtf8 => f.write_str("the line is not valid UTF-8"),
        }
    }
}

/// Why a line could not be read: a [`LineProblem`], or the reader failed.
#[derive(Debug)]
pub enum LineError {
    /// The line breaks a limit or is not text.
    Problem(LineProblem),
    /// Reading failed.
    Io(std::io::Error),
}

impl fmt::Display for LineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LineError::Problem(p) => p.fmt(f),
            LineError::Io(e) => write!(f, "reading failed: {e}"),
        }
    }
}

/// serde_json's message for an error in one line, with its position as a column only:
/// serde_json ends it with "at line 1 column N", where the line is the line parsed, not
/// the file's (whose number the caller reports).
pub fn json_message(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    let base = full.strip_suffix(&position).unwrap_or(&full);
    format!("{base} (column {})", e.column())
}

/// One step of [`BoundedLines::next_line`]: a line's number and text, or the number of
/// the line that could not be read and why.
pub type NextLine<'a> = Result<(usize, &'a str), (usize, LineError)>;

/// Lines of a reader, numbered from 1, each at most `max_line` bytes (without its line
/// break), the whole at most `max_file` bytes. A trailing `\r` is removed with the `\n`.
#[derive(Debug)]
pub struct BoundedLines<R> {
    reader: R,
    max_line: usize,
    max_file: u64,
    read: u64,
    line: usize,
    buf: Vec<u8>,
    done: bool,
}

impl<R: BufRead> BoundedLines<R> {
    /// Lines of `reader` within the shared limits ([`MAX_LINE_BYTES`], [`MAX_FILE_BYTES`]).
    pub fn new(reader: R) -> BoundedLines<R> {
        BoundedLines::with_limits(reader, MAX_LINE_BYTES, MAX_FILE_BYTES)
    }

    /// Lines of `reader` within the given limits.
    pub fn with_limits(reader: R, max_line: usize, max_file: u64) -> BoundedLines<R> {
        BoundedLines {
            reader,
            max_line,
            max_file,
            read: 0,
            line: 0,
            buf: Vec::new(),
            done: false,
        }
    }

    /// The next line and its 1-based number, `None` at the end, or the error and the
    /// number of the line it happened on (after an error, `None`).
    pub fn next_line(&mut self) -> Option<NextLine<'_>> {
        if self.done {
            return None;
        }
        self.line += 1;
        self.buf.clear();
        // At most the longest line, its `\r\n` and one byte more: enough to tell a line
        // that is too long without holding more of it.
        let cap = self.max_line as u64 + 3;
        let n = match (&mut self.reader)
            .take(cap)
            .read_until(b'\n', &mut self.buf)
        {
            Ok(0) => {
                self.done = true;
                return None;
            }
            Ok(n) => n,
            Err(e) => return self.fail(LineError::Io(e)),
        };
        self.read += n as u64;
        if self.read > self.max_file {
            let limit = self.max_file;
            return self.fail(LineError::Problem(LineProblem::FileTooLarge { limit }));
        }
        let mut end = self.buf.len();
        if self.buf[..end].ends_with(b"\n") {
            end -= 1;
            if self.buf[..end].ends_with(b"\r") {
                end -= 1;
            }
        }
        if end > self.max_line {
            let limit = self.max_line;
            return self.fail(LineError::Problem(LineProblem::TooLong { limit }));
        }
        if std::str::from_utf8(&self.buf[..end]).is_err() {
            return self.fail(LineError::Problem(LineProblem::NotUtf8));
        }
        let text = std::str::from_utf8(&self.buf[..end]).unwrap_or_default();
        Some(Ok((self.line, text)))
    }

    /// Ends the reader with `error` on the current line.
    fn fail<'a>(&mut self, error: LineError) -> Option<NextLine<'a>> {
        self.done = true;
        Some(Err((self.line, error)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(text: &[u8], max_line: usize, max_file: u64) -> Vec<Result<(usize, String), String>> {
        let mut lines = BoundedLines::with_limits(text, max_line, max_file);
        let mut out = Vec::new();
        while let Some(next) = lines.next_line() {
            out.push(
                next.map(|(n, l)| (n, l.to_string()))
                    .map_err(|(n, e)| format!("{n}: {e}")),
            );
        }
        out
    }

    #[test]
    fn lines_are_numbered_and_stripped_of_their_breaks() {
        let got = all(b"a\r\n\nbcd\nef", 3, 100);
        let want: Vec<Result<(usize, String), String>> = vec![
            Ok((1, "a".into())),
            Ok((2, "".into())),
            Ok((3, "bcd".into())),
            Ok((4, "ef".into())),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn a_line_over_the_limit_stops_the_reader_at_that_line() {
        let got = all(b"abc\nabcd\nx\n", 3, 100);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(
            got[1],
            Err("2: the line is longer than 3 bytes (the limit of one line)".into())
        );
        // A line with no end at all is read only up to the limit.
        let mut endless =
            BoundedLines::with_limits(std::io::BufReader::new(std::io::repeat(0)), 8, 100);
        assert!(matches!(
            endless.next_line(),
            Some(Err((
                1,
                LineError::Problem(LineProblem::TooLong { limit: 8 })
            )))
        ));
        assert!(endless.next_line().is_none());
    }

    #[test]
    fn a_file_over_the_limit_stops_the_reader_where_it_crosses_it() {
        let got = all(b"ab\ncd\nef\n", 10, 7);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(
            got[2]
                .as_ref()
                .unwrap_err()
                .starts_with("3: the file is larger than 7 bytes")
        );
        let endless_lines = std::io::BufReader::new(std::io::repeat(b'\n'));
        let mut lines = BoundedLines::with_limits(endless_lines, 8, 1000);
        let mut count = 0;
        while let Some(Ok(_)) = lines.next_line() {
            count += 1;
        }
        assert_eq!(count, 1000);
    }

    #[test]
    fn a_line_that_is_not_utf8_is_an_error() {
        let got = all(b"ok\n\xff\n", 10, 100);
        assert_eq!(got[1], Err("2: the line is not valid UTF-8".into()));
    }
}

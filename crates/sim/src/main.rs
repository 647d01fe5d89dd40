//! The `unikv` binary: `unikv replay` runs serving workloads through the static and the
//! unified pool side by side; `unikv bench-ops` measures the allocator on a recorded
//! operation trace.
//!
//! Exit status: 0 success (every run passed), 1 a report was printed and some run failed
//! its checks, 2 an error (bad options, unreadable input, a run that could not finish).

use std::io::Write;
use std::process::ExitCode;
use unikv_sim::cli::{self, Command};
use unikv_sim::replay;

fn main() -> ExitCode {
    // Start-up checks first: a bad UNIKV_INVARIANT_CHECK is a one-line error, not a run.
    if let Err(err) = unikv::init() {
        eprintln!("unikv: {err}");
        return ExitCode::from(2);
    }
    let command = match cli::parse_os_args(std::env::args_os().skip(1)) {
        Ok(command) => command,
        Err(err) => return fail(&err),
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match command {
        Command::Help(topic) => {
            // A closed stdout (`unikv --help | head -1`) is not worth an error.
            let _ = out.write_all(topic.text().as_bytes());
            ExitCode::SUCCESS
        }
        Command::Replay(args) => match replay::replay(&args, &mut out) {
            Ok(outcome) if outcome.pass() => ExitCode::SUCCESS,
            Ok(_) => ExitCode::from(1),
            Err(err) => fail(&err),
        },
        Command::BenchOps(args) => match replay::bench_ops(&args, &mut out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => fail(&err),
        },
    }
}

/// Prints `err` as one line on stderr and returns the error status.
fn fail(err: &unikv_sim::SimError) -> ExitCode {
    eprintln!("unikv: {err}");
    ExitCode::from(2)
}

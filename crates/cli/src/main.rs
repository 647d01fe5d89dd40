//! The `unikv` binary: `unikv replay` runs serving workloads through the static and the
//! unified pool side by side; `unikv bench-ops` measures the allocator on a recorded
//! operation trace; `unikv bench-scale` runs the replay at growing scales; `unikv sim`
//! runs the deterministic simulator with injected faults.
//!
//! Exit status: 0 success (every run passed), 1 a report was printed and some run failed
//! its checks, 2 an error (bad options, no command, unreadable input, a run that could
//! not finish, an output that could not be written). Every error is one line on stderr
//! (but a missing command, which prints the help there); `--help` and `--version` go to
//! stdout with status 0, and are printed before the environment is checked.
//!
//! The binary owns the command line ([`args`], clap's derive API, and the long help
//! texts in [`help`]), the commands' glue ([`commands`]), the progress bars
//! ([`progress`]) and the SVG plots ([`svg`]); what it runs is the libraries':
//! `unikv-replay` (the scheduler and the report), `unikv-ops` (op traces), `unikv-dst`
//! (the simulator) and `unikv-workload` (workloads and traces).

mod args;
mod commands;
mod error;
mod help;
mod progress;
mod svg;

use crate::args::{Cli, Command};
use crate::error::CliError;
use clap::Parser;
use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Nothing could be reported: say so before doing any work.
    if let Err(err) = stdout_is_open() {
        return fail(&err);
    }
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let command = match Cli::try_parse_from(&argv) {
        Ok(cli) => cli.into_command(),
        // `--help`, `-h`, `help [COMMAND]`, `--version`: on stdout, whatever the
        // environment holds (the help is how a user finds out what it should hold).
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            return print_help(&e.to_string());
        }
        // No command at all: the help, on stderr, and the usage error's status.
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = writeln!(std::io::stderr(), "{}", e.to_string().trim_end());
            return ExitCode::from(2);
        }
        Err(e) => Err(CliError::Usage(args::one_line(&e, &argv))),
    };
    let command = match command {
        Ok(command) => command,
        Err(err) => return fail(&err),
    };
    // Start-up checks before any command runs: a bad UNIKV_INVARIANT_CHECK is a one-line
    // error, not a run.
    if let Err(err) = unikv::init() {
        return fail(&err);
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match command {
        Command::Replay(args) => match commands::replay(&args, &mut out) {
            Ok(outcome) if outcome.pass() => ExitCode::SUCCESS,
            Ok(_) => ExitCode::from(1),
            Err(err) => fail(&err),
        },
        Command::BenchOps(args) => match commands::bench_ops(&args, &mut out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => fail(&err),
        },
        Command::BenchScale(args) => match commands::bench_scale(&args, &mut out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => fail(&err),
        },
        Command::BenchOverlap(args) => match commands::bench_overlap(&args, &mut out) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(err) => fail(&err),
        },
        Command::Sim(args) => {
            let mut progress = progress::SimBar::for_stderr(args.seeds);
            match unikv_dst::run_command(&args, &mut out, &mut progress) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(err) => fail(&CliError::Output(err)),
            }
        }
    }
}

/// Refuses a stdout that was closed when the process started. The Rust runtime reopens a
/// closed stdout on `/dev/null` before `main`, where every write succeeds and vanishes,
/// so `unikv replay >&-` would exit 0 with no report. The runtime opens it read-write; a
/// shell's `>/dev/null` opens it write-only, which tells the two apart (on Linux, through
/// `/proc`; elsewhere the check passes).
fn stdout_is_open() -> Result<(), CliError> {
    #[cfg(target_os = "linux")]
    {
        let on_null = std::fs::read_link("/proc/self/fd/1")
            .is_ok_and(|target| target == std::path::Path::new("/dev/null"));
        let read_write = || {
            std::fs::read_to_string("/proc/self/fdinfo/1")
                .ok()
                .and_then(|info| {
                    let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
                    u32::from_str_radix(flags.trim(), 8).ok()
                })
                // O_ACCMODE = 0o3, O_RDWR = 0o2
                .is_some_and(|flags| flags & 0o3 == 0o2)
        };
        if on_null && read_write() {
            return Err(CliError::StdoutClosed);
        }
    }
    Ok(())
}

/// Prints a help text on stdout and returns success.
fn print_help(text: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    let text = format!("{}\n", text.trim_end());
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        // A reader that stops early (`unikv --help | head -1`) is not an error.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => fail(&CliError::Output(e)),
        _ => ExitCode::SUCCESS,
    }
}

/// Prints `err` as one line on stderr and returns the error status. A stderr that
/// cannot be written changes nothing (there is nowhere left to report).
fn fail(err: &dyn std::fmt::Display) -> ExitCode {
    let _ = writeln!(std::io::stderr(), "unikv: {err}");
    ExitCode::from(2)
}

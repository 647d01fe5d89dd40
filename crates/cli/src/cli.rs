//! The command line, parsed by hand (std only): `unikv replay [options]`,
//! `unikv bench-ops FILE [options]` and the help texts.
//!
//! Options take their value as the next argument or after `=` (`--seed 7`, `--seed=7`);
//! a value never starts with `--`. `--workload` and `--page-size` (and `bench-ops`'s
//! `--invariants`) may be repeated, and the first two take comma-separated lists whose
//! items are trimmed and must not be empty (`1,,256` is an error); an item named twice
//! runs once. Any other option given twice is an error naming it.

use crate::error::CliError;
use std::ffi::OsString;
use std::path::PathBuf;
use unikv::ModelSpec;
use unikv_dst::{DEFAULT_SIM_SEEDS, SimArgs};
use unikv_invariants::Level;
use unikv_replay::config::{DEFAULT_MEMORY_BYTES, DEFAULT_SEED};
use unikv_replay::scale::BenchScaleArgs;
use unikv_replay::{Backend, Layout, ReplayOptions};
use unikv_workload::Preset;
use unikv_workload::trace;
use unikv_workload::units::{MAX_PAGE_SIZE, format_bytes, group_digits, parse_memory};

/// A parsed command line.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Print a help text and exit successfully.
    Help(HelpTopic),
    /// `unikv replay`.
    Replay(ReplayArgs),
    /// `unikv bench-ops FILE`.
    BenchOps(BenchOpsArgs),
    /// `unikv sim`.
    Sim(SimArgs),
    /// `unikv bench-scale`.
    BenchScale(BenchScaleArgs),
}

/// Which help text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelpTopic {
    /// `unikv --help`: the commands.
    Main,
    /// `unikv replay --help`.
    Replay,
    /// `unikv bench-ops --help`.
    BenchOps,
    /// `unikv sim --help`.
    Sim,
}

impl HelpTopic {
    /// The help text.
    pub fn text(self) -> String {
        match self {
            HelpTopic::Main => MAIN_HELP.to_string(),
            HelpTopic::Replay => replay_help(),
            HelpTopic::BenchOps => BENCH_OPS_HELP.to_string(),
            HelpTopic::Sim => SIM_HELP.to_string(),
        }
    }
}

/// The options of `unikv replay`, resolved (defaults filled in): what runs, and how the
/// report is printed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayArgs {
    /// The runs.
    pub options: ReplayOptions,
    /// Print one JSON object instead of the table (`--json`).
    pub json: bool,
    /// Write one SVG per run into this directory (`--svg`).
    pub svg_dir: Option<PathBuf>,
}

/// The options of `unikv bench-ops`.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchOpsArgs {
    /// The ops file written by `unikv replay --record-ops`.
    pub file: PathBuf,
    /// The invariant levels to measure at, in order (`--invariants`, repeatable; default
    /// off and strict, the two levels of the throughput targets in DESIGN.md §10).
    pub levels: Vec<Level>,
    /// Print one JSON object instead of the table.
    pub json: bool,
    /// The device the allocator runs on (`--device`, default cpu).
    pub backend: Backend,
    /// Replays per level (`--passes`, default 5), each against a fresh allocator; the
    /// pass with the median total time is reported.
    pub passes: usize,
}

/// Parses the process's arguments (without the program name).
pub fn parse_os_args(args: impl IntoIterator<Item = OsString>) -> Result<Command, CliError> {
    let args = args
        .into_iter()
        .map(|a| {
            a.into_string().map_err(|bad| CliError::NotUtf8 {
                arg: bad.to_string_lossy().into_owned(),
            })
        })
        .collect::<Result<Vec<String>, CliError>>()?;
    parse_args(&args)
}

/// Parses arguments (without the program name).
pub fn parse_args<S: AsRef<str>>(args: &[S]) -> Result<Command, CliError> {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    match args.first().copied() {
        None | Some("--help" | "-h") => Ok(Command::Help(HelpTopic::Main)),
        Some("help") => match args.get(1).copied() {
            None => Ok(Command::Help(HelpTopic::Main)),
            Some("replay") => Ok(Command::Help(HelpTopic::Replay)),
            Some("bench-ops") => Ok(Command::Help(HelpTopic::BenchOps)),
            Some("sim") => Ok(Command::Help(HelpTopic::Sim)),
            Some(other) => Err(CliError::UnknownCommand {
                command: other.to_string(),
            }),
        },
        Some("replay") => parse_replay(&args[1..]),
        Some("bench-ops") => parse_bench_ops(&args[1..]),
        Some("sim") => parse_sim(&args[1..]),
        Some("bench-scale") => parse_bench_scale(&args[1..]),
        Some(other) => Err(CliError::UnknownCommand {
            command: other.to_string(),
        }),
    }
}

/// Walks `--name value`, `--name=value` and positional arguments.
struct Args<'a> {
    command: &'static str,
    rest: std::slice::Iter<'a, &'a str>,
    /// The options given so far that may be given only once.
    seen: Vec<&'static str>,
}

enum Arg<'a> {
    /// An option, with its `=value` if it had one.
    Option(&'a str, Option<&'a str>),
    Positional(&'a str),
}

impl<'a> Args<'a> {
    fn next(&mut self) -> Option<Arg<'a>> {
        let arg = *self.rest.next()?;
        if arg.starts_with('-') && arg.len() > 1 {
            Some(match arg.split_once('=') {
                Some((name, value)) => Arg::Option(name, Some(value)),
                None => Arg::Option(arg, None),
            })
        } else {
            Some(Arg::Positional(arg))
        }
    }

    /// The option's value: after `=`, or the next argument (which must not be an option).
    fn value(
        &mut self,
        option: &'static str,
        inline: Option<&'a str>,
    ) -> Result<&'a str, CliError> {
        let value = match inline {
            Some(v) => v,
            None => match self.rest.clone().next() {
                Some(next) if !next.starts_with("--") => {
                    self.rest.next();
                    *next
                }
                _ => return Err(CliError::MissingValue { option }),
            },
        };
        if value.trim().is_empty() {
            return Err(CliError::MissingValue { option });
        }
        Ok(value)
    }

    /// Refuses a second `option` (one that may be given only once).
    fn once(&mut self, option: &'static str) -> Result<(), CliError> {
        if self.seen.contains(&option) {
            return Err(CliError::RepeatedOption { option });
        }
        self.seen.push(option);
        Ok(())
    }

    /// The value of an option that may be given only once.
    fn single(
        &mut self,
        option: &'static str,
        inline: Option<&'a str>,
    ) -> Result<&'a str, CliError> {
        self.once(option)?;
        self.value(option, inline)
    }

    /// A flag (no value), given at most once.
    fn flag(&mut self, option: &'static str, inline: Option<&str>) -> Result<(), CliError> {
        self.once(option)?;
        match inline {
            None => Ok(()),
            Some(value) => Err(CliError::UnexpectedValue {
                option,
                value: value.to_string(),
            }),
        }
    }

    fn unknown(&self, option: &str) -> CliError {
        CliError::UnknownOption {
            command: self.command,
            option: option.to_string(),
        }
    }
}

fn parse_replay(args: &[&str]) -> Result<Command, CliError> {
    let mut parsed = ReplayArgs::default();
    parsed.options.workloads = Vec::new();
    let mut page_sizes: Vec<u32> = Vec::new();
    // The `--workload` items in order, `None` for `all`: what `all` means depends on the
    // model, which may come later on the line.
    let mut workload_items: Vec<Option<Preset>> = Vec::new();
    let mut args = Args {
        command: "replay",
        rest: args.iter(),
        seen: Vec::new(),
    };
    while let Some(arg) = args.next() {
        let (name, inline) = match arg {
            Arg::Positional(p) => {
                return Err(CliError::UnexpectedArgument {
                    command: "replay",
                    arg: p.to_string(),
                });
            }
            Arg::Option(name, inline) => (name, inline),
        };
        match name {
            "--help" | "-h" => return Ok(Command::Help(HelpTopic::Replay)),
            "--workload" => {
                for name in list("--workload", args.value("--workload", inline)?)? {
                    let item = if name.eq_ignore_ascii_case("all") {
                        None
                    } else {
                        Some(
                            Preset::from_name(name).ok_or_else(|| CliError::UnknownWorkload {
                                name: name.to_string(),
                                known: known_workloads(),
                            })?,
                        )
                    };
                    workload_items.push(item);
                }
            }
            "--model" => {
                parsed.options.model =
                    unikv_workload::model::parse_model(args.single("--model", inline)?)?;
            }
            "--page-size" => {
                for value in list("--page-size", args.value("--page-size", inline)?)? {
                    let ps = parse_page_size(value)?;
                    if !page_sizes.contains(&ps) {
                        page_sizes.push(ps);
                    }
                }
            }
            "--memory" => {
                parsed.options.memory_bytes = parse_memory(args.single("--memory", inline)?)?
            }
            "--layout" => {
                let value = args.single("--layout", inline)?;
                parsed.options.layouts = match value.trim().to_ascii_lowercase().as_str() {
                    "static" => vec![Layout::Static],
                    "unified" => vec![Layout::Unified],
                    "both" => Layout::BOTH.to_vec(),
                    _ => {
                        return Err(CliError::UnknownLayout {
                            value: value.to_string(),
                        });
                    }
                };
            }
            "--seed" => {
                let value = args.single("--seed", inline)?;
                parsed.options.seed = value.trim().parse().map_err(|_| CliError::BadNumber {
                    option: "--seed",
                    value: value.to_string(),
                    reason: "expected an integer from 0 to 2^64-1",
                })?;
            }
            "--invariants" => {
                parsed.options.invariant_level = parse_level(args.single("--invariants", inline)?)?
            }
            "--json" => {
                args.flag("--json", inline)?;
                parsed.json = true;
            }
            "--no-timing" => {
                args.flag("--no-timing", inline)?;
                parsed.options.timing = false;
            }
            "--svg" => parsed.svg_dir = Some(PathBuf::from(args.single("--svg", inline)?)),
            "--trace" => {
                parsed.options.trace = Some(PathBuf::from(args.single("--trace", inline)?))
            }
            "--record-ops" => {
                parsed.options.record_ops =
                    Some(PathBuf::from(args.single("--record-ops", inline)?));
            }
            "--device" => parsed.options.backend = parse_backend(args.single("--device", inline)?)?,
            other => return Err(args.unknown(other)),
        }
    }
    if workload_items.is_empty() && parsed.options.trace.is_none() {
        workload_items.push(None);
    }
    for item in workload_items {
        let presets = match item {
            Some(preset) => vec![preset],
            None => Preset::defaults_for(&parsed.options.model),
        };
        for preset in presets {
            if !parsed.options.workloads.contains(&preset) {
                parsed.options.workloads.push(preset);
            }
        }
    }
    if let Some(preset) = parsed
        .options
        .workloads
        .iter()
        .find(|p| p.needs_recurrent_state() && !parsed.options.model.has_recurrent_state())
    {
        return Err(CliError::NeedsRecurrentModel {
            workload: preset.name(),
            model: parsed.options.model.name,
            recurrent: recurrent_models()
                .map(|m| m.name)
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    if !page_sizes.is_empty() {
        parsed.options.page_sizes = page_sizes;
    }
    if parsed.options.record_ops.is_some() && parsed.options.runs() != 1 {
        return Err(CliError::RecordOpsNeedsOneRun {
            runs: parsed.options.runs(),
        });
    }
    Ok(Command::Replay(parsed))
}

fn parse_bench_ops(args: &[&str]) -> Result<Command, CliError> {
    let mut file: Option<PathBuf> = None;
    let mut levels: Vec<Level> = Vec::new();
    let mut json = false;
    let mut backend = Backend::Cpu;
    let mut passes = 5;
    let mut args = Args {
        command: "bench-ops",
        rest: args.iter(),
        seen: Vec::new(),
    };
    while let Some(arg) = args.next() {
        match arg {
            Arg::Positional(p) if file.is_none() => file = Some(PathBuf::from(p)),
            Arg::Positional(p) => {
                return Err(CliError::UnexpectedArgument {
                    command: "bench-ops",
                    arg: p.to_string(),
                });
            }
            Arg::Option("--help" | "-h", _) => return Ok(Command::Help(HelpTopic::BenchOps)),
            Arg::Option("--invariants", inline) => {
                let level = parse_level(args.value("--invariants", inline)?)?;
                if !levels.contains(&level) {
                    levels.push(level);
                }
            }
            Arg::Option("--json", inline) => {
                args.flag("--json", inline)?;
                json = true;
            }
            Arg::Option("--device", inline) => {
                backend = parse_backend(args.single("--device", inline)?)?;
            }
            Arg::Option("--passes", inline) => {
                let value = args.single("--passes", inline)?;
                passes = value
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| CliError::BadNumber {
                        option: "--passes",
                        value: value.to_string(),
                        reason: "expected a whole number of passes, at least 1",
                    })?;
            }
            Arg::Option(other, _) => return Err(args.unknown(other)),
        }
    }
    let file = file.ok_or(CliError::MissingArgument {
        command: "bench-ops",
        what: "the ops FILE written by `unikv replay --record-ops`",
    })?;
    if levels.is_empty() {
        levels = vec![Level::Off, Level::Strict];
    }
    Ok(Command::BenchOps(BenchOpsArgs {
        file,
        levels,
        json,
        backend,
        passes,
    }))
}

/// `unikv bench-scale [--scales K,K] REPLAY-OPTIONS`.
fn parse_bench_scale(args: &[&str]) -> Result<Command, CliError> {
    let mut scales = Vec::new();
    let mut rest = Vec::new();
    let mut it = args.iter();
    while let Some(&arg) = it.next() {
        let value = match arg.strip_prefix("--scales") {
            Some("") => it
                .next()
                .copied()
                .ok_or(CliError::MissingValue { option: "--scales" })?,
            Some(inline) if inline.starts_with('=') => &inline[1..],
            _ => {
                rest.push(arg);
                continue;
            }
        };
        for item in list("--scales", value)? {
            let k = item
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|k| (1..=256).contains(k))
                .ok_or_else(|| CliError::BadNumber {
                    option: "--scales",
                    value: item.to_string(),
                    reason: "expected an integer from 1 to 256",
                })?;
            if !scales.contains(&k) {
                scales.push(k);
            }
        }
    }
    if scales.is_empty() {
        scales = unikv_replay::scale::DEFAULT_SCALES.to_vec();
    }
    match parse_replay(&rest)? {
        Command::Replay(replay) => Ok(Command::BenchScale(BenchScaleArgs {
            replay: replay.options,
            scales,
        })),
        Command::Help(_) => Ok(Command::Help(HelpTopic::Main)),
        other => Ok(other),
    }
}

/// `--device`'s value.
fn parse_backend(value: &str) -> Result<Backend, CliError> {
    Backend::from_name(value).ok_or_else(|| CliError::UnknownDevice {
        value: value.to_string(),
    })
}

fn parse_sim(args: &[&str]) -> Result<Command, CliError> {
    let mut args = Args {
        command: "sim",
        rest: args.iter(),
        seen: Vec::new(),
    };
    let number = |option: &'static str, value: &str| {
        value
            .trim()
            .parse::<u64>()
            .map_err(|_| CliError::BadNumber {
                option,
                value: value.to_string(),
                reason: "expected an integer from 0 to 2^64-1",
            })
    };
    let (mut first, mut seeds, mut one) = (None, None, None);
    while let Some(arg) = args.next() {
        match arg {
            Arg::Positional(p) => {
                return Err(CliError::UnexpectedArgument {
                    command: "sim",
                    arg: p.to_string(),
                });
            }
            Arg::Option("--help" | "-h", _) => return Ok(Command::Help(HelpTopic::Sim)),
            Arg::Option("--seed", inline) => {
                one = Some(number("--seed", args.single("--seed", inline)?)?);
            }
            Arg::Option("--first", inline) => {
                first = Some(number("--first", args.single("--first", inline)?)?);
            }
            Arg::Option("--seeds", inline) => {
                seeds = Some(number("--seeds", args.single("--seeds", inline)?)?);
            }
            Arg::Option(other, _) => return Err(args.unknown(other)),
        }
    }
    match (one, first, seeds) {
        (Some(seed), None, None) => Ok(Command::Sim(SimArgs {
            first: seed,
            seeds: 1,
        })),
        (Some(_), _, _) => Err(CliError::ConflictingOptions {
            options: "--seed runs one seed; --first and --seeds choose a range",
        }),
        (None, first, seeds) => Ok(Command::Sim(SimArgs {
            first: first.unwrap_or(0),
            seeds: seeds.unwrap_or(DEFAULT_SIM_SEEDS),
        })),
    }
}

/// Comma-separated items, spaces trimmed; an empty item is an error.
fn list<'a>(option: &'static str, value: &'a str) -> Result<Vec<&'a str>, CliError> {
    value
        .split(',')
        .map(str::trim)
        .map(|item| {
            if item.is_empty() {
                Err(CliError::EmptyListItem {
                    option,
                    value: value.to_string(),
                })
            } else {
                Ok(item)
            }
        })
        .collect()
}

fn parse_page_size(value: &str) -> Result<u32, CliError> {
    let bad = |reason| CliError::BadNumber {
        option: "--page-size",
        value: value.to_string(),
        reason,
    };
    let ps: u32 = value
        .parse()
        .map_err(|_| bad("expected a whole number of tokens"))?;
    if ps == 0 {
        return Err(bad("a page holds at least 1 token"));
    }
    if ps > MAX_PAGE_SIZE {
        return Err(bad("at most 65,536 tokens per page"));
    }
    Ok(ps)
}

fn parse_level(value: &str) -> Result<Level, CliError> {
    Level::parse(value).map_err(|_| CliError::UnknownLevel {
        value: value.to_string(),
    })
}

fn known_workloads() -> String {
    let mut names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
    names.push("all");
    names.join(", ")
}

/// `unikv --help`.
pub const MAIN_HELP: &str = "\
unikv: GPU memory for hybrid LLMs (FULL, SWA and Mamba state in one buffer), on the CPU

USAGE:
  unikv replay [OPTIONS]        replay serving workloads through the static and the
                                unified pool, side by side (try `unikv replay --help`)
  unikv bench-ops FILE [OPTIONS]
                                replay a recorded allocator operation trace and report
                                its throughput (try `unikv bench-ops --help`)
  unikv bench-scale [--scales K,K] [REPLAY OPTIONS]
                                the replay's runs at K times the pool and the requests
                                (K tenants side by side; default 1,4,16): host tokens/s
                                and step times per scale, to show cost growth
  unikv sim [OPTIONS]           the deterministic simulator with injected faults: random
                                engines over random configurations, every step checked
                                (try `unikv sim --help`)
  unikv help [COMMAND]          this text, or a command's

ENVIRONMENT:
  UNIKV_INVARIANT_CHECK         off|warn|strict|0|1|2: checked at start-up; the
                                commands' --invariants option sets the level they run at
";

/// `unikv bench-ops --help`.
pub const BENCH_OPS_HELP: &str = "\
unikv bench-ops: replay only the allocator operations a replay recorded, against a fresh
allocator, and report throughput (ops/s and tokens/s per operation kind)

USAGE:
  unikv bench-ops FILE [--invariants LEVEL]... [--device D] [--passes N] [--json]

ARGUMENTS:
  FILE                  an ops trace written by `unikv replay --record-ops FILE`

OPTIONS:
  --invariants LEVEL    off|warn|strict (or 0|1|2); repeat to measure at several levels
                        [default: off and strict]
  --device D            cpu (moves and fills carried out, their time taken out) or
                        none (bookkeeping only, no bytes kept) [default: cpu]
  --json                print one JSON object instead of the table
  -h, --help            this text
";

/// `unikv sim --help`.
pub const SIM_HELP: &str = "\
unikv sim: the deterministic simulator with injected faults. Each seed fixes a random
configuration (model, layout, page size, budget near the batch-size-1 floor, fault rate)
and a random engine driving the cache through it; every step checks the allocator, the
tree, every stamped KV and state byte (through the device translation too) and every
match against an independent oracle. A failing seed prints the command that reproduces it.

USAGE:
  unikv sim [--seeds N] [--first S]
  unikv sim --seed S

OPTIONS:
  --seeds N             how many seeds [default: 10000]
  --first S             the first seed [default: 0]
  --seed S              run only seed S (what a failure says to run)
  -h, --help            this text
";

/// The `--model` override keys, wrapped under the option's description.
fn wrap_keys() -> String {
    let mut lines = vec![String::new()];
    for key in unikv_workload::model::override_keys().split(", ") {
        let line = lines.last_mut().expect("one line at least");
        if line.len() + key.len() > 54 {
            lines.push(String::new());
        }
        let line = lines.last_mut().expect("one line at least");
        if !line.is_empty() {
            line.push_str(", ");
        }
        line.push_str(key);
    }
    lines.join(",\n                          ")
}

/// `unikv replay --help`.
pub fn replay_help() -> String {
    let workloads: String = Preset::ALL
        .iter()
        .map(|p| {
            let default = if Preset::DEFAULTS.contains(p) {
                ""
            } else if p.needs_recurrent_state() {
                " [default for a model with recurrent state]"
            } else {
                " [not run by default]"
            };
            format!("  {:<18}{}{default}\n", p.name(), p.description())
        })
        .collect();
    let models: String = ModelSpec::NAMED
        .iter()
        .map(|m| format!("  {:<17} {}\n", m.name, model_line(m)))
        .collect();
    format!(
        "\
unikv replay: run serving workloads through a deterministic scheduler, once with the
static paged pools (fixed FULL, SWA and state slot pools) and once with the unified
pool, and print a side-by-side report (on the CPU; no GPU needed)

USAGE:
  unikv replay [OPTIONS]

OPTIONS:
  --workload NAME[,NAME]  a preset to run; repeatable; `all` = the five defaults,
                          and mamba-starvation too for a model with recurrent state
                          [default: all, or none when --trace is given]
  --trace FILE            also run the requests of a JSON Lines trace (format below)
  --model NAME[:K=V,...]  the model's KV shapes [default: gpt-oss-20b]; K=V pairs
                          change its geometry, K one of:
                          {keys}
  --page-size N[,N]       tokens per page; repeatable [default: 1,256]
  --memory SIZE           the KV budget: 24GiB, 512MiB, 1.5GB, 4096 (bytes)
                          [default: {memory}, which puts the static split under
                          pressure on three of the four seed PR presets]
  --layout L              static, unified or both [default: both]
  --seed N                seed of the workloads and the scheduler [default: {seed}]
  --invariants LEVEL      off|warn|strict (or 0|1|2) [default: strict]
  --json                  print one JSON object instead of the table
  --no-timing             leave out CPU time per step (the one measurement that
                          varies between runs), for byte-identical output
  --svg DIR               write one SVG per run: each sub-pool's bytes over steps
  --record-ops FILE       record every allocator operation of the run (JSON Lines,
                          for `unikv bench-ops`); needs exactly one run
  --device D              cpu: the byte-keeping CPU device; none: bookkeeping only
                          (shapes checked, no bytes kept), for real budgets in
                          megabytes of memory [default: cpu]
  -h, --help              this text
  Every option but --workload and --page-size may be given once; list items
  (N,N) must not be empty.

WORKLOADS:
{workloads}
MODELS:
{models}
{trace}

{rows}
EXIT STATUS:
  0  every run finished every request with 0 host syncs, 0 invariant violations and
     0 leaked pages
  1  the report was printed, and some run failed one of those checks
  2  bad options, an unreadable trace, or a run that could not be carried out
",
        memory = format_bytes(DEFAULT_MEMORY_BYTES),
        seed = DEFAULT_SEED,
        keys = wrap_keys(),
        trace = trace::FORMAT_HELP,
        rows = unikv_replay::report::ROWS_HELP,
    )
}

/// One model's line in `--help`: its layers and what a token (and a request's state)
/// costs.
fn model_line(m: &ModelSpec) -> String {
    let mut layers = format!("{} FULL", m.full_layers);
    if m.swa_layers > 0 {
        layers += &format!(" + {} SWA", m.swa_layers);
    }
    if m.has_recurrent_state() {
        layers += &format!(" + {} recurrent", m.mamba_layers);
    }
    layers += " layers";
    if m.swa_layers > 0 {
        layers += &format!(" (window {})", m.window);
    }
    let bytes = if m.swa_layers == 0 {
        format!("{} bytes/token", group_digits(m.full_bytes_per_token()))
    } else if m.full_bytes_per_token() == m.swa_bytes_per_token() {
        format!(
            "{} bytes/token/side",
            group_digits(m.full_bytes_per_token())
        )
    } else {
        format!(
            "{} + {} bytes/token",
            group_digits(m.full_bytes_per_token()),
            group_digits(m.swa_bytes_per_token())
        )
    };
    if m.has_recurrent_state() {
        format!(
            "{layers}, {bytes},\n{:20}{} bytes of state per request",
            "",
            group_digits(m.state_bytes_per_request())
        )
    } else {
        format!("{layers}, {bytes}")
    }
}

/// The named models with recurrent (Mamba/GDN) state: those `mamba-starvation` runs on.
pub fn recurrent_models() -> impl Iterator<Item = ModelSpec> {
    ModelSpec::NAMED
        .into_iter()
        .filter(|m| m.has_recurrent_state())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay(args: &[&str]) -> Result<ReplayArgs, CliError> {
        let mut all = vec!["replay"];
        all.extend_from_slice(args);
        match parse_args(&all)? {
            Command::Replay(r) => Ok(r),
            other => panic!("{args:?}: not a replay: {other:?}"),
        }
    }

    #[test]
    fn no_options_give_the_documented_defaults() {
        let r = replay(&[]).unwrap();
        assert_eq!(r, ReplayArgs::default());
        assert_eq!(r.options.workloads, Preset::DEFAULTS);
        assert_eq!(r.options.page_sizes, [1, 256]);
        assert_eq!(r.options.layouts, [Layout::Static, Layout::Unified]);
        assert_eq!(r.options.model, ModelSpec::GPT_OSS_20B);
        assert_eq!(r.options.memory_bytes, 16 << 30);
        assert_eq!(r.options.invariant_level, Level::Strict);
        assert!(!r.json && r.options.timing && r.svg_dir.is_none() && r.options.trace.is_none());
        assert_eq!(r.options.runs(), 20);
    }

    #[test]
    fn every_named_model_is_accepted_and_all_adds_mamba_starvation_for_recurrent_ones() {
        for model in ModelSpec::NAMED {
            let parsed = replay(&["--model", model.name]).unwrap();
            assert_eq!(parsed.options.model, model);
            let mut expected = Preset::DEFAULTS.to_vec();
            if model.has_recurrent_state() {
                expected.push(Preset::MambaStarvation);
            }
            assert_eq!(parsed.options.workloads, expected, "{model}");
            // `all` means the same wherever --model comes on the line.
            let late = replay(&["--workload", "all", "--model", model.name]).unwrap();
            assert_eq!(late.options.workloads, expected, "{model}");
        }
        assert_eq!(
            recurrent_models().map(|m| m.name).collect::<Vec<_>>(),
            ["qwen3-next-80b-a3b", "nemotron-h-8b", "synthetic-tri"]
        );
        let r = replay(&[
            "--workload",
            "mamba-starvation,smoke",
            "--model",
            "nemotron-h-8b",
        ])
        .unwrap();
        assert_eq!(
            r.options.workloads,
            [Preset::MambaStarvation, Preset::Smoke]
        );
    }

    #[test]
    fn mamba_starvation_needs_a_model_with_recurrent_state() {
        for args in [
            &["--workload", "mamba-starvation"][..],
            &[
                "--workload",
                "smoke,mamba-starvation",
                "--model",
                "gemma-4-31b",
            ],
        ] {
            let err = replay(args).unwrap_err();
            assert!(
                matches!(
                    err,
                    CliError::NeedsRecurrentModel {
                        workload: "mamba-starvation",
                        ..
                    }
                ),
                "{args:?}: {err:?}"
            );
            let message = err.to_string();
            assert_eq!(message.lines().count(), 1);
            assert!(
                message.contains("needs a model with recurrent (Mamba/GDN) state")
                    && message.contains("qwen3-next-80b-a3b, nemotron-h-8b, synthetic-tri"),
                "{message}"
            );
        }
    }

    #[test]
    fn every_option_is_parsed() {
        let r = replay(&[
            "--workload",
            "smoke",
            "--workload=shared-prefix,long-outputs",
            "--workload",
            "smoke",
            "--model",
            "gpt-oss-120b",
            "--page-size",
            "16",
            "--page-size=1,16,64",
            "--memory",
            "24GiB",
            "--layout=unified",
            "--seed",
            "42",
            "--invariants",
            "warn",
            "--json",
            "--no-timing",
            "--svg",
            "out/plots",
            "--trace",
            "t.jsonl",
        ])
        .unwrap();
        assert_eq!(
            r.options.workloads,
            [Preset::Smoke, Preset::SharedPrefix, Preset::LongOutputs]
        );
        assert_eq!(r.options.model, ModelSpec::GPT_OSS_120B);
        assert_eq!(r.options.page_sizes, [16, 1, 64]);
        assert_eq!(r.options.memory_bytes, 24 << 30);
        assert_eq!(r.options.layouts, [Layout::Unified]);
        assert_eq!(r.options.seed, 42);
        assert_eq!(r.options.invariant_level, Level::Warn);
        assert!(r.json && !r.options.timing);
        assert_eq!(r.svg_dir, Some(PathBuf::from("out/plots")));
        assert_eq!(r.options.trace, Some(PathBuf::from("t.jsonl")));
        assert_eq!(r.options.runs(), 4 * 3);

        let r = replay(&["--workload", "all", "--workload", "smoke"]).unwrap();
        assert_eq!(r.options.workloads.len(), 6);
        let r = replay(&["--page-size", " 4 , 1", "--page-size=4"]).unwrap();
        assert_eq!(
            r.options.page_sizes,
            [4, 1],
            "items are trimmed; an item named twice runs once"
        );
    }

    #[test]
    fn an_option_given_twice_is_an_error_naming_it() {
        for (args, option) in [
            (&["--layout", "static", "--layout", "BOTH"][..], "--layout"),
            (&["--seed", "1", "--seed=1"], "--seed"),
            (&["--memory", "1GiB", "--memory", "2GiB"], "--memory"),
            (
                &["--model", "gpt-oss-20b", "--model", "gpt-oss-120b"],
                "--model",
            ),
            (
                &["--invariants", "off", "--invariants", "strict"],
                "--invariants",
            ),
            (&["--json", "--json"], "--json"),
            (&["--no-timing", "--no-timing"], "--no-timing"),
            (&["--svg", "a", "--svg", "b"], "--svg"),
            (&["--trace", "a", "--trace", "b"], "--trace"),
            (&["--record-ops", "a", "--record-ops", "b"], "--record-ops"),
        ] {
            let err = replay(args).unwrap_err();
            assert!(
                matches!(err, CliError::RepeatedOption { option: o } if o == option),
                "{args:?}: {err:?}"
            );
            assert!(err.to_string().contains(option), "{err}");
        }
        let err = parse_args(&["bench-ops", "f", "--json", "--json"]).unwrap_err();
        assert!(
            matches!(err, CliError::RepeatedOption { option: "--json" }),
            "{err:?}"
        );
        // The documented repeatable options stay repeatable.
        assert!(replay(&["--workload", "smoke", "--workload", "smoke"]).is_ok());
        assert!(replay(&["--page-size", "1", "--page-size", "4"]).is_ok());
        assert!(parse_args(&["bench-ops", "f", "--invariants", "0", "--invariants", "2"]).is_ok());
    }

    #[test]
    fn an_empty_list_item_is_an_error() {
        for (args, option) in [
            (&["--page-size", "1,,256"][..], "--page-size"),
            (&["--page-size", "1,256,"], "--page-size"),
            (&["--page-size=,1"], "--page-size"),
            (&["--page-size", "1, ,4"], "--page-size"),
            (&["--workload", "smoke,,long-outputs"], "--workload"),
            (&["--workload", "smoke,"], "--workload"),
        ] {
            let err = replay(args).unwrap_err();
            assert!(
                matches!(&err, CliError::EmptyListItem { option: o, .. } if *o == option),
                "{args:?}: {err:?}"
            );
            assert_eq!(err.to_string().lines().count(), 1);
        }
    }

    #[test]
    fn a_trace_alone_runs_only_the_trace() {
        let r = replay(&["--trace", "mine.jsonl"]).unwrap();
        assert!(r.options.workloads.is_empty());
        assert_eq!(r.options.runs(), 4);
    }

    #[test]
    fn record_ops_needs_exactly_one_run() {
        let err = replay(&["--record-ops", "ops.jsonl"]).unwrap_err();
        assert!(
            matches!(err, CliError::RecordOpsNeedsOneRun { runs: 20 }),
            "{err:?}"
        );
        let r = replay(&[
            "--record-ops",
            "ops.jsonl",
            "--workload",
            "smoke",
            "--page-size",
            "1",
            "--layout",
            "unified",
        ])
        .unwrap();
        assert_eq!(r.options.record_ops, Some(PathBuf::from("ops.jsonl")));
    }

    #[test]
    fn bad_values_give_typed_errors() {
        let check = |args: &[&str], expected: &dyn Fn(&CliError) -> bool| {
            let err = replay(args).unwrap_err();
            assert!(expected(&err), "{args:?}: {err:?}");
            assert_eq!(err.to_string().lines().count(), 1, "{err}");
        };
        check(
            &["--workload", "nope"],
            &|e| matches!(e, CliError::UnknownWorkload { name, known } if name == "nope" && known.contains("shared-prefix")),
        );
        check(&["--model", "llama"], &|e| {
            matches!(
                e,
                CliError::Workload(unikv_workload::WorkloadError::UnknownModel { .. })
            )
        });
        check(
            &["--page-size", "0"],
            &|e| matches!(e, CliError::BadNumber { option: "--page-size", reason, .. } if reason.contains("at least 1")),
        );
        check(&["--page-size", "x"], &|e| {
            matches!(
                e,
                CliError::BadNumber {
                    option: "--page-size",
                    ..
                }
            )
        });
        check(&["--page-size", "-4"], &|e| {
            matches!(
                e,
                CliError::MissingValue { .. } | CliError::BadNumber { .. }
            )
        });
        check(&["--page-size", "100000"], &|e| {
            matches!(e, CliError::BadNumber { .. })
        });
        check(&["--memory", "24G"], &|e| {
            matches!(
                e,
                CliError::Workload(unikv_workload::WorkloadError::BadMemory { .. })
            )
        });
        check(&["--memory", "0"], &|e| {
            matches!(
                e,
                CliError::Workload(unikv_workload::WorkloadError::BadMemory { .. })
            )
        });
        check(&["--layout", "paged"], &|e| {
            matches!(e, CliError::UnknownLayout { .. })
        });
        check(&["--seed", "-1"], &|e| {
            matches!(
                e,
                CliError::BadNumber {
                    option: "--seed",
                    ..
                }
            )
        });
        check(&["--seed", "1.5"], &|e| {
            matches!(
                e,
                CliError::BadNumber {
                    option: "--seed",
                    ..
                }
            )
        });
        check(&["--invariants", "loud"], &|e| {
            matches!(e, CliError::UnknownLevel { .. })
        });
        check(&["--seed"], &|e| {
            matches!(e, CliError::MissingValue { option: "--seed" })
        });
        check(&["--svg", "--json"], &|e| {
            matches!(e, CliError::MissingValue { option: "--svg" })
        });
        check(&["--memory="], &|e| {
            matches!(e, CliError::MissingValue { option: "--memory" })
        });
        check(&["--json=yes"], &|e| {
            matches!(
                e,
                CliError::UnexpectedValue {
                    option: "--json",
                    ..
                }
            )
        });
        check(
            &["--frobnicate"],
            &|e| matches!(e, CliError::UnknownOption { command: "replay", option } if option == "--frobnicate"),
        );
        check(&["smoke"], &|e| {
            matches!(e, CliError::UnexpectedArgument { .. })
        });
    }

    #[test]
    fn sim_takes_a_range_of_seeds_or_one_seed() {
        let sim = |args: &[&str]| match parse_args(args) {
            Ok(Command::Sim(s)) => Ok(s),
            Ok(other) => panic!("{args:?}: {other:?}"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(
            sim(&["sim"]),
            Ok(SimArgs {
                first: 0,
                seeds: DEFAULT_SIM_SEEDS
            })
        );
        assert_eq!(
            sim(&["sim", "--seeds", "50", "--first=7"]),
            Ok(SimArgs {
                first: 7,
                seeds: 50
            })
        );
        assert_eq!(
            sim(&["sim", "--seed", "42"]),
            Ok(SimArgs {
                first: 42,
                seeds: 1
            })
        );
        let err = sim(&["sim", "--seed", "1", "--seeds", "2"]).unwrap_err();
        assert!(err.contains("conflicting options"), "{err}");
        let err = sim(&["sim", "--seeds", "-1"]).unwrap_err();
        assert!(err.contains("--seeds"), "{err}");
        let err = sim(&["sim", "--seeds", "1", "--seeds", "2"]).unwrap_err();
        assert!(err.contains("given twice"), "{err}");
        let err = sim(&["sim", "7"]).unwrap_err();
        assert!(err.contains("unexpected argument"), "{err}");
        assert_eq!(
            parse_args(&["help", "sim"]).unwrap(),
            Command::Help(HelpTopic::Sim)
        );
        assert_eq!(
            parse_args(&["sim", "-h"]).unwrap(),
            Command::Help(HelpTopic::Sim)
        );
        assert!(HelpTopic::Main.text().contains("unikv sim"));
    }

    #[test]
    fn commands_and_help() {
        let none: [&str; 0] = [];
        assert_eq!(parse_args(&none).unwrap(), Command::Help(HelpTopic::Main));
        assert_eq!(parse_args(&["-h"]).unwrap(), Command::Help(HelpTopic::Main));
        assert_eq!(
            parse_args(&["help", "replay"]).unwrap(),
            Command::Help(HelpTopic::Replay)
        );
        assert_eq!(
            parse_args(&["replay", "--seed", "3", "--help"]).unwrap(),
            Command::Help(HelpTopic::Replay)
        );
        assert_eq!(
            parse_args(&["bench-ops", "-h"]).unwrap(),
            Command::Help(HelpTopic::BenchOps)
        );
        assert!(matches!(
            parse_args(&["rerun"]),
            Err(CliError::UnknownCommand { .. })
        ));
        let help = HelpTopic::Replay.text();
        for needle in [
            "may be given once",
            "--record-ops FILE",
            "16.00 GiB",
            "random-8192-64",
            "prefix_len",
            "EXIT STATUS",
        ] {
            assert!(help.contains(needle), "{needle}");
        }
    }

    #[test]
    fn bench_ops_takes_a_file_and_levels() {
        let Command::BenchOps(b) = parse_args(&["bench-ops", "ops.jsonl"]).unwrap() else {
            panic!("not bench-ops");
        };
        assert_eq!(b.file, PathBuf::from("ops.jsonl"));
        assert_eq!(b.levels, [Level::Off, Level::Strict]);
        let Command::BenchOps(b) =
            parse_args(&["bench-ops", "--invariants", "2", "ops.jsonl", "--json"]).unwrap()
        else {
            panic!("not bench-ops");
        };
        assert_eq!((b.levels, b.json, b.passes), (vec![Level::Strict], true, 5));
        let Command::BenchOps(b) = parse_args(&["bench-ops", "f", "--passes", "3"]).unwrap() else {
            panic!("not bench-ops");
        };
        assert_eq!(b.passes, 3);
        for bad in ["0", "-1", "x"] {
            assert!(matches!(
                parse_args(&["bench-ops", "f", "--passes", bad]),
                Err(CliError::BadNumber {
                    option: "--passes",
                    ..
                })
            ));
        }
        assert!(matches!(
            parse_args(&["bench-ops"]),
            Err(CliError::MissingArgument {
                command: "bench-ops",
                ..
            })
        ));
        assert!(matches!(
            parse_args(&["bench-ops", "a", "b"]),
            Err(CliError::UnexpectedArgument { .. })
        ));
        assert!(matches!(
            parse_args(&["bench-ops", "a", "--seed", "1"]),
            Err(CliError::UnknownOption {
                command: "bench-ops",
                ..
            })
        ));
    }

    #[test]
    fn arguments_must_be_utf8() {
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            let bad = OsString::from_vec(vec![b'-', b'-', 0xff]);
            let err = parse_os_args([OsString::from("replay"), bad]).unwrap_err();
            assert!(matches!(err, CliError::NotUtf8 { .. }), "{err:?}");
        }
        assert!(parse_os_args([OsString::from("replay")]).is_ok());
    }
}

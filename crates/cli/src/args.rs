//! The command line, declared with clap's derive API: `unikv replay`, `unikv bench-ops
//! FILE`, `unikv bench-scale`, `unikv bench-overlap`, `unikv sim` and `unikv help
//! [COMMAND]`.
//!
//! Each subcommand's arguments ([`ReplayCli`], [`BenchOpsCli`], [`BenchScaleCli`],
//! [`SimCli`]) resolve into the types the commands take ([`ReplayArgs`],
//! [`BenchOpsArgs`], `BenchScaleArgs`, `SimArgs`), where the rules that span options are
//! checked: what `--workload all` means for the model, a workload that needs recurrent
//! state, one run for `--record-ops`.
//!
//! clap enforces the rest: an option that takes one value may be given once (a flag
//! too); `--workload`, `--page-size`, `--scales` and `bench-ops`'s `--invariants` may be
//! repeated. The first three take comma-separated lists whose items are trimmed and must
//! not be empty (`1,,256` is an error); an item named twice runs once. Every value is
//! checked by its parser before any command runs, with a message that names the option.
//! [`one_line`] turns clap's error into the binary's single line on stderr.

use crate::error::CliError;
use crate::help;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use unikv::ModelSpec;
use unikv_dst::SimArgs;
use unikv_invariants::Level;
use unikv_replay::scale::BenchScaleArgs;
use unikv_replay::{Backend, LAYOUTS, Layout, ReplayOptions, SpecMode};
use unikv_workload::Preset;
use unikv_workload::units::{MAX_PAGE_SIZE, group_digits};

/// The command line of `unikv`.
#[derive(Debug, Parser)]
#[command(
    name = "unikv",
    about = "unikv: GPU memory for hybrid LLMs (FULL, SWA and Mamba state in one buffer), on the CPU",
    after_help = help::MAIN_AFTER,
    version,
    arg_required_else_help = true
)]
pub struct Cli {
    /// The command; without one, the help is printed on stderr with status 2.
    #[command(subcommand)]
    pub command: CommandCli,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum CommandCli {
    /// Replay serving workloads through the static and the unified pool, side by side
    #[command(
        long_about = help::REPLAY_ABOUT,
        after_long_help = help::replay_after(),
    )]
    Replay(ReplayCli),
    /// Replay a recorded allocator operation trace and report its throughput
    #[command(long_about = help::BENCH_OPS_ABOUT)]
    BenchOps(BenchOpsCli),
    /// The replay's runs at K times the pool and the requests (K tenants side by side):
    /// host tokens/s and step times per scale, to show cost growth
    #[command(after_long_help = help::BENCH_SCALE_AFTER)]
    BenchScale(BenchScaleCli),
    /// GPU idle between forwards under an overlap scheduler, unikv vs a syncing free path
    /// (on the CUDA backend: a GPU, or the emulated driver)
    #[command(long_about = help::BENCH_OVERLAP_ABOUT)]
    BenchOverlap(BenchOverlapCli),
    /// The deterministic simulator with injected faults: random engines over random
    /// configurations, every step checked
    #[command(long_about = help::SIM_ABOUT)]
    Sim(SimCli),
}

/// What runs: the options `unikv replay` and `unikv bench-scale` share (the workloads,
/// the model, the cache, speculation and the ops recording).
#[derive(Clone, Debug, Args)]
pub struct RunCli {
    /// A preset to run; repeatable; `all` = the five defaults, and mamba-starvation too for
    /// a model with recurrent state [default: all, or none when --trace is given]
    #[arg(long = "workload", value_name = "NAME[,NAME]", value_parser = parse_workloads)]
    pub workloads: Vec<WorkloadList>,
    /// Also run the requests of a JSON Lines trace (its format: `unikv replay --help`)
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// The model's KV shapes; K=V pairs change its geometry (models and keys: `unikv
    /// replay --help`)
    #[arg(
        long,
        value_name = "NAME[:K=V,...]",
        default_value = "gpt-oss-20b",
        value_parser = parse_model,
        long_help = help::model_option()
    )]
    pub model: ModelSpec,
    /// Tokens per page; repeatable
    #[arg(
        long = "page-size",
        value_name = "N[,N]",
        default_value = "1,256",
        value_parser = parse_page_sizes
    )]
    pub page_sizes: Vec<PageSizes>,
    /// The KV budget: 24GiB, 512MiB, 1.5GB, 4096 (bytes); the default puts the static
    /// split under pressure on three of the four seed PR presets
    #[arg(long, value_name = "SIZE", default_value = "16GiB", value_parser = parse_memory)]
    pub memory: u64,
    /// static, unified or both
    #[arg(long, value_name = "L", default_value = "both", value_parser = parse_layouts)]
    pub layout: Layouts,
    /// Seed of the workloads and the scheduler
    #[arg(long, value_name = "N", default_value_t = unikv_replay::config::DEFAULT_SEED, value_parser = parse_seed)]
    pub seed: u64,
    /// off|warn|strict (or 0|1|2)
    #[arg(long, value_name = "LEVEL", default_value = "strict", value_parser = parse_level)]
    pub invariants: Level,
    /// Record every allocator operation of the run (JSON Lines, for `unikv bench-ops`);
    /// needs exactly one run
    #[arg(long = "record-ops", value_name = "FILE")]
    pub record_ops: Option<PathBuf>,
    /// cpu: the byte-keeping CPU device; none: bookkeeping only (shapes checked, no bytes
    /// kept), for real budgets in megabytes of memory
    #[arg(long, value_name = "D", default_value = "cpu", value_parser = parse_backend)]
    pub device: Backend,
    /// Speculative decoding: every decode step verifies the next token and a chain of K
    /// drafts (1 to 63), each accepted with p = 0.85 (seeded); each run is also replayed
    /// without speculation for comparison
    #[arg(long = "spec", value_name = "K", value_parser = parse_spec_chain)]
    pub spec: Option<SpecMode>,
    /// Speculative decoding with a draft tree of N nodes (2 to 64): node i's parent is
    /// (i-1)/2, the same tree for every request
    #[arg(
        long = "spec-tree",
        value_name = "N",
        value_parser = parse_spec_tree,
        conflicts_with = "spec"
    )]
    pub spec_tree: Option<SpecMode>,
    /// With --spec or --spec-tree: accepted counts arrive one step late (each step's
    /// verify is allocated before the one before it is settled, as an overlap scheduler
    /// does)
    #[arg(long = "spec-late")]
    pub spec_late: bool,
}

/// `unikv replay`'s options: what runs, and the report's outputs.
#[derive(Clone, Debug, Args)]
pub struct ReplayCli {
    /// What runs.
    #[command(flatten)]
    pub run: RunCli,
    /// A host tier of SIZE (as --memory): prefixes the device evicts are written back to
    /// host memory and loaded back by the prompts that match them; the report adds the
    /// host's rows (REPORT ROWS) [default: none]
    #[arg(long = "host-memory", value_name = "SIZE", value_parser = parse_memory)]
    pub host_memory: Option<u64>,
    /// Models with recurrent layers save a state every TOKENS tokens (a multiple of the
    /// page size), in prefill and decode alike [default: 256 in whole pages, SGLang's
    /// --mamba-track-interval]
    #[arg(long = "checkpoint-interval", value_name = "TOKENS")]
    pub checkpoint_interval: Option<u32>,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
    /// Leave out CPU time per step (the one measurement that varies between runs), for
    /// byte-identical output
    #[arg(long = "no-timing")]
    pub no_timing: bool,
    /// Write one SVG per run: each sub-pool's bytes over steps
    #[arg(long, value_name = "DIR")]
    pub svg: Option<PathBuf>,
}

/// `unikv bench-ops`'s arguments.
#[derive(Clone, Debug, Args)]
pub struct BenchOpsCli {
    /// An ops trace written by `unikv replay --record-ops FILE`
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// off|warn|strict (or 0|1|2); repeat to measure at several levels [default: off and
    /// strict]
    #[arg(long = "invariants", value_name = "LEVEL", value_parser = parse_level)]
    pub levels: Vec<Level>,
    /// cpu (moves and fills carried out, their time taken out) or none (bookkeeping only,
    /// no bytes kept)
    #[arg(long, value_name = "D", default_value = "cpu", value_parser = parse_backend)]
    pub device: Backend,
    /// Replays per level (1 to 1,000), each against a fresh allocator; the pass with the
    /// median total time is reported
    #[arg(long, value_name = "N", default_value = "5", value_parser = parse_passes)]
    pub passes: usize,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
}

/// `unikv bench-scale`'s arguments: the scales, what one scale-1 run is (the replay's
/// options but its outputs: the table times every run, so there is no `--no-timing`,
/// and it draws no plot, so there is no `--svg`) and `--json`.
#[derive(Clone, Debug, Args)]
pub struct BenchScaleCli {
    /// The scales K, each from 1 to 256; repeatable
    #[arg(long, value_name = "K[,K]", default_value = "1,4,16", value_parser = parse_scales)]
    pub scales: Vec<Scales>,
    /// What one scale-1 run is.
    #[command(flatten)]
    pub run: RunCli,
    /// Print one JSON object (schema unikv.bench-scale.v1) instead of the tables
    #[arg(long)]
    pub json: bool,
}

/// Where `unikv bench-overlap` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverlapDevice {
    /// GPU 0 (a build with the `cuda` feature).
    Cuda,
    /// The CUDA backend on its emulated driver, spins in host time: checks the loop.
    Emulated,
}

/// `unikv bench-overlap`'s arguments.
#[derive(Clone, Debug, Args)]
pub struct BenchOverlapCli {
    /// cuda (GPU 0; a build with `--features cuda`) or emulated (the CUDA backend on an
    /// emulated driver whose forwards are host time: checks the loop, not a GPU)
    #[arg(long, value_name = "D", default_value = "cuda", value_parser = parse_overlap_device)]
    pub device: OverlapDevice,
    /// The forward's duration in microseconds (a spin kernel calibrated to it)
    #[arg(long = "forward-us", value_name = "US", default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub forward_us: u64,
    /// Presets to replay (`all`: the model's defaults, as for `replay`); repeatable
    #[arg(
        long = "workload",
        value_name = "NAME[,NAME]",
        default_value = "shared-prefix,random-2048-512",
        value_parser = parse_workloads
    )]
    pub workloads: Vec<WorkloadList>,
    /// Tokens per page; repeatable
    #[arg(
        long = "page-size",
        value_name = "N[,N]",
        default_value = "1,16,256",
        value_parser = parse_page_sizes
    )]
    pub page_sizes: Vec<PageSizes>,
    /// The first workload is also replayed speculatively at every page size: a chain of
    /// K drafts settled a step late, as an overlap scheduler does (0: no speculative rows)
    #[arg(long = "spec", value_name = "K", default_value = "4", value_parser = parse_overlap_spec)]
    pub spec: OverlapSpec,
    /// The model's KV shapes
    #[arg(long, value_name = "NAME[:K=V,...]", default_value = "gpt-oss-20b", value_parser = parse_model)]
    pub model: ModelSpec,
    /// The KV budget (a device allocation of this size)
    #[arg(long, value_name = "SIZE", default_value = "16GiB", value_parser = parse_memory)]
    pub memory: u64,
    /// Seed of the workloads and the scheduler
    #[arg(long, value_name = "N", default_value_t = unikv_replay::config::DEFAULT_SEED, value_parser = parse_seed)]
    pub seed: u64,
    /// Print one JSON object (schema unikv.bench-overlap.v1) instead of the table
    #[arg(long)]
    pub json: bool,
}

/// `unikv sim`'s arguments.
#[derive(Clone, Copy, Debug, Args)]
pub struct SimCli {
    /// How many seeds
    #[arg(long, value_name = "N", default_value_t = unikv_dst::DEFAULT_SIM_SEEDS, value_parser = parse_seed)]
    pub seeds: u64,
    /// The first seed
    #[arg(long, value_name = "S", default_value_t = 0, value_parser = parse_seed)]
    pub first: u64,
    /// Run only seed S (what a failure says to run)
    #[arg(long, value_name = "S", conflicts_with_all = ["seeds", "first"], value_parser = parse_seed)]
    pub seed: Option<u64>,
}

/// A parsed command.
#[derive(Debug)]
pub enum Command {
    /// `unikv replay`.
    Replay(ReplayArgs),
    /// `unikv bench-ops FILE`.
    BenchOps(BenchOpsArgs),
    /// `unikv bench-scale`.
    BenchScale(BenchScaleArgs),
    /// `unikv bench-overlap`.
    BenchOverlap(BenchOverlapArgs),
    /// `unikv sim`.
    Sim(SimArgs),
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

/// The options of `unikv bench-overlap`, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchOverlapArgs {
    /// Where it runs.
    pub device: OverlapDevice,
    /// The forward's duration.
    pub forward: std::time::Duration,
    /// The runs: the presets at each page size, unified, without speculation, then the
    /// first preset with it (when asked for).
    pub options: ReplayOptions,
    /// The speculative rows' mode (a chain settled late), if any.
    pub speculation: Option<SpecMode>,
    /// One JSON object instead of the table.
    pub json: bool,
}

/// The options of `unikv bench-ops`, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchOpsArgs {
    /// The ops file written by `unikv replay --record-ops`.
    pub file: PathBuf,
    /// The invariant levels to measure at, in order, without duplicates (default off and
    /// strict, the two levels of the throughput targets).
    pub levels: Vec<Level>,
    /// Print one JSON object instead of the table.
    pub json: bool,
    /// The device the allocator runs on.
    pub backend: Backend,
    /// Replays per level, each against a fresh allocator; the pass with the median total
    /// time is reported.
    pub passes: usize,
}

impl Cli {
    /// The command these arguments give, with the rules that span options checked.
    pub fn into_command(self) -> Result<Command, CliError> {
        Ok(match self.command {
            CommandCli::Replay(replay) => Command::Replay(replay.resolve()?),
            CommandCli::BenchOps(b) => Command::BenchOps(b.resolve()),
            CommandCli::BenchScale(b) => Command::BenchScale(b.resolve()?),
            CommandCli::BenchOverlap(b) => Command::BenchOverlap(b.resolve()),
            CommandCli::Sim(sim) => Command::Sim(sim.resolve()?),
        })
    }
}

/// The items of every occurrence of a list option, in order, each once.
fn union<T: PartialEq>(lists: impl IntoIterator<Item = Vec<T>>) -> Vec<T> {
    let mut items = Vec::new();
    for item in lists.into_iter().flatten() {
        if !items.contains(&item) {
            items.push(item);
        }
    }
    items
}

impl ReplayCli {
    /// The resolved options: `all` expanded for the model, lists merged, and the rules
    /// that span options checked (a workload that needs recurrent state, `--record-ops`
    /// with one run).
    pub fn resolve(self) -> Result<ReplayArgs, CliError> {
        let options = ReplayOptions {
            host_memory_bytes: self.host_memory.unwrap_or(0),
            checkpoint_interval: self.checkpoint_interval,
            ..self.run.resolve(!self.no_timing)?
        };
        if options.record_ops.is_some() && options.runs() != 1 {
            return Err(CliError::RecordOpsNeedsOneRun {
                runs: options.runs(),
            });
        }
        Ok(ReplayArgs {
            options,
            json: self.json,
            svg_dir: self.svg,
        })
    }
}

impl BenchScaleCli {
    /// The resolved options: the runs at every scale, always timed; `--record-ops` only
    /// when the runs and the scales make one run (one file records one run: recording
    /// each into the same file would keep only the last).
    pub fn resolve(self) -> Result<BenchScaleArgs, CliError> {
        let replay = self.run.resolve(true)?;
        let scales = union(self.scales.into_iter().map(|s| s.0));
        let runs = replay.runs().saturating_mul(scales.len());
        if replay.record_ops.is_some() && runs != 1 {
            return Err(CliError::ScaleRecordOpsNeedsOneRun { runs });
        }
        Ok(BenchScaleArgs {
            replay,
            scales,
            json: self.json,
        })
    }
}

impl RunCli {
    /// What runs: `all` expanded for the model, lists merged, the workload that needs
    /// recurrent state and `--spec-late` alone refused; `timing` as the command has it.
    pub fn resolve(self, timing: bool) -> Result<ReplayOptions, CliError> {
        let model = self.model;
        let mut items: Vec<Option<Preset>> = self.workloads.into_iter().flat_map(|w| w.0).collect();
        if items.is_empty() && self.trace.is_none() {
            items.push(None);
        }
        let workloads = union(items.into_iter().map(|item| match item {
            Some(preset) => vec![preset],
            None => Preset::defaults_for(&model),
        }));
        if let Some(preset) = workloads
            .iter()
            .find(|p| p.needs_recurrent_state() && !model.has_recurrent_state())
        {
            return Err(CliError::NeedsRecurrentModel {
                workload: preset.name(),
                model: model.name,
                recurrent: recurrent_models()
                    .map(|m| m.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let speculation = match (self.spec.or(self.spec_tree), self.spec_late) {
            (Some(mode), late) => Some(if late { mode.late() } else { mode }),
            (None, true) => return Err(CliError::SpecLateAlone),
            (None, false) => None,
        };
        let options = ReplayOptions {
            workloads,
            trace: self.trace,
            model,
            page_sizes: union(self.page_sizes.into_iter().map(|p| p.0)),
            memory_bytes: self.memory,
            layouts: self.layout.0,
            seed: self.seed,
            invariant_level: self.invariants,
            timing,
            record_ops: self.record_ops,
            backend: self.device,
            speculation,
            // `unikv replay`'s own options (`ReplayCli::resolve`); bench-scale has none.
            host_memory_bytes: 0,
            checkpoint_interval: None,
        };
        Ok(options)
    }
}

impl BenchOverlapCli {
    /// The resolved options: lists merged, the unified layout at invariant level off (a
    /// server's), speculation a late-settled chain.
    pub fn resolve(self) -> BenchOverlapArgs {
        // `all` is the model's defaults, in its place in the list (as for `replay`).
        let model = self.model;
        let workloads: Vec<Preset> = union(self.workloads.into_iter().flat_map(|w| w.0).map(
            |item| match item {
                Some(preset) => vec![preset],
                None => Preset::defaults_for(&model),
            },
        ));
        BenchOverlapArgs {
            device: self.device,
            forward: std::time::Duration::from_micros(self.forward_us),
            options: ReplayOptions {
                workloads,
                model: self.model,
                page_sizes: union(self.page_sizes.into_iter().map(|p| p.0)),
                memory_bytes: self.memory,
                layouts: vec![Layout::Unified],
                seed: self.seed,
                invariant_level: Level::Off,
                ..ReplayOptions::default()
            },
            speculation: self.spec.0,
            json: self.json,
        }
    }
}

impl BenchOpsCli {
    /// The resolved options (levels without duplicates, off and strict by default).
    pub fn resolve(self) -> BenchOpsArgs {
        let mut levels = union(self.levels.into_iter().map(|l| vec![l]));
        if levels.is_empty() {
            levels = vec![Level::Off, Level::Strict];
        }
        BenchOpsArgs {
            file: self.file,
            levels,
            json: self.json,
            backend: self.device,
            passes: self.passes,
        }
    }
}

impl SimCli {
    /// The seeds to run: `--seed` alone, or the range of `--first` and `--seeds`, which
    /// must hold a seed and end at `u64::MAX` at the latest.
    pub fn resolve(self) -> Result<SimArgs, CliError> {
        let (first, seeds) = match self.seed {
            Some(seed) => (seed, 1),
            None => (self.first, self.seeds),
        };
        Ok(SimArgs::new(first, seeds)?)
    }
}

/// The items of one `--workload` value: a preset, or `None` for `all` (what it means
/// depends on the model, which may come later on the line).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadList(pub Vec<Option<Preset>>);

/// The page sizes of one `--page-size` value.
#[derive(Clone, Debug, PartialEq)]
pub struct PageSizes(pub Vec<u32>);

/// The scales of one `--scales` value.
#[derive(Clone, Debug, PartialEq)]
pub struct Scales(pub Vec<u32>);

/// The layouts of `--layout`, static first.
#[derive(Clone, Debug, PartialEq)]
pub struct Layouts(pub Vec<Layout>);

/// Comma-separated items, spaces trimmed; an empty item is an error.
fn list(value: &str) -> Result<Vec<&str>, String> {
    value
        .split(',')
        .map(str::trim)
        .map(|item| {
            if item.is_empty() {
                Err(format!(
                    "empty item in {value:?} (items are separated by single commas)"
                ))
            } else {
                Ok(item)
            }
        })
        .collect()
}

fn parse_workloads(value: &str) -> Result<WorkloadList, String> {
    let items = list(value)?
        .into_iter()
        .map(|name| {
            if name.eq_ignore_ascii_case("all") {
                return Ok(None);
            }
            Preset::from_name(name).map(Some).ok_or_else(|| {
                let mut known: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
                known.push("all");
                format!("unknown workload {name:?} (known: {})", known.join(", "))
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(WorkloadList(items))
}

fn parse_page_sizes(value: &str) -> Result<PageSizes, String> {
    list(value)?
        .into_iter()
        .map(|item| {
            let ps: u32 = item
                .parse()
                .map_err(|_| format!("{item:?}: expected a whole number of tokens"))?;
            if ps == 0 {
                return Err("a page holds at least 1 token".into());
            }
            if ps > MAX_PAGE_SIZE {
                return Err(format!("{ps}: at most 65,536 tokens per page"));
            }
            Ok(ps)
        })
        .collect::<Result<_, String>>()
        .map(PageSizes)
}

fn parse_scales(value: &str) -> Result<Scales, String> {
    list(value)?
        .into_iter()
        .map(|item| {
            item.parse::<u32>()
                .ok()
                .filter(|k| (1..=256).contains(k))
                .ok_or_else(|| format!("{item:?}: expected an integer from 1 to 256"))
        })
        .collect::<Result<_, String>>()
        .map(Scales)
}

fn parse_layouts(value: &str) -> Result<Layouts, String> {
    Ok(Layouts(match value.trim().to_ascii_lowercase().as_str() {
        "static" => vec![LAYOUTS[0]],
        "unified" => vec![Layout::Unified],
        "both" => LAYOUTS.to_vec(),
        _ => {
            return Err(format!(
                "unknown layout {value:?} (expected static, unified or both)"
            ));
        }
    }))
}

fn parse_model(value: &str) -> Result<ModelSpec, String> {
    unikv_workload::model::parse_model(value).map_err(|e| e.to_string())
}

fn parse_memory(value: &str) -> Result<u64, String> {
    unikv_workload::units::parse_memory(value).map_err(|e| e.to_string())
}

fn parse_seed(value: &str) -> Result<u64, String> {
    value
        .trim()
        .parse()
        .map_err(|_| "expected an integer from 0 to 2^64-1".to_string())
}

/// The most passes `bench-ops --passes` takes: each pass replays the whole trace (up to
/// 2^24 operations) at every level, so a thousand is already minutes of a large trace;
/// a larger number is a typo, not a measurement.
pub const MAX_PASSES: usize = 1_000;

fn parse_passes(value: &str) -> Result<usize, String> {
    value
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=MAX_PASSES).contains(n))
        .ok_or_else(|| {
            format!(
                "expected a whole number of passes, at least 1 and at most {}",
                group_digits(MAX_PASSES as u64)
            )
        })
}

fn parse_level(value: &str) -> Result<Level, String> {
    Level::parse(value).map_err(|_| {
        format!("unknown invariant level {value:?} (expected off, warn, strict, 0, 1, 2)")
    })
}

/// `--spec K` or `--spec-tree N`: a whole number, in the range [`SpecMode`] checks.
fn parse_spec(
    value: &str,
    what: &str,
    mode: fn(u64) -> Result<SpecMode, unikv_replay::ReplayError>,
) -> Result<SpecMode, String> {
    let n: u64 = value
        .trim()
        .parse()
        .map_err(|_| format!("expected a whole number of {what}"))?;
    mode(n).map_err(|e| match e {
        unikv_replay::ReplayError::BadSpeculation { reason, .. } => reason,
        other => other.to_string(),
    })
}

/// `bench-overlap`'s `--spec K`: a late-settled chain of K drafts, or none for 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OverlapSpec(pub Option<SpecMode>);

fn parse_overlap_spec(value: &str) -> Result<OverlapSpec, String> {
    if value.trim() == "0" {
        return Ok(OverlapSpec(None));
    }
    parse_spec_chain(value).map(|mode| OverlapSpec(Some(mode.late())))
}

fn parse_overlap_device(value: &str) -> Result<OverlapDevice, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "cuda" => Ok(OverlapDevice::Cuda),
        "emulated" => Ok(OverlapDevice::Emulated),
        other => Err(format!("{other:?}: expected cuda or emulated")),
    }
}

fn parse_spec_chain(value: &str) -> Result<SpecMode, String> {
    parse_spec(value, "drafted tokens", SpecMode::chain)
}

fn parse_spec_tree(value: &str) -> Result<SpecMode, String> {
    parse_spec(value, "tree nodes", SpecMode::tree)
}

fn parse_backend(value: &str) -> Result<Backend, String> {
    Backend::from_name(value)
        .ok_or_else(|| format!("unknown device {value:?} (expected cpu or none)"))
}

/// The named models with recurrent (Mamba/GDN) state: those `mamba-starvation` runs on.
pub fn recurrent_models() -> impl Iterator<Item = ModelSpec> {
    ModelSpec::NAMED
        .into_iter()
        .filter(|m| m.has_recurrent_state())
}

/// clap's error as one line: its first paragraph (without clap's `error: ` and its tips,
/// usage and pointer to `--help`), its lines joined, what clap suggests for a misspelt
/// command or option (`did you mean 'replay'?`), and a pointer to the help of the
/// command `args` named (`unikv replay --help`), or the main help.
pub fn one_line(err: &clap::Error, args: &[std::ffi::OsString]) -> String {
    use clap::error::{ContextKind, ContextValue};
    let text = err.to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    let first: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let command = args
        .get(1)
        .and_then(|a| a.to_str())
        .filter(|a| ["replay", "bench-ops", "bench-scale", "sim"].contains(a));
    let help = match command {
        Some(command) => format!("unikv {command} --help"),
        None => "unikv --help".to_string(),
    };
    let suggested: Vec<String> = [ContextKind::SuggestedSubcommand, ContextKind::SuggestedArg]
        .into_iter()
        .filter_map(|kind| err.get(kind))
        .flat_map(|value| match value {
            ContextValue::String(s) => vec![s.clone()],
            ContextValue::Strings(v) => v.clone(),
            _ => Vec::new(),
        })
        .collect();
    let hint = if suggested.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = suggested.iter().map(|s| format!("'{s}'")).collect();
        format!("did you mean {}? ", names.join(" or "))
    };
    format!("{} ({hint}try `{help}`)", first.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Command, String> {
        let argv: Vec<std::ffi::OsString> = std::iter::once("unikv")
            .chain(args.iter().copied())
            .map(Into::into)
            .collect();
        let cli = Cli::try_parse_from(&argv).map_err(|e| one_line(&e, &argv))?;
        cli.into_command().map_err(|e| e.to_string())
    }

    fn replay(args: &[&str]) -> Result<ReplayArgs, String> {
        let mut all = vec!["replay"];
        all.extend_from_slice(args);
        match parse(&all)? {
            Command::Replay(r) => Ok(r),
            other => panic!("{args:?}: not a replay: {other:?}"),
        }
    }

    #[test]
    fn bench_overlap_resolves_its_rows_and_all_means_the_models_defaults() {
        let overlap = |args: &[&str]| match parse(&[&["bench-overlap"], args].concat()) {
            Ok(Command::BenchOverlap(b)) => b,
            other => panic!("{args:?}: {other:?}"),
        };
        let b = overlap(&[]);
        assert_eq!(b.device, OverlapDevice::Cuda);
        assert_eq!(b.forward, std::time::Duration::from_millis(2));
        assert_eq!(
            b.options.workloads,
            [Preset::SharedPrefix, Preset::Random2048x512]
        );
        assert_eq!(b.options.page_sizes, [1, 16, 256]);
        assert_eq!(b.options.layouts, [Layout::Unified]);
        assert_eq!(b.options.invariant_level, Level::Off);
        assert_eq!(b.speculation, Some(SpecMode::chain(4).unwrap().late()));
        let b = overlap(&["--workload", "smoke,all", "--spec", "0"]);
        let mut expected = vec![Preset::Smoke];
        expected.extend(Preset::defaults_for(&ModelSpec::GPT_OSS_20B));
        assert_eq!(b.options.workloads, expected);
        assert_eq!(b.speculation, None);
        assert!(parse(&["bench-overlap", "--forward-us", "0"]).is_err());
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_options_give_the_documented_defaults() {
        let r = replay(&[]).unwrap();
        assert_eq!(r, ReplayArgs::default());
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
            let message = replay(args).unwrap_err();
            assert_eq!(message.lines().count(), 1);
            assert!(
                message.contains(
                    "workload mamba-starvation needs a model with recurrent (Mamba/GDN) state"
                ) && message.contains("qwen3-next-80b-a3b, nemotron-h-8b, synthetic-tri"),
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
            "--device",
            "none",
            "--host-memory",
            "64GiB",
            "--checkpoint-interval",
            "512",
        ])
        .unwrap();
        let o = &r.options;
        assert_eq!(
            o.workloads,
            [Preset::Smoke, Preset::SharedPrefix, Preset::LongOutputs]
        );
        assert_eq!(o.model, ModelSpec::GPT_OSS_120B);
        assert_eq!(o.page_sizes, [16, 1, 64]);
        assert_eq!(o.memory_bytes, 24 << 30);
        assert_eq!(o.host_memory_bytes, 64 << 30);
        assert_eq!(o.checkpoint_interval, Some(512));
        assert_eq!(o.layouts, [Layout::Unified]);
        assert_eq!(o.seed, 42);
        assert_eq!(o.invariant_level, Level::Warn);
        assert_eq!(o.backend, Backend::None);
        assert!(r.json && !o.timing);
        assert_eq!(r.svg_dir, Some(PathBuf::from("out/plots")));
        assert_eq!(o.trace, Some(PathBuf::from("t.jsonl")));
        assert_eq!(o.runs(), 4 * 3);

        let r = replay(&["--workload", "all", "--workload", "smoke"]).unwrap();
        assert_eq!(r.options.workloads.len(), 6);
        let r = replay(&["--page-size", " 4 , 1", "--page-size=4", "--layout", "BOTH"]).unwrap();
        assert_eq!(
            r.options.page_sizes,
            [4, 1],
            "items are trimmed; an item named twice runs once"
        );
    }

    /// Every option but the lists is refused the second time, naming it (clap's rule,
    /// kept because a second value silently winning would hide a mistake).
    #[test]
    fn an_option_given_twice_is_an_error_naming_it() {
        for (args, option) in [
            (&["--layout", "static", "--layout", "both"][..], "--layout"),
            (&["--seed", "1", "--seed=1"], "--seed"),
            (&["--memory", "1GiB", "--memory", "2GiB"], "--memory"),
            (
                &["--host-memory", "1GiB", "--host-memory=1GiB"],
                "--host-memory",
            ),
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
            (&["--device", "cpu", "--device", "none"], "--device"),
        ] {
            let err = replay(args).unwrap_err();
            assert!(
                err.contains(option) && err.contains("cannot be used multiple times"),
                "{args:?}: {err}"
            );
        }
        let err = parse(&["bench-ops", "f", "--json", "--json"]).unwrap_err();
        assert!(err.contains("--json"), "{err}");
        // The documented repeatable options stay repeatable.
        assert!(replay(&["--workload", "smoke", "--workload", "smoke"]).is_ok());
        assert!(replay(&["--page-size", "1", "--page-size", "4"]).is_ok());
        assert!(parse(&["bench-ops", "f", "--invariants", "0", "--invariants", "2"]).is_ok());
        assert!(parse(&["bench-scale", "--scales", "1", "--scales", "2"]).is_ok());
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
                err.contains(option) && err.contains("empty item in"),
                "{args:?}: {err}"
            );
            assert_eq!(err.lines().count(), 1);
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
            err.contains("--record-ops records one run, but these options give 20"),
            "{err}"
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

    /// Each refused value is one line naming the option and why.
    #[test]
    fn bad_values_are_refused_with_the_reason() {
        for (args, needle) in [
            (
                &["--workload", "nope"][..],
                "unknown workload \"nope\" (known: shared-prefix",
            ),
            (&["--model", "llama"], "unknown model \"llama\""),
            (&["--model", "gpt-oss-20b:windw=3"], "unknown key \"windw\""),
            (&["--page-size", "0"], "a page holds at least 1 token"),
            (&["--page-size", "x"], "expected a whole number of tokens"),
            (&["--page-size", "65537"], "at most 65,536 tokens per page"),
            (&["--page-size", "65536"], ""),
            (&["--memory", "24G"], "bad memory size \"24G\""),
            (&["--memory", "0"], "the size must be positive"),
            (&["--memory="], "bad memory size \"\""),
            (&["--host-memory", "64G"], "bad memory size \"64G\""),
            (&["--host-memory", "0"], "the size must be positive"),
            (&["--host-memory="], "bad memory size \"\""),
            (&["--host-memory", "1.5GB"], ""),
            (&["--layout", "paged"], "unknown layout \"paged\""),
            (
                &["--device", "gpu"],
                "unknown device \"gpu\" (expected cpu or none)",
            ),
            (&["--seed", "1.5"], "expected an integer from 0 to 2^64-1"),
            (&["--seed", "18446744073709551616"], "expected an integer"),
            (
                &["--invariants", "loud"],
                "unknown invariant level \"loud\"",
            ),
            (&["--seed"], "--seed"),
            (&["--svg", "--json"], "--svg"),
            (&["--json=yes"], "--json"),
            (&["--frobnicate"], "--frobnicate"),
            (&["smoke"], "smoke"),
        ] {
            match replay(args) {
                Ok(_) if needle.is_empty() => {}
                Ok(r) => panic!("{args:?}: accepted as {r:?}"),
                Err(err) => {
                    assert!(!needle.is_empty(), "{args:?}: {err}");
                    assert!(err.contains(needle), "{args:?}: {err}");
                    assert_eq!(err.lines().count(), 1, "{err}");
                    assert!(err.ends_with("(try `unikv replay --help`)"), "{err}");
                }
            }
        }
    }

    #[test]
    fn speculation_takes_a_chain_or_a_tree_and_late_counts() {
        assert_eq!(replay(&[]).unwrap().options.speculation, None);
        let r = replay(&["--spec", "4"]).unwrap();
        assert_eq!(r.options.speculation, Some(SpecMode::chain(4).unwrap()));
        let r = replay(&["--spec-tree", "6", "--spec-late"]).unwrap();
        assert_eq!(
            r.options.speculation,
            Some(SpecMode::tree(6).unwrap().late())
        );
        let r = replay(&["--spec-late", "--spec=63"]).unwrap();
        assert_eq!(
            r.options.speculation,
            Some(SpecMode::chain(63).unwrap().late())
        );
        for (args, needle) in [
            (&["--spec", "0"][..], "a chain drafts 1 to 63 tokens"),
            (&["--spec", "64"], "a chain drafts 1 to 63 tokens"),
            (&["--spec=-1"], "expected a whole number of drafted tokens"),
            (
                &["--spec", "four"],
                "expected a whole number of drafted tokens",
            ),
            (&["--spec-tree", "1"], "a draft tree has 2 to 64 nodes"),
            (&["--spec-tree", "65"], "a draft tree has 2 to 64 nodes"),
            (
                &["--spec-tree", "x"],
                "expected a whole number of tree nodes",
            ),
            (&["--spec", "4", "--spec-tree", "6"], "cannot be used with"),
            (
                &["--spec", "4", "--spec", "4"],
                "cannot be used multiple times",
            ),
            (
                &["--spec-late"],
                "--spec-late needs --spec K or --spec-tree N",
            ),
        ] {
            let err = replay(args).unwrap_err();
            assert!(err.contains(needle), "{args:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn sim_takes_a_range_of_seeds_or_one_seed() {
        let sim = |args: &[&str]| match parse(args) {
            Ok(Command::Sim(s)) => Ok(s),
            Ok(other) => panic!("{args:?}: {other:?}"),
            Err(e) => Err(e),
        };
        assert_eq!(
            sim(&["sim"]),
            Ok(SimArgs {
                first: 0,
                seeds: unikv_dst::DEFAULT_SIM_SEEDS
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
        for conflicting in [
            &["sim", "--seed", "1", "--seeds", "2"][..],
            &["sim", "--first", "1", "--seed", "2"],
        ] {
            let err = sim(conflicting).unwrap_err();
            assert!(err.contains("cannot be used with"), "{err}");
        }
        let err = sim(&["sim", "--seeds", "x"]).unwrap_err();
        assert!(err.contains("--seeds"), "{err}");
        // Every seed of the range exists: none past u64::MAX, and at least one.
        assert_eq!(
            sim(&["sim", "--seed", "18446744073709551615"]),
            Ok(SimArgs {
                first: u64::MAX,
                seeds: 1
            })
        );
        let err = sim(&["sim", "--first", "18446744073709551613", "--seeds", "5"]).unwrap_err();
        assert!(
            err.contains("goes past the last seed 18446744073709551615 (at most 3 seeds"),
            "{err}"
        );
        let err = sim(&["sim", "--seeds", "0"]).unwrap_err();
        assert!(err.contains("runs no seed"), "{err}");
    }

    #[test]
    fn bench_ops_takes_a_file_and_levels() {
        let bench = |args: &[&str]| match parse(args) {
            Ok(Command::BenchOps(b)) => Ok(b),
            Ok(other) => panic!("{args:?}: {other:?}"),
            Err(e) => Err(e),
        };
        let b = bench(&["bench-ops", "ops.jsonl"]).unwrap();
        assert_eq!(b.file, PathBuf::from("ops.jsonl"));
        assert_eq!(b.levels, [Level::Off, Level::Strict]);
        assert_eq!((b.passes, b.backend, b.json), (5, Backend::Cpu, false));
        let b = bench(&[
            "bench-ops",
            "--invariants",
            "2",
            "ops.jsonl",
            "--json",
            "--invariants",
            "strict",
        ])
        .unwrap();
        assert_eq!((b.levels, b.json), (vec![Level::Strict], true));
        assert_eq!(
            bench(&["bench-ops", "f", "--passes", "3"]).unwrap().passes,
            3
        );
        for bad in ["0", "x", "1001", "1000000000"] {
            let err = bench(&["bench-ops", "f", "--passes", bad]).unwrap_err();
            assert!(err.contains("at least 1 and at most 1,000"), "{err}");
        }
        assert_eq!(
            bench(&["bench-ops", "f", "--passes", "1000"])
                .unwrap()
                .passes,
            1_000
        );
        assert!(bench(&["bench-ops"]).unwrap_err().contains("<FILE>"));
        assert!(bench(&["bench-ops", "a", "b"]).is_err());
        assert!(bench(&["bench-ops", "a", "--seed", "1"]).is_err());
    }

    #[test]
    fn bench_scale_takes_scales_and_the_replays_options() {
        let Command::BenchScale(b) = parse(&[
            "bench-scale",
            "--scales",
            "2,1",
            "--scales=2",
            "--workload",
            "smoke",
            "--device",
            "none",
        ])
        .unwrap() else {
            panic!("not bench-scale")
        };
        assert_eq!(b.scales, [2, 1]);
        assert_eq!(b.replay.workloads, [Preset::Smoke]);
        assert_eq!(b.replay.backend, Backend::None);
        assert!(
            b.replay.timing && !b.json,
            "bench-scale always times its runs"
        );
        let Command::BenchScale(b) = parse(&["bench-scale"]).unwrap() else {
            panic!("not bench-scale")
        };
        assert_eq!(b.scales, unikv_replay::scale::DEFAULT_SCALES);
        for bad in ["0", "257", "1,,2"] {
            let err = parse(&["bench-scale", "--scales", bad]).unwrap_err();
            assert!(err.contains("--scales"), "{err}");
        }
        // The replay's outputs it does not honour are not options of bench-scale, nor is
        // the host tier, whose figures its table has no rows for.
        for flag in [
            &["--svg", "plots"][..],
            &["--no-timing"],
            &["--host-memory", "1GiB"],
        ] {
            let mut args = vec!["bench-scale"];
            args.extend_from_slice(flag);
            let err = parse(&args).unwrap_err();
            assert!(
                err.starts_with(&format!("unexpected argument '{}' found", flag[0])),
                "{err}"
            );
        }
        let Command::BenchScale(b) = parse(&["bench-scale", "--json"]).unwrap() else {
            panic!("not bench-scale")
        };
        assert!(b.json);
        // One ops file records one run: runs × scales must be 1.
        let one = [
            "--workload",
            "smoke",
            "--page-size",
            "4",
            "--layout",
            "unified",
        ];
        let mut args = vec![
            "bench-scale",
            "--record-ops",
            "ops.jsonl",
            "--scales",
            "1,4",
        ];
        args.extend(one);
        let err = parse(&args).unwrap_err();
        assert!(
            err.contains("--record-ops records one run, but these options give 2 (runs × scales)"),
            "{err}"
        );
        let mut args = vec!["bench-scale", "--record-ops", "ops.jsonl", "--scales", "4"];
        args.extend(one);
        assert!(parse(&args).is_ok());
    }

    #[test]
    fn an_unknown_command_points_to_the_main_help() {
        let err = parse(&["rerun"]).unwrap_err();
        assert!(
            err.contains("'rerun'") && err.ends_with("(try `unikv --help`)"),
            "{err}"
        );
        // No command: clap's help as an error (printed on stderr, status 2, by main).
        let argv: Vec<std::ffi::OsString> = vec!["unikv".into()];
        let err = Cli::try_parse_from(&argv).unwrap_err();
        assert_eq!(
            err.kind(),
            clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        );
    }

    /// A misspelt command or option gets clap's suggestion, on the one line.
    #[test]
    fn a_misspelling_gets_a_suggestion() {
        let err = parse(&["repaly"]).unwrap_err();
        assert_eq!(
            err,
            "unrecognized subcommand 'repaly' (did you mean 'replay'? try `unikv --help`)"
        );
        let err = replay(&["--worklod", "smoke"]).unwrap_err();
        assert_eq!(
            err,
            "unexpected argument '--worklod' found (did you mean '--workload'? try \
             `unikv replay --help`)"
        );
        // Nothing like it: no suggestion.
        let err = replay(&["--frobnicate"]).unwrap_err();
        assert!(!err.contains("did you mean"), "{err}");
    }
}

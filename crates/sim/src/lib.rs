//! The deterministic scheduler simulator behind `unikv replay`.
//!
//! `unikv replay` runs serving workloads (named presets from the seed PR's load tests and
//! `bench_serving` shapes, or a user's `--trace`) through a seeded scheduler that drives
//! the cache the way an engine would, once with the static paged pools (fixed FULL, SWA
//! and Mamba state slot pools) and once with the unified pool, and prints a side-by-side
//! report (DESIGN.md §9). Every named model replays, the Mamba hybrids included.
//!
//! | module | what it holds |
//! |---|---|
//! | [`rng`] | SplitMix64, the only source of randomness |
//! | [`workload`] | [`Workload`], [`RequestSpec`], the presets ([`Preset`], [`StarvationPlan`]) |
//! | [`input`] | input files read line by line within fixed limits |
//! | [`trace`] | `--trace FILE` (JSON Lines) → [`Workload`] |
//! | [`cli`] | the hand-written command line and help texts |
//! | [`scheduler`] | the scheduler: [`scheduler::run`], [`RunConfig`], [`Layout`], [`StepProgress`] |
//! | [`ops`] | allocator op traces: `--record-ops` and `bench-ops` |
//! | [`report`] | [`RunStats`], [`MambaStats`], the table, the JSON object, the verdict |
//! | [`svg`] | one plot per run of each sub-pool's bytes over steps |
//! | [`progress`] | the progress bar on stderr |
//! | [`replay`] | the commands end to end |
//! | [`units`] | memory sizes in and out |
//!
//! # Invariants this crate keeps
//! - Determinism: the same seed gives the same workloads and the same report, byte for
//!   byte, except the CPU time per step (`--no-timing` leaves it out). No wall-clock input
//!   reaches any decision.
//! - No panics and no unbounded reads on any input: bad options, traces and files are
//!   [`SimError`]s (one line each), input files are read within the limits of [`input`],
//!   and output paths are checked before any run.
//! - Nothing imports `unikv-sim`; it drives the facade like an engine would.

pub mod cli;
pub mod dst;
mod error;
pub mod input;
pub mod model_spec;
pub mod ops;
pub mod progress;
pub mod replay;
pub mod report;
pub mod rng;
pub mod scale;
pub mod scheduler;
pub mod svg;
pub mod trace;
pub mod units;
pub mod workload;

pub use error::{OpsProblem, SimError, TraceProblem};
pub use report::{MambaStats, Report, RunStats, StepSample};
pub use scheduler::{Layout, RunConfig, StepProgress};
pub use workload::{Preset, RequestSpec, StarvationPlan, Workload};

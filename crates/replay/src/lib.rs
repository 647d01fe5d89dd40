//! The replay library behind `unikv replay` and `unikv bench-scale`: a deterministic
//! scheduler that drives the cache the way an engine would, once with the static paged
//! pools (fixed FULL, SWA and Mamba state slot pools) and once with the unified pool,
//! and the side-by-side report of what each did.
//!
//! | module | what it holds |
//! |---|---|
//! | [`config`] | [`LAYOUTS`], [`Backend`], one run's [`RunConfig`], a replay's [`ReplayOptions`] |
//! | [`scheduler`] | the scheduler: [`scheduler::run`], [`StepProgress`] |
//! | [`runs`] | a replay's workloads and runs in order; [`run`]: one run, its ops recorded if asked |
//! | [`stats`] | [`RunStats`], [`MambaStats`], [`HostRunStats`], samples, timing, why a run fails |
//! | [`report`] | [`Report`]: the table, the JSON object, the verdict |
//! | [`scale`] | `bench-scale`: the runs at growing pool and request counts |
//! | [`overlap`] | `bench-overlap`: GPU idle between forwards under an overlap scheduler, unikv vs a syncing free path |
//! | [`speculative`] | speculative runs: [`SpecMode`], the draft tree, the seeded acceptance |
//!
//! It owns no command line, progress bar or plot: those are the `unikv` binary's
//! (`crates/cli`), and this crate builds without them.
//!
//! # Invariants this crate keeps
//! - Determinism: the same seed gives the same workloads and the same report, byte for
//!   byte, except the CPU time per step (`--no-timing` leaves it out). No wall-clock input
//!   reaches any decision.
//! - The scheduler never names what watches the allocator: the ops recorder comes in
//!   from [`run`] as hooks ([`unikv::pools::Hooks`]) that the scheduler composes with its
//!   page counter into one `Hooked` layer.
//! - No panics on any input: bad workloads, traces and budgets are [`ReplayError`]s (one
//!   line each), and a run that cannot finish says so instead of hanging.
//! - It drives the facade only through its public API, as an engine would.

pub mod config;
pub mod error;
pub mod overlap;
pub mod report;
pub mod runs;
#[cfg(any(test, feature = "testing"))]
pub mod samples;
pub mod scale;
pub mod scheduler;
pub mod speculative;
pub mod stats;

pub use config::{Backend, LAYOUTS, ReplayOptions, RunConfig};
pub use error::ReplayError;
pub use report::Report;
pub use runs::run;
pub use scheduler::StepProgress;
pub use speculative::SpecMode;
pub use stats::{HostRunStats, MambaStats, PCIE_GEN5_X16_BYTES_PER_SECOND, RunStats, StepSample};
/// The facade's layout, the one a run is configured with (re-exported for the binary).
pub use unikv::Layout;

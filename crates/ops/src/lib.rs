//! Allocator-level operation traces: `unikv replay --record-ops FILE` writes every
//! operation a run made on its allocator, and `unikv bench-ops FILE` replays only those
//! operations against a fresh allocator, isolating the allocator's cost from the
//! scheduler's and the tree's. The format is documented in `docs/ops-trace.md`.
//!
//! | module | what it holds |
//! |---|---|
//! | [`format`](mod@format) | [`Op`], the header, id runs, the limits and the per-line [`check`](format::check) |
//! | [`record`] | [`Recorder`]: the hooks that write a run's operations |
//! | [`load`] | [`load`](load::load): a trace file, read and checked before anything runs |
//! | [`bench`](mod@bench) | [`replay`](bench::replay): a loaded trace against a fresh allocator, timed |
//!
//! # Invariants this crate keeps
//! - A trace is read within the input limits of `unikv_workload::input` and every line
//!   is checked against the format's limits before the first operation runs: no line
//!   makes the loader or the replay allocate without bound.
//! - A replay that diverges from the recording (other ids or slots handed out) is an
//!   error, never a number.
//! - It knows the allocator interface (`KvAllocator`, `Hooked`) and the builder's
//!   mappings, nothing of the scheduler or the command line.

pub mod bench;
pub mod error;
pub mod format;
pub mod load;
pub mod record;

pub use error::{OpsError, OpsProblem};
pub use format::{Op, SCHEMA, SCHEMA_V2};
pub use load::Trace;
pub use record::{Marks, RecordStatus, Recorder};

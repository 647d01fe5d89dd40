//! Named, levelled invariants for unikv.
//!
//! Every rule the bookkeeping of unikv depends on is declared once, by name, with a
//! [`Bucket`] that says how bad a breach is, next to the code that checks it:
//!
//! ```
//! use unikv_invariants::{Scope, declare_invariant};
//!
//! declare_invariant! {
//!     /// Every page handed to an SWA-side free is live on SWA.
//!     pub static PEER_MAPPED: "example.peer_mapped", FatalUncontainable,
//!         "every page handed to an SWA-side free is live on SWA";
//! }
//!
//! // Each cache owns a scope: its counters, its poll, its report.
//! let scope = Scope::new();
//! let free_swa_page = |live: bool| {
//!     // `expect` records a breach (from `Warn` up) and returns whether the rule held,
//!     // so the caller's containment step runs at every level, `Off` included.
//!     if !scope.expect(&PEER_MAPPED, live, || "page 7 is not live on SWA".to_string()) {
//!         return; // containment: never put a dead page on the free list
//!     }
//!     // ... free it ...
//! };
//! free_swa_page(true);
//! assert!(scope.poll().is_ok());
//! ```
//!
//! The level comes from `UNIKV_INVARIANT_CHECK` (`off|warn|strict|0|1|2`, default `off`),
//! read once; [`set_level`] (process-wide) and [`scoped_level`] (this thread) override it
//! for engines and tests. [`Scope::expect`] never fails by itself: it feeds the scope's
//! counters. Failing happens at an explicit [`Scope::poll`], the step boundary, according
//! to the crash matrix of [`Bucket::fails_at`].
//!
//! # Invariants this crate keeps
//! - A name is declared at most once per process: [`registry`] refuses a duplicate and
//!   names both declaring modules; building the registry happens once, so asking for it
//!   again, from any thread, registers nothing twice.
//! - Counts belong to a [`Scope`] (one per cache; its clones share it), never to the
//!   process: a scope's [`Scope::poll`] and [`Scope::report`] see only the breaches
//!   recorded through it, so two caches in one process, or two threads, never drain or
//!   count each other's breaches. Only the registry of names and the level are
//!   process-wide.
//! - [`Scope::expect`] and [`Scope::expect_count`] never block, never panic and never
//!   return an error; counts are never lost between concurrent recorders and a poll of
//!   their scope (each violation is seen by exactly one poll).
//! - A bad `UNIKV_INVARIANT_CHECK` is an error from [`init`] and [`try_level`]; code that
//!   only asks [`level`] treats it as `Strict` (fail safe), never as `Off`.

mod bucket;
mod check;
mod counters;
mod error;
mod level;
mod registry;
mod report;
mod scope;
mod sync;
pub mod testing;

pub use bucket::Bucket;
pub use check::{FailMode, Failure, LOG_EVERY, Violations, enabled};
pub use error::Error;
pub use level::{
    BadLevel, ENV_VAR, Level, LevelGuard, level, override_level, scoped_level, set_level, try_level,
};
pub use registry::{Declaration, Invariant, Registry, registry};
pub use report::{Report, ReportRow};
pub use scope::Scope;

#[doc(hidden)]
pub use inventory;

/// Checks the start-up configuration: the level in `UNIKV_INVARIANT_CHECK` parses and the
/// registry holds no duplicate name. Binaries and `HybridCache` builders call this first,
/// so a bad value is a one-line start-up error rather than a surprise later.
pub fn init() -> Result<&'static Registry, Error> {
    try_level()?;
    registry()
}

/// Declares a named invariant as a `static` and submits it to the registry.
///
/// ```
/// unikv_invariants::declare_invariant! {
///     /// Doc comments and attributes go on the static.
///     pub static FRONTIERS_DISJOINT: "example.frontiers_disjoint", FatalUncontainable,
///         "the low and the high frontier never cross";
/// }
/// assert_eq!(FRONTIERS_DISJOINT.name(), "example.frontiers_disjoint");
/// ```
///
/// The bucket is one of the [`Bucket`] variant names. The declaring module is recorded
/// with `module_path!()` so that a duplicate name is reported with both sites.
#[macro_export]
macro_rules! declare_invariant {
    ($( $(#[$meta:meta])* $vis:vis static $ident:ident : $name:literal, $bucket:ident, $description:literal; )+) => {
        $(
            $(#[$meta])*
            $vis static $ident: $crate::Invariant = $crate::Invariant::new(
                $name,
                $crate::Bucket::$bucket,
                $description,
                ::core::module_path!(),
            );
            $crate::inventory::submit! { $crate::Declaration(&$ident) }
        )+
    };
}

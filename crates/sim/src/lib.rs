//! The deterministic scheduler simulator behind `unikv replay`.
//!
//! Skeleton: the workloads, the scheduler and the report arrive with the replay issue.
//!
//! # Invariants this crate keeps (planned)
//! - Determinism: the same seed gives the same report, byte for byte (no wall-clock
//!   input to any decision).
//! - Nothing imports `unikv-sim`; it drives the facade like an engine would.

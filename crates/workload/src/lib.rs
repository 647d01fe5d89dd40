//! Workloads and their inputs: what `unikv replay` runs, before anything runs it.
//!
//! This crate owns the requests a replay feeds the cache and every input that shapes
//! them; it knows nothing of the scheduler, the allocator traces or the command line.
//!
//! | module | what it holds |
//! |---|---|
//! | [`rng`] | SplitMix64, the only source of randomness |
//! | [`workload`] | [`Workload`], [`RequestSpec`], the presets ([`Preset`], [`StarvationPlan`]) |
//! | [`trace`] | the `--trace FILE` format (JSON Lines) → [`Workload`] |
//! | [`input`] | input files read line by line within fixed limits |
//! | [`model`] | the model option: a named model, or its geometry changed key by key |
//! | [`hf`] | a model from a Hugging Face `config.json` ([`model_from_hf_config`]) |
//! | [`units`] | memory sizes in and out, grouped digits, durations, the page size bound |
//!
//! # Invariants this crate keeps
//! - Determinism: a preset built from the same seed (and, for a sized preset, the same
//!   model and budget) is the same request list, token for token; no clock is an input.
//! - No panics and no unbounded reads on any input: a bad trace, model or size is a
//!   [`WorkloadError`] (one line; a `config.json` that cannot be mapped, an
//!   [`HfConfigError`]), and input files are read within the limits of
//!   [`input`].
//! - It depends on the facade only for `ModelSpec` (and its `KvRows` and
//!   `RecurrentState`); nothing here drives a cache.

pub mod error;
pub mod hf;
pub mod input;
pub mod model;
pub mod rng;
pub mod trace;
pub mod units;
pub mod workload;

pub use error::{TraceProblem, WorkloadError};
pub use hf::{HfConfigError, model_from_hf_config};
pub use workload::{Preset, RequestSpec, StarvationPlan, Workload};

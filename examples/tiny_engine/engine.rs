//! A tiny hybrid decoder served two ways, to prove that unikv loses nothing: an engine
//! that keeps all its K/V and recurrent state in unikv's buffer (writing new K/V at the
//! step metadata's write locations, attending through its kernel ids, keeping the state
//! in the request's slot and writing every checkpoint the step metadata lists), and a
//! reference that runs each request alone with plain contiguous K/V. Both share one
//! forward (plain `f32` loops in a fixed order), so a correct cache makes their outputs
//! bit-identical. Three models ([`Model`]): FULL + SWA, FULL + Mamba and the tri-pool.
//!
//! Workloads ([`Workload`]): the mixed one is randomized and deterministic (shared
//! system prompts, follow-up turns, chunked prefill, decode batches, window releases,
//! eviction and lazy compaction under a small budget, retraction and re-admission,
//! aborts, `cache_unfinished`); the scripted ones (a shared-prefix batch, a multi-turn
//! conversation) exercise recurrent-state reuse and run with reuse on and off
//! ([`Reuse`]). Whenever a request resumes from a cached state, its first step compares
//! that state, bit for bit, with a contiguous recompute of its prefix
//! ([`RunStats::resumed_states`]). [`Fault`] breaks the engine on purpose, to show the
//! checks catch it. Plain loops instead of a tensor crate: the model is a few hundred
//! weights, and CI compiles and runs it on 2 cores many times over.
//!
//! With speculative decoding ([`serve_speculative`], module `speculative`) a draft model
//! proposes chains or trees of tokens that the target verifies in one step through
//! unikv's verify metadata; greedy acceptance keeps the output the plain decode's, token
//! for token, with the counts settled at once or one step late ([`SpecMode`]). Served
//! with reuse on and off ([`check_speculative_reuse`]), every state a request resumes
//! from — a later turn's included, whose state a speculative turn left — equals a
//! contiguous recompute of its prefix, bit for bit.
//!
//! The modules: `model` (the decoder and its one forward), `reference` (contiguous K/V),
//! `config` (a run's shape), `workload` (the jobs and their arrivals), `serve` (the serving loop on unikv, over
//! `buffer`: rows and states in unikv's buffer), `speculative` and `check`
//! (the comparisons). Used by `examples/tiny_engine/main.rs` and, through `#[path]`, by
//! `tests/tiny_engine.rs`, `tests/tiny_engine_reuse.rs` and `tests/tiny_engine_spec.rs`.

#![allow(dead_code)] // the test and the example use different parts

// `tests/` includes this file through `#[path]`, which makes rustc look for its modules
// beside it rather than in `engine/`; an explicit path is found alike from both.
#[path = "engine/buffer.rs"]
mod buffer;
#[path = "engine/check.rs"]
mod check;
#[path = "engine/config.rs"]
mod config;
#[path = "engine/model.rs"]
mod model;
#[path = "engine/reference.rs"]
mod reference;
#[path = "engine/serve.rs"]
mod serve;
#[path = "engine/speculative.rs"]
mod speculative;
#[path = "engine/workload.rs"]
mod workload;

// The example and the tests use different parts.
#[allow(unused_imports)]
pub use {
    check::{compare, compare_runs},
    config::{Fault, Reuse, RunConfig},
    model::{Model, Weights},
    reference::{reference, reference_outputs, reference_state},
    serve::{RunStats, check_reuse, serve},
    speculative::{
        Counts, Drafting, Rollback, SpecMode, SpecStats, TREE, check_speculative_reuse,
        serve_speculative, spec_modes,
    },
    workload::{Arrival, Job, Output, Workload, checkpoint_grid},
};

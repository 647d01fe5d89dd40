//! Deterministic simulation with injected faults (`unikv sim`, `cargo xtask sim`), in the
//! style of FoundationDB's and TigerBeetle's simulation testing: one seed fixes a random
//! configuration and a random engine driving [`HybridCache`](unikv::HybridCache) through it, with device ops
//! and allocator calls failing at random; after every step the run checks what an engine
//! relies on.
//!
//! # What a seed runs
//! [`Scenario::from_seed`] picks a layout, a model (every named spec, its KV rows and
//! recurrent state scaled down so a buffer near the batch-size-1 floor is small; half the
//! time another window), a page size (1 to 64, often larger than the window or not
//! dividing it), a budget from the batch-size-1 floor to a few times it, a fault rate and,
//! for a recurrent model, how many states a request may save in one step (1 to 4).
//! Half the seeds speculate: the cache is built with a [`Speculation`](unikv::Speculation)
//! (verify width 1 to 8, 1 or 2 verify steps of a request in flight), the model gets
//! 0 to 2 draft layers in its FULL envelope, and two seeds in three draft trees as well
//! as chains.
//! The engine ([`run`]) then steps: arrivals sharing prefixes of a few prompt families,
//! admission priced by `can_admit` and matched against the prefix cache, aborts at every
//! point of a lifecycle (a dropped match, a release after admission, mid-prefill,
//! mid-decode, after `cache_unfinished`), chunked prefill with `cache_unfinished`, batched
//! decode, retraction when memory is short (and re-admission of the prompt), explicit
//! `evict_to_free`, finishing with `cache_finished`, and `step_boundary`.
//! On a speculative seed a decode step is (mostly) a verify step: a random chain `k` or
//! draft tree per request, the cache's verify metadata (`build_verify_metadata`, its
//! tables reserved when the cache is built; the device offsets of an earlier unsettled
//! verify uploaded to a table the engine owns; `translate_verify`), the device's forward
//! at the translated ids (every node's KV at its write ids, the state after each node
//! into the slot the metadata names), the accepted paths uploaded and one
//! `compact_accepted` for the batch, settlement with random accepted counts or paths, on time or a step late with
//! the next verify already allocated (finishing mid-verify too), aborts and retractions
//! mid-verify, and wrong calls (settling twice, accepting more than the width, a bad
//! parent array) that must be their typed error and change nothing.
//!
//! # What it checks
//! - Faults are of two kinds: a device op refused by a [`FaultInjector`](unikv::kernels::FaultInjector) under the cache,
//!   and a fallible allocator call refused unforwarded by a [`Hooked`](unikv::pools::Hooked) allocator the
//!   cache wraps around its own (`wrap_allocator`), as if its device had failed.
//! - Every call that fails with an injected fault changed nothing the engine
//!   holds (the request's row and tokens), the allocator still verifies, and the retry
//!   succeeds (or is refused for memory, as it would have been).
//! - After every step: `verify()` of the allocator, the tree's `sanity_check`, the step
//!   boundary's conservation of every side (the run is at `Strict`), and **data
//!   integrity**: like an engine, the driver stamps every token's KV on every side when it
//!   is written (a byte derived from the token and everything before it, so a prefix hit
//!   must read the same bytes) at its rows as kernels address them (every layer's K and V
//!   row of [`KvGeometry`](unikv::KvGeometry), page-major, so at page size > 1 a token's
//!   bytes are `2 × layers` spans a page of rows apart) and every running request's state slot after each forward
//!   and checkpoint; it then reads every running request's KV back **through the device
//!   translation** (the mirror and the translate kernel) and every cached prefix and state
//!   through the host tables, after compaction moves, relays, SWA hand-overs and hits.
//!   Mid-verify, the rows the device knows the tokens of (the settled ones, then each
//!   unsettled step's accepted ones, once compacted; before, every node at its own row)
//!   and the slot group's state after each node of the newest step are checked; after
//!   settlement, every accepted row (a tree's after its compaction) and the selected
//!   running state.
//! - Every verify step's translated metadata, read back: per request and position below
//!   its width the FULL and SWA write ids are the kernel ids of the rows after what the
//!   device knows, past it the sink (after a late verify too), padding requests the
//!   sink; on a recurrent model the input state is the physical slot at the earlier
//!   verify's last accepted node of `[running, group…]` (and holds the state the device
//!   knows), the state after position `j` the slot of group slot `j`. A fault in
//!   `build_verify_metadata`, `translate_verify` or `compact_accepted` changed nothing
//!   (the checks above, every node still at its own row) and the retry succeeds. A fault in `settle` either changed nothing
//!   (retried) or struck after the settlement took effect (copying checkpoints out, as
//!   `settle` documents), never in between.
//! - Every match equals an **independent oracle**: the longest page-aligned prefix of the
//!   prompt (its last token excluded) that the tree's nodes hold, whose last window of
//!   tokens is SWA-live (or has no tombstone before it) and, for a recurrent model, that
//!   ends at a node holding a state — computed token by token from [`RadixTree::nodes`](unikv::radix::RadixTree::nodes),
//!   not by the tree's matcher.
//!
//! A failure names its seed and step and the one command that reproduces it.
//!
//! # What this crate owns
//! | module | what it holds |
//! |---|---|
//! | [`scenario`] | [`Scenario`]: one seed's configuration, and the scaled models |
//! | [`outcome`] | what a seed did ([`Outcome`]) or which check it broke ([`Failure`]) |
//! | `engine` | the random engine of one seed and, in `engine::checks`, what it checks |
//! | `stamps` | the bytes the engine stamps, derived from the token prefix |
//! | here | [`run`], [`run_many`], [`run_command`], their arguments ([`SimArgs`], whose range never passes `u64::MAX`) and what a run reports as it goes ([`SimProgress`]) |
//!
//! It depends on the facade and the seeded generator of `unikv-workload` only: no
//! scheduler, report or command line.
//!
//! # Invariants this crate keeps
//! - A seed fixes everything: the same seed gives the same [`Scenario`] and the same
//!   [`Outcome`], on any machine (no clock or thread is an input).
//! - A failure is reported with the seed and the command that reproduces it, never by a
//!   panic of the engine.

mod engine;
pub mod outcome;
pub mod scenario;
mod stamps;

pub use outcome::{Failure, Outcome};
pub use scenario::{Scenario, scaled};

use unikv::invariants::{Level, scoped_level};

/// Runs seed `seed` at invariant level `Strict`.
pub fn run(seed: u64) -> Result<Outcome, Failure> {
    let sc = Scenario::from_seed(seed);
    scoped_level(Level::Strict, || engine::Sim::new(sc.clone())?.run())
}

/// Runs the `count` seeds from `first` (`first..first + count`, which may end at
/// `u64::MAX` itself), calling `progress` after each; stops at the first failure. Seeds
/// past `u64::MAX` do not exist: a range that would reach them runs none of them (check
/// it first with [`SimArgs::new`]); `progress` is called once per seed that ran.
pub fn run_many(
    first: u64,
    count: u64,
    mut progress: impl FnMut(u64, &Outcome),
) -> Result<Outcome, Failure> {
    let mut total = Outcome::default();
    // `(0..count)` rather than `first..first + count`: the last seed, u64::MAX, has no
    // exclusive end, and a sum past it must not wrap to seed 0.
    for seed in (0..count).map_while(|i| first.checked_add(i)) {
        let o = run(seed)?;
        total.add(&o);
        progress(seed, &o);
    }
    Ok(total)
}

/// What `unikv sim` runs: seeds `first..first + seeds`, every one of them a `u64` (built
/// through [`SimArgs::new`], which refuses a range past `u64::MAX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimArgs {
    /// The first seed (`--first`, or `--seed` for one seed).
    pub first: u64,
    /// How many seeds (`--seeds`; 1 with `--seed`), at least 1.
    pub seeds: u64,
}

/// A range of seeds [`SimArgs::new`] refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SeedRangeError {
    /// `--seeds 0`: a run of no seed would report success having checked nothing.
    #[error("--seeds 0 runs no seed (give at least 1)")]
    NoSeeds,
    /// The range goes past the last seed, `u64::MAX`.
    #[error(
        "--first {first} --seeds {seeds} goes past the last seed {last} (at most {room} \
         seeds start at {first})",
        last = u64::MAX
    )]
    PastLastSeed {
        /// The first seed.
        first: u64,
        /// The seeds asked for.
        seeds: u64,
        /// The most seeds that start at `first`.
        room: u128,
    },
}

impl SimArgs {
    /// The `seeds` seeds from `first`, refused when there are none or when they would go
    /// past `u64::MAX`.
    pub fn new(first: u64, seeds: u64) -> Result<SimArgs, SeedRangeError> {
        if seeds == 0 {
            return Err(SeedRangeError::NoSeeds);
        }
        if first.checked_add(seeds - 1).is_none() {
            return Err(SeedRangeError::PastLastSeed {
                first,
                seeds,
                room: u128::from(u64::MAX - first) + 1,
            });
        }
        Ok(SimArgs { first, seeds })
    }
}

/// Seeds `unikv sim` runs without `--seeds`.
pub const DEFAULT_SIM_SEEDS: u64 = 10_000;

/// What `unikv sim` reports while it runs (the binary draws a bar on a terminal, plain
/// lines otherwise; this crate draws nothing, so it needs no terminal library).
pub trait SimProgress {
    /// Seed `done` of `total` ran clean (`done` counts from 1).
    fn seed_done(&mut self, done: u64, total: u64);
    /// The run is over (before the summary or the failure is written): clear what was
    /// drawn.
    fn finish(&mut self);
}

/// No progress at all.
impl SimProgress for () {
    fn seed_done(&mut self, _: u64, _: u64) {}
    fn finish(&mut self) {}
}

/// `unikv sim`: runs the seeds of `args`, telling `progress` after each, and writes a
/// summary on `out`. `Ok(false)` when a seed failed (its failure and reproduce command
/// are on stderr); an error is a summary that could not be written. The summary counts
/// the seeds that ran, never the seeds asked for.
pub fn run_command(
    args: &SimArgs,
    out: &mut impl std::io::Write,
    progress: &mut dyn SimProgress,
) -> std::io::Result<bool> {
    let started = std::time::Instant::now();
    let mut ran = 0u64;
    let result = run_many(args.first, args.seeds, |_, _| {
        ran += 1;
        progress.seed_done(ran, args.seeds);
    });
    progress.finish();
    let secs = started.elapsed().as_secs_f64();
    // `first..end`, or `first..=last` when the range ends at u64::MAX itself.
    let range = match args.first.checked_add(ran) {
        Some(end) => format!("{}..{end}", args.first),
        None => format!("{}..={}", args.first, u64::MAX),
    };
    match result {
        Ok(total) => {
            writeln!(
                out,
                "sim: seeds {range} clean in {secs:.1} s: {} steps, {} requests admitted, {} finished, {} released, {} prompt tokens hit, {} faults injected ({} in allocator calls), {} stamps checked, {} checkpoints saved ({} forwards saved several)",
                total.steps,
                total.admitted,
                total.finished,
                total.released,
                total.hit_tokens,
                total.faults,
                total.allocator_faults,
                total.stamps_checked,
                total.checkpoint_writes,
                total.multi_checkpoint_forwards
            )
            .and_then(|()| {
                writeln!(
                    out,
                    "sim: speculative: {} verify steps ({} requests verified, {} draft trees; {} verify metadata built and translated, {} translated ids checked, {} compactions, {} faults in those calls), {} settled ({} a step late, {} by replay; {} checkpoints they saved checked, {} of them replayed), {} tokens accepted, {} aborts, {} retractions and {} finishes mid-verify, {} wrong calls refused, {} settlements struck by a fault after taking effect",
                    total.verify_steps,
                    total.verifies,
                    total.tree_verifies,
                    total.verify_metadata_builds,
                    total.verify_ids_checked,
                    total.compactions,
                    total.verify_call_faults,
                    total.settles,
                    total.late_settles,
                    total.replay_settles,
                    total.settled_checkpoints_checked,
                    total.replayed_checkpoints_checked,
                    total.accepted_tokens,
                    total.mid_verify_aborts,
                    total.mid_verify_retractions,
                    total.finished_mid_verify,
                    total.refused_calls,
                    total.settle_faults_after_effect
                )
            })
            .and_then(|()| {
                writeln!(
                    out,
                    "sim: host tier: {} seeds, {} prompt tokens loaded back, {} bytes written back and {} loaded, {} write-backs skipped, {} copy queries found a copy in flight, {} aborts mid-load",
                    total.host_seeds,
                    total.host_hit_tokens,
                    total.host_written_bytes,
                    total.host_loaded_bytes,
                    total.host_refused_writes,
                    total.host_copies_in_flight,
                    total.host_aborts_mid_load
                )
            })
            .and_then(|()| writeln!(out, "sim: {ran} passed, 0 failed"))?;
            Ok(true)
        }
        Err(failure) => {
            eprintln!("sim: {failure}");
            writeln!(out, "sim: {ran} passed, 1 failed")?;
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unikv::Layout;
    use unikv::mamba::MAX_CHECKPOINTS_PER_STEP;

    /// A range is refused, naming how many seeds fit, when it would pass `u64::MAX`;
    /// one that ends at it exactly is a range like any other.
    #[test]
    fn a_seed_range_never_passes_the_last_seed() {
        assert_eq!(SimArgs::new(0, 0), Err(SeedRangeError::NoSeeds));
        assert_eq!(
            SimArgs::new(u64::MAX - 2, 5),
            Err(SeedRangeError::PastLastSeed {
                first: u64::MAX - 2,
                seeds: 5,
                room: 3
            })
        );
        let message = SimArgs::new(u64::MAX - 2, 5).unwrap_err().to_string();
        assert_eq!(
            message,
            "--first 18446744073709551613 --seeds 5 goes past the last seed \
             18446744073709551615 (at most 3 seeds start at 18446744073709551613)"
        );
        assert!(SimArgs::new(u64::MAX - 2, 3).is_ok());
        assert!(SimArgs::new(u64::MAX, 1).is_ok());
        assert!(SimArgs::new(0, u64::MAX).is_ok());
    }

    /// The last seed runs (an exclusive range `first..first + 1` could not name it), and
    /// the summary counts the seeds that ran.
    #[test]
    fn the_last_seed_runs_and_is_counted() {
        let mut seen = Vec::new();
        run_many(u64::MAX, 1, |seed, _| seen.push(seed)).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(seen, [u64::MAX]);
        let mut out = Vec::new();
        let args = SimArgs::new(u64::MAX, 1).unwrap();
        assert!(run_command(&args, &mut out, &mut ()).unwrap());
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("sim: seeds 18446744073709551615..=18446744073709551615 clean")
                && text.ends_with("sim: 1 passed, 0 failed\n"),
            "{text}"
        );
    }

    #[test]
    fn a_seed_fixes_its_scenario_and_its_outcome() {
        let a = Scenario::from_seed(7);
        let b = Scenario::from_seed(7);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert_eq!(run(7).unwrap(), run(7).unwrap());
    }

    #[test]
    fn a_few_seeds_run_clean_with_faults_hits_and_checks() {
        let total = run_many(0, 12, |_, _| {}).unwrap_or_else(|f| panic!("{f}"));
        assert!(total.faults > total.allocator_faults, "{total:?}");
        assert!(total.allocator_faults > 0, "{total:?}");
        assert!(total.hit_tokens > 0, "{total:?}");
        assert!(total.stamps_checked > 1000, "{total:?}");
    }

    /// Half the seeds run with a host tier: prefixes are written back, and loaded back
    /// (the stamps check the loaded rows and states like any other reused ones).
    #[test]
    fn host_tier_seeds_write_back_and_load_back() {
        let total = run_many(0, 40, |_, _| {}).unwrap_or_else(|f| panic!("{f}"));
        assert!(total.host_seeds > 10 && total.host_seeds < 30, "{total:?}");
        assert!(total.host_written_bytes > 0, "{total:?}");
        assert!(
            total.host_hit_tokens > 0 && total.host_loaded_bytes > 0,
            "{total:?}"
        );
    }

    /// Recurrent seeds save checkpoints, several in one forward too, under every
    /// per-step bound.
    #[test]
    fn recurrent_seeds_save_several_checkpoints_a_step() {
        let mut bounds = std::collections::BTreeSet::new();
        let mut total = Outcome::default();
        for seed in 0..48 {
            let sc = Scenario::from_seed(seed);
            if !sc.model.has_recurrent_state() {
                continue;
            }
            bounds.insert(sc.checkpoints_per_step);
            let o = run(seed).unwrap_or_else(|f| panic!("{f}"));
            total.checkpoint_writes += o.checkpoint_writes;
            total.multi_checkpoint_forwards += o.multi_checkpoint_forwards;
        }
        assert_eq!(
            bounds.len(),
            MAX_CHECKPOINTS_PER_STEP as usize,
            "{bounds:?}"
        );
        assert!(total.multi_checkpoint_forwards > 0, "{total:?}");
    }

    /// Speculative seeds cover every kind of model on both layouts, with chains and
    /// trees, and drive every speculative operation the engine knows.
    #[test]
    fn speculative_seeds_drive_every_speculative_operation_on_every_kind_of_model() {
        let mut kinds = std::collections::BTreeSet::new();
        let mut total = Outcome::default();
        let mut ran = 0;
        for seed in 0..96 {
            let sc = Scenario::from_seed(seed);
            let Some(spec) = sc.speculation else { continue };
            kinds.insert((
                sc.model.swa_layers > 0,
                sc.model.has_recurrent_state(),
                matches!(sc.layout, Layout::Unified),
            ));
            if ran < 24 {
                ran += 1;
                total.add(&run(seed).unwrap_or_else(|f| panic!("{f}")));
                assert!((1..=8).contains(&spec.max_width), "{spec:?}");
            }
        }
        assert_eq!(kinds.len(), 6, "{kinds:?}");
        assert_eq!(
            total.verify_metadata_builds, total.verify_steps,
            "{total:?}"
        );
        assert_eq!(total.compactions, total.verify_steps, "{total:?}");
        for (what, n) in [
            ("verify steps", total.verify_steps),
            ("draft trees", total.tree_verifies),
            ("chains", total.verifies - total.tree_verifies),
            ("late settles", total.late_settles),
            ("settles by replay", total.replay_settles),
            ("settles by copy", total.settles - total.replay_settles),
            ("settles on time", total.settles - total.late_settles),
            ("accepted tokens", total.accepted_tokens),
            (
                "mid-verify aborts and retractions",
                total.mid_verify_aborts.min(total.mid_verify_retractions),
            ),
            ("finishes mid-verify", total.finished_mid_verify),
            (
                "checkpoints saved by settlements",
                total.settled_checkpoints_checked,
            ),
            ("refused wrong calls", total.refused_calls),
            ("verify metadata builds", total.verify_metadata_builds),
            ("translated verify ids checked", total.verify_ids_checked),
            ("compactions", total.compactions),
        ] {
            assert!(n > 0, "no {what}: {total:?}");
        }
    }

    #[test]
    fn the_oracle_is_exercised_on_every_kind_of_model() {
        let mut kinds = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let s = Scenario::from_seed(seed);
            kinds.insert((
                s.model.swa_layers > 0,
                s.model.has_recurrent_state(),
                matches!(s.layout, Layout::Unified),
            ));
        }
        // Every combination a model can be (FULL with SWA, recurrent state or both) on
        // both layouts.
        assert_eq!(kinds.len(), 6, "{kinds:?}");
    }
}

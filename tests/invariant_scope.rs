//! Each cache owns its invariant scope: its allocator (through a wrapping allocator too)
//! and its tree count into it, its step boundary polls it on every path, and two caches
//! in one process — or on two threads at once — never see each other's breaches. (These
//! tests run as threads of one process under `cargo test`, which is the point.)

mod common;

use common::probe::{Probe, ProbeState};
use common::{Config, LAYOUTS, page_sizes};
use std::sync::{Arc, Mutex};
use unikv::invariants::{Error as InvariantError, Level, declare_invariant, scoped_level};
use unikv::{HybridCache, TokenId};

declare_invariant! {
    /// Breached on purpose by the probe, once per step.
    static INJECTED: "test.injected", Guard, "a breach the test injects";
}

/// What the probe wrapping a test cache's allocator does wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Records one breach of [`INJECTED`] into the allocator's scope per step.
    BreachEachStep,
    /// Drops every kv-row free (a request's release): its pages leak, so the
    /// cache's conservation fails at the next step boundary.
    LeakReleases,
}

fn build(config: &Config, fault: Option<Fault>) -> HybridCache {
    let mut builder = HybridCache::builder()
        .model(config.model)
        .page_size(config.page_size)
        .memory_bytes(config.memory_bytes())
        .layout(config.layout);
    if let Some(fault) = fault {
        let mut state = ProbeState::default();
        state.lose_every_row_free = fault == Fault::LeakReleases;
        state.breach_each_upload = (fault == Fault::BreachEachStep).then_some(&INJECTED);
        let state = Arc::new(Mutex::new(state));
        builder = builder.wrap_allocator(move |inner| Box::new(Probe::new(inner, state)));
    }
    builder.build().unwrap()
}

/// Admits, prefills and releases one request of `tokens` tokens, then ends the step.
fn one_step(cache: &mut HybridCache, seed: u32, tokens: usize) -> Result<(), unikv::Error> {
    let prompt: Vec<TokenId> = (0..tokens as u32)
        .map(|i| TokenId(seed * 1000 + i))
        .collect();
    let hit = cache.match_prefix(prompt);
    let mut req = cache.admit(hit)?;
    cache.alloc_extend(&mut req, tokens)?;
    cache.release(req)?;
    cache.step_boundary().map(|_| ())
}

fn injected_count(result: Result<(), unikv::Error>) -> u64 {
    match result {
        Ok(()) => 0,
        Err(unikv::Error::Invariants(InvariantError::Violated(v))) => {
            assert_eq!(v.failures.len(), 1, "{v}");
            assert_eq!(v.failures[0].name, INJECTED.name(), "{v}");
            v.failures[0].count
        }
        Err(e) => panic!("{e}"),
    }
}

/// The cache, its allocator (behind a wrapper) and its tree share one scope, and every
/// cache has its own.
#[test]
fn a_cache_shares_its_scope_with_its_allocator_and_tree() {
    let config = Config::new(LAYOUTS[0], 4, 8, 64);
    let (plain, wrapped) = (
        build(&config, None),
        build(&config, Some(Fault::BreachEachStep)),
    );
    for cache in [&plain, &wrapped] {
        let id = cache.invariant_scope().id();
        assert_eq!(cache.allocator().invariant_scope().id(), id);
        assert_eq!(cache.tree().invariant_scope().id(), id);
    }
    assert_ne!(plain.invariant_scope().id(), wrapped.invariant_scope().id());
}

/// Two caches in one process: one breaches at every step, the other's steps stay clean,
/// and each breach fails exactly one step of its own cache.
#[test]
fn two_caches_in_one_process_see_only_their_own_breaches() {
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            for ps in page_sizes() {
                let config = Config::new(layout, ps, 8, 64);
                let mut breaching = build(&config, Some(Fault::BreachEachStep));
                let mut clean = build(&config, None);
                for step in 0..4 {
                    let tokens = 3 * ps as usize;
                    assert_eq!(injected_count(one_step(&mut breaching, step, tokens)), 1);
                    one_step(&mut clean, step, tokens).unwrap_or_else(|e| {
                        panic!("{layout:?}/{ps}: the clean cache failed with {e}")
                    });
                }
                assert_eq!(breaching.invariant_scope().violations(&INJECTED), 4);
                assert_eq!(
                    clean.invariant_scope().report().unwrap().total_violations(),
                    0
                );
            }
        }
    });
}

/// Caches on four threads step at once, two of them breaching at every step: each sees
/// exactly its own breaches, one per step, and the clean ones none.
#[test]
fn caches_on_concurrent_threads_see_only_their_own_breaches() {
    const STEPS: u32 = 50;
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            std::thread::spawn(move || {
                scoped_level(Level::Strict, || {
                    let config = Config::new(LAYOUTS[(t / 2) as usize], 4, 8, 64);
                    let fault = (t % 2 == 0).then_some(Fault::BreachEachStep);
                    let mut cache = build(&config, fault);
                    let mut seen = 0;
                    for step in 0..STEPS {
                        let count = injected_count(one_step(&mut cache, t * STEPS + step, 12));
                        assert!(count <= 1, "thread {t}: {count} breaches in one step");
                        seen += count;
                    }
                    (fault.is_some(), seen)
                })
            })
        })
        .collect();
    for (t, handle) in threads.into_iter().enumerate() {
        let (breaching, seen) = handle.join().unwrap();
        let expected = if breaching { STEPS as u64 } else { 0 };
        assert_eq!(seen, expected, "thread {t}");
    }
}

/// A step boundary that fails conservation still polls: nothing stays pending in the
/// cache's scope, and another cache of the process steps cleanly.
#[test]
fn a_failed_conservation_check_leaves_nothing_pending() {
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            let config = Config::new(layout, 4, 8, 64);
            let mut leaking = build(&config, Some(Fault::LeakReleases));
            match one_step(&mut leaking, 1, 12) {
                Err(unikv::Error::Conservation { .. }) => {}
                other => panic!("{layout:?}: expected a conservation error, got {other:?}"),
            }
            assert!(
                leaking.invariant_scope().poll().is_ok(),
                "{layout:?}: the step boundary polled on its failing path"
            );
            let report = leaking.invariant_scope().report().unwrap();
            assert!(
                report.total_violations() > 0,
                "{layout:?}: counted:\n{report}"
            );
            let mut clean = build(&config, None);
            one_step(&mut clean, 1, 12).unwrap();
        }
    });
}

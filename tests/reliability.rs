//! What the facade does with sizes that overflow, failures inside the step boundary,
//! virtual-id recycling within a step, and window geometries where the page size does not
//! divide the window.

mod common;

use common::probe::{Fault, ProbeState};
use common::*;
use std::sync::{Arc, Mutex};
use unikv::{Error, HybridCache, KvRows, Layout, ModelSpec, TokenId};

fn fixture(layout: Layout, ps: u32, window: u32, tokens: u64) -> Fixture {
    Fixture::new(&Config::tokens(layout, ps, window, tokens, 8))
}

// ----- overflow ----------------------------------------------------------------------------

#[test]
fn can_admit_refuses_a_foreign_match_and_a_reservation_whose_target_overflows() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 8, 64 * ps as u64);
        let hit = fx.cache.match_prefix(text(0, 10));
        assert!(fx.cache.can_admit(&hit, 16), "{}", fx.label);
        for reserve in [usize::MAX, usize::MAX - 9, usize::MAX / 2] {
            assert!(
                !fx.cache.can_admit(&hit, reserve),
                "{}: reserve {reserve}",
                fx.label
            );
        }
        // A match of another cache is not admissible here at all.
        let mut other = Config::tokens(layout, ps, 8, 64 * ps as u64, 8).build();
        let foreign = other.match_prefix(text(0, 10));
        assert!(!fx.cache.can_admit(&foreign, 0), "{}", fx.label);
        fx.step();
        fx.teardown(vec![]);
    });
}

/// A match whose hit was evicted after it was made is priced as admission would take it:
/// matched again, so the hit it no longer has does not make an impossible prompt fit.
#[test]
fn can_admit_prices_a_stale_match_as_admission_would() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 8, 16 * ps as u64);
        let psz = ps as usize;
        let mut req = fx.admit(text(0, 4 * psz));
        fx.prefill(&mut req, 4 * psz);
        let conversation = req.tokens().to_vec();
        fx.cache.cache_finished(req).unwrap();
        fx.step();
        // A prompt one page longer than every FULL page: it fits only by its hit.
        let total = fx.cache.stats().full.total_pages;
        let extra: Vec<TokenId> = (0..(total + 1) * psz - conversation.len())
            .map(|i| TokenId(500_000 + i as u32))
            .collect();
        let hit = fx.cache.match_prefix(concat(&conversation, &extra));
        assert!(hit.cached_tokens() > 0, "{}: no hit", fx.label);
        assert!(!fx.cache.can_admit(&hit, 0), "{}: fresh", fx.label);
        fx.cache.evict_all().unwrap();
        fx.step();
        assert!(
            !fx.cache.can_admit(&hit, 0),
            "{}: a stale match counted a hit that was evicted",
            fx.label
        );
        fx.teardown(vec![]);
    });
}

#[test]
fn alloc_extend_past_usize_max_is_a_bad_request_and_changes_nothing() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 8, 64 * ps as u64);
        let mut req = fx.admit(text(0, 10));
        fx.cache.alloc_extend(&mut req, 4).unwrap();
        fx.step();
        let before = fx.cache.stats();
        // `usize::MAX - 3` wraps `4 + tokens` to 0, which a naive bound check accepts.
        for tokens in [usize::MAX, usize::MAX - 3] {
            match fx.cache.alloc_extend(&mut req, tokens) {
                Err(Error::BadRequest { .. }) => {}
                other => panic!("{}: extend by {tokens}: {other:?}", fx.label),
            }
            assert_eq!(req.len(), 4, "{}", fx.label);
        }
        fx.step();
        let after = fx.cache.stats();
        assert_eq!((after.full, after.swa), (before.full, before.swa));
        fx.prefill(&mut req, 6);
        fx.teardown(vec![req]);
    });
}

#[test]
fn a_demand_beyond_every_page_is_out_of_memory_and_evicts_nothing() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 8, 64 * ps as u64);
        let prompt = text(0, 4 * fx.keep());
        let mut r = fx.admit(prompt.clone());
        fx.prefill(&mut r, prompt.len());
        fx.cache.cache_finished(r).unwrap();
        fx.step();
        let cached = fx.cache.tree().sizes();
        let total = fx.cache.stats().full.total_pages;
        for (full, swa) in [
            (usize::MAX, usize::MAX),
            (usize::MAX, 0),
            (0, usize::MAX),
            (total + 1, 0),
        ] {
            match fx.cache.evict_to_free(full, swa) {
                Err(Error::OutOfMemory { .. }) => {}
                other => panic!("{}: evict_to_free({full}, {swa}): {other:?}", fx.label),
            }
            assert_eq!(fx.cache.tree().sizes(), cached, "{}: evicted", fx.label);
        }
        fx.step();
        assert_eq!(
            fx.cache.match_prefix(follow_up(&prompt)).cached_tokens(),
            prompt.len(),
            "{}",
            fx.label
        );
        fx.step();
        fx.teardown(vec![]);
    });
}

#[test]
fn a_model_whose_page_bytes_overflow_64_bits_is_a_config_error() {
    let base = tiny_model(8, 1);
    let cases = [
        // Per-token bytes overflow on both sides.
        (
            ModelSpec {
                full: KvRows::new(u32::MAX, u32::MAX, u32::MAX),
                swa: KvRows::new(u32::MAX, u32::MAX, u32::MAX),
                ..base
            },
            1,
        ),
        // Per-token bytes fit (2^33 × 2^31), a page of 2^31 tokens does not.
        (
            ModelSpec {
                full: KvRows::new(2, 1 << 31, 2),
                swa: KvRows::new(2, 1 << 31, 2),
                ..base
            },
            1 << 31,
        ),
        // Each side's page fits, the two together do not.
        (
            ModelSpec {
                full_layers: 1 << 30,
                swa_layers: 1 << 30,
                full: KvRows::new(1 << 30, 2, 1),
                swa: KvRows::new(1 << 30, 2, 1),
                ..base
            },
            2,
        ),
    ];
    for (model, ps) in cases {
        match HybridCache::builder()
            .model(model)
            .page_size(ps)
            .memory_bytes(1 << 30)
            .build()
        {
            Err(Error::Config(reason)) => assert!(reason.contains("64 bits"), "{reason}"),
            other => panic!("{model} at page size {ps}: {other:?}"),
        }
    }
}

// ----- the step boundary on every path -----------------------------------------------------

/// A cache whose allocator fails `fault` once, armed after a request was prefilled: the
/// boundary reports the failure, leaves a free group open and conservation intact, and the
/// next boundary succeeds.
fn boundary_survives(fault: Fault) {
    for_each_layout_and_page_size(|layout, ps| {
        let config = Config::tokens(layout, ps, 8, 64 * ps as u64, 8);
        let state = Arc::new(Mutex::new(ProbeState::default()));
        let mut fx = Fixture::of(&config, config.build_probed(&state));
        let mut req = fx.admit(text(0, 3 * fx.keep()));
        fx.prefill(&mut req, 2 * fx.keep());
        let stepped = fx.cache.step();
        state.lock().unwrap().fail_once = Some(fault);
        // Frees deferred in the failing step must still take effect.
        let tokens = fx.cache.release(req).unwrap();
        match fx.cache.step_boundary() {
            Err(Error::Pool(e)) => assert!(e.to_string().contains("injected"), "{e}"),
            other => panic!("{}: {fault:?}: {other:?}", fx.label),
        }
        assert_eq!(fx.cache.step(), stepped + 1, "{}", fx.label);
        if fault != Fault::FreeGroupBegin {
            assert!(
                fx.cache.allocator().in_free_group(),
                "{}: {fault:?}: no free group after the failed boundary",
                fx.label
            );
            fx.check_accounting(&[]);
        }
        // The cache works on: a request runs, and the next boundary is clean.
        let mut again = fx.admit(tokens);
        fx.prefill(&mut again, fx.keep());
        fx.teardown(vec![again]);
    });
}

#[test]
fn a_failed_mirror_upload_still_reopens_the_free_group() {
    boundary_survives(Fault::UploadMirror);
}

#[test]
fn a_failed_group_end_still_applies_the_steps_frees_and_keeps_a_group_open() {
    boundary_survives(Fault::FreeGroupEnd);
}

#[test]
fn a_failed_group_begin_is_reported_and_the_next_boundary_opens_one() {
    boundary_survives(Fault::FreeGroupBegin);
}

// ----- virtual-id recycling ------------------------------------------------------------------

/// Documents what the free group does not promise: after `release(A)`, a flush in the
/// eviction loop (here: B's allocation, short of memory) applies A's deferred frees, and B
/// gets A's ids in the same step.
#[test]
fn ids_freed_in_a_step_are_recycled_in_that_step_after_a_flush() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 8, 16 * ps as u64);
        let tokens = fx.cache.allocator().capacity().joint_schedulable_pages * fx.ps;
        let mut a = fx.admit(text(0, tokens));
        fx.cache.alloc_extend(&mut a, tokens).unwrap();
        fx.step();
        let step = fx.cache.step();
        let ps = fx.ps;
        let pages = |row: &[unikv::pools::VirtualToken]| {
            let mut p: Vec<u32> = row.iter().map(|&t| page_of(t, ps).0).collect();
            p.dedup();
            p.sort_unstable();
            p
        };
        let a_pages = pages(a.row());
        fx.cache.release(a).unwrap();
        let mut b = fx.admit(text(50_000, tokens));
        fx.cache.alloc_extend(&mut b, tokens).unwrap();
        assert_eq!(fx.cache.step(), step, "{}: still the same step", fx.label);
        assert_eq!(pages(b.row()), a_pages, "{}: B reuses A's ids", fx.label);
        fx.step();
        fx.teardown(vec![b]);
    });
}

/// The guarantee that does hold: every free names pages that are still owned — live,
/// and not freed already in the open group — so no id is recycled (or freed twice) while
/// an action naming it is unapplied. Driven through shared prefixes, unfinished and
/// finished inserts, releases, evictions under pressure, `can_admit` and `evict_all`.
#[test]
fn no_free_names_an_id_that_is_not_owned_any_more() {
    for_each_layout_and_page_size(|layout, ps| {
        let config = Config::tokens(layout, ps, 8, 40 * ps as u64, 8);
        let state = Arc::new(Mutex::new(ProbeState::checking_frees()));
        let mut fx = Fixture::of(&config, config.build_probed(&state));
        let keep = fx.keep();
        let base = text(0, 3 * keep);
        for round in 0..6u32 {
            let mut running = Vec::new();
            for branch in 0..3u32 {
                let prompt = concat(
                    &base[..(branch as usize + 1) * keep],
                    &text(1000 * (round * 3 + branch + 1), keep + 1),
                );
                let hit = fx.cache.match_prefix(prompt);
                let _ = fx.cache.can_admit(&hit, keep);
                let mut req = fx.cache.admit(hit).unwrap();
                let rest = req.remaining_prefill();
                match fx.cache.alloc_extend(&mut req, rest) {
                    Ok(()) => {}
                    Err(Error::OutOfMemory { .. }) => {
                        fx.cache.release(req).unwrap();
                        continue;
                    }
                    Err(e) => panic!("{}: {e}", fx.label),
                }
                if branch == 1 {
                    fx.cache.cache_unfinished(&mut req).unwrap();
                }
                running.push(req);
            }
            for (i, mut req) in running.into_iter().enumerate() {
                match fx
                    .cache
                    .alloc_decode(&mut [&mut req], &[TokenId(7 + i as u32)])
                {
                    Ok(()) | Err(Error::OutOfMemory { .. }) => {}
                    Err(e) => panic!("{}: {e}", fx.label),
                }
                if i % 2 == 0 {
                    fx.cache.cache_finished(req).unwrap();
                } else {
                    fx.cache.release(req).unwrap();
                }
            }
            if round % 3 == 2 {
                fx.cache.evict_all().unwrap();
            }
            fx.step();
        }
        let s = state.lock().unwrap();
        assert!(s.violations.is_empty(), "{}: {:#?}", fx.label, s.violations);
        assert!(s.pages_checked > 0, "{}: nothing was checked", fx.label);
        drop(s);
        fx.teardown(vec![]);
    });
}

// ----- window geometry -----------------------------------------------------------------------

/// A finished conversation's follow-up turn reuses every whole page of it, also where the
/// page size does not divide the window (the live tail kept behind the last whole page
/// must cover a window) and where a page is larger than the window.
#[test]
fn a_follow_up_turn_hits_its_history_whatever_the_page_size_and_window() {
    for layout in LAYOUTS {
        for (ps, window) in [(4, 6), (5, 16), (3, 8), (4, 7), (6, 4), (16, 5), (4, 8)] {
            for decoded in 0..2 * ps as usize {
                let mut fx = fixture(layout, ps, window, 64 * ps as u64);
                let prompt = text(0, 3 * window as usize + 2);
                let mut req = fx.admit(prompt);
                fx.prefill(&mut req, 5);
                fx.decode(&mut req, decoded, 100);
                let conversation = req.tokens().to_vec();
                fx.cache.cache_finished(req).unwrap();
                fx.step();
                let hit = fx.cache.match_prefix(follow_up(&conversation));
                assert_eq!(
                    hit.cached_tokens(),
                    fx.floor(conversation.len()),
                    "{}, window {window}: follow-up of {} tokens",
                    fx.label,
                    conversation.len()
                );
                drop(hit);
                fx.step();
                fx.teardown(vec![]);
            }
        }
    }
}

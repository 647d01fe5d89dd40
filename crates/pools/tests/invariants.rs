//! The free family's premises are reported, not filtered: a second ratchet, a FULL-only
//! free of a bound SWA page, a two-sided free of a tombstone, the sink, double frees and
//! a page freed twice in one group — each counted at `Warn`, failing `poll` per the crash
//! matrix, and contained (never a dead page on a free list) at every level.

mod common;

use common::*;
use unikv_invariants::{Level, scoped_level};
use unikv_pools::invariants::{
    DOUBLE_FREE, ONE_FREE_PER_GROUP, PEER_MAPPED, PEER_RELEASED, SINK_RESERVED, WINDOW_RATCHET,
};
use unikv_pools::{Segment, SwaState, VirtualToken};

/// Runs `breach` at Warn (must count exactly `count`, pass `poll` unless the bucket fails
/// at Warn) and at Strict (must fail `poll`), each time on a fresh pool prepared by `setup`.
fn reported_at_warn_and_strict<S>(
    inv: &'static unikv_invariants::Invariant,
    count: u64,
    fails_at_warn: bool,
    setup: impl Fn(&mut Pool) -> S,
    breach: impl Fn(&mut Pool, &S),
    after: impl Fn(&Pool, &S),
) {
    each_case(|layout, ps| {
        for level in [Level::Warn, Level::Strict] {
            let mut pool = pool(layout, ps, 64);
            let state = setup(&mut pool);
            scoped_level(level, || {
                pool.invariant_scope().poll().unwrap();
                let (n, ()) = breaches(&mut pool, inv, level, |pool| breach(pool, &state));
                assert_eq!(
                    n,
                    count,
                    "{layout:?}/{ps} at {level}: {} breaches",
                    inv.name()
                );
                let failed = pool.invariant_scope().poll().is_err();
                let expected = level == Level::Strict || fails_at_warn;
                assert_eq!(failed, expected, "{layout:?}/{ps}: poll at {level}");
                // Containment: the tables stay consistent whatever was reported.
                pool.verify()
                    .unwrap_or_else(|e| panic!("{layout:?}/{ps}: {e}"));
                after(&pool, &state);
            });
        }
    });
}

#[test]
fn a_double_ratchet_is_reported() {
    reported_at_warn_and_strict(
        &WINDOW_RATCHET,
        2,
        false,
        |pool| {
            let ps = pool.ps as usize;
            let row = new_row(pool, 4 * ps);
            pool.free_swa_segment(Segment::of_row(&row, 0..2 * ps))
                .unwrap();
            row
        },
        |pool, row| {
            let ps = pool.ps as usize;
            let before = pool.capacity();
            // The cursor ratchets over the same two pages again.
            pool.free_swa_segment(Segment::of_row(row, 0..2 * ps))
                .unwrap();
            assert_eq!(pool.capacity(), before, "not silently applied");
        },
        |pool, row| {
            let ps = pool.page_size();
            assert_eq!(pool.swa_state(row[0].page(ps)), SwaState::Tombstone);
        },
    );
}

#[test]
fn a_full_only_free_of_a_bound_swa_page_is_reported() {
    for grouped in [false, true] {
        reported_at_warn_and_strict(
            &PEER_RELEASED,
            1,
            false,
            |pool| {
                let n = 2 * pool.ps as usize;
                new_row(pool, n)
            },
            |pool, row| {
                let ps = pool.ps as usize;
                if grouped {
                    pool.free_group_begin().unwrap();
                }
                pool.free_full_segment(Segment::of_row(row, 0..ps)).unwrap();
                if grouped {
                    pool.free_group_end().unwrap();
                }
            },
            |pool, row| {
                // Containment: the SWA peer is released with FULL, nothing is stranded.
                let ps = pool.page_size();
                assert!(!pool.full_live(row[0].page(ps)));
                assert_eq!(pool.swa_state(row[0].page(ps)), SwaState::Unbound);
                assert_eq!(allocated(pool), (1, 1));
            },
        );
    }
}

#[test]
fn a_two_sided_segment_free_of_a_tombstone_is_uncontainable_loud() {
    reported_at_warn_and_strict(
        &PEER_MAPPED,
        1,
        true,
        |pool| {
            let ps = pool.ps as usize;
            let row = new_row(pool, 2 * ps);
            pool.free_swa_segment(Segment::of_row(&row, 0..ps)).unwrap();
            row
        },
        |pool, row| {
            let ps = pool.ps as usize;
            pool.free_segment(Segment::of_row(row, 0..ps)).unwrap();
        },
        |pool, _| assert_eq!(allocated(pool), (1, 1)),
    );
}

#[test]
fn an_swa_free_of_an_unbound_page_is_uncontainable_loud() {
    reported_at_warn_and_strict(
        &PEER_MAPPED,
        1,
        true,
        |pool| {
            let n = pool.ps as usize;
            let row = new_row(pool, n);
            pool.free(&row).unwrap();
            row
        },
        |pool, row| {
            pool.free_swa_segment(Segment::of_row(row, 0..row.len()))
                .unwrap()
        },
        |pool, _| assert_eq!(allocated(pool), (0, 0)),
    );
}

#[test]
fn freeing_the_sink_is_reported_and_skipped() {
    reported_at_warn_and_strict(
        &SINK_RESERVED,
        3,
        false,
        |pool| {
            let n = pool.ps as usize;
            new_row(pool, n)
        },
        |pool, _| {
            let ps = pool.ps as usize;
            let sink = vec![VirtualToken(0); ps];
            pool.free_segment(Segment::of_row(&sink, 0..ps)).unwrap();
            pool.free_full_segment(Segment::of_row(&sink, 0..ps))
                .unwrap();
            pool.free_swa_segment(Segment::of_row(&sink, 0..ps))
                .unwrap();
        },
        |pool, _| assert_eq!(allocated(pool), (1, 1)),
    );
}

#[test]
fn a_double_free_is_reported_and_never_lists_a_page_twice() {
    reported_at_warn_and_strict(
        &DOUBLE_FREE,
        1,
        false,
        |pool| {
            let n = 2 * pool.ps as usize;
            let row = new_row(pool, n);
            pool.free_segment(Segment::of_row(&row, 0..row.len()))
                .unwrap();
            row
        },
        |pool, row| {
            let ps = pool.ps as usize;
            pool.free_full_segment(Segment::of_row(row, 0..ps)).unwrap();
        },
        |pool, _| {
            // verify() (run by the helper) proves no free list holds a duplicate; and
            // every page is handed out once again.
            assert_eq!(allocated(pool), (0, 0));
        },
    );
}

#[test]
fn a_page_freed_twice_in_one_group_is_reported() {
    reported_at_warn_and_strict(
        &ONE_FREE_PER_GROUP,
        1,
        false,
        |pool| {
            let n = 2 * pool.ps as usize;
            new_row(pool, n)
        },
        |pool, row| {
            let ps = pool.ps as usize;
            pool.free_group_begin().unwrap();
            pool.free_segment(Segment::of_row(row, 0..ps)).unwrap();
            pool.free(&row[..1]).unwrap();
            pool.free_group_end().unwrap();
        },
        |pool, _| assert_eq!(allocated(pool), (1, 1)),
    );
}

#[test]
fn containment_runs_at_off_too() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 64);
        let psz = ps as usize;
        let row = new_row(&mut pool, 2 * psz);
        scoped_level(Level::Off, || {
            pool.free_swa_segment(Segment::of_row(&row, 0..psz))
                .unwrap();
            let before = pool.capacity();
            pool.free_swa_segment(Segment::of_row(&row, 0..psz))
                .unwrap();
            assert_eq!(pool.capacity(), before);
            pool.free_full_segment(Segment::of_row(&row, psz..2 * psz))
                .unwrap();
            pool.free(&row).unwrap();
            pool.free(&row).unwrap();
        });
        assert_eq!(allocated(&pool), (0, 0), "{layout:?}/{ps}");
        pool.verify().unwrap();
    });
}

#[test]
fn every_invariant_is_registered_once_from_one_module() {
    let registry = unikv_invariants::registry().unwrap();
    for name in [
        "swa.peer_mapped",
        "swa.peer_released",
        "swa.window_ratchet",
        "pool.double_free",
        "pool.sink_reserved",
        "pool.one_free_per_page_per_group",
        "pool.segment_shape",
        "pool.conservation",
    ] {
        let inv = registry
            .get(name)
            .unwrap_or_else(|| panic!("{name} not registered"));
        assert_eq!(inv.module(), "unikv_pools::invariants", "{name}");
    }
}

/// Two allocators in one process count their breaches in their own scopes: one breaches,
/// the other polls clean, and the breach fails only its own allocator's poll. Handed one
/// scope (as a cache hands its own), both record into it.
#[test]
fn two_allocators_in_one_process_see_only_their_own_breaches() {
    each_case(|layout, ps| {
        let psz = ps as usize;
        let (mut breaching, mut clean) = (pool(layout, ps, 32), pool(layout, ps, 32));
        assert_ne!(
            breaching.invariant_scope().id(),
            clean.invariant_scope().id(),
            "each allocator makes its own scope"
        );
        scoped_level(Level::Strict, || {
            let row = new_row(&mut breaching, psz);
            let clean_row = new_row(&mut clean, psz);
            breaching.free(&row).unwrap();
            breaching
                .free_segment(Segment::of_row(&row, 0..psz))
                .unwrap();
            clean.free(&clean_row).unwrap();
            assert!(clean.invariant_scope().poll().is_ok(), "{layout:?}/{ps}");
            assert_eq!(clean.invariant_scope().violations(&DOUBLE_FREE), 0);
            assert!(
                breaching.invariant_scope().poll().is_err(),
                "{layout:?}/{ps}"
            );
            assert!(breaching.invariant_scope().poll().is_ok(), "drained");

            let shared = unikv_invariants::Scope::new();
            breaching.set_invariant_scope(shared.clone());
            clean.set_invariant_scope(shared.clone());
            assert_eq!(clean.invariant_scope().id(), shared.id());
            clean.free(&clean_row).unwrap();
            assert_eq!(shared.violations(&DOUBLE_FREE), 1, "{layout:?}/{ps}");
            assert!(
                breaching.invariant_scope().poll().is_err(),
                "one shared scope"
            );
        });
    });
}

/// Pages in the long rows below: more than two of the batch passes' chunks of 16.
const LONG: usize = 40;

/// A new row of [`LONG`] pages.
fn long_row(pool: &mut Pool) -> Vec<VirtualToken> {
    new_row(pool, LONG * pool.ps as usize)
}

/// A [`long_row`] freed at once, both sides.
fn freed_long_row(pool: &mut Pool) -> Vec<VirtualToken> {
    let row = long_row(pool);
    pool.free_segment(whole(&row)).unwrap();
    row
}

/// `tokens` whole, as one segment.
fn whole(tokens: &[VirtualToken]) -> Segment<'_> {
    Segment::of_row(tokens, 0..tokens.len())
}

/// Frees `tokens` whole as one two-sided segment inside a free group.
fn deferred_free_segment(pool: &mut Pool, tokens: &[VirtualToken]) {
    pool.free_group_begin().unwrap();
    pool.free_segment(whole(tokens)).unwrap();
    pool.free_group_end().unwrap();
}

/// Inside a free group a segment's premises are checked at enqueue by one pass over
/// runs of pages (a row's prefill) before any report: a breach in a long row is still
/// reported page by page. A row freed twice is a double free on every page.
#[test]
fn a_deferred_free_of_a_freed_long_row_reports_each_page() {
    reported_at_warn_and_strict(
        &DOUBLE_FREE,
        LONG as u64,
        false,
        freed_long_row,
        |pool, row| deferred_free_segment(pool, row),
        |pool, _| assert_eq!(allocated(pool), (0, 0)),
    );
}

/// The same through a deferred FULL-only free, whose SWA premise (released) the freed
/// row keeps: only the FULL side's liveness tells.
#[test]
fn a_deferred_full_only_free_of_a_freed_long_row_reports_each_page() {
    reported_at_warn_and_strict(
        &DOUBLE_FREE,
        LONG as u64,
        false,
        freed_long_row,
        |pool, row| {
            pool.free_group_begin().unwrap();
            pool.free_full_segment(whole(row)).unwrap();
            pool.free_group_end().unwrap();
        },
        |pool, _| assert_eq!(allocated(pool), (0, 0)),
    );
}

/// The sink page heading a long row's deferred free is reported once; the row is freed.
#[test]
fn a_deferred_free_headed_by_the_sink_reports_it_once() {
    reported_at_warn_and_strict(
        &SINK_RESERVED,
        1,
        false,
        |pool| {
            let ps = pool.ps as usize;
            let mut tokens = vec![VirtualToken(0); ps];
            tokens.extend(long_row(pool));
            tokens
        },
        |pool, tokens| deferred_free_segment(pool, tokens),
        |pool, _| assert_eq!(allocated(pool), (0, 0)),
    );
}

/// A deferred two-sided free of a long row whose window was released: every page's SWA
/// is a tombstone.
#[test]
fn a_deferred_two_sided_free_of_a_released_window_reports_each_page() {
    reported_at_warn_and_strict(
        &PEER_MAPPED,
        LONG as u64,
        true,
        |pool| {
            let row = long_row(pool);
            pool.free_swa_segment(whole(&row)).unwrap();
            row
        },
        |pool, row| deferred_free_segment(pool, row),
        |pool, _| assert_eq!(allocated(pool), (0, 0)),
    );
}

/// A long row freed twice in one group: every page of the second free is reported (the
/// group's record of freed pages is kept a run of pages at a time), and each page is
/// released once.
#[test]
fn a_long_row_freed_twice_in_one_group_reports_each_page() {
    reported_at_warn_and_strict(
        &ONE_FREE_PER_GROUP,
        LONG as u64,
        false,
        long_row,
        |pool, row| {
            pool.free_group_begin().unwrap();
            pool.free_segment(whole(row)).unwrap();
            pool.free_segment(whole(row)).unwrap();
            pool.free_group_end().unwrap();
        },
        |pool, _| assert_eq!(allocated(pool), (0, 0)),
    );
}

//! The reviewed bug of the seed: reclaim flushes every deferred list before sizing, so
//! frees waiting in a group — in any one list alone — are visible and nothing is evicted.
//! Also: the set-shaped frees keep their liveness filter (recovery paths rely on it).

mod common;

use common::*;
use unikv_pools::{
    DeferredKind, PageDemand, ReclaimPlan, Reclaimable, Segment, SwaState, VirtualToken,
};

const EVERYTHING: Reclaimable = Reclaimable::pages(usize::MAX, usize::MAX);

/// Fills the pool with rows of `pages` pages each until the joint capacity is gone.
fn fill(pool: &mut Pool, pages: usize) -> Vec<Vec<VirtualToken>> {
    let n = pages * pool.ps as usize;
    let mut rows = Vec::new();
    loop {
        let mut row = Vec::new();
        if try_extend(pool, &mut row, n).is_err() {
            break;
        }
        rows.push(row);
    }
    assert!(!pool.allocation_fits(PageDemand::joint(pages)));
    rows
}

/// Each deferred list alone: how a finished row's pages are queued.
fn queue(pool: &mut Pool, kind: DeferredKind, row: &[VirtualToken]) {
    let seg = Segment::of_row(row, 0..row.len());
    match kind {
        DeferredKind::Tokens => pool.free(row).unwrap(),
        DeferredKind::PageReps => pool.free_segment(seg).unwrap(),
        DeferredKind::FullOnlyTokens => {
            pool.free_swa(row).unwrap(); // window already released (not deferred)
            pool.free_full(row).unwrap();
        }
        DeferredKind::FullOnlyPageReps => {
            pool.free_swa_segment(seg).unwrap();
            pool.free_full_segment(seg).unwrap();
        }
        // No FULL/SWA layout has a slot pool, so none can queue a slot (see `misuse.rs`).
        DeferredKind::Slots => unreachable!("a FULL/SWA pool has no slot list to fill"),
    }
}

const KINDS: [DeferredKind; 4] = [
    DeferredKind::Tokens,
    DeferredKind::PageReps,
    DeferredKind::FullOnlyTokens,
    DeferredKind::FullOnlyPageReps,
];

#[test]
fn reclaim_flushes_each_deferred_list_alone_before_sizing() {
    each_case(|layout, ps| {
        for kind in KINDS {
            let mut pool = pool(layout, ps, 32);
            let rows = fill(&mut pool, 4);
            pool.free_group_begin().unwrap();
            queue(&mut pool, kind, &rows[0]);
            let pending = pool.pending_frees();
            assert!(
                pending.iter().all(|&(k, n)| (k == kind) == (n > 0)),
                "{layout:?}/{ps}/{kind:?}: only its own list holds the frees: {pending:?}"
            );
            // Invisible until flushed: the pure check does not see them.
            assert!(
                !pool.allocation_fits(PageDemand::joint(4)),
                "{layout:?}/{ps}/{kind:?}"
            );
            // The bug: a flush that forgets this list over-evicts. The plan evicts nothing.
            let plan = pool.reclaim_plan(PageDemand::joint(4), EVERYTHING);
            assert_eq!(
                plan,
                Some(ReclaimPlan::default()),
                "{layout:?}/{ps}/{kind:?}"
            );
            assert!(pool.in_free_group(), "the flush keeps the group open");
            assert!(pool.pending_frees().iter().all(|&(_, n)| n == 0));
            let mut row = Vec::new();
            extend(&mut pool, &mut row, 4 * ps as usize);
            pool.free_group_end().unwrap();
            assert_clean(&pool);
        }
    });
}

#[test]
fn ensure_capacity_flushes_each_deferred_list_alone() {
    each_case(|layout, ps| {
        for kind in KINDS {
            let mut pool = pool(layout, ps, 32);
            let rows = fill(&mut pool, 4);
            pool.free_group_begin().unwrap();
            queue(&mut pool, kind, &rows[1]);
            pool.ensure_capacity(PageDemand::joint(4))
                .unwrap_or_else(|e| panic!("{layout:?}/{ps}/{kind:?}: {e}"));
            assert!(pool.in_free_group());
            pool.free_group_end().unwrap();
            assert_clean(&pool);
        }
    });
}

#[test]
fn reclaim_plan_is_minimal_and_none_when_impossible() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let rows = fill(&mut pool, 4);
        let live = allocated(&pool);
        // Nothing evictable: impossible.
        assert_eq!(
            pool.reclaim_plan(PageDemand::joint(4), Reclaimable::default()),
            None
        );
        // Everything evictable: exactly the pages short on each side (after compaction
        // there is no slack left in this full pool, so 4 pages each).
        let plan = pool.reclaim_plan(PageDemand::joint(4), EVERYTHING).unwrap();
        let fits_with = |pool: &mut Pool, p: ReclaimPlan| {
            // Evict `p` from the rows (SWA-only evictions as window frees first).
            let mut full = p.full_pages;
            let mut swa = p.swa_pages.saturating_sub(full);
            for row in &rows {
                let pages = row.len() / ps as usize;
                let take = full.min(pages);
                if take > 0 {
                    pool.free_segment(Segment::of_row(row, 0..take * ps as usize))
                        .unwrap();
                    full -= take;
                }
                let t = swa.min(pages - take);
                if t > 0 {
                    let r = take * ps as usize..(take + t) * ps as usize;
                    pool.free_swa_segment(Segment::of_row(row, r)).unwrap();
                    swa -= t;
                }
            }
            pool.allocation_fits(PageDemand::joint(4))
        };
        assert!(plan.full_pages <= live.0 && plan.swa_pages <= live.1);
        assert!(
            plan.full_pages > 0 || plan.swa_pages > 0,
            "{layout:?}/{ps}: {plan:?}"
        );
        assert!(
            fits_with(&mut pool, plan),
            "{layout:?}/{ps}: evicting the plan fits: {plan:?}"
        );
        assert_clean(&pool);
    });
}

/// A recovery path: a row with window-evicted (tombstoned) and live pages is released
/// with the set-shaped forms, which filter by SWA liveness, and nothing is reported even
/// at strict.
#[test]
fn set_shaped_frees_still_filter_by_liveness() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let row = new_row(&mut pool, 4 * psz);
        pool.free_swa_segment(Segment::of_row(&row, 0..2 * psz))
            .unwrap();
        unikv_invariants::scoped_level(unikv_invariants::Level::Strict, || {
            pool.invariant_scope().poll().unwrap();
            // free_swa over the whole row: live pages tombstoned, tombstones skipped.
            pool.free_swa(&row[..3 * psz]).unwrap();
            assert_eq!(allocated(&pool), (4, 1));
            // Shuffled ids, several per page, mixed liveness: both sides released.
            let mut ids: Vec<_> = row.iter().rev().copied().collect();
            ids.extend_from_slice(&row[..psz]);
            pool.free(&ids).unwrap();
            assert_eq!(allocated(&pool), (0, 0));
            pool.invariant_scope()
                .poll()
                .expect("the filter reports nothing");
        });
        for t in &row {
            assert_eq!(pool.swa_state(t.page(pool.page_size())), SwaState::Unbound);
        }
        assert_clean(&pool);
    });
}

/// Scenario 31: the plan's SWA reclaim is minimal given all FULL reclaim, and its FULL
/// reclaim minimal given that SWA reclaim. For every demand up to the pool's size, twin
/// pools replay the same history; one evicts the plan (fits), the others one page less
/// on either side (do not fit).
#[test]
fn reclaim_plan_is_minimal_on_each_side() {
    each_case(|layout, ps| {
        let psz = ps as usize;
        // Half the rows are FULL-only evictable (SWA already released), half SWA-evictable.
        let build = || {
            let mut p = pool(layout, ps, 32);
            let rows = fill(&mut p, 2);
            for row in rows.iter().step_by(2) {
                p.free_swa_segment(Segment::of_row(row, 0..row.len()))
                    .unwrap();
            }
            (p, rows)
        };
        let evict = |p: &mut Pool, rows: &[Vec<VirtualToken>], full: usize, swa: usize, k| {
            let (mut full, mut swa) = (full, swa);
            for (i, row) in rows.iter().enumerate() {
                let pages = row.len() / psz;
                let budget = if i % 2 == 0 { &mut full } else { &mut swa };
                let n = (*budget).min(pages);
                *budget -= n;
                let seg = Segment::of_row(row, 0..n * psz);
                if i % 2 == 0 {
                    p.free_full_segment(seg).unwrap();
                } else {
                    p.free_swa_segment(seg).unwrap();
                }
            }
            p.allocation_fits(PageDemand::joint(k))
        };
        let (probe, rows) = build();
        let evictable = Reclaimable::pages(
            rows.iter().step_by(2).map(|r| r.len() / psz).sum(),
            rows.iter().skip(1).step_by(2).map(|r| r.len() / psz).sum(),
        );
        drop(probe);
        let mut checked = [0usize; 3];
        for k in 1..=48 {
            let (mut a, rows) = build();
            let Some(plan) = a.reclaim_plan(PageDemand::joint(k), evictable) else {
                continue;
            };
            assert!(
                evict(&mut a, &rows, plan.full_pages, plan.swa_pages, k),
                "{layout:?}/{ps} k {k}: {plan:?}"
            );
            if plan.swa_pages > 0 {
                let (mut b, rows) = build();
                assert!(
                    !evict(&mut b, &rows, evictable.full_pages, plan.swa_pages - 1, k),
                    "{layout:?}/{ps} k {k}: one SWA page less must not fit: {plan:?}"
                );
                checked[1] += 1;
            }
            if plan.full_pages > 0 {
                let (mut c, rows) = build();
                assert!(
                    !evict(&mut c, &rows, plan.full_pages - 1, plan.swa_pages, k),
                    "{layout:?}/{ps} k {k}: one FULL page less must not fit: {plan:?}"
                );
                checked[0] += 1;
            }
            // The floor: the least FULL eviction that fits once all SWA is evicted too.
            let floor = plan.full_floor_pages;
            assert!(floor <= plan.full_pages, "{layout:?}/{ps} k {k}: {plan:?}");
            let (mut d, rows) = build();
            assert!(
                evict(&mut d, &rows, floor, evictable.swa_pages, k),
                "{layout:?}/{ps} k {k}: the floor with all SWA must fit: {plan:?}"
            );
            if floor > 0 {
                let (mut e, rows) = build();
                assert!(
                    !evict(&mut e, &rows, floor - 1, evictable.swa_pages, k),
                    "{layout:?}/{ps} k {k}: one FULL page below the floor must not fit: {plan:?}"
                );
                checked[2] += 1;
            }
            assert_clean(&a);
        }
        // Static: the released SWA of the FULL-only rows always covers the SWA side, so
        // only FULL is ever short there; unified prices both sides from one byte budget.
        let both = layout == Layout::Unified;
        assert!(
            checked[0] > 0 && (checked[1] > 0 || !both) && checked[2] > 0,
            "{layout:?}/{ps}: sides exercised (full, swa, floor): {checked:?}"
        );
    });
}

//! No data-dependent shapes: every free path, alloc and a flush with no holes issue zero
//! host syncs (and frees issue no device op at all), and the same detector flags a
//! deliberately filtering free that reads SWA liveness back from the device.

mod common;

use common::*;
use unikv_kernels::{HostSync, Readback, SyncReport};
use unikv_pools::{Segment, Side, VirtualToken};

/// The test helper: runs `f` on a fresh ledger record and reports any op that synced or
/// brought device data back (a data-dependent shape).
fn without_syncs(pool: &mut Pool, f: impl FnOnce(&mut Pool)) -> Result<(), SyncReport> {
    pool.ledger.reset();
    f(pool);
    pool.ledger.check_no_syncs()
}

/// Ops issued by `f`.
fn ops_of(pool: &mut Pool, f: impl FnOnce(&mut Pool)) -> usize {
    let before = pool.ledger.op_count();
    f(pool);
    pool.ledger.op_count() - before
}

/// The seed's scenario, in every free form, in and out of a group.
fn every_free_path(pool: &mut Pool) {
    let ps = pool.ps as usize;
    let mut a = new_row(pool, 3 * ps + 1);
    let b = new_row(pool, 4 * ps);
    let c = new_row(pool, 2 * ps + 1);
    extend(pool, &mut a, ps); // tail reuse, then a new page
    // Frees: none of them may issue any device op.
    let frees = ops_of(pool, |pool| {
        // Window eviction of a's first page, then its release split at the cursor.
        pool.free_swa_segment(Segment::of_row(&a, 0..ps)).unwrap();
        pool.free_kv_row_segments(&a, 0, ps, a.len()).unwrap();
        // b inside a group: window eviction, then FULL-only and two-sided segment frees.
        pool.free_group_begin().unwrap();
        pool.free_swa_segment(Segment::of_row(&b, 0..ps)).unwrap();
        pool.free_full_segment(Segment::of_row(&b, 0..ps)).unwrap();
        pool.free_segment(Segment::of_row(&b, ps..b.len())).unwrap();
        pool.free_group_end().unwrap();
        // c outside a group, two-sided.
        pool.free_segment(Segment::of_row(&c, 0..c.len())).unwrap();
    });
    assert_eq!(frees, 0, "frees are host bookkeeping only");
}

#[test]
fn segment_frees_alloc_and_flush_issue_no_sync_and_capacity_comes_back() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 64);
        pool.flush().unwrap();
        let initial = pool.capacity();
        without_syncs(&mut pool, every_free_path)
            .unwrap_or_else(|r| panic!("{layout:?}/{ps}: {r}"));
        without_syncs(&mut pool, |pool| {
            pool.flush().unwrap();
            pool.upload_mirror().unwrap();
        })
        .unwrap_or_else(|r| panic!("{layout:?}/{ps}: {r}"));
        assert_eq!(
            pool.capacity(),
            initial,
            "{layout:?}/{ps}: both sides' capacity comes back exactly"
        );
        // A flush with no holes issues nothing at all.
        assert_eq!(
            ops_of(&mut pool, |p| {
                p.flush().unwrap();
            }),
            0
        );
        assert_clean(&pool);
    });
}

/// A deliberately filtering window eviction: reads SWA liveness back from the device
/// mirror (as the reference's boolean mask did) and frees only the live pages.
fn filtering_free_swa_segment(pool: &mut Pool, row: &[VirtualToken]) {
    pool.upload_mirror().unwrap();
    let mirror = pool.mirror_table(Side::Swa).unwrap();
    let n = pool.virtual_pages() as usize;
    let live = pool
        .ledger
        .read_table(&HostSync::acquire("liveness filter"), mirror, 0, n)
        .unwrap();
    let ps = pool.page_size();
    let kept: Vec<VirtualToken> = row
        .iter()
        .copied()
        .filter(|t| live[t.page(ps).0 as usize] > 0)
        .collect();
    pool.free_swa(&kept).unwrap();
}

#[test]
fn the_detector_flags_a_filtering_free() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 64);
        let row = new_row(&mut pool, 4 * ps as usize);
        let report = without_syncs(&mut pool, |pool| {
            filtering_free_swa_segment(pool, &row[..2 * ps as usize])
        })
        .expect_err("a liveness read-back must be flagged");
        assert!(
            report
                .offenders
                .iter()
                .any(|r| r.synced && r.op == "read_table"),
            "{report}"
        );
        assert!(
            report.to_string().contains("no_sync.rs"),
            "the report names the call site: {report}"
        );
        // The fixed-shape form of the same free passes the same detector.
        without_syncs(&mut pool, |pool| {
            pool.free_swa_segment(Segment::of_row(&row, 2 * ps as usize..4 * ps as usize))
                .unwrap()
        })
        .unwrap();
        assert_clean(&pool);
    });
}

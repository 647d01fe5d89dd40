//! `free_batch`, the infallible mode of the free family: each variant does what its
//! checked method does, an op the checked method would refuse is recorded as
//! `pool.free_batch_well_formed` and skipped (the rest applied, the allocator
//! consistent), and on valid input a batch equals the checked calls one by one.

mod common;

use common::*;
use unikv_invariants::{Level, scoped_level};
use unikv_pools::invariants::FREE_BATCH_WELL_FORMED;
use unikv_pools::{Error, FreeOp, KvAllocator, Segment, VirtualSlot, VirtualToken};

/// Rows on a fresh pool: `[live, tombstoned head + live tail, dead, kv row, swa]`.
fn rows(p: &mut Pool) -> Vec<Vec<VirtualToken>> {
    let ps = p.ps as usize;
    let rows: Vec<_> = (0..5).map(|_| new_row(p, 3 * ps)).collect();
    p.free_swa_segment(Segment::of_row(&rows[1], 0..2 * ps))
        .unwrap();
    p.free_swa_segment(Segment::of_row(&rows[3], 0..ps))
        .unwrap();
    rows
}

/// One op of every variant, all valid on the rows of [`rows`].
fn every_variant(rows: &[Vec<VirtualToken>], ps: usize) -> Vec<FreeOp<'_>> {
    vec![
        FreeOp::TransferSwa {
            from: Segment::of_row(&rows[0], 0..2 * ps),
            to: Segment::of_row(&rows[1], 0..2 * ps),
        },
        FreeOp::Segment(Segment::of_row(&rows[2], 0..3 * ps)),
        FreeOp::FullSegment(Segment::of_row(&rows[0], 0..2 * ps)),
        FreeOp::SwaSegment(Segment::of_row(&rows[4], 0..ps)),
        FreeOp::KvRow {
            row: &rows[3],
            dead_lo: 0,
            cursor: ps,
            len: 3 * ps,
        },
    ]
}

/// The same ops through the checked methods.
fn checked(a: &mut dyn KvAllocator, ops: &[FreeOp<'_>]) {
    for op in ops {
        match *op {
            FreeOp::Segment(s) => a.free_segment(s),
            FreeOp::FullSegment(s) => a.free_full_segment(s),
            FreeOp::SwaSegment(s) => a.free_swa_segment(s),
            FreeOp::TransferSwa { from, to } => a.transfer_swa(from, to),
            FreeOp::KvRow {
                row,
                dead_lo,
                cursor,
                len,
            } => a.free_kv_row_segments(row, dead_lo, cursor, len),
            FreeOp::Slots(slots) => a.free_slots(slots),
        }
        .unwrap_or_else(|e| panic!("{}: {e}", op.name()));
    }
}

#[test]
fn every_variant_matches_its_checked_method_inside_and_outside_a_group() {
    each_case(|layout, ps| {
        for group in [false, true] {
            let (mut a, mut b) = (pool(layout, ps, 32), pool(layout, ps, 32));
            let (ra, rb) = (rows(&mut a), rows(&mut b));
            assert_eq!(ra, rb);
            if group {
                a.free_group_begin().unwrap();
                b.free_group_begin().unwrap();
            }
            let before = allocated(&a);
            let ops = every_variant(&ra, ps as usize);
            a.free_batch(&ops);
            checked(&mut *b.alloc, &every_variant(&rb, ps as usize));
            assert_eq!(snapshot(&*a.alloc), snapshot(&*b.alloc), "{layout:?}/{ps}");
            if group {
                a.free_group_end().unwrap();
                b.free_group_end().unwrap();
                assert_eq!(snapshot(&*a.alloc), snapshot(&*b.alloc));
            }
            // FULL: two pages of row 0, rows 2 and 3 whole.
            assert_eq!(allocated(&a).0, before.0 - 8, "{layout:?}/{ps}");
            assert_clean(&a);
        }
    });
}

#[test]
fn a_refused_op_is_recorded_and_skipped_and_the_rest_is_applied() {
    each_case(|layout, ps| {
        for level in [Level::Warn, Level::Strict] {
            let mut p = pool(layout, ps, 32);
            let psz = ps as usize;
            let rs = rows(&mut p);
            let repeated: Vec<_> = rs[0][..psz].iter().chain(&rs[0][..psz]).copied().collect();
            let out_of_range = [VirtualToken(u32::MAX - 1)];
            let ops = [
                // A transfer naming a source twice, an out-of-range id, overlapping
                // segments hidden by nothing, a kv row past its end: all refused.
                FreeOp::TransferSwa {
                    from: Segment::of_row(&repeated, 0..2 * psz),
                    to: Segment::of_row(&rs[1], 0..2 * psz),
                },
                FreeOp::Segment(Segment::of_row(&out_of_range, 0..1)),
                FreeOp::KvRow {
                    row: &rs[3],
                    dead_lo: 0,
                    cursor: psz,
                    len: 4 * psz,
                },
                // Valid: applied.
                FreeOp::Segment(Segment::of_row(&rs[2], 0..3 * psz)),
            ];
            let scope = p.invariant_scope().clone();
            scoped_level(level, || {
                scope.poll().unwrap();
                let before = allocated(&p);
                let (n, ()) = breaches(&mut p, &FREE_BATCH_WELL_FORMED, level, |p| {
                    p.free_batch(&ops)
                });
                assert_eq!(n, 3, "{layout:?}/{ps} at {level}");
                assert_eq!(scope.poll().is_err(), level == Level::Strict);
                assert_eq!(allocated(&p), (before.0 - 3, before.1 - 3));
                p.verify().unwrap();
            });
        }
    });
}

#[test]
fn a_slot_free_on_a_pool_without_slots_is_a_contained_breach() {
    each_case(|layout, ps| {
        for group in [false, true] {
            let mut p = pool(layout, ps, 32);
            let psz = ps as usize;
            let rs = rows(&mut p);
            if group {
                p.free_group_begin().unwrap();
            }
            let slots = [VirtualSlot(1)];
            // The checked method: a typed error that changes nothing.
            let before = snapshot(&*p.alloc);
            let err = p.free_slots(&slots).unwrap_err();
            assert!(
                matches!(err, Error::NoSlotPool { op: "free_slots" }),
                "{err}"
            );
            assert_eq!(snapshot(&*p.alloc), before, "{layout:?}/{ps}");
            // In a batch: recorded, skipped, and the rest applied.
            let ops = [
                FreeOp::Slots(&slots),
                FreeOp::Segment(Segment::of_row(&rs[2], 0..3 * psz)),
            ];
            let scope = p.invariant_scope().clone();
            scoped_level(Level::Strict, || {
                scope.poll().unwrap();
                let before = allocated(&p);
                let (n, ()) = breaches(&mut p, &FREE_BATCH_WELL_FORMED, Level::Strict, |p| {
                    p.free_batch(&ops)
                });
                assert_eq!(n, 1, "{layout:?}/{ps}");
                assert!(scope.poll().is_err());
                if group {
                    p.free_group_end().unwrap();
                }
                assert_eq!(allocated(&p), (before.0 - 3, before.1 - 3));
                p.verify().unwrap();
            });
        }
    });
}

//! The free group's bookkeeping seen from outside: whether a group is open, the
//! once-per-group record of freed pages (also when checks are raised after the pool was
//! built), the shape check of a segment's later pages, segments' own arithmetic, and the
//! slot errors' messages.

mod common;

use common::*;
use unikv_invariants::{Level, scoped_level};
use unikv_pools::invariants::{ONE_FREE_PER_GROUP, SEGMENT_SHAPE};
use unikv_pools::{Error, PageSize, Segment, SlotFault, VirtualToken};

#[test]
fn a_group_is_open_from_its_begin_to_its_end_only() {
    each_case(|layout, ps| {
        let mut p = pool(layout, ps, 16);
        assert!(!p.in_free_group());
        p.free_group_begin().unwrap();
        assert!(p.in_free_group());
        p.free_group_end().unwrap();
        assert!(!p.in_free_group(), "{layout:?}/{ps}");
    });
}

/// Checks raised after the pool was built grow the group's record on demand, one page at
/// a time upward (each page a new largest), and still find a page freed twice.
#[test]
fn a_record_grown_after_checks_were_raised_finds_a_second_free() {
    for layout in LAYOUTS {
        let mut p = scoped_level(Level::Off, || pool(layout, 1, 16));
        let row = new_row(&mut p, 9);
        // Row positions in ascending page order: each free notes a new largest page.
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by_key(|&i| row[i].0);
        let (twice, ()) = breaches(&mut p, &ONE_FREE_PER_GROUP, Level::Warn, |p| {
            p.free_group_begin().unwrap();
            for &i in &order[..8] {
                p.free_full_segment(Segment::of_row(&row, i..i + 1))
                    .unwrap();
            }
            p.free_full_segment(Segment::of_row(&row, order[3]..order[3] + 1))
                .unwrap();
            p.free_group_end().unwrap();
        });
        assert_eq!(twice, 1, "{layout:?}");
    }
}

/// A page listed twice in one segment free is a page freed twice in the group: counted
/// once, among pages none of which was freed before (the record's fast path must not
/// swallow it).
#[test]
fn a_page_listed_twice_in_one_segment_is_freed_twice_in_the_group() {
    for layout in LAYOUTS {
        let mut p = pool(layout, 1, 16);
        let a = new_row(&mut p, 8);
        let row: Vec<VirtualToken> = a[..4].iter().chain(&a[2..3]).copied().collect();
        let (twice, r) = breaches(&mut p, &ONE_FREE_PER_GROUP, Level::Warn, |p| {
            p.free_group_begin().unwrap();
            let r = p.free_full_segment(Segment::of_row(&row, 0..5));
            // Counted once: the pages noted before the repeat stay noted, once.
            p.free_full_segment(Segment::of_row(&a, 4..8)).unwrap();
            r
        });
        assert_eq!((twice, r.is_ok()), (1, true), "{layout:?}");
    }
}

/// A segment whose later page is entered mid-page (a row that is not page-contiguous)
/// breaks the segment's shape, at every page size above 1.
#[test]
fn a_later_page_entered_mid_page_breaks_the_segment_shape() {
    for layout in LAYOUTS {
        let mut p = pool(layout, 4, 16);
        let (a, b) = (new_row(&mut p, 8), new_row(&mut p, 8));
        // The first page of `a`, then `b` from its second token.
        let row: Vec<VirtualToken> = a[..4].iter().chain(&b[1..5]).copied().collect();
        let (bad, r) = breaches(&mut p, &SEGMENT_SHAPE, Level::Warn, |p| {
            p.free_segment(Segment::of_row(&row, 0..8))
        });
        assert_eq!(bad, 1, "{layout:?}: {r:?}");
    }
}

#[test]
fn a_segment_knows_its_range_and_its_pages() {
    let row: Vec<VirtualToken> = (40..60).map(VirtualToken).collect();
    let s = Segment::of_row(&row, 8..19);
    assert_eq!(s.range(), 8..19);
    assert_eq!(s.page_count(PageSize::new(4).unwrap()), 3);
    assert_eq!(s.page_count(PageSize::new(1).unwrap()), 11);
    assert_eq!(
        Segment::of_row(&row, 3..3).page_count(PageSize::new(4).unwrap()),
        0
    );
}

#[test]
fn slot_errors_say_what_is_wrong_with_the_slot() {
    let msg = |reason| {
        Error::BadSlot {
            op: "free_slots",
            slot: 3,
            reason,
        }
        .to_string()
    };
    assert_eq!(
        msg(SlotFault::OutOfRange { slots: 8 }),
        "free_slots: slot s3 is outside the slot id space (8 virtual slots)"
    );
    assert_eq!(msg(SlotFault::Sink), "free_slots: slot s3 is the sink");
    assert_eq!(
        msg(SlotFault::NotLive),
        "free_slots: slot s3 is not allocated"
    );
    assert!(msg(SlotFault::NamedTwice).starts_with("free_slots: slot s3 is named twice"));
}

/// A two-sided free queued in a group is checked when it is queued: a page whose SWA the
/// window already released breaks its premise (the caller wanted a FULL-only free).
#[test]
fn a_queued_two_sided_free_of_a_tombstone_breaks_its_premise() {
    use unikv_pools::invariants::PEER_MAPPED;
    each_case(|layout, ps| {
        let p_len = ps as usize;
        let mut p = pool(layout, ps, 16);
        let row = new_row(&mut p, 2 * p_len);
        p.free_swa_segment(Segment::of_row(&row, 0..p_len)).unwrap();
        let (bad, ()) = breaches(&mut p, &PEER_MAPPED, Level::Warn, |p| {
            p.free_group_begin().unwrap();
            p.free_segment(Segment::of_row(&row, 0..2 * p_len)).unwrap();
            p.free_group_end().unwrap();
        });
        assert_eq!(bad, 1, "{layout:?}/{ps}");
    });
}

/// The static layout's two fixed pools: as many SWA pages as FULL ones at ratio 1, half
/// as many at 0.5, and the pages the capacity reports.
#[test]
fn the_static_pools_follow_the_ratio() {
    use std::sync::Arc;
    use unikv_kernels::CpuDevice;
    use unikv_pools::{KvAllocator, StaticSwa};
    let pools = |ratio: f64| {
        let mut config = static_config(4, 64);
        config.swa_full_ratio = ratio;
        let pool = StaticSwa::new(Arc::new(CpuDevice::new()), config).unwrap();
        (pool.pool_pages(), pool.capacity())
    };
    let ((full, swa), cap) = pools(1.0);
    assert!(full > 8 && swa == full, "{full} {swa}");
    assert_eq!(cap.full.total_pages, full as usize, "{cap:?}");
    let ((full, swa), _) = pools(0.5);
    assert!(full > swa && swa > 1, "{full} {swa}");
}

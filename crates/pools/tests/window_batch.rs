//! `free_swa_segments`, the window release of a whole decode batch: on valid input it
//! equals `free_swa_segment` of each segment in order, and a batch with one segment the
//! checked free would refuse is refused whole, changing nothing.

mod common;

use common::*;
use unikv_pools::{Error, Segment, VirtualToken};

/// A pool with four rows of three pages each.
fn rows(layout: Layout, ps: u32) -> (Pool, Vec<Vec<VirtualToken>>) {
    let mut p = pool(layout, ps, 64);
    let rows = (0..4).map(|_| new_row(&mut p, 3 * ps as usize)).collect();
    (p, rows)
}

/// Window releases of several rows, out of row order, one of them empty.
fn windows(rows: &[Vec<VirtualToken>], ps: usize) -> Vec<Segment<'_>> {
    vec![
        Segment::of_row(&rows[2], 0..ps),
        Segment::of_row(&rows[0], 0..2 * ps),
        Segment::of_row(&rows[1], 0..0),
        Segment::of_row(&rows[3], ps..3 * ps),
    ]
}

#[test]
fn a_window_batch_equals_the_segment_frees_one_by_one() {
    each_case(|layout, ps| {
        let (mut batch, batch_rows) = rows(layout, ps);
        let (mut one, one_rows) = rows(layout, ps);
        batch
            .free_swa_segments(&windows(&batch_rows, ps as usize))
            .unwrap();
        for s in windows(&one_rows, ps as usize) {
            one.free_swa_segment(s).unwrap();
        }
        assert_eq!(
            snapshot(&*batch.alloc),
            snapshot(&*one.alloc),
            "{layout:?}/{ps}"
        );
        assert_clean(&batch);
    });
}

#[test]
fn a_window_batch_with_a_bad_segment_frees_nothing() {
    each_case(|layout, ps| {
        let (mut p, rows) = rows(layout, ps);
        let before = snapshot(&*p.alloc);
        let beyond = [VirtualToken(u32::MAX)];
        let mut batch = windows(&rows, ps as usize);
        batch.push(Segment {
            tokens: &beyond,
            start: 0,
        });
        let err = p.free_swa_segments(&batch).unwrap_err();
        assert!(
            matches!(
                err,
                Error::TokenOutOfRange { .. } | Error::SegmentStartsMidPage { .. }
            ),
            "{layout:?}/{ps}: {err:?}"
        );
        assert_eq!(snapshot(&*p.alloc), before, "{layout:?}/{ps}");
        assert_clean(&p);
    });
}

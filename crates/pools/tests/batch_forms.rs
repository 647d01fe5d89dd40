//! The batch forms equal the general ones: `free_swa_segments` (a decode batch's window
//! release) is `free_swa_segment` of each segment in order, and a batch with one segment
//! the checked free would refuse is refused whole, changing nothing; `alloc_decode` (its
//! own check and handout) is `alloc_extend` by one token per request, in its tokens, its
//! tables and its refusals.

mod common;

use common::*;
use unikv_invariants::{Level, scoped_level};
use unikv_pools::{DecodeRequest, Error, ExtendRequest, Segment, VirtualToken};

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

/// Without checks at page size 1 a window batch takes one batch pass (slice writes for
/// each 16 pages of a prefill); with them, page by page with its reports. The two agree,
/// on live pages, on pages already tombstoned (a second ratchet) and on repeats.
#[test]
fn a_window_batch_without_checks_equals_the_checked_page_by_page_release() {
    each_case(|layout, ps| {
        // Rows of 48 tokens at least: thirds of a row are whole pages, and at page size 1
        // runs of 16.
        let third = ps.max(16) as usize;
        let setup = || {
            let mut p = pool(layout, ps, 64 * ps.max(16) as u64);
            let rows: Vec<_> = (0..4).map(|_| new_row(&mut p, 3 * third)).collect();
            (p, rows)
        };
        let ((mut off, off_rows), (mut warn, warn_rows)) = (setup(), setup());
        for (p, rows, level) in [
            (&mut off, &off_rows, Level::Off),
            (&mut warn, &warn_rows, Level::Warn),
        ] {
            scoped_level(level, || {
                // The first third of rows[0] leaves first: the batch meets its tombstones.
                p.free_swa_segment(Segment::of_row(&rows[0], 0..third))
                    .unwrap();
                p.free_swa_segments(&thirds(rows, third)).unwrap();
            });
        }
        assert_eq!(
            snapshot(&*off.alloc),
            snapshot(&*warn.alloc),
            "{layout:?}/{ps}"
        );
        off.verify().unwrap();
        warn.verify().unwrap();
    });
}

/// Window releases of whole thirds of rows, out of row order, with a repeat (the second
/// ratchet over rows[2]'s first third).
fn thirds(rows: &[Vec<VirtualToken>], third: usize) -> Vec<Segment<'_>> {
    vec![
        Segment::of_row(&rows[2], 0..third),
        Segment::of_row(&rows[0], 0..2 * third),
        Segment::of_row(&rows[3], third..3 * third),
        Segment::of_row(&rows[2], 0..third),
    ]
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

/// Decode requests for `rows`, each growing by one token.
fn decodes(rows: &[Vec<VirtualToken>]) -> Vec<DecodeRequest> {
    rows.iter()
        .map(|row| DecodeRequest {
            prefix_len: row.len(),
            last_token: row.last().copied(),
        })
        .collect()
}

/// Rows ending on a page boundary, one token past it and one token before it (an empty
/// one too), with a freed row between them so the id stack is not in order.
fn ragged_rows(p: &mut Pool) -> Vec<Vec<VirtualToken>> {
    let ps = p.ps as usize;
    let mut rows = Vec::new();
    for len in [0, 1, ps - 1, ps, ps + 1, 2 * ps, 3 * ps - 1] {
        rows.push(new_row(p, len));
        let gap = new_row(p, ps + 1);
        p.free(&gap).unwrap();
    }
    rows
}

#[test]
fn a_decode_batch_equals_an_extend_by_one_token_each() {
    each_case(|layout, ps| {
        let mut decode = pool(layout, ps, 96);
        let mut extend = pool(layout, ps, 96);
        let (mut rows_d, mut rows_e) = (ragged_rows(&mut decode), ragged_rows(&mut extend));
        assert_eq!(rows_d, rows_e);
        // Steps across a page boundary of every row (all of them at small page sizes).
        for step in 0..=(ps as usize + 1).min(40) {
            let (mut out_d, mut out_e) = (Vec::new(), Vec::new());
            decode.alloc_decode(&decodes(&rows_d), &mut out_d).unwrap();
            let requests: Vec<ExtendRequest> = decodes(&rows_e)
                .into_iter()
                .map(ExtendRequest::from)
                .collect();
            extend.alloc_extend(&requests, &mut out_e).unwrap();
            assert_eq!(out_d, out_e, "{layout:?}/{ps} step {step}");
            assert_eq!(
                snapshot(&*decode.alloc),
                snapshot(&*extend.alloc),
                "{layout:?}/{ps}"
            );
            for ((row_d, row_e), (&d, &e)) in rows_d
                .iter_mut()
                .zip(&mut rows_e)
                .zip(out_d.iter().zip(&out_e))
            {
                row_d.push(d);
                row_e.push(e);
            }
        }
        assert_clean(&decode);
    });
}

#[test]
fn a_refused_decode_batch_is_refused_as_the_extend_and_changes_nothing() {
    each_case(|layout, ps| {
        let mut p = pool(layout, ps, 96);
        let rows = ragged_rows(&mut p);
        let before = snapshot(&*p.alloc);
        let mut bad = decodes(&rows);
        let unaligned = rows.iter().position(|r| r.len() % ps as usize != 0);
        // A row that does not end on a page boundary, without its last token; at page
        // size 1, where every row ends on one, more new pages than the pool has.
        match unaligned {
            Some(i) => bad[i].last_token = None,
            None => bad.extend((0..96).map(|_| DecodeRequest {
                prefix_len: 0,
                last_token: None,
            })),
        }
        let decode = p.alloc_decode(&bad, &mut Vec::new()).unwrap_err();
        let requests: Vec<ExtendRequest> = bad.iter().map(|&d| d.into()).collect();
        let extend = p.alloc_extend(&requests, &mut Vec::new()).unwrap_err();
        assert_eq!(
            format!("{decode:?}"),
            format!("{extend:?}"),
            "{layout:?}/{ps}"
        );
        assert!(
            matches!(
                decode,
                Error::BadRequest { .. } | Error::OutOfCapacity { .. }
            ),
            "{decode:?}"
        );
        assert_eq!(snapshot(&*p.alloc), before, "{layout:?}/{ps}");
    });
}

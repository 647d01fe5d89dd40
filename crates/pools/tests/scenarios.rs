//! Scenarios 1–19 of the reference list (sglang-unified-memory.md §7), each for both
//! layouts at every page size of the matrix (1, 4 and the cell's).

mod common;

use common::*;
use unikv_invariants::{Level, scoped_level};
use unikv_kernels::{HostSync, Readback};
use unikv_pools::invariants::{DOUBLE_FREE, PEER_RELEASED, SINK_RESERVED};
use unikv_pools::{
    DecodeRequest, Error, ExtendRequest, KvAllocator, PageDemand, Segment, Side, SideTranslation,
    StaticSwa, StaticSwaConfig, SubPoolSpec, SwaState, UnifiedSwa, UnifiedSwaConfig, VirtualPage,
    VirtualToken,
};

/// Distinct virtual pages of `tokens`, in order of first appearance.
fn pages_of(pool: &Pool, tokens: &[VirtualToken]) -> Vec<VirtualPage> {
    let ps = pool.page_size();
    let mut pages: Vec<VirtualPage> = Vec::new();
    for t in tokens {
        let v = t.page(ps);
        if pages.last() != Some(&v) {
            pages.push(v);
        }
    }
    pages
}

/// Every live envelope of both sides as byte ranges, checked disjoint and above the floor.
fn assert_envelopes_disjoint(pool: &Pool) {
    let mut ranges = Vec::new();
    for v in 1..pool.virtual_pages() {
        for side in [Side::Full, Side::Swa] {
            if let Some(p) = pool.physical_page(side, VirtualPage(v)) {
                let env = pool.grid(side).envelope;
                ranges.push((p as u64 * env, (p as u64 + 1) * env, side, v));
            }
        }
    }
    ranges.sort();
    for r in &ranges {
        assert!(
            r.0 >= pool.sink_floor(),
            "{:?}/{}: {r:?} is inside the sink floor",
            pool.layout,
            pool.ps
        );
    }
    for w in ranges.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "{:?}/{}: {:?} overlaps {:?}",
            pool.layout,
            pool.ps,
            w[0],
            w[1]
        );
    }
}

// 1. Reserved sink.
#[test]
fn s01_reserved_sink() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 16);
        assert_eq!(
            pool.sink_floor(),
            64 * ps as u64,
            "max envelope of both specs"
        );
        for side in [Side::Full, Side::Swa] {
            assert_eq!(pool.physical_page(side, VirtualPage::SINK), None);
            assert_eq!(pool.kernel_id(side, VirtualToken(0)), 0);
        }
        let mut rows = Vec::new();
        while let Ok(()) = {
            let mut row = Vec::new();
            let r = try_extend(&mut pool, &mut row, ps as usize);
            rows.push(row);
            r
        } {}
        let handed: Vec<VirtualToken> = rows.concat();
        assert!(handed.len() >= 8 * ps as usize);
        assert!(
            handed
                .iter()
                .all(|t| t.page(pool.page_size()) != VirtualPage::SINK)
        );
        assert_envelopes_disjoint(&pool);
        assert_clean(&pool);
    });
}

// 2. The SWA side's v2p is sized by FULL's virtual ids, even when SWA pages are 8× larger.
#[test]
fn s02_swa_v2p_is_sized_by_full_virtual_ids() {
    for ps in unikv_invariants::testing::page_sizes() {
        let full = SubPoolSpec::mha("full", 1, 1, 4, 2); // 16 B/token
        let swa = SubPoolSpec::mha("swa", 8, 1, 4, 2); // 128 B/token
        let floor = 128 * ps as u64;
        let config = UnifiedSwaConfig {
            total_bytes: floor + 40 * ps as u64 * 144,
            page_size: ps,
            window: WINDOW,
            full,
            swa: Some(swa),
            mamba: None,
            zero_on_handout: false,
        };
        let ledger = std::sync::Arc::new(unikv_kernels::SyncLedger::cpu());
        let mut pool = UnifiedSwa::new(ledger.clone(), config).unwrap();
        let top = VirtualPage(pool.virtual_pages() - 1);
        assert!(
            pool.virtual_pages() > 8 * 40,
            "FULL mints many more ids than SWA has pages"
        );
        assert_eq!(pool.swa_state(top), SwaState::Unbound);
        assert_eq!(
            pool.kernel_id(Side::Swa, top.first_token(pool.page_size())),
            0
        );
        // Churn so that high virtual ids get bound: allocate everything, free all but the
        // last row, repeat; every SWA bind must land.
        let mut out = Vec::new();
        let req = ExtendRequest {
            prefix_len: 0,
            seq_len: ps as usize,
            last_token: None,
        };
        let mut max_id = 0;
        for _ in 0..20 {
            let mut rows = Vec::new();
            while pool.alloc_extend(&[req], &mut out).is_ok() {
                rows.push(std::mem::take(&mut out));
            }
            for row in &rows[..rows.len() - 1] {
                max_id = max_id.max(row[0].page(pool.page_size()).0);
                pool.free_segment(Segment::of_row(row, 0..row.len()))
                    .unwrap();
            }
            pool.flush().unwrap();
        }
        pool.verify().unwrap();
        assert!(
            max_id >= 30,
            "ps {ps}: ids up to {max_id} were bound on SWA"
        );
    }
}

// 3. The batch-size-1 floor fails at boot.
#[test]
fn s03_bs1_floor_is_a_boot_error() {
    for ps in unikv_invariants::testing::page_sizes() {
        let device = || -> std::sync::Arc<dyn unikv_kernels::Device> {
            std::sync::Arc::new(unikv_kernels::CpuDevice::new())
        };
        let mut u = unified_config(ps, 1);
        u.window = 64;
        assert!(matches!(
            UnifiedSwa::new(device(), u.clone()),
            Err(Error::BufferTooSmall { .. })
        ));
        let s = StaticSwaConfig {
            total_bytes: u.total_bytes,
            page_size: ps,
            window: 64,
            full: u.full.clone(),
            swa: u.swa.clone(),
            mamba: None,
            swa_full_ratio: 0.8,
            zero_on_handout: false,
        };
        assert!(matches!(
            StaticSwa::new(device(), s),
            Err(Error::BufferTooSmall { .. })
        ));
        // Exactly one window (+ one page) on both sides is enough.
        let pages = (64 + ps as u64).div_ceil(ps as u64);
        assert!(UnifiedSwa::new(device(), unified_config(ps, pages)).is_ok());
    }
}

// 4. A joint alloc binds both sides under one virtual page, in disjoint byte ranges.
#[test]
fn s04_joint_alloc_binds_both_sides() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let rows: Vec<_> = (1..5)
            .map(|n| new_row(&mut pool, n * ps as usize + 1))
            .collect();
        for row in &rows {
            for v in pages_of(&pool, row) {
                assert!(pool.full_live(v) && pool.swa_state(v) == SwaState::Live);
            }
        }
        assert_eq!(allocated(&pool), (14, 14));
        assert_envelopes_disjoint(&pool);
        assert_clean(&pool);
    });
}

// 5. Extend with tail reuse.
#[test]
fn s05_extend_fills_the_tail_page_first() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        // (prefix, extend): the new tokens, the new pages.
        for (prefix, n) in [
            (1, 2 * psz),
            (psz + 1, psz - 1),
            (2 * psz - 1, 1),
            (3, 3 * psz + 2),
        ] {
            let mut row = new_row(&mut pool, prefix);
            let before = allocated(&pool);
            let req = ExtendRequest {
                prefix_len: prefix,
                seq_len: prefix + n,
                last_token: row.last().copied(),
            };
            let mut out = Vec::new();
            pool.alloc_extend(&[req], &mut out).unwrap();
            let new_pages = req.new_pages(pool.page_size());
            assert_eq!(
                allocated(&pool),
                (before.0 + new_pages, before.1 + new_pages)
            );
            if prefix % psz != 0 {
                assert_eq!(out[0].0, row.last().unwrap().0 + 1, "tail first");
            }
            row.extend(out);
            // Row positions and token offsets agree: position i is at offset i % ps.
            for (i, t) in row.iter().enumerate() {
                assert_eq!(t.offset(pool.page_size()) as usize, i % psz);
            }
        }
        assert_clean(&pool);
    });
}

// 6. Decode wrap: only requests that cross a page boundary get a page.
#[test]
fn s06_decode_binds_only_for_requests_that_wrap() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 64);
        let psz = ps as usize;
        let mut rows: Vec<Vec<VirtualToken>> = [psz, psz + 1, 2 * psz - 1, 1, 3]
            .iter()
            .map(|&n| new_row(&mut pool, n))
            .collect();
        for _step in 0..2 * psz + 1 {
            let reqs: Vec<DecodeRequest> = rows
                .iter()
                .map(|r| DecodeRequest {
                    prefix_len: r.len(),
                    last_token: r.last().copied(),
                })
                .collect();
            let wrapping = rows.iter().filter(|r| r.len() % psz == 0).count();
            let before = allocated(&pool);
            let mut out = Vec::new();
            pool.alloc_decode(&reqs, &mut out).unwrap();
            assert_eq!(allocated(&pool), (before.0 + wrapping, before.1 + wrapping));
            for (row, t) in rows.iter_mut().zip(out) {
                row.push(t);
            }
        }
        assert_clean(&pool);
    });
}

// 7. Translate: the host formula and the device op agree; unbound, tombstoned, zero and
// negative ids map to the sink; the tail past n is zero-filled.
#[test]
fn s07_translate() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let row = new_row(&mut pool, 3 * psz);
        pool.free_swa_segment(Segment::of_row(&row, 0..psz))
            .unwrap();
        pool.upload_mirror().unwrap();
        let mut ids: Vec<i32> = row.iter().map(|t| t.0 as i32).collect();
        let unbound = pool.virtual_pages() as i32 - 1;
        ids.extend([0, -1, unbound * ps as i32, i32::MAX]);
        let dev = pool.ledger.clone();
        let table = dev.alloc_table_for_test(&ids);
        let width = ids.len() + 5;
        let mut per_side = Vec::new();
        for side in [Side::Full, Side::Swa] {
            let out = unikv_kernels::Device::alloc_table(&*dev, width, 77).unwrap();
            pool.translate(side, table, ids.len(), out, width).unwrap();
            let got = dev
                .read_table(&HostSync::acquire("test"), out, 0, width)
                .unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let host = if id > 0 {
                    pool.kernel_id(side, VirtualToken(id as u32))
                } else {
                    0
                };
                assert_eq!(got[i], host, "{layout:?}/{ps} {side:?} id {id}");
                if id > 0 {
                    let v = VirtualToken(id as u32).page(pool.page_size());
                    if let Some(p) = pool.physical_page(side, v) {
                        let expected = p as i32 * pool.stride(side) as i32 + id % ps as i32;
                        assert_eq!(host, expected);
                    } else {
                        assert_eq!(host, 0);
                    }
                }
            }
            assert!(got[ids.len()..].iter().all(|&x| x == 0), "zero-filled tail");
            per_side.push(got);
        }
        // Both sides in one op: the same kernel ids.
        let outs = [Side::Full, Side::Swa].map(|side| SideTranslation {
            side,
            ids: table,
            n: ids.len(),
            out: unikv_kernels::Device::alloc_table(&*dev, width, 77).unwrap(),
            out_width: width,
        });
        dev.reset();
        pool.translate_many(&outs).unwrap();
        assert_eq!(dev.op_count(), 1, "one device op: {:?}", dev.ops());
        for (row, want) in outs.iter().zip(&per_side) {
            let got = dev
                .read_table(&HostSync::acquire("test"), row.out, 0, width)
                .unwrap();
            assert_eq!(&got, want, "{layout:?}/{ps} {:?} fused", row.side);
        }
        // SWA of the window-evicted page reads as the sink; FULL still translates.
        assert_eq!(pool.kernel_id(Side::Swa, row[0]), 0);
        assert_ne!(pool.kernel_id(Side::Full, row[0]), 0);
        assert_clean(&pool);
    });
}

trait TableForTest {
    fn alloc_table_for_test(&self, values: &[i32]) -> unikv_kernels::TableId;
}
impl TableForTest for unikv_kernels::SyncLedger {
    fn alloc_table_for_test(&self, values: &[i32]) -> unikv_kernels::TableId {
        use unikv_kernels::Device;
        let t = self.alloc_table(values.len(), 0).unwrap();
        self.upload_table(t, 0, values).unwrap();
        t
    }
}

// 8. Set-shaped free of one request out of three.
#[test]
fn s08_set_shaped_free() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let a = new_row(&mut pool, 2 * psz + 1);
        let b = new_row(&mut pool, 3 * psz);
        let c = new_row(&mut pool, psz);
        let mut ids: Vec<VirtualToken> = b.iter().rev().copied().collect();
        ids.extend_from_slice(&b[..psz]); // several per page, repeated, unordered
        pool.free(&ids).unwrap();
        assert_eq!(allocated(&pool), (4, 4));
        // Freed virtual pages are the next handed out.
        let again = new_row(&mut pool, 3 * psz);
        let mut freed = pages_of(&pool, &b);
        let mut reused = pages_of(&pool, &again);
        freed.sort();
        reused.sort();
        assert_eq!(freed, reused);
        let _ = (a, c);
        assert_clean(&pool);
    });
}

/// One virtual page as observed: id, FULL live, SWA state, FULL and SWA physical pages.
type PageView = (u32, bool, SwaState, Option<u32>, Option<u32>);

/// Everything observable of a pool's tables.
fn snapshot(pool: &Pool) -> Vec<PageView> {
    (0..pool.virtual_pages())
        .map(|v| {
            let v = VirtualPage(v);
            (
                v.0,
                pool.full_live(v),
                pool.swa_state(v),
                pool.physical_page(Side::Full, v),
                pool.physical_page(Side::Swa, v),
            )
        })
        .collect()
}

// 9. A segment free and the set-shaped free of the same slice leave identical tables.
#[test]
fn s09_segment_free_equals_set_free() {
    each_case(|layout, ps| {
        let psz = ps as usize;
        // (row length, page-aligned slices to free)
        let cases: &[(usize, &[(usize, usize)])] = &[
            (4 * psz, &[(0, 4 * psz)]),
            (5 * psz + 1, &[(psz, 3 * psz), (4 * psz, 5 * psz + 1)]),
            (3 * psz, &[(2 * psz, 2 * psz + 1)]),
        ];
        for &(len, slices) in cases {
            let mut a = pool(layout, ps, 32);
            let mut b = pool(layout, ps, 32);
            let ra = new_row(&mut a, len);
            let rb = new_row(&mut b, len);
            assert_eq!(ra, rb);
            for &(s, e) in slices {
                a.free_segment(Segment::of_row(&ra, s..e)).unwrap();
                b.free(&rb[s..e]).unwrap();
            }
            assert_eq!(snapshot(&a), snapshot(&b), "{layout:?}/{ps}");
            assert_eq!(a.capacity(), b.capacity());
            assert_clean(&a);
            assert_clean(&b);
        }
    });
}

// 10. A segment of k pages and r tokens frees k + 1 pages.
#[test]
fn s10_trailing_partial_page_is_released_whole() {
    each_case(|layout, ps| {
        let psz = ps as usize;
        for (k, r) in [(0, 1), (2, 1), (3, psz - 1), (1, 0)] {
            let mut pool = pool(layout, ps, 32);
            let row = new_row(&mut pool, 5 * psz);
            if r >= psz {
                continue;
            }
            pool.free_segment(Segment::of_row(&row, 0..k * psz + r))
                .unwrap();
            let freed = k + (r > 0) as usize;
            assert_eq!(
                allocated(&pool),
                (5 - freed, 5 - freed),
                "{layout:?}/{ps} k={k} r={r}"
            );
            assert_clean(&pool);
        }
    });
}

// 11. Two segments touching one page are refused, and nothing is freed.
#[test]
fn s11_segments_sharing_a_page_are_refused() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let row = new_row(&mut pool, 4 * psz);
        let before = pool.capacity();
        // (segments) that share a page or go backwards
        let bad: Vec<Vec<std::ops::Range<usize>>> = vec![
            vec![0..psz + 1, psz..2 * psz],
            vec![2 * psz..3 * psz, 0..psz],
            vec![0..psz, psz..2 * psz, psz..3 * psz],
        ];
        for ranges in bad {
            if ps == 1 && ranges[0] == (0..2) {
                continue;
            }
            let segs: Vec<Segment> = ranges
                .iter()
                .map(|r| Segment::of_row(&row, r.clone()))
                .collect();
            let err = pool.free_segments(&segs).unwrap_err();
            assert!(matches!(err, Error::SegmentsShareAPage { .. }), "{err}");
            assert_eq!(pool.capacity(), before);
        }
        // Disjoint segments are fine.
        let segs = [
            Segment::of_row(&row, 0..psz),
            Segment::of_row(&row, 2 * psz..4 * psz),
        ];
        pool.free_segments(&segs).unwrap();
        assert_eq!(allocated(&pool), (1, 1));
        assert_clean(&pool);
    });
}

// 12. A double free (lazy) is reported and never lists a page twice.
#[test]
fn s12_double_free_is_reported_not_duplicated() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let row = new_row(&mut pool, 2 * psz);
        pool.free_segment(Segment::of_row(&row, 0..2 * psz))
            .unwrap();
        let before = pool.capacity();
        let (n, ()) = breaches(&mut pool, &DOUBLE_FREE, Level::Warn, |pool| {
            pool.free_segment(Segment::of_row(&row, 0..2 * psz))
                .unwrap();
        });
        assert_eq!(n, 2, "{layout:?}/{ps}");
        assert_eq!(pool.capacity(), before);
        unikv_invariants::scoped_level(Level::Warn, || pool.invariant_scope().poll().unwrap());
        pool.verify().unwrap();
        // Every page can be handed out exactly once more.
        let rows: Vec<_> = (0..2).map(|_| new_row(&mut pool, psz)).collect();
        assert_ne!(rows[0], rows[1]);
        assert_clean(&pool);
    });
}

// 13. Tombstone: free_swa keeps FULL and the virtual id; a later two-sided free releases
// FULL only.
#[test]
fn s13_tombstone() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let row = new_row(&mut pool, 3 * psz);
        let before = pool.capacity();
        pool.free_swa(&row[..2 * psz]).unwrap();
        for v in pages_of(&pool, &row[..2 * psz]) {
            assert_eq!(pool.swa_state(v), SwaState::Tombstone);
            assert!(pool.full_live(v));
        }
        assert_eq!(allocated(&pool), (3, 1));
        let c = pool.capacity();
        assert_eq!(c.swa.tombstones, 2);
        assert_eq!(
            c.swa.available_pages,
            before.swa.available_pages + 2,
            "{layout:?}/{ps}: the SWA pages came back"
        );
        assert_eq!(
            c.full.available_pages, before.full.available_pages,
            "{layout:?}/{ps}: no FULL page did"
        );
        assert!(c.joint_available_pages >= before.joint_available_pages);
        pool.free(&row).unwrap();
        assert_eq!(allocated(&pool), (0, 0));
        assert_eq!(pool.capacity().swa.tombstones, 0);
        assert_clean(&pool);
    });
}

// 14. The FULL-only contract: reported with SWA bound, clean after free_swa.
#[test]
fn s14_full_only_contract() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let row = new_row(&mut pool, 2 * psz);
        let (n, ()) = breaches(&mut pool, &PEER_RELEASED, Level::Warn, |pool| {
            pool.free_full(&row[..psz]).unwrap()
        });
        assert_eq!(n, 1);
        scoped_level(Level::Warn, || pool.invariant_scope().poll().unwrap());
        pool.free_swa(&row[psz..]).unwrap();
        let swa = allocated(&pool).1;
        let (n, ()) = breaches(&mut pool, &PEER_RELEASED, Level::Warn, |pool| {
            pool.free_full(&row[psz..]).unwrap()
        });
        assert_eq!(n, 0);
        assert_eq!(allocated(&pool), (0, swa));
        assert_clean(&pool);
    });
}

// 15. The sink is never freed: padded rows (token 0) in a FULL-only or two-sided free.
#[test]
fn s15_sink_never_freed() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let mut row = vec![VirtualToken(0); psz]; // a padded first page
        let tail = new_row(&mut pool, 2 * psz);
        row.extend_from_slice(&tail);
        let (n, ()) = breaches(&mut pool, &SINK_RESERVED, Level::Warn, |pool| {
            pool.free_swa_segment(Segment::of_row(&row, 0..2 * psz))
                .unwrap();
            pool.free_kv_row_segments(&row, 0, 2 * psz, row.len())
                .unwrap();
        });
        assert_eq!(n, 2);
        scoped_level(Level::Warn, || pool.invariant_scope().poll().unwrap());
        let c = pool.capacity();
        assert_eq!(allocated(&pool), (0, 0));
        assert!(
            c.full.available_pages <= c.full.total_pages
                && c.swa.available_pages <= c.swa.total_pages
        );
        assert_eq!(pool.physical_page(Side::Full, VirtualPage::SINK), None);
        // Handing out everything never returns the sink.
        let mut all = Vec::new();
        let mut row = Vec::new();
        while try_extend(&mut pool, &mut row, psz).is_ok() {
            all.append(&mut row);
        }
        assert!(all.iter().all(|t| t.0 >= ps));
        assert_clean(&pool);
    });
}

// 16. Deferral: no capacity view moves inside a group; frees apply once at the end;
// the ids are cloned at enqueue.
#[test]
fn s16_group_defers_and_clones_at_enqueue() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let a = new_row(&mut pool, 2 * psz);
        let b = new_row(&mut pool, 2 * psz);
        let before = pool.capacity();
        pool.free_group_begin().unwrap();
        let mut ids = a.clone();
        pool.free(&ids).unwrap();
        ids.copy_from_slice(&b); // the caller reuses its buffer after the call
        pool.free_segment(Segment::of_row(&a, 0..0)).unwrap();
        assert_eq!(pool.capacity(), before, "deferred: no view changes");
        pool.free_group_end().unwrap();
        assert_eq!(allocated(&pool), (2, 2));
        for v in pages_of(&pool, &b) {
            assert!(pool.full_live(v), "b was not freed");
        }
        for v in pages_of(&pool, &a) {
            assert!(!pool.full_live(v), "a was freed once");
        }
        assert_clean(&pool);
    });
}

// 17. Ownership moves by rebinding (tombstone recovery under a locked FULL): no SWA page
// allocated or freed; a FULL-only free of the donor in the same group leaves the
// recovered node's SWA alone. Bad transfers are refused with no change.
#[test]
fn s17_swa_ownership_transfer_in_a_group() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let psz = ps as usize;
        let node = new_row(&mut pool, 2 * psz);
        pool.free_swa_segment(Segment::of_row(&node, 0..2 * psz))
            .unwrap(); // tombstoned
        let incoming = new_row(&mut pool, 2 * psz);
        let swa_pages: Vec<_> = pages_of(&pool, &incoming)
            .into_iter()
            .map(|v| pool.physical_page(Side::Swa, v).unwrap())
            .collect();
        let before = pool.capacity();
        // Refused: source tombstoned, target live, different lengths.
        for (from, to) in [(&node, &incoming), (&incoming, &incoming)] {
            let err = pool.transfer_swa(
                Segment::of_row(from, 0..2 * psz),
                Segment::of_row(to, 0..2 * psz),
            );
            assert!(matches!(err, Err(Error::BadTransfer { .. })));
            assert_eq!(pool.capacity(), before);
        }
        pool.free_group_begin().unwrap();
        pool.transfer_swa(
            Segment::of_row(&incoming, 0..2 * psz),
            Segment::of_row(&node, 0..2 * psz),
        )
        .unwrap();
        pool.free_full_segment(Segment::of_row(&incoming, 0..2 * psz))
            .unwrap();
        pool.free_group_end().unwrap();
        let after = pool.capacity();
        assert_eq!(
            after.swa.allocated_pages, before.swa.allocated_pages,
            "no SWA page allocated or freed"
        );
        assert_eq!(after.full.allocated_pages, before.full.allocated_pages - 2);
        let got: Vec<_> = pages_of(&pool, &node)
            .into_iter()
            .map(|v| pool.physical_page(Side::Swa, v).unwrap())
            .collect();
        assert_eq!(got, swa_pages, "the node owns the incoming SWA pages");
        assert_clean(&pool);
    });
}

// 18. Nested begin rejected; end without begin rejected; both change nothing.
#[test]
fn s18_groups_do_not_nest() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 32);
        let row = new_row(&mut pool, ps as usize);
        assert!(matches!(pool.free_group_end(), Err(Error::NoFreeGroup)));
        pool.free_group_begin().unwrap();
        pool.free(&row).unwrap();
        assert!(matches!(
            pool.free_group_begin(),
            Err(Error::NestedFreeGroup)
        ));
        assert!(pool.in_free_group());
        assert_eq!(
            pool.pending_frees()[0].1,
            row.len(),
            "the pending free survived"
        );
        pool.free_group_end().unwrap();
        assert_eq!(allocated(&pool), (0, 0));
        assert_clean(&pool);
    });
}

// 19. A flush exposes each list's frees and keeps the group open — separately and all at
// once.
#[test]
fn s19_flush_keeps_the_group_open() {
    each_case(|layout, ps| {
        let psz = ps as usize;
        type Queue = fn(&mut Pool, &[VirtualToken]);
        let queues: [(&str, Queue); 4] = [
            ("tokens", |p, r| p.free(r).unwrap()),
            ("page reps", |p, r| {
                p.free_segment(Segment::of_row(r, 0..r.len())).unwrap()
            }),
            ("full-only tokens", |p, r| {
                p.free_swa(r).unwrap();
                p.free_full(r).unwrap()
            }),
            ("full-only page reps", |p, r| {
                p.free_swa_segment(Segment::of_row(r, 0..r.len())).unwrap();
                p.free_full_segment(Segment::of_row(r, 0..r.len())).unwrap()
            }),
        ];
        for only in 0..=queues.len() {
            let mut pool = pool(layout, ps, 32);
            let rows: Vec<_> = (0..4).map(|_| new_row(&mut pool, 2 * psz)).collect();
            pool.free_group_begin().unwrap();
            let mut expected_full = 8;
            for (i, (name, q)) in queues.iter().enumerate() {
                if only == queues.len() || only == i {
                    q(&mut pool, &rows[i]);
                    expected_full -= 2;
                    let _ = name;
                }
            }
            assert!(pool.flush_deferred());
            assert!(pool.in_free_group(), "{layout:?}/{ps}: still open");
            assert_eq!(allocated(&pool).0, expected_full);
            assert!(pool.allocation_fits(PageDemand::joint(8 - expected_full)));
            assert!(!pool.flush_deferred(), "nothing left");
            pool.free_group_end().unwrap();
            assert_clean(&pool);
        }
    });
}

// Shortfall: a failing alloc changes nothing and leaves `out` untouched.
#[test]
fn out_of_capacity_changes_nothing() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 16);
        let psz = ps as usize;
        let row = new_row(&mut pool, 10 * psz);
        pool.free_segment(Segment::of_row(&row, 0..2 * psz))
            .unwrap(); // holes
        let before = (pool.capacity(), snapshot(&pool));
        let mut out = vec![VirtualToken(7)];
        let req = ExtendRequest {
            prefix_len: 0,
            seq_len: 100 * psz,
            last_token: None,
        };
        assert!(matches!(
            pool.alloc_extend(&[req], &mut out),
            Err(Error::OutOfCapacity { .. })
        ));
        assert_eq!(out, vec![VirtualToken(7)]);
        assert_eq!((pool.capacity(), snapshot(&pool)), before);
        // Bad requests are refused the same way.
        let bad = ExtendRequest {
            prefix_len: 1,
            seq_len: 2,
            last_token: None,
        };
        if ps > 1 {
            assert!(matches!(
                pool.alloc_extend(&[bad], &mut out),
                Err(Error::BadRequest { .. })
            ));
        }
        assert_eq!((pool.capacity(), snapshot(&pool)), before);
        assert_clean(&pool);
    });
}

/// Compaction moves envelopes with their bytes: tag every live page, free every other
/// row, flush, and read each tag back through the new translation.
#[test]
fn compaction_moves_page_contents_with_the_translation() {
    for ps in unikv_invariants::testing::page_sizes() {
        let mut pool = pool(Layout::Unified, ps, 32);
        let psz = ps as usize;
        let rows: Vec<_> = (0..8)
            .map(|i| new_row(&mut pool, (1 + i % 3) * psz))
            .collect();
        let tag =
            |v: VirtualPage, side: Side| (v.0 as u8).wrapping_mul(2).wrapping_add(side as u8 + 1);
        let buf = pool.buffer();
        let dev = pool.ledger.clone();
        let write = |pool: &Pool| {
            for v in 1..pool.virtual_pages() {
                for side in [Side::Full, Side::Swa] {
                    if let Some(p) = pool.physical_page(side, VirtualPage(v)) {
                        let env = pool.grid(side).envelope;
                        let span = unikv_kernels::ByteSpan {
                            offset: p as u64 * env,
                            len: env,
                        };
                        unikv_kernels::Device::fill_spans(
                            &*dev,
                            buf,
                            &[span],
                            tag(VirtualPage(v), side),
                        )
                        .unwrap();
                    }
                }
            }
        };
        write(&pool);
        for row in rows.iter().step_by(2) {
            pool.free_segment(Segment::of_row(row, 0..row.len()))
                .unwrap();
        }
        let (lo, hi) = (
            pool.capacity().full.hole_pages,
            pool.capacity().swa.hole_pages,
        );
        assert!(lo > 0 && hi > 0);
        let report = pool.flush().unwrap();
        assert!(report.pages_moved > 0, "ps {ps}: {report:?}");
        let c = pool.capacity();
        assert_eq!((c.full.hole_pages, c.swa.hole_pages), (0, 0));
        for row in rows.iter().skip(1).step_by(2) {
            for v in pages_of(&pool, row) {
                for side in [Side::Full, Side::Swa] {
                    let p = pool.physical_page(side, v).unwrap();
                    let env = pool.grid(side).envelope;
                    let bytes = dev
                        .read_bytes(&HostSync::acquire("test"), buf, p as u64 * env, env)
                        .unwrap();
                    assert!(
                        bytes.iter().all(|&b| b == tag(v, side)),
                        "ps {ps}: {v} {side:?} moved without its bytes"
                    );
                }
            }
        }
        assert_envelopes_disjoint(&pool);
        assert_clean(&pool);
    }
}

/// A move gate freezes compaction on both sides; capacity views stop crediting holes.
#[test]
fn a_move_gate_freezes_compaction() {
    for ps in unikv_invariants::testing::page_sizes() {
        let mut pool = pool(Layout::Unified, ps, 16);
        let psz = ps as usize;
        let a = new_row(&mut pool, 4 * psz);
        let _b = new_row(&mut pool, 4 * psz);
        pool.free_segment(Segment::of_row(&a, 0..4 * psz)).unwrap();
        let gate = pool.move_gate();
        let c = pool.capacity();
        assert_eq!(c.joint_schedulable_pages, c.joint_available_pages);
        let report = pool.flush().unwrap();
        assert!(report.gated && report.pages_moved == 0);
        assert_eq!(pool.capacity().full.hole_pages, 4);
        drop(gate);
        assert!(pool.capacity().joint_schedulable_pages >= c.joint_available_pages);
        let report = pool.flush().unwrap();
        assert!(
            !report.gated && report.pages_moved == 8,
            "4 per side, ps {ps}: {report:?}"
        );
        assert_clean(&pool);
    }
}

/// Envelopes are zeroed when handed out (configured on in the test pools): a page
/// written, freed and handed out again reads back as zeros, on both sides.
#[test]
fn handed_out_pages_are_zeroed() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 16);
        let psz = ps as usize;
        let row = new_row(&mut pool, 2 * psz);
        let (buf, dev) = (pool.buffer(), pool.ledger.clone());
        let envelopes = |pool: &Pool, row: &[VirtualToken]| {
            let mut spans = Vec::new();
            for v in pages_of(pool, row) {
                for side in [Side::Full, Side::Swa] {
                    let p = pool.physical_page(side, v).unwrap();
                    let env = pool.grid(side).envelope;
                    spans.push(unikv_kernels::ByteSpan {
                        offset: p as u64 * env,
                        len: env,
                    });
                }
            }
            spans
        };
        let spans = envelopes(&pool, &row);
        unikv_kernels::Device::fill_spans(&*dev, buf, &spans, 0xAB).unwrap();
        pool.free_segment(Segment::of_row(&row, 0..row.len()))
            .unwrap();
        let again = new_row(&mut pool, 2 * psz);
        let spans = envelopes(&pool, &again);
        for s in &spans {
            let bytes = dev
                .read_bytes(&HostSync::acquire("test"), buf, s.offset, s.len)
                .unwrap();
            assert!(
                bytes.iter().all(|&b| b == 0),
                "{layout:?}/{ps}: a handed-out envelope is not zeroed"
            );
        }
        assert_clean(&pool);
    });
}

/// The pool map of both layouts after a small workload (page size 4, so the snapshot
/// does not depend on the matrix cell): FULL at the top and SWA above the sink floor in
/// the unified buffer, two fixed regions in the static one.
#[test]
fn the_pool_map_shows_where_each_side_lives() {
    let mut text = String::new();
    for layout in LAYOUTS {
        let mut pool = pool(layout, 4, 16);
        let a = new_row(&mut pool, 10);
        let _b = new_row(&mut pool, 7);
        pool.free_swa_segment(Segment::of_row(&a, 0..4)).unwrap();
        text.push_str(&pool.pool_map().to_string());
    }
    insta::assert_snapshot!(text);
}

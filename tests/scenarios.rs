//! Scenarios 20–23 and 30–31 of the reference list (`sglang-unified-memory.md` §7),
//! through the facade: the window cursor (ratchet, protected floor, finish split, last
//! leaf at page size > window) and capacity accounting (joint versus per-side fits,
//! reclaim minimality). Each runs for both layouts at every page size of the matrix cell.

mod common;

use common::*;
use unikv::pools::{PageDemand, SwaState};
use unikv::{Error, Layout, Request, TokenId};

const W: u32 = 8;

/// The live-SWA band of scenario 20 for one request: rows `[cursor, len)` hold SWA, and
/// there are between `max(W, ps)` (or the whole row, when shorter) and
/// `max(W, ps) + ps + interval` of them.
fn assert_band(fx: &Fixture, req: &Request) {
    let (len, cursor) = (req.len(), req.window_cursor());
    let live = len - cursor;
    let keep = fx.keep();
    assert!(
        live >= keep.min(len),
        "{}: {live} live SWA rows < {keep} at len {len}",
        fx.label
    );
    assert!(
        live <= keep + fx.ps + fx.interval,
        "{}: {live} live SWA rows > {keep} + {} + {} at len {len}",
        fx.label,
        fx.ps,
        fx.interval
    );
}

/// Scenario 20: decode a request far past the window. At every step the cursor only
/// moves up, in whole pages; the live SWA rows stay inside the band; every row below the
/// cursor is a tombstone and every in-window row's SWA is bound.
#[test]
fn s20_ratchet_keeps_the_window_live_and_only_moves_up_in_pages() {
    for_each_layout_and_page_size(|layout, ps| {
        let ps = ps as usize;
        for interval in [None, Some(3 * ps as u32 + 1)] {
            let keep = (W as usize).max(ps);
            let prompt_len = keep + 2 * ps + 1;
            let decode = 3 * keep + 2 * ps + interval.map_or(ps, |i| i as usize);
            let total = prompt_len + decode;
            let mut config = Config::tokens(layout, ps as u32, W, total as u64 + 4 * ps as u64, 4);
            config.interval = interval;
            let mut fx = Fixture::new(&config);

            let mut req = fx.admit(text(0, prompt_len));
            fx.prefill(&mut req, ps.max(3));
            let mut cursors = vec![req.window_cursor()];
            for t in 0..decode {
                fx.cache
                    .alloc_decode(&mut [&mut req], &[TokenId(50_000 + t as u32)])
                    .unwrap();
                fx.step();
                let cursor = req.window_cursor();
                let previous = *cursors.last().unwrap();
                assert!(
                    cursor >= previous,
                    "{}: cursor moved down {previous} -> {cursor}",
                    fx.label
                );
                assert_eq!(
                    cursor % ps,
                    0,
                    "{}: cursor {cursor} not page-aligned",
                    fx.label
                );
                if cursor != previous {
                    cursors.push(cursor);
                }
                fx.check_request(&req);
                assert_band(&fx, &req);
                fx.check_accounting(&[&req]);
                let cap = fx.cache.allocator().capacity();
                assert_eq!(
                    cap.swa.tombstones,
                    cursor / ps,
                    "{}: tombstones = pages below the cursor",
                    fx.label
                );
            }
            assert!(
                cursors.len() >= 3,
                "{}: the cursor barely moved: {cursors:?}",
                fx.label
            );
            assert!(req.window_cursor() + keep + fx.ps + fx.interval >= req.len());
            fx.teardown(vec![req]);
        }
    });
}

/// Scenario 21: a request whose prefix `[0, P)` the tree owns never releases SWA below
/// `P`, even once its window has moved far past `P`; the tree's copy stays live.
#[test]
fn s21_window_eviction_never_frees_the_tree_owned_prefix() {
    for_each_layout_and_page_size(|layout, ps| {
        let ps = ps as usize;
        let keep = (W as usize).max(ps);
        let p = 2 * keep + ps;
        let decode = 3 * keep + ps;
        let config = Config::tokens(layout, ps as u32, W, (2 * p + decode + 8 * ps) as u64, 6);
        let mut fx = Fixture::new(&config);

        // A caches the prefix P (prefilled in one chunk: its SWA is all live).
        let prefix = text(0, p);
        let mut a = fx.admit(prefix.clone());
        fx.prefill(&mut a, p);
        fx.cache.cache_finished(a).unwrap();
        fx.step();

        // B reuses it.
        let mut b = fx.admit(concat(&prefix, &text(70_000, 2 * ps + 1)));
        assert_eq!(b.cached_at_admission(), p, "{}", fx.label);
        assert_eq!(b.protected_len(), p);
        let tree_rows: Vec<_> = b.row()[..p].to_vec();
        fx.prefill(&mut b, ps);
        for t in 0..decode {
            fx.cache
                .alloc_decode(&mut [&mut b], &[TokenId(80_000 + t as u32)])
                .unwrap();
            fx.step();
            fx.check_request(&b);
            fx.check_accounting(&[&b]);
            assert!(
                b.window_cursor() >= p,
                "{}: cursor {} below P = {p}",
                fx.label,
                b.window_cursor()
            );
            for (i, &t) in tree_rows.iter().enumerate() {
                assert_eq!(
                    fx.swa_state(t),
                    SwaState::Live,
                    "{}: tree row {i} lost its SWA at len {}",
                    fx.label,
                    b.len()
                );
            }
        }
        assert!(
            b.window_cursor() > p && b.len() - keep > p,
            "{}: the window never left P",
            fx.label
        );
        fx.cache.release(b).unwrap();
        fx.step();
        // The tree still holds P whole and live: the next request hits all of it.
        let again = fx.cache.match_prefix(follow_up(&prefix));
        assert_eq!(again.cached_tokens(), p, "{}", fx.label);
        drop(again);
        assert!(
            fx.cache.tree().nodes().iter().skip(1).all(|n| n.swa_live),
            "{}",
            fx.label
        );
        fx.teardown(vec![]);
    });
}

/// Decodes `req` until its cursor has moved and its length ends mid-page (or `min_len`).
fn decode_past_window(fx: &mut Fixture, req: &mut Request, min_len: usize, token: u32) {
    let mut t = token;
    while req.window_cursor() <= req.protected_len()
        || req.len() < min_len
        || req.len().is_multiple_of(fx.ps) && fx.ps > 1
    {
        fx.cache
            .alloc_decode(&mut [&mut *req], &[TokenId(t)])
            .unwrap();
        t += 1;
        fx.step();
        fx.check_request(req);
    }
}

/// Scenario 22: releasing a request with cursor `C` frees `[dead_lo, C)` FULL-only and
/// `[C, len)` on both sides; finishing frees its duplicates and its partial page. Both
/// sides' counts match exactly afterwards.
#[test]
fn s22_finish_and_release_split_at_the_cursor_and_leave_exact_counts() {
    for_each_layout_and_page_size(|layout, ps| {
        let ps = ps as usize;
        let keep = (W as usize).max(ps);
        let config = Config::tokens(layout, ps as u32, W, (12 * keep + 8 * ps) as u64, 8);
        let mut fx = Fixture::new(&config);

        // Release (abort) with the cursor past 0 and a partial last page.
        let mut r = fx.admit(text(0, keep + ps + 1));
        fx.prefill(&mut r, ps);
        decode_past_window(&mut fx, &mut r, 0, 1_000);
        let (len, cursor) = (r.len(), r.window_cursor());
        let cap = fx.cache.allocator().capacity();
        assert_eq!(cap.full.allocated_pages, len.div_ceil(ps), "{}", fx.label);
        assert_eq!(
            cap.swa.allocated_pages,
            len.div_ceil(ps) - cursor / ps,
            "{}",
            fx.label
        );
        assert_eq!(cap.swa.tombstones, cursor / ps, "{}", fx.label);
        fx.cache.release(r).unwrap();
        fx.step();
        fx.assert_empty_allocator();

        // Finish with the cursor past 0: the tree takes the whole pages (a tombstone part
        // below the cursor, live above it); the partial page is freed on both sides.
        let mut r = fx.admit(text(0, keep + ps + 1));
        fx.prefill(&mut r, ps);
        decode_past_window(&mut fx, &mut r, 0, 1_000);
        let (len, cursor) = (r.len(), r.window_cursor());
        let key_len = fx.floor(len);
        let tokens = r.tokens().to_vec();
        fx.cache.cache_finished(r).unwrap();
        fx.step();
        fx.check_accounting(&[]);
        let cap = fx.cache.allocator().capacity();
        assert_eq!(
            cap.full.allocated_pages,
            key_len / ps,
            "{}: FULL after finish",
            fx.label
        );
        assert_eq!(
            cap.swa.allocated_pages,
            (key_len - cursor) / ps,
            "{}: SWA after finish",
            fx.label
        );
        assert_eq!(
            cap.swa.tombstones,
            cursor / ps,
            "{}: tombstones after finish",
            fx.label
        );

        // A second request reuses it (protected P = key_len), decodes past its window and
        // is released: [P, C2) FULL-only, [C2, len) two-sided; the tree is untouched.
        let mut r2 = fx.admit(concat(&tokens, &text(90_000, ps + 1)));
        assert_eq!(
            r2.protected_len(),
            key_len,
            "{}: the finished request is a hit",
            fx.label
        );
        fx.prefill(&mut r2, ps);
        decode_past_window(&mut fx, &mut r2, key_len + 2 * keep + ps, 2_000);
        assert!(r2.window_cursor() > key_len, "{}", fx.label);
        fx.check_accounting(&[&r2]);
        fx.cache.release(r2).unwrap();
        fx.step();
        fx.check_accounting(&[]);
        let cap = fx.cache.allocator().capacity();
        assert_eq!(
            cap.full.allocated_pages,
            key_len / ps,
            "{}: FULL after release",
            fx.label
        );
        assert_eq!(
            cap.swa.allocated_pages,
            (key_len - cursor) / ps,
            "{}: SWA after release",
            fx.label
        );
        assert_eq!(
            cap.swa.tombstones,
            cursor / ps,
            "{}: tombstones after release",
            fx.label
        );
        fx.teardown(vec![]);
    });
}

/// Scenario 23: with the window smaller than a page (W = 4, ps = 16 and up), the last
/// inserted leaf keeps live SWA after window eviction, so the finished request is a hit:
/// the cursor keeps `max(W, ps)` behind the length, not `W`.
#[test]
fn s23_last_inserted_leaf_keeps_live_swa_when_pages_outgrow_the_window() {
    const SMALL_W: u32 = 4;
    let mut sizes = page_sizes();
    if !sizes.contains(&16) {
        sizes.push(16);
    }
    for layout in LAYOUTS {
        for &ps in &sizes {
            let ps = ps as usize;
            let keep = (SMALL_W as usize).max(ps);
            // The final length sits `W + 1` past a page boundary: keeping only `W` rows
            // would put the cursor on the last whole page and leave an all-tombstone leaf.
            let len = 4 * keep + (SMALL_W as usize + 1) % ps;
            let config = Config::tokens(layout, ps as u32, SMALL_W, (2 * len + 4 * ps) as u64, 6);
            let mut fx = Fixture::new(&config);
            let mut r = fx.admit(text(0, 2 * ps + 1));
            fx.prefill(&mut r, ps);
            let decode = len - r.len();
            fx.decode(&mut r, decode, 5_000);
            fx.cache.release_out_of_window(&mut r).unwrap();
            assert!(
                r.window_cursor() > 0,
                "{}: no window eviction happened",
                fx.label
            );
            fx.check_request(&r);
            let tokens = r.tokens().to_vec();
            fx.cache.cache_unfinished(&mut r).unwrap();
            fx.step();
            fx.check_request(&r);
            fx.check_accounting(&[&r]);
            fx.cache.cache_finished(r).unwrap();
            fx.step();
            let key_len = fx.floor(len);
            let tree = fx.cache.tree();
            let leaf = tree
                .nodes()
                .into_iter()
                .find(|n| n.children == 0 && n.id != tree.root())
                .expect("a leaf");
            assert_eq!(
                leaf.start.0 + leaf.key.len(),
                key_len,
                "{}: the leaf ends at the last whole page",
                fx.label
            );
            assert!(
                leaf.swa_live,
                "{}: the last leaf is all tombstone:\n{}",
                fx.label,
                tree.dump()
            );
            for &t in leaf.value {
                assert_eq!(
                    fx.swa_state(unikv::pools::VirtualToken(t.0)),
                    SwaState::Live,
                    "{}",
                    fx.label
                );
            }
            let hit = fx.cache.match_prefix(follow_up(&tokens));
            assert_eq!(
                hit.cached_tokens(),
                key_len,
                "{}: the finished request is a hit",
                fx.label
            );
            drop(hit);
            fx.teardown(vec![]);
        }
    }
}

/// Fills the tree with `n` one-page prefixes (each its own leaf under the root).
fn cache_single_page_prefixes(fx: &mut Fixture, n: usize) {
    for i in 0..n {
        let mut r = fx.admit(text(100_000 * (i as u32 + 1), fx.ps));
        fx.prefill(&mut r, fx.ps);
        fx.cache.cache_finished(r).unwrap();
        fx.step();
    }
}

/// Scenario 30: per-side availability is not enough. Unified: FULL and SWA each have room
/// for 4 pages but together for 3; a 4-page request evicts until the *joint* allocation
/// fits — exactly one prefix. Static: SWA is the short side; eviction continues until it
/// fits too, and evicts no more than that.
#[test]
fn s30_eviction_continues_until_the_joint_allocation_fits_and_no_further() {
    for ps in page_sizes() {
        // Unified, symmetric pages: 12 joint pages of room, 9 cached leaves leave 6 pages'
        // bytes, i.e. 6 per side alone but 3 together.
        let mut fx = Fixture::new(&Config::new(Layout::Unified, ps, W, 12));
        cache_single_page_prefixes(&mut fx, 9);
        let cap = fx.cache.allocator().capacity();
        assert!(
            cap.full.schedulable_pages >= 4 && cap.swa.schedulable_pages >= 4,
            "{}: {cap:?}",
            fx.label
        );
        assert_eq!(cap.joint_schedulable_pages, 3, "{}: {cap:?}", fx.label);
        let mut r = fx.admit(text(1, 4 * fx.ps));
        fx.cache
            .alloc_extend(&mut r, 4 * fx.ps)
            .unwrap_or_else(|e| panic!("{}: {e}", fx.label));
        fx.step();
        let evicted = fx.cache.stats().evictions;
        assert_eq!(
            evicted.full_nodes, 1,
            "{}: one prefix makes the joint room: {evicted:?}",
            fx.label
        );
        fx.check_accounting(&[&r]);
        fx.teardown(vec![r]);

        // Static, SWA short: FULL twice as many pages as SWA, which holds a window.
        let layout = Layout::Static {
            swa_full_tokens_ratio: 0.5,
        };
        let window_pages = (W + ps).div_ceil(ps) as u64;
        let mut fx = Fixture::new(&Config::new(layout, ps, W, (2 * window_pages).max(12)));
        let (full_total, swa_total) = (
            fx.empty.full.schedulable_pages,
            fx.empty.swa.schedulable_pages,
        );
        assert!(
            swa_total >= 5 && full_total >= 2 * swa_total - 1,
            "{}: {:?}",
            fx.label,
            fx.empty
        );
        cache_single_page_prefixes(&mut fx, swa_total - 1);
        let cap = fx.cache.allocator().capacity();
        assert_eq!(cap.swa.schedulable_pages, 1, "{}", fx.label);
        assert!(cap.full.schedulable_pages >= 4, "{}", fx.label);
        let mut r = fx.admit(text(1, 4 * fx.ps));
        fx.cache
            .alloc_extend(&mut r, 4 * fx.ps)
            .unwrap_or_else(|e| panic!("{}: {e}", fx.label));
        fx.step();
        let evicted = fx.cache.stats().evictions;
        assert_eq!(
            evicted.full_nodes, 3,
            "{}: three prefixes make the SWA room: {evicted:?}",
            fx.label
        );
        fx.teardown(vec![r]);
    }
}

/// A tree with every kind of node: a prefix locked by a running request, a request's
/// prefix cached after its window moved (a tombstone parent under live nodes), and
/// one-page leaves. Returns the running request.
fn mixed_tree(fx: &mut Fixture) -> Request {
    let keep = fx.keep();
    let ps = fx.ps;
    let mut a = fx.admit(text(0, keep + ps + 1));
    fx.prefill(&mut a, ps);
    decode_past_window(fx, &mut a, 2 * keep + ps, 10_000);
    fx.cache.cache_finished(a).unwrap();
    fx.step();
    let locked_prefix = text(200_000, keep + ps);
    let mut b = fx.admit(locked_prefix.clone());
    fx.prefill(&mut b, ps);
    fx.cache.cache_unfinished(&mut b).unwrap();
    fx.step();
    cache_single_page_prefixes(fx, 3);
    b
}

/// Scenario 31: `evict_to_free` evicts nothing when even evicting every unlocked prefix
/// would not make the demand fit; when it succeeds the demand fits and allocating it
/// needs no further eviction. On one-page leaves the eviction is exactly minimal.
#[test]
fn s31_reclaim_evicts_nothing_when_impossible_and_enough_when_possible() {
    for_each_layout_and_page_size(|layout, ps| {
        let config = Config::tokens(layout, ps, W, 24 * (W as u64).max(ps as u64), 12);
        // Joint demands from 1 page up to more than the buffer holds.
        let fx = Fixture::new(&config);
        let max = fx.empty.full.total_pages + 2;
        drop(fx);
        let mut fitted = 0;
        let mut refused_from = None;
        for d in 1..=max {
            let demands = [
                PageDemand::joint(d),
                PageDemand::pages(d, 0),
                PageDemand::pages(0, d),
            ];
            for demand in demands {
                let joint = demand.full_pages == demand.swa_pages;
                let mut fx = Fixture::new(&config);
                let b = mixed_tree(&mut fx);
                let before = (
                    fx.cache.stats(),
                    fx.cache.tree().sizes(),
                    fx.cache.tree().node_count(),
                );
                match fx.cache.evict_to_free(demand.full_pages, demand.swa_pages) {
                    Ok(()) => {
                        assert!(
                            fx.cache.allocator().allocation_fits(demand),
                            "{}: {demand:?} does not fit",
                            fx.label
                        );
                        if joint {
                            assert_eq!(
                                refused_from, None,
                                "{}: {d} fits after a smaller joint demand was refused",
                                fx.label
                            );
                            fitted = d;
                            // Allocating it needs no further eviction.
                            let evictions = fx.cache.stats().evictions;
                            let mut r = fx.admit(text(7, d * fx.ps));
                            fx.cache.alloc_extend(&mut r, d * fx.ps).unwrap();
                            assert_eq!(
                                fx.cache.stats().evictions,
                                evictions,
                                "{}: {demand:?}",
                                fx.label
                            );
                            fx.step();
                            fx.check_accounting(&[&b, &r]);
                            fx.cache.release(r).unwrap();
                        }
                    }
                    Err(Error::OutOfMemory { .. }) => {
                        let after = (
                            fx.cache.stats(),
                            fx.cache.tree().sizes(),
                            fx.cache.tree().node_count(),
                        );
                        assert_eq!(
                            after, before,
                            "{}: a refused {demand:?} evicted something",
                            fx.label
                        );
                        if joint {
                            refused_from.get_or_insert(d);
                        }
                    }
                    Err(e) => panic!("{}: {demand:?}: {e}", fx.label),
                }
                fx.step();
                fx.teardown(vec![b]);
            }
        }
        assert!(fitted > 1, "{layout:?} ps {ps}: no demand fitted");
    });
}

/// Scenario 31, minimality: on one-page leaves, a joint demand of `k` pages past what is
/// free evicts exactly the prefixes it needs.
#[test]
fn s31_reclaim_on_one_page_leaves_is_exactly_minimal() {
    for_each_layout_and_page_size(|layout, ps| {
        for extra in 1..=4 {
            let mut fx = Fixture::new(&Config::new(layout, ps, W, 12));
            cache_single_page_prefixes(&mut fx, 9);
            let cap = fx.cache.allocator().capacity();
            let free = cap.joint_schedulable_pages;
            fx.cache.evict_to_free(free + extra, free + extra).unwrap();
            fx.step();
            let evicted = fx.cache.stats().evictions;
            // Unified: a leaf frees one FULL and one SWA page, one joint page. Static: one
            // page of each pool.
            let needed = match layout {
                Layout::Unified => extra,
                Layout::Static { .. } => (free + extra)
                    .saturating_sub(cap.full.schedulable_pages.min(cap.swa.schedulable_pages)),
            };
            assert_eq!(
                evicted.full_nodes as usize, needed,
                "{}: +{extra}: {evicted:?}",
                fx.label
            );
            fx.teardown(vec![]);
        }
    });
}

//! The sub-allocator's unit tests: accounting and the full scan, compaction and relays
//! against their plans, and the batch passes against the page-by-page calls.

use super::*;
use crate::ramp::RUN;
use crate::virtual_ids::VirtualIds;
use unikv_kernels::SpanMove;

fn grid() -> Grid {
    Grid {
        envelope: 8,
        pages: 32,
        min_page: 2,
        stride: 4,
    }
}

/// Binds virtual pages 1..=n, frees those in `freed`, compacts; checks the moves are
/// disjoint whole envelopes and the span is packed.
fn compact_case(grow: Grow, n: u32, freed: &[u32]) {
    // Rows longer than a batch pass's [`RUN`] need a bigger grid.
    let g = if n > 30 {
        Grid {
            pages: 128,
            ..grid()
        }
    } else {
        grid()
    };
    let mut sub = SubAllocator::new(g, grow, 256);
    for v in 1..=n {
        let p = sub.take();
        sub.bind(v, p);
    }
    for &v in freed {
        sub.unbind(v, false);
    }
    sub.verify("sub").unwrap();
    let mut mirror = sub.v2p.clone();
    sub.clear_dirty();
    // Planning changes nothing; the envelopes predicted after the planned compaction
    // are the ones the binds take once it commits.
    let before = state(&sub);
    let (mut moves, mut plan) = (Vec::new(), CompactionPlan::default());
    sub.plan_compaction(Edge::Low, &mut moves, &mut plan);
    assert_eq!(state(&sub), before, "{grow:?}: planning changed the tables");
    // The pairs: the band's survivors in page order, each into the next hole of the
    // packed span, lowest first.
    let h = sub.holes.len() as u32;
    let (packed, band) = match sub.compaction_edge(Edge::Low) {
        Edge::Low => (sub.lo..sub.hi - h, sub.hi - h..sub.hi),
        Edge::High => (sub.lo + h..sub.hi, sub.lo..sub.lo + h),
    };
    let mut inner: Vec<u32> = sub
        .holes
        .iter()
        .copied()
        .filter(|p| packed.contains(p))
        .collect();
    inner.sort_unstable();
    let survivors = band.filter(|&p| sub.owner(p) != 0);
    let want: Vec<(u32, u32)> = survivors.zip(inner).collect();
    assert_eq!(plan.pairs, want, "{grow:?}");
    let mut predicted = Vec::new();
    let room = (sub.grid.pages - sub.grid.min_page - sub.live).min(3) as usize;
    sub.handout_envelopes(
        room,
        plan.view().unwrap_or(sub.view()),
        sub.growth_edge(),
        &mut predicted,
    );
    let mut committed = sub.clone();
    committed.commit_compaction(&plan);
    let taken: Vec<ByteSpan> = (0..room)
        .map(|i| {
            let p = committed.take();
            committed.bind(250 - i as u32, p);
            committed.envelope(p)
        })
        .collect();
    assert_eq!(predicted, taken, "{grow:?}");
    moves.clear();
    let moved = sub.compact(&mut moves);
    assert_eq!(moved, plan.pairs.len());
    sub.verify("sub").unwrap();
    upload(&mut sub, &mut mirror); // every rebound entry is dirty
    assert!(sub.holes.is_empty());
    assert_eq!(sub.span_pages(), n - freed.len() as u32);
    // The moves are the planned pairs' envelopes, abutting ones merged into one copy.
    let envelopes: Vec<(u64, u64)> = moves
        .iter()
        .flat_map(|m| (0..m.len / 8).map(move |k| (m.src + 8 * k, m.dst + 8 * k)))
        .collect();
    let pairs: Vec<(u64, u64)> = plan
        .pairs
        .iter()
        .map(|&(s, d)| (s as u64 * 8, d as u64 * 8))
        .collect();
    assert_eq!(envelopes, pairs, "{grow:?}");
    for w in moves.windows(2) {
        let abut = w[0].src + w[0].len == w[1].src && w[0].dst + w[0].len == w[1].dst;
        assert!(!abut, "{grow:?}: {w:?} are one copy");
    }
    for m in &moves {
        assert!(m.len % 8 == 0 && m.len > 0);
        assert!(
            !envelopes
                .iter()
                .any(|&(src, _)| src >= m.dst && src < m.dst + m.len),
            "{grow:?}: a destination is also a source"
        );
    }
}

#[test]
fn compaction_packs_both_directions() {
    for grow in [Grow::Up, Grow::Down] {
        compact_case(grow, 10, &[1, 5, 10]);
        compact_case(grow, 10, &[9, 10]); // holes at the frontier: no move
        compact_case(grow, 10, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        compact_case(grow, 12, &[2, 3, 4, 8]); // a run of survivors into a run of holes
        compact_case(grow, 30, &[3, 9, 10, 11, 17, 25, 26, 29]);
        compact_case(grow, 1, &[]);
        // Rows of more than [`RUN`] survivors and holes: whole chunks, a free page
        // inside a chunk of the band, holes that do not run.
        let row: Vec<u32> = (1..=20).collect();
        compact_case(grow, 60, &row);
        compact_case(grow, 60, &[&row[..18], &[50]].concat());
        compact_case(grow, 60, &(1..=39).step_by(2).collect::<Vec<_>>());
        compact_case(
            grow,
            100,
            &[&(3..=40).collect::<Vec<_>>()[..], &[77, 95]].concat(),
        );
    }
    let mut sub = SubAllocator::new(grid(), Grow::Up, 64);
    let mut moves = Vec::new();
    assert_eq!(sub.compact(&mut moves), 0, "no holes, no moves");
}

/// The full scan names each kind of table corruption (and passes a sound table).
#[test]
fn verify_names_every_kind_of_corruption() {
    let sound = || {
        let mut sub = SubAllocator::new(grid(), Grow::Up, 16);
        for v in 1..=4 {
            let p = sub.take();
            sub.bind(v, p);
        }
        sub.unbind(2, true);
        sub
    };
    assert_eq!(sound().verify("up"), Ok(()));
    type Corrupt = fn(&mut SubAllocator);
    let cases: [(&str, Corrupt); 7] = [
        ("the sink is bound", |s| s.v2p[0] = 3),
        ("outside the span", |s| s.v2p[1] = 30),
        ("but p", |s| s.p2v[s.v2p[1] as usize] = 4),
        ("has v2p -2", |s| s.v2p[5] = -2),
        ("counters say", |s| s.tombstones += 1),
        ("listed twice", |s| {
            let h = s.holes[0];
            s.holes.push(h);
        }),
        ("is bound or outside the span", |s| {
            s.holes[0] = s.v2p[1] as u32
        }),
    ];
    for (needle, corrupt) in cases {
        let mut sub = sound();
        corrupt(&mut sub);
        let err = sub.verify("up").unwrap_err();
        assert!(
            err.starts_with("up: ") && err.contains(needle),
            "{needle}: {err}"
        );
    }
}

/// The read accessors answer from the tables: a bound page's entries both ways, a
/// page freed inside the span as a hole, the span's ends (the high one exclusive),
/// and binding a tombstoned page clears its tombstone.
#[test]
fn the_accessors_and_a_rebind_over_a_tombstone_follow_the_tables() {
    let mut sub = SubAllocator::new(grid(), Grow::Down, 16);
    let (p, q) = (sub.take(), sub.take());
    sub.bind(3, p);
    sub.bind(5, q);
    assert_eq!(
        (sub.v2p(3), sub.p2v(p), sub.v2p(5), sub.p2v(q)),
        (p as i32, 3, q as i32, 5)
    );
    assert_eq!(
        (sub.v2p(99), sub.p2v(999)),
        (0, 0),
        "out of range reads as unbound"
    );
    let (lo, hi) = sub.span();
    assert!(sub.in_span(lo) && sub.in_span(hi - 1) && !sub.in_span(hi));
    // Freeing the top page (the span's far end, below the frontier) leaves a hole.
    let top = p.max(q);
    let v = sub.p2v(top);
    sub.unbind(v, true);
    assert_eq!(sub.holes(), [top]);
    assert_eq!((sub.v2p(v), sub.tombstones()), (-1, 1));
    let r = sub.take();
    sub.bind(v, r);
    assert_eq!((sub.v2p(v), sub.tombstones(), sub.live()), (r as i32, 0, 2));
}

#[test]
fn tombstones_and_dirty_entries_are_tracked() {
    let mut sub = SubAllocator::new(grid(), Grow::Down, 16);
    let p = sub.take();
    assert_eq!(p, 31, "grows down from the top page");
    sub.bind(3, p);
    assert_eq!((sub.v2p[3], sub.tombstones(), sub.live()), (p as i32, 0, 1));
    sub.unbind(3, true);
    assert_eq!((sub.v2p[3], sub.tombstones(), sub.live()), (-1, 1, 0));
    sub.clear_tombstone(3);
    assert_eq!((sub.v2p[3], sub.tombstones()), (0, 0));
    assert_eq!(
        sub.dirty_spans(),
        [(3, 1)],
        "a page changed three times is one entry"
    );
    assert_eq!(sub.dirty_count(), 1);
    let mut mirror = vec![0; 16];
    mirror[3] = 7;
    upload(&mut sub, &mut mirror);
    assert_eq!(mirror[3], 0, "the upload copies the entry as it is now");
    assert!(!sub.has_dirty());
    // Consecutive pages, either way, are one span; others are spans of their own.
    for v in [5, 6, 4, 9, 6] {
        sub.mark(v);
    }
    assert_eq!(sub.dirty_spans(), [(4, 3), (9, 1), (6, 1)]);
    assert_eq!(sub.dirty_count(), 5);
}

/// A page-size-1 row (consecutive ids on consecutive pages) is one dirty span when it
/// is bound, however long it is, and one span for its whole chunks when it is
/// released (its last pages, fewer than [`RUN`], go page by page).
#[test]
fn a_run_is_one_dirty_span() {
    let big = Grid {
        envelope: 8,
        pages: 256,
        min_page: 1,
        stride: 4,
    };
    let mut sub = SubAllocator::new(big, Grow::Up, 256);
    let row: Vec<u32> = (10..110).collect();
    let popped: Vec<u32> = row.iter().rev().copied().collect();
    sub.bind_popped(&popped);
    assert_eq!(sub.dirty_spans(), [(10, 100)]);
    let mut mirror = vec![0; 256];
    upload(&mut sub, &mut mirror);
    sub.release_each(&row, Keep::NotSink, Release::Free, None);
    let tail = (106..110).map(|v| (v, 1));
    assert_eq!(
        sub.dirty_spans(),
        tail.chain([(10, 96)]).collect::<Vec<_>>()
    );
    upload(&mut sub, &mut mirror);
}

/// The mirror upload: copies the dirty spans of `v2p` into `mirror` and forgets them.
/// Checks that the mirror then equals `v2p`: every changed entry was in a span.
fn upload(sub: &mut SubAllocator, mirror: &mut [i32]) {
    for &(start, len) in sub.dirty_spans() {
        let span = start as usize..(start + len) as usize;
        mirror[span.clone()].copy_from_slice(&sub.v2p[span]);
    }
    sub.clear_dirty();
    assert_eq!(
        mirror,
        &sub.v2p[..],
        "an entry changed outside every dirty span"
    );
}

/// The pages the dirty spans cover.
fn dirty_pages(sub: &SubAllocator) -> std::collections::BTreeSet<u32> {
    sub.dirty_spans()
        .iter()
        .flat_map(|&(start, len)| start..start + len)
        .collect()
}

/// Everything a batch form must leave exactly as the page-by-page calls do.
fn state(sub: &SubAllocator) -> impl PartialEq + std::fmt::Debug + use<> {
    (
        (sub.v2p.clone(), sub.p2v.clone(), sub.holes.clone()),
        (sub.lo, sub.hi, sub.live, sub.tombstones),
        dirty_pages(sub),
    )
}

/// What [`SubAllocator::release_each`] promises, page by page: unbind each kept live
/// page (returning the ids; to a tombstone under `Release::Tombstone`), clear each
/// kept tombstone under `Release::FreeAndClear`.
fn release_one_by_one(
    sub: &mut SubAllocator,
    pages: &[u32],
    keep: Keep<'_>,
    how: Release,
) -> Vec<u32> {
    let mut released = Vec::new();
    for &v in pages.iter().filter(|&&v| keep.keeps(v)) {
        match sub.v2p[v as usize] {
            p if p > 0 => {
                sub.unbind(v, how == Release::Tombstone);
                released.push(v);
            }
            -1 if how == Release::FreeAndClear => sub.clear_tombstone(v),
            _ => {}
        }
    }
    released
}

/// A release mode drawn from `n` (0, 1 or 2).
fn release_mode(n: u32) -> Release {
    [Release::Free, Release::FreeAndClear, Release::Tombstone][n as usize]
}

/// The run fast paths (a page-size-1 prefill: [`RUN`] consecutive ids on consecutive
/// pages) against page-by-page calls: ids ascending and descending, pages fresh at
/// either end or from holes in either order, runs of tombstones, runs broken by a
/// bound id, a tombstone, a free page, a peer page that is not live or a repeated
/// page, and batches that end mid-chunk.
#[test]
fn run_shaped_batches_match_page_by_page_calls() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u32| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) % n as u64) as u32
    };
    let big = Grid {
        envelope: 8,
        pages: 400,
        // Page 1 bound: a descending run of entries can end at a free entry (0).
        min_page: 1,
        stride: 4,
    };
    const IDS: u32 = 300;
    // A peer table that keeps every page but a few.
    let peer: Vec<i32> = (0..IDS as i32).map(|v| (v % 37 != 5) as i32).collect();
    let (mut fast_binds, mut fast_releases) = (0, 0);
    for grow in [Grow::Up, Grow::Down] {
        let (mut batch, mut single) = (
            SubAllocator::new(big, grow, IDS),
            SubAllocator::new(big, grow, IDS),
        );
        let mut mirrors = (vec![0; IDS as usize], vec![0; IDS as usize]);
        for round in 0..300 {
            let free: Vec<u32> = (1..IDS).filter(|&v| batch.v2p[v as usize] <= 0).collect();
            let room = (big.pages - big.min_page - batch.live) as usize;
            if round % 2 == 0 && free.len() > RUN && room > RUN {
                // A run of ids from a random start, either way, sometimes with one id
                // that is already bound swapped in (a broken run).
                let n = (RUN + next(3 * RUN as u32) as usize)
                    .min(free.len())
                    .min(room);
                let start = next((free.len() - n) as u32 + 1) as usize;
                let mut ids: Vec<u32> = free[start..start + n].to_vec();
                if next(2) == 0 {
                    ids.reverse();
                }
                fast_binds += ids.windows(2).filter(|w| w[0].abs_diff(w[1]) == 1).count();
                // The stack's top: the last bound first.
                let popped: Vec<u32> = ids.iter().rev().copied().collect();
                batch.bind_popped(&popped);
                for &v in &ids {
                    let p = single.take();
                    single.bind(v, p);
                }
            } else if batch.live > 0 {
                // Release a run of bound ids (either way), or of any ids (runs of
                // tombstones, free pages amid live ones), with repeats and sink visits
                // now and then, and tombstone a few first so some chunks are broken.
                let bound: Vec<u32> = match next(3) {
                    0 => (1..IDS).collect(),
                    _ => (1..IDS).filter(|&v| batch.v2p[v as usize] > 0).collect(),
                };
                let n = (RUN + next(3 * RUN as u32) as usize).min(bound.len());
                let start = next((bound.len() - n) as u32 + 1) as usize;
                let mut pages: Vec<u32> = bound[start..start + n].to_vec();
                if next(2) == 0 {
                    pages.reverse();
                }
                match next(4) {
                    0 => pages.push(pages[0]),
                    1 => pages.insert(next(pages.len() as u32) as usize, 0),
                    2 => {
                        let v = pages[next(pages.len() as u32) as usize];
                        if batch.v2p[v as usize] > 0 {
                            batch.unbind(v, true);
                            single.unbind(v, true);
                        }
                    }
                    _ => {}
                }
                fast_releases += pages.len();
                let how = release_mode(next(3));
                let keep = Keep::LiveIn(&peer);
                let mut released = Vec::new();
                batch.release_each(&pages, keep, how, Some(&mut released));
                let expected = release_one_by_one(&mut single, &pages, keep, how);
                assert_eq!(released, expected, "{grow:?} round {round}");
            }
            assert_eq!(state(&batch), state(&single), "{grow:?} round {round}");
            batch.verify("batch").unwrap();
            if round % 7 == 6 {
                // Holes in both orders: a compaction empties them, binds refill them.
                let mut moves = Vec::new();
                batch.compact(&mut moves);
                single.compact(&mut moves);
                upload(&mut batch, &mut mirrors.0);
                upload(&mut single, &mut mirrors.1);
            }
        }
    }
    assert!(
        fast_binds > 2000 && fast_releases > 2000,
        "{fast_binds} {fast_releases}"
    );
}

/// The two run shapes a random walk seldom makes: a run of tombstones cleared by a
/// two-sided free, and pages whose entries descend to page 1 and then to a free
/// entry, which a run must not take for live.
#[test]
fn tombstone_runs_and_a_ramp_down_to_a_free_entry_release_as_page_by_page() {
    let grid = Grid {
        envelope: 8,
        pages: 128,
        min_page: 1,
        stride: 4,
    };
    let peer = vec![1; 128];
    let keep = Keep::LiveIn(&peer);
    let check = |setup: &dyn Fn(&mut SubAllocator), pages: &[u32], how: Release| {
        let (mut batch, mut single) = (
            SubAllocator::new(grid, Grow::Up, 128),
            SubAllocator::new(grid, Grow::Up, 128),
        );
        setup(&mut batch);
        setup(&mut single);
        let mut released = Vec::new();
        batch.release_each(pages, keep, how, Some(&mut released));
        let expected = release_one_by_one(&mut single, pages, keep, how);
        assert_eq!(released, expected, "{how:?}");
        assert_eq!(state(&batch), state(&single), "{how:?}");
        batch.verify("batch").unwrap();
    };
    // Ids 20 down to 6 on pages 1 up to 15: v2p[6..=20] is 15 down to 1, v2p[21] is 0.
    let descending = |sub: &mut SubAllocator| {
        for v in (6..=20).rev() {
            let p = sub.take();
            sub.bind(v, p);
        }
    };
    let ids: Vec<u32> = (6..=21).collect();
    check(&descending, &ids, Release::Free);
    check(
        &descending,
        &ids.iter().rev().copied().collect::<Vec<_>>(),
        Release::Free,
    );
    // Ids 10..60 bound in order, then tombstoned: 50 tombstones in a row.
    let tombstoned = |sub: &mut SubAllocator| {
        for v in 10..60 {
            let p = sub.take();
            sub.bind(v, p);
        }
        let pages: Vec<u32> = (10..60).collect();
        sub.release_each(&pages, Keep::NotSink, Release::Tombstone, None);
        assert_eq!((sub.live(), sub.tombstones()), (0, 50));
    };
    let ids: Vec<u32> = (5..65).collect();
    check(&tombstoned, &ids, Release::FreeAndClear);
    check(
        &tombstoned,
        &ids.iter().rev().copied().collect::<Vec<_>>(),
        Release::FreeAndClear,
    );
    check(&tombstoned, &ids, Release::Free);
}

#[test]
fn batch_binds_and_releases_match_page_by_page_calls() {
    // A small LCG: deterministic, no dependency.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u32| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) % n as u64) as u32
    };
    for grow in [Grow::Up, Grow::Down, Grow::Float] {
        let (mut batch, mut single) = (
            SubAllocator::new(grid(), grow, 64),
            SubAllocator::new(grid(), grow, 64),
        );
        let mut mirrors = (vec![0; 64], vec![0; 64]);
        if grow == Grow::Float {
            assert!(batch.place(12) && single.place(12));
        }
        let mut free: Vec<u32> = (1..64).rev().collect();
        let (mut bound, mut unbound) = (0, 0);
        for round in 0..400 {
            let room = batch.grid.pages - batch.span_pages() + batch.holes.len() as u32;
            let room = match grow {
                // A float grows at its high edge only here; an end up to the grid.
                Grow::Float => batch.grid.pages - batch.hi + batch.holes.len() as u32,
                _ => room.min(batch.grid.pages - batch.grid.min_page - batch.live),
            };
            if round % 3 != 2 && room > 0 && !free.is_empty() {
                let n = next(room.min(free.len() as u32).min(6) + 1) as usize;
                let ids: Vec<u32> = (0..n).map(|_| free.pop().unwrap()).collect();
                let (mut spans_batch, mut spans_single) = (Vec::new(), Vec::new());
                batch.handout_envelopes(
                    ids.len(),
                    batch.view(),
                    batch.growth_edge(),
                    &mut spans_batch,
                );
                batch.bind_popped(&ids.iter().rev().copied().collect::<Vec<_>>());
                bound += ids.len();
                for &v in &ids {
                    let p = single.take();
                    single.bind(v, p);
                    spans_single.push(single.envelope(p));
                }
                assert_eq!(spans_batch, spans_single, "{grow:?} round {round}");
            } else {
                // Any pages, bound or not, with repeats and the sink: the filter and
                // the table decide, as in a flush.
                let pages: Vec<u32> = (0..next(8)).map(|_| next(64)).collect();
                let how = release_mode(next(3));
                // A peer table that keeps four pages in five.
                let peer: Vec<i32> = (0..64).map(|v| (v % 5 != 1) as i32).collect();
                let keep = Keep::LiveIn(&peer);
                let mut released = Vec::new();
                batch.release_each(&pages, keep, how, Some(&mut released));
                let expected = release_one_by_one(&mut single, &pages, keep, how);
                assert_eq!(released, expected, "{grow:?} round {round}");
                unbound += released.len();
                free.extend(released);
                // Tombstones too, so that both branches of a release are exercised.
                if let Some(&v) = pages.iter().find(|&&v| v != 0 && batch.v2p[v as usize] > 0) {
                    batch.unbind(v, true);
                    single.unbind(v, true);
                }
            }
            assert_eq!(state(&batch), state(&single), "{grow:?} round {round}");
            batch.verify("batch").unwrap();
            if round % 50 == 49 {
                upload(&mut batch, &mut mirrors.0);
                upload(&mut single, &mut mirrors.1);
            }
        }
        assert!(
            bound > 200 && unbound > 100,
            "{grow:?}: {bound} bound, {unbound} released"
        );
    }
}

/// The small pieces: an id space's size and free ids, a list with its room already
/// mapped, and a cleared relay plan that has nothing to show or commit.
#[test]
fn ids_lists_and_a_cleared_plan_say_what_they_hold() {
    let mut ids = VirtualIds::new(5);
    assert_eq!((ids.count(), ids.available()), (5, 4));
    assert_eq!(ids.pop(), Some(1), "the lowest first");
    let mut free = ids.as_slice().to_vec();
    free.sort_unstable();
    assert_eq!(free, [2, 3, 4]);
    let list: Vec<u32> = resident_list(1000);
    assert!(list.is_empty() && list.capacity() >= 1000);
    let table: Vec<u32> = resident_table(3000);
    assert!(table.len() == 3000 && table.iter().all(|&x| x == 0));
    let (mut moves, mut plan) = (Vec::new(), RelayPlan::default());
    float_of_four().plan_relay((4, 16), 2, &mut moves, &mut plan);
    assert!(plan.view().is_some() && !plan.pairs.is_empty());
    plan.clear();
    assert!(plan.view().is_none() && plan.pairs.is_empty() && plan.holes.is_empty());
}

/// A float on [14, 18) with four live pages.
fn float_of_four() -> SubAllocator {
    let mut f = SubAllocator::new(grid(), Grow::Float, 64);
    assert!(f.place(16));
    for (v, edge) in [Edge::High, Edge::Low, Edge::High, Edge::Low]
        .into_iter()
        .enumerate()
    {
        let p = f.take_at(edge);
        f.bind(v as u32 + 1, p);
    }
    assert_eq!((f.span(), f.live()), ((14, 18), 4));
    f
}

/// A relay target too short above the span grows downward by exactly the pages still
/// missing, and never below the room's low end (then the target is what fits).
#[test]
fn a_relay_target_grows_down_by_the_missing_pages_and_stops_at_the_room() {
    let (mut moves, mut plan) = (Vec::new(), RelayPlan::default());
    // Room [4, 16), six pages needed: [14, 16) grows down by four, to [10, 16).
    float_of_four().plan_relay((4, 16), 2, &mut moves, &mut plan);
    assert_eq!(plan.span, Some((10, 16)));
    // Room [12, 16): only two pages below, so the target is all of the room.
    float_of_four().plan_relay((12, 16), 2, &mut moves, &mut plan);
    assert_eq!(plan.span, Some((12, 16)));
}

/// The span's accounting fails on each of its clauses alone: the pinned edge of each
/// growth, the floor, the ends' order, the grid's top, and live + holes = span.
#[test]
fn accounting_fails_on_each_clause_alone() {
    let up = || {
        let mut s = SubAllocator::new(grid(), Grow::Up, 16);
        let p = s.take();
        s.bind(3, p);
        s
    };
    let down = || {
        let mut s = SubAllocator::new(grid(), Grow::Down, 16);
        let p = s.take();
        s.bind(3, p);
        s
    };
    type Corruption = (&'static str, fn() -> SubAllocator, fn(&mut SubAllocator));
    let g = grid();
    let cases: [Corruption; 6] = [
        ("up: low end off the floor", up, |s| s.lo += 1),
        ("down: high end off the top", down, |s| s.hi -= 1),
        (
            "float: nothing live but a span of holes",
            float_of_four,
            |s| {
                s.live = 0;
                s.holes = (14..18).collect();
            },
        ),
        ("below the floor", down, |s| s.lo = 0),
        ("ends crossed", down, |s| s.lo = s.hi + 1),
        ("live + holes != span", up, |s| s.live += 1),
    ];
    for (what, make, corrupt) in cases {
        let mut s = make();
        assert!(s.accounting_holds(), "{what}: clean");
        corrupt(&mut s);
        assert!(!s.accounting_holds(), "{what}: not caught");
    }
    // Above the grid's top, on a float (no pinned edge to trip first).
    let mut f = float_of_four();
    f.hi = g.pages + 1;
    f.lo = f.hi - 4;
    assert!(!f.accounting_holds(), "above the top");
}

/// Binding a batch over tombstoned entries revives them: the tombstone count drops
/// by each, as page-by-page binds would.
#[test]
fn a_batch_bind_over_tombstones_clears_them() {
    let mut sub = SubAllocator::new(grid(), Grow::Down, 16);
    for v in [3, 4, 5] {
        let p = sub.take();
        sub.bind(v, p);
    }
    sub.unbind(3, true);
    sub.unbind(5, true);
    assert_eq!(sub.tombstones(), 2);
    sub.bind_popped(&[6, 5, 3]);
    assert_eq!((sub.tombstones(), sub.live()), (0, 4));
    sub.verify("down").unwrap();
}

#[test]
fn a_float_is_placed_grows_both_ways_packs_relays_and_parks() {
    let mut f = SubAllocator::new(grid(), Grow::Float, 64);
    assert!(f.accounting_holds(), "parked at start");
    // An empty float may be placed anywhere on its grid above the floor, edges included.
    let g = grid();
    assert!(!f.place(g.min_page - 1) && !f.place(g.pages + 1));
    assert!(f.place(g.min_page) && f.place(g.pages));
    assert_eq!(f.span(), (g.pages, g.pages));
    assert!(f.place(16));
    let mut v = 0;
    let mut bind = |f: &mut SubAllocator, edge| {
        v += 1;
        let p = f.take_at(edge);
        f.bind(v, p);
        p
    };
    assert_eq!(bind(&mut f, Edge::High), 16);
    assert_eq!(bind(&mut f, Edge::Low), 15);
    assert_eq!(bind(&mut f, Edge::High), 17);
    assert_eq!(bind(&mut f, Edge::Low), 14);
    assert_eq!(f.span(), (14, 18));
    assert!(!f.place(3), "a float holding pages is not moved by place");
    f.unbind(2, false); // page 15
    f.verify("float").unwrap();
    let mut moves = Vec::new();
    assert_eq!(f.compact_toward(Edge::High, &mut moves), 1);
    assert_eq!(f.span(), (15, 18));
    f.verify("float").unwrap();
    // A relay into [4, 10) with room for two more: the span lies above it, so all
    // three pages move, into the low pages of T = [5, 10); the rest are its holes.
    let (mut moves, mut plan) = (Vec::new(), RelayPlan::default());
    let before = state(&f);
    f.plan_relay((4, 10), 2, &mut moves, &mut plan);
    assert_eq!(state(&f), before, "planning changed the tables");
    assert_eq!(plan.span, Some((5, 10)));
    assert_eq!(plan.pairs, vec![(15, 5), (16, 6), (17, 7)]);
    assert_eq!(plan.holes, vec![8, 9]);
    let mut predicted = Vec::new();
    f.handout_envelopes(2, plan.view().unwrap(), Edge::High, &mut predicted);
    f.commit_relay(&plan);
    f.verify("float").unwrap();
    assert_eq!((f.span(), f.live), ((5, 10), 3));
    let taken: Vec<ByteSpan> = (0..2)
        .map(|i| {
            let p = f.take();
            f.bind(40 + i, p);
            f.envelope(p)
        })
        .collect();
    assert_eq!(predicted, taken, "the holes the plan predicted are taken");
    for v in [40, 41] {
        f.unbind(v, false);
    }
    // Only the pages outside [a, b) move: here one, into the first free page.
    f.plan_relay((6, 20), 0, &mut moves, &mut plan);
    assert_eq!(plan.span, Some((6, 10)));
    assert_eq!(plan.pairs, vec![(5, 8)]);
    f.commit_relay(&plan);
    f.verify("float").unwrap();
    // Appended; the three consecutive pages relaid into consecutive pages are one copy.
    let at = |p: u64| p * 8;
    assert_eq!(
        moves,
        [(15, 5, 3), (5, 8, 1)].map(|(src, dst, pages)| SpanMove {
            src: at(src),
            dst: at(dst),
            len: pages * 8
        })
    );
    for v in [1, 3, 4] {
        f.unbind(v, false);
    }
    assert_eq!(f.span_pages(), 0, "parked: transparent");
    assert!(f.holes().is_empty());
    f.verify("float").unwrap();
    assert!(f.place(20));
}

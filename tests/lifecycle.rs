//! A request's life through `HybridCache`, the awkward paths included: abort after the
//! match and before admission, abort mid-prefill, retraction and re-admission, two
//! requests prefilling the same text at once, a hit on a prefix whose SWA tail was
//! tombstoned, requests longer than the window at page size 1 and 256, stale matches,
//! foreign handles and bad arguments. Every scenario ends by releasing everything,
//! evicting everything and checking that every page came back.

mod common;

use common::*;
use unikv::pools::VirtualToken;
use unikv::{Error, HybridCache, Layout, Request, TokenId};

const W: u32 = 8;

/// A fixture with room for `tokens` tokens per side (at least 8 pages).
fn fixture(layout: Layout, ps: u32, tokens: usize) -> Fixture {
    Fixture::new(&Config::tokens(layout, ps, W, tokens as u64, 8))
}

/// Caches `prompt` through a request prefilled in one chunk (its SWA stays live).
fn cache_prompt(fx: &mut Fixture, prompt: &[TokenId]) {
    let mut r = fx.admit(prompt.to_vec());
    let n = r.remaining_prefill();
    fx.prefill(&mut r, n);
    fx.cache.cache_finished(r).unwrap();
    fx.step();
}

#[test]
fn abort_after_match_and_before_admit_locks_nothing_and_leaks_nothing() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 64 * ps as usize);
        let keep = fx.keep();
        let prefix = text(0, 2 * keep);
        cache_prompt(&mut fx, &prefix);
        let before = fx.cache.stats();

        let prompt = concat(&prefix, &text(900, 3));
        let hit = fx.cache.match_prefix(prompt.clone());
        assert_eq!(hit.cached_tokens(), 2 * keep, "{}", fx.label);
        assert_eq!(hit.prompt_len(), prompt.len());
        assert_eq!(
            fx.cache.tree().lock_count(),
            0,
            "{}: a match locks nothing",
            fx.label
        );
        // Abort: the prompt comes back, nothing is undone because nothing was done.
        assert_eq!(hit.into_tokens(), prompt);
        fx.step();
        let after = fx.cache.stats();
        assert_eq!(
            (after.full, after.swa),
            (before.full, before.swa),
            "{}",
            fx.label
        );
        assert_eq!(
            (after.live_requests, after.hit_tokens),
            (0, 0),
            "{}",
            fx.label
        );
        assert_eq!(fx.cache.tree().sizes().full_protected.0, 0);

        // Dropping the match is an abort too.
        drop(fx.cache.match_prefix(prompt));
        assert_eq!(fx.cache.tree().lock_count(), 0);
        fx.teardown(vec![]);
    });
}

#[test]
fn abort_mid_prefill_returns_every_page_it_took() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 64 * ps as usize);
        let keep = fx.keep();
        let prefix = text(0, 2 * keep);
        cache_prompt(&mut fx, &prefix);
        let cached = settled(&fx.cache.allocator().capacity());

        for (prompt, hit) in [
            (text(5_000, 4 * keep + 3), 0),
            (concat(&prefix, &text(6_000, 4 * keep + 1)), 2 * keep),
        ] {
            let mut r = fx.admit(prompt);
            assert_eq!(r.cached_at_admission(), hit, "{}", fx.label);
            // Two chunks of a longer prompt, the window moving in between.
            for _ in 0..2 {
                fx.cache.alloc_extend(&mut r, keep + fx.ps.min(3)).unwrap();
                fx.step();
                fx.check_request(&r);
                fx.check_accounting(&[&r]);
            }
            assert!(r.remaining_prefill() > 0);
            let tokens = fx.cache.release(r).unwrap();
            assert_eq!(
                tokens.len(),
                if hit == 0 { 4 * keep + 3 } else { 6 * keep + 1 }
            );
            fx.step();
            fx.check_accounting(&[]);
            assert_eq!(fx.cache.tree().lock_count(), 0, "{}", fx.label);
            assert_eq!(
                settled(&fx.cache.allocator().capacity()),
                cached,
                "{}: the abort gave back every page",
                fx.label
            );
        }
        fx.teardown(vec![]);
    });
}

#[test]
fn retraction_and_readmission_reuse_what_was_cached() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 96 * ps as usize);
        let keep = fx.keep();
        let prompt = text(0, 3 * keep + fx.ps + 1);

        // Retracted before anything was cached: all of it comes back, nothing is a hit.
        let mut r = fx.admit(prompt.clone());
        fx.prefill(&mut r, fx.ps);
        fx.decode(&mut r, keep, 10_000);
        let tokens = fx.cache.release(r).unwrap();
        assert_eq!(tokens.len(), prompt.len() + keep);
        assert_eq!(&tokens[..prompt.len()], &prompt[..]);
        fx.step();
        fx.assert_empty_allocator();
        let r = fx.admit(tokens);
        assert_eq!(r.cached_at_admission(), 0, "{}", fx.label);
        fx.cache.release(r).unwrap();
        fx.step();

        // Cached while running (prompt done), then retracted under pressure: the
        // re-admitted request hits every whole page of the cached prompt.
        let mut r = fx.admit(prompt.clone());
        fx.prefill(&mut r, 2 * fx.ps);
        fx.cache.cache_unfinished(&mut r).unwrap();
        fx.step();
        fx.check_request(&r);
        fx.check_accounting(&[&r]);
        let cached = fx.floor(prompt.len());
        assert_eq!(r.protected_len(), cached, "{}", fx.label);
        fx.decode(&mut r, 2 * keep, 20_000);
        let hits_before = fx.cache.stats().hit_tokens;
        let tokens = fx.cache.release(r).unwrap();
        fx.step();
        fx.check_accounting(&[]);
        let mut r = fx.admit(tokens.clone());
        assert_eq!(
            r.cached_at_admission(),
            cached,
            "{}: re-admission hits the cached prompt",
            fx.label
        );
        assert_eq!(fx.cache.stats().hit_tokens, hits_before + cached as u64);
        assert_eq!(r.remaining_prefill(), tokens.len() - cached);
        fx.prefill(&mut r, 3 * fx.ps);
        fx.decode(&mut r, 3, 30_000);
        fx.check_accounting(&[&r]);
        fx.cache.cache_finished(r).unwrap();
        fx.step();
        fx.teardown(vec![]);
    });
}

/// Prefills `a` and `b` (same prompt) chunk by chunk, alternating, while `others` run.
fn prefill_together(
    fx: &mut Fixture,
    a: &mut Request,
    b: &mut Request,
    chunk: usize,
    others: &[&Request],
) {
    while a.remaining_prefill() + b.remaining_prefill() > 0 {
        for r in [&mut *a, &mut *b] {
            let n = chunk.min(r.remaining_prefill());
            fx.cache.alloc_extend(r, n).unwrap();
        }
        fx.step();
        fx.check_request(a);
        fx.check_request(b);
        let mut live = vec![&*a, &*b];
        live.extend_from_slice(others);
        fx.check_accounting(&live);
    }
}

#[test]
fn two_requests_prefilling_the_same_text_both_finish_and_the_losers_copy_comes_back() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 96 * ps as usize);
        let keep = fx.keep();
        let prompt = text(0, 2 * keep + fx.ps + 1);
        let key_len = fx.floor(prompt.len());

        // Both finish: the tree keeps the winner's pages, the loser's are freed whole.
        let mut a = fx.admit(prompt.clone());
        let mut b = fx.admit(prompt.clone());
        let chunk = fx.ps + 1;
        prefill_together(&mut fx, &mut a, &mut b, chunk, &[]);
        let winner: Vec<VirtualToken> = a.row()[..key_len].to_vec();
        fx.cache.cache_finished(a).unwrap();
        fx.step();
        fx.cache.cache_finished(b).unwrap();
        fx.step();
        fx.check_accounting(&[]);
        let stats = fx.cache.stats();
        let cap = fx.cache.allocator().capacity();
        assert_eq!(
            cap.full.allocated_pages,
            key_len / fx.ps,
            "{}: only one copy is kept",
            fx.label
        );
        assert_eq!(
            stats.full.available_pages,
            stats.full.total_pages - key_len / fx.ps,
            "{}",
            fx.label
        );
        assert_eq!(stats.full.evictable_pages, key_len / fx.ps);
        assert_eq!(
            fx.cache.match_prefix(follow_up(&prompt)).cached_tokens(),
            key_len
        );
        assert!(
            winner.iter().all(|&t| fx.full_live(t)),
            "{}: the winner's copy stays",
            fx.label
        );
        fx.evict_everything();
        fx.assert_empty();

        // Both cache while running: the loser switches to the winner's copy, its own
        // duplicate pages come back at the step boundary, and both keep decoding.
        let mut a = fx.admit(prompt.clone());
        let mut b = fx.admit(prompt.clone());
        let chunk = 2 * fx.ps;
        prefill_together(&mut fx, &mut a, &mut b, chunk, &[]);
        let loser: Vec<VirtualToken> = b.row()[..key_len].to_vec();
        fx.cache.cache_unfinished(&mut a).unwrap();
        fx.cache.cache_unfinished(&mut b).unwrap();
        fx.step();
        assert_eq!(
            &b.row()[..key_len],
            &a.row()[..key_len],
            "{}: the loser reads the tree's copy",
            fx.label
        );
        assert!(
            loser.iter().all(|&t| !fx.full_live(t)),
            "{}: the loser's duplicate is freed",
            fx.label
        );
        fx.check_accounting(&[&a, &b]);
        for i in 0..2 * keep {
            let t = [TokenId(40_000 + i as u32), TokenId(50_000 + i as u32)];
            fx.cache.alloc_decode(&mut [&mut a, &mut b], &t).unwrap();
            fx.step();
            fx.check_request(&a);
            fx.check_request(&b);
            fx.check_accounting(&[&a, &b]);
        }

        // A loser whose window already moved (cursor > 0) frees its duplicate FULL-only
        // below its cursor and on both sides above it; the counts stay exact.
        let mut c = fx.admit(concat(&prompt, &text(60_000, 2 * keep + fx.ps)));
        // Its prompt shares the cached part: prefill only what is new, then the tree
        // holds what it computed too.
        assert_eq!(c.cached_at_admission(), key_len);
        let mut d = fx.admit(c.tokens().to_vec());
        let chunk = fx.ps;
        prefill_together(&mut fx, &mut c, &mut d, chunk, &[&a, &b]);
        assert!(
            d.window_cursor() > d.protected_len(),
            "{}: the window moved",
            fx.label
        );
        fx.cache.cache_finished(c).unwrap();
        fx.step();
        fx.cache.cache_finished(d).unwrap();
        fx.step();
        fx.check_accounting(&[&a, &b]);
        fx.teardown(vec![a, b]);
    });
}

#[test]
fn a_hit_on_a_prefix_whose_swa_tail_was_tombstoned_needs_a_whole_live_window() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 64 * ps as usize);
        let (keep, ps) = (fx.keep(), fx.ps);
        let leaf_window = (W as usize).div_ceil(ps) * ps;
        let prompt = text(0, 3 * keep);
        cache_prompt(&mut fx, &prompt);
        // The tree: a live internal node [0, 3·keep − leaf_window) and a live leaf of one
        // page-aligned window.
        let split = prompt.len() - leaf_window;

        // B uses all of it; its window lock covers only the leaf, so under SWA pressure
        // the internal node (FULL-locked by B) is tombstoned, not evicted.
        let b = fx.admit(concat(&prompt, &text(1_000, ps + 1)));
        assert_eq!(b.cached_at_admission(), prompt.len(), "{}", fx.label);
        let swa_free = fx.cache.allocator().capacity().swa.schedulable_pages;
        fx.cache.evict_to_free(0, swa_free + 1).unwrap();
        fx.step();
        let evictions = fx.cache.stats().evictions;
        assert_eq!(
            (evictions.swa_tombstones, evictions.full_nodes),
            (1, 0),
            "{}: {evictions:?}",
            fx.label
        );
        fx.cache.release(b).unwrap();
        fx.step();
        fx.check_accounting(&[]);

        // A match may not end on the tombstone, nor less than a window past it.
        assert_eq!(
            fx.cache
                .match_prefix(prompt[..split].to_vec())
                .cached_tokens(),
            0,
            "{}",
            fx.label
        );
        if ps < W as usize {
            let short = prompt[..split + ps].to_vec();
            assert_eq!(
                fx.cache.match_prefix(short).cached_tokens(),
                0,
                "{}: less than a window of live SWA",
                fx.label
            );
        }
        // The whole prompt ends a window of live SWA past the tombstone: a hit.
        assert_eq!(
            fx.cache.match_prefix(follow_up(&prompt)).cached_tokens(),
            prompt.len(),
            "{}",
            fx.label
        );

        // A request on it runs and finishes normally; its window never needs the
        // tombstoned rows.
        let mut c = fx.admit(concat(&prompt, &text(2_000, 2 * ps + 3)));
        assert_eq!(c.cached_at_admission(), prompt.len(), "{}", fx.label);
        for (i, &t) in c.row()[..split].iter().enumerate() {
            assert_eq!(
                fx.swa_state(t),
                unikv::pools::SwaState::Tombstone,
                "{}: row {i}",
                fx.label
            );
        }
        fx.prefill(&mut c, ps);
        fx.decode(&mut c, keep + ps, 3_000);
        fx.check_accounting(&[&c]);
        fx.cache.cache_finished(c).unwrap();
        fx.step();
        fx.teardown(vec![]);
    });
}

#[test]
fn requests_longer_than_the_window_at_page_size_1_and_256() {
    let mut sizes = page_sizes();
    sizes.retain(|&ps| ps != 4);
    if !sizes.contains(&256) {
        sizes.push(256);
    }
    for layout in LAYOUTS {
        for &ps in &sizes {
            const LONG_W: u32 = 16;
            let keep = (LONG_W as usize).max(ps as usize);
            let prompt = text(0, 2 * keep + 37);
            let decode = keep + 50;
            let tokens = 2 * (prompt.len() + decode) + 8 * ps as usize;
            let mut fx = Fixture::new(&Config::tokens(layout, ps, LONG_W, tokens as u64, 8));
            let mut r = fx.admit(prompt.clone());
            fx.prefill(&mut r, 100);
            fx.decode(&mut r, decode, 10_000);
            assert!(r.window_cursor() > 0, "{}: the window moved", fx.label);
            let all = r.tokens().to_vec();
            let len = r.len();
            fx.cache.cache_finished(r).unwrap();
            fx.step();
            // A follow-up turn reuses every whole page.
            let mut next = fx.admit(concat(&all, &text(20_000, 5)));
            assert_eq!(next.cached_at_admission(), fx.floor(len), "{}", fx.label);
            fx.prefill(&mut next, 100);
            fx.decode(&mut next, keep + 1, 30_000);
            fx.teardown(vec![next]);
        }
    }
}

#[test]
fn a_stale_match_is_matched_again_at_admission() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 64 * ps as usize);
        let prompt = text(0, 2 * fx.keep() + 1);
        let key_len = fx.floor(prompt.len());

        // Matched on an empty tree; the prompt is cached before admission: the admitted
        // request gets the hit.
        let early = fx.cache.match_prefix(follow_up(&prompt));
        assert_eq!(early.cached_tokens(), 0);
        cache_prompt(&mut fx, &prompt);
        let r = fx.cache.admit(early).unwrap();
        assert_eq!(r.cached_at_admission(), key_len, "{}", fx.label);
        fx.cache.release(r).unwrap();
        fx.step();

        // Matched with a hit; the hit is evicted before admission: admission neither
        // fails nor locks a dead node, it admits with no hit.
        let late = fx.cache.match_prefix(follow_up(&prompt));
        assert_eq!(late.cached_tokens(), key_len);
        fx.evict_everything();
        let mut r = fx
            .cache
            .admit(late)
            .unwrap_or_else(|e| panic!("{}: {e}", fx.label));
        assert_eq!(r.cached_at_admission(), 0, "{}", fx.label);
        fx.prefill(&mut r, fx.ps);
        fx.teardown(vec![r]);
    });
}

#[test]
fn handles_of_another_cache_are_refused_and_change_nothing() {
    let config = Config::new(Layout::Unified, 4, W, 32);
    let mut one = Fixture::new(&config);
    let mut two = Fixture::new(&config);
    let mut r = one.admit(text(0, 20));
    one.prefill(&mut r, 8);
    let (stats_one, stats_two) = (one.cache.stats(), two.cache.stats());

    let foreign_match = one.cache.match_prefix(text(0, 20));
    assert!(matches!(
        two.cache.admit(foreign_match),
        Err(Error::ForeignRequest { .. })
    ));
    let refused: Vec<Result<(), Error>> = vec![
        two.cache.alloc_extend(&mut r, 0),
        two.cache.alloc_decode(&mut [&mut r], &[TokenId(1)]),
        two.cache.release_out_of_window(&mut r).map(drop),
        two.cache.cache_unfinished(&mut r),
    ];
    for result in refused {
        let err = result.expect_err("a foreign request is refused");
        assert!(
            matches!(err, Error::ForeignRequest { request } if request == r.id()),
            "{err}"
        );
    }
    assert_eq!(
        (one.cache.stats(), two.cache.stats()),
        (stats_one, stats_two)
    );
    assert_eq!(r.len(), 20);
    one.teardown(vec![r]);
    two.teardown(vec![]);
}

#[test]
fn bad_arguments_are_refused_and_change_nothing() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 64 * ps as usize);
        let mut a = fx.admit(text(0, 10));
        let mut b = fx.admit(text(100, 10));
        fx.cache.alloc_extend(&mut a, 10).unwrap();
        fx.cache.alloc_extend(&mut b, 4).unwrap();
        fx.step();
        let stats = fx.cache.stats();
        let shape = |r: &Request| {
            (
                r.len(),
                r.tokens().len(),
                r.window_cursor(),
                r.row().to_vec(),
            )
        };
        let (sa, sb) = (shape(&a), shape(&b));

        let past_prompt = fx.cache.alloc_extend(&mut b, 7).unwrap_err();
        assert!(
            matches!(past_prompt, Error::BadRequest { .. }),
            "{past_prompt}"
        );
        let mid_prefill = fx
            .cache
            .alloc_decode(&mut [&mut a, &mut b], &[TokenId(1), TokenId(2)])
            .unwrap_err();
        assert!(
            matches!(mid_prefill, Error::BadRequest { request, .. } if request == b.id()),
            "{mid_prefill}"
        );
        let mismatch = fx
            .cache
            .alloc_decode(&mut [&mut a], &[TokenId(1), TokenId(2)])
            .unwrap_err();
        assert!(matches!(mismatch, Error::BadRequest { .. }), "{mismatch}");
        assert_eq!(
            (shape(&a), shape(&b)),
            (sa, sb),
            "{}: the requests are unchanged",
            fx.label
        );
        fx.step();
        assert_eq!(fx.cache.stats().full, stats.full);
        assert_eq!(fx.cache.stats().swa, stats.swa);
        fx.teardown(vec![a, b]);
    });
}

/// Admits and prefills requests of `len` tokens until one does not fit; returns them.
fn fill_with_running_requests(fx: &mut Fixture, len: usize) -> (Vec<Request>, Request, Error) {
    let mut running = Vec::new();
    for i in 0.. {
        let mut r = fx.admit(text(1_000_000 * (i + 1), len));
        match fx.cache.alloc_extend(&mut r, len) {
            Ok(()) => {
                fx.step();
                running.push(r);
            }
            Err(e) => return (running, r, e),
        }
    }
    unreachable!()
}

#[test]
fn out_of_memory_is_typed_changes_no_request_and_retraction_makes_room() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 16 * ps as usize);
        let len = 3 * fx.ps;
        let (mut running, mut blocked, err) = fill_with_running_requests(&mut fx, len);
        assert!(
            matches!(err, Error::OutOfMemory { .. }),
            "{}: {err}",
            fx.label
        );
        assert!(err.to_string().contains("out of memory"), "{err}");
        assert!(!running.is_empty());
        assert_eq!(
            blocked.len(),
            0,
            "{}: the failed extend took nothing",
            fx.label
        );
        fx.step();
        let mut live: Vec<&Request> = running.iter().collect();
        live.push(&blocked);
        fx.check_accounting(&live);
        // Retract one running request: the blocked one fits now.
        let retracted = fx.cache.release(running.pop().unwrap()).unwrap();
        assert_eq!(retracted.len(), len);
        fx.cache
            .alloc_extend(&mut blocked, len)
            .unwrap_or_else(|e| panic!("{}: {e}", fx.label));
        fx.step();
        running.push(blocked);
        fx.check_accounting(&running.iter().collect::<Vec<_>>());
        fx.teardown(running);
    });
}

#[test]
fn can_admit_is_pure_and_admission_it_allows_succeeds() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = fixture(layout, ps, 24 * ps as usize);
        let keep = fx.keep();
        // Cached prefixes, one of them locked by a running request.
        let locked = text(0, 2 * keep);
        cache_prompt(&mut fx, &locked);
        cache_prompt(&mut fx, &text(500_000, keep + 1));
        let mut running = fx.admit(concat(&locked, &text(600_000, fx.ps)));
        fx.prefill(&mut running, fx.ps);
        let total = fx.cache.stats().full.total_pages;
        let (mut admitted, mut refused) = (0, 0);
        for (i, pages) in [1, 2, 4, 8, total / 2, total, 4 * total]
            .into_iter()
            .enumerate()
        {
            let len = pages * fx.ps;
            let before = (
                fx.cache.stats(),
                fx.cache.allocator().capacity(),
                fx.cache.tree().sizes(),
            );
            let hit = fx.cache.match_prefix(text(1_000_000 * (i as u32 + 1), len));
            let admissible = fx.cache.can_admit(&hit, 0);
            let after = (
                fx.cache.stats(),
                fx.cache.allocator().capacity(),
                fx.cache.tree().sizes(),
            );
            assert_eq!(after, before, "{}: can_admit changed something", fx.label);
            if !admissible {
                refused += 1;
                continue;
            }
            admitted += 1;
            let mut r = fx.cache.admit(hit).unwrap();
            fx.cache
                .alloc_extend(&mut r, len)
                .unwrap_or_else(|e| panic!("{}: can_admit allowed {len} tokens: {e}", fx.label));
            fx.step();
            fx.cache.cache_finished(r).unwrap();
            fx.step();
        }
        assert!(
            admitted > 0 && refused > 0,
            "{}: {admitted} admitted, {refused} refused",
            fx.label
        );
        fx.teardown(vec![running]);
    });
}

/// `HybridCache` is `Send`: an engine may move it to its scheduler thread.
#[test]
fn the_cache_and_requests_can_move_between_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<HybridCache>();
    assert_send::<Request>();
}

/// Scenarios 25–26 through the facade: a request re-computes a prefix whose cached SWA
/// was tombstoned. While another request holds the prefix's FULL, the tree takes the
/// newcomer's SWA pages over (no SWA page allocated or freed); once nobody holds it, the
/// node adopts the newcomer's KV and its old FULL is freed. The counts stay exact and
/// the prefix is a hit again.
#[test]
fn recomputing_a_tombstoned_prefix_revives_it_with_or_without_a_lock_on_its_full() {
    for_each_layout_and_page_size(|layout, ps| {
        for locked in [true, false] {
            let mut fx = fixture(layout, ps, 96 * ps as usize);
            let (keep, ps) = (fx.keep(), fx.ps);
            let prompt = text(0, 3 * keep);
            cache_prompt(&mut fx, &prompt);
            // B holds all of it and decodes past its window: the window lock goes, the
            // FULL lock stays; SWA pressure then tombstones the whole prefix.
            let mut b = Some(fx.admit(concat(&prompt, &text(1_000, ps))));
            let holder = b.as_mut().unwrap();
            fx.prefill(holder, ps);
            fx.decode(holder, 2 * keep + ps, 2_000);
            let tree_swa = fx.cache.tree().sizes().swa_evictable.0 / ps;
            assert!(
                tree_swa > 0,
                "{}: the prefix's SWA became evictable",
                fx.label
            );
            let swa_free = fx.cache.allocator().capacity().swa.schedulable_pages;
            fx.cache.evict_to_free(0, swa_free + tree_swa).unwrap();
            fx.step();
            assert_eq!(fx.cache.tree().sizes().swa_evictable.0, 0, "{}", fx.label);
            assert_eq!(
                fx.cache.match_prefix(follow_up(&prompt)).cached_tokens(),
                0,
                "{}: all tombstone",
                fx.label
            );
            if !locked {
                fx.cache.release(b.take().unwrap()).unwrap();
                fx.step();
            }
            // C recomputes the prompt (prefilled in one chunk: its SWA is all live).
            let mut c = fx.admit(prompt.clone());
            assert_eq!(c.cached_at_admission(), 0);
            fx.prefill(&mut c, 3 * keep);
            let swa_before = fx.cache.allocator().capacity().swa.allocated_pages;
            fx.cache.cache_finished(c).unwrap();
            fx.step();
            let swa_after = fx.cache.allocator().capacity().swa.allocated_pages;
            assert_eq!(
                swa_after, swa_before,
                "{}: SWA ownership moved, no page allocated or freed",
                fx.label
            );
            let live: Vec<&Request> = b.iter().collect();
            fx.check_accounting(&live);
            assert_eq!(
                fx.cache.match_prefix(follow_up(&prompt)).cached_tokens(),
                prompt.len(),
                "{}: a hit again",
                fx.label
            );
            let tree = fx.cache.tree();
            assert!(
                tree.nodes().iter().skip(1).all(|n| n.swa_live),
                "{}:\n{}",
                fx.label,
                tree.dump()
            );
            if let Some(mut b) = b {
                fx.check_request(&b);
                fx.decode(&mut b, ps, 3_000);
                fx.teardown(vec![b]);
            } else {
                fx.teardown(vec![]);
            }
        }
    });
}

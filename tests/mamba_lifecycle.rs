//! The recurrent-state lifecycle through the facade: the running slot at admission,
//! checkpoints planned per step, every held checkpoint cached at finish, copy-on-write on
//! a hit, no leak on release, three-side conservation at every boundary.

mod common;

use common::TINY_MAMBA;
use unikv::{HybridCache, Layout, ModelSpec, TokenId};

fn cache(model: ModelSpec, layout: Layout, ps: u32, memory: u64) -> HybridCache {
    HybridCache::builder()
        .model(model)
        .page_size(ps)
        .memory_bytes(memory)
        .layout(layout)
        .build()
        .unwrap()
}

fn prompt(n: u32, base: u32) -> Vec<TokenId> {
    (0..n).map(|i| TokenId(base + i)).collect()
}

#[test]
fn a_finished_request_caches_its_checkpoints_and_a_follow_up_copies_the_deepest() {
    for layout in [
        Layout::Unified,
        Layout::Static {
            swa_full_tokens_ratio: 0.8,
        },
    ] {
        for ps in [1u32, 16] {
            let p16 = |n: usize| n / ps as usize * ps as usize;
            let mut c = cache(ModelSpec::QWEN3_NEXT_80B_A3B, layout, ps, 2 << 30);
            let p = prompt(600, 0);
            let hit = c.match_prefix(p.clone());
            assert_eq!(hit.cached_tokens(), 0);
            let mut req = c.admit(hit).unwrap();
            assert_eq!(req.state_slots().len(), 1, "the running slot only");
            c.alloc_extend(&mut req, 600).unwrap();
            // The deepest grid point and the prompt's last whole page.
            let at: Vec<usize> = req.checkpoint_writes().iter().map(|w| w.at_len).collect();
            assert_eq!(at, [512, p16(600)], "{layout:?} ps {ps}");
            assert_eq!(req.state_slots().len(), 3);
            for t in 0..10 {
                c.alloc_decode(&mut [&mut req], &[TokenId(9000 + t)])
                    .unwrap();
                assert!(req.checkpoint_writes().is_empty());
                c.step_boundary().unwrap();
            }
            let s = c.stats();
            assert_eq!(s.mamba.held_pages, 3, "{layout:?} ps {ps}");
            c.cache_finished(req).unwrap();
            c.step_boundary().unwrap();
            let s = c.stats();
            assert_eq!(s.mamba.held_pages, 0);
            // At page size 1 the running state at 610 ends a page and is cached too.
            let cached_states = if ps == 1 { 3 } else { 2 };
            assert_eq!(s.mamba.evictable_pages, cached_states, "{layout:?} ps {ps}");
            // A follow-up on the prompt: the match ends at the prompt's last page.
            let mut follow = p.clone();
            follow.extend(prompt(50, 5000));
            let hit = c.match_prefix(follow);
            assert_eq!(hit.cached_tokens(), p16(600), "{layout:?} ps {ps}");
            let req = c.admit(hit).unwrap();
            assert_eq!(c.stats().mamba.protected_pages, 1);
            c.release(req).unwrap();
            c.step_boundary().unwrap();
            let s = c.stats();
            assert_eq!(
                (s.mamba.held_pages, s.mamba.evictable_pages),
                (0, cached_states)
            );
            assert_eq!(s.mamba.available_pages + cached_states, s.mamba.total_pages);
        }
    }
}

fn tiny_cache(memory: u64, device: std::sync::Arc<dyn unikv::kernels::Device>) -> HybridCache {
    HybridCache::builder()
        .model(TINY_MAMBA)
        .page_size(1)
        .memory_bytes(memory)
        .layout(Layout::Unified)
        .checkpoint_interval(64)
        .device(device)
        .build()
        .unwrap()
}

/// Admits, prefills and finishes a distinct 40-token prompt (below the checkpoint grid:
/// its KV and the state at its end are cached).
fn finish_one(c: &mut HybridCache, base: u32) {
    let hit = c.match_prefix(prompt(40, base));
    let mut req = c.admit(hit).unwrap();
    c.alloc_extend(&mut req, 40).unwrap();
    c.cache_finished(req).unwrap();
    c.step_boundary().unwrap();
}

/// SGLang #34441: the buffer full of cached FULL pages, a gap smaller than one state slot
/// while the slot counters say free. Admission (three slots) evicts FULL leaves as donors
/// (no cached state is touched), with no host sync; with no FULL evictable it is a typed
/// error at once, never a loop.
#[test]
fn a_slot_shortfall_with_free_slot_ids_evicts_full_donors_and_never_loops() {
    let ledger = std::sync::Arc::new(unikv::kernels::SyncLedger::cpu());
    // 64 B sink + 3 slots + 600 tokens of KV.
    let mut c = tiny_cache(64 + 3 * 64 + 600 * 32, ledger.clone());
    let mut base = 0;
    while c.allocator().capacity().full.schedulable_pages >= 40 + 3 * 2 {
        finish_one(&mut c, base);
        base += 1000;
    }
    // A running request decodes into the gap until three slots no longer fit in it.
    let hit = c.match_prefix(prompt(40, 500_000));
    let mut filler = c.admit(hit).unwrap();
    c.alloc_extend(&mut filler, 40).unwrap();
    let mut t = 0;
    while c
        .allocator()
        .allocation_fits(unikv::pools::PageDemand::slots(3))
    {
        c.alloc_decode(&mut [&mut filler], &[TokenId(600_000 + t)])
            .unwrap();
        c.step_boundary().unwrap();
        t += 1;
    }
    let before = c.stats();
    assert!(
        before.mamba.available_pages >= 3,
        "slot ids are free: {:?}",
        before.mamba
    );
    assert!(
        !c.allocator()
            .allocation_fits(unikv::pools::PageDemand::slots(3)),
        "the gap is smaller than three slots"
    );
    ledger.reset();
    let hit = c.match_prefix(prompt(40, 999_000));
    assert!(c.can_admit(&hit, 0));
    let mut req = c.admit(hit).unwrap();
    c.alloc_extend(&mut req, 40).unwrap();
    ledger.check_no_syncs().unwrap();
    let after = c.stats();
    // Each finished prompt cached a state at its end too: the shortfall takes cached
    // states or FULL donors, whichever the reclaim plan prices first.
    assert!(
        after.evictions.donor_nodes + after.evictions.mamba_states > 0,
        "{:?}",
        after.evictions
    );
    // Now hold the rest of the memory in running requests: nothing is evictable.
    let mut held = vec![filler, req];
    loop {
        let hit = c.match_prefix(prompt(40, 2_000_000 + held.len() as u32 * 1000));
        match c.admit(hit) {
            Ok(mut r) => match c.alloc_extend(&mut r, 40) {
                Ok(()) => held.push(r),
                // It keeps its slots: the next admission finds even less room.
                Err(unikv::Error::OutOfMemory { .. }) => held.push(r),
                Err(e) => panic!("{e}"),
            },
            Err(unikv::Error::OutOfMemory { mamba_slots, .. }) => {
                assert_eq!(mamba_slots, 1, "admission takes the running slot");
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    // Admission evicted every FULL donor it could before refusing; so does the next one.
    let hit = c.match_prefix(prompt(40, 7_000_000));
    let locks = c.tree().lock_count();
    match c.admit(hit) {
        Err(unikv::Error::OutOfMemory { mamba_slots: 1, .. }) => {}
        other => panic!("expected a typed shortfall, got {other:?}"),
    }
    assert_eq!(
        c.tree().lock_count(),
        locks,
        "a refused admission locks nothing"
    );
    for r in held {
        c.release(r).unwrap();
    }
    c.step_boundary().unwrap();
    let s = c.stats();
    assert_eq!(s.mamba.held_pages, 0);
    assert_eq!(
        s.mamba.available_pages + s.mamba.evictable_pages,
        s.mamba.total_pages
    );
}

/// Abort between `match_prefix` and `admit`, and a release, leave no slot behind.
#[test]
fn an_abort_before_admission_and_a_release_leak_no_slot() {
    let mut c = tiny_cache(
        1 << 20,
        std::sync::Arc::new(unikv::kernels::CpuDevice::new()),
    );
    let total = c.stats().mamba.total_pages;
    drop(c.match_prefix(prompt(100, 0)));
    let hit = c.match_prefix(prompt(100, 0));
    let mut req = c.admit(hit).unwrap();
    c.alloc_extend(&mut req, 100).unwrap();
    assert_eq!(c.stats().mamba.available_pages, total - 3);
    c.release(req).unwrap();
    c.step_boundary().unwrap();
    assert_eq!(c.stats().mamba.available_pages, total);
}

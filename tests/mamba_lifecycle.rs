//! The recurrent-state lifecycle through the facade: slots at admission, checkpoints on
//! the grid, the latest checkpoint cached at finish, copy-on-write on a hit, no leak on
//! release, three-side conservation at every boundary.

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
fn a_finished_request_caches_its_latest_checkpoint_and_a_follow_up_copies_it() {
    for layout in [
        Layout::Unified,
        Layout::Static {
            swa_full_tokens_ratio: 0.8,
        },
    ] {
        for ps in [1u32, 16] {
            let mut c = cache(ModelSpec::QWEN3_NEXT_80B_A3B, layout, ps, 2 << 30);
            let p = prompt(600, 0);
            let hit = c.match_prefix(p.clone());
            assert_eq!(hit.cached_tokens(), 0);
            let mut req = c.admit(hit).unwrap();
            assert_eq!(req.state_slots().len(), 3);
            c.alloc_extend(&mut req, 600).unwrap();
            let w = req
                .checkpoint_write()
                .expect("600 tokens cross the grid at 512");
            assert_eq!(w.at_len, 512);
            for t in 0..10 {
                c.alloc_decode(&mut [&mut req], &[TokenId(9000 + t)])
                    .unwrap();
                c.step_boundary().unwrap();
            }
            let s = c.stats();
            assert_eq!(s.mamba.held_pages, 3, "{layout:?} ps {ps}");
            c.cache_finished(req).unwrap();
            c.step_boundary().unwrap();
            let s = c.stats();
            assert_eq!(s.mamba.held_pages, 0);
            assert_eq!(
                s.mamba.evictable_pages, 1,
                "the checkpoint at 512 is cached"
            );
            // A follow-up: the match ends at the cached state, 512 tokens.
            let mut follow = p.clone();
            follow.extend(prompt(50, 5000));
            let hit = c.match_prefix(follow);
            assert_eq!(hit.cached_tokens(), 512, "{layout:?} ps {ps}");
            let req = c.admit(hit).unwrap();
            assert_eq!(c.stats().mamba.protected_pages, 1);
            c.release(req).unwrap();
            c.step_boundary().unwrap();
            let s = c.stats();
            assert_eq!((s.mamba.held_pages, s.mamba.evictable_pages), (0, 1));
            assert_eq!(s.mamba.available_pages + 1, s.mamba.total_pages);
        }
    }
}

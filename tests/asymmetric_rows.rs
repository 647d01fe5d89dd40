//! A model whose FULL and SWA layers have different KV rows (Gemma 4's global layers have
//! fewer, wider heads than its sliding ones): each side's pool is sized by its own rows,
//! and a request's life through the cache keeps the window rules and leaks nothing.

mod common;

use common::*;
use unikv::{HybridCache, Layout, ModelSpec};

#[test]
fn each_side_pages_its_own_rows() {
    for ps in [1u32, 16] {
        let m = ModelSpec::GEMMA_4_31B;
        let tokens = u64::from(m.window.div_ceil(ps) * ps + 2 * ps);
        let cache = HybridCache::builder()
            .model(m)
            .page_size(ps)
            .memory_bytes(2 * tokens * (m.full_bytes_per_token() + m.swa_bytes_per_token()))
            .layout(Layout::Unified)
            .build()
            .unwrap();
        let stats = cache.stats();
        // FULL: 10 layers × 2 × 4 heads × 512 × 2 B; SWA: 50 × 2 × 16 × 256 × 2 B.
        assert_eq!(stats.full.page_bytes, u64::from(ps) * 81_920);
        assert_eq!(stats.swa.page_bytes, u64::from(ps) * 819_200);
    }
    // The tiny asymmetric model: FULL 1 × 2 × 1 × 8 × 2 = 32 B, SWA 2 × 2 × 2 × 2 × 1 = 16 B.
    let m = tiny_asymmetric_model(8);
    assert_eq!(
        (m.full_bytes_per_token(), m.swa_bytes_per_token()),
        (32, 16)
    );
    let (full, swa) = m.kv_sub_pools();
    assert_eq!((full.rows_per_token, swa.rows_per_token), (2, 4));
}

#[test]
fn a_request_lives_and_ends_on_a_model_with_asymmetric_rows() {
    for_each_layout_and_page_size(|layout, ps| {
        let config = Config {
            model: tiny_asymmetric_model(8),
            ..Config::tokens(layout, ps, 8, 64 * u64::from(ps), 8)
        };
        let mut fx = Fixture::new(&config);
        let stats = fx.cache.stats();
        assert_eq!(stats.full.page_bytes, 32 * u64::from(ps), "{}", fx.label);
        assert_eq!(stats.swa.page_bytes, 16 * u64::from(ps), "{}", fx.label);
        // A prompt past the window, prefilled in chunks, then decoded past another window:
        // the window rules hold after every step (checked by prefill and decode).
        let prompt = text(0, 3 * fx.keep() + 1);
        let mut r = fx.admit(prompt.clone());
        fx.prefill(&mut r, ps as usize + 3);
        let decoded = fx.keep() + 2;
        fx.decode(&mut r, decoded, 5_000);
        fx.check_accounting(&[&r]);
        // Its text is cached (SWA live for the last window only); a follow-up turn finds
        // it.
        fx.cache.cache_finished(r).unwrap();
        fx.step();
        let turn = concat(&concat(&prompt, &text(5_000, decoded)), &text(9_000, 3));
        let hit = fx.cache.match_prefix(turn);
        assert!(hit.cached_tokens() > 0, "{}", fx.label);
        let mut again = fx.cache.admit(hit).unwrap();
        let n = again.remaining_prefill();
        fx.prefill(&mut again, n);
        fx.teardown(vec![again]);
    });
}

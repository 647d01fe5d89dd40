//! Recurrent-state reuse (SGLang #22935, #38625): a request saves its state where later
//! prompts are likely to leave its path (its branching point, its prompt's end, the
//! checkpoint grid), `cache_unfinished` hands those states to the tree while it still
//! runs, and a state written by the step in flight ends matches only after the step
//! boundary. Every case on both layouts, a FULL + Mamba and a tri-pool model, at the
//! matrix's page sizes, with conservation checked at every boundary.

mod common;

use common::{LAYOUTS, TINY_MAMBA, TINY_TRI, page_sizes};
use unikv::radix::StateRole;
use unikv::{HybridCache, Layout, ModelSpec, Request, TokenId};

/// Tokens shared by the prompts (the seed load test's system prompt).
const SHARED: usize = 4096;

fn cache(model: ModelSpec, layout: Layout, ps: u32) -> HybridCache {
    HybridCache::builder()
        .model(model)
        .page_size(ps)
        .memory_bytes(64 << 20)
        .layout(layout)
        .build()
        .unwrap()
}

/// The shared prefix then `suffix` tokens of its own (`branch` names them).
fn prompt(branch: u32, suffix: usize) -> Vec<TokenId> {
    let mut p: Vec<TokenId> = (0..SHARED as u32).map(TokenId).collect();
    p.extend((0..suffix as u32).map(|i| TokenId(1_000_000 * (branch + 1) + i)));
    p
}

/// Admits `p` and prefills it in one chunk.
fn prefill(c: &mut HybridCache, p: Vec<TokenId>) -> Request {
    let hit = c.match_prefix(p);
    let mut req = c.admit(hit).unwrap();
    let n = req.remaining_prefill();
    c.alloc_extend(&mut req, n).unwrap();
    req
}

/// [`prefill`], then caches it unfinished (the scheduler's order: every chunk is cached at
/// once).
fn start(c: &mut HybridCache, p: Vec<TokenId>) -> Request {
    let mut req = prefill(c, p);
    c.cache_unfinished(&mut req).unwrap();
    req
}

fn decode(c: &mut HybridCache, req: &mut Request, n: u32) {
    for t in 0..n {
        c.alloc_decode(&mut [&mut *req], &[TokenId(7_000_000 + t)])
            .unwrap();
        c.step_boundary().unwrap();
    }
}

/// Runs `case` for every model, layout and page size.
fn each(case: impl Fn(&mut HybridCache, &str, usize)) {
    for model in [TINY_MAMBA, TINY_TRI] {
        for layout in LAYOUTS {
            for ps in page_sizes() {
                let mut c = cache(model, layout, ps);
                let label = format!("{} {} ps {ps}", model.name, layout.as_str());
                case(&mut c, &label, ps as usize);
                let s = c.stats();
                assert_eq!(s.live_requests, 0, "{label}");
                c.evict_all().unwrap();
                c.step_boundary().unwrap();
                let s = c.stats();
                assert_eq!(
                    (s.mamba.available_pages, s.full.available_pages),
                    (s.mamba.total_pages, s.full.total_pages),
                    "{label}: every slot and page is free again"
                );
            }
        }
    }
}

/// #22935: two prompts share 4,096 tokens, then diverge. The second resumes from the
/// first's state at the shared prefix rounded down to the grid, while the first is still
/// decoding.
#[test]
fn a_second_prompt_sharing_a_prefix_resumes_from_the_first_ones_state() {
    each(|c, label, _| {
        let mut a = start(c, prompt(0, 100));
        c.step_boundary().unwrap();
        decode(c, &mut a, 3);
        let hit = c.match_prefix(prompt(1, 200));
        assert_eq!(hit.kv_hit_tokens(), SHARED, "{label}");
        assert_eq!(hit.cached_tokens(), SHARED, "{label}: a grid multiple");
        assert_eq!(hit.recomputed_tokens(), 0, "{label}");
        let b = c.admit(hit).unwrap();
        assert_eq!(b.cached_at_admission(), SHARED);
        c.release(b).unwrap();
        c.cache_finished(a).unwrap();
        c.step_boundary().unwrap();
    });
}

/// A state the step in flight writes ends no match before the step boundary (a request
/// admitted in the same step would copy it before it is written), and one after.
#[test]
fn a_state_written_in_the_current_step_is_matched_only_after_the_boundary() {
    each(|c, label, _| {
        let a = start(c, prompt(0, 100));
        let same_step = c.match_prefix(prompt(1, 200));
        assert_eq!(same_step.kv_hit_tokens(), SHARED, "{label}");
        assert_eq!(
            same_step.cached_tokens(),
            0,
            "{label}: the state is in flight"
        );
        drop(same_step);
        c.step_boundary().unwrap();
        let next_step = c.match_prefix(prompt(1, 200));
        assert_eq!(next_step.cached_tokens(), SHARED, "{label}");
        drop(next_step);
        c.release(a).unwrap();
        c.step_boundary().unwrap();
    });
}

/// A long suffix: the first request saves no state at the shared prefix (its states are
/// at its own end and deepest grid point), so the second hits the KV only, recomputes it
/// and saves its branching point; the third sharing the branch hits all of it.
#[test]
fn the_third_request_sharing_a_branch_hits_all_of_it() {
    each(|c, label, ps| {
        let suffix = 1000usize.max(3 * ps);
        let a = start(c, prompt(0, suffix));
        c.step_boundary().unwrap();
        let hit = c.match_prefix(prompt(1, suffix));
        assert_eq!(hit.kv_hit_tokens(), SHARED, "{label}");
        assert!(
            hit.cached_tokens() < SHARED,
            "{label}: no state at the branch"
        );
        drop(hit);
        let mut b = prefill(c, prompt(1, suffix));
        assert_eq!(b.kv_hit_at_admission(), SHARED);
        assert!(
            b.checkpoint_writes().iter().any(|w| w.at_len == SHARED),
            "{label}: the branching point is saved: {:?}",
            b.checkpoint_writes()
        );
        c.cache_unfinished(&mut b).unwrap();
        c.step_boundary().unwrap();
        let hit = c.match_prefix(prompt(2, suffix));
        assert_eq!(hit.cached_tokens(), SHARED, "{label}");
        drop(hit);
        for r in [a, b] {
            c.cache_finished(r).unwrap();
        }
        c.step_boundary().unwrap();
    });
}

/// Evicting the KV under a state drops the state with it: no state outlives its path.
#[test]
fn evicting_kv_drops_the_states_on_it() {
    each(|c, label, _| {
        let a = start(c, prompt(0, 100));
        c.cache_finished(a).unwrap();
        c.step_boundary().unwrap();
        let s = c.stats();
        assert!(s.mamba.evictable_pages >= 2, "{label}: states cached");
        c.evict_all().unwrap();
        c.step_boundary().unwrap();
        let s = c.stats();
        assert_eq!(s.mamba.evictable_pages, 0, "{label}");
        assert_eq!(s.mamba.available_pages, s.mamba.total_pages, "{label}");
    });
}

/// An abort between a checkpoint's planning (its slot written by the step's forward) and
/// its insert returns every slot.
#[test]
fn an_abort_between_a_checkpoint_write_and_its_insert_leaks_no_slot() {
    each(|c, label, _| {
        let a = prefill(c, prompt(0, 100));
        assert_eq!(a.checkpoint_writes().len(), 2, "{label}");
        assert_eq!(a.state_slots().len(), 3, "{label}");
        c.release(a).unwrap();
        c.step_boundary().unwrap();
        let s = c.stats();
        assert_eq!(s.mamba.held_pages, 0, "{label}");
        assert_eq!(s.mamba.available_pages, s.mamba.total_pages, "{label}");
    });
}

/// A decoding request rewrites one checkpoint slot: it never holds more than its running
/// slot and one checkpoint once its prefill's states are in the tree.
#[test]
fn a_decoding_request_rewrites_one_checkpoint_slot() {
    each(|c, label, ps| {
        let mut a = start(c, prompt(0, 100));
        c.step_boundary().unwrap();
        assert_eq!(a.state_slots().len(), 1, "{label}: handed to the tree");
        let grid = 256usize.div_ceil(ps) * ps;
        let steps = (3 * grid) as u32;
        let mut crossed = 0;
        for t in 0..steps {
            c.alloc_decode(&mut [&mut a], &[TokenId(7_000_000 + t)])
                .unwrap();
            crossed += a.checkpoint_writes().len();
            assert!(a.state_slots().len() <= 2, "{label}");
            c.step_boundary().unwrap();
        }
        assert!(crossed >= 2, "{label}: {crossed} grid points crossed");
        c.cache_finished(a).unwrap();
        c.step_boundary().unwrap();
    });
}

/// A decoding request's checkpoint is best effort: with no slot to save it in (the slot
/// pool full of running requests, no cached state to evict) the decode still succeeds
/// and saves nothing, where a prefill chunk's checkpoints, which later prompts resume
/// from and `can_admit` priced, fail the allocation like missing KV. (The static layout:
/// its slot pool fills up independently of the KV.)
#[test]
fn a_decode_checkpoint_never_costs_the_decode_its_memory() {
    let layout = LAYOUTS[1];
    assert!(matches!(layout, Layout::Static { .. }));
    for model in [TINY_MAMBA, TINY_TRI] {
        for ps in page_sizes() {
            let label = format!("{} ps {ps}", model.name);
            let mut c = cache(model, layout, ps);
            let c = &mut c;
            let grid = 256usize.div_ceil(ps as usize) * ps as usize;
            let mut a = start(c, prompt(0, 100));
            c.step_boundary().unwrap();
            let next_grid = (a.len() / grid + 1) * grid;
            let to_go = (next_grid - 1 - a.len()) as u32;
            decode(c, &mut a, to_go);
            c.evict_all().unwrap();
            let hit = c.match_prefix(prompt(1, 2 * grid));
            let mut b = c.admit(hit).unwrap();
            let mut fillers = Vec::new();
            for i in 0.. {
                let hit = c.match_prefix(vec![TokenId(9_000_000 + i)]);
                match c.admit(hit) {
                    Ok(r) => fillers.push(r),
                    Err(unikv::Error::OutOfMemory { .. }) => break,
                    Err(e) => panic!("{label}: {e}"),
                }
            }
            assert_eq!(c.stats().mamba.available_pages, 0, "{label}: no slot left");

            c.alloc_decode(&mut [&mut a], &[TokenId(8_000_000)])
                .unwrap_or_else(|e| panic!("{label}: the decode failed for its checkpoint: {e}"));
            assert_eq!(a.len(), next_grid, "{label}");
            assert!(a.checkpoint_writes().is_empty(), "{label}: nothing saved");
            assert_eq!(a.state_slots().len(), 1, "{label}");

            let before = b.len();
            let n = b.remaining_prefill();
            assert!(
                matches!(
                    c.alloc_extend(&mut b, n),
                    Err(unikv::Error::OutOfMemory { .. })
                ),
                "{label}: a prefill's checkpoints are required"
            );
            assert_eq!(
                b.len(),
                before,
                "{label}: the failed extend changed nothing"
            );

            for r in fillers.into_iter().chain([b]) {
                c.release(r).unwrap();
            }
            c.cache_finished(a).unwrap();
            c.step_boundary().unwrap();
            c.evict_all().unwrap();
            c.step_boundary().unwrap();
            let s = c.stats();
            assert_eq!(s.mamba.available_pages, s.mamba.total_pages, "{label}");
        }
    }
}

/// The states a request hands the tree carry their worth: the grid points inside its
/// prompt are [`StateRole::Grid`] (Mamba eviction frees them first), its prompt's last
/// whole page and every state beyond it (a decode's checkpoint, the state at its end)
/// are anchors, where a next turn resumes.
#[test]
fn grid_states_inside_the_prompt_are_marked_and_the_prompt_end_and_beyond_are_anchors() {
    each(|c, label, ps| {
        let p = prompt(0, 100);
        let prompt_page = p.len() / ps * ps;
        let roles = |c: &HybridCache| -> Vec<(usize, StateRole)> {
            let mut states: Vec<(usize, StateRole)> = c
                .tree()
                .nodes()
                .iter()
                .filter_map(|n| Some((n.start.get() + n.key.len(), n.mamba_role?)))
                .collect();
            states.sort_unstable_by_key(|s| s.0);
            states
        };
        let mut a = start(c, p);
        c.step_boundary().unwrap();
        let after_prefill = roles(c);
        assert_eq!(
            after_prefill
                .iter()
                .filter(|s| s.1 == StateRole::Grid)
                .count(),
            1,
            "{label}: {after_prefill:?}"
        );
        // Past the next grid point, then finished: its decode checkpoint is an anchor.
        decode(c, &mut a, 160);
        c.cache_finished(a).unwrap();
        c.step_boundary().unwrap();
        let states = roles(c);
        assert!(
            states.iter().any(|s| s.0 > prompt_page),
            "{label}: {states:?}"
        );
        for &(at, role) in &states {
            let expected = if at < prompt_page {
                StateRole::Grid
            } else {
                StateRole::Anchor
            };
            assert_eq!(role, expected, "{label}: the state at {at} of {states:?}");
        }
    });
}

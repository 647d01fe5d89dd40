//! A shared system prompt served by chunked prefill (issue #36): six requests one after
//! another, each the same 3,000-token system prompt plus its own 600-token suffix,
//! prefilled in 512-token chunks with `cache_unfinished` after each chunk, 32 tokens
//! decoded, then `cache_finished`. The second request is the first whose prompt leaves
//! the first one's path: it saves the state at the grid point below where they diverge
//! (2,816 with the default 256-token interval, its `mamba_branching`), and every later
//! request must resume from it (or deeper), however many chunk states of its own the
//! second request pushed onto the same path past the per-path cap. Every recurrent model
//! of `ModelSpec`, both layouts, page sizes 1, 16 and 256, at invariant level Strict.
//!
//! The second request itself resumes from whatever the first one's cap left on the
//! shared part: while only one path exists nothing marks a state there as shared, and
//! the cap keeps that path's deepest states (at page size 256 the state at 2,816 is
//! among them, at 1 and 16 it is not). That is the branching-point mechanism's promise
//! (SGLang's `mamba_branching_seqlen` likewise): the first request to branch saves the
//! state, the ones after it reuse it.

mod common;

use common::{LAYOUTS, assert_all_free, assert_no_violations, concat, text};
use unikv::invariants::{Level, scoped_level};
use unikv::{HybridCache, Layout, ModelSpec, TokenId};

/// The system prompt every request starts with.
const SYSTEM: usize = 3_000;
/// Each request's own tokens after it.
const SUFFIX: usize = 600;
/// The scheduler's prefill chunk.
const CHUNK: usize = 512;
/// Tokens decoded before the request finishes.
const DECODE: u32 = 32;
/// Requests in the run.
const REQUESTS: u32 = 6;
/// The deepest checkpoint-grid point (the default interval, 256 tokens) at or below
/// where the prompts diverge: the state the second request saves for its branch.
const BRANCH_STATE: usize = 2_816;

/// The page sizes, plus the matrix cell's when it is another one.
fn page_sizes() -> Vec<u32> {
    let mut sizes = vec![1, 16, 256];
    if let Some(ps) = unikv::invariants::testing::matrix_page_size()
        && !sizes.contains(&ps)
    {
        sizes.push(ps);
    }
    sizes
}

/// The 4 GiB. Each model's KV (at most 64 KiB a token) for six requests and a
/// few dozen state slots (at most 100 MiB each) fit it, so no model needs another budget.
const MEMORY: u64 = 4 << 30;

/// What one request of the run saw.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// Tokens reused at admission (the recurrent hit).
    reused: usize,
    /// The FULL KV hit at admission.
    kv_hit: usize,
    /// Whether one of its prefill chunks saved the state at [`BRANCH_STATE`].
    saved_branch: bool,
}

/// Runs the six requests and returns what each saw.
fn run(model: ModelSpec, layout: Layout, ps: u32, label: &str) -> Vec<Seen> {
    let mut c = HybridCache::builder()
        .model(model)
        .page_size(ps)
        .memory_bytes(MEMORY)
        .layout(layout)
        .build()
        .unwrap();
    let system = text(0, SYSTEM);
    let mut hits = Vec::new();
    for r in 0..REQUESTS {
        let prompt = concat(&system, &text(1_000_000 * (r + 1), SUFFIX));
        let hit = c.match_prefix(prompt);
        let mut req = c.admit(hit).unwrap();
        let mut seen = Seen {
            reused: req.cached_at_admission(),
            kv_hit: req.kv_hit_at_admission(),
            saved_branch: false,
        };
        while req.remaining_prefill() > 0 {
            let n = req.remaining_prefill().min(CHUNK);
            c.alloc_extend(&mut req, n)
                .unwrap_or_else(|e| panic!("{label} request {r}: {e}"));
            seen.saved_branch |= req
                .checkpoint_writes()
                .iter()
                .any(|w| w.at_len == BRANCH_STATE);
            c.cache_unfinished(&mut req).unwrap();
            c.step_boundary().unwrap();
        }
        hits.push(seen);
        for t in 0..DECODE {
            c.alloc_decode(&mut [&mut req], &[TokenId(9_000_000 + t)])
                .unwrap_or_else(|e| panic!("{label} request {r}: {e}"));
            c.step_boundary().unwrap();
        }
        c.cache_finished(req).unwrap();
        c.step_boundary().unwrap();
    }
    assert_no_violations(&c, label);
    c.evict_all().unwrap();
    c.step_boundary().unwrap();
    assert_all_free(&c.stats(), label);
    hits
}

/// The second request keeps the whole system prompt's KV and saves the state at the
/// branch (or resumes from it); requests 3–6 resume from it (or deeper). Every cell
/// runs; the failure lists them all.
#[test]
fn every_request_after_the_first_branch_resumes_from_its_state() {
    scoped_level(Level::Strict, || {
        let mut failed = Vec::new();
        for model in [
            ModelSpec::QWEN3_NEXT_80B_A3B,
            ModelSpec::NEMOTRON_H_8B,
            ModelSpec::SYNTHETIC_TRI,
        ] {
            for layout in LAYOUTS {
                for ps in page_sizes() {
                    let label = format!("{} {} ps {ps}", model.name, layout.as_str());
                    let seen = run(model, layout, ps, &label);
                    let kv_hit = SYSTEM / ps as usize * ps as usize;
                    let first = (seen[0].reused, seen[0].kv_hit) == (0, 0);
                    // At page size 256 the first request's state at the branch survives its
                    // cap, and the second resumes from it instead of saving it again.
                    let second = seen[1].kv_hit == kv_hit
                        && (seen[1].saved_branch || seen[1].reused >= BRANCH_STATE);
                    let later = seen[2..]
                        .iter()
                        .all(|s| s.kv_hit == kv_hit && s.reused >= BRANCH_STATE);
                    if !first || !second || !later {
                        let per_request: Vec<_> = seen
                            .iter()
                            .map(|s| (s.reused, s.kv_hit, s.saved_branch))
                            .collect();
                        failed.push(format!("{label}: {per_request:?}"));
                    }
                }
            }
        }
        assert!(
            failed.is_empty(),
            "per request (reused, KV hit, saved the branch state): the second must hit \
             {SYSTEM} rounded down to the page and save the state at {BRANCH_STATE} (or \
             resume from it), the later ones resume from it or deeper:\n{}",
            failed.join("\n")
        );
    });
}

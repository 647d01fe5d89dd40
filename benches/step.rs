//! Facade benchmarks: the allocator + tree CPU time of one scheduler step
//! (the target: a decode step of a batch of 256 at page size 1 within 20 µs), the
//! same for a Mamba hybrid, the lifecycle operations around it and a match against the
//! shared-prefix preset's tree. Run with
//! `cargo bench -p unikv --bench step`.

mod common;

use common::{LAYOUTS, QWEN3_NEXT_SCALED_STATE, prefilled};
use divan::Bencher;
use unikv::{HybridCache, Layout, ModelSpec, Request, TokenId};

fn main() {
    divan::main();
}

const BATCH: usize = 256;
const PROMPT: usize = 512;

/// The synthetic tri-pool model with its recurrent state scaled down as
/// [`QWEN3_NEXT_SCALED_STATE`]'s and gpt-oss's window of 128 tokens, so that decoding
/// releases SWA as it goes (with the synthetic 1,024 the static layout's small SWA pool
/// would run out within the bench's iterations).
const SYNTHETIC_TRI_SCALED_STATE: ModelSpec = ModelSpec {
    name: "synthetic-tri (scaled state, window 128)",
    recurrent: QWEN3_NEXT_SCALED_STATE.recurrent,
    window: 128,
    draft_layers: 0,
    ..ModelSpec::SYNTHETIC_TRI
};

/// A cache of `model` with `BATCH` requests past prefill, decoding. Prompts are
/// `PROMPT` tokens, half that for the tri-pool model: its static layout's SWA pool (at
/// 16 GiB, after the reference's state share) cannot hold 256 whole prompts before their
/// window release, and the CPU device cannot map a larger budget on this machine.
fn decoding_model(model: ModelSpec, layout: Layout, page_size: u32) -> (HybridCache, Vec<Request>) {
    let prompt_len = if model.swa_layers > 0 && model.has_recurrent_state() {
        PROMPT / 2
    } else {
        PROMPT
    };
    let mut cache = HybridCache::builder()
        .model(model)
        .page_size(page_size)
        .memory_bytes(16 << 30)
        .layout(layout)
        .build()
        .expect("the cache builds");
    let requests = prefilled(&mut cache, BATCH, prompt_len, prompt_len);
    (cache, requests)
}

/// One decode step of `BATCH` requests of `model`: `alloc_decode` for the batch (with
/// each request's window release and checkpoint bookkeeping) and the step boundary
/// (deferred frees, conservation of every side, mirror upload, invariant poll).
fn decode_step(bencher: Bencher, model: ModelSpec, layout: &str, page_size: u32) {
    let layout = LAYOUTS
        .iter()
        .find(|(name, _)| *name == layout)
        .expect("a layout")
        .1;
    let (mut cache, mut requests) = decoding_model(model, layout, page_size);
    let tokens = vec![TokenId(7); BATCH];
    bencher.bench_local(|| {
        let mut batch: Vec<&mut Request> = requests.iter_mut().collect();
        cache.alloc_decode(&mut batch, &tokens).expect("decoded");
        cache.step_boundary().expect("a clean step");
    });
}

/// One decode step of 256 requests of gpt-oss-20b.
#[divan::bench(args = [("static", 1), ("unified", 1), ("static", 256), ("unified", 256)], sample_count = 200)]
fn decode_step_batch_256(bencher: Bencher, (layout, page_size): (&str, u32)) {
    decode_step(bencher, ModelSpec::GPT_OSS_20B, layout, page_size);
}

/// One decode step of 256 requests of a Mamba hybrid (Qwen3-Next's FULL layers, three
/// state slots a request, a checkpoint every 256 tokens).
#[divan::bench(args = [("static", 1), ("unified", 1), ("static", 64), ("unified", 64)], sample_count = 200)]
fn mamba_decode_step_batch_256(bencher: Bencher, (layout, page_size): (&str, u32)) {
    decode_step(bencher, QWEN3_NEXT_SCALED_STATE, layout, page_size);
}

/// One decode step of 256 requests of the tri-pool model (FULL, SWA and recurrent state;
/// on the unified layout SWA floats between the slots and FULL).
#[divan::bench(args = [("static", 1), ("unified", 1), ("static", 64), ("unified", 64)], sample_count = 200)]
fn tri_decode_step_batch_256(bencher: Bencher, (layout, page_size): (&str, u32)) {
    decode_step(bencher, SYNTHETIC_TRI_SCALED_STATE, layout, page_size);
}

/// Admission of a 4,096-token prompt whose first 4,032 tokens are cached: match, admit,
/// prefill the rest, release.
#[divan::bench(args = ["static", "unified"], sample_count = 100)]
fn admit_with_hit_and_release(bencher: Bencher, layout: &str) {
    let layout = LAYOUTS
        .iter()
        .find(|(name, _)| *name == layout)
        .expect("a layout")
        .1;
    let mut cache = HybridCache::builder()
        .memory_bytes(4 << 30)
        .layout(layout)
        .build()
        .expect("the cache builds");
    let system: Vec<TokenId> = (0..4_032).map(TokenId).collect();
    let hit = cache.match_prefix(system.clone());
    let mut seed = cache.admit(hit).expect("admitted");
    cache.alloc_extend(&mut seed, 4_032).expect("prefilled");
    cache.cache_finished(seed).expect("cached");
    cache.step_boundary().expect("a clean step");
    let mut prompt = system;
    prompt.extend((0..64).map(|t| TokenId(900_000 + t)));
    bencher.bench_local(|| {
        let hit = cache.match_prefix(prompt.clone());
        let mut req = cache.admit(hit).expect("admitted");
        let rest = req.remaining_prefill();
        cache.alloc_extend(&mut req, rest).expect("prefilled");
        cache.release(req).expect("released");
        cache.step_boundary().expect("a clean step");
    });
}

/// A match against the shared-prefix preset's tree (a 4,096-token system prompt cached
/// with 64 finished requests' own 128 tokens below it), as a scheduler runs one for every
/// waiting request each step: match a new 4,224-token prompt sharing the system prompt
/// and drop the match (the request waits). gpt-oss-20b, unified.
#[divan::bench(args = [1, 256], sample_count = 200)]
fn match_shared_prefix(bencher: Bencher, page_size: u32) {
    let mut cache = HybridCache::builder()
        .page_size(page_size)
        .memory_bytes(4 << 30)
        .layout(Layout::Unified)
        .build()
        .expect("the cache builds");
    let system: Vec<TokenId> = (0..4_096).map(TokenId).collect();
    let with_suffix = |branch: u32| {
        let mut p = system.clone();
        p.extend((0..128).map(|t| TokenId(1_000_000 * (branch + 1) + t)));
        p
    };
    for branch in 0..64 {
        let hit = cache.match_prefix(with_suffix(branch));
        let mut req = cache.admit(hit).expect("admitted");
        let rest = req.remaining_prefill();
        cache.alloc_extend(&mut req, rest).expect("prefilled");
        cache.cache_finished(req).expect("cached");
        cache.step_boundary().expect("a clean step");
    }
    let prompt = with_suffix(1_000);
    assert_eq!(cache.match_prefix(prompt.clone()).cached_tokens(), 4_096);
    bencher
        .with_inputs(|| prompt.clone())
        .bench_local_values(|p| drop(cache.match_prefix(p)));
}

//! A speculative verify step's host cost against a plain decode step's, in the same run:
//! 256 decoding requests, chain drafts of `k = 4`. A decode step is `alloc_decode`, the
//! step metadata and the step boundary; a verify step is `alloc_verify` (5 rows a
//! request), the step metadata of its 5 positions (the rows attention reads), the verify
//! metadata (built and translated: write ids, draft window, states), `settle` (accepted
//! counts cycling through 1..=5, so tails are freed) and the step boundary. Thread CPU time per step,
//! median of the measured steps; prints one line per case and the ratio (issue 29's bar:
//! at most 2). Run with `cargo bench -p unikv --bench verify`.

mod common;

use common::{LAYOUTS, QWEN3_NEXT_SCALED_STATE, median, prefilled};
use std::time::Duration;
use unikv::kernels::thread_cpu_time;
use unikv::{
    Accepted, Draft, HybridCache, Layout, ModelSpec, Request, Speculation, StepMetadata, TokenId,
    VerifyMetadata,
};

const BATCH: usize = 256;
const PROMPT: usize = 512;
const K: usize = 4;
const WARMUP: usize = 10;
const STEPS: usize = 100;

fn main() {
    println!(
        "{:<36} {:>8} {:>4} {:>12} {:>12} {:>7}",
        "model", "layout", "ps", "decode µs", "verify µs", "ratio"
    );
    for (model, sizes) in [
        (ModelSpec::GPT_OSS_20B, [1u32, 256]),
        (QWEN3_NEXT_SCALED_STATE, [1, 64]),
    ] {
        for (name, layout) in LAYOUTS {
            for ps in sizes {
                let decode = median(decode_steps(model, layout, ps));
                let verify = median(verify_steps(model, layout, ps));
                println!(
                    "{:<36} {:>8} {:>4} {:>12.1} {:>12.1} {:>7.2}",
                    model.name,
                    name,
                    ps,
                    decode.as_secs_f64() * 1e6,
                    verify.as_secs_f64() * 1e6,
                    verify.as_secs_f64() / decode.as_secs_f64()
                );
            }
        }
    }
}

/// A cache with `BATCH` requests past prefill.
fn decoding(model: ModelSpec, layout: Layout, ps: u32) -> (HybridCache, Vec<Request>) {
    let mut cache = HybridCache::builder()
        .model(model.with_draft_layers(1))
        .page_size(ps)
        .memory_bytes(16 << 30)
        .layout(layout)
        .speculation(Speculation::chain(K as u32))
        .build()
        .expect("the cache builds");
    let requests = prefilled(&mut cache, BATCH, PROMPT, PROMPT);
    (cache, requests)
}

fn decode_steps(model: ModelSpec, layout: Layout, ps: u32) -> Vec<Duration> {
    let (mut cache, mut requests) = decoding(model, layout, ps);
    let tokens = vec![TokenId(7); BATCH];
    let mut meta = StepMetadata::new();
    let mut times = Vec::with_capacity(STEPS);
    for step in 0..WARMUP + STEPS {
        let start = thread_cpu_time();
        let mut batch: Vec<&mut Request> = requests.iter_mut().collect();
        cache.alloc_decode(&mut batch, &tokens).expect("decoded");
        let shape: Vec<(&Request, usize)> = requests.iter().map(|r| (r, 1)).collect();
        cache.build_step_metadata(&mut meta, &shape).expect("built");
        cache.step_boundary().expect("a clean step");
        if step >= WARMUP {
            times.push(thread_cpu_time() - start);
        }
    }
    release(cache, requests);
    times
}

fn verify_steps(model: ModelSpec, layout: Layout, ps: u32) -> Vec<Duration> {
    let (mut cache, mut requests) = decoding(model, layout, ps);
    let drafts = vec![Draft::Chain { k: K }; BATCH];
    let accepted_tokens: Vec<TokenId> = (0..=K as u32).map(TokenId).collect();
    let mut meta = StepMetadata::new();
    let mut vmeta = VerifyMetadata::new(BATCH);
    cache.reserve_verify_metadata(&vmeta).unwrap();
    let mut times = Vec::with_capacity(STEPS);
    for step in 0..WARMUP + STEPS {
        let accepted: Vec<Accepted<'_>> = (0..BATCH)
            .map(|r| Accepted::chain(&accepted_tokens[..1 + (r + step) % (K + 1)]))
            .collect();
        let start = thread_cpu_time();
        let mut batch: Vec<&mut Request> = requests.iter_mut().collect();
        cache.alloc_verify(&mut batch, &drafts).expect("allocated");
        let shape: Vec<(&Request, usize)> = requests.iter().map(|r| (r, 1 + K)).collect();
        cache.build_step_metadata(&mut meta, &shape).expect("built");
        let batch: Vec<&Request> = requests.iter().collect();
        cache
            .build_verify_metadata(&mut vmeta, &batch)
            .expect("built");
        cache
            .translate_verify(&mut vmeta, None)
            .expect("translated");
        let mut batch: Vec<&mut Request> = requests.iter_mut().collect();
        cache.settle(&mut batch, &accepted).expect("settled");
        cache.step_boundary().expect("a clean step");
        if step >= WARMUP {
            times.push(thread_cpu_time() - start);
        }
    }
    release(cache, requests);
    times
}

fn release(mut cache: HybridCache, requests: Vec<Request>) {
    for req in requests {
        cache.release(req).expect("released");
    }
}

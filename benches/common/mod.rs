//! What the facade's benchmarks share: the models and layouts they time, the set-up of
//! a batch of requests past prefill, and the median of their samples.

use std::time::Duration;
use unikv::{HybridCache, Layout, ModelSpec, RecurrentState, Request, TokenId};

/// The layouts every benchmark times: static (SWA sized at 0.8 of FULL's tokens) and
/// unified.
pub const LAYOUTS: [(&str, Layout); 2] = [
    (
        "static",
        Layout::Static {
            swa_full_tokens_ratio: 0.8,
        },
    ),
    ("unified", Layout::Unified),
];

/// Admits `batch` requests of `prompt_len` tokens each (distinct prompts: no hits) and
/// prefills them in chunks of at most `chunk` tokens, a step boundary after each chunk.
/// Panics with the request and the error when the cache cannot hold them.
pub fn prefilled(
    cache: &mut HybridCache,
    batch: usize,
    prompt_len: usize,
    chunk: usize,
) -> Vec<Request> {
    let mut requests = Vec::with_capacity(batch);
    for r in 0..batch as u32 {
        let prompt: Vec<TokenId> = (0..prompt_len as u32)
            .map(|t| TokenId(r * 1_000_000 + t))
            .collect();
        let hit = cache.match_prefix(prompt);
        let mut req = cache.admit(hit).expect("admitted");
        while req.remaining_prefill() > 0 {
            let n = req.remaining_prefill().min(chunk);
            if let Err(e) = cache.alloc_extend(&mut req, n) {
                panic!("request {r} of {batch}, prompt of {prompt_len}: prefill: {e}");
            }
            cache.step_boundary().expect("a clean step");
        }
        requests.push(req);
    }
    requests
}

/// The median of `samples` (the upper one of an even count).
// Each bench compiles this file on its own; `step` times through divan and takes no median.
#[allow(dead_code)]
pub fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

/// Qwen3-Next-80B-A3B's layers and KV rows with its recurrent state scaled down to 48
/// bytes a layer, so that 256 requests' slots fit a CPU device's host buffer (the real
/// state is 77 MB a request). The allocator's and tree's work is per slot, not per byte:
/// a step's CPU time is the real model's.
pub const QWEN3_NEXT_SCALED_STATE: ModelSpec = ModelSpec {
    name: "qwen3-next-80b-a3b (scaled state)",
    recurrent: RecurrentState {
        conv_channels: 4,
        conv_kernel: 4,
        heads: 1,
        head_dim: 2,
        state_size: 3,
        conv_dtype_bytes: 2,
        state_dtype_bytes: 4,
    },
    ..ModelSpec::QWEN3_NEXT_80B_A3B
};

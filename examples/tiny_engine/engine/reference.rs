//! The reference: each request alone, prefilled in one pass, with plain contiguous K/V.

use super::config::RunConfig;
use super::model::{KV, KvStore, LayerKind, States, Weights, argmax, forward, zero_states};
use super::workload::{Job, Output};
use std::time::{Duration, Instant};
use unikv::TokenId;

/// Plain contiguous K/V per attention layer of one request.
#[derive(Default)]
struct ContiguousKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl ContiguousKv {
    /// The vector of an attention layer: FULL layers first, then SWA.
    fn slot(layer: LayerKind) -> usize {
        match layer {
            LayerKind::Full(i) => i as usize,
            LayerKind::Swa(i) => 2 + i as usize,
            LayerKind::Recurrent(_) => unreachable!("no K/V"),
        }
    }
}

impl KvStore for ContiguousKv {
    fn write(&mut self, layer: LayerKind, pos: usize, k: &[f32], v: &[f32]) {
        let s = Self::slot(layer);
        if self.k.len() <= s {
            self.k.resize(s + 1, Vec::new());
            self.v.resize(s + 1, Vec::new());
        }
        assert_eq!(self.k[s].len(), pos * KV, "the reference writes in order");
        self.k[s].extend_from_slice(k);
        self.v[s].extend_from_slice(v);
    }

    fn read(&self, layer: LayerKind, pos: usize, k: &mut [f32], v: &mut [f32]) {
        let s = Self::slot(layer);
        k.copy_from_slice(&self.k[s][pos * KV..(pos + 1) * KV]);
        v.copy_from_slice(&self.v[s][pos * KV..(pos + 1) * KV]);
    }
}

/// The reference: `prompt` prefilled in one pass, then `max_new` greedy tokens, K/V in
/// contiguous vectors. Returns the output and the tokens it computed.
pub fn reference(w: &Weights, prompt: &[TokenId], max_new: usize) -> Output {
    let mut kv = ContiguousKv::default();
    let mut states = zero_states(w);
    let mut logits = forward(w, &mut kv, &mut states, prompt, 0, |_, _| {});
    let mut out = Output::default();
    let mut pos = prompt.len();
    loop {
        let next = argmax(&logits);
        out.tokens.push(next);
        if out.tokens.len() == max_new {
            out.logits = logits;
            return out;
        }
        logits = forward(w, &mut kv, &mut states, &[next], pos, |_, _| {});
        pos += 1;
    }
}

/// The recurrent states a contiguous forward of `prefix` from the initial state reaches:
/// what a request resuming after `prefix` must start from. Layers above the last
/// recurrent one cannot change a state, so the forward stops there (half the attention
/// of a debug-build test).
pub fn reference_state(w: &Weights, prefix: &[TokenId]) -> States {
    let below = w
        .kinds
        .iter()
        .rposition(|k| matches!(k, LayerKind::Recurrent(_)))
        .map_or(0, |last| last + 1);
    let w = w.first_layers(below);
    let mut kv = ContiguousKv::default();
    let mut states = zero_states(&w);
    forward(&w, &mut kv, &mut states, prefix, 0, |_, _| {});
    states
}

/// The reference outputs of every job, and their tokens per second. A job that never
/// arrived (a follow-up of an aborted turn) has an empty output.
pub fn reference_outputs(cfg: &RunConfig, jobs: &[Job]) -> (Vec<Output>, Duration, u64) {
    let weights = Weights::random(cfg.seed ^ 0x5eed, cfg.model);
    let started = Instant::now();
    let mut tokens = 0u64;
    let outputs = jobs
        .iter()
        .map(|j| {
            if j.prompt.is_empty() {
                return Output::default();
            }
            tokens += (j.prompt.len() + j.max_new - 1) as u64;
            reference(&weights, &j.prompt, j.max_new)
        })
        .collect();
    (outputs, started.elapsed(), tokens)
}

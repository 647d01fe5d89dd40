//! What a seed did ([`Outcome`]), or which check it broke and how to run it again
//! ([`Failure`]).

/// What a seed did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Steps run.
    pub steps: usize,
    /// Requests admitted (re-admissions after a retraction included).
    pub admitted: usize,
    /// Requests finished into the prefix cache.
    pub finished: usize,
    /// Requests aborted or retracted.
    pub released: usize,
    /// Prompt tokens served from the prefix cache.
    pub hit_tokens: usize,
    /// Faults injected, of both kinds (each one checked and retried).
    pub faults: usize,
    /// Of those, allocator calls refused through `wrap_allocator`.
    pub allocator_faults: usize,
    /// Token and state stamps read back and checked.
    pub stamps_checked: u64,
    /// Recurrent-state checkpoints the cache asked the engine to save.
    pub checkpoint_writes: u64,
    /// Forwards that saved more than one checkpoint of one request.
    pub multi_checkpoint_forwards: u64,
}

/// A seed that broke a check: the crate's error.
#[derive(Clone, Debug, thiserror::Error)]
#[error("seed {seed} failed at step {step}: {what}\n  reproduce: cargo xtask sim --seed {seed}")]
pub struct Failure {
    /// The seed.
    pub seed: u64,
    /// The step it broke in.
    pub step: usize,
    /// What broke.
    pub what: String,
}

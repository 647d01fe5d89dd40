//! What a seed did ([`Outcome`]), or which check it broke and how to run it again
//! ([`Failure`]).

use std::fmt;

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

/// A seed that broke a check.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The seed.
    pub seed: u64,
    /// The step it broke in.
    pub step: usize,
    /// What broke.
    pub what: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {} failed at step {}: {}\n  reproduce: cargo xtask sim --seed {}",
            self.seed, self.step, self.what, self.seed
        )
    }
}

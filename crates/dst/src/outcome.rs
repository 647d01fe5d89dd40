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
    /// Verify steps (`alloc_verify` calls that succeeded, each for a batch).
    pub verify_steps: u64,
    /// Requests verified in those steps.
    pub verifies: u64,
    /// Of those, draft trees (the rest chains).
    pub tree_verifies: u64,
    /// Verify steps of a request settled.
    pub settles: u64,
    /// Of those, settled a step late: with a later verify of the request already
    /// allocated.
    pub late_settles: u64,
    /// Of the settled steps, those rolled back by the engine's replay of logged inputs
    /// (the rest copied the accepted state).
    pub replay_settles: u64,
    /// Of the checkpoints settlements saved, those a replay wrote.
    pub replayed_checkpoints_checked: u64,
    /// Tokens accepted by the settled steps.
    pub accepted_tokens: u64,
    /// Requests aborted with a verify step in flight.
    pub mid_verify_aborts: u64,
    /// Requests retracted (and queued again) with a verify step in flight.
    pub mid_verify_retractions: u64,
    /// Requests finished into the prefix cache with a verify step in flight.
    pub finished_mid_verify: u64,
    /// Wrong speculative calls (settling twice, accepting more than a verify's width, a
    /// bad parent array) refused with their typed error, changing nothing.
    pub refused_calls: u64,
    /// Settlements a fault struck after they took effect (copying checkpoints out).
    pub settle_faults_after_effect: u64,
    /// Checkpoints settlements saved (at the positions the accepted tokens crossed), each
    /// read back at once: its slot held the accepted prefix's state.
    pub settled_checkpoints_checked: u64,
    /// Verify metadata built (`build_verify_metadata`, each for a verify step's batch)
    /// and translated (`translate_verify`).
    pub verify_metadata_builds: u64,
    /// Translated verify ids (write ids, input states, group slots, padding) checked
    /// against the host tables.
    pub verify_ids_checked: u64,
    /// `compact_accepted` calls (one per verify step).
    pub compactions: u64,
    /// Faults injected into those three calls (each checked to change nothing, then
    /// retried).
    pub verify_call_faults: u64,
    /// Seeds run with a host tier.
    pub host_seeds: u64,
    /// Prompt tokens admissions loaded back from the host tier.
    pub host_hit_tokens: u64,
    /// Bytes written back to the host tier, and loaded back from it.
    pub host_written_bytes: u64,
    /// See [`Outcome::host_written_bytes`].
    pub host_loaded_bytes: u64,
    /// Write-backs the host skipped (no room, or a copy refused by a fault).
    pub host_refused_writes: u64,
    /// Queries of a host-tier copy's event that found it still in flight (its pages
    /// parked, its host path locked).
    pub host_copies_in_flight: u64,
    /// Requests released right after admission while their load-back was in flight.
    pub host_aborts_mid_load: u64,
}

impl Outcome {
    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &Outcome) {
        self.steps += o.steps;
        self.admitted += o.admitted;
        self.finished += o.finished;
        self.released += o.released;
        self.hit_tokens += o.hit_tokens;
        self.faults += o.faults;
        self.allocator_faults += o.allocator_faults;
        self.stamps_checked += o.stamps_checked;
        self.checkpoint_writes += o.checkpoint_writes;
        self.multi_checkpoint_forwards += o.multi_checkpoint_forwards;
        self.verify_steps += o.verify_steps;
        self.verifies += o.verifies;
        self.tree_verifies += o.tree_verifies;
        self.settles += o.settles;
        self.late_settles += o.late_settles;
        self.replay_settles += o.replay_settles;
        self.replayed_checkpoints_checked += o.replayed_checkpoints_checked;
        self.accepted_tokens += o.accepted_tokens;
        self.mid_verify_aborts += o.mid_verify_aborts;
        self.mid_verify_retractions += o.mid_verify_retractions;
        self.finished_mid_verify += o.finished_mid_verify;
        self.refused_calls += o.refused_calls;
        self.settle_faults_after_effect += o.settle_faults_after_effect;
        self.settled_checkpoints_checked += o.settled_checkpoints_checked;
        self.verify_metadata_builds += o.verify_metadata_builds;
        self.verify_ids_checked += o.verify_ids_checked;
        self.compactions += o.compactions;
        self.verify_call_faults += o.verify_call_faults;
        self.host_seeds += o.host_seeds;
        self.host_hit_tokens += o.host_hit_tokens;
        self.host_written_bytes += o.host_written_bytes;
        self.host_loaded_bytes += o.host_loaded_bytes;
        self.host_refused_writes += o.host_refused_writes;
        self.host_copies_in_flight += o.host_copies_in_flight;
        self.host_aborts_mid_load += o.host_aborts_mid_load;
    }
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

//! A request's state, held by the engine: a value that the cache's finishing methods
//! consume, so it cannot be used after release.

use unikv_mamba::{CheckpointWrite, PlanMarks};
use unikv_pools::{VirtualSlot, VirtualToken as PoolToken};
use unikv_radix::{LockHandle, MatchResult, TokenId};

/// The host part of a match ([`crate::PrefixMatch`]): positions `[device end, len)`
/// come from the host.
#[derive(Clone, Debug)]
pub(crate) struct HostMatch {
    /// The host tree's node the match ends at.
    pub(crate) node: unikv_radix::NodeId,
    /// Where the host match ends (beyond the device match).
    pub(crate) len: usize,
    /// The host tree's FULL hit.
    pub(crate) full_hit: usize,
    /// The host values of `[0, len)`.
    pub(crate) values: Vec<unikv_radix::VirtualToken>,
    /// The host state unit at `len` (models with recurrent state).
    pub(crate) state: Option<u32>,
    /// Bytes its load-back copies.
    pub(crate) load_bytes: u64,
}

/// The result of [`crate::HybridCache::match_prefix`]: how much of a prompt the prefix
/// cache holds. Nothing is locked yet — dropping it aborts with nothing to undo.
#[derive(Debug)]
pub struct PrefixMatch {
    pub(crate) tokens: Vec<TokenId>,
    pub(crate) result: MatchResult,
    /// The part beyond `result` the host tier holds, when it has one.
    pub(crate) host: Option<HostMatch>,
    pub(crate) epoch: u64,
    pub(crate) cache: u64,
}

impl PrefixMatch {
    /// Tokens of the prompt the request reuses from the cache (whole pages), on the
    /// device and loaded back from the host: KV whose last window of SWA is cached and,
    /// for a model with recurrent layers, at whose end a state is cached (the request
    /// resumes from it).
    pub fn cached_tokens(&self) -> usize {
        self.host.as_ref().map_or(self.result.len.0, |h| h.len)
    }

    /// Of [`PrefixMatch::cached_tokens`], those the device holds.
    pub fn device_tokens(&self) -> usize {
        self.result.len.0
    }

    /// Of [`PrefixMatch::cached_tokens`], those admission loads back from the host tier.
    pub fn host_tokens(&self) -> usize {
        self.cached_tokens() - self.device_tokens()
    }

    /// Bytes admission copies from the host tier to load back
    /// [`PrefixMatch::host_tokens`]: their FULL pages, the SWA window's pages the host
    /// holds behind their end, and the state at it (0 without a host part).
    pub fn load_bytes(&self) -> u64 {
        self.host.as_ref().map_or(0, |h| h.load_bytes)
    }

    /// Tokens of the prompt whose FULL KV the cache holds (whole pages, device or host),
    /// at least [`PrefixMatch::cached_tokens`]. What lies beyond the cached tokens is
    /// recomputed ([`PrefixMatch::recomputed_tokens`]): the match could not end there (no
    /// state, or too little live SWA behind it).
    pub fn kv_hit_tokens(&self) -> usize {
        let host = self.host.as_ref().map_or(0, |h| h.full_hit);
        self.result.full_hit.0.max(host)
    }

    /// Tokens whose KV the cache holds but the request recomputes:
    /// [`PrefixMatch::kv_hit_tokens`] − [`PrefixMatch::cached_tokens`].
    pub fn recomputed_tokens(&self) -> usize {
        self.kv_hit_tokens() - self.cached_tokens()
    }

    /// The prompt's length.
    pub fn prompt_len(&self) -> usize {
        self.tokens.len()
    }

    /// Gives the prompt back (abort).
    pub fn into_tokens(self) -> Vec<TokenId> {
        self.tokens
    }
}

/// One admitted request. The engine holds it; every cache method that changes it takes
/// it by `&mut`, and [`crate::HybridCache::cache_finished`] and
/// [`crate::HybridCache::release`] consume it. Dropping it without either leaks its KV
/// (the cache's stats keep counting it as held).
#[derive(Debug)]
#[must_use = "a request must be finished or released, or its KV leaks"]
pub struct Request {
    pub(crate) id: u64,
    pub(crate) cache: u64,
    /// Prompt and generated tokens; the first `row.len()` have KV.
    pub(crate) tokens: Vec<TokenId>,
    /// Virtual token ids of the rows that have KV.
    pub(crate) row: Vec<PoolToken>,
    /// The tree owns rows `[0, protected)` (page-aligned).
    pub(crate) protected: usize,
    /// SWA of rows below the cursor is released (page-aligned, only moves up).
    pub(crate) cursor: usize,
    /// The lock on the tree node whose prefix the request uses.
    pub(crate) lock: Option<LockHandle>,
    pub(crate) window_lock_released: bool,
    pub(crate) cached_at_admission: usize,
    pub(crate) kv_hit_at_admission: usize,
    /// Its recurrent state slots (a model with Mamba/GDN layers).
    pub(crate) state: Option<RequestState>,
    /// Its unsettled verify steps, oldest first; their rows follow the settled ones.
    pub(crate) verifies: std::collections::VecDeque<crate::speculative::PendingVerify>,
}

/// The Mamba state slots a request owns.
#[derive(Debug)]
pub(crate) struct RequestState {
    /// The running state: the recurrent kernels read and update it every step; with
    /// speculation, settling copies the accepted position's state into it.
    pub(crate) running: VirtualSlot,
    /// Checkpoints written (or being written) that the prefix tree has not taken yet, in
    /// ascending position, each with the step whose forward writes it.
    pub(crate) held: Vec<(CheckpointWrite, u64)>,
    /// The checkpoints the last allocation asks the engine to write in this step's
    /// forward (still listed after the tree takes their slots).
    pub(crate) pending: Vec<CheckpointWrite>,
    /// What makes a position worth saving for this request.
    pub(crate) marks: PlanMarks,
}

impl RequestState {
    /// Every slot it owns: its running slot, then its checkpoints (the scratch groups
    /// of its unsettled verifies are the cache's, not its own).
    pub(crate) fn slots(&self) -> Vec<VirtualSlot> {
        let mut slots = vec![self.running];
        slots.extend(self.held.iter().map(|(w, _)| w.slot));
        slots
    }
}

impl Request {
    /// The cache-assigned id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Rows with KV: its settled tokens' and those its unsettled verify steps reserved
    /// ([`Request::settled_len`] without speculation).
    pub fn len(&self) -> usize {
        self.row.len()
    }

    /// Rows of settled tokens: every row but those its unsettled verify steps reserved.
    pub fn settled_len(&self) -> usize {
        self.row.len() - self.reserved_rows()
    }

    /// Rows its unsettled verify steps reserved (the worst case: every position of
    /// each accepted).
    pub fn reserved_rows(&self) -> usize {
        self.verifies.iter().map(|v| v.width).sum()
    }

    /// Its verify steps not settled yet ([`crate::HybridCache::settle`]).
    pub fn unsettled_verifies(&self) -> usize {
        self.verifies.len()
    }

    /// Whether no token has KV yet.
    pub fn is_empty(&self) -> bool {
        self.row.is_empty()
    }

    /// Prompt and generated tokens (the first [`Request::settled_len`] have KV; with
    /// speculation, accepted tokens join at [`crate::HybridCache::settle`]).
    pub fn tokens(&self) -> &[TokenId] {
        &self.tokens
    }

    /// Tokens still to prefill.
    pub fn remaining_prefill(&self) -> usize {
        self.tokens.len().saturating_sub(self.row.len())
    }

    /// The virtual token ids of its rows (what attention metadata is built from).
    pub fn row(&self) -> &[PoolToken] {
        &self.row
    }

    /// The window cursor: SWA of rows below it is released.
    pub fn window_cursor(&self) -> usize {
        self.cursor
    }

    /// Rows the prefix cache owns (`[0, protected)`).
    pub fn protected_len(&self) -> usize {
        self.protected
    }

    /// Tokens reused from the prefix cache when it was admitted.
    pub fn cached_at_admission(&self) -> usize {
        self.cached_at_admission
    }

    /// Tokens whose FULL KV the prefix cache held when it was admitted (at least
    /// [`Request::cached_at_admission`]; the difference was recomputed).
    pub fn kv_hit_at_admission(&self) -> usize {
        self.kv_hit_at_admission
    }

    /// Its running recurrent state slot (`None` for a model without recurrent layers):
    /// the slot the recurrent kernels read and update. At admission it holds a copy of
    /// the cached state its prefix ended at; without one (no hit) its bytes are whatever
    /// the slot last held (zeros only with `zero_on_handout`), so the kernel starts such
    /// a request from its initial state.
    pub fn state_slot(&self) -> Option<VirtualSlot> {
        self.state.as_ref().map(|s| s.running)
    }

    /// The checkpoints the engine writes in this step's forward, in ascending position:
    /// the state after `at_len` tokens goes into `slot`, a slot nothing else writes in
    /// that forward. Planned by the last allocation
    /// ([`unikv_mamba::StatePolicy::plan`]: the request's branching point, its prompt's
    /// end, grid points); empty when it planned none, or without the prefix cache.
    pub fn checkpoint_writes(&self) -> &[CheckpointWrite] {
        self.state.as_ref().map_or(&[], |s| &s.pending)
    }

    /// The checkpoints it holds that the prefix tree has not taken yet, in ascending
    /// position: the state after `at_len` tokens is in `slot` once the forward of the
    /// step that planned it ran ([`Request::checkpoint_writes`]). Settling a verify adds
    /// the checkpoints its accepted positions cross, copied out of the verify's scratch
    /// group at once (so never listed as writes). Empty without recurrent layers.
    pub fn held_checkpoints(&self) -> impl Iterator<Item = CheckpointWrite> + '_ {
        self.state
            .iter()
            .flat_map(|s| s.held.iter().map(|&(write, _)| write))
    }

    /// Every state slot it owns: its running slot, then the checkpoints the prefix tree
    /// has not taken yet (not the scratch groups its unsettled verifies write:
    /// [`Request::state_group`]).
    pub fn state_slots(&self) -> Vec<VirtualSlot> {
        self.state
            .as_ref()
            .map_or_else(Vec::new, RequestState::slots)
    }

    /// With speculation on a recurrent model, the slots of the scratch lane its newest
    /// unsettled verify writes. Under the copy rollback the state after its position `i`
    /// goes into the `i`-th slot, and settling copies the last accepted position's state
    /// into the running slot ([`Request::state_slot`], which no verify writes); under a
    /// [`crate::StateReplay`] the lane's log entries lie in these slots, shared with other
    /// verifies' lanes (the verify metadata names each entry). Empty with no verify in
    /// flight or without recurrent layers.
    pub fn state_group(&self) -> &[VirtualSlot] {
        self.verifies.back().map_or(&[], |v| &v.lane.slots)
    }

    /// The lane slots of all its unsettled verifies, oldest first (with counts a step
    /// late, the newest verify reads its input state from, or replays, the one before
    /// it).
    pub fn state_groups(&self) -> Vec<&[VirtualSlot]> {
        self.verifies.iter().map(|v| &v.lane.slots[..]).collect()
    }
}

//! What an engine exports about the cache.

/// One side's (sub-pool's) accounting, in pages. At a step boundary
/// `available + evictable + protected + held = total` exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideStats {
    /// `full`, `swa` or `mamba` (the Mamba side counts state slots as its pages).
    pub name: &'static str,
    /// The side's page capacity (conservation view).
    pub total_pages: usize,
    /// Pages not allocated.
    pub available_pages: usize,
    /// Pages the prefix cache holds unlocked (evictable).
    pub evictable_pages: usize,
    /// Pages the prefix cache holds locked by running requests.
    pub protected_pages: usize,
    /// Pages live requests hold outside the prefix cache.
    pub held_pages: usize,
    /// Bytes of one page envelope of this side.
    pub page_bytes: u64,
    /// Pages this side alone could get now, after compaction (what schedulers plan with).
    pub schedulable_pages: usize,
}

impl SideStats {
    /// Bytes in use (allocated pages × page bytes).
    pub fn used_bytes(&self) -> u64 {
        (self.total_pages - self.available_pages) as u64 * self.page_bytes
    }
}

/// Evictions by kind since the cache was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictionCounts {
    /// Whole nodes evicted (FULL, and SWA with them).
    pub full_nodes: u64,
    /// Tokens of those nodes.
    pub full_tokens: u64,
    /// Nodes whose SWA was released (tombstoned) while FULL stayed.
    pub swa_tombstones: u64,
    /// Tokens of those nodes.
    pub swa_tokens: u64,
    /// Cached Mamba states evicted (alone, or with their node).
    pub mamba_states: u64,
    /// Whole nodes evicted to make room for Mamba state slots (FULL as the byte donor).
    pub donor_nodes: u64,
}

/// A snapshot of the cache's accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheStats {
    /// Step boundaries passed.
    pub step: u64,
    /// The FULL side.
    pub full: SideStats,
    /// The SWA side (all zero for a model without sliding-window layers).
    pub swa: SideStats,
    /// The Mamba side, in state slots (all zero for a model without recurrent layers).
    pub mamba: SideStats,
    /// Requests admitted and not yet finished or released.
    pub live_requests: usize,
    /// Prompt tokens served from the prefix cache at admission (for a model with
    /// recurrent layers: resumed from a cached state).
    pub hit_tokens: u64,
    /// Prompt tokens whose FULL KV the prefix cache held at admission, at least
    /// `hit_tokens`: the difference was recomputed (no state, or too little live SWA,
    /// where the KV hit ended).
    pub kv_hit_tokens: u64,
    /// Prompt tokens admitted.
    pub admitted_prompt_tokens: u64,
    /// Evictions by kind.
    pub evictions: EvictionCounts,
    /// State slots of speculative verify scratch groups (counted in `mamba.held_pages`):
    /// the groups unsettled verifies write and those kept for the next ones.
    pub verify_scratch_slots: usize,
    /// The host tier's figures (`None` without one:
    /// [`crate::HybridCacheBuilder::host_memory_bytes`]).
    pub host: Option<HostStats>,
}

/// What [`crate::HybridCache::step_boundary`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepReport {
    /// The step that just ended (1-based).
    pub step: u64,
}

/// What the host tier did, for [`crate::CacheStats::host`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Bytes of the host buffer.
    pub total_bytes: u64,
    /// Bytes the host holds per kind: FULL pages, SWA pages, recurrent states.
    pub full_bytes: u64,
    /// See [`HostStats::full_bytes`].
    pub swa_bytes: u64,
    /// See [`HostStats::full_bytes`].
    pub state_bytes: u64,
    /// Most bytes the host held at once (all kinds).
    pub peak_bytes: u64,
    /// Prompt tokens admissions loaded back from the host.
    pub hit_tokens: u64,
    /// Bytes written back (device to host).
    pub written_bytes: u64,
    /// Bytes loaded back (host to device).
    pub loaded_bytes: u64,
    /// Copies issued (one per run of adjacent bytes).
    pub copies: u64,
    /// The largest single copy, in bytes.
    pub largest_copy: u64,
    /// Write-backs skipped because the host could not make room for them.
    pub refused_writes: u64,
}

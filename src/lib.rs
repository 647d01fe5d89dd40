//! unikv: GPU memory for hybrid LLMs — FULL attention, sliding-window attention (SWA) and
//! Mamba/GDN state in **one byte buffer** whose split follows the workload, with a
//! radix-tree prefix cache on top and no host sync on the scheduling path.
//!
//! This facade is the one crate an engine depends on. It re-exports the workspace crates:
//!
//! | module | crate | what it holds |
//! |---|---|---|
//! | [`invariants`] | `unikv-invariants` | named, levelled invariants (`UNIKV_INVARIANT_CHECK`) |
//! | [`kernels`] | `unikv-kernels` | the sync-free `Device` trait, CPU and CUDA backends, `SyncLedger` |
//! | [`pools`] | `unikv-pools` | the byte buffer, FULL/SWA sub-allocators and Mamba slots, the static baseline |
//! | [`mamba`] | `unikv-mamba` | the state geometry of a Mamba slot and the checkpoint policy |
//! | [`radix`] | `unikv-radix` | the prefix tree that emits actions |
//!
//! Call [`init`] once at start-up: it reports a bad `UNIKV_INVARIANT_CHECK` value or a
//! duplicate invariant name as an error instead of running on.
//!
//! # Invariants this crate keeps
//! - Every crate that declares invariants is linked, so the registry is complete: the
//!   facade names each crate's declarations in [`declared_invariants`] (inventory
//!   silently drops crates nothing references).
//! - Each [`HybridCache`] owns one invariant scope
//!   ([`HybridCache::invariant_scope`]), shared with its allocator (through any
//!   wrapper) and its tree and polled by its step boundary on every path: two caches in
//!   one process never see each other's breaches.

mod cache;
mod error;
mod invariants_decl;
mod model;
mod request;
mod speculative;
mod stats;
mod step;
mod tables;
mod verify;

pub use cache::{
    DEFAULT_EVICTION_INTERVAL, HostWritePolicy, HybridCache, HybridCacheBuilder, Layout,
    TREE_SANITY_INTERVAL, static_slot_pool, verify_scratch_slots,
};
pub use error::{AcceptedFault, Error};
pub use model::{KvRows, ModelSpec, RecurrentState};
pub use request::{PrefixMatch, Request};
pub use speculative::{
    Accepted, BookkeepingReplay, DEFAULT_VERIFY_BATCH, Draft, LogEntry, MAX_IN_FLIGHT,
    MAX_VERIFY_BATCH, MAX_VERIFY_WIDTH, ReplayContext, ScratchShape, Speculation, StateCommit,
    StateReplay,
};
pub use stats::{CacheStats, EvictionCounts, HostStats, SideStats, StepReport};
pub use step::{
    DeviceLayout, KvGeometry, LoadedPage, RequestStep, StepCapacity, StepCheckpoint, StepMetadata,
    StepView,
};
pub use unikv_radix::TokenId;
pub use verify::{DeviceValues, VerifyLayout, VerifyMetadata, VerifyOffsets};

pub use unikv_invariants as invariants;
pub use unikv_kernels as kernels;
pub use unikv_mamba as mamba;
pub use unikv_pools as pools;
pub use unikv_radix as radix;

/// Checks the start-up configuration (invariant level, registry) after making sure every
/// crate's declarations are linked. Returns the registry.
pub fn init() -> Result<&'static invariants::Registry, invariants::Error> {
    // Naming the declarations keeps each crate's object code, and with it the
    // registrations `inventory` made there, in the final binary.
    std::hint::black_box(declared());
    invariants::init()
}

/// Every invariant the workspace's crates declare, as each crate lists them.
fn declared() -> Vec<&'static invariants::Invariant> {
    [
        &unikv_pools::invariants::ALL[..],
        &unikv_radix::INVARIANTS[..],
        &invariants_decl::ALL[..],
    ]
    .concat()
}

/// The names of every invariant declared by the workspace's crates. The registry seen
/// through the facade holds at least these.
pub fn declared_invariants() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = declared().iter().map(|i| i.name()).collect();
    names.sort_unstable();
    names
}

//! unikv-pools: one byte buffer holding the FULL and SWA KV and the Mamba state slots of a
//! hybrid model, with host-authoritative sub-allocators, segment frees with no host
//! sync, and the static paged baseline.
//!
//! Two allocators implement one trait, [`KvAllocator`]:
//! - [`UnifiedSwa`]: one buffer; FULL grows down from the high end and mints virtual
//!   pages, the low end grows up from the sink floor: SWA, which binds its physical pages
//!   to the same virtual pages (`swa.v2p` *is* the FULL→SWA map: > 0 live, -1 tombstone,
//!   0 unbound), or the Mamba state slots (their own virtual ids, page size 1). With all
//!   three (the tri-pool, `[slots up | SWA float | FULL down]`) SWA floats between the
//!   ends: an empty float parks and is transparent, its first page lands at the midpoint
//!   of the room between the ends, it grows toward the roomier side, and when an end
//!   needs bytes it holds the shortfall ladder packs the ends and relays the fewest
//!   boundary SWA pages (their data stays readable through `v2p`). Capacity is bytes at
//!   the frontier; compaction is lazy (a free leaves a hole, an alloc drains holes first,
//!   a flush moves survivors into holes with one `Device::move_spans` for every side and
//!   then rewrites only `v2p`/`p2v`).
//! - [`StaticSwa`]: fixed pools sized by a SWA:FULL token ratio and a FULL→SWA index
//!   map, the baseline every comparison runs against; optionally without SWA and with a
//!   fixed pool of Mamba state slots ([`StaticSlots`], sized like the reference engine by
//!   [`reference_slot_pool`]).
//!
//! Building blocks: [`SubAllocator`] (one span — an `Up` end, a `Down` end or a `Float`
//! between them — with its `v2p`/`p2v`, holes, lazy compaction, relays and dirty mirror
//! entries), [`VirtualIds`] (an id owner's free ids), [`Grid`], [`SubPoolSpec`],
//! [`SlotPoolSpec`] and [`sink_floor`].
//!
//! # Mamba slots and absent sides
//! State slots are a third side of the same machinery, not an allocator of their own: a
//! [`SlotPoolSpec`] (bytes per slot, 8-aligned) gives a grid of page size 1, and a
//! [`SubAllocator`] with its own [`VirtualIds`] ([`VirtualSlot`], 0 = sink) holds the
//! slots, with holes, lazy compaction that moves whole slot envelopes through
//! `move_spans` and a slot mirror that `translate` reads at stride 1
//! (`compaction_moves_whole_slot_envelopes_and_every_slot_keeps_its_bytes`). Slot calls
//! are the free family's slot path (`free_slots`, deferred in a group through the fifth
//! list), `copy_slots` (copy-on-write, every pair checked before one move batch) and
//! `alloc_slots` (transactional like a page allocation). [`KvAllocator::reclaim_plan`]
//! reclaims SWA, then Mamba states, then FULL, so for a byte-bound slot shortfall FULL
//! is the donor and a cached state the last resort
//! (`a_slot_shortfall_with_spare_ids_is_paid_by_full_donors_and_states_last`,
//! `reclaim_plan_sizes_slot_eviction_after_flushing_the_slot_list`). A layout without a
//! side treats it as absent: an empty grid (`Grid::ABSENT`), no mirror, every id the
//! sink, slot calls [`Error::NoSlotPool`], SWA-only calls [`Error::NoSwaSide`]
//! (`slot_demands_on_a_pool_without_slots_are_typed_errors_that_change_nothing`,
//! `a_full_only_static_allocator_binds_full_and_refuses_swa_frees`).
//!
//! ```
//! use std::sync::Arc;
//! use unikv_kernels::CpuDevice;
//! use unikv_pools::{ExtendRequest, KvAllocator, Segment, SubPoolSpec, UnifiedSwa, UnifiedSwaConfig};
//!
//! let device = Arc::new(CpuDevice::new());
//! let mut pool = UnifiedSwa::new(device, UnifiedSwaConfig {
//!     total_bytes: 1 << 20,
//!     page_size: 4,
//!     window: 8,
//!     full: SubPoolSpec::mha("full", 2, 1, 8, 2),
//!     swa: Some(SubPoolSpec::mha("swa", 2, 1, 8, 2)),
//!     mamba: None,
//!     zero_on_handout: false,
//! })?;
//! let mut row = Vec::new();
//! pool.alloc_extend(&[ExtendRequest { prefix_len: 0, seq_len: 10, last_token: None }], &mut row)?;
//! // Window eviction: the first page leaves the window (SWA only, fixed shape).
//! pool.free_swa_segment(Segment::of_row(&row, 0..4))?;
//! // Finish: [0, 4) FULL-only, [4, 10) two-sided.
//! pool.free_kv_row_segments(&row, 0, 4, 10)?;
//! assert_eq!(pool.capacity().full.allocated_pages, 0);
//! # Ok::<(), unikv_pools::Error>(())
//! ```
//!
//! # Invariants this crate keeps
//! - **No host sync on the scheduling path.** All bookkeeping (free lists, `v2p`/`p2v`,
//!   frontiers, holes, groups) is host data; the allocators hold an `Arc<dyn Device>`,
//!   whose trait has no waiting op. Device work is limited to zeroing envelopes on
//!   hand-out (optional), moving envelopes on a compaction flush and the per-step mirror
//!   upload ([`KvAllocator::upload_mirror`]).
//! - **Fixed-shape segment frees.** `free_segment`, `free_swa_segment` (and its batch
//!   form `free_swa_segments`), `free_full_segment` and `free_kv_row_segments` take page
//!   representatives by stride
//!   from host arithmetic; they never filter by liveness and never de-duplicate. They
//!   check their premise as named invariants (`swa.peer_mapped`, `swa.peer_released`,
//!   `swa.window_ratchet`, `pool.double_free`, `pool.sink_reserved`,
//!   `pool.one_free_per_page_per_group`) and contain a breach: a page that is not live on
//!   the side being freed never reaches a free list. Set-shaped `free`/`free_swa` keep
//!   the liveness filter.
//! - **The sink** (virtual page 0 ↔ physical page 0, inside the reserved floor) is never
//!   handed out and never freed.
//! - **One flush of deferred frees.** Every deferred list of a free group (tokens, page
//!   reps, FULL-only tokens, FULL-only page reps, Mamba slots) is enumerated in one place and drained
//!   by one function that every flush site uses (group end, `flush_deferred`, `flush`,
//!   `ensure_capacity`, `reclaim_plan`, which flushes **before** sizing).
//! - **Typed errors change nothing.** A failing operation (capacity, bad ids, unaligned
//!   segments, shared pages, split pages, repeated transfer pages, nested groups, a
//!   failed device op) leaves the allocator as it was. Device work is transactional: the
//!   host plans, issues the device op, and commits its tables only after it was issued
//!   (compaction, a float's relay, zeroing on hand-out, the mirror upload). Two
//!   exceptions, both invisible above the allocator: a flush site's deferred frees
//!   (`flush`, `ensure_capacity`), which are host-only and due, stay applied when the
//!   device work after them fails; and a tri-pool relay over ends with holes first packs
//!   the ends as a transaction of its own, which stays when the relay fails (every page
//!   keeps its virtual id and its bytes). Sizes are overflow-safe:
//!   a huge demand is out of capacity with a saturated, never wrapped, count.
//! - **A refused build leaves the device as it found it.** Each allocator allocates its
//!   buffer and mirror tables through one guard that frees them when it drops, so a
//!   constructor that fails at any allocation frees the ones before it, and a dropped
//!   allocator frees the rest through the same code.
//! - **Mirror epochs.** [`KvAllocator::translate`] refuses while the device mirror is
//!   behind the host tables ([`KvAllocator::mirror_current`]); upload first.
//! - **An infallible free path.** [`KvAllocator::free_batch`] runs each [`FreeOp`]
//!   through its checked method and records a refusal as `pool.free_batch_well_formed`
//!   (skipping that op) instead of returning it.
//! - **Conservation** (`pool.conservation`): per sub-pool live + holes = span; free ids +
//!   live FULL = ids; SWA live + tombstones ≤ FULL live; frontiers never cross and stay
//!   above the sink floor. Checked at every flush from `Warn` up, and in full by
//!   [`KvAllocator::verify`].
//! - **Breaches are counted per allocator scope.** Every invariant above is recorded in
//!   [`KvAllocator::invariant_scope`]: the allocator's own scope until a cache hands it
//!   the cache's ([`KvAllocator::set_invariant_scope`], which a wrapping allocator
//!   forwards), never in process-wide counters.
//! - Kernel ids (`physical page × stride + offset`) fit in i32, checked at boot; the
//!   buffer holds at least the sink plus one request's window (the batch-size-1 floor).

mod api;
mod error;
mod frees;
mod hooked;
mod host;
mod ids;
pub mod invariants;
mod memory;
mod ramp;
mod resident;
mod spec;
mod static_paged;
mod sub;
mod unified;
mod virtual_ids;

pub use api::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, FreeOp, KvAllocator,
    MoveGate, PageDemand, PoolMap, ReclaimPlan, Reclaimable, Segment, SideCapacity,
    SideTranslation, SpanInfo, SwaState,
};
pub use error::{Bs1Floor, Error, SlotFault};
pub use hooked::{Call, Hooked, Hooks, IdFree, Outcome};
pub use host::{HostBlock, HostGeometry, HostKind, HostPool, HostPoolSpec, HostRun};
pub use ids::{Bytes, PageSize, PhysicalPage, VirtualPage, VirtualSlot, VirtualToken};
pub use spec::{BS1_STATE_SLOTS, Grid, Grow, Side, SlotPoolSpec, SubPoolSpec, sink_floor};
pub use static_paged::{
    PrefixCaching, REFERENCE_MAMBA_FULL_MEMORY_RATIO, REFERENCE_SLOTS_PER_RUNNING_REQUEST,
    ReferenceSlotPool, StaticSlots, StaticSwa, StaticSwaConfig, reference_slot_pool,
};
pub use sub::{Edge, SubAllocator};
pub use unified::{UnifiedSwa, UnifiedSwaConfig};
pub use virtual_ids::VirtualIds;

//! Every invariant of both FULL/SWA allocators (unified and static paged), declared side
//! by side so that each name is declared exactly once and both layouts check the same
//! rules.
//!
//! Each check is paired with a containment step that runs at every level: a page that
//! breaks a free's premise is never put on a free list.

use unikv_invariants::declare_invariant;

declare_invariant! {
    /// Every page handed to an SWA-side free (`free_swa_segment`, the SWA half of
    /// `free_segment`) is live on SWA. Otherwise an unbound page (or the sink) would join
    /// the SWA free list and be handed out twice. Containment: the page's SWA side is
    /// skipped.
    pub static PEER_MAPPED: "swa.peer_mapped", FatalUncontainable,
        "every page handed to an SWA-side free is live on SWA (caller wants a FULL-only free)";

    /// Every page handed to a FULL-only free (`free_full`, `free_full_segment`) has no live
    /// SWA peer. Otherwise the SWA page would be stranded under a recycled virtual id.
    /// Containment: the SWA peer is released too.
    pub static PEER_RELEASED: "swa.peer_released", Guard,
        "every page handed to a FULL-only free has no live SWA peer";

    /// An out-of-window (SWA-only) free never covers a range whose SWA is already released:
    /// the window cursor only moves up. Containment: the tombstoned page is skipped.
    pub static WINDOW_RATCHET: "swa.window_ratchet", Guard,
        "an out-of-window free never covers an already released SWA range";

    /// A free releases only pages that are live on the side it frees (no double free, no
    /// free of a page never allocated). Containment: the page is skipped.
    pub static DOUBLE_FREE: "pool.double_free", FatalContainable,
        "a free releases only live pages: no double free and no free of an unbound page";

    /// The sink (virtual page 0 ↔ physical page 0) is never freed and never handed out.
    /// Containment: a free skips it.
    pub static SINK_RESERVED: "pool.sink_reserved", FatalContainable,
        "the sink page is never freed and never handed out";

    /// Within one free group a page is freed by exactly one call (segment frees do not
    /// de-duplicate). Containment: the second free finds the page released and skips it.
    pub static ONE_FREE_PER_GROUP: "pool.one_free_per_page_per_group", Guard,
        "within one free group each page is freed by exactly one call";

    /// Each representative of a segment is the first token of its page: the segment is a
    /// contiguous, page-aligned slice of one row.
    pub static SEGMENT_SHAPE: "pool.segment_shape", Guard,
        "every page representative of a segment is the first token of its page";

    /// An allocation that passed its room check finds every virtual id and page it was
    /// promised (the room arithmetic and the free lists agree). Containment: the
    /// allocation stops at the breach and hands out no sink or unbacked id.
    pub static ROOM_CHECK: "pool.room_check", FatalContainable,
        "an allocation that passed its room check finds every page and virtual id it was promised";

    /// A free the caller makes from host state it trusts ([`crate::KvAllocator::free_batch`])
    /// is well-formed: in range, aligned, page-disjoint, a valid transfer. The checked
    /// method would have returned a typed error. Containment: that free is skipped whole
    /// (it changed nothing), the rest of the batch is applied.
    pub static FREE_BATCH_WELL_FORMED: "pool.free_batch_well_formed", FatalContainable,
        "every free of an infallible batch is well-formed (the checked form would not refuse it)";

    /// Per sub-pool: live pages + holes = pages of the span between its end and its
    /// frontier; free virtual ids + live FULL pages = virtual id count; SWA live +
    /// tombstones ≤ FULL live; frontiers never cross and stay inside the buffer above the
    /// sink floor. Checked at every flush from `Warn` up.
    pub static CONSERVATION: "pool.conservation", FatalUncontainable,
        "available + allocated = total per sub-pool, and frontiers and spans account for every byte";
}

/// Every invariant this crate declares (the facade names them so that `inventory` keeps
/// every registration, and checks the registry against this list).
pub const ALL: [&unikv_invariants::Invariant; 10] = [
    &PEER_MAPPED,
    &PEER_RELEASED,
    &WINDOW_RATCHET,
    &DOUBLE_FREE,
    &SINK_RESERVED,
    &ONE_FREE_PER_GROUP,
    &SEGMENT_SHAPE,
    &ROOM_CHECK,
    &FREE_BATCH_WELL_FORMED,
    &CONSERVATION,
];

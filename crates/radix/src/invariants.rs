//! The named invariants this crate checks (see the crate documentation).

use unikv_invariants::declare_invariant;

declare_invariant! {
    /// Every lock takes FULL on the whole path and SWA on a part of it, so a node's FULL
    /// lock count is never below its SWA lock count.
    pub static FULL_LOCKS_COVER_SWA_LOCKS: "radix.full_locks_cover_swa_locks", FatalContainable,
        "on every node the FULL lock count is at least the SWA lock count";
    /// A lock release never finds a count already at zero (containment: the decrement is skipped).
    pub static LOCK_UNDERFLOW: "radix.lock_underflow", FatalContainable,
        "a lock release never decrements a lock count that is already zero";
    /// `sanity_check` recomputes sizes, LRU sets, structure and lock counts and finds what
    /// the tree recorded.
    pub static SANITY: "radix.sanity", Guard,
        "recomputing sizes, LRU sets, structure and lock counts from the tree matches what it recorded";
}

/// Every invariant this crate declares (the facade names them so that `inventory` keeps
/// every registration, and checks the registry against this list).
pub const ALL: [&unikv_invariants::Invariant; 3] =
    [&FULL_LOCKS_COVER_SWA_LOCKS, &LOCK_UNDERFLOW, &SANITY];

//! The facade's invariants: request lifecycle rules that only the facade can see.

use unikv_invariants::declare_invariant;

declare_invariant! {
    /// Per side, at every step boundary: available + evictable + protected + held by live
    /// requests = total, in pages.
    pub static CONSERVATION: "cache.conservation", FatalUncontainable,
        "per side at each step boundary: available + evictable + protected + held = total pages";
}

/// Every invariant this crate declares.
pub const ALL: [&unikv_invariants::Invariant; 1] = [&CONSERVATION];

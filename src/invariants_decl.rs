//! The facade's invariants: request lifecycle rules that only the facade can see.

use unikv_invariants::declare_invariant;

declare_invariant! {
    /// Per side, at every step boundary: available + evictable + protected + held by live
    /// requests = total, in pages.
    pub static CONSERVATION: "cache.conservation", FatalUncontainable,
        "per side at each step boundary: available + evictable + protected + held = total pages";
}

declare_invariant! {
    /// The host tier, at every step boundary: its pool's frames and units add up, and
    /// the units it holds are exactly those its tree names (FULL pages and states of its
    /// nodes, the SWA pages of its live ones); its tree passes its sanity check.
    pub static HOST_CONSERVATION: "cache.host_conservation", FatalUncontainable,
        "at each step boundary the host pool's units are exactly those the host tree names";
}

declare_invariant! {
    /// Step metadata: every SWA row inside the window of a step's first new token is live
    /// (a released one would read the sink).
    pub static WINDOW_LIVE: "step.window_live", FatalContainable,
        "step metadata: every SWA row inside a query's window is live, none reads the sink";
}

/// Every invariant this crate declares.
pub const ALL: [&unikv_invariants::Invariant; 3] =
    [&CONSERVATION, &HOST_CONSERVATION, &WINDOW_LIVE];

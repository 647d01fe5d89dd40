//! Actions: what a tree operation asks the caller to do to the allocators.
//!
//! The tree never touches a pool. Each operation returns the actions, in virtual token ids,
//! in the order they must be applied; the caller (the facade) maps each one onto one
//! allocator call.

use crate::dump::values;
use crate::{MambaSlot, NodeId, Slots, Tokens, VirtualToken};
use std::fmt;

/// Whether a node's SWA side is live or released (a tombstone).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SwaSide {
    /// SWA KV is bound: a free of the node releases both sides (`free_segment`).
    Live,
    /// SWA KV was released, FULL stays: a free releases FULL only (`free_full_segment`).
    Tombstone,
}

/// One thing the caller applies to its allocators. Token lists always cover whole pages
/// (every list starts on a page boundary and has a multiple of the page size in length).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Duplicate KV an insert did not consume, SWA live: free both sides
    /// (`free_segment`). Deferrable.
    FreeDeviceKv {
        /// The duplicate tokens (the inserting request's copies).
        tokens: Vec<VirtualToken>,
    },
    /// Duplicate KV whose SWA was already released (below the request's window cursor,
    /// or the old FULL value of an adopted tombstone): free FULL only
    /// (`free_full_segment`). Deferrable.
    FreeDeviceKvFullOnly {
        /// The tokens, every page of them SWA-tombstoned.
        tokens: Vec<VirtualToken>,
    },
    /// A tombstoned node adopted live incoming KV: its value is now `tokens`, whose SWA
    /// side is live (no allocator call in the unified pool; a static pool rebuilds its
    /// FULL→SWA map here).
    SwaRebuild {
        /// The node.
        node: NodeId,
        /// The node's new value.
        tokens: Vec<VirtualToken>,
    },
    /// A tombstoned node whose FULL is locked met live incoming KV: rebind `kept`'s
    /// virtual pages to `incoming`'s SWA physical pages (pairing page by page), tombstone
    /// `incoming`'s SWA, then free `incoming`'s FULL. No SWA page is allocated or freed.
    RecoverSwaWithLockedFull {
        /// The node, whose value stays `kept`.
        node: NodeId,
        /// The node's locked FULL value: SWA-tombstoned, becomes live.
        kept: Vec<VirtualToken>,
        /// The inserting request's tokens: SWA live, handed over; FULL freed.
        incoming: Vec<VirtualToken>,
    },
    /// A whole node left the tree (a KV-removed event): free its KV on both sides if
    /// `swa` is live (`free_segment`), FULL only if it is a tombstone (`free_full_segment`).
    /// One action for both sides, so the caller never recycles the FULL virtual ids before
    /// the SWA side has been resolved through them.
    EvictNode {
        /// The evicted node (stale from now on).
        node: NodeId,
        /// Its value.
        tokens: Vec<VirtualToken>,
        /// Its SWA side at eviction.
        swa: SwaSide,
    },
    /// An internal (or FULL-locked) node's SWA was released and the node is now a
    /// tombstone: free SWA only (`free_swa_segment`).
    TombstoneSwa {
        /// The node.
        node: NodeId,
        /// Its value (FULL ids; the allocator resolves SWA through them).
        tokens: Vec<VirtualToken>,
    },
    /// A node's Mamba state was evicted: free the slot.
    EvictMambaState {
        /// The node that held it.
        node: NodeId,
        /// The slot.
        slot: MambaSlot,
    },
    /// An insert's Mamba state was not adopted (the node had one, or nothing was cached
    /// at its position): free the slot.
    FreeMambaSlot {
        /// The slot.
        slot: MambaSlot,
    },
}

impl Action {
    /// Whether the action may be deferred to the next barrier (a free group); the others
    /// must be applied before anything else touches the allocator.
    pub fn is_deferrable(&self) -> bool {
        matches!(
            self,
            Action::FreeDeviceKv { .. } | Action::FreeDeviceKvFullOnly { .. }
        )
    }

    /// What applying this action releases, in tokens per side and Mamba slots.
    pub fn released(&self) -> Released {
        let n = |t: &Vec<VirtualToken>| Tokens(t.len());
        match self {
            Action::FreeDeviceKv { tokens } => Released {
                full: n(tokens),
                swa: n(tokens),
                mamba: Slots::ZERO,
            },
            Action::FreeDeviceKvFullOnly { tokens } => Released {
                full: n(tokens),
                ..Released::default()
            },
            Action::SwaRebuild { .. } => Released::default(),
            Action::RecoverSwaWithLockedFull { incoming, .. } => Released {
                full: n(incoming),
                ..Released::default()
            },
            Action::EvictNode { tokens, swa, .. } => Released {
                full: n(tokens),
                swa: if *swa == SwaSide::Live {
                    n(tokens)
                } else {
                    Tokens::ZERO
                },
                mamba: Slots::ZERO,
            },
            Action::TombstoneSwa { tokens, .. } => Released {
                swa: n(tokens),
                ..Released::default()
            },
            Action::EvictMambaState { .. } | Action::FreeMambaSlot { .. } => Released {
                mamba: Slots(1),
                ..Released::default()
            },
        }
    }
}

/// One line per action, values as runs of consecutive ids (`v 18..24` is 18 to 23).
impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::FreeDeviceKv { tokens } => write!(f, "FreeDeviceKv v {}", values(tokens)),
            Action::FreeDeviceKvFullOnly { tokens } => {
                write!(f, "FreeDeviceKvFullOnly v {}", values(tokens))
            }
            Action::SwaRebuild { node, tokens } => {
                write!(f, "SwaRebuild {node} v {}", values(tokens))
            }
            Action::RecoverSwaWithLockedFull {
                node,
                kept,
                incoming,
            } => write!(
                f,
                "RecoverSwaWithLockedFull {node} kept v {} incoming v {}",
                values(kept),
                values(incoming)
            ),
            Action::EvictNode { node, tokens, swa } => {
                let side = match swa {
                    SwaSide::Live => "live",
                    SwaSide::Tombstone => "tombstone",
                };
                write!(f, "EvictNode {node} v {} ({side})", values(tokens))
            }
            Action::TombstoneSwa { node, tokens } => {
                write!(f, "TombstoneSwa {node} v {}", values(tokens))
            }
            Action::EvictMambaState { node, slot } => {
                write!(f, "EvictMambaState {node} s{}", slot.0)
            }
            Action::FreeMambaSlot { slot } => write!(f, "FreeMambaSlot s{}", slot.0),
        }
    }
}

/// Capacity released by actions: FULL tokens, SWA tokens, Mamba slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// FULL tokens.
    pub full: Tokens,
    /// SWA tokens.
    pub swa: Tokens,
    /// Mamba slots.
    pub mamba: Slots,
}

impl Released {
    /// Adds another release.
    pub fn add(&mut self, other: Released) {
        self.full += other.full;
        self.swa += other.swa;
        self.mamba += other.mamba;
    }

    /// The sum over `actions`.
    pub fn of(actions: &[Action]) -> Released {
        let mut total = Released::default();
        for a in actions {
            total.add(a.released());
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind: whether it may wait for the barrier, and what applying it releases.
    #[test]
    fn each_action_says_whether_it_defers_and_what_it_releases() {
        let node = NodeId {
            index: 1,
            generation: 0,
        };
        let v = |n: u32| (10..10 + n).map(VirtualToken).collect::<Vec<_>>();
        let r = |full, swa, mamba| Released {
            full: Tokens(full),
            swa: Tokens(swa),
            mamba: Slots(mamba),
        };
        let slot = MambaSlot(3);
        let cases = [
            (Action::FreeDeviceKv { tokens: v(4) }, true, r(4, 4, 0)),
            (
                Action::FreeDeviceKvFullOnly { tokens: v(3) },
                true,
                r(3, 0, 0),
            ),
            (Action::SwaRebuild { node, tokens: v(2) }, false, r(0, 0, 0)),
            (
                Action::RecoverSwaWithLockedFull {
                    node,
                    kept: v(2),
                    incoming: v(5),
                },
                false,
                r(5, 0, 0),
            ),
            (
                Action::EvictNode {
                    node,
                    tokens: v(6),
                    swa: SwaSide::Live,
                },
                false,
                r(6, 6, 0),
            ),
            (
                Action::EvictNode {
                    node,
                    tokens: v(6),
                    swa: SwaSide::Tombstone,
                },
                false,
                r(6, 0, 0),
            ),
            (
                Action::TombstoneSwa { node, tokens: v(7) },
                false,
                r(0, 7, 0),
            ),
            (Action::EvictMambaState { node, slot }, false, r(0, 0, 1)),
            (Action::FreeMambaSlot { slot }, false, r(0, 0, 1)),
        ];
        let mut total = Released::default();
        for (action, deferrable, released) in &cases {
            assert_eq!(action.is_deferrable(), *deferrable, "{action}");
            assert_eq!(action.released(), *released, "{action}");
            total.add(*released);
        }
        let actions: Vec<Action> = cases.into_iter().map(|(a, _, _)| a).collect();
        assert_eq!(Released::of(&actions), total);
        assert_eq!(total, r(24, 17, 2));
    }
}

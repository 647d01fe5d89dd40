//! unikv-radix: the prefix tree of unikv, with FULL, SWA and MAMBA components, that emits
//! actions instead of touching allocators.
//!
//! The tree is pure CPU. Its keys are [`TokenId`]s, its values [`VirtualToken`]s (virtual
//! token ids: virtual page × page size + offset). Every operation that releases or moves
//! KV returns [`Action`]s, in order; the caller (the facade) applies each one to its
//! allocators. The tree never imports `pools` and never touches device memory.
//!
//! ```
//! use unikv_radix::{Action, InsertRequest, RadixTree, TokenId, TreeConfig, VirtualToken};
//!
//! // Page size 1, window 2, no Mamba.
//! let mut tree = RadixTree::new(TreeConfig::swa(1, 2)).unwrap();
//! let key: Vec<TokenId> = [1, 2, 3, 4].map(TokenId).to_vec();
//! let row: Vec<VirtualToken> = (10..14).map(VirtualToken).collect();
//! tree.insert(InsertRequest::new(&key, &row)).unwrap();
//!
//! // A second request with the same tokens, whose window cursor is at 2: its duplicate
//! // rows below the cursor already lost their SWA, so they are freed FULL-only.
//! let dup: Vec<VirtualToken> = (20..24).map(VirtualToken).collect();
//! let out = tree.insert(InsertRequest::new(&key, &dup).window_cursor(2)).unwrap();
//! assert_eq!(out.actions, vec![
//!     Action::FreeDeviceKvFullOnly { tokens: vec![VirtualToken(20), VirtualToken(21)] },
//!     Action::FreeDeviceKv { tokens: vec![VirtualToken(22), VirtualToken(23)] },
//! ]);
//!
//! let hit = tree.match_prefix(&key);
//! assert_eq!(hit.len.get(), 4);
//! assert_eq!(hit.values.to_vec(), row);
//! tree.sanity_check().unwrap();
//! ```
//!
//! # Components
//! - **FULL**: the node's value; locks on the whole path to the root; an LRU set of
//!   unlocked leaves. Evicting a leaf removes the node ([`Action::EvictNode`]).
//! - **SWA**: live or tombstone per node; a window lock covers the live nodes of one
//!   window upward from the locked node; an LRU set of unlocked live nodes. Evicting an
//!   unlocked leaf removes it whole, evicting any other node tombstones it
//!   ([`Action::TombstoneSwa`]).
//! - **MAMBA**: an optional state slot per node (the state at the node's end, attached
//!   by the insert that ends there or, as one of its [`InsertRequest::checkpoints`], by an
//!   insert passing there, which splits the node; kept by the lower part when a node
//!   splits); pinned by a lock taken with [`RadixTree::lock`] (an admission, which copies
//!   it) at the locked node only, never by an insert's lock (its request runs on its own
//!   state); an LRU set of unlocked states, [`StateRole::Grid`] states no admission copied
//!   first ([`StateCheckpoint::role`]). Evicting a state frees the state alone: the KV under it stays a FULL hit. A state whose writing
//!   forward is in flight ([`StateCheckpoint::in_flight`]) ends no match and is pinned
//!   like a locked one until [`RadixTree::publish_states`]. Optionally a cap on the states
//!   of one root-to-node path (applied by the insert that attaches states), and a
//!   checkpoint grid that [`MatchResult::mamba_branching`] is aligned to.
//!
//! Main entry points: [`RadixTree::match_prefix`], [`RadixTree::insert`] (with
//! [`InsertRequest`]; [`InsertRequest::after`] continues from a locked node), [`RadixTree::lock`] / [`RadixTree::release_window`] /
//! [`RadixTree::unlock`], [`RadixTree::evict_one`] / [`RadixTree::evict_until`],
//! [`RadixTree::sizes`], [`RadixTree::sanity_check`] and [`RadixTree::dump`].
//!
//! # Invariants this crate keeps
//! - Every node but the root has a non-empty key of whole pages and one value per key
//!   token; children are keyed by their first page.
//! - Sizes ([`Sizes`]) are exact: the evictable and protected counts of every component
//!   equal the recomputation from the nodes, and every LRU set holds exactly the nodes its
//!   rule admits, ordered by last use. `sanity_check` proves both (`radix.sanity`).
//! - `radix.full_locks_cover_swa_locks`: on every node the FULL lock count is at least the
//!   SWA lock count; a tombstone is never SWA-locked; a Mamba lock implies a state.
//! - `radix.lock_underflow`: a release never decrements a count already at zero.
//! - Breaches of these invariants are recorded in the tree's invariant scope
//!   ([`RadixTree::invariant_scope`]; its own until a cache hands it the cache's).
//! - A match ends only where a whole window of live SWA precedes it (from the root none
//!   is needed) and, with Mamba, only on a node with a published state.
//! - Mamba path cap ([`TreeConfig::mamba_path_cap`]): when an insert attaches a state and
//!   the path from the root to that node then holds more states than the cap, the insert
//!   evicts unlocked states on that path (each an [`Action::EvictMambaState`] in its
//!   actions, in the order applied; only the state goes) until the path is within the cap:
//!   first those that serve no reuse (grid states before anchors), then those that do (the
//!   deepest state above a node where paths diverge, or one an admission copied), each
//!   group least recently used first. Best-effort over unpinned states: the states
//!   just attached, locked ones and ones in flight are never evicted for it,
//!   so a path stays above the cap exactly when every other state on it is locked. Checked
//!   at the insert's commit only: a descendant's path that gains the state, or a path whose
//!   excess states are unlocked later, is brought within the cap by its next attach.
//! - Insert frees each duplicate page exactly once, FULL-only below the request's window
//!   cursor and two-sided above it; no page appears in two actions of one operation.
//! - A fresh live leaf holds at most one page-aligned window, `ceil(W / ps) × ps` tokens;
//!   an insert never creates a leaf that is all tombstone.
//! - Bad input (unknown node or lock handle, double release, misaligned length, a claimed
//!   prefix the tree does not hold) is a typed [`RadixError`] and leaves the tree unchanged.
//! - Eviction costs O(log n) per evicted node, never a walk of the tree.

mod action;
mod dump;
mod error;
mod evict;
mod insert;
mod invariants;
mod lock;
mod matching;
mod sanity;
mod tree;
mod types;
mod values;

pub use action::{Action, Released, SwaSide};
pub use error::RadixError;
pub use insert::{InsertOutcome, InsertRequest, KeyStart};
pub use invariants::{ALL as INVARIANTS, FULL_LOCKS_COVER_SWA_LOCKS, LOCK_UNDERFLOW, SANITY};
pub use matching::MatchResult;
pub use tree::{NodeView, RadixTree, Sizes};
pub use types::{
    Component, LockHandle, MambaSlot, NodeId, Slots, StateCheckpoint, StateRole, TokenId, Tokens,
    TreeConfig, VirtualToken,
};
pub use values::PathValues;

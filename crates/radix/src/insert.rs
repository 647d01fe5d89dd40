//! `insert`: cache a request's KV, emitting frees for the duplicates it did not consume.
//!
//! The request's row is split by two host integers: `prev_prefix_len` (rows the tree
//! already owns: they *are* the tree's values and are neither consumed nor freed) and the
//! window cursor (rows below it had their SWA released by window eviction and are
//! FULL-only). Per matched node:
//! - live node: the incoming duplicate is freed, FULL-only below the cursor
//!   (`FreeDeviceKvFullOnly`), two-sided above it (`FreeDeviceKv`);
//! - tombstone: the part below the cursor is freed FULL-only; the part above it (the node
//!   is split at the cursor first) revives the node: it adopts the incoming value (old
//!   FULL freed FULL-only, `SwaRebuild`) or, when its FULL is locked,
//!   `RecoverSwaWithLockedFull` moves SWA ownership onto it.
//!
//! New tokens past the matched path become a tombstone parent for the part below the
//! cursor and live nodes above it, the live leaf capped at one page-aligned window. Tokens
//! that would only form an all-tombstone leaf are not cached: they stay the caller's.
//!
//! Recurrent states attach at the key's end ([`InsertRequest::mamba`]) or at positions
//! inside it ([`InsertRequest::checkpoints`]: the node there is split so that one ends at
//! each); a state lands only on a node that has none and live SWA, otherwise its slot is
//! handed back (`FreeMambaSlot`). With a Mamba path cap, an insert that attaches states
//! then frees the least recently used unlocked states on its path, never one it just
//! attached, until the path holds no more than the cap.

use crate::error::RadixError;
use crate::matching::common_pages;
use crate::tree::{Ix, Node, ROOT};
use crate::{
    Action, LockHandle, MambaSlot, NodeId, RadixTree, StateCheckpoint, TokenId, Tokens,
    VirtualToken,
};

/// What a request hands to [`RadixTree::insert`].
#[derive(Clone, Copy, Debug)]
pub struct InsertRequest<'a> {
    /// The request's tokens (length a multiple of the page size; the caller keeps the
    /// partial last page).
    pub key: &'a [TokenId],
    /// The request's row: one virtual token per key token.
    pub value: &'a [VirtualToken],
    /// Rows `[0, prev_prefix_len)` are the tree's own values (the request matched them).
    pub prev_prefix_len: Tokens,
    /// The window cursor: SWA of rows below it is already released. Page-aligned, at least
    /// `prev_prefix_len`. Ignored without SWA.
    pub window_cursor: Tokens,
    /// The Mamba state at the end of `key`, if the model has Mamba layers.
    pub mamba: Option<MambaSlot>,
    /// Mamba states at positions inside `key` (strictly ascending page boundaries in
    /// `(0, key.len()]`); each lands where the tree ends up caching that position.
    pub checkpoints: &'a [StateCheckpoint],
    /// Lock the inserted node and return the handle (an unfinished request that keeps
    /// decoding on top of what it just cached). The caller releases the request's previous
    /// lock afterwards, and replaces its row's `[0, cached_len)` with
    /// [`RadixTree::prefix_values`] of the returned node.
    pub lock: bool,
}

impl<'a> InsertRequest<'a> {
    /// A finished request with nothing matched and no window eviction yet.
    pub fn new(key: &'a [TokenId], value: &'a [VirtualToken]) -> Self {
        InsertRequest {
            key,
            value,
            prev_prefix_len: Tokens::ZERO,
            window_cursor: Tokens::ZERO,
            mamba: None,
            checkpoints: &[],
            lock: false,
        }
    }

    /// Sets the tree-owned prefix length.
    pub fn prev_prefix_len(mut self, len: usize) -> Self {
        self.prev_prefix_len = Tokens(len);
        self
    }

    /// Sets the window cursor.
    pub fn window_cursor(mut self, cursor: usize) -> Self {
        self.window_cursor = Tokens(cursor);
        self
    }

    /// Sets the Mamba state at the end of the key.
    pub fn mamba(mut self, slot: MambaSlot) -> Self {
        self.mamba = Some(slot);
        self
    }

    /// Sets the Mamba states inside the key.
    pub fn checkpoints(mut self, checkpoints: &'a [StateCheckpoint]) -> Self {
        self.checkpoints = checkpoints;
        self
    }

    /// Locks the inserted node (unfinished requests).
    pub fn locked(mut self) -> Self {
        self.lock = true;
        self
    }
}

/// The result of [`RadixTree::insert`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InsertOutcome {
    /// Actions to apply, in order.
    pub actions: Vec<Action>,
    /// The node whose end is `cached_len` (the root when nothing is cached).
    pub node: NodeId,
    /// The tree now owns `[0, cached_len)` of the key: rows there are either tree values or
    /// freed by `actions`. Rows `[cached_len, len)` stay the caller's.
    pub cached_len: Tokens,
    /// The lock on `node`, when the request asked for one.
    pub lock: Option<LockHandle>,
}

impl RadixTree {
    /// Inserts a request's KV. See the module documentation for how each slice is handled.
    ///
    /// Errors (tree unchanged): key/value length mismatch, a length or cursor not
    /// page-aligned, a claimed tree-owned prefix the tree does not hold or whose values
    /// differ, a Mamba slot for a tree without Mamba.
    pub fn insert(&mut self, req: InsertRequest<'_>) -> Result<InsertOutcome, RadixError> {
        self.validate_insert(&req)?;
        let ps = self.ps();
        let len = req.key.len();
        let ppl = req.prev_prefix_len.0;
        let cursor = if self.swa_enabled() {
            req.window_cursor.0.max(ppl).min(len)
        } else {
            0
        };
        let mut actions = Vec::new();
        let mut pos = 0;
        let mut x = ROOT;
        while pos < len {
            let Some(&child) = self.nodes[x as usize].children.get(&req.key[pos..pos + ps]) else {
                break;
            };
            let c = common_pages(&self.nodes[child as usize].key, &req.key[pos..], ps);
            let child = if c < self.nodes[child as usize].len() {
                self.split(child, c)
            } else {
                child
            };
            let end = pos + c;
            let child = self.overlap(child, pos, end, ppl, cursor, req.value, &mut actions);
            x = child;
            pos = end;
        }
        if pos < len {
            let last = self.add_new(x, pos, len, cursor, req.key, req.value);
            if last != x {
                x = last;
                pos = len;
            }
        }
        let cached_len = pos;

        let mut attached: Vec<Ix> = Vec::new();
        if let Some(slot) = req.mamba {
            if x != ROOT && cached_len == len && self.nodes[x as usize].mamba.is_none() {
                self.with_node(x, |n| n.mamba = Some(slot));
                attached.push(x);
            } else {
                actions.push(Action::FreeMambaSlot { slot });
            }
        }
        self.attach_checkpoints(x, cached_len, req.checkpoints, &mut attached, &mut actions);

        let t = self.tick();
        let mut y = x;
        while y != ROOT {
            self.with_node(y, |n| n.full_tick = t);
            y = self.nodes[y as usize].parent;
        }
        self.touch_swa_window(x, t);
        if x != ROOT {
            self.with_node(x, |n| n.mamba_tick = t);
        }
        for &a in &attached {
            self.with_node(a, |n| n.mamba_tick = t);
        }
        if !attached.is_empty() {
            self.evict_excess_path_states(x, &attached, &mut actions);
        }

        let lock = if req.lock {
            Some(self.lock_ix(x))
        } else {
            None
        };
        Ok(InsertOutcome {
            actions,
            node: self.id(x),
            cached_len: Tokens(cached_len),
            lock,
        })
    }

    /// Attaches `checkpoints` (ascending, validated) at their positions on the path from
    /// the root to `x`, which ends at `end`: the node holding a position is split so that
    /// one ends there. A position past `end` (not cached), on a node that already holds a
    /// state or on a tombstone (a state there could never end a match) hands its slot
    /// back. Attached nodes are pushed to `attached`.
    fn attach_checkpoints(
        &mut self,
        x: Ix,
        end: usize,
        checkpoints: &[StateCheckpoint],
        attached: &mut Vec<Ix>,
        actions: &mut Vec<Action>,
    ) {
        // Deepest first, walking up once: `y` spans `(end - len(y), end]`.
        let (mut y, mut end) = (x, end);
        for c in checkpoints.iter().rev() {
            let at = c.at.0;
            while y != ROOT && end - self.nodes[y as usize].len() >= at {
                end -= self.nodes[y as usize].len();
                y = self.nodes[y as usize].parent;
            }
            if y == ROOT || at > end {
                actions.push(Action::FreeMambaSlot { slot: c.slot });
                continue;
            }
            if at < end {
                let start = end - self.nodes[y as usize].len();
                y = self.split(y, at - start);
                end = at;
            }
            let n = &self.nodes[y as usize];
            if n.mamba.is_some() || (self.swa_enabled() && !n.swa_live) {
                actions.push(Action::FreeMambaSlot { slot: c.slot });
                continue;
            }
            self.with_node(y, |n| {
                n.mamba = Some(c.slot);
                n.mamba_in_flight = c.in_flight;
            });
            if c.in_flight {
                self.in_flight.push(y);
            }
            attached.push(y);
        }
    }

    /// Enforces [`crate::TreeConfig::mamba_path_cap`] on the path from the root to `x`,
    /// where states were just attached (`attached`): while the path holds more states than
    /// the cap, frees the least recently used unlocked state on it that was not just
    /// attached (`EvictMambaState`). Every such state sits on an ancestor of `x` or on
    /// `x`, and only the state goes. Locked states are never taken: the cap is best-effort
    /// over unlocked states.
    fn evict_excess_path_states(&mut self, x: Ix, attached: &[Ix], actions: &mut Vec<Action>) {
        let Some(cap) = self.config.mamba_path_cap else {
            return;
        };
        let mut held = 0;
        let mut candidates: Vec<(u64, Ix)> = Vec::new();
        let mut y = x;
        while y != ROOT {
            let n = &self.nodes[y as usize];
            if n.mamba.is_some() {
                held += 1;
                if self.state_unpinned(y) && !attached.contains(&y) {
                    candidates.push((n.mamba_tick, y));
                }
            }
            y = n.parent;
        }
        if held <= cap.get() {
            return;
        }
        // Least recently used first; the index breaks tick ties deterministically, as in
        // the Mamba LRU set.
        candidates.sort_unstable();
        for (_, y) in candidates.into_iter().take(held - cap.get()) {
            self.evict_mamba(y, actions);
        }
    }

    fn validate_insert(&self, req: &InsertRequest<'_>) -> Result<(), RadixError> {
        let ps = self.ps();
        let page_size = self.config.page_size;
        if req.key.len() != req.value.len() {
            return Err(RadixError::KeyValueLengthMismatch {
                key: req.key.len(),
                value: req.value.len(),
            });
        }
        let aligned = |what, len: usize| {
            if len.is_multiple_of(ps) {
                Ok(())
            } else {
                Err(RadixError::NotPageAligned {
                    what,
                    len,
                    page_size,
                })
            }
        };
        aligned("key length", req.key.len())?;
        aligned("prev_prefix_len", req.prev_prefix_len.0)?;
        if self.swa_enabled() {
            aligned("window cursor", req.window_cursor.0)?;
        }
        if (req.mamba.is_some() || !req.checkpoints.is_empty()) && !self.config.mamba {
            return Err(RadixError::MambaDisabled);
        }
        let mut previous = 0;
        for c in req.checkpoints {
            let at = c.at.0;
            if at <= previous || at > req.key.len() || !at.is_multiple_of(ps) {
                return Err(RadixError::BadCheckpoint {
                    at,
                    key_len: req.key.len(),
                    page_size,
                });
            }
            previous = at;
        }
        let ppl = req.prev_prefix_len.0;
        if ppl > req.key.len() {
            return Err(RadixError::PrefixNotInTree {
                claimed: ppl,
                cached: req.key.len(),
            });
        }
        // Read-only walk over the claimed prefix: the tree holds it, with these values.
        let mut pos = 0;
        let mut x = ROOT;
        while pos < ppl {
            let Some(&child) = self.nodes[x as usize].children.get(&req.key[pos..pos + ps]) else {
                break;
            };
            let n = &self.nodes[child as usize];
            let c = common_pages(&n.key, &req.key[pos..], ps);
            let upto = c.min(ppl - pos);
            if let Some(i) = (0..upto).find(|&i| n.value[i] != req.value[pos + i]) {
                return Err(RadixError::PrefixValueMismatch { position: pos + i });
            }
            pos += c;
            if c < n.len() {
                break;
            }
            x = child;
        }
        if pos < ppl {
            return Err(RadixError::PrefixNotInTree {
                claimed: ppl,
                cached: pos,
            });
        }
        Ok(())
    }

    /// Handles the incoming slice `[s, e)` over the existing node `ix`, which covers
    /// exactly `[s, e)`. Returns the node that now ends at `e`.
    #[allow(clippy::too_many_arguments)]
    fn overlap(
        &mut self,
        ix: Ix,
        s: usize,
        e: usize,
        ppl: usize,
        cursor: usize,
        value: &[VirtualToken],
        actions: &mut Vec<Action>,
    ) -> Ix {
        let dup_lo = s.max(ppl);
        if dup_lo >= e {
            return ix; // the tree's own values
        }
        let swa_live = !self.swa_enabled() || self.nodes[ix as usize].swa_live;
        if swa_live {
            push_split_free(actions, value, dup_lo, e, cursor);
            return ix;
        }
        // Tombstone.
        let live_lo = dup_lo.max(cursor);
        if live_lo >= e {
            push_full_only(actions, &value[dup_lo..e]);
            return ix;
        }
        push_full_only(actions, &value[dup_lo..live_lo]);
        if live_lo > s {
            self.split(ix, live_lo - s);
        }
        let incoming = value[live_lo..e].to_vec();
        let node = self.id(ix);
        if self.nodes[ix as usize].full_lock == 0 {
            let old = self.with_node(ix, |n| {
                n.swa_live = true;
                std::mem::replace(&mut n.value, incoming.clone())
            });
            actions.push(Action::FreeDeviceKvFullOnly { tokens: old });
            actions.push(Action::SwaRebuild {
                node,
                tokens: incoming,
            });
        } else {
            let kept = self.with_node(ix, |n| {
                n.swa_live = true;
                n.value.clone()
            });
            actions.push(Action::RecoverSwaWithLockedFull {
                node,
                kept,
                incoming,
            });
        }
        ix
    }

    /// Adds the new tokens `[pos, len)` under `parent`: a tombstone node below the cursor,
    /// live nodes above it with the leaf capped at one page-aligned window. Returns the new
    /// last node, or `parent` when nothing was added (everything below the cursor).
    fn add_new(
        &mut self,
        parent: Ix,
        pos: usize,
        len: usize,
        cursor: usize,
        key: &[TokenId],
        value: &[VirtualToken],
    ) -> Ix {
        let c = cursor.max(pos);
        if c >= len {
            return parent; // would be an all-tombstone leaf: not cached
        }
        let make = |lo: usize, hi: usize, live: bool| Node {
            key: key[lo..hi].to_vec(),
            value: value[lo..hi].to_vec(),
            swa_live: live,
            ..Node::default()
        };
        let mut x = parent;
        if c > pos {
            x = self.add_child(x, make(pos, c, false));
        }
        let mut lo = c;
        if let Some(tail) = self.config.leaf_window()
            && len - lo > tail.0
        {
            x = self.add_child(x, make(lo, len - tail.0, true));
            lo = len - tail.0;
        }
        self.add_child(x, make(lo, len, true))
    }
}

/// Frees the duplicate `value[lo..hi]`: FULL-only below `cursor`, two-sided above.
fn push_split_free(
    actions: &mut Vec<Action>,
    value: &[VirtualToken],
    lo: usize,
    hi: usize,
    cursor: usize,
) {
    let mid = cursor.clamp(lo, hi);
    push_full_only(actions, &value[lo..mid]);
    if mid < hi {
        if let Some(Action::FreeDeviceKv { tokens }) = actions.last_mut() {
            tokens.extend_from_slice(&value[mid..hi]);
        } else {
            actions.push(Action::FreeDeviceKv {
                tokens: value[mid..hi].to_vec(),
            });
        }
    }
}

/// Frees `tokens` FULL-only, merged into the previous action when it is one too (both
/// are whole pages, so the merged list is still a list of whole pages).
fn push_full_only(actions: &mut Vec<Action>, tokens: &[VirtualToken]) {
    if tokens.is_empty() {
        return;
    }
    if let Some(Action::FreeDeviceKvFullOnly { tokens: last }) = actions.last_mut() {
        last.extend_from_slice(tokens);
    } else {
        actions.push(Action::FreeDeviceKvFullOnly {
            tokens: tokens.to_vec(),
        });
    }
}

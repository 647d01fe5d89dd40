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
//! A request that already holds a lock on the path it extends inserts only its new suffix
//! ([`InsertRequest::after`], SGLang's `insert_suffix_from_node`): the walk starts at the
//! locked node instead of the root, so a chunk costs its own tokens, not the whole row.
//!
//! Recurrent states attach at the key's end ([`InsertRequest::mamba`]) or at positions
//! inside it ([`InsertRequest::checkpoints`]: the node there is split so that one ends at
//! each); a state lands only on a node that has none and live SWA, otherwise its slot is
//! handed back (`FreeMambaSlot`). With a Mamba path cap, an insert that attaches states
//! then frees unlocked states on its path, never one it just attached, until the path
//! holds no more than the cap: first the states that serve no reuse (neither the deepest
//! state above a node where paths diverge nor copied by an admission), then the others,
//! each group least recently used first.
//!
//! Checks: the model test (`random_request_lifecycles_keep_the_tree_and_the_ledger_consistent`)
//! runs every sequence with and without [`InsertRequest::after`] in lockstep and compares
//! the trees, and the `tree` bench times both. The path cap values a state by the reuse
//! it serves because recency alone misleads there (a path's own inserts make every older
//! state on it look stale): `the_mamba_path_cap_keeps_the_state_other_paths_branch_from`,
//! `the_mamba_path_cap_keeps_a_state_an_admission_copied`, and in the facade
//! `every_request_after_the_first_branch_resumes_from_its_state` (a shared prompt's
//! branch state survives the chunk states of the request that saved it).

use crate::error::RadixError;
use crate::lock::State;
use crate::matching::common_pages;
use crate::tree::{Ix, Node, ROOT};
use crate::{
    Action, LockHandle, MambaSlot, NodeId, RadixTree, StateCheckpoint, StateRole, TokenId, Tokens,
    VirtualToken,
};

/// Where an insert's key starts, and which rows before its new part the tree owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyStart {
    /// The key is the whole sequence from position 0; rows `[0, tree_owned)` are the
    /// tree's own values (the request matched or cached them before).
    Root {
        /// The tree-owned prefix (SGLang's `prev_prefix_len`).
        tree_owned: Tokens,
    },
    /// The key continues the path that ends at the node `lock` holds: its first token
    /// sits at `at`, that node's end, and every row before it is the tree's own. The walk
    /// starts at that node (SGLang's `insert_suffix_from_node`).
    After {
        /// The caller's lock on the node its key continues.
        lock: LockHandle,
        /// The position of the key's first token: the locked node's end (checked).
        at: Tokens,
    },
}

/// What a request hands to [`RadixTree::insert`].
#[derive(Clone, Copy, Debug)]
pub struct InsertRequest<'a> {
    /// The request's tokens from [`InsertRequest::start`] on (the key ends on a page
    /// boundary; the caller keeps the partial last page).
    pub key: &'a [TokenId],
    /// The request's row: one virtual token per key token.
    pub value: &'a [VirtualToken],
    /// Where `key` starts.
    pub start: KeyStart,
    /// The window cursor, as a position in the whole sequence: SWA of rows below it is
    /// already released. Page-aligned, at least the tree-owned prefix. Ignored without
    /// SWA.
    pub window_cursor: Tokens,
    /// The Mamba state at the end of `key`, if the model has Mamba layers.
    pub mamba: Option<MambaSlot>,
    /// Mamba states at positions of the whole sequence (strictly ascending page
    /// boundaries in `(0, end of key]`, also before the key's start); each lands where
    /// the tree ends up caching that position.
    pub checkpoints: &'a [StateCheckpoint],
    /// Lock the inserted node and return the handle (an unfinished request that keeps
    /// decoding on top of what it just cached). The lock keeps its path's KV, not the
    /// Mamba state at the node: the request runs on its own state slot. The caller releases the request's previous
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
            start: KeyStart::Root {
                tree_owned: Tokens::ZERO,
            },
            window_cursor: Tokens::ZERO,
            mamba: None,
            checkpoints: &[],
            lock: false,
        }
    }

    /// The new suffix of a request holding `lock`: `key` and `value` are its tokens from
    /// position `at`, the end of the locked node, on ([`KeyStart::After`]).
    pub fn after(
        lock: LockHandle,
        at: usize,
        key: &'a [TokenId],
        value: &'a [VirtualToken],
    ) -> Self {
        InsertRequest {
            start: KeyStart::After {
                lock,
                at: Tokens(at),
            },
            ..InsertRequest::new(key, value)
        }
    }

    /// Sets the tree-owned prefix length of a key that starts at the root.
    pub fn prev_prefix_len(mut self, len: usize) -> Self {
        self.start = KeyStart::Root {
            tree_owned: Tokens(len),
        };
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
        let (row, start) = self.validate_insert(&req)?;
        let ps = self.ps();
        let len = row.end();
        let cursor = if self.swa_enabled() {
            req.window_cursor.0.max(row.tree_owned).min(len)
        } else {
            0
        };
        let mut actions = Vec::new();
        let mut pos = row.base;
        let mut x = start;
        while pos < len {
            let Some(&child) = self.nodes[x as usize].children.get(row.page(pos, ps)) else {
                break;
            };
            let c = common_pages(&self.nodes[child as usize].key, row.key_from(pos), ps);
            let child = if c < self.nodes[child as usize].len() {
                self.split(child, c)
            } else {
                child
            };
            let end = pos + c;
            let child = self.overlap(child, pos, end, row.tree_owned, cursor, &row, &mut actions);
            x = child;
            pos = end;
        }
        if pos < len {
            let last = self.add_new(x, pos, len, cursor, &row);
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
            Some(self.lock_ix(x, State::Unpinned, self.window()))
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
                n.mamba_grid = c.role == StateRole::Grid;
            });
            if c.in_flight {
                self.in_flight.push(y);
            }
            attached.push(y);
        }
    }

    /// Enforces [`crate::TreeConfig::mamba_path_cap`] on the path from the root to `x`,
    /// where states were just attached (`attached`): while the path holds more states than
    /// the cap, frees an unlocked state on it that was not just attached
    /// (`EvictMambaState`). Every such state sits on an ancestor of `x` or on `x`, and only
    /// the state goes. Locked states are never taken: the cap is best-effort over unlocked
    /// states.
    ///
    /// Which state goes is valued by the reuse it serves, not by recency alone: the path's
    /// own recent inserts make every older state on it look stale, the one that other
    /// paths resume from included. A state *serves reuse* when it is a **branch state**
    /// (walking the path up from `x`, a node with two children or more, its own node
    /// included, comes after the previous state: the deepest state above where paths
    /// diverge, the one a request taking the other branch resumes from) or when an
    /// admission copied it (`mamba_hit`). The cap evicts the states that serve no reuse
    /// first, [`StateRole::Grid`] ones before anchors, then the others, each group least
    /// recently used first. One walk up the path:
    /// O(path), as a pure LRU order. Forks below `x` are not walked: they could only value
    /// a state on `x` itself that this insert did not attach.
    fn evict_excess_path_states(&mut self, x: Ix, attached: &[Ix], actions: &mut Vec<Action>) {
        let Some(cap) = self.config.mamba_path_cap else {
            return;
        };
        let mut held = 0;
        let mut candidates: Vec<(bool, bool, u64, Ix)> = Vec::new();
        // Whether paths diverge below the current node and above the previous state.
        let mut fork_below = false;
        let mut y = x;
        while y != ROOT {
            let n = &self.nodes[y as usize];
            fork_below |= n.children.len() >= 2;
            if n.mamba.is_some() {
                held += 1;
                if self.state_unpinned(y) && !attached.contains(&y) {
                    candidates.push((fork_below || n.mamba_hit, !n.mamba_grid, n.mamba_tick, y));
                }
                // A fork below this state is served by it, not by the states above it.
                fork_below = false;
            }
            y = n.parent;
        }
        if held <= cap.get() {
            return;
        }
        // States that serve no reuse first (`false` sorts first), grid points before
        // anchors, then least recently used; the index breaks tick ties deterministically, as in the Mamba LRU set.
        candidates.sort_unstable();
        for (.., y) in candidates.into_iter().take(held - cap.get()) {
            self.evict_mamba(y, actions);
        }
    }

    /// Checks `req` and resolves where its walk starts: the row with absolute positions,
    /// and the node ending at the row's first position.
    fn validate_insert<'r>(&self, req: &InsertRequest<'r>) -> Result<(Row<'r>, Ix), RadixError> {
        let ps = self.ps();
        let page_size = self.config.page_size;
        if req.key.len() != req.value.len() {
            return Err(RadixError::KeyValueLengthMismatch {
                key: req.key.len(),
                value: req.value.len(),
            });
        }
        let (base, tree_owned, start) = match req.start {
            KeyStart::Root { tree_owned } => (0, tree_owned.0, ROOT),
            KeyStart::After { lock, at } => {
                let ix = self
                    .locks
                    .get(&lock.0)
                    .ok_or(RadixError::UnknownLock(lock))?
                    .node;
                let end = self.start_of(ix) + self.nodes[ix as usize].len();
                if at.0 != end {
                    return Err(RadixError::SuffixStartMismatch {
                        at: at.0,
                        node_end: end,
                    });
                }
                (end, end, ix)
            }
        };
        let row = Row {
            base,
            tree_owned,
            key: req.key,
            value: req.value,
        };
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
        aligned("prev_prefix_len", tree_owned)?;
        if self.swa_enabled() {
            aligned("window cursor", req.window_cursor.0)?;
        }
        if (req.mamba.is_some() || !req.checkpoints.is_empty()) && !self.config.mamba {
            return Err(RadixError::MambaDisabled);
        }
        let mut previous = 0;
        for c in req.checkpoints {
            let at = c.at.0;
            if at <= previous || at > row.end() || !at.is_multiple_of(ps) {
                return Err(RadixError::BadCheckpoint {
                    at,
                    key_len: row.end(),
                    page_size,
                });
            }
            previous = at;
        }
        if base > 0 {
            return Ok((row, start)); // the lock's path is the tree's own
        }
        let ppl = tree_owned;
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
        Ok((row, start))
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
        row: &Row<'_>,
        actions: &mut Vec<Action>,
    ) -> Ix {
        let dup_lo = s.max(ppl);
        if dup_lo >= e {
            return ix; // the tree's own values
        }
        let swa_live = !self.swa_enabled() || self.nodes[ix as usize].swa_live;
        if swa_live {
            push_split_free(actions, row, dup_lo, e, cursor);
            return ix;
        }
        // Tombstone.
        let live_lo = dup_lo.max(cursor);
        if live_lo >= e {
            push_full_only(actions, row.values(dup_lo, e));
            return ix;
        }
        push_full_only(actions, row.values(dup_lo, live_lo));
        if live_lo > s {
            self.split(ix, live_lo - s);
        }
        let incoming = row.values(live_lo, e).to_vec();
        let node = self.id(ix);
        if self.nodes[ix as usize].full_lock == 0 {
            let old = self.with_node(ix, |n| {
                n.swa_live = true;
                std::mem::replace(&mut n.value, incoming.as_slice().into())
            });
            actions.push(Action::FreeDeviceKvFullOnly {
                tokens: old.to_vec(),
            });
            actions.push(Action::SwaRebuild {
                node,
                tokens: incoming,
            });
        } else {
            let kept = self.with_node(ix, |n| {
                n.swa_live = true;
                n.value.to_vec()
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
    fn add_new(&mut self, parent: Ix, pos: usize, len: usize, cursor: usize, row: &Row<'_>) -> Ix {
        let c = cursor.max(pos);
        if c >= len {
            return parent; // would be an all-tombstone leaf: not cached
        }
        let make = |lo: usize, hi: usize, live: bool| Node {
            key: row.keys(lo, hi).to_vec(),
            value: row.values(lo, hi).into(),
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

/// An insert's key and value, addressed by positions of the whole sequence: they hold
/// positions `[base, base + len)`.
struct Row<'a> {
    /// The position of `key[0]`.
    base: usize,
    /// Rows below this position are the tree's own values.
    tree_owned: usize,
    key: &'a [TokenId],
    value: &'a [VirtualToken],
}

impl<'a> Row<'a> {
    /// The position after the last key token.
    fn end(&self) -> usize {
        self.base + self.key.len()
    }

    fn key_from(&self, pos: usize) -> &'a [TokenId] {
        &self.key[pos - self.base..]
    }

    fn page(&self, pos: usize, ps: usize) -> &'a [TokenId] {
        self.keys(pos, pos + ps)
    }

    fn keys(&self, lo: usize, hi: usize) -> &'a [TokenId] {
        &self.key[lo - self.base..hi - self.base]
    }

    fn values(&self, lo: usize, hi: usize) -> &'a [VirtualToken] {
        &self.value[lo - self.base..hi - self.base]
    }
}

/// Frees the duplicate rows `[lo, hi)`: FULL-only below `cursor`, two-sided above.
fn push_split_free(actions: &mut Vec<Action>, row: &Row<'_>, lo: usize, hi: usize, cursor: usize) {
    let mid = cursor.clamp(lo, hi);
    push_full_only(actions, row.values(lo, mid));
    if mid < hi {
        let tail = row.values(mid, hi);
        if let Some(Action::FreeDeviceKv { tokens }) = actions.last_mut() {
            tokens.extend_from_slice(tail);
        } else {
            actions.push(Action::FreeDeviceKv {
                tokens: tail.to_vec(),
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

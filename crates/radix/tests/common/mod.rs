//! Test support shared by the radix integration tests: a page-ownership ledger that plays
//! the allocator (every action is applied to it; a page freed twice, freed on the wrong
//! side or leaked fails loudly), and a driver that runs requests against a tree the way
//! the facade will (match, lock, window eviction, insert, unlock, free the rest).

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use unikv_radix::{
    Action, Component, InsertRequest, LockHandle, MambaSlot, MatchResult, NodeId, RadixError,
    RadixTree, SwaSide, TokenId, Tokens, TreeConfig, VirtualToken,
};

/// A page's state in the ledger: FULL allocated, SWA live or released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Page {
    /// FULL and SWA bound.
    Live,
    /// FULL bound, SWA released.
    Tomb,
}

/// The allocator stand-in: which virtual pages and Mamba slots are allocated.
#[derive(Debug)]
pub struct Ledger {
    pub ps: usize,
    pub pages: BTreeMap<u32, Page>,
    free_pages: Vec<u32>,
    next_page: u32,
    pub slots: BTreeSet<u32>,
    next_slot: u32,
    /// How many actions of each kind were applied.
    pub seen: BTreeMap<&'static str, usize>,
}

impl Ledger {
    pub fn new(ps: usize) -> Self {
        Ledger {
            ps,
            pages: BTreeMap::new(),
            free_pages: Vec::new(),
            next_page: 1, // page 0 is the sink
            slots: BTreeSet::new(),
            next_slot: 0,
            seen: BTreeMap::new(),
        }
    }

    /// Allocates `tokens` (whole pages) with both sides bound; freed pages are reused
    /// first (LIFO) so that a stale reference would alias a new owner.
    pub fn alloc(&mut self, tokens: usize) -> Vec<VirtualToken> {
        assert_eq!(tokens % self.ps, 0, "alloc of a partial page");
        let mut out = Vec::with_capacity(tokens);
        for _ in 0..tokens / self.ps {
            let page = self.free_pages.pop().unwrap_or_else(|| {
                self.next_page += 1;
                self.next_page - 1
            });
            assert!(self.pages.insert(page, Page::Live).is_none());
            let base = page * self.ps as u32;
            out.extend((0..self.ps as u32).map(|o| VirtualToken(base + o)));
        }
        out
    }

    pub fn alloc_slot(&mut self) -> MambaSlot {
        self.next_slot += 1;
        self.slots.insert(self.next_slot);
        MambaSlot(self.next_slot)
    }

    /// The pages of a token list that must be whole pages, each once.
    pub fn pages_of(&self, tokens: &[VirtualToken]) -> Vec<u32> {
        assert_eq!(tokens.len() % self.ps, 0, "token list is not whole pages");
        let mut seen = BTreeSet::new();
        tokens
            .chunks(self.ps)
            .map(|chunk| {
                let page = chunk[0].0 / self.ps as u32;
                for (o, t) in chunk.iter().enumerate() {
                    assert_eq!(t.0, page * self.ps as u32 + o as u32, "not a whole page");
                }
                assert!(seen.insert(page), "page {page} twice in one list");
                page
            })
            .collect()
    }

    fn expect_state(&self, page: u32, state: Page, what: &str) {
        assert_eq!(
            self.pages.get(&page),
            Some(&state),
            "{what}: page {page} should be {state:?}"
        );
    }

    /// Window eviction of a request's rows: SWA released, FULL kept.
    pub fn free_swa(&mut self, tokens: &[VirtualToken]) {
        for p in self.pages_of(tokens) {
            self.expect_state(p, Page::Live, "free_swa_segment");
            self.pages.insert(p, Page::Tomb);
        }
    }

    fn free_two_sided(&mut self, tokens: &[VirtualToken], what: &str) {
        for p in self.pages_of(tokens) {
            self.expect_state(p, Page::Live, what);
            self.pages.remove(&p);
            self.free_pages.push(p);
        }
    }

    fn free_full_only(&mut self, tokens: &[VirtualToken], what: &str) {
        for p in self.pages_of(tokens) {
            self.expect_state(p, Page::Tomb, what);
            self.pages.remove(&p);
            self.free_pages.push(p);
        }
    }

    fn free_slot(&mut self, slot: MambaSlot) {
        assert!(
            self.slots.remove(&slot.0),
            "Mamba slot {} freed twice",
            slot.0
        );
    }

    /// Applies one action as the facade would.
    pub fn apply(&mut self, action: &Action) {
        let kind = match action {
            Action::FreeDeviceKv { .. } => "FreeDeviceKv",
            Action::FreeDeviceKvFullOnly { .. } => "FreeDeviceKvFullOnly",
            Action::SwaRebuild { .. } => "SwaRebuild",
            Action::RecoverSwaWithLockedFull { .. } => "RecoverSwaWithLockedFull",
            Action::EvictNode {
                swa: SwaSide::Live, ..
            } => "EvictNode(live)",
            Action::EvictNode { .. } => "EvictNode(tombstone)",
            Action::TombstoneSwa { .. } => "TombstoneSwa",
            Action::EvictMambaState { .. } => "EvictMambaState",
            Action::FreeMambaSlot { .. } => "FreeMambaSlot",
        };
        *self.seen.entry(kind).or_default() += 1;
        match action {
            Action::FreeDeviceKv { tokens } => self.free_two_sided(tokens, "FreeDeviceKv"),
            Action::FreeDeviceKvFullOnly { tokens } => {
                self.free_full_only(tokens, "FreeDeviceKvFullOnly")
            }
            Action::SwaRebuild { tokens, .. } => {
                for p in self.pages_of(tokens) {
                    self.expect_state(p, Page::Live, "SwaRebuild");
                }
            }
            Action::RecoverSwaWithLockedFull { kept, incoming, .. } => {
                assert_eq!(kept.len(), incoming.len());
                let kept = self.pages_of(kept);
                let incoming = self.pages_of(incoming);
                for (&k, &i) in kept.iter().zip(&incoming) {
                    self.expect_state(k, Page::Tomb, "recover (kept)");
                    self.expect_state(i, Page::Live, "recover (incoming)");
                    // Rebind: kept takes incoming's SWA page; incoming is tombstoned, then
                    // its FULL freed.
                    self.pages.insert(k, Page::Live);
                    self.pages.remove(&i);
                    self.free_pages.push(i);
                }
            }
            Action::EvictNode { tokens, swa, .. } => match swa {
                SwaSide::Live => self.free_two_sided(tokens, "EvictNode (live)"),
                SwaSide::Tombstone => self.free_full_only(tokens, "EvictNode (tombstone)"),
            },
            Action::TombstoneSwa { tokens, .. } => self.free_swa(tokens),
            Action::EvictMambaState { slot, .. } | Action::FreeMambaSlot { slot } => {
                self.free_slot(*slot)
            }
        }
    }

    pub fn apply_all(&mut self, actions: &[Action]) {
        for a in actions {
            self.apply(a);
        }
    }

    pub fn live_pages(&self) -> usize {
        self.pages.values().filter(|&&p| p == Page::Live).count()
    }
}

/// Expands page symbols into tokens: each symbol is one page whose last token is the
/// symbol and whose other tokens are 0, so different pages share all but their last token
/// (matches diverge inside a page, and only whole pages may count).
pub fn tokens(pages: &[u32], ps: usize) -> Vec<TokenId> {
    pages
        .iter()
        .flat_map(|&s| (0..ps).map(move |i| TokenId(if i + 1 == ps { s + 1 } else { 0 })))
        .collect()
}

/// A request as the facade tracks it.
#[derive(Debug)]
pub struct Req {
    pub key: Vec<TokenId>,
    pub row: Vec<VirtualToken>,
    /// `[0, ppl)` are tree values.
    pub ppl: usize,
    /// SWA of `[ppl, cursor)` released.
    pub cursor: usize,
    pub lock: Option<LockHandle>,
    pub window_locked: bool,
    /// Pages the window lock must keep live: up to a window of live pages right below
    /// `ppl`, taken when the lock was.
    pub window_pages: Vec<u32>,
    pub mamba: Option<MambaSlot>,
}

/// How a request holding a lock inserts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// Its whole key from the root, claiming the tree-owned prefix.
    FromRoot,
    /// Only what follows its locked node ([`InsertRequest::after`]), as the facade does.
    FromLock,
}

/// A tree, a ledger and the requests in flight.
pub struct Sim {
    pub tree: RadixTree,
    /// How requests holding a lock insert.
    pub walk: Walk,
    pub ledger: Ledger,
    pub ps: usize,
    pub reqs: Vec<Req>,
    /// Locks taken on arbitrary nodes (not by requests), with the node.
    pub extra_locks: Vec<(LockHandle, NodeId)>,
    /// States inserts evicted for the Mamba path cap.
    pub cap_evictions: usize,
    /// Inserts that left their path over the cap (every other state on it locked).
    pub cap_overruns: usize,
    /// Matches that reported a Mamba branching length.
    pub mamba_branchings: usize,
}

impl Sim {
    pub fn new(config: TreeConfig) -> Self {
        Self::with_walk(config, Walk::FromRoot)
    }

    pub fn with_walk(config: TreeConfig, walk: Walk) -> Self {
        let ps = config.page_size as usize;
        Sim {
            tree: RadixTree::new(config).unwrap(),
            walk,
            ledger: Ledger::new(ps),
            ps,
            reqs: Vec::new(),
            extra_locks: Vec::new(),
            cap_evictions: 0,
            cap_overruns: 0,
            mamba_branchings: 0,
        }
    }

    pub fn window(&self) -> Option<usize> {
        self.tree.config().window.map(|w| w.get())
    }

    /// A request arrives with `key` (whole pages): match, lock, allocate the rest.
    pub fn start(&mut self, key: Vec<TokenId>) -> usize {
        let m = self.tree.match_prefix(&key);
        self.check_match(&key, &m);
        let lock = self.tree.lock(m.node).unwrap();
        let mut row = m.values.to_vec();
        row.extend(self.ledger.alloc(key.len() - m.len.get()));
        let mamba = self.tree.config().mamba.then(|| self.ledger.alloc_slot());
        let window_pages = self.window_pages(&row[..m.len.get()]);
        self.reqs.push(Req {
            key,
            row,
            ppl: m.len.get(),
            cursor: m.len.get(),
            lock: Some(lock),
            window_locked: true,
            window_pages,
            mamba,
        });
        self.reqs.len() - 1
    }

    /// The live pages right below the end of `prefix`, up to a window's worth of tokens:
    /// what a window lock at that end protects.
    fn window_pages(&self, prefix: &[VirtualToken]) -> Vec<u32> {
        let Some(w) = self.window() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut covered = 0;
        for page in self.ledger.pages_of(prefix).into_iter().rev() {
            if covered >= w || self.ledger.pages.get(&page) != Some(&Page::Live) {
                break;
            }
            out.push(page);
            covered += self.ps;
        }
        out
    }

    /// A request that arrived before the cache held anything it could reuse: nothing
    /// matched, nothing locked, its whole row freshly allocated.
    pub fn start_fresh(&mut self, key: Vec<TokenId>) -> usize {
        let row = self.ledger.alloc(key.len());
        let mamba = self.tree.config().mamba.then(|| self.ledger.alloc_slot());
        self.reqs.push(Req {
            key,
            row,
            ppl: 0,
            cursor: 0,
            lock: None,
            window_locked: false,
            window_pages: Vec::new(),
            mamba,
        });
        self.reqs.len() - 1
    }

    /// Moves the cursor to `cursor` tokens (page-aligned) whatever the ratchet rule says.
    pub fn slide_to(&mut self, r: usize, cursor: usize) {
        let req = &mut self.reqs[r];
        assert!(cursor >= req.cursor && cursor.is_multiple_of(self.ps));
        self.ledger.free_swa(&req.row[req.cursor..cursor]);
        req.cursor = cursor;
    }

    /// Decodes `extra` (whole pages) more tokens.
    pub fn extend(&mut self, r: usize, extra: &[TokenId]) {
        let row = self.ledger.alloc(extra.len());
        let req = &mut self.reqs[r];
        req.key.extend_from_slice(extra);
        req.row.extend(row);
    }

    /// Window eviction: moves the cursor up by up to `pages`, never past
    /// `len − max(W, ps)` floored to a page (the ratchet rule for prefix-sharing caches).
    pub fn slide(&mut self, r: usize, pages: usize) {
        let Some(w) = self.window() else { return };
        let ps = self.ps;
        let req = &mut self.reqs[r];
        let limit = req.key.len().saturating_sub(w.max(ps)) / ps * ps;
        let new = (req.cursor + pages * ps).min(limit);
        if new > req.cursor {
            self.ledger.free_swa(&req.row[req.cursor..new]);
            req.cursor = new;
        }
    }

    /// Locks the `i`-th node (in dump order) directly, whatever it is (root, tombstone,
    /// internal node).
    pub fn lock_any(&mut self, i: usize) {
        let nodes: Vec<NodeId> = self.tree.nodes().iter().map(|v| v.id).collect();
        let node = nodes[i % nodes.len()];
        let handle = self.tree.lock(node).unwrap();
        self.extra_locks.push((handle, node));
    }

    /// Releases the `i`-th extra lock; a second release is refused and changes nothing.
    pub fn unlock_any(&mut self, i: usize) {
        if self.extra_locks.is_empty() {
            return;
        }
        let (handle, _) = self.extra_locks.remove(i % self.extra_locks.len());
        self.tree.unlock(handle).unwrap();
        let before = self.tree.dump();
        assert_eq!(
            self.tree.unlock(handle),
            Err(RadixError::UnknownLock(handle))
        );
        assert_eq!(self.tree.dump(), before);
    }

    /// Releases the window lock early.
    pub fn release_window(&mut self, r: usize) {
        let req = &mut self.reqs[r];
        if let (Some(lock), true) = (req.lock, req.window_locked) {
            self.tree.release_window(lock).unwrap();
            req.window_locked = false;
            req.window_pages.clear();
        }
    }

    fn insert_request(
        &mut self,
        r: usize,
        lock: bool,
        mamba: Option<MambaSlot>,
    ) -> (usize, Vec<Action>) {
        let req = &self.reqs[r];
        let from_lock = req.lock.filter(|_| self.walk == Walk::FromLock);
        let mut ins = match from_lock {
            Some(held) => {
                InsertRequest::after(held, req.ppl, &req.key[req.ppl..], &req.row[req.ppl..])
            }
            None => InsertRequest::new(&req.key, &req.row).prev_prefix_len(req.ppl),
        }
        .window_cursor(req.cursor);
        ins.mamba = mamba;
        ins.lock = lock;
        let hit_before = self.tree.full_hit_len(&req.key).get();
        let out = self.tree.insert(ins).unwrap();
        self.check_actions_disjoint(&out.actions);
        self.check_path_cap(mamba, &out);
        self.check_cached(r, hit_before, &out);
        self.ledger.apply_all(&out.actions);
        let old = self.reqs[r].lock.take();
        if let Some(old) = old {
            self.tree.unlock(old).unwrap();
        }
        let cached = out.cached_len.get();
        let values = self.tree.prefix_values(out.node).unwrap().to_vec();
        assert_eq!(values.len(), cached);
        let window_pages = if out.lock.is_some() {
            self.window_pages(&values)
        } else {
            Vec::new()
        };
        let req = &mut self.reqs[r];
        req.window_pages = window_pages;
        req.row[..cached].copy_from_slice(&values);
        req.ppl = cached;
        req.cursor = req.cursor.max(cached);
        req.lock = out.lock;
        req.window_locked = out.lock.is_some();
        (cached, out.actions)
    }

    /// The model of what an insert caches: the whole key, unless the tokens past what the
    /// tree held all lie below the window cursor (they would form an all-tombstone leaf);
    /// the tree then holds exactly that on FULL; and every node of the key's path that
    /// ends above the cursor is live (duplicates over tombstones revived them).
    fn check_cached(&self, r: usize, hit_before: usize, out: &unikv_radix::InsertOutcome) {
        let req = &self.reqs[r];
        let len = req.key.len();
        let cached = out.cached_len.get();
        let cursor = if self.window().is_some() {
            req.cursor.max(req.ppl).min(len)
        } else {
            0
        };
        let expected = if hit_before >= len || cursor < len {
            len
        } else {
            hit_before
        };
        assert_eq!(
            cached, expected,
            "cached length (cursor {cursor}, hit {hit_before})"
        );
        assert_eq!(self.tree.full_hit_len(&req.key).get(), cached);
        let mut id = Some(out.node);
        while let Some(node) = id {
            let v = self.tree.node(node).unwrap();
            if v.parent.is_some() && v.start.get() + v.key.len() > cursor {
                assert!(
                    v.swa_live,
                    "node {node} above the cursor {cursor} is a tombstone"
                );
            }
            id = v.parent;
        }
    }

    /// The model of the Mamba path cap: only an insert that attached its state evicts
    /// states for the cap, each an unlocked state on an ancestor of its node, no more than
    /// the excess; afterwards the path holds at most `cap` states, or more only when every
    /// state on it but the new one is locked (the cap is best-effort over unlocked states).
    fn check_path_cap(&mut self, slot: Option<MambaSlot>, out: &unikv_radix::InsertOutcome) {
        let evicted: Vec<NodeId> = out
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::EvictMambaState { node, .. } => Some(*node),
                _ => None,
            })
            .collect();
        let attached = slot.is_some_and(|s| {
            !out.actions.contains(&Action::FreeMambaSlot { slot: s })
                && self.tree.node(out.node).unwrap().mamba == Some(s)
        });
        let Some(cap) = self.tree.config().mamba_path_cap else {
            assert!(evicted.is_empty(), "states evicted without a cap");
            return;
        };
        if !attached {
            assert!(evicted.is_empty(), "states evicted without an attach");
            return;
        }
        let mut ancestors = Vec::new();
        let mut id = self.tree.node(out.node).unwrap().parent;
        while let Some(n) = id {
            let v = self.tree.node(n).unwrap();
            ancestors.push(v);
            id = v.parent;
        }
        for e in &evicted {
            let v = ancestors
                .iter()
                .find(|v| v.id == *e)
                .expect("an evicted state is not on the inserted path");
            assert_eq!((v.mamba, v.mamba_lock), (None, 0));
        }
        let held = 1 + ancestors.iter().filter(|v| v.mamba.is_some()).count();
        let all_locked = ancestors
            .iter()
            .all(|v| v.mamba.is_none() || v.mamba_lock > 0);
        assert!(
            held <= cap.get() || all_locked,
            "path holds {held} states over cap {cap} with unlocked ones left"
        );
        if !evicted.is_empty() {
            assert!(
                held == cap.get() || all_locked,
                "evicted more than the excess"
            );
        }
        self.cap_evictions += evicted.len();
        self.cap_overruns += usize::from(held > cap.get());
    }

    /// An unfinished request caches what it has and keeps the new node locked.
    pub fn checkpoint(&mut self, r: usize) -> Vec<Action> {
        self.insert_request(r, true, None).1
    }

    /// A finished request: insert, unlock, free what the tree did not take. Returns the
    /// insert's actions.
    pub fn finish(&mut self, r: usize) -> Vec<Action> {
        let mamba = self.reqs[r].mamba.take();
        let (cached, actions) = self.insert_request(r, false, mamba);
        let req = self.reqs.remove(r);
        let mid = req.cursor.max(cached);
        if mid > cached {
            self.ledger.apply(&Action::FreeDeviceKvFullOnly {
                tokens: req.row[cached..mid].to_vec(),
            });
        }
        if req.row.len() > mid {
            self.ledger.apply(&Action::FreeDeviceKv {
                tokens: req.row[mid..].to_vec(),
            });
        }
        actions
    }

    /// Evicts `component` until `amount` tokens (or slots) are released.
    pub fn evict(&mut self, component: Component, amount: usize) -> Vec<Action> {
        let (actions, released) = self.tree.evict_until(component, |r| match component {
            Component::Full => r.full.get() >= amount,
            Component::Swa => r.swa.get() >= amount,
            Component::Mamba => r.mamba.get() >= amount,
        });
        assert_eq!(released, unikv_radix::Released::of(&actions));
        self.check_actions_disjoint(&actions);
        self.ledger.apply_all(&actions);
        actions
    }

    /// A match without a lock, checked against the model.
    pub fn probe(&mut self, key: &[TokenId]) -> MatchResult {
        let m = self.tree.match_prefix(key);
        self.check_match(key, &m);
        m
    }

    /// No page appears in two actions of one operation, except as a recovery's `kept`
    /// (which is the node's, not freed) or a rebuild's stamp.
    pub fn check_actions_disjoint(&self, actions: &[Action]) {
        let mut seen = BTreeSet::new();
        for a in actions {
            let lists: Vec<&Vec<VirtualToken>> = match a {
                Action::FreeDeviceKv { tokens }
                | Action::FreeDeviceKvFullOnly { tokens }
                | Action::EvictNode { tokens, .. }
                | Action::TombstoneSwa { tokens, .. } => vec![tokens],
                Action::RecoverSwaWithLockedFull { incoming, .. } => vec![incoming],
                _ => vec![],
            };
            for l in lists {
                for p in self.ledger.pages_of(l) {
                    assert!(seen.insert(p), "page {p} in two actions: {actions:?}");
                }
            }
        }
    }

    /// The model of a match: the values are the tree's, the end is valid by the ledger's
    /// SWA states (a whole window of live pages behind it unless no page before it is a
    /// tombstone; with Mamba, a state on the node), and no deeper node of the FULL hit is
    /// valid.
    pub fn check_match(&mut self, key: &[TokenId], m: &MatchResult) {
        let ps = self.ps;
        assert!(m.len <= m.full_hit);
        assert_eq!(m.len.get() % ps, 0);
        assert_eq!(m.full_hit.get() % ps, 0);
        assert_eq!(m.values, self.tree.prefix_values(m.node).unwrap());
        assert_eq!(m.branching, (m.full_hit > m.len).then_some(m.full_hit));
        let config = self.tree.config();
        let grid = config
            .mamba_checkpoint_interval
            .map_or(ps, |interval| interval.get());
        let aligned = m.full_hit.get() / grid * grid;
        assert_eq!(
            m.mamba_branching,
            (config.mamba && aligned > m.len.get()).then_some(Tokens(aligned))
        );
        self.mamba_branchings += usize::from(m.mamba_branching.is_some());
        // The FULL hit path, root first.
        let mut path = Vec::new();
        let mut id = Some(m.full_hit_node);
        while let Some(n) = id {
            let view = self.tree.node(n).unwrap();
            path.push(view);
            id = view.parent;
        }
        path.reverse();
        let mut pos = 0;
        let mut last_tomb_end: Option<usize> = None;
        let mut best = 0;
        for v in &path[1..] {
            assert_eq!(v.key, &key[pos..pos + v.key.len()], "FULL hit key mismatch");
            let pages = self.ledger.pages_of(v.value);
            let states: BTreeSet<Page> = pages.iter().map(|p| self.ledger.pages[p]).collect();
            assert_eq!(states.len(), 1, "a node's pages disagree on SWA");
            pos += v.key.len();
            if states.contains(&Page::Tomb) {
                last_tomb_end = Some(pos);
            }
            let swa_ok = match (self.window(), last_tomb_end) {
                (None, _) | (_, None) => true,
                (Some(w), Some(t)) => pos - t >= w,
            };
            let mamba_ok = !self.tree.config().mamba || v.mamba.is_some();
            if swa_ok && mamba_ok {
                best = pos;
            }
        }
        assert_eq!(pos, m.full_hit.get());
        assert_eq!(best, m.len.get(), "match end is not the deepest valid end");
        // The FULL hit cannot go one page further.
        if pos + ps <= key.len() {
            let next = &key[pos..pos + ps];
            assert!(
                !self
                    .tree
                    .nodes()
                    .iter()
                    .any(|v| v.parent == Some(m.full_hit_node) && &v.key[..ps] == next),
                "FULL hit stopped short"
            );
        }
    }

    /// Conservation: every allocated page is owned by exactly one of the tree or a request,
    /// in the SWA state its owner implies; every Mamba slot likewise.
    pub fn check_conservation(&self) {
        fn own(owned: &mut BTreeMap<u32, Page>, pages: Vec<u32>, state: Page, who: &str) {
            for p in pages {
                assert!(
                    owned.insert(p, state).is_none(),
                    "page {p} owned twice ({who})"
                );
            }
        }
        let mut owned: BTreeMap<u32, Page> = BTreeMap::new();
        let mut slots = BTreeSet::new();
        for v in self.tree.nodes().iter().skip(1) {
            let state = if v.swa_live { Page::Live } else { Page::Tomb };
            own(&mut owned, self.ledger.pages_of(v.value), state, "tree");
            if let Some(s) = v.mamba {
                assert!(slots.insert(s.0));
            }
        }
        let tree_pages = owned.clone();
        for (_, node) in &self.extra_locks {
            assert!(
                self.tree.node(*node).is_ok(),
                "locked node {node} left the tree"
            );
        }
        for r in &self.reqs {
            // A locked prefix stays in the tree, and its window stays live.
            if r.lock.is_some() {
                for p in self.ledger.pages_of(&r.row[..r.ppl]) {
                    assert!(tree_pages.contains_key(&p), "locked page {p} left the tree");
                }
            }
            if r.window_locked {
                for p in &r.window_pages {
                    assert_eq!(
                        tree_pages.get(p),
                        Some(&Page::Live),
                        "window-locked page {p}"
                    );
                }
            }
            let cursor = if self.window().is_some() {
                r.cursor
            } else {
                r.ppl
            };
            own(
                &mut owned,
                self.ledger.pages_of(&r.row[r.ppl..cursor]),
                Page::Tomb,
                "request",
            );
            own(
                &mut owned,
                self.ledger.pages_of(&r.row[cursor..]),
                Page::Live,
                "request",
            );
            if let Some(s) = r.mamba {
                assert!(slots.insert(s.0));
            }
        }
        assert_eq!(
            owned, self.ledger.pages,
            "ledger and owners disagree (leak)"
        );
        assert_eq!(slots, self.ledger.slots, "Mamba slots leaked");
    }

    /// Finishes every request, evicts everything, and checks that nothing is left.
    pub fn drain(&mut self) {
        while !self.extra_locks.is_empty() {
            self.unlock_any(0);
        }
        while !self.reqs.is_empty() {
            self.finish(0);
        }
        self.evict(Component::Full, usize::MAX);
        assert_eq!(self.tree.node_count(), 1, "{}", self.tree.dump());
        assert!(
            self.ledger.pages.is_empty(),
            "pages leaked: {:?}",
            self.ledger.pages
        );
        assert!(self.ledger.slots.is_empty(), "slots leaked");
        assert_eq!(self.tree.sizes(), unikv_radix::Sizes::default());
    }

    /// Sanity, conservation and the invariant poll.
    pub fn check(&self) {
        self.tree.sanity_check().unwrap();
        self.check_conservation();
        self.tree.invariant_scope().poll().unwrap();
    }
}

/// Property-test cases: `PROPTEST_CASES` when it is set (a local hunt asks for more),
/// else `default` (sized for the CI matrix).
pub fn proptest_cases(default: u32) -> u32 {
    cases_from(std::env::var("PROPTEST_CASES").ok().as_deref(), default)
}

/// [`proptest_cases`] given the variable's value: a value that is not a count fails
/// loudly instead of falling back unnoticed.
pub fn cases_from(var: Option<&str>, default: u32) -> u32 {
    match var {
        None => default,
        Some(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PROPTEST_CASES={v:?} is not a number of cases")),
    }
}

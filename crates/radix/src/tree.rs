//! The arena, the node layout, the per-component LRU sets and exact accounting.
//!
//! Every mutation of a node goes through [`RadixTree::leave`] / [`RadixTree::enter`]
//! (or [`RadixTree::with_node`], which brackets a closure with both): `leave` takes the
//! node's contribution out of the six size counters and out of the LRU sets, `enter` puts
//! the recomputed contribution back. Accounting and LRU membership are therefore exact by
//! construction, and `sanity_check` recomputes both from scratch to prove it.

use crate::error::RadixError;
use crate::{
    MambaSlot, NodeId, PathValues, Slots, StateRole, TokenId, Tokens, TreeConfig, VirtualToken,
};
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use unikv_invariants::Scope;

/// Arena index of a node (internal; the public id adds a generation).
pub(crate) type Ix = u32;

/// The root's arena index.
pub(crate) const ROOT: Ix = 0;
/// "No node" (the root's parent).
pub(crate) const NIL: Ix = u32::MAX;

/// A small, fast, non-cryptographic hasher for child keys (token pages).
#[derive(Default, Clone, Copy)]
pub(crate) struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

/// Children keyed by their first page of tokens.
pub(crate) type Children = HashMap<Box<[TokenId]>, Ix, BuildHasherDefault<PageHasher>>;

/// One node of the arena.
#[derive(Debug, Default)]
pub(crate) struct Node {
    pub(crate) generation: u32,
    pub(crate) alive: bool,
    pub(crate) parent: Ix,
    pub(crate) key: Vec<TokenId>,
    /// Shared, so that a match hands out runs of it without a copy ([`PathValues`]).
    pub(crate) value: Arc<[VirtualToken]>,
    pub(crate) children: Children,
    /// SWA live (`false` = tombstone). Meaningless without SWA (kept `true`).
    pub(crate) swa_live: bool,
    pub(crate) full_lock: u32,
    pub(crate) swa_lock: u32,
    pub(crate) mamba_lock: u32,
    pub(crate) mamba: Option<MambaSlot>,
    /// The state's writing forward is in flight: it ends no match and is pinned like a
    /// locked one (its slot must not be recycled into the same forward) until
    /// [`RadixTree::publish_states`].
    pub(crate) mamba_in_flight: bool,
    /// An admission copied the state (a pinned lock took it) since it was attached: it
    /// served a later request, so the Mamba path cap keeps it over states that served
    /// none. Cleared with the state; never set without one.
    pub(crate) mamba_hit: bool,
    /// The state is a [`StateRole::Grid`] point ([`Node::mamba_key`]). Cleared with the
    /// state; never set without one.
    pub(crate) mamba_grid: bool,
    pub(crate) full_tick: u64,
    pub(crate) swa_tick: u64,
    pub(crate) mamba_tick: u64,
    pub(crate) in_full: bool,
    pub(crate) in_swa: bool,
    pub(crate) in_mamba: bool,
    /// Its SWA lies in the window of a state that serves reuse
    /// ([`RadixTree::serves_a_window`]), which orders SWA eviction ([`Node::swa_key`]).
    /// Kept, because it depends on the states below the node: recomputed where one of
    /// them changes ([`RadixTree::remark_windows`]) and for a split's new node. Always
    /// `false` in a tree without both SWA and recurrent state.
    pub(crate) swa_window: bool,
}

impl Node {
    /// Orders the Mamba LRU after every unserved grid state's key (ticks stay far below).
    const VALUED: u64 = 1 << 63;

    pub(crate) fn len(&self) -> usize {
        self.key.len()
    }

    /// Whether the node holds a state that serves reuse: any state but a
    /// [`StateRole::Grid`] point no admission copied ([`Node::mamba_hit`]).
    pub(crate) fn holds_valued_state(&self) -> bool {
        self.mamba.is_some() && (self.mamba_hit || !self.mamba_grid)
    }

    /// The node's key in the SWA LRU: live SWA no valued state's window needs
    /// ([`Node::swa_window`]) first, then the rest, each least recently used first.
    pub(crate) fn swa_key(&self) -> u64 {
        if self.swa_window {
            self.swa_tick | Self::VALUED
        } else {
            self.swa_tick
        }
    }

    /// The node's key in the Mamba LRU: [`StateRole::Grid`] states no admission copied
    /// first, then every other state, each least recently used first.
    pub(crate) fn mamba_key(&self) -> u64 {
        if self.holds_valued_state() {
            self.mamba_tick | Self::VALUED
        } else {
            self.mamba_tick
        }
    }
}

/// The six size counters: evictable and protected per component.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sizes {
    /// FULL tokens in nodes no lock holds (evictable by FULL eviction, leaves first).
    pub full_evictable: Tokens,
    /// FULL tokens in locked nodes.
    pub full_protected: Tokens,
    /// Live SWA tokens in nodes no window lock holds.
    pub swa_evictable: Tokens,
    /// Live SWA tokens in window-locked nodes.
    pub swa_protected: Tokens,
    /// Mamba states no lock holds.
    pub mamba_evictable: Slots,
    /// Locked Mamba states.
    pub mamba_protected: Slots,
}

/// What a node contributes to [`Sizes`]: `(full_e, full_p, swa_e, swa_p, mamba_e, mamba_p)`.
type Contribution = [usize; 6];

/// A recorded lock.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LockRecord {
    pub(crate) node: Ix,
    /// Start position (in tokens from the root) of the highest node the window lock
    /// covers; `None` when it covers nothing (released, or nothing live to cover).
    pub(crate) swa_floor: Option<usize>,
    /// Whether `release_window` (or `unlock`) released the window part already.
    pub(crate) window_released: bool,
    pub(crate) mamba: bool,
}

/// The prefix tree: an arena of nodes with FULL, SWA and MAMBA components.
///
/// See the crate documentation for the rules it keeps and the actions it emits.
#[derive(Debug)]
pub struct RadixTree {
    pub(crate) config: TreeConfig,
    pub(crate) nodes: Vec<Node>,
    pub(crate) free: Vec<Ix>,
    pub(crate) sizes: Sizes,
    pub(crate) full_lru: BTreeSet<(u64, Ix)>,
    pub(crate) swa_lru: BTreeSet<(u64, Ix)>,
    pub(crate) mamba_lru: BTreeSet<(u64, Ix)>,
    /// Nodes given a state whose writing forward is in flight (see
    /// [`Node::mamba_in_flight`]), cleared by [`RadixTree::publish_states`].
    pub(crate) in_flight: Vec<Ix>,
    pub(crate) clock: u64,
    pub(crate) locks: HashMap<u64, LockRecord>,
    pub(crate) next_lock: u64,
    /// Where the tree's invariant breaches are counted (its cache's scope).
    pub(crate) scope: Scope,
}

/// A read-only view of one node, for tests, dumps and diagnostics.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    /// The node.
    pub id: NodeId,
    /// Its parent (`None` for the root).
    pub parent: Option<NodeId>,
    /// Position of its first token, counted from the root.
    pub start: Tokens,
    /// Its key (empty for the root).
    pub key: &'a [TokenId],
    /// Its value: one virtual token per key token.
    pub value: &'a [VirtualToken],
    /// Whether its SWA side is live (always `true` without SWA, and for the root).
    pub swa_live: bool,
    /// FULL lock count.
    pub full_lock: u32,
    /// SWA (window) lock count.
    pub swa_lock: u32,
    /// Its Mamba state.
    pub mamba: Option<MambaSlot>,
    /// Its Mamba state's role (`Some` exactly when it has a state).
    pub mamba_role: Option<StateRole>,
    /// Mamba lock count.
    pub mamba_lock: u32,
    /// Number of children.
    pub children: usize,
}

impl RadixTree {
    /// An empty tree.
    pub fn new(config: TreeConfig) -> Result<Self, RadixError> {
        if config.page_size == 0 {
            return Err(RadixError::InvalidConfig {
                reason: "page size must be at least 1",
            });
        }
        if config.window == Some(Tokens(0)) {
            return Err(RadixError::InvalidConfig {
                reason: "window must be at least 1 token",
            });
        }
        let ps = config.page_size as usize;
        if let Some(interval) = config.mamba_checkpoint_interval {
            if interval.0 == 0 {
                return Err(RadixError::InvalidConfig {
                    reason: "Mamba checkpoint interval must be at least one page",
                });
            }
            if !interval.0.is_multiple_of(ps) {
                return Err(RadixError::NotPageAligned {
                    what: "Mamba checkpoint interval",
                    len: interval.0,
                    page_size: config.page_size,
                });
            }
        }
        if !config.mamba
            && (config.mamba_path_cap.is_some() || config.mamba_checkpoint_interval.is_some())
        {
            return Err(RadixError::InvalidConfig {
                reason: "Mamba path cap or checkpoint interval without the Mamba component",
            });
        }
        let root = Node {
            alive: true,
            parent: NIL,
            swa_live: true,
            ..Node::default()
        };
        Ok(RadixTree {
            config,
            nodes: vec![root],
            free: Vec::new(),
            sizes: Sizes::default(),
            full_lru: BTreeSet::new(),
            swa_lru: BTreeSet::new(),
            mamba_lru: BTreeSet::new(),
            in_flight: Vec::new(),
            clock: 0,
            locks: HashMap::new(),
            next_lock: 1,
            scope: Scope::new(),
        })
    }

    /// The invariant scope the tree counts its breaches in (its own, made by
    /// [`RadixTree::new`], until [`RadixTree::set_invariant_scope`]).
    pub fn invariant_scope(&self) -> &Scope {
        &self.scope
    }

    /// Counts the tree's breaches in `scope` from now on (a cache hands it its own
    /// scope); breaches recorded before stay in the previous scope.
    pub fn set_invariant_scope(&mut self, scope: Scope) {
        self.scope = scope;
    }

    /// The configuration the tree was built with.
    pub fn config(&self) -> &TreeConfig {
        &self.config
    }

    /// The root's id (matched length 0).
    pub fn root(&self) -> NodeId {
        self.id(ROOT)
    }

    /// Makes every state inserted as in flight ([`crate::StateCheckpoint::in_flight`])
    /// able to end a match: call it once the forward that wrote them is ordered before
    /// anything a later match issues (at the step boundary).
    pub fn publish_states(&mut self) {
        for ix in std::mem::take(&mut self.in_flight) {
            if self.nodes[ix as usize].mamba_in_flight {
                self.with_node(ix, |n| n.mamba_in_flight = false);
            }
        }
    }

    /// Whether `ix` holds a state that can end a match (one whose write has been
    /// published).
    pub(crate) fn holds_ready_state(&self, ix: Ix) -> bool {
        let n = &self.nodes[ix as usize];
        n.mamba.is_some() && !n.mamba_in_flight
    }

    /// Whether `ix`'s state may be evicted: it is neither locked nor in flight.
    pub(crate) fn state_unpinned(&self, ix: Ix) -> bool {
        let n = &self.nodes[ix as usize];
        n.mamba_lock == 0 && !n.mamba_in_flight
    }

    /// Exact evictable and protected sizes of every component.
    pub fn sizes(&self) -> Sizes {
        self.sizes
    }

    /// FULL tokens, live SWA tokens and Mamba states the tree holds (evictable plus
    /// protected): the tree's terms of a caller's leak equation.
    pub fn held(&self) -> (Tokens, Tokens, Slots) {
        let s = self.sizes;
        (
            s.full_evictable + s.full_protected,
            s.swa_evictable + s.swa_protected,
            s.mamba_evictable + s.mamba_protected,
        )
    }

    /// Number of live nodes, the root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Number of locks held.
    pub fn lock_count(&self) -> usize {
        self.locks.len()
    }

    /// A view of one node.
    pub fn node(&self, id: NodeId) -> Result<NodeView<'_>, RadixError> {
        let ix = self.resolve(id)?;
        Ok(self.view(ix, self.start_of(ix)))
    }

    /// Views of every live node, parents before children (depth-first, children in key
    /// order, so the order is deterministic).
    pub fn nodes(&self) -> Vec<NodeView<'_>> {
        let mut out = Vec::with_capacity(self.node_count());
        let mut stack = vec![(ROOT, 0usize)];
        while let Some((ix, start)) = stack.pop() {
            out.push(self.view(ix, start));
            let end = start + self.nodes[ix as usize].len();
            let mut kids = self.sorted_children(ix);
            kids.reverse();
            stack.extend(kids.into_iter().map(|c| (c, end)));
        }
        out
    }

    /// The key from the root down to the end of `id`: the tokens a request must start
    /// with to reach it. O(depth + its length).
    pub fn path_key(&self, id: NodeId) -> Result<Vec<TokenId>, RadixError> {
        let ix = self.resolve(id)?;
        let mut parts = Vec::new();
        let mut x = ix;
        while x != ROOT {
            parts.push(&self.nodes[x as usize].key[..]);
            x = self.nodes[x as usize].parent;
        }
        Ok(parts.into_iter().rev().flatten().copied().collect())
    }

    /// The values from the root down to the end of `id`: what a request matched at `id`
    /// holds in its row.
    pub fn prefix_values(&self, id: NodeId) -> Result<PathValues, RadixError> {
        self.values_from(id, Tokens::ZERO)
    }

    /// The values of positions `[from, end of id)` on the path to `id` (none when `from`
    /// is at or past its end), shared with the nodes: what changed in the row of a
    /// request that inserted the suffix after `from` ([`crate::InsertRequest::after`]).
    pub fn values_from(&self, id: NodeId, from: Tokens) -> Result<PathValues, RadixError> {
        let ix = self.resolve(id)?;
        let mut end = self.start_of(ix) + self.nodes[ix as usize].len();
        let mut path = Vec::new();
        let mut x = ix;
        while x != ROOT && end > from.0 {
            let n = &self.nodes[x as usize];
            let start = end - n.len();
            path.push((x, from.0.saturating_sub(start)));
            end = start;
            x = n.parent;
        }
        let mut values = PathValues::default();
        for &(p, skip) in path.iter().rev() {
            let value = &self.nodes[p as usize].value;
            values.push(value, skip..value.len());
        }
        Ok(values)
    }

    pub(crate) fn sorted_children(&self, ix: Ix) -> Vec<Ix> {
        let mut kids: Vec<(&[TokenId], Ix)> = self.nodes[ix as usize]
            .children
            .iter()
            .map(|(k, &c)| (&k[..], c))
            .collect();
        kids.sort();
        kids.into_iter().map(|(_, c)| c).collect()
    }

    fn view(&self, ix: Ix, start: usize) -> NodeView<'_> {
        let n = &self.nodes[ix as usize];
        NodeView {
            id: self.id(ix),
            parent: (n.parent != NIL).then(|| self.id(n.parent)),
            start: Tokens(start),
            key: &n.key,
            value: &n.value[..],
            swa_live: n.swa_live,
            full_lock: n.full_lock,
            swa_lock: n.swa_lock,
            mamba: n.mamba,
            mamba_role: n.mamba.map(|_| {
                if n.mamba_grid {
                    StateRole::Grid
                } else {
                    StateRole::Anchor
                }
            }),
            mamba_lock: n.mamba_lock,
            children: n.children.len(),
        }
    }

    pub(crate) fn ps(&self) -> usize {
        self.config.page_size as usize
    }

    pub(crate) fn swa_enabled(&self) -> bool {
        self.config.window.is_some()
    }

    pub(crate) fn window(&self) -> usize {
        self.config.window.map_or(0, |w| w.0)
    }

    pub(crate) fn id(&self, ix: Ix) -> NodeId {
        NodeId {
            index: ix,
            generation: self.nodes[ix as usize].generation,
        }
    }

    pub(crate) fn resolve(&self, id: NodeId) -> Result<Ix, RadixError> {
        match self.nodes.get(id.index as usize) {
            Some(n) if n.alive && n.generation == id.generation => Ok(id.index),
            _ => Err(RadixError::UnknownNode(id)),
        }
    }

    /// Start position of a node (sum of its ancestors' key lengths): O(depth).
    pub(crate) fn start_of(&self, ix: Ix) -> usize {
        let mut start = 0;
        let mut x = self.nodes[ix as usize].parent;
        while x != NIL {
            start += self.nodes[x as usize].len();
            x = self.nodes[x as usize].parent;
        }
        start
    }

    pub(crate) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    // ----- accounting and LRU membership -------------------------------------------------

    pub(crate) fn contribution(&self, ix: Ix) -> Contribution {
        let n = &self.nodes[ix as usize];
        if ix == ROOT || !n.alive {
            return [0; 6];
        }
        let len = n.len();
        let mut c = [0; 6];
        // A leaf pinned by an in-flight state cannot be evicted before it is published.
        if n.full_lock == 0 && !n.mamba_in_flight {
            c[0] = len;
        } else {
            c[1] = len;
        }
        if self.swa_enabled() && n.swa_live {
            if n.swa_lock == 0 {
                c[2] = len;
            } else {
                c[3] = len;
            }
        }
        if n.mamba.is_some() {
            if n.mamba_lock == 0 && !n.mamba_in_flight {
                c[4] = 1;
            } else {
                c[5] = 1;
            }
        }
        c
    }

    /// Membership rules of the three LRU sets: `(full, swa, mamba)`.
    pub(crate) fn should_be_in(&self, ix: Ix) -> (bool, bool, bool) {
        let n = &self.nodes[ix as usize];
        if ix == ROOT || !n.alive {
            return (false, false, false);
        }
        (
            n.children.is_empty() && n.full_lock == 0 && !n.mamba_in_flight,
            self.swa_enabled() && n.swa_live && n.swa_lock == 0,
            n.mamba.is_some() && n.mamba_lock == 0 && !n.mamba_in_flight,
        )
    }

    /// Takes the node out of the counters and LRU sets.
    pub(crate) fn leave(&mut self, ix: Ix) {
        let c = self.contribution(ix);
        let s = &mut self.sizes;
        s.full_evictable.0 -= c[0];
        s.full_protected.0 -= c[1];
        s.swa_evictable.0 -= c[2];
        s.swa_protected.0 -= c[3];
        s.mamba_evictable.0 -= c[4];
        s.mamba_protected.0 -= c[5];
        let n = &mut self.nodes[ix as usize];
        if n.in_full {
            self.full_lru.remove(&(n.full_tick, ix));
            n.in_full = false;
        }
        if n.in_swa {
            self.swa_lru.remove(&(n.swa_key(), ix));
            n.in_swa = false;
        }
        if n.in_mamba {
            self.mamba_lru.remove(&(n.mamba_key(), ix));
            n.in_mamba = false;
        }
    }

    /// Puts the node's recomputed contribution back into the counters and LRU sets.
    pub(crate) fn enter(&mut self, ix: Ix) {
        let c = self.contribution(ix);
        let s = &mut self.sizes;
        s.full_evictable.0 += c[0];
        s.full_protected.0 += c[1];
        s.swa_evictable.0 += c[2];
        s.swa_protected.0 += c[3];
        s.mamba_evictable.0 += c[4];
        s.mamba_protected.0 += c[5];
        let (f, w, m) = self.should_be_in(ix);
        let n = &mut self.nodes[ix as usize];
        if f {
            self.full_lru.insert((n.full_tick, ix));
            n.in_full = true;
        }
        if w {
            self.swa_lru.insert((n.swa_key(), ix));
            n.in_swa = true;
        }
        if m {
            self.mamba_lru.insert((n.mamba_key(), ix));
            n.in_mamba = true;
        }
    }

    /// Whether `ix` or a node below it within `W` tokens of its end holds a state that
    /// serves reuse ([`Node::holds_valued_state`]): the window behind that state, the
    /// `W` tokens before it, reaches into `ix`. A match on a model with recurrent layers
    /// ends only at a state, so live SWA outside every such window serves no match.
    /// Always `false` in a tree without both SWA and recurrent state.
    pub(crate) fn serves_a_window(&self, ix: Ix) -> bool {
        if !(self.config.mamba && self.swa_enabled()) {
            return false;
        }
        let window = self.window();
        if self.nodes[ix as usize].holds_valued_state() {
            return true;
        }
        // Nodes to look below, with how far their ends lie below the end of `ix` (empty,
        // it does not allocate: most nodes have no child within the window).
        let mut stack = Vec::new();
        let (mut x, mut distance) = (ix, 0);
        loop {
            for &c in self.nodes[x as usize].children.values() {
                let end = distance + self.nodes[c as usize].len();
                if end >= window {
                    continue; // a state there or below looks back no further than `c`
                }
                if self.nodes[c as usize].holds_valued_state() {
                    return true;
                }
                stack.push((c, end));
            }
            match stack.pop() {
                Some(next) => (x, distance) = next,
                None => return false,
            }
        }
    }

    /// Recomputes [`Node::swa_window`] where a state that serves reuse came or went at a
    /// position `distance` tokens below the end of `x`: for `x` and the nodes above it
    /// whose ends lie within `W` tokens of that position.
    pub(crate) fn remark_windows(&mut self, mut x: Ix, mut distance: usize) {
        let window = self.window();
        while x != ROOT && distance < window {
            let marked = self.serves_a_window(x);
            if self.nodes[x as usize].swa_window != marked {
                self.with_node(x, |n| n.swa_window = marked);
            }
            distance += self.nodes[x as usize].len();
            x = self.nodes[x as usize].parent;
        }
    }

    /// Mutates a node with its accounting and LRU membership kept exact (and the window
    /// marks of it and the nodes above it, when its state began or stopped serving reuse).
    pub(crate) fn with_node<R>(&mut self, ix: Ix, f: impl FnOnce(&mut Node) -> R) -> R {
        let valued = self.nodes[ix as usize].holds_valued_state();
        self.leave(ix);
        let r = f(&mut self.nodes[ix as usize]);
        self.enter(ix);
        if self.nodes[ix as usize].holds_valued_state() != valued {
            self.remark_windows(ix, 0);
        }
        r
    }

    // ----- structure ---------------------------------------------------------------------

    /// Allocates a node in the arena and links it under `parent`.
    pub(crate) fn add_child(&mut self, parent: Ix, mut node: Node) -> Ix {
        let ps = self.ps();
        node.alive = true;
        node.parent = parent;
        let ix = match self.free.pop() {
            Some(ix) => {
                node.generation = self.nodes[ix as usize].generation;
                self.nodes[ix as usize] = node;
                ix
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as Ix
            }
        };
        let page: Box<[TokenId]> = self.nodes[ix as usize].key[..ps].into();
        self.with_node(parent, |p| p.children.insert(page, ix));
        self.enter(ix);
        ix
    }

    /// Unlinks a childless node from its parent and frees its arena entry.
    pub(crate) fn remove_leaf(&mut self, ix: Ix) -> Node {
        let ps = self.ps();
        self.leave(ix);
        let slot = &mut self.nodes[ix as usize];
        let generation = slot.generation.wrapping_add(1);
        let old = std::mem::take(slot);
        slot.generation = generation;
        self.free.push(ix);
        self.with_node(old.parent, |p| p.children.remove(&old.key[..ps]));
        if old.holds_valued_state() {
            self.remark_windows(old.parent, old.len());
        }
        old
    }

    /// Splits `ix` at `at` tokens (page-aligned, `0 < at < len`): a new parent takes the
    /// first `at` tokens with the node's SWA state, lock counts and ticks; `ix` keeps the
    /// rest, its children and its Mamba state. Returns the new parent.
    pub(crate) fn split(&mut self, ix: Ix, at: usize) -> Ix {
        let ps = self.ps();
        debug_assert!(at > 0 && at < self.nodes[ix as usize].len() && at.is_multiple_of(ps));
        let (upper_key, upper_value) = self.with_node(ix, |n| {
            let lower_key = n.key.split_off(at);
            // Two new slices: runs already handed out keep the old one.
            let lower_value: Arc<[VirtualToken]> = n.value[at..].into();
            let upper_value: Arc<[VirtualToken]> = n.value[..at].into();
            n.value = lower_value;
            (std::mem::replace(&mut n.key, lower_key), upper_value)
        });
        let n = &self.nodes[ix as usize];
        let grand = n.parent;
        let mut children = Children::default();
        children.insert(n.key[..ps].into(), ix);
        let upper = Node {
            key: upper_key,
            value: upper_value,
            children,
            swa_live: n.swa_live,
            full_lock: n.full_lock,
            swa_lock: n.swa_lock,
            full_tick: n.full_tick,
            swa_tick: n.swa_tick,
            mamba_tick: n.mamba_tick,
            ..Node::default()
        };
        // Link the new parent in place of `ix` under the grandparent (same first page).
        let p = match self.free.pop() {
            Some(p) => {
                let generation = self.nodes[p as usize].generation;
                self.nodes[p as usize] = Node {
                    generation,
                    ..upper
                };
                p
            }
            None => {
                self.nodes.push(upper);
                (self.nodes.len() - 1) as Ix
            }
        };
        {
            let node = &mut self.nodes[p as usize];
            node.alive = true;
            node.parent = grand;
        }
        let page: Box<[TokenId]> = self.nodes[p as usize].key[..ps].into();
        self.nodes[grand as usize].children.insert(page, p);
        self.nodes[ix as usize].parent = p;
        // The states below it are the lower part's (`ix` keeps its end and its mark).
        self.nodes[p as usize].swa_window = self.serves_a_window(p);
        self.enter(p);
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Action, Component, InsertRequest, StateCheckpoint};

    fn key(n: u32) -> Vec<TokenId> {
        (0..n).map(TokenId).collect()
    }

    fn row(n: u32) -> Vec<VirtualToken> {
        (100..100 + n).map(VirtualToken).collect()
    }

    /// An SWA key follows the states below its node, not only the node's own: at window
    /// 10 and page size 2, a prompt of 16 tokens with grid states at 8 and 12 and its
    /// anchor at 16 has nodes [0, 6) (outside the anchor's window), [6, 8), [8, 12) and
    /// [12, 16) (inside it: valued). Evicting the anchor, or removing the leaf that holds
    /// it, sends every node above it within the window ahead of an older prompt's valued
    /// windows, though none of them is touched. `sanity_check` recomputes every key.
    #[test]
    fn an_swa_key_follows_the_states_below_it() {
        let mut tree = RadixTree::new(TreeConfig::swa(2, 10).with_mamba()).unwrap();
        let mut insert = |first: u32, base: u32| -> [Ix; 4] {
            let key: Vec<TokenId> = (0..16)
                .map(|t| TokenId(if t < 2 { first } else { t }))
                .collect();
            let row: Vec<VirtualToken> = (base..base + 16).map(VirtualToken).collect();
            let state = |at: usize, slot: u32, role| StateCheckpoint {
                at: Tokens(at),
                slot: MambaSlot(slot),
                in_flight: false,
                role,
            };
            let states = [
                state(8, base, StateRole::Grid),
                state(12, base + 1, StateRole::Grid),
                state(16, base + 2, StateRole::Anchor),
            ];
            let out = tree
                .insert(InsertRequest::new(&key, &row).checkpoints(&states))
                .unwrap();
            let mut path = [out.node.index; 4];
            for i in (0..3).rev() {
                path[i] = tree.nodes[path[i + 1] as usize].parent;
            }
            path
        };
        let b = insert(1_000, 100);
        let a = insert(2_000, 200);
        // `b` older than `a`, on both sides.
        for (path, base) in [(b, 1), (a, 10)] {
            for (i, &ix) in path.iter().enumerate() {
                tree.with_node(ix, |n| {
                    n.swa_tick = base + i as u64;
                    n.full_tick = base + i as u64;
                });
            }
        }
        let order =
            |tree: &RadixTree| -> Vec<Ix> { tree.swa_lru.iter().map(|&(_, ix)| ix).collect() };
        assert_eq!(
            order(&tree),
            [b[0], a[0], b[1], b[2], b[3], a[1], a[2], a[3]]
        );

        let mut actions = Vec::new();
        tree.evict_mamba(a[3], &mut actions);
        tree.sanity_check().unwrap();
        assert_eq!(
            order(&tree),
            [b[0], a[0], a[1], a[2], a[3], b[1], b[2], b[3]],
            "`a`'s anchor gone: its whole window before `b`'s"
        );

        match tree.evict_one(Component::Full).as_deref() {
            Some(
                [
                    Action::EvictNode { node, .. },
                    Action::EvictMambaState { .. },
                ],
            ) => {
                assert_eq!(node.index, b[3]);
            }
            other => panic!("{other:?}"),
        }
        tree.sanity_check().unwrap();
        assert_eq!(
            order(&tree),
            [b[0], b[1], b[2], a[0], a[1], a[2], a[3]],
            "`b`'s leaf and anchor gone: no window valued, the oldest first"
        );
    }

    /// A split keeps the sizes, moves the upper part to a new parent that inherits the
    /// SWA state and lock counts, and leaves the Mamba state on the lower part.
    #[test]
    fn a_split_keeps_sizes_locks_and_the_mamba_state_below() {
        let mut tree = RadixTree::new(TreeConfig::swa(2, 8).with_mamba()).unwrap();
        let out = tree
            .insert(InsertRequest::new(&key(8), &row(8)).mamba(MambaSlot(5)))
            .unwrap();
        let ix = out.node.index;
        let lock = tree.lock(out.node).unwrap();
        let before = tree.sizes();
        let upper = tree.split(ix, 4);
        assert_eq!(tree.sizes(), before);
        let (u, l) = (&tree.nodes[upper as usize], &tree.nodes[ix as usize]);
        assert_eq!((u.key.len(), l.key.len()), (4, 4));
        assert_eq!((u.full_lock, u.swa_lock, u.mamba_lock), (1, 1, 0));
        assert_eq!((l.full_lock, l.swa_lock, l.mamba_lock), (1, 1, 1));
        assert_eq!((u.mamba, l.mamba), (None, Some(MambaSlot(5))));
        assert_eq!(l.parent, upper);
        assert_eq!(tree.prefix_values(out.node).unwrap().to_vec(), row(8));
        tree.sanity_check().unwrap();
        tree.unlock(lock).unwrap();
        assert_eq!(tree.sizes().full_protected, Tokens(0));
        tree.sanity_check().unwrap();
    }

    /// A removed node's id goes stale even when its arena entry is reused.
    #[test]
    fn an_evicted_node_id_is_stale_after_reuse() {
        let mut tree = RadixTree::new(TreeConfig::swa(1, 4)).unwrap();
        let out = tree.insert(InsertRequest::new(&key(3), &row(3))).unwrap();
        while tree.evict_one(crate::Component::Full).is_some() {}
        let again = tree.insert(InsertRequest::new(&key(3), &row(3))).unwrap();
        assert_eq!(again.node.index(), out.node.index());
        assert_ne!(again.node, out.node);
        assert!(tree.node(out.node).is_err());
        assert!(tree.node(again.node).is_ok());
    }

    /// Child keys hash whole pages (two tokens per word) and find pages that differ only
    /// in their last token apart.
    #[test]
    fn children_are_found_by_whole_first_pages() {
        let mut tree = RadixTree::new(TreeConfig::swa(3, 3)).unwrap();
        for last in 0..50 {
            let k = [TokenId(7), TokenId(7), TokenId(last)];
            tree.insert(InsertRequest::new(&k, &row(3))).unwrap();
        }
        assert_eq!(tree.nodes[ROOT as usize].children.len(), 50);
        let hit = tree.match_prefix(&[TokenId(7), TokenId(7), TokenId(31), TokenId(1)]);
        assert_eq!(hit.len, Tokens(3));
        tree.sanity_check().unwrap();
    }

    /// A split's new parent carries the node's LRU ticks (so it keeps its place in every
    /// eviction order), and, in a reused arena slot, that slot's generation (so an id of
    /// the slot's previous node stays stale).
    #[test]
    fn a_split_keeps_the_lru_ticks_and_a_reused_slots_generation() {
        let mut tree = RadixTree::new(TreeConfig::swa(2, 8).with_mamba()).unwrap();
        let out = tree
            .insert(InsertRequest::new(&key(8), &row(8)).mamba(MambaSlot(5)))
            .unwrap();
        let lock = tree.lock(out.node).unwrap();
        let gone = tree
            .insert(InsertRequest::new(&[TokenId(90), TokenId(91)], &row(2)))
            .unwrap();
        assert!(tree.evict_one(crate::Component::Full).is_some());
        assert!(tree.node(gone.node).is_err());
        let ix = out.node.index;
        let n = &tree.nodes[ix as usize];
        let ticks = (n.full_tick, n.swa_tick, n.mamba_tick);
        assert!(ticks.0 > 0 && ticks.1 > 0 && ticks.2 > 0, "{ticks:?}");
        let upper = tree.split(ix, 4);
        assert_eq!(upper, gone.node.index, "the freed slot is reused");
        let u = &tree.nodes[upper as usize];
        assert_eq!((u.full_tick, u.swa_tick, u.mamba_tick), ticks);
        assert!(tree.node(gone.node).is_err(), "the old id stays stale");
        tree.sanity_check().unwrap();
        tree.unlock(lock).unwrap();
    }

    /// `index()` is the node's arena position, and the lock count counts handles.
    #[test]
    fn node_ids_name_their_arena_slot_and_locks_are_counted() {
        let mut tree = RadixTree::new(TreeConfig::swa(1, 4)).unwrap();
        let a = tree.insert(InsertRequest::new(&key(3), &row(3))).unwrap();
        let k: Vec<TokenId> = (50..53).map(TokenId).collect();
        let b = tree.insert(InsertRequest::new(&k, &row(3))).unwrap();
        for view in tree.nodes() {
            assert_eq!(tree.nodes[view.id.index() as usize].key[..], view.key[..]);
        }
        assert_ne!(a.node.index(), b.node.index());
        let locks = [tree.lock(a.node).unwrap(), tree.lock(b.node).unwrap()];
        assert_eq!(tree.lock_count(), 2);
        // The SWA of a locked node released while FULL stays locked: a sane tree.
        tree.release_window(locks[0]).unwrap();
        tree.sanity_check().unwrap();
        tree.unlock(locks[0]).unwrap();
        assert_eq!(tree.lock_count(), 1);
        tree.unlock(locks[1]).unwrap();
        tree.sanity_check().unwrap();
    }

    /// A tree handed another scope records its breaches there.
    #[test]
    fn breaches_go_to_the_scope_the_tree_was_handed() {
        let mut tree = RadixTree::new(TreeConfig::swa(1, 4)).unwrap();
        tree.insert(InsertRequest::new(&key(3), &row(3))).unwrap();
        let scope = Scope::new();
        tree.set_invariant_scope(scope.clone());
        tree.sizes.full_evictable.0 += 1;
        unikv_invariants::scoped_level(unikv_invariants::Level::Warn, || {
            assert!(tree.sanity_check().is_err());
        });
        assert_eq!(scope.violations(&crate::invariants::SANITY), 1);
        assert_eq!(
            tree.invariant_scope()
                .violations(&crate::invariants::SANITY),
            1
        );
    }

    /// FULL hits stop at the first partly matched node: a deeper child whose first page
    /// happens to follow the match is not counted.
    #[test]
    fn a_full_hit_ends_inside_a_partly_matched_node() {
        let mut tree = RadixTree::new(TreeConfig::swa(1, 4)).unwrap();
        tree.insert(InsertRequest::new(&key(4), &row(4))).unwrap();
        let longer = [key(4), vec![TokenId(9), TokenId(9)]].concat();
        tree.insert(InsertRequest::new(&longer, &row(6))).unwrap();
        let probe = [TokenId(0), TokenId(1), TokenId(9), TokenId(9)];
        assert_eq!(tree.full_hit_len(&probe), Tokens(2));
        assert_eq!(tree.full_hit_len(&longer), Tokens(6));
    }

    /// The page hasher mixes every kind of write, one word or several, into distinct
    /// hashes (children are found by it in O(1)).
    #[test]
    fn the_page_hasher_mixes_every_write() {
        let hash = |f: &dyn Fn(&mut PageHasher)| {
            let mut h = PageHasher::default();
            f(&mut h);
            h.finish()
        };
        let mut seen = std::collections::HashSet::new();
        assert!(seen.insert(hash(&|_| {})));
        for i in 0..256u64 {
            for h in [
                hash(&|h| h.write_u64(i + 1)),
                hash(&|h| h.write_u32(i as u32 + 1_000)),
                hash(&|h| h.write_usize(i as usize + 2_000)),
                hash(&|h| h.write(&[(i % 251) as u8 + 1, (i / 251) as u8 + 7])),
            ] {
                assert!(seen.insert(h), "a collision at {i}");
            }
            for j in 0..16u64 {
                assert!(seen.insert(hash(&|h| {
                    h.write_u64(i + 3_000);
                    h.write_u64(j + 1);
                })));
            }
        }
    }

    /// A state's node locked once for itself and once under a locked descendant holds
    /// more FULL locks than Mamba locks: a sane tree.
    #[test]
    fn a_state_node_under_a_locked_descendant_is_sane() {
        let mut tree = RadixTree::new(TreeConfig::full_only(2).with_mamba()).unwrap();
        let a = tree
            .insert(InsertRequest::new(&key(4), &row(4)).mamba(MambaSlot(1)))
            .unwrap();
        let b = tree.insert(InsertRequest::new(&key(8), &row(8))).unwrap();
        let locks = [tree.lock(a.node).unwrap(), tree.lock(b.node).unwrap()];
        let n = &tree.nodes[a.node.index as usize];
        assert_eq!((n.full_lock, n.mamba_lock), (2, 1));
        tree.sanity_check().unwrap();
        for lock in locks {
            tree.unlock(lock).unwrap();
        }
    }

    /// Tombstoning a node whose state is locked (its window released, FULL and state
    /// still held) keeps the state.
    #[test]
    fn a_tombstone_keeps_a_locked_state() {
        let mut tree = RadixTree::new(TreeConfig::swa(2, 4).with_mamba()).unwrap();
        let a = tree
            .insert(InsertRequest::new(&key(8), &row(8)).mamba(MambaSlot(1)))
            .unwrap();
        let lock = tree.lock(a.node).unwrap();
        tree.release_window(lock).unwrap();
        tree.insert(InsertRequest::new(&key(24), &row(24))).unwrap();
        let ix = a.node.index as usize;
        while tree.nodes[ix].swa_live {
            assert!(
                tree.evict_one(crate::Component::Swa).is_some(),
                "{}",
                tree.dump()
            );
        }
        assert_eq!(tree.nodes[ix].mamba, Some(MambaSlot(1)), "{}", tree.dump());
        tree.sanity_check().unwrap();
        tree.unlock(lock).unwrap();
    }

    /// Over the path cap, only the excess states go, least recently used first.
    #[test]
    fn the_path_cap_evicts_only_the_excess_states() {
        let cap = std::num::NonZeroUsize::new(1).unwrap();
        let mut tree = RadixTree::new(
            TreeConfig::full_only(1)
                .with_mamba()
                .with_mamba_path_cap(cap),
        )
        .unwrap();
        let a = tree
            .insert(InsertRequest::new(&key(4), &row(4)).mamba(MambaSlot(1)))
            .unwrap();
        let b = tree
            .insert(InsertRequest::new(&key(8), &row(8)).mamba(MambaSlot(2)))
            .unwrap();
        assert_eq!(tree.nodes[a.node.index as usize].mamba, None);
        assert_eq!(tree.nodes[b.node.index as usize].mamba, Some(MambaSlot(2)));
        tree.sanity_check().unwrap();
    }

    /// States attached from the deepest node up (each on a node a split made, whose own
    /// path holds only itself) leave one path of five over a cap of two; the next attach
    /// below them evicts every excess state, not just one per attach.
    #[test]
    fn an_attach_below_a_path_over_the_cap_evicts_every_excess_state() {
        let cap = std::num::NonZeroUsize::new(2).unwrap();
        let mut tree = RadixTree::new(
            TreeConfig::full_only(1)
                .with_mamba()
                .with_mamba_path_cap(cap),
        )
        .unwrap();
        for (slot, n) in [5, 4, 3, 2, 1].into_iter().enumerate() {
            let out = tree
                .insert(InsertRequest::new(&key(n), &row(n)).mamba(MambaSlot(slot as u32 + 1)))
                .unwrap();
            assert!(
                !out.actions
                    .iter()
                    .any(|a| matches!(a, crate::Action::EvictMambaState { .. })),
                "{:?}",
                out.actions
            );
        }
        assert_eq!(tree.held().2.get(), 5, "{}", tree.dump());
        let out = tree
            .insert(InsertRequest::new(&key(6), &row(6)).mamba(MambaSlot(6)))
            .unwrap();
        let evicted = out
            .actions
            .iter()
            .filter(|a| matches!(a, crate::Action::EvictMambaState { .. }))
            .count();
        assert_eq!(evicted, 4, "{:?}", out.actions);
        assert_eq!(tree.held().2.get(), 2, "{}", tree.dump());
        tree.sanity_check().unwrap();
    }

    /// An insert's claimed prefix is checked value by value up to its end only, in every
    /// node of the path.
    #[test]
    fn a_claimed_prefix_is_checked_up_to_its_end_in_every_node() {
        let mut tree = RadixTree::new(TreeConfig::full_only(1)).unwrap();
        tree.insert(InsertRequest::new(&key(8), &row(8))).unwrap();
        let fork = [key(4), vec![TokenId(99)]].concat();
        tree.insert(InsertRequest::new(&fork, &row(5))).unwrap();
        // The tree's values for the first six tokens, others after them.
        let mut value = row(6);
        value.extend([VirtualToken(500), VirtualToken(501)]);
        let out = tree.insert(InsertRequest::new(&key(8), &value).prev_prefix_len(6));
        assert!(out.is_ok(), "{out:?}");
        value[5] = VirtualToken(502);
        let out = tree.insert(InsertRequest::new(&key(8), &value).prev_prefix_len(6));
        assert!(
            matches!(out, Err(RadixError::PrefixValueMismatch { position: 5 })),
            "{out:?}"
        );
    }

    /// Releasing a lock whose counts a bug already zeroed is a recorded breach that
    /// leaves the counts at zero, never an underflow, on every part of the lock.
    #[test]
    fn a_release_below_zero_is_a_breach_not_an_underflow() {
        use crate::invariants::LOCK_UNDERFLOW;
        for part in ["full", "swa", "mamba"] {
            let mut tree = RadixTree::new(TreeConfig::swa(1, 4).with_mamba()).unwrap();
            let a = tree
                .insert(InsertRequest::new(&key(3), &row(3)).mamba(MambaSlot(1)))
                .unwrap();
            let lock = tree.lock(a.node).unwrap();
            let ix = a.node.index;
            tree.leave(ix);
            let n = &mut tree.nodes[ix as usize];
            match part {
                "full" => n.full_lock = 0,
                "swa" => n.swa_lock = 0,
                _ => n.mamba_lock = 0,
            }
            tree.enter(ix);
            unikv_invariants::scoped_level(unikv_invariants::Level::Warn, || {
                tree.unlock(lock).unwrap();
            });
            assert_eq!(
                tree.invariant_scope().violations(&LOCK_UNDERFLOW),
                1,
                "{part}"
            );
            let n = &tree.nodes[ix as usize];
            assert_eq!((n.full_lock, n.swa_lock, n.mamba_lock), (0, 0, 0), "{part}");
        }
    }

    /// An insert over a tombstoned node whose window starts inside it revives the node
    /// from the window on and leaves the part before it a tombstone.
    #[test]
    fn a_revived_tombstone_is_split_where_the_window_starts() {
        let mut tree = RadixTree::new(TreeConfig::swa(1, 4)).unwrap();
        tree.insert(InsertRequest::new(&key(8), &row(8))).unwrap();
        tree.insert(InsertRequest::new(&key(16), &row(16))).unwrap();
        // Tombstone everything before the last leaf window.
        while tree
            .nodes()
            .iter()
            .any(|n| n.start.0 < 8 && n.swa_live && !n.key.is_empty())
        {
            assert!(
                tree.evict_one(crate::Component::Swa).is_some(),
                "{}",
                tree.dump()
            );
        }
        let value: Vec<VirtualToken> = (500..516).map(VirtualToken).collect();
        tree.insert(InsertRequest::new(&key(16), &value).window_cursor(6))
            .unwrap();
        tree.sanity_check().unwrap();
        for n in tree.nodes().iter().filter(|n| !n.key.is_empty()) {
            let (lo, hi) = (n.start.0, n.start.0 + n.key.len());
            assert!(
                hi <= 6 || lo >= 6,
                "a node across the window start: {}",
                tree.dump()
            );
            if hi <= 6 {
                assert!(!n.swa_live, "{}", tree.dump());
            } else if lo < 8 {
                assert!(n.swa_live, "{}", tree.dump());
            }
        }
    }
}

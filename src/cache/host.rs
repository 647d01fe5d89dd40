//! The host tier: prefixes the device evicts are written back to a host buffer, and a
//! later prompt that matches them loads them back instead of recomputing them.
//!
//! One mechanism per job, each reused from the device side. The host tier is a second
//! [`RadixTree`] over the same keys whose values are host units instead of virtual
//! tokens (a FULL page's host unit id × page size + offset; a state's host unit id as its
//! slot), so a host match obeys the device's rules — it ends only where the SWA window
//! behind it and a state at it are on the host — and the host tree's LRU evicts host data
//! as the device tree's evicts device data, through the same [`Action`]s. [`HostPool`]
//! keeps the bytes' bookkeeping; only the SWA window's pages behind a written-back
//! position and the states at positions get host bytes
//! (`a_demoted_prefix_hits_from_the_host_and_loads_back_its_bytes`).
//!
//! Copies are device work in stream order ([`Device::copy_device_to_host`],
//! [`Device::copy_host_to_device`]), merged into one run per stretch of adjacent pages.
//! A device page or slot a write-back reads (its victim's, or an ancestor's it copied)
//! is freed once its copy's event is done, learnt by a non-blocking query; until then it
//! stays held (parked), never waited for — except an SWA tombstone's pages, freed at
//! once because the tree keeps the node and may rebuild or free its values in the same
//! step (the copy, issued first, reads them before later work on the stream writes
//! them). A load-back keeps its host path locked until its copy is done, and a request
//! released before then keeps its rows and slots parked the same way (the queued copy
//! still writes them). A match prices its load ([`crate::PrefixMatch::load_bytes`]), and
//! the step metadata lists each load until the step boundary.

use super::HybridCache;
use crate::error::Error;
use crate::request::HostMatch;
use crate::stats::HostStats;
use std::collections::HashMap;
use unikv_kernels::{CopyEvent, Device, HostBytesId, HostCopy};
use unikv_pools::{
    FreeOp, HostBlock, HostKind, HostPool, HostPoolSpec, Side, VirtualPage, VirtualSlot,
    VirtualToken as PoolToken,
};
use unikv_radix::{
    Action, Component, InsertRequest, LockHandle, MambaSlot, NodeId, RadixTree, TokenId,
    TreeConfig, VirtualToken as TreeToken,
};

/// When the host tier copies a device prefix (SGLang HiCache's three policies).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostWritePolicy {
    /// On eviction: a prefix goes to the host when the device evicts it (its frees wait
    /// for the copy).
    #[default]
    WriteBack,
    /// On caching: every prefix a request hands the tree is copied at the next step
    /// boundary (after the forward that wrote it), so an eviction finds it there and
    /// frees at once; host traffic for prefixes that are never evicted.
    WriteThrough,
    /// On reuse: a prefix is copied at the step boundary after its `hits`-th admission
    /// hit it (and written back on eviction like any other).
    WriteThroughSelective {
        /// Admissions that hit a prefix before it is copied (at least 1).
        hits: u32,
    },
}

/// A copy whose completion the cache waits for without waiting: what it releases once
/// its event is done.
#[derive(Debug)]
struct Parked {
    event: CopyEvent,
    /// The request a load-back fills (`None` for a write-back): a release of it before
    /// the copy is done parks its rows here too.
    request: Option<u64>,
    /// The device pages (virtual page ids, FULL and SWA alike; sorted) and the state slot
    /// a write-back copies from: a free of any of them waits for the copy.
    reads: Vec<u32>,
    reads_slot: Option<u32>,
    releases: Vec<Release>,
}

impl Parked {
    /// Whether the copy reads one of `pages` or `slots`.
    fn reads_any(&self, pages: &[u32], slots: &[u32]) -> bool {
        pages.iter().any(|p| self.reads.binary_search(p).is_ok())
            || self.reads_slot.is_some_and(|s| slots.contains(&s))
    }
}

#[derive(Debug)]
enum Release {
    /// A write-back's device frees (the evicted node's actions).
    Device(Vec<Action>),
    /// A load-back's lock on its host path.
    HostLock(LockHandle),
    /// A released request's rows and slots, which its load-back still writes.
    Rows(ReleasedRows),
}

/// What [`HybridCache::release`] frees of a request: its rows past the tree-owned prefix
/// (a [`FreeOp::KvRow`]'s fields) and its state slots.
#[derive(Debug)]
pub(super) struct ReleasedRows {
    pub(super) row: Vec<PoolToken>,
    pub(super) dead_lo: usize,
    pub(super) cursor: usize,
    pub(super) len: usize,
    pub(super) slots: Vec<VirtualSlot>,
    /// The FULL and SWA pages and the slots it counted as held.
    pub(super) held: [usize; 3],
}

impl ReleasedRows {
    /// Frees them (at once, or deferred to the open free group, as any row free).
    pub(super) fn free(&self, alloc: &mut dyn unikv_pools::KvAllocator) {
        let row = FreeOp::KvRow {
            row: &self.row,
            dead_lo: self.dead_lo,
            cursor: self.cursor,
            len: self.len,
        };
        if self.slots.is_empty() {
            alloc.free_batch(&[row]);
        } else {
            alloc.free_batch(&[row, FreeOp::Slots(&self.slots)]);
        }
    }
}

/// A host unit: its id (a host tree value) and its block in the pool.
pub(crate) type Unit = (u32, HostBlock);

/// One page of a load-back: its row position, its FULL unit, and its SWA unit when the
/// host holds the page's SWA.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PlannedPage {
    pub(crate) at: usize,
    pub(crate) full: Unit,
    pub(crate) swa: Option<Unit>,
}

/// What a load-back moves (see [`HostTier::load_plan`]): its pages in row order and the
/// state copied into the running slot.
#[derive(Debug)]
pub(crate) struct LoadPlan {
    pub(crate) pages: Vec<PlannedPage>,
    pub(crate) state: Option<Unit>,
}

impl LoadPlan {
    /// The bytes it copies.
    fn bytes(&self, pool: &HostPool) -> u64 {
        let swa = self.pages.iter().filter(|p| p.swa.is_some()).count() as u64;
        self.pages.len() as u64 * pool.unit_bytes(HostKind::Full)
            + swa * pool.unit_bytes(HostKind::Swa)
            + u64::from(self.state.is_some()) * pool.unit_bytes(HostKind::State)
    }
}

/// A request's load-back in the current step, kept for the step metadata until the
/// step boundary.
#[derive(Debug)]
pub(crate) struct StepLoad {
    /// The request it loaded into.
    pub(crate) request: u64,
    /// What it copied.
    pub(crate) plan: LoadPlan,
}

/// The host tier of a cache: its pool, its tree and its copies in flight.
#[derive(Debug)]
pub(super) struct HostTier {
    pool: HostPool,
    tree: RadixTree,
    buffer: HostBytesId,
    /// The host SWA unit of each host FULL unit whose page's SWA is on the host.
    swa: HashMap<u32, u32>,
    parked: Vec<Parked>,
    policy: HostWritePolicy,
    /// Device nodes to copy at the next step boundary (write-through).
    through: Vec<NodeId>,
    /// Admissions that hit each device node so far (write-through-selective).
    hits: HashMap<NodeId, u32>,
    /// The load-backs issued since the last step boundary (the step metadata lists them).
    pub(super) loads: Vec<StepLoad>,
    /// Device pages and slots a write-back still holds (parked), per side.
    pub(super) parked_full: usize,
    pub(super) parked_swa: usize,
    pub(super) parked_slots: usize,
    stats: HostStats,
}

impl HostTier {
    /// A host tier of `bytes` for pages and states of the device grids `full`, `swa`
    /// and `state` (envelope bytes, 0 for an absent side), with a tree like the
    /// device's (`config`, without its path cap).
    pub(super) fn new(
        device: &dyn Device,
        bytes: u64,
        units: [u64; 3],
        config: TreeConfig,
        scope: unikv_invariants::Scope,
        policy: HostWritePolicy,
    ) -> Result<HostTier, Error> {
        if policy == (HostWritePolicy::WriteThroughSelective { hits: 0 }) {
            return Err(Error::Config(
                "a selective write-through needs at least 1 hit".into(),
            ));
        }
        let pool = HostPool::new(HostPoolSpec {
            total_bytes: bytes,
            full_page_bytes: units[0],
            swa_page_bytes: units[1],
            state_bytes: units[2],
        })
        .map_err(|e| Error::Config(format!("host memory: {e}")))?;
        let ps = config.page_size as u64;
        let ids = u64::from(pool.frame_count()) * u64::from(pool.units_per_frame(HostKind::Full));
        if ids.saturating_mul(ps) > u64::from(u32::MAX) {
            return Err(Error::Config(format!(
                "host memory of {bytes} bytes holds {ids} FULL pages of {ps} tokens: more \
                 token ids than 32 bits hold"
            )));
        }
        let mut tree = RadixTree::new(config)?;
        tree.set_invariant_scope(scope);
        let buffer = device.alloc_host(pool.frame_count() as u64 * pool.frame_bytes())?;
        Ok(HostTier {
            pool,
            tree,
            buffer,
            swa: HashMap::new(),
            parked: Vec::new(),
            policy,
            through: Vec::new(),
            hits: HashMap::new(),
            loads: Vec::new(),
            parked_full: 0,
            parked_swa: 0,
            parked_slots: 0,
            stats: HostStats {
                total_bytes: bytes,
                ..HostStats::default()
            },
        })
    }

    /// Its tree.
    pub(super) fn tree(&self) -> &RadixTree {
        &self.tree
    }

    fn ps(&self) -> usize {
        self.tree.config().page_size as usize
    }

    /// The host tree's match of `key` when it reaches past `device` tokens.
    pub(super) fn match_beyond(&mut self, key: &[TokenId], device: usize) -> Option<HostMatch> {
        let m = self.tree.match_prefix(key);
        if m.len.0 <= device {
            return None;
        }
        let state = self.tree.node(m.node).ok()?.mamba.map(|s| s.0);
        let mut hm = HostMatch {
            node: m.node,
            len: m.len.0,
            full_hit: m.full_hit.0,
            values: m.values.to_vec(),
            state,
            load_bytes: 0,
        };
        // A plan that misses a unit loads nothing: its bytes are 0, admission refuses it.
        hm.load_bytes = self
            .load_plan(&hm, device)
            .map_or(0, |plan| plan.bytes(&self.pool));
        Some(hm)
    }

    /// What loading the host part `[from, hm.len)` of a match moves: every FULL page,
    /// the SWA pages the host holds, the state at the end. `None` when the pool lacks a
    /// unit the host tree names (a conservation breach the step boundary reports).
    fn load_plan(&self, hm: &HostMatch, from: usize) -> Option<LoadPlan> {
        let ps = self.ps();
        let mut pages = Vec::with_capacity((hm.len - from) / ps);
        for at in (from..hm.len).step_by(ps) {
            let unit = hm.values[at].0 / ps as u32;
            let full = self.pool.block_of(HostKind::Full, unit)?;
            let swa = match self.swa.get(&unit) {
                Some(&s) => Some((s, self.pool.block_of(HostKind::Swa, s)?)),
                None => None,
            };
            pages.push(PlannedPage {
                at,
                full: (unit, full),
                swa,
            });
        }
        // Only the trailing stretch of pages whose SWA the host holds is a window a
        // position can use; SWA bytes before a gap are not loaded.
        let trailing = pages.iter().rev().take_while(|p| p.swa.is_some()).count();
        let gap = pages.len() - trailing;
        for p in &mut pages[..gap] {
            p.swa = None;
        }
        let state = match hm.state {
            Some(unit) => Some((unit, self.pool.block_of(HostKind::State, unit)?)),
            None => None,
        };
        Some(LoadPlan { pages, state })
    }

    /// Frees the host units the host tree's `actions` release. A unit the pool does not
    /// hold is a conservation breach the step boundary reports; nothing else is freed
    /// twice.
    fn apply(&mut self, actions: &[Action]) {
        let ps = self.ps();
        let (mut full, mut swa, mut states) = (Vec::new(), Vec::new(), Vec::new());
        // Each page of `tokens`: its SWA unit when the host holds one, and its FULL unit
        // into `full` when given.
        let pages = |map: &mut HashMap<u32, u32>,
                     tokens: &[TreeToken],
                     full: Option<&mut Vec<u32>>,
                     swa: &mut Vec<u32>| {
            let units = tokens.iter().step_by(ps).map(|t| t.0 / ps as u32);
            let mut full = full;
            for unit in units {
                if let Some(full) = full.as_deref_mut() {
                    full.push(unit);
                }
                swa.extend(map.remove(&unit));
            }
        };
        for action in actions {
            match action {
                Action::FreeDeviceKv { tokens }
                | Action::FreeDeviceKvFullOnly { tokens }
                | Action::EvictNode { tokens, .. } => {
                    pages(&mut self.swa, tokens, Some(&mut full), &mut swa)
                }
                Action::SwaRebuild { .. } => {}
                Action::RecoverSwaWithLockedFull { kept, incoming, .. } => {
                    for (k, i) in kept.iter().zip(incoming).step_by(ps) {
                        let (k, i) = (k.0 / ps as u32, i.0 / ps as u32);
                        if let Some(s) = self.swa.remove(&i) {
                            self.swa.insert(k, s);
                        }
                        full.push(i);
                    }
                }
                Action::TombstoneSwa { tokens, .. } => pages(&mut self.swa, tokens, None, &mut swa),
                Action::EvictMambaState { slot, .. } | Action::FreeMambaSlot { slot } => {
                    states.push(slot.0)
                }
            }
        }
        for (kind, ids) in [
            (HostKind::Full, full),
            (HostKind::Swa, swa),
            (HostKind::State, states),
        ] {
            let blocks: Vec<HostBlock> = ids
                .iter()
                .filter_map(|&id| self.pool.block_of(kind, id))
                .collect();
            // A refusal leaves the pool as it was: conservation against the tree then
            // names the breach at the step boundary.
            let _ = self.pool.free(kind, &blocks);
        }
    }

    /// `need` units of each kind ([`HostKind::ALL`] order), evicting the host tree's
    /// least recently used prefixes (never the path under `keep`, which is locked
    /// meanwhile) until they fit. `None` when they cannot.
    fn take(&mut self, need: [usize; 3], keep: Option<NodeId>) -> Option<[Vec<HostBlock>; 3]> {
        let lock = keep.and_then(|n| self.tree.lock(n).ok());
        let fits = |pool: &HostPool| pool.fits(need.map(|n| n as u64));
        while !fits(&self.pool) {
            let Some(actions) = self.tree.evict_one(Component::Full) else {
                break;
            };
            self.apply(&actions);
        }
        if let Some(lock) = lock {
            let _ = self.tree.unlock(lock);
        }
        if !fits(&self.pool) {
            return None;
        }
        let mut out: [Vec<HostBlock>; 3] = Default::default();
        for (i, &kind) in HostKind::ALL.iter().enumerate() {
            if need[i] > 0 && self.pool.alloc(kind, need[i], &mut out[i]).is_err() {
                // `fits` held, so this is a bookkeeping bug: give back what was taken.
                for (kind, blocks) in HostKind::ALL.iter().zip(&out) {
                    let _ = self.pool.free(*kind, blocks);
                }
                return None;
            }
        }
        Some(out)
    }

    fn count_copies(&mut self, copies: &[HostCopy]) {
        self.stats.copies += copies.len() as u64;
        for c in copies {
            self.stats.largest_copy = self.stats.largest_copy.max(c.len);
        }
    }

    /// The tier's figures now.
    pub(super) fn stats(&self) -> HostStats {
        HostStats {
            full_bytes: self.pool.held_bytes(HostKind::Full),
            swa_bytes: self.pool.held_bytes(HostKind::Swa),
            state_bytes: self.pool.held_bytes(HostKind::State),
            ..self.stats
        }
    }

    fn note_peak(&mut self) {
        let held: u64 = HostKind::ALL.iter().map(|&k| self.pool.held_bytes(k)).sum();
        self.stats.peak_bytes = self.stats.peak_bytes.max(held);
    }

    /// Conservation of the host tier: every unit the pool holds is one the host tree
    /// names (FULL pages and states in the tree, SWA pages of its live nodes), from the
    /// counters (O(1)); with `deep`, also the pool's own frame walk and the tree's sanity
    /// check (O(frames + nodes)).
    pub(super) fn conservation(&self, deep: bool) -> Result<(), String> {
        if deep {
            self.pool.conservation()?;
        }
        let ps = self.ps() as u64;
        let sizes = self.tree.sizes();
        let tree_full = (sizes.full_evictable.0 + sizes.full_protected.0) as u64;
        let tree_swa = (sizes.swa_evictable.0 + sizes.swa_protected.0) as u64 / ps;
        let tree_states = (sizes.mamba_evictable.0 + sizes.mamba_protected.0) as u64;
        let pool = [
            self.pool.held(HostKind::Full) * ps,
            self.pool.held(HostKind::Swa),
            self.pool.held(HostKind::State),
        ];
        let tree = [tree_full, tree_swa, tree_states];
        if pool != tree || self.swa.len() as u64 != tree_swa {
            return Err(format!(
                "host tier: the pool holds (FULL tokens, SWA pages, states) {pool:?}, the host \
                 tree names {tree:?}, {} host pages map an SWA unit",
                self.swa.len()
            ));
        }
        if deep {
            self.tree
                .sanity_check()
                .map_err(|e| format!("host tree: {e}"))?;
        }
        Ok(())
    }
}

/// Merges per-page copies into runs where both sides are adjacent.
fn merged(mut copies: Vec<HostCopy>) -> Vec<HostCopy> {
    copies.sort_unstable_by_key(|c| c.host);
    let mut out: Vec<HostCopy> = Vec::with_capacity(copies.len());
    for c in copies {
        match out.last_mut() {
            Some(r) if r.host + r.len == c.host && r.device + r.len == c.device => r.len += c.len,
            _ => out.push(c),
        }
    }
    out
}

impl HybridCache {
    /// Writes the prefix ending at device node `victim` back to the host before the
    /// device evicts it: the FULL pages the host does not hold yet, the SWA pages of the
    /// window behind its end when they are live, and its state. A copy still running is
    /// parked with the device pages and slot it reads, so that their frees wait for it
    /// ([`HybridCache::park_behind_readers`]). A host that cannot make room, or a refused
    /// copy, skips the write-back: the eviction goes on as without a host tier and
    /// nothing is lost on either side.
    pub(super) fn write_back(&mut self, victim: NodeId) -> Result<(), Error> {
        let Some(host) = self.host.as_mut() else {
            return Ok(());
        };
        let ps = self.ps;
        let key = self.tree.path_key(victim)?;
        let values = self.tree.prefix_values(victim)?.to_vec();
        let view = self.tree.node(victim)?;
        // Grid states inside a prompt serve only a request that leaves the path before
        // the next state: not worth a state's host bytes.
        let state = view
            .mamba
            .filter(|_| view.mamba_role == Some(unikv_radix::StateRole::Anchor));
        let end = key.len();
        let m = host.tree.match_prefix(&key);
        let hf = m.full_hit.0;
        let host_state_at_end = hf == end && host.tree.node(m.full_hit_node)?.mamba.is_some();
        let want_state = state.is_some() && !host_state_at_end;
        let new_pages = (end - hf) / ps;
        if new_pages == 0 && !want_state {
            return Ok(());
        }
        let host_prefix = if hf > 0 {
            host.tree.prefix_values(m.full_hit_node)?.to_vec()
        } else {
            Vec::new()
        };
        // The SWA window behind the end and behind the page before it (where a prompt
        // that repeats this one stops matching: a match never covers its last token),
        // where it is new on the host and live on the device.
        let swa_from = if self.has_swa {
            let window_pages = self.window.div_ceil(ps).max(1);
            hf.max(end.saturating_sub((window_pages + 1) * ps))
        } else {
            end
        };
        // The longest live stretch ending at the end (a decode released the SWA behind
        // its window, so the page before the window may be gone already).
        let mut live_from = end;
        while live_from > swa_from
            && self
                .alloc
                .swa_state(VirtualPage(values[live_from - ps].0 / ps as u32))
                == unikv_pools::SwaState::Live
        {
            live_from -= ps;
        }
        let swa_from = live_from;
        let need = [new_pages, (end - swa_from) / ps, usize::from(want_state)];
        // From here the host tree may change (its LRU makes room, the copy inserts): a
        // match taken before names host nodes and units that may be gone.
        self.epoch += 1;
        let host = self.host.as_mut().expect("checked above");
        let keep = (hf > 0).then_some(m.full_hit_node);
        let Some(units) = host.take(need, keep) else {
            host.stats.refused_writes += 1;
            return Ok(());
        };
        let [full, swa, states] = &units;
        let mut copies = Vec::with_capacity(full.len() + swa.len() + states.len());
        let mut host_values = host_prefix;
        let mut swa_pairs = Vec::with_capacity(swa.len());
        let mut reads = Vec::with_capacity(full.len());
        // Every page the tree holds is mapped, and so is every slot: one that is not (a
        // bookkeeping breach the boundary reports) skips the write-back, never copies
        // the sink.
        let mut mapped = true;
        for (i, &b) in full.iter().enumerate() {
            let p = hf + i * ps;
            let unit = host.pool.unit_id(HostKind::Full, b);
            host_values.extend((0..ps as u32).map(|o| TreeToken(unit * ps as u32 + o)));
            let page = values[p].0 / ps as u32;
            reads.push(page);
            let mut copy = |side, kind, block| match device_page(&*self.alloc, side, page) {
                Some(device) => copies.push(HostCopy {
                    device,
                    host: host.pool.offset(kind, block),
                    len: host.pool.unit_bytes(kind),
                }),
                None => mapped = false,
            };
            copy(Side::Full, HostKind::Full, b);
            if p >= swa_from {
                let s = swa[(p - swa_from) / ps];
                copy(Side::Swa, HostKind::Swa, s);
                swa_pairs.push((unit, host.pool.unit_id(HostKind::Swa, s)));
            }
        }
        let state_unit = match (state, states.first()) {
            (Some(MambaSlot(slot)), Some(&b)) => {
                match self.alloc.physical_slot(unikv_pools::VirtualSlot(slot)) {
                    Some(phys) => copies.push(HostCopy {
                        device: self.alloc.grid(Side::Mamba).offset(phys),
                        host: host.pool.offset(HostKind::State, b),
                        len: host.pool.unit_bytes(HostKind::State),
                    }),
                    None => mapped = false,
                }
                Some(host.pool.unit_id(HostKind::State, b))
            }
            _ => None,
        };
        let copies = merged(copies);
        let issued = if mapped {
            self.device
                .copy_device_to_host(self.alloc.buffer(), host.buffer, &copies)
                .and_then(|()| self.device.record_copy_event())
                .ok()
        } else {
            None
        };
        let Some(event) = issued else {
            // Unmapped, refused (nothing issued), or issued with no event to learn its
            // end by: the host does not take it (a later write-back of the units is
            // ordered after it), and the eviction goes on as without a host tier.
            for (kind, blocks) in HostKind::ALL.iter().zip(&units) {
                let _ = host.pool.free(*kind, blocks);
            }
            host.stats.refused_writes += 1;
            return Ok(());
        };
        host.count_copies(&copies);
        host.stats.written_bytes += copies.iter().map(|c| c.len).sum::<u64>();
        let mut insert = InsertRequest::new(&key, &host_values)
            .prev_prefix_len(hf)
            .window_cursor(swa_from);
        if let Some(unit) = state_unit {
            insert = insert.mamba(MambaSlot(unit));
        }
        let outcome = match host.tree.insert(insert) {
            Ok(outcome) => outcome,
            Err(e) => {
                // The host tree refused it: its units go back (the copy into them is
                // ordered before any later one).
                for (kind, blocks) in HostKind::ALL.iter().zip(&units) {
                    let _ = host.pool.free(*kind, blocks);
                }
                return Err(e.into());
            }
        };
        host.swa.extend(swa_pairs);
        host.apply(&outcome.actions);
        // Rows the host tree did not take (it makes no leaf of tombstones only) go back.
        let kept = outcome.cached_len.0.max(hf);
        if kept < end {
            let untaken: Vec<TreeToken> = host_values[kept..end].to_vec();
            host.apply(&[Action::FreeDeviceKv { tokens: untaken }]);
        }
        host.note_peak();
        // A query that fails counts as not done: the frees wait for the next one.
        if self.device.copy_event_done(event).unwrap_or(false) {
            let _ = self.device.free_copy_event(event);
        } else {
            reads.sort_unstable();
            let reads_slot = state.filter(|_| state_unit.is_some()).map(|s| s.0);
            let host = self.host.as_mut().expect("checked above");
            host.parked.push(Parked {
                event,
                request: None,
                reads,
                reads_slot,
                releases: Vec::new(),
            });
        }
        Ok(())
    }

    /// A request handed the tree the prefix ending at device node `node`: under
    /// write-through it is copied at the next step boundary.
    pub(super) fn note_cached(&mut self, node: NodeId) {
        if let Some(host) = self.host.as_mut()
            && host.policy == HostWritePolicy::WriteThrough
        {
            host.through.push(node);
        }
    }

    /// An admission hit device node `node`: under selective write-through its
    /// `hits`-th hit queues it for the next step boundary.
    pub(super) fn note_hit(&mut self, node: NodeId) {
        if let Some(host) = self.host.as_mut()
            && let HostWritePolicy::WriteThroughSelective { hits } = host.policy
        {
            let count = host.hits.entry(node).or_insert(0);
            *count += 1;
            if *count == hits {
                host.through.push(node);
            }
        }
    }

    /// Copies the prefixes write-through queued (at a step boundary, after the forward
    /// that wrote them): what the host lacks of each, as a write-back would, with no
    /// device page to free. A node evicted since is skipped.
    pub(super) fn write_through(&mut self) -> Result<(), Error> {
        let Some(host) = self.host.as_mut() else {
            return Ok(());
        };
        let queued = std::mem::take(&mut host.through);
        for node in queued {
            if self.tree.node(node).is_err() {
                continue;
            }
            // The device pages stay cached; a later eviction's frees wait for the copy.
            self.write_back(node)?;
        }
        // Stale counts (of evicted nodes) go with the queue's turn.
        if let Some(host) = self.host.as_mut() {
            let tree = &self.tree;
            host.hits.retain(|&n, _| tree.node(n).is_ok());
        }
        Ok(())
    }

    /// Parks `actions` (device frees) behind the latest write-back still running that
    /// reads one of the pages or slots they free, counting them held until its event is
    /// done; copies complete in issue order, so the earlier readers are done by then.
    /// Returns what applies now: everything when no copy in flight reads them, and an
    /// SWA tombstone's frees always — the tree keeps the node and may rebuild or free
    /// its values in the same step, so they cannot wait; the copy, issued first, reads
    /// those pages before any later work on the stream writes them.
    pub(super) fn park_behind_readers(&mut self, actions: Vec<Action>) -> Vec<Action> {
        let Some(host) = self.host.as_mut() else {
            return actions;
        };
        if host
            .parked
            .iter()
            .all(|p| p.reads.is_empty() && p.reads_slot.is_none())
        {
            return actions;
        }
        let (pages, slots) = freed_units(&actions, self.ps);
        let Some(reader) = host
            .parked
            .iter_mut()
            .rev()
            .find(|p| p.reads_any(&pages, &slots))
        else {
            return actions;
        };
        // A query that fails counts as not done, as at the step boundary.
        if self.device.copy_event_done(reader.event).unwrap_or(false) {
            return actions;
        }
        let (now, later): (Vec<Action>, Vec<Action>) = actions
            .into_iter()
            .partition(|a| matches!(a, Action::TombstoneSwa { .. }));
        let [full, swa, slots] = parked_pages(&later, self.ps, self.has_swa);
        host.parked_full += full;
        host.parked_swa += swa;
        host.parked_slots += slots;
        reader.releases.push(Release::Device(later));
        now
    }

    /// Parks released request `request`'s frees behind its load-back while that copy is
    /// not done (it still writes the rows and the running slot, which the next step could
    /// otherwise hand out), counting them held meanwhile. Returns them when nothing is in
    /// flight, to be freed now.
    pub(super) fn park_released(
        &mut self,
        request: u64,
        rows: ReleasedRows,
    ) -> Option<ReleasedRows> {
        let Some(host) = self.host.as_mut() else {
            return Some(rows);
        };
        let Some(load) = host.parked.iter_mut().find(|p| p.request == Some(request)) else {
            return Some(rows);
        };
        // A query that fails counts as not done, as at the step boundary.
        if self.device.copy_event_done(load.event).unwrap_or(false) {
            return Some(rows);
        }
        let [full, swa, slots] = rows.held;
        host.parked_full += full;
        host.parked_swa += swa;
        host.parked_slots += slots;
        load.releases.push(Release::Rows(rows));
        None
    }

    /// The load-back of request `request` issued since the last step boundary (the step
    /// metadata lists it). Loads are pushed at admission, which numbers requests in
    /// increasing order, so the list is sorted by request: a binary search.
    pub(crate) fn step_load(&self, request: u64) -> Option<&StepLoad> {
        let loads = &self.host.as_ref()?.loads;
        let i = loads.binary_search_by_key(&request, |l| l.request).ok()?;
        Some(&loads[i])
    }

    /// The byte geometry of the host buffer (`None` without a host tier).
    pub fn host_geometry(&self) -> Option<unikv_pools::HostGeometry> {
        self.host.as_ref().map(|h| h.pool.geometry())
    }

    /// Releases what the copies that completed since the last call held: a write-back's
    /// device frees, a load-back's host lock. A query per copy, never a wait. The step's
    /// load-back list starts over.
    pub(super) fn poll_copies(&mut self) -> Result<(), Error> {
        let Some(host) = self.host.as_mut() else {
            return Ok(());
        };
        host.loads.clear();
        // A query that fails counts as not done: asked again at the next boundary. The
        // ones left keep their issue order (`park_behind_readers` picks the latest).
        let device = &self.device;
        let (done, pending): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut host.parked)
            .into_iter()
            .partition(|p| device.copy_event_done(p.event).unwrap_or(false));
        host.parked = pending;
        let mut unlocked = Ok(());
        for parked in done {
            // A handle the device fails to release costs the device a handle, nothing here.
            let _ = self.device.free_copy_event(parked.event);
            for release in parked.releases {
                let host = self.host.as_mut().expect("checked above");
                match release {
                    Release::Device(actions) => {
                        let [full, swa, slots] = parked_pages(&actions, self.ps, self.has_swa);
                        host.parked_full -= full;
                        host.parked_swa -= swa;
                        host.parked_slots -= slots;
                        self.apply(&actions);
                    }
                    // An unlock that fails still lets the other releases go.
                    Release::HostLock(lock) => unlocked = unlocked.and(host.tree.unlock(lock)),
                    Release::Rows(rows) => {
                        let [full, swa, slots] = rows.held;
                        host.parked_full -= full;
                        host.parked_swa -= swa;
                        host.parked_slots -= slots;
                        rows.free(self.alloc.as_mut());
                    }
                }
            }
        }
        unlocked.map_err(Into::into)
    }

    /// Locks the host path of a match before admission makes room (a write-back could
    /// otherwise evict it from the host): `None` without a host part.
    pub(super) fn lock_host(
        &mut self,
        hit: &crate::PrefixMatch,
    ) -> Result<Option<LockHandle>, Error> {
        match (&hit.host, self.host.as_mut()) {
            (Some(hm), Some(host)) => Ok(Some(host.tree.lock(hm.node)?)),
            _ => Ok(None),
        }
    }

    /// Gives back a lock [`HybridCache::lock_host`] took.
    pub(super) fn unlock_host(&mut self, lock: Option<LockHandle>) -> Result<(), Error> {
        if let (Some(lock), Some(host)) = (lock, self.host.as_mut()) {
            host.tree.unlock(lock)?;
        }
        Ok(())
    }

    /// Loads the host part of a match into `req`'s new rows (allocated here, after its
    /// device part) and its running state: FULL pages, the SWA pages the host holds, the
    /// state at the end. `lock` (from [`HybridCache::lock_host`]) holds the host path;
    /// it is released once the copy is done. On error nothing stays allocated, and the
    /// lock is the caller's to release.
    pub(super) fn load_back(
        &mut self,
        req: &mut crate::Request,
        hm: &HostMatch,
        lock: LockHandle,
    ) -> Result<(), Error> {
        let from = req.row.len();
        let extend = unikv_pools::ExtendRequest {
            prefix_len: from,
            seq_len: hm.len,
            last_token: req.row.last().copied(),
        };
        let pages = extend.new_pages(self.alloc.page_size());
        self.make_room(self.kv_demand(pages))?;
        self.scratch.clear();
        let mut rows = std::mem::take(&mut self.scratch);
        if let Err(e) = self.alloc.alloc_extend(&[extend], &mut rows) {
            self.scratch = rows;
            return Err(self.out_of_memory(e));
        }
        let host = self.host.as_ref().expect("a host match needs a host tier");
        let planned = host.load_plan(hm, from).and_then(|plan| {
            // Rows from `swa_lo` to the end get their SWA from the host; those below
            // keep none.
            let swa_lo = plan
                .pages
                .iter()
                .find(|p| p.swa.is_some())
                .map_or(hm.len, |p| p.at);
            let copies = load_copies(&plan, &rows, from, host, &*self.alloc, req)?;
            Some((plan, swa_lo, copies))
        });
        let issued = match planned {
            Some((plan, swa_lo, copies)) => self
                .device
                .copy_host_to_device(host.buffer, self.alloc.buffer(), &copies)
                .and_then(|()| self.device.record_copy_event())
                .map(|event| (event, plan, swa_lo, copies))
                .map_err(Error::from),
            // The host tree names a unit the pool lacks, or a new row or the running
            // slot is unmapped: a bookkeeping breach, refused before anything is copied.
            None => Err(Error::Conservation {
                step: self.step,
                detail: format!(
                    "the load-back of rows {from}..{} misses a host unit or a device page",
                    hm.len
                ),
            }),
        };
        let (event, plan, swa_lo, copies) = match issued {
            Ok(issued) => issued,
            Err(e) => {
                self.alloc.free_batch(&[FreeOp::KvRow {
                    row: &rows,
                    dead_lo: 0,
                    cursor: 0,
                    len: rows.len(),
                }]);
                rows.clear();
                self.scratch = rows;
                return Err(e);
            }
        };
        let before = self.held(req);
        req.row.extend_from_slice(&rows);
        self.account(before, self.held(req));
        rows.clear();
        self.scratch = rows;
        // The loaded rows below the window the host held have SWA pages with nothing in
        // them: released, as a decode releases what leaves its window.
        if self.has_swa && swa_lo > from {
            self.alloc
                .free_swa_segment(unikv_pools::Segment::of_row(&req.row, from..swa_lo))?;
            self.window_released(req, swa_lo)?;
        }
        // Last, so that no error path after it hands the lock back twice.
        let host = self.host.as_mut().expect("checked above");
        host.count_copies(&copies);
        host.stats.loaded_bytes += copies.iter().map(|c| c.len).sum::<u64>();
        host.stats.hit_tokens += (hm.len - from) as u64;
        host.loads.push(StepLoad {
            request: req.id,
            plan,
        });
        host.parked.push(Parked {
            event,
            request: Some(req.id),
            reads: Vec::new(),
            reads_slot: None,
            releases: vec![Release::HostLock(lock)],
        });
        Ok(())
    }

    /// Checks the host tier's conservation at every step boundary when invariants are
    /// on: its counters every time, the walk of its frames and tree at `Strict` every
    /// [`super::TREE_SANITY_INTERVAL`]-th step (as the device tree's).
    pub(super) fn check_host(&self) -> Result<(), Error> {
        let Some(host) = &self.host else {
            return Ok(());
        };
        if !unikv_invariants::enabled() {
            return Ok(());
        }
        let deep = unikv_invariants::level() == unikv_invariants::Level::Strict
            && self.step.is_multiple_of(super::TREE_SANITY_INTERVAL);
        let result = host.conservation(deep);
        let holds = result.is_ok();
        let detail = || result.clone().err().unwrap_or_default();
        if !self
            .scope
            .expect(&crate::invariants_decl::HOST_CONSERVATION, holds, detail)
        {
            return Err(Error::Conservation {
                step: self.step,
                detail: detail(),
            });
        }
        Ok(())
    }

    /// The host tier's figures (`None` without one).
    pub(super) fn host_stats(&self) -> Option<HostStats> {
        self.host.as_ref().map(HostTier::stats)
    }
}

/// The device pages (virtual page ids) and state slots `actions` free, on any side.
fn freed_units(actions: &[Action], ps: usize) -> (Vec<u32>, Vec<u32>) {
    let (mut pages, mut slots) = (Vec::new(), Vec::new());
    let mut add = |tokens: &[TreeToken]| {
        pages.extend(tokens.iter().step_by(ps).map(|t| t.0 / ps as u32));
    };
    for action in actions {
        match action {
            Action::FreeDeviceKv { tokens }
            | Action::FreeDeviceKvFullOnly { tokens }
            | Action::EvictNode { tokens, .. }
            | Action::TombstoneSwa { tokens, .. } => add(tokens),
            Action::RecoverSwaWithLockedFull { incoming, .. } => add(incoming),
            Action::SwaRebuild { .. } => {}
            Action::EvictMambaState { slot, .. } | Action::FreeMambaSlot { slot } => {
                slots.push(slot.0)
            }
        }
    }
    (pages, slots)
}

/// The FULL pages, SWA pages (none without SWA layers: the tree counts a node's side
/// as live then) and state slots `actions` release.
fn parked_pages(actions: &[Action], ps: usize, has_swa: bool) -> [usize; 3] {
    let r = unikv_radix::Released::of(actions);
    let swa = if has_swa { r.swa.0 / ps } else { 0 };
    [r.full.0 / ps, swa, r.mamba.0]
}

/// The byte offset of `page`'s envelope on `side` (`None` when unmapped).
fn device_page(alloc: &dyn unikv_pools::KvAllocator, side: Side, page: u32) -> Option<u64> {
    let phys = alloc.physical_page(side, VirtualPage(page))?;
    Some(alloc.grid(side).offset(phys))
}

/// The copies of a load-back of `plan` into `rows` (the new rows from row `from`): its
/// FULL and SWA pages, the state into `req`'s running slot. `None` when a row or the
/// slot is unmapped.
fn load_copies(
    plan: &LoadPlan,
    rows: &[unikv_pools::VirtualToken],
    from: usize,
    host: &HostTier,
    alloc: &dyn unikv_pools::KvAllocator,
    req: &crate::Request,
) -> Option<Vec<HostCopy>> {
    let ps = host.ps();
    let unit = |kind, block| (host.pool.offset(kind, block), host.pool.unit_bytes(kind));
    let mut copies = Vec::with_capacity(2 * plan.pages.len() + 1);
    for p in &plan.pages {
        let page = rows[p.at - from].0 / ps as u32;
        let (at, len) = unit(HostKind::Full, p.full.1);
        copies.push(HostCopy {
            device: device_page(alloc, Side::Full, page)?,
            host: at,
            len,
        });
        if let Some((_, b)) = p.swa {
            let (at, len) = unit(HostKind::Swa, b);
            copies.push(HostCopy {
                device: device_page(alloc, Side::Swa, page)?,
                host: at,
                len,
            });
        }
    }
    if let (Some((_, b)), Some(state)) = (plan.state, &req.state) {
        let (at, len) = unit(HostKind::State, b);
        copies.push(HostCopy {
            device: alloc
                .grid(Side::Mamba)
                .offset(alloc.physical_slot(state.running)?),
            host: at,
            len,
        });
    }
    Some(merged(copies))
}

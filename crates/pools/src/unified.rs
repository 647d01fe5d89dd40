//! `UnifiedSwa`: the unified pool, FULL KV with SWA KV, Mamba state or both in one byte
//! buffer. FULL grows down from the high end and mints virtual pages; the low end grows up
//! from the sink floor (SWA, or the Mamba slots); with all three kinds (the tri-pool,
//! `[Mamba up | SWA float | FULL down]`) SWA is a float between the ends. SWA binds its
//! pages to FULL's virtual pages (so `swa.v2p` is the FULL→SWA map); Mamba state slots
//! have their own virtual ids. Capacity is bytes between the frontiers, so the split
//! follows the workload; compaction is lazy, and a float moves only when an end needs the
//! bytes it holds (the shortfall ladder).
//!
//! This file holds the layout, the tables the free family works on and the
//! [`KvAllocator`] implementation; `fit` is the feasibility check (and where a float's
//! pages go), `room` the shortfall ladder, `alloc` the allocation paths.
//!
//! The float's moves are checked from both ends in `tests/tri_pool.rs`
//! (`scenario_34_the_float_lands_at_the_midpoint_parks_when_empty_and_never_walls_off_full`,
//! `scenario_35_full_needing_the_floats_bytes_relays_the_fewest_boundary_swa_pages`), and
//! a device fault anywhere in the ladder changes nothing a caller sees
//! (`a_device_fault_anywhere_in_the_ladder_changes_nothing_a_caller_sees`).

mod alloc;
mod fit;
mod room;

use fit::{FloatFit, Placement};
use room::Source;

use crate::api::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, KvAllocator, MoveGate,
    PageDemand, PoolMap, ReclaimPlan, Reclaimable, Segment, SpanInfo, SwaState,
};
use crate::error::Error;
use crate::frees::{self, FreeGroup, PageTables};
use crate::ids::{PageSize, VirtualPage, VirtualSlot, VirtualToken};
use crate::invariants::CONSERVATION;
use crate::memory::DeviceMemory;
use crate::spec::{
    BS1_STATE_SLOTS, Grid, Grow, Side, SlotPoolSpec, SubPoolSpec, bs1_floor, check_bs1_floor,
    largest_total, sink_floor, window_pages,
};
use crate::sub::{CompactionPlan, Keep, RelayPlan, Release, SubAllocator};
use crate::virtual_ids::VirtualIds;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use unikv_invariants::{Scope, enabled};
use unikv_kernels::{ByteSpan, BytesId, Device, SpanMove, TableId, TableSpans};

/// How to build a [`UnifiedSwa`]: FULL with SWA (gpt-oss, Gemma) or with Mamba state
/// (Qwen3-Next, Nemotron-H).
#[derive(Clone, Debug)]
pub struct UnifiedSwaConfig {
    /// Bytes of the one buffer.
    pub total_bytes: u64,
    /// Tokens per page (FULL and SWA share it).
    pub page_size: u32,
    /// The sliding window, in tokens (sizes the batch-size-1 floor; unused without SWA).
    pub window: u32,
    /// The FULL sub-pool (grows down from the high end).
    pub full: SubPoolSpec,
    /// The SWA sub-pool (grows up from the sink floor); `None` for a model without
    /// sliding-window layers.
    pub swa: Option<SubPoolSpec>,
    /// The Mamba state slots (grow up from the sink floor); `None` for a model without
    /// recurrent layers. With SWA as well the layout is the tri-pool: SWA floats between
    /// the slots and FULL.
    pub mamba: Option<SlotPoolSpec>,
    /// Zero page envelopes and slots when they are handed out (one `fill_spans` per
    /// allocation).
    pub zero_on_handout: bool,
}

/// Index of a side in per-side arrays (`[full, swa, mamba]`).
const fn ix(side: Side) -> usize {
    match side {
        Side::Full => 0,
        Side::Swa => 1,
        Side::Mamba => 2,
    }
}

/// The unified allocator over one byte buffer on a [`Device`]: FULL at the high end, SWA
/// or Mamba state at the low end.
#[derive(Debug)]
pub struct UnifiedSwa {
    device: Arc<dyn Device>,
    /// Held for its drop: frees `buffer` and `mirrors` with the allocator.
    _memory: DeviceMemory,
    buffer: BytesId,
    ps: PageSize,
    total_bytes: u64,
    floor: u64,
    full: SubAllocator,
    /// The SWA side (the low end), when the model has one.
    swa: Option<SubAllocator>,
    /// The Mamba slot side (the low end, page size 1), when the model has one.
    mamba: Option<SubAllocator>,
    /// Free virtual pages (FULL mints them).
    free_ids: VirtualIds,
    virtual_pages: u32,
    /// Free virtual slots (empty without a slot pool).
    slot_ids: VirtualIds,
    /// Virtual slots, sink included (0 without a slot pool).
    virtual_slots: u32,
    group: FreeGroup,
    /// Where this allocator's invariant breaches are counted (its cache's scope).
    scope: Scope,
    gates: Arc<AtomicUsize>,
    /// Device mirror of each side's `v2p` (`[full, swa, mamba]`, absent sides `None`).
    mirrors: [Option<TableId>; 3],
    zero_on_handout: bool,
    /// Envelopes to zero before an allocation binds them (one `fill_spans`).
    spans: Vec<ByteSpan>,
    /// Envelope copies of a planned compaction (every side, one `move_spans`).
    moves: Vec<SpanMove>,
    /// The planned compaction per side, committed after the device moved.
    plans: [CompactionPlan; 3],
    /// The planned relay of the tri-pool's float, committed after the device moved.
    relay: RelayPlan,
}

impl UnifiedSwa {
    /// Lays out the buffer, allocates it (zeroed) and the mirror tables on `device`.
    /// Fails when the buffer cannot hold the sink plus one request (one window on both
    /// sides, or [`BS1_STATE_SLOTS`] slots and one FULL page;
    /// [`Error::BufferTooSmall`]) or kernel ids would overflow i32.
    pub fn new(device: Arc<dyn Device>, config: UnifiedSwaConfig) -> Result<UnifiedSwa, Error> {
        let ps = PageSize::new(config.page_size)
            .ok_or_else(|| Error::BadConfig("page size must be at least 1".into()))?;
        let total = config.total_bytes;
        let (swa_spec, slot_spec) = (config.swa.as_ref(), config.mamba.as_ref());
        if swa_spec.is_none() && slot_spec.is_none() {
            return Err(Error::BadConfig(
                "a unified pool needs an SWA side or a Mamba slot pool beside FULL".into(),
            ));
        }
        let kv: Vec<&SubPoolSpec> = std::iter::once(&config.full).chain(swa_spec).collect();
        let floor = sink_floor(&kv, slot_spec, ps);
        // Every side's grid in a buffer of `bytes` (absent sides: `None`).
        let grids = |bytes| -> Result<(Grid, Option<Grid>, Option<Grid>), Error> {
            Ok((
                Grid::new(&config.full, ps, bytes, floor, "full")?,
                swa_spec
                    .map(|swa| Grid::new(swa, ps, bytes, floor, "swa"))
                    .transpose()?,
                slot_spec
                    .map(|slots| slots.grid(bytes, floor))
                    .transpose()?,
            ))
        };
        let (full_grid, swa_grid, slot_grid) =
            grids(total).map_err(|e| e.at_layout_limit(largest_total(&kv, slot_spec, ps)))?;
        let floor_need = bs1_floor(ps, swa_spec.map(|_| config.window), slot_spec.is_some());
        let wp = window_pages(ps, config.window);
        // One request at batch size 1: its slots packed above the floor (or the floor),
        // one window of FULL below the top and, between them, one window of SWA pages on
        // their own grid (or, without SWA, one FULL page).
        let holds_one = |(f, s, m): (Grid, Option<Grid>, Option<Grid>)| -> bool {
            let low = m.map_or(floor, |m| {
                m.offset(m.min_page)
                    .saturating_add(BS1_STATE_SLOTS as u64 * m.envelope)
            });
            let full_pages = if s.is_some() { wp } else { 1 };
            let Some(full_lo) = (f.pages as u64).checked_sub(full_pages) else {
                return false;
            };
            let full_lo = full_lo * f.envelope;
            match s {
                None => full_lo >= low,
                Some(s) => {
                    full_lo >= low
                        && (full_lo / s.envelope).saturating_sub(low.div_ceil(s.envelope)) >= wp
                }
            }
        };
        check_bs1_floor(total, floor_need, |bytes| grids(bytes).is_ok_and(holds_one))?;
        let virtual_pages = full_grid.pages - full_grid.min_page + 1;
        if virtual_pages as u64 * ps.get() as u64 > i32::MAX as u64 {
            return Err(Error::BadConfig(format!(
                "{virtual_pages} virtual pages × page size {ps} overflow i32 token ids"
            )));
        }
        let virtual_slots = slot_grid.map_or(0, |g| g.pages - g.min_page + 1);
        let mut memory = DeviceMemory::new(device.clone());
        let buffer = memory.alloc_bytes(total, 0)?;
        let mut mirrors = [None; 3];
        mirrors[ix(Side::Full)] = Some(memory.alloc_table(virtual_pages as usize, 0)?);
        // With the slots at the low end, SWA floats between them and FULL.
        let swa_grow = if slot_grid.is_some() {
            Grow::Float
        } else {
            Grow::Up
        };
        let swa = match swa_grid {
            Some(grid) => {
                mirrors[ix(Side::Swa)] = Some(memory.alloc_table(virtual_pages as usize, 0)?);
                Some(SubAllocator::new(grid, swa_grow, virtual_pages))
            }
            None => None,
        };
        let mamba = match slot_grid {
            Some(grid) => {
                mirrors[ix(Side::Mamba)] = Some(memory.alloc_table(virtual_slots as usize, 0)?);
                Some(SubAllocator::new(grid, Grow::Up, virtual_slots))
            }
            None => None,
        };
        Ok(UnifiedSwa {
            device,
            _memory: memory,
            buffer,
            ps,
            total_bytes: total,
            floor,
            full: SubAllocator::new(full_grid, Grow::Down, virtual_pages),
            swa,
            mamba,
            free_ids: VirtualIds::new(virtual_pages),
            virtual_pages,
            slot_ids: VirtualIds::new(virtual_slots),
            virtual_slots,
            group: FreeGroup::new(virtual_pages),
            scope: Scope::new(),
            gates: Arc::new(AtomicUsize::new(0)),
            mirrors,
            zero_on_handout: config.zero_on_handout,
            spans: Vec::new(),
            moves: Vec::new(),
            plans: Default::default(),
            relay: RelayPlan::default(),
        })
    }

    /// Byte range `[low, high)` of `side`'s span (an absent side: the empty span at the
    /// sink floor).
    pub fn span_bytes(&self, side: Side) -> (u64, u64) {
        self.side(side)
            .map_or((self.floor, self.floor), SubAllocator::span_bytes)
    }

    /// Mirror entries waiting for the upload (every side).
    fn mirror_pending(&self) -> usize {
        self.subs().map(SubAllocator::dirty_count).sum()
    }

    /// `side`'s sub-pool; `None` for a side this layout does not have.
    fn side(&self, side: Side) -> Option<&SubAllocator> {
        match side {
            Side::Full => Some(&self.full),
            Side::Swa => self.swa.as_ref(),
            Side::Mamba => self.mamba.as_ref(),
        }
    }

    /// The sub-pools this layout has, FULL first.
    fn subs(&self) -> impl Iterator<Item = &SubAllocator> {
        std::iter::once(&self.full)
            .chain(self.swa.as_ref())
            .chain(self.mamba.as_ref())
    }

    /// The low (grow-up) end: the Mamba slots, else SWA.
    fn low(&self) -> &SubAllocator {
        match (&self.mamba, &self.swa) {
            (Some(low), _) | (None, Some(low)) => low,
            (None, None) => unreachable!("a layout has SWA or Mamba (checked at boot)"),
        }
    }

    /// The float between the ends: SWA in the tri-pool.
    fn float(&self) -> Option<&SubAllocator> {
        self.swa.as_ref().filter(|swa| swa.grow == Grow::Float)
    }

    fn gated(&self) -> bool {
        self.gates.load(Ordering::Acquire) > 0
    }
}

impl PageTables for UnifiedSwa {
    fn ps(&self) -> PageSize {
        self.ps
    }
    fn virtual_pages(&self) -> u32 {
        self.virtual_pages
    }
    #[inline(always)]
    fn full_live(&self, v: u32) -> bool {
        self.full.v2p[v as usize] > 0
    }
    #[inline(always)]
    fn run_clean(&self, v: u32, n: usize, want: Option<frees::SwaWant>) -> bool {
        let pages = v as usize..v as usize + n;
        let full = self.full.v2p[pages.clone()]
            .iter()
            .fold(true, |ok, &e| ok & (e > 0));
        let swa = match (want, &self.swa) {
            (None, _) => true,
            (Some(want), Some(swa)) => swa.v2p[pages]
                .iter()
                .fold(true, |ok, &e| ok & want.holds(e)),
            // No SWA side: every entry reads as unbound (0).
            (Some(want), None) => want.holds(0),
        };
        (v != 0) & full & swa
    }
    #[inline(always)]
    fn swa_entry(&self, v: u32) -> i32 {
        self.swa.as_ref().map_or(0, |swa| swa.v2p[v as usize])
    }
    // Reached only for a page whose SWA entry is live (> 0), so only with an SWA side.
    #[inline(always)]
    fn release_swa(&mut self, v: u32, tombstone: bool) {
        if let Some(swa) = &mut self.swa {
            swa.unbind(v, tombstone);
        }
    }
    #[inline(always)]
    fn release_full(&mut self, v: u32) {
        self.full.unbind(v, false);
        if let Some(swa) = &mut self.swa {
            swa.clear_tombstone(v);
        }
        self.free_ids.push(v);
    }
    fn move_swa(&mut self, from: u32, to: u32) {
        if let Some(swa) = &mut self.swa {
            swa.rebind(from, to);
        }
    }
    /// Two passes, SWA then FULL, each touching one side's tables and lists. Same effect,
    /// in the same order per list, as `release_page_silently` page by page: the SWA and
    /// FULL transitions of a page do not read each other's state, except the FULL
    /// liveness filter, which the SWA pass reads before the FULL pass changes it. A page
    /// listed twice is still released once: its second visit finds SWA unbound (0: no
    /// change) in the first pass and FULL free in the second.
    fn release_pages(&mut self, pages: &[u32]) {
        if let Some(swa) = &mut self.swa {
            swa.release_each(
                pages,
                Keep::LiveIn(&self.full.v2p),
                Release::FreeAndClear,
                None,
            );
        }
        // FULL has no tombstones; each released id goes back on the stack, in order.
        self.full.release_each(
            pages,
            Keep::NotSink,
            Release::Free,
            Some(self.free_ids.stack()),
        );
    }
    fn tombstone_swa_pages(&mut self, pages: &[u32]) {
        if let Some(swa) = &mut self.swa {
            swa.release_each(pages, Keep::NotSink, Release::Tombstone, None);
        }
    }
    fn group(&mut self) -> &mut FreeGroup {
        &mut self.group
    }
    fn group_ref(&self) -> &FreeGroup {
        &self.group
    }
    fn scope(&self) -> &Scope {
        &self.scope
    }
    fn has_swa(&self) -> bool {
        self.swa.is_some()
    }
    fn slot_ids(&self) -> u32 {
        self.virtual_slots
    }
    fn slot_live(&self, s: u32) -> bool {
        self.mamba
            .as_ref()
            .is_some_and(|m| m.v2p.get(s as usize).is_some_and(|&p| p > 0))
    }
    fn release_slot(&mut self, s: u32) {
        if let Some(mamba) = &mut self.mamba {
            mamba.unbind(s, false);
            self.slot_ids.push(s);
        }
    }
}

impl frees::SlotCopy for UnifiedSwa {
    fn issue_slot_copies(&self, pairs: &[(VirtualSlot, VirtualSlot)]) -> Result<(), Error> {
        let Some(mamba) = &self.mamba else {
            return Err(Error::NoSlotPool { op: "copy_slots" });
        };
        // Checked live by the caller: both ends of each pair are bound.
        let copies: Vec<SpanMove> = pairs
            .iter()
            .map(|&(src, dst)| {
                let (src, dst) = (mamba.v2p[src.0 as usize], mamba.v2p[dst.0 as usize]);
                SpanMove {
                    src: mamba.grid.offset(src as u32),
                    dst: mamba.grid.offset(dst as u32),
                    len: mamba.grid.envelope,
                }
            })
            .collect();
        self.device.move_spans(self.buffer, &copies)?;
        Ok(())
    }
}

impl KvAllocator for UnifiedSwa {
    fn page_size(&self) -> PageSize {
        self.ps
    }

    fn invariant_scope(&self) -> &Scope {
        &self.scope
    }

    fn set_invariant_scope(&mut self, scope: Scope) {
        self.scope = scope;
    }

    fn virtual_pages(&self) -> u32 {
        self.virtual_pages
    }

    crate::frees::free_family_methods!();

    fn alloc_slots(&mut self, n: usize, out: &mut Vec<VirtualSlot>) -> Result<(), Error> {
        if self.mamba.is_none() {
            return Err(Error::NoSlotPool { op: "alloc_slots" });
        }
        // One transaction, as a page allocation: room, planned moves, device work
        // (moves, zeroing), and only then the tables.
        self.prepare_handout(Side::Mamba, PageDemand::slots(n), n)?;
        out.reserve(n);
        self.bind_slots(n, out);
        Ok(())
    }

    fn flush(&mut self) -> Result<FlushReport, Error> {
        let deferred_flushed = frees::flush_deferred(self);
        let gated = self.gated();
        let pages_moved = if gated {
            0
        } else {
            self.compact(self.float_compaction_edge())?
        };
        if enabled() {
            self.check_conservation();
        }
        Ok(FlushReport {
            deferred_flushed,
            pages_moved,
            gated,
        })
    }

    fn allocation_fits(&self, demand: PageDemand) -> bool {
        self.fits_any(demand, Reclaimable::default())
    }

    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        if demand.mamba_slots > 0 && self.mamba.is_none() {
            return Err(Error::NoSlotPool {
                op: "ensure_capacity",
            });
        }
        frees::flush_deferred(self);
        let (from, _) = self.plan_room(demand)?;
        if from != Source::AsIs {
            if let Err(e) = self.issue_moves() {
                self.drop_plans();
                return Err(e);
            }
            self.commit_plans(from);
        }
        Ok(())
    }

    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        if demand.mamba_slots > 0 && self.mamba.is_none() {
            // No slot pool: no eviction makes a slot demand fit (and nothing is flushed).
            return None;
        }
        // Deferred frees first: bytes waiting in any list must be visible before sizing.
        frees::flush_deferred(self);
        if self.fits_any(demand, Reclaimable::default()) {
            return Some(ReclaimPlan::default());
        }
        let live = |side| self.side(side).map_or(0, |sub| sub.live as usize);
        let all = Reclaimable {
            full_pages: evictable.full_pages.min(live(Side::Full)),
            swa_pages: evictable.swa_pages.min(live(Side::Swa)),
            mamba_slots: evictable.mamba_slots.min(live(Side::Mamba)),
        };
        if !self.fits_any(demand, all) {
            return None;
        }
        // SWA first (the cheapest to lose), then Mamba states, then FULL: FULL is the
        // donor of bytes, a cached state the last resort (an id-bound slot shortfall
        // still needs the states it lacks ids for).
        let swa_pages = Self::min_fitting(all.swa_pages, |r| {
            self.fits_any(
                demand,
                Reclaimable {
                    swa_pages: r,
                    ..all
                },
            )
        });
        let mamba_slots = Self::min_fitting(all.mamba_slots, |r| {
            self.fits_any(
                demand,
                Reclaimable {
                    swa_pages,
                    mamba_slots: r,
                    ..all
                },
            )
        });
        let full_pages = Self::min_fitting(all.full_pages, |r| {
            let r = Reclaimable {
                full_pages: r,
                swa_pages,
                mamba_slots,
            };
            self.fits_any(demand, r)
        });
        // Monotone in the other reclaims, so with all of them the minimum is at most
        // `full_pages`.
        let full_floor_pages = Self::min_fitting(all.full_pages, |r| {
            self.fits_any(
                demand,
                Reclaimable {
                    full_pages: r,
                    ..all
                },
            )
        });
        Some(ReclaimPlan {
            full_pages,
            swa_pages,
            mamba_slots,
            full_floor_pages,
        })
    }

    fn capacity(&self) -> Capacity {
        let available = self.joint_pages(Placement::Now);
        // A slot is priced against one token of FULL (and SWA) KV: the bytes it takes
        // from the shared budget, in tokens.
        let kv_page_bytes =
            self.full.grid.envelope + self.swa.as_ref().map_or(0, |swa| swa.grid.envelope);
        let ps = self.ps.get() as u64;
        Capacity {
            page_size: self.ps.get(),
            full: self.side_capacity(Side::Full),
            swa: self.side_capacity(Side::Swa),
            mamba: self.side_capacity(Side::Mamba),
            slot_price_tokens: self.mamba.as_ref().map_or(0, |m| {
                m.grid.envelope.saturating_mul(ps).div_ceil(kv_page_bytes) as usize
            }),
            joint_available_pages: available,
            joint_schedulable_pages: if self.gated() {
                available
            } else {
                self.joint_pages(Placement::Relaid)
            },
        }
    }

    fn pool_map(&self) -> PoolMap {
        let info = |side: Side, sub: &SubAllocator| SpanInfo {
            side,
            bytes: sub.span_bytes(),
            envelope: sub.grid.envelope,
            pages: sub.span_pages() as usize,
            live: sub.live as usize,
            holes: sub.holes.len(),
            tombstones: sub.tombstones as usize,
        };
        let mut spans = Vec::with_capacity(3);
        for side in [Side::Mamba, Side::Swa, Side::Full] {
            if let Some(sub) = self.side(side) {
                spans.push(info(side, sub));
            }
        }
        PoolMap {
            layout: "unified",
            page_size: self.ps.get(),
            total_bytes: self.total_bytes,
            sink_floor: self.floor,
            spans,
        }
    }

    fn move_gate(&self) -> MoveGate {
        MoveGate::close(&self.gates)
    }

    fn upload_mirror(&mut self) -> Result<(), Error> {
        // One op for every side's changed spans, copied from the host tables as they are
        // now. The spans stay until it was issued, so a failed upload is retried whole
        // (copying a span again is idempotent).
        let mut copies = [TableSpans {
            table: TableId(0),
            values: &[],
            spans: &[],
        }; 3];
        let mut n = 0;
        for side in [Side::Full, Side::Swa, Side::Mamba] {
            if let (Some(sub), Some(table)) = (self.side(side), self.mirrors[ix(side)])
                && sub.has_dirty()
            {
                copies[n] = TableSpans {
                    table,
                    values: sub.v2p_table(),
                    spans: sub.dirty_spans(),
                };
                n += 1;
            }
        }
        if n > 0 {
            self.device.copy_table_spans(&copies[..n])?;
        }
        self.full.clear_dirty();
        for sub in [&mut self.swa, &mut self.mamba].into_iter().flatten() {
            sub.clear_dirty();
        }
        Ok(())
    }

    fn mirror_table(&self, side: Side) -> Option<TableId> {
        self.mirrors[ix(side)]
    }

    fn stride(&self, side: Side) -> u32 {
        self.grid(side).stride
    }

    fn kernel_id(&self, side: Side, token: VirtualToken) -> i32 {
        let Some(sub) = self.side(side) else {
            return 0;
        };
        match sub.v2p.get(token.page(self.ps).0 as usize) {
            Some(&p) if p > 0 && token.0 != 0 => {
                p * sub.grid.stride as i32 + token.offset(self.ps) as i32
            }
            _ => 0,
        }
    }

    fn grid(&self, side: Side) -> Grid {
        self.side(side).map_or(Grid::ABSENT, |sub| sub.grid)
    }

    fn sink_floor(&self) -> u64 {
        self.floor
    }

    fn physical_page(&self, side: Side, page: VirtualPage) -> Option<u32> {
        let p = *self.side(side)?.v2p.get(page.0 as usize)?;
        (p > 0).then_some(p as u32)
    }

    fn physical_slot(&self, slot: VirtualSlot) -> Option<u32> {
        self.physical_page(Side::Mamba, VirtualPage(slot.0))
    }

    fn full_live(&self, page: VirtualPage) -> bool {
        (page.0 as usize) < self.full.v2p.len() && self.full.v2p[page.0 as usize] > 0
    }

    fn swa_state(&self, page: VirtualPage) -> SwaState {
        match self
            .swa
            .as_ref()
            .and_then(|swa| swa.v2p.get(page.0 as usize))
        {
            Some(&p) if p > 0 => SwaState::Live,
            Some(-1) => SwaState::Tombstone,
            _ => SwaState::Unbound,
        }
    }

    fn check_conservation(&self) -> bool {
        let low = self.low();
        let (low_lo, _) = low.span_bytes();
        let (_, full_hi) = self.full.span_bytes();
        let swa_fits_full = self
            .swa
            .as_ref()
            .is_none_or(|swa| swa.live + swa.tombstones <= self.full.live);
        // `[low end | float | FULL]` in byte order (an empty float is transparent).
        let chain_disjoint = match self.float().filter(|swa| swa.live > 0) {
            Some(swa) => {
                let (lo, hi) = swa.span_bytes();
                low.facing_byte() <= lo && hi <= self.full.facing_byte()
            }
            None => low.facing_byte() <= self.full.facing_byte(),
        };
        let slots_conserved = self.mamba.as_ref().is_none_or(|m| {
            m.tombstones == 0
                && self.slot_ids.available() + m.live as usize == self.virtual_slots as usize - 1
        });
        let holds = self.subs().all(SubAllocator::accounting_holds)
            && self.free_ids.available() + self.full.live as usize
                == self.virtual_pages as usize - 1
            && swa_fits_full
            && slots_conserved
            && self.full.tombstones == 0
            && chain_disjoint
            && low_lo >= self.floor
            && full_hi <= self.total_bytes;
        self.scope.expect(&CONSERVATION, holds, || {
            let side = |name: &str, sub: &SubAllocator| {
                format!(
                    "{name} live {} holes {} tomb {} span {} frontier {}",
                    sub.live,
                    sub.holes.len(),
                    sub.tombstones,
                    sub.span_pages(),
                    sub.frontier()
                )
            };
            let mut what = side("full", &self.full);
            for (name, sub) in [("swa", &self.swa), ("mamba", &self.mamba)] {
                if let Some(sub) = sub {
                    what += &format!("; {}", side(name, sub));
                }
            }
            format!(
                "unified: {what}; free ids {} of {}; free slots {} of {}",
                self.free_ids.available(),
                self.virtual_pages - 1,
                self.slot_ids.available(),
                self.virtual_slots.saturating_sub(1)
            )
        })
    }

    fn verify(&self) -> Result<(), String> {
        self.full.verify("full")?;
        if let Some(swa) = &self.swa {
            swa.verify("swa")?;
        }
        if let Some(mamba) = &self.mamba {
            mamba.verify("mamba")?;
        }
        if !self.check_conservation() {
            return Err("conservation does not hold".into());
        }
        let free_ids_ok = |ids: &VirtualIds, v2p: &[i32], what: &str| {
            let mut ids = ids.as_slice().to_vec();
            ids.sort_unstable();
            if ids.windows(2).any(|w| w[0] == w[1]) || ids.first() == Some(&0) {
                return Err(format!("free virtual {what}s hold a duplicate or the sink"));
            }
            match ids.iter().find(|&&v| v2p[v as usize] != 0) {
                Some(v) => Err(format!("free virtual {what} {v} is bound")),
                None => Ok(()),
            }
        };
        free_ids_ok(&self.free_ids, &self.full.v2p, "page")?;
        if let Some(mamba) = &self.mamba {
            free_ids_ok(&self.slot_ids, &mamba.v2p, "slot")?;
        }
        if let Some(swa) = &self.swa {
            for v in 0..self.virtual_pages as usize {
                if swa.v2p[v] != 0 && self.full.v2p[v] <= 0 {
                    return Err(format!(
                        "v{v} has SWA entry {} without live FULL",
                        swa.v2p[v]
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::invariants::ROOM_CHECK;
    use unikv_invariants::{Level, scoped_level};
    use unikv_kernels::CpuDevice;

    fn pool(ps: u32) -> UnifiedSwa {
        pool_on(Arc::new(CpuDevice::new()), ps, false)
    }

    fn pool_on(device: Arc<dyn Device>, ps: u32, zero_on_handout: bool) -> UnifiedSwa {
        UnifiedSwa::new(
            device,
            UnifiedSwaConfig {
                zero_on_handout,
                ..config(ps)
            },
        )
        .unwrap()
    }

    /// FULL and SWA sides with room for 16 joint pages above the sink floor.
    fn config(ps: u32) -> UnifiedSwaConfig {
        let (full, swa) = (
            SubPoolSpec::mha("full", 2, 1, 4, 2),
            SubPoolSpec::mha("swa", 2, 2, 4, 2),
        );
        let floor = full.bytes_per_token.max(swa.bytes_per_token) * u64::from(ps);
        UnifiedSwaConfig {
            total_bytes: floor + 16 * u64::from(ps) * (full.bytes_per_token + swa.bytes_per_token),
            page_size: ps,
            window: 8,
            full,
            swa: Some(swa),
            mamba: None,
            zero_on_handout: false,
        }
    }

    /// The conservation check fails on a corruption of one of its clauses alone: a FULL
    /// tombstone (FULL has none), or a Mamba tombstone (slots have none either).
    #[test]
    fn conservation_fails_on_a_tombstone_where_a_side_has_none() {
        let mut out = Vec::new();
        let request = ExtendRequest {
            prefix_len: 0,
            seq_len: 4,
            last_token: None,
        };
        let mut p = pool(4);
        p.alloc_extend(&[request], &mut out).unwrap();
        assert!(p.check_conservation());
        p.full.tombstones = 1;
        assert!(!p.check_conservation(), "a FULL tombstone");

        let mut p = UnifiedSwa::new(
            Arc::new(CpuDevice::new()),
            UnifiedSwaConfig {
                mamba: Some(crate::SlotPoolSpec {
                    name: "mamba",
                    layers: 1,
                    bytes_per_slot: 64,
                }),
                total_bytes: 1 << 16,
                ..config(4)
            },
        )
        .unwrap();
        let mut slots = Vec::new();
        p.alloc_slots(1, &mut slots).unwrap();
        assert!(p.check_conservation());
        p.mamba.as_mut().unwrap().tombstones = 1;
        assert!(!p.check_conservation(), "a Mamba tombstone");
    }

    /// The full scan finds a free id list holding the sink in place of a free id, which
    /// the counts alone do not show.
    #[test]
    fn verify_finds_the_sink_on_the_free_id_list() {
        let mut p = pool(4);
        assert_eq!(p.verify(), Ok(()));
        let stack = p.free_ids.stack();
        stack[0] = 0;
        assert_eq!(
            p.verify(),
            Err("free virtual pages hold a duplicate or the sink".to_string())
        );
    }

    /// An empty pool's totals: every virtual id but the sink on FULL, every page above the
    /// floor on SWA (all of them free).
    #[test]
    fn an_empty_pools_totals_count_every_id_and_every_page_above_the_floor() {
        let pool = pool(4);
        let cap = pool.capacity();
        assert_eq!(cap.full.total_pages, pool.free_ids.available());
        assert_eq!(cap.full.total_pages, pool.virtual_pages as usize - 1);
        let swa = pool.swa.as_ref().unwrap();
        assert_eq!(
            cap.swa.total_pages,
            (swa.grid.pages - swa.grid.min_page) as usize
        );
        assert!(cap.swa.total_pages > 0 && cap.full.total_pages > 0);
    }

    /// Zeroing on hand-out happens only when asked, and only for an allocation that takes
    /// new pages (one filling a page's free tail zeroes nothing).
    #[test]
    fn only_new_pages_are_zeroed_and_only_when_asked() {
        let fresh = |seq_len: usize, prefix_len: usize, last: Option<VirtualToken>| ExtendRequest {
            prefix_len,
            seq_len,
            last_token: last,
        };
        for zero in [false, true] {
            let ledger = Arc::new(unikv_kernels::SyncLedger::cpu());
            let mut pool = pool_on(ledger.clone(), 4, zero);
            ledger.reset();
            let mut out = Vec::new();
            pool.alloc_extend(&[fresh(2, 0, None)], &mut out).unwrap();
            let fills = |l: &unikv_kernels::SyncLedger| {
                l.ops().iter().filter(|r| r.op == "fill_spans").count()
            };
            assert_eq!(fills(&ledger), usize::from(zero), "zero {zero}: a new page");
            ledger.reset();
            let last = out.last().copied();
            pool.alloc_extend(&[fresh(4, 2, last)], &mut out).unwrap();
            assert_eq!(fills(&ledger), 0, "zero {zero}: the page's free tail");
        }
    }

    /// A stack of free ids that breaks the room check's promise (the sink on it, two ids
    /// below its top) takes the page-by-page path: the ids above the sink are handed out
    /// a page at a time (a request's last page only as far as its length), bound on both
    /// sides, and the breach is recorded where the sink would have been popped.
    #[test]
    fn a_broken_id_stack_hands_out_up_to_the_breach_and_records_it() {
        let fresh = |seq_len: usize| ExtendRequest {
            prefix_len: 0,
            seq_len,
            last_token: None,
        };
        for ps in [1u32, 4] {
            let p = ps as usize;
            // One request of three pages; or one of a page and a token, then one of a page.
            let batches: [(Vec<ExtendRequest>, u32); 2] = [
                (vec![fresh(2 * p + 1)], ps),
                (vec![fresh(p + 1), fresh(p)], 1),
            ];
            for (requests, b_tokens) in batches {
                scoped_level(Level::Strict, || {
                    let mut pool = pool(ps);
                    let stack = pool.free_ids.stack();
                    let top = stack.len();
                    let (a, b) = (stack[top - 1], stack[top - 2]);
                    stack.insert(top - 2, 0);
                    let mut out = Vec::new();
                    pool.alloc_extend(&requests, &mut out).unwrap();
                    let page = |v: u32, n: u32| (0..n).map(move |o| VirtualToken(v * ps + o));
                    let want: Vec<VirtualToken> = page(a, ps).chain(page(b, b_tokens)).collect();
                    assert_eq!(out, want, "ps {ps} {requests:?}");
                    for v in [a, b] {
                        assert!(
                            KvAllocator::full_live(&pool, VirtualPage(v)),
                            "ps {ps}: v{v}"
                        );
                        assert_eq!(pool.swa_state(VirtualPage(v)), SwaState::Live, "ps {ps}");
                    }
                    assert_eq!(pool.scope.violations(&ROOM_CHECK), 1, "ps {ps}");
                });
            }
        }
    }
}

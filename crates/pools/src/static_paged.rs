//! `StaticSwa`: the static paged baseline. Fixed pools in one buffer, never moved: an
//! optional fixed pool of Mamba state slots, then an SWA pool and a FULL pool sized at
//! boot by a SWA:FULL token ratio, with a FULL→SWA index map. FULL pages are the virtual
//! pages (they never move); SWA pages are bound to them through the map (> 0 live, -1
//! tombstone, 0 unbound). Without an SWA side (a FULL/Mamba model) the SWA pool is empty
//! and allocations bind FULL only. Same operations and invariants as [`crate::UnifiedSwa`].
//!
//! Byte layout, low to high: `[sink floor | Mamba slots | SWA pool | FULL pool]`.
//!
//! This file holds the layout, the tables the free family works on and the
//! [`KvAllocator`] implementation; `alloc` is the allocation paths, `reference` the
//! reference engine's slot pool sizing.

mod alloc;
mod reference;

pub use reference::{
    PrefixCaching, REFERENCE_MAMBA_FULL_MEMORY_RATIO, REFERENCE_SLOTS_PER_RUNNING_REQUEST,
    ReferenceSlotPool, reference_slot_pool,
};

use crate::api::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, KvAllocator, MoveGate,
    PageDemand, PoolMap, ReclaimPlan, Reclaimable, Segment, SideCapacity, SpanInfo, SwaState,
};
use crate::error::Error;
use crate::frees::{self, FreeGroup, PageTables};
use crate::ids::{PageSize, VirtualPage, VirtualSlot, VirtualToken};
use crate::invariants::CONSERVATION;
use crate::memory::DeviceMemory;
use crate::resident::{resident_list, resident_table};
use crate::spec::{
    BS1_STATE_SLOTS, Grid, Side, SlotPoolSpec, SubPoolSpec, bs1_floor, check_bs1_floor,
    largest_total, sink_floor, window_pages,
};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use unikv_invariants::{Scope, enabled};
use unikv_kernels::{ByteSpan, BytesId, Device, SpanMove, TableId, TableScatter};

/// How to build a [`StaticSwa`].
#[derive(Clone, Debug)]
pub struct StaticSwaConfig {
    /// Bytes of the buffer every pool lives in.
    pub total_bytes: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// The sliding window, in tokens (sizes the batch-size-1 floor). Unused without an
    /// SWA side.
    pub window: u32,
    /// The FULL pool.
    pub full: SubPoolSpec,
    /// The SWA pool; `None` for a model without sliding-window layers (a FULL/Mamba
    /// hybrid such as Qwen3-Next): the SWA pool then has 0 pages and allocations bind
    /// FULL only.
    pub swa: Option<SubPoolSpec>,
    /// A fixed pool of Mamba state slots at the low end of the buffer, or `None` for a
    /// model without recurrent layers.
    pub mamba: Option<StaticSlots>,
    /// SWA tokens per FULL token (the reference engine's default is 0.8). Unused without
    /// an SWA side.
    pub swa_full_ratio: f64,
    /// Zero page and slot envelopes when they are handed out.
    pub zero_on_handout: bool,
}

/// A fixed pool of Mamba state slots: `slots` slots of `spec` (virtual slots
/// `1..=slots`; slot 0 is the sink). Size it with [`reference_slot_pool`] to match the
/// reference engine's default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaticSlots {
    /// One slot: one request's state across all recurrent layers.
    pub spec: SlotPoolSpec,
    /// Slots in the pool (at least [`BS1_STATE_SLOTS`]).
    pub slots: u32,
}

/// The fixed pools a buffer holds, in pages (slots for Mamba) and base pages of each
/// side's grid.
#[derive(Clone, Copy, Debug)]
struct Pools {
    full_pages: u64,
    swa_pages: u64,
    full_base: u64,
    swa_base: u64,
    /// Physical slot of virtual slot 1.
    slot_base: u64,
    /// Whether the slots fit in the buffer at all.
    slots_fit: bool,
}

/// The static paged allocator: fixed FULL, SWA and Mamba slot pools.
#[derive(Debug)]
pub struct StaticSwa {
    device: Arc<dyn Device>,
    /// Held for its drop: frees `buffer` and the mirror tables with the allocator.
    _memory: DeviceMemory,
    buffer: BytesId,
    ps: PageSize,
    full_grid: Grid,
    /// [`Grid::ABSENT`] without an SWA side.
    swa_grid: Grid,
    /// [`Grid::ABSENT`] without a slot pool.
    slot_grid: Grid,
    /// Whether the model has an SWA side.
    swa_side: bool,
    floor: u64,
    total_bytes: u64,
    /// FULL physical page of virtual page `v` is `full_base + v - 1`.
    full_base: u32,
    /// SWA physical pages are `swa_base .. swa_base + swa_pages`.
    swa_base: u32,
    full_pages: u32,
    swa_pages: u32,
    /// FULL liveness by virtual page.
    full_live: Vec<bool>,
    /// Free virtual pages (a stack).
    free_full: Vec<u32>,
    /// FULL→SWA map by virtual page: > 0 live SWA physical page, -1 tombstone, 0 none.
    swa_of: Vec<i32>,
    /// SWA physical page → virtual page (0 = free), indexed from `swa_base`.
    swa_owner: Vec<u32>,
    /// Free SWA physical pages (a stack).
    free_swa: Vec<u32>,
    swa_live: u32,
    tombstones: u32,
    /// Physical slot of virtual slot `s` is `slot_base + s - 1` (slots never move).
    slot_base: u32,
    /// Slots in the pool (0 without one).
    slots: u32,
    /// Slot liveness by virtual slot (`slots + 1` entries, the sink included).
    slot_live: Vec<bool>,
    /// Free virtual slots (a stack).
    free_slots: Vec<u32>,
    live_slots: u32,
    group: FreeGroup,
    /// Where this allocator's invariant breaches are counted (its cache's scope).
    scope: Scope,
    gates: Arc<AtomicUsize>,
    full_mirror: TableId,
    swa_mirror: Option<TableId>,
    slot_mirror: Option<TableId>,
    zero_on_handout: bool,
    /// Envelopes to zero before an allocation binds them (every pool, one `fill_spans`).
    spans: Vec<ByteSpan>,
    dirty: Vec<u32>,
    dirty_flag: Vec<bool>,
    /// Virtual slots whose mirror entry changed since the last upload.
    slot_dirty: Vec<u32>,
    slot_dirty_flag: Vec<bool>,
    entries: Vec<(u32, i32)>,
}

impl StaticSwa {
    /// Places the slot pool above the sink floor, then sizes the SWA and FULL pools from
    /// the ratio in the rest, and allocates the buffer and the mirror tables. A buffer that
    /// cannot hold the slots, the sink and one request's window on each KV side is
    /// [`Error::BufferTooSmall`] (stating the least size that can); a slot pool of fewer
    /// than [`BS1_STATE_SLOTS`] slots is [`Error::BadConfig`].
    pub fn new(device: Arc<dyn Device>, config: StaticSwaConfig) -> Result<StaticSwa, Error> {
        let ps = PageSize::new(config.page_size)
            .ok_or_else(|| Error::BadConfig("page size must be at least 1".into()))?;
        let swa_spec = config.swa.as_ref();
        if swa_spec.is_some() && !(config.swa_full_ratio > 0.0 && config.swa_full_ratio.is_finite())
        {
            return Err(Error::BadConfig(format!(
                "swa_full_ratio must be positive, got {}",
                config.swa_full_ratio
            )));
        }
        let slot_spec = config.mamba.as_ref().map(|m| &m.spec);
        let slots = config.mamba.as_ref().map_or(0, |m| m.slots);
        if config.mamba.is_some() && slots < BS1_STATE_SLOTS {
            return Err(Error::BadConfig(format!(
                "a slot pool of {slots} slots is below the batch-size-1 floor of {BS1_STATE_SLOTS} (one running state and two radix checkpoints)"
            )));
        }
        let total = config.total_bytes;
        let kv_specs: Vec<&SubPoolSpec> = std::iter::once(&config.full).chain(swa_spec).collect();
        let floor = sink_floor(&kv_specs, slot_spec, ps);
        let at_limit = |e: Error| e.at_layout_limit(largest_total(&kv_specs, slot_spec, ps));
        let full_grid = Grid::new(&config.full, ps, total, floor, "full").map_err(at_limit)?;
        let swa_grid = match swa_spec {
            Some(spec) => Grid::new(spec, ps, total, floor, "swa").map_err(at_limit)?,
            None => Grid::ABSENT,
        };
        let slot_grid = match slot_spec {
            Some(spec) => spec.grid(total, floor).map_err(at_limit)?,
            None => Grid::ABSENT,
        };
        let (ef, es, eslot) = (full_grid.envelope, swa_grid.envelope, slot_grid.envelope);
        let ratio = config.swa_full_ratio;
        // The pools a buffer of `bytes` holds: the slots from the slot grid's first page
        // above the floor; then, from the first SWA page above them, N_s = ratio × N_f SWA
        // pages; then N_f FULL pages from the next FULL page boundary, as many as fit.
        // Without SWA, FULL takes everything above the slots.
        let pools = |bytes: u64| -> Pools {
            let slot_base = if slot_spec.is_some() {
                floor.div_ceil(eslot).max(1)
            } else {
                0
            };
            let kv_start = floor.max((slot_base + slots as u64) * eslot);
            let slots_fit = kv_start <= bytes;
            if swa_spec.is_none() {
                let full_base = kv_start.div_ceil(ef).max(1);
                return Pools {
                    full_pages: (bytes / ef).saturating_sub(full_base),
                    swa_pages: 0,
                    full_base,
                    swa_base: 0,
                    slot_base,
                    slots_fit,
                };
            }
            let swa_base = kv_start.div_ceil(es).max(1);
            let start = swa_base * es;
            let usable = bytes.saturating_sub(start);
            let per_full = ef as f64 + ratio * es as f64;
            let layout = |nf: u64| {
                let ns = (nf as f64 * ratio) as u64;
                let full_base = (start + ns * es).div_ceil(ef);
                (ns, full_base, (full_base + nf).saturating_mul(ef) <= bytes)
            };
            // The FULL region's alignment costs less than one FULL envelope.
            let mut full_pages = (usable.saturating_sub(ef) as f64 / per_full) as u64;
            while full_pages > 0 && !layout(full_pages).2 {
                full_pages -= 1;
            }
            let (swa_pages, full_base, _) = layout(full_pages);
            Pools {
                full_pages,
                swa_pages,
                full_base,
                swa_base,
                slot_base,
                slots_fit,
            }
        };
        // Without SWA only one page of FULL is charged (the reference does not charge
        // FULL: its request length is clamped to the pool).
        let window = if swa_spec.is_some() { config.window } else { 0 };
        let window_pages = window_pages(ps, window);
        check_bs1_floor(
            total,
            bs1_floor(ps, swa_spec.map(|_| config.window), config.mamba.is_some()),
            |bytes| {
                let p = pools(bytes);
                p.slots_fit
                    && p.full_pages >= window_pages
                    && (swa_spec.is_none() || p.swa_pages >= window_pages)
            },
        )?;
        let p = pools(total);
        let (full_pages, swa_pages, full_base, swa_base, slot_base) = (
            p.full_pages as u32,
            p.swa_pages as u32,
            p.full_base as u32,
            p.swa_base as u32,
            p.slot_base as u32,
        );
        let virtual_pages = full_pages + 1;
        if virtual_pages as u64 * ps.get() as u64 > i32::MAX as u64 {
            return Err(Error::BadConfig(format!(
                "{virtual_pages} virtual pages × page size {ps} overflow i32 token ids"
            )));
        }
        let slot_ids = if slot_spec.is_some() { slots + 1 } else { 0 };
        let mut memory = DeviceMemory::new(device.clone());
        let buffer = memory.alloc_bytes(total, 0)?;
        let full_mirror = memory.alloc_table(virtual_pages as usize, 0)?;
        let swa_mirror = match swa_spec {
            Some(_) => Some(memory.alloc_table(virtual_pages as usize, 0)?),
            None => None,
        };
        let slot_mirror = match slot_spec {
            Some(_) => Some(memory.alloc_table(slot_ids as usize, 0)?),
            None => None,
        };
        Ok(StaticSwa {
            device,
            _memory: memory,
            buffer,
            ps,
            full_grid,
            swa_grid,
            slot_grid,
            swa_side: swa_spec.is_some(),
            floor,
            total_bytes: total,
            full_base,
            swa_base,
            full_pages,
            swa_pages,
            full_live: resident_table(virtual_pages as usize),
            free_full: (1..virtual_pages).rev().collect(),
            swa_of: resident_table(virtual_pages as usize),
            swa_owner: resident_table(swa_pages as usize),
            free_swa: (swa_base..swa_base + swa_pages).rev().collect(),
            swa_live: 0,
            tombstones: 0,
            slot_base,
            slots: if slot_spec.is_some() { slots } else { 0 },
            slot_live: resident_table(slot_ids as usize),
            free_slots: (1..slot_ids).rev().collect(),
            live_slots: 0,
            group: FreeGroup::new(virtual_pages),
            scope: Scope::new(),
            gates: Arc::new(AtomicUsize::new(0)),
            full_mirror,
            swa_mirror,
            slot_mirror,
            zero_on_handout: config.zero_on_handout,
            spans: Vec::new(),
            dirty: resident_list(virtual_pages as usize),
            dirty_flag: resident_table(virtual_pages as usize),
            slot_dirty: resident_list(slot_ids as usize),
            slot_dirty_flag: resident_table(slot_ids as usize),
            // Every table's entries of one upload: sized and mapped at boot.
            entries: {
                let n = 2 * virtual_pages as usize + slot_ids as usize;
                let mut entries = Vec::with_capacity(n);
                entries.resize(n, std::hint::black_box((0, 0)));
                entries.clear();
                entries
            },
        })
    }

    /// Slots of the fixed Mamba pool (0 without one).
    pub fn pool_slots(&self) -> u32 {
        self.slots
    }

    /// FULL pages and SWA pages of the two fixed pools.
    pub fn pool_pages(&self) -> (u32, u32) {
        (self.full_pages, self.swa_pages)
    }

    /// Mirror entries waiting for the upload (one list serves both page tables; slots
    /// have their own).
    fn mirror_pending(&self) -> usize {
        self.dirty.len() + self.slot_dirty.len()
    }

    #[inline]
    fn mark(&mut self, v: u32) {
        let flag = &mut self.dirty_flag[v as usize];
        if !*flag {
            *flag = true;
            self.dirty.push(v);
        }
    }

    #[inline]
    fn mark_slot(&mut self, s: u32) {
        let flag = &mut self.slot_dirty_flag[s as usize];
        if !*flag {
            *flag = true;
            self.slot_dirty.push(s);
        }
    }

    /// The physical slot of live virtual slot `s`.
    #[inline]
    fn slot_phys(&self, s: u32) -> u32 {
        self.slot_base + s - 1
    }
}

impl PageTables for StaticSwa {
    fn ps(&self) -> PageSize {
        self.ps
    }
    fn virtual_pages(&self) -> u32 {
        self.full_pages + 1
    }
    #[inline(always)]
    fn full_live(&self, v: u32) -> bool {
        self.full_live[v as usize]
    }
    #[inline(always)]
    fn swa_entry(&self, v: u32) -> i32 {
        self.swa_of[v as usize]
    }
    #[inline(always)]
    fn release_swa(&mut self, v: u32, tombstone: bool) {
        let s = self.swa_of[v as usize] as u32;
        self.swa_owner[(s - self.swa_base) as usize] = 0;
        self.free_swa.push(s);
        self.swa_live -= 1;
        self.swa_of[v as usize] = if tombstone { -1 } else { 0 };
        self.tombstones += tombstone as u32;
        self.mark(v);
    }
    #[inline(always)]
    fn release_full(&mut self, v: u32) {
        self.full_live[v as usize] = false;
        if self.swa_of[v as usize] == -1 {
            self.swa_of[v as usize] = 0;
            self.tombstones -= 1;
        }
        self.mark(v);
        self.free_full.push(v);
    }
    /// One pass with the same effect, in the same order, as `release_page_silently` page
    /// by page: the lists are written through slices reserved up front (a few stores per
    /// page instead of three `Vec::push`es), and the counters are settled once.
    fn release_pages(&mut self, pages: &[u32]) {
        let n = pages.len();
        let StaticSwa {
            full_live,
            swa_of,
            swa_owner,
            free_full,
            free_swa,
            dirty,
            dirty_flag,
            swa_live,
            tombstones,
            swa_base,
            ..
        } = self;
        let swa_base = *swa_base;
        let (full_base, swa_free_base, dirty_base) = (free_full.len(), free_swa.len(), dirty.len());
        free_full.resize(full_base + n, 0);
        free_swa.resize(swa_free_base + n, 0);
        dirty.resize(dirty_base + n, 0);
        let (new_full, new_swa, new_dirty) = (
            &mut free_full[full_base..],
            &mut free_swa[swa_free_base..],
            &mut dirty[dirty_base..],
        );
        let (full_live, swa_of, swa_owner, flags) = (
            &mut full_live[..],
            &mut swa_of[..],
            &mut swa_owner[..],
            &mut dirty_flag[..],
        );
        let (mut freed, mut swa_freed, mut marked, mut cleared) = (0usize, 0usize, 0usize, 0u32);
        for &v in pages {
            if v == 0 || !full_live[v as usize] {
                continue;
            }
            let entry = &mut swa_of[v as usize];
            if *entry > 0 {
                // `release_swa(v, false)`.
                swa_owner[(*entry as u32 - swa_base) as usize] = 0;
                new_swa[swa_freed] = *entry as u32;
                swa_freed += 1;
            } else if *entry == -1 {
                // `release_full` clears the tombstone.
                cleared += 1;
            }
            *entry = 0;
            // `release_full(v)`.
            full_live[v as usize] = false;
            new_full[freed] = v;
            freed += 1;
            // `mark(v)` (both releases mark the same page; the second is a no-op).
            let flag = &mut flags[v as usize];
            new_dirty[marked] = v;
            marked += !*flag as usize;
            *flag = true;
        }
        free_full.truncate(full_base + freed);
        free_swa.truncate(swa_free_base + swa_freed);
        dirty.truncate(dirty_base + marked);
        *swa_live -= swa_freed as u32;
        *tombstones -= cleared;
    }
    fn move_swa(&mut self, from: u32, to: u32) {
        let s = self.swa_of[from as usize];
        self.swa_of[to as usize] = s;
        self.swa_owner[(s as u32 - self.swa_base) as usize] = to;
        self.swa_of[from as usize] = -1;
        self.mark(from);
        self.mark(to);
    }
    fn has_swa(&self) -> bool {
        self.swa_side
    }
    fn slot_ids(&self) -> u32 {
        self.slot_live.len() as u32
    }
    fn slot_live(&self, s: u32) -> bool {
        self.slot_live[s as usize]
    }
    fn release_slot(&mut self, s: u32) {
        self.slot_live[s as usize] = false;
        self.live_slots -= 1;
        self.free_slots.push(s);
        self.mark_slot(s);
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
}

impl frees::SlotCopy for StaticSwa {
    /// One `move_spans` of whole slot envelopes. A copy, not a move: the sources stay
    /// bound and intact (`frees::copy_slots` checked that no destination is a source or
    /// named twice, which is also what `move_spans` requires).
    fn issue_slot_copies(&self, pairs: &[(VirtualSlot, VirtualSlot)]) -> Result<(), Error> {
        let grid = self.slot_grid;
        let moves: Vec<SpanMove> = pairs
            .iter()
            .map(|&(src, dst)| SpanMove {
                src: grid.offset(self.slot_phys(src.0)),
                dst: grid.offset(self.slot_phys(dst.0)),
                len: grid.envelope,
            })
            .collect();
        self.device.move_spans(self.buffer, &moves)?;
        Ok(())
    }
}

impl KvAllocator for StaticSwa {
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
        self.full_pages + 1
    }

    crate::frees::free_family_methods!();

    fn alloc_slots(&mut self, n: usize, out: &mut Vec<VirtualSlot>) -> Result<(), Error> {
        self.alloc_slot_ids(n, out)
    }

    fn flush(&mut self) -> Result<FlushReport, Error> {
        let deferred_flushed = frees::flush_deferred(self);
        if enabled() {
            self.check_conservation();
        }
        Ok(FlushReport {
            deferred_flushed,
            pages_moved: 0,
            gated: false,
        })
    }

    fn allocation_fits(&self, demand: PageDemand) -> bool {
        // Without a slot pool a slot demand never fits (no free slots).
        self.fits(demand, 0, 0) && self.fits_slots(demand, 0)
    }

    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        if demand.mamba_slots > 0 && self.slot_mirror.is_none() {
            return Err(Error::NoSlotPool {
                op: "ensure_capacity",
            });
        }
        frees::flush_deferred(self);
        if !self.fits(demand, 0, 0) {
            return Err(Error::OutOfCapacity {
                full_pages: demand.full_pages,
                swa_pages: demand.swa_pages,
                available_pages: self.joint_free(),
            });
        }
        if !self.fits_slots(demand, 0) {
            return Err(self.out_of_slots());
        }
        Ok(())
    }

    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        if demand.mamba_slots > 0 && self.slot_mirror.is_none() {
            // No slot pool: no eviction makes a slot demand fit (and nothing is flushed).
            return None;
        }
        // Deferred frees first: bytes waiting in any list must be visible before sizing.
        frees::flush_deferred(self);
        let rf_max = evictable
            .full_pages
            .min(self.full_pages as usize - self.free_full.len());
        let rs_max = evictable.swa_pages.min(self.swa_live as usize);
        let rm_max = evictable.mamba_slots.min(self.live_slots as usize);
        if !self.fits(demand, rf_max, rs_max) || !self.fits_slots(demand, rm_max) {
            return None;
        }
        // The pools are separate: no side's reclaim depends on another's.
        let full_pages = demand.full_pages.saturating_sub(self.free_full.len());
        Some(ReclaimPlan {
            swa_pages: if self.swa_side {
                demand.swa_pages.saturating_sub(self.free_swa.len())
            } else {
                0
            },
            full_pages,
            mamba_slots: demand.mamba_slots.saturating_sub(self.free_slots.len()),
            full_floor_pages: full_pages,
        })
    }

    fn capacity(&self) -> Capacity {
        let full_alloc = self.full_pages as usize - self.free_full.len();
        let joint = self.joint_free();
        Capacity {
            page_size: self.ps.get(),
            full: SideCapacity {
                available_pages: self.free_full.len(),
                schedulable_pages: self.free_full.len(),
                allocated_pages: full_alloc,
                total_pages: self.full_pages as usize,
                hole_pages: 0,
                tombstones: 0,
            },
            swa: SideCapacity {
                available_pages: self.free_swa.len(),
                schedulable_pages: self.free_swa.len(),
                allocated_pages: self.swa_live as usize,
                total_pages: self.swa_pages as usize,
                hole_pages: 0,
                tombstones: self.tombstones as usize,
            },
            mamba: SideCapacity {
                available_pages: self.free_slots.len(),
                schedulable_pages: self.free_slots.len(),
                allocated_pages: self.live_slots as usize,
                total_pages: self.slots as usize,
                hole_pages: 0,
                tombstones: 0,
            },
            // The static pools share no bytes: a slot costs no KV tokens.
            slot_price_tokens: 0,
            joint_available_pages: joint,
            joint_schedulable_pages: joint,
        }
    }

    fn pool_map(&self) -> PoolMap {
        let full_live = self.full_pages as usize - self.free_full.len();
        let mut spans = Vec::with_capacity(3);
        if self.slot_mirror.is_some() {
            spans.push(SpanInfo {
                side: Side::Mamba,
                bytes: self.region(Side::Mamba),
                envelope: self.slot_grid.envelope,
                pages: self.slots as usize,
                live: self.live_slots as usize,
                holes: 0,
                tombstones: 0,
            });
        }
        if self.swa_side {
            spans.push(SpanInfo {
                side: Side::Swa,
                bytes: self.region(Side::Swa),
                envelope: self.swa_grid.envelope,
                pages: self.swa_pages as usize,
                live: self.swa_live as usize,
                holes: 0,
                tombstones: self.tombstones as usize,
            });
        }
        spans.push(SpanInfo {
            side: Side::Full,
            bytes: self.region(Side::Full),
            envelope: self.full_grid.envelope,
            pages: self.full_pages as usize,
            live: full_live,
            holes: 0,
            tombstones: 0,
        });
        PoolMap {
            layout: "static",
            page_size: self.ps.get(),
            total_bytes: self.total_bytes,
            sink_floor: self.floor,
            spans,
        }
    }

    fn move_gate(&self) -> MoveGate {
        // Static pages never move; the gate is honoured trivially.
        MoveGate::close(&self.gates)
    }

    fn upload_mirror(&mut self) -> Result<(), Error> {
        if self.mirror_pending() == 0 {
            return Ok(());
        }
        // FULL's entry follows liveness too (unbound reads as the sink, as in the unified
        // layout), so one dirty list serves both page tables; slots have their own (a
        // slot's entry is its fixed physical slot while live, else the sink). Every entry
        // stays dirty until every scatter was issued, so a failed upload is retried whole.
        // Exact-size extends: no capacity check per entry.
        let (full_live, full_base, swa_of) = (&self.full_live, self.full_base, &self.swa_of);
        let n = self.dirty.len();
        self.entries.clear();
        self.entries.extend(self.dirty.iter().map(|&v| {
            let full = if full_live[v as usize] {
                (full_base + v - 1) as i32
            } else {
                0
            };
            (v, full)
        }));
        if self.swa_side {
            self.entries
                .extend(self.dirty.iter().map(|&v| (v, swa_of[v as usize])));
        }
        let (slot_live, slot_base) = (&self.slot_live, self.slot_base);
        self.entries.extend(self.slot_dirty.iter().map(|&s| {
            let phys = if slot_live[s as usize] {
                (slot_base + s - 1) as i32
            } else {
                0
            };
            (s, phys)
        }));
        let (full, rest) = self.entries.split_at(n);
        let (swa, slots) = rest.split_at(if self.swa_side { n } else { 0 });
        // One op for every table that changed.
        let mirrors = [Some(self.full_mirror), self.swa_mirror, self.slot_mirror];
        let mut scatters = [TableScatter {
            table: self.full_mirror,
            entries: &[],
        }; 3];
        let mut k = 0;
        for (table, entries) in mirrors.into_iter().zip([full, swa, slots]) {
            if let Some(table) = table
                && !entries.is_empty()
            {
                scatters[k] = TableScatter { table, entries };
                k += 1;
            }
        }
        if k > 0 {
            self.device.scatter_tables(&scatters[..k])?;
        }
        let flags = &mut self.dirty_flag;
        for &v in &self.dirty {
            flags[v as usize] = false;
        }
        self.dirty.clear();
        let flags = &mut self.slot_dirty_flag;
        for &s in &self.slot_dirty {
            flags[s as usize] = false;
        }
        self.slot_dirty.clear();
        Ok(())
    }

    fn mirror_table(&self, side: Side) -> Option<TableId> {
        match side {
            Side::Full => Some(self.full_mirror),
            Side::Swa => self.swa_mirror,
            Side::Mamba => self.slot_mirror,
        }
    }

    fn stride(&self, side: Side) -> u32 {
        self.grid(side).stride
    }

    fn kernel_id(&self, side: Side, token: VirtualToken) -> i32 {
        // Slots are not addressed by virtual tokens: their ids come from `physical_slot`
        // (or a Mamba translate).
        if side == Side::Mamba {
            return 0;
        }
        match self.physical_page(side, token.page(self.ps)) {
            Some(p) if token.0 != 0 => {
                p as i32 * self.stride(side) as i32 + token.offset(self.ps) as i32
            }
            _ => 0,
        }
    }

    fn grid(&self, side: Side) -> Grid {
        match side {
            Side::Full => self.full_grid,
            Side::Swa => self.swa_grid,
            Side::Mamba => self.slot_grid,
        }
    }

    fn sink_floor(&self) -> u64 {
        self.floor
    }

    fn physical_page(&self, side: Side, page: VirtualPage) -> Option<u32> {
        let v = page.0 as usize;
        match side {
            Side::Full => {
                (v != 0 && *self.full_live.get(v)?).then(|| self.full_base + v as u32 - 1)
            }
            Side::Swa => self.swa_of.get(v).filter(|&&p| p > 0).map(|&p| p as u32),
            Side::Mamba => None,
        }
    }

    fn physical_slot(&self, slot: VirtualSlot) -> Option<u32> {
        let s = slot.0;
        (s != 0 && *self.slot_live.get(s as usize)?).then(|| self.slot_phys(s))
    }

    fn full_live(&self, page: VirtualPage) -> bool {
        self.full_live
            .get(page.0 as usize)
            .copied()
            .unwrap_or(false)
    }

    fn swa_state(&self, page: VirtualPage) -> SwaState {
        match self.swa_of.get(page.0 as usize) {
            Some(&p) if p > 0 => SwaState::Live,
            Some(-1) => SwaState::Tombstone,
            _ => SwaState::Unbound,
        }
    }

    fn check_conservation(&self) -> bool {
        // Saturating: a free list longer than the pool is a breach to report, not a panic.
        let full_live = (self.full_pages as usize).saturating_sub(self.free_full.len());
        let (mamba, swa, full) = (
            self.region(Side::Mamba),
            self.region(Side::Swa),
            self.region(Side::Full),
        );
        let holds = self.free_swa.len() + self.swa_live as usize == self.swa_pages as usize
            && self.free_full.len() <= self.full_pages as usize
            && (self.swa_live + self.tombstones) as usize <= full_live
            && self.free_slots.len() + self.live_slots as usize == self.slots as usize
            && (self.slots == 0 || self.floor <= mamba.0)
            && mamba.1 <= swa.0.max(full.0)
            && swa.1 <= full.0
            && full.1 <= self.total_bytes;
        self.scope.expect(&CONSERVATION, holds, || {
            format!(
                "static: full {} free of {}; swa {} live {} free of {}; {} tombstones; slots {} live {} free of {}",
                self.free_full.len(),
                self.full_pages,
                self.swa_live,
                self.free_swa.len(),
                self.swa_pages,
                self.tombstones,
                self.live_slots,
                self.free_slots.len(),
                self.slots
            )
        })
    }

    fn verify(&self) -> Result<(), String> {
        if !self.check_conservation() {
            return Err("conservation does not hold".into());
        }
        if self.full_live[0] || self.swa_of[0] != 0 {
            return Err("the sink is bound".into());
        }
        let mut free = self.free_full.clone();
        free.sort_unstable();
        if free.windows(2).any(|w| w[0] == w[1]) || free.first() == Some(&0) {
            return Err("free FULL list holds a duplicate or the sink".into());
        }
        if let Some(&v) = free.iter().find(|&&v| self.full_live[v as usize]) {
            return Err(format!("free FULL page v{v} is live"));
        }
        let live = self.full_live.iter().filter(|&&l| l).count();
        if live + free.len() != self.full_pages as usize {
            return Err(format!(
                "{live} live + {} free FULL pages != {}",
                free.len(),
                self.full_pages
            ));
        }
        let mut free_swa = self.free_swa.clone();
        free_swa.sort_unstable();
        if free_swa.windows(2).any(|w| w[0] == w[1]) {
            return Err("free SWA list holds a duplicate".into());
        }
        if let Some(&s) = free_swa
            .iter()
            .find(|&&s| self.swa_owner[(s - self.swa_base) as usize] != 0)
        {
            return Err(format!("free SWA page {s} is owned"));
        }
        let (mut swa_live, mut tomb) = (0, 0);
        for (v, &s) in self.swa_of.iter().enumerate() {
            if s > 0 {
                swa_live += 1;
                if self.swa_owner[(s as u32 - self.swa_base) as usize] != v as u32 {
                    return Err(format!("v{v} → swa {s} whose owner differs"));
                }
            } else if s == -1 {
                tomb += 1;
            }
            if s != 0 && !self.full_live[v] {
                return Err(format!("v{v} has SWA entry {s} without live FULL"));
            }
        }
        if swa_live != self.swa_live || tomb != self.tombstones {
            return Err(format!(
                "{swa_live} SWA live and {tomb} tombstones in the map, counters say {} and {}",
                self.swa_live, self.tombstones
            ));
        }
        if !self.swa_side && (self.swa_pages != 0 || swa_live != 0 || tomb != 0) {
            return Err("an allocator without SWA binds SWA pages".into());
        }
        self.verify_slots()
    }
}

impl StaticSwa {
    /// The byte range `[low, high)` of a side's fixed pool (empty at the pool's base when
    /// the side is absent).
    fn region(&self, side: Side) -> (u64, u64) {
        let (grid, base, pages) = match side {
            Side::Full => (self.full_grid, self.full_base, self.full_pages),
            Side::Swa => (self.swa_grid, self.swa_base, self.swa_pages),
            Side::Mamba => (self.slot_grid, self.slot_base, self.slots),
        };
        (grid.offset(base), grid.offset(base + pages))
    }

    /// The slot half of [`KvAllocator::verify`]: the free stack and the liveness table
    /// agree with each other and with the counter, and the sink is never live.
    fn verify_slots(&self) -> Result<(), String> {
        if self.slot_live.first() == Some(&true) {
            return Err("the sink slot is live".into());
        }
        let mut free = self.free_slots.clone();
        free.sort_unstable();
        if free.windows(2).any(|w| w[0] == w[1]) || free.first() == Some(&0) {
            return Err("free slot list holds a duplicate or the sink".into());
        }
        if let Some(&s) = free.iter().find(|&&s| self.slot_live[s as usize]) {
            return Err(format!("free slot s{s} is live"));
        }
        let live = self.slot_live.iter().filter(|&&l| l).count();
        if live != self.live_slots as usize || live + free.len() != self.slots as usize {
            return Err(format!(
                "{live} live + {} free slots != {} (counter says {} live)",
                free.len(),
                self.slots,
                self.live_slots
            ));
        }
        if let Some(&s) = self
            .slot_dirty
            .iter()
            .find(|&&s| !self.slot_dirty_flag[s as usize])
        {
            return Err(format!("dirty slot s{s} is not flagged"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unikv_kernels::CpuDevice;

    fn pool() -> StaticSwa {
        StaticSwa::new(Arc::new(CpuDevice::new()), config()).unwrap()
    }

    /// A pool with a FULL, an SWA and a slot side, one FULL page and one slot bound.
    fn full_pool() -> StaticSwa {
        let mut p = StaticSwa::new(Arc::new(CpuDevice::new()), config_with_slots()).unwrap();
        one_page(&mut p);
        let mut slots = Vec::new();
        p.alloc_slots(1, &mut slots).unwrap();
        assert_eq!(p.verify(), Ok(()));
        p
    }

    /// Allocates one fresh page (four tokens).
    fn one_page(p: &mut StaticSwa) {
        let request = ExtendRequest {
            prefix_len: 0,
            seq_len: 4,
            last_token: None,
        };
        p.alloc_extend(&[request], &mut Vec::new()).unwrap();
    }

    /// [`config`] with four state slots and room for them.
    fn config_with_slots() -> StaticSwaConfig {
        StaticSwaConfig {
            total_bytes: 1 << 17,
            mamba: Some(StaticSlots {
                spec: crate::SlotPoolSpec {
                    name: "mamba",
                    layers: 1,
                    bytes_per_slot: 64,
                },
                slots: 4,
            }),
            ..config()
        }
    }

    fn config() -> StaticSwaConfig {
        StaticSwaConfig {
            total_bytes: 1 << 16,
            page_size: 4,
            window: 8,
            full: SubPoolSpec::mha("full", 2, 1, 4, 2),
            swa: Some(SubPoolSpec::mha("swa", 2, 2, 4, 2)),
            mamba: None,
            swa_full_ratio: 1.0,
            zero_on_handout: false,
        }
    }

    /// Each clause of the conservation equation is checked on its own: breaking any one
    /// counter or region bound fails it, while the others still hold.
    #[test]
    fn each_conservation_clause_fails_on_its_own() {
        type Corruption = (&'static str, fn(&mut StaticSwa));
        let corruptions: [Corruption; 8] = [
            ("swa free + live", |p| p.swa_live += 1),
            ("full free list longer than the pool", |p| {
                p.free_full.extend(0..p.full_pages + 1)
            }),
            ("swa live + tombstones within full live", |p| {
                p.tombstones += 2
            }),
            ("slots free + live", |p| p.live_slots += 1),
            ("slots above the floor", |p| p.floor = u64::MAX),
            ("slots below swa and full", |p| p.slots += 1 << 20),
            ("swa below full", |p| p.swa_pages += 1 << 20),
            ("full inside the buffer", |p| p.total_bytes = 0),
        ];
        for (clause, corrupt) in corruptions {
            let mut p = full_pool();
            assert!(p.check_conservation(), "{clause}: clean");
            corrupt(&mut p);
            assert!(!p.check_conservation(), "{clause}: not caught");
        }
    }

    /// The full scan names each kind of corruption that the counters alone do not show.
    #[test]
    fn verify_names_each_corruption_the_counters_miss() {
        let mut p = full_pool();
        p.full_live[0] = true;
        p.free_full.retain(|_| true);
        assert_eq!(p.verify(), Err("the sink is bound".to_string()));

        let mut p = full_pool();
        let v = (1..p.swa_of.len()).find(|&v| p.full_live[v]).unwrap();
        let s = p.swa_of[v];
        // A tombstone the counter does not know: the map says one, the counter none.
        p.swa_owner[(s as u32 - p.swa_base) as usize] = 0;
        p.free_swa.push(s as u32);
        p.swa_of[v] = -1;
        p.swa_live -= 1;
        assert_eq!(
            p.verify(),
            Err("0 SWA live and 1 tombstones in the map, counters say 0 and 0".to_string())
        );

        let mut p = full_pool();
        p.slot_live[0] = true;
        assert_eq!(p.verify(), Err("the sink slot is live".to_string()));

        // The sink on the free slot list, in place of a free slot: the counts balance.
        let mut p = full_pool();
        let last = p.free_slots.len() - 1;
        p.free_slots[last] = 0;
        assert_eq!(
            p.verify(),
            Err("free slot list holds a duplicate or the sink".to_string())
        );
    }

    /// A mirror upload with nothing changed issues no device op.
    #[test]
    fn an_upload_with_nothing_dirty_issues_nothing() {
        let ledger = Arc::new(unikv_kernels::SyncLedger::cpu());
        let mut p = StaticSwa::new(ledger.clone(), config()).unwrap();
        p.upload_mirror().unwrap();
        ledger.reset();
        p.upload_mirror().unwrap();
        assert_eq!(ledger.op_count(), 0, "{:?}", ledger.ops());
    }

    /// Dropping the allocator frees its buffer and every mirror table.
    #[test]
    fn dropping_the_allocator_frees_its_device_memory() {
        let ledger = Arc::new(unikv_kernels::SyncLedger::cpu());
        let p = StaticSwa::new(ledger.clone(), config_with_slots()).unwrap();
        ledger.reset();
        drop(p);
        let frees: Vec<&str> = ledger.ops().iter().map(|r| r.op).collect();
        assert_eq!(
            frees,
            ["free_bytes", "free_table", "free_table", "free_table"]
        );
    }

    /// An allocator without an SWA side that still holds an SWA tombstone is caught.
    #[test]
    fn a_pool_without_swa_that_binds_swa_is_caught() {
        let mut p = StaticSwa::new(
            Arc::new(CpuDevice::new()),
            StaticSwaConfig {
                swa: None,
                ..config()
            },
        )
        .unwrap();
        one_page(&mut p);
        let v = (1..p.swa_of.len()).find(|&v| p.full_live[v]).unwrap();
        let clean = (p.swa_pages, p.free_swa.clone(), p.swa_owner.clone());
        p.swa_of[v] = -1;
        p.tombstones = 1;
        assert_eq!(
            p.verify(),
            Err("an allocator without SWA binds SWA pages".to_string())
        );
        // Or one that claims an SWA pool, free and unowned, with nothing bound.
        p.swa_of[v] = 0;
        p.tombstones = 0;
        p.swa_pages = 1;
        p.free_swa.push(p.swa_base);
        p.swa_owner = vec![0];
        assert_eq!(
            p.verify(),
            Err("an allocator without SWA binds SWA pages".to_string())
        );
        (p.swa_pages, p.free_swa, p.swa_owner) = clean;
        assert_eq!(p.verify(), Ok(()));
    }

    /// The full scan finds a free FULL list that repeats a page or holds the sink, even
    /// when the counts still balance.
    #[test]
    fn verify_finds_a_repeated_or_sink_entry_in_the_free_list() {
        let clean = pool();
        assert_eq!(clean.verify(), Ok(()));
        for corrupt in [|f: &mut Vec<u32>| f[0] = f[1], |f: &mut Vec<u32>| f[0] = 0] {
            let mut p = pool();
            corrupt(&mut p.free_full);
            assert_eq!(
                p.verify(),
                Err("free FULL list holds a duplicate or the sink".to_string())
            );
        }
    }
}

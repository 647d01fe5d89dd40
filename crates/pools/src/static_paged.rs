//! `StaticSwa`: the static paged FULL/SWA baseline. Two fixed pools in the same buffer,
//! sized at boot by a SWA:FULL token ratio, and a FULL→SWA index map. FULL pages are the
//! virtual pages (they never move); SWA pages are bound to them through the map (> 0
//! live, -1 tombstone, 0 unbound). Same operations and invariants as [`crate::UnifiedSwa`].

use crate::api::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, KvAllocator, MoveGate,
    PageDemand, PoolMap, ReclaimPlan, Reclaimable, Segment, SideCapacity, SpanInfo, SwaState,
};
use crate::error::Error;
use crate::frees::{self, FreeGroup, PageTables};
use crate::ids::{PageSize, VirtualPage, VirtualToken};
use crate::invariants::{CONSERVATION, ROOM_CHECK};
use crate::spec::{Grid, Side, SubPoolSpec, bs1_floor, check_bs1_floor, sink_floor, window_pages};
use crate::sub::{resident_list, resident_table};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use unikv_invariants::{Scope, enabled};
use unikv_kernels::{ByteSpan, BytesId, Device, TableId, Translate};

/// How to build a [`StaticSwa`].
#[derive(Clone, Debug)]
pub struct StaticSwaConfig {
    /// Bytes of the buffer both pools live in.
    pub total_bytes: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// The sliding window, in tokens (sizes the batch-size-1 floor).
    pub window: u32,
    /// The FULL pool.
    pub full: SubPoolSpec,
    /// The SWA pool.
    pub swa: SubPoolSpec,
    /// SWA tokens per FULL token (the reference engine's default is 0.8).
    pub swa_full_ratio: f64,
    /// Zero page envelopes when they are handed out.
    pub zero_on_handout: bool,
}

/// The static paged FULL/SWA allocator.
#[derive(Debug)]
pub struct StaticSwa {
    device: Arc<dyn Device>,
    buffer: BytesId,
    ps: PageSize,
    full_grid: Grid,
    swa_grid: Grid,
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
    group: FreeGroup,
    /// Where this allocator's invariant breaches are counted (its cache's scope).
    scope: Scope,
    gates: Arc<AtomicUsize>,
    mirrors: [TableId; 2],
    zero_on_handout: bool,
    /// Envelopes to zero before an allocation binds them (both pools, one `fill_spans`).
    spans: Vec<ByteSpan>,
    dirty: Vec<u32>,
    dirty_flag: Vec<bool>,
    entries: Vec<(u32, i32)>,
}

impl StaticSwa {
    /// Sizes the two pools from the ratio and allocates the buffer and the mirror tables.
    pub fn new(device: Arc<dyn Device>, config: StaticSwaConfig) -> Result<StaticSwa, Error> {
        let ps = PageSize::new(config.page_size)
            .ok_or_else(|| Error::BadConfig("page size must be at least 1".into()))?;
        if !(config.swa_full_ratio > 0.0 && config.swa_full_ratio.is_finite()) {
            return Err(Error::BadConfig(format!(
                "swa_full_ratio must be positive, got {}",
                config.swa_full_ratio
            )));
        }
        let total = config.total_bytes;
        let floor = sink_floor(&[&config.full, &config.swa], None, ps);
        let full_grid = Grid::new(&config.full, ps, total, floor, "full")?;
        let swa_grid = Grid::new(&config.swa, ps, total, floor, "swa")?;
        let (ef, es) = (full_grid.envelope, swa_grid.envelope);
        let ratio = config.swa_full_ratio;
        // The two pools a buffer of `bytes` holds: N_f FULL pages from the FULL grid's
        // first page above the floor, then N_s = ratio × N_f SWA pages (aligned to the SWA
        // grid), as many as fit. Returns `(N_f, N_s, SWA base page, FULL base page)`.
        let pools = |bytes: u64| -> Result<(u64, u64, u64, u32), Error> {
            let full_base = Grid::new(&config.full, ps, bytes, floor, "full")?.min_page;
            Grid::new(&config.swa, ps, bytes, floor, "swa")?;
            let start = full_grid.offset(full_base);
            let usable = bytes.saturating_sub(start);
            let per_full = ef as f64 + ratio * es as f64;
            let layout = |nf: u64| {
                let ns = (nf as f64 * ratio) as u64;
                let swa_base = (start + nf * ef).div_ceil(es);
                (ns, swa_base, (swa_base + ns).saturating_mul(es) <= bytes)
            };
            let mut full_pages = (usable.saturating_sub(es) as f64 / per_full) as u64;
            while full_pages > 0 && !layout(full_pages).2 {
                full_pages -= 1;
            }
            let (swa_pages, swa_base, _) = layout(full_pages);
            Ok((full_pages, swa_pages, swa_base, full_base))
        };
        let window_pages = window_pages(ps, config.window);
        check_bs1_floor(total, bs1_floor(ps, Some(config.window), false), |bytes| {
            pools(bytes).is_ok_and(|(nf, ns, ..)| nf >= window_pages && ns >= window_pages)
        })?;
        let (full_pages, swa_pages, swa_base, full_base) = pools(total)?;
        let (full_pages, swa_pages, swa_base) =
            (full_pages as u32, swa_pages as u32, swa_base as u32);
        let virtual_pages = full_pages + 1;
        if virtual_pages as u64 * ps.get() as u64 > i32::MAX as u64 {
            return Err(Error::BadConfig(format!(
                "{virtual_pages} virtual pages × page size {ps} overflow i32 token ids"
            )));
        }
        let buffer = device.alloc_bytes(total, 0)?;
        let full_mirror = device.alloc_table(virtual_pages as usize, 0)?;
        let swa_mirror = device.alloc_table(virtual_pages as usize, 0)?;
        Ok(StaticSwa {
            device,
            buffer,
            ps,
            full_grid,
            swa_grid,
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
            group: FreeGroup::new(virtual_pages),
            scope: Scope::new(),
            gates: Arc::new(AtomicUsize::new(0)),
            mirrors: [full_mirror, swa_mirror],
            zero_on_handout: config.zero_on_handout,
            spans: Vec::new(),
            dirty: resident_list(virtual_pages as usize),
            dirty_flag: resident_table(virtual_pages as usize),
            // Both tables' entries of one upload: sized and mapped at boot.
            entries: {
                let n = 2 * virtual_pages as usize;
                let mut entries = Vec::with_capacity(n);
                entries.resize(n, std::hint::black_box((0, 0)));
                entries.clear();
                entries
            },
        })
    }

    /// FULL pages and SWA pages of the two fixed pools.
    pub fn pool_pages(&self) -> (u32, u32) {
        (self.full_pages, self.swa_pages)
    }

    /// Mirror entries waiting for the upload (one list serves both tables).
    fn mirror_pending(&self) -> usize {
        self.dirty.len()
    }

    #[inline]
    fn mark(&mut self, v: u32) {
        let flag = &mut self.dirty_flag[v as usize];
        if !*flag {
            *flag = true;
            self.dirty.push(v);
        }
    }

    fn fits(&self, d: PageDemand, r_f: usize, r_s: usize) -> bool {
        d.full_pages <= self.free_full.len().saturating_add(r_f)
            && d.swa_pages <= self.free_swa.len().saturating_add(r_s)
    }

    fn validate(&self, requests: impl Iterator<Item = ExtendRequest>) -> Result<usize, Error> {
        let ps = self.ps;
        let mut totals = (0usize, 0usize);
        for (index, r) in requests.enumerate() {
            frees::check_request(index, &r, ps, &mut totals)?;
            if !ps.is_aligned(r.prefix_len) {
                let ok = r.last_token.is_some_and(|last| {
                    let v = last.page(ps).0 as usize;
                    last.offset(ps) as usize == (r.prefix_len - 1) % ps.get() as usize
                        && v != 0
                        && v < self.full_live.len()
                        && self.full_live[v]
                });
                if !ok {
                    return Err(Error::BadRequest {
                        index,
                        reason: format!(
                            "last token {:?} is not a live token at row position {}",
                            r.last_token,
                            r.prefix_len - 1
                        ),
                    });
                }
            }
        }
        Ok(totals.0)
    }

    /// An allocation as one transaction: validate, size the room, zero the envelopes
    /// the pops will hand out (the tops of the two free stacks) on the device, and only
    /// then bind. A failed zeroing changes nothing.
    fn alloc(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest> + Clone,
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        let pages = self.validate(requests.clone())?;
        if !self.fits(PageDemand::joint(pages), 0, 0) {
            return Err(Error::OutOfCapacity {
                full_pages: pages,
                swa_pages: pages,
                available_pages: self.free_full.len().min(self.free_swa.len()),
            });
        }
        if self.zero_on_handout && pages > 0 {
            let (fg, sg, full_base) = (self.full_grid, self.swa_grid, self.full_base);
            let spans = &mut self.spans;
            spans.clear();
            // `fits` checked both stacks hold `pages` entries; pops take the last first.
            let full = &self.free_full[self.free_full.len() - pages..];
            let swa = &self.free_swa[self.free_swa.len() - pages..];
            spans.extend(full.iter().rev().map(|&v| ByteSpan {
                offset: fg.offset(full_base + v - 1),
                len: fg.envelope,
            }));
            spans.extend(swa.iter().rev().map(|&s| ByteSpan {
                offset: sg.offset(s),
                len: sg.envelope,
            }));
            self.device.fill_spans(self.buffer, spans, 0)?;
        }
        let ps = self.ps.get() as usize;
        for r in requests {
            let mut pos = r.prefix_len;
            if pos % ps != 0
                && let Some(last) = r.last_token
            {
                let tail_end = (pos - pos % ps + ps).min(r.seq_len);
                let mut t = last.0;
                while pos < tail_end {
                    t += 1;
                    out.push(VirtualToken(t));
                    pos += 1;
                }
            }
            while pos < r.seq_len {
                let (Some(v), Some(s)) = (self.free_full.pop(), self.free_swa.pop()) else {
                    self.scope.expect(&ROOM_CHECK, false, || {
                        "an allocation ran out of pages past its room check".to_string()
                    });
                    break;
                };
                self.full_live[v as usize] = true;
                if self.swa_of[v as usize] == -1 {
                    self.tombstones -= 1;
                }
                self.swa_of[v as usize] = s as i32;
                self.swa_owner[(s - self.swa_base) as usize] = v;
                self.swa_live += 1;
                self.mark(v);
                let n = (r.seq_len - pos).min(ps);
                let base = v * ps as u32;
                out.extend((0..n as u32).map(|o| VirtualToken(base + o)));
                pos += n;
            }
        }
        Ok(())
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
    fn release_pages(&mut self, pages: impl ExactSizeIterator<Item = u32> + Clone) {
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
        for v in pages {
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
    fn issue_slot_copies(
        &self,
        _pairs: &[(crate::ids::VirtualSlot, crate::ids::VirtualSlot)],
    ) -> Result<(), Error> {
        Err(Error::NoSlotPool { op: "copy_slots" })
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

    fn alloc_slots(
        &mut self,
        _n: usize,
        _out: &mut Vec<crate::ids::VirtualSlot>,
    ) -> Result<(), Error> {
        Err(Error::NoSlotPool { op: "alloc_slots" })
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
        // No slot pool: a slot demand never fits.
        demand.mamba_slots == 0 && self.fits(demand, 0, 0)
    }

    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        if demand.mamba_slots > 0 {
            return Err(Error::NoSlotPool {
                op: "ensure_capacity",
            });
        }
        frees::flush_deferred(self);
        if self.fits(demand, 0, 0) {
            Ok(())
        } else {
            Err(Error::OutOfCapacity {
                full_pages: demand.full_pages,
                swa_pages: demand.swa_pages,
                available_pages: self.free_full.len().min(self.free_swa.len()),
            })
        }
    }

    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        if demand.mamba_slots > 0 {
            // No slot pool: no eviction makes a slot demand fit (and nothing is flushed).
            return None;
        }
        // Deferred frees first: bytes waiting in any list must be visible before sizing.
        frees::flush_deferred(self);
        let rf_max = evictable
            .full_pages
            .min(self.full_pages as usize - self.free_full.len());
        let rs_max = evictable.swa_pages.min(self.swa_live as usize);
        if !self.fits(demand, rf_max, rs_max) {
            return None;
        }
        // The sides are separate pools: the FULL reclaim does not depend on the SWA one.
        let full_pages = demand.full_pages.saturating_sub(self.free_full.len());
        Some(ReclaimPlan {
            swa_pages: demand.swa_pages.saturating_sub(self.free_swa.len()),
            full_pages,
            mamba_slots: 0,
            full_floor_pages: full_pages,
        })
    }

    fn capacity(&self) -> Capacity {
        let full_alloc = self.full_pages as usize - self.free_full.len();
        let joint = self.free_full.len().min(self.free_swa.len());
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
            joint_available_pages: joint,
            joint_schedulable_pages: joint,
            ..Capacity::default()
        }
    }

    fn pool_map(&self) -> PoolMap {
        let full_live = self.full_pages as usize - self.free_full.len();
        PoolMap {
            layout: "static",
            page_size: self.ps.get(),
            total_bytes: self.total_bytes,
            sink_floor: self.floor,
            spans: vec![
                SpanInfo {
                    side: Side::Full,
                    bytes: (
                        self.full_grid.offset(self.full_base),
                        self.full_grid.offset(self.full_base + self.full_pages),
                    ),
                    envelope: self.full_grid.envelope,
                    pages: self.full_pages as usize,
                    live: full_live,
                    holes: 0,
                    tombstones: 0,
                },
                SpanInfo {
                    side: Side::Swa,
                    bytes: (
                        self.swa_grid.offset(self.swa_base),
                        self.swa_grid.offset(self.swa_base + self.swa_pages),
                    ),
                    envelope: self.swa_grid.envelope,
                    pages: self.swa_pages as usize,
                    live: self.swa_live as usize,
                    holes: 0,
                    tombstones: self.tombstones as usize,
                },
            ],
        }
    }

    fn move_gate(&self) -> MoveGate {
        // Static pages never move; the gate is honoured trivially.
        MoveGate::close(&self.gates)
    }

    fn upload_mirror(&mut self) -> Result<(), Error> {
        if self.dirty.is_empty() {
            return Ok(());
        }
        // FULL's entry follows liveness too (unbound reads as the sink, as in the unified
        // layout), so one dirty list serves both tables. The entries stay dirty until
        // both scatters were issued, so a failed upload is retried whole.
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
        self.entries
            .extend(self.dirty.iter().map(|&v| (v, swa_of[v as usize])));
        let (full, swa) = self.entries.split_at(n);
        self.device.scatter_table(self.mirrors[0], full)?;
        self.device.scatter_table(self.mirrors[1], swa)?;
        let flags = &mut self.dirty_flag;
        for &v in &self.dirty {
            flags[v as usize] = false;
        }
        self.dirty.clear();
        Ok(())
    }

    fn mirror_table(&self, side: Side) -> Option<TableId> {
        match side {
            Side::Full => Some(self.mirrors[0]),
            Side::Swa => Some(self.mirrors[1]),
            Side::Mamba => None,
        }
    }

    fn stride(&self, side: Side) -> u32 {
        self.grid(side).stride
    }

    fn kernel_id(&self, side: Side, token: VirtualToken) -> i32 {
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
            Side::Mamba => Grid::ABSENT,
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

    fn physical_slot(&self, _slot: crate::ids::VirtualSlot) -> Option<u32> {
        None
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
        let full_live = self.full_pages as usize - self.free_full.len();
        let holds = self.free_swa.len() + self.swa_live as usize == self.swa_pages as usize
            && self.free_full.len() <= self.full_pages as usize
            && (self.swa_live + self.tombstones) as usize <= full_live
            && self.full_grid.offset(self.full_base + self.full_pages)
                <= self.swa_grid.offset(self.swa_base);
        self.scope.expect(&CONSERVATION, holds, || {
            format!(
                "static: full {} free of {}; swa {} live {} free of {}; {} tombstones",
                self.free_full.len(),
                self.full_pages,
                self.swa_live,
                self.free_swa.len(),
                self.swa_pages,
                self.tombstones
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
        Ok(())
    }
}

impl Drop for StaticSwa {
    fn drop(&mut self) {
        // Tear-down; a failure here has nobody to report to.
        let _ = self.device.free_bytes(self.buffer);
        for t in self.mirrors {
            let _ = self.device.free_table(t);
        }
    }
}

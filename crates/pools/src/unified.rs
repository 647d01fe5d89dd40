//! `UnifiedSwa`: FULL and SWA KV in one byte buffer. FULL grows down from the high end
//! and mints virtual pages; SWA grows up from the sink floor and binds its pages to the
//! same virtual pages, so `swa.v2p` is the FULL→SWA map. Capacity is bytes at the
//! frontier; compaction is lazy.

use crate::api::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, KvAllocator, MoveGate,
    PageDemand, PoolMap, ReclaimPlan, Reclaimable, Segment, SideCapacity, SpanInfo, SwaState,
};
use crate::error::Error;
use crate::frees::{self, FreeGroup, PageTables};
use crate::ids::{PageSize, VirtualPage, VirtualToken};
use crate::invariants::{CONSERVATION, ROOM_CHECK};
use crate::spec::{Grid, Grow, Side, SubPoolSpec, check_bs1_floor, sink_floor, window_pages};
use crate::sub::{CompactionPlan, Edge, SubAllocator, VirtualIds};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use unikv_invariants::{Scope, enabled};
use unikv_kernels::{ByteSpan, BytesId, Device, SpanMove, TableId, Translate};

/// How to build a [`UnifiedSwa`].
#[derive(Clone, Debug)]
pub struct UnifiedSwaConfig {
    /// Bytes of the one buffer.
    pub total_bytes: u64,
    /// Tokens per page (FULL and SWA share it).
    pub page_size: u32,
    /// The sliding window, in tokens (sizes the batch-size-1 floor).
    pub window: u32,
    /// The FULL sub-pool (grows down from the high end).
    pub full: SubPoolSpec,
    /// The SWA sub-pool (grows up from the sink floor).
    pub swa: SubPoolSpec,
    /// Zero page envelopes when they are handed out (one `fill_spans` per side per alloc).
    pub zero_on_handout: bool,
}

/// The unified FULL/SWA allocator over one byte buffer on a [`Device`].
#[derive(Debug)]
pub struct UnifiedSwa {
    device: Arc<dyn Device>,
    buffer: BytesId,
    ps: PageSize,
    total_bytes: u64,
    floor: u64,
    full: SubAllocator,
    swa: SubAllocator,
    /// Free virtual pages (FULL mints them).
    free_ids: VirtualIds,
    virtual_pages: u32,
    group: FreeGroup,
    /// Where this allocator's invariant breaches are counted (its cache's scope).
    scope: Scope,
    gates: Arc<AtomicUsize>,
    mirrors: [TableId; 2],
    zero_on_handout: bool,
    /// Envelopes to zero before an allocation binds them (both sides, one `fill_spans`).
    spans: Vec<ByteSpan>,
    /// Envelope copies of a planned compaction (both sides, one `move_spans`).
    moves: Vec<SpanMove>,
    /// The planned compaction per side (SWA, FULL), committed after the device moved.
    plans: [CompactionPlan; 2],
    /// Mirror entries of an upload: FULL's, then SWA's from `dirty_split`.
    dirty: Vec<(u32, i32)>,
}

impl UnifiedSwa {
    /// Lays out the buffer, allocates it (zeroed) and the two mirror tables on `device`.
    /// Fails when the buffer cannot hold the sink plus one request's window on both sides
    /// ([`Error::BufferTooSmall`]) or kernel ids would overflow i32.
    pub fn new(device: Arc<dyn Device>, config: UnifiedSwaConfig) -> Result<UnifiedSwa, Error> {
        let ps = PageSize::new(config.page_size)
            .ok_or_else(|| Error::BadConfig("page size must be at least 1".into()))?;
        let total = config.total_bytes;
        let floor = sink_floor(&[&config.full, &config.swa], None, ps);
        let grids = |bytes| -> Result<(Grid, Grid), Error> {
            Ok((
                Grid::new(&config.full, ps, bytes, floor, "full")?,
                Grid::new(&config.swa, ps, bytes, floor, "swa")?,
            ))
        };
        let (full_grid, swa_grid) = grids(total)?;
        // The room between the sink floor and the top of the FULL grid must hold one
        // window of joint pages.
        let window_bytes =
            window_pages(ps, config.window).saturating_mul(full_grid.envelope + swa_grid.envelope);
        check_bs1_floor(total, ps, config.window, |bytes| {
            grids(bytes).is_ok_and(|(f, s)| {
                f.offset(f.pages).saturating_sub(s.offset(s.min_page)) >= window_bytes
            })
        })?;
        let virtual_pages = full_grid.pages - full_grid.min_page + 1;
        if virtual_pages as u64 * ps.get() as u64 > i32::MAX as u64 {
            return Err(Error::BadConfig(format!(
                "{virtual_pages} virtual pages × page size {ps} overflow i32 token ids"
            )));
        }
        let buffer = device.alloc_bytes(total, 0)?;
        let full_mirror = device.alloc_table(virtual_pages as usize, 0)?;
        let swa_mirror = device.alloc_table(virtual_pages as usize, 0)?;
        Ok(UnifiedSwa {
            device,
            buffer,
            ps,
            total_bytes: total,
            floor,
            full: SubAllocator::new(full_grid, Grow::Down, virtual_pages),
            swa: SubAllocator::new(swa_grid, Grow::Up, virtual_pages),
            free_ids: VirtualIds::new(virtual_pages),
            virtual_pages,
            group: FreeGroup::new(virtual_pages),
            scope: Scope::new(),
            gates: Arc::new(AtomicUsize::new(0)),
            mirrors: [full_mirror, swa_mirror],
            zero_on_handout: config.zero_on_handout,
            spans: Vec::new(),
            moves: Vec::new(),
            plans: Default::default(),
            // At most one entry per virtual page and side per upload: sized and mapped at
            // boot.
            dirty: {
                let n = 2 * virtual_pages as usize;
                let mut entries = Vec::with_capacity(n);
                entries.resize(n, std::hint::black_box((0, 0)));
                entries.clear();
                entries
            },
        })
    }

    /// Byte range `[low, high)` of `side`'s span (an absent side: the empty span at the
    /// sink floor).
    pub fn span_bytes(&self, side: Side) -> (u64, u64) {
        self.side(side)
            .map_or((self.floor, self.floor), SubAllocator::span_bytes)
    }

    /// Mirror entries waiting for the upload (both sides).
    fn mirror_pending(&self) -> usize {
        self.full.dirty_count() + self.swa.dirty_count()
    }

    /// `side`'s sub-pool; `None` for [`Side::Mamba`] (no slot pool).
    fn side(&self, side: Side) -> Option<&SubAllocator> {
        match side {
            Side::Full => Some(&self.full),
            Side::Swa => Some(&self.swa),
            Side::Mamba => None,
        }
    }

    fn gated(&self) -> bool {
        self.gates.load(Ordering::Acquire) > 0
    }

    /// Whether `d_f` FULL and `d_s` SWA pages fit after reclaiming `r_f`/`r_s` live pages,
    /// now (holes, then the frontier) or after compaction.
    /// Overflow-safe for any demand and reclaim: the page counts are widened to u64 and
    /// saturate (a saturated demand never fits).
    fn fits(&self, d_f: usize, d_s: usize, r_f: usize, r_s: usize, compacted: bool) -> bool {
        let (d_f, d_s, r_f, r_s) = (d_f as u64, d_s as u64, r_f as u64, r_s as u64);
        if d_f > (self.free_ids.available() as u64).saturating_add(r_f) {
            return false;
        }
        let (ef, es) = (self.full.grid.envelope, self.swa.grid.envelope);
        let (low_f, high_s) = if compacted {
            let span_f = (self.full.live as u64).saturating_sub(r_f) + d_f;
            let span_s = (self.swa.live as u64)
                .saturating_sub(r_s)
                .saturating_add(d_s);
            (
                (self.full.grid.pages as u64).checked_sub(span_f),
                (self.swa.grid.min_page as u64).saturating_add(span_s),
            )
        } else {
            let ext_f = d_f.saturating_sub((self.full.holes.len() as u64).saturating_add(r_f));
            let ext_s = d_s.saturating_sub((self.swa.holes.len() as u64).saturating_add(r_s));
            (
                (self.full.frontier() as u64).checked_sub(ext_f),
                (self.swa.frontier() as u64).saturating_add(ext_s),
            )
        };
        // Pages are below 2^31 (kernel ids fit in i32), so `low_f × ef` fits a u64 when the
        // buffer does; the SWA side saturates for an absurd demand.
        low_f.is_some_and(|low_f| low_f * ef >= high_s.saturating_mul(es))
    }

    fn fits_any(&self, d: PageDemand, r_f: usize, r_s: usize) -> bool {
        self.fits(d.full_pages, d.swa_pages, r_f, r_s, false)
            || (!self.gated() && self.fits(d.full_pages, d.swa_pages, r_f, r_s, true))
    }

    /// Largest `k` in `[0, hi]` with `ok(k)`, for monotone `ok`.
    fn max_fitting(hi: usize, ok: impl Fn(usize) -> bool) -> usize {
        let (mut lo, mut hi) = (0usize, hi);
        if ok(hi) {
            return hi;
        }
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if ok(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Smallest `r` in `[0, hi]` with `ok(r)` (`ok(hi)` holds), for monotone `ok`.
    fn min_fitting(hi: usize, ok: impl Fn(usize) -> bool) -> usize {
        if ok(0) {
            return 0;
        }
        let (mut lo, mut hi) = (0usize, hi);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if ok(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    }

    /// Plans a compaction of both sides into `self.plans` and `self.moves` (cleared
    /// first), changing no table.
    fn plan_compaction(&mut self) {
        self.moves.clear();
        let [swa_plan, full_plan] = &mut self.plans;
        self.swa
            .plan_compaction(Edge::Low, &mut self.moves, swa_plan);
        self.full
            .plan_compaction(Edge::High, &mut self.moves, full_plan);
    }

    /// The packed span of `side` after the planned compaction (`None`: unchanged).
    fn planned_span(&self, side: Side) -> Option<(u32, u32)> {
        match side {
            Side::Swa => self.plans[0].span,
            Side::Full => self.plans[1].span,
            Side::Mamba => None,
        }
    }

    /// Applies the planned compaction to the tables; returns the pages moved.
    fn commit_compaction(&mut self) -> usize {
        let [swa_plan, full_plan] = &self.plans;
        self.swa.commit_compaction(swa_plan);
        self.full.commit_compaction(full_plan);
        let moved = swa_plan.pairs.len() + full_plan.pairs.len();
        for plan in &mut self.plans {
            plan.span = None;
        }
        moved
    }

    /// Issues the planned moves (one `move_spans` for both sides: the SWA and FULL spans
    /// are disjoint, so no destination overlaps another).
    fn issue_moves(&self) -> Result<(), Error> {
        if !self.moves.is_empty() {
            self.device.move_spans(self.buffer, &self.moves)?;
        }
        Ok(())
    }

    /// Compacts both sides: plans, moves the envelopes on the device, and rewrites the
    /// tables only once the move was issued. A failed move changes no table (the moves
    /// only wrote holes, which nothing points to).
    fn compact(&mut self) -> Result<usize, Error> {
        if self.full.holes.is_empty() && self.swa.holes.is_empty() {
            return Ok(0);
        }
        self.plan_compaction();
        if let Err(e) = self.issue_moves() {
            for plan in &mut self.plans {
                plan.span = None;
            }
            return Err(e);
        }
        Ok(self.commit_compaction())
    }

    /// Whether `d_f`/`d_s` pages fit now (`Ok(false)`) or only after compaction
    /// (`Ok(true)`); [`Error::OutOfCapacity`] otherwise. Changes nothing.
    fn room_for(&self, d_f: usize, d_s: usize) -> Result<bool, Error> {
        if self.fits(d_f, d_s, 0, 0, false) {
            return Ok(false);
        }
        if !self.gated() && self.fits(d_f, d_s, 0, 0, true) {
            return Ok(true);
        }
        Err(Error::OutOfCapacity {
            full_pages: d_f,
            swa_pages: d_s,
            available_pages: self.joint_pages(!self.gated()),
        })
    }

    fn joint_pages(&self, compacted: bool) -> usize {
        Self::max_fitting(self.free_ids.available(), |k| {
            self.fits(k, k, 0, 0, compacted)
        })
    }

    /// Checks every request; returns the new pages and the tokens the batch hands out.
    fn validate(
        &self,
        requests: impl Iterator<Item = ExtendRequest>,
    ) -> Result<(usize, usize), Error> {
        let ps = self.ps;
        let mut totals = (0usize, 0usize);
        for (index, r) in requests.enumerate() {
            frees::check_request(index, &r, ps, &mut totals)?;
            if !ps.is_aligned(r.prefix_len) {
                let Some(last) = r.last_token else {
                    return Err(Error::BadRequest {
                        index,
                        reason: format!("prefix of {} tokens without a last token", r.prefix_len),
                    });
                };
                let v = last.page(ps).0;
                if last.offset(ps) as usize != ps.offset_of(r.prefix_len - 1)
                    || v == 0
                    || v >= self.virtual_pages
                    || self.full.v2p[v as usize] <= 0
                {
                    return Err(Error::BadRequest {
                        index,
                        reason: format!(
                            "last token {last} is not a live token at row position {}",
                            r.prefix_len - 1
                        ),
                    });
                }
            }
        }
        Ok(totals)
    }

    /// Hands out the batch's tokens: each request's free tail first, then `pages` new
    /// joint pages, in the order the id stack pops them. The caller checked the requests
    /// and the room.
    fn extend_unchecked(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest> + Clone,
        pages: usize,
        out: &mut Vec<VirtualToken>,
    ) {
        let stack = self.free_ids.stack();
        let Some(first) = stack.len().checked_sub(pages) else {
            return self.extend_page_by_page(requests, out);
        };
        // The ids `pages` pops would return, last on the stack first.
        let ids = &stack[first..];
        if ids.contains(&0) {
            return self.extend_page_by_page(requests, out);
        }
        // FULL then SWA, each side's takes and binds in id order: the same tables, holes
        // and dirty entries as binding both sides page by page.
        self.full.bind_each(ids.iter().rev().copied());
        self.swa.bind_each(ids.iter().rev().copied());
        let page_size = self.ps;
        let ps = page_size.get() as usize;
        let mut next = ids.iter().rev();
        if ps == 1 {
            // A page is a token: each request's tokens are its ids, copied in one
            // exact-size extend.
            for r in requests {
                let pos = Self::fill_tail(page_size, &r, out);
                let tokens = r.seq_len.saturating_sub(pos);
                out.extend(next.by_ref().take(tokens).map(|&v| VirtualToken(v)));
            }
            stack.truncate(first);
            return;
        }
        for r in requests {
            let mut pos = Self::fill_tail(page_size, &r, out);
            // `pages` is the sum of the requests' new pages: an id is there for each.
            while pos < r.seq_len
                && let Some(&v) = next.next()
            {
                let n = (r.seq_len - pos).min(ps);
                let base = v * ps as u32;
                if n == 1 {
                    out.push(VirtualToken(base));
                } else {
                    out.extend((0..n as u32).map(|o| VirtualToken(base + o)));
                }
                pos += n;
            }
        }
        stack.truncate(first);
    }

    /// Appends the tokens after `r.last_token` up to the end of its page (or the
    /// request's end); returns the row position reached.
    #[inline]
    fn fill_tail(page_size: PageSize, r: &ExtendRequest, out: &mut Vec<VirtualToken>) -> usize {
        let pos = r.prefix_len;
        let offset = page_size.offset_of(pos);
        match r.last_token {
            Some(last) if offset != 0 => {
                let tail_end = (pos - offset + page_size.get() as usize).min(r.seq_len);
                let first = last.0 + 1;
                out.extend((0..(tail_end - pos) as u32).map(|i| VirtualToken(first + i)));
                tail_end
            }
            _ => pos,
        }
    }

    /// The page-by-page form of [`UnifiedSwa::extend_unchecked`], for a stack that breaks
    /// the room check's promise (too few ids, or the sink on it): it stops at the breach
    /// and reports it.
    #[cold]
    fn extend_page_by_page(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest>,
        out: &mut Vec<VirtualToken>,
    ) {
        let page_size = self.ps;
        let ps = page_size.get() as usize;
        for r in requests {
            let mut pos = Self::fill_tail(page_size, &r, out);
            while pos < r.seq_len {
                // The caller checked the room, which covers the virtual ids.
                let Some(v) = self.free_ids.pop().filter(|&v| v != 0) else {
                    self.scope.expect(&ROOM_CHECK, false, || {
                        "an allocation ran out of virtual ids past its room check".to_string()
                    });
                    break;
                };
                let pf = self.full.take();
                self.full.bind(v, pf);
                let psw = self.swa.take();
                self.swa.bind(v, psw);
                let n = (r.seq_len - pos).min(ps);
                let base = v * ps as u32;
                out.extend((0..n as u32).map(|o| VirtualToken(base + o)));
                pos += n;
            }
        }
    }

    /// An allocation as one transaction: validate, size the room, plan any compaction
    /// and the envelopes to zero, issue the device work (moves, then zeroing), and only
    /// then commit the compaction and bind the pages. A failed device op leaves every
    /// table, list and counter as it was (the device wrote only pages nothing points to).
    fn alloc(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest> + Clone,
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        let (pages, tokens) = self.validate(requests.clone())?;
        let compact = self.room_for(pages, pages)?;
        if compact {
            self.plan_compaction();
        }
        let device_work = self.issue_handout_work(pages, compact);
        if let Err(e) = device_work {
            for plan in &mut self.plans {
                plan.span = None;
            }
            return Err(e);
        }
        if compact {
            self.commit_compaction();
        }
        out.reserve(tokens);
        self.extend_unchecked(requests, pages, out);
        Ok(())
    }

    /// The device half of an allocation: the planned moves, then the zeroing of the
    /// `pages` envelopes per side the binds will take (predicted from the state after the
    /// planned compaction). Changes no host table.
    fn issue_handout_work(&mut self, pages: usize, compact: bool) -> Result<(), Error> {
        if compact {
            self.issue_moves()?;
        }
        if self.zero_on_handout && pages > 0 {
            let mut spans = std::mem::take(&mut self.spans);
            spans.clear();
            let packed = |side| {
                if compact {
                    self.planned_span(side)
                } else {
                    None
                }
            };
            self.full
                .handout_envelopes(pages, packed(Side::Full), &mut spans);
            self.swa
                .handout_envelopes(pages, packed(Side::Swa), &mut spans);
            let filled = self.device.fill_spans(self.buffer, &spans, 0);
            self.spans = spans;
            filled?;
        }
        Ok(())
    }

    fn side_capacity(&self, side: Side) -> SideCapacity {
        let gated = self.gated();
        let (sub, total, avail, sched) = match side {
            Side::Full => {
                let hi = self.free_ids.available();
                (
                    &self.full,
                    self.virtual_pages as usize - 1,
                    Self::max_fitting(hi, |k| self.fits(k, 0, 0, 0, false)),
                    Self::max_fitting(hi, |k| self.fits(k, 0, 0, 0, !gated)),
                )
            }
            Side::Swa => {
                let hi = self.swa.grid.pages as usize;
                (
                    &self.swa,
                    (self.swa.grid.pages - self.swa.grid.min_page) as usize,
                    Self::max_fitting(hi, |k| self.fits(0, k, 0, 0, false)),
                    Self::max_fitting(hi, |k| self.fits(0, k, 0, 0, !gated)),
                )
            }
            // No slot pool: no capacity.
            Side::Mamba => return SideCapacity::default(),
        };
        SideCapacity {
            available_pages: avail,
            schedulable_pages: sched.max(avail),
            allocated_pages: sub.live as usize,
            total_pages: total,
            hole_pages: sub.holes.len(),
            tombstones: sub.tombstones as usize,
        }
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
    fn swa_entry(&self, v: u32) -> i32 {
        self.swa.v2p[v as usize]
    }
    #[inline(always)]
    fn release_swa(&mut self, v: u32, tombstone: bool) {
        self.swa.unbind(v, tombstone);
    }
    #[inline(always)]
    fn release_full(&mut self, v: u32) {
        self.full.unbind(v, false);
        self.swa.clear_tombstone(v);
        self.free_ids.push(v);
    }
    fn move_swa(&mut self, from: u32, to: u32) {
        self.swa.rebind(from, to);
    }
    /// Two passes, SWA then FULL, each touching one side's tables and lists. Same effect,
    /// in the same order per list, as `release_page_silently` page by page: the SWA and
    /// FULL transitions of a page do not read each other's state, except the FULL
    /// liveness filter, which the SWA pass reads before the FULL pass changes it. A page
    /// listed twice is still released once: its second visit finds SWA unbound (0: no
    /// change) in the first pass and FULL free in the second.
    fn release_pages(&mut self, pages: impl ExactSizeIterator<Item = u32> + Clone) {
        let full = &self.full.v2p;
        self.swa.release_each(
            pages.clone(),
            |v| v != 0 && full[v as usize] > 0,
            true,
            None,
        );
        // FULL has no tombstones; each released id goes back on the stack, in order.
        self.full
            .release_each(pages, |v| v != 0, false, Some(self.free_ids.stack()));
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

impl frees::SlotCopy for UnifiedSwa {
    fn issue_slot_copies(
        &self,
        _pairs: &[(crate::ids::VirtualSlot, crate::ids::VirtualSlot)],
    ) -> Result<(), Error> {
        Err(Error::NoSlotPool { op: "copy_slots" })
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

    fn alloc_slots(
        &mut self,
        _n: usize,
        _out: &mut Vec<crate::ids::VirtualSlot>,
    ) -> Result<(), Error> {
        Err(Error::NoSlotPool { op: "alloc_slots" })
    }

    fn flush(&mut self) -> Result<FlushReport, Error> {
        let deferred_flushed = frees::flush_deferred(self);
        let gated = self.gated();
        let pages_moved = if gated { 0 } else { self.compact()? };
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
        // No slot pool: a slot demand never fits.
        demand.mamba_slots == 0 && self.fits_any(demand, 0, 0)
    }

    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        if demand.mamba_slots > 0 {
            return Err(Error::NoSlotPool {
                op: "ensure_capacity",
            });
        }
        frees::flush_deferred(self);
        if self.room_for(demand.full_pages, demand.swa_pages)? {
            self.compact()?;
        }
        Ok(())
    }

    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        if demand.mamba_slots > 0 {
            // No slot pool: no eviction makes a slot demand fit (and nothing is flushed).
            return None;
        }
        // Deferred frees first: bytes waiting in any list must be visible before sizing.
        frees::flush_deferred(self);
        if self.fits_any(demand, 0, 0) {
            return Some(ReclaimPlan::default());
        }
        let rf_max = evictable.full_pages.min(self.full.live as usize);
        let rs_max = evictable.swa_pages.min(self.swa.live as usize);
        if !self.fits_any(demand, rf_max, rs_max) {
            return None;
        }
        let swa_pages = Self::min_fitting(rs_max, |r| self.fits_any(demand, rf_max, r));
        let full_pages = Self::min_fitting(rf_max, |r| self.fits_any(demand, r, swa_pages));
        // Monotone in the SWA reclaim, so with all of it the minimum is at most `full_pages`.
        let full_floor_pages = Self::min_fitting(rf_max, |r| self.fits_any(demand, r, rs_max));
        Some(ReclaimPlan {
            full_pages,
            swa_pages,
            mamba_slots: 0,
            full_floor_pages,
        })
    }

    fn capacity(&self) -> Capacity {
        let available = self.joint_pages(false);
        Capacity {
            page_size: self.ps.get(),
            full: self.side_capacity(Side::Full),
            swa: self.side_capacity(Side::Swa),
            joint_available_pages: available,
            joint_schedulable_pages: if self.gated() {
                available
            } else {
                self.joint_pages(true)
            },
            ..Capacity::default()
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
        PoolMap {
            layout: "unified",
            page_size: self.ps.get(),
            total_bytes: self.total_bytes,
            sink_floor: self.floor,
            spans: vec![info(Side::Swa, &self.swa), info(Side::Full, &self.full)],
        }
    }

    fn move_gate(&self) -> MoveGate {
        MoveGate::close(&self.gates)
    }

    fn upload_mirror(&mut self) -> Result<(), Error> {
        if !self.full.has_dirty() && !self.swa.has_dirty() {
            return Ok(());
        }
        // Both sides' entries first; they stay dirty until both scatters were issued, so
        // a failed upload is retried whole (re-scattering an entry is idempotent).
        self.dirty.clear();
        self.full.dirty_entries(&mut self.dirty);
        let split = self.dirty.len();
        self.swa.dirty_entries(&mut self.dirty);
        let (full, swa) = self.dirty.split_at(split);
        if !full.is_empty() {
            self.device.scatter_table(self.mirrors[0], full)?;
        }
        if !swa.is_empty() {
            self.device.scatter_table(self.mirrors[1], swa)?;
        }
        self.full.clear_dirty();
        self.swa.clear_dirty();
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

    fn physical_slot(&self, _slot: crate::ids::VirtualSlot) -> Option<u32> {
        None
    }

    fn full_live(&self, page: VirtualPage) -> bool {
        (page.0 as usize) < self.full.v2p.len() && self.full.v2p[page.0 as usize] > 0
    }

    fn swa_state(&self, page: VirtualPage) -> SwaState {
        match self.swa.v2p.get(page.0 as usize) {
            Some(&p) if p > 0 => SwaState::Live,
            Some(-1) => SwaState::Tombstone,
            _ => SwaState::Unbound,
        }
    }

    fn check_conservation(&self) -> bool {
        let (swa_lo, _) = self.swa.span_bytes();
        let (_, full_hi) = self.full.span_bytes();
        let holds = self.full.accounting_holds()
            && self.swa.accounting_holds()
            && self.free_ids.available() + self.full.live as usize
                == self.virtual_pages as usize - 1
            && self.swa.live + self.swa.tombstones <= self.full.live
            && self.full.tombstones == 0
            && self.swa.facing_byte() <= self.full.facing_byte()
            && swa_lo >= self.floor
            && full_hi <= self.total_bytes;
        self.scope.expect(&CONSERVATION, holds, || {
            format!(
                "unified: full live {} holes {} span {} frontier {}; swa live {} holes {} tomb {} span {} frontier {}; free ids {} of {}",
                self.full.live,
                self.full.holes.len(),
                self.full.span_pages(),
                self.full.frontier(),
                self.swa.live,
                self.swa.holes.len(),
                self.swa.tombstones,
                self.swa.span_pages(),
                self.swa.frontier(),
                self.free_ids.available(),
                self.virtual_pages - 1
            )
        })
    }

    fn verify(&self) -> Result<(), String> {
        self.full.verify("full")?;
        self.swa.verify("swa")?;
        if !self.check_conservation() {
            return Err("conservation does not hold".into());
        }
        let mut ids = self.free_ids.as_slice().to_vec();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) || ids.first() == Some(&0) {
            return Err("free virtual ids hold a duplicate or the sink".into());
        }
        if let Some(&v) = ids.iter().find(|&&v| self.full.v2p[v as usize] != 0) {
            return Err(format!("free virtual id {v} is bound on FULL"));
        }
        for v in 0..self.virtual_pages as usize {
            if self.swa.v2p[v] != 0 && self.full.v2p[v] <= 0 {
                return Err(format!(
                    "v{v} has SWA entry {} without live FULL",
                    self.swa.v2p[v]
                ));
            }
        }
        Ok(())
    }
}

impl Drop for UnifiedSwa {
    fn drop(&mut self) {
        // Tear-down; a failure here has nobody to report to.
        let _ = self.device.free_bytes(self.buffer);
        for t in self.mirrors {
            let _ = self.device.free_table(t);
        }
    }
}

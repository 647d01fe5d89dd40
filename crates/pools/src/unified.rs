//! `UnifiedSwa`: the unified pool, FULL KV and SWA KV or Mamba state in one byte buffer.
//! FULL grows down from the high end and mints virtual pages; the other side grows up
//! from the sink floor. SWA binds its pages to FULL's virtual pages (so `swa.v2p` is the
//! FULL→SWA map); Mamba state slots have their own virtual ids. Capacity is bytes between
//! the frontiers, so the split follows the workload; compaction is lazy.

use crate::api::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, KvAllocator, MoveGate,
    PageDemand, PoolMap, ReclaimPlan, Reclaimable, Segment, SideCapacity, SpanInfo, SwaState,
};
use crate::error::Error;
use crate::frees::{self, FreeGroup, PageTables};
use crate::ids::{PageSize, VirtualPage, VirtualSlot, VirtualToken};
use crate::invariants::{CONSERVATION, ROOM_CHECK};
use crate::spec::{
    BS1_STATE_SLOTS, Grid, Grow, Side, SlotPoolSpec, SubPoolSpec, bs1_floor, check_bs1_floor,
    sink_floor, window_pages,
};
use crate::sub::{CompactionPlan, Edge, SubAllocator, VirtualIds};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use unikv_invariants::{Scope, enabled};
use unikv_kernels::{ByteSpan, BytesId, Device, SpanMove, TableId, Translate};

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
    /// recurrent layers. A layout has SWA or Mamba, not both (the tri-pool is not built
    /// yet: [`Error::BadConfig`]).
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

/// How a fit is priced: with the pages where they are, or after compacting every side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// Holes first, then each frontier extends into the gap.
    Now,
    /// Every side packed against its end, no holes.
    Compacted,
}

/// The unified allocator over one byte buffer on a [`Device`]: FULL at the high end, SWA
/// or Mamba state at the low end.
#[derive(Debug)]
pub struct UnifiedSwa {
    device: Arc<dyn Device>,
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
    /// Mirror entries of an upload, side after side.
    dirty: Vec<(u32, i32)>,
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
        let (swa_spec, slot_spec) = match (&config.swa, &config.mamba) {
            (Some(_), Some(_)) => {
                return Err(Error::BadConfig(
                    "FULL, SWA and Mamba in one buffer (the tri-pool) is not built yet".into(),
                ));
            }
            (None, None) => {
                return Err(Error::BadConfig(
                    "a unified pool needs an SWA side or a Mamba slot pool beside FULL".into(),
                ));
            }
            (swa, mamba) => (swa.as_ref(), mamba.as_ref()),
        };
        let kv: Vec<&SubPoolSpec> = std::iter::once(&config.full).chain(swa_spec).collect();
        let floor = sink_floor(&kv, slot_spec, ps);
        // Each layout's low end: its grid and what one request needs of it at bs = 1.
        let low_grid = |bytes| match (swa_spec, slot_spec) {
            (Some(swa), _) => Grid::new(swa, ps, bytes, floor, "swa"),
            (None, Some(slots)) => slots.grid(bytes, floor),
            (None, None) => unreachable!("refused above"),
        };
        let grids = |bytes| -> Result<(Grid, Grid), Error> {
            Ok((
                Grid::new(&config.full, ps, bytes, floor, "full")?,
                low_grid(bytes)?,
            ))
        };
        let (full_grid, low) = grids(total)?;
        let floor_need = bs1_floor(ps, swa_spec.map(|_| config.window), slot_spec.is_some());
        let need = |f: &Grid, l: &Grid| -> u64 {
            match swa_spec {
                Some(_) => window_pages(ps, config.window).saturating_mul(f.envelope + l.envelope),
                None => (BS1_STATE_SLOTS as u64 * l.envelope).saturating_add(f.envelope),
            }
        };
        check_bs1_floor(total, floor_need, |bytes| {
            grids(bytes).is_ok_and(|(f, l)| {
                f.offset(f.pages).saturating_sub(l.offset(l.min_page)) >= need(&f, &l)
            })
        })?;
        let virtual_pages = full_grid.pages - full_grid.min_page + 1;
        if virtual_pages as u64 * ps.get() as u64 > i32::MAX as u64 {
            return Err(Error::BadConfig(format!(
                "{virtual_pages} virtual pages × page size {ps} overflow i32 token ids"
            )));
        }
        let virtual_slots = if slot_spec.is_some() {
            low.pages - low.min_page + 1
        } else {
            0
        };
        let buffer = device.alloc_bytes(total, 0)?;
        let mut mirrors = [None; 3];
        mirrors[ix(Side::Full)] = Some(device.alloc_table(virtual_pages as usize, 0)?);
        let (swa, mamba) = if swa_spec.is_some() {
            mirrors[ix(Side::Swa)] = Some(device.alloc_table(virtual_pages as usize, 0)?);
            (Some(SubAllocator::new(low, Grow::Up, virtual_pages)), None)
        } else {
            mirrors[ix(Side::Mamba)] = Some(device.alloc_table(virtual_slots as usize, 0)?);
            (None, Some(SubAllocator::new(low, Grow::Up, virtual_slots)))
        };
        Ok(UnifiedSwa {
            device,
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
            // At most one entry per virtual page (or slot) and side per upload: sized and
            // mapped at boot.
            dirty: {
                let n = 2 * virtual_pages as usize + virtual_slots as usize;
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

    /// The low (grow-up) end: SWA or the Mamba slots.
    fn low(&self) -> &SubAllocator {
        match (&self.swa, &self.mamba) {
            (Some(low), _) | (None, Some(low)) => low,
            (None, None) => unreachable!("a layout has SWA or Mamba (checked at boot)"),
        }
    }

    fn gated(&self) -> bool {
        self.gates.load(Ordering::Acquire) > 0
    }

    /// The one feasibility predicate of the chain `[low end | FULL]`: whether `d` fits
    /// after reclaiming `r` live pages and slots, priced `at` a placement. FULL needs
    /// free virtual pages, Mamba free virtual slots, and the low end's high frontier must
    /// stay at or below FULL's low frontier in bytes. A demand for a side the layout does
    /// not have: SWA pages are vacuous without SWA (FULL pages carry the tokens), slots
    /// never fit without a slot pool. Overflow-safe for any demand and reclaim: counts
    /// are widened to u64 and saturate (a saturated demand never fits).
    fn fits(&self, d: PageDemand, r: Reclaimable, at: Placement) -> bool {
        let w = |n: usize| n as u64;
        if w(d.full_pages) > w(self.free_ids.available()).saturating_add(w(r.full_pages)) {
            return false;
        }
        let (low, d_low, r_low) = match (&self.swa, &self.mamba) {
            (Some(swa), _) => (swa, d.swa_pages, r.swa_pages),
            (None, Some(mamba)) => {
                if w(d.mamba_slots) > w(self.slot_ids.available()).saturating_add(w(r.mamba_slots))
                {
                    return false;
                }
                (mamba, d.mamba_slots, r.mamba_slots)
            }
            (None, None) => return false,
        };
        if self.swa.is_some() && self.mamba.is_none() && d.mamba_slots > 0 {
            return false;
        }
        let low_f = Self::frontier_after(&self.full, w(d.full_pages), w(r.full_pages), at);
        let high = Self::frontier_after(low, w(d_low), w(r_low), at);
        // Pages are below 2^31 (kernel ids fit in i32), so `low_f × envelope` fits a u64
        // when the buffer does; the low end saturates for an absurd demand.
        low_f.is_some_and(|low_f| {
            high.is_some_and(|high| {
                low_f * self.full.grid.envelope >= high.saturating_mul(low.grid.envelope)
            })
        })
    }

    /// Where `sub`'s growth frontier would be after `d` more and `r` fewer live pages:
    /// its low page for a `Down` end, its high page for an `Up` end (`None`: below 0).
    fn frontier_after(sub: &SubAllocator, d: u64, r: u64, at: Placement) -> Option<u64> {
        let live = (sub.live as u64).saturating_sub(r);
        let g = sub.grid;
        match (sub.grow, at) {
            (Grow::Down, Placement::Compacted) => {
                (g.pages as u64).checked_sub(live.saturating_add(d))
            }
            (Grow::Down, Placement::Now) => {
                let ext = d.saturating_sub((sub.holes.len() as u64).saturating_add(r));
                (sub.frontier() as u64).checked_sub(ext)
            }
            (_, Placement::Compacted) => {
                Some((g.min_page as u64).saturating_add(live.saturating_add(d)))
            }
            (_, Placement::Now) => {
                let ext = d.saturating_sub((sub.holes.len() as u64).saturating_add(r));
                Some((sub.frontier() as u64).saturating_add(ext))
            }
        }
    }

    /// Whether `d` fits after reclaiming `r`, now or (moves allowed) after compaction.
    fn fits_any(&self, d: PageDemand, r: Reclaimable) -> bool {
        self.fits(d, r, Placement::Now) || (!self.gated() && self.fits(d, r, Placement::Compacted))
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

    /// Plans a compaction of every side into `self.plans` and `self.moves` (cleared
    /// first), changing no table.
    fn plan_compaction(&mut self) {
        self.moves.clear();
        let [full_plan, swa_plan, mamba_plan] = &mut self.plans;
        if let Some(swa) = &self.swa {
            swa.plan_compaction(Edge::Low, &mut self.moves, swa_plan);
        }
        if let Some(mamba) = &self.mamba {
            mamba.plan_compaction(Edge::Low, &mut self.moves, mamba_plan);
        }
        self.full
            .plan_compaction(Edge::High, &mut self.moves, full_plan);
    }

    /// The packed span of `side` after the planned compaction (`None`: unchanged).
    fn planned_span(&self, side: Side) -> Option<(u32, u32)> {
        self.plans[ix(side)].span
    }

    /// Forgets a planned compaction (its moves failed, or it was applied).
    fn drop_plans(&mut self) {
        for plan in &mut self.plans {
            plan.span = None;
        }
    }

    /// Applies the planned compaction to the tables; returns the pages moved.
    fn commit_compaction(&mut self) -> usize {
        let [full_plan, swa_plan, mamba_plan] = &self.plans;
        self.full.commit_compaction(full_plan);
        if let Some(swa) = &mut self.swa {
            swa.commit_compaction(swa_plan);
        }
        if let Some(mamba) = &mut self.mamba {
            mamba.commit_compaction(mamba_plan);
        }
        let moved = self.plans.iter().map(|p| p.pairs.len()).sum();
        self.drop_plans();
        moved
    }

    /// Issues the planned moves (one `move_spans` for every side: the spans are
    /// disjoint, so no destination overlaps another).
    fn issue_moves(&self) -> Result<(), Error> {
        if !self.moves.is_empty() {
            self.device.move_spans(self.buffer, &self.moves)?;
        }
        Ok(())
    }

    /// Compacts every side: plans, moves the envelopes on the device, and rewrites the
    /// tables only once the move was issued. A failed move changes no table (the moves
    /// only wrote holes, which nothing points to).
    fn compact(&mut self) -> Result<usize, Error> {
        if self.subs().all(|sub| sub.holes.is_empty()) {
            return Ok(0);
        }
        self.plan_compaction();
        if let Err(e) = self.issue_moves() {
            self.drop_plans();
            return Err(e);
        }
        Ok(self.commit_compaction())
    }

    /// Whether `d` fits now (`Ok(false)`) or only after compaction (`Ok(true)`);
    /// [`Error::OutOfCapacity`] otherwise. Changes nothing.
    fn room_for(&self, d: PageDemand) -> Result<bool, Error> {
        let none = Reclaimable::default();
        if self.fits(d, none, Placement::Now) {
            return Ok(false);
        }
        if !self.gated() && self.fits(d, none, Placement::Compacted) {
            return Ok(true);
        }
        if d.mamba_slots > 0 {
            return Err(Error::OutOfSlots {
                requested: d.mamba_slots,
                available: self.side_capacity(Side::Mamba).schedulable_pages,
            });
        }
        Err(Error::OutOfCapacity {
            full_pages: d.full_pages,
            swa_pages: d.swa_pages,
            available_pages: self.joint_pages(self.placement()),
        })
    }

    /// The placement a scheduler may count on: compacted unless a gate holds the pages.
    fn placement(&self) -> Placement {
        if self.gated() {
            Placement::Now
        } else {
            Placement::Compacted
        }
    }

    fn joint_pages(&self, at: Placement) -> usize {
        Self::max_fitting(self.free_ids.available(), |k| {
            self.fits(PageDemand::joint(k), Reclaimable::default(), at)
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
        if let Some(swa) = &mut self.swa {
            swa.bind_each(ids.iter().rev().copied());
        }
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
                if let Some(swa) = &mut self.swa {
                    let psw = swa.take();
                    swa.bind(v, psw);
                }
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
        let compact = self.room_for(PageDemand::joint(pages))?;
        if compact {
            self.plan_compaction();
        }
        let device_work = self.issue_handout_work(Side::Full, pages, compact);
        if let Err(e) = device_work {
            self.drop_plans();
            return Err(e);
        }
        if compact {
            self.commit_compaction();
        }
        out.reserve(tokens);
        self.extend_unchecked(requests, pages, out);
        Ok(())
    }

    /// The device half of an allocation of `n` pages (`Side::Full`: FULL and any SWA
    /// page of each) or `n` slots (`Side::Mamba`): the planned moves, then the zeroing of
    /// the envelopes the binds will take (predicted from the state after the planned
    /// compaction). Changes no host table.
    fn issue_handout_work(&mut self, what: Side, n: usize, compact: bool) -> Result<(), Error> {
        if compact {
            self.issue_moves()?;
        }
        if self.zero_on_handout && n > 0 {
            let mut spans = std::mem::take(&mut self.spans);
            spans.clear();
            let packed = |side| {
                if compact {
                    self.planned_span(side)
                } else {
                    None
                }
            };
            let sides: &[Side] = match what {
                Side::Mamba => &[Side::Mamba],
                _ => &[Side::Full, Side::Swa],
            };
            for &side in sides {
                if let Some(sub) = self.side(side) {
                    sub.handout_envelopes(n, packed(side), &mut spans);
                }
            }
            let filled = self.device.fill_spans(self.buffer, &spans, 0);
            self.spans = spans;
            filled?;
        }
        Ok(())
    }

    /// One side's capacity views (an absent side: all zero).
    fn side_capacity(&self, side: Side) -> SideCapacity {
        let Some(sub) = self.side(side) else {
            return SideCapacity::default();
        };
        let demand = |k| match side {
            Side::Full => PageDemand::pages(k, 0),
            Side::Swa => PageDemand::pages(0, k),
            Side::Mamba => PageDemand::slots(k),
        };
        let (hi, total) = match side {
            Side::Full => (self.free_ids.available(), self.virtual_pages as usize - 1),
            Side::Swa => (
                sub.grid.pages as usize,
                (sub.grid.pages - sub.grid.min_page) as usize,
            ),
            Side::Mamba => (self.slot_ids.available(), self.virtual_slots as usize - 1),
        };
        let none = Reclaimable::default();
        let avail = Self::max_fitting(hi, |k| self.fits(demand(k), none, Placement::Now));
        let sched = Self::max_fitting(hi, |k| self.fits(demand(k), none, self.placement()));
        SideCapacity {
            available_pages: avail,
            schedulable_pages: sched.max(avail),
            allocated_pages: sub.live as usize,
            total_pages: total,
            hole_pages: sub.holes.len(),
            tombstones: sub.tombstones as usize,
        }
    }

    /// Hands out `n` slots (the caller checked the room), appending their ids to `out`.
    fn bind_slots(&mut self, n: usize, out: &mut Vec<VirtualSlot>) {
        let Some(mamba) = &mut self.mamba else { return };
        for _ in 0..n {
            let Some(s) = self.slot_ids.pop().filter(|&s| s != 0) else {
                self.scope.expect(&ROOM_CHECK, false, || {
                    "a slot allocation ran out of virtual slots past its room check".to_string()
                });
                return;
            };
            let p = mamba.take();
            mamba.bind(s, p);
            out.push(VirtualSlot(s));
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
    fn release_pages(&mut self, pages: impl ExactSizeIterator<Item = u32> + Clone) {
        let full = &self.full.v2p;
        if let Some(swa) = &mut self.swa {
            swa.release_each(
                pages.clone(),
                |v| v != 0 && full[v as usize] > 0,
                true,
                None,
            );
        }
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
        // One transaction, as a page allocation: room, planned compaction, device work
        // (moves, zeroing), and only then the tables.
        let compact = self.room_for(PageDemand::slots(n))?;
        if compact {
            self.plan_compaction();
        }
        if let Err(e) = self.issue_handout_work(Side::Mamba, n, compact) {
            self.drop_plans();
            return Err(e);
        }
        if compact {
            self.commit_compaction();
        }
        out.reserve(n);
        self.bind_slots(n, out);
        Ok(())
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
        self.fits_any(demand, Reclaimable::default())
    }

    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        if demand.mamba_slots > 0 && self.mamba.is_none() {
            return Err(Error::NoSlotPool {
                op: "ensure_capacity",
            });
        }
        frees::flush_deferred(self);
        if self.room_for(demand)? {
            self.compact()?;
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
                self.joint_pages(Placement::Compacted)
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
        if self.subs().all(|sub| !sub.has_dirty()) {
            return Ok(());
        }
        // Every side's entries first; they stay dirty until every scatter was issued, so
        // a failed upload is retried whole (re-scattering an entry is idempotent).
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.clear();
        let mut ends = [0usize; 3];
        for side in [Side::Full, Side::Swa, Side::Mamba] {
            if let Some(sub) = self.side(side) {
                sub.dirty_entries(&mut dirty);
            }
            ends[ix(side)] = dirty.len();
        }
        let mut from = 0;
        let mut scattered = Ok(());
        for side in [Side::Full, Side::Swa, Side::Mamba] {
            let entries = &dirty[from..ends[ix(side)]];
            from = ends[ix(side)];
            if let (false, Some(mirror)) = (entries.is_empty(), self.mirrors[ix(side)]) {
                scattered = self.device.scatter_table(mirror, entries);
                if scattered.is_err() {
                    break;
                }
            }
        }
        self.dirty = dirty;
        scattered?;
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
            && low.facing_byte() <= self.full.facing_byte()
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

impl Drop for UnifiedSwa {
    fn drop(&mut self) {
        // Tear-down; a failure here has nobody to report to.
        let _ = self.device.free_bytes(self.buffer);
        for t in self.mirrors.into_iter().flatten() {
            let _ = self.device.free_table(t);
        }
    }
}

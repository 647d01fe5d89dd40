//! A forwarding `KvAllocator` for tests, installed with `HybridCacheBuilder::wrap_allocator`:
//! it fails a chosen method once or the n-th fallible call, or loses one call's frees (fault
//! injection), and it can check, before forwarding
//! each free, that every page the free names is still owned — FULL live and not already
//! freed in the open group for FULL and two-sided frees, SWA live for SWA frees — so an id
//! recycled while an action naming it was unapplied would be caught where it happens.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use unikv::invariants::{Invariant, Scope};
use unikv::kernels::{BytesId, TableId};
use unikv::pools::{
    Capacity, DecodeRequest, DeferredKind, Error, ExtendRequest, FlushReport, FreeOp, Grid,
    KvAllocator, MoveGate, PageDemand, PageSize, PoolMap, ReclaimPlan, Reclaimable, Segment, Side,
    SwaState, VirtualPage, VirtualSlot, VirtualToken,
};

/// The methods a probe can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `free_group_end`.
    FreeGroupEnd,
    /// `free_group_begin`.
    FreeGroupBegin,
    /// `upload_mirror`.
    UploadMirror,
    /// The next kv-row free (`free_kv_row_segments`, or a `FreeOp::KvRow` of a batch) is
    /// dropped without freeing: pages leak, so the next step boundary finds conservation
    /// broken.
    LoseRowFrees,
}

/// What the test and the probe share.
#[derive(Debug, Default)]
pub struct ProbeState {
    /// The next call of this method fails (without forwarding) and clears it.
    pub fail_once: Option<Fault>,
    /// The fallible calls forwarded or failed so far (every method that returns a
    /// `Result`).
    pub fallible_calls: usize,
    /// The fallible call with this index fails (without forwarding), once.
    pub fail_call: Option<usize>,
    /// Faults injected so far (by `fail_once` or `fail_call`).
    pub injected: usize,
    /// Drop every kv-row free (not just the next): every release leaks its pages.
    pub lose_every_row_free: bool,
    /// Record one breach of this invariant into the allocator's scope at every mirror
    /// upload (once per step), where the inner allocator records its own.
    pub breach_each_upload: Option<&'static Invariant>,
    /// Check every free against the pages' ownership.
    pub check_frees: bool,
    /// Pages freed FULL or two-sided in the open group and not yet flushed.
    pending: HashSet<u32>,
    /// Pages each checked free named.
    pub pages_checked: usize,
    /// Frees that named a page not owned (should stay empty).
    pub violations: Vec<String>,
}

/// The wrapper; see the module docs.
#[derive(Debug)]
pub struct Probe {
    inner: Box<dyn KvAllocator>,
    state: Arc<Mutex<ProbeState>>,
}

/// Which side(s) a free releases.
#[derive(Clone, Copy, Debug)]
enum Freed {
    Both,
    Full,
    Swa,
}

impl ProbeState {
    /// A state that checks every free.
    pub fn checking_frees() -> ProbeState {
        ProbeState {
            check_frees: true,
            ..ProbeState::default()
        }
    }
}

impl Probe {
    /// Wraps `inner`; the test keeps `state`.
    pub fn new(inner: Box<dyn KvAllocator>, state: Arc<Mutex<ProbeState>>) -> Probe {
        Probe { inner, state }
    }

    fn state(&self) -> MutexGuard<'_, ProbeState> {
        self.state.lock().expect("probe state")
    }

    /// Whether `method` is armed (disarming it).
    fn armed(&self, method: Fault) -> bool {
        let mut s = self.state();
        let armed = s.fail_once == Some(method);
        if armed {
            s.fail_once = None;
        }
        armed
    }

    fn fault(&self, method: Fault) -> Result<(), Error> {
        if self.armed(method) {
            self.state().injected += 1;
            return Err(Error::BadConfig(format!("injected fault in {method:?}")));
        }
        Ok(())
    }

    /// Counts one fallible call of `method`; fails it when it is the armed index.
    fn gate(&self, method: &str) -> Result<(), Error> {
        let mut s = self.state();
        let index = s.fallible_calls;
        s.fallible_calls += 1;
        if s.fail_call == Some(index) {
            s.fail_call = None;
            s.injected += 1;
            return Err(Error::BadConfig(format!(
                "injected fault in {method} (fallible call {index})"
            )));
        }
        Ok(())
    }

    fn ps(&self) -> PageSize {
        self.inner.page_size()
    }

    /// Checks `pages` before a free of `what` and, for deferred frees, records them.
    fn check(&self, what: &str, freed: Freed, pages: impl IntoIterator<Item = VirtualPage>) {
        let mut s = self.state();
        if !s.check_frees {
            return;
        }
        let deferred = self.inner.in_free_group() && !matches!(freed, Freed::Swa);
        for page in pages {
            s.pages_checked += 1;
            let owned = match freed {
                Freed::Both | Freed::Full => {
                    self.inner.full_live(page) && !s.pending.contains(&page.0)
                }
                Freed::Swa => self.inner.swa_state(page) == SwaState::Live,
            };
            if !owned {
                let pending = s.pending.contains(&page.0);
                s.violations.push(format!(
                    "{what} names page {} ({:?} freed), which is not owned: FULL live {}, SWA \
                     {:?}, freed in the open group {}",
                    page.0,
                    freed,
                    self.inner.full_live(page),
                    self.inner.swa_state(page),
                    pending
                ));
            }
            if deferred {
                s.pending.insert(page.0);
            }
        }
    }

    fn segment_pages(&self, segment: Segment<'_>) -> Vec<VirtualPage> {
        let ps = self.ps();
        segment.reps(ps).map(|t| t.page(ps)).collect()
    }

    fn id_pages(&self, ids: &[VirtualToken]) -> Vec<VirtualPage> {
        let ps = self.ps();
        let mut pages: Vec<VirtualPage> = ids.iter().map(|t| t.page(ps)).collect();
        pages.dedup();
        pages
    }

    /// After any forwarded call: once nothing is deferred, nothing freed is pending.
    fn settle<R>(&self, result: R) -> R {
        if self.inner.pending_frees().iter().all(|&(_, n)| n == 0) {
            self.state().pending.clear();
        }
        result
    }
}

impl KvAllocator for Probe {
    fn page_size(&self) -> PageSize {
        self.inner.page_size()
    }
    fn virtual_pages(&self) -> u32 {
        self.inner.virtual_pages()
    }
    fn alloc_extend(
        &mut self,
        requests: &[ExtendRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        self.gate("alloc_extend")?;
        let r = self.inner.alloc_extend(requests, out);
        self.settle(r)
    }
    fn alloc_decode(
        &mut self,
        requests: &[DecodeRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        self.gate("alloc_decode")?;
        let r = self.inner.alloc_decode(requests, out);
        self.settle(r)
    }
    fn alloc_slots(&mut self, n: usize, out: &mut Vec<VirtualSlot>) -> Result<(), Error> {
        self.gate("alloc_slots")?;
        let r = self.inner.alloc_slots(n, out);
        self.settle(r)
    }
    fn free_slots(&mut self, slots: &[VirtualSlot]) -> Result<(), Error> {
        self.gate("free_slots")?;
        let r = self.inner.free_slots(slots);
        self.settle(r)
    }
    fn free(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        self.gate("free")?;
        self.check("free", Freed::Both, self.id_pages(ids));
        let r = self.inner.free(ids);
        self.settle(r)
    }
    fn free_swa(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        self.gate("free_swa")?;
        self.check("free_swa", Freed::Swa, self.id_pages(ids));
        let r = self.inner.free_swa(ids);
        self.settle(r)
    }
    fn free_full(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        self.gate("free_full")?;
        self.check("free_full", Freed::Full, self.id_pages(ids));
        let r = self.inner.free_full(ids);
        self.settle(r)
    }
    fn free_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        self.gate("free_segment")?;
        self.check("free_segment", Freed::Both, self.segment_pages(segment));
        let r = self.inner.free_segment(segment);
        self.settle(r)
    }
    fn free_swa_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        self.gate("free_swa_segment")?;
        self.check("free_swa_segment", Freed::Swa, self.segment_pages(segment));
        let r = self.inner.free_swa_segment(segment);
        self.settle(r)
    }
    fn free_full_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        self.gate("free_full_segment")?;
        self.check(
            "free_full_segment",
            Freed::Full,
            self.segment_pages(segment),
        );
        let r = self.inner.free_full_segment(segment);
        self.settle(r)
    }
    fn free_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error> {
        self.gate("free_segments")?;
        for &s in segments {
            self.check("free_segments", Freed::Both, self.segment_pages(s));
        }
        let r = self.inner.free_segments(segments);
        self.settle(r)
    }
    fn free_kv_row_segments(
        &mut self,
        row: &[VirtualToken],
        dead_lo: usize,
        cursor: usize,
        len: usize,
    ) -> Result<(), Error> {
        self.gate("free_kv_row_segments")?;
        if dead_lo <= cursor && cursor <= len && len <= row.len() {
            let full = self.segment_pages(Segment::of_row(row, dead_lo..cursor));
            self.check("free_kv_row_segments", Freed::Full, full);
            let both = self.segment_pages(Segment::of_row(row, cursor..len));
            self.check("free_kv_row_segments", Freed::Both, both);
        }
        if self.armed(Fault::LoseRowFrees) || self.state().lose_every_row_free {
            return Ok(());
        }
        let r = self.inner.free_kv_row_segments(row, dead_lo, cursor, len);
        self.settle(r)
    }
    fn transfer_swa(&mut self, from: Segment<'_>, to: Segment<'_>) -> Result<(), Error> {
        self.gate("transfer_swa")?;
        self.check("transfer_swa", Freed::Swa, self.segment_pages(from));
        let r = self.inner.transfer_swa(from, to);
        self.settle(r)
    }
    fn free_batch(&mut self, frees: &[FreeOp<'_>]) {
        let lose_rows = self.armed(Fault::LoseRowFrees) || self.state().lose_every_row_free;
        let mut kept = Vec::with_capacity(frees.len());
        for &op in frees {
            match op {
                FreeOp::Segment(s) => {
                    self.check("free_segment", Freed::Both, self.segment_pages(s))
                }
                FreeOp::FullSegment(s) => {
                    self.check("free_full_segment", Freed::Full, self.segment_pages(s))
                }
                FreeOp::SwaSegment(s) => {
                    self.check("free_swa_segment", Freed::Swa, self.segment_pages(s))
                }
                FreeOp::TransferSwa { from, .. } => {
                    self.check("transfer_swa", Freed::Swa, self.segment_pages(from))
                }
                FreeOp::KvRow {
                    row,
                    dead_lo,
                    cursor,
                    len,
                } => {
                    if dead_lo <= cursor && cursor <= len && len <= row.len() {
                        let full = self.segment_pages(Segment::of_row(row, dead_lo..cursor));
                        self.check("free_kv_row_segments", Freed::Full, full);
                        let both = self.segment_pages(Segment::of_row(row, cursor..len));
                        self.check("free_kv_row_segments", Freed::Both, both);
                    }
                    if lose_rows {
                        continue;
                    }
                }
                // Slots have no pages for the page checks.
                FreeOp::Slots(_) => {}
            }
            kept.push(op);
        }
        self.inner.free_batch(&kept);
        self.settle(());
    }
    fn free_group_begin(&mut self) -> Result<(), Error> {
        self.gate("free_group_begin")?;
        self.fault(Fault::FreeGroupBegin)?;
        self.inner.free_group_begin()
    }
    fn free_group_end(&mut self) -> Result<(), Error> {
        self.gate("free_group_end")?;
        self.fault(Fault::FreeGroupEnd)?;
        let r = self.inner.free_group_end();
        self.settle(r)
    }
    fn in_free_group(&self) -> bool {
        self.inner.in_free_group()
    }
    fn pending_frees(&self) -> [(DeferredKind, usize); 5] {
        self.inner.pending_frees()
    }
    fn flush_deferred(&mut self) -> bool {
        let r = self.inner.flush_deferred();
        self.settle(r)
    }
    fn flush(&mut self) -> Result<FlushReport, Error> {
        self.gate("flush")?;
        let r = self.inner.flush();
        self.settle(r)
    }
    fn allocation_fits(&self, demand: PageDemand) -> bool {
        self.inner.allocation_fits(demand)
    }
    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        self.gate("ensure_capacity")?;
        let r = self.inner.ensure_capacity(demand);
        self.settle(r)
    }
    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        let r = self.inner.reclaim_plan(demand, evictable);
        self.settle(r)
    }
    fn capacity(&self) -> Capacity {
        self.inner.capacity()
    }
    fn pool_map(&self) -> PoolMap {
        self.inner.pool_map()
    }
    fn move_gate(&self) -> MoveGate {
        self.inner.move_gate()
    }
    fn invariant_scope(&self) -> &Scope {
        self.inner.invariant_scope()
    }
    fn set_invariant_scope(&mut self, scope: Scope) {
        self.inner.set_invariant_scope(scope);
    }
    fn mirror_current(&self) -> bool {
        self.inner.mirror_current()
    }
    fn upload_mirror(&mut self) -> Result<(), Error> {
        self.gate("upload_mirror")?;
        let breach = self.state().breach_each_upload;
        if let Some(invariant) = breach {
            self.inner
                .invariant_scope()
                .expect(invariant, false, || "injected at the mirror upload".into());
        }
        self.fault(Fault::UploadMirror)?;
        self.inner.upload_mirror()
    }
    fn mirror_table(&self, side: Side) -> Option<TableId> {
        self.inner.mirror_table(side)
    }
    fn stride(&self, side: Side) -> u32 {
        self.inner.stride(side)
    }
    fn kernel_id(&self, side: Side, token: VirtualToken) -> i32 {
        self.inner.kernel_id(side, token)
    }
    fn translate(
        &self,
        side: Side,
        ids: TableId,
        n: usize,
        out: TableId,
        out_width: usize,
    ) -> Result<(), Error> {
        self.gate("translate")?;
        self.inner.translate(side, ids, n, out, out_width)
    }
    fn buffer(&self) -> BytesId {
        self.inner.buffer()
    }
    fn grid(&self, side: Side) -> Grid {
        self.inner.grid(side)
    }
    fn sink_floor(&self) -> u64 {
        self.inner.sink_floor()
    }
    fn physical_page(&self, side: Side, page: VirtualPage) -> Option<u32> {
        self.inner.physical_page(side, page)
    }
    fn physical_slot(&self, slot: VirtualSlot) -> Option<u32> {
        self.inner.physical_slot(slot)
    }
    fn copy_slots(&self, pairs: &[(VirtualSlot, VirtualSlot)]) -> Result<(), Error> {
        self.inner.copy_slots(pairs)
    }
    fn full_live(&self, page: VirtualPage) -> bool {
        self.inner.full_live(page)
    }
    fn swa_state(&self, page: VirtualPage) -> SwaState {
        self.inner.swa_state(page)
    }
    fn check_conservation(&self) -> bool {
        self.inner.check_conservation()
    }
    fn verify(&self) -> Result<(), String> {
        self.inner.verify()
    }
}

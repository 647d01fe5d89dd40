//! The operations every FULL/SWA allocator offers ([`KvAllocator`]) and the values they
//! take and return: requests, segments, demands, reclaim plans, capacity views, move gates.

use crate::error::Error;
use crate::ids::{PageSize, VirtualPage, VirtualSlot, VirtualToken};
use crate::spec::{Grid, Side};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use unikv_invariants::Scope;
use unikv_kernels::{BytesId, TableId};

/// One row of [`KvAllocator::translate_many`]: `n` virtual ids in the device table
/// `ids` translated against `side`'s mirror into `out`, zero-filled to `out_width`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideTranslation {
    /// The side whose mirror translates.
    pub side: Side,
    /// The virtual ids.
    pub ids: TableId,
    /// How many.
    pub n: usize,
    /// The output table.
    pub out: TableId,
    /// Width written to `out` (`>= n`).
    pub out_width: usize,
}

/// One request of an extend batch: its row grows from `prefix_len` to `seq_len` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtendRequest {
    /// Tokens the request already holds (its row's length before this extend).
    pub prefix_len: usize,
    /// Tokens it holds after this extend (`>= prefix_len`).
    pub seq_len: usize,
    /// The last token of the prefix (`row[prefix_len - 1]`); `None` when `prefix_len` is
    /// 0. Its page's free tail is filled before new pages are taken.
    pub last_token: Option<VirtualToken>,
}

/// One request of a decode batch: it grows by one token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeRequest {
    /// Tokens the request holds before this step.
    pub prefix_len: usize,
    /// Its last token (`row[prefix_len - 1]`); `None` when `prefix_len` is 0.
    pub last_token: Option<VirtualToken>,
}

impl From<DecodeRequest> for ExtendRequest {
    /// A decode is an extend by one token (`usize::MAX` saturates; the allocators refuse
    /// it as longer than the id space).
    fn from(d: DecodeRequest) -> ExtendRequest {
        ExtendRequest {
            prefix_len: d.prefix_len,
            seq_len: d.prefix_len.saturating_add(1),
            last_token: d.last_token,
        }
    }
}

impl ExtendRequest {
    /// New pages this request needs: `ceil(seq_len / ps) − ceil(prefix_len / ps)`, from
    /// host lengths only.
    #[inline]
    pub fn new_pages(&self, ps: PageSize) -> usize {
        ps.pages_for(self.seq_len) - ps.pages_for(self.prefix_len)
    }
}

/// A contiguous slice `row[start..start + tokens.len()]` of one request's row, with
/// `start` page-aligned: its pages are every page-size-th token (the page
/// representatives), known from host arithmetic, so freeing it needs no de-duplication.
/// The last page may be partly covered; it is released whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment<'a> {
    /// The row's tokens `start..start + len`.
    pub tokens: &'a [VirtualToken],
    /// Row position of `tokens[0]` (a multiple of the page size).
    pub start: usize,
}

impl<'a> Segment<'a> {
    /// The segment `row[range]`.
    pub fn of_row(row: &'a [VirtualToken], range: Range<usize>) -> Segment<'a> {
        Segment {
            start: range.start,
            tokens: &row[range],
        }
    }

    /// Row positions it covers.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.tokens.len()
    }

    /// Its page representatives: one token per page, by stride (no filter, no dedup).
    pub fn reps(&self, ps: PageSize) -> impl Iterator<Item = VirtualToken> + 'a {
        self.tokens.iter().copied().step_by(ps.get() as usize)
    }

    /// Its pages, in row order.
    pub fn pages(&self, ps: PageSize) -> impl Iterator<Item = VirtualPage> + 'a {
        self.reps(ps).map(move |t| t.page(ps))
    }

    /// How many pages it touches.
    pub fn page_count(&self, ps: PageSize) -> usize {
        ps.pages_for(self.tokens.len())
    }
}

/// One free of an infallible batch ([`KvAllocator::free_batch`]): the frees a caller makes
/// from host state it trusts (the facade applying the prefix tree's actions after the tree
/// changed). Each variant is one checked method's call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeOp<'a> {
    /// [`KvAllocator::free_segment`]: two-sided.
    Segment(Segment<'a>),
    /// [`KvAllocator::free_full_segment`]: FULL only.
    FullSegment(Segment<'a>),
    /// [`KvAllocator::free_swa_segment`]: SWA only (window eviction).
    SwaSegment(Segment<'a>),
    /// [`KvAllocator::transfer_swa`]: SWA ownership from `from` to `to`.
    TransferSwa {
        /// Pages live on SWA.
        from: Segment<'a>,
        /// SWA tombstones with live FULL.
        to: Segment<'a>,
    },
    /// [`KvAllocator::free_kv_row_segments`]: `row[dead_lo..len]` split at `cursor`.
    KvRow {
        /// The request's row.
        row: &'a [VirtualToken],
        /// First position freed.
        dead_lo: usize,
        /// The window cursor (FULL-only below, two-sided above).
        cursor: usize,
        /// The row's length.
        len: usize,
    },
    /// [`KvAllocator::free_slots`]: Mamba state slots.
    Slots(&'a [VirtualSlot]),
}

impl FreeOp<'_> {
    /// The checked method this op calls.
    pub const fn name(&self) -> &'static str {
        match self {
            FreeOp::Segment(_) => "free_segment",
            FreeOp::FullSegment(_) => "free_full_segment",
            FreeOp::SwaSegment(_) => "free_swa_segment",
            FreeOp::TransferSwa { .. } => "transfer_swa",
            FreeOp::KvRow { .. } => "free_kv_row_segments",
            FreeOp::Slots(_) => "free_slots",
        }
    }
}

/// Pages (and Mamba state slots) an operation needs on each side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageDemand {
    /// New FULL pages (each mints a virtual page).
    pub full_pages: usize,
    /// New SWA pages.
    pub swa_pages: usize,
    /// New Mamba state slots. An allocator without a slot pool cannot fit any
    /// ([`Error::NoSlotPool`] from [`KvAllocator::ensure_capacity`]).
    pub mamba_slots: usize,
}

impl PageDemand {
    /// The same number of pages on both sides (what an allocation binds), no slots.
    pub const fn joint(pages: usize) -> PageDemand {
        PageDemand::pages(pages, pages)
    }

    /// `full_pages` FULL and `swa_pages` SWA pages, no slots.
    pub const fn pages(full_pages: usize, swa_pages: usize) -> PageDemand {
        PageDemand {
            full_pages,
            swa_pages,
            mamba_slots: 0,
        }
    }

    /// `n` Mamba state slots, no pages.
    pub const fn slots(n: usize) -> PageDemand {
        PageDemand {
            full_pages: 0,
            swa_pages: 0,
            mamba_slots: n,
        }
    }
}

/// Pages (and Mamba state slots) the caller (the tree) could release by eviction, per
/// side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reclaimable {
    /// FULL pages evictable.
    pub full_pages: usize,
    /// SWA pages evictable.
    pub swa_pages: usize,
    /// Mamba state slots evictable.
    pub mamba_slots: usize,
}

impl Reclaimable {
    /// `full_pages` FULL and `swa_pages` SWA pages evictable, no slots.
    pub const fn pages(full_pages: usize, swa_pages: usize) -> Reclaimable {
        Reclaimable {
            full_pages,
            swa_pages,
            mamba_slots: 0,
        }
    }
}

/// What to evict so that a demand fits: the minimum SWA reclaim (with all FULL reclaim
/// allowed), then the minimum FULL reclaim given that SWA reclaim.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReclaimPlan {
    /// FULL pages to evict.
    pub full_pages: usize,
    /// SWA pages to evict.
    pub swa_pages: usize,
    /// Mamba state slots to evict (always 0 without a slot pool).
    pub mamba_slots: usize,
    /// A lower bound of the FULL reclaim any fit needs: the minimum FULL reclaim with
    /// all evictable SWA reclaimed too (`<= full_pages`). An evictor may evict this
    /// much FULL before it sizes the plan again.
    pub full_floor_pages: usize,
}

/// One side's capacity views, in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SideCapacity {
    /// Pages this side alone could get now, without compaction.
    pub available_pages: usize,
    /// Pages this side alone could get after compacting every sub-pool (equal to
    /// `available_pages` while moves are gated).
    pub schedulable_pages: usize,
    /// Pages bound (live) on this side.
    pub allocated_pages: usize,
    /// The side's static cap (conservation view: `cap − allocated` is its leak-check
    /// availability).
    pub total_pages: usize,
    /// Freed pages inside the span not yet compacted (unified) — always 0 for static.
    pub hole_pages: usize,
    /// SWA only: pages whose SWA was released while FULL stays (tombstones).
    pub tombstones: usize,
}

/// The capacity views of an allocator, in pages (slots for the Mamba side). Exact host
/// integers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    /// The page size.
    pub page_size: u32,
    /// FULL side.
    pub full: SideCapacity,
    /// SWA side (all zero without an SWA side).
    pub swa: SideCapacity,
    /// Mamba side, in slots (all zero without a slot pool).
    pub mamba: SideCapacity,
    /// What one slot costs in tokens of KV: `ceil(slot bytes / bytes of one token on
    /// every KV side)`, the exchange rate of the shared byte budget (0 without a slot
    /// pool, and for a static layout, whose pools do not share bytes).
    pub slot_price_tokens: usize,
    /// Pages a joint allocation (one FULL + one SWA page each) could get now.
    pub joint_available_pages: usize,
    /// The same after compaction (what schedulers should plan with).
    pub joint_schedulable_pages: usize,
}

/// Which deferred list of a free group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeferredKind {
    /// Set-shaped two-sided frees (tokens).
    Tokens,
    /// Two-sided segment frees (page representatives).
    PageReps,
    /// Set-shaped FULL-only frees (tokens).
    FullOnlyTokens,
    /// FULL-only segment frees (page representatives).
    FullOnlyPageReps,
    /// Mamba state slot frees.
    Slots,
}

/// A hold on physical addresses: while any gate of an allocator is alive, no compaction
/// moves a page of any of its sub-pools (one counter shared by every member, so a gate
/// cannot reach only some of them). Dropping it reopens.
#[derive(Debug)]
#[must_use = "the gate reopens when it is dropped"]
pub struct MoveGate {
    count: Arc<AtomicUsize>,
}

impl MoveGate {
    pub(crate) fn close(count: &Arc<AtomicUsize>) -> MoveGate {
        count.fetch_add(1, Ordering::AcqRel);
        MoveGate {
            count: Arc::clone(count),
        }
    }
}

impl Drop for MoveGate {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a flush did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Whether deferred frees were applied.
    pub deferred_flushed: bool,
    /// Page envelopes moved by compaction (both sides).
    pub pages_moved: usize,
    /// Whether compaction was skipped because a move gate is closed.
    pub gated: bool,
}

/// One sub-pool's region of the buffer, for [`PoolMap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanInfo {
    /// Which side.
    pub side: Side,
    /// Byte range `[low, high)` the side occupies (live pages and holes).
    pub bytes: (u64, u64),
    /// Bytes of one page envelope.
    pub envelope: u64,
    /// Pages the span holds (live + holes for unified; the fixed pool for static).
    pub pages: usize,
    /// Live pages.
    pub live: usize,
    /// Holes inside the span.
    pub holes: usize,
    /// SWA tombstones (0 for FULL).
    pub tombstones: usize,
}

/// Where each side lives in the buffer: a human-readable pool map (its `Display` is a
/// small table, low bytes first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolMap {
    /// `unified` or `static`.
    pub layout: &'static str,
    /// Tokens per page.
    pub page_size: u32,
    /// Bytes of the buffer.
    pub total_bytes: u64,
    /// Bytes of the reserved sink floor.
    pub sink_floor: u64,
    /// Each side's region, by ascending byte offset.
    pub spans: Vec<SpanInfo>,
}

impl std::fmt::Display for PoolMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} pool, page size {}, {} B (sink floor {} B)",
            self.layout, self.page_size, self.total_bytes, self.sink_floor
        )?;
        let mut at = self.sink_floor;
        for s in &self.spans {
            if s.bytes.0 > at {
                writeln!(f, "  free  [{:>10}, {:>10})", at, s.bytes.0)?;
            }
            write!(
                f,
                "  {:<5} [{:>10}, {:>10})  {} pages: {} live, {} holes",
                s.side.as_str(),
                s.bytes.0,
                s.bytes.1,
                s.pages,
                s.live,
                s.holes
            )?;
            if s.side == Side::Swa {
                write!(f, ", {} tombstones", s.tombstones)?;
            }
            writeln!(f, ", {} B/page", s.envelope)?;
            at = at.max(s.bytes.1);
        }
        if self.total_bytes > at {
            writeln!(f, "  free  [{:>10}, {:>10})", at, self.total_bytes)?;
        }
        Ok(())
    }
}

/// Whether a virtual page is bound on SWA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwaState {
    /// Bound to a live SWA page.
    Live,
    /// SWA released while FULL stays (`v2p = -1`).
    Tombstone,
    /// Never bound (or both sides freed) (`v2p = 0`).
    Unbound,
}

/// The operations of a FULL/SWA allocator, shared by the unified one-buffer allocator
/// ([`crate::UnifiedSwa`]) and the static paged baseline ([`crate::StaticSwa`]), so the
/// facade and the replay drive either through one interface. Everything here is host
/// bookkeeping: no method waits for the device.
///
/// Errors are for the caller's mistakes and shortfalls, and leave the allocator exactly
/// as it was. Breaches of a free's premise are invariants (see [`crate::invariants`]):
/// they are reported and contained, never filtered silently.
///
/// Every method is `#[track_caller]` (also through `dyn KvAllocator` and
/// [`Hooked`](crate::Hooked)), as every op of [`Device`](unikv_kernels::Device) is: a
/// hook sees the line that called the allocator (an allocator fault injected by a
/// [`Hooks::gate`](crate::Hooks::gate) names it), and so does a device wrapper for an op
/// a method issues in its own body.
pub trait KvAllocator: std::fmt::Debug + Send {
    /// Tokens per page.
    #[track_caller]
    fn page_size(&self) -> PageSize;

    /// The invariant scope this allocator counts its breaches in (its own, made at
    /// construction, until [`KvAllocator::set_invariant_scope`]). A wrapping allocator
    /// forwards both methods, so that its inner allocator records into the cache's scope.
    #[track_caller]
    fn invariant_scope(&self) -> &Scope;

    /// Counts this allocator's breaches in `scope` from now on (a cache hands it its own
    /// scope); breaches recorded before stay in the previous scope.
    #[track_caller]
    fn set_invariant_scope(&mut self, scope: Scope);

    /// Virtual pages of the id space (including the sink, page 0).
    #[track_caller]
    fn virtual_pages(&self) -> u32;

    /// Extends each request from `prefix_len` to `seq_len`, appending the new tokens' ids
    /// to `out` request by request. Each request's tail page is filled first; the count
    /// of new pages comes from host lengths; FULL and SWA are bound under the same new
    /// virtual pages. Short capacity: [`Error::OutOfCapacity`], nothing allocated, `out`
    /// untouched.
    #[track_caller]
    fn alloc_extend(
        &mut self,
        requests: &[ExtendRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error>;

    /// One token per request (tail reuse: most steps need no new page).
    #[track_caller]
    fn alloc_decode(
        &mut self,
        requests: &[DecodeRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error>;

    /// Set-shaped two-sided free (any ids, several per page): frees FULL, and SWA where it
    /// is live (the filter recovery paths rely on). Deferred inside a free group.
    #[track_caller]
    fn free(&mut self, ids: &[VirtualToken]) -> Result<(), Error>;

    /// Set-shaped SWA-only free: tombstones the pages whose SWA is live, skips the rest
    /// (filter kept). Never deferred.
    #[track_caller]
    fn free_swa(&mut self, ids: &[VirtualToken]) -> Result<(), Error>;

    /// Set-shaped FULL-only free: every page's SWA must already be released
    /// (`swa.peer_released`). Deferred inside a group.
    #[track_caller]
    fn free_full(&mut self, ids: &[VirtualToken]) -> Result<(), Error>;

    /// Two-sided segment free: every page's SWA is live (`swa.peer_mapped`), FULL released
    /// too. Fixed shape: page representatives by stride, no filter, no de-duplication.
    /// Deferred inside a group.
    #[track_caller]
    fn free_segment(&mut self, segment: Segment<'_>) -> Result<(), Error>;

    /// SWA-only segment free (window eviction): every page must be live on SWA
    /// (`swa.peer_mapped`); a page already released is a second ratchet
    /// (`swa.window_ratchet`). Fixed shape; never deferred.
    #[track_caller]
    fn free_swa_segment(&mut self, segment: Segment<'_>) -> Result<(), Error>;

    /// SWA-only frees of several segments, as [`KvAllocator::free_swa_segment`] of each in
    /// order: the window eviction of a whole decode batch in one call. Every segment's
    /// shape and range is checked before any page is freed, so a refused batch changes
    /// nothing. Never deferred.
    #[track_caller]
    fn free_swa_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error>;

    /// FULL-only segment free: every page must have no live SWA peer
    /// (`swa.peer_released`). Fixed shape; deferred inside a group through its own list.
    #[track_caller]
    fn free_full_segment(&mut self, segment: Segment<'_>) -> Result<(), Error>;

    /// Two-sided frees of ascending, page-disjoint segments of one row; two segments that
    /// touch one page are refused ([`Error::SegmentsShareAPage`]) before anything is freed.
    #[track_caller]
    fn free_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error>;

    /// Frees `row[dead_lo..len]` of a finishing request, split at its window `cursor`:
    /// `[dead_lo, cursor)` FULL-only (its SWA is already released), `[cursor, len)`
    /// two-sided. `cursor` is clamped into `[dead_lo, len]`; a cursor that splits a page
    /// between two non-empty halves is [`Error::SplitPage`].
    #[track_caller]
    fn free_kv_row_segments(
        &mut self,
        row: &[VirtualToken],
        dead_lo: usize,
        cursor: usize,
        len: usize,
    ) -> Result<(), Error>;

    /// Moves SWA ownership page by page from `from` (live on SWA) to `to` (an SWA
    /// tombstone with live FULL): `to` takes `from`'s SWA page and `from` becomes a
    /// tombstone. No SWA page is allocated or freed (tombstone recovery under a locked
    /// FULL).
    #[track_caller]
    fn transfer_swa(&mut self, from: Segment<'_>, to: Segment<'_>) -> Result<(), Error>;

    /// Allocates `n` Mamba state slots, appending their ids to `out`. Short capacity:
    /// [`Error::OutOfCapacity`]; no slot pool: [`Error::NoSlotPool`]. Either way nothing
    /// is allocated and `out` is untouched.
    #[track_caller]
    fn alloc_slots(&mut self, n: usize, out: &mut Vec<VirtualSlot>) -> Result<(), Error>;

    /// Frees Mamba state slots (each live, none named twice). Deferred inside a free
    /// group, through its own list. No slot pool: [`Error::NoSlotPool`]; a slot that
    /// cannot be freed: [`Error::BadSlot`]; either way nothing changed.
    #[track_caller]
    fn free_slots(&mut self, slots: &[VirtualSlot]) -> Result<(), Error>;

    /// Copies the state of each pair's first slot into its second (copy-on-write of a
    /// cached state into a request's own slot): one `move_spans` of whole slot envelopes
    /// for the batch, a host-known shape, no sync. Every slot must be live and no
    /// destination may be a source or named twice ([`Error::BadSlot`], nothing issued).
    /// Changes no table.
    #[track_caller]
    fn copy_slots(&self, pairs: &[(VirtualSlot, VirtualSlot)]) -> Result<(), Error>;

    /// The physical slot bound to `slot` (`None` when unbound, the sink, out of range,
    /// or without a slot pool). Its envelope is at byte `slot × grid(Side::Mamba).envelope`.
    #[track_caller]
    fn physical_slot(&self, slot: VirtualSlot) -> Option<u32>;

    /// Applies `frees` in order and cannot fail: the infallible mode of the free family,
    /// for frees the caller makes from host state it trusts, after a change it cannot
    /// undo (DESIGN §3: a failure inside a multi-step operation is impossible by
    /// construction, which the signature states). Each op runs through the same code as
    /// its checked method; an op the checked method would refuse with a typed error —
    /// which changes nothing — is recorded as a `pool.free_batch_well_formed` breach
    /// (FatalContainable) and skipped, and the rest of the batch is applied, so the
    /// allocator stays consistent. The premise checks of the frees (`swa.peer_mapped`,
    /// `pool.double_free`, ...) are recorded and contained as in the checked methods.
    ///
    /// A wrapping allocator forwards the batch whole to the allocator it wraps (never
    /// through its own checked methods, which it may fail on purpose).
    #[track_caller]
    fn free_batch(&mut self, frees: &[FreeOp<'_>]);

    /// Opens a free group: two-sided and FULL-only frees are deferred (cloned at enqueue)
    /// until the group ends or a flush exposes them. Groups do not nest.
    #[track_caller]
    fn free_group_begin(&mut self) -> Result<(), Error>;

    /// Applies every deferred free and closes the group.
    #[track_caller]
    fn free_group_end(&mut self) -> Result<(), Error>;

    /// Whether a free group is open.
    #[track_caller]
    fn in_free_group(&self) -> bool;

    /// Pending deferred frees per list (the one enumeration every flush site uses).
    #[track_caller]
    fn pending_frees(&self) -> [(DeferredKind, usize); 5];

    /// Applies every deferred free now and keeps the group open; returns whether anything
    /// was pending.
    #[track_caller]
    fn flush_deferred(&mut self) -> bool;

    /// The step-boundary flush: applies deferred frees (group stays open), compacts holes
    /// (moving page envelopes on the device, unless a move gate is closed) and checks
    /// conservation from `Warn` up. With no holes it issues no device work. A failed
    /// move leaves the tables as they were (the deferred frees stay applied).
    #[track_caller]
    fn flush(&mut self) -> Result<FlushReport, Error>;

    /// Whether `demand` fits now or after compaction. Pure: changes nothing.
    #[track_caller]
    fn allocation_fits(&self, demand: PageDemand) -> bool;

    /// Makes `demand` allocatable: flushes deferred frees, then compacts if that makes it
    /// fit. [`Error::OutOfCapacity`] when it cannot fit, or a device error when the
    /// compaction's move fails (either way the deferred frees stay applied, and nothing
    /// else changed). A slot demand without a slot pool: [`Error::NoSlotPool`], before
    /// anything is flushed.
    #[track_caller]
    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error>;

    /// Flushes every deferred list **first**, then sizes the eviction that makes `demand`
    /// fit: `Some` of the minimum SWA reclaim (all FULL reclaim allowed), then the minimum
    /// FULL reclaim given it, with [`ReclaimPlan::full_floor_pages`] the minimum FULL
    /// reclaim with all evictable SWA; all zero when it already fits; `None` when even
    /// reclaiming everything evictable would not do (and, without flushing, for a slot
    /// demand on an allocator without a slot pool).
    #[track_caller]
    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan>;

    /// The capacity views.
    #[track_caller]
    fn capacity(&self) -> Capacity;

    /// Where each side lives in the buffer (for reports and debugging).
    #[track_caller]
    fn pool_map(&self) -> PoolMap;

    /// Freezes compaction on every sub-pool until the gate drops.
    #[track_caller]
    fn move_gate(&self) -> MoveGate;

    /// The step boundary's mirror upload: one device op for every side with the dirty
    /// translation entries (none when nothing changed): the unified pool copies the
    /// changed spans of its host tables (`copy_table_spans`), the static pool scatters
    /// the entries it derives (`scatter_tables`). Transactional: the entries stay dirty
    /// until the op was issued, so after a failure a retry uploads them.
    #[track_caller]
    fn upload_mirror(&mut self) -> Result<(), Error>;

    /// Whether the device mirror holds the host tables (no entry changed since the last
    /// [`KvAllocator::upload_mirror`]). O(1). Any allocation, compaction, free or transfer
    /// makes it false until the next upload.
    #[track_caller]
    fn mirror_current(&self) -> bool;

    /// The device table that mirrors `side`'s translation (virtual page → physical page).
    /// It is current only while [`KvAllocator::mirror_current`] holds: within a step, an
    /// allocation may compact (moving pages and rewriting the host tables) and frees may
    /// release pages that a later allocation hands out again, so a kernel that reads the
    /// mirror between such a change and the upload would address stale pages.
    /// `None` for a side the allocator does not have ([`Side::Mamba`] without a slot pool).
    #[track_caller]
    fn mirror_table(&self, side: Side) -> Option<TableId>;

    /// Kernel rows per page envelope of `side`.
    #[track_caller]
    fn stride(&self, side: Side) -> u32;

    /// The kernel id of `token` on `side`, from host tables: `v2p[page] × stride + offset`,
    /// or 0 (the sink) when the page is unbound, tombstoned, 0 or out of range.
    #[track_caller]
    fn kernel_id(&self, side: Side, token: VirtualToken) -> i32;

    /// Issues the device translate of `n` virtual ids in `ids` to kernel ids in `out`
    /// (zero-filled up to `out_width`) against `side`'s mirror.
    ///
    /// **Mirror epochs:** refuses with [`Error::MirrorBehind`], issuing nothing, while the
    /// mirror is behind the host tables ([`KvAllocator::mirror_current`] is false), so a
    /// translate between an allocation (which may have compacted) and the step
    /// boundary's [`KvAllocator::upload_mirror`] cannot read stale pages. Upload first.
    #[track_caller]
    fn translate(
        &self,
        side: Side,
        ids: TableId,
        n: usize,
        out: TableId,
        out_width: usize,
    ) -> Result<(), Error>;

    /// [`KvAllocator::translate`] for several rows in one device op (a step's
    /// translation of every side: one launch on a GPU). Refused as a whole, issuing
    /// nothing, when any row is refused.
    #[track_caller]
    fn translate_many(&self, rows: &[SideTranslation]) -> Result<(), Error>;

    /// The device byte buffer both sides live in.
    #[track_caller]
    fn buffer(&self) -> BytesId;

    /// The grid of `side`: envelope bytes, pages, first page above the sink floor, stride.
    #[track_caller]
    fn grid(&self, side: Side) -> Grid;

    /// Bytes of the reserved sink floor at the low end of the buffer.
    #[track_caller]
    fn sink_floor(&self) -> u64;

    /// The physical page bound to `page` on `side` (`None` when unbound, tombstoned, the
    /// sink or out of range). Its envelope is at byte `page × grid(side).envelope`.
    #[track_caller]
    fn physical_page(&self, side: Side, page: VirtualPage) -> Option<u32>;

    /// Whether FULL is live for `page`.
    #[track_caller]
    fn full_live(&self, page: VirtualPage) -> bool;

    /// `page`'s SWA state.
    #[track_caller]
    fn swa_state(&self, page: VirtualPage) -> SwaState;

    /// The O(1) conservation checks (also run at every flush from `Warn` up); records
    /// `pool.conservation` and returns whether they held.
    #[track_caller]
    fn check_conservation(&self) -> bool;

    /// A full scan of every table against every counter (idle diagnostic, O(pool)):
    /// `Err` names the first discrepancy.
    #[track_caller]
    fn verify(&self) -> Result<(), String>;
}

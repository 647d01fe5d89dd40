//! The free family, written once over the page tables of either layout: fixed-shape
//! segment frees that check their premise as invariants, set-shaped frees that keep the
//! liveness filter, free groups with their deferred lists, and the one flush every
//! flush site calls.
//!
//! This file holds the page frees (set-shaped and segment), their checks and premises,
//! the SWA transfer and the infallible `free_batch`; `group` the free groups, their
//! deferred lists and the flush; `slots` the Mamba slot path; `methods` the
//! `KvAllocator` methods both layouts expand from one macro.

mod group;
mod methods;
mod slots;

use group::DeferredFrees;
pub(crate) use group::{FreeGroup, flush_deferred, group_begin, group_end};
pub(crate) use methods::{device_translation, free_family_methods};
pub(crate) use slots::{SlotCopy, copy_slots, free_slots};

use crate::api::{DeferredKind, ExtendRequest, FreeOp, Segment};
use crate::error::Error;
use crate::ids::{PageSize, VirtualPage, VirtualToken};
use crate::invariants::{
    DOUBLE_FREE, FREE_BATCH_WELL_FORMED, PEER_MAPPED, PEER_RELEASED, SEGMENT_SHAPE, SINK_RESERVED,
    WINDOW_RATCHET,
};
use crate::ramp::{RUN, is_ramp, steps};
use unikv_invariants::{Invariant, Scope, enabled};

/// The page tables a layout exposes to the free family.
pub(crate) trait PageTables {
    /// Tokens per page.
    fn ps(&self) -> PageSize;
    /// Virtual pages of the id space, sink included.
    fn virtual_pages(&self) -> u32;
    /// Whether FULL is live for virtual page `v` (`v` in range).
    fn full_live(&self, v: u32) -> bool;
    /// SWA entry of `v`: > 0 live, -1 tombstone, 0 unbound.
    fn swa_entry(&self, v: u32) -> i32;
    /// The invariant scope the free family records its premises' breaches in.
    fn scope(&self) -> &Scope;
    /// Releases `v`'s live SWA page; `tombstone` when FULL stays.
    fn release_swa(&mut self, v: u32, tombstone: bool);
    /// Releases `v`'s live FULL page and recycles the id (clears a tombstone).
    fn release_full(&mut self, v: u32);
    /// Moves the SWA page of `from` (live) to `to` (tombstone); `from` becomes a tombstone.
    fn move_swa(&mut self, from: u32, to: u32);
    /// A flush's release of `pages`, in order: every page that is live on FULL loses both
    /// sides, whatever its SWA state (a live SWA page is released, a tombstone cleared);
    /// the sink and pages not live on FULL are skipped. The same effect on every table
    /// and list, in the same order per list, as `release_page_silently` page by page (a
    /// test compares the two for every layout), in one batch pass.
    fn release_pages(&mut self, pages: &[u32]);
    /// A window release of `pages`, in order: each page live on SWA (and not the sink)
    /// becomes a tombstone as by `release_swa(v, true)`; the rest are left alone. One
    /// batch pass where the layout has one.
    fn tombstone_swa_pages(&mut self, pages: &[u32]) {
        for &v in pages {
            if v != 0 && self.swa_entry(v) > 0 {
                self.release_swa(v, true);
            }
        }
    }
    /// Whether pages `v..v + n` (in range) are all live on FULL, none the sink, and each
    /// SWA entry keeps `want` (when given): [`check_at_enqueue`]'s premises, with no
    /// report. Page by page unless the layout reads its tables as slices.
    fn run_clean(&self, v: u32, n: usize, want: Option<SwaWant>) -> bool {
        (v..v + n as u32).fold(v != 0, |ok, p| {
            ok & self.full_live(p) & want.is_none_or(|w| w.holds(self.swa_entry(p)))
        })
    }
    /// Whether the layout has an SWA side. Without one (a FULL/Mamba layout) a
    /// two-sided free is a FULL free with no SWA premise, and SWA-only frees and
    /// transfers are refused ([`Error::NoSwaSide`]).
    fn has_swa(&self) -> bool;
    /// Virtual slots of the slot id space, sink included; 0 without a slot pool.
    fn slot_ids(&self) -> u32;
    /// Whether slot `s` (in range) is allocated.
    fn slot_live(&self, s: u32) -> bool;
    /// Releases live Mamba slot `s` and recycles its id. Reached only through
    /// [`free_slots`], which checked `s` (so a layout without a slot pool never is).
    fn release_slot(&mut self, s: u32);
    /// The free group state.
    fn group(&mut self) -> &mut FreeGroup;
    /// The free group state, shared.
    fn group_ref(&self) -> &FreeGroup;
}

/// Calls `f(v, n)` for the pages of `pages` in order: `n` = [`RUN`] for a chunk of pages
/// that ascend by one from `v` (a page-size-1 row, whose table entries are then one
/// slice), `n` = 1 for each other page (the next [`RUN`] go one by one after a chunk that
/// does not run).
#[inline(always)]
fn for_each_run(pages: &[u32], mut f: impl FnMut(u32, usize)) {
    let ascending = steps(1);
    let mut i = 0;
    while i < pages.len() {
        if let Some(chunk) = pages[i..].first_chunk::<RUN>()
            && is_ramp(chunk, chunk[0], &ascending)
        {
            f(chunk[0], RUN);
            i += RUN;
            continue;
        }
        let end = (i + RUN).min(pages.len());
        for &v in &pages[i..end] {
            f(v, 1);
        }
        i = end;
    }
}

/// Refuses an extend request whose lengths disagree, and adds its new pages and tokens to
/// the batch's totals without overflow.
pub(crate) fn check_request(
    index: usize,
    r: &ExtendRequest,
    ps: PageSize,
    totals: &mut (usize, usize),
) -> Result<(), Error> {
    if r.seq_len < r.prefix_len {
        return Err(Error::BadRequest {
            index,
            reason: format!("seq_len {} < prefix_len {}", r.seq_len, r.prefix_len),
        });
    }
    // Saturating: a saturated demand never fits, so it is refused as out of capacity,
    // with the true (or saturated, never wrapped) page count.
    let (pages, tokens) = totals;
    *pages = pages.saturating_add(r.new_pages(ps));
    *tokens = tokens.saturating_add(r.seq_len - r.prefix_len);
    Ok(())
}

/// Refuses a token outside the id space.
pub(crate) fn check_tokens<T: PageTables + ?Sized>(
    t: &T,
    ids: &[VirtualToken],
) -> Result<(), Error> {
    let limit = t.virtual_pages() as u64 * t.ps().get() as u64;
    match ids.iter().find(|id| id.0 as u64 >= limit) {
        Some(&token) => Err(Error::TokenOutOfRange {
            token,
            pages: t.virtual_pages(),
        }),
        None => Ok(()),
    }
}

/// Refuses a segment that is not page-aligned or holds an out-of-range id; reports (from
/// `Warn` up) a representative that is not the first token of its page.
pub(crate) fn check_segment<T: PageTables + ?Sized>(t: &T, seg: &Segment<'_>) -> Result<(), Error> {
    let ps = t.ps();
    if seg.tokens.is_empty() {
        return Ok(());
    }
    if !ps.is_aligned(seg.start) {
        return Err(Error::UnalignedSegment {
            start: seg.start,
            page_size: ps.get(),
        });
    }
    let first = seg.tokens[0];
    if first.offset(ps) != 0 {
        return Err(Error::SegmentStartsMidPage {
            start: seg.start,
            token: first,
            offset: first.offset(ps),
            page_size: ps.get(),
        });
    }
    let limit = t.virtual_pages() as u64 * ps.get() as u64;
    // At page size 1 every token is a representative: one branch-free maximum (which
    // vectorises) decides, and only a failing segment looks for its first offender.
    let out_of_range = if ps.get() == 1 {
        seg.tokens.iter().map(|t| t.0).max().unwrap_or(0) as u64 >= limit
    } else {
        seg.reps(ps).any(|token| token.0 as u64 >= limit)
    };
    if out_of_range && let Some(token) = seg.reps(ps).find(|token| token.0 as u64 >= limit) {
        return Err(Error::TokenOutOfRange {
            token,
            pages: t.virtual_pages(),
        });
    }
    if enabled() && ps.get() > 1 {
        for (i, token) in seg.reps(ps).enumerate() {
            t.scope().expect(&SEGMENT_SHAPE, token.offset(ps) == 0, || {
                format!(
                    "segment at {}: representative {i} ({token}) is not the first token of its page",
                    seg.start
                )
            });
        }
    }
    Ok(())
}

/// Refuses an SWA operation on a layout without an SWA side.
fn require_swa<T: PageTables + ?Sized>(t: &T, op: &'static str) -> Result<(), Error> {
    if t.has_swa() {
        Ok(())
    } else {
        Err(Error::NoSwaSide { op })
    }
}

/// Whether `v` is the sink; reports it (the sink is never freed).
#[inline]
fn is_sink(scope: &Scope, v: u32, op: &'static str) -> bool {
    !scope.expect(&SINK_RESERVED, v != 0, || {
        format!("{op}: the sink page was handed to a free")
    })
}

/// How a two-sided page free treats a page whose SWA is not live.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SwaPremise {
    /// Set-shaped: filter silently (recovery paths rely on it).
    Filter,
    /// Segment: the SWA must be live (`swa.peer_mapped`).
    MustBeLive,
}

/// Frees both sides of `v` (containment always; reports only when `report`).
#[inline]
fn two_sided_page<T: PageTables + ?Sized>(t: &mut T, v: u32, premise: SwaPremise, report: bool) {
    if v == 0 {
        if report {
            is_sink(t.scope(), v, "two-sided free");
        }
        return;
    }
    if !t.full_live(v) {
        if report {
            t.scope().expect(&DOUBLE_FREE, false, || {
                format!("two-sided free of virtual page {v}, which is not live on FULL")
            });
        }
        return;
    }
    let swa = t.swa_entry(v);
    if swa > 0 {
        t.release_swa(v, false);
    } else if report && premise == SwaPremise::MustBeLive && t.has_swa() {
        t.scope().expect(&PEER_MAPPED, false, || {
            format!(
                "two-sided segment free of virtual page {v}, whose SWA is not live ({swa}): the caller wants a FULL-only free"
            )
        });
    }
    t.release_full(v);
}

/// Frees only FULL of `v`; a live SWA peer is reported and released too (containment).
#[inline]
fn full_only_page<T: PageTables + ?Sized>(t: &mut T, v: u32, report: bool) {
    if v == 0 {
        if report {
            is_sink(t.scope(), v, "FULL-only free");
        }
        return;
    }
    if !t.full_live(v) {
        if report {
            t.scope().expect(&DOUBLE_FREE, false, || {
                format!("FULL-only free of virtual page {v}, which is not live on FULL")
            });
        }
        return;
    }
    if t.swa_entry(v) > 0 {
        if report {
            t.scope().expect(&PEER_RELEASED, false, || {
                format!("FULL-only free of virtual page {v}, whose SWA page is still bound")
            });
        }
        t.release_swa(v, false);
    }
    t.release_full(v);
}

/// A flush's release of one page: containment only (its premises were checked at
/// enqueue). With `report` off, [`two_sided_page`] under either premise and
/// [`full_only_page`] are this same transition. The reference every layout's batch
/// [`PageTables::release_pages`] is tested against.
#[cfg(test)]
pub(crate) fn release_page_silently<T: PageTables + ?Sized>(t: &mut T, v: u32) {
    if v == 0 || !t.full_live(v) {
        return;
    }
    if t.swa_entry(v) > 0 {
        t.release_swa(v, false);
    }
    t.release_full(v);
}

/// Checks (without freeing) the premises a deferred free will rely on, at enqueue.
fn check_at_enqueue<T: PageTables + ?Sized>(t: &T, v: u32, kind: DeferredKind) {
    if is_sink(t.scope(), v, "deferred free") {
        return;
    }
    if !t.scope().expect(&DOUBLE_FREE, t.full_live(v), || {
        format!("deferred free of virtual page {v}, which is not live on FULL")
    }) {
        return;
    }
    let swa = t.swa_entry(v);
    let Some((invariant, want)) = swa_premise(t, kind) else {
        return;
    };
    t.scope().expect(invariant, want.holds(swa), || match kind {
        DeferredKind::PageReps => format!(
            "two-sided segment free of virtual page {v}, whose SWA is not live ({swa}): the caller wants a FULL-only free"
        ),
        _ => format!("FULL-only free of virtual page {v}, whose SWA page is still bound"),
    });
}

/// A premise on a page's SWA entry: the invariant a breach breaks, and whether an entry
/// keeps it.
type SwaRule = (&'static Invariant, SwaWant);

/// What a premise wants of a page's SWA entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SwaWant {
    /// Live (> 0).
    Live,
    /// Released (a tombstone or unbound, <= 0).
    Released,
}

impl SwaWant {
    /// Whether SWA entry `e` keeps the premise.
    #[inline(always)]
    pub(crate) fn holds(self, e: i32) -> bool {
        match self {
            SwaWant::Live => e > 0,
            SwaWant::Released => e <= 0,
        }
    }
}

/// What a deferred free of `kind` requires of a page's SWA entry, and the invariant a
/// breach breaks: live for a two-sided segment free (with an SWA side), released for a
/// FULL-only free, nothing otherwise.
fn swa_premise<T: PageTables + ?Sized>(t: &T, kind: DeferredKind) -> Option<SwaRule> {
    match kind {
        DeferredKind::PageReps if t.has_swa() => Some((&PEER_MAPPED, SwaWant::Live)),
        DeferredKind::FullOnlyTokens | DeferredKind::FullOnlyPageReps => {
            Some((&PEER_RELEASED, SwaWant::Released))
        }
        DeferredKind::PageReps | DeferredKind::Tokens | DeferredKind::Slots => None,
    }
}

/// Whether [`check_at_enqueue`] passes for every one of `pages`, without a report: the
/// same premises, folded without a branch per page (a row's runs of pages as slices).
fn enqueue_clean<T: PageTables + ?Sized>(t: &T, pages: &[u32], kind: DeferredKind) -> bool {
    let want = swa_premise(t, kind).map(|(_, want)| want);
    let mut ok = true;
    for_each_run(pages, |v, n| ok &= t.run_clean(v, n, want));
    ok
}

fn sorted_pages(ps: PageSize, ids: &[VirtualToken], scratch: &mut Vec<u32>) {
    scratch.clear();
    scratch.extend(ids.iter().map(|t| t.page(ps).0));
    scratch.sort_unstable();
    scratch.dedup();
}

/// Borrows the group's scratch buffer (so set-shaped frees do not allocate per call).
fn take_scratch<T: PageTables + ?Sized>(t: &mut T) -> Vec<u32> {
    std::mem::take(&mut t.group().scratch)
}

fn put_scratch<T: PageTables + ?Sized>(t: &mut T, scratch: Vec<u32>) {
    t.group().scratch = scratch;
}

/// Set-shaped two-sided free.
pub(crate) fn free<T: PageTables + ?Sized>(t: &mut T, ids: &[VirtualToken]) -> Result<(), Error> {
    check_tokens(t, ids)?;
    let ps = t.ps();
    let mut pages = take_scratch(t);
    sorted_pages(ps, ids, &mut pages);
    if t.group_ref().open {
        if enabled() {
            for &v in &pages {
                check_at_enqueue(t, v, DeferredKind::Tokens);
            }
            let scope = t.scope().clone();
            t.group().note_pages(&scope, &pages);
        }
        t.group().deferred.tokens.extend_from_slice(ids);
    } else {
        for &v in &pages {
            two_sided_page(t, v, SwaPremise::Filter, true);
        }
    }
    put_scratch(t, pages);
    Ok(())
}

/// Set-shaped SWA-only free, filtered by liveness; never deferred.
pub(crate) fn free_swa<T: PageTables + ?Sized>(
    t: &mut T,
    ids: &[VirtualToken],
) -> Result<(), Error> {
    require_swa(t, "free_swa")?;
    check_tokens(t, ids)?;
    let mut pages = take_scratch(t);
    sorted_pages(t.ps(), ids, &mut pages);
    for &v in &pages {
        if is_sink(t.scope(), v, "free_swa") {
            continue;
        }
        if t.swa_entry(v) > 0 {
            t.release_swa(v, true);
        }
    }
    put_scratch(t, pages);
    Ok(())
}

/// Set-shaped FULL-only free.
pub(crate) fn free_full<T: PageTables + ?Sized>(
    t: &mut T,
    ids: &[VirtualToken],
) -> Result<(), Error> {
    check_tokens(t, ids)?;
    let mut pages = take_scratch(t);
    sorted_pages(t.ps(), ids, &mut pages);
    if t.group_ref().open {
        if enabled() {
            for &v in &pages {
                check_at_enqueue(t, v, DeferredKind::FullOnlyTokens);
            }
            let scope = t.scope().clone();
            t.group().note_pages(&scope, &pages);
        }
        t.group().deferred.full_only_tokens.extend_from_slice(ids);
    } else {
        for &v in &pages {
            full_only_page(t, v, true);
        }
    }
    put_scratch(t, pages);
    Ok(())
}

/// Appends `seg`'s pages to a deferred list; at page size 1 a token is its page, and the
/// exact-size copy needs no capacity check per page.
fn extend_pages(ps: PageSize, seg: &Segment<'_>, list: &mut Vec<u32>) {
    if ps.get() == 1 {
        list.extend(seg.tokens.iter().map(|t| t.0));
    } else {
        list.extend(seg.pages(ps).map(|v| v.0));
    }
}

/// Two-sided segment free (fixed shape).
pub(crate) fn free_segment<T: PageTables + ?Sized>(
    t: &mut T,
    seg: Segment<'_>,
) -> Result<(), Error> {
    free_segment_pages(
        t,
        seg,
        DeferredKind::PageReps,
        |d| &mut d.page_reps,
        |t, v| two_sided_page(t, v, SwaPremise::MustBeLive, true),
    )
}

/// FULL-only segment free (fixed shape), deferred through its own list.
pub(crate) fn free_full_segment<T: PageTables + ?Sized>(
    t: &mut T,
    seg: Segment<'_>,
) -> Result<(), Error> {
    free_segment_pages(
        t,
        seg,
        DeferredKind::FullOnlyPageReps,
        |d| &mut d.full_only_page_reps,
        |t, v| full_only_page(t, v, true),
    )
}

/// The shape both deferrable segment frees share: inside a group, check each page's
/// premise at enqueue (from `Warn` up) and defer the pages to `list`; outside one,
/// `apply` each page now.
fn free_segment_pages<T: PageTables + ?Sized>(
    t: &mut T,
    seg: Segment<'_>,
    kind: DeferredKind,
    list: fn(&mut DeferredFrees) -> &mut Vec<u32>,
    apply: impl Fn(&mut T, u32),
) -> Result<(), Error> {
    check_segment(t, &seg)?;
    let ps = t.ps();
    if t.group_ref().open {
        if !enabled() {
            extend_pages(ps, &seg, list(&mut t.group().deferred));
            return Ok(());
        }
        let mut pages = take_scratch(t);
        pages.clear();
        extend_pages(ps, &seg, &mut pages);
        // The common case, every check passing, is one branch-free pass over a slice;
        // only a breach pays for the reporting checks, which then say what failed.
        if !enqueue_clean(t, &pages, kind) {
            for &v in &pages {
                check_at_enqueue(t, v, kind);
            }
        }
        let scope = t.scope().clone();
        t.group().note_pages(&scope, &pages);
        list(&mut t.group().deferred).extend_from_slice(&pages);
        put_scratch(t, pages);
        return Ok(());
    }
    for v in seg.pages(ps) {
        apply(t, v.0);
    }
    Ok(())
}

/// SWA-only segment free (fixed shape, window eviction); never deferred.
pub(crate) fn free_swa_segment<T: PageTables + ?Sized>(
    t: &mut T,
    seg: Segment<'_>,
) -> Result<(), Error> {
    swa_segments(t, std::slice::from_ref(&seg), "free_swa_segment")
}

/// SWA-only frees of several segments (a decode batch's window eviction): every segment
/// is checked before any page is freed, then each is freed as by `free_swa_segment`, in
/// order. Never deferred.
pub(crate) fn free_swa_segments<T: PageTables + ?Sized>(
    t: &mut T,
    segments: &[Segment<'_>],
) -> Result<(), Error> {
    swa_segments(t, segments, "free_swa_segments")
}

/// The SWA-only segment frees, one segment or a batch: all checked, then all released.
fn swa_segments<T: PageTables + ?Sized>(
    t: &mut T,
    segments: &[Segment<'_>],
    op: &'static str,
) -> Result<(), Error> {
    require_swa(t, op)?;
    for seg in segments {
        check_segment(t, seg)?;
    }
    let ps = t.ps();
    let clean = || {
        let pages = segments
            .iter()
            .flat_map(|seg| seg.tokens.iter().map(|t| t.0));
        pages.fold(true, |ok, v| ok & (v != 0) & (t.swa_entry(v) > 0))
    };
    if ps.get() == 1 && (!enabled() || clean()) {
        // Nothing to report (the checks are off, or every page is live on SWA and not
        // the sink, which one branch-free pass tells), and a token is its page: the pages
        // become tombstones in one batch pass (what the loop below does, less its
        // reports), with slice writes for a prefill's runs. Larger pages make short
        // lists, for which the loop is cheaper than the pass's set-up.
        let mut pages = take_scratch(t);
        pages.clear();
        for seg in segments {
            pages.extend(seg.tokens.iter().map(|t| t.0));
        }
        t.tombstone_swa_pages(&pages);
        put_scratch(t, pages);
        return Ok(());
    }
    for v in segments.iter().flat_map(|seg| seg.pages(ps)) {
        let v = v.0;
        if is_sink(t.scope(), v, op) {
            continue;
        }
        let swa = t.swa_entry(v);
        if swa > 0 {
            t.release_swa(v, true);
        } else if swa < 0 {
            t.scope().expect(&WINDOW_RATCHET, false, || {
                format!(
                    "out-of-window free of virtual page {v}, whose SWA is already released: the cursor ratcheted twice over it"
                )
            });
        } else {
            t.scope().expect(&PEER_MAPPED, false, || {
                format!("SWA-only free of virtual page {v}, which is not bound on SWA")
            });
        }
    }
    Ok(())
}

/// Checks that segments are ascending and page-disjoint. Empty segments touch no page
/// and are skipped; each non-empty segment is compared with the previous non-empty one
/// (so an empty segment between two overlapping ones cannot hide the overlap).
pub(crate) fn check_disjoint(ps: PageSize, segments: &[Segment<'_>]) -> Result<(), Error> {
    let mut previous: Option<&Segment<'_>> = None;
    for b in segments.iter().filter(|s| !s.tokens.is_empty()) {
        if let Some(a) = previous {
            // `start + len - 1` of a non-empty slice of a row cannot overflow a real row;
            // saturate for a hand-built segment.
            let a_last_page = a.start.saturating_add(a.tokens.len() - 1) / ps.get() as usize;
            let b_first_page = b.start / ps.get() as usize;
            if b_first_page <= a_last_page {
                return Err(Error::SegmentsShareAPage {
                    first: a.range(),
                    second: b.range(),
                });
            }
        }
        previous = Some(b);
    }
    Ok(())
}

/// Two-sided frees of page-disjoint segments.
pub(crate) fn free_segments<T: PageTables + ?Sized>(
    t: &mut T,
    segments: &[Segment<'_>],
) -> Result<(), Error> {
    check_disjoint(t.ps(), segments)?;
    for seg in segments {
        check_segment(t, seg)?;
    }
    for seg in segments {
        free_segment(t, *seg)?;
    }
    Ok(())
}

/// `row[dead_lo..len]` split at the cursor: FULL-only below, two-sided above.
pub(crate) fn free_kv_row_segments<T: PageTables + ?Sized>(
    t: &mut T,
    row: &[VirtualToken],
    dead_lo: usize,
    cursor: usize,
    len: usize,
) -> Result<(), Error> {
    let ps = t.ps();
    if len > row.len() || dead_lo > len {
        return Err(Error::RowRange {
            start: dead_lo,
            end: len,
            len: row.len(),
        });
    }
    if !ps.is_aligned(dead_lo) {
        return Err(Error::UnalignedSegment {
            start: dead_lo,
            page_size: ps.get(),
        });
    }
    let cursor = cursor.clamp(dead_lo, len);
    if dead_lo < cursor && cursor < len && !ps.is_aligned(cursor) {
        return Err(Error::SplitPage {
            cursor,
            page_size: ps.get(),
        });
    }
    let full_only = Segment::of_row(row, dead_lo..cursor);
    let two_sided = Segment::of_row(row, cursor..len);
    check_segment(t, &full_only)?;
    check_segment(t, &two_sided)?;
    free_full_segment(t, full_only)?;
    free_segment(t, two_sided)
}

/// Moves SWA ownership from `from`'s pages to `to`'s pages.
pub(crate) fn transfer_swa<T: PageTables + ?Sized>(
    t: &mut T,
    from: Segment<'_>,
    to: Segment<'_>,
) -> Result<(), Error> {
    require_swa(t, "transfer_swa")?;
    check_segment(t, &from)?;
    check_segment(t, &to)?;
    let ps = t.ps();
    if from.page_count(ps) != to.page_count(ps) {
        return Err(Error::BadTransfer {
            from: from.pages(ps).next().unwrap_or_default(),
            to: to.pages(ps).next().unwrap_or_default(),
            reason: "the segments cover different numbers of pages",
        });
    }
    // A page named twice (as a source or as a target) would pass the per-page checks
    // below, all read before any move, and then break the second move.
    let mut seen: Vec<u32> = from.pages(ps).map(|v| v.0).collect();
    let sources = seen.len();
    seen.extend(to.pages(ps).map(|v| v.0));
    let (src, dst) = seen.split_at_mut(sources);
    src.sort_unstable();
    dst.sort_unstable();
    for pages in [&*src, &*dst] {
        if let Some(w) = pages.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::BadTransfer {
                from: VirtualPage(w[0]),
                to: VirtualPage(w[0]),
                reason: "a page is named twice",
            });
        }
    }
    for (f, d) in from.pages(ps).zip(to.pages(ps)) {
        let reason = if f.0 == 0 || d.0 == 0 {
            Some("the sink cannot be transferred")
        } else if t.swa_entry(f.0) <= 0 {
            Some("the source is not live on SWA")
        } else if t.swa_entry(d.0) != -1 || !t.full_live(d.0) {
            Some("the target is not an SWA tombstone with live FULL")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(Error::BadTransfer {
                from: f,
                to: d,
                reason,
            });
        }
    }
    for (f, d) in from.pages(ps).zip(to.pages(ps)) {
        t.move_swa(f.0, d.0);
    }
    Ok(())
}

/// The infallible mode of the free family ([`crate::KvAllocator::free_batch`]): each op
/// runs through its checked function, the error-returning mode of the same code; a
/// refusal (which changed nothing) is recorded as a `pool.free_batch_well_formed` breach
/// and the op is skipped. Written over the page tables, not the trait, so no wrapper
/// stands between the batch and the frees.
pub(crate) fn free_batch<T: PageTables + ?Sized>(t: &mut T, frees: &[FreeOp<'_>]) {
    for op in frees {
        let result = match *op {
            FreeOp::Segment(seg) => free_segment(t, seg),
            FreeOp::FullSegment(seg) => free_full_segment(t, seg),
            FreeOp::SwaSegment(seg) => free_swa_segment(t, seg),
            FreeOp::TransferSwa { from, to } => transfer_swa(t, from, to),
            FreeOp::KvRow {
                row,
                dead_lo,
                cursor,
                len,
            } => free_kv_row_segments(t, row, dead_lo, cursor, len),
            FreeOp::Slots(slots) => free_slots(t, slots),
        };
        if let Err(e) = result {
            t.scope().expect(&FREE_BATCH_WELL_FORMED, false, || {
                format!(
                    "{} of an infallible free batch refused ({e}): skipped",
                    op.name()
                )
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvAllocator, Side};

    /// Applies the same calls to two allocators, releases `pages` through the layout's
    /// batch `release_pages` in one and `release_page_silently` page by page in the other,
    /// and checks that they agree on everything: tables, counts, holes (through the pages
    /// the next allocation takes) and the full scan.
    fn batch_release_matches<A: KvAllocator + PageTables>(mut batch: A, mut single: A, ps: usize) {
        let mut rows = Vec::new();
        for a in [&mut batch, &mut single] {
            let mut row = Vec::new();
            a.alloc_extend(
                &[crate::ExtendRequest {
                    prefix_len: 0,
                    seq_len: 12 * ps,
                    last_token: None,
                }],
                &mut row,
            )
            .unwrap();
            // Tombstones on the first four pages.
            a.free_swa_segment(crate::Segment::of_row(&row, 0..4 * ps))
                .unwrap();
            rows.push(row);
        }
        assert_eq!(rows[0], rows[1]);
        let page = |i: usize| rows[0][i * ps].page(batch.ps()).0;
        // Live pages, tombstones, a repeat, the sink and a page that is not live.
        let pages = [
            page(1),
            page(6),
            0,
            page(6),
            page(2),
            page(9),
            page(11) + 1,
            page(0),
        ];
        batch.release_pages(&pages);
        for &v in &pages {
            release_page_silently(&mut single, v);
        }
        let view = |a: &A| {
            let tables: Vec<_> = (0..KvAllocator::virtual_pages(a))
                .map(|v| {
                    let page = VirtualPage(v);
                    (
                        a.physical_page(Side::Full, page),
                        a.physical_page(Side::Swa, page),
                        a.swa_state(page),
                    )
                })
                .collect();
            (tables, a.capacity(), a.pool_map(), a.verify())
        };
        assert_eq!(view(&batch), view(&single));
        let next = |a: &mut A| {
            let mut out = Vec::new();
            a.alloc_extend(
                &[crate::ExtendRequest {
                    prefix_len: 0,
                    seq_len: 5 * ps,
                    last_token: None,
                }],
                &mut out,
            )
            .unwrap();
            let ps = a.ps();
            out.iter()
                .map(|t| {
                    (
                        a.physical_page(Side::Full, t.page(ps)),
                        a.physical_page(Side::Swa, t.page(ps)),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            next(&mut batch),
            next(&mut single),
            "the same holes, in the same order"
        );
    }

    #[test]
    fn every_layouts_batch_release_is_the_page_by_page_release() {
        use crate::{StaticSwa, StaticSwaConfig, SubPoolSpec, UnifiedSwa, UnifiedSwaConfig};
        use std::sync::Arc;
        use unikv_kernels::CpuDevice;
        let full = SubPoolSpec::mha("full", 2, 1, 4, 2);
        let swa = SubPoolSpec::mha("swa", 2, 2, 4, 2);
        for ps in [1u32, 4] {
            let unified = || {
                UnifiedSwa::new(
                    Arc::new(CpuDevice::new()),
                    UnifiedSwaConfig {
                        total_bytes: 1 << 16,
                        page_size: ps,
                        window: 8,
                        full: full.clone(),
                        swa: Some(swa.clone()),
                        mamba: None,
                        zero_on_handout: false,
                    },
                )
                .unwrap()
            };
            let fixed = || {
                StaticSwa::new(
                    Arc::new(CpuDevice::new()),
                    StaticSwaConfig {
                        total_bytes: 1 << 16,
                        page_size: ps,
                        window: 8,
                        full: full.clone(),
                        swa: Some(swa.clone()),
                        mamba: None,
                        swa_full_ratio: 1.0,
                        zero_on_handout: false,
                    },
                )
                .unwrap()
            };
            batch_release_matches(unified(), unified(), ps as usize);
            batch_release_matches(fixed(), fixed(), ps as usize);
        }
    }

    #[test]
    fn segments_must_be_page_disjoint_and_ascending() {
        let ps = PageSize::new(4).unwrap();
        let row: Vec<VirtualToken> = (4..20).map(VirtualToken).collect();
        let seg = |r: std::ops::Range<usize>| Segment::of_row(&row, r);
        assert!(check_disjoint(ps, &[seg(0..4), seg(4..8), seg(12..13)]).is_ok());
        assert!(check_disjoint(ps, &[seg(0..5), seg(4..8)]).is_err());
        assert!(check_disjoint(ps, &[seg(8..12), seg(0..4)]).is_err());
        assert!(check_disjoint(ps, &[seg(0..4), seg(4..4), seg(4..8)]).is_ok());
        // An empty segment between two overlapping ones does not hide the overlap.
        assert!(check_disjoint(ps, &[seg(0..4), seg(4..4), seg(0..4)]).is_err());
        assert!(check_disjoint(ps, &[seg(0..0), seg(0..4), seg(8..8), seg(2..6)]).is_err());
    }
}

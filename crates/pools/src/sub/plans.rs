//! Compaction and a float's relay, each planned **without changing anything** (the page
//! pairs, the envelope copies and the span after it) and committed to the tables only
//! after the device moved the bytes, so a failed move leaves the sub-allocator as it was.

use super::dirty::note_dirty;
use super::sort::sort_pages_in;
use super::{Edge, SpanView, SubAllocator, is_bound};
use crate::ramp::{RUN, fill_ramps, is_ramp, is_unit, lowest, steps};
use crate::spec::Grow;
use unikv_kernels::SpanMove;

impl SubAllocator {
    /// Compacts the span toward its fixed end (a float: toward its low edge) at once:
    /// [`SubAllocator::plan_compaction`] then [`SubAllocator::commit_compaction`].
    /// Appends the envelope moves to `moves`; returns how many pages moved.
    // The composites plan, issue and commit apart (transactional); this shorthand is the
    // unit tests'.
    #[cfg(test)]
    pub(crate) fn compact(&mut self, moves: &mut Vec<SpanMove>) -> usize {
        self.compact_toward(self.compaction_edge(Edge::Low), moves)
    }

    /// Compacts toward `edge` at once (plan, then commit).
    #[cfg(test)]
    pub(crate) fn compact_toward(&mut self, edge: Edge, moves: &mut Vec<SpanMove>) -> usize {
        let mut plan = CompactionPlan::default();
        self.plan_compaction(edge, moves, &mut plan);
        self.commit_compaction(&plan);
        plan.pairs.len()
    }

    /// The edge a compaction packs against: an end's fixed end; a float's `edge`.
    pub(super) fn compaction_edge(&self, edge: Edge) -> Edge {
        match self.grow {
            Grow::Up => Edge::Low,
            Grow::Down => Edge::High,
            Grow::Float => edge,
        }
    }

    /// Plans a compaction toward `edge` (ends always pack against their fixed end; the
    /// argument only steers a float) **without changing anything**: survivors beyond the
    /// packed span are paired with holes inside it, the envelope copies are appended to
    /// `moves` (no destination is a source) and `plan` (cleared first) records the page
    /// pairs and the packed span for [`SubAllocator::commit_compaction`], which must run
    /// only after the device moved the bytes. With no holes the plan is empty.
    /// Survivors moving into consecutive holes are one copy (a page-size-1 row moves as
    /// one span, not page by page). O(holes + packed span / 64) when the holes are dense
    /// in it, O(holes log holes) at worst.
    pub(crate) fn plan_compaction(
        &self,
        edge: Edge,
        moves: &mut Vec<SpanMove>,
        plan: &mut CompactionPlan,
    ) {
        plan.pairs.clear();
        plan.span = None;
        if self.holes.is_empty() {
            return;
        }
        let edge = self.compaction_edge(edge);
        let holes = self.holes.len() as u32;
        let (packed_lo, packed_hi) = match edge {
            Edge::Low => (self.lo, self.hi - holes),
            Edge::High => (self.lo + holes, self.hi),
        };
        // The band that empties: its survivors fill the holes inside the packed span.
        let band = match edge {
            Edge::Low => packed_hi..self.hi,
            Edge::High => self.lo..packed_lo,
        };
        plan.inner.clear();
        plan.inner.extend(
            self.holes
                .iter()
                .copied()
                .filter(|&p| p >= packed_lo && p < packed_hi),
        );
        sort_pages_in(&mut plan.inner, (packed_lo, packed_hi), &mut plan.bits);
        self.pair_survivors(band, &plan.inner, moves, &mut plan.pairs);
        plan.span = Some((packed_lo, packed_hi));
    }

    /// Applies a planned compaction to the tables (after the device moved the bytes):
    /// each survivor is rebound to its hole, the span shrinks to the packed span, the hole
    /// list empties. The plan must come from [`SubAllocator::plan_compaction`] on this
    /// unchanged state; an empty plan changes nothing.
    pub(crate) fn commit_compaction(&mut self, plan: &CompactionPlan) {
        let Some((lo, hi)) = plan.span else { return };
        self.rebind_moved(&plan.pairs);
        self.lo = lo;
        self.hi = hi;
        self.holes.clear();
    }

    /// Pairs each bound page of `sources`, in order, with the next page of `free` (sorted
    /// ascending) until either runs out: appends the envelope copies to `moves` and the
    /// pairs to `pairs`; returns how many free pages it used.
    fn pair_survivors(
        &self,
        sources: std::ops::Range<u32>,
        free: &[u32],
        moves: &mut Vec<SpanMove>,
        pairs: &mut Vec<(u32, u32)>,
    ) -> usize {
        let (mut left, mut src) = (free, sources.start);
        let ascending = steps(1);
        while src < sources.end && !left.is_empty() {
            // [`RUN`] bound pages in a row into as many consecutive free pages (a
            // page-size-1 row): the pairs the steps below make, found in one test each.
            if let Some(dst) = left.first_chunk::<RUN>()
                && sources.end - src >= RUN as u32
                && is_ramp(dst, dst[0], &ascending)
                && (src..src + RUN as u32).fold(true, |ok, p| ok & self.is_owned(p))
            {
                self.plan_moves((src, dst[0]), RUN as u32, moves, pairs);
                (left, src) = (&left[RUN..], src + RUN as u32);
                continue;
            }
            // Not a chunk: the next [`RUN`] sources page by page, before the next test.
            let end = sources.end.min(src + RUN as u32);
            while src < end && !left.is_empty() {
                if self.owner(src) != 0 {
                    self.plan_moves((src, left[0]), 1, moves, pairs);
                    left = &left[1..];
                }
                src += 1;
            }
        }
        free.len() - left.len()
    }

    /// Records the envelope copies of the `n` pages from `src` to the `n` free pages from
    /// `dst` (in `moves`) and the pairs (in `pairs`), for a plan's commit to rebind.
    fn plan_moves(
        &self,
        (src, dst): (u32, u32),
        n: u32,
        moves: &mut Vec<SpanMove>,
        pairs: &mut Vec<(u32, u32)>,
    ) {
        pairs.extend((0..n).map(|i| (src + i, dst + i)));
        let (src, dst, len) = (
            self.grid.offset(src),
            self.grid.offset(dst),
            self.grid.envelope * u64::from(n),
        );
        // Consecutive survivors into consecutive holes (a page-size-1 row) are one copy:
        // the union of disjoint moves whose sources and destinations both abut.
        if let Some(last) = moves.last_mut()
            && last.src + last.len == src
            && last.dst + last.len == dst
        {
            last.len += len;
            return;
        }
        moves.push(SpanMove { src, dst, len });
    }

    /// Whether page `p` is bound (see [`is_bound`]).
    #[inline(always)]
    fn is_owned(&self, p: u32) -> bool {
        is_bound(&self.v2p, &self.p2v, p)
    }

    /// Rebinds the virtual page of each planned `(src, dst)` move to `dst` (the device
    /// moved its bytes).
    ///
    /// [`RUN`] pairs from consecutive pages to consecutive pages whose virtual pages run
    /// too (a page-size-1 row) are rebound with slice writes and one dirty span.
    fn rebind_moved(&mut self, pairs: &[(u32, u32)]) {
        let ascending = steps(1);
        let mut i = 0;
        while i < pairs.len() {
            if let Some(chunk) = pairs[i..].first_chunk::<RUN>()
                && let Some((v_lo, sv)) = self.rebind_run(chunk, &ascending)
            {
                let (s0, d0) = (chunk[0].0 as usize, chunk[0].1);
                // No destination is a source: `p2v[s0..]` is still the survivors' owners.
                self.p2v.copy_within(s0..s0 + RUN, d0 as usize);
                // The entry of the run's lowest virtual page: its last pair's when they
                // descend.
                let first = if sv == 1 {
                    (d0, 1)
                } else {
                    (d0 + RUN as u32 - 1, u32::MAX)
                };
                let v = v_lo as usize;
                fill_ramps(&mut self.v2p[v..v + RUN], first, (0, 1), |p, _| p as i32);
                note_dirty(&mut self.dirty, v_lo, RUN as u32);
                i += RUN;
                continue;
            }
            let end = (i + RUN).min(pairs.len());
            for &(src, dst) in &pairs[i..end] {
                // `src` is left with a stale entry: `v2p[v]` no longer points to it.
                let v = self.p2v[src as usize];
                self.p2v[dst as usize] = v;
                self.v2p[v as usize] = dst as i32;
                self.mark(v);
            }
            i = end;
        }
    }

    /// The lowest virtual page and the step (±1) of `chunk`'s owners when its pairs go
    /// from consecutive pages to consecutive pages and the owners run too.
    #[inline(always)]
    fn rebind_run(&self, chunk: &[(u32, u32); RUN], ascending: &[u32; RUN]) -> Option<(u32, u32)> {
        let (s0, d0) = chunk[0];
        if !(is_ramp(&chunk.map(|(s, _)| s), s0, ascending)
            & is_ramp(&chunk.map(|(_, d)| d), d0, ascending))
        {
            return None;
        }
        let owners = *self.p2v.get(s0 as usize..)?.first_chunk::<RUN>()?;
        let sv = owners[1].wrapping_sub(owners[0]);
        (is_unit(sv) && is_ramp(&owners, owners[0], &steps(sv)))
            .then(|| (lowest((owners[0], sv), RUN), sv))
    }

    /// Plans a float's relay between the ends (the shortfall ladder's last rung) **without
    /// changing anything**: the span becomes `T ⊂ [a, b)` with room for `extra` more
    /// pages (`|T| ≥ live + extra`), `T` keeps every page of the span inside `[a, b)`, so
    /// only the live pages outside `[a, b)` move (the fewest possible), each into a free
    /// page of `T`. The envelope copies are appended to `moves` (sources lie outside `T`,
    /// destinations inside: no destination is a source) and `plan` (cleared first)
    /// records the pairs, `T` and the free pages left in it (the holes after the commit).
    /// Requires `b - a ≥ live + extra` and nothing live on any side in `[a, b)` but this
    /// span's pages (the composite's arithmetic); with less room it moves what fits.
    /// O(holes + |T| / 64 + the span's pages outside `T` + pages added): the span's pages
    /// inside `T` are not visited.
    pub(crate) fn plan_relay(
        &self,
        (a, b): (u32, u32),
        extra: u32,
        moves: &mut Vec<SpanMove>,
        plan: &mut RelayPlan,
    ) {
        plan.pairs.clear();
        plan.holes.clear();
        let need = self.live.saturating_add(extra);
        let (mut t0, mut t1) = (self.lo.max(a), self.hi.min(b));
        if t0 > t1 {
            // The whole span is outside [a, b): start at its nearest edge.
            t0 = self.lo.clamp(a, b);
            t1 = t0;
        }
        if t1 - t0 < need {
            t1 += (need - (t1 - t0)).min(b - t1);
            t0 -= (need - (t1 - t0)).min(t0 - a);
        }
        let (lo, hi) = (self.lo, self.hi);
        // The free pages of T, lowest first: its holes and its pages beyond the old span.
        plan.holes
            .extend(self.holes.iter().copied().filter(|&p| p >= t0 && p < t1));
        plan.holes.extend((t0..t1.min(lo)).chain(t0.max(hi)..t1));
        sort_pages_in(&mut plan.holes, (t0, t1), &mut plan.bits);
        // The live pages outside T (the span's parts below and above it), each into the
        // next free page.
        let below = self.pair_survivors(lo..t0.min(hi), &plan.holes, moves, &mut plan.pairs);
        let above =
            self.pair_survivors(t1.max(lo)..hi, &plan.holes[below..], moves, &mut plan.pairs);
        plan.holes.drain(..below + above);
        plan.span = Some((t0, t1));
    }

    /// Applies a planned relay (after the device moved the bytes): each moved page is
    /// rebound to its new page, the span becomes the plan's, its free pages the holes.
    pub(crate) fn commit_relay(&mut self, plan: &RelayPlan) {
        let Some((lo, hi)) = plan.span else { return };
        self.rebind_moved(&plan.pairs);
        self.lo = lo;
        self.hi = hi;
        self.holes.clear();
        if self.live == 0 {
            // Nothing live: the float parks, as after its last free.
            self.hi = self.lo;
        } else {
            self.holes.extend_from_slice(&plan.holes);
        }
    }
}

/// A compaction planned by [`SubAllocator::plan_compaction`] and not yet applied: the
/// survivor → hole page pairs and the packed span. Reused across compactions (its lists
/// keep their capacity).
#[derive(Debug, Default, Clone)]
pub(crate) struct CompactionPlan {
    /// `(source page, destination hole)` per moved survivor.
    pub(crate) pairs: Vec<(u32, u32)>,
    /// The span after the commit; `None`: nothing to compact.
    pub(crate) span: Option<(u32, u32)>,
    /// Holes inside the packed span, sorted (scratch).
    inner: Vec<u32>,
    /// A bitmap for sorting them (scratch, see `sort_pages_in`).
    bits: Vec<u64>,
}

impl CompactionPlan {
    /// Forgets the plan (nothing to commit).
    pub(crate) fn clear(&mut self) {
        self.pairs.clear();
        self.span = None;
    }

    /// The span after the commit, with no holes (`None`: nothing planned).
    pub(crate) fn view(&self) -> Option<SpanView<'static>> {
        self.span.map(|(lo, hi)| SpanView { holes: &[], lo, hi })
    }
}

/// A float's relay planned by [`SubAllocator::plan_relay`] and not yet applied: the
/// moved page → free page pairs, the span after the commit and the free pages left in it.
#[derive(Debug, Default, Clone)]
pub(crate) struct RelayPlan {
    /// `(source page, destination page)` per moved page.
    pub(crate) pairs: Vec<(u32, u32)>,
    /// The span after the commit; `None`: nothing planned.
    pub(crate) span: Option<(u32, u32)>,
    /// The span's free pages after the commit (its holes; the last is taken first).
    pub(crate) holes: Vec<u32>,
    /// A bitmap for sorting them (scratch, see `sort_pages_in`).
    bits: Vec<u64>,
}

impl RelayPlan {
    /// Forgets the plan (nothing to commit).
    pub(crate) fn clear(&mut self) {
        self.pairs.clear();
        self.holes.clear();
        self.span = None;
    }

    /// The span after the commit (`None`: nothing planned).
    pub(crate) fn view(&self) -> Option<SpanView<'_>> {
        self.span.map(|(lo, hi)| SpanView {
            holes: &self.holes,
            lo,
            hi,
        })
    }
}

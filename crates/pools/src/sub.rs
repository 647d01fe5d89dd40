//! The multi-ended sub-allocator: one sub-pool's span at one end of the buffer (or a
//! float between the ends), its
//! `v2p`/`p2v` tables, live count, holes, tombstones and dirty mirror entries, and lazy
//! compaction (a free leaves a hole, an alloc drains holes first, a flush moves
//! survivors into holes and rewrites only the tables).
//!
//! A building block for composites: the composite owns the capacity arithmetic between
//! its members and the virtual ids ([`VirtualIds`]); a sub-allocator only keeps one
//! span's tables honest. Its read-only views are public; its mutators (`take`, `bind`,
//! `unbind`, `rebind`, compaction, ...) are crate-private, because their preconditions
//! are the composite's arithmetic and are not checked again (a composite outside this
//! crate, e.g. the tri-pool, is built here or gets checked entry points).

use crate::spec::{Grid, Grow};

/// One edge of a span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    /// The low (first) page.
    Low,
    /// The high (one past the last) page.
    High,
}
use std::mem::MaybeUninit;
use unikv_kernels::{ByteSpan, SpanMove};

/// One sub-pool's host-authoritative bookkeeping: a span `[lo, hi)` of its grid, its
/// translation tables (`v2p`: > 0 bound, -1 tombstone, 0 unbound; `p2v`: the owner of a
/// bound page), its holes and its dirty mirror entries. An `Up` end keeps `lo` at the
/// floor and grows at `hi`; a `Down` end keeps `hi` at the top and grows at `lo`; a
/// `Float` moves both and parks (becomes empty and transparent) when its last page is
/// freed. Methods that take
/// a page trust the composite's arithmetic (documented preconditions);
/// [`SubAllocator::verify`] checks everything.
///
/// The mutators are crate-private, so misuse outside the crate (an `unbind` of an unbound
/// page, which would push the sink onto the hole list and underflow `live`) does not
/// compile:
///
/// ```compile_fail
/// use unikv_pools::{Grid, Grow, SubAllocator};
///
/// let grid = Grid { envelope: 8, pages: 32, min_page: 2, stride: 4 };
/// let mut sub = SubAllocator::new(grid, Grow::Up, 64);
/// sub.unbind(1, false); // private: not callable outside unikv-pools
/// ```
#[derive(Debug, Clone)]
pub struct SubAllocator {
    /// The grid (envelope bytes, pages, first page above the floor, kernel stride).
    pub(crate) grid: Grid,
    /// Which end the span grows from.
    pub(crate) grow: Grow,
    /// Virtual page → physical page: > 0 bound, -1 tombstone, 0 unbound. Index 0 is the sink.
    pub(crate) v2p: Vec<i32>,
    /// Physical page → virtual page, written only by a bind: page `p` is bound iff
    /// `v2p[p2v[p]] == p`, so a release leaves its stale entry and writes one table
    /// rather than two (at page size 1 each is a cache miss). Read it through
    /// [`SubAllocator::p2v`] or `owner`.
    pub(crate) p2v: Vec<u32>,
    /// First page of the span.
    pub(crate) lo: u32,
    /// One past the last page of the span.
    pub(crate) hi: u32,
    /// Free pages inside the span (freed, not yet compacted).
    pub(crate) holes: Vec<u32>,
    /// Bound pages.
    pub(crate) live: u32,
    /// Virtual pages with `v2p = -1`.
    pub(crate) tombstones: u32,
    /// The edge a float takes fresh pages at (the composite steers it before binding;
    /// an end always grows at its own frontier).
    float_edge: Edge,
    /// The `v2p` entries changed since the last mirror upload, as `(first virtual page,
    /// pages)` spans: the upload copies them from `v2p` as it is then, so a span is one
    /// entry however many pages it covers (a page-size-1 row's run), and its order does
    /// not matter. Spans may overlap (a page changed twice may be in two).
    dirty: Vec<(u32, u32)>,
}

impl SubAllocator {
    /// An empty sub-allocator on `grid`, growing from `grow`'s end, with a `v2p` of
    /// `virtual_pages` entries (the id owner's count, sink included). A float starts
    /// parked at the floor; the composite places it (`place`, crate-private).
    pub fn new(grid: Grid, grow: Grow, virtual_pages: u32) -> SubAllocator {
        let at = match grow {
            Grow::Up | Grow::Float => grid.min_page,
            Grow::Down => grid.pages,
        };
        // The tables are made resident now, at boot, not by page faults on the scheduling
        // path. (Reserving the lists to their bounds as well was measured slower: fresh
        // mappings fault on first touch anyway and all start at the same 4 KiB offset.)
        SubAllocator {
            grid,
            grow,
            v2p: resident_table(virtual_pages as usize),
            p2v: resident_table(grid.pages as usize),
            lo: at,
            hi: at,
            holes: resident_list((grid.pages - grid.min_page.min(grid.pages)) as usize),
            live: 0,
            tombstones: 0,
            float_edge: Edge::High,
            // Room for two changes of every page between uploads before a reallocation.
            dirty: resident_list(2 * virtual_pages as usize),
        }
    }

    /// The grid.
    pub fn grid(&self) -> Grid {
        self.grid
    }

    /// The end the span grows from.
    pub fn grow(&self) -> Grow {
        self.grow
    }

    /// The span `[lo, hi)` in pages.
    pub fn span(&self) -> (u32, u32) {
        (self.lo, self.hi)
    }

    /// The growth frontier page: `hi` for `Up` (and a float), `lo` for `Down`.
    pub fn frontier(&self) -> u32 {
        match self.grow {
            Grow::Down => self.lo,
            Grow::Up | Grow::Float => self.hi,
        }
    }

    /// Bound pages.
    pub fn live(&self) -> u32 {
        self.live
    }

    /// Virtual pages whose entry is a tombstone (-1).
    pub fn tombstones(&self) -> u32 {
        self.tombstones
    }

    /// Free pages inside the span, awaiting compaction.
    pub fn holes(&self) -> &[u32] {
        &self.holes
    }

    /// The `v2p` entry of virtual page `v` (0 when out of range).
    pub fn v2p(&self, v: u32) -> i32 {
        self.v2p.get(v as usize).copied().unwrap_or(0)
    }

    /// The virtual page bound to physical page `p` (0 when free or out of range).
    pub fn p2v(&self, p: u32) -> u32 {
        if (p as usize) < self.p2v.len() {
            self.owner(p)
        } else {
            0
        }
    }

    /// The owner of page `p` (in the grid), 0 when free: its `p2v` entry if that page's
    /// `v2p` entry points back.
    #[inline(always)]
    fn owner(&self, p: u32) -> u32 {
        owner(&self.v2p, &self.p2v, p)
    }

    /// Pages of the span (live + holes).
    #[inline]
    pub fn span_pages(&self) -> u32 {
        self.hi - self.lo
    }

    /// Byte range of the span `[low, high)` (empty for a parked float).
    #[inline]
    pub fn span_bytes(&self) -> (u64, u64) {
        (self.grid.offset(self.lo), self.grid.offset(self.hi))
    }

    /// The byte frontier facing the other end (Up: high byte; Down: low byte).
    #[inline]
    pub fn facing_byte(&self) -> u64 {
        self.grid.offset(self.frontier())
    }

    /// Whether `p` lies inside the span.
    #[inline]
    pub fn in_span(&self, p: u32) -> bool {
        p >= self.lo && p < self.hi
    }

    /// Records that `v`'s mirror entry changed.
    #[inline(always)]
    fn mark(&mut self, v: u32) {
        note_dirty(&mut self.dirty, v, 1);
    }

    /// Takes a physical page at the growth edge (a hole first, else the frontier advances
    /// by one). The caller checked the room: the frontier must not cross its neighbour's.
    #[inline(always)]
    pub(crate) fn take(&mut self) -> u32 {
        self.take_at(self.growth_edge())
    }

    /// The edge fresh pages are taken at: an end's frontier, or the edge a float was
    /// steered to by its composite.
    #[inline(always)]
    pub fn growth_edge(&self) -> Edge {
        match self.grow {
            Grow::Down => Edge::Low,
            Grow::Up => Edge::High,
            Grow::Float => self.float_edge,
        }
    }

    /// Steers a float's growth to `edge` (no effect on an end).
    pub(crate) fn set_float_edge(&mut self, edge: Edge) {
        self.float_edge = edge;
    }

    /// The span as it is: its holes and edges.
    pub(crate) fn view(&self) -> SpanView<'_> {
        SpanView {
            holes: &self.holes,
            lo: self.lo,
            hi: self.hi,
        }
    }

    /// Takes a physical page: a hole first, else the span extends by one page at `edge`
    /// (a float grows toward the roomier side; an end should use [`SubAllocator::take`]).
    #[inline(always)]
    pub(crate) fn take_at(&mut self, edge: Edge) -> u32 {
        if let Some(p) = self.holes.pop() {
            return p;
        }
        match edge {
            Edge::High => {
                let p = self.hi;
                self.hi += 1;
                p
            }
            Edge::Low => {
                self.lo -= 1;
                self.lo
            }
        }
    }

    /// Places an empty float's span at page `at` (`min_page ≤ at ≤ pages`). Returns false,
    /// changing nothing, when the span holds pages or `at` is outside the grid.
    pub(crate) fn place(&mut self, at: u32) -> bool {
        if self.live != 0
            || !self.holes.is_empty()
            || at < self.grid.min_page
            || at > self.grid.pages
        {
            return false;
        }
        self.lo = at;
        self.hi = at;
        true
    }

    /// Binds virtual page `v` (unbound or tombstoned) to physical page `p` (from
    /// [`SubAllocator::take`]).
    #[inline(always)]
    pub(crate) fn bind(&mut self, v: u32, p: u32) {
        debug_assert!(p != 0 && self.owner(p) == 0);
        let entry = &mut self.v2p[v as usize];
        if *entry == -1 {
            self.tombstones -= 1;
        }
        *entry = p as i32;
        self.p2v[p as usize] = v;
        self.live += 1;
        self.mark(v);
    }

    /// Unbinds live `v`, leaving a hole; `tombstone` writes -1 instead of 0. Returns the
    /// physical page. A float whose last page goes parks (empty, no holes).
    #[inline(always)]
    pub(crate) fn unbind(&mut self, v: u32, tombstone: bool) -> u32 {
        let entry = &mut self.v2p[v as usize];
        debug_assert!(*entry > 0);
        let p = *entry as u32;
        *entry = if tombstone { -1 } else { 0 };
        self.holes.push(p);
        self.live -= 1;
        self.tombstones += tombstone as u32;
        self.mark(v);
        if self.grow == Grow::Float && self.live == 0 {
            self.holes.clear();
            self.hi = self.lo;
        }
        p
    }

    /// Clears `v`'s tombstone (its FULL page is freed).
    #[inline(always)]
    pub(crate) fn clear_tombstone(&mut self, v: u32) {
        let entry = &mut self.v2p[v as usize];
        if *entry == -1 {
            *entry = 0;
            self.tombstones -= 1;
            self.mark(v);
        }
    }

    /// Moves `from`'s binding to `to` (a tombstone); `from` becomes a tombstone.
    pub(crate) fn rebind(&mut self, from: u32, to: u32) {
        let p = self.v2p[from as usize];
        debug_assert!(p > 0 && self.v2p[to as usize] == -1);
        self.v2p[to as usize] = p;
        self.p2v[p as usize] = to;
        self.v2p[from as usize] = -1;
        self.mark(from);
        self.mark(to);
    }

    /// Byte span of physical page `p`'s envelope.
    #[inline]
    pub fn envelope(&self, p: u32) -> ByteSpan {
        ByteSpan {
            offset: self.grid.offset(p),
            len: self.grid.envelope,
        }
    }

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
    fn compaction_edge(&self, edge: Edge) -> Edge {
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

    /// Appends the envelopes of the `n` pages the next binds would take, in the order
    /// they take them, from the span `view` (the span as it is, or as a planned
    /// compaction or relay leaves it) growing at `edge`: holes first (the last listed
    /// first), then fresh pages beyond that edge. Pure; lets a caller zero the pages on
    /// the device before it binds them.
    pub(crate) fn handout_envelopes(
        &self,
        n: usize,
        view: SpanView<'_>,
        edge: Edge,
        out: &mut Vec<ByteSpan>,
    ) {
        let SpanView { holes, lo, hi } = view;
        let from_holes = n.min(holes.len());
        let fresh = (n - from_holes) as u32;
        let grid = self.grid;
        let envelope = |p: u32| ByteSpan {
            offset: grid.offset(p),
            len: grid.envelope,
        };
        out.extend(
            holes[holes.len() - from_holes..]
                .iter()
                .rev()
                .map(|&p| envelope(p)),
        );
        out.extend((0..fresh).map(|i| {
            envelope(match edge {
                Edge::Low => lo - 1 - i,
                Edge::High => hi + i,
            })
        }));
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

    /// Batch release: for each `v` of `pages` that `keep` keeps, in order, a live page is
    /// unbound as by `unbind(v, how == Release::Tombstone)` (and `v` appended to
    /// `released`), a tombstone is cleared as by `clear_tombstone(v)` under
    /// [`Release::FreeAndClear`], and any other entry is left alone. Same tables, counters,
    /// hole and dirty order as those calls one by one; the lists are written through
    /// slices reserved up front, so a page costs a few stores rather than a few
    /// `Vec::push`es (a push reloads the length from memory after every store to a table).
    ///
    /// A page-size-1 row is runs of consecutive virtual pages bound to consecutive
    /// physical pages (its prefill), or of tombstones (its window): each
    /// [`ReleaseRun`] is released with slice fills and ramps instead of page by page.
    #[inline(always)]
    pub(crate) fn release_each(
        &mut self,
        pages: &[u32],
        keep: Keep<'_>,
        how: Release,
        mut released: Option<&mut Vec<u32>>,
    ) {
        let clear_tombstones = how == Release::FreeAndClear;
        // What a released entry becomes.
        let to = if how == Release::Tombstone { -1 } else { 0 };
        if self.grow == Grow::Float {
            // A float parks when its last page goes: keep the page-by-page path.
            for &v in pages.iter().filter(|&&v| keep.keeps(v)) {
                match self.v2p[v as usize] {
                    p if p > 0 => {
                        self.unbind(v, to == -1);
                        if let Some(released) = released.as_deref_mut() {
                            released.push(v);
                        }
                    }
                    -1 if clear_tombstones => self.clear_tombstone(v),
                    _ => {}
                }
            }
            return;
        }
        let n = pages.len();
        // No `p2v` write: a released page's entry goes stale (see the field).
        let SubAllocator {
            v2p,
            holes,
            live,
            tombstones,
            dirty,
            ..
        } = self;
        let mut nothing = Vec::new();
        let record = released.is_some();
        let released = released.unwrap_or(&mut nothing);
        let (hole_base, released_base) = (holes.len(), released.len());
        // Written in place in the lists' spare room (not zero-filled first), lengths set
        // once at the end.
        holes.reserve(n);
        if record {
            released.reserve(n);
        }
        let (open, dirty_base) = DirtySpans::reopen(dirty, n);
        let mut spans = DirtySpans {
            slots: &mut dirty.spare_capacity_mut()[..n + 1],
            written: 0,
            open,
        };
        let new_holes = &mut holes.spare_capacity_mut()[..n];
        let new_released = &mut released.spare_capacity_mut()[..if record { n } else { 0 }];
        let v2p = &mut v2p[..];
        let (mut unbound, mut cleared) = (0usize, 0usize);
        let mut i = 0;
        while i < n {
            if let Some(run) = ReleaseRun::find(&pages[i..], v2p, keep, clear_tombstones) {
                // The same writes as the loop below, as slice fills and ramps.
                let len = run.len;
                let (v, sv) = run.pages;
                let v_lo = lowest((v, sv), len) as usize;
                spans.note(v_lo as u32, len as u32);
                match run.entries {
                    Some(entries) => {
                        v2p[v_lo..v_lo + len].fill(to);
                        let holes = &mut new_holes[unbound..unbound + len];
                        fill_ramps(holes, entries, (0, 1), |p, _| MaybeUninit::new(p));
                        if record {
                            let released = &mut new_released[unbound..unbound + len];
                            for (slot, &v) in released.iter_mut().zip(&pages[i..i + len]) {
                                slot.write(v);
                            }
                        }
                        unbound += len;
                    }
                    None => {
                        v2p[v_lo..v_lo + len].fill(0);
                        cleared += len;
                    }
                }
                i += len;
                continue;
            }
            let end = (i + RUN).min(n);
            for &v in &pages[i..end] {
                if !keep.keeps(v) {
                    continue;
                }
                let entry = &mut v2p[v as usize];
                let p = *entry;
                if p > 0 {
                    *entry = to;
                    new_holes[unbound].write(p as u32);
                    if record {
                        new_released[unbound].write(v);
                    }
                    spans.note_apart(v);
                    unbound += 1;
                } else if p == -1 && clear_tombstones {
                    *entry = 0;
                    spans.note_apart(v);
                    cleared += 1;
                }
            }
            i = end;
        }
        let spans = spans.close();
        // SAFETY: the loop wrote the first `unbound` entries of the hole and (when
        // recording) id slices (each page writes at the index its count has reached
        // before the count moves on), and `unbound <= n`, the room reserved; `close`
        // counts the dirty slots written.
        unsafe {
            holes.set_len(hole_base + unbound);
            dirty.set_len(dirty_base + spans);
        }
        if record {
            // SAFETY: as above.
            unsafe { released.set_len(released_base + unbound) };
        }
        *live -= unbound as u32;
        *tombstones -= cleared as u32;
        if to == -1 {
            *tombstones += unbound as u32;
        }
    }

    /// Batch bind for an allocation of the ids `popped`, as a stack pops them (the last
    /// first): for each id, takes a physical page and binds the id to it, as by
    /// `let p = take(); bind(v, p)` (the pages [`SubAllocator::handout_envelopes`]
    /// predicts). Same tables, counters, hole and dirty order as those calls one by one.
    /// The caller checked the room; the ids are distinct and not the sink.
    ///
    /// The tables and the dirty entries (written in place in the list's spare room) are
    /// filled in one pass, so no page pays for a `Vec::push` (which reloads the length
    /// from memory after every store to a table). Consecutive ids, unbound, that get
    /// consecutive physical pages (a page-size-1 prefill) are bound as a [`BindRun`]:
    /// checked [`RUN`] at a time, then written as ramps however long the run.
    pub(crate) fn bind_popped(&mut self, popped: &[u32]) {
        let n = popped.len();
        // `take` pops holes (last first), then moves the frontier one page at a time.
        let from_holes = n.min(self.holes.len());
        let hole_split = self.holes.len() - from_holes;
        let fresh = (n - from_holes) as u32;
        // The first fresh page and the step to the next.
        let (fresh_first, fresh_step) = match self.growth_edge() {
            Edge::Low => {
                let lo = self.lo;
                self.lo -= fresh;
                (lo.wrapping_sub(1), u32::MAX)
            }
            Edge::High => {
                let hi = self.hi;
                self.hi += fresh;
                (hi, 1)
            }
        };
        let SubAllocator {
            v2p,
            p2v,
            holes,
            live,
            tombstones,
            dirty,
            ..
        } = self;
        let taken = &holes[hole_split..];
        // The `t`-th bind's id and page.
        let id = |t: usize| popped[n - 1 - t];
        let page = |t: usize| {
            if t < from_holes {
                taken[from_holes - 1 - t]
            } else {
                fresh_first.wrapping_add(fresh_step.wrapping_mul((t - from_holes) as u32))
            }
        };
        let (open, dirty_base) = DirtySpans::reopen(dirty, n);
        let mut spans = DirtySpans {
            slots: &mut dirty.spare_capacity_mut()[..n + 1],
            written: 0,
            open,
        };
        let (v2p, p2v) = (&mut v2p[..], &mut p2v[..]);
        let mut revived = 0u32;
        let mut t = 0;
        while t < n {
            // Holes, then fresh pages: a run lies in one of them.
            let (pages, seg_end) = if t < from_holes {
                (Pages::Stack(&taken[..from_holes - t]), from_holes)
            } else {
                (Pages::Ramp(page(t), fresh_step), n)
            };
            if let Some(run) = BindRun::find(&popped[..n - t], pages, seg_end - t, v2p) {
                revived += run.revived;
                run.write(v2p, p2v);
                spans.note(lowest(run.ids, run.len), run.len as u32);
                t += run.len;
                continue;
            }
            let end = (t + RUN).min(seg_end);
            for t in t..end {
                let (v, p) = (id(t), page(t));
                debug_assert!(p != 0 && owner(v2p, p2v, p) == 0);
                let entry = &mut v2p[v as usize];
                revived += (*entry == -1) as u32;
                *entry = p as i32;
                p2v[p as usize] = v;
                spans.note_one(v);
            }
            t = end;
        }
        let spans = spans.close();
        // SAFETY: `close` counts the dirty slots written, from the list's length.
        unsafe { dirty.set_len(dirty_base + spans) };
        holes.truncate(hole_split);
        *live += n as u32;
        *tombstones -= revived;
    }

    /// The mirror entries changed since the last upload, as `(first virtual page,
    /// pages)` spans of `v2p` (they may overlap; the upload copies them from
    /// [`SubAllocator::v2p_table`] as it is then). They stay until
    /// [`SubAllocator::clear_dirty`] (after the upload succeeded), so a failed upload is
    /// retried whole.
    pub fn dirty_spans(&self) -> &[(u32, u32)] {
        &self.dirty
    }

    /// The whole `v2p` table, indexed by virtual page (what the mirror copies).
    pub fn v2p_table(&self) -> &[i32] {
        &self.v2p
    }

    /// Forgets the dirty spans (the mirror now holds them).
    pub fn clear_dirty(&mut self) {
        self.dirty.clear();
    }

    /// Mirror entries waiting for the upload: the pages the dirty spans cover (a page in
    /// two overlapping spans counts twice). O(spans).
    pub fn dirty_count(&self) -> usize {
        self.dirty.iter().map(|&(_, n)| n as usize).sum()
    }

    /// Whether any mirror entry is dirty.
    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// O(1) accounting: live + holes = span, and the span inside the grid above the
    /// floor, pinned at its fixed end.
    pub fn accounting_holds(&self) -> bool {
        let pinned = match self.grow {
            Grow::Up => self.lo == self.grid.min_page,
            Grow::Down => self.hi == self.grid.pages,
            Grow::Float => self.live > 0 || self.lo == self.hi,
        };
        pinned
            && self.lo >= self.grid.min_page
            && self.lo <= self.hi
            && self.hi <= self.grid.pages
            && self.live as u64 + self.holes.len() as u64 == self.span_pages() as u64
    }

    /// Full scan: every table entry against every counter; `Err` names the first
    /// discrepancy, prefixed with `name`.
    pub fn verify(&self, name: &str) -> Result<(), String> {
        if self.v2p[0] != 0 || self.p2v[0] != 0 {
            return Err(format!("{name}: the sink is bound"));
        }
        let mut live = 0u32;
        let mut tomb = 0u32;
        for (v, &p) in self.v2p.iter().enumerate() {
            if p > 0 {
                live += 1;
                if !self.in_span(p as u32) {
                    return Err(format!("{name}: v{v} → p{p} outside the span"));
                }
                if self.p2v[p as usize] != v as u32 {
                    return Err(format!(
                        "{name}: v{v} → p{p} but p{p} → v{}",
                        self.p2v[p as usize]
                    ));
                }
            } else if p == -1 {
                tomb += 1;
            } else if p != 0 {
                return Err(format!("{name}: v{v} has v2p {p}"));
            }
        }
        if live != self.live || tomb != self.tombstones {
            return Err(format!(
                "{name}: {live} live and {tomb} tombstones in v2p, counters say {} and {}",
                self.live, self.tombstones
            ));
        }
        // Each bound page's owner points back (above), so `p2v` binds exactly `live`
        // pages: its other entries are stale by construction.
        let mut holes = self.holes.clone();
        holes.sort_unstable();
        if holes.windows(2).any(|w| w[0] == w[1]) {
            return Err(format!("{name}: a hole is listed twice"));
        }
        for &h in &holes {
            if !self.in_span(h) || self.owner(h) != 0 {
                return Err(format!("{name}: hole p{h} is bound or outside the span"));
            }
        }
        if !self.accounting_holds() {
            return Err(format!(
                "{name}: live {} + holes {} != span {}",
                self.live,
                self.holes.len(),
                self.span_pages()
            ));
        }
        Ok(())
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

/// The span `(s, l)` grown by entries `start..start + len` when they lie in it or abut it
/// on either side (consecutive pages, ascending or descending, are one span); `None` when
/// they are apart. An empty span `(0, 0)` grows only by a span starting at 0.
#[inline(always)]
fn merge((s, l): (u32, u32), start: u32, len: u32) -> Option<(u32, u32)> {
    if start >= s && start + len <= s + l {
        Some((s, l)) // already in it (a page changed twice)
    } else if start == s + l {
        Some((s, l + len))
    } else if start + len == s {
        Some((start, l + len))
    } else {
        None
    }
}

/// Notes entries `start..start + len` dirty in `dirty`, merged into the last span
/// when they can be.
#[inline(always)]
fn note_dirty(dirty: &mut Vec<(u32, u32)>, start: u32, len: u32) {
    match dirty.last_mut() {
        Some(last) => match merge(*last, start, len) {
            Some(grown) => *last = grown,
            None => dirty.push((start, len)),
        },
        None => dirty.push((start, len)),
    }
}

/// A batch pass's dirty spans, written in place into the list's spare room rather than
/// by a `Vec::push` per page: the span being grown stays open (in registers) and is
/// stored when a page does not merge into it. [`DirtySpans::note`] merges as
/// [`note_dirty`] does; the page-by-page notes test less (see each).
struct DirtySpans<'a> {
    /// The spare room: one slot per note, and one for the open span.
    slots: &'a mut [MaybeUninit<(u32, u32)>],
    /// Slots written.
    written: usize,
    /// The span being grown; `(0, 0)` when none.
    open: (u32, u32),
}

impl DirtySpans<'_> {
    /// Takes the list's last span back as the open one and reserves room for `notes`
    /// notes; returns the list's length then, for [`DirtySpans::close`]'s count.
    fn reopen(list: &mut Vec<(u32, u32)>, notes: usize) -> ((u32, u32), usize) {
        let open = list.pop().unwrap_or((0, 0));
        list.reserve(notes + 1);
        (open, list.len())
    }

    /// Notes entries `start..start + len` dirty.
    #[inline(always)]
    fn note(&mut self, start: u32, len: u32) {
        match merge(self.open, start, len) {
            Some(grown) => self.open = grown,
            None => {
                if self.open.1 > 0 {
                    self.slots[self.written].write(self.open);
                    self.written += 1;
                }
                self.open = (start, len);
            }
        }
    }

    /// Notes entry `v` dirty, page by page: it grows the open span only when it comes
    /// right after it (one predictable test for scattered pages; a page that merges no
    /// other way starts a span of its own, which may overlap another).
    #[inline(always)]
    fn note_one(&mut self, v: u32) {
        let (s, l) = self.open;
        if l != 0 && v == s.wrapping_add(l) {
            self.open.1 += 1;
        } else {
            if l != 0 {
                self.slots[self.written].write(self.open);
                self.written += 1;
            }
            self.open = (v, 1);
        }
    }

    /// Notes entry `v` dirty as a span of its own, with no merge test: for a
    /// page-by-page release, whose pages (a decode batch's, scattered over the rows)
    /// seldom abut. The open span stays open (the spans' order does not matter).
    #[inline(always)]
    fn note_apart(&mut self, v: u32) {
        self.slots[self.written].write((v, 1));
        self.written += 1;
    }

    /// Stores the open span; returns how many slots (from the first) hold spans.
    fn close(mut self) -> usize {
        if self.open.1 > 0 {
            self.slots[self.written].write(self.open);
            self.written += 1;
        }
        self.written
    }
}

/// Sorts `pages`, each inside `[lo, hi)`, ascending. Pages that are mostly runs (a
/// page-size-1 compaction's holes: freed rows) are sorted as runs
/// ([`sort_as_runs`]). Otherwise distinct pages not too sparse in the range (range / 64
/// at most pages × log2 pages) are sorted through a bitmap of the range in `bits`
/// (scratch): O(pages + range / 64) rather than O(pages log pages). Sparser or repeated
/// pages take a comparison sort; the result is the same.
fn sort_pages_in(pages: &mut [u32], (lo, hi): (u32, u32), bits: &mut Vec<u64>) {
    if sort_as_runs(pages, bits) {
        return;
    }
    let words = (hi - lo).div_ceil(64) as usize;
    let log = (usize::BITS - pages.len().leading_zeros()) as usize;
    if words > pages.len() * log.max(2) {
        pages.sort_unstable();
        return;
    }
    bits.clear();
    bits.resize(words, 0);
    let mut repeated = 0;
    for &p in pages.iter() {
        let at = p - lo;
        let (word, bit) = (&mut bits[(at / 64) as usize], 1u64 << (at % 64));
        repeated |= *word & bit;
        *word |= bit;
    }
    if repeated != 0 {
        pages.sort_unstable();
        return;
    }
    let mut out = pages.iter_mut();
    for (w, &word) in bits.iter().enumerate() {
        let (base, mut word) = (lo + 64 * w as u32, word);
        while word != 0 {
            // Each set bit is one of the pages, so there is a slot for it.
            if let Some(slot) = out.next() {
                *slot = base + word.trailing_zeros();
            }
            word &= word - 1;
        }
    }
}

/// Sorts `pages` as runs when at most one in eight is outside a run: each [`RUN`]-page
/// chunk that ascends or descends by one starts a run (grown a chunk at a time), each
/// other page is a run of one; the runs, as `start << 32 | len` in `scratch`, are sorted
/// and written back ascending. O(pages + runs log runs). Returns `false`, leaving
/// `pages` as they were, when too few pages run or two runs share a page.
fn sort_as_runs(pages: &mut [u32], scratch: &mut Vec<u64>) -> bool {
    let n = pages.len();
    let (mut i, mut singles) = (0, 0);
    scratch.clear();
    while i < n {
        let run = pages[i..].first_chunk::<RUN>().and_then(|chunk| {
            let step = chunk[1].wrapping_sub(chunk[0]);
            (is_unit(step) && is_ramp(chunk, chunk[0], &steps(step))).then_some((chunk[0], step))
        });
        let Some((first, step)) = run else {
            let end = (i + RUN).min(n);
            singles += end - i;
            if 8 * singles > n {
                return false;
            }
            scratch.extend(pages[i..end].iter().map(|&p| u64::from(p) << 32 | 1));
            i = end;
            continue;
        };
        let ramp = steps(step);
        let mut len = RUN;
        while let Some(next) = pages[i + len..].first_chunk::<RUN>()
            && is_ramp(
                next,
                first.wrapping_add(step.wrapping_mul(len as u32)),
                &ramp,
            )
        {
            len += RUN;
        }
        scratch.push(u64::from(lowest((first, step), len)) << 32 | len as u64);
        i += len;
    }
    scratch.sort_unstable();
    let mut end = 0;
    for &run in scratch.iter() {
        let (start, len) = (run >> 32, run & u64::from(u32::MAX));
        if start < end {
            return false; // a page listed twice
        }
        end = start + len;
    }
    let mut out = 0;
    for &run in scratch.iter() {
        let (start, len) = ((run >> 32) as u32, (run & u64::from(u32::MAX)) as usize);
        for (slot, page) in pages[out..out + len].iter_mut().zip(start..) {
            *slot = page;
        }
        out += len;
    }
    true
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

/// A span's shape as allocations see it: its holes (the last is taken first) and edges.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpanView<'a> {
    /// Free pages inside the span.
    pub(crate) holes: &'a [u32],
    /// First page.
    pub(crate) lo: u32,
    /// One past the last page.
    pub(crate) hi: u32,
}

/// What a batch release [`SubAllocator::release_each`] makes of the pages it visits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Live pages are freed (the FULL side, which has no tombstones).
    Free,
    /// Live pages are freed and tombstones cleared (the SWA side of a two-sided free).
    FreeAndClear,
    /// Live pages become tombstones, the rest is left (the SWA side of a window release).
    Tombstone,
}

/// Which pages of a batch release [`SubAllocator::release_each`] visits.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Keep<'a> {
    /// Every page but the sink.
    NotSink,
    /// Every page but the sink whose entry in this table (the peer side's `v2p`) is live.
    LiveIn(&'a [i32]),
}

impl Keep<'_> {
    #[inline(always)]
    fn keeps(self, v: u32) -> bool {
        match self {
            Keep::NotSink => v != 0,
            Keep::LiveIn(table) => v != 0 && table[v as usize] > 0,
        }
    }
}

/// Pages a batch pass handles at once when they form a run.
pub(crate) const RUN: usize = 16;

/// `step * t` for each `t < RUN` (wrapping), for a step of 1 or -1: with `m` all ones
/// for -1 and zero for 1, `step * t = (t ^ m) - m`, since SSE2 has no lane-wise 32-bit
/// multiply (and a select between two ramps costs more than this).
#[inline(always)]
pub(crate) fn steps(step: u32) -> [u32; RUN] {
    let m = ((step as i32) >> 31) as u32;
    let mut out = [0; RUN];
    for (t, o) in out.iter_mut().enumerate() {
        *o = (t as u32 ^ m).wrapping_sub(m);
    }
    out
}

/// The owner of page `p` in these tables, 0 when free (see [`SubAllocator::p2v`]).
#[inline(always)]
fn owner(v2p: &[i32], p2v: &[u32], p: u32) -> u32 {
    if is_bound(v2p, p2v, p) {
        p2v[p as usize]
    } else {
        0
    }
}

/// Whether page `p` is bound in these tables: its `p2v` entry is a page whose `v2p`
/// entry points back. Branch-free (`v2p[0]`, the sink's entry, is read for a page with
/// no owner), so a batch pass can fold it over a chunk.
#[inline(always)]
fn is_bound(v2p: &[i32], p2v: &[u32], p: u32) -> bool {
    let v = p2v[p as usize];
    (v != 0) & (v2p[v as usize] == p as i32)
}

/// Pages a batch release clears with slice writes: consecutive virtual pages (either
/// way), none the sink and each kept, all live on consecutive physical pages (either
/// way) or all tombstones.
struct ReleaseRun {
    /// The pages in the run, a multiple of [`RUN`].
    len: usize,
    /// The first page visited and the step to the next (±1).
    pages: (u32, u32),
    /// Live: the physical page of the first page visited and the step to the next's
    /// (±1). `None`: tombstones.
    entries: Option<(u32, u32)>,
}

impl ReleaseRun {
    /// The longest run, [`RUN`] pages at a time, at the start of `pages`; tombstones
    /// only when `clear_tombstones`.
    #[inline(always)]
    fn find(
        pages: &[u32],
        v2p: &[i32],
        keep: Keep<'_>,
        clear_tombstones: bool,
    ) -> Option<ReleaseRun> {
        let [v, next, ..] = *pages else { return None };
        let sv = next.wrapping_sub(v);
        if !is_unit(sv) {
            return None;
        }
        let first = *v2p.get(v as usize)?;
        let entries = if first > 0 {
            let sp = (*v2p.get(next as usize)? as u32).wrapping_sub(first as u32);
            if !is_unit(sp) {
                return None;
            }
            Some((first as u32, sp))
        } else if first == -1 && clear_tombstones {
            None
        } else {
            return None;
        };
        let page_steps = steps(sv);
        // Entries as the table lists them: in visiting order when the pages ascend, else
        // reversed.
        let entry_steps =
            entries.map(|(_, sp)| steps(if sv == 1 { sp } else { sp.wrapping_neg() }));
        let mut len = 0;
        while let Some(chunk) = pages[len..].first_chunk::<RUN>() {
            if !is_ramp(
                chunk,
                v.wrapping_add(sv.wrapping_mul(len as u32)),
                &page_steps,
            ) {
                break;
            }
            let v_lo = chunk[0].min(chunk[RUN - 1]) as usize;
            if v_lo == 0 {
                break;
            }
            let Some(table) = v2p.get(v_lo..).and_then(<[i32]>::first_chunk::<RUN>) else {
                break;
            };
            if let Keep::LiveIn(peer) = keep {
                let Some(peer) = peer.get(v_lo..v_lo + RUN) else {
                    break;
                };
                if !peer.iter().fold(true, |ok, &e| ok & (e > 0)) {
                    break;
                }
            }
            let ok = match (entries, &entry_steps) {
                (Some((p, sp)), Some(steps)) => {
                    // The entry of the chunk's lowest page.
                    let back = if sv == 1 { len } else { len + RUN - 1 } as u32;
                    let lo = p.wrapping_add(sp.wrapping_mul(back));
                    // A ramp of pages is live when both its ends are (it is monotone).
                    is_ramp(&table.map(|e| e as u32), lo, steps) && table[0].min(table[RUN - 1]) > 0
                }
                _ => table.iter().fold(true, |ok, &e| ok & (e == -1)),
            };
            if !ok {
                break;
            }
            len += RUN;
        }
        (len > 0).then_some(ReleaseRun {
            len,
            pages: (v, sv),
            entries,
        })
    }
}

/// Where a batch bind's next pages come from.
#[derive(Clone, Copy)]
enum Pages<'a> {
    /// The top of the hole stack: the last entry is taken first.
    Stack(&'a [u32]),
    /// The frontier: `(first, step)`.
    Ramp(u32, u32),
}

/// Binds a batch bind writes as ramps: the `t`-th is `(u + su·t, q + sq·t)` for steps
/// of ±1, so id `v` gets page `q + d·(v - u)` and page `p` gets id `u + d·(p - q)`,
/// with `d = su·sq`.
struct BindRun {
    /// The binds in the run, a multiple of [`RUN`].
    len: usize,
    /// The first id and the step to the next (`u`, `su`).
    ids: (u32, u32),
    /// The first page and the step to the next (`q`, `sq`).
    pages: (u32, u32),
    /// Tombstones among the ids' entries (a bind revives them).
    revived: u32,
}

impl BindRun {
    /// The longest run, [`RUN`] binds at a time and at most `max`, at the next binds:
    /// the ids from the end of `ids` backward (a stack's top), the pages from `pages`;
    /// `None` when not one [`RUN`] of ids and pages runs, or an id is bound.
    #[inline(always)]
    fn find(ids: &[u32], pages: Pages<'_>, max: usize, v2p: &[i32]) -> Option<BindRun> {
        if max < RUN {
            return None;
        }
        let (u, su) = stack_top_step(ids)?;
        let (q, sq) = match pages {
            Pages::Stack(stack) => stack_top_step(stack)?,
            Pages::Ramp(q, sq) => (q, sq),
        };
        if !(is_unit(su) && is_unit(sq)) {
            return None;
        }
        let (id_steps, page_steps) = (steps(su.wrapping_neg()), steps(sq.wrapping_neg()));
        let (mut len, mut revived) = (0usize, 0u32);
        while len + RUN <= max {
            // The next RUN binds' ids, as the stack lists them (reversed): the last is
            // bind `len`, the first bind `len + RUN - 1`.
            let back = (len + RUN - 1) as u32;
            let Some(chunk) = stack_chunk(ids, len) else {
                break;
            };
            if !is_ramp(chunk, u.wrapping_add(su.wrapping_mul(back)), &id_steps) {
                break;
            }
            if let Pages::Stack(stack) = pages {
                let Some(chunk) = stack_chunk(stack, len) else {
                    break;
                };
                if !is_ramp(chunk, q.wrapping_add(sq.wrapping_mul(back)), &page_steps) {
                    break;
                }
            }
            let v_lo = chunk[0].min(chunk[RUN - 1]) as usize;
            let Some(entries) = v2p.get(v_lo..).and_then(<[i32]>::first_chunk::<RUN>) else {
                break;
            };
            // Unbound entries are 0 (free) or -1 (a tombstone): minus their sum counts
            // the tombstones, without a popcount (which baseline x86-64 lacks).
            if !entries.iter().fold(true, |ok, &e| ok & (e == 0 || e == -1)) {
                break;
            }
            revived += entries.iter().sum::<i32>().unsigned_abs();
            len += RUN;
        }
        (len > 0).then_some(BindRun {
            len,
            ids: (u, su),
            pages: (q, sq),
            revived,
        })
    }

    /// Writes the run's entries, owners and dirty entries (`dirty`: one slot per bind).
    #[inline(always)]
    fn write(&self, v2p: &mut [i32], p2v: &mut [u32]) {
        let ((u, su), (q, sq)) = (self.ids, self.pages);
        let d = su.wrapping_mul(sq);
        let (v_lo, p_lo) = (lowest(self.ids, self.len), lowest(self.pages, self.len));
        let entry_lo = q.wrapping_add(d.wrapping_mul(v_lo.wrapping_sub(u)));
        let owner_lo = u.wrapping_add(d.wrapping_mul(p_lo.wrapping_sub(q)));
        let (v_lo, p_lo) = (v_lo as usize, p_lo as usize);
        fill_ramps(
            &mut v2p[v_lo..v_lo + self.len],
            (entry_lo, d),
            (0, 1),
            |p, _| p as i32,
        );
        fill_ramps(
            &mut p2v[p_lo..p_lo + self.len],
            (owner_lo, d),
            (0, 1),
            |v, _| v,
        );
    }
}

/// The top entry of a stack (the next popped) and the step to the one below it.
#[inline(always)]
fn stack_top_step(stack: &[u32]) -> Option<(u32, u32)> {
    let [.., below, top] = stack else {
        return None;
    };
    Some((*top, below.wrapping_sub(*top)))
}

/// The [`RUN`] entries of `stack` below its top `skip`, as listed (the last popped
/// first); `None` when fewer are left.
#[inline(always)]
fn stack_chunk(stack: &[u32], skip: usize) -> Option<&[u32; RUN]> {
    stack[..stack.len().checked_sub(skip)?].last_chunk()
}

/// The lowest of the `len` values `first + step·t` (`step` ±1, no wrap).
#[inline(always)]
fn lowest((first, step): (u32, u32), len: usize) -> u32 {
    first.min(first.wrapping_add(step.wrapping_mul(len as u32 - 1)))
}

/// Whether `step` is 1 or -1 (wrapping).
#[inline(always)]
fn is_unit(step: u32) -> bool {
    step == 1 || step == u32::MAX
}

/// Whether `chunk[t] == first + steps[t]` for every `t` (wrapping), branch-free.
#[inline(always)]
pub(crate) fn is_ramp(chunk: &[u32; RUN], first: u32, steps: &[u32; RUN]) -> bool {
    chunk
        .iter()
        .zip(steps)
        .fold(true, |ok, (&x, &d)| ok & (x == first.wrapping_add(d)))
}

/// Writes `f(a + sa·t, b + sb·t)` (wrapping) to `dst[t]`, for steps of ±1: two ramps,
/// [`RUN`] slots at a time as vector adds (a ramp not needed is `(0, 1)`, and folds
/// away).
#[inline(always)]
fn fill_ramps<T>(
    dst: &mut [T],
    (a, sa): (u32, u32),
    (b, sb): (u32, u32),
    f: impl Fn(u32, u32) -> T,
) {
    let (da, db) = (steps(sa), steps(sb));
    let (ja, jb) = (sa.wrapping_mul(RUN as u32), sb.wrapping_mul(RUN as u32));
    let (mut a, mut b) = (a, b);
    let mut chunks = dst.chunks_exact_mut(RUN);
    for chunk in &mut chunks {
        for ((slot, &da), &db) in chunk.iter_mut().zip(&da).zip(&db) {
            *slot = f(a.wrapping_add(da), b.wrapping_add(db));
        }
        a = a.wrapping_add(ja);
        b = b.wrapping_add(jb);
    }
    for ((slot, &da), &db) in chunks.into_remainder().iter_mut().zip(&da).zip(&db) {
        *slot = f(a.wrapping_add(da), b.wrapping_add(db));
    }
}

/// A zeroed table of `len` entries whose memory is mapped now: one write per 4 KiB page
/// (through `black_box`, so it is not elided), instead of a page fault at the first
/// write on the scheduling path.
pub(crate) fn resident_table<T: Copy + Default>(len: usize) -> Vec<T> {
    let mut table = vec![T::default(); len];
    let step = (4096 / std::mem::size_of::<T>()).max(1);
    for i in (0..len).step_by(step) {
        table[i] = std::hint::black_box(T::default());
    }
    table
}

/// An empty list with room for `bound` entries, mapped now (written once and cleared):
/// pushes up to its bound neither reallocate nor fault on the scheduling path.
pub(crate) fn resident_list<T: Copy + Default>(bound: usize) -> Vec<T> {
    let mut list = Vec::with_capacity(bound);
    list.resize(bound, std::hint::black_box(T::default()));
    list.clear();
    list
}

/// The free virtual pages of an id owner (FULL, Mamba): a stack, so the most recently
/// freed id is reused first; ids `1..count` (0 is the sink).
#[derive(Debug, Clone)]
pub struct VirtualIds {
    free: Vec<u32>,
    count: u32,
}

impl VirtualIds {
    /// Ids `1..count`, all free; the lowest is handed out first.
    pub fn new(count: u32) -> VirtualIds {
        VirtualIds {
            free: (1..count).rev().collect(),
            count,
        }
    }

    /// Ids in the space, the sink included.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Free ids.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Takes an id.
    #[inline(always)]
    pub(crate) fn pop(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// The free ids as a stack (the last is taken first), for batch takes and returns.
    #[inline]
    pub(crate) fn stack(&mut self) -> &mut Vec<u32> {
        &mut self.free
    }

    /// Returns an id (the caller checked it was live).
    #[inline(always)]
    pub(crate) fn push(&mut self, v: u32) {
        self.free.push(v);
    }

    /// The free ids, in no particular order.
    pub fn as_slice(&self) -> &[u32] {
        &self.free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> Grid {
        Grid {
            envelope: 8,
            pages: 32,
            min_page: 2,
            stride: 4,
        }
    }

    /// Binds virtual pages 1..=n, frees those in `freed`, compacts; checks the moves are
    /// disjoint whole envelopes and the span is packed.
    fn compact_case(grow: Grow, n: u32, freed: &[u32]) {
        // Rows longer than a batch pass's [`RUN`] need a bigger grid.
        let g = if n > 30 {
            Grid {
                pages: 128,
                ..grid()
            }
        } else {
            grid()
        };
        let mut sub = SubAllocator::new(g, grow, 256);
        for v in 1..=n {
            let p = sub.take();
            sub.bind(v, p);
        }
        for &v in freed {
            sub.unbind(v, false);
        }
        sub.verify("sub").unwrap();
        let mut mirror = sub.v2p.clone();
        sub.clear_dirty();
        // Planning changes nothing; the envelopes predicted after the planned compaction
        // are the ones the binds take once it commits.
        let before = state(&sub);
        let (mut moves, mut plan) = (Vec::new(), CompactionPlan::default());
        sub.plan_compaction(Edge::Low, &mut moves, &mut plan);
        assert_eq!(state(&sub), before, "{grow:?}: planning changed the tables");
        // The pairs: the band's survivors in page order, each into the next hole of the
        // packed span, lowest first.
        let h = sub.holes.len() as u32;
        let (packed, band) = match sub.compaction_edge(Edge::Low) {
            Edge::Low => (sub.lo..sub.hi - h, sub.hi - h..sub.hi),
            Edge::High => (sub.lo + h..sub.hi, sub.lo..sub.lo + h),
        };
        let mut inner: Vec<u32> = sub
            .holes
            .iter()
            .copied()
            .filter(|p| packed.contains(p))
            .collect();
        inner.sort_unstable();
        let survivors = band.filter(|&p| sub.owner(p) != 0);
        let want: Vec<(u32, u32)> = survivors.zip(inner).collect();
        assert_eq!(plan.pairs, want, "{grow:?}");
        let mut predicted = Vec::new();
        let room = (sub.grid.pages - sub.grid.min_page - sub.live).min(3) as usize;
        sub.handout_envelopes(
            room,
            plan.view().unwrap_or(sub.view()),
            sub.growth_edge(),
            &mut predicted,
        );
        let mut committed = sub.clone();
        committed.commit_compaction(&plan);
        let taken: Vec<ByteSpan> = (0..room)
            .map(|i| {
                let p = committed.take();
                committed.bind(250 - i as u32, p);
                committed.envelope(p)
            })
            .collect();
        assert_eq!(predicted, taken, "{grow:?}");
        moves.clear();
        let moved = sub.compact(&mut moves);
        assert_eq!(moved, plan.pairs.len());
        sub.verify("sub").unwrap();
        upload(&mut sub, &mut mirror); // every rebound entry is dirty
        assert!(sub.holes.is_empty());
        assert_eq!(sub.span_pages(), n - freed.len() as u32);
        // The moves are the planned pairs' envelopes, abutting ones merged into one copy.
        let envelopes: Vec<(u64, u64)> = moves
            .iter()
            .flat_map(|m| (0..m.len / 8).map(move |k| (m.src + 8 * k, m.dst + 8 * k)))
            .collect();
        let pairs: Vec<(u64, u64)> = plan
            .pairs
            .iter()
            .map(|&(s, d)| (s as u64 * 8, d as u64 * 8))
            .collect();
        assert_eq!(envelopes, pairs, "{grow:?}");
        for w in moves.windows(2) {
            let abut = w[0].src + w[0].len == w[1].src && w[0].dst + w[0].len == w[1].dst;
            assert!(!abut, "{grow:?}: {w:?} are one copy");
        }
        for m in &moves {
            assert!(m.len % 8 == 0 && m.len > 0);
            assert!(
                !envelopes
                    .iter()
                    .any(|&(src, _)| src >= m.dst && src < m.dst + m.len),
                "{grow:?}: a destination is also a source"
            );
        }
    }

    #[test]
    fn compaction_packs_both_directions() {
        for grow in [Grow::Up, Grow::Down] {
            compact_case(grow, 10, &[1, 5, 10]);
            compact_case(grow, 10, &[9, 10]); // holes at the frontier: no move
            compact_case(grow, 10, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
            compact_case(grow, 12, &[2, 3, 4, 8]); // a run of survivors into a run of holes
            compact_case(grow, 30, &[3, 9, 10, 11, 17, 25, 26, 29]);
            compact_case(grow, 1, &[]);
            // Rows of more than [`RUN`] survivors and holes: whole chunks, a free page
            // inside a chunk of the band, holes that do not run.
            let row: Vec<u32> = (1..=20).collect();
            compact_case(grow, 60, &row);
            compact_case(grow, 60, &[&row[..18], &[50]].concat());
            compact_case(grow, 60, &(1..=39).step_by(2).collect::<Vec<_>>());
            compact_case(
                grow,
                100,
                &[&(3..=40).collect::<Vec<_>>()[..], &[77, 95]].concat(),
            );
        }
        let mut sub = SubAllocator::new(grid(), Grow::Up, 64);
        let mut moves = Vec::new();
        assert_eq!(sub.compact(&mut moves), 0, "no holes, no moves");
    }

    /// A page listed twice, the second time inside another run's span, is not lost or
    /// misplaced by the runs sort (it falls back to a comparison sort).
    #[test]
    fn a_page_repeated_inside_a_run_sorts_as_a_comparison_sort_does() {
        let mut pages: Vec<u32> = (0..200).chain(1000..1100).collect();
        pages.push(50);
        pages.extend(1100..1200);
        let mut expected = pages.clone();
        expected.sort_unstable();
        sort_pages_in(&mut pages, (0, 1200), &mut Vec::new());
        assert_eq!(pages, expected);
    }

    proptest::proptest! {
        /// Dense, sparse or repeated, pages come out as a comparison sort leaves them.
        #[test]
        fn pages_sort_as_a_comparison_sort_does(
            lo in 0u32..1000,
            width in 1u32..700,
            picks in proptest::collection::vec(0u32..700, 0..400),
            repeat in proptest::bool::ANY,
        ) {
            let mut pages: Vec<u32> = picks.iter().map(|&k| lo + k % width).collect();
            if !repeat {
                pages.sort_unstable();
                pages.dedup();
                // A fixed shuffle, so the input is not sorted already.
                let n = pages.len();
                for i in 0..n {
                    pages.swap(i, (i * 7 + 3) % n);
                }
            }
            let mut expected = pages.clone();
            expected.sort_unstable();
            let mut bits = vec![u64::MAX; 3]; // stale scratch is cleared
            sort_pages_in(&mut pages, (lo, lo + width), &mut bits);
            proptest::prop_assert_eq!(pages, expected);
        }

        /// Runs either way (a freed row's pages), some single pages and perhaps a page
        /// listed twice, in a shuffled order of runs, come out as a comparison sort
        /// leaves them.
        #[test]
        fn runs_sort_as_a_comparison_sort_does(
            lens in proptest::collection::vec((1usize..300, proptest::bool::ANY), 0..12),
            order in proptest::collection::vec(0usize..1000, 12),
            repeat in proptest::option::of(0usize..2000),
        ) {
            // Run k covers [300 k, 300 k + len), listed up or down.
            let mut runs: Vec<Vec<u32>> = lens
                .iter()
                .enumerate()
                .map(|(k, &(len, down))| {
                    let run = 300 * k as u32..300 * k as u32 + len as u32;
                    if down { run.rev().collect() } else { run.collect() }
                })
                .collect();
            for (k, &o) in order.iter().enumerate().take(runs.len()) {
                let j = o % runs.len();
                runs.swap(k, j);
            }
            let mut pages: Vec<u32> = runs.concat();
            if let Some(r) = repeat.filter(|_| !pages.is_empty()) {
                let again = pages[r % pages.len()];
                pages.insert((r * 7) % pages.len(), again);
            }
            let mut expected = pages.clone();
            expected.sort_unstable();
            let mut bits = vec![u64::MAX; 3];
            sort_pages_in(&mut pages, (0, 3600), &mut bits);
            proptest::prop_assert_eq!(pages, expected);
        }
    }

    /// The full scan names each kind of table corruption (and passes a sound table).
    #[test]
    fn verify_names_every_kind_of_corruption() {
        let sound = || {
            let mut sub = SubAllocator::new(grid(), Grow::Up, 16);
            for v in 1..=4 {
                let p = sub.take();
                sub.bind(v, p);
            }
            sub.unbind(2, true);
            sub
        };
        assert_eq!(sound().verify("up"), Ok(()));
        type Corrupt = fn(&mut SubAllocator);
        let cases: [(&str, Corrupt); 7] = [
            ("the sink is bound", |s| s.v2p[0] = 3),
            ("outside the span", |s| s.v2p[1] = 30),
            ("but p", |s| s.p2v[s.v2p[1] as usize] = 4),
            ("has v2p -2", |s| s.v2p[5] = -2),
            ("counters say", |s| s.tombstones += 1),
            ("listed twice", |s| {
                let h = s.holes[0];
                s.holes.push(h);
            }),
            ("is bound or outside the span", |s| {
                s.holes[0] = s.v2p[1] as u32
            }),
        ];
        for (needle, corrupt) in cases {
            let mut sub = sound();
            corrupt(&mut sub);
            let err = sub.verify("up").unwrap_err();
            assert!(
                err.starts_with("up: ") && err.contains(needle),
                "{needle}: {err}"
            );
        }
    }

    /// The read accessors answer from the tables: a bound page's entries both ways, a
    /// page freed inside the span as a hole, the span's ends (the high one exclusive),
    /// and binding a tombstoned page clears its tombstone.
    #[test]
    fn the_accessors_and_a_rebind_over_a_tombstone_follow_the_tables() {
        let mut sub = SubAllocator::new(grid(), Grow::Down, 16);
        let (p, q) = (sub.take(), sub.take());
        sub.bind(3, p);
        sub.bind(5, q);
        assert_eq!(
            (sub.v2p(3), sub.p2v(p), sub.v2p(5), sub.p2v(q)),
            (p as i32, 3, q as i32, 5)
        );
        assert_eq!(
            (sub.v2p(99), sub.p2v(999)),
            (0, 0),
            "out of range reads as unbound"
        );
        let (lo, hi) = sub.span();
        assert!(sub.in_span(lo) && sub.in_span(hi - 1) && !sub.in_span(hi));
        // Freeing the top page (the span's far end, below the frontier) leaves a hole.
        let top = p.max(q);
        let v = sub.p2v(top);
        sub.unbind(v, true);
        assert_eq!(sub.holes(), [top]);
        assert_eq!((sub.v2p(v), sub.tombstones()), (-1, 1));
        let r = sub.take();
        sub.bind(v, r);
        assert_eq!((sub.v2p(v), sub.tombstones(), sub.live()), (r as i32, 0, 2));
    }

    #[test]
    fn tombstones_and_dirty_entries_are_tracked() {
        let mut sub = SubAllocator::new(grid(), Grow::Down, 16);
        let p = sub.take();
        assert_eq!(p, 31, "grows down from the top page");
        sub.bind(3, p);
        assert_eq!((sub.v2p[3], sub.tombstones(), sub.live()), (p as i32, 0, 1));
        sub.unbind(3, true);
        assert_eq!((sub.v2p[3], sub.tombstones(), sub.live()), (-1, 1, 0));
        sub.clear_tombstone(3);
        assert_eq!((sub.v2p[3], sub.tombstones()), (0, 0));
        assert_eq!(
            sub.dirty_spans(),
            [(3, 1)],
            "a page changed three times is one entry"
        );
        assert_eq!(sub.dirty_count(), 1);
        let mut mirror = vec![0; 16];
        mirror[3] = 7;
        upload(&mut sub, &mut mirror);
        assert_eq!(mirror[3], 0, "the upload copies the entry as it is now");
        assert!(!sub.has_dirty());
        // Consecutive pages, either way, are one span; others are spans of their own.
        for v in [5, 6, 4, 9, 6] {
            sub.mark(v);
        }
        assert_eq!(sub.dirty_spans(), [(4, 3), (9, 1), (6, 1)]);
        assert_eq!(sub.dirty_count(), 5);
    }

    /// A page-size-1 row (consecutive ids on consecutive pages) is one dirty span when it
    /// is bound, however long it is, and one span for its whole chunks when it is
    /// released (its last pages, fewer than [`RUN`], go page by page).
    #[test]
    fn a_run_is_one_dirty_span() {
        let big = Grid {
            envelope: 8,
            pages: 256,
            min_page: 1,
            stride: 4,
        };
        let mut sub = SubAllocator::new(big, Grow::Up, 256);
        let row: Vec<u32> = (10..110).collect();
        let popped: Vec<u32> = row.iter().rev().copied().collect();
        sub.bind_popped(&popped);
        assert_eq!(sub.dirty_spans(), [(10, 100)]);
        let mut mirror = vec![0; 256];
        upload(&mut sub, &mut mirror);
        sub.release_each(&row, Keep::NotSink, Release::Free, None);
        let tail = (106..110).map(|v| (v, 1));
        assert_eq!(
            sub.dirty_spans(),
            tail.chain([(10, 96)]).collect::<Vec<_>>()
        );
        upload(&mut sub, &mut mirror);
    }

    /// The mirror upload: copies the dirty spans of `v2p` into `mirror` and forgets them.
    /// Checks that the mirror then equals `v2p`: every changed entry was in a span.
    fn upload(sub: &mut SubAllocator, mirror: &mut [i32]) {
        for &(start, len) in sub.dirty_spans() {
            let span = start as usize..(start + len) as usize;
            mirror[span.clone()].copy_from_slice(&sub.v2p[span]);
        }
        sub.clear_dirty();
        assert_eq!(
            mirror,
            &sub.v2p[..],
            "an entry changed outside every dirty span"
        );
    }

    /// The pages the dirty spans cover.
    fn dirty_pages(sub: &SubAllocator) -> std::collections::BTreeSet<u32> {
        sub.dirty_spans()
            .iter()
            .flat_map(|&(start, len)| start..start + len)
            .collect()
    }

    /// Everything a batch form must leave exactly as the page-by-page calls do.
    fn state(sub: &SubAllocator) -> impl PartialEq + std::fmt::Debug + use<> {
        (
            (sub.v2p.clone(), sub.p2v.clone(), sub.holes.clone()),
            (sub.lo, sub.hi, sub.live, sub.tombstones),
            dirty_pages(sub),
        )
    }

    /// What [`SubAllocator::release_each`] promises, page by page: unbind each kept live
    /// page (returning the ids; to a tombstone under `Release::Tombstone`), clear each
    /// kept tombstone under `Release::FreeAndClear`.
    fn release_one_by_one(
        sub: &mut SubAllocator,
        pages: &[u32],
        keep: Keep<'_>,
        how: Release,
    ) -> Vec<u32> {
        let mut released = Vec::new();
        for &v in pages.iter().filter(|&&v| keep.keeps(v)) {
            match sub.v2p[v as usize] {
                p if p > 0 => {
                    sub.unbind(v, how == Release::Tombstone);
                    released.push(v);
                }
                -1 if how == Release::FreeAndClear => sub.clear_tombstone(v),
                _ => {}
            }
        }
        released
    }

    /// A release mode drawn from `n` (0, 1 or 2).
    fn release_mode(n: u32) -> Release {
        [Release::Free, Release::FreeAndClear, Release::Tombstone][n as usize]
    }

    /// The run fast paths (a page-size-1 prefill: [`RUN`] consecutive ids on consecutive
    /// pages) against page-by-page calls: ids ascending and descending, pages fresh at
    /// either end or from holes in either order, runs of tombstones, runs broken by a
    /// bound id, a tombstone, a free page, a peer page that is not live or a repeated
    /// page, and batches that end mid-chunk.
    #[test]
    fn run_shaped_batches_match_page_by_page_calls() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u32| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 33) % n as u64) as u32
        };
        let big = Grid {
            envelope: 8,
            pages: 400,
            // Page 1 bound: a descending run of entries can end at a free entry (0).
            min_page: 1,
            stride: 4,
        };
        const IDS: u32 = 300;
        // A peer table that keeps every page but a few.
        let peer: Vec<i32> = (0..IDS as i32).map(|v| (v % 37 != 5) as i32).collect();
        let (mut fast_binds, mut fast_releases) = (0, 0);
        for grow in [Grow::Up, Grow::Down] {
            let (mut batch, mut single) = (
                SubAllocator::new(big, grow, IDS),
                SubAllocator::new(big, grow, IDS),
            );
            let mut mirrors = (vec![0; IDS as usize], vec![0; IDS as usize]);
            for round in 0..300 {
                let free: Vec<u32> = (1..IDS).filter(|&v| batch.v2p[v as usize] <= 0).collect();
                let room = (big.pages - big.min_page - batch.live) as usize;
                if round % 2 == 0 && free.len() > RUN && room > RUN {
                    // A run of ids from a random start, either way, sometimes with one id
                    // that is already bound swapped in (a broken run).
                    let n = (RUN + next(3 * RUN as u32) as usize)
                        .min(free.len())
                        .min(room);
                    let start = next((free.len() - n) as u32 + 1) as usize;
                    let mut ids: Vec<u32> = free[start..start + n].to_vec();
                    if next(2) == 0 {
                        ids.reverse();
                    }
                    fast_binds += ids.windows(2).filter(|w| w[0].abs_diff(w[1]) == 1).count();
                    // The stack's top: the last bound first.
                    let popped: Vec<u32> = ids.iter().rev().copied().collect();
                    batch.bind_popped(&popped);
                    for &v in &ids {
                        let p = single.take();
                        single.bind(v, p);
                    }
                } else if batch.live > 0 {
                    // Release a run of bound ids (either way), or of any ids (runs of
                    // tombstones, free pages amid live ones), with repeats and sink visits
                    // now and then, and tombstone a few first so some chunks are broken.
                    let bound: Vec<u32> = match next(3) {
                        0 => (1..IDS).collect(),
                        _ => (1..IDS).filter(|&v| batch.v2p[v as usize] > 0).collect(),
                    };
                    let n = (RUN + next(3 * RUN as u32) as usize).min(bound.len());
                    let start = next((bound.len() - n) as u32 + 1) as usize;
                    let mut pages: Vec<u32> = bound[start..start + n].to_vec();
                    if next(2) == 0 {
                        pages.reverse();
                    }
                    match next(4) {
                        0 => pages.push(pages[0]),
                        1 => pages.insert(next(pages.len() as u32) as usize, 0),
                        2 => {
                            let v = pages[next(pages.len() as u32) as usize];
                            if batch.v2p[v as usize] > 0 {
                                batch.unbind(v, true);
                                single.unbind(v, true);
                            }
                        }
                        _ => {}
                    }
                    fast_releases += pages.len();
                    let how = release_mode(next(3));
                    let keep = Keep::LiveIn(&peer);
                    let mut released = Vec::new();
                    batch.release_each(&pages, keep, how, Some(&mut released));
                    let expected = release_one_by_one(&mut single, &pages, keep, how);
                    assert_eq!(released, expected, "{grow:?} round {round}");
                }
                assert_eq!(state(&batch), state(&single), "{grow:?} round {round}");
                batch.verify("batch").unwrap();
                if round % 7 == 6 {
                    // Holes in both orders: a compaction empties them, binds refill them.
                    let mut moves = Vec::new();
                    batch.compact(&mut moves);
                    single.compact(&mut moves);
                    upload(&mut batch, &mut mirrors.0);
                    upload(&mut single, &mut mirrors.1);
                }
            }
        }
        assert!(
            fast_binds > 2000 && fast_releases > 2000,
            "{fast_binds} {fast_releases}"
        );
    }

    /// The two run shapes a random walk seldom makes: a run of tombstones cleared by a
    /// two-sided free, and pages whose entries descend to page 1 and then to a free
    /// entry, which a run must not take for live.
    #[test]
    fn tombstone_runs_and_a_ramp_down_to_a_free_entry_release_as_page_by_page() {
        let grid = Grid {
            envelope: 8,
            pages: 128,
            min_page: 1,
            stride: 4,
        };
        let peer = vec![1; 128];
        let keep = Keep::LiveIn(&peer);
        let check = |setup: &dyn Fn(&mut SubAllocator), pages: &[u32], how: Release| {
            let (mut batch, mut single) = (
                SubAllocator::new(grid, Grow::Up, 128),
                SubAllocator::new(grid, Grow::Up, 128),
            );
            setup(&mut batch);
            setup(&mut single);
            let mut released = Vec::new();
            batch.release_each(pages, keep, how, Some(&mut released));
            let expected = release_one_by_one(&mut single, pages, keep, how);
            assert_eq!(released, expected, "{how:?}");
            assert_eq!(state(&batch), state(&single), "{how:?}");
            batch.verify("batch").unwrap();
        };
        // Ids 20 down to 6 on pages 1 up to 15: v2p[6..=20] is 15 down to 1, v2p[21] is 0.
        let descending = |sub: &mut SubAllocator| {
            for v in (6..=20).rev() {
                let p = sub.take();
                sub.bind(v, p);
            }
        };
        let ids: Vec<u32> = (6..=21).collect();
        check(&descending, &ids, Release::Free);
        check(
            &descending,
            &ids.iter().rev().copied().collect::<Vec<_>>(),
            Release::Free,
        );
        // Ids 10..60 bound in order, then tombstoned: 50 tombstones in a row.
        let tombstoned = |sub: &mut SubAllocator| {
            for v in 10..60 {
                let p = sub.take();
                sub.bind(v, p);
            }
            let pages: Vec<u32> = (10..60).collect();
            sub.release_each(&pages, Keep::NotSink, Release::Tombstone, None);
            assert_eq!((sub.live(), sub.tombstones()), (0, 50));
        };
        let ids: Vec<u32> = (5..65).collect();
        check(&tombstoned, &ids, Release::FreeAndClear);
        check(
            &tombstoned,
            &ids.iter().rev().copied().collect::<Vec<_>>(),
            Release::FreeAndClear,
        );
        check(&tombstoned, &ids, Release::Free);
    }

    #[test]
    fn batch_binds_and_releases_match_page_by_page_calls() {
        // A small LCG: deterministic, no dependency.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u32| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 33) % n as u64) as u32
        };
        for grow in [Grow::Up, Grow::Down, Grow::Float] {
            let (mut batch, mut single) = (
                SubAllocator::new(grid(), grow, 64),
                SubAllocator::new(grid(), grow, 64),
            );
            let mut mirrors = (vec![0; 64], vec![0; 64]);
            if grow == Grow::Float {
                assert!(batch.place(12) && single.place(12));
            }
            let mut free: Vec<u32> = (1..64).rev().collect();
            let (mut bound, mut unbound) = (0, 0);
            for round in 0..400 {
                let room = batch.grid.pages - batch.span_pages() + batch.holes.len() as u32;
                let room = match grow {
                    // A float grows at its high edge only here; an end up to the grid.
                    Grow::Float => batch.grid.pages - batch.hi + batch.holes.len() as u32,
                    _ => room.min(batch.grid.pages - batch.grid.min_page - batch.live),
                };
                if round % 3 != 2 && room > 0 && !free.is_empty() {
                    let n = next(room.min(free.len() as u32).min(6) + 1) as usize;
                    let ids: Vec<u32> = (0..n).map(|_| free.pop().unwrap()).collect();
                    let (mut spans_batch, mut spans_single) = (Vec::new(), Vec::new());
                    batch.handout_envelopes(
                        ids.len(),
                        batch.view(),
                        batch.growth_edge(),
                        &mut spans_batch,
                    );
                    batch.bind_popped(&ids.iter().rev().copied().collect::<Vec<_>>());
                    bound += ids.len();
                    for &v in &ids {
                        let p = single.take();
                        single.bind(v, p);
                        spans_single.push(single.envelope(p));
                    }
                    assert_eq!(spans_batch, spans_single, "{grow:?} round {round}");
                } else {
                    // Any pages, bound or not, with repeats and the sink: the filter and
                    // the table decide, as in a flush.
                    let pages: Vec<u32> = (0..next(8)).map(|_| next(64)).collect();
                    let how = release_mode(next(3));
                    // A peer table that keeps four pages in five.
                    let peer: Vec<i32> = (0..64).map(|v| (v % 5 != 1) as i32).collect();
                    let keep = Keep::LiveIn(&peer);
                    let mut released = Vec::new();
                    batch.release_each(&pages, keep, how, Some(&mut released));
                    let expected = release_one_by_one(&mut single, &pages, keep, how);
                    assert_eq!(released, expected, "{grow:?} round {round}");
                    unbound += released.len();
                    free.extend(released);
                    // Tombstones too, so that both branches of a release are exercised.
                    if let Some(&v) = pages.iter().find(|&&v| v != 0 && batch.v2p[v as usize] > 0) {
                        batch.unbind(v, true);
                        single.unbind(v, true);
                    }
                }
                assert_eq!(state(&batch), state(&single), "{grow:?} round {round}");
                batch.verify("batch").unwrap();
                if round % 50 == 49 {
                    upload(&mut batch, &mut mirrors.0);
                    upload(&mut single, &mut mirrors.1);
                }
            }
            assert!(
                bound > 200 && unbound > 100,
                "{grow:?}: {bound} bound, {unbound} released"
            );
        }
    }

    /// The small pieces: an id space's size and free ids, a list with its room already
    /// mapped, and a cleared relay plan that has nothing to show or commit.
    #[test]
    fn ids_lists_and_a_cleared_plan_say_what_they_hold() {
        let mut ids = VirtualIds::new(5);
        assert_eq!((ids.count(), ids.available()), (5, 4));
        assert_eq!(ids.pop(), Some(1), "the lowest first");
        let mut free = ids.as_slice().to_vec();
        free.sort_unstable();
        assert_eq!(free, [2, 3, 4]);
        let list: Vec<u32> = resident_list(1000);
        assert!(list.is_empty() && list.capacity() >= 1000);
        let table: Vec<u32> = resident_table(3000);
        assert!(table.len() == 3000 && table.iter().all(|&x| x == 0));
        let (mut moves, mut plan) = (Vec::new(), RelayPlan::default());
        float_of_four().plan_relay((4, 16), 2, &mut moves, &mut plan);
        assert!(plan.view().is_some() && !plan.pairs.is_empty());
        plan.clear();
        assert!(plan.view().is_none() && plan.pairs.is_empty() && plan.holes.is_empty());
    }

    /// A float on [14, 18) with four live pages.
    fn float_of_four() -> SubAllocator {
        let mut f = SubAllocator::new(grid(), Grow::Float, 64);
        assert!(f.place(16));
        for (v, edge) in [Edge::High, Edge::Low, Edge::High, Edge::Low]
            .into_iter()
            .enumerate()
        {
            let p = f.take_at(edge);
            f.bind(v as u32 + 1, p);
        }
        assert_eq!((f.span(), f.live()), ((14, 18), 4));
        f
    }

    /// A relay target too short above the span grows downward by exactly the pages still
    /// missing, and never below the room's low end (then the target is what fits).
    #[test]
    fn a_relay_target_grows_down_by_the_missing_pages_and_stops_at_the_room() {
        let (mut moves, mut plan) = (Vec::new(), RelayPlan::default());
        // Room [4, 16), six pages needed: [14, 16) grows down by four, to [10, 16).
        float_of_four().plan_relay((4, 16), 2, &mut moves, &mut plan);
        assert_eq!(plan.span, Some((10, 16)));
        // Room [12, 16): only two pages below, so the target is all of the room.
        float_of_four().plan_relay((12, 16), 2, &mut moves, &mut plan);
        assert_eq!(plan.span, Some((12, 16)));
    }

    /// The span's accounting fails on each of its clauses alone: the pinned edge of each
    /// growth, the floor, the ends' order, the grid's top, and live + holes = span.
    #[test]
    fn accounting_fails_on_each_clause_alone() {
        let up = || {
            let mut s = SubAllocator::new(grid(), Grow::Up, 16);
            let p = s.take();
            s.bind(3, p);
            s
        };
        let down = || {
            let mut s = SubAllocator::new(grid(), Grow::Down, 16);
            let p = s.take();
            s.bind(3, p);
            s
        };
        type Corruption = (&'static str, fn() -> SubAllocator, fn(&mut SubAllocator));
        let g = grid();
        let cases: [Corruption; 6] = [
            ("up: low end off the floor", up, |s| s.lo += 1),
            ("down: high end off the top", down, |s| s.hi -= 1),
            (
                "float: nothing live but a span of holes",
                float_of_four,
                |s| {
                    s.live = 0;
                    s.holes = (14..18).collect();
                },
            ),
            ("below the floor", down, |s| s.lo = 0),
            ("ends crossed", down, |s| s.lo = s.hi + 1),
            ("live + holes != span", up, |s| s.live += 1),
        ];
        for (what, make, corrupt) in cases {
            let mut s = make();
            assert!(s.accounting_holds(), "{what}: clean");
            corrupt(&mut s);
            assert!(!s.accounting_holds(), "{what}: not caught");
        }
        // Above the grid's top, on a float (no pinned edge to trip first).
        let mut f = float_of_four();
        f.hi = g.pages + 1;
        f.lo = f.hi - 4;
        assert!(!f.accounting_holds(), "above the top");
    }

    /// Binding a batch over tombstoned entries revives them: the tombstone count drops
    /// by each, as page-by-page binds would.
    #[test]
    fn a_batch_bind_over_tombstones_clears_them() {
        let mut sub = SubAllocator::new(grid(), Grow::Down, 16);
        for v in [3, 4, 5] {
            let p = sub.take();
            sub.bind(v, p);
        }
        sub.unbind(3, true);
        sub.unbind(5, true);
        assert_eq!(sub.tombstones(), 2);
        sub.bind_popped(&[6, 5, 3]);
        assert_eq!((sub.tombstones(), sub.live()), (0, 4));
        sub.verify("down").unwrap();
    }

    #[test]
    fn a_float_is_placed_grows_both_ways_packs_relays_and_parks() {
        let mut f = SubAllocator::new(grid(), Grow::Float, 64);
        assert!(f.accounting_holds(), "parked at start");
        // An empty float may be placed anywhere on its grid above the floor, edges included.
        let g = grid();
        assert!(!f.place(g.min_page - 1) && !f.place(g.pages + 1));
        assert!(f.place(g.min_page) && f.place(g.pages));
        assert_eq!(f.span(), (g.pages, g.pages));
        assert!(f.place(16));
        let mut v = 0;
        let mut bind = |f: &mut SubAllocator, edge| {
            v += 1;
            let p = f.take_at(edge);
            f.bind(v, p);
            p
        };
        assert_eq!(bind(&mut f, Edge::High), 16);
        assert_eq!(bind(&mut f, Edge::Low), 15);
        assert_eq!(bind(&mut f, Edge::High), 17);
        assert_eq!(bind(&mut f, Edge::Low), 14);
        assert_eq!(f.span(), (14, 18));
        assert!(!f.place(3), "a float holding pages is not moved by place");
        f.unbind(2, false); // page 15
        f.verify("float").unwrap();
        let mut moves = Vec::new();
        assert_eq!(f.compact_toward(Edge::High, &mut moves), 1);
        assert_eq!(f.span(), (15, 18));
        f.verify("float").unwrap();
        // A relay into [4, 10) with room for two more: the span lies above it, so all
        // three pages move, into the low pages of T = [5, 10); the rest are its holes.
        let (mut moves, mut plan) = (Vec::new(), RelayPlan::default());
        let before = state(&f);
        f.plan_relay((4, 10), 2, &mut moves, &mut plan);
        assert_eq!(state(&f), before, "planning changed the tables");
        assert_eq!(plan.span, Some((5, 10)));
        assert_eq!(plan.pairs, vec![(15, 5), (16, 6), (17, 7)]);
        assert_eq!(plan.holes, vec![8, 9]);
        let mut predicted = Vec::new();
        f.handout_envelopes(2, plan.view().unwrap(), Edge::High, &mut predicted);
        f.commit_relay(&plan);
        f.verify("float").unwrap();
        assert_eq!((f.span(), f.live), ((5, 10), 3));
        let taken: Vec<ByteSpan> = (0..2)
            .map(|i| {
                let p = f.take();
                f.bind(40 + i, p);
                f.envelope(p)
            })
            .collect();
        assert_eq!(predicted, taken, "the holes the plan predicted are taken");
        for v in [40, 41] {
            f.unbind(v, false);
        }
        // Only the pages outside [a, b) move: here one, into the first free page.
        f.plan_relay((6, 20), 0, &mut moves, &mut plan);
        assert_eq!(plan.span, Some((6, 10)));
        assert_eq!(plan.pairs, vec![(5, 8)]);
        f.commit_relay(&plan);
        f.verify("float").unwrap();
        // Appended; the three consecutive pages relaid into consecutive pages are one copy.
        let at = |p: u64| p * 8;
        assert_eq!(
            moves,
            [(15, 5, 3), (5, 8, 1)].map(|(src, dst, pages)| SpanMove {
                src: at(src),
                dst: at(dst),
                len: pages * 8
            })
        );
        for v in [1, 3, 4] {
            f.unbind(v, false);
        }
        assert_eq!(f.span_pages(), 0, "parked: transparent");
        assert!(f.holes().is_empty());
        f.verify("float").unwrap();
        assert!(f.place(20));
    }
}

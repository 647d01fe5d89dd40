//! The multi-ended sub-allocator: one sub-pool's span at one end of the buffer (or a
//! float between the ends), its
//! `v2p`/`p2v` tables, live count, holes, tombstones and dirty mirror entries, and lazy
//! compaction (a free leaves a hole, an alloc drains holes first, a flush moves
//! survivors into holes and rewrites only the tables).
//!
//! A building block for composites: the composite owns the capacity arithmetic between
//! its members and the virtual ids ([`VirtualIds`](crate::VirtualIds)); a sub-allocator
//! only keeps one span's tables honest. Its read-only views are public; its mutators
//! (`take`, `bind`, `unbind`, `rebind`, compaction, ...) are crate-private, because their
//! preconditions are the composite's arithmetic and are not checked again (a composite
//! outside this crate, e.g. the tri-pool, is built here or gets checked entry points).
//!
//! This file holds the span, its tables and the page-by-page operations; the rest, one
//! concern a file: `plans` (compaction and a float's relay, planned apart from their
//! commit), `batch` (the batch bind and release passes, a run of pages at a time),
//! `dirty` (the mirror entries changed since the last upload, as spans) and `sort` (the
//! page sorts the plans use).

mod batch;
mod dirty;
mod plans;
mod sort;
#[cfg(test)]
mod tests;

pub(crate) use batch::{Keep, Release};
pub(crate) use plans::{CompactionPlan, RelayPlan};

use crate::resident::{resident_list, resident_table};
use crate::spec::{Grid, Grow};
use unikv_kernels::ByteSpan;

/// One edge of a span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    /// The low (first) page.
    Low,
    /// The high (one past the last) page.
    High,
}

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

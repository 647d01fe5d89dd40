//! The multi-ended sub-allocator: one sub-pool's span at one end of the buffer (or a
//! float between the ends), its
//! `v2p`/`p2v` tables, live count, holes, tombstones and dirty mirror entries, and lazy
//! compaction (a free leaves a hole, an alloc drains holes first, a flush moves
//! survivors into holes and rewrites only the tables).
//!
//! Public as a building block for other composites (FULL/Mamba in `unikv-mamba`): the
//! composite owns the capacity arithmetic between its members and the virtual ids
//! ([`VirtualIds`]); a sub-allocator only keeps one span's tables honest.

use crate::spec::{Grid, Grow};

/// One edge of a span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    /// The low (first) page.
    Low,
    /// The high (one past the last) page.
    High,
}
use unikv_kernels::{ByteSpan, SpanMove};

/// One sub-pool's host-authoritative bookkeeping: a span `[lo, hi)` of its grid, its
/// translation tables (`v2p`: > 0 bound, -1 tombstone, 0 unbound; `p2v`: 0 free), its
/// holes and its dirty mirror entries. An `Up` end keeps `lo` at the floor and grows at
/// `hi`; a `Down` end keeps `hi` at the top and grows at `lo`; a `Float` moves both and
/// parks (becomes empty and transparent) when its last page is freed. Methods that take
/// a page trust the composite's arithmetic (documented preconditions);
/// [`SubAllocator::verify`] checks everything.
#[derive(Debug, Clone)]
pub struct SubAllocator {
    /// The grid (envelope bytes, pages, first page above the floor, kernel stride).
    pub(crate) grid: Grid,
    /// Which end the span grows from.
    pub(crate) grow: Grow,
    /// Virtual page → physical page: > 0 bound, -1 tombstone, 0 unbound. Index 0 is the sink.
    pub(crate) v2p: Vec<i32>,
    /// Physical page → virtual page; 0 = free (page 0 is the sink).
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
    /// Virtual pages whose `v2p` entry changed since the last mirror upload.
    dirty: Vec<u32>,
    dirty_flag: Vec<bool>,
}

impl SubAllocator {
    /// An empty sub-allocator on `grid`, growing from `grow`'s end, with a `v2p` of
    /// `virtual_pages` entries (the id owner's count, sink included). A float starts
    /// parked at the floor; [`SubAllocator::place`] puts it where the composite wants.
    pub fn new(grid: Grid, grow: Grow, virtual_pages: u32) -> SubAllocator {
        let at = match grow {
            Grow::Up | Grow::Float => grid.min_page,
            Grow::Down => grid.pages,
        };
        SubAllocator {
            grid,
            grow,
            v2p: vec![0; virtual_pages as usize],
            p2v: vec![0; grid.pages as usize],
            lo: at,
            hi: at,
            holes: Vec::new(),
            live: 0,
            tombstones: 0,
            dirty: Vec::new(),
            dirty_flag: vec![false; virtual_pages as usize],
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
        self.p2v.get(p as usize).copied().unwrap_or(0)
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

    #[inline]
    fn mark(&mut self, v: u32) {
        let flag = &mut self.dirty_flag[v as usize];
        if !*flag {
            *flag = true;
            self.dirty.push(v);
        }
    }

    /// Takes a physical page at the growth edge (a hole first, else the frontier advances
    /// by one). The caller checked the room: the frontier must not cross its neighbour's.
    #[inline]
    pub fn take(&mut self) -> u32 {
        let edge = match self.grow {
            Grow::Down => Edge::Low,
            Grow::Up | Grow::Float => Edge::High,
        };
        self.take_at(edge)
    }

    /// Takes a physical page: a hole first, else the span extends by one page at `edge`
    /// (a float grows toward the roomier side; an end should use [`SubAllocator::take`]).
    #[inline]
    pub fn take_at(&mut self, edge: Edge) -> u32 {
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
    pub fn place(&mut self, at: u32) -> bool {
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
    #[inline]
    pub fn bind(&mut self, v: u32, p: u32) {
        debug_assert!(p != 0 && self.p2v[p as usize] == 0);
        if self.v2p[v as usize] == -1 {
            self.tombstones -= 1;
        }
        self.v2p[v as usize] = p as i32;
        self.p2v[p as usize] = v;
        self.live += 1;
        self.mark(v);
    }

    /// Unbinds live `v`, leaving a hole; `tombstone` writes -1 instead of 0. Returns the
    /// physical page. A float whose last page goes parks (empty, no holes).
    #[inline]
    pub fn unbind(&mut self, v: u32, tombstone: bool) -> u32 {
        let p = self.v2p[v as usize];
        debug_assert!(p > 0);
        let p = p as u32;
        self.v2p[v as usize] = if tombstone { -1 } else { 0 };
        self.p2v[p as usize] = 0;
        self.holes.push(p);
        self.live -= 1;
        self.tombstones += tombstone as u32;
        self.mark(v);
        if self.live == 0 && self.grow == Grow::Float {
            self.holes.clear();
            self.hi = self.lo;
        }
        p
    }

    /// Clears `v`'s tombstone (its FULL page is freed).
    #[inline]
    pub fn clear_tombstone(&mut self, v: u32) {
        if self.v2p[v as usize] == -1 {
            self.v2p[v as usize] = 0;
            self.tombstones -= 1;
            self.mark(v);
        }
    }

    /// Moves `from`'s binding to `to` (a tombstone); `from` becomes a tombstone.
    pub fn rebind(&mut self, from: u32, to: u32) {
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

    /// Moves the page bound at `src` to the free page `dst`, recording the envelope copy.
    fn move_page(&mut self, src: u32, dst: u32, moves: &mut Vec<SpanMove>) {
        let v = self.p2v[src as usize];
        moves.push(SpanMove {
            src: self.grid.offset(src),
            dst: self.grid.offset(dst),
            len: self.grid.envelope,
        });
        self.p2v[src as usize] = 0;
        self.p2v[dst as usize] = v;
        self.v2p[v as usize] = dst as i32;
        self.mark(v);
    }

    /// Compacts the span toward its fixed end (a float: toward its low edge): survivors
    /// beyond the packed span move into holes inside it, the frontier retreats past
    /// every hole, the hole list empties. Appends the envelope moves to `moves` (no
    /// destination is a source); returns how many pages moved. O(holes log holes).
    pub fn compact(&mut self, moves: &mut Vec<SpanMove>) -> usize {
        let edge = match self.grow {
            Grow::Down => Edge::High,
            Grow::Up | Grow::Float => Edge::Low,
        };
        self.compact_toward(edge, moves)
    }

    /// Compacts toward `edge`: packs live pages against it. Ends always pack against
    /// their fixed end (the argument only steers a float).
    pub fn compact_toward(&mut self, edge: Edge, moves: &mut Vec<SpanMove>) -> usize {
        if self.holes.is_empty() {
            return 0;
        }
        let edge = match self.grow {
            Grow::Up => Edge::Low,
            Grow::Down => Edge::High,
            Grow::Float => edge,
        };
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
        let mut inner: Vec<u32> = self
            .holes
            .iter()
            .copied()
            .filter(|&p| p >= packed_lo && p < packed_hi)
            .collect();
        inner.sort_unstable();
        let mut moved = 0;
        let mut dst_iter = inner.into_iter();
        for src in band {
            if self.p2v[src as usize] == 0 {
                continue;
            }
            let Some(dst) = dst_iter.next() else { break };
            self.move_page(src, dst, moves);
            moved += 1;
        }
        self.lo = packed_lo;
        self.hi = packed_hi;
        self.holes.clear();
        moved
    }

    /// A float's leapfrog step: moves the `count` live pages at edge `from` to fresh
    /// pages just beyond the opposite edge, so the span slides away from `from` by
    /// `count` pages. Requires no holes (compact first and issue those moves in their own
    /// `move_spans` call) and room beyond the opposite edge (the composite's arithmetic).
    /// Returns how many pages moved (0, changing nothing, when the preconditions fail).
    pub fn slide(&mut self, from: Edge, count: u32, moves: &mut Vec<SpanMove>) -> u32 {
        let room = match from {
            Edge::Low => self.grid.pages - self.hi,
            Edge::High => self.lo - self.grid.min_page,
        };
        if self.grow != Grow::Float || !self.holes.is_empty() || count > self.live || count > room {
            return 0;
        }
        for _ in 0..count {
            match from {
                Edge::Low => {
                    let (src, dst) = (self.lo, self.hi);
                    self.move_page(src, dst, moves);
                    self.lo += 1;
                    self.hi += 1;
                }
                Edge::High => {
                    let (src, dst) = (self.hi - 1, self.lo - 1);
                    self.move_page(src, dst, moves);
                    self.lo -= 1;
                    self.hi -= 1;
                }
            }
        }
        count
    }

    /// Takes the dirty `(virtual page, v2p)` entries for the mirror upload (into `out`,
    /// cleared first).
    pub fn take_dirty(&mut self, out: &mut Vec<(u32, i32)>) {
        out.clear();
        for &v in &self.dirty {
            self.dirty_flag[v as usize] = false;
            out.push((v, self.v2p[v as usize]));
        }
        self.dirty.clear();
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
        let bound_in_p2v = self.p2v.iter().filter(|&&v| v != 0).count() as u32;
        if bound_in_p2v != live {
            return Err(format!(
                "{name}: p2v binds {bound_in_p2v} pages, v2p {live}"
            ));
        }
        let mut holes = self.holes.clone();
        holes.sort_unstable();
        if holes.windows(2).any(|w| w[0] == w[1]) {
            return Err(format!("{name}: a hole is listed twice"));
        }
        for &h in &holes {
            if !self.in_span(h) || self.p2v[h as usize] != 0 {
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
    #[inline]
    pub fn pop(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Returns an id (the caller checked it was live).
    #[inline]
    pub fn push(&mut self, v: u32) {
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
        let mut sub = SubAllocator::new(grid(), grow, 64);
        for v in 1..=n {
            let p = sub.take();
            sub.bind(v, p);
        }
        for &v in freed {
            sub.unbind(v, false);
        }
        sub.verify("sub").unwrap();
        let mut moves = Vec::new();
        let moved = sub.compact(&mut moves);
        sub.verify("sub").unwrap();
        assert_eq!(moves.len(), moved);
        assert!(sub.holes.is_empty());
        assert_eq!(sub.span_pages(), n - freed.len() as u32);
        let srcs: Vec<u64> = moves.iter().map(|m| m.src).collect();
        for m in &moves {
            assert_eq!(m.len, 8);
            assert!(
                !srcs.contains(&m.dst),
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
            compact_case(grow, 1, &[]);
        }
        let mut sub = SubAllocator::new(grid(), Grow::Up, 64);
        let mut moves = Vec::new();
        assert_eq!(sub.compact(&mut moves), 0, "no holes, no moves");
    }

    #[test]
    fn tombstones_and_dirty_entries_are_tracked() {
        let mut sub = SubAllocator::new(grid(), Grow::Down, 16);
        let p = sub.take();
        assert_eq!(p, 31, "grows down from the top page");
        sub.bind(3, p);
        sub.unbind(3, true);
        assert_eq!((sub.v2p[3], sub.tombstones, sub.live), (-1, 1, 0));
        sub.clear_tombstone(3);
        assert_eq!((sub.v2p[3], sub.tombstones), (0, 0));
        let mut dirty = Vec::new();
        sub.take_dirty(&mut dirty);
        assert_eq!(
            dirty,
            vec![(3, 0)],
            "one entry per page however often it changed"
        );
        assert!(!sub.has_dirty());
    }

    #[test]
    fn a_float_is_placed_grows_both_ways_packs_slides_and_parks() {
        let mut f = SubAllocator::new(grid(), Grow::Float, 64);
        assert!(f.accounting_holds(), "parked at start");
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
        moves.clear();
        assert_eq!(f.slide(Edge::High, 2, &mut moves), 2, "slide down by two");
        assert_eq!(f.span(), (13, 16));
        assert_eq!(moves.len(), 2);
        f.verify("float").unwrap();
        assert_eq!(
            f.slide(Edge::Low, 9, &mut moves),
            0,
            "more than live: refused"
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

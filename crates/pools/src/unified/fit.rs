//! The unified pool's feasibility: whether a demand fits after a reclaim, priced at a
//! [`Placement`] (as things are, with both ends packed, or with the tri-pool's float
//! relaid), and where the float's new pages would go ([`FloatFit`]); and the counts built
//! on it (the joint pages and each side's capacity views, by bisection over the fit).

use super::UnifiedSwa;
use crate::api::{PageDemand, Reclaimable, SideCapacity};
use crate::spec::{Grow, Side};
use crate::sub::{Edge, SubAllocator};

/// How a fit is priced: with the pages where they are, or after moving some.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Placement {
    /// Holes first, then each frontier extends into the gap.
    Now,
    /// Both ends packed against their ends, no holes; a float stays where it is (its
    /// holes reused).
    Compacted,
    /// Both ends packed and a float relaid anywhere between them (the shortfall ladder's
    /// last rung). The same as `Compacted` without a float.
    Relaid,
}

/// Where a fitting demand's float pages go (the tri-pool's SWA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FloatFit {
    /// No float, or no float page wanted.
    Stay,
    /// Holes first, then fresh pages at this edge (the roomier side).
    Grow(Edge),
    /// The float is empty (parked): its span starts at this page, the midpoint of the
    /// room between the ends, and grows up.
    Place(u32),
    /// The float must move: it fits in the pages `[a, b)` of its grid between the packed
    /// ends ([`SubAllocator::plan_relay`]).
    Relay((u32, u32)),
}

impl UnifiedSwa {
    /// Whether `d` fits after reclaiming `r` live pages and slots, priced `at` a
    /// placement: [`UnifiedSwa::fit`] found a way.
    pub(super) fn fits(&self, d: PageDemand, r: Reclaimable, at: Placement) -> bool {
        self.fit(d, r, at).is_some()
    }

    /// The one feasibility predicate of the chain `[low end | float | FULL]`: whether `d`
    /// fits after reclaiming `r` live pages and slots, priced `at` a placement, and where
    /// the float's pages would go. FULL needs free virtual pages, Mamba free virtual
    /// slots; the low end's high frontier must stay at or below FULL's low frontier in
    /// bytes, and a float's span (with its new pages) between them
    /// ([`UnifiedSwa::float_fit`]). A demand for a side the layout does not have: SWA
    /// pages are vacuous without SWA (FULL pages carry the tokens), slots never fit
    /// without a slot pool. Overflow-safe for any demand and reclaim: counts are widened
    /// to u64 and saturate (a saturated demand never fits). Monotone: less demand or
    /// more reclaim never turns a fit into a misfit, and `Now` ⇒ `Compacted` ⇒ `Relaid`.
    pub(super) fn fit(&self, d: PageDemand, r: Reclaimable, at: Placement) -> Option<FloatFit> {
        let w = |n: usize| n as u64;
        if w(d.full_pages) > w(self.free_ids.available()).saturating_add(w(r.full_pages)) {
            return None;
        }
        if d.mamba_slots > 0 {
            self.mamba.as_ref()?;
            if w(d.mamba_slots) > w(self.slot_ids.available()).saturating_add(w(r.mamba_slots)) {
                return None;
            }
        }
        let ends = match at {
            Placement::Now => Placement::Now,
            Placement::Compacted | Placement::Relaid => Placement::Compacted,
        };
        let (low, d_low, r_low) = match &self.mamba {
            Some(mamba) => (mamba, d.mamba_slots, r.mamba_slots),
            None => (self.swa.as_ref()?, d.swa_pages, r.swa_pages),
        };
        let full_page = Self::frontier_after(&self.full, w(d.full_pages), w(r.full_pages), ends)?;
        let low_page = Self::frontier_after(low, w(d_low), w(r_low), ends)?;
        // Pages are below 2^31 (kernel ids fit in i32), so `full_page × envelope` fits a
        // u64 when the buffer does; the low end saturates for an absurd demand.
        let full_byte = full_page * self.full.grid.envelope;
        let low_byte = low_page.saturating_mul(low.grid.envelope);
        if low_byte > full_byte {
            return None;
        }
        match self.float() {
            None => Some(FloatFit::Stay),
            Some(swa) => Self::float_fit(
                swa,
                w(d.swa_pages),
                w(r.swa_pages),
                (low_byte, full_byte),
                at,
            ),
        }
    }

    /// Where a float's `d` more pages go, after reclaiming `r` of its live pages, when
    /// the ends' frontiers are at the bytes `[low, high)`: on its own grid, the pages
    /// `[a, b)` lie wholly between them. Empty (or emptied by the reclaim), the float is
    /// transparent and is placed at the midpoint of that room; `Relaid`, it may move
    /// anywhere in it; otherwise it must not be crossed by an end and grows at the edge
    /// with more room (its holes first).
    fn float_fit(
        swa: &SubAllocator,
        d: u64,
        r: u64,
        (low, high): (u64, u64),
        at: Placement,
    ) -> Option<FloatFit> {
        let env = swa.grid.envelope;
        // `high` is at most the buffer's size, so `b` is at most the float's grid pages.
        let (a, b) = (low.div_ceil(env), high / env);
        let room = b.saturating_sub(a);
        let live = (swa.live as u64).saturating_sub(r);
        let pages = |p: u64| p as u32;
        if at == Placement::Relaid {
            return (live.saturating_add(d) <= room)
                .then_some(FloatFit::Relay((pages(a), pages(b))));
        }
        if live == 0 {
            return match d {
                0 => Some(FloatFit::Stay),
                _ => (d <= room).then(|| FloatFit::Place(pages(a + (room - d) / 2))),
            };
        }
        let (lo, hi) = (swa.lo as u64, swa.hi as u64);
        if lo < a || hi > b {
            // An end would cross the float: only a relay makes room.
            return None;
        }
        let ext = d.saturating_sub((swa.holes.len() as u64).saturating_add(r));
        let (below, above) = (lo - a, b - hi);
        let edge = if above >= below {
            Edge::High
        } else {
            Edge::Low
        };
        (ext <= below.max(above)).then_some(FloatFit::Grow(edge))
    }

    /// Where `sub`'s growth frontier would be after `d` more and `r` fewer live pages:
    /// its low page for a `Down` end, its high page for an `Up` end (`None`: below 0).
    /// `Relaid` prices an end as `Compacted`.
    fn frontier_after(sub: &SubAllocator, d: u64, r: u64, at: Placement) -> Option<u64> {
        let live = (sub.live as u64).saturating_sub(r);
        let g = sub.grid;
        match (sub.grow, at) {
            (Grow::Down, Placement::Compacted | Placement::Relaid) => {
                (g.pages as u64).checked_sub(live.saturating_add(d))
            }
            (Grow::Down, Placement::Now) => {
                let ext = d.saturating_sub((sub.holes.len() as u64).saturating_add(r));
                (sub.frontier() as u64).checked_sub(ext)
            }
            (_, Placement::Compacted | Placement::Relaid) => {
                Some((g.min_page as u64).saturating_add(live.saturating_add(d)))
            }
            (_, Placement::Now) => {
                let ext = d.saturating_sub((sub.holes.len() as u64).saturating_add(r));
                Some((sub.frontier() as u64).saturating_add(ext))
            }
        }
    }

    /// Whether `d` fits after reclaiming `r`, now or (moves allowed) after compaction and
    /// any relay of the float.
    pub(super) fn fits_any(&self, d: PageDemand, r: Reclaimable) -> bool {
        self.fits(d, r, Placement::Now) || (!self.gated() && self.fits(d, r, Placement::Relaid))
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
    pub(super) fn min_fitting(hi: usize, ok: impl Fn(usize) -> bool) -> usize {
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

    /// The placement a scheduler may count on: compacted and relaid unless a gate holds
    /// the pages.
    pub(super) fn placement(&self) -> Placement {
        if self.gated() {
            Placement::Now
        } else {
            Placement::Relaid
        }
    }

    pub(super) fn joint_pages(&self, at: Placement) -> usize {
        Self::max_fitting(self.free_ids.available(), |k| {
            self.fits(PageDemand::joint(k), Reclaimable::default(), at)
        })
    }

    /// One side's capacity views (an absent side: all zero).
    pub(super) fn side_capacity(&self, side: Side) -> SideCapacity {
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
}

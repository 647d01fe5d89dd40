//! The tree's actions turned into frees (the one place), and eviction: `make_room`, the
//! loop every allocation short of memory runs, `evict_to_free` and `evict_all`.
//!
//! `apply` is the one place tree actions become frees: one `free_batch` per action list,
//! which cannot fail, so nothing can fail between a tree change and its frees (the
//! finishing methods' own row frees go the same way). Every action list is applied
//! whole, with no flush and no allocation between its actions, so no virtual id is
//! recycled while an action naming it is unapplied, though ids freed in a step are
//! recycled in that step after a flush
//! (`ids_freed_in_a_step_are_recycled_in_that_step_after_a_flush`,
//! `no_free_names_an_id_that_is_not_owned_any_more`).
//!
//! `make_room` is the one eviction loop: flush deferred frees, ask the allocator's
//! `reclaim_plan`, evict, check the fit again. A FULL pass evicts node by node until the
//! plan's `full_floor_pages` (at least one node) is released, since no fit needs less
//! FULL; an SWA pass evicts one node
//! (`s30_eviction_continues_until_the_joint_allocation_fits_and_no_further`,
//! `s31_reclaim_evicts_nothing_when_impossible_and_enough_when_possible`).

use super::{HybridCache, Layout};
use crate::error::Error;
use unikv_pools::{
    FreeOp, PageDemand, Reclaimable, Segment, VirtualSlot, VirtualToken as PoolToken,
};
use unikv_radix::{Action, Component, SwaSide, VirtualToken as TreeToken};

impl HybridCache {
    /// Applies the tree's actions to the allocator, in the tree's order. This is the one
    /// place actions turn into frees.
    ///
    /// Virtual-id recycling: the cache keeps a free group open for the whole step, so
    /// two-sided and FULL-only frees (the only ones that recycle virtual ids) are
    /// deferred until the next flush; SWA-only frees and transfers, which act at once,
    /// never recycle an id. Flushes do happen mid-step: the eviction loop
    /// (`evict_to_free`, and any allocation short of memory), `evict_all` and
    /// `can_admit` apply the deferred frees before pricing or after each eviction, and
    /// the next allocation may hand the freed ids to another request in the same step.
    /// What keeps that safe is narrower than "nothing recycles before the boundary":
    /// every action list the tree returns is applied whole, here, with no flush and no
    /// allocation between its actions, and the tree no longer names an id once the list
    /// that frees it is returned. So no id is recycled while an action naming it is
    /// unapplied.
    ///
    /// Applying cannot fail: the tree has already changed, so the frees go to the
    /// allocator as one [`KvAllocator::free_batch`], whose signature has no error (a free
    /// the allocator would refuse is an invariant breach, contained there). Nothing can
    /// leave the tree and the allocator disagreeing halfway through a list.
    pub(super) fn apply(&mut self, actions: &[Action]) {
        use std::ops::Range;
        /// One free, its tokens as a range of the flattened list.
        enum Planned {
            Both(Range<usize>),
            Full(Range<usize>),
            Swa(Range<usize>),
            Transfer(Range<usize>, Range<usize>),
        }
        let mut tokens = std::mem::take(&mut self.scratch);
        tokens.clear();
        let mut push = |t: &[TreeToken]| {
            let start = tokens.len();
            tokens.extend(t.iter().map(|t| PoolToken(t.0)));
            start..tokens.len()
        };
        let mut planned = Vec::with_capacity(actions.len() + 1);
        let mut slots: Vec<VirtualSlot> = Vec::new();
        for action in actions {
            match action {
                Action::FreeDeviceKv { tokens } => planned.push(Planned::Both(push(tokens))),
                Action::FreeDeviceKvFullOnly { tokens } => {
                    planned.push(Planned::Full(push(tokens)))
                }
                // The node's new value already has live SWA in both layouts.
                Action::SwaRebuild { .. } => {}
                Action::RecoverSwaWithLockedFull { kept, incoming, .. } => {
                    let (from, to) = (push(incoming), push(kept));
                    planned.push(Planned::Transfer(from.clone(), to));
                    planned.push(Planned::Full(from));
                }
                Action::EvictNode { tokens, swa, .. } => {
                    let range = push(tokens);
                    planned.push(match swa {
                        SwaSide::Live => Planned::Both(range),
                        SwaSide::Tombstone => Planned::Full(range),
                    });
                    self.evictions.full_nodes += 1;
                    self.evictions.full_tokens += tokens.len() as u64;
                }
                Action::TombstoneSwa { tokens, .. } => {
                    planned.push(Planned::Swa(push(tokens)));
                    self.evictions.swa_tombstones += 1;
                    self.evictions.swa_tokens += tokens.len() as u64;
                }
                Action::EvictMambaState { slot, .. } => {
                    slots.push(VirtualSlot(slot.0));
                    self.evictions.mamba_states += 1;
                }
                Action::FreeMambaSlot { slot } => slots.push(VirtualSlot(slot.0)),
            }
        }
        let seg = |r: &Range<usize>| Segment {
            tokens: &tokens[r.clone()],
            start: 0,
        };
        let mut frees: Vec<FreeOp<'_>> = planned
            .iter()
            .map(|p| match p {
                Planned::Both(r) => FreeOp::Segment(seg(r)),
                Planned::Full(r) => FreeOp::FullSegment(seg(r)),
                Planned::Swa(r) => FreeOp::SwaSegment(seg(r)),
                Planned::Transfer(from, to) => FreeOp::TransferSwa {
                    from: seg(from),
                    to: seg(to),
                },
            })
            .collect();
        // Slots have their own ids: their frees commute with the pages'.
        if !slots.is_empty() {
            frees.push(FreeOp::Slots(&slots));
        }
        if !frees.is_empty() {
            self.alloc.free_batch(&frees);
        }
        drop(frees);
        self.scratch = tokens;
    }

    /// Evicts unlocked prefixes until `full_pages` FULL and `swa_pages` SWA pages can be
    /// allocated together: deferred frees are flushed first (so freed memory is not
    /// evicted for again), then the allocator's minimum reclaim plan is evicted from the
    /// tree, FULL before SWA, and the fit is checked again. A demand beyond a side's total
    /// is [`Error::OutOfMemory`] at once, with nothing flushed or evicted.
    pub fn evict_to_free(&mut self, full_pages: usize, swa_pages: usize) -> Result<(), Error> {
        self.make_room(PageDemand::pages(full_pages, swa_pages))
    }

    pub(super) fn make_room(&mut self, demand: PageDemand) -> Result<(), Error> {
        if !self.could_ever_fit(demand) {
            return Err(self.oom(demand));
        }
        if self.alloc.allocation_fits(demand) {
            return Ok(());
        }
        let ps = self.ps;
        loop {
            let sizes = self.tree.sizes();
            let evictable = Reclaimable {
                full_pages: sizes.full_evictable.0 / ps,
                swa_pages: sizes.swa_evictable.0 / ps,
                mamba_slots: sizes.mamba_evictable.0,
            };
            // Flushes every deferred list first (so a recheck sees what the last pass
            // freed), then sizes the least eviction: SWA, then Mamba states, then FULL,
            // the byte donor of a slot demand.
            let Some(plan) = self.alloc.reclaim_plan(demand, evictable) else {
                return Err(self.oom(demand));
            };
            if plan.full_pages == 0 && plan.swa_pages == 0 && plan.mamba_slots == 0 {
                return self
                    .alloc
                    .ensure_capacity(demand)
                    .map_err(|e| self.out_of_memory(e));
            }
            // FULL before SWA, and the plan and the fit checked again after each pass: the
            // plan prices SWA and FULL reclaim separately, but evicting a FULL leaf frees
            // its SWA too, so evicting the plan's counts whole over-evicts. A FULL pass
            // evicts node by node up to the plan's floor (at least one node): no fit needs
            // less FULL, so a recheck before it would evict the same nodes again.
            let actions = if plan.full_pages > 0 {
                let floor = plan.full_floor_pages.max(1);
                let before = self.tree.sizes();
                let actions = if self.host.is_some() {
                    self.evict_writing_back(Component::Full, floor)?
                } else {
                    self.tree
                        .evict_until(Component::Full, |r| r.full.0 / ps >= floor)
                        .0
                };
                // Frees parked behind a write-back in flight still evicted something:
                // the next pass tries the next victim.
                let progressed = self.tree.sizes() != before;
                // Only a shared buffer gives FULL bytes to slots.
                if demand.mamba_slots > 0 && self.layout == Layout::Unified {
                    self.evictions.donor_nodes += actions
                        .iter()
                        .filter(|a| matches!(a, Action::EvictNode { .. }))
                        .count() as u64;
                }
                Some(actions).filter(|a| !a.is_empty() || progressed)
            } else {
                let component = if plan.swa_pages > 0 {
                    Component::Swa
                } else {
                    Component::Mamba
                };
                if self.host.is_some() {
                    // One node; its frees may be parked behind its write-back.
                    let before = self.tree.sizes();
                    let now = self.evict_writing_back(component, 1)?;
                    let progressed = self.tree.sizes() != before;
                    Some(now).filter(|a| !a.is_empty() || progressed)
                } else {
                    self.tree.evict_one(component)
                }
            };
            let Some(actions) = actions else {
                return Err(self.oom(demand));
            };
            self.epoch += 1;
            self.apply(&actions);
            self.alloc.flush_deferred();
        }
    }

    /// An eviction pass with a host tier: node by node until `floor` pages (FULL) or
    /// nodes (SWA, Mamba) are released, each victim written back first (an SWA
    /// tombstone or a state eviction would otherwise leave the host a prefix it cannot
    /// end a match at); the frees of pages or a slot a write-back still running reads
    /// (this victim's, or an earlier one's that copied its ancestors' pages) are parked
    /// until it is done, the others returned to apply now.
    fn evict_writing_back(
        &mut self,
        component: Component,
        floor: usize,
    ) -> Result<Vec<Action>, Error> {
        let mut now = Vec::new();
        let mut released = 0;
        while released < floor {
            let Some(victim) = self.tree.next_victim(component) else {
                break;
            };
            if let Err(e) = self.write_back(victim) {
                // What this pass evicted is out of the tree: its frees go now.
                self.apply(&now);
                return Err(e);
            }
            let Some(step) = self.tree.evict_one(component) else {
                break;
            };
            released += match component {
                Component::Full => unikv_radix::Released::of(&step).full.0 / self.ps,
                Component::Swa | Component::Mamba => 1,
            };
            now.extend(self.park_behind_readers(step));
        }
        Ok(now)
    }

    /// Evicts every unlocked prefix from the cache (an engine's "flush cache"), applying
    /// the frees at once (all of them once it is done when a write-back still running
    /// reads one of their pages), and frees the idle verify scratch groups. Returns the
    /// tokens evicted.
    pub fn evict_all(&mut self) -> Result<usize, Error> {
        let (actions, released) = self.tree.evict_until(Component::Full, |_| false);
        self.epoch += 1;
        let now = self.park_behind_readers(actions);
        self.apply(&now);
        // The verify scratch kept for the next verifies goes too (made again when needed).
        self.verify_scratch.free_idle(self.alloc.as_mut());
        self.alloc.flush_deferred();
        Ok(released.full.0)
    }

    /// Whether `demand` is within each side's total: a larger one cannot fit whatever is
    /// evicted, and is refused before any allocator arithmetic sees it (so no size a
    /// caller passes can overflow there).
    pub(super) fn could_ever_fit(&self, demand: PageDemand) -> bool {
        let cap = self.alloc.capacity();
        demand.full_pages <= cap.full.total_pages
            && demand.swa_pages <= cap.swa.total_pages
            && demand.mamba_slots <= cap.mamba.total_pages
    }

    fn oom(&self, demand: PageDemand) -> Error {
        let cap = self.alloc.capacity();
        Error::OutOfMemory {
            full_pages: demand.full_pages,
            swa_pages: demand.swa_pages,
            mamba_slots: demand.mamba_slots,
            full_available: cap.full.schedulable_pages,
            swa_available: cap.swa.schedulable_pages,
            mamba_available: cap.mamba.schedulable_pages,
        }
    }

    pub(super) fn out_of_memory(&self, e: unikv_pools::Error) -> Error {
        match e {
            unikv_pools::Error::OutOfCapacity {
                full_pages,
                swa_pages,
                ..
            } => self.oom(PageDemand::pages(full_pages, swa_pages)),
            unikv_pools::Error::OutOfSlots { requested, .. } => {
                self.oom(PageDemand::slots(requested))
            }
            other => Error::Pool(other),
        }
    }
}

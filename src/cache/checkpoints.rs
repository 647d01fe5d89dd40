//! Checkpoint plans: which states each request of an allocation saves this step, the
//! slots they take (reused held ones first, then fresh ones priced with the KV), and what
//! a request holds once the allocation succeeds.
//!
//! The plan reuses the slots of checkpoints the request holds from earlier steps first,
//! never one the step's forward already writes
//! (`a_second_chunk_in_one_step_never_rewrites_a_slot_the_step_writes`,
//! `a_decoding_request_rewrites_one_checkpoint_slot`). A prefill chunk's checkpoints are
//! priced like its KV; a decode's are best effort, saved only when their fresh slots fit
//! beside the KV, never at the price of a failed decode, while the writes into held slots
//! stay (`a_decode_checkpoint_never_costs_the_decode_its_memory`,
//! `a_decode_short_of_fresh_slots_keeps_the_writes_into_held_ones`). When the KV
//! allocation (or a settlement's copy) fails, the fresh slots go back
//! (`a_failed_settlement_copy_gives_back_its_fresh_checkpoint_slots`); the simulator's
//! allocator faults catch a leaked slot as broken conservation.
//! [`Request::checkpoint_writes`](crate::Request::checkpoint_writes) tells the engine where
//! to save, and the step metadata carries the writes as a prefix-summed section
//! (`checkpoint_writes_are_a_prefix_summed_section_of_the_step_table`).

use super::HybridCache;
use crate::error::Error;
use crate::request::Request;
use unikv_mamba::CheckpointWrite;
use unikv_pools::{FreeOp, PageDemand, VirtualSlot};

impl HybridCache {
    /// Plans the checkpoints of `req` growing over `rows` (from its settled rows) in this
    /// step into `plan`.
    /// The new writes go first into the slots of checkpoints it holds from earlier steps,
    /// oldest first (the tree never saw them, and a deeper state supersedes them), then
    /// into fresh slots; a request holds at most [`StatePolicy::checkpoints_per_step`]
    /// checkpoints, so when the bound is reached the plan keeps its deepest positions.
    /// So a decoding request rewrites one checkpoint slot; an engine keeps each prefill
    /// chunk's states by caching the request after the chunk.
    pub(super) fn plan_checkpoints(
        &self,
        req: &Request,
        rows: std::ops::Range<usize>,
        plan: &mut CheckpointPlan,
    ) {
        let (Some(policy), Some(state)) = (self.states, &req.state) else {
            plan.skip();
            return;
        };
        let first = plan.at.len();
        policy.plan(rows, state.marks, &mut plan.at);
        let cap = policy.checkpoints_per_step() as usize;
        let planned = plan.at.len() - first;
        let older = state
            .held
            .iter()
            .take_while(|(_, step)| *step < self.step)
            .count();
        let keep = planned.min(cap.saturating_sub(state.held.len() - older));
        let reuse = keep.min(older);
        plan.at.drain(first..first + planned - keep);
        plan.requests.push(Planned {
            start: first,
            new: keep,
            reuse,
            fresh_start: plan.fresh,
        });
        plan.fresh += keep - reuse;
    }

    /// Allocates the fresh slots `plan` writes into (the caller made room for them).
    fn alloc_checkpoint_slots(&mut self, plan: &mut CheckpointPlan) -> Result<(), Error> {
        plan.slots.clear();
        if plan.fresh == 0 {
            return Ok(());
        }
        self.alloc
            .alloc_slots(plan.fresh, &mut plan.slots)
            .map_err(|e| self.out_of_memory(e))
    }

    /// Makes room for `pages` new KV pages and `plan`'s checkpoint slots together, takes
    /// the slots, then runs `alloc_kv`; when that fails the slots go back, so the
    /// allocation changes nothing. With [`Checkpoints::BestEffort`], when memory cannot
    /// hold the KV and the fresh slots together (after evicting what the tree can give),
    /// the step saves only into the slots the requests already hold, priced on the KV
    /// alone.
    pub(super) fn alloc_with_checkpoints(
        &mut self,
        pages: usize,
        plan: &mut CheckpointPlan,
        checkpoints: Checkpoints,
        alloc_kv: impl FnOnce(&mut Self) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let kv = self.kv_demand(pages);
        match self.make_room(PageDemand {
            mamba_slots: plan.fresh,
            ..kv
        }) {
            // Without fresh slots the demand is the KV's alone: retrying it could only
            // fail the same way.
            Err(Error::OutOfMemory { .. })
                if plan.fresh != 0 && checkpoints == Checkpoints::BestEffort =>
            {
                plan.drop_fresh();
                self.make_room(kv)?;
            }
            other => other?,
        }
        self.alloc_checkpoint_slots(plan)?;
        let result = alloc_kv(self);
        if result.is_err() && !plan.slots.is_empty() {
            self.alloc.free_batch(&[FreeOp::Slots(&plan.slots)]);
        }
        result
    }

    /// Records the checkpoints `plan` gave `req` (its `i`-th request), which the engine
    /// writes in this step's forward: into the slots of the held checkpoints they
    /// replace, then into fresh ones.
    pub(super) fn commit_checkpoints(
        &mut self,
        req: &mut Request,
        plan: &CheckpointPlan,
        i: usize,
    ) {
        let Some(state) = &mut req.state else {
            return;
        };
        state.pending.clear();
        let writes: Vec<CheckpointWrite> = plan
            .writes(i, &state.held)
            .map(|(at_len, slot)| CheckpointWrite { slot, at_len })
            .collect();
        let p = plan.requests[i];
        state.held.drain(..p.reuse);
        for write in writes {
            state.held.push((write, self.step));
            state.pending.push(write);
        }
        self.held_slots += p.new - p.reuse;
    }
}

/// The checkpoints one allocation plans, request by request (reused across calls).
#[derive(Debug, Default)]
pub(super) struct CheckpointPlan {
    /// Positions to save, request after request, ascending within a request.
    at: Vec<usize>,
    /// Per request of the allocation, in order.
    requests: Vec<Planned>,
    /// Fresh slots the plan needs (positions not written into a reused slot).
    fresh: usize,
    /// The fresh slots, request after request.
    slots: Vec<VirtualSlot>,
}

impl CheckpointPlan {
    pub(super) fn clear(&mut self) {
        self.at.clear();
        self.requests.clear();
        self.fresh = 0;
        self.slots.clear();
    }

    /// The fresh slots the plan took.
    pub(super) fn fresh_slots(&self) -> &[VirtualSlot] {
        &self.slots
    }

    /// Plans nothing for the next request of the allocation (it takes no slot, so its
    /// `fresh_start` is never read).
    pub(super) fn skip(&mut self) {
        self.requests.push(Planned::default());
    }

    /// The `i`-th request's writes as (position, slot): into the slots of the oldest
    /// checkpoints it holds (`held`, before the commit), then into its fresh slots.
    pub(super) fn writes<'a>(
        &'a self,
        i: usize,
        held: &'a [(CheckpointWrite, u64)],
    ) -> impl Iterator<Item = (usize, VirtualSlot)> + 'a {
        let p = self.requests[i];
        let reused = held[..p.reuse].iter().map(|(w, _)| w.slot);
        let fresh = self.slots[p.fresh_start..p.fresh_start + p.new - p.reuse]
            .iter()
            .copied();
        self.at[p.start..p.start + p.new]
            .iter()
            .copied()
            .zip(reused.chain(fresh))
    }

    /// Drops every position that needs a fresh slot: each request keeps its deepest
    /// positions, as many as it reuses held slots for.
    fn drop_fresh(&mut self) {
        let all = std::mem::take(&mut self.at);
        for p in &mut self.requests {
            let kept = &all[p.start + p.new - p.reuse..p.start + p.new];
            p.start = self.at.len();
            self.at.extend_from_slice(kept);
            p.new = p.reuse;
            p.fresh_start = 0;
        }
        self.fresh = 0;
    }
}

/// Whether an allocation may go without the fresh slots its checkpoints need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Checkpoints {
    /// A prefill chunk's states (the branching point, the prompt's end, grid points)
    /// are what later requests resume from, and `can_admit` priced them: without room
    /// for them the allocation fails like one short of KV.
    Required,
    /// A decoding request's states serve only its own follow-up turn: they are worth
    /// future hits, never a retraction now, so without room they are not saved.
    BestEffort,
}

/// One request's part of a [`CheckpointPlan`].
#[derive(Clone, Copy, Debug, Default)]
struct Planned {
    /// Its first position in `at`.
    start: usize,
    /// Positions planned.
    new: usize,
    /// Held checkpoints (its oldest) whose slots the first positions are written into.
    reuse: usize,
    /// Its first fresh slot in `slots`; read only when it takes fresh slots
    /// (`new > reuse`), so a request that takes none leaves it 0.
    fresh_start: usize,
}

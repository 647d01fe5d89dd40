//! Verify scratch: the **lanes** a verify step writes, one entry per position, owned by
//! the cache rather than by a request, never in the prefix tree, and reused across
//! requests. Under the copy rollback (the default) an entry is the state after the
//! position, a whole state slot; under the replay rollback
//! ([`StateReplay`](crate::StateReplay)) it is the position's log entry, and a slot holds
//! [`ScratchShape::entries_per_slot`] of them, so one slot holds the lanes of many verifies.
//! One mechanism for both: a lane is `width` consecutive entries of a **block** of slots.
//!
//! A verify takes a lane when it is allocated and gives it back when it settles (or its
//! request ends); a lane given back is handed out again only from the next step, since
//! this step's forward may still read it (a later verify of the same request reads the
//! earlier one's entries). At the step boundary the cache keeps blocks for up to
//! [`Speculation::scratch_groups`] lanes and frees idle blocks beyond, so in the steady
//! state the scratch is made once and priced once, and draft positions never take the
//! room of cached states
//! (`a_verify_writes_a_scratch_group_and_settling_copies_the_accepted_state_into_the_running_slot`,
//! `the_step_boundary_keeps_the_declared_scratch_groups_and_frees_the_rest`,
//! `replay_rollback_packs_many_verifies_into_one_slot_and_commits_the_accepted_entries`).
//! A verify takes an idle lane or makes a block from fresh slots priced in the same
//! eviction loop as its KV, evicting cached states if it must, and a verify refused at
//! any allocator call gives its fresh scratch back
//! (`a_verify_evicts_cached_states_to_make_its_scratch`,
//! `a_verify_refused_at_any_allocator_call_gives_its_fresh_scratch_back`).
//!
//! With counts a step late a request holds two lanes, so a verify never reads an entry
//! it writes: the verify metadata's slots are `[running, earlier verify's lane, newest
//! lane]` (`a_verify_never_reads_a_state_slot_it_writes` checks every late
//! configuration).
//!
//! The copy rollback follows SGLang's `intermediate_ssm_state_cache` — per-draft states
//! in a buffer apart from the prefix cache's states, sized by the running batch × draft
//! tokens — with two differences: the lanes live in the same slot machinery (the unified
//! layout lends the buffer's bytes to them only while they are made; the static layout
//! sizes its slot pool [`verify_scratch_slots`](crate::verify_scratch_slots) beyond the
//! reference pool, the KV pools getting the rest), and two lanes per request with counts
//! a step late. The replay rollback follows TensorRT-LLM's (#13453): the logs cost about
//! 1/130 of the states they replace.

use crate::Speculation;
use crate::request::Request;
use crate::speculative::{ScratchLane, ScratchShape};
use unikv_pools::{FreeOp, KvAllocator, VirtualSlot};

/// One block of slots and how many of its lanes are out (held, or given back in this step).
#[derive(Debug)]
struct Block {
    slots: Box<[VirtualSlot]>,
    out: u32,
}

/// The cache's verify scratch.
#[derive(Debug)]
pub(crate) struct VerifyScratch {
    pub(crate) shape: ScratchShape,
    /// Blocks made (`None`: freed, its index free for the next one).
    blocks: Vec<Option<Block>>,
    /// Lanes free to hand out in this step.
    idle: Vec<ScratchLane>,
    /// Lanes given back in this step: handed out again from the next one.
    returned: Vec<ScratchLane>,
    /// Slots of every block made and not freed.
    slots: usize,
}

impl VerifyScratch {
    /// No scratch yet, lanes of `shape`.
    pub(crate) fn new(shape: ScratchShape) -> VerifyScratch {
        VerifyScratch {
            shape,
            blocks: Vec::new(),
            idle: Vec::new(),
            returned: Vec::new(),
            slots: 0,
        }
    }

    /// Slots of every block it has made and not freed (held, in the cache's accounting).
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// Fresh slots that `lanes` more lanes than the idle ones need.
    pub(crate) fn fresh_slots(&self, lanes: usize) -> usize {
        let short = lanes.saturating_sub(self.idle.len());
        self.shape.slots_for(short as u32) as usize
    }

    /// State slots that `requests` requests verifying with as many verifies in flight as
    /// `spec` allows (at most its `max_batch` of them) need beyond the blocks made
    /// already (what admission prices).
    pub(crate) fn shortfall(&self, spec: Option<Speculation>, requests: usize) -> usize {
        let Some(spec) = spec else { return 0 };
        // Lanes past the declared batch are transient (made and freed within steps), so
        // admission prices no more than the batch's.
        let lanes = requests
            .min(spec.max_batch as usize)
            .saturating_mul(spec.max_in_flight as usize);
        (self.shape.slots_for(lanes as u32) as usize).saturating_sub(self.slots)
    }

    /// Takes an idle lane (the caller counted that one is there).
    pub(crate) fn take(&mut self) -> ScratchLane {
        let lane = self
            .idle
            .pop()
            .expect("an idle scratch lane, counted by the caller");
        self.block_mut(lane.block).out += 1;
        lane
    }

    /// Makes blocks of `slots` (just allocated, [`VerifyScratch::fresh_slots`] of them):
    /// their lanes become idle, to be taken in this step.
    pub(crate) fn made(&mut self, slots: &[VirtualSlot]) {
        let per = self.shape.slots_per_block() as usize;
        for chunk in slots.chunks_exact(per) {
            let block = Block {
                slots: chunk.into(),
                out: 0,
            };
            let at = match self.blocks.iter().position(Option::is_none) {
                Some(at) => {
                    self.blocks[at] = Some(block);
                    at
                }
                None => {
                    self.blocks.push(Some(block));
                    self.blocks.len() - 1
                }
            };
            for l in 0..self.shape.lanes_per_block() {
                self.idle.push(ScratchLane {
                    slots: chunk.into(),
                    first: l * self.shape.width,
                    block: at,
                });
            }
            self.slots += chunk.len();
        }
    }

    /// A settled verify's lane comes back (handed out again from the next step).
    pub(crate) fn give_back(&mut self, lane: ScratchLane) {
        if !lane.is_empty() {
            self.returned.push(lane);
        }
    }

    /// Every lane of `req`'s unsettled verifies comes back (it finished or was released).
    pub(crate) fn give_back_all(&mut self, req: &Request) {
        for v in &req.verifies {
            self.give_back(v.lane.clone());
        }
    }

    /// The step ends: the lanes given back in it become idle, and while more than
    /// `spec`'s [`Speculation::scratch_groups`] lanes are idle, blocks whose every lane is
    /// idle are freed (deferred, with the step's other frees).
    pub(crate) fn end_step(&mut self, alloc: &mut dyn KvAllocator, spec: Option<Speculation>) {
        for lane in self.returned.drain(..) {
            if let Some(b) = self.blocks[lane.block].as_mut() {
                b.out -= 1;
            }
            self.idle.push(lane);
        }
        let keep = spec.map_or(0, |s| s.scratch_groups());
        let per = self.shape.lanes_per_block() as usize;
        let mut kept = self.idle.len();
        let mut free = Vec::new();
        // Newest blocks first: the oldest ones stay, so lanes keep their slots.
        for at in (0..self.blocks.len()).rev() {
            if kept <= keep {
                break;
            }
            if self.blocks[at].as_ref().is_some_and(|b| b.out == 0) {
                free.push(at);
                kept -= per;
            }
        }
        self.free(alloc, &free);
    }

    /// Frees every idle block (the cache is cleared: [`crate::HybridCache::evict_all`]).
    pub(crate) fn free_idle(&mut self, alloc: &mut dyn KvAllocator) {
        let idle: Vec<usize> = (0..self.blocks.len())
            .filter(|&at| self.blocks[at].as_ref().is_some_and(|b| b.out == 0))
            .collect();
        self.free(alloc, &idle);
    }

    /// Frees the blocks at `ats` (none of their lanes out) and drops their idle lanes.
    fn free(&mut self, alloc: &mut dyn KvAllocator, ats: &[usize]) {
        if ats.is_empty() {
            return;
        }
        let mut slots: Vec<VirtualSlot> = Vec::new();
        for &at in ats {
            let block = self.blocks[at].take().expect("a block made and not freed");
            slots.extend_from_slice(&block.slots);
        }
        self.idle.retain(|l| !ats.contains(&l.block));
        alloc.free_batch(&[FreeOp::Slots(&slots)]);
        self.slots -= slots.len();
    }

    fn block_mut(&mut self, at: usize) -> &mut Block {
        self.blocks[at].as_mut().expect("a lane's block is made")
    }
}

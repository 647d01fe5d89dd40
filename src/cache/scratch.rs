//! Verify scratch: the groups of state slots a verify step writes (the state after each
//! of its positions), owned by the cache rather than by a request, never in the prefix
//! tree, and reused across requests.
//!
//! A verify takes a group when it is allocated and gives it back when it settles (or
//! its request ends); a group given back is handed out again only from the next step,
//! since this step's forward may still read it (a later verify of the same request reads
//! its accepted state there). At the step boundary the cache keeps up to
//! [`Speculation::scratch_groups`] groups for the next verifies and frees the rest, so
//! in the steady state the scratch is made once and priced once, and draft states never
//! take the room of cached ones
//! (`a_verify_writes_a_scratch_group_and_settling_copies_the_accepted_state_into_the_running_slot`,
//! `the_step_boundary_keeps_the_declared_scratch_groups_and_frees_the_rest`). A verify
//! takes an idle group or makes one from fresh slots priced in the same eviction loop as
//! its KV, evicting cached states if it must, and a verify refused at any allocator call
//! gives its fresh scratch back (`a_verify_evicts_cached_states_to_make_its_scratch`,
//! `a_verify_refused_at_any_allocator_call_gives_its_fresh_scratch_back`).
//!
//! With counts a step late a request holds two groups, so a verify never reads a state
//! slot it writes: the verify metadata's slots are `[running, earlier verify's group,
//! newest group]`, the input the running slot or the earlier group's slot at its last
//! accepted node (a device offset), the outputs the newest group
//! (`a_verify_never_reads_a_state_slot_it_writes` checks every late configuration).
//!
//! The design follows SGLang's `intermediate_ssm_state_cache` — per-draft states in a
//! buffer apart from the prefix cache's states, sized by the running batch × draft
//! tokens — with two differences: the groups live in the same slot machinery (the
//! unified layout lends the buffer's bytes to them only while they are made; the static
//! layout sizes its slot pool
//! [`verify_scratch_slots`](crate::verify_scratch_slots) beyond the reference pool, the
//! KV pools getting the rest), and two groups per request with counts a step late.

use crate::Speculation;
use crate::request::Request;
use unikv_pools::{FreeOp, KvAllocator, VirtualSlot};

/// The cache's verify scratch groups.
#[derive(Debug, Default)]
pub(crate) struct VerifyScratch {
    /// Groups free to hand out in this step.
    idle: Vec<Box<[VirtualSlot]>>,
    /// Groups given back in this step: handed out again from the next one.
    returned: Vec<Box<[VirtualSlot]>>,
    /// Slots of every group: idle, given back, and held by unsettled verifies.
    slots: usize,
}

impl VerifyScratch {
    /// Slots of every group it has made and not freed (held, in the cache's accounting).
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// Groups free to hand out in this step.
    pub(crate) fn idle(&self) -> usize {
        self.idle.len()
    }

    /// State slots that `requests` requests verifying with as many verifies in flight as
    /// `spec` allows (at most its `max_batch` of them) need beyond the groups made
    /// already (what admission prices).
    pub(crate) fn shortfall(&self, spec: Option<Speculation>, requests: usize) -> usize {
        let Some(spec) = spec else { return 0 };
        let width = spec.max_width as usize;
        let made = self.slots / width;
        // Groups past the declared batch are transient (made and freed within steps), so
        // admission prices no more than the batch's.
        requests
            .min(spec.max_batch as usize)
            .saturating_mul(spec.max_in_flight as usize)
            .saturating_sub(made)
            .saturating_mul(width)
    }

    /// Takes an idle group (the caller counted that one is there).
    pub(crate) fn take(&mut self) -> Box<[VirtualSlot]> {
        self.idle
            .pop()
            .expect("an idle scratch group, counted by the caller")
    }

    /// Makes a new group of `slots` (just allocated), held by the verify that takes it.
    pub(crate) fn made(&mut self, slots: &[VirtualSlot]) -> Box<[VirtualSlot]> {
        self.slots += slots.len();
        slots.into()
    }

    /// A settled verify's group comes back (handed out again from the next step).
    pub(crate) fn give_back(&mut self, group: Box<[VirtualSlot]>) {
        if !group.is_empty() {
            self.returned.push(group);
        }
    }

    /// Every group of `req`'s unsettled verifies comes back (it finished or was
    /// released).
    pub(crate) fn give_back_all(&mut self, req: &Request) {
        for v in &req.verifies {
            self.give_back(v.group.clone());
        }
    }

    /// The step ends: the groups given back in it become idle, and what is kept beyond
    /// `spec`'s [`Speculation::scratch_groups`] is freed (deferred, with the step's other
    /// frees).
    pub(crate) fn end_step(&mut self, alloc: &mut dyn KvAllocator, spec: Option<Speculation>) {
        self.idle.append(&mut self.returned);
        let keep = spec.map_or(0, |s| s.scratch_groups());
        if self.idle.len() > keep {
            let extra = self.idle.split_off(keep);
            self.free(alloc, extra);
        }
    }

    /// Frees every idle group (the cache is cleared: [`crate::HybridCache::evict_all`]).
    pub(crate) fn free_idle(&mut self, alloc: &mut dyn KvAllocator) {
        let idle = std::mem::take(&mut self.idle);
        self.free(alloc, idle);
    }

    fn free(&mut self, alloc: &mut dyn KvAllocator, groups: Vec<Box<[VirtualSlot]>>) {
        let slots: Vec<VirtualSlot> = groups.iter().flat_map(|g| g.iter().copied()).collect();
        if slots.is_empty() {
            return;
        }
        alloc.free_batch(&[FreeOp::Slots(&slots)]);
        self.slots -= slots.len();
    }
}

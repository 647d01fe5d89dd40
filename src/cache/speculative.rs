//! Verify steps ([`HybridCache::alloc_verify`]) and their settlement
//! ([`HybridCache::settle`]): the host reserves every position a verify may keep, and
//! gives back what was rejected when the accepted counts arrive, whenever that is.
//!
//! `alloc_verify` reserves, per request, the rows of every position its draft verifies
//! for the worst case — every earlier unsettled verify accepted whole — after releasing
//! the SWA that left the window of the *settled* rows, so every position a verify reads
//! keeps its window, `W + k`
//! (`swa_keeps_the_window_behind_every_verify_position_across_a_release`). `settle`
//! applies accepted counts oldest first (at most `max_in_flight` verifies of a request
//! unsettled): the accepted tokens join the request, and the rows past what a later
//! unsettled verify may still read are freed as whole pages in one `free_batch`, a partly
//! used page staying (`late_counts_settle_in_order_and_free_only_what_no_verify_may_read`,
//! `a_partial_tail_frees_whole_pages_only_inside_one_page_and_across_a_boundary`).
//!
//! On a recurrent model a request runs on **one** running slot, as without speculation;
//! each unsettled verify writes one entry per position into a scratch lane
//! (`cache/scratch.rs`). Under the copy rollback, settling *copies* the last accepted
//! position's state into the running slot, and the states of the checkpoints the accepted
//! positions cross into their slots, in one `copy_slots`; under a
//! [`StateReplay`](crate::StateReplay) it hands the engine one commit per request to
//! replay (`replay_rollback_packs_many_verifies_into_one_slot_and_commits_the_accepted_entries`).
//! Either is issued before anything changes on the host — settled in the step or a step
//! late alike, since a later verify writes a lane of its own
//! (`a_settled_verify_crossing_a_grid_point_saves_its_state_there_on_time_and_late`). So
//! the running slot always holds the state at the settled length, and a request that
//! finishes with a verify in flight caches it
//! (`a_finish_with_a_verify_in_flight_caches_the_running_state`,
//! `a_follow_up_turn_after_a_speculative_turn_resumes_from_the_end_of_its_output`).

use super::{CheckpointPlan, Checkpoints, HybridCache};
use crate::error::Error;
use crate::request::Request;
use crate::speculative::{Accepted, Draft, LogEntry, PendingVerify, ScratchLane, StateCommit};
use unikv_pools::{ExtendRequest, FreeOp, PageDemand, VirtualSlot};

impl HybridCache {
    /// Allocates one verify step for each request of the batch: the rows of every
    /// position its draft verifies (`1 + k` for a chain, the tree's nodes for a tree), on
    /// FULL and SWA, for the target's verify forward and the draft model's own KV rows
    /// (which share the FULL envelope: [`crate::ModelSpec::draft_layers`]). One
    /// allocator call for the batch; SWA that left the window of the *settled* rows is
    /// released first, so every position a verify reads keeps its window (`W + k` rows).
    ///
    /// The rows follow the request's settled rows and those its earlier unsettled
    /// verifies reserved (when the accepted counts arrive late, the next step is
    /// allocated for the worst case: every earlier position accepted; the kernels read
    /// the accepted counts on the device). Draft tokens never enter the prefix tree; the
    /// accepted ones join the request at [`HybridCache::settle`].
    ///
    /// On a model with recurrent layers the verify writes the state after its position
    /// `i` into the `i`-th slot of a scratch group ([`Request::state_group`]), reading
    /// the running state ([`Request::state_slot`]) or, with an earlier verify unsettled,
    /// that verify's group at its last accepted position (a device offset).
    ///
    /// Errors, before anything changes: a cache built without speculation
    /// ([`Error::SpeculationOff`]), a draft wider than it was built for
    /// ([`Error::VerifyWidth`]), a bad parent array ([`Error::BadDraftTree`]), a request
    /// still in prefill ([`Error::BadRequest`]) or with as many unsettled verifies as the
    /// cache allows ([`Error::TooManyInFlight`]). Short of memory after eviction:
    /// [`Error::OutOfMemory`], every request as it was.
    pub fn alloc_verify(
        &mut self,
        batch: &mut [&mut Request],
        drafts: &[Draft<'_>],
    ) -> Result<(), Error> {
        let first = batch.first().map_or(u64::MAX, |r| r.id);
        if batch.len() != drafts.len() {
            return Err(Error::BadRequest {
                request: first,
                reason: format!("{} requests but {} drafts", batch.len(), drafts.len()),
            });
        }
        let Some(spec) = self.speculation else {
            return Err(Error::SpeculationOff { request: first });
        };
        for (req, draft) in batch.iter().zip(drafts) {
            self.check_owner(req)?;
            let width = draft.width();
            if width == 0 || width > spec.max_width as usize {
                return Err(Error::VerifyWidth {
                    request: req.id,
                    width,
                    max_width: spec.max_width as usize,
                });
            }
            draft.check(req.id)?;
            if req.verifies.len() >= spec.max_in_flight as usize {
                return Err(Error::TooManyInFlight {
                    request: req.id,
                    in_flight: req.verifies.len(),
                });
            }
            if req.settled_len() != req.tokens.len() {
                return Err(Error::BadRequest {
                    request: req.id,
                    reason: format!(
                        "verify before prefill finished ({} of {} tokens)",
                        req.settled_len(),
                        req.tokens.len()
                    ),
                });
            }
        }
        self.release_batch_windows(batch)?;
        let ps = self.alloc.page_size();
        let extends: Vec<ExtendRequest> = batch
            .iter()
            .zip(drafts)
            .map(|(req, draft)| ExtendRequest {
                prefix_len: req.len(),
                seq_len: req.len() + draft.width(),
                last_token: req.row.last().copied(),
            })
            .collect();
        let pages = extends.iter().map(|e| e.new_pages(ps)).sum();
        // Each verify of a recurrent model writes a scratch lane: idle ones first, then
        // blocks of fresh slots, priced with the KV in one eviction loop.
        let lanes = if self.states.is_some() {
            batch.len()
        } else {
            0
        };
        let fresh = self.verify_scratch.fresh_slots(lanes);
        self.make_room(PageDemand {
            mamba_slots: fresh,
            ..self.kv_demand(pages)
        })?;
        let mut slots = Vec::with_capacity(fresh);
        if fresh > 0 {
            self.alloc
                .alloc_slots(fresh, &mut slots)
                .map_err(|e| self.out_of_memory(e))?;
        }
        let mut ids = std::mem::take(&mut self.scratch);
        ids.clear();
        let result = self
            .alloc
            .alloc_extend(&extends, &mut ids)
            .map_err(|e| self.out_of_memory(e));
        self.scratch = ids;
        if let Err(e) = result {
            // Nothing is allocated: the fresh scratch goes back.
            if !slots.is_empty() {
                self.alloc.free_batch(&[FreeOp::Slots(&slots)]);
            }
            return Err(e);
        }
        self.verify_scratch.made(&slots);
        let mut at = 0;
        for (i, (req, draft)) in batch.iter_mut().zip(drafts).enumerate() {
            let positions = draft.width();
            let before = self.held(req);
            req.row.extend_from_slice(&self.scratch[at..at + positions]);
            at += positions;
            self.account(before, self.held(req));
            let lane = if i < lanes {
                self.verify_scratch.take()
            } else {
                ScratchLane::default()
            };
            req.verifies.push_back(PendingVerify {
                width: positions,
                parents: draft.tree(),
                lane,
            });
            if let Some(state) = &mut req.state {
                // A verify saves no checkpoint in its forward (settling does).
                state.pending.clear();
            }
        }
        Ok(())
    }

    /// Settles the oldest unsettled verify step of each request of the batch with what
    /// the target accepted: the accepted tokens join the request (and with them its
    /// settled rows), and the rows reserved past what may still be read are freed —
    /// whole pages only, with fixed-shape frees; a page the accepted rows (or a later
    /// unsettled verify) partly use stays. Nothing is read from the device: the engine
    /// passes the counts when it has them.
    ///
    /// A tree verify's accepted nodes become the request's next rows in path order; their
    /// KV is moved there on the device by a fixed-shape copy that reads the accepted path
    /// there (the verify's metadata carries what it needs), so the host moves nothing.
    ///
    /// On a model with recurrent layers the last accepted position's state is copied
    /// from the verify's scratch group into the request's running slot, and the grid
    /// points, branching point and prompt end the accepted positions cross are saved as
    /// checkpoints, copied out of the group too (best effort: only into slots that fit
    /// without evicting the accepted KV's room) — in one device copy, settled on time or
    /// late alike (a later verify writes a group of its own). The group goes back to the
    /// cache.
    ///
    /// Errors, before anything changes: a request with no unsettled verify
    /// ([`Error::NothingToSettle`], e.g. settled twice), accepted positions that do not
    /// fit its verify ([`Error::BadAccepted`]: none, more than its width, a path for a
    /// chain, a path that is not a root-to-node path of its tree), or a device error of
    /// the state copy, which is issued before the host changes anything.
    pub fn settle(
        &mut self,
        batch: &mut [&mut Request],
        accepted: &[Accepted<'_>],
    ) -> Result<(), Error> {
        if batch.len() != accepted.len() {
            return Err(Error::BadRequest {
                request: batch.first().map_or(u64::MAX, |r| r.id),
                reason: format!(
                    "{} requests but {} accepted lists",
                    batch.len(),
                    accepted.len()
                ),
            });
        }
        for (req, acc) in batch.iter().zip(accepted) {
            self.check_owner(req)?;
            let Some(verify) = req.verifies.front() else {
                return Err(Error::NothingToSettle { request: req.id });
            };
            verify.check(req.id, acc)?;
        }
        // Rows each request keeps: its settled rows, the accepted ones, and what its later
        // unsettled verifies reserved (the device may already be writing them).
        let ps = self.ps;
        let settled: Vec<usize> = batch.iter().map(|r| r.settled_len()).collect();
        let keep: Vec<usize> = batch
            .iter()
            .zip(accepted)
            .map(|(r, acc)| {
                let width = r.verifies.front().map_or(0, |v| v.width);
                r.len() - width + acc.len()
            })
            .collect();
        // The accepted states go first (the one device op that can fail), so a refused
        // settlement changes nothing on the host.
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        let copied = self.settle_states(batch, accepted, &settled, &mut plan);
        if let Err(e) = copied {
            self.plan = plan;
            return Err(e);
        }
        let tails: Vec<FreeOp<'_>> = batch
            .iter()
            .zip(&keep)
            .filter_map(|(r, &keep)| {
                // Whole pages past the kept rows; a partly used page stays.
                let dead = keep.next_multiple_of(ps)..r.len();
                (!dead.is_empty()).then_some(FreeOp::KvRow {
                    row: &r.row,
                    dead_lo: dead.start,
                    cursor: dead.start,
                    len: dead.end,
                })
            })
            .collect();
        if !tails.is_empty() {
            self.alloc.free_batch(&tails);
        }
        drop(tails);
        for (i, ((req, acc), &keep)) in batch.iter_mut().zip(accepted).zip(&keep).enumerate() {
            let before = self.held(req);
            req.row.truncate(keep);
            self.lanes_mut().invalidate(req.id, keep, ps);
            let verify = req.verifies.pop_front().expect("checked above");
            req.tokens.extend_from_slice(acc.tokens);
            self.account(before, self.held(req));
            self.verify_scratch.give_back(verify.lane);
            if self.states.is_some() {
                self.commit_checkpoints(req, &plan, i);
                if let Some(state) = &mut req.state {
                    // Settling copied them; the next forward writes none of them.
                    state.pending.clear();
                }
            }
        }
        self.plan = plan;
        Ok(())
    }

    /// Copies each request's accepted state out of its oldest verify's scratch group, in
    /// one device op: the last accepted position's into its running slot, and the
    /// positions the checkpoint plan names (grid points, branching point, prompt end the
    /// accepted positions cross: planned as a decode step's, best effort) into their
    /// checkpoint slots — on time or late alike, since no later verify writes that
    /// group. On error nothing was copied and the fresh checkpoint slots went back.
    fn settle_states(
        &mut self,
        batch: &[&mut Request],
        accepted: &[Accepted<'_>],
        settled: &[usize],
        plan: &mut CheckpointPlan,
    ) -> Result<(), Error> {
        if self.states.is_none() {
            return Ok(());
        }
        for ((req, acc), &from) in batch.iter().zip(accepted).zip(settled) {
            self.plan_checkpoints(req, from..from + acc.len(), plan);
        }
        self.alloc_with_checkpoints(0, plan, Checkpoints::BestEffort, |_| Ok(()))?;
        let issued = match self.replay.clone() {
            None => self.copy_accepted_states(batch, accepted, settled, plan),
            Some(replay) => self.replay_accepted_states(&*replay, batch, accepted, settled, plan),
        };
        issued.inspect_err(|_| {
            // Nothing was issued: the fresh slots go back, nothing is recorded.
            self.alloc.free_batch(&[FreeOp::Slots(plan.fresh_slots())]);
        })
    }

    /// The copy rollback: each request's accepted state copied out of its lane (a state
    /// per position) into its running slot and the planned checkpoint slots, one device
    /// op.
    fn copy_accepted_states(
        &self,
        batch: &[&mut Request],
        accepted: &[Accepted<'_>],
        settled: &[usize],
        plan: &CheckpointPlan,
    ) -> Result<(), Error> {
        let shape = self.verify_scratch.shape;
        let mut copies: Vec<(VirtualSlot, VirtualSlot)> = Vec::new();
        for (i, (req, acc)) in batch.iter().zip(accepted).enumerate() {
            let (Some(state), Some(verify)) = (&req.state, req.verifies.front()) else {
                continue;
            };
            // The state after `at_len` settled tokens: the lane's entry of that position.
            let state_at = |at_len: usize| {
                verify
                    .lane
                    .entry(shape, acc.node(at_len - settled[i] - 1))
                    .0
            };
            copies.push((state_at(settled[i] + acc.len()), state.running));
            for (at_len, slot) in plan.writes(i, &state.held) {
                copies.push((state_at(at_len), slot));
            }
        }
        if copies.is_empty() {
            return Ok(());
        }
        Ok(self.alloc.copy_slots(&copies)?)
    }

    /// The replay rollback: one [`StateCommit`] per request — its running slot, the
    /// accepted positions' log entries in order, the planned checkpoints by entries
    /// replayed — handed to the engine's replay in one call, physical slots throughout.
    fn replay_accepted_states(
        &self,
        replay: &dyn crate::StateReplay,
        batch: &[&mut Request],
        accepted: &[Accepted<'_>],
        settled: &[usize],
        plan: &CheckpointPlan,
    ) -> Result<(), Error> {
        let shape = self.verify_scratch.shape;
        // A request's slots are bound while it lives; an unbound one is named with it.
        let physical = |request: u64, slot: VirtualSlot| {
            self.alloc.physical_slot(slot).ok_or(Error::BadRequest {
                request,
                reason: format!("state slot {} is not mapped", slot.0),
            })
        };
        // Flat lists, sliced per request below.
        let mut entries: Vec<LogEntry> = Vec::new();
        let mut saves: Vec<(u32, u32)> = Vec::new();
        let mut spans: Vec<(u64, u32, std::ops::Range<usize>, std::ops::Range<usize>)> = Vec::new();
        for (i, (req, acc)) in batch.iter().zip(accepted).enumerate() {
            let (Some(state), Some(verify)) = (&req.state, req.verifies.front()) else {
                continue;
            };
            let e0 = entries.len();
            for j in 0..acc.len() {
                let (slot, index) = verify.lane.entry(shape, acc.node(j));
                entries.push(LogEntry {
                    slot: physical(req.id, slot)?,
                    index,
                });
            }
            let s0 = saves.len();
            for (at_len, slot) in plan.writes(i, &state.held) {
                saves.push(((at_len - settled[i]) as u32, physical(req.id, slot)?));
            }
            spans.push((
                req.id,
                physical(req.id, state.running)?,
                e0..entries.len(),
                s0..saves.len(),
            ));
        }
        if spans.is_empty() {
            return Ok(());
        }
        let commits: Vec<StateCommit<'_>> = spans
            .into_iter()
            .map(|(request, running, e, s)| StateCommit {
                request,
                running,
                entries: &entries[e],
                checkpoints: &saves[s],
            })
            .collect();
        let ctx = crate::speculative::ReplayContext {
            device: self.device(),
            buffer: self.alloc.buffer(),
            slot_bytes: self.kv_geometry().slot_bytes,
            log_bytes: replay.log_bytes_per_position(),
        };
        Ok(replay.replay(&ctx, &commits)?)
    }
}

//! Making room: the shortfall ladder of an allocation (as things are, then both ends
//! compacted, then the tri-pool's float relaid), each rung planned into the pool's
//! compaction and relay plans without changing a table (a relay over ends with holes
//! first packs them as a transaction of its own, see `plan_room`), its moves issued as
//! one `move_spans`, and the plans committed only after that; then the float steered
//! where the fit put its pages. A flush's compaction goes through the same plans.

use super::{FloatFit, Placement, UnifiedSwa};
use crate::api::{PageDemand, Reclaimable};
use crate::error::Error;
use crate::invariants::ROOM_CHECK;
use crate::spec::{Grow, Side};
use crate::sub::Edge;

/// Where an allocation's pages come from, once its planned moves are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    /// Every side as it is.
    AsIs,
    /// The sides after the planned compaction (`plans`); a float as it is.
    Compacted,
    /// The float after the planned relay (`relay`); the ends as they are (packed).
    Relaid,
}

impl UnifiedSwa {
    /// Plans a compaction of both ends (and of a float toward `float`, if given) into
    /// `self.plans` and `self.moves` (cleared first), changing no table.
    fn plan_compaction(&mut self, float: Option<Edge>) {
        self.moves.clear();
        let is_float = self.float().is_some();
        let [full_plan, swa_plan, mamba_plan] = &mut self.plans;
        swa_plan.clear();
        if let Some(swa) = &self.swa {
            match (is_float, float) {
                (false, _) => swa.plan_compaction(Edge::Low, &mut self.moves, swa_plan),
                (true, Some(edge)) => swa.plan_compaction(edge, &mut self.moves, swa_plan),
                (true, None) => {}
            }
        }
        if let Some(mamba) = &self.mamba {
            mamba.plan_compaction(Edge::Low, &mut self.moves, mamba_plan);
        }
        self.full
            .plan_compaction(Edge::High, &mut self.moves, full_plan);
    }

    /// The edge a flush packs the float toward: the side with more room, so the bytes
    /// its holes held go to the tighter neighbour (`None` without a float).
    pub(super) fn float_compaction_edge(&self) -> Option<Edge> {
        let swa = self.float()?;
        let (lo, hi) = swa.span_bytes();
        let below = lo.saturating_sub(self.low().facing_byte());
        let above = self.full.facing_byte().saturating_sub(hi);
        Some(if below >= above {
            Edge::Low
        } else {
            Edge::High
        })
    }

    /// Forgets the planned compaction and relay (their moves failed, or they were
    /// applied).
    pub(super) fn drop_plans(&mut self) {
        for plan in &mut self.plans {
            plan.clear();
        }
        self.relay.clear();
    }

    /// Applies the planned compaction or relay (`from`) to the tables; returns the pages
    /// moved.
    pub(super) fn commit_plans(&mut self, from: Source) -> usize {
        let moved = match from {
            Source::AsIs => 0,
            Source::Compacted => {
                let [full_plan, swa_plan, mamba_plan] = &self.plans;
                self.full.commit_compaction(full_plan);
                if let Some(swa) = &mut self.swa {
                    swa.commit_compaction(swa_plan);
                }
                if let Some(mamba) = &mut self.mamba {
                    mamba.commit_compaction(mamba_plan);
                }
                self.plans.iter().map(|p| p.pairs.len()).sum()
            }
            Source::Relaid => {
                if let Some(swa) = &mut self.swa {
                    swa.commit_relay(&self.relay);
                }
                self.relay.pairs.len()
            }
        };
        self.drop_plans();
        moved
    }

    /// Issues the planned moves (one `move_spans` for every side: the spans are
    /// disjoint, so no destination overlaps another).
    pub(super) fn issue_moves(&self) -> Result<(), Error> {
        if !self.moves.is_empty() {
            self.device.move_spans(self.buffer, &self.moves)?;
        }
        Ok(())
    }

    /// Compacts both ends (and a float toward `float`): plans, moves the envelopes on the
    /// device, and rewrites the tables only once the move was issued. A failed move
    /// changes no table (the moves only wrote holes, which nothing points to).
    pub(super) fn compact(&mut self, float: Option<Edge>) -> Result<usize, Error> {
        if self.subs().all(|sub| sub.holes.is_empty()) {
            return Ok(0);
        }
        self.plan_compaction(float);
        if let Err(e) = self.issue_moves() {
            self.drop_plans();
            return Err(e);
        }
        Ok(self.commit_plans(Source::Compacted))
    }

    /// Sizes the room for `d` and plans the moves that make it, changing no table, with
    /// one exception: a relay of the float over ends with holes first compacts the ends
    /// as a transaction of its own (the ladder's first rung: every page keeps its
    /// virtual id and its bytes). Returns where the pages come from once the planned
    /// moves are issued, and where the float's go; [`Error::OutOfCapacity`] (or
    /// [`Error::OutOfSlots`]) when no placement fits.
    pub(super) fn plan_room(&mut self, d: PageDemand) -> Result<(Source, FloatFit), Error> {
        let none = Reclaimable::default();
        if let Some(float) = self.fit(d, none, Placement::Now) {
            return Ok((Source::AsIs, float));
        }
        if !self.gated() {
            if let Some(float) = self.fit(d, none, Placement::Compacted) {
                self.plan_compaction(None);
                return Ok((Source::Compacted, float));
            }
            if self.fits(d, none, Placement::Relaid) {
                self.compact(None)?;
                // The ends are packed now, so the float's room is what `Relaid` priced.
                if let (Some(FloatFit::Relay(room)), Some(swa)) =
                    (self.fit(d, none, Placement::Relaid), &self.swa)
                {
                    self.moves.clear();
                    swa.plan_relay(room, d.swa_pages as u32, &mut self.moves, &mut self.relay);
                    return Ok((Source::Relaid, FloatFit::Grow(Edge::High)));
                }
                self.scope.expect(&ROOM_CHECK, false, || {
                    format!("{d:?} fitted relaid but not once the ends were packed")
                });
            }
        }
        if d.mamba_slots > 0 {
            return Err(Error::OutOfSlots {
                requested: d.mamba_slots,
                available: self.side_capacity(Side::Mamba).schedulable_pages,
            });
        }
        Err(Error::OutOfCapacity {
            full_pages: d.full_pages,
            swa_pages: d.swa_pages,
            available_pages: self.joint_pages(self.placement()),
        })
    }

    /// Points the float's growth where `float` says (after its pages' device work).
    pub(super) fn steer_float(&mut self, float: FloatFit) {
        let Some(swa) = self.swa.as_mut().filter(|swa| swa.grow == Grow::Float) else {
            return;
        };
        match float {
            FloatFit::Stay | FloatFit::Relay(_) => {}
            FloatFit::Grow(edge) => swa.set_float_edge(edge),
            FloatFit::Place(at) => {
                swa.place(at);
                swa.set_float_edge(Edge::High);
            }
        }
    }
}

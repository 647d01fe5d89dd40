//! A speculative run's decode step: one verify step for the verify batch (taken round
//! robin), the settlement of the oldest verify of each request whose counts are due
//! (accepted lengths drawn from the seed), and a plain decode for the decoders beyond the
//! verify batch.

use super::{Simulation, SpecNote, fed_back, requests};
use crate::error::ReplayError;
use crate::speculative::{Acceptance, DraftShape, SpecMode};
use crate::stats::SpecStats;
use unikv::{Accepted, Draft, TokenId};

/// A speculative run's state.
pub(super) struct Speculating {
    pub(super) mode: SpecMode,
    /// The draft tree's parent array (empty for chains).
    pub(super) parents: Vec<i32>,
    pub(super) acceptance: Acceptance,
    pub(super) stats: SpecStats,
    /// Requests one verify step covers at most (the cache's verify batch).
    pub(super) lanes: usize,
    /// Where the next step's verify batch starts among the decoders (round robin).
    pub(super) turn: usize,
}

impl Simulation<'_> {
    /// One verify step for each request that had finished prefill when the step began
    /// (`decoders`, ascending indices into `running`): `alloc_verify` for the batch (out
    /// of memory, the newest request is retracted and the rest retried, as for a decode),
    /// then `settle` of each request's oldest verify once as many are in flight as the
    /// mode keeps (1, or 2 with counts a step late).
    pub(super) fn verify(&mut self, mut decoders: Vec<usize>) -> Result<bool, ReplayError> {
        let Some(spec) = &self.spec else {
            return Ok(false);
        };
        let mode = spec.mode;
        let parents = spec.parents.clone();
        // At most the cache's verify batch verifies, its members taken round robin; the
        // others decode plainly after the settlement.
        let all = decoders.clone();
        if decoders.len() > spec.lanes {
            let start = spec.turn % decoders.len();
            decoders.rotate_left(start);
            decoders.truncate(spec.lanes);
            decoders.sort_unstable();
        }
        if let Some(spec) = &mut self.spec {
            spec.turn = spec.turn.wrapping_add(decoders.len());
        }
        let draft = match mode.draft {
            DraftShape::Chain { k } => Draft::Chain { k: k as usize },
            DraftShape::Tree { .. } => Draft::Tree { parents: &parents },
        };
        let allocated = self.alloc_retracting(&mut decoders, draft.width(), |s, decoders| {
            let drafts = vec![draft; decoders.len()];
            let mut batch = requests(&mut s.running, decoders);
            (s.notes)(SpecNote::Begin);
            s.cache.alloc_verify(&mut batch, &drafts)?;
            (s.notes)(SpecNote::Verified { drafts: &drafts });
            Ok(())
        })?;
        let Some(retracted_any) = allocated else {
            return Ok(false);
        };
        // The verify's forward holds every reserved row: the step's peak, before the
        // rejected ones go back. Its metadata is built before it settles.
        self.observe_peaks();
        for &i in &decoders {
            let req = &self.running[i].req;
            self.computed.push((i, req.id(), req.reserved_rows()));
        }
        self.step_metadata()?;
        let in_flight = mode.speculation().max_in_flight as usize;
        // Settled: the oldest verify of each request that verified with as many in
        // flight as the mode keeps, and of each waiting one whose counts arrived.
        let settling: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| i < self.running.len())
            .filter(|&i| {
                let unsettled = self.running[i].req.unsettled_verifies();
                match decoders.binary_search(&i) {
                    Ok(_) => unsettled == in_flight,
                    Err(_) => unsettled > 0,
                }
            })
            .collect();
        let Some(spec) = &mut self.spec else {
            return Ok(false);
        };
        spec.stats.verify_steps += decoders.len() as u64;
        if !settling.is_empty() {
            // What the target accepted: drawn, capped by the output left (at least 1).
            let mut counts = Vec::with_capacity(settling.len());
            let mut paths: Vec<Vec<u32>> = Vec::new();
            let mut tokens: Vec<Vec<TokenId>> = Vec::with_capacity(settling.len());
            for &i in &settling {
                let r = &self.running[i];
                let request = &self.workload.requests[r.spec];
                let cap = (request.output_len - r.sampled) as usize;
                let count = match mode.draft {
                    DraftShape::Chain { k } => spec.acceptance.chain(k, cap),
                    DraftShape::Tree { .. } => {
                        let mut path = Vec::new();
                        spec.acceptance.tree_path(cap, &mut path);
                        let n = path.len();
                        paths.push(path);
                        n
                    }
                };
                tokens.push(
                    (0..count as u32)
                        .map(|j| fed_back(self.config.seed, request, r.sampled + j))
                        .collect(),
                );
                counts.push(count);
            }
            let accepted: Vec<Accepted<'_>> = match mode.draft {
                DraftShape::Chain { .. } => tokens.iter().map(|t| Accepted::chain(t)).collect(),
                DraftShape::Tree { .. } => paths
                    .iter()
                    .zip(&tokens)
                    .map(|(p, t)| Accepted::tree(p, t))
                    .collect(),
            };
            let mut batch = requests(&mut self.running, &settling);
            (self.notes)(SpecNote::Begin);
            self.cache.settle(&mut batch, &accepted)?;
            (self.notes)(SpecNote::Settled {
                accepted: &counts,
                paths: (!paths.is_empty()).then_some(&paths[..]),
            });
            for (&i, &count) in settling.iter().zip(&counts) {
                self.running[i].sampled += count as u32;
                self.tokens_done += count as u64;
            }
            spec.stats.settled_steps += settling.len() as u64;
            spec.stats.accepted_tokens += counts.iter().sum::<usize>() as u64;
        }
        if !retracted_any {
            self.estimate.decay();
        }
        // The decoders beyond the verify batch decode one token plainly, as an engine
        // turns speculation off past its speculative batch (vLLM's
        // `speculative_disable_by_batch_size`, TensorRT-LLM's `max_concurrency`): no
        // request waits a step, and none needs scratch. Their verifies settled above.
        let rest: Vec<usize> = all
            .into_iter()
            .filter(|&i| i < self.running.len() && decoders.binary_search(&i).is_err())
            .filter(|&i| self.running[i].req.unsettled_verifies() == 0)
            .collect();
        if !rest.is_empty() {
            self.decode(rest)?;
        }
        Ok(true)
    }
}

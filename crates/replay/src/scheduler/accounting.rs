//! What a run counts as it goes: the pages the allocator handles ([`PagesHandled`], a
//! hook on every allocator call), the bytes and peaks of each sub-pool (and of the host
//! tier's kinds), the samples, host syncs and the invariant violations the step boundary
//! reports.

use super::Simulation;
use crate::error::ReplayError;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use unikv::pools::{Call, FreeOp, Hooks, KvAllocator, Outcome, PageSize};
use unikv::{HybridCache, ModelSpec};

impl Simulation<'_> {
    /// Counts what poll found at the step boundary; anything else is fatal.
    pub(super) fn step_boundary_result(
        &mut self,
        result: Result<unikv::StepReport, unikv::Error>,
    ) -> Result<(), ReplayError> {
        match result {
            Ok(_) => Ok(()),
            Err(unikv::Error::Invariants(unikv::invariants::Error::Violated(v))) => {
                // Counted from the cache's scope at the end; the run goes on so the report
                // shows it.
                let _ = v;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Tracks the peak bytes per sub-pool within a step (a verify's reserved rows, freed
    /// again when it settles, count while its forward runs).
    pub(super) fn observe_peaks(&mut self) {
        let stats = self.cache.stats();
        for (name, b) in subpool_bytes(&self.config.model, &stats) {
            let peak = self
                .stats
                .peak_bytes_by_subpool
                .entry(name.to_string())
                .or_insert(0);
            *peak = (*peak).max(b);
        }
    }

    /// Samples bytes per sub-pool and tracks their peaks (and the peak of state slots in
    /// use, and the host tier's bytes per kind).
    pub(super) fn observe(&mut self, step: u64) {
        let stats = self.cache.stats();
        let bytes = subpool_bytes(&self.config.model, &stats);
        for (name, b) in &bytes {
            let peak = self
                .stats
                .peak_bytes_by_subpool
                .entry(name.to_string())
                .or_insert(0);
            *peak = (*peak).max(*b);
        }
        if let Some(mamba) = &mut self.stats.mamba {
            let in_use = (stats.mamba.total_pages - stats.mamba.available_pages) as u64;
            mamba.peak_slots = mamba.peak_slots.max(in_use);
            // Every live request holds one running slot and the cache its verify scratch;
            // every other slot in use is a checkpoint (held by its request until the tree
            // takes it, or cached there).
            let own = stats.live_requests as u64 + stats.verify_scratch_slots as u64;
            let checkpoints = in_use.saturating_sub(own);
            mamba.peak_checkpoint_slots = mamba.peak_checkpoint_slots.max(checkpoints);
        }
        // The host tier's bytes per kind, sampled here as the device's are.
        if let (Some(host), Some(tier)) = (&mut self.stats.host, &stats.host) {
            host.observe(tier);
        }
        self.samples.record(step, || {
            bytes.iter().map(|(n, b)| (n.to_string(), *b)).collect()
        });
        // Keep the ledger small: count its syncs, then forget its op records.
        self.stats.host_syncs += self.ledger.syncs() as u64;
        self.ledger.reset();
    }
}

/// Counts the pages (and state slots) the allocator binds or releases, call by call:
/// what a step's host work should be proportional to (moves inside the allocator are
/// not counted).
#[derive(Debug)]
pub(super) struct PagesHandled(pub(super) Arc<AtomicU64>);

/// Pages one free releases (or, for a transfer, moves to its new owner). A batch op the
/// allocator refused (and skipped) may name a bad row range: counted without slicing.
fn free_pages(op: FreeOp<'_>, ps: PageSize) -> u64 {
    (match op {
        FreeOp::Segment(s) | FreeOp::FullSegment(s) | FreeOp::SwaSegment(s) => s.page_count(ps),
        FreeOp::TransferSwa { from, .. } => from.page_count(ps),
        FreeOp::KvRow {
            row, dead_lo, len, ..
        } => ps.pages_for(len.min(row.len()).saturating_sub(dead_lo)),
        FreeOp::Slots(slots) => slots.len(),
    }) as u64
}

impl Hooks for PagesHandled {
    fn after(&mut self, inner: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        let Outcome::Done { tokens, slots } = outcome else {
            return;
        };
        let ps = inner.page_size();
        let pages = match call {
            // A token at a page's first offset opened the page.
            Call::AllocExtend(_) | Call::AllocDecode(_) => {
                tokens.iter().filter(|t| t.offset(ps) == 0).count() as u64
            }
            Call::AllocSlots(_) => slots.len() as u64,
            // Runs of one page counted once, as the free de-duplicates them.
            Call::FreeIds(_, ids) => {
                let first = |i: usize| i == 0 || ids[i].page(ps) != ids[i - 1].page(ps);
                (0..ids.len()).filter(|&i| first(i)).count() as u64
            }
            Call::Free(op) => free_pages(op, ps),
            Call::FreeSegments(segments) | Call::FreeSwaSegments(segments) => {
                segments.iter().map(|s| s.page_count(ps) as u64).sum()
            }
            Call::FreeBatch(ops) => ops.iter().map(|&op| free_pages(op, ps)).sum(),
            _ => 0,
        };
        self.0.fetch_add(pages, Ordering::Relaxed);
    }
}

/// The sub-pools a run of `model` reports, with the bytes each holds now: `full`, `swa`
/// when the model has sliding-window layers, `mamba` (state slots × slot bytes) when it
/// has recurrent state.
pub(super) fn subpool_bytes(
    model: &ModelSpec,
    stats: &unikv::CacheStats,
) -> Vec<(&'static str, u64)> {
    let mut bytes = vec![("full", stats.full.used_bytes())];
    if model.swa_layers > 0 {
        bytes.push(("swa", stats.swa.used_bytes()));
    }
    if model.has_recurrent_state() {
        bytes.push(("mamba", stats.mamba.used_bytes()));
    }
    bytes
}

/// Violations recorded in the run's cache's invariant scope (this run's alone, whatever
/// else runs in the process).
pub(super) fn violations(cache: &HybridCache) -> u64 {
    cache
        .invariant_scope()
        .report()
        .map_or(0, |r| r.total_violations())
}

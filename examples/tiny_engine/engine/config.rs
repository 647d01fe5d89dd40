//! What a serving run is configured with: the workload, the reuse switch, a deliberate
//! fault and the budget ([`RunConfig`]). A leaf beside the model and the workload: the
//! serving loops, the reference and the checks all read it.

use super::model::Model;
use super::workload::{Workload, checkpoint_grid};
use unikv::Layout;

/// Whether the engine reuses cached prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    /// Every prefill chunk and every finished request enters the prefix cache, and
    /// admission resumes from the deepest cached state (FULL/SWA KV with it).
    On,
    /// Nothing enters the prefix cache (requests are released, never cached), so no
    /// admission hits and every token is computed from scratch.
    Off,
}

impl Reuse {
    /// `on` or `off`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reuse::On => "on",
            Reuse::Off => "off",
        }
    }
}

/// A deliberate engine bug, so a test can show that the checks catch a wrong reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// No bug.
    None,
    /// Flips one bit of the state a request resumes from (in its slot, before the first
    /// step reads it): a wrong state copy.
    FlipResumedState,
    /// Never writes the checkpoints the step metadata lists: the cache then holds stale
    /// slot bytes where it believes a state is.
    SkipCheckpointWrites,
}

/// The shape of a serving run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Seed of the workload and the scheduler's choices.
    pub seed: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// Static or unified.
    pub layout: Layout,
    /// The model served.
    pub model: Model,
    /// What is served.
    pub workload: Workload,
    /// Whether cached prefixes are reused.
    pub reuse: Reuse,
    /// Room for this many tokens of FULL and SWA KV (the budget).
    pub budget_tokens: u64,
    /// Most requests running at once.
    pub max_running: usize,
    /// Most prefill tokens per step.
    pub prefill_budget: usize,
    /// A deliberate bug ([`Fault::None`] for a real run).
    pub fault: Fault,
    /// Bytes of the cache's host tier (0: none): evicted prefixes are written back to
    /// host memory and loaded back by the admissions that match them.
    pub host_memory_bytes: u64,
}

impl RunConfig {
    /// A run of a scripted reuse workload ([`Workload::SharedPrefix`],
    /// [`Workload::MultiTurn`] or [`Workload::TurnsAcrossGrid`]) at page size
    /// `page_size`: room for every request's KV and states at once, so nothing a later
    /// request could hit is evicted; prefill in chunks of up to two grid intervals.
    pub fn scripted(
        page_size: u32,
        layout: Layout,
        model: Model,
        workload: Workload,
        reuse: Reuse,
    ) -> RunConfig {
        let grid = checkpoint_grid(page_size) as usize;
        RunConfig {
            seed: 11,
            page_size,
            layout,
            model,
            workload,
            reuse,
            budget_tokens: 32 * grid as u64,
            max_running: 4,
            prefill_budget: 2 * grid,
            fault: Fault::None,
            host_memory_bytes: 0,
        }
    }
}

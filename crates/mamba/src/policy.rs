//! When a request's recurrent state is checkpointed: the policy (the checkpoint grid, how
//! many states one step may save) and the per-step plan of positions to save.
//!
//! A recurrent state summarises a whole prefix and cannot be cut back like KV rows, so a
//! prefix hit can only resume from a state saved at exactly the hit's length. A request
//! therefore saves its state, while it runs, at the positions later requests are likely
//! to leave its path ([`StatePolicy::plan`]):
//! - **its branching point**: where its prompt leaves the longest cached path, when no
//!   state exists there (SGLang's `mamba_branching_seqlen`): the next request that leaves
//!   the path at the same place hits all of it;
//! - **the end of its prompt** (its last whole page): a follow-up turn is the prompt, the
//!   output and new text, and a re-sent prompt is the prompt;
//! - **the checkpoint grid**: every multiple of the interval the step crosses, deepest
//!   first (the chunked-prefill kernels of GDN and Mamba2 compute the state at chunk
//!   boundaries anyway; SGLang #38625 snapshots them in every prefill extend).
//!
//! A step saves at most [`StatePolicy::checkpoints_per_step`] states, so a request holds
//! at most one running slot and that many checkpoint slots
//! ([`StatePolicy::slots_per_request`]).
//!
//! By default the interval is 256 tokens (SGLang's `mamba_track_interval`) and a step
//! saves at most 2 states, so a request holds at most three slots. The plan and the grid are
//! checked against brute-force models in `tests/properties.rs`
//! (`a_plan_keeps_the_worthiest_distinct_page_boundaries_inside_the_step`,
//! `grid_queries_match_brute_force`).

use std::num::NonZeroU32;
use std::ops::Range;

use unikv_pools::{PageSize, VirtualSlot};

use crate::error::Error;

/// The reference engine's checkpoint interval in tokens: SGLang
/// `python/sglang/srt/server_args.py`, `ServerArgs.mamba_track_interval: int = 256`
/// (`--mamba-track-interval`), which it requires to be divisible by `page_size` and at
/// least `speculative_num_draft_tokens` when the extra-buffer (checkpointing) strategy is
/// on.
pub const DEFAULT_CHECKPOINT_INTERVAL: u32 = 256;

/// States one step of one request may save by default: 2. A request then holds at most
/// three slots (its running state and two checkpoints), what the reference engine's
/// extra-buffer strategy holds (a running slot and `mamba_ping_pong_track_buffer_size =
/// 2` track slots), so the batch-size-1 floor and the static slot pool's sizing stay the
/// reference engine's. Two cover the positions worth a slot in one prefill step: the
/// deepest place a later prompt may leave the path (the branching point, else the
/// deepest grid point) and the prompt's end (follow-up turns); a chunked prefill saves
/// two per chunk, so a long prompt is covered chunk by chunk.
pub const DEFAULT_CHECKPOINTS_PER_STEP: u32 = 2;

/// The most states one step may save ([`StatePolicy::with_checkpoints_per_step`]): each
/// is a slot the request holds until the prefix tree takes it, and the tree keeps at
/// most a few per path anyway.
pub const MAX_CHECKPOINTS_PER_STEP: u32 = 4;

/// Slots one request holds at batch size 1 with the prefix cache on and the default
/// policy, which the batch-size-1 floor charges (3 slots + sink): the running state and
/// [`DEFAULT_CHECKPOINTS_PER_STEP`] checkpoints. The pools' own constant, so the floor
/// and the policy cannot disagree.
pub const BS1_SLOTS: u32 = unikv_pools::BS1_STATE_SLOTS;

// The floor charges what a checkpointed request holds by default.
const _: () = assert!(BS1_SLOTS == 1 + DEFAULT_CHECKPOINTS_PER_STEP);
/// A checkpoint interval in tokens: a positive multiple of the page size, so that every
/// checkpoint ends on a page boundary, where a prefix-tree node can end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CheckpointInterval(NonZeroU32);

impl CheckpointInterval {
    /// `tokens` as an interval for pages of `page_size`; [`Error::BadInterval`] unless it
    /// is a positive multiple of the page size.
    pub const fn new(tokens: u32, page_size: PageSize) -> Result<CheckpointInterval, Error> {
        match NonZeroU32::new(tokens) {
            Some(t) if tokens.is_multiple_of(page_size.get()) => Ok(CheckpointInterval(t)),
            _ => Err(Error::BadInterval {
                interval: tokens,
                page_size: page_size.get(),
            }),
        }
    }

    /// Tokens between checkpoints.
    pub const fn get(self) -> u32 {
        self.0.get()
    }

    /// The largest multiple of the interval at or below `len` (0 below the first).
    pub const fn floor(self, len: usize) -> usize {
        let i = self.0.get() as usize;
        len / i * i
    }
}

/// Whether and how a request's recurrent state is checkpointed.
///
/// # Example
///
/// ```
/// use unikv_mamba::{BS1_SLOTS, DEFAULT_CHECKPOINT_INTERVAL, PlanMarks, StatePolicy};
/// use unikv_pools::PageSize;
///
/// let ps = PageSize::new(64).unwrap();
/// let policy = StatePolicy::checkpointed(DEFAULT_CHECKPOINT_INTERVAL, ps)?;
/// assert_eq!(policy.slots_per_request(), BS1_SLOTS);
/// assert_eq!(policy.checkpoint_at_or_below(700), Some(512));
/// assert_eq!(policy.checkpoint_at_or_below(255), None);
/// // A 4,224-token prompt prefilled in one step saves its last whole page and the
/// // deepest grid point.
/// let mut at = Vec::new();
/// policy.plan(0..4224, PlanMarks { branching: None, prompt_len: 4224 }, &mut at);
/// assert_eq!(at, [4096, 4224]);
/// // One whose prompt left a cached path at 1,024 saves its branching point first.
/// at.clear();
/// policy.plan(0..4224, PlanMarks { branching: Some(1024), prompt_len: 4224 }, &mut at);
/// assert_eq!(at, [1024, 4224]);
/// assert_eq!(StatePolicy::NoPrefixCache.slots_per_request(), 1);
/// assert!(StatePolicy::checkpointed(100, ps).is_err());
/// # Ok::<(), unikv_mamba::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatePolicy {
    /// No prefix cache: a request holds its running state only; nothing is saved.
    NoPrefixCache,
    /// Prefix cache on: states are saved where [`StatePolicy::plan`] says.
    Checkpointed {
        /// Tokens between grid checkpoints.
        interval: CheckpointInterval,
        /// Tokens per page: every saved position ends a page.
        page_size: PageSize,
        /// States one step of one request may save.
        per_step: NonZeroU32,
    },
}

/// What a request knows about itself that makes a position worth saving, beside the grid
/// ([`StatePolicy::plan`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanMarks {
    /// Where its prompt left the longest cached path with no state there (the tree's
    /// `MatchResult::mamba_branching`), if beyond what it resumed from.
    pub branching: Option<usize>,
    /// Its prompt's length in tokens: the state at its last whole page is saved.
    pub prompt_len: usize,
}

impl PlanMarks {
    /// Whether the state at `at` tokens is worth more than a grid point inside the prompt
    /// (for pages of `page_size` tokens): the branching point, or the prompt's last whole
    /// page or beyond it (a decode's checkpoints, where a conversation's next turn
    /// resumes). What later requests resume from, rather than the grid between.
    pub const fn anchors(&self, at: usize, page_size: usize) -> bool {
        let ps = if page_size == 0 { 1 } else { page_size };
        let branching = match self.branching {
            Some(b) => b / ps * ps == at,
            None => false,
        };
        branching || at >= self.prompt_len / ps * ps
    }
}

impl StatePolicy {
    /// Checkpoints every `interval` tokens for pages of `page_size`, saving at most
    /// [`DEFAULT_CHECKPOINTS_PER_STEP`] states a step; [`Error::BadInterval`] unless
    /// `interval` is a positive multiple of the page size.
    pub const fn checkpointed(interval: u32, page_size: PageSize) -> Result<StatePolicy, Error> {
        match CheckpointInterval::new(interval, page_size) {
            Ok(interval) => Ok(StatePolicy::Checkpointed {
                interval,
                page_size,
                per_step: NonZeroU32::new(DEFAULT_CHECKPOINTS_PER_STEP).unwrap(),
            }),
            Err(e) => Err(e),
        }
    }

    /// The same policy saving at most `n` states a step. [`Error::BadCheckpointsPerStep`]
    /// unless `1 ≤ n ≤` [`MAX_CHECKPOINTS_PER_STEP`]; [`Error::NotCheckpointed`] for
    /// [`StatePolicy::NoPrefixCache`].
    pub fn with_checkpoints_per_step(self, n: u32) -> Result<StatePolicy, Error> {
        let StatePolicy::Checkpointed {
            interval,
            page_size,
            ..
        } = self
        else {
            return Err(Error::NotCheckpointed);
        };
        match NonZeroU32::new(n) {
            Some(per_step) if n <= MAX_CHECKPOINTS_PER_STEP => Ok(StatePolicy::Checkpointed {
                interval,
                page_size,
                per_step,
            }),
            _ => Err(Error::BadCheckpointsPerStep {
                per_step: n,
                max: MAX_CHECKPOINTS_PER_STEP,
            }),
        }
    }

    /// The checkpoint interval, `None` without a prefix cache.
    pub const fn interval(&self) -> Option<CheckpointInterval> {
        match self {
            StatePolicy::NoPrefixCache => None,
            StatePolicy::Checkpointed { interval, .. } => Some(*interval),
        }
    }

    /// States one step of one request may save (0 without a prefix cache).
    pub const fn checkpoints_per_step(&self) -> u32 {
        match self {
            StatePolicy::NoPrefixCache => 0,
            StatePolicy::Checkpointed { per_step, .. } => per_step.get(),
        }
    }

    /// The most slots a running request holds: its running state and the checkpoints it
    /// has not handed to the prefix tree yet (at most
    /// [`StatePolicy::checkpoints_per_step`]): 1, or [`BS1_SLOTS`] by default.
    pub const fn slots_per_request(&self) -> u32 {
        1 + self.checkpoints_per_step()
    }

    /// The last checkpoint-grid position at or below `len` tokens: the largest positive
    /// multiple of the interval `≤ len`. `None` below the first grid point or without a
    /// prefix cache (the empty prefix needs no saved state).
    pub const fn checkpoint_at_or_below(&self, len: usize) -> Option<usize> {
        match self.interval() {
            Some(i) if i.floor(len) > 0 => Some(i.floor(len)),
            _ => None,
        }
    }

    /// The positions whose state a step that grows a request over `grown` (its rows
    /// `old_len..new_len`) saves, appended to `out` in ascending order: each ends a page,
    /// lies in `(old_len, new_len]`, and appears once; at most
    /// [`StatePolicy::checkpoints_per_step`] of them, taken in this order of worth: the
    /// branching point, the prompt's last whole page, then grid points from the deepest
    /// down. Nothing without a prefix cache.
    pub fn plan(&self, grown: Range<usize>, marks: PlanMarks, out: &mut Vec<usize>) {
        let StatePolicy::Checkpointed {
            interval,
            page_size,
            per_step,
        } = *self
        else {
            return;
        };
        let ps = page_size.get() as usize;
        let first = out.len();
        let limit = per_step.get() as usize;
        let inside = |p: usize| p > grown.start && p <= grown.end && p > 0;
        let take = |p: usize, out: &mut Vec<usize>| {
            let p = p / ps * ps;
            if out.len() - first < limit && inside(p) && !out[first..].contains(&p) {
                out.push(p);
            }
        };
        if let Some(b) = marks.branching {
            take(b, out);
        }
        take(marks.prompt_len, out);
        let mut g = interval.floor(grown.end);
        while g > grown.start && out.len() - first < limit {
            take(g, out);
            g -= interval.get() as usize;
        }
        out[first..].sort_unstable();
    }
}

/// A checkpoint a step's forward must write: the recurrent state after the first `at_len`
/// tokens of the request (`at_len − old_len` tokens into the step's new tokens) goes into
/// the envelope of `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CheckpointWrite {
    /// The checkpoint slot to write (a slot of the request's own, written by nothing
    /// else in that step).
    pub slot: VirtualSlot,
    /// The position whose state is saved, in tokens (a page boundary).
    pub at_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ps(tokens: u32) -> PageSize {
        PageSize::new(tokens).unwrap()
    }

    fn plan(policy: StatePolicy, grown: Range<usize>, marks: PlanMarks) -> Vec<usize> {
        let mut out = vec![7]; // appended after what is there
        policy.plan(grown, marks, &mut out);
        assert_eq!(out[0], 7);
        out.split_off(1)
    }

    #[test]
    fn the_interval_must_be_a_positive_multiple_of_the_page_size() {
        assert_eq!(
            StatePolicy::checkpointed(0, ps(1)),
            Err(Error::BadInterval {
                interval: 0,
                page_size: 1
            })
        );
        assert_eq!(
            StatePolicy::checkpointed(96, ps(64)),
            Err(Error::BadInterval {
                interval: 96,
                page_size: 64
            })
        );
        // Non-power-of-two page sizes divide too.
        assert!(StatePolicy::checkpointed(300, ps(3)).is_ok());
        assert!(StatePolicy::checkpointed(DEFAULT_CHECKPOINT_INTERVAL, ps(256)).is_ok());
        assert!(StatePolicy::checkpointed(DEFAULT_CHECKPOINT_INTERVAL, ps(512)).is_err());
    }

    #[test]
    fn slots_per_request_and_the_bs1_floor_agree() {
        let policy = StatePolicy::checkpointed(256, ps(1)).unwrap();
        assert_eq!(policy.slots_per_request(), 3);
        assert_eq!(BS1_SLOTS, 3);
        assert_eq!(StatePolicy::NoPrefixCache.slots_per_request(), 1);
        let four = policy.with_checkpoints_per_step(4).unwrap();
        assert_eq!(four.slots_per_request(), 5);
        for bad in [0, MAX_CHECKPOINTS_PER_STEP + 1] {
            assert_eq!(
                policy.with_checkpoints_per_step(bad),
                Err(Error::BadCheckpointsPerStep {
                    per_step: bad,
                    max: MAX_CHECKPOINTS_PER_STEP
                })
            );
        }
        assert_eq!(
            StatePolicy::NoPrefixCache.with_checkpoints_per_step(2),
            Err(Error::NotCheckpointed)
        );
    }

    #[test]
    fn grid_queries_and_plans_without_a_prefix_cache_are_empty() {
        let p = StatePolicy::NoPrefixCache;
        assert_eq!(p.interval(), None);
        assert_eq!(p.checkpoint_at_or_below(10_000), None);
        let marks = PlanMarks {
            branching: Some(512),
            prompt_len: 1000,
        };
        assert!(plan(p, 0..10_000, marks).is_empty());
    }

    #[test]
    fn checkpoint_at_or_below_is_the_largest_positive_grid_point() {
        let p = StatePolicy::checkpointed(256, ps(16)).unwrap();
        for (len, want) in [
            (0, None),
            (255, None),
            (256, Some(256)),
            (257, Some(256)),
            (511, Some(256)),
            (512, Some(512)),
        ] {
            assert_eq!(p.checkpoint_at_or_below(len), want, "len {len}");
        }
    }

    /// One case: (page size, per step, grown, branching, prompt length, expected).
    type Case = (
        u32,
        u32,
        Range<usize>,
        Option<usize>,
        usize,
        &'static [usize],
    );

    #[test]
    fn a_plan_takes_the_branching_point_the_prompt_end_then_the_deepest_grid_points() {
        let cases: &[Case] = &[
            // A whole prompt in one step: its last page, then the deepest grid point.
            (1, 2, 0..4224, None, 4224, &[4096, 4224]),
            (256, 2, 0..4224, None, 4224, &[3840, 4096]),
            (16, 2, 0..4224, None, 4224, &[4096, 4224]),
            // The branching point comes first.
            (1, 2, 0..4224, Some(1024), 4224, &[1024, 4224]),
            (1, 1, 0..4224, Some(1024), 4224, &[1024]),
            (1, 4, 0..4224, Some(1024), 4224, &[1024, 3840, 4096, 4224]),
            // A chunk inside the prompt: grid points only, deepest first.
            (1, 2, 100..1000, None, 4224, &[512, 768]),
            (1, 2, 100..300, None, 4224, &[256]),
            (1, 2, 100..200, None, 4224, &[]),
            // The branching point and the prompt end only count inside the step.
            (1, 2, 2000..3000, Some(1024), 4224, &[2560, 2816]),
            (1, 2, 4200..4230, Some(1024), 4224, &[4224]),
            // A decode step crossing the grid, and one crossing nothing.
            (16, 2, 4607..4608, None, 4224, &[4608]),
            (16, 2, 4608..4609, None, 4224, &[]),
            // Positions coinciding are saved once.
            (256, 2, 0..4096, Some(4096), 4096, &[3840, 4096]),
            // An empty step saves nothing.
            (1, 2, 300..300, Some(300), 300, &[]),
        ];
        for (page, per_step, grown, branching, prompt_len, want) in cases {
            let policy = StatePolicy::checkpointed(256, ps(*page))
                .unwrap()
                .with_checkpoints_per_step(*per_step)
                .unwrap();
            let marks = PlanMarks {
                branching: *branching,
                prompt_len: *prompt_len,
            };
            assert_eq!(
                plan(policy, grown.clone(), marks),
                *want,
                "ps {page} per step {per_step} grown {grown:?} branching {branching:?}"
            );
        }
    }

    #[test]
    fn the_branching_point_and_the_prompts_last_page_and_beyond_are_anchors() {
        let marks = PlanMarks {
            branching: Some(300),
            prompt_len: 1_000,
        };
        // Page size 256: branching 300 → 256, the prompt's last whole page ends at 768.
        for (at, anchor) in [
            (256, true),
            (512, false),
            (768, true),
            (1_024, true),
            (0, false),
        ] {
            assert_eq!(marks.anchors(at, 256), anchor, "at {at}");
        }
        // Page size 1: the marks are exact.
        assert!(marks.anchors(300, 1) && marks.anchors(1_000, 1) && marks.anchors(1_200, 1));
        assert!(!marks.anchors(256, 1) && !marks.anchors(999, 1));
        let none = PlanMarks {
            branching: None,
            prompt_len: 1_000,
        };
        assert!(!none.anchors(256, 256) && none.anchors(768, 256));
        // A zero page size counts as one, never a division by zero.
        assert!(none.anchors(1_000, 0) && !none.anchors(999, 0));
    }
}

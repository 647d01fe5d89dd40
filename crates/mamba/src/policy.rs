//! When a request's recurrent state is checkpointed: the policy (how many slots a request
//! holds, where the checkpoint grid lies) and the per-request ping-pong tracker.
//!
//! A recurrent state summarises a whole prefix and cannot be cut back like KV rows, so a
//! prefix hit can only resume from a state saved at exactly the hit's length. The
//! reference engine saves one on a fixed grid of `mamba_track_interval` tokens while a
//! request runs, into two "ping-pong" track slots beside its running slot (SGLang
//! `HybridReqToTokenPool`: `mamba_ping_pong_track_buffer_size` track slots per request,
//! `mamba_next_track_idx` choosing the one to write, `get_mamba_ping_pong_other_idx` the
//! one holding the last saved state), so a request holds 3 slots with the prefix cache on.

use std::num::NonZeroU32;

use unikv_pools::{PageSize, VirtualSlot};

use crate::error::Error;

/// The reference engine's checkpoint interval in tokens: SGLang
/// `python/sglang/srt/server_args.py`, `ServerArgs.mamba_track_interval: int = 256`
/// (`--mamba-track-interval`), which it requires to be divisible by `page_size` and at
/// least `speculative_num_draft_tokens` when the extra-buffer (checkpointing) strategy is
/// on.
pub const DEFAULT_CHECKPOINT_INTERVAL: u32 = 256;

/// Slots one request holds at batch size 1 with the prefix cache on, which the
/// batch-size-1 floor charges (3 slots + sink): the running state and two checkpoints.
/// The pools' own constant, so the floor and the policy cannot disagree.
pub const BS1_SLOTS: u32 = unikv_pools::BS1_STATE_SLOTS;

// The floor charges what a checkpointed request holds.
const _: () = assert!(BS1_SLOTS == 1 + TRACK_SLOTS);

/// Checkpoint slots of a checkpointed request (the ping-pong pair).
const TRACK_SLOTS: u32 = 2;

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
/// use unikv_mamba::{BS1_SLOTS, DEFAULT_CHECKPOINT_INTERVAL, StatePolicy};
/// use unikv_pools::PageSize;
///
/// let ps = PageSize::new(64).unwrap();
/// let policy = StatePolicy::checkpointed(DEFAULT_CHECKPOINT_INTERVAL, ps)?;
/// assert_eq!(policy.slots_per_request(), BS1_SLOTS);
/// assert_eq!(policy.checkpoint_at_or_below(700), Some(512));
/// assert_eq!(policy.checkpoint_at_or_below(255), None);
/// // A FULL hit of 600 tokens with a state only at 256: prefill from 256 and save the
/// // state at 512, where later requests sharing this prefix branch off.
/// assert_eq!(policy.branching_len(600, 256), Some(512));
/// assert_eq!(policy.branching_len(600, 512), None);
/// assert_eq!(StatePolicy::NoPrefixCache.slots_per_request(), 1);
/// assert!(StatePolicy::checkpointed(100, ps).is_err());
/// # Ok::<(), unikv_mamba::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatePolicy {
    /// No prefix cache: a request holds its running state only; nothing is saved.
    NoPrefixCache,
    /// Prefix cache on: the state is saved at every multiple of `interval` tokens into
    /// the request's two checkpoint slots ([`CheckpointTrack`]).
    Checkpointed {
        /// Tokens between checkpoints.
        interval: CheckpointInterval,
    },
}

impl StatePolicy {
    /// Checkpoints every `interval` tokens for pages of `page_size`; [`Error::BadInterval`]
    /// unless `interval` is a positive multiple of the page size.
    pub const fn checkpointed(interval: u32, page_size: PageSize) -> Result<StatePolicy, Error> {
        match CheckpointInterval::new(interval, page_size) {
            Ok(interval) => Ok(StatePolicy::Checkpointed { interval }),
            Err(e) => Err(e),
        }
    }

    /// The checkpoint interval, `None` without a prefix cache.
    pub const fn interval(&self) -> Option<CheckpointInterval> {
        match self {
            StatePolicy::NoPrefixCache => None,
            StatePolicy::Checkpointed { interval } => Some(*interval),
        }
    }

    /// Slots a running request holds: 1 (its running state), or 3 with checkpoints (the
    /// running state and two ping-pong checkpoints, [`BS1_SLOTS`]).
    pub const fn slots_per_request(&self) -> u32 {
        match self {
            StatePolicy::NoPrefixCache => 1,
            StatePolicy::Checkpointed { .. } => 1 + TRACK_SLOTS,
        }
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

    /// Where a request should save a state for future branching: its FULL (KV) hit of
    /// `full_hit` tokens aligned down to the grid, when that lies beyond `matched`, the
    /// length its state-valid match resumes from. The request then prefills from
    /// `matched` and saves the state at the returned length, so the next request sharing
    /// the prefix matches its state there. `None` when the grid point is not beyond the
    /// match (nothing to gain) or without a prefix cache.
    pub const fn branching_len(&self, full_hit: usize, matched: usize) -> Option<usize> {
        match self.checkpoint_at_or_below(full_hit) {
            Some(b) if b > matched => Some(b),
            _ => None,
        }
    }
}

/// A checkpoint a step's forward must write: the recurrent state after the first `at_len`
/// tokens of the request (`at_len − old_len` tokens into the step's new tokens) goes into
/// the envelope of `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CheckpointWrite {
    /// The checkpoint slot to write (never the one holding the latest checkpoint).
    pub slot: VirtualSlot,
    /// The grid position whose state is saved, in tokens.
    pub at_len: usize,
}

/// Which of a request's two checkpoint slots holds its latest checkpoint, and at what
/// length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Latest {
    index: usize,
    len: usize,
}

/// One request's checkpoint tracker over its two checkpoint slots (ping-pong): it says,
/// step by step, which grid position to save and where, such that the latest completed
/// checkpoint is never overwritten by the write in flight.
///
/// # How an engine uses it
///
/// 1. **Admission.** Under [`StatePolicy::Checkpointed`] the request gets
///    [`StatePolicy::slots_per_request`] = 3 slots from the pools' slot allocator: one
///    running slot and two checkpoint slots. On a prefix hit whose state matched `m`
///    tokens, the matched node's state is copied into the running slot and the tracker
///    starts at `m` ([`CheckpointTrack::new`]`(policy, [c0, c1], m)`; 0 without a hit).
///    Grid points at or below `m` are never saved again: the tree holds them. When
///    [`StatePolicy::branching_len`] gives `Some(b)`, the first prefill chunk ends at `b`,
///    so that step saves the state at `b`.
/// 2. **Every forward step** that takes the request from `old_len` to `new_len` tokens
///    calls [`CheckpointTrack::advance`]`(old_len, new_len)` while the step is planned. On
///    `Some(CheckpointWrite { slot, at_len })` the step's batch tells the kernel to write
///    the state after `at_len` tokens into `slot` during that forward (the reference
///    engine's `mamba_track_indices` / `mamba_track_seqlens`), beside the usual update of
///    the running slot; only the last grid point a step crosses is saved. No host sync:
///    the tracker is host bookkeeping and the write is part of the launch.
/// 3. **After that step completes**, [`CheckpointTrack::latest`] is the saved state. To
///    cache the prefix (a chunk's end, the request's end), the engine inserts
///    `latest = (slot, len)` into the prefix tree at `len` tokens. A request that goes on
///    running hands the slot to the tree with [`CheckpointTrack::take_latest`] and a fresh
///    slot; a finished one frees its running slot and the checkpoint slot it did not hand
///    over.
///
/// The tracker records a write as the latest as soon as `advance` returns it; the engine
/// reads `latest` only between steps, when that write has completed.
///
/// # Example
///
/// ```
/// use unikv_mamba::{CheckpointTrack, CheckpointWrite, StatePolicy};
/// use unikv_pools::{PageSize, VirtualSlot};
///
/// let policy = StatePolicy::checkpointed(256, PageSize::new(16).unwrap())?;
/// let (a, b) = (VirtualSlot(7), VirtualSlot(9));
/// let mut track = CheckpointTrack::new(policy, [a, b], 0)?;
/// // A 600-token prefill crosses 256 and 512: only 512 is saved.
/// assert_eq!(
///     track.advance(0, 600)?,
///     Some(CheckpointWrite { slot: a, at_len: 512 })
/// );
/// assert_eq!(track.latest(), Some((a, 512)));
/// // Decoding to 767 crosses nothing; to 768 writes the other slot, keeping 512 intact.
/// assert_eq!(track.advance(600, 767)?, None);
/// assert_eq!(
///     track.advance(767, 768)?,
///     Some(CheckpointWrite { slot: b, at_len: 768 })
/// );
/// assert_eq!(track.latest(), Some((b, 768)));
/// # Ok::<(), unikv_mamba::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointTrack {
    interval: CheckpointInterval,
    slots: [VirtualSlot; 2],
    len: usize,
    latest: Option<Latest>,
}

impl CheckpointTrack {
    /// A tracker over the checkpoint slots `slots` for a request whose state is at
    /// `start_len` tokens (its state-valid prefix match, 0 without one); no checkpoint is
    /// held yet. [`Error::NotCheckpointed`] under [`StatePolicy::NoPrefixCache`],
    /// [`Error::SameSlots`] when the two slots are one.
    pub fn new(
        policy: StatePolicy,
        slots: [VirtualSlot; 2],
        start_len: usize,
    ) -> Result<CheckpointTrack, Error> {
        let interval = policy.interval().ok_or(Error::NotCheckpointed)?;
        if slots[0] == slots[1] {
            return Err(Error::SameSlots { slot: slots[0].0 });
        }
        Ok(CheckpointTrack {
            interval,
            slots,
            len: start_len,
            latest: None,
        })
    }

    /// The request grew from `old_len` to `new_len` tokens in one step. When it crossed
    /// one or more grid points in `(old_len, new_len]`, returns the write of the last of
    /// them, into the checkpoint slot that does not hold the latest checkpoint, and
    /// records it as the latest. Fails, changing nothing, with [`Error::OutOfStep`] when
    /// the tracker is not at `old_len` and [`Error::Shrink`] when `new_len < old_len`.
    pub fn advance(
        &mut self,
        old_len: usize,
        new_len: usize,
    ) -> Result<Option<CheckpointWrite>, Error> {
        if old_len != self.len {
            return Err(Error::OutOfStep {
                at: self.len,
                old_len,
            });
        }
        if new_len < old_len {
            return Err(Error::Shrink { old_len, new_len });
        }
        self.len = new_len;
        let at_len = self.interval.floor(new_len);
        if at_len <= old_len {
            return Ok(None);
        }
        let index = match self.latest {
            Some(l) => 1 - l.index,
            None => 0,
        };
        self.latest = Some(Latest { index, len: at_len });
        Ok(Some(CheckpointWrite {
            slot: self.slots[index],
            at_len,
        }))
    }

    /// The latest checkpoint: its slot and its length in tokens, the largest grid point
    /// crossed since the tracker started (or since [`CheckpointTrack::take_latest`]).
    pub fn latest(&self) -> Option<(VirtualSlot, usize)> {
        self.latest.map(|l| (self.slots[l.index], l.len))
    }

    /// The two checkpoint slots.
    pub const fn slots(&self) -> [VirtualSlot; 2] {
        self.slots
    }

    /// The request's length the tracker is at, in tokens.
    pub const fn request_len(&self) -> usize {
        self.len
    }

    /// The checkpoint interval.
    pub const fn interval(&self) -> CheckpointInterval {
        self.interval
    }

    /// Hands the latest checkpoint's slot out (for the prefix tree to keep) and puts
    /// `fresh` in its place; the tracker then holds no checkpoint. `Ok(None)` and no
    /// change (the caller keeps `fresh`) when it holds none. [`Error::SameSlots`], no
    /// change, when `fresh` is the other checkpoint slot.
    pub fn take_latest(
        &mut self,
        fresh: VirtualSlot,
    ) -> Result<Option<(VirtualSlot, usize)>, Error> {
        let Some(l) = self.latest else {
            return Ok(None);
        };
        if fresh == self.slots[1 - l.index] {
            return Err(Error::SameSlots { slot: fresh.0 });
        }
        let taken = std::mem::replace(&mut self.slots[l.index], fresh);
        self.latest = None;
        Ok(Some((taken, l.len)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ps(tokens: u32) -> PageSize {
        PageSize::new(tokens).unwrap()
    }

    fn track(interval: u32, start: usize) -> CheckpointTrack {
        let policy = StatePolicy::checkpointed(interval, ps(1)).unwrap();
        CheckpointTrack::new(policy, [VirtualSlot(1), VirtualSlot(2)], start).unwrap()
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
        assert!(StatePolicy::NoPrefixCache.slots_per_request() <= BS1_SLOTS);
    }

    #[test]
    fn grid_queries_without_a_prefix_cache_are_none() {
        let p = StatePolicy::NoPrefixCache;
        assert_eq!(p.interval(), None);
        assert_eq!(p.checkpoint_at_or_below(10_000), None);
        assert_eq!(p.branching_len(10_000, 0), None);
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
        // Branching only past the state-valid match.
        assert_eq!(p.branching_len(1000, 0), Some(768));
        assert_eq!(p.branching_len(1000, 767), Some(768));
        assert_eq!(p.branching_len(1000, 768), None);
        assert_eq!(p.branching_len(255, 0), None);
    }

    #[test]
    fn a_tracker_needs_checkpoints_and_two_distinct_slots() {
        assert_eq!(
            CheckpointTrack::new(
                StatePolicy::NoPrefixCache,
                [VirtualSlot(1), VirtualSlot(2)],
                0
            ),
            Err(Error::NotCheckpointed)
        );
        let policy = StatePolicy::checkpointed(8, ps(8)).unwrap();
        assert_eq!(
            CheckpointTrack::new(policy, [VirtualSlot(5), VirtualSlot(5)], 0),
            Err(Error::SameSlots { slot: 5 })
        );
    }

    #[test]
    fn writes_alternate_and_never_hit_the_latest() {
        let mut t = track(4, 0);
        let [a, b] = t.slots();
        assert_eq!(t.advance(0, 3).unwrap(), None);
        assert_eq!(t.latest(), None);
        let w = |slot, at_len| Some(CheckpointWrite { slot, at_len });
        assert_eq!(t.advance(3, 4).unwrap(), w(a, 4));
        assert_eq!(t.advance(4, 5).unwrap(), None);
        assert_eq!(t.latest(), Some((a, 4)));
        // Crossing 8, 12 and 16 at once saves 16 only.
        assert_eq!(t.advance(5, 17).unwrap(), w(b, 16));
        assert_eq!(t.advance(17, 20).unwrap(), w(a, 20));
        assert_eq!(t.latest(), Some((a, 20)));
        assert_eq!(t.request_len(), 20);
        // An empty step crosses nothing.
        assert_eq!(t.advance(20, 20).unwrap(), None);
    }

    #[test]
    fn a_resumed_track_does_not_save_the_matched_grid_point_again() {
        let mut t = track(4, 8);
        assert_eq!(t.advance(8, 11).unwrap(), None);
        assert_eq!(t.latest(), None);
        assert_eq!(
            t.advance(11, 12).unwrap(),
            Some(CheckpointWrite {
                slot: VirtualSlot(1),
                at_len: 12
            })
        );
    }

    #[test]
    fn misuse_is_refused_without_change() {
        let mut t = track(4, 0);
        t.advance(0, 5).unwrap();
        let before = t.clone();
        assert_eq!(t.advance(4, 9), Err(Error::OutOfStep { at: 5, old_len: 4 }));
        assert_eq!(
            t.advance(5, 3),
            Err(Error::Shrink {
                old_len: 5,
                new_len: 3
            })
        );
        // The other checkpoint slot cannot replace the latest.
        assert_eq!(
            t.take_latest(VirtualSlot(2)),
            Err(Error::SameSlots { slot: 2 })
        );
        assert_eq!(t, before);
    }

    #[test]
    fn take_latest_hands_the_slot_over_and_puts_a_fresh_one_in() {
        let mut t = track(4, 0);
        assert_eq!(t.take_latest(VirtualSlot(30)).unwrap(), None);
        assert_eq!(t.slots(), [VirtualSlot(1), VirtualSlot(2)]);
        t.advance(0, 4).unwrap();
        t.advance(4, 9).unwrap();
        assert_eq!(t.latest(), Some((VirtualSlot(2), 8)));
        assert_eq!(
            t.take_latest(VirtualSlot(30)).unwrap(),
            Some((VirtualSlot(2), 8))
        );
        assert_eq!(t.slots(), [VirtualSlot(1), VirtualSlot(30)]);
        assert_eq!(t.latest(), None);
        // The next write may go to either slot: none holds a checkpoint now.
        let w = t.advance(9, 12).unwrap().unwrap();
        assert_eq!(w.at_len, 12);
        assert_eq!(t.latest(), Some((w.slot, 12)));
    }
}

//! Speculative decoding's vocabulary: what a cache is built to verify
//! ([`Speculation`]), the draft a verify step checks ([`Draft`]: a chain of `k` tokens
//! or a tree with a parent array), and what the target model accepted ([`Accepted`]).
//!
//! A verify step gives each request the rows of every position it verifies
//! ([`crate::HybridCache::alloc_verify`]); the accepted counts are device values, and the
//! host learns them when it learns them (one step late under an overlap scheduler), so
//! nothing waits for them: [`crate::HybridCache::settle`] applies them whenever they
//! arrive, oldest verify first.
//!
//! # Where the parts live
//! | part | file |
//! |---|---|
//! | the vocabulary ([`Speculation`], [`Draft`], [`Accepted`]) | `speculative.rs` (here) |
//! | `alloc_verify`, `settle` | `cache/speculative.rs` |
//! | the scratch lanes a verify writes its states or logs into | `cache/scratch.rs` |
//! | the replay rollback ([`StateReplay`], [`StateCommit`]) | `speculative.rs` (here), `cache/speculative.rs` |
//! | verify metadata and `compact_accepted` | `verify.rs` |
//!
//! # What holds
//! - A bad setting is refused at build (`a_bad_speculation_setting_is_refused_at_build`).
//! - Draft tokens never enter the tree; a request with an unsettled verify refuses a
//!   plain decode or prefill ([`crate::Error::Unsettled`]), and every bad draft or
//!   settlement is a typed error that changes nothing
//!   (`bad_settlements_and_drafts_are_typed_errors_that_change_nothing`; random
//!   lifecycles with every byte checked in tests/speculative_proptest.rs).
//! - Admission prices what a verifying request transiently holds: the rows of
//!   `max_width × max_in_flight` positions and the scratch its verifies need where the
//!   cache has made none to spare
//!   (`admission_prices_the_verify_rows_and_scratch_of_a_running_request`).
//! - The draft model's KV shares the FULL envelope
//!   ([`ModelSpec::draft_layers`](crate::ModelSpec::draft_layers): FULL layers past the
//!   target's).
//! - The tiny engine's `--spec` (tests/tiny_engine_spec.rs) drafts with the target's
//!   first layer, verifies chains and a tree through the verify metadata with counts
//!   settled at once and one step late, and its outputs equal the plain greedy decode bit
//!   for bit, with reuse off and on; every state a request resumes from equals a
//!   contiguous recompute of its prefix
//!   (`speculative_turns_on_full_swa_match_plain_decoding_with_reuse_off_and_on`,
//!   `speculative_turns_on_the_tri_pool_resume_exact_states`,
//!   `a_flipped_bit_in_a_state_resumed_after_a_speculative_turn_fails_the_state_check`).

use crate::error::{AcceptedFault, Error};
use unikv_pools::VirtualSlot;
use unikv_radix::TokenId;

/// The most positions [`Speculation::max_width`] may declare: EAGLE-2/3 trees verify up
/// to 64 nodes (SGLang's `speculative_num_draft_tokens` defaults stay far below).
pub const MAX_VERIFY_WIDTH: u32 = 64;

/// The most verify steps of one request that may be unsettled at once
/// ([`Speculation::max_in_flight`]): an overlap scheduler learns a step's counts one step
/// late, so two are in flight (the verify metadata's device offsets name one earlier
/// verify).
pub const MAX_IN_FLIGHT: u32 = 2;

/// The verify batch [`Speculation::chain`] and [`Speculation::tree`] declare
/// ([`Speculation::max_batch`]): a CUDA graph's batch for a verify step is typically
/// this order (SGLang caps its running requests at 48 when it speculates).
pub const DEFAULT_VERIFY_BATCH: u32 = 8;

/// The most requests [`Speculation::max_batch`] may declare.
pub const MAX_VERIFY_BATCH: u32 = 4096;

/// What a cache is built to verify ([`crate::HybridCacheBuilder::speculation`]).
///
/// On a model with recurrent layers a verify writes one entry per position into a
/// **scratch lane**, which the request holds only while the verify is unsettled: lanes
/// are the cache's, never in the prefix tree, reused across requests (up to `max_batch
/// × max_in_flight` of them are kept once made). Under the copy rollback (the default)
/// an entry is the state after the position, a whole slot, and settling *copies* the
/// accepted position's state into the request's own running slot (one device copy, with
/// the checkpoints the accepted positions cross); under a [`StateReplay`] an entry is
/// the position's log, many to a slot, and settling hands the engine the accepted
/// entries to replay. So draft positions never take the room of cached states (the
/// static layout sizes its slot pool for `max_batch × max_in_flight` lanes beyond the
/// reference pool, as SGLang allocates its `intermediate_ssm_state_cache` apart from the
/// states its prefix cache holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Positions one request verifies in one step at most: `1 + k` for a chain of `k`
    /// drafts, `n` for a draft tree of `n` nodes (1 ..= [`MAX_VERIFY_WIDTH`]).
    pub max_width: u32,
    /// Verify steps of one request that may be unsettled at once (1 ..=
    /// [`MAX_IN_FLIGHT`]): 1 when the counts arrive before the next step is allocated,
    /// 2 under an overlap scheduler.
    pub max_in_flight: u32,
    /// Requests one verify step covers at most (1 ..= [`MAX_VERIFY_BATCH`]): the scratch
    /// groups the cache keeps once made (`max_batch × max_in_flight`), and what the
    /// static layout sizes its slot pool for beyond the reference pool. A larger batch
    /// still verifies, its extra groups taken from the shared slot room and given back
    /// at the step boundary.
    pub max_batch: u32,
}

impl Speculation {
    /// Chain drafts of up to `k` tokens, counts settled before the next step.
    pub const fn chain(k: u32) -> Speculation {
        Speculation {
            max_width: k.saturating_add(1),
            max_in_flight: 1,
            max_batch: DEFAULT_VERIFY_BATCH,
        }
    }

    /// Draft trees of up to `nodes` nodes, counts settled before the next step.
    pub const fn tree(nodes: u32) -> Speculation {
        Speculation {
            max_width: nodes,
            max_in_flight: 1,
            max_batch: DEFAULT_VERIFY_BATCH,
        }
    }

    /// The same with `n` verify steps of a request unsettled at once (2 for counts that
    /// arrive one step late).
    pub const fn in_flight(self, n: u32) -> Speculation {
        Speculation {
            max_in_flight: n,
            ..self
        }
    }

    /// The same for verify batches of up to `n` requests.
    pub const fn batch(self, n: u32) -> Speculation {
        Speculation {
            max_batch: n,
            ..self
        }
    }

    /// Scratch groups the cache keeps once made: `max_batch × max_in_flight` (a request
    /// with two verifies in flight holds two groups, so the newer verify reads the older
    /// one's state and writes a group of its own).
    pub const fn scratch_groups(&self) -> usize {
        self.max_batch as usize * self.max_in_flight as usize
    }

    /// Why the builder refuses it, if it does.
    pub(crate) fn check(&self) -> Result<(), String> {
        if !(1..=MAX_VERIFY_WIDTH).contains(&self.max_width) {
            return Err(format!(
                "speculation: a verify width of {} positions (1 ..= {MAX_VERIFY_WIDTH})",
                self.max_width
            ));
        }
        if !(1..=MAX_IN_FLIGHT).contains(&self.max_in_flight) {
            return Err(format!(
                "speculation: {} verify steps in flight (1 ..= {MAX_IN_FLIGHT})",
                self.max_in_flight
            ));
        }
        if !(1..=MAX_VERIFY_BATCH).contains(&self.max_batch) {
            return Err(format!(
                "speculation: a verify batch of {} requests (1 ..= {MAX_VERIFY_BATCH})",
                self.max_batch
            ));
        }
        Ok(())
    }
}

/// An engine's **replay rollback** of recurrent state
/// ([`HybridCacheBuilder::state_replay`](crate::HybridCacheBuilder::state_replay)), as
/// TensorRT-LLM's Mamba speculation rolls back (#13453): a verify writes no state; its
/// kernel logs, per position, the inputs each recurrent layer's recurrence consumes (a
/// **log entry** of [`StateReplay::log_bytes_per_position`] bytes) and keeps the
/// request's running state as it was; settling hands the engine one [`StateCommit`] per
/// request, which it replays from the running state over the accepted positions' entries,
/// saving the checkpoints on the way and the last state into the running slot. A log
/// entry is about 1/130 of a Qwen3-Next state and 1/200 of a Nemotron-H state
/// ([`unikv_mamba::RecurrentState::checked_log_bytes_per_layer`]), so many verifies' logs
/// share one state slot, where the copy rollback (the default, SGLang's
/// `intermediate_ssm_state_cache`) writes a whole state per position.
///
/// With counts a step late, the newer verify's kernel starts from the running state and
/// replays the earlier verify's accepted entries on the fly (its accepted path is a
/// device value), since that verify is not committed yet.
pub trait StateReplay: Send + Sync + std::fmt::Debug {
    /// Bytes one position's log entry holds, every recurrent layer's inputs together (at
    /// most a state slot's bytes; the builder refuses more).
    fn log_bytes_per_position(&self) -> u64;

    /// Issues each commit in stream order, without waiting for the device: from the
    /// state in `running`, the recurrence over `entries` in order; after `n` entries the
    /// state goes into each checkpoint `(n, slot)`'s slot, and after the last into
    /// `running`. Called by [`crate::HybridCache::settle`] before the host changes
    /// anything, so anything the cache issues later (a copy out of a cached state, a
    /// compaction's moves) reads the committed state. `ctx` names the buffer the slots
    /// live in and where. An error means nothing was issued.
    fn replay(
        &self,
        ctx: &ReplayContext<'_>,
        commits: &[StateCommit<'_>],
    ) -> Result<(), unikv_kernels::Error>;

    /// Whether it moves bytes (every engine's does; [`BookkeepingReplay`] does not, and
    /// the builder allows it only on a device without bytes).
    fn moves_bytes(&self) -> bool {
        true
    }
}

/// Where a replay's slots live: the cache's device and buffer, a physical slot `p` at
/// `p × slot_bytes` ([`ReplayContext::slot_offset`], as
/// [`KvGeometry::slot_offset`](crate::KvGeometry::slot_offset) places it) and a log entry
/// `index × log_bytes` past its slot's start ([`ReplayContext::entry_offset`]).
#[derive(Clone, Copy, Debug)]
pub struct ReplayContext<'a> {
    /// The device the buffer lives on (issue the replay on its stream).
    pub device: &'a dyn unikv_kernels::Device,
    /// The cache's buffer.
    pub buffer: unikv_kernels::BytesId,
    /// Bytes of one state slot.
    pub slot_bytes: u64,
    /// Bytes of one log entry ([`StateReplay::log_bytes_per_position`]).
    pub log_bytes: u64,
}

impl ReplayContext<'_> {
    /// The byte offset of physical state slot `slot` in the buffer.
    pub fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes
    }

    /// The byte offset of log entry `entry` in the buffer.
    pub fn entry_offset(&self, entry: LogEntry) -> u64 {
        self.slot_offset(entry.slot) + u64::from(entry.index) * self.log_bytes
    }
}

/// Where one position's log entry lives: entry `index` (of
/// [`StateReplay::log_bytes_per_position`] bytes) of the physical state slot `slot`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LogEntry {
    /// Physical state slot (what [`crate::KvGeometry::slot_offset`] places).
    pub slot: u32,
    /// The entry within the slot: its bytes start `index × log_bytes_per_position` past
    /// the slot's.
    pub index: u32,
}

/// One request's settlement under replay rollback (see [`StateReplay::replay`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateCommit<'a> {
    /// The request.
    pub request: u64,
    /// Physical slot of its running state: the state at its settled length before, at the
    /// new settled length after.
    pub running: u32,
    /// The accepted positions' log entries, in accepted order (a tree's along its path).
    pub entries: &'a [LogEntry],
    /// `(n, slot)`: the state after the first `n` entries is saved into physical slot
    /// `slot` (1 ≤ `n` ≤ `entries.len()`, ascending).
    pub checkpoints: &'a [(u32, u32)],
}

impl StateCommit<'_> {
    /// Each slot the replay writes, with the entry whose position its state is at: every
    /// checkpoint's, then the running slot's (for a replay whose state after a position
    /// depends on that position's entry alone, as the simulators' stand-ins).
    pub fn saves(&self) -> impl Iterator<Item = (LogEntry, u32)> + '_ {
        self.checkpoints
            .iter()
            .copied()
            .chain(std::iter::once((self.entries.len() as u32, self.running)))
            .filter_map(|(n, slot)| {
                let entry = self.entries.get((n as usize).checked_sub(1)?)?;
                Some((*entry, slot))
            })
    }
}

/// A [`StateReplay`] that moves nothing, for a cache whose device holds no bytes (the
/// replay simulator's [`NullDevice`](unikv_kernels::NullDevice)): the accounting of
/// replay rollback without data. The builder refuses it on a device with bytes, where it
/// would leave every running state stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BookkeepingReplay {
    /// The log entry's bytes to price (e.g. the model's
    /// [`ModelSpec::replay_log_bytes`](crate::ModelSpec::replay_log_bytes)).
    pub log_bytes_per_position: u64,
}

impl StateReplay for BookkeepingReplay {
    fn log_bytes_per_position(&self) -> u64 {
        self.log_bytes_per_position
    }

    fn replay(
        &self,
        _: &ReplayContext<'_>,
        _: &[StateCommit<'_>],
    ) -> Result<(), unikv_kernels::Error> {
        Ok(())
    }

    fn moves_bytes(&self) -> bool {
        false
    }
}

/// How verify lanes sit in state slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchShape {
    /// Entries a lane holds: the verify width.
    pub width: u32,
    /// Entries one state slot holds: 1 under the copy rollback (an entry is a state), the
    /// slot's bytes over a log entry's under the replay rollback.
    pub entries_per_slot: u32,
}

impl ScratchShape {
    /// The copy rollback's shape for `width` positions: one state per slot.
    pub const fn copy(width: u32) -> ScratchShape {
        ScratchShape {
            width,
            entries_per_slot: 1,
        }
    }

    /// The replay rollback's shape for `width` positions: as many log entries of
    /// `log_bytes` per slot of `slot_bytes` as fit (`None` for an entry of 0 bytes or
    /// larger than a slot).
    pub fn replaying(width: u32, slot_bytes: u64, log_bytes: u64) -> Option<ScratchShape> {
        if log_bytes == 0 || log_bytes > slot_bytes {
            return None;
        }
        Some(ScratchShape {
            width,
            entries_per_slot: u32::try_from(slot_bytes / log_bytes).unwrap_or(u32::MAX),
        })
    }

    /// Lanes one block holds: as many as fit in one slot, or 1 when a lane spans slots.
    pub const fn lanes_per_block(&self) -> u32 {
        if self.entries_per_slot >= self.width {
            self.entries_per_slot / self.width
        } else {
            1
        }
    }

    /// Slots one block takes.
    pub const fn slots_per_block(&self) -> u32 {
        if self.entries_per_slot >= self.width {
            1
        } else {
            self.width.div_ceil(self.entries_per_slot)
        }
    }

    /// State slots that hold `lanes` lanes.
    pub const fn slots_for(&self, lanes: u32) -> u32 {
        lanes
            .div_ceil(self.lanes_per_block())
            .saturating_mul(self.slots_per_block())
    }
}

/// A verify's lane: `width` entries from entry `first` of its block's slots (entry `g`
/// is entry `g % entries_per_slot` of slot `g / entries_per_slot`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ScratchLane {
    /// The block's slots (empty: no lane, a model without recurrent layers).
    pub(crate) slots: Box<[VirtualSlot]>,
    /// Its first entry in the block.
    pub(crate) first: u32,
    /// The block it belongs to (an index into the scratch's blocks).
    pub(crate) block: usize,
}

impl ScratchLane {
    /// Whether it is no lane.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The slot and the entry within it of position `i` of the lane.
    pub(crate) fn entry(&self, shape: ScratchShape, i: usize) -> (VirtualSlot, u32) {
        let g = self.first as usize + i;
        let per = shape.entries_per_slot as usize;
        (self.slots[g / per], (g % per) as u32)
    }
}

/// The draft one request verifies in one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Draft<'a> {
    /// A chain (EAGLE, MTP, DSPARK): the request's next token and `k` drafted after it,
    /// `1 + k` positions in row order.
    Chain {
        /// Drafted tokens.
        k: usize,
    },
    /// A draft tree (EAGLE-2/3 top-k trees) of `parents.len()` nodes in row order:
    /// node 0 is the request's next token (`parents[0] == -1`) and every other node's
    /// parent comes before it (`0 <= parents[i] < i`).
    Tree {
        /// Each node's parent (`-1` for the root).
        parents: &'a [i32],
    },
}

impl Draft<'_> {
    /// Positions the request verifies: `1 + k`, or the tree's nodes.
    pub fn width(&self) -> usize {
        match self {
            Draft::Chain { k } => k.saturating_add(1),
            Draft::Tree { parents } => parents.len(),
        }
    }

    /// The first node of a tree whose parent breaks the rule — the root's (node 0) is
    /// −1, every other node's an earlier node — with that parent; `None` for a chain or a
    /// well-formed tree.
    pub fn bad_parent(&self) -> Option<(usize, i32)> {
        let Draft::Tree { parents } = self else {
            return None;
        };
        parents.iter().copied().enumerate().find(|&(node, parent)| {
            if node == 0 {
                parent != -1
            } else {
                !(0..node as i64).contains(&i64::from(parent))
            }
        })
    }

    /// [`Error::BadDraftTree`] unless a tree's parent array is one (a chain always is).
    pub(crate) fn check(&self, request: u64) -> Result<(), Error> {
        match self.bad_parent() {
            Some((node, parent)) => Err(Error::BadDraftTree {
                request,
                node,
                parent,
            }),
            None => Ok(()),
        }
    }

    /// The parent array a verify keeps to check the accepted path (`None` for a chain,
    /// whose accepted positions are a prefix).
    pub(crate) fn tree(&self) -> Option<Box<[i32]>> {
        match self {
            Draft::Chain { .. } => None,
            Draft::Tree { parents } => Some((*parents).into()),
        }
    }
}

/// What the target model accepted of one verify step, in accepted order: for a chain,
/// the first `tokens.len()` positions (the request's next token, then the accepted
/// drafts); for a tree, the nodes of `path`, a root-to-node path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted<'a> {
    pub(crate) tokens: &'a [TokenId],
    pub(crate) path: Option<&'a [u32]>,
}

impl<'a> Accepted<'a> {
    /// A chain verify's accepted tokens (1 ..= `1 + k` of them: its first position is
    /// always kept).
    pub fn chain(tokens: &'a [TokenId]) -> Accepted<'a> {
        Accepted { tokens, path: None }
    }

    /// A tree verify's accepted path (node 0 first, each next node a child of the one
    /// before) and the tokens of those nodes.
    pub fn tree(path: &'a [u32], tokens: &'a [TokenId]) -> Accepted<'a> {
        Accepted {
            tokens,
            path: Some(path),
        }
    }

    /// Positions accepted.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether nothing was accepted (never valid: a verify keeps its first position).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The verify position whose row (and state) the `i`-th accepted token has.
    pub(crate) fn node(&self, i: usize) -> usize {
        self.path.map_or(i, |p| p[i] as usize)
    }
}

/// One verify step of a request that is not settled yet.
#[derive(Clone, Debug)]
pub(crate) struct PendingVerify {
    /// Positions it verifies (rows it reserved).
    pub(crate) width: usize,
    /// A tree's parent array.
    pub(crate) parents: Option<Box<[i32]>>,
    /// On a model with recurrent layers, the scratch lane it writes (position `i`'s
    /// entry: the state after it, or its log entry under replay rollback); empty
    /// otherwise.
    pub(crate) lane: ScratchLane,
}

impl PendingVerify {
    /// [`Error::BadAccepted`] unless `accepted` fits this verify: 1 ..= width positions,
    /// a chain's without a path, a tree's a root-to-node path with one token per node.
    pub(crate) fn check(&self, request: u64, accepted: &Accepted<'_>) -> Result<(), Error> {
        let bad = |reason: AcceptedFault| {
            Err(Error::BadAccepted {
                request,
                accepted: accepted.len(),
                width: self.width,
                reason,
            })
        };
        if accepted.is_empty() || accepted.len() > self.width {
            return bad(AcceptedFault::Count);
        }
        match (&self.parents, accepted.path) {
            (None, None) => Ok(()),
            (None, Some(_)) => bad(AcceptedFault::PathForChain),
            (Some(_), None) => bad(AcceptedFault::NoPath),
            (Some(parents), Some(path)) => {
                if path.len() != accepted.len() {
                    return bad(AcceptedFault::PathLength { path: path.len() });
                }
                let mut prev = -1;
                for (index, &node) in path.iter().enumerate() {
                    let parent = parents.get(node as usize).copied();
                    if parent != Some(prev) {
                        return bad(AcceptedFault::NotAPath { index, node });
                    }
                    prev = node as i32;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_saves_each_checkpoint_then_the_running_slot_from_the_entry_at_its_position() {
        let entries: Vec<LogEntry> = (0..4).map(|i| LogEntry { slot: 9, index: i }).collect();
        let commit = StateCommit {
            request: 1,
            running: 70,
            entries: &entries,
            checkpoints: &[(1, 50), (3, 51)],
        };
        let saves: Vec<(LogEntry, u32)> = commit.saves().collect();
        assert_eq!(
            saves,
            [(entries[0], 50), (entries[2], 51), (entries[3], 70)]
        );
        // Nothing accepted: nothing to save (the running slot already holds its state).
        let none = StateCommit {
            entries: &[],
            checkpoints: &[],
            ..commit
        };
        assert_eq!(none.saves().count(), 0);
    }

    #[test]
    fn a_log_entry_as_large_as_a_slot_fits_one_to_a_slot_and_a_larger_one_none() {
        assert_eq!(
            ScratchShape::replaying(5, 100, 100),
            Some(ScratchShape {
                width: 5,
                entries_per_slot: 1
            })
        );
        assert_eq!(ScratchShape::replaying(5, 100, 101), None);
        assert_eq!(ScratchShape::replaying(5, 100, 0), None);
        assert_eq!(
            ScratchShape::replaying(5, 100, 30)
                .unwrap()
                .entries_per_slot,
            3
        );
    }
}

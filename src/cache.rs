//! `HybridCache`: the allocator and the prefix tree behind one API that owns a request's
//! lifecycle, applies the tree's actions in one place and runs the eviction loop.
//!
//! Its methods live with the part of the lifecycle they serve:
//!
//! | part | methods | file |
//! |---|---|---|
//! | set-up | `builder`, [`HybridCacheBuilder::build`] | `cache/builder.rs` |
//! | admission | `match_prefix`, `can_admit`, `admit` | `cache.rs` |
//! | allocation | `alloc_extend`, `alloc_decode` | `cache.rs` |
//! | the sliding window | `release_out_of_window` (and the batch form the allocations call) | `cache/window.rs` |
//! | checkpoints | planned inside allocations and settlements | `cache/checkpoints.rs` |
//! | eviction | `evict_to_free`, `evict_all`, the loop that makes room | `cache/evict.rs` |
//! | speculative decoding | `alloc_verify`, `settle` (verify scratch: `cache/scratch.rs`) | `cache/speculative.rs` |
//! | finishing | `cache_unfinished`, `cache_finished`, `release` | `cache.rs` |
//! | the step boundary | `step_boundary`, `stats` | `cache.rs` |
//! | step metadata | `reserve_step_metadata`, `build_step_metadata`, `step_view`, `kv_geometry` | `step.rs` |
//! | verify metadata | `reserve_verify_metadata`, `build_verify_metadata`, `translate_verify`, `compact_accepted` | `verify.rs` |
//! | zero-copy readers of the tables | `export_table`, `make_stream_wait`, `device_arc` | `cache.rs` |
//!
//! The device tables the last two fill are owned here and kept in `tables.rs`, a leaf.
//!
//! # Sizes and refusals
//! Every size a caller passes is checked without arithmetic that can wrap, and a page
//! demand beyond a side's total is refused before the allocator or the eviction loop
//! sees it: [`HybridCache::can_admit`] says `false`, the allocations return
//! [`Error::OutOfMemory`] and nothing is evicted
//! (`a_demand_beyond_every_page_is_out_of_memory_and_evicts_nothing`,
//! `alloc_extend_past_usize_max_is_a_bad_request_and_changes_nothing`); the builder
//! refuses a model whose page bytes overflow 64 bits
//! (`a_model_whose_page_bytes_overflow_64_bits_is_a_config_error`).
//!
//! # The step boundary
//! [`HybridCache::step_boundary`] closes the step's free group, checks conservation per
//! side (available + evictable + protected + held = total; on the Mamba side `held`
//! counts the verify scratch groups with the requests' slots), uploads the mirror, opens
//! the next group, publishes the states the step wrote, runs the tree's `sanity_check`
//! at `Strict` every [`TREE_SANITY_INTERVAL`]-th step and polls the cache's invariant
//! scope — each part whatever an earlier one returned, so an error still leaves the next
//! group open and nothing pending (`a_failed_mirror_upload_still_reopens_the_free_group`,
//! `a_failed_group_end_still_applies_the_steps_frees_and_keeps_a_group_open`,
//! `a_failed_conservation_check_leaves_nothing_pending`).
//!
//! # Recurrent state
//! For a model with recurrent layers, [`HybridCache::admit`] allocates the request's
//! running slot (the eviction loop evicts FULL donors when the bytes are short, cached
//! states last) and copies the state its match ended at into it; the allocations plan
//! the step's checkpoints (`cache/checkpoints.rs`) and take their slots in the same
//! eviction loop as the KV. [`HybridCache::cache_unfinished`] and
//! [`HybridCache::cache_finished`] insert every held checkpoint at its position (and
//! `cache_finished` the running state when its rows end a page); a state the step in
//! flight writes ends no match and cannot be evicted until the step boundary publishes
//! it (`a_state_written_in_the_current_step_is_matched_only_after_the_boundary`);
//! [`HybridCache::release`] frees them all, and `apply` frees the slots of the tree's
//! `EvictMambaState` / `FreeMambaSlot` actions. tests/recurrent_reuse.rs,
//! tests/mamba_lifecycle.rs and tests/mamba_proptest.rs hold the lifecycle
//! (`a_finished_request_caches_its_checkpoints_and_a_follow_up_copies_the_deepest`,
//! `a_slot_shortfall_with_free_slot_ids_evicts_full_donors_and_never_loops`).

use crate::error::Error;
use crate::invariants_decl::CONSERVATION;
use crate::model::ModelSpec;
use crate::request::{PrefixMatch, Request, RequestState};
use crate::speculative::ScratchShape;
use crate::stats::{CacheStats, EvictionCounts, SideStats, StepReport};
use crate::tables::{DeviceTables, Lanes};
use std::sync::Arc;
use unikv_invariants::Scope;
use unikv_kernels::{Device, TableId};
use unikv_mamba::{PlanMarks, StatePolicy};
use unikv_pools::{
    DecodeRequest, ExtendRequest, FreeOp, KvAllocator, PageDemand, Reclaimable, Side, VirtualSlot,
    VirtualToken as PoolToken,
};
use unikv_radix::{
    InsertRequest, MambaSlot, RadixTree, StateCheckpoint, StateRole, TokenId, Tokens,
    VirtualToken as TreeToken,
};

mod builder;
mod checkpoints;
mod evict;
mod host;
pub use host::HostWritePolicy;
mod scratch;
mod speculative;
mod window;

pub use builder::{
    DEFAULT_EVICTION_INTERVAL, HybridCacheBuilder, Layout, static_slot_pool, verify_scratch_slots,
};
use checkpoints::{CheckpointPlan, Checkpoints};

/// At `Strict`, the step boundary walks the whole tree ([`RadixTree::sanity_check`]) at
/// every this-many-th step (from the first): a sample that costs a few µs per step
/// amortised instead of a walk of every node at every step.
pub const TREE_SANITY_INTERVAL: u64 = 128;

/// The one object an engine holds: FULL and SWA KV and Mamba/GDN state slots of a
/// hybrid model in one allocator, a radix prefix cache over it, and every rule of a
/// request's life written once.
///
/// A scheduler step looks like this:
///
/// ```
/// use unikv::{HybridCache, Layout, ModelSpec, TokenId};
///
/// let mut cache = HybridCache::builder()
///     .model(ModelSpec::GPT_OSS_20B)
///     .page_size(16)
///     .memory_bytes(64 << 20)
///     .layout(Layout::Unified)
///     .build()?;
///
/// // Admission: match the prompt against the prefix cache, then take the hit.
/// let prompt: Vec<TokenId> = (0..300).map(TokenId).collect();
/// let hit = cache.match_prefix(prompt);
/// assert!(cache.can_admit(&hit, 16));
/// let mut req = cache.admit(hit)?;
///
/// // Prefill in two chunks, then decode; SWA that leaves the window is released on the way.
/// cache.alloc_extend(&mut req, 200)?;
/// cache.alloc_extend(&mut req, 100)?;
/// for t in 0..40 {
///     cache.alloc_decode(&mut [&mut req], &[TokenId(1000 + t)])?;
///     cache.step_boundary()?; // deferred frees, conservation, mirror upload, invariants
/// }
///
/// // Finish: the tree keeps the KV for the next request with the same prefix.
/// let conversation = req.tokens().to_vec(); // 340 tokens
/// cache.cache_finished(req)?;
/// cache.step_boundary()?;
/// // A follow-up turn reuses every whole page: a window of live SWA ends the match.
/// let again = cache.match_prefix(conversation);
/// assert_eq!(again.cached_tokens(), 336);
/// // The bare prompt does not: its SWA left the window while the request decoded, and a
/// // match may only end where a whole window of live SWA precedes it.
/// assert_eq!(cache.match_prefix((0..300).map(TokenId).collect()).cached_tokens(), 0);
/// # Ok::<(), unikv::Error>(())
/// ```
///
/// # Models with recurrent state (Mamba, Gated DeltaNet)
///
/// Each request holds its running state slot from admission to its end and, with the
/// prefix cache, the checkpoints its steps save (at most
/// [`HybridCacheBuilder::checkpoints_per_step`]; where: [`unikv_mamba::StatePolicy::plan`])
/// until the tree takes them at [`HybridCache::cache_unfinished`] or
/// [`HybridCache::cache_finished`]. A match ends only at a cached state, which admission
/// copies into the request's own running slot on the device.
///
/// ```
/// use unikv::{HybridCache, Layout, ModelSpec, TokenId};
///
/// let mut cache = HybridCache::builder()
///     .model(ModelSpec::QWEN3_NEXT_80B_A3B)
///     .page_size(64)
///     .memory_bytes(2 << 30)
///     .layout(Layout::Unified)
///     .build()?;
/// let prompt: Vec<TokenId> = (0..600).map(TokenId).collect();
/// let hit = cache.match_prefix(prompt.clone());
/// let mut req = cache.admit(hit)?;
/// assert_eq!(req.state_slots().len(), 1); // the running state
/// cache.alloc_extend(&mut req, 600)?;
/// // The engine's kernel saves the state at the deepest grid point and at the prompt's
/// // last whole page into these slots.
/// let at: Vec<usize> = req.checkpoint_writes().iter().map(|w| w.at_len).collect();
/// assert_eq!(at, [512, 576]);
/// cache.cache_finished(req)?; // both states are cached, the running slot freed
/// cache.step_boundary()?;
/// let again = cache.match_prefix(prompt);
/// assert_eq!(again.cached_tokens(), 576); // ends at the deepest cached state
/// # Ok::<(), unikv::Error>(())
/// ```
///
/// # Reading the device tables (mirror epochs)
///
/// The host tables are authoritative; the device holds a mirror of each side's `v2p`,
/// refreshed by one asynchronous upload at [`HybridCache::step_boundary`]. Within a step,
/// an allocation may compact (moving pages and rewriting the host tables) and a flush may
/// hand freed pages to another request, so the mirror can be behind. Kernel ids from the
/// device therefore come through [`HybridCache::translate`], which uploads first when the
/// mirror is behind; the allocator's own `translate` refuses with
/// `MirrorBehind` instead. A kernel that reads [`KvAllocator::mirror_table`] directly
/// must run after the step boundary's upload (while [`KvAllocator::mirror_current`]).
#[derive(Debug)]
pub struct HybridCache {
    id: u64,
    alloc: Box<dyn KvAllocator>,
    tree: RadixTree,
    /// The cache's invariant scope, shared with `alloc` and `tree`.
    scope: Scope,
    model: ModelSpec,
    layout: Layout,
    ps: usize,
    window: usize,
    interval: usize,
    next_request: u64,
    /// Bumped by every tree change, so a stale [`PrefixMatch`] is matched again.
    epoch: u64,
    step: u64,
    live_requests: usize,
    /// Pages held by live requests (their rows past the tree-owned prefix).
    held_full_pages: usize,
    held_swa_pages: usize,
    hit_tokens: u64,
    kv_hit_tokens: u64,
    admitted_prompt_tokens: u64,
    evictions: EvictionCounts,
    /// Whether the model has sliding-window layers (without, nothing is released by
    /// the window and SWA accounting is all zero).
    has_swa: bool,
    /// How requests' recurrent states are checkpointed (`None` without recurrent layers).
    states: Option<StatePolicy>,
    /// State slots held by live requests (running and checkpoints).
    held_slots: usize,
    /// Ids an allocation returned (reused across calls).
    scratch: Vec<PoolToken>,
    /// The decode batch handed to the allocator (reused across calls).
    decode_scratch: Vec<DecodeRequest>,
    /// The device the allocator's buffer lives on (for the step table).
    device: Arc<dyn Device>,
    /// Mirror uploads that carried changes: step metadata built at another generation,
    /// or while the mirror is behind, names pages that may have moved.
    mirror_generation: u64,
    /// Its device tables: step metadata, verify metadata and the requests' lanes.
    tables: DeviceTables,
    /// The checkpoint plan of an allocation (reused across calls).
    plan: CheckpointPlan,
    /// What verify steps it was built for (`None`: no speculation).
    speculation: Option<crate::Speculation>,
    /// Verify scratch: the lanes verify steps write, the cache's (never a request's,
    /// never in the tree).
    verify_scratch: scratch::VerifyScratch,
    /// The engine's replay rollback, when it registered one (else the copy rollback).
    replay: Option<Arc<dyn crate::StateReplay>>,
    /// The host tier, when the builder gave it memory.
    host: Option<host::HostTier>,
    /// Locks on what this step's forward reads behind the chunks cached before it ran
    /// ([`HybridCache::cache_unfinished`]), released at the step boundary.
    step_pins: Vec<unikv_radix::LockHandle>,
}

impl HybridCache {
    /// A builder with the defaults: gpt-oss-20b, page size 1, unified, CPU device.
    pub fn builder() -> HybridCacheBuilder {
        HybridCacheBuilder::defaults()
    }

    /// The model.
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// Whether it rolls verified state back by the engine's [`crate::StateReplay`].
    pub(crate) fn replays_states(&self) -> bool {
        self.replay.is_some()
    }

    /// How its verify scratch lanes sit in state slots (one state per slot under the copy
    /// rollback; log entries packed into slots under a [`crate::StateReplay`]).
    pub fn scratch_shape(&self) -> ScratchShape {
        self.verify_scratch.shape
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.ps
    }

    /// Steps completed (calls of [`HybridCache::step_boundary`]).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The allocator, for read-only inspection (capacity views, host-side kernel ids).
    pub fn allocator(&self) -> &dyn KvAllocator {
        self.alloc.as_ref()
    }

    /// Issues the device translation of `n` virtual token ids in the device table `ids`
    /// into kernel ids in `out` (zero-filled to `out_width`) on `side`, uploading the
    /// mirror first when an allocation, free or compaction of this step left it behind
    /// the host tables (one asynchronous upload; nothing waits for the device). See
    /// [the mirror-epoch rule](HybridCache#reading-the-device-tables-mirror-epochs).
    /// A failed upload keeps its entries pending and translates nothing.
    pub fn translate(
        &mut self,
        side: Side,
        ids: TableId,
        n: usize,
        out: TableId,
        out_width: usize,
    ) -> Result<(), Error> {
        self.sync_mirror()?;
        Ok(self.alloc.translate(side, ids, n, out, out_width)?)
    }

    /// [`HybridCache::translate`] for several rows in one device op: a step's
    /// translation of every side (FULL and SWA rows, Mamba slots) is one launch on a
    /// GPU. Uploads the mirror first as `translate` does; a refused row refuses all.
    pub fn translate_many(&mut self, rows: &[unikv_pools::SideTranslation]) -> Result<(), Error> {
        self.sync_mirror()?;
        Ok(self.alloc.translate_many(rows)?)
    }

    /// Uploads the mirror when it is behind the host tables, starting a new mirror
    /// generation (which makes step metadata built before it stale).
    pub(crate) fn sync_mirror(&mut self) -> Result<(), unikv_pools::Error> {
        if self.alloc.mirror_current() {
            return Ok(());
        }
        // Counted even when the upload fails: the tables changed either way.
        self.mirror_generation += 1;
        self.alloc.upload_mirror()
    }

    /// The mirror generation (see [`HybridCache::sync_mirror`]).
    pub(crate) fn mirror_generation(&self) -> u64 {
        self.mirror_generation
    }

    /// [`Error::StaleStepMetadata`] unless device ids computed at mirror generation
    /// `computed` (`None`: never) still name the rows: the generation is the current one
    /// and no table changed since.
    pub(crate) fn check_current(&self, computed: Option<u64>) -> Result<(), Error> {
        let current = self.mirror_generation();
        let changed = !self.alloc.mirror_current();
        match computed {
            Some(at) if at == current && !changed => Ok(()),
            at => Err(Error::StaleStepMetadata {
                built: at.unwrap_or(0),
                current,
                tables_changed: changed,
            }),
        }
    }

    /// Distinguishes this cache from every other one in the process.
    pub(crate) fn cache_id(&self) -> u64 {
        self.id
    }

    /// Refuses a request of another cache.
    pub(crate) fn check_request(&self, req: &Request) -> Result<(), Error> {
        self.check_owner(req)
    }

    /// What verify steps it was built for.
    pub(crate) fn speculation(&self) -> Option<crate::Speculation> {
        self.speculation
    }

    /// The device its buffer lives on.
    pub(crate) fn device(&self) -> &dyn Device {
        self.device.as_ref()
    }

    /// The device its buffer lives on, shared: the one given to the builder (an engine
    /// or a tool that wrapped it, in a `SyncLedger` say, finds its wrapper by pointer).
    pub fn device_arc(&self) -> Arc<dyn Device> {
        self.device.clone()
    }

    /// The memory of `table`, one of this cache's device tables
    /// ([`StepView::device_table`](crate::StepView::device_table),
    /// [`VerifyMetadata::tables`](crate::VerifyMetadata::tables)), for a reader that
    /// reads it in place: a DLPack export, an engine's attention kernel. No copy, no wait.
    ///
    /// The address holds until the cache frees the table, which it does only when a
    /// build needs a larger one; after [`HybridCache::reserve_step_metadata`] and
    /// [`HybridCache::reserve_verify_metadata`], builds within the reserved shapes reuse
    /// the same tables. While the export's guard lives, the memory of a freed table is
    /// kept (no longer written) rather than released. The contents are the last build's,
    /// overwritten in stream order by the next one; on a GPU, order the reader's stream
    /// first ([`HybridCache::make_stream_wait`]). See
    /// [`TableExport`](unikv_kernels::TableExport).
    ///
    /// Errors: [`Error::Device`] with `UnknownHandle` for a table this cache's device
    /// does not hold, or `NotExportable` on a device with no table memory (`NullDevice`).
    pub fn export_table(&self, table: TableId) -> Result<unikv_kernels::TableExport, Error> {
        Ok(self.device.export_table(table)?)
    }

    /// Makes the work enqueued on `consumer` from now on run after every device op the
    /// cache issued so far (the last build's tables written), without the host waiting:
    /// on a GPU one event, recorded on the cache's stream and waited for by `consumer`;
    /// nothing on the CPU backend. See
    /// [`Device::make_stream_wait`](unikv_kernels::Device::make_stream_wait).
    ///
    /// # Safety
    /// On a GPU, `consumer` is a valid stream of the same GPU's primary context (or
    /// `0x1`/`0x2`, the legacy and per-thread default streams), alive during the call.
    pub unsafe fn make_stream_wait(&self, consumer: unikv_kernels::RawStream) -> Result<(), Error> {
        // SAFETY: forwarded contract.
        Ok(unsafe { self.device.make_stream_wait(consumer) }?)
    }

    /// How recurrent states are checkpointed (`None` without recurrent layers).
    pub(crate) fn state_policy(&self) -> Option<StatePolicy> {
        self.states
    }

    /// The requests' lanes.
    pub(crate) fn lanes(&self) -> &Lanes {
        &self.tables.lanes
    }

    /// The requests' lanes, to write.
    pub(crate) fn lanes_mut(&mut self) -> &mut Lanes {
        &mut self.tables.lanes
    }

    /// Its device tables and the device they live on (to grow and fill them).
    pub(crate) fn tables_mut(&mut self) -> (&mut DeviceTables, &dyn Device) {
        (&mut self.tables, self.device.as_ref())
    }

    /// The prefix tree, for read-only inspection (sizes, dumps).
    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    /// The host tier's prefix tree (its values are host units), for read-only inspection;
    /// `None` without a host tier ([`HybridCacheBuilder::host_memory_bytes`]).
    pub fn host_tree(&self) -> Option<&RadixTree> {
        self.host.as_ref().map(|h| h.tree())
    }

    /// The cache's invariant scope: its allocator and its tree count their breaches in it,
    /// [`HybridCache::step_boundary`] polls it, and its report is this cache's alone
    /// (another cache in the process has its own). Its fail mode can be set through it.
    pub fn invariant_scope(&self) -> &Scope {
        &self.scope
    }

    // ----- admission -------------------------------------------------------------------

    /// Matches `prompt` against the prefix cache. Nothing is locked or allocated: drop the
    /// result to abort; pass it to [`HybridCache::admit`] to take the hit.
    ///
    /// The last prompt token is never served from the cache: its forward pass produces the
    /// logits of the first output token, so at least one token is always left to prefill.
    pub fn match_prefix(&mut self, prompt: Vec<TokenId>) -> PrefixMatch {
        let result = self.match_in_tree(&prompt);
        let host = self
            .host
            .as_mut()
            .and_then(|h| h.match_beyond(&prompt[..prompt.len().saturating_sub(1)], result.len.0));
        PrefixMatch {
            tokens: prompt,
            result,
            host,
            epoch: self.epoch,
            cache: self.id,
        }
    }

    /// The tree's match for `prompt`, its last token excluded.
    fn match_in_tree(&mut self, prompt: &[TokenId]) -> unikv_radix::MatchResult {
        self.tree
            .match_prefix(&prompt[..prompt.len().saturating_sub(1)])
    }

    /// Whether the request could be admitted now and grow by `reserve_tokens` past its
    /// prompt, counting what evicting unlocked prefixes could free. The allocator prices
    /// the joint FULL + SWA demand itself (in the unified layout, evicting SWA makes room
    /// for FULL), so the answer is exact up to the hit's own pages, which admission locks.
    /// Takes `&mut self` because pricing first applies the step's deferred frees (as any
    /// allocation would); nothing else changes. `false` for a match of another cache and
    /// for a reservation past every page (including one that overflows `usize`).
    pub fn can_admit(&mut self, hit: &PrefixMatch, reserve_tokens: usize) -> bool {
        if hit.cache != self.id {
            return false;
        }
        // A match made before the tree changed is priced as admission would take it: matched
        // again (its hit may have been evicted since).
        let again;
        let result = if hit.epoch == self.epoch {
            &hit.result
        } else {
            again = self.match_in_tree(&hit.tokens);
            &again
        };
        let cached = result.len.0;
        // A target past `usize::MAX` cannot fit (and must not wrap to a small one).
        let Some(target) = hit.tokens.len().checked_add(reserve_tokens) else {
            return false;
        };
        // The running slot and the checkpoints a one-chunk prefill of the prompt and the
        // reserved decode save (a decoding request rewrites its one checkpoint slot), and
        // the scratch its verify steps write where the kept scratch has none to spare.
        let slots = self.states.map_or(0, |policy| {
            let mut at = Vec::new();
            policy.plan(cached..target, Self::marks(&hit.tokens, result), &mut at);
            1 + at.len()
                + self
                    .verify_scratch
                    .shortfall(self.speculation, self.live_requests + 1)
        });
        // A verifying request transiently holds the rows of every position its unsettled
        // verifies reserved past its settled ones.
        let verify_rows = self
            .speculation
            .map_or(0, |s| s.max_width as usize * s.max_in_flight as usize);
        let Some(target_rows) = target.checked_add(verify_rows) else {
            return false;
        };
        let pages = target_rows.div_ceil(self.ps) - cached / self.ps;
        let demand = PageDemand {
            mamba_slots: slots,
            ..self.kv_demand(pages)
        };
        if !self.could_ever_fit(demand) {
            return false;
        }
        if self.alloc.allocation_fits(demand) {
            return true;
        }
        let sizes = self.tree.sizes();
        // The hit itself will be locked (FULL, SWA over its last window, its state), so it
        // cannot be evicted for this request.
        let evictable = Reclaimable {
            full_pages: (sizes.full_evictable.0 / self.ps).saturating_sub(cached / self.ps),
            swa_pages: (sizes.swa_evictable.0 / self.ps).saturating_sub(cached / self.ps),
            mamba_slots: sizes
                .mamba_evictable
                .0
                .saturating_sub(usize::from(cached > 0 && self.states.is_some())),
        };
        self.alloc.reclaim_plan(demand, evictable).is_some()
    }

    /// Admits a matched prompt: locks the hit so no eviction takes it, and returns the
    /// request, which starts with the hit's KV. A match made before the tree changed is
    /// matched again first. No KV is allocated here; prefill with
    /// [`HybridCache::alloc_extend`].
    ///
    /// A model with recurrent layers also gets its running state slot here (evicting
    /// unlocked prefixes if memory is short; checkpoint slots come with the allocations
    /// that save them), and the cached state its match ends at is copied into its running slot
    /// (one device copy of a host-known shape; a match of such a model only ends where a
    /// state is cached). On error nothing is locked or allocated
    /// ([`Error::OutOfMemory`] when the slots do not fit).
    pub fn admit(&mut self, hit: PrefixMatch) -> Result<Request, Error> {
        if hit.cache != self.id {
            return Err(Error::ForeignRequest { request: u64::MAX });
        }
        let hit = if hit.epoch == self.epoch {
            hit
        } else {
            self.match_prefix(hit.tokens)
        };
        let cached = hit.result.len.0;
        let lock = if cached > 0 {
            Some(self.tree.lock(hit.result.node)?)
        } else {
            None
        };
        if cached > 0 {
            self.note_hit(hit.result.node);
        }
        let host_lock = match self.lock_host(&hit) {
            Ok(l) => l,
            Err(e) => {
                if let Some(lock) = lock {
                    self.tree.unlock(lock)?;
                }
                return Err(e);
            }
        };
        let state = match self.states {
            Some(_) => {
                // A host part brings its own state (loaded into the running slot below).
                let matched = if cached > 0 && hit.host.is_none() {
                    self.tree.node(hit.result.node)?.mamba
                } else {
                    None
                };
                let marks = Self::marks(&hit.tokens, &hit.result);
                match self.admit_state(marks, matched) {
                    Ok(state) => Some(state),
                    Err(e) => {
                        if let Some(lock) = lock {
                            self.tree.unlock(lock)?;
                        }
                        self.unlock_host(host_lock)?;
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let id = self.next_request;
        self.next_request += 1;
        self.live_requests += 1;
        let (reused, kv_hit) = (hit.cached_tokens(), hit.kv_hit_tokens());
        let row = hit.result.values.iter().map(|v| PoolToken(v.0)).collect();
        let mut req = Request {
            id,
            cache: self.id,
            tokens: hit.tokens,
            row,
            protected: cached,
            cursor: cached,
            lock,
            window_lock_released: false,
            cached_at_admission: reused,
            kv_hit_at_admission: kv_hit,
            state,
            verifies: Default::default(),
        };
        if let (Some(host), Some(host_lock)) = (&hit.host, host_lock)
            && let Err(e) = self.load_back(&mut req, host, host_lock)
        {
            // Nothing was loaded: the request goes as if never admitted.
            self.unlock_host(Some(host_lock))?;
            self.release(req)?;
            return Err(e);
        }
        self.hit_tokens += reused as u64;
        self.kv_hit_tokens += kv_hit as u64;
        self.admitted_prompt_tokens += req.tokens.len() as u64;
        Ok(req)
    }

    /// What makes a position of a prompt matched as `result` worth a state.
    fn marks(prompt: &[TokenId], result: &unikv_radix::MatchResult) -> PlanMarks {
        PlanMarks {
            branching: result.mamba_branching.map(|b| b.0),
            prompt_len: prompt.len(),
        }
    }

    /// Allocates a request's running slot (evicting if memory is short) and copies the
    /// matched state into it. On error nothing stays allocated.
    fn admit_state(
        &mut self,
        marks: PlanMarks,
        matched: Option<MambaSlot>,
    ) -> Result<RequestState, Error> {
        self.make_room(PageDemand::slots(1))?;
        let mut slots = Vec::with_capacity(1);
        self.alloc
            .alloc_slots(1, &mut slots)
            .map_err(|e| self.out_of_memory(e))?;
        let running = slots[0];
        if let Some(MambaSlot(src)) = matched
            && let Err(e) = self.alloc.copy_slots(&[(VirtualSlot(src), running)])
        {
            // Nothing was copied; the slot goes back.
            self.alloc.free_batch(&[FreeOp::Slots(&slots)]);
            return Err(e.into());
        }
        self.held_slots += 1;
        Ok(RequestState {
            running,
            held: Vec::new(),
            pending: Vec::new(),
            marks,
        })
    }

    /// The KV pages a demand of `pages` new pages takes: on FULL, and on SWA when the
    /// model has it.
    fn kv_demand(&self, pages: usize) -> PageDemand {
        PageDemand::pages(pages, if self.has_swa { pages } else { 0 })
    }

    // ----- allocation ------------------------------------------------------------------

    /// Allocates KV for the next `tokens` prompt tokens of `req` (a prefill chunk). SWA
    /// that left the window is released first; when memory is short, unlocked prefixes
    /// are evicted. On error the request is as it was (see [`Error`]).
    pub fn alloc_extend(&mut self, req: &mut Request, tokens: usize) -> Result<(), Error> {
        self.check_owner(req)?;
        Self::check_settled(req)?;
        let len = req.len();
        // `len <= tokens.len()` always holds, so this cannot overflow where `len + tokens`
        // could.
        if tokens > req.tokens.len() - len {
            return Err(Error::BadRequest {
                request: req.id,
                reason: format!(
                    "extend by {tokens} tokens past {len} but the request has only {} tokens",
                    req.tokens.len()
                ),
            });
        }
        self.release_out_of_window(req)?;
        let extend = ExtendRequest {
            prefix_len: len,
            seq_len: len + tokens,
            last_token: req.row.last().copied(),
        };
        let pages = extend.new_pages(self.alloc.page_size());
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        self.plan_checkpoints(req, len..len + tokens, &mut plan);
        let result =
            self.alloc_with_checkpoints(pages, &mut plan, Checkpoints::Required, |cache| {
                cache.scratch.clear();
                cache
                    .alloc
                    .alloc_extend(&[extend], &mut cache.scratch)
                    .map_err(|e| cache.out_of_memory(e))
            });
        if result.is_ok() {
            let before = self.held(req);
            req.row.extend_from_slice(&self.scratch);
            self.account(before, self.held(req));
            self.commit_checkpoints(req, &plan, 0);
        }
        self.plan = plan;
        result
    }

    /// Appends one generated token to each request of the batch and allocates its KV
    /// (one allocator call for the batch; most steps need no new page). SWA that left the
    /// window is released first. With recurrent layers, a request that reaches a
    /// checkpoint-grid position saves its state there when a slot fits beside the KV
    /// (best effort: a decode never fails for a checkpoint). On error every request is as
    /// it was (see [`Error`]).
    pub fn alloc_decode(
        &mut self,
        batch: &mut [&mut Request],
        next_tokens: &[TokenId],
    ) -> Result<(), Error> {
        if batch.len() != next_tokens.len() {
            return Err(Error::BadRequest {
                request: batch.first().map_or(u64::MAX, |r| r.id),
                reason: format!(
                    "{} requests but {} next tokens",
                    batch.len(),
                    next_tokens.len()
                ),
            });
        }
        for req in batch.iter() {
            self.check_owner(req)?;
            Self::check_settled(req)?;
            if req.len() != req.tokens.len() {
                return Err(Error::BadRequest {
                    request: req.id,
                    reason: format!(
                        "decode before prefill finished ({} of {} tokens)",
                        req.len(),
                        req.tokens.len()
                    ),
                });
            }
        }
        self.release_batch_windows(batch)?;
        let mut requests = std::mem::take(&mut self.decode_scratch);
        requests.clear();
        requests.extend(batch.iter().map(|req| DecodeRequest {
            prefix_len: req.len(),
            last_token: req.row.last().copied(),
        }));
        let ps = self.alloc.page_size();
        let pages = requests
            .iter()
            .map(|d| ExtendRequest::from(*d).new_pages(ps))
            .sum();
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        for req in batch.iter() {
            self.plan_checkpoints(req, req.len()..req.len() + 1, &mut plan);
        }
        let result =
            self.alloc_with_checkpoints(pages, &mut plan, Checkpoints::BestEffort, |cache| {
                cache.scratch.clear();
                cache
                    .alloc
                    .alloc_decode(&requests, &mut cache.scratch)
                    .map_err(|e| cache.out_of_memory(e))
            });
        self.decode_scratch = requests;
        if result.is_ok() {
            for (i, req) in batch.iter_mut().enumerate() {
                let before = self.held(req);
                req.row.push(self.scratch[i]);
                req.tokens.push(next_tokens[i]);
                let after = self.held(req);
                self.account(before, after);
                self.commit_checkpoints(req, &plan, i);
            }
        }
        self.plan = plan;
        result
    }

    // ----- finishing, caching, releasing -------------------------------------------------

    /// Caches what `req` computed so far and keeps it running: its whole pages enter the
    /// tree (duplicates of what the tree already had are freed), the tree's copy is locked
    /// for it, and its row now reads the tree's values. With recurrent layers, the
    /// checkpoints it saved so far enter the tree with them (a state the tree already
    /// has is freed), so a request arriving while it still runs resumes from them; one
    /// this step's forward writes ends matches from the next step on (after
    /// [`HybridCache::step_boundary`]).
    ///
    /// It may be called before the step's forward and between its allocations: with
    /// sliding-window layers, what the forward reads behind the tokens cached since the
    /// last call (their SWA and one window before them) stays locked until
    /// [`HybridCache::step_boundary`], so a later allocation of the step evicts none of
    /// it (`a_chunk_cached_mid_step_keeps_the_window_its_forward_reads`).
    pub fn cache_unfinished(&mut self, req: &mut Request) -> Result<(), Error> {
        self.check_owner(req)?;
        let before = self.held(req);
        let checkpoints = self.held_checkpoints(req);
        let outcome = self.insert(req, true, &checkpoints)?;
        self.handed_to_tree(req, checkpoints.len());
        let cached = outcome.cached_len.0;
        if self.has_swa && cached > req.protected {
            // The new lock covers one window behind `cached`; the forward's queries
            // from `req.protected` on read one window behind each.
            let reach = Tokens(cached - req.protected + self.window);
            let pin = self.tree.lock_reaching(outcome.node, reach)?;
            self.step_pins.push(pin);
        }
        if let Some(old) = req.lock.take() {
            self.tree.unlock(old)?;
        }
        req.lock = outcome.lock;
        req.window_lock_released = false;
        // Rows before `protected` already read the tree's values.
        let values = self.tree.values_from(outcome.node, Tokens(req.protected))?;
        for (slot, v) in req.row[req.protected..cached].iter_mut().zip(values.iter()) {
            *slot = PoolToken(v.0);
        }
        self.tables.lanes.invalidate(req.id, req.protected, self.ps);
        req.protected = cached;
        req.cursor = req.cursor.max(cached);
        self.account(before, self.held(req));
        Ok(())
    }

    /// Finishes `req`: its whole pages enter the tree for future requests, duplicates and
    /// the partial last page are freed, and its lock is released. With recurrent layers,
    /// every checkpoint it still holds enters the tree at its position, and so does its
    /// running state when its rows end a page (the state a follow-up turn resumes from);
    /// a state the tree already has, or cannot hold, is freed with its other slots.
    pub fn cache_finished(&mut self, req: Request) -> Result<(), Error> {
        self.check_owner(&req)?;
        self.tables.lanes.release(req.id);
        let before = self.held(&req);
        let len = req.settled_len();
        let mut checkpoints = self.held_checkpoints(&req);
        // The running state is the state at `len` even with a verify in flight: a verify
        // writes only its scratch group, and settling copied the accepted state in.
        let mut cached_running = None;
        if let Some(state) = &req.state
            && len > 0
            && len.is_multiple_of(self.ps)
            && checkpoints.last().is_none_or(|c| c.at.0 < len)
        {
            // The forward that wrote it may be this step's.
            checkpoints.push(StateCheckpoint {
                at: Tokens(len),
                slot: MambaSlot(state.running.0),
                in_flight: true,
                role: StateRole::Anchor,
            });
            cached_running = Some(state.running);
        }
        let outcome = self.insert(&req, false, &checkpoints)?;
        let cached = outcome.cached_len.0;
        self.alloc.free_batch(&[FreeOp::KvRow {
            row: &req.row,
            dead_lo: cached,
            cursor: req.cursor.max(cached),
            len: req.len(),
        }]);
        if let Some(state) = &req.state {
            // The tree took (or handed back through its actions) every checkpoint and
            // the running slot when it was one; otherwise the running slot goes back.
            if cached_running.is_none() {
                self.alloc
                    .free_batch(&[FreeOp::Slots(std::slice::from_ref(&state.running))]);
            }
            self.held_slots -= 1 + state.held.len();
        }
        self.verify_scratch.give_back_all(&req);
        if let Some(lock) = req.lock {
            self.tree.unlock(lock)?;
        }
        self.account(before, (0, 0));
        self.live_requests -= 1;
        Ok(())
    }

    /// The checkpoints `req` holds, as the tree takes them: one whose forward is this
    /// step's is in flight.
    fn held_checkpoints(&self, req: &Request) -> Vec<StateCheckpoint> {
        req.state.as_ref().map_or_else(Vec::new, |state| {
            state
                .held
                .iter()
                .map(|&(w, step)| StateCheckpoint {
                    at: Tokens(w.at_len),
                    slot: MambaSlot(w.slot.0),
                    in_flight: step == self.step,
                    role: if state.marks.anchors(w.at_len, self.ps) {
                        StateRole::Anchor
                    } else {
                        StateRole::Grid
                    },
                })
                .collect()
        })
    }

    /// The tree took `req`'s `n` held checkpoints (adopting each slot or handing it back
    /// through the actions it returned).
    fn handed_to_tree(&mut self, req: &mut Request, n: usize) {
        if let Some(state) = &mut req.state {
            state.held.clear();
            self.held_slots -= n;
        }
    }

    /// Releases `req` without caching (abort, or retraction under memory pressure): its
    /// own KV is freed, its lock released. Returns its tokens (prompt and generated), so a
    /// retracted request can be matched and admitted again later.
    ///
    /// A request whose load-back from the host tier is still in flight keeps its rows
    /// and slots, counted as held, until the copy is done (learnt at a step boundary).
    pub fn release(&mut self, mut req: Request) -> Result<Vec<TokenId>, Error> {
        self.check_owner(&req)?;
        self.tables.lanes.release(req.id);
        let before = self.held(&req);
        let slots = req.state.as_ref().map_or_else(Vec::new, |s| s.slots());
        self.held_slots -= slots.len();
        let (len, dead_lo) = (req.len(), req.protected);
        let rows = host::ReleasedRows {
            row: std::mem::take(&mut req.row),
            len,
            dead_lo,
            cursor: req.cursor.max(dead_lo),
            held: [before.0, before.1, slots.len()],
            slots,
        };
        if let Some(rows) = self.park_released(req.id, rows) {
            rows.free(self.alloc.as_mut());
        }
        self.verify_scratch.give_back_all(&req);
        if let Some(lock) = req.lock {
            self.tree.unlock(lock)?;
            self.epoch += 1;
        }
        self.account(before, (0, 0));
        self.live_requests -= 1;
        Ok(req.tokens)
    }

    /// Inserts `req`'s whole pages with `checkpoints` (held states at their positions)
    /// and applies the actions.
    fn insert(
        &mut self,
        req: &Request,
        lock: bool,
        checkpoints: &[StateCheckpoint],
    ) -> Result<unikv_radix::InsertOutcome, Error> {
        let key_len = req.settled_len() / self.ps * self.ps;
        // A request holding a lock inserts only what follows its locked node (where its
        // tree-owned prefix ends), so a chunk costs its own tokens, not the whole row.
        let from = if req.lock.is_some() { req.protected } else { 0 };
        let values: Vec<TreeToken> = req.row[from..key_len]
            .iter()
            .map(|v| TreeToken(v.0))
            .collect();
        let key = &req.tokens[from..key_len];
        let mut insert = match req.lock {
            Some(held) => InsertRequest::after(held, from, key, &values),
            None => InsertRequest::new(key, &values).prev_prefix_len(req.protected),
        }
        .window_cursor(req.cursor.max(req.protected))
        .checkpoints(checkpoints);
        if lock {
            insert = insert.locked();
        }
        let outcome = self.tree.insert(insert)?;
        self.epoch += 1;
        self.apply(&outcome.actions);
        self.note_cached(outcome.node);
        Ok(outcome)
    }

    // ----- the step boundary -------------------------------------------------------------

    /// Ends the step: closes the step's free group (every deferred free takes effect),
    /// checks conservation exactly, uploads the translation mirror (one device op per
    /// side, none when nothing changed), opens the next step's group, runs the tree's
    /// `sanity_check` at `Strict` and polls the invariants. Nothing here waits for the
    /// device, and nothing is compacted: compaction is lazy, run by an allocation that
    /// fits only after it.
    ///
    /// Every part runs whatever an earlier one returned, and the first error is returned
    /// after all of them: the step counts as ended, the next step's free group is open
    /// and every breach was polled, so the cache stays usable and a later boundary
    /// (e.g. retrying a failed mirror upload) can succeed. When closing the group fails,
    /// its deferred frees are applied anyway and it stays open for the next step.
    ///
    /// At `Strict` every [`TREE_SANITY_INTERVAL`]-th boundary (the first included) walks
    /// the whole tree, O(nodes × page size): for the ~500 nodes that 256 finished
    /// 2K-token conversations on a shared prompt leave, about 30 µs at page size 1 and
    /// 260 µs at page size 256 (`cargo bench -p unikv-radix --bench tree -- sanity`), so
    /// a few µs per step amortised; lower levels skip it. Walking at every boundary made
    /// the replay's median step time at page size 256 grow up to 20-fold.
    pub fn step_boundary(&mut self) -> Result<StepReport, Error> {
        // The step's forward is launched: a later step's work is ordered after it.
        let unpinned = self
            .step_pins
            .drain(..)
            .try_for_each(|pin| self.tree.unlock(pin));
        // Scratch given back in this step is handed out again from the next one (this
        // step's forward may still read it); what is kept beyond the reserve goes back.
        self.verify_scratch
            .end_step(self.alloc.as_mut(), self.speculation);
        let closed = if self.alloc.in_free_group() {
            self.alloc.free_group_end().inspect_err(|_| {
                self.alloc.flush_deferred();
            })
        } else {
            Ok(())
        };
        if unikv_invariants::enabled() {
            self.alloc.check_conservation();
        }
        let polled_copies = self.poll_copies();
        let conservation = self.check_conservation().and_then(|()| self.check_host());
        let uploaded = self.sync_mirror();
        let reopened = if self.alloc.in_free_group() {
            Ok(())
        } else {
            self.alloc.free_group_begin()
        };
        // The step's forward is ordered before anything a later match issues.
        self.tree.publish_states();
        let written = self.write_through();
        let sane = if self.step.is_multiple_of(TREE_SANITY_INTERVAL) {
            self.tree.sanity_check_at_strict()
        } else {
            Ok(())
        };
        self.step += 1;
        // Polled on every path, a failing one included, so no breach stays pending for
        // the next step (the drained ones stay counted in the scope's report).
        let polled = self.scope.poll();
        unpinned?;
        closed?;
        polled_copies?;
        written?;
        conservation?;
        uploaded?;
        reopened?;
        sane?;
        polled?;
        Ok(StepReport { step: self.step })
    }

    /// Conservation per side, in pages: available + evictable + protected + held by live
    /// requests = total. Deferred frees must have been applied (step boundary).
    fn check_conservation(&self) -> Result<(), Error> {
        let stats = self.stats();
        for side in [&stats.full, &stats.swa, &stats.mamba] {
            let sum = side.available_pages
                + side.evictable_pages
                + side.protected_pages
                + side.held_pages;
            let holds = sum == side.total_pages;
            let detail = || {
                format!(
                    "{}: available {} + evictable {} + protected {} + held {} = {} != total {}",
                    side.name,
                    side.available_pages,
                    side.evictable_pages,
                    side.protected_pages,
                    side.held_pages,
                    sum,
                    side.total_pages
                )
            };
            if !self.scope.expect(&CONSERVATION, holds, detail) {
                return Err(Error::Conservation {
                    step: self.step,
                    detail: detail(),
                });
            }
        }
        Ok(())
    }

    // ----- accounting ---------------------------------------------------------------------

    /// Pages `req` holds itself: FULL for rows `[protected, len)`, SWA for rows
    /// `[max(cursor, protected), len)`.
    fn held(&self, req: &Request) -> (usize, usize) {
        let end = req.len().div_ceil(self.ps);
        let full = end - req.protected / self.ps;
        let swa = if self.has_swa {
            end.saturating_sub(req.cursor.max(req.protected) / self.ps)
        } else {
            0
        };
        (full, swa)
    }

    fn account(&mut self, before: (usize, usize), after: (usize, usize)) {
        self.held_full_pages = self.held_full_pages + after.0 - before.0;
        self.held_swa_pages = self.held_swa_pages + after.1 - before.1;
    }

    /// [`Error::Unsettled`] while `req` has unsettled verify steps.
    fn check_settled(req: &Request) -> Result<(), Error> {
        match req.verifies.len() {
            0 => Ok(()),
            in_flight => Err(Error::Unsettled {
                request: req.id,
                in_flight,
            }),
        }
    }

    fn check_owner(&self, req: &Request) -> Result<(), Error> {
        if req.cache == self.id {
            Ok(())
        } else {
            Err(Error::ForeignRequest { request: req.id })
        }
    }

    /// What an engine exports: per side, pages and bytes available, evictable, protected
    /// and held; prefix hits; evictions by kind.
    pub fn stats(&self) -> CacheStats {
        let cap = self.alloc.capacity();
        let sizes = self.tree.sizes();
        let ps = self.ps;
        let side = |name: &'static str,
                    side: Side,
                    c: &unikv_pools::SideCapacity,
                    evictable: usize,
                    protected: usize,
                    held: usize| {
            let envelope = self.alloc.grid(side).envelope;
            SideStats {
                name,
                total_pages: c.total_pages,
                available_pages: c.total_pages - c.allocated_pages,
                evictable_pages: evictable / ps,
                protected_pages: protected / ps,
                held_pages: held,
                page_bytes: envelope,
                schedulable_pages: c.schedulable_pages,
            }
        };
        CacheStats {
            step: self.step,
            full: side(
                "full",
                Side::Full,
                &cap.full,
                sizes.full_evictable.0,
                sizes.full_protected.0,
                self.held_full_pages + self.host.as_ref().map_or(0, |h| h.parked_full),
            ),
            swa: side(
                "swa",
                Side::Swa,
                &cap.swa,
                sizes.swa_evictable.0,
                sizes.swa_protected.0,
                self.held_swa_pages + self.host.as_ref().map_or(0, |h| h.parked_swa),
            ),
            // A slot is a page of one: its counts go through `side` times the page size.
            mamba: side(
                "mamba",
                Side::Mamba,
                &cap.mamba,
                sizes.mamba_evictable.0 * ps,
                sizes.mamba_protected.0 * ps,
                self.held_slots
                    + self.verify_scratch.slots()
                    + self.host.as_ref().map_or(0, |h| h.parked_slots),
            ),
            live_requests: self.live_requests,
            hit_tokens: self.hit_tokens,
            kv_hit_tokens: self.kv_hit_tokens,
            admitted_prompt_tokens: self.admitted_prompt_tokens,
            evictions: self.evictions,
            verify_scratch_slots: self.verify_scratch.slots(),
            host: self.host_stats(),
        }
    }
}

impl Drop for HybridCache {
    /// Frees its device tables (the allocator frees its own memory when it drops next),
    /// so a dropped cache leaves the device as it found it.
    fn drop(&mut self) {
        self.tables.free(self.device.as_ref());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unikv_invariants::{Level, scoped_level};

    /// The step boundary walks the tree at `Strict` on its sampled steps (a corrupted tree
    /// fails it, and the boundary still reopens the free group) and skips the walk below
    /// `Strict` and between samples.
    #[test]
    fn step_boundary_runs_the_tree_sanity_check_at_strict_only() {
        // At page size 16 one token too many is no page too many: conservation holds,
        // only the tree walk sees it.
        let mut cache = HybridCache::builder()
            .page_size(16)
            .memory_bytes(16 << 20)
            .build()
            .unwrap();
        cache.tree.corrupt_recorded_sizes();
        // Below Strict no boundary walks, the sampled first one included.
        scoped_level(Level::Warn, || {
            cache.step_boundary().unwrap();
        });
        scoped_level(Level::Strict, || {
            // Between samples the corruption goes unseen...
            while !cache.step().is_multiple_of(TREE_SANITY_INTERVAL) {
                cache.step_boundary().unwrap();
            }
            assert_eq!(cache.step(), TREE_SANITY_INTERVAL);
            // ...and the sampled boundary finds it.
            match cache.step_boundary() {
                Err(Error::Radix(unikv_radix::RadixError::Insane(m))) => {
                    assert!(m.contains("sizes"), "{m}")
                }
                other => panic!("a corrupted tree passed the strict boundary: {other:?}"),
            }
            assert!(cache.alloc.in_free_group());
            assert_eq!(cache.step(), TREE_SANITY_INTERVAL + 1);
        });
    }
}

//! `HybridCache`: the allocator and the prefix tree behind one API that owns a request's
//! lifecycle, applies the tree's actions in one place and runs the eviction loop.

use crate::error::Error;
use crate::invariants_decl::CONSERVATION;
use crate::model::ModelSpec;
use crate::request::{PrefixMatch, Request, RequestState};
use crate::stats::{CacheStats, EvictionCounts, SideStats, StepReport};
use crate::step::StepTable;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use unikv_invariants::Scope;
use unikv_kernels::{CpuDevice, Device, TableId};
use unikv_mamba::{CheckpointWrite, PlanMarks, StatePolicy};
use unikv_pools::{
    DecodeRequest, ExtendRequest, FreeOp, KvAllocator, PageDemand, PrefixCaching,
    REFERENCE_MAMBA_FULL_MEMORY_RATIO, Reclaimable, Segment, Side, StaticSlots, StaticSwa,
    StaticSwaConfig, UnifiedSwa, UnifiedSwaConfig, VirtualSlot, VirtualToken as PoolToken,
    reference_slot_pool,
};
use unikv_radix::{
    Action, Component, InsertRequest, MambaSlot, RadixTree, StateCheckpoint, SwaSide, TokenId,
    Tokens, TreeConfig, VirtualToken as TreeToken,
};

/// How the FULL KV, the SWA KV and the Mamba state slots share the memory budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// The baseline: fixed pools. `swa_full_tokens_ratio` is SWA tokens per FULL
    /// token (the reference engine's `--swa-full-tokens-ratio`, default 0.8); a model
    /// with recurrent state gets a fixed slot pool sized as the reference engine sizes
    /// it ([`unikv_pools::reference_slot_pool`]).
    Static {
        /// SWA token capacity per FULL token capacity (> 0).
        swa_full_tokens_ratio: f64,
    },
    /// One byte buffer whose split follows the workload.
    Unified,
}

impl Layout {
    /// `static` or `unified`.
    pub const fn as_str(&self) -> &'static str {
        match self {
            Layout::Static { .. } => "static",
            Layout::Unified => "unified",
        }
    }
}

/// The fixed slot pool [`Layout::Static`] gives a model whose state slots are `spec`, in
/// a budget of `memory_bytes`: the reference engine's default split of the budget between
/// states and KV ([`reference_slot_pool`] with [`REFERENCE_MAMBA_FULL_MEMORY_RATIO`] and a
/// radix prefix cache, which every [`HybridCache`] keeps; its running-request cap, a third
/// of the slots, follows from admission taking three slots a request). The builder and
/// anything that rebuilds its allocator (the replay's ops-trace rerun) use this one
/// mapping.
pub fn static_slot_pool(
    spec: unikv_pools::SlotPoolSpec,
    memory_bytes: u64,
) -> Result<StaticSlots, unikv_pools::Error> {
    let pool = reference_slot_pool(
        memory_bytes,
        &spec,
        REFERENCE_MAMBA_FULL_MEMORY_RATIO,
        PrefixCaching::Radix,
    )?;
    Ok(StaticSlots {
        slots: pool.slots,
        spec,
    })
}

/// The default eviction interval in tokens at small page sizes: releasing a request's
/// out-of-window SWA every 16 tokens instead of every token cuts the per-step cost of a
/// 256-request decode batch at page size 1 by about 40% (`cargo bench -p unikv --bench
/// step`) for 16 more SWA tokens per request.
pub const DEFAULT_EVICTION_INTERVAL: u32 = 16;

/// At `Strict`, the step boundary walks the whole tree ([`RadixTree::sanity_check`]) at
/// every this-many-th step (from the first): a sample that costs a few µs per step
/// amortised instead of a walk of every node at every step.
pub const TREE_SANITY_INTERVAL: u64 = 128;

/// At most this many cached recurrent states on one root-to-leaf path of the prefix
/// tree (the reference engine caps them per path too): beyond it, the least recently
/// used unlocked ones are evicted when an insert adds one, so one long conversation
/// cannot fill the slot pool with checkpoints of itself.
pub const MAMBA_PATH_CAP: std::num::NonZeroUsize = std::num::NonZeroUsize::new(4).unwrap();

/// Distinguishes caches so a request handle cannot be used on another one.
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// Builds a [`HybridCache`]; see [`HybridCache::builder`].
pub struct HybridCacheBuilder {
    model: ModelSpec,
    page_size: u32,
    memory_bytes: u64,
    layout: Layout,
    device: Option<Arc<dyn Device>>,
    eviction_interval: Option<u32>,
    zero_on_handout: bool,
    checkpoint_interval: Option<u32>,
    checkpoints_per_step: Option<u32>,
    wrap: Option<AllocatorWrapper>,
}

/// A function that wraps the allocator the builder made (see
/// [`HybridCacheBuilder::wrap_allocator`]).
type AllocatorWrapper = Box<dyn FnOnce(Box<dyn KvAllocator>) -> Box<dyn KvAllocator>>;

impl std::fmt::Debug for HybridCacheBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridCacheBuilder")
            .field("model", &self.model.name)
            .field("page_size", &self.page_size)
            .field("memory_bytes", &self.memory_bytes)
            .field("layout", &self.layout)
            .field("device", &self.device.as_ref().map(|d| d.name()))
            .field("eviction_interval", &self.eviction_interval)
            .field("zero_on_handout", &self.zero_on_handout)
            .field("checkpoint_interval", &self.checkpoint_interval)
            .field("checkpoints_per_step", &self.checkpoints_per_step)
            .field("wrapped", &self.wrap.is_some())
            .finish()
    }
}

impl HybridCacheBuilder {
    /// The model whose KV the cache holds (default [`ModelSpec::GPT_OSS_20B`]).
    pub fn model(mut self, model: ModelSpec) -> Self {
        self.model = model;
        self
    }

    /// Tokens per page (default 1).
    pub fn page_size(mut self, page_size: u32) -> Self {
        self.page_size = page_size;
        self
    }

    /// The KV memory budget in bytes (required).
    pub fn memory_bytes(mut self, bytes: u64) -> Self {
        self.memory_bytes = bytes;
        self
    }

    /// Static or unified (default unified).
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The device the buffer lives on (default a [`CpuDevice`]).
    pub fn device(mut self, device: Arc<dyn Device>) -> Self {
        self.device = Some(device);
        self
    }

    /// How many tokens past the window a request's cursor may lag before its SWA is
    /// released (default: the larger of one page and [`DEFAULT_EVICTION_INTERVAL`]
    /// tokens). Larger values free less often, in bigger segments, and hold that much
    /// more SWA per request.
    pub fn eviction_interval(mut self, tokens: u32) -> Self {
        self.eviction_interval = Some(tokens);
        self
    }

    /// Zero page envelopes when they are handed out (default off; kernels that read
    /// whole pages need it when neighbours may hold NaN bytes).
    pub fn zero_on_handout(mut self, zero: bool) -> Self {
        self.zero_on_handout = zero;
        self
    }

    /// The grid, in tokens, on which a request's recurrent state is checkpointed for the
    /// prefix cache (a model with Mamba/GDN layers; default
    /// [`unikv_mamba::DEFAULT_CHECKPOINT_INTERVAL`] rounded up to whole pages). A cached
    /// state lets a later request skip the prefill up to it, so a finer grid reuses more
    /// of a prompt; each request holds two checkpoint slots whatever the grid. Must be a
    /// positive multiple of the page size.
    pub fn checkpoint_interval(mut self, tokens: u32) -> Self {
        self.checkpoint_interval = Some(tokens);
        self
    }

    /// For a model with recurrent layers: the most states one step of one request saves
    /// (default [`unikv_mamba::DEFAULT_CHECKPOINTS_PER_STEP`] = 2, at most
    /// [`unikv_mamba::MAX_CHECKPOINTS_PER_STEP`]); a request holds at most its running
    /// slot and that many checkpoint slots. See [`unikv_mamba::StatePolicy::plan`] for
    /// which positions are saved.
    pub fn checkpoints_per_step(mut self, n: u32) -> Self {
        self.checkpoints_per_step = Some(n);
        self
    }

    /// Wraps the allocator the builder makes, e.g. in a recorder of every allocator-level
    /// operation (the replay's `--record-ops`) or a fault injector in tests. The wrapper
    /// must forward every call.
    pub fn wrap_allocator(
        mut self,
        wrap: impl FnOnce(Box<dyn KvAllocator>) -> Box<dyn KvAllocator> + 'static,
    ) -> Self {
        self.wrap = Some(Box::new(wrap));
        self
    }

    /// Checks the configuration and lays out the buffer.
    pub fn build(self) -> Result<HybridCache, Error> {
        crate::init()?;
        let m = &self.model;
        let config_error = |reason: String| Err(Error::Config(reason));
        if self.page_size == 0 {
            return config_error("page size must be at least 1 token".into());
        }
        if m.full_layers == 0 {
            return config_error(format!("model {} has no full-attention layer", m.name));
        }
        let has_swa = m.swa_layers > 0;
        let has_state = m.has_recurrent_state();
        if !has_swa && !has_state {
            return config_error(format!(
                "model {} has neither sliding-window nor recurrent layers; unikv's pools \
                 share a buffer between FULL and one of them",
                m.name
            ));
        }
        if has_swa && m.window == 0 {
            return config_error(format!("model {}: a sliding window of 0 tokens", m.name));
        }
        let mut kinds = vec![("full-attention", m.full)];
        if has_swa {
            kinds.push(("sliding-window", m.swa));
        }
        for (kind, rows) in kinds {
            if rows.is_empty() {
                return config_error(format!(
                    "model {}: the {kind} layers' KV heads, head dim and dtype bytes must \
                     be > 0 (not {rows})",
                    m.name
                ));
            }
        }
        // Every byte size the allocator derives (a page's envelope on each side, a joint
        // page, a state slot) must fit in 64 bits, or it would be quoted wrapped.
        let ps = u64::from(self.page_size);
        let joint_page_bytes = m
            .checked_full_bytes_per_token()
            .and_then(|f| f.checked_mul(ps))
            .zip(
                m.checked_swa_bytes_per_token()
                    .and_then(|s| s.checked_mul(ps)),
            )
            .and_then(|(f, s)| f.checked_add(s));
        if joint_page_bytes.is_none() {
            return config_error(format!(
                "model {m} at page size {ps}: a page's KV bytes do not fit in 64 bits"
            ));
        }
        let slots = if has_state {
            Some(m.slot_pool().map_err(|e| {
                Error::Config(format!("model {}: its recurrent state: {e}", m.name))
            })?)
        } else {
            None
        };
        let states = if has_state {
            let interval = self.checkpoint_interval.unwrap_or_else(|| {
                unikv_mamba::DEFAULT_CHECKPOINT_INTERVAL.div_ceil(self.page_size) * self.page_size
            });
            let page = unikv_pools::PageSize::new(self.page_size)
                .ok_or_else(|| Error::Config("page size must be at least 1 token".into()))?;
            let policy = StatePolicy::checkpointed(interval, page).and_then(|p| {
                match self.checkpoints_per_step {
                    Some(n) => p.with_checkpoints_per_step(n),
                    None => Ok(p),
                }
            });
            Some(policy.map_err(|e| Error::Config(format!("model {}: {e}", m.name)))?)
        } else {
            None
        };
        if self.memory_bytes == 0 {
            return config_error("a memory budget of 0 bytes (set memory_bytes)".into());
        }
        if let Layout::Static {
            swa_full_tokens_ratio,
        } = self.layout
            && !(swa_full_tokens_ratio.is_finite() && swa_full_tokens_ratio > 0.0)
        {
            return config_error(format!(
                "static layout: the SWA:FULL token ratio must be a positive number, not {swa_full_tokens_ratio}"
            ));
        }
        let device = self.device.unwrap_or_else(|| Arc::new(CpuDevice::new()));
        let step_device = device.clone();
        let (full, swa) = m.kv_sub_pools();
        let swa = has_swa.then_some(swa);
        let mut alloc: Box<dyn KvAllocator> = match self.layout {
            Layout::Unified => Box::new(UnifiedSwa::new(
                device,
                UnifiedSwaConfig {
                    total_bytes: self.memory_bytes,
                    page_size: self.page_size,
                    window: m.window,
                    full,
                    swa,
                    mamba: slots,
                    zero_on_handout: self.zero_on_handout,
                },
            )?),
            Layout::Static {
                swa_full_tokens_ratio,
            } => Box::new(StaticSwa::new(
                device,
                StaticSwaConfig {
                    total_bytes: self.memory_bytes,
                    page_size: self.page_size,
                    window: m.window,
                    full,
                    swa,
                    mamba: slots
                        .map(|spec| static_slot_pool(spec, self.memory_bytes))
                        .transpose()?,
                    swa_full_ratio: swa_full_tokens_ratio,
                    zero_on_handout: self.zero_on_handout,
                },
            )?),
        };
        let window = m.window as usize;
        if let Some(wrap) = self.wrap {
            alloc = wrap(alloc);
        }
        // One scope for the cache: the allocator (through any wrapper) and the tree count
        // their breaches where the step boundary polls.
        let scope = Scope::new();
        alloc.set_invariant_scope(scope.clone());
        let tree_config = if has_swa {
            TreeConfig::swa(self.page_size, window)
        } else {
            TreeConfig::full_only(self.page_size)
        };
        let tree_config = match states {
            Some(policy) => {
                let tree_config = tree_config.with_mamba().with_mamba_path_cap(MAMBA_PATH_CAP);
                match policy.interval() {
                    Some(interval) => {
                        tree_config.with_mamba_checkpoint_interval(interval.get() as usize)
                    }
                    None => tree_config,
                }
            }
            None => tree_config,
        };
        let mut tree = RadixTree::new(tree_config)?;
        tree.set_invariant_scope(scope.clone());
        // Frees are grouped per step: a freed virtual id is recycled only at a flush (the
        // boundary, or an eviction loop), never while an action naming it is unapplied.
        alloc.free_group_begin()?;
        Ok(HybridCache {
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            alloc,
            tree,
            scope,
            model: self.model,
            layout: self.layout,
            ps: self.page_size as usize,
            window,
            interval: self
                .eviction_interval
                .unwrap_or(self.page_size.max(DEFAULT_EVICTION_INTERVAL))
                as usize,
            next_request: 0,
            epoch: 0,
            step: 0,
            live_requests: 0,
            held_full_pages: 0,
            held_swa_pages: 0,
            hit_tokens: 0,
            kv_hit_tokens: 0,
            admitted_prompt_tokens: 0,
            evictions: EvictionCounts::default(),
            has_swa,
            states,
            held_slots: 0,
            scratch: Vec::new(),
            decode_scratch: Vec::new(),
            device: step_device,
            mirror_generation: 0,
            step_table: None,
            plan: CheckpointPlan::default(),
        })
    }
}

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
    /// The device table step metadata is uploaded to (reused, grown when short).
    step_table: Option<StepTable>,
    /// The checkpoint plan of an allocation (reused across calls).
    plan: CheckpointPlan,
}

impl HybridCache {
    /// A builder with the defaults: gpt-oss-20b, page size 1, unified, CPU device.
    pub fn builder() -> HybridCacheBuilder {
        HybridCacheBuilder {
            model: ModelSpec::GPT_OSS_20B,
            page_size: 1,
            memory_bytes: 0,
            layout: Layout::Unified,
            device: None,
            eviction_interval: None,
            zero_on_handout: false,
            checkpoint_interval: None,
            checkpoints_per_step: None,
            wrap: None,
        }
    }

    /// The model.
    pub fn model(&self) -> &ModelSpec {
        &self.model
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

    /// Distinguishes this cache from every other one in the process.
    pub(crate) fn cache_id(&self) -> u64 {
        self.id
    }

    /// Refuses a request of another cache.
    pub(crate) fn check_request(&self, req: &Request) -> Result<(), Error> {
        self.check_owner(req)
    }

    /// Uploads a step's metadata image into the step table (one op), growing the table
    /// first when it is too short. A failed upload leaves the table as it was.
    pub(crate) fn upload_step_table(&mut self, image: &[i32]) -> Result<TableId, Error> {
        let table = match self.step_table {
            Some(t) if t.len >= image.len() => t,
            old => {
                let len = image.len().max(old.map_or(0, |t| 2 * t.len)).max(1024);
                let id = self.device.alloc_table(len, 0)?;
                if let Some(old) = old {
                    // Set-up work, off the steady state: a table only grows.
                    self.device.free_table(old.id)?;
                }
                let t = StepTable { id, len };
                self.step_table = Some(t);
                t
            }
        };
        self.device.upload_table(table.id, 0, image)?;
        Ok(table.id)
    }

    /// The prefix tree, for read-only inspection (sizes, dumps).
    pub fn tree(&self) -> &RadixTree {
        &self.tree
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
        PrefixMatch {
            tokens: prompt,
            result,
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
        // reserved decode save (a decoding request rewrites its one checkpoint slot).
        let slots = self.states.map_or(0, |policy| {
            let mut at = Vec::new();
            policy.plan(cached..target, Self::marks(&hit.tokens, result), &mut at);
            1 + at.len()
        });
        let pages = target.div_ceil(self.ps) - cached / self.ps;
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
        let state = match self.states {
            Some(_) => {
                let matched = if cached > 0 {
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
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let id = self.next_request;
        self.next_request += 1;
        self.live_requests += 1;
        self.hit_tokens += cached as u64;
        self.kv_hit_tokens += hit.result.full_hit.0 as u64;
        self.admitted_prompt_tokens += hit.tokens.len() as u64;
        let row = hit.result.values.iter().map(|v| PoolToken(v.0)).collect();
        Ok(Request {
            id,
            cache: self.id,
            tokens: hit.tokens,
            row,
            protected: cached,
            cursor: cached,
            lock,
            window_lock_released: false,
            cached_at_admission: cached,
            kv_hit_at_admission: hit.result.full_hit.0,
            state,
        })
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

    /// Plans the checkpoints of `req` growing to `new_len` rows in this step into `plan`.
    /// The new writes go first into the slots of checkpoints it holds from earlier steps,
    /// oldest first (the tree never saw them, and a deeper state supersedes them), then
    /// into fresh slots; a request holds at most [`StatePolicy::checkpoints_per_step`]
    /// checkpoints, so when the bound is reached the plan keeps its deepest positions.
    /// So a decoding request rewrites one checkpoint slot; an engine keeps each prefill
    /// chunk's states by caching the request after the chunk.
    fn plan_checkpoints(&self, req: &Request, new_len: usize, plan: &mut CheckpointPlan) {
        let fresh_start = plan.fresh;
        let (Some(policy), Some(state)) = (self.states, &req.state) else {
            plan.requests.push(Planned {
                fresh_start,
                ..Planned::default()
            });
            return;
        };
        let first = plan.at.len();
        policy.plan(req.len()..new_len, state.marks, &mut plan.at);
        let cap = policy.checkpoints_per_step() as usize;
        let planned = plan.at.len() - first;
        let older = state
            .held
            .iter()
            .take_while(|(_, step)| *step < self.step)
            .count();
        let keep = planned.min(cap.saturating_sub(state.held.len() - older));
        let reuse = keep.min(older);
        plan.at.drain(first..first + planned - keep);
        plan.fresh += keep - reuse;
        plan.requests.push(Planned {
            start: first,
            new: keep,
            reuse,
            fresh_start,
        });
    }

    /// Allocates the fresh slots `plan` writes into (the caller made room for them).
    fn alloc_checkpoint_slots(&mut self, plan: &mut CheckpointPlan) -> Result<(), Error> {
        plan.slots.clear();
        if plan.fresh == 0 {
            return Ok(());
        }
        self.alloc
            .alloc_slots(plan.fresh, &mut plan.slots)
            .map_err(|e| self.out_of_memory(e))
    }

    /// Makes room for `pages` new KV pages and `plan`'s checkpoint slots together, takes
    /// the slots, then runs `alloc_kv`; when that fails the slots go back, so the
    /// allocation changes nothing. With [`Checkpoints::BestEffort`], when memory cannot
    /// hold the KV and the fresh slots together (after evicting what the tree can give),
    /// the step saves only into the slots the requests already hold, priced on the KV
    /// alone.
    fn alloc_with_checkpoints(
        &mut self,
        pages: usize,
        plan: &mut CheckpointPlan,
        checkpoints: Checkpoints,
        alloc_kv: impl FnOnce(&mut Self) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let kv = self.kv_demand(pages);
        match self.make_room(PageDemand {
            mamba_slots: plan.fresh,
            ..kv
        }) {
            Err(Error::OutOfMemory { .. })
                if plan.fresh > 0 && checkpoints == Checkpoints::BestEffort =>
            {
                plan.drop_fresh();
                self.make_room(kv)?;
            }
            other => other?,
        }
        self.alloc_checkpoint_slots(plan)?;
        let result = alloc_kv(self);
        if result.is_err() && !plan.slots.is_empty() {
            self.alloc.free_batch(&[FreeOp::Slots(&plan.slots)]);
        }
        result
    }

    /// Records the checkpoints `plan` gave `req` (its `i`-th request), which the engine
    /// writes in this step's forward: into the slots of the held checkpoints they
    /// replace, then into fresh ones.
    fn commit_checkpoints(&mut self, req: &mut Request, plan: &CheckpointPlan, i: usize) {
        let Some(state) = &mut req.state else {
            return;
        };
        state.pending.clear();
        let p = plan.requests[i];
        let reused: Vec<VirtualSlot> = state.held.drain(..p.reuse).map(|(w, _)| w.slot).collect();
        let fresh = &plan.slots[p.fresh_start..p.fresh_start + p.new - p.reuse];
        for (&at_len, &slot) in plan.at[p.start..p.start + p.new]
            .iter()
            .zip(reused.iter().chain(fresh))
        {
            let write = CheckpointWrite { slot, at_len };
            state.held.push((write, self.step));
            state.pending.push(write);
        }
        self.held_slots += fresh.len();
    }

    // ----- allocation ------------------------------------------------------------------

    /// Allocates KV for the next `tokens` prompt tokens of `req` (a prefill chunk). SWA
    /// that left the window is released first; when memory is short, unlocked prefixes
    /// are evicted. On error the request is as it was (see [`Error`]).
    pub fn alloc_extend(&mut self, req: &mut Request, tokens: usize) -> Result<(), Error> {
        self.check_owner(req)?;
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
        self.plan_checkpoints(req, len + tokens, &mut plan);
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
        // The batch's SWA that left the window, in one allocator call.
        let released: Vec<(usize, std::ops::Range<usize>)> = batch
            .iter()
            .enumerate()
            .filter_map(|(i, req)| self.out_of_window(req).map(|rows| (i, rows)))
            .collect();
        if !released.is_empty() {
            let segments: Vec<Segment<'_>> = released
                .iter()
                .map(|(i, rows)| Segment::of_row(&batch[*i].row, rows.clone()))
                .collect();
            self.alloc.free_swa_segments(&segments)?;
            for (i, rows) in released {
                self.window_released(batch[i], rows.end)?;
            }
        }
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
            self.plan_checkpoints(req, req.len() + 1, &mut plan);
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

    /// Releases the SWA KV of `req`'s rows that left the window: once the cursor lags by at
    /// least the eviction interval, it moves up to `⌊len⌋ − ⌈W⌉` (whole pages: `len`
    /// rounded down, the window rounded up). So the live SWA behind the last whole page,
    /// where a follow-up turn's match ends, covers at least a window even when the page
    /// size does not divide it; and the live SWA behind `len` covers one too. The cursor
    /// only moves up, stays page-aligned and never goes below the tree-owned prefix.
    /// Returns the tokens released. Called by the alloc methods; engines may call it too.
    pub fn release_out_of_window(&mut self, req: &mut Request) -> Result<usize, Error> {
        self.check_owner(req)?;
        let Some(rows) = self.out_of_window(req) else {
            return Ok(0);
        };
        self.alloc
            .free_swa_segment(Segment::of_row(&req.row, rows.clone()))?;
        self.window_released(req, rows.end)?;
        Ok(rows.len())
    }

    /// The rows of `req` whose SWA [`HybridCache::release_out_of_window`] releases now
    /// (from the cursor to the new cursor), if any.
    fn out_of_window(&self, req: &Request) -> Option<std::ops::Range<usize>> {
        if !self.has_swa {
            return None;
        }
        let len = req.len();
        let evicted = req.cursor.max(req.protected);
        let keep = self.window.div_ceil(self.ps) * self.ps;
        if len < evicted + keep + self.interval {
            return None;
        }
        let new_cursor = len / self.ps * self.ps - keep;
        (new_cursor > evicted).then_some(evicted..new_cursor)
    }

    /// Moves `req`'s cursor to `new_cursor` once the SWA below it is freed.
    fn window_released(&mut self, req: &mut Request, new_cursor: usize) -> Result<(), Error> {
        let before = self.held(req);
        req.cursor = new_cursor;
        self.account(before, self.held(req));
        // Once the window has left the cached prefix, the prefix's SWA may be evicted.
        if let Some(lock) = req.lock
            && !req.window_lock_released
            && new_cursor >= req.protected
        {
            self.tree.release_window(lock)?;
            req.window_lock_released = true;
            self.epoch += 1;
        }
        Ok(())
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
    /// Call it once the step's allocations are done (before or after the forward).
    pub fn cache_unfinished(&mut self, req: &mut Request) -> Result<(), Error> {
        self.check_owner(req)?;
        let before = self.held(req);
        let checkpoints = self.held_checkpoints(req);
        let outcome = self.insert(req, true, &checkpoints)?;
        self.handed_to_tree(req, checkpoints.len());
        let cached = outcome.cached_len.0;
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
        let before = self.held(&req);
        let len = req.len();
        let mut checkpoints = self.held_checkpoints(&req);
        let mut running = req.state.as_ref().map(|s| s.running);
        if let Some(slot) = running
            && len > 0
            && len.is_multiple_of(self.ps)
            && checkpoints.last().is_none_or(|c| c.at.0 < len)
        {
            // The forward that wrote it may be this step's.
            checkpoints.push(StateCheckpoint {
                at: Tokens(len),
                slot: MambaSlot(slot.0),
                in_flight: true,
            });
            running = None;
        }
        let outcome = self.insert(&req, false, &checkpoints)?;
        let cached = outcome.cached_len.0;
        self.alloc.free_batch(&[FreeOp::KvRow {
            row: &req.row,
            dead_lo: cached,
            cursor: req.cursor.max(cached),
            len,
        }]);
        if let Some(state) = &req.state {
            // The tree took (or handed back through its actions) every checkpoint and,
            // unless `running` is still set, the running slot.
            if let Some(slot) = running {
                self.alloc.free_batch(&[FreeOp::Slots(&[slot])]);
            }
            self.held_slots -= 1 + state.held.len();
        }
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
    pub fn release(&mut self, req: Request) -> Result<Vec<TokenId>, Error> {
        self.check_owner(&req)?;
        let before = self.held(&req);
        let len = req.len();
        let dead_lo = req.protected;
        self.alloc.free_batch(&[FreeOp::KvRow {
            row: &req.row,
            dead_lo,
            cursor: req.cursor.max(dead_lo),
            len,
        }]);
        if let Some(state) = &req.state {
            let slots = state.slots();
            self.alloc.free_batch(&[FreeOp::Slots(&slots)]);
            self.held_slots -= slots.len();
        }
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
        let key_len = req.len() / self.ps * self.ps;
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
        Ok(outcome)
    }

    // ----- actions and eviction ----------------------------------------------------------

    /// Applies the tree's actions to the allocator, in the tree's order. This is the one
    /// place actions turn into frees.
    ///
    /// Virtual-id recycling: the cache keeps a free group open for the whole step, so
    /// two-sided and FULL-only frees (the only ones that recycle virtual ids) are
    /// deferred until the next flush; SWA-only frees and transfers, which act at once,
    /// never recycle an id. Flushes do happen mid-step: the eviction loop
    /// (`evict_to_free`, and any allocation short of memory), `evict_all` and
    /// `can_admit` apply the deferred frees before pricing or after each eviction, and
    /// the next allocation may hand the freed ids to another request in the same step.
    /// What keeps that safe is narrower than "nothing recycles before the boundary":
    /// every action list the tree returns is applied whole, here, with no flush and no
    /// allocation between its actions, and the tree no longer names an id once the list
    /// that frees it is returned. So no id is recycled while an action naming it is
    /// unapplied.
    ///
    /// Applying cannot fail: the tree has already changed, so the frees go to the
    /// allocator as one [`KvAllocator::free_batch`], whose signature has no error (a free
    /// the allocator would refuse is an invariant breach, contained there). Nothing can
    /// leave the tree and the allocator disagreeing halfway through a list.
    fn apply(&mut self, actions: &[Action]) {
        use std::ops::Range;
        /// One free, its tokens as a range of the flattened list.
        enum Planned {
            Both(Range<usize>),
            Full(Range<usize>),
            Swa(Range<usize>),
            Transfer(Range<usize>, Range<usize>),
        }
        let mut tokens = std::mem::take(&mut self.scratch);
        tokens.clear();
        let mut push = |t: &[TreeToken]| {
            let start = tokens.len();
            tokens.extend(t.iter().map(|t| PoolToken(t.0)));
            start..tokens.len()
        };
        let mut planned = Vec::with_capacity(actions.len() + 1);
        let mut slots: Vec<VirtualSlot> = Vec::new();
        for action in actions {
            match action {
                Action::FreeDeviceKv { tokens } => planned.push(Planned::Both(push(tokens))),
                Action::FreeDeviceKvFullOnly { tokens } => {
                    planned.push(Planned::Full(push(tokens)))
                }
                // The node's new value already has live SWA in both layouts.
                Action::SwaRebuild { .. } => {}
                Action::RecoverSwaWithLockedFull { kept, incoming, .. } => {
                    let (from, to) = (push(incoming), push(kept));
                    planned.push(Planned::Transfer(from.clone(), to));
                    planned.push(Planned::Full(from));
                }
                Action::EvictNode { tokens, swa, .. } => {
                    let range = push(tokens);
                    planned.push(match swa {
                        SwaSide::Live => Planned::Both(range),
                        SwaSide::Tombstone => Planned::Full(range),
                    });
                    self.evictions.full_nodes += 1;
                    self.evictions.full_tokens += tokens.len() as u64;
                }
                Action::TombstoneSwa { tokens, .. } => {
                    planned.push(Planned::Swa(push(tokens)));
                    self.evictions.swa_tombstones += 1;
                    self.evictions.swa_tokens += tokens.len() as u64;
                }
                Action::EvictMambaState { slot, .. } => {
                    slots.push(VirtualSlot(slot.0));
                    self.evictions.mamba_states += 1;
                }
                Action::FreeMambaSlot { slot } => slots.push(VirtualSlot(slot.0)),
            }
        }
        let seg = |r: &Range<usize>| Segment {
            tokens: &tokens[r.clone()],
            start: 0,
        };
        let mut frees: Vec<FreeOp<'_>> = planned
            .iter()
            .map(|p| match p {
                Planned::Both(r) => FreeOp::Segment(seg(r)),
                Planned::Full(r) => FreeOp::FullSegment(seg(r)),
                Planned::Swa(r) => FreeOp::SwaSegment(seg(r)),
                Planned::Transfer(from, to) => FreeOp::TransferSwa {
                    from: seg(from),
                    to: seg(to),
                },
            })
            .collect();
        // Slots have their own ids: their frees commute with the pages'.
        if !slots.is_empty() {
            frees.push(FreeOp::Slots(&slots));
        }
        if !frees.is_empty() {
            self.alloc.free_batch(&frees);
        }
        drop(frees);
        self.scratch = tokens;
    }

    /// Evicts unlocked prefixes until `full_pages` FULL and `swa_pages` SWA pages can be
    /// allocated together: deferred frees are flushed first (so freed memory is not
    /// evicted for again), then the allocator's minimum reclaim plan is evicted from the
    /// tree, FULL before SWA, and the fit is checked again. A demand beyond a side's total
    /// is [`Error::OutOfMemory`] at once, with nothing flushed or evicted.
    pub fn evict_to_free(&mut self, full_pages: usize, swa_pages: usize) -> Result<(), Error> {
        self.make_room(PageDemand::pages(full_pages, swa_pages))
    }

    fn make_room(&mut self, demand: PageDemand) -> Result<(), Error> {
        if !self.could_ever_fit(demand) {
            return Err(self.oom(demand));
        }
        if self.alloc.allocation_fits(demand) {
            return Ok(());
        }
        let ps = self.ps;
        loop {
            let sizes = self.tree.sizes();
            let evictable = Reclaimable {
                full_pages: sizes.full_evictable.0 / ps,
                swa_pages: sizes.swa_evictable.0 / ps,
                mamba_slots: sizes.mamba_evictable.0,
            };
            // Flushes every deferred list first (so a recheck sees what the last pass
            // freed), then sizes the least eviction: SWA, then Mamba states, then FULL,
            // the byte donor of a slot demand.
            let Some(plan) = self.alloc.reclaim_plan(demand, evictable) else {
                return Err(self.oom(demand));
            };
            if plan.full_pages == 0 && plan.swa_pages == 0 && plan.mamba_slots == 0 {
                return self
                    .alloc
                    .ensure_capacity(demand)
                    .map_err(|e| self.out_of_memory(e));
            }
            // FULL before SWA, and the plan and the fit checked again after each pass: the
            // plan prices SWA and FULL reclaim separately, but evicting a FULL leaf frees
            // its SWA too, so evicting the plan's counts whole over-evicts. A FULL pass
            // evicts node by node up to the plan's floor (at least one node): no fit needs
            // less FULL, so a recheck before it would evict the same nodes again.
            let actions = if plan.full_pages > 0 {
                let floor = plan.full_floor_pages.max(1);
                let (actions, _) = self
                    .tree
                    .evict_until(Component::Full, |r| r.full.0 / ps >= floor);
                // Only a shared buffer gives FULL bytes to slots.
                if demand.mamba_slots > 0 && self.layout == Layout::Unified {
                    self.evictions.donor_nodes += actions
                        .iter()
                        .filter(|a| matches!(a, Action::EvictNode { .. }))
                        .count() as u64;
                }
                Some(actions).filter(|a| !a.is_empty())
            } else if plan.swa_pages > 0 {
                self.tree.evict_one(Component::Swa)
            } else {
                self.tree.evict_one(Component::Mamba)
            };
            let Some(actions) = actions else {
                return Err(self.oom(demand));
            };
            self.epoch += 1;
            self.apply(&actions);
            self.alloc.flush_deferred();
        }
    }

    /// Evicts every unlocked prefix from the cache (an engine's "flush cache"), applying
    /// the frees at once. Returns the tokens evicted.
    pub fn evict_all(&mut self) -> Result<usize, Error> {
        let (actions, released) = self.tree.evict_until(Component::Full, |_| false);
        self.epoch += 1;
        self.apply(&actions);
        self.alloc.flush_deferred();
        Ok(released.full.0)
    }

    /// Whether `demand` is within each side's total: a larger one cannot fit whatever is
    /// evicted, and is refused before any allocator arithmetic sees it (so no size a
    /// caller passes can overflow there).
    fn could_ever_fit(&self, demand: PageDemand) -> bool {
        let cap = self.alloc.capacity();
        demand.full_pages <= cap.full.total_pages
            && demand.swa_pages <= cap.swa.total_pages
            && demand.mamba_slots <= cap.mamba.total_pages
    }

    fn oom(&self, demand: PageDemand) -> Error {
        let cap = self.alloc.capacity();
        Error::OutOfMemory {
            full_pages: demand.full_pages,
            swa_pages: demand.swa_pages,
            mamba_slots: demand.mamba_slots,
            full_available: cap.full.schedulable_pages,
            swa_available: cap.swa.schedulable_pages,
            mamba_available: cap.mamba.schedulable_pages,
        }
    }

    fn out_of_memory(&self, e: unikv_pools::Error) -> Error {
        match e {
            unikv_pools::Error::OutOfCapacity {
                full_pages,
                swa_pages,
                ..
            } => self.oom(PageDemand::pages(full_pages, swa_pages)),
            unikv_pools::Error::OutOfSlots { requested, .. } => {
                self.oom(PageDemand::slots(requested))
            }
            other => Error::Pool(other),
        }
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
        let conservation = self.check_conservation();
        let uploaded = self.sync_mirror();
        let reopened = if self.alloc.in_free_group() {
            Ok(())
        } else {
            self.alloc.free_group_begin()
        };
        // The step's forward is ordered before anything a later match issues.
        self.tree.publish_states();
        let sane = if self.step.is_multiple_of(TREE_SANITY_INTERVAL) {
            self.tree.sanity_check_at_strict()
        } else {
            Ok(())
        };
        self.step += 1;
        // Polled on every path, a failing one included, so no breach stays pending for
        // the next step (the drained ones stay counted in the scope's report).
        let polled = self.scope.poll();
        closed?;
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
                self.held_full_pages,
            ),
            swa: side(
                "swa",
                Side::Swa,
                &cap.swa,
                sizes.swa_evictable.0,
                sizes.swa_protected.0,
                self.held_swa_pages,
            ),
            // A slot is a page of one: its counts go through `side` times the page size.
            mamba: side(
                "mamba",
                Side::Mamba,
                &cap.mamba,
                sizes.mamba_evictable.0 * ps,
                sizes.mamba_protected.0 * ps,
                self.held_slots,
            ),
            live_requests: self.live_requests,
            hit_tokens: self.hit_tokens,
            kv_hit_tokens: self.kv_hit_tokens,
            admitted_prompt_tokens: self.admitted_prompt_tokens,
            evictions: self.evictions,
        }
    }
}

impl Drop for HybridCache {
    /// Frees the step table (the allocator frees its own memory when it drops next), so a
    /// dropped cache leaves the device as it found it.
    fn drop(&mut self) {
        if let Some(table) = self.step_table.take() {
            // Nothing to report to: a failed free of a table no one reads only leaks it.
            let _ = self.device.free_table(table.id);
        }
    }
}

/// The checkpoints one allocation plans, request by request (reused across calls).
#[derive(Debug, Default)]
struct CheckpointPlan {
    /// Positions to save, request after request, ascending within a request.
    at: Vec<usize>,
    /// Per request of the allocation, in order.
    requests: Vec<Planned>,
    /// Fresh slots the plan needs (positions not written into a reused slot).
    fresh: usize,
    /// The fresh slots, request after request.
    slots: Vec<VirtualSlot>,
}

impl CheckpointPlan {
    fn clear(&mut self) {
        self.at.clear();
        self.requests.clear();
        self.fresh = 0;
        self.slots.clear();
    }

    /// Drops every position that needs a fresh slot: each request keeps its deepest
    /// positions, as many as it reuses held slots for.
    fn drop_fresh(&mut self) {
        let all = std::mem::take(&mut self.at);
        for p in &mut self.requests {
            let kept = &all[p.start + p.new - p.reuse..p.start + p.new];
            p.start = self.at.len();
            self.at.extend_from_slice(kept);
            p.new = p.reuse;
            p.fresh_start = 0;
        }
        self.fresh = 0;
    }
}

/// Whether an allocation may go without the fresh slots its checkpoints need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Checkpoints {
    /// A prefill chunk's states (the branching point, the prompt's end, grid points)
    /// are what later requests resume from, and `can_admit` priced them: without room
    /// for them the allocation fails like one short of KV.
    Required,
    /// A decoding request's states serve only its own follow-up turn: they are worth
    /// future hits, never a retraction now, so without room they are not saved.
    BestEffort,
}

/// One request's part of a [`CheckpointPlan`].
#[derive(Clone, Copy, Debug, Default)]
struct Planned {
    /// Its first position in `at`.
    start: usize,
    /// Positions planned.
    new: usize,
    /// Held checkpoints (its oldest) whose slots the first positions are written into.
    reuse: usize,
    /// Its first fresh slot in `slots`.
    fresh_start: usize,
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

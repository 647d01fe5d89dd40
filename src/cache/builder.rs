//! [`HybridCacheBuilder`]: the layout, the model, the budget and the knobs, validated
//! once into a [`HybridCache`]; and the static layout's slot pool sizing.

use super::{CheckpointPlan, HybridCache};
use crate::error::Error;
use crate::model::ModelSpec;
use crate::stats::EvictionCounts;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use unikv_invariants::Scope;
use unikv_kernels::{CpuDevice, Device};
use unikv_mamba::StatePolicy;
use unikv_pools::{
    KvAllocator, PrefixCaching, REFERENCE_MAMBA_FULL_MEMORY_RATIO, Side, StaticSlots, StaticSwa,
    StaticSwaConfig, UnifiedSwa, UnifiedSwaConfig, reference_slot_pool,
};
use unikv_radix::{RadixTree, TreeConfig};

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
    /// The reference engine's default `--swa-full-tokens-ratio`: the ratio of a
    /// [`Layout::Static`] parsed from `"static"`.
    pub const DEFAULT_SWA_FULL_TOKENS_RATIO: f64 = 0.8;

    /// `static` or `unified`.
    pub const fn as_str(&self) -> &'static str {
        match self {
            Layout::Static { .. } => "static",
            Layout::Unified => "unified",
        }
    }
}

/// `static` or `unified` (the ratio is not shown).
impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `static` (with [`Layout::DEFAULT_SWA_FULL_TOKENS_RATIO`]) or `unified`, in lower case
/// as [`Layout::as_str`] writes them; any other name is [`Error::Config`].
impl FromStr for Layout {
    type Err = Error;

    fn from_str(name: &str) -> Result<Layout, Error> {
        match name {
            "static" => Ok(Layout::Static {
                swa_full_tokens_ratio: Layout::DEFAULT_SWA_FULL_TOKENS_RATIO,
            }),
            "unified" => Ok(Layout::Unified),
            _ => Err(Error::Config(format!(
                "unknown layout {name:?} (expected static or unified)"
            ))),
        }
    }
}

/// The fixed slot pool [`Layout::Static`] gives a model whose state slots are `spec`, in
/// a budget of `memory_bytes`: the reference engine's default split of the budget between
/// states and KV ([`reference_slot_pool`] with [`REFERENCE_MAMBA_FULL_MEMORY_RATIO`] and a
/// radix prefix cache, which every [`HybridCache`] keeps; it sizes the pool for a third
/// of the slots running, a request holding at most its running slot and two
/// checkpoints by default). The builder and
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

/// The state slots the static layout adds to its reference slot pool for verify
/// scratch ([`crate::Speculation::scratch_groups`] lanes of `shape`; under the copy
/// rollback `max_width` slots each): the draft positions' entries live beyond the pool
/// the reference sizes for running and cached states, as SGLang's
/// `intermediate_ssm_state_cache` is a buffer apart from its Mamba pool, sized by the
/// running batch × draft tokens. The KV pools get the rest of the budget. 0 without
/// speculation. [`HybridCache::scratch_shape`] gives a built cache's shape.
pub fn verify_scratch_slots(
    speculation: Option<crate::Speculation>,
    shape: crate::ScratchShape,
) -> u32 {
    speculation.map_or(0, |s| shape.slots_for(s.scratch_groups() as u32))
}

/// The default eviction interval in tokens at small page sizes: releasing a request's
/// out-of-window SWA every 16 tokens instead of every token cuts the per-step cost of a
/// 256-request decode batch at page size 1 by about 40% (`cargo bench -p unikv --bench
/// step`) for 16 more SWA tokens per request.
pub const DEFAULT_EVICTION_INTERVAL: u32 = 16;

/// At most this many cached recurrent states on one root-to-leaf path of the prefix
/// tree (the reference engine caps them per path too): beyond it, unlocked ones are
/// evicted when an insert adds one, so one long conversation cannot fill the slot pool
/// with checkpoints of itself. Those that serve no other request go first (see
/// [`unikv_radix::TreeConfig::mamba_path_cap`]): a request's own chunk states never push
/// out the state a shared prompt's later requests resume from.
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
    speculation: Option<crate::Speculation>,
    replay: Option<Arc<dyn crate::StateReplay>>,
    wrap: Option<AllocatorWrapper>,
    host_memory_bytes: u64,
    host_write_policy: super::HostWritePolicy,
}

/// The shape of the verify scratch's lanes: a state per entry under the copy rollback,
/// log entries packed into slots under `replay`'s. Refuses a replay rollback without
/// speculation or recurrent layers, a log entry of 0 bytes or past a slot, and
/// [`crate::BookkeepingReplay`] on a device with bytes.
fn scratch_shape(
    m: &ModelSpec,
    speculation: Option<crate::Speculation>,
    slot_bytes: Option<u64>,
    replay: Option<&dyn crate::StateReplay>,
    device: &dyn Device,
) -> Result<crate::ScratchShape, Error> {
    let width = speculation.map_or(1, |s| s.max_width);
    let Some(replay) = replay else {
        return Ok(crate::ScratchShape::copy(width));
    };
    let (Some(_), Some(slot_bytes)) = (speculation, slot_bytes) else {
        return Err(Error::Config(format!(
            "model {}: a state replay needs speculation on a model with recurrent layers",
            m.name
        )));
    };
    if !replay.moves_bytes() && device.holds_bytes() {
        return Err(Error::Config(format!(
            "a bookkeeping replay moves no bytes, but device {} holds them: register the \
             engine's replay kernel",
            device.name()
        )));
    }
    let log = replay.log_bytes_per_position();
    crate::ScratchShape::replaying(width, slot_bytes, log).ok_or_else(|| {
        Error::Config(format!(
            "model {}: a log entry of {log} bytes per position (1 ..= the state slot's \
             {slot_bytes})",
            m.name
        ))
    })
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
            .field("speculation", &self.speculation)
            .field("replay", &self.replay)
            .field("wrapped", &self.wrap.is_some())
            .field("host_memory_bytes", &self.host_memory_bytes)
            .field("host_write_policy", &self.host_write_policy)
            .finish()
    }
}

impl HybridCacheBuilder {
    /// The defaults [`HybridCache::builder`] starts from.
    pub(super) fn defaults() -> Self {
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
            speculation: None,
            replay: None,
            wrap: None,
            host_memory_bytes: 0,
            host_write_policy: super::HostWritePolicy::WriteBack,
        }
    }

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

    /// Builds the cache for speculative decoding: verify steps of up to
    /// [`crate::Speculation::max_width`] positions per request
    /// ([`HybridCache::alloc_verify`]), settled up to
    /// [`crate::Speculation::max_in_flight`] steps late ([`HybridCache::settle`]). On
    /// a model with recurrent layers each unsettled verify writes a scratch group of
    /// `max_width` state slots the cache keeps for verifies (never a request's, never in
    /// the tree); the static layout sizes them beyond its reference slot pool
    /// ([`verify_scratch_slots`]). Default: none (a verify step is
    /// [`Error::SpeculationOff`]). A bad setting ([`crate::Speculation`]'s ranges) is
    /// [`Error::Config`].
    pub fn speculation(mut self, speculation: crate::Speculation) -> Self {
        self.speculation = Some(speculation);
        self
    }

    /// Rolls verified recurrent state back by the engine's replay
    /// ([`crate::StateReplay`]) instead of copying it out of per-position states: a
    /// verify logs each position's recurrence inputs (a log entry, many to a state slot)
    /// and settling hands `replay` the accepted entries to replay from the running state.
    /// Only with speculation on a model with recurrent layers; a log entry larger than a
    /// state slot, or [`crate::BookkeepingReplay`] on a device with bytes, is
    /// [`Error::Config`]. Default: the copy rollback.
    pub fn state_replay(mut self, replay: Arc<dyn crate::StateReplay>) -> Self {
        self.replay = Some(replay);
        self
    }

    /// Gives the cache a host tier of `bytes` (default 0: none): prefixes the device
    /// evicts are written back to a host buffer (pinned on CUDA) and a later prompt that
    /// matches them loads them back instead of recomputing them
    /// ([`crate::PrefixMatch::host_tokens`]). The buffer holds FULL pages, the SWA
    /// window's pages behind a written-back position and recurrent states
    /// ([`crate::HostStats`]). A size that holds no page, state or frame is
    /// [`Error::Config`].
    pub fn host_memory_bytes(mut self, bytes: u64) -> Self {
        self.host_memory_bytes = bytes;
        self
    }

    /// When the host tier copies a device prefix (default
    /// [`crate::HostWritePolicy::WriteBack`]: on eviction). Only with
    /// [`HybridCacheBuilder::host_memory_bytes`]; a selective write-through of 0 hits is
    /// [`Error::Config`].
    pub fn host_write_policy(mut self, policy: crate::HostWritePolicy) -> Self {
        self.host_write_policy = policy;
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
        if let Some(spec) = self.speculation {
            spec.check().map_err(Error::Config)?;
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
        let shape = scratch_shape(
            m,
            self.speculation,
            slots.as_ref().map(|s| s.bytes_per_slot),
            self.replay.as_deref(),
            &*device,
        )?;
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
                        .map(|spec| {
                            static_slot_pool(spec, self.memory_bytes).map(|pool| StaticSlots {
                                slots: pool.slots + verify_scratch_slots(self.speculation, shape),
                                ..pool
                            })
                        })
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
        // The host tree is the device tree's twin without the path cap (the host keeps
        // what the device evicted, states included).
        let host_config = match states {
            Some(policy) => {
                let tree_config = tree_config.with_mamba();
                match policy.interval() {
                    Some(interval) => {
                        tree_config.with_mamba_checkpoint_interval(interval.get() as usize)
                    }
                    None => tree_config,
                }
            }
            None => tree_config,
        };
        let tree_config = match states {
            Some(_) => host_config.with_mamba_path_cap(MAMBA_PATH_CAP),
            None => host_config,
        };
        let host = if self.host_memory_bytes > 0 {
            let envelope = |side: Side, present: bool| {
                if present {
                    alloc.grid(side).envelope
                } else {
                    0
                }
            };
            let units = [
                envelope(Side::Full, true),
                envelope(Side::Swa, has_swa),
                envelope(Side::Mamba, states.is_some()),
            ];
            Some(super::host::HostTier::new(
                &*step_device,
                self.host_memory_bytes,
                units,
                host_config,
                scope.clone(),
                self.host_write_policy,
            )?)
        } else {
            None
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
            tables: Default::default(),
            plan: CheckpointPlan::default(),
            speculation: self.speculation,
            verify_scratch: super::scratch::VerifyScratch::new(shape),
            replay: self.replay,
            host,
            step_pins: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_prints_and_parses_by_its_lower_case_name() {
        for layout in [
            Layout::Static {
                swa_full_tokens_ratio: Layout::DEFAULT_SWA_FULL_TOKENS_RATIO,
            },
            Layout::Unified,
        ] {
            assert_eq!(layout.to_string().parse::<Layout>().unwrap(), layout);
        }
        assert_eq!(Layout::Unified.to_string(), "unified");
        let err = "Static".parse::<Layout>().unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid cache configuration: unknown layout \"Static\" (expected static or unified)"
        );
    }
}

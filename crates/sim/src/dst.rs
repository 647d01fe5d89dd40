//! Deterministic simulation with injected faults (`unikv sim`, `cargo xtask sim`), in the
//! style of FoundationDB's and TigerBeetle's simulation testing: one seed fixes a random
//! configuration and a random engine driving [`HybridCache`] through it, with device ops
//! and allocator calls failing at random; after every step the run checks what an engine
//! relies on.
//!
//! # What a seed runs
//! [`Scenario::from_seed`] picks a layout, a model (every named spec, its KV rows and
//! recurrent state scaled down so a buffer near the batch-size-1 floor is small; half the
//! time another window), a page size (1 to 64, often larger than the window or not
//! dividing it), a budget from the batch-size-1 floor to a few times it, a fault rate and,
//! for a recurrent model, how many states a request may save in one step (1 to 4).
//! The engine ([`run`]) then steps: arrivals sharing prefixes of a few prompt families,
//! admission priced by `can_admit` and matched against the prefix cache, aborts at every
//! point of a lifecycle (a dropped match, a release after admission, mid-prefill,
//! mid-decode, after `cache_unfinished`), chunked prefill with `cache_unfinished`, batched
//! decode, retraction when memory is short (and re-admission of the prompt), explicit
//! `evict_to_free`, finishing with `cache_finished`, and `step_boundary`.
//!
//! # What it checks
//! - Faults are of two kinds: a device op refused by a [`FaultInjector`] under the cache,
//!   and a fallible allocator call refused unforwarded by a [`Hooked`] allocator the
//!   cache wraps around its own (`wrap_allocator`), as if its device had failed.
//! - Every call that fails with an injected fault changed nothing the engine
//!   holds (the request's row and tokens), the allocator still verifies, and the retry
//!   succeeds (or is refused for memory, as it would have been).
//! - After every step: `verify()` of the allocator, the tree's `sanity_check`, the step
//!   boundary's conservation of every side (the run is at `Strict`), and **data
//!   integrity**: like an engine, the driver stamps every token's KV on every side when it
//!   is written (a byte derived from the token and everything before it, so a prefix hit
//!   must read the same bytes) and every running request's state slot after each forward
//!   and checkpoint; it then reads every running request's KV back **through the device
//!   translation** (the mirror and the translate kernel) and every cached prefix and state
//!   through the host tables, after compaction moves, relays, SWA hand-overs and hits.
//! - Every match equals an **independent oracle**: the longest page-aligned prefix of the
//!   prompt (its last token excluded) that the tree's nodes hold, whose last window of
//!   tokens is SWA-live (or has no tombstone before it) and, for a recurrent model, that
//!   ends at a node holding a state — computed token by token from [`RadixTree::nodes`],
//!   not by the tree's matcher.
//!
//! A failure names its seed and step and the one command that reproduces it.

use crate::rng::SplitMix64;
use std::collections::HashMap;
use std::fmt;
use std::panic::Location;
use std::sync::{Arc, Mutex, PoisonError};
use unikv::invariants::{Level, scoped_level};
use unikv::kernels::{
    ByteSpan, CpuDevice, Device, Error as DeviceError, FaultInjector, HostSync, Readback, TableId,
};
use unikv::mamba::MAX_CHECKPOINTS_PER_STEP;
use unikv::pools::{Call, Hooked, Hooks, KvAllocator, Side, VirtualSlot, VirtualToken};
use unikv::radix::RadixTree;
use unikv::{Error, HybridCache, KvRows, Layout, ModelSpec, RecurrentState, Request, TokenId};

/// One seed's configuration, derived from the seed alone.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// The seed.
    pub seed: u64,
    /// The model, scaled down ([`scaled`]).
    pub model: ModelSpec,
    /// Static or unified.
    pub layout: Layout,
    /// Tokens per page.
    pub page_size: u32,
    /// The buffer's bytes.
    pub memory_bytes: u64,
    /// Steps the engine runs.
    pub steps: usize,
    /// Device faults per thousand device ops.
    pub faults_per_mille: u64,
    /// Recurrent states a request may save in one step (1 to the most the cache allows),
    /// so seeds drive single- and multi-checkpoint steps.
    pub checkpoints_per_step: u32,
}

/// The named models with their KV rows and recurrent state scaled down (head dims / 32,
/// one KV head, state of a few bytes a layer), so a buffer near the batch-size-1 floor is
/// kilobytes; layer counts, windows and which kinds a model has stay.
pub fn scaled(m: ModelSpec) -> ModelSpec {
    let rows = |r: KvRows| {
        if r.kv_heads == 0 {
            r
        } else {
            KvRows::new(1, (r.head_dim / 32).max(1), r.dtype_bytes)
        }
    };
    let recurrent = if m.has_recurrent_state() {
        RecurrentState {
            conv_channels: 4,
            conv_kernel: m.recurrent.conv_kernel.clamp(2, 4),
            heads: 1,
            head_dim: 2,
            state_size: 2,
            conv_dtype_bytes: m.recurrent.conv_dtype_bytes,
            state_dtype_bytes: m.recurrent.state_dtype_bytes,
        }
    } else {
        m.recurrent
    };
    ModelSpec {
        full: rows(m.full),
        swa: rows(m.swa),
        recurrent,
        ..m
    }
}

impl Scenario {
    /// The configuration seed `seed` runs.
    pub fn from_seed(seed: u64) -> Scenario {
        let mut rng = SplitMix64::for_stream(seed, "dst.config");
        let named = ModelSpec::NAMED;
        let mut model = scaled(named[rng.below(named.len() as u64) as usize]);
        if model.swa_layers > 0 && rng.below(2) == 0 {
            model.window = rng.in_range(2, 48) as u32;
        }
        let page_size = [1, 1, 2, 3, 4, 8, 16, 64][rng.below(8) as usize];
        let layout = if rng.below(2) == 0 {
            Layout::Unified
        } else {
            Layout::Static {
                swa_full_tokens_ratio: [0.5, 0.8, 1.0, 2.0][rng.below(4) as usize],
            }
        };
        // The batch-size-1 floor.
        let floor = buildable(model, layout, page_size, 1);
        // From the floor (every admission a struggle) to a few times it.
        let memory_bytes = buildable(model, layout, page_size, floor + floor * rng.below(64) / 16);
        Scenario {
            seed,
            model,
            layout,
            page_size,
            memory_bytes,
            steps: rng.in_range(20, 80) as usize,
            faults_per_mille: [0, 5, 20, 60][rng.below(4) as usize],
            // From the seed, not the stream, so every earlier draw stays what it was.
            checkpoints_per_step: 1 + (seed / 3 % u64::from(MAX_CHECKPOINTS_PER_STEP)) as u32,
        }
    }
}

/// About the least budget from `bytes` up that a cache of `model` builds with: the need
/// the builder states, asked again until a size builds. (The static layout's slot pool
/// is a share of the budget, so its stated need grows with the budget, and at a few pages
/// a larger budget can leave its KV pools short of one request.)
fn buildable(model: ModelSpec, layout: Layout, page_size: u32, bytes: u64) -> u64 {
    let mut bytes = bytes.max(1);
    for _ in 0..64 {
        let built = HybridCache::builder()
            .model(model)
            .layout(layout)
            .page_size(page_size)
            .memory_bytes(bytes)
            .build();
        match built {
            Ok(_) => return bytes,
            Err(Error::Pool(unikv::pools::Error::BufferTooSmall { needed, .. })) => {
                bytes = needed.0.max(bytes + bytes / 8 + 1);
            }
            Err(_) => bytes = bytes.saturating_mul(2),
        }
    }
    bytes
}

/// What a seed did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Steps run.
    pub steps: usize,
    /// Requests admitted (re-admissions after a retraction included).
    pub admitted: usize,
    /// Requests finished into the prefix cache.
    pub finished: usize,
    /// Requests aborted or retracted.
    pub released: usize,
    /// Prompt tokens served from the prefix cache.
    pub hit_tokens: usize,
    /// Faults injected, of both kinds (each one checked and retried).
    pub faults: usize,
    /// Of those, allocator calls refused through `wrap_allocator`.
    pub allocator_faults: usize,
    /// Token and state stamps read back and checked.
    pub stamps_checked: u64,
    /// Recurrent-state checkpoints the cache asked the engine to save.
    pub checkpoint_writes: u64,
    /// Forwards that saved more than one checkpoint of one request.
    pub multi_checkpoint_forwards: u64,
}

/// A seed that broke a check.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The seed.
    pub seed: u64,
    /// The step it broke in.
    pub step: usize,
    /// What broke.
    pub what: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {} failed at step {}: {}\n  reproduce: cargo xtask sim --seed {}",
            self.seed, self.step, self.what, self.seed
        )
    }
}

/// The stamp of a token's KV on `side`: a byte of the hash of the token and everything
/// before it (never 0, what zeroing writes).
fn kv_stamp(prefix_hash: u64, side: Side) -> u8 {
    let h = match side {
        Side::Full => prefix_hash,
        _ => prefix_hash.rotate_left(17) ^ 0x5a5a,
    };
    (h % 255) as u8 + 1
}

/// The recurrent state after `hash`'s prefix (never 0).
fn state_stamp(prefix_hash: u64) -> u8 {
    (prefix_hash.rotate_left(41) % 255) as u8 + 1
}

/// Extends a prefix hash by one token (FNV-1a over the token's bytes).
fn hash_next(h: u64, t: TokenId) -> u64 {
    let mut h = h;
    for b in t.0.to_le_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const HASH_START: u64 = 0xcbf2_9ce4_8422_2325;

/// The prefix hashes of `tokens`: entry `i` is the hash of `tokens[..=i]`.
fn prefix_hashes(tokens: &[TokenId]) -> Vec<u64> {
    let mut h = HASH_START;
    tokens
        .iter()
        .map(|&t| {
            h = hash_next(h, t);
            h
        })
        .collect()
}

/// The hash of the empty prefix or of `tokens[..len]`.
fn hash_at(hashes: &[u64], len: usize) -> u64 {
    if len == 0 {
        HASH_START
    } else {
        hashes[len - 1]
    }
}

/// A running request as the engine holds it.
struct Running {
    req: Request,
    /// The prompt's length.
    prompt_len: usize,
    /// Output tokens still to decode after the prompt.
    to_decode: usize,
    /// Tokens the request's state slot has processed.
    state_len: usize,
    /// Whether the engine aborts it when its prefill is done.
    abort_after_prefill: bool,
}

/// The engine of one seed.
struct Sim {
    sc: Scenario,
    cache: HybridCache,
    faults: Arc<FaultInjector<CpuDevice>>,
    /// The allocator calls to refuse.
    alloc_faults: Arc<Mutex<AllocFaults>>,
    /// The device under the fault injector: the engine's own reads and writes.
    dev: Arc<CpuDevice>,
    rng: SplitMix64,
    ps: usize,
    waiting: Vec<(Vec<TokenId>, usize)>,
    running: Vec<Running>,
    families: Vec<Vec<TokenId>>,
    next_token: u32,
    out: Outcome,
    step: usize,
    /// Device tables for the translation check (ids in, kernel ids out), grown as needed.
    tables: Option<(TableId, TableId, usize)>,
}

/// The allocator fault armed, shared by the engine and its [`AllocFaultHooks`].
#[derive(Debug, Default)]
struct AllocFaults {
    /// Refuse the fallible call this many calls from now.
    armed: Option<u64>,
    /// Fallible calls seen.
    calls: u64,
    /// Calls refused since the last disarm.
    injected: usize,
}

/// Refuses the armed fallible allocator call, unforwarded, with the device's typed fault
/// (on a GPU the likeliest failure of an allocator call is its device op).
#[derive(Debug)]
struct AllocFaultHooks(Arc<Mutex<AllocFaults>>);

impl Hooks for AllocFaultHooks {
    fn gate(&mut self, _: &dyn KvAllocator, call: Call<'_>) -> Result<(), unikv::pools::Error> {
        let mut s = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let index = s.calls;
        s.calls += 1;
        match s.armed {
            Some(0) => {
                s.armed = None;
                s.injected += 1;
                Err(unikv::pools::Error::Device(DeviceError::InjectedFault {
                    op: call.name(),
                    index,
                    location: Location::caller(),
                }))
            }
            Some(n) => {
                s.armed = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// Whether `e` is an injected device fault (directly or through the allocator).
fn injected(e: &Error) -> bool {
    matches!(
        e,
        Error::Device(DeviceError::InjectedFault { .. })
            | Error::Pool(unikv::pools::Error::Device(
                DeviceError::InjectedFault { .. }
            ))
    )
}

/// Whether `e` says memory is short (the engine retracts or waits).
fn short(e: &Error) -> bool {
    matches!(
        e,
        Error::OutOfMemory { .. }
            | Error::Pool(
                unikv::pools::Error::OutOfCapacity { .. } | unikv::pools::Error::OutOfSlots { .. }
            )
    )
}

/// Runs seed `seed` at invariant level `Strict`.
pub fn run(seed: u64) -> Result<Outcome, Failure> {
    let sc = Scenario::from_seed(seed);
    scoped_level(Level::Strict, || Sim::new(sc.clone())?.run())
}

impl Sim {
    fn new(sc: Scenario) -> Result<Sim, Failure> {
        let dev = Arc::new(CpuDevice::new());
        let faults = Arc::new(FaultInjector::new(dev.clone()));
        let device: Arc<dyn Device> = faults.clone();
        let alloc_faults = Arc::new(Mutex::new(AllocFaults::default()));
        let hooks = alloc_faults.clone();
        let mut builder = HybridCache::builder()
            .model(sc.model)
            .layout(sc.layout)
            .page_size(sc.page_size)
            .memory_bytes(sc.memory_bytes)
            .zero_on_handout(true)
            .device(device)
            .wrap_allocator(move |inner| Box::new(Hooked::new(inner, AllocFaultHooks(hooks))));
        if sc.model.has_recurrent_state() {
            let ps = sc.page_size;
            builder = builder
                .checkpoint_interval(ps * (1 + (sc.seed % 3) as u32) * 8u32.div_ceil(ps))
                .checkpoints_per_step(sc.checkpoints_per_step);
        }
        let cache = builder.build().map_err(|e| Failure {
            seed: sc.seed,
            step: 0,
            what: format!("the cache did not build for {sc:?}: {e}"),
        })?;
        let mut rng = SplitMix64::for_stream(sc.seed, "dst.engine");
        let families = (0..3)
            .map(|f| {
                let len = rng.in_range(8, 96) as usize;
                (0..len)
                    .map(|i| TokenId(1_000 * (f + 1) + (rng.below(6) as u32) * 100 + i as u32 % 7))
                    .collect()
            })
            .collect();
        Ok(Sim {
            ps: sc.page_size as usize,
            sc,
            cache,
            faults,
            alloc_faults,
            dev,
            rng,
            waiting: Vec::new(),
            running: Vec::new(),
            families,
            next_token: 1 << 20,
            out: Outcome::default(),
            step: 0,
            tables: None,
        })
    }

    fn fail(&self, what: impl Into<String>) -> Failure {
        Failure {
            seed: self.sc.seed,
            step: self.step,
            what: what.into(),
        }
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.rng.below(1000) < per_mille
    }

    fn alloc_faults(&self) -> std::sync::MutexGuard<'_, AllocFaults> {
        self.alloc_faults
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Arms a fault at one of the next few device ops or fallible allocator calls, at the
    /// scenario's rate.
    fn maybe_arm(&mut self) {
        if self.sc.faults_per_mille > 0 && self.chance(self.sc.faults_per_mille * 8) {
            let n = self.rng.below(6);
            if self.rng.below(2) == 0 {
                self.faults.reset();
                self.faults.fail_at(n);
            } else {
                self.alloc_faults().armed = Some(n);
            }
        }
    }

    /// Disarms both kinds; whether a fault fired since they were armed (counted).
    fn disarm(&mut self) -> bool {
        let device = self.faults.injected().len();
        self.faults.reset();
        let allocator = {
            let mut s = self.alloc_faults();
            s.armed = None;
            std::mem::take(&mut s.injected)
        };
        self.out.allocator_faults += allocator;
        device + allocator > 0
    }

    fn run(mut self) -> Result<Outcome, Failure> {
        for step in 0..self.sc.steps {
            self.step = step;
            self.one_step()?;
        }
        // Drain: release everything, evict everything; every page must come back.
        self.disarm();
        for r in std::mem::take(&mut self.running) {
            self.cache
                .release(r.req)
                .map_err(|e| self.fail(format!("release at the end: {e}")))?;
        }
        self.cache
            .evict_all()
            .map_err(|e| self.fail(format!("evict_all: {e}")))?;
        self.cache
            .step_boundary()
            .map_err(|e| self.fail(format!("the last step boundary: {e}")))?;
        let stats = self.cache.stats();
        for side in [stats.full, stats.swa, stats.mamba] {
            if side.available_pages != side.total_pages {
                return Err(self.fail(format!("leaked {side:?}")));
            }
        }
        self.out.steps = self.sc.steps;
        Ok(self.out)
    }

    fn one_step(&mut self) -> Result<(), Failure> {
        self.arrivals();
        self.admit()?;
        self.prefill()?;
        self.decode()?;
        self.finish()?;
        if self.chance(60) {
            let pages = self.rng.below(6) as usize;
            self.call("evict_to_free", |s| s.cache.evict_to_free(pages, pages))?;
        }
        self.maybe_arm();
        let boundary = self.cache.step_boundary();
        let fired = self.disarm();
        match boundary {
            Ok(_) => {}
            Err(e) if fired && injected(&e) => {
                self.out.faults += 1;
                // The step ended; the next boundary must balance.
                self.cache
                    .step_boundary()
                    .map_err(|e| self.fail(format!("the boundary after a fault: {e}")))?;
            }
            Err(e) => return Err(self.fail(format!("step_boundary: {e}"))),
        }
        self.check_everything()
    }

    /// Runs an engine call with a fault maybe armed; an injected fault must change
    /// nothing the engine holds, and the call is retried without one. `Ok(None)` when
    /// memory is short.
    fn call<T>(
        &mut self,
        what: &str,
        mut f: impl FnMut(&mut Sim) -> Result<T, Error>,
    ) -> Result<Option<T>, Failure> {
        let before = self.engine_view();
        self.maybe_arm();
        let first = f(self);
        let fired = self.disarm();
        let result = match first {
            Err(e) if fired && injected(&e) => {
                self.out.faults += 1;
                if self.engine_view() != before {
                    return Err(self.fail(format!("{what} failed with {e} and changed a request")));
                }
                self.cache
                    .allocator()
                    .verify()
                    .map_err(|v| self.fail(format!("{what} failed with {e}; verify: {v}")))?;
                self.check_bytes(&format!("after a fault in {what}"))?;
                f(self)
            }
            other => other,
        };
        match result {
            Ok(t) => Ok(Some(t)),
            Err(e) if short(&e) => Ok(None),
            Err(e) => Err(self.fail(format!("{what}: {e}"))),
        }
    }

    /// What the engine holds of its running requests.
    fn engine_view(&self) -> Vec<(u64, Vec<VirtualToken>, usize)> {
        self.running
            .iter()
            .map(|r| (r.req.id(), r.req.row().to_vec(), r.req.tokens().len()))
            .collect()
    }

    fn fresh_tokens(&mut self, n: usize) -> Vec<TokenId> {
        (0..n)
            .map(|_| {
                self.next_token += 1;
                TokenId(self.next_token)
            })
            .collect()
    }

    fn arrivals(&mut self) {
        for _ in 0..self.rng.below(3) {
            let f = self.rng.below(self.families.len() as u64) as usize;
            let shared = self.rng.below(self.families[f].len() as u64 + 1) as usize;
            let mut prompt = self.families[f][..shared].to_vec();
            let own = self.rng.in_range(1, 40) as usize;
            prompt.extend(self.fresh_tokens(own));
            let output = self.rng.in_range(1, 48) as usize;
            self.waiting.push((prompt, output));
        }
    }

    /// The oracle's match for `prompt`: see the module docs.
    fn oracle(&self, prompt: &[TokenId]) -> usize {
        let tree: &RadixTree = self.cache.tree();
        let key = &prompt[..prompt.len().saturating_sub(1)];
        let key_len = key.len() / self.ps * self.ps;
        let window = if self.sc.model.swa_layers > 0 {
            Some(self.sc.model.window as usize)
        } else {
            None
        };
        let mamba = self.sc.model.has_recurrent_state();
        // Per node: its path from the root as (token, swa live) and whether a state ends it.
        let mut paths: HashMap<_, Vec<(TokenId, bool)>> = HashMap::new();
        let mut best = 0;
        for n in tree.nodes() {
            let mut path = n.parent.map(|p| paths[&p].clone()).unwrap_or_default();
            path.extend(n.key.iter().map(|&t| (t, n.swa_live)));
            let end = path.len();
            // Every page-aligned length inside this node that the prompt shares.
            let lo = n.start.0 + 1;
            for len in (lo..=end.min(key_len)).rev() {
                if len % self.ps != 0 || len <= best {
                    continue;
                }
                if path[..len].iter().zip(key).any(|((t, _), k)| t != k) {
                    continue;
                }
                if mamba && !(len == end && n.mamba.is_some()) {
                    continue;
                }
                // A match ends only where a whole window of live SWA precedes it, or where
                // no tombstone does.
                if let Some(w) = window {
                    let live = |range: std::ops::Range<usize>| path[range].iter().all(|p| p.1);
                    if !(live(0..len) || (len >= w && live(len - w..len))) {
                        continue;
                    }
                }
                best = len;
            }
            paths.insert(n.id, path);
        }
        best
    }

    fn admit(&mut self) -> Result<(), Failure> {
        let cap = 2 + (self.sc.seed % 6) as usize;
        while self.running.len() < cap && !self.waiting.is_empty() {
            let (prompt, output) = self.waiting[0].clone();
            let expected = self.oracle(&prompt);
            let hit = self.cache.match_prefix(prompt);
            if hit.cached_tokens() != expected {
                return Err(self.fail(format!(
                    "a match of {} tokens served {} cached tokens, the oracle says {expected}",
                    hit.prompt_len(),
                    hit.cached_tokens()
                )));
            }
            if self.chance(40) {
                // An abort between the match and the admission.
                drop(hit);
                self.waiting.remove(0);
                continue;
            }
            if !self.cache.can_admit(&hit, 8) {
                break;
            }
            let mut hit = Some(hit);
            let admitted = self.call("admit", |s| {
                // A retry re-matches: the first try consumed the match.
                let h = match hit.take() {
                    Some(h) => h,
                    None => s.cache.match_prefix(s.waiting[0].0.clone()),
                };
                s.cache.admit(h)
            })?;
            let Some(req) = admitted else { break };
            self.waiting.remove(0);
            self.out.admitted += 1;
            let cached = req.cached_at_admission();
            self.out.hit_tokens += cached;
            let r = Running {
                prompt_len: req.tokens().len(),
                req,
                to_decode: output,
                state_len: cached,
                abort_after_prefill: self.chance(60),
            };
            self.check_request(&r, "at admission")?;
            if self.chance(30) {
                // An abort right after admission.
                self.release(r)?;
                continue;
            }
            self.running.push(r);
        }
        Ok(())
    }

    fn release(&mut self, r: Running) -> Result<(), Failure> {
        self.out.released += 1;
        self.cache
            .release(r.req)
            .map(drop)
            .map_err(|e| self.fail(format!("release: {e}")))
    }

    /// Retracts the most recently admitted request: its prompt goes back to the front.
    fn retract(&mut self) -> Result<(), Failure> {
        let Some(r) = self.running.pop() else {
            return Ok(());
        };
        let prompt = r.req.tokens()[..r.prompt_len].to_vec();
        self.waiting.insert(0, (prompt, r.to_decode));
        self.release(r)
    }

    fn prefill(&mut self) -> Result<(), Failure> {
        let mut i = 0;
        while i < self.running.len() {
            let remaining = self.running[i].req.remaining_prefill();
            if remaining == 0 {
                i += 1;
                continue;
            }
            let chunk = (self.rng.in_range(1, 3) as usize * self.ps * 4).min(remaining);
            let old = self.running[i].req.len();
            let done = self.call("alloc_extend", |s| {
                s.cache.alloc_extend(&mut s.running[i].req, chunk)
            })?;
            if done.is_none() {
                if self.running.len() == 1 {
                    // Alone and still short: the budget is at the floor; evict and wait.
                    self.call("evict_to_free", |s| s.cache.evict_to_free(1, 1))?;
                    return Ok(());
                }
                self.retract()?;
                continue;
            }
            self.forward(i, old)?;
            if self.chance(500) {
                self.call("cache_unfinished", |s| {
                    s.cache.cache_unfinished(&mut s.running[i].req)
                })?;
            }
            if self.running[i].req.remaining_prefill() == 0 && self.running[i].abort_after_prefill {
                let r = self.running.remove(i);
                self.release(r)?;
                continue;
            }
            i += 1;
        }
        Ok(())
    }

    fn decode(&mut self) -> Result<(), Failure> {
        loop {
            let batch: Vec<usize> = (0..self.running.len())
                .filter(|&i| {
                    let r = &self.running[i];
                    r.req.remaining_prefill() == 0 && r.to_decode > 0
                })
                .collect();
            if batch.is_empty() {
                return Ok(());
            }
            let tokens = self.fresh_tokens(batch.len());
            let olds: Vec<usize> = batch.iter().map(|&i| self.running[i].req.len()).collect();
            let done = self.call("alloc_decode", |s| {
                let mut reqs: Vec<&mut Request> = s
                    .running
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| batch.contains(i))
                    .map(|(_, r)| &mut r.req)
                    .collect();
                s.cache.alloc_decode(&mut reqs, &tokens)
            })?;
            if done.is_none() {
                if self.running.len() <= 1 {
                    return Ok(());
                }
                self.retract()?;
                continue;
            }
            for (&i, &old) in batch.iter().zip(&olds) {
                self.running[i].to_decode -= 1;
                self.forward(i, old)?;
            }
            if self.chance(30) && !self.running.is_empty() {
                // An abort mid-decode.
                let k = self.rng.below(self.running.len() as u64) as usize;
                let r = self.running.remove(k);
                self.release(r)?;
            }
            return Ok(());
        }
    }

    fn finish(&mut self) -> Result<(), Failure> {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.req.remaining_prefill() == 0 && r.to_decode == 0 {
                let r = self.running.remove(i);
                self.cache
                    .cache_finished(r.req)
                    .map_err(|e| self.fail(format!("cache_finished: {e}")))?;
                self.out.finished += 1;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// The engine's forward over `running[i]`'s new tokens `[old, len)`: stamps their KV
    /// on every side it has, the running state, and the checkpoints the cache asks for.
    fn forward(&mut self, i: usize, old: usize) -> Result<(), Failure> {
        let r = &self.running[i];
        let hashes = prefix_hashes(&r.req.tokens()[..r.req.len()]);
        let alloc = self.cache.allocator();
        let buffer = alloc.buffer();
        let mut spans: Vec<(ByteSpan, u8)> = Vec::new();
        for (&t, &hash) in r.req.row()[old..].iter().zip(&hashes[old..]) {
            for side in self.kv_sides() {
                let Some(span) = self.token_span(side, t) else {
                    return Err(self.fail(format!("a new token t{} has no {side:?} page", t.0)));
                };
                spans.push((span, kv_stamp(hash, side)));
            }
        }
        if let Some(slot) = r.req.state_slot() {
            let len = r.req.len();
            spans.push((self.slot_span(slot)?, state_stamp(hash_at(&hashes, len))));
            let writes = r.req.checkpoint_writes();
            self.out.checkpoint_writes += writes.len() as u64;
            self.out.multi_checkpoint_forwards += u64::from(writes.len() > 1);
            for w in writes {
                spans.push((
                    self.slot_span(w.slot)?,
                    state_stamp(hash_at(&hashes, w.at_len)),
                ));
            }
        }
        for (span, value) in spans {
            self.dev
                .fill_spans(buffer, &[span], value)
                .map_err(|e| self.fail(format!("stamping: {e}")))?;
        }
        let len = self.running[i].req.len();
        self.running[i].state_len = len;
        Ok(())
    }

    fn kv_sides(&self) -> Vec<Side> {
        if self.sc.model.swa_layers > 0 {
            vec![Side::Full, Side::Swa]
        } else {
            vec![Side::Full]
        }
    }

    /// The bytes of token `t` on `side` (its share of the page envelope), through the
    /// host tables.
    fn token_span(&self, side: Side, t: VirtualToken) -> Option<ByteSpan> {
        let alloc = self.cache.allocator();
        let ps = alloc.page_size();
        let p = alloc.physical_page(side, t.page(ps))?;
        Some(self.span_at(side, p, t.offset(ps) as usize))
    }

    /// The share of offset `o` in physical page `p`'s envelope on `side`.
    fn span_at(&self, side: Side, p: u32, o: usize) -> ByteSpan {
        let env = self.cache.allocator().grid(side).envelope;
        let share = env / self.ps as u64;
        ByteSpan {
            offset: p as u64 * env + o as u64 * share,
            len: share,
        }
    }

    fn slot_span(&self, slot: VirtualSlot) -> Result<ByteSpan, Failure> {
        let alloc = self.cache.allocator();
        let p = alloc
            .physical_slot(slot)
            .ok_or_else(|| self.fail(format!("state slot {slot:?} is not bound")))?;
        let env = alloc.grid(Side::Mamba).envelope;
        Ok(ByteSpan {
            offset: p as u64 * env,
            len: env,
        })
    }

    /// The whole buffer, read back once for a round of checks.
    fn buffer_bytes(&self) -> Result<Vec<u8>, Failure> {
        let alloc = self.cache.allocator();
        let total = alloc.pool_map().total_bytes;
        self.dev
            .read_bytes(
                &HostSync::acquire("dst: the engine's read-back of every stamp"),
                alloc.buffer(),
                0,
                total,
            )
            .map_err(|e| self.fail(format!("reading the buffer: {e}")))
    }

    fn check(bytes: &[u8], span: ByteSpan, want: u8) -> bool {
        bytes[span.offset as usize..(span.offset + span.len) as usize]
            .iter()
            .all(|&b| b == want)
    }

    /// One running request: every token's FULL bytes, its SWA bytes from its window
    /// cursor on (and wherever still live), and its state, through the host tables.
    fn check_request(&mut self, r: &Running, when: &str) -> Result<(), Failure> {
        let bytes = self.buffer_bytes()?;
        self.check_request_in(&bytes, r, when)
    }

    fn check_request_in(&mut self, bytes: &[u8], r: &Running, when: &str) -> Result<(), Failure> {
        let hashes = prefix_hashes(&r.req.tokens()[..r.req.len()]);
        // Attention reads every token's FULL KV and the last window's SWA KV (and the
        // cache promises SWA from the cursor on).
        let window_start = r.req.len().saturating_sub(self.sc.model.window as usize);
        let swa_from = r.req.window_cursor().min(window_start);
        for (pos, t) in r.req.row().iter().enumerate() {
            for side in self.kv_sides() {
                let span = self.token_span(side, *t);
                let required = side == Side::Full || pos >= swa_from;
                match span {
                    None if required => {
                        return Err(self.fail(format!(
                            "{when}: request {} row {pos} has no {side:?} page",
                            r.req.id()
                        )));
                    }
                    None => {}
                    Some(span) => {
                        self.out.stamps_checked += 1;
                        if !Self::check(bytes, span, kv_stamp(hashes[pos], side)) {
                            return Err(self.fail(format!(
                                "{when}: request {} row {pos} (t{}) lost its {side:?} bytes",
                                r.req.id(),
                                t.0
                            )));
                        }
                    }
                }
            }
        }
        if let Some(slot) = r.req.state_slot() {
            let span = self.slot_span(slot)?;
            let want = if r.state_len == 0 {
                0
            } else {
                state_stamp(hash_at(&hashes, r.state_len))
            };
            self.out.stamps_checked += 1;
            if !Self::check(bytes, span, want) {
                return Err(self.fail(format!(
                    "{when}: request {}'s state (after {} tokens) is not in its slot",
                    r.req.id(),
                    r.state_len
                )));
            }
        }
        Ok(())
    }

    /// After a step: the allocator verifies, the tree is sane, the bytes hold.
    fn check_everything(&mut self) -> Result<(), Failure> {
        self.cache
            .allocator()
            .verify()
            .map_err(|e| self.fail(format!("verify: {e}")))?;
        self.cache
            .tree()
            .sanity_check()
            .map_err(|e| self.fail(format!("tree sanity: {e}")))?;
        self.check_bytes("after the step")?;
        self.check_translation()
    }

    /// Every running request's and every cached prefix's bytes, through the host tables.
    fn check_bytes(&mut self, when: &str) -> Result<(), Failure> {
        let bytes = self.buffer_bytes()?;
        let running = std::mem::take(&mut self.running);
        let result = running
            .iter()
            .try_for_each(|r| self.check_request_in(&bytes, r, when));
        self.running = running;
        result?;
        // The prefix cache: every node's FULL bytes, its SWA bytes while live, its state.
        let mut hashes: HashMap<_, u64> = HashMap::new();
        let mut failures = Vec::new();
        let mut checked = 0u64;
        for n in self.cache.tree().nodes() {
            let mut h = n.parent.map_or(HASH_START, |p| hashes[&p]);
            for (t, v) in n.key.iter().zip(n.value) {
                h = hash_next(h, *t);
                for side in self.kv_sides() {
                    if side == Side::Swa && !n.swa_live {
                        continue;
                    }
                    match self.token_span(side, VirtualToken(v.0)) {
                        Some(span) => {
                            checked += 1;
                            if !Self::check(&bytes, span, kv_stamp(h, side)) {
                                failures.push(format!("cached t{} lost its {side:?} bytes", v.0));
                            }
                        }
                        None => failures.push(format!("cached t{} has no {side:?} page", v.0)),
                    }
                }
            }
            if let Some(slot) = n.mamba {
                let span = self.slot_span(VirtualSlot(slot.0))?;
                checked += 1;
                if !Self::check(&bytes, span, state_stamp(h)) {
                    failures.push(format!(
                        "the cached state at position {} is wrong",
                        n.start.0 + n.key.len()
                    ));
                }
            }
            hashes.insert(n.id, h);
        }
        self.out.stamps_checked += checked;
        match failures.first() {
            Some(f) => Err(self.fail(format!("{when}: {f} ({} such)", failures.len()))),
            None => Ok(()),
        }
    }

    /// Every running request's row read back through the device translation (mirror
    /// upload and translate kernel): each kernel id names the page the host tables name.
    fn check_translation(&mut self) -> Result<(), Failure> {
        let longest = self.running.iter().map(|r| r.req.len()).max().unwrap_or(0);
        if longest == 0 {
            return Ok(());
        }
        let (ids, out) = self.tables_for(longest)?;
        let sync = HostSync::acquire("dst: reading kernel ids back");
        for i in 0..self.running.len() {
            let row: Vec<i32> = self.running[i]
                .req
                .row()
                .iter()
                .map(|t| t.0 as i32)
                .collect();
            for side in self.kv_sides() {
                self.dev
                    .upload_table(ids, 0, &row)
                    .map_err(|e| self.fail(format!("uploading ids: {e}")))?;
                self.cache
                    .translate(side, ids, row.len(), out, row.len())
                    .map_err(|e| self.fail(format!("translate {side:?}: {e}")))?;
                let kernel = self
                    .dev
                    .read_table(&sync, out, 0, row.len())
                    .map_err(|e| self.fail(format!("reading kernel ids: {e}")))?;
                let alloc = self.cache.allocator();
                for (pos, (&k, t)) in kernel.iter().zip(self.running[i].req.row()).enumerate() {
                    let host = alloc.kernel_id(side, *t);
                    if k != host {
                        return Err(self.fail(format!(
                            "request {} row {pos} on {side:?}: the device translated t{} to {k}, the host tables say {host}",
                            self.running[i].req.id(),
                            t.0
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn tables_for(&mut self, n: usize) -> Result<(TableId, TableId), Failure> {
        if let Some((ids, out, len)) = self.tables
            && len >= n
        {
            return Ok((ids, out));
        }
        let len = n.next_power_of_two();
        let alloc = |s: &Sim| {
            s.dev
                .alloc_table(len, 0)
                .map_err(|e| s.fail(format!("a table: {e}")))
        };
        let (ids, out) = (alloc(self)?, alloc(self)?);
        self.tables = Some((ids, out, len));
        Ok((ids, out))
    }
}

/// Runs seeds `first..first + count`, calling `progress` after each; stops at the first
/// failure.
pub fn run_many(
    first: u64,
    count: u64,
    mut progress: impl FnMut(u64, &Outcome),
) -> Result<Outcome, Failure> {
    let mut total = Outcome::default();
    for seed in first..first.saturating_add(count) {
        let o = run(seed)?;
        total.steps += o.steps;
        total.admitted += o.admitted;
        total.finished += o.finished;
        total.released += o.released;
        total.hit_tokens += o.hit_tokens;
        total.faults += o.faults;
        total.allocator_faults += o.allocator_faults;
        total.stamps_checked += o.stamps_checked;
        total.checkpoint_writes += o.checkpoint_writes;
        total.multi_checkpoint_forwards += o.multi_checkpoint_forwards;
        progress(seed, &o);
    }
    Ok(total)
}

/// `unikv sim`: runs the seeds of `args`, a progress line on stderr every tenth of them,
/// and a summary on `out`. `Ok(false)` when a seed failed (its failure and reproduce
/// command are on stderr).
pub fn run_command(
    args: &crate::cli::SimArgs,
    out: &mut impl std::io::Write,
) -> Result<bool, crate::SimError> {
    let started = std::time::Instant::now();
    let every = (args.seeds / 10).max(1);
    let result = run_many(args.first, args.seeds, |seed, _| {
        let done = seed - args.first + 1;
        if done.is_multiple_of(every) && done < args.seeds {
            eprintln!(
                "sim: {done} of {} seeds clean ({:.1} s)",
                args.seeds,
                started.elapsed().as_secs_f64()
            );
        }
    });
    let secs = started.elapsed().as_secs_f64();
    match result {
        Ok(total) => {
            writeln!(
                out,
                "sim: seeds {}..{} clean in {secs:.1} s: {} steps, {} requests admitted, {} finished, {} released, {} prompt tokens hit, {} faults injected ({} in allocator calls), {} stamps checked, {} checkpoints saved ({} forwards saved several)",
                args.first,
                args.first.saturating_add(args.seeds),
                total.steps,
                total.admitted,
                total.finished,
                total.released,
                total.hit_tokens,
                total.faults,
                total.allocator_faults,
                total.stamps_checked,
                total.checkpoint_writes,
                total.multi_checkpoint_forwards
            )
            .and_then(|()| writeln!(out, "sim: {} passed, 0 failed", args.seeds))
            .map_err(crate::SimError::Output)?;
            Ok(true)
        }
        Err(failure) => {
            eprintln!("sim: {failure}");
            writeln!(out, "sim: {} passed, 1 failed", failure.seed - args.first)
                .map_err(crate::SimError::Output)?;
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_fixes_its_scenario_and_its_outcome() {
        let a = Scenario::from_seed(7);
        let b = Scenario::from_seed(7);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert_eq!(run(7).unwrap(), run(7).unwrap());
    }

    #[test]
    fn a_few_seeds_run_clean_with_faults_hits_and_checks() {
        let total = run_many(0, 12, |_, _| {}).unwrap_or_else(|f| panic!("{f}"));
        assert!(total.faults > total.allocator_faults, "{total:?}");
        assert!(total.allocator_faults > 0, "{total:?}");
        assert!(total.hit_tokens > 0, "{total:?}");
        assert!(total.stamps_checked > 1000, "{total:?}");
    }

    /// Recurrent seeds save checkpoints, several in one forward too, under every
    /// per-step bound.
    #[test]
    fn recurrent_seeds_save_several_checkpoints_a_step() {
        let mut bounds = std::collections::BTreeSet::new();
        let mut total = Outcome::default();
        for seed in 0..48 {
            let sc = Scenario::from_seed(seed);
            if !sc.model.has_recurrent_state() {
                continue;
            }
            bounds.insert(sc.checkpoints_per_step);
            let o = run(seed).unwrap_or_else(|f| panic!("{f}"));
            total.checkpoint_writes += o.checkpoint_writes;
            total.multi_checkpoint_forwards += o.multi_checkpoint_forwards;
        }
        assert_eq!(
            bounds.len(),
            MAX_CHECKPOINTS_PER_STEP as usize,
            "{bounds:?}"
        );
        assert!(total.multi_checkpoint_forwards > 0, "{total:?}");
    }

    #[test]
    fn the_oracle_is_exercised_on_every_kind_of_model() {
        let mut kinds = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let s = Scenario::from_seed(seed);
            kinds.insert((
                s.model.swa_layers > 0,
                s.model.has_recurrent_state(),
                matches!(s.layout, Layout::Unified),
            ));
        }
        // Every combination a model can be (FULL with SWA, recurrent state or both) on
        // both layouts.
        assert_eq!(kinds.len(), 6, "{kinds:?}");
    }
}

//! The random engine of one seed ([`Sim`]): arrivals sharing prefixes of a few prompt
//! families, admission checked against the oracle, aborts, chunked prefill, batched
//! decode, retraction, finishing, and faults armed at random; every injected fault is
//! retried and checked. On a speculative seed decode steps are verify steps ([`speculative`]).
//! What it checks after each step is in [`checks`].

mod checks;
mod speculative;

use crate::outcome::{Failure, Outcome};
use crate::scenario::Scenario;
use crate::stamps::{hash_at, kv_stamp, prefix_hashes, state_stamp};
use std::collections::{HashMap, VecDeque};
use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use unikv::kernels::{
    ByteSpan, CpuDevice, Device, DeviceCall, DeviceHooks, DeviceOp, Error as DeviceError,
    FaultInjector, Intercepted, TableId,
};
use unikv::pools::{Call, Hooked, Hooks, KvAllocator, VirtualToken};
use unikv::radix::RadixTree;
use unikv::{Error, HybridCache, KvGeometry, Request, TokenId, VerifyMetadata};
use unikv_workload::rng::SplitMix64;

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
    /// Its verify steps not settled yet, oldest first (speculative seeds).
    verifies: VecDeque<speculative::InFlight>,
}

impl Running {
    /// The tokens whose KV its rows hold as the device knows them: the settled tokens,
    /// then what each unsettled verify step accepted (a device value the host learns
    /// when it settles).
    fn device_tokens(&self) -> Vec<TokenId> {
        let mut tokens = self.req.tokens()[..self.req.settled_len()].to_vec();
        for v in &self.verifies {
            tokens.extend_from_slice(&v.accepted);
        }
        tokens
    }
}

/// The engine of one seed.
pub(crate) struct Sim {
    sc: Scenario,
    cache: HybridCache,
    /// The byte geometry the cache's kernels address the buffer with.
    geometry: KvGeometry,
    faults: Arc<FaultInjector<Lagging>>,
    /// The device whose host-tier copies can lag (under the fault injector).
    lag: Arc<Lagging>,
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
    /// Speculative seeds: the verify metadata, its tables reserved when the cache is
    /// built.
    verify_meta: Option<VerifyMetadata>,
    /// Speculative seeds: the engine's device table of what its kernels write for the
    /// verify (offsets: accepted counts, then last nodes; then the accepted paths).
    values: Option<TableId>,
}

/// The CPU device with [`LagHooks`]: host-tier copies that stay in flight.
type Lagging = Intercepted<CpuDevice, LagHooks>;

/// Makes host-tier copies stay in flight while on: the CPU device copies at once, so a
/// query of a copy's event is refused instead (the cache counts a refused query as not
/// done). A write-back's device pages then stay parked, a load-back's host path locked,
/// and a request released right after its load aborts mid-load, as on a busy GPU.
#[derive(Debug, Default)]
pub(crate) struct LagHooks {
    on: AtomicBool,
    /// Queries that found a copy in flight.
    lagged: AtomicU64,
}

impl DeviceHooks for LagHooks {
    type Ticket = ();

    #[track_caller]
    fn before<D: Device + ?Sized>(&self, _: &D, call: DeviceCall<'_>) -> Result<(), DeviceError> {
        if call.op != DeviceOp::CopyEventDone || !self.on.load(Ordering::Relaxed) {
            return Ok(());
        }
        let index = self.lagged.fetch_add(1, Ordering::Relaxed);
        Err(DeviceError::InjectedFault {
            op: "copy_event_done (in flight)",
            index,
            location: Location::caller(),
        })
    }

    fn after<D: Device + ?Sized>(
        &self,
        _: &D,
        _: DeviceCall<'_>,
        _: (),
        _: Result<(), &DeviceError>,
    ) {
    }
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

impl Sim {
    pub(crate) fn new(sc: Scenario) -> Result<Sim, Failure> {
        let dev = Arc::new(CpuDevice::new());
        let lag = Arc::new(Intercepted::with_hooks(dev.clone(), LagHooks::default()));
        let faults = Arc::new(FaultInjector::new(lag.clone()));
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
        if let Some(spec) = sc.speculation {
            builder = builder.speculation(spec);
        }
        if let Some(replay) = sc.state_replay() {
            builder = builder.state_replay(replay);
        }
        if let Some(bytes) = sc.host_memory_bytes {
            builder = builder.host_memory_bytes(bytes);
        }
        if sc.model.has_recurrent_state() {
            let ps = sc.page_size;
            builder = builder
                .checkpoint_interval(ps * (1 + (sc.seed % 3) as u32) * 8u32.div_ceil(ps))
                .checkpoints_per_step(sc.checkpoints_per_step);
        }
        let mut cache = builder.build().map_err(|e| Failure {
            seed: sc.seed,
            step: 0,
            what: format!("the cache did not build for {sc:?}: {e}"),
        })?;
        let fail = |what: String| Failure {
            seed: sc.seed,
            step: 0,
            what,
        };
        let (verify_meta, values) = match sc.speculation {
            Some(spec) => {
                let meta = VerifyMetadata::new(speculative::VERIFY_BATCH);
                cache
                    .reserve_verify_metadata(&meta)
                    .map_err(|e| fail(format!("reserving the verify metadata: {e}")))?;
                let b = speculative::VERIFY_BATCH;
                let values = dev
                    .alloc_table(2 * b + b * spec.max_width as usize, 0)
                    .map_err(|e| fail(format!("the verify value table: {e}")))?;
                (Some(meta), Some(values))
            }
            None => (None, None),
        };
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
            geometry: cache.kv_geometry(),
            sc,
            cache,
            faults,
            lag,
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
            verify_meta,
            values,
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

    pub(crate) fn run(mut self) -> Result<Outcome, Failure> {
        for step in 0..self.sc.steps {
            self.step = step;
            self.one_step()?;
        }
        // Drain: release everything, evict everything; every page must come back (the
        // copies complete: their parked pages and locks go at the next boundary).
        self.disarm();
        self.lag.hooks().on.store(false, Ordering::Relaxed);
        for r in std::mem::take(&mut self.running) {
            self.cache
                .release(r.req)
                .map_err(|e| self.fail(format!("release at the end: {e}")))?;
        }
        // Verify scratch given back in a step is idle (and freed by `evict_all`) from the
        // next one.
        self.cache
            .step_boundary()
            .map_err(|e| self.fail(format!("the drain's step boundary: {e}")))?;
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
        if let Some(host) = stats.host {
            self.out.host_seeds += 1;
            self.out.host_copies_in_flight += self.lag.hooks().lagged.load(Ordering::Relaxed);
            self.out.host_hit_tokens += host.hit_tokens;
            self.out.host_written_bytes += host.written_bytes;
            self.out.host_loaded_bytes += host.loaded_bytes;
            self.out.host_refused_writes += host.refused_writes;
        }
        self.out.steps = self.sc.steps;
        Ok(self.out)
    }

    fn one_step(&mut self) -> Result<(), Failure> {
        // Host-tier seeds: in about a third of the steps the copies stay in flight.
        if self.sc.host_memory_bytes.is_some() {
            let on = self.chance(330);
            self.lag.hooks().on.store(on, Ordering::Relaxed);
        }
        self.arrivals();
        self.admit()?;
        self.prefill()?;
        if self.sc.speculation.is_some() {
            self.verify()?;
        } else {
            self.decode()?;
        }
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

    /// What the engine holds of its running requests: id, row, tokens, unsettled
    /// verify steps.
    fn engine_view(&self) -> Vec<(u64, Vec<VirtualToken>, usize, usize)> {
        self.running
            .iter()
            .map(|r| {
                (
                    r.req.id(),
                    r.req.row().to_vec(),
                    r.req.tokens().len(),
                    r.req.unsettled_verifies(),
                )
            })
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
    /// What a match of `prompt` must serve: the longest valid end the device tree
    /// holds, or the host tier's when longer (its tree has the same rules).
    fn oracle(&self, prompt: &[TokenId]) -> (usize, usize) {
        let device = self.oracle_in(self.cache.tree(), prompt);
        let host = self
            .cache
            .host_tree()
            .map_or(0, |tree| self.oracle_in(tree, prompt));
        (device, device.max(host))
    }

    fn oracle_in(&self, tree: &RadixTree, prompt: &[TokenId]) -> usize {
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
            let (device, expected) = self.oracle(&prompt);
            let hit = self.cache.match_prefix(prompt);
            if (hit.device_tokens(), hit.cached_tokens()) != (device, expected) {
                return Err(self.fail(format!(
                    "a match of {} tokens served {} cached tokens ({} on the device), the \
                     oracle says {expected} ({device})",
                    hit.prompt_len(),
                    hit.cached_tokens(),
                    hit.device_tokens()
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
                verifies: VecDeque::new(),
            };
            self.check_request(&r, "at admission")?;
            // A load-back still in flight: an abort now must keep its rows until the
            // copy is done.
            let mid_load = cached > device && self.lag.hooks().on.load(Ordering::Relaxed);
            if self.chance(30) || (mid_load && self.chance(150)) {
                // An abort right after admission.
                self.out.host_aborts_mid_load += u64::from(mid_load);
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
                // On a speculative seed it may finish with a verify step in flight: its
                // settled pages are cached, the reserved ones freed.
                self.out.finished_mid_verify += u64::from(!r.verifies.is_empty());
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
        let mut fills: Vec<(Vec<ByteSpan>, u8)> = Vec::new();
        for (&t, &hash) in r.req.row()[old..].iter().zip(&hashes[old..]) {
            for side in self.kv_sides() {
                let Some(rows) = self.token_rows(side, t) else {
                    return Err(self.fail(format!("a new token t{} has no {side:?} page", t.0)));
                };
                fills.push((rows.spans().collect(), kv_stamp(hash, side)));
            }
        }
        if let Some(slot) = r.req.state_slot() {
            let len = r.req.len();
            fills.push((
                vec![self.slot_span(slot)?],
                state_stamp(hash_at(&hashes, len)),
            ));
            let writes = r.req.checkpoint_writes();
            self.out.checkpoint_writes += writes.len() as u64;
            self.out.multi_checkpoint_forwards += u64::from(writes.len() > 1);
            for w in writes {
                fills.push((
                    vec![self.slot_span(w.slot)?],
                    state_stamp(hash_at(&hashes, w.at_len)),
                ));
            }
        }
        for (spans, value) in fills {
            self.dev
                .fill_spans(buffer, &spans, value)
                .map_err(|e| self.fail(format!("stamping: {e}")))?;
        }
        let len = self.running[i].req.len();
        self.running[i].state_len = len;
        Ok(())
    }
}

//! The deterministic scheduler behind `unikv replay`: [`run`] replays one workload
//! through one layout at one page size, driving `HybridCache` as an engine's scheduler
//! would, and returns its [`RunStats`]. A caller that wants to see the allocator's calls
//! (the ops recorder of [`crate::run`]) hands [`run`] a wrapper for the allocator; the
//! scheduler knows nothing of what it wraps.
//!
//! # Policy (modelled on the reference engine's scheduler)
//! - Each step has a prefill budget of `chunk_tokens`. It first continues the requests
//!   still prefilling, then admits waiting requests in arrival order while the
//!   concurrency cap, the budget and memory allow (`can_admit`, reserving the prompt, its
//!   output and the running requests' expected decode, `DecodeEstimate`). Each
//!   admission matches the prompt against the prefix cache
//!   at that moment, and every prefill chunk is cached at once (`cache_unfinished`), so a
//!   prefix prefilled earlier in the same step is already a hit.
//! - Every request that was decoding when the step began decodes one token
//!   (`alloc_decode`, one call for the batch; SWA that left the window is released on
//!   the way). A prefill's last chunk samples the first output token.
//! - Speculating ([`RunConfig::speculation`]), that decode is a verify step instead: one
//!   `alloc_verify` for the batch (each request's next token and its drafts), then one
//!   `settle` with the positions each request accepted, drawn from the seed
//!   ([`crate::speculative::Acceptance`]) and capped by the output left; the accepted tokens are
//!   the workload's next output tokens, so the token stream is the one decoding gives,
//!   several tokens a step. With counts a step late (`SpecMode::late`), a request's
//!   verify is settled in the step after it, once that step's verify is allocated; a
//!   request finished (or retracted) with a verify in flight drops it, as an overlap
//!   scheduler drops the step it launched for a request that had already finished.
//!   On a model with recurrent state at most the cache's verify batch verifies a step
//!   (`config::verify_lanes`, taken round robin); the other decoders decode one token
//!   plainly in the same step (an engine turns speculation off past its speculative
//!   batch), so no request waits and only the verify batch needs scratch states.
//! - Out of memory, the most recently admitted request is retracted (its KV released, its
//!   tokens back at the front of the queue) and the allocation retried; a request that
//!   cannot fit alone is [`ReplayError::BudgetTooSmall`].
//! - Requests arrive at their `arrival_step`, or, with an `after`, at the first step after
//!   that request finished (a chat's next turn); arrivals join the back of the queue.
//!   Output tokens are the workload's where it fixes them (`RequestSpec::output`), else
//!   drawn from the seed and the request's id; either way the token fed back at each
//!   decode is the one sampled last.
//! - Finished requests enter the prefix cache (`cache_finished`); then `step_boundary`
//!   flushes, checks conservation and polls the invariants. When every request is done
//!   the prefix cache is cleared and every page must be free again (leaks).
//!
//! # Contract
//! - Deterministic: the same `(workload, config)` gives the same [`RunStats`] except
//!   `step_cpu_ns`, the only measured field (thread CPU time; no clock is an input to
//!   any decision).
//! - It runs at [`RunConfig::invariant_level`]: the caller (the replay command,
//!   `bench-scale`) puts that
//!   level in force on the calling thread with `unikv::invariants::scoped_level`, so a
//!   scheduler that stays on that thread needs to do nothing.
//! - It calls `progress` once per step with cumulative counts (cheap: the bar redraws at
//!   most 20 times a second); keep that call outside the timed region of `step_cpu_ns`.
//! - It never hangs: a budget that cannot hold one request alone is
//!   [`ReplayError::BudgetTooSmall`] before the first step, and a run that stops making
//!   progress (or passes [`RunConfig::max_steps`]) is [`ReplayError::Stalled`].
//! - It fills `samples` through [`crate::stats::SampleRecorder`] (bounded, evenly spaced).

use crate::config::{RunConfig, cache_builder};
use crate::error::ReplayError;
use crate::speculative::{Acceptance, DraftShape, SpecMode, tree_parents};
use crate::stats::{MambaStats, RunStats, SampleRecorder, SpecStats};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use unikv::kernels::{SyncLedger, thread_cpu_time, thread_cpu_time_overhead};
use unikv::pools::{Call, FreeOp, Hooked, Hooks, KvAllocator, Outcome, PageSize};
use unikv::{Accepted, Draft, HybridCache, ModelSpec, Request, StepMetadata, TokenId};
use unikv_workload::rng::SplitMix64;
use unikv_workload::{RequestSpec, Workload};

/// Where a run stands, reported to the progress callback after every step. All counts
/// are cumulative and never decrease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepProgress {
    /// Steps run so far.
    pub step: u64,
    /// Tokens of the workload (prompt and output) processed at least once: a retraction
    /// does not move this back (recomputing a retracted prefix is not progress).
    /// At most [`Workload::total_tokens`].
    pub tokens_done: u64,
    /// Requests finished.
    pub requests_completed: u64,
}

/// Replays `workload` through `config.layout` at `config.page_size` and reports what
/// happened, calling `progress` after every step. `hooks` watch every allocator call
/// (the ops recorder, or `()` for none) inside the scheduler's own page counter, in the
/// one [`Hooked`] layer the cache's allocator gets. See the module documentation for the
/// scheduling policy.
pub fn run<H: Hooks + 'static>(
    workload: &Workload,
    config: &RunConfig,
    hooks: H,
    progress: &dyn Fn(StepProgress),
) -> Result<RunStats, ReplayError> {
    run_noted(workload, config, hooks, &mut |_| {}, progress)
}

/// What a speculative run tells `notes` around its verify and settle calls (the ops
/// recorder writes them into the trace, [`crate::run`]): nothing else about the run.
#[derive(Clone, Copy, Debug)]
pub enum SpecNote<'a> {
    /// A verify or settle call is about to be made (the allocator calls it makes come
    /// next; a call that fails is followed by another `Begin`).
    Begin,
    /// `alloc_verify` allocated these drafts, one per request of the batch.
    Verified {
        /// Each request's draft.
        drafts: &'a [Draft<'a>],
    },
    /// `settle` settled the oldest verify of each request of the batch.
    Settled {
        /// Positions each request accepted.
        accepted: &'a [usize],
        /// A tree verify's accepted paths (`None` for chains).
        paths: Option<&'a [Vec<u32>]>,
    },
}

/// [`run`], telling `notes` about each verify and settle call ([`SpecNote`]).
pub fn run_noted<H: Hooks + 'static>(
    workload: &Workload,
    config: &RunConfig,
    hooks: H,
    notes: &mut dyn FnMut(SpecNote<'_>),
    progress: &dyn Fn(StepProgress),
) -> Result<RunStats, ReplayError> {
    Simulation::new(workload, config, hooks, notes)?.run(progress)
}

/// What admission reserves for decoding, as the reference engine's scheduler does
/// (SGLang's `new_token_ratio`: `NewTokenRatioTracker` and `retract_decode`): a new
/// request reserves its whole remaining output, each running request the expected share
/// of its own (`ratio` × remaining, both clipped at [`DecodeEstimate::CLIP`]). The ratio
/// starts at 0.7, decays over 600 decode steps without a retraction to 0.7 × 0.14, and a
/// retraction resets it to what the remaining batch has decoded so far (plus 20 steps
/// each) over what it may decode. Deterministic: no clock or randomness.
#[derive(Clone, Copy, Debug, PartialEq)]
struct DecodeEstimate {
    ratio: f64,
}

impl DecodeEstimate {
    const INIT: f64 = 0.7;
    const MIN: f64 = Self::INIT * 0.14;
    const DECAY: f64 = (Self::INIT - Self::MIN) / 600.0;
    /// Longest output an estimate counts.
    const CLIP: usize = 4096;
    /// Steps of decode a retraction's new estimate grants each remaining request.
    const RETRACT_DECODE_STEPS: u64 = 20;

    fn new() -> Self {
        DecodeEstimate { ratio: Self::INIT }
    }

    /// Tokens a request with `left` output tokens to go reserves at its admission.
    fn admitting(left: usize) -> usize {
        left.min(Self::CLIP)
    }

    /// Tokens a running request with `left` output tokens to go keeps reserved.
    fn running(&self, left: usize) -> usize {
        (left.min(Self::CLIP) as f64 * self.ratio).ceil() as usize
    }

    /// A decode step went by without a retraction.
    fn decay(&mut self) {
        self.ratio = (self.ratio - Self::DECAY).max(Self::MIN);
    }

    /// After a retraction: the remaining batch has decoded `decoded` of at most `max_new`
    /// tokens over `requests` requests.
    fn retracted(&mut self, decoded: u64, max_new: u64, requests: usize) {
        let expected = decoded + Self::RETRACT_DECODE_STEPS * requests as u64;
        self.ratio = (expected as f64 / (max_new + 1) as f64).min(1.0);
    }
}

/// Vocabulary that generated tokens are drawn from (disjoint from nothing: generated
/// tokens only need to be deterministic, and shared outputs are not a goal).
const VOCAB: u64 = 200_000;

/// A request waiting for admission (first time, or after a retraction).
#[derive(Debug)]
struct Waiting {
    spec: usize,
    /// Prompt and the generated tokens that had KV when it was retracted.
    tokens: Vec<TokenId>,
    /// Output tokens sampled so far (the last one has no KV yet).
    sampled: u32,
}

/// A request holding KV.
#[derive(Debug)]
struct Running {
    spec: usize,
    req: Request,
    sampled: u32,
}

/// A speculative run's state.
struct Speculating {
    mode: SpecMode,
    /// The draft tree's parent array (empty for chains).
    parents: Vec<i32>,
    acceptance: Acceptance,
    stats: SpecStats,
    /// Requests one verify step covers at most (the cache's verify batch).
    lanes: usize,
    /// Where the next step's verify batch starts among the decoders (round robin).
    turn: usize,
}

/// One run's state.
struct Simulation<'a> {
    workload: &'a Workload,
    config: &'a RunConfig,
    cache: HybridCache,
    ledger: Arc<SyncLedger>,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    next_arrival: usize,
    /// The requests that arrive at a fixed step (no [`RequestSpec::after`]), in arrival
    /// order.
    ///
    /// [`RequestSpec::after`]: unikv_workload::RequestSpec::after
    arrivals: Vec<usize>,
    /// For each request, the requests its finish releases (their `after`).
    dependents: Vec<Vec<usize>>,
    /// Requests released by a finish, waiting for their step (the next one, or their
    /// `arrival_step` if later), in the order they were released.
    released: Vec<usize>,
    stats: RunStats,
    samples: SampleRecorder,
    tokens_done: u64,
    /// Pages the allocator bound or released so far ([`PagesHandled`]).
    pages_handled: Arc<AtomicU64>,
    /// The decode admission reserves for.
    estimate: DecodeEstimate,
    /// Speculative decoding, when the run speculates.
    spec: Option<Speculating>,
    /// Told about verify and settle calls.
    notes: &'a mut dyn FnMut(SpecNote<'_>),
    /// The requests this step computes, as an engine's forward would: (index into
    /// `running`, request id, new tokens).
    computed: Vec<(usize, u64, usize)>,
    /// The step's metadata (reused).
    meta: StepMetadata,
    /// The host CPU time of this step's metadata builds, once built.
    metadata_ns: Option<u64>,
    /// The first entry of `computed` no build has covered yet.
    metadata_from: usize,
    /// Whether this step builds its metadata (every [`METADATA_EVERY`]-th).
    metadata_due: bool,
}

/// The replay builds step metadata every this many steps: enough to time it across a
/// run, while the CPU backend's share of the device work (translating every row of the
/// batch, which a GPU does in microseconds) stays a small part of the replay's wall time.
pub const METADATA_EVERY: u64 = 16;

impl<'a> Simulation<'a> {
    fn new<H: Hooks + 'static>(
        workload: &'a Workload,
        config: &'a RunConfig,
        hooks: H,
        notes: &'a mut dyn FnMut(SpecNote<'_>),
    ) -> Result<Self, ReplayError> {
        let ledger = config.backend.ledger();
        let mut builder = cache_builder(config, ledger.clone());
        let pages_handled = Arc::new(AtomicU64::new(0));
        let counter = PagesHandled(pages_handled.clone());
        // The counter outermost, as a layer of its own would be.
        builder =
            builder.wrap_allocator(move |inner| Box::new(Hooked::new(inner, (counter, hooks))));
        let cache = builder.build().map_err(|e| match e {
            unikv::Error::Pool(unikv::pools::Error::BufferTooSmall { needed, .. }) => {
                ReplayError::BudgetTooSmall {
                    workload: workload.name.clone(),
                    layout: config.layout,
                    page_size: config.page_size,
                    budget_bytes: config.memory_bytes,
                    needed_bytes: needed.0,
                    reason: bs1_floor(&config.model).into(),
                }
            }
            other => ReplayError::Cache(other),
        })?;
        let mut arrivals: Vec<usize> = Vec::with_capacity(workload.requests.len());
        let mut dependents = vec![Vec::new(); workload.requests.len()];
        for (i, r) in workload.requests.iter().enumerate() {
            match r.after {
                // `validate` makes it an earlier request; any other is treated as absent.
                Some(after) if (after as usize) < i => dependents[after as usize].push(i),
                _ => arrivals.push(i),
            }
        }
        arrivals.sort_by_key(|&i| (workload.requests[i].arrival_step, i));
        let mut stats = RunStats::new(workload, config);
        if config.model.has_recurrent_state() {
            let slots = cache.stats().mamba;
            stats.mamba = Some(MambaStats {
                slot_bytes: slots.page_bytes,
                slots_total: slots.total_pages as u64,
                ..MambaStats::default()
            });
        }
        Ok(Simulation {
            workload,
            config,
            cache,
            ledger,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_arrival: 0,
            arrivals,
            dependents,
            released: Vec::new(),
            stats,
            samples: SampleRecorder::new(config.max_samples),
            tokens_done: 0,
            pages_handled,
            estimate: DecodeEstimate::new(),
            spec: config.speculation.map(|mode| Speculating {
                mode,
                parents: match mode.draft {
                    DraftShape::Chain { .. } => Vec::new(),
                    DraftShape::Tree { nodes } => tree_parents(nodes),
                },
                acceptance: Acceptance::new(config.seed, &mode),
                stats: SpecStats {
                    draft: mode.to_string(),
                    width: mode.width(),
                    late: mode.late,
                    ..SpecStats::default()
                },
                lanes: if config.model.has_recurrent_state() {
                    crate::config::verify_lanes(config) as usize
                } else {
                    usize::MAX
                },
                turn: 0,
            }),
            notes,
            computed: Vec::new(),
            meta: StepMetadata::new(),
            metadata_ns: None,
            metadata_from: 0,
            metadata_due: false,
        })
    }

    fn run(mut self, progress: &dyn Fn(StepProgress)) -> Result<RunStats, ReplayError> {
        let total = self.workload.requests.len() as u64;
        let mut step = 0u64;
        while self.stats.requests_completed < total {
            if step >= self.config.max_steps {
                return Err(self.stalled(
                    step,
                    format!("passed the step limit of {}", self.config.max_steps),
                ));
            }
            self.arrive(step);
            self.computed.clear();
            self.metadata_ns = None;
            self.metadata_from = 0;
            self.metadata_due = step.is_multiple_of(METADATA_EVERY);
            let started = thread_cpu_time();
            let moved = self.step()?;
            let report = self.cache.step_boundary();
            // Host bookkeeping only, in this thread's CPU time (preemption on a shared
            // machine does not count). The CPU backend runs device ops (page moves, the
            // mirror upload) synchronously on this thread, where a GPU would launch them
            // asynchronously, so their time is taken out: the ledger's wall time (cheap
            // per op; a device op preempted is over-subtracted, a host op never counted).
            // The step's metadata is timed apart (its own row of the report).
            let metadata = self.metadata_ns.unwrap_or(0);
            let elapsed = (thread_cpu_time()
                .saturating_sub(started)
                .saturating_sub(thread_cpu_time_overhead())
                .saturating_sub(self.ledger.device_time())
                .as_nanos() as u64)
                .saturating_sub(metadata);
            self.step_boundary_result(report)?;
            step += 1;
            self.stats.steps = step;
            self.stats.step_cpu_ns.push(elapsed);
            if self.metadata_ns.is_some() {
                self.stats
                    .step_with_metadata_cpu_ns
                    .push(elapsed + metadata);
            }
            self.stats.pages_handled = self.pages_handled.load(Ordering::Relaxed);
            self.observe(step);
            progress(StepProgress {
                step,
                tokens_done: self.tokens_done,
                requests_completed: self.stats.requests_completed,
            });
            if !moved && self.next_arrival == self.arrivals.len() && self.released.is_empty() {
                return Err(self.stalled(step, "no request could make progress".into()));
            }
        }
        self.finish(step)
    }

    /// Queues the requests that arrive at `step`: those of a fixed step in arrival order,
    /// then those an earlier step's finishes released, in the order they were released.
    fn arrive(&mut self, step: u64) {
        while let Some(&i) = self.arrivals.get(self.next_arrival) {
            if self.workload.requests[i].arrival_step > step {
                break;
            }
            self.queue(i);
            self.next_arrival += 1;
        }
        if self.released.is_empty() {
            return;
        }
        let mut released = std::mem::take(&mut self.released);
        released.retain(|&i| {
            let due = self.workload.requests[i].arrival_step <= step;
            if due {
                self.queue(i);
            }
            !due
        });
        self.released = released;
    }

    /// Puts request `i` of the workload at the back of the queue.
    fn queue(&mut self, i: usize) {
        let tokens = self.workload.requests[i]
            .prompt
            .iter()
            .map(|&t| TokenId(t))
            .collect();
        self.waiting.push_back(Waiting {
            spec: i,
            tokens,
            sampled: 0,
        });
    }

    /// One scheduler step, in the reference engine's order: the step's prefill budget
    /// (`chunk_tokens`) first continues the requests still prefilling, then admits new
    /// ones (matching each against the prefix cache when it is admitted, so a prefix
    /// cached earlier in the step is a hit); every request that was decoding when the
    /// step began decodes one token; finished requests enter the cache. Returns whether
    /// anything moved.
    fn step(&mut self) -> Result<bool, ReplayError> {
        let decoders: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].req.remaining_prefill() == 0)
            .collect();
        let mut budget = self.config.chunk_tokens as usize;
        let mut moved = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].req.remaining_prefill() > 0 {
                moved |= self.prefill_chunk(i, &mut budget)?;
            }
            i += 1;
        }
        moved |= self.admit(&mut budget)?;
        moved |= if self.spec.is_some() {
            self.verify(decoders)?
        } else {
            self.decode(decoders)?
        };
        self.step_metadata()?;
        moved |= self.finish_requests()?;
        Ok(moved)
    }

    /// Builds the step's metadata for the requests it computes, as an engine does after
    /// the step's allocations and before its forward (a verify before its settlement), on
    /// every [`METADATA_EVERY`]-th step: for those computed since the last build (a
    /// speculative step's plain decodes past its verify batch come after the verifies
    /// settle, so they are a second build); its host CPU time (device work excluded, as
    /// for the step) adds to `metadata_ns`.
    fn step_metadata(&mut self) -> Result<(), ReplayError> {
        let from = self.metadata_from;
        if !self.metadata_due || (from == self.computed.len() && self.metadata_ns.is_some()) {
            return Ok(());
        }
        self.metadata_from = self.computed.len();
        let running = &self.running;
        // A retraction pops the newest request: an index still holding its id is current.
        let batch: Vec<(&Request, usize)> = self.computed[from..]
            .iter()
            .filter_map(|&(i, id, n)| {
                let r = running.get(i).filter(|r| r.req.id() == id)?;
                Some((&r.req, n))
            })
            .collect();
        let device_before = self.ledger.device_time();
        let started = thread_cpu_time();
        let built = self.cache.build_step_metadata(&mut self.meta, &batch);
        let device = self.ledger.device_time().saturating_sub(device_before);
        let ns = thread_cpu_time()
            .saturating_sub(started)
            .saturating_sub(thread_cpu_time_overhead())
            .saturating_sub(device)
            .as_nanos() as u64;
        self.metadata_ns = Some(self.metadata_ns.unwrap_or(0) + ns);
        built?;
        Ok(())
    }

    /// Admits waiting requests in order while the concurrency cap, the prefill budget and
    /// memory allow, and prefills their first chunk.
    fn admit(&mut self, budget: &mut usize) -> Result<bool, ReplayError> {
        let mut admitted = false;
        while self.running.len() < self.workload.concurrency as usize && *budget > 0 {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let spec = &self.workload.requests[w.spec];
            let output_left = (spec.output_len - w.sampled.min(spec.output_len)) as usize;
            let hit = self.cache.match_prefix(w.tokens);
            let reserve = DecodeEstimate::admitting(output_left)
                + self.running_reserve()
                + self.verify_reserve();
            if !self.cache.can_admit(&hit, reserve) {
                if self.running.is_empty() {
                    // Nothing else holds memory: clear the prefix cache and try once more,
                    // else this request can never run.
                    let len = hit.prompt_len();
                    self.cache.evict_all()?;
                    if !self.cache.can_admit(&hit, reserve.min(1)) {
                        return Err(self.too_small(len + output_left));
                    }
                } else {
                    self.waiting.push_front(Waiting {
                        spec: w.spec,
                        tokens: hit.into_tokens(),
                        sampled: w.sampled,
                    });
                    break;
                }
            }
            let req = self.cache.admit(hit)?;
            self.stats.prompt_tokens += req.tokens().len() as u64;
            let (reused, kv_hit) = (req.cached_at_admission(), req.kv_hit_at_admission());
            self.stats.prefix_hit_tokens += reused as u64;
            self.stats.kv_hit_tokens += kv_hit as u64;
            self.stats.recomputed_tokens += kv_hit.saturating_sub(reused) as u64;
            if let Some(mamba) = &mut self.stats.mamba {
                // A model with recurrent state resumes only where a state is cached.
                mamba.recurrent_hit_tokens += reused as u64;
            }
            self.running.push(Running {
                spec: w.spec,
                req,
                sampled: w.sampled,
            });
            self.stats.peak_admitted = self.stats.peak_admitted.max(self.running.len() as u64);
            admitted = true;
            // A match never covers the prompt's last token, so there is always a chunk.
            self.prefill_chunk(self.running.len() - 1, budget)?;
        }
        Ok(admitted)
    }

    /// Prefills the next chunk of `running[i]` within `budget` and caches what it has so
    /// far (the reference engine caches unfinished requests after every chunk, so that
    /// later requests with the same prefix hit it while its SWA is still live). Out of
    /// memory, the newest request is retracted (maybe this one) and the step goes on.
    fn prefill_chunk(&mut self, i: usize, budget: &mut usize) -> Result<bool, ReplayError> {
        loop {
            if i >= self.running.len() {
                return Ok(false); // it was retracted
            }
            let n = self.running[i].req.remaining_prefill().min(*budget);
            match self.cache.alloc_extend(&mut self.running[i].req, n) {
                Ok(()) => {
                    self.computed.push((i, self.running[i].req.id(), n));
                    *budget -= n;
                    self.tokens_done += n as u64;
                    self.cache.cache_unfinished(&mut self.running[i].req)?;
                    if self.running[i].req.remaining_prefill() == 0 {
                        self.first_token(i);
                    }
                    return Ok(true);
                }
                Err(unikv::Error::OutOfMemory { .. }) => {
                    if self.retract_newest()?.is_none() {
                        return Err(self.too_small(self.running[i].req.tokens().len()));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The forward that completes a prefill samples the first output token (a request
    /// re-admitted after retraction already has its pending token).
    fn first_token(&mut self, i: usize) {
        let r = &mut self.running[i];
        if r.sampled == 0 {
            r.sampled = 1;
            self.tokens_done += 1;
        }
    }

    /// Runs `alloc` on the requests of `decoders` (ascending indices into `running`) with
    /// output still to go; while memory is short, retracts the newest running request and
    /// retries without it. `Ok(None)`: no request was left to allocate for; else whether
    /// a request was retracted. `extra` is the rows one request needs past its length
    /// (for the error when even one request alone does not fit).
    fn alloc_retracting(
        &mut self,
        decoders: &mut Vec<usize>,
        extra: usize,
        mut alloc: impl FnMut(&mut Self, &[usize]) -> Result<(), unikv::Error>,
    ) -> Result<Option<bool>, ReplayError> {
        let mut retracted_any = false;
        loop {
            decoders.retain(|&i| {
                let r = &self.running[i];
                r.sampled < self.workload.requests[r.spec].output_len
            });
            if decoders.is_empty() {
                return Ok(None);
            }
            match alloc(self, decoders) {
                Ok(()) => return Ok(Some(retracted_any)),
                Err(unikv::Error::OutOfMemory { .. }) => {
                    let need = self.running[decoders[0]].req.len() + extra;
                    match self.retract_newest()? {
                        Some(retracted) => {
                            retracted_any = true;
                            decoders.retain(|&i| i != retracted);
                        }
                        None => return Err(self.too_small(need)),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// One decode token for each request that had finished prefill when the step began
    /// (`decoders`, ascending indices into `running`).
    fn decode(&mut self, mut decoders: Vec<usize>) -> Result<bool, ReplayError> {
        let allocated = self.alloc_retracting(&mut decoders, 1, |s, decoders| {
            let tokens: Vec<TokenId> = decoders
                .iter()
                .map(|&i| {
                    let r = &s.running[i];
                    // The token fed back is the last one sampled, the `sampled`-th.
                    fed_back(s.config.seed, &s.workload.requests[r.spec], r.sampled)
                })
                .collect();
            let mut batch = requests(&mut s.running, decoders);
            s.cache.alloc_decode(&mut batch, &tokens)
        })?;
        let Some(retracted_any) = allocated else {
            return Ok(false);
        };
        for &i in &decoders {
            self.running[i].sampled += 1;
            self.computed.push((i, self.running[i].req.id(), 1));
        }
        self.tokens_done += decoders.len() as u64;
        if !retracted_any {
            self.estimate.decay();
        }
        Ok(true)
    }

    /// One verify step for each request that had finished prefill when the step began
    /// (`decoders`, ascending indices into `running`): `alloc_verify` for the batch (out
    /// of memory, the newest request is retracted and the rest retried, as for a decode),
    /// then `settle` of each request's oldest verify once as many are in flight as the
    /// mode keeps (1, or 2 with counts a step late).
    fn verify(&mut self, mut decoders: Vec<usize>) -> Result<bool, ReplayError> {
        let Some(spec) = &self.spec else {
            return Ok(false);
        };
        let mode = spec.mode;
        let parents = spec.parents.clone();
        // At most the cache's verify batch verifies, its members taken round robin; the
        // others decode plainly after the settlement.
        let all = decoders.clone();
        if decoders.len() > spec.lanes {
            let start = spec.turn % decoders.len();
            decoders.rotate_left(start);
            decoders.truncate(spec.lanes);
            decoders.sort_unstable();
        }
        if let Some(spec) = &mut self.spec {
            spec.turn = spec.turn.wrapping_add(decoders.len());
        }
        let draft = match mode.draft {
            DraftShape::Chain { k } => Draft::Chain { k: k as usize },
            DraftShape::Tree { .. } => Draft::Tree { parents: &parents },
        };
        let allocated = self.alloc_retracting(&mut decoders, draft.width(), |s, decoders| {
            let drafts = vec![draft; decoders.len()];
            let mut batch = requests(&mut s.running, decoders);
            (s.notes)(SpecNote::Begin);
            s.cache.alloc_verify(&mut batch, &drafts)?;
            (s.notes)(SpecNote::Verified { drafts: &drafts });
            Ok(())
        })?;
        let Some(retracted_any) = allocated else {
            return Ok(false);
        };
        // The verify's forward holds every reserved row: the step's peak, before the
        // rejected ones go back. Its metadata is built before it settles.
        self.observe_peaks();
        for &i in &decoders {
            let req = &self.running[i].req;
            self.computed.push((i, req.id(), req.reserved_rows()));
        }
        self.step_metadata()?;
        let in_flight = mode.speculation().max_in_flight as usize;
        // Settled: the oldest verify of each request that verified with as many in
        // flight as the mode keeps, and of each waiting one whose counts arrived.
        let settling: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| i < self.running.len())
            .filter(|&i| {
                let unsettled = self.running[i].req.unsettled_verifies();
                match decoders.binary_search(&i) {
                    Ok(_) => unsettled == in_flight,
                    Err(_) => unsettled > 0,
                }
            })
            .collect();
        let Some(spec) = &mut self.spec else {
            return Ok(false);
        };
        spec.stats.verify_steps += decoders.len() as u64;
        if !settling.is_empty() {
            // What the target accepted: drawn, capped by the output left (at least 1).
            let mut counts = Vec::with_capacity(settling.len());
            let mut paths: Vec<Vec<u32>> = Vec::new();
            let mut tokens: Vec<Vec<TokenId>> = Vec::with_capacity(settling.len());
            for &i in &settling {
                let r = &self.running[i];
                let request = &self.workload.requests[r.spec];
                let cap = (request.output_len - r.sampled) as usize;
                let count = match mode.draft {
                    DraftShape::Chain { k } => spec.acceptance.chain(k, cap),
                    DraftShape::Tree { .. } => {
                        let mut path = Vec::new();
                        spec.acceptance.tree_path(cap, &mut path);
                        let n = path.len();
                        paths.push(path);
                        n
                    }
                };
                tokens.push(
                    (0..count as u32)
                        .map(|j| fed_back(self.config.seed, request, r.sampled + j))
                        .collect(),
                );
                counts.push(count);
            }
            let accepted: Vec<Accepted<'_>> = match mode.draft {
                DraftShape::Chain { .. } => tokens.iter().map(|t| Accepted::chain(t)).collect(),
                DraftShape::Tree { .. } => paths
                    .iter()
                    .zip(&tokens)
                    .map(|(p, t)| Accepted::tree(p, t))
                    .collect(),
            };
            let mut batch = requests(&mut self.running, &settling);
            (self.notes)(SpecNote::Begin);
            self.cache.settle(&mut batch, &accepted)?;
            (self.notes)(SpecNote::Settled {
                accepted: &counts,
                paths: (!paths.is_empty()).then_some(&paths[..]),
            });
            for (&i, &count) in settling.iter().zip(&counts) {
                self.running[i].sampled += count as u32;
                self.tokens_done += count as u64;
            }
            spec.stats.settled_steps += settling.len() as u64;
            spec.stats.accepted_tokens += counts.iter().sum::<usize>() as u64;
        }
        if !retracted_any {
            self.estimate.decay();
        }
        // The decoders beyond the verify batch decode one token plainly, as an engine
        // turns speculation off past its speculative batch (vLLM's
        // `speculative_disable_by_batch_size`, TensorRT-LLM's `max_concurrency`): no
        // request waits a step, and none needs scratch. Their verifies settled above.
        let rest: Vec<usize> = all
            .into_iter()
            .filter(|&i| i < self.running.len() && decoders.binary_search(&i).is_err())
            .filter(|&i| self.running[i].req.unsettled_verifies() == 0)
            .collect();
        if !rest.is_empty() {
            self.decode(rest)?;
        }
        Ok(true)
    }

    /// Output tokens a running request has still to decode.
    fn output_left(&self, r: &Running) -> usize {
        let len = self.workload.requests[r.spec].output_len;
        (len - r.sampled.min(len)) as usize
    }

    /// The rows the running requests' verifies transiently hold past their settled
    /// ones (each up to the verify width per verify in flight), which admission keeps
    /// free beside the decode estimate (the admitted request's own are priced by
    /// `can_admit`).
    fn verify_reserve(&self) -> usize {
        self.spec.as_ref().map_or(0, |s| {
            let held = s.mode.width() as usize * s.mode.speculation().max_in_flight as usize;
            held * self.running.len()
        })
    }

    /// What the running requests keep reserved for their decode.
    fn running_reserve(&self) -> usize {
        self.running
            .iter()
            .map(|r| self.estimate.running(self.output_left(r)))
            .sum()
    }

    /// Sends the most recently admitted request back to the front of the queue, its KV
    /// released (the reference engine's retraction), and resets the decode estimate. Returns its index in `running`, or
    /// `None` when it is the only running request (nothing else could make room).
    fn retract_newest(&mut self) -> Result<Option<usize>, ReplayError> {
        if self.running.len() < 2 {
            return Ok(None);
        }
        let r = self.running.pop().expect("two or more running");
        let tokens = self.cache.release(r.req)?;
        self.waiting.push_front(Waiting {
            spec: r.spec,
            tokens,
            sampled: r.sampled,
        });
        self.stats.retractions += 1;
        let (decoded, max_new) = self.running.iter().fold((0, 0), |(d, m), r| {
            let len = self.workload.requests[r.spec].output_len;
            (d + u64::from(r.sampled.min(len)), m + u64::from(len))
        });
        self.estimate
            .retracted(decoded, max_new, self.running.len());
        Ok(Some(self.running.len()))
    }

    /// Finishes the requests that sampled their last token: their KV enters the tree.
    fn finish_requests(&mut self) -> Result<bool, ReplayError> {
        let mut finished = false;
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.sampled >= self.workload.requests[r.spec].output_len {
                let r = self.running.remove(i);
                self.cache.cache_finished(r.req)?;
                self.stats.requests_completed += 1;
                self.released.extend_from_slice(&self.dependents[r.spec]);
                finished = true;
            } else {
                i += 1;
            }
        }
        Ok(finished)
    }

    /// Counts what poll found at the step boundary; anything else is fatal.
    fn step_boundary_result(
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
    fn observe_peaks(&mut self) {
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
    /// use).
    fn observe(&mut self, step: u64) {
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
        self.samples.record(step, || {
            bytes.iter().map(|(n, b)| (n.to_string(), *b)).collect()
        });
        // Keep the ledger small: count its syncs, then forget its op records.
        self.stats.host_syncs += self.ledger.syncs() as u64;
        self.ledger.reset();
    }

    /// After the last request: clear the prefix cache and count what was not given back.
    fn finish(mut self, step: u64) -> Result<RunStats, ReplayError> {
        // Evictions under memory pressure, not the clearing below.
        let e = self.cache.stats().evictions;
        self.cache.evict_all()?;
        let report = self.cache.step_boundary();
        self.step_boundary_result(report)?;
        let stats = self.cache.stats();
        self.stats.leaked_pages = [stats.full, stats.swa, stats.mamba]
            .iter()
            .map(|s| (s.total_pages - s.available_pages) as u64)
            .sum::<u64>()
            + stats.live_requests as u64;
        let mut evictions = vec![("full".to_string(), e.full_tokens)];
        if self.config.model.swa_layers > 0 {
            evictions.push(("swa".to_string(), e.swa_tokens));
        }
        self.stats.evictions_by_kind = evictions.into_iter().collect();
        if let Some(mamba) = &mut self.stats.mamba {
            mamba.state_evictions = e.mamba_states;
            mamba.donor_nodes = e.donor_nodes;
        }
        self.stats.host_syncs += self.ledger.syncs() as u64;
        self.stats.invariant_violations = violations(&self.cache);
        self.stats.speculative = self.spec.take().map(|s| s.stats);
        let model = self.config.model;
        let Simulation {
            samples,
            stats: mut run,
            ..
        } = self;
        run.samples = samples.finish(step, || {
            subpool_bytes(&model, &stats)
                .into_iter()
                .map(|(n, b)| (n.to_string(), b))
                .collect()
        });
        // The cache (and whatever wraps its allocator) is dropped on return.
        Ok(run)
    }

    fn stalled(&self, steps: u64, reason: String) -> ReplayError {
        ReplayError::Stalled {
            workload: self.workload.name.clone(),
            layout: self.config.layout,
            page_size: self.config.page_size,
            steps,
            reason,
        }
    }

    fn too_small(&self, tokens: usize) -> ReplayError {
        let m = &self.config.model;
        let per_token = m.full_bytes_per_token() + m.swa_bytes_per_token();
        // A request of a model with recurrent state also holds its three state slots.
        let states = m.state_bytes_per_request().saturating_mul(3);
        ReplayError::BudgetTooSmall {
            workload: self.workload.name.clone(),
            layout: self.config.layout,
            page_size: self.config.page_size,
            budget_bytes: self.config.memory_bytes,
            needed_bytes: (tokens as u64)
                .saturating_mul(per_token)
                .saturating_add(states),
            reason: format!("one request of {tokens} tokens does not fit alone"),
        }
    }
}

/// Counts the pages (and state slots) the allocator binds or releases, call by call:
/// what a step's host work should be proportional to (moves inside the allocator are
/// not counted).
#[derive(Debug)]
struct PagesHandled(Arc<AtomicU64>);

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
fn subpool_bytes(model: &ModelSpec, stats: &unikv::CacheStats) -> Vec<(&'static str, u64)> {
    let mut bytes = vec![("full", stats.full.used_bytes())];
    if model.swa_layers > 0 {
        bytes.push(("swa", stats.swa.used_bytes()));
    }
    if model.has_recurrent_state() {
        bytes.push(("mamba", stats.mamba.used_bytes()));
    }
    bytes
}

/// Why a budget the builder refuses cannot hold one request (the batch-size-1 floor).
fn bs1_floor(model: &ModelSpec) -> &'static str {
    match (model.swa_layers > 0, model.has_recurrent_state()) {
        (true, false) => "the buffer cannot hold the sink and one window on both sides",
        (false, _) => "the buffer cannot hold the sink, three state slots and one FULL page",
        (true, true) => {
            "the buffer cannot hold the sink, one window on both sides and three state slots"
        }
    }
}

/// The token a request with `sampled` output tokens sampled feeds back at its next
/// forward: its `sampled`-th output token, the workload's where it fixes them, else drawn
/// from the seed.
fn fed_back(seed: u64, request: &RequestSpec, sampled: u32) -> TokenId {
    let index = (sampled as usize).saturating_sub(1);
    match request.output.as_ref().and_then(|output| output.get(index)) {
        Some(&token) => TokenId(token),
        None => generated_token(seed, request.id, sampled),
    }
}

/// The requests of `running` at `indices` (ascending), as a batch.
fn requests<'r>(running: &'r mut [Running], indices: &[usize]) -> Vec<&'r mut Request> {
    let mut in_batch = vec![false; running.len()];
    for &i in indices {
        in_batch[i] = true;
    }
    running
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| in_batch[*i])
        .map(|(_, r)| &mut r.req)
        .collect()
}

/// The token a request samples as its `index`-th output: deterministic in the seed.
fn generated_token(seed: u64, request: u32, index: u32) -> TokenId {
    let mut rng = SplitMix64::new(
        seed ^ ((request as u64) << 32 | index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    TokenId(rng.below(VOCAB) as u32)
}

/// Violations recorded in the run's cache's invariant scope (this run's alone, whatever
/// else runs in the process).
fn violations(cache: &HybridCache) -> u64 {
    cache
        .invariant_scope()
        .report()
        .map_or(0, |r| r.total_violations())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode estimate follows the reference engine's numbers: 0.7 at start, down to
    /// 0.7 x 0.14 after 600 quiet decode steps (never below), reset by a retraction to
    /// what the batch decoded (plus 20 steps each) over what it may decode, at most 1.
    #[test]
    fn the_decode_estimate_decays_and_resets_as_the_reference_engines_does() {
        let mut e = DecodeEstimate::new();
        assert_eq!(DecodeEstimate::admitting(10_000), 4096, "clipped");
        assert_eq!(DecodeEstimate::admitting(100), 100);
        assert_eq!(e.running(1000), 700);
        assert_eq!(e.running(10_000), (4096.0f64 * 0.7).ceil() as usize);
        for _ in 0..300 {
            e.decay();
        }
        assert!((e.ratio - (0.7 + 0.098) / 2.0).abs() < 1e-9, "{e:?}");
        for _ in 0..400 {
            e.decay();
        }
        assert_eq!(e.ratio, DecodeEstimate::MIN);
        assert_eq!(e.running(1000), 98);
        e.retracted(300, 2000, 10);
        assert!((e.ratio - 500.0 / 2001.0).abs() < 1e-12, "{e:?}");
        e.retracted(5000, 2000, 10);
        assert_eq!(e.ratio, 1.0);
    }
    use crate::config::{Backend, LAYOUTS};
    use crate::speculative::SpecMode;
    use unikv::Layout;
    use unikv_invariants::Level;
    use unikv_workload::Preset;

    fn smoke(layout: Layout, page_size: u32, memory_bytes: u64) -> Result<RunStats, ReplayError> {
        let config = RunConfig::new(ModelSpec::GPT_OSS_20B, layout, page_size, memory_bytes);
        run(&Preset::Smoke.build(3), &config, (), &|_| {})
    }

    #[test]
    fn every_request_finishes_with_no_sync_violation_or_leak() {
        for layout in LAYOUTS {
            for ps in unikv_invariants::testing::page_sizes() {
                let stats = smoke(layout, ps, 1 << 30).unwrap();
                assert_eq!(
                    stats.requests_completed, stats.requests_total,
                    "{layout} ps {ps}"
                );
                assert_eq!(
                    (
                        stats.host_syncs,
                        stats.invariant_violations,
                        stats.leaked_pages
                    ),
                    (0, 0, 0)
                );
                assert!(stats.steps > 0 && stats.step_cpu_ns.len() as u64 == stats.steps);
                assert!(
                    stats.peak_bytes_by_subpool["full"] > 0
                        && stats.peak_bytes_by_subpool["swa"] > 0
                );
                assert!(!stats.samples.is_empty());
            }
        }
    }

    #[test]
    fn a_shared_prefix_is_a_hit_once_it_is_cached() {
        let stats = smoke(Layout::Unified, 1, 1 << 30).unwrap();
        assert!(stats.prefix_hit_tokens > 0, "{stats:?}");
        // gpt-oss resumes wherever its KV hit ends (its window is live there).
        assert_eq!(stats.kv_hit_tokens, stats.prefix_hit_tokens);
        assert_eq!(stats.recomputed_tokens, 0);
        assert!(stats.mamba.is_none());
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let strip = |mut s: RunStats| {
            s.step_cpu_ns.clear();
            s.step_with_metadata_cpu_ns.clear();
            s
        };
        for layout in LAYOUTS {
            let a = strip(smoke(layout, 4, 1 << 30).unwrap());
            let b = strip(smoke(layout, 4, 1 << 30).unwrap());
            assert_eq!(a, b);
        }
    }

    #[test]
    fn memory_pressure_retracts_and_still_finishes_everything() {
        // Enough for a few requests at once, not for the whole batch.
        let stats = smoke(LAYOUTS[0], 4, 48 << 20).unwrap();
        assert_eq!(stats.requests_completed, stats.requests_total);
        assert_eq!(stats.leaked_pages, 0);
    }

    #[test]
    fn an_impossible_budget_is_a_clear_error_not_a_hang() {
        for budget in [1 << 20, 8 << 20] {
            let err = smoke(Layout::Unified, 4, budget).unwrap_err();
            assert!(matches!(err, ReplayError::BudgetTooSmall { .. }), "{err:?}");
            assert!(err.to_string().contains("cannot run it"), "{err}");
        }
    }

    /// A run reports its own cache's breaches only: another scope of the process (another
    /// cache, another rank) breaching at every step of the run does not show in it.
    #[test]
    fn a_run_counts_only_its_own_caches_breaches() {
        let other = unikv::invariants::Scope::new();
        let config = RunConfig::new(ModelSpec::GPT_OSS_20B, Layout::Unified, 16, 1 << 30);
        let stats = unikv_invariants::scoped_level(Level::Warn, || {
            run(&Preset::Smoke.build(3), &config, (), &|_| {
                other.expect(&unikv::pools::invariants::DOUBLE_FREE, false, || {
                    "another cache's breach".into()
                });
            })
        })
        .unwrap();
        assert!(other.violations(&unikv::pools::invariants::DOUBLE_FREE) > 0);
        assert_eq!(stats.invariant_violations, 0);
    }

    /// Two clients, each with a one-turn and a three-turn conversation: prompts of 40
    /// new tokens (after the history), 24 output tokens a turn.
    fn small_chat() -> Workload {
        let shape = unikv_workload::workload::ChatShape {
            clients: 2,
            turns: &[1, 3],
            user_tokens: 40,
            output_tokens: 24,
        };
        shape.build(
            "chat",
            unikv_workload::workload::TokenSource::new(5, "chat"),
        )
    }

    fn chat_run(model: ModelSpec, page_size: u32) -> RunStats {
        let mut config = RunConfig::new(model, Layout::Unified, page_size, 16 << 30);
        config.backend = Backend::None;
        run(&small_chat(), &config, (), &|_| {}).unwrap()
    }

    /// A turn arrives the step after the one before it finished: each of a client's four
    /// turns takes 24 steps (a prefill that samples the first token, 23 decodes), one
    /// after another.
    #[test]
    fn a_next_turn_arrives_once_the_last_one_finished() {
        let stats = chat_run(ModelSpec::GPT_OSS_20B, 1);
        assert_eq!(stats.requests_completed, 8);
        assert_eq!(stats.peak_admitted, 2);
        assert_eq!(stats.steps, 4 * 24);
    }

    /// The scheduler generates exactly the outputs the workload fixed, so a next turn's
    /// prompt finds the whole last turn cached: its prompt and the 23 output tokens fed
    /// back (the 24th was sampled last and has no KV). The three-turn conversations' turns
    /// 2 and 3 (prompts of 104 and 168 tokens, after 40 and 104) hit 63 and 127 tokens,
    /// for each of the two clients; at page size 1 every hit ends where a state is cached
    /// (the running state enters the tree with its finished request), so nothing is
    /// recomputed.
    #[test]
    fn a_next_turn_reuses_the_whole_last_turn_at_page_size_1() {
        for model in [ModelSpec::GPT_OSS_20B, ModelSpec::QWEN3_NEXT_80B_A3B] {
            let stats = chat_run(model, 1);
            let hit = 2 * (63 + 127);
            assert_eq!(stats.prompt_tokens, 2 * (40 + 40 + 104 + 168), "{model}");
            assert_eq!(
                (
                    stats.kv_hit_tokens,
                    stats.prefix_hit_tokens,
                    stats.recomputed_tokens
                ),
                (hit, hit, 0),
                "{model}"
            );
            match stats.mamba {
                Some(m) => {
                    assert_eq!(m.recurrent_hit_tokens, hit);
                    assert!(m.peak_checkpoint_slots > 0 && m.peak_checkpoint_slots < m.peak_slots);
                }
                None => assert!(!model.has_recurrent_state()),
            }
        }
    }

    /// At page size 16 the KV hit ends on the last whole page (48 and 112 tokens) while
    /// the deepest state a recurrent model cached is its last prompt's end (32 and 96: a
    /// finished request's running state is cached only when its rows end a page, and no
    /// grid point lies below 256), so it recomputes 16 tokens a turn; the report says so.
    #[test]
    fn the_report_counts_what_a_recurrent_model_recomputes() {
        let stats = chat_run(ModelSpec::QWEN3_NEXT_80B_A3B, 16);
        let mamba = stats.mamba.unwrap();
        assert_eq!(stats.kv_hit_tokens, 2 * (48 + 112));
        assert_eq!(mamba.recurrent_hit_tokens, 2 * (32 + 96));
        assert_eq!(stats.prefix_hit_tokens, mamba.recurrent_hit_tokens);
        assert_eq!(stats.recomputed_tokens, 2 * (16 + 16));
        // A model without recurrent state resumes where its KV hit ends.
        let plain = chat_run(ModelSpec::GPT_OSS_20B, 16);
        assert_eq!(
            (
                plain.kv_hit_tokens,
                plain.prefix_hit_tokens,
                plain.recomputed_tokens
            ),
            (2 * (48 + 112), 2 * (48 + 112), 0)
        );
        assert!(plain.mamba.is_none());
    }

    /// Chain, tree and late speculation on both layouts and the test page sizes, for a
    /// FULL+SWA model and a recurrent one: every request finishes with no sync, violation
    /// or leak, every verify step accepts at least its first position and at most its
    /// width, and fewer steps are needed than decoding one token per step.
    #[test]
    fn speculative_runs_finish_clean_on_every_layout_and_page_size() {
        let modes = [
            SpecMode::chain(4).unwrap(),
            SpecMode::tree(6).unwrap(),
            SpecMode::chain(4).unwrap().late(),
            SpecMode::tree(6).unwrap().late(),
        ];
        for model in [ModelSpec::GPT_OSS_20B, ModelSpec::NEMOTRON_H_8B] {
            for layout in LAYOUTS {
                for ps in unikv_invariants::testing::page_sizes() {
                    for mode in modes {
                        let label = format!("{model} {layout} ps {ps} {mode}");
                        // A quarter of the budget holds the verify scratch: at 16 GiB,
                        // Nemotron-H's covers 3 of the 4 requests a step late, all of them
                        // in the step.
                        let mut config = RunConfig::new(model, layout, ps, 16 << 30);
                        config.backend = Backend::None;
                        config.speculation = Some(mode);
                        let stats = run(&Preset::Smoke.build(3), &config, (), &|_| {})
                            .unwrap_or_else(|e| panic!("{label}: {e}"));
                        assert_eq!(stats.requests_completed, stats.requests_total, "{label}");
                        assert_eq!(
                            (
                                stats.host_syncs,
                                stats.invariant_violations,
                                stats.leaked_pages
                            ),
                            (0, 0, 0),
                            "{label}"
                        );
                        let spec = stats.speculative.as_ref().unwrap();
                        assert!(spec.settled_steps > 0, "{label}");
                        assert!(spec.accepted_tokens >= spec.settled_steps, "{label}");
                        assert!(
                            spec.accepted_tokens <= spec.settled_steps * u64::from(mode.width()),
                            "{label}"
                        );
                        let plain = RunConfig {
                            speculation: None,
                            ..config.clone()
                        };
                        let base = run(&Preset::Smoke.build(3), &plain, (), &|_| {}).unwrap();
                        assert!(
                            stats.steps < base.steps,
                            "{label}: {} vs {}",
                            stats.steps,
                            base.steps
                        );
                    }
                }
            }
        }
    }

    /// Speculation changes how many tokens a step adds, not which: a chat's next turn
    /// finds exactly the same KV cached as without speculation, and a recurrent model
    /// resumes from the same states, settled in the step or a step late (settling copies
    /// the accepted state into the running slot and saves the checkpoints the accepted
    /// positions cross, so a request finishing with a verify in flight caches its state).
    #[test]
    fn speculation_generates_the_same_tokens_as_decoding() {
        for model in [ModelSpec::GPT_OSS_20B, ModelSpec::QWEN3_NEXT_80B_A3B] {
            for mode in [
                SpecMode::chain(4).unwrap(),
                SpecMode::tree(6).unwrap().late(),
            ] {
                for layout in LAYOUTS {
                    let mut config = RunConfig::new(model, layout, 1, 16 << 30);
                    config.backend = Backend::None;
                    config.speculation = Some(mode);
                    let spec = run(&small_chat(), &config, (), &|_| {}).unwrap();
                    let plain = RunConfig {
                        speculation: None,
                        ..config.clone()
                    };
                    let plain = run(&small_chat(), &plain, (), &|_| {}).unwrap();
                    assert_eq!(
                        (spec.prompt_tokens, spec.kv_hit_tokens),
                        (plain.prompt_tokens, plain.kv_hit_tokens),
                        "{model} {mode} {layout}"
                    );
                    assert_eq!(
                        (spec.prefix_hit_tokens, spec.recomputed_tokens),
                        (plain.prefix_hit_tokens, plain.recomputed_tokens),
                        "{model} {mode}"
                    );
                    let s = spec.speculative.unwrap();
                    // 8 requests of 24 output tokens: the first comes from prefill, the rest
                    // from verify steps, or, on a recurrent model past its verify batch,
                    // from plain decodes.
                    if model.has_recurrent_state() {
                        assert!(s.accepted_tokens <= 8 * 23, "{model} {mode}");
                        assert!(s.verify_steps > 0, "{model} {mode}");
                    } else {
                        assert_eq!(s.accepted_tokens, 8 * 23, "{model} {mode}");
                    }
                }
            }
        }
    }

    /// A speculative run never takes more steps than decoding: the decoders beyond the
    /// verify batch decode plainly in the same step instead of waiting for their turn
    /// (Qwen3-Next's verify batch at 16 GiB is 2 requests of the chat's 8).
    #[test]
    fn decoders_beyond_the_verify_batch_decode_plainly() {
        let model = ModelSpec::QWEN3_NEXT_80B_A3B;
        for layout in LAYOUTS {
            let mut config = RunConfig::new(model, layout, 1, 16 << 30);
            config.backend = Backend::None;
            config.speculation = Some(SpecMode::chain(4).unwrap());
            assert_eq!(crate::config::verify_lanes(&config), 2);
            let spec = run(&small_chat(), &config, (), &|_| {}).unwrap();
            let plain = RunConfig {
                speculation: None,
                ..config.clone()
            };
            let plain = run(&small_chat(), &plain, (), &|_| {}).unwrap();
            assert!(
                spec.steps <= plain.steps,
                "{layout}: {} > {}",
                spec.steps,
                plain.steps
            );
            assert_eq!(spec.prefix_hit_tokens, plain.prefix_hit_tokens, "{layout}");
        }
    }

    /// At page size 1 every token allocated is a page bound, so the count is at least the
    /// tokens not served from the cache; at page size 16 it is about a sixteenth.
    #[test]
    fn pages_handled_counts_the_pages_bound_and_released() {
        let w = Preset::Smoke.build(3);
        let pages = |ps| {
            let config = RunConfig::new(ModelSpec::GPT_OSS_20B, Layout::Unified, ps, 1 << 30);
            let stats = run(&w, &config, (), &|_| {}).unwrap();
            (stats.pages_handled, stats.prefix_hit_tokens)
        };
        let ((one, hits), (sixteen, _)) = (pages(1), pages(16));
        assert!(one >= w.total_tokens() - hits, "{one} pages");
        assert!(
            sixteen * 8 < one && sixteen * 32 > one,
            "{sixteen} vs {one}"
        );
    }
}

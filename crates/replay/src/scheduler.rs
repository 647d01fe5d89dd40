//! The deterministic scheduler behind `unikv replay`: [`run`] replays one workload
//! through one layout at one page size, driving `HybridCache` as an engine's scheduler
//! would, and returns its [`RunStats`]. A caller that wants to see the allocator's calls
//! (the ops recorder of [`crate::run`]) hands [`run`] a wrapper for the allocator; the
//! scheduler knows nothing of what it wraps.
//!
//! One run's state (`Simulation`) has its methods in four files, by part of a step:
//!
//! | file | what it holds |
//! |---|---|
//! | `scheduler.rs` | [`run`], the run's state and its step loop: arrivals, the step, its metadata, the plain decode, finishes, the end of the run, its errors |
//! | `scheduler/admission.rs` | admission (`DecodeEstimate` and the verify rows it reserves), prefill chunks, retraction |
//! | `scheduler/speculative.rs` | the verify step, its settlement and the plain decode past the verify batch |
//! | `scheduler/accounting.rs` | the pages-handled hook, sub-pool bytes and peaks, samples, syncs, violations |
//! | `scheduler/tests.rs` | whole runs |
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
//!   the last of those requests finished (a chat's next turn); arrivals join the back of
//!   the queue.
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
use crate::speculative::{Acceptance, DraftShape, tree_parents};
use crate::stats::{MambaStats, RunStats, SampleRecorder, SpecStats};
use accounting::{PagesHandled, subpool_bytes, violations};
use admission::DecodeEstimate;
use speculative::Speculating;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use unikv::kernels::{SyncLedger, thread_cpu_time, thread_cpu_time_overhead};
use unikv::pools::{Hooked, Hooks};
use unikv::{Draft, HybridCache, ModelSpec, Request, StepMetadata, TokenId};
use unikv_workload::rng::SplitMix64;
use unikv_workload::{RequestSpec, Workload};

mod accounting;
mod admission;
mod speculative;
#[cfg(test)]
mod tests;

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
    Simulation::new(workload, config, config.backend.ledger(), hooks, notes)?.run(progress)
}

/// What an overlapped run ([`run_overlapped`]) calls after each step's unikv work: it
/// launches the step's forward on the device and returns at once, so the next step's
/// unikv work runs on the host while the forward runs on the GPU.
pub type LaunchForward<'a> = &'a mut dyn FnMut(u64) -> Result<(), ReplayError>;

/// [`run`] as an overlap scheduler runs it, on the device behind `ledger`: the step
/// metadata is reserved at set-up for the workload (its concurrency, longest request and
/// largest step, so no step grows it) and built every step, and `forward(step)` is
/// called after the step's unikv work (its boundary included), outside the timed region,
/// where the engine launches the step's forward; the next step's work (frees,
/// admissions, allocations, eviction, metadata build and upload) then runs while that
/// forward does. The overlap benchmark ([`crate::overlap`]).
pub fn run_overlapped<H: Hooks + 'static>(
    workload: &Workload,
    config: &RunConfig,
    ledger: Arc<SyncLedger>,
    hooks: H,
    forward: LaunchForward<'_>,
) -> Result<RunStats, ReplayError> {
    let mut notes = |_: SpecNote<'_>| {};
    let mut sim = Simulation::new(workload, config, ledger, hooks, &mut notes)?;
    let width = config.speculation.map_or(1, |s| s.width()) as usize;
    let concurrency = workload.concurrency as usize;
    sim.cache.reserve_step_metadata(unikv::StepCapacity {
        requests: concurrency,
        max_len: workload
            .requests
            .iter()
            .map(|r| r.prompt.len() + r.output_len as usize + width)
            .max()
            .unwrap_or(0),
        max_new_tokens: config.chunk_tokens as usize + concurrency * width,
        max_loaded_pages: 0,
    })?;
    sim.metadata_every = 1;
    sim.forward = Some(forward);
    sim.run(&|_| {})
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
    /// For each request, the requests whose `after` names it.
    dependents: Vec<Vec<usize>>,
    /// For each request, how many of its `after` have not finished yet: it is released
    /// when the last one does.
    unfinished_after: Vec<usize>,
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
    /// Whether this step builds its metadata (every `metadata_every`-th).
    metadata_due: bool,
    /// Steps between metadata builds ([`METADATA_EVERY`], or 1 in an overlapped run).
    metadata_every: u64,
    /// Launches each step's forward (an overlapped run).
    forward: Option<LaunchForward<'a>>,
}

/// The replay builds step metadata every this many steps: enough to time it across a
/// run, while the CPU backend's share of the device work (translating every row of the
/// batch, which a GPU does in microseconds) stays a small part of the replay's wall time.
pub const METADATA_EVERY: u64 = 16;

impl<'a> Simulation<'a> {
    fn new<H: Hooks + 'static>(
        workload: &'a Workload,
        config: &'a RunConfig,
        ledger: Arc<SyncLedger>,
        hooks: H,
        notes: &'a mut dyn FnMut(SpecNote<'_>),
    ) -> Result<Self, ReplayError> {
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
        let mut unfinished_after = vec![0; workload.requests.len()];
        for (i, r) in workload.requests.iter().enumerate() {
            // `validate` makes them earlier requests; any other is treated as absent.
            for &after in r.after.iter().filter(|&&a| (a as usize) < i) {
                dependents[after as usize].push(i);
                unfinished_after[i] += 1;
            }
            if unfinished_after[i] == 0 {
                arrivals.push(i);
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
            unfinished_after,
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
            metadata_every: METADATA_EVERY,
            forward: None,
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
            self.metadata_due = step.is_multiple_of(self.metadata_every);
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
            if let Some(forward) = &mut self.forward {
                forward(step)?;
            }
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
                for &d in &self.dependents[r.spec] {
                    self.unfinished_after[d] -= 1;
                    if self.unfinished_after[d] == 0 {
                        self.released.push(d);
                    }
                }
                finished = true;
            } else {
                i += 1;
            }
        }
        Ok(finished)
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
        if let (Some(host), Some(tier)) = (&mut self.stats.host, &stats.host) {
            host.observe(tier);
            host.device_hit_tokens = self
                .stats
                .prefix_hit_tokens
                .saturating_sub(host.host_hit_tokens);
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

    /// The whole size of running request `i`: its workload prompt and every output token,
    /// what it needs at its end (not the rows it holds now).
    fn full_size(&self, i: usize) -> usize {
        let spec = &self.workload.requests[self.running[i].spec];
        spec.total_len() as usize
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

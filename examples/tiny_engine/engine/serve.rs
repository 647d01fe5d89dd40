//! The serving loop: admission, chunked prefill and decode batches allocated through
//! unikv, the forward over its buffer, sampling, aborts, retraction and caching, with the
//! run's shape ([`RunConfig`]) and counts ([`RunStats`]).

use super::buffer::{BufferKv, load_states, step_table, store_states};
use super::check::{check_resumed_state, compare, compare_runs};
use super::config::{Fault, Reuse, RunConfig};
use super::model::{Rng, States, Weights, argmax, forward, zero_states};

use super::workload::{
    Arrival, Job, Output, Workload, arrive, checkpoint_grid, random_tokens, workload,
};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use unikv::kernels::{
    CpuDevice, Device, DeviceCall, DeviceHooks, DeviceOp, Error as DeviceError, Intercepted,
};
use unikv::mamba::MambaSpec;
use unikv::{Error, HybridCache, Layout, ModelSpec, PrefixMatch, Request, StepMetadata, TokenId};

/// What a serving run went through.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// Scheduler steps.
    pub steps: u64,
    /// Tokens the forwards computed (recomputation after a retraction included).
    pub computed_tokens: u64,
    /// Prompt tokens of every admission (a re-admitted request's generated tokens
    /// count as prompt).
    pub prompt_tokens: u64,
    /// Prompt tokens the prefill chunks computed: the prompt tokens less the reused ones
    /// (and what a retraction threw away).
    pub prefill_tokens: u64,
    /// Wall time of the forwards and the cache calls (not of the resumed-state checks).
    pub elapsed: Duration,
    /// Page envelopes moved by compaction.
    pub compaction_moves: u64,
    /// Admissions with a prefix hit (for a recurrent model: a resumed state).
    pub prefix_hits: u64,
    /// Tokens reused from the prefix cache (`Request::cached_at_admission`).
    pub hit_tokens: u64,
    /// Tokens whose FULL KV the cache held at admission (`Request::kv_hit_at_admission`);
    /// beyond `hit_tokens` they were recomputed, for want of a state there.
    pub kv_hit_tokens: u64,
    /// Resumed states compared with a contiguous recompute of their prefix.
    pub resumes_checked: u64,
    /// Requests retracted after resuming from a state but before their first step read
    /// it (nothing to check; they are admitted again).
    pub resumes_retracted: u64,
    /// The first resumed state that differed from the recompute.
    pub state_mismatch: Option<String>,
    /// Window releases (a request's cursor moved up).
    pub window_releases: u64,
    /// Nodes evicted from the prefix cache.
    pub evictions: u64,
    /// Of `hit_tokens`, those loaded back from the host tier.
    pub host_hit_tokens: u64,
    /// Requests retracted for memory and admitted again.
    pub retractions: u64,
    /// Requests aborted.
    pub aborts: u64,
    /// `cache_unfinished` calls.
    pub cached_unfinished: u64,
}

impl RunStats {
    /// The number of resumed states checked, or the first that differed, bit for bit,
    /// from the state a contiguous recompute of its prefix reaches.
    pub fn resumed_states(&self) -> Result<u64, String> {
        match &self.state_mismatch {
            Some(diff) => Err(diff.clone()),
            None => Ok(self.resumes_checked),
        }
    }
}

/// A job admitted to the cache, with its request.
struct Running {
    job: usize,
    req: Request,
    /// The next token to append (sampled, not yet computed).
    pending: Option<TokenId>,
    /// It prefilled a chunk this step (cached unfinished after the step, with reuse on).
    chunked: bool,
    /// Resumed from a cached state after this many tokens, not yet checked: its first
    /// step compares the state it reads with a recompute.
    resumed_at: Option<usize>,
}

/// The budget in bytes for `tokens` tokens of FULL and SWA KV, state slots on top.
pub(super) fn memory_bytes(cfg: &RunConfig, spec: &ModelSpec) -> u64 {
    let per_token = spec.full_bytes_per_token() + spec.swa_bytes_per_token();
    let kv = cfg.budget_tokens * per_token;
    let slots = if spec.has_recurrent_state() {
        3 * cfg.max_running as u64 * spec.slot_pool().unwrap().bytes_per_slot * 2
    } else {
        0
    };
    match cfg.layout {
        // The static layout keeps ~0.9 of the KV bytes again for its slot pool.
        Layout::Static { .. } if spec.has_recurrent_state() => kv * 2 + slots,
        _ => kv + slots,
    }
}

/// Hooks that count the spans every `move_spans` moves (compaction, and the state copy
/// of an admission with a cached state), around the engine's [`CpuDevice`].
#[derive(Debug, Default)]
pub struct SpansMoved(AtomicU64);

impl SpansMoved {
    /// Spans moved so far.
    fn moved(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl DeviceHooks for SpansMoved {
    type Ticket = ();

    fn name(&self, inner: String) -> String {
        format!("counting({inner})")
    }

    fn before<D: Device + ?Sized>(&self, _: &D, _: DeviceCall<'_>) -> Result<(), DeviceError> {
        Ok(())
    }

    fn after<D: Device + ?Sized>(
        &self,
        _: &D,
        call: DeviceCall<'_>,
        _: (),
        outcome: Result<(), &DeviceError>,
    ) {
        if call.op == DeviceOp::MoveSpans && outcome.is_ok() {
            self.0.fetch_add(call.items as u64, Ordering::Relaxed);
        }
    }
}

/// Serves the workload through unikv. Returns every job (with follow-ups) as it ran and
/// the run's counts.
pub fn serve(cfg: &RunConfig) -> Result<(Vec<Job>, RunStats), Error> {
    let mut rng = Rng::new(cfg.seed);
    let weights = Weights::random(cfg.seed ^ 0x5eed, cfg.model);
    let spec = cfg.model.spec();
    let cpu = Arc::new(CpuDevice::new());
    let device = Arc::new(Intercepted::with_hooks(cpu.clone(), SpansMoved::default()));
    let ps = cfg.page_size as usize;
    let mut builder = HybridCache::builder()
        .model(spec)
        .page_size(cfg.page_size)
        .memory_bytes(memory_bytes(cfg, &spec))
        .layout(cfg.layout)
        .device(device.clone());
    if cfg.model.is_recurrent() {
        builder = builder.checkpoint_interval(checkpoint_grid(cfg.page_size));
    }
    if cfg.host_memory_bytes > 0 {
        builder = builder.host_memory_bytes(cfg.host_memory_bytes);
    }
    let mut cache = builder.build()?;
    let slot_layout = MambaSpec::new(spec.mamba_layers, spec.recurrent)
        .slot_layout()
        .ok();
    let geo = cache.kv_geometry();
    let buffer = cache.allocator().buffer();

    let mut jobs = workload(cfg.workload, cfg.page_size, &mut rng);
    let mut waiting: Vec<usize> = (0..jobs.len()).collect();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut stats = RunStats::default();
    let mut meta = StepMetadata::new();
    let mut state_copies = 0u64;
    let unit = ps.max(16);
    let max_conversation = (cfg.budget_tokens as usize / 3).max(unit);
    let (max_new, abort_chance) = match cfg.workload {
        Workload::Mixed {
            max_new,
            abort_chance,
            ..
        } => (max_new, abort_chance),
        _ => (0, 0.0),
    };
    let mixed = matches!(cfg.workload, Workload::Mixed { .. });
    let started = Instant::now();
    // Time spent recomputing resumed states to check them (not serving).
    let mut verifying = Duration::ZERO;

    while !(queue.is_empty() && running.is_empty() && waiting.is_empty()) {
        arrive(&mut jobs, &mut waiting, &mut queue);
        // Admission.
        while running.len() < cfg.max_running {
            let Some(&j) = queue.front() else { break };
            let job = &jobs[j];
            let mut prompt = job.prompt.clone();
            prompt.extend_from_slice(&job.output.tokens);
            let hit: PrefixMatch = cache.match_prefix(prompt);
            if mixed && rng.chance(0.03) && job.output.tokens.is_empty() {
                // Abort before admission: dropping the match undoes nothing.
                drop(hit);
                queue.pop_front();
                jobs[j].aborted = true;
                stats.aborts += 1;
                continue;
            }
            if !cache.can_admit(&hit, 1) {
                break;
            }
            let req = match cache.admit(hit) {
                Ok(r) => r,
                Err(Error::OutOfMemory { .. }) => break,
                Err(e) => return Err(e),
            };
            queue.pop_front();
            let cached = req.cached_at_admission();
            jobs[j].reused = cached;
            if cfg.reuse == Reuse::Off {
                assert_eq!(
                    req.kv_hit_at_admission(),
                    0,
                    "with reuse off nothing is cached, so nothing is hit"
                );
            }
            stats.prompt_tokens += req.tokens().len() as u64;
            stats.kv_hit_tokens += req.kv_hit_at_admission() as u64;
            if cached > 0 {
                stats.prefix_hits += 1;
                stats.hit_tokens += cached as u64;
                if cfg.model.is_recurrent() {
                    state_copies += 1;
                }
            }
            running.push(Running {
                job: j,
                req,
                pending: None,
                chunked: false,
                resumed_at: (cached > 0 && cfg.model.is_recurrent()).then_some(cached),
            });
        }
        if running.is_empty() {
            assert!(
                queue.is_empty(),
                "the budget cannot admit request {:?}",
                queue.front()
            );
            panic!("jobs {waiting:?} wait for jobs that will never run");
        }

        // Allocation: prefill chunks under the step's token budget, then one decode batch.
        // A shortfall retracts the newest request (it is admitted again later).
        let mut step: Vec<(usize, usize)> = Vec::new(); // (running index, new tokens)
        let mut budget = cfg.prefill_budget;
        let mut i = 0;
        while i < running.len() {
            let r = &mut running[i];
            let remaining = r.req.remaining_prefill();
            if remaining == 0 || budget == 0 {
                i += 1;
                continue;
            }
            let n = remaining.min(budget).min(rng.range(1, unit * 2));
            let cursor = r.req.window_cursor();
            match cache.alloc_extend(&mut r.req, n) {
                Ok(()) => {
                    stats.window_releases += u64::from(r.req.window_cursor() > cursor);
                    stats.prefill_tokens += n as u64;
                    r.chunked = true;
                    budget -= n;
                    step.push((i, n));
                    i += 1;
                }
                Err(Error::OutOfMemory { .. }) => {
                    // The newest goes: `i` itself (then `i` names the next request) or a
                    // newer one (then `i` is tried again).
                    retract(&mut cache, &mut running, &mut step, &mut queue, &mut stats)?;
                }
                Err(e) => return Err(e),
            }
        }
        loop {
            let decoders: Vec<usize> = (0..running.len())
                .filter(|&i| {
                    running[i].pending.is_some() && running[i].req.remaining_prefill() == 0
                })
                .filter(|i| !step.iter().any(|&(j, _)| j == *i))
                .collect();
            if decoders.is_empty() {
                break;
            }
            let cursors: Vec<usize> = decoders
                .iter()
                .map(|&i| running[i].req.window_cursor())
                .collect();
            let next: Vec<TokenId> = decoders
                .iter()
                .map(|&i| running[i].pending.unwrap())
                .collect();
            let result = {
                let mut batch: Vec<&mut Request> = running
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| decoders.contains(i))
                    .map(|(_, r)| &mut r.req)
                    .collect();
                cache.alloc_decode(&mut batch, &next)
            };
            match result {
                Ok(()) => {
                    for (k, &i) in decoders.iter().enumerate() {
                        running[i].pending = None;
                        stats.window_releases +=
                            u64::from(running[i].req.window_cursor() > cursors[k]);
                        step.push((i, 1));
                    }
                    break;
                }
                Err(Error::OutOfMemory { .. }) => {
                    retract(&mut cache, &mut running, &mut step, &mut queue, &mut stats)?;
                }
                Err(e) => return Err(e),
            }
        }
        step.sort_unstable();

        // Metadata, after every allocation of the step; then the forward on the "device".
        let batch: Vec<(&Request, usize)> =
            step.iter().map(|&(i, n)| (&running[i].req, n)).collect();
        cache.build_step_metadata(&mut meta, &batch)?;
        drop(batch);
        let view = cache.step_view(&meta)?;
        let table = step_table(&cpu, &view)?;
        let mut logits: Vec<Vec<f32>> = Vec::with_capacity(step.len());
        cpu.run_kernel(buffer, |bytes| {
            for (k, &(i, _)) in step.iter().enumerate() {
                let resumed_at = running[i].resumed_at.take();
                let req = &running[i].req;
                let m = view.request(k);
                let mut states = zero_states(&weights);
                // The state before row 0 is the initial (zero) one; later rows continue
                // from the slot (a cached state copied there at admission, or this
                // request's own last step). A fresh slot's bytes are stale.
                if let (Some(slot), Some(layout), true) =
                    (m.state_slot, &slot_layout, m.first_query() > 0)
                {
                    if resumed_at.is_some() && cfg.fault == Fault::FlipResumedState {
                        let at = geo.slot_offset(slot) + layout.temporal(0).unwrap().start;
                        bytes[at as usize] ^= 1;
                    }
                    load_states(bytes, &geo, layout, slot, &mut states);
                }
                // The first step after a resume reads the cached state: it must be the
                // one a full recompute of the prefix reaches.
                if let Some(at) = resumed_at {
                    stats.resumes_checked += 1;
                    let checking = Instant::now();
                    let checked = if m.first_query() == at {
                        check_resumed_state(&weights, &req.tokens()[..at], &states)
                    } else {
                        Err(format!(
                            "resumed after {at} tokens, but its first step starts at {}",
                            m.first_query()
                        ))
                    };
                    verifying += checking.elapsed();
                    if let Err(diff) = checked
                        && stats.state_mismatch.is_none()
                    {
                        stats.state_mismatch = Some(format!("request {}: {diff}", req.id()));
                    }
                }
                let tokens = &req.tokens()[m.first_query()..m.len];
                let mut saved: Vec<(u32, States)> = Vec::new();
                let mut kv = BufferKv {
                    bytes: &mut *bytes,
                    geo,
                    step: m,
                    table: &table,
                };
                // Every checkpoint the step metadata lists for this request (a list: the
                // branching point, the prompt's last whole page, grid points) gets the
                // state after its row length.
                let l = forward(
                    &weights,
                    &mut kv,
                    &mut states,
                    tokens,
                    m.first_query(),
                    |len, s| {
                        for c in m.checkpoints.iter().filter(|c| c.at_len == len) {
                            saved.push((c.slot, s.clone()));
                        }
                    },
                );
                assert_eq!(
                    saved.len(),
                    m.checkpoints.len(),
                    "every listed checkpoint lies inside the step's new tokens"
                );
                if let (Some(slot), Some(layout)) = (m.state_slot, &slot_layout) {
                    store_states(bytes, &geo, layout, slot, &states);
                    if cfg.fault != Fault::SkipCheckpointWrites {
                        for (slot, s) in &saved {
                            store_states(bytes, &geo, layout, *slot, s);
                        }
                    }
                }
                logits.push(l);
            }
        })?;
        stats.computed_tokens += step.iter().map(|&(_, n)| n as u64).sum::<u64>();

        // Sampling, finishing, aborts, caching.
        let mut finished: Vec<usize> = Vec::new();
        for (k, &(i, _)) in step.iter().enumerate() {
            let r = &mut running[i];
            if r.req.remaining_prefill() > 0 {
                continue;
            }
            let job = &mut jobs[r.job];
            let next = argmax(&logits[k]);
            job.output.tokens.push(next);
            job.output.logits = std::mem::take(&mut logits[k]);
            if job.output.tokens.len() == job.max_new {
                finished.push(i);
            } else {
                r.pending = Some(next);
            }
        }
        finished.sort_unstable();
        for &i in finished.iter().rev() {
            let r = running.remove(i);
            let job = &jobs[r.job];
            let mut prompt = job.prompt.clone();
            prompt.extend_from_slice(&job.output.tokens);
            // A follow-up turn on the whole conversation: a prefix hit on its pages.
            if mixed && rng.chance(0.5) && prompt.len() + unit < max_conversation {
                let question = rng.range(1, unit / 2);
                prompt.extend(random_tokens(&mut rng, question));
                jobs.push(Job::new(prompt, rng.range(1, max_new), Arrival::Start));
                queue.push_back(jobs.len() - 1);
            }
            match cfg.reuse {
                Reuse::On => cache.cache_finished(r.req)?,
                Reuse::Off => drop(cache.release(r.req)?),
            }
        }
        if mixed && !running.is_empty() && rng.chance(abort_chance) {
            let i = rng.below(running.len());
            let r = running.remove(i);
            jobs[r.job].aborted = true;
            stats.aborts += 1;
            cache.release(r.req)?;
        }
        if cfg.reuse == Reuse::On && !mixed {
            // The scripted workloads cache every prefill chunk with the states it saved
            // (a request holds at most `checkpoints_per_step` of them), as SGLang's
            // chunked prefill does, so a request arriving while this one still runs
            // resumes from them.
            for r in running.iter_mut().filter(|r| r.chunked) {
                cache.cache_unfinished(&mut r.req)?;
                stats.cached_unfinished += 1;
            }
        }
        if cfg.reuse == Reuse::On && mixed {
            // The mixed workload caches a decoding request now and then (so a request
            // keeps checkpoints across steps, the cache reuses their slots, and the
            // windows of uncached prompts are released).
            if !running.is_empty() && rng.chance(0.05) {
                let i = rng.below(running.len());
                if running[i].req.remaining_prefill() == 0 {
                    cache.cache_unfinished(&mut running[i].req)?;
                    stats.cached_unfinished += 1;
                }
            }
        }
        for r in &mut running {
            r.chunked = false;
        }
        cache.step_boundary()?;
        stats.steps += 1;
    }
    stats.elapsed = started.elapsed() - verifying;
    stats.compaction_moves = device.hooks().moved().saturating_sub(state_copies);
    let ev = cache.stats().evictions;
    stats.evictions = ev.full_nodes + ev.swa_tombstones + ev.mamba_states;
    stats.host_hit_tokens = cache.stats().host.map_or(0, |h| h.hit_tokens);
    Ok((jobs, stats))
}

/// Releases the newest running request for memory and queues it again at the front (its
/// generated tokens become part of its prompt when it is admitted again).
fn retract(
    cache: &mut HybridCache,
    running: &mut Vec<Running>,
    step: &mut Vec<(usize, usize)>,
    queue: &mut VecDeque<usize>,
    stats: &mut RunStats,
) -> Result<(), Error> {
    assert!(
        running.len() > 1,
        "the budget cannot hold one request even with everything else evicted"
    );
    let victim = running.len() - 1;
    let r = running.remove(victim);
    step.retain(|&(j, _)| j != victim);
    for s in step.iter_mut() {
        if s.0 > victim {
            s.0 -= 1;
        }
    }
    stats.retractions += 1;
    stats.resumes_retracted += u64::from(r.resumed_at.is_some());
    queue.push_front(r.job);
    cache.release(r.req)?;
    Ok(())
}

/// Checks one run of a scripted reuse workload against `baseline`, a run of the same
/// workload (reuse off, say) whose outputs equal `reference`: the same jobs with the same
/// prompts and bit-identical outputs, equal to the reference; every state a request
/// resumed from equal, bit for bit, to a contiguous recompute of its prefix; and reuse
/// happened exactly when it is on (on: states resumed, fewer prompt tokens prefilled
/// than admitted; off: not one token hit), so the check cannot pass vacuously. Returns
/// the jobs compared.
pub fn check_reuse(
    cfg: &RunConfig,
    jobs: &[Job],
    stats: &RunStats,
    baseline: &[Job],
    reference: &[Output],
) -> Result<usize, String> {
    let resumed = stats.resumed_states()?;
    compare_runs(baseline, jobs)?;
    let compared = compare(jobs, reference)?;
    match cfg.reuse {
        Reuse::On => {
            if stats.prefix_hits == 0 {
                return Err("reuse on, but no request hit the prefix cache".into());
            }
            if cfg.model.is_recurrent() && resumed + stats.resumes_retracted != stats.prefix_hits {
                return Err(format!(
                    "{} hits but {resumed} resumed states checked ({} retracted first)",
                    stats.prefix_hits, stats.resumes_retracted
                ));
            }
            if stats.prefill_tokens >= stats.prompt_tokens {
                return Err(format!(
                    "reuse on, but {} of {} prompt tokens were prefilled",
                    stats.prefill_tokens, stats.prompt_tokens
                ));
            }
        }
        Reuse::Off => {
            // (A request retracted mid-prefill is admitted again, so its prompt counts
            // twice while only part of it was prefilled the first time.)
            if stats.prefix_hits > 0 || stats.kv_hit_tokens > 0 {
                return Err(format!(
                    "reuse off, but {} hits ({} tokens of KV)",
                    stats.prefix_hits, stats.kv_hit_tokens
                ));
            }
        }
    }
    Ok(compared)
}

//! Speculative decoding on the tiny engine: a draft model (the target's first layer
//! alone, [`Weights::draft`], its K/V in the FULL envelope's draft rows) proposes a chain
//! or a tree of next tokens, the target verifies them all in one step through unikv's
//! verify metadata, and greedy acceptance keeps the longest path whose every token is the
//! target's own choice — so the output is the plain greedy decode's, token for token and
//! bit for bit, however many drafts are rejected.
//!
//! The host side is what an engine's scheduler does: [`HybridCache::alloc_verify`] for
//! the batch, [`HybridCache::build_verify_metadata`] and
//! [`HybridCache::translate_verify`] (with the device offsets of an earlier verify whose
//! counts it has not learnt yet), [`HybridCache::compact_accepted`] after a tree's verify
//! forward, and [`HybridCache::settle`] when the counts arrive: at once ([`Counts::Timely`])
//! or one step late, after the next step was allocated and run ([`Counts::Late`], an
//! overlap scheduler). The "device" side is the CPU twin of the kernels: it reads the
//! verify metadata's translated ids, runs the draft and the target over the verify
//! positions (a tree's nodes attend to their ancestors only), and writes the accepted
//! counts and paths into a device table the next step's metadata and the tree compaction
//! read. Settled rows before a verify are read at the kernel ids the cache's mirror
//! holds for them (what the step metadata's FULL and SWA tables carry).
//!
//! Recurrent state rolls back by copy (the cache's default: a verify writes the state
//! after each position into its scratch lane) or by replay ([`Rollback::Replay`]: a
//! verify logs each position's conv inputs, and the cache hands [`TinyReplay`] the
//! accepted ones to replay through [`Weights::advance`], the forward's own recurrence).
//!
//! With reuse on, prefill chunks and finished requests enter the prefix cache (a request
//! may finish with a verify in flight), so a later request resumes from a state a
//! speculative turn left: a checkpoint a settlement copied out of a verify's scratch
//! group, or the running state a finished request cached. Its first step compares that
//! state, bit for bit, with a contiguous recompute of its prefix, as the plain serving
//! loop does ([`SpecStats::served`]); with reuse off nothing is cached.

use super::buffer::{
    BufferKv, IdKv, load_states, load_states_at, read_f32s, step_table, store_states,
    store_states_at, write_f32s,
};
use super::check::check_resumed_state;
use super::config::{Fault, Reuse, RunConfig};
use super::model::{RC, Rng, States, WINDOW, Weights, argmax, forward, log_of, zero_states};

use super::serve::{RunStats, check_reuse, memory_bytes};
use super::workload::{Job, Output, Workload, arrive, checkpoint_grid, workload};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use unikv::kernels::{CpuDevice, Device, HostSync, Readback, TableId};
use unikv::mamba::{MambaSpec, SlotLayout};
use unikv::{
    Accepted, DeviceValues, Draft, Error, HybridCache, KvGeometry, ReplayContext, Request,
    Speculation, StateCommit, StateReplay, StepMetadata, TokenId, VerifyLayout, VerifyMetadata,
    VerifyOffsets,
};

/// The draft tree of [`Drafting::Tree`] (parents in row order, an EAGLE-2-style top-k
/// tree): the root (the request's next token) with its two likeliest continuations,
/// each continued by its likeliest, and the first branch once more. Depth 3.
pub const TREE: [i32; 6] = [-1, 0, 0, 1, 2, 3];

/// How the draft model proposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drafting {
    /// A chain of `k` tokens (EAGLE, MTP): each the draft's greedy choice after the one
    /// before it.
    Chain {
        /// Drafted tokens per verify.
        k: usize,
    },
    /// The draft tree [`TREE`]: a node's children are the draft's best next tokens after
    /// it, best first.
    Tree,
}

/// When the host learns a verify's accepted counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counts {
    /// Before the next step is allocated.
    Timely,
    /// One step late (an overlap scheduler): the next verify is allocated, its metadata
    /// built and its forward run before the host settles this one.
    Late,
}

/// How a verified recurrent state rolls back to its accepted position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rollback {
    /// The verify writes the state after each position into its scratch lane; settling
    /// copies the accepted one (the cache's default).
    Copy,
    /// The verify logs each position's recurrence inputs; settling replays the accepted
    /// ones from the running state ([`TinyReplay`], registered with the cache).
    Replay,
}

/// How the engine speculates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecMode {
    /// Chain or tree drafts.
    pub drafting: Drafting,
    /// When counts arrive.
    pub counts: Counts,
    /// How recurrent state rolls back (no effect without recurrent layers).
    pub rollback: Rollback,
}

impl SpecMode {
    /// The tree each verify checks (a chain is the tree `i − 1`).
    fn parents(&self) -> Vec<i32> {
        match self.drafting {
            Drafting::Chain { k } => (-1..k as i32).collect(),
            Drafting::Tree => TREE.to_vec(),
        }
    }

    /// What the cache is built for.
    fn speculation(&self) -> Speculation {
        let s = match self.drafting {
            Drafting::Chain { k } => Speculation::chain(k as u32),
            Drafting::Tree => Speculation::tree(TREE.len() as u32),
        };
        match self.counts {
            Counts::Timely => s,
            Counts::Late => s.in_flight(2),
        }
    }

    /// A short label for tables.
    pub fn label(&self) -> String {
        let d = match self.drafting {
            Drafting::Chain { k } => format!("chain {k}"),
            Drafting::Tree => format!("tree {}", TREE.len()),
        };
        let c = match self.counts {
            Counts::Timely => "timely",
            Counts::Late => "late",
        };
        let r = match self.rollback {
            Rollback::Copy => "",
            Rollback::Replay => " replay",
        };
        format!("{d} {c}{r}")
    }
}

/// Every speculative mode for `model`: chains of `k` and the draft tree, counts on time
/// and late, rolled back by copy and, on a model with recurrent layers, by replay.
pub fn spec_modes(k: usize, model: super::model::Model) -> Vec<SpecMode> {
    let rollbacks: &[Rollback] = if model.is_recurrent() {
        &[Rollback::Copy, Rollback::Replay]
    } else {
        &[Rollback::Copy]
    };
    let mut modes = Vec::new();
    for &rollback in rollbacks {
        for drafting in [Drafting::Chain { k }, Drafting::Tree] {
            for counts in [Counts::Timely, Counts::Late] {
                modes.push(SpecMode {
                    drafting,
                    counts,
                    rollback,
                });
            }
        }
    }
    modes
}

/// What a speculative run went through.
#[derive(Clone, Debug, Default)]
pub struct SpecStats {
    /// Scheduler steps.
    pub steps: u64,
    /// Verifies (one request's verify in one step).
    pub verifies: u64,
    /// Draft tokens a verify could have accepted (`k`, or the tree's depth), summed.
    pub drafted: u64,
    /// Draft tokens accepted, summed.
    pub accepted_drafts: u64,
    /// Verifies settled while a later one of the request was in flight.
    pub late_settles: u64,
    /// Requests finished with a verify in flight.
    pub finished_mid_verify: u64,
    /// What a plain run counts of admissions and reuse: prompt and prefilled tokens,
    /// prefix hits, reused and KV-hit tokens, and the resumed states checked against a
    /// recompute ([`RunStats::resumed_states`]); the rest stays 0.
    pub served: RunStats,
    /// Of the resumed states, those inside an earlier request's output: only its verifies
    /// computed those positions, so the state is one a speculative turn left.
    pub resumed_in_output: u64,
    /// Wall time of the run (not of the resumed-state checks).
    pub elapsed: Duration,
}

impl SpecStats {
    /// Draft tokens accepted of those that could have been.
    pub fn acceptance(&self) -> f64 {
        self.accepted_drafts as f64 / self.drafted.max(1) as f64
    }

    /// Tokens a verify step gains on average (its accepted drafts and the target's own
    /// next token).
    pub fn tokens_per_verify(&self) -> f64 {
        (self.accepted_drafts + self.verifies) as f64 / self.verifies.max(1) as f64
    }
}

/// One verify as the device ran it: the accepted nodes and their tokens.
#[derive(Clone, Debug)]
struct Verified {
    path: Vec<u32>,
    tokens: Vec<TokenId>,
}

/// A job admitted to the cache.
struct Running {
    job: usize,
    req: Request,
    /// The next token (the target's choice after the last computed one): the root of
    /// the next verify.
    pending: Option<TokenId>,
    /// Verifies the device ran and the host has not settled, oldest first.
    unsettled: VecDeque<Verified>,
    /// Resumed from a cached state after this many tokens, not yet checked: its first
    /// step (a prefill chunk) compares the state it reads with a recompute.
    resumed_at: Option<usize>,
}

impl Running {
    /// The tokens the device holds rows for: the settled ones, then every unsettled
    /// verify's accepted ones.
    fn device_tokens(&self) -> Vec<TokenId> {
        let mut t = self.req.tokens().to_vec();
        for v in &self.unsettled {
            t.extend_from_slice(&v.tokens);
        }
        t
    }
}

/// The draft and the target model, and where the buffer keeps what they compute.
struct Models<'a> {
    target: &'a Weights,
    draft: &'a Weights,
    geo: KvGeometry,
    slots: Option<SlotLayout>,
    /// Whether verifies log inputs (replay rollback) rather than write states.
    replay: bool,
}

/// The replay rollback's kernel on the CPU backend: each commit's running state,
/// advanced over the accepted positions' logged inputs ([`Weights::advance`], the
/// forward's own recurrence), saved into each checkpoint on the way and into the
/// running slot at the end.
#[derive(Debug)]
pub struct TinyReplay {
    cpu: Arc<CpuDevice>,
    target: Weights,
    layout: SlotLayout,
}

impl TinyReplay {
    /// Bytes one position's log takes: each recurrent layer's conv input, `f32`.
    fn log_bytes(layout: &SlotLayout) -> u64 {
        u64::from(layout.layers()) * RC as u64 * 4
    }
}

impl StateReplay for TinyReplay {
    fn log_bytes_per_position(&self) -> u64 {
        TinyReplay::log_bytes(&self.layout)
    }

    fn replay(
        &self,
        ctx: &ReplayContext<'_>,
        commits: &[StateCommit<'_>],
    ) -> Result<(), unikv::kernels::Error> {
        let layers = self.layout.layers() as usize;
        self.cpu.run_kernel(ctx.buffer, |bytes| {
            let mut states = zero_states(&self.target);
            let mut log = vec![0.0f32; layers * RC];
            for c in commits {
                load_states_at(bytes, ctx.slot_offset(c.running), &self.layout, &mut states);
                for (n, &entry) in c.entries.iter().enumerate() {
                    read_f32s(bytes, ctx.entry_offset(entry), &mut log);
                    self.target.advance(&mut states, &log);
                    for &(at, slot) in c.checkpoints {
                        if at as usize == n + 1 {
                            store_states_at(bytes, ctx.slot_offset(slot), &self.layout, &states);
                        }
                    }
                }
                store_states_at(bytes, ctx.slot_offset(c.running), &self.layout, &states);
            }
        })
    }
}

/// Serves `cfg`'s workload through unikv, speculatively, with `cfg.reuse` and
/// `cfg.fault`. Returns every job as it ran and the run's counts. The budget holds every
/// request (nothing is retracted).
pub fn serve_speculative(cfg: &RunConfig, mode: SpecMode) -> Result<(Vec<Job>, SpecStats), Error> {
    let mut rng = Rng::new(cfg.seed);
    let weights = Weights::random(cfg.seed ^ 0x5eed, cfg.model);
    let spec = cfg.model.spec().with_draft_layers(1);
    let draft = weights.draft(spec.full_layers);
    let speculation = mode.speculation();
    let width = speculation.max_width as usize;
    let parents = mode.parents();
    let cpu = Arc::new(CpuDevice::new());
    // Room for the verify rows and each request's slot group on top of the plain budget.
    let per_token = spec.full_bytes_per_token() + spec.swa_bytes_per_token();
    let mut memory = memory_bytes(cfg, &spec) + 2 * (cfg.max_running * width) as u64 * per_token;
    if let Ok(pool) = spec.slot_pool() {
        memory += 2 * (cfg.max_running * width) as u64 * pool.bytes_per_slot;
    }
    let mut builder = HybridCache::builder()
        .model(spec)
        .page_size(cfg.page_size)
        .memory_bytes(memory)
        .layout(cfg.layout)
        .speculation(speculation)
        .device(cpu.clone());
    let slots = MambaSpec::new(spec.mamba_layers, spec.recurrent)
        .slot_layout()
        .ok();
    if cfg.model.is_recurrent() {
        builder = builder.checkpoint_interval(checkpoint_grid(cfg.page_size));
    }
    let replay = mode.rollback == Rollback::Replay && cfg.model.is_recurrent();
    if let (true, Some(layout)) = (replay, slots) {
        builder = builder.state_replay(Arc::new(TinyReplay {
            cpu: cpu.clone(),
            target: weights.clone(),
            layout,
        }));
    }
    let mut cache = builder.build()?;
    let models = Models {
        target: &weights,
        draft: &draft,
        geo: cache.kv_geometry(),
        slots,
        replay,
    };
    let buffer = cache.allocator().buffer();
    // The accept kernel's outputs: per batch position the accepted count, one past the
    // last accepted node, and the accepted path (then −1).
    let b = cfg.max_running;
    let values: TableId = cpu.alloc_table(2 * b + b * width, 0)?;
    let at = |at| DeviceValues { table: values, at };

    let mut jobs = workload(cfg.workload, cfg.page_size, &mut rng);
    let mut waiting: Vec<usize> = (0..jobs.len()).collect();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut stats = SpecStats::default();
    let mut meta = StepMetadata::new();
    let mut vmeta = VerifyMetadata::new(b);
    cache.reserve_verify_metadata(&vmeta)?; // set-up: the serving loop never allocates
    let keep_unsettled = match mode.counts {
        Counts::Timely => 0,
        Counts::Late => 1,
    };
    let started = Instant::now();
    // Time spent recomputing resumed states to check them (not serving).
    let mut checking = Duration::ZERO;

    while !(queue.is_empty() && running.is_empty() && waiting.is_empty()) {
        arrive(&mut jobs, &mut waiting, &mut queue);
        while running.len() < cfg.max_running {
            let Some(&j) = queue.front() else { break };
            let hit = cache.match_prefix(jobs[j].prompt.clone());
            if !cache.can_admit(&hit, 1) {
                break;
            }
            let req = cache.admit(hit)?;
            queue.pop_front();
            let cached = req.cached_at_admission();
            jobs[j].reused = cached;
            let served = &mut stats.served;
            served.prompt_tokens += req.tokens().len() as u64;
            served.kv_hit_tokens += req.kv_hit_at_admission() as u64;
            let resumed = cached > 0 && cfg.model.is_recurrent();
            if cached > 0 {
                served.prefix_hits += 1;
                served.hit_tokens += cached as u64;
            }
            if resumed && reaches_into_output(&jobs, &req.tokens()[..cached]) {
                stats.resumed_in_output += 1;
            }
            running.push(Running {
                job: j,
                req,
                pending: None,
                unsettled: VecDeque::new(),
                resumed_at: resumed.then_some(cached),
            });
        }
        assert!(!running.is_empty(), "the budget admits no request");

        // Allocation: prefill chunks, then one verify for every decoding request.
        let mut prefill: Vec<(usize, usize)> = Vec::new();
        let mut budget = cfg.prefill_budget;
        for (i, r) in running.iter_mut().enumerate() {
            let n = r.req.remaining_prefill().min(budget);
            if n > 0 {
                cache.alloc_extend(&mut r.req, n)?;
                stats.served.prefill_tokens += n as u64;
                budget -= n;
                prefill.push((i, n));
            }
        }
        let verifiers: Vec<usize> = (0..running.len())
            .filter(|&i| running[i].pending.is_some())
            .collect();
        let draft_shape = match mode.drafting {
            Drafting::Chain { k } => Draft::Chain { k },
            Drafting::Tree => Draft::Tree { parents: &TREE },
        };
        if !verifiers.is_empty() {
            let mut batch = pick(&mut running, &verifiers);
            cache.alloc_verify(&mut batch, &vec![draft_shape; verifiers.len()])?;
            stats.verifies += verifiers.len() as u64;
        }

        // Metadata, after every allocation of the step: the prefill chunks, then each
        // verifier with its reserved rows as new tokens (its page tables are the context
        // its verify reads, built on the device from its lane).
        let step_batch: Vec<(&Request, usize)> = prefill
            .iter()
            .map(|&(i, n)| (&running[i].req, n))
            .chain(verifiers.iter().map(|&i| {
                let req = &running[i].req;
                (req, req.reserved_rows())
            }))
            .collect();
        if !step_batch.is_empty() {
            cache.build_step_metadata(&mut meta, &step_batch)?;
        }
        drop(step_batch);
        let mut verify_ids: Option<(VerifyLayout, Vec<i32>)> = None;
        if !verifiers.is_empty() {
            let batch: Vec<&Request> = verifiers.iter().map(|&i| &running[i].req).collect();
            cache.build_verify_metadata(&mut vmeta, &batch)?;
            // The device offsets: where each request's earlier unsettled verify ends
            // (its accepted count, and one past its last accepted node). The accept
            // kernel wrote them; the CPU twin gathers them into batch order here.
            let mut offsets = vec![0i32; 2 * b];
            let mut late = false;
            for (m, &i) in verifiers.iter().enumerate() {
                if let Some(earlier) = running[i].unsettled.back() {
                    late = true;
                    offsets[m] = earlier.tokens.len() as i32;
                    offsets[b + m] = *earlier.path.last().unwrap() as i32 + 1;
                }
            }
            cpu.upload_table(values, 0, &offsets)?;
            let offsets = late.then_some(VerifyOffsets {
                accepted: at(0),
                last_node: at(b),
            });
            cache.translate_verify(&mut vmeta, offsets)?;
            let l = vmeta.layout();
            let (_, outputs) = vmeta.tables().expect("built");
            let sync = HostSync::acquire("tiny engine: the verify kernel's CPU twin reads its ids");
            verify_ids = Some((l, cpu.read_table(&sync, outputs, 0, l.outputs_len)?));
        }

        // The forward: prefill chunks (target and draft), then the verifies.
        let view = (!prefill.is_empty() || !verifiers.is_empty())
            .then(|| cache.step_view(&meta))
            .transpose()?;
        let table = match &view {
            Some(view) => step_table(&cpu, view)?,
            None => Vec::new(),
        };
        // Kernel ids of the rows before each verify's positions, from its page tables.
        let before: Vec<(Vec<i32>, Vec<i32>)> = verifiers
            .iter()
            .enumerate()
            .map(|(m, &i)| {
                let step = view
                    .as_ref()
                    .expect("a verify batch")
                    .request(prefill.len() + m);
                settled_ids(&cache, &running[i], step, &table)
            })
            .collect();
        let mut prefill_logits: Vec<Vec<f32>> = Vec::new();
        let mut verified: Vec<(Verified, TokenId, Vec<Vec<f32>>)> = Vec::new();
        // The states resumed requests read in their first step: (running index, resumed
        // after, the step's first query, the state).
        let mut resumed: Vec<(usize, usize, usize, States)> = Vec::new();
        cpu.run_kernel(buffer, |bytes| {
            for (k, &(i, _)) in prefill.iter().enumerate() {
                let m = view.as_ref().expect("a prefill batch").request(k);
                let resumed_at = running[i].resumed_at.take();
                let (logits, read) = prefill_forward(
                    &models,
                    bytes,
                    m,
                    &table,
                    &running[i].req,
                    resumed_at.is_some(),
                    cfg.fault,
                );
                prefill_logits.push(logits);
                if let (Some(at), Some(state)) = (resumed_at, read) {
                    resumed.push((i, at, m.first_query(), state));
                }
            }
            if let Some((l, out)) = &verify_ids {
                for (m, &i) in verifiers.iter().enumerate() {
                    let r = &running[i];
                    let ids = NodeIds {
                        l,
                        inputs: vmeta.inputs(),
                        out,
                        m,
                        before: &before[m],
                    };
                    let root = r.pending.expect("a verifier has a next token");
                    // Under replay rollback the earlier unsettled verify is not committed:
                    // its accepted path (a device value) is replayed first.
                    let earlier = r.unsettled.back().map(|v| &v.path[..]);
                    verified.push(verify_forward(
                        &models, bytes, &ids, &parents, root, earlier,
                    ));
                }
            }
        })?;

        // The first step after a resume read the cached state: it must be the one a full
        // recompute of the prefix reaches.
        for (i, at, first_query, state) in resumed {
            let watch = Instant::now();
            let req = &running[i].req;
            let checked = if first_query == at {
                check_resumed_state(models.target, &req.tokens()[..at], &state)
            } else {
                Err(format!(
                    "resumed after {at} tokens, but its first step starts at {first_query}"
                ))
            };
            checking += watch.elapsed();
            stats.served.resumes_checked += 1;
            if let Err(diff) = checked
                && stats.served.state_mismatch.is_none()
            {
                stats.served.state_mismatch = Some(format!("request {}: {diff}", req.id()));
            }
        }

        // The accept kernel's outputs; a tree's accepted nodes move to consecutive rows.
        if !verifiers.is_empty() {
            let mut paths = vec![-1i32; b * width];
            for (m, (v, _, _)) in verified.iter().enumerate() {
                for (n, &node) in v.path.iter().enumerate() {
                    paths[m * width + n] = node as i32;
                }
            }
            cpu.upload_table(values, 2 * b, &paths)?;
            if mode.drafting == Drafting::Tree {
                cache.compact_accepted(&vmeta, at(2 * b))?;
            }
        }

        // Like the scripted workloads of `serve`, with reuse on every prefill chunk enters
        // the prefix cache at once, so a request arriving while this one decodes hits it.
        if cfg.reuse == Reuse::On {
            for &(i, _) in &prefill {
                cache.cache_unfinished(&mut running[i].req)?;
                stats.served.cached_unfinished += 1;
            }
        }

        // Prefill outputs: a finished prompt's first token.
        let mut finished: Vec<usize> = Vec::new();
        for (k, &(i, _)) in prefill.iter().enumerate() {
            let r = &mut running[i];
            if r.req.remaining_prefill() > 0 {
                continue;
            }
            let job = &mut jobs[r.job];
            let next = argmax(&prefill_logits[k]);
            job.output.tokens.push(next);
            job.output.logits = std::mem::take(&mut prefill_logits[k]);
            if job.output.tokens.len() == job.max_new {
                finished.push(i);
            } else {
                r.pending = Some(next);
            }
        }
        // Verify outputs: the accepted drafts and the target's next token, up to the
        // job's length.
        let depth = match mode.drafting {
            Drafting::Chain { k } => k,
            Drafting::Tree => depth_of(&parents, TREE.len() - 1),
        };
        for (&i, (v, bonus, mut logits)) in verifiers.iter().zip(verified) {
            stats.drafted += depth as u64;
            stats.accepted_drafts += v.path.len() as u64 - 1;
            let r = &mut running[i];
            let job = &mut jobs[r.job];
            // The token each node's logits chose: the next path node's, or the bonus.
            for (n, &node) in v.path.iter().enumerate() {
                if job.output.tokens.len() == job.max_new {
                    break;
                }
                let token = v.tokens.get(n + 1).copied().unwrap_or(bonus);
                job.output.tokens.push(token);
                job.output.logits = std::mem::take(&mut logits[node as usize]);
            }
            r.unsettled.push_back(v);
            if job.output.tokens.len() == job.max_new {
                finished.push(i);
            } else {
                r.pending = Some(bonus);
            }
        }

        // The counts arrive: settle every verify but the newest `keep_unsettled`.
        let settling: Vec<usize> = (0..running.len())
            .filter(|&i| running[i].req.unsettled_verifies() > keep_unsettled)
            .collect();
        if !settling.is_empty() {
            let oldest: Vec<Verified> = settling
                .iter()
                .map(|&i| running[i].unsettled.pop_front().expect("unsettled"))
                .collect();
            stats.late_settles += settling
                .iter()
                .filter(|&&i| !running[i].unsettled.is_empty())
                .count() as u64;
            let accepted: Vec<Accepted<'_>> = oldest
                .iter()
                .map(|v| match mode.drafting {
                    Drafting::Chain { .. } => Accepted::chain(&v.tokens),
                    Drafting::Tree => Accepted::tree(&v.path, &v.tokens),
                })
                .collect();
            let mut batch = pick(&mut running, &settling);
            cache.settle(&mut batch, &accepted)?;
        }

        finished.sort_unstable();
        for &i in finished.iter().rev() {
            let r = running.remove(i);
            stats.finished_mid_verify += u64::from(r.req.unsettled_verifies() > 0);
            // With a verify in flight the cache takes the state at the settled length:
            // settling copied it into the running slot.
            match cfg.reuse {
                Reuse::On => cache.cache_finished(r.req)?,
                Reuse::Off => drop(cache.release(r.req)?),
            }
        }
        cache.step_boundary()?;
        stats.steps += 1;
    }
    cpu.free_table(values)?;
    stats.elapsed = started.elapsed() - checking;
    stats.served.steps = stats.steps;
    stats.served.elapsed = stats.elapsed;
    Ok((jobs, stats))
}

/// Whether `prefix` reaches into an earlier job's output: it is that job's prompt, then
/// some of its generated tokens. A verify computed each of those positions, so a cached
/// state at the end of `prefix` is one a speculative turn left.
fn reaches_into_output(jobs: &[Job], prefix: &[TokenId]) -> bool {
    jobs.iter().any(|j| {
        let p = j.prompt.len();
        prefix.len() > p
            && prefix.starts_with(&j.prompt)
            && j.output.tokens.starts_with(&prefix[p..])
    })
}

/// The requests `idx` (ascending) of `running`, mutably, in that order.
fn pick<'a>(running: &'a mut [Running], idx: &[usize]) -> Vec<&'a mut Request> {
    running
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| idx.contains(i))
        .map(|(_, r)| &mut r.req)
        .collect()
}

/// A node's depth in a tree (the root's is 0).
fn depth_of(parents: &[i32], mut node: usize) -> usize {
    let mut d = 0;
    while parents[node] >= 0 {
        node = parents[node] as usize;
        d += 1;
    }
    d
}

/// The FULL and SWA kernel ids of the rows the device holds before a request's newest
/// verify (the settled ones and the earlier unsettled verify's accepted ones), read from
/// its step's page tables; SWA ids only inside the window the verify reads (0 below it).
fn settled_ids(
    cache: &HybridCache,
    r: &Running,
    step: unikv::RequestStep<'_>,
    table: &[i32],
) -> (Vec<i32>, Vec<i32>) {
    let len = r.device_tokens().len();
    let full = (0..len)
        .map(|p| step.full_id(table, p).expect("a row of the request"))
        .collect();
    let swa = if cache.model().swa_layers > 0 {
        let lo = (len + 1).saturating_sub(WINDOW);
        (0..len)
            .map(|p| {
                if p >= lo {
                    step.swa_id(table, p).expect("a row inside the window")
                } else {
                    0
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    (full, swa)
}

/// A prefill chunk's forward: the target (K/V, state, checkpoints) and the draft (its
/// K/V rows), at the step metadata's ids. Returns the target's logits after the chunk
/// and, for a request that `resumed` from a cached state, the state it read from its
/// slot (first flipping a bit of it under [`Fault::FlipResumedState`]).
fn prefill_forward(
    models: &Models<'_>,
    bytes: &mut [u8],
    m: unikv::RequestStep<'_>,
    table: &[i32],
    req: &Request,
    resumed: bool,
    fault: Fault,
) -> (Vec<f32>, Option<States>) {
    let mut states = zero_states(models.target);
    let mut read = None;
    if let (Some(slot), Some(layout), true) = (m.state_slot, &models.slots, m.first_query() > 0) {
        if resumed && fault == Fault::FlipResumedState {
            let at = models.geo.slot_offset(slot) + layout.temporal(0).unwrap().start;
            bytes[at as usize] ^= 1;
        }
        load_states(bytes, &models.geo, layout, slot, &mut states);
        read = resumed.then(|| states.clone());
    }
    let tokens = &req.tokens()[m.first_query()..m.len];
    let mut saved: Vec<(u32, States)> = Vec::new();
    let mut kv = BufferKv {
        bytes: &mut *bytes,
        geo: models.geo,
        step: m,
        table,
    };
    let logits = forward(
        models.target,
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
    let mut none = zero_states(models.draft);
    forward(
        models.draft,
        &mut kv,
        &mut none,
        tokens,
        m.first_query(),
        |_, _| {},
    );
    if let (Some(slot), Some(layout)) = (m.state_slot, &models.slots) {
        store_states(bytes, &models.geo, layout, slot, &states);
        if fault != Fault::SkipCheckpointWrites {
            for (slot, s) in &saved {
                store_states(bytes, &models.geo, layout, *slot, s);
            }
        }
    }
    (logits, read)
}

/// One request's verify metadata as its kernels read it: its batch position `m`, the
/// inputs table's image (its tree mask), the outputs table's translated ids, and the
/// kernel ids of the rows before its positions.
struct NodeIds<'a> {
    l: &'a VerifyLayout,
    inputs: &'a [i32],
    out: &'a [i32],
    m: usize,
    before: &'a (Vec<i32>, Vec<i32>),
}

impl NodeIds<'_> {
    /// The verify positions `node` attends to (its tree mask): its ancestors and itself,
    /// root first.
    fn mask(&self, node: usize) -> impl Iterator<Item = usize> {
        let at = self.l.masks + 2 * (self.m * self.l.width + node);
        let bits = self.inputs[at] as u32 as u64 | (self.inputs[at + 1] as u32 as u64) << 32;
        (0..64).filter(move |&n| bits >> n & 1 == 1)
    }

    /// The FULL and SWA ids by position a node reads and writes: the rows before the
    /// verify, then those of the positions in its mask (its own last). Its depth.
    fn of(&self, node: usize) -> (Vec<i32>, Vec<i32>, usize) {
        let (l, w) = (self.l, self.l.width);
        let mut full = self.before.0.clone();
        let mut swa = self.before.1.clone();
        for n in self.mask(node) {
            full.push(self.out[l.write_full + self.m * w + n]);
            if !self.before.1.is_empty() {
                swa.push(self.out[l.write_swa + self.m * w + n]);
            }
        }
        let depth = full.len() - self.before.0.len() - 1;
        (full, swa, depth)
    }
}

/// The verify forward of one request, as its kernels run it: the draft proposes the
/// tree's tokens (each node attending to the rows before the verify and its ancestors,
/// writing its draft K/V at its row), the target computes every node (K/V at the node's
/// row, the state after it into the node's slot of the group, starting from the state
/// the metadata names), and greedy acceptance walks from the root to the child whose
/// token the target chose, while there is one. Returns the accepted path, the target's
/// next token after it, and every node's logits.
fn verify_forward(
    models: &Models<'_>,
    bytes: &mut [u8],
    ids: &NodeIds<'_>,
    parents: &[i32],
    root: TokenId,
    earlier: Option<&[u32]>,
) -> (Verified, TokenId, Vec<Vec<f32>>) {
    let start = ids.before.0.len();
    let nodes = parents.len();
    let children = |n: usize| (0..nodes).filter(move |&c| parents[c] == n as i32);
    // The draft: node tokens, each node's children its best next tokens.
    let mut tokens = vec![root; nodes];
    for n in 0..nodes {
        let (full, swa, depth) = ids.of(n);
        let mut kv = IdKv {
            bytes: &mut *bytes,
            geo: models.geo,
            full: &full,
            swa: &swa,
        };
        let pos = start + depth;
        let mut none = zero_states(models.draft);
        let logits = forward(
            models.draft,
            &mut kv,
            &mut none,
            &[tokens[n]],
            pos,
            |_, _| {},
        );
        let mut ranked: Vec<usize> = (0..logits.len()).collect();
        // Best first; ties to the lower token, as `argmax`.
        ranked.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        for (c, &t) in children(n).zip(&ranked) {
            tokens[c] = TokenId(t as u32);
        }
    }
    // The target: every node from its parent's state.
    let l = ids.l;
    let slot_of = |n: usize| ids.out[l.state_out + ids.m * l.width + n] as u32;
    // A log entry's byte offset: its slot's, plus its index × the entry's bytes.
    let s = l.slots_per_request;
    let entry_at = |slot: u32, index: i32, layout: &SlotLayout| {
        models.geo.slot_offset(slot) + index as u64 * TinyReplay::log_bytes(layout)
    };
    let mut input = zero_states(models.target);
    if let Some(layout) = &models.slots {
        let slot = ids.out[l.state_in + ids.m] as u32;
        assert!(slot > 0, "the verify's input state translated to the sink");
        load_states(bytes, &models.geo, layout, slot, &mut input);
        if let (true, Some(path)) = (models.replay, earlier) {
            let mut log = vec![0.0f32; layout.layers() as usize * RC];
            for &node in path {
                let n = node as usize;
                let slot = ids.out[l.prev_out + ids.m * l.width + n] as u32;
                let index = ids.inputs[l.entries + ids.m * s + 1 + n];
                read_f32s(bytes, entry_at(slot, index, layout), &mut log);
                models.target.advance(&mut input, &log);
            }
        }
    }
    let mut states: Vec<States> = Vec::with_capacity(nodes);
    let mut logits: Vec<Vec<f32>> = Vec::with_capacity(nodes);
    for n in 0..nodes {
        let mut s = match parents[n] {
            p if p < 0 => input.clone(),
            p => states[p as usize].clone(),
        };
        let (full, swa, depth) = ids.of(n);
        let mut kv = IdKv {
            bytes: &mut *bytes,
            geo: models.geo,
            full: &full,
            swa: &swa,
        };
        let pos = start + depth;
        logits.push(forward(
            models.target,
            &mut kv,
            &mut s,
            &[tokens[n]],
            pos,
            |_, _| {},
        ));
        if let Some(layout) = &models.slots {
            if models.replay {
                let index = ids.inputs
                    [l.entries + ids.m * l.slots_per_request + l.slots_per_request - l.width + n];
                write_f32s(bytes, entry_at(slot_of(n), index, layout), &log_of(&s));
            } else {
                store_states(bytes, &models.geo, layout, slot_of(n), &s);
            }
        }
        states.push(s);
    }
    // Greedy acceptance.
    let mut path = vec![0u32];
    loop {
        let cur = *path.last().unwrap() as usize;
        let want = argmax(&logits[cur]);
        match children(cur).find(|&c| tokens[c] == want) {
            Some(c) => path.push(c as u32),
            None => break,
        }
    }
    let bonus = argmax(&logits[*path.last().unwrap() as usize]);
    let accepted = path.iter().map(|&n| tokens[n as usize]).collect();
    (
        Verified {
            path,
            tokens: accepted,
        },
        bonus,
        logits,
    )
}

/// Checks two speculative runs of `cfg`'s workload (its `reuse` aside), `off` with reuse
/// off and `on` with reuse on, against each other and `reference`, the plain greedy
/// decode: [`check_reuse`] for each (the same jobs with bit-identical outputs, equal to
/// the reference; every resumed state equal to a recompute of its prefix; reuse exactly
/// when on). On a recurrent model with reuse on, every hit resumed a state, and on
/// [`Workload::TurnsAcrossGrid`] some of them lie inside an earlier turn's output (a
/// speculative turn left them), so the check cannot pass on prompt states alone.
/// Returns the resumed states checked.
pub fn check_speculative_reuse(
    cfg: &RunConfig,
    off: (&[Job], &SpecStats),
    on: (&[Job], &SpecStats),
    reference: &[Output],
) -> Result<u64, String> {
    let with = |reuse| RunConfig {
        reuse,
        ..cfg.clone()
    };
    check_reuse(&with(Reuse::Off), off.0, &off.1.served, off.0, reference)
        .map_err(|d| format!("reuse off: {d}"))?;
    check_reuse(&with(Reuse::On), on.0, &on.1.served, off.0, reference)
        .map_err(|d| format!("reuse on: {d}"))?;
    let stats = on.1;
    if cfg.model.is_recurrent()
        && cfg.workload == Workload::TurnsAcrossGrid
        && stats.resumed_in_output == 0
    {
        return Err(format!(
            "reuse on, but none of {} resumed states lies inside an earlier turn's output",
            stats.served.resumes_checked
        ));
    }
    Ok(stats.served.resumes_checked)
}

//! Serving workloads: named presets and the request list the scheduler replays.
//!
//! A [`Workload`] is a list of [`RequestSpec`]s with concrete token ids, generated
//! deterministically from a seed, so that the radix cache sees real sharing where the
//! workload has it and none where it has not:
//!
//! - Every *unique segment* (a random prompt, a question after a shared prefix, a shared
//!   prefix itself) starts with a **lead token** that no other segment of the workload
//!   starts with (`(offset + n) mod VOCAB_SIZE` for the `n`-th segment, with a seeded
//!   `offset`); its other tokens are uniform in `0..VOCAB_SIZE`. So two prompts that do
//!   not share a prefix differ at token 0, and two prompts built on the same shared prefix
//!   agree on exactly that prefix and differ right after it. (Only a workload with more
//!   than [`VOCAB_SIZE`] segments would reuse a lead token.)
//! - Every preset has every request arrive at step 0, as `bench_serving` does with an
//!   unlimited request rate: the client-side cap is the workload's `concurrency`, like
//!   `--max-concurrency`. The one exception is `multi-turn`, whose clients each send a
//!   conversation's next turn (or their next conversation) the step after the last
//!   answer is complete ([`RequestSpec::after`]), as a chat user does.
//! - Output tokens: the scheduler draws a request's output from the run's seed and the
//!   request's id, except where the workload fixes them ([`RequestSpec::output`]):
//!   `multi-turn` does, so that turn `t + 1`'s prompt holds exactly the tokens turn `t`
//!   generated (all of them; the tree holds the KV of all but the last, which was
//!   sampled and never fed back).
//! - Random lengths: `bench_serving --dataset-name random` draws each length uniformly in
//!   `[max(1, ⌊len × ratio⌋), len]` with `--random-range-ratio`. The presets use ratio
//!   **1.0**, i.e. the nominal lengths exactly ([`RANDOM_RANGE_RATIO`]): the shapes are
//!   named by their lengths, fixed lengths put the most pressure on memory, and a report
//!   is easier to read when every request of a preset costs the same.
//!
//! Presets (sources in `../shared/reference/seed-pr.md`, the seed PR's validation):
//!
//! | name | requests | prompt | output | concurrency | source |
//! |---|---|---|---|---|---|
//! | `shared-prefix` | 192 | 4,096 shared + 128 | 2,048 | 192 | the PR's shared-prefix load test |
//! | `long-outputs` | 100 | 512 | 4,096 | 128 | the PR's long-output load test |
//! | `random-2048-512` | 200 | 2,048 | 512 | 64 | the PR's `bench_serving` random 2048/512 |
//! | `random-8192-64` | 100 | 8,192 | 64 | 64 | the PR's `bench_serving` random 8192/64 |
//! | `multi-turn` | 512 turns of 256 conversations (1–5 turns, mean 2.0) | 278 new + the history | 858 | 32 clients | LMSYS-Chat-1M's means × 4 (see below) |
//! | `smoke` | 8 | 96–300 | 8–160 | 4 | none: a small mix for fast tests |
//! | `mamba-starvation` | sized to the budget | 4,096 (+ 256) | 16 / 64 | sized | #34441's shape (recurrent models only) |
//!
//! `multi-turn` takes its shape from LMSYS-Chat-1M (Zheng et al., *LMSYS-Chat-1M: A
//! Large-Scale Real-World LLM Conversation Dataset*, arXiv 2309.11998, Table 1: one
//! million conversations with 25 models, 2.0 turns per conversation, 69.5 tokens per user
//! prompt and 214.5 per response, on average). It keeps the mean turn count (a geometric
//! spread, [`CHAT_TURNS`]) and the prompt : response ratio, and scales the lengths by
//! [`CHAT_LENGTH_SCALE`] = 4 (278 and 858 tokens) so that a turn spans several 256-token
//! pages and the prefix cache, not page rounding, decides its hit rate. Chat has no shared
//! system prompt there, so conversations share nothing; what a turn reuses is its own
//! conversation's history. Its concurrency is its [`CHAT_CLIENTS`] = 32 closed-loop
//! clients (the dataset has no arrival times): 256 conversations, 512 requests, about
//! 1.1 M tokens (`shared-prefix` has 1.2 M).
//!
//! `mamba-starvation` is the one preset sized by its run: its history overfills the
//! budget whatever `--memory` is, so it is built from the model and the budget
//! ([`Preset::build_for`], [`StarvationPlan`]). See [`Preset::MambaStarvation`].

use crate::error::WorkloadError;
use crate::rng::SplitMix64;
use unikv::ModelSpec;

/// Size of the token-id space workloads draw from: gpt-oss's `o200k_harmony` vocabulary
/// (201,088 ids). Any size works; this one makes the ids look like the model's.
pub const VOCAB_SIZE: u32 = 201_088;

/// `bench_serving`'s `--random-range-ratio` for the random presets: 1.0, fixed lengths
/// (see the module documentation for why).
pub const RANDOM_RANGE_RATIO: f64 = 1.0;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// The request's index in its workload (`0..requests.len()`, in workload order).
    pub id: u32,
    /// The scheduler step at which the request arrives (it may wait longer for a slot).
    pub arrival_step: u64,
    /// The prompt's token ids (never empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate (at least 1).
    pub output_len: u32,
    /// The requests whose finishes release this one (empty: none): it then arrives at
    /// the first step after the last of them finished (and not before `arrival_step`),
    /// as a chat client sends a conversation's next turn once the answer to the last one
    /// is complete. Always earlier requests (smaller ids), in increasing order; empty for
    /// every preset but `multi-turn` and `mamba-starvation` ([`StarvationPlan::after`]).
    pub after: Vec<u32>,
    /// The tokens it generates, when the workload fixes them (`output_len` of them, in
    /// order): a conversation's next turn repeats this turn's output in its prompt, so the
    /// scheduler must generate exactly these. `None`: the scheduler draws them from the
    /// run's seed and the request's id.
    pub output: Option<Vec<u32>>,
}

impl RequestSpec {
    /// Prompt length in tokens.
    pub fn prompt_len(&self) -> u64 {
        self.prompt.len() as u64
    }

    /// Prompt plus output, in tokens: the request's length when it finishes.
    pub fn total_len(&self) -> u64 {
        self.prompt_len() + u64::from(self.output_len)
    }
}

/// A named list of requests and the client's concurrency cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// The preset's name, or the trace file's stem.
    pub name: String,
    /// At most this many requests are in the system (running or waiting for memory) at
    /// once; the next one arrives when one finishes (`bench_serving --max-concurrency`).
    pub concurrency: u32,
    /// The requests, ordered by `arrival_step`, then `id`; `requests[i].id == i`.
    pub requests: Vec<RequestSpec>,
}

impl Workload {
    /// `k` tenants of this workload side by side: every request `k` times in a row
    /// (tenant `c`'s token ids, prompt and fixed output, shifted by `c × VOCAB_SIZE`, so
    /// tenants share no prefix and each keeps the sharing it had; a request released by
    /// another's finish is released by the same tenant's copy of it), `k` times the
    /// concurrency. `k = 1` (or 0) is the workload itself.
    pub fn tenants(&self, k: u32) -> Workload {
        let k = k.max(1);
        let mut requests = Vec::with_capacity(self.requests.len() * k as usize);
        for r in &self.requests {
            for c in 0..k {
                let shift = c.saturating_mul(VOCAB_SIZE);
                let shifted = |tokens: &[u32]| -> Vec<u32> {
                    tokens.iter().map(|&t| t.saturating_add(shift)).collect()
                };
                requests.push(RequestSpec {
                    id: requests.len() as u32,
                    arrival_step: r.arrival_step,
                    prompt: shifted(&r.prompt),
                    output_len: r.output_len,
                    // Request `a` of tenant `c` is request `a × k + c` here.
                    after: r
                        .after
                        .iter()
                        .map(|a| a.saturating_mul(k).saturating_add(c))
                        .collect(),
                    output: r.output.as_deref().map(shifted),
                });
            }
        }
        Workload {
            name: self.name.clone(),
            concurrency: self.concurrency.saturating_mul(k),
            requests,
        }
    }

    /// Sum of the prompt lengths.
    pub fn total_prompt_tokens(&self) -> u64 {
        self.requests.iter().map(RequestSpec::prompt_len).sum()
    }

    /// Sum of the output lengths.
    pub fn total_output_tokens(&self) -> u64 {
        self.requests.iter().map(|r| u64::from(r.output_len)).sum()
    }

    /// Prompt plus output tokens of every request (the progress bar's length).
    pub fn total_tokens(&self) -> u64 {
        self.total_prompt_tokens() + self.total_output_tokens()
    }

    /// The longest request, prompt plus output, in tokens (0 for an empty workload).
    pub fn max_request_tokens(&self) -> u64 {
        self.requests
            .iter()
            .map(RequestSpec::total_len)
            .max()
            .unwrap_or(0)
    }

    /// Checks what the scheduler relies on: at least one request, a positive
    /// concurrency, ids equal to positions, arrivals in order, non-empty prompts,
    /// positive output lengths, fixed outputs of exactly `output_len` tokens, and every
    /// `after` naming earlier requests in increasing order.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |reason: String| WorkloadError::BadWorkload {
            name: self.name.clone(),
            reason,
        };
        if self.requests.is_empty() {
            return Err(bad("it has no requests".into()));
        }
        if self.concurrency == 0 {
            return Err(bad("its concurrency is 0".into()));
        }
        let mut previous_arrival = 0;
        for (i, r) in self.requests.iter().enumerate() {
            if r.id as usize != i {
                return Err(bad(format!("request at position {i} has id {}", r.id)));
            }
            if r.arrival_step < previous_arrival {
                return Err(bad(format!(
                    "request {i} arrives at step {} before request {} (step {previous_arrival})",
                    r.arrival_step,
                    i - 1
                )));
            }
            previous_arrival = r.arrival_step;
            if r.prompt.is_empty() {
                return Err(bad(format!("request {i} has an empty prompt")));
            }
            if r.output_len == 0 {
                return Err(bad(format!("request {i} has output length 0")));
            }
            if let Some(output) = &r.output
                && output.len() != r.output_len as usize
            {
                return Err(bad(format!(
                    "request {i} fixes {} output tokens but generates {}",
                    output.len(),
                    r.output_len
                )));
            }
            if let Some(&after) = r.after.iter().find(|&&a| a as usize >= i) {
                return Err(bad(format!(
                    "request {i} waits for request {after}, which is not an earlier one"
                )));
            }
            if !r.after.is_sorted_by(|a, b| a < b) {
                return Err(bad(format!(
                    "request {i} waits for requests {:?}, not in increasing order",
                    r.after
                )));
            }
        }
        Ok(())
    }
}

/// Draws token ids for one workload: lead tokens that never repeat (see the module
/// documentation) and uniform tokens after them.
#[derive(Debug)]
pub struct TokenSource {
    rng: SplitMix64,
    lead_offset: u64,
    leads_used: u64,
}

impl TokenSource {
    /// A source for the workload `name` under `seed`.
    pub fn new(seed: u64, name: &str) -> TokenSource {
        let mut rng = SplitMix64::for_stream(seed, name);
        let lead_offset = rng.below(u64::from(VOCAB_SIZE));
        TokenSource {
            rng,
            lead_offset,
            leads_used: 0,
        }
    }

    /// The random number generator behind the tokens (for lengths).
    pub fn rng(&mut self) -> &mut SplitMix64 {
        &mut self.rng
    }

    /// `len` tokens drawn uniformly (no lead token): text that continues something, such
    /// as a model's output.
    pub fn uniform(&mut self, len: u64) -> Vec<u32> {
        (0..len)
            .map(|_| self.rng.below(u64::from(VOCAB_SIZE)) as u32)
            .collect()
    }

    /// A fresh segment of `len` tokens: a lead token no earlier segment started with,
    /// then uniform tokens.
    pub fn segment(&mut self, len: u64) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        if len == 0 {
            return tokens;
        }
        let lead = (self.lead_offset + self.leads_used) % u64::from(VOCAB_SIZE);
        self.leads_used += 1;
        tokens.push(lead as u32);
        for _ in 1..len {
            tokens.push(self.rng.below(u64::from(VOCAB_SIZE)) as u32);
        }
        tokens
    }
}

/// A length as `bench_serving`'s random dataset draws it: uniform in
/// `[max(1, ⌊len × ratio⌋), len]` (exactly `len` at ratio 1.0, consuming no randomness).
pub fn random_len(rng: &mut SplitMix64, len: u64, ratio: f64) -> u64 {
    let ratio = if ratio.is_finite() {
        ratio.clamp(0.0, 1.0)
    } else {
        1.0
    };
    let lo = ((len as f64 * ratio).floor() as u64).clamp(1, len.max(1));
    rng.in_range(lo, len.max(1))
}

/// The named workloads `--workload` accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Preset {
    /// One 4,096-token system prompt; 192 requests, each that prompt and a 128-token
    /// question, 2,048 output tokens; concurrency 192. Source: the seed PR's shared-prefix
    /// load test (gpt-oss-20b, page size 256).
    SharedPrefix,
    /// 100 requests of 512 prompt / 4,096 output tokens, concurrency 128. Source: the seed
    /// PR's long-output load test.
    LongOutputs,
    /// 200 random prompts of 2,048 tokens, 512 output tokens, concurrency 64. Source: the
    /// seed PR's `bench_serving` random dataset, 2048/512 shape.
    Random2048x512,
    /// 100 random prompts of 8,192 tokens, 64 output tokens, concurrency 64. Source: the
    /// seed PR's `bench_serving` random dataset, 8192/64 shape.
    Random8192x64,
    /// Chat conversations shaped like LMSYS-Chat-1M's (arXiv 2309.11998, Table 1: 2.0
    /// turns per conversation, 69.5 tokens per user prompt, 214.5 per response), lengths
    /// × [`CHAT_LENGTH_SCALE`]: [`CHAT_CLIENTS`] clients each hold the
    /// [`CHAT_TURNS`].len() conversations of [`CHAT_TURNS`] (1, 1, 1, 1, 2, 2, 3 and 5
    /// turns: mean 2.0) one after another, in a seeded order. A conversation's first
    /// turn is [`CHAT_USER_TOKENS`] new tokens; turn `t + 1`'s prompt is turn `t`'s
    /// prompt, the [`CHAT_OUTPUT_TOKENS`] tokens turn `t` generated and
    /// [`CHAT_USER_TOKENS`] new ones. A client sends its next turn the step after its
    /// last one finished ([`RequestSpec::after`]), so at most [`CHAT_CLIENTS`] requests
    /// are in the system. No two conversations share a token prefix. 512 requests.
    MultiTurn,
    /// Eight requests with short lengths: five share a 160-token prefix (longer than
    /// gpt-oss's 128-token window), three are random; staggered arrivals, concurrency 4,
    /// outputs from 8 to 160 tokens. For fast tests and the report snapshot.
    Smoke,
    /// The shape of the reference engine's "Mamba starvation" (#34441, in
    /// `shared/reference/sglang-unified-memory.md` §8): the buffer fills with FULL pages
    /// while slot counters look free, and new requests need state slots. First
    /// [`StarvationPlan::histories`] long conversations (4,096-token prompts, 16 output
    /// tokens, [`StarvationPlan::concurrency`] at once) whose KV and last state stay in
    /// the prefix cache and together overfill the budget by a quarter, so once they ran
    /// the free gap is smaller than one state slot; then [`StarvationPlan::follow_ups`]
    /// follow-up turns of histories that finished last (the history and a 256-token
    /// question, 64 output tokens), each needing three fresh state slots. In the unified
    /// layout those slots can only come from the cached FULL KV (the donor); the static
    /// layout has a fixed slot pool beside a fixed, smaller KV pool. Sized by the model
    /// and the budget ([`Preset::build_for`]); meaningful only for a model with
    /// recurrent state (the command line refuses it for others).
    MambaStarvation,
}

/// How [`Preset::MambaStarvation`] is sized for a model and a budget: every count is
/// derived from the bytes a history and a running request take.
///
/// Requests are admitted in workload order and every history has the same length, so
/// histories finish about in order (speculation accepts a different number of tokens
/// per request and step), all before any follow-up (a follow-up is longer and starts
/// later). Follow-up `k < concurrency` continues history `histories − concurrency + k`
/// and arrives once that history finished, as a conversation's next turn does however
/// fast a run decodes; the next ones continue the histories before those, newest first
/// (the prefix cache evicts the least recently used first), and arrive once every
/// history finished. See [`StarvationPlan::target`] and [`StarvationPlan::after`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StarvationPlan {
    /// History conversations, enough that their cached KV and states overfill the budget
    /// by a quarter (at least 2).
    pub histories: u32,
    /// Follow-up turns: two per request of `concurrency`, at most one per history.
    pub follow_ups: u32,
    /// Requests at once: as many running requests (three state slots and a history's KV
    /// each) as half the budget holds (at least 1, at most 64, fewer than `histories`),
    /// so the running set never needs what the prefix cache cannot give up.
    pub concurrency: u32,
}

impl StarvationPlan {
    /// Prompt tokens of a history (a multiple of every checkpoint grid up to 4,096
    /// tokens, so its last checkpoint, which the prefix cache keeps, ends its prompt).
    pub const HISTORY_PROMPT: u64 = 4_096;
    /// Output tokens of a history.
    pub const HISTORY_OUTPUT: u32 = 16;
    /// Tokens a follow-up adds to its history.
    pub const QUESTION: u64 = 256;
    /// Output tokens of a follow-up.
    pub const FOLLOW_UP_OUTPUT: u32 = 64;
    /// State slots a running request holds (one running state, two checkpoints).
    const SLOTS_PER_REQUEST: u64 = 3;

    /// The plan for `model` in a budget of `memory_bytes`.
    pub fn new(model: &ModelSpec, memory_bytes: u64) -> StarvationPlan {
        let kv_per_token = model.full_bytes_per_token().max(1);
        let state = model.state_bytes_per_request();
        let history_tokens = Self::HISTORY_PROMPT + u64::from(Self::HISTORY_OUTPUT);
        let history_kv = history_tokens.saturating_mul(kv_per_token);
        // A finished history keeps its KV and its last state in the prefix cache.
        let cached = history_kv.saturating_add(state).max(1);
        let histories = (memory_bytes / 4 * 5).div_ceil(cached).clamp(2, 4_096) as u32;
        let running = history_kv
            .saturating_add(state.saturating_mul(Self::SLOTS_PER_REQUEST))
            .max(1);
        let concurrency = (memory_bytes / 2 / running).clamp(1, 64) as u32;
        let concurrency = concurrency.min(histories - 1);
        StarvationPlan {
            histories,
            follow_ups: (2 * concurrency).min(histories),
            concurrency,
        }
    }

    /// The requests whose finishes send follow-up `k` ([`RequestSpec::after`]): the
    /// history it continues in the first wave (a conversation's next turn never comes
    /// before its last answer, however fast a run decodes), every history for the others,
    /// so that they queue behind the whole first wave in the plan's order whichever
    /// history finishes last.
    pub fn after(&self, k: u32) -> Vec<u32> {
        if k < self.concurrency {
            vec![self.target(k)]
        } else {
            (0..self.histories).collect()
        }
    }

    /// The history follow-up `k` (below [`StarvationPlan::follow_ups`]) continues: the
    /// last `concurrency` histories in order, then the ones before them, newest first.
    pub fn target(&self, k: u32) -> u32 {
        let last_wave = self.histories - self.concurrency;
        if k < self.concurrency {
            last_wave + k
        } else {
            // `follow_ups ≤ histories` keeps this at 0 or above.
            last_wave - 1 - (k - self.concurrency)
        }
    }
}

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 7] = [
        Preset::SharedPrefix,
        Preset::LongOutputs,
        Preset::Random2048x512,
        Preset::Random8192x64,
        Preset::MultiTurn,
        Preset::Smoke,
        Preset::MambaStarvation,
    ];

    /// The four reference presets and `multi-turn`, which `unikv replay` runs for
    /// every model when no `--workload` is given (not `smoke`; see
    /// [`Preset::defaults_for`]).
    pub const DEFAULTS: [Preset; 5] = [
        Preset::SharedPrefix,
        Preset::LongOutputs,
        Preset::Random2048x512,
        Preset::Random8192x64,
        Preset::MultiTurn,
    ];

    /// What `--workload all` (and no `--workload`) runs for `model`: [`Preset::DEFAULTS`],
    /// and `mamba-starvation` after them when the model has recurrent state.
    pub fn defaults_for(model: &ModelSpec) -> Vec<Preset> {
        let mut presets = Preset::DEFAULTS.to_vec();
        if model.has_recurrent_state() {
            presets.push(Preset::MambaStarvation);
        }
        presets
    }

    /// Whether the preset needs a model with recurrent state (`mamba-starvation`).
    pub const fn needs_recurrent_state(self) -> bool {
        matches!(self, Preset::MambaStarvation)
    }

    /// The name `--workload` accepts.
    pub const fn name(self) -> &'static str {
        match self {
            Preset::SharedPrefix => "shared-prefix",
            Preset::LongOutputs => "long-outputs",
            Preset::Random2048x512 => "random-2048-512",
            Preset::Random8192x64 => "random-8192-64",
            Preset::MultiTurn => "multi-turn",
            Preset::Smoke => "smoke",
            Preset::MambaStarvation => "mamba-starvation",
        }
    }

    /// The preset named `name` (case-insensitive).
    pub fn from_name(name: &str) -> Option<Preset> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(name.trim()))
    }

    /// One line for `--help`: the shape and its source.
    pub const fn description(self) -> &'static str {
        match self {
            Preset::SharedPrefix => {
                "192 x (4,096 shared + 128) in / 2,048 out, concurrency 192 (seed PR load test)"
            }
            Preset::LongOutputs => "100 x 512 in / 4,096 out, concurrency 128 (seed PR load test)",
            Preset::Random2048x512 => {
                "200 x 2,048 in / 512 out, concurrency 64 (seed PR bench_serving, random)"
            }
            Preset::Random8192x64 => {
                "100 x 8,192 in / 64 out, concurrency 64 (seed PR bench_serving, random)"
            }
            Preset::MultiTurn => {
                "256 chats (1-5 turns, mean 2.0) x (history + 278) in / 858 out, next turn \
                 when the last finished, 32 clients (LMSYS-Chat-1M x 4)"
            }
            Preset::Smoke => {
                "8 short requests, 5 sharing a 160-token prefix, concurrency 4 (tests)"
            }
            Preset::MambaStarvation => {
                "4,096-token histories overfill the budget, then follow-ups need state slots \
                 (#34441; sized to the budget)"
            }
        }
    }

    /// The workload, with token ids drawn from `seed` (equal seeds, equal workloads).
    ///
    /// ```
    /// use unikv_workload::Preset;
    /// let w = Preset::SharedPrefix.build(1);
    /// assert_eq!((w.requests.len(), w.concurrency), (192, 192));
    /// assert_eq!(w.requests[0].prompt[..4096], w.requests[191].prompt[..4096]);
    /// assert_eq!(w, Preset::SharedPrefix.build(1));
    /// ```
    ///
    /// `mamba-starvation` is sized by a model and a budget ([`Preset::build_for`]); here
    /// it is built for qwen3-next-80b-a3b in the default 16 GiB.
    pub fn build(self, seed: u64) -> Workload {
        self.build_for(seed, &ModelSpec::QWEN3_NEXT_80B_A3B, 16 << 30)
    }

    /// The workload for a run of `model` in a budget of `memory_bytes`: the same as
    /// [`Preset::build`] for every preset but `mamba-starvation`, which is sized by them
    /// ([`StarvationPlan::new`]).
    pub fn build_for(self, seed: u64, model: &ModelSpec, memory_bytes: u64) -> Workload {
        let mut tokens = TokenSource::new(seed, self.name());
        let mut requests = Vec::new();
        let mut push = |arrival_step: u64, prompt: Vec<u32>, output_len: u32, after| {
            let id = requests.len() as u32;
            requests.push(RequestSpec {
                id,
                arrival_step,
                prompt,
                output_len,
                after,
                output: None,
            });
        };
        let concurrency = match self {
            Preset::SharedPrefix => {
                let system = tokens.segment(4_096);
                for _ in 0..192 {
                    let mut prompt = system.clone();
                    prompt.extend(tokens.segment(128));
                    push(0, prompt, 2_048, Vec::new());
                }
                192
            }
            Preset::LongOutputs => {
                for _ in 0..100 {
                    push(0, tokens.segment(512), 4_096, Vec::new());
                }
                128
            }
            Preset::Random2048x512 | Preset::Random8192x64 => {
                let (count, input, output) = if self == Preset::Random2048x512 {
                    (200, 2_048, 512)
                } else {
                    (100, 8_192, 64)
                };
                for _ in 0..count {
                    let input_len = random_len(tokens.rng(), input, RANDOM_RANGE_RATIO);
                    let output_len = random_len(tokens.rng(), output, RANDOM_RANGE_RATIO);
                    push(0, tokens.segment(input_len), output_len as u32, Vec::new());
                }
                64
            }
            Preset::MultiTurn => return ChatShape::MULTI_TURN.build(self.name(), tokens),
            Preset::Smoke => {
                let prefix = tokens.segment(160);
                let shared = |tokens: &mut TokenSource| {
                    let mut prompt = prefix.clone();
                    prompt.extend(tokens.segment(24));
                    prompt
                };
                // (arrival step, prompt, output length), in arrival order.
                let plan = [
                    (0, shared(&mut tokens), 40),
                    (0, shared(&mut tokens), 40),
                    (1, tokens.segment(200), 96),
                    (2, shared(&mut tokens), 160),
                    (3, tokens.segment(300), 8),
                    (4, shared(&mut tokens), 40),
                    (6, tokens.segment(96), 32),
                    (8, shared(&mut tokens), 64),
                ];
                for (arrival, prompt, output) in plan {
                    push(arrival, prompt, output, Vec::new());
                }
                4
            }
            Preset::MambaStarvation => {
                let plan = StarvationPlan::new(model, memory_bytes);
                let histories: Vec<Vec<u32>> = (0..plan.histories)
                    .map(|_| tokens.segment(StarvationPlan::HISTORY_PROMPT))
                    .collect();
                for history in &histories {
                    push(
                        0,
                        history.clone(),
                        StarvationPlan::HISTORY_OUTPUT,
                        Vec::new(),
                    );
                }
                for k in 0..plan.follow_ups {
                    let target = plan.target(k);
                    let mut prompt = histories[target as usize].clone();
                    prompt.extend(tokens.segment(StarvationPlan::QUESTION));
                    push(0, prompt, StarvationPlan::FOLLOW_UP_OUTPUT, plan.after(k));
                }
                plan.concurrency
            }
        };
        Workload {
            name: self.name().to_string(),
            concurrency,
            requests,
        }
    }
}

/// Clients of `multi-turn`: at most this many of its requests are in the system at
/// once (each client waits for its answer before it sends again).
pub const CHAT_CLIENTS: u32 = 32;

/// The turn counts of the conversations each `multi-turn` client holds, in the order of a
/// geometric distribution of mean 2 (LMSYS-Chat-1M's 2.0 turns per conversation; the
/// paper publishes the mean only): half the conversations end after one turn, a quarter
/// after two, an eighth after three, and the tail of four or more turns, an eighth, is at
/// its own mean, five. Mean exactly 2.0; 16 turns per client.
pub const CHAT_TURNS: [u32; 8] = [1, 1, 1, 1, 2, 2, 3, 5];

/// How much longer `multi-turn`'s prompts and responses are than LMSYS-Chat-1M's means:
/// at × 1 a turn (69.5 + 214.5 tokens) is about one 256-token page, so at page size 256
/// a history rounds down to a page or none and the preset would measure rounding, not
/// reuse; × 4 puts about four and a half pages in each turn and keeps the dataset's
/// prompt : response ratio (1 : 3.1).
pub const CHAT_LENGTH_SCALE: u64 = 4;

/// New tokens of each `multi-turn` user prompt: LMSYS-Chat-1M's mean of 69.5 tokens ×
/// [`CHAT_LENGTH_SCALE`].
pub const CHAT_USER_TOKENS: u64 = 278;

/// Output tokens of each `multi-turn` turn: LMSYS-Chat-1M's mean response of 214.5 tokens
/// × [`CHAT_LENGTH_SCALE`].
pub const CHAT_OUTPUT_TOKENS: u32 = 858;

// The lengths are the dataset's means (69.5, 214.5 tokens) times the scale.
const _: () = assert!(CHAT_USER_TOKENS * 2 == 139 * CHAT_LENGTH_SCALE);
const _: () = assert!(CHAT_OUTPUT_TOKENS as u64 * 2 == 429 * CHAT_LENGTH_SCALE);

/// The shape of a chat workload: `multi-turn`'s is [`ChatShape::MULTI_TURN`]; tests build
/// smaller ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatShape {
    /// Closed-loop clients (the workload's concurrency).
    pub clients: u32,
    /// The turn counts of the conversations every client holds, one after another (each
    /// client in its own seeded order).
    pub turns: &'static [u32],
    /// New tokens of each user prompt.
    pub user_tokens: u64,
    /// Output tokens of each turn.
    pub output_tokens: u32,
}

impl ChatShape {
    /// `multi-turn`'s shape (see [`Preset::MultiTurn`]).
    pub const MULTI_TURN: ChatShape = ChatShape {
        clients: CHAT_CLIENTS,
        turns: &CHAT_TURNS,
        user_tokens: CHAT_USER_TOKENS,
        output_tokens: CHAT_OUTPUT_TOKENS,
    };

    /// Requests each client sends: the sum of the turn counts.
    pub fn turns_per_client(&self) -> u32 {
        self.turns.iter().sum()
    }

    /// The workload `name` of this shape, its tokens drawn from `tokens`. Requests are
    /// numbered turn position first: the `n`-th turn a client sends is request
    /// `n × clients + client`, and each but a client's first waits for the one before it
    /// ([`RequestSpec::after`]). A conversation's turn `t + 1` has for prompt turn `t`'s
    /// prompt, its whole output and `user_tokens` new tokens (the first turn: those
    /// alone). Every output is fixed ([`RequestSpec::output`]), so the next turn's prompt
    /// holds exactly what the scheduler generated.
    pub fn build(&self, name: &str, mut tokens: TokenSource) -> Workload {
        let clients = self.clients as usize;
        // Each client's turns in the order it sends them: (prompt, output).
        let mut chains: Vec<Vec<(Vec<u32>, Vec<u32>)>> = Vec::with_capacity(clients);
        for _ in 0..clients {
            let mut turns = self.turns.to_vec();
            // Fisher-Yates with the workload's generator: each client its own order.
            for i in (1..turns.len()).rev() {
                let j = tokens.rng().below(i as u64 + 1) as usize;
                turns.swap(i, j);
            }
            let mut chain = Vec::new();
            for conversation_turns in turns {
                let mut history = Vec::new();
                for _ in 0..conversation_turns {
                    let mut prompt = history;
                    prompt.extend(tokens.segment(self.user_tokens));
                    let output = tokens.uniform(u64::from(self.output_tokens));
                    history = prompt.clone();
                    history.extend_from_slice(&output);
                    chain.push((prompt, output));
                }
            }
            chains.push(chain);
        }
        let per_client = self.turns_per_client() as usize;
        let mut requests = Vec::with_capacity(clients * per_client);
        for n in 0..per_client {
            for chain in &mut chains {
                let (prompt, output) = std::mem::take(&mut chain[n]);
                let id = requests.len() as u32;
                requests.push(RequestSpec {
                    id,
                    arrival_step: 0,
                    prompt,
                    output_len: self.output_tokens,
                    after: id.checked_sub(self.clients).into_iter().collect(),
                    output: Some(output),
                });
            }
        }
        Workload {
            name: name.to_string(),
            concurrency: self.clients,
            requests,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    fn common_prefix(a: &[u32], b: &[u32]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn the_same_seed_gives_the_same_workload_and_another_seed_another() {
        for preset in Preset::ALL {
            let a = preset.build(7);
            assert_eq!(a, preset.build(7), "{}", preset.name());
            assert_ne!(a, preset.build(8), "{}", preset.name());
            a.validate().unwrap();
        }
    }

    #[test]
    fn shared_prefix_requests_share_exactly_their_first_4096_tokens() {
        let w = Preset::SharedPrefix.build(1);
        assert_eq!(w.requests.len(), 192);
        assert_eq!(w.concurrency, 192);
        let first = &w.requests[0].prompt;
        for r in &w.requests {
            assert_eq!(r.prompt.len(), 4_096 + 128);
            assert_eq!(r.output_len, 2_048);
            assert_eq!(r.arrival_step, 0);
            assert_eq!(r.prompt[..4_096], first[..4_096]);
        }
        for pair in w.requests.windows(2) {
            assert_eq!(common_prefix(&pair[0].prompt, &pair[1].prompt), 4_096);
        }
    }

    #[test]
    fn random_prompts_share_no_token_prefix() {
        for preset in [
            Preset::LongOutputs,
            Preset::Random2048x512,
            Preset::Random8192x64,
        ] {
            let w = preset.build(3);
            let mut leads: Vec<u32> = w.requests.iter().map(|r| r.prompt[0]).collect();
            leads.sort_unstable();
            leads.dedup();
            assert_eq!(leads.len(), w.requests.len(), "{}", preset.name());
        }
    }

    #[test]
    fn presets_have_their_documented_shapes() {
        let check = |preset: Preset, count: usize, prompt: usize, output: u32, conc: u32| {
            let w = preset.build(0);
            assert_eq!(w.name, preset.name());
            assert_eq!(w.requests.len(), count, "{}", preset.name());
            assert_eq!(w.concurrency, conc, "{}", preset.name());
            for r in &w.requests {
                assert_eq!(r.prompt.len(), prompt, "{}", preset.name());
                assert_eq!(r.output_len, output, "{}", preset.name());
                assert!(r.prompt.iter().all(|&t| t < VOCAB_SIZE));
            }
        };
        check(Preset::SharedPrefix, 192, 4_224, 2_048, 192);
        check(Preset::LongOutputs, 100, 512, 4_096, 128);
        check(Preset::Random2048x512, 200, 2_048, 512, 64);
        check(Preset::Random8192x64, 100, 8_192, 64, 64);
    }

    /// `multi-turn` as its documentation says: 32 clients, each with the eight
    /// conversations of `CHAT_TURNS` (mean 2.0 turns), 278 new tokens a turn, 858 fixed
    /// output tokens, each client's turns chained by `after`.
    #[test]
    fn multi_turn_has_its_documented_shape() {
        let w = Preset::MultiTurn.build(0);
        w.validate().unwrap();
        assert_eq!(w.name, "multi-turn");
        assert_eq!((w.requests.len(), w.concurrency), (512, 32));
        // A mean of 2.0 turns per conversation.
        assert_eq!(CHAT_TURNS.iter().sum::<u32>(), 2 * CHAT_TURNS.len() as u32);
        let mut first_turns = 0;
        let mut turns_by_client = vec![Vec::new(); 32];
        for r in &w.requests {
            assert_eq!(r.arrival_step, 0);
            assert_eq!(r.output_len, 858);
            assert_eq!(r.output.as_ref().map(Vec::len), Some(858));
            let after: Vec<u32> = r.id.checked_sub(32).into_iter().collect();
            assert_eq!(r.after, after, "request {}", r.id);
            assert!(
                r.prompt
                    .iter()
                    .chain(r.output.iter().flatten())
                    .all(|&t| t < VOCAB_SIZE)
            );
            // A turn's prompt is 278 new tokens after whole earlier turns of 1,136.
            let earlier = r.prompt.len() - 278;
            assert_eq!(earlier % (278 + 858), 0, "request {}", r.id);
            let turn = earlier / (278 + 858) + 1;
            if turn == 1 {
                first_turns += 1;
                turns_by_client[r.id as usize % 32].push(0);
            }
            *turns_by_client[r.id as usize % 32].last_mut().unwrap() += 1;
        }
        assert_eq!(first_turns, 256, "256 conversations");
        for (client, turns) in turns_by_client.iter_mut().enumerate() {
            turns.sort_unstable();
            assert_eq!(turns[..], [1, 1, 1, 1, 2, 2, 3, 5], "client {client}");
        }
        // Clients send their conversations in different orders.
        let order = |c: usize| -> Vec<usize> {
            (0..16)
                .map(|n| w.requests[n * 32 + c].prompt.len())
                .collect()
        };
        assert!((1..32).any(|c| order(c) != order(0)));
    }

    /// Turn `t + 1` of a conversation is turn `t`'s prompt, all of turn `t`'s output and
    /// fresh text; a new conversation shares no prefix with anything before it.
    #[test]
    fn a_next_turn_starts_with_the_last_turns_prompt_and_output() {
        for tenants in [1, 3] {
            let w = Preset::MultiTurn.build(2).tenants(tenants);
            w.validate().unwrap();
            let mut leads = Vec::new();
            let mut follow_ups = 0;
            for r in &w.requests {
                let &[after] = &r.after[..] else {
                    assert!(r.after.is_empty(), "request {}: one turn before it", r.id);
                    leads.push(r.prompt[0]);
                    continue;
                };
                let previous = &w.requests[after as usize];
                // The same client (and tenant): `clients × tenants` requests apart.
                assert_eq!(r.id - after, 32 * tenants);
                let history = [&previous.prompt[..], previous.output.as_ref().unwrap()].concat();
                if r.prompt.len() == 278 {
                    leads.push(r.prompt[0]);
                    assert_eq!(common_prefix(&r.prompt, &history), 0);
                } else {
                    follow_ups += 1;
                    assert_eq!(r.prompt.len(), history.len() + 278);
                    assert_eq!(r.prompt[..history.len()], history[..]);
                    assert_ne!(r.prompt[history.len()], history[0]);
                }
            }
            assert_eq!(follow_ups, 256 * tenants as usize);
            let conversations = leads.len();
            leads.sort_unstable();
            leads.dedup();
            assert_eq!(
                leads.len(),
                conversations,
                "no two conversations share a prefix"
            );
            assert_eq!(conversations, 256 * tenants as usize);
        }
    }

    #[test]
    fn names_round_trip_and_defaults_leave_out_smoke_and_mamba_starvation() {
        for preset in Preset::ALL {
            assert_eq!(Preset::from_name(preset.name()), Some(preset));
        }
        assert_eq!(
            Preset::from_name("Shared-Prefix"),
            Some(Preset::SharedPrefix)
        );
        assert_eq!(Preset::from_name("nope"), None);
        assert!(!Preset::DEFAULTS.contains(&Preset::Smoke));
        assert!(!Preset::DEFAULTS.contains(&Preset::MambaStarvation));
    }

    #[test]
    fn mamba_starvation_overfills_the_budget_and_follows_up_finished_histories() {
        // Histories arrive at once; no follow-up arrives before the history it continues.
        for model in [ModelSpec::QWEN3_NEXT_80B_A3B, ModelSpec::NEMOTRON_H_8B] {
            for memory in [768u64 << 20, 2 << 30, 16 << 30, 80 << 30] {
                let plan = StarvationPlan::new(&model, memory);
                let w = Preset::MambaStarvation.build_for(5, &model, memory);
                w.validate().unwrap();
                let label = format!("{} at {memory}", model.name);
                let (h, f, c) = (plan.histories, plan.follow_ups, plan.concurrency);
                assert_eq!(w.requests.len() as u32, h + f, "{label}");
                assert_eq!(w.concurrency, c, "{label}");
                assert!(c >= 1 && c < h && f >= 1 && f <= h, "{label}: {plan:?}");
                // The histories' KV and cached states overfill the budget.
                let history_tokens =
                    StarvationPlan::HISTORY_PROMPT + u64::from(StarvationPlan::HISTORY_OUTPUT);
                let cached =
                    history_tokens * model.full_bytes_per_token() + model.state_bytes_per_request();
                assert!(u64::from(h) * cached >= memory / 4 * 5, "{label}");
                // The running set fits in half the budget (at concurrency > 1).
                let running = history_tokens * model.full_bytes_per_token()
                    + 3 * model.state_bytes_per_request();
                assert!(c == 1 || u64::from(c) * running <= memory / 2, "{label}");
                let (histories, follow_ups) = w.requests.split_at(h as usize);
                assert!(
                    histories.iter().all(|r| r.prompt.len() == 4_096
                        && r.output_len == StarvationPlan::HISTORY_OUTPUT)
                );
                let mut targets = Vec::new();
                for (k, r) in follow_ups.iter().enumerate() {
                    let target = plan.target(k as u32);
                    // A follow-up is its history and a fresh question.
                    assert_eq!(r.prompt.len(), 4_096 + 256);
                    assert_eq!(r.prompt[..4_096], histories[target as usize].prompt[..]);
                    assert_eq!(common_prefix(&r.prompt[4_096..], &histories[0].prompt), 0);
                    // A first-wave turn is sent once its history finished, the others once
                    // every history did.
                    let after: Vec<u32> = if (k as u32) < c {
                        vec![target]
                    } else {
                        (0..h).collect()
                    };
                    assert_eq!(r.after, after, "{label}: follow-up {k}");
                    targets.push(target);
                }
                // The last wave in order, then the ones before it, newest first; each
                // history at most once.
                let last_wave: Vec<u32> = (h - c..h).collect();
                assert_eq!(targets[..c as usize], last_wave[..], "{label}");
                assert!(targets[c as usize..].windows(2).all(|p| p[0] == p[1] + 1));
                targets.sort_unstable();
                targets.dedup();
                assert_eq!(targets.len() as u32, f, "{label}");
            }
        }
        // 16 GiB of qwen3-next: 121 histories, 25 at once, 50 follow-ups.
        let plan = StarvationPlan::new(&ModelSpec::QWEN3_NEXT_80B_A3B, 16 << 30);
        assert_eq!(
            (plan.histories, plan.concurrency, plan.follow_ups),
            (121, 25, 50)
        );
        // `build` is the qwen3-next, 16 GiB plan.
        assert_eq!(
            Preset::MambaStarvation.build(2),
            Preset::MambaStarvation.build_for(2, &ModelSpec::QWEN3_NEXT_80B_A3B, 16 << 30)
        );
    }

    #[test]
    fn every_preset_but_mamba_starvation_ignores_the_model_and_budget() {
        for preset in Preset::ALL {
            let sized = preset.build_for(4, &ModelSpec::NEMOTRON_H_8B, 1 << 30);
            assert_eq!(
                sized == preset.build(4),
                !preset.needs_recurrent_state(),
                "{}",
                preset.name()
            );
        }
        assert_eq!(
            Preset::defaults_for(&ModelSpec::GPT_OSS_20B),
            Preset::DEFAULTS
        );
        assert_eq!(
            Preset::defaults_for(&ModelSpec::SYNTHETIC_TRI).last(),
            Some(&Preset::MambaStarvation)
        );
    }

    #[test]
    fn random_len_follows_bench_serving() {
        let mut rng = SplitMix64::new(5);
        assert_eq!(random_len(&mut rng, 2_048, 1.0), 2_048);
        for _ in 0..200 {
            let len = random_len(&mut rng, 100, 0.5);
            assert!((50..=100).contains(&len));
            let len = random_len(&mut rng, 100, 0.0);
            assert!((1..=100).contains(&len));
        }
        assert_eq!(random_len(&mut rng, 0, 1.0), 1);
    }

    #[test]
    fn validate_names_what_is_wrong() {
        let mut w = Preset::Smoke.build(0);
        w.requests[3].output_len = 0;
        let err = w.validate().unwrap_err().to_string();
        assert!(err.contains("smoke") && err.contains("request 3"), "{err}");
        let mut w = Preset::Smoke.build(0);
        w.requests.swap(1, 2);
        assert!(w.validate().is_err());
        let mut w = Preset::MultiTurn.build(0);
        w.requests[40].after = vec![40];
        let err = w.validate().unwrap_err().to_string();
        assert!(err.contains("request 40 waits for request 40"), "{err}");
        let mut w = Preset::MultiTurn.build(0);
        w.requests[40].after = vec![8, 3];
        let err = w.validate().unwrap_err().to_string();
        assert!(
            err.contains("request 40 waits for requests [8, 3]"),
            "{err}"
        );
        let mut w = Preset::MultiTurn.build(0);
        w.requests[7].output.as_mut().unwrap().pop();
        let err = w.validate().unwrap_err().to_string();
        assert!(err.contains("request 7 fixes 857 output tokens"), "{err}");
        let w = Workload {
            name: "empty".into(),
            concurrency: 1,
            requests: vec![],
        };
        assert!(
            w.validate()
                .unwrap_err()
                .to_string()
                .contains("no requests")
        );
    }

    #[test]
    fn the_smoke_workload_is_stable() {
        let w = Preset::Smoke.build(1);
        let prefix = &w.requests[0].prompt;
        let mut dump = format!("{} concurrency {}\n", w.name, w.concurrency);
        for r in &w.requests {
            let _ = writeln!(
                dump,
                "id {} arrives {} prompt {:>3} (shares {:>3} with id 0) output {:>3} head {:?}",
                r.id,
                r.arrival_step,
                r.prompt.len(),
                common_prefix(prefix, &r.prompt),
                r.output_len,
                &r.prompt[..4]
            );
        }
        insta::assert_snapshot!(dump);
    }
}

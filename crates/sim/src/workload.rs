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
//!   `--max-concurrency`.
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
//! | `smoke` | 8 | 96–300 | 8–160 | 4 | none: a small mix for fast tests |

use crate::error::SimError;
use crate::rng::SplitMix64;

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
    /// concurrency, ids equal to positions, arrivals in order, non-empty prompts and
    /// positive output lengths.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |reason: String| SimError::BadWorkload {
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
        }
        Ok(())
    }
}

/// Draws token ids for one workload: lead tokens that never repeat (see the module
/// documentation) and uniform tokens after them.
#[derive(Debug)]
pub(crate) struct TokenSource {
    rng: SplitMix64,
    lead_offset: u64,
    leads_used: u64,
}

impl TokenSource {
    /// A source for the workload `name` under `seed`.
    pub(crate) fn new(seed: u64, name: &str) -> TokenSource {
        let mut rng = SplitMix64::for_stream(seed, name);
        let lead_offset = rng.below(u64::from(VOCAB_SIZE));
        TokenSource {
            rng,
            lead_offset,
            leads_used: 0,
        }
    }

    /// The random number generator behind the tokens (for lengths).
    pub(crate) fn rng(&mut self) -> &mut SplitMix64 {
        &mut self.rng
    }

    /// A fresh segment of `len` tokens: a lead token no earlier segment started with,
    /// then uniform tokens.
    pub(crate) fn segment(&mut self, len: u64) -> Vec<u32> {
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
    /// Eight requests with short lengths: five share a 160-token prefix (longer than
    /// gpt-oss's 128-token window), three are random; staggered arrivals, concurrency 4,
    /// outputs from 8 to 160 tokens. For fast tests and the report snapshot.
    Smoke,
}

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 5] = [
        Preset::SharedPrefix,
        Preset::LongOutputs,
        Preset::Random2048x512,
        Preset::Random8192x64,
        Preset::Smoke,
    ];

    /// The presets `unikv replay` runs when no `--workload` is given (not `smoke`).
    pub const DEFAULTS: [Preset; 4] = [
        Preset::SharedPrefix,
        Preset::LongOutputs,
        Preset::Random2048x512,
        Preset::Random8192x64,
    ];

    /// The name `--workload` accepts.
    pub const fn name(self) -> &'static str {
        match self {
            Preset::SharedPrefix => "shared-prefix",
            Preset::LongOutputs => "long-outputs",
            Preset::Random2048x512 => "random-2048-512",
            Preset::Random8192x64 => "random-8192-64",
            Preset::Smoke => "smoke",
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
            Preset::Smoke => {
                "8 short requests, 5 sharing a 160-token prefix, concurrency 4 (tests)"
            }
        }
    }

    /// The workload, with token ids drawn from `seed` (equal seeds, equal workloads).
    ///
    /// ```
    /// use unikv_sim::Preset;
    /// let w = Preset::SharedPrefix.build(1);
    /// assert_eq!((w.requests.len(), w.concurrency), (192, 192));
    /// assert_eq!(w.requests[0].prompt[..4096], w.requests[191].prompt[..4096]);
    /// assert_eq!(w, Preset::SharedPrefix.build(1));
    /// ```
    pub fn build(self, seed: u64) -> Workload {
        let mut tokens = TokenSource::new(seed, self.name());
        let mut requests = Vec::new();
        let mut push = |arrival_step: u64, prompt: Vec<u32>, output_len: u32| {
            let id = requests.len() as u32;
            requests.push(RequestSpec {
                id,
                arrival_step,
                prompt,
                output_len,
            });
        };
        let concurrency = match self {
            Preset::SharedPrefix => {
                let system = tokens.segment(4_096);
                for _ in 0..192 {
                    let mut prompt = system.clone();
                    prompt.extend(tokens.segment(128));
                    push(0, prompt, 2_048);
                }
                192
            }
            Preset::LongOutputs => {
                for _ in 0..100 {
                    push(0, tokens.segment(512), 4_096);
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
                    push(0, tokens.segment(input_len), output_len as u32);
                }
                64
            }
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
                    push(arrival, prompt, output);
                }
                4
            }
        };
        Workload {
            name: self.name().to_string(),
            concurrency,
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

    #[test]
    fn names_round_trip_and_defaults_leave_out_smoke() {
        for preset in Preset::ALL {
            assert_eq!(Preset::from_name(preset.name()), Some(preset));
        }
        assert_eq!(
            Preset::from_name("Shared-Prefix"),
            Some(Preset::SharedPrefix)
        );
        assert_eq!(Preset::from_name("nope"), None);
        assert!(!Preset::DEFAULTS.contains(&Preset::Smoke));
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

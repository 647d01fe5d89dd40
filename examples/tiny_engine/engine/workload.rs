//! What the engine serves: the jobs of a [`Workload`] (the randomized mixed one, the
//! scripted shared-prefix batch and multi-turn conversation) and their arrivals.

use super::model::{Rng, VOCAB};
use std::collections::VecDeque;
use unikv::TokenId;

/// One request of the workload.
#[derive(Clone, Debug)]
pub struct Job {
    /// Prompt tokens (a follow-up turn's are set when it arrives).
    pub prompt: Vec<TokenId>,
    /// Tokens to generate.
    pub max_new: usize,
    /// When it enters the queue.
    pub arrival: Arrival,
    /// What it generated (all of it, or up to its abort).
    pub output: Output,
    /// Whether it was aborted (a follow-up of an aborted turn never arrives and counts as
    /// aborted, with nothing generated).
    pub aborted: bool,
    /// Tokens reused from the prefix cache at its last admission (for a recurrent model,
    /// where the state it resumed from ends).
    pub reused: usize,
}

impl Job {
    /// A job not yet run.
    pub(super) fn new(prompt: Vec<TokenId>, max_new: usize, arrival: Arrival) -> Job {
        Job {
            prompt,
            max_new,
            arrival,
            output: Output::default(),
            aborted: false,
            reused: 0,
        }
    }

    /// Whether it generated all its tokens.
    pub fn finished(&self) -> bool {
        !self.aborted && self.output.tokens.len() == self.max_new
    }
}

/// What a request produced: its generated tokens and the logits that chose the last one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Output {
    /// Generated tokens.
    pub tokens: Vec<TokenId>,
    /// The logits of the last step (empty before the first token).
    pub logits: Vec<f32>,
}

/// The checkpoint grid the engine asks for at page size `ps`: two pages, at least 16
/// tokens, at most 256 tokens and at least a page. At page sizes 1 and 16 a grid point
/// is not on every page, so a prompt's last whole page and its branching point are
/// states of their own; at 256 the grid is the page, which keeps the prompts (and the
/// debug-build test) short.
pub fn checkpoint_grid(ps: u32) -> u32 {
    (2 * ps).clamp(16, 256).max(ps)
}

/// When a job enters the admission queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// At the start of the run.
    Start,
    /// Once job `of` has generated `tokens` tokens: it arrives while `of` still decodes
    /// when `tokens` is below `of`'s `max_new`.
    Decoded {
        /// The job it waits for.
        of: usize,
        /// Tokens that job has generated.
        tokens: usize,
    },
    /// Once job `of` finished: the next turn of its conversation, whose prompt is `of`'s
    /// prompt, then its output, then `text`.
    FollowUp {
        /// The previous turn.
        of: usize,
        /// The new user text.
        text: Vec<TokenId>,
    },
}

/// What the engine serves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Workload {
    /// Randomized: a few system prompts with a unique question each, follow-up turns
    /// drawn at random, aborts, and a budget small enough for eviction, compaction and
    /// retraction.
    Mixed {
        /// Requests arriving (follow-up turns come on top).
        requests: usize,
        /// Most tokens a request generates.
        max_new: usize,
        /// The chance per step that a running request is aborted.
        abort_chance: f64,
    },
    /// Five requests sharing a prefix of one and a half checkpoint grids (plus a few
    /// tokens, so it ends off every page and grid point), then diverging: two arrive
    /// together (neither hits), the others while an earlier one still decodes; the fourth
    /// extends the third's prompt, so it resumes from a state the third saved.
    SharedPrefix,
    /// Two conversations of three turns sharing a system prompt: each next turn's prompt
    /// is the previous turn's prompt, its output and new text; the second conversation
    /// starts while the first one's first turn decodes.
    MultiTurn,
    /// Two conversations of two turns whose first turn's prompt ends half its output
    /// before a checkpoint grid point, so its decode crosses one: the second turn
    /// resumes from a state the first turn's decode saved (with speculation, a
    /// settlement's), at every page size.
    TurnsAcrossGrid,
}

impl Workload {
    /// A short label for tables.
    pub const fn as_str(&self) -> &'static str {
        match self {
            Workload::Mixed { .. } => "mixed",
            Workload::SharedPrefix => "shared-prefix",
            Workload::MultiTurn => "multi-turn",
            Workload::TurnsAcrossGrid => "turns-x-grid",
        }
    }
}

/// `n` random tokens.
pub(super) fn random_tokens(rng: &mut Rng, n: usize) -> Vec<TokenId> {
    (0..n).map(|_| TokenId(rng.below(VOCAB) as u32)).collect()
}

/// The jobs of `kind` served at page size `page_size`.
pub(super) fn workload(kind: Workload, page_size: u32, rng: &mut Rng) -> Vec<Job> {
    let grid = checkpoint_grid(page_size) as usize;
    match kind {
        Workload::Mixed {
            requests, max_new, ..
        } => mixed(page_size, requests, max_new, rng),
        Workload::SharedPrefix => shared_prefix(grid, rng),
        Workload::MultiTurn => multi_turn(grid, rng),
        Workload::TurnsAcrossGrid => turns_across_grid(grid, rng),
    }
}

/// The tokens a scripted job generates: half a grid interval, at most 16.
fn scripted_max_new(grid: usize) -> usize {
    (grid / 2).min(16)
}

/// [`Workload::SharedPrefix`] for checkpoint grid `grid`.
fn shared_prefix(grid: usize, rng: &mut Rng) -> Vec<Job> {
    let shared = random_tokens(rng, grid + grid / 2 + 3);
    let max_new = scripted_max_new(grid);
    let own = |rng: &mut Rng| {
        let n = rng.range(grid / 4, grid / 2);
        random_tokens(rng, n)
    };
    let branch = [shared.clone(), own(rng)].concat();
    vec![
        Job::new([&shared[..], &own(rng)].concat(), max_new, Arrival::Start),
        Job::new([&shared[..], &own(rng)].concat(), max_new, Arrival::Start),
        Job::new(
            branch.clone(),
            max_new,
            Arrival::Decoded { of: 0, tokens: 1 },
        ),
        Job::new(
            [branch, own(rng)].concat(),
            max_new,
            Arrival::Decoded { of: 2, tokens: 1 },
        ),
        Job::new(
            [&shared[..], &own(rng)].concat(),
            max_new,
            Arrival::Decoded {
                of: 0,
                tokens: max_new / 2,
            },
        ),
    ]
}

/// [`Workload::MultiTurn`] for checkpoint grid `grid`: job `2t + c` is turn `t` of
/// conversation `c`.
fn multi_turn(grid: usize, rng: &mut Rng) -> Vec<Job> {
    conversations(grid, grid + 5, 3, rng, |_, _, rng| {
        rng.range(grid / 4, grid / 2)
    })
}

/// [`Workload::TurnsAcrossGrid`] for checkpoint grid `grid`: two turns of two
/// conversations (job `2t + c` is turn `t` of conversation `c`) after a quarter grid of
/// shared system prompt; the first turn's prompt ends half its output before the first
/// grid point past a quarter grid of own text, the second turn's text is a quarter grid.
/// (Short, so that the debug-build test runs in seconds at page size 256, where a grid
/// point is 256 tokens away.)
fn turns_across_grid(grid: usize, rng: &mut Rng) -> Vec<Job> {
    let half_out = scripted_max_new(grid) / 2;
    conversations(grid, grid / 4, 2, rng, |turn, before, _| match turn {
        0 => (before + grid / 4 + half_out).next_multiple_of(grid) - half_out - before,
        _ => grid / 4,
    })
}

/// Two conversations of `turns` turns on a shared system prompt of `system` tokens (job
/// `2t + c` is turn `t` of conversation `c`; the second starts while the first one's
/// first turn decodes), each turn's own text `text_len(turn, tokens before it, rng)` tokens.
fn conversations(
    grid: usize,
    system: usize,
    turns: usize,
    rng: &mut Rng,
    mut text_len: impl FnMut(usize, usize, &mut Rng) -> usize,
) -> Vec<Job> {
    /// Conversations.
    const CONVERSATIONS: usize = 2;
    let system = random_tokens(rng, system);
    let max_new = scripted_max_new(grid);
    let mut jobs: Vec<Job> = Vec::new();
    // Each turn's prompt length (scripted turns are never aborted, so a follow-up's
    // prompt is its previous turn's prompt and `max_new` tokens of output, then its text).
    let mut prompt_lens: Vec<usize> = Vec::new();
    for turn in 0..turns {
        for c in 0..CONVERSATIONS {
            let before = match turn {
                0 => system.len(),
                _ => prompt_lens[(turn - 1) * CONVERSATIONS + c] + max_new,
            };
            let own = text_len(turn, before, rng);
            prompt_lens.push(before + own);
            let text = random_tokens(rng, own);
            let job = if turn == 0 {
                let arrival = if c == 0 {
                    Arrival::Start
                } else {
                    Arrival::Decoded { of: 0, tokens: 1 }
                };
                Job::new([system.clone(), text].concat(), max_new, arrival)
            } else {
                let of = (turn - 1) * CONVERSATIONS + c;
                Job::new(Vec::new(), max_new, Arrival::FollowUp { of, text })
            };
            jobs.push(job);
        }
    }
    jobs
}

/// The randomized workload ([`Workload::Mixed`]): a few system prompts, a unique
/// question each; follow-up turns come while serving. Lengths scale with the page size
/// so that hits (which end on whole pages and, with the recurrent layer, on checkpoints)
/// and window releases happen at every page size.
fn mixed(page_size: u32, requests: usize, max_new: usize, rng: &mut Rng) -> Vec<Job> {
    let unit = (page_size as usize).max(16);
    let systems: Vec<Vec<TokenId>> = (0..3)
        .map(|_| random_tokens(rng, unit + unit / 4))
        .collect();
    (0..requests)
        .map(|_| {
            let mut prompt = systems[rng.below(systems.len())].clone();
            let q = rng.range(1, unit / 2);
            prompt.extend(random_tokens(rng, q));
            Job::new(prompt, rng.range(1, max_new), Arrival::Start)
        })
        .collect()
}

/// Moves every waiting job whose arrival came to the back of the queue, in job order.
/// A follow-up turn gets its prompt here; one of an aborted turn is aborted.
pub(super) fn arrive(jobs: &mut [Job], waiting: &mut Vec<usize>, queue: &mut VecDeque<usize>) {
    waiting.retain(|&j| {
        let arrived = match &jobs[j].arrival {
            Arrival::Start => true,
            Arrival::Decoded { of, tokens } => {
                jobs[*of].output.tokens.len() >= *tokens || jobs[*of].aborted
            }
            Arrival::FollowUp { of, .. } => jobs[*of].finished() || jobs[*of].aborted,
        };
        if !arrived {
            return true;
        }
        if let Arrival::FollowUp { of, text } = &jobs[j].arrival {
            let before = &jobs[*of];
            if before.aborted {
                jobs[j].aborted = true;
                return false;
            }
            let prompt = [&before.prompt[..], &before.output.tokens, text].concat();
            jobs[j].prompt = prompt;
        }
        queue.push_back(j);
        false
    });
}

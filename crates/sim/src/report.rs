//! What a run reports ([`RunStats`], filled by the scheduler) and the replay's renderings
//! of a set of runs ([`Report`]): the side-by-side table, the JSON object, and the
//! pass/fail verdict. (The SVG plots are in [`crate::svg`].)
//!
//! # The table
//! One block per (workload, page size), static and unified in adjacent columns and the
//! ratio unified / static (`—` where static is 0 or a layout is missing), then one
//! verdict line for all runs.
//!
//! Every run shows how much of the prompts the prefix cache served: the hit rate (tokens
//! reused), the KV hit (tokens whose FULL/SWA KV was cached) and the tokens recomputed
//! (the difference). A model with recurrent state adds its Mamba rows (the recurrent hit:
//! tokens resumed from a cached state; peak bytes of the slots, the slots in use at the
//! peak, the most of them held as checkpoints, and the capacity they had; cached states
//! evicted, FULL nodes evicted as donors for slots); the table of any other model has
//! none.
//!
//! # The JSON object (`--json`, schema `unikv.replay.v3`)
//! ```text
//! {
//!   "schema": "unikv.replay.v3",
//!   "model": { "name", "full_layers", "swa_layers", "mamba_layers", "sliding_window",
//!              "full_rows": { "kv_heads", "head_dim", "dtype_bytes" },
//!              "swa_rows": { "kv_heads", "head_dim", "dtype_bytes" },
//!              "full_bytes_per_token", "swa_bytes_per_token",
//!              "state_bytes_per_request" },     0 without recurrent layers
//!   "memory_bytes": u64,            the KV budget of every run
//!   "seed": u64,
//!   "invariant_level": "off" | "warn" | "strict",
//!   "pass": bool,                   every run passed (the exit status is 0)
//!   "runs": [ {
//!     "workload": str, "layout": "static" | "unified", "page_size": u32,
//!     "requests_total": u64, "requests_completed": u64,
//!     "peak_admitted": u64,         most requests holding KV at once
//!     "retractions": u64,           requests sent back to the queue for memory
//!     "prompt_tokens": u64,         prompt tokens matched against the tree, all admissions
//!     "prefix_hit_tokens": u64,     of those, tokens found in the tree and reused (a
//!                                   model with recurrent state: resumed from a state)
//!     "prefix_hit_rate": f64 | null,  hit / prompt tokens (null when no prompt token)
//!     "kv_hit_tokens": u64,         prompt tokens whose FULL/SWA KV the tree held
//!     "recomputed_tokens": u64,     kv_hit_tokens - prefix_hit_tokens: cached KV whose
//!                                   tokens were computed again (no state, or too little
//!                                   live SWA, where the KV hit ended)
//!     "evictions_by_kind": { kind: u64 },      tokens evicted from the tree under memory
//!                                   pressure, by kind: full, and swa for a model with SWA
//!     "peak_bytes_by_subpool": { name: u64 },  largest bytes held by each sub-pool: full,
//!                                   swa (a model with SWA), mamba (one with recurrent state)
//!     "mamba": { "slot_bytes", "slots_total", "peak_slots", "state_evictions",
//!                "donor_nodes", "recurrent_hit_tokens", "peak_checkpoint_slots" } | null,
//!                                   state slots and state reuse (see MambaStats); null
//!                                   for a model without recurrent state
//!     "steps": u64,
//!     "pages_handled": u64,         pages and state slots the allocator bound or released
//!     "host_syncs": u64, "host_syncs_per_step": f64,
//!     "invariant_violations": u64,
//!     "leaked_pages": u64,          pages (and state slots) neither free nor owned at
//!                                   the end
//!     "step_cpu_ns": { "steps_timed", "median", "p99", "max", "total",
//!                      "ns_per_page" } | null,
//!                                   allocator + tree CPU time per step (null with
//!                                   --no-timing or when nothing was timed)
//!     "pass": bool,
//!     "failures": [ str ]           why the run failed, one sentence each
//!   } ]
//! }
//! ```
//! Everything but `step_cpu_ns` is a function of the seed: with `--no-timing` the same
//! seed prints the same bytes.

use crate::error::SimError;
use crate::scheduler::{Layout, RunConfig};
use crate::units::{format_bytes, format_ns};
use crate::workload::Workload;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use unikv::ModelSpec;
use unikv_invariants::Level;

/// The schema name of the JSON object (`--json`).
pub const SCHEMA: &str = "unikv.replay.v3";

/// The bytes each sub-pool held at one step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StepSample {
    /// The step.
    pub step: u64,
    /// Sub-pool name (`full`, `swa`, ...) → bytes held (live pages × page envelope).
    pub bytes_by_subpool: BTreeMap<String, u64>,
}

/// What a run of a model with recurrent (Mamba/GDN) state did with its state slots. Slot
/// bytes held are in [`RunStats::peak_bytes_by_subpool`] under `mamba`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MambaStats {
    /// Bytes of one state slot (every recurrent layer's conv and temporal state).
    pub slot_bytes: u64,
    /// Slots the layout can hold: the static layout's fixed pool, or as many as the whole
    /// unified buffer holds (when it holds nothing else).
    pub slots_total: u64,
    /// The most slots in use (held by requests or cached in the tree) at a step boundary.
    pub peak_slots: u64,
    /// Cached states evicted from the tree under memory pressure (alone, or with their
    /// node).
    pub state_evictions: u64,
    /// Whole FULL nodes evicted to make room for state slots (FULL as the byte donor).
    pub donor_nodes: u64,
    /// Prompt tokens whose recurrent state was reused: each admission resumed from a
    /// cached state after this many tokens and computed only the rest (equal to
    /// [`RunStats::prefix_hit_tokens`], since such a model's match ends only at a state).
    pub recurrent_hit_tokens: u64,
    /// The most slots held as checkpoints at once, at a step boundary: every slot in use
    /// but the live requests' running ones (states cached in the tree, and those a
    /// request saved that the tree has not taken yet).
    pub peak_checkpoint_slots: u64,
}

/// What one run (a workload × a layout × a page size) did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RunStats {
    /// The workload's name.
    pub workload: String,
    /// The layout.
    pub layout: Layout,
    /// Tokens per page.
    pub page_size: u32,
    /// The KV budget in bytes.
    pub memory_bytes: u64,
    /// Requests in the workload.
    pub requests_total: u64,
    /// Requests that produced all their output tokens.
    pub requests_completed: u64,
    /// The most requests holding KV at once.
    pub peak_admitted: u64,
    /// Requests retracted (sent back to the queue, their KV released) for memory.
    pub retractions: u64,
    /// Prompt tokens looked up in the prefix tree, summed over admissions (a re-admitted
    /// request counts again).
    pub prompt_tokens: u64,
    /// Of `prompt_tokens`, those matched in the tree: reused, not computed again (for a
    /// model with recurrent state, resumed from a cached state).
    pub prefix_hit_tokens: u64,
    /// Of `prompt_tokens`, those whose FULL (and SWA) KV the tree held at admission, at
    /// least `prefix_hit_tokens`: the match may end before the KV does (no cached state
    /// there, or too little live SWA behind it).
    pub kv_hit_tokens: u64,
    /// `kv_hit_tokens − prefix_hit_tokens`: tokens whose KV was cached but were computed
    /// again, summed over admissions.
    pub recomputed_tokens: u64,
    /// Tokens evicted from the tree under memory pressure (not the clearing after the
    /// last request), by kind: `full` (whole nodes) and `swa` (tombstoned SWA).
    pub evictions_by_kind: BTreeMap<String, u64>,
    /// The largest number of bytes each sub-pool held at any step boundary.
    pub peak_bytes_by_subpool: BTreeMap<String, u64>,
    /// The state slots of a model with recurrent state (`None` for any other).
    pub mamba: Option<MambaStats>,
    /// Host syncs the cache issued (must be 0).
    pub host_syncs: u64,
    /// Steps run.
    pub steps: u64,
    /// Allocator and tree CPU time of each step, in nanoseconds: the thread's CPU time
    /// (preemption does not count), without the time the CPU backend spends executing
    /// device ops (page moves, the mirror upload), which a GPU would run asynchronously.
    /// The only measured field; may be empty.
    pub step_cpu_ns: Vec<u64>,
    /// Pages (and state slots) the allocator bound or released over the run: what the
    /// steps' host time should be proportional to.
    pub pages_handled: u64,
    /// Invariant violations recorded in the run's cache's invariant scope (must be 0).
    pub invariant_violations: u64,
    /// Pages (and, for a model with recurrent state, state slots) neither free nor owned
    /// by anyone once every request finished and the tree was cleared, plus requests
    /// still live (must be 0).
    pub leaked_pages: u64,
    /// Bytes per sub-pool over the run (see [`SampleRecorder`]).
    pub samples: Vec<StepSample>,
}

impl RunStats {
    /// Empty statistics for running `workload` with `config`: the run's identity filled
    /// in, every count 0.
    pub fn new(workload: &Workload, config: &RunConfig) -> RunStats {
        RunStats {
            workload: workload.name.clone(),
            layout: config.layout,
            page_size: config.page_size,
            memory_bytes: config.memory_bytes,
            requests_total: workload.requests.len() as u64,
            ..RunStats::default()
        }
    }

    /// Prefix hits / prompt tokens looked up, or `None` when none was looked up.
    pub fn prefix_hit_rate(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.prefix_hit_tokens as f64 / self.prompt_tokens as f64)
    }

    /// Host syncs per step (0 when no step ran).
    pub fn host_syncs_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.host_syncs as f64 / self.steps as f64
        }
    }

    /// Median, p99 and max of [`RunStats::step_cpu_ns`], or `None` when it is empty.
    pub fn timing(&self) -> Option<Timing> {
        let mut sorted = self.step_cpu_ns.clone();
        sorted.sort_unstable();
        Some(Timing {
            steps_timed: sorted.len() as u64,
            median: percentile(&sorted, 50.0)?,
            p99: percentile(&sorted, 99.0)?,
            max: *sorted.last()?,
            total: sorted.iter().sum(),
            ns_per_page: sorted.iter().sum::<u64>() / self.pages_handled.max(1),
        })
    }

    /// Why this run fails the replay, if it does.
    pub fn failures(&self) -> Vec<Failure> {
        let mut failures = Vec::new();
        if self.requests_completed < self.requests_total {
            failures.push(Failure::Unfinished {
                completed: self.requests_completed,
                total: self.requests_total,
            });
        }
        if self.host_syncs > 0 {
            failures.push(Failure::HostSyncs {
                syncs: self.host_syncs,
            });
        }
        if self.invariant_violations > 0 {
            failures.push(Failure::InvariantViolations {
                violations: self.invariant_violations,
            });
        }
        if self.leaked_pages > 0 {
            failures.push(Failure::Leaked {
                pages: self.leaked_pages,
            });
        }
        failures
    }

    /// `workload · page size N · layout`, the run's name in reports.
    pub fn label(&self) -> String {
        format!(
            "{} · page size {} · {}",
            self.workload, self.page_size, self.layout
        )
    }
}

/// Why a run fails the replay's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Some requests did not finish.
    Unfinished {
        /// Requests finished.
        completed: u64,
        /// Requests in the workload.
        total: u64,
    },
    /// The cache synchronised with the device.
    HostSyncs {
        /// How many times.
        syncs: u64,
    },
    /// Invariants were violated.
    InvariantViolations {
        /// How many violations.
        violations: u64,
    },
    /// Pages leaked.
    Leaked {
        /// How many pages.
        pages: u64,
    },
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Unfinished { completed, total } => write!(
                f,
                "{} of {total} requests unfinished",
                total.saturating_sub(*completed)
            ),
            Failure::HostSyncs { syncs } => write!(f, "{syncs} host syncs"),
            Failure::InvariantViolations { violations } => {
                write!(f, "{violations} invariant violations")
            }
            Failure::Leaked { pages } => write!(f, "{pages} leaked pages"),
        }
    }
}

/// Summary of the CPU time per step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Timing {
    /// Steps measured.
    pub steps_timed: u64,
    /// Median (nearest rank), in nanoseconds.
    pub median: u64,
    /// 99th percentile (nearest rank), in nanoseconds.
    pub p99: u64,
    /// Slowest step, in nanoseconds.
    pub max: u64,
    /// All steps, in nanoseconds.
    pub total: u64,
    /// `total` per page handled ([`RunStats::pages_handled`]), in nanoseconds.
    pub ns_per_page: u64,
}

/// The `p`-th percentile (0 < p ≤ 100) of ascending `sorted` values by the nearest-rank
/// method: the smallest value with at least `p` % of the values at or below it, i.e.
/// `sorted[⌈p/100 × n⌉ − 1]`. Always one of the values (no interpolation). `None` for
/// no values or a `p` outside (0, 100].
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() || !(p > 0.0 && p <= 100.0) {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Keeps a bounded, evenly spaced subset of per-step samples for the plots: it records
/// every `stride`-th step and, when full, drops every other sample and doubles the
/// stride. A run of any length ends with between `max / 2` and `max` samples (plus the
/// final step, see [`SampleRecorder::finish`]), deterministically.
#[derive(Clone, Debug)]
pub struct SampleRecorder {
    max: usize,
    stride: u64,
    samples: Vec<StepSample>,
}

impl SampleRecorder {
    /// A recorder that keeps at most `max` samples (at least 2).
    pub fn new(max: usize) -> SampleRecorder {
        SampleRecorder {
            max: max.max(2),
            stride: 1,
            samples: Vec::new(),
        }
    }

    /// Whether `step` will be kept; ask before computing an expensive sample.
    pub fn wants(&self, step: u64) -> bool {
        step.is_multiple_of(self.stride)
    }

    /// Offers the bytes held at `step` (steps must increase); `bytes` is called only if
    /// the sample is kept.
    pub fn record(&mut self, step: u64, bytes: impl FnOnce() -> BTreeMap<String, u64>) {
        if !self.wants(step) {
            return;
        }
        self.samples.push(StepSample {
            step,
            bytes_by_subpool: bytes(),
        });
        if self.samples.len() > self.max {
            self.stride *= 2;
            let stride = self.stride;
            self.samples.retain(|s| s.step.is_multiple_of(stride));
        }
    }

    /// The samples, with the last step added if it was not kept (so plots end where the
    /// run ended).
    pub fn finish(
        mut self,
        last_step: u64,
        bytes: impl FnOnce() -> BTreeMap<String, u64>,
    ) -> Vec<StepSample> {
        if self.samples.last().is_none_or(|s| s.step < last_step) {
            self.samples.push(StepSample {
                step: last_step,
                bytes_by_subpool: bytes(),
            });
        }
        self.samples
    }
}

/// A set of runs and what they share: the replay's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The model.
    pub model: ModelSpec,
    /// The KV budget of every run.
    pub memory_bytes: u64,
    /// The seed.
    pub seed: u64,
    /// The invariant level the runs were checked at.
    pub invariant_level: Level,
    /// Whether the renderings include CPU time per step.
    pub timing: bool,
    /// The runs, in the order they ran.
    pub runs: Vec<RunStats>,
}

impl Report {
    /// Whether every run passed (no unfinished request, host sync, violation or leak).
    pub fn pass(&self) -> bool {
        self.runs.iter().all(|r| r.failures().is_empty())
    }

    /// The runs grouped by (workload, page size) in order of first appearance, each
    /// group's runs ordered static then unified.
    pub fn groups(&self) -> Vec<(&str, u32, Vec<&RunStats>)> {
        let mut groups: Vec<(&str, u32, Vec<&RunStats>)> = Vec::new();
        for run in &self.runs {
            match groups
                .iter_mut()
                .find(|(w, ps, _)| *w == run.workload && *ps == run.page_size)
            {
                Some((_, _, runs)) => runs.push(run),
                None => groups.push((&run.workload, run.page_size, vec![run])),
            }
        }
        for (_, _, runs) in &mut groups {
            runs.sort_by_key(|r| r.layout);
        }
        groups
    }

    /// The side-by-side table.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "unikv replay · {} · memory {} · seed {} · invariants {}\nmodel {}",
            self.model.name,
            format_bytes(self.memory_bytes),
            self.seed,
            self.invariant_level,
            self.model
        );
        for (workload, page_size, runs) in self.groups() {
            let _ = writeln!(out, "\n{workload} · page size {page_size}");
            out.push_str(&self.render_group(&runs));
        }
        out.push('\n');
        out.push_str(&self.render_verdict());
        out
    }

    fn render_group(&self, runs: &[&RunStats]) -> String {
        // With both layouts: static, unified, ratio. Otherwise the runs as they are.
        let pair = match runs {
            [s, u] if s.layout == Layout::Static && u.layout == Layout::Unified => Some((*s, *u)),
            _ => None,
        };
        let mut table = Table::new(runs.iter().map(|r| r.layout.as_str()), pair.is_some());
        let count = |v: u64| Cell::Count(v);
        table.row("requests completed", runs, |r| {
            Cell::Text(
                format!(
                    "{}/{}",
                    group_digits(r.requests_completed),
                    group_digits(r.requests_total)
                ),
                Some(r.requests_completed as f64),
            )
        });
        table.row("peak admitted", runs, |r| count(r.peak_admitted));
        table.row("retractions", runs, |r| count(r.retractions));
        table.row("prefix hit rate", runs, |r| match r.prefix_hit_rate() {
            Some(rate) => Cell::Text(format!("{:.1} %", rate * 100.0), Some(rate)),
            None => Cell::Text("—".into(), None),
        });
        let recurrent = runs.iter().any(|r| r.mamba.is_some());
        // A model with recurrent state: a Mamba cell of each run ("—" for a run without).
        let mamba = |field: fn(&MambaStats) -> u64| {
            move |r: &RunStats| match &r.mamba {
                Some(m) => count(field(m)),
                None => Cell::Text("—".into(), None),
            }
        };
        table.row("KV hit tokens", runs, |r| count(r.kv_hit_tokens));
        if recurrent {
            table.row(
                "recurrent hit tokens",
                runs,
                mamba(|m| m.recurrent_hit_tokens),
            );
        }
        table.row("recomputed tokens", runs, |r| count(r.recomputed_tokens));
        for kind in union_keys(runs, |r| &r.evictions_by_kind) {
            table.row(&format!("evictions ({kind})"), runs, |r| {
                count(r.evictions_by_kind.get(&kind).copied().unwrap_or(0))
            });
        }
        if recurrent {
            table.row(
                "evictions (mamba states)",
                runs,
                mamba(|m| m.state_evictions),
            );
            table.row("evictions (donor nodes)", runs, mamba(|m| m.donor_nodes));
        }
        for pool in union_keys(runs, |r| &r.peak_bytes_by_subpool) {
            table.row(&format!("peak bytes ({pool})"), runs, |r| {
                let bytes = r.peak_bytes_by_subpool.get(&pool).copied().unwrap_or(0);
                Cell::Text(format_bytes(bytes), Some(bytes as f64))
            });
        }
        if recurrent {
            table.row("peak state slots", runs, mamba(|m| m.peak_slots));
            table.row(
                "peak checkpoint slots",
                runs,
                mamba(|m| m.peak_checkpoint_slots),
            );
            table.row("state slot capacity", runs, mamba(|m| m.slots_total));
        }
        table.row("steps", runs, |r| count(r.steps));
        table.row("host syncs per step", runs, |r| {
            let per_step = r.host_syncs_per_step();
            let text = if r.host_syncs == 0 {
                "0".to_string()
            } else {
                format!("{per_step:.4}")
            };
            Cell::Text(text, Some(per_step))
        });
        if self.timing {
            table.row("step CPU time, median", runs, |r| match r.timing() {
                Some(t) => Cell::Text(format_ns(t.median), Some(t.median as f64)),
                None => Cell::Text("—".into(), None),
            });
            table.row("step CPU time, p99", runs, |r| match r.timing() {
                Some(t) => Cell::Text(format_ns(t.p99), Some(t.p99 as f64)),
                None => Cell::Text("—".into(), None),
            });
            table.row("step CPU per page", runs, |r| match r.timing() {
                Some(t) => Cell::Text(format_ns(t.ns_per_page), Some(t.ns_per_page as f64)),
                None => Cell::Text("—".into(), None),
            });
        }
        table.row("invariant violations", runs, |r| {
            count(r.invariant_violations)
        });
        table.row("leaked pages", runs, |r| count(r.leaked_pages));
        table.row("verdict", runs, |r| {
            let text = if r.failures().is_empty() {
                "pass"
            } else {
                "FAIL"
            };
            Cell::Label(text)
        });
        table.finish()
    }

    /// The verdict: one line when every run passed, else a line per failing run.
    pub fn render_verdict(&self) -> String {
        let failing: Vec<(String, Vec<Failure>)> = self
            .runs
            .iter()
            .map(|r| (r.label(), r.failures()))
            .filter(|(_, f)| !f.is_empty())
            .collect();
        if failing.is_empty() {
            let runs = match self.runs.len() {
                1 => "1 run".to_string(),
                n => format!("{n} runs"),
            };
            return format!(
                "verdict: PASS ({runs}: every request finished; 0 host syncs, 0 invariant \
                 violations, 0 leaked pages)\n"
            );
        }
        let mut out = format!(
            "verdict: FAIL ({} of {} runs)\n",
            failing.len(),
            self.runs.len()
        );
        for (label, failures) in failing {
            let reasons: Vec<String> = failures.iter().map(Failure::to_string).collect();
            let _ = writeln!(out, "  {label}: {}", reasons.join("; "));
        }
        out
    }

    /// The JSON object documented in the module docs, pretty-printed, with a final newline.
    pub fn to_json(&self) -> Result<String, SimError> {
        let doc = JsonReport {
            schema: SCHEMA,
            model: JsonModel {
                name: self.model.name,
                full_layers: self.model.full_layers,
                swa_layers: self.model.swa_layers,
                mamba_layers: self.model.mamba_layers,
                sliding_window: self.model.window,
                full_rows: JsonRows::from(self.model.full),
                swa_rows: JsonRows::from(self.model.swa),
                full_bytes_per_token: self.model.full_bytes_per_token(),
                swa_bytes_per_token: self.model.swa_bytes_per_token(),
                state_bytes_per_request: self.model.state_bytes_per_request(),
            },
            memory_bytes: self.memory_bytes,
            seed: self.seed,
            invariant_level: self.invariant_level.as_str(),
            pass: self.pass(),
            runs: self
                .runs
                .iter()
                .map(|r| {
                    let failures: Vec<String> =
                        r.failures().iter().map(Failure::to_string).collect();
                    JsonRun {
                        workload: &r.workload,
                        layout: r.layout,
                        page_size: r.page_size,
                        requests_total: r.requests_total,
                        requests_completed: r.requests_completed,
                        peak_admitted: r.peak_admitted,
                        retractions: r.retractions,
                        prompt_tokens: r.prompt_tokens,
                        prefix_hit_tokens: r.prefix_hit_tokens,
                        prefix_hit_rate: r.prefix_hit_rate(),
                        kv_hit_tokens: r.kv_hit_tokens,
                        recomputed_tokens: r.recomputed_tokens,
                        evictions_by_kind: &r.evictions_by_kind,
                        peak_bytes_by_subpool: &r.peak_bytes_by_subpool,
                        mamba: r.mamba,
                        steps: r.steps,
                        pages_handled: r.pages_handled,
                        host_syncs: r.host_syncs,
                        host_syncs_per_step: r.host_syncs_per_step(),
                        invariant_violations: r.invariant_violations,
                        leaked_pages: r.leaked_pages,
                        step_cpu_ns: if self.timing { r.timing() } else { None },
                        pass: failures.is_empty(),
                        failures,
                    }
                })
                .collect(),
        };
        let mut text = serde_json::to_string_pretty(&doc)?;
        text.push('\n');
        Ok(text)
    }
}

#[derive(Serialize)]
struct JsonReport<'a> {
    schema: &'static str,
    model: JsonModel,
    memory_bytes: u64,
    seed: u64,
    invariant_level: &'static str,
    pass: bool,
    runs: Vec<JsonRun<'a>>,
}

#[derive(Serialize)]
struct JsonModel {
    name: &'static str,
    full_layers: u32,
    swa_layers: u32,
    mamba_layers: u32,
    sliding_window: u32,
    full_rows: JsonRows,
    swa_rows: JsonRows,
    full_bytes_per_token: u64,
    swa_bytes_per_token: u64,
    state_bytes_per_request: u64,
}

/// One attention kind's KV rows per layer.
#[derive(Serialize)]
struct JsonRows {
    kv_heads: u32,
    head_dim: u32,
    dtype_bytes: u32,
}

impl From<unikv::KvRows> for JsonRows {
    fn from(rows: unikv::KvRows) -> JsonRows {
        JsonRows {
            kv_heads: rows.kv_heads,
            head_dim: rows.head_dim,
            dtype_bytes: rows.dtype_bytes,
        }
    }
}

#[derive(Serialize)]
struct JsonRun<'a> {
    workload: &'a str,
    layout: Layout,
    page_size: u32,
    requests_total: u64,
    requests_completed: u64,
    peak_admitted: u64,
    retractions: u64,
    prompt_tokens: u64,
    prefix_hit_tokens: u64,
    prefix_hit_rate: Option<f64>,
    kv_hit_tokens: u64,
    recomputed_tokens: u64,
    evictions_by_kind: &'a BTreeMap<String, u64>,
    peak_bytes_by_subpool: &'a BTreeMap<String, u64>,
    mamba: Option<MambaStats>,
    steps: u64,
    pages_handled: u64,
    host_syncs: u64,
    host_syncs_per_step: f64,
    invariant_violations: u64,
    leaked_pages: u64,
    step_cpu_ns: Option<Timing>,
    pass: bool,
    failures: Vec<String>,
}

/// One cell of the table: its text and, for the ratio column, its value.
enum Cell {
    /// A count: grouped digits, compared.
    Count(u64),
    /// Text and the value the ratio compares (`—` in the ratio column without one).
    Text(String, Option<f64>),
    /// Text that is not compared (blank in the ratio column).
    Label(&'static str),
}

impl Cell {
    fn text_and_value(self) -> (String, Option<f64>) {
        match self {
            Cell::Count(v) => (group_digits(v), Some(v as f64)),
            Cell::Text(text, value) => (text, value),
            Cell::Label(text) => (text.to_string(), None),
        }
    }
}

/// A left-aligned label column, right-aligned value columns and an optional ratio.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    ratio: bool,
}

const LABEL_WIDTH: usize = 24;
const COLUMN_WIDTH: usize = 16;

impl Table {
    fn new<'a>(columns: impl Iterator<Item = &'a str>, ratio: bool) -> Table {
        let mut header: Vec<String> = columns.map(str::to_string).collect();
        if ratio {
            header.push("unified/static".into());
        }
        Table {
            header,
            rows: Vec::new(),
            ratio,
        }
    }

    fn row(&mut self, label: &str, runs: &[&RunStats], cell: impl Fn(&RunStats) -> Cell) {
        let mut row = vec![label.to_string()];
        let mut values = Vec::new();
        let mut compared = true;
        for run in runs {
            let cell = cell(run);
            compared &= !matches!(cell, Cell::Label(_));
            let (text, value) = cell.text_and_value();
            row.push(text);
            values.push(value);
        }
        if self.ratio {
            let ratio = match values.as_slice() {
                _ if !compared => String::new(),
                [Some(s), Some(u)] if *s != 0.0 => format!("{:.2}", u / s),
                _ => "—".to_string(),
            };
            row.push(ratio);
        }
        self.rows.push(row);
    }

    fn finish(self) -> String {
        let mut out = String::new();
        let _ = write!(out, "  {:<LABEL_WIDTH$}", "");
        for h in &self.header {
            let _ = write!(out, "{h:>COLUMN_WIDTH$}");
        }
        out.push('\n');
        for row in &self.rows {
            let _ = write!(out, "  {:<LABEL_WIDTH$}", row[0]);
            for cell in &row[1..] {
                // Pad by characters, not bytes ("µs", "—").
                let pad = COLUMN_WIDTH.saturating_sub(cell.chars().count());
                let _ = write!(out, "{:pad$}{cell}", "");
            }
            let trimmed = out.trim_end_matches(' ').len();
            out.truncate(trimmed);
            out.push('\n');
        }
        out
    }
}

/// The keys of a map field across runs, sorted, without duplicates.
fn union_keys<'a>(
    runs: &[&'a RunStats],
    field: impl Fn(&'a RunStats) -> &'a BTreeMap<String, u64>,
) -> Vec<String> {
    let mut keys: Vec<String> = runs.iter().flat_map(|r| field(r).keys().cloned()).collect();
    keys.sort();
    keys.dedup();
    keys
}

/// `1234567` → `1,234,567`.
pub fn group_digits(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A hand-made pair of runs of one group, shaped like a shared-prefix replay at page
    /// size 256 where the static split retracts.
    pub(crate) fn sample_pair() -> Vec<RunStats> {
        let map = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
            pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
        };
        let base = RunStats {
            workload: "shared-prefix".into(),
            page_size: 256,
            memory_bytes: 16 << 30,
            requests_total: 192,
            ..RunStats::default()
        };
        let statik = RunStats {
            layout: Layout::Static,
            requests_completed: 192,
            peak_admitted: 141,
            retractions: 37,
            prompt_tokens: 968_448,
            prefix_hit_tokens: 786_432,
            kv_hit_tokens: 790_528,
            recomputed_tokens: 4_096,
            evictions_by_kind: map(&[("full", 65_536), ("swa", 24_576)]),
            peak_bytes_by_subpool: map(&[("full", 9_543_548_928), ("swa", 1_887_436_800)]),
            steps: 5_980,
            step_cpu_ns: vec![4_000, 5_000, 6_000, 7_000, 90_000],
            samples: vec![
                StepSample {
                    step: 0,
                    bytes_by_subpool: map(&[("full", 0), ("swa", 0)]),
                },
                StepSample {
                    step: 2_990,
                    bytes_by_subpool: map(&[("full", 9_000_000_000), ("swa", 1_800_000_000)]),
                },
                StepSample {
                    step: 5_980,
                    bytes_by_subpool: map(&[("full", 0), ("swa", 0)]),
                },
            ],
            ..base.clone()
        };
        let unified = RunStats {
            layout: Layout::Unified,
            requests_completed: 192,
            peak_admitted: 192,
            retractions: 0,
            prompt_tokens: 811_008,
            prefix_hit_tokens: 786_432,
            kv_hit_tokens: 786_432,
            evictions_by_kind: map(&[("swa", 24_576)]),
            peak_bytes_by_subpool: map(&[("full", 10_368_319_488), ("swa", 1_811_939_328)]),
            steps: 2_180,
            step_cpu_ns: vec![3_000, 3_500, 4_000, 4_500, 50_000],
            samples: vec![
                StepSample {
                    step: 0,
                    bytes_by_subpool: map(&[("full", 0), ("swa", 0)]),
                },
                StepSample {
                    step: 2_180,
                    bytes_by_subpool: map(&[("full", 10_368_319_488), ("swa", 1_811_939_328)]),
                },
            ],
            ..base
        };
        vec![statik, unified]
    }

    pub(crate) fn sample_report() -> Report {
        Report {
            model: ModelSpec::GPT_OSS_20B,
            memory_bytes: 16 << 30,
            seed: 1,
            invariant_level: Level::Strict,
            timing: true,
            runs: sample_pair(),
        }
    }

    /// A hand-made pair of runs of a model with recurrent state (qwen3-next: FULL and
    /// state slots, no SWA), shaped like a `mamba-starvation` replay at page size 1.
    pub(crate) fn sample_mamba_report() -> Report {
        let map = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
            pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
        };
        let slot_bytes = 77_266_944;
        let base = RunStats {
            workload: "mamba-starvation".into(),
            page_size: 1,
            memory_bytes: 16 << 30,
            requests_total: 171,
            requests_completed: 171,
            peak_admitted: 25,
            steps: 219,
            step_cpu_ns: vec![40_000, 60_000, 500_000],
            ..RunStats::default()
        };
        let statik = RunStats {
            layout: Layout::Static,
            prompt_tokens: 713_216,
            prefix_hit_tokens: 114_688,
            kv_hit_tokens: 147_456,
            recomputed_tokens: 32_768,
            evictions_by_kind: map(&[("full", 152_107)]),
            peak_bytes_by_subpool: map(&[("full", 8_987_000_832), ("mamba", 105 * slot_bytes)]),
            mamba: Some(MambaStats {
                slot_bytes,
                slots_total: 105,
                peak_slots: 105,
                state_evictions: 116,
                donor_nodes: 0,
                recurrent_hit_tokens: 114_688,
                peak_checkpoint_slots: 80,
            }),
            ..base.clone()
        };
        let unified = RunStats {
            layout: Layout::Unified,
            prompt_tokens: 713_216,
            prefix_hit_tokens: 204_800,
            kv_hit_tokens: 212_992,
            recomputed_tokens: 8_192,
            evictions_by_kind: map(&[("full", 291_881)]),
            peak_bytes_by_subpool: map(&[("full", 7_473_233_920), ("mamba", 150 * slot_bytes)]),
            mamba: Some(MambaStats {
                slot_bytes,
                slots_total: 221,
                peak_slots: 150,
                state_evictions: 71,
                donor_nodes: 138,
                recurrent_hit_tokens: 204_800,
                peak_checkpoint_slots: 125,
            }),
            ..base
        };
        Report {
            model: ModelSpec::QWEN3_NEXT_80B_A3B,
            memory_bytes: 16 << 30,
            seed: 1,
            invariant_level: Level::Strict,
            timing: false,
            runs: vec![statik, unified],
        }
    }

    #[test]
    fn a_model_with_recurrent_state_gets_mamba_rows_and_no_swa_rows() {
        let table = sample_mamba_report().render_table();
        insta::assert_snapshot!(table);
        for row in [
            "recurrent hit tokens",
            "evictions (mamba states)",
            "evictions (donor nodes)",
            "peak bytes (mamba)",
            "peak state slots",
            "peak checkpoint slots",
            "state slot capacity",
        ] {
            assert!(table.contains(row), "{row}");
            assert!(!sample_report().render_table().contains(row), "{row}");
        }
        // Every model shows its KV hit and what it recomputed.
        for row in ["KV hit tokens", "recomputed tokens"] {
            assert!(table.contains(row), "{row}");
            assert!(sample_report().render_table().contains(row), "{row}");
        }
        assert!(!table.contains("(swa)"), "{table}");
        let json = sample_mamba_report().to_json().unwrap();
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["schema"], SCHEMA);
        assert_eq!(value["model"]["mamba_layers"], 36);
        assert_eq!(value["model"]["state_bytes_per_request"], 77_266_944);
        let unified = &value["runs"][1]["mamba"];
        assert_eq!(unified["donor_nodes"], 138);
        assert_eq!(unified["peak_slots"], 150);
        assert_eq!(unified["slots_total"], 221);
        assert_eq!(unified["state_evictions"], 71);
        assert_eq!(unified["slot_bytes"], 77_266_944);
        assert_eq!(unified["recurrent_hit_tokens"], 204_800);
        assert_eq!(unified["peak_checkpoint_slots"], 125);
        assert_eq!(value["runs"][1]["kv_hit_tokens"], 212_992);
        assert_eq!(value["runs"][1]["recomputed_tokens"], 8_192);
        // A model without recurrent state says so with null.
        let plain: serde_json::Value =
            serde_json::from_str(&sample_report().to_json().unwrap()).unwrap();
        assert!(plain["runs"][0]["mamba"].is_null());
        assert_eq!(plain["model"]["state_bytes_per_request"], 0);
    }

    /// The README says every report row is explained by `unikv replay --help`.
    #[test]
    fn every_row_of_the_table_is_explained_by_the_replay_help() {
        let help = crate::cli::replay_help();
        let rows = help
            .split("REPORT ROWS")
            .nth(1)
            .and_then(|s| s.split("EXIT STATUS").next())
            .expect("a REPORT ROWS section");
        for table in [sample_report(), sample_mamba_report()].map(|r| r.render_table()) {
            // Rows start with two spaces; the column header with more.
            for line in table
                .lines()
                .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
            {
                let label = line.trim_start().split("  ").next().unwrap();
                // Rows named by a kind or side are listed once, as `(KIND)` / `(SIDE)`.
                let listed = match label.split_once(" (") {
                    Some((head, "full)" | "swa)" | "mamba)")) => format!("\n  {head} ("),
                    _ => format!("\n  {label} "),
                };
                assert!(
                    rows.contains(&listed),
                    "{label:?} is not in the help's rows"
                );
            }
        }
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&v, 0.5), Some(1));
        let five = [10, 20, 30, 40, 50];
        assert_eq!(percentile(&five, 50.0), Some(30));
        assert_eq!(percentile(&five, 99.0), Some(50));
        assert_eq!(percentile(&five, 20.0), Some(10));
        assert_eq!(percentile(&five, 21.0), Some(20));
        assert_eq!(
            percentile(&[7, 9], 50.0),
            Some(7),
            "lower middle, no interpolation"
        );
        assert_eq!(percentile(&[7], 99.0), Some(7));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&five, 0.0), None);
        assert_eq!(percentile(&five, 101.0), None);
        assert_eq!(percentile(&five, f64::NAN), None);
    }

    #[test]
    fn timing_summarises_unsorted_steps() {
        let run = RunStats {
            step_cpu_ns: vec![50, 10, 40, 20, 30],
            pages_handled: 3,
            ..RunStats::default()
        };
        assert_eq!(
            run.timing(),
            Some(Timing {
                steps_timed: 5,
                median: 30,
                p99: 50,
                max: 50,
                total: 150,
                ns_per_page: 50,
            })
        );
        assert_eq!(RunStats::default().timing(), None);
    }

    #[test]
    fn the_verdict_fails_on_leaks_violations_syncs_and_unfinished_requests() {
        let good = RunStats {
            requests_total: 3,
            requests_completed: 3,
            ..RunStats::default()
        };
        assert!(good.failures().is_empty());
        let cases: [(RunStats, Failure); 4] = [
            (
                RunStats {
                    leaked_pages: 2,
                    ..good.clone()
                },
                Failure::Leaked { pages: 2 },
            ),
            (
                RunStats {
                    invariant_violations: 1,
                    ..good.clone()
                },
                Failure::InvariantViolations { violations: 1 },
            ),
            (
                RunStats {
                    host_syncs: 5,
                    ..good.clone()
                },
                Failure::HostSyncs { syncs: 5 },
            ),
            (
                RunStats {
                    requests_completed: 1,
                    ..good.clone()
                },
                Failure::Unfinished {
                    completed: 1,
                    total: 3,
                },
            ),
        ];
        for (run, failure) in cases {
            assert_eq!(run.failures(), std::slice::from_ref(&failure));
            let report = Report {
                runs: vec![good.clone(), run],
                ..sample_report()
            };
            assert!(!report.pass(), "{failure}");
            let verdict = report.render_verdict();
            assert!(
                verdict.starts_with("verdict: FAIL (1 of 2 runs)"),
                "{verdict}"
            );
            assert!(verdict.contains(&failure.to_string()), "{verdict}");
        }
        assert!(
            Report {
                runs: vec![good],
                ..sample_report()
            }
            .pass()
        );
        assert_eq!(
            Failure::Unfinished {
                completed: 1,
                total: 3
            }
            .to_string(),
            "2 of 3 requests unfinished"
        );
    }

    #[test]
    fn the_table_puts_static_and_unified_side_by_side() {
        insta::assert_snapshot!(sample_report().render_table());
    }

    #[test]
    fn the_table_without_timing_or_with_one_layout() {
        let mut report = sample_report();
        report.timing = false;
        report.runs.remove(0);
        insta::assert_snapshot!(report.render_table());
    }

    #[test]
    fn the_json_report_is_documented_and_stable() {
        let json = sample_report().to_json().unwrap();
        insta::assert_snapshot!(json);
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["runs"][1]["step_cpu_ns"]["median"], 4_000);
        let mut no_timing = sample_report();
        no_timing.timing = false;
        let value: serde_json::Value = serde_json::from_str(&no_timing.to_json().unwrap()).unwrap();
        assert!(value["runs"][0]["step_cpu_ns"].is_null());
    }

    #[test]
    fn groups_keep_first_appearance_order_and_put_static_first() {
        let mut runs = sample_pair();
        runs.swap(0, 1);
        let other = RunStats {
            workload: "smoke".into(),
            page_size: 1,
            ..runs[0].clone()
        };
        runs.insert(1, other);
        let report = Report {
            runs,
            ..sample_report()
        };
        let groups: Vec<(String, u32, Vec<Layout>)> = report
            .groups()
            .into_iter()
            .map(|(w, ps, runs)| (w.to_string(), ps, runs.iter().map(|r| r.layout).collect()))
            .collect();
        assert_eq!(
            groups,
            [
                (
                    "shared-prefix".to_string(),
                    256,
                    vec![Layout::Static, Layout::Unified]
                ),
                ("smoke".to_string(), 1, vec![Layout::Unified]),
            ]
        );
    }

    #[test]
    fn the_sample_recorder_stays_bounded_and_evenly_spaced() {
        let bytes = |step: u64| BTreeMap::from([("full".to_string(), step)]);
        let mut recorder = SampleRecorder::new(8);
        for step in 0..1_000 {
            recorder.record(step, || bytes(step));
        }
        let samples = recorder.finish(999, || bytes(999));
        let steps: Vec<u64> = samples.iter().map(|s| s.step).collect();
        assert!(steps.len() <= 9 && steps.len() >= 4, "{steps:?}");
        let stride = steps[1] - steps[0];
        assert!(
            steps[..steps.len() - 1]
                .windows(2)
                .all(|w| w[1] - w[0] == stride),
            "{steps:?}"
        );
        assert_eq!(*steps.last().unwrap(), 999);
        assert!(samples.iter().all(|s| s.bytes_by_subpool["full"] == s.step));
        // A short run keeps every step and adds nothing twice.
        let mut short = SampleRecorder::new(8);
        for step in 0..3 {
            short.record(step, || bytes(step));
        }
        assert_eq!(short.finish(2, || bytes(2)).len(), 3);
    }

    #[test]
    fn digits_are_grouped_by_thousands() {
        assert_eq!(group_digits(0), "0");
        assert_eq!(group_digits(999), "999");
        assert_eq!(group_digits(1_000), "1,000");
        assert_eq!(group_digits(1_234_567), "1,234,567");
    }
}

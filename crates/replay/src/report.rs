//! What a run reports ([`RunStats`], filled by the scheduler) and the replay's renderings
//! of a set of runs ([`Report`]): the side-by-side table, the JSON object, and the
//! pass/fail verdict. (The command line draws the SVG plots.)
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
//! A replay with a host tier (`--host-memory`) says so under the header, with the PCIe
//! bandwidth its transfer times assume ([`PCIE_GEN5_X16_BYTES_PER_SECOND`]), and adds its
//! rows: the hit split into the device's and the host's tokens, the bytes loaded back and
//! written back and their time on the link, the host's peak bytes per kind and in all,
//! its copies and the write-backs it refused. A table without one has none of this.
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
//!     "step_with_metadata_cpu_ns": { as step_cpu_ns },  (absent with --no-timing)
//!                                   the same plus the step's metadata build: the
//!                                   step's whole host cost, over every 16th step (its
//!                                   ns_per_page counts their time only)
//!     "pass": bool,
//!     "failures": [ str ],          why the run failed, one sentence each
//!     "host": {                     the host tier (--host-memory); null without one
//!       "total_bytes": u64,         its buffer
//!       "device_hit_tokens": u64,   prefix_hit_tokens the device held at admission,
//!       "host_hit_tokens": u64,     and those loaded back from the host (the rest)
//!       "loaded_bytes": u64,        bytes copied host to device (load-backs)
//!       "written_bytes": u64,       bytes copied device to host (write-backs at eviction)
//!       "peak_full_bytes": u64, "peak_swa_bytes": u64, "peak_state_bytes": u64,
//!                                   most bytes held per kind at a step boundary
//!       "peak_bytes": u64,          most bytes held at once, all kinds
//!       "copies": u64, "largest_copy": u64,  copies issued both ways, the largest
//!       "refused_writes": u64,      write-backs skipped: the host could not make room
//!       "transfer_bytes_per_second": u64,  the link assumed per direction (PCIe Gen5 x16)
//!       "load_ns": u64, "write_back_ns": u64  loaded and written bytes / that bandwidth
//!     } | null,
//!     "speculative": {              only in a speculative run (--spec, --spec-tree)
//!       "draft": str, "width": u32, "late": bool,
//!       "verify_steps": u64,        verify steps allocated, one per request and step
//!       "settled_steps": u64,       of those, settled (the rest were dropped with their
//!                                   finished or retracted request)
//!       "accepted_tokens": u64,     positions the settled steps accepted
//!       "accepted_per_step": f64 | null,
//!       "baseline_peak_bytes_by_subpool": { name: u64 },  the same run without
//!       "baseline_steps": u64, "baseline_retractions": u64,  speculation
//!       "baseline_failures": [ str ],
//!       "baseline_prompt_tokens": u64, "baseline_prefix_hit_tokens": u64,
//!       "baseline_recomputed_tokens": u64,
//!       "baseline_prefix_hit_rate": f64 | null  the speculative run's is held to 95 % of it
//!     }
//!   } ]
//! }
//! ```
//! Everything but the two timings is a function of the seed: with `--no-timing` the same
//! seed prints the same bytes.

use crate::config::serialize_layout;
use crate::error::ReplayError;
use crate::speculative::ACCEPT_PROBABILITY;
use crate::stats::{
    Failure, HostRunStats, MambaStats, PCIE_GEN5_X16_BYTES_PER_SECOND, RunStats, SpecStats, Timing,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use unikv::{Layout, ModelSpec};
use unikv_invariants::Level;
use unikv_workload::units::{format_bytes, format_ns, group_digits};

/// The report's rows, one line each (and its continuation lines): what `unikv replay
/// --help` prints under REPORT ROWS. Every row the table can have is here (a test checks
/// it).
pub const ROWS_HELP: &str = "\
REPORT ROWS (a column per layout, then unified/static):
  requests completed        requests that finished, of the workload's
  peak admitted             most requests running at once
  retractions               requests sent back to the queue when memory ran short
  prefix hit rate           admitted prompt tokens served from the prefix cache
  KV hit tokens             admitted prompt tokens whose FULL/SWA KV was cached
  recurrent hit tokens      of those, tokens resumed from a cached recurrent state
                            (models with state; the same as the hit rate's tokens)
  recomputed tokens         KV hit minus tokens served: cached KV computed again
                            (no state, or too little live SWA, where the hit ended)
  device hit tokens         with --host-memory: of the tokens served, those the device
                            held at admission,
  host hit tokens             and those loaded back from the host tier
  evictions (KIND)          tokens evicted from the prefix cache under pressure: full
                            (whole nodes), swa (window tombstones)
  evictions (mamba states)  cached recurrent states evicted (models with state)
  evictions (donor nodes)   prefix nodes evicted so their FULL bytes hold state slots
  peak bytes (SIDE)         most bytes in use on a sub-pool: full, swa, mamba
  peak state slots          most state slots in use at once
  peak checkpoint slots     most of them held as checkpoints (cached in the tree, or
                            saved by a request and not yet taken): all but running ones
  state slot capacity       state slots the layout can hold (static: its fixed pool)
  host loaded bytes         with --host-memory: bytes copied back, host to device
  host written bytes        bytes written back, device to host, as the device evicted
  host load time            those bytes' time on the link at PCIe Gen5 x16, 64 GB/s
  host write-back time        per direction (time = bytes / bandwidth, each apart)
  host peak (SIDE)          most bytes the host held per kind at a step boundary: full,
                            swa, mamba (recurrent states)
  host peak bytes           most bytes the host held at once, all kinds
  host copies               copies issued both ways (one per run of adjacent bytes)
  host largest copy         the largest single copy
  host refused writes       write-backs skipped because the host could not make room
  steps                     scheduler steps to finish the workload
  host syncs per step       device waits on the scheduling path (must be 0)
  step CPU time, median     allocator and tree host time per step (device work
  step CPU time, p99          excluded; thread CPU time, so preemption does not count)
  step CPU per page         all steps' host time per page (or state slot) bound or
                            released
  step + metadata, median   the step's whole host cost: the rows above plus the
  step + metadata, p99        step metadata the engine builds for its forward (every
                            16th step; --no-timing drops these five rows)
  verify steps              speculative runs (--spec, --spec-tree): verify steps,
                            one per request and step
  accepted per verify       positions accepted per settled verify step, the
                            request's next token included (mean)
  no-spec prefix hit rate   the same run decoding one token per step: its hit rate,
  no-spec recomputed          its recomputed tokens,
  no-spec steps               its steps,
  no-spec retractions         its retractions
  no-spec peak (SIDE)         and its peak bytes on each sub-pool
  invariant violations      breaches recorded at the run's level (must be 0)
  leaked pages              pages and slots still held after releasing and evicting
                            everything (must be 0)
  verdict                   pass when every request finished and the three checks
                            above hold
";

/// The schema name of the JSON object (`--json`).
pub const SCHEMA: &str = "unikv.replay.v3";

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
            runs.sort_by_key(|r| r.layout == Layout::Unified); // static first (stable)
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
        if let Some(spec) = self.runs.iter().find_map(|r| r.speculative.as_ref()) {
            let _ = writeln!(
                out,
                "speculative decoding: {}, verify width {}, each draft accepted with p = \
                 {ACCEPT_PROBABILITY} (seeded); no-spec rows: the same run decoding one token \
                 per step",
                spec.draft, spec.width
            );
        }
        if let Some(host) = self.runs.iter().find_map(|r| r.host.as_ref()) {
            let _ = writeln!(
                out,
                "host tier: {}, written back as the device evicts, loaded back by the \
                 prompts that match; transfer times at PCIe Gen5 x16, {} GB/s per direction \
                 (bytes / bandwidth)",
                format_bytes(host.total_bytes),
                PCIE_GEN5_X16_BYTES_PER_SECOND / 1_000_000_000
            );
        }
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
            [s, u] if matches!(s.layout, Layout::Static { .. }) && u.layout == Layout::Unified => {
                Some((*s, *u))
            }
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
        let tiered = runs.iter().any(|r| r.host.is_some());
        // A replay with a host tier: a host cell of each run ("—" for a run without).
        let host = |cell: fn(&HostRunStats) -> Cell| {
            move |r: &RunStats| match &r.host {
                Some(h) => cell(h),
                None => Cell::Text("—".into(), None),
            }
        };
        if tiered {
            table.row(
                "device hit tokens",
                runs,
                host(|h| Cell::Count(h.device_hit_tokens)),
            );
            table.row(
                "host hit tokens",
                runs,
                host(|h| Cell::Count(h.host_hit_tokens)),
            );
        }
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
        if tiered {
            table.row(
                "host loaded bytes",
                runs,
                host(|h| Cell::bytes(h.loaded_bytes)),
            );
            table.row(
                "host written bytes",
                runs,
                host(|h| Cell::bytes(h.written_bytes)),
            );
            table.row("host load time", runs, host(|h| Cell::time(h.load_ns())));
            table.row(
                "host write-back time",
                runs,
                host(|h| Cell::time(h.write_back_ns())),
            );
            table.row(
                "host peak (full)",
                runs,
                host(|h| Cell::bytes(h.peak_full_bytes)),
            );
            if self.model.swa_layers > 0 {
                table.row(
                    "host peak (swa)",
                    runs,
                    host(|h| Cell::bytes(h.peak_swa_bytes)),
                );
            }
            if self.model.has_recurrent_state() {
                table.row(
                    "host peak (mamba)",
                    runs,
                    host(|h| Cell::bytes(h.peak_state_bytes)),
                );
            }
            table.row("host peak bytes", runs, host(|h| Cell::bytes(h.peak_bytes)));
            table.row("host copies", runs, host(|h| Cell::Count(h.copies)));
            table.row(
                "host largest copy",
                runs,
                host(|h| Cell::bytes(h.largest_copy)),
            );
            table.row(
                "host refused writes",
                runs,
                host(|h| Cell::Count(h.refused_writes)),
            );
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
            table.row("step + metadata, median", runs, |r| {
                match r.timing_with_metadata() {
                    Some(t) => Cell::Text(format_ns(t.median), Some(t.median as f64)),
                    None => Cell::Text("—".into(), None),
                }
            });
            table.row("step + metadata, p99", runs, |r| {
                match r.timing_with_metadata() {
                    Some(t) => Cell::Text(format_ns(t.p99), Some(t.p99 as f64)),
                    None => Cell::Text("—".into(), None),
                }
            });
        }
        if runs.iter().any(|r| r.speculative.is_some()) {
            let spec = |field: fn(&SpecStats) -> u64| {
                move |r: &RunStats| match &r.speculative {
                    Some(s) => count(field(s)),
                    None => Cell::Text("—".into(), None),
                }
            };
            table.row("verify steps", runs, spec(|s| s.verify_steps));
            table.row("accepted per verify", runs, |r| {
                match r
                    .speculative
                    .as_ref()
                    .and_then(SpecStats::accepted_per_step)
                {
                    Some(mean) => Cell::Text(format!("{mean:.2}"), Some(mean)),
                    None => Cell::Text("—".into(), None),
                }
            });
            table.row("no-spec prefix hit rate", runs, |r| {
                match r
                    .speculative
                    .as_ref()
                    .and_then(SpecStats::baseline_prefix_hit_rate)
                {
                    Some(rate) => Cell::Text(format!("{:.1} %", rate * 100.0), Some(rate)),
                    None => Cell::Text("—".into(), None),
                }
            });
            table.row(
                "no-spec recomputed",
                runs,
                spec(|s| s.baseline_recomputed_tokens),
            );
            table.row("no-spec steps", runs, spec(|s| s.baseline_steps));
            table.row(
                "no-spec retractions",
                runs,
                spec(|s| s.baseline_retractions),
            );
            let pools: Vec<String> = {
                let mut keys: Vec<String> = runs
                    .iter()
                    .filter_map(|r| r.speculative.as_ref())
                    .flat_map(|s| s.baseline_peak_bytes_by_subpool.keys().cloned())
                    .collect();
                keys.sort();
                keys.dedup();
                keys
            };
            for pool in pools {
                table.row(&format!("no-spec peak ({pool})"), runs, |r| {
                    match &r.speculative {
                        Some(s) => {
                            let bytes = s
                                .baseline_peak_bytes_by_subpool
                                .get(&pool)
                                .copied()
                                .unwrap_or(0);
                            Cell::Text(format_bytes(bytes), Some(bytes as f64))
                        }
                        None => Cell::Text("—".into(), None),
                    }
                });
            }
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
    pub fn to_json(&self) -> Result<String, ReplayError> {
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
                        step_with_metadata_cpu_ns: if self.timing {
                            r.timing_with_metadata()
                        } else {
                            None
                        },
                        pass: failures.is_empty(),
                        failures,
                        host: r.host.as_ref().map(|h| JsonHost {
                            stats: h,
                            transfer_bytes_per_second: PCIE_GEN5_X16_BYTES_PER_SECOND,
                            load_ns: h.load_ns(),
                            write_back_ns: h.write_back_ns(),
                        }),
                        speculative: r.speculative.as_ref().map(|s| JsonSpec {
                            stats: s,
                            accepted_per_step: s.accepted_per_step(),
                            baseline_prefix_hit_rate: s.baseline_prefix_hit_rate(),
                        }),
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
    #[serde(serialize_with = "serialize_layout")]
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
    #[serde(skip_serializing_if = "Option::is_none")]
    step_with_metadata_cpu_ns: Option<Timing>,
    pass: bool,
    failures: Vec<String>,
    host: Option<JsonHost<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    speculative: Option<JsonSpec<'a>>,
}

/// A run's host tier in its JSON object: its figures and their time on the link.
#[derive(Serialize)]
struct JsonHost<'a> {
    #[serde(flatten)]
    stats: &'a HostRunStats,
    transfer_bytes_per_second: u64,
    load_ns: u64,
    write_back_ns: u64,
}

/// A speculative run's part of its JSON object.
#[derive(Serialize)]
struct JsonSpec<'a> {
    #[serde(flatten)]
    stats: &'a SpecStats,
    accepted_per_step: Option<f64>,
    baseline_prefix_hit_rate: Option<f64>,
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
    /// Bytes, in binary units, compared.
    fn bytes(bytes: u64) -> Cell {
        Cell::Text(format_bytes(bytes), Some(bytes as f64))
    }

    /// A time in nanoseconds, in its unit, compared.
    fn time(ns: u64) -> Cell {
        Cell::Text(format_ns(ns), Some(ns as f64))
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LAYOUTS;
    use crate::samples::{
        sample_host_report, sample_mamba_report, sample_pair, sample_report, sample_spec_report,
    };

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

    /// The README says every report row is explained by `unikv replay --help`, which
    /// prints [`ROWS_HELP`].
    #[test]
    fn every_row_of_the_table_is_explained_by_the_replay_help() {
        let rows = ROWS_HELP;
        for table in [
            sample_report(),
            sample_mamba_report(),
            sample_spec_report(),
            sample_host_report(),
            mamba_host_report(),
        ]
        .map(|r| r.render_table())
        {
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

    /// A speculative report adds its rows and a line saying what was drafted; the JSON
    /// run carries a `speculative` object that a plain run does not have.
    #[test]
    fn a_speculative_report_adds_its_rows_and_json_object() {
        let table = sample_spec_report().render_table();
        for row in [
            "speculative decoding: chain of 4 drafts, verify width 5",
            "verify steps",
            "accepted per verify                 3.71            3.71",
            "no-spec steps",
            "no-spec retractions",
            "no-spec peak (full)",
            "no-spec peak (mamba)",
        ] {
            assert!(table.contains(row), "{row}: {table}");
            assert!(!sample_mamba_report().render_table().contains(row), "{row}");
        }
        let value: serde_json::Value =
            serde_json::from_str(&sample_spec_report().to_json().unwrap()).unwrap();
        let spec = &value["runs"][0]["speculative"];
        assert_eq!(spec["accepted_per_step"], 3.71);
        assert_eq!(spec["width"], 5);
        assert_eq!(spec["baseline_failures"], serde_json::json!([]));
        let plain: serde_json::Value =
            serde_json::from_str(&sample_mamba_report().to_json().unwrap()).unwrap();
        assert!(plain["runs"][0].get("speculative").is_none());
    }

    /// [`sample_mamba_report`] with a host tier holding states.
    fn mamba_host_report() -> Report {
        let mut report = sample_mamba_report();
        for run in &mut report.runs {
            run.host = Some(HostRunStats {
                total_bytes: 64 << 30,
                host_hit_tokens: run.prefix_hit_tokens / 2,
                device_hit_tokens: run.prefix_hit_tokens / 2,
                peak_state_bytes: 40 * 77_266_944,
                ..HostRunStats::default()
            });
        }
        report
    }

    /// A replay with a host tier says so under the header and adds a row per host
    /// figure; the JSON run carries a `host` object (null without a host tier, whose
    /// table has none of these rows).
    #[test]
    fn a_host_tier_adds_its_rows_and_json_object() {
        let table = sample_host_report().render_table();
        insta::assert_snapshot!(table);
        let rows = [
            "host tier: 64.00 GiB,",
            "64 GB/s per direction",
            "device hit tokens",
            "host hit tokens",
            "host loaded bytes",
            "host written bytes",
            "host load time",
            "host write-back time",
            "host peak (full)",
            "host peak (swa)",
            "host peak bytes",
            "host copies",
            "host largest copy",
            "host refused writes",
        ];
        for row in rows {
            assert!(table.contains(row), "{row}: {table}");
            for plain in [sample_report(), sample_mamba_report(), sample_spec_report()] {
                assert!(!plain.render_table().contains(row), "{row}");
            }
        }
        // gpt-oss keeps no state; qwen3-next has no SWA.
        assert!(!table.contains("host peak (mamba)"), "{table}");
        let mamba = mamba_host_report().render_table();
        assert!(mamba.contains("host peak (mamba)"), "{mamba}");
        assert!(!mamba.contains("host peak (swa)"), "{mamba}");
        // 13,958,643,712 bytes at 64 GB/s: 218.1 ms.
        let load = table.lines().find(|l| l.starts_with("  host load time"));
        assert!(load.is_some_and(|l| l.contains(" 218.10 ms ")), "{table}");
        let value: serde_json::Value =
            serde_json::from_str(&sample_host_report().to_json().unwrap()).unwrap();
        let host = &value["runs"][0]["host"];
        assert_eq!(host["total_bytes"], 64u64 << 30);
        assert_eq!(host["device_hit_tokens"], 12_288);
        assert_eq!(host["host_hit_tokens"], 509_952);
        assert_eq!(
            host["device_hit_tokens"].as_u64().unwrap() + host["host_hit_tokens"].as_u64().unwrap(),
            value["runs"][0]["prefix_hit_tokens"].as_u64().unwrap()
        );
        assert_eq!(host["loaded_bytes"], 13_958_643_712u64);
        assert_eq!(host["written_bytes"], 36_473_995_264u64);
        assert_eq!(host["peak_full_bytes"], 35_869_491_200u64);
        assert_eq!(host["peak_swa_bytes"], 1_879_048_192u64);
        assert_eq!(host["peak_state_bytes"], 0);
        assert_eq!(host["peak_bytes"], 37_748_539_392u64);
        assert_eq!(host["copies"], 3_968);
        assert_eq!(host["largest_copy"], 23_592_960);
        assert_eq!(host["refused_writes"], 0);
        assert_eq!(host["transfer_bytes_per_second"], 64_000_000_000u64);
        assert_eq!(host["load_ns"], 218_103_808);
        assert_eq!(host["write_back_ns"], 569_906_176);
        for plain in [sample_report(), sample_mamba_report(), sample_spec_report()] {
            let value: serde_json::Value = serde_json::from_str(&plain.to_json().unwrap()).unwrap();
            for run in value["runs"].as_array().unwrap() {
                assert!(run["host"].is_null(), "{run}");
            }
        }
    }

    /// A transfer takes bytes / [`PCIE_GEN5_X16_BYTES_PER_SECOND`], and the help states
    /// the bandwidth the constant holds.
    #[test]
    fn transfer_times_are_bytes_over_the_stated_pcie_bandwidth() {
        use crate::stats::transfer_ns;
        assert_eq!(transfer_ns(64_000_000_000), 1_000_000_000);
        assert_eq!(transfer_ns(64), 1);
        assert_eq!(transfer_ns(63), 0, "rounded down");
        assert_eq!(transfer_ns(1 << 30), 16_777_216);
        assert_eq!(
            transfer_ns(u64::MAX),
            (u128::from(u64::MAX) * 1_000 / 64_000) as u64
        );
        let host = HostRunStats {
            loaded_bytes: 128_000,
            written_bytes: 64_000,
            ..HostRunStats::default()
        };
        assert_eq!((host.load_ns(), host.write_back_ns()), (2_000, 1_000));
        let gbps = PCIE_GEN5_X16_BYTES_PER_SECOND / 1_000_000_000;
        assert!(ROWS_HELP.contains(&format!("PCIe Gen5 x16, {gbps} GB/s")));
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
                ("shared-prefix".to_string(), 256, LAYOUTS.to_vec()),
                ("smoke".to_string(), 1, vec![Layout::Unified]),
            ]
        );
    }
}

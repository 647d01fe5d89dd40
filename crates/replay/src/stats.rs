//! What a run reports: [`RunStats`] (filled by the scheduler), its Mamba part
//! ([`MambaStats`]), its host tier's part ([`HostRunStats`], with the PCIe bandwidth its
//! transfer times assume, [`PCIE_GEN5_X16_BYTES_PER_SECOND`]), the bounded per-step samples the plots draw ([`SampleRecorder`]),
//! the CPU time summary ([`Timing`]) and why a run fails the verdict ([`Failure`]).

use crate::config::{LAYOUTS, RunConfig, serialize_layout};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use unikv::Layout;
use unikv_workload::Workload;

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

/// The host-device bandwidth a run's transfer times assume, per direction: PCIe Gen5 x16,
/// 64 GB/s (10⁹ bytes), its nominal figure (32 GT/s × 16 lanes ≈ 63 GB/s after 128b/130b
/// encoding; pinned copies measure 50–55 GB/s, so the times are lower bounds). A time is
/// bytes / bandwidth, loads (host to device) and write-backs (device to host) apart: the
/// link is full duplex, so the two may overlap each other (and the forward); the report
/// shows what the bytes cost the link, not a stall.
pub const PCIE_GEN5_X16_BYTES_PER_SECOND: u64 = 64_000_000_000;

/// Nanoseconds `bytes` take at [`PCIE_GEN5_X16_BYTES_PER_SECOND`] (rounded down).
pub fn transfer_ns(bytes: u64) -> u64 {
    (u128::from(bytes) * 1_000_000_000 / u128::from(PCIE_GEN5_X16_BYTES_PER_SECOND)) as u64
}

/// What a run's host tier did (`--host-memory`): how the prefix cache's hits split
/// between the device and the host, the bytes moved each way and what they cost the link
/// ([`PCIE_GEN5_X16_BYTES_PER_SECOND`]), and the bytes the host held. `None` in
/// [`RunStats::host`] without a host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostRunStats {
    /// Bytes of the host buffer (`--host-memory`).
    pub total_bytes: u64,
    /// Of [`RunStats::prefix_hit_tokens`], those the device held at admission.
    pub device_hit_tokens: u64,
    /// Of [`RunStats::prefix_hit_tokens`], those admission loaded back from the host
    /// (each admission's [`unikv::PrefixMatch::host_tokens`]).
    pub host_hit_tokens: u64,
    /// Bytes loaded back, host to device.
    pub loaded_bytes: u64,
    /// Bytes written back, device to host, as the device evicted prefixes.
    pub written_bytes: u64,
    /// The most bytes of FULL pages the host held at a step boundary.
    pub peak_full_bytes: u64,
    /// The most bytes of SWA pages (the window behind a written-back position) the host
    /// held at a step boundary.
    pub peak_swa_bytes: u64,
    /// The most bytes of recurrent states the host held at a step boundary.
    pub peak_state_bytes: u64,
    /// The most bytes the host held at once, all kinds (the tier's own peak, taken at
    /// every write-back, so at least any step boundary's sum).
    pub peak_bytes: u64,
    /// Copies issued, both ways (one per run of adjacent bytes).
    pub copies: u64,
    /// The largest single copy, in bytes.
    pub largest_copy: u64,
    /// Write-backs skipped because the host could not make room for them.
    pub refused_writes: u64,
}

impl HostRunStats {
    /// The load-backs' time on the link: [`HostRunStats::loaded_bytes`] at
    /// [`PCIE_GEN5_X16_BYTES_PER_SECOND`], in nanoseconds.
    pub fn load_ns(&self) -> u64 {
        transfer_ns(self.loaded_bytes)
    }

    /// The write-backs' time on the link: [`HostRunStats::written_bytes`] at
    /// [`PCIE_GEN5_X16_BYTES_PER_SECOND`], in nanoseconds.
    pub fn write_back_ns(&self) -> u64 {
        transfer_ns(self.written_bytes)
    }

    /// Takes the cache's host figures at a step boundary: the per-kind peaks sampled,
    /// the counters as they are.
    pub fn observe(&mut self, host: &unikv::HostStats) {
        self.total_bytes = host.total_bytes;
        self.peak_full_bytes = self.peak_full_bytes.max(host.full_bytes);
        self.peak_swa_bytes = self.peak_swa_bytes.max(host.swa_bytes);
        self.peak_state_bytes = self.peak_state_bytes.max(host.state_bytes);
        self.peak_bytes = self.peak_bytes.max(host.peak_bytes);
        self.host_hit_tokens = host.hit_tokens;
        self.loaded_bytes = host.loaded_bytes;
        self.written_bytes = host.written_bytes;
        self.copies = host.copies;
        self.largest_copy = host.largest_copy;
        self.refused_writes = host.refused_writes;
    }
}

/// What a speculative run's verify steps did, and what the same run did without
/// speculation (the baseline the report compares with).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SpecStats {
    /// What each verify step drafted (`chain of 4 drafts`, `tree of 6 nodes`, with
    /// `, counts a step late`).
    pub draft: String,
    /// Positions one verify step checks (`1 + k`, or the tree's nodes).
    pub width: u32,
    /// Whether the counts were settled a step late.
    pub late: bool,
    /// Verify steps allocated, one per request and step (`alloc_verify` batches count
    /// each request).
    pub verify_steps: u64,
    /// Verify steps settled (the rest were in flight when their request finished or was
    /// retracted, and were dropped with it, as an overlap scheduler drops them).
    pub settled_steps: u64,
    /// Positions the settled steps accepted (each at least 1: the request's next token).
    pub accepted_tokens: u64,
    /// The baseline's peak bytes per sub-pool: the same workload, layout and page size
    /// decoding one token per step.
    pub baseline_peak_bytes_by_subpool: BTreeMap<String, u64>,
    /// The baseline's steps.
    pub baseline_steps: u64,
    /// The baseline's retractions.
    pub baseline_retractions: u64,
    /// Why the baseline failed its checks (empty when it passed).
    pub baseline_failures: Vec<String>,
    /// The baseline's prompt tokens admitted.
    pub baseline_prompt_tokens: u64,
    /// The baseline's prompt tokens served from the prefix cache (its hit rate's
    /// numerator: the speculative run's hit rate is held against it).
    pub baseline_prefix_hit_tokens: u64,
    /// The baseline's tokens whose KV was cached but were recomputed.
    pub baseline_recomputed_tokens: u64,
}

impl SpecStats {
    /// The baseline's prefix hit rate (`None` when it admitted no prompt token).
    pub fn baseline_prefix_hit_rate(&self) -> Option<f64> {
        (self.baseline_prompt_tokens > 0)
            .then(|| self.baseline_prefix_hit_tokens as f64 / self.baseline_prompt_tokens as f64)
    }

    /// Mean positions accepted per settled verify step (`None` before any).
    pub fn accepted_per_step(&self) -> Option<f64> {
        (self.settled_steps > 0).then(|| self.accepted_tokens as f64 / self.settled_steps as f64)
    }
}

/// What one run (a workload × a layout × a page size) did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunStats {
    /// The workload's name.
    pub workload: String,
    /// The layout (its name in JSON).
    #[serde(serialize_with = "serialize_layout")]
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
    /// The largest number of bytes each sub-pool held at any step boundary (and, in a
    /// speculative run, right after each verify step's allocation, while its rejected
    /// rows are still held).
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
    /// The whole host cost of every `METADATA_EVERY`-th step, in nanoseconds: its
    /// `step_cpu_ns` plus its metadata build (`build_step_metadata` for the requests the
    /// step computes), measured as `step_cpu_ns` is (a step's metadata is not part of
    /// its `step_cpu_ns`). Measured; may be empty.
    pub step_with_metadata_cpu_ns: Vec<u64>,
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
    /// A speculative run's verify steps and its baseline (`None` without speculation).
    pub speculative: Option<SpecStats>,
    /// What the host tier did (`None` without one, [`RunConfig::host_memory_bytes`]).
    pub host: Option<HostRunStats>,
}

/// Empty statistics of the static layout (the facade's [`Layout`] has no default): no
/// workload, every count 0.
impl Default for RunStats {
    fn default() -> RunStats {
        RunStats {
            workload: String::new(),
            layout: LAYOUTS[0],
            page_size: 0,
            memory_bytes: 0,
            requests_total: 0,
            requests_completed: 0,
            peak_admitted: 0,
            retractions: 0,
            prompt_tokens: 0,
            prefix_hit_tokens: 0,
            kv_hit_tokens: 0,
            recomputed_tokens: 0,
            evictions_by_kind: BTreeMap::new(),
            peak_bytes_by_subpool: BTreeMap::new(),
            mamba: None,
            host_syncs: 0,
            steps: 0,
            step_cpu_ns: Vec::new(),
            step_with_metadata_cpu_ns: Vec::new(),
            pages_handled: 0,
            invariant_violations: 0,
            leaked_pages: 0,
            samples: Vec::new(),
            speculative: None,
            host: None,
        }
    }
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
            host: (config.host_memory_bytes > 0).then(|| HostRunStats {
                total_bytes: config.host_memory_bytes,
                ..HostRunStats::default()
            }),
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
        self.timing_of(self.step_cpu_ns.clone())
    }

    /// [`RunStats::timing`] of the steps' whole host cost, allocator and tree plus
    /// metadata ([`RunStats::step_with_metadata_cpu_ns`]), or `None` when it is empty.
    pub fn timing_with_metadata(&self) -> Option<Timing> {
        self.timing_of(self.step_with_metadata_cpu_ns.clone())
    }

    fn timing_of(&self, mut sorted: Vec<u64>) -> Option<Timing> {
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
        if let Some(spec) = &self.speculative
            && !spec.baseline_failures.is_empty()
        {
            failures.push(Failure::Baseline {
                reasons: spec.baseline_failures.join("; "),
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
    /// A speculative run's baseline (the same run without speculation) failed.
    Baseline {
        /// Its failures, `; `-separated.
        reasons: String,
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
            Failure::Baseline { reasons } => write!(f, "without speculation: {reasons}"),
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

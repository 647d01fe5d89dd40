//! Hand-made reports for tests of the renderings (here and in the command line's plots):
//! compiled for this crate's tests and, with the `testing` feature, for other crates'.

use crate::config::LAYOUTS;
use crate::report::Report;
use crate::stats::{HostRunStats, MambaStats, RunStats, SpecStats, StepSample};
use std::collections::BTreeMap;
use unikv::Layout;
use unikv::ModelSpec;
use unikv_invariants::Level;

/// A hand-made pair of runs of one group, shaped like a shared-prefix replay at page
/// size 256 where the static split retracts.
pub fn sample_pair() -> Vec<RunStats> {
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
        layout: LAYOUTS[0],
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
        step_with_metadata_cpu_ns: vec![5_000, 6_200, 95_000],
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
        step_with_metadata_cpu_ns: vec![3_900, 5_100, 54_000],
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

/// [`sample_pair`] as a gpt-oss-20b report at 16 GiB, with timing.
pub fn sample_report() -> Report {
    Report {
        model: ModelSpec::GPT_OSS_20B,
        memory_bytes: 16 << 30,
        seed: 1,
        invariant_level: Level::Strict,
        timing: true,
        runs: sample_pair(),
    }
}

/// [`sample_mamba_report`] as a speculative replay (`--spec 4`): the same runs with
/// hand-made verify steps and a no-spec baseline.
pub fn sample_spec_report() -> Report {
    let mut report = sample_mamba_report();
    for run in &mut report.runs {
        run.speculative = Some(SpecStats {
            draft: "chain of 4 drafts".into(),
            width: 5,
            late: false,
            verify_steps: 1_000,
            settled_steps: 1_000,
            accepted_tokens: 3_710,
            baseline_peak_bytes_by_subpool: run.peak_bytes_by_subpool.clone(),
            baseline_steps: run.steps * 3,
            baseline_retractions: run.retractions,
            baseline_failures: Vec::new(),
            baseline_prompt_tokens: run.prompt_tokens,
            baseline_prefix_hit_tokens: run.prefix_hit_tokens,
            baseline_recomputed_tokens: run.recomputed_tokens,
        });
    }
    report
}

/// A hand-made pair of runs of a model with recurrent state (qwen3-next: FULL and
/// state slots, no SWA), shaped like a `mamba-starvation` replay at page size 1.
pub fn sample_mamba_report() -> Report {
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
        layout: LAYOUTS[0],
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

/// A hand-made pair of runs with a host tier (`--host-memory 64GiB`), shaped like a
/// gpt-oss-20b `multi-turn` replay at page size 16 in 1 GiB of device memory, without
/// timing: most of the hit is loaded back from the host.
pub fn sample_host_report() -> Report {
    let map = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    };
    let base = RunStats {
        workload: "multi-turn".into(),
        page_size: 16,
        memory_bytes: 1 << 30,
        requests_total: 512,
        requests_completed: 512,
        peak_admitted: 32,
        ..RunStats::default()
    };
    let statik = RunStats {
        layout: LAYOUTS[0],
        retractions: 41,
        prompt_tokens: 1_061_888,
        prefix_hit_tokens: 522_240,
        kv_hit_tokens: 522_240,
        evictions_by_kind: map(&[("full", 1_468_416), ("swa", 1_523_712)]),
        peak_bytes_by_subpool: map(&[("full", 596_361_216), ("swa", 477_102_080)]),
        steps: 31_204,
        host: Some(HostRunStats {
            total_bytes: 64 << 30,
            device_hit_tokens: 12_288,
            host_hit_tokens: 509_952,
            loaded_bytes: 13_958_643_712,
            written_bytes: 36_473_995_264,
            peak_full_bytes: 35_869_491_200,
            peak_swa_bytes: 1_879_048_192,
            peak_state_bytes: 0,
            peak_bytes: 37_748_539_392,
            copies: 3_968,
            largest_copy: 23_592_960,
            refused_writes: 0,
        }),
        ..base.clone()
    };
    let unified = RunStats {
        layout: Layout::Unified,
        retractions: 3,
        prompt_tokens: 1_037_312,
        prefix_hit_tokens: 529_408,
        kv_hit_tokens: 529_408,
        evictions_by_kind: map(&[("full", 1_101_312), ("swa", 2_064_384)]),
        peak_bytes_by_subpool: map(&[("full", 863_502_336), ("swa", 209_715_200)]),
        steps: 29_877,
        host: Some(HostRunStats {
            total_bytes: 64 << 30,
            device_hit_tokens: 21_504,
            host_hit_tokens: 507_904,
            loaded_bytes: 13_908_312_064,
            written_bytes: 27_858_370_560,
            peak_full_bytes: 27_065_843_712,
            peak_swa_bytes: 1_413_480_448,
            peak_state_bytes: 0,
            peak_bytes: 28_479_324_160,
            copies: 3_612,
            largest_copy: 23_592_960,
            refused_writes: 0,
        }),
        ..base
    };
    Report {
        model: ModelSpec::GPT_OSS_20B,
        memory_bytes: 1 << 30,
        seed: 1,
        invariant_level: Level::Off,
        timing: false,
        runs: vec![statik, unified],
    }
}

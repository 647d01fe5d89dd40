//! The equivalence run in the test matrix: the tiny engine of `examples/tiny_engine`
//! serves a short randomized workload (shared prefixes, follow-up turns, chunked
//! prefill, window releases, eviction and compaction under a small budget, retraction,
//! aborts) through unikv's buffer and step metadata, and every request's generated
//! tokens and final logits equal, bit for bit, those of a reference with contiguous K/V,
//! and every recurrent state a request resumes from equals a contiguous recompute of its
//! prefix. At the matrix cell's page size (1 and 16 without one), both layouts, for
//! FULL + SWA, FULL + Mamba and the tri-pool (the tri-pool only, at page size 256).
//! `tests/tiny_engine_reuse.rs` runs the scripted reuse workloads with reuse on and off.

#[path = "../examples/tiny_engine/engine.rs"]
mod engine;

use engine::{Fault, Model, Reuse, RunConfig, Workload, compare, reference_outputs, serve};
use unikv::Layout;

/// The matrix cell's page size; 1 and 16 without one.
fn page_sizes() -> Vec<u32> {
    unikv::invariants::testing::matrix_page_size().map_or(vec![1, 16], |ps| vec![ps])
}

#[test]
fn the_engine_on_unikv_generates_exactly_what_the_contiguous_reference_does() {
    for ps in page_sizes() {
        // At page size 256 (long prompts: hits need whole pages) only the tri model,
        // whose layouts cover the most, to keep the debug run to seconds.
        let models: &[Model] = if ps >= 256 {
            &[Model::TriPool]
        } else {
            &Model::ALL
        };
        for &model in models {
            for layout in [
                Layout::Static {
                    swa_full_tokens_ratio: 1.0,
                },
                Layout::Unified,
            ] {
                let unit = ps.max(16);
                let cfg = RunConfig {
                    seed: 3,
                    page_size: ps,
                    layout,
                    model,
                    // Short outputs and no aborts keep the page-size-256 run short
                    // (its prompts are long: hits need whole 256-token pages).
                    workload: Workload::Mixed {
                        requests: if ps >= 256 { 3 } else { 14 },
                        max_new: if ps >= 256 { 8 } else { unit as usize },
                        abort_chance: if ps >= 256 { 0.0 } else { 0.02 },
                    },
                    reuse: Reuse::On,
                    budget_tokens: if ps >= 256 { 4 } else { 10 } * u64::from(unit) + 32,
                    max_running: 6,
                    prefill_budget: 4 * unit as usize,
                    fault: Fault::None,
                    host_memory_bytes: 0,
                };
                let label = format!("ps {ps} {} {}", layout.as_str(), model.as_str());
                let (jobs, stats) = serve(&cfg).unwrap_or_else(|e| panic!("{label}: {e}"));
                let (want, _, _) = reference_outputs(&cfg, &jobs);
                let compared = compare(&jobs, &want).unwrap_or_else(|d| panic!("{label}: {d}"));
                stats
                    .resumed_states()
                    .unwrap_or_else(|d| panic!("{label}: {d}"));
                eprintln!("{label}: {compared} requests identical, {stats:?}");
                assert!(compared > 0, "{label}: no request finished");
                assert!(stats.prefix_hits > 0, "{label}: no prefix hit");
                assert!(
                    stats.retractions + stats.evictions > 0,
                    "{label}: no pressure"
                );
                // At page size 256 the short run is too short for these.
                if ps < 256 {
                    // A model without SWA layers has no window to release.
                    if model.spec().swa_layers > 0 {
                        assert!(stats.window_releases > 0, "{label}: no window release");
                    }
                    if layout == Layout::Unified {
                        assert!(stats.compaction_moves > 0, "{label}: no compaction");
                    }
                }
            }
        }
    }
}

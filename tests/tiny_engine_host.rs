//! The host tier on the tiny engine of `examples/tiny_engine` is exact: a short
//! randomized workload under a small device budget (evictions write prefixes back, later
//! admissions load them back) generates, with a host tier, exactly the tokens and final
//! logits of the contiguous reference, and every recurrent state a request resumes from —
//! loaded from the host or not — equals a contiguous recompute of its prefix. FULL + SWA,
//! FULL + Mamba and the tri-pool, both layouts, at the matrix cell's page size (1 and 16
//! without one); and some admission of each loaded a prefix back, so the check cannot
//! pass vacuously. (`tests/tiny_engine.rs` runs the same workload without a host tier.)

#[path = "../examples/tiny_engine/engine.rs"]
mod engine;

use engine::{Fault, Model, Reuse, RunConfig, Workload, compare, reference_outputs, serve};
use unikv::Layout;

/// The matrix cell's page size; 1 and 16 without one.
fn page_sizes() -> Vec<u32> {
    unikv::invariants::testing::matrix_page_size().map_or(vec![1, 16], |ps| vec![ps])
}

#[test]
fn prefixes_loaded_back_from_the_host_serve_exactly_what_a_recompute_does() {
    for ps in page_sizes() {
        // At page size 256 the tri model only, to keep the debug run to seconds.
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
                    seed: 5,
                    page_size: ps,
                    layout,
                    model,
                    workload: Workload::Mixed {
                        requests: if ps >= 256 { 32 } else { 24 },
                        max_new: unit as usize,
                        abort_chance: 0.02,
                    },
                    reuse: Reuse::On,
                    budget_tokens: 10 * u64::from(unit) + 32,
                    max_running: 6,
                    prefill_budget: 4 * unit as usize,
                    fault: Fault::None,
                    host_memory_bytes: 64 << 20,
                };
                let label = format!("ps {ps} {} {}", layout.as_str(), model.as_str());
                let (jobs, stats) = serve(&cfg).unwrap_or_else(|e| panic!("{label}: {e}"));
                let (want, _, _) = reference_outputs(&cfg, &jobs);
                let compared = compare(&jobs, &want).unwrap_or_else(|d| panic!("{label}: {d}"));
                stats
                    .resumed_states()
                    .unwrap_or_else(|d| panic!("{label}: {d}"));
                eprintln!("{label}: {compared} requests identical, {stats:?}");
                assert!(stats.host_hit_tokens > 0, "{label}: nothing loaded back");
            }
        }
    }
}

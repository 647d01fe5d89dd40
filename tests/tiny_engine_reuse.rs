//! Recurrent-state reuse in the tiny engine of `examples/tiny_engine` is exact: for a
//! FULL + Mamba model and the tri-pool, a shared-prefix batch and a multi-turn
//! conversation served with the prefix cache on and off generate the same tokens and
//! final logits, bit for bit, as each other and as the contiguous reference; every state
//! a request resumes from equals, bit for bit, the state a contiguous recompute of its
//! prefix reaches; and with reuse on, states are resumed and fewer prompt tokens are
//! prefilled than admitted (so the checks cannot pass vacuously). Both layouts, at the
//! matrix cell's page size (1, 16 and 256 without one). The last tests break the engine
//! on purpose (a flipped bit in a resumed state, checkpoints never written) and show the
//! checks catch it.

#[path = "../examples/tiny_engine/engine.rs"]
mod engine;

use engine::{
    Fault, Job, Model, Output, Reuse, RunConfig, Workload, check_reuse, compare, compare_runs,
    reference_outputs, serve,
};
use unikv::Layout;

/// Both layouts (the static one with as many SWA tokens as FULL ones).
const LAYOUTS: [Layout; 2] = [
    Layout::Static {
        swa_full_tokens_ratio: 1.0,
    },
    Layout::Unified,
];

/// The matrix cell's page size; 1, 16 and 256 without one.
fn page_sizes() -> Vec<u32> {
    unikv::invariants::testing::matrix_page_size().map_or(vec![1, 16, 256], |ps| vec![ps])
}

/// Serves `workload` for `model` with reuse off and on, both layouts, at every page size;
/// checks every run against the first (reuse off, static) and the reference.
fn check(model: Model, workload: Workload) {
    for ps in page_sizes() {
        let mut baseline: Option<(Vec<Job>, Vec<Output>)> = None;
        for layout in LAYOUTS {
            for reuse in [Reuse::Off, Reuse::On] {
                let cfg = RunConfig::scripted(ps, layout, model, workload, reuse);
                let label = format!(
                    "ps {ps} {} {} {} reuse {}",
                    layout.as_str(),
                    model.as_str(),
                    workload.as_str(),
                    reuse.as_str()
                );
                let (jobs, stats) = serve(&cfg).unwrap_or_else(|e| panic!("{label}: {e}"));
                let (base, want) = baseline.get_or_insert_with(|| {
                    let (want, _, _) = reference_outputs(&cfg, &jobs);
                    (jobs.clone(), want)
                });
                let compared = check_reuse(&cfg, &jobs, &stats, base, want)
                    .unwrap_or_else(|d| panic!("{label}: {d}"));
                eprintln!(
                    "{label}: {compared} requests identical; {} states resumed ({} tokens, \
                     KV hit {}; per job {:?}), {} of {} prompt tokens prefilled",
                    stats.prefix_hits,
                    stats.hit_tokens,
                    stats.kv_hit_tokens,
                    jobs.iter()
                        .map(|j| (j.reused, j.prompt.len()))
                        .collect::<Vec<_>>(),
                    stats.prefill_tokens,
                    stats.prompt_tokens
                );
                assert_eq!(compared, jobs.len(), "{label}: every request finished");
            }
        }
    }
}

#[test]
fn a_shared_prefix_batch_on_full_mamba_resumes_exact_states() {
    check(Model::Mamba, Workload::SharedPrefix);
}

#[test]
fn a_shared_prefix_batch_on_the_tri_pool_resumes_exact_states() {
    check(Model::TriPool, Workload::SharedPrefix);
}

#[test]
fn a_multi_turn_conversation_on_full_mamba_resumes_exact_states() {
    check(Model::Mamba, Workload::MultiTurn);
}

#[test]
fn a_multi_turn_conversation_on_the_tri_pool_resumes_exact_states() {
    check(Model::TriPool, Workload::MultiTurn);
}

/// Serves the shared-prefix batch on the tri-pool (unified, page size 16 in every matrix
/// cell: the checks are the same at every page size, and this one runs in a fraction of
/// a second) with reuse on and `fault`. Returns what the state check says, and what the
/// output check says against a correct run with reuse off.
fn faulty_run(fault: Fault) -> (Result<u64, String>, Result<usize, String>) {
    let (ps, model, workload) = (16, Model::TriPool, Workload::SharedPrefix);
    let off = RunConfig::scripted(ps, Layout::Unified, model, workload, Reuse::Off);
    let (base, _) = serve(&off).unwrap();
    let (want, _, _) = reference_outputs(&off, &base);
    let cfg = RunConfig {
        fault,
        ..RunConfig::scripted(ps, Layout::Unified, model, workload, Reuse::On)
    };
    let (jobs, stats) = serve(&cfg).unwrap();
    let outputs = compare_runs(&base, &jobs).and_then(|_| compare(&jobs, &want));
    (stats.resumed_states(), outputs)
}

#[test]
fn a_flipped_bit_in_a_resumed_state_fails_the_state_check() {
    let (states, _) = faulty_run(Fault::FlipResumedState);
    let diff = states.expect_err("a corrupted resumed state must be caught");
    eprintln!("caught: {diff}");
}

#[test]
fn checkpoints_never_written_fail_both_checks() {
    let (states, outputs) = faulty_run(Fault::SkipCheckpointWrites);
    let diff = states.expect_err("a stale cached state must be caught");
    eprintln!("state check: {diff}");
    let diff = outputs.expect_err("resuming from stale states changes the outputs");
    eprintln!("output check: {diff}");
}

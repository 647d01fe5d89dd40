//! Speculative decoding end to end: the tiny engine of `examples/tiny_engine` drafts with
//! a smaller model (the target's first layer), verifies chains and a draft tree through
//! unikv's verify metadata (allocation, device-side offsets, tree compaction, settlement
//! at once and one step late) and serves conversations whose first turn's decode crosses
//! a checkpoint grid point, with the prefix cache off and on. Every request's generated
//! tokens and final logits equal, bit for bit, the other run's and the contiguous
//! reference's plain greedy decode; every state a request resumes from — the second
//! turn's, inside the first turn's output, which a settlement (or a finish, with a
//! verify in flight or not) left — equals a contiguous recompute of its prefix, bit for
//! bit. FULL + SWA, FULL + Mamba and the tri-pool, both layouts, at the matrix cell's
//! page size (1, 16 and 256 without one). The last test flips a bit of a resumed state
//! and shows the check catches it.

#[path = "../examples/tiny_engine/engine.rs"]
mod engine;

use engine::{
    Counts, Drafting, Fault, Model, Output, Reuse, Rollback, RunConfig, SpecMode, Workload,
    check_speculative_reuse, reference_outputs, serve_speculative, spec_modes,
};
use unikv::Layout;

/// The matrix cell's page size; 1, 16 and 256 without one.
fn page_sizes() -> Vec<u32> {
    unikv::invariants::testing::matrix_page_size().map_or(vec![1, 16, 256], |ps| vec![ps])
}

const LAYOUTS: [Layout; 2] = [
    Layout::Static {
        swa_full_tokens_ratio: 1.0,
    },
    Layout::Unified,
];

/// Every speculative mode for `model`: a chain of 3 and the draft tree, counts on time
/// and late, rolled back by copy and, on a model with recurrent layers, by the engine's
/// replay of logged inputs.
fn modes(model: Model) -> Vec<SpecMode> {
    spec_modes(3, model)
}

/// Serves [`Workload::TurnsAcrossGrid`] for `model` speculatively with reuse off and on,
/// every mode, both layouts, at every page size, and checks each pair.
fn check(model: Model) {
    let (mut accepted, mut drafted, mut resumes) = (0, 0, 0);
    for ps in page_sizes() {
        // Every run of a page size serves the same prompts: one reference decode.
        let mut want: Option<Vec<Output>> = None;
        for layout in LAYOUTS {
            for mode in modes(model) {
                let cfg =
                    RunConfig::scripted(ps, layout, model, Workload::TurnsAcrossGrid, Reuse::Off);
                let label = format!(
                    "ps {ps} {} {} {}",
                    layout.as_str(),
                    model.as_str(),
                    mode.label()
                );
                let (off, off_stats) =
                    serve_speculative(&cfg, mode).unwrap_or_else(|e| panic!("{label}: {e}"));
                let on_cfg = RunConfig {
                    reuse: Reuse::On,
                    ..cfg.clone()
                };
                let (on, on_stats) =
                    serve_speculative(&on_cfg, mode).unwrap_or_else(|e| panic!("{label}: {e}"));
                let want = want.get_or_insert_with(|| reference_outputs(&cfg, &off).0);
                let checked =
                    check_speculative_reuse(&cfg, (&off, &off_stats), (&on, &on_stats), want)
                        .unwrap_or_else(|d| panic!("{label}: {d}"));
                eprintln!(
                    "{label}: {} requests identical with reuse off and on; {checked} resumed \
                     states equal their recompute ({} inside an earlier turn's output), {} of \
                     {} prompt tokens prefilled",
                    on.len(),
                    on_stats.resumed_in_output,
                    on_stats.served.prefill_tokens,
                    on_stats.served.prompt_tokens,
                );
                assert!(on.iter().all(|j| j.finished()), "{label}: every job ran");
                if mode.counts == Counts::Late {
                    assert!(on_stats.late_settles > 0, "{label}: nothing settled late");
                }
                accepted += on_stats.accepted_drafts;
                drafted += on_stats.drafted;
                resumes += checked;
            }
        }
    }
    // Some drafts are accepted and some rejected, so both paths run.
    assert!(
        accepted > 0 && accepted < drafted,
        "{accepted} of {drafted} drafts accepted"
    );
    assert_eq!(
        resumes > 0,
        model.is_recurrent(),
        "{resumes} resumed states checked"
    );
}

#[test]
fn speculative_turns_on_full_swa_match_plain_decoding_with_reuse_off_and_on() {
    check(Model::Swa);
}

#[test]
fn speculative_turns_on_full_mamba_resume_exact_states() {
    check(Model::Mamba);
}

#[test]
fn speculative_turns_on_the_tri_pool_resume_exact_states() {
    check(Model::TriPool);
}

#[test]
fn a_flipped_bit_in_a_state_resumed_after_a_speculative_turn_fails_the_state_check() {
    for rollback in [Rollback::Copy, Rollback::Replay] {
        let mode = SpecMode {
            drafting: Drafting::Chain { k: 3 },
            counts: Counts::Late,
            rollback,
        };
        let (ps, model, workload) = (16, Model::TriPool, Workload::TurnsAcrossGrid);
        let off = RunConfig::scripted(ps, Layout::Unified, model, workload, Reuse::Off);
        let (base, base_stats) = serve_speculative(&off, mode).unwrap();
        let (want, _, _) = reference_outputs(&off, &base);
        let cfg = RunConfig {
            fault: Fault::FlipResumedState,
            ..RunConfig::scripted(ps, Layout::Unified, model, workload, Reuse::On)
        };
        let (jobs, stats) = serve_speculative(&cfg, mode).unwrap();
        assert!(stats.resumed_in_output > 0, "{rollback:?}: {stats:?}");
        let diff = stats
            .served
            .resumed_states()
            .expect_err("a corrupted resumed state must be caught");
        eprintln!("{rollback:?}: caught: {diff}");
        check_speculative_reuse(&cfg, (&base, &base_stats), (&jobs, &stats), &want)
            .expect_err("the speculative check reports it");
    }
}

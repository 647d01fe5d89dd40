//! Speculative decoding end to end: the tiny engine of `examples/tiny_engine` drafts with
//! a smaller model (the target's first layer), verifies chains and a draft tree through
//! unikv's verify metadata (allocation, device-side offsets, tree compaction, settlement
//! at once and one step late), and every request's generated tokens and final logits
//! equal, bit for bit, the contiguous reference's plain greedy decode. At the matrix
//! cell's page size (1 and 16 without one), both layouts, FULL + SWA, FULL + Mamba and
//! the tri-pool (the tri-pool only at page size 256), on the shared-prefix workload (prefix hits under speculation).

#[path = "../examples/tiny_engine/engine.rs"]
mod engine;

use engine::{
    Counts, Drafting, Model, Reuse, RunConfig, SpecMode, Workload, compare, reference_outputs,
    serve_speculative,
};
use unikv::Layout;

/// The matrix cell's page size; 1 and 16 without one.
fn page_sizes() -> Vec<u32> {
    unikv::invariants::testing::matrix_page_size().map_or(vec![1, 16], |ps| vec![ps])
}

const LAYOUTS: [Layout; 2] = [
    Layout::Static {
        swa_full_tokens_ratio: 1.0,
    },
    Layout::Unified,
];

#[test]
fn speculative_decoding_generates_exactly_what_plain_decoding_does() {
    let (mut accepted, mut drafted) = (0, 0);
    for ps in page_sizes() {
        // At page size 256 (long prompts) only the tri-pool, to keep the debug run short.
        let models: &[Model] = if ps >= 256 {
            &[Model::TriPool]
        } else {
            &Model::ALL
        };
        for &model in models {
            for layout in LAYOUTS {
                for drafting in [Drafting::Chain { k: 3 }, Drafting::Tree] {
                    for counts in [Counts::Timely, Counts::Late] {
                        let mode = SpecMode { drafting, counts };
                        let cfg = RunConfig::scripted(
                            ps,
                            layout,
                            model,
                            Workload::SharedPrefix,
                            Reuse::On,
                        );
                        let label = format!(
                            "ps {ps} {} {} {}",
                            layout.as_str(),
                            model.as_str(),
                            mode.label()
                        );
                        let (jobs, stats) = serve_speculative(&cfg, mode)
                            .unwrap_or_else(|e| panic!("{label}: {e}"));
                        let (want, _, _) = reference_outputs(&cfg, &jobs);
                        let compared =
                            compare(&jobs, &want).unwrap_or_else(|d| panic!("{label}: {d}"));
                        assert_eq!(compared, jobs.len(), "{label}: every job ran");
                        accepted += stats.accepted_drafts;
                        drafted += stats.drafted;
                        if counts == Counts::Late {
                            assert!(stats.late_settles > 0, "{label}: nothing settled late");
                        }
                    }
                }
            }
        }
    }
    // Some drafts are accepted and some rejected, so both paths run.
    assert!(
        accepted > 0 && accepted < drafted,
        "{accepted} of {drafted} drafts accepted"
    );
}

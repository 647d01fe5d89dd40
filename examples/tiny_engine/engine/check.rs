//! The checks: a run against the reference, two runs against each other, and a resumed
//! recurrent state against a contiguous recompute of its prefix. The run-level reuse
//! checks build on them beside their runs (`serve::check_reuse`,
//! `speculative::check_speculative_reuse`).

use super::model::{States, Weights};
use super::reference::reference_state;
use super::workload::{Job, Output};
use unikv::TokenId;

/// Compares a resumed state with the state a contiguous recompute of `prefix` reaches,
/// bit for bit.
pub(super) fn check_resumed_state(
    w: &Weights,
    prefix: &[TokenId],
    resumed: &States,
) -> Result<(), String> {
    let want = reference_state(w, prefix);
    let bits = |s: &States| {
        s.iter()
            .flatten()
            .map(|x| x.to_bits())
            .collect::<Vec<u32>>()
    };
    let (got, want) = (bits(resumed), bits(&want));
    match got.iter().zip(&want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "the state resumed after {} tokens differs from the recompute at float {i}: \
             {:#010x} vs {:#010x}",
            prefix.len(),
            got[i],
            want[i]
        )),
    }
}

/// Compares every job with the reference: a finished job's tokens and final logits bit
/// for bit, an aborted one's tokens as a prefix. Returns the first difference.
pub fn compare(jobs: &[Job], reference: &[Output]) -> Result<usize, String> {
    let mut compared = 0;
    for (i, (job, want)) in jobs.iter().zip(reference).enumerate() {
        let got = &job.output;
        if job.aborted {
            if !want.tokens.starts_with(&got.tokens) {
                return Err(format!(
                    "aborted request {i}: generated {:?}, the reference {:?}",
                    got.tokens, want.tokens
                ));
            }
            continue;
        }
        if got.tokens != want.tokens {
            return Err(format!(
                "request {i} (prompt of {} tokens): generated {:?}, the reference {:?}",
                job.prompt.len(),
                got.tokens,
                want.tokens
            ));
        }
        if bits(&got.logits) != bits(&want.logits) {
            return Err(format!(
                "request {i}: final logits differ: {:?} vs the reference {:?}",
                &got.logits[..4.min(got.logits.len())],
                &want.logits[..4.min(want.logits.len())]
            ));
        }
        compared += 1;
    }
    Ok(compared)
}

/// Compares two runs of one workload (reuse on and off, two layouts): the same jobs with
/// the same prompts, each aborted in both or in neither, with identical generated tokens
/// and final logits, bit for bit. Returns the jobs compared or the first difference.
pub fn compare_runs(a: &[Job], b: &[Job]) -> Result<usize, String> {
    if a.len() != b.len() {
        return Err(format!("{} jobs against {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x.prompt != y.prompt {
            return Err(format!(
                "job {i}: prompts of {} and {} tokens differ",
                x.prompt.len(),
                y.prompt.len()
            ));
        }
        if x.aborted != y.aborted {
            return Err(format!("job {i}: aborted in one run only"));
        }
        if x.output.tokens != y.output.tokens {
            return Err(format!(
                "job {i}: generated {:?} against {:?}",
                x.output.tokens, y.output.tokens
            ));
        }
        if bits(&x.output.logits) != bits(&y.output.logits) {
            return Err(format!("job {i}: final logits differ"));
        }
    }
    Ok(a.len())
}

/// The bit patterns of `l`.
fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|x| x.to_bits()).collect()
}

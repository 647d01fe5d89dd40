//! The checks: a run against the reference, two runs against each other, a resumed
//! recurrent state against a contiguous recompute of its prefix, and reuse happening
//! exactly when it is on, for plain and speculative serving.

use super::model::{States, Weights};
use super::reference::{Output, reference_state};
use super::serve::{Reuse, RunConfig, RunStats};
use super::spec::SpecStats;
use super::workload::{Job, Workload};
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

/// Checks one run of a scripted reuse workload against `baseline`, a run of the same
/// workload (reuse off, say) whose outputs equal `reference`: the same jobs with the same
/// prompts and bit-identical outputs, equal to the reference; every state a request
/// resumed from equal, bit for bit, to a contiguous recompute of its prefix; and reuse
/// happened exactly when it is on (on: states resumed, fewer prompt tokens prefilled
/// than admitted; off: not one token hit), so the check cannot pass vacuously. Returns
/// the jobs compared.
pub fn check_reuse(
    cfg: &RunConfig,
    jobs: &[Job],
    stats: &RunStats,
    baseline: &[Job],
    reference: &[Output],
) -> Result<usize, String> {
    let resumed = stats.resumed_states()?;
    compare_runs(baseline, jobs)?;
    let compared = compare(jobs, reference)?;
    match cfg.reuse {
        Reuse::On => {
            if stats.prefix_hits == 0 {
                return Err("reuse on, but no request hit the prefix cache".into());
            }
            if cfg.model.is_recurrent() && resumed + stats.resumes_retracted != stats.prefix_hits {
                return Err(format!(
                    "{} hits but {resumed} resumed states checked ({} retracted first)",
                    stats.prefix_hits, stats.resumes_retracted
                ));
            }
            if stats.prefill_tokens >= stats.prompt_tokens {
                return Err(format!(
                    "reuse on, but {} of {} prompt tokens were prefilled",
                    stats.prefill_tokens, stats.prompt_tokens
                ));
            }
        }
        Reuse::Off => {
            // (A request retracted mid-prefill is admitted again, so its prompt counts
            // twice while only part of it was prefilled the first time.)
            if stats.prefix_hits > 0 || stats.kv_hit_tokens > 0 {
                return Err(format!(
                    "reuse off, but {} hits ({} tokens of KV)",
                    stats.prefix_hits, stats.kv_hit_tokens
                ));
            }
        }
    }
    Ok(compared)
}

/// Checks two speculative runs of `cfg`'s workload (its `reuse` aside), `off` with reuse
/// off and `on` with reuse on, against each other and `reference`, the plain greedy
/// decode: [`check_reuse`] for each (the same jobs with bit-identical outputs, equal to
/// the reference; every resumed state equal to a recompute of its prefix; reuse exactly
/// when on). On a recurrent model with reuse on, every hit resumed a state, and on
/// [`Workload::TurnsAcrossGrid`] some of them lie inside an earlier turn's output (a
/// speculative turn left them), so the check cannot pass on prompt states alone.
/// Returns the resumed states checked.
pub fn check_speculative_reuse(
    cfg: &RunConfig,
    off: (&[Job], &SpecStats),
    on: (&[Job], &SpecStats),
    reference: &[Output],
) -> Result<u64, String> {
    let with = |reuse| RunConfig {
        reuse,
        ..cfg.clone()
    };
    check_reuse(&with(Reuse::Off), off.0, &off.1.served, off.0, reference)
        .map_err(|d| format!("reuse off: {d}"))?;
    check_reuse(&with(Reuse::On), on.0, &on.1.served, off.0, reference)
        .map_err(|d| format!("reuse on: {d}"))?;
    let stats = on.1;
    if cfg.model.is_recurrent()
        && cfg.workload == Workload::TurnsAcrossGrid
        && stats.resumed_in_output == 0
    {
        return Err(format!(
            "reuse on, but none of {} resumed states lies inside an earlier turn's output",
            stats.served.resumes_checked
        ));
    }
    Ok(stats.served.resumes_checked)
}

/// The bit patterns of `l`.
fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|x| x.to_bits()).collect()
}

//! `cargo run --release --example tiny_engine`: a tiny hybrid decoder (FULL and SWA
//! attention layers, a recurrent layer) served through unikv with every K/V row and
//! state in unikv's buffer, against a reference with contiguous K/V. For page sizes 1,
//! 16 and 256, static and unified, with and without the recurrent layer, it prints both
//! implementations' tokens/s, what the serving run went through (compaction moves,
//! prefix hits, window releases, evictions, retractions, aborts) and whether every
//! request's generated tokens and final logits are identical. Exit status 1 when any
//! output differs.

mod engine;

use engine::{RunConfig, compare, reference_outputs, serve};
use unikv::Layout;

fn main() {
    if let Err(e) = unikv::init() {
        eprintln!("tiny_engine: {e}");
        std::process::exit(2);
    }
    let mut all_identical = true;
    for ps in [1u32, 16, 256] {
        println!("page size {ps}");
        for recurrent in [false, true] {
            for layout in [
                Layout::Static {
                    swa_full_tokens_ratio: 1.0,
                },
                Layout::Unified,
            ] {
                let cfg = RunConfig {
                    seed: 7,
                    page_size: ps,
                    layout,
                    recurrent,
                    requests: 48,
                    budget_tokens: 12 * u64::from(ps.max(16)) + 64,
                    max_running: 8,
                    prefill_budget: 4 * ps.max(16) as usize,
                    max_new: ps.max(16) as usize,
                    abort_chance: 0.02,
                };
                let (jobs, stats) = match serve(&cfg) {
                    Ok(run) => run,
                    Err(e) => {
                        eprintln!("tiny_engine: page size {ps} {}: {e}", layout.as_str());
                        std::process::exit(1);
                    }
                };
                let (want, ref_time, ref_tokens) = reference_outputs(&cfg, &jobs);
                let verdict = compare(&jobs, &want);
                let model = if recurrent {
                    "full+swa+rec"
                } else {
                    "full+swa"
                };
                println!(
                    "  {model:<12} {:<7} unikv {:>9.0} tok/s  reference {:>9.0} tok/s  \
                     compaction moves {:>4}  prefix hits {:>3}  window releases {:>4}  \
                     evictions {:>3}  retractions {:>3}  aborts {:>2}  requests {:>3}",
                    layout.as_str(),
                    stats.computed_tokens as f64 / stats.elapsed.as_secs_f64(),
                    ref_tokens as f64 / ref_time.as_secs_f64(),
                    stats.compaction_moves,
                    stats.prefix_hits,
                    stats.window_releases,
                    stats.evictions,
                    stats.retractions,
                    stats.aborts,
                    jobs.len(),
                );
                if let Err(diff) = verdict {
                    println!("    DIFFERS: {diff}");
                    all_identical = false;
                }
            }
        }
    }
    println!(
        "outputs identical: {}",
        if all_identical { "yes" } else { "no" }
    );
    if !all_identical {
        std::process::exit(1);
    }
}

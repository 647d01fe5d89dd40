//! `cargo run --release --example tiny_engine`: a tiny hybrid decoder served through unikv
//! with every K/V row and recurrent state in unikv's buffer, against a reference with
//! contiguous K/V. For page sizes 1, 16 and 256, static and unified:
//!
//! - the mixed workload (shared system prompts, random follow-ups, aborts, a small budget)
//!   on FULL + SWA, FULL + Mamba and the tri-pool, with reuse on;
//! - the shared-prefix batch and the multi-turn conversation on FULL + Mamba and the
//!   tri-pool, with reuse off and on: each run against the first (reuse off, static) and
//!   the reference, and every resumed state against a contiguous recompute of its prefix.
//!
//! `cargo run --release --example tiny_engine -- --spec K` decodes speculatively instead:
//! a draft model (the target's first layer) proposes chains of `K` tokens and the draft
//! tree `TREE`, the target verifies them through unikv's verify metadata, and the counts
//! settle at once or one step late — for the three models at page sizes 1, 16 and 256,
//! both layouts, on the shared-prefix batch and on conversations whose first turn's
//! decode crosses a checkpoint grid point (so the second turn resumes from a state the
//! speculative turn left), each with reuse off and on. Each row gives the acceptance
//! rate, the tokens a verify gains, and the resumed states checked (those inside an
//! earlier request's output apart); every request's output must be the other run's and
//! the reference's plain greedy decode, token for token and bit for bit, and every
//! resumed state its recompute.
//!
//! Each row gives both implementations' tokens/s, the states (or prefixes) resumed and
//! the prompt tokens they reused, and what the run went through (compaction moves,
//! window releases, evictions, retractions, aborts). It ends with `outputs identical:
//! yes` when every request's generated tokens and final logits are identical and every
//! resumed state equals its recompute; exit status 1 otherwise.

mod engine;

use engine::{
    Fault, Job, Model, Reuse, RunConfig, RunStats, SpecMode, SpecStats, Workload, check_reuse,
    check_speculative_reuse, compare, reference_outputs, serve, serve_speculative, spec_modes,
};
use std::time::Duration;
use unikv::Layout;

/// Both layouts (the static one with as many SWA tokens as FULL ones).
const LAYOUTS: [Layout; 2] = [
    Layout::Static {
        swa_full_tokens_ratio: 1.0,
    },
    Layout::Unified,
];

/// Runs every cell, prints its row, and the verdict.
/// What `tiny_engine --help` prints.
const HELP: &str = "\
tiny_engine: a tiny hybrid decoder served through unikv against a contiguous-K/V
reference, for page sizes 1, 16 and 256, static and unified; exit status 0 when every
output is identical and every resumed state equals its recompute, 1 otherwise, 2 on
bad arguments.

Usage: cargo run --release --example tiny_engine [-- --spec K | --host-memory]

Options:
  --spec K        decode speculatively: a draft model proposes chains of K tokens (1 to 8)
                  and a draft tree, the target verifies them through unikv's verify metadata
  --host-memory   the mixed workload with a 64 MiB host tier: evicted prefixes are written
                  back to host memory and loaded back by the admissions that match them
  -h, --help  print this help

Environment:
  UNIKV_INVARIANT_CHECK   off|warn|strict|0|1|2";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The help first, whatever the environment holds: it says what it should hold.
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{HELP}");
        return;
    }
    if let Err(e) = unikv::init() {
        eprintln!("tiny_engine: {e}");
        std::process::exit(2);
    }
    let all_identical = match args.as_slice() {
        [] => plain(0),
        [flag] if flag == "--host-memory" => plain(HOST_MEMORY_BYTES),
        [flag, k] if flag == "--spec" => match k.parse::<usize>() {
            Ok(k) if (1..=8).contains(&k) => speculative(k),
            _ => usage(&format!(
                "--spec takes a draft length of 1 ..= 8, not {k:?}"
            )),
        },
        _ => usage(&format!("unexpected arguments {args:?}")),
    };
    println!(
        "outputs identical: {}",
        if all_identical { "yes" } else { "no" }
    );
    if !all_identical {
        std::process::exit(1);
    }
}

/// The usage line and status 2.
fn usage(error: &str) -> ! {
    eprintln!(
        "tiny_engine: {error}\nusage: tiny_engine [--spec K | --host-memory] (try `tiny_engine --help`)"
    );
    std::process::exit(2);
}

/// The speculative matrix; whether every output was identical and every resumed state
/// equal to its recompute.
fn speculative(k: usize) -> bool {
    let mut all_identical = true;
    let (mut resumes, mut in_output) = (0u64, 0u64);
    for ps in [1u32, 16, 256] {
        println!("page size {ps}");
        for workload in [Workload::SharedPrefix, Workload::TurnsAcrossGrid] {
            for model in Model::ALL {
                for layout in LAYOUTS {
                    for mode in spec_modes(k, model) {
                        let cfg = RunConfig::scripted(ps, layout, model, workload, Reuse::Off);
                        let (off, off_stats) = serve_speculative_or_exit(&cfg, mode);
                        let on_cfg = RunConfig {
                            reuse: Reuse::On,
                            ..cfg.clone()
                        };
                        let (on, stats) = serve_speculative_or_exit(&on_cfg, mode);
                        let (want, _, _) = reference_outputs(&cfg, &off);
                        let verdict =
                            check_speculative_reuse(&cfg, (&off, &off_stats), (&on, &stats), &want);
                        let served = &stats.served;
                        println!(
                            "  {:<13} {:<12} {:<7} {:<14} acceptance {:>5.1} %  \
                                 tokens/verify {:>4.2}  verifies {:>3}  settled late {:>3}  \
                                 finished mid-verify {:>2}  hits {:>2}  reused {:>4} of {:>4} \
                                 prompt tokens  resumes checked {:>2} ({:>2} in an output)  \
                                 requests {:>2}",
                            workload.as_str(),
                            model.as_str(),
                            layout.as_str(),
                            mode.label(),
                            100.0 * stats.acceptance(),
                            stats.tokens_per_verify(),
                            stats.verifies,
                            stats.late_settles,
                            stats.finished_mid_verify,
                            served.prefix_hits,
                            served.hit_tokens,
                            served.prompt_tokens,
                            served.resumes_checked,
                            stats.resumed_in_output,
                            on.len(),
                        );
                        resumes += served.resumes_checked;
                        in_output += stats.resumed_in_output;
                        all_identical &= report(verdict.map(|n| n as usize));
                    }
                }
            }
        }
    }
    println!(
        "resumed states checked: {resumes} ({in_output} inside an earlier request's output), \
         every one equal to its recompute: {}",
        if all_identical { "yes" } else { "no" }
    );
    all_identical
}

/// Serves `cfg` speculatively, or exits with status 1 when the cache refuses.
fn serve_speculative_or_exit(cfg: &RunConfig, mode: SpecMode) -> (Vec<Job>, SpecStats) {
    serve_speculative(cfg, mode).unwrap_or_else(|e| {
        eprintln!(
            "tiny_engine: page size {} {} {} {} {} reuse {}: {e}",
            cfg.page_size,
            cfg.layout.as_str(),
            cfg.model.as_str(),
            cfg.workload.as_str(),
            mode.label(),
            cfg.reuse.as_str()
        );
        std::process::exit(1);
    })
}

/// The host tier `--host-memory` gives each cache: far more than the small budget's
/// device memory, so evicted prefixes stay on the host.
const HOST_MEMORY_BYTES: u64 = 64 << 20;

/// The plain matrix, with a host tier of `host` bytes (0: none); whether every output
/// was identical (and, with a host tier, some admission loaded a prefix back).
fn plain(host: u64) -> bool {
    let mut all_identical = true;
    let mut host_hits = 0;
    for ps in [1u32, 16, 256] {
        println!("page size {ps}");
        for model in Model::ALL {
            for layout in LAYOUTS {
                let unit = ps.max(16);
                let cfg = RunConfig {
                    seed: 7,
                    page_size: ps,
                    layout,
                    model,
                    workload: Workload::Mixed {
                        requests: 48,
                        max_new: unit as usize,
                        abort_chance: 0.02,
                    },
                    reuse: Reuse::On,
                    budget_tokens: 12 * u64::from(unit) + 64,
                    max_running: 8,
                    prefill_budget: 4 * unit as usize,
                    fault: Fault::None,
                    host_memory_bytes: host,
                };
                let (jobs, stats) = serve_or_exit(&cfg);
                let (want, ref_time, ref_tokens) = reference_outputs(&cfg, &jobs);
                let verdict = compare(&jobs, &want).and_then(|n| stats.resumed_states().map(|_| n));
                print_row(&cfg, &jobs, &stats, ref_time, ref_tokens);
                all_identical &= report(verdict);
                host_hits += stats.host_hit_tokens;
            }
        }
        for workload in [Workload::SharedPrefix, Workload::MultiTurn] {
            for model in Model::RECURRENT {
                let mut baseline: Option<Vec<Job>> = None;
                for layout in LAYOUTS {
                    for reuse in [Reuse::Off, Reuse::On] {
                        let cfg = RunConfig {
                            host_memory_bytes: host,
                            ..RunConfig::scripted(ps, layout, model, workload, reuse)
                        };
                        let (jobs, stats) = serve_or_exit(&cfg);
                        let (want, ref_time, ref_tokens) = reference_outputs(&cfg, &jobs);
                        let base = baseline.get_or_insert_with(|| jobs.clone());
                        let verdict = check_reuse(&cfg, &jobs, &stats, base, &want);
                        print_row(&cfg, &jobs, &stats, ref_time, ref_tokens);
                        all_identical &= report(verdict);
                    }
                }
            }
        }
    }
    if host > 0 {
        println!("tokens loaded back from the host tier: {host_hits}");
        all_identical &= report(if host_hits > 0 {
            Ok(0)
        } else {
            Err("no admission loaded a prefix back from the host tier".into())
        });
    }
    all_identical
}

/// Serves `cfg`, or exits with status 1 when the cache refuses.
fn serve_or_exit(cfg: &RunConfig) -> (Vec<Job>, RunStats) {
    serve(cfg).unwrap_or_else(|e| {
        eprintln!(
            "tiny_engine: page size {} {} {} {}: {e}",
            cfg.page_size,
            cfg.layout.as_str(),
            cfg.model.as_str(),
            cfg.workload.as_str()
        );
        std::process::exit(1);
    })
}

/// One row of the table.
fn print_row(cfg: &RunConfig, jobs: &[Job], stats: &RunStats, ref_time: Duration, ref_tokens: u64) {
    println!(
        "  {:<12} {:<7} {:<13} reuse {:<3}  unikv {:>8.0} tok/s  reference {:>8.0} tok/s  \
         hits {:>3}  reused {:>5} of {:>5} prompt tokens (KV hit {:>5}, from the host {:>5})  \
         compaction moves {:>4}  window releases {:>4}  evictions {:>3}  retractions {:>3}  \
         aborts {:>2}  requests {:>3}",
        cfg.model.as_str(),
        cfg.layout.as_str(),
        cfg.workload.as_str(),
        cfg.reuse.as_str(),
        stats.computed_tokens as f64 / stats.elapsed.as_secs_f64(),
        ref_tokens as f64 / ref_time.as_secs_f64(),
        stats.prefix_hits,
        stats.hit_tokens,
        stats.prompt_tokens,
        stats.kv_hit_tokens,
        stats.host_hit_tokens,
        stats.compaction_moves,
        stats.window_releases,
        stats.evictions,
        stats.retractions,
        stats.aborts,
        jobs.len(),
    );
}

/// Prints a difference under its row; whether there was none.
fn report(verdict: Result<usize, String>) -> bool {
    match verdict {
        Ok(_) => true,
        Err(diff) => {
            println!("    DIFFERS: {diff}");
            false
        }
    }
}

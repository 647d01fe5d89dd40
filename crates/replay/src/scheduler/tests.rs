//! The scheduler's runs end to end: every request finishes with no sync, violation or
//! leak on both layouts, prefix hits, determinism, retraction under memory pressure, an
//! impossible budget, chat turns, a recurrent model's recomputation, speculative runs and
//! the pages-handled counter.

use super::*;

use crate::config::{Backend, LAYOUTS};
use crate::speculative::SpecMode;
use unikv::Layout;
use unikv_invariants::Level;
use unikv_workload::Preset;

fn smoke(layout: Layout, page_size: u32, memory_bytes: u64) -> Result<RunStats, ReplayError> {
    let config = RunConfig::new(ModelSpec::GPT_OSS_20B, layout, page_size, memory_bytes);
    run(&Preset::Smoke.build(3), &config, (), &|_| {})
}

#[test]
fn every_request_finishes_with_no_sync_violation_or_leak() {
    for layout in LAYOUTS {
        for ps in unikv_invariants::testing::page_sizes() {
            let stats = smoke(layout, ps, 1 << 30).unwrap();
            assert_eq!(
                stats.requests_completed, stats.requests_total,
                "{layout} ps {ps}"
            );
            assert_eq!(
                (
                    stats.host_syncs,
                    stats.invariant_violations,
                    stats.leaked_pages
                ),
                (0, 0, 0)
            );
            assert!(stats.steps > 0 && stats.step_cpu_ns.len() as u64 == stats.steps);
            assert!(
                stats.peak_bytes_by_subpool["full"] > 0 && stats.peak_bytes_by_subpool["swa"] > 0
            );
            assert!(!stats.samples.is_empty());
        }
    }
}

#[test]
fn a_shared_prefix_is_a_hit_once_it_is_cached() {
    let stats = smoke(Layout::Unified, 1, 1 << 30).unwrap();
    assert!(stats.prefix_hit_tokens > 0, "{stats:?}");
    // gpt-oss resumes wherever its KV hit ends (its window is live there).
    assert_eq!(stats.kv_hit_tokens, stats.prefix_hit_tokens);
    assert_eq!(stats.recomputed_tokens, 0);
    assert!(stats.mamba.is_none());
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let strip = |mut s: RunStats| {
        s.step_cpu_ns.clear();
        s.step_with_metadata_cpu_ns.clear();
        s
    };
    for layout in LAYOUTS {
        let a = strip(smoke(layout, 4, 1 << 30).unwrap());
        let b = strip(smoke(layout, 4, 1 << 30).unwrap());
        assert_eq!(a, b);
    }
}

#[test]
fn memory_pressure_retracts_and_still_finishes_everything() {
    // Enough for a few requests at once, not for the whole batch.
    let stats = smoke(LAYOUTS[0], 4, 48 << 20).unwrap();
    assert_eq!(stats.requests_completed, stats.requests_total);
    assert_eq!(stats.leaked_pages, 0);
}

#[test]
fn an_impossible_budget_is_a_clear_error_not_a_hang() {
    for budget in [1 << 20, 8 << 20] {
        let err = smoke(Layout::Unified, 4, budget).unwrap_err();
        assert!(matches!(err, ReplayError::BudgetTooSmall { .. }), "{err:?}");
        assert!(err.to_string().contains("cannot run it"), "{err}");
    }
}

/// A request that is admitted (its reserve is clipped) but cannot decode to its end
/// alone is refused with its whole size, not the rows it held when memory ran out.
#[test]
fn a_request_too_large_to_finish_alone_is_refused_with_its_whole_size() {
    let model = ModelSpec::GPT_OSS_20B;
    let per_token = model.full_bytes_per_token() + model.swa_bytes_per_token();
    let workload = unikv_workload::Workload {
        name: "one long request".into(),
        concurrency: 1,
        requests: vec![unikv_workload::RequestSpec {
            id: 0,
            arrival_step: 0,
            prompt: (0..1_000).collect(),
            output_len: 200_000,
            after: Vec::new(),
            output: None,
        }],
    };
    // Room for the prompt and the clipped reserve, far from 201,000 tokens.
    let config = RunConfig::new(model, Layout::Unified, 16, per_token * 20_000);
    let err = run(&workload, &config, (), &|_| {}).unwrap_err();
    assert!(matches!(err, ReplayError::BudgetTooSmall { .. }), "{err:?}");
    assert!(
        err.to_string().contains("one request of 201000 tokens"),
        "{err}"
    );
}

/// A run reports its own cache's breaches only: another scope of the process (another
/// cache, another rank) breaching at every step of the run does not show in it.
#[test]
fn a_run_counts_only_its_own_caches_breaches() {
    let other = unikv::invariants::Scope::new();
    let config = RunConfig::new(ModelSpec::GPT_OSS_20B, Layout::Unified, 16, 1 << 30);
    let stats = unikv_invariants::scoped_level(Level::Warn, || {
        run(&Preset::Smoke.build(3), &config, (), &|_| {
            other.expect(&unikv::pools::invariants::DOUBLE_FREE, false, || {
                "another cache's breach".into()
            });
        })
    })
    .unwrap();
    assert!(other.violations(&unikv::pools::invariants::DOUBLE_FREE) > 0);
    assert_eq!(stats.invariant_violations, 0);
}

/// Two clients, each with a one-turn and a three-turn conversation: prompts of 40
/// new tokens (after the history), 24 output tokens a turn.
fn small_chat() -> Workload {
    let shape = unikv_workload::workload::ChatShape {
        clients: 2,
        turns: &[1, 3],
        user_tokens: 40,
        output_tokens: 24,
    };
    shape.build(
        "chat",
        unikv_workload::workload::TokenSource::new(5, "chat"),
    )
}

fn chat_run(model: ModelSpec, page_size: u32) -> RunStats {
    let mut config = RunConfig::new(model, Layout::Unified, page_size, 16 << 30);
    config.backend = Backend::None;
    run(&small_chat(), &config, (), &|_| {}).unwrap()
}

/// A turn arrives the step after the one before it finished: each of a client's four
/// turns takes 24 steps (a prefill that samples the first token, 23 decodes), one
/// after another.
#[test]
fn a_next_turn_arrives_once_the_last_one_finished() {
    let stats = chat_run(ModelSpec::GPT_OSS_20B, 1);
    assert_eq!(stats.requests_completed, 8);
    assert_eq!(stats.peak_admitted, 2);
    assert_eq!(stats.steps, 4 * 24);
}

/// A request released by several others arrives the step after the last of them
/// finished, whichever order they finish in: two requests decoding 30 and 10 tokens
/// (a step for the prefill that samples the first, one for each other), then one of 5
/// after both: 30 + 5 steps, in either order of the two.
#[test]
fn a_request_after_several_arrives_once_the_last_of_them_finished() {
    for outputs in [[30, 10], [10, 30]] {
        let request = |id: u32, output_len: u32, after: Vec<u32>| unikv_workload::RequestSpec {
            id,
            arrival_step: 0,
            prompt: (id * 100..id * 100 + 8).collect(),
            output_len,
            after,
            output: None,
        };
        let workload = Workload {
            name: "after two".into(),
            concurrency: 3,
            requests: vec![
                request(0, outputs[0], Vec::new()),
                request(1, outputs[1], Vec::new()),
                request(2, 5, vec![0, 1]),
            ],
        };
        workload.validate().unwrap();
        let mut config = RunConfig::new(ModelSpec::GPT_OSS_20B, Layout::Unified, 1, 1 << 30);
        config.backend = Backend::None;
        let stats = run(&workload, &config, (), &|_| {}).unwrap();
        assert_eq!(stats.requests_completed, 3);
        assert_eq!(stats.steps, 30 + 5, "outputs {outputs:?}");
    }
}

/// The scheduler generates exactly the outputs the workload fixed, so a next turn's
/// prompt finds the whole last turn cached: its prompt and the 23 output tokens fed
/// back (the 24th was sampled last and has no KV). The three-turn conversations' turns
/// 2 and 3 (prompts of 104 and 168 tokens, after 40 and 104) hit 63 and 127 tokens,
/// for each of the two clients; at page size 1 every hit ends where a state is cached
/// (the running state enters the tree with its finished request), so nothing is
/// recomputed.
#[test]
fn a_next_turn_reuses_the_whole_last_turn_at_page_size_1() {
    for model in [ModelSpec::GPT_OSS_20B, ModelSpec::QWEN3_NEXT_80B_A3B] {
        let stats = chat_run(model, 1);
        let hit = 2 * (63 + 127);
        assert_eq!(stats.prompt_tokens, 2 * (40 + 40 + 104 + 168), "{model}");
        assert_eq!(
            (
                stats.kv_hit_tokens,
                stats.prefix_hit_tokens,
                stats.recomputed_tokens
            ),
            (hit, hit, 0),
            "{model}"
        );
        match stats.mamba {
            Some(m) => {
                assert_eq!(m.recurrent_hit_tokens, hit);
                assert!(m.peak_checkpoint_slots > 0 && m.peak_checkpoint_slots < m.peak_slots);
            }
            None => assert!(!model.has_recurrent_state()),
        }
    }
}

/// At page size 16 the KV hit ends on the last whole page (48 and 112 tokens) while
/// the deepest state a recurrent model cached is its last prompt's end (32 and 96: a
/// finished request's running state is cached only when its rows end a page, and no
/// grid point lies below 256), so it recomputes 16 tokens a turn; the report says so.
#[test]
fn the_report_counts_what_a_recurrent_model_recomputes() {
    let stats = chat_run(ModelSpec::QWEN3_NEXT_80B_A3B, 16);
    let mamba = stats.mamba.unwrap();
    assert_eq!(stats.kv_hit_tokens, 2 * (48 + 112));
    assert_eq!(mamba.recurrent_hit_tokens, 2 * (32 + 96));
    assert_eq!(stats.prefix_hit_tokens, mamba.recurrent_hit_tokens);
    assert_eq!(stats.recomputed_tokens, 2 * (16 + 16));
    // A model without recurrent state resumes where its KV hit ends.
    let plain = chat_run(ModelSpec::GPT_OSS_20B, 16);
    assert_eq!(
        (
            plain.kv_hit_tokens,
            plain.prefix_hit_tokens,
            plain.recomputed_tokens
        ),
        (2 * (48 + 112), 2 * (48 + 112), 0)
    );
    assert!(plain.mamba.is_none());
}

/// Chain, tree and late speculation on both layouts and the test page sizes, for a
/// FULL+SWA model and a recurrent one: every request finishes with no sync, violation
/// or leak, every verify step accepts at least its first position and at most its
/// width, and fewer steps are needed than decoding one token per step.
#[test]
fn speculative_runs_finish_clean_on_every_layout_and_page_size() {
    let modes = [
        SpecMode::chain(4).unwrap(),
        SpecMode::tree(6).unwrap(),
        SpecMode::chain(4).unwrap().late(),
        SpecMode::tree(6).unwrap().late(),
    ];
    for model in [ModelSpec::GPT_OSS_20B, ModelSpec::NEMOTRON_H_8B] {
        for layout in LAYOUTS {
            for ps in unikv_invariants::testing::page_sizes() {
                for mode in modes {
                    let label = format!("{model} {layout} ps {ps} {mode}");
                    // A quarter of the budget holds the verify scratch: at 16 GiB,
                    // Nemotron-H's covers 3 of the 4 requests a step late, all of them
                    // in the step.
                    let mut config = RunConfig::new(model, layout, ps, 16 << 30);
                    config.backend = Backend::None;
                    config.speculation = Some(mode);
                    let stats = run(&Preset::Smoke.build(3), &config, (), &|_| {})
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    assert_eq!(stats.requests_completed, stats.requests_total, "{label}");
                    assert_eq!(
                        (
                            stats.host_syncs,
                            stats.invariant_violations,
                            stats.leaked_pages
                        ),
                        (0, 0, 0),
                        "{label}"
                    );
                    let spec = stats.speculative.as_ref().unwrap();
                    assert!(spec.settled_steps > 0, "{label}");
                    assert!(spec.accepted_tokens >= spec.settled_steps, "{label}");
                    assert!(
                        spec.accepted_tokens <= spec.settled_steps * u64::from(mode.width()),
                        "{label}"
                    );
                    let plain = RunConfig {
                        speculation: None,
                        ..config.clone()
                    };
                    let base = run(&Preset::Smoke.build(3), &plain, (), &|_| {}).unwrap();
                    assert!(
                        stats.steps < base.steps,
                        "{label}: {} vs {}",
                        stats.steps,
                        base.steps
                    );
                }
            }
        }
    }
}

/// Speculation changes how many tokens a step adds, not which: a chat's next turn
/// finds exactly the same KV cached as without speculation, and a recurrent model
/// resumes from the same states, settled in the step or a step late (settling copies
/// the accepted state into the running slot and saves the checkpoints the accepted
/// positions cross, so a request finishing with a verify in flight caches its state).
#[test]
fn speculation_generates_the_same_tokens_as_decoding() {
    for model in [ModelSpec::GPT_OSS_20B, ModelSpec::QWEN3_NEXT_80B_A3B] {
        for mode in [
            SpecMode::chain(4).unwrap(),
            SpecMode::tree(6).unwrap().late(),
        ] {
            for layout in LAYOUTS {
                let mut config = RunConfig::new(model, layout, 1, 16 << 30);
                config.backend = Backend::None;
                config.speculation = Some(mode);
                let spec = run(&small_chat(), &config, (), &|_| {}).unwrap();
                let plain = RunConfig {
                    speculation: None,
                    ..config.clone()
                };
                let plain = run(&small_chat(), &plain, (), &|_| {}).unwrap();
                assert_eq!(
                    (spec.prompt_tokens, spec.kv_hit_tokens),
                    (plain.prompt_tokens, plain.kv_hit_tokens),
                    "{model} {mode} {layout}"
                );
                assert_eq!(
                    (spec.prefix_hit_tokens, spec.recomputed_tokens),
                    (plain.prefix_hit_tokens, plain.recomputed_tokens),
                    "{model} {mode}"
                );
                let s = spec.speculative.unwrap();
                // 8 requests of 24 output tokens: the first comes from prefill, the rest
                // from verify steps, or, on a recurrent model past its verify batch,
                // from plain decodes.
                if model.has_recurrent_state() {
                    assert!(s.accepted_tokens <= 8 * 23, "{model} {mode}");
                    assert!(s.verify_steps > 0, "{model} {mode}");
                } else {
                    assert_eq!(s.accepted_tokens, 8 * 23, "{model} {mode}");
                }
            }
        }
    }
}

/// A speculative run never takes more steps than decoding: the decoders beyond the
/// verify batch decode plainly in the same step instead of waiting for their turn
/// (Qwen3-Next's verify batch at 16 GiB is [`REPLAY_VERIFY_BATCH`] = 64 requests of
/// this chat's 80 clients).
#[test]
fn decoders_beyond_the_verify_batch_decode_plainly() {
    use crate::config::REPLAY_VERIFY_BATCH;
    let chat = unikv_workload::workload::ChatShape {
        clients: 80,
        turns: &[1],
        user_tokens: 40,
        output_tokens: 24,
    }
    .build(
        "chat",
        unikv_workload::workload::TokenSource::new(5, "chat"),
    );
    let model = ModelSpec::QWEN3_NEXT_80B_A3B;
    for layout in LAYOUTS {
        let mut config = RunConfig::new(model, layout, 1, 16 << 30);
        config.backend = Backend::None;
        config.speculation = Some(SpecMode::chain(4).unwrap());
        assert_eq!(crate::config::verify_lanes(&config), REPLAY_VERIFY_BATCH);
        let spec = run(&chat, &config, (), &|_| {}).unwrap();
        assert_eq!(
            spec.peak_admitted, 80,
            "{layout}: more decoders than the batch"
        );
        let plain = RunConfig {
            speculation: None,
            ..config.clone()
        };
        let plain = run(&chat, &plain, (), &|_| {}).unwrap();
        assert!(
            spec.steps <= plain.steps,
            "{layout}: {} > {}",
            spec.steps,
            plain.steps
        );
        assert_eq!(spec.prefix_hit_tokens, plain.prefix_hit_tokens, "{layout}");
    }
}

/// At page size 1 every token allocated is a page bound, so the count is at least the
/// tokens not served from the cache; at page size 16 it is about a sixteenth.
#[test]
fn pages_handled_counts_the_pages_bound_and_released() {
    let w = Preset::Smoke.build(3);
    let pages = |ps| {
        let config = RunConfig::new(ModelSpec::GPT_OSS_20B, Layout::Unified, ps, 1 << 30);
        let stats = run(&w, &config, (), &|_| {}).unwrap();
        (stats.pages_handled, stats.prefix_hit_tokens)
    };
    let ((one, hits), (sixteen, _)) = (pages(1), pages(16));
    assert!(one >= w.total_tokens() - hits, "{one} pages");
    assert!(
        sixteen * 8 < one && sixteen * 32 > one,
        "{sixteen} vs {one}"
    );
}

/// Two clients of two three-turn conversations each (prompts of 128 new tokens after the
/// history, 32 output tokens a turn): in a small device a client's history is evicted
/// while the other client runs. (Heavier pressure on gpt-oss trips `step.window_live`
/// with or without a host tier: the scheduler caches a prefill chunk before the step's
/// later allocations, which may then evict SWA the step's forward still reads.)
fn tiered_chat() -> Workload {
    let shape = unikv_workload::workload::ChatShape {
        clients: 2,
        turns: &[3, 3],
        user_tokens: 128,
        output_tokens: 32,
    };
    shape.build(
        "chat",
        unikv_workload::workload::TokenSource::new(9, "chat"),
    )
}

/// [`tiered_chat`] at page size 16 on `--device none`, with a host tier of
/// `host_memory_bytes` (0: none).
fn tiered_run(
    model: ModelSpec,
    layout: Layout,
    memory_bytes: u64,
    host_memory_bytes: u64,
) -> RunStats {
    let mut config = RunConfig::new(model, layout, 16, memory_bytes);
    config.backend = Backend::None;
    config.host_memory_bytes = host_memory_bytes;
    run(&tiered_chat(), &config, (), &|_| {}).unwrap()
}

/// A device too small for the conversations' histories evicts them before their next
/// turns; a host tier takes them and loads them back: the same run hits more, computes
/// fewer prompt tokens and recomputes no more (the recurrent model, whose states the
/// host keeps too, fewer), as much as a device that never evicts would, and says where
/// its hits came from and what moved. Without a host tier a run has no host figures.
#[test]
fn a_host_tier_hits_more_and_recomputes_less_on_a_small_device() {
    for (model, memory) in [
        (ModelSpec::GPT_OSS_20B, 32 << 20),
        (ModelSpec::QWEN3_NEXT_80B_A3B, 512 << 20),
    ] {
        for layout in LAYOUTS {
            let without = tiered_run(model, layout, memory, 0);
            let with = tiered_run(model, layout, memory, 4 << 30);
            let ample = tiered_run(model, layout, 4 << 30, 0);
            for s in [&without, &with, &ample] {
                assert!(
                    s.failures().is_empty(),
                    "{model} {layout} {}: {:?}",
                    s.memory_bytes,
                    s.failures()
                );
            }
            assert!(without.host.is_none(), "{model} {layout}");
            let computed = |s: &RunStats| s.prompt_tokens - s.prefix_hit_tokens;
            assert!(
                with.prefix_hit_tokens > without.prefix_hit_tokens
                    && computed(&with) < computed(&without)
                    && with.recomputed_tokens <= without.recomputed_tokens,
                "{model} {layout}: {without:?} vs {with:?}"
            );
            assert_eq!(
                (with.prefix_hit_tokens, with.recomputed_tokens),
                (ample.prefix_hit_tokens, ample.recomputed_tokens),
                "{model} {layout}: as a device that never evicts"
            );
            if model.has_recurrent_state() {
                assert!(
                    with.recomputed_tokens < without.recomputed_tokens,
                    "{model} {layout}"
                );
            }
            let host = with.host.expect("a host tier");
            assert_eq!(host.total_bytes, 4 << 30);
            assert_eq!(
                host.device_hit_tokens + host.host_hit_tokens,
                with.prefix_hit_tokens
            );
            assert!(host.host_hit_tokens > 0, "{host:?}");
            // Every host hit token's FULL row came back, in whole pages.
            assert!(
                host.loaded_bytes >= host.host_hit_tokens * model.full_bytes_per_token(),
                "{host:?}"
            );
            assert!(host.written_bytes > 0 && host.copies > 0, "{host:?}");
            assert!(
                host.largest_copy > 0
                    && host.largest_copy <= host.written_bytes.max(host.loaded_bytes),
                "{host:?}"
            );
            assert!(host.peak_full_bytes > 0, "{host:?}");
            assert_eq!(host.peak_swa_bytes > 0, model.swa_layers > 0, "{host:?}");
            assert_eq!(
                host.peak_state_bytes > 0,
                model.has_recurrent_state(),
                "{host:?}"
            );
            let kinds = [
                host.peak_full_bytes,
                host.peak_swa_bytes,
                host.peak_state_bytes,
            ];
            assert!(
                kinds.iter().all(|&b| b <= host.peak_bytes) && host.peak_bytes <= host.total_bytes,
                "{host:?}"
            );
            assert_eq!(host.refused_writes, 0, "4 GiB holds every history");
        }
    }
}

/// The scheduler caches each prefill chunk as soon as it is allocated, so a later
/// admission of the same step hits it, and the step's later allocations may then evict:
/// what the step's forward reads behind a chunk stays locked until the boundary, so a
/// chat under memory pressure (gpt-oss-20b, static, page size 16, 64 MiB: evicting every
/// few steps) runs at strict with no breach (`step.window_live` was breached once here).
#[test]
fn chunks_cached_mid_step_keep_their_window_under_memory_pressure() {
    let shape = unikv_workload::workload::ChatShape {
        clients: 8,
        turns: &[3, 3],
        user_tokens: 40,
        output_tokens: 24,
    };
    let workload = shape.build(
        "chat",
        unikv_workload::workload::TokenSource::new(5, "chat"),
    );
    let mut config = RunConfig::new(ModelSpec::GPT_OSS_20B, LAYOUTS[0], 16, 64 << 20);
    config.backend = Backend::None;
    let stats =
        unikv_invariants::scoped_level(Level::Strict, || run(&workload, &config, (), &|_| {}))
            .unwrap();
    assert_eq!(stats.requests_completed, 48);
    assert!(stats.evictions_by_kind["swa"] > 0, "{stats:?}");
    assert_eq!(stats.invariant_violations, 0);
}

//! The builder refuses unusable configurations with typed errors and clear messages, and
//! never panics: zero page size, window 0, Mamba layers, a model without one kind of
//! attention, a zero or too small budget (the batch-size-1 floor), a bad static ratio, a
//! buffer whose kernel ids would overflow i32. Sound configurations build.

mod common;

use common::tiny_model;
use unikv::{Error, HybridCache, HybridCacheBuilder, Layout, ModelSpec};

fn tiny() -> HybridCacheBuilder {
    HybridCache::builder()
        .model(tiny_model(8, 1))
        .page_size(4)
        .memory_bytes(1 << 16)
}

fn with_model(f: impl FnOnce(&mut ModelSpec)) -> HybridCacheBuilder {
    let mut m = tiny_model(8, 1);
    f(&mut m);
    tiny().model(m)
}

fn static_ratio(ratio: f64) -> HybridCacheBuilder {
    tiny().layout(Layout::Static {
        swa_full_tokens_ratio: ratio,
    })
}

/// Builds and expects an error of the kind `is_kind` whose message contains `needle`.
fn check(name: &str, builder: HybridCacheBuilder, is_kind: fn(&Error) -> bool, needle: &str) {
    match builder.build() {
        Ok(_) => panic!("{name}: built"),
        Err(e) => {
            assert!(is_kind(&e), "{name}: wrong kind: {e:?}");
            let message = e.to_string();
            assert!(
                message.contains(needle),
                "{name}: {message:?} does not mention {needle:?}"
            );
        }
    }
}

/// A builder case: name, builder, the error kind expected, a word the message must hold.
type Case = (
    &'static str,
    HybridCacheBuilder,
    fn(&Error) -> bool,
    &'static str,
);

fn config(e: &Error) -> bool {
    matches!(e, Error::Config(_))
}

fn too_small(e: &Error) -> bool {
    matches!(e, Error::Pool(unikv::pools::Error::BufferTooSmall { .. }))
}

#[test]
fn unusable_configurations_are_typed_errors_with_clear_messages() {
    let cases: Vec<Case> = vec![
        ("zero page size", tiny().page_size(0), config, "page size"),
        (
            "window 0",
            with_model(|m| m.window = 0),
            config,
            "window of 0",
        ),
        (
            "Mamba layers beside SWA without a state geometry",
            with_model(|m| m.mamba_layers = 2),
            config,
            "recurrent state",
        ),
        (
            "Mamba layers without a state geometry",
            with_model(|m| {
                m.mamba_layers = 2;
                m.swa_layers = 0;
            }),
            config,
            "recurrent state",
        ),
        (
            "no FULL layer",
            with_model(|m| m.full_layers = 0),
            config,
            "full-attention",
        ),
        (
            "no SWA layer",
            with_model(|m| m.swa_layers = 0),
            config,
            "sliding-window",
        ),
        (
            "no FULL KV heads",
            with_model(|m| m.full.kv_heads = 0),
            config,
            "full-attention layers' KV heads",
        ),
        (
            "no SWA head dim",
            with_model(|m| m.swa.head_dim = 0),
            config,
            "sliding-window layers' KV heads",
        ),
        (
            "no budget",
            HybridCache::builder().model(tiny_model(8, 1)),
            config,
            "memory",
        ),
        (
            "below the bs-1 floor, unified",
            tiny().memory_bytes(447),
            too_small,
            "window",
        ),
        (
            "below the bs-1 floor, static",
            static_ratio(1.0).memory_bytes(447),
            too_small,
            "window",
        ),
        ("ratio 0", static_ratio(0.0), config, "ratio"),
        ("negative ratio", static_ratio(-0.5), config, "ratio"),
        ("NaN ratio", static_ratio(f64::NAN), config, "ratio"),
        (
            "infinite ratio",
            static_ratio(f64::INFINITY),
            config,
            "ratio",
        ),
        (
            "kernel ids overflow i32",
            tiny().page_size(1).memory_bytes(1 << 40),
            |e| matches!(e, Error::Pool(unikv::pools::Error::KernelIdOverflow { .. })),
            "i32",
        ),
    ];
    for (name, builder, kind, needle) in cases {
        check(name, builder, kind, needle);
    }
}

/// A budget smaller than the sink floor itself (one page envelope) is the same typed
/// error as any budget below the batch-size-1 floor, not an arithmetic overflow.
#[test]
fn a_budget_below_the_sink_floor_is_a_typed_error_not_a_panic() {
    for bytes in [1, 63] {
        check(
            &format!("{bytes} bytes"),
            tiny().memory_bytes(bytes),
            too_small,
            "window",
        );
        let layout = Layout::Static {
            swa_full_tokens_ratio: 1.0,
        };
        check(
            &format!("{bytes} bytes, static"),
            tiny().layout(layout).memory_bytes(bytes),
            too_small,
            "window",
        );
    }
}

#[test]
fn the_batch_size_1_floor_is_the_boundary_between_refusal_and_a_cache_that_runs_one_window() {
    // W = 8 at page size 4: one window is ceil((8 + 4) / 4) = 3 pages per side, 64 B each.
    let envelope = 4 * 16;
    let floor = envelope + 3 * 2 * envelope;
    let refused = tiny().memory_bytes(floor - 1).build();
    assert!(
        matches!(
            refused,
            Err(Error::Pool(unikv::pools::Error::BufferTooSmall { .. }))
        ),
        "{refused:?}"
    );
    let mut cache = tiny()
        .memory_bytes(floor)
        .build()
        .expect("exactly the floor builds");
    // ... and holds a request of one window plus a page.
    let hit = cache.match_prefix((0..12).map(unikv::TokenId).collect());
    let mut r = cache.admit(hit).unwrap();
    cache.alloc_extend(&mut r, 12).unwrap();
    cache.step_boundary().unwrap();
    cache.release(r).unwrap();
    cache.step_boundary().unwrap();
}

#[test]
fn sound_configurations_build_for_every_layout_and_named_model() {
    for layout in [
        Layout::Unified,
        Layout::Static {
            swa_full_tokens_ratio: 0.8,
        },
    ] {
        for model in ModelSpec::NAMED.iter().filter(|m| !m.has_recurrent_state()) {
            for ps in [1, 16] {
                // Room for one request's window and a few pages on both sides, with
                // 1.5× slack for the static split: Gemma 4's 901 KB joint token needs
                // far more than gpt-oss's 48 KB.
                let tokens = u64::from(model.window.div_ceil(ps) * ps + 2 * ps);
                let joint = model.full_bytes_per_token() + model.swa_bytes_per_token();
                let memory = (tokens * joint * 3 / 2).max(32 << 20);
                let cache = HybridCache::builder()
                    .model(*model)
                    .page_size(ps)
                    .memory_bytes(memory)
                    .layout(layout)
                    .build()
                    .unwrap_or_else(|e| panic!("{model} ps {ps} {layout:?}: {e}"));
                assert_eq!((cache.page_size(), cache.layout()), (ps as usize, layout));
                assert_eq!(cache.model(), model);
                let stats = cache.stats();
                assert_eq!(stats.full.available_pages, stats.full.total_pages);
                assert_eq!(stats.swa.available_pages, stats.swa.total_pages);
            }
        }
    }
}

#[test]
fn named_models_with_recurrent_layers_build_on_both_layouts() {
    let recurrent: Vec<ModelSpec> = ModelSpec::NAMED
        .into_iter()
        .filter(ModelSpec::has_recurrent_state)
        .collect();
    let names: Vec<&str> = recurrent.iter().map(|m| m.name).collect();
    assert_eq!(
        names,
        ["qwen3-next-80b-a3b", "nemotron-h-8b", "synthetic-tri"]
    );
    for model in recurrent {
        for layout in [
            Layout::Unified,
            Layout::Static {
                swa_full_tokens_ratio: 0.8,
            },
        ] {
            let built = HybridCache::builder()
                .model(model)
                .memory_bytes(4 << 30)
                .layout(layout)
                .build();
            match built {
                Ok(cache) => {
                    let stats = cache.stats();
                    assert!(
                        stats.mamba.total_pages >= 3,
                        "{model} {layout:?}: {stats:?}"
                    );
                    assert_eq!(
                        stats.mamba.page_bytes,
                        model.state_bytes_per_request(),
                        "{model}: one slot holds one request's state"
                    );
                }
                Err(e) => panic!("{model} {layout:?}: {e}"),
            }
        }
    }
}

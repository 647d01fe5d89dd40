//! The host cost of a whole decode step, as an engine pays it: `alloc_decode`, the step's
//! metadata and the step boundary, for a batch of 256 requests decoding one token each,
//! at contexts of 512, 4k, 16k and 64k tokens, page sizes 1, 16 and 256, both layouts,
//! gpt-oss-20b and Qwen3-Next (recurrent state scaled down as in `benches/step.rs`), at
//! invariant levels off and strict. Thread CPU time on a `NullDevice` (bookkeeping only),
//! medians of 30 steps after 5 warm-up steps.
//!
//! A cell decodes 35 steps building the metadata on the device from the lanes
//! (`build_step_metadata`, what the step costs), then 35 building it on the host row by row
//! (`build_step_metadata_on_host`: the cost the lanes replace, printed beside it as
//! "host-built"; "step with it" adds the device steps' allocator and boundary). Run with `cargo bench -p unikv --bench step_cost` (`-- --quick`: contexts
//! 512 and 4k only; `-- --ctx 16384` one context; `--model gpt-oss`, `--ps 16` and
//! `--level off` pick cells).

mod common;

use common::{LAYOUTS, QWEN3_NEXT_SCALED_STATE, median, prefilled};
use std::sync::Arc;
use std::time::Duration;
use unikv::invariants::{Level, scoped_level};
use unikv::kernels::{NullDevice, thread_cpu_time};
use unikv::{HybridCache, Layout, ModelSpec, Request, StepCapacity, StepMetadata, TokenId};

const BATCH: usize = 256;
const WARM_UP: usize = 5;
const STEPS: usize = 30;
/// Tokens each request decodes: the steps with the device build, then as many with the
/// host build.
const DECODED: usize = 2 * (WARM_UP + STEPS);
/// Prefill chunk: each releases the window its predecessor left, so a static SWA pool
/// sized for windows holds a long prompt.
const CHUNK: usize = 1_024;

/// Median per-part step times of one cell.
struct Cell {
    alloc: Duration,
    meta: Duration,
    boundary: Duration,
    host_meta: Duration,
}

fn timed<R>(f: impl FnOnce() -> R) -> (R, Duration) {
    let start = thread_cpu_time();
    let r = f();
    (r, thread_cpu_time().saturating_sub(start))
}

/// A cache of `model` holding `BATCH` requests of `ctx` tokens each, decoding.
fn decoding(model: ModelSpec, layout: Layout, ps: u32, ctx: usize) -> (HybridCache, Vec<Request>) {
    let tokens = (BATCH * (ctx + DECODED + 2 * ps as usize)) as u64;
    // FULL room for every request's rows and a fifth more, and as many SWA tokens as the
    // static layout's ratio gives (more than the unified layout's windows need); kernel
    // ids must stay inside i32, so no more.
    let per_token = model.full_bytes_per_token() + model.swa_bytes_per_token() * 4 / 5;
    let slots = model.slot_pool().map_or(0, |s| s.bytes_per_slot) * (BATCH as u64 * 8);
    let mut memory = per_token * tokens * 6 / 5 + slots + (64 << 20);
    if model.has_recurrent_state() && layout != Layout::Unified {
        // The static layout gives the reference's share of the budget to state slots.
        memory *= 3;
    }
    let mut cache = HybridCache::builder()
        .model(model)
        .page_size(ps)
        .memory_bytes(memory)
        .layout(layout)
        .device(Arc::new(NullDevice::new()))
        .build()
        .expect("the cache builds");
    cache
        .reserve_step_metadata(StepCapacity {
            requests: BATCH,
            max_len: ctx + DECODED + 1,
            max_new_tokens: BATCH,
            max_loaded_pages: 0,
        })
        .expect("lanes reserved");
    let requests = prefilled(&mut cache, BATCH, ctx, CHUNK);
    (cache, requests)
}

fn cell(model: ModelSpec, layout: Layout, ps: u32, ctx: usize) -> Cell {
    let (mut cache, mut requests) = decoding(model, layout, ps, ctx);
    let tokens = vec![TokenId(7); BATCH];
    let mut meta = StepMetadata::new();
    // Steps with the metadata built on the device, then steps with it built on the host
    // (apart: a host build streams every row through the caches and would slow the
    // step after it).
    let mut times: [Vec<Duration>; 4] = Default::default();
    for on_host in [false, true] {
        for step in 0..WARM_UP + STEPS {
            let mut batch: Vec<&mut Request> = requests.iter_mut().collect();
            let (r, alloc) = timed(|| cache.alloc_decode(&mut batch, &tokens));
            r.expect("decoded");
            let shape: Vec<(&Request, usize)> = requests.iter().map(|r| (r, 1)).collect();
            let (r, meta_t) = timed(|| {
                if on_host {
                    cache.build_step_metadata_on_host(&mut meta, &shape)
                } else {
                    cache.build_step_metadata(&mut meta, &shape)
                }
            });
            r.expect("built");
            drop(shape);
            let (r, boundary) = timed(|| cache.step_boundary());
            r.expect("a clean step");
            if step >= WARM_UP {
                if on_host {
                    times[3].push(meta_t);
                } else {
                    for (v, t) in times.iter_mut().zip([alloc, meta_t, boundary]) {
                        v.push(t);
                    }
                }
            }
        }
    }
    for req in requests {
        cache.release(req).expect("released");
    }
    let [alloc, meta, boundary, host_meta] = times.map(median);
    Cell {
        alloc,
        meta,
        boundary,
        host_meta,
    }
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut contexts = vec![512, 4_096, 16_384, 65_536];
    if args.iter().any(|a| a == "--quick") {
        contexts = vec![512, 4_096];
    }
    if let Some(i) = args.iter().position(|a| a == "--ctx") {
        let ctx = args
            .get(i + 1)
            .and_then(|c| c.parse().ok())
            .expect("--ctx N");
        contexts = vec![ctx];
    }
    let value = |flag: &str| {
        let i = args.iter().position(|a| a == flag)?;
        Some(
            args.get(i + 1)
                .unwrap_or_else(|| panic!("{flag} VALUE"))
                .clone(),
        )
    };
    let only_model = value("--model");
    let only_ps: Option<u32> = value("--ps").map(|p| p.parse().expect("--ps N"));
    let only_level = value("--level");
    let models = [ModelSpec::GPT_OSS_20B, QWEN3_NEXT_SCALED_STATE];
    // A filter that picks no cell is refused, not run as an empty table.
    if let Some(m) = &only_model {
        assert!(
            models
                .iter()
                .any(|model| model.name.starts_with(m.as_str())),
            "--model {m}: no benchmarked model's name starts with it"
        );
    }
    if let Some(p) = only_ps {
        assert!([1, 16, 256].contains(&p), "--ps {p}: one of 1, 16, 256");
    }
    if let Some(l) = &only_level {
        assert!(
            ["off", "strict"].contains(&l.as_str()),
            "--level {l}: off or strict"
        );
    }
    for level in [Level::Off, Level::Strict] {
        if only_level.as_ref().is_some_and(|l| *l != level.to_string()) {
            continue;
        }
        println!(
            "\nhost cost of a decode step, batch {BATCH}, invariants {level}, µs (thread CPU, \
             median of {STEPS} steps)"
        );
        println!(
            "| model | layout | ps | context | alloc | metadata | boundary | step | \
             host-built metadata | step with it | metadata vs 512 |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for model in models {
            if only_model
                .as_ref()
                .is_some_and(|m| !model.name.starts_with(m.as_str()))
            {
                continue;
            }
            for (name, layout) in LAYOUTS {
                for ps in [1, 16, 256] {
                    if only_ps.is_some_and(|p| p != ps) {
                        continue;
                    }
                    let mut base: Option<Duration> = None;
                    for &ctx in &contexts {
                        let c = scoped_level(level, || cell(model, layout, ps, ctx));
                        let step = c.alloc + c.meta + c.boundary;
                        let today = c.alloc + c.host_meta + c.boundary;
                        let base = *base.get_or_insert(c.meta);
                        println!(
                            "| {} | {name} | {ps} | {ctx} | {} | {} | {} | **{}** | {} | {} | {:.2}× |",
                            model.name,
                            us(c.alloc),
                            us(c.meta),
                            us(c.boundary),
                            us(step),
                            us(c.host_meta),
                            us(today),
                            c.meta.as_secs_f64() / base.as_secs_f64().max(1e-9),
                        );
                    }
                }
            }
        }
    }
}

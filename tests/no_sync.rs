//! No host sync on the scheduling path: a whole scheduler step through `HybridCache` —
//! admission with a prefix hit, chunked prefill under memory pressure (eviction), decode
//! with an out-of-window SWA release, finishing, explicit eviction and the step boundary —
//! issues zero host syncs and zero data-dependent shapes on a recording device. The only
//! device work is at the step boundary: the translation mirror upload (and compaction).

mod common;

use common::*;
use std::sync::Arc;
use unikv::kernels::{CpuDevice, CudaDevice, Readback, SyncLedger};
use unikv::{Layout, TokenId};

const W: u32 = 8;

#[test]
fn a_full_scheduler_step_issues_no_host_sync_and_uploads_the_mirror_once() {
    a_full_scheduler_step_on(|| Arc::new(CpuDevice::new()));
}

/// The same step on the CUDA backend (over its emulated driver): its ops stage their
/// arguments through the pinned ring, so no driver call on the way may block the host.
#[test]
fn on_the_cuda_backend_a_full_scheduler_step_issues_no_sync_hazard() {
    a_full_scheduler_step_on(|| Arc::new(CudaDevice::emulated()));
}

/// The check is not vacuous: a CUDA backend without a staging ring, which uploads every
/// argument list from pageable memory into a fresh allocation, fails the same test, and
/// the report names the hazard.
#[test]
fn a_cuda_backend_that_may_block_fails_the_no_sync_step() {
    let failure = std::panic::catch_unwind(|| {
        a_full_scheduler_step_on(|| Arc::new(CudaDevice::emulated().with_staging(0).unwrap()))
    })
    .expect_err("the blocking variant must fail the no-sync test");
    let message = failure
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        message.contains("sync hazard")
            && (message.contains("copy_table_spans") || message.contains("scatter_tables")),
        "{message}"
    );
}

/// The no-sync proof of a whole step: with a long kernel holding the device's stream,
/// admission with a prefix hit, prefill, a decode batch, finishing, eviction and the step
/// boundary (mirror upload, compaction) all return to the host while the kernel still
/// runs. On a GPU (`cargo xtask gpu`) the spin is real; elsewhere the emulated stream
/// stays stalled until a read-back.
#[test]
fn a_whole_step_returns_while_the_gpu_is_still_busy() {
    let dev = Arc::new(match CudaDevice::new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            assert!(
                std::env::var("UNIKV_REQUIRE_GPU").map_or(true, |v| v != "1"),
                "UNIKV_REQUIRE_GPU=1 but: {e}"
            );
            CudaDevice::emulated()
        }
    });
    for layout in LAYOUTS {
        let ledger = Arc::new(SyncLedger::new(dev.clone()));
        let config = Config {
            device: Some(ledger.clone()),
            ..Config::tokens(layout, 4, W, 40 * 8, 8)
        };
        let mut fx = Fixture::new(&config);
        let keep = fx.keep();
        let prefix = text(0, 2 * keep);
        let mut p = fx.admit(prefix.clone());
        fx.prefill(&mut p, 2 * keep);
        fx.cache.cache_finished(p).unwrap();
        let mut decoding = fx.admit(text(400_000, keep + 1));
        fx.prefill(&mut decoding, keep + 1);
        fx.step();
        ledger.reset();

        let spin = dev.enqueue_spin(2_000_000_000).unwrap();
        let mut admitted = fx.admit(concat(&prefix, &text(600_000, 3 * keep)));
        fx.cache.alloc_extend(&mut admitted, 3 * keep).unwrap();
        for t in 0..2 * keep as u32 {
            fx.cache
                .alloc_decode(
                    &mut [&mut decoding, &mut admitted],
                    &[TokenId(t), TokenId(t + 1)],
                )
                .unwrap();
        }
        fx.cache.cache_finished(admitted).unwrap();
        fx.cache.evict_to_free(1, 1).unwrap();
        fx.step();
        assert!(
            !spin.is_done().unwrap(),
            "{}: the step waited for the stream",
            fx.label
        );
        ledger
            .check_no_syncs()
            .unwrap_or_else(|report| panic!("{}: {report}", fx.label));
        assert!(
            ledger.op_count() > 0,
            "{}: the step issued device work",
            fx.label
        );
        fx.check_accounting(&[&decoding]);
        fx.teardown(vec![decoding]);
        dev.synchronize(&unikv::kernels::HostSync::acquire("test: end of the proof"))
            .unwrap();
        assert!(spin.is_done().unwrap(), "a wait ends the spin");
    }
}

/// The device op of `layout`'s mirror upload: the unified pool copies spans of its host
/// tables; the static pool scatters entries it derives.
fn mirror_upload_op(layout: Layout) -> &'static str {
    match layout {
        Layout::Unified => "copy_table_spans",
        Layout::Static { .. } => "scatter_tables",
    }
}

fn a_full_scheduler_step_on(device: impl Fn() -> Arc<dyn Readback>) {
    for_each_layout_and_page_size(|layout, ps| {
        let ledger = Arc::new(SyncLedger::new(device()));
        let config = Config {
            device: Some(ledger.clone()),
            ..Config::tokens(layout, ps, W, 40 * (W as u64).max(ps as u64), 8)
        };
        let mut fx = Fixture::new(&config);
        let keep = fx.keep();
        let ps = fx.ps;

        // Before the step: a cached prefix, filler prefixes that pressure will evict, and
        // a request decoding right below its next window release.
        let prefix = text(0, 2 * keep);
        let mut p = fx.admit(prefix.clone());
        fx.prefill(&mut p, 2 * keep);
        fx.cache.cache_finished(p).unwrap();
        fx.step();
        let mut finishing = fx.admit(text(300_000, keep + 1));
        fx.prefill(&mut finishing, keep + 1);
        let mut decoding = fx.admit(text(400_000, keep + 1));
        fx.prefill(&mut decoding, keep + 1);
        let mut i = 0;
        while fx.cache.allocator().capacity().joint_schedulable_pages >= 3 * keep / ps {
            let mut filler = fx.admit(text(1_000_000 * (i + 1), ps));
            fx.prefill(&mut filler, ps);
            fx.cache.cache_finished(filler).unwrap();
            fx.step();
            i += 1;
        }
        // Decode until one more token moves the window.
        while decoding.len() < decoding.window_cursor() + keep + fx.interval {
            let token = 500_000 + decoding.len() as u32;
            fx.decode(&mut decoding, 1, token);
        }
        let evictions_before = fx.cache.stats().evictions;
        ledger.reset();

        // The step.
        let mut admitted = fx.admit(concat(&prefix, &text(600_000, 3 * keep)));
        assert_eq!(admitted.cached_at_admission(), 2 * keep, "{}", fx.label);
        fx.cache.alloc_extend(&mut admitted, 3 * keep).unwrap();
        let cursor = decoding.window_cursor();
        fx.cache
            .alloc_decode(&mut [&mut decoding], &[TokenId(7)])
            .unwrap();
        assert!(
            decoding.window_cursor() > cursor,
            "{}: the window release ran",
            fx.label
        );
        fx.cache.cache_finished(finishing).unwrap();
        fx.cache.evict_to_free(1, 1).unwrap();
        assert_ne!(
            fx.cache.stats().evictions,
            evictions_before,
            "{}: pressure evicted",
            fx.label
        );
        // The scheduling path issues no device work but asynchronous page moves (lazy
        // compaction inside an allocation that needs it).
        let scheduling_ops = ledger.ops();
        assert!(
            scheduling_ops.iter().all(|r| r.op == "move_spans"),
            "{}: device work on the scheduling path: {scheduling_ops:?}",
            fx.label
        );
        let before_boundary = scheduling_ops.len();
        fx.step();

        ledger
            .check_no_syncs()
            .unwrap_or_else(|report| panic!("{}: {report}", fx.label));
        assert_eq!((ledger.syncs(), ledger.data_dependent_shapes()), (0, 0));
        // The boundary's own device work: the mirror upload, one op for every side.
        let ops = ledger.ops()[before_boundary..].to_vec();
        let upload = mirror_upload_op(layout);
        let uploads = ops.iter().filter(|r| r.op == upload).count();
        assert_eq!(
            uploads, 1,
            "{}: the boundary uploads the mirror in one op: {ops:?}",
            fx.label
        );
        assert!(
            ops.iter().all(|r| r.op == upload || r.op == "move_spans"),
            "{}: unexpected device ops at the boundary: {ops:?}",
            fx.label
        );
        // A step that changed no table uploads nothing.
        ledger.reset();
        fx.step();
        assert_eq!(ledger.op_count(), 0, "{}: {:?}", fx.label, ledger.ops());
        let label = fx.label.clone();
        fx.teardown(vec![admitted, decoding]);
        // Dropping the cache frees its device memory: tear-down, a hazard on a GPU.
        let waits: Vec<_> = ledger
            .ops()
            .into_iter()
            .filter(|r| r.synced && !matches!(r.op, "free_bytes" | "free_table"))
            .collect();
        assert!(waits.is_empty(), "{label}: {waits:?}");
    });
}

/// What the device sees after a step boundary is what the host decided: both mirrors
/// equal the host's translation tables entry by entry (live, tombstone, unbound), and
/// the device translation of each running request's row gives the host's kernel ids —
/// the sink for rows whose SWA left the window — through window releases, tombstoning,
/// finishing, eviction and compaction. (The read-backs are the test's, with a permit,
/// outside the step.)
#[test]
fn the_uploaded_mirror_and_device_translation_match_the_host_after_every_step() {
    use unikv::kernels::HostSync;
    use unikv::pools::{Side, SwaState, VirtualPage};

    for_each_layout_and_page_size(|layout, ps| {
        let ledger = Arc::new(SyncLedger::cpu());
        let config = Config {
            device: Some(ledger.clone()),
            ..Config::tokens(layout, ps, W, 24 * (W as u64).max(ps as u64), 8)
        };
        let mut fx = Fixture::new(&config);
        let keep = fx.keep();
        let sync = HostSync::acquire("test: compare the device mirror with the host");
        let device = ledger.inner().clone();

        let check = |fx: &Fixture, running: &[&unikv::Request]| {
            let alloc = fx.cache.allocator();
            let pages = alloc.virtual_pages() as usize;
            for side in [Side::Full, Side::Swa] {
                let mirror = device
                    .read_table(&sync, alloc.mirror_table(side).unwrap(), 0, pages)
                    .unwrap();
                for (v, &entry) in mirror.iter().enumerate() {
                    let page = VirtualPage(v as u32);
                    let expected = match alloc.physical_page(side, page) {
                        Some(p) => p as i32,
                        None if side == Side::Swa
                            && alloc.swa_state(page) == SwaState::Tombstone =>
                        {
                            -1
                        }
                        None => 0,
                    };
                    let ok = entry == expected || (expected == 0 && entry <= 0 && v == 0);
                    assert!(
                        ok,
                        "{}: {side:?} mirror of v{v} is {entry}, host says {expected}",
                        fx.label
                    );
                }
                for r in running {
                    let ids: Vec<i32> = r.row().iter().map(|t| t.0 as i32).collect();
                    let width = ids.len() + 3;
                    let ids_table = device.alloc_table(ids.len().max(1), 0).unwrap();
                    device.upload_table(ids_table, 0, &ids).unwrap();
                    let out = device.alloc_table(width, -7).unwrap();
                    alloc
                        .translate(side, ids_table, ids.len(), out, width)
                        .unwrap();
                    let kernel = device.read_table(&sync, out, 0, width).unwrap();
                    for (i, &t) in r.row().iter().enumerate() {
                        assert_eq!(
                            kernel[i],
                            alloc.kernel_id(side, t),
                            "{}: {side:?} row {i}",
                            fx.label
                        );
                    }
                    assert_eq!(
                        &kernel[ids.len()..],
                        &[0, 0, 0],
                        "{}: the tail is zero-filled",
                        fx.label
                    );
                    if side == Side::Swa {
                        for (i, &k) in kernel[..r.window_cursor().min(ids.len())]
                            .iter()
                            .enumerate()
                        {
                            if i >= r.protected_len() {
                                assert_eq!(
                                    k, 0,
                                    "{}: row {i} below the cursor reads the sink",
                                    fx.label
                                );
                            }
                        }
                    }
                    device.free_table(ids_table).unwrap();
                    device.free_table(out).unwrap();
                }
            }
        };

        let prefix = text(0, 2 * keep);
        let mut a = fx.admit(prefix.clone());
        fx.prefill(&mut a, fx.ps);
        fx.cache.cache_finished(a).unwrap();
        fx.step();
        check(&fx, &[]);
        let mut b = fx.admit(concat(&prefix, &text(10_000, keep + 1)));
        let mut c = fx.admit(text(20_000, keep + 3));
        let chunk = fx.ps;
        for _ in 0..3 * keep {
            for r in [&mut b, &mut c] {
                if r.remaining_prefill() > 0 {
                    let n = chunk.min(r.remaining_prefill());
                    fx.cache.alloc_extend(r, n).unwrap();
                } else {
                    let t = 30_000 + r.len() as u32;
                    fx.cache
                        .alloc_decode(&mut [r], &[unikv::TokenId(t)])
                        .unwrap();
                }
            }
            fx.step();
            check(&fx, &[&b, &c]);
        }
        // Tombstone what can be, finish one request (compaction follows its frees).
        let swa_free = fx.cache.allocator().capacity().swa.schedulable_pages;
        let _ = fx.cache.evict_to_free(0, swa_free + 1);
        fx.step();
        check(&fx, &[&b, &c]);
        fx.cache.cache_finished(c).unwrap();
        fx.cache.step_boundary().unwrap();
        check(&fx, &[&b]);
        fx.cache.evict_all().unwrap();
        fx.step();
        check(&fx, &[&b]);
        assert_eq!(
            ledger.syncs(),
            0,
            "{}: the cache itself never synced",
            fx.label
        );
        fx.teardown(vec![b]);
    });
}

/// The Mamba paths of a step on a FULL + recurrent-state hybrid and on the tri-pool model
/// (FULL, SWA and recurrent state: the float's placement and ladder), both layouts: admission
/// with a cached state (slot allocation, the copy-on-write of the matched state), on the
/// unified layout under a slot shortfall that evicts FULL donors, chunked prefill across
/// the checkpoint grid, decode, finishing (the latest checkpoint inserted, the other
/// slots freed), a release, and the step boundary: zero host syncs, and nothing but
/// asynchronous moves and zeroing before the boundary.
#[test]
fn a_mamba_hybrid_step_issues_no_host_sync() {
    for (model, layout) in [TINY_MAMBA, TINY_TRI]
        .into_iter()
        .flat_map(|m| LAYOUTS.map(|l| (m, l)))
    {
        for ps in [1u32, 4] {
            let ledger = Arc::new(SyncLedger::cpu());
            let mut cache = unikv::HybridCache::builder()
                .model(model)
                .page_size(ps)
                .memory_bytes(64 * 32 + 32 * 400)
                .layout(layout)
                .checkpoint_interval(16)
                .device(ledger.clone())
                .build()
                .unwrap();
            let label = format!("{} {} ps {ps}", model.name, layout.as_str());
            let finish = |cache: &mut unikv::HybridCache, prompt: Vec<TokenId>| {
                let n = prompt.len();
                let hit = cache.match_prefix(prompt);
                let mut r = cache.admit(hit).unwrap();
                cache.alloc_extend(&mut r, n).unwrap();
                cache.cache_finished(r).unwrap();
                cache.step_boundary().unwrap();
            };
            // A cached prefix with its states at 32 and 40 tokens, then fillers.
            let prefix = text(0, 40);
            finish(&mut cache, prefix.clone());
            let mut i = 1;
            while cache.allocator().capacity().full.schedulable_pages * (ps as usize) >= 120 {
                finish(&mut cache, text(1_000_000 * i, 12));
                i += 1;
            }
            // On the unified layout a running request decodes into the gap until three
            // slots no longer fit in it (the slot ids stay free: #34441's shape).
            let hit = cache.match_prefix(text(500_000, 8));
            let mut running = cache.admit(hit).unwrap();
            cache.alloc_extend(&mut running, 8).unwrap();
            if layout == Layout::Unified {
                let mut t = 0;
                while cache
                    .allocator()
                    .allocation_fits(unikv::pools::PageDemand::slots(3))
                {
                    cache
                        .alloc_decode(&mut [&mut running], &[TokenId(600_000 + t)])
                        .unwrap();
                    t += 1;
                }
            }
            cache.step_boundary().unwrap();
            let donors = cache.stats().evictions.donor_nodes;
            ledger.reset();

            // The step.
            let hit = cache.match_prefix(concat(&prefix, &text(700_000, 20)));
            // The prefix's request saved states at its grid point, 32, and its prompt's
            // end, 40; the fillers may have evicted its last node (with the state at 40).
            let cached = hit.cached_tokens();
            assert!(matches!(cached, 32 | 40), "{label}: {cached}");
            let mut req = cache.admit(hit).unwrap();
            cache.alloc_extend(&mut req, 60 - cached).unwrap();
            let at: Vec<usize> = req.checkpoint_writes().iter().map(|w| w.at_len).collect();
            assert_eq!(at, [48, 60], "{label}: 60 tokens cross 48");
            // Its states enter the tree while it runs (a suffix insert from its lock).
            cache.cache_unfinished(&mut req).unwrap();
            cache
                .alloc_decode(&mut [&mut req, &mut running], &[TokenId(1), TokenId(2)])
                .unwrap();
            cache.cache_finished(req).unwrap();
            cache.release(running).unwrap();
            if layout == Layout::Unified {
                assert!(
                    cache.stats().evictions.donor_nodes > donors,
                    "{label}: the admission evicted FULL donors for its slots"
                );
            }
            let scheduling = ledger.ops();
            assert!(
                scheduling
                    .iter()
                    .all(|r| matches!(r.op, "move_spans" | "fill_spans")),
                "{label}: device work on the scheduling path: {scheduling:?}"
            );
            assert!(
                scheduling.iter().any(|r| r.op == "move_spans"),
                "{label}: the state copy is a device move"
            );
            cache.step_boundary().unwrap();
            ledger
                .check_no_syncs()
                .unwrap_or_else(|report| panic!("{label}: {report}"));
            let s = cache.stats();
            assert_eq!(s.mamba.held_pages, 0, "{label}");
        }
    }
}

/// Step metadata from the device lanes issues no host sync and allocates nothing once
/// reserved at set-up: decode steps of several requests — each writing its new pages into
/// its lane, uploading the header and translating the page tables — on the CPU backend
/// and on the CUDA backend (emulated driver, stream stalled), whose every op stages
/// through the pinned ring (no sync hazard); the last step's table names the host's ids.
#[test]
fn step_metadata_from_the_lanes_issues_no_host_sync() {
    let devices: [fn() -> Arc<dyn Readback>; 2] = [
        || Arc::new(CpuDevice::new()),
        || Arc::new(CudaDevice::emulated()),
    ];
    for device in devices {
        for_each_layout_and_page_size(|layout, ps| {
            let ledger = Arc::new(SyncLedger::new(device()));
            let config = Config {
                device: Some(ledger.clone()),
                ..Config::tokens(layout, ps, W, 40 * (W as u64).max(ps as u64), 8)
            };
            let mut fx = Fixture::new(&config);
            let keep = fx.keep();
            let mut running: Vec<unikv::Request> = (0..3)
                .map(|r| {
                    let mut req = fx.admit(text(100_000 * (r + 1), keep + 1));
                    fx.prefill(&mut req, keep + 1);
                    req
                })
                .collect();
            fx.cache
                .reserve_step_metadata(unikv::StepCapacity {
                    requests: 4,
                    max_len: 4 * keep + 64,
                    max_new_tokens: 4,
                    max_loaded_pages: 0,
                })
                .unwrap();
            let mut meta = unikv::StepMetadata::new();
            // The step table's set-up: the first build allocates it.
            let batch: Vec<(&unikv::Request, usize)> = running.iter().map(|r| (r, 1)).collect();
            fx.cache.build_step_metadata(&mut meta, &batch).unwrap();
            drop(batch);
            fx.step();
            ledger.reset();
            for step in 0..2 * keep {
                let mut batch: Vec<&mut unikv::Request> = running.iter_mut().collect();
                let tokens = vec![TokenId(7 + step as u32); batch.len()];
                fx.cache.alloc_decode(&mut batch, &tokens).unwrap();
                let batch: Vec<(&unikv::Request, usize)> = running.iter().map(|r| (r, 1)).collect();
                fx.cache.build_step_metadata(&mut meta, &batch).unwrap();
                assert!(fx.cache.step_view(&meta).is_ok(), "{}", fx.label);
                drop(batch);
                fx.step();
            }
            ledger
                .check_no_syncs()
                .unwrap_or_else(|report| panic!("{}: {report}", fx.label));
            assert_eq!((ledger.syncs(), ledger.data_dependent_shapes()), (0, 0));
            let ops: Vec<&str> = ledger.ops().iter().map(|r| r.op).collect();
            assert!(
                !ops.contains(&"alloc_table") && ops.contains(&"translate_lanes"),
                "{}: {ops:?}",
                fx.label
            );
            fx.teardown(running);
        });
    }
}

/// The host tier's paths wait for nothing either: with a long kernel holding the stream,
/// an eviction that writes a prefix back, a step boundary that finds the copy still
/// running (its device pages stay parked), an admission that loads the prefix back from
/// the host, the step's metadata listing the load, and the next boundaries all return
/// while the kernel runs, with zero host syncs; once the stream drains, a boundary frees
/// the parked pages.
#[test]
fn the_host_tier_writes_back_and_loads_back_while_the_gpu_is_still_busy() {
    for model in [tiny_model(W, 1), TINY_TRI] {
        for layout in LAYOUTS {
            let dev = Arc::new(CudaDevice::emulated());
            let ledger = Arc::new(SyncLedger::new(dev.clone()));
            let label = format!("{} {}", model.name, layout.as_str());
            let ps = 16;
            let mut cache = unikv::HybridCache::builder()
                .model(model)
                .layout(layout)
                .page_size(ps as u32)
                .memory_bytes(1 << 22)
                .host_memory_bytes(1 << 22)
                .device(ledger.clone())
                .build()
                .unwrap();
            let first = text(1, 8 * ps + 1);
            let next = concat(&first, &text(2, ps + 1));
            let prefill = |cache: &mut unikv::HybridCache, p: &[TokenId]| {
                let hit = cache.match_prefix(p.to_vec());
                let mut req = cache.admit(hit).unwrap();
                let n = req.remaining_prefill();
                cache.alloc_extend(&mut req, n).unwrap();
                (req, n)
            };
            // Set-up: the step table is shaped for the load-back too, and the first
            // build allocates it.
            cache
                .reserve_step_metadata(unikv::StepCapacity {
                    requests: 2,
                    max_len: 16 * ps,
                    max_new_tokens: 16 * ps,
                    max_loaded_pages: 16,
                })
                .unwrap();
            let mut meta = unikv::StepMetadata::new();
            let (a, n) = prefill(&mut cache, &first);
            cache.build_step_metadata(&mut meta, &[(&a, n)]).unwrap();
            cache.cache_finished(a).unwrap();
            cache.step_boundary().unwrap();
            ledger.reset();

            let spin = dev.enqueue_spin(2_000_000_000).unwrap();
            let s = cache.stats();
            // Everything is evicted, but the write-back is queued behind the kernel: its
            // pages stay held, so the room asked for is not there yet.
            let evicted = cache.evict_to_free(s.full.available_pages + s.full.evictable_pages, 0);
            assert!(
                matches!(evicted, Err(unikv::Error::OutOfMemory { .. })),
                "{label}: {evicted:?}"
            );
            assert_eq!(cache.stats().full.evictable_pages, 0, "{label}");
            cache.step_boundary().unwrap();
            let hit = cache.match_prefix(next.clone());
            assert!(hit.host_tokens() > 0, "{label}");
            let (b, n) = prefill(&mut cache, &next);
            cache.build_step_metadata(&mut meta, &[(&b, n)]).unwrap();
            assert!(!cache.step_view(&meta).unwrap().request(0).loaded.is_empty());
            cache.cache_finished(b).unwrap();
            cache.step_boundary().unwrap();
            assert!(
                !spin.is_done().unwrap(),
                "{label}: a step waited for the stream"
            );
            ledger
                .check_no_syncs()
                .unwrap_or_else(|report| panic!("{label}: {report}"));
            assert!(cache.stats().host.unwrap().copies >= 2, "{label}");
            // Only the write-back's parked pages are still held.
            cache.evict_all().unwrap();
            cache.step_boundary().unwrap();
            let s = cache.stats();
            assert!(s.full.available_pages < s.full.total_pages, "{label}");

            dev.synchronize(&unikv::kernels::HostSync::acquire("test: end of the proof"))
                .unwrap();
            cache.step_boundary().unwrap();
            cache.evict_all().unwrap();
            cache.step_boundary().unwrap();
            let s = cache.stats();
            assert_eq!(s.full.available_pages, s.full.total_pages, "{label}");
        }
    }
}

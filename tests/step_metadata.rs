//! Step metadata: what an attention kernel reads for a batch is what the host tables say
//! after the step's allocations — FULL ids of every row, SWA ids of the rows inside the
//! window of the step's first new token, write locations, state slots — and the device
//! table holds the same entries. Metadata built before a compaction moved its pages (or
//! before any other table change) is refused with a typed error, never read.

mod common;

use common::*;
use std::sync::Arc;
use unikv::kernels::{CpuDevice, CudaDevice, HostSync, Readback, SyncLedger};
use unikv::pools::{Side, SwaState};
use unikv::{
    DeviceLayout, Error, HybridCache, Layout, Request, StepCapacity, StepMetadata, StepView,
    TokenId,
};

const W: u32 = 8;

/// The cache these tests run: window `W`, room for 64 windows (or pages), an eviction
/// interval of 16.
fn config(layout: Layout, ps: u32) -> Config {
    Config::tokens(layout, ps, W, 64 * (W as u64).max(ps as u64), 16)
}

/// The device table's entries (what kernels read).
fn device_table(cpu: &CpuDevice, view: &StepView<'_>) -> Vec<i32> {
    let sync = HostSync::acquire("test: reading the step table back");
    cpu.read_table(
        &sync,
        view.device_table().expect("a table"),
        0,
        view.device_layout().len,
    )
    .unwrap()
}

/// Request `i`'s SWA kernel ids of rows `[swa_first, len)`, read from the device table.
fn swa_ids(view: &StepView<'_>, table: &[i32], i: usize) -> Vec<i32> {
    let m = view.request(i);
    (m.swa_first..m.len)
        .map(|p| m.swa_id(table, p).unwrap())
        .collect()
}

/// Checks every entry of `view` — the header on the host, the page tables the device
/// wrote — against the host tables, and the device table's header against the host's.
fn check_view(
    cache: &HybridCache,
    view: &StepView<'_>,
    batch: &[(&Request, usize)],
    cpu: &CpuDevice,
    label: &str,
) {
    let alloc = cache.allocator();
    let table = device_table(cpu, view);
    let ps = cache.page_size();
    let layout = view.device_layout();
    assert_eq!(view.len(), batch.len(), "{label}");
    for (i, &(req, n)) in batch.iter().enumerate() {
        let m = view.request(i);
        assert_eq!((m.request, m.len, m.new_tokens), (req.id(), req.len(), n));
        let full: Vec<i32> = req
            .row()
            .iter()
            .map(|&t| alloc.kernel_id(Side::Full, t))
            .collect();
        let read: Vec<i32> = (0..m.len).map(|p| m.full_id(&table, p).unwrap()).collect();
        assert_eq!(read, full, "{label}: FULL ids of request {i}");
        assert_eq!(m.full_id(&table, m.len), None);
        assert_eq!(m.full_pages().len(), req.len().div_ceil(ps), "{label}");
        assert_eq!(
            table[layout.full_last + i] as usize,
            req.len() - (m.full_pages().len() - 1) * ps,
            "{label}: last page length"
        );
        assert!(
            full.iter().all(|&k| k > 0),
            "{label}: a FULL row reads the sink"
        );
        assert_eq!(m.write_full, &full[req.len() - n..], "{label}: FULL writes");
        let first = (req.len() - n + 1).saturating_sub(W as usize);
        assert_eq!(m.swa_first, first, "{label}");
        let swa: Vec<i32> = req.row()[first..]
            .iter()
            .map(|&t| alloc.kernel_id(Side::Swa, t))
            .collect();
        assert_eq!(
            swa_ids(view, &table, i),
            swa,
            "{label}: SWA ids of request {i}"
        );
        assert!(
            swa.iter().all(|&k| k > 0),
            "{label}: a window row reads the sink"
        );
        assert_eq!(m.write_swa, &swa[swa.len() - n..], "{label}: SWA writes");
        assert_eq!(m.swa_id(&table, first.wrapping_sub(1)), None);
        assert_eq!(m.state_slot, None, "{label}: no recurrent layers");
    }
    let image = view.host_image();
    assert_eq!(image.len(), layout.header_len());
    let starts = &image[layout.query_starts..layout.query_starts + batch.len() + 1];
    let mut want = vec![0];
    for &(_, n) in batch {
        want.push(want.last().unwrap() + n as i32);
    }
    assert_eq!(starts, &want[..], "{label}: cu_seqlens_q");
    assert_eq!(
        &table[..layout.header_len()],
        image,
        "{label}: the device table's header is the host image"
    );
}

#[test]
fn metadata_names_the_host_kernel_ids_and_is_uploaded_in_one_op() {
    for_each_layout_and_page_size(|layout, ps| {
        let cpu = Arc::new(CpuDevice::new());
        let ledger = Arc::new(SyncLedger::new(cpu.clone()));
        let config = Config {
            device: Some(ledger.clone()),
            ..config(layout, ps)
        };
        let mut fx = Fixture::new(&config);
        let keep = fx.keep();
        // A decoding request past its first window release, and one prefilling.
        let mut decoding = fx.admit(text(1, 2 * keep + 3));
        fx.prefill(&mut decoding, keep);
        fx.decode(&mut decoding, keep + fx.interval, 9_000);
        assert!(decoding.window_cursor() > 0, "{}: released", fx.label);
        let mut prefilling = fx.admit(text(50_000, 3 * keep));
        fx.cache.alloc_extend(&mut prefilling, keep).unwrap();
        fx.step();

        let chunk = keep + 1;
        fx.cache.alloc_extend(&mut prefilling, chunk).unwrap();
        fx.cache
            .alloc_decode(&mut [&mut decoding], &[TokenId(7)])
            .unwrap();
        // Lanes for both requests' whole prompts, sized at set-up.
        fx.cache
            .reserve_step_metadata(StepCapacity {
                requests: 2,
                max_len: 8 * (keep + fx.interval),
                max_new_tokens: 4 * keep,
                max_loaded_pages: 0,
            })
            .unwrap();
        let mut meta = StepMetadata::new();
        ledger.reset();
        let batch = [(&prefilling, chunk), (&decoding, 1)];
        fx.cache.build_step_metadata(&mut meta, &batch).unwrap();
        // Past the set-up of the table (the first build allocates it), the mirror upload this step's allocations made due, the new pages written into
        // the lanes, the header's one upload and the one translation of the page tables.
        let ops: Vec<&str> = ledger
            .ops()
            .iter()
            .map(|r| r.op)
            .filter(|&op| op != "alloc_table" && op != "free_table")
            .collect();
        assert_eq!(
            ops[1..],
            ["scatter_tables", "upload_table", "translate_lanes"],
            "{}: {ops:?}",
            fx.label
        );
        assert_eq!(ledger.syncs(), 0);
        let view = fx.cache.step_view(&meta).expect("current metadata");
        check_view(&fx.cache, &view, &batch, &cpu, &fx.label);

        // The next step reuses the table: one upload, nothing allocated.
        fx.step();
        fx.cache
            .alloc_decode(&mut [&mut decoding], &[TokenId(8)])
            .unwrap();
        ledger.reset();
        let batch = [(&decoding, 1)];
        fx.cache.build_step_metadata(&mut meta, &batch).unwrap();
        let ops: Vec<&str> = ledger.ops().iter().map(|r| r.op).collect();
        assert!(
            ops.ends_with(&["upload_table", "translate_lanes"]),
            "{}: {ops:?}",
            fx.label
        );
        assert!(!ops.contains(&"alloc_table"), "{}: {ops:?}", fx.label);
        let view = fx.cache.step_view(&meta).unwrap();
        check_view(&fx.cache, &view, &batch, &cpu, &fx.label);
        fx.step();
        fx.teardown(vec![decoding, prefilling]);
    });
}

/// The `holed` cache of tests/mirror_epoch.rs: a long request whose released SWA left
/// holes, so the next three-page allocation fits only by compacting.
#[test]
fn metadata_built_before_a_compacting_allocation_is_refused_and_a_rebuild_names_the_moved_pages() {
    for ps in page_sizes() {
        let cpu = Arc::new(CpuDevice::new());
        let ledger = Arc::new(SyncLedger::new(cpu.clone()));
        let joint = (W + ps).div_ceil(ps) as usize + 6;
        let mut config = Config::new(Layout::Unified, ps, W, joint as u64);
        config.device = Some(ledger.clone());
        let mut fx = Fixture::new(&config);
        let ps = ps as usize;
        let mut long = fx.admit(text(1, (joint - 1) * ps));
        fx.prefill(&mut long, (joint - 1) * ps);
        assert!(fx.cache.release_out_of_window(&mut long).unwrap() > 0);
        fx.step();

        let mut meta = StepMetadata::new();
        assert!(matches!(
            fx.cache.step_view(&meta),
            Err(Error::UnbuiltStepMetadata)
        ));
        fx.cache
            .build_step_metadata(&mut meta, &[(&long, 1)])
            .unwrap();
        let before = {
            let view = fx.cache.step_view(&meta).unwrap();
            swa_ids(&view, &device_table(&cpu, &view), 0)
        };
        let moves = |l: &SyncLedger| l.ops().iter().filter(|r| r.op == "move_spans").count();
        let moves_before = moves(&ledger);
        let mut req = fx.admit(text(7_000, 3 * ps + 1));
        fx.cache.alloc_extend(&mut req, 3 * ps).unwrap();
        assert!(moves(&ledger) > moves_before, "{}: compacted", fx.label);
        match fx.cache.step_view(&meta) {
            Err(Error::StaleStepMetadata {
                tables_changed: true,
                ..
            }) => {}
            other => panic!("{}: stale metadata was readable: {other:?}", fx.label),
        }
        // An upload (here the cache's translate path) does not make it current again.
        fx.cache
            .build_step_metadata(&mut StepMetadata::new(), &[])
            .unwrap();
        assert!(matches!(
            fx.cache.step_view(&meta),
            Err(Error::StaleStepMetadata {
                tables_changed: false,
                ..
            })
        ));
        fx.cache
            .build_step_metadata(&mut meta, &[(&long, 1), (&req, 3 * ps)])
            .unwrap();
        let view = fx.cache.step_view(&meta).unwrap();
        let after = swa_ids(&view, &device_table(&cpu, &view), 0);
        assert_ne!(
            before, after,
            "{}: compaction moved the long request's window",
            fx.label
        );
        check_view(
            &fx.cache,
            &view,
            &[(&long, 1), (&req, 3 * ps)],
            &cpu,
            &fx.label,
        );
        // Another cache cannot read it.
        let other = Config::new(Layout::Unified, ps as u32, W, joint as u64).build();
        assert!(matches!(
            other.step_view(&meta),
            Err(Error::UnbuiltStepMetadata)
        ));
        fx.step();
        fx.teardown(vec![long, req]);
    }
}

#[test]
fn bad_batches_are_refused_and_leave_the_metadata_unreadable() {
    let mut fx = Fixture::new(&Config::new(Layout::Unified, 4, W, 32));
    let mut req = fx.admit(text(1, 10));
    fx.cache.alloc_extend(&mut req, 10).unwrap();
    let mut meta = StepMetadata::new();
    fx.cache
        .build_step_metadata(&mut meta, &[(&req, 10)])
        .unwrap();
    assert!(fx.cache.step_view(&meta).is_ok());
    assert!(matches!(
        fx.cache.build_step_metadata(&mut meta, &[(&req, 11)]),
        Err(Error::BadRequest { .. })
    ));
    assert!(matches!(
        fx.cache.step_view(&meta),
        Err(Error::UnbuiltStepMetadata)
    ));
    let mut other = Config::new(Layout::Unified, 4, W, 32).build();
    assert!(matches!(
        other.build_step_metadata(&mut meta, &[(&req, 1)]),
        Err(Error::ForeignRequest { .. })
    ));
    fx.step();
    fx.teardown(vec![req]);
}

/// A recurrent model's checkpoint writes are a prefix-summed section of the device table:
/// `checkpoint_starts` (B + 1 entries), then each write's physical slot and position in
/// batch order, as [`Request::checkpoint_writes`] lists them and the view reads them.
#[test]
fn checkpoint_writes_are_a_prefix_summed_section_of_the_step_table() {
    for layout in LAYOUTS {
        for ps in page_sizes() {
            let cpu = Arc::new(CpuDevice::new());
            let mut cache = HybridCache::builder()
                .model(TINY_TRI)
                .page_size(ps)
                .memory_bytes(1 << 20)
                .layout(layout)
                .checkpoint_interval(64.max(ps))
                .device(cpu.clone())
                .build()
                .unwrap();
            let label = format!("{} ps {ps}", layout.as_str());
            let admit = |cache: &mut HybridCache, base: u32, n: u32| {
                let hit = cache.match_prefix((base..base + n).map(TokenId).collect());
                cache.admit(hit).unwrap()
            };
            // One request saving nothing this step, one saving two states.
            let mut quiet = admit(&mut cache, 0, 8);
            cache.alloc_extend(&mut quiet, 4).unwrap();
            // Two and a half grid intervals: a grid point and the prompt's last page.
            let g = 64.max(ps);
            let n = 2 * g + g / 2;
            let mut saving = admit(&mut cache, 100_000, n);
            cache.alloc_extend(&mut saving, n as usize).unwrap();
            assert!(quiet.checkpoint_writes().is_empty(), "{label}");
            assert_eq!(saving.checkpoint_writes().len(), 2, "{label}");
            let mut meta = StepMetadata::new();
            let batch = [(&quiet, 4), (&saving, n as usize)];
            cache.build_step_metadata(&mut meta, &batch).unwrap();
            let view = cache.step_view(&meta).unwrap();
            let l = view.device_layout();
            let image = view.host_image();
            assert_eq!(
                &image[l.checkpoint_starts..l.checkpoint_starts + 3],
                &[0, 0, 2],
                "{label}"
            );
            let alloc = cache.allocator();
            for (k, w) in saving.checkpoint_writes().iter().enumerate() {
                let slot = alloc.physical_slot(w.slot).unwrap();
                assert_eq!(image[l.checkpoint_slots + k], slot as i32, "{label}");
                assert_eq!(image[l.checkpoint_at + k], w.at_len as i32, "{label}");
                assert_eq!(view.request(1).checkpoints[k].slot, slot, "{label}");
                assert_eq!(view.request(1).checkpoints[k].at_len, w.at_len, "{label}");
            }
            assert!(view.request(0).checkpoints.is_empty(), "{label}");
            // The section holds the batch's two (and room for the shape's capacity).
            assert!(l.checkpoint_at + 2 <= l.header_len(), "{label}");
            let device = device_table(&cpu, &view);
            assert_eq!(&device[..l.header_len()], image, "{label}");
            cache.release(quiet).unwrap();
            cache.release(saving).unwrap();
        }
    }
}

/// A step whose window reaches below a request's window cursor would read released SWA
/// (the sink): the build counts it as the breach `step.window_live`, which fails the
/// step boundary at strict; a window at or above the cursor is no breach.
#[test]
fn a_window_below_the_window_cursor_is_a_window_live_breach() {
    use unikv::invariants::{Error as InvariantError, Level, scoped_level};
    scoped_level(Level::Strict, || {
        for_each_layout_and_page_size(|layout, ps| {
            let mut fx = Fixture::new(&config(layout, ps));
            let keep = fx.keep();
            let mut req = fx.admit(text(1, 2 * keep + 3));
            fx.prefill(&mut req, keep);
            fx.decode(&mut req, keep + fx.interval, 9_000);
            let cursor = req.window_cursor();
            assert!(cursor > 0, "{}: released", fx.label);
            let mut meta = StepMetadata::new();
            // A query's window starts W − 1 rows below it: at the cursor itself when the
            // first new row is `cursor + W − 1`.
            let at_cursor = req.len() - (cursor + W as usize - 1);
            fx.cache
                .build_step_metadata(&mut meta, &[(&req, at_cursor)])
                .unwrap();
            fx.step();
            fx.cache
                .build_step_metadata(&mut meta, &[(&req, at_cursor + 1)])
                .unwrap();
            match fx.cache.step_boundary() {
                Err(Error::Invariants(InvariantError::Violated(v))) => {
                    assert_eq!(v.failures.len(), 1, "{}: {v}", fx.label);
                    assert_eq!(v.failures[0].name, "step.window_live", "{}", fx.label);
                }
                other => panic!("{}: no breach: {other:?}", fx.label),
            }
            // The breach stays in the scope's report: no teardown's clean check.
            fx.cache.release(req).unwrap();
        });
    });
}

/// A chunk cached before its step's forward (`cache_unfinished` between the step's
/// allocations, as a scheduler does that lets a later admission of the step hit it)
/// keeps what that forward reads, its SWA and the window before it: evicting every SWA
/// page it can later in the step tombstones none of it, so the step's metadata reads no
/// released row. From the boundary on it is cache like any other: the same eviction then
/// leaves only the window the request still holds.
#[test]
fn a_chunk_cached_mid_step_keeps_the_window_its_forward_reads() {
    use unikv::invariants::{Level, scoped_level};
    scoped_level(Level::Strict, || {
        for_each_layout_and_page_size(|layout, ps| {
            let mut fx = Fixture::new(&config(layout, ps));
            let chunk = 4 * fx.keep();
            let mut req = fx.admit(text(1, 2 * chunk + 1));
            fx.cache.alloc_extend(&mut req, chunk).unwrap();
            fx.cache.cache_unfinished(&mut req).unwrap();
            fx.step();
            // The second chunk's queries read from `chunk - W` on.
            fx.cache.alloc_extend(&mut req, chunk).unwrap();
            fx.cache.cache_unfinished(&mut req).unwrap();
            // One SWA page more than fits, until no SWA is evictable.
            let evict_every_swa_page = |fx: &mut Fixture| {
                while fx.cache.tree().sizes().swa_evictable.0 > 0 {
                    let more = fx.cache.stats().swa.schedulable_pages + 1;
                    fx.cache.evict_to_free(0, more).unwrap();
                }
            };
            evict_every_swa_page(&mut fx);
            let read = chunk - W as usize;
            let swa = |fx: &Fixture, req: &Request| fx.swa_state(req.row()[read]);
            assert_eq!(swa(&fx, &req), SwaState::Live, "{}", fx.label);
            let mut meta = StepMetadata::new();
            fx.cache
                .build_step_metadata(&mut meta, &[(&req, chunk)])
                .unwrap();
            fx.step();
            evict_every_swa_page(&mut fx);
            assert_eq!(swa(&fx, &req), SwaState::Tombstone, "{}", fx.label);
            fx.check_request(&req);
            fx.teardown(vec![req]);
        });
    });
}

/// Once shaped by `reserve_step_metadata`, every step's table has the same layout — every
/// section at the same offset, whatever the batch (its requests past the batch are padding
/// with empty runs) — so a CUDA graph captured once reads it; a step beyond the capacity
/// grows it and changes the layout.
#[test]
fn a_reserved_capacity_gives_every_step_the_same_layout() {
    for_each_layout_and_page_size(|layout, ps| {
        let mut fx = Fixture::new(&config(layout, ps));
        let keep = fx.keep();
        fx.cache
            .reserve_step_metadata(StepCapacity {
                requests: 4,
                max_len: 4 * keep,
                max_new_tokens: keep + 4,
                max_loaded_pages: 0,
            })
            .unwrap();
        let mut a = fx.admit(text(1, 2 * keep));
        fx.prefill(&mut a, keep);
        let mut meta = StepMetadata::new();
        fx.cache
            .build_step_metadata(&mut meta, &[(&a, keep)])
            .unwrap();
        let first = fx.cache.step_view(&meta).unwrap().device_layout();
        fx.step();
        let mut b = fx.admit(text(50_000, keep));
        fx.cache.alloc_extend(&mut b, keep).unwrap();
        fx.cache.alloc_decode(&mut [&mut a], &[TokenId(3)]).unwrap();
        fx.cache
            .build_step_metadata(&mut meta, &[(&b, keep), (&a, 1)])
            .unwrap();
        let view = fx.cache.step_view(&meta).unwrap();
        let second = view.device_layout();
        assert_eq!((first.batch, second.batch), (1, 2), "{}", fx.label);
        assert_eq!(
            DeviceLayout { batch: 0, ..first },
            DeviceLayout { batch: 0, ..second },
            "{}: the same layout",
            fx.label
        );
        // The padding requests' runs are empty: their prefix sums repeat the total.
        let image = view.host_image();
        let starts = &image[second.full_starts..=second.full_starts + second.max_batch];
        assert!(
            starts[2..].iter().all(|&s| s == starts[2]),
            "{}: {starts:?}",
            fx.label
        );
        fx.step();
        // Five requests' worth of lanes is beyond the capacity: the shape grows.
        let mut more: Vec<Request> = (0..3)
            .map(|r| {
                let mut req = fx.admit(text(100_000 * (r + 2), 1));
                fx.cache.alloc_extend(&mut req, 1).unwrap();
                req
            })
            .collect();
        more.push(a);
        more.push(b);
        let batch: Vec<(&Request, usize)> = more.iter().map(|r| (r, 1)).collect();
        fx.cache.build_step_metadata(&mut meta, &batch).unwrap();
        let grown = fx.cache.step_view(&meta).unwrap().device_layout();
        assert!(grown.max_batch >= 5, "{}", fx.label);
        assert_ne!(grown.len, second.len, "{}", fx.label);
        drop(batch);
        fx.step();
        fx.teardown(more);
    });
}

/// A load-back is device work listed in the step metadata: the step that admits a
/// request with a host hit lists, in its fixed-shape `load_*` sections, each page the
/// load brought in (its FULL kernel id, its SWA kernel id when the host held its
/// window, the host units it came from) and the state it loaded, host- and
/// device-built alike; the next step lists nothing. A cache without a host tier has
/// no such sections.
#[test]
fn load_backs_are_sections_of_the_step_table() {
    for model in [tiny_model(W, 1), TINY_MAMBA, TINY_TRI] {
        for_each_layout_and_page_size(|layout, ps| {
            let label = format!("{} {} ps {ps}", model.name, layout.as_str());
            let ps = ps as usize;
            let build = |host: u64| {
                HybridCache::builder()
                    .model(model)
                    .layout(layout)
                    .page_size(ps as u32)
                    .memory_bytes(1 << 22)
                    .host_memory_bytes(host)
                    .device(Arc::new(CpuDevice::new()))
                    .build()
                    .unwrap()
            };
            let first = text(1, 8 * ps + 1);
            let next = concat(&first, &text(2, ps + 1));
            let prefill = |cache: &mut HybridCache, p: &[TokenId]| {
                let hit = cache.match_prefix(p.to_vec());
                let mut req = cache.admit(hit).unwrap();
                let n = req.remaining_prefill();
                cache.alloc_extend(&mut req, n).unwrap();
                (req, n)
            };
            let mut meta = StepMetadata::new();

            // Without a host tier the sections are empty.
            let mut plain = build(0);
            let (req, n) = prefill(&mut plain, &first);
            plain.build_step_metadata(&mut meta, &[(&req, n)]).unwrap();
            let l = plain.step_view(&meta).unwrap().device_layout();
            assert_eq!(
                (l.load_starts, l.load_states),
                (l.full_pages, l.full_pages),
                "{label}: no load sections"
            );
            plain.release(req).unwrap();

            let mut cache = build(1 << 22);
            let (a, _) = prefill(&mut cache, &first);
            cache.cache_finished(a).unwrap();
            cache.step_boundary().unwrap();
            common::evict_all_evictable(&mut cache);
            let hit = cache.match_prefix(next.clone());
            let loaded = hit.host_tokens();
            assert!(loaded > 0 && hit.device_tokens() == 0, "{label}");
            let (b, n) = prefill(&mut cache, &next);
            cache.build_step_metadata(&mut meta, &[(&b, n)]).unwrap();
            let view = cache.step_view(&meta).unwrap();
            let (l, img, m) = (view.device_layout(), view.host_image(), view.request(0));
            let alloc = cache.allocator();
            let has_swa = model.swa_layers > 0;
            assert_eq!(m.loaded.len(), loaded / ps, "{label}");
            for (k, p) in m.loaded.iter().enumerate() {
                assert_eq!(p.at, k * ps, "{label}");
                let row = b.row()[p.at];
                assert_eq!(p.full, alloc.kernel_id(Side::Full, row), "{label}");
                assert_eq!(img[l.load_full + k], p.full, "{label}");
                assert_eq!(img[l.load_host_full + k], p.host_full as i32, "{label}");
                if has_swa {
                    let swa = p.host_swa.map_or(0, |_| alloc.kernel_id(Side::Swa, row));
                    assert_eq!((p.swa, img[l.load_swa + k]), (swa, swa), "{label}");
                    let unit = p.host_swa.map_or(-1, |u| u as i32);
                    assert_eq!(img[l.load_host_swa + k], unit, "{label}");
                }
            }
            // The window behind the loaded end came from the host.
            assert_eq!(
                m.loaded.last().unwrap().host_swa.is_some(),
                has_swa,
                "{label}"
            );
            let starts = &img[l.load_starts..=l.load_starts + l.max_batch];
            assert_eq!(starts[0], 0, "{label}");
            assert!(
                starts[1..].iter().all(|&s| s == m.loaded.len() as i32),
                "{label}"
            );
            let state = model.has_recurrent_state();
            assert_eq!(m.loaded_state.is_some(), state, "{label}");
            if state {
                let unit = m.loaded_state.map_or(-1, |u| u as i32);
                assert_eq!(img[l.load_states], unit, "{label}");
                assert!(
                    img[l.load_states + 1..l.load_states + l.max_batch]
                        .iter()
                        .all(|&u| u == -1)
                );
            }
            // Each host unit lies inside the host buffer.
            let g = cache.host_geometry().unwrap();
            let end = cache.stats().host.unwrap().total_bytes;
            for p in m.loaded {
                let at = g.offset(unikv::pools::HostKind::Full, p.host_full).unwrap();
                assert!(at + g.unit_bytes[0] <= end, "{label}");
            }
            // The host-built table has the same header.
            let header = img[..l.header_len()].to_vec();
            let mut on_host = StepMetadata::new();
            cache
                .build_step_metadata_on_host(&mut on_host, &[(&b, n)])
                .unwrap();
            let host_view = cache.step_view(&on_host).unwrap();
            assert_eq!(
                host_view.host_image()[..l.header_len()],
                header[..],
                "{label}"
            );
            let listed: Vec<unikv::LoadedPage> = host_view.request(0).loaded.to_vec();
            let view = cache.step_view(&on_host).unwrap();
            assert_eq!(listed, view.request(0).loaded, "{label}");

            // The next step lists nothing: its decode loaded no page.
            let mut b = b;
            cache.step_boundary().unwrap();
            cache.alloc_decode(&mut [&mut b], &[TokenId(7)]).unwrap();
            cache.build_step_metadata(&mut meta, &[(&b, 1)]).unwrap();
            let view = cache.step_view(&meta).unwrap();
            let (l, img) = (view.device_layout(), view.host_image());
            assert!(view.request(0).loaded.is_empty(), "{label}");
            assert_eq!(view.request(0).loaded_state, None, "{label}");
            let starts = &img[l.load_starts..=l.load_starts + l.max_batch];
            assert!(starts.iter().all(|&s| s == 0), "{label}: {starts:?}");
            cache.release(b).unwrap();
            cache.step_boundary().unwrap();
        });
    }
}

/// Two admissions of one step that both load from the host: each request of the batch,
/// in whatever order the batch lists them, names its own loaded pages, and the
/// `load_starts` prefix sums follow the batch's order.
#[test]
fn each_request_lists_its_own_load_back() {
    for_each_layout_and_page_size(|layout, ps| {
        let label = format!("{} ps {ps}", layout.as_str());
        let ps = ps as usize;
        let mut cache = HybridCache::builder()
            .model(TINY_TRI)
            .layout(layout)
            .page_size(ps as u32)
            .memory_bytes(1 << 22)
            .host_memory_bytes(1 << 22)
            .device(Arc::new(CpuDevice::new()))
            .build()
            .unwrap();
        let prefill = |cache: &mut HybridCache, p: &[TokenId]| {
            let hit = cache.match_prefix(p.to_vec());
            let mut req = cache.admit(hit).unwrap();
            let n = req.remaining_prefill();
            cache.alloc_extend(&mut req, n).unwrap();
            (req, n)
        };
        let firsts = [text(1, 8 * ps + 1), text(3, 4 * ps + 1)];
        for p in &firsts {
            let (r, _) = prefill(&mut cache, p);
            cache.cache_finished(r).unwrap();
        }
        cache.step_boundary().unwrap();
        common::evict_all_evictable(&mut cache);
        let (a, na) = prefill(&mut cache, &concat(&firsts[0], &text(2, ps + 1)));
        let (b, nb) = prefill(&mut cache, &concat(&firsts[1], &text(4, ps + 1)));
        let mut meta = StepMetadata::new();
        cache
            .build_step_metadata(&mut meta, &[(&b, nb), (&a, na)])
            .unwrap();
        let view = cache.step_view(&meta).unwrap();
        let (l, img) = (view.device_layout(), view.host_image());
        let alloc = cache.allocator();
        let mut total = 0;
        for (i, req) in [&b, &a].into_iter().enumerate() {
            let m = view.request(i);
            assert_eq!(m.request, req.id(), "{label}");
            assert_eq!(m.loaded.len(), req.cached_at_admission() / ps, "{label}");
            assert!(!m.loaded.is_empty() && m.loaded_state.is_some(), "{label}");
            for p in m.loaded {
                assert_eq!(
                    p.full,
                    alloc.kernel_id(Side::Full, req.row()[p.at]),
                    "{label}"
                );
            }
            assert_eq!(img[l.load_starts + i], total as i32, "{label}");
            total += m.loaded.len();
        }
        assert_eq!(img[l.load_starts + 2], total as i32, "{label}");
        cache.release(a).unwrap();
        cache.release(b).unwrap();
        cache.step_boundary().unwrap();
    });
}

/// One of the two identical caches of `a_captured_step_translation_replays_every_decode_step`:
/// its fixture, device, running requests and metadata.
struct Decoder {
    fx: Fixture,
    cuda: Arc<CudaDevice>,
    running: Vec<Request>,
    meta: StepMetadata,
    /// Requests admitted and finished so far.
    admitted: usize,
    finished: usize,
}

impl Decoder {
    fn new(layout: Layout, ps: u32, capacity: StepCapacity) -> Decoder {
        let cuda = Arc::new(CudaDevice::emulated());
        let config = Config {
            device: Some(cuda.clone()),
            ..Config::tokens(layout, ps, W, 2048, 16)
        };
        let mut fx = Fixture::new(&config);
        fx.cache.reserve_step_metadata(capacity).unwrap();
        Decoder {
            fx,
            cuda,
            running: Vec::new(),
            meta: StepMetadata::new(),
            admitted: 0,
            finished: 0,
        }
    }

    /// Step `step`'s allocations: every 37th step the oldest request finishes; below three
    /// running, a new one is admitted and prefilled in this step; the rest decode a token.
    /// Returns each running request's new tokens, in batch order.
    fn allocate(&mut self, step: u32) -> Vec<usize> {
        if step % 37 == 36 && !self.running.is_empty() {
            let done = self.running.remove(0);
            self.fx.cache.cache_finished(done).unwrap();
            self.finished += 1;
        }
        let decoding = self.running.len();
        let mut news = vec![1; decoding];
        if decoding > 0 {
            let tokens: Vec<TokenId> = (0..decoding as u32)
                .map(|i| TokenId(7 + step + i))
                .collect();
            let mut reqs: Vec<&mut Request> = self.running.iter_mut().collect();
            self.fx.cache.alloc_decode(&mut reqs, &tokens).unwrap();
        }
        if decoding < 3 {
            let len = 5 + (step as usize * 7) % 23;
            let mut req = self.fx.admit(text(10_000 * (step + 1), len));
            let n = req.remaining_prefill();
            self.fx.cache.alloc_extend(&mut req, n).unwrap();
            self.running.push(req);
            self.admitted += 1;
            news.push(n);
        }
        news
    }

    /// The step table as the device holds it now.
    fn table(&self) -> (DeviceLayout, Vec<i32>) {
        let view = self.fx.cache.step_view(&self.meta).unwrap();
        let layout = view.device_layout();
        let sync = HostSync::acquire("test: reading the step table back");
        let table = self
            .cuda
            .read_table(&sync, view.device_table().unwrap(), 0, layout.len)
            .unwrap();
        (layout, table)
    }
}

/// Issue 41's "one decode step in a CUDA graph": a batch decodes for 1,000 steps — requests
/// growing, one finishing every 37 steps and another admitted and prefilled in its place,
/// pages allocated so the lanes change — on the CUDA backend's emulated driver. On one
/// cache each step's device work is its eager inputs (`build_step_inputs`) and one replay
/// of a graph that captured `translate_step_tables` once, at step 0; after every step its
/// step table equals, entry for entry, the table an uncaptured `build_step_metadata` left
/// on an identical cache.
#[test]
fn a_captured_step_translation_replays_every_decode_step() {
    let capacity = StepCapacity {
        requests: 4,
        max_len: 256,
        max_new_tokens: 64,
        max_loaded_pages: 0,
    };
    for layout in [Layout::Unified, LAYOUTS[1]] {
        for ps in [1, 16] {
            let mut graphed = Decoder::new(layout, ps, capacity);
            let mut plain = Decoder::new(layout, ps, capacity);
            let label = graphed.fx.label.clone();
            let (mut graph, mut captured, mut captures) = (None, Vec::new(), 0);
            for step in 0..1000 {
                let news = graphed.allocate(step);
                assert_eq!(plain.allocate(step), news, "{label}: step {step}");
                let batch: Vec<(&Request, usize)> =
                    graphed.running.iter().zip(news.iter().copied()).collect();
                let cache = &mut graphed.fx.cache;
                cache.build_step_inputs(&mut graphed.meta, &batch).unwrap();
                if graph.is_none() || captured != graphed.meta.page_table_translation() {
                    captured = graphed.meta.page_table_translation().to_vec();
                    let meta = &graphed.meta;
                    let cache = &graphed.fx.cache;
                    graph = Some(
                        graphed
                            .cuda
                            .capture(|_| cache.translate_step_tables(meta))
                            .unwrap(),
                    );
                    captures += 1;
                }
                graphed.cuda.launch_graph(graph.as_ref().unwrap()).unwrap();
                let batch: Vec<(&Request, usize)> =
                    plain.running.iter().zip(news.iter().copied()).collect();
                plain
                    .fx
                    .cache
                    .build_step_metadata(&mut plain.meta, &batch)
                    .unwrap();
                let (got, want) = (graphed.table(), plain.table());
                assert_eq!(got.0, want.0, "{label}: step {step}: the layout");
                assert_eq!(got.1, want.1, "{label}: step {step}: the step table");
                for d in [&mut graphed, &mut plain] {
                    d.fx.step();
                    d.cuda.end_step().unwrap();
                }
            }
            assert_eq!(captures, 1, "{label}: captured once, at step 0");
            let (admitted, finished) = (graphed.admitted, graphed.finished);
            assert!(
                admitted > 20 && finished > 20,
                "{label}: {admitted} {finished}"
            );
            for d in [graphed, plain] {
                let Decoder { fx, running, .. } = d;
                fx.teardown(running);
            }
        }
    }
}

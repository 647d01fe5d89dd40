//! A refused build leaves the device as it found it. An engine that retries a build with
//! a smaller budget after an out-of-memory must not leak what the failed attempt had
//! already allocated.
//!
//! For every layout, a FULL+SWA model, a Mamba hybrid (whose static layout has a fixed
//! slot pool) and the tri-pool model, at the matrix's page sizes: the build's first,
//! second, ... device op fails in turn until the build succeeds. Each refused build must
//! return the injected device error, typed, and leave no buffer or table live on the
//! device; the successful one holds exactly the allocations the refused ones were stopped
//! at, and dropping its cache frees them all. A build refused after its allocator exists
//! (the allocator's first free group refused) frees the allocator's memory too.

mod common;

use common::probe::{Fault, Probe, ProbeState};
use common::{LAYOUTS, TINY_MAMBA, TINY_TRI, page_sizes, tiny_model};
use std::sync::{Arc, Mutex};
use unikv::kernels::{CpuDevice, Error as DeviceError, FaultInjector};
use unikv::pools::Error as PoolError;
use unikv::{Error, HybridCache, ModelSpec};

/// Room for every model here at every page size (a CPU buffer costs only what is written).
const BUDGET: u64 = 1 << 20;

/// Fails each device op of building `model` in turn, on every layout and page size, and
/// checks that nothing leaks; `allocations` is how many buffers and tables a built cache
/// holds on its device.
fn check(model: ModelSpec, allocations: usize) {
    for layout in LAYOUTS {
        for ps in page_sizes() {
            let label = format!("{} {} ps {ps}", model.name, layout.as_str());
            for n in 0.. {
                let cpu = Arc::new(CpuDevice::new());
                let faults = Arc::new(FaultInjector::new(cpu.clone()));
                faults.fail_at(n);
                let built = HybridCache::builder()
                    .model(model)
                    .page_size(ps)
                    .memory_bytes(BUDGET)
                    .layout(layout)
                    .device(faults.clone())
                    .build();
                let cache = match built {
                    Err(e) => {
                        assert!(
                            matches!(
                                &e,
                                Error::Pool(PoolError::Device(DeviceError::InjectedFault {
                                    op: "alloc_bytes" | "alloc_table",
                                    index,
                                    ..
                                })) if *index == n
                            ),
                            "{label}: the build failing at op {n} returned {e:?}"
                        );
                        assert_eq!(
                            cpu.live_allocations(),
                            0,
                            "{label}: the build refused at op {n} ({e}) left device memory"
                        );
                        continue;
                    }
                    Ok(cache) => cache,
                };
                assert!(
                    faults.injected().is_empty(),
                    "{label}: the build succeeded past an injected fault {:?}",
                    faults.injected()
                );
                // Still armed for the op past the build's last: the drop's frees must pass.
                faults.clear();
                assert_eq!(
                    (n as usize, cpu.live_allocations()),
                    (allocations, allocations),
                    "{label}: (refused builds, allocations the built cache holds)"
                );
                drop(cache);
                assert_eq!(
                    cpu.live_allocations(),
                    0,
                    "{label}: a dropped cache left device memory"
                );
                break;
            }
        }
    }
}

/// FULL and SWA: the buffer and both sides' mirror tables.
#[test]
fn a_refused_build_of_a_sliding_window_model_frees_what_it_allocated() {
    check(tiny_model(8, 1), 3);
}

/// FULL and Mamba state slots (the static layout's fixed slot pool): the buffer, the FULL
/// mirror and the slot mirror.
#[test]
fn a_refused_build_of_a_recurrent_model_frees_what_it_allocated() {
    check(TINY_MAMBA, 3);
}

/// FULL, SWA and Mamba state slots: the buffer and three mirror tables.
#[test]
fn a_refused_build_of_a_tri_pool_model_frees_what_it_allocated() {
    check(TINY_TRI, 4);
}

/// The allocator is built, then its first free group is refused: the build returns that
/// error and the allocator, dropped with it, frees its buffer and tables.
#[test]
fn a_build_refused_after_its_allocator_exists_frees_the_allocator() {
    for model in [tiny_model(8, 1), TINY_MAMBA, TINY_TRI] {
        for layout in LAYOUTS {
            let label = format!("{} {}", model.name, layout.as_str());
            let cpu = Arc::new(CpuDevice::new());
            let probe = Arc::new(Mutex::new(ProbeState::default()));
            probe.lock().unwrap().fail_once = Some(Fault::FreeGroupBegin);
            let wrapped = probe.clone();
            let built = HybridCache::builder()
                .model(model)
                .memory_bytes(BUDGET)
                .layout(layout)
                .device(cpu.clone())
                .wrap_allocator(move |inner| Box::new(Probe::new(inner, wrapped)))
                .build();
            assert!(
                matches!(built, Err(Error::Pool(PoolError::BadConfig(_)))),
                "{label}: {built:?}"
            );
            assert_eq!(probe.lock().unwrap().injected, 1, "{label}");
            assert_eq!(
                cpu.live_allocations(),
                0,
                "{label}: the refused build left device memory"
            );
        }
    }
}

/// A dropped cache frees its step table too: after a step's metadata was built and
/// uploaded, the device holds nothing once the cache is gone.
#[test]
fn a_dropped_cache_frees_its_step_table() {
    for ps in page_sizes() {
        let cpu = Arc::new(CpuDevice::new());
        let mut cache = HybridCache::builder()
            .model(TINY_TRI)
            .page_size(ps)
            .memory_bytes(BUDGET)
            .device(cpu.clone())
            .build()
            .unwrap();
        let hit = cache.match_prefix((0..40).map(unikv::TokenId).collect());
        let mut req = cache.admit(hit).unwrap();
        cache.alloc_extend(&mut req, 40).unwrap();
        let mut meta = unikv::StepMetadata::new();
        cache.build_step_metadata(&mut meta, &[(&req, 40)]).unwrap();
        assert!(cache.step_view(&meta).unwrap().device_table().is_some());
        cache.release(req).unwrap();
        drop(cache);
        assert_eq!(cpu.live_allocations(), 0, "ps {ps}");
    }
}

#[test]
fn a_refused_table_growth_leaks_nothing_and_keeps_the_old_table() {
    for ps in page_sizes() {
        let cpu = Arc::new(CpuDevice::new());
        let dev = Arc::new(FaultInjector::new(cpu.clone()));
        let mut cache = HybridCache::builder()
            .model(TINY_TRI)
            .page_size(ps)
            .memory_bytes(64 << 20)
            .device(dev.clone())
            .build()
            .unwrap();
        let admit = |cache: &mut HybridCache, from: u32, n: usize| {
            let tokens = (from..from + n as u32).map(unikv::TokenId).collect();
            let hit = cache.match_prefix(tokens);
            let mut req = cache.admit(hit).unwrap();
            cache.alloc_extend(&mut req, n).unwrap();
            req
        };
        let short = admit(&mut cache, 0, 40);
        let mut meta = unikv::StepMetadata::new();
        cache
            .build_step_metadata(&mut meta, &[(&short, 40)])
            .unwrap();
        // A step whose metadata outgrows the table: freeing the old one is refused.
        let long = admit(&mut cache, 10_000, 3_000);
        // Uploads the mirror, so the attempts below differ only in the op refused.
        cache
            .build_step_metadata(&mut meta, &[(&short, 40)])
            .unwrap();
        // Each op of the build fails in turn (allocating the bigger table, freeing the
        // old one, the uploads) until it succeeds: none leaks a table.
        let mut n = 0;
        loop {
            let live = cpu.live_allocations();
            dev.fail_at(n);
            match cache.build_step_metadata(&mut meta, &[(&long, 3_000)]) {
                Ok(()) => break,
                Err(e) => assert!(e.to_string().contains("injected fault"), "ps {ps}: {e}"),
            }
            assert_eq!(cpu.live_allocations(), live, "ps {ps}: op {n} refused");
            n += 1;
        }
        dev.clear();
        let refused: Vec<_> = dev.injected().iter().map(|f| f.op).collect();
        assert!(
            refused.contains(&unikv::kernels::DeviceOp::FreeTable),
            "ps {ps}: {refused:?}"
        );
        cache.release(short).unwrap();
        cache.release(long).unwrap();
        drop(cache);
        assert_eq!(cpu.live_allocations(), 0, "ps {ps}");
    }
}

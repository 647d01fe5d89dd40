//! Wrapping allocators forward the Mamba slot vocabulary to the allocator they wrap: the
//! test probe (`tests/common/probe.rs`) passes slot calls through its gate to the inner
//! allocator, whose answer (no slot pool on the FULL/SWA layouts) comes back unchanged.
//! The sim's recording allocator is covered in `crates/ops/src/record.rs`.

mod common;

use common::probe::{Probe, ProbeState};
use common::{Config, LAYOUTS, page_sizes};
use std::sync::{Arc, Mutex};
use unikv::pools::{DeferredKind, Error, FreeOp, KvAllocator, PageDemand, Side, VirtualSlot};

#[test]
fn the_probe_forwards_slot_calls_to_the_allocator_it_wraps() {
    for layout in LAYOUTS {
        for ps in page_sizes() {
            let state = Arc::new(Mutex::new(ProbeState::default()));
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (probe_state, record) = (state.clone(), seen.clone());
            let cache = Config::new(layout, ps, 8, 64)
                .builder()
                .wrap_allocator(move |inner| {
                    let mut probe = Probe::new(inner, probe_state);
                    let mut out = Vec::new();
                    let mut r = record.lock().unwrap();
                    r.push(probe.alloc_slots(1, &mut out).map_err(|e| e.to_string()));
                    r.push(
                        probe
                            .free_slots(&[VirtualSlot(1)])
                            .map_err(|e| e.to_string()),
                    );
                    assert!(out.is_empty());
                    // The batch form reaches the inner allocator too (a contained breach
                    // there, not a panic here).
                    probe.free_batch(&[FreeOp::Slots(&[VirtualSlot(1)])]);
                    Box::new(probe)
                })
                .build()
                .unwrap();
            let expected = [
                Error::NoSlotPool { op: "alloc_slots" }.to_string(),
                Error::NoSlotPool { op: "free_slots" }.to_string(),
            ];
            let seen = seen.lock().unwrap();
            assert_eq!(*seen, expected.map(Err), "{layout:?}/{ps}");
            // Both went through the probe's gate (counted as fallible calls).
            assert!(state.lock().unwrap().fallible_calls >= 2);
            let alloc = cache.allocator();
            assert_eq!(alloc.mirror_table(Side::Mamba), None);
            assert!(!alloc.allocation_fits(PageDemand::slots(1)));
            let pending = alloc.pending_frees();
            assert_eq!(pending[4], (DeferredKind::Slots, 0));
        }
    }
}

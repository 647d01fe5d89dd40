//! Mirror epochs: within a step an allocation may compact, rewriting the host tables
//! while the device mirror still names the old pages. A device translation in that
//! window either refuses (the allocator's `translate`) or uploads first
//! (`HybridCache::translate`), so no kernel id comes from a stale mirror.

mod common;

use common::*;
use std::sync::Arc;
use unikv::kernels::{CpuDevice, Device, HostSync, Readback, SyncLedger};
use unikv::pools::{Error as PoolError, Side, SideTranslation};
use unikv::{Layout, Request};

const W: u32 = 8;

/// A unified cache nearly full with one long request that left the window far behind:
/// its released SWA pages are holes below its live window, one joint page is left
/// between the frontiers, so a three-page allocation (SWA from the holes, FULL more than
/// the gap) fits only by compacting the SWA side. Returns the fixture, the device, its
/// ledger, the request and the pages of the allocation that must compact.
fn holed(ps: u32) -> (Fixture, Arc<CpuDevice>, Arc<SyncLedger>, Request, usize) {
    let cpu = Arc::new(CpuDevice::new());
    let ledger = Arc::new(SyncLedger::new(cpu.clone()));
    let joint = (W + ps).div_ceil(ps) as usize + 6;
    let mut config = Config::new(Layout::Unified, ps, W, joint as u64);
    config.device = Some(ledger.clone());
    let mut fx = Fixture::new(&config);
    let ps = ps as usize;
    // One chunk, then the window release: the released pages stay holes (an allocation
    // after the release would drain them first).
    let mut long = fx.admit(text(1, (joint - 1) * ps));
    fx.prefill(&mut long, (joint - 1) * ps);
    let released = fx
        .cache
        .release_out_of_window(&mut long)
        .expect("window release");
    assert!(released > 0, "{}: nothing left the window", fx.label);
    fx.step();
    (fx, cpu, ledger, long, 3)
}

#[test]
fn a_translate_after_a_compacting_allocation_is_refused_by_the_allocator_and_uploaded_first_by_the_cache()
 {
    for ps in page_sizes() {
        let (mut fx, cpu, ledger, long, pages) = holed(ps);
        let ps = ps as usize;
        assert!(fx.cache.allocator().mirror_current(), "{}", fx.label);
        let moves_before = ledger.ops().iter().filter(|r| r.op == "move_spans").count();
        // More pages than the frontier gap, fewer than the gap and the holes.
        let mut req = fx.admit(text(7_000, pages * ps + 1));
        fx.cache
            .alloc_extend(&mut req, pages * ps)
            .unwrap_or_else(|e| panic!("{}: compacting allocation: {e}", fx.label));
        let moves = ledger.ops().iter().filter(|r| r.op == "move_spans").count();
        assert!(
            moves > moves_before,
            "{}: the allocation did not compact",
            fx.label
        );
        assert!(!fx.cache.allocator().mirror_current(), "{}", fx.label);

        // The engine's tables: the new request's virtual ids, and room for kernel ids.
        let ids: Vec<i32> = req.row().iter().map(|t| t.0 as i32).collect();
        let n = ids.len();
        let dev_ids = cpu.alloc_table(n, 0).expect("ids table");
        cpu.upload_table(dev_ids, 0, &ids).expect("upload ids");
        let out = cpu.alloc_table(n, -7).expect("out table");
        for side in [Side::Full, Side::Swa] {
            let refused = fx.cache.allocator().translate(side, dev_ids, n, out, n);
            assert!(
                matches!(refused, Err(PoolError::MirrorBehind { pending }) if pending > 0),
                "{}: {side:?}: a translate on a stale mirror was not refused: {refused:?}",
                fx.label
            );
        }
        let sync = HostSync::acquire("test: reading kernel ids back");
        assert_eq!(
            cpu.read_table(&sync, out, 0, n).expect("read"),
            vec![-7; n],
            "{}: a refused translate wrote",
            fx.label
        );
        for side in [Side::Full, Side::Swa] {
            fx.cache
                .translate(side, dev_ids, n, out, n)
                .unwrap_or_else(|e| panic!("{}: {side:?}: translate: {e}", fx.label));
            assert!(fx.cache.allocator().mirror_current(), "{}", fx.label);
            let device = cpu.read_table(&sync, out, 0, n).expect("read");
            let host: Vec<i32> = req
                .row()
                .iter()
                .map(|&t| fx.cache.allocator().kernel_id(side, t))
                .collect();
            assert_eq!(
                device, host,
                "{}: {side:?}: kernel ids after the upload",
                fx.label
            );
            assert!(
                host.iter().all(|&k| k > 0),
                "{}: {side:?}: a live row translated to the sink",
                fx.label
            );
        }
        fx.step();
        fx.check_accounting(&[&long, &req]);
        fx.teardown(vec![long, req]);
    }
}

/// Both sides' translations of a step in one device op: refused as a whole on a stale
/// mirror by the allocator (nothing written), uploaded first by the cache, and then equal
/// to the host's kernel ids on both sides, through one `translate_many`.
#[test]
fn both_sides_translate_in_one_op_with_the_same_epoch_rule() {
    for ps in page_sizes() {
        let (mut fx, cpu, ledger, long, pages) = holed(ps);
        let mut req = fx.admit(text(7_000, pages * ps as usize + 1));
        fx.cache
            .alloc_extend(&mut req, pages * ps as usize)
            .unwrap();
        assert!(!fx.cache.allocator().mirror_current(), "{}", fx.label);
        let ids: Vec<i32> = req.row().iter().map(|t| t.0 as i32).collect();
        let n = ids.len();
        let dev_ids = cpu.alloc_table(n, 0).unwrap();
        cpu.upload_table(dev_ids, 0, &ids).unwrap();
        let outs = [
            cpu.alloc_table(n + 2, -7).unwrap(),
            cpu.alloc_table(n + 2, -7).unwrap(),
        ];
        let rows: Vec<SideTranslation> = [Side::Full, Side::Swa]
            .into_iter()
            .zip(outs)
            .map(|(side, out)| SideTranslation {
                side,
                ids: dev_ids,
                n,
                out,
                out_width: n + 2,
            })
            .collect();
        let refused = fx.cache.allocator().translate_many(&rows);
        assert!(
            matches!(refused, Err(PoolError::MirrorBehind { .. })),
            "{}: {refused:?}",
            fx.label
        );
        let sync = HostSync::acquire("test: reading kernel ids back");
        for out in outs {
            assert_eq!(
                cpu.read_table(&sync, out, 0, n + 2).unwrap(),
                vec![-7; n + 2]
            );
        }
        ledger.reset();
        fx.cache.translate_many(&rows).unwrap();
        let kinds: Vec<&str> = ledger.ops().iter().map(|r| r.op).collect();
        assert_eq!(
            kinds,
            ["copy_table_spans", "translate_many"],
            "{}",
            fx.label
        );
        for (row, out) in rows.iter().zip(outs) {
            let host: Vec<i32> = req
                .row()
                .iter()
                .map(|&t| fx.cache.allocator().kernel_id(row.side, t))
                .chain([0, 0])
                .collect();
            assert_eq!(
                cpu.read_table(&sync, out, 0, n + 2).unwrap(),
                host,
                "{}",
                fx.label
            );
        }
        fx.step();
        fx.teardown(vec![long, req]);
    }
}

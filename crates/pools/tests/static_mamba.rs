//! `StaticSwa` as the static baseline for Mamba hybrids: a fixed slot pool beside the KV
//! pools (`[sink floor | slots | SWA | FULL]`), slot alloc/free/copy through the free
//! family, the slot mirror, capacity and reclaim over slots, no host sync on any slot
//! path, transactional device work, a FULL/Mamba allocator without SWA, and the
//! reference engine's sizing of the slot pool.

mod common;

use common::{WINDOW, alloc_slots, assert_sound, fresh_row, full_spec, slot_spec, swa_spec};
use proptest::prelude::*;
use std::sync::Arc;
use unikv_kernels::{
    ByteSpan, CpuDevice, Device, DeviceOp, FaultInjector, HostSync, Readback, SyncLedger,
};
use unikv_pools::{
    BS1_STATE_SLOTS, DeferredKind, Error, KvAllocator, PageDemand, PrefixCaching,
    REFERENCE_MAMBA_FULL_MEMORY_RATIO, ReclaimPlan, Reclaimable, ReferenceSlotPool, Segment, Side,
    SlotFault, SlotPoolSpec, StaticSlots, StaticSwa, StaticSwaConfig, VirtualSlot, VirtualToken,
    reference_slot_pool,
};

/// Whether the config has an SWA side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kv {
    FullSwa,
    FullOnly,
}

/// A static pool with `slots` slots and room for about `pages` KV pages per side.
fn config(ps: u32, pages: u64, slots: u32, kv: Kv) -> StaticSwaConfig {
    let (full, swa) = (full_spec(), swa_spec());
    let floor = 256u64.max(swa.bytes_per_token * ps as u64);
    let slot_bytes = (slots as u64 + 1) * slot_spec().bytes_per_slot;
    let kv_bytes = match kv {
        Kv::FullSwa => pages * ps as u64 * (full.bytes_per_token + swa.bytes_per_token),
        Kv::FullOnly => pages * ps as u64 * full.bytes_per_token,
    };
    StaticSwaConfig {
        // Room for the alignment of each region.
        total_bytes: floor + slot_bytes + kv_bytes + 4 * ps as u64 * swa.bytes_per_token,
        page_size: ps,
        window: WINDOW,
        full,
        swa: (kv == Kv::FullSwa).then_some(swa),
        mamba: Some(StaticSlots {
            spec: slot_spec(),
            slots,
        }),
        swa_full_ratio: 1.0,
        zero_on_handout: true,
    }
}

/// A pool on a `SyncLedger` around the CPU device.
struct Rig {
    ledger: Arc<SyncLedger>,
    alloc: StaticSwa,
}

fn rig(ps: u32, slots: u32, kv: Kv) -> Rig {
    let ledger = Arc::new(SyncLedger::cpu());
    let device: Arc<dyn Device> = ledger.clone();
    let alloc = StaticSwa::new(device, config(ps, 32, slots, kv)).unwrap();
    Rig { ledger, alloc }
}

/// Every page size of the test matrix, both KV shapes.
fn each_case(mut f: impl FnMut(u32, Kv)) {
    for ps in unikv_invariants::testing::page_sizes() {
        for kv in [Kv::FullSwa, Kv::FullOnly] {
            f(ps, kv);
        }
    }
}

fn pending_slots(a: &StaticSwa) -> usize {
    let lists = a.pending_frees();
    assert_eq!(lists[4].0, DeferredKind::Slots);
    lists[4].1
}

/// What a refused call must leave as it was.
fn snapshot(a: &StaticSwa) -> impl PartialEq + std::fmt::Debug + use<> {
    let slots: Vec<_> = (0..=a.pool_slots() + 1)
        .map(|s| a.physical_slot(VirtualSlot(s)))
        .collect();
    (
        a.capacity(),
        a.pool_map(),
        a.pending_frees(),
        a.verify(),
        a.mirror_current(),
        slots,
    )
}

/// Bytes of a live slot's envelope.
fn slot_bytes(dev: &dyn Readback, a: &StaticSwa, s: VirtualSlot) -> Vec<u8> {
    let p = a.physical_slot(s).unwrap();
    let env = a.grid(Side::Mamba).envelope;
    dev.read_bytes(
        &HostSync::acquire("test: read a slot"),
        a.buffer(),
        p as u64 * env,
        env,
    )
    .unwrap()
}

/// Writes `value` over a live slot's envelope.
fn stamp_slot(dev: &dyn Device, a: &StaticSwa, s: VirtualSlot, value: u8) {
    let p = a.physical_slot(s).unwrap();
    let env = a.grid(Side::Mamba).envelope;
    let span = ByteSpan {
        offset: p as u64 * env,
        len: env,
    };
    dev.fill_spans(a.buffer(), &[span], value).unwrap();
}

#[test]
fn slots_are_ids_one_to_n_at_fixed_physical_slots_above_the_floor() {
    each_case(|ps, kv| {
        let mut a = rig(ps, 8, kv).alloc;
        assert_eq!(a.pool_slots(), 8);
        let slots = alloc_slots(&mut a, 8);
        let mut ids: Vec<u32> = slots.iter().map(|s| s.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, (1..=8).collect::<Vec<_>>());
        let grid = a.grid(Side::Mamba);
        assert_eq!(
            (grid.envelope, grid.stride, a.stride(Side::Mamba)),
            (256, 1, 1)
        );
        let map = a.pool_map();
        let mamba = map.spans[0];
        assert_eq!((mamba.side, mamba.pages, mamba.live), (Side::Mamba, 8, 8));
        assert!(mamba.bytes.0 >= a.sink_floor());
        // Slots, then SWA (when the model has it), then FULL, ascending and disjoint.
        let sides: Vec<Side> = map.spans.iter().map(|s| s.side).collect();
        match kv {
            Kv::FullSwa => assert_eq!(sides, [Side::Mamba, Side::Swa, Side::Full]),
            Kv::FullOnly => assert_eq!(sides, [Side::Mamba, Side::Full]),
        }
        assert!(map.spans.windows(2).all(|w| w[0].bytes.1 <= w[1].bytes.0));
        assert!(map.spans.last().unwrap().bytes.1 <= map.total_bytes);
        for s in &slots {
            let p = a.physical_slot(*s).unwrap() as u64;
            assert!(p * 256 >= mamba.bytes.0 && (p + 1) * 256 <= mamba.bytes.1);
        }
        // The sink and ids past the pool have no physical slot; a token has no slot id.
        assert_eq!(a.physical_slot(VirtualSlot(0)), None);
        assert_eq!(a.physical_slot(VirtualSlot(9)), None);
        assert_eq!(a.kernel_id(Side::Mamba, VirtualToken(1)), 0);
        assert!(map.to_string().contains("mamba"), "{map}");
        assert_sound(&a);
    });
}

#[test]
fn slot_frees_apply_now_outside_a_group_and_at_the_flush_inside_one() {
    each_case(|ps, kv| {
        let mut a = rig(ps, 6, kv).alloc;
        let s = alloc_slots(&mut a, 4);
        assert_eq!(a.capacity().mamba.allocated_pages, 4);
        assert_sound(&a);
        // Outside a group: freed at once.
        a.free_slots(&s[..1]).unwrap();
        assert_eq!(a.capacity().mamba.available_pages, 3);
        assert_eq!(a.physical_slot(s[0]), None);
        assert_sound(&a);
        // Inside a group: deferred through the slot list until a flush.
        a.free_group_begin().unwrap();
        a.free_slots(&s[1..3]).unwrap();
        assert_eq!(pending_slots(&a), 2);
        assert_eq!(a.capacity().mamba.available_pages, 3);
        assert!(a.physical_slot(s[1]).is_some());
        assert_sound(&a);
        // A pending slot named again, or a slot named twice in one call, is refused.
        let before = snapshot(&a);
        for bad in [
            &[s[1]][..],
            &[s[3], s[3]][..],
            &[s[0]][..],
            &[VirtualSlot(0)][..],
        ] {
            let err = a.free_slots(bad).unwrap_err();
            assert!(matches!(err, Error::BadSlot { .. }), "{err}");
            assert_eq!(snapshot(&a), before);
        }
        assert!(matches!(
            a.free_slots(&[s[1]]),
            Err(Error::BadSlot {
                reason: SlotFault::NamedTwice,
                ..
            })
        ));
        assert!(matches!(
            a.free_slots(&[s[0]]),
            Err(Error::BadSlot {
                reason: SlotFault::NotLive,
                ..
            })
        ));
        assert!(a.flush_deferred());
        assert_eq!(pending_slots(&a), 0);
        assert_eq!(a.capacity().mamba.available_pages, 5);
        assert_eq!(a.physical_slot(s[1]), None);
        assert!(a.in_free_group());
        a.free_slots(&s[3..]).unwrap();
        assert_eq!(pending_slots(&a), 1);
        a.free_group_end().unwrap();
        assert_eq!(pending_slots(&a), 0);
        assert_eq!(a.capacity().mamba.available_pages, 6);
        assert_sound(&a);
        // Freed ids come back (the most recently freed first).
        assert_eq!(alloc_slots(&mut a, 1), vec![s[3]]);
        assert_sound(&a);
    });
}

#[test]
fn slot_exhaustion_is_a_typed_error_that_changes_nothing() {
    each_case(|ps, kv| {
        let mut a = rig(ps, 4, kv).alloc;
        let _held = alloc_slots(&mut a, 3);
        let before = snapshot(&a);
        let mut out = vec![VirtualSlot(77)];
        let err = a.alloc_slots(2, &mut out).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfCapacity {
                    available_pages: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(out, vec![VirtualSlot(77)], "out is untouched");
        assert_eq!(snapshot(&a), before);
        assert!(!a.allocation_fits(PageDemand::slots(2)));
        assert!(a.allocation_fits(PageDemand::slots(1)));
        assert!(matches!(
            a.ensure_capacity(PageDemand::slots(2)),
            Err(Error::OutOfCapacity { .. })
        ));
        // Zero slots always succeed.
        a.alloc_slots(0, &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_sound(&a);
    });
}

#[test]
fn copy_slots_copies_whole_envelopes_and_leaves_the_source() {
    each_case(|ps, kv| {
        let r = rig(ps, 6, kv);
        let (ledger, mut a) = (r.ledger, r.alloc);
        let s = alloc_slots(&mut a, 4);
        // Handed-out slots were zeroed.
        assert!(slot_bytes(&*ledger, &a, s[0]).iter().all(|&b| b == 0));
        stamp_slot(&*ledger, &a, s[0], 0xA1);
        stamp_slot(&*ledger, &a, s[1], 0xB2);
        stamp_slot(&*ledger, &a, s[2], 0x11);
        stamp_slot(&*ledger, &a, s[3], 0x22);
        let before = a.capacity();
        let ops = ledger.op_count();
        a.copy_slots(&[(s[0], s[2]), (s[1], s[3])]).unwrap();
        assert_eq!(ledger.op_count() - ops, 1, "one move_spans for the batch");
        for (slot, byte) in [(s[0], 0xA1), (s[1], 0xB2), (s[2], 0xA1), (s[3], 0xB2)] {
            assert!(
                slot_bytes(&*ledger, &a, slot).iter().all(|&b| b == byte),
                "{slot:?}"
            );
        }
        assert_eq!(a.capacity(), before, "a copy changes no table");
        // Refused before anything is issued: a dead slot, a destination named twice, a
        // destination that is also a source.
        a.free_slots(&s[3..]).unwrap();
        let ops = ledger.op_count();
        for pairs in [
            &[(s[0], s[3])][..],
            &[(s[0], s[2]), (s[1], s[2])][..],
            &[(s[0], s[1]), (s[1], s[2])][..],
        ] {
            let err = a.copy_slots(pairs).unwrap_err();
            assert!(matches!(err, Error::BadSlot { .. }), "{err}");
        }
        assert_eq!(ledger.op_count(), ops);
        assert_sound(&a);
    });
}

#[test]
fn reclaim_plan_sizes_slot_eviction_after_flushing_the_slot_list() {
    each_case(|ps, kv| {
        let mut a = rig(ps, 4, kv).alloc;
        let s = alloc_slots(&mut a, 4);
        let demand = PageDemand::slots(2);
        let evictable = |n| Reclaimable {
            mamba_slots: n,
            ..Reclaimable::default()
        };
        assert_eq!(a.reclaim_plan(demand, evictable(1)), None);
        assert_eq!(
            a.reclaim_plan(demand, evictable(3)),
            Some(ReclaimPlan {
                mamba_slots: 2,
                ..ReclaimPlan::default()
            })
        );
        // Evictable slots beyond the live ones do not count.
        assert_eq!(a.reclaim_plan(PageDemand::slots(5), evictable(9)), None);
        // A pending slot free is flushed before sizing: one fewer slot to evict.
        a.free_group_begin().unwrap();
        a.free_slots(&s[..1]).unwrap();
        assert_eq!(pending_slots(&a), 1);
        assert_eq!(
            a.reclaim_plan(demand, evictable(3)),
            Some(ReclaimPlan {
                mamba_slots: 1,
                ..ReclaimPlan::default()
            })
        );
        assert_eq!(pending_slots(&a), 0);
        assert!(a.in_free_group());
        a.free_slots(&s[1..2]).unwrap();
        // `ensure_capacity` flushes the slot list too.
        a.ensure_capacity(demand).unwrap();
        assert_eq!(pending_slots(&a), 0);
        a.free_group_end().unwrap();
        // Pages and slots size independently: the static pools share no bytes.
        let both = PageDemand {
            mamba_slots: 2,
            ..PageDemand::joint(3)
        };
        let plan = a.reclaim_plan(both, Reclaimable::default()).unwrap();
        assert_eq!(
            (plan.full_pages, plan.swa_pages, plan.mamba_slots),
            (0, 0, 0)
        );
        assert_eq!(a.capacity().slot_price_tokens, 0);
        assert_sound(&a);
    });
}

/// Every new slot path, and the page paths of an allocator with slots.
fn every_slot_path(a: &mut StaticSwa) {
    let s = alloc_slots(a, 4);
    a.copy_slots(&[(s[0], s[1])]).unwrap();
    a.free_slots(&s[..1]).unwrap();
    a.free_group_begin().unwrap();
    a.free_slots(&s[1..2]).unwrap();
    a.reclaim_plan(PageDemand::slots(1), Reclaimable::default())
        .unwrap();
    a.free_slots(&s[2..3]).unwrap();
    a.ensure_capacity(PageDemand::slots(2)).unwrap();
    a.free_slots(&s[3..]).unwrap();
    a.free_group_end().unwrap();
    let row = fresh_row(a, 10);
    a.free_group_begin().unwrap();
    a.free_segment(Segment::of_row(&row, 0..row.len())).unwrap();
    a.free_group_end().unwrap();
    a.flush().unwrap();
    a.upload_mirror().unwrap();
}

#[test]
fn slot_paths_issue_no_host_sync() {
    each_case(|ps, kv| {
        let r = rig(ps, 6, kv);
        let (ledger, mut a) = (r.ledger, r.alloc);
        let initial = a.capacity();
        ledger.reset();
        every_slot_path(&mut a);
        ledger
            .check_no_syncs()
            .unwrap_or_else(|rep| panic!("ps {ps} {kv:?}: {rep}"));
        assert_eq!(a.capacity(), initial, "every slot and page came back");
        // Slot frees are host bookkeeping only.
        let s = alloc_slots(&mut a, 2);
        let ops = ledger.op_count();
        a.free_slots(&s).unwrap();
        assert_eq!(ledger.op_count(), ops);
        assert_sound(&a);
    });
}

#[test]
fn the_mamba_translate_reads_the_uploaded_slot_mirror() {
    each_case(|ps, kv| {
        let r = rig(ps, 6, kv);
        let (ledger, mut a) = (r.ledger, r.alloc);
        let s = alloc_slots(&mut a, 3);
        a.free_slots(&s[1..2]).unwrap();
        assert!(!a.mirror_current());
        let ids = ledger.alloc_table(4, 0).unwrap();
        let out = ledger.alloc_table(6, -1).unwrap();
        let err = a.translate(Side::Mamba, ids, 4, out, 6).unwrap_err();
        assert!(matches!(err, Error::MirrorBehind { .. }), "{err}");
        a.upload_mirror().unwrap();
        assert!(a.mirror_current());
        ledger
            .upload_table(ids, 0, &[s[0].0 as i32, s[1].0 as i32, s[2].0 as i32, 0])
            .unwrap();
        a.translate(Side::Mamba, ids, 4, out, 6).unwrap();
        let got = ledger
            .read_table(&HostSync::acquire("test: read kernel ids"), out, 0, 6)
            .unwrap();
        let phys = |v: VirtualSlot| a.physical_slot(v).unwrap() as i32;
        assert_eq!(got, vec![phys(s[0]), 0, phys(s[2]), 0, 0, 0]);
        let mirror = a.mirror_table(Side::Mamba).unwrap();
        let table = ledger
            .read_table(&HostSync::acquire("test: read the mirror"), mirror, 0, 7)
            .unwrap();
        assert_eq!(table[s[0].0 as usize], phys(s[0]));
        assert_eq!(table[s[1].0 as usize], 0);
        assert_eq!(table[0], 0, "the sink reads as the sink");
        assert_sound(&a);
    });
}

/// A pool on a fault injector around the CPU device.
fn faulty(ps: u32, kv: Kv) -> (Arc<FaultInjector<CpuDevice>>, StaticSwa) {
    let faults = Arc::new(FaultInjector::new(Arc::new(CpuDevice::new())));
    let device: Arc<dyn Device> = faults.clone();
    let alloc = StaticSwa::new(device, config(ps, 32, 6, kv)).unwrap();
    (faults, alloc)
}

#[test]
fn a_failed_device_op_on_a_slot_path_changes_nothing_and_the_retry_succeeds() {
    each_case(|ps, kv| {
        let (faults, mut a) = faulty(ps, kv);
        let dev = faults.inner();
        // Zeroing on hand-out.
        let s = alloc_slots(&mut a, 2);
        stamp_slot(&**dev, &a, s[0], 0x5A);
        a.free_slots(&s[..1]).unwrap();
        let before = snapshot(&a);
        faults.fail_every(DeviceOp::FillSpans);
        let mut out = Vec::new();
        let err = a.alloc_slots(1, &mut out).unwrap_err();
        assert!(matches!(err, Error::Device(_)), "{err}");
        assert!(out.is_empty());
        assert_eq!(snapshot(&a), before);
        faults.clear();
        a.alloc_slots(1, &mut out).unwrap();
        assert_eq!(out, vec![s[0]]);
        assert!(
            slot_bytes(&**dev, &a, s[0]).iter().all(|&b| b == 0),
            "the retry zeroed the slot it handed out"
        );
        assert_sound(&a);
        // The copy.
        stamp_slot(&**dev, &a, s[0], 0x33);
        stamp_slot(&**dev, &a, s[1], 0x44);
        faults.fail_every(DeviceOp::MoveSpans);
        let before = snapshot(&a);
        assert!(a.copy_slots(&[(s[0], s[1])]).is_err());
        assert_eq!(snapshot(&a), before);
        assert!(slot_bytes(&**dev, &a, s[1]).iter().all(|&b| b == 0x44));
        faults.clear();
        a.copy_slots(&[(s[0], s[1])]).unwrap();
        assert!(slot_bytes(&**dev, &a, s[1]).iter().all(|&b| b == 0x33));
        // The mirror upload: one op for FULL, SWA and the slots; fail it, then retry.
        let _row = fresh_row(&mut a, 3);
        let more = alloc_slots(&mut a, 1);
        a.free_slots(&more).unwrap();
        let mut n = 0;
        loop {
            let before = snapshot(&a);
            faults.reset();
            faults.fail_at(n);
            let result = a.upload_mirror();
            if faults.injected().is_empty() {
                result.unwrap();
                break;
            }
            assert!(result.is_err());
            assert!(
                !a.mirror_current(),
                "stays dirty until the upload was issued"
            );
            assert_eq!(snapshot(&a), before);
            faults.clear();
            n += 1;
        }
        assert_eq!(n, 1, "one upload op for every table");
        assert!(a.mirror_current());
        let mirror = a.mirror_table(Side::Mamba).unwrap();
        let table = dev
            .read_table(&HostSync::acquire("test: read the mirror"), mirror, 0, 7)
            .unwrap();
        for v in 1..7 {
            let want = a.physical_slot(VirtualSlot(v)).map_or(0, |p| p as i32);
            assert_eq!(table[v as usize], want, "s{v}");
        }
        assert_sound(&a);
    });
}

#[test]
fn a_full_only_static_allocator_binds_full_and_refuses_swa_frees() {
    for ps in unikv_invariants::testing::page_sizes() {
        let mut a = rig(ps, 4, Kv::FullOnly).alloc;
        let psz = ps as usize;
        assert_eq!(a.mirror_table(Side::Swa), None);
        assert_eq!(a.grid(Side::Swa).pages, 0);
        let mut rows: Vec<Vec<VirtualToken>> = Vec::new();
        for step in 0..24 {
            let n = 1 + (step * 7) % (3 * psz + 2);
            if a.allocation_fits(PageDemand::pages(ps_pages(ps, n), 0)) {
                let row = fresh_row(&mut a, n);
                assert!(row.iter().all(|t| a.kernel_id(Side::Full, *t) != 0));
                assert!(row.iter().all(|t| a.kernel_id(Side::Swa, *t) == 0));
                rows.push(row);
            }
            assert_eq!(a.capacity().swa, Default::default());
            if step % 3 == 2 {
                let row = rows.remove(0);
                let before = snapshot(&a);
                let swa_free = a.free_swa_segment(Segment::of_row(&row, 0..row.len()));
                assert!(matches!(swa_free, Err(Error::NoSwaSide { .. })));
                assert!(matches!(
                    a.free_swa(&row),
                    Err(Error::NoSwaSide { op: "free_swa" })
                ));
                let seg = Segment::of_row(&row, 0..row.len().min(psz));
                assert!(matches!(
                    a.transfer_swa(seg, seg),
                    Err(Error::NoSwaSide { op: "transfer_swa" })
                ));
                assert_eq!(snapshot(&a), before);
                // Two-sided frees free FULL; a window split frees FULL below and above.
                if step % 2 == 0 {
                    a.free_segment(Segment::of_row(&row, 0..row.len())).unwrap();
                } else {
                    let cursor = ps_floor(ps, row.len() / 2);
                    a.free_kv_row_segments(&row, 0, cursor, row.len()).unwrap();
                }
            }
            a.upload_mirror().unwrap();
            assert_sound(&a);
        }
        a.free_group_begin().unwrap();
        for row in &rows {
            a.free_segment(Segment::of_row(row, 0..row.len())).unwrap();
        }
        a.free_group_end().unwrap();
        let c = a.capacity();
        assert_eq!(c.full.allocated_pages, 0);
        assert_eq!(c.joint_available_pages, c.full.total_pages);
        assert_sound(&a);
    }
}

fn ps_pages(ps: u32, n: usize) -> usize {
    n.div_ceil(ps as usize)
}

fn ps_floor(ps: u32, n: usize) -> usize {
    n - n % ps as usize
}

#[test]
fn too_few_slots_or_a_buffer_without_room_for_them_is_refused_at_boot() {
    for ps in unikv_invariants::testing::page_sizes() {
        for kv in [Kv::FullSwa, Kv::FullOnly] {
            let device = || -> Arc<dyn Device> { Arc::new(CpuDevice::new()) };
            let mut c = config(ps, 32, BS1_STATE_SLOTS - 1, kv);
            assert!(matches!(
                StaticSwa::new(device(), c.clone()),
                Err(Error::BadConfig(_))
            ));
            // More slots than the whole buffer holds, whatever the page size.
            let too_many = (c.total_bytes / slot_spec().bytes_per_slot) as u32 + 1;
            c.mamba.as_mut().unwrap().slots = too_many;
            let Err(Error::BufferTooSmall { needed, have, .. }) =
                StaticSwa::new(device(), c.clone())
            else {
                panic!("ps {ps} {kv:?}: {too_many} slots do not fit");
            };
            assert_eq!(have.0, c.total_bytes);
            assert!(
                needed.0 >= u64::from(too_many) * slot_spec().bytes_per_slot,
                "the slots are charged"
            );
            // The stated need is exactly enough.
            c.total_bytes = needed.0;
            let a = StaticSwa::new(device(), c.clone()).unwrap();
            assert_eq!(a.pool_slots(), too_many);
            assert_sound(&a);
            c.total_bytes = needed.0 - 1;
            assert!(matches!(
                StaticSwa::new(device(), c),
                Err(Error::BufferTooSmall { .. })
            ));
        }
    }
}

#[test]
fn the_reference_sizing_matches_hand_computed_numbers() {
    assert_eq!(REFERENCE_MAMBA_FULL_MEMORY_RATIO, 0.9);
    let spec = SlotPoolSpec {
        name: "gdn",
        layers: 36,
        bytes_per_slot: 4096,
    };
    // 10,000,000 × 0.9 / 1.9 = 4,736,842.1 bytes of state; / 4096 = 1156.45 → 1156
    // slots; with a radix cache 1156 // 3 = 385 running requests.
    let radix = reference_slot_pool(10_000_000, &spec, 0.9, PrefixCaching::Radix).unwrap();
    assert_eq!(
        radix,
        ReferenceSlotPool {
            slots: 1156,
            max_running_requests: 385
        }
    );
    let plain = reference_slot_pool(10_000_000, &spec, 0.9, PrefixCaching::Disabled).unwrap();
    assert_eq!(plain.max_running_requests, 1156);
    // Ratio 1: half the budget, 5,000,000 / 4096 = 1220.7 → 1220 slots.
    let half = reference_slot_pool(10_000_000, &spec, 1.0, PrefixCaching::Radix).unwrap();
    assert_eq!((half.slots, half.max_running_requests), (1220, 406));
    // A budget of whole slots: ratio 1 gives half of them (the count is not capped by
    // what is left over after whole slots).
    let whole = reference_slot_pool(4096 * 100, &spec, 1.0, PrefixCaching::Radix).unwrap();
    assert_eq!(whole.slots, 50);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            reference_slot_pool(10_000_000, &spec, bad, PrefixCaching::Radix),
            Err(Error::BadConfig(_))
        ));
    }
    let odd = SlotPoolSpec {
        bytes_per_slot: 100,
        ..spec.clone()
    };
    assert!(reference_slot_pool(10_000_000, &odd, 0.9, PrefixCaching::Radix).is_err());
    // The sized pool boots: slots first, the KV pools get the rest of the buffer.
    let total = 10_000_000;
    let n = reference_slot_pool(
        total,
        &spec,
        REFERENCE_MAMBA_FULL_MEMORY_RATIO,
        PrefixCaching::Radix,
    )
    .unwrap()
    .slots;
    let a = StaticSwa::new(
        Arc::new(CpuDevice::new()),
        StaticSwaConfig {
            total_bytes: total,
            page_size: 16,
            window: 128,
            full: full_spec(),
            swa: None,
            mamba: Some(StaticSlots {
                spec: spec.clone(),
                slots: n,
            }),
            swa_full_ratio: 0.8,
            zero_on_handout: false,
        },
    )
    .unwrap();
    let c = a.capacity();
    assert_eq!(c.mamba.total_pages, 1156);
    // FULL gets what the slots and the sink leave: (10,000,000 − 4096 × 1157) / 512 B
    // per page, less at most one page of alignment.
    let full_room = (total - 4096 * 1157) / 512;
    assert!(
        c.full.total_pages as u64 + 1 >= full_room && c.full.total_pages as u64 <= full_room,
        "{} FULL pages, room for {full_room}",
        c.full.total_pages
    );
}

/// Slot ops for the model test.
#[derive(Clone, Debug)]
enum SlotOp {
    Alloc(usize),
    /// Free the held slot at this index (mod the held count).
    Free(usize),
    Begin,
    End,
    Flush,
}

fn slot_op() -> impl Strategy<Value = SlotOp> {
    prop_oneof![
        3 => (0usize..4).prop_map(SlotOp::Alloc),
        3 => any::<usize>().prop_map(SlotOp::Free),
        1 => Just(SlotOp::Begin),
        1 => Just(SlotOp::End),
        1 => Just(SlotOp::Flush),
    ]
}

proptest! {
    /// Against a model of held, pending and free slot counts: every alloc succeeds iff
    /// the model has the slots, frees apply at once outside a group and at a flush inside
    /// one, and conservation and the scan hold after every op.
    #[test]
    fn slot_ops_follow_the_model(ops in proptest::collection::vec(slot_op(), 1..60)) {
        let mut a = rig(4, 8, Kv::FullSwa).alloc;
        let (mut held, mut pending, mut group): (Vec<VirtualSlot>, usize, bool) =
            (Vec::new(), 0, false);
        let mut free = 8usize;
        for op in ops {
            match op {
                SlotOp::Alloc(n) => {
                    let mut out = Vec::new();
                    let r = a.alloc_slots(n, &mut out);
                    prop_assert_eq!(r.is_ok(), n <= free);
                    if r.is_ok() {
                        free -= n;
                        held.extend(out);
                    }
                }
                SlotOp::Free(i) if !held.is_empty() => {
                    let s = held.swap_remove(i % held.len());
                    a.free_slots(&[s]).unwrap();
                    if group { pending += 1 } else { free += 1 }
                }
                SlotOp::Free(_) => {}
                SlotOp::Begin => {
                    prop_assert_eq!(a.free_group_begin().is_ok(), !group);
                    group = true;
                }
                SlotOp::End => {
                    prop_assert_eq!(a.free_group_end().is_ok(), group);
                    group = false;
                    free += std::mem::take(&mut pending);
                }
                SlotOp::Flush => {
                    a.flush().unwrap();
                    free += std::mem::take(&mut pending);
                }
            }
            prop_assert_eq!(pending_slots(&a), pending);
            let c = a.capacity().mamba;
            prop_assert_eq!(c.available_pages, free);
            prop_assert_eq!(c.allocated_pages, 8 - free);
            prop_assert!(a.check_conservation());
            prop_assert_eq!(a.verify(), Ok(()));
        }
    }
}

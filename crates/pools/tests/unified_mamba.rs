//! `UnifiedSwa` with Mamba state slots beside FULL (the two-pool `[slots up | FULL down]`):
//! the layout and slot price, reference scenarios 36 (Mamba donor) and 37 (Mamba reclaim
//! inside a free group, with the FULL-only-reps-only case), #34441 at the pool level,
//! compaction that keeps every slot's bytes, copy-on-write copies, no host sync on any
//! slot path, transactional device work, the batch-size-1 floor, and random slot and
//! page churn against a byte-budget model.

mod common;

use common::{SLOT, WINDOW, alloc_slots, assert_sound, fresh_row, full_spec, slot_spec, try_row};
use proptest::prelude::*;
use std::sync::Arc;
use unikv_kernels::{
    ByteSpan, CpuDevice, Device, DeviceOp, FaultInjector, HostSync, Readback, SyncLedger,
};
use unikv_pools::{
    BS1_STATE_SLOTS, DeferredKind, Error, KvAllocator, PageDemand, ReclaimPlan, Reclaimable,
    Segment, Side, UnifiedSwa, UnifiedSwaConfig, VirtualSlot, VirtualToken,
};

/// The sink floor: one slot or one FULL page, whichever is larger.
fn floor(ps: u32) -> u64 {
    SLOT.max(full_spec().bytes_per_token * ps as u64)
}

/// A FULL + Mamba unified pool of the sink floor plus `bytes`.
fn config(ps: u32, bytes: u64) -> UnifiedSwaConfig {
    UnifiedSwaConfig {
        total_bytes: floor(ps) + bytes,
        page_size: ps,
        window: WINDOW,
        full: full_spec(),
        swa: None,
        mamba: Some(slot_spec()),
        zero_on_handout: true,
    }
}

/// A pool on a `SyncLedger` around the CPU device.
struct Rig {
    ledger: Arc<SyncLedger>,
    a: UnifiedSwa,
}

fn rig(ps: u32, bytes: u64) -> Rig {
    let ledger = Arc::new(SyncLedger::cpu());
    let device: Arc<dyn Device> = ledger.clone();
    let a = UnifiedSwa::new(device, config(ps, bytes)).unwrap();
    Rig { ledger, a }
}

/// Page sizes 1 and ≥ 4 (one slot spans several FULL pages at 1 and 4, less than one
/// page at 16).
const PAGE_SIZES: [u32; 3] = [1, 4, 16];

/// What a refused call must leave as it was.
fn snapshot(a: &UnifiedSwa) -> impl PartialEq + std::fmt::Debug + use<> {
    let slots: Vec<_> = (0..64).map(|s| a.physical_slot(VirtualSlot(s))).collect();
    (
        a.capacity(),
        a.pool_map(),
        a.pending_frees(),
        a.verify(),
        a.mirror_current(),
        slots,
    )
}

/// The byte span of a live slot.
fn slot_span(a: &UnifiedSwa, s: VirtualSlot) -> ByteSpan {
    let env = a.grid(Side::Mamba).envelope;
    ByteSpan {
        offset: a.physical_slot(s).unwrap() as u64 * env,
        len: env,
    }
}

fn slot_bytes(dev: &dyn Readback, a: &UnifiedSwa, s: VirtualSlot) -> Vec<u8> {
    let span = slot_span(a, s);
    dev.read_bytes(
        &HostSync::acquire("test: read a slot"),
        a.buffer(),
        span.offset,
        span.len,
    )
    .unwrap()
}

fn stamp_slot(dev: &dyn Device, a: &UnifiedSwa, s: VirtualSlot, value: u8) {
    dev.fill_spans(a.buffer(), &[slot_span(a, s)], value)
        .unwrap();
}

/// Allocates FULL rows of one page until no page fits, then slots until no slot fits
/// (a FULL page is larger than a slot at page size 16): the buffer is full.
fn fill_with_full(a: &mut UnifiedSwa) -> (Vec<Vec<VirtualToken>>, Vec<VirtualSlot>) {
    let ps = a.page_size().get() as usize;
    let mut rows = Vec::new();
    while a.allocation_fits(PageDemand::pages(1, 0)) {
        rows.push(fresh_row(a, ps));
    }
    let mut slots = Vec::new();
    while a.allocation_fits(PageDemand::slots(1)) {
        slots.extend(alloc_slots(a, 1));
    }
    (rows, slots)
}

#[test]
fn slots_grow_up_from_the_floor_full_grows_down_and_a_slot_is_priced_in_tokens() {
    for ps in PAGE_SIZES {
        let Rig { mut a, .. } = rig(ps, 16 * SLOT);
        let cap = a.capacity();
        // 256 B of state cost 8 tokens of 32 B of FULL KV.
        assert_eq!(cap.slot_price_tokens, 8, "ps {ps}");
        assert_eq!(cap.swa, Default::default(), "no SWA side");
        assert!(cap.mamba.available_pages >= 14, "ps {ps}: {cap:?}");
        let s = alloc_slots(&mut a, 3);
        let row = fresh_row(&mut a, 3 * ps as usize);
        let map = a.pool_map();
        let sides: Vec<Side> = map.spans.iter().map(|s| s.side).collect();
        assert_eq!(sides, [Side::Mamba, Side::Full]);
        let (mamba, full) = (map.spans[0], map.spans[1]);
        assert_eq!(mamba.bytes.0, a.sink_floor(), "slots start at the floor");
        assert_eq!(full.bytes.1, map.total_bytes, "FULL ends at the top");
        assert!(mamba.bytes.1 <= full.bytes.0);
        assert_eq!((mamba.live, full.live), (3, 3));
        for slot in &s {
            let span = slot_span(&a, *slot);
            assert!(span.offset >= mamba.bytes.0 && span.offset + span.len <= mamba.bytes.1);
        }
        // Slot ids are their own id space: the sink and unknown ids have no slot.
        assert_eq!(a.physical_slot(VirtualSlot(0)), None);
        assert_eq!(a.physical_slot(VirtualSlot(u32::MAX)), None);
        assert_eq!(a.stride(Side::Mamba), 1, "slots translate at page size 1");
        // No SWA side: its translation is a typed refusal naming the side.
        a.upload_mirror().unwrap();
        let ids = unikv_kernels::TableId(0);
        assert!(matches!(
            a.translate(Side::Swa, ids, 1, ids, 1),
            Err(Error::NoSwaSide { op: "translate" })
        ));
        // Every slot costs the FULL side its price: fewer FULL pages fit with more slots.
        let full_before = a.capacity().full.available_pages;
        let more = alloc_slots(&mut a, 2);
        let full_after = a.capacity().full.available_pages;
        assert_eq!(
            (full_before - full_after) as u64,
            (2 * SLOT).div_ceil(32 * ps as u64),
            "ps {ps}"
        );
        a.free_slots(&more).unwrap();
        a.free_slots(&s).unwrap();
        a.free(&row).unwrap();
        a.flush().unwrap();
        assert_eq!(a.capacity(), cap, "everything comes back");
        assert_sound(&a);
    }
}

/// Scenario 36 and #34441 at the pool level: slot ids to spare, no bytes. The plan asks
/// for FULL donors only; Mamba states only when FULL is exhausted; with nothing
/// evictable it is `None`, and the allocation is a typed error that changes nothing.
#[test]
fn a_slot_shortfall_with_spare_ids_is_paid_by_full_donors_and_states_last() {
    for ps in PAGE_SIZES {
        let Rig { mut a, .. } = rig(ps, 24 * SLOT);
        let held = alloc_slots(&mut a, 2);
        let (rows, _tail) = fill_with_full(&mut a);
        let cap = a.capacity();
        assert!(
            cap.mamba.total_pages - cap.mamba.allocated_pages > 10,
            "ids to spare"
        );
        assert!(!a.allocation_fits(PageDemand::slots(1)), "ps {ps}: {cap:?}");
        let demand = PageDemand::slots(1);
        let evictable = Reclaimable {
            full_pages: rows.len(),
            swa_pages: 0,
            mamba_slots: 2,
        };
        let plan = a.reclaim_plan(demand, evictable).unwrap();
        assert_eq!(plan.mamba_slots, 0, "ps {ps}: FULL is the donor: {plan:?}");
        assert!(plan.full_pages > 0 && plan.full_floor_pages <= plan.full_pages);
        // The plan is the minimum: one page less is not enough.
        let pages = plan.full_pages;
        let spare: Vec<VirtualToken> = rows[..pages - 1].concat();
        a.free(&spare).unwrap();
        assert!(
            !a.allocation_fits(demand),
            "ps {ps}: {pages} pages is the minimum"
        );
        a.free(&rows[pages - 1]).unwrap();
        let s = alloc_slots(&mut a, 1);
        assert_sound(&a);
        // With no FULL evictable, cached states are the last resort.
        let (more_rows, _tail) = fill_with_full(&mut a);
        let rows: Vec<_> = [rows[pages..].to_vec(), more_rows].concat();
        assert!(!a.allocation_fits(demand));
        let only_states = Reclaimable {
            mamba_slots: 3,
            ..Reclaimable::default()
        };
        let plan = a.reclaim_plan(demand, only_states).unwrap();
        assert_eq!((plan.full_pages, plan.mamba_slots), (0, 1), "ps {ps}");
        // Nothing evictable: no plan, and the allocation is refused with nothing changed.
        assert_eq!(a.reclaim_plan(demand, Reclaimable::default()), None);
        let before = snapshot(&a);
        let mut out = Vec::new();
        match a.alloc_slots(1, &mut out) {
            Err(Error::OutOfSlots {
                requested: 1,
                available: 0,
            }) => {}
            other => panic!("ps {ps}: {other:?}"),
        }
        assert!(out.is_empty());
        assert_eq!(snapshot(&a), before);
        for r in &rows {
            a.free(r).unwrap();
        }
        a.free_slots(&held).unwrap();
        a.free_slots(&s).unwrap();
        assert_sound(&a);
    }
}

/// Scenario 37 (the seed's reviewed bug): inside a free group, FULL frees wait in the
/// deferred lists. Sizing a slot demand flushes every list first, so the bytes those
/// frees return are seen, nothing is evicted, the group stays open with empty lists, and
/// the slot allocation succeeds — also when the only pending frees are FULL-only page
/// representatives.
#[test]
fn reclaim_inside_a_free_group_flushes_every_deferred_list_before_the_recheck() {
    #[derive(Clone, Copy, Debug)]
    enum Pending {
        Tokens,
        PageReps,
        FullOnlyTokens,
        FullOnlyPageReps,
    }
    for ps in PAGE_SIZES {
        for pending in [
            Pending::Tokens,
            Pending::PageReps,
            Pending::FullOnlyTokens,
            Pending::FullOnlyPageReps,
        ] {
            let Rig { ledger, mut a } = rig(ps, 24 * SLOT);
            let _held = alloc_slots(&mut a, 1);
            let (mut rows, _tail) = fill_with_full(&mut a);
            assert!(!a.allocation_fits(PageDemand::slots(1)));
            // Free enough FULL for one slot, deferred inside the group.
            let pages = (SLOT as usize).div_ceil(32 * ps as usize);
            let victims: Vec<Vec<VirtualToken>> = rows.drain(..pages).collect();
            let victim: Vec<VirtualToken> = victims.concat();
            let before = a.capacity().full.available_pages;
            a.free_group_begin().unwrap();
            match pending {
                Pending::Tokens => a.free(&victim).unwrap(),
                Pending::PageReps => a
                    .free_segment(Segment::of_row(&victim, 0..victim.len()))
                    .unwrap(),
                Pending::FullOnlyTokens => a.free_full(&victim).unwrap(),
                Pending::FullOnlyPageReps => a
                    .free_full_segment(Segment::of_row(&victim, 0..victim.len()))
                    .unwrap(),
            }
            let lists = a.pending_frees();
            let waiting: usize = lists.iter().map(|&(_, n)| n).sum();
            assert!(waiting > 0, "{pending:?}: deferred inside the group");
            assert!(
                !a.allocation_fits(PageDemand::slots(1)),
                "the pure check does not flush"
            );
            ledger.reset();
            let plan = a.reclaim_plan(PageDemand::slots(1), Reclaimable::default());
            assert_eq!(
                plan,
                Some(ReclaimPlan::default()),
                "ps {ps} {pending:?}: the deferred bytes suffice, nothing to evict"
            );
            assert!(a.in_free_group(), "the group stays open");
            assert!(
                a.pending_frees().iter().all(|&(_, n)| n == 0),
                "lists flushed"
            );
            assert_eq!(a.capacity().full.allocated_pages, rows.len());
            assert!(a.capacity().full.available_pages >= before + pages);
            let s = alloc_slots(&mut a, 1);
            ledger.check_no_syncs().unwrap();
            a.free_group_end().unwrap();
            a.free_slots(&s).unwrap();
            assert_sound(&a);
        }
    }
}

/// Freed slots leave holes; compaction moves live slot envelopes down into them through
/// the device, and every slot still reads its own bytes through the translation.
#[test]
fn compaction_moves_whole_slot_envelopes_and_every_slot_keeps_its_bytes() {
    for ps in PAGE_SIZES {
        let Rig { ledger, mut a } = rig(ps, 32 * SLOT);
        let dev = ledger.inner().clone();
        let s = alloc_slots(&mut a, 8);
        for (i, slot) in s.iter().enumerate() {
            stamp_slot(&*ledger, &a, *slot, 0x10 + i as u8);
        }
        let physical: Vec<u32> = s.iter().map(|&x| a.physical_slot(x).unwrap()).collect();
        // Free the lowest three: the top ones are moved down.
        let mut low: Vec<(u32, usize)> = physical.iter().copied().zip(0..).collect();
        low.sort_unstable();
        let freed: Vec<usize> = low[..3].iter().map(|&(_, i)| i).collect();
        let gone: Vec<VirtualSlot> = freed.iter().map(|&i| s[i]).collect();
        a.free_slots(&gone).unwrap();
        assert_eq!(a.capacity().mamba.hole_pages, 3);
        ledger.reset();
        let report = a.flush().unwrap();
        ledger.check_no_syncs().unwrap();
        assert_eq!(report.pages_moved, 3, "ps {ps}");
        assert_eq!(a.capacity().mamba.hole_pages, 0);
        let mut moved = 0;
        for (i, slot) in s.iter().enumerate() {
            if freed.contains(&i) {
                assert_eq!(a.physical_slot(*slot), None);
                continue;
            }
            moved += usize::from(a.physical_slot(*slot) != Some(physical[i]));
            assert!(
                slot_bytes(&*dev, &a, *slot)
                    .iter()
                    .all(|&b| b == 0x10 + i as u8),
                "ps {ps}: slot {i} kept its state"
            );
        }
        assert_eq!(moved, 3);
        let map = a.pool_map();
        assert_eq!(map.spans[0].bytes.1 - map.spans[0].bytes.0, 5 * SLOT);
        // The mirror the kernels translate with follows the moves.
        a.upload_mirror().unwrap();
        assert!(a.mirror_current());
        let ids = a.capacity().mamba.total_pages + 1;
        let kept: Vec<VirtualSlot> = (0..8)
            .filter(|i| !freed.contains(i))
            .map(|i| s[i])
            .collect();
        let mirror = a.mirror_table(Side::Mamba).unwrap();
        let table = dev
            .read_table(
                &HostSync::acquire("test: read the slot mirror"),
                mirror,
                0,
                ids,
            )
            .unwrap();
        for slot in &kept {
            assert_eq!(
                table[slot.0 as usize],
                a.physical_slot(*slot).unwrap() as i32
            );
        }
        // The device gather the kernels use: moved slots and a freed one (the sink).
        let ids_t = ledger.alloc_table(kept.len() + 1, 0).unwrap();
        let out = ledger.alloc_table(kept.len() + 1, -1).unwrap();
        let mut ids: Vec<i32> = kept.iter().map(|s| s.0 as i32).collect();
        ids.push(gone[0].0 as i32);
        ledger.upload_table(ids_t, 0, &ids).unwrap();
        a.translate(Side::Mamba, ids_t, ids.len(), out, ids.len())
            .unwrap();
        let got = dev
            .read_table(&HostSync::acquire("test: read slot ids"), out, 0, ids.len())
            .unwrap();
        let mut want: Vec<i32> = kept
            .iter()
            .map(|s| a.physical_slot(*s).unwrap() as i32)
            .collect();
        want.push(0);
        assert_eq!(got, want, "ps {ps}");
        a.free_slots(&kept).unwrap();
        assert_sound(&a);
    }
}

/// Copy-on-write: whole envelopes copied, sources untouched, bad pairs refused before
/// anything is issued, no host sync.
#[test]
fn copy_slots_copies_whole_envelopes_without_a_sync_and_refuses_bad_pairs() {
    for ps in PAGE_SIZES {
        let Rig { ledger, mut a } = rig(ps, 16 * SLOT);
        let dev = ledger.inner().clone();
        let s = alloc_slots(&mut a, 4);
        stamp_slot(&*ledger, &a, s[0], 0xA1);
        stamp_slot(&*ledger, &a, s[1], 0xB2);
        ledger.reset();
        a.copy_slots(&[(s[0], s[2]), (s[1], s[3])]).unwrap();
        ledger.check_no_syncs().unwrap();
        for (slot, v) in [(s[0], 0xA1), (s[2], 0xA1), (s[1], 0xB2), (s[3], 0xB2)] {
            assert!(slot_bytes(&*dev, &a, slot).iter().all(|&b| b == v));
        }
        a.free_slots(&s[3..]).unwrap();
        let ops = ledger.op_count();
        for pairs in [
            &[(s[0], s[3])][..],           // a freed destination
            &[(s[0], s[0])],               // onto itself
            &[(s[0], s[2]), (s[1], s[2])], // one destination twice
            &[(VirtualSlot(999), s[2])],   // out of range
            &[(s[0], s[1]), (s[1], s[2])], // a destination that is a source
        ] {
            let err = a.copy_slots(pairs).unwrap_err();
            assert!(matches!(err, Error::BadSlot { .. }), "{pairs:?}: {err}");
        }
        assert_eq!(ledger.op_count(), ops, "nothing issued for a refused copy");
        a.free_slots(&s[..3]).unwrap();
        assert_sound(&a);
    }
}

/// Every slot path at once under the ledger: alloc (with compaction), frees in and out
/// of a group, copies, reclaim planning, donor frees, mirror upload.
#[test]
fn every_slot_path_issues_no_host_sync() {
    for ps in PAGE_SIZES {
        let Rig { ledger, mut a } = rig(ps, 24 * SLOT);
        ledger.reset();
        let s = alloc_slots(&mut a, 4);
        a.copy_slots(&[(s[0], s[1])]).unwrap();
        a.free_slots(&s[..1]).unwrap();
        a.free_group_begin().unwrap();
        a.free_slots(&s[1..2]).unwrap();
        let (rows, tail) = fill_with_full(&mut a);
        a.free_slots(&tail).unwrap();
        a.free(&rows[0]).unwrap();
        a.reclaim_plan(PageDemand::slots(3), Reclaimable::pages(rows.len() - 1, 0))
            .unwrap();
        a.free_group_end().unwrap();
        for r in &rows[1..] {
            a.free(r).unwrap();
        }
        let more = alloc_slots(&mut a, 3); // compacts the holes first
        a.flush().unwrap();
        a.upload_mirror().unwrap();
        a.free_slots(&s[2..]).unwrap();
        a.free_slots(&more).unwrap();
        a.flush().unwrap();
        ledger
            .check_no_syncs()
            .unwrap_or_else(|r| panic!("ps {ps}: {r}"));
        assert_sound(&a);
    }
}

/// A device op that fails inside a slot allocation (the compaction's FULL moves, the
/// zeroing) or a copy changes nothing, and the retry succeeds with every state intact.
#[test]
fn a_failed_device_op_on_a_slot_path_changes_nothing() {
    for ps in PAGE_SIZES {
        for op in [DeviceOp::MoveSpans, DeviceOp::FillSpans] {
            let faults = Arc::new(FaultInjector::new(Arc::new(CpuDevice::new())));
            let device: Arc<dyn Device> = faults.clone();
            let mut a = UnifiedSwa::new(device, config(ps, 16 * SLOT)).unwrap();
            let dev = faults.inner().clone();
            let s = alloc_slots(&mut a, 3);
            for (i, slot) in s.iter().enumerate() {
                stamp_slot(&*dev, &a, *slot, 0x40 + i as u8);
            }
            // The rest of the buffer FULL, then the oldest (highest) FULL pages freed:
            // holes at the top of FULL's span, so new slots need FULL's pages moved up.
            let (mut rows, tail) = fill_with_full(&mut a);
            a.free_slots(&tail).unwrap();
            let k = (3 * SLOT).div_ceil(32 * ps as u64) as usize + 1;
            for r in rows.drain(..k) {
                a.free(&r).unwrap();
            }
            let before = snapshot(&a);
            faults.fail_every(op);
            let mut out = Vec::new();
            let err = a.alloc_slots(3, &mut out).unwrap_err();
            assert!(matches!(err, Error::Device(_)), "ps {ps} {op:?}: {err}");
            assert!(out.is_empty());
            assert_eq!(snapshot(&a), before, "ps {ps} {op:?}");
            faults.clear();
            let fresh = alloc_slots(&mut a, 3);
            for (i, slot) in s.iter().enumerate() {
                assert!(
                    slot_bytes(&*dev, &a, *slot)
                        .iter()
                        .all(|&b| b == 0x40 + i as u8),
                    "ps {ps} {op:?}: slot {i}"
                );
            }
            for slot in &fresh {
                assert!(slot_bytes(&*dev, &a, *slot).iter().all(|&b| b == 0));
            }
            // A failed copy leaves the destination as it was.
            faults.fail_every(DeviceOp::MoveSpans);
            assert!(a.copy_slots(&[(s[0], fresh[0])]).is_err());
            faults.clear();
            assert!(slot_bytes(&*dev, &a, fresh[0]).iter().all(|&b| b == 0));
            for r in &rows {
                a.free(r).unwrap();
            }
            a.free_slots(&s).unwrap();
            a.free_slots(&fresh).unwrap();
            assert_sound(&a);
        }
    }
}

/// Below the sink, three slots and one FULL page (each on its grid), the pool does not
/// boot: a typed error that names the floor and the exact bytes it needs.
#[test]
fn a_buffer_below_three_slots_and_one_full_page_is_a_typed_boot_error() {
    for ps in PAGE_SIZES {
        let page = full_spec().bytes_per_token * ps as u64;
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
        let needed =
            match UnifiedSwa::new(device.clone(), config(ps, BS1_STATE_SLOTS as u64 * SLOT)) {
                Err(e @ Error::BufferTooSmall { .. }) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("3 Mamba state slots and one FULL page"),
                        "{msg}"
                    );
                    let Error::BufferTooSmall { needed, .. } = e else {
                        unreachable!()
                    };
                    needed.0
                }
                other => panic!("ps {ps}: {:?}", other.map(|_| ())),
            };
        assert!(needed >= floor(ps) + BS1_STATE_SLOTS as u64 * SLOT + page);
        let ok = UnifiedSwa::new(device.clone(), config(ps, needed - floor(ps))).unwrap();
        assert!(ok.capacity().mamba.available_pages >= 3);
        assert!(ok.capacity().full.available_pages >= 1);
        assert!(matches!(
            UnifiedSwa::new(device, config(ps, needed - floor(ps) - 1)),
            Err(Error::BufferTooSmall { .. })
        ));
    }
}

// ---- random churn against a byte-budget model ----

#[derive(Clone, Debug)]
enum Op {
    AllocSlots(usize),
    FreeSlot(usize),
    AllocRow(usize),
    FreeRow(usize),
    Copy(usize, usize),
    Group,
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..4).prop_map(Op::AllocSlots),
        3 => any::<usize>().prop_map(Op::FreeSlot),
        3 => (1usize..40).prop_map(Op::AllocRow),
        2 => any::<usize>().prop_map(Op::FreeRow),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::Copy(a, b)),
        1 => Just(Op::Group),
        1 => Just(Op::Flush),
    ]
}

/// The model: live slots with the byte each was stamped with, live rows, and frees
/// waiting in an open group.
struct Model {
    slots: Vec<(VirtualSlot, u8)>,
    rows: Vec<Vec<VirtualToken>>,
    pending_slots: usize,
    pending_pages: usize,
    group: bool,
}

fn churn(ps: u32, budget_slots: u64, ops: &[Op]) {
    let Rig { ledger, mut a } = rig(ps, budget_slots * SLOT);
    let dev = ledger.inner().clone();
    let usable = budget_slots * SLOT;
    let page = 32 * ps as u64;
    let mut m = Model {
        slots: Vec::new(),
        rows: Vec::new(),
        pending_slots: 0,
        pending_pages: 0,
        group: false,
    };
    let mut stamp = 1u8;
    let pages_of = |r: &Vec<VirtualToken>| r.len().div_ceil(ps as usize);
    for op in ops {
        // Bytes the model says are held (deferred frees still hold theirs).
        let held = |m: &Model| {
            (m.slots.len() + m.pending_slots) as u64 * SLOT
                + (m.rows.iter().map(pages_of).sum::<usize>() + m.pending_pages) as u64 * page
        };
        match *op {
            Op::AllocSlots(n) => {
                let before = snapshot(&a);
                let mut out = Vec::new();
                let need = n as u64 * SLOT;
                match a.alloc_slots(n, &mut out) {
                    Ok(()) => {
                        assert!(held(&m) + need <= usable, "{op:?}: more than the buffer");
                        for s in out {
                            assert!(slot_bytes(&*dev, &a, s).iter().all(|&b| b == 0));
                            stamp = stamp.wrapping_add(1).max(1);
                            stamp_slot(&*dev, &a, s, stamp);
                            m.slots.push((s, stamp));
                        }
                    }
                    Err(Error::OutOfSlots { .. }) => {
                        // Alignment of the two grids may cost up to one FULL page.
                        assert!(
                            held(&m) + need + page > usable,
                            "{op:?}: refused with room ({} held of {usable})",
                            held(&m)
                        );
                        assert_eq!(snapshot(&a), before);
                    }
                    Err(e) => panic!("{op:?}: {e}"),
                }
            }
            Op::FreeSlot(i) if !m.slots.is_empty() => {
                let (s, _) = m.slots.swap_remove(i % m.slots.len());
                a.free_slots(&[s]).unwrap();
                if m.group {
                    m.pending_slots += 1;
                }
            }
            Op::AllocRow(n) => {
                let before = snapshot(&a);
                match try_row(&mut a, n) {
                    Ok(r) => {
                        assert!(held(&m) + pages_of(&r) as u64 * page <= usable);
                        m.rows.push(r);
                    }
                    Err(Error::OutOfCapacity { .. }) => {
                        let need = n.div_ceil(ps as usize) as u64 * page;
                        assert!(held(&m) + need + SLOT > usable, "{op:?}: refused with room");
                        assert_eq!(snapshot(&a), before);
                    }
                    Err(e) => panic!("{op:?}: {e}"),
                }
            }
            Op::FreeRow(i) if !m.rows.is_empty() => {
                let r = m.rows.swap_remove(i % m.rows.len());
                a.free(&r).unwrap();
                if m.group {
                    m.pending_pages += pages_of(&r);
                }
            }
            Op::Copy(i, j) if m.slots.len() >= 2 => {
                let (i, j) = (i % m.slots.len(), j % m.slots.len());
                if i != j {
                    a.copy_slots(&[(m.slots[i].0, m.slots[j].0)]).unwrap();
                    m.slots[j].1 = m.slots[i].1;
                }
            }
            Op::Group => {
                if m.group {
                    a.free_group_end().unwrap();
                    (m.pending_slots, m.pending_pages) = (0, 0);
                } else {
                    a.free_group_begin().unwrap();
                }
                m.group = !m.group;
            }
            Op::Flush => {
                a.flush().unwrap();
                (m.pending_slots, m.pending_pages) = (0, 0);
            }
            _ => {}
        }
        assert_sound(&a);
        let cap = a.capacity();
        assert_eq!(cap.mamba.allocated_pages, m.slots.len() + m.pending_slots);
        for &(s, v) in &m.slots {
            assert!(
                slot_bytes(&*dev, &a, s).iter().all(|&b| b == v),
                "{op:?}: slot {s:?} lost its state"
            );
        }
    }
    if m.group {
        a.free_group_end().unwrap();
    }
    for (s, _) in m.slots.drain(..) {
        a.free_slots(&[s]).unwrap();
    }
    for r in m.rows.drain(..) {
        a.free(&r).unwrap();
    }
    a.flush().unwrap();
    let cap = a.capacity();
    assert_eq!(cap.mamba.allocated_pages + cap.full.allocated_pages, 0);
    assert_eq!(cap.mamba.hole_pages + cap.full.hole_pages, 0);
    assert_sound(&a);
    let lists = a.pending_frees();
    assert!(lists.iter().all(|&(_, n)| n == 0));
    assert_eq!(lists[4].0, DeferredKind::Slots);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_slot_and_page_churn_keeps_every_state_and_the_byte_budget(
        ps in prop::sample::select(PAGE_SIZES.to_vec()),
        budget_slots in 6u64..24,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        churn(ps, budget_slots, &ops);
    }
}

/// With no slot in use FULL can take every one of its virtual pages (the ids bound the
/// demand exactly; the bytes allow it when the floor is a whole number of FULL pages).
#[test]
fn full_can_take_every_virtual_page_when_no_slot_is_used() {
    for ps in [1u32, 4, 8] {
        let Rig { mut a, .. } = rig(ps, 16 * SLOT);
        let all = a.virtual_pages() as usize - 1;
        assert_eq!(a.capacity().full.available_pages, all, "ps {ps}");
        let row = fresh_row(&mut a, all * ps as usize);
        assert_eq!(row.len(), all * ps as usize);
        assert!(try_row(&mut a, 1).is_err(), "ps {ps}: nothing is left");
        assert_sound(&a);
    }
}

/// Dropping an allocator frees its buffer and mirror tables on the device.
#[test]
fn dropping_an_allocator_frees_its_device_memory() {
    let sync = HostSync::acquire("test: is the buffer still there");
    let dev = Arc::new(CpuDevice::new());
    let a = UnifiedSwa::new(dev.clone(), config(4, 16 * SLOT)).unwrap();
    let (buffer, full, slots) = (
        a.buffer(),
        a.mirror_table(Side::Full).unwrap(),
        a.mirror_table(Side::Mamba).unwrap(),
    );
    assert!(dev.read_bytes(&sync, buffer, 0, 1).is_ok());
    drop(a);
    assert!(dev.read_bytes(&sync, buffer, 0, 1).is_err());
    assert!(dev.read_table(&sync, full, 0, 1).is_err());
    assert!(dev.read_table(&sync, slots, 0, 1).is_err());
}

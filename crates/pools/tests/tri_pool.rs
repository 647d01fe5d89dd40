//! The tri-pool: `UnifiedSwa` with Mamba state slots, SWA and FULL in one buffer
//! (`[slots up | SWA float | FULL down]`). Reference scenarios 34 (float placement) and 35
//! (float make_room: the shortfall ladder), from both ends and over ends with holes; no
//! host sync on any of it; a device fault at every op of a ladder-heavy run changes
//! nothing a caller can see; the batch-size-1 floor; and random churn of slots, rows,
//! window releases, groups and flushes against a byte-budget model, with every page's
//! and slot's bytes checked after every step.

mod common;

use common::{SLOT, WINDOW, assert_sound, full_spec, slot_spec, swa_spec, try_row};
use proptest::prelude::*;
use std::sync::Arc;
use unikv_kernels::{
    ByteSpan, CpuDevice, Device, Error as DeviceError, FaultInjector, HostSync, Readback,
    SyncLedger,
};
use unikv_pools::{
    Error, KvAllocator, PageDemand, Segment, Side, SwaState, UnifiedSwa, UnifiedSwaConfig,
    VirtualPage, VirtualSlot, VirtualToken,
};

/// Bytes of one joint page (FULL + SWA).
fn joint(ps: u32) -> u64 {
    (full_spec().bytes_per_token + swa_spec().bytes_per_token) * ps as u64
}

/// The sink floor: one slot or one SWA page, whichever is larger.
fn floor(ps: u32) -> u64 {
    SLOT.max(swa_spec().bytes_per_token * ps as u64)
}

/// A tri-pool of the sink floor plus `bytes`.
fn config(ps: u32, bytes: u64) -> UnifiedSwaConfig {
    UnifiedSwaConfig {
        total_bytes: floor(ps) + bytes,
        page_size: ps,
        window: WINDOW,
        full: full_spec(),
        swa: Some(swa_spec()),
        mamba: Some(slot_spec()),
        zero_on_handout: true,
    }
}

/// Page sizes 1 and ≥ 4 (a slot spans several pages at 1 and 4, less than one at 16).
const PAGE_SIZES: [u32; 3] = [1, 4, 16];

/// A pool on a `SyncLedger` around a fault injector around the CPU device.
struct Rig {
    ledger: Arc<SyncLedger>,
    faults: Arc<FaultInjector<CpuDevice>>,
    a: UnifiedSwa,
}

fn rig(ps: u32, bytes: u64) -> Rig {
    let faults = Arc::new(FaultInjector::new(Arc::new(CpuDevice::new())));
    let ledger = Arc::new(SyncLedger::new(faults.clone()));
    let device: Arc<dyn Device> = ledger.clone();
    let a = UnifiedSwa::new(device, config(ps, bytes)).unwrap();
    Rig { ledger, faults, a }
}

/// The stamp of virtual page `v` on `side` (never 0, which is what zeroing writes).
fn stamp(v: u32, side: Side) -> u8 {
    (v.wrapping_mul(7) % 250) as u8 + 1 + (side == Side::Swa) as u8
}

/// The stamp of slot `s`.
fn slot_stamp(s: VirtualSlot) -> u8 {
    (s.0.wrapping_mul(13) % 250) as u8 + 3
}

fn envelope(a: &UnifiedSwa, side: Side, v: u32) -> Option<ByteSpan> {
    let p = match side {
        Side::Mamba => a.physical_slot(VirtualSlot(v))?,
        _ => a.physical_page(side, VirtualPage(v))?,
    };
    let env = a.grid(side).envelope;
    Some(ByteSpan {
        offset: p as u64 * env,
        len: env,
    })
}

fn read(dev: &dyn Readback, a: &UnifiedSwa, span: ByteSpan) -> Vec<u8> {
    dev.read_bytes(
        &HostSync::acquire("test: read stamps"),
        a.buffer(),
        span.offset,
        span.len,
    )
    .unwrap()
}

/// Checks the fresh pages of `row` read zero, then stamps them on both sides.
fn stamp_row(dev: &dyn Readback, a: &UnifiedSwa, row: &[VirtualToken]) {
    let ps = a.page_size();
    for t in row.iter().step_by(ps.get() as usize) {
        let v = t.page(ps).0;
        for side in [Side::Full, Side::Swa] {
            let span = envelope(a, side, v).unwrap();
            assert!(
                read(dev, a, span).iter().all(|&b| b == 0),
                "handed out unzeroed"
            );
            dev.fill_spans(a.buffer(), &[span], stamp(v, side)).unwrap();
        }
    }
}

fn stamp_slots(dev: &dyn Readback, a: &UnifiedSwa, slots: &[VirtualSlot]) {
    for &s in slots {
        let span = envelope(a, Side::Mamba, s.0).unwrap();
        assert!(
            read(dev, a, span).iter().all(|&b| b == 0),
            "slot handed out unzeroed"
        );
        dev.fill_spans(a.buffer(), &[span], slot_stamp(s)).unwrap();
    }
}

/// Every live page and slot still holds its stamp, read through the host tables.
#[track_caller]
fn assert_stamps(dev: &dyn Readback, a: &UnifiedSwa, what: &str) {
    for v in 1..a.virtual_pages() {
        for side in [Side::Full, Side::Swa] {
            if let Some(span) = envelope(a, side, v) {
                assert!(
                    read(dev, a, span).iter().all(|&b| b == stamp(v, side)),
                    "{what}: {side:?} page v{v} lost its bytes"
                );
            }
        }
    }
    for s in 1..a.capacity().mamba.total_pages as u32 + 1 {
        if let Some(span) = envelope(a, Side::Mamba, s) {
            assert!(
                read(dev, a, span)
                    .iter()
                    .all(|&b| b == slot_stamp(VirtualSlot(s))),
                "{what}: slot {s} lost its state"
            );
        }
    }
}

fn swa_pages(a: &UnifiedSwa) -> Vec<Option<u32>> {
    (0..a.virtual_pages())
        .map(|v| a.physical_page(Side::Swa, VirtualPage(v)))
        .collect()
}

/// The float's span in pages of its grid.
fn float_span(a: &UnifiedSwa) -> (u64, u64) {
    let env = a.grid(Side::Swa).envelope;
    let (lo, hi) = a.span_bytes(Side::Swa);
    (lo / env, hi / env)
}

#[test]
fn scenario_34_the_float_lands_at_the_midpoint_parks_when_empty_and_never_walls_off_full() {
    for ps in PAGE_SIZES {
        let psz = ps as usize;
        let Rig { ledger, mut a, .. } = rig(ps, 8 * SLOT + 48 * joint(ps));
        let dev = ledger.inner().clone();
        let mut slots = Vec::new();
        a.alloc_slots(2, &mut slots).unwrap();
        stamp_slots(&*dev, &a, &slots);
        let parked = a.capacity();
        let (lo, hi) = a.span_bytes(Side::Swa);
        assert_eq!(lo, hi, "ps {ps}: an empty float occupies no bytes");
        // The first joint page: FULL takes the top page, SWA lands at the midpoint of
        // the room left between the slots and FULL.
        let row = try_row(&mut a, psz).unwrap();
        let env = a.grid(Side::Swa).envelope;
        let mamba_hi = a.span_bytes(Side::Mamba).1;
        let full_lo = a.span_bytes(Side::Full).0;
        let (first, last) = (mamba_hi.div_ceil(env), full_lo / env);
        assert_eq!(
            float_span(&a),
            (
                first + (last - first - 1) / 2,
                first + (last - first - 1) / 2 + 1
            ),
            "ps {ps}: the first SWA page sits at the midpoint"
        );
        let mid = (mamba_hi + full_lo) / 2;
        assert!(a.span_bytes(Side::Swa).0.abs_diff(mid) <= env, "ps {ps}");
        assert_sound(&a);
        // Its window released, the float is empty again: parked and transparent, and the
        // pool is what it was (FULL keeps the row's page).
        a.free_swa_segment(Segment::of_row(&row, 0..psz)).unwrap();
        let (lo, hi) = a.span_bytes(Side::Swa);
        assert_eq!(lo, hi, "ps {ps}: parked");
        a.free(&row).unwrap();
        a.flush().unwrap();
        assert_eq!(
            a.capacity(),
            parked,
            "ps {ps}: a parked float changes nothing"
        );
        // FULL grows through the middle: page after page, each row's SWA released at
        // once, FULL reaches the slots; the float never walls off the bytes it parked on.
        let old_float = mid;
        let mut rows = Vec::new();
        while let Ok(row) = try_row(&mut a, psz) {
            stamp_row(&*dev, &a, &row);
            a.free_swa_segment(Segment::of_row(&row, 0..psz)).unwrap();
            assert_eq!(float_span(&a).0, float_span(&a).1, "ps {ps}: parked");
            rows.push(row);
            assert_sound(&a);
        }
        let full_lo = a.span_bytes(Side::Full).0;
        assert!(
            full_lo < old_float,
            "ps {ps}: FULL passed the float's old place"
        );
        let gap = full_lo - a.span_bytes(Side::Mamba).1;
        assert!(
            gap < joint(ps) + env,
            "ps {ps}: {gap} bytes left unused between the ends"
        );
        assert_stamps(&*dev, &a, "scenario 34");
        assert_eq!(ledger.syncs(), 0);
    }
}

/// Fills a tri-pool with `slots` slots and one-page rows until nothing fits, then
/// releases the SWA of every row but every third (a window eviction): the float is full
/// of holes with live pages spread through it, and the ends are tight against it, so
/// FULL's or the slots' next bytes are the float's. Stamps everything.
fn float_with_holes(ps: u32, slots: usize) -> (Rig, Vec<Vec<VirtualToken>>, Vec<VirtualSlot>) {
    let psz = ps as usize;
    let mut rig = rig(ps, 8 * SLOT + 48 * joint(ps));
    let dev = rig.ledger.inner().clone();
    let mut held = Vec::new();
    rig.a.alloc_slots(slots, &mut held).unwrap();
    stamp_slots(&*dev, &rig.a, &held);
    let mut rows = Vec::new();
    while let Ok(row) = try_row(&mut rig.a, psz) {
        stamp_row(&*dev, &rig.a, &row);
        rows.push(row);
    }
    for row in rows
        .iter()
        .skip(1)
        .step_by(3)
        .chain(rows.iter().skip(2).step_by(3))
    {
        rig.a
            .free_swa_segment(Segment::of_row(row, 0..psz))
            .unwrap();
    }
    assert!(
        rig.a.capacity().swa.hole_pages > 0,
        "ps {ps}: the float has holes"
    );
    assert_sound(&rig.a);
    (rig, rows, held)
}

/// Counts the SWA pages that moved between two tables.
fn moved(before: &[Option<u32>], after: &[Option<u32>]) -> usize {
    before
        .iter()
        .zip(after)
        .filter(|(b, a)| b.is_some() && b != a)
        .count()
}

#[test]
fn scenario_35_full_needing_the_floats_bytes_relays_the_fewest_boundary_swa_pages() {
    for ps in PAGE_SIZES {
        let psz = ps as usize;
        let (rig, mut rows, _slots) = float_with_holes(ps, 2);
        let Rig { ledger, mut a, .. } = rig;
        let dev = ledger.inner().clone();
        let env = a.grid(Side::Swa).envelope;
        let full_env = a.grid(Side::Full).envelope;
        let mut relays = 0;
        loop {
            let before = swa_pages(&a);
            // The float pages the next FULL page needs: those at or above the SWA page
            // its new frontier falls in.
            let full_lo = a.span_bytes(Side::Full).0;
            let b = (full_lo - full_env) / env;
            let (_, hi) = float_span(&a);
            let in_the_way = before.iter().flatten().filter(|&&p| p as u64 >= b).count();
            let holes = a.capacity().swa.hole_pages;
            let Ok(row) = try_row(&mut a, psz) else { break };
            stamp_row(&*dev, &a, &row);
            rows.push(row);
            let after = swa_pages(&a);
            if hi > b {
                relays += 1;
                assert!(holes > 0);
                assert_eq!(
                    moved(&before, &after),
                    in_the_way,
                    "ps {ps}: the ladder moves exactly the pages in FULL's way"
                );
                assert!(float_span(&a).1 <= b, "ps {ps}: FULL's page is free of SWA");
            } else {
                assert_eq!(moved(&before, &after), 0, "ps {ps}: no move without need");
            }
            assert_sound(&a);
            assert_stamps(&*dev, &a, "scenario 35");
        }
        assert!(relays > 0, "ps {ps}: FULL never reached the float");
        assert_eq!(
            ledger.syncs(),
            0,
            "ps {ps}: the ladder waited for the device"
        );
        a.upload_mirror().unwrap();
        assert!(a.mirror_current());
    }
}

#[test]
fn a_slot_demand_the_float_blocks_relays_its_low_pages_toward_full() {
    for ps in PAGE_SIZES {
        let (rig, _rows, mut slots) = float_with_holes(ps, 1);
        let Rig { ledger, mut a, .. } = rig;
        let dev = ledger.inner().clone();
        let env = a.grid(Side::Swa).envelope;
        let mut relays = 0;
        loop {
            let before = swa_pages(&a);
            let mamba_hi = a.span_bytes(Side::Mamba).1;
            let first = (mamba_hi + SLOT).div_ceil(env);
            let (lo, _) = float_span(&a);
            let in_the_way = before
                .iter()
                .flatten()
                .filter(|&&p| (p as u64) < first)
                .count();
            let mut out = Vec::new();
            match a.alloc_slots(1, &mut out) {
                Ok(()) => {}
                Err(Error::OutOfSlots { .. }) => break,
                Err(e) => panic!("ps {ps}: {e}"),
            }
            stamp_slots(&*dev, &a, &out);
            slots.extend(out);
            let after = swa_pages(&a);
            if lo < first {
                relays += 1;
                assert_eq!(moved(&before, &after), in_the_way, "ps {ps}");
                assert!(float_span(&a).0 >= first, "ps {ps}");
            } else {
                assert_eq!(moved(&before, &after), 0, "ps {ps}");
            }
            assert_sound(&a);
            assert_stamps(&*dev, &a, "slot ladder");
        }
        assert!(relays > 0, "ps {ps}: the slots never reached the float");
        assert_eq!(ledger.syncs(), 0);
    }
}

#[test]
fn the_ladder_packs_ends_with_holes_before_it_relays_the_float() {
    for ps in PAGE_SIZES {
        let psz = ps as usize;
        let (rig, mut rows, mut slots) = float_with_holes(ps, 3);
        let Rig { ledger, mut a, .. } = rig;
        let dev = ledger.inner().clone();
        // Holes in both ends: a FULL row (its SWA released first, so only FULL frees)
        // and a slot.
        let row = rows.remove(1);
        a.free(&row).unwrap();
        a.free_slots(&[slots.remove(1)]).unwrap();
        // A row larger than FULL's holes and the room above the float: it needs both
        // rungs.
        let cap = a.capacity();
        assert!(cap.full.hole_pages > 0 && cap.mamba.hole_pages > 0);
        let need = cap.joint_schedulable_pages;
        assert!(
            !a.allocation_fits(PageDemand::joint(need + 1)),
            "ps {ps}: the schedulable count is exact"
        );
        let row = try_row(&mut a, need * psz).unwrap();
        stamp_row(&*dev, &a, &row);
        let cap = a.capacity();
        assert_eq!(
            cap.full.hole_pages + cap.mamba.hole_pages,
            0,
            "ps {ps}: packed"
        );
        assert_sound(&a);
        assert_stamps(&*dev, &a, "both rungs");
        assert_eq!(ledger.syncs(), 0);
    }
}

#[test]
fn a_move_gate_freezes_the_float_as_well() {
    for ps in PAGE_SIZES {
        let psz = ps as usize;
        let (rig, _rows, _slots) = float_with_holes(ps, 2);
        let Rig { mut a, .. } = rig;
        let gate = a.move_gate();
        let before = swa_pages(&a);
        while try_row(&mut a, psz).is_ok() {}
        assert_eq!(
            moved(&before, &swa_pages(&a)),
            0,
            "ps {ps}: gated, nothing moved"
        );
        let gated = a.capacity().joint_available_pages;
        drop(gate);
        assert!(
            a.capacity().joint_schedulable_pages > gated,
            "ps {ps}: the ladder's room comes back with the gate"
        );
        try_row(&mut a, psz).unwrap();
        assert_sound(&a);
    }
}

/// What a caller can see of a pool: per virtual page and slot, liveness and whether its
/// bytes hold their stamp; the deferred lists, the group, `verify()`.
#[derive(Debug, PartialEq)]
struct Visible {
    pages: Vec<(bool, SwaState, bool, bool)>,
    slots: Vec<(bool, bool)>,
    pending: [(unikv_pools::DeferredKind, usize); 5],
    group: bool,
    verify: Result<(), String>,
}

/// Everything, physical placement and capacity included.
#[derive(Debug, PartialEq)]
struct Exact {
    visible: Visible,
    full: Vec<Option<u32>>,
    swa: Vec<Option<u32>>,
    slots: Vec<Option<u32>>,
    capacity: unikv_pools::Capacity,
    map: unikv_pools::PoolMap,
    mirror_current: bool,
}

fn exact(dev: &dyn Readback, a: &UnifiedSwa) -> Exact {
    let ok = |side, v| {
        envelope(a, side, v).is_none_or(|span| {
            let want = match side {
                Side::Mamba => slot_stamp(VirtualSlot(v)),
                _ => stamp(v, side),
            };
            read(dev, a, span).iter().all(|&b| b == want)
        })
    };
    let slot_ids = a.capacity().mamba.total_pages as u32 + 1;
    let visible = Visible {
        pages: (0..a.virtual_pages())
            .map(|v| {
                let page = VirtualPage(v);
                (
                    a.full_live(page),
                    a.swa_state(page),
                    ok(Side::Full, v),
                    ok(Side::Swa, v),
                )
            })
            .collect(),
        slots: (0..slot_ids)
            .map(|s| {
                (
                    a.physical_slot(VirtualSlot(s)).is_some(),
                    ok(Side::Mamba, s),
                )
            })
            .collect(),
        pending: a.pending_frees(),
        group: a.in_free_group(),
        verify: a.verify(),
    };
    Exact {
        visible,
        full: (0..a.virtual_pages())
            .map(|v| a.physical_page(Side::Full, VirtualPage(v)))
            .collect(),
        swa: swa_pages(a),
        slots: (0..slot_ids)
            .map(|s| a.physical_slot(VirtualSlot(s)))
            .collect(),
        capacity: a.capacity(),
        map: a.pool_map(),
        mirror_current: a.mirror_current(),
    }
}

/// Runs `call` with the n-th device op failing, for n = 0, 1, ... until it issues fewer
/// ops; after each failure what a caller sees is unchanged, and everything is unchanged
/// unless the ends had holes (the ladder's first rung is its own transaction). Returns
/// the result of the run without a fault and the faults injected.
fn sweep<R>(
    rig: &mut Rig,
    what: &str,
    mut call: impl FnMut(&mut UnifiedSwa) -> Result<R, Error>,
) -> (R, u64) {
    let dev = rig.ledger.inner().clone();
    let mut n = 0;
    loop {
        let before = exact(&*dev, &rig.a);
        let cap = rig.a.capacity();
        let ends_have_holes = cap.full.hole_pages + cap.mamba.hole_pages > 0;
        rig.faults.reset();
        rig.faults.fail_at(n);
        let result = call(&mut rig.a);
        let injected = rig.faults.injected();
        rig.faults.clear();
        if injected.is_empty() {
            let r = result.unwrap_or_else(|e| panic!("{what}: fails without a fault: {e}"));
            return (r, n);
        }
        match result {
            Err(Error::Device(DeviceError::InjectedFault { .. })) => {}
            Err(e) => panic!("{what}, fault at op {n}: unexpected error {e}"),
            Ok(_) => panic!("{what}: op {n} failed but the call reported success"),
        }
        let after = exact(&*dev, &rig.a);
        assert_eq!(
            after.visible, before.visible,
            "{what}: a fault at op {n} showed"
        );
        if !ends_have_holes {
            assert_eq!(after, before, "{what}: a fault at op {n} changed the pool");
        }
        n += 1;
    }
}

#[test]
fn a_device_fault_anywhere_in_the_ladder_changes_nothing_a_caller_sees() {
    for ps in PAGE_SIZES {
        let psz = ps as usize;
        let (mut rig, mut rows, mut slots) = float_with_holes(ps, 2);
        let dev = rig.ledger.inner().clone();
        let mut faults = 0;
        // FULL down into the float, slots up into it, then holes in both ends.
        for round in 0..40 {
            if round == 20 {
                rig.a.free(&rows.remove(2)).unwrap();
                rig.a.free_slots(&[slots.remove(0)]).unwrap();
            }
            if round % 4 == 3 {
                if rig.a.allocation_fits(PageDemand::slots(1)) {
                    let (out, f) = sweep(&mut rig, "alloc_slots", |a| {
                        let mut out = Vec::new();
                        a.alloc_slots(1, &mut out).map(|()| out)
                    });
                    faults += f;
                    stamp_slots(&*dev, &rig.a, &out);
                    slots.extend(out);
                }
                continue;
            }
            if !rig.a.allocation_fits(PageDemand::joint(1)) {
                break;
            }
            let (row, f) = sweep(&mut rig, "alloc_extend", |a| try_row(a, psz));
            faults += f;
            stamp_row(&*dev, &rig.a, &row);
            rows.push(row);
            if round % 5 == 0 {
                faults += sweep(&mut rig, "upload_mirror", |a| a.upload_mirror()).1;
            }
        }
        faults += sweep(&mut rig, "flush", |a| a.flush()).1;
        assert_sound(&rig.a);
        assert_stamps(&*dev, &rig.a, "after the sweep");
        assert!(faults >= 20, "ps {ps}: only {faults} faults injected");
    }
}

#[test]
fn the_batch_size_1_floor_charges_three_slots_and_a_window_on_both_kv_sides() {
    for ps in PAGE_SIZES {
        let err = UnifiedSwa::new(Arc::new(CpuDevice::new()), config(ps, SLOT)).unwrap_err();
        let Error::BufferTooSmall { needed, .. } = err else {
            panic!("ps {ps}: {err}")
        };
        let message = err.to_string();
        assert!(
            message.contains("3 Mamba state slots"),
            "ps {ps}: {message}"
        );
        let mut c = config(ps, 0);
        c.total_bytes = needed.0;
        let mut a = UnifiedSwa::new(Arc::new(CpuDevice::new()), c.clone()).unwrap();
        // Exactly enough: three slots and one request's window.
        let mut out = Vec::new();
        a.alloc_slots(3, &mut out).unwrap();
        let window = (WINDOW + ps) as usize;
        try_row(&mut a, window.div_ceil(ps as usize) * ps as usize).unwrap();
        assert_sound(&a);
        c.total_bytes -= 1;
        assert!(matches!(
            UnifiedSwa::new(Arc::new(CpuDevice::new()), c),
            Err(Error::BufferTooSmall { .. })
        ));
    }
}

#[derive(Clone, Debug)]
enum Op {
    AllocSlots(usize),
    FreeSlot(usize),
    AllocRow(usize),
    /// Releases the SWA of a row's first pages (a window eviction).
    ReleaseWindow(usize, usize),
    FreeRow(usize),
    Group,
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1usize..3).prop_map(Op::AllocSlots),
        2 => any::<usize>().prop_map(Op::FreeSlot),
        4 => (1usize..24).prop_map(Op::AllocRow),
        3 => (any::<usize>(), 1usize..24).prop_map(|(i, n)| Op::ReleaseWindow(i, n)),
        2 => any::<usize>().prop_map(Op::FreeRow),
        1 => Just(Op::Group),
        1 => Just(Op::Flush),
    ]
}

/// A live row: its tokens and how many of its first pages have their SWA released.
struct Row {
    tokens: Vec<VirtualToken>,
    released: usize,
}

/// Random churn against a byte-budget model: a refusal only when the model's held bytes
/// plus the demand plus the grids' alignment (one FULL page, two SWA pages and a slot)
/// pass the budget, and every live page and slot keeps its bytes through compaction and
/// relays.
fn churn(ps: u32, budget: u64, ops: &[Op]) {
    let Rig { ledger, mut a, .. } = rig(ps, budget);
    let dev = ledger.inner().clone();
    let psz = ps as usize;
    let (full_page, swa_page) = (
        full_spec().bytes_per_token * ps as u64,
        swa_spec().bytes_per_token * ps as u64,
    );
    let slack = full_page + 2 * swa_page + SLOT;
    let mut slots: Vec<VirtualSlot> = Vec::new();
    let mut rows: Vec<Row> = Vec::new();
    let mut pending = 0u64;
    let mut group = false;
    for op in ops {
        let held = |slots: &Vec<VirtualSlot>, rows: &Vec<Row>, pending: u64| {
            slots.len() as u64 * SLOT
                + pending
                + rows
                    .iter()
                    .map(|r| {
                        let pages = r.tokens.len().div_ceil(psz) as u64;
                        pages * full_page + (pages - r.released as u64) * swa_page
                    })
                    .sum::<u64>()
        };
        let before = held(&slots, &rows, pending);
        match *op {
            Op::AllocSlots(n) => {
                let mut out = Vec::new();
                match a.alloc_slots(n, &mut out) {
                    Ok(()) => {
                        assert!(before + n as u64 * SLOT <= budget, "{op:?}");
                        stamp_slots(&*dev, &a, &out);
                        slots.extend(out);
                    }
                    Err(Error::OutOfSlots { .. }) => {
                        assert!(
                            before + n as u64 * SLOT + slack > budget,
                            "{op:?}: refused with room"
                        );
                    }
                    Err(e) => panic!("{op:?}: {e}"),
                }
            }
            Op::FreeSlot(i) if !slots.is_empty() => {
                let s = slots.swap_remove(i % slots.len());
                a.free_slots(&[s]).unwrap();
                if group {
                    pending += SLOT;
                }
            }
            Op::AllocRow(n) => match try_row(&mut a, n) {
                Ok(tokens) => {
                    assert!(
                        before + n.div_ceil(psz) as u64 * joint(ps) <= budget,
                        "{op:?}"
                    );
                    stamp_row(&*dev, &a, &tokens);
                    rows.push(Row {
                        tokens,
                        released: 0,
                    });
                }
                Err(Error::OutOfCapacity { .. }) => {
                    let need = n.div_ceil(psz) as u64 * joint(ps);
                    assert!(before + need + slack > budget, "{op:?}: refused with room");
                }
                Err(e) => panic!("{op:?}: {e}"),
            },
            Op::ReleaseWindow(i, n) if !rows.is_empty() => {
                let i = i % rows.len();
                let r = &mut rows[i];
                let pages = r.tokens.len().div_ceil(psz);
                let to = (r.released + n.div_ceil(psz)).min(pages.saturating_sub(1));
                if to > r.released {
                    let end = (to * psz).min(r.tokens.len());
                    a.free_swa_segment(Segment::of_row(&r.tokens, r.released * psz..end))
                        .unwrap();
                    r.released = to;
                }
            }
            Op::FreeRow(i) if !rows.is_empty() => {
                let r = rows.swap_remove(i % rows.len());
                let len = r.tokens.len();
                a.free_kv_row_segments(&r.tokens, 0, r.released * psz, len)
                    .unwrap();
                if group {
                    let pages = len.div_ceil(psz) as u64;
                    pending += pages * full_page + (pages - r.released as u64) * swa_page;
                }
            }
            Op::Group => {
                if group {
                    a.free_group_end().unwrap();
                    pending = 0;
                } else {
                    a.free_group_begin().unwrap();
                }
                group = !group;
            }
            Op::Flush => {
                a.flush().unwrap();
                pending = 0;
            }
            _ => {}
        }
        assert_sound(&a);
        assert_stamps(&*dev, &a, &format!("{op:?}"));
    }
    if group {
        a.free_group_end().unwrap();
    }
    for s in slots.drain(..) {
        a.free_slots(&[s]).unwrap();
    }
    for r in rows.drain(..) {
        a.free_kv_row_segments(&r.tokens, 0, r.released * psz, r.tokens.len())
            .unwrap();
    }
    a.flush().unwrap();
    let cap = a.capacity();
    assert_eq!(
        cap.mamba.allocated_pages + cap.full.allocated_pages + cap.swa.allocated_pages,
        0
    );
    assert_sound(&a);
    assert_eq!(ledger.syncs(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_churn_keeps_every_page_slot_and_the_byte_budget(
        ps in prop::sample::select(PAGE_SIZES.to_vec()),
        budget_joint_pages in 12u64..48,
        budget_slots in 3u64..10,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        churn(ps, budget_slots * SLOT + budget_joint_pages * joint(ps), &ops);
    }
}

/// A flush packs the float's holes away toward the side with more room (the low side
/// on a tie): the float's end facing that side stays, the other moves in, and every
/// page keeps its bytes.
#[test]
fn a_flush_packs_the_float_toward_the_side_with_more_room() {
    for ps in PAGE_SIZES {
        let (mut rig, _rows, _slots) = float_with_holes(ps, 2);
        let dev = rig.ledger.inner().clone();
        let a = &mut rig.a;
        let (lo, hi) = a.span_bytes(Side::Swa);
        let below = lo - a.span_bytes(Side::Mamba).1;
        let above = a.span_bytes(Side::Full).0 - hi;
        a.flush().unwrap();
        assert_eq!(a.capacity().swa.hole_pages, 0, "ps {ps}: holes packed");
        let (lo2, hi2) = a.span_bytes(Side::Swa);
        if below >= above {
            assert!(lo2 == lo && hi2 < hi, "ps {ps}: toward the low side");
        } else {
            assert!(hi2 == hi && lo2 > lo, "ps {ps}: toward the high side");
        }
        assert_stamps(&*dev, a, "packed float");
        assert_sound(a);
    }
}

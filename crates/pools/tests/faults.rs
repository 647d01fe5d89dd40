//! The fault sweep: a replay-like sequence of allocator calls (allocations that compact
//! and zero, window evictions, frees, mirror uploads, flushes) on a device that fails
//! the n-th op, for every n in turn. After each failure the allocator's state — tables,
//! capacity, pool map, `verify()`, pending deferred frees, the mirror's dirtiness and
//! the bytes every `v2p` entry points to — equals the state before the call, and the
//! retry succeeds. Both layouts, page sizes 1, 4 and 16.

mod common;

use common::{LAYOUTS, Layout, static_config, unified_config};
use std::sync::Arc;
use unikv_kernels::{
    ByteSpan, CpuDevice, Device, Error as DeviceError, FaultInjector, HostSync, Readback,
};
use unikv_pools::{
    Error, ExtendRequest, KvAllocator, PageDemand, Segment, Side, StaticSwa, SwaState, UnifiedSwa,
    VirtualPage, VirtualToken,
};

struct Rig {
    faults: Arc<FaultInjector<CpuDevice>>,
    alloc: Box<dyn KvAllocator>,
}

/// The byte every envelope of `v` on `side` is stamped with after it is handed out.
fn stamp(v: u32, side: Side) -> u8 {
    (v.wrapping_mul(7) % 250) as u8 + 1 + (side == Side::Swa) as u8
}

/// Everything a failed call must leave unchanged.
#[derive(Debug, PartialEq)]
struct State {
    capacity: unikv_pools::Capacity,
    map: unikv_pools::PoolMap,
    pending: [(unikv_pools::DeferredKind, usize); 5],
    group: bool,
    verify: Result<(), String>,
    mirror_current: bool,
    /// Per virtual page: FULL physical page, SWA physical page, SWA state.
    tables: Vec<(Option<u32>, Option<u32>, SwaState)>,
    /// Per virtual page and side: whether every byte of the envelope it points to holds
    /// its stamp.
    bytes_ok: Vec<(bool, bool)>,
}

impl Rig {
    fn new(layout: Layout, ps: u32, pages: u64) -> Rig {
        let faults = Arc::new(FaultInjector::new(Arc::new(CpuDevice::new())));
        let device: Arc<dyn Device> = faults.clone();
        let alloc: Box<dyn KvAllocator> = match layout {
            Layout::Unified => {
                Box::new(UnifiedSwa::new(device, unified_config(ps, pages)).unwrap())
            }
            Layout::Static => Box::new(StaticSwa::new(device, static_config(ps, pages)).unwrap()),
        };
        Rig { faults, alloc }
    }

    fn envelope_bytes(&self, side: Side, v: u32) -> Option<Vec<u8>> {
        let p = self.alloc.physical_page(side, VirtualPage(v))?;
        let env = self.alloc.grid(side).envelope;
        let sync = HostSync::acquire("test: read stamps");
        Some(
            self.faults
                .inner()
                .read_bytes(&sync, self.alloc.buffer(), p as u64 * env, env)
                .unwrap(),
        )
    }

    fn state(&self) -> State {
        let pages = self.alloc.virtual_pages();
        let mut tables = Vec::new();
        let mut bytes_ok = Vec::new();
        for v in 0..pages {
            let page = VirtualPage(v);
            tables.push((
                self.alloc.physical_page(Side::Full, page),
                self.alloc.physical_page(Side::Swa, page),
                self.alloc.swa_state(page),
            ));
            let ok = |side| {
                self.envelope_bytes(side, v)
                    .is_none_or(|b| b.iter().all(|&x| x == stamp(v, side)))
            };
            bytes_ok.push((ok(Side::Full), ok(Side::Swa)));
        }
        State {
            capacity: self.alloc.capacity(),
            map: self.alloc.pool_map(),
            pending: self.alloc.pending_frees(),
            group: self.alloc.in_free_group(),
            verify: self.alloc.verify(),
            mirror_current: self.alloc.mirror_current(),
            tables,
            bytes_ok,
        }
    }

    /// Stamps every live envelope whose page `fresh` names (after an allocation).
    fn stamp_pages(&self, fresh: &[VirtualToken]) {
        let ps = self.alloc.page_size();
        for side in [Side::Full, Side::Swa] {
            for t in fresh {
                let v = t.page(ps).0;
                if let Some(p) = self.alloc.physical_page(side, VirtualPage(v)) {
                    let env = self.alloc.grid(side).envelope;
                    let span = ByteSpan {
                        offset: p as u64 * env,
                        len: env,
                    };
                    self.faults
                        .inner()
                        .fill_spans(self.alloc.buffer(), &[span], stamp(v, side))
                        .unwrap();
                }
            }
        }
    }

    /// Runs `call` with the n-th device op failing, for n = 0, 1, ... until it issues
    /// fewer than n + 1 ops; checks that every failure changed nothing. Returns the
    /// successful result and how many faults were injected.
    fn sweep<R>(
        &mut self,
        what: &str,
        mut call: impl FnMut(&mut dyn KvAllocator) -> Result<R, Error>,
    ) -> (R, u64) {
        let mut n = 0;
        loop {
            let before = self.state();
            assert_eq!(before.verify, Ok(()), "{what}: verify before");
            self.faults.reset();
            self.faults.fail_at(n);
            let result = call(&mut *self.alloc);
            let injected = self.faults.injected();
            self.faults.clear();
            if injected.is_empty() {
                let r = result.unwrap_or_else(|e| panic!("{what}: fails without a fault: {e}"));
                return (r, n);
            }
            match result {
                Err(Error::Device(DeviceError::InjectedFault { .. })) => {}
                Err(e) => panic!("{what}, fault at op {n}: unexpected error {e}"),
                Ok(_) => panic!("{what}: op {n} failed but the call reported success"),
            }
            let after = self.state();
            assert_eq!(
                after, before,
                "{what}: a failure at op {n} changed the state"
            );
            n += 1;
        }
    }

    fn extend(&mut self, row: &mut Vec<VirtualToken>, n: usize) -> u64 {
        let req = ExtendRequest {
            prefix_len: row.len(),
            seq_len: row.len() + n,
            last_token: row.last().copied(),
        };
        let (out, faults) = self.sweep("alloc_extend", |a| {
            let mut out = Vec::new();
            a.alloc_extend(&[req], &mut out).map(|()| out)
        });
        self.stamp_pages(&out);
        row.extend(out);
        faults
    }
}

fn scenario(layout: Layout, ps: u32) {
    let psz = ps as usize;
    let mut rig = Rig::new(layout, ps, 20);
    let mut faults = 0;
    let mut rows: Vec<Vec<VirtualToken>> = Vec::new();
    for _ in 0..6 {
        let mut row = Vec::new();
        faults += rig.extend(&mut row, 3 * psz);
        rows.push(row);
    }
    faults += rig.sweep("upload_mirror", |a| a.upload_mirror()).1;
    assert!(rig.alloc.mirror_current());
    // Window eviction: SWA holes (and tombstones) with FULL kept, then a row that only
    // fits once the SWA holes are compacted (unified).
    for row in &rows {
        rig.alloc
            .free_swa_segment(Segment::of_row(row, 0..2 * psz))
            .unwrap();
    }
    let needs_compaction = !rig.alloc.allocation_fits(PageDemand::joint(0))
        || rig.alloc.capacity().joint_available_pages < 8;
    let mut big = Vec::new();
    let before = rig.alloc.capacity();
    // The static pools do not share bytes: only the free FULL pages are left.
    let big_pages = if layout == Layout::Unified { 8 } else { 1 };
    faults += rig.extend(&mut big, big_pages * psz);
    if layout == Layout::Unified {
        assert!(
            needs_compaction && before.swa.hole_pages > 0,
            "the big row must compact: {before:?}"
        );
    }
    // A decode into a half page, then frees inside a group (deferred) and a flush that
    // compacts the FULL holes.
    faults += rig.extend(&mut rows[0], 1);
    rig.alloc.free_group_begin().unwrap();
    rig.alloc
        .free_kv_row_segments(&rows[1], 0, 2 * psz, rows[1].len())
        .unwrap();
    rig.alloc
        .free_kv_row_segments(&rows[3], 0, 2 * psz, rows[3].len())
        .unwrap();
    // Deferred frees are host-only and due: a flush applies them before its device work,
    // so the sweep starts from the flushed state.
    rig.alloc.flush_deferred();
    faults += rig.sweep("flush", |a| a.flush()).1;
    rig.alloc.free_group_end().unwrap();
    faults += rig.sweep("upload_mirror", |a| a.upload_mirror()).1;
    let mut again = Vec::new();
    faults += rig.extend(&mut again, 2 * psz);
    faults += rig
        .sweep("ensure_capacity", |a| {
            a.ensure_capacity(PageDemand::joint(1))
        })
        .1;
    faults += rig.sweep("upload_mirror", |a| a.upload_mirror()).1;
    let end = rig.state();
    assert_eq!(end.verify, Ok(()));
    assert!(end.bytes_ok.iter().all(|&(f, s)| f && s), "{layout:?}/{ps}");
    // Each allocation zeroes (one op), each upload scatters twice; the unified layout
    // also moves.
    assert!(
        faults >= 12,
        "{layout:?}/{ps}: only {faults} faults injected"
    );
}

#[test]
fn a_failed_device_op_changes_nothing_and_the_retry_succeeds() {
    for ps in [1, 4, 16] {
        for layout in LAYOUTS {
            scenario(layout, ps);
        }
    }
}

/// A unified rig with six rows of three pages each.
fn six_rows(ps: u32) -> (Rig, Vec<Vec<VirtualToken>>) {
    let mut rig = Rig::new(Layout::Unified, ps, 20);
    let rows = (0..6)
        .map(|_| {
            let mut row = Vec::new();
            rig.extend(&mut row, 3 * ps as usize);
            row
        })
        .collect();
    (rig, rows)
}

/// Releases the SWA of each row's first two pages: holes on the SWA side only.
fn release_windows(rig: &mut Rig, rows: &[Vec<VirtualToken>], ps: u32) {
    for row in rows {
        rig.alloc
            .free_swa_segment(Segment::of_row(row, 0..2 * ps as usize))
            .unwrap();
    }
}

#[test]
fn a_failed_compaction_move_keeps_the_tables_on_the_bytes() {
    // The seed rewrote `v2p` before `move_spans`: after a failed move the tables pointed
    // at envelopes whose bytes were never copied.
    for ps in [1, 4] {
        let psz = ps as usize;
        let (mut rig, rows) = six_rows(ps);
        release_windows(&mut rig, &rows, ps);
        let before = rig.state();
        rig.faults.fail_every(unikv_kernels::DeviceOp::MoveSpans);
        let mut out = Vec::new();
        let req = ExtendRequest {
            prefix_len: 0,
            seq_len: 8 * psz,
            last_token: None,
        };
        let err = rig.alloc.alloc_extend(&[req], &mut out).unwrap_err();
        assert!(matches!(err, Error::Device(_)), "{err}");
        assert!(out.is_empty());
        assert_eq!(rig.state(), before);
        rig.alloc.flush_deferred();
        assert!(rig.alloc.flush().is_err(), "flush compacts too");
        assert_eq!(rig.state(), before);
        rig.faults.clear();
        rig.alloc.alloc_extend(&[req], &mut out).unwrap();
        assert_eq!(out.len(), 8 * psz);
    }
}

#[test]
fn translate_is_refused_between_a_compacting_allocation_and_the_upload() {
    for ps in [1, 4] {
        let psz = ps as usize;
        let (mut rig, rows) = six_rows(ps);
        rig.alloc.upload_mirror().unwrap();
        assert!(rig.alloc.mirror_current());
        release_windows(&mut rig, &rows, ps);
        rig.alloc.upload_mirror().unwrap();
        let dev = rig.faults.inner().clone();
        let ids = dev.alloc_table(4, 0).unwrap();
        let out = dev.alloc_table(4, 0).unwrap();
        rig.alloc.translate(Side::Swa, ids, 4, out, 4).unwrap();
        let mut big = Vec::new();
        assert!(rig.alloc.capacity().swa.hole_pages > 0);
        rig.extend(&mut big, 8 * psz);
        let holes = rig.alloc.capacity().swa.hole_pages;
        assert_eq!(holes, 0, "the allocation compacted");
        assert!(!rig.alloc.mirror_current());
        for side in [Side::Full, Side::Swa] {
            let err = rig.alloc.translate(side, ids, 4, out, 4).unwrap_err();
            assert!(
                matches!(err, Error::MirrorBehind { pending } if pending > 0),
                "{err}"
            );
        }
        rig.alloc.upload_mirror().unwrap();
        assert!(rig.alloc.mirror_current());
        rig.alloc.translate(Side::Swa, ids, 4, out, 4).unwrap();
    }
}

//! The CUDA backend's host logic, over its emulated driver: what it asks the driver on
//! the op path (nothing that may block the host), how the sync-hazard count and the
//! ledger see a backend that does block, and the pinned staging ring under a busy GPU
//! (fenced reuse, the fallback when it is full, growth only at a step boundary).

use proptest::prelude::*;
use std::sync::Arc;
use unikv_kernels::{
    ByteSpan, BytesId, CpuDevice, CudaDevice, Device, DriverCall, Grid, HostSync, Kernel,
    LaneTranslate, Readback, RowGather, SpanMove, StreamKind, SyncHazard, SyncLedger, TableId,
    Translate, WindowTranslate,
};

/// The tables and buffer of a step, allocated at set-up.
struct Fixture {
    v2p: TableId,
    ids: TableId,
    out: TableId,
    buf: BytesId,
    /// A verify's device-side starts and accepted paths, and its window output.
    starts: TableId,
    paths: TableId,
    windows: TableId,
    /// A step's lane values (lanes, window firsts, FULL starts, window starts) and the
    /// page tables translated from the lanes (`ids` as 4 lanes of 8 pages).
    lane_meta: TableId,
    page_tables: TableId,
}

fn set_up(dev: &dyn Device) -> Fixture {
    let f = Fixture {
        v2p: dev.alloc_table(64, 0).unwrap(),
        ids: dev.alloc_table(32, 0).unwrap(),
        out: dev.alloc_table(40, -1).unwrap(),
        buf: dev.alloc_bytes(1 << 16, 7).unwrap(),
        starts: dev.alloc_table(2, 0).unwrap(),
        paths: dev.alloc_table(8, 0).unwrap(),
        windows: dev.alloc_table(16, 0).unwrap(),
        lane_meta: dev.alloc_table(10, 0).unwrap(),
        page_tables: dev.alloc_table(12, -1).unwrap(),
    };
    dev.upload_table(f.lane_meta, 0, &[1, 3, 2, -1, 0, 5, 9, -1, 2, 6])
        .unwrap();
    dev.upload_table(f.starts, 0, &[2, 1]).unwrap();
    dev.upload_table(f.paths, 0, &[0, 2, 3, -1, 1, -1, -1, -1])
        .unwrap();
    f
}

/// Every scheduling-path op of [`Device`], the way a decode step issues them.
fn step(dev: &dyn Device, f: &Fixture, k: u32) {
    let k = k % 8;
    dev.scatter_table(f.v2p, &[(1, 3 + k as i32), (2, -1), (5, 9), (1, 4)])
        .unwrap();
    dev.upload_table(f.ids, 0, &[4, 5, 12, 13, 20 + k as i32])
        .unwrap();
    dev.translate(&Translate {
        v2p: f.v2p,
        ids: f.ids,
        n: 5,
        page_size: 4,
        stride: 8,
        out: f.out,
        out_width: 40,
    })
    .unwrap();
    dev.gather_table(f.v2p, f.ids, 5, f.out).unwrap();
    // A verify step: write windows from device-side starts, then a tree's row gather.
    let window = WindowTranslate {
        v2p: f.v2p,
        ids: f.ids,
        ids_at: 0,
        rows: 8,
        starts: f.starts,
        starts_at: 0,
        bias: 0,
        lens: None,
        batch: 2,
        width: 4,
        page_size: 4,
        stride: 8,
        out: f.windows,
        out_at: 0,
    };
    dev.translate_windows(&[
        window,
        WindowTranslate {
            bias: 1,
            out_at: 8,
            lens: Some((f.starts, 0)),
            ..window
        },
    ])
    .unwrap();
    dev.translate_lanes(&lane_tables(f)).unwrap();
    dev.gather_rows(&[RowGather {
        buf: f.buf,
        ids: f.windows,
        ids_at: 0,
        path: f.paths,
        path_at: 0,
        batch: 2,
        width: 4,
        page_size: 4,
        rows_per_token: 2,
        row_bytes: 64,
    }])
    .unwrap();
    let page = 4096;
    dev.move_spans(
        f.buf,
        &[SpanMove {
            src: u64::from(k) * page,
            dst: 8 * page + u64::from(k) * page,
            len: page,
        }],
    )
    .unwrap();
    dev.fill_spans(
        f.buf,
        &[ByteSpan {
            offset: u64::from(k) * page,
            len: page,
        }],
        0,
    )
    .unwrap();
}

/// A step's FULL page table and SWA window from the lanes of `f.ids`: requests on lanes
/// 1 and 3, runs of 5 and 4 (the second past the table) and of 3 and 4 from entries 2
/// and -1, a start before the window.
fn lane_tables(f: &Fixture) -> [LaneTranslate; 2] {
    let full = LaneTranslate {
        v2p: f.v2p,
        rows: f.ids,
        lane_len: 8,
        lanes: (f.lane_meta, 0),
        firsts: None,
        starts: (f.lane_meta, 4),
        batch: 2,
        stride: 8,
        out: f.page_tables,
        out_at: 0,
        out_len: 6,
    };
    let window = LaneTranslate {
        firsts: Some((f.lane_meta, 2)),
        starts: (f.lane_meta, 7),
        out_at: 6,
        ..full
    };
    [full, window]
}

fn sync() -> HostSync {
    HostSync::acquire("test read-back")
}

/// `dev`'s tables and buffer after `steps` steps equal the CPU reference's.
fn assert_matches_the_cpu_after(dev: &CudaDevice, f: &Fixture, steps: u32) {
    let cpu = CpuDevice::new();
    let g = set_up(&cpu);
    for k in 0..steps {
        step(&cpu, &g, k);
    }
    let s = sync();
    for (a, b, len) in [
        (f.out, g.out, 40),
        (f.v2p, g.v2p, 64),
        (f.windows, g.windows, 16),
        (f.page_tables, g.page_tables, 12),
    ] {
        assert_eq!(
            dev.read_table(&s, a, 0, len).unwrap(),
            cpu.read_table(&s, b, 0, len).unwrap()
        );
    }
    assert_eq!(
        dev.read_bytes(&s, f.buf, 0, 1 << 16).unwrap(),
        cpu.read_bytes(&s, g.buf, 0, 1 << 16).unwrap()
    );
}

/// The ops of many steps (their lists wrap the ring many times) make only calls that
/// enqueue work or ask without waiting: no allocation, free, pageable copy or wait, and
/// no hazard at all, on a running stream and on one the GPU never gets to.
#[test]
fn the_op_path_makes_no_driver_call_that_may_block() {
    for stalled in [false, true] {
        // Stalled, nothing is consumed: the ring must hold every list, and the 64 fence
        // events made at boot every staged op (6 a step), so 10 steps.
        let dev = CudaDevice::emulated().with_staging(8192).unwrap();
        let f = set_up(&dev);
        if stalled {
            assert!(dev.stall_stream());
        }
        dev.trace_driver_calls();
        let before = dev.sync_hazards();
        let steps = if stalled { 10 } else { 200 };
        for k in 0..steps {
            step(&dev, &f, k);
            if !stalled {
                dev.end_step().unwrap();
            }
        }
        let calls = dev.take_driver_calls();
        assert!(calls.len() > 6 * steps as usize, "{}", calls.len());
        for record in &calls {
            assert!(
                matches!(
                    record.call,
                    DriverCall::CopyFromPinned { .. }
                        | DriverCall::Launch { .. }
                        | DriverCall::EventRecord
                        | DriverCall::EventQuery
                ),
                "stalled {stalled}: {record:?}"
            );
            assert_eq!(record.hazard, None, "{record:?}");
        }
        assert_eq!(dev.sync_hazards(), before, "stalled {stalled}");
        dev.resume_stream().unwrap();
        // And what the ops wrote is what the CPU reference writes.
        assert_matches_the_cpu_after(&dev, &f, steps);
    }
}

/// A lane translation's driver calls: its list (12 words per translation) copied from
/// the pinned ring, one launch of `unikv_translate_lanes` sized by the average run (x)
/// and the requests (y), and the ring's fence; none may block. A call with nothing to
/// launch and a refused call make no driver call at all.
#[test]
fn a_lane_translation_stages_one_list_through_the_ring_and_launches_once() {
    let dev = CudaDevice::emulated();
    let f = set_up(&dev);
    dev.upload_table(f.ids, 0, &(0..32).collect::<Vec<_>>())
        .unwrap();
    dev.scatter_table(f.v2p, &[(1, 3), (9, 5), (25, 2), (26, 7)])
        .unwrap();
    dev.trace_driver_calls();
    let before = dev.sync_hazards();
    dev.translate_lanes(&lane_tables(&f)).unwrap();
    let calls: Vec<_> = dev
        .take_driver_calls()
        .into_iter()
        .filter(|r| !matches!(r.call, DriverCall::EventQuery))
        .collect();
    let grid = Grid {
        blocks: (1, 4, 1),
        threads: 256,
    };
    assert_eq!(
        calls.iter().map(|r| r.call).collect::<Vec<_>>(),
        [
            DriverCall::CopyFromPinned { bytes: 2 * 12 * 8 },
            DriverCall::Launch {
                kernel: Kernel::TranslateLanes,
                grid
            },
            DriverCall::EventRecord,
        ]
    );
    for r in &calls {
        assert_eq!((r.op, r.hazard), ("translate_lanes", None), "{r:?}");
    }
    assert_eq!(dev.sync_hazards(), before);
    // Lane 1 holds pages 8..16 (9 → 5), lane 3 pages 24..32 (25 → 2, 26 → 7): lane 1
    // from entry 0 at 0..5, lane 3 at 5..9 (past the table from 6); lane 1 from entry 2
    // at -1..2 (only 0..2 lands), lane 3 from entry -1 at 2..6.
    assert_eq!(
        dev.read_table(&sync(), f.page_tables, 0, 12).unwrap(),
        [0, 40, 0, 0, 0, 0, 0, 0, 0, 0, 16, 56]
    );

    dev.take_driver_calls(); // the read-back's
    let [full, window] = lane_tables(&f);
    let nothing = [
        LaneTranslate { batch: 0, ..full },
        LaneTranslate {
            out_len: 0,
            ..window
        },
    ];
    dev.translate_lanes(&nothing).unwrap();
    let refused = [
        full,
        LaneTranslate {
            out_at: 5,
            ..window
        },
    ];
    assert!(dev.translate_lanes(&refused).is_err());
    let calls = dev.take_driver_calls();
    assert!(calls.is_empty(), "{calls:?}");
}

/// With no staging ring every list goes through a temporary allocation and a pageable
/// copy: each such call is a hazard, the ledger charges it to the op and its call site,
/// and its no-sync check fails, where the ring-staged backend passes.
#[test]
fn a_blocking_backend_is_caught_by_the_ledger_with_the_op_and_the_hazard() {
    let staged = Arc::new(SyncLedger::new(Arc::new(CudaDevice::emulated())));
    let f = set_up(&*staged);
    staged.reset();
    step(&*staged, &f, 1);
    staged.assert_no_syncs();

    let blocking = Arc::new(SyncLedger::new(Arc::new(
        CudaDevice::emulated().with_staging(0).unwrap(),
    )));
    let f = set_up(&*blocking);
    blocking.reset();
    step(&*blocking, &f, 1);
    let report = blocking.check_no_syncs().unwrap_err();
    let ops: Vec<&str> = report.offenders.iter().map(|r| r.op).collect();
    assert_eq!(
        ops,
        [
            "scatter_table",
            "upload_table",
            "translate_windows",
            "translate_lanes",
            "move_spans",
            "fill_spans"
        ],
        "the ops that stage a list, and only those: {report}"
    );
    for r in &report.offenders {
        assert!(r.hazards >= 1 && r.hazard.is_some(), "{r}");
        assert_eq!(r.location.file(), file!(), "{r}");
    }
    let upload = &report.offenders[1];
    assert_eq!(upload.hazard, Some(SyncHazard::PageableCopy), "{upload}");
    // An argument list in a temporary allocation: allocate, copy, free.
    assert_eq!(report.offenders[0].hazards, 3);
    assert_eq!(report.offenders[0].hazard, Some(SyncHazard::Free));
    assert!(report.to_string().contains("sync hazard"), "{report}");
}

/// On the legacy default stream (an engine that handed over the null stream) every
/// enqueued call is a hazard, even with a staging ring.
#[test]
fn the_legacy_default_stream_makes_every_enqueue_a_hazard() {
    let dev = CudaDevice::emulated_on(StreamKind::LegacyDefault);
    let f = set_up(&dev);
    dev.trace_driver_calls();
    step(&dev, &f, 0);
    let calls = dev.take_driver_calls();
    let enqueues = calls
        .iter()
        .filter(|r| {
            matches!(
                r.call,
                DriverCall::Launch { .. }
                    | DriverCall::CopyFromPinned { .. }
                    | DriverCall::EventRecord
            )
        })
        .count();
    assert!(enqueues >= 6);
    assert!(
        calls
            .iter()
            .filter(|r| !matches!(r.call, DriverCall::EventQuery))
            .all(|r| r.hazard == Some(SyncHazard::DefaultStream))
    );
    assert_eq!(dev.sync_hazards().last, Some(SyncHazard::DefaultStream));
}

/// A busy GPU (the stream stalled) fills a small ring: later ops still succeed, through
/// the counted fallback, and the results are right; the ring grows only at the step
/// boundary, after which the same step stages everything again.
#[test]
fn a_full_ring_falls_back_with_hazards_and_grows_only_at_the_step_boundary() {
    let dev = CudaDevice::emulated().with_staging(256).unwrap();
    let f = set_up(&dev);
    let cap = dev.staging_capacity();
    assert_eq!(cap, 256);
    assert!(dev.stall_stream());
    let before = dev.sync_hazards().count;
    for k in 0..4 {
        step(&dev, &f, k);
    }
    assert!(dev.sync_hazards().count > before, "the ring overflowed");
    assert_eq!(dev.staging_capacity(), cap, "no growth on the op path");
    dev.resume_stream().unwrap();
    dev.end_step().unwrap();
    let grown = dev.staging_capacity();
    assert!(grown > cap, "{grown}");
    assert_matches_the_cpu_after(&dev, &f, 4);

    assert!(dev.stall_stream());
    let before = dev.sync_hazards().count;
    step(&dev, &f, 5);
    assert_eq!(
        dev.sync_hazards().count,
        before,
        "the grown ring holds a step"
    );
    dev.resume_stream().unwrap();
    // A retired ring is freed once the stream is past it: at a later boundary.
    dev.trace_driver_calls();
    dev.end_step().unwrap();
    let frees = dev
        .take_driver_calls()
        .iter()
        .filter(|r| matches!(r.call, DriverCall::PinnedFree))
        .count();
    assert_eq!(frees, 1, "the old ring is freed");
}

/// One random op of the ring proptest.
#[derive(Clone, Debug)]
enum Op {
    Scatter(Vec<(u32, i32)>),
    Upload(usize, Vec<i32>),
    Move(u64, u64, u64),
    Fill(u64, u64, u8),
    Translate(usize),
    Stall,
    Resume,
    EndStep,
}

const TABLE: usize = 48;
const BYTES: u64 = 4096;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop::collection::vec((0..TABLE as u32, -2..50i32), 1..40).prop_map(Op::Scatter),
        3 => (0..TABLE / 2, prop::collection::vec(-1..200i32, 1..TABLE / 2))
            .prop_map(|(o, v)| Op::Upload(o, v)),
        2 => (0..BYTES / 2, 0..BYTES / 4, 1..BYTES / 4)
            .prop_map(|(s, d, l)| Op::Move(s, BYTES / 2 + d, l)),
        2 => (0..BYTES / 2, 1..BYTES / 2, any::<u8>()).prop_map(|(o, l, v)| Op::Fill(o, l, v)),
        2 => (0..TABLE).prop_map(Op::Translate),
        1 => Just(Op::Stall),
        1 => Just(Op::Resume),
        1 => Just(Op::EndStep),
    ]
}

fn apply(dev: &dyn Device, t: (TableId, TableId, TableId, BytesId), op: &Op) {
    let (v2p, ids, out, buf) = t;
    match op {
        Op::Scatter(e) => dev.scatter_table(v2p, e).unwrap(),
        Op::Upload(o, v) => dev.upload_table(ids, *o, v).unwrap(),
        Op::Move(s, d, l) => {
            let len = (*l).min(BYTES - d).min(BYTES / 2 - s);
            dev.move_spans(
                buf,
                &[SpanMove {
                    src: *s,
                    dst: *d,
                    len,
                }],
            )
            .unwrap()
        }
        Op::Fill(o, l, v) => dev
            .fill_spans(
                buf,
                &[ByteSpan {
                    offset: *o,
                    len: *l,
                }],
                *v,
            )
            .unwrap(),
        Op::Translate(n) => dev
            .translate(&Translate {
                v2p,
                ids,
                n: *n,
                page_size: 3,
                stride: 5,
                out,
                out_width: TABLE,
            })
            .unwrap(),
        Op::Stall | Op::Resume | Op::EndStep => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random ops through a small ring, with the GPU stalling and catching up at random
    /// and step boundaries between: the backend's tables and bytes equal the CPU
    /// reference's after every run, so no staged list was overwritten in flight.
    #[test]
    fn a_small_ring_under_a_stalling_gpu_matches_the_cpu_reference(
        ring in prop_oneof![Just(0usize), 64usize..1024],
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let dev = CudaDevice::emulated().with_staging(ring).unwrap();
        let cpu = CpuDevice::new();
        let make = |d: &dyn Device| (
            d.alloc_table(TABLE, 0).unwrap(),
            d.alloc_table(TABLE, 1).unwrap(),
            d.alloc_table(TABLE, -1).unwrap(),
            d.alloc_bytes(BYTES, 3).unwrap(),
        );
        let (t, u) = (make(&dev), make(&cpu));
        for op in &ops {
            match op {
                Op::Stall => { dev.stall_stream(); }
                Op::Resume => dev.resume_stream().unwrap(),
                Op::EndStep => dev.end_step().unwrap(),
                _ => {}
            }
            apply(&dev, t, op);
            apply(&cpu, u, op);
        }
        let s = sync();
        for (a, b) in [(t.0, u.0), (t.1, u.1), (t.2, u.2)] {
            prop_assert_eq!(dev.read_table(&s, a, 0, TABLE).unwrap(), cpu.read_table(&s, b, 0, TABLE).unwrap());
        }
        prop_assert_eq!(dev.read_bytes(&s, t.3, 0, BYTES).unwrap(), cpu.read_bytes(&s, u.3, 0, BYTES).unwrap());
    }
}

/// A clocked emulation's spin keeps the stream busy for its cycles in host nanoseconds
/// and then the stream goes on by itself: timed events around it read its length, a
/// spin enqueued behind it starts where it ended (no idle between the two), the host
/// never waits to enqueue, and a read-back sleeps the spins out.
#[test]
fn a_clocked_spin_lasts_its_cycles_and_timed_events_read_the_stream_time() {
    use std::time::{Duration, Instant};
    let dev = CudaDevice::emulated_clocked();
    let table = dev.alloc_table(1, 3).unwrap();
    let enqueued = Instant::now();
    let first_start = dev.record_timed_event().unwrap();
    dev.launch_spin(30_000_000).unwrap(); // 30 ms
    let first_end = dev.record_timed_event().unwrap();
    let second_start = dev.record_timed_event().unwrap();
    dev.launch_spin(10_000_000).unwrap();
    let second_end = dev.record_timed_event().unwrap();
    let returned = enqueued.elapsed();
    if returned < Duration::from_millis(30) {
        assert!(
            !first_end.is_done().unwrap(),
            "the stream is still in the spin"
        );
        assert!(
            first_end.elapsed_since(&first_start).is_err(),
            "no time before the event is done"
        );
    }
    let s = HostSync::acquire("test");
    assert_eq!(dev.read_table(&s, table, 0, 1).unwrap(), [3]);
    assert!(
        enqueued.elapsed() >= Duration::from_millis(40),
        "the read-back waited"
    );
    assert!(second_end.is_done().unwrap());
    let first = first_end.elapsed_since(&first_start).unwrap();
    assert!(
        first >= Duration::from_millis(30) && first < Duration::from_millis(30) + returned,
        "{first:?}"
    );
    assert_eq!(
        second_start.elapsed_since(&first_end).unwrap(),
        Duration::ZERO,
        "enqueued behind the first: no idle"
    );
    assert_eq!(
        second_end.elapsed_since(&second_start).unwrap(),
        Duration::from_millis(10)
    );
    assert_eq!(
        first_start.elapsed_since(&second_end).unwrap(),
        Duration::ZERO,
        "backwards reads as zero"
    );
}

/// On the unclocked emulation a spin still lasts until the stream is resumed (the
/// no-sync proofs rely on it), and a timed event behind it is done only then.
#[test]
fn an_unclocked_spin_lasts_until_resumed_and_its_timed_event_waits_with_it() {
    let dev = CudaDevice::emulated();
    let start = dev.record_timed_event().unwrap();
    dev.launch_spin(1).unwrap();
    let end = dev.record_timed_event().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2));
    assert!(start.is_done().unwrap());
    assert!(
        !end.is_done().unwrap(),
        "a spin of one cycle still holds the stream"
    );
    dev.resume_stream().unwrap();
    assert!(end.is_done().unwrap());
    assert!(end.elapsed_since(&start).unwrap() >= std::time::Duration::from_millis(2));
}

/// A step that stages more lists than the device has fence events, while the GPU is busy
/// (an overlap scheduler's step, during the forward): a list without an event of its own
/// is covered by the next fence, so every op still stages through the ring (no fallback,
/// no hazard) and the boundary does not grow a ring that had room. Before, each such step
/// fell back and doubled the ring, step after step (the overlap benchmark's replay held
/// gigabytes of staging).
#[test]
fn a_step_with_more_lists_than_fences_stages_them_all_and_does_not_grow_the_ring() {
    let dev = CudaDevice::emulated();
    let table = dev.alloc_table(4096, 0).unwrap();
    let cap = dev.staging_capacity();
    for step in 0..3 {
        assert!(dev.stall_stream());
        let before = dev.sync_hazards().count;
        for i in 0..500u32 {
            dev.scatter_table(table, &[(i, (step * 1000 + i) as i32)])
                .unwrap();
        }
        assert_eq!(dev.sync_hazards().count, before, "step {step}: no fallback");
        dev.end_step().unwrap();
        assert_eq!(
            dev.staging_capacity(),
            cap,
            "step {step}: the ring had room"
        );
        dev.resume_stream().unwrap();
        let s = HostSync::acquire("test");
        let got = dev.read_table(&s, table, 0, 500).unwrap();
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, &v)| v == (step * 1000 + i as u32) as i32),
            "step {step}"
        );
    }
}

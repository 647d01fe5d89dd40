//! The device half of the host tier: host-tier buffers, the stream-ordered copies between
//! them and a device byte buffer, and the events that say, without waiting, when a copy
//! has completed. On every in-tree backend: the CPU reference, the bookkeeping-only
//! `none` device and the CUDA backend over its emulated driver (whose stream can be
//! stalled as if the GPU were busy).

use std::sync::Arc;
use unikv_kernels::{
    ByteSpan, BytesId, CopyEvent, CpuDevice, CudaDevice, Device, DeviceOp, DriverCall, Error,
    FaultInjector, HostBytesId, HostCopy, HostSync, NullDevice, Readback, SyncHazard, SyncLedger,
};

fn sync() -> HostSync {
    HostSync::acquire("host tier test")
}

fn copy(device: u64, host: u64, len: u64) -> HostCopy {
    HostCopy { device, host, len }
}

/// Bytes of the device buffer every scenario uses.
const DEVICE_LEN: u64 = 256;
/// Bytes of its host buffer.
const HOST_LEN: u64 = 128;

/// The device buffer's pattern: byte `i` is `i % 251 + 1` (never 0, the host buffer's
/// fill).
fn pattern() -> Vec<u8> {
    (0..DEVICE_LEN).map(|i| (i % 251 + 1) as u8).collect()
}

/// A device buffer holding [`pattern`]. The trait has no byte upload: one fill per byte
/// value, over the single-byte spans that hold it.
fn patterned(dev: &dyn Device) -> BytesId {
    let buf = dev.alloc_bytes(DEVICE_LEN, 0).unwrap();
    for (i, &b) in pattern().iter().enumerate() {
        let span = ByteSpan {
            offset: i as u64,
            len: 1,
        };
        dev.fill_spans(buf, &[span], b).unwrap();
    }
    buf
}

/// The backends, by name: the two that keep bytes, then the one that keeps lengths.
fn backends() -> Vec<(&'static str, Arc<dyn Readback>)> {
    vec![
        ("cpu", Arc::new(CpuDevice::new())),
        ("emulated-cuda", Arc::new(CudaDevice::emulated())),
        ("none", Arc::new(NullDevice::new())),
    ]
}

/// Everything a refused call must leave as it was: the device and host bytes.
fn snapshot(dev: &dyn Readback, buf: BytesId, host: HostBytesId) -> (Vec<u8>, Vec<u8>) {
    let s = sync();
    (
        dev.read_bytes(&s, buf, 0, DEVICE_LEN).unwrap(),
        dev.read_host(&s, host, 0, HOST_LEN).unwrap(),
    )
}

#[test]
fn a_write_back_then_a_load_back_elsewhere_restores_the_bytes() {
    for (name, dev) in backends() {
        let buf = patterned(dev.as_ref());
        let host = dev.alloc_host(HOST_LEN).unwrap();
        let s = sync();
        assert_eq!(dev.read_host(&s, host, 0, HOST_LEN).unwrap(), [0; 128]);
        // Write back two pages out of order (and an empty copy), then load them back into
        // the buffer's upper half, swapped.
        let out = [copy(64, 32, 32), copy(0, 0, 16), copy(200, 127, 0)];
        dev.copy_device_to_host(buf, host, &out).unwrap();
        let back = [copy(128, 32, 32), copy(160, 0, 16)];
        dev.copy_host_to_device(host, buf, &back).unwrap();
        let event = dev.record_copy_event().unwrap();
        // Not stalled: every backend has completed by the time it is asked.
        assert!(dev.copy_event_done(event).unwrap(), "{name}");
        dev.free_copy_event(event).unwrap();

        let got_host = dev.read_host(&s, host, 0, HOST_LEN).unwrap();
        let got = dev.read_bytes(&s, buf, 0, DEVICE_LEN).unwrap();
        if !dev.holds_bytes() {
            // Bookkeeping only: accepted, and reads are zeros of the length asked.
            assert_eq!((got_host, got), (vec![0; 128], vec![0; 256]), "{name}");
            continue;
        }
        let p = pattern();
        let mut host_bytes = vec![0; HOST_LEN as usize];
        host_bytes[32..64].copy_from_slice(&p[64..96]);
        host_bytes[..16].copy_from_slice(&p[..16]);
        assert_eq!(got_host, host_bytes, "{name}: the write-back");
        let mut device = p.clone();
        device[128..160].copy_from_slice(&p[64..96]);
        device[160..176].copy_from_slice(&p[..16]);
        assert_eq!(got, device, "{name}: the load-back");
    }
}

#[test]
fn copies_may_read_overlapping_sources() {
    for (name, dev) in backends() {
        let buf = patterned(dev.as_ref());
        let host = dev.alloc_host(HOST_LEN).unwrap();
        // One device page written back twice; then one host range loaded back twice.
        dev.copy_device_to_host(buf, host, &[copy(8, 0, 16), copy(8, 64, 16)])
            .unwrap();
        dev.copy_host_to_device(host, buf, &[copy(100, 0, 16), copy(200, 4, 8)])
            .unwrap();
        if dev.holds_bytes() {
            let s = sync();
            let p = pattern();
            let host_bytes = dev.read_host(&s, host, 0, HOST_LEN).unwrap();
            assert_eq!(host_bytes[..16], p[8..24], "{name}");
            assert_eq!(host_bytes[64..80], p[8..24], "{name}");
            let got = dev.read_bytes(&s, buf, 100, 108).unwrap();
            assert_eq!(got[..16], p[8..24], "{name}");
            assert_eq!(got[100..108], p[12..20], "{name}");
        }
    }
}

/// One call on a backend, from its buffer, host buffer and an event it recorded.
type Call = Box<dyn Fn(&dyn Readback, BytesId, HostBytesId, CopyEvent) -> Result<(), Error>>;

/// The refused calls and the error each must return, on every backend alike (the
/// device's name aside).
fn refusals() -> Vec<(&'static str, Call, &'static str)> {
    let unknown_buf = BytesId(77);
    let unknown_host = HostBytesId(77);
    vec![
        (
            "unknown device buffer",
            Box::new(move |d, _, h, _| d.copy_device_to_host(unknown_buf, h, &[copy(0, 0, 1)])),
            r#"UnknownHandle { kind: "bytes", id: 77, device: "DEV" }"#,
        ),
        (
            "unknown host buffer",
            Box::new(move |d, b, _, _| d.copy_device_to_host(b, unknown_host, &[copy(0, 0, 1)])),
            r#"UnknownHandle { kind: "host bytes", id: 77, device: "DEV" }"#,
        ),
        (
            "a load-back looks its source (the host buffer) up first",
            Box::new(move |d, _, _, _| {
                d.copy_host_to_device(unknown_host, unknown_buf, &[copy(0, 0, 1)])
            }),
            r#"UnknownHandle { kind: "host bytes", id: 77, device: "DEV" }"#,
        ),
        (
            "past the device buffer",
            Box::new(|d, b, h, _| d.copy_device_to_host(b, h, &[copy(0, 0, 8), copy(250, 8, 8)])),
            r#"OutOfBounds { op: "copy_device_to_host", kind: "bytes", id: 0, start: 250, end: 258, len: 256 }"#,
        ),
        (
            "past the host buffer",
            Box::new(|d, b, h, _| d.copy_device_to_host(b, h, &[copy(0, 0, 8), copy(8, 121, 8)])),
            r#"OutOfBounds { op: "copy_device_to_host", kind: "host bytes", id: 0, start: 121, end: 129, len: 128 }"#,
        ),
        (
            "past the host buffer on a load-back",
            Box::new(|d, b, h, _| d.copy_host_to_device(h, b, &[copy(0, 128, 1)])),
            r#"OutOfBounds { op: "copy_host_to_device", kind: "host bytes", id: 0, start: 128, end: 129, len: 128 }"#,
        ),
        (
            "an offset that wraps",
            Box::new(|d, b, h, _| d.copy_host_to_device(h, b, &[copy(u64::MAX, 0, 2)])),
            r#"OutOfBounds { op: "copy_host_to_device", kind: "bytes", id: 0, start: 18446744073709551615, end: 18446744073709551615, len: 256 }"#,
        ),
        (
            "two write-backs into overlapping host ranges",
            Box::new(|d, b, h, _| {
                d.copy_device_to_host(b, h, &[copy(0, 40, 8), copy(64, 0, 16), copy(128, 12, 4)])
            }),
            r#"OverlappingCopies { op: "copy_device_to_host", id: 0, copy: 2, dst: 12..16, other_copy: 1, other: 0..16 }"#,
        ),
        (
            "two load-backs into overlapping device ranges",
            Box::new(|d, b, h, _| d.copy_host_to_device(h, b, &[copy(16, 0, 16), copy(31, 64, 2)])),
            r#"OverlappingCopies { op: "copy_host_to_device", id: 0, copy: 1, dst: 31..33, other_copy: 0, other: 16..32 }"#,
        ),
        (
            "an unknown event",
            Box::new(|d, _, _, e| d.copy_event_done(CopyEvent(e.0 + 5)).map(drop)),
            r#"UnknownHandle { kind: "copy event", id: 5, device: "DEV" }"#,
        ),
        (
            "an unknown event freed",
            Box::new(|d, _, _, e| d.free_copy_event(CopyEvent(e.0 + 5))),
            r#"UnknownHandle { kind: "copy event", id: 5, device: "DEV" }"#,
        ),
        (
            "an unknown host buffer freed",
            Box::new(move |d, _, _, _| d.free_host(unknown_host)),
            r#"UnknownHandle { kind: "host bytes", id: 77, device: "DEV" }"#,
        ),
        (
            "a read past the host buffer",
            Box::new(|d, _, h, _| d.read_host(&sync(), h, 100, 29).map(drop)),
            r#"OutOfBounds { op: "read_host", kind: "host bytes", id: 0, start: 100, end: 129, len: 128 }"#,
        ),
    ]
}

#[test]
fn refused_calls_return_the_typed_error_and_change_nothing() {
    for (name, dev) in backends() {
        let buf = patterned(dev.as_ref());
        let host = dev.alloc_host(HOST_LEN).unwrap();
        dev.copy_device_to_host(buf, host, &[copy(0, 64, 64)])
            .unwrap();
        let event = dev.record_copy_event().unwrap();
        let before = snapshot(dev.as_ref(), buf, host);
        for (what, call, expected) in refusals() {
            let err = call(dev.as_ref(), buf, host, event).expect_err(what);
            let got = format!("{err:?}").replace(&format!("\"{name}\""), "\"DEV\"");
            // The CUDA backend names its handles' device `cuda`, as on a GPU.
            let got = got.replace("\"cuda\"", "\"DEV\"");
            assert_eq!(got, expected, "{name}: {what}");
            assert_eq!(snapshot(dev.as_ref(), buf, host), before, "{name}: {what}");
        }
        // The handles the refusals named were never issued; the real ones still work.
        assert!(dev.copy_event_done(event).unwrap());
        dev.free_copy_event(event).unwrap();
        dev.free_host(host).unwrap();
        // Released handles are unknown from then on.
        assert!(matches!(
            dev.free_copy_event(event),
            Err(Error::UnknownHandle {
                kind: "copy event",
                ..
            })
        ));
        assert!(matches!(
            dev.read_host(&sync(), host, 0, 1),
            Err(Error::UnknownHandle {
                kind: "host bytes",
                ..
            })
        ));
    }
}

#[test]
fn a_refused_call_issues_no_driver_call() {
    let dev = CudaDevice::emulated();
    let buf = patterned(&dev);
    let host = dev.alloc_host(HOST_LEN).unwrap();
    let event = dev.record_copy_event().unwrap();
    dev.trace_driver_calls();
    for (what, call, _) in refusals() {
        if what.starts_with("a read") {
            continue; // a read-back may synchronise; it is refused before, but not an op
        }
        call(&dev, buf, host, event).expect_err(what);
        assert_eq!(dev.take_driver_calls(), [], "{what}");
    }
}

#[test]
fn the_ledger_counts_no_sync_but_read_host_and_the_pinned_allocations() {
    for (name, dev) in backends() {
        let ledger = SyncLedger::new(dev.clone());
        let buf = ledger.inner().alloc_bytes(64, 3).unwrap();
        let host = ledger.alloc_host(64).unwrap();
        ledger
            .copy_device_to_host(buf, host, &[copy(0, 0, 32), copy(32, 40, 8)])
            .unwrap();
        ledger
            .copy_host_to_device(host, buf, &[copy(40, 0, 8)])
            .unwrap();
        let event = ledger.record_copy_event().unwrap();
        assert!(ledger.copy_event_done(event).unwrap());
        ledger.free_copy_event(event).unwrap();
        let bytes = ledger.read_host(&sync(), host, 0, 2).unwrap();
        ledger.free_host(host).unwrap();

        let ops: Vec<(&str, bool)> = ledger.ops().iter().map(|r| (r.op, r.synced)).collect();
        // Allocating and freeing pinned memory may block (cuMemHostAlloc, cuMemFreeHost):
        // set-up, and counted as such on the CUDA backend. Nothing else waits but the read.
        let pinned = name == "emulated-cuda";
        assert_eq!(
            ops,
            [
                ("alloc_host", pinned),
                ("copy_device_to_host", false),
                ("copy_host_to_device", false),
                ("record_copy_event", false),
                ("copy_event_done", false),
                ("free_copy_event", false),
                ("read_host", true),
                ("free_host", pinned),
            ],
            "{name}"
        );
        let records = ledger.ops();
        assert_eq!(ledger.syncs(), if pinned { 3 } else { 1 }, "{name}");
        assert_eq!(ledger.data_dependent_shapes(), 1, "{name}: read_host");
        if pinned {
            assert_eq!(records[0].hazard, Some(SyncHazard::Allocation));
            assert_eq!(records[7].hazard, Some(SyncHazard::Free));
        }
        assert_eq!(records[1].location.file(), file!());
        let expected = if dev.holds_bytes() { [3, 3] } else { [0, 0] };
        assert_eq!(bytes, expected, "{name}");
    }
}

#[test]
fn a_write_back_on_a_stalled_stream_is_pending_until_resumed() {
    let dev = CudaDevice::emulated();
    let buf = patterned(&dev);
    let host = dev.alloc_host(HOST_LEN).unwrap();
    let before = dev.sync_hazards();
    assert!(dev.stall_stream());
    dev.copy_device_to_host(buf, host, &[copy(16, 8, 24)])
        .unwrap();
    let event = dev.record_copy_event().unwrap();
    // The GPU is busy: the copy waits in the stream, and asking changes nothing.
    for _ in 0..3 {
        assert!(!dev.copy_event_done(event).unwrap());
    }
    assert_eq!(dev.peek_host(host, 0, 40).unwrap(), Some(vec![0; 40]));
    assert_eq!(dev.sync_hazards(), before, "nothing waited");
    dev.resume_stream().unwrap();
    assert!(dev.copy_event_done(event).unwrap());
    let mut expected = vec![0; 40];
    expected[8..32].copy_from_slice(&pattern()[16..40]);
    assert_eq!(dev.peek_host(host, 0, 40).unwrap(), Some(expected.clone()));
    assert_eq!(dev.read_host(&sync(), host, 0, 40).unwrap(), expected);
}

#[test]
fn an_event_recorded_before_a_stalled_copy_is_done_and_one_after_it_is_not() {
    let dev = CudaDevice::emulated();
    let buf = patterned(&dev);
    let host = dev.alloc_host(HOST_LEN).unwrap();
    assert!(dev.stall_stream());
    let earlier = dev.record_copy_event().unwrap();
    dev.copy_host_to_device(host, buf, &[copy(0, 0, 8)])
        .unwrap();
    let later = dev.record_copy_event().unwrap();
    assert!(dev.copy_event_done(earlier).unwrap());
    assert!(!dev.copy_event_done(later).unwrap());
    dev.resume_stream().unwrap();
    assert!(dev.copy_event_done(later).unwrap());
    assert_eq!(
        dev.read_bytes(&sync(), buf, 0, 9).unwrap(),
        [0, 0, 0, 0, 0, 0, 0, 0, 9]
    );
}

/// The cache's move of a page to the host tier and back: the page is written back, its
/// device range reused at once (stream order keeps the copy ahead of the reuse), and the
/// page loaded back into another range, all while the GPU is busy.
#[test]
fn a_page_written_back_and_loaded_elsewhere_on_a_busy_stream_arrives_whole() {
    let dev = CudaDevice::emulated();
    let buf = patterned(&dev);
    let host = dev.alloc_host(HOST_LEN).unwrap();
    assert!(dev.stall_stream());
    dev.copy_device_to_host(buf, host, &[copy(32, 64, 32)])
        .unwrap();
    let written_back = dev.record_copy_event().unwrap();
    // The page's device range is handed out again and zeroed, in stream order.
    dev.fill_spans(
        buf,
        &[ByteSpan {
            offset: 32,
            len: 32,
        }],
        0,
    )
    .unwrap();
    dev.copy_host_to_device(host, buf, &[copy(192, 64, 32)])
        .unwrap();
    let loaded = dev.record_copy_event().unwrap();
    assert!(!dev.copy_event_done(written_back).unwrap());
    assert!(!dev.copy_event_done(loaded).unwrap());
    dev.resume_stream().unwrap();
    assert!(dev.copy_event_done(written_back).unwrap() && dev.copy_event_done(loaded).unwrap());
    let got = dev.read_bytes(&sync(), buf, 0, DEVICE_LEN).unwrap();
    let p = pattern();
    assert_eq!(got[192..224], p[32..64], "the page arrived");
    assert_eq!(got[32..64], [0; 32], "its old range was reused");
}

#[test]
fn the_host_tier_op_path_makes_no_driver_call_that_may_block() {
    let dev = CudaDevice::emulated();
    let buf = patterned(&dev);
    let host = dev.alloc_host(HOST_LEN).unwrap();
    dev.trace_driver_calls();
    let before = dev.sync_hazards();
    // Three copies, the first two adjacent on both sides: two driver calls.
    dev.copy_device_to_host(buf, host, &[copy(0, 0, 8), copy(8, 8, 8), copy(64, 32, 4)])
        .unwrap();
    dev.copy_host_to_device(host, buf, &[copy(128, 0, 16)])
        .unwrap();
    let event = dev.record_copy_event().unwrap();
    dev.copy_event_done(event).unwrap();
    dev.free_copy_event(event).unwrap();
    let calls: Vec<(&str, DriverCall)> = dev
        .take_driver_calls()
        .into_iter()
        .inspect(|r| assert_eq!(r.hazard, None, "{r:?}"))
        .map(|r| (r.op, r.call))
        .collect();
    assert_eq!(
        calls,
        [
            (
                "copy_device_to_host",
                DriverCall::CopyToPinned { bytes: 16 }
            ),
            ("copy_device_to_host", DriverCall::CopyToPinned { bytes: 4 }),
            ("copy_device_to_host", DriverCall::EventRecord),
            (
                "copy_host_to_device",
                DriverCall::CopyFromPinned { bytes: 16 }
            ),
            ("copy_host_to_device", DriverCall::EventRecord),
            ("record_copy_event", DriverCall::EventCreate),
            ("record_copy_event", DriverCall::EventRecord),
            ("copy_event_done", DriverCall::EventQuery),
            ("free_copy_event", DriverCall::EventDestroy),
        ]
    );
    assert_eq!(dev.sync_hazards(), before);
}

#[test]
fn a_host_buffer_freed_under_a_pending_copy_is_released_after_it() {
    let dev = CudaDevice::emulated();
    let buf = patterned(&dev);
    let host = dev.alloc_host(HOST_LEN).unwrap();
    dev.trace_driver_calls();
    assert!(dev.stall_stream());
    dev.copy_device_to_host(buf, host, &[copy(0, 0, 64)])
        .unwrap();
    dev.free_host(host).unwrap();
    let freed = |calls: &[unikv_kernels::DriverRecord]| {
        calls
            .iter()
            .filter(|r| r.call == DriverCall::PinnedFree)
            .map(|r| r.op)
            .collect::<Vec<_>>()
    };
    let calls = dev.take_driver_calls();
    assert_eq!(freed(&calls), [] as [&str; 0], "the copy still writes it");
    // A step boundary while the GPU is still busy keeps it too.
    dev.end_step().unwrap();
    assert_eq!(freed(&dev.take_driver_calls()), [] as [&str; 0]);
    dev.resume_stream().unwrap(); // the copy lands in memory that is still there
    dev.end_step().unwrap();
    assert_eq!(freed(&dev.take_driver_calls()), ["end_step"]);
    // The stream is healthy and the handle gone.
    dev.fill_spans(buf, &[ByteSpan { offset: 0, len: 1 }], 0)
        .unwrap();
    assert_eq!(dev.read_bytes(&sync(), buf, 0, 2).unwrap(), [0, 2]);
    assert!(dev.read_host(&sync(), host, 0, 1).is_err());
}

#[test]
fn host_copies_are_refused_inside_a_graph_capture() {
    let dev = CudaDevice::emulated();
    let buf = patterned(&dev);
    let host = dev.alloc_host(HOST_LEN).unwrap();
    for op in [
        "copy_device_to_host",
        "copy_host_to_device",
        "record_copy_event",
    ] {
        let err = dev
            .capture(|d| match op {
                "copy_device_to_host" => d.copy_device_to_host(buf, host, &[copy(0, 0, 8)]),
                "copy_host_to_device" => d.copy_host_to_device(host, buf, &[copy(0, 0, 8)]),
                _ => d.record_copy_event().map(drop),
            })
            .unwrap_err();
        assert!(
            matches!(err, Error::NotCapturable { op: refused } if refused == op),
            "{err:?}"
        );
    }
    // Outside a capture they run.
    dev.copy_device_to_host(buf, host, &[copy(0, 0, 8)])
        .unwrap();
}

/// Each host-tier op, from a buffer, a host buffer and an event.
fn host_tier_ops() -> Vec<(DeviceOp, Call)> {
    vec![
        (
            DeviceOp::AllocHost,
            Box::new(|d, _, _, _| d.alloc_host(16).map(drop)),
        ),
        (DeviceOp::FreeHost, Box::new(|d, _, h, _| d.free_host(h))),
        (
            DeviceOp::CopyDeviceToHost,
            Box::new(|d, b, h, _| d.copy_device_to_host(b, h, &[copy(0, 0, 32)])),
        ),
        (
            DeviceOp::CopyHostToDevice,
            Box::new(|d, b, h, _| d.copy_host_to_device(h, b, &[copy(64, 0, 32)])),
        ),
        (
            DeviceOp::RecordCopyEvent,
            Box::new(|d, _, _, _| d.record_copy_event().map(drop)),
        ),
        (
            DeviceOp::CopyEventDone,
            Box::new(|d, _, _, e| d.copy_event_done(e).map(drop)),
        ),
        (
            DeviceOp::FreeCopyEvent,
            Box::new(|d, _, _, e| d.free_copy_event(e)),
        ),
    ]
}

#[test]
fn the_fault_injector_fails_each_host_tier_op_and_the_failed_op_changes_nothing() {
    let cpu = Arc::new(CpuDevice::new());
    let cuda = Arc::new(CudaDevice::emulated());
    cuda.trace_driver_calls();
    let inners: [(&str, Arc<dyn Readback>); 2] =
        [("cpu", cpu.clone()), ("emulated-cuda", cuda.clone())];
    for (name, inner) in inners {
        let faults: FaultInjector<dyn Readback> = FaultInjector::new(inner.clone());
        for (op, call) in host_tier_ops() {
            // Fresh handles per op, with bytes in both buffers that a copy would change.
            let buf = patterned(&faults);
            let host = faults.alloc_host(HOST_LEN).unwrap();
            faults
                .copy_device_to_host(buf, host, &[copy(128, 0, 128)])
                .unwrap();
            let event = faults.record_copy_event().unwrap();
            let before = snapshot(&faults, buf, host);
            let live = cpu.live_allocations();
            cuda.take_driver_calls();

            faults.fail_every(op);
            let err = call(&faults, buf, host, event).unwrap_err();
            assert!(
                matches!(err, Error::InjectedFault { op: refused, .. } if refused == op.as_str()),
                "{name}: {err:?}"
            );
            assert_eq!(snapshot(&faults, buf, host), before, "{name}: {op:?}");
            if name == "cpu" {
                assert_eq!(
                    cpu.live_allocations(),
                    live,
                    "{op:?}: nothing allocated or freed"
                );
            } else {
                let calls: Vec<_> = cuda
                    .take_driver_calls()
                    .into_iter()
                    .filter(|r| r.op != "read_bytes" && r.op != "read_host")
                    .collect();
                assert_eq!(calls, [], "{op:?}: nothing reached the driver");
            }
            // The handles still work, and the retry succeeds.
            faults.clear();
            call(&faults, buf, host, event).unwrap();
        }
        // Read-backs are diagnostics: never failed (nor counted), as for read_bytes.
        let host = faults.alloc_host(8).unwrap();
        faults.fail_every(DeviceOp::ReadHost);
        let seen = faults.ops_seen();
        assert_eq!(faults.read_host(&sync(), host, 0, 8).unwrap(), [0; 8]);
        assert_eq!(faults.ops_seen(), seen);
        faults.clear();
    }
}

#[test]
fn host_tier_ops_are_named_and_only_read_host_waits() {
    let ops = [
        (DeviceOp::AllocHost, "alloc_host"),
        (DeviceOp::FreeHost, "free_host"),
        (DeviceOp::CopyDeviceToHost, "copy_device_to_host"),
        (DeviceOp::CopyHostToDevice, "copy_host_to_device"),
        (DeviceOp::RecordCopyEvent, "record_copy_event"),
        (DeviceOp::CopyEventDone, "copy_event_done"),
        (DeviceOp::FreeCopyEvent, "free_copy_event"),
        (DeviceOp::ReadHost, "read_host"),
    ];
    for (op, name) in ops {
        assert_eq!(op.as_str(), name);
        let reads = op == DeviceOp::ReadHost;
        assert_eq!(
            (op.waits(), op.returns_device_data()),
            (reads, reads),
            "{name}"
        );
    }
}

#[test]
fn a_large_host_tier_costs_only_what_was_copied_into_it() {
    // 64 GiB of host tier on the CPU backend, 32 GiB on `none`: neither takes the memory.
    let cpu = CpuDevice::new();
    let buf = cpu.alloc_bytes(1 << 30, 0).unwrap();
    let host = cpu.alloc_host(64 << 30).unwrap();
    cpu.fill_spans(
        buf,
        &[ByteSpan {
            offset: 4096,
            len: 4,
        }],
        5,
    )
    .unwrap();
    cpu.copy_device_to_host(buf, host, &[copy(0, 60 << 30, 1 << 30)])
        .unwrap();
    let got = cpu.read_host(&sync(), host, (60 << 30) + 4095, 6).unwrap();
    assert_eq!(got, [0, 5, 5, 5, 5, 0]);
    let none = NullDevice::new();
    let host = none.alloc_host(32 << 30).unwrap();
    let buf = none.alloc_bytes(80 << 30, 0).unwrap();
    none.copy_host_to_device(host, buf, &[copy(40 << 30, 0, 32 << 30)])
        .unwrap();
}

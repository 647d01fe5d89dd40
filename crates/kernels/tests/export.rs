//! Zero-copy table exports (`Device::export_table`) on the CPU backend and on the CUDA
//! backend over its emulated driver: the address reads what the ops wrote, in place; it
//! holds across later ops; a freed table's memory is kept while an export guard lives;
//! and ordering a reader's stream after the device's work never makes the host wait.

use std::sync::Arc;
use unikv_kernels::{
    CpuDevice, CudaDevice, Device, DriverCall, Error, ExportDevice, HostSync, NullDevice, Readback,
    SyncLedger, TableExport,
};

/// The entries of a CPU export, read in place.
fn read_cpu(export: &TableExport) -> Vec<i32> {
    assert_eq!(export.device, ExportDevice::Cpu);
    // SAFETY: a CPU export's address is the host address of `len` initialised `i32`s,
    // kept allocated while `export.guard` lives (it does: `export` is borrowed), and no
    // other thread runs an op on this device meanwhile.
    unsafe { std::slice::from_raw_parts(export.address as *const i32, export.len) }.to_vec()
}

#[test]
fn a_cpu_export_reads_the_table_in_place_and_sees_later_writes() {
    let cpu = Arc::new(CpuDevice::new());
    let dev: Arc<dyn Device> = cpu.clone();
    let table = dev.alloc_table(6, -1).unwrap();
    dev.upload_table(table, 1, &[10, 11, 12]).unwrap();
    let export = dev.export_table(table).unwrap();
    assert_eq!(export.len, 6);
    assert_eq!(export.address % 4, 0);
    let sync = HostSync::acquire("test: the host read to compare with");
    assert_eq!(
        read_cpu(&export),
        cpu.read_table(&sync, table, 0, 6).unwrap()
    );
    assert_eq!(read_cpu(&export), [-1, 10, 11, 12, -1, -1]);

    // No copy: a later op's write shows through the same address, which did not move
    // although other tables were allocated meanwhile.
    let others: Vec<_> = (0..64).map(|_| dev.alloc_table(100, 0).unwrap()).collect();
    dev.scatter_table(table, &[(0, 7), (5, 9)]).unwrap();
    assert_eq!(dev.export_table(table).unwrap().address, export.address);
    assert_eq!(read_cpu(&export), [7, 10, 11, 12, -1, 9]);
    for t in others {
        dev.free_table(t).unwrap();
    }
}

#[test]
fn a_freed_cpu_table_stays_readable_while_its_export_lives() {
    let cpu = Arc::new(CpuDevice::new());
    let table = cpu.alloc_table(4, 3).unwrap();
    let export = cpu.export_table(table).unwrap();
    cpu.free_table(table).unwrap();
    assert!(matches!(
        cpu.export_table(table),
        Err(Error::UnknownHandle { .. })
    ));
    // Allocations reuse nothing of it while the guard lives.
    let other = cpu.alloc_table(4, 8).unwrap();
    assert_eq!(read_cpu(&export), [3, 3, 3, 3]);
    assert_eq!(cpu.live_allocations(), 1);
    drop(export);
    cpu.free_table(other).unwrap(); // releases the kept memory too
    assert_eq!(cpu.live_allocations(), 0);
}

#[test]
fn an_emulated_cuda_export_names_the_table_memory_and_keeps_it_while_guarded() {
    let cuda = Arc::new(CudaDevice::emulated());
    let table = cuda.alloc_table(5, 0).unwrap();
    let other = cuda.alloc_table(5, 0).unwrap();
    let export = cuda.export_table(table).unwrap();
    assert_eq!(export.device, ExportDevice::EmulatedCuda);
    assert_eq!(export.len, 5);
    assert_ne!(export.address, 0);
    assert_ne!(cuda.export_table(other).unwrap().address, export.address);
    assert!(Arc::ptr_eq(
        &cuda.export_table(table).unwrap().guard,
        &export.guard
    ));

    // Freeing a guarded table releases no device memory until the guard drops; the next
    // set-up op after that does.
    cuda.trace_driver_calls();
    cuda.free_table(table).unwrap();
    let frees = |calls: &[unikv_kernels::DriverRecord]| {
        calls
            .iter()
            .filter(|r| r.call == DriverCall::DeviceFree)
            .count()
    };
    assert_eq!(frees(&cuda.take_driver_calls()), 0);
    drop(export);
    cuda.end_step().unwrap();
    assert_eq!(frees(&cuda.take_driver_calls()), 1);
    // An unguarded table is freed at once.
    cuda.free_table(other).unwrap();
    assert_eq!(frees(&cuda.take_driver_calls()), 1);
}

#[test]
fn ordering_a_readers_stream_issues_an_event_wait_and_no_host_sync() {
    let cuda = Arc::new(CudaDevice::emulated());
    let ledger = Arc::new(SyncLedger::new(cuda.clone()));
    let table = ledger.alloc_table(8, 0).unwrap();
    ledger.reset();
    cuda.stall_stream(); // the GPU is busy: a wait would hang here
    ledger.upload_table(table, 0, &[1, 2, 3]).unwrap();
    cuda.trace_driver_calls();
    let export = ledger.export_table(table).unwrap();
    // SAFETY: the emulated driver never dereferences the stream handle; 0x1 is
    // CU_STREAM_LEGACY, valid in any context.
    unsafe { ledger.make_stream_wait(0x1 as unikv_kernels::RawStream) }.unwrap();
    let calls: Vec<DriverCall> = cuda.take_driver_calls().iter().map(|r| r.call).collect();
    assert_eq!(
        calls,
        [
            DriverCall::EventCreate,
            DriverCall::EventRecord,
            DriverCall::ExternalWait,
            DriverCall::EventDestroy
        ]
    );
    assert_eq!(ledger.syncs(), 0);
    ledger.assert_no_syncs();
    let names: Vec<&str> = ledger.ops().iter().map(|r| r.op).collect();
    assert_eq!(names, ["upload_table", "make_stream_wait"]);
    cuda.resume_stream().unwrap();
    let sync = HostSync::acquire("test: check the upload landed");
    assert_eq!(
        cuda.read_table(&sync, table, 0, export.len).unwrap(),
        [1, 2, 3, 0, 0, 0, 0, 0]
    );
}

#[test]
fn a_null_device_refuses_to_export_and_orders_nothing() {
    let null = NullDevice::new();
    let table = null.alloc_table(4, 0).unwrap();
    let err = null.export_table(table).unwrap_err();
    assert!(matches!(err, Error::NotExportable { .. }), "{err}");
    assert!(err.to_string().contains("no table memory"), "{err}");
    // SAFETY: host backends never use the handle.
    unsafe { null.make_stream_wait(std::ptr::null_mut()) }.unwrap();
    let cpu = CpuDevice::new();
    assert!(matches!(
        cpu.export_table(unikv_kernels::TableId(9)),
        Err(Error::UnknownHandle { .. })
    ));
}

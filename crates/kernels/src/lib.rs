//! The device layer of unikv: a [`Device`] trait whose ops all have host-known output
//! shapes, the CPU reference backend [`CpuDevice`], the one forwarding wrapper
//! [`Intercepted`] whose [`DeviceHooks`] watch or fail each op (the recording
//! [`SyncLedger`] that counts syncs by call site and the fault-injecting
//! [`FaultInjector`] that fails chosen ops for fault sweeps are two), the bookkeeping-only
//! [`NullDevice`] that keeps no bytes, and the CUDA backend [`CudaDevice`]
//! behind the `cuda` feature (kernels in `cu/*.cu`, compiled at run time by
//! [`nvrtc`]).
//!
//! ```
//! use std::sync::Arc;
//! use unikv_kernels::{CpuDevice, Device, HostSync, Readback, Translate};
//!
//! let cpu = Arc::new(CpuDevice::new());
//! let dev: Arc<dyn Device> = cpu.clone(); // what scheduling-path code holds
//! let v2p = dev.alloc_table(4, 0).unwrap(); // the v2p mirror: page 0 is the sink
//! dev.scatter_table(v2p, &[(1, 2)]).unwrap(); // virtual page 1 -> physical page 2
//! let ids = dev.alloc_table(3, 0).unwrap();
//! dev.upload_table(ids, 0, &[4, 5, 12]).unwrap(); // page size 4: pages 1, 1, 3
//! let out = dev.alloc_table(4, -1).unwrap();
//! let args = Translate { v2p, ids, n: 3, page_size: 4, stride: 8, out, out_width: 4 };
//! dev.translate(&args).unwrap();
//! // Reading back needs a permit and the `Readback` trait, which `dyn Device` lacks.
//! let sync = HostSync::acquire("doc example");
//! // 2 × 8 + 0, 2 × 8 + 1, the sink for unbound page 3, the zero-filled tail.
//! assert_eq!(cpu.read_table(&sync, out, 0, 4).unwrap(), [16, 17, 0, 0]);
//! ```
//!
//! # An engine's stream
//! [`CudaDevice`] never uses the legacy default stream: [`CudaDevice::new`] creates a
//! non-blocking stream of its own, and [`CudaDevice::on_engine_stream`] enqueues on the
//! engine's. An engine orders its forward with unikv's work by events
//! ([`CudaDevice::record_event`] after a step's unikv ops, waited for on the engine's
//! stream; [`CudaDevice::wait_raw_event`] the other way), so the host never waits.
//!
//! The op path of [`CudaDevice`] allocates nothing, copies nothing from pageable memory
//! and never waits: argument lists go through a pinned staging ring, reused behind
//! events it only queries, and grown only at [`CudaDevice::end_step`]. Any driver call
//! that may block is counted as a [`SyncHazard`] ([`Device::sync_hazards`]), and a
//! [`SyncLedger`] around the device charges it to the op and call site that issued it.
//! [`CudaDevice::emulated`] runs the same backend over an emulated driver, so all of this
//! is tested without a GPU.
//!
//! ```no_run
//! # fn engine() -> Result<(), unikv_kernels::Error> {
//! use unikv_kernels::CudaDevice;
//! # let engine_stream: unikv_kernels::RawStream = std::ptr::null_mut();
//! // The engine's own non-blocking stream: unikv's ops are then in its stream order.
//! // SAFETY: the stream belongs to GPU 0's primary context and outlives the device.
//! let dev = unsafe { CudaDevice::on_engine_stream(0, engine_stream)? };
//! // Or a stream of unikv's own, ordered with the engine's by events:
//! let own = CudaDevice::new(0)?;
//! let after_step = own.record_event()?; // after this step's unikv ops
//! let _wait_for_it = after_step.raw(); // for cuStreamWaitEvent(engine_stream, ...)
//! # let _ = dev; Ok(()) }
//! ```
//!
//! # The host tier
//! What the GPU cannot hold (KV pages, recurrent states) a cache keeps in host-tier
//! buffers ([`Device::alloc_host`]: pinned memory on [`CudaDevice`], chunked host memory
//! on [`CpuDevice`], a length on [`NullDevice`]) and moves with stream-ordered copies
//! ([`Device::copy_device_to_host`], [`Device::copy_host_to_device`]) that never wait.
//! Whether a copy has completed (so a written-back page may be reused) is asked of an
//! event recorded after it ([`Device::record_copy_event`], [`Device::copy_event_done`]),
//! never waited for; only [`Readback::read_host`] waits.
//!
//! ```
//! use unikv_kernels::{CpuDevice, Device, HostCopy, HostSync, Readback};
//!
//! let dev = CpuDevice::new();
//! let buf = dev.alloc_bytes(64, 7).unwrap();
//! let host = dev.alloc_host(32).unwrap();
//! // Write back 16 bytes at 8, then load them back at 40.
//! dev.copy_device_to_host(buf, host, &[HostCopy { device: 8, host: 0, len: 16 }]).unwrap();
//! dev.copy_host_to_device(host, buf, &[HostCopy { device: 40, host: 0, len: 16 }]).unwrap();
//! let done = dev.record_copy_event().unwrap();
//! assert!(dev.copy_event_done(done).unwrap()); // a query, never a wait
//! dev.free_copy_event(done).unwrap();
//! let sync = HostSync::acquire("doc example");
//! assert_eq!(dev.read_host(&sync, host, 0, 17).unwrap()[15..], [7, 0]);
//! ```
//!
//! # Invariants this crate keeps
//! - Architecture invariant: no method of [`Device`] waits for the device or returns a
//!   value whose size depends on device data. Waiting ops live on [`Readback`] and need a
//!   [`HostSync`] permit; scheduling-path code holds an `Arc<dyn Device>`, so a host sync
//!   there does not compile, and [`SyncLedger`] counts any that happen elsewhere. The
//!   host-tier copies are enqueued, and their completion is only ever queried
//!   ([`Device::copy_event_done`]); the bytes of a host buffer reach the host's code
//!   only through [`Readback::read_host`].
//! - Every op checks its arguments on the host before it writes or issues anything: an
//!   op that returns an error has changed nothing.
//! - [`CpuDevice`] defines the semantics; every CUDA op has a CPU twin and a parity test
//!   (`tests/gpu_parity.rs`, on the emulated driver in every build and on a GPU when
//!   there is one), and the scalar rules both follow (translate's sink and tombstone
//!   rule, gather's out-of-range rule) are written once.
//! - Every driver call of [`CudaDevice`] goes through one function that classifies it
//!   ([`DriverCall::hazard`]), counts it and, when asked, traces it
//!   ([`CudaDevice::take_driver_calls`]); `tests/cuda_backend.rs` checks that the op path
//!   makes no call that may block, and that a ringless backend is caught by the ledger.
//! - Every `.cu` file of `cu/` is listed in [`nvrtc::KERNEL_SOURCES`] and compiled by
//!   [`nvrtc::compile_all`] (the CI check); sources include no toolkit header.
//! - Without the `cuda` feature the CUDA API exists and returns
//!   [`Error::NotCompiledWithCuda`]; with it, a machine without a driver gets
//!   [`Error::NoCudaDriver`] (and without NVRTC [`Error::NoNvrtc`]), never a panic.

mod check;
mod clock;
mod cpu;
mod cuda;
mod cuda_driver;
mod device;
mod driver;
mod emulated;
mod error;
mod export;
mod fault;
mod handles;
mod intercept;
mod ledger;
mod null;
pub mod nvrtc;

pub use clock::{thread_cpu_time, thread_cpu_time_overhead};
pub use cpu::CpuDevice;
pub use cuda::{
    CapturedGraph, CudaDevice, DEFAULT_STAGING_BYTES, DeviceEvent, DriverRecord, TimedEvent,
};
pub use device::{
    ByteSpan, BytesId, CopyEvent, Device, DeviceOp, ExportDevice, HostBytesId, HostCopy, HostSync,
    LaneTranslate, Readback, RowGather, SpanMove, TableExport, TableId, TableScatter, TableSpans,
    Translate, WindowTranslate,
};
pub use driver::{
    DriverCall, Grid, Kernel, RawEvent, RawStream, StreamKind, SyncHazard, SyncHazards,
};
pub use error::Error;
pub use export::ExportGuard;
pub use fault::{FaultHooks, FaultInjector, InjectedFault};
pub use intercept::{DeviceCall, DeviceHooks, Intercepted};
pub use ledger::{LedgerHooks, LedgerTicket, OpRecord, SyncLedger, SyncReport};
pub use null::NullDevice;

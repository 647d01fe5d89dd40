//! The driver calls the CUDA backend is written in, and what each may cost the host.
//!
//! [`CudaDevice`](crate::CudaDevice) keeps all of its logic (handles, bounds checks,
//! argument packing, the pinned staging ring) above a small [`Driver`] trait, so the
//! same code runs over the real CUDA driver (`cuda` feature) and over an emulated one
//! that executes every call on the host ([`CudaDevice::emulated`](crate::CudaDevice::emulated)).
//! Every call the backend makes is classified once, by [`DriverCall::hazard`]: the
//! calls that may block the host (allocation, free, pageable copy, synchronize,
//! anything on the legacy default stream) are *sync hazards*, counted by the device
//! ([`Device::sync_hazards`](crate::Device::sync_hazards)) and so by
//! [`SyncLedger`](crate::SyncLedger).

use crate::Error;
use std::fmt;

/// A device address (`CUdeviceptr`).
pub(crate) type DevPtr = u64;

/// A driver call that may make the host wait for the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyncHazard {
    /// A device or pinned host allocation (`cuMemAlloc`, `cuMemHostAlloc`).
    Allocation,
    /// A device or pinned host free (`cuMemFree`, `cuMemFreeHost`).
    Free,
    /// A host-to-device copy from pageable memory, which the driver stages itself.
    PageableCopy,
    /// A wait for the stream (`cuStreamSynchronize`, a device-to-host copy).
    Synchronize,
    /// Work enqueued on the legacy default stream, which serialises with every other
    /// blocking stream of the context.
    DefaultStream,
}

impl fmt::Display for SyncHazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SyncHazard::Allocation => "allocation",
            SyncHazard::Free => "free",
            SyncHazard::PageableCopy => "pageable copy",
            SyncHazard::Synchronize => "synchronize",
            SyncHazard::DefaultStream => "default stream",
        })
    }
}

/// How many sync hazards a device has issued, and the kind of the latest
/// ([`Device::sync_hazards`](crate::Device::sync_hazards)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncHazards {
    /// Hazards since the device was made.
    pub count: u64,
    /// The kind of the latest, if any.
    pub last: Option<SyncHazard>,
}

/// A raw CUDA stream handle (`CUstream`) an engine hands to
/// [`CudaDevice::on_engine_stream`](crate::CudaDevice::on_engine_stream).
pub type RawStream = *mut std::ffi::c_void;

/// A raw CUDA event handle (`CUevent`), of an engine's or of a
/// [`DeviceEvent`](crate::DeviceEvent).
pub type RawEvent = *mut std::ffi::c_void;

/// `u64` words per window in `unikv_translate_windows`' list (`cu/translate.cu`): the
/// record the backend stages and the emulated driver reads back.
pub(crate) const WINDOW_WORDS: usize = 12;
/// `u64` words per translation in `unikv_translate_lanes`' list (`cu/translate.cu`).
pub(crate) const LANE_WORDS: usize = 12;

/// The kernels of `cu/`, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `unikv_translate` (`cu/translate.cu`).
    Translate,
    /// `unikv_move_spans` (`cu/spans.cu`).
    MoveSpans,
    /// `unikv_fill_spans` (`cu/spans.cu`).
    FillSpans,
    /// `unikv_translate_many` (`cu/translate.cu`).
    TranslateMany,
    /// `unikv_scatter_tables` (`cu/tables.cu`).
    ScatterTables,
    /// `unikv_gather` (`cu/tables.cu`).
    Gather,
    /// `unikv_spin` (`cu/diag.cu`): keeps the stream busy, for no-sync proofs.
    Spin,
    /// `unikv_translate_windows` (`cu/translate.cu`).
    TranslateWindows,
    /// `unikv_gather_rows` (`cu/spans.cu`).
    GatherRows,
    /// `unikv_translate_lanes` (`cu/translate.cu`).
    TranslateLanes,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // ALL and file: the real driver's
impl Kernel {
    /// Every kernel, in the order a driver loads them.
    pub(crate) const ALL: [Kernel; 10] = [
        Kernel::Translate,
        Kernel::MoveSpans,
        Kernel::FillSpans,
        Kernel::TranslateMany,
        Kernel::ScatterTables,
        Kernel::Gather,
        Kernel::Spin,
        Kernel::TranslateWindows,
        Kernel::GatherRows,
        Kernel::TranslateLanes,
    ];

    /// The `extern "C"` name in its `.cu` file.
    pub fn symbol(self) -> &'static str {
        match self {
            Kernel::Translate => "unikv_translate",
            Kernel::MoveSpans => "unikv_move_spans",
            Kernel::FillSpans => "unikv_fill_spans",
            Kernel::TranslateMany => "unikv_translate_many",
            Kernel::ScatterTables => "unikv_scatter_tables",
            Kernel::Gather => "unikv_gather",
            Kernel::Spin => "unikv_spin",
            Kernel::TranslateWindows => "unikv_translate_windows",
            Kernel::GatherRows => "unikv_gather_rows",
            Kernel::TranslateLanes => "unikv_translate_lanes",
        }
    }

    /// The `.cu` file of `cu/` that defines it.
    pub(crate) fn file(self) -> &'static str {
        match self {
            Kernel::Translate
            | Kernel::TranslateMany
            | Kernel::TranslateWindows
            | Kernel::TranslateLanes => "translate.cu",
            Kernel::MoveSpans | Kernel::FillSpans | Kernel::GatherRows => "spans.cu",
            Kernel::ScatterTables | Kernel::Gather => "tables.cu",
            Kernel::Spin => "diag.cu",
        }
    }
}

/// One kernel argument, passed by value (a pointer is a `CUdeviceptr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arg {
    /// A device pointer or an `unsigned long long`.
    U64(u64),
    /// An `int`.
    I32(i32),
    /// An `unsigned char`.
    U8(u8),
}

/// A launch's grid and block (`x, y, z`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Blocks per dimension.
    pub blocks: (u32, u32, u32),
    /// Threads per block.
    pub threads: u32,
}

/// A pinned (page-locked) host buffer the driver made: its host address, or an id the
/// emulated driver knows it by.
#[derive(Debug)]
pub(crate) struct Pinned {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

/// An event the driver made (`CUevent`, or the emulated driver's id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EventHandle(pub(crate) usize);

/// A captured, instantiated CUDA graph (`CUgraphExec`, or the emulated driver's id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GraphHandle(pub(crate) usize);

/// Which stream a driver enqueues on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// A non-blocking stream the device created.
    Own,
    /// A stream the engine handed over.
    Engine,
    /// The legacy default stream (an engine handed over the null stream): every
    /// enqueued call is a [`SyncHazard::DefaultStream`].
    LegacyDefault,
}

/// One call the backend made to its driver, as [`CudaDevice::take_driver_calls`](crate::CudaDevice::take_driver_calls)
/// records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverCall {
    /// `cuMemAllocAsync` / `cuMemAlloc` of `bytes`.
    DeviceAlloc {
        /// Size asked for.
        bytes: u64,
    },
    /// `cuMemFreeAsync` / `cuMemFree`.
    DeviceFree,
    /// `cuMemHostAlloc` of `bytes`.
    PinnedAlloc {
        /// Size asked for.
        bytes: u64,
    },
    /// `cuMemFreeHost`.
    PinnedFree,
    /// `cuMemsetD8Async` of `bytes`.
    Memset {
        /// Bytes set.
        bytes: u64,
    },
    /// `cuMemsetD32Async` of `count` words.
    Fill32 {
        /// Words set.
        count: u64,
    },
    /// `cuMemcpyHtoDAsync` from pinned memory (truly asynchronous).
    CopyFromPinned {
        /// Bytes copied.
        bytes: u64,
    },
    /// `cuMemcpyDtoHAsync` into pinned memory (truly asynchronous: a host-tier
    /// write-back).
    CopyToPinned {
        /// Bytes copied.
        bytes: u64,
    },
    /// `cuMemcpyHtoDAsync` from pageable memory (the driver stages it and may wait).
    CopyFromPageable {
        /// Bytes copied.
        bytes: u64,
    },
    /// A device-to-host copy, then a wait for it.
    CopyToHost {
        /// Bytes copied.
        bytes: u64,
    },
    /// `cuLaunchKernel`.
    Launch {
        /// The kernel.
        kernel: Kernel,
        /// Its grid.
        grid: Grid,
    },
    /// `cuEventCreate`.
    EventCreate,
    /// `cuEventRecord`.
    EventRecord,
    /// `cuEventQuery` (never waits).
    EventQuery,
    /// `cuStreamWaitEvent` (the stream waits; the host does not).
    EventWait,
    /// `cuStreamWaitEvent` on another stream (a reader's, [`Device::make_stream_wait`](crate::Device::make_stream_wait)):
    /// that stream waits; neither the host nor the device's own stream does.
    ExternalWait,
    /// `cuEventElapsedTime` between two timed events (never waits).
    EventElapsed,
    /// `cuEventDestroy`.
    EventDestroy,
    /// `cuStreamSynchronize`.
    Synchronize,
    /// `cuStreamBeginCapture` (relaxed mode).
    CaptureBegin,
    /// `cuStreamEndCapture` and `cuGraphInstantiate`.
    CaptureEnd,
    /// `cuGraphLaunch`.
    GraphLaunch,
    /// `cuGraphExecDestroy`.
    GraphDestroy,
}

impl DriverCall {
    /// Whether this call enqueues work on the stream.
    fn enqueues(self) -> bool {
        matches!(
            self,
            DriverCall::Memset { .. }
                | DriverCall::Fill32 { .. }
                | DriverCall::CopyFromPinned { .. }
                | DriverCall::CopyToPinned { .. }
                | DriverCall::CopyFromPageable { .. }
                | DriverCall::Launch { .. }
                | DriverCall::EventRecord
                | DriverCall::EventWait
                | DriverCall::GraphLaunch
        )
    }

    /// What this call may cost the host on a stream of `stream`'s kind, or `None` when
    /// it only enqueues work (or asks a question that never waits).
    pub fn hazard(self, stream: StreamKind) -> Option<SyncHazard> {
        match self {
            DriverCall::DeviceAlloc { .. } | DriverCall::PinnedAlloc { .. } => {
                Some(SyncHazard::Allocation)
            }
            DriverCall::DeviceFree | DriverCall::PinnedFree => Some(SyncHazard::Free),
            DriverCall::CopyFromPageable { .. } => Some(SyncHazard::PageableCopy),
            DriverCall::CopyToHost { .. } | DriverCall::Synchronize => {
                Some(SyncHazard::Synchronize)
            }
            call if stream == StreamKind::LegacyDefault && call.enqueues() => {
                Some(SyncHazard::DefaultStream)
            }
            _ => None,
        }
    }
}

/// The driver operations the CUDA backend is written in. Every enqueuing call goes to
/// the driver's one stream, in call order.
///
/// Implementations only translate each call to the driver (or emulate it); bounds,
/// aliasing and handle checks are the backend's, made before any call.
pub(crate) trait Driver: Send + Sync {
    /// The stream's kind.
    fn stream_kind(&self) -> StreamKind;
    /// The raw `CUstream` (`0` for an emulated driver).
    fn raw_stream(&self) -> usize;
    /// Allocates `bytes` (> 0) of device memory, contents undefined.
    fn alloc(&self, bytes: usize) -> Result<DevPtr, Error>;
    /// Frees an allocation of [`Driver::alloc`] after the work enqueued so far.
    fn free(&self, ptr: DevPtr) -> Result<(), Error>;
    /// Allocates `bytes` (> 0) of device memory outside stream order (`cuMemAlloc`, never
    /// `cuMemAllocAsync`), contents undefined: legal while the stream captures a graph
    /// (relaxed mode), where a stream-ordered allocation would become a node of the
    /// graph. For memory a captured graph owns.
    fn alloc_unordered(&self, bytes: usize) -> Result<DevPtr, Error>;
    /// Frees an allocation of [`Driver::alloc_unordered`] (`cuMemFree`, outside stream
    /// order): the backend calls it only once no enqueued work uses `ptr`.
    fn free_unordered(&self, ptr: DevPtr) -> Result<(), Error>;
    /// Allocates `bytes` (> 0) of pinned host memory, contents undefined.
    fn alloc_pinned(&self, bytes: usize) -> Result<Pinned, Error>;
    /// Frees pinned memory no enqueued work still reads.
    fn free_pinned(&self, buf: Pinned) -> Result<(), Error>;
    /// Writes `bytes` into `buf` at `offset` (host memory: nothing is enqueued). The
    /// backend keeps the range inside `buf` and unread by in-flight copies.
    fn write_pinned(&self, buf: &Pinned, offset: usize, bytes: &[u8]);
    /// Enqueues setting `bytes` bytes at `dst` to `value`.
    fn memset(&self, dst: DevPtr, value: u8, bytes: usize) -> Result<(), Error>;
    /// Enqueues setting `count` 32-bit words at `dst` to `value`.
    fn fill32(&self, dst: DevPtr, value: u32, count: usize) -> Result<(), Error>;
    /// Enqueues copying `len` bytes of `buf` from `offset` to `dst`.
    fn copy_from_pinned(
        &self,
        dst: DevPtr,
        buf: &Pinned,
        offset: usize,
        len: usize,
    ) -> Result<(), Error>;
    /// Enqueues copying `len` bytes at `src` into `buf` at `offset` (a host-tier
    /// write-back). The backend keeps the range inside `buf`, and `buf` alive and unread
    /// by the host until the copy is done.
    fn copy_to_pinned(
        &self,
        buf: &Pinned,
        offset: usize,
        src: DevPtr,
        len: usize,
    ) -> Result<(), Error>;
    /// Copies `out.len()` bytes of `buf` from `offset` into `out` (host memory: nothing
    /// is enqueued and nothing waited for). The backend keeps the range inside `buf` and
    /// waits for the copies into it first.
    fn read_pinned(&self, buf: &Pinned, offset: usize, out: &mut [u8]);
    /// Copies `src` (pageable host memory) to `dst`; the slice may be reused on return.
    fn copy_from_pageable(&self, dst: DevPtr, src: &[u8]) -> Result<(), Error>;
    /// Waits for the stream, then copies `out.len()` bytes from `src`.
    fn copy_to_host(&self, src: DevPtr, out: &mut [u8]) -> Result<(), Error>;
    /// Enqueues `kernel` over `grid` with `args`, in the kernel's parameter order.
    fn launch(&self, kernel: Kernel, grid: Grid, args: &[Arg]) -> Result<(), Error>;
    /// Makes an event (without timing: a fence).
    fn event_create(&self) -> Result<EventHandle, Error>;
    /// Makes an event that keeps the time its work completed, for [`Driver::event_elapsed`].
    fn event_create_timed(&self) -> Result<EventHandle, Error>;
    /// Milliseconds from timed event `start`'s completion to `end`'s
    /// (`cuEventElapsedTime`); both must be done. Never waits.
    fn event_elapsed(&self, start: EventHandle, end: EventHandle) -> Result<f32, Error>;
    /// Enqueues recording `event` (it completes when the work before it has).
    fn event_record(&self, event: EventHandle) -> Result<(), Error>;
    /// Whether `event`'s recorded work is done, without waiting.
    fn event_done(&self, event: EventHandle) -> Result<bool, Error>;
    /// Makes the stream wait for `event` (of any stream of the context).
    fn event_wait(&self, event: EventHandle) -> Result<(), Error>;
    /// Makes another stream of the context (`CUstream`, or `0x1`/`0x2` for the legacy and
    /// per-thread default streams) wait for `event`; the caller vouches for `stream`.
    fn stream_wait_event(&self, stream: usize, event: EventHandle) -> Result<(), Error>;
    /// The GPU's ordinal, or `None` for an emulated driver (whose addresses name
    /// emulated memory).
    fn ordinal(&self) -> Option<usize>;
    /// Destroys an event (its pending work, if any, still completes).
    fn event_destroy(&self, event: EventHandle) -> Result<(), Error>;
    /// Waits for every call enqueued so far.
    fn synchronize(&self) -> Result<(), Error>;
    /// Starts capturing the stream's work into a graph instead of running it.
    fn capture_begin(&self) -> Result<(), Error>;
    /// Ends the capture and instantiates the graph.
    fn capture_end(&self) -> Result<GraphHandle, Error>;
    /// Enqueues one run of a captured graph.
    fn graph_launch(&self, graph: GraphHandle) -> Result<(), Error>;
    /// Destroys a captured graph (runs already enqueued still complete).
    fn graph_destroy(&self, graph: GraphHandle) -> Result<(), Error>;
    /// The GPU's peak memory bandwidth in bytes per second, if known.
    fn peak_bandwidth(&self) -> Option<f64>;
}

//! `CudaDevice`: the CUDA backend, written over the [`Driver`] calls of `driver.rs`.
//!
//! With the `cuda` feature, [`CudaDevice::new`] opens a GPU through cudarc (kernels
//! compiled at run time by NVRTC). In every build, [`CudaDevice::emulated`] runs the same
//! backend over an emulated driver, so all of its logic is tested on the CPU. Without
//! the feature, [`CudaDevice::new`] returns [`Error::NotCompiledWithCuda`] (candle's
//! dummy-backend pattern), so no other crate needs a `cfg`.
//!
//! # The op path
//! Every op of [`Device`] checks its arguments on the host, then enqueues on the one
//! stream, in call order, and returns. Argument lists (scatter pairs, span and move
//! lists, uploaded values) go through a **pinned staging ring**: written into pinned host
//! memory, copied asynchronously to a persistent device scratch buffer (or straight into
//! the table), and fenced by an event. A region of the ring is reused only once its
//! event reports done (`cuEventQuery`, which never waits). So the op path allocates
//! nothing, copies nothing from pageable memory and never waits.
//!
//! When the ring has no room (the GPU is far behind, or one list is larger than the ring)
//! the op still succeeds, through a temporary device allocation and a pageable copy: each
//! of those calls is a [`SyncHazard`], counted by [`Device::sync_hazards`] and so by a
//! [`SyncLedger`](crate::SyncLedger) wrapped around the device. The ring grows at the next
//! step boundary ([`CudaDevice::end_step`]), never on the op path.
//!
//! # The host tier
//! A host-tier buffer ([`Device::alloc_host`]) is pinned memory, so its copies
//! (`cuMemcpyDtoHAsync`, `cuMemcpyHtoDAsync`) are truly asynchronous, one driver call per
//! run of adjacent copies, on the device's stream. Each buffer owns a fence event,
//! recorded again after every call that copies into or out of it: a buffer freed while
//! its fence is pending is kept until the fence reports done (queried at later set-up
//! calls and at [`CudaDevice::end_step`]), so the release never waits and no copy touches
//! freed memory. [`Readback::read_host`] synchronises, then reads the pinned bytes.
//!
//! This file holds the device, its public surface, the one place driver calls are made
//! and the [`Device`] and [`Readback`] implementations; `staging` is the ring's
//! mechanics, `graphs` the argument lists a captured graph owns, `fused_writes` the
//! one-launch table writes that keep each entry's last write, `host_tier` the host-tier
//! buffers, copies and events.

mod fused_writes;
mod graphs;
mod host_tier;
mod staging;

use fused_writes::LastWins;
use graphs::{FencedLists, GraphList, SharedOrphans};
pub use staging::DEFAULT_STAGING_BYTES;
use staging::{FENCES, ListKind, Ring, STAGE_ALIGN};

use crate::check;
use crate::driver::{
    Arg, DevPtr, Driver, DriverCall, EventHandle, GraphHandle, Grid, Kernel, LANE_WORDS, RawEvent,
    RawStream, StreamKind, SyncHazard, SyncHazards, WINDOW_WORDS,
};
use crate::emulated::{EmulatedDriver, SpinClock};
use crate::export::Exports;
use crate::handles::Handles;
use crate::{
    ByteSpan, BytesId, CopyEvent, Device, Error, ExportDevice, HostBytesId, HostCopy, HostSync,
    LaneTranslate, Readback, RowGather, SpanMove, TableExport, TableId, TableScatter, TableSpans,
    Translate, WindowTranslate,
};
use host_tier::HostBuffer;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// Threads per block of every launch.
pub(crate) const BLOCK: u32 = 256;
/// Most blocks of one grid dimension; the kernels use grid-stride loops, so any size works.
const MAX_BLOCKS: u64 = 65_535;
/// Bytes of a span one block handles at a time (`UNIKV_CHUNK` of `cu/spans.cu`: 16
/// 16-byte words per thread).
const CHUNK: u64 = 16 * 16 * BLOCK as u64;

/// A launch of `items` independent items, one thread each (grid-stride).
fn per_item(items: u64) -> Grid {
    Grid {
        blocks: (
            items.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        threads: BLOCK,
    }
}

/// A launch over `spans` spans of at most `max_len` bytes (`cu/spans.cu`): a row of
/// blocks per span (y) and a block per chunk of the longest (x), both grid-stride.
fn per_span(spans: u64, max_len: u64) -> Grid {
    Grid {
        // Both <= MAX_BLOCKS, so they fit in u32 (and y in the 65,535 limit).
        blocks: (
            max_len.div_ceil(CHUNK).clamp(1, MAX_BLOCKS) as u32,
            spans.clamp(1, MAX_BLOCKS) as u32,
            1,
        ),
        threads: BLOCK,
    }
}

/// One driver call the backend made, with the device op that made it
/// ([`CudaDevice::take_driver_calls`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverRecord {
    /// The device op (`scatter_table`, `alloc_bytes`, `end_step`, ...).
    pub op: &'static str,
    /// The call.
    pub call: DriverCall,
    /// What it may cost the host, if anything.
    pub hazard: Option<SyncHazard>,
}

/// A device allocation: its address and its length in elements.
#[derive(Debug)]
struct Alloc {
    ptr: DevPtr,
    len: usize,
}

#[derive(Debug)]
struct State {
    bytes: Handles<Alloc>,
    tables: Handles<Alloc>,
    /// Host-tier buffers.
    hosts: Handles<HostBuffer>,
    /// Host-tier buffers freed while a copy may still use them: released once their
    /// fence is done.
    retired_hosts: Vec<HostBuffer>,
    /// Events of [`Device::record_copy_event`].
    copy_events: Handles<EventHandle>,
    /// Exported tables, and freed ones whose memory is kept for a live export.
    exports: Exports<DevPtr>,
    ring: Ring,
    /// Rings replaced by a larger one, freed once their fences are done.
    retired: Vec<Ring>,
    /// Events not in use as fences.
    spare: Vec<EventHandle>,
    /// Set when an op found no room in the ring; the next step boundary grows it.
    overflowed: bool,
    /// The largest list staged (or refused) since the last step boundary.
    largest: usize,
    /// Set while [`CudaDevice::capture`] records a graph.
    capturing: bool,
    /// The lists staged for the graph being captured (its own, from its capture on).
    graph_lists: Vec<GraphList>,
    /// Lists of dropped graphs behind the fence recorded after their last replay.
    fenced_lists: Vec<FencedLists>,
    /// Reused host buffers: the packed list of an op, the entries a table write kept.
    pack: Vec<u8>,
    seen: LastWins,
}

#[derive(Debug, Default)]
struct CallLog {
    hazards: SyncHazards,
    trace: Option<Vec<DriverRecord>>,
}

/// The CUDA backend: buffers and tables in GPU memory, every op one launch (or one copy)
/// on a single stream, in call order. Argument lists go through a pinned staging ring,
/// reused behind events it only queries and grown only at [`CudaDevice::end_step`]; an op
/// that finds no room falls back to an allocation and a pageable copy, each counted by
/// [`Device::sync_hazards`].
pub struct CudaDevice {
    name: String,
    driver: Arc<dyn Driver>,
    emulated: Option<Arc<EmulatedDriver>>,
    state: Mutex<State>,
    log: Mutex<CallLog>,
    /// Lists of dropped graphs, handed over by their drop for the next step boundary.
    orphans: Arc<SharedOrphans>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// An event recorded on a [`CudaDevice`]'s stream ([`CudaDevice::record_event`]); its
/// handle is destroyed when this drops.
pub struct DeviceEvent {
    handle: EventHandle,
    driver: Arc<dyn Driver>,
}

impl fmt::Debug for DeviceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DeviceEvent").finish()
    }
}

impl DeviceEvent {
    /// The raw handle, for the engine's `cuStreamWaitEvent`; valid while this lives.
    pub fn raw(&self) -> RawEvent {
        self.handle.0 as RawEvent
    }

    /// Whether the work before the event is done (`cuEventQuery`: never waits).
    pub fn is_done(&self) -> Result<bool, Error> {
        self.driver.event_done(self.handle)
    }
}

/// Whether an event keeps the time it completed (`cuEventCreate` without
/// `CU_EVENT_DISABLE_TIMING`), which costs a fence a little.
#[derive(Clone, Copy, Debug)]
enum EventTiming {
    /// A fence: done or not.
    Fence,
    /// A [`TimedEvent`].
    Timed,
}

/// An event recorded with a timestamp on a [`CudaDevice`]'s stream
/// ([`CudaDevice::record_timed_event`]): the time between two is GPU time between two
/// points of the stream (an engine's forward, the gap between two forwards).
#[derive(Debug)]
pub struct TimedEvent(DeviceEvent);

impl TimedEvent {
    /// Whether the stream has reached the event (`cuEventQuery`: never waits).
    pub fn is_done(&self) -> Result<bool, Error> {
        self.0.is_done()
    }

    /// The GPU time from `earlier` to this event (`cuEventElapsedTime`, about half a
    /// microsecond of resolution; zero when this one came first). Never waits.
    ///
    /// Errors: [`Error::Cuda`] when either is not done yet ([`TimedEvent::is_done`]), or
    /// the two are of different devices.
    pub fn elapsed_since(&self, earlier: &TimedEvent) -> Result<Duration, Error> {
        let ms = self
            .0
            .driver
            .event_elapsed(earlier.0.handle, self.0.handle)?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }
}

/// A CUDA graph captured from a [`CudaDevice`]'s ops ([`CudaDevice::capture`]), replayed
/// with [`CudaDevice::launch_graph`]; destroyed when this drops. It owns the argument
/// lists of the fused translations it captured (pinned memory and a device buffer each,
/// read at every replay): once it drops, the device's next step boundary
/// ([`CudaDevice::end_step`]) fences them behind the replays already enqueued and frees
/// them when the fence is done.
pub struct CapturedGraph {
    handle: GraphHandle,
    driver: Arc<dyn Driver>,
    lists: Vec<GraphList>,
    orphans: Arc<SharedOrphans>,
}

impl fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CapturedGraph").finish()
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        // Runs already enqueued still complete; a failure only leaks the graph.
        let _ = self.driver.graph_destroy(self.handle);
        // Those runs still read the lists: the device frees them behind a fence.
        let lists = std::mem::take(&mut self.lists);
        if !lists.is_empty() {
            self.orphans.adopt(lists, &*self.driver);
        }
    }
}

impl Drop for DeviceEvent {
    fn drop(&mut self) {
        // Destroying a pending event is allowed (its work still completes); a failure
        // only leaks one event handle.
        let _ = self.driver.event_destroy(self.handle);
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` on a non-blocking stream of its own and compiles every
    /// kernel for its architecture.
    ///
    /// Errors: [`Error::NotCompiledWithCuda`] in a build without the `cuda` feature,
    /// [`Error::NoCudaDriver`] (no libcuda), [`Error::NoCudaDevice`] (no such GPU),
    /// [`Error::NoNvrtc`] (no libnvrtc), [`Error::KernelCompile`], [`Error::Cuda`] for
    /// other driver failures (e.g. a PTX too new for the driver).
    pub fn new(ordinal: usize) -> Result<CudaDevice, Error> {
        let driver = crate::cuda_driver::open(ordinal)?;
        CudaDevice::with_driver(format!("cuda:{ordinal}"), driver, None)
    }

    /// Opens GPU `ordinal` on the engine's `stream`: every op is enqueued there, in
    /// call order with the engine's own work, and none waits for the GPU. Errors as
    /// [`CudaDevice::new`]. Handing over the null stream (the legacy default stream)
    /// works, but every enqueued call is then a [`SyncHazard::DefaultStream`].
    ///
    /// # Safety
    /// `stream` is a valid stream of GPU `ordinal`'s primary context (the one the
    /// CUDA runtime uses), and it outlives the device and everything it issued: the
    /// device never destroys it.
    pub unsafe fn on_engine_stream(ordinal: usize, stream: RawStream) -> Result<CudaDevice, Error> {
        // SAFETY: forwarded contract: `stream` is of this context and outlives the device.
        let driver = unsafe { crate::cuda_driver::open_on(ordinal, stream) }?;
        CudaDevice::with_driver(format!("cuda:{ordinal}"), driver, None)
    }

    /// The CUDA backend over an emulated driver on the host: device memory, pinned
    /// memory, one stream and its events, kernels run by their CPU twins. Every op
    /// behaves as on a GPU, the driver calls it makes are the ones a GPU would get
    /// ([`CudaDevice::take_driver_calls`]), and the stream can be stalled
    /// ([`CudaDevice::stall_stream`]) as if the GPU were busy. For tests of the
    /// backend's own logic without a GPU.
    pub fn emulated() -> CudaDevice {
        CudaDevice::emulated_on(StreamKind::Own)
    }

    /// [`CudaDevice::emulated`] on a stream of the given kind
    /// ([`StreamKind::LegacyDefault`] makes every enqueue a sync hazard).
    pub fn emulated_on(stream: StreamKind) -> CudaDevice {
        CudaDevice::emulated_with(stream, SpinClock::UntilResumed)
    }

    /// [`CudaDevice::emulated`] with a clock: a spin of `cycles`
    /// ([`CudaDevice::launch_spin`]) keeps the stream busy for `cycles` nanoseconds of host
    /// time and then the stream goes on by itself; a host wait (a read-back,
    /// [`Readback::synchronize`]) sleeps until it ends; timed events keep the host time
    /// the stream reached them. Other kernels take no time. For timing loops without a
    /// GPU (the overlap benchmark's CI run); the no-sync proofs use the unclocked one.
    pub fn emulated_clocked() -> CudaDevice {
        CudaDevice::emulated_with(StreamKind::Own, SpinClock::Nanoseconds)
    }

    fn emulated_with(stream: StreamKind, clock: SpinClock) -> CudaDevice {
        let emulated = Arc::new(EmulatedDriver::new(stream, clock));
        let driver: Arc<dyn Driver> = emulated.clone();
        let name = match stream {
            StreamKind::LegacyDefault => "emulated-cuda(default stream)",
            StreamKind::Own | StreamKind::Engine => "emulated-cuda",
        };
        match CudaDevice::with_driver(name.to_string(), driver.clone(), Some(emulated.clone())) {
            Ok(dev) => dev,
            // The emulated driver refuses nothing at boot but an allocation the host
            // cannot make; boot again without a ring rather than fail.
            Err(_) => CudaDevice::unstaged(name.to_string(), driver, Some(emulated)),
        }
    }

    fn unstaged(
        name: String,
        driver: Arc<dyn Driver>,
        emulated: Option<Arc<EmulatedDriver>>,
    ) -> CudaDevice {
        CudaDevice {
            name,
            driver,
            emulated,
            state: Mutex::new(State {
                bytes: Handles::new("bytes", "cuda"),
                tables: Handles::new("table", "cuda"),
                hosts: Handles::new("host bytes", "cuda"),
                retired_hosts: Vec::new(),
                copy_events: Handles::new("copy event", "cuda"),
                exports: Exports::default(),
                ring: Ring::empty(),
                retired: Vec::new(),
                spare: Vec::new(),
                overflowed: false,
                largest: 0,
                capturing: false,
                graph_lists: Vec::new(),
                fenced_lists: Vec::new(),
                pack: Vec::new(),
                seen: LastWins::default(),
            }),
            log: Mutex::new(CallLog::default()),
            orphans: Arc::default(),
        }
    }

    fn with_driver(
        name: String,
        driver: Arc<dyn Driver>,
        emulated: Option<Arc<EmulatedDriver>>,
    ) -> Result<CudaDevice, Error> {
        let dev = CudaDevice::unstaged(name, driver, emulated);
        {
            let mut st = dev.state();
            for _ in 0..FENCES {
                let event = dev.issue("boot", DriverCall::EventCreate, |d| d.event_create())?;
                st.spare.push(event);
            }
            st.ring = dev.make_ring("boot", DEFAULT_STAGING_BYTES)?;
        }
        Ok(dev)
    }

    /// Replaces the staging ring by one of `bytes` (set-up; `0` leaves no ring, so every
    /// op takes the hazardous fallback: the deliberately blocking variant the no-sync
    /// tests must catch). The ring still grows at step boundaries after an overflow.
    ///
    /// Errors: [`Error::OutOfMemory`] when the pinned or device memory cannot be had (the
    /// old ring is then kept).
    pub fn with_staging(self, bytes: usize) -> Result<CudaDevice, Error> {
        {
            let mut st = self.state();
            let ring = self.make_ring("with_staging", bytes)?;
            let old = std::mem::replace(&mut st.ring, ring);
            st.retired.push(old);
            self.free_retired(&mut st, "with_staging")?;
        }
        Ok(self)
    }

    /// How many GPUs the driver sees (`0` when it has none).
    ///
    /// Errors: [`Error::NotCompiledWithCuda`] without the `cuda` feature,
    /// [`Error::NoCudaDriver`] when libcuda cannot be loaded.
    pub fn device_count() -> Result<usize, Error> {
        crate::cuda_driver::device_count()
    }

    /// The CUDA version the driver supports, as `(major, minor)`.
    ///
    /// Errors: as [`CudaDevice::device_count`].
    pub fn driver_version() -> Result<(i32, i32), Error> {
        crate::cuda_driver::driver_version()
    }

    /// The stream every op is enqueued on (for the engine's `cuStreamWaitEvent`, graph
    /// capture and the like); the device keeps owning it. Null on an emulated device.
    pub fn stream(&self) -> RawStream {
        self.driver.raw_stream() as RawStream
    }

    /// Records the work enqueued so far (a step's unikv ops): an engine makes its
    /// stream wait for the event before its forward reads what they wrote. Issues
    /// without waiting; it is also a step boundary ([`CudaDevice::end_step`]).
    pub fn record_event(&self) -> Result<DeviceEvent, Error> {
        self.end_step()?;
        self.make_event("record_event", EventTiming::Fence)
    }

    /// Makes an event and records it after the work enqueued so far, without waiting.
    fn make_event(&self, op: &'static str, timing: EventTiming) -> Result<DeviceEvent, Error> {
        let handle = self.issue(op, DriverCall::EventCreate, |d| match timing {
            EventTiming::Fence => d.event_create(),
            EventTiming::Timed => d.event_create_timed(),
        })?;
        let event = DeviceEvent {
            handle,
            driver: self.driver.clone(),
        };
        self.issue(op, DriverCall::EventRecord, |d| d.event_record(handle))?;
        Ok(event)
    }

    /// Makes every op enqueued from now on wait for `event` (the engine's, recorded
    /// after the work unikv must follow), without the host waiting.
    ///
    /// # Safety
    /// `event` is a valid event of this GPU's context, recorded (or never recorded:
    /// then nothing is waited for), and alive until this call returns.
    pub unsafe fn wait_raw_event(&self, event: RawEvent) -> Result<(), Error> {
        let handle = EventHandle(event as usize);
        self.issue("wait_raw_event", DriverCall::EventWait, |d| {
            d.event_wait(handle)
        })
    }

    /// The step boundary, between one step's ops and the next's (an engine calls it, or
    /// [`CudaDevice::record_event`], once per step): frees rings an earlier growth
    /// retired, and host-tier buffers freed while copies used them, once the stream is
    /// past them, and, when an op of the step found no room
    /// in the staging ring, grows it to twice its size (or more, to fit the largest
    /// list). The only place the ring grows; its allocations are sync hazards of
    /// `end_step`, outside every op.
    ///
    /// Errors: [`Error::OutOfMemory`] when the larger ring cannot be had; the old one is
    /// kept and the step's ops still succeed through the fallback.
    pub fn end_step(&self) -> Result<(), Error> {
        let mut st = self.state();
        self.free_retired(&mut st, "end_step")?;
        self.reap_exports(&mut st, "end_step")?;
        self.release_retired_hosts(&mut st, "end_step")?;
        self.release_graph_lists(&mut st, "end_step")?;
        let State { ring, spare, .. } = &mut *st;
        self.retire(ring, spare, "end_step", u64::MAX)?; // done fences back to spare
        if st.spare.is_empty() {
            for _ in 0..FENCES {
                let event =
                    self.issue("end_step", DriverCall::EventCreate, |d| d.event_create())?;
                st.spare.push(event);
            }
        }
        // Lists staged without an event of their own (the step ran out of them).
        self.fence_head(&mut st, "end_step")?;
        if st.overflowed {
            let want = (2 * st.ring.cap)
                .max(2 * st.largest.next_multiple_of(STAGE_ALIGN))
                .max(DEFAULT_STAGING_BYTES);
            let ring = self.make_ring("end_step", want)?;
            let old = std::mem::replace(&mut st.ring, ring);
            st.retired.push(old);
            st.overflowed = false;
            st.largest = 0;
        }
        Ok(())
    }

    /// Captures the ops `record` issues into a CUDA graph instead of running them, for
    /// [`CudaDevice::launch_graph`] to replay (an engine capturing its forward captures
    /// the step's translation with it). A replay reads every table as it is when the
    /// replay runs: the engine writes a step's inputs eagerly (scatters, uploads), then
    /// replays.
    ///
    /// Capturable: `translate`, `gather_table` and `gather_rows` (their arguments are
    /// passed by value), and the fused translations `translate_many`,
    /// `translate_windows` and `translate_lanes`, whose argument list names tables and
    /// shapes only: captured, it is staged into pinned memory and a device buffer the
    /// graph owns for its life (not the shared staging ring, which later ops
    /// overwrite), so every replay launches with the lanes, starts and ids the tables
    /// hold at that time (`a_captured_lane_translation_replays_with_the_tables_of_each_launch`).
    /// Those lists are allocated here (set-up work: sync hazards of the capture) and
    /// freed behind a fence after the graph drops
    /// (`a_dropped_graph_frees_its_lists_once_the_stream_is_past_its_replays`).
    /// Refused with [`Error::NotCapturable`], issuing nothing: the ops whose list is
    /// per-step data (scatter, upload, copy of table spans, fill, move), host-tier
    /// copies and copy events. Those are a step's eager inputs.
    ///
    /// `record` may return any error a kernels [`Error`] converts into (the facade's
    /// included), so a closure can call the cache.
    ///
    /// Errors: what `record` returns (the capture is ended either way, and the lists it
    /// staged are freed at the next step boundary, as a dropped graph's), or the
    /// driver's.
    pub fn capture<E: From<Error>>(
        &self,
        record: impl FnOnce(&CudaDevice) -> Result<(), E>,
    ) -> Result<CapturedGraph, E> {
        self.issue("capture", DriverCall::CaptureBegin, |d| d.capture_begin())?;
        self.state().capturing = true;
        let recorded = record(self);
        let lists = {
            let mut st = self.state();
            st.capturing = false;
            std::mem::take(&mut st.graph_lists)
        };
        let handle = match self.issue("capture", DriverCall::CaptureEnd, |d| d.capture_end()) {
            Ok(handle) => handle,
            Err(e) => {
                // No graph: nothing that reads the lists will ever run.
                for list in lists {
                    let _ = self.free_graph_list("capture", list);
                }
                return Err(e.into());
            }
        };
        let graph = CapturedGraph {
            handle,
            driver: self.driver.clone(),
            lists,
            orphans: self.orphans.clone(),
        };
        recorded.map(|()| graph)
    }

    /// Enqueues one replay of `graph` (captured from this device), without waiting.
    pub fn launch_graph(&self, graph: &CapturedGraph) -> Result<(), Error> {
        self.issue("launch_graph", DriverCall::GraphLaunch, |d| {
            d.graph_launch(graph.handle)
        })
    }

    /// Enqueues a kernel that keeps the stream busy for about `cycles` GPU clock cycles
    /// and returns an event recorded after it: while [`DeviceEvent::is_done`] is false,
    /// nothing enqueued after it has run, so a host call that returns meanwhile did not
    /// wait for the stream (the no-sync proof). On an emulated device the spin lasts
    /// until [`CudaDevice::resume_stream`] or a read-back.
    pub fn enqueue_spin(&self, cycles: u64) -> Result<DeviceEvent, Error> {
        self.launch_spin(cycles)?;
        self.make_event("enqueue_spin", EventTiming::Fence)
    }

    /// Enqueues a kernel that keeps the stream busy for about `cycles` GPU clock cycles
    /// (one thread polling the SM clock): a stand-in for an engine's forward, of a
    /// duration calibrated with [`TimedEvent`]s. Never waits.
    pub fn launch_spin(&self, cycles: u64) -> Result<(), Error> {
        let grid = Grid {
            blocks: (1, 1, 1),
            threads: 1,
        };
        self.launch("launch_spin", Kernel::Spin, grid, &[Arg::U64(cycles)])
    }

    /// Records a [`TimedEvent`] after the work enqueued so far, without waiting (unlike
    /// [`CudaDevice::record_event`], not a step boundary).
    pub fn record_timed_event(&self) -> Result<TimedEvent, Error> {
        self.make_event("record_timed_event", EventTiming::Timed)
            .map(TimedEvent)
    }

    /// The GPU's peak memory bandwidth in bytes per second (memory clock × bus width ×
    /// 2), or `None` on an emulated device.
    pub fn peak_bandwidth(&self) -> Option<f64> {
        self.driver.peak_bandwidth()
    }

    /// The staging ring's capacity in bytes.
    pub fn staging_capacity(&self) -> usize {
        self.state().ring.cap
    }

    /// Starts keeping every driver call the backend makes (off by default).
    pub fn trace_driver_calls(&self) {
        self.log().trace.get_or_insert_with(Vec::new);
    }

    /// The driver calls made since [`CudaDevice::trace_driver_calls`] or the last take,
    /// in call order; tracing stays on.
    pub fn take_driver_calls(&self) -> Vec<DriverRecord> {
        self.log()
            .trace
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Emulated devices only: stalls the stream as if the GPU were busy with a long
    /// kernel; enqueued work waits until [`CudaDevice::resume_stream`] or a read-back.
    /// Returns `false` (and does nothing) on a real GPU.
    pub fn stall_stream(&self) -> bool {
        self.emulated.as_ref().map(|e| e.stall()).is_some()
    }

    /// Emulated devices only: `len` bytes of the host-tier buffer `host` from `offset` as
    /// they are now, without waiting for the stream (a copy still queued behind a stall
    /// has not written them yet): what a test of "not done until its event is" reads.
    /// `Ok(None)` on a real GPU, where reading pinned memory a copy may be writing is a
    /// race: query an event first, then [`Readback::read_host`].
    ///
    /// Errors: [`Error::UnknownHandle`], [`Error::OutOfBounds`].
    pub fn peek_host(
        &self,
        host: HostBytesId,
        offset: u64,
        len: u64,
    ) -> Result<Option<Vec<u8>>, Error> {
        let st = self.state();
        let h = st.hosts.get(host.0)?;
        check::host_range("peek_host", host, offset, len, h.len)?;
        let Some(emulated) = &self.emulated else {
            return Ok(None);
        };
        let mut out = vec![0; len as usize];
        emulated.read_pinned(&h.pinned, offset as usize, &mut out);
        Ok(Some(out))
    }

    /// Emulated devices only: resumes a stalled stream and runs what it queued.
    pub fn resume_stream(&self) -> Result<(), Error> {
        match &self.emulated {
            Some(e) => e.resume(),
            None => Ok(()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every op validates its arguments before it changes the handle tables or the
        // ring, and each update is a single assignment or push; a panic elsewhere
        // cannot leave them torn, so a poisoned lock still guards usable state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn log(&self) -> MutexGuard<'_, CallLog> {
        // A record is pushed whole.
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes one driver call: the one place calls are classified, counted and traced.
    fn issue<T>(
        &self,
        op: &'static str,
        call: DriverCall,
        f: impl FnOnce(&dyn Driver) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let hazard = call.hazard(self.driver.stream_kind());
        {
            let mut log = self.log();
            if let Some(h) = hazard {
                log.hazards.count += 1;
                log.hazards.last = Some(h);
            }
            if let Some(trace) = &mut log.trace {
                trace.push(DriverRecord { op, call, hazard });
            }
        }
        f(&*self.driver)
    }

    fn launch(
        &self,
        op: &'static str,
        kernel: Kernel,
        grid: Grid,
        args: &[Arg],
    ) -> Result<(), Error> {
        self.issue(op, DriverCall::Launch { kernel, grid }, |d| {
            d.launch(kernel, grid, args)
        })
    }

    /// Launches `kernel(list, count)` over the staged list of `count` entries: a row of
    /// blocks (y) per entry, enough blocks along x for the widest entry's `widest` items.
    /// The list is a descriptor (tables and shapes), so a graph may capture it.
    fn launch_list_rows(
        &self,
        st: &mut State,
        op: &'static str,
        kernel: Kernel,
        count: u64,
        widest: u64,
    ) -> Result<(), Error> {
        let grid = Grid {
            blocks: (
                widest.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32,
                count.clamp(1, MAX_BLOCKS) as u32,
                1,
            ),
            threads: BLOCK,
        };
        self.launch_with_list(st, op, ListKind::Descriptor, kernel, grid, |list| {
            vec![Arg::U64(list), Arg::U64(count)]
        })
    }

    /// Frees the memory of freed tables whose last export guard is gone.
    fn reap_exports(&self, st: &mut State, op: &'static str) -> Result<(), Error> {
        for ptr in st.exports.reap() {
            self.issue(op, DriverCall::DeviceFree, |d| d.free(ptr))?;
        }
        Ok(())
    }

    /// Waits for the stream and copies `len` `T`-sized elements from `src`.
    fn read<T: Copy>(
        &self,
        op: &'static str,
        src: DevPtr,
        len: usize,
        decode: impl Fn(&[u8]) -> T,
    ) -> Result<Vec<T>, Error> {
        let size = size_of::<T>();
        let mut raw = vec![0u8; len * size];
        self.issue(
            op,
            DriverCall::CopyToHost {
                bytes: raw.len() as u64,
            },
            |d| d.copy_to_host(src, &mut raw),
        )?;
        Ok(raw.chunks_exact(size).map(decode).collect())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Tear-down: a failure here only leaks memory of a device going away.
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let _ = self.driver.synchronize();
        for alloc in st.bytes.drain().chain(st.tables.drain()) {
            let _ = self.driver.free(alloc.ptr);
        }
        for ptr in st.exports.drain() {
            let _ = self.driver.free(ptr);
        }
        // The stream is idle (synchronised above): no copy uses a host buffer any more.
        for host in st.hosts.drain().chain(st.retired_hosts.drain(..)) {
            let _ = self.driver.event_destroy(host.fence);
            let _ = self.driver.free_pinned(host.pinned);
        }
        for event in st.copy_events.drain() {
            let _ = self.driver.event_destroy(event);
        }
        let rings = st
            .retired
            .drain(..)
            .chain([std::mem::replace(&mut st.ring, Ring::empty())]);
        for ring in rings {
            for (_, event) in ring.fences {
                let _ = self.driver.event_destroy(event);
            }
            if let Some(host) = ring.host {
                let _ = self.driver.free(ring.dev);
                let _ = self.driver.free_pinned(host);
            }
        }
        CudaDevice::drop_graph_lists(st, &self.orphans, &*self.driver);
        for event in st.spare.drain(..) {
            let _ = self.driver.event_destroy(event);
        }
        let _ = self.driver.synchronize();
    }
}

/// Appends `values` to `pack` as little-endian bytes (the GPU's byte order).
fn pack_u64s(pack: &mut Vec<u8>, values: impl IntoIterator<Item = u64>) {
    for v in values {
        pack.extend_from_slice(&v.to_le_bytes());
    }
}

fn decode_i32(b: &[u8]) -> i32 {
    i32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn sync_hazards(&self) -> SyncHazards {
        self.log().hazards
    }

    fn alloc_bytes(&self, len: u64, fill: u8) -> Result<BytesId, Error> {
        let n = usize::try_from(len).map_err(|_| Error::OutOfMemory {
            device: self.name(),
            bytes: len,
        })?;
        let mut st = self.state();
        st.bytes.next()?;
        let size = n.max(1); // CUDA refuses empty allocations
        let ptr = self.issue(
            "alloc_bytes",
            DriverCall::DeviceAlloc { bytes: size as u64 },
            |d| d.alloc(size),
        )?;
        if let Err(e) = self.issue(
            "alloc_bytes",
            DriverCall::Memset { bytes: size as u64 },
            |d| d.memset(ptr, fill, size),
        ) {
            let _ = self.issue("alloc_bytes", DriverCall::DeviceFree, |d| d.free(ptr));
            return Err(e);
        }
        Ok(BytesId(st.bytes.push(Alloc { ptr, len: n })))
    }

    fn alloc_table(&self, len: usize, fill: i32) -> Result<TableId, Error> {
        let mut st = self.state();
        st.tables.next()?;
        self.reap_exports(&mut st, "alloc_table")?;
        let count = len.max(1);
        let bytes = count.checked_mul(4).ok_or_else(|| Error::OutOfMemory {
            device: self.name(),
            bytes: u64::MAX,
        })?;
        let ptr = self.issue(
            "alloc_table",
            DriverCall::DeviceAlloc {
                bytes: bytes as u64,
            },
            |d| d.alloc(bytes),
        )?;
        if let Err(e) = self.issue(
            "alloc_table",
            DriverCall::Fill32 {
                count: count as u64,
            },
            |d| d.fill32(ptr, fill as u32, count),
        ) {
            let _ = self.issue("alloc_table", DriverCall::DeviceFree, |d| d.free(ptr));
            return Err(e);
        }
        st.seen.room_for(len);
        Ok(TableId(st.tables.push(Alloc { ptr, len })))
    }

    fn free_bytes(&self, buf: BytesId) -> Result<(), Error> {
        let mut st = self.state();
        let ptr = st.bytes.get(buf.0)?.ptr;
        self.issue("free_bytes", DriverCall::DeviceFree, |d| d.free(ptr))?;
        st.bytes.remove(buf.0)
    }

    fn free_table(&self, table: TableId) -> Result<(), Error> {
        let mut st = self.state();
        let ptr = st.tables.get(table.0)?.ptr;
        if let Some(ptr) = st.exports.retire(table.0, ptr) {
            self.issue("free_table", DriverCall::DeviceFree, |d| d.free(ptr))?;
        }
        st.tables.remove(table.0)?;
        self.reap_exports(&mut st, "free_table")
    }

    fn export_table(&self, table: TableId) -> Result<TableExport, Error> {
        let mut st = self.state();
        let t = st.tables.get(table.0)?;
        let (address, len) = (t.ptr, t.len);
        let device = match self.driver.ordinal() {
            Some(ordinal) => ExportDevice::Cuda { ordinal },
            None => ExportDevice::EmulatedCuda,
        };
        Ok(TableExport {
            address,
            len,
            device,
            guard: st.exports.guard(table.0),
        })
    }

    unsafe fn make_stream_wait(&self, consumer: crate::RawStream) -> Result<(), Error> {
        let stream = consumer as usize;
        if stream == self.driver.raw_stream() && stream != 0 {
            return Ok(()); // the device's own stream: already in order
        }
        let op = "make_stream_wait";
        let event = self.issue(op, DriverCall::EventCreate, |d| d.event_create())?;
        let waited = self
            .issue(op, DriverCall::EventRecord, |d| d.event_record(event))
            .and_then(|()| {
                self.issue(op, DriverCall::ExternalWait, |d| {
                    d.stream_wait_event(stream, event)
                })
            });
        // Destroying an event a stream still waits for is allowed: the wait holds.
        let destroyed = self.issue(op, DriverCall::EventDestroy, |d| d.event_destroy(event));
        waited.and(destroyed)
    }

    fn upload_table(&self, table: TableId, offset: usize, values: &[i32]) -> Result<(), Error> {
        let mut st = self.state();
        let t = st.tables.get(table.0)?;
        check::table_range("upload_table", table, offset, values.len(), t.len)?;
        if values.is_empty() {
            return Ok(());
        }
        let dst = t.ptr + 4 * offset as u64;
        st.pack.clear();
        st.pack.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        let staged = self.stage(&mut st, "upload_table", Some(dst))?;
        self.finish(&mut st, "upload_table", staged)
    }

    fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), Error> {
        self.scatter_tables(&[TableScatter { table, entries }])
    }

    fn scatter_tables(&self, scatters: &[TableScatter<'_>]) -> Result<(), Error> {
        let mut st = self.state();
        check::scatters(scatters, |t| Ok(st.tables.get(t.0)?.len))?;
        self.write_entries(&mut st, "scatter_tables", scatters)
    }

    fn copy_table_spans(&self, copies: &[TableSpans<'_>]) -> Result<(), Error> {
        let mut st = self.state();
        check::table_spans(copies, |t| Ok(st.tables.get(t.0)?.len))?;
        self.write_entries(&mut st, "copy_table_spans", copies)
    }

    fn gather_table(
        &self,
        src: TableId,
        indices: TableId,
        n: usize,
        out: TableId,
    ) -> Result<(), Error> {
        let st = self.state();
        let (s, i, o) = (
            st.tables.get(src.0)?,
            st.tables.get(indices.0)?,
            st.tables.get(out.0)?,
        );
        check::gather(src, (indices, i.len), n, (out, o.len))?;
        if n == 0 {
            return Ok(());
        }
        // Kernel `unikv_gather(const int* src, unsigned long long src_len, const int*
        // indices, unsigned long long n, int* out)`: `indices` and `out` hold >= n
        // entries and `out` is neither input (checked); thread i writes only out[i].
        let args = [
            Arg::U64(s.ptr),
            Arg::U64(s.len as u64),
            Arg::U64(i.ptr),
            Arg::U64(n as u64),
            Arg::U64(o.ptr),
        ];
        self.launch("gather_table", Kernel::Gather, per_item(n as u64), &args)
    }

    fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], value: u8) -> Result<(), Error> {
        let mut st = self.state();
        let b = st.bytes.get(buf.0)?;
        check::fill(buf, spans, b.len as u64)?;
        let ptr = b.ptr;
        st.pack.clear();
        pack_u64s(
            &mut st.pack,
            spans
                .iter()
                .filter(|s| s.len > 0)
                .flat_map(|s| [s.offset, s.len]),
        );
        let n = (st.pack.len() / 16) as u64;
        if n == 0 {
            return Ok(());
        }
        let longest = spans.iter().map(|s| s.len).max().unwrap_or(0);
        // Kernel `unikv_fill_spans(unsigned char* buf, const unsigned long long* spans,
        // unsigned long long n_spans, unsigned char value)`: every span was checked
        // inside `buf`; overlapping spans write the same value.
        self.launch_with_list(
            &mut st,
            "fill_spans",
            ListKind::Data,
            Kernel::FillSpans,
            per_span(n, longest),
            |list| vec![Arg::U64(ptr), Arg::U64(list), Arg::U64(n), Arg::U8(value)],
        )
    }

    fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), Error> {
        let mut st = self.state();
        let b = st.bytes.get(buf.0)?;
        check::moves(buf, moves, b.len as u64)?;
        let ptr = b.ptr;
        st.pack.clear();
        pack_u64s(
            &mut st.pack,
            moves
                .iter()
                .filter(|m| m.len > 0)
                .flat_map(|m| [m.src, m.dst, m.len]),
        );
        let n = (st.pack.len() / 24) as u64;
        if n == 0 {
            return Ok(());
        }
        let longest = moves.iter().map(|m| m.len).max().unwrap_or(0);
        // Kernel `unikv_move_spans(unsigned char* buf, const unsigned long long* moves,
        // unsigned long long n_moves)`: every range was checked inside `buf`, and no
        // destination overlaps another destination or any source, so no byte is both
        // read and written and each written byte has one writer: no staging copy.
        self.launch_with_list(
            &mut st,
            "move_spans",
            ListKind::Data,
            Kernel::MoveSpans,
            per_span(n, longest),
            |list| vec![Arg::U64(ptr), Arg::U64(list), Arg::U64(n)],
        )
    }

    fn translate(&self, args: &Translate) -> Result<(), Error> {
        let st = self.state();
        let (v2p, ids, out) = (
            st.tables.get(args.v2p.0)?,
            st.tables.get(args.ids.0)?,
            st.tables.get(args.out.0)?,
        );
        let (page_size, stride) = check::translate(args, ids.len, out.len)?;
        if args.out_width == 0 {
            return Ok(());
        }
        // Kernel `unikv_translate(const int* v2p, unsigned long long v2p_len, const int*
        // ids, unsigned long long n, int page_size, int stride, int* out, unsigned long
        // long out_width)`: `ids` holds >= n and `out` >= out_width entries, `out` is
        // neither input and page_size > 0 (checked); thread i writes only out[i].
        let launch = [
            Arg::U64(v2p.ptr),
            Arg::U64(v2p.len as u64),
            Arg::U64(ids.ptr),
            Arg::U64(args.n as u64),
            Arg::I32(page_size),
            Arg::I32(stride),
            Arg::U64(out.ptr),
            Arg::U64(args.out_width as u64),
        ];
        self.launch(
            "translate",
            Kernel::Translate,
            per_item(args.out_width as u64),
            &launch,
        )
    }

    fn translate_many(&self, all: &[Translate]) -> Result<(), Error> {
        let mut st = self.state();
        let mut scalars = Vec::with_capacity(all.len());
        check::translates(
            all,
            |t| Ok(st.tables.get(t.0)?.len),
            |_, ps| scalars.push(ps),
        )?;
        let State { tables, pack, .. } = &mut *st;
        pack.clear();
        let mut widest = 0;
        for (args, &(page_size, stride)) in all.iter().zip(&scalars) {
            if args.out_width == 0 {
                continue;
            }
            widest = widest.max(args.out_width as u64);
            let v2p = tables.get(args.v2p.0)?;
            pack_u64s(
                pack,
                [
                    v2p.ptr,
                    v2p.len as u64,
                    tables.get(args.ids.0)?.ptr,
                    args.n as u64,
                    page_size as u64,
                    stride as u64,
                    tables.get(args.out.0)?.ptr,
                    args.out_width as u64,
                ],
            );
        }
        let count = (pack.len() / 64) as u64;
        if count == 0 {
            return Ok(());
        }
        // Kernel `unikv_translate_many(const unsigned long long* list, unsigned long long
        // count)`: each translation checked as for `translate`, and no output is another
        // one's table (checked), so each output slot has one writer.
        self.launch_list_rows(
            &mut st,
            "translate_many",
            Kernel::TranslateMany,
            count,
            widest,
        )
    }

    fn translate_windows(&self, all: &[WindowTranslate]) -> Result<(), Error> {
        let mut st = self.state();
        let scalars = check::windows(all, |t| Ok(st.tables.get(t.0)?.len))?;
        let State { tables, pack, .. } = &mut *st;
        pack.clear();
        let mut widest = 0;
        for (w, &(page_size, stride)) in all.iter().zip(&scalars) {
            let items = (w.batch * w.width) as u64; // checked
            if items == 0 {
                continue;
            }
            widest = widest.max(items);
            let v2p = tables.get(w.v2p.0)?;
            let at = |t: TableId, i: usize| Ok::<_, Error>(tables.get(t.0)?.ptr + 4 * i as u64);
            pack_u64s(
                pack,
                [
                    v2p.ptr,
                    v2p.len as u64,
                    at(w.ids, w.ids_at)?,
                    w.rows as u64,
                    at(w.starts, w.starts_at)?,
                    i64::from(w.bias) as u64,
                    w.batch as u64,
                    w.width as u64,
                    page_size as u64,
                    stride as u64,
                    at(w.out, w.out_at)?,
                    match w.lens {
                        Some((t, i)) => at(t, i)?,
                        None => 0, // every entry live
                    },
                ],
            );
        }
        let count = (pack.len() / (8 * WINDOW_WORDS)) as u64;
        if count == 0 {
            return Ok(());
        }
        // Kernel `unikv_translate_windows(const unsigned long long* list, unsigned long
        // long count)`: each window's tables hold its ranges and no output is an input
        // of the call or overlaps another output (checked), so each slot has one writer.
        self.launch_list_rows(
            &mut st,
            "translate_windows",
            Kernel::TranslateWindows,
            count,
            widest,
        )
    }

    fn translate_lanes(&self, all: &[LaneTranslate]) -> Result<(), Error> {
        let mut st = self.state();
        let strides = check::lanes(all, |t| Ok(st.tables.get(t.0)?.len))?;
        let State { tables, pack, .. } = &mut *st;
        pack.clear();
        let (mut total, mut widest) = (0u64, 0u64);
        for (t, &stride) in all.iter().zip(&strides) {
            if t.batch == 0 || t.out_len == 0 {
                continue;
            }
            total += t.batch as u64;
            // The runs are device data: size x by the average run, the loop strides.
            widest = widest.max((t.out_len as u64).div_ceil(t.batch as u64));
            let (v2p, rows) = (tables.get(t.v2p.0)?, tables.get(t.rows.0)?);
            let at = |t: TableId, i: usize| Ok::<_, Error>(tables.get(t.0)?.ptr + 4 * i as u64);
            pack_u64s(
                pack,
                [
                    v2p.ptr,
                    v2p.len as u64,
                    rows.ptr,
                    rows.len as u64,
                    t.lane_len as u64,
                    at(t.lanes.0, t.lanes.1)?,
                    match t.firsts {
                        Some((f, i)) => at(f, i)?,
                        None => 0, // every run starts at entry 0
                    },
                    at(t.starts.0, t.starts.1)?,
                    t.batch as u64,
                    stride as u32 as u64,
                    at(t.out, t.out_at)?,
                    t.out_len as u64,
                ],
            );
        }
        let count = (pack.len() / (8 * LANE_WORDS)) as u64;
        if count == 0 {
            return Ok(());
        }
        // Kernel `unikv_translate_lanes(const unsigned long long* list, unsigned long long
        // count, unsigned long long total)`: each translation's tables hold its ranges,
        // v2p and rows are no output and no output range overlaps an input range or
        // another output (checked); total is the sum of the batches.
        let grid = Grid {
            blocks: (
                widest.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32,
                total.clamp(1, MAX_BLOCKS) as u32,
                1,
            ),
            threads: BLOCK,
        };
        self.launch_with_list(
            &mut st,
            "translate_lanes",
            ListKind::Descriptor,
            Kernel::TranslateLanes,
            grid,
            |list| vec![Arg::U64(list), Arg::U64(count), Arg::U64(total)],
        )
    }

    fn gather_rows(&self, all: &[RowGather]) -> Result<(), Error> {
        let st = self.state();
        check::row_gathers(
            all,
            |b| Ok(st.bytes.get(b.0)?.len as u64),
            |t| Ok(st.tables.get(t.0)?.len),
        )?;
        // One launch per gather, in call order, each with its arguments by value (so a
        // captured graph replays them).
        for args in all {
            self.gather_rows_one(&st, args)?;
        }
        Ok(())
    }

    fn alloc_host(&self, len: u64) -> Result<HostBytesId, Error> {
        self.alloc_host_buffer(len)
    }

    fn free_host(&self, host: HostBytesId) -> Result<(), Error> {
        self.free_host_buffer(host)
    }

    fn copy_device_to_host(
        &self,
        buf: BytesId,
        host: HostBytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        self.host_copies(check::CopyInto::Host, buf, host, copies)
    }

    fn copy_host_to_device(
        &self,
        host: HostBytesId,
        buf: BytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        self.host_copies(check::CopyInto::Device, buf, host, copies)
    }

    fn record_copy_event(&self) -> Result<CopyEvent, Error> {
        self.record_copy_marker()
    }

    fn copy_event_done(&self, event: CopyEvent) -> Result<bool, Error> {
        let handle = *self.state().copy_events.get(event.0)?;
        self.issue("copy_event_done", DriverCall::EventQuery, |d| {
            d.event_done(handle)
        })
    }

    fn free_copy_event(&self, event: CopyEvent) -> Result<(), Error> {
        let mut st = self.state();
        let handle = *st.copy_events.get(event.0)?;
        self.issue("free_copy_event", DriverCall::EventDestroy, |d| {
            d.event_destroy(handle)
        })?;
        st.copy_events.remove(event.0)
    }
}

impl CudaDevice {
    /// Launches one checked gather of [`Device::gather_rows`].
    fn gather_rows_one(&self, st: &State, args: &RowGather) -> Result<(), Error> {
        let (buf, ids, path) = (
            st.bytes.get(args.buf.0)?,
            st.tables.get(args.ids.0)?,
            st.tables.get(args.path.0)?,
        );
        let token_bytes = u64::from(args.rows_per_token) * args.row_bytes; // checked
        if args.batch == 0 || args.width == 0 || token_bytes == 0 {
            return Ok(());
        }
        // Kernel `unikv_gather_rows(unsigned char* buf, unsigned long long buf_len, const
        // int* ids, const int* path, unsigned long long batch, unsigned long long width,
        // unsigned long long page_size, unsigned long long rows_per_token, unsigned long
        // long row_bytes)`: the tables hold batch × width entries from the pointers and no
        // row offset wraps (checked); a thread owns one byte offset of a token's rows and
        // walks the path in order, so every byte has one thread and the order is kept.
        let launch = [
            Arg::U64(buf.ptr),
            Arg::U64(buf.len as u64),
            Arg::U64(ids.ptr + 4 * args.ids_at as u64),
            Arg::U64(path.ptr + 4 * args.path_at as u64),
            Arg::U64(args.batch as u64),
            Arg::U64(args.width as u64),
            Arg::U64(u64::from(args.page_size)),
            Arg::U64(u64::from(args.rows_per_token)),
            Arg::U64(args.row_bytes),
        ];
        let grid = Grid {
            blocks: (
                token_bytes.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32,
                (args.batch as u64).clamp(1, MAX_BLOCKS) as u32,
                1,
            ),
            threads: BLOCK,
        };
        self.launch("gather_rows", Kernel::GatherRows, grid, &launch)
    }
}

impl Readback for CudaDevice {
    fn read_table(
        &self,
        sync: &HostSync,
        table: TableId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<i32>, Error> {
        let st = self.state();
        let t = st.tables.get(table.0)?;
        check::table_range("read_table", table, offset, len, t.len)?;
        if len == 0 {
            return self.synchronize(sync).map(|()| Vec::new());
        }
        self.read("read_table", t.ptr + 4 * offset as u64, len, decode_i32)
    }

    fn read_bytes(
        &self,
        sync: &HostSync,
        buf: BytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        let st = self.state();
        let b = st.bytes.get(buf.0)?;
        check::bytes_range("read_bytes", buf, offset, len, b.len as u64)?;
        if len == 0 {
            return self.synchronize(sync).map(|()| Vec::new());
        }
        // In bounds (checked), so the length fits in usize.
        self.read("read_bytes", b.ptr + offset, len as usize, |b| b[0])
    }

    fn synchronize(&self, _sync: &HostSync) -> Result<(), Error> {
        self.issue("synchronize", DriverCall::Synchronize, |d| d.synchronize())
    }

    fn read_host(
        &self,
        _sync: &HostSync,
        host: HostBytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        let st = self.state();
        let h = st.hosts.get(host.0)?;
        check::host_range("read_host", host, offset, len, h.len)?;
        // Every copy into the buffer is done once the stream is.
        self.issue("read_host", DriverCall::Synchronize, |d| d.synchronize())?;
        // In bounds (checked), so offset and length fit in usize.
        let mut out = vec![0; len as usize];
        self.driver
            .read_pinned(&h.pinned, offset as usize, &mut out);
        Ok(out)
    }
}

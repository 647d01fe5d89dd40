//! `CudaDevice`: the CUDA backend (cudarc, kernels compiled at run time by NVRTC).
//!
//! With the `cuda` feature, [`CudaDevice::new`] checks that the driver library can be
//! loaded ([`Error::NoCudaDriver`] otherwise, never a panic), that the GPU exists
//! ([`Error::NoCudaDevice`]) and that NVRTC can be loaded ([`Error::NoNvrtc`]), then
//! compiles every kernel of `cu/` for the GPU's architecture. All work goes to one
//! stream, in call order; only [`Readback`] methods wait for it. That stream is never the
//! legacy default stream (the crate docs show an engine handing over its own).
//!
//! Without the feature the same type and functions exist and return
//! [`Error::NotCompiledWithCuda`] (candle's dummy-backend pattern), so no other crate
//! needs a `cfg`. The dummy type cannot be constructed, so its `Device` methods are
//! unreachable by construction.

#[cfg(feature = "cuda")]
pub use real::{CudaDevice, DeviceEvent};

#[cfg(not(feature = "cuda"))]
pub use dummy::{CudaDevice, DeviceEvent};

/// A raw CUDA stream handle (`CUstream`) an engine hands to
/// [`CudaDevice::on_engine_stream`].
pub type RawStream = *mut std::ffi::c_void;

/// A raw CUDA event handle (`CUevent`), of an engine's or of a [`DeviceEvent`].
pub type RawEvent = *mut std::ffi::c_void;

#[cfg(not(feature = "cuda"))]
mod dummy {
    use crate::{
        ByteSpan, BytesId, Device, Error, HostSync, Readback, SpanMove, TableId, Translate,
    };
    use std::convert::Infallible;

    /// The CUDA backend. This build has no `cuda` feature: [`CudaDevice::new`] returns
    /// [`Error::NotCompiledWithCuda`] and no value of this type can exist.
    #[derive(Debug)]
    pub struct CudaDevice {
        never: Infallible,
    }

    impl CudaDevice {
        /// Always [`Error::NotCompiledWithCuda`] in this build.
        pub fn new(ordinal: usize) -> Result<CudaDevice, Error> {
            let _ = ordinal;
            Err(Error::NotCompiledWithCuda)
        }

        /// Always [`Error::NotCompiledWithCuda`] in this build.
        ///
        /// # Safety
        /// As for the `cuda` build: `stream` belongs to GPU `ordinal`'s primary context
        /// and outlives the device.
        pub unsafe fn on_engine_stream(
            ordinal: usize,
            stream: super::RawStream,
        ) -> Result<CudaDevice, Error> {
            let _ = (ordinal, stream);
            Err(Error::NotCompiledWithCuda)
        }

        /// Always [`Error::NotCompiledWithCuda`] in this build.
        pub fn device_count() -> Result<usize, Error> {
            Err(Error::NotCompiledWithCuda)
        }

        /// Always [`Error::NotCompiledWithCuda`] in this build.
        pub fn driver_version() -> Result<(i32, i32), Error> {
            Err(Error::NotCompiledWithCuda)
        }

        /// The GPU's ordinal (unreachable: no value of this type exists).
        pub fn ordinal(&self) -> usize {
            match self.never {}
        }

        /// The stream (unreachable: no value of this type exists).
        pub fn stream(&self) -> super::RawStream {
            match self.never {}
        }

        /// Records the device's enqueued work (unreachable: no value of this type
        /// exists).
        pub fn record_event(&self) -> Result<DeviceEvent, Error> {
            match self.never {}
        }

        /// Makes the device's stream wait for `event` (unreachable).
        ///
        /// # Safety
        /// As for the `cuda` build.
        pub unsafe fn wait_raw_event(&self, event: super::RawEvent) -> Result<(), Error> {
            let _ = event;
            match self.never {}
        }
    }

    /// An event on a [`CudaDevice`]'s stream. This build has no `cuda` feature: no value
    /// of this type can exist.
    #[derive(Debug)]
    pub struct DeviceEvent {
        never: Infallible,
    }

    impl DeviceEvent {
        /// The raw handle (unreachable: no value of this type exists).
        pub fn raw(&self) -> super::RawEvent {
            match self.never {}
        }
    }

    impl Device for CudaDevice {
        fn name(&self) -> String {
            match self.never {}
        }
        fn alloc_bytes(&self, _: u64, _: u8) -> Result<BytesId, Error> {
            match self.never {}
        }
        fn alloc_table(&self, _: usize, _: i32) -> Result<TableId, Error> {
            match self.never {}
        }
        fn free_bytes(&self, _: BytesId) -> Result<(), Error> {
            match self.never {}
        }
        fn free_table(&self, _: TableId) -> Result<(), Error> {
            match self.never {}
        }
        fn upload_table(&self, _: TableId, _: usize, _: &[i32]) -> Result<(), Error> {
            match self.never {}
        }
        fn scatter_table(&self, _: TableId, _: &[(u32, i32)]) -> Result<(), Error> {
            match self.never {}
        }
        fn gather_table(&self, _: TableId, _: TableId, _: usize, _: TableId) -> Result<(), Error> {
            match self.never {}
        }
        fn fill_spans(&self, _: BytesId, _: &[ByteSpan], _: u8) -> Result<(), Error> {
            match self.never {}
        }
        fn move_spans(&self, _: BytesId, _: &[SpanMove]) -> Result<(), Error> {
            match self.never {}
        }
        fn translate(&self, _: &Translate) -> Result<(), Error> {
            match self.never {}
        }
    }

    impl Readback for CudaDevice {
        fn read_table(
            &self,
            _: &HostSync,
            _: TableId,
            _: usize,
            _: usize,
        ) -> Result<Vec<i32>, Error> {
            match self.never {}
        }
        fn read_bytes(&self, _: &HostSync, _: BytesId, _: u64, _: u64) -> Result<Vec<u8>, Error> {
            match self.never {}
        }
        fn synchronize(&self, _: &HostSync) -> Result<(), Error> {
            match self.never {}
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn without_the_cuda_feature_every_entry_point_says_so() {
            assert!(matches!(
                CudaDevice::new(0),
                Err(Error::NotCompiledWithCuda)
            ));
            assert!(matches!(
                CudaDevice::device_count(),
                Err(Error::NotCompiledWithCuda)
            ));
            // SAFETY: the call refuses before it could use the (null) stream.
            let on_stream = unsafe { CudaDevice::on_engine_stream(0, std::ptr::null_mut()) };
            assert!(matches!(on_stream, Err(Error::NotCompiledWithCuda)));
            assert!(matches!(
                CudaDevice::driver_version(),
                Err(Error::NotCompiledWithCuda)
            ));
        }
    }
}

#[cfg(feature = "cuda")]
mod real {
    use crate::check;
    use crate::nvrtc;
    use crate::{
        ByteSpan, BytesId, Device, Error, HostSync, Readback, SpanMove, TableId, Translate,
    };
    use cudarc::driver::sys::CUresult;
    use cudarc::driver::{
        CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DriverError, LaunchConfig,
        PushKernelArg,
    };
    use std::collections::HashSet;
    use std::fmt;
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

    /// Threads per block of every launch.
    const BLOCK: u32 = 256;
    /// Most blocks of one launch; the kernels use grid-stride loops, so any size works.
    const MAX_BLOCKS: u64 = 65_535;

    /// Whether the CUDA driver library can be loaded; asked once per process.
    fn driver_present() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        *PRESENT.get_or_init(|| {
            // SAFETY: `is_culib_present` only tries `dlopen` on the driver's library
            // names (and closes what it opened). Loading runs libcuda's initialisers,
            // which have no precondition on our side; no driver function is called.
            unsafe { cudarc::driver::sys::is_culib_present() }
        })
    }

    fn cuda(op: &'static str) -> impl Fn(DriverError) -> Error {
        move |e| Error::Cuda(format!("{op}: {e}"))
    }

    /// Like [`cuda`], but an out-of-memory result becomes [`Error::OutOfMemory`].
    fn alloc_error(device: String, bytes: u64) -> impl Fn(DriverError) -> Error {
        move |e| match e.0 {
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                device: device.clone(),
                bytes,
            },
            _ => Error::Cuda(format!("alloc of {bytes} bytes: {e}")),
        }
    }

    /// A launch of `items` independent items, one thread each (grid-stride).
    fn per_item(items: u64) -> LaunchConfig {
        let blocks = items.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1), // <= MAX_BLOCKS, fits in u32
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Bytes of a span one block handles at a time (`UNIKV_CHUNK` of `cu/spans.cu`: a
    /// 16-byte word per thread).
    const CHUNK: u64 = 16 * BLOCK as u64;

    /// A launch over `spans` spans of at most `max_len` bytes (`cu/spans.cu`): a row of
    /// blocks per span (y) and a block per chunk of the longest (x), both grid-stride.
    fn per_span(spans: u64, max_len: u64) -> LaunchConfig {
        LaunchConfig {
            // Both <= MAX_BLOCKS, so they fit in u32 (and y in the 65,535 limit).
            grid_dim: (
                max_len.div_ceil(CHUNK).clamp(1, MAX_BLOCKS) as u32,
                spans.clamp(1, MAX_BLOCKS) as u32,
                1,
            ),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    struct Kernels {
        translate: CudaFunction,
        move_spans: CudaFunction,
        fill_spans: CudaFunction,
        scatter: CudaFunction,
        gather: CudaFunction,
    }

    /// A device allocation and its length as the host knows it (the allocation holds
    /// at least one element, since CUDA refuses empty allocations).
    struct Slot<T> {
        data: CudaSlice<T>,
        len: usize,
    }

    #[derive(Default)]
    struct State {
        bytes: Vec<Option<Slot<u8>>>,
        tables: Vec<Option<Slot<i32>>>,
    }

    /// The CUDA backend: buffers and tables in GPU memory, every op one or two kernel
    /// launches (or one copy) on a single stream, in call order.
    ///
    /// Temporary device buffers of an op (scatter pairs, span and move lists) are
    /// freed stream-ordered (`cuMemFreeAsync`) on GPUs with memory pools, so no op of
    /// [`Device`] waits for the GPU; on a GPU without memory pools the driver frees
    /// synchronously.
    pub struct CudaDevice {
        ordinal: usize,
        stream: Arc<CudaStream>,
        kernels: Kernels,
        state: Mutex<State>,
    }

    /// An event recorded on a [`CudaDevice`]'s stream ([`CudaDevice::record_event`]).
    pub struct DeviceEvent(cudarc::driver::CudaEvent);

    impl fmt::Debug for DeviceEvent {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_tuple("DeviceEvent").finish()
        }
    }

    impl DeviceEvent {
        /// The raw handle, for the engine's `cuStreamWaitEvent`; valid while this lives.
        pub fn raw(&self) -> super::RawEvent {
            self.0.cu_event() as super::RawEvent
        }
    }

    impl fmt::Debug for CudaDevice {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("CudaDevice")
                .field("ordinal", &self.ordinal)
                .finish_non_exhaustive()
        }
    }

    impl CudaDevice {
        /// Opens GPU `ordinal` on a non-blocking stream of its own and compiles every
        /// kernel for its architecture.
        ///
        /// Errors: [`Error::NoCudaDriver`] (no libcuda), [`Error::NoCudaDevice`] (no
        /// such GPU), [`Error::NoNvrtc`] (no libnvrtc), [`Error::KernelCompile`],
        /// [`Error::Cuda`] for other driver failures (e.g. a PTX too new for the driver).
        pub fn new(ordinal: usize) -> Result<CudaDevice, Error> {
            CudaDevice::open(ordinal, |ctx| {
                ctx.new_stream()
                    .map_err(cuda("create a non-blocking stream"))
            })
        }

        /// Opens GPU `ordinal` on the engine's `stream`: every op is enqueued there, in
        /// call order with the engine's own work, and none waits for the GPU. Errors as
        /// [`CudaDevice::new`].
        ///
        /// # Safety
        /// `stream` is a valid stream of GPU `ordinal`'s primary context (the one the
        /// CUDA runtime uses), and it outlives the device and everything it issued: the
        /// device never destroys it.
        pub unsafe fn on_engine_stream(
            ordinal: usize,
            stream: super::RawStream,
        ) -> Result<CudaDevice, Error> {
            CudaDevice::open(ordinal, |ctx| {
                // SAFETY: the caller keeps `stream` valid, of this context, and alive
                // for the device's life (this function's contract); the wrapper does not
                // destroy it.
                Ok(unsafe { ctx.wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream) })
            })
        }

        /// [`CudaDevice::new`] with the stream `stream` makes for the context.
        fn open(
            ordinal: usize,
            stream: impl FnOnce(&Arc<CudaContext>) -> Result<Arc<CudaStream>, Error>,
        ) -> Result<CudaDevice, Error> {
            let count = CudaDevice::device_count()?;
            if ordinal >= count {
                return Err(Error::NoCudaDevice { ordinal, count });
            }
            let ctx = CudaContext::new(ordinal).map_err(cuda("create context"))?;
            let (major, minor) = ctx
                .compute_capability()
                .map_err(cuda("compute capability"))?;
            let arch = format!("compute_{major}{minor}");
            let load = |file: &'static str, names: &[&str]| -> Result<Vec<CudaFunction>, Error> {
                let src = nvrtc::source(file).ok_or(Error::KernelCompile {
                    file,
                    log: "not in KERNEL_SOURCES".to_string(),
                })?;
                let module = ctx
                    .load_module(nvrtc::compile(file, src, &arch)?)
                    .map_err(|e| {
                        let hint = match e.0 {
                            CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
                                "; the PTX comes from an NVRTC newer than the driver: use an \
                                 NVRTC whose CUDA version is at most the driver's"
                            }
                            _ => "",
                        };
                        Error::Cuda(format!("load {file} ({arch}): {e}{hint}"))
                    })?;
                names
                    .iter()
                    .map(|name| {
                        module
                            .load_function(name)
                            .map_err(|e| Error::Cuda(format!("{file}: kernel {name}: {e}")))
                    })
                    .collect()
            };
            let [translate] = take(load("translate.cu", &["unikv_translate"])?)?;
            let [move_spans, fill_spans] =
                take(load("spans.cu", &["unikv_move_spans", "unikv_fill_spans"])?)?;
            let [scatter, gather] = take(load("tables.cu", &["unikv_scatter", "unikv_gather"])?)?;
            Ok(CudaDevice {
                ordinal,
                stream: stream(&ctx)?,
                kernels: Kernels {
                    translate,
                    move_spans,
                    fill_spans,
                    scatter,
                    gather,
                },
                state: Mutex::new(State::default()),
            })
        }

        /// How many GPUs the driver sees (`0` when it has none).
        ///
        /// Errors: [`Error::NoCudaDriver`] when libcuda cannot be loaded.
        pub fn device_count() -> Result<usize, Error> {
            if !driver_present() {
                return Err(Error::NoCudaDriver);
            }
            match CudaContext::device_count() {
                Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
                Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
                Err(e) => Err(cuda("cuInit / device count")(e)),
            }
        }

        /// The CUDA version the driver supports, as `(major, minor)`.
        ///
        /// Errors: [`Error::NoCudaDriver`] when libcuda cannot be loaded.
        pub fn driver_version() -> Result<(i32, i32), Error> {
            if !driver_present() {
                return Err(Error::NoCudaDriver);
            }
            let mut version = 0;
            // SAFETY: libcuda is loadable (checked above), so the symbol lookup
            // succeeds; `cuDriverGetVersion` needs no `cuInit` and only writes one int
            // through the valid pointer we pass.
            unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
                .result()
                .map_err(cuda("cuDriverGetVersion"))?;
            Ok((version / 1000, version % 1000 / 10))
        }

        /// The GPU's ordinal.
        pub fn ordinal(&self) -> usize {
            self.ordinal
        }

        /// The stream every op is enqueued on (for the engine's `cuStreamWaitEvent`, graph
        /// capture and the like); the device keeps owning it.
        pub fn stream(&self) -> super::RawStream {
            self.stream.cu_stream() as super::RawStream
        }

        /// Records the work enqueued so far (a step's unikv ops): an engine makes its
        /// stream wait for the event before its forward reads what they wrote. Issues
        /// without waiting.
        pub fn record_event(&self) -> Result<DeviceEvent, Error> {
            self.bind()?;
            let event = self
                .stream
                .record_event(None)
                .map_err(cuda("record an event"))?;
            Ok(DeviceEvent(event))
        }

        /// Makes every op enqueued from now on wait for `event` (the engine's, recorded
        /// after the work unikv must follow), without the host waiting.
        ///
        /// # Safety
        /// `event` is a valid event of this GPU's context, recorded (or never recorded:
        /// then nothing is waited for), and alive until this call returns.
        pub unsafe fn wait_raw_event(&self, event: super::RawEvent) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: the stream is valid for the device's life; `event` is valid (this
            // function's contract); waiting enqueues a dependency and does not block.
            unsafe {
                cudarc::driver::result::stream::wait_event(
                    self.stream.cu_stream(),
                    event as cudarc::driver::sys::CUevent,
                    cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(cuda("wait for an event"))
        }

        fn state(&self) -> MutexGuard<'_, State> {
            // Every op validates its arguments before it changes the slot vectors or
            // issues work, and slot updates are single assignments; a panic elsewhere
            // cannot leave them torn, so a poisoned lock still guards usable state.
            self.state.lock().unwrap_or_else(PoisonError::into_inner)
        }

        /// Makes the GPU's context current on this thread. cudarc binds it for allocs,
        /// copies and launches, but not for the frees in `CudaSlice`'s `Drop`, which
        /// use the legacy default stream of the *current* context.
        fn bind(&self) -> Result<(), Error> {
            self.stream
                .context()
                .bind_to_thread()
                .map_err(cuda("bind context"))
        }

        fn unknown(&self, kind: &'static str, id: u32) -> Error {
            Error::UnknownHandle {
                kind,
                id,
                device: self.name(),
            }
        }
    }

    impl Drop for CudaDevice {
        fn drop(&mut self) {
            // The slots drop after this, possibly on a thread that never used the GPU;
            // their frees need the context current. A failure here only leaks memory
            // of a device being torn down, so it is ignored.
            let _ = self.bind();
        }
    }

    /// The `N` functions of one module, in the order asked for.
    fn take<const N: usize>(functions: Vec<CudaFunction>) -> Result<[CudaFunction; N], Error> {
        functions
            .try_into()
            .map_err(|_| Error::Cuda("a module returned the wrong number of kernels".into()))
    }

    impl State {
        fn bytes(&self, id: BytesId) -> Option<&Slot<u8>> {
            self.bytes.get(id.0 as usize).and_then(Option::as_ref)
        }
        fn bytes_mut(&mut self, id: BytesId) -> Option<&mut Slot<u8>> {
            self.bytes.get_mut(id.0 as usize).and_then(Option::as_mut)
        }
        fn table(&self, id: TableId) -> Option<&Slot<i32>> {
            self.tables.get(id.0 as usize).and_then(Option::as_ref)
        }
        fn table_mut(&mut self, id: TableId) -> Option<&mut Slot<i32>> {
            self.tables.get_mut(id.0 as usize).and_then(Option::as_mut)
        }
    }

    fn next_handle<T>(slots: &[T]) -> Result<u32, Error> {
        u32::try_from(slots.len()).map_err(|_| Error::BadArguments {
            op: "alloc",
            reason: "every handle number of this device has been used".to_string(),
        })
    }

    impl Device for CudaDevice {
        fn name(&self) -> String {
            format!("cuda:{}", self.ordinal)
        }

        fn alloc_bytes(&self, len: u64, fill: u8) -> Result<BytesId, Error> {
            let oom = alloc_error(self.name(), len);
            let n = usize::try_from(len)
                .map_err(|_| oom(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)))?;
            let mut st = self.state();
            let id = next_handle(&st.bytes)?;
            // SAFETY: the allocation is uninitialised; the memset below, issued on the
            // same stream before the handle is returned, writes every byte before any
            // op can read one.
            let mut data = unsafe { self.stream.alloc::<u8>(n.max(1)) }.map_err(&oom)?;
            {
                let (ptr, _record) = data.device_ptr_mut(&self.stream);
                // SAFETY: `ptr` is the start of the live allocation just made on
                // `self.stream`, of `n.max(1)` bytes; any byte pattern is a valid `u8`.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        ptr,
                        fill,
                        n.max(1),
                        self.stream.cu_stream(),
                    )
                }
                .map_err(cuda("alloc_bytes: memset"))?;
            }
            st.bytes.push(Some(Slot { data, len: n }));
            Ok(BytesId(id))
        }

        fn alloc_table(&self, len: usize, fill: i32) -> Result<TableId, Error> {
            let bytes = (len as u64).saturating_mul(4);
            let mut st = self.state();
            let id = next_handle(&st.tables)?;
            let mut host = Vec::new();
            host.try_reserve_exact(len.max(1)).map_err(|_| {
                alloc_error(self.name(), bytes)(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
            })?;
            host.resize(len.max(1), fill);
            let data = self
                .stream
                .clone_htod(&host)
                .map_err(alloc_error(self.name(), bytes))?;
            st.tables.push(Some(Slot { data, len }));
            Ok(TableId(id))
        }

        fn free_bytes(&self, buf: BytesId) -> Result<(), Error> {
            let mut st = self.state();
            match st.bytes.get_mut(buf.0 as usize) {
                Some(slot @ Some(_)) => {
                    self.bind()?;
                    *slot = None; // freed stream-ordered by CudaSlice's Drop
                    Ok(())
                }
                _ => Err(self.unknown("bytes", buf.0)),
            }
        }

        fn free_table(&self, table: TableId) -> Result<(), Error> {
            let mut st = self.state();
            match st.tables.get_mut(table.0 as usize) {
                Some(slot @ Some(_)) => {
                    self.bind()?;
                    *slot = None; // freed stream-ordered by CudaSlice's Drop
                    Ok(())
                }
                _ => Err(self.unknown("table", table.0)),
            }
        }

        fn upload_table(&self, table: TableId, offset: usize, values: &[i32]) -> Result<(), Error> {
            let mut st = self.state();
            let t = st
                .table_mut(table)
                .ok_or_else(|| self.unknown("table", table.0))?;
            check::table_range("upload_table", table, offset, values.len(), t.len)?;
            if values.is_empty() {
                return Ok(());
            }
            let mut view = t.data.slice_mut(offset..offset + values.len()); // in bounds: checked
            self.stream
                .memcpy_htod(values, &mut view)
                .map_err(cuda("upload_table"))
        }

        fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), Error> {
            let mut st = self.state();
            let t = st
                .table_mut(table)
                .ok_or_else(|| self.unknown("table", table.0))?;
            check::scatter(table, entries, t.len)?;
            // Keep the last pair of each index, so no two threads write one entry.
            let mut seen = HashSet::with_capacity(entries.len());
            let mut pairs: Vec<u32> = Vec::with_capacity(2 * entries.len());
            for &(index, value) in entries.iter().rev() {
                if seen.insert(index) {
                    pairs.extend([index, value as u32]); // bit pattern; the kernel casts back
                }
            }
            if pairs.is_empty() {
                return Ok(());
            }
            let n = (pairs.len() / 2) as u64;
            let pairs = self
                .stream
                .clone_htod(&pairs)
                .map_err(cuda("scatter_table: upload"))?;
            let mut launch = self.stream.launch_builder(&self.kernels.scatter);
            launch.arg(&mut t.data).arg(&pairs).arg(&n);
            // SAFETY: kernel `unikv_scatter(int* table, const unsigned int* pairs,
            // unsigned long long n)`, arguments in that order with matching types
            // (CudaSlice<i32>, CudaSlice<u32>, u64). Bounds: `pairs` holds 2n entries
            // and every index was checked `< t.len` on the host. Aliasing: `pairs` is a
            // fresh allocation and indices are unique, so each table entry has at most
            // one writer. `pairs` is freed stream-ordered after the launch.
            unsafe { launch.launch(per_item(n)) }.map_err(cuda("scatter_table: launch"))?;
            Ok(())
        }

        fn gather_table(
            &self,
            src: TableId,
            indices: TableId,
            n: usize,
            out: TableId,
        ) -> Result<(), Error> {
            let mut st = self.state();
            let indices_len = st
                .table(indices)
                .ok_or_else(|| self.unknown("table", indices.0))?
                .len;
            let src_len = st
                .table(src)
                .ok_or_else(|| self.unknown("table", src.0))?
                .len;
            let out_len = st
                .table(out)
                .ok_or_else(|| self.unknown("table", out.0))?
                .len;
            check::gather(src, (indices, indices_len), n, (out, out_len))?;
            if n == 0 {
                return Ok(());
            }
            // `out` differs from `src` and `indices` (checked), so taking it out of its
            // slot leaves both readable while we hold `out` mutably.
            let mut out_slot = st.tables[out.0 as usize]
                .take()
                .ok_or_else(|| self.unknown("table", out.0))?;
            let result = (|| {
                let (src_slot, indices_slot) = match (st.table(src), st.table(indices)) {
                    (Some(s), Some(i)) => (s, i),
                    _ => return Err(self.unknown("table", src.0)),
                };
                let (src_len, n) = (src_len as u64, n as u64);
                let mut launch = self.stream.launch_builder(&self.kernels.gather);
                launch
                    .arg(&src_slot.data)
                    .arg(&src_len)
                    .arg(&indices_slot.data)
                    .arg(&n)
                    .arg(&mut out_slot.data);
                // SAFETY: kernel `unikv_gather(const int* src, unsigned long long
                // src_len, const int* indices, unsigned long long n, int* out)`,
                // arguments in that order with matching types. Bounds: `indices` and
                // `out` hold >= n entries (checked); the kernel reads `src` only below
                // `src_len`, its true length. Aliasing: `out` is a different table from
                // `src` and `indices` (checked), and thread i writes only out[i].
                unsafe { launch.launch(per_item(n)) }.map_err(cuda("gather_table: launch"))?;
                Ok(())
            })();
            st.tables[out.0 as usize] = Some(out_slot);
            result
        }

        fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], value: u8) -> Result<(), Error> {
            let mut st = self.state();
            let b = st
                .bytes_mut(buf)
                .ok_or_else(|| self.unknown("bytes", buf.0))?;
            check::fill(buf, spans, b.len as u64)?;
            let list: Vec<u64> = spans
                .iter()
                .filter(|s| s.len > 0)
                .flat_map(|s| [s.offset, s.len])
                .collect();
            if list.is_empty() {
                return Ok(());
            }
            let n = (list.len() / 2) as u64;
            let longest = spans.iter().map(|s| s.len).max().unwrap_or(0);
            let list = self
                .stream
                .clone_htod(&list)
                .map_err(cuda("fill_spans: upload"))?;
            let mut launch = self.stream.launch_builder(&self.kernels.fill_spans);
            launch.arg(&mut b.data).arg(&list).arg(&n).arg(&value);
            // SAFETY: kernel `unikv_fill_spans(unsigned char* buf, const unsigned long
            // long* spans, unsigned long long n_spans, unsigned char value)`, arguments
            // in that order with matching types. Bounds: `list` holds 2n entries and
            // every span was checked inside `buf` on the host. Aliasing: `list` is a
            // fresh allocation; overlapping spans write the same value.
            unsafe { launch.launch(per_span(n, longest)) }.map_err(cuda("fill_spans: launch"))?;
            Ok(())
        }

        fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), Error> {
            let mut st = self.state();
            let b = st
                .bytes_mut(buf)
                .ok_or_else(|| self.unknown("bytes", buf.0))?;
            check::moves(buf, moves, b.len as u64)?;
            let list: Vec<u64> = moves
                .iter()
                .filter(|m| m.len > 0)
                .flat_map(|m| [m.src, m.dst, m.len])
                .collect();
            if list.is_empty() {
                return Ok(());
            }
            let n = (list.len() / 3) as u64;
            let longest = moves.iter().map(|m| m.len).max().unwrap_or(0);
            let list = self
                .stream
                .clone_htod(&list)
                .map_err(cuda("move_spans: upload"))?;
            let mut launch = self.stream.launch_builder(&self.kernels.move_spans);
            launch.arg(&mut b.data).arg(&list).arg(&n);
            // SAFETY: kernel `unikv_move_spans(unsigned char* buf, const unsigned long
            // long* moves, unsigned long long n_moves)`, arguments in that order with
            // matching types. Bounds: `list` holds 3n entries and every source and
            // destination range was checked inside `buf` on the host. Aliasing: no
            // destination overlaps another destination or any source (checked), so no
            // byte is both read and written and each written byte has one writer.
            unsafe { launch.launch(per_span(n, longest)) }.map_err(cuda("move_spans: launch"))?;
            Ok(())
        }

        fn translate(&self, args: &Translate) -> Result<(), Error> {
            let mut st = self.state();
            let v2p_len = st
                .table(args.v2p)
                .ok_or_else(|| self.unknown("table", args.v2p.0))?
                .len;
            let ids_len = st
                .table(args.ids)
                .ok_or_else(|| self.unknown("table", args.ids.0))?
                .len;
            let out_len = st
                .table(args.out)
                .ok_or_else(|| self.unknown("table", args.out.0))?
                .len;
            let (page_size, stride) = check::translate(args, ids_len, out_len)?;
            if args.out_width == 0 {
                return Ok(());
            }
            let out = args.out;
            // `out` differs from `v2p` and `ids` (checked): take it out of its slot.
            let mut out_slot = st.tables[out.0 as usize]
                .take()
                .ok_or_else(|| self.unknown("table", out.0))?;
            let result = (|| {
                let (v2p, ids) = match (st.table(args.v2p), st.table(args.ids)) {
                    (Some(v), Some(i)) => (v, i),
                    _ => return Err(self.unknown("table", args.v2p.0)),
                };
                let (v2p_len, n, out_width) =
                    (v2p_len as u64, args.n as u64, args.out_width as u64);
                let mut launch = self.stream.launch_builder(&self.kernels.translate);
                launch
                    .arg(&v2p.data)
                    .arg(&v2p_len)
                    .arg(&ids.data)
                    .arg(&n)
                    .arg(&page_size)
                    .arg(&stride)
                    .arg(&mut out_slot.data)
                    .arg(&out_width);
                // SAFETY: kernel `unikv_translate(const int* v2p, unsigned long long
                // v2p_len, const int* ids, unsigned long long n, int page_size, int
                // stride, int* out, unsigned long long out_width)`, arguments in that
                // order with matching types. Bounds: `ids` holds >= n and `out` >=
                // out_width entries (checked), `v2p` is read only below its true length,
                // page_size > 0 (checked, so no division by zero). Aliasing: `out` is a
                // different table from `v2p` and `ids` (checked); thread i writes only
                // out[i].
                unsafe { launch.launch(per_item(out_width)) }.map_err(cuda("translate: launch"))?;
                Ok(())
            })();
            st.tables[out.0 as usize] = Some(out_slot);
            result
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
            let t = st
                .table(table)
                .ok_or_else(|| self.unknown("table", table.0))?;
            check::table_range("read_table", table, offset, len, t.len)?;
            if len == 0 {
                return self.synchronize(sync).map(|()| Vec::new());
            }
            let view = t.data.slice(offset..offset + len); // in bounds: checked
            let values = self.stream.clone_dtoh(&view).map_err(cuda("read_table"))?;
            self.synchronize(sync)?;
            Ok(values)
        }

        fn read_bytes(
            &self,
            sync: &HostSync,
            buf: BytesId,
            offset: u64,
            len: u64,
        ) -> Result<Vec<u8>, Error> {
            let st = self.state();
            let b = st.bytes(buf).ok_or_else(|| self.unknown("bytes", buf.0))?;
            check::bytes_range("read_bytes", buf, offset, len, b.len as u64)?;
            if len == 0 {
                return self.synchronize(sync).map(|()| Vec::new());
            }
            // In bounds (checked), so both ends fit in usize.
            let view = b.data.slice(offset as usize..(offset + len) as usize);
            let values = self.stream.clone_dtoh(&view).map_err(cuda("read_bytes"))?;
            self.synchronize(sync)?;
            Ok(values)
        }

        fn synchronize(&self, _sync: &HostSync) -> Result<(), Error> {
            self.stream.synchronize().map_err(cuda("synchronize"))?;
            // Errors the driver reported from drops (stream-ordered frees) surface here.
            self.stream.context().check_err().map_err(cuda("deferred"))
        }
    }
}

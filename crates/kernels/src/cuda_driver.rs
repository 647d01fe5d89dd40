//! The real [`Driver`]: each call one CUDA driver API call through cudarc, on one stream.
//!
//! Without the `cuda` feature every entry point returns [`Error::NotCompiledWithCuda`].

#[cfg(not(feature = "cuda"))]
mod imp {
    use crate::Error;
    use crate::driver::Driver;
    use std::sync::Arc;

    pub(crate) fn open(ordinal: usize) -> Result<Arc<dyn Driver>, Error> {
        let _ = ordinal;
        Err(Error::NotCompiledWithCuda)
    }

    /// # Safety
    /// Nothing is done with `stream` in this build.
    pub(crate) unsafe fn open_on(
        ordinal: usize,
        stream: crate::driver::RawStream,
    ) -> Result<Arc<dyn Driver>, Error> {
        let _ = (ordinal, stream);
        Err(Error::NotCompiledWithCuda)
    }

    pub(crate) fn device_count() -> Result<usize, Error> {
        Err(Error::NotCompiledWithCuda)
    }

    pub(crate) fn driver_version() -> Result<(i32, i32), Error> {
        Err(Error::NotCompiledWithCuda)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use crate::Error;
    use crate::driver::{
        Arg, DevPtr, Driver, EventHandle, GraphHandle, Grid, Kernel, Pinned, StreamKind,
    };
    use crate::nvrtc;
    use cudarc::driver::sys::{self, CUresult};
    use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError, result};
    use std::ffi::c_void;
    use std::sync::{Arc, OnceLock};

    /// Whether the CUDA driver library can be loaded; asked once per process.
    fn driver_present() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        *PRESENT.get_or_init(|| {
            // SAFETY: `is_culib_present` only tries `dlopen` on the driver's library
            // names (and closes what it opened). Loading runs libcuda's initialisers,
            // which have no precondition on our side; no driver function is called.
            unsafe { sys::is_culib_present() }
        })
    }

    fn cuda(op: &'static str) -> impl Fn(DriverError) -> Error {
        move |e| Error::Cuda(format!("{op}: {e}"))
    }

    pub(crate) fn device_count() -> Result<usize, Error> {
        if !driver_present() {
            return Err(Error::NoCudaDriver);
        }
        match CudaContext::device_count() {
            Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
            Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
            Err(e) => Err(cuda("cuInit / device count")(e)),
        }
    }

    pub(crate) fn driver_version() -> Result<(i32, i32), Error> {
        if !driver_present() {
            return Err(Error::NoCudaDriver);
        }
        let mut version = 0;
        // SAFETY: libcuda is loadable (checked above), so the symbol lookup succeeds;
        // `cuDriverGetVersion` needs no `cuInit` and only writes one int through the
        // valid pointer we pass.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(cuda("cuDriverGetVersion"))?;
        Ok((version / 1000, version % 1000 / 10))
    }

    /// The CUDA driver on one stream of GPU `ordinal`'s primary context.
    struct CudaDriver {
        ordinal: usize,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        kind: StreamKind,
        /// Indexed like [`Kernel::ALL`].
        kernels: Vec<CudaFunction>,
        /// Whether the GPU has memory pools (`cuMemAllocAsync`).
        pools: bool,
    }

    // SAFETY: the driver API is thread-safe; every call binds the context first, and the
    // handles held (context, stream, functions) are valid from any thread.
    unsafe impl Send for CudaDriver {}
    // SAFETY: as for `Send`: no method mutates shared host state.
    unsafe impl Sync for CudaDriver {}

    pub(crate) fn open(ordinal: usize) -> Result<Arc<dyn Driver>, Error> {
        boot(ordinal, |ctx| {
            ctx.new_stream()
                .map(|s| (s, StreamKind::Own))
                .map_err(cuda("create a non-blocking stream"))
        })
    }

    /// # Safety
    /// `stream` is a valid stream of GPU `ordinal`'s primary context that outlives the
    /// driver (see [`CudaDevice::on_engine_stream`](crate::CudaDevice::on_engine_stream)).
    pub(crate) unsafe fn open_on(
        ordinal: usize,
        stream: crate::driver::RawStream,
    ) -> Result<Arc<dyn Driver>, Error> {
        boot(ordinal, |ctx| {
            let kind = if stream.is_null() {
                StreamKind::LegacyDefault
            } else {
                StreamKind::Engine
            };
            // SAFETY: the caller keeps `stream` valid, of this context, and alive for the
            // driver's life (this function's contract); the wrapper never destroys it.
            Ok((
                unsafe { ctx.wrap_borrowed_stream(stream as sys::CUstream) },
                kind,
            ))
        })
    }

    fn boot(
        ordinal: usize,
        stream: impl FnOnce(&Arc<CudaContext>) -> Result<(Arc<CudaStream>, StreamKind), Error>,
    ) -> Result<Arc<dyn Driver>, Error> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoCudaDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda("create context"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda("compute capability"))?;
        let arch = format!("compute_{major}{minor}");
        let mut kernels = Vec::with_capacity(Kernel::ALL.len());
        for kernel in Kernel::ALL {
            let file = kernel.file();
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
            let function = module
                .load_function(kernel.symbol())
                .map_err(|e| Error::Cuda(format!("{file}: kernel {}: {e}", kernel.symbol())))?;
            kernels.push(function);
        }
        let (stream, kind) = stream(&ctx)?;
        let pools = ctx.has_async_alloc();
        Ok(Arc::new(CudaDriver {
            ordinal,
            ctx,
            stream,
            kind,
            kernels,
            pools,
        }))
    }

    impl CudaDriver {
        /// Makes the context current on this thread (the raw calls below need it).
        fn bind(&self) -> Result<(), Error> {
            self.ctx.bind_to_thread().map_err(cuda("bind context"))
        }

        fn cu_stream(&self) -> sys::CUstream {
            self.stream.cu_stream()
        }

        fn oom(&self, bytes: usize) -> impl Fn(DriverError) -> Error + '_ {
            move |e| match e.0 {
                CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                    device: format!("cuda:{}", self.ordinal),
                    bytes: bytes as u64,
                },
                _ => Error::Cuda(format!("alloc of {bytes} bytes: {e}")),
            }
        }
    }

    impl Driver for CudaDriver {
        fn stream_kind(&self) -> StreamKind {
            self.kind
        }

        fn raw_stream(&self) -> usize {
            self.cu_stream() as usize
        }

        fn alloc(&self, bytes: usize) -> Result<DevPtr, Error> {
            self.bind()?;
            if self.pools {
                // SAFETY: the stream is valid for the driver's life; the memory is
                // returned uninitialised, as the trait says.
                unsafe { result::malloc_async(self.cu_stream(), bytes) }
            } else {
                // SAFETY: as above, without a stream.
                unsafe { result::malloc_sync(bytes) }
            }
            .map_err(self.oom(bytes))
        }

        fn free(&self, ptr: DevPtr) -> Result<(), Error> {
            self.bind()?;
            if self.pools {
                // SAFETY: `ptr` came from `alloc` and is freed once (the backend's
                // handle tables own it); the free is ordered after enqueued work.
                unsafe { result::free_async(ptr, self.cu_stream()) }
            } else {
                // SAFETY: as above; `cuMemFree` itself waits for work using `ptr`.
                unsafe { result::free_sync(ptr) }
            }
            .map_err(cuda("free"))
        }

        fn alloc_unordered(&self, bytes: usize) -> Result<DevPtr, Error> {
            self.bind()?;
            // SAFETY: a plain allocation, outside any stream (legal during a relaxed
            // capture); the memory is returned uninitialised, as the trait says.
            unsafe { result::malloc_sync(bytes) }.map_err(self.oom(bytes))
        }

        fn free_unordered(&self, ptr: DevPtr) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `ptr` came from `alloc_unordered` and is freed once (the backend
            // frees a graph's list once, after its fence reports every replay done).
            unsafe { result::free_sync(ptr) }.map_err(cuda("free"))
        }

        fn alloc_pinned(&self, bytes: usize) -> Result<Pinned, Error> {
            self.bind()?;
            // SAFETY: a plain page-locked allocation (flags 0) of `bytes`, freed once by
            // `free_pinned`.
            let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(self.oom(bytes))?;
            Ok(Pinned {
                addr: ptr as usize,
                len: bytes,
            })
        }

        fn free_pinned(&self, buf: Pinned) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `buf` came from `alloc_pinned` and is consumed here; the backend
            // frees a ring only after its fences report every copy from it done.
            unsafe { result::free_host(buf.addr as *mut c_void) }.map_err(cuda("free pinned"))
        }

        fn write_pinned(&self, buf: &Pinned, offset: usize, bytes: &[u8]) {
            debug_assert!(offset + bytes.len() <= buf.len);
            // SAFETY: `buf` is live pinned memory of `buf.len` bytes, and the backend
            // keeps `offset + bytes.len()` inside it and writes only ranges no
            // in-flight copy reads (its fences say so).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    (buf.addr as *mut u8).add(offset),
                    bytes.len(),
                )
            }
        }

        fn memset(&self, dst: DevPtr, value: u8, bytes: usize) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: the backend checked `[dst, dst + bytes)` inside one allocation.
            unsafe { result::memset_d8_async(dst, value, bytes, self.cu_stream()) }
                .map_err(cuda("memset"))
        }

        fn fill32(&self, dst: DevPtr, value: u32, count: usize) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: the backend checked `count` words at `dst` inside one allocation.
            unsafe { sys::cuMemsetD32Async(dst, value, count, self.cu_stream()) }
                .result()
                .map_err(cuda("memset d32"))
        }

        fn copy_from_pinned(
            &self,
            dst: DevPtr,
            buf: &Pinned,
            offset: usize,
            len: usize,
        ) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `[offset, offset + len)` is inside the live pinned `buf`, which
            // the backend leaves untouched until this copy's fence is done; `dst` has
            // room for `len` bytes (checked by the backend).
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst,
                    (buf.addr + offset) as *const c_void,
                    len,
                    self.cu_stream(),
                )
            }
            .result()
            .map_err(cuda("copy from pinned memory"))
        }

        fn copy_to_pinned(
            &self,
            buf: &Pinned,
            offset: usize,
            src: DevPtr,
            len: usize,
        ) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `[offset, offset + len)` is inside the live pinned `buf`, which the
            // backend keeps allocated, and neither reads nor writes on the host, until the
            // host buffer's fence event (recorded after this copy) is done or the stream
            // synchronised; `src` holds `len` bytes (checked by the backend).
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    (buf.addr + offset) as *mut c_void,
                    src,
                    len,
                    self.cu_stream(),
                )
            }
            .result()
            .map_err(cuda("copy to pinned memory"))
        }

        fn read_pinned(&self, buf: &Pinned, offset: usize, out: &mut [u8]) {
            debug_assert!(offset + out.len() <= buf.len);
            // SAFETY: `buf` is live pinned memory of `buf.len` bytes; the backend keeps
            // `offset + out.len()` inside it and synchronises the stream first, so no
            // copy writes the range meanwhile; `out` is a distinct host slice.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (buf.addr as *const u8).add(offset),
                    out.as_mut_ptr(),
                    out.len(),
                )
            }
        }

        fn copy_from_pageable(&self, dst: DevPtr, src: &[u8]) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `dst` has room for `src.len()` bytes (checked by the backend); for
            // pageable memory the driver stages `src` before returning.
            unsafe { result::memcpy_htod_async(dst, src, self.cu_stream()) }
                .map_err(cuda("copy from pageable memory"))
        }

        fn copy_to_host(&self, src: DevPtr, out: &mut [u8]) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `src` holds `out.len()` bytes (checked by the backend); the wait
            // below keeps `out` borrowed until the copy is done.
            unsafe { result::memcpy_dtoh_async(out, src, self.cu_stream()) }
                .map_err(cuda("copy to host"))?;
            self.synchronize()
        }

        fn launch(&self, kernel: Kernel, grid: Grid, args: &[Arg]) -> Result<(), Error> {
            self.bind()?;
            let index = Kernel::ALL.iter().position(|&k| k == kernel).unwrap_or(0);
            let mut values: Vec<Arg> = args.to_vec();
            let mut params: Vec<*mut c_void> = values
                .iter_mut()
                .map(|a| match a {
                    Arg::U64(v) => v as *mut u64 as *mut c_void,
                    Arg::I32(v) => v as *mut i32 as *mut c_void,
                    Arg::U8(v) => v as *mut u8 as *mut c_void,
                })
                .collect();
            // SAFETY: the function is the loaded `kernel`, and `args` follow its
            // parameter list in order and type (each call site states the signature);
            // the backend checked every pointer's range. `values` outlives the call,
            // which copies the parameters before returning.
            unsafe {
                result::launch_kernel(
                    self.kernels[index].cu_function(),
                    grid.blocks,
                    (grid.threads, 1, 1),
                    0,
                    self.cu_stream(),
                    &mut params,
                )
            }
            .map_err(|e| Error::Cuda(format!("launch {}: {e}", kernel.symbol())))
        }

        fn event_create(&self) -> Result<EventHandle, Error> {
            self.bind()?;
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(cuda("create an event"))?;
            Ok(EventHandle(event as usize))
        }

        fn event_create_timed(&self) -> Result<EventHandle, Error> {
            self.bind()?;
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(cuda("create a timed event"))?;
            Ok(EventHandle(event as usize))
        }

        fn event_elapsed(&self, start: EventHandle, end: EventHandle) -> Result<f32, Error> {
            self.bind()?;
            // SAFETY: both came from `event_create_timed` and are alive (the caller owns
            // them); the call never waits (an event not yet done is an error).
            unsafe { result::event::elapsed(start.0 as sys::CUevent, end.0 as sys::CUevent) }
                .map_err(cuda("read the time between two events"))
        }

        fn event_record(&self, event: EventHandle) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `event` came from `event_create` and is alive (the backend owns it).
            unsafe { result::event::record(event.0 as sys::CUevent, self.cu_stream()) }
                .map_err(cuda("record an event"))
        }

        fn event_done(&self, event: EventHandle) -> Result<bool, Error> {
            self.bind()?;
            // SAFETY: as for `event_record`; the query never waits.
            match unsafe { result::event::query(event.0 as sys::CUevent) } {
                Ok(()) => Ok(true),
                Err(DriverError(CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
                Err(e) => Err(cuda("query an event")(e)),
            }
        }

        fn event_wait(&self, event: EventHandle) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: the stream is valid; `event` is valid (the caller's contract);
            // waiting enqueues a dependency and does not block.
            unsafe {
                result::stream::wait_event(
                    self.cu_stream(),
                    event.0 as sys::CUevent,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(cuda("wait for an event"))
        }

        fn stream_wait_event(&self, stream: usize, event: EventHandle) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `stream` is a valid stream of this context or a special handle
            // (the caller's contract, `Device::make_stream_wait`), `event` came from
            // `event_create` and is alive; waiting enqueues a dependency, never blocks.
            unsafe {
                result::stream::wait_event(
                    stream as sys::CUstream,
                    event.0 as sys::CUevent,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(cuda("make a reader's stream wait for an event"))
        }

        fn ordinal(&self) -> Option<usize> {
            Some(self.ordinal)
        }

        fn event_destroy(&self, event: EventHandle) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `event` came from `event_create` and is destroyed once.
            unsafe { result::event::destroy(event.0 as sys::CUevent) }
                .map_err(cuda("destroy an event"))
        }

        fn synchronize(&self) -> Result<(), Error> {
            self.bind()?;
            self.stream.synchronize().map_err(cuda("synchronize"))?;
            // Errors the driver reported from stream-ordered frees surface here.
            self.ctx.check_err().map_err(cuda("deferred"))
        }

        fn capture_begin(&self) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: the stream is valid for the driver's life. Relaxed mode: other
            // threads' unrelated driver calls stay legal during the capture.
            unsafe {
                result::stream::begin_capture(
                    self.cu_stream(),
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                )
            }
            .map_err(cuda("begin a capture"))
        }

        fn capture_end(&self) -> Result<GraphHandle, Error> {
            self.bind()?;
            // SAFETY: the stream is valid and capturing (the backend began it).
            let graph = unsafe { result::stream::end_capture(self.cu_stream()) }
                .map_err(cuda("end a capture"))?;
            // SAFETY: `graph` was just captured; the executable copies it, so it is
            // destroyed right after.
            let exec =
                unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
            // SAFETY: as above; a failure only leaks the template.
            let _ = unsafe { result::graph::destroy(graph) };
            Ok(GraphHandle(
                exec.map_err(cuda("instantiate a graph"))? as usize
            ))
        }

        fn graph_launch(&self, graph: GraphHandle) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `graph` came from `capture_end` and is alive (the backend's
            // `CapturedGraph` owns it); the stream is valid.
            unsafe { result::graph::launch(graph.0 as sys::CUgraphExec, self.cu_stream()) }
                .map_err(cuda("launch a graph"))
        }

        fn graph_destroy(&self, graph: GraphHandle) -> Result<(), Error> {
            self.bind()?;
            // SAFETY: `graph` came from `capture_end` and is destroyed once.
            unsafe { result::graph::exec_destroy(graph.0 as sys::CUgraphExec) }
                .map_err(cuda("destroy a graph"))
        }

        fn peak_bandwidth(&self) -> Option<f64> {
            use sys::CUdevice_attribute as A;
            let khz = self
                .ctx
                .attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
                .ok()?;
            let bits = self
                .ctx
                .attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
                .ok()?;
            // Double data rate: two transfers per memory clock.
            Some(2.0 * f64::from(khz) * 1e3 * f64::from(bits) / 8.0)
        }
    }
}

pub(crate) use imp::*;

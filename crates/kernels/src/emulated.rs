//! An emulated CUDA driver: device memory, pinned memory, one stream and its events on
//! the host, so the CUDA backend's own logic (packing, staging, fences, checks) runs and
//! is tested without a GPU.
//!
//! Kernels run by their CPU twins, reading their arguments from emulated device memory
//! as the GPU would. The stream can be *stalled* ([`CudaDevice::stall_stream`](crate::CudaDevice::stall_stream)),
//! as if the GPU were busy with an engine's long kernel: enqueued work then waits in a
//! queue and runs, in order, when the stream is resumed or synchronised. A copy from
//! pinned memory reads the pinned bytes when it runs, not when it was enqueued, so a
//! backend that rewrote staging memory still in flight would copy the wrong bytes and
//! fail the parity tests, exactly as on a GPU. A copy into pinned memory (a host-tier
//! write-back) likewise reads the device and writes the pinned bytes when it runs: while
//! the stream is stalled they are not there, and an event recorded after it is not done.
//!
//! A kernel that reaches outside an allocation does not panic: like a GPU's illegal
//! address, it poisons the stream, and every later call returns the error.
//!
//! Spins keep a clock of one of two kinds ([`SpinClock`]): by default a spin lasts until
//! the stream is resumed or waited for (the no-sync proofs); a clocked emulation
//! ([`CudaDevice::emulated_clocked`](crate::CudaDevice::emulated_clocked)) runs a spin of
//! `cycles` for `cycles` nanoseconds of host time and then goes on by itself, and its
//! waits sleep until the spin ends, so an overlap loop sees a GPU that is busy for a
//! stated time. Either way an event keeps the (host) time the emulated stream reached
//! it, for [`Driver::event_elapsed`]; kernels other than spins take no time.

use crate::Error;
use crate::check;
use crate::driver::{
    Arg, DevPtr, Driver, EventHandle, GraphHandle, Grid, Kernel, LANE_WORDS, Pinned, StreamKind,
    WINDOW_WORDS,
};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Where emulated device addresses start (never 0, so a null pointer is never valid).
const BASE: DevPtr = 0x7000_0000_0000;
/// Emulated allocations are this aligned, like `cuMemAlloc`'s.
const ALIGN: u64 = 256;

/// Work waiting on the emulated stream.
#[derive(Clone, Debug)]
enum Work {
    Memset {
        dst: DevPtr,
        value: u8,
        bytes: usize,
    },
    Fill32 {
        dst: DevPtr,
        value: u32,
        count: usize,
    },
    CopyPinned {
        dst: DevPtr,
        pinned: usize,
        offset: usize,
        len: usize,
    },
    CopyBytes {
        dst: DevPtr,
        bytes: Vec<u8>,
    },
    /// A device-to-pinned copy (a write-back): reads the device bytes when it runs.
    CopyToPinned {
        src: DevPtr,
        pinned: usize,
        offset: usize,
        len: usize,
    },
    Launch {
        kernel: Kernel,
        args: Vec<Arg>,
    },
    Free {
        ptr: DevPtr,
    },
    /// The stream waits for another stream's event: always done here (one stream).
    Nothing,
    /// An event's record: keeps the time the stream reached it.
    Stamp {
        event: usize,
    },
}

/// How long an emulated spin lasts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum SpinClock {
    /// Until the stream is resumed or waited for.
    #[default]
    UntilResumed,
    /// Its `cycles` in nanoseconds of host time (a 1 GHz clock).
    Nanoseconds,
}

#[derive(Debug, Default)]
struct Emulation {
    memory: BTreeMap<DevPtr, Vec<u8>>,
    next: DevPtr,
    pinned: HashMap<usize, Vec<u8>>,
    next_pinned: usize,
    queue: VecDeque<Work>,
    /// Work items enqueued and executed so far (an event is done once `executed`
    /// reaches the count it was recorded at).
    enqueued: u64,
    executed: u64,
    events: HashMap<usize, u64>,
    next_event: usize,
    stalled: bool,
    /// Work captured since `capture_begin`, instead of run.
    capturing: Option<Vec<Work>>,
    graphs: HashMap<usize, Vec<Work>>,
    next_graph: usize,
    /// The sticky error of a faulted kernel.
    fault: Option<String>,
    clock: SpinClock,
    /// When the clocked spin the stream is in ends.
    busy_until: Option<Instant>,
    /// When the stream reached each recorded event.
    stamps: HashMap<usize, Instant>,
}

/// The emulated driver of [`CudaDevice::emulated`](crate::CudaDevice::emulated).
#[derive(Debug)]
pub(crate) struct EmulatedDriver {
    state: Mutex<Emulation>,
    stream: StreamKind,
}

impl EmulatedDriver {
    pub(crate) fn new(stream: StreamKind, clock: SpinClock) -> EmulatedDriver {
        EmulatedDriver {
            state: Mutex::new(Emulation {
                next: BASE,
                next_pinned: 1,
                next_event: 1,
                next_graph: 1,
                clock,
                ..Emulation::default()
            }),
            stream,
        }
    }

    /// The emulation, with a clocked spin that has ended by now run past.
    fn state(&self) -> MutexGuard<'_, Emulation> {
        // Every method leaves the emulation whole between statements that can panic.
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.tick();
        st
    }

    /// The emulation once the stream has nothing in flight: what a host wait sees
    /// (a clocked spin is slept out; any other ends).
    fn waited(&self) -> Result<MutexGuard<'_, Emulation>, Error> {
        loop {
            let mut st = self.state();
            match st.busy_until {
                Some(end) => {
                    drop(st);
                    std::thread::sleep(end.saturating_duration_since(Instant::now()));
                }
                None => {
                    st.stalled = false;
                    st.drain()?;
                    return Ok(st);
                }
            }
        }
    }

    /// Stalls the stream: work queues until [`EmulatedDriver::resume`] or a wait.
    pub(crate) fn stall(&self) {
        self.state().stalled = true;
    }

    /// Resumes a stalled stream (a clocked spin ends now) and runs what it queued.
    pub(crate) fn resume(&self) -> Result<(), Error> {
        let mut st = self.state();
        st.stalled = false;
        st.busy_until = None;
        st.drain()
    }

    fn enqueue(&self, work: Work) -> Result<(), Error> {
        let mut st = self.state();
        st.sticky()?;
        if let Some(captured) = &mut st.capturing {
            captured.push(work);
            return Ok(());
        }
        if let Work::Launch {
            kernel: Kernel::Spin,
            ..
        } = work
            && st.clock == SpinClock::UntilResumed
        {
            // It lasts until the stream is resumed (no clock to wait on).
            st.stalled = true;
        }
        st.queue.push_back(work);
        st.enqueued += 1;
        if st.stalled { Ok(()) } else { st.drain() }
    }
}

fn emulated(reason: String) -> Error {
    Error::Cuda(format!("emulated driver: {reason}"))
}

impl Emulation {
    fn sticky(&self) -> Result<(), Error> {
        match &self.fault {
            Some(f) => Err(emulated(f.clone())),
            None => Ok(()),
        }
    }

    fn drain(&mut self) -> Result<(), Error> {
        self.drain_from(Instant::now())
    }

    /// Runs the queue as a stream that reaches its front at `at`: a clocked spin moves
    /// the stream's time on by its cycles, and one that has not ended by now stalls it.
    fn drain_from(&mut self, mut at: Instant) -> Result<(), Error> {
        while let Some(work) = self.queue.pop_front() {
            self.executed += 1;
            match work {
                Work::Stamp { event } => {
                    self.stamps.insert(event, at);
                }
                Work::Launch {
                    kernel: Kernel::Spin,
                    args,
                } if self.clock == SpinClock::Nanoseconds => {
                    let cycles = match args.first() {
                        Some(Arg::U64(cycles)) => *cycles,
                        _ => 0,
                    };
                    at += Duration::from_nanos(cycles);
                    if at > Instant::now() {
                        self.busy_until = Some(at);
                        self.stalled = true;
                        break;
                    }
                }
                work => {
                    if self.fault.is_none()
                        && let Err(e) = self.run(work)
                    {
                        self.fault = Some(e);
                    }
                }
            }
        }
        self.sticky()
    }

    /// Ends a clocked spin whose time has come and runs the queue behind it from then.
    fn tick(&mut self) {
        if let Some(end) = self.busy_until
            && end <= Instant::now()
        {
            self.busy_until = None;
            self.stalled = false;
            // A fault is sticky: the next call that checks reports it.
            let _ = self.drain_from(end);
        }
    }

    /// The allocation holding `[ptr, ptr + len)`: its base and bytes.
    fn find(&mut self, ptr: DevPtr, len: u64) -> Result<(usize, &mut Vec<u8>), String> {
        let (&base, bytes) = self
            .memory
            .range_mut(..=ptr)
            .next_back()
            .ok_or_else(|| format!("illegal address {ptr:#x}"))?;
        let start = ptr - base;
        if start.saturating_add(len) > bytes.len() as u64 {
            return Err(format!(
                "illegal address: {len} bytes at {ptr:#x} reach past an allocation of {} bytes at {base:#x}",
                bytes.len()
            ));
        }
        Ok((start as usize, bytes))
    }

    fn read(&mut self, ptr: DevPtr, len: u64) -> Result<Vec<u8>, String> {
        let (start, bytes) = self.find(ptr, len)?;
        Ok(bytes[start..start + len as usize].to_vec())
    }

    fn write(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), String> {
        let (start, bytes) = self.find(ptr, data.len() as u64)?;
        bytes[start..start + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn words<const N: usize>(&mut self, ptr: DevPtr, count: u64) -> Result<Vec<[u8; N]>, String> {
        let raw = self.read(ptr, count * N as u64)?;
        Ok(raw
            .chunks_exact(N)
            .map(|c| c.try_into().unwrap_or([0; N]))
            .collect())
    }

    fn u64s(&mut self, ptr: DevPtr, count: u64) -> Result<Vec<u64>, String> {
        Ok(self
            .words::<8>(ptr, count)?
            .into_iter()
            .map(u64::from_le_bytes)
            .collect())
    }

    fn i32s(&mut self, ptr: DevPtr, count: u64) -> Result<Vec<i32>, String> {
        Ok(self
            .words::<4>(ptr, count)?
            .into_iter()
            .map(i32::from_le_bytes)
            .collect())
    }

    fn write_i32s(&mut self, ptr: DevPtr, values: &[i32]) -> Result<(), String> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(ptr, &bytes)
    }

    fn run(&mut self, work: Work) -> Result<(), String> {
        match work {
            Work::Memset { dst, value, bytes } => self.write(dst, &vec![value; bytes]),
            Work::Fill32 { dst, value, count } => self.write_i32s(dst, &vec![value as i32; count]),
            Work::CopyPinned {
                dst,
                pinned,
                offset,
                len,
            } => {
                let src = self
                    .pinned
                    .get(&pinned)
                    .and_then(|p| p.get(offset..offset + len))
                    .ok_or_else(|| format!("copy from unknown pinned memory {pinned}"))?
                    .to_vec();
                self.write(dst, &src)
            }
            Work::CopyBytes { dst, bytes } => self.write(dst, &bytes),
            Work::CopyToPinned {
                src,
                pinned,
                offset,
                len,
            } => {
                let data = self.read(src, len as u64)?;
                self.pinned
                    .get_mut(&pinned)
                    .and_then(|p| p.get_mut(offset..offset + len))
                    .ok_or_else(|| format!("copy into unknown pinned memory {pinned}"))?
                    .copy_from_slice(&data);
                Ok(())
            }
            Work::Launch { kernel, args } => self.launch(kernel, &args),
            Work::Free { ptr } => self
                .memory
                .remove(&ptr)
                .map(drop)
                .ok_or_else(|| format!("free of unknown address {ptr:#x}")),
            Work::Nothing => Ok(()),
            Work::Stamp { event } => {
                self.stamps.insert(event, Instant::now());
                Ok(())
            }
        }
    }

    /// One translation (`unikv_translate`'s arguments), by the shared scalar rule.
    #[allow(clippy::too_many_arguments)] // the kernel's own parameter list
    fn translate(
        &mut self,
        v2p: DevPtr,
        v2p_len: u64,
        ids: DevPtr,
        n: u64,
        page_size: i32,
        stride: i32,
        out: DevPtr,
        width: u64,
    ) -> Result<(), String> {
        let v2p = self.i32s(v2p, v2p_len)?;
        let ids = self.i32s(ids, n)?;
        let mut values = vec![0; width as usize];
        for (slot, &id) in values.iter_mut().zip(&ids) {
            *slot = check::translate_one(&v2p, id, page_size, stride);
        }
        self.write_i32s(out, &values)
    }

    /// Runs `kernel` by its CPU twin, reading every argument list from device memory.
    fn launch(&mut self, kernel: Kernel, args: &[Arg]) -> Result<(), String> {
        let u = |i: usize| match args.get(i) {
            Some(Arg::U64(v)) => Ok(*v),
            other => Err(format!("{kernel:?}: argument {i} is {other:?}, not a u64")),
        };
        match kernel {
            Kernel::Translate => {
                let i = |i: usize| match args.get(i) {
                    Some(Arg::I32(v)) => Ok(*v),
                    other => Err(format!("translate: argument {i} is {other:?}, not an int")),
                };
                self.translate(u(0)?, u(1)?, u(2)?, u(3)?, i(4)?, i(5)?, u(6)?, u(7)?)
            }
            Kernel::MoveSpans => {
                let (buf, list, n) = (u(0)?, u(1)?, u(2)?);
                let list = self.u64s(list, 3 * n)?;
                for m in list.chunks_exact(3) {
                    let (src, dst, len) = (m[0], m[1], m[2]);
                    let data = self.read(buf + src, len)?;
                    self.write(buf + dst, &data)?;
                }
                Ok(())
            }
            Kernel::FillSpans => {
                let (buf, list, n) = (u(0)?, u(1)?, u(2)?);
                let value = match args.get(3) {
                    Some(Arg::U8(v)) => *v,
                    other => return Err(format!("fill: argument 3 is {other:?}, not a byte")),
                };
                let list = self.u64s(list, 2 * n)?;
                for s in list.chunks_exact(2) {
                    self.write(buf + s[0], &vec![value; s[1] as usize])?;
                }
                Ok(())
            }
            Kernel::ScatterTables => {
                let (list, k, n) = (u(0)?, u(1)?, u(2)?);
                let tables = self.u64s(list, k)?;
                let triples = self.i32s(list + 8 * k, 3 * n)?;
                for t in triples.chunks_exact(3) {
                    let table = *tables
                        .get(t[0] as usize)
                        .ok_or_else(|| format!("scatter: table slot {} of {k}", t[0]))?;
                    self.write_i32s(table + 4 * u64::from(t[1] as u32), &[t[2]])?;
                }
                Ok(())
            }
            Kernel::TranslateMany => {
                let (list, count) = (u(0)?, u(1)?);
                for a in self.u64s(list, 8 * count)?.chunks_exact(8) {
                    self.translate(a[0], a[1], a[2], a[3], a[4] as i32, a[5] as i32, a[6], a[7])?;
                }
                Ok(())
            }
            Kernel::Spin => Ok(()),
            Kernel::TranslateWindows => {
                let (list, count) = (u(0)?, u(1)?);
                let words = WINDOW_WORDS;
                for a in self.u64s(list, words as u64 * count)?.chunks_exact(words) {
                    let (rows, batch, width) = (a[3], a[6], a[7]);
                    let v2p = self.i32s(a[0], a[1])?;
                    let ids = self.i32s(a[2], batch * rows)?;
                    let starts = self.i32s(a[4], batch)?;
                    let lens = match a[11] {
                        0 => vec![i32::MAX; batch as usize],
                        lens => self.i32s(lens, batch)?,
                    };
                    let scalars = (a[8] as i32, a[9] as i32);
                    let values: Vec<i32> = (0..batch * width)
                        .map(|i| {
                            let r = (i / width) as usize;
                            let row = &ids[r * rows as usize..][..rows as usize];
                            let j = (i % width) as usize;
                            let bias = a[5] as i32;
                            check::window_one(&v2p, row, starts[r], bias, lens[r], j, scalars)
                        })
                        .collect();
                    self.write_i32s(a[10], &values)?;
                }
                Ok(())
            }
            Kernel::TranslateLanes => {
                let (list, count) = (u(0)?, u(1)?);
                let words = LANE_WORDS;
                for a in self.u64s(list, words as u64 * count)?.chunks_exact(words) {
                    let (batch, lane_len, stride) = (a[8], a[4] as usize, a[9] as i32);
                    let v2p = self.i32s(a[0], a[1])?;
                    let rows = self.i32s(a[2], a[3])?;
                    let lanes = self.i32s(a[5], batch)?;
                    let firsts = match a[6] {
                        0 => vec![0; batch as usize],
                        firsts => self.i32s(firsts, batch)?,
                    };
                    let starts = self.i32s(a[7], batch + 1)?;
                    let mut out = self.i32s(a[10], a[11])?;
                    for r in 0..batch as usize {
                        let run = (lanes[r], firsts[r], starts[r], starts[r + 1]);
                        check::lane_run(lane_len, stride, &v2p, &rows, run, &mut out);
                    }
                    self.write_i32s(a[10], &out)?;
                }
                Ok(())
            }
            Kernel::GatherRows => {
                let (buf, total, batch, width) = (u(0)?, u(1)?, u(4)?, u(5)?);
                let ids = self.i32s(u(2)?, batch * width)?;
                let path = self.i32s(u(3)?, batch * width)?;
                let rows = check::TokenRows {
                    page_size: u(6)?,
                    per_token: u(7)?,
                    row_bytes: u(8)?,
                };
                let mut copies = Vec::new();
                let width = (width as usize).max(1); // 0: no launch
                for (ids, path) in ids.chunks(width).zip(path.chunks(width)) {
                    check::gathered_rows(rows, ids, path, total, |s, d, n| copies.push((s, d, n)));
                    // In order: a later copy may read what an earlier one wrote.
                    for (src, dst, len) in copies.drain(..) {
                        let data = self.read(buf + src, len)?;
                        self.write(buf + dst, &data)?;
                    }
                }
                Ok(())
            }
            Kernel::Gather => {
                let (src, src_len, indices, n, out) = (u(0)?, u(1)?, u(2)?, u(3)?, u(4)?);
                let src = self.i32s(src, src_len)?;
                let indices = self.i32s(indices, n)?;
                let values: Vec<i32> = indices
                    .iter()
                    .map(|&i| check::gather_one(&src, i))
                    .collect();
                self.write_i32s(out, &values)
            }
        }
    }
}

impl Driver for EmulatedDriver {
    fn stream_kind(&self) -> StreamKind {
        self.stream
    }

    fn raw_stream(&self) -> usize {
        0
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, Error> {
        let mut st = self.state();
        st.sticky()?;
        let mut memory = Vec::new();
        memory
            .try_reserve_exact(bytes)
            .map_err(|_| Error::OutOfMemory {
                device: "emulated-cuda".to_string(),
                bytes: bytes as u64,
            })?;
        memory.resize(bytes, 0xA5); // undefined contents: not zero, so a missing fill shows
        let ptr = st.next;
        st.next += (bytes as u64).div_ceil(ALIGN).max(1) * ALIGN;
        st.memory.insert(ptr, memory);
        Ok(ptr)
    }

    fn free(&self, ptr: DevPtr) -> Result<(), Error> {
        self.enqueue(Work::Free { ptr })
    }

    fn alloc_unordered(&self, bytes: usize) -> Result<DevPtr, Error> {
        // Emulated allocations are never stream-ordered (nothing is captured).
        self.alloc(bytes)
    }

    fn free_unordered(&self, ptr: DevPtr) -> Result<(), Error> {
        // At once, as `cuMemFree` once nothing uses the memory: a replay still queued
        // that reads it (a backend freeing too early) faults the stream when it runs.
        let mut st = self.state();
        st.sticky()?;
        match st.memory.remove(&ptr) {
            Some(_) => Ok(()),
            None => Err(emulated(format!("free of unknown address {ptr:#x}"))),
        }
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<Pinned, Error> {
        let mut st = self.state();
        let addr = st.next_pinned;
        st.next_pinned += 1;
        st.pinned.insert(addr, vec![0; bytes]);
        Ok(Pinned { addr, len: bytes })
    }

    fn free_pinned(&self, buf: Pinned) -> Result<(), Error> {
        self.state().pinned.remove(&buf.addr);
        Ok(())
    }

    fn write_pinned(&self, buf: &Pinned, offset: usize, bytes: &[u8]) {
        if offset + bytes.len() > buf.len {
            self.state().fault = Some(format!(
                "write of {} bytes at {offset} past pinned memory of {} bytes",
                bytes.len(),
                buf.len
            ));
        } else if let Some(p) = self.state().pinned.get_mut(&buf.addr) {
            p[offset..offset + bytes.len()].copy_from_slice(bytes);
        }
    }

    fn memset(&self, dst: DevPtr, value: u8, bytes: usize) -> Result<(), Error> {
        self.enqueue(Work::Memset { dst, value, bytes })
    }

    fn fill32(&self, dst: DevPtr, value: u32, count: usize) -> Result<(), Error> {
        self.enqueue(Work::Fill32 { dst, value, count })
    }

    fn copy_from_pinned(
        &self,
        dst: DevPtr,
        buf: &Pinned,
        offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        self.enqueue(Work::CopyPinned {
            dst,
            pinned: buf.addr,
            offset,
            len,
        })
    }

    fn copy_to_pinned(
        &self,
        buf: &Pinned,
        offset: usize,
        src: DevPtr,
        len: usize,
    ) -> Result<(), Error> {
        self.enqueue(Work::CopyToPinned {
            src,
            pinned: buf.addr,
            offset,
            len,
        })
    }

    fn read_pinned(&self, buf: &Pinned, offset: usize, out: &mut [u8]) {
        let mut st = self.state();
        match st
            .pinned
            .get(&buf.addr)
            .and_then(|p| p.get(offset..offset + out.len()))
        {
            Some(bytes) => out.copy_from_slice(bytes),
            None => {
                st.fault = Some(format!(
                    "read of {} bytes at {offset} outside pinned memory {} of {} bytes",
                    out.len(),
                    buf.addr,
                    buf.len
                ));
            }
        }
    }

    fn copy_from_pageable(&self, dst: DevPtr, src: &[u8]) -> Result<(), Error> {
        self.enqueue(Work::CopyBytes {
            dst,
            bytes: src.to_vec(),
        })
    }

    fn copy_to_host(&self, src: DevPtr, out: &mut [u8]) -> Result<(), Error> {
        let mut st = self.waited()?; // the host waits for everything, a spin included
        let data = st.read(src, out.len() as u64).map_err(emulated)?;
        out.copy_from_slice(&data);
        Ok(())
    }

    fn launch(&self, kernel: Kernel, grid: Grid, args: &[Arg]) -> Result<(), Error> {
        if grid.blocks.0 == 0 || grid.blocks.1 == 0 || grid.blocks.2 == 0 || grid.threads == 0 {
            return Err(emulated(format!("{kernel:?}: empty grid {grid:?}")));
        }
        self.enqueue(Work::Launch {
            kernel,
            args: args.to_vec(),
        })
    }

    fn event_create(&self) -> Result<EventHandle, Error> {
        let mut st = self.state();
        let id = st.next_event;
        st.next_event += 1;
        st.events.insert(id, 0);
        Ok(EventHandle(id))
    }

    fn event_create_timed(&self) -> Result<EventHandle, Error> {
        self.event_create()
    }

    fn event_elapsed(&self, start: EventHandle, end: EventHandle) -> Result<f32, Error> {
        let st = self.state();
        st.sticky()?;
        let stamp = |e: EventHandle| {
            st.stamps.get(&e.0).copied().ok_or_else(|| {
                emulated(format!(
                    "elapsed time of event {}, not done (or never recorded)",
                    e.0
                ))
            })
        };
        let (from, to) = (stamp(start)?, stamp(end)?);
        let ms = |d: Duration| d.as_secs_f32() * 1e3;
        Ok(if to >= from {
            ms(to - from)
        } else {
            -ms(from - to)
        })
    }

    fn event_record(&self, event: EventHandle) -> Result<(), Error> {
        let mut st = self.state();
        st.sticky()?;
        if !st.events.contains_key(&event.0) {
            return Err(emulated(format!("record of unknown event {}", event.0)));
        }
        st.stamps.remove(&event.0);
        // A stall alone holds only the work enqueued after it; a spin holds the stream.
        let behind = !st.queue.is_empty() || st.busy_until.is_some();
        if st.capturing.is_none() && behind {
            // The stream reaches it later: a stamp in the queue.
            st.queue.push_back(Work::Stamp { event: event.0 });
            st.enqueued += 1;
        } else if st.capturing.is_none() {
            st.stamps.insert(event.0, Instant::now());
        }
        let at = st.enqueued;
        st.events.insert(event.0, at);
        Ok(())
    }

    fn event_done(&self, event: EventHandle) -> Result<bool, Error> {
        let st = self.state();
        st.sticky()?;
        match st.events.get(&event.0) {
            Some(&mark) => Ok(st.executed >= mark),
            None => Err(emulated(format!("query of unknown event {}", event.0))),
        }
    }

    fn event_wait(&self, _event: EventHandle) -> Result<(), Error> {
        self.enqueue(Work::Nothing)
    }

    fn stream_wait_event(&self, _stream: usize, _event: EventHandle) -> Result<(), Error> {
        // The other stream is outside the emulation; the emulated stream is unaffected.
        self.state().sticky()
    }

    fn ordinal(&self) -> Option<usize> {
        None
    }

    fn event_destroy(&self, event: EventHandle) -> Result<(), Error> {
        let mut st = self.state();
        st.events.remove(&event.0);
        st.stamps.remove(&event.0);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), Error> {
        // A spin ends (a clocked one is slept out); the host waits for everything.
        self.waited().map(drop)
    }

    fn capture_begin(&self) -> Result<(), Error> {
        let mut st = self.state();
        st.sticky()?;
        if st.capturing.is_some() {
            return Err(emulated("the stream is already capturing".to_string()));
        }
        st.capturing = Some(Vec::new());
        Ok(())
    }

    fn capture_end(&self) -> Result<GraphHandle, Error> {
        let mut st = self.state();
        let work = st
            .capturing
            .take()
            .ok_or_else(|| emulated("end of a capture never begun".to_string()))?;
        let id = st.next_graph;
        st.next_graph += 1;
        st.graphs.insert(id, work);
        Ok(GraphHandle(id))
    }

    fn graph_launch(&self, graph: GraphHandle) -> Result<(), Error> {
        let work = self
            .state()
            .graphs
            .get(&graph.0)
            .cloned()
            .ok_or_else(|| emulated(format!("launch of unknown graph {}", graph.0)))?;
        work.into_iter().try_for_each(|w| self.enqueue(w))
    }

    fn graph_destroy(&self, graph: GraphHandle) -> Result<(), Error> {
        self.state().graphs.remove(&graph.0);
        Ok(())
    }

    fn peak_bandwidth(&self) -> Option<f64> {
        None
    }
}

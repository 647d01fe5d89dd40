//! The pinned staging ring's mechanics: a ring of pinned host memory and its device
//! mirror, written at its head, fenced by events and reused behind the fences the stream
//! is past (queried, never waited on); where there is no room, the fallback (a temporary
//! allocation and a pageable copy). [`CudaDevice::end_step`] grows it.

use super::{CudaDevice, State};
use crate::Error;
use crate::driver::{Arg, DevPtr, DriverCall, EventHandle, Grid, Kernel, Pinned};
use std::collections::VecDeque;

/// Staging ring bytes at boot: room for a step's lists at page size 1 (a 64 K-entry
/// scatter is 512 KiB).
pub const DEFAULT_STAGING_BYTES: usize = 4 << 20;

/// Fence events made at boot; more are made at a step boundary when a step used them all.
pub(super) const FENCES: usize = 64;

/// Staged lists are placed at this alignment (the kernels read 8- and 16-byte words).
pub(super) const STAGE_ALIGN: usize = 16;

/// The pinned staging ring and its device mirror. Positions are monotonic byte counts;
/// a position's place in the ring is `pos % cap`.
#[derive(Debug)]
pub(super) struct Ring {
    pub(super) host: Option<Pinned>,
    pub(super) dev: DevPtr,
    pub(super) cap: usize,
    /// Where the next list goes.
    head: u64,
    /// Every byte staged before this position has been consumed by the stream.
    tail: u64,
    /// In-flight fences, oldest first: (position the fence covers up to, its event).
    pub(super) fences: VecDeque<(u64, EventHandle)>,
}

impl Ring {
    /// A ring of no capacity: every op takes the fallback path.
    pub(super) fn empty() -> Ring {
        Ring {
            host: None,
            dev: 0,
            cap: 0,
            head: 0,
            tail: 0,
            fences: VecDeque::new(),
        }
    }
}

/// What an op's argument list holds, which decides whether a graph may capture it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ListKind {
    /// Per-step data (entries, values, spans, moves): refused during a capture, since a
    /// replay would reuse one step's data.
    Data,
    /// Table addresses and shapes (the fused translations): captured, it is staged into
    /// memory the graph owns, and every replay reads the tables as they are then.
    Descriptor,
}

/// Where an op's staged list landed.
pub(super) enum Staged {
    /// In the ring (fenced once the op has enqueued its work).
    Ring(DevPtr),
    /// In a temporary device allocation (the fallback), freed after the op's work.
    Temporary(DevPtr),
    /// Straight into the destination, through the ring.
    Copied,
    /// Straight into the destination, by a pageable copy (the fallback).
    CopiedPageable,
}

impl CudaDevice {
    /// A ring of `bytes` (none for `0`): pinned host memory and its device mirror.
    pub(super) fn make_ring(&self, op: &'static str, bytes: usize) -> Result<Ring, Error> {
        if bytes == 0 {
            return Ok(Ring::empty());
        }
        let cap = bytes.next_multiple_of(STAGE_ALIGN);
        let host = self.issue(op, DriverCall::PinnedAlloc { bytes: cap as u64 }, |d| {
            d.alloc_pinned(cap)
        })?;
        match self.issue(op, DriverCall::DeviceAlloc { bytes: cap as u64 }, |d| {
            d.alloc(cap)
        }) {
            Ok(dev) => Ok(Ring {
                host: Some(host),
                dev,
                cap,
                ..Ring::empty()
            }),
            Err(e) => {
                let _ = self.issue(op, DriverCall::PinnedFree, |d| d.free_pinned(host));
                Err(e)
            }
        }
    }

    /// Retires done fences of `ring` from the oldest, until the stream is known to be
    /// past `need` and a spare event exists (or no fence is left, or one is still
    /// pending).
    pub(super) fn retire(
        &self,
        ring: &mut Ring,
        spare: &mut Vec<EventHandle>,
        op: &'static str,
        need: u64,
    ) -> Result<(), Error> {
        while let Some(&(end, event)) = ring.fences.front() {
            if ring.tail >= need && !spare.is_empty() {
                break;
            }
            if !self.issue(op, DriverCall::EventQuery, |d| d.event_done(event))? {
                break;
            }
            ring.tail = end;
            spare.push(event);
            ring.fences.pop_front();
        }
        Ok(())
    }

    /// Frees retired rings the stream is past.
    pub(super) fn free_retired(&self, st: &mut State, op: &'static str) -> Result<(), Error> {
        let State { retired, spare, .. } = st;
        let mut i = 0;
        while i < retired.len() {
            let ring = &mut retired[i];
            self.retire(ring, spare, op, u64::MAX)?;
            if ring.fences.is_empty() {
                let ring = retired.swap_remove(i);
                if let Some(host) = ring.host {
                    self.issue(op, DriverCall::DeviceFree, |d| d.free(ring.dev))?;
                    self.issue(op, DriverCall::PinnedFree, |d| d.free_pinned(host))?;
                }
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Puts `st.pack` on the device: into `dst` when given, else into the ring's device
    /// mirror or (no room) a temporary allocation. The caller enqueues its work and then
    /// calls [`CudaDevice::finish`] with the result.
    pub(super) fn stage(
        &self,
        st: &mut State,
        op: &'static str,
        dst: Option<DevPtr>,
    ) -> Result<Staged, Error> {
        if st.capturing {
            return Err(Error::NotCapturable { op });
        }
        let len = st.pack.len();
        let span = len.next_multiple_of(STAGE_ALIGN);
        st.largest = st.largest.max(span);
        let State {
            ring,
            spare,
            pack,
            overflowed,
            ..
        } = st;
        if span <= ring.cap && ring.host.is_some() {
            let mut pos = ring.head;
            let place = (pos % ring.cap as u64) as usize;
            if place + span > ring.cap {
                pos += (ring.cap - place) as u64; // a list never wraps: skip to the start
            }
            let need = (pos + span as u64).saturating_sub(ring.cap as u64);
            self.retire(ring, spare, op, need)?;
            // A list needs room, not an event: one without a fence of its own is
            // covered by the next fence recorded ([`CudaDevice::finish`]).
            if let Some(host) = &ring.host
                && ring.tail >= need
            {
                let place = (pos % ring.cap as u64) as usize;
                self.driver.write_pinned(host, place, pack);
                let target = dst.unwrap_or(ring.dev + place as u64);
                self.issue(op, DriverCall::CopyFromPinned { bytes: len as u64 }, |d| {
                    d.copy_from_pinned(target, host, place, len)
                })?;
                ring.head = pos + span as u64;
                return Ok(match dst {
                    Some(_) => Staged::Copied,
                    None => Staged::Ring(target),
                });
            }
        }
        *overflowed = true;
        let copy = DriverCall::CopyFromPageable { bytes: len as u64 };
        match dst {
            Some(dst) => {
                self.issue(op, copy, |d| d.copy_from_pageable(dst, pack))?;
                Ok(Staged::CopiedPageable)
            }
            None => {
                let tmp = self.issue(op, DriverCall::DeviceAlloc { bytes: len as u64 }, |d| {
                    d.alloc(len)
                })?;
                if let Err(e) = self.issue(op, copy, |d| d.copy_from_pageable(tmp, pack)) {
                    let _ = self.issue(op, DriverCall::DeviceFree, |d| d.free(tmp));
                    return Err(e);
                }
                Ok(Staged::Temporary(tmp))
            }
        }
    }

    /// Ends an op that staged a list: fences the ring past it, or frees the temporary.
    pub(super) fn finish(
        &self,
        st: &mut State,
        op: &'static str,
        staged: Staged,
    ) -> Result<(), Error> {
        match staged {
            Staged::Ring(_) | Staged::Copied => self.fence_head(st, op),
            Staged::Temporary(tmp) => self.issue(op, DriverCall::DeviceFree, |d| d.free(tmp)),
            Staged::CopiedPageable => Ok(()),
        }
    }

    /// Fences the ring up to its head with a spare event. With none spare (more lists
    /// in flight than events, on a busy GPU) it records nothing: the next fence covers
    /// these lists too, since it follows them in stream order, and the step boundary
    /// makes more events and closes the ring's head.
    pub(super) fn fence_head(&self, st: &mut State, op: &'static str) -> Result<(), Error> {
        let head = st.ring.head;
        let fenced = st.ring.fences.back().map_or(st.ring.tail, |&(end, _)| end);
        if head <= fenced {
            return Ok(());
        }
        let Some(event) = st.spare.pop() else {
            return Ok(());
        };
        if let Err(e) = self.issue(op, DriverCall::EventRecord, |d| d.event_record(event)) {
            st.spare.push(event);
            return Err(e);
        }
        st.ring.fences.push_back((head, event));
        Ok(())
    }

    /// Stages `st.pack` and launches `kernel` with `args(list)`, the staged list's
    /// device address. The fence (or free) follows the launch even when it fails, since
    /// the copy before it was enqueued. During a capture a [`ListKind::Descriptor`] list
    /// is staged into memory the graph owns ([`CudaDevice::stage_for_graph`]) and a
    /// [`ListKind::Data`] list is refused.
    pub(super) fn launch_with_list(
        &self,
        st: &mut State,
        op: &'static str,
        list: ListKind,
        kernel: Kernel,
        grid: Grid,
        args: impl FnOnce(DevPtr) -> Vec<Arg>,
    ) -> Result<(), Error> {
        if st.capturing && list == ListKind::Descriptor {
            let list = self.stage_for_graph(st, op)?;
            let args = args(list);
            // A captured launch: the graph owns its list, so no fence.
            return self.issue(op, DriverCall::Launch { kernel, grid }, |d| {
                d.launch(kernel, grid, &args)
            });
        }
        let staged = self.stage(st, op, None)?;
        let list = match staged {
            Staged::Ring(p) | Staged::Temporary(p) => p,
            Staged::Copied | Staged::CopiedPageable => 0, // not reached: no destination given
        };
        let args = args(list);
        let launched = self.issue(op, DriverCall::Launch { kernel, grid }, |d| {
            d.launch(kernel, grid, &args)
        });
        let finished = self.finish(st, op, staged);
        launched.and(finished)
    }
}

//! The CUDA backend's host tier: pinned host-tier buffers, each with a fence event
//! recorded after every call that copies into or out of it; the stream-ordered copies
//! between them and the device's byte buffers; the events of
//! [`Device::record_copy_event`]. A buffer freed while its fence is pending is retired,
//! and released once the fence reports done, so no call here waits and no copy touches
//! freed memory.

use super::{CudaDevice, State};
use crate::check::{self, CopyInto};
use crate::driver::{DriverCall, EventHandle, Pinned};
use crate::{BytesId, CopyEvent, Device, Error, HostBytesId, HostCopy};

/// Zeroes written at a time into a new buffer (`cuMemHostAlloc` leaves its contents
/// undefined; [`Device::alloc_host`] promises zeros).
const ZERO_CHUNK: usize = 1 << 20;

/// A host-tier buffer: its pinned memory and its fence.
#[derive(Debug)]
pub(super) struct HostBuffer {
    /// The memory (at least one byte: CUDA refuses empty allocations).
    pub(super) pinned: Pinned,
    /// The buffer's length as the caller asked it.
    pub(super) len: u64,
    /// Recorded again after every call that copies into or out of the buffer, so it is
    /// done once every copy that uses the buffer is (a never-recorded event is done).
    pub(super) fence: EventHandle,
}

/// The non-empty copies of a call, each run of copies adjacent on both sides merged into
/// one (one driver call per run).
fn runs(copies: &[HostCopy]) -> impl Iterator<Item = HostCopy> + '_ {
    let mut copies = copies.iter().filter(|c| c.len > 0).copied().peekable();
    std::iter::from_fn(move || {
        let mut run = copies.next()?;
        // No overflow: every range was checked inside its buffer.
        while let Some(next) =
            copies.next_if(|c| c.device == run.device + run.len && c.host == run.host + run.len)
        {
            run.len += next.len;
        }
        Some(run)
    })
}

impl CudaDevice {
    /// [`Device::alloc_host`]: pinned memory, zero-filled, and its fence.
    pub(super) fn alloc_host_buffer(&self, len: u64) -> Result<HostBytesId, Error> {
        const OP: &str = "alloc_host";
        let n = usize::try_from(len).map_err(|_| Error::OutOfMemory {
            device: self.name(),
            bytes: len,
        })?;
        let mut st = self.state();
        st.hosts.next()?;
        self.release_retired_hosts(&mut st, OP)?;
        let size = n.max(1);
        let fence = self.issue(OP, DriverCall::EventCreate, |d| d.event_create())?;
        let alloc = DriverCall::PinnedAlloc { bytes: size as u64 };
        let pinned = match self.issue(OP, alloc, |d| d.alloc_pinned(size)) {
            Ok(pinned) => pinned,
            Err(e) => {
                let _ = self.issue(OP, DriverCall::EventDestroy, |d| d.event_destroy(fence));
                return Err(e);
            }
        };
        let zeros = vec![0; ZERO_CHUNK.min(size)];
        for at in (0..size).step_by(ZERO_CHUNK) {
            let n = ZERO_CHUNK.min(size - at);
            self.driver.write_pinned(&pinned, at, &zeros[..n]);
        }
        let buffer = HostBuffer { pinned, len, fence };
        Ok(HostBytesId(st.hosts.push(buffer)))
    }

    /// [`Device::free_host`]: released now when no copy still uses the buffer, retired
    /// (released at a later set-up call or step boundary) otherwise.
    pub(super) fn free_host_buffer(&self, host: HostBytesId) -> Result<(), Error> {
        const OP: &str = "free_host";
        let mut st = self.state();
        let fence = st.hosts.get(host.0)?.fence;
        let done = self.issue(OP, DriverCall::EventQuery, |d| d.event_done(fence))?;
        let buffer = st.hosts.take(host.0)?;
        if done {
            self.release_host(OP, buffer)?;
        } else {
            st.retired_hosts.push(buffer);
        }
        self.release_retired_hosts(&mut st, OP)
    }

    /// Releases the retired host buffers whose fence is done (a query each, no wait).
    pub(super) fn release_retired_hosts(
        &self,
        st: &mut State,
        op: &'static str,
    ) -> Result<(), Error> {
        let mut i = 0;
        while i < st.retired_hosts.len() {
            let fence = st.retired_hosts[i].fence;
            if self.issue(op, DriverCall::EventQuery, |d| d.event_done(fence))? {
                let buffer = st.retired_hosts.swap_remove(i);
                self.release_host(op, buffer)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Frees a host buffer no copy uses any more, and its fence.
    fn release_host(&self, op: &'static str, buffer: HostBuffer) -> Result<(), Error> {
        let fence = buffer.fence;
        let freed = self.issue(op, DriverCall::PinnedFree, |d| d.free_pinned(buffer.pinned));
        let destroyed = self.issue(op, DriverCall::EventDestroy, |d| d.event_destroy(fence));
        freed.and(destroyed)
    }

    /// [`Device::copy_device_to_host`] and [`Device::copy_host_to_device`]: checked, then
    /// one asynchronous copy per run and the buffer's fence recorded after them.
    pub(super) fn host_copies(
        &self,
        into: CopyInto,
        buf: BytesId,
        host: HostBytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        let op = into.op();
        let st = self.state();
        check::host_copies(
            into,
            buf,
            host,
            copies,
            |b| Ok(st.bytes.get(b.0)?.len as u64),
            |h| Ok(st.hosts.get(h.0)?.len),
        )?;
        if st.capturing {
            return Err(Error::NotCapturable { op });
        }
        let (dev, h) = (st.bytes.get(buf.0)?.ptr, st.hosts.get(host.0)?);
        let mut issued = false;
        for run in runs(copies) {
            // In bounds of both buffers (checked), so the offsets and length fit in usize.
            let (at, len) = (run.host as usize, run.len as usize);
            let (src_or_dst, bytes) = (dev + run.device, run.len);
            match into {
                CopyInto::Host => self.issue(op, DriverCall::CopyToPinned { bytes }, |d| {
                    d.copy_to_pinned(&h.pinned, at, src_or_dst, len)
                })?,
                CopyInto::Device => self.issue(op, DriverCall::CopyFromPinned { bytes }, |d| {
                    d.copy_from_pinned(src_or_dst, &h.pinned, at, len)
                })?,
            }
            issued = true;
        }
        if issued {
            let fence = h.fence;
            self.issue(op, DriverCall::EventRecord, |d| d.event_record(fence))?;
        }
        Ok(())
    }

    /// [`Device::record_copy_event`]: an event made and recorded on the stream.
    pub(super) fn record_copy_marker(&self) -> Result<CopyEvent, Error> {
        const OP: &str = "record_copy_event";
        let mut st = self.state();
        st.copy_events.next()?;
        if st.capturing {
            return Err(Error::NotCapturable { op: OP });
        }
        let event = self.issue(OP, DriverCall::EventCreate, |d| d.event_create())?;
        if let Err(e) = self.issue(OP, DriverCall::EventRecord, |d| d.event_record(event)) {
            let _ = self.issue(OP, DriverCall::EventDestroy, |d| d.event_destroy(event));
            return Err(e);
        }
        Ok(CopyEvent(st.copy_events.push(event)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(device: u64, host: u64, len: u64) -> HostCopy {
        HostCopy { device, host, len }
    }

    #[test]
    fn runs_merge_copies_adjacent_on_both_sides_and_drop_empty_ones() {
        let copies = [
            copy(0, 100, 8),
            copy(8, 108, 8),
            copy(16, 0, 0),
            copy(16, 116, 4),
            copy(20, 200, 4), // adjacent on the device only
            copy(64, 204, 4), // adjacent on the host only
            copy(40, 0, 2),
        ];
        let merged: Vec<HostCopy> = runs(&copies).collect();
        assert_eq!(
            merged,
            [
                copy(0, 100, 20),
                copy(20, 200, 4),
                copy(64, 204, 4),
                copy(40, 0, 2)
            ]
        );
    }
}

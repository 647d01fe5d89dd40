//! `CpuDevice`: the reference backend. Tables are host vectors and byte buffers (device
//! and host-tier alike) chunked host memory that costs only where bytes were written
//! (`cpu/sparse.rs`), behind one mutex; a handle is an index into them. Every op checks
//! all its arguments before it writes anything, so an op that returns an error has
//! changed nothing.

use crate::check::{self, CopyInto};
use crate::export::Exports;
use crate::handles::Handles;
use crate::{
    ByteSpan, BytesId, CopyEvent, Device, Error, ExportDevice, HostBytesId, HostCopy, HostSync,
    LaneTranslate, Readback, RowGather, SpanMove, TableExport, TableId, TableScatter, TableSpans,
    Translate, WindowTranslate,
};
use memory::filled;
use sparse::Buffer;
use std::sync::{Mutex, MutexGuard, PoisonError};

mod memory;
mod sparse;
#[cfg(test)]
mod tests;

/// The CPU reference backend: the semantics every other backend is compared against.
///
/// Work runs at once on the calling thread, so "stream order" is call order and
/// [`Readback::synchronize`] has nothing to wait for. Released handles are never handed
/// out again, so a stale handle is reported as [`Error::UnknownHandle`].
///
/// Host-tier buffers ([`Device::alloc_host`]) are chunked host memory like the device
/// buffers, so a host tier sized like a real one costs only the bytes copied into it;
/// copies run when they are issued, and a [`CopyEvent`] is complete when it is recorded.
#[derive(Debug)]
pub struct CpuDevice {
    state: Mutex<State>,
}

impl Default for CpuDevice {
    fn default() -> CpuDevice {
        CpuDevice {
            state: Mutex::new(State {
                bytes: Handles::new("bytes", "cpu"),
                tables: Handles::new("table", "cpu"),
                hosts: Handles::new("host bytes", "cpu"),
                events: Handles::new("copy event", "cpu"),
                exports: Exports::default(),
            }),
        }
    }
}

#[derive(Debug)]
struct State {
    bytes: Handles<Buffer>,
    /// Each table's entries. A table's vector is never resized (ops write in place, and
    /// `translate_lanes` takes it out and puts the same vector back), so its heap buffer,
    /// the address [`Device::export_table`] hands out, stays put until it is freed.
    tables: Handles<Vec<i32>>,
    /// Host-tier buffers.
    hosts: Handles<Buffer>,
    /// Recorded copy events (complete when recorded: there is nothing to remember).
    events: Handles<()>,
    /// Exported tables, and freed ones kept for a live export.
    exports: Exports<Vec<i32>>,
}
impl CpuDevice {
    /// A device with no buffers or tables.
    pub fn new() -> CpuDevice {
        CpuDevice::default()
    }

    /// Runs `kernel` over the bytes of `buf` on the calling thread: the CPU twin of a
    /// kernel launch, for an engine whose forward runs on this backend (an attention that
    /// reads K/V rows at the kernel ids of its step metadata and writes new ones). Work
    /// runs at issue here, so this is in stream order with every op before and after it
    /// and waits for nothing. It is not a [`Device`] op: code on the scheduling path holds
    /// a `dyn Device` and cannot reach it. `kernel` must not call back into this device
    /// (the buffer is borrowed for its run).
    pub fn run_kernel<R>(
        &self,
        buf: BytesId,
        kernel: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, Error> {
        let mut st = self.state();
        Ok(kernel(st.bytes_mut(buf)?.dense_mut()?))
    }

    /// Buffers (device and host-tier), tables and copy events allocated and not yet
    /// freed: what the device's users still hold on it (a leak check for tests; it walks
    /// every handle ever issued).
    pub fn live_allocations(&self) -> usize {
        let st = self.state();
        st.bytes.live() + st.tables.live() + st.hosts.live() + st.events.live()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Poisoning cannot leave the state half-written: every op validates all its
        // arguments before it writes, and the writes themselves do not panic. So a
        // poisoned lock still guards consistent data, and we keep using it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn bytes(&self, buf: BytesId) -> Result<&Buffer, Error> {
        self.bytes.get(buf.0)
    }

    fn bytes_mut(&mut self, buf: BytesId) -> Result<&mut Buffer, Error> {
        self.bytes.get_mut(buf.0)
    }

    fn host(&self, host: HostBytesId) -> Result<&Buffer, Error> {
        self.hosts.get(host.0)
    }

    fn table(&self, table: TableId) -> Result<&Vec<i32>, Error> {
        self.tables.get(table.0)
    }

    fn table_mut(&mut self, table: TableId) -> Result<&mut Vec<i32>, Error> {
        self.tables.get_mut(table.0)
    }
}

impl Device for CpuDevice {
    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn alloc_bytes(&self, len: u64, fill: u8) -> Result<BytesId, Error> {
        let mut st = self.state();
        st.bytes.next()?;
        let buf = Buffer::new(len, fill)?;
        Ok(BytesId(st.bytes.push(buf)))
    }

    fn alloc_table(&self, len: usize, fill: i32) -> Result<TableId, Error> {
        let mut st = self.state();
        st.tables.next()?;
        drop(st.exports.reap());
        let table = filled(len, fill)?;
        Ok(TableId(st.tables.push(table)))
    }

    fn free_bytes(&self, buf: BytesId) -> Result<(), Error> {
        self.state().bytes.remove(buf.0)
    }

    fn free_table(&self, table: TableId) -> Result<(), Error> {
        let mut st = self.state();
        let entries = st.tables.take(table.0)?;
        drop(st.exports.retire(table.0, entries));
        drop(st.exports.reap());
        Ok(())
    }

    fn export_table(&self, table: TableId) -> Result<TableExport, Error> {
        let mut st = self.state();
        let entries = st.table(table)?;
        let (address, len) = (entries.as_ptr() as u64, entries.len());
        Ok(TableExport {
            address,
            len,
            device: ExportDevice::Cpu,
            guard: st.exports.guard(table.0),
        })
    }

    fn upload_table(&self, table: TableId, offset: usize, values: &[i32]) -> Result<(), Error> {
        let mut st = self.state();
        let t = st.table_mut(table)?;
        check::table_range("upload_table", table, offset, values.len(), t.len())?;
        t[offset..offset + values.len()].copy_from_slice(values);
        Ok(())
    }

    fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), Error> {
        self.scatter_tables(&[TableScatter { table, entries }])
    }

    fn scatter_tables(&self, scatters: &[TableScatter<'_>]) -> Result<(), Error> {
        let mut st = self.state();
        check::scatters(scatters, |t| Ok(st.table(t)?.len()))?;
        for s in scatters {
            let t = st.table_mut(s.table)?;
            for &(i, v) in s.entries {
                t[i as usize] = v; // in order, so the last pair for an index wins
            }
        }
        Ok(())
    }

    fn copy_table_spans(&self, copies: &[TableSpans<'_>]) -> Result<(), Error> {
        let mut st = self.state();
        check::table_spans(copies, |t| Ok(st.table(t)?.len()))?;
        for c in copies {
            let t = st.table_mut(c.table)?;
            for &(start, len) in c.spans {
                let span = start as usize..(start + len) as usize;
                // A decode page's span is one entry: no copy call for it.
                match len {
                    1 => t[span.start] = c.values[span.start],
                    _ => t[span.clone()].copy_from_slice(&c.values[span]),
                }
            }
        }
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
        let indices_len = st.table(indices)?.len();
        let out_len = st.table(out)?.len();
        st.table(src)?;
        check::gather(src, (indices, indices_len), n, (out, out_len))?;
        let values: Vec<i32> = {
            let (src, indices) = (st.table(src)?, st.table(indices)?);
            indices[..n]
                .iter()
                .map(|&i| check::gather_one(src, i))
                .collect()
        };
        st.table_mut(out)?[..n].copy_from_slice(&values);
        Ok(())
    }

    fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], value: u8) -> Result<(), Error> {
        let mut st = self.state();
        let b = st.bytes_mut(buf)?;
        check::fill(buf, spans, b.len())?;
        for s in spans {
            b.fill(s.offset, s.len, value);
        }
        Ok(())
    }

    fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), Error> {
        let mut st = self.state();
        let b = st.bytes_mut(buf)?;
        check::moves(buf, moves, b.len())?;
        // No destination overlaps a source or another destination (checked), so each
        // move copies in place, in any order.
        for m in moves {
            b.copy(m.src, m.dst, m.len);
        }
        Ok(())
    }

    fn translate(&self, args: &Translate) -> Result<(), Error> {
        self.translate_many(std::slice::from_ref(args))
    }

    fn translate_many(&self, all: &[Translate]) -> Result<(), Error> {
        let mut st = self.state();
        let mut scalars = Vec::with_capacity(all.len());
        check::translates(all, |t| Ok(st.table(t)?.len()), |_, ps| scalars.push(ps))?;
        for (args, &(page_size, stride)) in all.iter().zip(&scalars) {
            let kernel_ids: Vec<i32> = {
                let (v2p, ids) = (st.table(args.v2p)?, st.table(args.ids)?);
                ids[..args.n]
                    .iter()
                    .map(|&id| check::translate_one(v2p, id, page_size, stride))
                    .collect()
            };
            let out = st.table_mut(args.out)?;
            out[..args.n].copy_from_slice(&kernel_ids);
            out[args.n..args.out_width].fill(0);
        }
        Ok(())
    }

    fn translate_windows(&self, all: &[WindowTranslate]) -> Result<(), Error> {
        let mut st = self.state();
        let scalars = check::windows(all, |t| Ok(st.table(t)?.len()))?;
        for (w, &scalars) in all.iter().zip(&scalars) {
            let values: Vec<i32> = {
                let (v2p, ids, starts) = (st.table(w.v2p)?, st.table(w.ids)?, st.table(w.starts)?);
                let lens = match w.lens {
                    Some((t, at)) => Some((st.table(t)?, at)),
                    None => None,
                };
                (0..w.batch * w.width)
                    .map(|i| {
                        let (r, j) = (i / w.width, i % w.width);
                        let row = &ids[w.ids_at + r * w.rows..][..w.rows];
                        let len = lens.map_or(i32::MAX, |(t, at)| t[at + r]);
                        let start = starts[w.starts_at + r];
                        check::window_one(v2p, row, start, w.bias, len, j, scalars)
                    })
                    .collect()
            };
            st.table_mut(w.out)?[w.out_at..][..values.len()].copy_from_slice(&values);
        }
        Ok(())
    }

    fn translate_lanes(&self, all: &[LaneTranslate]) -> Result<(), Error> {
        let mut st = self.state();
        let strides = check::lanes(all, |t| Ok(st.table(t)?.len()))?;
        for (t, &stride) in all.iter().zip(&strides) {
            // The per-request inputs (O(batch)) are copied: they may share the output's
            // table (in other ranges, checked), which is taken out while it is written.
            let lanes = st.table(t.lanes.0)?[t.lanes.1..][..t.batch].to_vec();
            let starts = st.table(t.starts.0)?[t.starts.1..][..t.batch + 1].to_vec();
            let firsts = match t.firsts {
                Some((f, at)) => st.table(f)?[at..][..t.batch].to_vec(),
                None => vec![0; t.batch],
            };
            // `out` is neither `v2p` nor `rows` (checked), so both stay readable.
            let mut out = std::mem::take(st.table_mut(t.out)?);
            let window = &mut out[t.out_at..][..t.out_len];
            let (v2p, rows) = (st.table(t.v2p)?, st.table(t.rows)?);
            for r in 0..t.batch {
                let run = (lanes[r], firsts[r], starts[r], starts[r + 1]);
                check::lane_run(t.lane_len, stride, v2p, rows, run, window);
            }
            *st.table_mut(t.out)? = out;
        }
        Ok(())
    }

    fn gather_rows(&self, all: &[RowGather]) -> Result<(), Error> {
        let mut st = self.state();
        check::row_gathers(all, |b| Ok(st.bytes(b)?.len()), |t| Ok(st.table(t)?.len()))?;
        for args in all {
            let n = args.batch * args.width; // checked
            if n == 0 {
                continue;
            }
            let ids = st.table(args.ids)?[args.ids_at..][..n].to_vec();
            let path = st.table(args.path)?[args.path_at..][..n].to_vec();
            let b = st.bytes_mut(args.buf)?;
            let total = b.len();
            for (ids, path) in ids.chunks(args.width).zip(path.chunks(args.width)) {
                check::gathered_rows(args.into(), ids, path, total, |src, dst, len| {
                    b.copy(src, dst, len)
                });
            }
        }
        Ok(())
    }

    fn alloc_host(&self, len: u64) -> Result<HostBytesId, Error> {
        let mut st = self.state();
        st.hosts.next()?;
        let buf = Buffer::new(len, 0)?;
        Ok(HostBytesId(st.hosts.push(buf)))
    }

    fn free_host(&self, host: HostBytesId) -> Result<(), Error> {
        self.state().hosts.remove(host.0)
    }

    fn copy_device_to_host(
        &self,
        buf: BytesId,
        host: HostBytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        self.host_copies(CopyInto::Host, buf, host, copies)
    }

    fn copy_host_to_device(
        &self,
        host: HostBytesId,
        buf: BytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        self.host_copies(CopyInto::Device, buf, host, copies)
    }

    fn record_copy_event(&self) -> Result<CopyEvent, Error> {
        let mut st = self.state();
        st.events.next()?;
        Ok(CopyEvent(st.events.push(())))
    }

    fn copy_event_done(&self, event: CopyEvent) -> Result<bool, Error> {
        // Every op ran when it was issued.
        self.state().events.get(event.0).map(|()| true)
    }

    fn free_copy_event(&self, event: CopyEvent) -> Result<(), Error> {
        self.state().events.remove(event.0)
    }
}

impl CpuDevice {
    /// The host-tier ops of [`Device`], here so the trait impl above stays about the
    /// device's own buffers and tables.
    fn host_copies(
        &self,
        into: CopyInto,
        buf: BytesId,
        host: HostBytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        let mut st = self.state();
        check::host_copies(
            into,
            buf,
            host,
            copies,
            |b| Ok(st.bytes(b)?.len()),
            |h| Ok(st.host(h)?.len()),
        )?;
        let State { bytes, hosts, .. } = &mut *st;
        let (device, host) = (bytes.get_mut(buf.0)?, hosts.get_mut(host.0)?);
        // Destinations do not overlap (checked) and sources are the other buffer, so the
        // copies commute.
        for c in copies.iter().filter(|c| c.len > 0) {
            match into {
                CopyInto::Host => host.copy_from(c.host, device, c.device, c.len),
                CopyInto::Device => device.copy_from(c.device, host, c.host, c.len),
            }
        }
        Ok(())
    }
}

impl Readback for CpuDevice {
    fn read_table(
        &self,
        _sync: &HostSync,
        table: TableId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<i32>, Error> {
        let st = self.state();
        let t = st.table(table)?;
        check::table_range("read_table", table, offset, len, t.len())?;
        Ok(t[offset..offset + len].to_vec())
    }

    fn read_bytes(
        &self,
        _sync: &HostSync,
        buf: BytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        let st = self.state();
        let b = st.bytes(buf)?;
        check::bytes_range("read_bytes", buf, offset, len, b.len())?;
        b.read(offset, len)
    }

    fn synchronize(&self, _sync: &HostSync) -> Result<(), Error> {
        Ok(())
    }

    fn read_host(
        &self,
        _sync: &HostSync,
        host: HostBytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        let st = self.state();
        let h = st.host(host)?;
        check::host_range("read_host", host, offset, len, h.len())?;
        h.read(offset, len)
    }
}

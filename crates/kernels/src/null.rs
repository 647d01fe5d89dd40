//! `NullDevice`: a device that keeps no bytes, for bookkeeping-only runs at any size.

use crate::check::{self, CopyInto};
use crate::handles::Handles;
use crate::{
    ByteSpan, BytesId, CopyEvent, Device, Error, HostBytesId, HostCopy, HostSync, LaneTranslate,
    Readback, RowGather, SpanMove, TableId, TableScatter, TableSpans, Translate, WindowTranslate,
};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A device that stores nothing: it remembers only each buffer's and table's length, and
/// accepts every op whose arguments pass the same host-side checks as on [`CpuDevice`]
/// (bounds, overlapping moves, translate's shapes), then does nothing. So a run of the
/// allocator against a real model's budget (80 GiB) costs only its host tables, and the
/// time it takes is the host's bookkeeping and those checks alone.
///
/// Reads come back as zeros of the length asked (nothing was kept): this device is for
/// measuring and sizing runs, not for checking data; the byte-keeping [`CpuDevice`] is.
/// Host-tier buffers are lengths too, checked like device buffers, and copy events are
/// complete when recorded.
///
/// ```
/// use unikv_kernels::{Device, HostSync, NullDevice, Readback, SpanMove};
///
/// let dev = NullDevice::new();
/// let buf = dev.alloc_bytes(80 << 30, 0).unwrap(); // 80 GiB, no memory taken
/// dev.move_spans(buf, &[SpanMove { src: 0, dst: 1 << 30, len: 4096 }]).unwrap();
/// assert!(dev.move_spans(buf, &[SpanMove { src: 0, dst: 80 << 30, len: 1 }]).is_err());
/// let sync = HostSync::acquire("doc example");
/// assert_eq!(dev.read_bytes(&sync, buf, 1 << 30, 2).unwrap(), [0, 0]);
/// ```
///
/// [`CpuDevice`]: crate::CpuDevice
#[derive(Debug)]
pub struct NullDevice {
    state: Mutex<Lengths>,
}

#[derive(Debug)]
struct Lengths {
    bytes: Handles<u64>,
    tables: Handles<usize>,
    hosts: Handles<u64>,
    events: Handles<()>,
}

impl Default for NullDevice {
    fn default() -> NullDevice {
        NullDevice {
            state: Mutex::new(Lengths {
                bytes: Handles::new("bytes", "none"),
                tables: Handles::new("table", "none"),
                hosts: Handles::new("host bytes", "none"),
                events: Handles::new("copy event", "none"),
            }),
        }
    }
}

impl NullDevice {
    /// A device with no buffers or tables.
    pub fn new() -> NullDevice {
        NullDevice::default()
    }

    fn state(&self) -> MutexGuard<'_, Lengths> {
        // Every op checks before it records anything: a poisoned lock guards whole data.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bytes_len(&self, buf: BytesId) -> Result<u64, Error> {
        self.state().bytes.get(buf.0).copied()
    }

    fn table_len(&self, table: TableId) -> Result<usize, Error> {
        self.state().tables.get(table.0).copied()
    }

    fn host_len(&self, host: HostBytesId) -> Result<u64, Error> {
        self.state().hosts.get(host.0).copied()
    }

    fn host_copies(
        &self,
        into: CopyInto,
        buf: BytesId,
        host: HostBytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        check::host_copies(
            into,
            buf,
            host,
            copies,
            |b| self.bytes_len(b),
            |h| self.host_len(h),
        )
    }
}

impl Device for NullDevice {
    fn name(&self) -> String {
        "none".to_string()
    }

    fn holds_bytes(&self) -> bool {
        false
    }

    fn alloc_bytes(&self, len: u64, _fill: u8) -> Result<BytesId, Error> {
        let mut st = self.state();
        st.bytes.next()?;
        Ok(BytesId(st.bytes.push(len)))
    }

    fn alloc_table(&self, len: usize, _fill: i32) -> Result<TableId, Error> {
        let mut st = self.state();
        st.tables.next()?;
        Ok(TableId(st.tables.push(len)))
    }

    fn free_bytes(&self, buf: BytesId) -> Result<(), Error> {
        self.state().bytes.remove(buf.0)
    }

    fn free_table(&self, table: TableId) -> Result<(), Error> {
        self.state().tables.remove(table.0)
    }

    fn upload_table(&self, table: TableId, offset: usize, values: &[i32]) -> Result<(), Error> {
        let len = self.table_len(table)?;
        check::table_range("upload_table", table, offset, values.len(), len)
    }

    fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), Error> {
        self.scatter_tables(&[TableScatter { table, entries }])
    }

    fn scatter_tables(&self, scatters: &[TableScatter<'_>]) -> Result<(), Error> {
        check::scatters(scatters, |t| self.table_len(t))
    }

    fn copy_table_spans(&self, copies: &[TableSpans<'_>]) -> Result<(), Error> {
        check::table_spans(copies, |t| self.table_len(t))
    }

    fn gather_table(
        &self,
        src: TableId,
        indices: TableId,
        n: usize,
        out: TableId,
    ) -> Result<(), Error> {
        self.table_len(src)?;
        let indices = (indices, self.table_len(indices)?);
        check::gather(src, indices, n, (out, self.table_len(out)?))
    }

    fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], _value: u8) -> Result<(), Error> {
        check::fill(buf, spans, self.bytes_len(buf)?)
    }

    fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), Error> {
        check::moves(buf, moves, self.bytes_len(buf)?)
    }

    fn translate(&self, args: &Translate) -> Result<(), Error> {
        self.translate_many(std::slice::from_ref(args))
    }

    fn translate_many(&self, all: &[Translate]) -> Result<(), Error> {
        check::translates(all, |t| self.table_len(t), |_, _| {})
    }

    fn translate_windows(&self, all: &[WindowTranslate]) -> Result<(), Error> {
        check::windows(all, |t| self.table_len(t)).map(drop)
    }

    fn gather_rows(&self, all: &[RowGather]) -> Result<(), Error> {
        check::row_gathers(all, |b| self.bytes_len(b), |t| self.table_len(t))
    }

    fn translate_lanes(&self, all: &[LaneTranslate]) -> Result<(), Error> {
        check::lanes(all, |t| self.table_len(t)).map(drop)
    }

    fn alloc_host(&self, len: u64) -> Result<HostBytesId, Error> {
        let mut st = self.state();
        st.hosts.next()?;
        Ok(HostBytesId(st.hosts.push(len)))
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
        self.state().events.get(event.0).map(|()| true)
    }

    fn free_copy_event(&self, event: CopyEvent) -> Result<(), Error> {
        self.state().events.remove(event.0)
    }
}

impl Readback for NullDevice {
    fn read_table(
        &self,
        _sync: &HostSync,
        table: TableId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<i32>, Error> {
        check::table_range("read_table", table, offset, len, self.table_len(table)?)?;
        Ok(vec![0; len])
    }

    fn read_bytes(
        &self,
        _sync: &HostSync,
        buf: BytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        check::bytes_range("read_bytes", buf, offset, len, self.bytes_len(buf)?)?;
        Ok(vec![0; len as usize])
    }

    fn read_host(
        &self,
        _sync: &HostSync,
        host: HostBytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        check::host_range("read_host", host, offset, len, self.host_len(host)?)?;
        Ok(vec![0; len as usize])
    }

    fn synchronize(&self, _sync: &HostSync) -> Result<(), Error> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuDevice;

    /// One op, run on either device.
    type Op = Box<dyn Fn(&dyn Device) -> Result<(), Error>>;

    /// The same op on both devices is refused alike or accepted by both.
    #[test]
    fn checks_agree_with_the_cpu_device() {
        let (cpu, none) = (CpuDevice::new(), NullDevice::new());
        let devs: [&dyn Device; 2] = [&cpu, &none];
        let ids: Vec<_> = devs
            .iter()
            .map(|d| (d.alloc_bytes(64, 0).unwrap(), d.alloc_table(8, 0).unwrap()))
            .collect();
        assert_eq!(ids[0], ids[1]);
        let (buf, table) = ids[0];
        let verdicts = |op: &Op| {
            devs.map(|d| op(d).map_err(|e| format!("{e:?}").replace("\"cpu\"", "\"none\"")))
        };
        let ops: Vec<Op> = vec![
            Box::new(move |d| {
                d.move_spans(
                    buf,
                    &[SpanMove {
                        src: 0,
                        dst: 16,
                        len: 16,
                    }],
                )
            }),
            Box::new(move |d| {
                d.move_spans(
                    buf,
                    &[SpanMove {
                        src: 0,
                        dst: 8,
                        len: 16,
                    }],
                )
            }),
            Box::new(move |d| {
                d.move_spans(
                    buf,
                    &[SpanMove {
                        src: 0,
                        dst: 60,
                        len: 8,
                    }],
                )
            }),
            Box::new(move |d| d.fill_spans(buf, &[ByteSpan { offset: 60, len: 8 }], 1)),
            Box::new(move |d| d.scatter_table(table, &[(7, 1)])),
            Box::new(move |d| d.scatter_table(table, &[(8, 1)])),
            Box::new(move |d| {
                d.copy_table_spans(&[TableSpans {
                    table,
                    values: &[0; 8],
                    spans: &[(0, 2), (6, 2)],
                }])
            }),
            Box::new(move |d| {
                d.copy_table_spans(&[TableSpans {
                    table,
                    values: &[0; 16],
                    spans: &[(6, 3)],
                }])
            }),
            Box::new(move |d| {
                d.copy_table_spans(&[TableSpans {
                    table,
                    values: &[0; 4],
                    spans: &[(3, 2)],
                }])
            }),
            Box::new(move |d| d.upload_table(table, 4, &[1, 2, 3, 4, 5])),
            Box::new(move |d| d.free_table(TableId(9))),
        ];
        // A verify step's window translations and row gather, well-formed and not.
        let window = WindowTranslate {
            v2p: table,
            ids: table,
            ids_at: 0,
            rows: 4,
            starts: table,
            starts_at: 6,
            bias: 0,
            lens: None,
            batch: 2,
            width: 2,
            page_size: 1,
            stride: 1,
            out: table,
            out_at: 0,
        };
        let out = devs.map(|d| d.alloc_table(8, 0).unwrap())[0];
        let gather = RowGather {
            buf,
            ids: table,
            ids_at: 0,
            path: table,
            path_at: 4,
            batch: 2,
            width: 2,
            page_size: 4,
            rows_per_token: 2,
            row_bytes: 4,
        };
        let verify: [Op; 8] = [
            Box::new(move |d| d.translate_windows(&[WindowTranslate { out, ..window }])),
            Box::new(move |d| {
                d.translate_windows(&[WindowTranslate {
                    out,
                    lens: Some((table, 7)),
                    ..window
                }])
            }),
            Box::new(move |d| d.translate_windows(&[window])),
            Box::new(move |d| {
                d.translate_windows(&[WindowTranslate {
                    out,
                    batch: 3,
                    ..window
                }])
            }),
            Box::new(move |d| {
                d.translate_windows(&[WindowTranslate {
                    out,
                    out_at: 5,
                    ..window
                }])
            }),
            Box::new(move |d| d.gather_rows(&[gather])),
            Box::new(move |d| d.gather_rows(&[RowGather { width: 3, ..gather }])),
            Box::new(move |d| {
                d.gather_rows(&[RowGather {
                    page_size: 0,
                    ..gather
                }])
            }),
        ];
        // A step's lane translation, then one malformed call per refusal of `check::lanes`:
        // no lanes, a stride past i32, short starts, an output over the starts, `v2p` as
        // the output, two outputs that overlap.
        let lane = LaneTranslate {
            v2p: table,
            rows: table,
            lane_len: 2,
            lanes: (out, 0),
            firsts: Some((out, 2)),
            starts: (out, 4),
            batch: 2,
            stride: 1,
            out,
            out_at: 7,
            out_len: 1,
        };
        let lanes: [Op; 7] = [
            Box::new(move |d| d.translate_lanes(&[lane])),
            Box::new(move |d| {
                d.translate_lanes(&[LaneTranslate {
                    lane_len: 0,
                    ..lane
                }])
            }),
            Box::new(move |d| {
                d.translate_lanes(&[LaneTranslate {
                    stride: u32::MAX,
                    ..lane
                }])
            }),
            Box::new(move |d| {
                d.translate_lanes(&[LaneTranslate {
                    starts: (out, 6),
                    ..lane
                }])
            }),
            Box::new(move |d| {
                d.translate_lanes(&[LaneTranslate {
                    out_at: 6,
                    out_len: 2,
                    ..lane
                }])
            }),
            Box::new(move |d| {
                d.translate_lanes(&[LaneTranslate {
                    out: table,
                    out_at: 0,
                    ..lane
                }])
            }),
            Box::new(move |d| {
                d.translate_lanes(&[
                    lane,
                    LaneTranslate {
                        lanes: (table, 0),
                        firsts: None,
                        starts: (table, 0),
                        ..lane
                    },
                ])
            }),
        ];
        let ops: Vec<Op> = ops.into_iter().chain(verify).collect();
        for op in &ops {
            let [a, b] = verdicts(op);
            assert_eq!(a, b);
        }
        // The well-formed lane call is accepted by both, each malformed one refused alike.
        for (k, op) in lanes.iter().enumerate() {
            let [a, b] = verdicts(op);
            assert_eq!(a, b, "lane call {k}");
            assert_eq!(a.is_ok(), k == 0, "lane call {k}: {a:?}");
        }
        assert_eq!(none.name(), "none");
    }
}

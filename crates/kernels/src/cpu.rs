//! `CpuDevice`: the reference backend. Tables are host vectors and byte buffers chunked
//! host memory that costs only where bytes were written (`sparse.rs`), behind one mutex;
//! a handle is an index into them. Every op checks all its arguments before it
//! writes anything, so an op that returns an error has changed nothing.

use crate::check;
use crate::handles::Handles;
use crate::sparse::Buffer;
use crate::{
    ByteSpan, BytesId, Device, Error, HostSync, LaneTranslate, Readback, RowGather, SpanMove,
    TableId, TableScatter, TableSpans, Translate, WindowTranslate,
};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The CPU reference backend: the semantics every other backend is compared against.
///
/// Work runs at once on the calling thread, so "stream order" is call order and
/// [`Readback::synchronize`] has nothing to wait for. Released handles are never handed
/// out again, so a stale handle is reported as [`Error::UnknownHandle`].
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
            }),
        }
    }
}

#[derive(Debug)]
struct State {
    bytes: Handles<Buffer>,
    tables: Handles<Vec<i32>>,
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

    /// Buffers and tables allocated and not yet freed: what the device's users still hold
    /// on it (a leak check for tests; it walks every handle ever issued).
    pub fn live_allocations(&self) -> usize {
        let st = self.state();
        st.bytes.live() + st.tables.live()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Poisoning cannot leave the state half-written: every op validates all its
        // arguments before it writes, and the writes themselves do not panic. So a
        // poisoned lock still guards consistent data, and we keep using it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn out_of_memory(bytes: u64) -> Error {
    Error::OutOfMemory {
        device: "cpu".to_string(),
        bytes,
    }
}

impl State {
    fn bytes(&self, buf: BytesId) -> Result<&Buffer, Error> {
        self.bytes.get(buf.0)
    }

    fn bytes_mut(&mut self, buf: BytesId) -> Result<&mut Buffer, Error> {
        self.bytes.get_mut(buf.0)
    }

    fn table(&self, table: TableId) -> Result<&Vec<i32>, Error> {
        self.tables.get(table.0)
    }

    fn table_mut(&mut self, table: TableId) -> Result<&mut Vec<i32>, Error> {
        self.tables.get_mut(table.0)
    }
}

/// A vector of `len` copies of `fill`, or an error instead of an abort when the host
/// cannot allocate it.
pub(crate) fn filled<T: Copy>(len: usize, fill: T) -> Result<Vec<T>, Error> {
    let bytes = (len as u64).saturating_mul(size_of::<T>() as u64);
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| out_of_memory(bytes))?;
    v.resize(len, fill);
    Ok(v)
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
        let table = filled(len, fill)?;
        Ok(TableId(st.tables.push(table)))
    }

    fn free_bytes(&self, buf: BytesId) -> Result<(), Error> {
        self.state().bytes.remove(buf.0)
    }

    fn free_table(&self, table: TableId) -> Result<(), Error> {
        self.state().tables.remove(table.0)
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use unikv_invariants::testing::page_sizes;

    fn sync() -> HostSync {
        HostSync::acquire("cpu backend unit test")
    }

    fn table(dev: &CpuDevice, values: &[i32]) -> TableId {
        let t = dev.alloc_table(values.len(), 0).unwrap();
        dev.upload_table(t, 0, values).unwrap();
        t
    }

    fn read(dev: &CpuDevice, t: TableId) -> Vec<i32> {
        let len = dev.state().table(t).unwrap().len();
        dev.read_table(&sync(), t, 0, len).unwrap()
    }

    fn bytes(dev: &CpuDevice, b: BytesId) -> Vec<u8> {
        let len = dev.state().bytes(b).unwrap().len();
        dev.read_bytes(&sync(), b, 0, len).unwrap()
    }

    #[test]
    fn alloc_fills_and_free_makes_the_handle_unknown() {
        let dev = CpuDevice::new();
        let b = dev.alloc_bytes(5, 0xAB).unwrap();
        let t = dev.alloc_table(3, -1).unwrap();
        assert_eq!(dev.live_allocations(), 2);
        assert_eq!(bytes(&dev, b), vec![0xAB; 5]);
        assert_eq!(read(&dev, t), vec![-1; 3]);
        dev.free_bytes(b).unwrap();
        assert_eq!(dev.live_allocations(), 1);
        dev.free_table(t).unwrap();
        assert_eq!(dev.live_allocations(), 0);
        assert!(matches!(
            dev.free_bytes(b),
            Err(Error::UnknownHandle { kind: "bytes", .. })
        ));
        assert!(matches!(
            dev.read_table(&sync(), t, 0, 1),
            Err(Error::UnknownHandle { kind: "table", .. })
        ));
        // A released handle number is never handed out again.
        assert_ne!(dev.alloc_table(1, 0).unwrap(), t);
    }

    #[test]
    fn alloc_of_an_impossible_size_is_an_error_not_an_abort() {
        let dev = CpuDevice::new();
        assert!(matches!(
            dev.alloc_bytes(u64::MAX, 0),
            Err(Error::OutOfMemory { .. })
        ));
    }

    #[test]
    fn upload_writes_a_range_and_rejects_one_past_the_end() {
        let dev = CpuDevice::new();
        let t = dev.alloc_table(4, 0).unwrap();
        dev.upload_table(t, 1, &[7, 8]).unwrap();
        assert_eq!(read(&dev, t), vec![0, 7, 8, 0]);
        assert!(matches!(
            dev.upload_table(t, 3, &[1, 2]),
            Err(Error::OutOfBounds {
                start: 3,
                end: 5,
                len: 4,
                ..
            })
        ));
        assert_eq!(read(&dev, t), vec![0, 7, 8, 0]);
    }

    #[test]
    fn span_copies_take_the_host_values_and_a_span_out_of_range_changes_nothing() {
        let dev = CpuDevice::new();
        let t = dev.alloc_table(12, -1).unwrap();
        let host: Vec<i32> = (0..12).map(|i| 100 + i).collect();
        let copy = |spans: &[(u32, u32)], values: &[i32]| {
            dev.copy_table_spans(&[TableSpans {
                table: t,
                values,
                spans,
            }])
        };
        copy(&[(2, 4), (4, 3), (11, 1), (9, 1), (0, 0)], &host).unwrap();
        let want = vec![-1, -1, 102, 103, 104, 105, 106, -1, -1, 109, -1, 111];
        assert_eq!(read(&dev, t), want);
        assert!(matches!(
            copy(&[(0, 2), (10, 3)], &host),
            Err(Error::OutOfBounds {
                kind: "table",
                start: 10,
                end: 13,
                len: 12,
                ..
            })
        ));
        assert!(matches!(
            copy(&[(3, 3)], &host[..5]),
            Err(Error::OutOfBounds {
                kind: "host values",
                start: 3,
                end: 6,
                len: 5,
                ..
            })
        ));
        assert_eq!(read(&dev, t), want, "a refused copy wrote nothing");
    }

    #[test]
    fn scatter_applies_in_order_and_an_out_of_range_index_changes_nothing() {
        let dev = CpuDevice::new();
        let t = dev.alloc_table(4, 0).unwrap();
        dev.scatter_table(t, &[(3, 30), (0, 10), (3, 33)]).unwrap();
        assert_eq!(read(&dev, t), vec![10, 0, 0, 33]);
        assert!(matches!(
            dev.scatter_table(t, &[(1, 5), (4, 6)]),
            Err(Error::OutOfBounds { start: 4, .. })
        ));
        assert_eq!(
            read(&dev, t),
            vec![10, 0, 0, 33],
            "nothing partially applied"
        );
    }

    #[test]
    fn gather_reads_src_and_writes_zero_for_indices_outside_it() {
        let dev = CpuDevice::new();
        let src = table(&dev, &[10, 11, 12]);
        let idx = table(&dev, &[2, 0, -1, 3, 1]);
        let out = dev.alloc_table(6, 99).unwrap();
        dev.gather_table(src, idx, 5, out).unwrap();
        assert_eq!(read(&dev, out), vec![12, 10, 0, 0, 11, 99]);
    }

    #[test]
    fn gather_rejects_short_tables_and_aliased_output() {
        let dev = CpuDevice::new();
        let src = table(&dev, &[10, 11, 12]);
        let idx = table(&dev, &[0, 1]);
        let out = dev.alloc_table(1, 0).unwrap();
        assert!(matches!(
            dev.gather_table(src, idx, 3, out),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            dev.gather_table(src, idx, 1, src),
            Err(Error::BadArguments { .. })
        ));
        assert!(matches!(
            dev.gather_table(src, idx, 1, idx),
            Err(Error::BadArguments { .. })
        ));
        assert_eq!(read(&dev, src), vec![10, 11, 12]);
    }

    #[test]
    fn fill_sets_every_span_and_rejects_a_span_past_the_end() {
        let dev = CpuDevice::new();
        let b = dev.alloc_bytes(8, 1).unwrap();
        let spans = [
            ByteSpan { offset: 0, len: 2 },
            ByteSpan { offset: 5, len: 3 },
            ByteSpan { offset: 4, len: 0 },
        ];
        dev.fill_spans(b, &spans, 0).unwrap();
        assert_eq!(bytes(&dev, b), vec![0, 0, 1, 1, 1, 0, 0, 0]);
        let bad = [
            ByteSpan { offset: 2, len: 1 },
            ByteSpan { offset: 7, len: 2 },
        ];
        assert!(matches!(
            dev.fill_spans(b, &bad, 9),
            Err(Error::OutOfBounds {
                start: 7,
                end: 9,
                ..
            })
        ));
        assert_eq!(bytes(&dev, b), vec![0, 0, 1, 1, 1, 0, 0, 0]);
        let overflow = [ByteSpan {
            offset: u64::MAX,
            len: 2,
        }];
        assert!(matches!(
            dev.fill_spans(b, &overflow, 9),
            Err(Error::OutOfBounds { .. })
        ));
    }

    /// Writes `pattern` into a fresh buffer.
    fn buffer_with(dev: &CpuDevice, pattern: &[u8]) -> BytesId {
        let b = dev.alloc_bytes(pattern.len() as u64, 0).unwrap();
        dev.state().bytes_mut(b).unwrap().write(0, pattern);
        b
    }

    /// A xorshift generator: reproducible random inputs without a dependency.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Random moves of whole `envelope`-byte slots of a `slots`-slot buffer, shaped like a
    /// compaction: distinct destination slots, sources among the other slots (several
    /// moves may read one source), a few empty moves anywhere.
    fn random_moves(rng: &mut Rng, slots: u64, envelope: u64, k: usize) -> Vec<SpanMove> {
        let mut order: Vec<u64> = (0..slots).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let (dsts, srcs) = order.split_at(k);
        let mut moves: Vec<SpanMove> = dsts
            .iter()
            .map(|&d| SpanMove {
                src: srcs[rng.below(srcs.len() as u64) as usize] * envelope,
                dst: d * envelope,
                len: envelope,
            })
            .collect();
        moves.push(SpanMove {
            src: dsts[0] * envelope,
            dst: srcs[0] * envelope + 1,
            len: 0,
        });
        moves
    }

    #[test]
    fn move_copies_in_place_like_a_naive_reference() {
        let mut rng = Rng(0x5EED);
        // (slots, envelope bytes, moves): page size 1 batches of many tiny envelopes, odd
        // sizes, and multi-MiB envelopes.
        for (slots, envelope, k) in [
            (4096, 1, 2000),
            (512, 37, 200),
            (64, 4099, 30),
            (6, 3 << 20, 2),
        ] {
            let pattern: Vec<u8> = (0..slots * envelope)
                .map(|_| rng.below(256) as u8)
                .collect();
            let moves = random_moves(&mut rng, slots, envelope, k);
            // The reference reads every source from a snapshot, so it is right whatever
            // the order of the copies.
            let mut expected = pattern.clone();
            for m in &moves {
                let (src, dst, len) = (m.src as usize, m.dst as usize, m.len as usize);
                expected[dst..dst + len].copy_from_slice(&pattern[src..src + len]);
            }
            let dev = CpuDevice::new();
            let b = buffer_with(&dev, &pattern);
            dev.move_spans(b, &moves).unwrap();
            assert!(
                bytes(&dev, b) == expected,
                "{slots} slots of {envelope} bytes"
            );
        }
    }

    #[test]
    fn move_refuses_overlaps_and_out_of_range_spans_before_writing() {
        let dev = CpuDevice::new();
        let pattern: Vec<u8> = (0..48).collect();
        let b = buffer_with(&dev, &pattern);
        let mv = |src, dst, len| SpanMove { src, dst, len };
        // (moves, the destination's move and range, the other move, kind and range)
        let cases = [
            (
                vec![mv(0, 8, 2), mv(2, 9, 2)],
                (1, 9..11, 0, "destination", 8..10),
            ),
            (vec![mv(0, 2, 4)], (0, 2..6, 0, "source", 0..4)),
            (vec![mv(0, 0, 1)], (0, 0..1, 0, "source", 0..1)),
            (
                vec![mv(0, 8, 4), mv(10, 14, 2)],
                (0, 8..12, 1, "source", 10..12),
            ),
            (
                vec![mv(6, 14, 2), mv(12, 4, 4)],
                (1, 4..8, 0, "source", 6..8),
            ),
            // A conflict behind a longer span that starts earlier.
            // A destination inside a long source, with a short source starting inside it too.
            (
                vec![mv(0, 20, 10), mv(1, 30, 1), mv(40, 5, 1)],
                (2, 5..6, 0, "source", 0..10),
            ),
        ];
        for (moves, (dst_move, dst, other_move, other_kind, other)) in cases {
            match dev.move_spans(b, &moves) {
                Err(Error::OverlappingMoves {
                    buf,
                    dst_move: d,
                    dst: dr,
                    other_move: o,
                    other_kind: ok,
                    other: or,
                }) => assert_eq!(
                    (buf, d, dr, o, ok, or),
                    (b.0, dst_move, dst, other_move, other_kind, other),
                    "{moves:?}"
                ),
                other => panic!("{moves:?}: {other:?}"),
            }
            assert_eq!(bytes(&dev, b), pattern, "{moves:?} wrote");
        }
        let past_end = [mv(0, 4, 2), mv(0, 47, 2)];
        assert!(matches!(
            dev.move_spans(b, &past_end),
            Err(Error::OutOfBounds {
                start: 47,
                end: 49,
                ..
            })
        ));
        assert_eq!(bytes(&dev, b), pattern);
        // Touching ranges, sources read twice and empty moves (even "inside" another
        // range) are fine.
        let touching = [
            mv(0, 4, 2),
            mv(6, 2, 2),
            mv(0, 8, 2),
            mv(2, 1, 0),
            mv(4, 4, 0),
        ];
        dev.move_spans(b, &touching).unwrap();
        let mut expected = pattern.clone();
        expected[4..6].copy_from_slice(&[0, 1]);
        expected[2..4].copy_from_slice(&[6, 7]);
        expected[8..10].copy_from_slice(&[0, 1]);
        assert_eq!(bytes(&dev, b), expected);
    }

    #[test]
    fn the_overlap_check_agrees_with_a_pairwise_check_in_any_order() {
        let mut rng = Rng(11);
        let hits = |a: u64, a_len: u64, b: u64, b_len: u64| {
            a_len > 0 && b_len > 0 && a < b + b_len && b < a + a_len
        };
        let mut refused = 0;
        for round in 0..4000 {
            let k = 1 + rng.below(6) as usize;
            // Odd rounds: destinations and sources each ascending (the pools' order, the
            // check's path without sorting); even rounds: any order.
            let (mut dst, mut src) = (0, 0);
            let moves: Vec<SpanMove> = (0..k)
                .map(|_| {
                    if round % 2 == 1 {
                        dst += rng.below(8);
                        src += rng.below(8);
                    } else {
                        dst = rng.below(40);
                        src = rng.below(40);
                    }
                    SpanMove {
                        src,
                        dst,
                        len: rng.below(5),
                    }
                })
                .collect();
            let pairwise = moves.iter().enumerate().any(|(i, m)| {
                moves.iter().enumerate().any(|(j, n)| {
                    hits(m.dst, m.len, n.src, n.len) || i != j && hits(m.dst, m.len, n.dst, n.len)
                })
            });
            let result = check::moves(BytesId(0), &moves, 64);
            assert_eq!(result.is_err(), pairwise, "{moves:?}: {result:?}");
            if let Err(Error::OverlappingMoves { dst, other, .. }) = &result {
                assert!(hits(
                    dst.start,
                    dst.end - dst.start,
                    other.start,
                    other.end - other.start
                ));
            }
            refused += usize::from(pairwise);
        }
        assert!(refused > 400 && refused < 3600, "{refused} of 4000 refused");
    }

    /// Translates `ids` with a fresh device and returns `out`.
    fn translate(v2p: &[i32], ids: &[i32], ps: u32, stride: u32, out_width: usize) -> Vec<i32> {
        let dev = CpuDevice::new();
        let (v2p, ids_t) = (table(&dev, v2p), table(&dev, ids));
        let out = dev.alloc_table(out_width, -7).unwrap();
        let args = Translate {
            v2p,
            ids: ids_t,
            n: ids.len(),
            page_size: ps,
            stride,
            out,
            out_width,
        };
        dev.translate(&args).unwrap();
        read(&dev, out)
    }

    #[test]
    fn translate_maps_bound_pages_and_sends_the_rest_to_the_sink() {
        for ps in page_sizes() {
            let p = ps as i32;
            let stride = 3 * ps;
            // virtual page: 0 sink, 1 → phys 2, 2 tombstone, 3 never bound, 4 → phys 1
            let v2p = [0, 2, -1, 0, 1];
            let ids = [
                p + p - 1, // page 1, last offset
                4 * p,     // page 4, offset 0
                2 * p,     // tombstone → sink
                3 * p,     // unbound → sink
                0,         // sink
                -5,        // negative → sink
                5 * p,     // page 5: outside v2p → sink
                i32::MAX,  // far outside v2p → sink
            ];
            let expected = vec![
                2 * stride as i32 + p - 1,
                stride as i32,
                0,
                0,
                0,
                0,
                0,
                0,
                0, // zero-filled tail
                0,
            ];
            assert_eq!(translate(&v2p, &ids, ps, stride, 10), expected, "ps = {ps}");
        }
    }

    #[test]
    fn translate_rejects_bad_arguments_before_writing() {
        let dev = CpuDevice::new();
        let v2p = table(&dev, &[0, 1]);
        let ids = table(&dev, &[1, 2, 3]);
        let out = dev.alloc_table(4, -7).unwrap();
        let ok = Translate {
            v2p,
            ids,
            n: 3,
            page_size: 2,
            stride: 2,
            out,
            out_width: 4,
        };
        let cases = [
            Translate { page_size: 0, ..ok },
            Translate {
                page_size: u32::MAX,
                ..ok
            },
            Translate {
                stride: u32::MAX,
                ..ok
            },
            Translate { n: 4, ..ok },         // ids too short
            Translate { out_width: 5, ..ok }, // out too short
            Translate { out_width: 2, ..ok }, // n > out_width
            Translate { out: v2p, ..ok },
            Translate { out: ids, ..ok },
        ];
        for args in cases {
            assert!(dev.translate(&args).is_err(), "{args:?}");
        }
        assert_eq!(read(&dev, out), vec![-7; 4], "nothing written");
        dev.translate(&ok).unwrap();
        assert_eq!(read(&dev, out), vec![0, 2, 3, 0]);
    }

    #[test]
    fn read_back_checks_its_range() {
        let dev = CpuDevice::new();
        let b = dev.alloc_bytes(4, 9).unwrap();
        assert_eq!(dev.read_bytes(&sync(), b, 1, 2).unwrap(), vec![9, 9]);
        assert!(matches!(
            dev.read_bytes(&sync(), b, 3, 2),
            Err(Error::OutOfBounds { .. })
        ));
        dev.synchronize(&sync()).unwrap();
    }

    #[test]
    fn a_cpu_kernel_reads_and_writes_the_buffer_in_call_order() {
        let dev = CpuDevice::new();
        let b = dev.alloc_bytes(8, 0).unwrap();
        dev.fill_spans(b, &[ByteSpan { offset: 2, len: 2 }], 7)
            .unwrap();
        let seen = dev
            .run_kernel(b, |bytes| {
                let seen = bytes.to_vec();
                bytes[0] = 9;
                seen
            })
            .unwrap();
        assert_eq!(seen, [0, 0, 7, 7, 0, 0, 0, 0]);
        assert_eq!(bytes(&dev, b), [9, 0, 7, 7, 0, 0, 0, 0]);
        dev.free_bytes(b).unwrap();
        assert!(matches!(
            dev.run_kernel(b, |_| ()),
            Err(Error::UnknownHandle { .. })
        ));
    }

    fn window(v2p: TableId, ids: TableId, starts: TableId, out: TableId) -> WindowTranslate {
        WindowTranslate {
            v2p,
            ids,
            ids_at: 0,
            rows: 5,
            starts,
            starts_at: 0,
            bias: 0,
            lens: None,
            batch: 2,
            width: 3,
            page_size: 2,
            stride: 10,
            out,
            out_at: 1,
        }
    }

    #[test]
    fn windows_translate_from_device_starts_and_write_the_sink_outside_the_row() {
        let dev = CpuDevice::new();
        let v2p = table(&dev, &[0, 5, -1, 3]);
        let ids = table(&dev, &[2, 3, 4, 5, 7, 6, 0, 1, 2, 3]);
        let starts = table(&dev, &[1, 3]);
        let (out, shifted) = (table(&dev, &[9; 8]), table(&dev, &[9; 8]));
        let (lens, limited) = (table(&dev, &[2, 1]), table(&dev, &[9; 8]));
        let w = window(v2p, ids, starts, out);
        let shift = WindowTranslate {
            bias: -2,
            out: shifted,
            ..w
        };
        dev.translate_windows(&[
            w,
            shift,
            WindowTranslate {
                lens: Some((lens, 0)),
                out: limited,
                ..shift
            },
        ])
        .unwrap();
        // Request 0 reads ids 3, 4, 5 (page 1 → 5, page 2 tombstoned); request 1 reads
        // 2, 3 and then past its row.
        assert_eq!(read(&dev, out), [9, 51, 0, 0, 50, 51, 0, 9]);
        // Two earlier: before request 0's row, then ids 2 and 3; request 1's 0, 1 (page
        // 0 unbound) and 2.
        assert_eq!(read(&dev, shifted), [9, 0, 50, 51, 0, 0, 50, 9]);
        // The same with live lengths 2 and 1: what lies past them is the sink.
        assert_eq!(read(&dev, limited), [9, 0, 50, 0, 0, 0, 0, 9]);
    }

    #[test]
    fn a_malformed_window_call_is_refused_before_anything_is_written() {
        let dev = CpuDevice::new();
        let v2p = table(&dev, &[0, 5, -1, 3]);
        let ids = table(&dev, &[2, 3, 4, 5, 7, 6, 0, 1, 2, 3]);
        let starts = table(&dev, &[1, 3]);
        let out = table(&dev, &[9; 8]);
        let w = window(v2p, ids, starts, out);
        for (bad, what) in [
            (
                vec![w, WindowTranslate { out: starts, ..w }],
                "an output is an input",
            ),
            (
                vec![w, WindowTranslate { out_at: 2, ..w }],
                "two outputs overlap",
            ),
            (
                vec![w, WindowTranslate { batch: 3, ..w }],
                "the rows are short",
            ),
            (
                vec![w, WindowTranslate { out_at: 3, ..w }],
                "the output is short",
            ),
            (
                vec![w, WindowTranslate { page_size: 0, ..w }],
                "page size 0",
            ),
            (
                vec![
                    w,
                    WindowTranslate {
                        lens: Some((starts, 1)),
                        ..w
                    },
                ],
                "the live lengths are short",
            ),
            (
                vec![
                    w,
                    WindowTranslate {
                        lens: Some((out, 0)),
                        ..w
                    },
                ],
                "an output is the live lengths",
            ),
        ] {
            let e = dev.translate_windows(&bad).expect_err(what);
            assert!(
                matches!(e, Error::BadArguments { .. } | Error::OutOfBounds { .. }),
                "{what}: {e:?}"
            );
            assert_eq!(read(&dev, out), [9; 8], "{what}: nothing written");
            assert_eq!(read(&dev, starts), [1, 3], "{what}: nothing written");
        }
    }

    /// The virtual → physical map of the lane examples: page 0 the sink, 1 → 5,
    /// 2 tombstoned, 3 unbound, 4 → 3, 5 → 7 (6 and up: outside it).
    const LANE_V2P: [i32; 6] = [0, 5, -1, 0, 3, 7];

    /// Lanes of 4 virtual pages: lane 0 translates to physical pages 5, 3, 7, 5; every
    /// page of lane 1 to the sink (tombstoned, unbound, outside `v2p`, negative); lane 2
    /// to 7, 5, 3, 5; then a partial lane of 2 entries, which is no lane.
    const LANE_ROWS: [i32; 14] = [1, 4, 5, 1, 2, 3, 6, -4, 5, 1, 4, 1, 1, 1];

    /// A lane translation of [`LANE_ROWS`] with its per-request values at the given
    /// offsets of `meta`.
    fn lane_translate(v2p: TableId, rows: TableId, meta: TableId, out: TableId) -> LaneTranslate {
        LaneTranslate {
            v2p,
            rows,
            lane_len: 4,
            lanes: (meta, 0),
            firsts: None,
            starts: (meta, 0),
            batch: 0,
            stride: 1,
            out,
            out_at: 0,
            out_len: 0,
        }
    }

    #[test]
    fn lanes_translate_runs_at_device_offsets_and_send_the_rest_to_the_sink() {
        for ps in page_sizes() {
            let dev = CpuDevice::new();
            let (v2p, rows) = (table(&dev, &LANE_V2P), table(&dev, &LANE_ROWS));
            // The per-request values of both translations in one table, the second's
            // output after them (a disjoint range of an input table is fine):
            // full lanes 2, 0, 3 (partial), 1 with starts 0, 4, 6, 8, 9 (runs of 4, 2, 2,
            // 1); window lanes 0, 2, -1 from entries 2, -1, 0 with starts 0, 3, 6, 8.
            #[rustfmt::skip]
            let meta = table(&dev, &[
                2, 0, 3, 1,  0, 4, 6, 8, 9,
                0, 2, -1,  2, -1, 0,  0, 3, 6, 8,
                -9, -9, -9, -9, -9, -9, -9, -9,
            ]);
            let full_out = table(&dev, &[-9; 11]);
            let stride = 3 * ps; // rows per page envelope: the kernel id of a first token
            let lanes = lane_translate(v2p, rows, meta, full_out);
            let full = LaneTranslate {
                starts: (meta, 4),
                batch: 4,
                stride,
                out_at: 1,
                out_len: 9,
                ..lanes
            };
            let window = LaneTranslate {
                lanes: (meta, 9),
                firsts: Some((meta, 12)),
                starts: (meta, 15),
                batch: 3,
                stride,
                out: meta,
                out_at: 19,
                out_len: 8,
                ..lanes
            };
            dev.translate_lanes(&[full, window]).unwrap();
            let s = stride as i32;
            // Lane 2 whole; lane 0's first two; the partial lane and lane 1: the sink.
            assert_eq!(
                read(&dev, full_out),
                [-9, 7 * s, 5 * s, 3 * s, 5 * s, 5 * s, 3 * s, 0, 0, 0, -9],
                "ps {ps}"
            );
            // Lane 0 from entry 2 (its entry 4 is past the lane), lane 2 from entry -1,
            // lane -1.
            assert_eq!(
                read(&dev, meta)[19..],
                [7 * s, 5 * s, 0, 0, 7 * s, 5 * s, 0, 0],
                "ps {ps}"
            );
        }
    }

    /// The table of `out_len + 2` entries (`-9` where nothing is written) that one
    /// request per entry of `lanes` writes through output entries `1..=out_len`, with
    /// `starts` (and `firsts`) as its device values, lanes of [`LANE_ROWS`], stride 1.
    fn lane_runs(
        lanes: &[i32],
        firsts: Option<&[i32]>,
        starts: &[i32],
        out_len: usize,
    ) -> Vec<i32> {
        let dev = CpuDevice::new();
        let (v2p, rows) = (table(&dev, &LANE_V2P), table(&dev, &LANE_ROWS));
        let out = table(&dev, &vec![-9; out_len + 2]);
        let args = LaneTranslate {
            lanes: (table(&dev, lanes), 0),
            firsts: firsts.map(|f| (table(&dev, f), 0)),
            starts: (table(&dev, starts), 0),
            batch: lanes.len(),
            out_at: 1,
            out_len,
            ..lane_translate(v2p, rows, v2p, out)
        };
        dev.translate_lanes(&[args]).unwrap();
        read(&dev, out)
    }

    #[test]
    fn lane_runs_write_only_inside_their_output() {
        let nothing = vec![-9; 6];
        for (lanes, firsts, starts, want) in [
            // Entries 2 and 3 of a run starting two before the output.
            (&[0][..], None, &[-2, 2][..], vec![-9, 7, 5, -9, -9, -9]),
            // A run that ends past the output: only its first entry lands.
            (&[0], None, &[3, 6], vec![-9, -9, -9, -9, 5, -9]),
            // A run that ends before it starts, and one of 0 entries.
            (&[0], None, &[3, 1], nothing.clone()),
            (&[0, 0], None, &[2, 2, 2], nothing.clone()),
            // The widest run device values can give: its entries past 2³¹ are past the
            // lane (the sink), unless the first entry brings them back to 0.
            (&[0], None, &[i32::MIN, i32::MAX], vec![-9, 0, 0, 0, 0, -9]),
            (
                &[0],
                Some(&[i32::MIN][..]),
                &[i32::MIN, i32::MAX],
                vec![-9, 5, 3, 7, 5, -9],
            ),
            // Ragged runs of two requests of one lane: entry 3; entries -1, 0 and 1.
            (
                &[0, 0],
                Some(&[3, -1]),
                &[0, 1, 4],
                vec![-9, 5, 0, 5, 3, -9],
            ),
            // Requests 0 and 2 overlap at 1 (request 1's run is empty): the later lands.
            (&[0, 0, 2], None, &[0, 3, 1, 2], vec![-9, 5, 7, 7, -9, -9]),
            // Lanes outside the lanes (the partial one, negative, far) and the last lane.
            (
                &[3, -1, i32::MAX, 2],
                None,
                &[0, 1, 2, 3, 4],
                vec![-9, 0, 0, 0, 7, -9],
            ),
        ] {
            assert_eq!(lane_runs(lanes, firsts, starts, 4), want, "{starts:?}");
        }
        // No requests, or no output: nothing is read and nothing is written.
        assert_eq!(lane_runs(&[], None, &[7], 4), nothing);
        assert_eq!(lane_runs(&[0], None, &[0, 4], 0), [-9, -9]);
    }

    #[test]
    fn a_malformed_lane_call_is_refused_before_anything_is_written() {
        let dev = CpuDevice::new();
        let (v2p, rows) = (table(&dev, &LANE_V2P), table(&dev, &LANE_ROWS));
        // lanes 0..2, firsts 2..4, starts 4..7, a free entry, then the other output.
        let meta = table(&dev, &[0, 2, 1, 0, 0, 2, 4, -9, -9, -9, -9, -9]);
        let out = table(&dev, &[-9; 6]);
        let ok = LaneTranslate {
            firsts: Some((meta, 2)),
            starts: (meta, 4),
            batch: 2,
            out_len: 6,
            ..lane_translate(v2p, rows, meta, out)
        };
        let other = LaneTranslate {
            out: meta,
            out_at: 8,
            out_len: 4,
            ..ok
        };
        let with = |edit: &dyn Fn(&mut LaneTranslate)| {
            let mut bad = ok;
            edit(&mut bad);
            vec![ok, other, bad]
        };
        // (what, a part of the refusal: its variant, or the reason's words)
        let oob = "OutOfBounds";
        let cases = [
            (
                "lanes of 0 entries",
                "lanes of 0 entries",
                with(&|t| t.lane_len = 0),
            ),
            (
                "a stride past i32",
                "does not fit in i32",
                with(&|t| t.stride = u32::MAX),
            ),
            ("short lanes", oob, with(&|t| t.lanes = (meta, 11))),
            ("short firsts", oob, with(&|t| t.firsts = Some((meta, 11)))),
            // Room for `batch` starts but not for the last prefix sum.
            ("short starts", oob, with(&|t| t.starts = (meta, 10))),
            ("a short output", oob, with(&|t| t.out_at = 1)),
            ("a batch past memory", oob, with(&|t| t.batch = usize::MAX)),
            (
                "an unknown table",
                "UnknownHandle",
                with(&|t| t.v2p = TableId(99)),
            ),
            (
                "v2p as the output",
                "`v2p` input",
                with(&|t| (t.out, t.out_len) = (v2p, 1)),
            ),
            (
                "rows as the output",
                "`rows` input",
                with(&|t| (t.out, t.out_len) = (rows, 1)),
            ),
            // Another translation's tables count as well: `out` is the first's output.
            (
                "another's output as v2p",
                "translation 0 is the `v2p` input of translation 2",
                with(&|t| {
                    (t.v2p, t.out, t.out_at, t.out_len) = (out, meta, 7, 1);
                }),
            ),
            (
                "over the lanes",
                "`lanes` input",
                with(&|t| (t.out, t.out_at, t.out_len) = (meta, 1, 1)),
            ),
            (
                "over the firsts",
                "`firsts` input",
                with(&|t| (t.out, t.out_at, t.out_len) = (meta, 3, 1)),
            ),
            // Only over the last prefix sum, `starts[batch]`.
            (
                "over the starts",
                "`starts` input",
                with(&|t| (t.out, t.out_at, t.out_len) = (meta, 6, 2)),
            ),
            (
                "over its own lanes",
                "translation 2 overlaps the `lanes` input of translation 2",
                with(&|t| {
                    (t.lanes, t.out, t.out_at, t.out_len) = ((meta, 6), meta, 7, 1);
                }),
            ),
            (
                "over another output",
                "outputs of translations 0 and 2",
                with(&|t| (t.out_at, t.out_len) = (5, 1)),
            ),
            (
                "over the other's output",
                "outputs of translations 1 and 2",
                with(&|t| {
                    (t.out, t.out_at, t.out_len) = (meta, 11, 1);
                }),
            ),
        ];
        for (what, refusal, call) in &cases {
            let e = format!("{:?}", dev.translate_lanes(call).expect_err(what));
            assert!(e.contains(refusal), "{what}: {e}");
            let typed = [
                "BadArguments { op: \"translate_lanes\"",
                "OutOfBounds { op: \"translate_lanes\"",
            ];
            assert!(
                *refusal == "UnknownHandle" || typed.iter().any(|t| e.starts_with(t)),
                "{what}: {e}"
            );
            assert_eq!(read(&dev, out), [-9; 6], "{what}: nothing written");
            assert_eq!(read(&dev, meta)[7..], [-9; 5], "{what}: nothing written");
        }
        // Adjacent ranges are no overlap: an output right after the starts, outputs of 0
        // entries anywhere.
        let edges = [
            ok,
            LaneTranslate {
                out: meta,
                out_at: 7,
                out_len: 1,
                ..ok
            },
            LaneTranslate {
                out: meta,
                out_at: 0,
                out_len: 0,
                ..ok
            },
            LaneTranslate {
                out_at: 3,
                out_len: 0,
                ..ok
            },
        ];
        dev.translate_lanes(&edges).unwrap();
        // Request 0: lane 0 from entry 1 at 0..2; request 1: lane 2 from entry 0 at 2..4
        // (of an output of one entry: only request 0's first).
        assert_eq!(read(&dev, out), [3, 7, 7, 5, -9, -9]);
        assert_eq!(read(&dev, meta)[7..], [3, -9, -9, -9, -9]);
    }

    #[test]
    fn row_gathers_follow_the_path_in_order_and_skip_the_sink_and_rows_past_the_buffer() {
        let dev = CpuDevice::new();
        let b = dev.alloc_bytes(20, 0).unwrap();
        dev.run_kernel(b, |bytes| {
            for (i, v) in bytes.iter_mut().enumerate() {
                *v = i as u8;
            }
        })
        .unwrap();
        // Page size 2, two rows a token of one byte: kernel id k's rows are bytes k, k + 2.
        let ids = table(&dev, &[4, 5, 8, 9, 12, 13, 0, 0, 16, 18, 0, -1]);
        let path = table(&dev, &[0, 2, 3, -1, 1, -1, 0, 0, 1, 7, 0, 0]);
        let args = RowGather {
            buf: b,
            ids,
            ids_at: 0,
            path,
            path_at: 0,
            batch: 3,
            width: 4,
            page_size: 2,
            rows_per_token: 2,
            row_bytes: 1,
        };
        dev.gather_rows(&[args]).unwrap();
        let mut want: Vec<u8> = (0..20).collect();
        // Request 0: position 2 → 1 (bytes 8, 10 → 5, 7), then 3 → 2 (9, 11 → 8, 10),
        // reading 8 and 10 before the second step overwrites them.
        (want[5], want[7], want[8], want[10]) = (8, 10, 9, 11);
        // Request 1: position 1 → 0 (13, 15 → 12, 14); its −1 ends the path.
        (want[12], want[14]) = (13, 15);
        // Request 2: 18 → 16; the second row, byte 20, is past the buffer.
        want[16] = 18;
        assert_eq!(bytes(&dev, b), want);
        for bad in [
            RowGather { width: 5, ..args },
            RowGather { path_at: 1, ..args },
            RowGather {
                page_size: 0,
                ..args
            },
            RowGather {
                row_bytes: u64::MAX,
                ..args
            },
        ] {
            // The good gather first: refused whole, it copies nothing either.
            assert!(dev.gather_rows(&[args, bad]).is_err(), "{bad:?}");
            assert_eq!(bytes(&dev, b), want, "{bad:?}: nothing written");
        }
    }
}

//! [`Buffer`]: the CPU backend's byte buffer, stored in chunks that cost memory only
//! once they hold bytes that differ, so a buffer the size of a GPU's memory is cheap
//! where nothing was written, and moving or filling such bytes costs no copy.
//!
//! A chunk is either uniform (every byte one value, no storage) or data. Filling a whole
//! chunk makes it uniform; writing a chunk's own uniform value over part of it changes
//! nothing; only a write of other bytes into part of a uniform chunk materialises it. The
//! bytes read are exactly those a flat vector would hold after the same writes (a test
//! compares the two on random ops). [`Buffer::dense_mut`] turns the buffer into one flat
//! vector for good, for a kernel that needs a slice of it.

use super::memory::filled;
use crate::Error;

/// Bytes per chunk: larger than a page envelope at small page sizes, small enough that a
/// stamped byte materialises little.
pub(crate) const CHUNK: usize = 64 << 10;

#[derive(Debug)]
pub(crate) enum Chunk {
    /// Every byte is this value.
    Uniform(u8),
    /// The bytes (`CHUNK` long; the last chunk of a buffer uses a prefix).
    Data(Box<[u8]>),
}

/// A run of a buffer's bytes inside one chunk ([`Buffer::copy_from`]).
enum Run<'a> {
    /// This many bytes of one value.
    Uniform(u8, usize),
    /// The bytes themselves.
    Bytes(&'a [u8]),
}

/// A CPU byte buffer; see the module docs.
#[derive(Debug)]
pub(crate) enum Buffer {
    /// Chunks of [`CHUNK`] bytes and the buffer's length.
    Chunked(Vec<Chunk>, u64),
    /// One flat vector (after [`Buffer::dense_mut`]).
    Dense(Vec<u8>),
}

/// The pieces of `[offset, offset + len)` that fall in one chunk each:
/// `(chunk, offset in it, length)`.
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (usize, usize, usize)> {
    let end = offset + len;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let (c, o) = ((at / CHUNK as u64) as usize, (at % CHUNK as u64) as usize);
        let n = (CHUNK - o).min((end - at) as usize);
        at += n as u64;
        Some((c, o, n))
    })
}

impl Chunk {
    /// The chunk as bytes, materialising a uniform one.
    fn data(&mut self) -> &mut [u8] {
        if let Chunk::Uniform(v) = *self {
            *self = Chunk::Data(vec![v; CHUNK].into_boxed_slice());
        }
        match self {
            Chunk::Data(d) => d,
            Chunk::Uniform(_) => unreachable!("materialised above"),
        }
    }

    /// Sets `n` bytes from `o` to `value` (`whole`: the piece is the chunk's every byte).
    fn fill(&mut self, o: usize, n: usize, value: u8, whole: bool) {
        match self {
            _ if whole => *self = Chunk::Uniform(value),
            Chunk::Uniform(v) if *v == value => {}
            _ => self.data()[o..o + n].fill(value),
        }
    }
}

impl Buffer {
    /// A buffer of `len` bytes of `fill`. Costs `len / CHUNK` chunk entries, no bytes.
    pub(crate) fn new(len: u64, fill: u8) -> Result<Buffer, Error> {
        let oom = || Error::OutOfMemory {
            device: "cpu".to_string(),
            bytes: len,
        };
        let n = usize::try_from(len.div_ceil(CHUNK as u64)).map_err(|_| oom())?;
        let mut chunks = Vec::new();
        chunks.try_reserve_exact(n).map_err(|_| oom())?;
        chunks.resize_with(n, || Chunk::Uniform(fill));
        Ok(Buffer::Chunked(chunks, len))
    }

    /// Bytes in the buffer.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Buffer::Chunked(_, len) => *len,
            Buffer::Dense(v) => v.len() as u64,
        }
    }

    /// Whether chunk `c` of a buffer of `len` bytes is covered whole by a piece `o, n`.
    fn whole(len: u64, c: usize, o: usize, n: usize) -> bool {
        let chunk_len = (len - (c * CHUNK) as u64).min(CHUNK as u64) as usize;
        o == 0 && n == chunk_len
    }

    /// Sets `[offset, offset + len)` (in bounds: checked by the caller) to `value`.
    pub(crate) fn fill(&mut self, offset: u64, len: u64, value: u8) {
        match self {
            Buffer::Dense(v) => v[offset as usize..(offset + len) as usize].fill(value),
            Buffer::Chunked(chunks, total) => {
                for (c, o, n) in pieces(offset, len) {
                    chunks[c].fill(o, n, value, Buffer::whole(*total, c, o, n));
                }
            }
        }
    }

    /// Copies `len` bytes from `src` to `dst` (both in bounds, not overlapping: checked
    /// by the caller).
    pub(crate) fn copy(&mut self, src: u64, dst: u64, len: u64) {
        let (chunks, total) = match self {
            Buffer::Dense(v) => {
                let src = src as usize;
                v.copy_within(src..src + len as usize, dst as usize);
                return;
            }
            Buffer::Chunked(chunks, total) => (chunks, *total),
        };
        // Walk the destination's pieces, each split where the source crosses a chunk.
        let mut done = 0u64;
        while done < len {
            let (s, d) = (src + done, dst + done);
            let (sc, so) = ((s / CHUNK as u64) as usize, (s % CHUNK as u64) as usize);
            let (dc, d_o) = ((d / CHUNK as u64) as usize, (d % CHUNK as u64) as usize);
            let n = (CHUNK - so).min(CHUNK - d_o).min((len - done) as usize);
            let whole = Buffer::whole(total, dc, d_o, n);
            match chunks[sc] {
                Chunk::Uniform(v) => chunks[dc].fill(d_o, n, v, whole),
                Chunk::Data(_) if sc == dc => {
                    chunks[dc].data().copy_within(so..so + n, d_o);
                }
                Chunk::Data(_) => {
                    let (from, to) = if sc < dc {
                        let (a, b) = chunks.split_at_mut(dc);
                        (&a[sc], &mut b[0])
                    } else {
                        let (a, b) = chunks.split_at_mut(sc);
                        (&b[0], &mut a[dc])
                    };
                    let Chunk::Data(from) = from else {
                        unreachable!("matched as data")
                    };
                    to.data()[d_o..d_o + n].copy_from_slice(&from[so..so + n]);
                }
            }
            done += n as u64;
        }
    }

    /// The bytes `[offset, offset + len)` (in bounds: checked by the caller).
    pub(crate) fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, Error> {
        match self {
            Buffer::Dense(v) => Ok(v[offset as usize..(offset + len) as usize].to_vec()),
            Buffer::Chunked(chunks, _) => {
                let mut out = Vec::new();
                out.try_reserve_exact(len as usize)
                    .map_err(|_| Error::OutOfMemory {
                        device: "cpu".to_string(),
                        bytes: len,
                    })?;
                for (c, o, n) in pieces(offset, len) {
                    match &chunks[c] {
                        Chunk::Uniform(v) => out.resize(out.len() + n, *v),
                        Chunk::Data(d) => out.extend_from_slice(&d[o..o + n]),
                    }
                }
                Ok(out)
            }
        }
    }

    /// The buffer as one flat slice, converting it for good (its every byte then costs
    /// memory, as a flat vector's would).
    pub(crate) fn dense_mut(&mut self) -> Result<&mut [u8], Error> {
        if let Buffer::Chunked(chunks, len) = self {
            let mut flat = filled(*len as usize, 0)?;
            for (c, chunk) in chunks.iter().enumerate() {
                let at = c * CHUNK;
                let piece = &mut flat[at..(at + CHUNK).min(*len as usize)];
                match chunk {
                    Chunk::Uniform(0) => {}
                    Chunk::Uniform(v) => piece.fill(*v),
                    Chunk::Data(d) => piece.copy_from_slice(&d[..piece.len()]),
                }
            }
            *self = Buffer::Dense(flat);
        }
        match self {
            Buffer::Dense(v) => Ok(v),
            Buffer::Chunked(..) => unreachable!("converted above"),
        }
    }

    /// Writes `bytes` at `offset` (in bounds: checked by the caller). A piece that
    /// repeats its uniform chunk's value changes nothing and materialises nothing.
    pub(crate) fn write(&mut self, offset: u64, bytes: &[u8]) {
        match self {
            Buffer::Dense(v) => v[offset as usize..][..bytes.len()].copy_from_slice(bytes),
            Buffer::Chunked(chunks, _) => {
                let mut at = 0;
                for (c, o, n) in pieces(offset, bytes.len() as u64) {
                    let piece = &bytes[at..at + n];
                    match chunks[c] {
                        Chunk::Uniform(v) if piece.iter().all(|&b| b == v) => {}
                        _ => chunks[c].data()[o..o + n].copy_from_slice(piece),
                    }
                    at += n;
                }
            }
        }
    }

    /// The bytes from `at` (in bounds) to the end of its chunk, at most `max` (> 0): one
    /// value repeated, or a slice.
    fn run(&self, at: u64, max: u64) -> Run<'_> {
        match self {
            Buffer::Dense(v) => Run::Bytes(&v[at as usize..(at + max) as usize]),
            Buffer::Chunked(chunks, _) => {
                let (c, o) = ((at / CHUNK as u64) as usize, (at % CHUNK as u64) as usize);
                let n = (CHUNK - o).min(max as usize);
                match &chunks[c] {
                    Chunk::Uniform(v) => Run::Uniform(*v, n),
                    Chunk::Data(d) => Run::Bytes(&d[o..o + n]),
                }
            }
        }
    }

    /// Copies `len` bytes of `src` from `src_at` to `dst` of this buffer (both ranges in
    /// bounds: checked by the caller): a host-tier copy between two buffers. Uniform
    /// source chunks are filled, not copied, so copying unwritten bytes costs no memory.
    pub(crate) fn copy_from(&mut self, dst: u64, src: &Buffer, src_at: u64, len: u64) {
        let mut done = 0;
        while done < len {
            let n = match src.run(src_at + done, len - done) {
                Run::Uniform(v, n) => {
                    self.fill(dst + done, n as u64, v);
                    n
                }
                Run::Bytes(bytes) => {
                    self.write(dst + done, bytes);
                    bytes.len()
                }
            };
            done += n as u64;
        }
    }

    /// Chunks that hold bytes (tests: what the buffer costs).
    #[cfg(test)]
    pub(crate) fn data_chunks(&self) -> usize {
        match self {
            Buffer::Chunked(chunks, _) => chunks
                .iter()
                .filter(|c| matches!(c, Chunk::Data(_)))
                .count(),
            Buffer::Dense(v) => v.len().div_ceil(CHUNK),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One op on a buffer of `LEN` bytes, in bounds.
    #[derive(Clone, Debug)]
    enum Op {
        Fill(u64, u64, u8),
        /// Source, destination, length: disjoint ranges.
        Copy(u64, u64, u64),
        /// Source in the buffer, destination in the other buffer, length (a write-back).
        CopyOut(u64, u64, u64),
        /// Source in the other buffer, destination in the buffer, length (a load-back).
        CopyIn(u64, u64, u64),
        /// Bytes written at an offset, as a kernel would.
        Write(u64, Vec<u8>),
        Dense,
    }

    const LEN: u64 = 3 * CHUNK as u64 + 1_234;

    fn op() -> impl Strategy<Value = Op> {
        let range = (0..LEN).prop_flat_map(|start| (Just(start), 0..=(LEN - start).min(150_000)));
        prop_oneof![
            4 => (range.clone(), prop_oneof![Just(0u8), Just(7u8), any::<u8>()])
                .prop_map(|((o, n), v)| Op::Fill(o, n, v)),
            4 => (0..LEN / 2, 0..LEN / 2, 0..LEN / 2).prop_filter_map("disjoint", |(a, b, n)| {
                // Source in the low half, destination in the high half, or swapped.
                let (src, dst) = (a, LEN / 2 + b);
                let n = n.min(LEN - dst).min(LEN / 2 - src);
                Some(if a % 2 == 0 { Op::Copy(src, dst, n) } else { Op::Copy(dst, src, n) })
            }),
            2 => (0..LEN, 0..LEN, 0..LEN).prop_map(|(a, b, n)| {
                Op::CopyOut(a, b, n.min(LEN - a).min(LEN - b))
            }),
            2 => (0..LEN, 0..LEN, 0..LEN).prop_map(|(a, b, n)| {
                Op::CopyIn(a, b, n.min(LEN - a).min(LEN - b))
            }),
            1 => (0..LEN, proptest::collection::vec(prop_oneof![Just(0u8), any::<u8>()], 0..300))
                .prop_map(|(o, bytes)| Op::Write(o.min(LEN - bytes.len() as u64), bytes)),
            1 => Just(Op::Dense),
        ]
    }

    proptest! {
        #[test]
        fn reads_what_a_flat_vector_holds_after_the_same_ops(
            fill in prop_oneof![Just(0u8), any::<u8>()],
            ops in proptest::collection::vec(op(), 1..24),
        ) {
            let mut buffer = Buffer::new(LEN, fill).unwrap();
            let mut flat = vec![fill; LEN as usize];
            // A second buffer (a host tier's) that copies cross to and from.
            let mut other = Buffer::new(LEN, 3).unwrap();
            let mut other_flat = vec![3; LEN as usize];
            for op in ops {
                match op {
                    Op::Fill(o, n, v) => {
                        buffer.fill(o, n, v);
                        flat[o as usize..(o + n) as usize].fill(v);
                    }
                    Op::Copy(s, d, n) => {
                        buffer.copy(s, d, n);
                        flat.copy_within(s as usize..(s + n) as usize, d as usize);
                    }
                    Op::CopyOut(s, d, n) => {
                        other.copy_from(d, &buffer, s, n);
                        other_flat[d as usize..(d + n) as usize]
                            .copy_from_slice(&flat[s as usize..(s + n) as usize]);
                    }
                    Op::CopyIn(s, d, n) => {
                        buffer.copy_from(d, &other, s, n);
                        flat[d as usize..(d + n) as usize]
                            .copy_from_slice(&other_flat[s as usize..(s + n) as usize]);
                    }
                    Op::Write(o, bytes) => {
                        buffer.write(o, &bytes);
                        flat[o as usize..][..bytes.len()].copy_from_slice(&bytes);
                    }
                    Op::Dense => {
                        prop_assert_eq!(&*buffer.dense_mut().unwrap(), &flat[..]);
                    }
                }
                prop_assert_eq!(buffer.read(0, LEN).unwrap(), flat.clone());
                prop_assert_eq!(other.read(0, LEN).unwrap(), other_flat.clone());
            }
            prop_assert_eq!(buffer.read(5, 70_000).unwrap(), flat[5..70_005].to_vec());
        }
    }

    #[test]
    fn moving_and_filling_unwritten_bytes_costs_no_memory() {
        let mut buffer = Buffer::new(16 << 30, 0).unwrap();
        buffer.copy(0, 8 << 30, 1 << 30);
        buffer.fill(3, 100_000, 0);
        assert_eq!(buffer.data_chunks(), 0);
        // A stamp materialises its chunk only; moving it, the destination's.
        buffer.fill(10, 1, 9);
        buffer.copy(0, 4 << 30, 100);
        assert_eq!(buffer.data_chunks(), 2);
        assert_eq!(buffer.read((4 << 30) + 9, 3).unwrap(), [0, 9, 0]);
        // Filling a whole chunk drops its bytes.
        buffer.fill(0, CHUNK as u64, 0);
        assert_eq!(buffer.data_chunks(), 1);
    }

    #[test]
    fn copying_unwritten_bytes_between_buffers_costs_no_memory() {
        let mut device = Buffer::new(16 << 30, 0).unwrap();
        let mut host = Buffer::new(8 << 30, 0).unwrap();
        host.copy_from(0, &device, 4 << 30, 4 << 30);
        device.copy_from(12 << 30, &host, 1 << 30, 2 << 30);
        assert_eq!((device.data_chunks(), host.data_chunks()), (0, 0));
        // A stamp crosses as bytes; a write of a chunk's own value materialises nothing.
        device.fill(CHUNK as u64 - 1, 2, 9);
        host.copy_from(100, &device, CHUNK as u64 - 2, 4);
        assert_eq!(host.read(100, 4).unwrap(), [0, 9, 9, 0]);
        assert_eq!(host.data_chunks(), 1);
        host.write(5 * CHUNK as u64, &[0; 100]);
        assert_eq!(host.data_chunks(), 1);
    }
}

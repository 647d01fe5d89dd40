//! Fused table writes (`scatter_tables`, `copy_table_spans`): one launch for every table
//! of a call, packing only the last write of each (table, index) ([`LastWins`], one
//! bitmap per distinct table, cleared after the call by the words it set), so no two GPU
//! threads write one entry.

use super::{CudaDevice, ListKind, State, per_item};
use crate::driver::{Arg, Kernel};
use crate::{Error, TableId, TableScatter, TableSpans};

impl CudaDevice {
    /// The one launch of a fused table write (`scatter_tables`, `copy_table_spans`),
    /// whose every index was checked inside its table: the scatter kernel's list is each
    /// table's address, then (slot, index, value) triples, each entry once (its last
    /// write, as on the CPU), so no two threads write one entry.
    pub(super) fn write_entries<W: TableWrites>(
        &self,
        st: &mut State,
        op: &'static str,
        parts: &[W],
    ) -> Result<(), Error> {
        let State {
            tables, pack, seen, ..
        } = st;
        pack.clear();
        for part in parts {
            pack.extend_from_slice(&tables.get(part.table().0)?.ptr.to_le_bytes());
        }
        let k = parts.len() as u64;
        seen.pack(parts, |t| tables.get(t.0).map_or(0, |a| a.len), pack);
        let n = (pack.len() as u64 - 8 * k) / 12;
        if n == 0 {
            return Ok(());
        }
        // Kernel `unikv_scatter_tables(const unsigned long long* list, unsigned long long
        // k, unsigned long long n)`.
        let kernel = Kernel::ScatterTables;
        self.launch_with_list(st, op, ListKind::Data, kernel, per_item(n), |list| {
            vec![Arg::U64(list), Arg::U64(k), Arg::U64(n)]
        })
    }
}

/// One table's part of a fused write of table entries (a [`TableScatter`] or a
/// [`TableSpans`]), as [`LastWins`] reads it.
pub(super) trait TableWrites {
    /// The table written.
    fn table(&self) -> TableId;
    /// Calls `f(index, value)` for every write, the last first.
    fn each_last_first(&self, f: impl FnMut(u32, i32));
    /// Calls `f(start, end)` for ranges of indices that cover every write.
    fn each_range(&self, f: impl FnMut(u32, u32));
}

impl TableWrites for TableScatter<'_> {
    fn table(&self) -> TableId {
        self.table
    }
    fn each_last_first(&self, mut f: impl FnMut(u32, i32)) {
        for &(index, value) in self.entries.iter().rev() {
            f(index, value);
        }
    }
    fn each_range(&self, mut f: impl FnMut(u32, u32)) {
        for &(index, _) in self.entries {
            f(index, index + 1);
        }
    }
}

impl TableWrites for TableSpans<'_> {
    fn table(&self) -> TableId {
        self.table
    }
    fn each_last_first(&self, mut f: impl FnMut(u32, i32)) {
        for &(start, len) in self.spans.iter().rev() {
            for index in (start..start + len).rev() {
                f(index, self.values[index as usize]);
            }
        }
    }
    fn each_range(&self, mut f: impl FnMut(u32, u32)) {
        for &(start, len) in self.spans {
            f(start, start + len);
        }
    }
}

/// The writes of a fused table op that survive "the last write of an entry wins",
/// found through one bitmap per distinct table of the call (no hashing, no sort), so no
/// two GPU threads write one entry. The bitmaps are all zero between calls: a call
/// clears only the words it set, so it costs O(its writes), not O(its tables' lengths).
#[derive(Debug, Default)]
pub(super) struct LastWins {
    words: Vec<u64>,
    /// Each part's first word in `words` (a table named twice shares its bitmap).
    bases: Vec<usize>,
}

impl LastWins {
    /// Makes room for one more table of `len` entries, at its allocation, so that any
    /// call's distinct tables fit without growing on the op path.
    pub(super) fn room_for(&mut self, len: usize) {
        self.words.resize(self.words.len() + len.div_ceil(64), 0);
    }

    /// Appends to `pack` the (slot, index, value) triple of every write of `parts` that
    /// no later write of the same table and index overrides, the last first. `len` gives
    /// a table's length; every index was checked inside it.
    fn pack<W: TableWrites>(
        &mut self,
        parts: &[W],
        len: impl Fn(TableId) -> usize,
        pack: &mut Vec<u8>,
    ) {
        let LastWins { words, bases } = self;
        bases.clear();
        let mut total = 0;
        for (slot, part) in parts.iter().enumerate() {
            let first = parts[..slot].iter().position(|e| e.table() == part.table());
            let base = match first {
                Some(first) => bases[first],
                None => {
                    let base = total;
                    total += len(part.table()).div_ceil(64);
                    base
                }
            };
            bases.push(base);
        }
        // Not reached when `room_for` saw every table: the op path then allocates nothing.
        if words.len() < total {
            words.resize(total, 0);
        }
        for (slot, part) in parts.iter().enumerate().rev() {
            let base = bases[slot];
            part.each_last_first(|index, value| {
                let (word, bit) = (&mut words[base + (index / 64) as usize], 1 << (index % 64));
                if *word & bit == 0 {
                    *word |= bit;
                    let mut triple = [0; 12];
                    for (out, w) in
                        triple
                            .chunks_exact_mut(4)
                            .zip([slot as u32, index, value as u32])
                    {
                        out.copy_from_slice(&w.to_le_bytes());
                    }
                    pack.extend_from_slice(&triple);
                }
            });
        }
        // Every word this call set is zeroed (zero before the call: no other bit in it).
        for (part, &base) in parts.iter().zip(bases.iter()) {
            part.each_range(|start, end| {
                if start < end {
                    let range = base + (start / 64) as usize..=base + ((end - 1) / 64) as usize;
                    words[range].fill(0);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes a packed list of (slot, index, value) triples.
    fn triples(pack: &[u8]) -> Vec<(u32, u32, i32)> {
        pack.chunks_exact(12)
            .map(|t| {
                let w = |i: usize| u32::from_le_bytes([t[i], t[i + 1], t[i + 2], t[i + 3]]);
                (w(0), w(4), w(8) as i32)
            })
            .collect()
    }

    /// Every entry written once, with the value of its last write in call order: within a
    /// part, across parts naming one table (spans of different host values overlapping,
    /// which no launch order of the kernel could otherwise resolve), and again in a second
    /// call (the bitmaps were cleared).
    #[test]
    fn a_fused_write_keeps_each_entrys_last_write_once() {
        let (a, b) = (TableId(1), TableId(2));
        let len = |t: TableId| if t == a { 200 } else { 70 };
        let mut seen = LastWins::default();
        let (old, new) = ([1; 200], [2; 200]);
        let parts = [
            TableSpans {
                table: a,
                values: &old,
                spans: &[(60, 10), (65, 10), (130, 1)],
            },
            TableSpans {
                table: b,
                values: &old,
                spans: &[(63, 3)],
            },
            TableSpans {
                table: a,
                values: &new,
                spans: &[(68, 4), (0, 0)],
            },
        ];
        for _ in 0..2 {
            let mut pack = Vec::new();
            seen.pack(&parts, len, &mut pack);
            let mut got = triples(&pack);
            got.sort_unstable();
            let mut want: Vec<(u32, u32, i32)> = (60..68)
                .map(|i| (0, i, 1))
                .chain([(0, 72, 1), (0, 73, 1), (0, 74, 1), (0, 130, 1)])
                .chain((63..66).map(|i| (1, i, 1)))
                .chain((68..72).map(|i| (2, i, 2)))
                .collect();
            want.sort_unstable();
            assert_eq!(got, want);
        }
        assert!(
            seen.words.iter().all(|&w| w == 0),
            "the bitmaps are left clear"
        );
        let entries = [(5, 1), (69, 2), (5, 3)];
        let mut pack = Vec::new();
        seen.pack(
            &[TableScatter {
                table: b,
                entries: &entries,
            }],
            len,
            &mut pack,
        );
        assert_eq!(triples(&pack), [(0, 5, 3), (0, 69, 2)]);
    }
}

//! Unit tests of the CPU backend: allocation, table writes and reads, fills and span
//! moves (the translation family and row gathers are in `tests/translate.rs`), each an
//! exact worked example or a comparison with a naive reference, and every refusal
//! checked to have written nothing.

use super::*;
use unikv_invariants::testing::page_sizes;

mod translate;

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

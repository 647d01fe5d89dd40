//! Unit tests of the CPU backend's translations (`translate`, `translate_windows`,
//! `translate_lanes`), its kernel hook and its row gathers: worked examples of what each
//! writes, the sink rules, and every malformed call refused before anything is written.

use super::*;

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
fn lane_runs(lanes: &[i32], firsts: Option<&[i32]>, starts: &[i32], out_len: usize) -> Vec<i32> {
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

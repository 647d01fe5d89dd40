//! Parity of the CUDA backend with the CPU reference: the same ops on the same inputs
//! give the same tables, bytes and errors.
//!
//! Every scenario runs on the CUDA backend over its emulated driver (in every build, so
//! the backend's packing, staging ring and checks are tested on the CPU), once with the
//! stream running and once with it stalled as if the GPU were busy, and then on a GPU.
//! Without a usable GPU (no `cuda` feature, no driver, no device, no NVRTC) the GPU half
//! prints `SKIPPED: no CUDA device (...)` and passes, unless `UNIKV_REQUIRE_GPU=1`, in
//! which case it fails. `cargo xtask gpu` runs these on a GPU machine.

use unikv_invariants::testing::page_sizes;
use unikv_kernels::{
    ByteSpan, BytesId, CpuDevice, CudaDevice, Device, DriverCall, DriverRecord, Error, HostCopy,
    HostSync, LaneTranslate, Readback, RowGather, SpanMove, TableId, TableScatter, TableSpans,
    Translate, WindowTranslate,
};

fn gpu_required() -> bool {
    std::env::var("UNIKV_REQUIRE_GPU").is_ok_and(|v| v.trim() == "1")
}

/// The GPU, or `None` after a loud skip line when there is none.
fn cuda_or_skip(test: &str) -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(
            e @ (Error::NotCompiledWithCuda
            | Error::NoCudaDriver
            | Error::NoCudaDevice { .. }
            | Error::NoNvrtc),
        ) => {
            assert!(!gpu_required(), "UNIKV_REQUIRE_GPU=1 but: {e}");
            eprintln!("SKIPPED: no CUDA device ({e}) [{test}]");
            None
        }
        Err(e) => panic!("a CUDA device is present but unusable: {e}"),
    }
}

/// Runs `scenario` on the CPU reference (which must succeed: the scenario itself is
/// checked even where no GPU is) and on the GPU, and asserts equal results.
fn check_parity<T: PartialEq + std::fmt::Debug>(
    test: &str,
    scenario: impl Fn(&dyn Readback) -> Result<T, Error>,
) {
    let on_cpu = scenario(&CpuDevice::new()).map_err(|e| format!("{e:?}"));
    assert!(
        on_cpu.is_ok(),
        "{test}: the scenario fails on the CPU: {on_cpu:?}"
    );
    let as_cpu = |e: Error| {
        format!("{e:?}")
            .replace("emulated-cuda", "cpu")
            .replace("cuda:0", "cpu")
            .replace("\"cuda\"", "\"cpu\"")
    };
    let emulated = CudaDevice::emulated();
    let on_emulated = scenario(&emulated).map_err(as_cpu);
    assert_eq!(
        on_emulated, on_cpu,
        "{test}: the CUDA backend (emulated driver) differs from the CPU reference"
    );
    // Stalled, every op's work waits in the stream, reading its staged arguments only
    // when it runs (at the read-back): staging memory reused too early shows here.
    let stalled = CudaDevice::emulated();
    assert!(stalled.stall_stream());
    let on_stalled = scenario(&stalled).map_err(as_cpu);
    assert_eq!(
        on_stalled, on_cpu,
        "{test}: the CUDA backend on a stalled stream differs from the CPU reference"
    );
    let Some(gpu) = cuda_or_skip(test) else {
        return;
    };
    let on_gpu = scenario(&gpu).map_err(as_cpu);
    assert_eq!(
        on_gpu, on_cpu,
        "{test}: CUDA differs from the CPU reference"
    );
}

/// A small deterministic generator (xorshift64*), so no test depends on `rand`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn sync() -> HostSync {
    HostSync::acquire("parity test")
}

fn table(dev: &dyn Readback, values: &[i32]) -> Result<TableId, Error> {
    let t = dev.alloc_table(values.len(), 0)?;
    dev.upload_table(t, 0, values)?;
    Ok(t)
}

/// A buffer holding `pattern`. The trait has no byte upload: one fill per byte value,
/// each over the single-byte spans that hold that value.
fn bytes(dev: &dyn Readback, pattern: &[u8]) -> Result<BytesId, Error> {
    let buf = dev.alloc_bytes(pattern.len() as u64, 0)?;
    let mut by_value: Vec<Vec<ByteSpan>> = vec![Vec::new(); 256];
    for (i, &b) in pattern.iter().enumerate() {
        by_value[b as usize].push(ByteSpan {
            offset: i as u64,
            len: 1,
        });
    }
    for (value, spans) in by_value.iter().enumerate() {
        dev.fill_spans(buf, spans, value as u8)?;
    }
    Ok(buf)
}

#[test]
fn translate_matches_cpu() {
    for ps in page_sizes() {
        let mut rng = Rng(0x9E37_79B9 + u64::from(ps));
        let pages = 64;
        // Sink, tombstones, unbound pages and bound ones.
        let v2p: Vec<i32> = (0..pages)
            .map(|v| match (v, rng.below(4)) {
                (0, _) => 0,
                (_, 0) => -1,
                (_, 1) => 0,
                _ => 1 + rng.below(1000) as i32,
            })
            .collect();
        // Ids in range, past the end of v2p, zero and negative.
        let ids: Vec<i32> = (0..3000)
            .map(|_| rng.below(pages as u64 * u64::from(ps) * 5 / 4) as i32 - 8)
            .collect();
        check_parity("translate", |dev| {
            let (v2p, ids_t) = (table(dev, &v2p)?, table(dev, &ids)?);
            let out_width = ids.len() + 77;
            let out = dev.alloc_table(out_width, -7)?;
            dev.translate(&Translate {
                v2p,
                ids: ids_t,
                n: ids.len(),
                page_size: ps,
                stride: 3 * ps + 1,
                out,
                out_width,
            })?;
            dev.read_table(&sync(), out, 0, out_width)
        });
    }
}

#[test]
fn translate_errors_match_cpu() {
    check_parity("translate errors", |dev| {
        let v2p = table(dev, &[0, 1])?;
        let ids = table(dev, &[1, 2, 3])?;
        let out = dev.alloc_table(4, -7)?;
        let ok = Translate {
            v2p,
            ids,
            n: 3,
            page_size: 2,
            stride: 2,
            out,
            out_width: 4,
        };
        let bad = [
            Translate { page_size: 0, ..ok },
            Translate { n: 4, ..ok },
            Translate { out_width: 5, ..ok },
            Translate { out: ids, ..ok },
        ];
        let errors: Vec<String> = bad
            .iter()
            .map(|args| format!("{:?}", dev.translate(args)))
            .collect();
        Ok((errors, dev.read_table(&sync(), out, 0, 4)?))
    });
}

/// The host tier's round trips: pages written back to a host buffer, their device ranges
/// reused at once (stream order keeps each copy ahead), pages loaded back elsewhere, and
/// the refusals, as the CPU does them.
#[test]
fn host_copies_match_cpu() {
    let page = 4096 + 5; // odd length: no alignment assumptions
    let mut rng = Rng(11);
    let pattern: Vec<u8> = (0..12 * page).map(|_| rng.next() as u8).collect();
    check_parity("host copies", |dev| {
        let buf = bytes(dev, &pattern)?;
        let p = page as u64;
        let host = dev.alloc_host(8 * p + 3)?;
        let copy = |device, host, len| HostCopy { device, host, len };
        let mut rng = Rng(5);
        for round in 0..4 {
            // Write back three random pages into host slots round..round + 3 (the first
            // two adjacent on both sides when the pages are), and reuse their ranges.
            let pages: Vec<u64> = (0..3).map(|_| rng.below(12)).collect();
            let slots = [round, round + 1, round + 3];
            let out: Vec<HostCopy> = pages
                .iter()
                .zip(slots)
                .map(|(&page, slot)| copy(page * p, slot * p + 3, p))
                .collect();
            dev.copy_device_to_host(buf, host, &out)?;
            let reused: Vec<ByteSpan> = pages
                .iter()
                .map(|&page| ByteSpan {
                    offset: page * p,
                    len: p,
                })
                .collect();
            dev.fill_spans(buf, &reused, round as u8)?;
            // Load slots back into two other pages (a part of one, a whole other).
            let back = [copy(((round + 5) % 12) * p + 7, slots[0] * p + 3, p - 9)];
            dev.copy_host_to_device(host, buf, &back)?;
            dev.copy_host_to_device(host, buf, &[copy(11 * p, slots[2] * p + 3, p)])?;
        }
        let event = dev.record_copy_event()?;
        let s = sync();
        let (host_bytes, device) = (
            dev.read_host(&s, host, 0, 8 * p + 3)?,
            dev.read_bytes(&s, buf, 0, 12 * p)?,
        );
        let done = dev.copy_event_done(event)?; // after a read-back: done on every backend
        let refusals = [
            dev.copy_device_to_host(buf, host, &[copy(11 * p, 8 * p, 4)]),
            dev.copy_host_to_device(host, buf, &[copy(0, 0, 8), copy(4, 64, 8)]),
        ]
        .map(|r| format!("{r:?}"));
        let unchanged = dev.read_host(&s, host, 0, 8 * p + 3)? == host_bytes;
        dev.free_copy_event(event)?;
        dev.free_host(host)?;
        Ok((host_bytes, device, done, refusals, unchanged))
    });
}

#[test]
fn move_spans_matches_cpu() {
    let envelope = 4096 + 3; // odd length: no alignment assumptions
    let mut rng = Rng(7);
    let pattern: Vec<u8> = (0..16 * envelope).map(|_| rng.next() as u8).collect();
    check_parity("move_spans", |dev| {
        let buf = bytes(dev, &pattern)?;
        let e = envelope as u64;
        // A compaction 9 → 5, 12 → 6 and a slide 0 → 14, a source read twice (0 → 15),
        // a move to a byte offset that is not a multiple of the envelope, and an empty
        // move. No destination overlaps a source or another destination.
        let moves = [
            SpanMove {
                src: 9 * e,
                dst: 5 * e,
                len: e,
            },
            SpanMove {
                src: 12 * e,
                dst: 6 * e,
                len: e,
            },
            SpanMove {
                src: 0,
                dst: 14 * e,
                len: e,
            },
            SpanMove {
                src: 0,
                dst: 15 * e,
                len: e,
            },
            SpanMove {
                src: 2 * e + 7,
                dst: 10 * e + 100,
                len: e,
            },
            SpanMove {
                src: 3 * e,
                dst: 4 * e,
                len: 0,
            },
        ];
        dev.move_spans(buf, &moves)?;
        // Refused by both, naming the same ranges: destinations that overlap, and a
        // destination that is another move's source.
        let overlapping = [
            SpanMove {
                src: 0,
                dst: e,
                len: e,
            },
            SpanMove {
                src: 0,
                dst: e + 1,
                len: e,
            },
        ];
        let onto_a_source = [
            SpanMove {
                src: 9 * e,
                dst: 5 * e,
                len: e,
            },
            SpanMove {
                src: 12 * e,
                dst: 9 * e,
                len: e,
            },
        ];
        let rejected = format!(
            "{:?} {:?}",
            dev.move_spans(buf, &overlapping),
            dev.move_spans(buf, &onto_a_source)
        );
        Ok((
            rejected,
            dev.read_bytes(&sync(), buf, 0, pattern.len() as u64)?,
        ))
    });
}

#[test]
fn fill_spans_matches_cpu() {
    check_parity("fill_spans", |dev| {
        let buf = dev.alloc_bytes(1 << 20, 0xAA)?;
        let spans = [
            ByteSpan { offset: 0, len: 1 },
            ByteSpan {
                offset: 17,
                len: 65_536,
            },
            ByteSpan {
                offset: 60_000,
                len: 10_000,
            }, // overlaps the previous one
            ByteSpan {
                offset: (1 << 20) - 5,
                len: 5,
            },
            ByteSpan {
                offset: 300_000,
                len: 0,
            },
        ];
        dev.fill_spans(buf, &spans, 0)?;
        let past_end = [ByteSpan {
            offset: (1 << 20) - 1,
            len: 2,
        }];
        let rejected = format!("{:?}", dev.fill_spans(buf, &past_end, 1));
        Ok((rejected, dev.read_bytes(&sync(), buf, 0, 1 << 20)?))
    });
}

#[test]
fn scatter_and_gather_match_cpu() {
    let mut rng = Rng(42);
    let len = 5000;
    // Duplicated indices: the last pair wins on both backends.
    let entries: Vec<(u32, i32)> = (0..20_000)
        .map(|_| (rng.below(len as u64) as u32, rng.next() as i32))
        .collect();
    // Indices inside the table, negative and past its end.
    let indices: Vec<i32> = (0..7000)
        .map(|_| rng.below(len as u64 + 200) as i32 - 100)
        .collect();
    check_parity("scatter/gather", |dev| {
        let t = dev.alloc_table(len, -1)?;
        dev.scatter_table(t, &entries)?;
        let rejected = format!("{:?}", dev.scatter_table(t, &[(0, 1), (len as u32, 2)]));
        let idx = table(dev, &indices)?;
        let out = dev.alloc_table(indices.len() + 3, 9)?;
        dev.gather_table(t, idx, indices.len(), out)?;
        Ok((
            rejected,
            dev.read_table(&sync(), t, 0, len)?,
            dev.read_table(&sync(), out, 0, indices.len() + 3)?,
        ))
    });
}

/// A verify step's device work: its write windows (two sides and a state window in one
/// table, from device-side starts) and a tree verify's row gather, at every page size;
/// then each malformed call refused the same way, before it writes anything.
#[test]
fn verify_windows_and_row_gathers_match_cpu() {
    for ps in page_sizes() {
        let ps = ps as u64;
        let mut rng = Rng(7 + ps);
        let (batch, rows, width) = (40usize, 16usize, 5usize);
        let pages = 48u64;
        let v2p: Vec<i32> = (0..pages)
            .map(|_| match rng.below(5) {
                0 => 0,
                1 => -1,
                _ => rng.below(pages) as i32 + 1,
            })
            .collect();
        let ids: Vec<i32> = (0..batch * rows)
            .map(|_| rng.below(pages * ps + 4) as i32 - 2)
            .collect();
        let starts: Vec<i32> = (0..batch)
            .map(|_| rng.below(rows as u64 + 4) as i32 - 1)
            .collect();
        // Gather: distinct kernel ids per position, page-major rows of 3 layers' K and V.
        let (rows_per_token, row_bytes) = (6u32, 16u64);
        let stride = u64::from(rows_per_token) * ps;
        let mut free: Vec<i32> = (stride..9 * stride)
            .filter(|k| k % stride < ps)
            .map(|k| k as i32)
            .collect();
        let kernel_ids: Vec<i32> = (0..batch * width)
            .map(|_| match free.len() {
                0 => 0,
                n => free.swap_remove(rng.below(n as u64) as usize),
            })
            .collect();
        let paths: Vec<i32> = (0..batch)
            .flat_map(|_| {
                let mut path = vec![0];
                let mut at = 0;
                while at + 1 < width as i32 && rng.below(4) != 0 {
                    at += 1 + rng.below(2) as i32;
                    path.push(at.min(width as i32 - 1));
                }
                path.dedup();
                path.resize(width, -1);
                path
            })
            .collect();
        let total = 9 * stride * row_bytes;
        let pattern: Vec<u8> = (0..total).map(|_| rng.next() as u8).collect();
        check_parity("verify windows and row gathers", |dev| {
            let (t_v2p, t_ids, t_starts) =
                (table(dev, &v2p)?, table(dev, &ids)?, table(dev, &starts)?);
            let out = dev.alloc_table(3 * batch * width + 2, 9)?;
            let window = WindowTranslate {
                v2p: t_v2p,
                ids: t_ids,
                ids_at: 0,
                rows,
                starts: t_starts,
                starts_at: 0,
                bias: 0,
                lens: None,
                batch,
                width,
                page_size: ps as u32,
                stride: (2 * ps) as u32,
                out,
                out_at: 1,
            };
            let windows = [
                window,
                WindowTranslate {
                    bias: 1,
                    stride: 3,
                    out_at: 1 + batch * width,
                    // Device data as live lengths: some negative, some past the width.
                    lens: Some((t_starts, 0)),
                    ..window
                },
                WindowTranslate {
                    bias: -3,
                    width: 1,
                    page_size: 1,
                    stride: 1,
                    out_at: 1 + 2 * batch * width,
                    ..window
                },
            ];
            dev.translate_windows(&windows)?;
            let buf = bytes(dev, &pattern)?;
            let (t_kernel, t_paths) = (table(dev, &kernel_ids)?, table(dev, &paths)?);
            let gather = RowGather {
                buf,
                ids: t_kernel,
                ids_at: 0,
                path: t_paths,
                path_at: 0,
                batch,
                width,
                page_size: ps as u32,
                rows_per_token,
                row_bytes,
            };
            // Two gathers in one op apply in call order (the second re-gathers a part).
            let narrow = RowGather {
                rows_per_token: 1,
                row_bytes: 8,
                ..gather
            };
            dev.gather_rows(&[gather, narrow])?;
            let refused: Vec<String> = [
                dev.translate_windows(&[WindowTranslate {
                    out: t_starts,
                    ..window
                }]),
                dev.translate_windows(&[
                    window,
                    WindowTranslate {
                        out_at: 2,
                        ..window
                    },
                ]),
                dev.translate_windows(&[WindowTranslate {
                    batch: batch + 1,
                    ..window
                }]),
                dev.translate_windows(&[WindowTranslate {
                    page_size: 0,
                    ..window
                }]),
                dev.gather_rows(&[
                    gather,
                    RowGather {
                        width: width + 1,
                        ..gather
                    },
                ]),
                dev.gather_rows(&[RowGather {
                    page_size: 0,
                    ..gather
                }]),
                dev.gather_rows(&[RowGather {
                    row_bytes: u64::MAX / 2,
                    ..gather
                }]),
            ]
            .into_iter()
            .map(|r| format!("{:?}", r.expect_err("a malformed verify op is refused")))
            .collect();
            Ok((
                refused,
                dev.read_table(&sync(), out, 0, 3 * batch * width + 2)?,
                dev.read_bytes(&sync(), buf, 0, total)?,
            ))
        });
    }
}

/// Prefix sums from `first` of `batch` runs of `0..=longest` entries each.
fn prefix_sums(rng: &mut Rng, first: i32, batch: usize, longest: u64) -> Vec<i32> {
    let mut starts = vec![first];
    for _ in 0..batch {
        let at = *starts.last().unwrap();
        starts.push(at + rng.below(longest + 1) as i32);
    }
    starts
}

/// Two decode steps' page tables from persistent lanes, at every page size: a FULL
/// table (each request's lane from entry 0, ragged runs, the last past the output) and
/// an SWA window (from device-side first entries, runs that start before the output) in
/// one op; then the host writes only each lane's new pages and the same op runs again;
/// then each malformed call refused the same way, before it writes anything.
#[test]
fn lane_translations_match_cpu() {
    for ps in page_sizes() {
        let mut rng = Rng(0x1A7E5 + u64::from(ps));
        let (lane_len, lane_count, batch) = (32usize, 24usize, 20usize);
        let pages = 96u64;
        let v2p: Vec<i32> = (0..pages)
            .map(|_| match rng.below(5) {
                0 => 0,
                1 => -1,
                _ => 1 + rng.below(1000) as i32,
            })
            .collect();
        // Whole lanes and a partial one; pages in and outside v2p, the sink, negative.
        let rows: Vec<i32> = (0..lane_count * lane_len + 5)
            .map(|_| rng.below(pages + 6) as i32 - 2)
            .collect();
        // Per request: its lane (some outside the lanes), its window's first entry (some
        // before or past the lane), the FULL runs' and the window's prefix sums.
        let lanes: Vec<i32> = (0..batch)
            .map(|_| rng.below(lane_count as u64 + 3) as i32 - 1)
            .collect();
        let firsts: Vec<i32> = (0..batch)
            .map(|_| rng.below(lane_len as u64 + 8) as i32 - 4)
            .collect();
        let full_starts = prefix_sums(&mut rng, 0, batch, lane_len as u64);
        let window_starts = prefix_sums(&mut rng, -3, batch, 8);
        let full_len = full_starts[batch] as usize - 5;
        let window_len = window_starts[batch] as usize;
        // The next step's new pages: one entry of each request's lane.
        let grown: Vec<(u32, i32)> = (0..lane_count)
            .map(|l| {
                let entry = l * lane_len + rng.below(lane_len as u64) as usize;
                (entry as u32, 1 + rng.below(pages - 1) as i32)
            })
            .collect();
        let meta: Vec<i32> = [&lanes[..], &firsts, &full_starts, &window_starts].concat();
        check_parity("lane translations", |dev| {
            let (t_v2p, t_rows, t_meta) =
                (table(dev, &v2p)?, table(dev, &rows)?, table(dev, &meta)?);
            let out = dev.alloc_table(full_len + window_len + 3, -9)?;
            let full = LaneTranslate {
                v2p: t_v2p,
                rows: t_rows,
                lane_len,
                lanes: (t_meta, 0),
                firsts: None,
                starts: (t_meta, 2 * batch),
                batch,
                stride: 2 * ps + 1,
                out,
                out_at: 1,
                out_len: full_len,
            };
            let window = LaneTranslate {
                firsts: Some((t_meta, batch)),
                starts: (t_meta, 3 * batch + 1),
                stride: ps,
                out_at: 2 + full_len,
                out_len: window_len,
                ..full
            };
            dev.translate_lanes(&[full, window])?;
            let s = sync();
            let first_step = dev.read_table(&s, out, 0, full_len + window_len + 3)?;
            dev.scatter_table(t_rows, &grown)?;
            dev.translate_lanes(&[window, full])?;
            // No lanes; starts short of the last prefix sum; an output over the window's
            // last start; `rows` as an output; outputs that overlap; a stride past i32.
            let refused: Vec<String> = [
                dev.translate_lanes(&[
                    full,
                    LaneTranslate {
                        lane_len: 0,
                        ..window
                    },
                ]),
                dev.translate_lanes(&[LaneTranslate {
                    starts: (t_meta, 3 * batch + 2),
                    ..window
                }]),
                dev.translate_lanes(&[LaneTranslate {
                    out: t_meta,
                    out_at: 4 * batch + 1,
                    out_len: 1,
                    ..window
                }]),
                dev.translate_lanes(&[
                    LaneTranslate {
                        out: t_meta,
                        out_at: 4 * batch + 2,
                        out_len: 0,
                        ..window
                    },
                    LaneTranslate {
                        out: t_rows,
                        out_len: 1,
                        ..full
                    },
                ]),
                dev.translate_lanes(&[
                    full,
                    LaneTranslate {
                        out_at: full_len,
                        ..window
                    },
                ]),
                dev.translate_lanes(&[LaneTranslate {
                    stride: u32::MAX,
                    ..full
                }]),
            ]
            .into_iter()
            .map(|r| format!("{:?}", r.expect_err("a malformed lane call is refused")))
            .collect();
            let second_step = dev.read_table(&s, out, 0, full_len + window_len + 3)?;
            // Pages and sinks in both steps; the new pages show in the second.
            let bound = first_step.iter().filter(|&&k| k > 0).count();
            assert!(bound > batch && bound + batch < first_step.len(), "{bound}");
            assert_ne!(first_step, second_step);
            Ok((
                first_step,
                refused,
                second_step,
                dev.read_table(&s, t_meta, 0, meta.len())?,
            ))
        });
    }
}

/// The tables of a step's captured translations, on one device: the `v2p` mirror, four
/// lanes of eight virtual pages, the header (each request's lane, first entry, FULL and
/// SWA output starts, window start and live length) and the two outputs.
#[derive(Clone, Copy)]
struct StepTables {
    v2p: TableId,
    rows: TableId,
    meta: TableId,
    out: TableId,
    windows: TableId,
}

const LANES: usize = 4;
const LANE_LEN: usize = 8;
// Offsets in `StepTables::meta`, and its length.
const META_LANES: usize = 0;
const META_FIRSTS: usize = 4;
const META_FULL: usize = 8;
const META_SWA: usize = 13;
const META_WIN: usize = 18;
const META_LENS: usize = 22;
const META_LEN: usize = 26;
const FULL_OUT: usize = 20;
const SWA_OUT: usize = 12;
const WIDTH: usize = 3;

impl StepTables {
    fn new(dev: &dyn Device) -> Result<StepTables, Error> {
        Ok(StepTables {
            v2p: dev.alloc_table(64, 0)?,
            rows: dev.alloc_table(LANES * LANE_LEN, 0)?,
            meta: dev.alloc_table(META_LEN, 0)?,
            out: dev.alloc_table(FULL_OUT + SWA_OUT, -1)?,
            windows: dev.alloc_table(LANES * WIDTH, -1)?,
        })
    }

    /// A step's FULL and SWA page tables, as the facade's step metadata translates them.
    fn lanes(&self) -> [LaneTranslate; 2] {
        let full = LaneTranslate {
            v2p: self.v2p,
            rows: self.rows,
            lane_len: LANE_LEN,
            lanes: (self.meta, META_LANES),
            firsts: None,
            starts: (self.meta, META_FULL),
            batch: LANES,
            stride: 3,
            out: self.out,
            out_at: 0,
            out_len: FULL_OUT,
        };
        let swa = LaneTranslate {
            firsts: Some((self.meta, META_FIRSTS)),
            starts: (self.meta, META_SWA),
            stride: 5,
            out_at: FULL_OUT,
            out_len: SWA_OUT,
            ..full
        };
        [full, swa]
    }

    /// A verify's write ids: a window of each lane from a device-side start.
    fn window(&self) -> WindowTranslate {
        WindowTranslate {
            v2p: self.v2p,
            ids: self.rows,
            ids_at: 0,
            rows: LANE_LEN,
            starts: self.meta,
            starts_at: META_WIN,
            bias: 1,
            lens: Some((self.meta, META_LENS)),
            batch: LANES,
            width: WIDTH,
            page_size: 2,
            stride: 7,
            out: self.windows,
            out_at: 0,
        }
    }

    /// One step's eager inputs, drawn from `rng`: some mirror entries and lane pages
    /// change (scatters), the header is uploaded whole.
    fn write_inputs(&self, dev: &dyn Device, rng: &mut Rng) -> Result<(), Error> {
        let v2p: Vec<(u32, i32)> = (0..4)
            .map(|_| (rng.below(64) as u32, rng.below(40) as i32 - 4))
            .collect();
        let rows: Vec<(u32, i32)> = (0..3)
            .map(|_| {
                let at = rng.below((LANES * LANE_LEN) as u64) as u32;
                (at, rng.below(70) as i32 - 2)
            })
            .collect();
        dev.scatter_tables(&[
            TableScatter {
                table: self.v2p,
                entries: &v2p,
            },
            TableScatter {
                table: self.rows,
                entries: &rows,
            },
        ])?;
        let mut meta = vec![0; META_LEN];
        for r in 0..LANES {
            // Lane 4 is past the table (the sink); firsts reach past a lane's end.
            meta[META_LANES + r] = rng.below(LANES as u64 + 1) as i32;
            meta[META_FIRSTS + r] = rng.below(LANE_LEN as u64) as i32;
            meta[META_WIN + r] = rng.below(LANE_LEN as u64 + 2) as i32 - 2;
            meta[META_LENS + r] = rng.below(WIDTH as u64 + 1) as i32;
        }
        // Prefix sums of each request's run (a padding request's is empty); the last may
        // reach past the output, which clips it.
        for (section, most) in [(META_FULL, 7), (META_SWA, 4)] {
            for r in 0..LANES {
                let run = if r == 3 { 0 } else { rng.below(most) as i32 };
                meta[section + r + 1] = meta[section + r] + run;
            }
        }
        dev.upload_table(self.meta, 0, &meta)
    }

    fn read(&self, dev: &dyn Readback) -> Result<(Vec<i32>, Vec<i32>), Error> {
        let s = sync();
        Ok((
            dev.read_table(&s, self.out, 0, FULL_OUT + SWA_OUT)?,
            dev.read_table(&s, self.windows, 0, LANES * WIDTH)?,
        ))
    }
}

/// A decode step's page-table translations (`translate_lanes`, and a verify's
/// `translate_windows`) captured once into a CUDA graph replay with the lanes, starts and
/// mirror as they are at each launch: over 1,000 replays, with the tables written eagerly
/// between them (scatters and an upload, through the staging ring the capture no longer
/// uses), every replay equals an uncaptured run on the CPU reference. The ops whose list
/// is per-step data stay refused during the capture.
#[test]
fn a_captured_lane_translation_replays_with_the_tables_of_each_launch() {
    let test = "a_captured_lane_translation_replays_with_the_tables_of_each_launch";
    for (label, dev) in backends(test) {
        // A small ring wraps every few steps: a list left in it would be overwritten.
        let dev = dev.with_staging(4096).unwrap();
        let tables = StepTables::new(&dev).unwrap();
        let buf = dev.alloc_bytes(64, 0).unwrap();
        let span = ByteSpan { offset: 0, len: 8 };
        let graph = dev
            .capture(|d| {
                let refused = [
                    ("scatter_tables", d.scatter_table(tables.v2p, &[(1, 2)])),
                    ("upload_table", d.upload_table(tables.meta, 0, &[1])),
                    ("fill_spans", d.fill_spans(buf, &[span], 1)),
                    (
                        "move_spans",
                        d.move_spans(
                            buf,
                            &[SpanMove {
                                src: 0,
                                dst: 8,
                                len: 8,
                            }],
                        ),
                    ),
                ];
                for (op, result) in refused {
                    assert!(
                        matches!(result, Err(Error::NotCapturable { op: o }) if o == op),
                        "{label}: {op}"
                    );
                }
                d.translate_lanes(&tables.lanes())?;
                d.translate_windows(&[tables.window()])
            })
            .unwrap();
        let untouched = (vec![-1; FULL_OUT + SWA_OUT], vec![-1; LANES * WIDTH]);
        assert_eq!(tables.read(&dev).unwrap(), untouched, "{label}: not run");
        let cpu = CpuDevice::new();
        let reference = StepTables::new(&cpu).unwrap();
        let (mut rng, mut cpu_rng) = (Rng(0x5EED_0041), Rng(0x5EED_0041));
        let mut live = 0;
        for replay in 0..1000 {
            tables.write_inputs(&dev, &mut rng).unwrap();
            dev.launch_graph(&graph).unwrap();
            reference.write_inputs(&cpu, &mut cpu_rng).unwrap();
            cpu.translate_lanes(&reference.lanes()).unwrap();
            cpu.translate_windows(&[reference.window()]).unwrap();
            let (got, want) = (tables.read(&dev).unwrap(), reference.read(&cpu).unwrap());
            assert_eq!(got, want, "{label}: replay {replay}");
            live += want.0.iter().chain(&want.1).filter(|&&k| k > 0).count();
            dev.end_step().unwrap();
        }
        // The replays translated real pages, not only sinks.
        assert!(live > 1000, "{label}: {live}");
    }
}

/// A captured translation's list belongs to its graph: the capture allocates it (pinned
/// memory and a device buffer), and once the graph drops the step boundary frees both,
/// but only after the stream is past the replays already enqueued. On a stalled stream
/// the replay still waits, so nothing is freed until it ran (a list freed early faults
/// the emulated stream). Captured and dropped again and again, nothing leaks.
#[test]
fn a_dropped_graph_frees_its_lists_once_the_stream_is_past_its_replays() {
    let test = "a_dropped_graph_frees_its_lists_once_the_stream_is_past_its_replays";
    let allocs = |calls: &[DriverRecord]| {
        calls
            .iter()
            .filter(|c| {
                matches!(
                    c.call,
                    DriverCall::PinnedAlloc { .. } | DriverCall::DeviceAlloc { .. }
                )
            })
            .count()
    };
    let frees = |calls: &[DriverRecord]| {
        calls
            .iter()
            .filter(|c| matches!(c.call, DriverCall::PinnedFree | DriverCall::DeviceFree))
            .count()
    };
    for (label, dev) in backends(test) {
        let tables = StepTables::new(&dev).unwrap();
        let mut rng = Rng(7);
        tables.write_inputs(&dev, &mut rng).unwrap();
        dev.trace_driver_calls();
        let graph = dev.capture(|d| d.translate_lanes(&tables.lanes())).unwrap();
        let captured = dev.take_driver_calls();
        assert_eq!(allocs(&captured), 2, "{label}: a pinned and a device list");
        assert!(
            captured
                .iter()
                .filter(|c| matches!(c.call, DriverCall::PinnedAlloc { .. }))
                .all(|c| c.op == "translate_lanes"),
            "{label}"
        );
        let stalled = dev.stall_stream();
        tables.write_inputs(&dev, &mut rng).unwrap();
        dev.launch_graph(&graph).unwrap();
        drop(graph);
        dev.end_step().unwrap();
        let mut released = dev.take_driver_calls();
        if stalled {
            assert_eq!(frees(&released), 0, "{label}: the replay still reads them");
        }
        dev.resume_stream().unwrap();
        let cpu = CpuDevice::new();
        let reference = StepTables::new(&cpu).unwrap();
        let mut cpu_rng = Rng(7);
        for _ in 0..2 {
            reference.write_inputs(&cpu, &mut cpu_rng).unwrap();
        }
        cpu.translate_lanes(&reference.lanes()).unwrap();
        let (got, want) = (tables.read(&dev).unwrap(), reference.read(&cpu).unwrap());
        assert_eq!(got.0, want.0, "{label}: the replay read its list");
        dev.end_step().unwrap();
        released.extend(dev.take_driver_calls());
        assert_eq!(frees(&released), 2, "{label}: both halves freed");
        // Again and again: every list allocated is freed.
        let mut calls = Vec::new();
        for _ in 0..50 {
            let graph = dev
                .capture(|d| {
                    d.translate_lanes(&tables.lanes())?;
                    d.translate_windows(&[tables.window()])
                })
                .unwrap();
            dev.launch_graph(&graph).unwrap();
            drop(graph);
            tables.read(&dev).unwrap(); // the stream is past the replay
            dev.end_step().unwrap();
            calls.extend(dev.take_driver_calls());
        }
        assert_eq!(allocs(&calls), 200, "{label}");
        assert_eq!(frees(&calls), 200, "{label}: nothing leaks");
    }
}

#[test]
fn empty_ops_and_empty_tables_match_cpu() {
    check_parity("empty", |dev| {
        let t = dev.alloc_table(0, 5)?;
        let b = dev.alloc_bytes(0, 5)?;
        dev.upload_table(t, 0, &[])?;
        dev.scatter_table(t, &[])?;
        dev.fill_spans(b, &[], 1)?;
        dev.move_spans(b, &[])?;
        let out = dev.alloc_table(0, 0)?;
        dev.translate(&Translate {
            v2p: t,
            ids: t,
            n: 0,
            page_size: 1,
            stride: 1,
            out,
            out_width: 0,
        })?;
        dev.free_table(t)?;
        // The same error but for the device's name.
        let stale = match dev.free_table(t) {
            Err(Error::UnknownHandle { kind, id, .. }) => Some((kind, id)),
            _ => None,
        };
        Ok((stale, dev.read_bytes(&sync(), b, 0, 0)?))
    });
}

#[cfg(feature = "cuda")]
/// The backend never uses the legacy default stream: its own stream is a created one, an
/// engine's stream carries its ops when handed over, and events order the two without
/// the host waiting.
#[test]
fn an_engine_stream_and_events_order_unikv_work() {
    let Some(own) = cuda_or_skip("an_engine_stream_and_events_order_unikv_work") else {
        return;
    };
    assert!(!own.stream().is_null(), "not the legacy default stream");
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let engine = ctx.new_stream().unwrap();
    let raw = engine.cu_stream() as unikv_kernels::RawStream;
    // SAFETY: `engine` is a stream of GPU 0's primary context, and it outlives `dev`
    // (dropped first, below).
    let dev = unsafe { CudaDevice::on_engine_stream(0, raw) }.unwrap();
    assert_eq!(dev.stream(), raw);
    let t = dev.alloc_table(4, 0).unwrap();
    dev.scatter_table(t, &[(1, 7), (3, 9)]).unwrap();
    let after = dev.record_event().unwrap();
    assert!(!after.raw().is_null());
    // unikv's own stream waits for the engine stream's work, enqueued, not on the host.
    // SAFETY: `after` is a recorded event of GPU 0's context, alive across the call.
    unsafe { own.wait_raw_event(after.raw()) }.unwrap();
    let sync = HostSync::acquire("test: read back the engine stream's work");
    assert_eq!(dev.read_table(&sync, t, 0, 4).unwrap(), [0, 7, 0, 9]);
    drop(dev);
    drop(engine);
}

/// The CUDA backends a check runs on: the emulated driver always, the GPU when present.
fn backends(test: &str) -> Vec<(&'static str, CudaDevice)> {
    let mut all = vec![("emulated", CudaDevice::emulated())];
    all.extend(cuda_or_skip(test).map(|gpu| ("gpu", gpu)));
    all
}

/// About a second of spinning on any current GPU (1-2 GHz SM clocks).
const SPIN_CYCLES: u64 = 2_000_000_000;

/// The no-sync proof: with a long kernel holding the stream, every scheduling-path op
/// returns to the host while that kernel still runs, so none waited for the stream; the
/// results, read back afterwards, equal the CPU reference's.
#[test]
fn every_op_returns_while_the_gpu_is_still_busy() {
    let scenario = |dev: &dyn Readback, busy: &dyn Fn(&str)| -> Result<_, Error> {
        let v2p = dev.alloc_table(64, 0)?;
        let ids = dev.alloc_table(16, 0)?;
        let out = dev.alloc_table(20, -1)?;
        let buf = dev.alloc_bytes(1 << 20, 3)?;
        busy("set-up");
        dev.scatter_table(v2p, &[(1, 3), (2, -1), (3, 5), (1, 4)])?;
        busy("scatter_table");
        dev.upload_table(ids, 0, &[4, 5, 9, 12, 13, 1])?;
        busy("upload_table");
        dev.move_spans(
            buf,
            &[SpanMove {
                src: 0,
                dst: 1 << 19,
                len: 1 << 18,
            }],
        )?;
        busy("move_spans");
        dev.fill_spans(
            buf,
            &[ByteSpan {
                offset: 0,
                len: 1 << 18,
            }],
            0,
        )?;
        busy("fill_spans");
        let args = Translate {
            v2p,
            ids,
            n: 6,
            page_size: 4,
            stride: 8,
            out,
            out_width: 20,
        };
        dev.translate(&args)?;
        busy("translate");
        dev.gather_table(v2p, ids, 6, out)?;
        busy("gather_table");
        let s = sync();
        Ok((
            dev.read_table(&s, out, 0, 20)?,
            dev.read_bytes(&s, buf, 0, 1 << 20)?,
        ))
    };
    let cpu = scenario(&CpuDevice::new(), &|_| {}).unwrap();
    for (label, dev) in backends("every_op_returns_while_the_gpu_is_still_busy") {
        let spin = dev.enqueue_spin(SPIN_CYCLES).unwrap();
        let busy = |op: &str| {
            assert!(
                !spin.is_done().unwrap(),
                "{label}: the spin ended before {op} returned"
            );
        };
        let hazards = dev.sync_hazards();
        let got = scenario(&dev, &busy).unwrap();
        assert!(
            spin.is_done().unwrap(),
            "{label}: the read-back waited for the spin"
        );
        assert_eq!(got, cpu, "{label}");
        // Only the set-up allocations and the read-backs may block.
        assert!(dev.sync_hazards().count >= hazards.count);
    }
}

/// A step's translation captured into a CUDA graph replays with the tables as they are
/// at its launch, and an op whose list is staged per call is refused during capture.
#[test]
fn a_captured_translation_replays_with_the_tables_of_its_launch() {
    for (label, dev) in backends("a_captured_translation_replays_with_the_tables_of_its_launch") {
        let v2p = dev.alloc_table(16, 0).unwrap();
        let ids = dev.alloc_table(8, 0).unwrap();
        let out = dev.alloc_table(8, -1).unwrap();
        let gathered = dev.alloc_table(8, -1).unwrap();
        let args = Translate {
            v2p,
            ids,
            n: 4,
            page_size: 2,
            stride: 4,
            out,
            out_width: 8,
        };
        let graph = dev
            .capture(|d| {
                assert!(matches!(
                    d.scatter_table(v2p, &[(1, 2)]),
                    Err(Error::NotCapturable {
                        op: "scatter_tables"
                    })
                ));
                d.translate(&args)?;
                d.gather_table(v2p, ids, 4, gathered)
            })
            .unwrap();
        let s = sync();
        assert_eq!(
            dev.read_table(&s, out, 0, 8).unwrap(),
            [-1; 8],
            "{label}: captured, not run"
        );
        for (k, table) in [[(1, 3), (2, 5)], [(1, 7), (3, 2)]].iter().enumerate() {
            dev.scatter_table(v2p, table).unwrap();
            dev.upload_table(ids, 0, &[2, 3, 4 + k as i32, 7]).unwrap();
            dev.launch_graph(&graph).unwrap();
            let cpu = CpuDevice::new();
            let (cv, ci) = (table_of(&cpu, 16), table_of(&cpu, 8));
            let (co, cg) = (
                cpu.alloc_table(8, -1).unwrap(),
                cpu.alloc_table(8, -1).unwrap(),
            );
            cpu.scatter_table(cv, &[(1, 3), (2, 5)]).unwrap();
            if k == 1 {
                cpu.scatter_table(cv, table).unwrap();
            }
            cpu.upload_table(ci, 0, &[2, 3, 4 + k as i32, 7]).unwrap();
            cpu.translate(&Translate {
                v2p: cv,
                ids: ci,
                out: co,
                ..args
            })
            .unwrap();
            cpu.gather_table(cv, ci, 4, cg).unwrap();
            for (a, b) in [(out, co), (gathered, cg)] {
                assert_eq!(
                    dev.read_table(&s, a, 0, 8).unwrap(),
                    cpu.read_table(&s, b, 0, 8).unwrap(),
                    "{label}: replay {k}"
                );
            }
        }
    }
}

/// A tree verify's row gather captured into a CUDA graph (with the forward that writes
/// the rows, in an engine) replays with the paths and ids as they are at its launch: a
/// graph captured once serves every step. The paths and ids are per-step data, uploaded
/// eagerly before each replay: an upload is refused during the capture.
#[test]
fn a_captured_row_gather_replays_with_the_paths_of_its_launch() {
    for (label, dev) in backends("a_captured_row_gather_replays_with_the_paths_of_its_launch") {
        let pattern: Vec<u8> = (0..64).collect();
        let buf = bytes(&dev, &pattern).unwrap();
        let (ids, path) = (table_of(&dev, 4), table_of(&dev, 4));
        let gather = RowGather {
            buf,
            ids,
            ids_at: 0,
            path,
            path_at: 0,
            batch: 1,
            width: 4,
            page_size: 4,
            rows_per_token: 2,
            row_bytes: 2,
        };
        let graph = dev
            .capture(|d| {
                assert!(matches!(
                    d.upload_table(path, 0, &[0]),
                    Err(Error::NotCapturable { op: "upload_table" })
                ));
                d.gather_rows(&[gather])
            })
            .unwrap();
        let s = sync();
        assert_eq!(
            dev.read_bytes(&s, buf, 0, 64).unwrap(),
            pattern,
            "{label}: captured, not run"
        );
        let cpu = CpuDevice::new();
        let cpu_buf = bytes(&cpu, &pattern).unwrap();
        let (cpu_ids, cpu_path) = (table_of(&cpu, 4), table_of(&cpu, 4));
        for (step, (kernel_ids, accepted)) in [
            ([1, 2, 3, 8], [0, 2, -1, -1]),
            ([9, 10, 11, 16], [0, 1, 3, -1]),
        ]
        .iter()
        .enumerate()
        {
            let both: [(&dyn Device, TableId, TableId); 2] =
                [(&dev, ids, path), (&cpu, cpu_ids, cpu_path)];
            for (d, i, p) in both {
                d.upload_table(i, 0, kernel_ids).unwrap();
                d.upload_table(p, 0, accepted).unwrap();
            }
            dev.launch_graph(&graph).unwrap();
            cpu.gather_rows(&[RowGather {
                buf: cpu_buf,
                ids: cpu_ids,
                path: cpu_path,
                ..gather
            }])
            .unwrap();
            assert_eq!(
                dev.read_bytes(&s, buf, 0, 64).unwrap(),
                cpu.read_bytes(&s, cpu_buf, 0, 64).unwrap(),
                "{label}: replay {step}"
            );
        }
    }
}

fn table_of(dev: &dyn Device, len: usize) -> TableId {
    dev.alloc_table(len, 0).unwrap()
}

/// Moves, fills and translations at page sizes 1, 16 and 256 of a gpt-oss-sized page
/// (24 layers × K and V × 8 heads × 64 × 2 bytes = 48 KiB per token), timed on the GPU:
/// one table of GB/s against the device's peak (GPU only; printed by `cargo xtask gpu`).
#[test]
fn bandwidth_table() {
    let Some(dev) = cuda_or_skip("bandwidth_table") else {
        return;
    };
    let peak = dev.peak_bandwidth().unwrap_or(f64::NAN);
    let per_token: u64 = 24 * 2 * 8 * 64 * 2;
    let budget: u64 = 8 << 30;
    let s = sync();
    println!("BANDWIDTH peak {:.0} GB/s", peak / 1e9);
    println!(
        "BANDWIDTH {:>6} {:>10} {:>12} {:>10} {:>8}",
        "op", "page size", "bytes", "GB/s", "of peak"
    );
    for ps in [1u64, 16, 256] {
        let envelope = per_token * ps;
        let pages = budget / envelope;
        let buf = dev.alloc_bytes(pages * envelope, 0).unwrap();
        let half = pages / 2;
        let moves: Vec<SpanMove> = (0..half)
            .map(|p| SpanMove {
                src: p * envelope,
                dst: (half + p) * envelope,
                len: envelope,
            })
            .collect();
        let spans: Vec<ByteSpan> = (0..half)
            .map(|p| ByteSpan {
                offset: p * envelope,
                len: envelope,
            })
            .collect();
        let timed = |run: &dyn Fn()| {
            run(); // warm-up
            dev.synchronize(&s).unwrap();
            let started = std::time::Instant::now();
            let reps = 5;
            for _ in 0..reps {
                run();
            }
            dev.synchronize(&s).unwrap();
            started.elapsed().as_secs_f64() / f64::from(reps)
        };
        let moved = 2 * half * envelope; // read + write
        let t = timed(&|| dev.move_spans(buf, &moves).unwrap());
        row("move", ps, moved, t, peak);
        let t = timed(&|| dev.fill_spans(buf, &spans, 0).unwrap());
        row("fill", ps, half * envelope, t, peak);
        dev.free_bytes(buf).unwrap();
        let n = 1 << 24;
        let v2p = dev.alloc_table((n / ps as usize) + 1, 1).unwrap();
        let ids = dev.alloc_table(n, 1).unwrap();
        let out = dev.alloc_table(n, 0).unwrap();
        let args = Translate {
            v2p,
            ids,
            n,
            page_size: ps as u32,
            stride: 1,
            out,
            out_width: n,
        };
        let t = timed(&|| dev.translate(&args).unwrap());
        row("translate", ps, 12 * n as u64, t, peak); // ids + v2p (roughly) + out
        for t in [v2p, ids, out] {
            dev.free_table(t).unwrap();
        }
    }
}

fn row(op: &str, ps: u64, bytes: u64, seconds: f64, peak: f64) {
    let rate = bytes as f64 / seconds;
    println!(
        "BANDWIDTH {op:>6} {ps:>10} {bytes:>12} {:>10.1} {:>7.0}%",
        rate / 1e9,
        100.0 * rate / peak
    );
}

/// Span copies from host tables (the unified pool's mirror upload): overlapping spans
/// and a table named twice copy the host values; a span past the table or past its host
/// values is refused and changes nothing.
#[test]
fn table_span_copies_match_cpu() {
    check_parity("copy_table_spans", |dev| {
        let (a, b) = (dev.alloc_table(12, -1)?, dev.alloc_table(5, -1)?);
        let host_a: Vec<i32> = (0..12).map(|i| 100 + i).collect();
        let host_b = [7, 8, 9, 10, 11];
        dev.copy_table_spans(&[
            TableSpans {
                table: a,
                values: &host_a,
                spans: &[(2, 4), (4, 3), (11, 1), (3, 1)],
            },
            TableSpans {
                table: b,
                values: &host_b,
                spans: &[(1, 2)],
            },
            TableSpans {
                table: a,
                values: &host_a,
                spans: &[(0, 0), (9, 1)],
            },
        ])?;
        let refuse = |copies: &[TableSpans<'_>]| format!("{:?}", dev.copy_table_spans(copies));
        let past_table = refuse(&[
            TableSpans {
                table: b,
                values: &host_b,
                spans: &[(0, 1)],
            },
            TableSpans {
                table: a,
                values: &host_a,
                spans: &[(10, 3)],
            },
        ]);
        let past_values = refuse(&[TableSpans {
            table: a,
            values: &host_b,
            spans: &[(3, 3)],
        }]);
        Ok((
            past_table,
            past_values,
            dev.read_table(&sync(), a, 0, 12)?,
            dev.read_table(&sync(), b, 0, 5)?,
        ))
    });
}

/// The fused forms: several tables scattered in one op (a table named twice, indices
/// repeated: the last pair wins) and several translations in one op, with the errors of
/// an out-of-range index and of an output that is another translation's input.
#[test]
fn fused_scatters_and_translations_match_cpu() {
    check_parity("fused", |dev| {
        let (a, b) = (dev.alloc_table(10, 0)?, dev.alloc_table(4, -1)?);
        let first = [(1, 5), (3, 6), (1, 7)];
        let second = [(0, 1), (3, 2)];
        let again = [(3, 9), (9, 4)];
        dev.scatter_tables(&[
            TableScatter {
                table: a,
                entries: &first,
            },
            TableScatter {
                table: b,
                entries: &second,
            },
            TableScatter {
                table: a,
                entries: &again,
            },
        ])?;
        let refused = format!(
            "{:?}",
            dev.scatter_tables(&[
                TableScatter {
                    table: a,
                    entries: &[(0, 1)]
                },
                TableScatter {
                    table: b,
                    entries: &[(4, 1)]
                },
            ])
        );
        let ids = table(dev, &[1, 2, 3, 9, 0, 7])?;
        let (o1, o2) = (dev.alloc_table(8, -5)?, dev.alloc_table(6, -5)?);
        let one = Translate {
            v2p: a,
            ids,
            n: 6,
            page_size: 1,
            stride: 3,
            out: o1,
            out_width: 8,
        };
        let two = Translate {
            v2p: b,
            ids,
            n: 5,
            page_size: 2,
            stride: 5,
            out: o2,
            out_width: 6,
        };
        dev.translate_many(&[one, two])?;
        let aliased = Translate { out: ids, ..two };
        let alias = format!("{:?}", dev.translate_many(&[one, aliased]));
        let s = sync();
        Ok((
            dev.read_table(&s, a, 0, 10)?,
            dev.read_table(&s, b, 0, 4)?,
            refused,
            dev.read_table(&s, o1, 0, 8)?,
            dev.read_table(&s, o2, 0, 6)?,
            alias,
        ))
    });
}

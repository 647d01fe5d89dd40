//! The CUDA kernels of `cu/*.cu` compiled as host C++ (a shim stands in for CUDA: the
//! launch runs every block and thread of the grid in turn; `tests/host/harness.cpp`) and
//! run against their CPU twins on random inputs, at several grid shapes (the backend's
//! own and odd ones), page sizes 1, 16 and 256 and page envelopes of up to 6 MiB. So an
//! indexing bug in a kernel shows without a GPU.
//!
//! Needs a C++ compiler (`$CXX`, else `c++`); without one the tests say so and pass,
//! unless `UNIKV_REQUIRE_CXX=1`.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use unikv_kernels::nvrtc::KERNEL_SOURCES;
use unikv_kernels::{
    ByteSpan, CpuDevice, Device, HostSync, LaneTranslate, Readback, RowGather, SpanMove,
    TableScatter, Translate, WindowTranslate,
};

/// Threads per block and most blocks of the CUDA backend's launches (`cuda.rs`).
const BLOCK: u32 = 256;
const MAX_BLOCKS: u64 = 65_535;

/// Bytes of a span one block handles at a time (`UNIKV_CHUNK` of `cu/spans.cu`).
const CHUNK: u64 = 16 * 16 * BLOCK as u64;

/// A launch: blocks along x and y, threads per block.
type Shape = (u32, u32, u32);

/// The shapes a table or translate kernel of `items` items runs at: one thread, an odd
/// one, and the backend's `per_item`.
fn item_shapes(items: u64) -> Vec<Shape> {
    let blocks = items.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32;
    vec![(1, 1, 1), (3, 1, 7), (blocks, 1, BLOCK)]
}

/// The shapes a span kernel of `spans` spans of at most `longest` bytes runs at: one
/// thread, odd ones, and the backend's `per_span`.
fn span_shapes(spans: u64, longest: u64) -> Vec<Shape> {
    let x = longest.div_ceil(CHUNK).clamp(1, MAX_BLOCKS) as u32;
    let y = spans.clamp(1, MAX_BLOCKS) as u32;
    vec![(1, 1, 1), (3, 2, 7), (2, 5, 32), (x, y, BLOCK)]
}

/// The compiled harness, or `None` when there is no C++ compiler.
fn harness() -> Option<&'static PathBuf> {
    static HARNESS: OnceLock<Option<PathBuf>> = OnceLock::new();
    HARNESS
        .get_or_init(|| {
            // One harness per version of the sources, shared by the test processes: each
            // compiles into its own file and renames it into place.
            let mut hash = DefaultHasher::new();
            for (name, src) in KERNEL_SOURCES {
                (name, src).hash(&mut hash);
            }
            include_str!("host/harness.cpp").hash(&mut hash);
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("host-kernels-{:016x}", hash.finish()));
            let exe = dir.join("harness");
            if exe.exists() {
                return Some(exe);
            }
            let work = dir.join(format!("build-{}", std::process::id()));
            std::fs::create_dir_all(&work).unwrap();
            for (name, src) in KERNEL_SOURCES {
                std::fs::write(work.join(name), src).unwrap();
            }
            std::fs::write(work.join("harness.cpp"), include_str!("host/harness.cpp")).unwrap();
            let built = work.join("harness");
            let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
            let out = match Command::new(&cxx)
                // A GPU has no type-based aliasing rules: the words of a span alias its bytes.
                .args([
                    "-O2",
                    "-std=c++17",
                    "-fno-strict-aliasing",
                    "-Wall",
                    "-Werror",
                    "-o",
                ])
                .arg(&built)
                .arg(work.join("harness.cpp"))
                .output()
            {
                Ok(out) => out,
                Err(e) if std::env::var("UNIKV_REQUIRE_CXX").as_deref() == Ok("1") => {
                    panic!("UNIKV_REQUIRE_CXX=1 but {cxx} does not run: {e}")
                }
                Err(e) => {
                    eprintln!("host kernels: skipped, no C++ compiler ({cxx}: {e})");
                    return None;
                }
            };
            assert!(
                out.status.success(),
                "the kernels do not compile as host C++:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::fs::rename(&built, &exe).unwrap();
            let _ = std::fs::remove_dir_all(&work);
            Some(exe)
        })
        .as_ref()
}

/// Runs kernel `name` on a `grid × block` launch with `arrays`; returns what it wrote.
fn run(name: &str, (x, y, block): Shape, arrays: &[&[u8]]) -> Vec<u8> {
    let exe = harness().expect("checked by the caller");
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = Vec::new();
    let shape: Vec<u8> = [x, y, block].iter().flat_map(|v| v.to_le_bytes()).collect();
    for a in [name.as_bytes(), &shape]
        .into_iter()
        .chain(arrays.iter().copied())
    {
        input.extend_from_slice(&(a.len() as u64).to_le_bytes());
        input.extend_from_slice(a);
    }
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&input).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let len = u64::from_le_bytes(out.stdout[..8].try_into().unwrap()) as usize;
    assert_eq!(out.stdout.len(), 8 + len, "{name}: one array out");
    out.stdout[8..].to_vec()
}

/// xorshift: reproducible random inputs.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
    /// `n` random bytes (a multiple of 8), a word at a time: the envelopes are MiBs.
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n / 8)
            .flat_map(|_| self.below(u64::MAX).to_le_bytes())
            .collect()
    }
}

fn bytes_of<T: Copy>(v: &[T], f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

fn i32s(v: &[i32]) -> Vec<u8> {
    bytes_of(v, |x| x.to_le_bytes().to_vec())
}

fn from_i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn sync() -> HostSync {
    HostSync::acquire("host kernel parity")
}

/// Bytes per page envelope of gpt-oss-20b at page size `ps` (one side: 24,576 B a token).
fn envelope(ps: u64) -> u64 {
    ps * 24_576
}

/// The CPU twin's buffer after `op`, from `pattern`.
fn cpu_bytes(pattern: &[u8], op: impl FnOnce(&CpuDevice, unikv_kernels::BytesId)) -> Vec<u8> {
    let dev = CpuDevice::new();
    let buf = dev.alloc_bytes(pattern.len() as u64, 0).unwrap();
    dev.run_kernel(buf, |b| b.copy_from_slice(pattern)).unwrap();
    op(&dev, buf);
    dev.read_bytes(&sync(), buf, 0, pattern.len() as u64)
        .unwrap()
}

#[test]
fn moves_and_fills_match_the_cpu_twin_at_every_page_size() {
    if harness().is_none() {
        return;
    }
    let mut rng = Rng(0x5EED_1234);
    for ps in [1, 16, 256] {
        let (e, slots) = (envelope(ps), 4u64);
        let pattern = rng.bytes((e * slots) as usize);
        let half = e / 2;
        let mv = |src, dst, len| SpanMove { src, dst, len };
        // A whole envelope, a run whose ends share their alignment (a head and a tail of
        // single bytes around 16-byte words), one whose ends do not (bytes only), one
        // empty: destinations in slots 1 and 3, sources in slots 0 and 2.
        let moves = [
            mv(0, 3 * e, e),
            mv(7, e + 7, 1_000.min(half - 7)),
            mv(2 * e + 3, e + half + 5, 100),
            mv(2 * e, 3 * e, 0),
        ];
        let want = cpu_bytes(&pattern, |dev, buf| dev.move_spans(buf, &moves).unwrap());
        let list = bytes_of(&moves, |m| {
            [m.src, m.dst, m.len].map(u64::to_le_bytes).concat()
        });
        for shape in span_shapes(moves.len() as u64, e) {
            let got = run("move_spans", shape, &[&pattern, &list]);
            assert!(got == want, "move_spans at ps {ps}, shape {shape:?}");
        }
        // Fills with a head, words and a tail, overlapping, shorter than their head, of
        // single bytes after an aligned start, and empty.
        let span = |offset, len| ByteSpan { offset, len };
        let spans = [
            span(3, e + 5),
            span(2 * e - 7, 20),
            span(2 * e + 1, 5),
            span(3 * e + 16, 8),
            span(3 * e, 0),
        ];
        let want = cpu_bytes(&pattern, |dev, buf| {
            dev.fill_spans(buf, &spans, 0xA5).unwrap()
        });
        let list = bytes_of(&spans, |s| [s.offset, s.len].map(u64::to_le_bytes).concat());
        for shape in span_shapes(spans.len() as u64, e + 5) {
            let got = run("fill_spans", shape, &[&pattern, &list, &[0xA5]]);
            assert!(got == want, "fill_spans at ps {ps}, shape {shape:?}");
        }
    }
}

#[test]
fn table_scatters_and_gathers_match_the_cpu_twin() {
    if harness().is_none() {
        return;
    }
    let mut rng = Rng(0xBEEF);
    for len in [1usize, 300, 5_000] {
        let dev = CpuDevice::new();
        let initial: Vec<i32> = (0..len).map(|_| rng.below(1000) as i32 - 500).collect();
        // Distinct indices (the backend keeps the last pair of each), in random order.
        let mut indices: Vec<u32> = (0..len as u32).filter(|_| rng.below(3) == 0).collect();
        for i in (1..indices.len()).rev() {
            indices.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let pairs: Vec<(u32, i32)> = indices
            .iter()
            .map(|&i| (i, rng.below(1 << 20) as i32))
            .collect();
        // Three tables in one launch, as the mirror upload of three sides.
        let others: [Vec<i32>; 2] = [vec![-3; len / 2 + 1], vec![9; 7]];
        let more: [Vec<(u32, i32)>; 2] = [
            (0..(len / 2 + 1) as u32)
                .step_by(2)
                .map(|i| (i, i as i32))
                .collect(),
            vec![(6, 1), (0, 2)],
        ];
        let tables: Vec<_> = [&initial, &others[0], &others[1]]
            .iter()
            .map(|values| {
                let t = dev.alloc_table(values.len(), 0).unwrap();
                dev.upload_table(t, 0, values).unwrap();
                t
            })
            .collect();
        let scatters = [
            TableScatter {
                table: tables[0],
                entries: &pairs,
            },
            TableScatter {
                table: tables[1],
                entries: &more[0],
            },
            TableScatter {
                table: tables[2],
                entries: &more[1],
            },
        ];
        dev.scatter_tables(&scatters).unwrap();
        let want: Vec<i32> = tables
            .iter()
            .zip([len, len / 2 + 1, 7])
            .flat_map(|(&t, n)| dev.read_table(&sync(), t, 0, n).unwrap())
            .collect();
        let mut list = Vec::new();
        for (slot, s) in scatters.iter().enumerate() {
            for &(i, v) in s.entries {
                for word in [slot as u32, i, v as u32] {
                    list.extend_from_slice(&word.to_le_bytes());
                }
            }
        }
        let n = (list.len() / 12) as u64;
        for shape in item_shapes(n) {
            let got = from_i32s(&run(
                "scatter_tables",
                shape,
                &[
                    &3u64.to_le_bytes(),
                    &i32s(&initial),
                    &i32s(&others[0]),
                    &i32s(&others[1]),
                    &list,
                ],
            ));
            assert_eq!(got, want, "scatter of {n} into 3 tables, shape {shape:?}");
        }

        // Indices in range, negative and past the end.
        let n = len + 7;
        let idx: Vec<i32> = (0..n)
            .map(|_| rng.below(len as u64 + 20) as i32 - 10)
            .collect();
        let (src, ids, out) = (
            dev.alloc_table(len, 0).unwrap(),
            dev.alloc_table(n, 0).unwrap(),
            dev.alloc_table(n, -9).unwrap(),
        );
        dev.upload_table(src, 0, &initial).unwrap();
        dev.upload_table(ids, 0, &idx).unwrap();
        dev.gather_table(src, ids, n, out).unwrap();
        let want = dev.read_table(&sync(), out, 0, n).unwrap();
        for shape in item_shapes(n as u64) {
            let got = from_i32s(&run(
                "gather",
                shape,
                &[&i32s(&initial), &i32s(&idx), &i32s(&vec![-9; n])],
            ));
            assert_eq!(got, want, "gather of {n} from {len}, shape {shape:?}");
        }
    }
}

#[test]
fn translate_matches_the_cpu_twin_at_every_page_size() {
    if harness().is_none() {
        return;
    }
    let mut rng = Rng(0xC0FFEE);
    // Every page size's translation again, all in one launch of `unikv_translate_many`.
    let many = CpuDevice::new();
    let (mut all, mut arrays, mut widest) = (Vec::new(), Vec::new(), 0);
    for ps in [1i64, 16, 256] {
        let dev = CpuDevice::new();
        let pages = 200usize;
        // Bound, unbound (0) and tombstoned (-1) pages; strides that overflow i32.
        let v2p: Vec<i32> = (0..pages)
            .map(|_| match rng.below(6) {
                0 => 0,
                1 => -1,
                _ => rng.below(1 << 30) as i32,
            })
            .collect();
        let stride = [ps as i32, 24_576, i32::MAX][rng.below(3) as usize];
        let n = 1_000usize;
        let ids: Vec<i32> = (0..n)
            .map(|_| rng.below((pages as u64 + 10) * ps as u64) as i32 - 5)
            .collect();
        let width = n + 13;
        let (t_v2p, t_ids, t_out) = (
            dev.alloc_table(pages, 0).unwrap(),
            dev.alloc_table(n, 0).unwrap(),
            dev.alloc_table(width + 2, 7).unwrap(),
        );
        dev.upload_table(t_v2p, 0, &v2p).unwrap();
        dev.upload_table(t_ids, 0, &ids).unwrap();
        dev.translate(&Translate {
            v2p: t_v2p,
            ids: t_ids,
            n,
            page_size: ps as u32,
            stride: stride as u32,
            out: t_out,
            out_width: width,
        })
        .unwrap();
        let want = dev.read_table(&sync(), t_out, 0, width + 2).unwrap();
        let args = bytes_of(&[n as i64, ps, stride as i64, width as i64], |x| {
            x.to_le_bytes().to_vec()
        });
        for shape in item_shapes(width as u64) {
            let got = from_i32s(&run(
                "translate",
                shape,
                &[&i32s(&v2p), &i32s(&ids), &args, &i32s(&vec![7; width + 2])],
            ));
            assert_eq!(
                got, want,
                "translate at ps {ps}, stride {stride}, shape {shape:?}"
            );
        }
        let table = |values: &[i32]| {
            let t = many.alloc_table(values.len(), 0).unwrap();
            many.upload_table(t, 0, values).unwrap();
            t
        };
        all.push(Translate {
            v2p: table(&v2p),
            ids: table(&ids),
            out: table(&vec![7; width + 2]),
            n,
            page_size: ps as u32,
            stride: stride as u32,
            out_width: width,
        });
        arrays.extend([i32s(&v2p), i32s(&ids), args, i32s(&vec![7; width + 2])]);
        widest = widest.max(width as u64);
    }
    many.translate_many(&all).unwrap();
    let want: Vec<i32> = all
        .iter()
        .flat_map(|t| many.read_table(&sync(), t.out, 0, t.out_width + 2).unwrap())
        .collect();
    let count = 3u64.to_le_bytes();
    let inputs: Vec<&[u8]> = std::iter::once(&count[..])
        .chain(arrays.iter().map(Vec::as_slice))
        .collect();
    let rows = widest.div_ceil(u64::from(BLOCK)) as u32;
    for shape in [(1, 1, 1), (3, 2, 7), (rows, 3, BLOCK)] {
        let got = from_i32s(&run("translate_many", shape, &inputs));
        assert_eq!(got, want, "translate_many, shape {shape:?}");
    }
}

/// A random draft tree of `width` nodes (parents before children) and one of its
/// root-to-node paths, padded with −1 to `width` entries; now and then a path of random
/// entries instead (device data: the kernels take whatever they are given).
fn random_path(rng: &mut Rng, width: usize) -> Vec<i32> {
    if rng.below(5) == 0 {
        return (0..width)
            .map(|_| rng.below(width as u64 + 2) as i32 - 1)
            .collect();
    }
    let parents: Vec<usize> = (1..width).map(|i| rng.below(i as u64) as usize).collect();
    let mut path = vec![0i32];
    while let Some(child) = (1..width)
        .filter(|&c| parents[c - 1] == *path.last().unwrap() as usize)
        .find(|_| rng.below(3) != 0)
    {
        path.push(child as i32);
    }
    path.resize(width, -1);
    path
}

#[test]
fn verify_windows_and_row_gathers_match_the_cpu_twin_at_every_page_size() {
    if harness().is_none() {
        return;
    }
    let mut rng = Rng(0x5EED_7A1E);
    for ps in [1u64, 16, 256] {
        // Windows: each request's row of virtual ids read from a device-side start (some
        // outside the row), in one launch for two windows.
        let (batch, rows, width) = (37usize, 24usize, 5usize);
        let pages = 64usize;
        let v2p: Vec<i32> = (0..pages)
            .map(|_| match rng.below(6) {
                0 => 0,
                1 => -1,
                _ => rng.below(1 << 20) as i32,
            })
            .collect();
        let mut windows = Vec::new();
        let (mut arrays, mut outs) = (vec![(2u64).to_le_bytes().to_vec()], Vec::new());
        let dev = CpuDevice::new();
        let table = |values: &[i32]| {
            let t = dev.alloc_table(values.len(), 0).unwrap();
            dev.upload_table(t, 0, values).unwrap();
            t
        };
        for bias in [0i32, -2] {
            let ids: Vec<i32> = (0..batch * rows)
                .map(|_| rng.below(pages as u64 * ps + 8) as i32 - 4)
                .collect();
            let starts: Vec<i32> = (0..batch)
                .map(|_| rng.below(rows as u64 + 6) as i32 - 2)
                .collect();
            // Live lengths on the shifted window only (some negative, some past it), from
            // a stream of their own so the other draws stay what they were.
            let mut lens_rng = Rng(0x1E45 + ps);
            let lens: Vec<i32> = match bias {
                0 => Vec::new(),
                _ => (0..batch)
                    .map(|_| lens_rng.below(width as u64 + 3) as i32 - 1)
                    .collect(),
            };
            let out = vec![7; batch * width + 3];
            let stride = (ps * 3) as u32;
            windows.push(WindowTranslate {
                v2p: table(&v2p),
                ids: table(&ids),
                ids_at: 0,
                rows,
                starts: table(&starts),
                starts_at: 0,
                bias,
                lens: (!lens.is_empty()).then(|| (table(&lens), 0)),
                batch,
                width,
                page_size: ps as u32,
                stride,
                out: table(&out),
                out_at: 1,
            });
            let args = [
                rows as i64,
                i64::from(bias),
                batch as i64,
                width as i64,
                ps as i64,
                i64::from(stride),
            ];
            arrays.extend([
                i32s(&v2p),
                i32s(&ids),
                i32s(&starts),
                i32s(&lens),
                bytes_of(&args, |x| x.to_le_bytes().to_vec()),
                i32s(&out[1..1 + batch * width]),
            ]);
            outs.push(out.len());
        }
        dev.translate_windows(&windows).unwrap();
        let want: Vec<i32> = windows
            .iter()
            .flat_map(|w| dev.read_table(&sync(), w.out, 1, batch * width).unwrap())
            .collect();
        let inputs: Vec<&[u8]> = arrays.iter().map(Vec::as_slice).collect();
        for shape in [(1, 1, 1), (3, 2, 7), (1, 2, BLOCK)] {
            let got = from_i32s(&run("translate_windows", shape, &inputs));
            assert_eq!(got, want, "translate_windows at ps {ps}, shape {shape:?}");
        }

        // Row gathers: distinct kernel ids per position (some the sink or padding, some
        // whose rows reach past the buffer), random paths.
        let (rows_per_token, row_bytes) = (4u32, 24u64);
        let stride = u64::from(rows_per_token) * ps;
        let phys = 6u64;
        let total = (phys + 1) * stride * row_bytes - 2 * row_bytes; // the last rows are cut
        let mut free: Vec<i32> = (stride..(phys + 1) * stride)
            .filter(|k| k % stride < ps)
            .map(|k| k as i32)
            .collect();
        let (batch, width) = (5usize, 6usize);
        let ids: Vec<i32> = (0..batch * width)
            .map(|_| match rng.below(8) {
                0 => 0,
                1 => -3,
                _ if !free.is_empty() => free.swap_remove(rng.below(free.len() as u64) as usize),
                _ => 0,
            })
            .collect();
        let path: Vec<i32> = (0..batch)
            .flat_map(|_| random_path(&mut rng, width))
            .collect();
        let pattern = rng.bytes(total as usize);
        let args = RowGather {
            buf: unikv_kernels::BytesId(0),
            ids: unikv_kernels::TableId(0),
            ids_at: 0,
            path: unikv_kernels::TableId(0),
            path_at: 0,
            batch,
            width,
            page_size: ps as u32,
            rows_per_token,
            row_bytes,
        };
        let want = cpu_bytes(&pattern, |dev, buf| {
            let (t_ids, t_path) = (
                dev.alloc_table(ids.len(), 0).unwrap(),
                dev.alloc_table(path.len(), 0).unwrap(),
            );
            dev.upload_table(t_ids, 0, &ids).unwrap();
            dev.upload_table(t_path, 0, &path).unwrap();
            dev.gather_rows(&[RowGather {
                buf,
                ids: t_ids,
                path: t_path,
                ..args
            }])
            .unwrap();
        });
        assert_ne!(want, pattern, "the gather at ps {ps} moves something");
        let geometry = bytes_of(
            &[
                batch as u64,
                width as u64,
                ps,
                u64::from(rows_per_token),
                row_bytes,
            ],
            |x| x.to_le_bytes().to_vec(),
        );
        let token_bytes = u64::from(rows_per_token) * row_bytes;
        for shape in [
            (1, 1, 1),
            (3, 2, 7),
            (
                token_bytes.div_ceil(u64::from(BLOCK)) as u32,
                batch as u32,
                BLOCK,
            ),
        ] {
            let got = run(
                "gather_rows",
                shape,
                &[&pattern, &i32s(&ids), &i32s(&path), &geometry],
            );
            assert!(got == want, "gather_rows at ps {ps}, shape {shape:?}");
        }
    }
}

/// One random lane translation's host values (see [`LaneTranslate`]).
struct Lanes {
    v2p: Vec<i32>,
    rows: Vec<i32>,
    lane_len: usize,
    lanes: Vec<i32>,
    firsts: Option<Vec<i32>>,
    starts: Vec<i32>,
    stride: u32,
    out_at: usize,
    out_len: usize,
}

impl Lanes {
    /// `batch` requests over a few lanes (and a partial one): lanes and first entries in
    /// and out of range, runs of ragged lengths from a start that may lie before 0 and
    /// reach past the output (which may hold fewer entries than the runs), pages bound,
    /// unbound, tombstoned, negative and outside `v2p`, strides that overflow `i32`.
    /// The runs never overlap (the CPU keeps the later of two writers, a GPU either).
    fn random(rng: &mut Rng, batch: usize) -> Lanes {
        let pages = 1 + rng.below(60) as usize;
        let v2p: Vec<i32> = (0..pages)
            .map(|_| match rng.below(6) {
                0 => 0,
                1 => -1,
                _ => rng.below(1 << 20) as i32,
            })
            .collect();
        let lane_len = 1 + rng.below(40) as usize;
        let whole = rng.below(6) as usize;
        let rows: Vec<i32> = (0..whole * lane_len + rng.below(lane_len as u64) as usize)
            .map(|_| rng.below(pages as u64 + 8) as i32 - 3)
            .collect();
        let lanes: Vec<i32> = (0..batch)
            .map(|_| rng.below(whole as u64 + 4) as i32 - 2)
            .collect();
        let firsts = (rng.below(2) == 0).then(|| {
            (0..batch)
                .map(|_| match rng.below(8) {
                    0 => i32::MIN,
                    1 => i32::MAX,
                    _ => rng.below(2 * lane_len as u64 + 6) as i32 - lane_len as i32 / 2 - 3,
                })
                .collect()
        });
        // Prefix sums of ragged runs (empty ones too) from a start before 0 (now and
        // then far before); the last may end far past the output, or before it starts.
        let mut starts = vec![match rng.below(6) {
            0 => i32::MIN,
            _ => rng.below(12) as i32 - 8,
        }];
        for _ in 0..batch {
            let at = *starts.last().unwrap();
            let next = match rng.below(10) {
                0 => 0,
                _ => rng.below(lane_len as u64 + 6) as i32,
            };
            starts.push(at.max(-20) + next);
        }
        match rng.below(6) {
            0 if batch > 0 => starts[batch] = i32::MAX,
            1 if batch > 0 => starts[batch] = starts[batch - 1] - 3,
            _ => {}
        }
        let end = usize::try_from(starts[batch].clamp(0, 4 * 40 * 40)).unwrap();
        Lanes {
            v2p,
            rows,
            lane_len,
            lanes,
            firsts,
            starts,
            stride: [1, 24_576, i32::MAX as u32][rng.below(3) as usize],
            out_at: rng.below(3) as usize,
            out_len: rng.below(end as u64 + 6) as usize,
        }
    }

    /// The output table: a guard entry or two around `out_len` entries.
    fn out(&self) -> Vec<i32> {
        vec![7; self.out_at + self.out_len + 2]
    }
}

#[test]
fn lane_translations_match_the_cpu_twin() {
    if harness().is_none() {
        return;
    }
    let mut rng = Rng(0x1A4E_5EED);
    for round in 0..24 {
        // No translation, one, or several of no, one and many requests in one launch.
        let count = [0, 1, 1, 2, 3][round % 5];
        let all: Vec<Lanes> = (0..count)
            .map(|_| {
                let batch = [0, 1, 37, 300][rng.below(4) as usize];
                Lanes::random(&mut rng, batch)
            })
            .collect();
        let dev = CpuDevice::new();
        let table = |values: &[i32]| {
            let t = dev.alloc_table(values.len(), 0).unwrap();
            dev.upload_table(t, 0, values).unwrap();
            t
        };
        let args: Vec<LaneTranslate> = all
            .iter()
            .map(|l| LaneTranslate {
                v2p: table(&l.v2p),
                rows: table(&l.rows),
                lane_len: l.lane_len,
                lanes: (table(&l.lanes), 0),
                firsts: l.firsts.as_ref().map(|f| (table(f), 0)),
                starts: (table(&l.starts), 0),
                batch: l.lanes.len(),
                stride: l.stride,
                out: table(&l.out()),
                out_at: l.out_at,
                out_len: l.out_len,
            })
            .collect();
        dev.translate_lanes(&args).unwrap();
        let want: Vec<i32> = args
            .iter()
            .zip(&all)
            .flat_map(|(t, l)| dev.read_table(&sync(), t.out, 0, l.out().len()).unwrap())
            .collect();
        let mut arrays = vec![(count as u64).to_le_bytes().to_vec()];
        for l in &all {
            let scalars = [
                l.lane_len as u64,
                l.lanes.len() as u64,
                u64::from(l.stride),
                l.out_at as u64,
                l.out_len as u64,
            ];
            arrays.extend([
                i32s(&l.v2p),
                i32s(&l.rows),
                i32s(&l.lanes),
                l.firsts.as_deref().map_or_else(Vec::new, i32s),
                i32s(&l.starts),
                bytes_of(&scalars, |x| x.to_le_bytes().to_vec()),
                i32s(&l.out()),
            ]);
        }
        let inputs: Vec<&[u8]> = arrays.iter().map(Vec::as_slice).collect();
        // The backend's grid (cuda.rs: x for the average run of the translations it
        // launches, y for every request), then odd ones.
        let launched = all.iter().filter(|l| !l.lanes.is_empty() && l.out_len > 0);
        let widest = launched
            .clone()
            .map(|l| (l.out_len as u64).div_ceil(l.lanes.len() as u64))
            .max()
            .unwrap_or(0);
        let total: u64 = launched.map(|l| l.lanes.len() as u64).sum();
        let backend = (
            widest.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32,
            total.clamp(1, MAX_BLOCKS) as u32,
            BLOCK,
        );
        for shape in [backend, (1, 1, 1), (3, 2, 7), (2, 5, 32)] {
            let got = from_i32s(&run("translate_lanes", shape, &inputs));
            assert_eq!(got, want, "translate_lanes round {round}, shape {shape:?}");
        }
    }
}

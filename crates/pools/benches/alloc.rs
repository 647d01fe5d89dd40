//! Allocator micro-benchmarks (divan): alloc_extend, alloc_decode for a batch of 256,
//! the three segment frees of 4,096 and 32,768 tokens, a decode batch's window release
//! (`free_swa_segments` of 256 rows), and a flush with 10% holes — at
//! page sizes 1 and 256, unified and static — and Mamba state slots (alloc and free of a
//! batch's slots, the copy-on-write copies) on FULL + Mamba pools. Inputs are built
//! outside the timed region.
//!
//! `cargo bench -p unikv-pools --bench alloc`

use divan::Bencher;
use std::sync::Arc;
use unikv_kernels::{CpuDevice, Device};
use unikv_pools::{
    DecodeRequest, ExtendRequest, KvAllocator, Segment, SlotPoolSpec, StaticSlots, StaticSwa,
    StaticSwaConfig, SubPoolSpec, UnifiedSwa, UnifiedSwaConfig, VirtualSlot, VirtualToken,
};

fn main() {
    divan::main();
}

/// (layout, page size) cases.
const CASES: [&str; 4] = ["unified/1", "unified/256", "static/1", "static/256"];

/// A pool with room for `tokens` tokens per side (plus a margin), tiny envelopes so the
/// CPU device's buffer stays small: the benches time host bookkeeping.
fn pool(case: &str, tokens: u64) -> Box<dyn KvAllocator> {
    let (layout, ps) = case.split_once('/').unwrap();
    let ps: u32 = ps.parse().unwrap();
    let spec = || SubPoolSpec::mha("kv", 1, 1, 2, 2); // 8 B/token
    let tokens = tokens.div_ceil(ps as u64) * ps as u64 + 4 * ps as u64;
    let total = 8 * ps as u64 + tokens * 16 + 64 * ps as u64;
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    match layout {
        "unified" => Box::new(
            UnifiedSwa::new(
                device,
                UnifiedSwaConfig {
                    total_bytes: total,
                    page_size: ps,
                    window: 128,
                    full: spec(),
                    swa: Some(spec()),
                    mamba: None,
                    zero_on_handout: false,
                },
            )
            .unwrap(),
        ),
        _ => Box::new(
            StaticSwa::new(
                device,
                StaticSwaConfig {
                    total_bytes: total,
                    page_size: ps,
                    window: 128,
                    full: spec(),
                    swa: Some(spec()),
                    mamba: None,
                    swa_full_ratio: 1.0,
                    zero_on_handout: false,
                },
            )
            .unwrap(),
        ),
    }
}

fn row(pool: &mut dyn KvAllocator, n: usize) -> Vec<VirtualToken> {
    let mut out = Vec::with_capacity(n);
    let req = ExtendRequest {
        prefix_len: 0,
        seq_len: n,
        last_token: None,
    };
    pool.alloc_extend(&[req], &mut out).unwrap();
    out
}

/// Extend a batch of 8 new requests × 512 tokens (4,096 tokens).
#[divan::bench(args = CASES)]
fn alloc_extend(bencher: Bencher, case: &str) {
    let reqs = [ExtendRequest {
        prefix_len: 0,
        seq_len: 512,
        last_token: None,
    }; 8];
    bencher
        .with_inputs(|| (pool(case, 8192), Vec::with_capacity(4096)))
        .bench_local_refs(|(pool, out)| pool.alloc_extend(&reqs, out).unwrap());
}

/// One decode step of 256 requests of staggered lengths (at page size 1 every request
/// takes a page; at 256 about one).
#[divan::bench(args = CASES)]
fn alloc_decode_batch_256(bencher: Bencher, case: &str) {
    bencher
        .with_inputs(|| {
            let ps: u64 = case.split_once('/').unwrap().1.parse().unwrap();
            let mut pool = pool(case, 256 * (400 + 2 * ps));
            let reqs: Vec<DecodeRequest> = (0..256)
                .map(|i| {
                    let r = row(&mut *pool, 100 + i);
                    DecodeRequest {
                        prefix_len: r.len(),
                        last_token: r.last().copied(),
                    }
                })
                .collect();
            (pool, reqs, Vec::with_capacity(256))
        })
        .bench_local_refs(|(pool, reqs, out)| pool.alloc_decode(reqs, out).unwrap());
}

const TOKENS: [usize; 2] = [4096, 32768];

fn free_bench(bencher: Bencher, case: &str, n: usize, kind: u8) {
    bencher
        .with_inputs(|| {
            let mut pool = pool(case, n as u64);
            // Steady state: one earlier cycle grew the free lists and hole lists.
            let warm = row(&mut *pool, n);
            pool.free_segment(Segment::of_row(&warm, 0..n)).unwrap();
            pool.flush().unwrap();
            let r = row(&mut *pool, n);
            if kind == 2 {
                pool.free_swa_segment(Segment::of_row(&r, 0..n)).unwrap();
            }
            (pool, r)
        })
        .bench_local_refs(|(pool, r)| {
            let seg = Segment::of_row(r, 0..n);
            match kind {
                0 => pool.free_segment(seg),
                1 => pool.free_swa_segment(seg),
                _ => pool.free_full_segment(seg),
            }
            .unwrap()
        });
}

/// Two-sided segment free of one row.
#[divan::bench(args = CASES, consts = TOKENS)]
fn free_segment<const N: usize>(bencher: Bencher, case: &str) {
    free_bench(bencher, case, N, 0);
}

/// SWA-only segment free (window eviction) of one row.
#[divan::bench(args = CASES, consts = TOKENS)]
fn free_swa_segment<const N: usize>(bencher: Bencher, case: &str) {
    free_bench(bencher, case, N, 1);
}

/// FULL-only segment free of one row whose SWA is already released.
#[divan::bench(args = CASES, consts = TOKENS)]
fn free_full_segment<const N: usize>(bencher: Bencher, case: &str) {
    free_bench(bencher, case, N, 2);
}

/// A flush of a pool of 32,768 tokens in 64 rows with every tenth page freed (10% holes):
/// the holes are compacted through the device.
/// One decode step's window release: 256 rows each leave 256 tokens of the window, in one
/// `free_swa_segments` call.
#[divan::bench(args = CASES)]
fn free_swa_segments_batch_256(bencher: Bencher, case: &str) {
    bencher
        .with_inputs(|| {
            let mut pool = pool(case, 256 * 512);
            let rows: Vec<Vec<VirtualToken>> = (0..256).map(|_| row(&mut *pool, 512)).collect();
            (pool, rows)
        })
        .bench_local_refs(|(pool, rows)| {
            let windows: Vec<Segment<'_>> =
                rows.iter().map(|r| Segment::of_row(r, 0..256)).collect();
            pool.free_swa_segments(&windows).unwrap()
        });
}

#[divan::bench(args = CASES)]
fn flush_10pct_holes(bencher: Bencher, case: &str) {
    bencher
        .with_inputs(|| {
            let mut pool = pool(case, 32768);
            let ps = pool.page_size().get() as usize;
            let rows: Vec<_> = (0..64).map(|_| row(&mut *pool, 512)).collect();
            let pages: Vec<VirtualToken> = rows.concat().into_iter().step_by(ps).collect();
            for (i, t) in pages.iter().enumerate() {
                if i % 10 == 0 {
                    pool.free(&[*t]).unwrap();
                }
            }
            pool
        })
        .bench_local_refs(|pool| pool.flush().unwrap());
}

/// Steady state on a warm pool, shaped like a facade step: inside a free group, allocate
/// one row of 4,096 tokens and free it with a two-sided segment free, close the group,
/// flush (compaction) and upload the mirror. Run it with `UNIKV_INVARIANT_CHECK=strict`
/// to price the checks.
#[divan::bench(args = CASES)]
fn alloc_free_cycle_4096(bencher: Bencher, case: &str) {
    let mut pool = pool(case, 8192);
    let mut out = Vec::with_capacity(4096);
    let req = [ExtendRequest {
        prefix_len: 0,
        seq_len: 4096,
        last_token: None,
    }];
    bencher.bench_local(|| {
        out.clear();
        pool.free_group_begin().unwrap();
        pool.alloc_extend(&req, &mut out).unwrap();
        pool.free_segment(Segment::of_row(&out, 0..4096)).unwrap();
        pool.free_group_end().unwrap();
        pool.flush().unwrap();
        pool.upload_mirror().unwrap();
    });
}

/// FULL + Mamba layouts for the slot benches.
const SLOT_LAYOUTS: [&str; 2] = ["unified", "static"];

/// Slots per batch: 256 requests × 3 (running + two checkpoints).
const BATCH_SLOTS: usize = 768;

/// A FULL + Mamba pool with room for 2 × [`BATCH_SLOTS`] slots of 64 bytes and 8,192
/// tokens of FULL KV (page size 1; slots have their own page size 1 id space).
fn slot_pool(layout: &str) -> Box<dyn KvAllocator> {
    let full = SubPoolSpec::mha("kv", 1, 1, 2, 2); // 8 B/token
    let slots = SlotPoolSpec {
        name: "mamba",
        layers: 2,
        bytes_per_slot: 64,
    };
    let n = 2 * BATCH_SLOTS as u64;
    let total = 64 + (n + 1) * 64 + 8192 * 8 + 64;
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    match layout {
        "unified" => Box::new(
            UnifiedSwa::new(
                device,
                UnifiedSwaConfig {
                    total_bytes: total,
                    page_size: 1,
                    window: 128,
                    full,
                    swa: None,
                    mamba: Some(slots),
                    zero_on_handout: false,
                },
            )
            .unwrap(),
        ),
        _ => Box::new(
            StaticSwa::new(
                device,
                StaticSwaConfig {
                    total_bytes: total,
                    page_size: 1,
                    window: 128,
                    full,
                    swa: None,
                    mamba: Some(StaticSlots {
                        spec: slots,
                        slots: n as u32,
                    }),
                    swa_full_ratio: 1.0,
                    zero_on_handout: false,
                },
            )
            .unwrap(),
        ),
    }
}

/// Allocation of a batch's slots (256 requests × 3) on a warm pool, then their free.
#[divan::bench(args = SLOT_LAYOUTS)]
fn alloc_free_slots_768(bencher: Bencher, layout: &str) {
    let mut pool = slot_pool(layout);
    let mut out = Vec::with_capacity(BATCH_SLOTS);
    bencher.bench_local(|| {
        out.clear();
        pool.alloc_slots(BATCH_SLOTS, &mut out).unwrap();
        pool.free_slots(&out).unwrap();
    });
}

/// Allocation of one request's three slots, then their free (admission and release).
#[divan::bench(args = SLOT_LAYOUTS)]
fn alloc_free_slots_3(bencher: Bencher, layout: &str) {
    let mut pool = slot_pool(layout);
    let mut out = Vec::with_capacity(3);
    bencher.bench_local(|| {
        out.clear();
        pool.alloc_slots(3, &mut out).unwrap();
        pool.free_slots(&out).unwrap();
    });
}

/// Copy-on-write of 256 matched states into the admitted requests' slots (one device
/// move batch; the CPU device copies 64-byte envelopes).
#[divan::bench(args = SLOT_LAYOUTS)]
fn copy_slots_256(bencher: Bencher, layout: &str) {
    let mut pool = slot_pool(layout);
    let mut s: Vec<VirtualSlot> = Vec::with_capacity(512);
    pool.alloc_slots(512, &mut s).unwrap();
    let pairs: Vec<(VirtualSlot, VirtualSlot)> = s[..256]
        .iter()
        .copied()
        .zip(s[256..].iter().copied())
        .collect();
    bencher.bench_local(|| pool.copy_slots(&pairs).unwrap());
}

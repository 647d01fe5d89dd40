//! Edges of the pools that no other test pinned down (each found by a surviving mutant):
//! the exact refusals of a finishing row's free and of a transfer naming the sink, the
//! empty and whole-row cases of that free, the ids' display forms and first tokens, the
//! specs each field of which a grid refuses at zero, a reference slot pool that never
//! holds more slots than its buffer, a reused page handed out zeroed, and a group's
//! frees reaching the device mirror, the static id space, and a demand beyond the pool
//! that no overstated eviction fits.

mod common;

use common::*;
use unikv_kernels::{ByteSpan, Device, HostSync, Readback};
use unikv_pools::{
    Bytes, Error, Grid, KvAllocator, PageDemand, PageSize, PhysicalPage, PrefixCaching,
    Reclaimable, Segment, Side, SlotPoolSpec, StaticSwa, SubPoolSpec, VirtualPage, VirtualToken,
    reference_slot_pool,
};

/// Page sizes above 1 of the matrix (at page size 1 every position is page-aligned).
fn paged_cases(mut f: impl FnMut(Layout, u32)) {
    each_case(|layout, ps| {
        if ps > 1 {
            f(layout, ps);
        }
    });
}

/// Proves a finishing row's free that starts at its end (`dead_lo == len`, aligned) is
/// an empty free, not a bad row range: it succeeds and frees nothing, for the whole row
/// and for a prefix of it.
#[test]
fn a_kv_row_free_starting_at_its_end_succeeds_and_frees_nothing() {
    each_case(|layout, ps| {
        let p = ps as usize;
        let mut pool = pool(layout, ps, 16);
        let row = new_row(&mut pool, 2 * p);
        let before = pool.capacity();
        for len in [2 * p, p] {
            pool.free_kv_row_segments(&row, len, len, len)
                .unwrap_or_else(|e| panic!("{layout:?}/{ps} len {len}: {e}"));
        }
        assert_eq!(pool.capacity(), before, "{layout:?}/{ps}");
        assert_clean(&pool);
    });
}

/// Proves a cursor strictly inside the freed range that splits a page is refused as a
/// split page (the cause), not as the unaligned two-sided half it would leave, and
/// changes nothing.
#[test]
fn a_cursor_splitting_a_page_between_two_nonempty_halves_is_a_split_page() {
    paged_cases(|layout, ps| {
        let p = ps as usize;
        let mut pool = pool(layout, ps, 16);
        let row = new_row(&mut pool, 3 * p);
        pool.free_swa_segment(Segment::of_row(&row, 0..p)).unwrap();
        let before = pool.capacity();
        for cursor in [1, p + 1, 3 * p - 1] {
            let err = pool.free_kv_row_segments(&row, 0, cursor, 3 * p);
            assert!(
                matches!(err, Err(Error::SplitPage { cursor: c, page_size }) if c == cursor && page_size == ps),
                "{layout:?}/{ps} cursor {cursor}: {err:?}"
            );
        }
        assert_eq!(pool.capacity(), before, "{layout:?}/{ps}");
        assert_clean(&pool);
    });
}

/// Proves a cursor at (or clamped to) a row end that is not page-aligned splits nothing:
/// the two-sided half is empty, so the whole row is one FULL-only free of every page,
/// the partly filled last page included.
#[test]
fn a_cursor_at_an_unaligned_row_end_frees_the_whole_row_full_only() {
    paged_cases(|layout, ps| {
        let p = ps as usize;
        let len = 2 * p + 1;
        for cursor in [len, usize::MAX] {
            let mut pool = pool(layout, ps, 16);
            let row = new_row(&mut pool, len);
            pool.free_swa_segment(Segment::of_row(&row, 0..len))
                .unwrap();
            pool.free_kv_row_segments(&row, 0, cursor, len)
                .unwrap_or_else(|e| panic!("{layout:?}/{ps} cursor {cursor}: {e}"));
            assert_eq!(allocated(&pool), (0, 0), "{layout:?}/{ps} cursor {cursor}");
            assert_clean(&pool);
        }
    });
}

/// The sink's page as a segment (page-aligned, in range: only its page says what it is).
fn sink_segment(ps: u32) -> Vec<VirtualToken> {
    (0..ps).map(VirtualToken).collect()
}

/// Proves a transfer that names the sink, as its source or as its target, is refused for
/// that reason (not for the sink's SWA state) and changes nothing.
#[test]
fn a_transfer_from_or_to_the_sink_is_refused_as_a_sink_transfer() {
    each_case(|layout, ps| {
        let p = ps as usize;
        let mut pool = pool(layout, ps, 16);
        let row = new_row(&mut pool, 2 * p);
        pool.free_swa_segment(Segment::of_row(&row, 0..p)).unwrap();
        let (tombstone, live) = (Segment::of_row(&row, 0..p), Segment::of_row(&row, p..2 * p));
        let sink = sink_segment(ps);
        let sink = Segment::of_row(&sink, 0..p);
        let before = (pool.capacity(), pool.pool_map());
        for (from, to) in [(live, sink), (sink, tombstone)] {
            let err = pool.transfer_swa(from, to);
            assert!(
                matches!(
                    err,
                    Err(Error::BadTransfer {
                        reason: "the sink cannot be transferred",
                        ..
                    })
                ),
                "{layout:?}/{ps}: {err:?}"
            );
        }
        assert_eq!(
            (pool.capacity(), pool.pool_map()),
            before,
            "{layout:?}/{ps}"
        );
        assert_clean(&pool);
    });
}

/// Proves each id and quantity displays as its kind's prefix (or unit) and its number.
#[test]
fn ids_and_quantities_display_with_their_kind() {
    let shown = [
        format!("{}", VirtualToken(17)),
        format!("{}", VirtualPage(5)),
        format!("{}", PhysicalPage(9)),
        format!("{}", Bytes(4096)),
        format!("{}", PageSize::new(16).unwrap()),
    ];
    assert_eq!(shown, ["t17", "v5", "p9", "4096 B", "16"]);
}

/// Proves a page's first token is its page number times the page size (at page sizes
/// that are and are not powers of two), and is the token at offset 0.
#[test]
fn a_pages_first_token_is_the_page_times_the_page_size() {
    for (ps, page, first) in [(4, 3, 12), (16, 5, 80), (3, 7, 21), (1, 9, 9)] {
        let size = PageSize::new(ps).unwrap();
        let v = VirtualPage(page);
        assert_eq!(
            v.first_token(size),
            VirtualToken(first),
            "ps {ps} page {page}"
        );
        assert_eq!(v.first_token(size), v.token(size, 0));
        assert_eq!(v.first_token(size).page(size), v);
    }
}

/// Proves a grid refuses a sub-pool spec with any one of its layers, bytes per token or
/// kernel rows per token at zero, each alone, as a bad config.
#[test]
fn a_grid_refuses_a_spec_with_any_one_size_at_zero() {
    let good = SubPoolSpec::mha("full", 2, 1, 4, 2);
    let ps = PageSize::new(4).unwrap();
    assert!(Grid::new(&good, ps, 1 << 20, 64, "full").is_ok());
    let zeroed = [
        SubPoolSpec {
            layers: 0,
            ..good.clone()
        },
        SubPoolSpec {
            bytes_per_token: 0,
            ..good.clone()
        },
        SubPoolSpec {
            rows_per_token: 0,
            ..good.clone()
        },
    ];
    for spec in zeroed {
        let got = Grid::new(&spec, ps, 1 << 20, 64, "full");
        assert!(matches!(got, Err(Error::BadConfig(_))), "{spec:?}: {got:?}");
    }
}

/// Proves a slot grid refuses a slot pool with no layers even when its slot size is
/// valid, and one with no bytes per slot or a size that is not a multiple of 8.
#[test]
fn a_slot_grid_refuses_a_pool_with_no_layers_or_a_bad_slot_size() {
    let good = SlotPoolSpec {
        name: "mamba",
        layers: 2,
        bytes_per_slot: 256,
    };
    assert!(good.grid(1 << 20, 256).is_ok());
    for (layers, bytes_per_slot) in [(0, 256), (2, 0), (2, 12)] {
        let spec = SlotPoolSpec {
            layers,
            bytes_per_slot,
            ..good.clone()
        };
        let got = spec.grid(1 << 20, 256);
        assert!(matches!(got, Err(Error::BadConfig(_))), "{spec:?}: {got:?}");
    }
}

/// Proves the reference slot pool never holds more slots than the buffer: with a ratio
/// so large that the state share is the whole buffer, and a buffer size that rounds up
/// in floating point (2^54 − 1 → 2^54), the count is still the buffer's slots, rounded
/// down.
#[test]
fn a_reference_slot_pool_never_holds_more_slots_than_its_buffer() {
    let spec = SlotPoolSpec {
        name: "mamba",
        layers: 2,
        bytes_per_slot: 1 << 23,
    };
    let total = (1u64 << 54) - 1;
    let pool = reference_slot_pool(total, &spec, 1e20, PrefixCaching::Disabled).unwrap();
    assert_eq!(pool.slots as u64, total / spec.bytes_per_slot);
    assert!(pool.slots as u64 * spec.bytes_per_slot <= total);
    assert_eq!(pool.max_running_requests, pool.slots);
}

/// The envelopes of the page of `token` on FULL and SWA.
fn envelopes(pool: &Pool, token: VirtualToken) -> [ByteSpan; 2] {
    let v = token.page(pool.page_size());
    [Side::Full, Side::Swa].map(|side| {
        let env = pool.grid(side).envelope;
        ByteSpan {
            offset: pool.physical_page(side, v).unwrap() as u64 * env,
            len: env,
        }
    })
}

/// Proves a page handed out again is zeroed on both sides: a page whose envelopes were
/// written, then freed, and allocated again (a static pool's free stacks hand it back
/// first) reads zero on FULL and on SWA.
#[test]
fn a_reused_page_is_handed_out_zeroed_on_both_sides() {
    each_case(|layout, ps| {
        let p = ps as usize;
        let mut pool = pool(layout, ps, 16);
        let used = new_row(&mut pool, p);
        let written = envelopes(&pool, used[0]);
        pool.ledger
            .fill_spans(pool.buffer(), &written, 0x5a)
            .unwrap();
        pool.free_segment(Segment::of_row(&used, 0..p)).unwrap();
        pool.flush().unwrap();
        let again = new_row(&mut pool, p);
        for span in envelopes(&pool, again[0]) {
            let sync = HostSync::acquire("test: read a handed-out envelope");
            let bytes = pool
                .ledger
                .read_bytes(&sync, pool.buffer(), span.offset, span.len)
                .unwrap();
            assert!(
                bytes.iter().all(|&b| b == 0),
                "{layout:?}/{ps}: {span:?} handed out unzeroed"
            );
        }
    });
}

/// Proves the frees a group's end applies (in one batch) reach the device mirror: the
/// mirror is behind once the group ended, and after the upload the device translate of
/// every token agrees with the host's kernel ids on both sides (the freed ones the sink).
#[test]
fn frees_applied_at_a_group_end_reach_the_device_mirror() {
    each_case(|layout, ps| {
        let p = ps as usize;
        let mut pool = pool(layout, ps, 16);
        let (freed, kept) = (new_row(&mut pool, 3 * p), new_row(&mut pool, p));
        pool.upload_mirror().unwrap();
        pool.free_group_begin().unwrap();
        pool.free_segment(Segment::of_row(&freed, 0..2 * p))
            .unwrap();
        pool.free(&freed[2 * p..]).unwrap();
        pool.free_group_end().unwrap();
        assert!(!pool.mirror_current(), "{layout:?}/{ps}");
        pool.upload_mirror().unwrap();

        let tokens: Vec<VirtualToken> = freed.iter().chain(&kept).copied().collect();
        let ids: Vec<i32> = tokens.iter().map(|t| t.0 as i32).collect();
        let dev = pool.ledger.clone();
        let table = dev.alloc_table(ids.len(), 0).unwrap();
        dev.upload_table(table, 0, &ids).unwrap();
        for side in [Side::Full, Side::Swa] {
            let out = dev.alloc_table(ids.len(), -7).unwrap();
            pool.translate(side, table, ids.len(), out, ids.len())
                .unwrap();
            let sync = HostSync::acquire("test: read translated ids");
            let device = dev.read_table(&sync, out, 0, ids.len()).unwrap();
            let host: Vec<i32> = tokens.iter().map(|&t| pool.kernel_id(side, t)).collect();
            assert_eq!(device, host, "{layout:?}/{ps} {side:?}");
            assert!(host[..3 * p].iter().all(|&k| k == 0), "{layout:?}/{ps}");
        }
    });
}

/// Proves a static pool's id space is the sink plus one virtual page per FULL page: with
/// every page handed out, the ids are exactly `1..virtual_pages()`.
#[test]
fn a_static_pools_virtual_pages_are_the_sink_and_one_per_full_page() {
    for ps in unikv_invariants::testing::page_sizes() {
        let device: std::sync::Arc<dyn Device> =
            std::sync::Arc::new(unikv_kernels::SyncLedger::cpu());
        let mut a = StaticSwa::new(device, static_config(ps, 16)).unwrap();
        let (full_pages, _) = a.pool_pages();
        assert_eq!(a.virtual_pages(), full_pages + 1, "ps {ps}");
        let mut pages = Vec::new();
        while let Ok(row) = try_row(&mut a, ps as usize) {
            pages.push(row[0].page(a.page_size()).0);
        }
        pages.sort_unstable();
        assert_eq!(pages, (1..a.virtual_pages()).collect::<Vec<_>>(), "ps {ps}");
    }
}

/// Proves a demand for more FULL pages than the whole pool has no reclaim plan however
/// much the caller says is evictable: no eviction frees more than is allocated.
#[test]
fn a_demand_beyond_the_pool_has_no_plan_whatever_the_caller_offers() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 16);
        new_row(&mut pool, 3 * ps as usize);
        let total = pool.capacity().full.total_pages;
        let offered = Reclaimable::pages(10 * total, 10 * total);
        let plan = pool.reclaim_plan(PageDemand::pages(total + 1, 0), offered);
        assert_eq!(plan, None, "{layout:?}/{ps}");
        assert_clean(&pool);
    });
}

//! Property test: the public `KvAllocator` API driven with arbitrary arguments — valid
//! ones (rows the allocator handed out) mixed with invalid ones (out-of-range ids, the
//! sink, unaligned starts, overlapping or repeated segments, huge sizes, wrong order).
//! Every call returns `Ok` or a typed error and never panics (debug builds included);
//! after every call `verify()` and conservation hold; a call that returns an error
//! changes nothing. Premise breaches of well-shaped frees are recorded as invariants
//! (they are not errors), so the counters are drained at the end.

mod common;

use common::*;
use proptest::prelude::*;
use unikv_kernels::Device;
use unikv_pools::{
    DecodeRequest, ExtendRequest, FreeOp, KvAllocator, PageDemand, Reclaimable, Segment, Side,
    VirtualPage, VirtualToken,
};

/// A token: a raw number, or one the allocator handed out (live or freed since).
#[derive(Clone, Copy, Debug)]
enum Tok {
    Raw(u32),
    Known(u16),
}

/// A length or row position: small, or anything.
#[derive(Clone, Copy, Debug)]
enum Len {
    Small(u8),
    Raw(usize),
}

/// A slice of a handed-out row (or of arbitrary tokens), with an arbitrary start.
#[derive(Clone, Debug)]
enum Seg {
    Row { row: u8, from: u8, to: u8 },
    Toks { toks: Vec<Tok>, start: Len },
}

#[derive(Clone, Debug)]
enum Op {
    NewRow(u8),
    Extend {
        prefix: Len,
        grow: Len,
        last: Option<Tok>,
    },
    Decode {
        prefix: Len,
        last: Option<Tok>,
    },
    Free(Vec<Tok>),
    FreeSwa(Vec<Tok>),
    FreeFull(Vec<Tok>),
    Segment {
        kind: u8,
        seg: Seg,
    },
    Segments(Vec<Seg>),
    KvRow {
        row: u8,
        dead_lo: Len,
        cursor: Len,
        len: Len,
    },
    Transfer {
        from: Seg,
        to: Seg,
    },
    Batch(Vec<(u8, Seg, Seg)>),
    GroupBegin,
    GroupEnd,
    FlushDeferred,
    Flush,
    Ensure {
        full: Len,
        swa: Len,
    },
    Reclaim {
        full: Len,
        swa: Len,
        ef: Len,
        es: Len,
    },
    Upload,
    Translate {
        n: Len,
        width: Len,
    },
}

fn tok() -> impl Strategy<Value = Tok> {
    prop_oneof![1 => any::<u32>().prop_map(Tok::Raw), 4 => any::<u16>().prop_map(Tok::Known)]
}

fn len() -> impl Strategy<Value = Len> {
    prop_oneof![4 => any::<u8>().prop_map(Len::Small), 1 => any::<usize>().prop_map(Len::Raw)]
}

fn seg() -> impl Strategy<Value = Seg> {
    prop_oneof![
        3 => (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(row, from, to)| Seg::Row { row, from, to }),
        1 => (proptest::collection::vec(tok(), 0..6), len()).prop_map(|(toks, start)| Seg::Toks { toks, start }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let toks = || proptest::collection::vec(tok(), 0..6);
    prop_oneof![
        4 => any::<u8>().prop_map(Op::NewRow),
        2 => (len(), len(), proptest::option::of(tok())).prop_map(|(prefix, grow, last)| Op::Extend { prefix, grow, last }),
        1 => (len(), proptest::option::of(tok())).prop_map(|(prefix, last)| Op::Decode { prefix, last }),
        1 => toks().prop_map(Op::Free),
        1 => toks().prop_map(Op::FreeSwa),
        1 => toks().prop_map(Op::FreeFull),
        3 => (0u8..3, seg()).prop_map(|(kind, seg)| Op::Segment { kind, seg }),
        1 => proptest::collection::vec(seg(), 0..4).prop_map(Op::Segments),
        2 => (any::<u8>(), len(), len(), len()).prop_map(|(row, dead_lo, cursor, len)| Op::KvRow { row, dead_lo, cursor, len }),
        1 => (seg(), seg()).prop_map(|(from, to)| Op::Transfer { from, to }),
        1 => proptest::collection::vec((0u8..5, seg(), seg()), 0..4).prop_map(Op::Batch),
        1 => Just(Op::GroupBegin),
        1 => Just(Op::GroupEnd),
        1 => Just(Op::FlushDeferred),
        1 => Just(Op::Flush),
        1 => (len(), len()).prop_map(|(full, swa)| Op::Ensure { full, swa }),
        1 => (len(), len(), len(), len()).prop_map(|(full, swa, ef, es)| Op::Reclaim { full, swa, ef, es }),
        1 => Just(Op::Upload),
        1 => (len(), len()).prop_map(|(n, width)| Op::Translate { n, width }),
    ]
}

struct World {
    /// Every token ever handed out.
    known: Vec<VirtualToken>,
    /// Rows handed out (live or not).
    rows: Vec<Vec<VirtualToken>>,
}

impl World {
    fn tok(&self, t: Tok) -> VirtualToken {
        match t {
            Tok::Raw(x) => VirtualToken(x),
            Tok::Known(i) if !self.known.is_empty() => self.known[i as usize % self.known.len()],
            Tok::Known(i) => VirtualToken(i as u32),
        }
    }

    fn toks(&self, ts: &[Tok]) -> Vec<VirtualToken> {
        ts.iter().map(|&t| self.tok(t)).collect()
    }

    fn row(&self, i: u8) -> &[VirtualToken] {
        if self.rows.is_empty() {
            &[]
        } else {
            &self.rows[i as usize % self.rows.len()]
        }
    }
}

fn len_of(l: Len) -> usize {
    match l {
        Len::Small(x) => x as usize,
        Len::Raw(x) => x,
    }
}

/// The tokens a [`Seg`] names, owned, and its start.
fn seg_parts(w: &World, s: &Seg, ps: usize) -> (Vec<VirtualToken>, usize) {
    match s {
        Seg::Row { row, from, to } => {
            let row = w.row(*row);
            let pages = row.len().div_ceil(ps);
            let a = (*from as usize % (pages + 1) * ps).min(row.len());
            let b = (*to as usize % (pages + 1) * ps).min(row.len()).max(a);
            (row[a..b].to_vec(), a)
        }
        Seg::Toks { toks, start } => (w.toks(toks), len_of(*start)),
    }
}

fn segment(parts: &(Vec<VirtualToken>, usize)) -> Segment<'_> {
    Segment {
        tokens: &parts.0,
        start: parts.1,
    }
}

/// Everything a refused call must leave as it was.
fn snapshot(a: &dyn KvAllocator) -> impl PartialEq + std::fmt::Debug + use<> {
    let tables: Vec<_> = (0..a.virtual_pages())
        .map(|v| {
            let v = VirtualPage(v);
            (
                a.physical_page(Side::Full, v),
                a.physical_page(Side::Swa, v),
                a.swa_state(v),
            )
        })
        .collect();
    (
        (a.capacity(), a.pool_map(), a.pending_frees()),
        (a.in_free_group(), a.mirror_current(), tables),
    )
}

fn run(layout: Layout, ps: u32, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut pool = pool(layout, ps, 24);
    let psz = ps as usize;
    let mut w = World {
        known: Vec::new(),
        rows: Vec::new(),
    };
    let dev = pool.ledger.clone();
    let ids = dev.alloc_table(16, 0).unwrap();
    dev.upload_table(ids, 0, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let out = dev.alloc_table(16, 0).unwrap();
    for (step, op) in ops.iter().enumerate() {
        let ctx = || format!("{layout:?}/ps {ps}, step {step}: {op:?}");
        if matches!(op, Op::Ensure { .. }) {
            // A refused `ensure_capacity` keeps the deferred frees it applied (they were
            // due); apply them first so the comparison is exact.
            pool.flush_deferred();
        }
        let before = snapshot(&*pool.alloc);
        let a = &mut *pool.alloc;
        let result: Result<(), unikv_pools::Error> = match op {
            Op::NewRow(n) => {
                let mut row = Vec::new();
                let req = ExtendRequest {
                    prefix_len: 0,
                    seq_len: *n as usize % (4 * psz) + 1,
                    last_token: None,
                };
                let r = a.alloc_extend(&[req], &mut row);
                if r.is_ok() {
                    w.known.extend(&row);
                    w.rows.push(row);
                }
                r
            }
            Op::Extend { prefix, grow, last } => {
                let prefix_len = len_of(*prefix);
                let req = ExtendRequest {
                    prefix_len,
                    seq_len: prefix_len.saturating_add(len_of(*grow)),
                    last_token: last.map(|t| w.tok(t)),
                };
                let mut got = Vec::new();
                let r = a.alloc_extend(&[req], &mut got);
                w.known.extend(got);
                r
            }
            Op::Decode { prefix, last } => {
                let req = DecodeRequest {
                    prefix_len: len_of(*prefix),
                    last_token: last.map(|t| w.tok(t)),
                };
                let mut got = Vec::new();
                let r = a.alloc_decode(&[req], &mut got);
                w.known.extend(got);
                r
            }
            Op::Free(ts) => a.free(&w.toks(ts)),
            Op::FreeSwa(ts) => a.free_swa(&w.toks(ts)),
            Op::FreeFull(ts) => a.free_full(&w.toks(ts)),
            Op::Segment { kind, seg } => {
                let parts = seg_parts(&w, seg, psz);
                match kind {
                    0 => a.free_segment(segment(&parts)),
                    1 => a.free_swa_segment(segment(&parts)),
                    _ => a.free_full_segment(segment(&parts)),
                }
            }
            Op::Segments(segs) => {
                let parts: Vec<_> = segs.iter().map(|s| seg_parts(&w, s, psz)).collect();
                let segs: Vec<_> = parts.iter().map(segment).collect();
                a.free_segments(&segs)
            }
            Op::KvRow {
                row,
                dead_lo,
                cursor,
                len,
            } => {
                let row = w.row(*row).to_vec();
                a.free_kv_row_segments(&row, len_of(*dead_lo), len_of(*cursor), len_of(*len))
            }
            Op::Transfer { from, to } => {
                let (f, t) = (seg_parts(&w, from, psz), seg_parts(&w, to, psz));
                a.transfer_swa(segment(&f), segment(&t))
            }
            Op::Batch(items) => {
                let parts: Vec<_> = items
                    .iter()
                    .map(|(k, s, t)| (*k, seg_parts(&w, s, psz), seg_parts(&w, t, psz)))
                    .collect();
                let rows: Vec<_> = items.iter().map(|(k, ..)| w.row(*k).to_vec()).collect();
                let batch: Vec<FreeOp<'_>> = parts
                    .iter()
                    .zip(&rows)
                    .map(|((k, s, t), row)| match k {
                        0 => FreeOp::Segment(segment(s)),
                        1 => FreeOp::FullSegment(segment(s)),
                        2 => FreeOp::SwaSegment(segment(s)),
                        3 => FreeOp::TransferSwa {
                            from: segment(s),
                            to: segment(t),
                        },
                        _ => FreeOp::KvRow {
                            row,
                            dead_lo: s.1,
                            cursor: t.1,
                            len: row.len(),
                        },
                    })
                    .collect();
                a.free_batch(&batch);
                Ok(())
            }
            Op::GroupBegin => a.free_group_begin(),
            Op::GroupEnd => a.free_group_end(),
            Op::FlushDeferred => {
                a.flush_deferred();
                Ok(())
            }
            Op::Flush => a.flush().map(|_| ()),
            Op::Ensure { full, swa } => {
                a.ensure_capacity(PageDemand::pages(len_of(*full), len_of(*swa)))
            }
            Op::Reclaim { full, swa, ef, es } => {
                let demand = PageDemand::pages(len_of(*full), len_of(*swa));
                let evictable = Reclaimable::pages(len_of(*ef), len_of(*es));
                let _ = a.allocation_fits(demand);
                if let Some(plan) = a.reclaim_plan(demand, evictable) {
                    // The floor is the least FULL reclaim that fits with all SWA reclaim:
                    // a lower bound of the plan's FULL, enough with all SWA, and no less is.
                    let floor = plan.full_floor_pages;
                    assert!(floor <= plan.full_pages, "{plan:?}");
                    let with = |f| Reclaimable::pages(f, evictable.swa_pages);
                    assert!(a.reclaim_plan(demand, with(floor)).is_some(), "{plan:?}");
                    if floor > 0 {
                        assert_eq!(a.reclaim_plan(demand, with(floor - 1)), None, "{plan:?}");
                    }
                }
                Ok(())
            }
            Op::Upload => a.upload_mirror(),
            Op::Translate { n, width } => {
                let side = if len_of(*n).is_multiple_of(2) {
                    Side::Full
                } else {
                    Side::Swa
                };
                a.translate(side, ids, len_of(*n), out, len_of(*width))
            }
        };
        if let Err(e) = &result {
            prop_assert_eq!(
                snapshot(&*pool.alloc),
                before,
                "{}: refused with {} but changed the state",
                ctx(),
                e
            );
        }
        pool.verify()
            .map_err(|e| TestCaseError::fail(format!("{}: {e}", ctx())))?;
        prop_assert!(pool.check_conservation(), "{}", ctx());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(32),
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_arguments_get_ok_or_a_typed_error_and_a_refusal_changes_nothing(
        ops in proptest::collection::vec(op(), 1..64)
    ) {
        for ps in unikv_invariants::testing::page_sizes() {
            for layout in LAYOUTS {
                run(layout, ps, &ops)?;
            }
        }
    }
}

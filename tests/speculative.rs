//! Speculative decoding through `HybridCache`: verify steps reserve every position a
//! draft may keep on FULL, SWA and the recurrent slot group, and settling gives back what
//! was rejected (whole pages only) and selects the accepted state. Every case at
//! invariant level Strict (a conservation breach fails the step boundary), on both
//! layouts, a FULL + SWA, a FULL + Mamba and a tri-pool model, at page sizes 1, 16, 256
//! and the matrix's.

mod common;

use common::{LAYOUTS, TINY_MAMBA, TINY_TRI, tiny_model};
use unikv::invariants::{Level, scoped_level};
use unikv::pools::{Side, SwaState, VirtualPage};
use unikv::{
    Accepted, AcceptedFault, Draft, Error, HybridCache, Layout, ModelSpec, Request, Speculation,
    TokenId,
};

/// Drafted tokens per chain verify.
const K: usize = 4;

/// The models: FULL + SWA (window 8), FULL + Mamba, and FULL + SWA + Mamba.
fn models() -> [ModelSpec; 3] {
    [tiny_model(8, 1), TINY_MAMBA, TINY_TRI]
}

fn page_sizes() -> Vec<u32> {
    let mut sizes = vec![1, 16, 256];
    for ps in common::page_sizes() {
        if !sizes.contains(&ps) {
            sizes.push(ps);
        }
    }
    sizes
}

fn cache(model: ModelSpec, layout: Layout, ps: u32, speculation: Speculation) -> HybridCache {
    HybridCache::builder()
        .model(model.with_draft_layers(1))
        .page_size(ps)
        .memory_bytes(8 << 20)
        .layout(layout)
        .speculation(speculation)
        .build()
        .unwrap()
}

fn tokens(from: u32, n: usize) -> Vec<TokenId> {
    (from..from + n as u32).map(TokenId).collect()
}

/// Admits a prompt of `len` tokens and prefills it.
fn prefill(c: &mut HybridCache, len: usize) -> Request {
    let hit = c.match_prefix(tokens(0, len));
    let mut req = c.admit(hit).unwrap();
    c.alloc_extend(&mut req, len).unwrap();
    req
}

/// Pages a request holds on FULL past the tree-owned prefix, by its row.
fn held_full(req: &Request, ps: usize) -> usize {
    req.len().div_ceil(ps) - req.protected_len() / ps
}

/// Runs `case` for every model, layout and page size at Strict, with chain drafts of
/// `K` tokens settled before the next step, then checks that releasing the case's
/// requests and evicting the tree frees every page and slot.
fn each(speculation: Speculation, case: impl Fn(&mut HybridCache, &str, usize) -> Vec<Request>) {
    scoped_level(Level::Strict, || {
        for model in models() {
            for layout in LAYOUTS {
                for ps in page_sizes() {
                    let mut c = cache(model, layout, ps, speculation);
                    let label = format!("{} {} ps {ps}", model.name, layout.as_str());
                    let live = case(&mut c, &label, ps as usize);
                    for req in live {
                        c.release(req).unwrap();
                    }
                    c.step_boundary().unwrap();
                    c.evict_all().unwrap();
                    c.step_boundary().unwrap();
                    common::assert_all_free(&c.stats(), &label);
                }
            }
        }
    });
}

/// A prompt length that leaves the verify's rows at `offset` into a page.
fn prompt_at(ps: usize, offset: usize) -> usize {
    3 * ps.max(8) + offset % ps
}

#[test]
fn a_verify_reserves_every_position_and_all_rejected_keeps_only_the_first() {
    each(Speculation::chain(K as u32), |c, label, ps| {
        let mut req = prefill(c, prompt_at(ps, 3));
        let len = req.len();
        c.step_boundary().unwrap();
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap();
        assert_eq!(req.len(), len + 1 + K, "{label}: 1 + k rows reserved");
        assert_eq!(req.settled_len(), len, "{label}");
        assert_eq!(req.unsettled_verifies(), 1, "{label}");
        c.step_boundary().unwrap();
        c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, 1))])
            .unwrap();
        assert_eq!(
            (req.len(), req.settled_len()),
            (len + 1, len + 1),
            "{label}"
        );
        assert_eq!(req.tokens()[len], TokenId(900), "{label}");
        c.step_boundary().unwrap();
        assert_eq!(
            c.stats().full.held_pages,
            held_full(&req, ps),
            "{label}: the rejected tail's whole pages went back"
        );
        vec![req]
    });
}

#[test]
fn all_accepted_keeps_every_row_and_frees_nothing() {
    each(Speculation::chain(K as u32), |c, label, _| {
        let mut req = prefill(c, 37);
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap();
        let row = req.row().to_vec();
        let before = c.stats().full.available_pages;
        c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, 1 + K))])
            .unwrap();
        c.step_boundary().unwrap();
        assert_eq!(req.row(), &row[..], "{label}");
        assert_eq!(req.settled_len(), 37 + 1 + K, "{label}");
        assert_eq!(c.stats().full.available_pages, before, "{label}");
        vec![req]
    });
}

#[test]
fn a_partial_tail_frees_whole_pages_only_inside_one_page_and_across_a_boundary() {
    // (offset of the verify's first row in its page, accepted): at page size 16 the
    // first case stays inside one page, the second crosses into the next and gives it
    // back.
    for (offset, accepted) in [(3, 2), (13, 2)] {
        each(Speculation::chain(K as u32), |c, label, ps| {
            let mut req = prefill(c, prompt_at(ps, offset));
            let len = req.len();
            c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                .unwrap();
            let reserved_pages = held_full(&req, ps);
            c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, accepted))])
                .unwrap();
            c.step_boundary().unwrap();
            let kept = (len + accepted).div_ceil(ps) - req.protected_len() / ps;
            assert_eq!(c.stats().full.held_pages, kept, "{label} offset {offset}");
            assert!(c.stats().swa.held_pages <= kept, "{label}");
            assert!(kept <= reserved_pages, "{label}");
            // The next decode fills the partly used page first.
            c.alloc_decode(&mut [&mut req], &[TokenId(1)]).unwrap();
            c.step_boundary().unwrap();
            assert_eq!(req.len(), len + accepted + 1, "{label}");
            vec![req]
        });
    }
}

#[test]
fn a_tree_accepting_a_non_contiguous_path_keeps_its_nodes_in_path_order() {
    // Node 0 → 1, 2; 1 → 3; 2 → 4. The target accepts 0 → 2 → 4.
    let parents = [-1, 0, 0, 1, 2];
    each(Speculation::tree(5), |c, label, _| {
        let mut req = prefill(c, 21);
        c.alloc_verify(&mut [&mut req], &[Draft::Tree { parents: &parents }])
            .unwrap();
        let row = req.row().to_vec();
        let group = req.state_group().to_vec();
        c.settle(
            &mut [&mut req],
            &[Accepted::tree(&[0, 2, 4], &tokens(900, 3))],
        )
        .unwrap();
        c.step_boundary().unwrap();
        // Accepted nodes become rows 21, 22, 23 (the device moves their KV there).
        assert_eq!(req.row(), &row[..24], "{label}");
        assert_eq!(&req.tokens()[21..], &tokens(900, 3)[..], "{label}");
        if !group.is_empty() {
            assert_eq!(
                req.state_slot(),
                Some(group[4]),
                "{label}: the last accepted node's state runs"
            );
        }
        vec![req]
    });
}

#[test]
fn swa_keeps_the_window_behind_every_verify_position_across_a_release() {
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            for ps in page_sizes() {
                let model = tiny_model(8, 1);
                let spec = Speculation::chain(K as u32).in_flight(2);
                let mut c = cache(model, layout, ps, spec);
                let label = format!("{} ps {ps}", layout.as_str());
                let mut req = prefill(&mut c, 3 * ps as usize + 5);
                // Counts arrive one step late: each step is allocated with the last one's
                // unsettled, enough steps to move the window cursor several times.
                c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                    .unwrap();
                for step in 0..40u32 {
                    c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                        .unwrap();
                    let settled = req.settled_len();
                    let alloc = c.allocator();
                    // Every row a verify position may read (the window behind the first
                    // unsettled position and everything after it) is live on SWA.
                    for i in (settled + 1).saturating_sub(8)..req.len() {
                        let page = VirtualPage(req.row()[i].0 / ps);
                        assert_eq!(
                            alloc.swa_state(page),
                            SwaState::Live,
                            "{label}: step {step} row {i}"
                        );
                        assert!(alloc.physical_page(Side::Swa, page).is_some(), "{label}");
                    }
                    let a = 1 + (step as usize % (K + 1));
                    c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, a))])
                        .unwrap();
                    c.step_boundary().unwrap();
                }
                assert!(req.window_cursor() > 0, "{label}: the window moved");
                c.release(req).unwrap();
                c.step_boundary().unwrap();
                common::assert_all_free(&c.stats(), &label);
            }
        }
    });
}

#[test]
fn an_abort_and_a_retraction_mid_verify_return_every_page_and_slot() {
    each(Speculation::chain(K as u32).in_flight(2), |c, label, _| {
        let mut a = prefill(c, 40);
        let mut b = prefill(c, 50);
        c.cache_unfinished(&mut b).unwrap();
        c.alloc_verify(&mut [&mut a, &mut b], &[Draft::Chain { k: K }; 2])
            .unwrap();
        c.alloc_verify(&mut [&mut a, &mut b], &[Draft::Chain { k: 2 }; 2])
            .unwrap();
        // Abort one, retract the other and admit it again from its settled tokens.
        c.release(a).unwrap();
        let again = c.release(b).unwrap();
        assert_eq!(again.len(), 50, "{label}: only settled tokens come back");
        c.step_boundary().unwrap();
        let s = c.stats();
        assert_eq!(
            (s.full.held_pages, s.swa.held_pages, s.mamba.held_pages),
            (0, 0, 0)
        );
        let hit = c.match_prefix(again);
        let mut b = c.admit(hit).unwrap();
        let n = b.remaining_prefill();
        c.alloc_extend(&mut b, n).unwrap();
        c.step_boundary().unwrap();
        vec![b]
    });
}

#[test]
fn late_counts_settle_in_order_and_free_only_what_no_verify_may_read() {
    each(Speculation::chain(K as u32).in_flight(2), |c, label, ps| {
        let mut req = prefill(c, 30);
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap();
        c.step_boundary().unwrap();
        // The next step is allocated before the first step's counts arrive.
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap();
        assert_eq!(req.len(), 30 + 2 * (1 + K), "{label}");
        assert_eq!(
            c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                .unwrap_err()
                .to_string(),
            Error::TooManyInFlight {
                request: req.id(),
                in_flight: 2
            }
            .to_string(),
            "{label}"
        );
        c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, 2))])
            .unwrap();
        // The second verify may still read up to 2 + (1 + K) rows past the settled ones.
        assert_eq!((req.settled_len(), req.len()), (32, 32 + 1 + K), "{label}");
        c.settle(&mut [&mut req], &[Accepted::chain(&tokens(910, 3))])
            .unwrap();
        assert_eq!((req.settled_len(), req.len()), (35, 35), "{label}");
        assert_eq!(&req.tokens()[30..], &[900, 901, 910, 911, 912].map(TokenId));
        c.step_boundary().unwrap();
        assert_eq!(c.stats().full.held_pages, held_full(&req, ps), "{label}");
        vec![req]
    });
}

#[test]
fn bad_settlements_and_drafts_are_typed_errors_that_change_nothing() {
    each(Speculation::tree(5), |c, label, _| {
        let t1 = tokens(1, 8);
        let mut req = prefill(c, 25);
        // A bad parent array, and a draft wider than the cache verifies.
        let bad_tree = c
            .alloc_verify(
                &mut [&mut req],
                &[Draft::Tree {
                    parents: &[-1, 0, 2],
                }],
            )
            .unwrap_err();
        assert!(
            matches!(
                bad_tree,
                Error::BadDraftTree {
                    node: 2,
                    parent: 2,
                    ..
                }
            ),
            "{label}: {bad_tree}"
        );
        let wide = c
            .alloc_verify(&mut [&mut req], &[Draft::Chain { k: 5 }])
            .unwrap_err();
        assert!(
            matches!(
                wide,
                Error::VerifyWidth {
                    width: 6,
                    max_width: 5,
                    ..
                }
            ),
            "{label}"
        );
        // Settling with nothing in flight.
        let none = c
            .settle(&mut [&mut req], &[Accepted::chain(&t1[..1])])
            .unwrap_err();
        assert!(matches!(none, Error::NothingToSettle { .. }), "{label}");
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: 3 }])
            .unwrap();
        let before = (req.row().to_vec(), req.tokens().to_vec(), c.stats());
        let refused = [
            (Accepted::chain(&[]), AcceptedFault::Count),
            (Accepted::chain(&t1[..5]), AcceptedFault::Count),
            (
                Accepted::tree(&[0, 1], &t1[..2]),
                AcceptedFault::PathForChain,
            ),
        ];
        for (acc, fault) in refused {
            let e = c.settle(&mut [&mut req], &[acc]).unwrap_err();
            assert!(
                matches!(e, Error::BadAccepted { reason, .. } if reason == fault),
                "{label}: {e}"
            );
            assert_eq!(
                (req.row(), req.tokens(), c.stats()),
                (&before.0[..], &before.1[..], before.2)
            );
        }
        c.settle(&mut [&mut req], &[Accepted::chain(&t1[..4])])
            .unwrap();
        // A tree: a path that leaves it, one without a path, and settling twice.
        c.alloc_verify(
            &mut [&mut req],
            &[Draft::Tree {
                parents: &[-1, 0, 0, 1],
            }],
        )
        .unwrap();
        for (acc, fault) in [
            (
                Accepted::tree(&[0, 2, 3], &t1[..3]),
                AcceptedFault::NotAPath { index: 2, node: 3 },
            ),
            (
                Accepted::tree(&[1], &t1[..1]),
                AcceptedFault::NotAPath { index: 0, node: 1 },
            ),
            (Accepted::chain(&t1[..2]), AcceptedFault::NoPath),
            (
                Accepted::tree(&[0, 1], &t1[..3]),
                AcceptedFault::PathLength { path: 2 },
            ),
        ] {
            let e = c.settle(&mut [&mut req], &[acc]).unwrap_err();
            assert!(
                matches!(e, Error::BadAccepted { reason, .. } if reason == fault),
                "{label}: {e}"
            );
        }
        c.settle(&mut [&mut req], &[Accepted::tree(&[0, 1, 3], &t1[..3])])
            .unwrap();
        let twice = c
            .settle(&mut [&mut req], &[Accepted::tree(&[0, 1, 3], &t1[..3])])
            .unwrap_err();
        assert!(matches!(twice, Error::NothingToSettle { .. }), "{label}");
        c.step_boundary().unwrap();
        // A plain decode waits for settlement; after it, it works.
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: 1 }])
            .unwrap();
        let unsettled = c.alloc_decode(&mut [&mut req], &[TokenId(5)]).unwrap_err();
        assert!(
            matches!(unsettled, Error::Unsettled { in_flight: 1, .. }),
            "{label}"
        );
        c.settle(&mut [&mut req], &[Accepted::chain(&t1[..1])])
            .unwrap();
        c.alloc_decode(&mut [&mut req], &[TokenId(5)]).unwrap();
        c.step_boundary().unwrap();
        vec![req]
    });
}

#[test]
fn a_cache_without_speculation_refuses_a_verify() {
    let mut c = HybridCache::builder()
        .model(tiny_model(8, 1))
        .memory_bytes(1 << 20)
        .build()
        .unwrap();
    let mut req = prefill(&mut c, 10);
    let e = c
        .alloc_verify(&mut [&mut req], &[Draft::Chain { k: 1 }])
        .unwrap_err();
    assert!(matches!(e, Error::SpeculationOff { .. }), "{e}");
    c.release(req).unwrap();
}

#[test]
fn finishing_mid_verify_caches_the_settled_pages_and_frees_the_reserved_ones() {
    each(Speculation::chain(K as u32).in_flight(2), |c, label, ps| {
        let len = 2 * ps.max(8);
        let mut req = prefill(c, len);
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap();
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap();
        c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, 1 + K))])
            .unwrap();
        let settled = req.tokens().to_vec();
        c.cache_finished(req).unwrap();
        c.step_boundary().unwrap();
        let s = c.stats();
        assert_eq!(
            (s.full.held_pages, s.swa.held_pages, s.mamba.held_pages),
            (0, 0, 0)
        );
        // The settled whole pages are cached: a follow-up hits them.
        let hit = c.match_prefix(settled);
        assert!(
            hit.kv_hit_tokens() >= len,
            "{label}: {}",
            hit.kv_hit_tokens()
        );
        vec![]
    });
}

#[test]
fn a_recurrent_request_runs_on_a_slot_group_and_settling_selects_the_accepted_state() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                let mut c = cache(model, layout, 1, Speculation::chain(K as u32));
                let label = format!("{} {}", model.name, layout.as_str());
                let mut req = prefill(&mut c, 10);
                let group = req.state_group().to_vec();
                assert_eq!(group.len(), 1 + K, "{label}");
                assert_eq!(req.state_slot(), Some(group[0]), "{label}");
                assert_eq!(
                    c.stats().mamba.held_pages,
                    1 + K + req.checkpoint_writes().len()
                );
                for a in [3, 1, 5] {
                    c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                        .unwrap();
                    c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, a))])
                        .unwrap();
                    assert_eq!(
                        req.state_slot(),
                        Some(group[a - 1]),
                        "{label}: accepted {a}"
                    );
                    c.step_boundary().unwrap();
                }
                c.release(req).unwrap();
                c.step_boundary().unwrap();
                c.evict_all().unwrap();
                c.step_boundary().unwrap();
                common::assert_all_free(&c.stats(), &label);
            }
        }
    });
}

#[test]
fn a_settled_verify_crossing_a_grid_point_saves_its_state_there_unless_settled_late() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                for late in [false, true] {
                    let spec = Speculation::chain(K as u32).in_flight(2);
                    let mut c = HybridCache::builder()
                        .model(model)
                        .memory_bytes(8 << 20)
                        .layout(layout)
                        .checkpoint_interval(16)
                        .speculation(spec)
                        .build()
                        .unwrap();
                    let label = format!("{} {} late {late}", model.name, layout.as_str());
                    // 14 prompt tokens, then 5 accepted cross the grid point at 16.
                    let mut req = prefill(&mut c, 14);
                    c.cache_unfinished(&mut req).unwrap();
                    c.step_boundary().unwrap();
                    c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                        .unwrap();
                    if late {
                        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                            .unwrap();
                    }
                    c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, 1 + K))])
                        .unwrap();
                    let checkpoints = req.state_slots().len() - req.state_group().len();
                    assert_eq!(checkpoints, usize::from(!late), "{label}");
                    if late {
                        c.settle(&mut [&mut req], &[Accepted::chain(&tokens(910, 1))])
                            .unwrap();
                    }
                    let conversation = req.tokens().to_vec();
                    c.cache_finished(req).unwrap();
                    c.step_boundary().unwrap();
                    let hit = c.match_prefix(conversation);
                    assert_eq!(
                        hit.cached_tokens(),
                        if late { 14 } else { 16 },
                        "{label}: the grid point's state ends the match, else the prompt end's"
                    );
                    c.evict_all().unwrap();
                    c.step_boundary().unwrap();
                    common::assert_all_free(&c.stats(), &label);
                }
            }
        }
    });
}

/// Every speculative path — verify steps (chain and tree, late and timely), their
/// metadata (built, translated from device-side offsets, a tree's compaction), settlement
/// (all rejected, partial, all accepted, a tree path), checkpoints copied out of the
/// slot group, an abort and a finish mid-verify — issues no host sync and no
/// data-dependent shape, on the CPU backend and on the CUDA backend over its emulated
/// driver (whose ops must not block either).
#[test]
fn every_speculative_path_issues_no_host_sync() {
    use std::sync::Arc;
    use unikv::kernels::{CpuDevice, CudaDevice, Device, Readback, SyncLedger};
    use unikv::{DeviceValues, VerifyMetadata, VerifyOffsets};
    let devices: [fn() -> Arc<dyn Readback>; 2] = [
        || Arc::new(CpuDevice::new()),
        || Arc::new(CudaDevice::emulated()),
    ];
    for device in devices {
        for model in models() {
            for layout in LAYOUTS {
                for ps in [1u32, 16] {
                    let ledger = Arc::new(SyncLedger::new(device()));
                    let mut c = HybridCache::builder()
                        .model(model.with_draft_layers(1))
                        .page_size(ps)
                        .memory_bytes(8 << 20)
                        .layout(layout)
                        .checkpoint_interval(16 * ps)
                        .speculation(Speculation::tree(5).in_flight(2))
                        .device(ledger.clone())
                        .build()
                        .unwrap();
                    let label =
                        format!("{} {} ps {ps} on {:?}", model.name, layout.as_str(), ledger);
                    let mut a = prefill(&mut c, 14 * ps as usize);
                    let mut b = prefill(&mut c, 30);
                    let mut d = prefill(&mut c, 20);
                    c.step_boundary().unwrap();
                    // The engine's device values: offsets, then accepted paths (all
                    // empty: −1).
                    let values = ledger.alloc_table(6 + 4 * 5, -1).unwrap();
                    let at = |at| DeviceValues { table: values, at };
                    let mut meta = VerifyMetadata::new(4);
                    c.reserve_verify_metadata(&meta).unwrap();
                    ledger.reset();
                    let tree = [-1, 0, 0, 1, 2];
                    for step in 0..12usize {
                        let drafts = [
                            Draft::Chain { k: 4 },
                            Draft::Tree { parents: &tree },
                            Draft::Chain { k: step % 5 },
                        ];
                        c.alloc_verify(&mut [&mut a, &mut b, &mut d], &drafts)
                            .unwrap();
                        // The verify's metadata, translated from the device-side
                        // offsets of the earlier verifies, and a tree's compaction.
                        c.build_verify_metadata(&mut meta, &[&a, &b, &d]).unwrap();
                        let late = (step > 0) as i32;
                        ledger
                            .upload_table(values, 0, &[late * 2, late * 3, 0, late, late * 2, 0])
                            .unwrap();
                        c.translate_verify(
                            &mut meta,
                            Some(VerifyOffsets {
                                accepted: at(0),
                                last_node: at(3),
                            }),
                        )
                        .unwrap();
                        c.compact_accepted(&meta, at(6)).unwrap();
                        // `a` and `b` settle a step late, `d` at once.
                        c.settle(
                            &mut [&mut d],
                            &[Accepted::chain(&tokens(900, 1 + step % 5))],
                        )
                        .unwrap();
                        if step > 0 {
                            let path: &[u32] = [&[0][..], &[0, 2], &[0, 2, 4]][step % 3];
                            c.settle(
                                &mut [&mut a, &mut b],
                                &[
                                    Accepted::chain(&tokens(900, 1 + step % 5)),
                                    Accepted::tree(path, &tokens(900, path.len())),
                                ],
                            )
                            .unwrap();
                        }
                        c.cache_unfinished(&mut d).unwrap();
                        c.step_boundary().unwrap();
                    }
                    c.release(a).unwrap();
                    c.cache_finished(b).unwrap();
                    c.cache_finished(d).unwrap();
                    c.step_boundary().unwrap();
                    ledger
                        .check_no_syncs()
                        .unwrap_or_else(|report| panic!("{label}: {report}"));
                    assert_eq!(
                        (ledger.syncs(), ledger.data_dependent_shapes()),
                        (0, 0),
                        "{label}"
                    );
                    assert!(
                        ledger.op_count() > 0,
                        "{label}: the steps issued device work"
                    );
                }
            }
        }
    }
}

/// At the top of a 141 GiB buffer (an H200's memory) kernel ids and byte offsets of a
/// verify's rows — FULL, SWA and the draft model's layer in the FULL envelope — neither
/// wrap nor leave the buffer: in the unified layout FULL grows down from the buffer's
/// high end, so the first request's rows are its highest pages. Bookkeeping only
/// (`NullDevice`).
#[test]
fn verify_rows_at_the_top_of_a_141_gib_pool_do_not_wrap() {
    use std::sync::Arc;
    use unikv::kernels::NullDevice;
    const BYTES: u64 = 141 << 30;
    for model in [ModelSpec::GPT_OSS_120B, ModelSpec::QWEN3_NEXT_80B_A3B] {
        let model = model.with_draft_layers(1);
        for layout in LAYOUTS {
            for ps in [1u32, 16, 256] {
                let mut c = HybridCache::builder()
                    .model(model)
                    .page_size(ps)
                    .memory_bytes(BYTES)
                    .layout(layout)
                    .speculation(Speculation::chain(K as u32))
                    .device(Arc::new(NullDevice::new()))
                    .build()
                    .unwrap();
                let label = format!("{} {} ps {ps}", model.name, layout.as_str());
                let mut req = prefill(&mut c, 3 * ps as usize + 1);
                c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                    .unwrap();
                let g = c.kv_geometry();
                let alloc = c.allocator();
                let mut highest = 0u64;
                for (side, layers) in [
                    (Side::Full, model.full_envelope_layers()),
                    (Side::Swa, model.swa_layers),
                ] {
                    if layers == 0 {
                        continue;
                    }
                    let grid = alloc.grid(side);
                    // SWA below the window cursor was released.
                    let from = if side == Side::Swa {
                        req.window_cursor()
                    } else {
                        0
                    };
                    for &t in &req.row()[from..] {
                        let id = alloc.kernel_id(side, t);
                        let page = alloc
                            .physical_page(side, VirtualPage(t.0 / ps))
                            .unwrap_or_else(|| panic!("{label}: {side:?} {t} unbound"));
                        let exact = u64::from(page) * u64::from(grid.stride) + u64::from(t.0 % ps);
                        assert_eq!(id as u64, exact, "{label}: {side:?} id of {t} wrapped");
                        let last = g.row_offset(side, id, layers - 1, true);
                        let end = last
                            + if side == Side::Full {
                                g.full_row_bytes
                            } else {
                                g.swa_row_bytes
                            };
                        assert!(end <= BYTES, "{label}: {side:?} row past the buffer: {end}");
                        highest = highest.max(end);
                    }
                }
                // The unified layout's FULL pages come from the buffer's high end (the
                // static one's FULL pool starts about halfway up).
                assert!(
                    highest > BYTES / 2 || layout != Layout::Unified,
                    "{label}: the verify's rows are near the top ({highest} of {BYTES})"
                );
                c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, 2))])
                    .unwrap();
                c.release(req).unwrap();
                c.step_boundary().unwrap();
            }
        }
    }
}

/// The verify metadata has one shape for every batch up to its maximum (what a CUDA
/// graph captured once replays): the same two tables, the same layout, and every
/// request past the batch and every position past a request's draft names the sink.
#[test]
fn verify_metadata_is_fixed_shape_and_pads_to_the_sink() {
    use std::sync::Arc;
    use unikv::VerifyMetadata;
    use unikv::kernels::{CpuDevice, HostSync, Readback};
    for model in models() {
        for layout in LAYOUTS {
            let cpu = Arc::new(CpuDevice::new());
            let mut c = HybridCache::builder()
                .model(model.with_draft_layers(1))
                .page_size(16)
                .memory_bytes(8 << 20)
                .layout(layout)
                .speculation(Speculation::chain(K as u32))
                .device(cpu.clone())
                .build()
                .unwrap();
            let label = format!("{} {}", model.name, layout.as_str());
            let mut reqs: Vec<Request> = (0..3).map(|_| prefill(&mut c, 20)).collect();
            let mut meta = VerifyMetadata::new(4);
            let mut shapes = Vec::new();
            for (batch, k) in [(3, K), (1, 1)] {
                let mut b: Vec<&mut Request> = reqs.iter_mut().take(batch).collect();
                c.alloc_verify(&mut b, &vec![Draft::Chain { k }; batch])
                    .unwrap();
                let b: Vec<&Request> = reqs.iter().take(batch).collect();
                c.build_verify_metadata(&mut meta, &b).unwrap();
                c.translate_verify(&mut meta, None).unwrap();
                shapes.push((meta.tables(), meta.layout()));
                let l = meta.layout();
                let (_, outputs) = meta.tables().unwrap();
                let sync = HostSync::acquire("test: reading the verify metadata back");
                let out = cpu.read_table(&sync, outputs, 0, l.outputs_len).unwrap();
                for r in 0..l.max_batch {
                    for j in 0..l.width {
                        let id = out[l.write_full + r * l.width + j];
                        let live = r < batch && j <= k;
                        assert_eq!(
                            id > 0,
                            live,
                            "{label}: batch {batch} request {r} position {j}"
                        );
                    }
                }
                let mut b: Vec<&mut Request> = reqs.iter_mut().take(batch).collect();
                let accepted = tokens(500, 1);
                c.settle(&mut b, &vec![Accepted::chain(&accepted); batch])
                    .unwrap();
                c.step_boundary().unwrap();
            }
            assert_eq!(shapes[0], shapes[1], "{label}: one shape for both batches");
            for req in reqs {
                c.release(req).unwrap();
            }
            drop(c);
            assert_eq!(
                cpu.live_allocations(),
                0,
                "{label}: the verify tables freed too"
            );
        }
    }
}

/// A verify allocated before the earlier one settled (counts a step late) starts where
/// the earlier one's accepted rows end, a device value; its positions past its own
/// draft are the sink even when the earlier verify reserved rows there (it accepted
/// fewer than its width), so a padded kernel write lands nowhere.
#[test]
fn a_late_verify_pads_past_its_draft_to_the_sink() {
    use std::sync::Arc;
    use unikv::kernels::{CpuDevice, Device, HostSync, Readback};
    use unikv::{DeviceValues, VerifyMetadata, VerifyOffsets};
    for model in models() {
        for layout in LAYOUTS {
            let cpu = Arc::new(CpuDevice::new());
            let mut c = HybridCache::builder()
                .model(model)
                .page_size(16)
                .memory_bytes(8 << 20)
                .layout(layout)
                .speculation(Speculation::chain(K as u32).in_flight(2))
                .device(cpu.clone())
                .build()
                .unwrap();
            let label = format!("{} {}", model.name, layout.as_str());
            let mut req = prefill(&mut c, 20);
            let mut meta = VerifyMetadata::new(2);
            c.reserve_verify_metadata(&meta).unwrap();
            // Two verifies in flight: K drafts, then none.
            c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                .unwrap();
            c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: 0 }])
                .unwrap();
            c.build_verify_metadata(&mut meta, &[&req]).unwrap();
            // The earlier verify accepted 1 of its 1 + K positions.
            let values = cpu.alloc_table(4, 0).unwrap();
            cpu.upload_table(values, 0, &[1, 0, 1, 0]).unwrap();
            let at = |at| DeviceValues { table: values, at };
            c.translate_verify(
                &mut meta,
                Some(VerifyOffsets {
                    accepted: at(0),
                    last_node: at(2),
                }),
            )
            .unwrap();
            let l = meta.layout();
            let (_, outputs) = meta.tables().unwrap();
            let sync = HostSync::acquire("test: reading the verify metadata back");
            let out = cpu.read_table(&sync, outputs, 0, l.outputs_len).unwrap();
            let alloc = c.allocator();
            let settled = req.settled_len();
            assert_eq!(
                out[l.write_full],
                alloc.kernel_id(Side::Full, req.row()[settled + 1]),
                "{label}: the one position follows the accepted row"
            );
            for j in 1..l.width {
                assert!(
                    settled + 1 + j < req.row().len(),
                    "{label}: the earlier verify reserved rows here"
                );
                assert_eq!(out[l.write_full + j], 0, "{label}: FULL position {j}");
                if model.swa_layers > 0 {
                    assert_eq!(out[l.write_swa + j], 0, "{label}: SWA position {j}");
                }
                if l.slots_per_request > 0 {
                    assert_eq!(out[l.state_out + j], 0, "{label}: state after {j}");
                }
            }
            let one = tokens(900, 1);
            c.settle(&mut [&mut req], &[Accepted::chain(&one)]).unwrap();
            c.settle(&mut [&mut req], &[Accepted::chain(&one)]).unwrap();
            c.release(req).unwrap();
            c.step_boundary().unwrap();
        }
    }
}

/// Admission prices a request's whole slot group: with trees of 5 nodes a recurrent
/// request takes 5 slots, and `can_admit` refuses one only when its group does not fit
/// where a request without speculation would still be admitted (the KV has room to
/// spare).
#[test]
fn admission_prices_the_whole_slot_group() {
    /// Admits 2-token prompts until `can_admit` refuses: (admitted, slots free then).
    fn fill(layout: Layout, speculation: Option<Speculation>) -> (usize, usize) {
        let slot = TINY_MAMBA.slot_pool().unwrap().bytes_per_slot;
        let mut b = HybridCache::builder()
            .model(TINY_MAMBA.with_draft_layers(1))
            .page_size(1)
            .memory_bytes(64 * slot + (1 << 20))
            .layout(layout);
        if let Some(s) = speculation {
            b = b.speculation(s);
        }
        let mut c = b.build().unwrap();
        let width = speculation.map_or(1, |s| s.max_width as usize);
        let mut admitted = Vec::new();
        loop {
            let hit = c.match_prefix(tokens(1000 * admitted.len() as u32, 2));
            if !c.can_admit(&hit, 0) {
                break;
            }
            let req = c.admit(hit).unwrap();
            assert_eq!(req.state_slots().len(), width, "{}", layout.as_str());
            admitted.push(req);
        }
        let s = c.stats();
        assert!(
            s.full.available_pages > 100,
            "{}: KV ran out",
            layout.as_str()
        );
        assert_eq!(
            s.mamba.held_pages,
            width * admitted.len(),
            "{}",
            layout.as_str()
        );
        for req in admitted.drain(..).rev() {
            c.release(req).unwrap();
        }
        (s.mamba.held_pages / width, s.mamba.available_pages)
    }
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            let label = layout.as_str();
            let (plain, plain_free) = fill(layout, None);
            let (spec, spec_free) = fill(layout, Some(Speculation::tree(5)));
            assert!(
                spec > 0 && spec < plain,
                "{label}: {spec} vs {plain} admitted"
            );
            assert!(
                spec_free < plain_free + 5,
                "{label}: refused with {spec_free} slots free ({plain_free} without speculation)"
            );
        }
    });
}

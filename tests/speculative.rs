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
                    common::clear_and_assert_all_free(&mut c, &label);
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
        let running = req.state_slot();
        c.settle(
            &mut [&mut req],
            &[Accepted::tree(&[0, 2, 4], &tokens(900, 3))],
        )
        .unwrap();
        c.step_boundary().unwrap();
        // Accepted nodes become rows 21, 22, 23 (the device moves their KV there).
        assert_eq!(req.row(), &row[..24], "{label}");
        assert_eq!(&req.tokens()[21..], &tokens(900, 3)[..], "{label}");
        // Node 4's state was copied into the request's own running slot.
        assert_eq!(req.state_slot(), running, "{label}");
        assert_eq!(req.state_group(), &[], "{label}: the group went back");
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
            (0, 0, s.verify_scratch_slots),
            "{label}: only the cache's verify scratch is held"
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
            (0, 0, s.verify_scratch_slots),
            "{label}: only the cache's verify scratch is held"
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

/// A recurrent cache on the CPU device with `spec`, a checkpoint grid of 16 tokens at
/// page size `ps`, and the device, so a test can play the verify kernel (write each
/// position's state into the scratch group) and read states back.
fn state_cache(
    model: ModelSpec,
    layout: Layout,
    ps: u32,
    spec: Speculation,
) -> (HybridCache, std::sync::Arc<unikv::kernels::CpuDevice>) {
    let cpu = std::sync::Arc::new(unikv::kernels::CpuDevice::new());
    let c = HybridCache::builder()
        .model(model)
        .page_size(ps)
        .memory_bytes(8 << 20)
        .layout(layout)
        .checkpoint_interval(16 * ps)
        .speculation(spec)
        .device(cpu.clone())
        .build()
        .unwrap();
    (c, cpu)
}

/// The bytes of state slot `slot`.
fn slot_span(c: &HybridCache, slot: unikv::pools::VirtualSlot) -> unikv::kernels::ByteSpan {
    let alloc = c.allocator();
    let grid = alloc.grid(Side::Mamba);
    let p = alloc.physical_slot(slot).expect("a bound slot");
    unikv::kernels::ByteSpan {
        offset: grid.offset(p),
        len: grid.envelope,
    }
}

/// Writes `value` into every byte of `slot` (what a kernel writing a state does).
fn write_state(
    c: &HybridCache,
    cpu: &unikv::kernels::CpuDevice,
    slot: unikv::pools::VirtualSlot,
    value: u8,
) {
    use unikv::kernels::Device;
    cpu.fill_spans(c.allocator().buffer(), &[slot_span(c, slot)], value)
        .unwrap();
}

/// The value every byte of `slot` holds (panics when they differ).
fn read_state(
    c: &HybridCache,
    cpu: &unikv::kernels::CpuDevice,
    slot: unikv::pools::VirtualSlot,
) -> u8 {
    use unikv::kernels::{HostSync, Readback};
    let span = slot_span(c, slot);
    let sync = HostSync::acquire("test: reading a state back");
    let bytes = cpu
        .read_bytes(&sync, c.allocator().buffer(), span.offset, span.len)
        .unwrap();
    assert!(bytes.iter().all(|&b| b == bytes[0]), "a torn state");
    bytes[0]
}

/// The state after `len` tokens, as the tests' kernel writes it.
fn state_at(len: usize) -> u8 {
    (len % 251) as u8 + 1
}

/// Plays the verify kernel for `req`'s newest verify, chain positions only: the state
/// after position `i` (row `from + i`) goes into its scratch group's slot `i`.
fn verify_forward(c: &HybridCache, cpu: &unikv::kernels::CpuDevice, req: &Request, from: usize) {
    for (i, &slot) in req.state_group().iter().enumerate() {
        write_state(c, cpu, slot, state_at(from + i + 1));
    }
}

#[test]
fn a_verify_writes_a_scratch_group_and_settling_copies_the_accepted_state_into_the_running_slot() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                let (mut c, cpu) = state_cache(model, layout, 1, Speculation::chain(K as u32));
                let label = format!("{} {}", model.name, layout.as_str());
                let mut req = prefill(&mut c, 10);
                let running = req.state_slot().unwrap();
                write_state(&c, &cpu, running, state_at(10));
                assert_eq!(req.state_group(), &[], "{label}: no verify, no group");
                assert_eq!(req.state_slots().len(), 1 + req.checkpoint_writes().len());
                c.step_boundary().unwrap();
                let mut groups = Vec::new();
                for a in [3, 1, 5] {
                    let from = req.settled_len();
                    c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                        .unwrap();
                    let group = req.state_group().to_vec();
                    assert_eq!(group.len(), 1 + K, "{label}");
                    assert!(!group.contains(&running), "{label}: the group is scratch");
                    assert_eq!(c.stats().verify_scratch_slots, 1 + K, "{label}");
                    verify_forward(&c, &cpu, &req, from);
                    c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, a))])
                        .unwrap();
                    assert_eq!(req.state_slot(), Some(running), "{label}: one running slot");
                    assert_eq!(
                        read_state(&c, &cpu, running),
                        state_at(from + a),
                        "{label}: accepted {a}: the accepted position's state was copied in"
                    );
                    assert_eq!(req.state_group(), &[], "{label}");
                    groups.push(group);
                    c.step_boundary().unwrap();
                }
                assert!(
                    groups.windows(2).all(|g| g[0] == g[1]),
                    "{label}: one scratch group, reused every step: {groups:?}"
                );
                let s = c.stats();
                assert_eq!(
                    s.mamba.held_pages,
                    req.state_slots().len() + 1 + K,
                    "{label}: the request's own slots and the kept scratch group"
                );
                c.release(req).unwrap();
                common::clear_and_assert_all_free(&mut c, &label);
            }
        }
    });
}

/// Settlement saves the checkpoints the accepted positions cross from the accepted
/// states, whether the counts came in the step or a step late (a later verify writes a
/// scratch group of its own, so the earlier one's states are still there); the follow-up
/// resumes from the grid point's state, which holds exactly the state after 16 tokens.
#[test]
fn a_settled_verify_crossing_a_grid_point_saves_its_state_there_on_time_and_late() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                for late in [false, true] {
                    let spec = Speculation::chain(K as u32).in_flight(2);
                    let (mut c, cpu) = state_cache(model, layout, 1, spec);
                    let label = format!("{} {} late {late}", model.name, layout.as_str());
                    // 14 prompt tokens, then 5 accepted cross the grid point at 16.
                    let mut req = prefill(&mut c, 14);
                    write_state(&c, &cpu, req.state_slot().unwrap(), state_at(14));
                    c.cache_unfinished(&mut req).unwrap();
                    c.step_boundary().unwrap();
                    c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                        .unwrap();
                    verify_forward(&c, &cpu, &req, 14);
                    if late {
                        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                            .unwrap();
                        // The later verify starts from the earlier one's last position.
                        verify_forward(&c, &cpu, &req, 14 + 1 + K);
                    }
                    c.settle(&mut [&mut req], &[Accepted::chain(&tokens(900, 1 + K))])
                        .unwrap();
                    let checkpoints = &req.state_slots()[1..];
                    assert_eq!(checkpoints.len(), 1, "{label}: the grid point's state");
                    assert_eq!(
                        read_state(&c, &cpu, checkpoints[0]),
                        state_at(16),
                        "{label}: the checkpoint holds the state after 16 tokens"
                    );
                    if late {
                        c.settle(&mut [&mut req], &[Accepted::chain(&tokens(910, 1))])
                            .unwrap();
                    }
                    let conversation = req.tokens().to_vec();
                    c.cache_finished(req).unwrap();
                    c.step_boundary().unwrap();
                    let hit = c.match_prefix(conversation.clone());
                    // The running state at the conversation's end is cached too, so the
                    // match ends one token short of it (the last token is recomputed).
                    assert_eq!(hit.cached_tokens(), 16, "{label}");
                    let again = c.match_prefix(conversation[..17].to_vec());
                    assert_eq!(again.cached_tokens(), 16, "{label}");
                    let req = c.admit(again).unwrap();
                    assert_eq!(
                        read_state(&c, &cpu, req.state_slot().unwrap()),
                        state_at(16),
                        "{label}: the resumed state is the state after 16 tokens"
                    );
                    c.release(req).unwrap();
                    common::clear_and_assert_all_free(&mut c, &label);
                }
            }
        }
    });
}

/// Every speculative path — verify steps (chain and tree, late and timely), their
/// metadata (built, translated from device-side offsets, a tree's compaction), settlement
/// (all rejected, partial, all accepted, a tree path), checkpoints copied out of the
/// slot group, an abort and a finish mid-verify — issues no host sync and no
/// data-dependent shape, on the CPU backend, on the CUDA backend over its emulated
/// driver (whose ops must not block either) and, where there is one (`cargo xtask gpu`,
/// which requires it), on GPU 0.
#[test]
fn every_speculative_path_issues_no_host_sync() {
    use std::sync::Arc;
    use unikv::kernels::{CpuDevice, CudaDevice, Device, Readback, SyncLedger};
    use unikv::{DeviceValues, VerifyMetadata, VerifyOffsets};
    let mut devices: Vec<Box<dyn Fn() -> Arc<dyn Readback>>> = vec![
        Box::new(|| Arc::new(CpuDevice::new())),
        Box::new(|| Arc::new(CudaDevice::emulated())),
    ];
    match CudaDevice::new(0) {
        Ok(gpu) => {
            let gpu: Arc<dyn Readback> = Arc::new(gpu);
            devices.push(Box::new(move || gpu.clone()));
        }
        Err(e) => assert!(
            std::env::var("UNIKV_REQUIRE_GPU").map_or(true, |v| v != "1"),
            "UNIKV_REQUIRE_GPU=1 but: {e}"
        ),
    }
    for device in &devices {
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

/// Admission prices what a verifying request transiently holds: the rows of every
/// position its unsettled verifies reserve, and the scratch group each writes where the
/// cache has made none to spare. So the longest prompt `can_admit` takes into an empty
/// cache prefills *and* verifies a full-width draft, settled in the step or a step late
/// (without the pricing, the verify ran out of memory).
#[test]
fn admission_prices_the_verify_rows_and_scratch_of_a_running_request() {
    scoped_level(Level::Strict, || {
        for model in models() {
            for layout in LAYOUTS {
                for ps in [1u32, 16] {
                    for spec in [
                        Speculation::chain(K as u32),
                        Speculation::tree(7).in_flight(2),
                    ] {
                        let mut c = cache(model, layout, ps, spec);
                        let label = format!(
                            "{} {} ps {ps} width {} in flight {}",
                            model.name,
                            layout.as_str(),
                            spec.max_width,
                            spec.max_in_flight
                        );
                        let total = c.stats().full.total_pages * ps as usize;
                        // The longest prompt admission takes (it admits less as prompts grow).
                        let (mut lo, mut hi) = (1usize, total + 1);
                        while hi - lo > 1 {
                            let mid = (lo + hi) / 2;
                            let hit = c.match_prefix(tokens(0, mid));
                            if c.can_admit(&hit, 0) {
                                lo = mid;
                            } else {
                                hi = mid;
                            }
                        }
                        let mut req = prefill(&mut c, lo);
                        c.step_boundary().unwrap();
                        let width = spec.max_width as usize;
                        let parents: Vec<i32> = (0..width as i32).map(|i| i - 1).collect();
                        let draft = Draft::Tree { parents: &parents };
                        for _ in 0..spec.max_in_flight {
                            c.alloc_verify(&mut [&mut req], &[draft])
                                .unwrap_or_else(|e| panic!("{label}: prompt {lo}: {e}"));
                        }
                        let path: Vec<u32> = (0..width as u32).collect();
                        for _ in 0..spec.max_in_flight {
                            c.settle(
                                &mut [&mut req],
                                &[Accepted::tree(&path, &tokens(900, width))],
                            )
                            .unwrap();
                        }
                        c.release(req).unwrap();
                        common::clear_and_assert_all_free(&mut c, &label);
                    }
                }
            }
        }
    });
}

/// Plays one speculative turn of `req` to `steps` verify steps of a chain of `K`, each
/// accepting `accepted` positions, settled in the step or (`late`) in the next one, the
/// last verify of a late turn still in flight at the end (an overlap scheduler's
/// request finishes with its next verify launched). Every verify's kernel writes its
/// positions' states; returns the settled length.
fn speculative_turn(
    c: &mut HybridCache,
    cpu: &unikv::kernels::CpuDevice,
    req: &mut Request,
    steps: usize,
    accepted: usize,
    late: bool,
) -> usize {
    // Where the newest verify starts: past every earlier verify's accepted positions.
    let mut device_len = req.settled_len();
    for step in 0..steps {
        c.alloc_verify(&mut [&mut *req], &[Draft::Chain { k: K }])
            .unwrap();
        verify_forward(c, cpu, req, device_len);
        device_len += accepted;
        if !late || req.unsettled_verifies() == 2 {
            let t = tokens(1000 + 10 * step as u32, accepted);
            c.settle(&mut [&mut *req], &[Accepted::chain(&t)]).unwrap();
        }
        c.step_boundary().unwrap();
    }
    req.settled_len()
}

/// A follow-up turn after a speculative turn resumes from the state at the end of the
/// previous output (the conversation's last token is recomputed, as always): the running
/// slot holds the accepted state after every settlement, on time or a step late, and
/// finishing caches it even with a verify still in flight.
#[test]
fn a_follow_up_turn_after_a_speculative_turn_resumes_from_the_end_of_its_output() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                for ps in [1u32, 16] {
                    for late in [false, true] {
                        let spec = Speculation::chain(K as u32).in_flight(2);
                        let (mut c, cpu) = state_cache(model, layout, ps, spec);
                        let label =
                            format!("{} {} ps {ps} late {late}", model.name, layout.as_str());
                        // 3 steps accepting 1 + K each end the output on a page boundary.
                        let prompt = 3 * 16.max(ps as usize) - 3 * (1 + K);
                        let mut req = prefill(&mut c, prompt);
                        write_state(&c, &cpu, req.state_slot().unwrap(), state_at(prompt));
                        c.cache_unfinished(&mut req).unwrap();
                        c.step_boundary().unwrap();
                        let steps = if late { 4 } else { 3 };
                        let end = speculative_turn(&mut c, &cpu, &mut req, steps, 1 + K, late);
                        assert_eq!(end, prompt + 3 * (1 + K), "{label}");
                        assert!(end.is_multiple_of(ps as usize), "{label}");
                        assert_eq!(req.unsettled_verifies(), usize::from(late), "{label}");
                        let mut next = req.tokens().to_vec();
                        c.cache_finished(req).unwrap();
                        c.step_boundary().unwrap();
                        next.extend(tokens(5000, 7));
                        let hit = c.match_prefix(next);
                        assert_eq!(
                            hit.cached_tokens(),
                            end,
                            "{label}: the follow-up resumes at the end of the output"
                        );
                        let req = c.admit(hit).unwrap();
                        assert_eq!(
                            read_state(&c, &cpu, req.state_slot().unwrap()),
                            state_at(end),
                            "{label}: from the state after the whole output"
                        );
                        c.release(req).unwrap();
                        common::clear_and_assert_all_free(&mut c, &label);
                    }
                }
            }
        }
    });
}

/// A request finishing with a verify in flight (its counts not settled) caches its
/// running state — the state at its settled length, which no verify writes — and gives
/// the verify's scratch group back to the cache.
#[test]
fn a_finish_with_a_verify_in_flight_caches_the_running_state() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                for in_flight in [1, 2] {
                    let spec = Speculation::chain(K as u32).in_flight(in_flight);
                    let (mut c, cpu) = state_cache(model, layout, 1, spec);
                    let label = format!("{} {} in flight {in_flight}", model.name, layout.as_str());
                    let mut req = prefill(&mut c, 21);
                    write_state(&c, &cpu, req.state_slot().unwrap(), state_at(21));
                    c.step_boundary().unwrap();
                    // Settled: 21 + 2 tokens; then a verify the request finishes with.
                    speculative_turn(&mut c, &cpu, &mut req, 1, 2, false);
                    for _ in 0..in_flight {
                        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
                            .unwrap();
                        verify_forward(&c, &cpu, &req, 23);
                    }
                    assert_eq!(req.unsettled_verifies(), in_flight as usize, "{label}");
                    let conversation = req.tokens().to_vec();
                    assert_eq!(conversation.len(), 23, "{label}");
                    c.cache_finished(req).unwrap();
                    c.step_boundary().unwrap();
                    let s = c.stats();
                    assert_eq!(s.mamba.held_pages, s.verify_scratch_slots, "{label}");
                    let mut next = conversation;
                    next.push(TokenId(7));
                    let hit = c.match_prefix(next);
                    assert_eq!(
                        hit.cached_tokens(),
                        23,
                        "{label}: the running state is cached"
                    );
                    let req = c.admit(hit).unwrap();
                    assert_eq!(
                        read_state(&c, &cpu, req.state_slot().unwrap()),
                        state_at(23),
                        "{label}"
                    );
                    c.release(req).unwrap();
                    common::clear_and_assert_all_free(&mut c, &label);
                }
            }
        }
    });
}

/// A speculation setting out of range is refused when the cache is built, each with its
/// reason.
#[test]
fn a_bad_speculation_setting_is_refused_at_build() {
    let ok = Speculation::chain(K as u32);
    for (bad, reason) in [
        (Speculation { max_width: 0, ..ok }, "verify width of 0"),
        (
            Speculation {
                max_width: unikv::MAX_VERIFY_WIDTH + 1,
                ..ok
            },
            "verify width of 65",
        ),
        (
            Speculation {
                max_in_flight: 0,
                ..ok
            },
            "0 verify steps in flight",
        ),
        (
            Speculation {
                max_in_flight: unikv::MAX_IN_FLIGHT + 1,
                ..ok
            },
            "3 verify steps in flight",
        ),
        (Speculation { max_batch: 0, ..ok }, "verify batch of 0"),
        (
            ok.batch(unikv::MAX_VERIFY_BATCH + 1),
            "verify batch of 4097",
        ),
    ] {
        let e = HybridCache::builder()
            .model(TINY_MAMBA)
            .memory_bytes(8 << 20)
            .speculation(bad)
            .build()
            .unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains(reason)),
            "{bad:?}: {e}"
        );
    }
    for good in [
        ok,
        ok.in_flight(2).batch(1),
        Speculation::tree(unikv::MAX_VERIFY_WIDTH),
    ] {
        HybridCache::builder()
            .model(TINY_MAMBA)
            .memory_bytes(64 << 20)
            .speculation(good)
            .build()
            .unwrap_or_else(|e| panic!("{good:?}: {e}"));
    }
}

/// A verify never reads a state slot it writes: for every late-settlement configuration
/// (each count the earlier verify may have accepted, a request with one verify in flight
/// beside one with two, chains and trees) the input state each request's verify reads is
/// none of the slots any verify of the batch writes. So a kernel may write its outputs
/// before it reads its input.
#[test]
fn a_verify_never_reads_a_state_slot_it_writes() {
    use std::collections::HashSet;
    use unikv::kernels::{CpuDevice, Device, HostSync, Readback};
    use unikv::{DeviceValues, VerifyMetadata, VerifyOffsets};
    for model in [TINY_MAMBA, TINY_TRI] {
        for layout in LAYOUTS {
            for in_flight in [1u32, 2] {
                let cpu = std::sync::Arc::new(CpuDevice::new());
                let mut c = HybridCache::builder()
                    .model(model)
                    .page_size(16)
                    .memory_bytes(8 << 20)
                    .layout(layout)
                    .speculation(Speculation::chain(K as u32).in_flight(in_flight))
                    .device(cpu.clone())
                    .build()
                    .unwrap();
                let label = format!("{} {} in flight {in_flight}", model.name, layout.as_str());
                let mut a = prefill(&mut c, 20);
                let mut b = prefill(&mut c, 30);
                let mut meta = VerifyMetadata::new(2);
                c.reserve_verify_metadata(&meta).unwrap();
                let values = cpu.alloc_table(4, 0).unwrap();
                let at = |at| DeviceValues { table: values, at };
                for step in 0..2 * (1 + K) {
                    // `a` keeps `in_flight` verifies unsettled; `b` settles at once.
                    c.alloc_verify(&mut [&mut a, &mut b], &[Draft::Chain { k: K }; 2])
                        .unwrap();
                    c.build_verify_metadata(&mut meta, &[&a, &b]).unwrap();
                    let earlier = (a.unsettled_verifies() > 1) as i32;
                    // Every count the earlier verify may have accepted, in turn.
                    let count = earlier * (1 + (step % (1 + K)) as i32);
                    cpu.upload_table(values, 0, &[count, 0, count, 0]).unwrap();
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
                    let written: HashSet<i32> = out[l.state_out..l.state_out + 2 * l.width]
                        .iter()
                        .copied()
                        .filter(|&p| p > 0)
                        .collect();
                    assert_eq!(
                        written.len(),
                        2 * (1 + K),
                        "{label}: two groups of their own"
                    );
                    for r in 0..2 {
                        let input = out[l.state_in + r];
                        assert!(input > 0, "{label}: step {step} request {r} reads the sink");
                        assert!(
                            !written.contains(&input),
                            "{label}: step {step}: request {r} reads slot {input}, which the verify writes"
                        );
                    }
                    if a.unsettled_verifies() == in_flight as usize {
                        let t = tokens(900, count.max(1) as usize);
                        c.settle(&mut [&mut a], &[Accepted::chain(&t)]).unwrap();
                    }
                    c.settle(&mut [&mut b], &[Accepted::chain(&tokens(900, 2))])
                        .unwrap();
                    c.step_boundary().unwrap();
                }
                c.release(a).unwrap();
                c.release(b).unwrap();
                c.step_boundary().unwrap();
            }
        }
    }
}

/// At the step boundary the cache keeps `max_batch × max_in_flight` scratch groups idle
/// for the next verifies and frees the rest (groups made past the declared batch are
/// transient): 4 requests with 2 verifies each in flight hold 8 groups; once they
/// settle, a batch of 3 keeps 6.
#[test]
fn the_step_boundary_keeps_the_declared_scratch_groups_and_frees_the_rest() {
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            let spec = Speculation::chain(K as u32).in_flight(2).batch(3);
            let (mut c, _) = state_cache(TINY_MAMBA, layout, 1, spec);
            let label = format!("{} {}", TINY_MAMBA.name, layout.as_str());
            let mut reqs: Vec<Request> = (0..4).map(|_| prefill(&mut c, 10)).collect();
            c.step_boundary().unwrap();
            for _ in 0..2 {
                let mut batch: Vec<&mut Request> = reqs.iter_mut().collect();
                c.alloc_verify(&mut batch, &[Draft::Chain { k: K }; 4])
                    .unwrap();
                c.step_boundary().unwrap();
            }
            let group = 1 + K;
            assert_eq!(c.stats().verify_scratch_slots, 8 * group, "{label}: held");
            let accepted = tokens(900, 1);
            for _ in 0..2 {
                let mut batch: Vec<&mut Request> = reqs.iter_mut().collect();
                c.settle(&mut batch, &[Accepted::chain(&accepted); 4])
                    .unwrap();
            }
            assert_eq!(
                c.stats().verify_scratch_slots,
                8 * group,
                "{label}: given back"
            );
            c.step_boundary().unwrap();
            assert_eq!(
                c.stats().verify_scratch_slots,
                3 * 2 * group,
                "{label}: the batch's groups kept, the rest freed"
            );
            // The kept groups serve the next verifies: no fresh slot, none of a freed one.
            for _ in 0..2 {
                let mut batch: Vec<&mut Request> = reqs.iter_mut().take(3).collect();
                c.alloc_verify(&mut batch, &[Draft::Chain { k: K }; 3])
                    .unwrap();
            }
            assert_eq!(
                c.stats().verify_scratch_slots,
                3 * 2 * group,
                "{label}: the kept groups reused"
            );
            for _ in 0..2 {
                let mut batch: Vec<&mut Request> = reqs.iter_mut().take(3).collect();
                c.settle(&mut batch, &[Accepted::chain(&accepted); 3])
                    .unwrap();
            }
            for req in reqs {
                c.release(req).unwrap();
            }
            common::clear_and_assert_all_free(&mut c, &label);
        }
    });
}

/// A verify refused at any of its fallible allocator calls (its fresh scratch slots, its
/// rows) changes nothing: the scratch it took goes back, the request keeps its rows, and
/// once everything is released every page and slot is free.
#[test]
fn a_verify_refused_at_any_allocator_call_gives_its_fresh_scratch_back() {
    use common::probe::{Probe, ProbeState};
    use std::sync::{Arc, Mutex};
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            let mut refused = 0;
            for n in 0.. {
                let label = format!("{} {} call {n}", TINY_MAMBA.name, layout.as_str());
                let state = Arc::new(Mutex::new(ProbeState::default()));
                let wrapped = state.clone();
                let mut c = HybridCache::builder()
                    .model(TINY_MAMBA)
                    .memory_bytes(8 << 20)
                    .layout(layout)
                    .checkpoint_interval(16)
                    .speculation(Speculation::chain(K as u32))
                    .wrap_allocator(move |inner| Box::new(Probe::new(inner, wrapped)))
                    .build()
                    .unwrap();
                let mut req = prefill(&mut c, 10);
                c.step_boundary().unwrap();
                let (rows, slots) = (req.len(), req.state_slots());
                {
                    let mut s = state.lock().unwrap();
                    s.fail_call = Some(s.fallible_calls + n);
                }
                let result = c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }]);
                let injected = {
                    let mut s = state.lock().unwrap();
                    s.fail_call = None; // past the verify: nothing else fails
                    s.injected
                };
                if injected == 0 {
                    result.unwrap_or_else(|e| panic!("{label}: {e}"));
                    c.release(req).unwrap();
                    common::clear_and_assert_all_free(&mut c, &label);
                    break;
                }
                assert!(result.is_err(), "{label}: the injected fault is its error");
                refused += 1;
                assert_eq!((req.len(), req.state_slots()), (rows, slots), "{label}");
                assert_eq!(
                    c.stats().verify_scratch_slots,
                    0,
                    "{label}: no scratch kept"
                );
                c.step_boundary().unwrap();
                c.release(req).unwrap();
                common::clear_and_assert_all_free(&mut c, &label);
            }
            assert!(
                refused >= 2,
                "{}: the slots and the rows refused",
                layout.as_str()
            );
        }
    });
}

/// A verify's fresh scratch slots are priced with its rows in one eviction loop: on the
/// static layout, whose slot pool is full of cached states while its KV has room, the
/// verify evicts cached states to make its scratch instead of failing short of slots.
#[test]
fn a_verify_evicts_cached_states_to_make_its_scratch() {
    // States of 4 KiB, so a 1 MiB budget's slot pool fills before its KV.
    const BIG_STATE: ModelSpec = ModelSpec {
        recurrent: unikv::RecurrentState {
            state_size: 256,
            ..TINY_MAMBA.recurrent
        },
        ..TINY_MAMBA
    };
    scoped_level(Level::Strict, || {
        let layout = LAYOUTS[1];
        assert!(matches!(layout, Layout::Static { .. }));
        let label = format!("{} {}", BIG_STATE.name, layout.as_str());
        let mut c = HybridCache::builder()
            .model(BIG_STATE)
            .memory_bytes(1 << 20)
            .layout(layout)
            .checkpoint_interval(16)
            .speculation(Speculation::chain(K as u32))
            .build()
            .unwrap();
        let mut req = prefill(&mut c, 10);
        c.step_boundary().unwrap();
        let mut cached = 0u32;
        while c.stats().mamba.available_pages > K {
            let hit = c.match_prefix(tokens(1_000_000 * (cached + 1), 40));
            let mut r = c.admit(hit).unwrap();
            c.alloc_extend(&mut r, 40).unwrap();
            c.cache_finished(r).unwrap();
            c.step_boundary().unwrap();
            cached += 1;
            assert!(cached < 10_000, "{label}: the slot pool never filled");
        }
        assert!(
            c.stats().full.available_pages > 2 * (1 + K),
            "{label}: KV has room"
        );
        let evicted = c.stats().evictions;
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_ne!(
            c.stats().evictions,
            evicted,
            "{label}: cached states evicted"
        );
        c.step_boundary().unwrap();
        c.release(req).unwrap();
        common::clear_and_assert_all_free(&mut c, &label);
    });
}

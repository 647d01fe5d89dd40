//! Scenarios 23–29 of the reference list (sglang-unified-memory.md §7) and the issue's
//! extra cases, at every page size of `unikv_invariants::testing::page_sizes()`.
//! Every action is applied to the page-ownership ledger of `common`, which fails on a page
//! freed twice or on the wrong side; each scenario ends by draining the tree and checking
//! that no page or slot leaked.

mod common;

use common::{Sim, tokens};
use unikv_invariants::testing::page_sizes;
use unikv_radix::{
    Action, Component, InsertRequest, MambaSlot, RadixError, RadixTree, StateCheckpoint, StateRole,
    SwaSide, TokenId, Tokens, TreeConfig, VirtualToken,
};

/// Page symbols `0, 1, .., n-1`: a key of `n` distinct pages.
fn pages(n: u32) -> Vec<u32> {
    (0..n).collect()
}

fn slice(row: &[VirtualToken], lo: usize, hi: usize) -> Vec<VirtualToken> {
    row[lo..hi].to_vec()
}

/// A written state of `role` in `slot` after `pages` pages of `p` tokens.
fn written_state(p: usize, pages: usize, slot: u32, role: StateRole) -> StateCheckpoint {
    StateCheckpoint {
        at: Tokens(pages * p),
        slot: MambaSlot(slot),
        in_flight: false,
        role,
    }
}

/// Inserts a prompt of `len` pages of `p` tokens whose first page is `first` (the others
/// `10, 11, ..`, shared by every such prompt), its values counting from `base`, with
/// `states`. Returns its key.
fn insert_prompt(
    tree: &mut RadixTree,
    p: usize,
    (first, len): (u32, u32),
    base: u32,
    states: &[StateCheckpoint],
) -> Vec<TokenId> {
    let symbols: Vec<u32> = std::iter::once(first).chain(10..9 + len).collect();
    let key = tokens(&symbols, p);
    let row: Vec<VirtualToken> = (base..base + len * p as u32).map(VirtualToken).collect();
    tree.insert(InsertRequest::new(&key, &row).checkpoints(states))
        .unwrap();
    key
}

/// Scenario 24: a duplicate insert is split at the request's cursor: FULL-only below it,
/// two-sided above it, one action each, no page in both (at most one action when the
/// cursor is at either end).
#[test]
fn scenario_24_duplicate_insert_splits_at_the_cursor() {
    for ps in page_sizes() {
        // (cursor in pages, expect FULL-only, expect two-sided). The tree holds [0, 6) and
        // the capped leaf [6, 8) (in pages), so a cursor at 7 crosses a node boundary.
        for (cursor_pages, full_only, two_sided) in [
            (0, false, true),
            (3, true, true),
            (6, true, true),
            (7, true, true),
            (8, true, false),
        ] {
            let mut sim = Sim::new(TreeConfig::swa(ps, 2 * ps as usize));
            let key = tokens(&pages(8), ps as usize);
            let a = sim.start_fresh(key.clone());
            let b = sim.start_fresh(key);
            sim.finish(a); // b is now index 0
            let b = b - 1;
            let c = cursor_pages * ps as usize;
            sim.slide_to(b, c);
            let row = sim.reqs[b].row.clone();
            let actions = sim.finish(b);
            let mut expected = Vec::new();
            if full_only {
                expected.push(Action::FreeDeviceKvFullOnly {
                    tokens: slice(&row, 0, c),
                });
            }
            if two_sided {
                expected.push(Action::FreeDeviceKv {
                    tokens: slice(&row, c, row.len()),
                });
            }
            assert_eq!(actions, expected, "ps {ps} cursor {c}");
            sim.check();
            sim.drain();
        }
    }
}

/// Scenario 25: an unlocked tombstone adopts live incoming KV: the old FULL is freed
/// FULL-only, SWA is rebuilt from the incoming value, and live SWA drops by exactly the
/// request's two-sided release.
#[test]
fn scenario_25_unlocked_tombstone_adopts_the_incoming_value() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, 2 * p));
        let key = tokens(&pages(6), p);
        let a = sim.start_fresh(key.clone());
        let b = sim.start_fresh(key.clone()) - 1;
        let a_row = sim.reqs[a].row.clone();
        sim.finish(a); // nodes [0, 4p) and the capped leaf [4p, 6p)
        let evicted = sim.evict(Component::Swa, 1);
        let internal = sim.tree.match_prefix(&key[..4 * p]).full_hit_node;
        assert_eq!(
            evicted,
            vec![Action::TombstoneSwa {
                node: internal,
                tokens: slice(&a_row, 0, 4 * p)
            }]
        );
        sim.check();

        let b_row = sim.reqs[b].row.clone();
        let live_before = sim.ledger.live_pages();
        let actions = sim.finish(b);
        assert_eq!(
            actions,
            vec![
                Action::FreeDeviceKvFullOnly {
                    tokens: slice(&a_row, 0, 4 * p)
                },
                Action::SwaRebuild {
                    node: internal,
                    tokens: slice(&b_row, 0, 4 * p)
                },
                Action::FreeDeviceKv {
                    tokens: slice(&b_row, 4 * p, 6 * p)
                },
            ]
        );
        assert_eq!(sim.ledger.live_pages(), live_before - 2);
        assert_eq!(sim.tree.node(internal).unwrap().value, &b_row[..4 * p]);
        assert!(sim.tree.node(internal).unwrap().swa_live);
        sim.check();
        sim.drain();
    }
}

/// Scenario 26: a tombstone whose FULL is locked by another request recovers by moving SWA
/// ownership: the locked FULL value is untouched, and applying the recovery allocates and
/// frees no SWA page.
#[test]
fn scenario_26_locked_full_recovery_moves_swa_ownership() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, 2 * p));
        let key = tokens(&pages(6), p);
        let a = sim.start_fresh(key.clone());
        let b = sim.start_fresh(key.clone()) - 1;
        let a_row = sim.reqs[a].row.clone();
        sim.finish(a);
        let c = sim.start(key.clone()); // locks the whole path, SWA on the leaf only
        assert_eq!(sim.reqs[c].ppl, 6 * p);
        let evicted = sim.evict(Component::Swa, 1);
        let internal = sim.tree.match_prefix(&key[..4 * p]).full_hit_node;
        assert!(matches!(&evicted[..], [Action::TombstoneSwa { node, .. }] if *node == internal));
        assert_eq!(sim.tree.node(internal).unwrap().full_lock, 1);

        let b_row = sim.reqs[b].row.clone();
        let req = &sim.reqs[b];
        let out = sim
            .tree
            .insert(InsertRequest::new(&req.key, &req.row))
            .unwrap();
        assert_eq!(
            out.actions,
            vec![
                Action::RecoverSwaWithLockedFull {
                    node: internal,
                    kept: slice(&a_row, 0, 4 * p),
                    incoming: slice(&b_row, 0, 4 * p),
                },
                Action::FreeDeviceKv {
                    tokens: slice(&b_row, 4 * p, 6 * p)
                },
            ]
        );
        let live_before = sim.ledger.live_pages();
        sim.ledger.apply(&out.actions[0]);
        assert_eq!(
            sim.ledger.live_pages(),
            live_before,
            "no SWA page allocated or freed"
        );
        sim.ledger.apply(&out.actions[1]);
        sim.reqs.remove(b); // its row is fully handed over
        let view = sim.tree.node(internal).unwrap();
        assert_eq!(view.value, &a_row[..4 * p], "the locked FULL value is kept");
        assert!(view.swa_live);
        sim.check();
        sim.drain();
    }
}

/// Scenario 27, and "a match that ends below a tombstone needs a whole window":
/// path A (live, W/2) → B (tombstone) → C (live, W − ps) → D (live, ps), with W = 4 ps.
/// The match may end at A (from the root, no window needed) or D (a whole window of live
/// SWA behind it), never at B or C; a FULL-only longer hit is reported as branching.
#[test]
fn scenario_27_a_match_below_a_tombstone_needs_a_whole_window() {
    for ps in page_sizes() {
        let p = ps as usize;
        let w = 4 * p;
        let mut sim = Sim::new(TreeConfig::swa(ps, w));
        let key = tokens(&pages(7), p); // A = pages 0..2, B = 2, C = 3..6, D = 6
        let a = sim.start_fresh(key[..2 * p].to_vec());
        sim.finish(a);
        let r = sim.start_fresh(key.clone());
        sim.slide_to(r, 3 * p);
        sim.finish(r); // B becomes a tombstone, C+D one live leaf of W tokens
        sim.probe(&key[..6 * p]); // splits C from D
        sim.check();
        // (query length in pages, expected match in pages, expected branching in pages)
        let table = [
            (1, 1, None),
            (2, 2, None),
            (3, 2, Some(3)),
            (4, 2, Some(4)),
            (6, 2, Some(6)),
            (7, 7, None),
        ];
        for (query, matched, branching) in table {
            assert_eq!(sim.tree.full_hit_len(&key[..query * p]), Tokens(query * p));
            let m = sim.probe(&key[..query * p]);
            assert_eq!(m.len, Tokens(matched * p), "ps {ps} query {query}");
            assert_eq!(m.branching, branching.map(|b| Tokens(b * p)));
            assert_eq!(m.full_hit, Tokens(query * p));
        }
        let end = sim.probe(&key).node;
        let d = sim.tree.node(end).unwrap();
        assert_eq!((d.start, d.key.len()), (Tokens(6 * p), p));
        sim.check();
        sim.drain();
    }
}

/// Scenario 28: a fresh live leaf is capped at `ceil(W / ps) × ps`; locking it protects
/// exactly that many SWA tokens (and the whole path's FULL); releasing returns protected
/// sizes to zero.
#[test]
fn scenario_28_a_live_leaf_is_capped_at_one_page_aligned_window() {
    for ps in page_sizes() {
        let p = ps as usize;
        for w in [1, p.div_ceil(2), p, p + 1, 3 * p] {
            let mut sim = Sim::new(TreeConfig::swa(ps, w));
            let tail = w.div_ceil(p) * p;
            let len = (3 * w).div_ceil(p) * p;
            let r = sim.start_fresh(tokens(&pages((len / p) as u32), p));
            sim.finish(r);
            let leaf = sim
                .tree
                .nodes()
                .into_iter()
                .find(|v| v.children == 0)
                .unwrap();
            assert_eq!(leaf.key.len(), tail.min(len), "ps {ps} W {w}");
            let lock = sim.tree.lock(leaf.id).unwrap();
            let sizes = sim.tree.sizes();
            assert_eq!(sizes.swa_protected, Tokens(tail.min(len)));
            assert_eq!(sizes.full_protected, Tokens(len));
            assert_eq!(sizes.swa_evictable, Tokens(len - tail.min(len)));
            sim.tree.sanity_check().unwrap();
            sim.tree.unlock(lock).unwrap();
            let sizes = sim.tree.sizes();
            assert_eq!(
                (sizes.swa_protected, sizes.full_protected),
                (Tokens(0), Tokens(0))
            );
            assert_eq!(sizes.full_evictable, Tokens(len));
            sim.check();
            sim.drain();
        }
    }
}

/// What one SWA eviction step did, for scenario 29's table.
#[derive(Debug, PartialEq)]
enum Step {
    Tombstone(usize),
    RemoveLeaf(usize),
}

/// Scenario 29: SWA eviction tombstones internal nodes and evicts leaves whole, least
/// recently used first; FULL KV leaves the tree only with whole leaves (the only
/// KV-removed events).
#[test]
fn scenario_29_swa_eviction_tombstones_internal_nodes_in_lru_order() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, 2 * p));
        // P = pages [0, 1], Q1 = [2, 3], Q2 = [4, 5]: P is shared.
        let first = sim.start_fresh(tokens(&[0, 1, 2, 3], p));
        sim.finish(first);
        let second = sim.start(tokens(&[0, 1, 4, 5], p));
        sim.finish(second);
        sim.check();
        let start_of = |sim: &Sim, node| sim.tree.node(node).unwrap().start.get() / p;
        let mut steps = Vec::new();
        while let Some(actions) = sim.tree.evict_one(Component::Swa) {
            sim.ledger.apply_all(&actions);
            for a in &actions {
                match a {
                    Action::TombstoneSwa { node, .. } => {
                        steps.push((Step::Tombstone(start_of(&sim, *node)), None))
                    }
                    Action::EvictNode { tokens, swa, .. } => {
                        assert_eq!(*swa, SwaSide::Live);
                        steps.push((Step::RemoveLeaf(tokens.len() / p), None))
                    }
                    other => steps.push((Step::Tombstone(usize::MAX), Some(other.clone()))),
                }
            }
            sim.check();
        }
        // Q1 (least recently used) whole, then P (internal: tombstone), then Q2 whole.
        assert_eq!(
            steps,
            vec![
                (Step::RemoveLeaf(2), None),
                (Step::Tombstone(0), None),
                (Step::RemoveLeaf(2), None),
            ],
            "ps {ps}"
        );
        // P stays as a FULL-only leaf: FULL eviction removes it.
        let nodes = sim.tree.nodes();
        assert_eq!(nodes.len(), 2);
        assert!(!nodes[1].swa_live);
        assert_eq!(sim.tree.sizes().full_evictable, Tokens(2 * p));
        let full = sim.evict(Component::Full, 1);
        assert!(matches!(
            &full[..],
            [Action::EvictNode {
                swa: SwaSide::Tombstone,
                ..
            }]
        ));
        sim.check();
        sim.drain();
    }
}

/// Scenario 23: with a page larger than the window, window eviction plus insert never
/// leaves an all-tombstone leaf: the last page stays live and matchable.
#[test]
fn scenario_23_a_page_larger_than_the_window_never_leaves_an_all_tombstone_leaf() {
    let mut sizes: Vec<u32> = page_sizes().into_iter().filter(|&ps| ps > 1).collect();
    if !sizes.contains(&16) {
        sizes.push(16);
    }
    for ps in sizes {
        let p = ps as usize;
        let w = (p / 4).max(1);
        let mut sim = Sim::new(TreeConfig::swa(ps, w));
        let key = tokens(&pages(5), p);
        let r = sim.start_fresh(key.clone());
        sim.slide(r, 100); // as far as the ratchet allows: len − max(W, ps)
        assert_eq!(sim.reqs[r].cursor, 4 * p);
        sim.finish(r);
        // Even a cursor at the very end (beyond the ratchet) caches no tombstone leaf.
        let other = tokens(&[9, 9, 9], p);
        let r = sim.start_fresh(other.clone());
        sim.slide_to(r, 3 * p);
        sim.finish(r);
        for v in sim.tree.nodes().iter().skip(1) {
            if v.children == 0 {
                assert!(v.swa_live, "ps {ps}: all-tombstone leaf {:?}", v.id);
            }
        }
        assert_eq!(sim.probe(&key).len, Tokens(5 * p));
        assert_eq!(sim.probe(&other).len, Tokens(0));
        sim.check();
        sim.drain();
    }
}

/// Mamba: only nodes with a state end a match; a duplicate state is freed; states are
/// evicted least recently used first, alone: the KV under a state stays (a FULL hit a
/// later request can save a branching state on).
#[test]
fn mamba_states_end_matches_and_are_evicted_lru() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, p).with_mamba());
        let short = tokens(&[0, 1], p);
        let long = tokens(&[0, 1, 2, 3], p);
        let a = sim.start(long.clone());
        sim.finish(a);
        // The state sits at the end of `long` only: `short` matches nothing.
        let m = sim.probe(&short);
        assert_eq!((m.len, m.branching), (Tokens(0), Some(Tokens(2 * p))));
        assert_eq!(sim.probe(&long).len, Tokens(4 * p));
        let b = sim.start(short.clone());
        sim.finish(b); // state at the end of `short` now
        assert_eq!(sim.probe(&short).len, Tokens(2 * p));
        // A duplicate state at the same position is freed.
        let c = sim.start(short.clone());
        let slot = sim.reqs[c].mamba.unwrap();
        let actions = sim.finish(c);
        assert_eq!(actions, vec![Action::FreeMambaSlot { slot }]);
        sim.check();
        // LRU: `long`'s state was used before `short`'s; it sits on an unlocked leaf,
        // whose KV stays: `long` still hits it on FULL and branches there.
        let long_node = node_ending(&sim, &long);
        let evicted = sim.evict(Component::Mamba, 1);
        assert!(matches!(
            &evicted[..],
            [Action::EvictMambaState { node, .. }] if *node == long_node
        ));
        let m = sim.probe(&long);
        assert_eq!((m.len, m.full_hit), (Tokens(2 * p), Tokens(4 * p)));
        assert_eq!(sim.tree.sizes().mamba_evictable.get(), 1);
        // Once a longer request extends it, `short`'s state is internal: only it goes.
        let e = sim.start(long.clone());
        sim.finish(e);
        sim.check();
        let short_node = node_ending(&sim, &short);
        let evicted = sim.evict(Component::Mamba, 1);
        assert!(matches!(
            &evicted[..],
            [Action::EvictMambaState { node, .. }] if *node == short_node
        ));
        assert_eq!(sim.probe(&short).len, Tokens(0));
        assert_eq!(sim.probe(&long).len, Tokens(4 * p));
        sim.check();
        sim.drain();
    }
}

/// The node that ends exactly at the end of `key`, found without a match (which would
/// refresh LRU positions).
fn node_ending(sim: &Sim, key: &[TokenId]) -> unikv_radix::NodeId {
    sim.tree
        .nodes()
        .into_iter()
        .find(|v| v.start.get() + v.key.len() == key.len() && v.key == &key[v.start.get()..])
        .unwrap()
        .id
}

/// A locked Mamba state is protected until the lock is released.
#[test]
fn mamba_lock_protects_the_state() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, p).with_mamba());
        let key = tokens(&[3, 4], p);
        let a = sim.start(key.clone());
        sim.finish(a);
        let b = sim.start(key.clone());
        assert_eq!(sim.tree.sizes().mamba_protected.get(), 1);
        assert!(sim.tree.evict_one(Component::Mamba).is_none());
        sim.check();
        sim.finish(b);
        assert_eq!(sim.tree.sizes().mamba_evictable.get(), 1);
        sim.check();
        sim.drain();
    }
}

/// `release_window` drops the SWA part of a lock early; FULL stays locked, and the node's
/// SWA becomes evictable (a tombstone, since its FULL is still locked).
#[test]
fn releasing_the_window_keeps_full_locked() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, 2 * p));
        let key = tokens(&pages(4), p);
        let a = sim.start(key.clone());
        sim.finish(a);
        let b = sim.start(key.clone());
        assert_eq!(sim.tree.sizes().swa_protected, Tokens(2 * p));
        sim.release_window(b);
        let s = sim.tree.sizes();
        assert_eq!(
            (s.swa_protected, s.full_protected),
            (Tokens(0), Tokens(4 * p))
        );
        assert_eq!(
            sim.tree.release_window(sim.reqs[b].lock.unwrap()),
            Err(RadixError::WindowAlreadyReleased(sim.reqs[b].lock.unwrap()))
        );
        let actions = sim.evict(Component::Swa, usize::MAX);
        assert!(
            actions
                .iter()
                .all(|a| matches!(a, Action::TombstoneSwa { .. }))
        );
        assert_eq!(sim.tree.sizes().full_protected, Tokens(4 * p));
        sim.check();
        sim.drain();
    }
}

/// A lock survives splits of the nodes it covers (a later insert that diverges inside
/// them): releasing it returns every protected size to zero.
#[test]
fn locks_survive_node_splits() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, 3 * p));
        let a = sim.start_fresh(tokens(&pages(6), p));
        sim.finish(a);
        let b = sim.start(tokens(&pages(6), p));
        for split_at in [1, 4, 5] {
            let mut k: Vec<u32> = (0..split_at).collect();
            k.extend([7, 8]);
            let r = sim.start(tokens(&k, p));
            sim.finish(r);
            sim.check();
        }
        sim.finish(b);
        let s = sim.tree.sizes();
        assert_eq!(
            (s.full_protected, s.swa_protected, s.mamba_protected.get()),
            (Tokens(0), Tokens(0), 0)
        );
        sim.check();
        sim.drain();
    }
}

/// `evict_until` checks its predicate before each step and stops as soon as it holds.
#[test]
fn evict_until_stops_as_soon_as_the_predicate_holds() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::swa(ps, 2 * p));
        for s in 0..4 {
            let r = sim.start(tokens(&[s, s], p));
            sim.finish(r);
        }
        let (none, released) = sim.tree.evict_until(Component::Full, |_| true);
        assert!(none.is_empty() && released.full == Tokens(0));
        let actions = sim.evict(Component::Full, 3 * p);
        let leaves = actions
            .iter()
            .filter(|a| matches!(a, Action::EvictNode { .. }))
            .count();
        assert_eq!(
            leaves, 2,
            "ps {ps}: 3 pages need two 2-page leaves ({actions:?})"
        );
        sim.check();
        sim.drain();
    }
}

/// Without SWA, duplicates are freed two-sided (FULL only exists) and eviction removes
/// leaves.
#[test]
fn a_tree_without_swa_frees_duplicates_and_evicts_leaves() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::full_only(ps));
        let key = tokens(&pages(5), p);
        let a = sim.start_fresh(key.clone());
        let b = sim.start_fresh(key.clone()) - 1;
        sim.finish(a);
        let row = sim.reqs[b].row.clone();
        assert_eq!(sim.finish(b), vec![Action::FreeDeviceKv { tokens: row }]);
        assert_eq!(sim.tree.nodes().len(), 2, "no window cap without SWA");
        assert!(sim.tree.evict_one(Component::Swa).is_none());
        sim.check();
        sim.drain();
    }
}

/// A request holding a lock inserts only its new suffix: the tree walks from the locked
/// node, and `values_from` hands back only the rows past the old prefix, across nodes.
#[test]
fn a_suffix_insert_continues_from_the_locked_node() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::swa(ps, p)).unwrap();
        let key = tokens(&pages(6), p);
        let row: Vec<VirtualToken> = (100..100 + 6 * p as u32).map(VirtualToken).collect();
        let first = tree
            .insert(InsertRequest::new(&key[..2 * p], &row[..2 * p]).locked())
            .unwrap();
        let lock = first.lock.unwrap();
        // Another request splits the locked path after one page: the lock's node keeps its
        // end.
        let mut other = key[..p].to_vec();
        other.extend(tokens(&[7], p));
        let other_row: Vec<VirtualToken> = (900..900 + 2 * p as u32).map(VirtualToken).collect();
        tree.insert(InsertRequest::new(&other, &other_row).prev_prefix_len(0))
            .unwrap();
        let out = tree
            .insert(InsertRequest::after(lock, 2 * p, &key[2 * p..], &row[2 * p..]).locked())
            .unwrap();
        assert_eq!(out.cached_len.get(), 6 * p);
        assert_eq!(tree.match_prefix(&key).len.get(), 6 * p);
        assert_eq!(
            tree.values_from(out.node, Tokens(2 * p)).unwrap().to_vec(),
            row[2 * p..].to_vec()
        );
        assert_eq!(
            tree.values_from(out.node, Tokens(p + 1)).unwrap().to_vec(),
            row[p + 1..].to_vec(),
            "ps {ps}: from inside a node"
        );
        assert_eq!(
            tree.values_from(out.node, Tokens::ZERO).unwrap(),
            tree.prefix_values(out.node).unwrap()
        );
        assert!(
            tree.values_from(out.node, Tokens(6 * p))
                .unwrap()
                .is_empty()
        );
        tree.sanity_check().unwrap();
    }
}

/// Bad input is a typed error and leaves the tree exactly as it was.
#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let ps = 4u32;
    let mut tree = RadixTree::new(TreeConfig::swa(ps, 8)).unwrap();
    let key = tokens(&pages(4), 4);
    let row: Vec<VirtualToken> = (16..32).map(VirtualToken).collect();
    let out = tree.insert(InsertRequest::new(&key, &row)).unwrap();
    let lock = tree.lock(out.node).unwrap();
    let other_key = tokens(&[0, 1, 5, 6], 4);
    // Shares the first two pages (and their values) with `key`, then diverges.
    let other_row: Vec<VirtualToken> = (16..24).chain(40..48).map(VirtualToken).collect();
    let before = tree.dump();
    let cases: Vec<(InsertRequest<'_>, RadixError)> = vec![
        (
            InsertRequest::new(&key, &row[..12]),
            RadixError::KeyValueLengthMismatch { key: 16, value: 12 },
        ),
        (
            InsertRequest::new(&key[..6], &row[..6]),
            RadixError::NotPageAligned {
                what: "key length",
                len: 6,
                page_size: 4,
            },
        ),
        (
            InsertRequest::new(&key, &row).window_cursor(2),
            RadixError::NotPageAligned {
                what: "window cursor",
                len: 2,
                page_size: 4,
            },
        ),
        (
            InsertRequest::new(&other_key, &other_row).prev_prefix_len(12),
            RadixError::PrefixNotInTree {
                claimed: 12,
                cached: 8,
            },
        ),
        (
            InsertRequest::new(&key, &other_row).prev_prefix_len(12),
            RadixError::PrefixValueMismatch { position: 8 },
        ),
        (
            InsertRequest::new(&key, &row).mamba(MambaSlot(1)),
            RadixError::MambaDisabled,
        ),
        (
            // A suffix must start where its locked node ends (16), not inside it.
            InsertRequest::after(lock, 12, &key[12..], &row[12..]),
            RadixError::SuffixStartMismatch {
                at: 12,
                node_end: 16,
            },
        ),
    ];
    for (request, error) in cases {
        assert_eq!(tree.insert(request), Err(error));
        assert_eq!(tree.dump(), before);
    }
    tree.unlock(lock).unwrap();
    let unlocked = tree.dump();
    assert_eq!(
        tree.insert(InsertRequest::after(lock, 16, &[], &[])),
        Err(RadixError::UnknownLock(lock))
    );
    assert_eq!(tree.dump(), unlocked);
    assert_eq!(tree.unlock(lock), Err(RadixError::UnknownLock(lock)));
    assert_eq!(
        tree.release_window(lock),
        Err(RadixError::UnknownLock(lock))
    );
    let stale = out.node;
    while tree.evict_one(Component::Full).is_some() {}
    assert_eq!(tree.lock(stale), Err(RadixError::UnknownNode(stale)));
    assert!(tree.node(stale).is_err());
    assert!(matches!(
        RadixTree::new(TreeConfig::swa(0, 8)),
        Err(RadixError::InvalidConfig { .. })
    ));
    assert!(matches!(
        RadixTree::new(TreeConfig::swa(4, 0)),
        Err(RadixError::InvalidConfig { .. })
    ));
    tree.sanity_check().unwrap();
    tree.invariant_scope().poll().unwrap();
}

/// The root is a valid lock target (a request that matched nothing): locking it protects
/// nothing. Empty keys cache nothing and hand a Mamba slot back.
#[test]
fn empty_matches_and_inserts_are_harmless() {
    let mut tree = RadixTree::new(TreeConfig::swa(2, 4).with_mamba()).unwrap();
    let lock = tree.lock(tree.root()).unwrap();
    assert_eq!(tree.sizes(), Default::default());
    tree.unlock(lock).unwrap();
    let out = tree
        .insert(InsertRequest::new(&[], &[]).mamba(MambaSlot(3)))
        .unwrap();
    assert_eq!(out.cached_len, Tokens(0));
    assert_eq!(
        out.actions,
        vec![Action::FreeMambaSlot { slot: MambaSlot(3) }]
    );
    let m = tree.match_prefix(&[TokenId(1)]); // less than a page
    assert_eq!((m.len, m.full_hit), (Tokens(0), Tokens(0)));
    tree.sanity_check().unwrap();
    tree.invariant_scope().poll().unwrap();
}

/// Caches `key` as a request that matched nothing (its own Mamba state attached at the
/// key's end) and returns the insert's actions with the request's row.
fn cache_fresh(sim: &mut Sim, key: Vec<TokenId>) -> (Vec<Action>, Vec<VirtualToken>) {
    let r = sim.start_fresh(key);
    let row = sim.reqs[r].row.clone();
    (sim.finish(r), row)
}

fn evicted_states(actions: &[Action]) -> Vec<(unikv_radix::NodeId, MambaSlot)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::EvictMambaState { node, slot } => Some((*node, *slot)),
            _ => None,
        })
        .collect()
}

/// The Mamba path cap on one chain (no paths diverge, nothing copied: no state serves
/// reuse): an insert that attaches a state to a path already holding `cap` evicts the
/// least recently used unlocked states of that path (not the shallowest, not the
/// deepest), each as `EvictMambaState` after the insert's frees, and only those. A state
/// attached on an internal node is checked against its own path only: the deeper path is
/// brought within the cap by its next attach, which then evicts several.
#[test]
fn the_mamba_path_cap_evicts_the_least_recently_used_unlocked_path_states() {
    for ps in page_sizes() {
        let p = ps as usize;
        let cap = std::num::NonZeroUsize::new(2).unwrap();
        let config = TreeConfig::full_only(ps)
            .with_mamba()
            .with_mamba_path_cap(cap);
        let mut sim = Sim::new(config);
        let k = |n| tokens(&pages(n), p);
        for n in [1, 3, 2] {
            let (actions, _) = cache_fresh(&mut sim, k(n));
            assert!(evicted_states(&actions).is_empty(), "ps {ps} key {n}");
            sim.check();
        }
        // States at p, 3p and (attached last, on the node a split made) 2p: the path to 3p
        // holds three, over the cap, until the next attach on it.
        let state = |sim: &Sim, n| {
            let id = node_ending(sim, &k(n));
            (id, sim.tree.node(id).unwrap().mamba.unwrap())
        };
        let (s1, s3) = (state(&sim, 1), state(&sim, 3));
        let (actions, row) = cache_fresh(&mut sim, k(4));
        assert_eq!(
            actions,
            vec![
                Action::FreeDeviceKv {
                    tokens: slice(&row, 0, 3 * p)
                },
                Action::EvictMambaState {
                    node: s1.0,
                    slot: s1.1
                },
                Action::EvictMambaState {
                    node: s3.0,
                    slot: s3.1
                },
            ],
            "ps {ps}"
        );
        sim.check();
        assert_eq!(sim.tree.held().2.get(), 2);
        assert_eq!(sim.probe(&k(1)).len, Tokens(0));
        assert_eq!(sim.probe(&k(2)).len, Tokens(2 * p));
        let m = sim.probe(&k(3));
        assert_eq!((m.len, m.full_hit), (Tokens(2 * p), Tokens(3 * p)));
        assert_eq!(sim.probe(&k(4)).len, Tokens(4 * p));
        assert!(sim.tree.dump().starts_with("tree ps="));
        assert!(
            sim.tree
                .dump()
                .lines()
                .next()
                .unwrap()
                .contains("path_cap=2")
        );
        sim.check();
        sim.drain();
    }
}

/// The cap is best-effort over unlocked states: a locked state is never evicted for it,
/// so the path stays over the cap while only locked states could go; once unlocked, the
/// next attach on the path evicts the excess in LRU order (the unlocking request's insert
/// refreshed its state, so the other one goes first).
#[test]
fn the_mamba_path_cap_never_evicts_a_locked_state() {
    for ps in page_sizes() {
        let p = ps as usize;
        let cap = std::num::NonZeroUsize::new(1).unwrap();
        let config = TreeConfig::swa(ps, p).with_mamba().with_mamba_path_cap(cap);
        let mut sim = Sim::new(config);
        let k = |n| tokens(&pages(n), p);
        cache_fresh(&mut sim, k(1));
        let reader = sim.start(k(1)); // locks the state at p
        let n1 = node_ending(&sim, &k(1));
        assert_eq!(sim.tree.node(n1).unwrap().mamba_lock, 1);
        let (actions, _) = cache_fresh(&mut sim, k(2));
        assert!(evicted_states(&actions).is_empty(), "ps {ps}: {actions:?}");
        let n2 = node_ending(&sim, &k(2));
        let slot1 = sim.tree.node(n1).unwrap().mamba.unwrap();
        let slot2 = sim.tree.node(n2).unwrap().mamba.unwrap();
        assert_eq!(sim.tree.sizes().mamba_protected.get(), 1);
        assert_eq!(sim.tree.sizes().mamba_evictable.get(), 1);
        sim.check();
        // The reader finishes: its duplicate state is handed back, the path's is unlocked
        // and refreshed.
        sim.finish(reader);
        sim.check();
        let (actions, _) = cache_fresh(&mut sim, k(3));
        assert_eq!(
            evicted_states(&actions),
            vec![(n2, slot2), (n1, slot1)],
            "ps {ps}"
        );
        assert_eq!(sim.tree.held().2.get(), 1);
        sim.check();
        sim.drain();
    }
}

/// An admission's lock pins the state it copies; an unfinished insert's lock keeps the
/// path's KV but leaves the state at its node evictable (the request runs on its own
/// slot), and evicting it keeps the KV and the lock.
#[test]
fn an_unfinished_inserts_lock_leaves_its_state_evictable() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::swa(ps, p).with_mamba()).unwrap();
        let key = tokens(&pages(2), p);
        let row: Vec<VirtualToken> = (100..100 + 2 * p as u32).map(VirtualToken).collect();
        let out = tree
            .insert(InsertRequest::new(&key, &row).mamba(MambaSlot(5)).locked())
            .unwrap();
        let node = tree.node(out.node).unwrap();
        assert_eq!(
            (node.mamba, node.mamba_lock),
            (Some(MambaSlot(5)), 0),
            "ps {ps}"
        );
        assert_eq!(tree.sizes().mamba_evictable.get(), 1, "ps {ps}");
        let admission = tree.lock(out.node).unwrap();
        assert_eq!(tree.sizes().mamba_protected.get(), 1, "ps {ps}");
        assert!(
            tree.evict_one(Component::Mamba).is_none(),
            "ps {ps}: pinned"
        );
        tree.unlock(admission).unwrap();
        let actions = tree.evict_one(Component::Mamba).unwrap();
        assert_eq!(
            actions,
            vec![Action::EvictMambaState {
                node: out.node,
                slot: MambaSlot(5)
            }],
            "ps {ps}"
        );
        assert_eq!(
            tree.match_prefix(&key).full_hit.get(),
            2 * p,
            "ps {ps}: KV stays"
        );
        tree.unlock(out.lock.unwrap()).unwrap();
        tree.sanity_check().unwrap();
    }
}

/// The node ending `key` and its state's slot.
fn state_at(sim: &Sim, key: &[TokenId]) -> (unikv_radix::NodeId, MambaSlot) {
    let id = node_ending(sim, key);
    (id, sim.tree.node(id).unwrap().mamba.unwrap())
}

/// The cap values a state by the reuse it serves: the state other paths branch from (the
/// deepest one above the node where they diverge) outlives older and newer states that
/// serve one path only, and a state above it is no branch state (the branch resumes from
/// the deeper one). Once only states that serve reuse are left (the others copied by
/// admissions), the least recently used of them goes.
#[test]
fn the_mamba_path_cap_keeps_the_state_other_paths_branch_from() {
    for ps in page_sizes() {
        let p = ps as usize;
        let cap = std::num::NonZeroUsize::new(3).unwrap();
        let config = TreeConfig::full_only(ps)
            .with_mamba()
            .with_mamba_path_cap(cap);
        let mut sim = Sim::new(config);
        let k = |n: u32| tokens(&pages(n), p);
        // Q at p, S at 2p, a branch leaving at 3p (its state at 4p), D at 5p: the node
        // [2p, 3p) has two children, and S is the deepest state above it.
        let branch = tokens(&[0, 1, 2, 9], p);
        for key in [k(1), k(2), branch.clone(), k(5)] {
            let (actions, _) = cache_fresh(&mut sim, key);
            assert!(evicted_states(&actions).is_empty(), "ps {ps}: {actions:?}");
        }
        let (q, s, d) = (
            state_at(&sim, &k(1)),
            state_at(&sim, &k(2)),
            state_at(&sim, &k(5)),
        );
        sim.check();
        // E at 6p: Q (the oldest, above S) goes, not S.
        let (actions, row) = cache_fresh(&mut sim, k(6));
        assert_eq!(
            actions,
            vec![
                Action::FreeDeviceKv {
                    tokens: slice(&row, 0, 5 * p)
                },
                Action::EvictMambaState {
                    node: q.0,
                    slot: q.1
                },
            ],
            "ps {ps}"
        );
        // G at 7p: D goes, although S is older (no match has refreshed S).
        let (actions, _) = cache_fresh(&mut sim, k(7));
        assert_eq!(evicted_states(&actions), vec![d], "ps {ps}");
        let other_branch = tokens(&[0, 1, 2, 7], p);
        assert_eq!(sim.probe(&other_branch).len, Tokens(2 * p), "ps {ps}");
        sim.check();
        // Admissions copy G, then H at 8p: S, G and H all serve reuse, so I at 9p evicts
        // the least recently used of them, S.
        for n in [7, 8] {
            if n == 8 {
                cache_fresh(&mut sim, k(8));
            }
            let r = sim.start(k(n));
            let own = sim.reqs[r].mamba.unwrap();
            assert_eq!(sim.finish(r), vec![Action::FreeMambaSlot { slot: own }]);
        }
        let (actions, _) = cache_fresh(&mut sim, k(9));
        assert_eq!(evicted_states(&actions), vec![s], "ps {ps}");
        sim.check();
        sim.drain();
    }
}

/// A state an admission copied outlives a newer one on its path that nobody copied,
/// although no paths diverge there.
#[test]
fn the_mamba_path_cap_keeps_a_state_an_admission_copied() {
    for ps in page_sizes() {
        let p = ps as usize;
        let cap = std::num::NonZeroUsize::new(2).unwrap();
        let config = TreeConfig::full_only(ps)
            .with_mamba()
            .with_mamba_path_cap(cap);
        let mut sim = Sim::new(config);
        let k = |symbols: &[u32]| tokens(symbols, p);
        cache_fresh(&mut sim, k(&[0]));
        let s = state_at(&sim, &k(&[0]));
        // A repeat of the prompt copies S: S is hit.
        let r = sim.start(k(&[0]));
        sim.finish(r);
        // T at 2p is newer than S and nobody copied it.
        let (actions, _) = cache_fresh(&mut sim, k(&[0, 1]));
        assert!(evicted_states(&actions).is_empty(), "ps {ps}: {actions:?}");
        let t = state_at(&sim, &k(&[0, 1]));
        let (actions, _) = cache_fresh(&mut sim, k(&[0, 1, 2]));
        assert_eq!(evicted_states(&actions), vec![t], "ps {ps}");
        assert_eq!(sim.tree.node(s.0).unwrap().mamba, Some(s.1), "ps {ps}");
        assert_eq!(sim.probe(&k(&[0, 7])).len, Tokens(p), "ps {ps}");
        sim.check();
        sim.drain();
    }
}

/// Without a cap the same sequence keeps every state (the cap is what evicts).
#[test]
fn without_a_path_cap_an_insert_evicts_no_state() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::full_only(ps).with_mamba());
        for n in 1..=4 {
            let (actions, _) = cache_fresh(&mut sim, tokens(&pages(n), p));
            assert!(evicted_states(&actions).is_empty());
        }
        assert_eq!(sim.tree.held().2.get(), 4);
        sim.check();
        sim.drain();
    }
}

/// (interval in pages, or `None` for the page-size grid; probe symbols; expected len,
/// FULL hit and Mamba branching, in pages).
type BranchingCase = (Option<usize>, &'static [u32], usize, usize, Option<usize>);

/// `mamba_branching` is the FULL hit aligned down to the checkpoint grid when that is
/// still past the (state-valid) match: the page size without an interval, `None` without
/// Mamba or when the aligned hit is no longer than the match.
#[test]
fn mamba_branching_is_the_full_hit_aligned_down_to_the_checkpoint_grid() {
    for ps in page_sizes() {
        let p = ps as usize;
        let t = |symbols: &[u32]| tokens(symbols, p);
        // States at 2 and 5 pages.
        let cases: [BranchingCase; 7] = [
            (Some(2), &[0, 1, 2, 7], 2, 3, None),
            (Some(2), &[0, 1, 2, 3, 7], 2, 4, Some(4)),
            (Some(3), &[0, 1, 2, 3, 7], 2, 4, Some(3)),
            (Some(2), &[0, 7], 0, 1, None),
            (Some(2), &[0, 1, 2, 3, 4], 5, 5, None),
            (None, &[0, 1, 2, 7], 2, 3, Some(3)),
            (None, &[0, 7], 0, 1, Some(1)),
        ];
        for (interval, probe, len, hit, expected) in cases {
            let mut config = TreeConfig::full_only(ps).with_mamba();
            if let Some(pages) = interval {
                config = config.with_mamba_checkpoint_interval(pages * p);
            }
            let mut sim = Sim::new(config);
            cache_fresh(&mut sim, t(&[0, 1, 2, 3, 4]));
            cache_fresh(&mut sim, t(&[0, 1]));
            let m = sim.probe(&t(probe));
            let case = format!("ps {ps} interval {interval:?} probe {probe:?}");
            assert_eq!(
                (m.len, m.full_hit),
                (Tokens(len * p), Tokens(hit * p)),
                "{case}"
            );
            assert_eq!(
                m.branching,
                (hit > len).then_some(Tokens(hit * p)),
                "{case}"
            );
            assert_eq!(m.mamba_branching, expected.map(|e| Tokens(e * p)), "{case}");
            sim.check();
            sim.drain();
        }
        // Without Mamba there is no Mamba branching, even where FULL branches (below a
        // tombstone the match needs a whole window).
        let mut sim = Sim::new(TreeConfig::swa(ps, 2 * p));
        let key = t(&[0, 1, 2, 3, 4, 5]);
        cache_fresh(&mut sim, key.clone());
        sim.evict(Component::Swa, 1);
        let m = sim.probe(&t(&[0, 1, 2, 3, 4, 7]));
        assert!(m.branching.is_some(), "ps {ps}: {m:?}");
        assert_eq!(m.mamba_branching, None);
        sim.check();
        sim.drain();
    }
}

/// The Mamba options are checked when the tree is built: an interval that is not a
/// positive multiple of the page size, or a Mamba option without Mamba, is a typed error.
#[test]
fn mamba_options_are_checked_when_the_tree_is_built() {
    let cap = std::num::NonZeroUsize::new(1).unwrap();
    let mamba = TreeConfig::full_only(4).with_mamba();
    assert_eq!(
        RadixTree::new(mamba.with_mamba_checkpoint_interval(6)).err(),
        Some(RadixError::NotPageAligned {
            what: "Mamba checkpoint interval",
            len: 6,
            page_size: 4
        })
    );
    assert!(matches!(
        RadixTree::new(mamba.with_mamba_checkpoint_interval(0)),
        Err(RadixError::InvalidConfig { .. })
    ));
    for without_mamba in [
        TreeConfig::full_only(4).with_mamba_path_cap(cap),
        TreeConfig::swa(4, 8).with_mamba_checkpoint_interval(8),
    ] {
        assert!(matches!(
            RadixTree::new(without_mamba),
            Err(RadixError::InvalidConfig { .. })
        ));
    }
    let tree = RadixTree::new(
        mamba
            .with_mamba_checkpoint_interval(8)
            .with_mamba_path_cap(cap),
    );
    assert_eq!(tree.unwrap().config().mamba_grid(), Tokens(8));
    assert_eq!(mamba.mamba_grid(), Tokens(4));
}

/// A claimed tree-owned prefix that leaves a node in its middle is not in the tree, even
/// when the rest of the claim matches a child of that node (a walk that went on into the
/// node's children after the divergence would accept it).
#[test]
fn a_claimed_prefix_that_leaves_a_node_midway_is_not_in_the_tree() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::full_only(ps)).unwrap();
        let ids = |from: u32| (from..from + 3 * ps).map(VirtualToken).collect::<Vec<_>>();
        let (a, b) = (ids(100), ids(1_000));
        // [0 1 2] then [0 1 3]: the node [0 1] with the children [2] and [3].
        tree.insert(InsertRequest::new(&tokens(&[0, 1, 2], p), &a))
            .unwrap();
        // (Its duplicate pages [0 1] come back as a free: nothing to apply here.)
        tree.insert(InsertRequest::new(&tokens(&[0, 1, 3], p), &b))
            .unwrap();
        // [0 2 ...] claiming two pages: page 0 is the tree's, page 2 is the child's
        // (values included), but the tree holds no path [0 2].
        let key = tokens(&[0, 2, 4], p);
        let row: Vec<VirtualToken> = a[..p]
            .iter()
            .chain(&a[2 * p..])
            .copied()
            .chain((5_000..5_000 + ps).map(VirtualToken))
            .collect();
        let before = tree.dump();
        assert_eq!(
            tree.insert(InsertRequest::new(&key, &row).prev_prefix_len(2 * p))
                .unwrap_err(),
            RadixError::PrefixNotInTree {
                claimed: 2 * p,
                cached: p,
            },
            "ps {ps}"
        );
        assert_eq!(
            tree.dump(),
            before,
            "ps {ps}: a refused insert changes nothing"
        );
    }
}

/// An insert refreshes the FULL LRU positions along its path, as a match does: after a
/// duplicate insert of the older of two leaves, the other one is evicted first.
#[test]
fn an_insert_refreshes_its_paths_lru_position() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::full_only(ps)).unwrap();
        let ids = |from: u32| (from..from + 2 * ps).map(VirtualToken).collect::<Vec<_>>();
        let (old, new, dup) = (ids(100), ids(1_000), ids(5_000));
        tree.insert(InsertRequest::new(&tokens(&[0, 1], p), &old))
            .unwrap();
        tree.insert(InsertRequest::new(&tokens(&[7, 8], p), &new))
            .unwrap();
        // The duplicate frees its own copy and touches the tree's [0 1].
        let out = tree
            .insert(InsertRequest::new(&tokens(&[0, 1], p), &dup))
            .unwrap();
        assert_eq!(out.actions, vec![Action::FreeDeviceKv { tokens: dup }]);
        let evicted = tree.evict_one(Component::Full).unwrap();
        assert!(
            matches!(&evicted[..], [Action::EvictNode { tokens, .. }] if *tokens == new),
            "ps {ps}: {evicted:?}"
        );
    }
}

/// A match refreshes the LRU position of the state it ends at: of two cached states, the
/// one matched last is evicted last.
#[test]
fn a_match_refreshes_the_state_it_ends_at() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut sim = Sim::new(TreeConfig::full_only(ps).with_mamba());
        let (older, newer) = (tokens(&[0, 1], p), tokens(&[5, 6], p));
        for key in [&older, &newer] {
            let r = sim.start(key.clone());
            sim.finish(r);
        }
        assert_eq!(sim.probe(&older).len, Tokens(2 * p), "ps {ps}");
        let newer_node = node_ending(&sim, &newer);
        let evicted = sim.evict(Component::Mamba, 1);
        assert!(
            evicted
                .iter()
                .any(|a| matches!(a, Action::EvictMambaState { node, .. } if *node == newer_node)),
            "ps {ps}: {evicted:?}"
        );
        assert_eq!(
            sim.probe(&older).len,
            Tokens(2 * p),
            "ps {ps}: still cached"
        );
        sim.check();
        sim.drain();
    }
}

/// `held` counts what the tree holds whether locked or not: evictable plus protected.
#[test]
fn held_counts_evictable_and_protected_kv() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::swa(ps, 64 * p)).unwrap();
        let ids = |from: u32| (from..from + 2 * ps).map(VirtualToken).collect::<Vec<_>>();
        let (a, b) = (ids(100), ids(1_000));
        tree.insert(InsertRequest::new(&tokens(&[0, 1], p), &a))
            .unwrap();
        let locked = tree
            .insert(InsertRequest::new(&tokens(&[5, 6], p), &b).locked())
            .unwrap();
        assert!(locked.lock.is_some());
        let s = tree.sizes();
        assert!(
            s.full_protected.get() > 0 && s.full_evictable.get() > 0,
            "ps {ps}"
        );
        assert_eq!(
            tree.held(),
            (Tokens(4 * p), Tokens(4 * p), unikv_radix::Slots(0)),
            "ps {ps}"
        );
    }
}

/// An insert or match refreshes the SWA LRU positions of its node and of the ancestors
/// within `W + ps` tokens of it, no further: after a match of a chain of one-page nodes,
/// only the ancestors beyond that span are older than a leaf inserted before the match.
#[test]
fn the_swa_refresh_reaches_one_window_and_a_page_up_the_path() {
    // ps 2, W 4: a refresh covers 6 tokens, three one-page nodes.
    let (ps, w) = (2u32, 4usize);
    let p = ps as usize;
    let mut tree = RadixTree::new(TreeConfig::swa(ps, w)).unwrap();
    let mut next = 100u32;
    let mut insert = |tree: &mut RadixTree, pages: &[u32]| {
        let key = tokens(pages, p);
        let row: Vec<VirtualToken> = (next..next + key.len() as u32).map(VirtualToken).collect();
        next += key.len() as u32;
        tree.insert(InsertRequest::new(&key, &row)).unwrap();
    };
    for n in 1..=5 {
        insert(&mut tree, &pages(n));
    }
    let later = [70, 71];
    insert(&mut tree, &later);
    let later_key = tokens(&later, p);
    let later_node = tree
        .nodes()
        .into_iter()
        .find(|v| v.key == &later_key[..])
        .unwrap()
        .id;
    // A match of the whole chain refreshes pages 4, 3 and 2; pages 0 and 1 were last
    // refreshed by the inserts of [0 1 2] and [0 1 2 3], before the later leaf.
    assert_eq!(tree.match_prefix(&tokens(&pages(5), p)).len, Tokens(5 * p));
    let mut order = Vec::new();
    while let Some(actions) = tree.evict_one(Component::Swa) {
        let node = match &actions[0] {
            Action::TombstoneSwa { node, .. } | Action::EvictNode { node, .. } => *node,
            other => panic!("{other:?}"),
        };
        order.push(node);
        if node == later_node {
            break;
        }
    }
    assert_eq!(
        order.len(),
        3,
        "two chain nodes are older than the later leaf: {order:?}"
    );
}

/// States at positions inside an insert's key: the node there is split so one ends at
/// each position; a state written by the step in flight ends no match (and cannot be
/// evicted) until `publish_states`; the per-path cap evicts the oldest states first and
/// never one the insert just attached; checkpoints that do not ascend inside the key
/// are refused with the tree unchanged.
#[test]
fn checkpoints_inside_a_key_land_at_their_positions_and_honour_the_path_cap() {
    for ps in page_sizes() {
        let p = ps as usize;
        let cap = std::num::NonZeroUsize::new(2).unwrap();
        let mut tree = RadixTree::new(
            TreeConfig::full_only(ps)
                .with_mamba()
                .with_mamba_path_cap(cap),
        )
        .unwrap();
        let key: Vec<TokenId> = (0..4 * p as u32).map(TokenId).collect();
        let value: Vec<VirtualToken> = (1..=4 * p as u32).map(VirtualToken).collect();
        let at = |pages: usize, slot: u32, in_flight: bool| StateCheckpoint {
            at: Tokens(pages * p),
            slot: MambaSlot(slot),
            in_flight,
            role: StateRole::Anchor,
        };
        // Misordered or misplaced checkpoints change nothing.
        for bad in [
            vec![at(2, 1, false), at(1, 2, false)],
            vec![at(0, 1, false)],
            vec![at(5, 1, false)],
        ] {
            let refused = tree.insert(InsertRequest::new(&key, &value).checkpoints(&bad));
            assert!(
                matches!(refused, Err(RadixError::BadCheckpoint { .. })),
                "ps {ps}: {refused:?}"
            );
            assert_eq!(tree.node_count(), 1, "ps {ps}");
        }
        let first = [at(1, 1, false), at(2, 2, false)];
        let out = tree
            .insert(InsertRequest::new(&key, &value).checkpoints(&first))
            .unwrap();
        assert!(out.actions.is_empty(), "ps {ps}: {:?}", out.actions);
        assert_eq!(tree.match_prefix(&key[..3 * p]).len, Tokens(2 * p));
        assert_eq!(tree.match_prefix(&key[..2 * p - 1]).len, Tokens(p));
        // Two more, in flight: the path holds four, the cap two; the two oldest go.
        let second = [at(3, 3, true), at(4, 4, true)];
        let out = tree
            .insert(
                InsertRequest::new(&key, &value)
                    .prev_prefix_len(4 * p)
                    .checkpoints(&second),
            )
            .unwrap();
        let mut evicted: Vec<u32> = out
            .actions
            .iter()
            .map(|a| match a {
                Action::EvictMambaState { slot, .. } => slot.0,
                other => panic!("ps {ps}: {other:?}"),
            })
            .collect();
        evicted.sort_unstable();
        assert_eq!(evicted, [1, 2], "ps {ps}: the oldest states go");
        // In flight: no match ends there, and no eviction takes them.
        assert_eq!(tree.match_prefix(&key).len, Tokens(0), "ps {ps}");
        assert!(tree.evict_one(Component::Mamba).is_none(), "ps {ps}");
        assert!(tree.evict_one(Component::Full).is_none(), "ps {ps}");
        tree.publish_states();
        assert_eq!(tree.match_prefix(&key).len, Tokens(4 * p), "ps {ps}");
        assert_eq!(tree.sizes().mamba_evictable.get(), 2);
        tree.sanity_check().unwrap();
    }
}

/// Mamba eviction values a state by the reuse it serves: every grid state inside a prompt
/// ([`StateRole::Grid`]) that no admission copied goes before any anchor, even an anchor
/// older than it, each group least recently used first; a grid state an admission copied
/// counts as an anchor.
#[test]
fn mamba_eviction_frees_unserved_grid_states_before_older_anchors() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::full_only(ps).with_mamba()).unwrap();
        // Three prompts of 3 pages (distinct first pages), each with a grid state at page 1
        // and its anchor at page 2, inserted in the order `a`, `b`, `c`.
        let mut insert = |first: u32, base: u32| {
            let states = [
                written_state(p, 1, base, StateRole::Grid),
                written_state(p, 2, base + 1, StateRole::Anchor),
            ];
            insert_prompt(&mut tree, p, (first, 3), base, &states)
        };
        let a = insert(1, 100);
        let b = insert(2, 200);
        insert(3, 300);
        let evicted = |tree: &mut RadixTree| match tree.evict_one(Component::Mamba).as_deref() {
            Some([Action::EvictMambaState { slot, .. }]) => slot.0,
            other => panic!("ps {ps}: {other:?}"),
        };
        let mut order = Vec::new();
        // An admission copies `b`'s grid state: it served reuse, so it outlives `a`'s anchor.
        let hit = tree.match_prefix(&b[..p]);
        assert_eq!(hit.len.get(), p, "ps {ps}");
        let lock = tree.lock(hit.node).unwrap();
        tree.unlock(lock).unwrap();
        for _ in 0..6 {
            order.push(evicted(&mut tree));
            tree.sanity_check().unwrap();
        }
        // The unserved grid states first (`c`'s before `a`'s older anchor), then the anchors
        // and the copied grid state least recently used first (the match touched `b`'s
        // grid state last).
        assert_eq!(order, [100, 300, 101, 201, 301, 200], "ps {ps}");
        assert!(tree.evict_one(Component::Mamba).is_none(), "ps {ps}");
        assert_eq!(
            tree.match_prefix(&a).full_hit.get(),
            3 * p,
            "ps {ps}: KV stays"
        );
    }
}

/// With recurrent state, SWA eviction tombstones live SWA that no valued state's window
/// needs before any window that one does, even an older one: a match can end only at a
/// state, so a prompt's SWA far behind its prompt-end state serves nothing. Two prompts
/// of 6 pages, each a grid state at page 4 and an anchor at page 6, window 2 pages: the
/// first two tombstones take both prompts' first 4 pages, and both still match whole
/// (plain LRU took the older prompt's two nodes, its window with them).
#[test]
fn swa_eviction_keeps_the_window_behind_a_valued_state_over_newer_swa_no_state_needs() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::swa(ps, 2 * p).with_mamba()).unwrap();
        let mut insert = |first: u32, base: u32| {
            let states = [
                written_state(p, 4, base, StateRole::Grid),
                written_state(p, 6, base + 1, StateRole::Anchor),
            ];
            insert_prompt(&mut tree, p, (first, 6), base, &states)
        };
        let older = insert(1, 100);
        let newer = insert(2, 200);
        for _ in 0..2 {
            match tree.evict_one(Component::Swa).as_deref() {
                Some([Action::TombstoneSwa { tokens, .. }, ..]) => {
                    assert_eq!(tokens.len(), 4 * p, "ps {ps}: the stretch no window needs");
                }
                other => panic!("ps {ps}: {other:?}"),
            }
            tree.sanity_check().unwrap();
        }
        for key in [&older, &newer] {
            assert_eq!(tree.match_prefix(key).len, Tokens(6 * p), "ps {ps}");
        }
    }
}

/// `lock_reaching` locks the SWA of the nodes covering `reach` tokens up from the node
/// (one window at least), FULL to the root and no Mamba state: SWA eviction tombstones
/// only what lies beyond, and once it is unlocked the rest goes too.
#[test]
fn a_lock_reaching_back_keeps_that_much_swa_live() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::swa(ps, 2 * p).with_mamba()).unwrap();
        // Four 2-page nodes: [0, 2p), [2p, 4p), [4p, 6p), [6p, 8p), the last with a state.
        let key = tokens(&pages(8), p);
        let row: Vec<VirtualToken> = (100..100 + 8 * p as u32).map(VirtualToken).collect();
        let mut node = None;
        for end in [2, 4, 6, 8] {
            let mut insert = InsertRequest::new(&key[..end * p], &row[..end * p]);
            if end == 8 {
                insert = insert.mamba(MambaSlot(7));
            }
            node = Some(tree.insert(insert).unwrap().node);
        }
        let node = node.unwrap();
        let lock = tree.lock_reaching(node, Tokens(5 * p)).unwrap();
        assert_eq!(
            tree.sizes().mamba_protected.get(),
            0,
            "ps {ps}: its state stays evictable"
        );
        let mut tombstoned = Vec::new();
        while let Some(actions) = tree.evict_one(Component::Swa) {
            for a in actions {
                if let Action::TombstoneSwa { tokens, .. } = a {
                    tombstoned.push(tokens[0].0 - 100);
                }
            }
        }
        // 5 pages reach into [2p, 4p): only [0, 2p) goes.
        assert_eq!(tombstoned, [0], "ps {ps}");
        tree.sanity_check().unwrap();
        tree.unlock(lock).unwrap();
        let mut after = 0;
        while tree.evict_one(Component::Swa).is_some() {
            after += 1;
        }
        assert_eq!(after, 3, "ps {ps}: the three other nodes");
        tree.sanity_check().unwrap();
    }
}

/// The Mamba path cap, among the states that serve no reuse, takes a grid state before an
/// anchor of the same age.
#[test]
fn the_mamba_path_cap_takes_a_grid_state_before_an_anchor() {
    for ps in page_sizes() {
        let p = ps as usize;
        let cap = std::num::NonZeroUsize::new(2).unwrap();
        let config = TreeConfig::full_only(ps)
            .with_mamba()
            .with_mamba_path_cap(cap);
        let mut tree = RadixTree::new(config).unwrap();
        let key = tokens(&pages(4), p);
        let row: Vec<VirtualToken> = (100..100 + 4 * p as u32).map(VirtualToken).collect();
        let prompt = [
            written_state(p, 1, 1, StateRole::Grid),
            written_state(p, 2, 2, StateRole::Anchor),
        ];
        tree.insert(InsertRequest::new(&key[..3 * p], &row[..3 * p]).checkpoints(&prompt))
            .unwrap();
        // The continuation's state at page 4 is a third on the path: one of the two goes.
        let out = tree
            .insert(InsertRequest::new(&key, &row).mamba(MambaSlot(3)))
            .unwrap();
        let freed: Vec<u32> = out
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::EvictMambaState { slot, .. } => Some(slot.0),
                _ => None,
            })
            .collect();
        assert_eq!(freed, [1], "ps {ps}");
        tree.sanity_check().unwrap();
    }
}

/// `path_key` gives the tokens from the root to a node's end; `next_victim` names the
/// node `evict_one` takes next, without taking it.
#[test]
fn path_key_and_next_victim_name_what_eviction_takes() {
    for ps in page_sizes() {
        let p = ps as usize;
        let mut tree = RadixTree::new(TreeConfig::full_only(ps).with_mamba()).unwrap();
        let a = tokens(&[1, 2, 3], p);
        let b = tokens(&[1, 2, 4, 5], p);
        let value = |base: u32, n: usize| -> Vec<VirtualToken> {
            (base..base + n as u32).map(VirtualToken).collect()
        };
        let first = tree
            .insert(InsertRequest::new(&a, &value(100, a.len())).mamba(MambaSlot(1)))
            .unwrap();
        // The shared two pages are duplicates (freed by the insert's actions).
        let second = tree
            .insert(InsertRequest::new(&b, &value(200, b.len())).mamba(MambaSlot(2)))
            .unwrap();
        assert_eq!(tree.path_key(first.node).unwrap(), a, "ps {ps}");
        assert_eq!(tree.path_key(second.node).unwrap(), b, "ps {ps}");
        // The first leaf is the least recently used: named, not evicted.
        assert_eq!(
            tree.next_victim(Component::Full),
            Some(first.node),
            "ps {ps}"
        );
        assert_eq!(
            tree.next_victim(Component::Full),
            Some(first.node),
            "ps {ps}"
        );
        assert_eq!(
            tree.next_victim(Component::Mamba),
            Some(first.node),
            "ps {ps}"
        );
        let evicted = tree.evict_one(Component::Full).unwrap();
        assert!(
            matches!(evicted[0], Action::EvictNode { node, .. } if node == first.node),
            "ps {ps}: {evicted:?}"
        );
        assert_eq!(
            tree.next_victim(Component::Full),
            Some(second.node),
            "ps {ps}"
        );
        assert!(tree.path_key(first.node).is_err(), "ps {ps}: a stale id");
        tree.sanity_check().unwrap();
    }
}

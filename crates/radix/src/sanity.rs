//! `sanity_check`: recompute everything the tree keeps incrementally and compare.
//!
//! O(nodes + locks × depth): meant for tests, idle diagnostics and the strict level, never
//! for the scheduling path.

use crate::RadixTree;
use crate::error::RadixError;
use crate::invariants::SANITY;
use crate::tree::{Ix, NIL, ROOT, Sizes};
use std::collections::BTreeSet;

impl RadixTree {
    /// Recomputes structure, sizes, LRU membership and order, and lock counts from the
    /// nodes and the lock records, and compares them with what the tree recorded.
    ///
    /// A mismatch is recorded against the `radix.sanity` invariant in the tree's scope (a
    /// `Guard`: it fails [`unikv_invariants::Scope::poll`] at `Strict`) and returned as
    /// [`RadixError::Insane`].
    pub fn sanity_check(&self) -> Result<(), RadixError> {
        match self.recompute() {
            Ok(()) => Ok(()),
            Err(message) => {
                self.scope.expect(&SANITY, false, || message.clone());
                Err(RadixError::Insane(message))
            }
        }
    }

    /// Runs [`RadixTree::sanity_check`] when the invariant level is `Strict`, and does
    /// nothing otherwise: the step-boundary hook for callers that want the full walk only
    /// where it is affordable.
    pub fn sanity_check_at_strict(&self) -> Result<(), RadixError> {
        if unikv_invariants::level() == unikv_invariants::Level::Strict {
            self.sanity_check()
        } else {
            Ok(())
        }
    }

    /// Test hook: makes the recorded sizes disagree with the nodes (one FULL token too
    /// many evictable), so that [`RadixTree::sanity_check`] fails. Only with the `testing`
    /// feature, for crates that test what they do with an insane tree.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn corrupt_recorded_sizes(&mut self) {
        self.sizes.full_evictable.0 += 1;
    }

    fn recompute(&self) -> Result<(), String> {
        let ps = self.ps();
        let mut sizes = Sizes::default();
        let (mut full, mut swa, mut mamba) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        let mut alive = 0usize;
        for (i, n) in self.nodes.iter().enumerate() {
            let ix = i as Ix;
            if !n.alive {
                if ix == ROOT {
                    return Err("the root is not alive".into());
                }
                continue;
            }
            alive += 1;
            if ix != ROOT {
                if n.key.is_empty() || !n.key.len().is_multiple_of(ps) {
                    return Err(format!("n{ix}: key length {} not whole pages", n.key.len()));
                }
                if n.key.len() != n.value.len() {
                    return Err(format!("n{ix}: key/value lengths differ"));
                }
                let p = n.parent;
                if p == NIL || !self.nodes[p as usize].alive {
                    return Err(format!("n{ix}: parent n{p} is not alive"));
                }
                if self.nodes[p as usize].children.get(&n.key[..ps]) != Some(&ix) {
                    return Err(format!("n{ix}: parent n{p} does not list it"));
                }
            } else if n.parent != NIL || !n.key.is_empty() || n.full_lock != 0 {
                return Err("the root has a parent, a key or a lock".into());
            }
            for (k, &c) in &n.children {
                let child = &self.nodes[c as usize];
                if !child.alive || child.parent != ix || child.key.get(..ps) != Some(&k[..]) {
                    return Err(format!("n{ix}: child entry n{c} is inconsistent"));
                }
            }
            if !self.swa_enabled() && !n.swa_live {
                return Err(format!("n{ix}: tombstone in a tree without SWA"));
            }
            if !n.swa_live && n.swa_lock != 0 {
                return Err(format!("n{ix}: tombstone with SWA lock {}", n.swa_lock));
            }
            if n.full_lock < n.swa_lock {
                return Err(format!(
                    "n{ix}: FULL lock {} < SWA lock {}",
                    n.full_lock, n.swa_lock
                ));
            }
            if n.mamba_lock > 0 && (n.mamba.is_none() || n.full_lock < n.mamba_lock) {
                return Err(format!("n{ix}: Mamba lock without a state or FULL lock"));
            }
            if n.mamba_hit && n.mamba.is_none() {
                return Err(format!("n{ix}: a Mamba hit mark without a state"));
            }
            if n.mamba_grid && n.mamba.is_none() {
                return Err(format!("n{ix}: a grid-state mark without a state"));
            }
            // The root has no SWA: never marked.
            if ix != ROOT && n.swa_window != self.serves_a_window(ix) {
                return Err(format!(
                    "n{ix}: SWA window mark {}, but the states below it say {}",
                    n.swa_window, !n.swa_window
                ));
            }
            let c = self.contribution(ix);
            sizes.full_evictable.0 += c[0];
            sizes.full_protected.0 += c[1];
            sizes.swa_evictable.0 += c[2];
            sizes.swa_protected.0 += c[3];
            sizes.mamba_evictable.0 += c[4];
            sizes.mamba_protected.0 += c[5];
            let (f, w, m) = self.should_be_in(ix);
            if (f, w, m) != (n.in_full, n.in_swa, n.in_mamba) {
                return Err(format!(
                    "n{ix}: LRU membership (full, swa, mamba) recorded {:?}, expected {:?}",
                    (n.in_full, n.in_swa, n.in_mamba),
                    (f, w, m)
                ));
            }
            if f {
                full.insert((n.full_tick, ix));
            }
            if w {
                swa.insert((n.swa_key(), ix));
            }
            if m {
                mamba.insert((n.mamba_key(), ix));
            }
        }
        if alive != self.node_count() {
            return Err(format!(
                "{alive} live nodes but the free list implies {}",
                self.node_count()
            ));
        }
        if self.free.iter().any(|&f| self.nodes[f as usize].alive) {
            return Err("a free arena entry is alive".into());
        }
        let mut reachable = 0;
        let mut stack = vec![ROOT];
        while let Some(x) = stack.pop() {
            reachable += 1;
            stack.extend(self.nodes[x as usize].children.values().copied());
        }
        if reachable != alive {
            return Err(format!("{reachable} nodes reachable, {alive} alive"));
        }
        if sizes != self.sizes {
            return Err(format!(
                "sizes recorded {:?}, recomputed {:?}",
                self.sizes, sizes
            ));
        }
        for (name, recorded, expected) in [
            ("full", &self.full_lru, &full),
            ("swa", &self.swa_lru, &swa),
            ("mamba", &self.mamba_lru, &mamba),
        ] {
            if recorded != expected {
                return Err(format!(
                    "{name} LRU order recorded {recorded:?}, recomputed {expected:?}"
                ));
            }
        }
        self.recount_locks()
    }

    fn recount_locks(&self) -> Result<(), String> {
        let mut counts = vec![[0u32; 3]; self.nodes.len()];
        for (handle, record) in &self.locks {
            if !self.nodes[record.node as usize].alive {
                return Err(format!("lock#{handle} holds a dead node n{}", record.node));
            }
            let mut x = record.node;
            while x != ROOT {
                counts[x as usize][0] += 1;
                x = self.nodes[x as usize].parent;
            }
            if let Some(floor) = record.swa_floor {
                let mut start = self.start_of(record.node);
                let mut x = record.node;
                while x != ROOT && start >= floor {
                    counts[x as usize][1] += 1;
                    x = self.nodes[x as usize].parent;
                    start = start.saturating_sub(self.nodes[x as usize].len());
                    if x == ROOT {
                        break;
                    }
                }
            }
            if record.mamba {
                counts[record.node as usize][2] += 1;
            }
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.alive {
                continue;
            }
            let recorded = [n.full_lock, n.swa_lock, n.mamba_lock];
            if recorded != counts[i] {
                return Err(format!(
                    "n{i}: lock counts (full, swa, mamba) recorded {recorded:?}, the lock records give {:?}",
                    counts[i]
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::tree::ROOT;
    use crate::{InsertRequest, RadixError, RadixTree, TokenId, TreeConfig, VirtualToken};
    use unikv_invariants::{Error, Level, scoped_level};

    fn tree_with_two_paths() -> RadixTree {
        let mut tree = RadixTree::new(TreeConfig::swa(2, 4)).unwrap();
        for (first, base) in [(1, 100), (2, 200)] {
            let key: Vec<TokenId> = (0..8).map(|i| TokenId(first * 10 + i)).collect();
            let row: Vec<VirtualToken> = (base..base + 8).map(VirtualToken).collect();
            tree.insert(InsertRequest::new(&key, &row)).unwrap();
        }
        tree.sanity_check().unwrap();
        tree
    }

    /// The first child of the root (the test trees have two).
    fn first_child(t: &RadixTree) -> crate::tree::Ix {
        t.nodes[ROOT as usize]
            .children
            .values()
            .copied()
            .next()
            .unwrap()
    }

    /// Each corruption of recorded state is found, named, and recorded against
    /// `radix.sanity` in the tree's own scope (which fails its poll at `Strict`).
    #[test]
    fn sanity_check_finds_every_kind_of_corruption() {
        type Corrupt = fn(&mut RadixTree);
        let cases: [(&str, Corrupt); 12] = [
            ("sizes recorded", |t| t.sizes.full_evictable.0 += 1),
            ("LRU membership", |t| {
                let ix = t.full_lru.first().unwrap().1;
                t.nodes[ix as usize].in_full = false;
            }),
            ("full LRU order", |t| {
                let (tick, ix) = t.full_lru.pop_first().unwrap();
                t.full_lru.insert((tick + 1000, ix));
            }),
            ("lock counts", |t| {
                let ix = first_child(t);
                t.leave(ix);
                t.nodes[ix as usize].full_lock += 1;
                t.enter(ix);
            }),
            ("child entry", |t| {
                let ix = first_child(t);
                t.nodes[ix as usize].key[0] = TokenId(999);
            }),
            ("not whole pages", |t| {
                let ix = first_child(t);
                t.leave(ix);
                t.nodes[ix as usize].key.pop();
                let n = &mut t.nodes[ix as usize];
                n.value = n.value[..n.value.len() - 1].into();
                t.enter(ix);
            }),
            ("the root has a parent, a key or a lock", |t| {
                t.nodes[ROOT as usize].key.push(TokenId(1));
            }),
            ("FULL lock 0 < SWA lock 1", |t| {
                let ix = first_child(t);
                t.leave(ix);
                t.nodes[ix as usize].swa_lock = 1;
                t.enter(ix);
            }),
            ("Mamba lock without a state", |t| {
                let ix = first_child(t);
                t.leave(ix);
                t.nodes[ix as usize].mamba_lock = 1;
                t.nodes[ix as usize].full_lock = 1;
                t.enter(ix);
            }),
            ("a Mamba hit mark without a state", |t| {
                let ix = first_child(t);
                t.nodes[ix as usize].mamba_hit = true;
            }),
            ("is inconsistent", |t| {
                let ix = first_child(t);
                let other = t.nodes[ROOT as usize]
                    .children
                    .values()
                    .copied()
                    .find(|&c| c != ix)
                    .unwrap();
                // A child that names another node as its parent.
                t.nodes[ix as usize].parent = other;
            }),
            ("tombstone with SWA lock", |t| {
                let ix = first_child(t);
                t.leave(ix);
                t.nodes[ix as usize].swa_live = false;
                t.nodes[ix as usize].swa_lock = 1;
                t.nodes[ix as usize].full_lock = 1;
                t.enter(ix);
            }),
        ];
        // The step-boundary hook only walks at `Strict`.
        let mut corrupted = tree_with_two_paths();
        corrupted.sizes.swa_protected.0 += 1;
        scoped_level(Level::Warn, || {
            assert!(corrupted.sanity_check_at_strict().is_ok())
        });
        scoped_level(Level::Strict, || {
            assert!(corrupted.invariant_scope().poll().is_ok());
            assert!(corrupted.sanity_check_at_strict().is_err());
            assert!(
                tree_with_two_paths().invariant_scope().poll().is_ok(),
                "another tree's scope sees nothing"
            );
            assert!(corrupted.invariant_scope().poll().is_err());
            for (needle, corrupt) in cases {
                let mut tree = tree_with_two_paths();
                corrupt(&mut tree);
                match tree.sanity_check() {
                    Err(RadixError::Insane(message)) => {
                        assert!(message.contains(needle), "{needle}: {message}")
                    }
                    other => panic!("{needle}: not detected ({other:?})"),
                }
                match tree.invariant_scope().poll() {
                    Err(Error::Violated(v)) => {
                        assert_eq!(v.failures[0].name, "radix.sanity");
                    }
                    other => panic!("{needle}: poll gave {other:?}"),
                }
            }
        });
    }

    /// A node whose parent slot is dead is named for that, before the parent's missing
    /// child entry (the lower half of a split sits below its new parent in the arena, so
    /// it is checked before the parent's children are).
    #[test]
    fn a_node_whose_parent_is_dead_is_named() {
        let mut tree = RadixTree::new(TreeConfig::full_only(2)).unwrap();
        let key: Vec<TokenId> = (0..8).map(TokenId).collect();
        let row: Vec<VirtualToken> = (100..108).map(VirtualToken).collect();
        let lower = tree
            .insert(InsertRequest::new(&key, &row))
            .unwrap()
            .node
            .index;
        let other = [&key[..4], &[TokenId(50), TokenId(51)]].concat();
        tree.insert(InsertRequest::new(&other, &row[..6])).unwrap();
        assert!(tree.nodes[lower as usize].parent > lower, "{}", tree.dump());
        tree.nodes.push(crate::tree::Node::default());
        tree.nodes[lower as usize].parent = (tree.nodes.len() - 1) as crate::tree::Ix;
        let err = tree.sanity_check().unwrap_err().to_string();
        assert!(err.contains("is not alive"), "{err}");
    }

    /// The test hook breaks exactly the recorded FULL evictable size.
    #[cfg(feature = "testing")]
    #[test]
    fn the_corruption_hook_breaks_the_recorded_sizes() {
        let mut tree = tree_with_two_paths();
        let before = tree.sizes();
        tree.corrupt_recorded_sizes();
        assert_eq!(tree.sizes().full_evictable.0, before.full_evictable.0 + 1);
        let err = tree.sanity_check().unwrap_err().to_string();
        assert!(err.contains("sizes recorded"), "{err}");
    }
}

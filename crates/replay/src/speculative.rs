//! Speculative decoding in the replay (`--spec K`, `--spec-tree N`, `--spec-late`): what a
//! run drafts ([`SpecMode`], [`DraftShape`]), the fixed draft tree of `--spec-tree`
//! ([`tree_parents`]) and the seeded acceptance of each verify step ([`Acceptance`]).
//!
//! Every decode step of a running request becomes a verify step: the request's next token
//! and its drafts are allocated ([`unikv::HybridCache::alloc_verify`]), and the accepted
//! positions are settled ([`unikv::HybridCache::settle`]) in the same step, or with
//! `--spec-late` in the next one, after that step's verify was allocated (an overlap
//! scheduler learns the counts a step late). The accepted tokens are the workload's next
//! output tokens, so a request produces exactly the tokens it produces without
//! speculation, several per step.

use crate::error::ReplayError;
use serde::Serialize;
use std::fmt;
use unikv::{MAX_VERIFY_WIDTH, Speculation};
use unikv_workload::rng::SplitMix64;

/// The probability that a draft token is accepted given that the one before it was:
/// **0.85**. DeepSeek-V3 Technical Report (arXiv:2412.19437), §5.4.3: the acceptance rate
/// of the second token, predicted by the MTP module, is 85–90 % across generation topics.
/// The low end is taken, and the same rate is assumed at every depth
/// (a geometric accepted length), so a chain of `k` drafts keeps on average
/// `1 + p + p² + … + p^k` positions (3.71 for `k = 4`).
pub const ACCEPT_PROBABILITY: f64 = 0.85;

/// [`ACCEPT_PROBABILITY`] in parts per million: what a draw is compared with (integer
/// arithmetic, so every platform draws the same).
const ACCEPT_PPM: u64 = 850_000;

/// What a verify step drafts after the request's next token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DraftShape {
    /// A chain of `k` drafts (EAGLE, MTP): `1 + k` positions.
    Chain {
        /// Drafted tokens.
        k: u32,
    },
    /// A draft tree of `nodes` nodes, node 0 the request's next token, shaped by
    /// [`tree_parents`] (EAGLE-2/3 top-k trees).
    Tree {
        /// Nodes, the root included.
        nodes: u32,
    },
}

/// How a run speculates: its draft and whether counts arrive a step late.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SpecMode {
    /// What each verify step drafts.
    pub draft: DraftShape,
    /// Accepted counts are delivered one step late: each step's verify is allocated
    /// before the one before it is settled (two verify steps in flight per request).
    pub late: bool,
}

impl SpecMode {
    /// The most drafts a chain may have: `1 + k` positions fit [`MAX_VERIFY_WIDTH`].
    pub const MAX_CHAIN_DRAFTS: u32 = MAX_VERIFY_WIDTH - 1;

    /// Chain drafts of `k` tokens (`--spec K`), settled in the step: 1 ..=
    /// [`SpecMode::MAX_CHAIN_DRAFTS`], else [`ReplayError::BadSpeculation`].
    pub fn chain(k: u64) -> Result<SpecMode, ReplayError> {
        if !(1..=u64::from(Self::MAX_CHAIN_DRAFTS)).contains(&k) {
            return Err(ReplayError::BadSpeculation {
                option: "--spec",
                value: k,
                reason: format!(
                    "a chain drafts 1 to {} tokens (a verify step checks 1 + K positions, at \
                     most {MAX_VERIFY_WIDTH})",
                    Self::MAX_CHAIN_DRAFTS
                ),
            });
        }
        Ok(SpecMode {
            draft: DraftShape::Chain { k: k as u32 },
            late: false,
        })
    }

    /// A draft tree of `nodes` nodes (`--spec-tree N`), settled in the step: 2 ..=
    /// [`MAX_VERIFY_WIDTH`] (the root and at least one draft), else
    /// [`ReplayError::BadSpeculation`].
    pub fn tree(nodes: u64) -> Result<SpecMode, ReplayError> {
        if !(2..=u64::from(MAX_VERIFY_WIDTH)).contains(&nodes) {
            return Err(ReplayError::BadSpeculation {
                option: "--spec-tree",
                value: nodes,
                reason: format!(
                    "a draft tree has 2 to {MAX_VERIFY_WIDTH} nodes (the root, the request's \
                     next token, and at least one draft; a verify step checks every node)"
                ),
            });
        }
        Ok(SpecMode {
            draft: DraftShape::Tree {
                nodes: nodes as u32,
            },
            late: false,
        })
    }

    /// The same with counts delivered one step late (`--spec-late`).
    pub const fn late(self) -> SpecMode {
        SpecMode { late: true, ..self }
    }

    /// Positions one verify step checks: `1 + k`, or the tree's nodes.
    pub const fn width(&self) -> u32 {
        match self.draft {
            DraftShape::Chain { k } => k + 1,
            DraftShape::Tree { nodes } => nodes,
        }
    }

    /// What the cache is built for: this width, with two steps in flight when late.
    pub const fn speculation(&self) -> Speculation {
        let spec = match self.draft {
            DraftShape::Chain { k } => Speculation::chain(k),
            DraftShape::Tree { nodes } => Speculation::tree(nodes),
        };
        spec.in_flight(if self.late { 2 } else { 1 })
    }
}

impl fmt::Display for SpecMode {
    /// `chain of 4 drafts`, `tree of 6 nodes`, with `, counts a step late` when late.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.draft {
            DraftShape::Chain { k } => write!(f, "chain of {k} drafts")?,
            DraftShape::Tree { nodes } => write!(f, "tree of {nodes} nodes")?,
        }
        if self.late {
            f.write_str(", counts a step late")?;
        }
        Ok(())
    }
}

/// The parent array of `--spec-tree N`: the same for every request and step, a binary
/// tree in breadth-first order, node `i`'s parent `(i − 1) / 2` (node 0 the root, the
/// request's next token). Node `2j + 1` is node `j`'s top-1 candidate and `2j + 2` its
/// top-2, the shape of an EAGLE-2/3 top-k tree with `k = 2` expanded level by level:
/// `N = 6` gives `[-1, 0, 0, 1, 1, 2]`.
pub fn tree_parents(nodes: u32) -> Vec<i32> {
    (0..nodes as i32)
        .map(|i| if i == 0 { -1 } else { (i - 1) / 2 })
        .collect()
}

/// The seeded acceptance of verify steps: one generator per run, drawn in the scheduler's
/// (deterministic) order.
#[derive(Clone, Debug)]
pub struct Acceptance {
    rng: SplitMix64,
    /// Each node's children in rank order (a tree's), empty for a chain.
    children: Vec<Vec<u32>>,
}

impl Acceptance {
    /// The acceptance of `mode`'s verify steps under `seed`.
    pub fn new(seed: u64, mode: &SpecMode) -> Acceptance {
        let mut children = Vec::new();
        if let DraftShape::Tree { nodes } = mode.draft {
            children = vec![Vec::new(); nodes as usize];
            for (node, &parent) in tree_parents(nodes).iter().enumerate().skip(1) {
                children[parent as usize].push(node as u32);
            }
        }
        Acceptance {
            rng: SplitMix64::for_stream(seed, "speculative acceptance"),
            children,
        }
    }

    /// Whether the next draft is accepted (probability [`ACCEPT_PROBABILITY`]).
    fn accepts(&mut self) -> bool {
        self.rng.below(1_000_000) < ACCEPT_PPM
    }

    /// Positions a chain verify of `k` drafts keeps, at most `cap` (≥ 1): the first
    /// always, then each next draft while the draws accept.
    pub fn chain(&mut self, k: u32, cap: usize) -> usize {
        let mut accepted = 1;
        while accepted <= k as usize && accepted < cap && self.accepts() {
            accepted += 1;
        }
        accepted
    }

    /// The accepted root-to-node path of a tree verify, at most `cap` (≥ 1) nodes: from
    /// the root, each node's children are drafted in rank order, and the first one a
    /// draw accepts is the next node; the walk stops where no child is accepted.
    pub fn tree_path(&mut self, cap: usize, path: &mut Vec<u32>) {
        path.clear();
        path.push(0);
        let mut node = 0usize;
        'down: while path.len() < cap {
            for i in 0..self.children[node].len() {
                if self.accepts() {
                    node = self.children[node][i] as usize;
                    path.push(node as u32);
                    continue 'down;
                }
            }
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_draft_sizes_are_typed_errors_naming_the_option_and_the_range() {
        for (result, needle) in [
            (
                SpecMode::chain(0),
                "--spec 0: a chain drafts 1 to 63 tokens",
            ),
            (
                SpecMode::chain(64),
                "--spec 64: a chain drafts 1 to 63 tokens",
            ),
            (
                SpecMode::tree(1),
                "--spec-tree 1: a draft tree has 2 to 64 nodes",
            ),
            (
                SpecMode::tree(65),
                "--spec-tree 65: a draft tree has 2 to 64 nodes",
            ),
        ] {
            let err = result.unwrap_err();
            assert!(matches!(err, ReplayError::BadSpeculation { .. }), "{err:?}");
            assert!(err.to_string().starts_with(needle), "{err}");
        }
        assert_eq!(SpecMode::chain(63).unwrap().width(), 64);
        assert_eq!(SpecMode::tree(64).unwrap().width(), 64);
        let late = SpecMode::chain(4).unwrap().late();
        assert_eq!(late.speculation(), Speculation::chain(4).in_flight(2));
        assert_eq!(late.to_string(), "chain of 4 drafts, counts a step late");
        assert_eq!(SpecMode::tree(6).unwrap().to_string(), "tree of 6 nodes");
    }

    #[test]
    fn the_tree_is_binary_in_breadth_first_order() {
        assert_eq!(tree_parents(6), [-1, 0, 0, 1, 1, 2]);
        assert_eq!(tree_parents(2), [-1, 0]);
        // A valid parent array: every parent comes before its child.
        let parents = tree_parents(64);
        assert!(
            parents
                .iter()
                .enumerate()
                .skip(1)
                .all(|(i, &p)| (0..i as i32).contains(&p))
        );
    }

    /// The mean accepted length of a chain of 4 is 1 + p + p² + p³ + p⁴ ≈ 3.71, and a
    /// cap is never passed; a tree path is a root-to-node path of the tree.
    #[test]
    fn acceptance_is_geometric_capped_and_deterministic() {
        let mode = SpecMode::chain(4).unwrap();
        let mut a = Acceptance::new(7, &mode);
        let n = 100_000;
        let total: usize = (0..n).map(|_| a.chain(4, usize::MAX)).sum();
        let mean = total as f64 / n as f64;
        let expected: f64 = (0..=4).map(|i| ACCEPT_PROBABILITY.powi(i)).sum();
        assert!((mean - expected).abs() < 0.02, "{mean} vs {expected}");
        assert!((0..1000).all(|_| (1..=2).contains(&a.chain(4, 2))));
        assert_eq!(a.chain(4, 1), 1);
        let draws = |seed| {
            let mut a = Acceptance::new(seed, &mode);
            (0..64).map(|_| a.chain(4, 5)).collect::<Vec<_>>()
        };
        assert_eq!(draws(3), draws(3));
        assert_ne!(draws(3), draws(4));

        let tree = SpecMode::tree(6).unwrap();
        let parents = tree_parents(6);
        let mut a = Acceptance::new(1, &tree);
        let mut path = Vec::new();
        let mut seen_second_child = false;
        for _ in 0..1000 {
            a.tree_path(usize::MAX, &mut path);
            assert_eq!(path[0], 0);
            for w in path.windows(2) {
                assert_eq!(parents[w[1] as usize], w[0] as i32, "{path:?}");
            }
            seen_second_child |= path.contains(&2) || path.contains(&4);
            a.tree_path(2, &mut path);
            assert!((1..=2).contains(&path.len()));
        }
        assert!(seen_second_child, "top-2 candidates are accepted too");
    }
}

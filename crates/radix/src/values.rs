//! [`PathValues`]: the values of a path handed out without copying a token.
//!
//! Every node keeps its values in one shared slice (`Arc<[VirtualToken]>`), so a match
//! (or [`crate::RadixTree::values_from`]) returns one reference-counted run per node of
//! the path, as SGLang's Rust tree core's `PageValue` does, instead of a fresh vector of
//! every token. A run is a snapshot: a later split or revival gives the node a new slice
//! and leaves the runs already handed out as they were.

use crate::VirtualToken;
use std::ops::Range;
use std::sync::Arc;

/// The values of consecutive nodes of one path, in path order, shared with the tree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PathValues {
    runs: Vec<ValueRun>,
    len: usize,
}

/// Part of one node's values.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ValueRun {
    values: Arc<[VirtualToken]>,
    range: Range<usize>,
}

impl PathValues {
    /// Appends `values[range]` (a node's, shared).
    pub(crate) fn push(&mut self, values: &Arc<[VirtualToken]>, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        self.len += range.len();
        self.runs.push(ValueRun {
            values: Arc::clone(values),
            range,
        });
    }

    /// Tokens in all.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runs, one slice per node of the path.
    pub fn runs(&self) -> impl Iterator<Item = &[VirtualToken]> {
        self.runs.iter().map(|r| &r.values[r.range.clone()])
    }

    /// Every token, in path order.
    pub fn iter(&self) -> impl Iterator<Item = VirtualToken> + '_ {
        self.runs().flat_map(|run| run.iter().copied())
    }

    /// Every token, copied into one vector.
    pub fn to_vec(&self) -> Vec<VirtualToken> {
        let mut out = Vec::with_capacity(self.len);
        for run in self.runs() {
            out.extend_from_slice(run);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_share_their_slices_and_flatten_in_order() {
        let a: Arc<[VirtualToken]> = (0..4).map(VirtualToken).collect();
        let b: Arc<[VirtualToken]> = (10..14).map(VirtualToken).collect();
        let mut p = PathValues::default();
        p.push(&a, 0..4);
        p.push(&b, 1..3);
        p.push(&b, 2..2);
        assert_eq!(p.len(), 6);
        assert_eq!(Arc::strong_count(&a), 2, "shared, not copied");
        assert_eq!(p.runs().count(), 2, "an empty range adds no run");
        let want: Vec<VirtualToken> = [0, 1, 2, 3, 11, 12].map(VirtualToken).to_vec();
        assert_eq!(p.to_vec(), want);
        assert_eq!(p.iter().collect::<Vec<_>>(), want);
        assert!(PathValues::default().is_empty());
    }
}

//! `match_prefix`: the longest cached prefix a request may reuse.
//!
//! The walk follows FULL as far as the key matches (splitting the last node at a page
//! boundary when the match ends inside it). A node is a valid end when every component
//! accepts it: SWA needs a whole window of live SWA right behind the end unless the path
//! from the root is live all the way (a tombstone resets the running length to zero and is
//! never an end); Mamba needs a state on the node whose write is published. The FULL hit beyond the last valid end
//! is reported as a branching length, and with Mamba also aligned down to the checkpoint
//! grid (where a checkpointed state would extend future matches).

use crate::tree::{Ix, ROOT};
use crate::{NodeId, PathValues, RadixTree, TokenId, Tokens};

/// The result of [`RadixTree::match_prefix`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchResult {
    /// The deepest valid end (the root when nothing is reusable): lock this node.
    pub node: NodeId,
    /// Matched (reusable) length: the end of `node`.
    pub len: Tokens,
    /// The values of `[0, len)`: what the request's row starts with, shared with the
    /// tree's nodes (no token copied).
    pub values: PathValues,
    /// The deepest node the FULL walk reached (its end is `full_hit`).
    pub full_hit_node: NodeId,
    /// Page-aligned length of the FULL hit (≥ `len`).
    pub full_hit: Tokens,
    /// `Some(full_hit)` when the FULL hit is longer than the valid match: the position
    /// where a later insert can branch so that future requests reuse more.
    pub branching: Option<Tokens>,
    /// With Mamba, where a checkpointed state would let future requests reuse more: the
    /// FULL hit aligned down to [`crate::TreeConfig::mamba_grid`] (the checkpoint interval,
    /// else the page size), when that is still longer than `len`; `None` otherwise and
    /// without Mamba. The reference engine's `mamba_branching_seqlen`.
    pub mamba_branching: Option<Tokens>,
}

/// Length of the common prefix of `a` and `b`, floored to whole pages of `ps`.
pub(crate) fn common_pages(a: &[TokenId], b: &[TokenId], ps: usize) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    // Compare in chunks: the compiler vectorises slice equality well.
    const CHUNK: usize = 64;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i / ps * ps
}

impl RadixTree {
    /// Finds the longest reusable prefix of `key` (only whole pages count) and refreshes
    /// the LRU positions it used: FULL along the walked path, SWA from the end upward
    /// within `W + ps` tokens, Mamba on the end only.
    ///
    /// Takes `&mut self` because a match that ends inside a node splits it there.
    pub fn match_prefix(&mut self, key: &[TokenId]) -> MatchResult {
        let ps = self.ps();
        let key_len = key.len() / ps * ps;
        let key = &key[..key_len];
        let mut path: Vec<(Ix, usize)> = Vec::new(); // (node, end position)
        let mut pos = 0;
        let mut x = ROOT;
        while pos < key_len {
            let Some(&child) = self.nodes[x as usize].children.get(&key[pos..pos + ps]) else {
                break;
            };
            let c = common_pages(&self.nodes[child as usize].key, &key[pos..], ps);
            if c < self.nodes[child as usize].len() {
                let upper = self.split(child, c);
                pos += c;
                path.push((upper, pos));
                break;
            }
            pos += c;
            path.push((child, pos));
            x = child;
        }
        let full_hit = pos;
        let full_hit_ix = path.last().map_or(ROOT, |&(ix, _)| ix);

        // Validity walk.
        let window = self.window();
        let mut running = usize::MAX;
        let mut best = (ROOT, 0usize, 0usize); // (node, end, path index + 1)
        for (i, &(ix, end)) in path.iter().enumerate() {
            let n = &self.nodes[ix as usize];
            let mut valid = true;
            if self.swa_enabled() {
                if n.swa_live {
                    running = running.saturating_add(n.len());
                    valid = running >= window;
                } else {
                    running = 0;
                    valid = false;
                }
            }
            if self.config.mamba && !self.holds_ready_state(ix) {
                valid = false;
            }
            if valid {
                best = (ix, end, i + 1);
            }
        }
        let (best_ix, best_len, best_count) = best;
        let mut values = PathValues::default();
        for &(ix, _) in &path[..best_count] {
            let value = &self.nodes[ix as usize].value;
            values.push(value, 0..value.len());
        }

        let t = self.tick();
        for &(ix, _) in &path {
            self.with_node(ix, |n| n.full_tick = t);
        }
        self.touch_swa_window(best_ix, t);
        if best_ix != ROOT {
            self.with_node(best_ix, |n| n.mamba_tick = t);
        }

        MatchResult {
            node: self.id(best_ix),
            len: Tokens(best_len),
            values,
            full_hit_node: self.id(full_hit_ix),
            full_hit: Tokens(full_hit),
            branching: (full_hit > best_len).then_some(Tokens(full_hit)),
            mamba_branching: self.mamba_branching(full_hit, best_len),
        }
    }

    /// The FULL hit aligned down to the Mamba grid, when Mamba is on and that is still
    /// past the valid match.
    fn mamba_branching(&self, full_hit: usize, matched: usize) -> Option<Tokens> {
        if !self.config.mamba {
            return None;
        }
        let grid = self.config.mamba_grid().0; // ≥ ps ≥ 1: `new` refused anything else
        let aligned = full_hit / grid * grid;
        (aligned > matched).then_some(Tokens(aligned))
    }

    /// How many tokens of `key` (whole pages) the tree holds on FULL, without splitting a
    /// node or refreshing an LRU position: a side-effect-free estimate for admission.
    pub fn full_hit_len(&self, key: &[TokenId]) -> Tokens {
        let ps = self.ps();
        let key = &key[..key.len() / ps * ps];
        let mut pos = 0;
        let mut x = ROOT;
        while pos < key.len() {
            let Some(&child) = self.nodes[x as usize].children.get(&key[pos..pos + ps]) else {
                break;
            };
            let n = &self.nodes[child as usize];
            let c = common_pages(&n.key, &key[pos..], ps);
            pos += c;
            if c < n.len() {
                break;
            }
            x = child;
        }
        Tokens(pos)
    }

    /// Refreshes the SWA ticks of `ix` and its ancestors within `W + ps` tokens (further
    /// ancestors are outside any window that could use them and stay evictable).
    pub(crate) fn touch_swa_window(&mut self, ix: Ix, t: u64) {
        if !self.swa_enabled() {
            return;
        }
        let span = self.window() + self.ps();
        let mut covered = 0;
        let mut x = ix;
        while x != ROOT && covered < span {
            self.with_node(x, |n| n.swa_tick = t);
            covered += self.nodes[x as usize].len();
            x = self.nodes[x as usize].parent;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::common_pages;
    use crate::TokenId;

    /// Long keys are compared a chunk at a time: a difference inside the first chunk, or
    /// in a later one, ends the common prefix exactly there.
    #[test]
    fn long_keys_are_compared_exactly_across_chunks() {
        let a: Vec<TokenId> = (0..300).map(TokenId).collect();
        for (differ_at, ps, expected) in [(10, 1, 10), (10, 4, 8), (130, 1, 130), (299, 16, 288)] {
            let mut b = a.clone();
            b[differ_at] = TokenId(9_999);
            assert_eq!(common_pages(&a, &b, ps), expected, "differ at {differ_at}");
        }
        assert_eq!(common_pages(&a, &a, 1), 300);
    }

    #[test]
    fn common_prefix_is_floored_to_whole_pages() {
        let t = |v: &[u32]| v.iter().copied().map(TokenId).collect::<Vec<_>>();
        let a = t(&[1, 2, 3, 4, 5, 6, 7]);
        // (other, page size, expected)
        let cases = [
            (t(&[1, 2, 3, 4, 5, 6, 7]), 1, 7),
            (t(&[1, 2, 3, 4, 5, 6, 7]), 2, 6),
            (t(&[1, 2, 3, 9]), 1, 3),
            (t(&[1, 2, 3, 9]), 2, 2),
            (t(&[1, 2, 3, 9]), 4, 0),
            (t(&[]), 1, 0),
        ];
        for (b, ps, expected) in cases {
            assert_eq!(common_pages(&a, &b, ps), expected, "{b:?} at ps {ps}");
        }
        let long: Vec<TokenId> = (0..1000).map(TokenId).collect();
        let mut other = long.clone();
        other[777] = TokenId(0);
        assert_eq!(common_pages(&long, &other, 16), 768);
    }
}

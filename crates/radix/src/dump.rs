//! A readable, deterministic dump of the tree for snapshots and debugging.
//!
//! One line per node (children in key order), then the three LRU orders, least recently
//! used first. Ticks are not printed: the orders say everything they mean.

use crate::tree::{Ix, ROOT};
use crate::{RadixTree, TokenId, VirtualToken};
use std::fmt::Write;

/// Writes up to 12 tokens, then an ellipsis and the count.
fn tokens(key: &[TokenId]) -> String {
    let shown: Vec<String> = key.iter().take(12).map(|t| t.0.to_string()).collect();
    let mut s = shown.join(" ");
    if key.len() > 12 {
        let _ = write!(s, " … ({} tokens)", key.len());
    }
    s
}

/// Writes values as runs of consecutive ids: `100..104 7 9..11`.
pub(crate) fn values(value: &[VirtualToken]) -> String {
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < value.len() {
        let mut j = i;
        while j + 1 < value.len() && value[j + 1].0 == value[j].0 + 1 {
            j += 1;
        }
        runs.push(if j == i {
            value[i].0.to_string()
        } else {
            format!("{}..{}", value[i].0, value[j].0 + 1)
        });
        i = j + 1;
    }
    runs.join(" ")
}

impl RadixTree {
    /// A readable dump: configuration, sizes, one line per node, LRU orders.
    pub fn dump(&self) -> String {
        let c = &self.config;
        let s = self.sizes;
        let mut out = String::new();
        let window = c.window.map_or("none".to_string(), |w| w.0.to_string());
        let mut mamba = if c.mamba { "on" } else { "off" }.to_string();
        if let Some(cap) = c.mamba_path_cap {
            let _ = write!(mamba, " path_cap={cap}");
        }
        if let Some(interval) = c.mamba_checkpoint_interval {
            let _ = write!(mamba, " ckpt={}", interval.0);
        }
        let _ = writeln!(
            out,
            "tree ps={} W={} mamba={} nodes={} locks={}",
            c.page_size,
            window,
            mamba,
            self.node_count(),
            self.locks.len()
        );
        let _ = writeln!(
            out,
            "sizes full {}+{}p swa {}+{}p mamba {}+{}p (evictable+protected)",
            s.full_evictable.0,
            s.full_protected.0,
            s.swa_evictable.0,
            s.swa_protected.0,
            s.mamba_evictable.0,
            s.mamba_protected.0
        );
        self.dump_node(ROOT, 0, "", &mut out);
        for (name, set) in [
            ("full", &self.full_lru),
            ("swa", &self.swa_lru),
            ("mamba", &self.mamba_lru),
        ] {
            let order: Vec<String> = set.iter().map(|&(_, ix)| format!("n{ix}")).collect();
            let _ = writeln!(out, "lru {name}: [{}]", order.join(" "));
        }
        out
    }

    fn dump_node(&self, ix: Ix, start: usize, indent: &str, out: &mut String) {
        let n = &self.nodes[ix as usize];
        if ix == ROOT {
            let _ = writeln!(out, "n0 root");
        } else {
            let swa = if !self.swa_enabled() {
                ""
            } else if n.swa_live {
                " live"
            } else {
                " TOMB"
            };
            let mut line = format!(
                "{indent}n{ix} [{start}..{}) key {} = v {}{swa}",
                start + n.len(),
                tokens(&n.key),
                values(&n.value)
            );
            if n.full_lock > 0 || n.swa_lock > 0 {
                let _ = write!(line, " lock full={} swa={}", n.full_lock, n.swa_lock);
            }
            if let Some(slot) = n.mamba {
                let _ = write!(line, " mamba=s{}", slot.0);
                if n.mamba_lock > 0 {
                    let _ = write!(line, "(lock {})", n.mamba_lock);
                }
            }
            let _ = writeln!(out, "{line}");
        }
        let child_indent = format!("{indent}  ");
        let end = start + n.len();
        for c in self.sorted_children(ix) {
            self.dump_node(c, end, &child_indent, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_past_twelve_tokens_are_shortened() {
        let key = |n: u32| (0..n).map(TokenId).collect::<Vec<_>>();
        assert_eq!(tokens(&key(12)), "0 1 2 3 4 5 6 7 8 9 10 11");
        assert_eq!(tokens(&key(13)), "0 1 2 3 4 5 6 7 8 9 10 11 … (13 tokens)");
    }
}

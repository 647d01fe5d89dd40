//! Eviction per component, least recently used first, O(log n) per evicted node.
//!
//! - FULL: the LRU unlocked leaf leaves the tree whole (`EvictNode`, plus its Mamba state);
//!   its parent may become an evictable leaf in turn.
//! - SWA: the LRU unlocked live node is evicted whole when it is an unlocked leaf,
//!   otherwise tombstoned (`TombstoneSwa`, its unlocked Mamba state cascades).
//! - MAMBA: the LRU unlocked state is freed (`EvictMambaState`); the KV under it stays.

use crate::action::SwaSide;
use crate::tree::Ix;
use crate::{Action, Component, RadixTree, Released};

impl RadixTree {
    /// Evicts one node's worth of `component` and returns the actions, or `None` when
    /// nothing of that component is evictable.
    pub fn evict_one(&mut self, component: Component) -> Option<Vec<Action>> {
        let mut actions = Vec::new();
        match component {
            Component::Full => {
                let &(_, ix) = self.full_lru.first()?;
                self.evict_leaf(ix, &mut actions);
            }
            Component::Swa => {
                let &(_, ix) = self.swa_lru.first()?;
                let n = &self.nodes[ix as usize];
                if n.children.is_empty() && n.full_lock == 0 && !n.mamba_in_flight {
                    self.evict_leaf(ix, &mut actions);
                } else {
                    self.tombstone(ix, &mut actions);
                }
            }
            Component::Mamba => {
                // Only the state: the KV under it stays a FULL hit that a later request
                // branching there saves a state for (and FULL's own LRU evicts it).
                let &(_, ix) = self.mamba_lru.first()?;
                self.evict_mamba(ix, &mut actions);
            }
        }
        Some(actions)
    }

    /// The node [`RadixTree::evict_one`] would evict next for `component` (a FULL leaf,
    /// an SWA node, a state's node), without evicting it: what a host tier writes back
    /// first. `None` when nothing of that component is evictable.
    pub fn next_victim(&self, component: Component) -> Option<crate::NodeId> {
        let set = match component {
            Component::Full => &self.full_lru,
            Component::Swa => &self.swa_lru,
            Component::Mamba => &self.mamba_lru,
        };
        set.first().map(|&(_, ix)| self.id(ix))
    }

    /// Evicts `component` node by node until `done(released so far)` holds (checked before
    /// every step, so an already satisfied predicate evicts nothing) or nothing evictable
    /// is left. Returns every step's actions, in order, and what they release.
    pub fn evict_until(
        &mut self,
        component: Component,
        mut done: impl FnMut(&Released) -> bool,
    ) -> (Vec<Action>, Released) {
        let mut actions = Vec::new();
        let mut released = Released::default();
        while !done(&released) {
            let Some(step) = self.evict_one(component) else {
                break;
            };
            released.add(Released::of(&step));
            actions.extend(step);
        }
        (actions, released)
    }

    fn evict_leaf(&mut self, ix: Ix, actions: &mut Vec<Action>) {
        let id = self.id(ix);
        let node = self.remove_leaf(ix);
        actions.push(Action::EvictNode {
            node: id,
            tokens: node.value.to_vec(),
            swa: if !self.swa_enabled() || node.swa_live {
                SwaSide::Live
            } else {
                SwaSide::Tombstone
            },
        });
        if let Some(slot) = node.mamba {
            actions.push(Action::EvictMambaState { node: id, slot });
        }
    }

    fn tombstone(&mut self, ix: Ix, actions: &mut Vec<Action>) {
        let id = self.id(ix);
        let tokens = self.with_node(ix, |n| {
            n.swa_live = false;
            n.value.to_vec()
        });
        actions.push(Action::TombstoneSwa { node: id, tokens });
        if self.nodes[ix as usize].mamba.is_some() && self.state_unpinned(ix) {
            self.evict_mamba(ix, actions);
        }
    }

    pub(crate) fn evict_mamba(&mut self, ix: Ix, actions: &mut Vec<Action>) {
        let id = self.id(ix);
        if let Some(slot) = self.with_node(ix, |n| {
            n.mamba_in_flight = false;
            n.mamba_hit = false;
            n.mamba_grid = false;
            n.mamba.take()
        }) {
            actions.push(Action::EvictMambaState { node: id, slot });
        }
    }
}

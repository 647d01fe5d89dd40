//! Locks: FULL on the whole path to the root, SWA on one window upward, and the Mamba
//! state at the node for a lock that reads it ([`RadixTree::lock`], a request being
//! admitted); an insert's lock, held by a request that runs on its own state, leaves the
//! state an ordinary cache entry.
//!
//! A lock is recorded in the tree under a never-reused handle. The window part remembers
//! the start position of the highest node it covers (its boundary): node splits copy lock
//! counts onto the new upper part and keep positions, so releasing "every node on the path
//! that starts at or above the boundary" undoes exactly what the lock did, however the
//! path was split in between.

use crate::error::RadixError;
use crate::invariants::{FULL_LOCKS_COVER_SWA_LOCKS, LOCK_UNDERFLOW};
use crate::tree::{Ix, LockRecord, ROOT};
use crate::{LockHandle, NodeId, RadixTree, Tokens};

/// What a lock does to the Mamba state at its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Pinned: the lock's holder copies it (an admission).
    Pinned,
    /// Left evictable: the holder runs on its own state slot, so the cached one serves
    /// only later requests, like any other cache entry.
    Unpinned,
}

impl RadixTree {
    /// Locks `node` for a request that uses the prefix ending there: FULL on every node up
    /// to the root, SWA on the live nodes covering one window upward from the node (fewer
    /// when the root or a tombstone comes first), and the node's Mamba state if it has one,
    /// which is then marked as copied by an admission: a state that served reuse, which
    /// the Mamba path cap keeps over ones that served none
    /// ([`crate::TreeConfig::mamba_path_cap`]). Locked parts are protected: no eviction
    /// touches them.
    pub fn lock(&mut self, node: NodeId) -> Result<LockHandle, RadixError> {
        let ix = self.resolve(node)?;
        Ok(self.lock_ix(ix, State::Pinned, self.window()))
    }

    /// Locks `node` for a forward that has yet to read the window behind a stretch of
    /// tokens ending there: FULL on every node up to the root, and SWA on the live nodes
    /// covering `reach` tokens upward from the node (at least one window). The node's
    /// Mamba state stays evictable. A chunk cached before its step's forward runs needs
    /// its length plus one window ([`RadixTree::unlock`] when the forward is launched).
    pub fn lock_reaching(&mut self, node: NodeId, reach: Tokens) -> Result<LockHandle, RadixError> {
        let ix = self.resolve(node)?;
        let reach = reach.0.max(self.window());
        Ok(self.lock_ix(ix, State::Unpinned, reach))
    }

    /// Locks `ix` (see [`RadixTree::lock`]), its window part covering `reach` tokens.
    pub(crate) fn lock_ix(&mut self, ix: Ix, state: State, reach: usize) -> LockHandle {
        let mut x = ix;
        while x != ROOT {
            self.with_node(x, |n| n.full_lock += 1);
            x = self.nodes[x as usize].parent;
        }
        let mut swa_floor = None;
        if self.swa_enabled() && ix != ROOT {
            let mut start = self.start_of(ix);
            let mut covered = 0;
            let mut x = ix;
            while x != ROOT && covered < reach && self.nodes[x as usize].swa_live {
                self.with_node(x, |n| n.swa_lock += 1);
                let n = &self.nodes[x as usize];
                self.scope.expect(
                    &FULL_LOCKS_COVER_SWA_LOCKS,
                    n.full_lock >= n.swa_lock,
                    || {
                        format!(
                            "lock: node n{x} has FULL lock {} < SWA lock {}",
                            n.full_lock, n.swa_lock
                        )
                    },
                );
                covered += n.len();
                swa_floor = Some(start);
                x = n.parent;
                if x != ROOT {
                    start -= self.nodes[x as usize].len();
                }
            }
        }
        let mamba = state == State::Pinned && self.nodes[ix as usize].mamba.is_some();
        if mamba {
            self.with_node(ix, |n| {
                n.mamba_lock += 1;
                n.mamba_hit = true;
            });
        }
        let handle = self.next_lock;
        self.next_lock += 1;
        self.locks.insert(
            handle,
            LockRecord {
                node: ix,
                swa_floor,
                window_released: false,
                mamba,
            },
        );
        LockHandle(handle)
    }

    /// Releases a lock taken by [`RadixTree::lock`] (or an insert with `lock`): all of its
    /// FULL, SWA and Mamba parts. A handle released twice is an error (tree unchanged).
    pub fn unlock(&mut self, handle: LockHandle) -> Result<(), RadixError> {
        let record = self
            .locks
            .remove(&handle.0)
            .ok_or(RadixError::UnknownLock(handle))?;
        if let Some(floor) = record.swa_floor {
            self.release_swa(record.node, floor);
        }
        if record.mamba {
            let ok = self.scope.expect(
                &LOCK_UNDERFLOW,
                self.nodes[record.node as usize].mamba_lock > 0,
                || format!("unlock: Mamba lock of n{} is already 0", record.node),
            );
            if ok {
                self.with_node(record.node, |n| n.mamba_lock -= 1);
            }
        }
        let mut x = record.node;
        while x != ROOT {
            let n = &self.nodes[x as usize];
            let ok = self.scope.expect(&LOCK_UNDERFLOW, n.full_lock > 0, || {
                format!("unlock: FULL lock of n{x} is already 0")
            });
            if ok {
                self.with_node(x, |n| n.full_lock -= 1);
            }
            x = self.nodes[x as usize].parent;
        }
        Ok(())
    }

    /// Releases only the window (SWA) part of a lock, once decoding has moved past the
    /// window: FULL (and Mamba) stay locked until [`RadixTree::unlock`].
    pub fn release_window(&mut self, handle: LockHandle) -> Result<(), RadixError> {
        let record = self
            .locks
            .get_mut(&handle.0)
            .ok_or(RadixError::UnknownLock(handle))?;
        if record.window_released {
            return Err(RadixError::WindowAlreadyReleased(handle));
        }
        record.window_released = true;
        let node = record.node;
        if let Some(floor) = record.swa_floor.take() {
            self.release_swa(node, floor);
        }
        Ok(())
    }

    /// Decrements the SWA lock of every node on the path from `ix` up that starts at or
    /// below position `floor` counted from the root (i.e. at or after `floor`).
    fn release_swa(&mut self, ix: Ix, floor: usize) {
        let mut start = self.start_of(ix);
        let mut x = ix;
        while x != ROOT {
            let n = &self.nodes[x as usize];
            let ok = self.scope.expect(&LOCK_UNDERFLOW, n.swa_lock > 0, || {
                format!("release: SWA lock of n{x} is already 0")
            });
            if ok {
                self.with_node(x, |n| n.swa_lock -= 1);
            }
            if start <= floor {
                break;
            }
            x = self.nodes[x as usize].parent;
            start -= self.nodes[x as usize].len();
        }
    }
}

//! Zero-copy export of tables (a leaf shared by the backends): the guard an export hands
//! out, and the bookkeeping that keeps a freed table's memory until every guard of it is
//! gone, so a reader holding an export never reads released memory.
//!
//! A backend asks [`Exports::guard`] for a table's guard when it exports the table,
//! passes every freed table through [`Exports::retire`] (which keeps the memory while a
//! guard of it lives) and releases what [`Exports::reap`] hands back at its set-up ops
//! (allocations, frees, step boundaries): never on the op path.

use std::sync::{Arc, Weak};

/// Keeps an exported table's memory allocated while it lives, even after the table is
/// freed (or replaced by a larger one): the memory is released at the device's first
/// allocation, free or step boundary after the last guard of it drops, or when the
/// device drops. Opaque; clone the `Arc` to share it.
#[derive(Debug)]
pub struct ExportGuard {
    _private: (),
}

/// The exported tables of one device and the freed ones whose memory is still guarded.
#[derive(Debug)]
pub(crate) struct Exports<T> {
    /// `(table handle, its guard)` for every table exported and not yet freed.
    live: Vec<(u32, Weak<ExportGuard>)>,
    /// Freed tables' memory, kept while a guard lives.
    retired: Vec<(Weak<ExportGuard>, T)>,
}

impl<T> Default for Exports<T> {
    fn default() -> Exports<T> {
        Exports {
            live: Vec::new(),
            retired: Vec::new(),
        }
    }
}

impl<T> Exports<T> {
    /// The guard of table `id` (the one already handed out while it lives, else a new one).
    pub(crate) fn guard(&mut self, id: u32) -> Arc<ExportGuard> {
        self.live.retain(|(_, g)| g.strong_count() > 0);
        if let Some(guard) = self
            .live
            .iter()
            .find(|(t, _)| *t == id)
            .and_then(|(_, g)| g.upgrade())
        {
            return guard;
        }
        let guard = Arc::new(ExportGuard { _private: () });
        self.live.push((id, Arc::downgrade(&guard)));
        guard
    }

    /// Table `id` was freed and `memory` is what held it: handed back to release now when
    /// no guard of it lives, else kept (and `None` returned) until [`Exports::reap`].
    pub(crate) fn retire(&mut self, id: u32, memory: T) -> Option<T> {
        let Some(at) = self.live.iter().position(|(t, _)| *t == id) else {
            return Some(memory);
        };
        let (_, guard) = self.live.swap_remove(at);
        if guard.strong_count() == 0 {
            return Some(memory);
        }
        self.retired.push((guard, memory));
        None
    }

    /// The retired memory no guard holds any more, to release now.
    pub(crate) fn reap(&mut self) -> Vec<T> {
        if self.retired.is_empty() {
            return Vec::new();
        }
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|(g, _)| g.strong_count() == 0);
        self.retired = kept;
        gone.into_iter().map(|(_, memory)| memory).collect()
    }

    /// Every retired memory, guarded or not (the device's tear-down).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.live.clear();
        self.retired.drain(..).map(|(_, memory)| memory)
    }

    /// How many freed tables' memory is still kept for a guard.
    #[cfg(test)]
    pub(crate) fn retained(&self) -> usize {
        self.retired.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guarded_table_is_kept_until_its_last_guard_drops() {
        let mut exports = Exports::default();
        let a = exports.guard(3);
        let b = exports.guard(3);
        assert!(Arc::ptr_eq(&a, &b), "one guard per live table");
        assert_eq!(exports.retire(3, "memory of 3"), None);
        assert_eq!(exports.retire(4, "memory of 4"), Some("memory of 4"));
        drop(a);
        assert!(exports.reap().is_empty());
        drop(b);
        assert_eq!(exports.reap(), ["memory of 3"]);
        assert_eq!(exports.retained(), 0);
        let c = exports.guard(5);
        drop(c);
        assert_eq!(exports.retire(5, "memory of 5"), Some("memory of 5"));
    }
}

//! Per-invariant violation counters shared between recording threads and the poller.
//!
//! This file is also compiled into the loom model (`tests/loom_counters.rs`), so it only
//! depends on `crate::sync` and has no constructor (each side builds the fields with its
//! own atomics: const std atomics here, loom's in the model).

use crate::sync::{AtomicU64, Ordering};

/// Violation counters of one invariant.
#[derive(Debug)]
pub(crate) struct Counters {
    /// Every violation ever recorded.
    pub(crate) total: AtomicU64,
    /// Violations recorded since the last [`Counters::take_unpolled`].
    pub(crate) unpolled: AtomicU64,
}

impl Counters {
    /// Records `n` violations; returns the total before them, which decides logging.
    pub(crate) fn record(&self, n: u64) -> u64 {
        // Order between the two counters does not matter: `total` is a statistic and
        // `unpolled` is drained by swap, so no increment is lost or seen twice.
        self.unpolled.fetch_add(n, Ordering::AcqRel);
        self.total.fetch_add(n, Ordering::Relaxed)
    }

    /// Takes the violations recorded since the last call (each is returned exactly once).
    pub(crate) fn take_unpolled(&self) -> u64 {
        self.unpolled.swap(0, Ordering::AcqRel)
    }

    /// Every violation ever recorded.
    pub(crate) fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// Whether recording `n` violations on top of `before` crosses a logging point: the
/// first violation, then every `every`-th.
pub(crate) fn crosses_log_point(before: u64, n: u64, every: u64) -> bool {
    n > 0 && (before == 0 || before / every != (before + n) / every)
}

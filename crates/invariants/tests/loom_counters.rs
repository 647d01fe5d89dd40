//! Loom model of the per-invariant counters: concurrent recorders and a concurrent
//! poller never lose or double-count a violation, and exactly one recorder logs the
//! first hit. Run with `RUSTFLAGS="--cfg unikv_loom" cargo test -p unikv-invariants
//! --test loom_counters --release` (`cargo xtask ci` does).
#![cfg(unikv_loom)]

/// The atomics the counters file uses, here loom's.
mod sync {
    pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
}

#[path = "../src/counters.rs"]
#[allow(dead_code)]
mod counters;

use counters::{Counters, crosses_log_point};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;

#[test]
fn recorders_and_a_poller_lose_nothing_and_log_the_first_hit_once() {
    loom::model(|| {
        let counters = Arc::new(Counters {
            total: AtomicU64::new(0),
            unpolled: AtomicU64::new(0),
        });
        let first_hit_logs = Arc::new(AtomicU64::new(0));
        let recorders: Vec<_> = [1u64, 2]
            .into_iter()
            .map(|n| {
                let counters = counters.clone();
                let logs = first_hit_logs.clone();
                thread::spawn(move || {
                    let before = counters.record(n);
                    if before == 0 && crosses_log_point(before, n, 512) {
                        logs.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let poller = {
            let counters = counters.clone();
            thread::spawn(move || counters.take_unpolled())
        };
        for r in recorders {
            r.join().unwrap();
        }
        let polled = poller.join().unwrap() + counters.take_unpolled();
        assert_eq!(polled, 3, "every violation is seen by exactly one poll");
        assert_eq!(counters.total(), 3);
        assert_eq!(
            first_hit_logs.load(Ordering::Relaxed),
            1,
            "the first hit is logged once"
        );
    });
}

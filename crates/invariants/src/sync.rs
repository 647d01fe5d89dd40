//! The atomics the counters use: std's normally, loom's under `--cfg unikv_loom`.

#[cfg(unikv_loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(unikv_loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

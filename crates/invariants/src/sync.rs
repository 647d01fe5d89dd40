//! The atomics the counters use. The loom model (`tests/loom_counters.rs`) compiles the
//! counters against loom's atomics through its own `sync` module instead.

pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

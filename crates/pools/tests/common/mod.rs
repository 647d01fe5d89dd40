//! Shared set-up of the pools' integration tests: both layouts at every page size of the
//! test matrix, on a `SyncLedger` around the CPU device, plus request and invariant helpers.
#![allow(dead_code)]

use std::sync::Arc;
use unikv_invariants::{Invariant, Level, scoped_level};
use unikv_kernels::{Device, SyncLedger};
use unikv_pools::{
    Error, ExtendRequest, KvAllocator, SlotPoolSpec, StaticSwa, StaticSwaConfig, SubPoolSpec,
    UnifiedSwa, UnifiedSwaConfig, VirtualPage, VirtualSlot, VirtualToken,
};

/// Which allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Unified,
    Static,
}

pub const LAYOUTS: [Layout; 2] = [Layout::Unified, Layout::Static];

/// FULL: 2 layers × 1 head × 4 dims × 2 bytes × K,V = 32 B/token.
pub fn full_spec() -> SubPoolSpec {
    SubPoolSpec::mha("full", 2, 1, 4, 2)
}

/// SWA: 2 layers, 2 heads: 64 B/token (differs from FULL on purpose).
pub fn swa_spec() -> SubPoolSpec {
    SubPoolSpec::mha("swa", 2, 2, 4, 2)
}

/// The window every test pool is sized for.
pub const WINDOW: u32 = 8;

/// A pool with room for about `pages` joint pages.
pub fn unified_config(ps: u32, pages: u64) -> UnifiedSwaConfig {
    let (full, swa) = (full_spec(), swa_spec());
    let floor = full.bytes_per_token.max(swa.bytes_per_token) * ps as u64;
    UnifiedSwaConfig {
        total_bytes: floor + pages * ps as u64 * (full.bytes_per_token + swa.bytes_per_token),
        page_size: ps,
        window: WINDOW,
        full,
        swa: Some(swa),
        mamba: None,
        zero_on_handout: true,
    }
}

pub fn static_config(ps: u32, pages: u64) -> StaticSwaConfig {
    let u = unified_config(ps, pages);
    StaticSwaConfig {
        // Room for alignment of the SWA region.
        total_bytes: u.total_bytes + 2 * ps as u64 * swa_spec().bytes_per_token,
        page_size: ps,
        window: WINDOW,
        full: u.full,
        swa: u.swa,
        mamba: None,
        swa_full_ratio: 1.0,
        zero_on_handout: true,
    }
}

/// A pool under test and the ledger it runs on.
pub struct Pool {
    pub layout: Layout,
    pub ps: u32,
    pub ledger: Arc<SyncLedger>,
    pub alloc: Box<dyn KvAllocator>,
}

impl std::ops::Deref for Pool {
    type Target = dyn KvAllocator;
    fn deref(&self) -> &Self::Target {
        &*self.alloc
    }
}

impl std::ops::DerefMut for Pool {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut *self.alloc
    }
}

pub fn pool(layout: Layout, ps: u32, pages: u64) -> Pool {
    let ledger = Arc::new(SyncLedger::cpu());
    let device: Arc<dyn Device> = ledger.clone();
    let alloc: Box<dyn KvAllocator> = match layout {
        Layout::Unified => Box::new(UnifiedSwa::new(device, unified_config(ps, pages)).unwrap()),
        Layout::Static => Box::new(StaticSwa::new(device, static_config(ps, pages)).unwrap()),
    };
    Pool {
        layout,
        ps,
        ledger,
        alloc,
    }
}

/// Runs `f` for both layouts at every page size of the matrix. (Tests of one binary run
/// as threads under `cargo test`: each pool counts breaches in its own invariant scope, so
/// they need no serialising.)
pub fn each_case(mut f: impl FnMut(Layout, u32)) {
    for ps in unikv_invariants::testing::page_sizes() {
        for layout in LAYOUTS {
            f(layout, ps);
        }
    }
}

/// Extends `row` by `n` tokens (one request).
pub fn extend(pool: &mut Pool, row: &mut Vec<VirtualToken>, n: usize) {
    try_extend(pool, row, n)
        .unwrap_or_else(|e| panic!("extend {n} on {:?}/{}: {e}", pool.layout, pool.ps));
}

pub fn try_extend(
    pool: &mut Pool,
    row: &mut Vec<VirtualToken>,
    n: usize,
) -> Result<(), unikv_pools::Error> {
    let req = ExtendRequest {
        prefix_len: row.len(),
        seq_len: row.len() + n,
        last_token: row.last().copied(),
    };
    let mut out = Vec::new();
    pool.alloc_extend(&[req], &mut out)?;
    assert_eq!(out.len(), n);
    row.extend(out);
    Ok(())
}

/// A new row of `n` tokens.
pub fn new_row(pool: &mut Pool, n: usize) -> Vec<VirtualToken> {
    let mut row = Vec::new();
    extend(pool, &mut row, n);
    row
}

/// Breaches of `inv` recorded in `pool`'s scope while `f` runs on it at `level`.
pub fn breaches<R>(
    pool: &mut Pool,
    inv: &'static Invariant,
    level: Level,
    f: impl FnOnce(&mut Pool) -> R,
) -> (u64, R) {
    let scope = pool.invariant_scope().clone();
    scoped_level(level, || {
        let before = scope.violations(inv);
        let r = f(pool);
        (scope.violations(inv) - before, r)
    })
}

/// The step boundary at the ambient level must pass: nothing the test did legitimately
/// breaches an invariant.
#[track_caller]
pub fn assert_clean(pool: &Pool) {
    if let Err(e) = pool.verify() {
        panic!("{:?}/ps {}: {e}", pool.layout, pool.ps);
    }
    if let Err(e) = pool.invariant_scope().poll() {
        panic!("{:?}/ps {}: {e}", pool.layout, pool.ps);
    }
}

/// Allocated pages per side.
pub fn allocated(pool: &Pool) -> (usize, usize) {
    let c = pool.capacity();
    (c.full.allocated_pages, c.swa.allocated_pages)
}

/// Bytes of one Mamba state slot of the slot tests (2 recurrent layers): larger than any
/// KV envelope at page sizes 1 and 4, so it sets the sink floor there.
pub const SLOT: u64 = 256;

/// The slot pool of the slot tests.
pub fn slot_spec() -> SlotPoolSpec {
    SlotPoolSpec {
        name: "mamba",
        layers: 2,
        bytes_per_slot: SLOT,
    }
}

/// Conservation and the full scan hold, and nothing breached an invariant (any allocator).
#[track_caller]
pub fn assert_sound(a: &dyn KvAllocator) {
    assert!(a.check_conservation());
    a.verify().unwrap();
    a.invariant_scope().poll().unwrap();
}

/// `n` fresh slots (they must fit).
pub fn alloc_slots(a: &mut dyn KvAllocator, n: usize) -> Vec<VirtualSlot> {
    let mut out = Vec::new();
    a.alloc_slots(n, &mut out).unwrap();
    assert_eq!(out.len(), n);
    out
}

/// A fresh row of `n` tokens (one request with no prefix).
pub fn try_row(a: &mut dyn KvAllocator, n: usize) -> Result<Vec<VirtualToken>, Error> {
    let mut out = Vec::new();
    a.alloc_extend(
        &[ExtendRequest {
            prefix_len: 0,
            seq_len: n,
            last_token: None,
        }],
        &mut out,
    )?;
    Ok(out)
}

/// A fresh row of `n` tokens that must fit.
pub fn fresh_row(a: &mut dyn KvAllocator, n: usize) -> Vec<VirtualToken> {
    try_row(a, n).unwrap()
}

/// The host tables and views two pools are compared by.
pub fn snapshot(a: &dyn KvAllocator) -> impl PartialEq + std::fmt::Debug + use<> {
    let pages: Vec<_> = (0..a.virtual_pages())
        .map(|v| (a.full_live(VirtualPage(v)), a.swa_state(VirtualPage(v))))
        .collect();
    (a.capacity(), a.pool_map(), a.pending_frees(), pages)
}

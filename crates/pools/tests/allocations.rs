//! Warm frees allocate nothing: once a pool has been through a step's frees, the same
//! frees again take no heap allocation (the set-shaped frees sort their pages in the
//! group's reused scratch buffer; a free of one state slot needs no duplicate check).
//! Counted by a global allocator that counts this thread's allocations.

mod common;

use common::*;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::sync::Arc;
use unikv_kernels::{Device, SyncLedger};
use unikv_pools::{KvAllocator, UnifiedSwa, UnifiedSwaConfig, VirtualToken};

thread_local! {
    /// Heap allocations (and reallocations) made by this thread.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting each allocation of the calling thread.
struct Counting;

fn count() {
    // `try_with`: a thread being torn down may still allocate.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so
// `System`'s guarantees are this allocator's; counting touches only a thread-local cell.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, forwarded as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        count();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: `ptr` was allocated by `System` (every allocation here is) with
        // `layout`, as the caller guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: as for `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Allocations this thread makes while `f` runs.
fn allocations(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(Cell::get);
    f();
    ALLOCATIONS.with(Cell::get) - before
}

/// One step of set-shaped frees over fresh rows: each row's SWA by ids, then its FULL by
/// ids, and a two-sided free by ids; the allocations each free made, by name.
fn set_shaped_step(pool: &mut Pool) -> Vec<(&'static str, u64)> {
    let p = pool.ps as usize;
    let rows: Vec<Vec<VirtualToken>> = (0..3).map(|_| new_row(pool, 2 * p + 1)).collect();
    pool.upload_mirror().unwrap();
    let mut seen = Vec::new();
    for row in &rows[..2] {
        seen.push(("free_swa", allocations(|| pool.free_swa(row).unwrap())));
        seen.push(("free_full", allocations(|| pool.free_full(row).unwrap())));
    }
    seen.push(("free", allocations(|| pool.free(&rows[2]).unwrap())));
    pool.upload_mirror().unwrap();
    pool.flush().unwrap();
    seen
}

/// Proves the set-shaped frees reuse their scratch: a second identical step of
/// `free_swa`, `free_full` and `free` allocates nothing on either layout.
#[test]
fn warm_set_shaped_frees_allocate_nothing() {
    each_case(|layout, ps| {
        let mut pool = pool(layout, ps, 16);
        set_shaped_step(&mut pool);
        let warm = set_shaped_step(&mut pool);
        assert!(
            warm.iter().all(|&(_, n)| n == 0),
            "{layout:?}/{ps}: {warm:?}"
        );
        assert_clean(&pool);
    });
}

/// A FULL + Mamba unified pool with room for a few slots and pages.
fn slot_pool(ps: u32) -> UnifiedSwa {
    let device: Arc<dyn Device> = Arc::new(SyncLedger::cpu());
    let full = full_spec();
    let floor = SLOT.max(full.bytes_per_token * ps as u64);
    let config = UnifiedSwaConfig {
        total_bytes: floor + 8 * SLOT + 8 * full.bytes_per_token * ps as u64,
        page_size: ps,
        window: WINDOW,
        full,
        swa: None,
        mamba: Some(slot_spec()),
        zero_on_handout: true,
    };
    UnifiedSwa::new(device, config).unwrap()
}

/// Proves a free of one state slot (a request's own state) allocates nothing once warm:
/// one slot needs no duplicate check.
#[test]
fn a_warm_free_of_one_slot_allocates_nothing() {
    for ps in unikv_invariants::testing::page_sizes() {
        let mut pool = slot_pool(ps);
        let mut step = || {
            let slot = alloc_slots(&mut pool, 1);
            pool.upload_mirror().unwrap();
            let n = allocations(|| pool.free_slots(&slot).unwrap());
            pool.upload_mirror().unwrap();
            n
        };
        step();
        assert_eq!(step(), 0, "ps {ps}");
        assert_sound(&pool);
    }
}

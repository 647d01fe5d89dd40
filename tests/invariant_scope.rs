//! Each cache owns its invariant scope: its allocator (through a wrapping allocator too)
//! and its tree count into it, its step boundary polls it on every path, and two caches
//! in one process — or on two threads at once — never see each other's breaches. (These
//! tests run as threads of one process under `cargo test`, which is the point.)

mod common;

use common::{Config, LAYOUTS, page_sizes};
use unikv::invariants::{Error as InvariantError, Level, Scope, declare_invariant, scoped_level};
use unikv::kernels::{BytesId, TableId};
use unikv::pools::{
    Capacity, DecodeRequest, DeferredKind, Error, ExtendRequest, FlushReport, FreeOp, Grid,
    KvAllocator, MoveGate, PageDemand, PageSize, PoolMap, ReclaimPlan, Reclaimable, Segment, Side,
    SwaState, VirtualPage, VirtualToken,
};
use unikv::{HybridCache, TokenId};

declare_invariant! {
    /// Breached on purpose by [`Faulty`], once per step.
    static INJECTED: "test.injected", Guard, "a breach the test injects";
}

/// What [`Faulty`] does wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Records one breach of [`INJECTED`] into the inner allocator's scope per step.
    BreachEachStep,
    /// Drops every kv-row free (a request's release): its pages leak, so the
    /// cache's conservation fails at the next step boundary.
    LeakReleases,
}

/// A wrapping allocator that forwards every call (the scope methods included) but one.
#[derive(Debug)]
struct Faulty {
    inner: Box<dyn KvAllocator>,
    fault: Fault,
}

impl KvAllocator for Faulty {
    fn page_size(&self) -> PageSize {
        self.inner.page_size()
    }
    fn invariant_scope(&self) -> &Scope {
        self.inner.invariant_scope()
    }
    fn set_invariant_scope(&mut self, scope: Scope) {
        self.inner.set_invariant_scope(scope)
    }
    fn virtual_pages(&self) -> u32 {
        self.inner.virtual_pages()
    }
    fn alloc_extend(
        &mut self,
        requests: &[ExtendRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        self.inner.alloc_extend(requests, out)
    }
    fn alloc_decode(
        &mut self,
        requests: &[DecodeRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        self.inner.alloc_decode(requests, out)
    }
    fn free(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        self.inner.free(ids)
    }
    fn free_swa(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        self.inner.free_swa(ids)
    }
    fn free_full(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        self.inner.free_full(ids)
    }
    fn free_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        self.inner.free_segment(segment)
    }
    fn free_swa_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        self.inner.free_swa_segment(segment)
    }
    fn free_full_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        self.inner.free_full_segment(segment)
    }
    fn free_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error> {
        self.inner.free_segments(segments)
    }
    fn free_kv_row_segments(
        &mut self,
        row: &[VirtualToken],
        dead_lo: usize,
        cursor: usize,
        len: usize,
    ) -> Result<(), Error> {
        if self.fault == Fault::LeakReleases {
            return Ok(());
        }
        self.inner.free_kv_row_segments(row, dead_lo, cursor, len)
    }
    fn transfer_swa(&mut self, from: Segment<'_>, to: Segment<'_>) -> Result<(), Error> {
        self.inner.transfer_swa(from, to)
    }
    fn free_batch(&mut self, frees: &[FreeOp<'_>]) {
        let kept: Vec<FreeOp<'_>> = frees
            .iter()
            .copied()
            .filter(|op| !(self.fault == Fault::LeakReleases && matches!(op, FreeOp::KvRow { .. })))
            .collect();
        self.inner.free_batch(&kept)
    }
    fn free_group_begin(&mut self) -> Result<(), Error> {
        self.inner.free_group_begin()
    }
    fn free_group_end(&mut self) -> Result<(), Error> {
        self.inner.free_group_end()
    }
    fn in_free_group(&self) -> bool {
        self.inner.in_free_group()
    }
    fn pending_frees(&self) -> [(DeferredKind, usize); 4] {
        self.inner.pending_frees()
    }
    fn flush_deferred(&mut self) -> bool {
        self.inner.flush_deferred()
    }
    fn flush(&mut self) -> Result<FlushReport, Error> {
        self.inner.flush()
    }
    fn allocation_fits(&self, demand: PageDemand) -> bool {
        self.inner.allocation_fits(demand)
    }
    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        self.inner.ensure_capacity(demand)
    }
    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        self.inner.reclaim_plan(demand, evictable)
    }
    fn capacity(&self) -> Capacity {
        self.inner.capacity()
    }
    fn pool_map(&self) -> PoolMap {
        self.inner.pool_map()
    }
    fn move_gate(&self) -> MoveGate {
        self.inner.move_gate()
    }
    fn mirror_current(&self) -> bool {
        self.inner.mirror_current()
    }
    fn upload_mirror(&mut self) -> Result<(), Error> {
        if self.fault == Fault::BreachEachStep {
            // Recorded where the inner allocator records: the cache's scope, if the
            // cache handed it over through this wrapper.
            self.inner
                .invariant_scope()
                .expect(&INJECTED, false, || "injected at the mirror upload".into());
        }
        self.inner.upload_mirror()
    }
    fn mirror_table(&self, side: Side) -> TableId {
        self.inner.mirror_table(side)
    }
    fn stride(&self, side: Side) -> u32 {
        self.inner.stride(side)
    }
    fn kernel_id(&self, side: Side, token: VirtualToken) -> i32 {
        self.inner.kernel_id(side, token)
    }
    fn translate(
        &self,
        side: Side,
        ids: TableId,
        n: usize,
        out: TableId,
        out_width: usize,
    ) -> Result<(), Error> {
        self.inner.translate(side, ids, n, out, out_width)
    }
    fn buffer(&self) -> BytesId {
        self.inner.buffer()
    }
    fn grid(&self, side: Side) -> Grid {
        self.inner.grid(side)
    }
    fn sink_floor(&self) -> u64 {
        self.inner.sink_floor()
    }
    fn physical_page(&self, side: Side, page: VirtualPage) -> Option<u32> {
        self.inner.physical_page(side, page)
    }
    fn full_live(&self, page: VirtualPage) -> bool {
        self.inner.full_live(page)
    }
    fn swa_state(&self, page: VirtualPage) -> SwaState {
        self.inner.swa_state(page)
    }
    fn check_conservation(&self) -> bool {
        self.inner.check_conservation()
    }
    fn verify(&self) -> Result<(), String> {
        self.inner.verify()
    }
}

fn build(config: &Config, fault: Option<Fault>) -> HybridCache {
    let mut builder = HybridCache::builder()
        .model(config.model)
        .page_size(config.page_size)
        .memory_bytes(config.memory_bytes())
        .layout(config.layout);
    if let Some(fault) = fault {
        builder = builder.wrap_allocator(move |inner| Box::new(Faulty { inner, fault }));
    }
    builder.build().unwrap()
}

/// Admits, prefills and releases one request of `tokens` tokens, then ends the step.
fn one_step(cache: &mut HybridCache, seed: u32, tokens: usize) -> Result<(), unikv::Error> {
    let prompt: Vec<TokenId> = (0..tokens as u32)
        .map(|i| TokenId(seed * 1000 + i))
        .collect();
    let hit = cache.match_prefix(prompt);
    let mut req = cache.admit(hit)?;
    cache.alloc_extend(&mut req, tokens)?;
    cache.release(req)?;
    cache.step_boundary().map(|_| ())
}

fn injected_count(result: Result<(), unikv::Error>) -> u64 {
    match result {
        Ok(()) => 0,
        Err(unikv::Error::Invariants(InvariantError::Violated(v))) => {
            assert_eq!(v.failures.len(), 1, "{v}");
            assert_eq!(v.failures[0].name, INJECTED.name(), "{v}");
            v.failures[0].count
        }
        Err(e) => panic!("{e}"),
    }
}

/// The cache, its allocator (behind a wrapper) and its tree share one scope, and every
/// cache has its own.
#[test]
fn a_cache_shares_its_scope_with_its_allocator_and_tree() {
    let config = Config::new(LAYOUTS[0], 4, 8, 64);
    let (plain, wrapped) = (
        build(&config, None),
        build(&config, Some(Fault::BreachEachStep)),
    );
    for cache in [&plain, &wrapped] {
        let id = cache.invariant_scope().id();
        assert_eq!(cache.allocator().invariant_scope().id(), id);
        assert_eq!(cache.tree().invariant_scope().id(), id);
    }
    assert_ne!(plain.invariant_scope().id(), wrapped.invariant_scope().id());
}

/// Two caches in one process: one breaches at every step, the other's steps stay clean,
/// and each breach fails exactly one step of its own cache.
#[test]
fn two_caches_in_one_process_see_only_their_own_breaches() {
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            for ps in page_sizes() {
                let config = Config::new(layout, ps, 8, 64);
                let mut breaching = build(&config, Some(Fault::BreachEachStep));
                let mut clean = build(&config, None);
                for step in 0..4 {
                    let tokens = 3 * ps as usize;
                    assert_eq!(injected_count(one_step(&mut breaching, step, tokens)), 1);
                    one_step(&mut clean, step, tokens).unwrap_or_else(|e| {
                        panic!("{layout:?}/{ps}: the clean cache failed with {e}")
                    });
                }
                assert_eq!(breaching.invariant_scope().violations(&INJECTED), 4);
                assert_eq!(
                    clean.invariant_scope().report().unwrap().total_violations(),
                    0
                );
            }
        }
    });
}

/// Caches on four threads step at once, two of them breaching at every step: each sees
/// exactly its own breaches, one per step, and the clean ones none.
#[test]
fn caches_on_concurrent_threads_see_only_their_own_breaches() {
    const STEPS: u32 = 50;
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            std::thread::spawn(move || {
                scoped_level(Level::Strict, || {
                    let config = Config::new(LAYOUTS[(t / 2) as usize], 4, 8, 64);
                    let fault = (t % 2 == 0).then_some(Fault::BreachEachStep);
                    let mut cache = build(&config, fault);
                    let mut seen = 0;
                    for step in 0..STEPS {
                        let count = injected_count(one_step(&mut cache, t * STEPS + step, 12));
                        assert!(count <= 1, "thread {t}: {count} breaches in one step");
                        seen += count;
                    }
                    (fault.is_some(), seen)
                })
            })
        })
        .collect();
    for (t, handle) in threads.into_iter().enumerate() {
        let (breaching, seen) = handle.join().unwrap();
        let expected = if breaching { STEPS as u64 } else { 0 };
        assert_eq!(seen, expected, "thread {t}");
    }
}

/// A step boundary that fails conservation still polls: nothing stays pending in the
/// cache's scope, and another cache of the process steps cleanly.
#[test]
fn a_failed_conservation_check_leaves_nothing_pending() {
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            let config = Config::new(layout, 4, 8, 64);
            let mut leaking = build(&config, Some(Fault::LeakReleases));
            match one_step(&mut leaking, 1, 12) {
                Err(unikv::Error::Conservation { .. }) => {}
                other => panic!("{layout:?}: expected a conservation error, got {other:?}"),
            }
            assert!(
                leaking.invariant_scope().poll().is_ok(),
                "{layout:?}: the step boundary polled on its failing path"
            );
            let report = leaking.invariant_scope().report().unwrap();
            assert!(
                report.total_violations() > 0,
                "{layout:?}: counted:\n{report}"
            );
            let mut clean = build(&config, None);
            one_step(&mut clean, 1, 12).unwrap();
        }
    });
}

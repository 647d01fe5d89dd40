//! `Hooked` forwards every `KvAllocator` method unchanged: the same operations, run on a
//! bare allocator and on a twin of it behind `Hooked` with hooks that keep every default,
//! return the same values and leave the two answering every query alike, after every
//! operation; the invariant scope and the checks are the inner allocator's; and the
//! hooks see each call as documented (a fallible call gated, an infallible one not, a
//! failed call's outcome not done).

mod common;

use common::*;
use std::fmt::Debug;
use unikv_invariants::{Level, Scope, scoped_level};
use unikv_kernels::{BytesId, Device, SyncLedger, TableId};
use unikv_pools::invariants::DOUBLE_FREE;
use unikv_pools::{
    Call, Capacity, DecodeRequest, DeferredKind, Error, ExtendRequest, FlushReport, FreeOp, Grid,
    Hooked, Hooks, KvAllocator, MoveGate, Outcome, PageDemand, PageSize, PoolMap, ReclaimPlan,
    Reclaimable, Segment, Side, SideTranslation, SwaState, UnifiedSwa, UnifiedSwaConfig,
    VirtualPage, VirtualSlot, VirtualToken,
};

/// Hooks that keep every default: gate nothing, forward every free, watch nothing.
#[derive(Debug)]
struct Noop;

impl Hooks for Noop {}

/// Slots every snapshot asks about (more than any test allocates).
const SLOTS_ASKED: u32 = 16;

/// Every answer of every query of `a`, as text (values of two allocators built alike
/// are equal: ids, physical pages and device handles are handed out deterministically).
fn snapshot(a: &dyn KvAllocator) -> String {
    let ps = a.page_size();
    let sides = [Side::Full, Side::Swa, Side::Mamba];
    let per_side: Vec<_> = sides
        .iter()
        .map(|&s| (s, a.stride(s), a.grid(s), a.mirror_table(s)))
        .collect();
    let per_page: Vec<_> = (0..a.virtual_pages())
        .map(VirtualPage)
        .map(|v| {
            let ids = sides.map(|s| {
                let last = v.token(ps, ps.get() - 1);
                (
                    a.physical_page(s, v),
                    a.kernel_id(s, v.first_token(ps)),
                    a.kernel_id(s, last),
                )
            });
            (v, a.full_live(v), a.swa_state(v), ids)
        })
        .collect();
    let slots: Vec<_> = (0..SLOTS_ASKED)
        .map(|s| a.physical_slot(VirtualSlot(s)))
        .collect();
    let fits = [
        PageDemand::joint(1),
        PageDemand::joint(usize::MAX / 2),
        PageDemand::slots(1),
    ]
    .map(|d| a.allocation_fits(d));
    format!(
        "{:#?}",
        (
            (ps, a.virtual_pages(), a.sink_floor(), a.buffer()),
            (a.capacity(), a.pool_map(), a.pending_frees()),
            (a.in_free_group(), a.mirror_current(), fits),
            (a.check_conservation(), a.verify()),
            per_side,
            per_page,
            slots,
        )
    )
}

/// An allocator bare and its twin (built alike) behind `Hooked<Noop>`.
struct Twin {
    what: String,
    bare: Box<dyn KvAllocator>,
    hooked: Hooked<Noop>,
}

impl Twin {
    fn new(what: String, build: impl Fn() -> Box<dyn KvAllocator>) -> Twin {
        let twin = Twin {
            what,
            bare: build(),
            hooked: Hooked::new(build(), Noop),
        };
        twin.assert_alike("built");
        twin
    }

    #[track_caller]
    fn assert_alike(&self, after: &str) {
        assert_eq!(
            snapshot(&*self.bare),
            snapshot(&self.hooked),
            "{}: the twins differ after {after}",
            self.what
        );
    }

    /// Runs `op` on both twins: it must return the same on both and leave them alike.
    #[track_caller]
    fn step<R: Debug>(&mut self, name: &str, op: impl Fn(&mut dyn KvAllocator) -> R) -> R {
        let bare = op(&mut *self.bare);
        let hooked = op(&mut self.hooked);
        assert_eq!(
            format!("{bare:?}"),
            format!("{hooked:?}"),
            "{}: {name} returned differently through Hooked",
            self.what
        );
        self.assert_alike(name);
        hooked
    }
}

/// A fresh row of `n` tokens, as a result (so a refusal is compared, not unwrapped).
fn row(a: &mut dyn KvAllocator, n: usize) -> Result<Vec<VirtualToken>, Error> {
    try_row(a, n)
}

/// `row` grown by one decode step: the new token.
fn decode(a: &mut dyn KvAllocator, row: &[VirtualToken]) -> Result<Vec<VirtualToken>, Error> {
    let mut out = Vec::new();
    let request = DecodeRequest {
        prefix_len: row.len(),
        last_token: row.last().copied(),
    };
    a.alloc_decode(&[request], &mut out).map(|()| out)
}

fn slots(a: &mut dyn KvAllocator, n: usize) -> Result<Vec<VirtualSlot>, Error> {
    let mut out = Vec::new();
    a.alloc_slots(n, &mut out).map(|()| out)
}

/// A demand just past what fits now, and all of `a`'s pages as evictable.
fn past_capacity(a: &dyn KvAllocator) -> (PageDemand, Reclaimable) {
    let c = a.capacity();
    (
        PageDemand::joint(c.joint_schedulable_pages + 2),
        Reclaimable::pages(c.full.allocated_pages, c.swa.allocated_pages),
    )
}

/// Every mutating method, and the queries after each, on the twins: allocation, decode,
/// window release and SWA transfer, each free shape, a free group with its flushes, slots
/// and their copies, capacity and reclaim sizing, the mirror, and refusals of each.
fn drive(t: &mut Twin, ps: usize) {
    let r1 = t.step("alloc_extend", |a| row(a, 3 * ps)).unwrap();
    let r2 = t.step("alloc_extend", |a| row(a, 2 * ps)).unwrap();
    let mut r3 = t.step("alloc_extend", |a| row(a, 3 * ps)).unwrap();
    let decoded = t.step("alloc_decode", |a| decode(a, &r3)).unwrap();
    assert_eq!(decoded.len(), 1);
    r3.extend(decoded);
    let behind = t.step("translate behind the host tables", |a| {
        a.translate(Side::Full, TableId(0), 1, TableId(0), 1)
    });
    assert!(
        matches!(behind, Err(Error::MirrorBehind { .. })),
        "{behind:?}"
    );
    let translation = SideTranslation {
        side: Side::Full,
        ids: TableId(0),
        n: 1,
        out: TableId(0),
        out_width: 1,
    };
    let behind = t.step("translate_many behind the host tables", |a| {
        a.translate_many(&[translation])
    });
    assert!(
        matches!(behind, Err(Error::MirrorBehind { .. })),
        "{behind:?}"
    );
    t.step("upload_mirror", |a| a.upload_mirror()).unwrap();

    // The window leaves r1's first page; r2's first page hands it its SWA page.
    t.step("free_swa_segment", |a| {
        a.free_swa_segment(Segment::of_row(&r1, 0..ps))
    })
    .unwrap();
    t.step("transfer_swa", |a| {
        a.transfer_swa(Segment::of_row(&r2, 0..ps), Segment::of_row(&r1, 0..ps))
    })
    .unwrap();
    t.step("transfer_swa onto a live target", |a| {
        a.transfer_swa(
            Segment::of_row(&r2, ps..2 * ps),
            Segment::of_row(&r1, ps..2 * ps),
        )
    })
    .unwrap_err();
    t.step("free_swa", |a| a.free_swa(&r1[..ps])).unwrap();
    t.step("free_full_segment", |a| {
        a.free_full_segment(Segment::of_row(&r1, 0..ps))
    })
    .unwrap();
    t.step("free_full", |a| a.free_full(&r2[..ps])).unwrap();
    t.step("free", |a| a.free(&r2[ps..])).unwrap();
    t.step("free_segments", |a| {
        a.free_segments(&[
            Segment::of_row(&r1, ps..2 * ps),
            Segment::of_row(&r1, 2 * ps..3 * ps),
        ])
    })
    .unwrap();
    t.step("free_segments sharing a page", |a| {
        a.free_segments(&[
            Segment::of_row(&r3, 0..ps + 1),
            Segment::of_row(&r3, ps..2 * ps),
        ])
    })
    .unwrap_err();
    t.step("free_swa_segments with a token out of range", |a| {
        a.free_swa_segments(&[
            Segment::of_row(&r3, 0..ps),
            Segment {
                tokens: &[VirtualToken(u32::MAX)],
                start: 0,
            },
        ])
    })
    .unwrap_err();
    t.step("free_swa_segments", |a| {
        a.free_swa_segments(&[Segment::of_row(&r3, 0..ps)])
    })
    .unwrap();
    if ps > 1 {
        t.step("free_kv_row_segments splitting a page", |a| {
            a.free_kv_row_segments(&r3, 0, ps + 1, 2 * ps)
        })
        .unwrap_err();
    }
    t.step("free_kv_row_segments", |a| {
        a.free_kv_row_segments(&r3, 0, ps, 2 * ps)
    })
    .unwrap();

    // A free group: deferred frees, both flushes, and its end.
    let r4 = t.step("alloc_extend", |a| row(a, 2 * ps)).unwrap();
    let r5 = t.step("alloc_extend", |a| row(a, 2 * ps)).unwrap();
    t.step("free_group_begin", |a| a.free_group_begin())
        .unwrap();
    t.step("free_group_begin inside a group", |a| a.free_group_begin())
        .unwrap_err();
    t.step("free_segment deferred", |a| {
        a.free_segment(Segment::of_row(&r4, 0..ps))
    })
    .unwrap();
    assert!(t.step("flush_deferred with frees pending", |a| a.flush_deferred()));
    assert!(!t.step("flush_deferred with none", |a| a.flush_deferred()));
    t.step("free deferred", |a| a.free(&r4[ps..])).unwrap();
    let report = t.step("flush with frees pending", |a| a.flush()).unwrap();
    assert!(report.deferred_flushed, "{report:?}");
    t.step("free_batch", |a| {
        a.free_batch(&[FreeOp::Segment(Segment::of_row(&r5, 0..2 * ps))])
    });
    t.step("free_group_end", |a| a.free_group_end()).unwrap();
    t.step("free_group_end outside a group", |a| a.free_group_end())
        .unwrap_err();

    // Mamba state slots (refused alike without a slot pool).
    match t.step("alloc_slots", |a| slots(a, 3)) {
        Ok(s) => {
            t.step("copy_slots", |a| a.copy_slots(&[(s[0], s[1])]))
                .unwrap();
            t.step("copy_slots onto its source", |a| {
                a.copy_slots(&[(s[0], s[0])])
            })
            .unwrap_err();
            t.step("free_slots", |a| a.free_slots(&s[2..])).unwrap();
            t.step("free_slots of a freed slot", |a| a.free_slots(&s[2..]))
                .unwrap_err();
        }
        Err(e) => {
            assert!(matches!(e, Error::NoSlotPool { .. }), "{e:?}");
            t.step("copy_slots", |a| {
                a.copy_slots(&[(VirtualSlot(1), VirtualSlot(2))])
            })
            .unwrap_err();
            t.step("free_slots", |a| a.free_slots(&[VirtualSlot(1)]))
                .unwrap_err();
        }
    }

    // Capacity: fill the pool, then ask what fits and what to evict.
    while t
        .step("alloc_extend until full", |a| row(a, 2 * ps))
        .is_ok()
    {}
    t.step("ensure_capacity past the pool", |a| {
        a.ensure_capacity(past_capacity(a).0)
    })
    .unwrap_err();
    t.step("ensure_capacity of nothing", |a| {
        a.ensure_capacity(PageDemand::default())
    })
    .unwrap();
    let plan = t.step("reclaim_plan needing eviction", |a| {
        let (demand, evictable) = past_capacity(a);
        a.reclaim_plan(demand, evictable)
    });
    assert!(
        plan.is_some_and(|p| p != ReclaimPlan::default()),
        "{plan:?}"
    );
    let plan = t.step("reclaim_plan beyond every eviction", |a| {
        a.reclaim_plan(PageDemand::joint(usize::MAX / 2), Reclaimable::default())
    });
    assert_eq!(plan, None);
    t.step("upload_mirror", |a| a.upload_mirror()).unwrap();
    assert_sound(&*t.bare);
    assert_sound(&t.hooked);
}

/// The FULL + SWA + Mamba tri-pool of the slot tests, about `pages` joint pages.
fn tri_pool(ps: u32, pages: u64) -> Box<dyn KvAllocator> {
    let device: std::sync::Arc<dyn Device> = std::sync::Arc::new(SyncLedger::cpu());
    let kv = unified_config(ps, pages);
    let config = UnifiedSwaConfig {
        total_bytes: kv.total_bytes + 8 * SLOT,
        mamba: Some(slot_spec()),
        ..kv
    };
    Box::new(UnifiedSwa::new(device, config).unwrap())
}

/// Kills the forwarding mutants of every method: each one, on every layout (the tri-pool
/// included), returns what the bare allocator returns and leaves the wrapped allocator
/// answering every query as the bare one does.
#[test]
fn every_method_through_hooked_acts_and_answers_as_on_the_bare_allocator() {
    each_case(|layout, ps| {
        let mut twin = Twin::new(format!("{layout:?}/{ps}"), || pool(layout, ps, 16).alloc);
        drive(&mut twin, ps as usize);
    });
    for ps in unikv_invariants::testing::page_sizes() {
        let mut twin = Twin::new(format!("tri-pool/{ps}"), || tri_pool(ps, 16));
        drive(&mut twin, ps as usize);
    }
}

/// Proves `invariant_scope` and `set_invariant_scope` reach the inner allocator: the
/// wrapper shows the inner allocator's own scope, and after a new scope is set it shows
/// that one, which then counts the inner allocator's breaches.
#[test]
fn the_invariant_scope_is_the_inner_allocators_and_a_set_scope_reaches_it() {
    each_case(|layout, ps| {
        let inner = pool(layout, ps, 16).alloc;
        let own = inner.invariant_scope().id();
        let mut hooked = Hooked::new(inner, Noop);
        assert_eq!(hooked.invariant_scope().id(), own, "{layout:?}/{ps}");

        let scope = Scope::new();
        hooked.set_invariant_scope(scope.clone());
        assert_eq!(hooked.invariant_scope().id(), scope.id(), "{layout:?}/{ps}");
        let row = fresh_row(&mut hooked, ps as usize);
        scoped_level(Level::Warn, || {
            hooked
                .free_segment(Segment::of_row(&row, 0..ps as usize))
                .unwrap();
            hooked
                .free_segment(Segment::of_row(&row, 0..ps as usize))
                .unwrap();
        });
        assert_eq!(scope.violations(&DOUBLE_FREE), 1, "{layout:?}/{ps}");
    });
}

/// An allocator whose checks fail, as a corrupted one's would (no pool reaches that
/// through its API); nothing else of it is asked.
#[derive(Debug, Default)]
struct Corrupted(Scope);

/// The checks are the only methods a test of `Corrupted` calls.
fn not_asked() -> ! {
    unreachable!("only the checks of a corrupted allocator are asked")
}

impl KvAllocator for Corrupted {
    fn check_conservation(&self) -> bool {
        false
    }
    fn verify(&self) -> Result<(), String> {
        Err("free FULL ids hold the sink".into())
    }
    fn invariant_scope(&self) -> &Scope {
        &self.0
    }
    fn page_size(&self) -> PageSize {
        not_asked()
    }
    fn set_invariant_scope(&mut self, _: Scope) {
        not_asked()
    }
    fn virtual_pages(&self) -> u32 {
        not_asked()
    }
    fn alloc_extend(
        &mut self,
        _: &[ExtendRequest],
        _: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        not_asked()
    }
    fn alloc_decode(
        &mut self,
        _: &[DecodeRequest],
        _: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        not_asked()
    }
    fn free(&mut self, _: &[VirtualToken]) -> Result<(), Error> {
        not_asked()
    }
    fn free_swa(&mut self, _: &[VirtualToken]) -> Result<(), Error> {
        not_asked()
    }
    fn free_full(&mut self, _: &[VirtualToken]) -> Result<(), Error> {
        not_asked()
    }
    fn free_segment(&mut self, _: Segment<'_>) -> Result<(), Error> {
        not_asked()
    }
    fn free_swa_segment(&mut self, _: Segment<'_>) -> Result<(), Error> {
        not_asked()
    }
    fn free_full_segment(&mut self, _: Segment<'_>) -> Result<(), Error> {
        not_asked()
    }
    fn free_segments(&mut self, _: &[Segment<'_>]) -> Result<(), Error> {
        not_asked()
    }
    fn free_swa_segments(&mut self, _: &[Segment<'_>]) -> Result<(), Error> {
        not_asked()
    }
    fn free_kv_row_segments(
        &mut self,
        _: &[VirtualToken],
        _: usize,
        _: usize,
        _: usize,
    ) -> Result<(), Error> {
        not_asked()
    }
    fn transfer_swa(&mut self, _: Segment<'_>, _: Segment<'_>) -> Result<(), Error> {
        not_asked()
    }
    fn alloc_slots(&mut self, _: usize, _: &mut Vec<VirtualSlot>) -> Result<(), Error> {
        not_asked()
    }
    fn free_slots(&mut self, _: &[VirtualSlot]) -> Result<(), Error> {
        not_asked()
    }
    fn copy_slots(&self, _: &[(VirtualSlot, VirtualSlot)]) -> Result<(), Error> {
        not_asked()
    }
    fn physical_slot(&self, _: VirtualSlot) -> Option<u32> {
        not_asked()
    }
    fn free_batch(&mut self, _: &[FreeOp<'_>]) {
        not_asked()
    }
    fn free_group_begin(&mut self) -> Result<(), Error> {
        not_asked()
    }
    fn free_group_end(&mut self) -> Result<(), Error> {
        not_asked()
    }
    fn in_free_group(&self) -> bool {
        not_asked()
    }
    fn pending_frees(&self) -> [(DeferredKind, usize); 5] {
        not_asked()
    }
    fn flush_deferred(&mut self) -> bool {
        not_asked()
    }
    fn flush(&mut self) -> Result<FlushReport, Error> {
        not_asked()
    }
    fn allocation_fits(&self, _: PageDemand) -> bool {
        not_asked()
    }
    fn ensure_capacity(&mut self, _: PageDemand) -> Result<(), Error> {
        not_asked()
    }
    fn reclaim_plan(&mut self, _: PageDemand, _: Reclaimable) -> Option<ReclaimPlan> {
        not_asked()
    }
    fn capacity(&self) -> Capacity {
        not_asked()
    }
    fn pool_map(&self) -> PoolMap {
        not_asked()
    }
    fn move_gate(&self) -> MoveGate {
        not_asked()
    }
    fn upload_mirror(&mut self) -> Result<(), Error> {
        not_asked()
    }
    fn mirror_current(&self) -> bool {
        not_asked()
    }
    fn mirror_table(&self, _: Side) -> Option<TableId> {
        not_asked()
    }
    fn stride(&self, _: Side) -> u32 {
        not_asked()
    }
    fn kernel_id(&self, _: Side, _: VirtualToken) -> i32 {
        not_asked()
    }
    fn translate(&self, _: Side, _: TableId, _: usize, _: TableId, _: usize) -> Result<(), Error> {
        not_asked()
    }
    fn translate_many(&self, _: &[SideTranslation]) -> Result<(), Error> {
        not_asked()
    }
    fn buffer(&self) -> BytesId {
        not_asked()
    }
    fn grid(&self, _: Side) -> Grid {
        not_asked()
    }
    fn sink_floor(&self) -> u64 {
        not_asked()
    }
    fn physical_page(&self, _: Side, _: VirtualPage) -> Option<u32> {
        not_asked()
    }
    fn full_live(&self, _: VirtualPage) -> bool {
        not_asked()
    }
    fn swa_state(&self, _: VirtualPage) -> SwaState {
        not_asked()
    }
}

/// Proves `check_conservation` and `verify` are the inner allocator's: a wrapper does not
/// pass a corrupted allocator as sound.
#[test]
fn a_corrupted_inner_allocator_fails_its_checks_through_hooked() {
    let hooked = Hooked::new(Box::new(Corrupted::default()), Noop);
    assert!(!hooked.check_conservation());
    assert_eq!(
        hooked.verify(),
        Err("free FULL ids hold the sink".to_string())
    );
}

/// Records what the hooks are shown: each gated call's name, and each call after it ran
/// with whether it is fallible and whether its outcome is done.
#[derive(Debug, Default)]
struct Watch {
    gated: Vec<&'static str>,
    shown: Vec<(&'static str, bool, bool)>,
}

impl Hooks for Watch {
    fn gate(&mut self, _: &dyn KvAllocator, call: Call<'_>) -> Result<(), Error> {
        self.gated.push(call.name());
        Ok(())
    }
    fn after(&mut self, _: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        self.shown
            .push((call.name(), call.fallible(), outcome.done()));
    }
}

/// Proves `Call::fallible` and `Outcome::done` say what the wrapper does: exactly the
/// calls that return a `Result` are gated and report `fallible`, the infallible ones
/// (`free_batch`, `flush_deferred`, `reclaim_plan`) are neither, and a call the inner
/// allocator refuses is shown with an outcome that is not done.
#[test]
fn exactly_the_fallible_calls_are_gated_and_a_refused_call_is_not_done() {
    each_case(|layout, ps| {
        let p = ps as usize;
        let mut hooked = Hooked::new(pool(layout, ps, 16).alloc, Watch::default());
        let row = fresh_row(&mut hooked, 2 * p);
        let mut out = Vec::new();
        let decode = DecodeRequest {
            prefix_len: row.len(),
            last_token: row.last().copied(),
        };
        hooked.alloc_decode(&[decode], &mut out).unwrap();
        let refused = hooked.alloc_slots(1, &mut Vec::new());
        assert!(
            matches!(refused, Err(Error::NoSlotPool { .. })),
            "{refused:?}"
        );
        hooked.free_group_begin().unwrap();
        hooked.free_batch(&[FreeOp::Segment(Segment::of_row(&row, 0..p))]);
        hooked.flush_deferred();
        hooked.flush().unwrap();
        hooked.free_group_end().unwrap();
        hooked.free_full(&[]).unwrap();
        let huge = PageDemand::joint(usize::MAX / 2);
        assert!(hooked.ensure_capacity(huge).is_err());
        assert_eq!(hooked.reclaim_plan(huge, Reclaimable::default()), None);
        hooked
            .free_swa_segment(Segment::of_row(&row, p..2 * p))
            .unwrap();
        hooked.upload_mirror().unwrap();

        let w = hooked.hooks();
        assert_eq!(
            w.shown,
            [
                ("alloc_extend", true, true),
                ("alloc_decode", true, true),
                ("alloc_slots", true, false),
                ("free_group_begin", true, true),
                ("free_batch", false, true),
                ("flush_deferred", false, true),
                ("flush", true, true),
                ("free_group_end", true, true),
                ("free_full", true, true),
                ("ensure_capacity", true, false),
                ("reclaim_plan", false, true),
                ("free_swa_segment", true, true),
                ("upload_mirror", true, true),
            ],
            "{layout:?}/{ps}"
        );
        let fallible: Vec<_> = w.shown.iter().filter(|s| s.1).map(|s| s.0).collect();
        assert_eq!(w.gated, fallible, "{layout:?}/{ps}");
    });
}

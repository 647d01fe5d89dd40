//! [`Hooked`]: the one forwarding [`KvAllocator`], for everything that wraps an allocator
//! to watch or fail its calls (the facade's `wrap_allocator`): an op recorder, a fault
//! injector, a test probe. The wrapper forwards every method; a [`Hooks`] sees each
//! mutating call as a [`Call`], may fail a fallible one before it is forwarded, and may
//! drop a free (a lost free, for tests that prove a leak is caught).
//!
//! Hooks compose, so an allocator is wrapped once however many hooks watch it: a pair
//! `(A, B)` is `A` wrapped around `B`, an `Option<H>` is `H` or nothing.
//!
//! The wrapper is `#[track_caller]`-transparent: the hooks, and the inner allocator, see
//! the line that called the method, through `dyn KvAllocator` and nested wrappers too.

use crate::api::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, FreeOp, KvAllocator,
    MoveGate, PageDemand, PoolMap, ReclaimPlan, Reclaimable, Segment, SideTranslation, SwaState,
};
use crate::{Error, Grid, PageSize, Side, VirtualPage, VirtualSlot, VirtualToken};
use unikv_invariants::Scope;
use unikv_kernels::{BytesId, TableId};

/// Which sides a free by token ids releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdFree {
    /// [`KvAllocator::free`]: both sides.
    Both,
    /// [`KvAllocator::free_full`]: FULL only.
    Full,
    /// [`KvAllocator::free_swa`]: SWA only.
    Swa,
}

/// One mutating call of a [`KvAllocator`] with its arguments, as a [`Hooks`] sees it.
/// The read-only methods, and the device ops `translate` and `copy_slots` (whose
/// failures a device fault injector covers), are forwarded unseen.
#[derive(Clone, Copy, Debug)]
pub enum Call<'a> {
    /// [`KvAllocator::alloc_extend`].
    AllocExtend(&'a [ExtendRequest]),
    /// [`KvAllocator::alloc_decode`].
    AllocDecode(&'a [DecodeRequest]),
    /// [`KvAllocator::alloc_slots`] of this many slots.
    AllocSlots(usize),
    /// [`KvAllocator::free`], [`KvAllocator::free_full`] or [`KvAllocator::free_swa`].
    FreeIds(IdFree, &'a [VirtualToken]),
    /// One checked free as its [`FreeOp`]: `free_segment`, `free_full_segment`,
    /// `free_swa_segment`, `transfer_swa`, `free_kv_row_segments` or `free_slots`.
    Free(FreeOp<'a>),
    /// [`KvAllocator::free_segments`].
    FreeSegments(&'a [Segment<'a>]),
    /// [`KvAllocator::free_swa_segments`].
    FreeSwaSegments(&'a [Segment<'a>]),
    /// [`KvAllocator::free_batch`] (infallible).
    FreeBatch(&'a [FreeOp<'a>]),
    /// [`KvAllocator::free_group_begin`].
    GroupBegin,
    /// [`KvAllocator::free_group_end`].
    GroupEnd,
    /// [`KvAllocator::flush_deferred`] (infallible).
    FlushDeferred,
    /// [`KvAllocator::flush`].
    Flush,
    /// [`KvAllocator::ensure_capacity`].
    EnsureCapacity(PageDemand),
    /// [`KvAllocator::reclaim_plan`] (infallible).
    ReclaimPlan(PageDemand, Reclaimable),
    /// [`KvAllocator::upload_mirror`].
    UploadMirror,
}

impl Call<'_> {
    /// The method's name.
    pub const fn name(&self) -> &'static str {
        match self {
            Call::AllocExtend(_) => "alloc_extend",
            Call::AllocDecode(_) => "alloc_decode",
            Call::AllocSlots(_) => "alloc_slots",
            Call::FreeIds(IdFree::Both, _) => "free",
            Call::FreeIds(IdFree::Full, _) => "free_full",
            Call::FreeIds(IdFree::Swa, _) => "free_swa",
            Call::Free(op) => op.name(),
            Call::FreeSegments(_) => "free_segments",
            Call::FreeSwaSegments(_) => "free_swa_segments",
            Call::FreeBatch(_) => "free_batch",
            Call::GroupBegin => "free_group_begin",
            Call::GroupEnd => "free_group_end",
            Call::FlushDeferred => "flush_deferred",
            Call::Flush => "flush",
            Call::EnsureCapacity(_) => "ensure_capacity",
            Call::ReclaimPlan(..) => "reclaim_plan",
            Call::UploadMirror => "upload_mirror",
        }
    }

    /// Whether the method returns a `Result` (so [`Hooks::gate`] may fail it).
    pub const fn fallible(&self) -> bool {
        !matches!(
            self,
            Call::FreeBatch(_) | Call::FlushDeferred | Call::ReclaimPlan(..)
        )
    }
}

/// How a forwarded call ended, for [`Hooks::after`].
#[derive(Clone, Copy, Debug)]
pub enum Outcome<'a> {
    /// It succeeded (infallible calls always do), handing out these tokens (the
    /// allocations' new ids) and slots; both empty for frees and the rest.
    Done {
        /// Token ids appended to the caller's `out`.
        tokens: &'a [VirtualToken],
        /// Slots appended to the caller's `out`.
        slots: &'a [VirtualSlot],
    },
    /// The inner allocator returned this error.
    Failed(&'a Error),
}

impl Outcome<'_> {
    const DONE: Outcome<'static> = Outcome::Done {
        tokens: &[],
        slots: &[],
    };

    /// Whether the call succeeded.
    pub const fn done(&self) -> bool {
        matches!(self, Outcome::Done { .. })
    }
}

/// What a [`Hooked`] allocator calls around each [`Call`]. Both methods see the inner
/// allocator, as it is before (`gate`) and after (`after`) the call.
pub trait Hooks: std::fmt::Debug + Send {
    /// Before a fallible call ([`Call::fallible`]) is forwarded: an error fails the call
    /// with it, unforwarded, and [`Hooks::after`] is not called. `Location::caller()` here
    /// is the line that called the allocator.
    #[track_caller]
    fn gate(&mut self, inner: &dyn KvAllocator, call: Call<'_>) -> Result<(), Error> {
        let _ = (inner, call);
        Ok(())
    }

    /// Whether the free `op` reaches the inner allocator: asked for each checked free
    /// that is one [`FreeOp`] ([`Call::Free`], after its gate) and for each op of a batch.
    /// `false` drops it as though it were done (the call returns `Ok`).
    #[track_caller]
    fn forward_free(&mut self, inner: &dyn KvAllocator, op: FreeOp<'_>) -> bool {
        let _ = (inner, op);
        true
    }

    /// After a call was forwarded (a dropped free counts as done), whatever its outcome.
    #[track_caller]
    fn after(&mut self, inner: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        let _ = (inner, call, outcome);
    }
}

/// `A` wrapped around `B`, as though the allocator were `Hooked<A>` around `Hooked<B>`:
/// `A` gates a call first and sees its outcome last, and when `B` refuses a call that `A`
/// let through, `A`'s `after` sees the refusal. A free is forwarded when both forward it
/// (`B` is not asked about one `A` drops). Each hook sees the calls it would see as a
/// layer but for one thing: for a checked free ([`Call::Free`]) both gates run before
/// either hook is asked to forward it, so `A` is not asked about a free `B` refuses, and
/// `B` gates a free that `A` then drops, and sees it done.
impl<A: Hooks, B: Hooks> Hooks for (A, B) {
    fn gate(&mut self, inner: &dyn KvAllocator, call: Call<'_>) -> Result<(), Error> {
        self.0.gate(inner, call)?;
        if let Err(e) = self.1.gate(inner, call) {
            self.0.after(inner, call, Outcome::Failed(&e));
            return Err(e);
        }
        Ok(())
    }

    fn forward_free(&mut self, inner: &dyn KvAllocator, op: FreeOp<'_>) -> bool {
        self.0.forward_free(inner, op) && self.1.forward_free(inner, op)
    }

    fn after(&mut self, inner: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        self.1.after(inner, call, outcome);
        self.0.after(inner, call, outcome);
    }
}

/// No hooks: a `Hooked<()>` only forwards (a caller with nothing to watch).
impl Hooks for () {}

/// `H` when there is one, nothing otherwise (a hook chosen at run time, such as the
/// replay's optional op recorder).
impl<H: Hooks> Hooks for Option<H> {
    fn gate(&mut self, inner: &dyn KvAllocator, call: Call<'_>) -> Result<(), Error> {
        match self {
            Some(hooks) => hooks.gate(inner, call),
            None => Ok(()),
        }
    }

    fn forward_free(&mut self, inner: &dyn KvAllocator, op: FreeOp<'_>) -> bool {
        match self {
            Some(hooks) => hooks.forward_free(inner, op),
            None => true,
        }
    }

    fn after(&mut self, inner: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        if let Some(hooks) = self {
            hooks.after(inner, call, outcome);
        }
    }
}

/// A [`KvAllocator`] that forwards every method to `inner` and shows each mutating call to
/// its [`Hooks`]; see the module docs.
#[derive(Debug)]
pub struct Hooked<H> {
    inner: Box<dyn KvAllocator>,
    hooks: H,
}

impl<H: Hooks> Hooked<H> {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn KvAllocator>, hooks: H) -> Hooked<H> {
        Hooked { inner, hooks }
    }

    /// The hooks.
    pub fn hooks(&self) -> &H {
        &self.hooks
    }

    /// The hooks, mutably.
    pub fn hooks_mut(&mut self) -> &mut H {
        &mut self.hooks
    }

    /// Asks the hooks to let `call` through.
    #[track_caller]
    fn gate(&mut self, call: Call<'_>) -> Result<(), Error> {
        self.hooks.gate(&*self.inner, call)
    }

    /// Gates the checked free `op` and asks the hooks whether it is forwarded; one they
    /// drop is shown as done, and `Ok(false)` returned.
    #[track_caller]
    fn gate_free(&mut self, op: FreeOp<'_>) -> Result<bool, Error> {
        let call = Call::Free(op);
        self.hooks.gate(&*self.inner, call)?;
        if self.hooks.forward_free(&*self.inner, op) {
            return Ok(true);
        }
        self.hooks.after(&*self.inner, call, Outcome::DONE);
        Ok(false)
    }

    /// Shows how a forwarded `call` ended (`done` when it succeeded) and hands its result
    /// back.
    #[track_caller]
    fn show<T>(
        &mut self,
        call: Call<'_>,
        result: Result<T, Error>,
        done: Outcome<'_>,
    ) -> Result<T, Error> {
        let outcome = match &result {
            Ok(_) => done,
            Err(e) => Outcome::Failed(e),
        };
        self.hooks.after(&*self.inner, call, outcome);
        result
    }
}

// Each method calls the inner allocator in its own body (not in a closure), so the
// caller's location reaches the inner allocator too.
impl<H: Hooks> KvAllocator for Hooked<H> {
    fn page_size(&self) -> PageSize {
        self.inner.page_size()
    }
    fn invariant_scope(&self) -> &Scope {
        self.inner.invariant_scope()
    }
    fn set_invariant_scope(&mut self, scope: Scope) {
        self.inner.set_invariant_scope(scope);
    }
    fn virtual_pages(&self) -> u32 {
        self.inner.virtual_pages()
    }
    fn alloc_extend(
        &mut self,
        requests: &[ExtendRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        let call = Call::AllocExtend(requests);
        self.gate(call)?;
        let from = out.len();
        let result = self.inner.alloc_extend(requests, out);
        let tokens = &out[from..];
        self.show(call, result, Outcome::Done { tokens, slots: &[] })
    }
    fn alloc_decode(
        &mut self,
        requests: &[DecodeRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        let call = Call::AllocDecode(requests);
        self.gate(call)?;
        let from = out.len();
        let result = self.inner.alloc_decode(requests, out);
        let tokens = &out[from..];
        self.show(call, result, Outcome::Done { tokens, slots: &[] })
    }
    fn free(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        let call = Call::FreeIds(IdFree::Both, ids);
        self.gate(call)?;
        let result = self.inner.free(ids);
        self.show(call, result, Outcome::DONE)
    }
    fn free_swa(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        let call = Call::FreeIds(IdFree::Swa, ids);
        self.gate(call)?;
        let result = self.inner.free_swa(ids);
        self.show(call, result, Outcome::DONE)
    }
    fn free_full(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
        let call = Call::FreeIds(IdFree::Full, ids);
        self.gate(call)?;
        let result = self.inner.free_full(ids);
        self.show(call, result, Outcome::DONE)
    }
    fn free_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        let op = FreeOp::Segment(segment);
        if !self.gate_free(op)? {
            return Ok(());
        }
        let result = self.inner.free_segment(segment);
        self.show(Call::Free(op), result, Outcome::DONE)
    }
    fn free_swa_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        let op = FreeOp::SwaSegment(segment);
        if !self.gate_free(op)? {
            return Ok(());
        }
        let result = self.inner.free_swa_segment(segment);
        self.show(Call::Free(op), result, Outcome::DONE)
    }
    fn free_swa_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error> {
        let call = Call::FreeSwaSegments(segments);
        self.gate(call)?;
        let result = self.inner.free_swa_segments(segments);
        self.show(call, result, Outcome::DONE)
    }
    fn free_full_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
        let op = FreeOp::FullSegment(segment);
        if !self.gate_free(op)? {
            return Ok(());
        }
        let result = self.inner.free_full_segment(segment);
        self.show(Call::Free(op), result, Outcome::DONE)
    }
    fn free_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error> {
        let call = Call::FreeSegments(segments);
        self.gate(call)?;
        let result = self.inner.free_segments(segments);
        self.show(call, result, Outcome::DONE)
    }
    fn free_kv_row_segments(
        &mut self,
        row: &[VirtualToken],
        dead_lo: usize,
        cursor: usize,
        len: usize,
    ) -> Result<(), Error> {
        let op = FreeOp::KvRow {
            row,
            dead_lo,
            cursor,
            len,
        };
        if !self.gate_free(op)? {
            return Ok(());
        }
        let result = self.inner.free_kv_row_segments(row, dead_lo, cursor, len);
        self.show(Call::Free(op), result, Outcome::DONE)
    }
    fn transfer_swa(&mut self, from: Segment<'_>, to: Segment<'_>) -> Result<(), Error> {
        let op = FreeOp::TransferSwa { from, to };
        if !self.gate_free(op)? {
            return Ok(());
        }
        let result = self.inner.transfer_swa(from, to);
        self.show(Call::Free(op), result, Outcome::DONE)
    }
    fn alloc_slots(&mut self, n: usize, out: &mut Vec<VirtualSlot>) -> Result<(), Error> {
        let call = Call::AllocSlots(n);
        self.gate(call)?;
        let from = out.len();
        let result = self.inner.alloc_slots(n, out);
        let slots = &out[from..];
        self.show(call, result, Outcome::Done { tokens: &[], slots })
    }
    fn free_slots(&mut self, slots: &[VirtualSlot]) -> Result<(), Error> {
        let op = FreeOp::Slots(slots);
        if !self.gate_free(op)? {
            return Ok(());
        }
        let result = self.inner.free_slots(slots);
        self.show(Call::Free(op), result, Outcome::DONE)
    }
    fn copy_slots(&self, pairs: &[(VirtualSlot, VirtualSlot)]) -> Result<(), Error> {
        self.inner.copy_slots(pairs)
    }
    fn physical_slot(&self, slot: VirtualSlot) -> Option<u32> {
        self.inner.physical_slot(slot)
    }
    fn free_batch(&mut self, frees: &[FreeOp<'_>]) {
        // The ops the hooks keep; a copy only once one is dropped.
        let mut kept: Option<Vec<FreeOp<'_>>> = None;
        for (i, &op) in frees.iter().enumerate() {
            match (self.hooks.forward_free(&*self.inner, op), &mut kept) {
                (true, Some(kept)) => kept.push(op),
                (false, None) => kept = Some(frees[..i].to_vec()),
                _ => {}
            }
        }
        let frees = kept.as_deref().unwrap_or(frees);
        self.inner.free_batch(frees);
        let call = Call::FreeBatch(frees);
        self.hooks.after(&*self.inner, call, Outcome::DONE);
    }
    fn free_group_begin(&mut self) -> Result<(), Error> {
        let call = Call::GroupBegin;
        self.gate(call)?;
        let result = self.inner.free_group_begin();
        self.show(call, result, Outcome::DONE)
    }
    fn free_group_end(&mut self) -> Result<(), Error> {
        let call = Call::GroupEnd;
        self.gate(call)?;
        let result = self.inner.free_group_end();
        self.show(call, result, Outcome::DONE)
    }
    fn in_free_group(&self) -> bool {
        self.inner.in_free_group()
    }
    fn pending_frees(&self) -> [(DeferredKind, usize); 5] {
        self.inner.pending_frees()
    }
    fn flush_deferred(&mut self) -> bool {
        let flushed = self.inner.flush_deferred();
        let call = Call::FlushDeferred;
        self.hooks.after(&*self.inner, call, Outcome::DONE);
        flushed
    }
    fn flush(&mut self) -> Result<FlushReport, Error> {
        let call = Call::Flush;
        self.gate(call)?;
        let result = self.inner.flush();
        self.show(call, result, Outcome::DONE)
    }
    fn allocation_fits(&self, demand: PageDemand) -> bool {
        self.inner.allocation_fits(demand)
    }
    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), Error> {
        let call = Call::EnsureCapacity(demand);
        self.gate(call)?;
        let result = self.inner.ensure_capacity(demand);
        self.show(call, result, Outcome::DONE)
    }
    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        let plan = self.inner.reclaim_plan(demand, evictable);
        let call = Call::ReclaimPlan(demand, evictable);
        self.hooks.after(&*self.inner, call, Outcome::DONE);
        plan
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
    fn upload_mirror(&mut self) -> Result<(), Error> {
        let call = Call::UploadMirror;
        self.gate(call)?;
        let result = self.inner.upload_mirror();
        self.show(call, result, Outcome::DONE)
    }
    fn mirror_current(&self) -> bool {
        self.inner.mirror_current()
    }
    fn mirror_table(&self, side: Side) -> Option<TableId> {
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
    fn translate_many(&self, rows: &[SideTranslation]) -> Result<(), Error> {
        self.inner.translate_many(rows)
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

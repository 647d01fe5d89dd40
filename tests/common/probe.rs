//! A test probe around an allocator (the `Hooks` of a `Hooked` allocator, installed with
//! `HybridCacheBuilder::wrap_allocator`): it fails a chosen method once or the n-th fallible
//! call, or loses kv-row frees (fault injection), and it can check, before forwarding
//! each free, that every page the free names is still owned — FULL live and not already
//! freed in the open group for FULL and two-sided frees, SWA live for SWA frees — so an id
//! recycled while an action naming it was unapplied would be caught where it happens.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use unikv::invariants::Invariant;
use unikv::pools::{
    Call, Error, FreeOp, Hooked, Hooks, IdFree, KvAllocator, Outcome, PageSize, Segment, SwaState,
    VirtualPage, VirtualToken,
};

/// The methods a probe can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `free_group_end`.
    FreeGroupEnd,
    /// `free_group_begin`.
    FreeGroupBegin,
    /// `upload_mirror`.
    UploadMirror,
    /// The next kv-row free (`free_kv_row_segments`, or a `FreeOp::KvRow` of a batch) is
    /// dropped without freeing: pages leak, so the next step boundary finds conservation
    /// broken.
    LoseRowFrees,
}

/// What the test and the probe share.
#[derive(Debug, Default)]
pub struct ProbeState {
    /// The next call of this method fails (without forwarding) and clears it.
    pub fail_once: Option<Fault>,
    /// The fallible calls forwarded or failed so far (every mutating method that returns
    /// a `Result`).
    pub fallible_calls: usize,
    /// The fallible call with this index fails (without forwarding), once.
    pub fail_call: Option<usize>,
    /// Faults injected so far (by `fail_once` or `fail_call`).
    pub injected: usize,
    /// Drop every kv-row free (not just the next): every release leaks its pages.
    pub lose_every_row_free: bool,
    /// Record one breach of this invariant into the allocator's scope at every mirror
    /// upload (once per step), where the inner allocator records its own.
    pub breach_each_upload: Option<&'static Invariant>,
    /// Check every free against the pages' ownership.
    pub check_frees: bool,
    /// Pages freed FULL or two-sided in the open group and not yet flushed.
    pending: HashSet<u32>,
    /// Pages each checked free named.
    pub pages_checked: usize,
    /// Frees that named a page not owned (should stay empty).
    pub violations: Vec<String>,
}

/// The probe; see the module docs.
#[derive(Debug)]
pub struct Probe(Arc<Mutex<ProbeState>>);

/// Which side(s) a free releases.
#[derive(Clone, Copy, Debug)]
enum Freed {
    Both,
    Full,
    Swa,
}

impl ProbeState {
    /// A state that checks every free.
    pub fn checking_frees() -> ProbeState {
        ProbeState {
            check_frees: true,
            ..ProbeState::default()
        }
    }
}

impl Probe {
    /// Wraps `inner`; the test keeps `state`.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(inner: Box<dyn KvAllocator>, state: Arc<Mutex<ProbeState>>) -> Hooked<Probe> {
        Hooked::new(inner, Probe(state))
    }

    fn state(&self) -> MutexGuard<'_, ProbeState> {
        self.0.lock().expect("probe state")
    }

    /// Whether `method` is armed (disarming it).
    fn armed(&self, method: Fault) -> bool {
        let mut s = self.state();
        let armed = s.fail_once == Some(method);
        if armed {
            s.fail_once = None;
        }
        armed
    }

    fn fault(&self, method: Fault) -> Result<(), Error> {
        if self.armed(method) {
            self.state().injected += 1;
            return Err(Error::BadConfig(format!("injected fault in {method:?}")));
        }
        Ok(())
    }

    /// Checks `pages` before a free of `what` and, for deferred frees, records them.
    fn check(
        &self,
        inner: &dyn KvAllocator,
        what: &str,
        freed: Freed,
        pages: impl IntoIterator<Item = VirtualPage>,
    ) {
        let mut s = self.state();
        if !s.check_frees {
            return;
        }
        let deferred = inner.in_free_group() && !matches!(freed, Freed::Swa);
        for page in pages {
            s.pages_checked += 1;
            let owned = match freed {
                Freed::Both | Freed::Full => inner.full_live(page) && !s.pending.contains(&page.0),
                Freed::Swa => inner.swa_state(page) == SwaState::Live,
            };
            if !owned {
                let pending = s.pending.contains(&page.0);
                s.violations.push(format!(
                    "{what} names page {} ({:?} freed), which is not owned: FULL live {}, SWA \
                     {:?}, freed in the open group {}",
                    page.0,
                    freed,
                    inner.full_live(page),
                    inner.swa_state(page),
                    pending
                ));
            }
            if deferred {
                s.pending.insert(page.0);
            }
        }
    }

    /// Checks the pages of one free op.
    fn check_op(&self, inner: &dyn KvAllocator, op: FreeOp<'_>) {
        let ps = inner.page_size();
        let pages = |s: Segment<'_>| segment_pages(ps, s);
        match op {
            FreeOp::Segment(s) => self.check(inner, "free_segment", Freed::Both, pages(s)),
            FreeOp::FullSegment(s) => self.check(inner, "free_full_segment", Freed::Full, pages(s)),
            FreeOp::SwaSegment(s) => self.check(inner, "free_swa_segment", Freed::Swa, pages(s)),
            FreeOp::TransferSwa { from, .. } => {
                self.check(inner, "transfer_swa", Freed::Swa, pages(from))
            }
            FreeOp::KvRow {
                row,
                dead_lo,
                cursor,
                len,
            } => {
                if dead_lo <= cursor && cursor <= len && len <= row.len() {
                    let full = pages(Segment::of_row(row, dead_lo..cursor));
                    self.check(inner, "free_kv_row_segments", Freed::Full, full);
                    let both = pages(Segment::of_row(row, cursor..len));
                    self.check(inner, "free_kv_row_segments", Freed::Both, both);
                }
            }
            // Slots have no pages for the page checks.
            FreeOp::Slots(_) => {}
        }
    }
}

fn segment_pages(ps: PageSize, segment: Segment<'_>) -> Vec<VirtualPage> {
    segment.reps(ps).map(|t| t.page(ps)).collect()
}

fn id_pages(ps: PageSize, ids: &[VirtualToken]) -> Vec<VirtualPage> {
    let mut pages: Vec<VirtualPage> = ids.iter().map(|t| t.page(ps)).collect();
    pages.dedup();
    pages
}

impl Hooks for Probe {
    fn gate(&mut self, inner: &dyn KvAllocator, call: Call<'_>) -> Result<(), Error> {
        {
            let mut s = self.state();
            let index = s.fallible_calls;
            s.fallible_calls += 1;
            if s.fail_call == Some(index) {
                s.fail_call = None;
                s.injected += 1;
                return Err(Error::BadConfig(format!(
                    "injected fault in {} (fallible call {index})",
                    call.name()
                )));
            }
        }
        let ps = inner.page_size();
        match call {
            Call::GroupBegin => self.fault(Fault::FreeGroupBegin)?,
            Call::GroupEnd => self.fault(Fault::FreeGroupEnd)?,
            Call::UploadMirror => {
                let breach = self.state().breach_each_upload;
                if let Some(invariant) = breach {
                    inner
                        .invariant_scope()
                        .expect(invariant, false, || "injected at the mirror upload".into());
                }
                self.fault(Fault::UploadMirror)?;
            }
            Call::FreeIds(which, ids) => {
                let (what, freed) = match which {
                    IdFree::Both => ("free", Freed::Both),
                    IdFree::Full => ("free_full", Freed::Full),
                    IdFree::Swa => ("free_swa", Freed::Swa),
                };
                self.check(inner, what, freed, id_pages(ps, ids));
            }
            Call::FreeSegments(segments) => {
                for &s in segments {
                    self.check(inner, "free_segments", Freed::Both, segment_pages(ps, s));
                }
            }
            Call::FreeSwaSegments(segments) => {
                for &s in segments {
                    self.check(inner, "free_swa_segments", Freed::Swa, segment_pages(ps, s));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn forward_free(&mut self, inner: &dyn KvAllocator, op: FreeOp<'_>) -> bool {
        self.check_op(inner, op);
        let lost = matches!(op, FreeOp::KvRow { .. })
            && (self.armed(Fault::LoseRowFrees) || self.state().lose_every_row_free);
        !lost
    }

    /// Once nothing is deferred, nothing freed is pending.
    fn after(&mut self, inner: &dyn KvAllocator, _: Call<'_>, _: Outcome<'_>) {
        if inner.pending_frees().iter().all(|&(_, n)| n == 0) {
            self.state().pending.clear();
        }
    }
}

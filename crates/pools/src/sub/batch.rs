//! The sub-allocator's batch passes: [`SubAllocator::release_each`] and
//! [`SubAllocator::bind_popped`], which leave the tables exactly as the page-by-page calls
//! would, writing the lists in place and a run of consecutive pages (a page-size-1 row)
//! as slice fills and ramps ([`ReleaseRun`], [`BindRun`]).

use super::dirty::DirtySpans;
use super::{Edge, SubAllocator, owner};
use crate::ramp::{RUN, fill_ramps, is_ramp, is_unit, lowest, steps};
use crate::spec::Grow;
use std::mem::MaybeUninit;

impl SubAllocator {
    /// Batch release: for each `v` of `pages` that `keep` keeps, in order, a live page is
    /// unbound as by `unbind(v, how == Release::Tombstone)` (and `v` appended to
    /// `released`), a tombstone is cleared as by `clear_tombstone(v)` under
    /// [`Release::FreeAndClear`], and any other entry is left alone. Same tables, counters,
    /// hole and dirty order as those calls one by one; the lists are written through
    /// slices reserved up front, so a page costs a few stores rather than a few
    /// `Vec::push`es (a push reloads the length from memory after every store to a table).
    ///
    /// A page-size-1 row is runs of consecutive virtual pages bound to consecutive
    /// physical pages (its prefill), or of tombstones (its window): each
    /// [`ReleaseRun`] is released with slice fills and ramps instead of page by page.
    #[inline(always)]
    pub(crate) fn release_each(
        &mut self,
        pages: &[u32],
        keep: Keep<'_>,
        how: Release,
        mut released: Option<&mut Vec<u32>>,
    ) {
        let clear_tombstones = how == Release::FreeAndClear;
        // What a released entry becomes.
        let to = if how == Release::Tombstone { -1 } else { 0 };
        if self.grow == Grow::Float {
            // A float parks when its last page goes: keep the page-by-page path.
            for &v in pages.iter().filter(|&&v| keep.keeps(v)) {
                match self.v2p[v as usize] {
                    p if p > 0 => {
                        self.unbind(v, to == -1);
                        if let Some(released) = released.as_deref_mut() {
                            released.push(v);
                        }
                    }
                    -1 if clear_tombstones => self.clear_tombstone(v),
                    _ => {}
                }
            }
            return;
        }
        let n = pages.len();
        // No `p2v` write: a released page's entry goes stale (see the field).
        let SubAllocator {
            v2p,
            holes,
            live,
            tombstones,
            dirty,
            ..
        } = self;
        let mut nothing = Vec::new();
        let record = released.is_some();
        let released = released.unwrap_or(&mut nothing);
        let (hole_base, released_base) = (holes.len(), released.len());
        // Written in place in the lists' spare room (not zero-filled first), lengths set
        // once at the end.
        holes.reserve(n);
        if record {
            released.reserve(n);
        }
        let (open, dirty_base) = DirtySpans::reopen(dirty, n);
        let mut spans = DirtySpans {
            slots: &mut dirty.spare_capacity_mut()[..n + 1],
            written: 0,
            open,
        };
        let new_holes = &mut holes.spare_capacity_mut()[..n];
        let new_released = &mut released.spare_capacity_mut()[..if record { n } else { 0 }];
        let v2p = &mut v2p[..];
        let (mut unbound, mut cleared) = (0usize, 0usize);
        let mut i = 0;
        while i < n {
            if let Some(run) = ReleaseRun::find(&pages[i..], v2p, keep, clear_tombstones) {
                // The same writes as the loop below, as slice fills and ramps.
                let len = run.len;
                let (v, sv) = run.pages;
                let v_lo = lowest((v, sv), len) as usize;
                spans.note(v_lo as u32, len as u32);
                match run.entries {
                    Some(entries) => {
                        v2p[v_lo..v_lo + len].fill(to);
                        let holes = &mut new_holes[unbound..unbound + len];
                        fill_ramps(holes, entries, (0, 1), |p, _| MaybeUninit::new(p));
                        if record {
                            let released = &mut new_released[unbound..unbound + len];
                            for (slot, &v) in released.iter_mut().zip(&pages[i..i + len]) {
                                slot.write(v);
                            }
                        }
                        unbound += len;
                    }
                    None => {
                        v2p[v_lo..v_lo + len].fill(0);
                        cleared += len;
                    }
                }
                i += len;
                continue;
            }
            let end = (i + RUN).min(n);
            for &v in &pages[i..end] {
                if !keep.keeps(v) {
                    continue;
                }
                let entry = &mut v2p[v as usize];
                let p = *entry;
                if p > 0 {
                    *entry = to;
                    new_holes[unbound].write(p as u32);
                    if record {
                        new_released[unbound].write(v);
                    }
                    spans.note_apart(v);
                    unbound += 1;
                } else if p == -1 && clear_tombstones {
                    *entry = 0;
                    spans.note_apart(v);
                    cleared += 1;
                }
            }
            i = end;
        }
        let spans = spans.close();
        // SAFETY: the loop wrote the first `unbound` entries of the hole and (when
        // recording) id slices (each page writes at the index its count has reached
        // before the count moves on), and `unbound <= n`, the room reserved; `close`
        // counts the dirty slots written.
        unsafe {
            holes.set_len(hole_base + unbound);
            dirty.set_len(dirty_base + spans);
        }
        if record {
            // SAFETY: as above.
            unsafe { released.set_len(released_base + unbound) };
        }
        *live -= unbound as u32;
        *tombstones -= cleared as u32;
        if to == -1 {
            *tombstones += unbound as u32;
        }
    }

    /// Batch bind for an allocation of the ids `popped`, as a stack pops them (the last
    /// first): for each id, takes a physical page and binds the id to it, as by
    /// `let p = take(); bind(v, p)` (the pages [`SubAllocator::handout_envelopes`]
    /// predicts). Same tables, counters, hole and dirty order as those calls one by one.
    /// The caller checked the room; the ids are distinct and not the sink.
    ///
    /// The tables and the dirty entries (written in place in the list's spare room) are
    /// filled in one pass, so no page pays for a `Vec::push` (which reloads the length
    /// from memory after every store to a table). Consecutive ids, unbound, that get
    /// consecutive physical pages (a page-size-1 prefill) are bound as a [`BindRun`]:
    /// checked [`RUN`] at a time, then written as ramps however long the run.
    pub(crate) fn bind_popped(&mut self, popped: &[u32]) {
        let n = popped.len();
        // `take` pops holes (last first), then moves the frontier one page at a time.
        let from_holes = n.min(self.holes.len());
        let hole_split = self.holes.len() - from_holes;
        let fresh = (n - from_holes) as u32;
        // The first fresh page and the step to the next.
        let (fresh_first, fresh_step) = match self.growth_edge() {
            Edge::Low => {
                let lo = self.lo;
                self.lo -= fresh;
                (lo.wrapping_sub(1), u32::MAX)
            }
            Edge::High => {
                let hi = self.hi;
                self.hi += fresh;
                (hi, 1)
            }
        };
        let SubAllocator {
            v2p,
            p2v,
            holes,
            live,
            tombstones,
            dirty,
            ..
        } = self;
        let taken = &holes[hole_split..];
        // The `t`-th bind's id and page.
        let id = |t: usize| popped[n - 1 - t];
        let page = |t: usize| {
            if t < from_holes {
                taken[from_holes - 1 - t]
            } else {
                fresh_first.wrapping_add(fresh_step.wrapping_mul((t - from_holes) as u32))
            }
        };
        let (open, dirty_base) = DirtySpans::reopen(dirty, n);
        let mut spans = DirtySpans {
            slots: &mut dirty.spare_capacity_mut()[..n + 1],
            written: 0,
            open,
        };
        let (v2p, p2v) = (&mut v2p[..], &mut p2v[..]);
        let mut revived = 0u32;
        let mut t = 0;
        while t < n {
            // Holes, then fresh pages: a run lies in one of them.
            let (pages, seg_end) = if t < from_holes {
                (Pages::Stack(&taken[..from_holes - t]), from_holes)
            } else {
                (Pages::Ramp(page(t), fresh_step), n)
            };
            if let Some(run) = BindRun::find(&popped[..n - t], pages, seg_end - t, v2p) {
                revived += run.revived;
                run.write(v2p, p2v);
                spans.note(lowest(run.ids, run.len), run.len as u32);
                t += run.len;
                continue;
            }
            let end = (t + RUN).min(seg_end);
            for t in t..end {
                let (v, p) = (id(t), page(t));
                debug_assert!(p != 0 && owner(v2p, p2v, p) == 0);
                let entry = &mut v2p[v as usize];
                revived += (*entry == -1) as u32;
                *entry = p as i32;
                p2v[p as usize] = v;
                spans.note_one(v);
            }
            t = end;
        }
        let spans = spans.close();
        // SAFETY: `close` counts the dirty slots written, from the list's length.
        unsafe { dirty.set_len(dirty_base + spans) };
        holes.truncate(hole_split);
        *live += n as u32;
        *tombstones -= revived;
    }
}

/// What a batch release [`SubAllocator::release_each`] makes of the pages it visits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Live pages are freed (the FULL side, which has no tombstones).
    Free,
    /// Live pages are freed and tombstones cleared (the SWA side of a two-sided free).
    FreeAndClear,
    /// Live pages become tombstones, the rest is left (the SWA side of a window release).
    Tombstone,
}

/// Which pages of a batch release [`SubAllocator::release_each`] visits.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Keep<'a> {
    /// Every page but the sink.
    NotSink,
    /// Every page but the sink whose entry in this table (the peer side's `v2p`) is live.
    LiveIn(&'a [i32]),
}

impl Keep<'_> {
    #[inline(always)]
    pub(super) fn keeps(self, v: u32) -> bool {
        match self {
            Keep::NotSink => v != 0,
            Keep::LiveIn(table) => v != 0 && table[v as usize] > 0,
        }
    }
}

/// Pages a batch release clears with slice writes: consecutive virtual pages (either
/// way), none the sink and each kept, all live on consecutive physical pages (either
/// way) or all tombstones.
struct ReleaseRun {
    /// The pages in the run, a multiple of [`RUN`].
    len: usize,
    /// The first page visited and the step to the next (±1).
    pages: (u32, u32),
    /// Live: the physical page of the first page visited and the step to the next's
    /// (±1). `None`: tombstones.
    entries: Option<(u32, u32)>,
}

impl ReleaseRun {
    /// The longest run, [`RUN`] pages at a time, at the start of `pages`; tombstones
    /// only when `clear_tombstones`.
    #[inline(always)]
    fn find(
        pages: &[u32],
        v2p: &[i32],
        keep: Keep<'_>,
        clear_tombstones: bool,
    ) -> Option<ReleaseRun> {
        let [v, next, ..] = *pages else { return None };
        let sv = next.wrapping_sub(v);
        if !is_unit(sv) {
            return None;
        }
        let first = *v2p.get(v as usize)?;
        let entries = if first > 0 {
            let sp = (*v2p.get(next as usize)? as u32).wrapping_sub(first as u32);
            if !is_unit(sp) {
                return None;
            }
            Some((first as u32, sp))
        } else if first == -1 && clear_tombstones {
            None
        } else {
            return None;
        };
        let page_steps = steps(sv);
        // Entries as the table lists them: in visiting order when the pages ascend, else
        // reversed.
        let entry_steps =
            entries.map(|(_, sp)| steps(if sv == 1 { sp } else { sp.wrapping_neg() }));
        let mut len = 0;
        while let Some(chunk) = pages[len..].first_chunk::<RUN>() {
            if !is_ramp(
                chunk,
                v.wrapping_add(sv.wrapping_mul(len as u32)),
                &page_steps,
            ) {
                break;
            }
            let v_lo = chunk[0].min(chunk[RUN - 1]) as usize;
            if v_lo == 0 {
                break;
            }
            let Some(table) = v2p.get(v_lo..).and_then(<[i32]>::first_chunk::<RUN>) else {
                break;
            };
            if let Keep::LiveIn(peer) = keep {
                let Some(peer) = peer.get(v_lo..v_lo + RUN) else {
                    break;
                };
                if !peer.iter().fold(true, |ok, &e| ok & (e > 0)) {
                    break;
                }
            }
            let ok = match (entries, &entry_steps) {
                (Some((p, sp)), Some(steps)) => {
                    // The entry of the chunk's lowest page.
                    let back = if sv == 1 { len } else { len + RUN - 1 } as u32;
                    let lo = p.wrapping_add(sp.wrapping_mul(back));
                    // A ramp of pages is live when both its ends are (it is monotone).
                    is_ramp(&table.map(|e| e as u32), lo, steps) && table[0].min(table[RUN - 1]) > 0
                }
                _ => table.iter().fold(true, |ok, &e| ok & (e == -1)),
            };
            if !ok {
                break;
            }
            len += RUN;
        }
        (len > 0).then_some(ReleaseRun {
            len,
            pages: (v, sv),
            entries,
        })
    }
}

/// Where a batch bind's next pages come from.
#[derive(Clone, Copy)]
enum Pages<'a> {
    /// The top of the hole stack: the last entry is taken first.
    Stack(&'a [u32]),
    /// The frontier: `(first, step)`.
    Ramp(u32, u32),
}

/// Binds a batch bind writes as ramps: the `t`-th is `(u + su·t, q + sq·t)` for steps
/// of ±1, so id `v` gets page `q + d·(v - u)` and page `p` gets id `u + d·(p - q)`,
/// with `d = su·sq`.
struct BindRun {
    /// The binds in the run, a multiple of [`RUN`].
    len: usize,
    /// The first id and the step to the next (`u`, `su`).
    ids: (u32, u32),
    /// The first page and the step to the next (`q`, `sq`).
    pages: (u32, u32),
    /// Tombstones among the ids' entries (a bind revives them).
    revived: u32,
}

impl BindRun {
    /// The longest run, [`RUN`] binds at a time and at most `max`, at the next binds:
    /// the ids from the end of `ids` backward (a stack's top), the pages from `pages`;
    /// `None` when not one [`RUN`] of ids and pages runs, or an id is bound.
    #[inline(always)]
    fn find(ids: &[u32], pages: Pages<'_>, max: usize, v2p: &[i32]) -> Option<BindRun> {
        if max < RUN {
            return None;
        }
        let (u, su) = stack_top_step(ids)?;
        let (q, sq) = match pages {
            Pages::Stack(stack) => stack_top_step(stack)?,
            Pages::Ramp(q, sq) => (q, sq),
        };
        if !(is_unit(su) && is_unit(sq)) {
            return None;
        }
        let (id_steps, page_steps) = (steps(su.wrapping_neg()), steps(sq.wrapping_neg()));
        let (mut len, mut revived) = (0usize, 0u32);
        while len + RUN <= max {
            // The next RUN binds' ids, as the stack lists them (reversed): the last is
            // bind `len`, the first bind `len + RUN - 1`.
            let back = (len + RUN - 1) as u32;
            let Some(chunk) = stack_chunk(ids, len) else {
                break;
            };
            if !is_ramp(chunk, u.wrapping_add(su.wrapping_mul(back)), &id_steps) {
                break;
            }
            if let Pages::Stack(stack) = pages {
                let Some(chunk) = stack_chunk(stack, len) else {
                    break;
                };
                if !is_ramp(chunk, q.wrapping_add(sq.wrapping_mul(back)), &page_steps) {
                    break;
                }
            }
            let v_lo = chunk[0].min(chunk[RUN - 1]) as usize;
            let Some(entries) = v2p.get(v_lo..).and_then(<[i32]>::first_chunk::<RUN>) else {
                break;
            };
            // Unbound entries are 0 (free) or -1 (a tombstone): minus their sum counts
            // the tombstones, without a popcount (which baseline x86-64 lacks).
            if !entries.iter().fold(true, |ok, &e| ok & (e == 0 || e == -1)) {
                break;
            }
            revived += entries.iter().sum::<i32>().unsigned_abs();
            len += RUN;
        }
        (len > 0).then_some(BindRun {
            len,
            ids: (u, su),
            pages: (q, sq),
            revived,
        })
    }

    /// Writes the run's entries, owners and dirty entries (`dirty`: one slot per bind).
    #[inline(always)]
    fn write(&self, v2p: &mut [i32], p2v: &mut [u32]) {
        let ((u, su), (q, sq)) = (self.ids, self.pages);
        let d = su.wrapping_mul(sq);
        let (v_lo, p_lo) = (lowest(self.ids, self.len), lowest(self.pages, self.len));
        let entry_lo = q.wrapping_add(d.wrapping_mul(v_lo.wrapping_sub(u)));
        let owner_lo = u.wrapping_add(d.wrapping_mul(p_lo.wrapping_sub(q)));
        let (v_lo, p_lo) = (v_lo as usize, p_lo as usize);
        fill_ramps(
            &mut v2p[v_lo..v_lo + self.len],
            (entry_lo, d),
            (0, 1),
            |p, _| p as i32,
        );
        fill_ramps(
            &mut p2v[p_lo..p_lo + self.len],
            (owner_lo, d),
            (0, 1),
            |v, _| v,
        );
    }
}

/// The top entry of a stack (the next popped) and the step to the one below it.
#[inline(always)]
fn stack_top_step(stack: &[u32]) -> Option<(u32, u32)> {
    let [.., below, top] = stack else {
        return None;
    };
    Some((*top, below.wrapping_sub(*top)))
}

/// The [`RUN`] entries of `stack` below its top `skip`, as listed (the last popped
/// first); `None` when fewer are left.
#[inline(always)]
fn stack_chunk(stack: &[u32], skip: usize) -> Option<&[u32; RUN]> {
    stack[..stack.len().checked_sub(skip)?].last_chunk()
}

//! Free groups: the deferred lists a group's frees wait in ([`DeferredFrees`], five of
//! them, enumerated in one place), the pages freed in the open group (epoch stamps, so a
//! page freed twice is reported), opening and closing a group, and **the** flush of
//! deferred frees that every flush site calls.

use super::{PageTables, for_each_run, sorted_pages};
use crate::api::DeferredKind;
use crate::error::Error;
use crate::ids::{VirtualSlot, VirtualToken};
use crate::invariants::ONE_FREE_PER_GROUP;
use unikv_invariants::{Scope, enabled};

/// The deferred lists of a free group. Every use of them goes through
/// [`DeferredFrees::lists`] or [`flush_deferred`], both of which destructure the struct,
/// so a new list cannot be forgotten by a flush site (the reviewed bug of the seed).
#[derive(Debug, Default)]
pub(crate) struct DeferredFrees {
    /// Set-shaped two-sided frees.
    pub(super) tokens: Vec<VirtualToken>,
    /// Two-sided segment frees, by virtual page.
    pub(super) page_reps: Vec<u32>,
    /// Set-shaped FULL-only frees.
    pub(super) full_only_tokens: Vec<VirtualToken>,
    /// FULL-only segment frees, by virtual page.
    pub(super) full_only_page_reps: Vec<u32>,
    /// Mamba state slot frees.
    pub(super) slots: Vec<VirtualSlot>,
}

impl DeferredFrees {
    /// The one enumeration of every deferred list with its length.
    pub(crate) fn lists(&self) -> [(DeferredKind, usize); 5] {
        let DeferredFrees {
            tokens,
            page_reps,
            full_only_tokens,
            full_only_page_reps,
            slots,
        } = self;
        [
            (DeferredKind::Tokens, tokens.len()),
            (DeferredKind::PageReps, page_reps.len()),
            (DeferredKind::FullOnlyTokens, full_only_tokens.len()),
            (DeferredKind::FullOnlyPageReps, full_only_page_reps.len()),
            (DeferredKind::Slots, slots.len()),
        ]
    }

    /// Whether no list holds anything (every flush asks: destructured like [`Self::lists`],
    /// without building the array).
    pub(crate) fn is_empty(&self) -> bool {
        let DeferredFrees {
            tokens,
            page_reps,
            full_only_tokens,
            full_only_page_reps,
            slots,
        } = self;
        tokens.is_empty()
            && page_reps.is_empty()
            && full_only_tokens.is_empty()
            && full_only_page_reps.is_empty()
            && slots.is_empty()
    }
}

/// Pages each segment-free list of a group holds mapped from construction (4 MiB).
const DEFERRED_RESIDENT: usize = 1 << 20;

/// A free group: open or not, its deferred lists, and (when checks are enabled) the
/// pages freed in it since the last flush, as epoch stamps per virtual page (O(1) per
/// page, no hashing; forgetting them all is one increment).
#[derive(Debug, Default)]
pub(crate) struct FreeGroup {
    pub(super) open: bool,
    pub(super) deferred: DeferredFrees,
    /// `stamps[v] == epoch`: page `v` was freed since the last flush. Grown on demand,
    /// only while checks are enabled.
    stamps: Vec<u32>,
    epoch: u32,
    /// Page list of the set-shaped free in progress.
    pub(super) scratch: Vec<u32>,
    /// `slot_pending[s]`: slot `s` is on the deferred slot list (grown on demand), so a
    /// second free of it in the group is refused before it could release it twice.
    pub(super) slot_pending: Vec<bool>,
}

impl FreeGroup {
    /// A closed group over `virtual_pages` pages. With checks enabled at construction,
    /// its stamps are sized and mapped now rather than grown (and faulted in) by the
    /// first groups; with checks off they stay empty and grow only if checks are raised.
    pub(crate) fn new(virtual_pages: u32) -> FreeGroup {
        // The segment lists (a step's row frees) are mapped now up to a bound, so the
        // first big flushes do not fault them in on the scheduling path.
        let resident = (virtual_pages as usize).min(DEFERRED_RESIDENT);
        FreeGroup {
            stamps: if enabled() {
                crate::resident::resident_table(virtual_pages as usize)
            } else {
                Vec::new()
            },
            deferred: DeferredFrees {
                page_reps: crate::resident::resident_list(resident),
                full_only_page_reps: crate::resident::resident_list(resident),
                ..DeferredFrees::default()
            },
            ..FreeGroup::default()
        }
    }

    /// Whether a group is open.
    pub(crate) fn is_open(&self) -> bool {
        self.open
    }

    /// The deferred lists.
    pub(crate) fn deferred(&self) -> &DeferredFrees {
        &self.deferred
    }

    /// Records the pages of one free call (one call frees each page once), reporting a
    /// page freed twice in this group. A set-shaped call passes its pages sorted and
    /// de-duplicated (`sorted_pages`), so each page is noted once per call.
    ///
    /// The common case, no page noted before and none listed twice, is one read-only
    /// pass and one pass of stores; anything else is reported page by page, as noted.
    pub(super) fn note_pages(&mut self, scope: &Scope, pages: &[u32]) {
        if !enabled() {
            return;
        }
        if self.epoch == 0 {
            self.epoch = 1;
        }
        let epoch = self.epoch;
        if pages.is_empty() {
            return;
        }
        // A fold of `max` vectorises, where `Iterator::max` does not.
        let top = pages.iter().fold(0, |m, &v| m.max(v));
        if top as usize >= self.stamps.len() {
            self.stamps
                .resize((top as usize + 1).next_power_of_two(), 0);
        }
        let stamps = &mut self.stamps[..];
        let mut fresh = true;
        for_each_run(pages, |v, n| {
            let run = &stamps[v as usize..v as usize + n];
            fresh &= run.iter().fold(true, |ok, &s| ok & (s != epoch));
        });
        if fresh {
            let mut repeated = false;
            for_each_run(pages, |v, n| {
                let run = &mut stamps[v as usize..v as usize + n];
                repeated |= run.iter().fold(false, |seen, &s| seen | (s == epoch));
                run.fill(epoch);
            });
            if !repeated {
                return;
            }
            // A page listed twice: every page was fresh, so unmark them all (any stamp
            // but the epoch is fresh) and note them one by one, reporting the repeat.
            for &v in pages {
                stamps[v as usize] = 0;
            }
        }
        for &v in pages {
            let fresh = stamps[v as usize] != epoch;
            stamps[v as usize] = epoch;
            scope.expect(&ONE_FREE_PER_GROUP, fresh, || {
                format!("virtual page {v} is freed twice in one free group")
            });
        }
    }

    /// Forgets which pages were freed (a flush applied them, or a new group begins).
    fn forget_freed(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.stamps.fill(0);
            self.epoch = 1;
        }
    }
}

/// Opens a group.
pub(crate) fn group_begin<T: PageTables + ?Sized>(t: &mut T) -> Result<(), Error> {
    let g = t.group();
    if g.open {
        return Err(Error::NestedFreeGroup);
    }
    g.open = true;
    g.forget_freed();
    Ok(())
}

/// Flushes and closes a group.
pub(crate) fn group_end<T: PageTables + ?Sized>(t: &mut T) -> Result<(), Error> {
    if !t.group_ref().open {
        return Err(Error::NoFreeGroup);
    }
    flush_deferred(t);
    let g = t.group();
    g.open = false;
    g.forget_freed();
    Ok(())
}

/// **The** flush of deferred frees: every list, every flush site. Applies the frees
/// (containment only: their premises were checked at enqueue) and keeps the group open.
/// Returns whether anything was pending.
#[inline]
pub(crate) fn flush_deferred<T: PageTables + ?Sized>(t: &mut T) -> bool {
    // Most flush sites find nothing pending: keep that check inlined at each of them.
    if t.group_ref().deferred.is_empty() {
        return false;
    }
    apply_deferred(t);
    true
}

/// The body of [`flush_deferred`] once something is pending.
#[inline(never)]
fn apply_deferred<T: PageTables + ?Sized>(t: &mut T) {
    let DeferredFrees {
        mut tokens,
        mut page_reps,
        mut full_only_tokens,
        mut full_only_page_reps,
        mut slots,
    } = std::mem::take(&mut t.group().deferred);
    let ps = t.ps();
    let mut pages = std::mem::take(&mut t.group().scratch);
    // Without reports, a two-sided free (either premise) and a FULL-only free are the same
    // transition: both sides go, whatever the SWA state (see `release_page_silently`).
    sorted_pages(ps, &tokens, &mut pages);
    t.release_pages(&pages);
    t.release_pages(&page_reps);
    sorted_pages(ps, &full_only_tokens, &mut pages);
    t.release_pages(&pages);
    t.release_pages(&full_only_page_reps);
    for s in &slots {
        t.group().slot_pending[s.0 as usize] = false;
        t.release_slot(s.0);
    }
    // Hand the emptied buffers back so the next group reuses their capacity.
    tokens.clear();
    page_reps.clear();
    full_only_tokens.clear();
    full_only_page_reps.clear();
    slots.clear();
    let g = t.group();
    g.deferred = DeferredFrees {
        tokens,
        page_reps,
        full_only_tokens,
        full_only_page_reps,
        slots,
    };
    g.scratch = pages;
    g.forget_freed();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_groups_segment_lists_are_mapped_at_construction_up_to_their_bound() {
        let small = FreeGroup::new(1000);
        for list in [
            &small.deferred.page_reps,
            &small.deferred.full_only_page_reps,
        ] {
            assert!(list.is_empty() && list.capacity() >= 1000);
        }
        let big = FreeGroup::new(3 * DEFERRED_RESIDENT as u32);
        assert!(big.deferred.page_reps.capacity() >= DEFERRED_RESIDENT);
        assert!(
            big.deferred.page_reps.capacity() < 2 * DEFERRED_RESIDENT,
            "capped"
        );
    }

    #[test]
    fn the_enumeration_names_every_list() {
        let d = DeferredFrees {
            tokens: vec![VirtualToken(1)],
            page_reps: vec![1; 2],
            full_only_tokens: vec![VirtualToken(2); 3],
            full_only_page_reps: vec![2; 4],
            slots: vec![VirtualSlot(1); 5],
        };
        assert_eq!(
            d.lists(),
            [
                (DeferredKind::Tokens, 1),
                (DeferredKind::PageReps, 2),
                (DeferredKind::FullOnlyTokens, 3),
                (DeferredKind::FullOnlyPageReps, 4),
                (DeferredKind::Slots, 5),
            ]
        );
        assert!(!d.is_empty());
        assert!(DeferredFrees::default().is_empty());
        // The slot list alone makes them non-empty (a flush would otherwise skip it).
        let only_slots = DeferredFrees {
            slots: vec![VirtualSlot(1)],
            ..DeferredFrees::default()
        };
        assert!(!only_slots.is_empty());
        assert_eq!(only_slots.lists()[4], (DeferredKind::Slots, 1));
    }
}

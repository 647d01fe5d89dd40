//! The sub-allocator's dirty mirror entries: the `v2p` spans changed since the last
//! upload, noted as the tables change (merged into the last span when they abut) and
//! read, then forgotten, by the mirror upload; and [`DirtySpans`], the in-place writer a
//! batch pass notes them through.

use super::SubAllocator;
use std::mem::MaybeUninit;

impl SubAllocator {
    /// Records that `v`'s mirror entry changed.
    #[inline(always)]
    pub(super) fn mark(&mut self, v: u32) {
        note_dirty(&mut self.dirty, v, 1);
    }

    /// The mirror entries changed since the last upload, as `(first virtual page,
    /// pages)` spans of `v2p` (they may overlap; the upload copies them from
    /// [`SubAllocator::v2p_table`] as it is then). They stay until
    /// [`SubAllocator::clear_dirty`] (after the upload succeeded), so a failed upload is
    /// retried whole.
    pub fn dirty_spans(&self) -> &[(u32, u32)] {
        &self.dirty
    }

    /// The whole `v2p` table, indexed by virtual page (what the mirror copies).
    pub fn v2p_table(&self) -> &[i32] {
        &self.v2p
    }

    /// Forgets the dirty spans (the mirror now holds them).
    pub fn clear_dirty(&mut self) {
        self.dirty.clear();
    }

    /// Mirror entries waiting for the upload: the pages the dirty spans cover (a page in
    /// two overlapping spans counts twice). O(spans).
    pub fn dirty_count(&self) -> usize {
        self.dirty.iter().map(|&(_, n)| n as usize).sum()
    }

    /// Whether any mirror entry is dirty.
    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }
}

/// The span `(s, l)` grown by entries `start..start + len` when they lie in it or abut it
/// on either side (consecutive pages, ascending or descending, are one span); `None` when
/// they are apart. An empty span `(0, 0)` grows only by a span starting at 0.
#[inline(always)]
fn merge((s, l): (u32, u32), start: u32, len: u32) -> Option<(u32, u32)> {
    if start >= s && start + len <= s + l {
        Some((s, l)) // already in it (a page changed twice)
    } else if start == s + l {
        Some((s, l + len))
    } else if start + len == s {
        Some((start, l + len))
    } else {
        None
    }
}

/// Notes entries `start..start + len` dirty in `dirty`, merged into the last span
/// when they can be.
#[inline(always)]
pub(super) fn note_dirty(dirty: &mut Vec<(u32, u32)>, start: u32, len: u32) {
    match dirty.last_mut() {
        Some(last) => match merge(*last, start, len) {
            Some(grown) => *last = grown,
            None => dirty.push((start, len)),
        },
        None => dirty.push((start, len)),
    }
}

/// A batch pass's dirty spans, written in place into the list's spare room rather than
/// by a `Vec::push` per page: the span being grown stays open (in registers) and is
/// stored when a page does not merge into it. [`DirtySpans::note`] merges as
/// [`note_dirty`] does; the page-by-page notes test less (see each).
pub(super) struct DirtySpans<'a> {
    /// The spare room: one slot per note, and one for the open span.
    pub(super) slots: &'a mut [MaybeUninit<(u32, u32)>],
    /// Slots written.
    pub(super) written: usize,
    /// The span being grown; `(0, 0)` when none.
    pub(super) open: (u32, u32),
}

impl DirtySpans<'_> {
    /// Takes the list's last span back as the open one and reserves room for `notes`
    /// notes; returns the list's length then, for [`DirtySpans::close`]'s count.
    pub(super) fn reopen(list: &mut Vec<(u32, u32)>, notes: usize) -> ((u32, u32), usize) {
        let open = list.pop().unwrap_or((0, 0));
        list.reserve(notes + 1);
        (open, list.len())
    }

    /// Notes entries `start..start + len` dirty.
    #[inline(always)]
    pub(super) fn note(&mut self, start: u32, len: u32) {
        match merge(self.open, start, len) {
            Some(grown) => self.open = grown,
            None => {
                if self.open.1 > 0 {
                    self.slots[self.written].write(self.open);
                    self.written += 1;
                }
                self.open = (start, len);
            }
        }
    }

    /// Notes entry `v` dirty, page by page: it grows the open span only when it comes
    /// right after it (one predictable test for scattered pages; a page that merges no
    /// other way starts a span of its own, which may overlap another).
    #[inline(always)]
    pub(super) fn note_one(&mut self, v: u32) {
        let (s, l) = self.open;
        if l != 0 && v == s.wrapping_add(l) {
            self.open.1 += 1;
        } else {
            if l != 0 {
                self.slots[self.written].write(self.open);
                self.written += 1;
            }
            self.open = (v, 1);
        }
    }

    /// Notes entry `v` dirty as a span of its own, with no merge test: for a
    /// page-by-page release, whose pages (a decode batch's, scattered over the rows)
    /// seldom abut. The open span stays open (the spans' order does not matter).
    #[inline(always)]
    pub(super) fn note_apart(&mut self, v: u32) {
        self.slots[self.written].write((v, 1));
        self.written += 1;
    }

    /// Stores the open span; returns how many slots (from the first) hold spans.
    pub(super) fn close(mut self) -> usize {
        if self.open.1 > 0 {
            self.slots[self.written].write(self.open);
            self.written += 1;
        }
        self.written
    }
}

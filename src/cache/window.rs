//! The sliding window: SWA KV a request's rows left behind is released once the cursor
//! lags by the eviction interval, one request ([`HybridCache::release_out_of_window`]) or
//! a batch in one allocator call (before a decode or verify batch allocates).
//!
//! The release keeps the window rounded up to whole pages behind the last whole page
//! (`⌊len⌋ − ⌈W⌉`), so a finished conversation's follow-up turn can end its match there
//! even when the page size does not divide the window
//! (`a_follow_up_turn_hits_its_history_whatever_the_page_size_and_window`). The cursor
//! only moves up, in whole pages, never below the tree-owned prefix
//! (`s20_ratchet_keeps_the_window_live_and_only_moves_up_in_pages`,
//! `s21_window_eviction_never_frees_the_tree_owned_prefix`). The batch form checks every
//! segment before any page is freed, and at page size 1 without checks is one
//! release pass in the pools (`a_window_batch_equals_the_segment_frees_one_by_one`,
//! `a_window_batch_without_checks_equals_the_checked_page_by_page_release`).

use super::HybridCache;
use crate::error::Error;
use crate::request::Request;
use unikv_pools::Segment;

impl HybridCache {
    /// Releases the SWA KV of `req`'s rows that left the window: once the cursor lags by at
    /// least the eviction interval, it moves up to `⌊len⌋ − ⌈W⌉` (whole pages: `len`
    /// rounded down, the window rounded up). So the live SWA behind the last whole page,
    /// where a follow-up turn's match ends, covers at least a window even when the page
    /// size does not divide it; and the live SWA behind `len` covers one too. The cursor
    /// only moves up, stays page-aligned and never goes below the tree-owned prefix.
    /// Returns the tokens released. Called by the alloc methods; engines may call it too.
    pub fn release_out_of_window(&mut self, req: &mut Request) -> Result<usize, Error> {
        self.check_owner(req)?;
        let Some(rows) = self.out_of_window(req) else {
            return Ok(0);
        };
        self.alloc
            .free_swa_segment(Segment::of_row(&req.row, rows.clone()))?;
        self.window_released(req, rows.end)?;
        Ok(rows.len())
    }

    /// The rows of `req` whose SWA [`HybridCache::release_out_of_window`] releases now
    /// (from the cursor to the new cursor), if any.
    fn out_of_window(&self, req: &Request) -> Option<std::ops::Range<usize>> {
        if !self.has_swa {
            return None;
        }
        // Every unsettled verify position lies past the settled rows, so a window behind
        // them is behind every position a verify reads (`W + k` rows stay live).
        let len = req.settled_len();
        let evicted = req.cursor.max(req.protected);
        let keep = self.window.div_ceil(self.ps) * self.ps;
        if len < evicted + keep + self.interval {
            return None;
        }
        let new_cursor = len / self.ps * self.ps - keep;
        (new_cursor > evicted).then_some(evicted..new_cursor)
    }

    /// Moves `req`'s cursor to `new_cursor` once the SWA below it is freed.
    pub(super) fn window_released(
        &mut self,
        req: &mut Request,
        new_cursor: usize,
    ) -> Result<(), Error> {
        let before = self.held(req);
        req.cursor = new_cursor;
        self.account(before, self.held(req));
        // Once the window has left the cached prefix, the prefix's SWA may be evicted.
        if let Some(lock) = req.lock
            && !req.window_lock_released
            && new_cursor >= req.protected
        {
            self.tree.release_window(lock)?;
            req.window_lock_released = true;
            self.epoch += 1;
        }
        Ok(())
    }

    /// Releases the SWA of every request of the batch that left the window of its settled
    /// rows, in one allocator call (every segment checked before any page is freed).
    pub(super) fn release_batch_windows(
        &mut self,
        batch: &mut [&mut Request],
    ) -> Result<(), Error> {
        let released: Vec<(usize, std::ops::Range<usize>)> = batch
            .iter()
            .enumerate()
            .filter_map(|(i, req)| self.out_of_window(req).map(|rows| (i, rows)))
            .collect();
        if released.is_empty() {
            return Ok(());
        }
        let segments: Vec<Segment<'_>> = released
            .iter()
            .map(|(i, rows)| Segment::of_row(&batch[*i].row, rows.clone()))
            .collect();
        self.alloc.free_swa_segments(&segments)?;
        for (i, rows) in released {
            self.window_released(batch[i], rows.end)?;
        }
        Ok(())
    }
}

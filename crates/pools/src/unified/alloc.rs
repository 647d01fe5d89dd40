//! The unified pool's allocation paths: checking a batch (extend or decode), one
//! transaction per allocation (room, device work, then the binds) and the handouts that
//! bind the pages on top of the id stack and write the tokens, with the page-by-page form
//! for a stack that breaks the room check's promise; and the slot handout.

use super::{FloatFit, Source, UnifiedSwa, ix};
use crate::api::{DecodeRequest, ExtendRequest, PageDemand};
use crate::error::Error;
use crate::frees;
use crate::ids::{PageSize, VirtualSlot, VirtualToken};
use crate::invariants::ROOM_CHECK;
use crate::spec::Side;
use crate::sub::{Edge, SpanView};

impl UnifiedSwa {
    /// Checks every request; returns the new pages and the tokens the batch hands out.
    fn validate(
        &self,
        requests: impl Iterator<Item = ExtendRequest>,
    ) -> Result<(usize, usize), Error> {
        let ps = self.ps;
        let mut totals = (0usize, 0usize);
        for (index, r) in requests.enumerate() {
            frees::check_request(index, &r, ps, &mut totals)?;
            if !ps.is_aligned(r.prefix_len) {
                self.check_last_token(index, r.prefix_len, r.last_token)?;
            }
        }
        Ok(totals)
    }

    /// Checks a decode batch (one token each); returns the new pages it needs: one per
    /// request whose row ends on a page boundary.
    fn validate_decode(&self, requests: &[DecodeRequest]) -> Result<usize, Error> {
        let ps = self.ps;
        let mut pages = 0;
        for (index, d) in requests.iter().enumerate() {
            if ps.is_aligned(d.prefix_len) {
                pages += 1;
            } else {
                self.check_last_token(index, d.prefix_len, d.last_token)?;
            }
        }
        Ok(pages)
    }

    /// Request `index` holds `prefix_len` tokens, not a whole number of pages: its last
    /// token must be live, at row position `prefix_len - 1` of its page.
    #[inline(always)]
    fn check_last_token(
        &self,
        index: usize,
        prefix_len: usize,
        last: Option<VirtualToken>,
    ) -> Result<(), Error> {
        let ps = self.ps;
        let live = last.is_some_and(|last| {
            let v = last.page(ps).0;
            last.offset(ps) as usize == ps.offset_of(prefix_len - 1)
                && v != 0
                && v < self.virtual_pages
                && self.full.v2p[v as usize] > 0
        });
        if live {
            Ok(())
        } else {
            Err(Self::bad_last_token(index, prefix_len, last))
        }
    }

    /// The refusal of [`UnifiedSwa::check_last_token`] (kept out of the per-request loop).
    #[cold]
    fn bad_last_token(index: usize, prefix_len: usize, last: Option<VirtualToken>) -> Error {
        Error::BadRequest {
            index,
            reason: match last {
                None => format!("prefix of {prefix_len} tokens without a last token"),
                Some(last) => format!(
                    "last token {last} is not a live token at row position {}",
                    prefix_len - 1
                ),
            },
        }
    }

    /// Hands out the batch's tokens: each request's free tail first, then `pages` new
    /// joint pages, in the order the id stack pops them. The caller checked the requests
    /// and the room.
    fn extend_unchecked(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest> + Clone,
        pages: usize,
        out: &mut Vec<VirtualToken>,
    ) {
        let Some(first) = self.bind_top(pages) else {
            return self.extend_page_by_page(requests, out);
        };
        let stack = self.free_ids.stack();
        let ids = &stack[first..];
        let page_size = self.ps;
        let ps = page_size.get() as usize;
        let mut next = ids.iter().rev();
        if ps == 1 {
            // A page is a token: each request's tokens are its ids, copied in one
            // exact-size extend.
            for r in requests {
                let pos = Self::fill_tail(page_size, &r, out);
                let tokens = r.seq_len.saturating_sub(pos);
                out.extend(next.by_ref().take(tokens).map(|&v| VirtualToken(v)));
            }
            stack.truncate(first);
            return;
        }
        for r in requests {
            let mut pos = Self::fill_tail(page_size, &r, out);
            // `pages` is the sum of the requests' new pages: an id is there for each.
            while pos < r.seq_len
                && let Some(&v) = next.next()
            {
                let n = (r.seq_len - pos).min(ps);
                let base = v * ps as u32;
                if n == 1 {
                    out.push(VirtualToken(base));
                } else {
                    out.extend((0..n as u32).map(|o| VirtualToken(base + o)));
                }
                pos += n;
            }
        }
        stack.truncate(first);
    }

    /// Binds both sides of the `pages` ids on top of the id stack (the ids `pages` pops
    /// would return, last first) and returns where they start; the caller hands them out
    /// and truncates the stack there. `None`, binding nothing, when the stack breaks the
    /// room check's promise (too few ids, or the sink among them).
    fn bind_top(&mut self, pages: usize) -> Option<usize> {
        let stack = self.free_ids.stack();
        let first = stack.len().checked_sub(pages)?;
        let ids = &stack[first..];
        if ids.contains(&0) {
            return None;
        }
        // FULL then SWA, each side's takes and binds in id order: the same tables, holes
        // and dirty entries as binding both sides page by page.
        self.full.bind_popped(ids);
        if let Some(swa) = &mut self.swa {
            swa.bind_popped(ids);
        }
        Some(first)
    }

    /// The decode form of [`UnifiedSwa::extend_unchecked`]: each request's token is the
    /// next slot of its last page or, when its row ends on a page boundary, the first
    /// token of the next new page (`pages` of them, in pop order). The caller checked the
    /// requests (`pages` is [`UnifiedSwa::validate_decode`]'s count) and the room.
    fn decode_unchecked(
        &mut self,
        requests: &[DecodeRequest],
        pages: usize,
        out: &mut Vec<VirtualToken>,
    ) {
        let Some(first) = self.bind_top(pages) else {
            let requests = requests.iter().map(|&d| ExtendRequest::from(d));
            return self.extend_page_by_page(requests, out);
        };
        let ps = self.ps;
        let stack = self.free_ids.stack();
        let mut next = stack[first..].iter().rev();
        out.extend(requests.iter().map(|d| match d.last_token {
            Some(last) if !ps.is_aligned(d.prefix_len) => VirtualToken(last.0 + 1),
            // One id per aligned request: `validate_decode` counted them.
            _ => VirtualToken(next.next().map_or(0, |&v| v * ps.get())),
        }));
        stack.truncate(first);
    }

    /// Appends the tokens after `r.last_token` up to the end of its page (or the
    /// request's end); returns the row position reached.
    #[inline]
    fn fill_tail(page_size: PageSize, r: &ExtendRequest, out: &mut Vec<VirtualToken>) -> usize {
        let pos = r.prefix_len;
        let offset = page_size.offset_of(pos);
        match r.last_token {
            Some(last) if offset != 0 => {
                let tail_end = (pos - offset + page_size.get() as usize).min(r.seq_len);
                let first = last.0 + 1;
                out.extend((0..(tail_end - pos) as u32).map(|i| VirtualToken(first + i)));
                tail_end
            }
            _ => pos,
        }
    }

    /// The page-by-page form of [`UnifiedSwa::extend_unchecked`], for a stack that breaks
    /// the room check's promise (too few ids, or the sink on it): it stops at the breach
    /// and reports it.
    #[cold]
    fn extend_page_by_page(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest>,
        out: &mut Vec<VirtualToken>,
    ) {
        let page_size = self.ps;
        let ps = page_size.get() as usize;
        for r in requests {
            let mut pos = Self::fill_tail(page_size, &r, out);
            while pos < r.seq_len {
                // The caller checked the room, which covers the virtual ids.
                let Some(v) = self.free_ids.pop().filter(|&v| v != 0) else {
                    self.scope.expect(&ROOM_CHECK, false, || {
                        "an allocation ran out of virtual ids past its room check".to_string()
                    });
                    break;
                };
                let pf = self.full.take();
                self.full.bind(v, pf);
                if let Some(swa) = &mut self.swa {
                    let psw = swa.take();
                    swa.bind(v, psw);
                }
                let n = (r.seq_len - pos).min(ps);
                let base = v * ps as u32;
                out.extend((0..n as u32).map(|o| VirtualToken(base + o)));
                pos += n;
            }
        }
    }

    /// An allocation as one transaction: validate, size the room, plan any compaction
    /// or relay and the envelopes to zero, issue the device work (moves, then zeroing),
    /// and only then commit the moves and bind the pages. A failed device op leaves every
    /// table, list and counter as it was (the device wrote only pages nothing points to),
    /// except that a relay's first rung may have packed the ends ([`UnifiedSwa::plan_room`]).
    pub(super) fn alloc(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest> + Clone,
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        let (pages, tokens) = self.validate(requests.clone())?;
        self.prepare_handout(Side::Full, PageDemand::joint(pages), pages)?;
        out.reserve(tokens);
        self.extend_unchecked(requests, pages, out);
        Ok(())
    }

    /// [`UnifiedSwa::alloc`] for a decode batch, through the one-token forms of its
    /// check and handout.
    pub(crate) fn alloc_one_each(
        &mut self,
        requests: &[DecodeRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        let pages = self.validate_decode(requests)?;
        self.prepare_handout(Side::Full, PageDemand::joint(pages), pages)?;
        out.reserve(requests.len());
        self.decode_unchecked(requests, pages, out);
        Ok(())
    }

    /// Everything before an allocation's binds of `n` pages (`Side::Full`: FULL and any
    /// SWA page of each) or `n` slots (`Side::Mamba`) for demand `d`: the room, the
    /// planned moves and the zeroing issued, then the moves committed and the float
    /// steered. A failed device op commits nothing.
    pub(super) fn prepare_handout(
        &mut self,
        what: Side,
        d: PageDemand,
        n: usize,
    ) -> Result<(), Error> {
        let (from, float) = self.plan_room(d)?;
        if let Err(e) = self.issue_handout_work(what, n, from, float) {
            self.drop_plans();
            return Err(e);
        }
        self.commit_plans(from);
        self.steer_float(float);
        Ok(())
    }

    /// The device half of an allocation of `n` pages or slots (see
    /// [`UnifiedSwa::prepare_handout`]): the planned moves, then the zeroing of the
    /// envelopes the binds will take (predicted from the state after the planned moves,
    /// and for the float from where `float` puts its pages). Changes no host table.
    fn issue_handout_work(
        &mut self,
        what: Side,
        n: usize,
        from: Source,
        float: FloatFit,
    ) -> Result<(), Error> {
        if from != Source::AsIs {
            self.issue_moves()?;
        }
        if self.zero_on_handout && n > 0 {
            let mut spans = std::mem::take(&mut self.spans);
            spans.clear();
            let sides: &[Side] = match what {
                Side::Mamba => &[Side::Mamba],
                _ => &[Side::Full, Side::Swa],
            };
            let is_float = self.float().is_some();
            for &side in sides {
                let Some(sub) = self.side(side) else { continue };
                let planned = match from {
                    Source::AsIs => None,
                    Source::Compacted => self.plans[ix(side)].view(),
                    Source::Relaid if side == Side::Swa => self.relay.view(),
                    Source::Relaid => None,
                };
                let (view, edge) = match (side == Side::Swa && is_float, float) {
                    (true, FloatFit::Place(at)) => (
                        SpanView {
                            holes: &[],
                            lo: at,
                            hi: at,
                        },
                        Edge::High,
                    ),
                    (true, FloatFit::Grow(edge)) => (planned.unwrap_or(sub.view()), edge),
                    _ => (planned.unwrap_or(sub.view()), sub.growth_edge()),
                };
                sub.handout_envelopes(n, view, edge, &mut spans);
            }
            let filled = self.device.fill_spans(self.buffer, &spans, 0);
            self.spans = spans;
            filled?;
        }
        Ok(())
    }

    /// Hands out `n` slots (the caller checked the room), appending their ids to `out`.
    pub(super) fn bind_slots(&mut self, n: usize, out: &mut Vec<VirtualSlot>) {
        let Some(mamba) = &mut self.mamba else { return };
        for _ in 0..n {
            let Some(s) = self.slot_ids.pop().filter(|&s| s != 0) else {
                self.scope.expect(&ROOM_CHECK, false, || {
                    "a slot allocation ran out of virtual slots past its room check".to_string()
                });
                return;
            };
            let p = mamba.take();
            mamba.bind(s, p);
            out.push(VirtualSlot(s));
        }
    }
}

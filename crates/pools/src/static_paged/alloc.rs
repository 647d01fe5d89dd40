//! The static baseline's allocation paths: the room checks against the free stacks, a
//! page allocation (extend or decode) and a slot allocation, each one transaction (size
//! it, zero the envelopes the pops will hand out, and only then bind).

use super::StaticSwa;
use crate::api::{DecodeRequest, ExtendRequest, PageDemand};
use crate::error::Error;
use crate::frees;
use crate::ids::{VirtualSlot, VirtualToken};
use crate::invariants::ROOM_CHECK;
use unikv_kernels::ByteSpan;

impl StaticSwa {
    /// Whether the page demand fits with `r_f`/`r_s` pages reclaimed. Without an SWA
    /// side an SWA demand is vacuous: nothing binds SWA.
    pub(super) fn fits(&self, d: PageDemand, r_f: usize, r_s: usize) -> bool {
        d.full_pages <= self.free_full.len().saturating_add(r_f)
            && (!self.swa_side || d.swa_pages <= self.free_swa.len().saturating_add(r_s))
    }

    /// Whether the slot demand fits with `r_m` slots reclaimed (static: free slots only,
    /// no byte budget is shared with the KV pools).
    pub(super) fn fits_slots(&self, d: PageDemand, r_m: usize) -> bool {
        d.mamba_slots <= self.free_slots.len().saturating_add(r_m)
    }

    /// Pages a joint allocation could get now.
    pub(super) fn joint_free(&self) -> usize {
        if self.swa_side {
            self.free_full.len().min(self.free_swa.len())
        } else {
            self.free_full.len()
        }
    }

    /// The short-capacity error of a slot demand.
    pub(super) fn out_of_slots(&self) -> Error {
        // The trait's short-capacity error; its page counts are zero because only slots
        // were asked for, and `available_pages` is the free slot count.
        Error::OutOfCapacity {
            full_pages: 0,
            swa_pages: 0,
            available_pages: self.free_slots.len(),
        }
    }

    /// A slot allocation as one transaction: size it, zero the envelopes the pops will
    /// hand out (the top of the free stack) on the device, and only then bind. A failed
    /// zeroing changes nothing.
    pub(super) fn alloc_slot_ids(
        &mut self,
        n: usize,
        out: &mut Vec<VirtualSlot>,
    ) -> Result<(), Error> {
        if self.slot_mirror.is_none() {
            return Err(Error::NoSlotPool { op: "alloc_slots" });
        }
        if n == 0 {
            return Ok(());
        }
        if n > self.free_slots.len() {
            return Err(self.out_of_slots());
        }
        let handed = self.free_slots.len() - n..;
        if self.zero_on_handout {
            let (grid, base) = (self.slot_grid, self.slot_base);
            self.spans.clear();
            self.spans.extend(
                self.free_slots[handed.clone()]
                    .iter()
                    .rev()
                    .map(|&s| ByteSpan {
                        offset: grid.offset(base + s - 1),
                        len: grid.envelope,
                    }),
            );
            self.device.fill_spans(self.buffer, &self.spans, 0)?;
        }
        out.reserve(n);
        for _ in 0..n {
            // `n` entries checked above.
            let Some(s) = self.free_slots.pop() else {
                break;
            };
            self.slot_live[s as usize] = true;
            self.live_slots += 1;
            self.mark_slot(s);
            out.push(VirtualSlot(s));
        }
        Ok(())
    }

    fn validate(&self, requests: impl Iterator<Item = ExtendRequest>) -> Result<usize, Error> {
        let ps = self.ps;
        let mut totals = (0usize, 0usize);
        for (index, r) in requests.enumerate() {
            frees::check_request(index, &r, ps, &mut totals)?;
            if !ps.is_aligned(r.prefix_len) {
                let ok = r.last_token.is_some_and(|last| {
                    let v = last.page(ps).0 as usize;
                    last.offset(ps) as usize == (r.prefix_len - 1) % ps.get() as usize
                        && v != 0
                        && v < self.full_live.len()
                        && self.full_live[v]
                });
                if !ok {
                    return Err(Error::BadRequest {
                        index,
                        reason: format!(
                            "last token {:?} is not a live token at row position {}",
                            r.last_token,
                            r.prefix_len - 1
                        ),
                    });
                }
            }
        }
        Ok(totals.0)
    }

    /// A decode batch: an extend by one token per request.
    pub(crate) fn alloc_one_each(
        &mut self,
        requests: &[DecodeRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        self.alloc(requests.iter().map(|&d| ExtendRequest::from(d)), out)
    }

    /// An allocation as one transaction: validate, size the room, zero the envelopes
    /// the pops will hand out (the tops of the two free stacks) on the device, and only
    /// then bind. A failed zeroing changes nothing.
    pub(super) fn alloc(
        &mut self,
        requests: impl Iterator<Item = ExtendRequest> + Clone,
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), Error> {
        let pages = self.validate(requests.clone())?;
        if !self.fits(PageDemand::joint(pages), 0, 0) {
            return Err(Error::OutOfCapacity {
                full_pages: pages,
                swa_pages: if self.swa_side { pages } else { 0 },
                available_pages: self.joint_free(),
            });
        }
        if self.zero_on_handout && pages > 0 {
            let (fg, sg, full_base) = (self.full_grid, self.swa_grid, self.full_base);
            let spans = &mut self.spans;
            spans.clear();
            // `fits` checked both stacks hold `pages` entries (SWA's only with an SWA
            // side); pops take the last first.
            let full = &self.free_full[self.free_full.len() - pages..];
            let swa = if self.swa_side {
                &self.free_swa[self.free_swa.len() - pages..]
            } else {
                &[]
            };
            spans.extend(full.iter().rev().map(|&v| ByteSpan {
                offset: fg.offset(full_base + v - 1),
                len: fg.envelope,
            }));
            spans.extend(swa.iter().rev().map(|&s| ByteSpan {
                offset: sg.offset(s),
                len: sg.envelope,
            }));
            self.device.fill_spans(self.buffer, spans, 0)?;
        }
        let ps = self.ps.get() as usize;
        for r in requests {
            let mut pos = r.prefix_len;
            if pos % ps != 0
                && let Some(last) = r.last_token
            {
                let tail_end = (pos - pos % ps + ps).min(r.seq_len);
                let mut t = last.0;
                while pos < tail_end {
                    t += 1;
                    out.push(VirtualToken(t));
                    pos += 1;
                }
            }
            while pos < r.seq_len {
                if self.free_full.is_empty() || (self.swa_side && self.free_swa.is_empty()) {
                    self.scope.expect(&ROOM_CHECK, false, || {
                        "an allocation ran out of pages past its room check".to_string()
                    });
                    break;
                }
                let Some(v) = self.free_full.pop() else {
                    break;
                };
                self.full_live[v as usize] = true;
                if self.swa_side
                    && let Some(s) = self.free_swa.pop()
                {
                    if self.swa_of[v as usize] == -1 {
                        self.tombstones -= 1;
                    }
                    self.swa_of[v as usize] = s as i32;
                    self.swa_owner[(s - self.swa_base) as usize] = v;
                    self.swa_live += 1;
                }
                self.mark(v);
                let n = (r.seq_len - pos).min(ps);
                let base = v * ps as u32;
                out.extend((0..n as u32).map(|o| VirtualToken(base + o)));
                pos += n;
            }
        }
        Ok(())
    }
}

//! The free family's Mamba state slot path: the slot check every slot call runs before
//! anything changes, slot frees (deferred in a group through the slot list) and
//! copy-on-write slot copies ([`SlotCopy`] is the layouts' device half).

use super::PageTables;
use crate::error::{Error, SlotFault};
use crate::ids::VirtualSlot;

/// Refuses, before anything changes, a slot list a free could not take: no slot pool
/// ([`Error::NoSlotPool`]), or a slot outside the id space, the sink, not live, named
/// twice in `slots`, or already pending in the open group ([`Error::BadSlot`]). Slots
/// are few per call (a request's states), so the duplicate check is a sort of a copy.
pub(crate) fn check_slots<T: PageTables + ?Sized>(
    t: &T,
    slots: &[VirtualSlot],
    op: &'static str,
) -> Result<(), Error> {
    let ids = t.slot_ids();
    if ids == 0 {
        return Err(Error::NoSlotPool { op });
    }
    let bad = |slot: u32, reason| Err(Error::BadSlot { op, slot, reason });
    let pending = &t.group_ref().slot_pending;
    for &VirtualSlot(s) in slots {
        if s >= ids {
            return bad(s, SlotFault::OutOfRange { slots: ids });
        }
        if s == 0 {
            return bad(s, SlotFault::Sink);
        }
        if !t.slot_live(s) {
            return bad(s, SlotFault::NotLive);
        }
        if pending.get(s as usize).copied().unwrap_or(false) {
            return bad(s, SlotFault::NamedTwice);
        }
    }
    if slots.len() > 1 {
        let mut sorted: Vec<u32> = slots.iter().map(|s| s.0).collect();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return bad(w[0], SlotFault::NamedTwice);
        }
    }
    Ok(())
}

/// Frees Mamba state slots (checked by [`check_slots`]; a refusal changes nothing).
/// Deferred inside a free group through the slot list, like every other deferred free.
pub(crate) fn free_slots<T: PageTables + ?Sized>(
    t: &mut T,
    slots: &[VirtualSlot],
) -> Result<(), Error> {
    check_slots(t, slots, "free_slots")?;
    if t.group_ref().open {
        let g = t.group();
        for &VirtualSlot(s) in slots {
            if s as usize >= g.slot_pending.len() {
                g.slot_pending
                    .resize((s as usize + 1).next_power_of_two(), false);
            }
            g.slot_pending[s as usize] = true;
        }
        g.deferred.slots.extend_from_slice(slots);
    } else {
        for &VirtualSlot(s) in slots {
            t.release_slot(s);
        }
    }
    Ok(())
}

/// The layouts' device half of [`crate::KvAllocator::copy_slots`].
pub(crate) trait SlotCopy: PageTables {
    /// Issues one envelope copy per pair (each slot checked live, the pairs checked).
    fn issue_slot_copies(&self, pairs: &[(VirtualSlot, VirtualSlot)]) -> Result<(), Error>;
}

/// Copies slot states: every slot live, no destination a source or named twice
/// ([`Error::BadSlot`], nothing issued), then the layout issues the copies.
pub(crate) fn copy_slots<T: SlotCopy + ?Sized>(
    t: &T,
    pairs: &[(VirtualSlot, VirtualSlot)],
) -> Result<(), Error> {
    if pairs.is_empty() {
        return Ok(());
    }
    let op = "copy_slots";
    let ids = t.slot_ids();
    if ids == 0 {
        return Err(Error::NoSlotPool { op });
    }
    for &(VirtualSlot(src), VirtualSlot(dst)) in pairs {
        for s in [src, dst] {
            let reason = if s >= ids {
                SlotFault::OutOfRange { slots: ids }
            } else if s == 0 {
                SlotFault::Sink
            } else if !t.slot_live(s) {
                SlotFault::NotLive
            } else {
                continue;
            };
            return Err(Error::BadSlot {
                op,
                slot: s,
                reason,
            });
        }
    }
    let mut dsts: Vec<u32> = pairs.iter().map(|p| p.1.0).collect();
    dsts.sort_unstable();
    let twice = dsts.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]);
    let src_is_dst = pairs
        .iter()
        .find(|p| dsts.binary_search(&p.0.0).is_ok())
        .map(|p| p.0.0);
    if let Some(slot) = twice.or(src_is_dst) {
        return Err(Error::BadSlot {
            op,
            slot,
            reason: SlotFault::NamedTwice,
        });
    }
    t.issue_slot_copies(pairs)
}

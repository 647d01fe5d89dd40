//! The [`crate::KvAllocator`] methods both layouts implement the same way, as one macro
//! expanded inside each `impl KvAllocator`, and the device translation against a side's
//! mirror that its translate methods share.

use super::PageTables;
use crate::api::{KvAllocator, SideTranslation};
use crate::error::Error;
use crate::spec::Side;
use unikv_kernels::Translate;

/// The device translation of `row` against its side's mirror, refused while the mirror
/// is `pending` entries behind the host tables (the mirror-epoch rule).
pub(crate) fn device_translation(
    a: &(impl KvAllocator + PageTables + ?Sized),
    pending: usize,
    row: &SideTranslation,
) -> Result<Translate, Error> {
    let Some(v2p) = a.mirror_table(row.side) else {
        let op = "translate";
        return Err(match row.side {
            Side::Swa => Error::NoSwaSide { op },
            _ => Error::NoSlotPool { op },
        });
    };
    if pending != 0 {
        return Err(Error::MirrorBehind { pending });
    }
    Ok(Translate {
        v2p,
        ids: row.ids,
        n: row.n,
        // A slot is a page of one: its id is its page.
        page_size: if row.side == Side::Mamba {
            1
        } else {
            a.ps().get()
        },
        stride: a.stride(row.side),
        out: row.out,
        out_width: row.out_width,
    })
}

/// The [`crate::KvAllocator`] methods both allocators implement the same way: allocation
/// through their inherent `alloc`, the whole free family through this module's generic
/// functions, and the device translate against a side's mirror. Written once here and expanded inside each `impl KvAllocator`, so
/// the two layouts cannot drift apart.
macro_rules! free_family_methods {
    () => {
        fn alloc_extend(
            &mut self,
            requests: &[ExtendRequest],
            out: &mut Vec<VirtualToken>,
        ) -> Result<(), Error> {
            self.alloc(requests.iter().copied(), out)
        }

        fn alloc_decode(
            &mut self,
            requests: &[DecodeRequest],
            out: &mut Vec<VirtualToken>,
        ) -> Result<(), Error> {
            if let Some(index) = requests.iter().position(|d| d.prefix_len == usize::MAX) {
                return Err(Error::BadRequest {
                    index,
                    reason: "a row of usize::MAX tokens cannot grow by one".into(),
                });
            }
            self.alloc_one_each(requests, out)
        }

        fn free(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
            $crate::frees::free(self, ids)
        }

        fn free_swa(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
            $crate::frees::free_swa(self, ids)
        }

        fn free_full(&mut self, ids: &[VirtualToken]) -> Result<(), Error> {
            $crate::frees::free_full(self, ids)
        }

        fn free_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
            $crate::frees::free_segment(self, segment)
        }

        fn free_swa_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
            $crate::frees::free_swa_segment(self, segment)
        }

        fn free_swa_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error> {
            $crate::frees::free_swa_segments(self, segments)
        }

        fn free_full_segment(&mut self, segment: Segment<'_>) -> Result<(), Error> {
            $crate::frees::free_full_segment(self, segment)
        }

        fn free_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), Error> {
            $crate::frees::free_segments(self, segments)
        }

        fn free_kv_row_segments(
            &mut self,
            row: &[VirtualToken],
            dead_lo: usize,
            cursor: usize,
            len: usize,
        ) -> Result<(), Error> {
            $crate::frees::free_kv_row_segments(self, row, dead_lo, cursor, len)
        }

        fn transfer_swa(&mut self, from: Segment<'_>, to: Segment<'_>) -> Result<(), Error> {
            $crate::frees::transfer_swa(self, from, to)
        }

        fn free_slots(&mut self, slots: &[$crate::ids::VirtualSlot]) -> Result<(), Error> {
            $crate::frees::free_slots(self, slots)
        }

        fn copy_slots(
            &self,
            pairs: &[($crate::ids::VirtualSlot, $crate::ids::VirtualSlot)],
        ) -> Result<(), Error> {
            $crate::frees::copy_slots(self, pairs)
        }

        fn free_batch(&mut self, frees: &[$crate::api::FreeOp<'_>]) {
            $crate::frees::free_batch(self, frees)
        }

        fn free_group_begin(&mut self) -> Result<(), Error> {
            $crate::frees::group_begin(self)
        }

        fn free_group_end(&mut self) -> Result<(), Error> {
            $crate::frees::group_end(self)
        }

        fn in_free_group(&self) -> bool {
            self.group.is_open()
        }

        fn pending_frees(&self) -> [(DeferredKind, usize); 5] {
            self.group.deferred().lists()
        }

        fn flush_deferred(&mut self) -> bool {
            $crate::frees::flush_deferred(self)
        }

        fn translate(
            &self,
            side: Side,
            ids: TableId,
            n: usize,
            out: TableId,
            out_width: usize,
        ) -> Result<(), Error> {
            let row = $crate::api::SideTranslation {
                side,
                ids,
                n,
                out,
                out_width,
            };
            let args = $crate::frees::device_translation(self, self.mirror_pending(), &row)?;
            Ok(self.device.translate(&args)?)
        }

        fn translate_many(&self, rows: &[$crate::api::SideTranslation]) -> Result<(), Error> {
            let pending = self.mirror_pending();
            let all = rows
                .iter()
                .map(|row| $crate::frees::device_translation(self, pending, row))
                .collect::<Result<Vec<_>, Error>>()?;
            Ok(self.device.translate_many(&all)?)
        }

        fn buffer(&self) -> BytesId {
            self.buffer
        }

        fn mirror_current(&self) -> bool {
            self.mirror_pending() == 0
        }
    };
}
pub(crate) use free_family_methods;

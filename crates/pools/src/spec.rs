//! Sub-pool specs and the byte layout of the one buffer: page envelopes, grids anchored at
//! byte 0, the reserved sink floor, kernel-id strides and the batch-size-1 floor.

use crate::error::{Bs1Floor, Error};
use crate::ids::{Bytes, PageSize};

/// Which side of an allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Side {
    /// Full-attention KV: mints the virtual pages.
    Full,
    /// Sliding-window KV: binds its pages to FULL's virtual pages.
    Swa,
    /// Mamba state slots: their own virtual ids ([`crate::VirtualSlot`], page size 1).
    /// On an allocator without a slot pool it is an absent side (an empty grid, no
    /// mirror, every id the sink).
    Mamba,
}

impl Side {
    /// `full`, `swa` or `mamba`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Side::Full => "full",
            Side::Swa => "swa",
            Side::Mamba => "mamba",
        }
    }
}

/// Where a sub-pool's span grows from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grow {
    /// From the low end of the buffer (above the sink floor) upward.
    Up,
    /// From the high end of the buffer downward.
    Down,
    /// Between the two ends; placed by its composite, grows at either edge.
    Float,
}

/// One sub-pool of the buffer: its layers and the bytes and kernel rows one token costs
/// across all of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubPoolSpec {
    /// A short name for reports.
    pub name: &'static str,
    /// Attention layers of this kind.
    pub layers: u32,
    /// Bytes of one token across all layers (K and V rows of every layer).
    pub bytes_per_token: u64,
    /// Kernel rows of one token across all layers (`2 × layers` for MHA: a K and a V row
    /// per layer). The kernel-id stride is `rows_per_token × page size`.
    pub rows_per_token: u32,
}

impl SubPoolSpec {
    /// An MHA sub-pool: `layers × 2 × kv_heads × head_dim × dtype_bytes` bytes per token,
    /// `2 × layers` rows per token.
    pub const fn mha(
        name: &'static str,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
    ) -> SubPoolSpec {
        SubPoolSpec {
            name,
            layers,
            // Saturating: an absurd product is refused by `Grid::new` as too large for
            // any buffer, never wrapped.
            bytes_per_token: (layers as u64 * 2)
                .saturating_mul(kv_heads as u64)
                .saturating_mul(head_dim as u64)
                .saturating_mul(dtype_bytes as u64),
            rows_per_token: layers.saturating_mul(2),
        }
    }

    fn validate(&self) -> Result<(), Error> {
        if self.layers == 0 || self.bytes_per_token == 0 || self.rows_per_token == 0 {
            return Err(Error::BadConfig(format!(
                "sub-pool {:?} needs layers, bytes per token and rows per token > 0",
                self.name
            )));
        }
        Ok(())
    }
}

/// The Mamba (recurrent state) sub-pool: one slot holds one request's state across all
/// recurrent layers (conv and temporal states, then any sibling side states, so that one
/// envelope move carries them all). Slots have page size 1 and their own virtual ids
/// ([`crate::VirtualSlot`]); a slot's kernel id is its physical slot (stride 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotPoolSpec {
    /// A short name for reports.
    pub name: &'static str,
    /// Recurrent layers whose state a slot holds.
    pub layers: u32,
    /// Bytes of one slot (its envelope), a multiple of 8.
    pub bytes_per_slot: u64,
}

impl SlotPoolSpec {
    /// The grid of the slots in a buffer of `total` bytes above a sink floor of `floor`
    /// bytes: envelope `bytes_per_slot`, stride 1.
    pub fn grid(&self, total: u64, floor: u64) -> Result<Grid, Error> {
        if self.layers == 0 || self.bytes_per_slot == 0 || !self.bytes_per_slot.is_multiple_of(8) {
            return Err(Error::BadConfig(format!(
                "slot pool {:?} needs layers > 0 and a positive multiple of 8 bytes per slot (not {})",
                self.name, self.bytes_per_slot
            )));
        }
        let pages = total / self.bytes_per_slot;
        if pages > i32::MAX as u64 {
            return Err(Error::KernelIdOverflow {
                side: "mamba",
                pages,
                stride: 1,
                largest_bytes: self.largest_total(),
            });
        }
        let min_page = floor.div_ceil(self.bytes_per_slot).max(1);
        Ok(Grid {
            envelope: self.bytes_per_slot,
            pages: pages as u32,
            min_page: min_page.min(pages) as u32,
            stride: 1,
        })
    }
}

impl SlotPoolSpec {
    /// The largest buffer whose slot grid keeps its ids in i32: `i32::MAX` slots and
    /// the bytes short of one more.
    pub fn largest_total(&self) -> u64 {
        largest_total_of(self.bytes_per_slot, 1)
    }
}

/// The largest buffer, in bytes, whose grid of `envelope`-byte pages with `stride` rows
/// each keeps every kernel id (`page × stride + offset`) in i32 ([`Grid::new`]'s test):
/// the most pages that fit, and the bytes short of one more page.
fn largest_total_of(envelope: u64, stride: u64) -> u64 {
    let pages = i32::MAX as u64 / stride.max(1);
    (pages + 1).saturating_mul(envelope).saturating_sub(1)
}

/// The largest buffer whose grids on every side (`kv` and the `slots`, at page size
/// `ps`) keep their kernel ids in i32: what [`Error::KernelIdOverflow`] names as the
/// budget to give instead.
pub fn largest_total(kv: &[&SubPoolSpec], slots: Option<&SlotPoolSpec>, ps: PageSize) -> u64 {
    kv.iter()
        .map(|spec| {
            let envelope = spec.bytes_per_token.saturating_mul(ps.get() as u64);
            largest_total_of(envelope, spec.rows_per_token as u64 * ps.get() as u64)
        })
        .chain(slots.map(SlotPoolSpec::largest_total))
        .min()
        .unwrap_or(u64::MAX)
}

/// The geometry of one sub-pool's grid inside the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Bytes of one page envelope (`page size × bytes per token`).
    pub envelope: u64,
    /// Pages of the grid (`total bytes / envelope`); physical page `p` is at byte
    /// `p × envelope`.
    pub pages: u32,
    /// First page above the sink floor (`ceil(floor / envelope)`, at least 1).
    pub min_page: u32,
    /// Kernel rows per page envelope (`rows per token × page size`).
    pub stride: u32,
}

impl Grid {
    /// The grid of a side an allocator does not have ([`Side::Mamba`] on the FULL/SWA
    /// layouts): no pages, no rows.
    pub const ABSENT: Grid = Grid {
        envelope: 0,
        pages: 0,
        min_page: 0,
        stride: 0,
    };

    /// The grid of `spec` in a buffer of `total` bytes with a sink floor of `floor` bytes;
    /// `side` names it in errors. Fails when kernel ids would not fit in i32.
    pub fn new(
        spec: &SubPoolSpec,
        ps: PageSize,
        total: u64,
        floor: u64,
        side: &'static str,
    ) -> Result<Grid, Error> {
        spec.validate()?;
        let envelope = spec
            .bytes_per_token
            .checked_mul(ps.get() as u64)
            .ok_or_else(|| {
                Error::BadConfig(format!(
                    "sub-pool {:?}: {} bytes per token × page size {ps} overflow u64",
                    spec.name, spec.bytes_per_token
                ))
            })?;
        let pages = total / envelope;
        // Both factors are u32: the product fits a u64.
        let stride = spec.rows_per_token as u64 * ps.get() as u64;
        if pages.saturating_mul(stride) > i32::MAX as u64 || pages > i32::MAX as u64 {
            return Err(Error::KernelIdOverflow {
                side,
                pages,
                stride,
                // This side's; the layout's constructor names the least over its sides.
                largest_bytes: largest_total_of(envelope, stride),
            });
        }
        let min_page = floor.div_ceil(envelope).max(1);
        Ok(Grid {
            envelope,
            pages: pages as u32,
            min_page: min_page.min(pages) as u32,
            stride: stride as u32,
        })
    }

    /// Byte offset of physical page `page`.
    #[inline]
    pub const fn offset(&self, page: u32) -> u64 {
        page as u64 * self.envelope
    }
}

/// The sink floor: the bottom bytes reserved for padded-token writes, one page envelope
/// of the largest sub-pool (`max(page size × bytes per token)`), or one slot when a slot
/// is larger (a slot is charged once, not per page: its page size is 1).
pub fn sink_floor(specs: &[&SubPoolSpec], slots: Option<&SlotPoolSpec>, ps: PageSize) -> u64 {
    specs
        .iter()
        .map(|s| s.bytes_per_token.saturating_mul(ps.get() as u64))
        .chain(slots.map(|s| s.bytes_per_slot))
        .max()
        .unwrap_or(0)
}

/// The batch-size-1 floor: a buffer of `total` bytes must hold the sink plus what one
/// request needs (`floor`: a window of `window + page size` tokens, in whole pages, on
/// FULL and SWA, and/or its Mamba state slots), which `holds(bytes)` decides for a buffer
/// of `bytes` (it must be monotone in `bytes`). When it does not,
/// [`Error::BufferTooSmall`] states the **least** size that does (found by doubling, then
/// bisection, over `holds` itself, so the stated need is exactly enough).
pub(crate) fn check_bs1_floor(
    total: u64,
    floor: Bs1Floor,
    holds: impl Fn(u64) -> bool,
) -> Result<(), Error> {
    if holds(total) {
        return Ok(());
    }
    let mut hi = total.max(1);
    while !holds(hi) {
        hi = hi
            .checked_mul(2)
            .filter(|&h| h <= u64::MAX / 2)
            .ok_or_else(|| {
                Error::BadConfig(format!("no buffer size holds the sink and {floor}"))
            })?;
    }
    // `holds(lo)` is false, `holds(hi)` true.
    let mut lo = total;
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if holds(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Err(Error::BufferTooSmall {
        needed: Bytes(hi),
        have: Bytes(total),
        floor,
    })
}

/// Mamba state slots one request holds at batch size 1 with the prefix cache on: one
/// running state and two checkpoints (the reference engine's floor,
/// `_check_bs1_feasibility_floor`: `3 × state entry bytes + sink`).
pub const BS1_STATE_SLOTS: u32 = 3;

/// The floor of a layout: a window when it has SWA, [`BS1_STATE_SLOTS`] with a slot pool.
pub(crate) fn bs1_floor(ps: PageSize, window: Option<u32>, slots: bool) -> Bs1Floor {
    Bs1Floor {
        window_tokens: window.map(|w| w as usize + ps.get() as usize),
        slots: if slots { BS1_STATE_SLOTS } else { 0 },
    }
}

/// Pages of one window on both sides: `window + page size` tokens, in whole pages.
pub(crate) fn window_pages(ps: PageSize, window: u32) -> u64 {
    ps.pages_for(window as usize + ps.get() as usize) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grid's page ids must fit in i32 (the kernels' ids): one page more is refused.
    #[test]
    fn a_grid_past_i32_pages_is_a_kernel_id_overflow() {
        let slots = SlotPoolSpec {
            name: "mamba",
            layers: 1,
            bytes_per_slot: 8,
        };
        let fits = 8 * i32::MAX as u64;
        assert_eq!(slots.grid(fits, 0).unwrap().pages, i32::MAX as u32);
        assert!(matches!(
            slots.grid(fits + 8, 0),
            Err(Error::KernelIdOverflow { side: "mamba", pages, stride: 1, largest_bytes })
                if pages == i32::MAX as u64 + 1 && largest_bytes == fits + 7
        ));
        let kv = SubPoolSpec::mha("full", 1, 1, 1, 1);
        let ps = PageSize::new(1).unwrap();
        // The largest budget a layout names is the least over its sides.
        let ps4 = PageSize::new(4).unwrap();
        let largest = largest_total(&[&kv], Some(&slots), ps4);
        assert_eq!(
            largest,
            slots.largest_total().min(largest_total(&[&kv], None, ps4))
        );
        assert!(Grid::new(&kv, ps4, largest_total(&[&kv], None, ps4), 0, "full").is_ok());
        assert!(Grid::new(&kv, ps4, largest_total(&[&kv], None, ps4) + 1, 0, "full").is_err());
        // Two bytes a token (K and V): rows × pages must fit too.
        assert!(Grid::new(&kv, ps, 2 * i32::MAX as u64, 0, "full").is_err());
        assert!(Grid::new(&kv, ps, i32::MAX as u64, 0, "full").is_ok());
    }
}

//! What one Mamba state slot holds: the byte ranges of every layer's conv and temporal
//! state and of the sibling side states inside one slot envelope.
//!
//! # Why one envelope per slot
//!
//! The reference engine keeps each kind of state in its own tensor, layer-major with the
//! slot as the second axis (SGLang `python/sglang/srt/mem_cache/memory_pool.py`,
//! `MambaPool.__init__`: conv states `[num_mamba_layers, size + 1, conv_dim, kernel − 1]`,
//! the temporal state `[num_mamba_layers, size + 1, heads, head_dim, state_size]`, slot 0
//! padded for dummy writes; the speculative `intermediate_ssm` / `intermediate_conv_window`
//! caches are further tensors of their own). A slot there is a column across several
//! tensors, so moving one means one copy per tensor and layer.
//!
//! unikv keeps one slot's whole state contiguous in one envelope of the shared buffer, so
//! that compaction and a copy-on-write move a slot as one envelope. The order inside it
//! follows the reference's `MambaPool.State` fields: every layer's conv state, then every
//! layer's temporal (SSM) state, then the side states, sibling side states after the
//! temporal rows so a move carries them.

use std::ops::Range;

use unikv_pools::SlotPoolSpec;

use crate::error::Error;
use crate::state::RecurrentState;

/// Alignment of every range start and of the envelope size, in bytes. Slot envelopes are
/// laid on a grid anchored at byte 0 of the buffer ([`SlotPoolSpec::bytes_per_slot`] is a
/// multiple of 8), so every range starts 8-aligned in the buffer too: no element of up to
/// 8 bytes straddles its alignment (a CUDA load of a misaligned float32 faults).
pub const SLOT_ALIGN: u64 = 8;

/// The Mamba/GDN state of one request: `layers` recurrent layers of `state` each, plus
/// `side_state_bytes` of sibling per-slot side states (speculative decoding's
/// intermediate states, for one; 0 by default).
///
/// # Example
///
/// ```
/// use unikv_mamba::{MambaSpec, RecurrentState, SlotPart};
///
/// let layer = RecurrentState {
///     conv_channels: 16,
///     conv_kernel: 4,
///     heads: 2,
///     head_dim: 4,
///     state_size: 8,
///     conv_dtype_bytes: 2,
///     state_dtype_bytes: 4,
/// };
/// // 2 layers, 10 bytes of side states.
/// let spec = MambaSpec::new(2, layer).with_side_state_bytes(10);
/// let slot = spec.slot_layout()?;
/// // Conv: 16 × 3 × 2 = 96 B per layer; temporal: 2 × 4 × 8 × 4 = 256 B per layer.
/// assert_eq!(slot.conv(0)?, 0..96);
/// assert_eq!(slot.conv(1)?, 96..192);
/// assert_eq!(slot.temporal(0)?, 192..448);
/// assert_eq!(slot.temporal(1)?, 448..704);
/// assert_eq!(slot.side(), 704..714);
/// // The envelope rounds up to a multiple of 8.
/// assert_eq!(slot.entry_bytes(), 720);
/// assert_eq!(spec.slot_pool_spec("mamba")?.bytes_per_slot, 720);
/// assert_eq!(slot.parts().next(), Some((SlotPart::Conv(0), 0..96)));
/// # Ok::<(), unikv_mamba::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MambaSpec {
    /// Recurrent layers whose state a slot holds.
    pub layers: u32,
    /// The state of one layer.
    pub state: RecurrentState,
    /// Bytes of sibling side states per slot, after the temporal states.
    pub side_state_bytes: u64,
}

impl MambaSpec {
    /// `layers` layers of `state`, no side states.
    pub const fn new(layers: u32, state: RecurrentState) -> MambaSpec {
        MambaSpec {
            layers,
            state,
            side_state_bytes: 0,
        }
    }

    /// This spec with `bytes` of side states per slot.
    pub const fn with_side_state_bytes(self, bytes: u64) -> MambaSpec {
        MambaSpec {
            side_state_bytes: bytes,
            ..self
        }
    }

    /// The byte ranges inside one slot envelope. Fails with [`Error::NoState`] when there
    /// is no recurrent state to hold (no layers, or layers of 0 bytes) and with
    /// [`Error::LayoutOverflow`] when a size or offset does not fit in 64 bits.
    pub fn slot_layout(&self) -> Result<SlotLayout, Error> {
        let overflow = |part| Error::LayoutOverflow {
            part,
            layers: self.layers,
            side_state_bytes: self.side_state_bytes,
        };
        let conv_bytes = self.state.checked_conv_bytes().ok_or(overflow("conv"))?;
        let temporal_bytes = self
            .state
            .checked_temporal_bytes()
            .ok_or(overflow("temporal"))?;
        if self.layers == 0 || (conv_bytes == 0 && temporal_bytes == 0) {
            return Err(Error::NoState {
                layers: self.layers,
                bytes_per_layer: self.state.state_bytes_per_layer(),
            });
        }
        let layers = self.layers as u64;
        let conv_stride = align_up(conv_bytes).ok_or(overflow("conv"))?;
        let temporal_start = conv_stride.checked_mul(layers).ok_or(overflow("conv"))?;
        let temporal_stride = align_up(temporal_bytes).ok_or(overflow("temporal"))?;
        let side_start = temporal_stride
            .checked_mul(layers)
            .and_then(|t| t.checked_add(temporal_start))
            .ok_or(overflow("temporal"))?;
        let side_end = side_start
            .checked_add(self.side_state_bytes)
            .ok_or(overflow("side"))?;
        let entry_bytes = align_up(side_end).ok_or(overflow("entry"))?;
        Ok(SlotLayout {
            layers: self.layers,
            conv_bytes,
            conv_stride,
            temporal_start,
            temporal_bytes,
            temporal_stride,
            side_start,
            side_bytes: self.side_state_bytes,
            entry_bytes,
        })
    }

    /// Bytes of one slot envelope ([`SlotLayout::entry_bytes`]), a multiple of
    /// [`SLOT_ALIGN`]; errors as [`MambaSpec::slot_layout`].
    pub fn entry_bytes(&self) -> Result<u64, Error> {
        self.slot_layout().map(|l| l.entry_bytes())
    }

    /// The slot sub-pool of this state, named `name`, for the pools' allocator; errors as
    /// [`MambaSpec::slot_layout`].
    pub fn slot_pool_spec(&self, name: &'static str) -> Result<SlotPoolSpec, Error> {
        Ok(SlotPoolSpec {
            name,
            layers: self.layers,
            bytes_per_slot: self.entry_bytes()?,
        })
    }
}

/// `bytes` rounded up to a multiple of [`SLOT_ALIGN`], or `None` past 64 bits.
fn align_up(bytes: u64) -> Option<u64> {
    Some(bytes.checked_add(SLOT_ALIGN - 1)? / SLOT_ALIGN * SLOT_ALIGN)
}

/// One part of a slot, as [`SlotLayout::parts`] names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SlotPart {
    /// The conv state of a layer (its index among the recurrent layers).
    Conv(u32),
    /// The temporal (SSM) state of a layer.
    Temporal(u32),
    /// The sibling side states.
    Side,
}

/// The byte ranges inside one slot envelope, offsets from the envelope's first byte.
///
/// Invariants (checked at construction by [`MambaSpec::slot_layout`], with checked
/// arithmetic): layer `l`'s conv state precedes layer `l + 1`'s; every conv state precedes
/// every temporal state, which precede the side states; the ranges are disjoint, each
/// starts at a multiple of [`SLOT_ALIGN`] (padding between them is at most 7 bytes) and
/// all lie inside [`SlotLayout::entry_bytes`], itself a multiple of [`SLOT_ALIGN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    layers: u32,
    conv_bytes: u64,
    conv_stride: u64,
    temporal_start: u64,
    temporal_bytes: u64,
    temporal_stride: u64,
    side_start: u64,
    side_bytes: u64,
    entry_bytes: u64,
}

impl SlotLayout {
    /// Recurrent layers the slot holds.
    pub const fn layers(&self) -> u32 {
        self.layers
    }

    /// Bytes of the envelope: every range plus alignment padding, a multiple of
    /// [`SLOT_ALIGN`].
    pub const fn entry_bytes(&self) -> u64 {
        self.entry_bytes
    }

    /// The conv state of layer `layer` (empty for a kernel of width ≤ 1).
    pub fn conv(&self, layer: u32) -> Result<Range<u64>, Error> {
        let start = self.check_layer(layer)? * self.conv_stride;
        Ok(start..start + self.conv_bytes)
    }

    /// The temporal (SSM) state of layer `layer`.
    pub fn temporal(&self, layer: u32) -> Result<Range<u64>, Error> {
        let start = self.temporal_start + self.check_layer(layer)? * self.temporal_stride;
        Ok(start..start + self.temporal_bytes)
    }

    /// The side states (empty without them).
    pub const fn side(&self) -> Range<u64> {
        self.side_start..self.side_start + self.side_bytes
    }

    /// Every part in slot order: each layer's conv state, each layer's temporal state,
    /// then the side states.
    pub fn parts(&self) -> impl Iterator<Item = (SlotPart, Range<u64>)> + '_ {
        // The index is below `layers`, so the offsets fit: construction checked the ends.
        let conv = (0..self.layers).map(|l| {
            let start = l as u64 * self.conv_stride;
            (SlotPart::Conv(l), start..start + self.conv_bytes)
        });
        let temporal = (0..self.layers).map(|l| {
            let start = self.temporal_start + l as u64 * self.temporal_stride;
            (SlotPart::Temporal(l), start..start + self.temporal_bytes)
        });
        conv.chain(temporal)
            .chain(std::iter::once((SlotPart::Side, self.side())))
    }

    fn check_layer(&self, layer: u32) -> Result<u64, Error> {
        if layer < self.layers {
            Ok(layer as u64)
        } else {
            Err(Error::NoSuchLayer {
                layer,
                layers: self.layers,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nemotron-H-8B's Mamba2 layer (the facade's `ModelSpec::NEMOTRON_H_8B` numbers).
    const NEMOTRON_H: RecurrentState = RecurrentState {
        conv_channels: 128 * 64 + 2 * 8 * 128,
        conv_kernel: 4,
        heads: 128,
        head_dim: 64,
        state_size: 128,
        conv_dtype_bytes: 2,
        state_dtype_bytes: 4,
    };

    #[test]
    fn a_real_models_slot_is_packed_without_padding() {
        let spec = MambaSpec::new(24, NEMOTRON_H);
        let slot = spec.slot_layout().unwrap();
        // 24 × (61,440 + 4,194,304): both parts are multiples of 8 already.
        assert_eq!(slot.entry_bytes(), 102_137_856);
        assert_eq!(slot.conv(23).unwrap(), 23 * 61_440..24 * 61_440);
        assert_eq!(slot.temporal(0).unwrap().start, 24 * 61_440);
        assert_eq!(slot.side(), 102_137_856..102_137_856);
        assert_eq!(
            spec.slot_pool_spec("mamba").unwrap(),
            SlotPoolSpec {
                name: "mamba",
                layers: 24,
                bytes_per_slot: 102_137_856
            }
        );
    }

    #[test]
    fn odd_sizes_are_padded_to_8_at_each_range_and_at_the_end() {
        let state = RecurrentState {
            conv_channels: 3,
            conv_kernel: 2,
            heads: 1,
            head_dim: 1,
            state_size: 3,
            conv_dtype_bytes: 1,
            state_dtype_bytes: 4,
        };
        let slot = MambaSpec::new(2, state)
            .with_side_state_bytes(1)
            .slot_layout()
            .unwrap();
        assert_eq!(slot.conv(0).unwrap(), 0..3);
        assert_eq!(slot.conv(1).unwrap(), 8..11);
        assert_eq!(slot.temporal(0).unwrap(), 16..28);
        assert_eq!(slot.temporal(1).unwrap(), 32..44);
        assert_eq!(slot.side(), 48..49);
        assert_eq!(slot.entry_bytes(), 56);
    }

    #[test]
    fn no_state_and_bad_layers_are_typed_errors() {
        assert_eq!(
            MambaSpec::new(0, NEMOTRON_H).slot_layout(),
            Err(Error::NoState {
                layers: 0,
                bytes_per_layer: 4_255_744
            })
        );
        assert_eq!(
            MambaSpec::new(4, RecurrentState::NONE).entry_bytes(),
            Err(Error::NoState {
                layers: 4,
                bytes_per_layer: 0
            })
        );
        let slot = MambaSpec::new(2, NEMOTRON_H).slot_layout().unwrap();
        assert_eq!(
            slot.temporal(2),
            Err(Error::NoSuchLayer {
                layer: 2,
                layers: 2
            })
        );
        assert!(slot.conv(u32::MAX).is_err());
    }

    #[test]
    fn overflow_is_a_typed_error_naming_the_part() {
        let wide = RecurrentState {
            heads: u32::MAX,
            head_dim: u32::MAX,
            state_size: u32::MAX,
            ..NEMOTRON_H
        };
        assert!(matches!(
            MambaSpec::new(1, wide).slot_layout(),
            Err(Error::LayoutOverflow {
                part: "temporal",
                ..
            })
        ));
        // Each layer fits, the layers together do not.
        let big = RecurrentState {
            heads: u32::MAX,
            head_dim: 1 << 16,
            state_size: 1,
            state_dtype_bytes: 4,
            ..NEMOTRON_H
        };
        assert!(matches!(
            MambaSpec::new(u32::MAX, big).slot_layout(),
            Err(Error::LayoutOverflow {
                part: "conv" | "temporal",
                ..
            })
        ));
        // The side states push the end past 64 bits.
        assert_eq!(
            MambaSpec::new(1, NEMOTRON_H)
                .with_side_state_bytes(u64::MAX - 8)
                .entry_bytes(),
            Err(Error::LayoutOverflow {
                part: "side",
                layers: 1,
                side_state_bytes: u64::MAX - 8
            })
        );
        // The end fits, rounding it up to 8 does not.
        let tiny = RecurrentState {
            conv_kernel: 0,
            heads: 1,
            head_dim: 1,
            state_size: 1,
            state_dtype_bytes: 1,
            ..NEMOTRON_H
        };
        assert_eq!(
            MambaSpec::new(1, tiny)
                .with_side_state_bytes(u64::MAX - 8)
                .entry_bytes(),
            Err(Error::LayoutOverflow {
                part: "entry",
                layers: 1,
                side_state_bytes: u64::MAX - 8
            })
        );
    }
}

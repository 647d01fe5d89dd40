//! The state one recurrent layer keeps per request (moved here from the facade's model
//! specs so that the slot layout and the model spec share one vocabulary type).

use crate::bytes::{checked_product, saturated};

/// The state one recurrent layer (a Mamba2 mixer or a Gated DeltaNet) keeps per request,
/// in the shape the reference engine allocates (`Mamba2StateShape` in SGLang's
/// `python/sglang/srt/configs/mamba_utils.py`, which serves Mamba2 and GDN alike):
///
/// * a **conv state** of `conv_channels × (conv_kernel − 1)` elements: the last
///   `kernel − 1` inputs of the causal convolution. For Mamba2
///   `conv_channels = mamba_num_heads × mamba_head_dim + 2 × n_groups × ssm_state_size`
///   (x, B and C go through the convolution); for GDN
///   `conv_channels = 2 × linear_num_key_heads × linear_key_head_dim +
///   linear_num_value_heads × linear_value_head_dim` (q, k and v do);
/// * a **temporal (SSM) state** of `heads × head_dim × state_size` elements. For Mamba2
///   `mamba_num_heads × mamba_head_dim × ssm_state_size`; for GDN
///   `linear_num_value_heads × linear_value_head_dim × linear_key_head_dim` (one
///   key-dim × value-dim matrix per value head).
///
/// Element sizes are the engine's, not the checkpoint's: SGLang keeps the conv state in
/// bf16 and the temporal state in float32 by default (`mamba2_state_dtype`:
/// `SGLANG_MAMBA_SSM_DTYPE`, else the config's `mamba_ssm_dtype`, else `"float32"`).
///
/// # Example
///
/// One Mamba2 layer of Nemotron-H-8B (`mamba_num_heads` 128, `mamba_head_dim` 64,
/// `n_groups` 8, `ssm_state_size` 128, `conv_kernel` 4; bf16 conv, float32 temporal):
///
/// ```
/// use unikv_mamba::RecurrentState;
///
/// let layer = RecurrentState {
///     conv_channels: 128 * 64 + 2 * 8 * 128,
///     conv_kernel: 4,
///     heads: 128,
///     head_dim: 64,
///     state_size: 128,
///     conv_dtype_bytes: 2,
///     state_dtype_bytes: 4,
/// };
/// assert_eq!(layer.checked_conv_bytes(), Some(61_440));
/// assert_eq!(layer.checked_temporal_bytes(), Some(4_194_304));
/// assert_eq!(layer.state_bytes_per_layer(), 61_440 + 4_194_304);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecurrentState {
    /// Channels of the causal convolution.
    pub conv_channels: u32,
    /// Width of the convolution kernel (`conv_kernel`, `linear_conv_kernel_dim`); a
    /// kernel of width `k` keeps `k − 1` inputs (none for `k ≤ 1`).
    pub conv_kernel: u32,
    /// Heads of the temporal state (Mamba2 heads, GDN value heads).
    pub heads: u32,
    /// Head dimension of the temporal state (Mamba2 head dim, GDN value head dim).
    pub head_dim: u32,
    /// State size per head element (Mamba2 `ssm_state_size`, GDN key head dim).
    pub state_size: u32,
    /// Bytes per conv-state element.
    pub conv_dtype_bytes: u32,
    /// Bytes per temporal-state element.
    pub state_dtype_bytes: u32,
}

impl RecurrentState {
    /// No recurrent state: the geometry of a model without recurrent layers.
    pub const NONE: RecurrentState = RecurrentState {
        conv_channels: 0,
        conv_kernel: 0,
        heads: 0,
        head_dim: 0,
        state_size: 0,
        conv_dtype_bytes: 0,
        state_dtype_bytes: 0,
    };

    /// `conv_channels × (conv_kernel − 1) × conv_dtype_bytes`, or `None` past 64 bits.
    pub const fn checked_conv_bytes(&self) -> Option<u64> {
        checked_product(&[
            self.conv_channels,
            self.conv_kernel.saturating_sub(1),
            self.conv_dtype_bytes,
        ])
    }

    /// `heads × head_dim × state_size × state_dtype_bytes`, or `None` past 64 bits.
    pub const fn checked_temporal_bytes(&self) -> Option<u64> {
        checked_product(&[
            self.heads,
            self.head_dim,
            self.state_size,
            self.state_dtype_bytes,
        ])
    }

    /// Conv plus temporal bytes of one layer, or `None` past 64 bits.
    pub const fn checked_state_bytes_per_layer(&self) -> Option<u64> {
        match (self.checked_conv_bytes(), self.checked_temporal_bytes()) {
            (Some(c), Some(t)) => c.checked_add(t),
            _ => None,
        }
    }

    /// [`RecurrentState::checked_state_bytes_per_layer`], `u64::MAX` past 64 bits.
    pub const fn state_bytes_per_layer(&self) -> u64 {
        saturated(self.checked_state_bytes_per_layer())
    }

    /// The inputs one position's recurrence consumes in one layer, which a replay
    /// rollback logs per verify position instead of the state after it: the conv's input
    /// channels (`conv_channels × conv_dtype_bytes`; for Mamba2 `x`, `B` and `C`, for
    /// GDN `q`, `k` and `v`) and two `f32` gates per head (Mamba2's `dt`; GDN's `β` and
    /// `g`), or `None` past 64 bits. An estimate for an engine that does not state its
    /// own log; about 1/130 of a Qwen3-Next layer's state and 1/200 of Nemotron-H's.
    pub const fn checked_log_bytes_per_layer(&self) -> Option<u64> {
        let gates = checked_product(&[self.heads, 2, 4]);
        match (
            checked_product(&[self.conv_channels, self.conv_dtype_bytes]),
            gates,
        ) {
            (Some(c), Some(g)) => c.checked_add(g),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_positions_log_is_its_conv_inputs_and_two_gates_per_head() {
        // Qwen3-Next's GDN layer: 8,192 conv channels of bf16 and 32 value heads.
        let gdn = RecurrentState {
            conv_channels: 2 * 16 * 128 + 32 * 128,
            conv_kernel: 4,
            heads: 32,
            head_dim: 128,
            state_size: 128,
            conv_dtype_bytes: 2,
            state_dtype_bytes: 4,
        };
        assert_eq!(
            gdn.checked_log_bytes_per_layer(),
            Some(8_192 * 2 + 32 * 2 * 4)
        );
        assert_eq!(gdn.state_bytes_per_layer() / 16_640, 128);
        assert_eq!(RecurrentState::NONE.checked_log_bytes_per_layer(), Some(0));
        let wide = RecurrentState {
            conv_channels: u32::MAX,
            conv_dtype_bytes: u32::MAX,
            heads: u32::MAX,
            ..gdn
        };
        // (2^32 − 1)^2 conv bytes plus 8 × (2^32 − 1) gate bytes pass 64 bits.
        assert_eq!(wide.checked_log_bytes_per_layer(), None);
    }

    #[test]
    fn none_holds_no_bytes_and_a_kernel_of_width_one_keeps_no_inputs() {
        assert_eq!(
            RecurrentState::NONE.checked_state_bytes_per_layer(),
            Some(0)
        );
        let s = RecurrentState {
            conv_channels: 8,
            conv_kernel: 1,
            heads: 2,
            head_dim: 3,
            state_size: 4,
            conv_dtype_bytes: 2,
            state_dtype_bytes: 4,
        };
        assert_eq!(s.checked_conv_bytes(), Some(0));
        assert_eq!(s.checked_temporal_bytes(), Some(2 * 3 * 4 * 4));
        assert_eq!(s.state_bytes_per_layer(), 96);
    }

    #[test]
    fn past_64_bits_is_none_or_saturates() {
        let s = RecurrentState {
            conv_channels: u32::MAX,
            conv_kernel: u32::MAX,
            heads: u32::MAX,
            head_dim: u32::MAX,
            state_size: 1,
            conv_dtype_bytes: 1,
            state_dtype_bytes: 1,
        };
        // Each part fits, the sum does not.
        assert!(s.checked_conv_bytes().is_some() && s.checked_temporal_bytes().is_some());
        assert_eq!(s.checked_state_bytes_per_layer(), None);
        assert_eq!(s.state_bytes_per_layer(), u64::MAX);
    }
}

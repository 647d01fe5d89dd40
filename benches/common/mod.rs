//! What the facade's benchmarks share: the models they time.

use unikv::{ModelSpec, RecurrentState};

/// Qwen3-Next-80B-A3B's layers and KV rows with its recurrent state scaled down to 48
/// bytes a layer, so that 256 requests' slots fit a CPU device's host buffer (the real
/// state is 77 MB a request). The allocator's and tree's work is per slot, not per byte:
/// a step's CPU time is the real model's.
pub const QWEN3_NEXT_SCALED_STATE: ModelSpec = ModelSpec {
    name: "qwen3-next-80b-a3b (scaled state)",
    recurrent: RecurrentState {
        conv_channels: 4,
        conv_kernel: 4,
        heads: 1,
        head_dim: 2,
        state_size: 3,
        conv_dtype_bytes: 2,
        state_dtype_bytes: 4,
    },
    ..ModelSpec::QWEN3_NEXT_80B_A3B
};

//! The crate's one error type. A function that returns one changed nothing.

/// Why a state geometry or a checkpoint policy refused its input. Every variant carries the
/// numbers that were refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A slot needs at least one recurrent layer with some state to hold.
    #[error("a Mamba slot needs state: {layers} layers of {bytes_per_layer} B each")]
    NoState {
        /// Recurrent layers of the spec.
        layers: u32,
        /// Conv plus temporal bytes of one layer (0, or `u64::MAX` past 64 bits).
        bytes_per_layer: u64,
    },
    /// The slot's bytes do not fit in 64 bits.
    #[error(
        "the {part} bytes of a Mamba slot of {layers} layers (side states {side_state_bytes} B) overflow u64"
    )]
    LayoutOverflow {
        /// The part whose size or offset overflowed (`conv`, `temporal`, `side`, `entry`).
        part: &'static str,
        /// Recurrent layers of the spec.
        layers: u32,
        /// Side-state bytes of the spec.
        side_state_bytes: u64,
    },
    /// A layer index past the slot's layers.
    #[error("layer {layer} is not one of the slot's {layers} layers")]
    NoSuchLayer {
        /// The index asked for.
        layer: u32,
        /// Recurrent layers of the slot.
        layers: u32,
    },
    /// A checkpoint interval that is not a positive multiple of the page size (a
    /// checkpoint must end where a prefix-tree node can end: on a page boundary).
    #[error(
        "checkpoint interval {interval} is not a positive multiple of the page size {page_size}"
    )]
    BadInterval {
        /// The interval in tokens.
        interval: u32,
        /// The page size in tokens.
        page_size: u32,
    },
    /// A per-step checkpoint bound was asked of a policy that keeps no checkpoints.
    #[error("the policy keeps no checkpoints (no prefix cache)")]
    NotCheckpointed,
    /// A bound on the states one step may save outside `1..=max`.
    #[error("checkpoints per step must be between 1 and {max}, not {per_step}")]
    BadCheckpointsPerStep {
        /// The bound asked for.
        per_step: u32,
        /// The largest bound allowed.
        max: u32,
    },
}

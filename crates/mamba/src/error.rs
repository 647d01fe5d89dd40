//! The crate's one error type. A function that returns one changed nothing.

/// Why a state geometry or a checkpoint policy refused its input. Every variant carries the
/// numbers that were refused; a tracker that returns one is unchanged.
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
    /// A checkpoint tracker was asked for under a policy that keeps no checkpoints.
    #[error("the policy keeps no checkpoints (no prefix cache): nothing to track")]
    NotCheckpointed,
    /// A tracker was advanced from a length it is not at (a missed or repeated step).
    #[error("checkpoint track is at {at} tokens, advanced from {old_len}")]
    OutOfStep {
        /// The length the tracker holds.
        at: usize,
        /// The length the caller advanced from.
        old_len: usize,
    },
    /// A tracker was advanced to a shorter row; a row only grows (a retracted or
    /// truncated request starts a new track).
    #[error("checkpoint track cannot shrink from {old_len} to {new_len} tokens")]
    Shrink {
        /// The length advanced from.
        old_len: usize,
        /// The shorter length asked for.
        new_len: usize,
    },
    /// The two checkpoint slots of a tracker are the same slot (ping-pong needs two).
    #[error("checkpoint slots must differ (both are slot {slot})")]
    SameSlots {
        /// The slot given twice.
        slot: u32,
    },
}

//! The Mamba/GDN side of unikv that is not allocation: the **geometry** of one state slot
//! (which bytes of a slot envelope hold which layer's conv and temporal state, and the
//! side states) and the **checkpoint policy** (how many slots a request holds and when
//! its state is saved for the prefix cache).
//!
//! The slot allocator (`SubAllocator`, `VirtualIds`, page size 1 on its own grid) and the
//! composites that place slots in the shared buffer live in `unikv-pools`; this crate
//! hands them a [`unikv_pools::SlotPoolSpec`] ([`MambaSpec::slot_pool_spec`]) and speaks
//! of slots as [`unikv_pools::VirtualSlot`]s. It allocates nothing, touches no device and
//! holds no mutable state: a request's checkpoints are the caller's.
//!
//! - [`RecurrentState`]: the per-layer state shape (the facade's `ModelSpec.recurrent`).
//! - [`MambaSpec`] → [`SlotLayout`]: the byte ranges inside one slot envelope.
//! - [`StatePolicy`], [`PlanMarks`]: the checkpoint grid and the positions a step saves.
//! - [`checked_product`], [`saturated`]: byte counts of memory shapes in 64 bits (the
//!   facade's KV rows use them too).
//!
//! # Invariants this crate keeps
//! - A [`SlotLayout`]'s ranges are disjoint and in slot order (every layer's conv state,
//!   then every layer's temporal state, then the side states), each starts at a multiple
//!   of [`SLOT_ALIGN`] and all lie inside [`SlotLayout::entry_bytes`], a positive multiple
//!   of [`SLOT_ALIGN`]. Sizes and offsets use checked arithmetic: a geometry that does not
//!   fit in 64 bits is [`Error::LayoutOverflow`], never a wrapped size.
//! - A checkpoint interval is a positive multiple of the page size
//!   ([`CheckpointInterval::new`]), so every checkpoint ends on a page boundary.
//! - A checkpointed request holds at most [`StatePolicy::slots_per_request`] slots, by
//!   default [`BS1_SLOTS`] = 3 (the running state and two checkpoints), the pools'
//!   batch-size-1 floor constant itself.
//! - A plan ([`StatePolicy::plan`]) names each position once, in ascending order, each a
//!   page boundary inside the step's new rows, at most
//!   [`StatePolicy::checkpoints_per_step`] of them.

mod bytes;
mod error;
mod layout;
mod policy;
mod state;

pub use bytes::{checked_product, saturated};
pub use error::Error;
pub use layout::{MambaSpec, SLOT_ALIGN, SlotLayout, SlotPart};
pub use policy::{
    BS1_SLOTS, CheckpointInterval, CheckpointWrite, DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_CHECKPOINTS_PER_STEP, MAX_CHECKPOINTS_PER_STEP, PlanMarks, StatePolicy,
};
pub use state::RecurrentState;

//! Mamba/GDN state slots and the tri-pool composite (Mamba end, SWA float, FULL end).
//!
//! Skeleton: the slot allocator and the tri-pool arrive with the Mamba issue. What this
//! crate will keep is stated now, so the crates below it are built to allow it.
//!
//! # Invariants this crate keeps (planned)
//! - Mamba state is one slot per page (page size 1) with its own virtual ids; a slot is
//!   never handed out twice and the sink slot is never handed out.
//! - A slot shortfall that is byte-bound evicts FULL as a donor (flushing deferred frees
//!   before each recheck); one that is id-bound evicts Mamba states only.
//! - In the tri-pool the float lies strictly between the two ends' frontiers, and moving
//!   it relocates whole page envelopes through the device layer only.

//! The crate's error type.

use crate::{BadLevel, Violations};

/// Everything the invariants crate can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `UNIKV_INVARIANT_CHECK` holds a value that is not a level.
    #[error(transparent)]
    BadLevel(#[from] BadLevel),
    /// Two declarations use the same invariant name.
    #[error("invariant {name:?} is declared twice: in {first} and in {second}")]
    DuplicateInvariant {
        /// The name declared twice.
        name: &'static str,
        /// The module of one declaration.
        first: &'static str,
        /// The module of the other.
        second: &'static str,
    },
    /// Invariants whose bucket fails at the current level were breached since the last poll.
    #[error(transparent)]
    Violated(#[from] Violations),
}

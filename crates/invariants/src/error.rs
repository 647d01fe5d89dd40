//! The crate's error type.

use crate::Violations;

/// Everything the invariants crate can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `UNIKV_INVARIANT_CHECK` holds a value that is not a level.
    #[error(
        "invalid {var}={value:?}: expected one of off, warn, strict, 0, 1, 2 (case-insensitive)"
    )]
    BadLevel {
        /// The variable's name.
        var: &'static str,
        /// The value found.
        value: String,
    },
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

//! What checking shares across scopes: the log period, whether costly checks run, the
//! fail mode and the failures a [`crate::Scope::poll`] returns.

use crate::{Bucket, Level, level};
use std::fmt;

/// After the first violation of an invariant, every `LOG_EVERY`-th is logged again.
pub const LOG_EVERY: u64 = 512;

/// Whether checks that cost something to evaluate should run (level `Warn` or `Strict`).
/// Containment must not depend on this: it runs at every level.
#[inline]
pub fn enabled() -> bool {
    level() != Level::Off
}

/// What [`crate::Scope::poll`] does when a breach fails at the current level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailMode {
    /// Return [`crate::Error::Violated`] (the default: library code reports, the engine decides).
    Error,
    /// Panic with the same message (for engines and test harnesses that prefer to stop).
    Panic,
}

/// One failing invariant in [`Violations`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The invariant's name.
    pub name: &'static str,
    /// Its bucket.
    pub bucket: Bucket,
    /// Breaches since the previous poll.
    pub count: u64,
    /// The most recent breach's message.
    pub last_message: Option<String>,
}

/// The failing breaches one [`crate::Scope::poll`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violations {
    /// The level at the poll.
    pub level: Level,
    /// Each failing invariant, sorted by name.
    pub failures: Vec<Failure>,
}

impl std::error::Error for Violations {}

impl fmt::Display for Violations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant violations at level {}:", self.level)?;
        for (i, failure) in self.failures.iter().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(
                f,
                "{sep}{} ({}) ×{}",
                failure.name, failure.bucket, failure.count
            )?;
            if let Some(message) = &failure.last_message {
                write!(f, ": {message}")?;
            }
        }
        Ok(())
    }
}

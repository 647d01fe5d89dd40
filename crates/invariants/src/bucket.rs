//! Buckets: how bad a breach is, and the crash matrix.

use crate::Level;
use std::fmt;

/// Blast radius × recoverability of an invariant breach.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bucket {
    /// A legitimate, recoverable situation worth counting; never fails.
    Soften,
    /// Recoverable, but a bug: fails at `Strict`.
    Guard,
    /// No correct fallback, but the damage is contained cheaply: fails at `Strict`.
    FatalContainable,
    /// Global corruption (a page handed out twice, a leak of the buffer): fails from `Warn` up.
    FatalUncontainable,
}

impl Bucket {
    /// Every bucket, mildest first.
    pub const ALL: [Bucket; 4] = [
        Bucket::Soften,
        Bucket::Guard,
        Bucket::FatalContainable,
        Bucket::FatalUncontainable,
    ];

    /// The crash matrix: whether a breach in this bucket fails [`crate::Scope::poll`] at `level`.
    ///
    /// | bucket | off | warn | strict |
    /// |---|---|---|---|
    /// | Soften | – | – | – |
    /// | Guard | – | – | fails |
    /// | FatalContainable | – | – | fails |
    /// | FatalUncontainable | – | fails | fails |
    pub const fn fails_at(self, level: Level) -> bool {
        match self {
            Bucket::Soften => false,
            Bucket::Guard | Bucket::FatalContainable => matches!(level, Level::Strict),
            Bucket::FatalUncontainable => matches!(level, Level::Warn | Level::Strict),
        }
    }

    /// The bucket's name as written in reports.
    pub const fn as_str(self) -> &'static str {
        match self {
            Bucket::Soften => "soften",
            Bucket::Guard => "guard",
            Bucket::FatalContainable => "fatal-containable",
            Bucket::FatalUncontainable => "fatal-uncontainable",
        }
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

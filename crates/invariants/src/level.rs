//! The check level: `UNIKV_INVARIANT_CHECK`, read once, with programmatic and scoped overrides.

use once_cell::sync::OnceCell;
use std::cell::Cell;
use std::ffi::OsStr;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

/// The environment variable that sets the default level.
pub const ENV_VAR: &str = "UNIKV_INVARIANT_CHECK";

/// A value of [`ENV_VAR`] (or given to [`Level::parse`]) that is not a level.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {var}={value:?}: expected one of off, warn, strict, 0, 1, 2 (case-insensitive)")]
pub struct BadLevel {
    /// The variable's name.
    pub var: &'static str,
    /// The value found.
    pub value: String,
}

/// How much invariant checking runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Level {
    /// Containment only: breaches are neither counted nor logged (the default).
    #[default]
    Off = 0,
    /// Breaches are counted and logged (first hit, then every [`crate::LOG_EVERY`]-th);
    /// only `FatalUncontainable` fails.
    Warn = 1,
    /// Like `Warn`, and `Guard` and `FatalContainable` fail too.
    Strict = 2,
}

impl Level {
    /// Every level, from `Off` to `Strict`.
    pub const ALL: [Level; 3] = [Level::Off, Level::Warn, Level::Strict];

    /// Parses `off|warn|strict|0|1|2`, case-insensitive, surrounding spaces ignored.
    pub fn parse(value: &str) -> Result<Level, BadLevel> {
        match value.trim().to_ascii_lowercase().as_str() {
            "off" | "0" => Ok(Level::Off),
            "warn" | "1" => Ok(Level::Warn),
            "strict" | "2" => Ok(Level::Strict),
            _ => Err(BadLevel {
                var: ENV_VAR,
                value: value.to_string(),
            }),
        }
    }

    /// The level an environment value gives: unset or empty means `Off`.
    pub fn from_env_value(value: Option<&OsStr>) -> Result<Level, BadLevel> {
        match value {
            None => Ok(Level::Off),
            Some(v) if v.is_empty() => Ok(Level::Off),
            Some(v) => match v.to_str() {
                Some(s) => Level::parse(s),
                None => Err(BadLevel {
                    var: ENV_VAR,
                    value: v.to_string_lossy().into_owned(),
                }),
            },
        }
    }

    /// The level's name as accepted by [`Level::parse`].
    pub const fn as_str(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Warn => "warn",
            Level::Strict => "strict",
        }
    }

    const fn from_u8(v: u8) -> Option<Level> {
        match v {
            0 => Some(Level::Off),
            1 => Some(Level::Warn),
            2 => Some(Level::Strict),
            _ => None,
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Level {
    type Err = BadLevel;
    fn from_str(s: &str) -> Result<Level, BadLevel> {
        Level::parse(s)
    }
}

/// The level from the environment, read once (a bad value is not cached: each ask
/// reports it again).
static ENV_LEVEL: OnceCell<Level> = OnceCell::new();
/// Process-wide override set by [`set_level`]; `NO_OVERRIDE` when unset.
static OVERRIDE: AtomicU8 = AtomicU8::new(NO_OVERRIDE);
const NO_OVERRIDE: u8 = u8::MAX;

thread_local! {
    /// Innermost scoped override of this thread.
    static SCOPED: Cell<Option<Level>> = const { Cell::new(None) };
}

/// The level in force on this thread: the innermost scoped override, else the
/// process-wide override, else `UNIKV_INVARIANT_CHECK`.
pub fn try_level() -> Result<Level, BadLevel> {
    if let Some(level) = SCOPED.with(Cell::get) {
        return Ok(level);
    }
    if let Some(level) = Level::from_u8(OVERRIDE.load(Ordering::Relaxed)) {
        return Ok(level);
    }
    ENV_LEVEL
        .get_or_try_init(|| Level::from_env_value(std::env::var_os(ENV_VAR).as_deref()))
        .copied()
}

/// The level in force, with a bad environment value read as `Strict` (fail safe).
/// Entry points call [`crate::init`] first, which reports such a value as an error.
pub fn level() -> Level {
    try_level().unwrap_or(Level::Strict)
}

/// Sets the process-wide level (for engines that take it from their own configuration).
/// `None` returns to the environment's level.
pub fn set_level(level: Option<Level>) {
    OVERRIDE.store(level.map_or(NO_OVERRIDE, |l| l as u8), Ordering::Relaxed);
}

/// Runs `f` with `level` in force on this thread, then restores the previous level.
pub fn scoped_level<R>(level: Level, f: impl FnOnce() -> R) -> R {
    let _guard = override_level(level);
    f()
}

/// Puts `level` in force on this thread until the guard drops (scoped override for tests).
pub fn override_level(level: Level) -> LevelGuard {
    let previous = SCOPED.with(|s| s.replace(Some(level)));
    LevelGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the previous scoped level of this thread when dropped.
#[must_use = "the override ends when the guard drops"]
#[derive(Debug)]
pub struct LevelGuard {
    previous: Option<Level>,
    // The override is per thread, so the guard must drop on the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for LevelGuard {
    fn drop(&mut self) {
        SCOPED.with(|s| s.set(self.previous));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_parses() {
        let cases = [
            ("off", Level::Off),
            ("OFF", Level::Off),
            ("Off", Level::Off),
            ("0", Level::Off),
            ("warn", Level::Warn),
            ("WARN", Level::Warn),
            ("wArN", Level::Warn),
            ("1", Level::Warn),
            ("strict", Level::Strict),
            ("STRICT", Level::Strict),
            (" strict\n", Level::Strict),
            ("2", Level::Strict),
        ];
        for (text, expected) in cases {
            assert_eq!(Level::parse(text).unwrap(), expected, "{text:?}");
        }
        for level in Level::ALL {
            assert_eq!(Level::parse(level.as_str()).unwrap(), level);
        }
    }

    #[test]
    fn unset_and_empty_are_off() {
        assert_eq!(Level::from_env_value(None).unwrap(), Level::Off);
        assert_eq!(
            Level::from_env_value(Some(OsStr::new(""))).unwrap(),
            Level::Off
        );
        assert_eq!(
            Level::from_env_value(Some(OsStr::new("warn"))).unwrap(),
            Level::Warn
        );
    }

    #[test]
    fn a_bad_value_names_the_variable_the_value_and_the_spellings() {
        for bad in ["loud", "3", "-1", "true", "stric", "off,warn"] {
            let message = Level::parse(bad).unwrap_err().to_string();
            assert!(message.contains("UNIKV_INVARIANT_CHECK"), "{message}");
            assert!(message.contains(&format!("{bad:?}")), "{message}");
            for spelling in ["off", "warn", "strict", "0", "1", "2"] {
                assert!(message.contains(spelling), "{message}");
            }
        }
        let message = Level::from_env_value(Some(OsStr::new("loud")))
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "invalid UNIKV_INVARIANT_CHECK=\"loud\": expected one of off, warn, strict, 0, 1, 2 (case-insensitive)"
        );
    }

    #[test]
    fn scoped_overrides_nest_and_restore() {
        let outer = level();
        scoped_level(Level::Strict, || {
            assert_eq!(level(), Level::Strict);
            scoped_level(Level::Warn, || assert_eq!(level(), Level::Warn));
            assert_eq!(level(), Level::Strict);
        });
        assert_eq!(level(), outer);
    }
}

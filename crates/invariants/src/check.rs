//! `expect` (record, never fail) and `poll` (the step boundary, where failing happens).

use crate::counters::crosses_log_point;
use crate::{Bucket, Error, Invariant, Level, level, registry};
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

/// After the first violation of an invariant, every `LOG_EVERY`-th is logged again.
pub const LOG_EVERY: u64 = 512;

/// Whether checks that cost something to evaluate should run (level `Warn` or `Strict`).
/// Containment must not depend on this: it runs at every level.
#[inline]
pub fn enabled() -> bool {
    level() != Level::Off
}

/// Records one breach of `invariant` when `holds` is false, and returns `holds` so that
/// the caller can run its containment step (at every level, `Off` included).
///
/// Never blocks, panics or fails: from `Warn` up it bumps the invariant's counters and
/// logs the first hit and then every [`LOG_EVERY`]-th through `tracing`; failing is
/// [`poll`]'s job. `message` is only evaluated for a breach that is recorded.
#[inline]
pub fn expect(
    invariant: &'static Invariant,
    holds: bool,
    message: impl FnOnce() -> String,
) -> bool {
    if !holds {
        record(invariant, 1, message);
    }
    holds
}

/// Records `violations` breaches counted elsewhere, e.g. by a device-side count kernel
/// whose result was read without blocking at the step boundary.
pub fn expect_count(
    invariant: &'static Invariant,
    violations: u64,
    message: impl FnOnce() -> String,
) {
    if violations > 0 {
        record(invariant, violations, message);
    }
}

#[cold]
fn record(invariant: &'static Invariant, n: u64, message: impl FnOnce() -> String) {
    if level() == Level::Off {
        return;
    }
    let before = invariant.counters.record(n);
    let log = crosses_log_point(before, n, LOG_EVERY);
    if !log && invariant.bucket() == Bucket::Soften {
        return;
    }
    let message = message();
    if log {
        let count = before + n;
        let (name, bucket) = (invariant.name(), invariant.bucket().as_str());
        match invariant.bucket() {
            Bucket::Soften => tracing::info!(invariant = name, bucket, count, "{message}"),
            Bucket::Guard | Bucket::FatalContainable => {
                tracing::warn!(invariant = name, bucket, count, "{message}")
            }
            Bucket::FatalUncontainable => {
                tracing::error!(invariant = name, bucket, count, "{message}")
            }
        }
    }
    *invariant
        .last_message
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(message);
}

/// What [`poll`] does when a breach fails at the current level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailMode {
    /// Return [`Error::Violated`] (the default: library code reports, the engine decides).
    Error,
    /// Panic with the same message (for engines and test harnesses that prefer to stop).
    Panic,
}

static FAIL_MODE: AtomicU8 = AtomicU8::new(0);

/// Chooses what [`poll`] does on a failing breach, process-wide.
pub fn set_fail_mode(mode: FailMode) {
    FAIL_MODE.store(matches!(mode, FailMode::Panic) as u8, Ordering::Relaxed);
}

/// The fail mode in force.
pub fn fail_mode() -> FailMode {
    if FAIL_MODE.load(Ordering::Relaxed) == 0 {
        FailMode::Error
    } else {
        FailMode::Panic
    }
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

/// The failing breaches one [`poll`] found.
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

/// The step boundary: drains every invariant's breaches since the last poll and fails
/// when one of them is in a bucket that fails at the current level (see
/// [`Bucket::fails_at`]). Each breach is seen by exactly one poll. Breaches that do not
/// fail at this level are drained too (they stay in the totals of [`crate::report`]).
pub fn poll() -> Result<(), Error> {
    let level = level();
    let mut failures = Vec::new();
    for invariant in registry()?.iter() {
        let count = invariant.counters.take_unpolled();
        if count > 0 && invariant.bucket().fails_at(level) {
            failures.push(Failure {
                name: invariant.name(),
                bucket: invariant.bucket(),
                count,
                last_message: invariant.last_message(),
            });
        }
    }
    if failures.is_empty() {
        return Ok(());
    }
    let violations = Violations { level, failures };
    match fail_mode() {
        FailMode::Error => Err(Error::Violated(violations)),
        FailMode::Panic => panic!("{violations}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{declare_invariant, scoped_level};
    use std::sync::{Arc, Mutex};

    declare_invariant! {
        /// Test invariant in the `Soften` bucket.
        static TEST_SOFTEN: "test.soften", Soften, "test: soften";
        /// Test invariant in the `Guard` bucket.
        static TEST_GUARD: "test.guard", Guard, "test: guard";
        /// Test invariant in the `FatalContainable` bucket.
        static TEST_FATAL_CONTAINABLE: "test.fatal_containable", FatalContainable, "test: fatal containable";
        /// Test invariant in the `FatalUncontainable` bucket.
        static TEST_FATAL_UNCONTAINABLE: "test.fatal_uncontainable", FatalUncontainable, "test: fatal uncontainable";
    }

    fn of(bucket: Bucket) -> &'static Invariant {
        match bucket {
            Bucket::Soften => &TEST_SOFTEN,
            Bucket::Guard => &TEST_GUARD,
            Bucket::FatalContainable => &TEST_FATAL_CONTAINABLE,
            Bucket::FatalUncontainable => &TEST_FATAL_UNCONTAINABLE,
        }
    }

    #[test]
    fn the_crash_matrix_holds_for_every_bucket_and_level() {
        let expected = |bucket, level| match (bucket, level) {
            (Bucket::Soften, _) => false,
            (_, Level::Off) => false,
            (Bucket::FatalUncontainable, _) => true,
            (_, Level::Warn) => false,
            (_, Level::Strict) => true,
        };
        for bucket in Bucket::ALL {
            for level in Level::ALL {
                assert_eq!(
                    bucket.fails_at(level),
                    expected(bucket, level),
                    "{bucket} at {level}"
                );
                scoped_level(level, || {
                    poll().ok(); // start from a clean slate
                    assert!(!expect(of(bucket), false, || format!(
                        "{bucket} breached at {level}"
                    )));
                    let result = poll();
                    assert_eq!(
                        result.is_err(),
                        expected(bucket, level),
                        "{bucket} at {level}: {result:?}"
                    );
                    if let Err(Error::Violated(v)) = result {
                        assert_eq!(v.failures.len(), 1);
                        assert_eq!(v.failures[0].name, of(bucket).name());
                        assert_eq!(v.failures[0].count, 1);
                        assert_eq!(v.level, level);
                    }
                    assert!(poll().is_ok(), "a breach fails one poll only");
                });
            }
        }
    }

    #[test]
    fn expect_returns_the_condition_so_containment_runs_at_off() {
        scoped_level(Level::Off, || {
            let before = TEST_GUARD.violations();
            let mut contained = 0;
            for holds in [true, false, false] {
                if !expect(&TEST_GUARD, holds, || {
                    unreachable!("no message is built at off")
                }) {
                    contained += 1;
                }
            }
            assert_eq!(contained, 2);
            assert_eq!(TEST_GUARD.violations(), before, "off counts nothing");
        });
    }

    #[test]
    fn the_panic_mode_panics_at_poll_not_at_expect() {
        scoped_level(Level::Strict, || {
            poll().ok();
            set_fail_mode(FailMode::Panic);
            expect(&TEST_FATAL_CONTAINABLE, false, || "boom".into());
            let caught = std::panic::catch_unwind(poll).unwrap_err();
            set_fail_mode(FailMode::Error);
            let text = caught.downcast_ref::<String>().unwrap();
            assert!(
                text.contains("test.fatal_containable") && text.contains("boom"),
                "{text}"
            );
        });
    }

    /// A `tracing` writer that keeps what it is given.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn warn_logs_the_first_hit_and_then_every_nth_with_counts() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            scoped_level(Level::Warn, || {
                for i in 0..(2 * LOG_EVERY + 3) {
                    expect(&TEST_GUARD, false, || format!("breach {i}"));
                }
                expect_count(&TEST_FATAL_UNCONTAINABLE, 3, || "three device hits".into());
            });
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let guard_lines: Vec<&str> = text.lines().filter(|l| l.contains("test.guard")).collect();
        assert_eq!(guard_lines.len(), 3, "first, 512th and 1024th:\n{text}");
        assert!(
            guard_lines[0].contains("WARN") && guard_lines[0].contains("count=1"),
            "{text}"
        );
        assert!(
            guard_lines[0].contains("bucket=\"guard\"") && guard_lines[0].contains("breach 0"),
            "{text}"
        );
        assert!(
            guard_lines[1].contains("count=512") && guard_lines[1].contains("breach 511"),
            "{text}"
        );
        assert!(guard_lines[2].contains("count=1024"), "{text}");
        let fatal: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("test.fatal_uncontainable"))
            .collect();
        assert_eq!(fatal.len(), 1);
        assert!(
            fatal[0].contains("ERROR") && fatal[0].contains("count=3"),
            "{text}"
        );
        assert!(TEST_GUARD.violations() >= 2 * LOG_EVERY + 3);
    }

    #[test]
    fn log_points_are_first_and_every_nth() {
        use crate::counters::crosses_log_point as c;
        assert!(c(0, 1, 512));
        assert!(!c(1, 1, 512));
        assert!(c(511, 1, 512));
        assert!(!c(512, 1, 512));
        assert!(c(500, 20, 512), "a batch that crosses a point logs");
        assert!(!c(0, 0, 512));
    }
}

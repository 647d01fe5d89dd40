//! [`Scope`]: the violation counters of one cache, with its `expect`, `poll` and `report`.
//!
//! The registry of names is process-wide; the counts are not. Each cache owns one scope
//! (its allocator and its tree record into clones of it), so two caches in one process —
//! tensor-parallel ranks as threads, tests of one binary — never drain or count each
//! other's breaches.

use crate::counters::{Counters, crosses_log_point};
use crate::sync::AtomicU64;
use crate::{
    Bucket, Error, FailMode, Failure, Invariant, LOG_EVERY, Level, Report, ReportRow, Violations,
    level, registry,
};
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// Source of scope ids (unique per [`Scope::new`] in the process).
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The violation counters of one cache, one slot per registered invariant.
///
/// Cheap to clone: clones share the counters (an `Arc`), so a cache hands a clone to its
/// allocator and its tree and all three record into, and poll, the same counts.
/// Recording is lock-free on the counters (a mutex guards only the last message of a
/// recorded breach); the level stays process-wide ([`crate::level`]).
///
/// ```
/// use unikv_invariants::{Level, Scope, declare_invariant, scoped_level};
///
/// declare_invariant! {
///     /// An example rule.
///     static EXAMPLE_RULE: "example.scope_rule", Guard, "an example rule";
/// }
///
/// let (mine, theirs) = (Scope::new(), Scope::new());
/// scoped_level(Level::Strict, || {
///     assert!(!mine.expect(&EXAMPLE_RULE, false, || "broken here".into()));
///     assert!(theirs.poll().is_ok(), "another scope sees nothing");
///     assert!(mine.poll().is_err(), "the breach fails its own scope's poll, once");
///     assert!(mine.poll().is_ok());
/// });
/// assert_eq!(mine.violations(&EXAMPLE_RULE), 1);
/// assert_eq!(theirs.violations(&EXAMPLE_RULE), 0);
/// ```
#[derive(Clone)]
pub struct Scope {
    inner: Arc<Inner>,
}

struct Inner {
    id: u64,
    /// One per registered invariant, indexed by [`Invariant::slot`]; empty when the
    /// registry could not be built (then `poll` and `report` return that error).
    slots: Box<[Slot]>,
    /// 0: [`FailMode::Error`], 1: [`FailMode::Panic`].
    fail_mode: AtomicU8,
}

struct Slot {
    counters: Counters,
    last_message: Mutex<Option<String>>,
}

impl Default for Scope {
    fn default() -> Self {
        Scope::new()
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("id", &self.inner.id)
            .field("fail_mode", &self.fail_mode())
            .finish_non_exhaustive()
    }
}

impl Scope {
    /// A scope with zeroed counters for every registered invariant and
    /// [`FailMode::Error`]. Never fails: when the registry cannot be built (a duplicate
    /// name), [`Scope::poll`] and [`Scope::report`] return that error.
    pub fn new() -> Scope {
        let invariants = registry().map_or(0, |r| r.len());
        let slots = (0..invariants)
            .map(|_| Slot {
                counters: Counters {
                    total: AtomicU64::new(0),
                    unpolled: AtomicU64::new(0),
                },
                last_message: Mutex::new(None),
            })
            .collect();
        Scope {
            inner: Arc::new(Inner {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                slots,
                fail_mode: AtomicU8::new(0),
            }),
        }
    }

    /// The scope's id, unique in the process and shared by its clones (logged with every
    /// breach, so that the ranks of one process can be told apart).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    fn slot(&self, invariant: &Invariant) -> Option<&Slot> {
        self.inner.slots.get(invariant.slot()?)
    }

    /// Records one breach of `invariant` when `holds` is false, and returns `holds` so that
    /// the caller can run its containment step (at every level, `Off` included).
    ///
    /// Never blocks, panics or fails: from `Warn` up it bumps this scope's counters and
    /// logs the scope's first hit and then every [`LOG_EVERY`]-th through `tracing`;
    /// failing is [`Scope::poll`]'s job. `message` is only evaluated for a breach that is
    /// recorded.
    #[inline]
    pub fn expect(
        &self,
        invariant: &'static Invariant,
        holds: bool,
        message: impl FnOnce() -> String,
    ) -> bool {
        if !holds {
            self.record(invariant, 1, message);
        }
        holds
    }

    /// Records `violations` breaches counted elsewhere, e.g. by a device-side count kernel
    /// whose result was read without blocking at the step boundary.
    pub fn expect_count(
        &self,
        invariant: &'static Invariant,
        violations: u64,
        message: impl FnOnce() -> String,
    ) {
        if violations > 0 {
            self.record(invariant, violations, message);
        }
    }

    #[cold]
    fn record(&self, invariant: &'static Invariant, n: u64, message: impl FnOnce() -> String) {
        if level() == Level::Off {
            return;
        }
        let (name, bucket) = (invariant.name(), invariant.bucket().as_str());
        let scope = self.inner.id;
        let Some(slot) = self.slot(invariant) else {
            // Only an `Invariant` built by hand and never submitted (or a broken
            // registry, which `poll` reports) gets here: say so rather than drop it.
            tracing::error!(
                invariant = name,
                bucket,
                scope,
                "breach of an invariant that is not in the registry (declare it with \
                 declare_invariant!): {}",
                message()
            );
            return;
        };
        let before = slot.counters.record(n);
        let log = crosses_log_point(before, n, LOG_EVERY);
        if !log && invariant.bucket() == Bucket::Soften {
            return;
        }
        let message = message();
        if log {
            let count = before + n;
            match invariant.bucket() {
                Bucket::Soften => {
                    tracing::info!(invariant = name, bucket, scope, count, "{message}")
                }
                Bucket::Guard | Bucket::FatalContainable => {
                    tracing::warn!(invariant = name, bucket, scope, count, "{message}")
                }
                Bucket::FatalUncontainable => {
                    tracing::error!(invariant = name, bucket, scope, count, "{message}")
                }
            }
        }
        *slot.last_message.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
    }

    /// The step boundary: drains this scope's breaches since its last poll and fails when
    /// one of them is in a bucket that fails at the current level (see
    /// [`Bucket::fails_at`]), by returning [`Error::Violated`] or panicking, per
    /// [`Scope::fail_mode`]. Each breach is seen by exactly one poll of its scope; other
    /// scopes never see it. Breaches that do not fail at this level are drained too (they
    /// stay in the totals of [`Scope::report`]).
    pub fn poll(&self) -> Result<(), Error> {
        let level = level();
        let mut failures = Vec::new();
        for invariant in registry()?.iter() {
            let Some(slot) = self.slot(invariant) else {
                continue;
            };
            let count = slot.counters.take_unpolled();
            if count > 0 && invariant.bucket().fails_at(level) {
                failures.push(Failure {
                    name: invariant.name(),
                    bucket: invariant.bucket(),
                    count,
                    last_message: last_message(slot),
                });
            }
        }
        if failures.is_empty() {
            return Ok(());
        }
        let violations = Violations { level, failures };
        match self.fail_mode() {
            FailMode::Error => Err(Error::Violated(violations)),
            FailMode::Panic => panic!("{violations}"),
        }
    }

    /// Every registered invariant with the violations recorded in this scope (polled or
    /// not), sorted by name.
    pub fn report(&self) -> Result<Report, Error> {
        let rows = registry()?
            .iter()
            .map(|inv| ReportRow {
                name: inv.name(),
                bucket: inv.bucket(),
                module: inv.module(),
                description: inv.description(),
                violations: self.violations(inv),
            })
            .collect();
        Ok(Report {
            level: level(),
            rows,
        })
    }

    /// Every violation of `invariant` recorded in this scope (at `Warn` and `Strict`),
    /// polled or not.
    pub fn violations(&self, invariant: &Invariant) -> u64 {
        self.slot(invariant).map_or(0, |s| s.counters.total())
    }

    /// The message of the most recent violation of `invariant` recorded in this scope.
    pub fn last_message(&self, invariant: &Invariant) -> Option<String> {
        self.slot(invariant).and_then(last_message)
    }

    /// Chooses what [`Scope::poll`] does on a failing breach, for this scope and its
    /// clones (a cache's allocator and tree included).
    pub fn set_fail_mode(&self, mode: FailMode) {
        self.inner
            .fail_mode
            .store(matches!(mode, FailMode::Panic) as u8, Ordering::Relaxed);
    }

    /// The fail mode in force for this scope (default [`FailMode::Error`]).
    pub fn fail_mode(&self) -> FailMode {
        if self.inner.fail_mode.load(Ordering::Relaxed) == 0 {
            FailMode::Error
        } else {
            FailMode::Panic
        }
    }
}

fn last_message(slot: &Slot) -> Option<String> {
    slot.last_message
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{declare_invariant, scoped_level};
    use std::sync::Mutex;

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
                    let scope = Scope::new();
                    assert!(!scope.expect(of(bucket), false, || format!(
                        "{bucket} breached at {level}"
                    )));
                    let result = scope.poll();
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
                    assert!(scope.poll().is_ok(), "a breach fails one poll only");
                });
            }
        }
    }

    #[test]
    fn expect_returns_the_condition_so_containment_runs_at_off() {
        scoped_level(Level::Off, || {
            let scope = Scope::new();
            let mut contained = 0;
            for holds in [true, false, false] {
                if !scope.expect(&TEST_GUARD, holds, || {
                    unreachable!("no message is built at off")
                }) {
                    contained += 1;
                }
            }
            assert_eq!(contained, 2);
            assert_eq!(scope.violations(&TEST_GUARD), 0, "off counts nothing");
        });
    }

    #[test]
    fn the_panic_mode_panics_at_poll_not_at_expect_and_only_in_its_scope() {
        scoped_level(Level::Strict, || {
            let (panics, errs) = (Scope::new(), Scope::new());
            let clone = panics.clone();
            clone.set_fail_mode(FailMode::Panic);
            assert_eq!(panics.fail_mode(), FailMode::Panic, "clones share the mode");
            assert_eq!(errs.fail_mode(), FailMode::Error);
            panics.expect(&TEST_FATAL_CONTAINABLE, false, || "boom".into());
            errs.expect(&TEST_FATAL_CONTAINABLE, false, || "quiet".into());
            let caught = std::panic::catch_unwind(|| panics.poll()).unwrap_err();
            let text = caught.downcast_ref::<String>().unwrap();
            assert!(
                text.contains("test.fatal_containable") && text.contains("boom"),
                "{text}"
            );
            assert!(matches!(errs.poll(), Err(Error::Violated(_))));
        });
    }

    /// Two scopes in one process (and in two threads breaching and polling at once) see
    /// only their own breaches; clones of one scope see the same counts.
    #[test]
    fn scopes_never_see_each_others_breaches() {
        scoped_level(Level::Strict, || {
            let (a, b) = (Scope::new(), Scope::new());
            assert_ne!(a.id(), b.id());
            assert_eq!(a.clone().id(), a.id());
            a.clone().expect(&TEST_GUARD, false, || "a's breach".into());
            assert!(b.poll().is_ok(), "b is clean");
            assert_eq!(b.violations(&TEST_GUARD), 0);
            assert_eq!(b.last_message(&TEST_GUARD), None);
            assert_eq!(a.last_message(&TEST_GUARD).as_deref(), Some("a's breach"));
            assert!(a.poll().is_err(), "a clone's breach is a's");
            assert_eq!(a.report().unwrap().total_violations(), 1);
            assert_eq!(b.report().unwrap().total_violations(), 0);
        });
        const ROUNDS: u64 = 200;
        let threads: Vec<_> = (1..=4u64)
            .map(|per_round| {
                std::thread::spawn(move || {
                    scoped_level(Level::Strict, || {
                        let scope = Scope::new();
                        let mut polled = 0;
                        for round in 0..ROUNDS {
                            scope.expect_count(&TEST_GUARD, per_round, || format!("{round}"));
                            if let Err(Error::Violated(v)) = scope.poll() {
                                polled += v.failures[0].count;
                            }
                        }
                        (per_round, polled, scope.violations(&TEST_GUARD))
                    })
                })
            })
            .collect();
        for t in threads {
            let (per_round, polled, total) = t.join().unwrap();
            assert_eq!(
                polled,
                per_round * ROUNDS,
                "each poll saw its own scope only"
            );
            assert_eq!(total, per_round * ROUNDS);
        }
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
    fn warn_logs_the_first_hit_and_then_every_nth_with_counts_per_scope() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let (scope, other) = (Scope::new(), Scope::new());
        tracing::subscriber::with_default(subscriber, || {
            scoped_level(Level::Warn, || {
                for i in 0..(2 * LOG_EVERY + 3) {
                    scope.expect(&TEST_GUARD, false, || format!("breach {i}"));
                }
                scope.expect_count(&TEST_FATAL_UNCONTAINABLE, 3, || "three device hits".into());
                other.expect(&TEST_GUARD, false, || "other's first".into());
            });
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let this_scope = format!("scope={}", scope.id());
        let guard_lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("test.guard") && l.contains(&this_scope))
            .collect();
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
        let other_lines: Vec<&str> = text.lines().filter(|l| l.contains("other's")).collect();
        assert_eq!(
            other_lines.len(),
            1,
            "each scope logs its own first hit:\n{text}"
        );
        assert!(
            other_lines[0].contains(&format!("scope={}", other.id()))
                && other_lines[0].contains("count=1"),
            "{text}"
        );
        let fatal: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("test.fatal_uncontainable"))
            .collect();
        assert_eq!(fatal.len(), 1);
        assert!(
            fatal[0].contains("ERROR") && fatal[0].contains("count=3"),
            "{text}"
        );
        assert_eq!(scope.violations(&TEST_GUARD), 2 * LOG_EVERY + 3);
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

    #[test]
    fn an_invariant_outside_the_registry_is_counted_nowhere() {
        static LOOSE: Invariant = Invariant::new("test.loose", Bucket::Guard, "loose", "here");
        scoped_level(Level::Strict, || {
            let scope = Scope::new();
            assert!(!scope.expect(&LOOSE, false, || "unregistered".into()));
            assert_eq!(scope.violations(&LOOSE), 0);
            assert!(scope.poll().is_ok());
        });
    }
}

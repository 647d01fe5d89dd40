//! The process-wide level override, in a test binary of its own: [`set_level`] changes
//! the level of every thread of the process, so it must not race with tests that read the
//! level without a scoped override (under `cargo test` the tests of one binary are threads).

use unikv_invariants::{Level, level, override_level, set_level};

#[test]
fn scoped_override_beats_the_process_override_and_stays_on_its_thread() {
    set_level(Some(Level::Warn));
    assert_eq!(level(), Level::Warn);
    let guard = override_level(Level::Off);
    assert_eq!(level(), Level::Off);
    std::thread::spawn(|| assert_eq!(level(), Level::Warn))
        .join()
        .unwrap();
    drop(guard);
    assert_eq!(level(), Level::Warn);
    set_level(None);
}

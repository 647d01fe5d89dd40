//! A step boundary that finds conservation broken. In a file of its own: the breach it
//! provokes is recorded in the process's invariant counters, which a test running
//! beside it in the same process (plain `cargo test`) would otherwise poll.

mod common;

use common::probe::{Fault, ProbeState};
use common::*;
use std::sync::{Arc, Mutex};
use unikv::{Error, Layout};

/// A boundary that finds conservation broken still ends the step, opens the next group
/// and polls the breach it recorded: a later cache's first boundary is clean (a pending
/// breach would fail it).
#[test]
fn a_conservation_failure_still_polls_and_reopens_the_free_group() {
    let config = Config::tokens(Layout::Unified, 1, 8, 64, 8);
    let state = Arc::new(Mutex::new(ProbeState::default()));
    let mut fx = Fixture::of(&config, config.build_probed(&state));
    let mut req = fx.admit(text(0, 20));
    fx.prefill(&mut req, 20);
    state.lock().unwrap().fail_once = Some(Fault::LoseRowFrees);
    fx.cache.release(req).unwrap();
    match fx.cache.step_boundary() {
        Err(Error::Conservation { .. }) => {}
        other => panic!("leaked pages passed the boundary: {other:?}"),
    }
    assert!(fx.cache.allocator().in_free_group());
    let mut clean = Fixture::new(&config);
    clean.step();
}

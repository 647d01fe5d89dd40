//! insta snapshots of the tree dump after a scripted sequence: shared prefixes, window
//! eviction below a cursor (a tombstone node), a locked request, SWA eviction that
//! tombstones internal nodes and cascades to their Mamba states, a duplicate insert that
//! revives tombstones by recovery under the lock, and FULL eviction. Fixed page size 2 and
//! window 4, so the snapshots do not depend on the matrix cell.

mod common;

use common::{Sim, tokens};
use unikv_radix::{Action, Component, TreeConfig};

fn listing(actions: &[Action]) -> String {
    actions.iter().map(|a| format!("{a}\n")).collect()
}

#[test]
fn the_dump_after_a_scripted_sequence_is_stable() {
    let mut sim = Sim::new(TreeConfig::swa(2, 4).with_mamba());
    let shared = [0, 1, 2, 3, 4];
    let mut long = shared.to_vec();
    long.extend([7, 8, 9]);

    // Two requests with a shared prefix; the second window-evicts below its cursor.
    let a = sim.start_fresh(tokens(&shared, 2));
    let c = sim.start_fresh(tokens(&shared, 2)); // a duplicate, inserted at the end
    sim.finish(a);
    let b = sim.start(tokens(&long, 2));
    sim.slide(b, 2);
    sim.finish(b);
    sim.check();
    insta::assert_snapshot!("after_two_requests", sim.tree.dump());

    // A request locks the long path (its window covers the last leaf only); SWA
    // eviction then tombstones every other node, dropping their Mamba states.
    let d = sim.start(tokens(&long, 2));
    let evicted = sim.evict(Component::Swa, usize::MAX);
    sim.check();
    insta::assert_snapshot!(
        "after_swa_eviction",
        format!("{}\nactions:\n{}", sim.tree.dump(), listing(&evicted))
    );

    // The duplicate finishes: its live copies revive the tombstones; their FULL is
    // locked by `d`, so SWA ownership moves instead of values being adopted.
    let _ = (c, d);
    let actions = sim.finish(0);
    sim.check();
    insta::assert_snapshot!(
        "after_recovery",
        format!("{}\nactions:\n{}", sim.tree.dump(), listing(&actions))
    );

    sim.finish(0);
    let evicted = sim.evict(Component::Full, 4);
    sim.check();
    insta::assert_snapshot!(
        "after_full_eviction",
        format!("{}\nactions:\n{}", sim.tree.dump(), listing(&evicted))
    );
    sim.drain();
}

//! The registry seen through the facade is complete: every invariant each crate lists is
//! registered (inventory silently drops crates that nothing references), and nothing is
//! registered that no crate lists.

#[test]
fn the_facade_sees_exactly_the_declared_invariants() {
    let registry = unikv::init().expect("a sound start-up configuration");
    let registered: Vec<&str> = registry.names().collect();
    let declared = unikv::declared_invariants();
    assert_eq!(
        registered, declared,
        "registry (left) and the crates' lists (right) differ"
    );
    for expected in [
        "swa.peer_mapped",
        "swa.peer_released",
        "swa.window_ratchet",
        "radix.sanity",
        "cache.conservation",
    ] {
        assert!(registered.contains(&expected), "{expected} missing");
    }
}

//! The registry seen through the facade is complete: every invariant each crate says it
//! declares is registered (inventory drops crates that nothing references).

#[test]
fn the_facade_sees_every_declared_invariant() {
    let registry = unikv::init().expect("a sound start-up configuration");
    let registered: Vec<&str> = registry.names().collect();
    let missing: Vec<&str> = unikv::declared_invariants()
        .into_iter()
        .filter(|name| !registered.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "declared but not registered: {missing:?}\nregistered: {registered:?}"
    );
}

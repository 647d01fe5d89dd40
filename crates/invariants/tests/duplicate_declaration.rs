//! A test binary of its own that declares a name the crate's tests do not use, twice, in
//! two modules: the registry must refuse it and name both modules. (It is a separate
//! binary so that the broken registry cannot affect any other test.)

mod first_site {
    unikv_invariants::declare_invariant! {
        /// One declaration of the shared name.
        pub static TAKEN: "dup.taken_name", Guard, "declared here first";
    }
}

mod second_site {
    unikv_invariants::declare_invariant! {
        /// A second, conflicting declaration of the same name.
        pub static TAKEN_AGAIN: "dup.taken_name", Soften, "and declared here again";
    }
}

#[test]
fn a_duplicate_name_is_refused_naming_both_declaring_modules() {
    assert_eq!(first_site::TAKEN.name(), second_site::TAKEN_AGAIN.name());
    let err = unikv_invariants::registry().unwrap_err();
    assert_eq!(
        err.to_string(),
        "invariant \"dup.taken_name\" is declared twice: in duplicate_declaration::first_site \
         and in duplicate_declaration::second_site"
    );
    // Asking again reports the same error: nothing half-built was cached.
    assert_eq!(
        unikv_invariants::registry().unwrap_err().to_string(),
        err.to_string()
    );
    // Start-up and a scope's poll and report report it too, instead of running without a
    // registry (its `expect` still returns the condition, so containment runs).
    assert!(matches!(
        unikv_invariants::init(),
        Err(unikv_invariants::Error::DuplicateInvariant { .. })
    ));
    let scope = unikv_invariants::Scope::new();
    let _strict = unikv_invariants::override_level(unikv_invariants::Level::Strict);
    assert!(!scope.expect(&first_site::TAKEN, false, || "still contained".into()));
    assert!(scope.poll().is_err());
    assert!(scope.report().is_err());
}

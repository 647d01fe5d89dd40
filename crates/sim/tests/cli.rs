//! The `unikv` binary's start-up behaviour.

use std::process::Command;

#[test]
fn a_bad_invariant_level_is_a_one_line_error_naming_the_variable_and_spellings() {
    for bad in ["loud", "3", "yes"] {
        let out = Command::new(env!("CARGO_BIN_EXE_unikv"))
            .arg("replay")
            .env("UNIKV_INVARIANT_CHECK", bad)
            .output()
            .expect("the binary runs");
        assert!(!out.status.success(), "{bad}: must exit non-zero");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr:?}");
        assert!(
            stderr.contains("UNIKV_INVARIANT_CHECK") && stderr.contains(&format!("{bad:?}")),
            "{stderr}"
        );
        assert!(stderr.contains("off, warn, strict, 0, 1, 2"), "{stderr}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn every_accepted_spelling_starts() {
    for good in ["off", "WARN", "Strict", "0", "1", "2"] {
        let out = Command::new(env!("CARGO_BIN_EXE_unikv"))
            .arg("--help")
            .env("UNIKV_INVARIANT_CHECK", good)
            .output()
            .expect("the binary runs");
        assert!(
            out.status.success(),
            "{good}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

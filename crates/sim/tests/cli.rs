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

/// Runs the binary with `args` (and a valid invariant level) and returns (status, stdout,
/// stderr).
fn unikv(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_unikv"))
        .args(args)
        .env("UNIKV_INVARIANT_CHECK", "off")
        .output()
        .expect("the binary runs");
    (
        out.status.code(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn replay_help_documents_the_options_the_defaults_and_the_trace_format() {
    let (status, stdout, stderr) = unikv(&["replay", "--help"]);
    assert_eq!(status, Some(0), "{stderr}");
    for needle in [
        "--workload",
        "--page-size",
        "--memory",
        "--layout",
        "--seed",
        "--json",
        "--svg DIR",
        "--trace FILE",
        "--record-ops FILE",
        "[default: 1,256]",
        "TRACE FORMAT",
        "shared-prefix",
        "EXIT STATUS",
    ] {
        assert!(stdout.contains(needle), "{needle} missing from:\n{stdout}");
    }
    let (status, stdout, _) = unikv(&["help"]);
    assert_eq!(status, Some(0));
    assert!(stdout.contains("unikv replay") && stdout.contains("unikv bench-ops"));
}

#[test]
fn bad_options_are_one_line_errors_with_status_2() {
    for args in [
        &["replay", "--memory", "24G"][..],
        &["replay", "--workload", "nope"],
        &["replay", "--page-size", "0"],
        &["replay", "--layout", "paged"],
        &["replay", "--frobnicate"],
        &["replay", "--record-ops", "ops.jsonl"],
        &["bench-ops"],
        &["rerun"],
    ] {
        let (status, stdout, stderr) = unikv(args);
        assert_eq!(status, Some(2), "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("unikv: "), "{args:?}: {stderr}");
    }
}

#[test]
fn a_malformed_trace_line_is_reported_with_its_file_and_line() {
    let dir = std::env::temp_dir().join(format!("unikv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"arrival_step\": 0, \"prompt_len\": 64, \"output_len\": 8}\n\
         \n\
         {\"arrival_step\": 1, \"prompt_len\": 64, \"output_len\": 0}\n",
    )
    .unwrap();
    let (status, stdout, stderr) = unikv(&["replay", "--trace", path.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stdout.is_empty());
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("bad.jsonl:3: output_len must be at least 1"),
        "{stderr}"
    );
}

#[test]
fn the_smoke_report_is_stable() {
    let (status, stdout, stderr) = unikv(&["replay", "--workload", "smoke", "--no-timing"]);
    assert_eq!(status, Some(0), "{stderr}");
    insta::assert_snapshot!(stdout);
}

#[test]
fn the_same_seed_gives_identical_json_twice() {
    let args = [
        "replay",
        "--workload",
        "smoke",
        "--page-size",
        "4",
        "--seed",
        "9",
        "--json",
        "--no-timing",
    ];
    let (s1, first, e1) = unikv(&args);
    let (s2, second, e2) = unikv(&args);
    assert_eq!((s1, s2), (Some(0), Some(0)), "{e1}{e2}");
    assert!(
        first.starts_with('{') && first.contains("\"schema\": \"unikv.replay.v1\""),
        "{first}"
    );
    assert_eq!(first, second);
    let (_, other_seed, _) = unikv(&[
        "replay",
        "--workload",
        "smoke",
        "--page-size",
        "4",
        "--seed",
        "10",
        "--json",
        "--no-timing",
    ]);
    assert_ne!(first, other_seed, "the seed changes the workload");
}

#[test]
fn an_impossible_budget_is_a_clear_error_instead_of_a_hang() {
    let (status, stdout, stderr) = unikv(&["replay", "--workload", "smoke", "--memory", "1MiB"]);
    assert_eq!(status, Some(2), "{stdout}{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("1048576") || stderr.contains("1 MiB") || stderr.contains("budget"),
        "{stderr}"
    );
}

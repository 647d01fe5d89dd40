//! The `unikv` binary (skeleton).
fn main() {}

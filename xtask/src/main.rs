//! xtask (skeleton).
fn main() {}

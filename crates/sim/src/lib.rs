//! unikv-sim (skeleton).

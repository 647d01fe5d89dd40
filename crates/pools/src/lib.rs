//! unikv-pools (skeleton).

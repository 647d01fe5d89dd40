//! unikv-mamba (skeleton).

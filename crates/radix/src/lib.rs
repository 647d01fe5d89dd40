//! unikv-radix (skeleton).

//! unikv facade (skeleton).

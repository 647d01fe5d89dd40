//! Byte counts of memory shapes in 64 bits: the checked product of a shape's factors and
//! its saturating form for infallible accessors. A recurrent layer's state here and the
//! facade's per-token KV rows (`unikv::KvRows`) are sized with the same two functions.

/// The product of `factors` in 64 bits, or `None` when it overflows.
///
/// ```
/// use unikv_mamba::checked_product;
/// assert_eq!(checked_product(&[24, 2, 8, 64, 2]), Some(49_152));
/// assert_eq!(checked_product(&[u32::MAX, u32::MAX, 2]), None);
/// assert_eq!(checked_product(&[]), Some(1));
/// ```
pub const fn checked_product(factors: &[u32]) -> Option<u64> {
    let mut bytes: u64 = 1;
    let mut i = 0;
    while i < factors.len() {
        bytes = match bytes.checked_mul(factors[i] as u64) {
            Some(b) => b,
            None => return None,
        };
        i += 1;
    }
    Some(bytes)
}

/// A checked byte count, or `u64::MAX` where it overflowed (for accessors that cannot
/// fail; a caller that must refuse an overflow uses the checked count).
///
/// ```
/// use unikv_mamba::saturated;
/// assert_eq!(saturated(Some(7)), 7);
/// assert_eq!(saturated(None), u64::MAX);
/// ```
pub const fn saturated(bytes: Option<u64>) -> u64 {
    match bytes {
        Some(b) => b,
        None => u64::MAX,
    }
}

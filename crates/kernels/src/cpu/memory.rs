//! Fallible host allocation for the CPU backend: a flat vector that reports a host out of
//! memory as [`Error::OutOfMemory`] instead of aborting. A leaf: the device and its
//! chunked buffers (`sparse.rs`) both allocate through it, and it imports neither.

use crate::Error;

/// The CPU backend's out-of-memory error for a request of `bytes`.
fn out_of_memory(bytes: u64) -> Error {
    Error::OutOfMemory {
        device: "cpu".to_string(),
        bytes,
    }
}

/// A vector of `len` copies of `fill`, or an error instead of an abort when the host
/// cannot allocate it.
pub(crate) fn filled<T: Copy>(len: usize, fill: T) -> Result<Vec<T>, Error> {
    let bytes = (len as u64).saturating_mul(size_of::<T>() as u64);
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| out_of_memory(bytes))?;
    v.resize(len, fill);
    Ok(v)
}

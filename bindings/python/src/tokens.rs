//! Token ids from Python: any C-contiguous buffer of 32- or 64-bit integers (a numpy
//! array, `array('q')`, a CPU torch tensor's `.numpy()`) read through a `memoryview` in
//! one copy, no Python loop per token; or a list or tuple of ints.

use crate::errors::invalid;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyTuple};
use unikv::TokenId;

/// The token ids `value` holds. Refuses (with `InvalidArgument`, changing nothing) a
/// buffer that is not one-dimensional and contiguous, whose items are not 4- or 8-byte
/// integers, or an id that is negative or past `u32`.
pub fn token_ids(value: &Bound<'_, PyAny>) -> PyResult<Vec<TokenId>> {
    read_ints(value, "tokens", id)
}

/// The integers `value` holds (a list or tuple of ints, or a one-dimensional contiguous
/// buffer of 4- or 8-byte integers), refused as [`token_ids`] refuses, with messages
/// naming `what`.
pub fn ints(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    read_ints(value, what, Ok)
}

/// The integers `value` holds, each through `f`, in one pass.
fn read_ints<T>(
    value: &Bound<'_, PyAny>,
    what: &str,
    f: impl Fn(i64) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let ids: Vec<i64> = value
            .extract()
            .map_err(|_| invalid(format!("{what}: a list of ints")))?;
        return ids.into_iter().map(f).collect();
    }
    let py = value.py();
    static MEMORYVIEW: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let memoryview = MEMORYVIEW.get_or_try_init(py, || {
        py.import("builtins")?
            .getattr("memoryview")
            .map(Bound::unbind)
    })?;
    let view = memoryview.bind(py).call1((value,)).map_err(|_| {
        invalid(format!(
            "{what}: an int32/int64 buffer or a list of ints, not {}",
            type_name(value)
        ))
    })?;
    let ndim: usize = view.getattr(intern!(py, "ndim"))?.extract()?;
    let contiguous: bool = view.getattr(intern!(py, "c_contiguous"))?.extract()?;
    let format: String = view.getattr(intern!(py, "format"))?.extract()?;
    let itemsize: usize = view.getattr(intern!(py, "itemsize"))?.extract()?;
    if ndim != 1 {
        return Err(invalid(format!(
            "{what}: a one-dimensional buffer, not {ndim} dimensions"
        )));
    }
    if !contiguous {
        return Err(invalid(format!(
            "{what}: a contiguous buffer (this one is strided)"
        )));
    }
    // Native or little-endian signed or unsigned integers of 4 or 8 bytes.
    let kind = format.trim_start_matches(['@', '=', '<']);
    let integer = matches!(kind, "i" | "l" | "q" | "I" | "L" | "Q" | "n" | "N");
    if !integer || !(itemsize == 4 || itemsize == 8) {
        return Err(invalid(format!(
            "{what}: int32 or int64 items, not format {format:?} of {itemsize} bytes"
        )));
    }
    let signed = kind.chars().all(|c| c.is_ascii_lowercase());
    let bytes = view.call_method0(intern!(py, "tobytes"))?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    let mut out = Vec::with_capacity(bytes.len() / itemsize);
    for chunk in bytes.chunks_exact(itemsize) {
        let v = match (itemsize, signed) {
            (4, true) => i64::from(i32::from_ne_bytes(chunk.try_into().expect("4 bytes"))),
            (4, false) => i64::from(u32::from_ne_bytes(chunk.try_into().expect("4 bytes"))),
            (_, true) => i64::from_ne_bytes(chunk.try_into().expect("8 bytes")),
            (_, false) => {
                let u = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
                i64::try_from(u).unwrap_or(i64::MAX)
            }
        };
        out.push(f(v)?);
    }
    Ok(out)
}

/// A token id, or `InvalidArgument` when `v` is negative or past `u32`.
fn id(v: i64) -> PyResult<TokenId> {
    u32::try_from(v)
        .map(TokenId)
        .map_err(|_| invalid(format!("tokens: id {v} is not in 0 ..= {}", u32::MAX)))
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "this object".into())
}

/// Per-request counts: `None` (one each), an int (the same for all) or one per request
/// (a buffer or a list of `n` non-negative ints).
pub fn counts(value: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Vec<usize>> {
    let Some(value) = value else {
        return Ok(vec![1; n]);
    };
    if let Ok(each) = value.extract::<usize>() {
        return Ok(vec![each; n]);
    }
    let ids = token_ids(value).map_err(|_| {
        invalid("new_tokens: an int, or one non-negative int per request (a buffer or a list)")
    })?;
    if ids.len() != n {
        return Err(invalid(format!(
            "new_tokens: {} counts for {n} requests",
            ids.len()
        )));
    }
    Ok(ids.into_iter().map(|t| t.0 as usize).collect())
}

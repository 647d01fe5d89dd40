//! The Python exception hierarchy, mirroring [`unikv::Error`]: `unikv.Error` and one
//! subclass per kind of failure, with the numbers as attributes where the Rust variant
//! has them. No Rust panic crosses into Python: [`guarded`] turns one into
//! `unikv.InternalError`.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::panic::{AssertUnwindSafe, catch_unwind};

pyo3::create_exception!(
    unikv,
    Error,
    PyException,
    "Everything unikv raises: a failed cache operation changes nothing it was given."
);
pyo3::create_exception!(
    unikv,
    OutOfMemory,
    Error,
    "Not enough memory even after evicting every unlocked prefix; the demand and what was free are attributes."
);
pyo3::create_exception!(
    unikv,
    InvalidArgument,
    Error,
    "An argument the cache refuses: a bad configuration, a request of another cache or one already finished, a count past the prompt, a bad buffer."
);
pyo3::create_exception!(
    unikv,
    InvariantViolation,
    Error,
    "An invariant failed at the current UNIKV_INVARIANT_CHECK level (or conservation broke at a step boundary)."
);
pyo3::create_exception!(
    unikv,
    DeviceError,
    Error,
    "The device (CPU or CUDA backend) refused an operation."
);
pyo3::create_exception!(
    unikv,
    InternalError,
    Error,
    "A bug in unikv (a Rust panic, caught at the boundary): please report it."
);

/// Registers the exception classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("OutOfMemory", py.get_type::<OutOfMemory>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("InvariantViolation", py.get_type::<InvariantViolation>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}

/// The Python exception for a facade error, with its numbers as attributes.
pub fn to_py(py: Python<'_>, e: unikv::Error) -> PyErr {
    use unikv::Error as E;
    let message = e.to_string();
    let attrs = PyDict::new(py);
    let err = match &e {
        E::OutOfMemory {
            full_pages,
            swa_pages,
            mamba_slots,
            full_available,
            swa_available,
            mamba_available,
        } => {
            let _ = attrs.set_item("full_pages", full_pages);
            let _ = attrs.set_item("swa_pages", swa_pages);
            let _ = attrs.set_item("mamba_slots", mamba_slots);
            let _ = attrs.set_item("full_available", full_available);
            let _ = attrs.set_item("swa_available", swa_available);
            let _ = attrs.set_item("mamba_available", mamba_available);
            OutOfMemory::new_err(message)
        }
        E::Conservation { step, .. } => {
            let _ = attrs.set_item("step", step);
            InvariantViolation::new_err(message)
        }
        E::Invariants(_) => InvariantViolation::new_err(message),
        E::Device(_) => DeviceError::new_err(message),
        E::ForeignRequest { request }
        | E::BadRequest { request, .. }
        | E::SpeculationOff { request }
        | E::VerifyWidth { request, .. }
        | E::BadDraftTree { request, .. }
        | E::TooManyInFlight { request, .. }
        | E::Unsettled { request, .. }
        | E::NothingToSettle { request }
        | E::BadAccepted { request, .. } => {
            let _ = attrs.set_item("request", request);
            InvalidArgument::new_err(message)
        }
        _ => {
            let _ = attrs.set_item("request", py.None());
            InvalidArgument::new_err(message)
        }
    };
    let value = err.value(py);
    for (k, v) in attrs.iter() {
        let _ = value.setattr(
            k.cast::<pyo3::types::PyString>().ok().map_or_else(
                || "detail".to_string(),
                |s| s.to_string_lossy().into_owned(),
            ),
            v,
        );
    }
    err
}

/// An `InvalidArgument` with `message` (about no request: its `request` is `None`).
pub fn invalid(message: impl Into<String>) -> PyErr {
    let err = InvalidArgument::new_err(message.into());
    Python::attach(|py| {
        let _ = err.value(py).setattr("request", py.None());
    });
    err
}

/// Runs `f`, turning a Rust panic into `unikv.InternalError` (never a Python
/// `PanicException`, which is a `BaseException` an engine's `except Exception` misses).
pub fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            Err(InternalError::new_err(format!("unikv panicked: {what}")))
        }
    }
}

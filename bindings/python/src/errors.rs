//! The Python exception hierarchy, mirroring [`unikv::Error`]: `unikv.Error` and one
//! subclass per kind of failure, with the numbers as attributes where the Rust variant
//! has them. No Rust panic crosses into Python: [`guarded`] turns one into
//! `unikv.InternalError`.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
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

/// The `unikv` exception class a facade error becomes (see [`classify`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// `unikv.OutOfMemory`.
    OutOfMemory,
    /// `unikv.InvalidArgument`.
    InvalidArgument,
    /// `unikv.InvariantViolation`.
    InvariantViolation,
    /// `unikv.DeviceError`.
    DeviceError,
}

impl Class {
    /// The class's name in the `unikv` module.
    pub fn name(self) -> &'static str {
        match self {
            Class::OutOfMemory => "OutOfMemory",
            Class::InvalidArgument => "InvalidArgument",
            Class::InvariantViolation => "InvariantViolation",
            Class::DeviceError => "DeviceError",
        }
    }

    /// An exception of this class with `message`.
    fn new_err(self, message: String) -> PyErr {
        match self {
            Class::OutOfMemory => OutOfMemory::new_err(message),
            Class::InvalidArgument => InvalidArgument::new_err(message),
            Class::InvariantViolation => InvariantViolation::new_err(message),
            Class::DeviceError => DeviceError::new_err(message),
        }
    }
}

/// The exception class a facade error becomes and the attributes it carries: a name
/// and an int, or `None` (Python's `None`). [`to_py`] raises exactly this; the lockstep
/// reference (`reference.rs`) records it.
pub fn classify(e: &unikv::Error) -> (Class, Vec<(&'static str, Option<u64>)>) {
    use unikv::Error as E;
    let count = |n: &usize| Some(*n as u64);
    match e {
        E::OutOfMemory {
            full_pages,
            swa_pages,
            mamba_slots,
            full_available,
            swa_available,
            mamba_available,
        } => (
            Class::OutOfMemory,
            vec![
                ("full_pages", count(full_pages)),
                ("swa_pages", count(swa_pages)),
                ("mamba_slots", count(mamba_slots)),
                ("full_available", count(full_available)),
                ("swa_available", count(swa_available)),
                ("mamba_available", count(mamba_available)),
            ],
        ),
        E::Conservation { step, .. } => (Class::InvariantViolation, vec![("step", Some(*step))]),
        E::Invariants(_) => (Class::InvariantViolation, vec![]),
        E::Device(_) => (Class::DeviceError, vec![]),
        E::ForeignRequest { request }
        | E::BadRequest { request, .. }
        | E::SpeculationOff { request }
        | E::VerifyWidth { request, .. }
        | E::BadDraftTree { request, .. }
        | E::TooManyInFlight { request, .. }
        | E::Unsettled { request, .. }
        | E::NothingToSettle { request }
        | E::BadAccepted { request, .. } => {
            (Class::InvalidArgument, vec![("request", Some(*request))])
        }
        _ => (Class::InvalidArgument, vec![("request", None)]),
    }
}

/// The Python exception for a facade error, with its numbers as attributes.
pub fn to_py(py: Python<'_>, e: unikv::Error) -> PyErr {
    let (class, attrs) = classify(&e);
    let err = class.new_err(e.to_string());
    let value = err.value(py);
    for (name, number) in attrs {
        let _ = match number {
            Some(n) => value.setattr(name, n),
            None => value.setattr(name, py.None()),
        };
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

/// The `InvalidArgument` for an object another call is using (a second thread's call on
/// the same request, match or metadata while the first runs with the GIL released).
pub fn busy(what: &str) -> PyErr {
    invalid(format!(
        "this {what} is in use by another call (another thread)"
    ))
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

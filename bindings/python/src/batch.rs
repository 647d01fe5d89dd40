//! A batch of requests for the calls that take several ([`Batch`]), and the one way
//! those calls read their `requests` argument: a `Batch` or any sequence of requests.
//!
//! An engine whose batch stays the same from step to step builds a `Batch` once: each
//! step then borrows its requests without converting a Python list (at batch 256 the
//! list's conversion is about as long as the allocator's step).

use crate::Request;
use crate::errors::invalid;
use pyo3::prelude::*;

/// An immutable list of requests, for `alloc_decode`, `build_step_metadata` and the
/// speculative calls; build a new one when requests join or leave.
#[pyclass(module = "unikv", name = "Batch", frozen)]
pub struct Batch {
    requests: Vec<Py<Request>>,
}

#[pymethods]
impl Batch {
    /// A batch of `requests` (each at most once).
    #[new]
    fn new(requests: Vec<Bound<'_, Request>>) -> PyResult<Batch> {
        let mut seen = std::collections::HashSet::with_capacity(requests.len());
        for r in &requests {
            if !seen.insert(r.as_ptr() as usize) {
                return Err(invalid("a request appears twice in the batch"));
            }
        }
        Ok(Batch {
            requests: requests.into_iter().map(Bound::unbind).collect(),
        })
    }

    fn __len__(&self) -> usize {
        self.requests.len()
    }

    /// The requests, in order.
    #[getter]
    fn requests(&self, py: Python<'_>) -> Vec<Py<Request>> {
        self.requests.iter().map(|r| r.clone_ref(py)).collect()
    }

    fn __repr__(&self) -> String {
        format!("Batch({} requests)", self.requests.len())
    }
}

/// The requests of `value` (a [`Batch`] or a sequence of requests) borrowed mutably, in
/// order; a request that appears twice, or is borrowed elsewhere, is refused.
pub fn borrow_all<'py>(value: &Bound<'py, PyAny>) -> PyResult<Vec<PyRefMut<'py, Request>>> {
    let py = value.py();
    let refuse = |_| invalid("a request appears twice in the batch");
    if let Ok(batch) = value.cast::<Batch>() {
        return batch
            .get()
            .requests
            .iter()
            .map(|r| r.bind(py).try_borrow_mut().map_err(refuse))
            .collect();
    }
    let requests: Vec<Bound<'py, Request>> = value
        .extract()
        .map_err(|_| invalid("requests: a unikv.Batch or a sequence of unikv.Request"))?;
    requests
        .iter()
        .map(|r| r.try_borrow_mut().map_err(refuse))
        .collect()
}

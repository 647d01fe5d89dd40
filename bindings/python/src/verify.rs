//! Verify metadata for Python: [`VerifyMetadata`] wraps the facade's, and its inputs
//! table's host image is a numpy `int32` array that views it.
//!
//! A view is an [`InputsView`] object (the array's base) that keeps the metadata alive and
//! is counted: a build into metadata with a live view is refused, so a view always reads
//! the build it was taken of.

use crate::errors::invalid;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyDict};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The metadata of one verify step for batches of up to `max_batch` requests, reused
/// across steps: built by `HybridCache.build_verify_metadata`, translated on the device
/// by `HybridCache.translate_verify`.
#[pyclass(module = "unikv", name = "VerifyMetadata")]
pub struct VerifyMetadata {
    pub(crate) inner: unikv::VerifyMetadata,
    /// Live views of the inputs' host image.
    views: Arc<AtomicUsize>,
}

impl VerifyMetadata {
    /// Refuses a build while a view of the host image is alive.
    pub(crate) fn check_no_views(&self) -> PyResult<()> {
        match self.views.load(Ordering::Acquire) {
            0 => Ok(()),
            n => Err(invalid(format!(
                "{n} numpy view(s) of this verify metadata's inputs are alive: drop them before the next build"
            ))),
        }
    }
}

#[pymethods]
impl VerifyMetadata {
    /// Empty metadata for batches of up to `max_batch` requests.
    #[new]
    fn new(max_batch: usize) -> VerifyMetadata {
        VerifyMetadata {
            inner: unikv::VerifyMetadata::new(max_batch),
            views: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The inputs table's host image as a numpy `int32` array viewing it (no copy). While
    /// the array lives, building into this metadata is refused.
    #[getter]
    fn inputs<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf
            .try_borrow()
            .map_err(|_| crate::errors::busy("verify metadata"))?;
        let image = me.inner.inputs();
        me.views.fetch_add(1, Ordering::AcqRel);
        let view = Bound::new(
            py,
            InputsView {
                _owner: slf.clone().unbind(),
                image: (image.as_ptr() as usize, image.len()),
                views: me.views.clone(),
            },
        )?;
        drop(me);
        static ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let asarray = ASARRAY.get_or_try_init(py, || {
            py.import("numpy")?.getattr("asarray").map(Bound::unbind)
        })?;
        asarray.bind(py).call1((view,))
    }

    /// Where each section of the inputs and outputs tables starts, in entries.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = self.inner.layout();
        let d = PyDict::new(py);
        for (k, v) in [
            ("max_batch", l.max_batch),
            ("width", l.width),
            ("rows_per_request", l.rows_per_request),
            ("slots_per_request", l.slots_per_request),
            ("widths", l.widths),
            ("settled", l.settled),
            ("parents", l.parents),
            ("depths", l.depths),
            ("masks", l.masks),
            ("rows", l.rows),
            ("slots", l.slots),
            ("entries", l.entries),
            ("zeros", l.zeros),
            ("inputs_len", l.inputs_len),
            ("write_full", l.write_full),
            ("write_swa", l.write_swa),
            ("state_in", l.state_in),
            ("state_out", l.state_out),
            ("prev_out", l.prev_out),
            ("outputs_len", l.outputs_len),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The device tables `(inputs, outputs)` once built, else `None`.
    #[getter]
    fn device_tables(&self) -> Option<(u32, u32)> {
        self.inner.tables().map(|(i, o)| (i.0, o.0))
    }
}

/// A counted view of a [`VerifyMetadata`]'s inputs (a numpy array's base).
#[pyclass(module = "unikv", name = "_InputsView", frozen)]
pub struct InputsView {
    _owner: Py<VerifyMetadata>,
    image: (usize, usize),
    views: Arc<AtomicUsize>,
}

#[pymethods]
impl InputsView {
    /// The numpy array interface (`int32`, read-only).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::step::array_interface(py, self.image)
    }

    /// The same as a C struct in a capsule (what numpy reads first).
    #[getter]
    fn __array_struct__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        crate::step::array_struct(py, self.image)
    }
}

impl Drop for InputsView {
    fn drop(&mut self) {
        self.views.fetch_sub(1, Ordering::AcqRel);
    }
}

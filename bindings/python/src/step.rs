//! Step metadata for Python: [`StepMetadata`] wraps the facade's, and its host image is
//! a numpy `int32` array that *views* it (`__array_interface__`, no copy).
//!
//! Safety of the view: the numpy array keeps the `StepMetadata` object alive (it is the
//! array's base), and the cache rebuilds into an object only when nothing but the cache
//! refers to it (no array, no Python name); otherwise the next build makes a new one. So
//! a view always reads the step it was taken of, and in the steady state (the engine
//! drops last step's arrays before building the next) nothing is allocated.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyDict};
use unikv::DeviceLayout;

/// One step's metadata: the header the host wrote (`host_image`, a numpy view) and where
/// each section starts (`layout`). The page tables are written on the device
/// (`device_table`). Built by `HybridCache.build_step_metadata`.
#[pyclass(module = "unikv", name = "StepMetadata")]
pub struct StepMetadata {
    pub(crate) inner: unikv::StepMetadata,
    /// The host image's address and length, taken at the build (the image is not
    /// touched until the next build into this object, which happens only when no view
    /// of it exists).
    image: (usize, usize),
    layout: DeviceLayout,
    table: Option<u32>,
}

impl StepMetadata {
    /// Empty metadata.
    pub fn new() -> StepMetadata {
        StepMetadata {
            inner: unikv::StepMetadata::new(),
            image: (0, 0),
            layout: DeviceLayout::default(),
            table: None,
        }
    }

    /// Records what a successful build produced: the host image's address and length
    /// (of `inner`'s own vector), its layout and its device table.
    pub fn built(&mut self, image: (usize, usize), layout: DeviceLayout, table: Option<u32>) {
        self.image = image;
        self.layout = layout;
        self.table = table;
    }
}

#[pymethods]
impl StepMetadata {
    /// The numpy array interface of the host image (`int32`, read-only, no copy).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        array_interface(py, self.image)
    }

    /// The same as a C struct (numpy's `PyArrayInterface` in a capsule), which numpy
    /// reads first and faster than the dict.
    #[getter]
    fn __array_struct__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        array_struct(py, self.image)
    }

    /// The header the host wrote, as a numpy `int32` array viewing it (valid as long as
    /// the array lives: it keeps this object alive).
    #[getter]
    fn host_image<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        static ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let py = slf.py();
        let asarray = ASARRAY.get_or_try_init(py, || {
            py.import("numpy")?.getattr("asarray").map(Bound::unbind)
        })?;
        asarray.bind(py).call1((slf,))
    }

    /// Where each section starts in the table, in entries (`query_starts`,
    /// `full_starts`, ..., `full_pages`, `swa_pages`, `len`), with `batch`, `max_batch`
    /// and `page_size`.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = &self.layout;
        let d = PyDict::new(py);
        for (k, v) in [
            ("batch", l.batch),
            ("max_batch", l.max_batch),
            ("page_size", l.page_size),
            ("query_starts", l.query_starts),
            ("full_starts", l.full_starts),
            ("full_last", l.full_last),
            ("swa_starts", l.swa_starts),
            ("swa_first", l.swa_first),
            ("swa_first_page", l.swa_first_page),
            ("lanes", l.lanes),
            ("write_full", l.write_full),
            ("write_swa", l.write_swa),
            ("state_slots", l.state_slots),
            ("checkpoint_starts", l.checkpoint_starts),
            ("checkpoint_slots", l.checkpoint_slots),
            ("checkpoint_at", l.checkpoint_at),
            ("load_starts", l.load_starts),
            ("load_full", l.load_full),
            ("load_swa", l.load_swa),
            ("load_host_full", l.load_host_full),
            ("load_host_swa", l.load_host_swa),
            ("load_states", l.load_states),
            ("full_pages", l.full_pages),
            ("swa_pages", l.swa_pages),
            ("len", l.len),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Entries the host wrote (everything before the page tables).
    #[getter]
    fn header_len(&self) -> usize {
        self.layout.header_len()
    }

    /// The device table holding the whole step table (the page tables written on the
    /// device), or `None` before a build.
    #[getter]
    fn device_table(&self) -> Option<u32> {
        self.table
    }

    fn __repr__(&self) -> String {
        format!(
            "StepMetadata(batch={}, header_len={}, len={})",
            self.layout.batch,
            self.layout.header_len(),
            self.layout.len
        )
    }
}

/// The numpy array interface of `len` `i32`s at `ptr` (read-only).
pub(crate) fn array_interface(
    py: Python<'_>,
    (ptr, len): (usize, usize),
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    // numpy needs a non-null address even for an empty array.
    let ptr = if len == 0 {
        std::ptr::NonNull::<i32>::dangling().as_ptr() as usize
    } else {
        ptr
    };
    d.set_item("shape", (len,))?;
    d.set_item("typestr", "<i4")?;
    d.set_item("data", (ptr, true))?;
    d.set_item("version", 3)?;
    Ok(d)
}

/// numpy's `PyArrayInterface` (numpy/ndarraytypes.h), the struct `__array_struct__`'s
/// capsule points to.
#[repr(C)]
struct PyArrayInterface {
    two: std::os::raw::c_int,
    nd: std::os::raw::c_int,
    typekind: std::os::raw::c_char,
    itemsize: std::os::raw::c_int,
    flags: std::os::raw::c_int,
    shape: *const isize,
    strides: *const isize,
    data: *const std::os::raw::c_void,
    descr: *const std::os::raw::c_void,
}

/// The capsule's contents: the interface first (numpy reads the capsule's pointer as a
/// `PyArrayInterface`), then the shape and stride it points to, on the heap so they stay
/// put when the value moves into the capsule.
#[repr(C)]
struct ArrayStruct {
    interface: PyArrayInterface,
    dims: Box<[isize; 2]>,
}

// SAFETY: the raw pointers point to `dims` (owned by the value) and to the host image,
// which numpy reads only while it holds the object the capsule came from; nothing is
// shared with another thread through them.
unsafe impl Send for ArrayStruct {}

/// numpy's `C_CONTIGUOUS | ALIGNED | NOTSWAPPED`: read-only, native order.
const READ_ONLY_FLAGS: std::os::raw::c_int = 0x1 | 0x100 | 0x200;

/// A capsule describing `len` `i32`s at `ptr` (read-only) for `__array_struct__`.
pub(crate) fn array_struct(
    py: Python<'_>,
    (ptr, len): (usize, usize),
) -> PyResult<Bound<'_, PyCapsule>> {
    let dims = Box::new([len as isize, std::mem::size_of::<i32>() as isize]);
    let ptr = if len == 0 {
        std::ptr::NonNull::<i32>::dangling().as_ptr() as usize
    } else {
        ptr
    };
    let value = ArrayStruct {
        interface: PyArrayInterface {
            two: 2,
            nd: 1,
            typekind: b'i' as std::os::raw::c_char,
            itemsize: std::mem::size_of::<i32>() as std::os::raw::c_int,
            flags: READ_ONLY_FLAGS,
            shape: dims.as_ptr(),
            strides: dims[1..].as_ptr(),
            data: ptr as *const std::os::raw::c_void,
            descr: std::ptr::null(),
        },
        dims,
    };
    PyCapsule::new(py, value, None)
}

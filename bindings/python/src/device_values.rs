//! Device values an engine's kernels write and the cache's kernels read: a verify's
//! accepted counts, its last accepted nodes and its accepted paths, which the host
//! learns only when it learns them (one step late under an overlap scheduler).
//! [`DeviceValues`] is an `int32` table on the cache's device, owned by the engine: its
//! accept kernel writes it on the device (on the CPU backend, `write` stands in for
//! it), and `HybridCache.translate_verify` / `compact_accepted` read it there, so
//! nothing on the host waits for a count.

use crate::errors::{invalid, to_py};
use crate::tokens::ints;
use pyo3::prelude::*;
use std::sync::Arc;
use unikv::kernels::{Device, TableId};

/// An `int32` table on the cache's device that the engine's kernels write (accepted
/// counts, last accepted nodes, accepted paths), made by `HybridCache.device_values`
/// (set-up: an allocation) and freed when the object goes. Pass `(values, at)` — the
/// table and the entry the batch's values start at — to `translate_verify` and
/// `compact_accepted`.
#[pyclass(module = "unikv", name = "DeviceValues", frozen)]
pub struct DeviceValues {
    device: Arc<dyn Device>,
    pub(crate) table: TableId,
    len: usize,
}

impl DeviceValues {
    /// A table of `len` entries filled with `fill` on `device`.
    pub(crate) fn new(
        py: Python<'_>,
        device: Arc<dyn Device>,
        len: usize,
        fill: i32,
    ) -> PyResult<DeviceValues> {
        if len == 0 {
            return Err(invalid("device values: a table of at least one entry"));
        }
        let table = py
            .detach(|| device.alloc_table(len, fill))
            .map_err(|e| to_py(py, e.into()))?;
        Ok(DeviceValues { device, table, len })
    }

    /// The facade's `DeviceValues` for entries from `at`, or `InvalidArgument` when `at`
    /// is past the table or the table lives on another cache's device than `device`.
    pub(crate) fn at(&self, device: &Arc<dyn Device>, at: usize) -> PyResult<unikv::DeviceValues> {
        // The same id on another device would name another table.
        if !Arc::ptr_eq(&self.device, device) {
            return Err(invalid(format!(
                "device values: table {} belongs to another cache's device",
                self.table.0
            )));
        }
        if at >= self.len {
            return Err(invalid(format!(
                "device values: entry {at} of a table of {} entries",
                self.len
            )));
        }
        Ok(unikv::DeviceValues {
            table: self.table,
            at,
        })
    }
}

#[pymethods]
impl DeviceValues {
    /// Entries in the table.
    fn __len__(&self) -> usize {
        self.len
    }

    /// The device table's id (what the cache's device knows it by).
    #[getter]
    fn table(&self) -> u32 {
        self.table.0
    }

    /// Writes `values` (a list of ints or an int32/int64 buffer) from entry `at`, as an
    /// asynchronous upload: on the CPU backend, what an engine's accept kernel does on
    /// the device. Refuses values past the table or past `int32`, changing nothing.
    #[pyo3(signature = (values, *, at = 0))]
    fn write(&self, py: Python<'_>, values: &Bound<'_, PyAny>, at: usize) -> PyResult<()> {
        let values = ints(values, "device values")?;
        let values: Vec<i32> = values
            .into_iter()
            .map(|v| {
                i32::try_from(v)
                    .map_err(|_| invalid(format!("device values: {v} does not fit an int32 entry")))
            })
            .collect::<PyResult<_>>()?;
        if at
            .checked_add(values.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(invalid(format!(
                "device values: {} values from entry {at} of a table of {} entries",
                values.len(),
                self.len
            )));
        }
        py.detach(|| self.device.upload_table(self.table, at, &values))
            .map_err(|e| to_py(py, e.into()))
    }

    fn __repr__(&self) -> String {
        format!("DeviceValues(table={}, len={})", self.table.0, self.len)
    }
}

impl Drop for DeviceValues {
    fn drop(&mut self) {
        // Freeing a table the device still holds cannot fail in a way the engine could act
        // on (the table is its own); a device error here leaves it to the device's teardown.
        let _ = self.device.free_table(self.table);
    }
}

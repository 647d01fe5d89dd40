//! DLPack export of the device tables: [`DeviceTable`] hands a step table or a verify
//! table to `torch.from_dlpack` / `numpy.from_dlpack` with no copy and no host sync, and
//! the device names that go with it (`"cuda"`, `"cuda:N"`, `"ledger(...)"`).
//!
//! The C structs are DLPack's `dlpack.h` (v0.8, the unversioned `DLManagedTensor` every
//! consumer reads), written out here: [`DLDevice`], [`DLDataType`], [`DLTensor`],
//! [`DLManagedTensor`]. A capsule named `"dltensor"` carries one; the consumer renames it
//! `"used_dltensor"` and calls the deleter when its tensor dies. The deleter drops the
//! reference to the `DeviceTable` (and through it to the cache and the table's export
//! guard), so the memory outlives every tensor viewing it. A capsule never consumed
//! still holds `"dltensor"` when it dies, and its destructor calls the deleter.
//!
//! Streams (CUDA): `__dlpack__(stream=s)` follows the array API: `None` means the legacy
//! default stream, `1` the legacy default stream (`CU_STREAM_LEGACY`), `2` the
//! per-thread default stream, `-1` no ordering, `0` is refused (ambiguous), any other
//! value is the consumer's `CUstream`. Unless `-1`, the consumer stream is made to wait
//! for the cache's stream by one event (`cuStreamWaitEvent`), never by a host sync.

use crate::HybridCache;
use crate::errors::{invalid, to_py};
use crate::step::StepMetadata;
use crate::verify::VerifyMetadata;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{CStr, c_void};
use std::sync::{Arc, Mutex, Weak};
use unikv::kernels::{CpuDevice, CudaDevice, Device, ExportDevice, SyncLedger, TableExport};

/// DLPack's `DLDeviceType` codes used here.
const KDL_CPU: i32 = 1;
/// `kDLCUDA`.
const KDL_CUDA: i32 = 2;
/// `kDLInt` (`DLDataTypeCode`).
const KDL_INT: u8 = 0;

/// The capsule's name before it is consumed.
const DLTENSOR: &CStr = c"dltensor";
/// The name a consumer gives the capsule when it takes the tensor.
const USED_DLTENSOR: &CStr = c"used_dltensor";

/// `DLDevice`.
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor`.
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What a capsule points to: the managed tensor first (its address is the capsule's
/// pointer), then the shape and strides it points into and the reference that keeps the
/// table alive. Boxed, so the inner pointers hold until the deleter frees the box.
#[repr(C)]
struct Exported {
    managed: DLManagedTensor,
    shape: [i64; 1],
    strides: [i64; 1],
    owner: Option<Py<DeviceTable>>,
}

/// The managed tensor's deleter: frees the box and drops its reference to the table,
/// attaching to the interpreter (taking the GIL) when the consumer calls it without.
///
/// # Safety
/// `managed` came from [`capsule`]'s `Box::into_raw` and is deleted once.
unsafe extern "C" fn delete_exported(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the first field of a boxed `Exported` (repr(C)), made by
    // `capsule` and handed out once: the consumer calls the deleter once, or the
    // capsule's destructor does when no consumer took it, never both.
    let mut exported = unsafe { Box::from_raw(managed.cast::<Exported>()) };
    let owner = exported.owner.take();
    drop(exported);
    // Attached, the reference drops now (on any thread); while the interpreter shuts
    // down, pyo3 defers it instead.
    let _ = Python::try_attach(|_py| drop(owner));
}

/// The capsule's destructor: deletes the tensor unless a consumer took it (renamed the
/// capsule), keeping any exception in flight.
///
/// # Safety
/// Called by Python with the GIL held, on a capsule made by [`capsule`].
unsafe extern "C" fn destroy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (Python's call); the name is a C string.
    if unsafe { ffi::PyCapsule_IsValid(capsule, USED_DLTENSOR.as_ptr()) } == 1 {
        return; // the consumer owns the tensor and calls the deleter
    }
    let (mut ty, mut value, mut tb) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: the GIL is held; the three out-pointers are valid locals.
    unsafe { ffi::PyErr_Fetch(&mut ty, &mut value, &mut tb) };
    // SAFETY: as above; a wrong name returns null with an exception set.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) };
    if managed.is_null() {
        // SAFETY: the GIL is held and an exception is set.
        unsafe { ffi::PyErr_WriteUnraisable(capsule) };
    } else {
        // SAFETY: the pointer is the `DLManagedTensor` `capsule` stored, never consumed.
        unsafe { delete_exported(managed.cast()) };
    }
    // SAFETY: restores what `PyErr_Fetch` took (the GIL is held).
    unsafe { ffi::PyErr_Restore(ty, value, tb) };
}

/// A `"dltensor"` capsule of the `i32` vector `export` describes, `len` entries long,
/// that keeps `owner` alive until the consumer's tensor (or the capsule) dies.
fn capsule<'py>(
    py: Python<'py>,
    owner: Py<DeviceTable>,
    export: &TableExport,
    len: usize,
    device: DLDevice,
) -> PyResult<Bound<'py, PyAny>> {
    let exported = Box::new(Exported {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: export.address as *mut c_void,
                device,
                ndim: 1,
                dtype: DLDataType {
                    code: KDL_INT,
                    bits: 32,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        shape: [len as i64],
        strides: [1],
        owner: Some(owner),
    });
    let raw = Box::into_raw(exported);
    // SAFETY: `raw` is a valid, unique box pointer; the shape and strides point into the
    // same allocation, which stays put until the deleter frees it.
    unsafe {
        (*raw).managed.dl_tensor.shape = (*raw).shape.as_mut_ptr();
        (*raw).managed.dl_tensor.strides = (*raw).strides.as_mut_ptr();
        (*raw).managed.manager_ctx = raw.cast();
    }
    // SAFETY: the GIL is held (`py`); the name is a static C string; the destructor
    // matches `PyCapsule_Destructor`.
    let ptr = unsafe { ffi::PyCapsule_New(raw.cast(), DLTENSOR.as_ptr(), Some(destroy_capsule)) };
    if ptr.is_null() {
        // SAFETY: the capsule was not made, so nothing else owns the box.
        unsafe { delete_exported(raw.cast()) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `PyCapsule_New` returned a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, ptr) })
}

/// A device table of a cache, exported for reading in place through DLPack:
/// `torch.from_dlpack(unikv.DeviceTable(cache, meta))` is an `int32` tensor of the whole
/// step table (`meta.layout["len"]` entries: the header, then the page tables the device
/// wrote) with no copy; for verify metadata, `part="inputs"` or `"outputs"`.
///
/// Why a class of its own rather than `__dlpack__` on the metadata: the table belongs to
/// the cache's device, and metadata objects do not refer to their cache (the cache keeps
/// its last step metadata, so a reference back would be a cycle). A `DeviceTable` holds
/// the cache and the table's export guard, so a tensor made from it keeps both alive
/// (after `del cache` too) and its memory stays allocated even if a later, larger build
/// replaces the table. The contents are the latest build's: the next build overwrites
/// them in stream order, so read them within the step (as the host views). Read-only
/// by contract. Made only for current metadata (built after the step's allocations).
#[pyclass(module = "unikv", name = "DeviceTable", frozen)]
pub struct DeviceTable {
    cache: Py<HybridCache>,
    export: TableExport,
    /// Entries exported (the metadata's length, at most the table's).
    len: usize,
}

impl DeviceTable {
    /// DLPack's `(device_type, device_id)`, or `BufferError` for memory no reader can
    /// address.
    fn dl_device(&self) -> PyResult<(i32, i32)> {
        match self.export.device {
            ExportDevice::Cpu => Ok((KDL_CPU, 0)),
            ExportDevice::Cuda { ordinal } => Ok((KDL_CUDA, ordinal as i32)),
            ExportDevice::EmulatedCuda => Err(PyBufferError::new_err(
                "the table lives in an emulated CUDA device's memory, which no reader can address",
            )),
        }
    }
}

#[pymethods]
impl DeviceTable {
    /// The device table of `metadata` (a `StepMetadata`, or a `VerifyMetadata` with
    /// `part` `"inputs"` or `"outputs"`) built by `cache`. Raises `InvalidArgument` for
    /// metadata that is stale, of an empty batch or not built, `DeviceError` on
    /// `device="none"` (no table memory).
    #[new]
    #[pyo3(signature = (cache, metadata, part = None))]
    fn new(
        py: Python<'_>,
        cache: &Bound<'_, HybridCache>,
        metadata: &Bound<'_, PyAny>,
        part: Option<&str>,
    ) -> PyResult<DeviceTable> {
        let c = cache.get();
        let (export, len) = if let Ok(step) = metadata.cast::<StepMetadata>() {
            if let Some(part) = part {
                return Err(invalid(format!(
                    "part: None for step metadata (one table), not {part:?}"
                )));
            }
            let meta = step
                .try_borrow()
                .map_err(|_| crate::errors::busy("step metadata"))?;
            let inner = &meta.inner;
            c.with(py, |c| {
                let view = c.step_view(inner)?;
                let len = view.device_layout().len;
                Ok(view
                    .device_table()
                    .map(|t| c.export_table(t).map(|e| (e, len))))
            })?
            .ok_or_else(|| invalid("step metadata of an empty batch has no device table"))?
            .map_err(|e| to_py(py, e))?
        } else if let Ok(verify) = metadata.cast::<VerifyMetadata>() {
            let meta = verify
                .try_borrow()
                .map_err(|_| crate::errors::busy("verify metadata"))?;
            let layout = meta.inner.layout();
            let (inputs, outputs) = meta
                .inner
                .tables()
                .ok_or_else(|| invalid("this verify metadata was not built yet"))?;
            let (table, len) = match part {
                Some("inputs") => (inputs, layout.inputs_len),
                Some("outputs") => (outputs, layout.outputs_len),
                other => {
                    return Err(invalid(format!(
                        "part: \"inputs\" or \"outputs\" for verify metadata, not {other:?}"
                    )));
                }
            };
            (c.with(py, |c| c.export_table(table))?, len)
        } else {
            return Err(invalid(
                "metadata: a unikv.StepMetadata or unikv.VerifyMetadata",
            ));
        };
        if len > export.len {
            return Err(invalid(format!(
                "the metadata describes {len} entries but its table holds {}: it is stale",
                export.len
            )));
        }
        Ok(DeviceTable {
            cache: cache.clone().unbind(),
            export,
            len,
        })
    }

    /// The first entry's address on its device (a host pointer or a `CUdeviceptr`).
    #[getter]
    fn address(&self) -> u64 {
        self.export.address
    }

    /// Where the table lives: `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        match self.export.device {
            ExportDevice::Cpu => "cpu".into(),
            ExportDevice::Cuda { ordinal } => format!("cuda:{ordinal}"),
            ExportDevice::EmulatedCuda => "emulated-cuda".into(),
        }
    }

    /// Entries exported.
    fn __len__(&self) -> usize {
        self.len
    }

    /// DLPack's `(device_type, device_id)`: `(1, 0)` for the CPU (`kDLCPU`), `(2, N)`
    /// for CUDA GPU `N` (`kDLCUDA`).
    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        self.dl_device()
    }

    /// A `"dltensor"` capsule of the table (`int32`, one dimension, no copy), per the
    /// array API. `stream` (CUDA only; `None` on the CPU): the consumer's stream, which
    /// is made to wait for the cache's work by an event (no host sync); see the module
    /// doc for the special values. `max_version` is accepted and answered with the
    /// unversioned capsule; `dl_device` must be this table's device and `copy` not
    /// `True` (`BufferError` otherwise: the export is in place only).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let _ = max_version; // any version reads the unversioned capsule
        let (device_type, device_id) = me.dl_device()?;
        if let Some(asked) = dl_device
            && asked != (device_type, device_id)
        {
            return Err(PyBufferError::new_err(format!(
                "dl_device {asked:?}: the table lives on ({device_type}, {device_id}) and is exported in place only"
            )));
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "copy=True: unikv exports its tables in place only (copy=None or False)",
            ));
        }
        match (device_type, stream) {
            (KDL_CPU, None) => {}
            (KDL_CPU, Some(s)) => {
                return Err(invalid(format!(
                    "stream: None for a CPU table (DLPack has no CPU streams), not {s}"
                )));
            }
            (_, Some(-1)) => {} // the consumer asked for no ordering
            (_, Some(0)) => {
                return Err(invalid(
                    "stream: 0 is ambiguous in DLPack; pass 1 (legacy default), 2 (per-thread default) or a CUstream",
                ));
            }
            (_, Some(s)) if s < 0 => {
                return Err(invalid(format!("stream: -1, 1, 2 or a CUstream, not {s}")));
            }
            (_, s) => {
                // None: the legacy default stream (CU_STREAM_LEGACY = 0x1).
                let consumer = s.unwrap_or(1) as usize;
                let cache = me.cache.get();
                cache.with(py, |c| {
                    // SAFETY: the consumer vouches for its stream (DLPack's contract: a
                    // stream of this device, alive during the call), or passed 1 or 2,
                    // CUDA's special handles.
                    unsafe { c.make_stream_wait(consumer as unikv::kernels::RawStream) }
                })?;
            }
        }
        let device = DLDevice {
            device_type,
            device_id,
        };
        capsule(py, slf.clone().unbind(), &me.export, me.len, device)
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceTable(device={:?}, len={}, address={:#x})",
            self.device(),
            self.len,
            self.export.address
        )
    }
}

/// The devices of a cache (see [`crate::engine::device`]).
type Devices = (Arc<dyn Device>, Option<Arc<CpuDevice>>);

/// The ledgers of caches built on `device="ledger(...)"`, found again by pointer.
static LEDGERS: Mutex<Vec<Weak<SyncLedger>>> = Mutex::new(Vec::new());

/// The devices for a name other than `"cpu"` and `"none"`: `"cuda"` or `"cuda:N"` (the
/// CUDA backend on GPU `N`; `DeviceError` when the wheel was built without the `cuda`
/// feature or there is no such GPU), or `"ledger(D)"` for any of those (a `SyncLedger`
/// around `D`, recording every op: for tests, `_host_syncs`). `Ok(None)` for `"none"`.
pub(crate) fn open_device(py: Python<'_>, name: &str) -> PyResult<Option<Devices>> {
    let expected = "expected \"cpu\", \"none\", \"cuda\", \"cuda:N\" or \"ledger(...)\" of one";
    if let Some(inner) = name
        .strip_prefix("ledger(")
        .and_then(|r| r.strip_suffix(')'))
    {
        let (readback, cpu): (Arc<dyn unikv::kernels::Readback>, _) = match inner {
            "cpu" => {
                let cpu = Arc::new(CpuDevice::new());
                (cpu.clone(), Some(cpu))
            }
            "none" => (Arc::new(unikv::kernels::NullDevice::new()), None),
            other => match cuda(py, other)? {
                Some(cuda) => (cuda, None),
                None => {
                    return Err(invalid(format!("unknown device {name:?} ({expected})")));
                }
            },
        };
        let ledger = Arc::new(SyncLedger::new(readback));
        let mut ledgers = LEDGERS.lock().unwrap_or_else(|p| p.into_inner());
        ledgers.retain(|l| l.strong_count() > 0);
        ledgers.push(Arc::downgrade(&ledger));
        return Ok(Some((ledger, cpu)));
    }
    match (name, cuda(py, name)?) {
        ("none", _) => Ok(None),
        (_, Some(cuda)) => Ok(Some((cuda, None))),
        _ => Err(invalid(format!("unknown device {name:?} ({expected})"))),
    }
}

/// The CUDA device `name` names (`"cuda"`, `"cuda:N"`), `None` for another name.
fn cuda(py: Python<'_>, name: &str) -> PyResult<Option<Arc<CudaDevice>>> {
    let ordinal = match name.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => match rest.strip_prefix(':').and_then(|n| n.parse().ok()) {
            Some(n) => n,
            None => return Ok(None),
        },
        None => return Ok(None),
    };
    let device = py
        .detach(|| CudaDevice::new(ordinal))
        .map_err(|e| to_py(py, e.into()))?;
    Ok(Some(Arc::new(device)))
}

/// The ledger of a cache built on `device="ledger(...)"`.
fn ledger_of(py: Python<'_>, cache: &Bound<'_, HybridCache>) -> PyResult<Arc<SyncLedger>> {
    let device = cache.get().with(py, |c| Ok(c.device_arc()))?;
    let at = Arc::as_ptr(&device).cast::<()>();
    let ledgers = LEDGERS.lock().unwrap_or_else(|p| p.into_inner());
    ledgers
        .iter()
        .filter_map(Weak::upgrade)
        .find(|l| Arc::as_ptr(l).cast::<()>() == at)
        .ok_or_else(|| invalid("the cache was not built on device=\"ledger(...)\""))
}

/// Host syncs the ledger of a `device="ledger(...)"` cache counted since it was made or
/// last reset: `Readback` ops and ops during which the device issued a sync hazard (a
/// blocking allocation, free or copy, the legacy default stream).
#[pyfunction]
pub(crate) fn _host_syncs(py: Python<'_>, cache: &Bound<'_, HybridCache>) -> PyResult<usize> {
    Ok(ledger_of(py, cache)?.syncs())
}

/// The ops the ledger of a `device="ledger(...)"` cache recorded since it was made or
/// last reset, by name, in call order.
#[pyfunction]
pub(crate) fn _ledger_ops(py: Python<'_>, cache: &Bound<'_, HybridCache>) -> PyResult<Vec<String>> {
    Ok(ledger_of(py, cache)?
        .ops()
        .iter()
        .map(|r| r.op.to_string())
        .collect())
}

/// Forgets what the ledger of a `device="ledger(...)"` cache recorded (before the path
/// under test).
#[pyfunction]
pub(crate) fn _reset_ledger(py: Python<'_>, cache: &Bound<'_, HybridCache>) -> PyResult<()> {
    ledger_of(py, cache)?.reset();
    Ok(())
}

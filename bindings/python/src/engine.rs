//! What an engine whose forward runs on the host needs from a cache built with
//! `device="cpu"`: a model of its own geometry ([`ModelSpec`]), the byte layout of the
//! buffer ([`KvGeometry`]: where a kernel id's K/V row and a state slot's conv and
//! temporal states are), the buffer's bytes ([`CpuBuffer`]: gathered and scattered rows)
//! and the page tables the device wrote for a step (a host read-back). The example
//! engine (`examples/python/`) runs its forward through these; a real engine's kernels
//! read the same bytes and tables on the GPU.
//!
//! Copies, not views: the CPU backend stores a buffer in chunks (it turns dense only for
//! a kernel, under its own lock), and its bytes move under compaction and state copies
//! whenever the cache runs. A numpy view of them could outlive the cache or race its
//! calls; so [`CpuBuffer::read`] and [`CpuBuffer::write`] copy rows out and in through
//! `CpuDevice::run_kernel` with the cache locked — a kernel launch's CPU twin, in order
//! with every cache call before and after it.

use crate::HybridCache;
use crate::errors::invalid;
use crate::step::StepMetadata;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes};
use std::sync::{Arc, LazyLock, Mutex};
use unikv::kernels::{CpuDevice, Device, HostSync, Readback};
use unikv::mamba::{MambaSpec, SlotLayout};
use unikv::pools::Side;
use unikv::{KvRows, RecurrentState};

/// A device for a cache, and the same device as a [`CpuDevice`] when it is one.
type Devices = (Arc<dyn Device>, Option<Arc<CpuDevice>>);

/// The device a cache is built on, and the CPU device behind it when it is `"cpu"` (kept
/// beside the cache so [`CpuBuffer`] can run kernels over its bytes). `"cuda"`,
/// `"cuda:N"` and `"ledger(...)"` are opened by `dlpack::open_device`.
pub(crate) fn device(name: &str) -> PyResult<Devices> {
    if name == "cpu" {
        let cpu = Arc::new(CpuDevice::new());
        return Ok((cpu.clone(), Some(cpu)));
    }
    if let Some(devices) = Python::attach(|py| crate::dlpack::open_device(py, name))? {
        return Ok(devices);
    }
    Ok((crate::device(name)?, None))
}

/// A model given by its geometry rather than by name or `config.json`: FULL, SWA and
/// recurrent layers, one K/V row shape for both attention kinds, and one recurrent state
/// per recurrent layer. For small test and example models (the Hugging Face families
/// never mix all three kinds).
#[pyclass(module = "unikv", name = "ModelSpec", frozen, get_all)]
#[derive(Clone)]
pub struct ModelSpec {
    /// The model's name.
    name: String,
    /// Full-attention layers.
    full_layers: u32,
    /// Sliding-window layers.
    swa_layers: u32,
    /// Recurrent (Mamba-like) layers.
    mamba_layers: u32,
    /// KV heads of an attention layer.
    kv_heads: u32,
    /// Head dimension.
    head_dim: u32,
    /// Bytes per K/V element (and per conv state element).
    dtype_bytes: u32,
    /// The sliding window in tokens (0 without SWA layers).
    window: u32,
    /// Channels of the conv state.
    conv_channels: u32,
    /// Width of the causal conv (it keeps `conv_kernel - 1` inputs).
    conv_kernel: u32,
    /// Heads of the temporal state.
    state_heads: u32,
    /// Head dimension of the temporal state.
    state_head_dim: u32,
    /// State size per head dimension.
    state_size: u32,
    /// Bytes per temporal state element.
    state_dtype_bytes: u32,
}

#[pymethods]
impl ModelSpec {
    /// A model of this geometry; the cache checks it when it is built.
    #[new]
    #[pyo3(signature = (*, name, full_layers, swa_layers = 0, mamba_layers = 0, kv_heads, head_dim, dtype_bytes = 2, window = 0, conv_channels = 0, conv_kernel = 0, state_heads = 0, state_head_dim = 0, state_size = 0, state_dtype_bytes = 4))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        full_layers: u32,
        swa_layers: u32,
        mamba_layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        window: u32,
        conv_channels: u32,
        conv_kernel: u32,
        state_heads: u32,
        state_head_dim: u32,
        state_size: u32,
        state_dtype_bytes: u32,
    ) -> PyResult<ModelSpec> {
        if swa_layers > 0 && window == 0 {
            return Err(invalid("ModelSpec: SWA layers need a window"));
        }
        if mamba_layers > 0 && state_heads * state_head_dim * state_size == 0 {
            return Err(invalid(
                "ModelSpec: recurrent layers need state_heads, state_head_dim and state_size",
            ));
        }
        Ok(ModelSpec {
            name,
            full_layers,
            swa_layers,
            mamba_layers,
            kv_heads,
            head_dim,
            dtype_bytes,
            window,
            conv_channels,
            conv_kernel,
            state_heads,
            state_head_dim,
            state_size,
            state_dtype_bytes,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "ModelSpec(name={:?}, full_layers={}, swa_layers={}, mamba_layers={})",
            self.name, self.full_layers, self.swa_layers, self.mamba_layers
        )
    }
}

impl ModelSpec {
    /// The facade's spec.
    pub(crate) fn spec(&self) -> unikv::ModelSpec {
        let rows = KvRows::new(self.kv_heads, self.head_dim, self.dtype_bytes);
        unikv::ModelSpec {
            name: intern(&self.name),
            full_layers: self.full_layers,
            swa_layers: self.swa_layers,
            mamba_layers: self.mamba_layers,
            full: if self.full_layers == 0 {
                KvRows::NONE
            } else {
                rows
            },
            swa: if self.swa_layers == 0 {
                KvRows::NONE
            } else {
                rows
            },
            recurrent: if self.mamba_layers == 0 {
                RecurrentState::NONE
            } else {
                RecurrentState {
                    conv_channels: self.conv_channels,
                    conv_kernel: self.conv_kernel,
                    heads: self.state_heads,
                    head_dim: self.state_head_dim,
                    state_size: self.state_size,
                    conv_dtype_bytes: self.dtype_bytes,
                    state_dtype_bytes: self.state_dtype_bytes,
                }
            },
            window: if self.swa_layers == 0 { 0 } else { self.window },
            draft_layers: 0,
        }
    }
}

/// `name` as a `&'static str` (`ModelSpec::name`'s type), leaked once per distinct name.
fn intern(name: &str) -> &'static str {
    static NAMES: LazyLock<Mutex<Vec<&'static str>>> = LazyLock::new(|| Mutex::new(Vec::new()));
    // A poisoned lock still holds valid names (a push cannot half-happen).
    let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(known) = names.iter().find(|n| **n == name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.push(leaked);
    leaked
}

/// Where the buffer keeps a kernel id's K/V rows and a state slot's states (the facade's
/// `KvGeometry` and the slot layout): a FULL or SWA kernel id `k` names a token's rows,
/// layer `l`'s K row at row `k + 2·l·page_size` and its V row at `k + (2·l + 1)·page_size`,
/// each `row_bytes` long; physical slot `p` at byte `p × slot_bytes`, each recurrent
/// layer's conv and temporal state at fixed ranges inside it. Kernel id 0 and slot 0
/// are the sink.
#[pyclass(module = "unikv", name = "KvGeometry", frozen)]
pub struct KvGeometry {
    inner: unikv::KvGeometry,
    full_layers: u32,
    swa_layers: u32,
    slots: Option<SlotLayout>,
}

impl KvGeometry {
    fn of(cache: &unikv::HybridCache) -> KvGeometry {
        let model = cache.model();
        KvGeometry {
            inner: cache.kv_geometry(),
            full_layers: model.full_envelope_layers(),
            swa_layers: model.swa_layers,
            slots: MambaSpec::new(model.mamba_layers, model.recurrent)
                .slot_layout()
                .ok(),
        }
    }

    fn slot_layout(&self) -> PyResult<&SlotLayout> {
        self.slots
            .as_ref()
            .ok_or_else(|| invalid("the model has no recurrent state"))
    }
}

#[pymethods]
impl KvGeometry {
    /// The geometry of `cache`'s buffer.
    #[new]
    fn new(py: Python<'_>, cache: &Bound<'_, HybridCache>) -> PyResult<KvGeometry> {
        cache.get().with(py, |c| Ok(KvGeometry::of(c)))
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.inner.page_size
    }

    /// Bytes of one FULL K (or V) row.
    #[getter]
    fn full_row_bytes(&self) -> u64 {
        self.inner.full_row_bytes
    }

    /// Bytes of one SWA K (or V) row (0 without SWA layers).
    #[getter]
    fn swa_row_bytes(&self) -> u64 {
        self.inner.swa_row_bytes
    }

    /// Bytes of one state slot (0 without recurrent layers).
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.inner.slot_bytes
    }

    /// Byte offsets (an `int64` array) of layer `layer`'s K rows (`value=False`) or V
    /// rows (`value=True`) of the tokens with kernel ids `kernel_ids` on `side`
    /// (`"full"` or `"swa"`).
    #[pyo3(signature = (side, kernel_ids, layer, *, value))]
    fn row_offsets<'py>(
        &self,
        py: Python<'py>,
        side: &str,
        kernel_ids: &Bound<'py, PyAny>,
        layer: u32,
        value: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (side, layers) = match side {
            "full" => (Side::Full, self.full_layers),
            "swa" => (Side::Swa, self.swa_layers),
            other => {
                return Err(invalid(format!("side: \"full\" or \"swa\", not {other:?}")));
            }
        };
        if layer >= layers {
            return Err(invalid(format!(
                "layer {layer} of a side with {layers} layers"
            )));
        }
        let ids = int64s(kernel_ids, "kernel_ids")?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let id = i32::try_from(id)
                .ok()
                .filter(|id| *id >= 0)
                .ok_or_else(|| invalid(format!("kernel id {id} is not in 0 ..= i32::MAX")))?;
            out.push(self.inner.row_offset(side, id, layer, value) as i64);
        }
        array(py, &out, "int64", &[out.len()])
    }

    /// Byte offset of physical state slot `slot`.
    fn slot_offset(&self, slot: u32) -> u64 {
        self.inner.slot_offset(slot)
    }

    /// The byte range `(start, end)` of recurrent layer `layer`'s conv state inside a
    /// slot.
    fn conv_state(&self, layer: u32) -> PyResult<(u64, u64)> {
        let r = self
            .slot_layout()?
            .conv(layer)
            .map_err(|e| invalid(e.to_string()))?;
        Ok((r.start, r.end))
    }

    /// The byte range `(start, end)` of recurrent layer `layer`'s temporal state inside
    /// a slot.
    fn temporal_state(&self, layer: u32) -> PyResult<(u64, u64)> {
        let r = self
            .slot_layout()?
            .temporal(layer)
            .map_err(|e| invalid(e.to_string()))?;
        Ok((r.start, r.end))
    }

    fn __repr__(&self) -> String {
        let g = &self.inner;
        format!(
            "KvGeometry(page_size={}, full_row_bytes={}, swa_row_bytes={}, slot_bytes={})",
            g.page_size, g.full_row_bytes, g.swa_row_bytes, g.slot_bytes
        )
    }
}

/// The bytes of a `device="cpu"` cache's buffer, for an engine whose forward runs on the
/// host: rows copied out ([`CpuBuffer::read`]) and in ([`CpuBuffer::write`]) with the
/// cache locked, each call one kernel's CPU twin; and the page tables the device wrote
/// for a step ([`CpuBuffer::read_step_table`], a host read-back).
#[pyclass(module = "unikv", name = "CpuBuffer", frozen)]
pub struct CpuBuffer {
    cache: Py<HybridCache>,
    cpu: Arc<CpuDevice>,
}

impl CpuBuffer {
    /// Runs `kernel` over the buffer's bytes with the cache locked and the GIL released.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        kernel: impl FnOnce(&mut [u8]) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        let cpu = &self.cpu;
        let cache = self.cache.get();
        cache.with(py, |c| {
            let buffer = c.allocator().buffer();
            cpu.run_kernel(buffer, kernel).map_err(unikv::Error::from)
        })?
    }
}

#[pymethods]
impl CpuBuffer {
    /// The buffer of `cache`, which must have been built with `device="cpu"`.
    #[new]
    fn new(cache: &Bound<'_, HybridCache>) -> PyResult<CpuBuffer> {
        let cpu = cache
            .get()
            .cpu
            .clone()
            .ok_or_else(|| invalid("CpuBuffer: the cache was not built with device=\"cpu\""))?;
        Ok(CpuBuffer {
            cache: cache.clone().unbind(),
            cpu,
        })
    }

    /// The buffer's geometry.
    #[getter]
    fn geometry(&self, py: Python<'_>) -> PyResult<KvGeometry> {
        self.cache.get().with(py, |c| Ok(KvGeometry::of(c)))
    }

    /// Copies `nbytes` bytes at each byte offset of `offsets` (ints: a buffer or a
    /// list) out of the buffer: a `uint8` array of shape `(len(offsets), nbytes)`, yours
    /// to keep (view it as the rows' dtype). Every range must lie in the buffer.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offsets: &Bound<'py, PyAny>,
        nbytes: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let offsets = int64s(offsets, "offsets")?;
        let n = offsets.len();
        let rows = self.run(py, |bytes| {
            let ranges = ranges(&offsets, nbytes, bytes.len())?;
            let mut out = Vec::with_capacity(n * nbytes);
            for r in ranges {
                out.extend_from_slice(&bytes[r]);
            }
            Ok(out)
        })?;
        array(py, &rows, "uint8", &[n, nbytes])
    }

    /// Copies row `i` of `rows` (a C-contiguous buffer of any dtype, `len(offsets)` rows
    /// of equal bytes: a float32 array of shape `(n, width)`, say) into the buffer at
    /// byte `offsets[i]`. Checks every range before it writes any.
    fn write(
        &self,
        py: Python<'_>,
        offsets: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let offsets = int64s(offsets, "offsets")?;
        let data = contiguous_bytes(rows, "rows")?;
        let data = data.cast::<PyBytes>()?.as_bytes();
        if offsets.is_empty() {
            return if data.is_empty() {
                Ok(())
            } else {
                Err(invalid("rows: bytes for no offsets"))
            };
        }
        if data.len() % offsets.len() != 0 {
            return Err(invalid(format!(
                "rows: {} bytes do not make {} equal rows",
                data.len(),
                offsets.len()
            )));
        }
        let nbytes = data.len() / offsets.len();
        self.run(py, |bytes| {
            let ranges = ranges(&offsets, nbytes, bytes.len())?;
            for (r, row) in ranges.into_iter().zip(data.chunks_exact(nbytes.max(1))) {
                bytes[r].copy_from_slice(row);
            }
            Ok(())
        })
    }

    /// The whole step table of `step` as the device holds it (`int32`, `layout["len"]`
    /// entries: the host-written header, then the FULL and SWA page tables the device
    /// wrote). A host read-back: the CPU backend's stand-in for an attention kernel that
    /// reads the page tables on the device; `step` must be the cache's current step
    /// metadata. Empty for an empty batch.
    fn read_step_table<'py>(
        &self,
        py: Python<'py>,
        step: &Bound<'py, StepMetadata>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let meta = step
            .try_borrow()
            .map_err(|_| crate::errors::busy("step metadata"))?;
        let inner = &meta.inner;
        let cpu = &self.cpu;
        let table = self.cache.get().with(py, |c| {
            let view = c.step_view(inner)?;
            let Some(table) = view.device_table() else {
                return Ok(Vec::new());
            };
            let sync = HostSync::acquire(
                "unikv.CpuBuffer.read_step_table: a host engine reads its page tables",
            );
            Ok(cpu.read_table(&sync, table, 0, view.device_layout().len)?)
        })?;
        array(py, &table, "int32", &[table.len()])
    }

    /// The verify metadata's outputs table as the device holds it (`int32`,
    /// `layout["outputs_len"]` entries: the write ids and state slots
    /// `HybridCache.translate_verify` wrote). A host read-back: the CPU backend's
    /// stand-in for a verify kernel reading them on the device.
    fn read_verify_outputs<'py>(
        &self,
        py: Python<'py>,
        meta: &Bound<'py, crate::verify::VerifyMetadata>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let meta = meta
            .try_borrow()
            .map_err(|_| crate::errors::busy("verify metadata"))?;
        let Some((_, outputs)) = meta.inner.tables() else {
            return Err(crate::errors::invalid(
                "read_verify_outputs: this verify metadata was never built",
            ));
        };
        let len = meta.inner.layout().outputs_len;
        let cpu = &self.cpu;
        let table = self.cache.get().with(py, |_| {
            let sync = HostSync::acquire(
                "unikv.CpuBuffer.read_verify_outputs: a host engine reads its verify ids",
            );
            Ok(cpu.read_table(&sync, outputs, 0, len)?)
        })?;
        array(py, &table, "int32", &[table.len()])
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("CpuBuffer(cache={})", self.cache.get().__repr__(py))
    }
}

/// The byte ranges of `nbytes` at each offset, or `InvalidArgument` (before anything is
/// touched) when one is negative or ends past `len`.
fn ranges(offsets: &[i64], nbytes: usize, len: usize) -> PyResult<Vec<std::ops::Range<usize>>> {
    offsets
        .iter()
        .map(|&at| {
            usize::try_from(at)
                .ok()
                .and_then(|start| Some(start..start.checked_add(nbytes)?))
                .filter(|r| r.end <= len)
                .ok_or_else(|| {
                    invalid(format!(
                        "bytes [{at}, {at} + {nbytes}) are outside the buffer's {len} bytes"
                    ))
                })
        })
        .collect()
}

/// `numpy`, imported once.
fn numpy(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    Ok(NUMPY
        .get_or_try_init(py, || py.import("numpy").map(Bound::unbind))?
        .bind(py))
}

/// A new numpy array of `dtype` and `shape` holding `values` (one copy, into a
/// `bytearray` the array owns; writable).
fn array<'py, T: Copy>(
    py: Python<'py>,
    values: &[T],
    dtype: &str,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `values` is a live, initialised slice of plain `Copy` numbers (u8, i32,
    // i64: no padding, no pointers), so its `size_of_val` bytes are readable as `u8`
    // for the borrow's duration, and nothing writes them meanwhile (shared borrow).
    let bytes = unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    };
    let owned = PyByteArray::new(py, bytes);
    numpy(py)?
        .call_method1(intern!(py, "frombuffer"), (owned, dtype))?
        .call_method1(intern!(py, "reshape"), (shape.to_vec(),))
}

/// The bytes of a C-contiguous buffer (any item type), as one `bytes` copy.
fn contiguous_bytes<'py>(value: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyAny>> {
    let py = value.py();
    let view = py
        .import("builtins")?
        .getattr(intern!(py, "memoryview"))?
        .call1((value,))
        .map_err(|_| invalid(format!("{what}: a buffer (a numpy array, bytes)")))?;
    let contiguous: bool = view.getattr(intern!(py, "c_contiguous"))?.extract()?;
    if !contiguous {
        return Err(invalid(format!(
            "{what}: a C-contiguous buffer (this one is strided)"
        )));
    }
    view.call_method0(intern!(py, "tobytes"))
}

/// Integers from an int buffer (any integer dtype, one dimension) or a list of ints.
fn int64s(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    let py = value.py();
    let np = numpy(py)?;
    let arr = np
        .call_method1(intern!(py, "asarray"), (value,))
        .map_err(|_| invalid(format!("{what}: ints (an int array or a list)")))?;
    let kind: String = arr
        .getattr(intern!(py, "dtype"))?
        .getattr(intern!(py, "kind"))?
        .extract()?;
    let ndim: usize = arr.getattr(intern!(py, "ndim"))?.extract()?;
    let size: usize = arr.getattr(intern!(py, "size"))?.extract()?;
    if ndim != 1 || !(kind == "i" || kind == "u" || size == 0) {
        return Err(invalid(format!(
            "{what}: a one-dimensional array or list of ints"
        )));
    }
    let arr = np.call_method1(intern!(py, "ascontiguousarray"), (arr, "<i8"))?;
    let bytes = arr.call_method0(intern!(py, "tobytes"))?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    Ok(bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

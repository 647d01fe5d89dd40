//! `unikv._unikv`: the Python extension behind the `unikv` package. Thin by design: every
//! method converts its arguments, releases the GIL, locks the cache and calls the facade;
//! the logic stays in Rust.
//!
//! The cache sits behind a `Mutex`, so a second Python thread's call waits for the first
//! one's (the GIL released meanwhile) and never sees a half-done operation; a request is
//! a Python object holding the facade's `Request` until `cache_finished` or `release`
//! consumes it, after which any use raises `unikv.InvalidArgument`.

mod batch;
mod bench;
mod device_values;
mod dlpack;
mod engine;
mod errors;
mod hf;
mod reference;
mod sglang;
mod speculative;
mod step;
mod tokens;
mod verify;

use errors::{busy, guarded, invalid, to_py};
use pyo3::prelude::*;
use std::sync::{Mutex, MutexGuard};
use unikv::{Layout, ModelSpec, TokenId};

/// A `HybridCache` for Python: one byte buffer for a hybrid model's FULL and SWA KV and
/// recurrent state, with the radix prefix cache on top.
#[pyclass(module = "unikv", name = "HybridCache", frozen)]
struct HybridCache {
    inner: Mutex<unikv::HybridCache>,
    /// The last step metadata built, rebuilt in place when nothing else refers to it.
    last_step: Mutex<Option<Py<step::StepMetadata>>>,
    /// The model's catalogue name (for `repr`).
    model: String,
    /// The CPU device the buffer lives on, for `CpuBuffer` (`None` on `device="none"`).
    cpu: Option<std::sync::Arc<unikv::kernels::CpuDevice>>,
    /// The device the buffer lives on, for the engine's own tables (`DeviceValues`).
    device: std::sync::Arc<dyn unikv::kernels::Device>,
}

/// What the prefix cache holds for a prompt, from `HybridCache.match_prefix`; admitting
/// it consumes it.
#[pyclass(module = "unikv", name = "PrefixMatch")]
struct PrefixMatch {
    inner: Option<unikv::PrefixMatch>,
}

/// A running request: its tokens, its rows and its state. `cache_finished` and `release`
/// consume it; using it afterwards raises `InvalidArgument`.
#[pyclass(module = "unikv", name = "Request")]
struct Request {
    inner: Option<unikv::Request>,
    /// Its id, kept for messages after it is consumed.
    id: u64,
}

impl HybridCache {
    /// Runs `f` on the cache with the GIL released, mapping its error.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut unikv::HybridCache) -> Result<T, unikv::Error> + Send,
    ) -> PyResult<T> {
        let result = guarded(|| Ok(py.detach(|| f(&mut self.lock()))))?;
        result.map_err(|e| to_py(py, e))
    }

    /// Runs `build` (which fills the step metadata and returns its view's parts) into the
    /// last step metadata object when nothing else refers to it, else into a new one, and
    /// records what it built. The cache keeps the object for the next build.
    fn build_step(
        &self,
        py: Python<'_>,
        build: impl FnOnce(
            &mut unikv::HybridCache,
            &mut unikv::StepMetadata,
        ) -> Result<Built, unikv::Error>
        + Send,
    ) -> PyResult<Py<step::StepMetadata>> {
        // Reuse the last object when only the cache refers to it (no view is alive). The
        // slot's lock is held only for the take (and the put back), never across the build,
        // whose GIL release would otherwise let a second builder wait for the lock while
        // holding the GIL the first one needs back.
        let previous = self.last_slot().take();
        let target = match previous {
            Some(meta) if meta.get_refcnt(py) == 1 => meta,
            _ => Py::new(py, step::StepMetadata::new())?,
        };
        let result = {
            let mut meta = target.borrow_mut(py);
            let inner = &mut meta.inner;
            match self.with(py, |c| build(c, inner)) {
                Ok(Built(image, layout, table)) => {
                    meta.built(image, layout, table);
                    Ok(())
                }
                Err(e) => {
                    // A failed build may have moved the image: nothing may view it.
                    meta.built((0, 0), unikv::DeviceLayout::default(), None);
                    Err(e)
                }
            }
        };
        *self.last_slot() = Some(target.clone_ref(py));
        result.map(|()| target)
    }

    /// The last step metadata's slot (locked briefly, with the GIL held).
    fn last_slot(&self) -> MutexGuard<'_, Option<Py<step::StepMetadata>>> {
        self.last_step.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> MutexGuard<'_, unikv::HybridCache> {
        // A panic inside a call poisoned the lock after `guarded` caught it; the facade
        // leaves the cache consistent on error, so the next call may go on.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Request {
    fn get(&mut self) -> PyResult<&mut unikv::Request> {
        let id = self.id;
        self.inner
            .as_mut()
            .ok_or_else(|| invalid(format!("request {id} was finished or released")))
    }

    /// Reads the request through `f`, or raises `InvalidArgument` when it is closed or
    /// another thread's call is using it (never pyo3's borrow error).
    fn read<T>(slf: &Bound<'_, Self>, f: impl FnOnce(&unikv::Request) -> T) -> PyResult<T> {
        let me = slf.try_borrow().map_err(|_| busy("request"))?;
        let id = me.id;
        me.inner
            .as_ref()
            .map(f)
            .ok_or_else(|| invalid(format!("request {id} was finished or released")))
    }

    fn take(&mut self) -> PyResult<unikv::Request> {
        let id = self.id;
        self.inner
            .take()
            .ok_or_else(|| invalid(format!("request {id} was finished or released")))
    }
}

/// What a step metadata build produced: the host image's address and length, its
/// layout and its device table.
struct Built((usize, usize), unikv::DeviceLayout, Option<u32>);

/// The parts of `meta`'s view (after a build) that [`step::StepMetadata`] records.
fn view_of(c: &unikv::HybridCache, meta: &unikv::StepMetadata) -> Result<Built, unikv::Error> {
    let view = c.step_view(meta)?;
    let image = view.host_image();
    Ok(Built(
        (image.as_ptr() as usize, image.len()),
        view.device_layout(),
        view.device_table().map(|t| t.0),
    ))
}

/// A layout from its name: `"unified"`, or `"static"` with SWA sized at
/// `swa_full_tokens_ratio` of FULL's tokens.
fn layout(name: &str, swa_full_tokens_ratio: f64) -> PyResult<Layout> {
    match name {
        "unified" => Ok(Layout::Unified),
        "static" => Ok(Layout::Static {
            swa_full_tokens_ratio,
        }),
        other => Err(invalid(format!(
            "unknown layout {other:?} (expected \"unified\" or \"static\")"
        ))),
    }
}

/// A host write policy by SGLang's name for it.
fn write_policy(name: &str, hits: u32) -> PyResult<unikv::HostWritePolicy> {
    match name {
        "write_back" => Ok(unikv::HostWritePolicy::WriteBack),
        "write_through" => Ok(unikv::HostWritePolicy::WriteThrough),
        "write_through_selective" => Ok(unikv::HostWritePolicy::WriteThroughSelective { hits }),
        other => Err(invalid(format!(
            "unknown host write policy {other:?} (expected \"write_back\", \"write_through\" \
             or \"write_through_selective\")"
        ))),
    }
}

/// The device a cache's buffer lives on: `"cpu"` (bytes in host memory: the CPU twins
/// of the kernels run) or `"none"` (lengths only: bookkeeping without bytes, as the
/// replay's `--device none`).
pub(crate) fn device(name: &str) -> PyResult<std::sync::Arc<dyn unikv::kernels::Device>> {
    match name {
        "cpu" => Ok(std::sync::Arc::new(unikv::kernels::CpuDevice::new())),
        "none" => Ok(std::sync::Arc::new(unikv::kernels::NullDevice::new())),
        other => Err(invalid(format!(
            "unknown device {other:?} (expected \"cpu\" or \"none\")"
        ))),
    }
}

/// A budget: an int (bytes) or a string such as `"16GiB"`, `"512MiB"`, `"1.5GB"`.
fn memory(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = value.extract::<u64>() {
        return Ok(n);
    }
    let text: String = value
        .extract()
        .map_err(|_| invalid("memory: an int (bytes) or a string such as \"16GiB\""))?;
    unikv_workload::units::parse_memory(&text).map_err(|e| invalid(format!("memory: {e}")))
}

#[pymethods]
impl HybridCache {
    /// Builds a cache. `model` is a catalogue name (`unikv.models()` lists them) or a
    /// Hugging Face `config.json` as a dict (gpt-oss, Gemma, Qwen3-Next, Nemotron-H;
    /// `model_name` names it), `memory` the buffer's bytes (an int or `"16GiB"`),
    /// `layout` `"unified"` or `"static"`; the checkpoint knobs apply to models with
    /// recurrent state. `host_memory_bytes` gives the cache a host tier of that many
    /// bytes (0: none): prefixes the device evicts are written back there and loaded
    /// back by a later prompt that matches them (`PrefixMatch.host_tokens`);
    /// `host_write_policy` says when a prefix is copied (`"write_back"`: on eviction,
    /// `"write_through"`: once cached, `"write_through_selective"`: after
    /// `host_write_hits` admissions hit it).
    #[new]
    #[pyo3(signature = (*, model, memory, page_size = 1, layout = "unified", swa_full_tokens_ratio = 0.8, checkpoint_interval = None, checkpoints_per_step = None, model_name = None, device = "cpu", speculation = None, host_memory_bytes = 0, host_write_policy = "write_back", host_write_hits = 2))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: &Bound<'_, PyAny>,
        memory: &Bound<'_, PyAny>,
        page_size: u32,
        layout: &str,
        swa_full_tokens_ratio: f64,
        checkpoint_interval: Option<u32>,
        checkpoints_per_step: Option<u32>,
        model_name: Option<&str>,
        device: &str,
        speculation: Option<speculative::Speculation>,
        host_memory_bytes: u64,
        host_write_policy: &str,
        host_write_hits: u32,
    ) -> PyResult<HybridCache> {
        let spec = hf::model(model, model_name)?;
        let bytes = self::memory(memory)?;
        let layout = self::layout(layout, swa_full_tokens_ratio)?;
        let (device, cpu) = engine::device(device)?;
        let mut builder = unikv::HybridCache::builder()
            .model(spec)
            .page_size(page_size)
            .memory_bytes(bytes)
            .layout(layout)
            .host_memory_bytes(host_memory_bytes)
            .host_write_policy(write_policy(host_write_policy, host_write_hits)?)
            .device(device.clone());
        if let Some(n) = checkpoint_interval {
            builder = builder.checkpoint_interval(n);
        }
        if let Some(n) = checkpoints_per_step {
            builder = builder.checkpoints_per_step(n);
        }
        if let Some(s) = speculation {
            builder = builder.speculation(s.into());
        }
        // The builder is not `Send` (it may hold an allocator wrapper), so it builds with
        // the GIL held; building allocates the buffer and nothing else.
        let cache = guarded(|| Ok(builder.build()))?.map_err(|e| to_py(py, e))?;
        Ok(HybridCache {
            inner: Mutex::new(cache),
            last_step: Mutex::new(None),
            model: spec.name.to_string(),
            cpu,
            device,
        })
    }

    /// The model's name (a catalogue name, or the config's).
    #[getter]
    fn model(&self) -> &str {
        &self.model
    }

    /// How verify scratch lanes sit in state slots: `{"width": positions a lane holds,
    /// "entries_per_slot": 1 under the copy rollback (an entry is a state)}`.
    #[getter]
    fn scratch_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let shape = py.detach(|| self.lock().scratch_shape());
        let d = pyo3::types::PyDict::new(py);
        d.set_item("width", shape.width)?;
        d.set_item("entries_per_slot", shape.entries_per_slot)?;
        Ok(d)
    }

    /// The layout: `"unified"` or `"static"`.
    #[getter]
    fn layout(&self, py: Python<'_>) -> &'static str {
        match py.detach(|| self.lock().layout()) {
            Layout::Unified => "unified",
            Layout::Static { .. } => "static",
        }
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self, py: Python<'_>) -> usize {
        // Waiting for the cache's lock never holds the GIL.
        py.detach(|| self.lock().page_size())
    }

    /// The step counter (step boundaries so far).
    #[getter]
    fn step(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.lock().step())
    }

    /// Looks `tokens` up in the prefix cache (any int32/int64 buffer or a list of ints).
    fn match_prefix(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<PrefixMatch> {
        let tokens = tokens::token_ids(tokens)?;
        let hit = self.with(py, |c| Ok(c.match_prefix(tokens)))?;
        Ok(PrefixMatch { inner: Some(hit) })
    }

    /// Whether `hit` can be admitted with room for `reserve_tokens` more tokens (evicting
    /// what the prefix cache may give up, if needed, but admitting nothing).
    #[pyo3(signature = (hit, *, reserve_tokens = 0))]
    fn can_admit(
        &self,
        py: Python<'_>,
        hit: &Bound<'_, PrefixMatch>,
        reserve_tokens: usize,
    ) -> PyResult<bool> {
        let hit = hit.try_borrow().map_err(|_| busy("prefix match"))?;
        let hit = hit
            .inner
            .as_ref()
            .ok_or_else(|| invalid("this prefix match was admitted already"))?;
        self.with(py, |c| Ok(c.can_admit(hit, reserve_tokens)))
    }

    /// Admits `hit` as a running request (consuming the match).
    fn admit(&self, py: Python<'_>, hit: &Bound<'_, PrefixMatch>) -> PyResult<Request> {
        let mut hit = hit.try_borrow_mut().map_err(|_| busy("prefix match"))?;
        let matched = hit
            .inner
            .take()
            .ok_or_else(|| invalid("this prefix match was admitted already"))?;
        match self.with(py, |c| c.admit(matched)) {
            Ok(req) => Ok(Request {
                id: req.id(),
                inner: Some(req),
            }),
            Err(e) => Err(e),
        }
    }

    /// Allocates the next `tokens` prompt tokens of `request` (a prefill chunk).
    fn alloc_extend(
        &self,
        py: Python<'_>,
        request: &Bound<'_, Request>,
        tokens: usize,
    ) -> PyResult<()> {
        let mut r = request.try_borrow_mut().map_err(|_| busy("request"))?;
        let req = r.get()?;
        self.with(py, |c| c.alloc_extend(req, tokens))
    }

    /// Allocates one decode token for each request of `requests`, whose next tokens are
    /// `next_tokens` (one per request: an int buffer or a list).
    fn alloc_decode(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        next_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let next = tokens::token_ids(next_tokens)?;
        let n = requests
            .len()
            .map_err(|_| invalid("requests: a unikv.Batch or a sequence of unikv.Request"))?;
        if next.len() != n {
            return Err(invalid(format!(
                "{n} requests but {} next tokens",
                next.len()
            )));
        }
        let mut borrowed = batch::borrow_all(requests)?;
        let mut batch = Vec::with_capacity(borrowed.len());
        for r in &mut borrowed {
            batch.push(r.get()?);
        }
        self.with(py, |c| c.alloc_decode(&mut batch, &next))
    }

    /// Allocates one verify step for each request of `requests`: the rows of every
    /// position its draft verifies. `drafts` holds one draft per request: an int `k` (a
    /// chain of `k` tokens) or a list of parent indices (a tree). The cache must be built
    /// with `speculation`.
    fn alloc_verify(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        drafts: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let drafts = drafts
            .iter()
            .map(speculative::DraftArg::extract)
            .collect::<PyResult<Vec<_>>>()?;
        let mut borrowed = batch::borrow_all(requests)?;
        let mut batch = Vec::with_capacity(borrowed.len());
        for r in &mut borrowed {
            batch.push(r.get()?);
        }
        let drafts: Vec<unikv::Draft<'_>> = drafts.iter().map(|d| d.as_draft()).collect();
        self.with(py, |c| c.alloc_verify(&mut batch, &drafts))
    }

    /// Settles the oldest unsettled verify of each request of `requests` with what the
    /// target accepted: one entry per request, its accepted tokens (a chain) or
    /// `(path, tokens)` (a tree). Reads nothing from the device.
    fn settle(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        accepted: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let accepted = accepted
            .iter()
            .map(speculative::AcceptedArg::extract)
            .collect::<PyResult<Vec<_>>>()?;
        let mut borrowed = batch::borrow_all(requests)?;
        let mut batch = Vec::with_capacity(borrowed.len());
        for r in &mut borrowed {
            batch.push(r.get()?);
        }
        let accepted: Vec<unikv::Accepted<'_>> = accepted.iter().map(|a| a.as_accepted()).collect();
        self.with(py, |c| c.settle(&mut batch, &accepted))
    }

    /// Sizes the device tables for `meta`'s maximum batch (set-up: an allocation), so no
    /// later build allocates.
    fn reserve_verify_metadata(
        &self,
        py: Python<'_>,
        meta: &Bound<'_, verify::VerifyMetadata>,
    ) -> PyResult<()> {
        let m = meta.try_borrow().map_err(|_| busy("verify metadata"))?;
        let inner = &m.inner;
        self.with(py, |c| c.reserve_verify_metadata(inner))
    }

    /// Builds the verify metadata of `requests` (each one's newest verify) into `meta`
    /// and uploads its inputs. Refused while a numpy view of `meta.inputs` is alive.
    fn build_verify_metadata(
        &self,
        py: Python<'_>,
        meta: &Bound<'_, verify::VerifyMetadata>,
        requests: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut m = meta
            .try_borrow_mut()
            .map_err(|_| invalid("this verify metadata is in use"))?;
        m.check_no_views()?;
        let borrowed = batch::borrow_all(requests)?;
        let mut batch = Vec::with_capacity(borrowed.len());
        for r in &borrowed {
            let id = r.id;
            batch.push(
                r.inner
                    .as_ref()
                    .ok_or_else(|| invalid(format!("request {id} was finished or released")))?,
            );
        }
        let inner = &mut m.inner;
        self.with(py, |c| c.build_verify_metadata(inner, &batch))
    }

    /// Computes the verify metadata's outputs on the device (write ids, input and output
    /// states). With counts settled in the step pass no offsets; with an earlier verify
    /// unsettled on the host (counts a step late), `accepted` is `(values, at)`: its
    /// accepted count per request of the batch, from entry `at` (0 for a request with
    /// nothing unsettled), and `last_nodes` one past its last accepted node (a tree's;
    /// a chain's equals the count: leave it out). Reads them on the device only.
    #[pyo3(signature = (meta, *, accepted = None, last_nodes = None))]
    fn translate_verify(
        &self,
        py: Python<'_>,
        meta: &Bound<'_, verify::VerifyMetadata>,
        accepted: Option<(PyRef<'_, device_values::DeviceValues>, usize)>,
        last_nodes: Option<(PyRef<'_, device_values::DeviceValues>, usize)>,
    ) -> PyResult<()> {
        let offsets = match (&accepted, &last_nodes) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(invalid(
                    "translate_verify: last_nodes without accepted (pass the accepted counts)",
                ));
            }
            (Some((values, at)), last) => {
                let accepted = values.at(&self.device, *at)?;
                let last_node = match last {
                    Some((values, at)) => values.at(&self.device, *at)?,
                    None => accepted,
                };
                Some(unikv::VerifyOffsets {
                    accepted,
                    last_node,
                })
            }
        };
        let mut m = meta
            .try_borrow_mut()
            .map_err(|_| invalid("this verify metadata is in use"))?;
        let inner = &mut m.inner;
        self.with(py, |c| c.translate_verify(inner, offsets))
    }

    /// After a tree verify's forward, moves each request's accepted nodes' KV to
    /// consecutive rows on the device, reading the accepted paths there: `paths` is
    /// `(values, at)`, `width` entries per request from entry `at` (the path's nodes,
    /// then −1; a chain's `0, 1, …` moves nothing). One fixed-shape device op; call it
    /// before anything allocates. Nothing is read back.
    fn compact_accepted(
        &self,
        py: Python<'_>,
        meta: &Bound<'_, verify::VerifyMetadata>,
        paths: (PyRef<'_, device_values::DeviceValues>, usize),
    ) -> PyResult<()> {
        let paths = paths.0.at(&self.device, paths.1)?;
        let m = meta
            .try_borrow()
            .map_err(|_| invalid("this verify metadata is in use"))?;
        let inner = &m.inner;
        self.with(py, |c| c.compact_accepted(inner, paths))
    }

    /// A table of `len` `int32` entries (filled with `fill`) on the cache's device for
    /// the engine's kernels to write: accepted counts, last accepted nodes and paths,
    /// which `translate_verify` and `compact_accepted` read on the device. Set-up work
    /// (an allocation); freed when the object goes.
    #[pyo3(signature = (len, *, fill = 0))]
    fn device_values(
        &self,
        py: Python<'_>,
        len: usize,
        fill: i32,
    ) -> PyResult<device_values::DeviceValues> {
        device_values::DeviceValues::new(py, self.device.clone(), len, fill)
    }

    /// Releases the SWA KV of `request`'s rows that left the window; returns the tokens
    /// released.
    fn release_out_of_window(
        &self,
        py: Python<'_>,
        request: &Bound<'_, Request>,
    ) -> PyResult<usize> {
        let mut r = request.try_borrow_mut().map_err(|_| busy("request"))?;
        let req = r.get()?;
        self.with(py, |c| c.release_out_of_window(req))
    }

    /// Caches what `request` computed so far and keeps it running.
    fn cache_unfinished(&self, py: Python<'_>, request: &Bound<'_, Request>) -> PyResult<()> {
        let mut r = request.try_borrow_mut().map_err(|_| busy("request"))?;
        let req = r.get()?;
        self.with(py, |c| c.cache_unfinished(req))
    }

    /// Finishes `request`: its KV (and state) enters the prefix cache. The request cannot
    /// be used afterwards.
    fn cache_finished(&self, py: Python<'_>, request: &Bound<'_, Request>) -> PyResult<()> {
        let req = request
            .try_borrow_mut()
            .map_err(|_| busy("request"))?
            .take()?;
        self.with(py, |c| c.cache_finished(req))
    }

    /// Releases `request` without caching it (an abort or a retraction); returns its
    /// tokens, so it can be admitted again. The request cannot be used afterwards.
    fn release(&self, py: Python<'_>, request: &Bound<'_, Request>) -> PyResult<Vec<u32>> {
        let req = request
            .try_borrow_mut()
            .map_err(|_| busy("request"))?
            .take()?;
        let tokens = self.with(py, |c| c.release(req))?;
        Ok(tokens.into_iter().map(|t| t.0).collect())
    }

    /// Ends the step: applies deferred frees, checks conservation and polls the
    /// invariants. Returns the step's report.
    fn step_boundary(&self, py: Python<'_>) -> PyResult<StepReport> {
        let report = self.with(py, |c| c.step_boundary())?;
        Ok(StepReport { report })
    }

    /// Builds the step's metadata for `requests` computing `new_tokens` tokens each (an
    /// int for all, or one per request: a buffer or a list), after the step's
    /// allocations: the header on the host (`StepMetadata.host_image`, a numpy view) and
    /// the page tables on the device, one translation.
    #[pyo3(signature = (requests, new_tokens = None))]
    fn build_step_metadata(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        new_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<step::StepMetadata>> {
        let borrowed = batch::borrow_all(requests)?;
        let counts = tokens::counts(new_tokens, borrowed.len())?;
        let mut rows = Vec::with_capacity(borrowed.len());
        for (r, n) in borrowed.iter().zip(counts) {
            let id = r.id;
            let req = r
                .inner
                .as_ref()
                .ok_or_else(|| invalid(format!("request {id} was finished or released")))?;
            rows.push((req, n));
        }
        self.build_step(py, |c, meta| {
            c.build_step_metadata(meta, &rows)?;
            view_of(c, meta)
        })
    }

    /// One decode step's allocation and metadata in one call: `alloc_decode(requests,
    /// next_tokens)` then `build_step_metadata(requests)` (one new token each), with one
    /// pass over the batch and one release of the GIL. A refused allocation builds
    /// nothing.
    fn decode_step(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        next_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Py<step::StepMetadata>> {
        let next = tokens::token_ids(next_tokens)?;
        let mut borrowed = batch::borrow_all(requests)?;
        if next.len() != borrowed.len() {
            return Err(invalid(format!(
                "{} requests but {} next tokens",
                borrowed.len(),
                next.len()
            )));
        }
        let mut batch = Vec::with_capacity(borrowed.len());
        for r in &mut borrowed {
            batch.push(r.get()?);
        }
        self.build_step(py, |c, meta| {
            c.alloc_decode(&mut batch, &next)?;
            let rows: Vec<(&unikv::Request, usize)> = batch.iter().map(|r| (&**r, 1)).collect();
            c.build_step_metadata(meta, &rows)?;
            view_of(c, meta)
        })
    }

    /// Shapes step metadata for `requests` running requests of up to `max_len` tokens,
    /// steps of up to `max_new_tokens` new tokens and `max_loaded_pages` pages loaded
    /// back from the host tier (set-up: a device allocation), so every step's table has
    /// the same layout and no step within it allocates.
    #[pyo3(signature = (*, requests, max_len, max_new_tokens, max_loaded_pages = 0))]
    fn reserve_step_metadata(
        &self,
        py: Python<'_>,
        requests: usize,
        max_len: usize,
        max_new_tokens: usize,
        max_loaded_pages: usize,
    ) -> PyResult<()> {
        let capacity = unikv::StepCapacity {
            requests,
            max_len,
            max_new_tokens,
            max_loaded_pages,
        };
        self.with(py, |c| c.reserve_step_metadata(capacity))
    }

    /// Evicts unlocked prefixes until `full_pages` FULL and `swa_pages` SWA pages can be
    /// allocated together (`OutOfMemory` when they cannot, even after evicting all).
    #[pyo3(signature = (*, full_pages = 0, swa_pages = 0))]
    fn evict_to_free(&self, py: Python<'_>, full_pages: usize, swa_pages: usize) -> PyResult<()> {
        self.with(py, |c| c.evict_to_free(full_pages, swa_pages))
    }

    /// Evicts every unlocked prefix (an engine's "flush cache"); returns the tokens
    /// evicted.
    fn evict_all(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |c| c.evict_all())
    }

    /// The host tier's buffer geometry, or `None` without a host tier: a dict with
    /// `frame_bytes`, `units_per_frame` and `unit_bytes` (each a list for FULL pages,
    /// SWA pages and states). Unit `u` of a kind `k` is at byte
    /// `u // units_per_frame[k] * frame_bytes + u % units_per_frame[k] * unit_bytes[k]`:
    /// how the step table's `load_host_*` entries become host byte offsets.
    fn host_geometry<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyDict>>> {
        let Some(g) = self.with(py, |c| Ok(c.host_geometry()))? else {
            return Ok(None);
        };
        let d = pyo3::types::PyDict::new(py);
        d.set_item("frame_bytes", g.frame_bytes)?;
        d.set_item("units_per_frame", g.units_per_frame.to_vec())?;
        d.set_item("unit_bytes", g.unit_bytes.to_vec())?;
        Ok(Some(d))
    }

    /// The cache's counters now.
    fn stats(&self, py: Python<'_>) -> PyResult<Stats> {
        let s = self.with(py, |c| Ok(c.stats()))?;
        Ok(Stats::from(&s))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (page_size, layout) = py.detach(|| {
            let c = self.lock();
            (c.page_size(), c.layout())
        });
        format!(
            "HybridCache(model={:?}, page_size={page_size}, layout={layout:?})",
            self.model
        )
    }
}

#[pymethods]
impl PrefixMatch {
    /// Prompt tokens the request reuses (KV with a live window and, with recurrent
    /// layers, a cached state at its end): `device_tokens + host_tokens`.
    #[getter]
    fn cached_tokens(&self) -> PyResult<usize> {
        self.get().map(unikv::PrefixMatch::cached_tokens)
    }

    /// Of `cached_tokens`, those the device holds.
    #[getter]
    fn device_tokens(&self) -> PyResult<usize> {
        self.get().map(unikv::PrefixMatch::device_tokens)
    }

    /// Of `cached_tokens`, those admission loads back from the host tier (0 without
    /// one).
    #[getter]
    fn host_tokens(&self) -> PyResult<usize> {
        self.get().map(unikv::PrefixMatch::host_tokens)
    }

    /// Prompt tokens whose KV is cached (at least `cached_tokens`).
    #[getter]
    fn kv_hit_tokens(&self) -> PyResult<usize> {
        self.get().map(unikv::PrefixMatch::kv_hit_tokens)
    }

    /// Bytes admission copies from the host tier to load back `host_tokens` (0 without
    /// a host part).
    #[getter]
    fn load_bytes(&self) -> PyResult<u64> {
        self.get().map(unikv::PrefixMatch::load_bytes)
    }

    /// The prompt's length.
    #[getter]
    fn prompt_len(&self) -> PyResult<usize> {
        self.get().map(unikv::PrefixMatch::prompt_len)
    }

    fn __repr__(&self) -> String {
        match &self.inner {
            Some(m) => format!(
                "PrefixMatch(cached_tokens={}, device_tokens={}, host_tokens={}, kv_hit_tokens={}, prompt_len={})",
                m.cached_tokens(),
                m.device_tokens(),
                m.host_tokens(),
                m.kv_hit_tokens(),
                m.prompt_len()
            ),
            None => "PrefixMatch(<admitted>)".into(),
        }
    }
}

impl PrefixMatch {
    fn get(&self) -> PyResult<&unikv::PrefixMatch> {
        self.inner
            .as_ref()
            .ok_or_else(|| invalid("this prefix match was admitted already"))
    }
}

#[pymethods]
impl Request {
    /// The request's id.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Tokens with KV (prompt rows allocated so far, then decoded ones).
    #[getter]
    fn len(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Request::read(slf, unikv::Request::len)
    }

    /// Rows whose tokens are settled (its length without unsettled verify positions).
    #[getter]
    fn settled_len(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Request::read(slf, unikv::Request::settled_len)
    }

    /// Verify steps allocated and not settled yet.
    #[getter]
    fn unsettled_verifies(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Request::read(slf, unikv::Request::unsettled_verifies)
    }

    /// Prompt tokens not allocated yet.
    #[getter]
    fn remaining_prefill(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Request::read(slf, unikv::Request::remaining_prefill)
    }

    /// Prompt tokens reused from the prefix cache at admission.
    #[getter]
    fn cached_at_admission(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Request::read(slf, unikv::Request::cached_at_admission)
    }

    /// The request's tokens (prompt, then decoded).
    fn tokens(slf: &Bound<'_, Self>) -> PyResult<Vec<u32>> {
        Request::read(slf, |r| r.tokens().iter().map(|t| t.0).collect())
    }

    /// The request's running state slot (a virtual slot id; `None` on a model without
    /// recurrent layers). A kernel reads it through the step metadata, which translates
    /// it.
    #[getter]
    fn state_slot(slf: &Bound<'_, Self>) -> PyResult<Option<u32>> {
        Request::read(slf, |r| r.state_slot().map(|s| s.0))
    }

    /// Whether the request was finished or released (then any other use raises).
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_none()
    }

    fn __repr__(&self) -> String {
        match &self.inner {
            Some(r) => format!("Request(id={}, len={})", self.id, r.len()),
            None => format!("Request(id={}, <closed>)", self.id),
        }
    }
}

/// What a step boundary reports.
#[pyclass(module = "unikv", name = "StepReport", frozen)]
struct StepReport {
    report: unikv::StepReport,
}

#[pymethods]
impl StepReport {
    /// The step that ended.
    #[getter]
    fn step(&self) -> u64 {
        self.report.step
    }

    /// The whole report, as Rust prints it (formatted when asked: a step's report is
    /// usually dropped unread).
    #[getter]
    fn text(&self) -> String {
        format!("{:?}", self.report)
    }

    fn __repr__(&self) -> String {
        format!("StepReport(step={})", self.report.step)
    }
}

/// One side's pages (`full`, `swa`) or slots (`mamba`).
#[pyclass(module = "unikv", name = "SideStats", frozen, get_all)]
#[derive(Clone)]
struct SideStats {
    /// Pages (or slots) in all.
    total: usize,
    /// Free now.
    available: usize,
    /// Cached and unlocked: the prefix cache may give them up.
    evictable: usize,
    /// Cached and locked by a running request.
    protected: usize,
    /// Held by running requests.
    held: usize,
}

/// The cache's counters.
#[pyclass(module = "unikv", name = "Stats", frozen, get_all)]
struct Stats {
    /// Step boundaries so far.
    step: u64,
    /// FULL pages.
    full: SideStats,
    /// SWA pages.
    swa: SideStats,
    /// Mamba state slots.
    mamba: SideStats,
    /// Requests running.
    live_requests: usize,
    /// Prompt tokens reused from the prefix cache, in all.
    hit_tokens: u64,
    /// The host tier's figures (`None` without one).
    host: Option<HostStats>,
}

/// What the host tier did and holds (`Stats.host`).
#[pyclass(module = "unikv", name = "HostStats", frozen, get_all)]
#[derive(Clone)]
struct HostStats {
    /// Bytes of the host buffer.
    total_bytes: u64,
    /// Bytes the host holds of FULL pages.
    full_bytes: u64,
    /// Bytes the host holds of SWA pages.
    swa_bytes: u64,
    /// Bytes the host holds of recurrent states.
    state_bytes: u64,
    /// Most bytes the host held at once (all kinds).
    peak_bytes: u64,
    /// Prompt tokens admissions loaded back from the host.
    hit_tokens: u64,
    /// Bytes written back (device to host).
    written_bytes: u64,
    /// Bytes loaded back (host to device).
    loaded_bytes: u64,
    /// Copies issued (one per run of adjacent bytes).
    copies: u64,
    /// The largest single copy, in bytes.
    largest_copy: u64,
    /// Write-backs skipped because the host could not make room for them.
    refused_writes: u64,
}

impl From<&unikv::HostStats> for HostStats {
    fn from(h: &unikv::HostStats) -> HostStats {
        HostStats {
            total_bytes: h.total_bytes,
            full_bytes: h.full_bytes,
            swa_bytes: h.swa_bytes,
            state_bytes: h.state_bytes,
            peak_bytes: h.peak_bytes,
            hit_tokens: h.hit_tokens,
            written_bytes: h.written_bytes,
            loaded_bytes: h.loaded_bytes,
            copies: h.copies,
            largest_copy: h.largest_copy,
            refused_writes: h.refused_writes,
        }
    }
}

impl From<&unikv::SideStats> for SideStats {
    fn from(s: &unikv::SideStats) -> SideStats {
        SideStats {
            total: s.total_pages,
            available: s.available_pages,
            evictable: s.evictable_pages,
            protected: s.protected_pages,
            held: s.held_pages,
        }
    }
}

impl From<&unikv::CacheStats> for Stats {
    fn from(s: &unikv::CacheStats) -> Stats {
        Stats {
            step: s.step,
            full: (&s.full).into(),
            swa: (&s.swa).into(),
            mamba: (&s.mamba).into(),
            live_requests: s.live_requests,
            hit_tokens: s.hit_tokens,
            host: s.host.as_ref().map(HostStats::from),
        }
    }
}

/// The catalogue's model names.
pub(crate) fn model_names() -> Vec<&'static str> {
    ModelSpec::NAMED.iter().map(|m| m.name).collect()
}

/// Sets the invariant level for the whole process: `"off"`, `"warn"` or `"strict"`
/// (also `0`, `1`, `2`); `None` goes back to `UNIKV_INVARIANT_CHECK`.
#[pyfunction]
#[pyo3(signature = (level))]
fn set_invariant_level(level: Option<&str>) -> PyResult<()> {
    let level = level
        .map(unikv::invariants::Level::parse)
        .transpose()
        .map_err(|e| invalid(e.to_string()))?;
    unikv::invariants::set_level(level);
    Ok(())
}

/// The invariant level in force on this thread (`"off"`, `"warn"` or `"strict"`).
#[pyfunction]
fn invariant_level() -> &'static str {
    unikv::invariants::level().as_str()
}

/// The model names `HybridCache(model=...)` accepts.
#[pyfunction]
fn models() -> Vec<&'static str> {
    model_names()
}

/// Panics inside Rust, to test that a panic reaches Python as `InternalError`.
#[pyfunction]
fn _panic_for_tests() -> PyResult<()> {
    guarded(|| -> PyResult<()> { panic!("a deliberate panic") })
}

/// Token ids as the cache sees them, for tests of the buffer conversion.
#[pyfunction]
fn _token_ids_for_tests(tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    Ok(tokens::token_ids(tokens)?
        .into_iter()
        .map(|t: TokenId| t.0)
        .collect())
}

#[pymodule]
fn _unikv(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<HybridCache>()?;
    m.add_class::<PrefixMatch>()?;
    m.add_class::<Request>()?;
    m.add_class::<StepReport>()?;
    m.add_class::<Stats>()?;
    m.add_class::<step::StepMetadata>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<speculative::Speculation>()?;
    m.add_class::<verify::VerifyMetadata>()?;
    m.add_class::<verify::InputsView>()?;
    m.add_class::<device_values::DeviceValues>()?;
    m.add_function(wrap_pyfunction!(set_invariant_level, m)?)?;
    m.add_function(wrap_pyfunction!(invariant_level, m)?)?;
    m.add_class::<SideStats>()?;
    m.add_class::<HostStats>()?;
    m.add_class::<engine::ModelSpec>()?;
    m.add_class::<engine::KvGeometry>()?;
    m.add_class::<engine::CpuBuffer>()?;
    m.add_class::<dlpack::DeviceTable>()?;
    m.add_function(wrap_pyfunction!(models, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    m.add_function(wrap_pyfunction!(_token_ids_for_tests, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_rust_decode_steps, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_reference_run, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::_request_kv_indices, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::_kernel_ids, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::_prefix_indices, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::_capacity, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::_evict_to_free, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::_evict_all, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::_request_rows, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::_host_syncs, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::_ledger_ops, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::_reset_ledger, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

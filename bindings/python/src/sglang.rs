//! What `unikv.sglang` (the SGLang-shaped adapter, `python/unikv/sglang.py`) needs beyond
//! the lifecycle methods: a request's KV indices (the virtual ids its rows hold, or their
//! kernel ids on FULL or SWA), the virtual ids of a prompt's cached prefix, the capacity
//! views, and eviction by page counts. Free functions over `HybridCache` and `Request`
//! (a second `#[pymethods]` block would need PyO3's `multiple-pymethods`), private to
//! the package: their names start with `_` and only the adapter calls them.
//!
//! Id arrays come back as a `bytearray` of little-endian items (int64 virtual ids, int32
//! kernel ids), which the adapter wraps with `numpy.frombuffer` without a per-id loop.

use crate::errors::invalid;
use crate::{HybridCache, Request, tokens};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};
use std::collections::HashSet;
use unikv::TokenId;
use unikv::pools::{Side, VirtualToken};

/// Which ids of a row: the virtual ids themselves, or their kernel ids on one side.
#[derive(Clone, Copy)]
enum IdSpace {
    Virtual,
    Kernel(Side),
}

fn id_space(name: &str) -> PyResult<IdSpace> {
    match name {
        "virtual" => Ok(IdSpace::Virtual),
        "full" => Ok(IdSpace::Kernel(Side::Full)),
        "swa" => Ok(IdSpace::Kernel(Side::Swa)),
        other => Err(invalid(format!(
            "side {other:?} (expected \"virtual\", \"full\" or \"swa\")"
        ))),
    }
}

/// `ids` in `space`, as little-endian bytes: int64 virtual ids, or int32 kernel ids read
/// from the host tables (the sink, 0, for a row whose page is not bound on that side,
/// e.g. SWA that left the window).
fn encode(alloc: &dyn unikv::pools::KvAllocator, space: IdSpace, ids: &[VirtualToken]) -> Vec<u8> {
    match space {
        IdSpace::Virtual => ids
            .iter()
            .flat_map(|v| i64::from(v.0).to_le_bytes())
            .collect(),
        IdSpace::Kernel(side) => ids
            .iter()
            .flat_map(|&v| alloc.kernel_id(side, v).to_le_bytes())
            .collect(),
    }
}

/// The ids of rows `[start, end)` of `request` (`end` defaults to its length): with
/// `side="virtual"` the virtual token ids its rows hold (int64, what SGLang's
/// `req_to_token` row holds), with `"full"` or `"swa"` their kernel ids on that side
/// (int32).
#[pyfunction]
#[pyo3(signature = (cache, request, side = "virtual", start = 0, end = None))]
pub fn _request_kv_indices<'py>(
    py: Python<'py>,
    cache: &Bound<'py, HybridCache>,
    request: &Bound<'py, Request>,
    side: &str,
    start: usize,
    end: Option<usize>,
) -> PyResult<Bound<'py, PyByteArray>> {
    let space = id_space(side)?;
    let r = request
        .try_borrow()
        .map_err(|_| crate::errors::busy("request"))?;
    let id = r.id;
    let req = r
        .inner
        .as_ref()
        .ok_or_else(|| invalid(format!("request {id} was finished or released")))?;
    let row = req.row();
    let end = end.unwrap_or(row.len());
    if start > end || end > row.len() {
        return Err(invalid(format!(
            "rows {start}..{end} of request {id}, which has {} rows",
            row.len()
        )));
    }
    // The ids are read from `cache`'s tables: a request of another cache gets ids that
    // mean nothing here (the adapter only passes its own cache's requests).
    let bytes = cache
        .get()
        .with(py, |c| Ok(encode(c.allocator(), space, &row[start..end])))?;
    Ok(PyByteArray::new(py, &bytes))
}

/// The kernel ids (int32) of the virtual ids `ids` (an int32/int64 buffer or a list) on
/// `side` (`"full"` or `"swa"`), read from the host tables: SGLang's
/// `translate_loc_from_full_to_swa` for `side="swa"`.
#[pyfunction]
pub fn _kernel_ids<'py>(
    py: Python<'py>,
    cache: &Bound<'py, HybridCache>,
    ids: &Bound<'py, PyAny>,
    side: &str,
) -> PyResult<Bound<'py, PyByteArray>> {
    let space = match id_space(side)? {
        IdSpace::Virtual => return Err(invalid("side: \"full\" or \"swa\" to translate")),
        kernel => kernel,
    };
    let ids: Vec<VirtualToken> = tokens::token_ids(ids)?
        .into_iter()
        .map(|t| VirtualToken(t.0))
        .collect();
    let bytes = cache
        .get()
        .with(py, |c| Ok(encode(c.allocator(), space, &ids)))?;
    Ok(PyByteArray::new(py, &bytes))
}

/// The virtual ids (int64) the prefix cache holds for `tokens[..length]`, read from the
/// tree without locking, splitting or refreshing anything: `length` is a match's
/// `device_tokens`, so the device tree holds that prefix whole (a host part is in the
/// host tree, whose values are host units, not ids). Walks every node once
/// (`RadixTree::nodes`), so it costs O(nodes), not O(length).
#[pyfunction]
pub fn _prefix_indices<'py>(
    py: Python<'py>,
    cache: &Bound<'py, HybridCache>,
    tokens: &Bound<'py, PyAny>,
    length: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let key: Vec<TokenId> = tokens::token_ids(tokens)?;
    if length > key.len() {
        return Err(invalid(format!(
            "a prefix of {length} tokens of a {}-token key",
            key.len()
        )));
    }
    let values = cache.get().with(py, |c| {
        let tree = c.tree();
        let root = tree.root();
        let mut on_path = HashSet::from([root]);
        let mut out = vec![VirtualToken(0); length];
        let mut filled = 0;
        // Parents come before their children, so a node's parent is judged first.
        for node in tree.nodes() {
            let Some(parent) = node.parent else { continue };
            let start = node.start.0;
            if start >= length || !on_path.contains(&parent) {
                continue;
            }
            let n = node.key.len().min(length - start);
            if node.key[..n] != key[start..start + n] {
                continue;
            }
            on_path.insert(node.id);
            for (slot, v) in out[start..start + n].iter_mut().zip(node.value) {
                *slot = VirtualToken(v.0);
            }
            filled += n;
        }
        Ok((filled, out))
    })?;
    let (filled, out) = values;
    if filled != length {
        return Err(invalid(format!(
            "the prefix cache holds {filled} of the {length} tokens asked for (match again)"
        )));
    }
    let bytes: Vec<u8> = out
        .iter()
        .flat_map(|v| i64::from(v.0).to_le_bytes())
        .collect();
    Ok(PyByteArray::new(py, &bytes))
}

/// The allocator's capacity views, in pages: `page_size`, `joint_available_pages` and
/// `joint_schedulable_pages` (a FULL and an SWA page each; after compaction for the
/// latter), and per side (`full_`, `swa_`) `available_pages`, `schedulable_pages` and
/// `total_pages`.
#[pyfunction]
pub fn _capacity<'py>(
    py: Python<'py>,
    cache: &Bound<'py, HybridCache>,
) -> PyResult<Bound<'py, PyDict>> {
    let cap = cache.get().with(py, |c| Ok(c.allocator().capacity()))?;
    let d = PyDict::new(py);
    d.set_item("page_size", cap.page_size)?;
    d.set_item("joint_available_pages", cap.joint_available_pages)?;
    d.set_item("joint_schedulable_pages", cap.joint_schedulable_pages)?;
    for (name, side) in [("full", &cap.full), ("swa", &cap.swa)] {
        d.set_item(format!("{name}_available_pages"), side.available_pages)?;
        d.set_item(format!("{name}_schedulable_pages"), side.schedulable_pages)?;
        d.set_item(format!("{name}_total_pages"), side.total_pages)?;
    }
    Ok(d)
}

/// Evicts unlocked prefixes until `full_pages` FULL and `swa_pages` SWA pages can be
/// allocated together (`HybridCache::evict_to_free`); `unikv.OutOfMemory` when evicting
/// every unlocked prefix would not do.
#[pyfunction]
pub fn _evict_to_free(
    py: Python<'_>,
    cache: &Bound<'_, HybridCache>,
    full_pages: usize,
    swa_pages: usize,
) -> PyResult<()> {
    cache
        .get()
        .with(py, |c| c.evict_to_free(full_pages, swa_pages))
}

/// Evicts every unlocked prefix (`HybridCache::evict_all`); returns the tokens evicted.
#[pyfunction]
pub fn _evict_all(py: Python<'_>, cache: &Bound<'_, HybridCache>) -> PyResult<usize> {
    cache.get().with(py, |c| c.evict_all())
}

/// `(len, protected_len, window_cursor)` of `request`: its rows, the rows the prefix
/// cache owns (`[0, protected_len)`) and the row below which its SWA was released.
#[pyfunction]
pub fn _request_rows(request: &Bound<'_, Request>) -> PyResult<(usize, usize, usize)> {
    let mut r = request
        .try_borrow_mut()
        .map_err(|_| crate::errors::busy("request"))?;
    let req = r.get()?;
    Ok((req.len(), req.protected_len(), req.window_cursor()))
}

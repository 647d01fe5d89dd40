//! Verify metadata: what the kernels of one verify step consume, in two fixed-shape
//! device tables sized for a declared maximum batch and the cache's
//! [`Speculation`](crate::Speculation), so a CUDA graph captured once replays for any
//! batch up to it (padding requests and positions name the sink).
//!
//! The **inputs** are host data in virtual ids (they survive compaction): per request
//! the newest verify's width, its settled length, its tree (parents, depths and the tree
//! mask of the positions each one attends to; a chain is the tree `i − 1`), the virtual
//! ids of every row its unsettled verifies reserved, and its state slots. The **outputs**
//! are translated on the device, against the current mirror, by
//! [`HybridCache::translate_verify`] in one op: for each side it reads each request's
//! rows from a **device** offset — where the accepted counts of its earlier unsettled
//! verify put the newest one — up to its draft's width, and translates them: the write
//! ids of every verify position on FULL and SWA (the first `k` of the FULL ones are the
//! draft model's write window: its layers share the FULL envelope), the physical input
//! state (the running slot, or the accepted position's slot of the earlier verify's
//! scratch group: the replay index translation) and the scratch group the verify writes,
//! disjoint from its input by construction. So nothing on the host waits for an
//! accepted count.
//!
//! After the verify forward, [`HybridCache::compact_accepted`] moves a tree verify's
//! accepted nodes' KV to consecutive rows with one fixed-shape device copy that reads
//! the accepted paths on the device.
//!
//! The tables are sized once by [`HybridCache::reserve_verify_metadata`] (set-up: an
//! allocation); after it nothing on the speculative path waits for the device
//! (`every_speculative_path_issues_no_host_sync`, which builds, translates and compacts
//! verify metadata on the CPU and emulated CUDA backends). Padding requests and the
//! positions past a draft name the sink, after a late verify too
//! (`verify_metadata_is_fixed_shape_and_pads_to_the_sink`,
//! `a_late_verify_pads_past_its_draft_to_the_sink`). `benches/verify.rs` times a verify
//! step against a decode step in one run.

use crate::cache::HybridCache;
use crate::error::Error;
use crate::request::Request;
use crate::tables::{DeviceTables, to_i32};
use unikv_kernels::{RowGather, TableId, WindowTranslate};
use unikv_pools::Side;

/// Device values an engine's kernels wrote (accepted counts, accepted paths): entries of
/// `table` from `at`, in batch order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceValues {
    /// The device table.
    pub table: TableId,
    /// The first entry.
    pub at: usize,
}

/// Where the newest verify of each request of the batch starts on the device, when its
/// earlier verify is unsettled on the host (device values the engine's accept kernel
/// wrote; 0 for a request with nothing unsettled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyOffsets {
    /// The earlier verify's accepted count: its positions start that many rows past the
    /// settled ones.
    pub accepted: DeviceValues,
    /// One past the earlier verify's last accepted node: its state there is the one the
    /// newest verify starts from (for a chain, the accepted count: pass the same values).
    pub last_node: DeviceValues,
}

/// Where each section of the two verify tables starts, in `i32` entries. `B` is the
/// declared maximum batch, `W` the cache's [`Speculation::max_width`](crate::Speculation),
/// `R = max_in_flight × W` the rows a request may have reserved, `S = 1 + max_in_flight
/// × W` state ids (0 without recurrent layers). Requests past the batch and positions past a request's
/// width are padding (0: the sink; −1 for parents).
///
/// | table | section | entries | what |
/// |---|---|---|---|
/// | inputs | `widths` | `B` | positions of the request's newest verify |
/// | inputs | `settled` | `B` | its settled rows (its positions start here plus the device offset) |
/// | inputs | `parents` | `B × W` | each position's parent (−1: the root) |
/// | inputs | `depths` | `B × W` | each position's depth (its RoPE position is the start plus it) |
/// | inputs | `masks` | `B × W × 2` | the tree mask: the positions each one attends to among the verify's (itself and its ancestors), bits 0–31 then 32–63 |
/// | inputs | `rows` | `B × R` | virtual ids of the rows its unsettled verifies reserved |
/// | inputs | `slots` | `B × S` | virtual state slots: the running one, the slot of each entry of the earlier unsettled verify's scratch lane (with `max_in_flight` = 2; the sink without one), of the newest verify's lane |
/// | inputs | `entries` | `B × S` | the entry within each of those slots (0 under the copy rollback, where an entry is the slot's state; a log entry's index under a [`StateReplay`](crate::StateReplay)) |
/// | inputs | `zeros` | `B` | zeros: the device offset of a batch with nothing unsettled |
/// | outputs | `write_full` | `B × W` | FULL kernel ids of its positions (the first `k`: the draft window) |
/// | outputs | `write_swa` | `B × W` | SWA kernel ids of its positions |
/// | outputs | `state_in` | `B` | physical slot of the state the verify starts from: copy rollback, the running slot or the earlier verify's lane slot at its last accepted node; replay rollback, the running slot always |
/// | outputs | `state_out` | `B × W` | physical slot of each position's entry in the newest verify's own lane: the state after it (copy), its log entry (replay) |
/// | outputs | `prev_out` | `B × W × (max_in_flight − 1)` | physical slot of each entry of the earlier unsettled verify's lane: under replay rollback the verify first replays that verify's accepted entries (its accepted path, a device value) from `state_in` |
///
/// **Contract: a verify never reads an entry it writes.** `state_in` is never a slot
/// whose entry a verify of the batch writes (the padding's sink aside): the running slot
/// belongs to its request and no verify writes it, and each unsettled verify writes a
/// scratch lane of its own, so with counts a step late the newest verify reads the
/// earlier one's lane and writes another. A kernel may write its outputs before it reads
/// its input (`tests/speculative.rs`, `a_verify_never_reads_a_state_slot_it_writes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerifyLayout {
    /// Requests the tables are sized for.
    pub max_batch: usize,
    /// Positions per request (`W`).
    pub width: usize,
    /// Reserved rows per request (`R`).
    pub rows_per_request: usize,
    /// State ids per request (`S`).
    pub slots_per_request: usize,
    /// Offset of `widths` (inputs).
    pub widths: usize,
    /// Offset of `settled` (inputs).
    pub settled: usize,
    /// Offset of `parents` (inputs).
    pub parents: usize,
    /// Offset of `depths` (inputs).
    pub depths: usize,
    /// Offset of `masks` (inputs).
    pub masks: usize,
    /// Offset of `rows` (inputs).
    pub rows: usize,
    /// Offset of `slots` (inputs).
    pub slots: usize,
    /// Offset of `entries` (inputs).
    pub entries: usize,
    /// Offset of `zeros` (inputs).
    pub zeros: usize,
    /// Entries of the inputs table.
    pub inputs_len: usize,
    /// Offset of `write_full` (outputs).
    pub write_full: usize,
    /// Offset of `write_swa` (outputs).
    pub write_swa: usize,
    /// Offset of `state_in` (outputs).
    pub state_in: usize,
    /// Offset of `state_out` (outputs).
    pub state_out: usize,
    /// Offset of `prev_out` (outputs).
    pub prev_out: usize,
    /// Entries of the outputs table.
    pub outputs_len: usize,
}

impl VerifyLayout {
    fn new(max_batch: usize, width: usize, in_flight: usize, states: bool) -> VerifyLayout {
        let b = max_batch;
        let r = in_flight * width;
        let s = if states { 1 + in_flight * width } else { 0 };
        let mut l = VerifyLayout {
            max_batch,
            width,
            rows_per_request: r,
            slots_per_request: s,
            ..VerifyLayout::default()
        };
        // Sizes in the order of the table above.
        let inputs = [
            b,
            b,
            b * width,
            b * width,
            b * width * 2,
            b * r,
            b * s,
            b * s,
            b,
        ];
        (
            [
                l.widths, l.settled, l.parents, l.depths, l.masks, l.rows, l.slots, l.entries,
                l.zeros,
            ],
            l.inputs_len,
        ) = sections(inputs);
        let prev = if states {
            b * width * (in_flight - 1)
        } else {
            0
        };
        let outputs = [b * width, b * width, b, b * width, prev];
        (
            [
                l.write_full,
                l.write_swa,
                l.state_in,
                l.state_out,
                l.prev_out,
            ],
            l.outputs_len,
        ) = sections(outputs);
        l
    }
}

/// Consecutive sections of `sizes` entries: where each starts, and the total.
fn sections<const N: usize>(sizes: [usize; N]) -> ([usize; N], usize) {
    let mut at = 0;
    let starts = sizes.map(|n| {
        let start = at;
        at += n;
        start
    });
    (starts, at)
}

/// The metadata of one verify step for up to `max_batch` requests, reused across
/// steps: build it with [`HybridCache::build_verify_metadata`] after the step's
/// allocations, translate it with [`HybridCache::translate_verify`].
#[derive(Debug)]
pub struct VerifyMetadata {
    max_batch: usize,
    /// The cache it was built by.
    built: Option<u64>,
    /// The mirror generation its outputs were translated at.
    translated: Option<u64>,
    layout: VerifyLayout,
    image: Vec<i32>,
    tables: Option<(TableId, TableId)>,
}

impl VerifyMetadata {
    /// Empty metadata for batches of up to `max_batch` requests (the batch a CUDA graph is
    /// captured for).
    pub fn new(max_batch: usize) -> VerifyMetadata {
        VerifyMetadata {
            max_batch,
            built: None,
            translated: None,
            layout: VerifyLayout::default(),
            image: Vec::new(),
            tables: None,
        }
    }

    /// Where each section starts.
    pub fn layout(&self) -> VerifyLayout {
        self.layout
    }

    /// The device tables (inputs, outputs), once built.
    pub fn tables(&self) -> Option<(TableId, TableId)> {
        self.tables
    }

    /// The host image of the inputs table.
    pub fn inputs(&self) -> &[i32] {
        &self.image
    }
}

impl HybridCache {
    /// Makes sure the verify tables hold `layout`'s inputs and outputs (growing them is
    /// an allocation: set-up work); returns both tables.
    fn verify_tables(&mut self, layout: VerifyLayout) -> Result<(TableId, TableId), Error> {
        let (tables, device) = self.tables_mut();
        // Each kept as it grows, so a failure below leaks nothing.
        let inputs = DeviceTables::grow(device, &mut tables.verify_inputs, layout.inputs_len)?;
        let outputs = DeviceTables::grow(device, &mut tables.verify_outputs, layout.outputs_len)?;
        Ok((inputs, outputs))
    }

    /// Uploads verify metadata's inputs (`layout`'s image) into the verify tables, grown
    /// first when they are short; returns both tables.
    fn upload_verify_tables(
        &mut self,
        layout: VerifyLayout,
        image: &[i32],
    ) -> Result<(TableId, TableId), Error> {
        let (inputs, outputs) = self.verify_tables(layout)?;
        self.device().upload_table(inputs, 0, image)?;
        Ok((inputs, outputs))
    }

    /// Sizes the device tables verify metadata for `meta`'s maximum batch needs, so that
    /// no later [`HybridCache::build_verify_metadata`] allocates: an allocation may make
    /// the host wait on a GPU, so call this once at set-up (where an engine captures its
    /// CUDA graphs), not on the scheduling path. Without it the first build allocates.
    ///
    /// Errors: a cache built without speculation ([`Error::SpeculationOff`]) or a device
    /// error (the tables as they were).
    pub fn reserve_verify_metadata(&mut self, meta: &VerifyMetadata) -> Result<(), Error> {
        let layout = self.verify_layout(meta.max_batch, u64::MAX)?;
        self.verify_tables(layout).map(drop)
    }

    /// The verify layout of batches of up to `max_batch` requests on this cache.
    fn verify_layout(&self, max_batch: usize, request: u64) -> Result<VerifyLayout, Error> {
        let spec = self
            .speculation()
            .ok_or(Error::SpeculationOff { request })?;
        Ok(VerifyLayout::new(
            max_batch,
            spec.max_width as usize,
            spec.max_in_flight as usize,
            self.model().has_recurrent_state(),
        ))
    }

    /// Builds the verify metadata of `batch` (each request's newest verify, allocated by
    /// [`HybridCache::alloc_verify`]) into `meta` and uploads its inputs in one
    /// asynchronous op. Host work is O(batch × width); nothing waits for the device once
    /// the tables are sized ([`HybridCache::reserve_verify_metadata`]).
    ///
    /// Errors: a cache built without speculation ([`Error::SpeculationOff`]), a batch
    /// larger than `meta`'s maximum, a request of another cache or with no unsettled
    /// verify ([`Error::BadRequest`]), a device error; then `meta` is not translatable
    /// until the next successful build.
    pub fn build_verify_metadata(
        &mut self,
        meta: &mut VerifyMetadata,
        batch: &[&Request],
    ) -> Result<(), Error> {
        meta.built = None;
        meta.translated = None;
        let first = batch.first().map_or(u64::MAX, |r| r.id);
        let l = self.verify_layout(meta.max_batch, first)?;
        if batch.len() > meta.max_batch {
            return Err(Error::BadRequest {
                request: first,
                reason: format!(
                    "a verify batch of {} requests, metadata for {}",
                    batch.len(),
                    meta.max_batch
                ),
            });
        }
        for req in batch {
            self.check_request(req)?;
            if req.verifies.is_empty() {
                return Err(Error::BadRequest {
                    request: req.id,
                    reason: "verify metadata for a request with no unsettled verify".into(),
                });
            }
        }
        let width = l.width;
        let shape = self.scratch_shape();
        meta.layout = l;
        meta.image.clear();
        meta.image.resize(l.inputs_len, 0);
        let img = &mut meta.image;
        img[l.parents..l.parents + l.max_batch * width].fill(-1);
        for (r, req) in batch.iter().enumerate() {
            let newest = req.verifies.back().expect("checked above");
            let settled = req.settled_len();
            img[l.widths + r] = newest.width as i32;
            img[l.settled + r] = to_i32(req.id, "settled length", "verify", settled)?;
            let tree = &mut img[l.parents + r * width..l.parents + (r + 1) * width];
            for i in 0..newest.width {
                tree[i] = match &newest.parents {
                    Some(p) => p[i],
                    None => i as i32 - 1,
                };
            }
            let mut masks = [0u64; crate::speculative::MAX_VERIFY_WIDTH as usize];
            for i in 0..newest.width {
                let parent = img[l.parents + r * width + i];
                (img[l.depths + r * width + i], masks[i]) = if parent < 0 {
                    (0, 1)
                } else {
                    let p = parent as usize;
                    (img[l.depths + r * width + p] + 1, masks[p] | 1 << i)
                };
                let at = l.masks + 2 * (r * width + i);
                // The words' bits, reinterpreted: a kernel reads them as unsigned.
                img[at] = masks[i] as u32 as i32;
                img[at + 1] = (masks[i] >> 32) as u32 as i32;
            }
            let reserved = &req.row[settled..];
            for (slot, v) in img[l.rows + r * l.rows_per_request..]
                .iter_mut()
                .zip(reserved)
            {
                *slot = v.0 as i32;
            }
            if let Some(state) = &req.state {
                // [running, the earlier unsettled verify's lane, the newest's lane], entry
                // by entry: disjoint, so the state a verify reads is never one it writes.
                let n = l.slots_per_request;
                let at = r * n;
                img[l.slots + at] = state.running.0 as i32;
                let put =
                    |first: usize, lane: &crate::speculative::ScratchLane, img: &mut [i32]| {
                        for i in 0..width {
                            let (slot, entry) = lane.entry(shape, i);
                            img[l.slots + at + first + i] = slot.0 as i32;
                            img[l.entries + at + first + i] = entry as i32;
                        }
                    };
                if req.verifies.len() > 1 {
                    put(1, &req.verifies[req.verifies.len() - 2].lane, img);
                }
                put(n - width, &newest.lane, img);
            }
        }
        let tables = self.upload_verify_tables(l, &meta.image)?;
        meta.tables = Some(tables);
        meta.built = Some(self.cache_id());
        Ok(())
    }

    /// Translates `meta`'s outputs on the device: each request's positions start at its
    /// settled rows plus `offsets.accepted` — device values: the accepted count of the
    /// request's earlier unsettled verify, 0 when it has none (`None`: no request of the
    /// batch has one) — and its state at `offsets.last_node` of `[running, group…]`.
    /// Uploads the mirror first when it is behind (so call it after the step's
    /// last allocation); then one [`unikv_kernels::Device::translate_windows`] for every
    /// side (FULL and SWA write ids, input state and the state group): one launch. Host-known shapes, no
    /// wait.
    pub fn translate_verify(
        &mut self,
        meta: &mut VerifyMetadata,
        offsets: Option<VerifyOffsets>,
    ) -> Result<(), Error> {
        let (inputs, outputs) = self.built_tables(meta)?;
        self.sync_mirror()?;
        let l = meta.layout;
        let zeros = DeviceValues {
            table: inputs,
            at: l.zeros,
        };
        let starts = offsets.map_or(zeros, |o| o.accepted);
        // Under replay rollback a verify starts from the running state and replays the
        // earlier verify's entries itself; under copy it starts from that verify's state.
        let replays = self.replays_states();
        let state_index = match offsets {
            Some(o) if !replays => o.last_node,
            _ => zeros,
        };
        let alloc = self.allocator();
        let ps = alloc.page_size().get();
        let window = |side: Side, out_at: usize| -> Option<WindowTranslate> {
            Some(WindowTranslate {
                v2p: alloc.mirror_table(side)?,
                ids: inputs,
                ids_at: l.rows,
                rows: l.rows_per_request,
                starts: starts.table,
                starts_at: starts.at,
                bias: 0,
                // Positions past a request's draft are the sink, whatever the offset.
                lens: Some((inputs, l.widths)),
                batch: l.max_batch,
                width: l.width,
                page_size: ps,
                stride: alloc.stride(side),
                out: outputs,
                out_at,
            })
        };
        let mut all: Vec<WindowTranslate> = Vec::with_capacity(4);
        all.extend(window(Side::Full, l.write_full));
        if self.model().swa_layers > 0 {
            all.extend(window(Side::Swa, l.write_swa));
        }
        if l.slots_per_request > 0
            && let Some(v2p) = alloc.mirror_table(Side::Mamba)
        {
            let slots = WindowTranslate {
                v2p,
                ids: inputs,
                ids_at: l.slots,
                rows: l.slots_per_request,
                starts: state_index.table,
                starts_at: state_index.at,
                bias: 0,
                lens: Some((inputs, l.widths)),
                batch: l.max_batch,
                width: 1,
                page_size: 1,
                stride: 1,
                out: outputs,
                out_at: l.state_in,
            };
            // The lane the verify writes: the last W entries, whatever the offset (apart
            // from the running slot and the earlier verify's lane the input is read from).
            let lane = WindowTranslate {
                starts: inputs,
                starts_at: l.zeros,
                bias: (l.slots_per_request - l.width) as i32,
                width: l.width,
                out_at: l.state_out,
                ..slots
            };
            all.extend([slots, lane]);
            if l.slots_per_request > 1 + l.width {
                // The earlier verify's lane: the W entries after the running slot.
                all.push(WindowTranslate {
                    bias: 1,
                    // Its own width is not the newest verify's: every entry translates.
                    lens: None,
                    out_at: l.prev_out,
                    ..lane
                });
            }
        }
        self.device().translate_windows(&all)?;
        meta.translated = Some(self.mirror_generation());
        Ok(())
    }

    /// Moves each tree verify's accepted nodes' KV (FULL, the draft layer's with it, and
    /// SWA) to consecutive rows from its first position, on the device: `paths` holds, per
    /// request, `W` entries — the accepted path's nodes in order, then −1 (a chain's path
    /// is `0, 1, …`, which moves nothing). One fixed-shape
    /// [`unikv_kernels::Device::gather_rows`] for every side (refused whole or issued
    /// whole, so a failed call moved nothing and may be retried), reading the write ids
    /// [`HybridCache::translate_verify`] produced; call it after the verify forward and
    /// before anything compacts (an allocation), so those ids still name the rows.
    pub fn compact_accepted(
        &self,
        meta: &VerifyMetadata,
        paths: DeviceValues,
    ) -> Result<(), Error> {
        let (_, outputs) = self.built_tables(meta)?;
        self.check_current(meta.translated)?;
        let l = meta.layout;
        let g = self.kv_geometry();
        let model = self.model();
        let mut sides = vec![(
            l.write_full,
            2 * model.full_envelope_layers(),
            g.full_row_bytes,
        )];
        if model.swa_layers > 0 {
            sides.push((l.write_swa, 2 * model.swa_layers, g.swa_row_bytes));
        }
        let gathers: Vec<RowGather> = sides
            .into_iter()
            .map(|(ids_at, rows_per_token, row_bytes)| RowGather {
                buf: self.allocator().buffer(),
                ids: outputs,
                ids_at,
                path: paths.table,
                path_at: paths.at,
                batch: l.max_batch,
                width: l.width,
                page_size: g.page_size as u32,
                rows_per_token,
                row_bytes,
            })
            .collect();
        // One op for every side: refused whole, or issued whole.
        self.device().gather_rows(&gathers)?;
        Ok(())
    }

    /// `meta`'s device tables if this cache built it.
    fn built_tables(&self, meta: &VerifyMetadata) -> Result<(TableId, TableId), Error> {
        match (meta.built, meta.tables) {
            (Some(cache), Some(tables)) if cache == self.cache_id() => Ok(tables),
            _ => Err(Error::UnbuiltStepMetadata),
        }
    }
}

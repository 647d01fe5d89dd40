//! Step metadata: what an attention kernel consumes for one batch of requests in one
//! step, built from host tables after the step's allocations, with host-known shapes and
//! no host sync — as host slices and as one device table uploaded in one op.
//!
//! Per request it holds the kernel ids of every FULL row, of the SWA rows inside the
//! window of the step's first new token, the write locations of the step's new tokens
//! on each side, and, for a model with recurrent layers, the physical state slot and any
//! checkpoint the kernel saves. Kernel ids name physical pages, which compaction moves
//! inside any allocation, so metadata is only readable while the tables it was built from
//! are unchanged: [`HybridCache::step_view`] checks the cache's mirror generation and
//! refuses stale metadata with [`Error::StaleStepMetadata`], and the view it returns
//! borrows the cache, so nothing can change the tables while it is read.

use crate::cache::HybridCache;
use crate::error::Error;
use crate::invariants_decl::WINDOW_LIVE;
use crate::request::Request;
use std::ops::Range;
use unikv_kernels::TableId;
use unikv_pools::Side;

/// The metadata of one step, reused across steps: fill it with
/// [`HybridCache::build_step_metadata`] after the step's allocations, read it through
/// [`HybridCache::step_view`]. Its host vectors keep their capacity, so a steady batch
/// allocates nothing.
#[derive(Debug, Default)]
pub struct StepMetadata {
    /// The cache and mirror generation it was built at; `None` before a successful build.
    built: Option<(u64, u64)>,
    requests: Vec<RequestMeta>,
    checkpoints: Vec<StepCheckpoint>,
    image: Vec<i32>,
    layout: DeviceLayout,
    table: Option<TableId>,
}

impl StepMetadata {
    /// Empty metadata (nothing readable until built).
    pub fn new() -> StepMetadata {
        StepMetadata::default()
    }
}

/// Where each section of the step's device table starts, in `i32` entries (host-known:
/// the sums of the batch's lengths). `B` is the batch size; every section follows the
/// batch order.
///
/// | section | entries | what |
/// |---|---|---|
/// | `query_starts` | `B + 1` | prefix sums of new tokens (`cu_seqlens_q`) |
/// | `full_starts` | `B + 1` | prefix sums of rows (`cu_seqlens_k` of the FULL layers) |
/// | `swa_starts` | `B + 1` | prefix sums of SWA window rows |
/// | `swa_first` | `B` | row position of each request's first SWA window row |
/// | `full_ids` | `Σ len` | FULL kernel ids of rows `[0, len)` |
/// | `swa_ids` | `Σ window rows` | SWA kernel ids of rows `[swa_first, len)` |
/// | `write_full` | `Σ new` | FULL kernel ids of the new tokens (`out_cache_loc`) |
/// | `write_swa` | `Σ new` | SWA kernel ids of the new tokens |
/// | `state_slots` | `B` | physical running state slot (0 without recurrent state) |
/// | `checkpoint_starts` | `B + 1` | prefix sums of the checkpoints each request saves |
/// | `checkpoint_slots` | `Σ checkpoints` | physical slot each checkpoint is saved to |
/// | `checkpoint_at` | `Σ checkpoints` | the row length whose state is saved there |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceLayout {
    /// Requests in the batch.
    pub batch: usize,
    /// Offset of `query_starts`.
    pub query_starts: usize,
    /// Offset of `full_starts`.
    pub full_starts: usize,
    /// Offset of `swa_starts`.
    pub swa_starts: usize,
    /// Offset of `swa_first`.
    pub swa_first: usize,
    /// Offset of `full_ids`.
    pub full_ids: usize,
    /// Offset of `swa_ids`.
    pub swa_ids: usize,
    /// Offset of `write_full`.
    pub write_full: usize,
    /// Offset of `write_swa`.
    pub write_swa: usize,
    /// Offset of `state_slots`.
    pub state_slots: usize,
    /// Offset of `checkpoint_starts`.
    pub checkpoint_starts: usize,
    /// Offset of `checkpoint_slots`.
    pub checkpoint_slots: usize,
    /// Offset of `checkpoint_at`.
    pub checkpoint_at: usize,
    /// Entries used (the table may be longer; the rest is stale).
    pub len: usize,
}

/// One request's part of the image, as ranges of it.
#[derive(Clone, Debug)]
struct RequestMeta {
    request: u64,
    len: usize,
    new_tokens: usize,
    swa_first: usize,
    full: Range<usize>,
    swa: Range<usize>,
    write_full: Range<usize>,
    write_swa: Range<usize>,
    state_slot: Option<u32>,
    checkpoints: Range<usize>,
}

/// A checkpoint a request's recurrent kernel saves in this step: the state after
/// `at_len` rows goes into physical slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCheckpoint {
    /// The physical slot (its envelope is at `slot × slot bytes`).
    pub slot: u32,
    /// The row length whose state is saved (inside this step's new tokens).
    pub at_len: usize,
}

/// Byte geometry of the buffer as kernels address it: a FULL or SWA kernel id `k` names
/// a token's rows in a page-major envelope, layer by layer, K then V: layer `l`'s K row
/// is row `k + 2·l·ps` and its V row `k + (2·l + 1)·ps`, each `row_bytes` long at byte
/// `row × row_bytes`. A physical state slot `p` is at byte `p × slot_bytes`. Kernel id
/// 0 (and slot 0) is the sink: padded writes go there and nothing reads it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Tokens per page.
    pub page_size: usize,
    /// Bytes of one FULL row (`kv_heads × head_dim × dtype bytes`).
    pub full_row_bytes: u64,
    /// Bytes of one SWA row (0 without SWA layers).
    pub swa_row_bytes: u64,
    /// Bytes of one state slot envelope (0 without recurrent layers).
    pub slot_bytes: u64,
}

impl KvGeometry {
    /// Byte offset of layer `layer`'s K row (`value = false`) or V row (`value = true`)
    /// of the token with kernel id `kernel_id` on `side` (FULL or SWA).
    pub fn row_offset(&self, side: Side, kernel_id: i32, layer: u32, value: bool) -> u64 {
        let row_bytes = match side {
            Side::Full => self.full_row_bytes,
            _ => self.swa_row_bytes,
        };
        let row = kernel_id as u64 + (2 * layer as u64 + value as u64) * self.page_size as u64;
        row * row_bytes
    }

    /// Byte offset of physical state slot `slot`.
    pub fn slot_offset(&self, slot: u32) -> u64 {
        slot as u64 * self.slot_bytes
    }
}

/// A readable view of current step metadata (see [`HybridCache::step_view`]). It borrows
/// the cache, so no allocation, free or compaction can run while it is alive.
#[derive(Debug, Clone, Copy)]
pub struct StepView<'a> {
    meta: &'a StepMetadata,
}

/// One request's metadata in a [`StepView`].
#[derive(Clone, Copy, Debug)]
pub struct RequestStep<'a> {
    /// The request's id.
    pub request: u64,
    /// Its rows after this step's allocation (the queries are the last `new_tokens`).
    pub len: usize,
    /// Tokens this step computes (the rows `[len − new_tokens, len)`).
    pub new_tokens: usize,
    /// FULL kernel ids of rows `[0, len)`.
    pub full: &'a [i32],
    /// Row position of `swa[0]`: the first row inside the window of the step's first new
    /// token (`len − new_tokens + 1 − W`, at least 0).
    pub swa_first: usize,
    /// SWA kernel ids of rows `[swa_first, len)`; a row whose SWA was released reads the
    /// sink (0), which a correct run never asks for. Empty without SWA layers.
    pub swa: &'a [i32],
    /// FULL kernel ids where the new tokens' K/V is written.
    pub write_full: &'a [i32],
    /// SWA kernel ids where the new tokens' K/V is written (empty without SWA layers).
    pub write_swa: &'a [i32],
    /// The physical running state slot (`None` without recurrent layers).
    pub state_slot: Option<u32>,
    /// The checkpoints this step saves, in ascending position (see
    /// [`Request::checkpoint_writes`]).
    pub checkpoints: &'a [StepCheckpoint],
}

impl RequestStep<'_> {
    /// Row position of the step's first new token.
    pub fn first_query(&self) -> usize {
        self.len - self.new_tokens
    }

    /// The SWA kernel id of row `pos`, `None` outside `[swa_first, len)`.
    pub fn swa_id(&self, pos: usize) -> Option<i32> {
        pos.checked_sub(self.swa_first)
            .and_then(|i| self.swa.get(i))
            .copied()
    }
}

impl<'a> StepView<'a> {
    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.meta.requests.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.meta.requests.is_empty()
    }

    /// The `i`-th request of the batch, in the order it was built with.
    pub fn request(&self, i: usize) -> RequestStep<'a> {
        let m = &self.meta.requests[i];
        let img = &self.meta.image;
        RequestStep {
            request: m.request,
            len: m.len,
            new_tokens: m.new_tokens,
            full: &img[m.full.clone()],
            swa_first: m.swa_first,
            swa: &img[m.swa.clone()],
            write_full: &img[m.write_full.clone()],
            write_swa: &img[m.write_swa.clone()],
            state_slot: m.state_slot,
            checkpoints: &self.meta.checkpoints[m.checkpoints.clone()],
        }
    }

    /// Every request of the batch.
    pub fn requests(&self) -> impl Iterator<Item = RequestStep<'a>> + '_ {
        (0..self.len()).map(|i| self.request(i))
    }

    /// The device table the metadata was uploaded to (`None` for an empty batch, which
    /// uploads nothing). Reused across steps: the next build overwrites it in stream
    /// order, after the kernels that read this one.
    pub fn device_table(&self) -> Option<TableId> {
        self.meta.table
    }

    /// Where each section starts in the device table.
    pub fn device_layout(&self) -> DeviceLayout {
        self.meta.layout
    }

    /// The host image of the device table (what was uploaded), `layout.len` entries.
    pub fn host_image(&self) -> &'a [i32] {
        &self.meta.image
    }
}

/// The step table a cache owns: one device table, grown when a step needs more entries
/// than any before.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepTable {
    pub(crate) id: TableId,
    pub(crate) len: usize,
}

fn to_i32(request: u64, what: &str, n: usize) -> Result<i32, Error> {
    i32::try_from(n).map_err(|_| Error::BadRequest {
        request,
        reason: format!("{what} {n} does not fit the step table's i32 entries"),
    })
}

impl HybridCache {
    /// The byte geometry kernels address the buffer with (see [`KvGeometry`]).
    pub fn kv_geometry(&self) -> KvGeometry {
        let alloc = self.allocator();
        let row_bytes = |side: Side| {
            let grid = alloc.grid(side);
            if grid.stride == 0 {
                0
            } else {
                grid.envelope / grid.stride as u64
            }
        };
        KvGeometry {
            page_size: self.page_size(),
            full_row_bytes: row_bytes(Side::Full),
            swa_row_bytes: row_bytes(Side::Swa),
            slot_bytes: if self.model().has_recurrent_state() {
                alloc.grid(Side::Mamba).envelope
            } else {
                0
            },
        }
    }

    /// Builds the metadata of one step for `batch` (each request with the tokens this
    /// step computes: the last chunk of a prefill, or 1 for a decode) into `meta`, and
    /// uploads it to the cache's step table in one asynchronous op. Call it after every
    /// allocation of the step — an allocation may compact and move the pages metadata
    /// names — and read it through [`HybridCache::step_view`], which refuses it once any
    /// table changed.
    ///
    /// When the translation mirror is behind the host tables it is uploaded first (the
    /// step's mirror upload; the step boundary then uploads only what changed after), so
    /// device tables and metadata agree. Host work is O(the batch's rows); nothing waits
    /// for the device. The table is reused and only grows, by a device allocation, when a
    /// step needs more entries than any step before.
    ///
    /// Errors: a request of another cache, more new tokens than rows, a pending
    /// checkpoint before this step's tokens ([`Error::BadRequest`]), or a device error;
    /// then `meta` stays unreadable until the next successful build. A row inside the
    /// window whose SWA was released reads the sink and is counted as the breach
    /// `step.window_live`.
    pub fn build_step_metadata(
        &mut self,
        meta: &mut StepMetadata,
        batch: &[(&Request, usize)],
    ) -> Result<(), Error> {
        meta.built = None;
        meta.requests.clear();
        meta.checkpoints.clear();
        meta.image.clear();
        for &(req, new_tokens) in batch {
            self.check_request(req)?;
            if new_tokens > req.len() {
                return Err(Error::BadRequest {
                    request: req.id(),
                    reason: format!(
                        "step metadata for {new_tokens} new tokens but the request has {} rows",
                        req.len()
                    ),
                });
            }
            if let Some(w) = req
                .checkpoint_writes()
                .iter()
                .find(|w| w.at_len <= req.len() - new_tokens || w.at_len > req.len())
            {
                return Err(Error::BadRequest {
                    request: req.id(),
                    reason: format!(
                        "its pending checkpoint at {} is not among this step's {new_tokens} \
                         new tokens (rows {}..{})",
                        w.at_len,
                        req.len() - new_tokens,
                        req.len()
                    ),
                });
            }
            to_i32(req.id(), "row count", req.len())?;
        }
        self.sync_mirror()?;
        let window = self.model().window as usize;
        let has_swa = self.model().swa_layers > 0;
        let b = batch.len();
        let rows: usize = batch.iter().map(|(r, _)| r.len()).sum();
        let new: usize = batch.iter().map(|&(_, n)| n).sum();
        let swa_first = |req: &Request, n: usize| (req.len() - n + 1).saturating_sub(window);
        let swa_rows: usize = if has_swa {
            batch.iter().map(|&(r, n)| r.len() - swa_first(r, n)).sum()
        } else {
            0
        };
        let swa_new = if has_swa { new } else { 0 };
        let saves: usize = batch.iter().map(|(r, _)| r.checkpoint_writes().len()).sum();
        let mut l = DeviceLayout {
            batch: b,
            ..DeviceLayout::default()
        };
        let mut at = 0;
        let mut section = |n: usize| {
            let start = at;
            at += n;
            start
        };
        l.query_starts = section(b + 1);
        l.full_starts = section(b + 1);
        l.swa_starts = section(b + 1);
        l.swa_first = section(b);
        l.full_ids = section(rows);
        l.swa_ids = section(swa_rows);
        l.write_full = section(new);
        l.write_swa = section(swa_new);
        l.state_slots = section(b);
        l.checkpoint_starts = section(b + 1);
        l.checkpoint_slots = section(saves);
        l.checkpoint_at = section(saves);
        l.len = at;
        to_i32(u64::MAX, "step table length", l.len)?;
        meta.image.resize(l.len, 0);
        let img = &mut meta.image;
        let alloc = self.allocator();
        let (mut q, mut f, mut s, mut w) = (0usize, 0usize, 0usize, 0usize);
        let mut sink_rows = 0usize;
        for (i, &(req, n)) in batch.iter().enumerate() {
            let len = req.len();
            let row = req.row();
            img[l.query_starts + i] = q as i32;
            img[l.full_starts + i] = f as i32;
            img[l.swa_starts + i] = s as i32;
            let full = l.full_ids + f..l.full_ids + f + len;
            for (slot, &t) in img[full.clone()].iter_mut().zip(row) {
                *slot = alloc.kernel_id(Side::Full, t);
            }
            let write_full = l.write_full + w..l.write_full + w + n;
            img.copy_within(full.end - n..full.end, write_full.start);
            let (first, swa, write_swa) = if has_swa {
                let first = swa_first(req, n);
                let swa = l.swa_ids + s..l.swa_ids + s + (len - first);
                for (slot, &t) in img[swa.clone()].iter_mut().zip(&row[first..]) {
                    *slot = alloc.kernel_id(Side::Swa, t);
                }
                sink_rows += img[swa.clone()].iter().filter(|&&k| k == 0).count();
                let write_swa = l.write_swa + w..l.write_swa + w + n;
                img.copy_within(swa.end - n..swa.end, write_swa.start);
                s += len - first;
                (first, swa, write_swa)
            } else {
                (0, 0..0, 0..0)
            };
            img[l.swa_first + i] = first as i32;
            let state_slot = req.state_slot().and_then(|v| alloc.physical_slot(v));
            img[l.state_slots + i] = state_slot.unwrap_or(0) as i32;
            img[l.checkpoint_starts + i] = meta.checkpoints.len() as i32;
            let first_save = meta.checkpoints.len();
            for c in req.checkpoint_writes() {
                // A held slot is always bound; the sink stands in should one not be.
                let slot = alloc.physical_slot(c.slot).unwrap_or(0);
                let k = meta.checkpoints.len();
                img[l.checkpoint_slots + k] = slot as i32;
                img[l.checkpoint_at + k] = c.at_len as i32;
                meta.checkpoints.push(StepCheckpoint {
                    slot,
                    at_len: c.at_len,
                });
            }
            let checkpoints = first_save..meta.checkpoints.len();
            meta.requests.push(RequestMeta {
                request: req.id(),
                len,
                new_tokens: n,
                swa_first: first,
                full,
                swa,
                write_full,
                write_swa,
                state_slot,
                checkpoints,
            });
            q += n;
            f += len;
            w += n;
        }
        img[l.query_starts + b] = q as i32;
        img[l.full_starts + b] = f as i32;
        img[l.swa_starts + b] = s as i32;
        img[l.checkpoint_starts + b] = meta.checkpoints.len() as i32;
        self.invariant_scope()
            .expect(&WINDOW_LIVE, sink_rows == 0, || {
                format!("{sink_rows} SWA rows inside a window of this step were released")
            });
        meta.layout = l;
        meta.table = if l.len == 0 {
            None
        } else {
            Some(self.upload_step_table(&meta.image)?)
        };
        meta.built = Some((self.cache_id(), self.mirror_generation()));
        Ok(())
    }

    /// Reads `meta` if it is current: built by this cache, and no table changed since
    /// (no allocation, free, compaction or mirror upload after its build). Otherwise
    /// [`Error::StaleStepMetadata`] (or [`Error::UnbuiltStepMetadata`] for metadata
    /// never built here, or whose last build failed). O(1).
    pub fn step_view<'a>(&'a self, meta: &'a StepMetadata) -> Result<StepView<'a>, Error> {
        let Some((cache, built)) = meta.built else {
            return Err(Error::UnbuiltStepMetadata);
        };
        if cache != self.cache_id() {
            return Err(Error::UnbuiltStepMetadata);
        }
        self.check_current(Some(built))?;
        Ok(StepView { meta })
    }
}

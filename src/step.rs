//! Step metadata: what an attention kernel consumes for one batch of requests in one
//! step, with host-known shapes and no host sync, at a host cost independent of the
//! requests' context lengths.
//!
//! Each running request's row lives on the device as a **lane** of virtual pages
//! (`crate::tables`, lanes.rs): a step writes only the pages it added. One device table per step holds a
//! small header the host writes — per request its new tokens, page counts, window start
//! and lane, the write locations of its new tokens, its state slot and checkpoints:
//! O(batch + new tokens) — and the page tables kernels read, which one
//! [`unikv_kernels::Device::translate_lanes`] derives on the device from the lanes and
//! the `v2p` mirrors: the kernel id of the first token of every FULL page of the request
//! and of every SWA page of the window of its first new token (per token at page size 1;
//! per page, FlashInfer's `kv_indices` shape, with `last_page_len`, above it).
//! [`HybridCache::build_step_metadata_on_host`] builds the same table on the host, row
//! by row (the reference the device build is tested against, and the cost it replaces).
//!
//! Kernel ids name physical pages, which compaction moves inside any allocation, so
//! metadata is only readable while the tables it was built from are unchanged:
//! [`HybridCache::step_view`] checks the cache's mirror generation and refuses stale
//! metadata with [`Error::StaleStepMetadata`], and the view it returns borrows the cache,
//! so nothing can change the tables while it is read
//! (`metadata_built_before_a_compacting_allocation_is_refused_and_a_rebuild_names_the_moved_pages`).
//!
//! # The fixed layout
//! [`HybridCache::reserve_step_metadata`] fixes a [`StepCapacity`]: every section of the
//! step table is sized for it and the batch padded with empty runs, so every step within
//! it has the same offsets and a CUDA graph captured once reads them
//! (`a_reserved_capacity_gives_every_step_the_same_layout`); beyond it the shape grows by
//! doubling. Once reserved, a build issues no host sync and allocates nothing
//! (`step_metadata_from_the_lanes_issues_no_host_sync`).
//!
//! # A decode step as eager inputs and a graph replay
//! [`HybridCache::build_step_metadata`] is two halves an engine may issue apart:
//! [`HybridCache::build_step_inputs`] writes the step's data (the lanes' new pages, the
//! header, the mirror when behind: lists a CUDA graph cannot capture) and
//! [`HybridCache::translate_step_tables`] issues the one `translate_lanes` that writes the
//! page tables from them. That translation names only tables and shapes
//! ([`StepMetadata::page_table_translation`]), the same at every step of a reserved
//! capacity, so a graph captures it once and each step is the eager inputs plus one
//! replay; the table it leaves equals an uncaptured build's at every step
//! (`a_captured_step_translation_replays_every_decode_step`: 1,000 decode steps with
//! requests growing, finishing and admitted, on the CUDA backend's emulated driver).
//!
//! # Checks
//! - A load-back from the host tier is listed, page by page, in the `load_*` sections of
//!   the step that admitted it, host- and device-built alike, and in no later step
//!   (`load_backs_are_sections_of_the_step_table`).
//! - The device-built table equals the host-built one entry for entry after every step
//!   of the Mamba and speculative property tests (`tests/common`'s
//!   `assert_device_tables_match_host`), and the first cases pin worked examples
//!   (`metadata_names_the_host_kernel_ids_and_is_uploaded_in_one_op`).
//! - A window page below the request's window cursor that reads the sink counts as
//!   `step.window_live` (`a_window_below_the_window_cursor_is_a_window_live_breach`).
//! - A verify step's context comes from the same tables: the verifiers go into the
//!   step's batch with their reserved rows as new tokens (the tiny engine's `--spec`).
//! - `benches/step_cost.rs` prints the host cost of a whole decode step at batch 256
//!   (allocator, metadata, boundary) from 512 to 64k tokens of context, beside the
//!   host-built metadata's.

pub use crate::tables::StepCapacity;
use crate::tables::{DeviceTables, Shape, to_i32};

use crate::cache::HybridCache;
use crate::error::Error;
use crate::invariants_decl::WINDOW_LIVE;
use crate::request::Request;
use std::ops::Range;
use unikv_kernels::{LaneTranslate, TableId};
use unikv_pools::{KvAllocator, Side, VirtualToken};

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
    loaded: Vec<LoadedPage>,
    /// The header (and, built on the host, the page tables too).
    image: Vec<i32>,
    lanes: Vec<u32>,
    layout: DeviceLayout,
    table: Option<TableId>,
    /// The translation that writes the page tables from the lanes (empty when built on
    /// the host, or for an empty batch).
    translation: Vec<LaneTranslate>,
}

impl StepMetadata {
    /// Empty metadata (nothing readable until built).
    pub fn new() -> StepMetadata {
        StepMetadata::default()
    }

    /// The one [`unikv_kernels::Device::translate_lanes`] call that writes this step's
    /// FULL and SWA page tables on the device from the lanes
    /// ([`HybridCache::translate_step_tables`] issues it): which tables it reads and
    /// writes and its shapes, none of the step's data, which it reads from the device
    /// tables when it runs. Empty for host-built metadata and for an empty batch.
    ///
    /// Within a reserved capacity ([`HybridCache::reserve_step_metadata`]) it is the same
    /// every step, so a CUDA graph that captured it once serves every step whose
    /// translation equals the captured one: an engine compares this list with the one it
    /// captured after each [`HybridCache::build_step_inputs`], and captures again when
    /// they differ (the step grew past the capacity: new tables, a new layout).
    pub fn page_table_translation(&self) -> &[LaneTranslate] {
        &self.translation
    }
}

/// Where each section of the step's device table starts, in `i32` entries (host-known:
/// the sums of the batch's lengths). `B` is the batch size; every section follows the
/// batch order. A request of `len` rows has `⌈len / ps⌉` FULL pages; its SWA window
/// (rows `[swa_first, len)`) covers the pages `⌊swa_first / ps⌋ .. ⌈len / ps⌉`. Every
/// section before `full_pages` is the header the host writes (`header_len` entries); the
/// two page tables after it are written on the device.
///
/// | section | entries | what |
/// |---|---|---|
/// | `query_starts` | `B + 1` | prefix sums of new tokens (`cu_seqlens_q`) |
/// | `full_starts` | `B + 1` | prefix sums of FULL pages (`kv_indptr`) |
/// | `full_last` | `B` | rows in each request's last FULL page, `1..=ps` (`kv_last_page_len`) |
/// | `swa_starts` | `B + 1` | prefix sums of SWA window pages |
/// | `swa_first` | `B` | row position of each request's first SWA window row |
/// | `swa_first_page` | `B` | its page (`swa_first / ps`): where the window's pages start in the lane |
/// | `lanes` | `B` | each request's lane (the device row its pages are translated from) |
/// | `write_full` | `Σ new` | FULL kernel ids of the new tokens (`out_cache_loc`) |
/// | `write_swa` | `Σ new` | SWA kernel ids of the new tokens |
/// | `state_slots` | `B` | physical running state slot (0 without recurrent state) |
/// | `checkpoint_starts` | `B + 1` | prefix sums of the checkpoints each request saves |
/// | `checkpoint_slots` | `Σ checkpoints` | physical slot each checkpoint is saved to |
/// | `checkpoint_at` | `Σ checkpoints` | the row length whose state is saved there |
/// | `load_starts` | `B + 1` (host tier only) | prefix sums of the pages each request's load-back brought in this step |
/// | `load_full` | `Σ loaded` | FULL kernel id of each loaded page's first token |
/// | `load_swa` | `Σ loaded` (SWA only) | its SWA kernel id when its SWA came from the host, else 0 |
/// | `load_host_full` | `Σ loaded` | the host FULL unit it came from (see [`unikv_pools::HostGeometry`]) |
/// | `load_host_swa` | `Σ loaded` (SWA only) | the host SWA unit, −1 when none |
/// | `load_states` | `B` (host tier and recurrent only) | host state unit loaded into its running slot, −1 when none |
/// | `full_pages` | `Σ pages` | kernel id of each FULL page's first token (0: the sink) |
/// | `swa_pages` | `Σ window pages` | kernel id of each SWA window page's first token |
///
/// The kernel id of row `pos` is its page's entry plus `pos % ps` (the sink page's rows
/// are all the sink); at page size 1 the page tables are per-row kernel ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceLayout {
    /// Requests in the batch.
    pub batch: usize,
    /// Requests the table is laid out for (`B`): those past `batch` are padding, with
    /// empty runs and the sink for their state slot.
    pub max_batch: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Offset of `query_starts`.
    pub query_starts: usize,
    /// Offset of `full_starts`.
    pub full_starts: usize,
    /// Offset of `full_last`.
    pub full_last: usize,
    /// Offset of `swa_starts`.
    pub swa_starts: usize,
    /// Offset of `swa_first`.
    pub swa_first: usize,
    /// Offset of `swa_first_page`.
    pub swa_first_page: usize,
    /// Offset of `lanes`.
    pub lanes: usize,
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
    /// Offset of `load_starts`.
    pub load_starts: usize,
    /// Offset of `load_full`.
    pub load_full: usize,
    /// Offset of `load_swa`.
    pub load_swa: usize,
    /// Offset of `load_host_full`.
    pub load_host_full: usize,
    /// Offset of `load_host_swa`.
    pub load_host_swa: usize,
    /// Offset of `load_states`.
    pub load_states: usize,
    /// Offset of `full_pages`, and the length of the header the host writes.
    pub full_pages: usize,
    /// Offset of `swa_pages`.
    pub swa_pages: usize,
    /// Entries used (the table may be longer; the rest is stale).
    pub len: usize,
}

impl DeviceLayout {
    /// Entries the host writes (everything before the page tables).
    pub fn header_len(&self) -> usize {
        self.full_pages
    }
}

/// One request's part of the table, as ranges of it.
#[derive(Clone, Debug)]
struct RequestMeta {
    request: u64,
    len: usize,
    new_tokens: usize,
    swa_first: usize,
    full_pages: Range<usize>,
    swa_pages: Range<usize>,
    write_full: Range<usize>,
    write_swa: Range<usize>,
    state_slot: Option<u32>,
    checkpoints: Range<usize>,
    loaded: Range<usize>,
    loaded_state: Option<u32>,
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

/// A page a load-back brought from the host tier into a request's rows in this step:
/// its copy was issued at admission on the cache's device stream, before the step
/// metadata's upload, so a forward ordered after the metadata (as reading it requires)
/// is ordered after the load too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadedPage {
    /// Row position of the page's first token.
    pub at: usize,
    /// FULL kernel id of that token.
    pub full: i32,
    /// SWA kernel id of that token when its SWA came from the host, else 0.
    pub swa: i32,
    /// The host FULL unit it came from (see [`unikv_pools::HostGeometry`]).
    pub host_full: u32,
    /// The host SWA unit, when its SWA came from the host.
    pub host_swa: Option<u32>,
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

/// One request's metadata in a [`StepView`]. Its page tables are ranges of the device
/// table ([`StepView::device_table`], [`RequestStep::full_pages`],
/// [`RequestStep::swa_pages`]), read by kernels on the device; the host holds only what
/// is O(new tokens).
#[derive(Clone, Copy, Debug)]
pub struct RequestStep<'a> {
    /// The request's id.
    pub request: u64,
    /// Its rows after this step's allocation (the queries are the last `new_tokens`).
    pub len: usize,
    /// Tokens this step computes (the rows `[len − new_tokens, len)`).
    pub new_tokens: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// The device table's entry of its first FULL page (see
    /// [`RequestStep::full_pages`]).
    pub full_at: usize,
    /// Row position of its first SWA window row: the first row inside the window of the
    /// step's first new token (`len − new_tokens + 1 − W`, at least 0).
    pub swa_first: usize,
    /// The device table's entry of its first SWA window page (see
    /// [`RequestStep::swa_pages`]).
    pub swa_at: usize,
    /// Its SWA window pages (0 without SWA layers).
    pub swa_page_count: usize,
    /// FULL kernel ids where the new tokens' K/V is written.
    pub write_full: &'a [i32],
    /// SWA kernel ids where the new tokens' K/V is written (empty without SWA layers).
    pub write_swa: &'a [i32],
    /// The physical running state slot (`None` without recurrent layers).
    pub state_slot: Option<u32>,
    /// The checkpoints this step saves, in ascending position (see
    /// [`Request::checkpoint_writes`]).
    pub checkpoints: &'a [StepCheckpoint],
    /// The pages its admission loaded back from the host tier since the last step
    /// boundary, in row order.
    pub loaded: &'a [LoadedPage],
    /// The host state unit its admission loaded into its running slot.
    pub loaded_state: Option<u32>,
}

impl RequestStep<'_> {
    /// Row position of the step's first new token.
    pub fn first_query(&self) -> usize {
        self.len - self.new_tokens
    }

    /// Entries of the device table holding the kernel id of the first token of each of
    /// its FULL pages, rows `[0, len)`.
    pub fn full_pages(&self) -> Range<usize> {
        self.full_at..self.full_at + self.len.div_ceil(self.page_size)
    }

    /// Entries of the device table holding the kernel id of the first token of each SWA
    /// page from `swa_first`'s to its last (a released page reads the sink, which a
    /// correct run never asks for). Empty without SWA layers.
    pub fn swa_pages(&self) -> Range<usize> {
        self.swa_at..self.swa_at + self.swa_page_count
    }

    /// The FULL kernel id of row `pos` read from `table` (the device table's entries, as
    /// a kernel sees them), `None` at or past `len`.
    pub fn full_id(&self, table: &[i32], pos: usize) -> Option<i32> {
        (pos < self.len).then(|| self.row_id(table, self.full_at, pos))
    }

    /// The SWA kernel id of row `pos` read from `table`, `None` outside
    /// `[swa_first, len)` (and always without SWA layers).
    pub fn swa_id(&self, table: &[i32], pos: usize) -> Option<i32> {
        let first_page = self.swa_first / self.page_size;
        (pos >= self.swa_first && pos < self.len && self.swa_page_count > 0)
            .then(|| self.row_id(table, self.swa_at - first_page, pos))
    }

    /// Row `pos`'s kernel id from the page table whose page 0 would be at `at`.
    fn row_id(&self, table: &[i32], at: usize, pos: usize) -> i32 {
        match table[at + pos / self.page_size] {
            0 => 0,
            page => page.wrapping_add((pos % self.page_size) as i32),
        }
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
            page_size: self.meta.layout.page_size,
            full_at: m.full_pages.start,
            swa_first: m.swa_first,
            swa_at: m.swa_pages.start,
            swa_page_count: m.swa_pages.len(),
            write_full: &img[m.write_full.clone()],
            write_swa: &img[m.write_swa.clone()],
            state_slot: m.state_slot,
            checkpoints: &self.meta.checkpoints[m.checkpoints.clone()],
            loaded: &self.meta.loaded[m.loaded.clone()],
            loaded_state: m.loaded_state,
        }
    }

    /// Every request of the batch.
    pub fn requests(&self) -> impl Iterator<Item = RequestStep<'a>> + '_ {
        (0..self.len()).map(|i| self.request(i))
    }

    /// The device table the metadata was built in (`None` for an empty batch, which
    /// writes nothing). Reused across steps: the next build overwrites it in stream
    /// order, after the kernels that read this one.
    pub fn device_table(&self) -> Option<TableId> {
        self.meta.table
    }

    /// Where each section starts in the device table.
    pub fn device_layout(&self) -> DeviceLayout {
        self.meta.layout
    }

    /// The header the host wrote to the device table (`layout.header_len()` entries; the
    /// whole table, `layout.len` entries, when built on the host).
    pub fn host_image(&self) -> &'a [i32] {
        &self.meta.image
    }
}

/// Where the page tables are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageTables {
    /// On the device, from the lanes: host work O(batch + new tokens).
    Device,
    /// On the host, row by row, uploaded whole: the reference.
    Host,
}

/// The kernel id of the first token of page `page` of `row` on `side` (0: the sink).
fn page_id(
    alloc: &dyn KvAllocator,
    side: Side,
    row: &[VirtualToken],
    ps: usize,
    page: usize,
) -> i32 {
    alloc.kernel_id(side, row[page * ps])
}

impl HybridCache {
    /// Uploads a step's metadata image into the step table (one op), growing the table
    /// first when it is shorter than `len` entries (`image` is its first entries). A failed
    /// upload leaves the table as it was.
    fn upload_step_table(&mut self, image: &[i32], len: usize) -> Result<TableId, Error> {
        let (tables, device) = self.tables_mut();
        let table = DeviceTables::grow(device, &mut tables.step, len)?;
        device.upload_table(table, 0, image)?;
        Ok(table)
    }

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

    /// Shapes step metadata for `capacity` (set-up work: a device allocation of the
    /// lanes; the step table follows at the first build): no step within it allocates,
    /// and every step's table has the same layout, so a CUDA graph captured once reads
    /// it. Without it the first build shapes them for its batch, and a step beyond the
    /// capacity grows it (doubling; a new layout).
    pub fn reserve_step_metadata(&mut self, capacity: StepCapacity) -> Result<(), Error> {
        let ps = self.page_size();
        let shape = Shape {
            requests: capacity.requests,
            pages: capacity.max_len.div_ceil(ps),
            new_tokens: capacity.max_new_tokens,
            saves: capacity.requests * self.saves_per_request(),
            loads: capacity.max_loaded_pages,
        };
        let device = self.device_arc();
        self.lanes_mut().reserve(device.as_ref(), shape)
    }

    /// The most checkpoints one request saves in a step.
    fn saves_per_request(&self) -> usize {
        self.state_policy()
            .map_or(0, |p| p.checkpoints_per_step() as usize)
    }

    /// Grows the step's shape (lanes and table layout) when `batch` needs more than it
    /// holds: lanes for every request holding one after this batch, its longest row, its
    /// new tokens and checkpoints.
    fn shape_step(&mut self, batch: &[(&Request, usize)]) -> Result<(), Error> {
        let ps = self.page_size();
        let need = Shape {
            requests: self.lanes().held_with(batch.iter().map(|(r, _)| r.id())),
            pages: batch
                .iter()
                .map(|(r, _)| r.len().div_ceil(ps))
                .max()
                .unwrap_or(0),
            new_tokens: batch.iter().map(|&(_, n)| n).sum(),
            saves: batch.iter().map(|(r, _)| r.checkpoint_writes().len()).sum(),
            loads: self.loaded_pages(batch),
        };
        let shape = self.lanes().shape();
        if shape.holds(need) {
            return Ok(());
        }
        let mut grown = shape.grown_to(need);
        grown.saves = grown.saves.max(grown.requests * self.saves_per_request());
        let device = self.device_arc();
        self.lanes_mut().reserve(device.as_ref(), grown)
    }

    /// Pages the load-backs of `batch`'s requests brought in this step.
    fn loaded_pages(&self, batch: &[(&Request, usize)]) -> usize {
        batch
            .iter()
            .filter_map(|(r, _)| self.step_load(r.id()))
            .map(|l| l.plan.pages.len())
            .sum()
    }

    /// Builds the metadata of one step for `batch` (each request with the tokens this
    /// step computes: the last chunk of a prefill, or 1 for a decode) into `meta`. Call it
    /// after every allocation of the step — an allocation may compact and move the pages
    /// metadata names — and read it through [`HybridCache::step_view`], which refuses it
    /// once any table changed.
    ///
    /// The host writes each request's new pages into its lane (one scatter), uploads the
    /// header (see [`DeviceLayout`]) and issues one [`unikv_kernels::Device::translate_lanes`]
    /// that writes the FULL and SWA page tables on the device: host work
    /// O(batch + new tokens), whatever the context; nothing waits for the device. The
    /// translation mirror is uploaded first when it is behind the host tables. The step
    /// table and the lanes are reused and grow (a device allocation) only when a step
    /// needs more than any before ([`HybridCache::reserve_step_metadata`] sizes them at
    /// set-up).
    ///
    /// Errors: a request of another cache, more new tokens than rows, a pending checkpoint before this step's tokens ([`Error::BadRequest`]), or a device
    /// error; then `meta` stays unreadable until the next successful build. An SWA page
    /// inside a window that was released (it reads the sink) is the breach
    /// `step.window_live`; only the window's pages below the request's window cursor are
    /// looked up (above it the rows are the request's own), so a decode's costs nothing.
    pub fn build_step_metadata(
        &mut self,
        meta: &mut StepMetadata,
        batch: &[(&Request, usize)],
    ) -> Result<(), Error> {
        self.build_step(meta, batch, PageTables::Device)?;
        self.translate_step_tables(meta)
            .inspect_err(|_| meta.built = None)
    }

    /// The eager half of [`HybridCache::build_step_metadata`], for an engine that replays
    /// a CUDA graph each step: everything but the page tables — the lanes' new pages
    /// (one scatter), the header (one upload) and, when behind, the translation mirror,
    /// all per-step data a graph cannot capture. The page tables are written by
    /// [`HybridCache::translate_step_tables`] (its translation,
    /// [`StepMetadata::page_table_translation`], is what the graph captures), so a
    /// decode step is these inputs, then one replay of a graph that captured the
    /// translation once (`a_captured_step_translation_replays_every_decode_step`):
    ///
    /// ```
    /// use std::sync::Arc;
    /// use unikv::kernels::{CudaDevice, LaneTranslate};
    /// use unikv::{HybridCache, Layout, ModelSpec, StepCapacity, StepMetadata, TokenId};
    ///
    /// let cuda = Arc::new(CudaDevice::emulated()); // or `CudaDevice::new(0)?` on a GPU
    /// let mut cache = HybridCache::builder()
    ///     .model(ModelSpec::GPT_OSS_20B)
    ///     .page_size(16)
    ///     .memory_bytes(64 << 20)
    ///     .layout(Layout::Unified)
    ///     .device(cuda.clone())
    ///     .build()?;
    /// // Every step within the capacity has the same tables and layout.
    /// cache.reserve_step_metadata(StepCapacity {
    ///     requests: 8,
    ///     max_len: 4096,
    ///     max_new_tokens: 512,
    ///     max_loaded_pages: 0,
    /// })?;
    /// let hit = cache.match_prefix((0..300).map(TokenId).collect());
    /// let mut req = cache.admit(hit)?;
    /// cache.alloc_extend(&mut req, 300)?;
    /// let mut meta = StepMetadata::new();
    /// let (mut graph, mut captured) = (None, Vec::<LaneTranslate>::new());
    /// let mut captures = 0;
    /// for step in 0..20 {
    ///     let new_tokens = if step == 0 { 300 } else { 1 };
    ///     if step > 0 {
    ///         cache.alloc_decode(&mut [&mut req], &[TokenId(1000 + step)])?;
    ///     }
    ///     cache.build_step_inputs(&mut meta, &[(&req, new_tokens)])?; // eager
    ///     if graph.is_none() || captured != meta.page_table_translation() {
    ///         // At the first step (and after the capacity grew): capture again, with
    ///         // the engine's forward in a real engine.
    ///         captured = meta.page_table_translation().to_vec();
    ///         graph = Some(cuda.capture(|_| cache.translate_step_tables(&meta))?);
    ///         captures += 1;
    ///     }
    ///     if let Some(graph) = &graph {
    ///         cuda.launch_graph(graph)?; // writes this step's page tables
    ///     }
    ///     // ... the forward reads the step table ...
    ///     cache.step_boundary()?;
    ///     cuda.end_step()?;
    /// }
    /// assert_eq!(captures, 1);
    /// # Ok::<(), unikv::Error>(())
    /// ```
    ///
    /// The metadata is readable ([`HybridCache::step_view`]) as after a full build; its
    /// device table's page tables hold this step's values once the translation (eager or
    /// replayed) has run, in stream order. Errors as [`HybridCache::build_step_metadata`].
    pub fn build_step_inputs(
        &mut self,
        meta: &mut StepMetadata,
        batch: &[(&Request, usize)],
    ) -> Result<(), Error> {
        self.build_step(meta, batch, PageTables::Device)
    }

    /// Writes the page tables of `meta` (built by [`HybridCache::build_step_inputs`]) on
    /// the device: its [`StepMetadata::page_table_translation`], one
    /// [`unikv_kernels::Device::translate_lanes`], which reads the lanes, the header and
    /// the `v2p` mirrors when it runs. On a [`unikv_kernels::CudaDevice`] a graph may
    /// capture it ([`unikv_kernels::CudaDevice::capture`]) and replay it at every step
    /// whose translation equals the captured one. Issues nothing for host-built
    /// metadata or an empty batch.
    ///
    /// Errors: [`Error::UnbuiltStepMetadata`] for metadata not built by this cache,
    /// [`Error::StaleStepMetadata`] when a table changed since its build (the mirror the
    /// translation reads would not be the one the header was built for), or the
    /// device's error; nothing is issued then.
    pub fn translate_step_tables(&self, meta: &StepMetadata) -> Result<(), Error> {
        let Some((cache, built)) = meta.built else {
            return Err(Error::UnbuiltStepMetadata);
        };
        if cache != self.cache_id() {
            return Err(Error::UnbuiltStepMetadata);
        }
        self.check_current(Some(built))?;
        if meta.translation.is_empty() {
            return Ok(());
        }
        Ok(self.device().translate_lanes(&meta.translation)?)
    }

    /// [`HybridCache::build_step_metadata`] with the page tables built on the host, row by
    /// row, and the whole table uploaded: the same entries at O(the batch's pages) host
    /// work. The reference the device build is tested against, and the cost it replaces
    /// (`benches/step.rs` times both).
    pub fn build_step_metadata_on_host(
        &mut self,
        meta: &mut StepMetadata,
        batch: &[(&Request, usize)],
    ) -> Result<(), Error> {
        self.build_step(meta, batch, PageTables::Host)
    }

    fn build_step(
        &mut self,
        meta: &mut StepMetadata,
        batch: &[(&Request, usize)],
        tables: PageTables,
    ) -> Result<(), Error> {
        meta.built = None;
        meta.requests.clear();
        meta.checkpoints.clear();
        meta.loaded.clear();
        meta.image.clear();
        meta.translation.clear();
        self.check_step_batch(batch)?;
        self.sync_mirror()?;
        let ps = self.page_size();
        let window = self.model().window as usize;
        let has_swa = self.model().swa_layers > 0;
        let b = batch.len();
        let swa_first = |req: &Request, n: usize| (req.len() - n + 1).saturating_sub(window);
        let pages = |req: &Request| req.len().div_ceil(ps);
        let window_pages = |req: &Request, n: usize| {
            if has_swa {
                pages(req) - swa_first(req, n) / ps
            } else {
                0
            }
        };
        if b > 0 {
            self.shape_step(batch)?;
        }
        let shape = if b > 0 {
            self.lanes().shape()
        } else {
            Shape::default()
        };
        let lanes = match tables {
            PageTables::Device if b > 0 => {
                let device = self.device_arc();
                let rows = batch.iter().map(|(r, _)| (r.id(), r.row()));
                self.lanes_mut()
                    .sync(device.as_ref(), rows, ps, &mut meta.lanes)?;
                Some(&meta.lanes[..])
            }
            _ => None,
        };
        // Every section is sized by the shape, not by this batch, so every step has the
        // same layout (requests past the batch are padding: empty runs).
        let (bb, new) = (shape.requests, shape.new_tokens);
        let swa_new = if has_swa { new } else { 0 };
        let swa_capacity = if has_swa {
            bb * (window.div_ceil(ps) + 2) + new.div_ceil(ps)
        } else {
            0
        };
        let has_host = self.host_geometry().is_some();
        let has_state = self.model().has_recurrent_state();
        let loads = if has_host { shape.loads } else { 0 };
        let mut l = DeviceLayout {
            batch: b,
            max_batch: bb,
            page_size: ps,
            ..DeviceLayout::default()
        };
        if b > 0 {
            let mut at = 0;
            let mut section = |n: usize| {
                let start = at;
                at += n;
                start
            };
            l.query_starts = section(bb + 1);
            l.full_starts = section(bb + 1);
            l.full_last = section(bb);
            l.swa_starts = section(bb + 1);
            l.swa_first = section(bb);
            l.swa_first_page = section(bb);
            l.lanes = section(bb);
            l.write_full = section(new);
            l.write_swa = section(swa_new);
            l.state_slots = section(bb);
            l.checkpoint_starts = section(bb + 1);
            l.checkpoint_slots = section(shape.saves);
            l.checkpoint_at = section(shape.saves);
            l.load_starts = section(if has_host { bb + 1 } else { 0 });
            l.load_full = section(loads);
            l.load_swa = section(if has_swa { loads } else { 0 });
            l.load_host_full = section(loads);
            l.load_host_swa = section(if has_swa { loads } else { 0 });
            l.load_states = section(if has_host && has_state { bb } else { 0 });
            l.full_pages = section(bb * shape.pages);
            l.swa_pages = section(swa_capacity);
            l.len = at;
        }
        to_i32(u64::MAX, "step table length", "step", l.len)?;
        let written = match tables {
            PageTables::Device => l.header_len(),
            PageTables::Host => l.len,
        };
        meta.image.resize(written, 0);
        let img = &mut meta.image;
        let alloc = self.allocator();
        let (mut q, mut f, mut s, mut w) = (0usize, 0usize, 0usize, 0usize);
        let mut released = 0usize;
        for (i, &(req, n)) in batch.iter().enumerate() {
            let len = req.len();
            let row = req.row();
            let (full_n, swa_n) = (pages(req), window_pages(req, n));
            let first = if has_swa { swa_first(req, n) } else { 0 };
            img[l.query_starts + i] = q as i32;
            img[l.full_starts + i] = f as i32;
            img[l.full_last + i] = (len - (full_n.max(1) - 1) * ps) as i32;
            img[l.swa_starts + i] = s as i32;
            img[l.swa_first + i] = first as i32;
            img[l.swa_first_page + i] = (first / ps) as i32;
            img[l.lanes + i] = lanes.map_or(0, |lanes| lanes[i] as i32);
            let write_full = l.write_full + w..l.write_full + w + n;
            for (slot, &t) in img[write_full.clone()].iter_mut().zip(&row[len - n..]) {
                *slot = alloc.kernel_id(Side::Full, t);
            }
            let write_swa = if has_swa {
                let write_swa = l.write_swa + w..l.write_swa + w + n;
                for (slot, &t) in img[write_swa.clone()].iter_mut().zip(&row[len - n..]) {
                    *slot = alloc.kernel_id(Side::Swa, t);
                }
                write_swa
            } else {
                0..0
            };
            let full_pages = l.full_pages + f..l.full_pages + f + full_n;
            let swa_pages = l.swa_pages + s..l.swa_pages + s + swa_n;
            if tables == PageTables::Host {
                for (page, slot) in img[full_pages.clone()].iter_mut().enumerate() {
                    *slot = page_id(alloc, Side::Full, row, ps, page);
                }
                for (k, slot) in img[swa_pages.clone()].iter_mut().enumerate() {
                    *slot = page_id(alloc, Side::Swa, row, ps, first / ps + k);
                }
            }
            if has_swa {
                // Rows from the window cursor up are the request's own, with live SWA;
                // below it the request released its own and the tree holds the rest
                // (live while locked): only the window's pages there are looked up.
                let below = first..req.window_cursor().min(len);
                if !below.is_empty() {
                    released += (below.start / ps..below.end.div_ceil(ps))
                        .filter(|&page| page_id(alloc, Side::Swa, row, ps, page) == 0)
                        .count();
                }
            }
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
            let first_load = meta.loaded.len();
            let load = self.step_load(req.id());
            if has_host {
                img[l.load_starts + i] = first_load as i32;
            }
            for p in load.map_or(&[][..], |l| &l.plan.pages) {
                let k = meta.loaded.len();
                let page = LoadedPage {
                    at: p.at,
                    full: alloc.kernel_id(Side::Full, row[p.at]),
                    swa: match p.swa {
                        Some(_) => alloc.kernel_id(Side::Swa, row[p.at]),
                        None => 0,
                    },
                    host_full: p.full.0,
                    host_swa: p.swa.map(|s| s.0),
                };
                img[l.load_full + k] = page.full;
                img[l.load_host_full + k] = page.host_full as i32;
                if has_swa {
                    img[l.load_swa + k] = page.swa;
                    img[l.load_host_swa + k] = page.host_swa.map_or(-1, |u| u as i32);
                }
                meta.loaded.push(page);
            }
            let loaded_state = load.and_then(|l| l.plan.state).map(|s| s.0);
            if has_host && has_state {
                img[l.load_states + i] = loaded_state.map_or(-1, |u| u as i32);
            }
            let checkpoints = first_save..meta.checkpoints.len();
            meta.requests.push(RequestMeta {
                request: req.id(),
                len,
                new_tokens: n,
                swa_first: first,
                full_pages,
                swa_pages,
                write_full,
                write_swa,
                state_slot,
                checkpoints,
                loaded: first_load..meta.loaded.len(),
                loaded_state,
            });
            q += n;
            f += full_n;
            s += swa_n;
            w += n;
        }
        if b > 0 {
            // The batch's totals, and the padding requests' empty runs after them.
            let saved = meta.checkpoints.len();
            for (section, total) in [
                (l.query_starts, q),
                (l.full_starts, f),
                (l.swa_starts, s),
                (l.checkpoint_starts, saved),
            ] {
                img[section + b..=section + bb].fill(total as i32);
            }
            if has_host {
                img[l.load_starts + b..=l.load_starts + bb].fill(meta.loaded.len() as i32);
                if has_state {
                    img[l.load_states + b..l.load_states + bb].fill(-1);
                }
            }
        }
        self.invariant_scope()
            .expect(&WINDOW_LIVE, released == 0, || {
                format!("{released} SWA pages inside a window of this step were released")
            });
        meta.layout = l;
        meta.table = if l.len == 0 {
            None
        } else {
            let table = self.upload_step_table(&meta.image, l.len)?;
            if tables == PageTables::Device {
                self.page_table_translation(table, &l, &mut meta.translation);
            }
            Some(table)
        };
        meta.built = Some((self.cache_id(), self.mirror_generation()));
        Ok(())
    }

    /// The checks of a step's batch, before anything is written.
    fn check_step_batch(&self, batch: &[(&Request, usize)]) -> Result<(), Error> {
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
            to_i32(req.id(), "row count", "step", req.len())?;
        }
        Ok(())
    }

    /// The translation that writes the FULL and SWA page tables of the step table laid
    /// out as `l` from the lanes, on the device (one
    /// [`unikv_kernels::Device::translate_lanes`]), into `all`. Every field comes from
    /// the tables and the layout, so within a reserved capacity it is the same every step.
    fn page_table_translation(
        &self,
        table: TableId,
        l: &DeviceLayout,
        all: &mut Vec<LaneTranslate>,
    ) {
        let alloc = self.allocator();
        let lanes = self.lanes();
        let Some(rows) = lanes.table() else {
            return; // an empty batch: nothing to translate
        };
        let translation = |side: Side, firsts, starts, out_at, out_len| {
            Some(LaneTranslate {
                v2p: alloc.mirror_table(side)?,
                rows,
                lane_len: lanes.lane_len(),
                lanes: (table, l.lanes),
                firsts,
                starts: (table, starts),
                batch: l.max_batch,
                stride: alloc.stride(side),
                out: table,
                out_at,
                out_len,
            })
        };
        all.extend(translation(
            Side::Full,
            None,
            l.full_starts,
            l.full_pages,
            l.swa_pages - l.full_pages,
        ));
        if self.model().swa_layers > 0 {
            all.extend(translation(
                Side::Swa,
                Some((table, l.swa_first_page)),
                l.swa_starts,
                l.swa_pages,
                l.len - l.swa_pages,
            ));
        }
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

//! The `Device` trait: every op has a host-known output shape and none waits for the device.
//!
//! Waiting ops (read-backs) live on [`Readback`] and take a [`HostSync`] permit. Code on
//! the scheduling path (pools, mamba, radix, the facade's step methods) holds an
//! `Arc<dyn Device>`, a trait with no waiting op, so a host sync there does not compile.

use crate::Error;
use crate::export::ExportGuard;
use std::sync::Arc;

/// Handle to a byte buffer owned by a [`Device`] (the unified KV buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BytesId(pub u32);

/// Handle to an `i32` table owned by a [`Device`] (a `v2p` mirror, a row of virtual ids,
/// a kernel-id output).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableId(pub u32);

/// Handle to a host-tier buffer owned by a [`Device`] ([`Device::alloc_host`]): memory on
/// the host side that holds KV pages and recurrent states the GPU cannot (pinned memory
/// on [`CudaDevice`](crate::CudaDevice), chunked host memory on
/// [`CpuDevice`](crate::CpuDevice), a length only on [`NullDevice`](crate::NullDevice)).
/// Its bytes move to and from a device byte buffer only by stream-ordered copies
/// ([`Device::copy_device_to_host`], [`Device::copy_host_to_device`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostBytesId(pub u32);

/// One copy of a host-tier copy call ([`Device::copy_device_to_host`],
/// [`Device::copy_host_to_device`]): `len` bytes at byte `device` of the device byte
/// buffer and byte `host` of the host buffer, in the call's direction. Within one call
/// no two copies write overlapping ranges of the destination (empty copies are
/// ignored); sources may overlap, and source and destination are different buffers, so
/// the copies commute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostCopy {
    /// Byte offset in the device byte buffer.
    pub device: u64,
    /// Byte offset in the host buffer.
    pub host: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// Handle to a completion marker recorded after the work issued to a [`Device`] so far
/// ([`Device::record_copy_event`]): [`Device::copy_event_done`] asks, without waiting,
/// whether that work has completed (a write-back has reached its host buffer, so its
/// device pages may be reused; a load-back has reached the device). Released with
/// [`Device::free_copy_event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyEvent(pub u32);

/// One page-envelope copy inside a byte buffer: `len` bytes from `src` to `dst` (byte
/// offsets). Within one [`Device::move_spans`] call no destination overlaps another
/// destination or any source (its own or another move's); sources may overlap each
/// other. So the moves commute and a backend copies each in place, with no staging copy.
/// The pools keep this: compaction moves live pages into holes, and a float's slide moves
/// pages to fresh pages beyond its span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanMove {
    /// Source byte offset.
    pub src: u64,
    /// Destination byte offset.
    pub dst: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// A byte range `[offset, offset + len)` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSpan {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Arguments of [`Device::translate`]: virtual token ids → kernel ids.
///
/// For `i < n`: `out[i] = v2p[id / page_size] * stride + id % page_size` where
/// `id = ids[i]`, or `0` (the sink) when `id <= 0`, `id / page_size` is outside `v2p`,
/// or `v2p[id / page_size] <= 0` (unbound or tombstoned). For `n <= i < out_width`:
/// `out[i] = 0` (zero-filled tail, so a captured graph sees a fixed width).
///
/// The arithmetic is `i32` and wraps: callers keep every kernel id inside `i32` (the
/// pools check `physical pages × stride` at set-up, with host arithmetic). `out` must be
/// a table other than `v2p` and `ids`; `page_size > 0`, `stride` and `page_size` fit in
/// `i32`, `n <= out_width`, and the tables are long enough (`ids >= n`,
/// `out >= out_width`), or the op fails before writing anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Translate {
    /// The `v2p` mirror (physical page per virtual page).
    pub v2p: TableId,
    /// Virtual token ids to translate.
    pub ids: TableId,
    /// How many ids to translate.
    pub n: usize,
    /// Tokens per page.
    pub page_size: u32,
    /// Rows per page envelope across all layers (page-major layout).
    pub stride: u32,
    /// Output table.
    pub out: TableId,
    /// Width written to `out` (`>= n`).
    pub out_width: usize,
}

/// One window of a [`Device::translate_windows`] call: for each of `batch` requests, a
/// window of `width` consecutive entries of the request's row of virtual ids, starting at
/// a device-side offset, translated into kernel ids (a verify step's write ids: the
/// start is the accepted count of the request's earlier verify, known only on the device).
///
/// For `r < batch`, `j < width`: `s = starts[starts_at + r] + bias + j` (exact, in
/// `i64`) and `out[out_at + r * width + j]` is the translation of
/// `ids[ids_at + r * rows + s]` by the rule of [`Translate`], or `0` (the sink) when `s`
/// is outside `0..rows` or `j` is at or past the request's live length
/// `lens[lens_at + r]` (with `lens`; device data, so not an error).
///
/// `page_size > 0`, `page_size` and `stride` fit in `i32`, the tables are long enough
/// (`ids` for `batch × rows` entries from `ids_at`, `starts` and `lens` for `batch`,
/// `out` for `batch × width` from `out_at`), and `out` is none of the call's input
/// tables, or the op fails before writing anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowTranslate {
    /// The `v2p` mirror (physical page per virtual page).
    pub v2p: TableId,
    /// Each request's row of virtual ids, `rows` entries per request.
    pub ids: TableId,
    /// Where request 0's row starts in `ids`.
    pub ids_at: usize,
    /// Entries per request's row.
    pub rows: usize,
    /// Each request's window start (device values).
    pub starts: TableId,
    /// Where request 0's start is in `starts`.
    pub starts_at: usize,
    /// Added to every start (host-known).
    pub bias: i32,
    /// Each request's live length (device values: `(table, index of request 0)`):
    /// entries `j >= lens[r]` of its window are the sink (a verify's positions past its
    /// draft's width). `None`: every entry is live.
    pub lens: Option<(TableId, usize)>,
    /// Requests.
    pub batch: usize,
    /// Entries of each request's window.
    pub width: usize,
    /// Tokens per page.
    pub page_size: u32,
    /// Rows per page envelope across all layers (page-major layout).
    pub stride: u32,
    /// Output table.
    pub out: TableId,
    /// Where request 0's window is written in `out`.
    pub out_at: usize,
}

/// One gather of a [`Device::gather_rows`] call: moves the rows of each request's accepted draft
/// tree path to consecutive positions, driven by device values (a tree verify's
/// settlement: the host never learns the path).
///
/// Request `r` has `width` kernel ids `ids[ids_at + r * width ..]` (its verify positions,
/// translated) and `width` path entries `path[path_at + r * width ..]`: the accepted
/// nodes in order, ended by the first entry outside `0..width`. For `i = 0, 1, …` in
/// order while `p = path[i]` is in `0..width`, the token rows of position `p` are copied
/// to those of position `i`: rows `l < rows_per_token` of a token with kernel id `k` are
/// the `row_bytes` bytes at `(k + l × page_size) × row_bytes` of `buf`. A step whose ids
/// are equal or not positive (the sink, padding) copies nothing, nor does a row that
/// reaches past `buf` (device data, so not an error). The order is the path's: a node of
/// a root-to-node path has an index at least its position, so a source is read before a
/// later step overwrites it.
///
/// `page_size > 0`, the tables are long enough (`batch × width` entries from `ids_at` and
/// from `path_at`) and a row's byte offset fits in `u64` for every `i32` kernel id, or
/// the op fails before writing anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowGather {
    /// The buffer holding the rows.
    pub buf: BytesId,
    /// Kernel ids of every request's positions, `width` per request.
    pub ids: TableId,
    /// Where request 0's ids start in `ids`.
    pub ids_at: usize,
    /// Accepted paths, `width` entries per request (device values).
    pub path: TableId,
    /// Where request 0's path starts in `path`.
    pub path_at: usize,
    /// Requests.
    pub batch: usize,
    /// Positions per request.
    pub width: usize,
    /// Tokens per page (the distance, in rows, between a token's rows of two layers).
    pub page_size: u32,
    /// Rows per token (every layer's K and V rows on this side).
    pub rows_per_token: u32,
    /// Bytes per row.
    pub row_bytes: u64,
}

/// One translation of a [`Device::translate_lanes`] call: for each of `batch` requests, a
/// run of its **lane** — its persistent row of virtual pages, `lane_len` entries of
/// `rows` — translated into the kernel ids of those pages' first tokens, at output
/// offsets the device reads (a step's FULL page table or SWA window: the host writes only
/// a request's new pages into its lane, so its work per step is independent of context).
///
/// For `r < batch`: lane `l = lanes[lanes_at + r]`, first entry `f = firsts[firsts_at + r]`
/// (0 without `firsts`), output start `o = starts[starts_at + r]` and count
/// `c = starts[starts_at + r + 1] − o`. For `j < c`, `out[out_at + o + j]` is the
/// translation of virtual page `p = rows[l × lane_len + f + j]`: `v2p[p] × stride` (the
/// kernel id of the page's first token; at page size 1, of the token), or `0` (the sink)
/// when `p <= 0`, `p` is outside `v2p`, `v2p[p] <= 0`, `f + j` is outside `0..lane_len` or
/// `l` is outside `0..rows.len() / lane_len` (the whole lanes `rows` holds: a partial lane
/// at its end is none). An entry whose output index `o + j` is outside `0..out_len` is
/// not written, and a run with `c <= 0` writes nothing (device data, so not an error);
/// only the entries inside `0..out_len` cost work, however far the device values reach.
/// Runs of two requests that overlap (device data again) give a slot two writers: the
/// CPU keeps the later request's, a GPU either. The arithmetic is `i32` and wraps, as
/// [`Translate`]'s.
///
/// `lane_len > 0`, `stride` fits in `i32`, the tables are long enough (`lanes` and
/// `firsts` for `batch` entries, `starts` for `batch + 1`, `out` for `out_len` from
/// `out_at`), no translation's `out` is the `v2p` or `rows` table of any translation of
/// the call, and `out`'s range overlaps no input range of the call (`lanes`, `firsts`,
/// `starts`, its own or another translation's) nor another translation's output, or the
/// op fails before writing anything: [`Error::OutOfBounds`] for a short table,
/// [`Error::UnknownHandle`] for a table that is not allocated, [`Error::BadArguments`]
/// for the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneTranslate {
    /// The `v2p` mirror (physical page per virtual page).
    pub v2p: TableId,
    /// The lanes: `lane_len` virtual pages per lane.
    pub rows: TableId,
    /// Entries per lane.
    pub lane_len: usize,
    /// Each request's lane (device values, `batch` from the index).
    pub lanes: (TableId, usize),
    /// Each request's first lane entry (device values, `batch` from the index); `None`:
    /// every request starts at entry 0.
    pub firsts: Option<(TableId, usize)>,
    /// Prefix sums of the outputs (device values, `batch + 1` from the index).
    pub starts: (TableId, usize),
    /// Requests.
    pub batch: usize,
    /// Rows per page envelope across all layers (the kernel id of a page's first token
    /// is its physical page × `stride`).
    pub stride: u32,
    /// Output table.
    pub out: TableId,
    /// Where output 0 is in `out`.
    pub out_at: usize,
    /// Output entries this translation may write (from `out_at`).
    pub out_len: usize,
}

/// One table's entries of a [`Device::scatter_tables`] call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableScatter<'a> {
    /// The table written.
    pub table: TableId,
    /// Its `(index, value)` pairs, as for [`Device::scatter_table`].
    pub entries: &'a [(u32, i32)],
}

/// One table's spans of a [`Device::copy_table_spans`] call: for each `(start, len)` of
/// `spans`, entries `start..start + len` of `table` become those of `values` (the host
/// table the device one mirrors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableSpans<'a> {
    /// The table written.
    pub table: TableId,
    /// The host values, indexed as the table is.
    pub values: &'a [i32],
    /// `(start, len)` spans of entries to copy; they may overlap (they copy the same
    /// values).
    pub spans: &'a [(u32, u32)],
}

/// Where an exported table's memory lives ([`TableExport::device`]): DLPack's
/// `DLDevice`, less the kinds unikv has no backend for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExportDevice {
    /// Host memory ([`CpuDevice`](crate::CpuDevice)): DLPack's `kDLCPU`.
    Cpu,
    /// Memory of CUDA GPU `ordinal` ([`CudaDevice`](crate::CudaDevice)): DLPack's
    /// `kDLCUDA`.
    Cuda {
        /// The GPU's ordinal.
        ordinal: usize,
    },
    /// An address of [`CudaDevice::emulated`](crate::CudaDevice::emulated)'s device
    /// memory: it names the table inside the emulation and cannot be dereferenced.
    EmulatedCuda,
}

/// A table's memory, for a reader that reads it in place (DLPack, an engine's kernel):
/// from [`Device::export_table`].
///
/// # Lifetime
/// - **Address.** A table never moves while it lives, so the address stays valid until
///   the table is freed. The facade frees a table when it replaces it by a larger one
///   (a build of step or verify metadata beyond every earlier one); reserving the
///   shapes first (`reserve_step_metadata`, `reserve_verify_metadata`) fixes the sizes,
///   so later builds reuse the same tables. Memory of a table freed while this export's
///   `guard` lives is kept (no longer written) until the guard drops; the device's drop
///   releases it regardless.
/// - **Contents.** The entries are what the ops issued so far wrote, in stream order:
///   on the host at once ([`ExportDevice::Cpu`]: read between calls, never while another
///   thread runs an op on the table), on a GPU once the reader's stream is ordered
///   after the device's work ([`Device::make_stream_wait`]). Read-only by contract:
///   the device writes the table at its next op that names it.
#[derive(Clone, Debug)]
pub struct TableExport {
    /// The first entry's address (host pointer or `CUdeviceptr`); non-null and aligned
    /// to 4 bytes (an empty table's is dangling).
    pub address: u64,
    /// The table's length in `i32` entries (all of it).
    pub len: usize,
    /// Where the memory lives.
    pub device: ExportDevice,
    /// Keeps the memory allocated while it lives (see the lifetime rules above).
    pub guard: Arc<ExportGuard>,
}

/// The ops of [`Device`] and [`Readback`], one per trait method: what an
/// [`Intercepted`](crate::Intercepted) device shows its hooks (a
/// [`FaultInjector`](crate::FaultInjector) fails ops by kind, a
/// [`SyncLedger`](crate::SyncLedger) records them by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceOp {
    /// [`Device::alloc_bytes`].
    AllocBytes,
    /// [`Device::alloc_table`].
    AllocTable,
    /// [`Device::free_bytes`].
    FreeBytes,
    /// [`Device::free_table`].
    FreeTable,
    /// [`Device::upload_table`].
    UploadTable,
    /// [`Device::scatter_table`].
    ScatterTable,
    /// [`Device::gather_table`].
    GatherTable,
    /// [`Device::fill_spans`].
    FillSpans,
    /// [`Device::move_spans`].
    MoveSpans,
    /// [`Device::translate`].
    Translate,
    /// [`Device::scatter_tables`].
    ScatterTables,
    /// [`Device::translate_many`].
    TranslateMany,
    /// [`Device::copy_table_spans`].
    CopyTableSpans,
    /// [`Device::translate_windows`].
    TranslateWindows,
    /// [`Device::gather_rows`].
    GatherRows,
    /// [`Device::translate_lanes`].
    TranslateLanes,
    /// [`Device::make_stream_wait`].
    MakeStreamWait,
    /// [`Device::alloc_host`].
    AllocHost,
    /// [`Device::free_host`].
    FreeHost,
    /// [`Device::copy_device_to_host`].
    CopyDeviceToHost,
    /// [`Device::copy_host_to_device`].
    CopyHostToDevice,
    /// [`Device::record_copy_event`].
    RecordCopyEvent,
    /// [`Device::copy_event_done`].
    CopyEventDone,
    /// [`Device::free_copy_event`].
    FreeCopyEvent,
    /// [`Readback::read_table`].
    ReadTable,
    /// [`Readback::read_bytes`].
    ReadBytes,
    /// [`Readback::synchronize`].
    Synchronize,
    /// [`Readback::read_host`].
    ReadHost,
}

impl DeviceOp {
    /// The trait method's name (`move_spans`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            DeviceOp::AllocBytes => "alloc_bytes",
            DeviceOp::AllocTable => "alloc_table",
            DeviceOp::FreeBytes => "free_bytes",
            DeviceOp::FreeTable => "free_table",
            DeviceOp::UploadTable => "upload_table",
            DeviceOp::ScatterTable => "scatter_table",
            DeviceOp::GatherTable => "gather_table",
            DeviceOp::FillSpans => "fill_spans",
            DeviceOp::MoveSpans => "move_spans",
            DeviceOp::Translate => "translate",
            DeviceOp::ScatterTables => "scatter_tables",
            DeviceOp::TranslateMany => "translate_many",
            DeviceOp::CopyTableSpans => "copy_table_spans",
            DeviceOp::TranslateWindows => "translate_windows",
            DeviceOp::GatherRows => "gather_rows",
            DeviceOp::TranslateLanes => "translate_lanes",
            DeviceOp::MakeStreamWait => "make_stream_wait",
            DeviceOp::AllocHost => "alloc_host",
            DeviceOp::FreeHost => "free_host",
            DeviceOp::CopyDeviceToHost => "copy_device_to_host",
            DeviceOp::CopyHostToDevice => "copy_host_to_device",
            DeviceOp::RecordCopyEvent => "record_copy_event",
            DeviceOp::CopyEventDone => "copy_event_done",
            DeviceOp::FreeCopyEvent => "free_copy_event",
            DeviceOp::ReadTable => "read_table",
            DeviceOp::ReadBytes => "read_bytes",
            DeviceOp::Synchronize => "synchronize",
            DeviceOp::ReadHost => "read_host",
        }
    }

    /// Whether the op is a [`Readback`] one: it waits for the device. The host-tier
    /// copies and [`Device::copy_event_done`] do not (a copy is enqueued, an event is
    /// queried); [`Readback::read_host`] does.
    pub const fn waits(self) -> bool {
        matches!(
            self,
            DeviceOp::ReadTable | DeviceOp::ReadBytes | DeviceOp::Synchronize | DeviceOp::ReadHost
        )
    }

    /// Whether the op brings device data back to the host, where it can size a later op
    /// (a data-dependent shape): the reads of [`Readback`] (a host buffer holds what
    /// copies from the device wrote, so [`Readback::read_host`] is one).
    pub const fn returns_device_data(self) -> bool {
        matches!(
            self,
            DeviceOp::ReadTable | DeviceOp::ReadBytes | DeviceOp::ReadHost
        )
    }
}

/// Device work with host-known output shapes, issued in stream order; nothing here
/// waits for the device. Errors are for caller mistakes (bad handle, out of bounds) and
/// for device failures; they are detected on the host before any work is issued, so an
/// op that fails has changed nothing.
///
/// Every op is `#[track_caller]` (also through `dyn Device`), so a recording wrapper such
/// as [`SyncLedger`](crate::SyncLedger) sees the caller's file and line.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// A short name for reports (`cpu`, `cuda:0`, `ledger(cpu)`).
    fn name(&self) -> String;

    /// Allocates a byte buffer of `len` bytes, every byte set to `fill` (set-up, not
    /// scheduling path).
    #[track_caller]
    fn alloc_bytes(&self, len: u64, fill: u8) -> Result<BytesId, Error>;

    /// Allocates an `i32` table of `len` entries set to `fill` (set-up).
    #[track_caller]
    fn alloc_table(&self, len: usize, fill: i32) -> Result<TableId, Error>;

    /// Releases a buffer (set-up / tear-down).
    #[track_caller]
    fn free_bytes(&self, buf: BytesId) -> Result<(), Error>;

    /// Releases a table (set-up / tear-down).
    #[track_caller]
    fn free_table(&self, table: TableId) -> Result<(), Error>;

    /// Writes `values` at `offset..offset + values.len()` of `table`. The host slice is
    /// staged before returning, so the caller may reuse it at once.
    #[track_caller]
    fn upload_table(&self, table: TableId, offset: usize, values: &[i32]) -> Result<(), Error>;

    /// Scatters `(index, value)` pairs into `table` (the per-step mirror upload of dirty
    /// table entries: one op however many entries). Staged like [`Device::upload_table`].
    /// When an index appears more than once, the last pair wins.
    #[track_caller]
    fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), Error>;

    /// [`Device::scatter_table`] for several tables in one op: the per-step mirror upload
    /// of every side is one launch on a GPU. Pairs apply in order across the whole call,
    /// so when a table's index appears more than once the last pair wins. Every index of
    /// every table is checked before anything is written.
    #[track_caller]
    fn scatter_tables(&self, scatters: &[TableScatter<'_>]) -> Result<(), Error>;

    /// Copies spans of host tables into device tables, several tables in one op: the
    /// per-step mirror upload of a pool that keeps its tables on the host, sized by the
    /// spans that changed (a page-size-1 prefill is one span, not one entry per token).
    /// Staged like [`Device::upload_table`]. Every span of every table is checked inside
    /// both the table and its values before anything is written.
    #[track_caller]
    fn copy_table_spans(&self, copies: &[TableSpans<'_>]) -> Result<(), Error>;

    /// `out[i] = src[indices[i]]` for `i < n`, or `0` when `indices[i]` is outside `src`
    /// (negative or too large; device data, so not an error). `out` must be a table
    /// other than `src` and `indices`.
    #[track_caller]
    fn gather_table(
        &self,
        src: TableId,
        indices: TableId,
        n: usize,
        out: TableId,
    ) -> Result<(), Error>;

    /// Sets every byte of each span of `buf` to `value` (zeroing page envelopes on
    /// hand-out, poisoning freed ones).
    #[track_caller]
    fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], value: u8) -> Result<(), Error>;

    /// Copies page envelopes inside `buf` (compaction). No destination may overlap
    /// another destination or any source (see [`SpanMove`]), so the order of the copies
    /// does not matter. A call that breaks this, or reaches outside `buf`, fails with
    /// [`Error::OverlappingMoves`] or [`Error::OutOfBounds`] before anything is written.
    #[track_caller]
    fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), Error>;

    /// Translates virtual token ids into kernel ids (see [`Translate`]).
    #[track_caller]
    fn translate(&self, args: &Translate) -> Result<(), Error>;

    /// Several [`Device::translate`]s in one op (a step's translation of every side: one
    /// launch on a GPU). Every one is checked before any is issued; no output may be an
    /// input of another or another's output.
    #[track_caller]
    fn translate_many(&self, all: &[Translate]) -> Result<(), Error>;

    /// Translates windows of virtual ids that start at device-side offsets (see
    /// [`WindowTranslate`]), several in one op (a verify step's write ids and state
    /// slots: one launch on a GPU). Every one is checked before any is written; no
    /// output may be an input table of the call or overlap another's output.
    #[track_caller]
    fn translate_windows(&self, all: &[WindowTranslate]) -> Result<(), Error>;

    /// Moves accepted draft-tree rows to consecutive positions (see [`RowGather`]),
    /// several gathers in one op (a verify's FULL and SWA rows), applied in call order.
    /// Every one is checked before any is issued, so a refused call copies nothing.
    #[track_caller]
    fn gather_rows(&self, all: &[RowGather]) -> Result<(), Error>;

    /// Translates runs of persistent lanes of virtual pages at device-side offsets (see
    /// [`LaneTranslate`]), several in one op (a step's FULL page table and SWA window: one
    /// launch on a GPU). Every one is checked before any is written.
    #[track_caller]
    fn translate_lanes(&self, all: &[LaneTranslate]) -> Result<(), Error>;

    /// Allocates a host-tier buffer of `len` bytes, every byte zero (set-up, not
    /// scheduling path): pinned memory on a GPU backend, so copies to and from it are
    /// truly asynchronous.
    ///
    /// Errors: [`Error::OutOfMemory`] when the host cannot provide it.
    #[track_caller]
    fn alloc_host(&self, len: u64) -> Result<HostBytesId, Error>;

    /// Releases a host-tier buffer (set-up / tear-down). Copies already issued that use
    /// it still complete: a backend whose copies run later keeps the memory until they
    /// have (the release never waits).
    ///
    /// Errors: [`Error::UnknownHandle`] (kind `host bytes`).
    #[track_caller]
    fn free_host(&self, host: HostBytesId) -> Result<(), Error>;

    /// Copies ranges of the device byte buffer `buf` into the host buffer `host` (a
    /// write-back), in stream order after the work issued so far; never waits. The
    /// copied device bytes may be overwritten by ops issued after this call (stream
    /// order keeps the copy ahead of them); the host bytes are there once an event
    /// recorded after it is done ([`Device::record_copy_event`]).
    ///
    /// Every copy is checked on the host first, and a refused call issues nothing:
    /// [`Error::UnknownHandle`] for an unknown buffer (`buf` is looked up first),
    /// [`Error::OutOfBounds`] for a range outside `buf` (kind `bytes`) or `host` (kind
    /// `host bytes`), checked copy by copy, device side first, and
    /// [`Error::OverlappingCopies`] when two copies write overlapping host ranges.
    #[track_caller]
    fn copy_device_to_host(
        &self,
        buf: BytesId,
        host: HostBytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error>;

    /// Copies ranges of the host buffer `host` into the device byte buffer `buf` (a
    /// load-back), in stream order after the work issued so far (a write-back into the
    /// same host range included); never waits. Ops issued after it see the bytes.
    ///
    /// Checked as [`Device::copy_device_to_host`] (`host` is looked up first; each
    /// copy's device range, then its host range); [`Error::OverlappingCopies`] when two
    /// copies write overlapping device ranges.
    #[track_caller]
    fn copy_host_to_device(
        &self,
        host: HostBytesId,
        buf: BytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error>;

    /// Records an event after all the work issued to this device so far; issues, never
    /// waits. [`Device::copy_event_done`] asks whether that work has completed.
    #[track_caller]
    fn record_copy_event(&self) -> Result<CopyEvent, Error>;

    /// Whether everything issued before `event` was recorded has completed: a query
    /// that never waits (`cuEventQuery` on a GPU; always `true` on a host backend, whose
    /// ops complete when they return). A `true` stays `true`.
    ///
    /// Errors: [`Error::UnknownHandle`] (kind `copy event`).
    #[track_caller]
    fn copy_event_done(&self, event: CopyEvent) -> Result<bool, Error>;

    /// Releases an event (pending or not: the work before it still completes).
    ///
    /// Errors: [`Error::UnknownHandle`] (kind `copy event`).
    #[track_caller]
    fn free_copy_event(&self, event: CopyEvent) -> Result<(), Error>;

    /// The memory of `table`, to read in place without a copy (see [`TableExport`] for
    /// how long the address and the contents hold). Issues nothing and waits for nothing.
    ///
    /// Errors: [`Error::UnknownHandle`] for a table that is not allocated;
    /// [`Error::NotExportable`] on a backend whose tables have no memory to read (the
    /// default: [`NullDevice`](crate::NullDevice)).
    fn export_table(&self, table: TableId) -> Result<TableExport, Error> {
        let _ = table;
        Err(Error::NotExportable {
            device: self.name(),
        })
    }

    /// Makes the work enqueued on `consumer` from now on run after every op issued to
    /// this device so far, without the host waiting: on a GPU an event recorded on the
    /// device's stream, waited for by `consumer` (`cuStreamWaitEvent`); nothing on a host
    /// backend, whose ops are done when they return (the default). What a reader of a
    /// [`TableExport`] on another stream calls first. `consumer` may be this device's own
    /// stream (then nothing is needed) or one of the CUDA handles `CU_STREAM_LEGACY`
    /// (`0x1`) and `CU_STREAM_PER_THREAD` (`0x2`).
    ///
    /// # Safety
    /// On a GPU backend, `consumer` is a valid stream of the same GPU's primary context
    /// (or one of the special handles above), alive during the call. Host backends never
    /// use it.
    #[track_caller]
    unsafe fn make_stream_wait(&self, consumer: crate::RawStream) -> Result<(), Error> {
        let _ = consumer;
        Ok(())
    }

    /// The driver calls that may have made the host wait (allocation, free, pageable
    /// copy, synchronize, the legacy default stream) this device has issued so far, for
    /// [`SyncLedger`](crate::SyncLedger) to charge to the op that issued them. Host
    /// backends issue none; [`CudaDevice`](crate::CudaDevice) counts its own.
    fn sync_hazards(&self) -> crate::SyncHazards {
        crate::SyncHazards::default()
    }

    /// Whether the buffers it allocates hold bytes (every backend but
    /// [`NullDevice`](crate::NullDevice), which keeps lengths only).
    fn holds_bytes(&self) -> bool {
        true
    }
}

/// A capability to wait for the device. Only [`Readback`] methods take one, and
/// scheduling-path code holds a `dyn Device`, which has none; so a permit there buys
/// nothing. Obtain one in tests, tools and off-path diagnostics with [`HostSync::acquire`].
#[derive(Debug)]
pub struct HostSync {
    reason: &'static str,
}

impl HostSync {
    /// A permit to wait for the device, for the stated off-scheduling-path `reason`.
    pub fn acquire(reason: &'static str) -> HostSync {
        HostSync { reason }
    }

    /// Why the permit was taken.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

/// Ops that wait for the device (read-backs). Each takes a [`HostSync`] permit.
///
/// `dyn Device` does not implement `Readback`, so code that holds one cannot wait, even
/// with a permit and the trait in scope:
///
/// ```compile_fail
/// use unikv_kernels::{Device, HostSync, Readback, TableId};
///
/// fn scheduling_path(dev: &dyn Device, table: TableId) {
///     let sync = HostSync::acquire("not allowed here");
///     let _ = dev.read_table(&sync, table, 0, 1); // no `read_table` on `dyn Device`
/// }
/// ```
pub trait Readback: Device {
    /// Waits for all issued work, then copies `len` entries of `table` from `offset`.
    #[track_caller]
    fn read_table(
        &self,
        sync: &HostSync,
        table: TableId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<i32>, Error>;

    /// Waits for all issued work, then copies `len` bytes of `buf` from `offset`.
    #[track_caller]
    fn read_bytes(
        &self,
        sync: &HostSync,
        buf: BytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error>;

    /// Waits for all issued work.
    #[track_caller]
    fn synchronize(&self, sync: &HostSync) -> Result<(), Error>;

    /// Waits for all issued work (copies into `host` included), then copies `len` bytes
    /// of the host buffer `host` from `offset`.
    ///
    /// Errors: [`Error::UnknownHandle`] (kind `host bytes`), [`Error::OutOfBounds`].
    #[track_caller]
    fn read_host(
        &self,
        sync: &HostSync,
        host: HostBytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error>;
}

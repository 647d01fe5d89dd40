//! The crate's error type: every failure a caller can cause, each leaving the allocator
//! exactly as it was.

use crate::ids::{Bytes, VirtualPage, VirtualToken};

/// Everything the pools report. An operation that returns one of these changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration that cannot describe a pool (zero sizes, a ratio out of range).
    #[error("bad pool configuration: {0}")]
    BadConfig(String),
    /// The buffer cannot hold one request at batch size 1 (the sink plus one window of
    /// SWA and its FULL pages, and/or the Mamba states of one request): the batch-size-1
    /// floor. Failing at boot avoids a retract loop at run time.
    #[error("buffer of {have} cannot hold one request: the sink floor and {floor} need {needed}")]
    BufferTooSmall {
        /// Bytes needed.
        needed: Bytes,
        /// Bytes given.
        have: Bytes,
        /// What one request needs.
        floor: Bs1Floor,
    },
    /// A kernel id (`physical page × stride + offset`) of this layout would not fit in i32.
    #[error(
        "{side}: {pages} pages × stride {stride} do not fit kernel ids in i32 (a budget of at \
         most {largest_bytes} bytes keeps every side's ids in range)"
    )]
    KernelIdOverflow {
        /// `full`, `swa` or `mamba`.
        side: &'static str,
        /// Pages of the grid.
        pages: u64,
        /// Rows per page envelope.
        stride: u64,
        /// The largest buffer whose grids, on every side of the layout, keep their
        /// kernel ids in i32: the budget to give instead.
        largest_bytes: u64,
    },
    /// Not enough capacity for the demand; nothing was allocated.
    #[error(
        "out of capacity: {full_pages} FULL and {swa_pages} SWA pages requested, {available_pages} joint pages available now"
    )]
    OutOfCapacity {
        /// FULL pages asked for.
        full_pages: usize,
        /// SWA pages asked for.
        swa_pages: usize,
        /// Pages a symmetric allocation could get now (after compaction).
        available_pages: usize,
    },
    /// Not enough Mamba state slots (virtual slots, or bytes for their envelopes) for the
    /// demand; nothing was allocated.
    #[error("out of Mamba state slots: {requested} requested, {available} available now")]
    OutOfSlots {
        /// Slots asked for.
        requested: usize,
        /// Slots an allocation could get now (after compaction).
        available: usize,
    },
    /// A virtual token id outside this allocator's id space.
    #[error("virtual token {token} is outside the id space ({pages} virtual pages)")]
    TokenOutOfRange {
        /// The token.
        token: VirtualToken,
        /// Virtual pages of the id space.
        pages: u32,
    },
    /// A segment (or kv-row range) whose start row position is not page-aligned.
    #[error("segment at row position {start} is not page-aligned (page size {page_size})")]
    UnalignedSegment {
        /// Row position of the segment's first token.
        start: usize,
        /// The page size.
        page_size: u32,
    },
    /// A segment at an aligned row position whose first id is not the first token of its
    /// page (the ids start mid-page).
    #[error(
        "segment at row position {start} starts mid-page: id {token} is token {offset} of its page (page size {page_size}), not the first"
    )]
    SegmentStartsMidPage {
        /// Row position of the segment's first token.
        start: usize,
        /// The segment's first id.
        token: VirtualToken,
        /// Its offset in its page.
        offset: u32,
        /// The page size.
        page_size: u32,
    },
    /// Two segments of one call touch the same page (or are not ascending).
    #[error("segments touch one page twice: row positions {first:?} and {second:?}")]
    SegmentsShareAPage {
        /// The earlier segment's row range.
        first: std::ops::Range<usize>,
        /// The later segment's row range.
        second: std::ops::Range<usize>,
    },
    /// A kv-row free whose window cursor splits a page between its FULL-only and its
    /// two-sided half.
    #[error(
        "kv row split at cursor {cursor} is not page-aligned (page size {page_size}): a page would be freed by two calls"
    )]
    SplitPage {
        /// The cursor.
        cursor: usize,
        /// The page size.
        page_size: u32,
    },
    /// A row range outside the row, or `dead_lo` after the row's length.
    #[error("row range {start}..{end} is outside a row of {len} tokens")]
    RowRange {
        /// Start.
        start: usize,
        /// End.
        end: usize,
        /// Row length.
        len: usize,
    },
    /// An extend/decode request whose lengths or last token disagree.
    #[error("request {index}: {reason}")]
    BadRequest {
        /// Index of the request in the batch.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// `free_group_begin` while a group is open.
    #[error("a free group is already open: groups do not nest")]
    NestedFreeGroup,
    /// `free_group_end` with no group open.
    #[error("no free group is open")]
    NoFreeGroup,
    /// An SWA transfer whose source is not live on SWA or whose target is not an
    /// SWA tombstone with live FULL.
    #[error("cannot transfer SWA from {from} to {to}: {reason}")]
    BadTransfer {
        /// Source page.
        from: VirtualPage,
        /// Target page.
        to: VirtualPage,
        /// What is wrong.
        reason: &'static str,
    },
    /// A device read of the translation tables (`translate`) while the device mirror is
    /// behind the host tables: entries changed since the last
    /// [`crate::KvAllocator::upload_mirror`] (an allocation, a compaction or a free this
    /// step). Upload first (the step boundary does).
    #[error(
        "the device mirror is behind the host tables ({pending} entries not uploaded): call upload_mirror before translating"
    )]
    MirrorBehind {
        /// Mirror entries waiting for the upload.
        pending: usize,
    },
    /// A Mamba slot operation (a slot allocation or free, or a demand with
    /// `mamba_slots > 0`) on an allocator that has no slot pool (a FULL/SWA layout).
    #[error("this allocator has no Mamba slot pool: {op} needs one")]
    NoSlotPool {
        /// The operation refused.
        op: &'static str,
    },
    /// An SWA operation (an SWA-only free or an SWA transfer) on an allocator that has
    /// no SWA side (a FULL/Mamba layout).
    #[error("this allocator has no SWA side: {op} needs one")]
    NoSwaSide {
        /// The operation refused.
        op: &'static str,
    },
    /// A slot operation named a slot that cannot take it: outside the slot id space, the
    /// sink, not live, or named twice (in the call, or pending in the open free group).
    #[error("{op}: slot s{slot} {reason}")]
    BadSlot {
        /// The operation refused.
        op: &'static str,
        /// The slot.
        slot: u32,
        /// What is wrong.
        reason: SlotFault,
    },
    /// The host pool has fewer free units of a kind than asked for; nothing was taken.
    #[error("host pool: {requested} {kind} units asked for, {available} available")]
    HostFull {
        /// `full`, `swa` or `state` ([`crate::HostKind::as_str`]).
        kind: &'static str,
        /// Units asked for.
        requested: u64,
        /// Units an allocation could take.
        available: u64,
    },
    /// A host-pool free named a unit outside the pool, of a frame lent to another kind,
    /// not in use, or twice; nothing was freed.
    #[error("host pool: {kind} unit {index} of frame {frame} is not in use")]
    HostBadFree {
        /// The kind freed.
        kind: &'static str,
        /// The unit's frame.
        frame: u32,
        /// The unit's index in its frame.
        index: u32,
    },
    /// The device refused an op (a bug in the layout or a failing device).
    #[error("device: {0}")]
    Device(#[from] unikv_kernels::Error),
}

/// Why a slot was refused ([`Error::BadSlot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotFault {
    /// The id is past the slot id space.
    OutOfRange {
        /// Virtual slots of the id space (sink included).
        slots: u32,
    },
    /// Slot 0, the sink, is never allocated or freed.
    Sink,
    /// The slot is not allocated.
    NotLive,
    /// The slot is named twice in one call, or is already pending in the open free group.
    NamedTwice,
}

impl std::fmt::Display for SlotFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotFault::OutOfRange { slots } => {
                write!(f, "is outside the slot id space ({slots} virtual slots)")
            }
            SlotFault::Sink => f.write_str("is the sink"),
            SlotFault::NotLive => f.write_str("is not allocated"),
            SlotFault::NamedTwice => {
                f.write_str("is named twice (in the call or pending in the free group)")
            }
        }
    }
}

/// What the batch-size-1 floor charges ([`Error::BufferTooSmall`]): one request's window
/// of SWA with its FULL pages, and/or its Mamba states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bs1Floor {
    /// Tokens of one window (window + one page) on SWA and FULL; `None` without SWA.
    pub window_tokens: Option<usize>,
    /// Mamba state slots of one request (0 without a slot pool).
    pub slots: u32,
}

impl std::fmt::Display for Bs1Floor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.window_tokens, self.slots) {
            (Some(w), 0) => write!(f, "one window of {w} tokens of SWA and FULL"),
            (Some(w), s) => write!(
                f,
                "one window of {w} tokens of SWA and FULL and {s} Mamba state slots"
            ),
            (None, s) => write!(f, "{s} Mamba state slots and one FULL page"),
        }
    }
}

impl Error {
    /// A kernel-id overflow names `largest` as the buffer that fits (the least over the
    /// layout's sides, where the grid that overflowed knew only its own); any other error
    /// is unchanged.
    pub(crate) fn at_layout_limit(self, largest: u64) -> Error {
        match self {
            Error::KernelIdOverflow {
                side,
                pages,
                stride,
                largest_bytes,
            } => Error::KernelIdOverflow {
                side,
                pages,
                stride,
                largest_bytes: largest_bytes.min(largest),
            },
            other => other,
        }
    }
}

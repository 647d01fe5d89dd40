//! The crate's error type.

/// Everything the device layer can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The crate was built without the `cuda` feature.
    #[error(
        "unikv was built without the `cuda` feature; rebuild with `--features cuda` to use a GPU"
    )]
    NotCompiledWithCuda,
    /// No CUDA driver library could be loaded.
    #[error(
        "no CUDA driver found (libcuda could not be loaded); use the CPU backend or install an NVIDIA driver"
    )]
    NoCudaDriver,
    /// The CUDA driver is installed but there is no GPU with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoCudaDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver sees.
        count: usize,
    },
    /// A handle that this device did not hand out, or already released.
    #[error("unknown {kind} handle {id} on device {device}")]
    UnknownHandle {
        /// `bytes`, `table`, `host bytes` or `copy event`.
        kind: &'static str,
        /// The handle's number.
        id: u32,
        /// The device's name.
        device: String,
    },
    /// An access outside a buffer or table.
    #[error("{op}: range {start}..{end} is outside {kind} {id} of length {len}")]
    OutOfBounds {
        /// The op.
        op: &'static str,
        /// `bytes`, `table` or `host bytes` (or `host values`, the host slice of a
        /// table copy).
        kind: &'static str,
        /// The handle's number.
        id: u32,
        /// Start of the access.
        start: u64,
        /// End of the access.
        end: u64,
        /// Length of the buffer or table.
        len: u64,
    },
    /// Arguments that break an op's contract (`out_width < n`, a zero page size, an
    /// aliased output, ...).
    #[error("{op}: {reason}")]
    BadArguments {
        /// The op.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Two ranges of one [`Device::move_spans`](crate::Device::move_spans) call overlap
    /// where its contract forbids it: a destination overlaps another destination or a
    /// source (its own or another move's). Refused before anything is written.
    #[error(
        "move_spans on bytes {buf}: destination {dst:?} of move {dst_move} overlaps {other_kind} {other:?} of move {other_move}"
    )]
    OverlappingMoves {
        /// The buffer's handle number.
        buf: u32,
        /// Index (in the call's slice) of the move whose destination overlaps.
        dst_move: usize,
        /// That destination's byte range.
        dst: std::ops::Range<u64>,
        /// Index of the move the other range belongs to (may be `dst_move`).
        other_move: usize,
        /// `source` or `destination`.
        other_kind: &'static str,
        /// The other range.
        other: std::ops::Range<u64>,
    },
    /// Two copies of one host-tier copy call
    /// ([`Device::copy_device_to_host`](crate::Device::copy_device_to_host),
    /// [`Device::copy_host_to_device`](crate::Device::copy_host_to_device)) write
    /// overlapping ranges of the destination buffer, so the outcome would depend on the
    /// order they ran. Refused before anything is issued.
    #[error(
        "{op}: destination {dst:?} of copy {copy} overlaps destination {other:?} of copy {other_copy} in destination buffer {id}"
    )]
    OverlappingCopies {
        /// The op (its name says the direction: the destination is host bytes for
        /// `copy_device_to_host`, bytes for `copy_host_to_device`).
        op: &'static str,
        /// The destination's handle number.
        id: u32,
        /// Index (in the call's slice) of the copy whose destination overlaps.
        copy: u32,
        /// That destination's byte range.
        dst: std::ops::Range<u64>,
        /// Index of the copy it overlaps.
        other_copy: u32,
        /// That copy's destination range.
        other: std::ops::Range<u64>,
    },
    /// The device could not allocate a buffer or table of the requested size.
    #[error("{device}: cannot allocate {bytes} bytes")]
    OutOfMemory {
        /// The device's name.
        device: String,
        /// The size asked for.
        bytes: u64,
    },
    /// NVRTC (the CUDA run-time compiler) could not be loaded.
    #[error(
        "libnvrtc could not be loaded; install the CUDA NVRTC library (e.g. the `nvidia-cuda-nvrtc-cu12` wheel) and put it on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// A kernel source did not compile with NVRTC.
    #[error("NVRTC could not compile {file}: {log}")]
    KernelCompile {
        /// The `.cu` file.
        file: &'static str,
        /// The compiler's log.
        log: String,
    },
    /// A [`FaultInjector`](crate::FaultInjector) refused the op (tests); nothing was
    /// issued.
    #[error("injected fault: {op} (op {index}) at {location}")]
    InjectedFault {
        /// The op refused.
        op: &'static str,
        /// Its index among the ops the injector saw.
        index: u64,
        /// Where it was called from.
        location: &'static std::panic::Location<'static>,
    },
    /// An op whose argument list is per-step data (scatter, upload, copy of table spans,
    /// fill, move) was issued while
    /// [`CudaDevice::capture`](crate::CudaDevice::capture) records a graph: its list
    /// changes every step, so a replayed graph would reuse a stale one. So was a
    /// host-tier copy or [`Device::record_copy_event`](crate::Device::record_copy_event):
    /// their completion is tracked by events recorded per call, which a replay would not
    /// record again. Refused before anything was issued: issue them eagerly, before the
    /// replay that reads what they wrote.
    #[error(
        "{op} cannot be captured into a CUDA graph: it is issued per call (a list of per-step data, a host-tier copy or its event); capture the translations and gathers, and issue the rest eagerly before the replay"
    )]
    NotCapturable {
        /// The op refused.
        op: &'static str,
    },
    /// The backend keeps no memory a reader could read a table in
    /// ([`Device::export_table`](crate::Device::export_table) on a bookkeeping-only
    /// device).
    #[error("{device} keeps no table memory to export; build the cache on the CPU or CUDA backend")]
    NotExportable {
        /// The device's name.
        device: String,
    },
    /// The CUDA driver or NVRTC reported an error.
    #[error("CUDA: {0}")]
    Cuda(String),
}
